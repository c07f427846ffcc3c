//! `tutor learner`: one learner rank started from the command line. Rank 0 serves the
//! coordinator (`tutor_learner::serve`); ranks 1..K−1 follow it (`run_follower`). Builds
//! the learner group's and the weights broadcast's rendezvous options from flags and
//! `[learner]`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::ValueEnum;
use tutor_proto::auth::{load_token, ClientAuth};

use super::{shutdown_signal, TlsArgs};
use crate::config::RunConfig;

/// `tutor learner --collective`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CollectiveArg {
    Cpu,
    Nccl,
}

/// The flags of `tutor learner`.
#[derive(clap::Args)]
pub struct LearnerArgs {
    #[arg(long)]
    config: PathBuf,
    /// Student model directory: config.json (+ tokenizer.json, optional
    /// model.safetensors). Rank 0 only (the others get the model from rank 0).
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// Published versions and the checkpoint are written here. Rank 0 only.
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// The learner's gRPC address (rank 0; the other ranks serve nothing).
    #[arg(long, default_value = "127.0.0.1:7301")]
    listen: SocketAddr,
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// This process's rank in the data-parallel group, 0..world size-1.
    #[arg(long, env = "TUTOR_LEARNER_RANK", default_value_t = 0)]
    rank: usize,
    /// Learner processes in the group (default: [learner] world_size of the config,
    /// which defaults to 1: one learner, no group).
    #[arg(long, env = "TUTOR_LEARNER_WORLD_SIZE")]
    world_size: Option<usize>,
    /// How the ranks exchange gradients (default: [learner] collective, `cpu`).
    /// `nccl` needs a build with the `nccl` feature and one GPU per rank.
    #[arg(long, env = "TUTOR_LEARNER_COLLECTIVE", value_enum)]
    collective: Option<CollectiveArg>,
    /// The coordinator's gRPC endpoint, where rank 0 publishes the rendezvous and the
    /// other ranks fetch it (needed when the world size is above 1).
    #[arg(long, env = "TUTOR_COORDINATOR")]
    coordinator: Option<String>,
    /// CPU collective, rank 0: the address it listens on for the other ranks (port
    /// 0: any free port).
    #[arg(
        long,
        env = "TUTOR_LEARNER_COLLECTIVE_LISTEN",
        default_value = "127.0.0.1:0"
    )]
    collective_listen: SocketAddr,
    /// CPU collective, rank 0: the host:port the other ranks connect to (default: the
    /// bound address; needed when --collective-listen is 0.0.0.0).
    #[arg(long, env = "TUTOR_LEARNER_COLLECTIVE_ADVERTISE")]
    collective_advertise: Option<String>,
    /// This rank's CUDA device: the one NCCL uses, and the one `[learner] device =
    /// "cuda"` trains on.
    #[arg(long, env = "TUTOR_LEARNER_GPU", default_value_t = 0)]
    gpu: usize,
    /// File holding the shared token every gRPC call must carry (else TUTOR_AUTH_TOKEN;
    /// neither: no authentication, allowed only on a loopback --listen or with --insecure).
    #[arg(long, value_name = "PATH")]
    auth_token_file: Option<PathBuf>,
    /// Listen on a non-loopback address without a token or client certificates: anyone
    /// who can reach the port may train the policy and download its weights. Refused
    /// without this flag.
    #[arg(long)]
    insecure: bool,
    #[command(flatten)]
    tls: TlsArgs,
}

