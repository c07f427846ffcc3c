//! The training state: the student's weights, their AdamW state and this rank's link to
//! the other data-parallel ranks. Owned by one thread (tch tensors are not shared across
//! tasks); the gRPC service talks to it through `LearnerHandle`.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tch::{Device, Kind, Tensor};
use tutor_policy::{ModelConfig, Policy};

use crate::checkpoint::{self, RngState, TrainerState};
use crate::collective::{Collective, CollectiveError, CpuCollective};
use crate::config::{LearnerConfig, Packing};
use crate::loss::{masked_cross_entropy, masked_nll_sum, PaddedBatch};
use crate::optim::{AdamW, AdamWConfig};
use crate::packing::{pack_examples, packed_nll_sum, PackedBatch};

/// What rank 0 sends a joining rank before the tensors: everything of the training state
/// that is not a tensor, so the other ranks need no checkpoint or model directory.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct GroupState {
    model: ModelConfig,
    config: LearnerConfig,
    steps: u64,
    optimizer_steps: u64,
    rng: RngState,
    parameters: Vec<String>,
}

/// Whether `e` (or what it wraps) is a collective's failure: the group is broken (a rank
/// died, hung or went out of step) and must be formed again.
pub fn is_collective_error(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<CollectiveError>())
}

/// What one optimizer step did (over all ranks).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    pub loss: f64,
    pub grad_norm: f64,
    pub label_tokens: u64,
    pub learning_rate: f64,
    pub seconds: f64,
    /// Forward/backward passes this rank ran for the step (gradient accumulation).
    pub micro_batches: usize,
}

/// Mixed precision (`LearnerConfig::precision`): the fp32 weights AdamW updates (the
/// model's bf16 parameters are their rounding) and the fp32 sums of the current step's
/// gradients, in the same order as `Trainer::params`.
struct Master {
    weights: Vec<Tensor>,
    grads: Vec<Tensor>,
}

pub struct Trainer {
    policy: Policy,
    /// The policy's parameters in name order (handles sharing the VarStore's storage), so
    /// the optimizer state and collectives line up across ranks and checkpoints.
    param_names: Vec<String>,
    params: Vec<Tensor>,
    optimizer: AdamW,
    /// `Some` when training in bf16.
    master: Option<Master>,
    config: LearnerConfig,
    steps: u64,
    collective: Box<dyn Collective>,
    /// The trainer's own random stream (seeded by `config.seed`), saved in checkpoints so
    /// a resumed run draws the same numbers. The cross-entropy step draws none.
    rng: ChaCha8Rng,
}

impl Trainer {
    /// Starts from `model_dir/model.safetensors` when present, else from random weights
    /// seeded by `config.seed` with the architecture in `model_dir/config.json`.
    pub fn from_model_dir(model_dir: &Path, config: LearnerConfig) -> Result<Self> {
        let device = Device::Cpu;
        let policy = if model_dir.join("model.safetensors").exists() {
            Policy::load_dir(model_dir, device).with_context(|| {
                format!("loading the initial model from {}", model_dir.display())
            })?
        } else {
            let cfg_path = model_dir.join("config.json");
            let mc = ModelConfig::load(&cfg_path)
                .with_context(|| format!("reading {}", cfg_path.display()))?;
            Policy::new(mc, device, config.seed as i64)
        };
        Self::new(policy, config)
    }

    /// A single-rank trainer.
    pub fn new(policy: Policy, config: LearnerConfig) -> Result<Self> {
        Self::with_collective(policy, config, Box::new(CpuCollective::solo()))
    }

