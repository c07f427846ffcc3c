//! Reinforcement-learning objectives (DESIGN.md, "Objectives (learner)"): the DAPO
//! token-level clipped surrogate, group-normalised advantages, the dynamic-sampling
//! filter, the turn-count length penalty and the reverse-KL advantage of on-policy
//! distillation. SFT, DAgger and RFT use `loss::masked_cross_entropy`.
//!
//! Tensor functions take per-token log-probabilities ℓ = log π(token | prefix) of the
//! sampled tokens as `[B, T]` tensors aligned with a `[B, T]` mask (1 on trained tokens,
//! 0 on context and padding). They compute in the kind of `logprobs` (use `Kind::Double`
//! where exactness matters, as the tests do); masks and advantages are converted to it.

use tch::{Kind, Tensor};

/// Advantages as a `[B, 1]` or `[B, T]` tensor of `logprobs`' kind, detached.
fn token_advantages(advantages: &Tensor, logprobs: &Tensor) -> Tensor {
    let a = advantages.detach().to_kind(logprobs.kind());
    match a.dim() {
        1 => a.unsqueeze(1),
        2 => a,
        d => panic!("advantages must be [B] or [B, T], got {d} dimensions"),
    }
}

/// DAPO's clipped surrogate (no KL term), token-level:
///
/// loss = −(1/Σ mask) Σ mask · min(r·Â, clip(r, 1 − ε_low, 1 + ε_high)·Â),
/// r = exp(ℓ_θ − ℓ_old).
///
/// `logprobs` (ℓ_θ, differentiable) and `old_logprobs` (ℓ_old, recorded at sampling time)
/// are `[B, T]`; `advantages` is `[B]` (one Â per trajectory, broadcast over its tokens)
/// or `[B, T]` (per-token, e.g. `reverse_kl_advantage` for on-policy distillation);
/// `mask` is `[B, T]`. `old_logprobs` and `advantages` are constants (detached). The
/// normaliser is the number of trained tokens of the whole batch (token-level loss, not a
/// per-sequence mean); a batch with no trained token gives 0 (as `masked_cross_entropy`).
pub fn dapo_loss(
    logprobs: &Tensor,
    old_logprobs: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    eps_low: f64,
    eps_high: f64,
) -> Tensor {
    let kind = logprobs.kind();
    let adv = token_advantages(advantages, logprobs);
    let mask = mask.detach().to_kind(kind);
    let ratio = (logprobs - old_logprobs.detach().to_kind(kind)).exp();
    let unclipped = &ratio * &adv;
    let clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * &adv;
    let surrogate = unclipped.minimum(&clipped);
    let denom = mask.sum(kind).clamp_min(1.0);
    -(surrogate * &mask).sum(kind) / denom
}

/// The share of trained tokens whose clipped term is the active one in `dapo_loss` (they
/// get no gradient): `low` where Â < 0 and r < 1 − ε_low, `high` where Â > 0 and
/// r > 1 + ε_high. Both are fractions of Σ mask (0 for an empty mask).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipFraction {
    pub low: f64,
    pub high: f64,
}

impl ClipFraction {
    pub fn total(&self) -> f64 {
        self.low + self.high
    }
}

/// The clip fractions of `dapo_loss` on the same inputs (no gradient).
pub fn dapo_clip_fraction(
    logprobs: &Tensor,
    old_logprobs: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    eps_low: f64,
    eps_high: f64,
) -> ClipFraction {
    let _guard = tch::no_grad_guard();
    let lp = logprobs.to_kind(Kind::Double);
    let adv = token_advantages(advantages, &lp);
    let mask = mask.to_kind(Kind::Double);
    let ratio = (&lp - old_logprobs.to_kind(Kind::Double)).exp();
    let denom = mask.sum(Kind::Double).double_value(&[]).max(1.0);
    let low = ratio
        .lt(1.0 - eps_low)
        .logical_and(&adv.lt(0.0))
        .to_kind(Kind::Double)
        * &mask;
    let high = ratio
        .gt(1.0 + eps_high)
        .logical_and(&adv.gt(0.0))
        .to_kind(Kind::Double)
        * &mask;
    ClipFraction {
        low: low.sum(Kind::Double).double_value(&[]) / denom,
        high: high.sum(Kind::Double).double_value(&[]) / denom,
    }
}

