//! What a training configuration needs per rank, before it runs (`tutor plan`): the
//! memory of the weights, gradients, fp32 masters, AdamW moments, activations (with and
//! without activation checkpointing) and logits of one pass, under each sharding mode;
//! the largest pass that fits in a GPU's memory; and the FLOPs of a pass.
//!
//! The arithmetic follows what the learner allocates (`trainer`, `loss::chunked`,
//! `Policy::set_checkpoint_activations`):
//! - Mixed precision (bf16 on a GPU): bf16 parameters (2 bytes each), their bf16 `.grad`
//!   (2), fp32 gradient sums (4), fp32 master weights (4) and two fp32 AdamW moments (8):
//!   20 bytes per parameter. fp32 training: parameters, gradients and moments, 16 bytes.
//! - Activations: what a decoder layer saves for its backward pass, per token, in the
//!   activation dtype: its input and the normed input, the MLP's input and normed input
//!   (4 × hidden), q through the q-norm, RoPE and the fused attention's saved output (4 ×
//!   heads·head_dim), k and v likewise (5 × kv_heads·head_dim), and the MLP's gate, up,
//!   activated gate and product (4 × intermediate). The fused causal kernel saves no
//!   `[T, T]` scores. With checkpointing: one hidden state per layer, plus one layer's
//!   activations while it is recomputed.
//! - Logits: a pass over the logits budget holds one chunk of `logits_budget_mb`; under
//!   it, or without a budget, the full `[positions, vocab]` float32 logits. The loss keeps
//!   about [`logit_copies`] float32 tensors of that size alive at its peak: 3 in fp32 (the
//!   logits, their log-softmax and the gradients through them), 5 under mixed precision
//!   (the head's bf16 output and its float32 cast, and the casts back in the backward
//!   pass, on top).
//! - A GPU's usable memory is [`USABLE_FRACTION`] of it (the CUDA context, the caching
//!   allocator's fragmentation, NCCL's buffers).
//!
//! Calibrated against measurement: the CPU learner's peak for tiny models (test
//! `tests/plan_memory.rs`) and an H100 (bench/README.md, `gpu_check`).

use serde::Serialize;
use tutor_policy::ModelConfig;

/// Float32 copies of a pass's logits the loss holds at its peak (measured: 3.0 on the
/// CPU in fp32, about 4.5 on an H100 in bf16).
pub fn logit_copies(mixed_precision: bool) -> f64 {
    if mixed_precision {
        5.0
    } else {
        3.0
    }
}
/// The share of a GPU's memory a plan counts on.
pub const USABLE_FRACTION: f64 = 0.9;

pub use crate::config::Shard;

/// What a plan is computed for.
#[derive(Debug, Clone)]
pub struct PlanInput {
    pub model: ModelConfig,
    /// Tokens of the longest sequence (`[coordinator] max_seq_len`).
    pub seq_len: usize,
    /// Token slots of one forward/backward pass, padding included (`[learner]
    /// micro_batch_tokens`, else the whole batch).
    pub pass_tokens: usize,
    /// Token slots of one optimizer step on one rank (the FLOPs of a step).
    pub step_tokens: usize,
    pub world_size: usize,
    /// bf16 parameters with fp32 masters (a GPU) or fp32 throughout.
    pub mixed_precision: bool,
    pub checkpoint_activations: bool,
    /// `[learner] logits_budget_mb` (0: no limit).
    pub logits_budget_mb: usize,
    /// The GPU's memory (bytes), when known.
    pub gpu_memory: Option<u64>,
    /// `[learner] shard`: the mode the run trains with (every mode is planned).
    pub shard: Shard,
    /// `[learner] bucket_mb`: what one exchange of `"optimizer"` and `"gradients"` moves.
    pub bucket_mb: f64,
    /// `[learner] prefetch`: `"full"` gathers the next layer while one computes.
    pub prefetch: bool,
}