    /// One rank of a data-parallel group. Every rank must call this (it broadcasts rank
    /// 0's weights, so all ranks start from the same point) and then `step` in lockstep.
    ///
    /// Moves the policy to `config.device` and, for mixed precision, keeps fp32 master
    /// copies of its (f32) weights and casts the model to bf16.
    pub fn with_collective(
        mut policy: Policy,
        config: LearnerConfig,
        mut collective: Box<dyn Collective>,
    ) -> Result<Self> {
        let default_gpu = match collective.device() {
            Device::Cuda(n) => n,
            _ => 0,
        };
        let device = config.device(default_gpu).map_err(anyhow::Error::msg)?;
        tutor_policy::check_device(device).map_err(|e| {
            anyhow::anyhow!(
                "learner.device = {:?}: {e}; use device = \"cpu\" on a machine without one",
                config.device
            )
        })?;
        if policy.device() != device {
            policy.var_store_mut().set_device(device);
        }
        let mut named: Vec<(String, Tensor)> = policy.var_store().variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let (param_names, mut params): (Vec<String>, Vec<Tensor>) = named.into_iter().unzip();
        if collective.world_size() > 1 {
            collective
                .broadcast(&mut params)
                .context("broadcasting rank 0's initial weights")?;
        }
        let master = if config.mixed_precision(device) {
            let weights: Vec<Tensor> = tch::no_grad(|| {
                params
                    .iter()
                    .map(|p| p.detach().to_kind(Kind::Float).copy())
                    .collect()
            });
            let grads = weights.iter().map(Tensor::zeros_like).collect();
            // Casts every parameter in place (all handles share it), `params` included.
            policy.var_store_mut().bfloat16();
            Some(Master { weights, grads })
        } else {
            None
        };
        let optimizer = AdamW::new(
            adamw_config(&config),
            master.as_ref().map_or(&params, |m| &m.weights),
        );
        let rng = ChaCha8Rng::seed_from_u64(config.seed);
        Ok(Self {
            policy,
            param_names,
            params,
            optimizer,
            master,
            config,
            steps: 0,
            collective,
            rng,
        })
    }

