//! The policy against its reference implementations on the same model, CPU:
//! greedy generation against `transformers`' `generate`, and one training step against
//! PyTorch eager. Prints tokens/s (and step times) of each side and their ratio.
//!
//! `cargo run --release -p tutor-bench --bin policy [-- --threads 2 --new-tokens 64
//! --batches 1,8 --repeats 3 --train-steps 5]` (or `make bench-policy`)
//!
//! 1. bench/reference/generate_hf.py makes a tiny Qwen3 model with `transformers` from a
//!    fixed config and seed (4 layers, hidden 384, GQA 6/2 heads, vocab 4096), saves it in
//!    Hugging Face layout and times `model.generate` (greedy, KV cache, one warm-up, best
//!    of `--repeats`) on seeded prompts of 24–40 tokens at each batch size.
//! 2. This binary loads the saved directory (`Policy::load_dir`) and times
//!    `Policy::generate` on the same prompts, greedy, the same number of new tokens (no
//!    stop token), one warm-up, best of `--repeats`; it also counts how many generated
//!    tokens agree with transformers' (float rounding may flip a near-tie, after which a
//!    row diverges; the count is a sanity check, not the measurement).
//! 3. One training step on a fixed seeded batch (8 rows of 96–128 tokens, the second half
//!    of each row labels): `Trainer::step` (forward, summed masked cross-entropy,
//!    backward, gradient division and clipping, AdamW) against
//!    bench/reference/train_step_torch.py doing the same with `transformers`' model and
//!    `torch.optim.AdamW`. One warm-up step, median of `--train-steps` steps each.
//!
//! Both sides use `--threads` intra-op threads (`tch::set_num_threads`,
//! `torch.set_num_threads`) and run one after the other, never at the same time. Besides
//! wall time each side reports the CPU seconds its process used (all threads), whose ratio
//! is less disturbed by other work on a shared machine. The Python is `TUTOR_PYTHON`,
//! else `.venv/bin/python`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use rand::{Rng, SeedableRng};
use tch::Device;
use tutor_bench::{median, min, read_json};
use tutor_learner::config::LearnerConfig;
use tutor_learner::trainer::Trainer;
use tutor_policy::{spawn_engine, ChatTokenizer, EngineConfig, EngineHandle, GenParams, Policy};

#[derive(Debug, Parser)]
struct Args {
    /// Intra-op threads on both sides.
    #[arg(long, default_value_t = 2)]
    threads: i32,
    /// New tokens per row (greedy, no stop token).
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Batch sizes to time generation at.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batches: Vec<usize>,
    /// How to time Tutor's generation: `Policy::generate` in the `default` (training)
    /// layout, in the `transposed` layout (`Policy::use_transposed_layout`, the fallback
    /// where weights cannot be packed) and prepared for decoding (`decode`:
    /// `Policy::use_decode_layout`, packed weights); and `engine`: the continuous-batching
    /// engine workers and `tutor serve` run (prepared for decoding), the batch's requests
    /// submitted at once. Each repeat times every layout back to back.
    #[arg(long, value_delimiter = ',', default_value = "default,decode,engine")]
    layouts: Vec<String>,
    /// Timed generation runs per side and batch size (the best counts).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Timed training steps per side (the median counts); 0 skips the training step.
    #[arg(long, default_value_t = 5)]
    train_steps: usize,
    /// Skip generation (only the training step).
    #[arg(long)]
    no_generate: bool,
}

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("bench/ has a parent")
        .to_path_buf()
}

fn python() -> PathBuf {
    match std::env::var_os("TUTOR_PYTHON") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => workspace().join(".venv/bin/python"),
    }
}

fn python_command(py: &Path, script: &Path) -> Command {
    let mut command = Command::new(py);
    command
        .arg(script)
        .env("TOKENIZERS_PARALLELISM", "false")
        .env("PYTHONHASHSEED", "0");
    command
}

fn cannot_run(py: &Path, script: &Path) -> String {
    format!(
        "cannot run {} for {}; run `make setup` or set TUTOR_PYTHON to a Python with torch \
         and transformers",
        py.display(),
        script.display()
    )
}

fn run_python(script: &str, args: &[&std::ffi::OsStr]) -> Result<()> {
    let py = python();
    let path = workspace().join("bench/reference").join(script);
    let status = python_command(&py, &path)
        .args(args)
        .status()
        .with_context(|| cannot_run(&py, &path))?;
    if !status.success() {
        bail!("{} failed ({status})", path.display());
    }
    Ok(())
}

