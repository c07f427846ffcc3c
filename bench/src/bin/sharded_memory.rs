//! Peak memory and time of a sharded training step (`[learner] shard = "optimizer"` and
//! `"gradients"`) with its exchanges in buckets (`[learner] bucket_mb`) against one
//! exchange of the whole flat vector (a bucket larger than the model: how every step
//! exchanged before buckets), on the CPU collective; and `"full"` without and with
//! `[learner] prefetch` (the next layer gathered while one computes).
//!
//! `cargo run --release -p tutor-bench --bin sharded_memory [-- --ranks 3 --hidden 768
//! --layers 6 --vocab 16384 --buckets 1000000,64,16]`
//!
//! Each measurement runs in a child process of its own (this binary with `--child`):
//! `--ranks` data-parallel ranks as threads over loopback TCP (`CpuCollective`), a random
//! Qwen3-shaped model, one warm-up step, then one measured step of the same examples.
//! The figure is the process's peak resident memory during the measured step above its
//! resident memory just before it (`/proc/self/status` VmHWM after the peak is reset
//! through `/proc/self/clear_refs`), all ranks together, and the step's seconds. Every
//! run prints rank 0's loss and gradient norm, which must agree across bucket sizes (and
//! with and without prefetching).

use std::process::Command;
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use tch::Device;
use tutor_bench::{child_json, status_kib};
use tutor_collective::{CpuCollective, CpuCollectiveTimeouts, CpuRendezvous};
use tutor_learner::config::{LearnerConfig, Shard};
use tutor_learner::trainer::{rank_shard, Trainer};
use tutor_policy::{ModelConfig, Policy};

#[derive(Parser, Debug)]
#[command(about = "Peak memory of a sharded step: exchanges in buckets vs one flat exchange")]
struct Args {
    /// Data-parallel ranks (threads of one process).
    #[arg(long, default_value_t = 3)]
    ranks: usize,
    #[arg(long, default_value_t = 768)]
    hidden: usize,
    #[arg(long, default_value_t = 6)]
    layers: usize,
    #[arg(long, default_value_t = 16_384)]
    vocab: usize,
    /// Bucket sizes in MiB (`[learner] bucket_mb`); the first is the reference (larger
    /// than the model: one exchange of everything).
    #[arg(long, value_delimiter = ',', default_value = "1000000,64,16")]
    buckets: Vec<f64>,
    /// Sharding modes: `optimizer` and `gradients` run with each bucket size; `full`
    /// (which exchanges one layer at a time whatever the bucket) runs without, then with,
    /// `[learner] prefetch`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "optimizer,gradients,full"
    )]
    modes: Vec<String>,
    /// Internal: run one measurement (mode, bucket MiB) and print it as JSON.
    #[arg(long, hide = true, num_args = 2)]
    child: Option<Vec<String>>,
}

fn model(args: &Args) -> ModelConfig {
    let mut mc = ModelConfig::tiny(args.vocab);
    mc.hidden_size = args.hidden;
    mc.intermediate_size = args.hidden * 8 / 3;
    mc.head_dim = 64;
    mc.num_attention_heads = (args.hidden / 64).max(1);
    mc.num_key_value_heads = (mc.num_attention_heads / 3).max(1);
    mc.num_hidden_layers = args.layers;
    mc
}

/// The sharding mode a `--modes` name means, and whether `"full"` prefetches.
fn parse_mode(name: &str) -> Result<(Shard, bool)> {
    Ok(match name {
        "optimizer" => (Shard::Optimizer, true),
        "gradients" => (Shard::Gradients, true),
        "full" => (Shard::Full, true),
        "full-no-prefetch" => (Shard::Full, false),
        other => bail!("--modes: {other:?} is not optimizer, gradients, full or full-no-prefetch"),
    })
}

