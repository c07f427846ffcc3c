//! The learner's typed configuration (section `[learner]` of a run config).

use serde::{Deserialize, Serialize};

use crate::schedule::{LrSchedule, ScheduleKind};

/// Optimizer and schedule settings. Defaults suit the single-machine CPU run.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LearnerConfig {
    /// Peak learning rate (AdamW).
    pub learning_rate: f64,
    /// Linear warmup steps from 0 to the peak learning rate.
    pub warmup_steps: u32,
    /// After the warmup: `"constant"` (the default) or `"cosine"` decay to
    /// `min_lr_ratio × learning_rate` at `total_steps`.
    pub schedule: ScheduleKind,
    /// Optimizer steps of the whole run (the cosine's length); unused by `"constant"`.
    /// In a run config, 0 with `"cosine"` means `[coordinator] iterations ×
    /// max_steps_per_iteration` (filled in by `tutor` when it loads the file).
    pub total_steps: u64,
    /// Floor of the cosine as a fraction of the peak (0 decays to 0).
    pub min_lr_ratio: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Gradient clipping by global norm; 0 disables it.
    pub grad_clip: f64,
    /// Seed for the initial weights of version 0.
    pub seed: u64,
    /// Gradient accumulation: a step's examples are run in micro-batches of at most this
    /// many padded tokens (examples × longest example) each, gradients summed, one
    /// optimizer step. An example longer than the budget runs alone. 0: one pass.
    pub micro_batch_tokens: usize,
    /// `tutor learner` writes its checkpoint (`out_dir/checkpoint`) after this many
    /// applied batches, and always after publishing a version; a `kill -9` loses at most
    /// the batches since (the coordinator sends them again). 1: after every batch;
    /// 0: only at publishes.
    pub checkpoint_every_steps: u64,
    /// DAPO's clip range of the importance ratio: [1 − clip_eps_low, 1 + clip_eps_high]
    /// (clip-higher: ε_high > ε_low keeps low-probability tokens explorable).
    pub clip_eps_low: f64,
    pub clip_eps_high: f64,
    /// Cross-entropy steps: `"none"` runs every example as its own padded sequence;
    /// `"tree"` packs them into rows where shared prefixes are computed once (a DAgger
    /// trajectory's labels branch off it) and several examples share a row (attention
    /// kept inside each, positions restarting). Same loss and gradients, fewer tokens.
    /// `"trunk"` runs each trajectory's tokens once as a plain causal sequence (the
    /// fused kernel) with the labels that branch off it attending to it: the tokens of
    /// "tree" at about the attention cost of plain rows; with the coordinator's
    /// `batch_by_episode`, a DAgger step costs about its longest example, not the sum.
    pub packing: Packing,
    /// Weight of an auxiliary next-token loss on the context tokens (the prompt and the
    /// observations, which are otherwise attended to but not trained on), added to the
    /// label loss as `w × mean context NLL`. 0 (the default) trains on labels only, as
    /// DAgger, BC and RFT are defined. A student trained from scratch learns to copy (a
    /// file path from the issue into its command) several times sooner with it, since
    /// the context repeats names it can learn to copy (docs/toy-world.md). The reported
    /// training loss then includes the term. With `packing = "none"` or `"trunk"`.
    pub context_loss_weight: f64,
    /// `"tree"`: the most slots in one packed row (a prefix tree larger than this gets a
    /// row of its own). Attention in a row is dense [L, L].
    pub pack_row_tokens: usize,
    /// The most full-vocabulary float32 logits (MiB) one forward pass may hold: a pass
    /// whose positions (padding included) × vocabulary × 4 bytes would exceed it computes
    /// its loss at the positions it trains on only, the output head run on as many of
    /// them at a time as fit (same loss and gradients; `loss::chunked`). At 32k tokens
    /// and a 152k vocabulary one sequence's logits are 19 GiB. 0: no limit (always the
    /// full logits, the layout before this setting).
    pub logits_budget_mb: usize,
    /// Activation checkpointing: a training pass keeps only each decoder layer's input
    /// and recomputes the layer's activations in the backward pass (same gradients, up to
    /// rounding; `Policy::set_checkpoint_activations`). Activation memory falls from every
    /// layer's intermediate tensors to one hidden state per layer, for about a third more
    /// compute. For long contexts and large models; off by default.
    pub checkpoint_activations: bool,
    /// How the training state is split across the data-parallel ranks (ZeRO):
    /// `"none"` (every rank holds everything), `"optimizer"` (each rank keeps the fp32
    /// master weights and AdamW moments of its slice only: gradients are reduce-scattered,
    /// each rank updates its slice, the parameters are all-gathered) or `"gradients"`
    /// (also the step's fp32 gradient sums: reduce-scattered after every micro-batch).
    /// The results equal `"none"` up to rounding; checkpoints keep the same layout (rank 0
    /// gathers the state), so a run resumes under any setting and world size. A group
    /// that loses a rank loses that rank's slice: rank 0 then stops, and restarted it
    /// resumes from its last checkpoint. `"full"` (ZeRO-3) shards the parameters too:
    /// each pass gathers one layer at a time (it needs `checkpoint_activations = true`),
    /// and after a step only rank 0 keeps the gathered weights, in host memory (it
    /// publishes them).
    pub shard: Shard,
    /// The most MiB of parameters (as f32) one collective call moves. With `shard =
    /// "optimizer"` or `"gradients"` a step's gradients are reduce-scattered, and the
    /// updated parameters all-gathered, bucket by bucket (consecutive whole parameters;
    /// one larger than a bucket, such as a large vocabulary's embedding, is a bucket
    /// alone), so a rank holds one bucket's fp32 buffer at a time instead of a flat copy
    /// of the whole model (4 bytes per parameter); `"full"` exchanges one layer at a time
    /// whatever this says. In every mode, rank 0 sends the weights to the ranks joining
    /// its group in buckets of this size. Ranks joining with `tutor learner` take rank
    /// 0's value; every rank must use the same one.
    pub bucket_mb: f64,
    /// With `shard = "full"` over the CPU collective on the CPU: gather the next layer's parameters
    /// while the current one computes, and let a layer's gradient reduce-scatter run
    /// while the next computes (the collective calls run on a thread of their own), for
    /// one more layer's parameters and one more fp32 gradient buffer of a layer in
    /// memory. Same results either way. On by default. On a GPU it has no effect yet:
    /// NCCL's calls run on the compute stream and wait for the device, so there would be
    /// nothing to overlap. Every rank must use the same value (ranks joining with `tutor
    /// learner` take rank 0's).
    pub prefetch: bool,
    /// Memory of each rank's GPU in GiB (80 for an H100, 141 for an H200): `tutor plan`
    /// says whether the run fits, and a learner on a GPU refuses to start a run whose plan
    /// does not fit (`learner::plan`). 0: unknown (no check).
    pub gpu_memory_gib: f64,
    /// Data-parallel learner ranks (`tutor learner --world-size` overrides it; each
    /// process's rank comes from `--rank`). 1: one learner, no rendezvous.
    pub world_size: usize,
    /// How the ranks exchange gradients and batches: `"cpu"` (TCP through rank 0) or
    /// `"nccl"` (one GPU per rank; needs a build with the `nccl` feature).
    pub collective: CollectiveChoice,
    /// How long a rank waits for the group to form: rank 0 for the coordinator to take
    /// its rendezvous and for every other rank to join; the others for rank 0's
    /// rendezvous (also after losing rank 0, for the next one).
    pub rendezvous_timeout_s: f64,
    /// The longest one collective operation may wait for another rank (a step of the
    /// slowest rank, or rank 0's next batch; rank 0 sends a keepalive every
    /// `collective_timeout_s / 4`, at most every 10 s, while the coordinator sends none).
    pub collective_timeout_s: f64,
    /// Where the student trains: `"cpu"`, `"cuda"` (GPU 0, or in an NCCL group the
    /// rank's `--gpu`) or `"cuda:N"`.
    pub device: String,
    /// Number format of the weights during training: `"auto"` (bf16 on a GPU, f32 on the
    /// CPU), `"f32"`, or `"bf16"`: bf16 parameters and activations, with fp32 master
    /// weights, fp32 gradient sums across micro-batches and ranks, and fp32 AdamW state.
    pub precision: Precision,
    /// Rollout workers that receive every published version over a collective
    /// (`[worker] weights_from = "broadcast"`, each with its own `--weights-rank` 1..N)
    /// besides the gRPC Weights service; needs `tutor learner --coordinator` (the
    /// rendezvous). 0: gRPC only.
    pub weight_receivers: usize,
    /// The collective of that broadcast: `"cpu"` (TCP) or `"nccl"` (GPU workers sharing
    /// a communicator with rank 0).
    pub broadcast_collective: CollectiveChoice,
    /// External student engines (base urls) this learner (rank 0) loads every published
    /// version into, as `[worker.student]` says how (api, reload, api key,
    /// reload_timeout_s, weights_dir): straight from the learner, once per engine. Workers
    /// then only wait for their engine to serve the leased version (`[worker.student]
    /// loaded_by = "learner"`). Empty: with `loaded_by = "learner"`, `[worker.student]
    /// base_url`; else none (the workers load the versions).
    pub engines: Vec<String>,
    /// `[worker.student] reload = "distributed"`: where the learner listens for an engine
    /// to join each weight-update group, ip:port (port 0: any free port).
    pub engine_group_listen: String,
    /// The host engines dial to reach `engine_group_listen` (the learner's address as they
    /// see it). Default: `engine_group_listen`'s ip, which must then not be 0.0.0.0.
    pub engine_group_address: Option<String>,
}