fn field<T: serde::de::DeserializeOwned>(
    v: &serde_json::Value,
    key: &str,
    file: &str,
) -> Result<T> {
    serde_json::from_value(v[key].clone()).with_context(|| format!("{file}: field `{key}`"))
}

/// CPU seconds (user + system, all threads) this process has used: less disturbed than
/// wall time by other work on the machine (Linux, `/proc/self/stat`, 100 Hz ticks).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<f64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    f.iter().sum::<f64>() / 100.0
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

fn bench_generate(args: &Args, dir: &Path) -> Result<()> {
    let threads = args.threads.to_string();
    let new_tokens = args.new_tokens.to_string();
    let batches: Vec<String> = args.batches.iter().map(|b| b.to_string()).collect();
    let batches = batches.join(",");
    println!("[reference] transformers generate (timed in turn with Tutor's runs) ...");
    let mut reference = Reference::start(&[
        "--out".as_ref(),
        dir.as_os_str(),
        "--threads".as_ref(),
        threads.as_ref(),
        "--new-tokens".as_ref(),
        new_tokens.as_ref(),
        "--batches".as_ref(),
        batches.as_ref(),
        "--serve".as_ref(),
    ])?;
    let hf = read_json(&dir.join("generate_hf.json"))?;
    let file = "generate_hf.json";
    let prompts: Vec<Vec<u32>> = field(&hf, "prompts", file)?;
    let versions = format!(
        "torch {}, transformers {}",
        hf["torch"].as_str().unwrap_or("?"),
        hf["transformers"].as_str().unwrap_or("?")
    );

    let params = GenParams {
        temperature: 0.0,
        max_new_tokens: args.new_tokens,
        ..GenParams::default()
    };
    println!(
        "generate: greedy, {} new tokens, prompts of 24-40 tokens, {} threads, best of {}, transformers and each layout timed in turn ({versions})",
        args.new_tokens, args.threads, args.repeats
    );
    // One runner per layout, all built up front, so that each repeat times transformers
    // and every layout back to back: a slow stretch of a shared machine then hits them
    // all alike.
    let load = || {
        Policy::load_dir(&dir.join("model"), Device::Cpu)
            .with_context(|| format!("loading {}", dir.join("model").display()))
    };
    let mut runners = Vec::new();
    for layout in &args.layouts {
        let runner = match layout.as_str() {
            "default" => Runner::Generate(Box::new(load()?)),
            "transposed" => {
                let mut policy = load()?;
                policy.use_transposed_layout();
                Runner::Generate(Box::new(policy))
            }
            "decode" => {
                let mut policy = load()?;
                policy.use_decode_layout();
                Runner::Generate(Box::new(policy))
            }
            "engine" => {
                let corpus: Vec<String> = (0..20).map(|i| format!("bench line {i}")).collect();
                let tokenizer = ChatTokenizer::train(&corpus, 300)?;
                // The engine thread owns its model and prepares it for decoding itself.
                let (handle, thread) = spawn_engine(
                    load()?,
                    tokenizer,
                    EngineConfig {
                        max_batch: args.batches.iter().copied().max().unwrap_or(1),
                        max_cached_tokens: 1 << 20,
                        queue: 64,
                        torch_threads: args.threads.max(1) as u32,
                        // Repeats send the same prompts: no prefix reuse, as transformers has none.
                        prefix_cache_tokens: 0,
                    },
                );
                Runner::Engine(handle, thread)
            }
            other => {
                bail!("--layouts: unknown layout {other:?} (default, transposed, decode, engine)")
            }
        };
        runners.push((layout.as_str(), runner));
    }
    println!("  layout       batch   transformers tok/s   tutor tok/s   ratio   CPU-time ratio   tokens equal to transformers'");
    for &b in &args.batches {
        let rows = &prompts[..b];
        let r = &hf["results"][b.to_string()];
        let hf_tokens: Vec<Vec<u32>> = field(r, "tokens", file)?;
        for (_, runner) in &runners {
            runner.generate(rows, &params)?; // warm-up
        }
        let mut wall = vec![Vec::new(); runners.len()];
        let mut cpu = vec![Vec::new(); runners.len()];
        let mut out = vec![Vec::new(); runners.len()];
        let (mut their_wall, mut their_cpu) = (Vec::new(), Vec::new());
        for _ in 0..args.repeats {
            let (w, c) = reference.time(b)?;
            their_wall.push(w);
            their_cpu.push(c);
            for (i, (_, runner)) in runners.iter().enumerate() {
                let (t0, c0) = (Instant::now(), cpu_seconds());
                out[i] = runner.generate(rows, &params)?;
                wall[i].push(t0.elapsed().as_secs_f64());
                cpu[i].push(cpu_seconds() - c0);
            }
        }
        let theirs = (b * args.new_tokens) as f64 / min(&their_wall);
        for (i, (layout, _)) in runners.iter().enumerate() {
            let ours = (b * args.new_tokens) as f64 / min(&wall[i]);
            // CPU seconds per token, theirs over ours: > 1 means Tutor needs less CPU.
            let cpu_ratio = min(&their_cpu) / min(&cpu[i]).max(0.01);
            // Tokens up to each row's first disagreement.
            let agree: usize = out[i]
                .iter()
                .zip(&hf_tokens)
                .map(|(g, h)| g.iter().zip(h).take_while(|(a, b)| a == b).count())
                .sum();
            println!(
                "  {layout:<11}  {b:>5}   {theirs:>18.1}   {ours:>11.1}   {:>5.2}   {cpu_ratio:>14.2}   {agree}/{}",
                ours / theirs,
                b * args.new_tokens
            );
        }
    }
    for (_, runner) in runners {
        if let Runner::Engine(handle, thread) = runner {
            drop(handle);
            let _ = thread.join();
        }
    }
    Ok(())
}