/// Runs the role until it ends or a shutdown signal arrives.
pub async fn run(args: LearnerArgs) -> Result<()> {
    let LearnerArgs {
        config,
        model_dir,
        out_dir,
        listen,
        addr_file,
        rank,
        world_size,
        collective,
        coordinator,
        collective_listen,
        collective_advertise,
        gpu,
        auth_token_file,
        insecure,
        tls,
    } = args;
    let (mut cfg, _) = RunConfig::load(&config)?;
    if cfg.learner.device.trim() == "cuda" {
        cfg.learner.device = format!("cuda:{gpu}");
    }
    let auth_token = load_token(auth_token_file.as_deref())?;
    tutor_learner::service::refuse_worker_token(auth_token.as_ref())?;
    let world_size = world_size.unwrap_or(cfg.learner.world_size);
    if world_size == 0 {
        anyhow::bail!("--world-size must be at least 1");
    }
    if rank >= world_size {
        anyhow::bail!(
            "--rank {rank} is not below the world size {world_size} (--world-size or \
             [learner] world_size in {})",
            config.display()
        );
    }
    let tls = tls.files();
    // How this learner calls the coordinator (rendezvous of either group).
    let coordinator_auth = || -> Result<ClientAuth> {
        Ok(ClientAuth::new(auth_token.as_ref()).with_tls(match tls.ca {
            Some(_) => tls.client()?,
            None => None,
        }))
    };
    let group = (world_size > 1)
        .then(|| -> Result<tutor_collective::GroupOptions> {
            Ok(tutor_collective::GroupOptions {
                rank,
                world_size,
                collective: match collective {
                    Some(CollectiveArg::Cpu) => tutor_collective::CollectiveChoice::Cpu,
                    Some(CollectiveArg::Nccl) => tutor_collective::CollectiveChoice::Nccl,
                    None => cfg.learner.collective,
                },
                coordinator: coordinator.clone().unwrap_or_default(),
                auth: coordinator_auth()?,
                collective_listen,
                collective_advertise: collective_advertise.clone(),
                gpu,
                rendezvous_timeout: std::time::Duration::from_secs_f64(
                    cfg.learner.rendezvous_timeout_s,
                ),
                collective_timeout: std::time::Duration::from_secs_f64(
                    cfg.learner.collective_timeout_s,
                ),
                group: String::new(),
            })
        })
        .transpose()?;
    if let Some(g) = &group {
        g.validate()?;
    }
    // Rank 0 also pushes every version to `weight_receivers` workers.
    let receivers = cfg.learner.weight_receivers;
    let broadcast = (rank == 0 && receivers > 0)
        .then(|| -> Result<tutor_collective::GroupOptions> {
            let Some(coordinator) = coordinator.clone() else {
                anyhow::bail!(
                    "[learner] weight_receivers = {receivers} in {} needs the \
                     coordinator's endpoint for the rendezvous: pass --coordinator URL",
                    config.display()
                );
            };
            let b = tutor_collective::GroupOptions {
                rank: 0,
                world_size: receivers + 1,
                collective: cfg.learner.broadcast_collective,
                coordinator,
                auth: coordinator_auth()?,
                // Its own port beside the learner group's, on the same interface.
                collective_listen: SocketAddr::new(collective_listen.ip(), 0),
                collective_advertise: collective_advertise.as_ref().map(|a| {
                    let host = a.rsplit_once(':').map_or(a.as_str(), |(h, _)| h);
                    format!("{host}:0")
                }),
                gpu,
                rendezvous_timeout: std::time::Duration::from_secs_f64(
                    cfg.learner.rendezvous_timeout_s,
                ),
                collective_timeout: tutor_collective::broadcast::RECEIVE_TIMEOUT,
                group: tutor_collective::broadcast::GROUP.into(),
            };
            b.validate()?;
            Ok(b)
        })
        .transpose()?;
    if rank > 0 {
        let group = group.expect("rank > 0 implies a group");
        return tokio::select! {
            r = tutor_learner::group::run_follower(group) => r,
            _ = shutdown_signal() => Ok(()),
        };
    }
    let (Some(model_dir), Some(out_dir)) = (model_dir, out_dir) else {
        anyhow::bail!("the learner (rank 0) needs --model-dir and --out-dir");
    };
    // A run that cannot fit is refused before anything loads (`tutor plan` shows why).
    {
        let mut planned = cfg.clone();
        planned.learner.world_size = world_size;
        let on_gpu = planned.learner.device(0).is_ok_and(|d| d.is_cuda());
        let model_config = model_dir.join("config.json");
        let model = tutor_policy::ModelConfig::load(&model_config)
            .with_context(|| format!("reading {}", model_config.display()))?;
        let plan = crate::plan::run_plan(&planned, model.clone(), (!on_gpu).then_some(0.0))?;
        if let Some(why) = crate::plan::memory_refusal(&plan) {
            anyhow::bail!(
                "{}: {why} (`tutor plan --config {}` shows the arithmetic)",
                config.display(),
                config.display()
            );
        }
    }
    // Rank 0 loads every version into the student engines (`[learner] engines`).
    let on_versions = engine_push(&cfg, &model_dir, &out_dir)?;
    tutor_learner::serve(
        tutor_learner::ServeOptions {
            listen,
            model_dir,
            out_dir,
            config: cfg.learner,
            addr_file,
            auth_token,
            tls,
            group,
            broadcast,
            insecure,
            on_versions,
        },
        shutdown_signal(),
    )
    .await
}

/// The hook that loads every published version into the student engines of
/// `[learner] engines` (see `RunConfig::learner_engines`); `None` when there are none.
fn engine_push(
    cfg: &RunConfig,
    model_dir: &std::path::Path,
    out_dir: &std::path::Path,
) -> Result<Option<tutor_learner::service::VersionsHook>> {
    use tutor_rollout_worker::student_engine::{push::EnginePush, RemoteEngine};
    let engines = cfg.learner_engines()?;
    if engines.is_empty() {
        return Ok(None);
    }
    let model_config = model_dir.join("config.json");
    let vocab = tutor_policy::ModelConfig::load(&model_config)
        .with_context(|| format!("reading {}", model_config.display()))?
        .vocab_size;
    let clients = engines
        .iter()
        .map(|c| {
            let client = RemoteEngine::new(c, vocab)?;
            Ok(client.with_group_listen_field("learner.engine_group_listen"))
        })
        .collect::<Result<Vec<_>>>()?;
    let student = &cfg.worker.student;
    let weights_dir = student
        .weights_dir
        .clone()
        .unwrap_or_else(|| out_dir.join("engine-weights"));
    let engine_dir = student
        .engine_weights_dir
        .clone()
        .unwrap_or_else(|| weights_dir.clone());
    let push = EnginePush::new(clients, model_dir.to_path_buf(), weights_dir, engine_dir)?;
    Ok(Some(Box::new(move |versions| {
        tokio::spawn(push.run(versions));
    })))
}