/// Per-token advantage of on-policy distillation with the reverse KL:
/// Â_t = −(ℓ_student − ℓ_teacher) on the student's sampled tokens, 0 where `mask` is 0.
/// Inputs are `[B, T]`; the output has `student_logprobs`' kind and stays differentiable
/// (−mask w.r.t. ℓ_student, +mask w.r.t. ℓ_teacher): detach it before using it as a
/// constant advantage, e.g. `dapo_loss(ℓ_θ, ℓ_old, &adv.detach(), mask, ε_low, ε_high)`
/// with `adv` computed from ℓ_old.
pub fn reverse_kl_advantage(
    student_logprobs: &Tensor,
    teacher_logprobs: &Tensor,
    mask: &Tensor,
) -> Tensor {
    let kind = student_logprobs.kind();
    -(student_logprobs - teacher_logprobs.to_kind(kind)) * mask.detach().to_kind(kind)
}

/// Mean and population standard deviation (divides by n) of a non-empty slice.
fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// Group-normalised advantages Â_i = (R_i − mean_G)/(std_G + δ), over consecutive groups
/// of `group_size` rewards (the G samples of one task are adjacent).
///
/// std_G is the *population* standard deviation (divides by G, `unbiased=False` in
/// PyTorch terms): it is defined for every G ≥ 1 and a group of identical rewards gets
/// Â = 0 exactly. (The sample std would scale every Â by √((G−1)/G), a constant factor
/// the optimizer's learning rate absorbs.) A trailing partial group is normalised on its
/// own; `group_size == 0` means one group holding all rewards.
pub fn group_advantages(rewards: &[f64], group_size: usize, delta: f64) -> Vec<f64> {
    if rewards.is_empty() {
        return Vec::new();
    }
    let g = if group_size == 0 {
        rewards.len()
    } else {
        group_size
    };
    let mut out = Vec::with_capacity(rewards.len());
    for group in rewards.chunks(g) {
        let (mean, std) = mean_std(group);
        out.extend(group.iter().map(|r| (r - mean) / (std + delta)));
    }
    out
}

/// Dynamic sampling: a group is kept only if its rewards are not all equal (otherwise
/// every advantage is 0 and the group carries no gradient). An empty group is dropped.
pub fn keep_group(rewards: &[f64]) -> bool {
    match rewards.first() {
        None => false,
        Some(first) => rewards.iter().any(|r| r != first),
    }
}

/// Indices (0-based, in order) of the consecutive groups of `group_size` rewards that
/// `keep_group` keeps. Grouping as in `group_advantages`.
pub fn kept_groups(rewards: &[f64], group_size: usize) -> Vec<usize> {
    let g = if group_size == 0 {
        rewards.len().max(1)
    } else {
        group_size
    };
    rewards
        .chunks(g)
        .enumerate()
        .filter(|(_, group)| keep_group(group))
        .map(|(i, _)| i)
        .collect()
}

/// Dynamic-sampling filter over samples and their rewards (consecutive groups of
/// `group_size`): returns the samples and rewards of the groups `keep_group` keeps, in
/// order. The caller refills the batch by sampling more groups.
pub fn filter_groups<T: Clone>(
    samples: &[T],
    rewards: &[f64],
    group_size: usize,
) -> (Vec<T>, Vec<f64>) {
    assert_eq!(
        samples.len(),
        rewards.len(),
        "one reward per sample is required"
    );
    let g = if group_size == 0 {
        rewards.len().max(1)
    } else {
        group_size
    };
    let mut kept_samples = Vec::new();
    let mut kept_rewards = Vec::new();
    for k in kept_groups(rewards, g) {
        let range = k * g..((k + 1) * g).min(rewards.len());
        kept_samples.extend_from_slice(&samples[range.clone()]);
        kept_rewards.extend_from_slice(&rewards[range]);
    }
    (kept_samples, kept_rewards)
}