    /// Continues a run from `Trainer::save_checkpoint`'s directory: weights, AdamW moments
    /// and step, schedule position, RNG and config as saved. Returns the data cursor the
    /// run saved with it. In a data-parallel group every rank resumes from the same
    /// checkpoint.
    pub fn resume(
        dir: &Path,
        collective: Box<dyn Collective>,
    ) -> Result<(Self, serde_json::Value)> {
        let dir = checkpoint::resolve(dir)?;
        let state = checkpoint::read_state(&dir)?;
        let policy = Policy::load_dir(&dir, Device::Cpu)
            .with_context(|| format!("loading the model of checkpoint {}", dir.display()))?;
        let mut trainer = Self::with_collective(policy, state.config.clone(), collective)?;
        if trainer.param_names != state.parameters {
            bail!(
                "{}: the parameters listed in {} do not match the model's",
                dir.display(),
                checkpoint::STATE_FILE
            );
        }
        let path = dir.join(checkpoint::OPTIMIZER_FILE);
        let mut saved: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&path)
            .with_context(|| format!("reading {}", path.display()))?
            .into_iter()
            .collect();
        let mut take = |key: String, like: &Tensor| -> Result<Tensor> {
            let t = saved
                .remove(&key)
                .with_context(|| format!("{}: no tensor {key}", path.display()))?;
            if t.size() != like.size() {
                bail!(
                    "{}: {key} has shape {:?}, the parameter has {:?}",
                    path.display(),
                    t.size(),
                    like.size()
                );
            }
            Ok(t.to_device(like.device()))
        };
        let mut exp_avg = Vec::with_capacity(trainer.params.len());
        let mut exp_avg_sq = Vec::with_capacity(trainer.params.len());
        for (name, p) in trainer.param_names.iter().zip(&trainer.params) {
            exp_avg.push(take(format!("exp_avg.{name}"), p)?);
            exp_avg_sq.push(take(format!("exp_avg_sq.{name}"), p)?);
        }
        if let Some(master) = &mut trainer.master {
            tch::no_grad(|| -> Result<()> {
                for ((name, w), p) in trainer
                    .param_names
                    .iter()
                    .zip(master.weights.iter_mut())
                    .zip(trainer.params.iter_mut())
                {
                    w.copy_(&take(format!("master.{name}"), w)?);
                    p.copy_(w);
                }
                Ok(())
            })?;
        }
        let rng = state.rng.restore().with_context(|| {
            format!("{}: field rng", dir.join(checkpoint::STATE_FILE).display())
        })?;
        trainer.restore_position(state.optimizer_steps, exp_avg, exp_avg_sq, state.steps, rng);
        Ok((trainer, state.data_cursor))
    }

    /// Writes a checkpoint to `dir` atomically (a temporary sibling renamed into place):
    /// the model in Hugging Face layout, the optimizer state, the schedule position, the
    /// RNG and `data_cursor` (the caller's position in its data; returned by `resume`).
    /// `extra_files` (e.g. the tokenizer) are copied in. In a data-parallel group the
    /// state is the same on every rank: rank 0 alone needs to write it.
    pub fn save_checkpoint(
        &self,
        dir: &Path,
        data_cursor: &serde_json::Value,
        extra_files: &[&Path],
    ) -> Result<()> {
        checkpoint::write_atomically(dir, |tmp| {
            self.policy
                .save_dir(tmp)
                .with_context(|| format!("saving the model to {}", tmp.display()))?;
            let mut moments: Vec<(String, Tensor)> = Vec::with_capacity(2 * self.params.len());
            for (i, name) in self.param_names.iter().enumerate() {
                let host = |t: &Tensor| t.to_device(Device::Cpu).contiguous();
                moments.push((
                    format!("exp_avg.{name}"),
                    host(&self.optimizer.exp_avg()[i]),
                ));
                moments.push((
                    format!("exp_avg_sq.{name}"),
                    host(&self.optimizer.exp_avg_sq()[i]),
                ));
                if let Some(master) = &self.master {
                    moments.push((format!("master.{name}"), host(&master.weights[i])));
                }
            }
            let opt_path = tmp.join(checkpoint::OPTIMIZER_FILE);
            Tensor::write_safetensors(&moments, &opt_path)
                .with_context(|| format!("writing {}", opt_path.display()))?;
            let state = TrainerState::new(
                self.steps,
                self.optimizer.steps_taken(),
                RngState::of(&self.rng),
                data_cursor.clone(),
                self.config.clone(),
                self.param_names.clone(),
                self.collective.world_size(),
            );
            let state_path = tmp.join(checkpoint::STATE_FILE);
            std::fs::write(&state_path, serde_json::to_vec_pretty(&state)?)
                .with_context(|| format!("writing {}", state_path.display()))?;
            for f in extra_files {
                if let Some(name) = f.file_name() {
                    std::fs::copy(f, tmp.join(name))
                        .with_context(|| format!("copying {} into the checkpoint", f.display()))?;
                }
            }
            Ok(())
        })
    }

    /// Rank 0: makes `collective` this trainer's group and brings the other ranks, which
    /// call `join_group` at the same time, to this trainer's exact state: weights, AdamW
    /// moments and step, schedule position, RNG, config. Used at start and whenever the
    /// group is formed again (a rank restarted), so a rank never needs a checkpoint.
    pub fn lead_group(&mut self, mut collective: Box<dyn Collective>) -> Result<()> {
        if collective.rank() != 0 {
            bail!("lead_group is for rank 0, got rank {}", collective.rank());
        }
        let state = GroupState {
            model: self.policy.config().clone(),
            config: self.config.clone(),
            steps: self.steps,
            optimizer_steps: self.optimizer.steps_taken(),
            rng: RngState::of(&self.rng),
            parameters: self.param_names.clone(),
        };
        let mut header = serde_json::to_vec(&state)?;
        collective
            .broadcast_bytes(&mut header)
            .context("sending the training state to the other ranks")?;
        // The fp32 weights: a joining rank casts them as `with_collective` does here.
        let mut weights: Vec<Tensor> = match &self.master {
            Some(m) => m.weights.iter().map(Tensor::shallow_clone).collect(),
            None => self.params.iter().map(Tensor::shallow_clone).collect(),
        };
        collective
            .broadcast(&mut weights)
            .context("sending the weights to the other ranks")?;
        let mut moments: Vec<Tensor> = self
            .optimizer
            .exp_avg()
            .iter()
            .chain(self.optimizer.exp_avg_sq())
            .map(Tensor::shallow_clone)
            .collect();
        collective
            .broadcast(&mut moments)
            .context("sending the optimizer state to the other ranks")?;
        self.collective = collective;
        Ok(())
    }

    /// Ranks 1..K−1: joins the group rank 0 leads (`lead_group`) and returns a trainer in
    /// rank 0's exact state.
    pub fn join_group(mut collective: Box<dyn Collective>) -> Result<Self> {
        let rank = collective.rank();
        let mut header = Vec::new();
        collective
            .broadcast_bytes(&mut header)
            .context("receiving the training state from rank 0")?;
        let state: GroupState = serde_json::from_slice(&header)
            .context("rank 0 sent a training state this learner cannot read (same tutor version on every rank?)")?;
        // Rank 0 built its model from this config: it is valid.
        let policy = Policy::new(state.model.clone(), Device::Cpu, 0);
        let mut config = state.config;
        // Rank 0's GPU is rank 0's: on a GPU, each rank trains on its collective's.
        if let (Ok(Device::Cuda(_)), Device::Cuda(own)) = (config.device(0), collective.device()) {
            config.device = format!("cuda:{own}");
        }
        let mut trainer = Self::with_collective(policy, config, collective)
            .with_context(|| format!("rank {rank}: receiving rank 0's weights"))?;
        if trainer.param_names != state.parameters {
            bail!("rank {rank}: the model's parameters differ from rank 0's list");
        }
        let mut moments: Vec<Tensor> = trainer
            .params
            .iter()
            .chain(trainer.params.iter())
            .map(|p| Tensor::zeros(p.size(), (tch::Kind::Float, p.device())))
            .collect();
        trainer
            .collective
            .broadcast(&mut moments)
            .with_context(|| format!("rank {rank}: receiving rank 0's optimizer state"))?;
        let exp_avg_sq = moments.split_off(trainer.params.len());
        let rng = state.rng.restore().context("rank 0's rng state")?;
        trainer.restore_position(state.optimizer_steps, moments, exp_avg_sq, state.steps, rng);
        Ok(trainer)
    }

    /// Takes over a saved (resume) or sent (join) position: AdamW's moments and step, the
    /// schedule position and the random stream.
    fn restore_position(
        &mut self,
        optimizer_steps: u64,
        exp_avg: Vec<Tensor>,
        exp_avg_sq: Vec<Tensor>,
        steps: u64,
        rng: ChaCha8Rng,
    ) {
        self.optimizer = AdamW::from_state(
            adamw_config(&self.config),
            optimizer_steps,
            exp_avg,
            exp_avg_sq,
        );
        self.steps = steps;
        self.rng = rng;
    }

    /// Leaves a broken group: the trainer goes on alone (rank 0 keeps its state and
    /// leads a new group later).
    pub fn leave_group(&mut self) {
        self.collective = Box::new(CpuCollective::solo());
    }

    /// Rank 0's `data` to every rank of the group (see `Collective::broadcast_bytes`).
    pub fn broadcast_bytes(&mut self, data: &mut Vec<u8>) -> Result<(), CollectiveError> {
        self.collective.broadcast_bytes(data)
    }

    /// The trainer's random stream (restored exactly on resume).
    pub fn rng(&mut self) -> &mut ChaCha8Rng {
        &mut self.rng
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn config(&self) -> &LearnerConfig {
        &self.config
    }

    /// Optimizer steps taken (the schedule position).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    pub fn rank(&self) -> usize {
        self.collective.rank()
    }

    pub fn world_size(&self) -> usize {
        self.collective.world_size()
    }

    /// Mean label-token cross-entropy of a batch under the current weights, no update.
    pub fn eval_loss(&self, examples: &[(Vec<u32>, Vec<bool>)]) -> f64 {
        let _guard = tch::no_grad_guard();
        let batch = PaddedBatch::new(examples, self.policy.device());
        let logits = self.policy.forward(&batch.input_ids, &batch.attention_mask);
        masked_cross_entropy(&logits, &batch.input_ids, &batch.loss_mask).double_value(&[])
    }

    /// One optimizer step on this rank's share of a batch: summed label-token
    /// cross-entropy, backward, gradients and label counts summed over the ranks, divided
    /// by the total label count (so the gradient is that of the token-level mean over the
    /// union of all ranks' examples), clipping by global norm, AdamW.
    ///
    /// In a group every rank must call `step` for every step, with its own examples (which
    /// may be empty). A step with no label token on any rank changes nothing and does not
    /// advance the schedule.
    pub fn step(&mut self, examples: &[(Vec<u32>, Vec<bool>)]) -> Result<StepReport> {
        let Some(start) = self.begin_step(examples.is_empty()) else {
            return Ok(self.idle_report());
        };
        if self.config.packing == Packing::Tree {
            return self.packed_step(start, examples);
        }
        let device = self.policy.device();
        let batches = micro_batches(examples, self.config.micro_batch_tokens)
            .into_iter()
            .map(|micro| PaddedBatch::new(micro, device));
        self.run_passes(start, batches, |policy, batch| {
            if batch.label_tokens == 0 {
                return None;
            }
            let logits = policy.forward(&batch.input_ids, &batch.attention_mask);
            let nll = masked_nll_sum(&logits, &batch.input_ids, &batch.loss_mask);
            Some((nll, batch.label_tokens))
        })
    }

    /// The passes of one step: `loss` gives each batch's summed loss and its trained
    /// tokens (`None`: nothing to train in it); each sum's gradient is accumulated
    /// (`backward`), then `finish_step` sums over the ranks and updates.
    pub(crate) fn run_passes<B>(
        &mut self,
        start: Instant,
        batches: impl Iterator<Item = B>,
        loss: impl Fn(&Policy, &B) -> Option<(Tensor, u64)>,
    ) -> Result<StepReport> {
        let (mut local_sum, mut local_tokens, mut passes) = (0.0, 0u64, 0);
        for batch in batches {
            let Some((sum, tokens)) = loss(&self.policy, &batch) else {
                continue;
            };
            local_sum += sum.double_value(&[]);
            self.backward(&sum);
            local_tokens += tokens;
            passes += 1;
        }
        self.finish_step(start, local_sum, local_tokens, passes)
    }

    /// `step` with `packing = "tree"`: the examples as tree rows (`pack_examples`: shared
    /// prefixes once, several examples per row), micro-batched by padded rows × longest
    /// row within `micro_batch_tokens`. The summed loss and so the step are those of the
    /// examples run separately.
    fn packed_step(
        &mut self,
        start: Instant,
        examples: &[(Vec<u32>, Vec<bool>)],
    ) -> Result<StepReport> {
        let rows = pack_examples(examples, self.config.pack_row_tokens.max(1));
        let ranges =
            micro_batch_ranges(rows.iter().map(|r| r.len()), self.config.micro_batch_tokens);
        let device = self.policy.device();
        let batches = ranges
            .into_iter()
            .map(|range| PackedBatch::new(&rows[range], device));
        self.run_passes(start, batches, |policy, batch| {
            if batch.label_tokens == 0 {
                return None;
            }
            let logits = policy.forward_tree(&batch.input_ids, &batch.position_ids, &batch.allowed);
            Some((packed_nll_sum(&logits, batch), batch.label_tokens))
        })
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
        }
    }

    /// Starts a step: `None` when a lone rank has no example (nothing to do, not even a
    /// collective call), else the start time, with every gradient zeroed.
    pub(crate) fn begin_step(&mut self, no_examples: bool) -> Option<Instant> {
        if self.collective.world_size() == 1 && no_examples {
            return None;
        }
        for p in self.params.iter_mut() {
            p.zero_grad();
        }
        if let Some(m) = &mut self.master {
            for g in m.grads.iter_mut() {
                let _ = g.zero_();
            }
        }
        Some(Instant::now())
    }

    /// Backward of one pass's summed loss. Gradients of the passes add up: in `.grad`
    /// for f32 parameters; for bf16 ones each pass's gradient is added to the fp32 sums
    /// and `.grad` cleared, so the sum over micro-batches is not rounded to bf16.
    pub(crate) fn backward(&mut self, loss: &Tensor) {
        loss.backward();
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
    }

    /// Ends a step whose passes accumulated the gradients of summed per-token losses in
    /// `.grad`: loss sums and token counts summed over the ranks, gradients all-reduced
    /// and divided by the total token count (the token-level mean over the union of the
    /// ranks' examples), clipped by global norm, AdamW. No trained token on any rank: no
    /// update, no step.
    pub(crate) fn finish_step(
        &mut self,
        start: Instant,
        local_sum: f64,
        local_labels: u64,
        passes: usize,
    ) -> Result<StepReport> {
        let lr = self.config.lr_at(self.steps);
        let idle = self.idle_report();
        let solo = self.collective.world_size() == 1;
        let mut totals = [local_sum, local_labels as f64];
        self.collective
            .all_reduce_sum_f64(&mut totals)
            .context("summing loss and label counts over the ranks")?;
        let label_tokens = totals[1] as u64;
        if label_tokens == 0 {
            // Nothing to learn from (e.g. only format-error labels): no update, no step.
            return Ok(idle);
        }
        let mut grads: Vec<Tensor> = match &self.master {
            Some(m) => m.grads.iter().map(Tensor::shallow_clone).collect(),
            None => self
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
        if !solo {
            self.collective
                .all_reduce_sum(&mut grads)
                .context("all-reducing gradients")?;
        }
        let grad_norm = tch::no_grad(|| {
            let mut sq = 0.0;
            for g in grads.iter_mut() {
                let _ = g.g_div_scalar_(label_tokens as f64);
                let n = g.norm().double_value(&[]);
                sq += n * n;
            }
            let norm: f64 = f64::sqrt(sq);
            if self.config.grad_clip > 0.0 {
                let coef = self.config.grad_clip / (norm + 1e-6);
                if coef < 1.0 {
                    for g in grads.iter_mut() {
                        let _ = g.g_mul_scalar_(coef);
                    }
                }
            }
            norm
        });
        match &mut self.master {
            Some(m) => {
                self.optimizer.step(&mut m.weights, &grads, lr);
                tch::no_grad(|| {
                    for (p, w) in self.params.iter_mut().zip(&m.weights) {
                        p.copy_(w);
                    }
                });
            }
            None => self.optimizer.step(&mut self.params, &grads, lr),
        }
        self.steps += 1;
        Ok(StepReport {
            loss: totals[0] / totals[1],
            grad_norm,
            label_tokens,
            learning_rate: lr,
            seconds: start.elapsed().as_secs_f64(),
            micro_batches: passes,
        })
    }

    /// The fp32 master weights in name order when training in bf16 (what AdamW updates;
    /// the parameters are their bf16 rounding), else `None`.
    pub fn master_weights(&self) -> Option<impl Iterator<Item = (&str, &Tensor)>> {
        self.master.as_ref().map(|m| {
            self.param_names
                .iter()
                .map(String::as_str)
                .zip(m.weights.iter())
        })
    }

    /// The parameters in name order (for comparisons and checkpoints).
    pub fn named_parameters(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.param_names
            .iter()
            .map(String::as_str)
            .zip(self.params.iter())
    }

    pub fn save_weights(&self, path: &Path) -> Result<()> {
        self.policy
            .save_weights(path)
            .with_context(|| format!("saving weights to {}", path.display()))
    }

    pub fn save_dir(&self, dir: &Path) -> Result<()> {
        self.policy
            .save_dir(dir)
            .with_context(|| format!("saving the checkpoint to {}", dir.display()))
    }
}

