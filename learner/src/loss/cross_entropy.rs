//! Cross-entropy on teacher labels (SFT, BC, DAgger, RFT): the padded batch, the masked
//! token-level loss, its packed-row form, and the trainer's step on it (`Trainer::step`,
//! plain or tree-packed). Only label tokens (teacher actions) contribute; the context is
//! attended to but never trained on.

use std::time::Instant;

use tch::{Kind, Tensor};

use crate::config::Packing;
use crate::loss::chunked::{chunked_weighted_nll, pass_chunk, shifted_positions};
use crate::packing::{pack_examples, pack_trunks, PackedBatch, TrunkBatch, TRUNK_BRANCH_DEPTH};
use crate::trainer::{micro_batch_ranges, micro_batches, StepError, StepReport, Trainer};

/// A padded batch ready for the model: right-padded token ids, the attention mask and
/// the loss mask (1 where the token is a label the model must predict).
pub struct PaddedBatch {
    pub input_ids: Tensor,
    pub attention_mask: Tensor,
    pub loss_mask: Tensor,
    pub label_tokens: u64,
}

impl PaddedBatch {
    /// Pads examples on the right to the longest one. `loss_mask[i][j]` says whether token
    /// j of example i is a label token.
    pub fn new(examples: &[(Vec<u32>, Vec<bool>)], device: tch::Device) -> Self {
        let max_len = examples
            .iter()
            .map(|(t, _)| t.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let n = examples.len();
        let mut ids = vec![0i64; n * max_len];
        let mut attn = vec![0i64; n * max_len];
        let mut lmask = vec![0f32; n * max_len];
        let mut label_tokens = 0u64;
        for (i, (tokens, mask)) in examples.iter().enumerate() {
            for (j, &t) in tokens.iter().enumerate() {
                ids[i * max_len + j] = t as i64;
                attn[i * max_len + j] = 1;
                // The first token has no prefix to be predicted from.
                if j > 0 && mask.get(j).copied().unwrap_or(false) {
                    lmask[i * max_len + j] = 1.0;
                    label_tokens += 1;
                }
            }
        }
        let shape = [n as i64, max_len as i64];
        Self {
            input_ids: Tensor::from_slice(&ids).reshape(shape).to(device),
            attention_mask: Tensor::from_slice(&attn).reshape(shape).to(device),
            loss_mask: Tensor::from_slice(&lmask).reshape(shape).to(device),
            label_tokens,
        }
    }
}

/// Mean next-token cross-entropy over label tokens (token-level mean over the batch).
/// `logits` is [B, T, V] from the full sequence; position j predicts token j + 1.
pub fn masked_cross_entropy(logits: &Tensor, input_ids: &Tensor, loss_mask: &Tensor) -> Tensor {
    let (sum, count) = masked_nll(logits, input_ids, loss_mask);
    sum / count.clamp_min(1.0)
}

/// Sum (not mean) of the label tokens' negative log-likelihoods. Gradients of sums add up
/// across micro-batches and ranks; dividing once by the total label count gives the
/// gradient of the token-level mean over the whole step.
pub fn masked_nll_sum(logits: &Tensor, input_ids: &Tensor, loss_mask: &Tensor) -> Tensor {
    masked_nll(logits, input_ids, loss_mask).0
}

fn masked_nll(logits: &Tensor, input_ids: &Tensor, loss_mask: &Tensor) -> (Tensor, Tensor) {
    let (b, t, v) = logits.size3().expect("logits must be [B, T, V]");
    if t < 2 {
        let zero = Tensor::zeros([], (Kind::Float, logits.device()));
        return (zero.shallow_clone(), zero);
    }
    let pred = logits.narrow(1, 0, t - 1).reshape([b * (t - 1), v]);
    let target = input_ids.narrow(1, 1, t - 1).reshape([b * (t - 1)]);
    let mask = loss_mask.narrow(1, 1, t - 1).reshape([b * (t - 1)]);
    let nll = -pred
        .log_softmax(-1, Kind::Float)
        .gather(1, &target.unsqueeze(1), false)
        .squeeze_dim(1);
    ((nll * &mask).sum(Kind::Float), mask.sum(Kind::Float))
}

/// The auxiliary context term of a micro-batch, on the label-sum scale: `w × mean NLL of
/// its context tokens × its label count`, so that after the step's division by the label
/// count it adds `w ×` the context's mean NLL (`[learner] context_loss_weight`).
pub fn context_nll_term(logits: &Tensor, batch: &PaddedBatch, weight: f64) -> Tensor {
    // Context: real tokens (attention mask) that are not labels.
    let context = batch.attention_mask.to_kind(Kind::Float) - &batch.loss_mask;
    let (sum, count) = masked_nll(logits, &batch.input_ids, &context);
    sum / count.clamp_min(1.0) * (weight * batch.label_tokens as f64)
}

/// Sum of label-token negative log-likelihoods of a packed batch; `logits` `[B, L, V]`
/// from `Policy::forward_tree` on it.
pub fn packed_nll_sum(logits: &Tensor, batch: &PackedBatch) -> Tensor {
    let (b, l, v) = logits.size3().expect("logits must be [B, L, V]");
    if batch.label_tokens == 0 {
        return Tensor::zeros([], (Kind::Float, logits.device()));
    }
    let pred = logits
        .reshape([b * l, v])
        .index_select(0, &batch.pred_index)
        .log_softmax(-1, Kind::Float);
    -pred
        .gather(1, &batch.targets.unsqueeze(1), false)
        .sum(Kind::Float)
}

/// The weighted negative log-likelihoods of a trunk row, on the label-sum scale: each
/// owned prediction's NLL × (its label multiplicity + `context_scale` × its context
/// multiplicity); `logits` `[1, S, V]` from `Policy::forward_trunk` on it.
pub fn trunk_nll_sum(logits: &Tensor, batch: &TrunkBatch, context_scale: f64) -> Tensor {
    let (b, s, v) = logits.size3().expect("logits must be [B, S, V]");
    if batch.targets.numel() == 0 {
        return Tensor::zeros([], (Kind::Float, logits.device()));
    }
    let nll = -logits
        .reshape([b * s, v])
        .index_select(0, &batch.pred_index)
        .log_softmax(-1, Kind::Float)
        .gather(1, &batch.targets.unsqueeze(1), false)
        .squeeze_dim(1);
    (nll * trunk_weights(batch, context_scale)).sum(Kind::Float)
}

/// Each owned prediction's weight in a trunk row's loss: its label multiplicity plus
/// `context_scale` × its context multiplicity.
fn trunk_weights(batch: &TrunkBatch, context_scale: f64) -> Tensor {
    &batch.label_weight + &batch.context_weight * context_scale
}

/// `masked_nll_sum` (plus `context_nll_term` where `context_weight > 0`) of a padded
/// batch, computed at its trained positions only, the head run on `chunk` rows at a
/// time (`chunked`): the same value and gradients.
pub fn chunked_padded_nll_sum(
    policy: &tutor_policy::Policy,
    batch: &PaddedBatch,
    context_weight: f64,
    chunk: i64,
) -> Tensor {
    let t = batch.input_ids.size()[1];
    if t < 2 {
        return Tensor::zeros([], (Kind::Float, batch.input_ids.device()));
    }
    // Column j: the weight of token j + 1's NLL, predicted at position j.
    let labels = batch.loss_mask.narrow(1, 1, t - 1);
    // A new tensor where the context adds to it (never in place: `labels` shares the
    // batch's storage).
    let weight = if context_weight > 0.0 {
        let context = batch
            .attention_mask
            .to_kind(Kind::Float)
            .narrow(1, 1, t - 1)
            - &labels;
        let count = context.sum(Kind::Float).double_value(&[]).max(1.0);
        &labels + context * (context_weight * batch.label_tokens as f64 / count)
    } else {
        labels
    };
    let (rows, shifted, targets) = shifted_positions(&batch.input_ids, &weight);
    let weight = weight.reshape([-1]).index_select(0, &shifted);
    let hidden = policy.forward_hidden(&batch.input_ids, &batch.attention_mask);
    chunked_weighted_nll(policy, &hidden, &rows, &targets, &weight, chunk)
}

impl Trainer {
    /// One optimizer step on this rank's share of a batch: summed label-token
    /// cross-entropy, backward, gradients and label counts summed over the ranks, divided
    /// by the total label count (so the gradient is that of the token-level mean over the
    /// union of all ranks' examples), clipping by global norm, AdamW.
    ///
    /// In a group every rank must call `step` for every step, with its own examples (which
    /// may be empty). A step with no label token on any rank changes nothing and does not
    /// advance the schedule.
    pub fn step(&mut self, examples: &[(Vec<u32>, Vec<bool>)]) -> Result<StepReport, StepError> {
        let Some(start) = self.begin_step(examples.is_empty()) else {
            return Ok(self.idle_report());
        };
        match self.config().packing {
            Packing::Tree => return self.packed_step(start, examples),
            Packing::Trunk => return self.trunk_step(start, examples),
            Packing::None => {}
        }
        let device = self.policy().device();
        let context_weight = self.config().context_loss_weight;
        let budget = self.config().logits_budget_mb;
        let batches = micro_batches(examples, self.config().micro_batch_tokens)
            .into_iter()
            .map(|micro| PaddedBatch::new(micro, device));
        self.run_passes(start, batches, |policy, batch| {
            if batch.label_tokens == 0 {
                return None;
            }
            if let Some(chunk) = pass_chunk(budget, policy, batch.input_ids.numel() as i64) {
                return Some((
                    chunked_padded_nll_sum(policy, batch, context_weight, chunk),
                    batch.label_tokens,
                ));
            }
            let logits = policy.forward(&batch.input_ids, &batch.attention_mask);
            let mut nll = masked_nll_sum(&logits, &batch.input_ids, &batch.loss_mask);
            if context_weight > 0.0 {
                nll += context_nll_term(&logits, batch, context_weight);
            }
            Some((nll, batch.label_tokens))
        })
    }

