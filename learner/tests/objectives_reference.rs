//! The learner's objectives against a PyTorch reference (tests/reference/objectives_ref.py):
//! seeded random inputs go to the script as JSON; its values and autograd gradients come
//! back and are compared with ours (tch autograd). Everything is float64 (tolerance 1e-9)
//! except the cross-entropy, whose implementation computes in float32 (tolerance 1e-5).
//!
//! The interpreter is $TUTOR_PYTHON, else the workspace venv (.venv/bin/python) that
//! `make setup` creates with torch. Without it the test fails; it never skips.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};
use tch::{Kind, Tensor};
use tutor_coordinator::rewards::group_advantages;
use tutor_learner::loss::{
    dapo_clip_fraction, dapo_loss, masked_cross_entropy, reverse_kl_advantage,
};

const TOL_F64: f64 = 1e-9;
const TOL_F32: f64 = 1e-5;

/// SplitMix64: a fixed-seed generator, so the inputs are the same on every run.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }
    fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
    /// A [b, t] 0/1 mask with probability `p` of 1 and at least one 1 per row.
    fn mask(&mut self, b: usize, t: usize, p: f64) -> Vec<f64> {
        let mut m: Vec<f64> = (0..b * t)
            .map(|_| (self.uniform(0.0, 1.0) < p) as u8 as f64)
            .collect();
        for row in 0..b {
            if m[row * t..(row + 1) * t].iter().all(|x| *x == 0.0) {
                m[row * t + (self.next_u64() as usize % t)] = 1.0;
            }
        }
        m
    }
}

fn python() -> PathBuf {
    match std::env::var_os("TUTOR_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python"),
    }
}

/// Runs the reference script on `input` and returns its output.
fn run_reference(input: &Value) -> Value {
    run_reference_with(&python(), input)
}

/// Runs the reference script with interpreter `py`; panics (with the `make setup` hint)
/// if it cannot be started or fails (e.g. torch is missing: exit status 3).
fn run_reference_with(py: &Path, input: &Value) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let in_path = dir.path().join("in.json");
    let out_path = dir.path().join("out.json");
    std::fs::write(&in_path, serde_json::to_vec(input).unwrap()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/objectives_ref.py");
    let output = Command::new(py)
        .arg(&script)
        .arg(&in_path)
        .arg(&out_path)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run the PyTorch reference with {} ({e}): run `make setup` \
                 (or set TUTOR_PYTHON to a Python with torch)",
                py.display()
            )
        });
    assert!(
        output.status.success(),
        "the PyTorch reference failed ({}) with {}: run `make setup` (or set TUTOR_PYTHON \
         to a Python with torch)\nstderr:\n{}",
        output.status,
        py.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&std::fs::read(&out_path).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("expected an array, got {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn values(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape([-1])).unwrap()
}

fn assert_close(what: &str, ours: &[f64], reference: &[f64], tol: f64) {
    assert_eq!(ours.len(), reference.len(), "{what}: lengths differ");
    for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
        assert!(
            (a - b).abs() <= tol * b.abs().max(1.0),
            "{what}[{i}]: ours {a} vs PyTorch {b} (tolerance {tol})"
        );
    }
}

fn t64(v: &[f64], shape: &[usize]) -> Tensor {
    let shape: Vec<i64> = shape.iter().map(|d| *d as i64).collect();
    Tensor::from_slice(v).reshape(shape.as_slice())
}

struct DapoCase {
    b: usize,
    t: usize,
    logprobs: Vec<f64>,
    old_logprobs: Vec<f64>,
    advantages: Vec<f64>,
    adv_shape: Vec<usize>,
    mask: Vec<f64>,
    eps_low: f64,
    eps_high: f64,
}

impl DapoCase {
    fn to_json(&self) -> Value {
        json!({
            "shape": [self.b, self.t],
            "logprobs": self.logprobs,
            "old_logprobs": self.old_logprobs,
            "advantages": self.advantages,
            "adv_shape": self.adv_shape,
            "mask": self.mask,
            "eps_low": self.eps_low,
            "eps_high": self.eps_high,
        })
    }

    fn advantage_at(&self, i: usize) -> f64 {
        if self.adv_shape.len() == 1 {
            self.advantages[i / self.t]
        } else {
            self.advantages[i]
        }
    }