fn child(mode: &str, bucket_mb: f64, args: &Args) -> Result<()> {
    let (shard, prefetch) = parse_mode(mode)?;
    let config = LearnerConfig {
        shard,
        bucket_mb,
        prefetch,
        checkpoint_activations: shard == Shard::Full,
        warmup_steps: 0,
        ..Default::default()
    };
    let examples: Vec<(Vec<u32>, Vec<bool>)> = (0..2 * args.ranks)
        .map(|i| {
            let ids = (0..96)
                .map(|j| 1 + ((i * 131 + j * 7919) % (args.vocab - 1)) as u32)
                .collect();
            (ids, (0..96).map(|j| j >= 48).collect())
        })
        .collect();
    let timeouts = CpuCollectiveTimeouts {
        connect: Duration::from_secs(60),
        io: Duration::from_secs(600),
    };
    let rdv = CpuRendezvous::bind("127.0.0.1:0")?;
    let addr = rdv.local_addr();
    let world = args.ranks;
    let barrier = Barrier::new(world);
    let before = Mutex::new(0u64);
    let results = Mutex::new(Vec::new());
    let mc = model(args);
    let rdv = Mutex::new(Some(rdv));
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (config, examples, mc) = (config.clone(), &examples, mc.clone());
                let (barrier, before, results, rdv) = (&barrier, &before, &results, &rdv);
                s.spawn(move || -> Result<()> {
                    let c: Box<dyn tutor_learner::Collective> = if rank == 0 {
                        let rdv = rdv.lock().unwrap().take().context("one rank 0")?;
                        Box::new(rdv.accept(world, timeouts)?)
                    } else {
                        Box::new(CpuCollective::connect(addr, rank, world, timeouts)?)
                    };
                    let policy = Policy::new(mc, Device::Cpu, 1);
                    let mut t = Trainer::with_collective(policy, config, c)?;
                    let mine = rank_shard(examples, rank, world);
                    t.step(&mine)?;
                    if barrier.wait().is_leader() {
                        std::fs::write("/proc/self/clear_refs", "5")
                            .context("resetting the peak (clear_refs)")?;
                        *before.lock().unwrap() = status_kib("VmRSS:")?;
                    }
                    barrier.wait();
                    let start = Instant::now();
                    let report = t.step(&mine)?;
                    let seconds = start.elapsed().as_secs_f64();
                    barrier.wait();
                    results
                        .lock()
                        .unwrap()
                        .push((rank, seconds, report.loss, report.grad_norm));
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| anyhow::anyhow!("a rank panicked"))??;
        }
        Ok(())
    })?;
    let peak = status_kib("VmHWM:")?;
    let results = results.into_inner().unwrap();
    let seconds = results.iter().map(|r| r.1).fold(0.0, f64::max);
    let (_, _, loss, grad_norm) = *results
        .iter()
        .find(|r| r.0 == 0)
        .context("rank 0's result")?;
    let parameters: i64 = Policy::new(mc, Device::Cpu, 1)
        .var_store()
        .variables()
        .values()
        .map(|t| t.numel() as i64)
        .sum();
    println!(
        "{}",
        serde_json::json!({
            "extra_kib": peak.saturating_sub(*before.lock().unwrap()),
            "seconds": seconds,
            "loss": loss,
            "grad_norm": grad_norm,
            "parameters": parameters,
        })
    );
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(c) = &args.child {
        let bucket: f64 = c[1].parse().context("--child MODE BUCKET_MB")?;
        return child(&c[0], bucket, &args);
    }
    let exe = std::env::current_exe()?;
    println!(
        "sharded_memory: {} ranks (threads, CPU collective), hidden {}, {} layers, vocab {}; \
         peak resident memory of one step above the memory before it, all ranks together",
        args.ranks, args.hidden, args.layers, args.vocab
    );
    println!(
        "{:>10} {:>12} {:>10} {:>8} {:>8} {:>9}  loss / grad norm",
        "mode", "bucket MiB", "peak MiB", "ratio", "step s", "ratio"
    );
    for mode in &args.modes {
        let (shard, _) = parse_mode(mode)?;
        let mut reference: Option<(f64, f64)> = None;
        // "full": the same bucket, prefetch off (the reference), then on.
        let runs: Vec<(&str, f64)> = if shard == Shard::Full {
            vec![("full-no-prefetch", 64.0), ("full", 64.0)]
        } else {
            args.buckets.iter().map(|&b| (mode.as_str(), b)).collect()
        };
        for (mode, bucket) in runs {
            let v = child_json(
                Command::new(&exe)
                    .args(["--child", mode, &bucket.to_string()])
                    .args(["--ranks", &args.ranks.to_string()])
                    .args(["--hidden", &args.hidden.to_string()])
                    .args(["--layers", &args.layers.to_string()])
                    .args(["--vocab", &args.vocab.to_string()]),
                &format!("{mode} with {bucket} MiB buckets"),
            )?;
            let mib = v["extra_kib"].as_f64().unwrap_or(0.0) / 1024.0;
            let secs = v["seconds"].as_f64().unwrap_or(0.0);
            if reference.is_none() {
                println!(
                    "({} parameters: {:.0} MiB in f32 per rank)",
                    v["parameters"],
                    v["parameters"].as_f64().unwrap_or(0.0) * 4.0 / (1u64 << 20) as f64
                );
            }
            let (ref_mib, ref_secs) = *reference.get_or_insert((mib, secs));
            println!(
                "{:>10} {:>12} {:>10.1} {:>7.2}x {:>8.2} {:>8.2}x  {:.6} / {:.6}",
                mode,
                bucket,
                mib,
                mib / ref_mib.max(1e-9),
                secs,
                secs / ref_secs.max(1e-9),
                v["loss"].as_f64().unwrap_or(f64::NAN),
                v["grad_norm"].as_f64().unwrap_or(f64::NAN),
            );
        }
    }
    Ok(())
}
