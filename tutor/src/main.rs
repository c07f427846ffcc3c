//! `tutor`: one binary for every role, so one image serves the whole system.

mod config;
mod eval;
mod export;
mod prepare;
mod report;
mod run;
mod serve;

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use tutor_proto::auth::{load_token, ClientAuth};

use crate::config::RunConfig;

#[derive(Parser)]
#[command(
    name = "tutor",
    version,
    about = "Train multi-turn software-engineering agents with turn-level DAgger.",
    long_about = "Train multi-turn software-engineering agents with turn-level DAgger.\n\n\
        `tutor run --config configs/quickstart.toml` runs everything on this machine: a learner, a \
        coordinator and rollout workers as separate processes talking gRPC on 127.0.0.1. The other \
        subcommands start one role each, for clusters.\n\n\
        Any config field can be overridden from the environment: TUTOR_<SECTION>__<FIELD>, e.g. \
        TUTOR_COORDINATOR__ITERATIONS=2."
)]
struct Cli {
    /// Log line format on stderr: `human`, or `json` (one object per line, for log
    /// collectors). `tutor run` passes it on to every process it starts.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Cmd,
}

/// `tutor learner --collective`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CollectiveArg {
    Cpu,
    Nccl,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Human,
    Json,
}

impl LogFormat {
    pub fn as_arg(self) -> &'static str {
        match self {
            LogFormat::Human => "human",
            LogFormat::Json => "json",
        }
    }
}

