//! What the learner's multi-rank tests share: the tiny student, parameter snapshots and
//! how far two snapshots are apart.

#![allow(dead_code)] // each test binary uses its own part

use tch::{Device, Kind};
use tutor_learner::Trainer;
use tutor_policy::{ModelConfig, Policy};

/// Parameter name and values (as f32), in name order.
pub type Snapshot = Vec<(String, Vec<f32>)>;

/// A two-layer student small enough for several ranks in one test process.
pub fn tiny_policy(seed: i64) -> Policy {
    let mut mc = ModelConfig::tiny(64);
    mc.hidden_size = 32;
    mc.intermediate_size = 64;
    mc.head_dim = 8;
    Policy::new(mc, Device::Cpu, seed)
}

/// The trainer's parameters (bf16 ones widened to f32).
pub fn params(t: &Trainer) -> Snapshot {
    t.named_parameters()
        .map(|(n, p)| {
            let v = p.to_kind(Kind::Float).reshape([-1]);
            (n.to_string(), Vec::try_from(v).unwrap())
        })
        .collect()
}

/// Largest over tensors of max|a − b| / max|b|.
pub fn max_rel_diff(a: &Snapshot, b: &Snapshot) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f64;
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let scale = vb
            .iter()
            .fold(0f64, |m, x| m.max(x.abs() as f64))
            .max(1e-12);
        let diff = va
            .iter()
            .zip(vb)
            .fold(0f64, |m, (x, y)| m.max((x - y).abs() as f64));
        worst = worst.max(diff / scale);
    }
    worst
}

/// A field of /proc/self/status in KiB (`VmRSS:`, `VmHWM:`).
pub fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"))
}
