//! `tutor`: one binary for every role, so one image serves the whole system. This file
//! parses the command line and hands each subcommand to its module (`roles/` for the
//! long-running services).

mod config;
mod experiment;
mod export;
mod logging;
mod plan;
mod plots;
mod prepare;
mod report;
mod roles;
mod run;
mod tasks;

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::{Parser, Subcommand};

use crate::logging::{init_logging, LogFormat};

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
        /// Prepare at exactly this directory instead of a new `NAME-TIMESTAMP` under
        /// `[run] out_dir` (containers and pods, whose roles find the run at a fixed path).
        /// Idempotent: a directory already prepared from the same config is reused as it
        /// is; one prepared from another config is refused.
        #[arg(long, env = "TUTOR_RUN_DIR")]
        run_dir: Option<PathBuf>,
    },
    /// Start the coordinator: leases episodes, stores trajectories, drives the learner.
    Coordinator(roles::coordinator::CoordinatorArgs),
    /// Start the learner: trains on batches from the coordinator, serves the weights.
    ///
    /// Data parallel: start K processes with the same --config, --world-size K,
    /// --coordinator and each its own --rank. Rank 0 serves the coordinator (its --listen,
    /// --model-dir, --out-dir), publishes its collective's address (CPU) or NCCL unique id
    /// at the coordinator and sends every batch to the other ranks; ranks 1..K-1 fetch it
    /// there, train their share of each batch in lockstep (gradients summed over the
    /// ranks) and exit when rank 0 ends the run. See docs/internals.md.
    #[command(verbatim_doc_comment)]
    Learner(roles::learner::LearnerArgs),
    /// Start a rollout worker: runs leased episodes in sandboxes with student and teacher.
    Worker(roles::worker::WorkerArgs),
    /// Evaluate one agent on a task file: every task in its own sandbox (local or
    /// Docker), every submission graded in a fresh one. `--agent oracle` (the gold patch)
    /// must resolve every valid task and `--agent noop` none: a check of tasks and
    /// sandboxes end to end.
    Eval(roles::eval::EvalArgs),
    /// What the run's learner needs on each rank before it starts: memory of the weights,
    /// gradients, fp32 masters, AdamW moments, activations (with and without
    /// checkpoint_activations) and logits under each sharding mode, the largest pass that
    /// fits, and FLOPs per pass and step. Exits 1 when the run as configured cannot fit
    /// (the learner refuses it at start too).
    Plan(plan::PlanArgs),
    /// Serve a checkpoint over an OpenAI-compatible HTTP API (GET /v1/models, POST
    /// /v1/chat/completions with streaming, logprobs, stop strings, seeds), batching
    /// concurrent requests in one engine.
    Serve(roles::serve::ServeArgs),
    /// Summarise a run or experiment directory: the iteration table (an experiment's:
    /// final held-out solve rate, teacher labels and wall time per arm), and PNG plots in
    /// DIR/plots/ (held-out solve rate, training loss, student-teacher disagreement; an
    /// experiment's with one curve per arm, mean and spread over seeds). The plots' text
    /// needs a TrueType font: DejaVu Sans (package fonts-dejavu-core, which `make setup`
    /// installs), or the file TUTOR_PLOT_FONT names.
    Report {
        /// A run directory written by `tutor run` (or a coordinator's --run-dir), or an
        /// experiment directory written by `tutor experiment` (it holds results.json).
        run_dir: PathBuf,
        /// Also list every stored episode.
        #[arg(long)]
        episodes: bool,
        /// Print one episode's conversation as the model saw it (decoded with the run's
        /// tokenizer): every context message, the executed action, and the other side's
        /// proposal where student and teacher disagreed. Episode ids as `--episodes`
        /// lists them (e.g. `it003-eval0002-g0a0`).
        #[arg(long, value_name = "EPISODE_ID")]
        transcript: Option<String>,
        /// Write the DAgger examples of every stored episode (training and held-out: the
        /// teacher labels every visited state) as JSON lines `{episode_id, turn_index,
        /// tokens, loss_mask}` to this file, for training or probing a model elsewhere.
        #[arg(long, value_name = "FILE")]
        dump_examples: Option<PathBuf>,
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
    /// Run an experiment: every [[arm]] of an experiment file under every seed, one
    /// `tutor run` after the other, then the results table (results.json, RESULTS.md).
    /// See docs/experiments.md and configs/experiments/.
    Experiment(experiment::ExperimentArgs),
    /// Task files.
    Tasks {
        #[command(subcommand)]
        command: TasksCmd,
    },
    /// Print the workers' token derived from the run's token (--auth-token-file, else
    /// TUTOR_AUTH_TOKEN), for the workers' Secret: it reaches Rollout, the rendezvous
    /// and the weights, but not Control (shutdown) or the learner's training.
    WorkerToken {
        /// File holding the run's token.
        #[arg(long, value_name = "PATH")]
        auth_token_file: Option<PathBuf>,
    },
    /// Print the learner ranks' token derived from the run's token (--auth-token-file,
    /// else TUTOR_AUTH_TOKEN), for the learner's Secret: it reaches the learner's own
    /// services and the coordinator's rendezvous, but not Control (shutdown) or Rollout.
    /// The coordinator calls the learner with it.
    LearnerToken {
        /// File holding the run's token.
        #[arg(long, value_name = "PATH")]
        auth_token_file: Option<PathBuf>,
    },
}

