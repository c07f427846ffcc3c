//! Cross-turn key/value reuse in the engine (`tutor_policy::engine`, prefix cache): one
//! agent episode of `--turns` turns, each prompt the previous prompt plus the reply and an
//! observation, run on an engine without the cache and on one with it.
//!
//! `cargo run --release -p tutor-bench --bin prefix_cache [-- --turns 30 --first 600
//! --observation 150 --reply 40 --hidden 256 --layers 4]`
//!
//! Both runs see the same prompts: the episode is scripted by the run without the cache
//! (its replies, then a fixed random observation), and the run with the cache is fed the
//! same prompts. Reported: prompt tokens prefilled, the student's seconds (sum of the
//! turns' wall times) and the largest difference between the two runs' log-probs of the
//! same tokens (the turns whose replies agree token for token).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tutor_policy::{
    spawn_engine, ChatTokenizer, EngineConfig, EngineEvent, EngineHandle, EngineRequest, GenParams,
    ModelConfig, Policy,
};

#[derive(Parser, Debug)]
#[command(
    about = "Prefill tokens and student time of a multi-turn episode, with and without the engine's prefix cache"
)]
struct Args {
    /// Turns of the episode.
    #[arg(long, default_value_t = 30)]
    turns: usize,
    /// Tokens of the first prompt (system prompt and issue).
    #[arg(long, default_value_t = 600)]
    first: usize,
    /// Tokens of each observation appended after a reply.
    #[arg(long, default_value_t = 150)]
    observation: usize,
    /// Tokens of each reply (greedy, no stop token).
    #[arg(long, default_value_t = 40)]
    reply: usize,
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 4096)]
    vocab: usize,
    /// libtorch threads of the engine (0: libtorch's default).
    #[arg(long, default_value_t = 0)]
    threads: u32,
    /// Where the engine runs: `cpu` (f32) or `cuda`/`cuda:N` (bf16, as a worker's GPU
    /// engine).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Each attention head's dimension (Qwen3: 128); the heads stay hidden / 64 and the
    /// key/value heads hidden / 128.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Tie the output head to the embedding (as Qwen3-0.6B does).
    #[arg(long)]
    tied: bool,
    /// The engine's `max_batch`.
    #[arg(long, default_value_t = 1)]
    max_batch: usize,
    /// The engine's `max_cached_tokens` (0: the episode's length).
    #[arg(long, default_value_t = 0)]
    max_cached: usize,
    /// Save the random model to a directory and load it from there (as `gpu_check` and a
    /// worker do) instead of using the model drawn in memory.
    #[arg(long)]
    from_dir: bool,
    /// Only the run without the cache (for looking at per-turn times).
    #[arg(long)]
    without_only: bool,
    /// With --without-only: also time the same turns with `Policy::generate` (no engine).
    #[arg(long)]
    policy_generate: bool,
}

/// One turn's outcome.
struct Turn {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    seconds: f64,
    /// Seconds from the request to its first token (prefill and the first sample).
    first: f64,
}

