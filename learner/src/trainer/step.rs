//! One optimizer step, whatever the objective: gradients zeroed, each micro-batch's summed
//! loss backward (`run_passes`, given the objective's loss by `crate::loss`), loss sums,
//! token counts and gradients summed over the ranks, the token-level mean, clipping,
//! AdamW (`finish_step`); and the typed error that says when the group must be formed
//! again. Also how a batch is cut: into micro-batches and into the ranks' shares.

use std::time::Instant;

use tch::{Kind, Tensor};
use tutor_collective::CollectiveError;
use tutor_policy::Policy;

use std::sync::{Arc, Mutex};

use tutor_collective::CpuCollective;

use super::shard::{FullGate, GateHandle};
use super::{StepReport, Trainer};

/// Why a step failed. Each variant says what happens next, so rank 0's service decides
/// recovery with a `match`, not by searching an error chain.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// A collective call of the step failed: the group is broken (a rank died, hung or
    /// went out of step) and must be formed again; this rank goes on alone until then.
    /// The step changed nothing (no update, no schedule step).
    #[error("{during}")]
    Collective {
        /// What the step was doing with the other ranks.
        during: &'static str,
        #[source]
        source: CollectiveError,
    },
    /// The group broke under `[learner] shard`: the other ranks' slices of the optimizer
    /// state went with them, so this trainer cannot step; resume from a checkpoint.
    #[error("{0}")]
    ShardLost(String),
}

/// Why a step was skipped: its loss or its gradient norm (over all ranks, so every rank
/// skips the same steps) was NaN or infinite. A skipped step changes nothing: no update,
/// no AdamW moment or schedule step; its gradients are dropped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NonFinite {
    /// The step's mean loss over the trained tokens.
    pub loss: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
}

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.loss.is_finite(), self.grad_norm.is_finite()) {
            (false, false) => write!(
                f,
                "the loss ({}) and the gradient norm ({}) are not finite",
                self.loss, self.grad_norm
            ),
            (false, true) => write!(f, "the loss ({}) is not finite", self.loss),
            _ => write!(
                f,
                "the gradient norm ({}) is not finite (loss {})",
                self.grad_norm, self.loss
            ),
        }
    }
}

impl Trainer {
    /// The passes of one step: `loss` gives each batch's summed loss and its trained
    /// tokens (`None`: nothing to train in it); each sum's gradient is accumulated
    /// (`backward`), then `finish_step` sums over the ranks and updates.
    pub(crate) fn run_passes<B>(
        &mut self,
        start: Instant,
        mut batches: impl ExactSizeIterator<Item = B>,
        loss: impl Fn(&Policy, &B) -> Option<(Tensor, u64)>,
    ) -> Result<StepReport, StepError> {
        if let Some(s) = &self.sharded {
            s.check_whole()
                .map_err(|e| StepError::ShardLost(format!("{e:#}")))?;
        }
        let rounds = self.pass_rounds(batches.len())?;
        let gate = self.open_gate();
        let (mut local_sum, mut local_tokens, mut passes) = (0.0, 0u64, 0);
        for _ in 0..rounds {
            // One batch at a time: a batch's tensors are made when it is taken.
            if let Some((sum, tokens)) = batches.next().and_then(|b| loss(&self.policy, &b)) {
                local_sum += sum.double_value(&[]);
                self.backward(&sum);
                local_tokens += tokens;
                passes += 1;
            }
            if let Some(g) = &gate {
                // A forward whose loss was not trained has nothing to recompute.
                self.policy.clear_checkpointed();
                g.lock().unwrap_or_else(|e| e.into_inner()).complete_pass();
            } else if let Some(s) = &mut self.sharded {
                s.reduce_pass(&self.params, &mut *self.collective)
                    .map_err(|source| StepError::Collective {
                        during: "reduce-scattering a micro-batch's gradients",
                        source,
                    })?;
            }
        }
        let closed = match gate {
            Some(g) => self.close_gate(g),
            None => Ok(()),
        };
        // An idle or skipped step changed nothing: rank 0's host copy is still current.
        let report = closed.and_then(|()| self.finish_step(start, local_sum, local_tokens, passes));
        if report.is_err() && self.is_fully_sharded() {
            // The parameters are released and the other ranks' slices unreachable: this
            // trainer cannot step or lead a group again (resume from a checkpoint).
            if let Some(s) = &mut self.sharded {
                s.lost = true;
            }
        }
        report
    }

