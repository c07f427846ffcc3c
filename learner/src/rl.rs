//! The learner's policy-gradient side: examples with per-token advantages and the
//! sampler's log-probs, their padded batch, the model's per-token log-probs, and the DAPO
//! optimizer step (`Trainer::dapo_step`). `StepExamples` turns a `TrainBatch` into the
//! step its loss kind asks for.

use anyhow::Result;
use tch::{Device, Kind, Tensor};
use tutor_proto::{LossKind, TrainExample};

use crate::objectives::{dapo_clip_fraction, dapo_loss, ClipFraction};
use crate::trainer::{micro_batch_ranges, rank_shard, StepReport, Trainer};

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

/// The examples of one training step, by objective.
#[derive(Debug, Clone, PartialEq)]
pub enum StepExamples {
    /// Token-level cross-entropy on the label tokens (SFT, BC, DAgger, RFT).
    CrossEntropy(Vec<(Vec<u32>, Vec<bool>)>),
    /// DAPO's clipped surrogate.
    Dapo(Vec<RlExample>),
}

impl StepExamples {
    /// Examples in the batch.
    pub fn len(&self) -> usize {
        match self {
            StepExamples::CrossEntropy(e) => e.len(),
            StepExamples::Dapo(e) => e.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sha256 (hex) of the batch's content: every example's token ids and loss mask,
    /// and for DAPO its advantages and old log-probs, in order. Two runs whose learners
    /// saw the same digest at a step trained on the same numbers there.
    pub fn digest(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        let tokens = |h: &mut Sha256, tokens: &[u32], mask: &[bool]| {
            h.update((tokens.len() as u64).to_le_bytes());
            for t in tokens {
                h.update(t.to_le_bytes());
            }
            h.update((mask.len() as u64).to_le_bytes());
            h.update(mask.iter().map(|&m| m as u8).collect::<Vec<u8>>());
        };
        match self {
            StepExamples::CrossEntropy(e) => {
                h.update(b"cross-entropy");
                for (t, m) in e {
                    tokens(&mut h, t, m);
                }
            }
            StepExamples::Dapo(e) => {
                h.update(b"dapo");
                for x in e {
                    tokens(&mut h, &x.tokens, &x.loss_mask);
                    for v in x.advantages.iter().chain(&x.old_logprobs) {
                        h.update(v.to_bits().to_le_bytes());
                    }
                }
            }
        }
        hex::encode(h.finalize())
    }

    /// This rank's share of the batch (`trainer::rank_shard`).
    pub fn shard(&self, rank: usize, world_size: usize) -> Self {
        match self {
            StepExamples::CrossEntropy(e) => {
                StepExamples::CrossEntropy(rank_shard(e, rank, world_size))
            }
            StepExamples::Dapo(e) => StepExamples::Dapo(rank_shard(e, rank, world_size)),
        }
    }

    /// The step a batch's examples ask for. Every example of a batch must have the same
    /// loss kind, and a DAPO example one advantage and one old log-prob per token.
    pub fn from_proto(examples: Vec<TrainExample>) -> Result<Self, String> {
        let kind = examples
            .first()
            .map(|e| e.loss_kind)
            .unwrap_or(LossKind::CrossEntropy as i32);
        if let Some(e) = examples.iter().find(|e| e.loss_kind != kind) {
            return Err(format!(
                "a training batch mixes loss kinds ({kind} and {} at episode {} turn {}): \
                 the coordinator sends one kind per batch",
                e.loss_kind, e.episode_id, e.turn_index
            ));
        }
        match LossKind::try_from(kind) {
            Ok(LossKind::CrossEntropy) => Ok(Self::CrossEntropy(
                examples
                    .into_iter()
                    .map(|e| (e.tokens, e.loss_mask))
                    .collect(),
            )),
            Ok(LossKind::Dapo) => examples
                .into_iter()
                .map(|e| {
                    let n = e.tokens.len();
                    if e.loss_mask.len() != n
                        || e.advantages.len() != n
                        || e.old_logprobs.len() != n
                    {
                        return Err(format!(
                            "DAPO example of episode {} has {n} tokens but {} mask values, {} \
                             advantages and {} old log-probs (one each per token expected)",
                            e.episode_id,
                            e.loss_mask.len(),
                            e.advantages.len(),
                            e.old_logprobs.len()
                        ));
                    }
                    Ok(RlExample {
                        tokens: e.tokens,
                        loss_mask: e.loss_mask,
                        advantages: e.advantages,
                        old_logprobs: e.old_logprobs,
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Self::Dapo),
            Err(_) => Err(format!("unknown loss kind {kind} in a training batch")),
        }
    }
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

impl Trainer {
    /// One optimizer step of the objective `examples` ask for.
    pub fn train_step(&mut self, examples: &StepExamples) -> Result<StepReport> {
        match examples {
            StepExamples::CrossEntropy(e) => self.step(e),
            StepExamples::Dapo(e) => self.dapo_step(e),
        }
    }

    /// One DAPO optimizer step on this rank's share of a batch: the clipped surrogate
    /// −Σ min(r·Â, clip(r, 1 − ε_low, 1 + ε_high)·Â), r = exp(ℓ_θ − ℓ_old), summed over
    /// the trained tokens of every micro-batch, divided by the trained tokens of all ranks
    /// (DAPO's token-level normalisation), no KL; clipping and AdamW as in `step`. ε from
    /// `LearnerConfig::clip_eps_low/high`. The reported loss is the surrogate's value
    /// before the update.
    pub fn dapo_step(&mut self, examples: &[RlExample]) -> Result<StepReport> {
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
        self.run_passes(start, batches, |policy, batch| {
            if batch.label_tokens == 0 {
                return None;
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
    /// update (one pass).
    pub fn eval_dapo(&self, examples: &[RlExample]) -> (f64, ClipFraction) {
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
        (loss.double_value(&[]), cf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_changes_with_any_token_mask_or_order_and_only_then() {
        let a = (vec![1u32, 2, 3], vec![false, true, true]);
        let b = (vec![4u32, 5], vec![false, true]);
        let batch = StepExamples::CrossEntropy(vec![a.clone(), b.clone()]);
        let d = batch.digest();
        assert_eq!(d.len(), 64);
        assert_eq!(d, batch.clone().digest());
        let one_token = StepExamples::CrossEntropy(vec![(vec![1, 2, 4], a.1.clone()), b.clone()]);
        let one_mask = StepExamples::CrossEntropy(vec![(a.0.clone(), vec![true; 3]), b.clone()]);
        let swapped = StepExamples::CrossEntropy(vec![b.clone(), a.clone()]);
        // The same numbers split differently between examples.
        let regrouped = StepExamples::CrossEntropy(vec![
            (vec![1, 2, 3, 4], vec![false, true, true, false]),
            (vec![5], vec![true]),
        ]);
        let dapo = StepExamples::Dapo(vec![RlExample {
            tokens: a.0.clone(),
            loss_mask: a.1.clone(),
            advantages: vec![0.0, 1.0, 1.0],
            old_logprobs: vec![0.0, -0.5, -0.25],
        }]);
        let mut other = dapo.clone();
        if let StepExamples::Dapo(e) = &mut other {
            e[0].advantages[1] = -1.0;
        }
        let all = [
            d,
            one_token.digest(),
            one_mask.digest(),
            swapped.digest(),
            regrouped.digest(),
            dapo.digest(),
            other.digest(),
        ];
        for (i, x) in all.iter().enumerate() {
            for y in &all[i + 1..] {
                assert_ne!(x, y);
            }
        }
    }
}