fn generate(engine: &EngineHandle, prompt: &[u32], n: usize) -> Result<Turn> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let start = Instant::now();
    engine
        .submit_blocking(EngineRequest {
            prompt: prompt.to_vec(),
            params: GenParams {
                temperature: 0.0,
                max_new_tokens: n,
                ..GenParams::default()
            },
            stop: Vec::new(),
            top_logprobs: 0,
            prompt_logprobs: false,
            text: false,
            events: tx,
        })
        .map_err(|e| anyhow::anyhow!("the engine refused the turn: {e}"))?;
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    let mut first = 0.0;
    loop {
        match rx.blocking_recv() {
            Some(EngineEvent::Token(t)) => {
                if tokens.is_empty() {
                    first = start.elapsed().as_secs_f64();
                }
                tokens.push(t.id);
                logprobs.push(t.logprob);
            }
            Some(EngineEvent::Done(_)) => break,
            Some(_) => {}
            None => bail!("the engine stopped in the middle of a turn"),
        }
    }
    Ok(Turn {
        tokens,
        logprobs,
        seconds: start.elapsed().as_secs_f64(),
        first,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = tutor_policy::parse_device(&args.device, 0)
        .with_context(|| format!("--device {:?}: expected cpu, cuda or cuda:N", args.device))?;
    tutor_policy::check_device(device)?;
    let total = args.first + args.turns * (args.reply + args.observation) + 16;
    let mut mc = ModelConfig::tiny(args.vocab);
    mc.hidden_size = args.hidden;
    mc.intermediate_size = 3 * args.hidden;
    mc.num_hidden_layers = args.layers;
    mc.num_attention_heads = (args.hidden / 64).max(1);
    mc.num_key_value_heads = (args.hidden / 128).max(1);
    mc.head_dim = args.head_dim.min(args.hidden);
    mc.max_position_embeddings = total;
    mc.tie_word_embeddings = args.tied;
    let saved = tempfile::tempdir()?;
    if args.from_dir {
        Policy::new(mc.clone(), tch::Device::Cpu, 7).save_dir(saved.path())?;
    }
    let corpus: Vec<String> = (0..20).map(|i| format!("turn {i}: ls -la")).collect();
    let tokenizer = ChatTokenizer::train(&corpus, 300)?;
    // The bench's model, as a worker's engine holds it: bf16 on a GPU.
    let model = || -> Result<Policy> {
        let mut policy = if args.from_dir {
            Policy::load_dir(saved.path(), device)?
        } else {
            Policy::new(mc.clone(), device, 7)
        };
        if device.is_cuda() {
            policy.var_store_mut().bfloat16();
        }
        Ok(policy)
    };
    let engine = |cache: usize| {
        let mut policy = model().expect("loading the saved model");
        policy.use_decode_layout();
        spawn_engine(
            policy,
            tokenizer.clone(),
            EngineConfig {
                max_batch: args.max_batch,
                max_cached_tokens: if args.max_cached > 0 {
                    args.max_cached
                } else {
                    total
                },
                queue: 2,
                torch_threads: args.threads,
                prefix_cache_tokens: cache,
            },
        )
    };
    println!(
        "device: {}; model: {} parameters ({} layers, hidden {}); episode: {} turns, first prompt {} tokens, \
         replies {}, observations {} ({} tokens at the end)",
        args.device,
        mc.num_parameters(),
        args.layers,
        args.hidden,
        args.turns,
        args.first,
        args.reply,
        args.observation,
        total - 16
    );
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut random = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| rng.gen_range(3..args.vocab as u32))
            .collect()
    };
    // The run without the cache scripts the episode.
    let (off, off_thread) = engine(0);
    let mut prompts = Vec::with_capacity(args.turns);
    let mut plain = Vec::with_capacity(args.turns);
    let mut prompt = random(args.first);
    for k in 0..args.turns {
        let turn = generate(&off, &prompt, args.reply)?;
        eprintln!(
            "without the cache: turn {k}, {} prompt tokens, {:.2} s",
            prompt.len(),
            turn.seconds
        );
        prompts.push(prompt.clone());
        prompt.extend(&turn.tokens);
        prompt.extend(random(args.observation));
        plain.push(turn);
    }
    let off_stats = off.prefix_stats();
    drop(off);
    off_thread.join().ok();
    if args.without_only {
        let secs: f64 = plain.iter().map(|t| t.seconds).sum();
        let tokens: usize = plain.iter().map(|t| t.tokens.len()).sum();
        let prefill: f64 = plain.iter().map(|t| t.first).sum();
        println!(
            "without the cache: {secs:.2} s for {tokens} generated tokens: {prefill:.2} s to the turns' first tokens, \
             {:.1} ms per later token",
            1e3 * (secs - prefill) / tokens.saturating_sub(plain.len()).max(1) as f64
        );
        if args.policy_generate {
            let policy = model()?;
            let params = GenParams {
                temperature: 0.0,
                max_new_tokens: args.reply,
                ..GenParams::default()
            };
            let start = Instant::now();
            let mut n = 0;
            for prompt in &prompts {
                n += policy.generate(std::slice::from_ref(prompt), std::slice::from_ref(&params))
                    [0]
                .tokens
                .len();
            }
            let secs = start.elapsed().as_secs_f64();
            println!(
                "Policy::generate, same prompts: {secs:.2} s for {n} tokens ({:.1} ms per token, prefill included)",
                1e3 * secs / n.max(1) as f64
            );
        }
        return Ok(());
    }

    let (on, on_thread) = engine(total);
    let mut cached = Vec::with_capacity(args.turns);
    for (k, prompt) in prompts.iter().enumerate() {
        let turn = generate(&on, prompt, args.reply)?;
        eprintln!(
            "with the cache: turn {k}, {} prompt tokens, {:.2} s",
            prompt.len(),
            turn.seconds
        );
        cached.push(turn);
    }
    let on_stats = on.prefix_stats();
    drop(on);
    on_thread.join().ok();

    let (mut same, mut worst) = (0, 0f32);
    for (a, b) in plain.iter().zip(&cached) {
        if a.tokens == b.tokens {
            same += 1;
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                worst = worst.max((x - y).abs());
            }
        } else {
            worst = worst.max((a.logprobs[0] - b.logprobs[0]).abs());
        }
    }
    let seconds = |turns: &[Turn]| turns.iter().map(|t| t.seconds).sum::<f64>();
    let (s_off, s_on) = (seconds(&plain), seconds(&cached));
    println!(
        "without the cache: {} prompt tokens prefilled, {s_off:.2} s of student time",
        off_stats.prefilled_tokens
    );
    println!(
        "with the cache:    {} prompt tokens prefilled ({} reused, {} of {} turns hit), {s_on:.2} s",
        on_stats.prefilled_tokens, on_stats.reused_tokens, on_stats.hits, on_stats.requests
    );
    println!(
        "prefill {:.1}× fewer tokens, student time {:.2}× shorter; {same} of {} replies identical, \
         largest |Δ log-prob| {worst:.2e}",
        off_stats.prefilled_tokens as f64 / on_stats.prefilled_tokens.max(1) as f64,
        s_off / s_on,
        args.turns
    );
    println!(
        "| {} | {} | {} | {} | {:.2} | {:.2} | {:.2}× | {same}/{} | {worst:.1e} |",
        args.turns,
        total - 16,
        off_stats.prefilled_tokens,
        on_stats.prefilled_tokens,
        s_off,
        s_on,
        s_off / s_on,
        args.turns
    );
    Ok(())
}