    /// How many trained tokens fall in each regime: (r < 1 − ε_low, r > 1 + ε_high) ×
    /// (Â > 0, Â < 0). The reference comparison is only meaningful if all four occur.
    fn regimes(&self) -> [usize; 4] {
        let mut n = [0; 4];
        for i in 0..self.b * self.t {
            if self.mask[i] == 0.0 {
                continue;
            }
            let r = (self.logprobs[i] - self.old_logprobs[i]).exp();
            let a = self.advantage_at(i);
            let below = r < 1.0 - self.eps_low;
            let above = r > 1.0 + self.eps_high;
            match (below, above, a > 0.0, a < 0.0) {
                (true, _, true, _) => n[0] += 1,
                (true, _, _, true) => n[1] += 1,
                (_, true, true, _) => n[2] += 1,
                (_, true, _, true) => n[3] += 1,
                _ => {}
            }
        }
        n
    }
}

/// Log-probs in (−4, 0) and old log-probs shifted by up to ±0.7, so the ratios
/// exp(ℓ − ℓ_old) span about [0.5, 2], beyond both clip bounds.
fn dapo_case(rng: &mut Rng, b: usize, t: usize, per_token: bool, eps: (f64, f64)) -> DapoCase {
    let logprobs = rng.vec(b * t, -4.0, -1e-3);
    let old_logprobs = logprobs
        .iter()
        .map(|l| l + rng.uniform(-0.7, 0.7))
        .collect();
    let (advantages, adv_shape) = if per_token {
        (rng.vec(b * t, -2.0, 2.0), vec![b, t])
    } else {
        // Both signs and a zero advantage (a sequence that carries no gradient).
        let mut a = rng.vec(b, -2.0, 2.0);
        a[0] = a[0].abs().max(0.1);
        a[1] = -a[1].abs().max(0.1);
        a[2] = 0.0;
        (a, vec![b])
    };
    DapoCase {
        b,
        t,
        logprobs,
        old_logprobs,
        advantages,
        adv_shape,
        mask: rng.mask(b, t, 0.7),
        eps_low: eps.0,
        eps_high: eps.1,
    }
}

