//! Rollout throughput: N workers' episodes at once against one student engine, as a
//! worker process with N episode slots runs them: Tutor's in-process engine
//! (`tutor_policy::engine`, continuous batching), and `tutor serve` as the external engine
//! (`[worker.student] kind = "engine"`: token ids over HTTP, the version checked on every
//! turn), started here from the release binary with the same limits. Real episodes: toy tasks in local sandboxes, the student acting on
//! every turn (β = 0, unbiased sampling, as DAPO leases it), each submission graded.
//!
//! `cargo build --release -p tutor && cargo run --release -p tutor-bench --bin rollouts
//! [-- --workers 1,2,4,8 --episodes 2 --turns 8 --reply 48 --hidden 256 --layers 4
//! --engine both]`
//!
//! Reported per N: episodes, turns and generated tokens, wall seconds, turns/s and
//! generated tokens/s, the speed-up over N = 1, and the mean episode's seconds. The random
//! student rarely writes a valid command, so its turns are mostly generation and a format
//! error: the figure bounds what the engine delivers to N concurrent episodes.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Parser;
use tutor_policy::{ChatTokenizer, ModelConfig};
use tutor_proto::{episode_event, EpisodeLease, EpisodePurpose, PolicyVersion, SamplingParams};
use tutor_rollout_worker::episode::{
    run_episode, EpisodeEnv, TeacherSource, DEFAULT_SYSTEM_PROMPT,
};
use tutor_rollout_worker::grade::GradingMode;
use tutor_rollout_worker::sandbox::SandboxFactory;
use tutor_rollout_worker::student::StudentHost;
use tutor_rollout_worker::student_engine::{EngineApi, StudentConfig, StudentKind};
use tutor_rollout_worker::worker::WorkerConfig;

#[derive(Parser, Debug)]
#[command(about = "Turns/s and generated tokens/s of N concurrent episodes on one student engine")]
struct Args {
    /// Concurrent episodes (worker slots) to measure, comma-separated.
    #[arg(long, default_value = "1,2,4,8", value_delimiter = ',')]
    workers: Vec<usize>,
    /// Episodes each slot runs, one after the other.
    #[arg(long, default_value_t = 2)]
    episodes: usize,
    /// Turns per episode (the student rarely submits, so most run them all).
    #[arg(long, default_value_t = 8)]
    turns: u32,
    /// Most tokens of each student reply.
    #[arg(long, default_value_t = 48)]
    reply: u32,
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 1024)]
    vocab: usize,
    /// The engine's most rows decoded together (`[worker] student_max_batch`).
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// libtorch threads of the engine (0: libtorch's default).
    #[arg(long, default_value_t = 0)]
    threads: u32,
    /// Which student engines to measure: `local` (in-process), `serve` (`tutor serve` as
    /// the external engine, SGLang's API), `vllm` (the same through vLLM's API: its
    /// `/v1/completions` and a `/weight_info` check before and after each turn), `apis`
    /// (serve and vllm) or `both` (local and serve).
    #[arg(long, default_value = "both")]
    engine: String,
    /// The tutor binary that serves (default: target/release/tutor of this checkout).
    #[arg(long)]
    tutor: Option<PathBuf>,
}

