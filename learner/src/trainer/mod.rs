//! The training state: the student's weights, their AdamW state (with fp32 master
//! weights in mixed precision) and this rank's link to the other data-parallel ranks.
//! Owned by one thread (tch tensors are not shared across tasks); the gRPC service talks
//! to it through `LearnerHandle`. `step` holds the step every objective shares, `state`
//! checkpoints and group membership; each objective's own step lives with its loss
//! (`crate::loss`).

mod shard;
mod state;
mod step;

pub use step::{micro_batch_ranges, micro_batches, rank_shard, NonFinite, StepError};

use std::path::Path;

use anyhow::{bail, Context, Result};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tch::{Device, Kind, Tensor};
use tutor_collective::{Collective, CpuCollective};
use tutor_policy::{ModelConfig, Policy};

use crate::config::{LearnerConfig, Shard};
use crate::optim::{AdamW, AdamWConfig};
use shard::{tensor_bytes, FlatLayout, Sharded};

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
    /// `Some`: the loss or the gradient norm was not finite and the step was skipped
    /// (no update, no optimizer or schedule step); `loss` and `grad_norm` are the
    /// non-finite values.
    pub skipped: Option<NonFinite>,
}

/// The training state one rank holds (`Trainer::state_bytes`), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateBytes {
    /// The model's parameters (every rank holds them all).
    pub parameters: u64,
    /// The fp32 weights AdamW updates besides the parameters: the master weights in
    /// bf16, this rank's slice of them when sharded.
    pub masters: u64,
    /// AdamW's two moments (fp32).
    pub moments: u64,
    /// fp32 gradient sums kept besides the parameters' `.grad`.
    pub grad_sums: u64,
    /// The most parameter bytes present at once during the last step's passes: with
    /// `shard = "full"` the units gathered at a time (the embedding/head and one layer),
    /// else `parameters`.
    pub parameters_in_passes: u64,
    /// Parameters kept in host memory: with `shard = "full"` rank 0's copy of the current
    /// weights (it publishes and checkpoints them), else 0.
    pub host_parameters: u64,
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
    /// `Some` when training in bf16 without sharding.
    master: Option<Master>,
    /// `Some` with `[learner] shard` other than `"none"`: this rank's slice of the fp32
    /// weights and gradient sums; `optimizer` then holds the moments of that slice only.
    sharded: Option<Sharded>,
    config: LearnerConfig,
    steps: u64,
    /// Steps skipped for a non-finite loss or gradient norm since this trainer started
    /// (not checkpointed).
    skipped_steps: u64,
    collective: Box<dyn Collective>,
    /// `shard = "full"`: the most parameter bytes present at once during the last
    /// step's passes.
    pass_parameter_peak: Option<u64>,
    /// Built for a group that has not formed yet (`from_model_dir_for_group`,
    /// `resume_for_group`): the device the training state moves to from host memory.
    target_device: Option<Device>,
    /// `shard = "full"`, rank 0, once its parameters were first released: the current
    /// weights (the parameters' kind) in host memory, where publishing, checkpoints and
    /// leading a group read them; the device keeps none between steps.
    host_params: Option<Vec<Tensor>>,
    /// The trainer's own random stream (seeded by `config.seed`), saved in checkpoints so
    /// a resumed run draws the same numbers. The cross-entropy step draws none.
    rng: ChaCha8Rng,
}

impl Trainer {
    /// Starts from `model_dir/model.safetensors` when present, else from random weights
    /// seeded by `config.seed` with the architecture in `model_dir/config.json`.
    pub fn from_model_dir(model_dir: &Path, config: LearnerConfig) -> Result<Self> {
        Self::from_model_dir_staged(model_dir, config, false)
    }

    /// `from_model_dir` for rank 0 of a group that has not formed yet: with a sharded
    /// `[learner] shard`, the training state stays in host memory until `lead_group`
    /// gives this rank its slice (alone, a sharded rank's slice is the whole state, which
    /// need not fit its GPU). A step taken alone moves it to the device first.
    pub fn from_model_dir_for_group(model_dir: &Path, config: LearnerConfig) -> Result<Self> {
        Self::from_model_dir_staged(model_dir, config, true)
    }