/// Bytes per rank of one sharding mode.
#[derive(Debug, Clone, Serialize)]
pub struct Memory {
    pub shard: Shard,
    /// The parameters (bf16 under mixed precision). With `full` no rank holds them on
    /// the GPU (`gathered` counts what a pass holds at once); rank 0 keeps them in host
    /// memory (`host_weights`).
    pub weights: f64,
    /// The parameters' own `.grad` (bf16 under mixed precision).
    pub grads: f64,
    /// fp32 gradient sums across micro-batches (mixed precision only).
    pub grad_sums: f64,
    pub masters: f64,
    pub optimizer: f64,
    /// The buffers of the step's exchanges. `full`: what a pass holds gathered at once
    /// (the embedding/head unit's parameters and `.grad`, one layer's parameters and
    /// gradients, and the fp32 buffer its gradients are reduce-scattered from).
    /// `optimizer` and `gradients`: the fp32 buffer of one bucket (`bucket_mb`, or the
    /// largest parameter when it is larger), and with `optimizer` the step's reduced
    /// fp32 gradient slice.
    pub gathered: f64,
    /// The training state: everything above.
    pub state: f64,
    /// `full`: the weights rank 0 keeps in host memory (it publishes and checkpoints
    /// them); 0 otherwise. Not GPU memory: not in `total`.
    pub host_weights: f64,
    /// One pass's activations (checkpointed or not, as the input says).
    pub activations: f64,
    pub logits: f64,
    pub total: f64,
    /// `Some(fits)` when the GPU's memory is known.
    pub fits: Option<bool>,
    /// The most token slots one pass may have and still fit (`None`: memory unknown, or
    /// not even the training state fits).
    pub max_pass_tokens: Option<usize>,
}

/// A whole plan.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub parameters: u64,
    /// Parameters of the matrix products (projections and output head), the FLOPs' N.
    pub matmul_parameters: u64,
    pub seq_len: usize,
    pub pass_tokens: usize,
    pub step_tokens: usize,
    pub world_size: usize,
    pub mixed_precision: bool,
    pub checkpoint_activations: bool,
    pub logits_budget_mb: usize,
    pub gpu_memory: Option<u64>,
    /// The mode the run trains with (`configured`).
    pub shard: Shard,
    /// Activation bytes per token of a pass: without and with checkpointing.
    pub activation_bytes_per_token: f64,
    pub checkpointed_bytes_per_token: f64,
    pub memory: Vec<Memory>,
    /// What rank 0 of a group holds on its GPU while the group forms (`tutor learner`
    /// builds its trainer alone, then leads the group): sharded, the state stays in host
    /// memory until then (`Trainer::from_model_dir_for_group`), so its GPU gets one
    /// bucket at a time of the fp32 weights it sends the other ranks, then its slices and
    /// the model the mode keeps; unsharded, the whole state.
    pub group_start: f64,
    /// Model FLOPs of one pass and of one optimizer step on one rank (forward and
    /// backward; checkpointing adds one more forward, counted in `step_flops_executed`).
    pub pass_flops: f64,
    pub step_flops: f64,
    pub step_flops_executed: f64,
}

impl Plan {
    /// The memory of a sharding mode.
    pub fn mode(&self, shard: Shard) -> &Memory {
        self.memory
            .iter()
            .find(|m| m.shard == shard)
            .expect("every mode is planned")
    }

    /// The memory of the mode the run trains with (`[learner] shard`).
    pub fn configured(&self) -> &Memory {
        self.mode(self.shard)
    }
}

fn matmul_parameters(m: &ModelConfig) -> u64 {
    let h = m.hidden_size as u64;
    let q = (m.num_attention_heads * m.head_dim) as u64;
    let kv = (m.num_key_value_heads * m.head_dim) as u64;
    let layer = h * q * 2 + h * kv * 2 + 3 * h * m.intermediate_size as u64;
    m.num_hidden_layers as u64 * layer + m.vocab_size as u64 * h
}

/// Activation elements a decoder layer saves per token (see the module's notes).
fn layer_elements(m: &ModelConfig) -> f64 {
    let h = m.hidden_size as f64;
    let q = (m.num_attention_heads * m.head_dim) as f64;
    let kv = (m.num_key_value_heads * m.head_dim) as f64;
    4.0 * h + 4.0 * q + 5.0 * kv + 4.0 * m.intermediate_size as f64
}

/// Model FLOPs (forward and backward) of one sequence of `t` tokens: 6 per matmul
/// parameter per token, plus causal attention (QKᵀ and AV: half the square).
pub fn sequence_flops(m: &ModelConfig, t: f64) -> f64 {
    let n = matmul_parameters(m) as f64;
    let attn = (m.num_hidden_layers * m.num_attention_heads * m.head_dim) as f64;
    6.0 * n * t + 6.0 * attn * t * t / 2.0
}

