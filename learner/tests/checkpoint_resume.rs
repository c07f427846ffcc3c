//! Exact resume: a run interrupted by a checkpoint (or by SIGKILL) and resumed ends with
//! the same parameters as the run that was never interrupted.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use tch::Device;
use tutor_learner::checkpoint;
use tutor_learner::schedule::ScheduleKind;
use tutor_learner::{CpuCollective, LearnerConfig, Trainer};
use tutor_policy::{ModelConfig, Policy};

type Example = (Vec<u32>, Vec<bool>);

fn tiny_policy() -> Policy {
    let mut mc = ModelConfig::tiny(64);
    mc.hidden_size = 32;
    mc.intermediate_size = 64;
    mc.head_dim = 8;
    Policy::new(mc, Device::Cpu, 3)
}

/// Warmup then cosine, accumulation on: the schedule position and the optimizer state
/// both matter for the later steps.
fn config() -> LearnerConfig {
    LearnerConfig {
        learning_rate: 1e-2,
        warmup_steps: 2,
        schedule: ScheduleKind::Cosine,
        total_steps: 8,
        min_lr_ratio: 0.1,
        weight_decay: 0.05,
        micro_batch_tokens: 40,
        seed: 17,
        ..Default::default()
    }
}

/// The batch of step `k` (the data cursor is the next step's index).
fn batch(k: u64) -> Vec<Example> {
    let mut rng = ChaCha8Rng::seed_from_u64(1000 + k);
    (0..4)
        .map(|_| {
            let len = rng.gen_range(4..16);
            let ctx = rng.gen_range(1..len - 1);
            let tokens = (0..len).map(|_| rng.gen_range(1..64)).collect();
            (tokens, (0..len).map(|j| j >= ctx).collect())
        })
        .collect()
}

fn params(t: &Trainer) -> Vec<(String, Vec<f32>)> {
    t.named_parameters()
        .map(|(n, p)| (n.to_string(), Vec::try_from(p.reshape([-1])).unwrap()))
        .collect()
}

const N: u64 = 8;

fn uninterrupted() -> Vec<(String, Vec<f32>)> {
    let mut t = Trainer::new(tiny_policy(), config()).unwrap();
    for k in 0..N {
        t.step(&batch(k)).unwrap();
    }
    params(&t)
}

#[test]
fn resumed_run_equals_uninterrupted_run() {
    let mut straight = Trainer::new(tiny_policy(), config()).unwrap();
    let mut draws_straight = Vec::new();
    for k in 0..N {
        straight.step(&batch(k)).unwrap();
        draws_straight.push(straight.rng().next_u64());
    }

    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ckpt");
    let k = 3;
    let mut first = Trainer::new(tiny_policy(), config()).unwrap();
    let mut draws = Vec::new();
    for s in 0..k {
        first.step(&batch(s)).unwrap();
        draws.push(first.rng().next_u64());
    }
    first
        .save_checkpoint(&dir, &json!({ "next_step": k }), &[])
        .unwrap();
    drop(first);
    for f in [
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(dir.join(f).exists(), "{f} missing");
    }
    // The model part is a plain Hugging Face checkpoint.
    Policy::load_dir(&dir, Device::Cpu).unwrap();

    let (mut resumed, cursor) = Trainer::resume(&dir, Box::new(CpuCollective::solo())).unwrap();
    assert_eq!(cursor, json!({ "next_step": k }));
    assert_eq!(resumed.steps(), k);
    let next = cursor["next_step"].as_u64().unwrap();
    for s in next..N {
        let r = resumed.step(&batch(s)).unwrap();
        assert_eq!(r.learning_rate, config().lr_at(s));
        draws.push(resumed.rng().next_u64());
    }
    assert_eq!(
        draws, draws_straight,
        "the RNG continues where it was saved"
    );
    assert_eq!(resumed.steps(), N);
    // Same ops in the same order on the same device: equal to the bit.
    assert!(
        params(&resumed) == params(&straight),
        "parameters differ after resume"
    );

    // Resuming the weights alone (fresh optimizer, schedule from 0) does not match, so the
    // comparison above can fail.
    let mut weights_only =
        Trainer::new(Policy::load_dir(&dir, Device::Cpu).unwrap(), config()).unwrap();
    for s in next..N {
        weights_only.step(&batch(s)).unwrap();
    }
    assert!(params(&weights_only) != params(&straight));
}

fn master(t: &Trainer) -> Vec<(String, Vec<f32>)> {
    t.master_weights()
        .expect("bf16 training keeps master weights")
        .map(|(n, p)| (n.to_string(), Vec::try_from(p.reshape([-1])).unwrap()))
        .collect()
}

fn bf16_params(t: &Trainer) -> Vec<(String, Vec<f32>)> {
    t.named_parameters()
        .map(|(n, p)| {
            assert_eq!(p.kind(), tch::Kind::BFloat16, "{n}");
            let f = p.to_kind(tch::Kind::Float).reshape([-1]);
            (n.to_string(), Vec::try_from(f).unwrap())
        })
        .collect()
}

