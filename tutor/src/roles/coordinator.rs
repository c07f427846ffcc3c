//! `tutor coordinator`: the coordinator role started from the command line (tasks and
//! config loaded here, everything else in `tutor_coordinator::serve`).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use tutor_proto::auth::load_token;

use super::{load_proto_tasks, shutdown_signal, TlsArgs};
use crate::config::RunConfig;

/// The flags of `tutor coordinator`.
#[derive(clap::Args)]
pub struct CoordinatorArgs {
    #[arg(long)]
    config: PathBuf,
    /// Run directory: trajectories, metrics.jsonl and the checkpoint go here.
    #[arg(long)]
    run_dir: PathBuf,
    /// Learner gRPC endpoint, e.g. http://127.0.0.1:7301.
    #[arg(long, env = "TUTOR_LEARNER")]
    learner: String,
    /// Training tasks (JSONL).
    #[arg(long)]
    train_tasks: PathBuf,
    /// Held-out tasks for student-only evaluation (JSONL).
    #[arg(long)]
    heldout_tasks: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1:7300")]
    listen: SocketAddr,
    /// Write the bound address here once listening (use with port 0).
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// File holding the shared token every gRPC call must carry (else TUTOR_AUTH_TOKEN;
    /// neither: no authentication, allowed only on a loopback --listen or with --insecure).
    #[arg(long, value_name = "PATH")]
    auth_token_file: Option<PathBuf>,
    /// Listen on a non-loopback address without a token or client certificates: anyone
    /// who can reach the port may stream episodes and shut the run down. Refused without
    /// this flag.
    #[arg(long)]
    insecure: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics (off by default).
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
    /// Write the metrics endpoint's bound address here (use with port 0).
    #[arg(long, value_name = "PATH", requires = "metrics_listen")]
    metrics_addr_file: Option<PathBuf>,
    /// TLS towards the workers, and with --tls-ca towards an https:// learner.
    #[command(flatten)]
    tls: TlsArgs,
}

/// Runs the role until it ends or a shutdown signal arrives.
pub async fn run(args: CoordinatorArgs) -> Result<()> {
    let CoordinatorArgs {
        config,
        run_dir,
        learner,
        train_tasks,
        heldout_tasks,
        listen,
        addr_file,
        auth_token_file,
        insecure,
        metrics_listen,
        metrics_addr_file,
        tls,
    } = args;
    let (cfg, _) = RunConfig::load(&config)?;
    let auth_token = load_token(auth_token_file.as_deref())?;
    let train = load_proto_tasks(&train_tasks)?;
    let heldout = match heldout_tasks {
        Some(p) => load_proto_tasks(&p)?,
        None => Vec::new(),
    };
    tutor_coordinator::serve(
        tutor_coordinator::ServeOptions {
            listen,
            run_dir,
            learner_endpoint: learner,
            config: cfg.coordinator,
            train_tasks: train,
            heldout_tasks: heldout,
            addr_file,
            auth_token,
            metrics_listen,
            metrics_addr_file,
            store: Default::default(),
            tls: tls.files(),
            insecure,
        },
        shutdown_signal(),
    )
    .await
}