/// How the training state is split across the data-parallel ranks (see
/// `LearnerConfig::shard`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Shard {
    /// Every rank holds everything.
    #[default]
    None,
    /// ZeRO-1: each rank holds the masters and moments of its slice.
    Optimizer,
    /// ZeRO-2: the fp32 gradient sums are sharded too.
    Gradients,
    /// ZeRO-3 / FSDP: parameters too, one layer gathered at a time (with activation
    /// checkpointing).
    Full,
}

impl Shard {
    pub const ALL: [Shard; 4] = [Shard::None, Shard::Optimizer, Shard::Gradients, Shard::Full];

    pub fn name(self) -> &'static str {
        match self {
            Shard::None => "none",
            Shard::Optimizer => "optimizer",
            Shard::Gradients => "gradients",
            Shard::Full => "full",
        }
    }
}

/// See `LearnerConfig::precision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    #[default]
    Auto,
    F32,
    Bf16,
}

pub use tutor_collective::CollectiveChoice;

/// How a cross-entropy step lays its examples out (see `LearnerConfig::packing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Packing {
    #[default]
    None,
    Tree,
    Trunk,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        Self {
            learning_rate: 1e-3,
            warmup_steps: 5,
            schedule: ScheduleKind::Constant,
            total_steps: 0,
            min_lr_ratio: 0.0,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            seed: 0,
            micro_batch_tokens: 0,
            checkpoint_every_steps: 1,
            clip_eps_low: 0.2,
            clip_eps_high: 0.28,
            packing: Packing::None,
            context_loss_weight: 0.0,
            pack_row_tokens: 4096,
            logits_budget_mb: 1024,
            bucket_mb: 64.0,
            prefetch: true,
            checkpoint_activations: false,
            shard: Shard::None,
            gpu_memory_gib: 0.0,
            world_size: 1,
            collective: CollectiveChoice::Cpu,
            rendezvous_timeout_s: 300.0,
            collective_timeout_s: 600.0,
            device: "cpu".into(),
            precision: Precision::Auto,
            weight_receivers: 0,
            broadcast_collective: CollectiveChoice::Cpu,
            engines: Vec::new(),
            engine_group_listen: "127.0.0.1:0".into(),
            engine_group_address: None,
        }
    }
}