/// A `tutor serve` of the bench's model, killed on drop.
struct Served(std::process::Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `tutor serve` on `model` with the in-process engine's limits; its address.
fn serve(args: &Args, model: &Path) -> Result<(Served, String)> {
    let bin = args
        .tutor
        .clone()
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/tutor"));
    if !bin.exists() {
        anyhow::bail!(
            "{} does not exist: build it first (cargo build --release -p tutor) or pass --tutor",
            bin.display()
        );
    }
    // The worker stages versions in its cache's engine-weights/ (StudentHost::remote).
    let staging = model.join("engine-weights");
    std::fs::create_dir_all(&staging)?;
    let addr_file = model.join("serve-addr");
    let _ = std::fs::remove_file(&addr_file);
    let defaults = WorkerConfig::default();
    let mut cmd = std::process::Command::new(&bin);
    cmd.arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--port", "0", "--device", "cpu", "--max-batch"])
        .arg(args.max_batch.to_string())
        .arg("--max-cached-tokens")
        .arg(defaults.student_cache_tokens.to_string())
        .arg("--prefix-cache-tokens")
        .arg(defaults.student_prefix_cache_tokens.to_string())
        .arg("--addr-file")
        .arg(&addr_file)
        .arg("--weights-root")
        .arg(&staging)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    if args.threads > 0 {
        cmd.env("OMP_NUM_THREADS", args.threads.to_string());
    }
    let mut served = Served(cmd.spawn()?);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !addr_file.exists() {
        if let Some(status) = served.0.try_wait()? {
            anyhow::bail!("tutor serve exited with {status}");
        }
        if Instant::now() > deadline {
            anyhow::bail!("tutor serve did not start within 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let addr = std::fs::read_to_string(&addr_file)?.trim().to_string();
    Ok((served, addr))
}

/// One configuration's totals.
struct Row {
    engine: &'static str,
    workers: usize,
    episodes: usize,
    turns: u64,
    tokens: u64,
    wall: f64,
    /// The episodes' own durations, added up.
    episode_seconds: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if std::env::var_os("TUTOR_SANDBOX_PYTHON").is_none() {
        let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-sandbox/bin/python");
        if venv.exists() {
            std::env::set_var("TUTOR_SANDBOX_PYTHON", venv);
        }
    }
    let most = args.workers.iter().copied().max().unwrap_or(1);
    let tasks = tutor_rollout_worker::toy::generate(most * args.episodes, 7);
    let dir = tempfile::tempdir()?;
    let mut corpus = vec![DEFAULT_SYSTEM_PROMPT.to_string()];
    for t in &tasks {
        corpus.push(t.problem_statement.clone());
        corpus.push(t.patch.clone());
    }
    let tokenizer = ChatTokenizer::train(&corpus, args.vocab)?;
    tokenizer.save(&dir.path().join("tokenizer.json"))?;
    let mut mc = ModelConfig::tiny(tokenizer.vocab_size());
    mc.hidden_size = args.hidden;
    mc.intermediate_size = 4 * args.hidden;
    mc.num_hidden_layers = args.layers;
    mc.num_attention_heads = (args.hidden / 64).max(1);
    mc.num_key_value_heads = mc.num_attention_heads;
    mc.head_dim = args.hidden / mc.num_attention_heads;
    mc.max_position_embeddings = 8192;
    mc.save(&dir.path().join("config.json"))?;
    // The weights `tutor serve` starts from and every engine runs (version 0).
    let policy = tutor_policy::Policy::new(mc.clone(), tch::Device::Cpu, 0);
    policy.save_weights(&dir.path().join("model.safetensors"))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let engines: &[&'static str] = match args.engine.as_str() {
        "local" => &["in-process"],
        "serve" => &["tutor serve"],
        "vllm" => &["tutor serve, vLLM's API"],
        "apis" => &["tutor serve", "tutor serve, vLLM's API"],
        "both" => &["in-process", "tutor serve"],
        other => anyhow::bail!("--engine {other:?}: expected local, serve, vllm, apis or both"),
    };
    println!(
        "student: {} parameters (hidden {}, {} layers, vocab {}); {} turns × ≤{} tokens per \
         episode, {} episodes per slot",
        mc.num_parameters(),
        args.hidden,
        args.layers,
        tokenizer.vocab_size(),
        args.turns,
        args.reply,
        args.episodes
    );
    let mut rows = Vec::new();
    for &kind in engines {
        for &n in &args.workers {
            // A fresh engine per configuration: nothing cached from the one before.
            let (student, _served) = if kind == "in-process" {
                let engine = tutor_policy::EngineConfig {
                    max_batch: args.max_batch,
                    torch_threads: args.threads,
                    ..WorkerConfig::default().student_engine()
                };
                let student = StudentHost::start(
                    dir.path(),
                    dir.path(),
                    tokenizer.clone(),
                    engine,
                    Default::default(),
                )?;
                (student, None)
            } else {
                let (served, addr) = serve(&args, dir.path())?;
                let config = StudentConfig {
                    kind: StudentKind::Engine,
                    api: if kind.contains("vLLM") {
                        EngineApi::Vllm
                    } else {
                        EngineApi::Sglang
                    },
                    base_url: format!("http://{addr}"),
                    ..Default::default()
                };
                let student = rt.block_on(StudentHost::remote(
                    dir.path(),
                    dir.path(),
                    &config,
                    Default::default(),
                ))?;
                (student, Some(served))
            };
            let weights = dir.path().join("version-0.safetensors");
            std::fs::copy(dir.path().join("model.safetensors"), &weights)?;
            rt.block_on(student.load_file(&weights, 0, "bench"))?;
            let row = run(&args, kind, n, &tasks, &tokenizer, student, dir.path())?;
            println!(
                "{kind}, {n} slot(s): {} episodes, {} turns, {} tokens in {:.1} s",
                row.episodes, row.turns, row.tokens, row.wall
            );
            rows.push(row);
        }
    }
    println!();
    println!("| engine | concurrent episodes | episodes | turns | generated tokens | wall s | turns/s | tokens/s | tokens/s vs 1 | mean episode s |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let base = rows
            .iter()
            .find(|b| b.workers == 1 && b.engine == r.engine)
            .map(|b| b.tokens as f64 / b.wall);
        let tps = r.tokens as f64 / r.wall;
        println!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.2} | {:.1} | {} | {:.1} |",
            r.engine,
            r.workers,
            r.episodes,
            r.turns,
            r.tokens,
            r.wall,
            r.turns as f64 / r.wall,
            tps,
            base.map_or("—".to_string(), |b| format!("{:.2}×", tps / b)),
            r.episode_seconds / r.episodes as f64
        );
    }
    Ok(())
}

/// `n` slots, each running `args.episodes` episodes one after the other, all on `student`.
fn run(
    args: &Args,
    engine: &'static str,
    n: usize,
    tasks: &[tutor_rollout_worker::tasks::TaskRecord],
    tokenizer: &ChatTokenizer,
    student: StudentHost,
    root: &Path,
) -> Result<Row> {
    let (tx, mut rx) = tokio::sync::mpsc::channel(65_536);
    let env = Arc::new(EpisodeEnv {
        worker_id: "bench".into(),
        tokenizer: Arc::new(tokenizer.clone()),
        student,
        events: tx,
        system_prompt: DEFAULT_SYSTEM_PROMPT.to_string(),
        sandboxes: SandboxFactory::Local {
            root: Some(root.to_path_buf()),
            owner: None,
        },
        grade_timeout: Duration::from_secs(120),
        grading: GradingMode::Strict,
        teacher: TeacherSource::Oracle,
        cancel: Arc::new(AtomicBool::new(false)),
    });
    let start = Instant::now();
    let mut slots = Vec::new();
    for slot in 0..n {
        let env = env.clone();
        let leases: Vec<EpisodeLease> = (0..args.episodes)
            .map(|k| {
                let i = slot * args.episodes + k;
                EpisodeLease {
                    episode_id: format!("it000-train{i:04}-g0a0"),
                    task: Some((&tasks[i]).into()),
                    beta: 0.0,
                    labels_unused: true,
                    sampling: Some(SamplingParams {
                        temperature: 1.0,
                        max_new_tokens: args.reply,
                        seed: i as u64,
                        unbiased: true,
                    }),
                    max_turns: args.turns,
                    command_timeout_ms: 30_000,
                    observation_max_chars: 1500,
                    purpose: EpisodePurpose::Train as i32,
                    seed: i as u64,
                    policy: Some(PolicyVersion {
                        version: 0,
                        ..Default::default()
                    }),
                    ..Default::default()
                }
            })
            .collect();
        slots.push(std::thread::spawn(move || {
            let mut seconds = 0.0;
            for lease in &leases {
                seconds += run_episode(&env, lease).duration_s;
            }
            seconds
        }));
    }
    let mut episode_seconds = 0.0;
    for s in slots {
        episode_seconds += s
            .join()
            .map_err(|_| anyhow::anyhow!("an episode thread panicked"))?;
    }
    let wall = start.elapsed().as_secs_f64();
    drop(env);
    let (mut turns, mut tokens) = (0u64, 0u64);
    while let Some(ev) = rx.blocking_recv() {
        if let Some(episode_event::Event::Turn(t)) = ev.event {
            turns += 1;
            tokens += t.student_tokens.len() as u64;
        }
    }
    Ok(Row {
        engine,
        workers: n,
        episodes: n * args.episodes,
        turns,
        tokens,
        wall,
        episode_seconds,
    })
}
