//! On-policy distillation (docs/architecture.md, "Objectives"): the per-token reverse-KL
//! advantage of the student's sampled tokens, trained with DAPO's surrogate
//! (`dapo::dapo_loss` with per-token advantages).

use tch::Tensor;

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

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    fn t2(v: &[f64], b: i64, t: i64) -> Tensor {
        Tensor::from_slice(v).reshape([b, t])
    }

    fn values(t: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape([-1])).unwrap()
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