/// Prints `role`'s token derived from the run's token (`tutor worker-token`,
/// `tutor learner-token`).
fn print_role_token(auth_token_file: Option<&Path>, role: tutor_proto::auth::Role) -> Result<()> {
    use tutor_proto::auth::Role;
    let token = tutor_proto::auth::load_token(auth_token_file)?.ok_or_else(|| {
        anyhow::anyhow!("no run token: give --auth-token-file or TUTOR_AUTH_TOKEN")
    })?;
    if token.role() != Role::Operator {
        anyhow::bail!(
            "that is already a {} token: give the run's token",
            token.role().as_str()
        );
    }
    println!("{}", token.derive(role).expose());
    Ok(())
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
        Cmd::Prepare { config, run_dir } => prepare::prepare_and_print(&config, run_dir.as_deref()),
        Cmd::Report {
            run_dir,
            episodes,
            transcript,
            dump_examples,
        } => {
            // A report piped into `head` should end quietly, as other Unix tools do.
            // SAFETY: restoring the default disposition of SIGPIPE before any output.
            unsafe {
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            }
            match (transcript, dump_examples) {
                (Some(id), _) => report::transcript(&run_dir, &id),
                (None, Some(out)) => report::dump_examples(&run_dir, &out),
                (None, None) => report::report(&run_dir, episodes),
            }
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
        Cmd::WorkerToken { auth_token_file } => {
            print_role_token(auth_token_file.as_deref(), tutor_proto::auth::Role::Worker)
        }
        Cmd::LearnerToken { auth_token_file } => {
            print_role_token(auth_token_file.as_deref(), tutor_proto::auth::Role::Learner)
        }
        Cmd::Experiment(args) => experiment::run(args, cli.log_format).await,
        Cmd::Coordinator(args) => roles::coordinator::run(args).await,
        Cmd::Learner(args) => roles::learner::run(args).await,
        Cmd::Worker(args) => roles::worker::run(args).await,
        Cmd::Eval(args) => roles::eval::eval(args).await,
        Cmd::Plan(args) => plan::run(args),
        Cmd::Serve(args) => roles::serve::serve(args, roles::shutdown_signal()).await,
        Cmd::Tasks {
            command:
                TasksCmd::Toy {
                    n,
                    seed,
                    out,
                    heldout_out,
                    heldout_fraction,
                },
        } => tasks::toy(n, seed, &out, heldout_out.as_deref(), heldout_fraction),
    }
}
