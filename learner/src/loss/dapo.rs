//! DAPO (docs/architecture.md, "Objectives"): the token-level clipped surrogate and its
//! clip fractions, the policy-gradient examples and padded batch it trains on (per-token
//! advantages and the sampler's log-probs), and the trainer's DAPO step
//! (`Trainer::dapo_step`). On-policy distillation trains with the same surrogate on
//! `distill::reverse_kl_advantage`.

use tch::{Device, Kind, Tensor};

use crate::loss::chunked::{chunked_logprob_loss, pass_chunk, shifted_positions};
use crate::trainer::{micro_batch_ranges, StepError, StepReport, Trainer};

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

/// One trajectory for a policy-gradient step. All vectors are aligned with `tokens`:
/// `loss_mask[j]` says whether token j is trained, `advantages[j]` is its Â and
/// `old_logprobs[j]` is log π_old(token j | tokens before j) as the sampler recorded it.
#[derive(Debug, Clone, PartialEq)]
pub struct RlExample {
    pub tokens: Vec<u32>,
    pub loss_mask: Vec<bool>,
    pub advantages: Vec<f32>,
    pub old_logprobs: Vec<f32>,
}

/// A right-padded policy-gradient batch. Targets are shifted: column j of `mask`,
/// `advantages` and `old_logprobs` (`[B, T − 1]`) is about token j + 1, which position j
/// predicts; the first token of a row has no prefix and is never trained.
pub struct RlBatch {
    pub input_ids: Tensor,
    pub attention_mask: Tensor,
    pub mask: Tensor,
    pub advantages: Tensor,
    pub old_logprobs: Tensor,
    pub label_tokens: u64,
}

impl RlBatch {
    pub fn new(examples: &[RlExample], device: Device) -> Self {
        let t = examples
            .iter()
            .map(|e| e.tokens.len())
            .max()
            .unwrap_or(0)
            .max(2);
        let b = examples.len();
        let mut ids = vec![0i64; b * t];
        let mut attn = vec![0i64; b * t];
        let mut mask = vec![0f32; b * (t - 1)];
        let mut adv = vec![0f32; b * (t - 1)];
        let mut old = vec![0f32; b * (t - 1)];
        let mut label_tokens = 0u64;
        for (i, e) in examples.iter().enumerate() {
            for (j, &tok) in e.tokens.iter().enumerate() {
                ids[i * t + j] = tok as i64;
                attn[i * t + j] = 1;
                if j > 0 && e.loss_mask.get(j).copied().unwrap_or(false) {
                    let k = i * (t - 1) + j - 1;
                    mask[k] = 1.0;
                    adv[k] = e.advantages.get(j).copied().unwrap_or(0.0);
                    old[k] = e.old_logprobs.get(j).copied().unwrap_or(0.0);
                    label_tokens += 1;
                }
            }
        }
        let full = [b as i64, t as i64];
        let shifted = [b as i64, t as i64 - 1];
        Self {
            input_ids: Tensor::from_slice(&ids).reshape(full).to(device),
            attention_mask: Tensor::from_slice(&attn).reshape(full).to(device),
            mask: Tensor::from_slice(&mask).reshape(shifted).to(device),
            advantages: Tensor::from_slice(&adv).reshape(shifted).to(device),
            old_logprobs: Tensor::from_slice(&old).reshape(shifted).to(device),
            label_tokens,
        }
    }
}

/// log π(token j + 1 | tokens ≤ j) for every position j < T − 1: `[B, T − 1]` in f32,
/// differentiable, from `[B, T, V]` logits of the full sequences.
pub fn token_logprobs(logits: &Tensor, input_ids: &Tensor) -> Tensor {
    let (b, t, v) = logits.size3().expect("logits must be [B, T, V]");
    let pred = logits.narrow(1, 0, t - 1).reshape([b * (t - 1), v]);
    let target = input_ids.narrow(1, 1, t - 1).reshape([b * (t - 1), 1]);
    pred.log_softmax(-1, Kind::Float)
        .gather(1, &target, false)
        .reshape([b, t - 1])
}