    /// Whether `[learner] shard = "full"`.
    pub(crate) fn is_fully_sharded(&self) -> bool {
        self.sharded
            .as_ref()
            .is_some_and(|s| s.mode == crate::config::Shard::Full)
    }

    /// For a forward outside the training step (the evaluations): refused with
    /// `shard = "full"`, whose parameters are released between steps (each pass gathers
    /// them layer by layer; only rank 0 keeps a copy, in host memory).
    pub(crate) fn check_whole_parameters(&self, what: &str) -> anyhow::Result<()> {
        if self.is_fully_sharded() {
            anyhow::bail!(
                "{what} runs the model's forward outside a training step, which learner.shard \
                 = \"full\" does not keep between steps: evaluate a published version or a \
                 checkpoint instead"
            );
        }
        Ok(())
    }

    /// `shard = "full"`: releases the parameters and lends the collective to a gate the
    /// policy calls during the passes (`shard::FullGate`). `None` in other modes. Rank 0
    /// first copies the weights to host memory if it holds none there yet (its first
    /// step: they were whole on the device until now).
    fn open_gate(&mut self) -> Option<Arc<Mutex<FullGate>>> {
        if !self.is_fully_sharded() {
            return None;
        }
        if self.collective.rank() == 0 {
            self.keep_weights_on_host();
        }
        let s = self.sharded.as_ref()?;
        let collective = std::mem::replace(&mut self.collective, Box::new(CpuCollective::solo()));
        let kind = self.param_kind();
        // NCCL's calls wait for the whole device (nccl.rs) on the compute stream, and a
        // lone rank on a GPU has nothing to overlap: a prefetch there would only hold
        // one more layer. Over the CPU collective, training on the CPU.
        let prefetch = self.config.prefetch
            && collective.device() == tch::Device::Cpu
            && s.weights.device() == tch::Device::Cpu;
        let gate = Arc::new(Mutex::new(FullGate::open(
            s,
            &self.params,
            kind,
            collective,
            prefetch,
        )));
        self.policy
            .set_param_gate(Some(Box::new(GateHandle(gate.clone()))));
        Some(gate)
    }

    /// Takes the gate out of the policy and the collective back; a collective call that
    /// failed during the passes fails the step.
    fn close_gate(&mut self, gate: Arc<Mutex<FullGate>>) -> Result<(), StepError> {
        drop(self.policy.set_param_gate(None));
        let gate = Arc::try_unwrap(gate)
            .ok()
            .expect("the policy dropped its handle of the gate")
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        let (collective, failed, peak) = gate.finish();
        self.collective = collective;
        self.pass_parameter_peak = Some(peak);
        match failed {
            Some((during, source)) => Err(StepError::Collective { during, source }),
            None => Ok(()),
        }
    }

    /// Rounds of passes of this step: this rank's batches, except under `shard =
    /// "gradients"` in a group, where each round ends with a reduce-scatter every rank
    /// makes: the most batches of any rank (a rank short of batches adds zeros).
    fn pass_rounds(&mut self, batches: usize) -> Result<usize, StepError> {
        let world = self.collective.world_size();
        // "full" too: each pass gathers and reduce-scatters unit by unit.
        let sharded_passes = matches!(&self.sharded, Some(s) if matches!(s.mode,
            crate::config::Shard::Gradients | crate::config::Shard::Full));
        if world == 1 || !sharded_passes {
            return Ok(batches);
        }
        let mut counts = vec![0.0; world];
        counts[self.collective.rank()] = batches as f64;
        self.collective
            .all_reduce_sum_f64(&mut counts)
            .map_err(|source| StepError::Collective {
                during: "agreeing on the number of micro-batches",
                source,
            })?;
        Ok(counts.into_iter().fold(0.0, f64::max) as usize)
    }

    /// What a step that changes nothing reports.
    pub(crate) fn idle_report(&self) -> StepReport {
        StepReport {
            loss: 0.0,
            grad_norm: 0.0,
            label_tokens: 0,
            learning_rate: self.config.lr_at(self.steps),
            seconds: 0.0,
            micro_batches: 0,
            skipped: None,
        }
    }