impl LearnerConfig {
    /// The schedule these settings describe.
    pub fn lr_schedule(&self) -> LrSchedule {
        LrSchedule {
            peak: self.learning_rate,
            warmup_steps: self.warmup_steps as u64,
            kind: self.schedule,
            min_lr_ratio: self.min_lr_ratio,
        }
    }

    /// The learning rate at optimizer step `step` (0-based): linear warmup, then constant
    /// or cosine over `total_steps` (see `LrSchedule::lr_at`).
    pub fn lr_at(&self, step: u64) -> f64 {
        self.lr_schedule().lr_at(step, self.total_steps)
    }

    /// The device `device` names. `"cuda"` without an index is `default_gpu` (the rank's
    /// GPU in an NCCL group, else 0). Whether that GPU exists is checked by the trainer.
    pub fn device(&self, default_gpu: usize) -> Result<tch::Device, ConfigError> {
        tutor_policy::parse_device(&self.device, default_gpu).ok_or_else(|| ConfigError::Device {
            got: self.device.clone(),
        })
    }

    /// Whether training on `device` keeps bf16 parameters with fp32 master weights
    /// (see `precision`).
    pub fn mixed_precision(&self, device: tch::Device) -> bool {
        match self.precision {
            Precision::Auto => device.is_cuda(),
            Precision::F32 => false,
            Precision::Bf16 => true,
        }
    }

    /// `bucket_mb` as f32 elements (at least one): the most one exchange of a sharded
    /// step moves in one collective call (`shard = "optimizer"` and `"gradients"`).
    pub fn bucket_elements(&self) -> i64 {
        // Rounded, not truncated: a joining rank reads rank 0's bucket_mb back from JSON,
        // which may parse a last bit low, and both must cut the same buckets.
        ((self.bucket_mb * (1u64 << 20) as f64 / 4.0).round() as i64).max(1)
    }

