//! The trainer's whole state moved as one: a checkpoint written and resumed from, and a
//! data-parallel group that rank 0 leads (sending it) and other ranks join (taking it),
//! left when the group breaks. After either, a trainer is in exactly the saved or sent
//! position: weights, AdamW moments and step, schedule position, RNG, config.

use std::path::Path;

use anyhow::{bail, Context, Result};
use rand_chacha::ChaCha8Rng;
use tch::{Device, Tensor};
use tutor_collective::{Collective, CollectiveError, CpuCollective};
use tutor_policy::{ModelConfig, Policy};

use super::shard::{self, FlatLayout, Sharded};
use super::{adamw_config, Trainer, Weights};
use crate::checkpoint::{self, RngState, TrainerState};
use crate::config::{LearnerConfig, Shard};
use crate::optim::AdamW;

/// The whole optimizer state (`Trainer::full_optimizer_state`).
struct FullState {
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    /// The fp32 master weights in bf16 training.
    master: Option<Vec<Tensor>>,
}

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

impl Trainer {
    /// Continues a run from `Trainer::save_checkpoint`'s directory: weights, AdamW moments
    /// and step, schedule position, RNG and config as saved. Returns the data cursor the
    /// run saved with it. In a data-parallel group every rank resumes from the same
    /// checkpoint.
    pub fn resume(
        dir: &Path,
        collective: Box<dyn Collective>,
    ) -> Result<(Self, serde_json::Value)> {
        Self::resume_with(dir, collective, |_| {})
    }

    /// `resume` with the saved config changed by `adjust` first (e.g. another
    /// `shard`: a checkpoint has the same layout whatever the sharding, so a run resumes
    /// under any setting and world size).
    pub fn resume_with(
        dir: &Path,
        collective: Box<dyn Collective>,
        adjust: impl FnOnce(&mut LearnerConfig),
    ) -> Result<(Self, serde_json::Value)> {
        Self::resume_staged(dir, collective, adjust, false)
    }

    /// `resume` for rank 0 of a group that has not formed yet (see
    /// `Trainer::from_model_dir_for_group`): alone, with the state in host memory until
    /// the group forms.
    pub fn resume_for_group(dir: &Path) -> Result<(Self, serde_json::Value)> {
        Self::resume_staged(
            dir,
            Box::new(tutor_collective::CpuCollective::solo()),
            |_| {},
            true,
        )
    }

