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

/// Group advantages, dynamic sampling and the turn penalty are tch-free: the coordinator
/// computes them (it owns the rewards) and they are re-exported here.
pub use tutor_coordinator::rewards::{
    filter_groups, group_advantages, keep_group, kept_groups, trajectory_reward, turn_penalty,
};

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