/// Turn-count length penalty: P = 0 if T < L_thr, else (L_thr − T)/(T_max − L_thr), i.e.
/// 0 at L_thr falling linearly to −1 at T_max. Never below −1: an episode longer than
/// T_max (which the step cap should prevent) gets −1.
///
/// Degenerate ramp (`t_max <= l_thr`): the ramp has no width, so the penalty is a step,
/// 0 for T ≤ L_thr and −1 for T > L_thr (the limit of the ramp as T_max → L_thr). No
/// division by zero, no panic.
pub fn turn_penalty(turns: u32, l_thr: u32, t_max: u32) -> f64 {
    if turns < l_thr {
        return 0.0;
    }
    if t_max <= l_thr {
        return if turns > l_thr { -1.0 } else { 0.0 };
    }
    let p = (l_thr as f64 - turns as f64) / (t_max as f64 - l_thr as f64);
    p.max(-1.0)
}

/// DAPO reward of one trajectory: resolved ∈ {0, 1} plus the turn penalty.
pub fn trajectory_reward(resolved: bool, turns: u32, l_thr: u32, t_max: u32) -> f64 {
    let base = if resolved { 1.0 } else { 0.0 };
    base + turn_penalty(turns, l_thr, t_max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t2(v: &[f64], b: i64, t: i64) -> Tensor {
        Tensor::from_slice(v).reshape([b, t])
    }

    fn close(a: f64, b: f64, tol: f64) {
        assert!((a - b).abs() <= tol, "{a} vs {b}");
    }

    fn values(t: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape([-1])).unwrap()
    }

    /// One sequence, four tokens, ε_low = 0.2, ε_high = 0.3, ℓ_old = 0.
    /// ℓ_θ = ln r for r = [1.5, 0.5, 1.1, 2.0]; mask = [1, 1, 1, 0].
    #[test]
    fn dapo_hand_computed_positive_advantage() {
        let r = [1.5f64, 0.5, 1.1, 2.0];
        let lp = t2(&r.map(f64::ln), 1, 4).set_requires_grad(true);
        let old = t2(&[0.0; 4], 1, 4);
        let mask = t2(&[1.0, 1.0, 1.0, 0.0], 1, 4);
        let adv = Tensor::from_slice(&[2.0f64]);
        // Â = 2: token 0: min(1.5·2, 1.3·2) = 2.6 (clipped high);
        //        token 1: min(0.5·2, 0.8·2) = 1.0 (unclipped: pessimistic side);
        //        token 2: min(1.1·2, 1.1·2) = 2.2; token 3 masked.
        // loss = −(2.6 + 1.0 + 2.2)/3 = −1.9333…
        let loss = dapo_loss(&lp, &old, &adv, &mask, 0.2, 0.3);
        close(loss.double_value(&[]), -(2.6 + 1.0 + 2.2) / 3.0, 1e-12);
        // d loss/d ℓ_j = −mask_j · Â · r_j / 3 where unclipped, 0 where clipped:
        // [0, −2·0.5/3, −2·1.1/3, 0].
        loss.backward();
        let g = values(&lp.grad());
        let want = [0.0, -1.0 / 3.0, -2.2 / 3.0, 0.0];
        for (a, b) in g.iter().zip(want) {
            close(*a, b, 1e-12);
        }
        let cf = dapo_clip_fraction(&lp, &old, &adv, &mask, 0.2, 0.3);
        // Only token 0 is clipped (high) among 3 trained tokens.
        close(cf.high, 1.0 / 3.0, 1e-12);
        close(cf.low, 0.0, 0.0);
    }

    #[test]
    fn dapo_hand_computed_negative_advantage_and_batch_normaliser() {
        // Two sequences, ℓ_old = 0, ε_low = 0.2, ε_high = 0.3.
        // seq 0: Â = −1, r = [0.5, 1.5]; seq 1: Â = 0.5, r = [1.0, 0.7], second masked out.
        let r = [0.5f64, 1.5, 1.0, 0.7];
        let lp = t2(&r.map(f64::ln), 2, 2).set_requires_grad(true);
        let old = t2(&[0.0; 4], 2, 2);
        let mask = t2(&[1.0, 1.0, 1.0, 0.0], 2, 2);
        let adv = Tensor::from_slice(&[-1.0f64, 0.5]);
        // seq 0 tok 0: min(−0.5, −0.8) = −0.8 (clipped low: no gradient)
        // seq 0 tok 1: min(−1.5, −1.3) = −1.5 (unclipped: the pessimistic side)
        // seq 1 tok 0: min(0.5, 0.5) = 0.5
        // loss = −(−0.8 − 1.5 + 0.5)/3 = 0.6  (3 trained tokens in the batch, not 2 means)
        let loss = dapo_loss(&lp, &old, &adv, &mask, 0.2, 0.3);
        close(loss.double_value(&[]), 0.6, 1e-12);
        loss.backward();
        // grads: [0, −(−1)·1.5/3, −0.5·1.0/3, 0] = [0, 0.5, −1/6, 0]
        let g = values(&lp.grad());
        for (a, b) in g.iter().zip([0.0, 0.5, -1.0 / 6.0, 0.0]) {
            close(*a, b, 1e-12);
        }
        let cf = dapo_clip_fraction(&lp, &old, &adv, &mask, 0.2, 0.3);
        close(cf.low, 1.0 / 3.0, 1e-12);
        close(cf.high, 0.0, 0.0);
        close(cf.total(), 1.0 / 3.0, 1e-12);
    }

    #[test]
    fn dapo_per_token_advantages_and_empty_mask() {
        // [B, T] advantages: r = 1 everywhere, Â = [1, −3], both trained: loss = −(1 − 3)/2 = 1.
        let lp = t2(&[0.0, 0.0], 1, 2);
        let adv = t2(&[1.0, -3.0], 1, 2);
        let mask = t2(&[1.0, 1.0], 1, 2);
        close(
            dapo_loss(&lp, &lp, &adv, &mask, 0.2, 0.28).double_value(&[]),
            1.0,
            1e-12,
        );
        let none = t2(&[0.0, 0.0], 1, 2);
        assert_eq!(
            dapo_loss(&lp, &lp, &adv, &none, 0.2, 0.28).double_value(&[]),
            0.0
        );
        let cf = dapo_clip_fraction(&lp, &lp, &adv, &none, 0.2, 0.28);
        assert_eq!((cf.low, cf.high), (0.0, 0.0));
    }

    #[test]
    fn group_advantages_hand_computed() {
        // Group [1, 0, 0, 1]: mean 0.5, population std 0.5, δ = 0 → [1, −1, −1, 1].
        // Group [1, 0, 0, 0]: mean 0.25, var = (0.5625 + 3·0.0625)/4 = 0.1875,
        //   std = 0.4330127…; Â = [0.75/std, −0.25/std ×3] = [1.7320508, −0.5773503 ×3].
        // Group [0.5, 0.5, 0.5, 0.5]: all equal → 0 (δ keeps the division finite).
        let r = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5];
        let a = group_advantages(&r, 4, 0.0);
        let s = 0.1875f64.sqrt();
        let want = [
            1.0,
            -1.0,
            -1.0,
            1.0,
            0.75 / s,
            -0.25 / s,
            -0.25 / s,
            -0.25 / s,
        ];
        for (x, y) in a[..8].iter().zip(want) {
            close(*x, y, 1e-12);
        }
        close(a[4], 3f64.sqrt(), 1e-12);
        let a = group_advantages(&r, 4, 1e-6);
        assert!(a[8..].iter().all(|x| *x == 0.0));
        // δ = 1 on the first group: (1 − 0.5)/(0.5 + 1) = 1/3.
        close(group_advantages(&r[..4], 4, 1.0)[0], 1.0 / 3.0, 1e-12);
        // Partial trailing group [1, 0] of size 2 normalised alone: ±1 with δ = 0.
        let p = group_advantages(&[1.0, 1.0, 0.0, 1.0, 0.0], 3, 0.0);
        close(p[3], 1.0, 1e-12);
        close(p[4], -1.0, 1e-12);
        // group_size 0: one group.
        assert_eq!(
            group_advantages(&[1.0, 0.0], 0, 0.0),
            group_advantages(&[1.0, 0.0], 2, 0.0)
        );
        assert!(group_advantages(&[], 4, 1e-6).is_empty());
    }

    #[test]
    fn dynamic_sampling_filter() {
        assert!(!keep_group(&[1.0, 1.0, 1.0]));
        assert!(!keep_group(&[0.0, 0.0]));
        assert!(!keep_group(&[]));
        assert!(keep_group(&[1.0, 0.0, 1.0]));
        // Penalties make otherwise equal outcomes different: kept.
        assert!(keep_group(&[1.0, 1.0 - 0.25]));
        // Groups of 2: [0, 0] dropped, [1, 0] kept, [1, 1] dropped, [0.5, 0.25] kept.
        let rewards = [0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5, 0.25];
        assert_eq!(kept_groups(&rewards, 2), vec![1, 3]);
        let samples = ["a", "b", "c", "d", "e", "f", "g", "h"];
        let (s, r) = filter_groups(&samples, &rewards, 2);
        assert_eq!(s, vec!["c", "d", "g", "h"]);
        assert_eq!(r, vec![1.0, 0.0, 0.5, 0.25]);
        // Groups of 4: [0, 0, 1, 0] and [1, 1, 0.5, 0.25] both kept.
        assert_eq!(kept_groups(&rewards, 4), vec![0, 1]);
        // Groups of 3 (last one partial): [0, 0, 1] kept, [0, 1, 1] kept, [0.5, 0.25] kept;
        // [1, 1, 1] | [0, 0, 0] | [2]: nothing kept.
        assert_eq!(kept_groups(&rewards, 3), vec![0, 1, 2]);
        assert!(kept_groups(&[1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 2.0], 3).is_empty());
        let (s, r) = filter_groups(&samples[..6], &[1.0, 1.0, 1.0, 0.0, 0.5, 0.0], 3);
        assert_eq!(s, vec!["d", "e", "f"]);
        assert_eq!(r, vec![0.0, 0.5, 0.0]);
    }

    #[test]
    fn turn_penalty_hand_computed() {
        // L_thr = 30, T_max = 40: 0 below 30, (30 − T)/10 from 30 on, −1 at 40.
        assert_eq!(turn_penalty(0, 30, 40), 0.0);
        assert_eq!(turn_penalty(29, 30, 40), 0.0);
        assert_eq!(turn_penalty(30, 30, 40), 0.0);
        close(turn_penalty(35, 30, 40), -0.5, 1e-12);
        close(turn_penalty(33, 30, 40), -0.3, 1e-12);
        assert_eq!(turn_penalty(40, 30, 40), -1.0);
        assert_eq!(turn_penalty(55, 30, 40), -1.0);
        // Degenerate ramps: a step at L_thr, never NaN or infinite.
        assert_eq!(turn_penalty(40, 40, 40), 0.0);
        assert_eq!(turn_penalty(41, 40, 40), -1.0);
        assert_eq!(turn_penalty(10, 40, 20), 0.0);
        assert_eq!(turn_penalty(45, 40, 20), -1.0);
        // reward = resolved + penalty: 1 + (30 − 35)/10 = 0.5.
        close(trajectory_reward(true, 35, 30, 40), 0.5, 1e-12);
        assert_eq!(trajectory_reward(false, 10, 30, 40), 0.0);
        assert_eq!(trajectory_reward(true, 10, 30, 40), 1.0);
    }

    #[test]
    fn reverse_kl_advantage_hand_computed() {
        // ℓ_s = [−1, −2, −0.5], ℓ_t = [−1.5, −1, −0.5], mask = [1, 1, 0]:
        // Â = −(ℓ_s − ℓ_t)·mask = [−0.5, 1, 0].
        let s = t2(&[-1.0, -2.0, -0.5], 1, 3).set_requires_grad(true);
        let t = t2(&[-1.5, -1.0, -0.5], 1, 3);
        let m = t2(&[1.0, 1.0, 0.0], 1, 3);
        let a = reverse_kl_advantage(&s, &t, &m);
        assert_eq!(values(&a), vec![-0.5, 1.0, 0.0]);
        a.sum(Kind::Double).backward();
        assert_eq!(values(&s.grad()), vec![-1.0, -1.0, 0.0]);
    }
}