fn adamw_config(c: &LearnerConfig) -> AdamWConfig {
    AdamWConfig {
        beta1: c.beta1,
        beta2: c.beta2,
        eps: c.eps,
        weight_decay: c.weight_decay,
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

    fn tiny_trainer() -> Trainer {
        let mut mc = ModelConfig::tiny(64);
        mc.hidden_size = 32;
        mc.intermediate_size = 64;
        mc.head_dim = 8;
        let policy = Policy::new(mc, Device::Cpu, 3);
        Trainer::new(
            policy,
            LearnerConfig {
                learning_rate: 1e-2,
                warmup_steps: 0,
                ..Default::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn loss_goes_down_on_repeated_data() {
        let mut t = tiny_trainer();
        let ex = vec![
            (
                vec![1u32, 5, 9, 13, 17, 21, 25, 2],
                vec![false, false, false, true, true, true, true, true],
            ),
            (
                vec![1u32, 7, 11, 3, 2],
                vec![false, false, true, true, true],
            ),
        ];
        let first = t.step(&ex).unwrap();
        let mut last = first;
        for _ in 0..30 {
            last = t.step(&ex).unwrap();
        }
        assert!(first.loss.is_finite() && first.grad_norm > 0.0);
        assert!(
            last.loss < first.loss * 0.5,
            "loss {} -> {}",
            first.loss,
            last.loss
        );
        assert_eq!(first.label_tokens, 5 + 3);
    }

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
            assert_eq!(a.label_tokens, b.label_tokens, "every label counted once");
            assert!(
                (a.loss - b.loss).abs() <= 1e-5 * a.loss,
                "{} vs {}",
                a.loss,
                b.loss
            );
            assert!((a.grad_norm - b.grad_norm).abs() <= 1e-4 * a.grad_norm);
        }
        let (mut num, mut den) = (0.0, 0.0);
        for ((_, p), (_, q)) in plain.named_parameters().zip(packed.named_parameters()) {
            num += (p - q).square().sum(tch::Kind::Double).double_value(&[]);
            den += p.square().sum(tch::Kind::Double).double_value(&[]);
        }
        let rel = (num / den).sqrt();
        assert!(rel <= 1e-5, "relative error {rel}");
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

    /// bf16 matrix products on the CPU run in oneDNN, whose AMX kernels have crashed
    /// (SIGILL) on some virtual machines that advertise AMX: cap it below AMX. Takes
    /// effect when called before the process's first oneDNN call (nextest runs each test
    /// in a process of its own).
    pub(crate) fn cap_onednn_isa() {
        if std::env::var_os("ONEDNN_MAX_CPU_ISA").is_none() {
            std::env::set_var("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16");
        }
    }

    fn bf16_trainer(lr: f64) -> Trainer {
        cap_onednn_isa();
        let mut t = tiny_trainer();
        t.config.precision = crate::config::Precision::Bf16;
        t.config.learning_rate = lr;
        let policy = Policy::new(t.policy.config().clone(), Device::Cpu, 3);
        Trainer::new(policy, t.config.clone()).unwrap()
    }

    fn as_f32(t: &Tensor) -> Tensor {
        t.to_kind(Kind::Float)
    }

    fn repeated_examples() -> Vec<(Vec<u32>, Vec<bool>)> {
        vec![
            (
                vec![1u32, 5, 9, 13, 17, 21, 25, 2],
                vec![false, false, false, true, true, true, true, true],
            ),
            (
                vec![1u32, 7, 11, 3, 2],
                vec![false, false, true, true, true],
            ),
            (
                vec![4u32, 8, 15, 16, 23, 42, 3],
                vec![false, true, true, true, true, true, true],
            ),
        ]
    }

    /// Mixed precision: bf16 parameters, fp32 master weights, gradient sums and AdamW
    /// moments; after every step the parameters are exactly the master's rounding; it
    /// learns, and stays close to the same run in f32.
    #[test]
    fn bf16_training_keeps_fp32_master_weights_gradients_and_moments() {
        let mut t = bf16_trainer(1e-2);
        t.config.micro_batch_tokens = 16; // several passes: sums across micro-batches
        let mut f32_run = tiny_trainer();
        f32_run.config.micro_batch_tokens = 16;
        let m = t.master.as_ref().expect("bf16 keeps master weights");
        assert!(t.params.iter().all(|p| p.kind() == Kind::BFloat16));
        assert!(m.weights.iter().all(|w| w.kind() == Kind::Float));
        assert!(m.grads.iter().all(|g| g.kind() == Kind::Float));
        // The master starts as the f32 initialization itself, not its bf16 rounding.
        for ((_, w), (_, f)) in t.master_weights().unwrap().zip(f32_run.named_parameters()) {
            assert!(w.equal(f));
        }
        let ex = repeated_examples();
        let first = t.step(&ex).unwrap();
        f32_run.step(&ex).unwrap();
        for _ in 0..2 {
            t.step(&ex).unwrap();
            f32_run.step(&ex).unwrap();
        }
        // Close to the f32 run after a few steps (bf16 keeps ~3 significant digits of the
        // activations; over many steps at this learning rate the runs diverge).
        let (mut num, mut den) = (0.0, 0.0);
        for ((_, w), (_, f)) in t.master_weights().unwrap().zip(f32_run.named_parameters()) {
            num += (w - f).square().sum(Kind::Double).double_value(&[]);
            den += f.square().sum(Kind::Double).double_value(&[]);
        }
        let rel = (num / den).sqrt();
        println!("relative distance to the f32 run after 3 steps: {rel:e}");
        assert!(rel < 0.02, "bf16 run drifted from the f32 run: {rel}");
        let mut last = first;
        for _ in 0..28 {
            last = t.step(&ex).unwrap();
        }
        assert!(first.micro_batches >= 2, "{}", first.micro_batches);
        assert!(
            t.optimizer
                .exp_avg()
                .iter()
                .chain(t.optimizer.exp_avg_sq())
                .all(|m| m.kind() == Kind::Float),
            "AdamW moments are fp32"
        );
        assert!(
            last.loss < first.loss * 0.5,
            "loss {} -> {}",
            first.loss,
            last.loss
        );
        for ((name, p), (_, w)) in t.named_parameters().zip(t.master_weights().unwrap()) {
            assert_eq!(p.kind(), Kind::BFloat16, "{name}");
            assert!(
                p.equal(&w.to_kind(Kind::BFloat16)),
                "{name}: the parameter is not the master's rounding"
            );
        }
        assert!(last.grad_norm.is_finite());
    }

    /// An update smaller than half a bf16 step is kept in the master (and adds up over
    /// steps) where bf16 parameters alone would round it away.
    #[test]
    fn updates_below_bf16_resolution_are_kept_in_the_master() {
        let mut t = bf16_trainer(1e-5);
        t.config.warmup_steps = 0;
        let name = "model.layers.0.mlp.down_proj.weight";
        let idx = t.param_names.iter().position(|n| n == name).unwrap();
        let w0 = t.master.as_ref().unwrap().weights[idx].copy();
        let p0 = t.params[idx].copy();
        t.step(&repeated_examples()).unwrap();
        let w1 = &t.master.as_ref().unwrap().weights[idx];
        let p1 = &t.params[idx];
        let n = w0.numel() as f64;
        let changed = |a: &Tensor, b: &Tensor| {
            f64::try_from(as_f32(a).ne_tensor(&as_f32(b)).sum(Kind::Double)).unwrap() / n
        };
        let master_moved = changed(&w0, w1);
        let bf16_moved = changed(&p0, p1);
        assert!(
            master_moved > 0.95,
            "master changed in {master_moved} of elements"
        );
        assert!(
            bf16_moved < 0.3,
            "bf16 parameters changed in {bf16_moved} of elements (the test needs updates below bf16 resolution)"
        );
        let step = (w1 - &w0).abs().max().double_value(&[]);
        assert!(step <= 1.2e-5, "AdamW's first step is about lr: {step}");
    }

    #[test]
    fn a_missing_gpu_is_a_clear_error() {
        let config = LearnerConfig {
            device: "cuda:63".into(),
            ..Default::default()
        };
        let policy = Policy::new(ModelConfig::tiny(64), Device::Cpu, 0);
        let e = format!("{:#}", Trainer::new(policy, config).err().unwrap());
        assert!(e.contains("learner.device") && e.contains("cuda:63"), "{e}");
    }

    #[test]
    fn context_tokens_get_no_gradient_signal() {
        // Changing a context-only token target must not change the loss value.
        let t = tiny_trainer();
        let a = vec![(vec![1u32, 5, 9, 13], vec![false, false, false, true])];
        let b = vec![(vec![1u32, 5, 9, 13], vec![false, false, false, true])];
        assert_eq!(t.eval_loss(&a), t.eval_loss(&b));
        let c = vec![(vec![1u32, 5, 9, 13], vec![false, true, false, true])];
        assert_ne!(t.eval_loss(&a), t.eval_loss(&c));
    }
}