/// FLOPs of `tokens` slots cut into sequences of `seq_len` (the last one shorter).
fn flops(m: &ModelConfig, tokens: usize, seq_len: usize) -> f64 {
    let seq = seq_len.max(1);
    let full = tokens / seq;
    let rest = tokens % seq;
    full as f64 * sequence_flops(m, seq as f64) + sequence_flops(m, rest as f64)
}

/// The plan of `input`.
pub fn plan(input: &PlanInput) -> Plan {
    let m = &input.model;
    let n = m.num_parameters() as f64;
    let k = input.world_size.max(1) as f64;
    let act_bytes = if input.mixed_precision { 2.0 } else { 4.0 };
    let h = m.hidden_size as f64;
    let layers = m.num_hidden_layers as f64;
    let layer = layer_elements(m);
    // The embedding's output and the final norm's input and output, outside the layers.
    let outside = 3.0 * h;
    let plain_per_token = (layers * layer + outside) * act_bytes;
    let checkpointed_per_token = (layers * h + layer + outside) * act_bytes;
    let per_token = if input.checkpoint_activations {
        checkpointed_per_token
    } else {
        plain_per_token
    };
    let logits = |tokens: f64| -> f64 {
        let full = tokens * m.vocab_size as f64 * 4.0;
        let held = if input.logits_budget_mb > 0 {
            full.min(input.logits_budget_mb as f64 * (1u64 << 20) as f64)
        } else {
            full
        };
        held * logit_copies(input.mixed_precision)
    };
    // Bytes per parameter of each piece of state.
    let (w, g, sums, masters, moments) = if input.mixed_precision {
        (2.0, 2.0, 4.0, 4.0, 8.0)
    } else {
        (4.0, 4.0, 0.0, 0.0, 8.0)
    };
    // The embedding/head unit: the embedding, the head unless tied, the final norm.
    let heads = if m.tie_word_embeddings { 1.0 } else { 2.0 };
    let outer_params = (heads * m.vocab_size as f64 * h + h).min(n);
    let layer_params = if m.num_hidden_layers > 0 {
        (n - outer_params) / layers
    } else {
        0.0
    };
    // One exchange bucket: consecutive whole parameters, a larger one (the embedding or
    // the head: vocabulary × hidden) alone.
    let largest_param = (m.vocab_size as f64 * h)
        .max(m.intermediate_size as f64 * h)
        .max((m.num_attention_heads * m.head_dim) as f64 * h);
    let bucket = (input.bucket_mb * (1u64 << 20) as f64)
        .max(4.0 * largest_param)
        .min(4.0 * n);
    // What the group's start stages at once: the weights and moment slices go a bucket
    // per broadcast, a larger parameter in runs of it.
    let start_bucket = (input.bucket_mb * (1u64 << 20) as f64).min(4.0 * n);
    let usable = input.gpu_memory.map(|b| b as f64 * USABLE_FRACTION);
    let memory: Vec<Memory> = Shard::ALL
        .iter()
        .map(|&shard| {
            // Sharded, each rank keeps an fp32 slice of the weights AdamW updates (in f32
            // too) and, from "gradients" on, an fp32 slice of the gradient sums.
            let (slice_masters, slice_sums) = (4.0 * n / k, 4.0 * n / k);
            let (weights, grads, grad_sums, mast, opt, gathered) = match shard {
                Shard::None => (w * n, g * n, sums * n, masters * n, moments * n, 0.0),
                Shard::Optimizer => (
                    w * n,
                    g * n,
                    sums * n,
                    slice_masters,
                    moments * n / k,
                    bucket + 4.0 * n / k,
                ),
                Shard::Gradients => (
                    w * n,
                    g * n,
                    slice_sums,
                    slice_masters,
                    moments * n / k,
                    bucket,
                ),
                Shard::Full => (
                    0.0,
                    0.0,
                    slice_sums,
                    slice_masters,
                    moments * n / k,
                    // The embedding/head unit (parameters and `.grad`) for the whole
                    // pass, one layer's parameters and gradients (and with `prefetch`
                    // the next layer's parameters and a second fp32 buffer: a layer's
                    // reduce-scatter still running while the next one's starts), and
                    // the fp32 buffer a unit's gradients are reduce-scattered from.
                    (w + g) * (outer_params + layer_params)
                        + if input.prefetch {
                            (w + 4.0) * layer_params
                        } else {
                            0.0
                        }
                        + 4.0 * outer_params.max(layer_params),
                ),
            };
            let state = weights + grads + grad_sums + mast + opt + gathered;
            let host_weights = if shard == Shard::Full { w * n } else { 0.0 };
            let tokens = input.pass_tokens as f64;
            let activations = per_token * tokens;
            let logit_bytes = logits(tokens);
            let total = state + activations + logit_bytes;
            let fits = usable.map(|u| total <= u);
            let max_pass_tokens = usable.and_then(|u| {
                let room = u - state;
                if room <= 0.0 {
                    return None;
                }
                // Largest t with per_token·t + logits(t) ≤ room (logits is monotone).
                let (mut lo, mut hi) = (0u64, 1u64 << 40);
                while lo < hi {
                    let mid = (lo + hi).div_ceil(2);
                    let t = mid as f64;
                    if per_token * t + logits(t) <= room {
                        lo = mid;
                    } else {
                        hi = mid - 1;
                    }
                }
                Some(lo as usize)
            });
            Memory {
                shard,
                weights,
                grads,
                grad_sums,
                masters: mast,
                optimizer: opt,
                gathered,
                state,
                host_weights,
                activations,
                logits: logit_bytes,
                total,
                fits,
                max_pass_tokens,
            }
        })
        .collect();
    let pass_flops = flops(m, input.pass_tokens, input.seq_len);
    let step_flops = flops(m, input.step_tokens, input.seq_len);
    let recompute = if input.checkpoint_activations {
        // One more forward of the layers: a third of their forward-and-backward.
        step_flops / 3.0
    } else {
        0.0
    };
    let mut plan = Plan {
        group_start: 0.0,
        parameters: m.num_parameters() as u64,
        matmul_parameters: matmul_parameters(m),
        seq_len: input.seq_len,
        pass_tokens: input.pass_tokens,
        step_tokens: input.step_tokens,
        world_size: input.world_size,
        mixed_precision: input.mixed_precision,
        checkpoint_activations: input.checkpoint_activations,
        logits_budget_mb: input.logits_budget_mb,
        gpu_memory: input.gpu_memory,
        shard: input.shard,
        activation_bytes_per_token: plain_per_token,
        checkpointed_bytes_per_token: checkpointed_per_token,
        memory,
        pass_flops,
        step_flops,
        step_flops_executed: step_flops + recompute,
    };
    // No `.grad` yet; the fp32 weights go out to the other ranks one bucket at a time
    // (staged on the device from host memory).
    let m = plan.configured();
    plan.group_start = m.state - m.grads - m.gathered + start_bucket;
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-0.6B's shape, as gpu_check trains it.
    fn qwen3_06b() -> ModelConfig {
        let mut m = ModelConfig::tiny(151_936);
        m.hidden_size = 1024;
        m.intermediate_size = 3072;
        m.num_hidden_layers = 28;
        m.num_attention_heads = 16;
        m.num_key_value_heads = 8;
        m.head_dim = 128;
        m.max_position_embeddings = 40_960;
        m.tie_word_embeddings = true;
        m
    }

    fn input(m: ModelConfig, tokens: usize, checkpoint: bool, budget: usize) -> PlanInput {
        PlanInput {
            model: m,
            seq_len: tokens / 2,
            pass_tokens: tokens,
            step_tokens: tokens,
            world_size: 1,
            mixed_precision: true,
            checkpoint_activations: checkpoint,
            logits_budget_mb: budget,
            gpu_memory: Some(80 * (1 << 30)),
            shard: Shard::None,
            bucket_mb: 64.0,
            prefetch: true,
        }
    }

    const GIB: f64 = (1u64 << 30) as f64;

    /// The plan's totals against what an H100 measured for Qwen3-0.6B's shape
    /// (bench/README.md, gpu_check `train`: the GPU memory in use after each run, which
    /// also holds the CUDA context and the caching allocator's slack): within 25%. The
    /// logit copies were read off the first five; the 32k-token rows were measured
    /// afterwards, as a check.
    #[test]
    fn the_plan_is_close_to_what_an_h100_measured() {
        let m = qwen3_06b();
        let p = plan(&input(m.clone(), 7992, false, 1024));
        assert_eq!(p.parameters, 596_049_920);
        for (tokens, checkpoint, budget, measured_gib) in [
            (7992, false, 1024, 31.49),
            (7992, false, 0, 51.85),
            (15992, true, 1024, 17.36),
            (15992, false, 1024, 46.59),
            (15992, false, 0, 77.80),
            (31987, true, 1024, 18.86),
            (31987, false, 1024, 76.76),
        ] {
            let p = plan(&input(m.clone(), tokens, checkpoint, budget));
            let planned = p.mode(Shard::None).total / GIB;
            let ratio = planned / measured_gib;
            assert!(
                (0.8..=1.25).contains(&ratio),
                "{tokens} tokens, checkpoint {checkpoint}, budget {budget}: planned {planned:.2} GiB, measured {measured_gib} GiB"
            );
        }
    }

    /// Sharding divides the state as ZeRO does, and a full shard of K ranks holds about
    /// 1/K of it; FLOPs are 6·N·T plus attention; the largest pass that fits fits.
    #[test]
    fn sharding_flops_and_the_largest_pass() {
        let m = qwen3_06b();
        let mut i = input(m.clone(), 8192, true, 1024);
        i.world_size = 8;
        let p = plan(&i);
        let n = p.parameters as f64;
        let none = p.mode(Shard::None);
        assert!((none.state - 20.0 * n).abs() < 1.0);
        // The exchange bucket: the tied embedding (151,936 × 1,024 f32) is larger than
        // the 64 MiB bucket, so it sets the buffer.
        let bucket = 4.0 * 151_936.0 * 1024.0;
        let opt = p.mode(Shard::Optimizer);
        assert!((opt.gathered - (bucket + 4.0 * n / 8.0)).abs() < 1.0);
        assert!((opt.state - (8.0 * n + 12.0 * n / 8.0 + opt.gathered)).abs() < 1.0);
        let grads = p.mode(Shard::Gradients);
        assert_eq!(grads.gathered, bucket);
        assert!((grads.state - (4.0 * n + 16.0 * n / 8.0 + bucket)).abs() < 1.0);
        // A bucket larger than the model is the model.
        let mut whole = i.clone();
        whole.bucket_mb = 1e6;
        assert!((plan(&whole).mode(Shard::Gradients).gathered - 4.0 * n).abs() < 1.0);
        // "full": the slices (16 bytes per parameter over 8 ranks) and the units a pass
        // gathers; rank 0 keeps the bf16 parameters in host memory.
        let full = p.mode(Shard::Full);
        assert!(full.state > 16.0 * n / 8.0 && full.state < grads.state);
        assert_eq!(full.weights, 0.0);
        assert!((full.host_weights - 2.0 * n).abs() < 1.0);
        // Prefetching adds one layer's bf16 parameters and an fp32 buffer of its size.
        let mut no_prefetch = i.clone();
        no_prefetch.prefetch = false;
        let layer = (n - 151_936.0 * 1024.0 - 1024.0) / 28.0;
        let saved = full.gathered - plan(&no_prefetch).mode(Shard::Full).gathered;
        assert!((saved - 6.0 * layer).abs() < 1.0, "{saved} {layer}");
        // Two sequences of 4,096 tokens: 6·N·T, plus causal attention 6·L·(heads·head_dim)·t²/2
        // for each.
        let six_nt = 6.0 * p.matmul_parameters as f64 * 8192.0;
        let attention = 2.0 * 6.0 * 28.0 * 2048.0 * 4096.0 * 4096.0 / 2.0;
        assert!((p.pass_flops / (six_nt + attention) - 1.0).abs() < 1e-9);
        assert!((p.step_flops_executed / p.step_flops - 4.0 / 3.0).abs() < 1e-9);
        let max = none.max_pass_tokens.unwrap();
        let mut at_max = i.clone();
        at_max.pass_tokens = max;
        assert_eq!(plan(&at_max).mode(Shard::None).fits, Some(true));
        at_max.pass_tokens = max + 64;
        assert_eq!(plan(&at_max).mode(Shard::None).fits, Some(false));
        // fp32 training holds 16 bytes per parameter; sharded, it adds an fp32 slice of
        // the weights (and of the gradient sums with "gradients").
        i.mixed_precision = false;
        let f32_plan = plan(&i);
        assert!((f32_plan.mode(Shard::None).state - 16.0 * n).abs() < 1.0);
        let opt = f32_plan.mode(Shard::Optimizer);
        assert!((opt.state - (8.0 * n + 12.0 * n / 8.0 + bucket + 4.0 * n / 8.0)).abs() < 1.0);
        let grads = f32_plan.mode(Shard::Gradients);
        assert!((grads.state - (8.0 * n + 16.0 * n / 8.0 + bucket)).abs() < 1.0);
    }
}
