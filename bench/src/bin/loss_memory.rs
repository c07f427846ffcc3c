//! Peak memory of one training step's loss, full `[B, T, vocab]` logits vs the chunked
//! loss at the trained positions only (`[learner] logits_budget_mb`), at several
//! sequence lengths, on the CPU.
//!
//! `cargo run --release -p tutor-bench --bin loss_memory [-- --tokens 2048,8192,32768
//! --vocab 16384 --labels 0.25 --budget-mb 64]`
//!
//! Each measurement runs in a child process of its own (this binary with `--child`): a
//! tiny random model (1 layer, hidden 64; the head is what grows with the vocabulary),
//! one example of `--tokens` tokens whose last `--labels` share of each 512-token turn
//! is label, and one `Trainer::step` on it. The figure is the step's peak resident
//! memory above the resident memory just before it (`/proc/self/status` VmHWM after the
//! peak is reset through `/proc/self/clear_refs`), in MiB and in KiB per token. Both
//! modes print the step's loss and gradient norm, which must agree.

use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use tch::Device;
use tutor_bench::{child_json, status_kib};
use tutor_learner::config::LearnerConfig;
use tutor_learner::trainer::Trainer;
use tutor_policy::{ModelConfig, Policy};

#[derive(Parser, Debug)]
#[command(about = "Peak memory of a training step: full logits vs the chunked loss")]
struct Args {
    /// Sequence lengths (one example each).
    #[arg(long, value_delimiter = ',', default_value = "2048,8192,32768")]
    tokens: Vec<usize>,
    /// Vocabulary size of the model (16,384 keeps the full logits of 32k tokens, about
    /// 2 GiB a tensor, within this machine's memory; Qwen's 152k would not fit).
    #[arg(long, default_value_t = 16_384)]
    vocab: usize,
    /// Share of each 512-token turn that is label (trained on).
    #[arg(long, default_value_t = 0.25)]
    labels: f64,
    /// `logits_budget_mb` of the chunked mode.
    #[arg(long, default_value_t = 64)]
    budget_mb: usize,
    /// Internal: run one measurement ("full" or "chunked") and print it as JSON.
    #[arg(long, hide = true)]
    child: Option<String>,
}

fn child(mode: &str, args: &Args) -> Result<()> {
    let tokens = args.tokens[0];
    let mut mc = ModelConfig::tiny(args.vocab);
    mc.hidden_size = 64;
    mc.intermediate_size = 128;
    mc.head_dim = 16;
    mc.num_hidden_layers = 1;
    mc.max_position_embeddings = tokens.max(4096);
    let policy = Policy::new(mc, Device::Cpu, 1);
    let config = LearnerConfig {
        logits_budget_mb: if mode == "full" { 0 } else { args.budget_mb },
        warmup_steps: 0,
        ..Default::default()
    };
    let mut trainer = Trainer::new(policy, config)?;
    let ids: Vec<u32> = (0..tokens)
        .map(|j| 1 + ((j * 7919) % (args.vocab - 1)) as u32)
        .collect();
    let label_from = ((1.0 - args.labels) * 512.0) as usize;
    let mask: Vec<bool> = (0..tokens).map(|j| j % 512 >= label_from).collect();
    let example = vec![(ids, mask)];
    std::fs::write("/proc/self/clear_refs", "5").context("resetting the peak (clear_refs)")?;
    let before = status_kib("VmRSS:")?;
    let start = Instant::now();
    let report = trainer.step(&example)?;
    let seconds = start.elapsed().as_secs_f64();
    let peak = status_kib("VmHWM:")?;
    println!(
        "{}",
        serde_json::json!({
            "extra_kib": peak.saturating_sub(before),
            "seconds": seconds,
            "loss": report.loss,
            "grad_norm": report.grad_norm,
        })
    );
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(mode) = &args.child {
        return child(mode, &args);
    }
    let exe = std::env::current_exe()?;
    println!(
        "loss_memory: vocab {}, {:.0} % labels, chunked budget {} MiB; one step, 1 layer, hidden 64",
        args.vocab,
        args.labels * 100.0,
        args.budget_mb
    );
    println!(
        "{:>7}  {:>10} {:>10}  {:>10} {:>10}  {:>6}  {:>7} {:>7}  loss (full / chunked)",
        "tokens", "full MiB", "KiB/tok", "chunk MiB", "KiB/tok", "ratio", "full s", "chunk s"
    );
    for &tokens in &args.tokens {
        let mut runs = Vec::new();
        for mode in ["full", "chunked"] {
            let v = child_json(
                Command::new(&exe)
                    .args(["--child", mode, "--tokens", &tokens.to_string()])
                    .args(["--vocab", &args.vocab.to_string()])
                    .args(["--labels", &args.labels.to_string()])
                    .args(["--budget-mb", &args.budget_mb.to_string()]),
                &format!("the {mode} step at {tokens} tokens"),
            )?;
            runs.push(v);
        }
        let mib = |v: &serde_json::Value| v["extra_kib"].as_f64().unwrap_or(0.0) / 1024.0;
        let per_token = |v: &serde_json::Value| mib(v) * 1024.0 / tokens as f64;
        let (f, c) = (&runs[0], &runs[1]);
        println!(
            "{:>7}  {:>10.1} {:>10.1}  {:>10.1} {:>10.1}  {:>5.1}x  {:>7.2} {:>7.2}  {:.6} / {:.6}",
            tokens,
            mib(f),
            per_token(f),
            mib(c),
            per_token(c),
            mib(f) / mib(c).max(1e-9),
            f["seconds"].as_f64().unwrap_or(0.0),
            c["seconds"].as_f64().unwrap_or(0.0),
            f["loss"].as_f64().unwrap_or(f64::NAN),
            c["loss"].as_f64().unwrap_or(f64::NAN),
        );
    }
    Ok(())
}
