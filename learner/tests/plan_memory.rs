//! `tutor plan`'s arithmetic (`tutor_learner::plan`) against what the CPU learner really
//! allocates. Each case runs in a child process of its own (this test binary again, with
//! `PLAN_MEMORY_CHILD` set), with glibc's mmap threshold fixed so that freed tensors go
//! back to the system at once (`MALLOC_MMAP_THRESHOLD_`): the peak resident memory of a
//! first training step above the memory before it (VmHWM after a reset through
//! /proc/self/clear_refs) is then what the step allocated at its peak: the gradients and
//! AdamW moments (created by the first step), the activations and the logits. The plan's
//! figure for the same pieces must be within a factor of 1.5 of it, with and without
//! activation checkpointing and the logits budget.

mod common;

use std::process::Command;

use tutor_learner::config::LearnerConfig;
use tutor_learner::plan::{plan, PlanInput, Shard};
use tutor_learner::Trainer;
use tutor_policy::{ModelConfig, Policy};

use common::status_kib;

const CHILD: &str = "PLAN_MEMORY_CHILD";

fn model() -> ModelConfig {
    let mut model = ModelConfig::tiny(8192);
    model.hidden_size = 128;
    model.intermediate_size = 384;
    model.num_hidden_layers = 4;
    model.num_attention_heads = 4;
    model.num_key_value_heads = 2;
    model.head_dim = 32;
    model.max_position_embeddings = 4096;
    model
}

/// In the child: one first step of the case, printing the bytes its peak added.
fn measure(checkpoint: bool, budget: usize) {
    tch::set_num_threads(1);
    // 4 rows of 1024 tokens, the second half of each labels.
    let examples: Vec<(Vec<u32>, Vec<bool>)> = (0..4u32)
        .map(|r| {
            let ids = (0..1024u32).map(|j| 1 + (j * 7 + r * 13) % 8000).collect();
            let mask = (0..1024).map(|j| j >= 512).collect();
            (ids, mask)
        })
        .collect();
    let config = LearnerConfig {
        warmup_steps: 0,
        checkpoint_activations: checkpoint,
        logits_budget_mb: budget,
        ..LearnerConfig::default()
    };
    let mut trainer =
        Trainer::new(Policy::new(model(), tch::Device::Cpu, 1), config).expect("a trainer");
    std::fs::write("/proc/self/clear_refs", "5")
        .expect("resetting VmHWM through /proc/self/clear_refs");
    let before = status_kib("VmRSS:");
    trainer.step(&examples).expect("the step");
    let extra = status_kib("VmHWM:").saturating_sub(before) * 1024;
    println!("\nPEAK_BYTES {extra}");
}

#[test]
fn the_plan_matches_the_cpu_learners_peak_memory() {
    if let Ok(case) = std::env::var(CHILD) {
        let (checkpoint, budget) = case.split_once(',').expect("CASE is checkpoint,budget");
        measure(checkpoint == "true", budget.parse().expect("budget"));
        return;
    }
    let exe = std::env::current_exe().expect("this test binary");
    let mut lines = Vec::new();
    let mut worst = 1.0f64;
    for (checkpoint, budget) in [(false, 0usize), (true, 0), (false, 1), (true, 1)] {
        let out = Command::new(&exe)
            .args([
                "the_plan_matches_the_cpu_learners_peak_memory",
                "--exact",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD, format!("{checkpoint},{budget}"))
            .env("MALLOC_MMAP_THRESHOLD_", "131072")
            .output()
            .expect("running the child");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "the child failed: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let measured: f64 = text
            .lines()
            .find_map(|l| l.split("PEAK_BYTES ").nth(1))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no PEAK_BYTES in the child's output: {text}"));
        let p = plan(&PlanInput {
            model: model(),
            seq_len: 1024,
            pass_tokens: 4096,
            step_tokens: 4096,
            world_size: 1,
            mixed_precision: false,
            checkpoint_activations: checkpoint,
            logits_budget_mb: budget,
            gpu_memory: None,
            shard: Shard::None,
            bucket_mb: 64.0,
            prefetch: true,
        });
        let m = p.mode(Shard::None);
        // What the first step allocates: everything but the weights.
        let planned = m.grads + m.optimizer + m.activations + m.logits;
        let ratio = planned / measured;
        worst = if (ratio - 1.0).abs() > (worst - 1.0).abs() {
            ratio
        } else {
            worst
        };
        let mib = |b: f64| b / 1048576.0;
        lines.push(format!(
            "checkpoint {checkpoint}, budget {budget} MiB: planned {:.1} MiB (gradients and moments {:.1}, activations {:.1}, logits {:.1}), measured {:.1} MiB, ratio {ratio:.2}",
            mib(planned),
            mib(m.grads + m.optimizer),
            mib(m.activations),
            mib(m.logits),
            mib(measured)
        ));
    }
    println!("{}", lines.join("\n"));
    assert!(
        (1.0 / 1.5..=1.5).contains(&worst),
        "the plan is off by more than 1.5x:\n{}",
        lines.join("\n")
    );
}