/// `dapo_loss × label_tokens` of a batch (the surrogate summed over its trained tokens),
/// computed at the trained positions only, the head run on `chunk` rows at a time
/// (`chunked`; each chunk's sum is `dapo_loss` on it times its length): the same value
/// and gradients.
pub fn chunked_dapo_sum(
    policy: &tutor_policy::Policy,
    batch: &RlBatch,
    eps_low: f64,
    eps_high: f64,
    chunk: i64,
) -> Tensor {
    let (rows, shifted, targets) = shifted_positions(&batch.input_ids, &batch.mask);
    // Each a [1, N] row of the trained positions, as `dapo_loss` takes it.
    let pick = |t: &Tensor| {
        t.reshape([-1])
            .index_select(0, &shifted)
            .to_kind(Kind::Float)
            .unsqueeze(0)
    };
    let old = pick(&batch.old_logprobs);
    let adv = pick(&batch.advantages);
    let hidden = policy.forward_hidden(&batch.input_ids, &batch.attention_mask);
    chunked_logprob_loss(policy, &hidden, &rows, &targets, chunk, |lp, start, len| {
        let mask = Tensor::ones([1, len], (Kind::Float, lp.device()));
        dapo_loss(
            &lp.unsqueeze(0),
            &old.narrow(1, start, len),
            &adv.narrow(1, start, len),
            &mask,
            eps_low,
            eps_high,
        ) * len as f64
    })
}

impl Trainer {
    /// One DAPO optimizer step on this rank's share of a batch: the clipped surrogate
    /// −Σ min(r·Â, clip(r, 1 − ε_low, 1 + ε_high)·Â), r = exp(ℓ_θ − ℓ_old), summed over
    /// the trained tokens of every micro-batch, divided by the trained tokens of all ranks
    /// (DAPO's token-level normalisation), no KL; clipping and AdamW as in `step`. ε from
    /// `LearnerConfig::clip_eps_low/high`. The reported loss is the surrogate's value
    /// before the update.
    pub fn dapo_step(&mut self, examples: &[RlExample]) -> Result<StepReport, StepError> {
        let Some(start) = self.begin_step(examples.is_empty()) else {
            return Ok(self.idle_report());
        };
        let (eps_low, eps_high) = (self.config().clip_eps_low, self.config().clip_eps_high);
        let runs = micro_batch_ranges(
            examples.iter().map(|e| e.tokens.len()),
            self.config().micro_batch_tokens,
        );
        let device = self.policy().device();
        let batches = runs
            .into_iter()
            .map(|run| RlBatch::new(&examples[run], device));
        let budget = self.config().logits_budget_mb;
        self.run_passes(start, batches, |policy, batch| {
            if batch.label_tokens == 0 {
                return None;
            }
            if let Some(chunk) = pass_chunk(budget, policy, batch.input_ids.numel() as i64) {
                let sum = chunked_dapo_sum(policy, batch, eps_low, eps_high, chunk);
                return Some((sum, batch.label_tokens));
            }
            let logits = policy.forward(&batch.input_ids, &batch.attention_mask);
            let lp = token_logprobs(&logits, &batch.input_ids);
            // dapo_loss is the mean over this pass's tokens; its sum adds up across passes
            // and ranks, and `finish_step` divides by the total once.
            let sum = dapo_loss(
                &lp,
                &batch.old_logprobs,
                &batch.advantages,
                &batch.mask,
                eps_low,
                eps_high,
            ) * batch.label_tokens as f64;
            Some((sum, batch.label_tokens))
        })
    }

    /// DAPO's surrogate loss and clip fractions of a batch under the current weights, no
    /// update (one pass). An error with `shard = "full"` (no parameters between steps).
    pub fn eval_dapo(&self, examples: &[RlExample]) -> anyhow::Result<(f64, ClipFraction)> {
        self.check_whole_parameters("eval_dapo")?;
        let _guard = tch::no_grad_guard();
        let batch = RlBatch::new(examples, self.policy().device());
        let logits = self
            .policy()
            .forward(&batch.input_ids, &batch.attention_mask);
        let lp = token_logprobs(&logits, &batch.input_ids);
        let (lo, hi) = (self.config().clip_eps_low, self.config().clip_eps_high);
        let loss = dapo_loss(
            &lp,
            &batch.old_logprobs,
            &batch.advantages,
            &batch.mask,
            lo,
            hi,
        );
        let cf = dapo_clip_fraction(
            &lp,
            &batch.old_logprobs,
            &batch.advantages,
            &batch.mask,
            lo,
            hi,
        );
        Ok((loss.double_value(&[]), cf))
    }
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
}