    /// Starts a step: `None` when a lone rank has no example (nothing to do, not even a
    /// collective call), else the start time, with every gradient zeroed.
    pub(crate) fn begin_step(&mut self, no_examples: bool) -> Option<Instant> {
        if self.collective.world_size() == 1 && no_examples {
            return None;
        }
        // A trainer built for a group that never formed trains alone, on its device
        // (before the step's batches are made for the policy's device).
        self.unstage();
        self.policy.clear_checkpointed();
        for p in self.params.iter_mut() {
            p.zero_grad();
        }
        if let Some(m) = &mut self.master {
            for g in m.grads.iter_mut() {
                let _ = g.zero_();
            }
        }
        if let Some(s) = &mut self.sharded {
            s.zero_grad_sums();
        }
        Some(Instant::now())
    }

    /// Backward of one pass's summed loss. Gradients of the passes add up: in `.grad`
    /// for f32 parameters; for bf16 ones each pass's gradient is added to the fp32 sums
    /// and `.grad` cleared, so the sum over micro-batches is not rounded to bf16.
    pub(crate) fn backward(&mut self, loss: &Tensor) {
        // With activation checkpointing the loss's backward stops at the last layer's
        // output: the layers' part runs after it, before the gradients are read (under
        // `shard = "full"` unit by unit, into the gate).
        self.policy.backward_loss(loss);
        if let Some(m) = &mut self.master {
            tch::no_grad(|| {
                for (p, sum) in self.params.iter().zip(m.grads.iter_mut()) {
                    let mut g = p.grad();
                    if g.defined() {
                        let _ = sum.g_add_(&g.to_kind(Kind::Float));
                        let _ = g.zero_();
                    }
                }
            });
        }
        if let Some(s) = &mut self.sharded {
            s.add_pass_to_flat_sums(&self.params);
        }
    }

    /// Ends a step whose passes accumulated the gradients of summed per-token losses in
    /// `.grad`: loss sums and token counts summed over the ranks, gradients all-reduced
    /// and divided by the total token count (the token-level mean over the union of the
    /// ranks' examples), clipped by global norm, AdamW. No trained token on any rank: no
    /// update, no step. A loss or gradient norm that is not finite: no update, no step
    /// either (`StepReport::skipped` says why), with a warning.
    pub(crate) fn finish_step(
        &mut self,
        start: Instant,
        local_sum: f64,
        local_labels: u64,
        passes: usize,
    ) -> Result<StepReport, StepError> {
        let lr = self.config.lr_at(self.steps);
        let idle = self.idle_report();
        let solo = self.collective.world_size() == 1;
        let mut totals = [local_sum, local_labels as f64];
        self.collective
            .all_reduce_sum_f64(&mut totals)
            .map_err(|source| StepError::Collective {
                during: "summing loss and label counts over the ranks",
                source,
            })?;
        let label_tokens = totals[1] as u64;
        if label_tokens == 0 {
            // Nothing to learn from (e.g. only format-error labels): no update, no step.
            return Ok(idle);
        }
        let mut grads: Vec<Tensor> = match (&mut self.sharded, &self.master) {
            // Sharded: this rank's slice of the summed gradients.
            (Some(s), _) => vec![s
                .reduced_slice(&self.params, &mut *self.collective)
                .map_err(|source| StepError::Collective {
                    during: "reduce-scattering gradients",
                    source,
                })?],
            (None, Some(m)) => m.grads.iter().map(Tensor::shallow_clone).collect(),
            (None, None) => self
                .params
                .iter()
                .map(|p| {
                    let g = p.grad();
                    if g.defined() {
                        g
                    } else {
                        p.zeros_like()
                    }
                })
                .collect(),
        };
        if !solo && self.sharded.is_none() {
            self.collective
                .all_reduce_sum(&mut grads)
                .map_err(|source| StepError::Collective {
                    during: "all-reducing gradients",
                    source,
                })?;
        }
        let mut sq = [tch::no_grad(|| {
            let mut sq = 0.0;
            for g in grads.iter_mut() {
                let _ = g.g_div_scalar_(label_tokens as f64);
                let n = g.norm().double_value(&[]);
                sq += n * n;
            }
            sq
        })];
        if !solo && self.sharded.is_some() {
            // Each rank holds a slice: the squares add up over the ranks.
            self.collective
                .all_reduce_sum_f64(&mut sq)
                .map_err(|source| StepError::Collective {
                    during: "summing the gradient norm over the ranks",
                    source,
                })?;
        }
        let grad_norm = f64::sqrt(sq[0]);
        if self.config.grad_clip > 0.0 {
            let coef = self.config.grad_clip / (grad_norm + 1e-6);
            if coef < 1.0 {
                tch::no_grad(|| {
                    for g in grads.iter_mut() {
                        let _ = g.g_mul_scalar_(coef);
                    }
                });
            }
        }
        let loss = totals[0] / totals[1];
        if !loss.is_finite() || !grad_norm.is_finite() {
            // Before clipping and AdamW: the weights, the moments and the schedule stay
            // as they were; the poisoned gradients are zeroed by the next `begin_step`.
            let why = NonFinite { loss, grad_norm };
            self.skipped_steps += 1;
            tracing::warn!(
                optimizer_steps = self.steps,
                loss,
                grad_norm,
                skipped_steps = self.skipped_steps,
                "training step skipped: {why}; the weights and the optimizer state are left \
                 as they were"
            );
            return Ok(StepReport {
                loss,
                grad_norm,
                label_tokens,
                learning_rate: lr,
                seconds: start.elapsed().as_secs_f64(),
                micro_batches: passes,
                skipped: Some(why),
            });
        }
        let kind = self.param_kind();
        match (&mut self.sharded, &mut self.master) {
            (Some(s), _) => {
                self.optimizer
                    .step(std::slice::from_mut(&mut s.weights), &grads, lr);
                let host = match (&mut self.host_params, self.collective.rank()) {
                    (Some(h), 0) => Some(h.as_mut_slice()),
                    _ => None,
                };
                s.gather_into_params(&mut self.params, host, kind, &mut *self.collective)
                    .map_err(|source| StepError::Collective {
                        during: "gathering the updated weights",
                        source,
                    })?;
            }
            (None, Some(m)) => {
                self.optimizer.step(&mut m.weights, &grads, lr);
                tch::no_grad(|| {
                    for (p, w) in self.params.iter_mut().zip(&m.weights) {
                        p.copy_(w);
                    }
                });
            }
            (None, None) => self.optimizer.step(&mut self.params, &grads, lr),
        }
        self.steps += 1;
        Ok(StepReport {
            loss,
            grad_norm,
            label_tokens,
            learning_rate: lr,
            seconds: start.elapsed().as_secs_f64(),
            micro_batches: passes,
            skipped: None,
        })
    }
}

