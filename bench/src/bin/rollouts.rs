//! Rollout throughput: N workers' episodes at once against one in-process student engine
//! (`tutor_policy::engine`, continuous batching), as a worker process with N episode
//! slots runs them. Real episodes: toy tasks in local sandboxes, the student acting on
//! every turn (β = 0, unbiased sampling, as DAPO leases it), each submission graded.
//!
//! `cargo run --release -p tutor-bench --bin rollouts [-- --workers 1,2,4,8
//! --episodes 2 --turns 8 --reply 48 --hidden 256 --layers 4]`
//!
//! Reported per N: episodes, turns and generated tokens, wall seconds, turns/s and
//! generated tokens/s, the speed-up over N = 1, and the mean episode's seconds. The random
//! student rarely writes a valid command, so its turns are mostly generation and a format
//! error: the figure bounds what the engine delivers to N concurrent episodes. The
//! external engine of issue 18 item 1 (`tutor serve` as the student) is not built yet, so
//! there is no second column.

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Parser;
use tutor_policy::{ChatTokenizer, ModelConfig};
use tutor_proto::{episode_event, EpisodeLease, EpisodePurpose, SamplingParams};
use tutor_rollout_worker::episode::{
    run_episode, EpisodeEnv, TeacherSource, DEFAULT_SYSTEM_PROMPT,
};
use tutor_rollout_worker::grade::GradingMode;
use tutor_rollout_worker::sandbox::SandboxFactory;
use tutor_rollout_worker::student::StudentHost;
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
}

/// One configuration's totals.
struct Row {
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
    for &n in &args.workers {
        // A fresh engine per configuration: nothing cached from the one before.
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
        let row = run(&args, n, &tasks, &tokenizer, student, dir.path())?;
        println!(
            "{n} slot(s): {} episodes, {} turns, {} tokens in {:.1} s",
            row.episodes, row.turns, row.tokens, row.wall
        );
        rows.push(row);
    }
    println!();
    println!("| concurrent episodes | episodes | turns | generated tokens | wall s | turns/s | tokens/s | tokens/s vs 1 | mean episode s |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let base = rows
        .iter()
        .find(|r| r.workers == 1)
        .map(|r| r.tokens as f64 / r.wall);
    for r in &rows {
        let tps = r.tokens as f64 / r.wall;
        println!(
            "| {} | {} | {} | {} | {:.1} | {:.2} | {:.1} | {} | {:.1} |",
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
        workers: n,
        episodes: n * args.episodes,
        turns,
        tokens,
        wall,
        episode_seconds,
    })
}