    /// `step` with `packing = "tree"`: the examples as tree rows (`pack_examples`: shared
    /// prefixes once, several examples per row), micro-batched by padded rows × longest
    /// row within `micro_batch_tokens`. The summed loss and so the step are those of the
    /// examples run separately.
    fn packed_step(
        &mut self,
        start: Instant,
        examples: &[(Vec<u32>, Vec<bool>)],
    ) -> Result<StepReport, StepError> {
        let rows = pack_examples(examples, self.config().pack_row_tokens.max(1));
        let ranges = micro_batch_ranges(
            rows.iter().map(|r| r.len()),
            self.config().micro_batch_tokens,
        );
        let device = self.policy().device();
        let batches = ranges
            .into_iter()
            .map(|range| PackedBatch::new(&rows[range], device));
        let budget = self.config().logits_budget_mb;
        self.run_passes(start, batches, |policy, batch| {
            if batch.label_tokens == 0 {
                return None;
            }
            if let Some(chunk) = pass_chunk(budget, policy, batch.input_ids.numel() as i64) {
                let hidden = policy.forward_tree_hidden(
                    &batch.input_ids,
                    &batch.position_ids,
                    &batch.allowed,
                );
                let ones = Tensor::ones_like(&batch.targets).to_kind(Kind::Float);
                let nll = chunked_weighted_nll(
                    policy,
                    &hidden,
                    &batch.pred_index,
                    &batch.targets,
                    &ones,
                    chunk,
                );
                return Some((nll, batch.label_tokens));
            }
            let logits = policy.forward_tree(&batch.input_ids, &batch.position_ids, &batch.allowed);
            Some((packed_nll_sum(&logits, batch), batch.label_tokens))
        })
    }