#[test]
fn objectives_match_pytorch() {
    let mut rng = Rng(0x0074_7574_6f72);

    // Masked cross-entropy from logits (f32 values, so both sides see the same inputs).
    let (cb, ct, cv) = (3usize, 7usize, 11usize);
    let logits: Vec<f64> = rng
        .vec(cb * ct * cv, -3.0, 3.0)
        .into_iter()
        .map(|x| x as f32 as f64)
        .collect();
    let ids: Vec<i64> = (0..cb * ct)
        .map(|_| (rng.next_u64() % cv as u64) as i64)
        .collect();
    let ce_mask = rng.mask(cb, ct, 0.6);

    let dapo_cases = [
        dapo_case(&mut rng, 6, 9, false, (0.2, 0.28)),
        dapo_case(&mut rng, 5, 8, true, (0.2, 0.3)),
        dapo_case(&mut rng, 4, 10, false, (0.2, 0.26)),
    ];
    for (k, c) in dapo_cases.iter().enumerate() {
        let n = c.regimes();
        assert!(
            n.iter().all(|x| *x > 0),
            "DAPO case {k} does not cover every clip regime: {n:?}"
        );
    }

    let (kb, kt) = (4usize, 6usize);
    let student = rng.vec(kb * kt, -5.0, -1e-3);
    let teacher = rng.vec(kb * kt, -5.0, -1e-3);
    let kl_mask = rng.mask(kb, kt, 0.7);
    let kl_weights = rng.vec(kb * kt, -1.0, 1.0);

    // 5 groups of G = 6: DAPO-like rewards (resolved + turn penalty), one group all equal.
    let group_size = 6;
    let mut rewards: Vec<f64> = (0..30)
        .map(|_| {
            let resolved = (rng.uniform(0.0, 1.0) < 0.4) as u8 as f64;
            let penalty = if rng.uniform(0.0, 1.0) < 0.5 {
                -rng.uniform(0.0, 1.0)
            } else {
                0.0
            };
            resolved + penalty
        })
        .collect();
    rewards[12..18].fill(1.0);
    let delta = 1e-6;

    let input = json!({
        "ce": {"shape": [cb, ct, cv], "logits": logits, "ids": ids, "mask": ce_mask},
        "dapo": dapo_cases.iter().map(DapoCase::to_json).collect::<Vec<_>>(),
        "reverse_kl": {
            "shape": [kb, kt], "student": student, "teacher": teacher,
            "mask": kl_mask, "weights": kl_weights,
        },
        "group_adv": {"rewards": rewards, "group_size": group_size, "delta": delta},
    });
    let reference = run_reference(&input);

    // Cross-entropy: value and gradient w.r.t. the logits.
    {
        let lg = Tensor::from_slice(&logits.iter().map(|x| *x as f32).collect::<Vec<_>>())
            .reshape([cb as i64, ct as i64, cv as i64])
            .set_requires_grad(true);
        let id = Tensor::from_slice(&ids).reshape([cb as i64, ct as i64]);
        let m = Tensor::from_slice(&ce_mask.iter().map(|x| *x as f32).collect::<Vec<_>>())
            .reshape([cb as i64, ct as i64]);
        let loss = masked_cross_entropy(&lg, &id, &m);
        loss.backward();
        let r = &reference["ce"];
        assert_close(
            "ce loss",
            &[loss.double_value(&[])],
            &[r["loss"].as_f64().unwrap()],
            TOL_F32,
        );
        assert_close(
            "ce grad",
            &values(&lg.grad()),
            &floats(&r["grad_logits"]),
            TOL_F32,
        );
    }

    // DAPO: value, gradient w.r.t. ℓ_θ and clip fractions.
    for (k, c) in dapo_cases.iter().enumerate() {
        let r = &reference["dapo"][k];
        let lp = t64(&c.logprobs, &[c.b, c.t]).set_requires_grad(true);
        let old = t64(&c.old_logprobs, &[c.b, c.t]);
        let adv = t64(&c.advantages, &c.adv_shape);
        let mask = t64(&c.mask, &[c.b, c.t]);
        let loss = dapo_loss(&lp, &old, &adv, &mask, c.eps_low, c.eps_high);
        loss.backward();
        assert_close(
            &format!("dapo[{k}] loss"),
            &[loss.double_value(&[])],
            &[r["loss"].as_f64().unwrap()],
            TOL_F64,
        );
        assert_close(
            &format!("dapo[{k}] grad"),
            &values(&lp.grad()),
            &floats(&r["grad_logprobs"]),
            TOL_F64,
        );
        let cf = dapo_clip_fraction(&lp, &old, &adv, &mask, c.eps_low, c.eps_high);
        assert_close(
            &format!("dapo[{k}] clip fractions"),
            &[cf.low, cf.high],
            &[
                r["clip_low"].as_f64().unwrap(),
                r["clip_high"].as_f64().unwrap(),
            ],
            TOL_F64,
        );
        assert!(cf.low > 0.0 && cf.high > 0.0, "dapo[{k}]: {cf:?}");
    }

    // Reverse-KL advantage: values and the gradients of Σ w·Â.
    {
        let r = &reference["reverse_kl"];
        let s = t64(&student, &[kb, kt]).set_requires_grad(true);
        let t = t64(&teacher, &[kb, kt]).set_requires_grad(true);
        let m = t64(&kl_mask, &[kb, kt]);
        let w = t64(&kl_weights, &[kb, kt]);
        let adv = reverse_kl_advantage(&s, &t, &m);
        (&adv * &w).sum(Kind::Double).backward();
        assert_close(
            "reverse-KL advantage",
            &values(&adv),
            &floats(&r["advantage"]),
            TOL_F64,
        );
        assert_close(
            "reverse-KL grad student",
            &values(&s.grad()),
            &floats(&r["grad_student"]),
            TOL_F64,
        );
        assert_close(
            "reverse-KL grad teacher",
            &values(&t.grad()),
            &floats(&r["grad_teacher"]),
            TOL_F64,
        );
    }

    // Group-normalised advantages.
    let ours = group_advantages(&rewards, group_size, delta);
    assert!(ours[12..18].iter().all(|a| *a == 0.0));
    assert_close(
        "group advantages",
        &ours,
        &floats(&reference["group_adv"]["advantages"]),
        TOL_F64,
    );
}

/// The message of the panic of `f`.
fn panic_message(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
    let err = std::panic::catch_unwind(f).expect_err("expected a failure");
    err.downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn a_missing_interpreter_or_torch_fails_with_the_setup_hint() {
    // No interpreter at all.
    let msg = panic_message(|| {
        run_reference_with(Path::new("/nonexistent/tutor-python"), &json!({}));
    });
    assert!(msg.contains("make setup"), "{msg}");
    // An interpreter that fails (as the script does when torch cannot be imported).
    let msg = panic_message(|| {
        run_reference_with(Path::new("false"), &json!({}));
    });
    assert!(msg.contains("make setup"), "{msg}");
}