/// generate_hf.py in `--serve` mode: times one `generate` per request.
struct Reference {
    child: std::process::Child,
    /// `None` once closed.
    stdin: Option<std::process::ChildStdin>,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Reference {
    /// Starts the script and waits until it has written its JSON and says `ready`.
    fn start(args: &[&std::ffi::OsStr]) -> Result<Self> {
        use std::io::BufRead;
        let py = python();
        let path = workspace().join("bench/reference/generate_hf.py");
        let mut child = python_command(&py, &path)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .with_context(|| cannot_run(&py, &path))?;
        let stdin = child.stdin.take().expect("piped");
        let mut stdout = std::io::BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        loop {
            line.clear();
            if stdout.read_line(&mut line)? == 0 {
                let status = child.wait()?;
                bail!("{} ended before it was ready ({status})", path.display());
            }
            if line.trim() == "ready" {
                break;
            }
            print!("{line}");
        }
        Ok(Reference {
            child,
            stdin: Some(stdin),
            stdout,
        })
    }

    /// Wall and CPU seconds of one timed `generate` at batch size `b`.
    fn time(&mut self, b: usize) -> Result<(f64, f64)> {
        use std::io::{BufRead, Write};
        let stdin = self.stdin.as_mut().expect("open until dropped");
        writeln!(stdin, "{b}")?;
        stdin.flush()?;
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("generate_hf.py ended ({:?})", self.child.try_wait()?);
        }
        let v: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("generate_hf.py said {line:?}"))?;
        Ok((
            field(&v, "seconds", "generate_hf.py")?,
            field(&v, "cpu_seconds", "generate_hf.py")?,
        ))
    }
}

