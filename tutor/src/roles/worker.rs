//! `tutor worker`: one rollout worker started from the command line, with its weights
//! receiver when `[worker] weights_from = "broadcast"`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use tutor_proto::auth::{load_token, ClientAuth};

use super::{shutdown_signal, TlsArgs};
use crate::config::RunConfig;

/// The flags of `tutor worker`.
#[derive(clap::Args)]
pub struct WorkerArgs {
    #[arg(long)]
    config: PathBuf,
    /// Coordinator gRPC endpoint, e.g. http://127.0.0.1:7300.
    #[arg(long, env = "TUTOR_COORDINATOR")]
    coordinator: String,
    /// Student model directory (config.json, tokenizer.json).
    #[arg(long)]
    model_dir: PathBuf,
    /// The worker's name; stable across restarts (containers are labelled with it, and
    /// a restarted worker removes what its predecessor left). Default: the host name,
    /// which is the pod's name in a Kubernetes StatefulSet and the container's ID under
    /// docker-compose, both kept across restarts. Two workers on one host need two names.
    #[arg(long, env = "TUTOR_WORKER_NAME")]
    name: Option<String>,
    /// The run this worker belongs to (a container label).
    #[arg(long, env = "TUTOR_RUN", default_value = "tutor")]
    run: String,
    /// Where downloaded weights are staged.
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Docker sandboxes: keep N started containers per image ready ahead of demand
    /// (tools and shell in place; an episode only copies its task in). Overrides
    /// `[worker] warm_pool`; 0 creates every container on demand. Pooled containers
    /// carry the run and worker labels and are removed when the worker stops.
    #[arg(long, value_name = "N")]
    warm_pool: Option<u32>,
    /// `[worker] weights_from = "broadcast"`: this worker's rank (1..N) among the
    /// `[learner] weight_receivers` that learner rank 0 pushes versions to.
    #[arg(long, env = "TUTOR_WORKER_WEIGHTS_RANK")]
    weights_rank: Option<usize>,
    /// File holding the shared token sent to the coordinator and the learner (else
    /// TUTOR_AUTH_TOKEN).
    #[arg(long, value_name = "PATH")]
    auth_token_file: Option<PathBuf>,
    /// TLS towards the coordinator and the learner (--tls-ca required; --tls-cert
    /// and --tls-key when the servers require client certificates).
    #[command(flatten)]
    tls: TlsArgs,
}

/// Runs the role until it ends or a shutdown signal arrives.
pub async fn run(args: WorkerArgs) -> Result<()> {
    let WorkerArgs {
        config,
        coordinator,
        model_dir,
        name,
        run,
        cache_dir,
        warm_pool,
        weights_rank,
        auth_token_file,
        tls,
    } = args;
    let name = name.unwrap_or_else(host_name);
    let (mut cfg, _) = RunConfig::load(&config)?;
    if let Some(n) = warm_pool {
        cfg.worker.warm_pool = n;
    }
    let auth = ClientAuth::new(load_token(auth_token_file.as_deref())?.as_ref())
        .with_tls(tls.files().client()?);
    let cache_dir = match cache_dir {
        Some(d) => d,
        None => std::env::temp_dir().join(format!("tutor-weights-{}", std::process::id())),
    };
    let broadcast =
        if cfg.worker.weights_from == tutor_rollout_worker::worker::WeightsFrom::Broadcast {
            let rank = match weights_rank {
                Some(r) if r >= 1 => r,
                _ => anyhow::bail!(
                    "[worker] weights_from = \"broadcast\" in {} needs --weights-rank R \
                 (1..N, a different one per worker, N = [learner] weight_receivers)",
                    config.display()
                ),
            };
            let inbox = tutor_rollout_worker::student::BroadcastInbox::new(
                std::time::Duration::from_secs_f64(cfg.worker.broadcast_wait_s),
            );
            let sink = inbox.clone();
            tutor_collective::broadcast::spawn_receiver(
                tutor_collective::GroupOptions {
                    rank,
                    // Both come from the rendezvous learner rank 0 publishes.
                    world_size: rank + 1,
                    collective: tutor_collective::CollectiveChoice::Cpu,
                    coordinator: coordinator.clone(),
                    auth: auth.clone(),
                    collective_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                    collective_advertise: None,
                    // NCCL receives on the student's GPU.
                    gpu: match cfg.worker.student_device()? {
                        tch::Device::Cuda(n) => n,
                        _ => 0,
                    },
                    rendezvous_timeout: std::time::Duration::from_secs(60),
                    collective_timeout: tutor_collective::broadcast::RECEIVE_TIMEOUT,
                    group: tutor_collective::broadcast::GROUP.into(),
                },
                tokio::runtime::Handle::current(),
                move |e| match e {
                    tutor_collective::broadcast::ReceiverEvent::Arrived(a) => {
                        sink.arrived(a.version, a.sha256, a.bytes)
                    }
                    tutor_collective::broadcast::ReceiverEvent::Joined { .. } => {
                        sink.set_in_group(true)
                    }
                    tutor_collective::broadcast::ReceiverEvent::Left => sink.set_in_group(false),
                },
            )?;
            Some(inbox)
        } else {
            None
        };
    tutor_rollout_worker::worker::run_worker(
        tutor_rollout_worker::worker::WorkerOptions {
            name,
            run,
            coordinator,
            model_dir,
            cache_dir,
            config: cfg.worker,
            auth,
            broadcast,
        },
        shutdown_signal(),
    )
    .await
}

/// This host's name (Linux), else "worker".
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "worker".into())
}