    /// `step` with `packing = "trunk"`: the examples as trunk rows (`pack_trunks`: a
    /// trajectory's tokens once under the causal kernel, its off-trunk labels as
    /// branches), one pass per row. The label sum is that of the examples run
    /// separately; the context term is `context_loss_weight ×` the step's label count ×
    /// its mean context NLL, as the plain path computes it for a step in one pass.
    fn trunk_step(
        &mut self,
        start: Instant,
        examples: &[(Vec<u32>, Vec<bool>)],
    ) -> Result<StepReport, StepError> {
        let rows = pack_trunks(examples, TRUNK_BRANCH_DEPTH);
        let labels: u64 = rows.iter().map(|r| r.label_tokens()).sum();
        let contexts: u64 = rows.iter().map(|r| r.context_tokens()).sum();
        let weight = self.config().context_loss_weight;
        let context_scale = if weight > 0.0 && contexts > 0 {
            weight * labels as f64 / contexts as f64
        } else {
            0.0
        };
        let device = self.policy().device();
        let batches = rows.iter().map(|row| TrunkBatch::new(row, device));
        let budget = self.config().logits_budget_mb;
        self.run_passes(start, batches, |policy, batch| {
            if batch.label_tokens == 0 && (context_scale == 0.0 || batch.context_tokens == 0) {
                return None;
            }
            if let Some(chunk) = pass_chunk(budget, policy, batch.input_ids.numel() as i64) {
                let hidden = policy.forward_trunk_hidden(
                    &batch.input_ids,
                    &batch.position_ids,
                    batch.trunk,
                    &batch.branch_allowed,
                );
                let nll = chunked_weighted_nll(
                    policy,
                    &hidden,
                    &batch.pred_index,
                    &batch.targets,
                    &trunk_weights(batch, context_scale),
                    chunk,
                );
                return Some((nll, batch.label_tokens));
            }
            let logits = policy.forward_trunk(
                &batch.input_ids,
                &batch.position_ids,
                batch.trunk,
                &batch.branch_allowed,
            );
            Some((
                trunk_nll_sum(&logits, batch, context_scale),
                batch.label_tokens,
            ))
        })
    }

