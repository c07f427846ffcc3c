//! A rank joining a sharded learner group (`Trainer::join_group`, every rank but 0 at
//! every formation of the group) holds no copy of the fp32 model in host memory beyond
//! what its mode keeps: it builds a placeholder of the model and keeps its slice of each
//! bucket of weights as it arrives. Measured as `plan_memory` measures a step: the
//! joining rank runs in a child process of its own (this test binary again, with
//! `JOIN_MEMORY_CHILD` set to rank 0's address) with glibc's mmap threshold fixed, and
//! reports the peak of its resident memory during the join above the memory before it
//! (VmHWM after a reset through /proc/self/clear_refs). Above the training state the rank
//! keeps, the peak may hold a few buckets in transit (the received tensors, the wire's
//! bytes, a bucket of another rank's moments), never a copy of the model: at most a
//! quarter of it here (4 ranks, buckets of 4 MiB, a 400 MiB model).
//!
//! `"full"` in f32 is the case that guards the weights: its state is the size of the
//! model (a quarter slice, two moments, the gradient sums), and a copy of the model while
//! the weights arrive would double that (before this test the join peaked at 1,508 MiB).
//! `"gradients"` in bf16 keeps bf16 parameters besides, 1.5 times the fp32 model in all,
//! so an fp32 copy held only while the weights arrive (before the moments exist) could
//! hide under its final state: it guards the end of the join, the moments' transit and
//! the parameters kept in bf16, not the weights' transit.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use tutor_collective::{CpuCollective, CpuCollectiveTimeouts, CpuRendezvous};
use tutor_learner::config::{Precision, Shard};
use tutor_learner::{Collective, LearnerConfig, Trainer};
use tutor_policy::{ModelConfig, Policy};

use common::status_kib;

const CHILD: &str = "JOIN_MEMORY_CHILD";
const WORLD: usize = 4;

/// 32 layers of 3.1M parameters and a small vocabulary: 101M parameters, 405 MB in
/// fp32, a layer 1/32 of it.
fn model() -> ModelConfig {
    let mut model = ModelConfig::tiny(4096);
    model.hidden_size = 512;
    model.intermediate_size = 1536;
    model.num_hidden_layers = 32;
    model.num_attention_heads = 4;
    model.num_key_value_heads = 2;
    model.head_dim = 128;
    model
}

fn timeouts() -> CpuCollectiveTimeouts {
    CpuCollectiveTimeouts {
        connect: Duration::from_secs(60),
        io: Duration::from_secs(120),
    }
}

/// In the child: joins as rank 1 and prints the peak its join added and the training
/// state it keeps.
fn join(addr: &str) {
    tch::set_num_threads(1);
    let c = CpuCollective::connect(addr, 1, WORLD, timeouts()).expect("joining rank 0");
    std::fs::write("/proc/self/clear_refs", "5")
        .expect("resetting VmHWM through /proc/self/clear_refs");
    let before = status_kib("VmRSS:");
    let trainer = Trainer::join_group(Box::new(c)).expect("the join");
    let peak = status_kib("VmHWM:").saturating_sub(before) * 1024;
    let b = trainer.state_bytes();
    let state = b.parameters + b.masters + b.moments + b.grad_sums + b.host_parameters;
    println!("\nPEAK_BYTES {peak} STATE_BYTES {state}");
}

fn field(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.split(&format!("{name} ")).nth(1))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in the child's output: {text}"))
}

#[test]
fn a_joining_sharded_rank_never_holds_the_whole_model() {
    if let Ok(addr) = std::env::var(CHILD) {
        join(&addr);
        return;
    }
    if std::env::var_os("ONEDNN_MAX_CPU_ISA").is_none() {
        // oneDNN's AMX kernels have crashed on some virtual machines (trainer tests).
        std::env::set_var("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16");
    }
    let exe = std::env::current_exe().expect("this test binary");
    let whole: u64 = {
        let (_, shapes) = Policy::placeholder(model(), tch::Device::Cpu);
        shapes
            .values()
            .map(|s| 4 * s.iter().product::<i64>() as u64)
            .sum()
    };
    let mut lines = Vec::new();
    for (shard, precision) in [
        (Shard::Full, Precision::F32),
        (Shard::Gradients, Precision::Bf16),
    ] {
        let config = LearnerConfig {
            shard,
            precision,
            checkpoint_activations: true,
            // Smaller than the embedding (8 MiB), which then goes in runs.
            bucket_mb: 4.0,
            ..LearnerConfig::default()
        };
        let mut lead = Trainer::new(Policy::new(model(), tch::Device::Cpu, 1), config).unwrap();
        let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
        let addr = rdv.local_addr();
        let mut child = Command::new(&exe)
            .args([
                "a_joining_sharded_rank_never_holds_the_whole_model",
                "--exact",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD, addr.to_string())
            .env("MALLOC_MMAP_THRESHOLD_", "131072")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting the child");
        // Ranks 2 and 3 join from threads of this process.
        let others: Vec<_> = (2..WORLD)
            .map(|r| {
                std::thread::spawn(move || {
                    let c = CpuCollective::connect(addr, r, WORLD, timeouts()).unwrap();
                    Trainer::join_group(Box::new(c) as Box<dyn Collective>).map(drop)
                })
            })
            .collect();
        let led = rdv
            .accept(WORLD, timeouts())
            .map_err(anyhow::Error::from)
            .and_then(|c| lead.lead_group(Box::new(c)));
        let joined: Vec<_> = others.into_iter().map(|h| h.join().unwrap()).collect();
        // The child's output first: it says why a join failed.
        let (mut out, mut err) = (String::new(), String::new());
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        let status = child.wait().unwrap();
        assert!(status.success(), "the child failed: {out}{err}");
        led.unwrap();
        for j in joined {
            j.unwrap();
        }
        eprintln!(
            "{}",
            err.lines()
                .filter(|l| l.contains("MEM"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        let (peak, state) = (field(&out, "PEAK_BYTES"), field(&out, "STATE_BYTES"));
        let mib = |b: u64| b as f64 / 1048576.0;
        let line = format!(
            "{} {precision:?}: the join's peak {:.1} MiB, the state it keeps {:.1} MiB, \
             the whole fp32 model {:.1} MiB",
            shard.name(),
            mib(peak),
            mib(state),
            mib(whole)
        );
        println!("{line}");
        assert!(
            peak <= state + whole / 4,
            "the joining rank held more than a quarter of the model beyond its state: {line}"
        );
        lines.push(line);
    }
    println!("{}", lines.join("\n"));
}