    /// Checks `[learner]`: the device, the schedule (a cosine needs `total_steps >
    /// warmup_steps`, `min_lr_ratio` in [0, 1]), DAPO's clip range, the group settings.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.device(0)?;
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return Err(ConfigError::MinLrRatio {
                got: self.min_lr_ratio,
            });
        }
        if !(0.0..1.0).contains(&self.clip_eps_low)
            || self.clip_eps_high.is_nan()
            || self.clip_eps_high < 0.0
        {
            return Err(ConfigError::ClipEps {
                low: self.clip_eps_low,
                high: self.clip_eps_high,
            });
        }
        if self.world_size == 0 {
            return Err(ConfigError::WorldSize);
        }
        let w = self.context_loss_weight;
        if !(0.0..=10.0).contains(&w) || (w > 0.0 && self.packing == Packing::Tree) {
            return Err(ConfigError::ContextLoss { got: w });
        }
        if !(self.rendezvous_timeout_s > 0.0 && self.collective_timeout_s > 0.0) {
            return Err(ConfigError::Timeouts {
                rendezvous: self.rendezvous_timeout_s,
                collective: self.collective_timeout_s,
            });
        }
        if self.schedule == ScheduleKind::Cosine && self.total_steps <= self.warmup_steps as u64 {
            return Err(ConfigError::Cosine {
                total: self.total_steps,
                warmup: self.warmup_steps,
            });
        }
        if self.shard == Shard::Full && !self.checkpoint_activations {
            return Err(ConfigError::FullShard);
        }
        if !(self.bucket_mb.is_finite() && self.bucket_mb > 0.0) {
            return Err(ConfigError::BucketMb {
                got: self.bucket_mb,
            });
        }
        if !(self.gpu_memory_gib.is_finite() && self.gpu_memory_gib >= 0.0) {
            return Err(ConfigError::GpuMemory {
                got: self.gpu_memory_gib,
            });
        }
        Ok(())
    }
}