/// TLS files of one role (see `tutor_proto::tls`): PEM, one set per process.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// This process's certificate (PEM chain, leaf first). With --tls-key, servers
    /// serve TLS and clients present it (mutual TLS).
    #[arg(
        long,
        env = "TUTOR_TLS_CERT",
        value_name = "PATH",
        requires = "tls_key"
    )]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(
        long,
        env = "TUTOR_TLS_KEY",
        value_name = "PATH",
        requires = "tls_cert"
    )]
    tls_key: Option<PathBuf>,
    /// The CA (PEM) that signed the peers' certificates: clients verify servers with
    /// it, servers require client certificates signed by it. Endpoints then use https://.
    #[arg(long, env = "TUTOR_TLS_CA", value_name = "PATH")]
    tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    fn files(self) -> tutor_proto::tls::TlsFiles {
        tutor_proto::tls::TlsFiles {
            cert: self.tls_cert,
            key: self.tls_key,
            ca: self.tls_ca,
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a whole training run on this machine (learner + coordinator + workers).
    Run {
        /// Run config (TOML); see configs/quickstart.toml.
        #[arg(long, env = "TUTOR_CONFIG")]
        config: PathBuf,
    },
    /// Prepare a run directory (config copy, tasks, tokenizer, student config.json) and
    /// start nothing: for starting the roles one by one with `tutor learner`, `tutor
    /// coordinator` and `tutor worker`. Prints the paths they take as one JSON object.
    Prepare {
        /// Run config (TOML); see configs/quickstart.toml.
        #[arg(long, env = "TUTOR_CONFIG")]
        config: PathBuf,
    },
    /// Start the coordinator: leases episodes, stores trajectories, drives the learner.
    Coordinator {
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
        /// neither: no authentication).
        #[arg(long, value_name = "PATH")]
        auth_token_file: Option<PathBuf>,
        /// Serve Prometheus metrics at http://ADDR/metrics (off by default).
        #[arg(long, value_name = "ADDR")]
        metrics_listen: Option<SocketAddr>,
        /// Write the metrics endpoint's bound address here (use with port 0).
        #[arg(long, value_name = "PATH", requires = "metrics_listen")]
        metrics_addr_file: Option<PathBuf>,
        /// TLS towards the workers, and with --tls-ca towards an https:// learner.
        #[command(flatten)]
        tls: TlsArgs,
    },
    /// Start the learner: trains on batches from the coordinator, serves the weights.
    ///
    /// Data parallel: start K processes with the same --config, --world-size K,
    /// --coordinator and each its own --rank. Rank 0 serves the coordinator (its --listen,
    /// --model-dir, --out-dir), publishes its collective's address (CPU) or NCCL unique id
    /// at the coordinator and sends every batch to the other ranks; ranks 1..K-1 fetch it
    /// there, train their share of each batch in lockstep (gradients summed over the
    /// ranks) and exit when rank 0 ends the run. See docs/internals.md.
    #[command(verbatim_doc_comment)]
    Learner {
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
        /// neither: no authentication).
        #[arg(long, value_name = "PATH")]
        auth_token_file: Option<PathBuf>,
        #[command(flatten)]
        tls: TlsArgs,
    },
    /// Start a rollout worker: runs leased episodes in sandboxes with student and teacher.
    Worker {
        #[arg(long)]
        config: PathBuf,
        /// Coordinator gRPC endpoint, e.g. http://127.0.0.1:7300.
        #[arg(long, env = "TUTOR_COORDINATOR")]
        coordinator: String,
        /// Student model directory (config.json, tokenizer.json).
        #[arg(long)]
        model_dir: PathBuf,
        /// The worker's name; stable across restarts (containers are labelled with it, and
        /// a restarted worker removes what its predecessor left).
        #[arg(long, default_value = "worker")]
        name: String,
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
    },
    /// Evaluate one agent on a task file: every task in its own sandbox (local or
    /// Docker), every submission graded in a fresh one. `--agent oracle` (the gold patch)
    /// must resolve every valid task and `--agent noop` none: a check of tasks and
    /// sandboxes end to end.
    Eval(eval::EvalArgs),
    /// Serve a checkpoint over an OpenAI-compatible HTTP API (GET /v1/models, POST
    /// /v1/chat/completions with streaming, logprobs, stop strings, seeds), batching
    /// concurrent requests in one engine.
    Serve(serve::ServeArgs),
    /// Summarise a run directory: the iteration table, and per-episode outcomes.
    Report {
        /// A run directory written by `tutor run` (or a coordinator's --run-dir).
        run_dir: PathBuf,
        /// Also list every stored episode.
        #[arg(long)]
        episodes: bool,
    },
    /// Write a policy version of a run as a Hugging Face model directory (config.json,
    /// model.safetensors, tokenizer.json, tokenizer_config.json with the chat template):
    /// transformers' `from_pretrained`, vLLM and `tutor serve --model` load it, and a new
    /// run starts from it (or from the run directory itself) with `[model] init_from`.
    Export {
        /// A run directory written by `tutor run`.
        run_dir: PathBuf,
        /// The version to export (default: the latest published).
        #[arg(long)]
        version: Option<u64>,
        /// Output directory; must not exist or be empty.
        #[arg(long)]
        out: PathBuf,
    },
    /// Task files.
    Tasks {
        #[command(subcommand)]
        command: TasksCmd,
    },
}

#[derive(Subcommand)]
enum TasksCmd {
    /// Generate toy Python repositories with one planted bug each (SWE-bench-style JSONL).
    Toy {
        /// Number of tasks.
        #[arg(long, default_value_t = 40)]
        n: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Output JSONL (the training part when --heldout-out is given).
        #[arg(long)]
        out: PathBuf,
        /// Also split off held-out tasks into this file (no task on both sides).
        #[arg(long)]
        heldout_out: Option<PathBuf>,
        #[arg(long, default_value_t = 0.2)]
        heldout_fraction: f64,
    },
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colours only on a terminal: log files (the roles `tutor run` starts write to
    // run/logs/) stay plain text that grep and people can read.
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => fmt.init(),
        LogFormat::Json => fmt.json().init(),
    }
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutdown signal received");
}

fn load_proto_tasks(path: &std::path::Path) -> Result<Vec<tutor_proto::Task>> {
    let tasks = tutor_rollout::tasks::load_tasks(path)?;
    Ok(tasks.iter().map(tutor_proto::Task::from).collect())
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    if let Err(e) = dispatch(cli).await {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

async fn dispatch(cli: Cli) -> Result<()> {
    match cli.command {
        Cmd::Run { config } => run::run(&config, cli.log_format).await,
        Cmd::Prepare { config } => {
            let (cfg, text) = RunConfig::load(&config)?;
            let p = prepare::prepare(&cfg, &text)?;
            let s = |p: &std::path::Path| p.display().to_string();
            let out = serde_json::json!({
                "run_dir": s(&p.dir),
                "config": s(&p.config_path),
                "model_dir": s(&p.model_dir),
                "train_tasks": s(&p.train_tasks),
                "heldout_tasks": s(&p.heldout_tasks),
                "learner_out_dir": s(&p.dir.join("learner")),
                "n_train": p.n_train,
                "n_heldout": p.n_heldout,
                "parameters": p.parameters,
            });
            println!("{out}");
            Ok(())
        }
        Cmd::Report { run_dir, episodes } => {
            // A report piped into `head` should end quietly, as other Unix tools do.
            // SAFETY: restoring the default disposition of SIGPIPE before any output.
            unsafe {
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            }
            report::report(&run_dir, episodes)
        }
        Cmd::Export {
            run_dir,
            version,
            out,
        } => {
            let e = export::export_version(&run_dir, version, &out)?;
            println!(
                "exported version {} of {} ({} parameters) to {}",
                e.version,
                run_dir.display(),
                e.parameters,
                e.out.display()
            );
            Ok(())
        }
        Cmd::Coordinator {
            config,
            run_dir,
            learner,
            train_tasks,
            heldout_tasks,
            listen,
            addr_file,
            auth_token_file,
            metrics_listen,
            metrics_addr_file,
            tls,
        } => {
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
                },
                shutdown_signal(),
            )
            .await
        }
        Cmd::Learner {
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
            tls,
        } => {
            let (mut cfg, _) = RunConfig::load(&config)?;
            if cfg.learner.device.trim() == "cuda" {
                cfg.learner.device = format!("cuda:{gpu}");
            }
            let auth_token = load_token(auth_token_file.as_deref())?;
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
                .then(|| -> Result<tutor_learner::group::GroupOptions> {
                    Ok(tutor_learner::group::GroupOptions {
                        rank,
                        world_size,
                        collective: match collective {
                            Some(CollectiveArg::Cpu) => tutor_learner::CollectiveChoice::Cpu,
                            Some(CollectiveArg::Nccl) => tutor_learner::CollectiveChoice::Nccl,
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
                .then(|| -> Result<tutor_learner::group::GroupOptions> {
                    let Some(coordinator) = coordinator.clone() else {
                        anyhow::bail!(
                            "[learner] weight_receivers = {receivers} in {} needs the \
                             coordinator's endpoint for the rendezvous: pass --coordinator URL",
                            config.display()
                        );
                    };
                    let b = tutor_learner::group::GroupOptions {
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
                        collective_timeout: tutor_learner::broadcast::RECEIVE_TIMEOUT,
                        group: tutor_learner::broadcast::GROUP.into(),
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
                },
                shutdown_signal(),
            )
            .await
        }
        Cmd::Worker {
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
        } => {
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
            let broadcast = if cfg.worker.weights_from
                == tutor_rollout::worker::WeightsFrom::Broadcast
            {
                let rank = match weights_rank {
                    Some(r) if r >= 1 => r,
                    _ => anyhow::bail!(
                        "[worker] weights_from = \"broadcast\" in {} needs --weights-rank R \
                         (1..N, a different one per worker, N = [learner] weight_receivers)",
                        config.display()
                    ),
                };
                let inbox = tutor_rollout::student::BroadcastInbox::new(
                    std::time::Duration::from_secs_f64(cfg.worker.broadcast_wait_s),
                );
                let sink = inbox.clone();
                tutor_learner::broadcast::spawn_receiver(
                    tutor_learner::group::GroupOptions {
                        rank,
                        // Both come from the rendezvous learner rank 0 publishes.
                        world_size: rank + 1,
                        collective: tutor_learner::CollectiveChoice::Cpu,
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
                        collective_timeout: tutor_learner::broadcast::RECEIVE_TIMEOUT,
                        group: tutor_learner::broadcast::GROUP.into(),
                    },
                    tokio::runtime::Handle::current(),
                    cache_dir.join("broadcast"),
                    move |e| match e {
                        tutor_learner::broadcast::ReceiverEvent::Arrived(a) => {
                            sink.arrived(a.version, a.sha256, a.path)
                        }
                        tutor_learner::broadcast::ReceiverEvent::Joined { .. } => {
                            sink.set_in_group(true)
                        }
                        tutor_learner::broadcast::ReceiverEvent::Left => sink.set_in_group(false),
                    },
                )?;
                Some(inbox)
            } else {
                None
            };
            tutor_rollout::worker::run_worker(
                tutor_rollout::worker::WorkerOptions {
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
        Cmd::Eval(args) => eval::eval(args).await,
        Cmd::Serve(args) => serve::serve(args, shutdown_signal()).await,
        Cmd::Tasks {
            command:
                TasksCmd::Toy {
                    n,
                    seed,
                    out,
                    heldout_out,
                    heldout_fraction,
                },
        } => {
            if n == 0 {
                anyhow::bail!("--n must be at least 1");
            }
            if !(0.0..1.0).contains(&heldout_fraction) {
                anyhow::bail!("--heldout-fraction must lie in [0, 1)");
            }
            let tasks = tutor_rollout::toy::generate(n, seed);
            match heldout_out {
                Some(h) => {
                    let (train, heldout) = tutor_rollout::toy::split(tasks, heldout_fraction);
                    tutor_rollout::tasks::write_tasks(&out, &train)
                        .with_context(|| format!("writing {}", out.display()))?;
                    tutor_rollout::tasks::write_tasks(&h, &heldout)
                        .with_context(|| format!("writing {}", h.display()))?;
                    println!(
                        "{} training tasks → {}, {} held-out → {}",
                        train.len(),
                        out.display(),
                        heldout.len(),
                        h.display()
                    );
                }
                None => {
                    tutor_rollout::tasks::write_tasks(&out, &tasks)
                        .with_context(|| format!("writing {}", out.display()))?;
                    println!("{} tasks → {}", tasks.len(), out.display());
                }
            }
            Ok(())
        }
    }
}