    fn from_model_dir_staged(model_dir: &Path, config: LearnerConfig, stage: bool) -> Result<Self> {
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
        Self::build(policy, config, Box::new(CpuCollective::solo()), stage)
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
        policy: Policy,
        config: LearnerConfig,
        collective: Box<dyn Collective>,
    ) -> Result<Self> {
        Self::build(policy, config, collective, false)
    }

    /// `with_collective`; with `stage` and a sharded `[learner] shard`, everything is
    /// built in host memory and moves to the configured device at `lead_group` (rank 0),
    /// at the end of `join_group` (a joining rank) or at a step taken before any group
    /// (`unstage`).
    pub(crate) fn build(
        policy: Policy,
        config: LearnerConfig,
        collective: Box<dyn Collective>,
        stage: bool,
    ) -> Result<Self> {
        Self::build_from(policy, Weights::InPolicy, config, collective, stage)
    }

    /// `build`, the weights coming from `weights`.
    pub(crate) fn build_from(
        mut policy: Policy,
        weights: Weights,
        config: LearnerConfig,
        mut collective: Box<dyn Collective>,
        stage: bool,
    ) -> Result<Self> {
        let default_gpu = match collective.device() {
            Device::Cuda(n) => n,
            _ => 0,
        };
        let target = config.device(default_gpu)?;
        tutor_policy::check_device(target).map_err(|e| {
            anyhow::anyhow!(
                "learner.device = {:?}: {e}; use device = \"cpu\" on a machine without one",
                config.device
            )
        })?;
        // (On the CPU too: the move is then no move, and the same code runs.)
        let staged = stage && config.shard != Shard::None;
        let device = if staged { Device::Cpu } else { target };
        if policy.device() != device {
            policy.var_store_mut().set_device(device);
        }
        if config.shard == Shard::Full && !config.checkpoint_activations {
            bail!("{}", crate::config::ConfigError::FullShard);
        }
        policy.set_checkpoint_activations(config.checkpoint_activations);
        let mut named: Vec<(String, Tensor)> = policy.var_store().variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let (param_names, mut params): (Vec<String>, Vec<Tensor>) = named.into_iter().unzip();
        let mixed = config.mixed_precision(target);
        let (world, rank, bucket) = (
            collective.world_size(),
            collective.rank(),
            config.bucket_elements(),
        );
        let sharded = match weights {
            Weights::InPolicy => {
                if world > 1 {
                    broadcast_in_buckets(&mut *collective, &mut params, bucket)
                        .context("broadcasting rank 0's initial weights")?;
                }
                (config.shard != Shard::None).then(|| {
                    Sharded::new(
                        config.shard,
                        bucket,
                        &param_names,
                        &params,
                        world,
                        rank,
                        mixed,
                        device,
                    )
                })
            }
            Weights::Received { shapes } => {
                if config.shard == Shard::None {
                    bail!("only a sharded rank receives its weights into a placeholder");
                }
                let shapes = param_names
                    .iter()
                    .map(|n| {
                        shapes
                            .get(n)
                            .cloned()
                            .with_context(|| format!("rank {rank}: no shape for parameter {n:?}"))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let layout = FlatLayout::for_shapes(
                    config.shard,
                    bucket,
                    &param_names,
                    &shapes,
                    world,
                    rank,
                );
                // The modes that keep the whole model set each parameter as it arrives,
                // already in the kind it trains in; `"full"` keeps none.
                let kind = if mixed { Kind::BFloat16 } else { Kind::Float };
                let mut set = |j: usize, start: i64, piece: &Tensor| {
                    tch::no_grad(|| {
                        if start == 0 {
                            params[j]
                                .set_data(&Tensor::zeros(shapes[j].as_slice(), (kind, device)));
                        }
                        params[j]
                            .view([-1])
                            .narrow(0, start, piece.numel() as i64)
                            .copy_(piece);
                    })
                };
                let keep =
                    (config.shard != Shard::Full).then_some(&mut set as &mut shard::KeepPiece);
                let slice =
                    shard::receive_slice_in_buckets(&mut *collective, &layout, bucket, keep)
                        .context("receiving rank 0's initial weights")?;
                Some(Sharded::from_slice(
                    config.shard,
                    layout,
                    slice.to_device(device),
                    mixed,
                    device,
                ))
            }
        };
        if let Some(s) = &sharded {
            if collective.world_size() > 1 {
                tracing::info!(
                    shard = config.shard.name(),
                    rank = collective.rank(),
                    world_size = collective.world_size(),
                    slice_elements = s.layout.share(),
                    padded_elements = s.layout.padded(),
                    "sharded training state: this rank keeps the fp32 weights and AdamW \
                     moments of its slice only"
                );
            }
        }
        let master = if mixed && sharded.is_none() {
            let weights: Vec<Tensor> = tch::no_grad(|| {
                params
                    .iter()
                    .map(|p| p.detach().to_kind(Kind::Float).copy())
                    .collect()
            });
            let grads = weights.iter().map(Tensor::zeros_like).collect();
            Some(Master { weights, grads })
        } else {
            None
        };
        if mixed {
            // Casts every parameter in place (all handles share it), `params` included.
            policy.var_store_mut().bfloat16();
        }
        let optimizer = AdamW::new(
            adamw_config(&config),
            match (&sharded, &master) {
                (Some(s), _) => std::slice::from_ref(&s.weights),
                (None, Some(m)) => &m.weights,
                (None, None) => &params,
            },
        );
        let rng = ChaCha8Rng::seed_from_u64(config.seed);
        Ok(Self {
            policy,
            param_names,
            params,
            optimizer,
            master,
            sharded,
            config,
            steps: 0,
            skipped_steps: 0,
            collective,
            pass_parameter_peak: None,
            host_params: None,
            target_device: staged.then_some(target),
            rng,
        })
    }

    /// Moves a trainer built for a group that has not formed yet (its state in host
    /// memory) to its device: with `shard = "full"` rank 0 first keeps the weights in
    /// host memory and releases the parameters, so the device gets only the slices.
    /// Nothing for any other trainer.
    pub(crate) fn unstage(&mut self) {
        let Some(target) = self.target_device.take() else {
            return;
        };
        if self.is_fully_sharded() {
            // Rank 0 publishes and checkpoints from its host copy; the others keep none.
            if self.collective.rank() == 0 {
                self.keep_weights_on_host();
            }
            shard::release_all(&mut self.params, Device::Cpu);
        }
        self.policy.var_store_mut().set_device(target);
        if let Some(s) = &mut self.sharded {
            s.weights = s.weights.to_device(target);
            if let Some(g) = &mut s.grad_sums {
                *g = g.to_device(target);
            }
        }
        let move_all = |ts: &[Tensor]| ts.iter().map(|t| t.to_device(target)).collect();
        let (exp_avg, exp_avg_sq) = (
            move_all(self.optimizer.exp_avg()),
            move_all(self.optimizer.exp_avg_sq()),
        );
        self.optimizer = AdamW::from_state(
            adamw_config(&self.config),
            self.optimizer.steps_taken(),
            exp_avg,
            exp_avg_sq,
        );
        tracing::info!(device = ?target, "the training state moved from host memory to its device");
    }

    /// `shard = "full"`, rank 0: copies the parameters, still whole, to host memory if it
    /// holds no copy there yet (before they are first released).
    pub(crate) fn keep_weights_on_host(&mut self) {
        if self.host_params.is_none() {
            self.host_params = Some(tch::no_grad(|| {
                self.params
                    .iter()
                    .map(|p| p.to_device(Device::Cpu).copy())
                    .collect()
            }));
        }
    }

    /// The parameters' number format (a released parameter keeps it).
    pub(crate) fn param_kind(&self) -> Kind {
        self.params.first().map_or(Kind::Float, Tensor::kind)
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

    /// Steps skipped since this trainer started because their loss or gradient norm was
    /// not finite (`StepReport::skipped`).
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    pub fn rank(&self) -> usize {
        self.collective.rank()
    }

    pub fn world_size(&self) -> usize {
        self.collective.world_size()
    }

    /// Mixed precision: bf16 parameters with fp32 masters (sharded or not).
    fn trains_in_bf16(&self) -> bool {
        self.params.first().map(Tensor::kind) == Some(Kind::BFloat16)
    }

    /// Whether `[learner] shard` splits the optimizer state across the ranks.
    pub fn is_sharded(&self) -> bool {
        self.sharded.is_some()
    }

    /// A sharded trainer whose group broke: the other ranks' slices of the optimizer
    /// state are gone, so it cannot step or lead a group; resume it from a checkpoint.
    pub fn lost_shards(&self) -> bool {
        self.sharded.as_ref().is_some_and(|s| s.lost)
    }

    /// What this rank holds of the training state, in bytes (tensor sizes, not process
    /// memory): how `[learner] shard` divides it.
    pub fn state_bytes(&self) -> StateBytes {
        let sum = |ts: &[Tensor]| ts.iter().map(tensor_bytes).sum::<u64>();
        let parameters = sum(&self.params);
        let moments = sum(self.optimizer.exp_avg()) + sum(self.optimizer.exp_avg_sq());
        let (masters, grad_sums) = match (&self.sharded, &self.master) {
            // In f32 the weights slice repeats values of the parameters: 4/K bytes per
            // parameter that unsharded f32 training does without.
            (Some(s), _) => s.bytes(),
            (None, Some(m)) => (sum(&m.weights), sum(&m.grads)),
            (None, None) => (0, 0),
        };
        StateBytes {
            parameters,
            masters,
            moments,
            grad_sums,
            parameters_in_passes: self.pass_parameter_peak.unwrap_or(parameters),
            host_parameters: self.host_params.as_deref().map_or(0, sum),
        }
    }

    /// The fp32 master weights in name order when training in bf16 without sharding
    /// (what AdamW updates; the parameters are their bf16 rounding), else `None`.
    pub fn master_weights(&self) -> Option<impl Iterator<Item = (&str, &Tensor)>> {
        self.master.as_ref().map(|m| {
            self.param_names
                .iter()
                .map(String::as_str)
                .zip(m.weights.iter())
        })
    }

    /// The current weights in name order (for comparisons and checkpoints): the
    /// parameters, or with `shard = "full"` rank 0's host copy of them (the other ranks'
    /// are released between steps: shape `[0]`).
    pub fn named_parameters(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.param_names
            .iter()
            .map(String::as_str)
            .zip(self.host_params.as_ref().unwrap_or(&self.params).iter())
    }

    pub fn save_weights(&self, path: &Path) -> Result<()> {
        self.policy
            .save_weights_with(path, self.named_parameters())
            .with_context(|| format!("saving weights to {}", path.display()))
    }

    pub fn save_dir(&self, dir: &Path) -> Result<()> {
        self.policy
            .save_dir_with(dir, self.named_parameters())
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

/// Where a trainer's weights come from when it is built.
pub(crate) enum Weights {
    /// The policy's own; in a group rank 0's are broadcast over the others'.
    InPolicy,
    /// Rank 0's, received bucket by bucket into a placeholder policy
    /// (`Policy::placeholder`, with each parameter's shape by name): a rank joining a
    /// sharded group, which keeps its slice and (except `"full"`) each parameter.
    Received {
        shapes: std::collections::BTreeMap<String, Vec<i64>>,
    },
}

/// Rank 0's `tensors` broadcast to every rank (in place), in calls of at most `bucket`
/// elements each (`shard::broadcast_calls`: consecutive whole tensors, a larger tensor in
/// runs of a bucket): a collective that stages host tensors through its GPU (NCCL) then
/// holds one bucket there, not the whole model nor its largest tensor. Every rank must
/// pass tensors of the same shapes and the same `bucket`.
pub(crate) fn broadcast_in_buckets(
    collective: &mut dyn Collective,
    tensors: &mut [Tensor],
    bucket: i64,
) -> Result<(), tutor_collective::CollectiveError> {
    let numels: Vec<i64> = tensors.iter().map(|t| t.numel() as i64).collect();
    for call in shard::broadcast_calls(&numels, bucket) {
        // Whole tensors as they are; a larger one's runs as views of its elements (the
        // parameters and their copies are contiguous), written in place.
        let mut pieces = tch::no_grad(|| {
            call.iter()
                .map(|p| {
                    let t = &tensors[p.tensor];
                    if p.len == numels[p.tensor] {
                        return Ok(t.shallow_clone());
                    }
                    let flat = t.f_view([-1]).map_err(|e| {
                        tutor_collective::CollectiveError::Setup(format!(
                            "tensor {} ({:?}) is larger than a bucket of {bucket} elements and \
                             not contiguous, so it cannot go in runs: {e}",
                            p.tensor,
                            t.size()
                        ))
                    })?;
                    Ok(flat.narrow(0, p.start, p.len))
                })
                .collect::<Result<Vec<Tensor>, tutor_collective::CollectiveError>>()
        })?;
        collective.broadcast(&mut pieces)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn tiny_trainer() -> Trainer {
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

    /// DAPO examples whose importance ratio overflows: old log-probs of −200 (finite, so
    /// a batch carrying them is taken) make r = exp(ℓ_θ + 200) infinite in f32, and with
    /// Â < 0 the unclipped −∞ is the surrogate's minimum: the loss is +∞ and backward
    /// gives non-finite gradients.
    fn overflowing_dapo() -> Vec<crate::loss::RlExample> {
        dapo_with_old_logprob(-200.0)
    }

    /// DAPO examples of `repeated_examples` with advantage −1 and the old policy's
    /// log-prob `old` on every label token: ratios of e^(log p − old).
    fn dapo_with_old_logprob(old: f32) -> Vec<crate::loss::RlExample> {
        repeated_examples()
            .into_iter()
            .map(|(tokens, loss_mask)| crate::loss::RlExample {
                advantages: loss_mask
                    .iter()
                    .map(|&m| if m { -1.0 } else { 0.0 })
                    .collect(),
                old_logprobs: loss_mask
                    .iter()
                    .map(|&m| if m { old } else { 0.0 })
                    .collect(),
                tokens,
                loss_mask,
            })
            .collect()
    }

    fn copies<'a>(ts: impl IntoIterator<Item = &'a Tensor>) -> Vec<Tensor> {
        ts.into_iter().map(Tensor::copy).collect()
    }

    fn all_equal(a: &[Tensor], b: &[Tensor]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.equal(y))
    }

    /// A step whose loss or gradient norm is not finite is skipped: the parameters (and
    /// the fp32 master weights in bf16), the AdamW moments and step and the schedule
    /// position are exactly as before it, it is reported and counted; the next good step
    /// trains from there.
    #[test]
    fn a_step_whose_loss_is_not_finite_changes_nothing() {
        for bf16 in [false, true] {
            let mut t = if bf16 {
                bf16_trainer(1e-2)
            } else {
                tiny_trainer()
            };
            // A good step first: non-zero moments to keep.
            t.step(&repeated_examples()).unwrap();
            let params = copies(&t.params);
            let master = t.master.as_ref().map(|m| copies(&m.weights));
            let exp_avg = copies(t.optimizer.exp_avg());
            let exp_avg_sq = copies(t.optimizer.exp_avg_sq());
            let (steps, adam_steps) = (t.steps, t.optimizer.steps_taken());

            let r = t.dapo_step(&overflowing_dapo()).unwrap();
            let why = r.skipped.expect("the step is skipped");
            assert_eq!(why.loss, f64::INFINITY, "bf16 {bf16}: {why}");
            assert!(!why.grad_norm.is_finite(), "bf16 {bf16}: {why}");
            assert_eq!(
                (r.loss.to_bits(), r.grad_norm.to_bits()),
                (why.loss.to_bits(), why.grad_norm.to_bits())
            );
            assert!(r.label_tokens > 0);
            assert!(
                all_equal(&t.params, &params),
                "bf16 {bf16}: the weights moved"
            );
            if let (Some(m), Some(before)) = (&t.master, &master) {
                assert!(all_equal(&m.weights, before), "the master weights moved");
            }
            assert!(all_equal(t.optimizer.exp_avg(), &exp_avg), "bf16 {bf16}");
            assert!(
                all_equal(t.optimizer.exp_avg_sq(), &exp_avg_sq),
                "bf16 {bf16}"
            );
            assert_eq!((t.steps, t.optimizer.steps_taken()), (steps, adam_steps));
            assert_eq!(t.skipped_steps(), 1);
            assert!(why.to_string().contains("not finite"), "{why}");

            let r = t.step(&repeated_examples()).unwrap();
            assert!(r.skipped.is_none() && r.loss.is_finite() && r.grad_norm > 0.0);
            assert_eq!(t.steps, steps + 1);
            assert!(
                !all_equal(&t.params, &params),
                "bf16 {bf16}: the good step trained"
            );
            for p in &t.params {
                let finite = p.isfinite().all().int64_value(&[]) == 1;
                assert!(finite, "bf16 {bf16}: a non-finite weight");
            }
        }
    }

    /// A finite loss whose gradients overflow (DAPO ratios near f32's largest value: the
    /// loss, a mean, stays finite; the gradients, sums over tokens, do not) is skipped
    /// like a non-finite loss: nothing moves, and the next step trains.
    #[test]
    fn a_step_whose_gradient_alone_is_not_finite_changes_nothing() {
        let mut t = tiny_trainer();
        t.step(&repeated_examples()).unwrap();
        let params = copies(&t.params);
        let exp_avg = copies(t.optimizer.exp_avg());
        let steps = t.steps;
        // Ratios of about e^(84 − 4) ≈ 5.5e34 per token.
        let r = t.dapo_step(&dapo_with_old_logprob(-84.0)).unwrap();
        assert!(r.loss.is_finite(), "the loss overflowed too: {}", r.loss);
        let why = r.skipped.expect("the step is skipped");
        assert!(!why.grad_norm.is_finite(), "{why}");
        assert!(all_equal(&t.params, &params), "the weights moved");
        assert!(all_equal(t.optimizer.exp_avg(), &exp_avg));
        assert_eq!(t.steps, steps);
        let r = t.step(&repeated_examples()).unwrap();
        assert!(r.skipped.is_none() && r.grad_norm.is_finite());
        assert_eq!(t.steps, steps + 1);
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
        assert_eq!(t.eval_loss(&a).unwrap(), t.eval_loss(&b).unwrap());
        let c = vec![(vec![1u32, 5, 9, 13], vec![false, true, false, true])];
        assert_ne!(t.eval_loss(&a).unwrap(), t.eval_loss(&c).unwrap());
    }

    /// With `shard = "full"` the parameters are released between steps: an evaluation
    /// forward is a clear error naming the setting, before and after a step, not a
    /// shape panic in the model.
    #[test]
    fn evaluations_under_a_full_shard_are_refused_naming_the_setting() {
        let config = LearnerConfig {
            shard: Shard::Full,
            checkpoint_activations: true,
            ..Default::default()
        };
        let policy = Policy::new(ModelConfig::tiny(64), Device::Cpu, 0);
        let mut t = Trainer::new(policy, config).unwrap();
        let examples = vec![(vec![1u32, 5, 9, 13], vec![false, false, true, true])];
        for stepped in [false, true] {
            let e = t.eval_loss(&examples).unwrap_err().to_string();
            assert!(e.contains("learner.shard") && e.contains("full"), "{e}");
            if !stepped {
                let r = t.step(&examples).unwrap();
                assert!(r.skipped.is_none() && r.label_tokens == 2);
            }
        }
    }
}