/// Mixed precision resumes exactly too: the checkpoint holds the fp32 master weights
/// beside the bf16 model (a Hugging Face checkpoint in bfloat16).
#[test]
fn bf16_resumed_run_equals_uninterrupted_run() {
    // See trainer/mod.rs `cap_onednn_isa`: bf16 products on the CPU stay off AMX.
    if std::env::var_os("ONEDNN_MAX_CPU_ISA").is_none() {
        std::env::set_var("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16");
    }
    let bf16 = || LearnerConfig {
        precision: tutor_learner::config::Precision::Bf16,
        ..config()
    };
    let mut straight = Trainer::new(tiny_policy(), bf16()).unwrap();
    for k in 0..N {
        straight.step(&batch(k)).unwrap();
    }
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ckpt");
    let k = 3;
    let mut first = Trainer::new(tiny_policy(), bf16()).unwrap();
    for s in 0..k {
        first.step(&batch(s)).unwrap();
    }
    first
        .save_checkpoint(&dir, &json!({ "next_step": k }), &[])
        .unwrap();
    let hf: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(hf["torch_dtype"], "bfloat16");
    let saved = tch::Tensor::read_safetensors(dir.join("model.safetensors")).unwrap();
    assert!(saved.iter().all(|(_, t)| t.kind() == tch::Kind::BFloat16));
    drop(first);

    let (mut resumed, _) = Trainer::resume(&dir, Box::new(CpuCollective::solo())).unwrap();
    for s in k..N {
        resumed.step(&batch(s)).unwrap();
    }
    assert!(
        master(&resumed) == master(&straight),
        "master weights differ after resume"
    );
    assert!(bf16_params(&resumed) == bf16_params(&straight));

    // The master is read from the checkpoint, not rebuilt from the bf16 weights (which
    // lose its low bits): without it, resuming is an error that names what is missing.
    let opt = dir.join("optimizer.safetensors");
    let kept: Vec<(String, tch::Tensor)> = tch::Tensor::read_safetensors(&opt)
        .unwrap()
        .into_iter()
        .filter(|(n, _)| !n.starts_with("master."))
        .collect();
    tch::Tensor::write_safetensors(&kept, &opt).unwrap();
    let err = Trainer::resume(&dir, Box::new(CpuCollective::solo()))
        .err()
        .unwrap();
    let err = format!("{err:#}");
    assert!(
        err.contains("master.") && err.contains("optimizer.safetensors"),
        "{err}"
    );
}

#[test]
fn resume_reports_what_is_missing() {
    let root = tempfile::tempdir().unwrap();
    let err = Trainer::resume(&root.path().join("nope"), Box::new(CpuCollective::solo()))
        .err()
        .unwrap();
    assert!(format!("{err:#}").contains("trainer_state.json"), "{err:#}");
    let dir = root.path().join("ckpt");
    let mut t = Trainer::new(tiny_policy(), config()).unwrap();
    t.save_checkpoint(&dir, &json!(0), &[]).unwrap();
    std::fs::remove_file(dir.join("optimizer.safetensors")).unwrap();
    let err = Trainer::resume(&dir, Box::new(CpuCollective::solo()))
        .err()
        .unwrap();
    assert!(
        format!("{err:#}").contains("optimizer.safetensors"),
        "{err:#}"
    );
}

const CHILD_DIR: &str = "TUTOR_LEARNER_SIGKILL_TEST_DIR";
const SELF_NAME: &str = "sigkill_mid_run_then_resume_equals_uninterrupted_run";

/// The learner process of the SIGKILL test: resumes from `dir/ckpt` if there is one,
/// checkpoints after every step, writes `dir/done` at the end.
fn child_run(dir: &Path) {
    let ckpt = dir.join("ckpt");
    let (mut t, next) = if checkpoint::exists(&ckpt) {
        let (t, cursor) = Trainer::resume(&ckpt, Box::new(CpuCollective::solo())).unwrap();
        (t, cursor.as_u64().unwrap())
    } else {
        (Trainer::new(tiny_policy(), config()).unwrap(), 0)
    };
    std::fs::write(dir.join(format!("started-at-{next}")), b"").unwrap();
    for k in next..N {
        t.step(&batch(k)).unwrap();
        t.save_checkpoint(&ckpt, &json!(k + 1), &[]).unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::write(dir.join("done"), b"").unwrap();
}

fn saved_steps(ckpt: &Path) -> Option<u64> {
    let dir = checkpoint::resolve(ckpt).ok()?;
    checkpoint::read_state(&dir).ok().map(|s| s.steps)
}

#[test]
fn sigkill_mid_run_then_resume_equals_uninterrupted_run() {
    if let Ok(dir) = std::env::var(CHILD_DIR) {
        child_run(Path::new(&dir));
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let ckpt = root.path().join("ckpt");
    let spawn = || {
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", SELF_NAME, "--nocapture", "--test-threads=1"])
            .env(CHILD_DIR, root.path())
            .spawn()
            .unwrap()
    };

    let mut child = spawn();
    let deadline = Instant::now() + Duration::from_secs(120);
    while saved_steps(&ckpt).unwrap_or(0) < 3 {
        assert!(Instant::now() < deadline, "the learner made no progress");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the learner exited early"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert!(
        !root.path().join("done").exists(),
        "killed after it finished"
    );
    let at_kill = saved_steps(&ckpt).unwrap();
    assert!(at_kill < N, "{at_kill}");

    let mut child = spawn();
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the resumed learner did not finish"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    assert!(root.path().join("done").exists());
    // It resumed rather than starting over.
    assert!(root.path().join(format!("started-at-{at_kill}")).exists());

    let (resumed, cursor) = Trainer::resume(&ckpt, Box::new(CpuCollective::solo())).unwrap();
    assert_eq!(cursor, json!(N));
    assert!(
        params(&resumed) == uninterrupted(),
        "parameters differ after kill -9 and resume"
    );
}