/// A `[learner]` setting the learner cannot run with; the message names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("learner.device must be \"cpu\", \"cuda\" or \"cuda:N\", got {got:?}")]
    Device { got: String },
    #[error("learner.min_lr_ratio must be in [0, 1], got {got}")]
    MinLrRatio { got: f64 },
    #[error(
        "learner.clip_eps_low must be in [0, 1) and learner.clip_eps_high at least 0, got \
         {low} and {high}"
    )]
    ClipEps { low: f64, high: f64 },
    #[error("learner.world_size must be at least 1")]
    WorldSize,
    #[error(
        "learner.context_loss_weight must be in [0, 10] and, when above 0, used with \
         learner.packing = \"none\" or \"trunk\"; got {got}"
    )]
    ContextLoss { got: f64 },
    #[error(
        "learner.rendezvous_timeout_s and learner.collective_timeout_s must be above 0, got \
         {rendezvous} and {collective}"
    )]
    Timeouts { rendezvous: f64, collective: f64 },
    #[error("learner.schedule = \"cosine\" needs total_steps ({total}) > warmup_steps ({warmup})")]
    Cosine { total: u64, warmup: u32 },
    #[error(
        "learner.shard = \"full\" needs learner.checkpoint_activations = true: each layer's \
         parameters are gathered only while it runs, and again when its backward recomputes \
         it"
    )]
    FullShard,
    #[error("learner.bucket_mb must be a number of MiB above 0, got {got}")]
    BucketMb { got: f64 },
    #[error("learner.gpu_memory_gib must be a number of GiB, 0 or more (0: unknown), got {got}")]
    GpuMemory { got: f64 },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_keep_warmup_then_constant() {
        // A config that names none of the schedule fields behaves as before they existed.
        let c: LearnerConfig =
            serde_json::from_str(r#"{"learning_rate": 0.01, "warmup_steps": 2}"#).unwrap();
        assert_eq!(c.schedule, ScheduleKind::Constant);
        assert_eq!(c.lr_at(0), 0.005);
        assert_eq!(c.lr_at(1), 0.01);
        assert_eq!(c.lr_at(2), 0.01);
        assert_eq!(c.lr_at(1_000_000), 0.01);
        assert!(c.validate().is_ok());
    }

    #[test]
    fn cosine_is_parsed_and_validated() {
        let c: LearnerConfig = serde_json::from_str(
            r#"{"learning_rate": 1.0, "warmup_steps": 0, "schedule": "cosine",
                "total_steps": 4, "min_lr_ratio": 0.0}"#,
        )
        .unwrap();
        // p = step/4: 1, (1 + cos π/4)/2, 1/2, (1 − cos π/4)/2, 0.
        assert_eq!(c.lr_at(0), 1.0);
        assert!((c.lr_at(2) - 0.5).abs() < 1e-12);
        assert!(c.lr_at(4).abs() < 1e-12);
        assert!(c.validate().is_ok());
        let short = LearnerConfig {
            total_steps: 0,
            ..c.clone()
        };
        assert!(short
            .validate()
            .unwrap_err()
            .to_string()
            .contains("total_steps"));
        let bad_floor = LearnerConfig {
            min_lr_ratio: 1.5,
            ..c
        };
        assert!(bad_floor.validate().is_err());
        assert!(serde_json::from_str::<LearnerConfig>(r#"{"schedule": "linear"}"#).is_err());
    }

    #[test]
    fn context_loss_weight_is_validated() {
        let mut c = LearnerConfig::default();
        assert_eq!(c.context_loss_weight, 0.0, "labels only by default");
        c.context_loss_weight = 1.0;
        assert!(c.validate().is_ok());
        for bad in [-0.1, 11.0, f64::NAN] {
            c.context_loss_weight = bad;
            assert!(c.validate().is_err(), "{bad}");
        }
        c.context_loss_weight = 1.0;
        c.packing = Packing::Tree;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("learner.packing"), "{err}");
    }

    #[test]
    fn device_and_precision_are_parsed_and_validated() {
        let c = LearnerConfig::default();
        assert_eq!(c.device(3), Ok(tch::Device::Cpu));
        assert!(!c.mixed_precision(tch::Device::Cpu), "auto: f32 on the CPU");
        assert!(
            c.mixed_precision(tch::Device::Cuda(0)),
            "auto: bf16 on a GPU"
        );
        let gpu: LearnerConfig =
            serde_json::from_str(r#"{"device": "cuda", "precision": "f32"}"#).unwrap();
        assert_eq!(gpu.device(3), Ok(tch::Device::Cuda(3)));
        assert!(!gpu.mixed_precision(tch::Device::Cuda(3)));
        let one: LearnerConfig = serde_json::from_str(r#"{"device": "cuda:1"}"#).unwrap();
        assert_eq!(one.device(3), Ok(tch::Device::Cuda(1)));
        let bf16: LearnerConfig = serde_json::from_str(r#"{"precision": "bf16"}"#).unwrap();
        assert!(bf16.mixed_precision(tch::Device::Cpu));
        let bad: LearnerConfig = serde_json::from_str(r#"{"device": "gpu0"}"#).unwrap();
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("learner.device") && e.contains("gpu0"), "{e}");
        assert!(serde_json::from_str::<LearnerConfig>(r#"{"precision": "fp16"}"#).is_err());
    }

    /// `shard` reads its four names and each validates, `"full"` only with activation
    /// checkpointing (the message names both fields).
    #[test]
    fn shard_modes_are_parsed_and_full_needs_checkpointing() {
        assert_eq!(LearnerConfig::default().shard, Shard::None);
        for mode in Shard::ALL {
            let c: LearnerConfig =
                serde_json::from_str(&format!(r#"{{"shard": "{}"}}"#, mode.name())).unwrap();
            assert_eq!(c.shard, mode);
            match c.validate() {
                Ok(()) => assert_ne!(mode, Shard::Full),
                Err(e) => {
                    assert_eq!(mode, Shard::Full);
                    let e = e.to_string();
                    assert!(
                        e.contains("learner.shard") && e.contains("checkpoint_activations"),
                        "{e}"
                    );
                }
            }
        }
        let c: LearnerConfig =
            serde_json::from_str(r#"{"shard": "full", "checkpoint_activations": true}"#).unwrap();
        c.validate().unwrap();
        assert!(serde_json::from_str::<LearnerConfig>(r#"{"shard": "zero2"}"#).is_err());
    }

    #[test]
    fn bucket_mb_is_validated_and_counted_in_f32_elements() {
        let c = LearnerConfig::default();
        assert_eq!(c.bucket_elements(), 16 << 20, "64 MiB of f32");
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let c = LearnerConfig {
                bucket_mb: bad,
                ..LearnerConfig::default()
            };
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("learner.bucket_mb"), "{e}");
        }
        let tiny = LearnerConfig {
            bucket_mb: 1e-9,
            ..LearnerConfig::default()
        };
        assert_eq!(tiny.bucket_elements(), 1, "at least one element");
    }
}