/// Splits examples, in order, into runs whose padded size (examples × longest example)
/// stays within `budget` tokens; an example longer than the budget forms a run of its
/// own. `budget` 0 keeps everything in one run.
pub fn micro_batches<T: AsRef<[u32]>, M>(examples: &[(T, M)], budget: usize) -> Vec<&[(T, M)]> {
    micro_batch_ranges(examples.iter().map(|(t, _)| t.as_ref().len()), budget)
        .into_iter()
        .map(|r| &examples[r])
        .collect()
}

/// `micro_batches` over example lengths: the index ranges of the runs.
pub fn micro_batch_ranges(
    lengths: impl ExactSizeIterator<Item = usize>,
    budget: usize,
) -> Vec<std::ops::Range<usize>> {
    let n = lengths.len();
    if n == 0 {
        return Vec::new();
    }
    if budget == 0 {
        return std::iter::once(0..n).collect();
    }
    let mut runs = Vec::new();
    let (mut start, mut longest) = (0, 0);
    for (i, len) in lengths.enumerate() {
        let grown = longest.max(len);
        if i > start && (i - start + 1) * grown > budget {
            runs.push(start..i);
            start = i;
            longest = len;
        } else {
            longest = grown;
        }
    }
    runs.push(start..n);
    runs
}