    /// Mean label-token cross-entropy of a batch under the current weights, no update.
    /// An error with `shard = "full"` (no parameters between steps).
    pub fn eval_loss(&self, examples: &[(Vec<u32>, Vec<bool>)]) -> anyhow::Result<f64> {
        self.check_whole_parameters("eval_loss")?;
        let _guard = tch::no_grad_guard();
        let batch = PaddedBatch::new(examples, self.policy().device());
        let logits = self
            .policy()
            .forward(&batch.input_ids, &batch.attention_mask);
        Ok(masked_cross_entropy(&logits, &batch.input_ids, &batch.loss_mask).double_value(&[]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_context_term_is_the_weighted_mean_context_nll_on_the_label_scale() {
        // Three tokens, uniform logits over 4: every NLL is ln 4. Token 2 is the label;
        // token 1 is the one context token with a prediction (token 0 has no prefix).
        let logits = Tensor::zeros([1, 3, 4], (Kind::Float, tch::Device::Cpu));
        let batch = PaddedBatch::new(
            &[(vec![1, 2, 3], vec![false, false, true])],
            tch::Device::Cpu,
        );
        assert_eq!(batch.label_tokens, 1);
        let term = context_nll_term(&logits, &batch, 0.5).double_value(&[]);
        assert!((term - 0.5 * 4f64.ln()).abs() < 1e-5, "{term}");
        // Padding is not context.
        let padded = PaddedBatch::new(
            &[
                (vec![1, 2, 3], vec![false, false, true]),
                (vec![1, 2], vec![false, true]),
            ],
            tch::Device::Cpu,
        );
        let logits = Tensor::zeros([2, 3, 4], (Kind::Float, tch::Device::Cpu));
        let term = context_nll_term(&logits, &padded, 1.0).double_value(&[]);
        assert!((term - 2.0 * 4f64.ln()).abs() < 1e-5, "{term}");
    }

    #[test]
    fn only_label_tokens_count() {
        // Two-token vocabulary, logits favour token 0 everywhere.
        let logits = Tensor::from_slice(&[2.0f32, 0.0, 2.0, 0.0, 2.0, 0.0]).reshape([1, 3, 2]);
        let ids = Tensor::from_slice(&[0i64, 1, 0]).reshape([1, 3]);
        // Only the last token (0, predicted from position 1) is a label: low loss.
        let mask_last = Tensor::from_slice(&[0f32, 0.0, 1.0]).reshape([1, 3]);
        let l_last = masked_cross_entropy(&logits, &ids, &mask_last).double_value(&[]);
        let expect_last = -(2f64.exp() / (2f64.exp() + 1.0)).ln();
        assert!(
            (l_last - expect_last).abs() < 1e-5,
            "{l_last} vs {expect_last}"
        );
        // Only the middle token (1, unlikely) is a label: high loss.
        let mask_mid = Tensor::from_slice(&[0f32, 1.0, 0.0]).reshape([1, 3]);
        let l_mid = masked_cross_entropy(&logits, &ids, &mask_mid).double_value(&[]);
        let expect_mid = -(1.0 / (2f64.exp() + 1.0)).ln();
        assert!((l_mid - expect_mid).abs() < 1e-5, "{l_mid} vs {expect_mid}");
        // Both: the mean of the two.
        let mask_both = Tensor::from_slice(&[0f32, 1.0, 1.0]).reshape([1, 3]);
        let l_both = masked_cross_entropy(&logits, &ids, &mask_both).double_value(&[]);
        assert!((l_both - (expect_last + expect_mid) / 2.0).abs() < 1e-5);
    }

    #[test]
    fn padding_and_context_are_excluded() {
        let examples = vec![
            (vec![5u32, 6, 7, 8], vec![false, false, true, true]),
            (vec![9u32, 3], vec![false, true]),
        ];
        let b = PaddedBatch::new(&examples, tch::Device::Cpu);
        assert_eq!(b.input_ids.size(), vec![2, 4]);
        assert_eq!(b.label_tokens, 3);
        let lm: Vec<f32> = Vec::try_from(b.loss_mask.reshape([-1])).unwrap();
        assert_eq!(lm, vec![0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]);
        let am: Vec<i64> = Vec::try_from(b.attention_mask.reshape([-1])).unwrap();
        assert_eq!(am, vec![1, 1, 1, 1, 1, 1, 0, 0]);
    }
}