    fn resume_staged(
        dir: &Path,
        collective: Box<dyn Collective>,
        adjust: impl FnOnce(&mut LearnerConfig),
        stage: bool,
    ) -> Result<(Self, serde_json::Value)> {
        let dir = checkpoint::resolve(dir)?;
        let state = checkpoint::read_state(&dir)?;
        let policy = Policy::load_dir(&dir, Device::Cpu)
            .with_context(|| format!("loading the model of checkpoint {}", dir.display()))?;
        let mut config = state.config.clone();
        adjust(&mut config);
        config.validate()?;
        let mut trainer = Self::build(policy, config, collective, stage)?;
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
        // Sharded, each rank keeps a slice: the whole state stays in host memory.
        let to_device = trainer.sharded.is_none();
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
            Ok(if to_device {
                t.to_device(like.device())
            } else {
                t
            })
        };
        let mut exp_avg = Vec::with_capacity(trainer.params.len());
        let mut exp_avg_sq = Vec::with_capacity(trainer.params.len());
        for (name, p) in trainer.param_names.iter().zip(&trainer.params) {
            exp_avg.push(take(format!("exp_avg.{name}"), p)?);
            exp_avg_sq.push(take(format!("exp_avg_sq.{name}"), p)?);
        }
        if trainer.trains_in_bf16() {
            let mut masters = Vec::with_capacity(trainer.params.len());
            for (name, p) in trainer.param_names.iter().zip(&trainer.params) {
                masters.push(take(format!("master.{name}"), p)?);
            }
            trainer.restore_masters(masters);
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
    ///
    /// With `[learner] shard` each rank holds a slice of the optimizer state: every rank
    /// of the group calls this together (rank 0 gathers the slices and writes the same
    /// layout as without sharding; the others only send theirs).
    pub fn save_checkpoint(
        &mut self,
        dir: &Path,
        data_cursor: &serde_json::Value,
        extra_files: &[&Path],
    ) -> Result<()> {
        let full = self
            .full_optimizer_state()
            .context("gathering the sharded optimizer state for the checkpoint")?;
        let Some(full) = full.filter(|_| self.collective.rank() == 0) else {
            return Ok(());
        };
        checkpoint::write_atomically(dir, |tmp| {
            self.policy
                .save_dir_with(tmp, self.named_parameters())
                .with_context(|| format!("saving the model to {}", tmp.display()))?;
            let mut moments: Vec<(String, Tensor)> = Vec::with_capacity(3 * self.params.len());
            for (i, name) in self.param_names.iter().enumerate() {
                let host = |t: &Tensor| t.to_device(Device::Cpu).contiguous();
                moments.push((format!("exp_avg.{name}"), host(&full.exp_avg[i])));
                moments.push((format!("exp_avg_sq.{name}"), host(&full.exp_avg_sq[i])));
                if let Some(master) = &full.master {
                    moments.push((format!("master.{name}"), host(&master[i])));
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

    /// Ranks 1..K−1 of a sharded group, while rank 0 runs `save_checkpoint`: sends this
    /// rank's slice of the optimizer state (the same call on every rank).
    pub fn send_checkpoint_state(&mut self) -> Result<()> {
        self.full_optimizer_state().map(drop)
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
        if let Some(s) = &self.sharded {
            s.check_whole()?;
            if self.collective.world_size() > 1 {
                bail!("lead_group: leave the current group first");
            }
        }
        // Alone, a sharded trainer's slice is the whole state.
        let full = self
            .full_optimizer_state()?
            .context("lead_group: rank 0 of its own group holds the whole state")?;
        let mut header = serde_json::to_vec(&state)?;
        collective
            .broadcast_bytes(&mut header)
            .context("sending the training state to the other ranks")?;
        // The fp32 weights: a joining rank casts them as `with_collective` does here.
        // Bucket by bucket, as the joining rank receives them (`broadcast_in_buckets`):
        // where they are in host memory (a trainer built for the group, the gathered
        // masters) the collective stages one bucket at a time on the device.
        let device = collective.device();
        let mut weights: Vec<Tensor> = match &full.master {
            // Sharded, the gathered masters are in host memory.
            Some(m) => m.iter().map(Tensor::shallow_clone).collect(),
            None => self
                .named_parameters()
                .map(|(_, p)| p.shallow_clone())
                .collect(),
        };
        super::broadcast_in_buckets(
            &mut *collective,
            &mut weights,
            self.config.bucket_elements(),
        )
        .context("sending the weights to the other ranks")?;
        if self.sharded.is_none() {
            let mut moments: Vec<Tensor> = full
                .exp_avg
                .iter()
                .chain(&full.exp_avg_sq)
                .map(Tensor::shallow_clone)
                .collect();
            collective
                .broadcast(&mut moments)
                .context("sending the optimizer state to the other ranks")?;
            self.collective = collective;
            self.unstage();
            return Ok(());
        }
        // Sharded: each rank gets its slice of the moments, one rank after another, a
        // bucket per broadcast (`shard::chunks`, as `join_group` receives them): no rank
        // ever holds the whole state on its device, nor more than a bucket of another
        // rank's slice.
        let world = collective.world_size();
        let bucket = self.config.bucket_elements();
        for r in 1..world {
            let layout = FlatLayout::for_mode(
                self.config.shard,
                bucket,
                &self.param_names,
                &weights,
                world,
                r,
            );
            for moment in [&full.exp_avg, &full.exp_avg_sq] {
                let slice = layout.slice_of(moment);
                for (at, n) in shard::chunks(slice.numel() as i64, bucket) {
                    let mut one = [slice.narrow(0, at, n).to_device(device)];
                    collective.broadcast(&mut one).with_context(|| {
                        format!("sending rank {r} its slice of the optimizer state")
                    })?;
                }
            }
        }
        self.collective = collective;
        let mode = self.config.shard;
        let mixed = full.master.is_some();
        // Where the slices live: the device this trainer trains on.
        let home = self
            .target_device
            .unwrap_or_else(|| self.params[0].device());
        self.sharded = Some(Sharded::new(
            mode,
            self.config.bucket_elements(),
            &self.param_names,
            &weights,
            world,
            0,
            mixed,
            home,
        ));
        drop(weights);
        let steps = self.optimizer.steps_taken();
        self.install_moments(steps, full.exp_avg, full.exp_avg_sq);
        // Now only this rank's slices are on the device; the model follows.
        self.unstage();
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
        let mut config = state.config;
        // Rank 0's GPU is rank 0's: on a GPU, each rank trains on its collective's.
        if let (Ok(Device::Cuda(_)), Device::Cuda(own)) = (config.device(0), collective.device()) {
            config.device = format!("cuda:{own}");
        }
        // Rank 0 built its model from this config: it is valid. Sharded, the model is a
        // placeholder that keeps this rank's slice of each bucket of weights as it arrives
        // in host memory (and, but with "full", each parameter in the kind it trains in),
        // then moves to the device: the joining rank holds no copy of the model beyond
        // what its mode keeps ("full": none). Unsharded, every rank holds it anyway; the
        // broadcast overwrites its zeros.
        let (policy, weights) = if config.shard == Shard::None {
            let policy = Policy::zeroed(state.model.clone(), Device::Cpu);
            (policy, Weights::InPolicy)
        } else {
            let (policy, shapes) = Policy::placeholder(state.model.clone(), Device::Cpu);
            (policy, Weights::Received { shapes })
        };
        let mut trainer = Self::build_from(policy, weights, config, collective, true)
            .with_context(|| format!("rank {rank}: receiving rank 0's weights"))?;
        if trainer.param_names != state.parameters {
            bail!("rank {rank}: the model's parameters differ from rank 0's list");
        }
        let rng = state.rng.restore().context("rank 0's rng state")?;
        let receiving = || format!("rank {rank}: receiving rank 0's optimizer state");
        // The moments arrive into the zeros the trainer's AdamW made (a second set would
        // hold the moments twice while they arrive).
        let owned = |ts: &[Tensor]| ts.iter().map(Tensor::shallow_clone).collect::<Vec<_>>();
        let (mut exp_avg, mut exp_avg_sq) = (
            owned(trainer.optimizer.exp_avg()),
            owned(trainer.optimizer.exp_avg_sq()),
        );
        if let Some(s) = &trainer.sharded {
            // Rank 0 sends each rank its slice, one rank after another, a bucket per
            // broadcast (`lead_group`): this rank's go into place, the others' through
            // one bucket of scratch.
            let (share, device) = (s.layout.share(), s.weights.device());
            let bucket = trainer.config.bucket_elements();
            let scratch = Tensor::zeros([bucket.min(share)], (tch::Kind::Float, device));
            for r in 1..trainer.collective.world_size() {
                for moment in [&exp_avg[0], &exp_avg_sq[0]] {
                    for (at, n) in shard::chunks(share, bucket) {
                        let mut into = if r == rank {
                            moment.narrow(0, at, n)
                        } else {
                            scratch.narrow(0, 0, n)
                        };
                        trainer
                            .collective
                            .broadcast(std::slice::from_mut(&mut into))
                            .with_context(receiving)?;
                    }
                }
            }
            drop(scratch);
            trainer.optimizer = AdamW::from_state(
                adamw_config(&trainer.config),
                state.optimizer_steps,
                exp_avg,
                exp_avg_sq,
            );
            trainer.steps = state.steps;
            trainer.rng = rng;
            trainer.unstage();
            return Ok(trainer);
        }
        let mut moments: Vec<Tensor> = exp_avg.drain(..).chain(exp_avg_sq.drain(..)).collect();
        trainer
            .collective
            .broadcast(&mut moments)
            .with_context(receiving)?;
        let exp_avg_sq = moments.split_off(trainer.params.len());
        trainer.restore_position(state.optimizer_steps, moments, exp_avg_sq, state.steps, rng);
        Ok(trainer)
    }

    /// Takes over a saved (resume) or sent (join) position: AdamW's moments (whole, shaped
    /// like the parameters) and step, the schedule position and the random stream.
    fn restore_position(
        &mut self,
        optimizer_steps: u64,
        exp_avg: Vec<Tensor>,
        exp_avg_sq: Vec<Tensor>,
        steps: u64,
        rng: ChaCha8Rng,
    ) {
        self.install_moments(optimizer_steps, exp_avg, exp_avg_sq);
        self.steps = steps;
        self.rng = rng;
    }

    /// AdamW at step `optimizer_steps` with these whole moments (this rank's slice of
    /// them when sharded).
    fn install_moments(
        &mut self,
        optimizer_steps: u64,
        exp_avg: Vec<Tensor>,
        exp_avg_sq: Vec<Tensor>,
    ) {
        let (exp_avg, exp_avg_sq) = match &self.sharded {
            Some(s) => {
                let device = s.weights.device();
                (
                    vec![s.layout.slice_of(&exp_avg).to_device(device)],
                    vec![s.layout.slice_of(&exp_avg_sq).to_device(device)],
                )
            }
            None => (exp_avg, exp_avg_sq),
        };
        self.optimizer = AdamW::from_state(
            adamw_config(&self.config),
            optimizer_steps,
            exp_avg,
            exp_avg_sq,
        );
    }

    /// Saved fp32 master weights (bf16 training): they become the masters (this rank's
    /// slice when sharded) and the parameters their rounding.
    fn restore_masters(&mut self, masters: Vec<Tensor>) {
        tch::no_grad(|| {
            match (&mut self.sharded, &mut self.master) {
                (Some(s), _) => {
                    s.weights = s.layout.slice_of(&masters).to_device(s.weights.device())
                }
                (None, Some(m)) => {
                    for (w, saved) in m.weights.iter_mut().zip(&masters) {
                        w.copy_(saved);
                    }
                }
                (None, None) => {}
            }
            for (p, w) in self.params.iter_mut().zip(&masters) {
                p.copy_(w);
            }
        });
    }

    /// The whole optimizer state, shaped like the parameters: AdamW's moments and, in
    /// bf16, the fp32 master weights. Sharded, the slices are gathered to rank 0's host
    /// memory (every rank of the group must call it together; the others get `None`);
    /// else views of the trainer's own tensors.
    fn full_optimizer_state(&mut self) -> Result<Option<FullState>> {
        let Some(s) = &self.sharded else {
            return Ok(Some(FullState {
                exp_avg: self
                    .optimizer
                    .exp_avg()
                    .iter()
                    .map(Tensor::shallow_clone)
                    .collect(),
                exp_avg_sq: self
                    .optimizer
                    .exp_avg_sq()
                    .iter()
                    .map(Tensor::shallow_clone)
                    .collect(),
                master: self
                    .master
                    .as_ref()
                    .map(|m| m.weights.iter().map(Tensor::shallow_clone).collect()),
            }));
        };
        s.check_whole()?;
        let bf16 = self.trains_in_bf16();
        let c = &mut *self.collective;
        let exp_avg = s.layout.gather_to_host(&self.optimizer.exp_avg()[0], c)?;
        let exp_avg_sq = s
            .layout
            .gather_to_host(&self.optimizer.exp_avg_sq()[0], c)?;
        let master = if bf16 {
            s.layout.gather_to_host(&s.weights, c)?
        } else {
            None
        };
        Ok(exp_avg
            .zip(exp_avg_sq)
            .map(|(exp_avg, exp_avg_sq)| FullState {
                exp_avg,
                exp_avg_sq,
                master,
            }))
    }

    /// Leaves a broken group: the trainer goes on alone (rank 0 keeps its state and
    /// leads a new group later).
    pub fn leave_group(&mut self) {
        if let Some(s) = &mut self.sharded {
            // The other ranks' slices of the state are gone with the group.
            s.lost |= self.collective.world_size() > 1;
        }
        self.collective = Box::new(CpuCollective::solo());
    }

    /// Rank 0's `data` to every rank of the group (see `Collective::broadcast_bytes`).
    pub fn broadcast_bytes(&mut self, data: &mut Vec<u8>) -> Result<(), CollectiveError> {
        self.collective.broadcast_bytes(data)
    }
}