impl Drop for Reference {
    fn drop(&mut self) {
        // Closing its standard input ends the script's loop.
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

/// One way of running Tutor's generation.
enum Runner {
    /// `Policy::generate` on a model in some layout.
    Generate(Box<Policy>),
    /// The continuous-batching engine, the batch's requests submitted at once.
    Engine(EngineHandle, std::thread::JoinHandle<()>),
}

impl Runner {
    fn generate(&self, prompts: &[Vec<u32>], params: &GenParams) -> Result<Vec<Vec<u32>>> {
        match self {
            Runner::Engine(handle, _) => tutor_bench::engine_generate(handle, prompts, params),
            Runner::Generate(policy) => {
                let ps = vec![params.clone(); prompts.len()];
                Ok(policy
                    .generate(prompts, &ps)
                    .into_iter()
                    .map(|g| g.tokens)
                    .collect())
            }
        }
    }
}

fn bench_train(args: &Args, dir: &Path) -> Result<()> {
    let model_dir = dir.join("model");
    let vocab = 4096u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let examples: Vec<(Vec<u32>, Vec<bool>)> = (0..8)
        .map(|_| {
            let len = rng.gen_range(96..=128);
            let ids = (0..len).map(|_| rng.gen_range(1..vocab)).collect();
            let mask = (0..len).map(|j| j >= len / 2).collect();
            (ids, mask)
        })
        .collect();
    let config = LearnerConfig {
        learning_rate: 1e-4,
        warmup_steps: 0,
        weight_decay: 0.01,
        grad_clip: 1.0,
        ..LearnerConfig::default()
    };
    let batch_path = dir.join("train_batch.json");
    let spec = serde_json::json!({
        "examples": examples.iter().map(|(t, _)| t).collect::<Vec<_>>(),
        "loss_masks": examples.iter().map(|(_, m)| m.iter().map(|&x| x as u8).collect::<Vec<_>>()).collect::<Vec<_>>(),
        "lr": config.learning_rate,
        "weight_decay": config.weight_decay,
        "beta1": config.beta1,
        "beta2": config.beta2,
        "eps": config.eps,
        "grad_clip": config.grad_clip,
    });
    std::fs::write(&batch_path, serde_json::to_vec(&spec)?)?;
    let tokens: usize = examples.iter().map(|(t, _)| t.len()).sum();

    println!("[reference] PyTorch eager training step ...");
    let out_path = dir.join("train_step_torch.json");
    let threads = args.threads.to_string();
    let steps = args.train_steps.to_string();
    run_python(
        "train_step_torch.py",
        &[
            "--model".as_ref(),
            model_dir.as_os_str(),
            "--batch".as_ref(),
            batch_path.as_os_str(),
            "--threads".as_ref(),
            threads.as_ref(),
            "--steps".as_ref(),
            steps.as_ref(),
            "--out".as_ref(),
            out_path.as_os_str(),
        ],
    )?;
    let torch = read_json(&out_path)?;
    let torch_seconds: Vec<f64> = field(&torch, "seconds", "train_step_torch.json")?;
    let torch_cpu: Vec<f64> = field(&torch, "cpu_seconds", "train_step_torch.json")?;
    let torch_losses: Vec<f64> = field(&torch, "losses", "train_step_torch.json")?;

    let policy = Policy::load_dir(&model_dir, Device::Cpu)?;
    let mut trainer = Trainer::new(policy, config)?;
    trainer.step(&examples)?; // warm-up
    let mut seconds = Vec::new();
    let mut cpu = Vec::new();
    let mut losses = Vec::new();
    for _ in 0..args.train_steps {
        let (t0, c0) = (Instant::now(), cpu_seconds());
        let report = trainer.step(&examples)?;
        seconds.push(t0.elapsed().as_secs_f64());
        cpu.push(cpu_seconds() - c0);
        losses.push(report.loss);
    }
    let (ours, theirs) = (median(seconds), median(torch_seconds));
    let (our_cpu, their_cpu) = (median(cpu), median(torch_cpu));
    println!(
        "train step: 8 rows, {tokens} tokens (right-padded to 128), forward + backward + clip + AdamW, \
         {} threads, median of {}",
        args.threads, args.train_steps
    );
    println!(
        "  wall  pytorch eager {:.1} ms   tutor {:.1} ms   ratio tutor/pytorch {:.3}",
        theirs * 1e3,
        ours * 1e3,
        ours / theirs
    );
    println!(
        "  CPU   pytorch eager {:.1} ms   tutor {:.1} ms   ratio tutor/pytorch {:.3}",
        their_cpu * 1e3,
        our_cpu * 1e3,
        our_cpu / their_cpu
    );
    println!(
        "  losses (after the warm-up step)  pytorch {:?}\n                                    tutor   {:?}",
        torch_losses
            .iter()
            .map(|l| format!("{l:.4}"))
            .collect::<Vec<_>>(),
        losses.iter().map(|l| format!("{l:.4}")).collect::<Vec<_>>()
    );
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    tch::set_num_threads(args.threads);
    tch::set_num_interop_threads(1);
    let dir = tempfile::tempdir()?;
    println!(
        "policy bench: {} CPUs, {} intra-op threads, load average {} at start",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        args.threads,
        load_average()
    );
    if args.no_generate {
        // The training step needs the model generate_hf.py makes; make it with no timing.
        run_python(
            "generate_hf.py",
            &[
                "--out".as_ref(),
                dir.path().as_os_str(),
                "--threads".as_ref(),
                args.threads.to_string().as_ref(),
                "--new-tokens".as_ref(),
                "1".as_ref(),
                "--batches".as_ref(),
                "1".as_ref(),
                "--repeats".as_ref(),
                "1".as_ref(),
            ],
        )?;
    } else {
        bench_generate(&args, dir.path())?;
    }
    if args.train_steps > 0 {
        bench_train(&args, dir.path())?;
    }
    Ok(())
}