/// This rank's share of a batch: examples `rank`, `rank + world`, … (so label counts
/// may differ between ranks; `Trainer::step` weights by them).
pub fn rank_shard<T: Clone>(examples: &[T], rank: usize, world_size: usize) -> Vec<T> {
    examples
        .iter()
        .skip(rank)
        .step_by(world_size.max(1))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Packing;
    use crate::packing::pack_examples;
    use crate::trainer::tests::tiny_trainer;

    #[test]
    fn micro_batches_respect_the_token_budget() {
        let lens = [3usize, 9, 2, 2, 2, 2, 30, 4, 5, 1];
        let ex: Vec<(Vec<u32>, Vec<bool>)> =
            lens.iter().map(|&n| (vec![1; n], vec![true; n])).collect();
        let runs = micro_batches(&ex, 12);
        let sizes: Vec<usize> = runs.iter().map(|r| r.len()).collect();
        // [3] then 3+9 would pad to 2×9; [9]; [2,2,2,2] (4×2 = 8, +30 no); [30] alone
        // (over budget); [4,5] (2×5); [1] (3×5 = 15 > 12).
        assert_eq!(sizes, vec![1, 1, 4, 1, 2, 1]);
        for r in &runs {
            let padded = r.len() * r.iter().map(|(t, _)| t.len()).max().unwrap();
            assert!(padded <= 12 || r.len() == 1, "{padded}");
        }
        // Order and content are kept.
        let flat: Vec<usize> = runs
            .iter()
            .flat_map(|r| r.iter().map(|(t, _)| t.len()))
            .collect();
        assert_eq!(flat, lens);
        assert_eq!(micro_batches(&ex, 0).len(), 1);
        assert!(micro_batches(&ex[..0], 8).is_empty());
    }

    /// DAgger-shaped examples: one trajectory's turns as growing prefixes, each with its
    /// teacher label (sometimes the executed continuation, sometimes a branch), a
    /// duplicate of one example, and unrelated short examples.
    fn dagger_shaped_examples() -> Vec<(Vec<u32>, Vec<bool>)> {
        let trunk: Vec<u32> = (0..60u32).map(|j| 1 + (j * 11) % 61).collect();
        let mut ex = Vec::new();
        for (t, cut) in [12usize, 25, 38, 50].into_iter().enumerate() {
            let label: Vec<u32> = if t % 2 == 0 {
                trunk[cut..cut + 6].to_vec() // the teacher acted: the trunk's own tokens
            } else {
                (0..5u32).map(|j| 1 + (j * 5 + t as u32) % 63).collect() // a branch
            };
            let mut tokens = trunk[..cut].to_vec();
            let mut mask = vec![false; cut];
            tokens.extend(&label);
            mask.extend(std::iter::repeat_n(true, label.len()));
            ex.push((tokens, mask));
        }
        ex.push(ex[1].clone());
        for i in 0..3u32 {
            let tokens: Vec<u32> = (0..9u32).map(|j| 2 + (i * 13 + j * 7) % 60).collect();
            let mask = (0..9).map(|j| j >= 4).collect();
            ex.push((tokens, mask));
        }
        ex
    }

    /// Two steps on the same examples agree: label count, loss, gradient norm.
    fn assert_same_step(a: &StepReport, b: &StepReport) {
        assert_eq!(a.label_tokens, b.label_tokens, "every label counted once");
        assert!(
            (a.loss - b.loss).abs() <= 1e-5 * a.loss.abs(),
            "{} vs {}",
            a.loss,
            b.loss
        );
        assert!((a.grad_norm - b.grad_norm).abs() <= 1e-4 * a.grad_norm);
    }

    /// Two trainers' weights agree to a relative error of 1e-5.
    fn assert_same_weights(a: &Trainer, b: &Trainer) {
        let (mut num, mut den) = (0.0, 0.0);
        for ((_, p), (_, q)) in a.named_parameters().zip(b.named_parameters()) {
            num += (p - q).square().sum(tch::Kind::Double).double_value(&[]);
            den += p.square().sum(tch::Kind::Double).double_value(&[]);
        }
        let rel = (num / den).sqrt();
        assert!(rel <= 1e-5, "relative error {rel}");
    }

    /// A trainer on a 65,536-token vocabulary (so that a 1 MiB logits budget is 4 rows).
    fn wide_vocab_trainer(logits_budget_mb: usize) -> Trainer {
        wide_vocab_trainer_with(logits_budget_mb, false)
    }

    fn wide_vocab_trainer_with(logits_budget_mb: usize, checkpoint_activations: bool) -> Trainer {
        let mut mc = tutor_policy::ModelConfig::tiny(1 << 16);
        mc.hidden_size = 32;
        mc.intermediate_size = 64;
        mc.head_dim = 8;
        let policy = Policy::new(mc, tch::Device::Cpu, 5);
        let config = crate::config::LearnerConfig {
            learning_rate: 1e-2,
            warmup_steps: 0,
            logits_budget_mb,
            checkpoint_activations,
            ..Default::default()
        };
        Trainer::new(policy, config).unwrap()
    }

    /// `[learner] checkpoint_activations` recomputes each layer in the backward pass: every
    /// layout and objective trains the same weights as without it, with full logits and
    /// within the logits budget, across micro-batches.
    #[test]
    fn checkpointed_steps_equal_plain_steps() {
        let ex = dagger_shaped_examples();
        for budget in [0, 1] {
            for (packing, context) in [
                (Packing::None, 0.5),
                (Packing::Tree, 0.0),
                (Packing::Trunk, 0.5),
            ] {
                let mut plain = wide_vocab_trainer_with(budget, false);
                let mut checkpointed = wide_vocab_trainer_with(budget, true);
                assert!(checkpointed.policy().checkpoint_activations());
                for t in [&mut plain, &mut checkpointed] {
                    t.config.packing = packing;
                    t.config.context_loss_weight = context;
                    t.config.micro_batch_tokens = 200;
                }
                for _ in 0..2 {
                    let a = plain.step(&ex).unwrap();
                    let b = checkpointed.step(&ex).unwrap();
                    assert_same_step(&a, &b);
                }
                assert_same_weights(&plain, &checkpointed);
            }
        }
        let rl: Vec<crate::loss::RlExample> = ex
            .iter()
            .enumerate()
            .map(|(i, (tokens, mask))| crate::loss::RlExample {
                advantages: vec![if i % 2 == 0 { 1.0 } else { -0.5 }; tokens.len()],
                old_logprobs: vec![-11.0; tokens.len()],
                tokens: tokens.clone(),
                loss_mask: mask.clone(),
            })
            .collect();
        let mut plain = wide_vocab_trainer_with(1, false);
        let mut checkpointed = wide_vocab_trainer_with(1, true);
        for _ in 0..2 {
            let a = plain.dapo_step(&rl).unwrap();
            let b = checkpointed.dapo_step(&rl).unwrap();
            assert_same_step(&a, &b);
        }
        assert_same_weights(&plain, &checkpointed);
    }

    /// Over `logits_budget_mb` a pass computes its loss at the trained positions only, 4
    /// rows of logits at a time here: every objective and layout trains the same weights
    /// as with the full `[B, T, vocab]` logits (budget 0), context term included.
    #[test]
    fn steps_over_the_logits_budget_equal_full_logits_steps() {
        let ex = dagger_shaped_examples();
        for (packing, context) in [
            (Packing::None, 0.5),
            (Packing::None, 0.0),
            (Packing::Tree, 0.0),
            (Packing::Trunk, 0.5),
        ] {
            let mut full = wide_vocab_trainer(0);
            let mut chunked = wide_vocab_trainer(1);
            for t in [&mut full, &mut chunked] {
                t.config.packing = packing;
                t.config.context_loss_weight = context;
                t.config.micro_batch_tokens = 200;
            }
            for _ in 0..2 {
                let a = full.step(&ex).unwrap();
                let b = chunked.step(&ex).unwrap();
                assert_same_step(&a, &b);
            }
            assert_same_weights(&full, &chunked);
        }
        // DAPO: advantages of both signs, old log-probs about the untrained model's (so
        // ratios near 1, some clipped after the first step).
        let rl: Vec<crate::loss::RlExample> = ex
            .iter()
            .enumerate()
            .map(|(i, (tokens, mask))| crate::loss::RlExample {
                advantages: vec![if i % 2 == 0 { 1.0 } else { -0.5 }; tokens.len()],
                old_logprobs: (0..tokens.len())
                    .map(|j| -11.09 + 0.05 * ((i + j) % 5) as f32)
                    .collect(),
                tokens: tokens.clone(),
                loss_mask: mask.clone(),
            })
            .collect();
        let mut full = wide_vocab_trainer(0);
        let mut chunked = wide_vocab_trainer(1);
        for _ in 0..3 {
            let a = full.dapo_step(&rl).unwrap();
            let b = chunked.dapo_step(&rl).unwrap();
            assert_same_step(&a, &b);
        }
        assert_same_weights(&full, &chunked);
    }

    #[test]
    fn tree_packed_steps_equal_plain_steps_with_fewer_tokens() {
        let ex = dagger_shaped_examples();
        let plain_tokens: usize = ex.iter().map(|(t, _)| t.len()).sum();
        let rows = pack_examples(&ex, 128);
        let packed_tokens: usize = rows.iter().map(|r| r.len()).sum();
        assert!(
            packed_tokens * 2 < plain_tokens,
            "{packed_tokens} vs {plain_tokens}"
        );
        assert!(rows.iter().all(|r| r.len() <= 128));
        assert!(rows.len() < ex.len(), "several examples share a row");
        let mut plain = tiny_trainer();
        let mut packed = tiny_trainer();
        packed.config.packing = Packing::Tree;
        packed.config.pack_row_tokens = 128;
        packed.config.micro_batch_tokens = 200; // and accumulated over micro-batches
        for _ in 0..3 {
            let a = plain.step(&ex).unwrap();
            let b = packed.step(&ex).unwrap();
            assert_same_step(&a, &b);
        }
        assert_same_weights(&plain, &packed);
    }

    #[test]
    fn trunk_steps_equal_plain_steps_context_term_included() {
        let ex = dagger_shaped_examples();
        let mut plain = tiny_trainer();
        let mut trunk = tiny_trainer();
        plain.config.context_loss_weight = 0.5;
        trunk.config.context_loss_weight = 0.5;
        trunk.config.packing = Packing::Trunk;
        trunk.config.validate().unwrap();
        for _ in 0..3 {
            let a = plain.step(&ex).unwrap();
            let b = trunk.step(&ex).unwrap();
            assert_eq!(a.micro_batches, 1);
            assert!(b.micro_batches > 1, "one pass per trunk row");
            assert_same_step(&a, &b);
        }
        assert_same_weights(&plain, &trunk);
        // And it differs from a step without the context term.
        let mut labels_only = tiny_trainer();
        labels_only.config.packing = Packing::Trunk;
        let c = labels_only.step(&ex).unwrap();
        let d = tiny_trainer().step(&ex).unwrap();
        assert!((c.loss - d.loss).abs() <= 1e-5 * d.loss);
        let mut with_context = tiny_trainer();
        with_context.config.packing = Packing::Trunk;
        with_context.config.context_loss_weight = 0.5;
        assert!((with_context.step(&ex).unwrap().loss - c.loss).abs() > 1e-3);
    }

    #[test]
    fn accumulated_micro_batches_equal_one_big_batch() {
        let ex: Vec<(Vec<u32>, Vec<bool>)> = (0..7u32)
            .map(|i| {
                let n = 4 + (i as usize * 5) % 11;
                let tokens = (0..n as u32).map(|j| 1 + (i * 7 + j * 3) % 63).collect();
                let mask = (0..n).map(|j| j > i as usize % 3).collect();
                (tokens, mask)
            })
            .collect();
        let mut whole = tiny_trainer();
        let mut split = tiny_trainer();
        split.config.micro_batch_tokens = 24;
        for _ in 0..3 {
            let a = whole.step(&ex).unwrap();
            let b = split.step(&ex).unwrap();
            assert_eq!(a.micro_batches, 1);
            assert!(b.micro_batches >= 4, "{}", b.micro_batches);
            assert_eq!(a.label_tokens, b.label_tokens);
            assert!(
                (a.loss - b.loss).abs() <= 1e-6 * a.loss,
                "{} vs {}",
                a.loss,
                b.loss
            );
            assert!((a.grad_norm - b.grad_norm).abs() <= 1e-5 * a.grad_norm);
        }
        let (mut num, mut den) = (0.0, 0.0);
        for ((_, p), (_, q)) in whole.named_parameters().zip(split.named_parameters()) {
            num += (p - q).square().sum(tch::Kind::Double).double_value(&[]);
            den += p.square().sum(tch::Kind::Double).double_value(&[]);
        }
        let rel = (num / den).sqrt();
        assert!(rel <= 1e-5, "relative error {rel}");
        // A per-micro-batch mean (each pass weighted equally) would be visibly different:
        // the label counts of the passes differ.
        let counts: Vec<usize> = micro_batches(&ex, 24)
            .iter()
            .map(|r| {
                r.iter()
                    .map(|(_, m)| m.iter().skip(1).filter(|&&b| b).count())
                    .sum()
            })
            .collect();
        assert!(counts.iter().any(|&c| c != counts[0]), "{counts:?}");
    }
}
