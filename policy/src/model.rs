//! The decoder-only transformer, and [`Policy`], which owns its parameters.
//!
//! Architecture (matching Hugging Face `Qwen3ForCausalLM`, `Qwen2ForCausalLM` and
//! `LlamaForCausalLM` so checkpoints are interchangeable):
//! embed -> N x [RMSNorm -> GQA attention (Qwen3: q/k per-head RMSNorm; then RoPE) ->
//! residual; RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> lm_head. Biases only where
//! the family and config put them (see `config.rs`): Qwen2 on q/k/v, Llama/Qwen3 with
//! `attention_bias` on q/k/v/o, Llama with `mlp_bias` on the MLP.
//!
//! Parameters live in a `tch::nn::VarStore` under their Hugging Face names
//! (`model.layers.0.self_attn.q_proj.weight`, ...), so saving the var store *is* writing a
//! Hugging Face checkpoint. The layer structs hold shallow clones of the variables: they
//! share storage with the var store, so loading weights or casting the store (e.g.
//! `var_store_mut().bfloat16()`, which uses `set_data`) is seen by the model.
//!
//! One code path serves training (`forward`, full sequences; `forward_tree`, packed rows
//! with explicit positions and attention structure) and generation (prefill and one-token
//! decode steps with a KV cache); they differ only in positions, mask and cache.
//!
//! Long on purpose (~900 lines of code, 400 of tests): the layers, the decoder and `Policy`
//! share private fields and one forward path for training and generation, which reads best
//! in one place.

use std::sync::Mutex;

use tch::nn::{Init, Path, VarStore};
use tch::{Device, Kind, Tensor};

use crate::packed::{self, PackedMatrix};
use crate::{ModelConfig, RopeScaling};

/// Which keys each query may attend to.
pub(crate) enum AttnMask {
    /// Plain causal attention over the whole (uncached) sequence: lets SDPA pick its
    /// fused causal kernels.
    Causal,
    /// Boolean `[B, 1, S, L]`, true = may attend (L = cached + new keys).
    Explicit(Tensor),
    /// A trunk and what branches off it, over the pass's own keys (no cache): slots
    /// `0 .. trunk` are one causal sequence (the fused causal kernel over the trunk's
    /// keys); slots `trunk ..` attend under the boolean `[B, 1, S - trunk, S]` rows.
    Trunk { trunk: i64, branches: Tensor },
}

/// Per-layer key/value cache, preallocated for the whole generation so that a decode
/// step writes one slot instead of re-concatenating the cache.
pub(crate) struct KvCache {
    /// (k, v) per layer, each `[B, kv_heads, capacity, head_dim]`.
    pub(crate) layers: Vec<(Tensor, Tensor)>,
    /// Number of filled slots.
    pub(crate) len: i64,
}

impl KvCache {
    pub(crate) fn new(
        config: &ModelConfig,
        batch: i64,
        capacity: i64,
        kind: Kind,
        device: Device,
    ) -> Self {
        let shape = [
            batch,
            config.num_key_value_heads as i64,
            capacity,
            config.head_dim as i64,
        ];
        let layers = (0..config.num_hidden_layers)
            .map(|_| {
                (
                    Tensor::zeros(shape, (kind, device)),
                    Tensor::zeros(shape, (kind, device)),
                )
            })
            .collect();
        KvCache { layers, len: 0 }
    }

    /// Copies slots `from .. from + n` of every row of `src` to slots `to .. to + n` of the
    /// same rows here (this cache may have more rows and another capacity).
    pub(crate) fn copy_block(&mut self, src: &KvCache, from: i64, to: i64, n: i64) {
        if n == 0 {
            return;
        }
        let rows = src.layers.first().map_or(0, |(k, _)| k.size()[0]);
        for ((k, v), (src_k, src_v)) in self.layers.iter_mut().zip(&src.layers) {
            k.narrow(0, 0, rows)
                .narrow(2, to, n)
                .copy_(&src_k.narrow(2, from, n));
            v.narrow(0, 0, rows)
                .narrow(2, to, n)
                .copy_(&src_v.narrow(2, from, n));
        }
    }

    /// Keeps only the rows listed in `rows` (an int64 index tensor), in that order.
    pub(crate) fn select_rows(&mut self, rows: &Tensor) {
        for (k, v) in self.layers.iter_mut() {
            *k = k.index_select(0, rows);
            *v = v.index_select(0, rows);
        }
    }

    /// Row `row`'s slots `slot .. slot + n`, copied out: `[kv_heads, n, head_dim]` keys
    /// and values per layer (what the prefix cache keeps).
    pub(crate) fn read_row(&self, row: i64, slot: i64, n: i64) -> Vec<(Tensor, Tensor)> {
        self.layers
            .iter()
            .map(|(k, v)| {
                let take =
                    |t: &Tensor| t.narrow(0, row, 1).narrow(2, slot, n).squeeze_dim(0).copy();
                (take(k), take(v))
            })
            .collect()
    }

    /// Writes the first `n` slots of `kv` (as `read_row` gives them) to row `row`, slots
    /// `slot .. slot + n`.
    pub(crate) fn write_row(&mut self, row: i64, slot: i64, kv: &[(Tensor, Tensor)], n: i64) {
        for ((k, v), (src_k, src_v)) in self.layers.iter_mut().zip(kv) {
            k.narrow(0, row, 1)
                .narrow(2, slot, n)
                .copy_(&src_k.narrow(1, 0, n).unsqueeze(0));
            v.narrow(0, row, 1)
                .narrow(2, slot, n)
                .copy_(&src_v.narrow(1, 0, n).unsqueeze(0));
        }
    }

    /// Copies slots `offset .. offset + n` of row `from` to the same slots of row `to`.
    pub(crate) fn copy_row(&mut self, from: i64, to: i64, offset: i64, n: i64) {
        for (k, v) in self.layers.iter_mut() {
            let src_k = k.narrow(0, from, 1).narrow(2, offset, n);
            k.narrow(0, to, 1).narrow(2, offset, n).copy_(&src_k);
            let src_v = v.narrow(0, from, 1).narrow(2, offset, n);
            v.narrow(0, to, 1).narrow(2, offset, n).copy_(&src_v);
        }
    }
}

struct RmsNorm {
    weight: Tensor,
    /// The normalized (last) dimension, the weight's length.
    dim: i64,
    eps: f64,
}

impl RmsNorm {
    fn new(p: Path, dim: usize, eps: f64) -> Self {
        RmsNorm {
            weight: p.var("weight", &[dim as i64], Init::Const(1.0)),
            dim: dim as i64,
            eps,
        }
    }

    /// Normalizes over the last dimension in float32 (as Hugging Face does) for stability
    /// in half precision, then scales in the input's precision.
    fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        if kind == Kind::Float {
            // The same arithmetic as below in one op (fewer kernel launches per decode step).
            return x.rms_norm([self.dim], Some(&self.weight), self.eps);
        }
        let xf = x.to_kind(Kind::Float);
        let var = xf.square().mean_dim(-1, true, Kind::Float);
        let normed = (xf * (var + self.eps).rsqrt()).to_kind(kind);
        normed * &self.weight
    }
}

/// A linear layer's parameters: `weight` `[out, in]` and optionally `bias` `[out]`.
struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// Zero here; `Policy::new` fills every matrix deterministically from its seed (biases
    /// stay zero, as in Hugging Face's initialization).
    fn new(p: &Path, name: &str, out_dim: usize, in_dim: usize, bias: bool) -> Self {
        let p = p / name;
        Linear {
            weight: p.var("weight", &[out_dim as i64, in_dim as i64], Init::Const(0.0)),
            bias: bias.then(|| p.var("bias", &[out_dim as i64], Init::Const(0.0))),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.weight, self.bias.as_ref())
    }
}

/// Projections of one input packed as one matrix for generation on the CPU
/// ([`Policy::use_decode_layout`]): their weights stacked along the output dimension (q,
/// k and v; gate and up), so one product serves them all. A snapshot of the weights.
struct PackedGroup {
    matrix: PackedMatrix,
    /// The members' biases, stacked the same way.
    bias: Option<Tensor>,
    /// Each member's output size, in order.
    sizes: Vec<i64>,
}

impl PackedGroup {
    fn new(members: &[&Linear]) -> Option<Self> {
        let weights: Vec<&Tensor> = members.iter().map(|l| &l.weight).collect();
        let biases: Option<Vec<&Tensor>> = members.iter().map(|l| l.bias.as_ref()).collect();
        let (matrix, bias) = tch::no_grad(|| {
            let matrix = PackedMatrix::new(&Tensor::cat(&weights, 0))?;
            Some((matrix, biases.map(|b| Tensor::cat(&b, 0))))
        })?;
        Some(PackedGroup {
            matrix,
            bias,
            sizes: weights.iter().map(|w| w.size()[0]).collect(),
        })
    }

    /// Each member's output for `x`; `None` while autograd records (packed products have
    /// no backward) or for input the packed product does not take.
    fn forward(&self, x: &Tensor) -> Option<Vec<Tensor>> {
        if packed::grad_enabled() {
            return None;
        }
        let mut y = self.matrix.matmul_t(x)?;
        if let Some(b) = &self.bias {
            y += b;
        }
        Some(if self.sizes.len() == 1 {
            vec![y]
        } else {
            y.split_with_sizes(self.sizes.as_slice(), -1)
        })
    }
}

/// `linear`'s output for `x`: through `group` (its packed copy) when it can, else plain.
fn project(group: &Option<PackedGroup>, linear: &Linear, x: &Tensor) -> Tensor {
    match group.as_ref().and_then(|g| g.forward(x)) {
        Some(mut out) => out.swap_remove(0),
        None => linear.forward(x),
    }
}

/// RoPE inverse frequencies `[head_dim / 2]` and the factor cos/sin are scaled by (1 except
/// for YaRN), as `transformers`' `ROPE_INIT_FUNCTIONS` compute them. Computed in f64 and
/// rounded once; `transformers` computes in float32, a difference at the last bit.
pub(crate) fn rope_inv_freq(c: &ModelConfig) -> (Vec<f64>, f64) {
    let dim = c.head_dim;
    let d = dim as f64;
    let base = c.rope_theta;
    let plain: Vec<f64> = (0..dim / 2)
        .map(|i| 1.0 / base.powf(2.0 * i as f64 / d))
        .collect();
    match &c.rope_scaling {
        None => (plain, 1.0),
        Some(RopeScaling::Linear { factor }) => (plain.iter().map(|f| f / factor).collect(), 1.0),
        Some(RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            attention_factor,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            truncate,
        }) => {
            let factor = *factor;
            let get_mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention_factor = match (attention_factor, mscale, mscale_all_dim) {
                (Some(a), _, _) => *a,
                (None, Some(m), Some(all)) if *m != 0.0 && *all != 0.0 => {
                    get_mscale(factor, *m) / get_mscale(factor, *all)
                }
                _ => get_mscale(factor, 1.0),
            };
            // `transformers` uses `value or default`, so 0 also means the default.
            let beta_fast = beta_fast.filter(|b| *b != 0.0).unwrap_or(32.0);
            let beta_slow = beta_slow.filter(|b| *b != 0.0).unwrap_or(1.0);
            let original = *original_max_position_embeddings as f64;
            let correction_dim = |rotations: f64| {
                d * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
            };
            let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
            if truncate.unwrap_or(true) {
                low = low.floor();
                high = high.ceil();
            }
            let low = low.max(0.0);
            let high = high.min(d - 1.0);
            let high = if low == high { high + 0.001 } else { high };
            let inv = plain
                .iter()
                .enumerate()
                .map(|(i, &extrapolation)| {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation_weight = 1.0 - ramp;
                    let interpolation = extrapolation / factor;
                    interpolation * (1.0 - extrapolation_weight)
                        + extrapolation * extrapolation_weight
                })
                .collect();
            (inv, attention_factor)
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let old_context = *original_max_position_embeddings as f64;
            let low_freq_wavelen = old_context / low_freq_factor;
            let high_freq_wavelen = old_context / high_freq_factor;
            let inv = plain
                .iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_freq_wavelen {
                        f
                    } else if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        let smooth = (old_context / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect();
            (inv, 1.0)
        }
    }
}

/// Rotary embedding tables for given positions.
pub(crate) struct Rope {
    /// `[B, 1, S, head_dim]` each, in the compute dtype.
    cos: Tensor,
    /// The sine table with its first half negated: HF's `rotate_half(x) · sin` is
    /// `roll(x, head_dim / 2) · sin_rot`, one roll instead of two slices, a negation and
    /// a concatenation.
    sin_rot: Tensor,
}

/// HF Llama/Qwen `rotate_half`: (x1, x2) -> (-x2, x1) on the two halves of the last dim.
#[cfg(test)]
fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size().last().copied().unwrap_or(0) / 2;
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    Tensor::cat(&[x2.neg(), x1], -1)
}

/// HF's `x · cos + rotate_half(x) · sin`.
fn apply_rope(x: &Tensor, rope: &Rope) -> Tensor {
    let half = x.size().last().copied().unwrap_or(0) / 2;
    (x * &rope.cos).addcmul(&x.roll([half], [-1]), &rope.sin_rot)
}

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// Qwen3's per-head norms; `None` for Qwen2 and Llama.
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
    /// q, k and v as one packed product, and o: see [`PackedGroup`].
    packed_qkv: Option<PackedGroup>,
    packed_o: Option<PackedGroup>,
}

impl Attention {
    fn new(p: Path, c: &ModelConfig) -> Self {
        let q_dim = c.num_attention_heads * c.head_dim;
        let kv_dim = c.num_key_value_heads * c.head_dim;
        let (qkv_bias, o_bias, qk_norm) = (c.qkv_bias(), c.o_bias(), c.qk_norm());
        Attention {
            q_proj: Linear::new(&p, "q_proj", q_dim, c.hidden_size, qkv_bias),
            k_proj: Linear::new(&p, "k_proj", kv_dim, c.hidden_size, qkv_bias),
            v_proj: Linear::new(&p, "v_proj", kv_dim, c.hidden_size, qkv_bias),
            o_proj: Linear::new(&p, "o_proj", c.hidden_size, q_dim, o_bias),
            q_norm: qk_norm.then(|| RmsNorm::new(&p / "q_norm", c.head_dim, c.rms_norm_eps)),
            k_norm: qk_norm.then(|| RmsNorm::new(&p / "k_norm", c.head_dim, c.rms_norm_eps)),
            num_heads: c.num_attention_heads as i64,
            num_kv_heads: c.num_key_value_heads as i64,
            head_dim: c.head_dim as i64,
            packed_qkv: None,
            packed_o: None,
        }
    }

    fn forward(&self, x: &Tensor, rope: &Rope, mask: &AttnMask, kv: Kv) -> Tensor {
        let (b, s, _) = x.size3().expect("hidden states are [B, S, H]");
        let (q, k, v) = match self.packed_qkv.as_ref().and_then(|g| g.forward(x)) {
            Some(mut qkv) => {
                let v = qkv.pop().expect("q, k, v");
                let k = qkv.pop().expect("q, k, v");
                let q = qkv.pop().expect("q, k, v");
                (q, k, v)
            }
            None => (
                self.q_proj.forward(x),
                self.k_proj.forward(x),
                self.v_proj.forward(x),
            ),
        };
        let heads = |t: Tensor, n: i64| t.view([b, s, n, self.head_dim]);
        // Qwen3 normalizes each head's q and k before the rotation.
        let norm = |t: Tensor, n: &Option<RmsNorm>| match n {
            Some(n) => n.forward(&t),
            None => t,
        };
        let q = norm(heads(q, self.num_heads), &self.q_norm).transpose(1, 2);
        let k = norm(heads(k, self.num_kv_heads), &self.k_norm).transpose(1, 2);
        let v = heads(v, self.num_kv_heads).transpose(1, 2);
        let q = apply_rope(&q, rope);
        let k = apply_rope(&k, rope);

        let y = match kv {
            Kv::None => self.attend(&q, &k, &v, mask),
            Kv::Append((k_cache, v_cache), start) => {
                k_cache.narrow(2, start, s).copy_(&k);
                v_cache.narrow(2, start, s).copy_(&v);
                let k = k_cache.narrow(2, 0, start + s);
                let v = v_cache.narrow(2, 0, start + s);
                self.attend(&q, &k, &v, mask)
            }
            Kv::Row((k_cache, v_cache), row, slot) => {
                k_cache.narrow(0, row, 1).narrow(2, slot, s).copy_(&k);
                v_cache.narrow(0, row, 1).narrow(2, slot, s).copy_(&v);
                self.attend(&q, &k, &v, mask)
            }
            Kv::RowAfter((k_cache, v_cache), row, from, slot) => {
                k_cache.narrow(0, row, 1).narrow(2, slot, s).copy_(&k);
                v_cache.narrow(0, row, 1).narrow(2, slot, s).copy_(&v);
                let k = k_cache.narrow(0, row, 1).narrow(2, from, slot + s - from);
                let v = v_cache.narrow(0, row, 1).narrow(2, from, slot + s - from);
                self.attend(&q, &k, &v, mask)
            }
        };
        let y = y
            .transpose(1, 2)
            .reshape([b, s, self.num_heads * self.head_dim]);
        project(&self.packed_o, &self.o_proj, &y)
    }

    /// Scaled dot-product attention of `q` `[B, heads, S, D]` over `k`, `v` `[B, kv_heads,
    /// L, D]`.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttnMask) -> Tensor {
        if q.device().is_cuda() {
            // cuDNN's attention builds a plan per new shape (attention_backend.rs).
            crate::attention_backend::avoid_cudnn_attention();
        }
        let (attn_mask, is_causal) = match mask {
            AttnMask::Causal => (None, true),
            AttnMask::Explicit(m) => (Some(m), false),
            AttnMask::Trunk { trunk, branches } => {
                let s = q.size()[2];
                let t = (*trunk).clamp(0, s);
                let mut parts = Vec::with_capacity(2);
                if t > 0 {
                    let (qt, kt, vt) = (q.narrow(2, 0, t), k.narrow(2, 0, t), v.narrow(2, 0, t));
                    parts.push(self.attend(&qt, &kt, &vt, &AttnMask::Causal));
                }
                if t < s {
                    let qb = q.narrow(2, t, s - t);
                    parts.push(self.attend(
                        &qb,
                        k,
                        v,
                        &AttnMask::Explicit(branches.shallow_clone()),
                    ));
                }
                return Tensor::cat(&parts, 2);
            }
        };
        Tensor::scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask,
            0.0,
            is_causal,
            None,
            self.num_heads != self.num_kv_heads,
        )
    }
}

/// Where one layer's keys and values go, and what its queries attend.
enum Kv<'a> {
    /// Nowhere: the pass's own keys, under the mask.
    None,
    /// Into the cache at slot `start` of every row; queries attend slots `0 .. start + S`
    /// under the mask.
    Append(&'a mut (Tensor, Tensor), i64),
    /// One prompt's prefill (batch 1): its keys and values go to cache row `.1`, slots
    /// `.2 .. .2 + S`; queries attend the pass's own keys under the mask.
    Row(&'a mut (Tensor, Tensor), i64, i64),
    /// The rest of a prompt whose first tokens' keys and values are already in cache row
    /// `.1`, slots `.2 .. .3` (a reused prefix): the pass's go to slots `.3 .. .3 + S`, and
    /// queries attend slots `.2 .. .3 + S` under the mask.
    RowAfter(&'a mut (Tensor, Tensor), i64, i64, i64),
}

struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    /// gate and up as one packed product, and down: see [`PackedGroup`].
    packed_gate_up: Option<PackedGroup>,
    packed_down: Option<PackedGroup>,
}

impl Mlp {
    fn new(p: Path, c: &ModelConfig) -> Self {
        let (h, i, bias) = (c.hidden_size, c.intermediate_size, c.mlp_has_bias());
        Mlp {
            gate_proj: Linear::new(&p, "gate_proj", i, h, bias),
            up_proj: Linear::new(&p, "up_proj", i, h, bias),
            down_proj: Linear::new(&p, "down_proj", h, i, bias),
            packed_gate_up: None,
            packed_down: None,
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let gated = match self.packed_gate_up.as_ref().and_then(|g| g.forward(x)) {
            Some(gate_up) => gate_up[0].silu() * &gate_up[1],
            None => self.gate_proj.forward(x).silu() * self.up_proj.forward(x),
        };
        project(&self.packed_down, &self.down_proj, &gated)
    }
}

struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

/// The transformer itself, without ownership of its parameters (see [`Policy`]).
pub(crate) struct Decoder {
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// `None` when tied to `embed_tokens`.
    lm_head: Option<Tensor>,
    /// The output projection (`lm_head` or the tied embedding) packed for generation.
    head_packed: Option<PackedGroup>,
    /// RoPE inverse frequencies, `[head_dim / 2]`, float32.
    inv_freq: Tensor,
    /// Factor cos/sin are multiplied by (YaRN's attention factor; 1 otherwise).
    rope_scale: f64,
}

/// What a checkpointed forward pass kept (see `Decoder::checkpointed_hidden`): the
/// embedding's output (with its graph to the embedding), each layer's input (no graph),
/// and the leaf that stands for the last layer's output.
struct Recompute {
    embedded: Tensor,
    inputs: Vec<Tensor>,
    last: Tensor,
    rope: Rope,
    mask: AttnMask,
}

impl Recompute {
    /// The layers' part of the backward pass, last layer first: each layer is run again
    /// from its saved input, with gradients, and backpropagated from the gradient its
    /// output received (through `sum(output · gradient)`, whose gradient with respect to
    /// the output is exactly that gradient); what reaches its input goes on to the layer
    /// before, and finally into the embedding. Parameters' gradients accumulate in
    /// `.grad` as in the ordinary backward pass, which they equal up to rounding.
    fn backward(self, decoder: &Decoder) {
        let mut grad = self.last.grad();
        if !grad.defined() {
            return; // the loss did not reach the decoder
        }
        for (layer, input) in decoder.layers.iter().zip(self.inputs).rev() {
            let x = input.set_requires_grad(true);
            let y = decoder.layer_forward(layer, &x, &self.rope, &self.mask);
            (y * &grad).sum(Kind::Float).backward();
            grad = x.grad();
        }
        (&self.embedded * &grad).sum(Kind::Float).backward();
    }

    /// [`Recompute::backward`] under a [`ParamGate`], from the loss itself: no
    /// parameter's `.grad` is used (`run_backward` returns each unit's gradients). The
    /// loss's backward gives the embedding/head unit's gradients and the last layer's
    /// output's; each layer is gathered, run again, backpropagated and its gradients
    /// handed to the gate (which releases it); last the embedding's gradient joins the
    /// unit's and the unit is reduced. Every unit is reduced even when the loss did not
    /// reach the decoder (zeros), so every rank makes the same collective calls.
    fn backward_gated(self, decoder: &Decoder, g: &mut Gated, loss: &Tensor) {
        let or_zeros = |d: Tensor, p: &Tensor| if d.defined() { d } else { p.zeros_like() };
        let mut inputs = vec![self.last.shallow_clone()];
        inputs.extend(g.units[0].iter().map(Tensor::shallow_clone));
        let mut got = Tensor::run_backward(&[loss], &inputs, false, false);
        let mut outer = got.split_off(1);
        let grad = got.pop().expect("the last layer's output's gradient");
        let mut grad = or_zeros(grad, &self.last);
        for (i, (layer, input)) in decoder.layers.iter().zip(self.inputs).enumerate().rev() {
            let unit = i + 1;
            g.gate.gather(unit);
            let x = input.set_requires_grad(true);
            let y = decoder.layer_forward(layer, &x, &self.rope, &self.mask);
            let out = (y * &grad).sum(Kind::Float);
            let mut inputs = vec![x.shallow_clone()];
            inputs.extend(g.units[unit].iter().map(Tensor::shallow_clone));
            let mut grads = Tensor::run_backward(&[out], &inputs, false, false);
            let rest = grads.split_off(1);
            grad = or_zeros(grads.pop().expect("the input's gradient"), &x);
            let rest: Vec<Tensor> = rest
                .into_iter()
                .zip(&g.units[unit])
                .map(|(d, p)| or_zeros(d, p))
                .collect();
            g.gate.reduce(unit, &rest);
        }
        let out = (&self.embedded * &grad).sum(Kind::Float);
        let embedding = Tensor::run_backward(&[out], &inputs[1..], false, false);
        for (sum, d) in outer.iter_mut().zip(embedding) {
            if d.defined() {
                *sum = if sum.defined() { &*sum + d } else { d };
            }
        }
        let outer: Vec<Tensor> = outer
            .into_iter()
            .zip(&g.units[0])
            .map(|(d, p)| or_zeros(d, p))
            .collect();
        g.gate.reduce(0, &outer);
    }
}

impl Decoder {
    /// The decoder's parameters under `root`; `made` is called after each part is made
    /// (the embedding, each decoder layer, the final norm and head).
    fn new(root: &Path, c: &ModelConfig, made: &mut dyn FnMut()) -> Self {
        let model = root / "model";
        let embed_tokens = (&model / "embed_tokens").var(
            "weight",
            &[c.vocab_size as i64, c.hidden_size as i64],
            Init::Const(0.0),
        );
        made();
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let p = &model / "layers" / i;
                let layer = DecoderLayer {
                    input_layernorm: RmsNorm::new(
                        &p / "input_layernorm",
                        c.hidden_size,
                        c.rms_norm_eps,
                    ),
                    self_attn: Attention::new(&p / "self_attn", c),
                    post_attention_layernorm: RmsNorm::new(
                        &p / "post_attention_layernorm",
                        c.hidden_size,
                        c.rms_norm_eps,
                    ),
                    mlp: Mlp::new(&p / "mlp", c),
                };
                made();
                layer
            })
            .collect();
        let norm = RmsNorm::new(&model / "norm", c.hidden_size, c.rms_norm_eps);
        let lm_head = (!c.tie_word_embeddings)
            .then(|| Linear::new(root, "lm_head", c.vocab_size, c.hidden_size, false).weight);
        made();
        let (inv, rope_scale) = rope_inv_freq(c);
        let inv: Vec<f32> = inv.into_iter().map(|f| f as f32).collect();
        let inv_freq = Tensor::from_slice(&inv).to_device(root.device());
        Decoder {
            embed_tokens,
            layers,
            norm,
            lm_head,
            head_packed: None,
            inv_freq,
            rope_scale,
        }
    }

    /// The output projection's matrix `[vocab, hidden]`.
    fn head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Packs every projection and the output head for generation (see `packed.rs`): q, k
    /// and v as one product, gate and up as one. False, with nothing packed, where packing
    /// is not available or the weights are not float32 on the CPU.
    pub(crate) fn pack(&mut self) -> bool {
        self.unpack();
        let head = Linear {
            weight: self.head().shallow_clone(),
            bias: None,
        };
        let Some(head) = PackedGroup::new(&[&head]) else {
            return false;
        };
        for layer in &mut self.layers {
            let (a, m) = (&mut layer.self_attn, &mut layer.mlp);
            a.packed_qkv = PackedGroup::new(&[&a.q_proj, &a.k_proj, &a.v_proj]);
            a.packed_o = PackedGroup::new(&[&a.o_proj]);
            m.packed_gate_up = PackedGroup::new(&[&m.gate_proj, &m.up_proj]);
            m.packed_down = PackedGroup::new(&[&m.down_proj]);
            if a.packed_qkv.is_none()
                || a.packed_o.is_none()
                || m.packed_gate_up.is_none()
                || m.packed_down.is_none()
            {
                self.unpack();
                return false;
            }
        }
        self.head_packed = Some(head);
        true
    }

    /// Drops the packed copies (the weights may be about to change).
    pub(crate) fn unpack(&mut self) {
        self.head_packed = None;
        for layer in &mut self.layers {
            let (a, m) = (&mut layer.self_attn, &mut layer.mlp);
            (a.packed_qkv, a.packed_o) = (None, None);
            (m.packed_gate_up, m.packed_down) = (None, None);
        }
    }

    pub(crate) fn is_packed(&self) -> bool {
        self.head_packed.is_some()
    }

    /// Kind the activations are computed in: the parameters' (float32 unless the var store
    /// was cast).
    pub(crate) fn compute_kind(&self) -> Kind {
        self.embed_tokens.kind()
    }

    fn rope(&self, positions: &Tensor) -> Rope {
        // [B, S, 1] * [D/2] -> [B, S, D/2]; duplicated to D as in HF (`cat(freqs, freqs)`).
        // `inv_freq` is not a variable, so `VarStore::set_device` does not move it.
        let inv_freq = self.inv_freq.to_device(positions.device());
        let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * inv_freq;
        let kind = self.compute_kind();
        let (mut cos, mut sin) = (freqs.cos(), freqs.sin());
        if self.rope_scale != 1.0 {
            cos *= self.rope_scale;
            sin *= self.rope_scale;
        }
        Rope {
            cos: Tensor::cat(&[&cos, &cos], -1).unsqueeze(1).to_kind(kind),
            sin_rot: Tensor::cat(&[&sin.neg(), &sin], -1)
                .unsqueeze(1)
                .to_kind(kind),
        }
    }

    /// Runs the decoder over `input_ids` `[B, S]` at `positions` `[B, S]`, writing keys and
    /// values into `cache` slots `cache.len .. cache.len + S` when given. Returns the final
    /// normalized hidden states `[B, S, H]`.
    pub(crate) fn hidden_states(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        mask: &AttnMask,
        mut cache: Option<&mut KvCache>,
    ) -> Tensor {
        let start = cache.as_ref().map_or(0, |c| c.len);
        let h = self.run_layers(input_ids, positions, |i, x, rope, layer| {
            let kv = match cache.as_mut() {
                Some(c) => Kv::Append(&mut c.layers[i], start),
                None => Kv::None,
            };
            layer.forward(x, rope, mask, kv)
        });
        if let Some(c) = cache {
            c.len = start + input_ids.size()[1];
        }
        h
    }

    /// Runs one prompt, `input_ids` and `positions` `[1, S]`, with causal attention, and
    /// writes its keys and values to row `row`, slots `slot .. slot + S` of `cache` (whose
    /// `len` is left to the caller). Returns the final normalized hidden states `[1, S, H]`.
    pub(crate) fn prefill_row(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        row: i64,
        slot: i64,
        cache: &mut KvCache,
    ) -> Tensor {
        self.run_layers(input_ids, positions, |i, x, rope, layer| {
            let kv = Kv::Row(&mut cache.layers[i], row, slot);
            layer.forward(x, rope, &AttnMask::Causal, kv)
        })
    }

    /// [`Decoder::prefill_row`] of a prompt's last S tokens when the keys and values of
    /// the ones before them are already in cache row `row`, slots `from .. slot`: the new
    /// tokens' go to slots `slot .. slot + S`, each attending the reused prefix and the new
    /// tokens up to itself. `positions` continue the prefix's (`slot - from ..`).
    pub(crate) fn prefill_row_after(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        row: i64,
        from: i64,
        slot: i64,
        cache: &mut KvCache,
    ) -> Tensor {
        let s = input_ids.size()[1];
        let reused = slot - from;
        let device = input_ids.device();
        // Query i (at position reused + i) sees keys 0 ..= reused + i.
        let keys = Tensor::arange(reused + s, (Kind::Int64, device)).unsqueeze(0);
        let queries = Tensor::arange(s, (Kind::Int64, device)).unsqueeze(1) + reused;
        let mask = keys.le_tensor(&queries).view([1, 1, s, reused + s]);
        let mask = AttnMask::Explicit(mask);
        self.run_layers(input_ids, positions, |i, x, rope, layer| {
            let kv = Kv::RowAfter(&mut cache.layers[i], row, from, slot);
            layer.forward(x, rope, &mask, kv)
        })
    }

    /// Embedding, then every layer (its attention run by `attend(layer index, normed
    /// input, rope, attention)`), then the final norm.
    fn run_layers(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        mut attend: impl FnMut(usize, &Tensor, &Rope, &Attention) -> Tensor,
    ) -> Tensor {
        let rope = self.rope(positions);
        let mut h = Tensor::embedding(&self.embed_tokens, input_ids, -1, false, false);
        // Residual adds are out of place (`&h + x`, not `+=`): the norms save `h` for the
        // backward pass, and an in-place update would invalidate it.
        for (i, layer) in self.layers.iter().enumerate() {
            let a = attend(
                i,
                &layer.input_layernorm.forward(&h),
                &rope,
                &layer.self_attn,
            );
            h = &h + a;
            let m = layer
                .mlp
                .forward(&layer.post_attention_layernorm.forward(&h));
            h = &h + m;
        }
        self.norm.forward(&h)
    }

    /// One decoder layer over the whole sequence, no cache (training).
    fn layer_forward(
        &self,
        layer: &DecoderLayer,
        h: &Tensor,
        rope: &Rope,
        mask: &AttnMask,
    ) -> Tensor {
        let a = layer
            .self_attn
            .forward(&layer.input_layernorm.forward(h), rope, mask, Kv::None);
        let h = h + a;
        let m = layer
            .mlp
            .forward(&layer.post_attention_layernorm.forward(&h));
        &h + m
    }

    /// [`Decoder::hidden_states`] without a cache, keeping only each layer's input for
    /// the backward pass instead of every activation inside the layers (activation
    /// checkpointing). The layers run without gradients; the final norm runs with them,
    /// on a leaf that stands for the last layer's output. The returned [`Recompute`]
    /// finishes the backward pass once the loss's backward has reached that leaf
    /// ([`Recompute::backward`]). Where gradients are off (evaluation, `no_grad`) there
    /// is nothing to recompute: `None`, and the states are computed as usual.
    ///
    /// Under a [`ParamGate`] the embedding/head unit is gathered first (for the whole
    /// pass: the gate releases it when it is reduced) and each layer is gathered before
    /// it runs and released after it.
    fn checkpointed_hidden(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        mask: AttnMask,
        mut gate: Option<&mut dyn ParamGate>,
    ) -> (Tensor, Option<Recompute>) {
        let rope = self.rope(positions);
        if let Some(g) = gate.as_deref_mut() {
            g.gather(0);
        }
        let embedded = Tensor::embedding(&self.embed_tokens, input_ids, -1, false, false);
        if !embedded.requires_grad() {
            assert!(
                gate.is_none(),
                "a forward without gradients under a parameter gate: the gate's passes \
                 are training passes (evaluate between steps)"
            );
            let mut h = embedded;
            for layer in &self.layers {
                h = self.layer_forward(layer, &h, &rope, &mask);
            }
            return (self.norm.forward(&h), None);
        }
        let mut inputs = Vec::with_capacity(self.layers.len());
        let mut h = embedded.detach();
        tch::no_grad(|| {
            for (i, layer) in self.layers.iter().enumerate() {
                if let Some(g) = gate.as_deref_mut() {
                    g.gather(i + 1);
                }
                let next = self.layer_forward(layer, &h, &rope, &mask);
                if let Some(g) = gate.as_deref_mut() {
                    g.release(i + 1);
                }
                inputs.push(std::mem::replace(&mut h, next));
            }
        });
        let last = h.set_requires_grad(true);
        let hidden = self.norm.forward(&last);
        let recompute = Recompute {
            embedded,
            inputs,
            last,
            rope,
            mask,
        };
        (hidden, Some(recompute))
    }

    /// Projects hidden states to float32 logits over the vocabulary.
    pub(crate) fn logits(&self, hidden: &Tensor) -> Tensor {
        match self.head_packed.as_ref().and_then(|g| g.forward(hidden)) {
            Some(mut out) => out.swap_remove(0),
            None => hidden.linear(self.head(), None::<Tensor>),
        }
        .to_kind(Kind::Float)
    }
}

/// The student model: configuration, parameters and the transformer using them.
pub struct Policy {
    pub(crate) config: ModelConfig,
    pub(crate) vs: VarStore,
    pub(crate) model: Decoder,
    /// See [`Policy::set_checkpoint_activations`].
    checkpoint_activations: bool,
    /// The checkpointed passes whose layers' backward is still to run.
    pending: Mutex<Vec<Recompute>>,
    /// See [`Policy::set_param_gate`].
    gate: Mutex<Option<Gated>>,
}

/// Makes the parameters of one unit of the model present around its use, for training
/// whose parameters are sharded across ranks (ZeRO-3: the learner's `shard = "full"`).
/// Unit 0 is the embedding, the final norm and the output head (everything not under
/// `model.layers.`); unit 1 + i is decoder layer i ([`param_unit`]). Installed with
/// [`Policy::set_param_gate`] under activation checkpointing, a training pass calls, in
/// this order: `gather(0)`; `gather(u)`, `release(u)` for each layer, first to last (the
/// forward without gradients); `gather(u)`, `reduce(u, …)` for each layer, last to first
/// (the backward); `reduce(0, …)`. The gate owns what "present" means (an all-gather of
/// the rank's slices) and releases a unit when it is reduced.
pub trait ParamGate: Send {
    /// Unit `unit`'s parameters are about to be used: make them present.
    fn gather(&mut self, unit: usize);
    /// Unit `unit`'s forward without gradients ended: its parameters may go.
    fn release(&mut self, unit: usize);
    /// Unit `unit`'s gradients of this pass, one per parameter of [`Policy::unit_params`]
    /// (name order); the parameters may go after.
    fn reduce(&mut self, unit: usize, grads: &[Tensor]);
}

/// The unit a parameter belongs to under a [`ParamGate`]: 1 + i for decoder layer i
/// (`model.layers.{i}.…`), 0 for everything else.
pub fn param_unit(name: &str) -> usize {
    name.strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|i| i.parse::<usize>().ok())
        .map_or(0, |i| i + 1)
}

/// An installed gate and each unit's parameters (handles), in name order.
struct Gated {
    gate: Box<dyn ParamGate>,
    units: Vec<Vec<Tensor>>,
}

/// libtorch has one global random generator, so concurrent `Policy::new` calls would
/// interleave their draws; this lock makes initialization depend only on the seed.
static INIT_LOCK: Mutex<()> = Mutex::new(());

/// Panics on an inconsistent config (`ModelConfig::load` checks it with an error).
fn assert_valid(config: &ModelConfig) {
    if let Err((field, message)) = config.validate() {
        panic!("invalid ModelConfig: field `{field}` {message}");
    }
}

impl Policy {
    /// A randomly initialized model: matrices ~ N(0, 0.02²), norm weights 1, biases 0. The same seed
    /// gives the same weights on any device (they are drawn on the CPU).
    ///
    /// Panics if the config is inconsistent (see `ModelConfig::load`, which checks it).
    pub fn new(config: ModelConfig, device: Device, seed: i64) -> Self {
        let policy = Self::zeroed(config, device);
        let _guard = INIT_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(seed);
        let mut vars: Vec<(String, Tensor)> = policy.vs.variables().into_iter().collect();
        // HashMap order is arbitrary; draw in name order for determinism.
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        tch::no_grad(|| {
            for (name, mut var) in vars {
                if name.ends_with("norm.weight") || name.ends_with(".bias") {
                    continue; // already 1 (norms) or 0 (biases)
                }
                let init = Tensor::randn(var.size(), (Kind::Float, Device::Cpu)) * 0.02;
                var.copy_(&init);
            }
        });
        policy
    }

    /// The architecture with all matrices zero (norms 1): the starting point for loading a
    /// checkpoint, where drawing random weights first would only cost time (every token is
    /// equally likely until then).
    pub fn zeroed(config: ModelConfig, device: Device) -> Self {
        assert_valid(&config);
        let vs = VarStore::new(device);
        let model = Decoder::new(&vs.root(), &config, &mut || {});
        Self::of(config, vs, model)
    }

    /// The architecture without its weights: every parameter is there under its name, in
    /// float32 with no elements (shape `[0]`), and the whole model was never in memory
    /// (each part's parameters are released as soon as it is made, so at most the
    /// embedding or one decoder layer was). Returns each parameter's real shape by name.
    ///
    /// For a rank joining a sharded learner group, which receives the weights bucket by
    /// bucket and keeps its slice (`"full"`: it gathers each layer's parameters when it
    /// runs it; the other modes: it sets each parameter as it arrives).
    pub fn placeholder(
        config: ModelConfig,
        device: Device,
    ) -> (Self, std::collections::BTreeMap<String, Vec<i64>>) {
        assert_valid(&config);
        let vs = VarStore::new(device);
        let mut shapes = std::collections::BTreeMap::new();
        let empty = Tensor::zeros([0], (Kind::Float, device));
        let model = Decoder::new(&vs.root(), &config, &mut || {
            for (name, mut var) in vs.variables() {
                if let std::collections::btree_map::Entry::Vacant(e) = shapes.entry(name) {
                    e.insert(var.size());
                    var.set_data(&empty);
                }
            }
        });
        (Self::of(config, vs, model), shapes)
    }

    fn of(config: ModelConfig, vs: VarStore, model: Decoder) -> Self {
        Policy {
            config,
            vs,
            model,
            checkpoint_activations: false,
            pending: Mutex::new(Vec::new()),
            gate: Mutex::new(None),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Activation checkpointing for training (`[learner] checkpoint_activations`): the
    /// training forwards ([`Policy::forward`], [`Policy::forward_tree`],
    /// [`Policy::forward_trunk`] and their `_hidden` forms), where gradients are on, keep
    /// only each decoder layer's input instead of every activation inside the layers, and
    /// recompute a layer's activations during the backward pass. Memory for activations
    /// falls from all of them to one hidden state per layer plus one layer's worth; the
    /// cost is a second forward pass through the layers.
    ///
    /// The caller must call [`Policy::backward_checkpointed`] after each `backward()` of
    /// a loss computed from such a forward: that runs the layers' part of the backward
    /// pass. Gradients then equal those without checkpointing, up to rounding.
    pub fn set_checkpoint_activations(&mut self, on: bool) {
        self.checkpoint_activations = on;
        self.clear_checkpointed();
    }

    /// Whether activation checkpointing is on (see [`Policy::set_checkpoint_activations`]).
    pub fn checkpoint_activations(&self) -> bool {
        self.checkpoint_activations
    }

    /// Finishes the backward pass of every checkpointed forward since the last call
    /// (nothing without checkpointing): call it after the loss's `backward()`.
    ///
    /// Under a [`ParamGate`] use [`Policy::backward_loss`] instead (panics).
    pub fn backward_checkpointed(&self) {
        assert!(
            self.gate
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_none(),
            "under a parameter gate the backward pass starts from the loss (backward_loss)"
        );
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        for recompute in pending.into_iter().rev() {
            recompute.backward(&self.model);
        }
    }

    /// The backward pass of a training loss: `loss.backward()`, then the checkpointed
    /// layers' part ([`Policy::backward_checkpointed`]). Under a [`ParamGate`] no
    /// parameter's `.grad` is used: the pass's one checkpointed forward is backpropagated
    /// unit by unit and each unit's gradients go to the gate.
    pub fn backward_loss(&self, loss: &Tensor) {
        let mut gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        let Some(g) = gate.as_mut() else {
            drop(gate);
            loss.backward();
            self.backward_checkpointed();
            return;
        };
        let mut pending =
            std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        assert!(
            pending.len() <= 1,
            "under a parameter gate a pass has one training forward, not {}",
            pending.len()
        );
        match pending.pop() {
            Some(recompute) => recompute.backward_gated(&self.model, g, loss),
            // A loss that used no training forward reaches no gated parameter.
            None => loss.backward(),
        }
    }

    /// Each unit's parameters (see [`ParamGate`]), in name order within a unit: unit 0
    /// first, then the layers in order.
    pub fn unit_params(&self) -> Vec<Vec<(String, Tensor)>> {
        let mut named: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let mut units: Vec<Vec<(String, Tensor)>> =
            (0..=self.model.layers.len()).map(|_| Vec::new()).collect();
        for (name, t) in named {
            let u = param_unit(&name);
            units[u].push((name, t));
        }
        units
    }

    /// Installs `gate` for the training passes that follow (`Some`), or takes it out
    /// (`None`; returns the one installed). Under a gate the training forwards must be
    /// checkpointed ([`Policy::set_checkpoint_activations`]): the gate gathers each
    /// layer's parameters only while the layer runs. One training forward and its
    /// backward per pass; what comes outside the sequence [`ParamGate`] describes is the
    /// gate's to refuse.
    pub fn set_param_gate(&self, gate: Option<Box<dyn ParamGate>>) -> Option<Box<dyn ParamGate>> {
        let units = gate.is_some().then(|| {
            self.unit_params()
                .into_iter()
                .map(|u| u.into_iter().map(|(_, t)| t).collect())
                .collect()
        });
        let mut slot = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        let old = slot.take().map(|g| g.gate);
        if let (Some(gate), Some(units)) = (gate, units) {
            *slot = Some(Gated { gate, units });
        }
        old
    }

    /// Drops what checkpointed forwards kept for a backward pass that will not come.
    pub fn clear_checkpointed(&self) {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// The final hidden states of a training forward without a cache: checkpointed when
    /// that is on (see [`Policy::set_checkpoint_activations`]).
    fn train_hidden(&self, ids: &Tensor, positions: &Tensor, mask: AttnMask) -> Tensor {
        let mut gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        if !self.checkpoint_activations {
            assert!(
                gate.is_none(),
                "a parameter gate needs activation checkpointing (the layers' parameters \
                 are present only while each layer runs)"
            );
            return self.model.hidden_states(ids, positions, &mask, None);
        }
        let gate = gate.as_mut().map(|g| &mut *g.gate as &mut dyn ParamGate);
        let (hidden, recompute) = self.model.checkpointed_hidden(ids, positions, mask, gate);
        if let Some(r) = recompute {
            self.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(r);
        }
        hidden
    }

    pub fn var_store(&self) -> &VarStore {
        &self.vs
    }

    /// The parameters, to change. Drops the packed copies [`Policy::use_decode_layout`]
    /// made (they would not follow the change); call it again afterwards to restore them.
    pub fn var_store_mut(&mut self) -> &mut VarStore {
        self.model.unpack();
        &mut self.vs
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// Prepares the model for generation on the CPU (the engine does this at start).
    ///
    /// Where MKL's packed products are available (the PyTorch wheel on x86-64 Linux),
    /// every projection matrix and the output head get a copy packed in MKL's panel
    /// format, used by the generation paths (anything run under `tch::no_grad`); a decode
    /// step's few rows then stream each matrix once instead of re-packing it per product.
    /// This keeps a second copy of those weights (about the model's size again).
    /// [`Policy::load_weights`] re-packs; [`Policy::var_store_mut`] drops the packs.
    ///
    /// Elsewhere each `[out, in]` matrix is re-laid out in place, stored transposed
    /// (`[in, out]` in memory, same shape, name and values), so that `x · Wᵀ` runs as a
    /// plain product: MKL's transposed-operand path is much slower for few rows. Loading
    /// weights afterwards keeps that layout (`copy_` writes through it).
    ///
    /// Either way logits change only by summation order (about 1e-6 relative) and
    /// training (with gradients) uses the weights as they are. Nothing changes for a
    /// model on a GPU.
    pub fn use_decode_layout(&mut self) {
        if self.device() != Device::Cpu {
            return;
        }
        if !self.model.pack() {
            self.use_transposed_layout();
        }
    }

    /// Stores each projection matrix and the output head transposed in memory (`[in,
    /// out]`), same shape, name and values: [`Policy::use_decode_layout`]'s fallback where
    /// weights cannot be packed. Loading weights afterwards keeps the layout. Nothing
    /// changes for a model on a GPU.
    pub fn use_transposed_layout(&mut self) {
        if self.device() != Device::Cpu {
            return;
        }
        // An untied embedding is only ever gathered by row: leave it row-major.
        let skip = (!self.config.tie_word_embeddings).then_some("model.embed_tokens.weight");
        tch::no_grad(|| {
            for (name, mut var) in self.vs.variables() {
                if var.dim() == 2
                    && name.ends_with(".weight")
                    && Some(name.as_str()) != skip
                    && var.is_contiguous()
                {
                    let relaid = var.transpose(0, 1).contiguous().transpose(0, 1);
                    // Every handle to this parameter (the layers' and the VarStore's)
                    // shares its TensorImpl, so they all see the new layout.
                    var.set_data(&relaid);
                }
            }
        });
    }

    /// Full-sequence causal forward for training.
    ///
    /// `input_ids` `[B, T]` (Int64), `attention_mask` `[B, T]` (1 = real token, 0 = padding)
    /// -> logits `[B, T, vocab]` (Float). With right padding (the expected layout) real
    /// tokens never see padding under a causal mask, so the fused causal kernel is used and
    /// positions are 0..T. Any other mask layout (e.g. left padding) falls back to an
    /// explicit mask with positions counted over real tokens only. Logits at padding
    /// positions are meaningless; mask them out of the loss.
    pub fn forward(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Tensor {
        self.model
            .logits(&self.forward_hidden(input_ids, attention_mask))
    }

    /// [`Policy::forward`] up to the output head: the final normalized hidden states
    /// `[B, T, hidden]` (the parameters' kind). With [`Policy::head_weight`] a loss can
    /// compute logits for the positions it trains on only, a few at a time, instead of
    /// `[B, T, vocab]` at once.
    pub fn forward_hidden(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Tensor {
        let device = self.device();
        let ids = input_ids.to_device(device).to_kind(Kind::Int64);
        let (b, t) = ids.size2().expect("input_ids must be [B, T]");
        let valid = attention_mask.to_device(device).ne(0);
        assert_eq!(
            valid.size(),
            [b, t],
            "attention_mask must have the shape of input_ids"
        );
        let right_padded = t < 2
            || bool::try_from(
                valid
                    .narrow(1, 1, t - 1)
                    .to_kind(Kind::Int64)
                    .le_tensor(&valid.narrow(1, 0, t - 1).to_kind(Kind::Int64))
                    .all(),
            )
            .unwrap_or(false);
        let (positions, mask) = if right_padded {
            let positions = Tensor::arange(t, (Kind::Int64, device))
                .unsqueeze(0)
                .expand([b, t], true);
            (positions, AttnMask::Causal)
        } else {
            let positions = (valid.to_kind(Kind::Int64).cumsum(1, Kind::Int64) - 1).clamp_min(0);
            (
                positions,
                AttnMask::Explicit(causal_mask(&valid, &valid, 0)),
            )
        };
        self.train_hidden(&ids, &positions, mask)
    }

    /// The output head's weight `[vocab, hidden]` (the embedding where they are tied):
    /// logits are `hidden · Wᵀ`, as float32. A handle to the parameter itself, so
    /// gradients through it reach the parameter.
    pub fn head_weight(&self) -> Tensor {
        self.model.head().shallow_clone()
    }

    /// Forward over rows with an explicit attention structure, for training on packed
    /// rows where several sequences share a prefix (a tree of token sequences).
    ///
    /// `input_ids` `[B, L]` (integer), `position_ids` `[B, L]` (integer): the RoPE
    /// position of each token, i.e. its index in the plain sequence it belongs to (a
    /// branch continues the positions of its prefix); `allowed` `[B, L, L]` (bool, or
    /// integer with nonzero = true): `allowed[b, i, j]` says whether query `i` may attend
    /// key `j`. A query always attends itself as well (so padding slots, whatever their
    /// row says, never produce an all-masked softmax row). Returns float32 logits
    /// `[B, L, vocab]`; logits of padding slots are meaningless.
    ///
    /// With `allowed` the causal lower triangle and positions `0..L`, this equals
    /// `forward` with an all-ones attention mask (up to the kernels' rounding).
    pub fn forward_tree(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        allowed: &Tensor,
    ) -> Tensor {
        self.model
            .logits(&self.forward_tree_hidden(input_ids, position_ids, allowed))
    }

    /// [`Policy::forward_tree`] up to the output head (see [`Policy::forward_hidden`]).
    pub fn forward_tree_hidden(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        allowed: &Tensor,
    ) -> Tensor {
        let device = self.device();
        let ids = input_ids.to_device(device).to_kind(Kind::Int64);
        let (b, l) = ids.size2().expect("input_ids must be [B, L]");
        let positions = position_ids.to_device(device).to_kind(Kind::Int64);
        assert_eq!(
            positions.size(),
            [b, l],
            "position_ids must have the shape of input_ids"
        );
        let allowed = allowed.to_device(device);
        assert_eq!(allowed.size(), [b, l, l], "allowed must be [B, L, L]");
        let own = Tensor::eye(l, (Kind::Bool, device)).unsqueeze(0);
        let mask = AttnMask::Explicit(allowed.ne(0).logical_or(&own).unsqueeze(1));
        self.train_hidden(&ids, &positions, mask)
    }
}

impl Policy {
    /// Forward over rows laid out as a trunk and branches, for training on a trajectory's
    /// DAgger examples at the cost of its tokens once: slots `0 .. trunk` of every row are
    /// one plain sequence (positions `0 .. trunk`, causal attention by the fused kernel);
    /// each later slot is a token off it (a teacher label where the student acted, or
    /// another example's tail) that attends the slots `branch_allowed[b, i - trunk, j]`
    /// says (its ancestors; it always attends itself as well).
    ///
    /// `input_ids`, `position_ids` `[B, S]` (integer), `branch_allowed` `[B, S - trunk,
    /// S]` (bool, or integer with nonzero = true). Returns float32 logits `[B, S, vocab]`.
    /// Equal to `forward_tree` with the causal triangle over the trunk (up to the
    /// kernels' rounding); the trunk's attention costs half of dense `[S, S]` and runs
    /// fused.
    pub fn forward_trunk(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        trunk: i64,
        branch_allowed: &Tensor,
    ) -> Tensor {
        self.model.logits(&self.forward_trunk_hidden(
            input_ids,
            position_ids,
            trunk,
            branch_allowed,
        ))
    }

    /// [`Policy::forward_trunk`] up to the output head (see [`Policy::forward_hidden`]).
    pub fn forward_trunk_hidden(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        trunk: i64,
        branch_allowed: &Tensor,
    ) -> Tensor {
        let device = self.device();
        let ids = input_ids.to_device(device).to_kind(Kind::Int64);
        let (b, s) = ids.size2().expect("input_ids must be [B, S]");
        assert!((0..=s).contains(&trunk), "the trunk is 0..=S slots");
        let positions = position_ids.to_device(device).to_kind(Kind::Int64);
        assert_eq!(
            positions.size(),
            [b, s],
            "position_ids must have the shape of input_ids"
        );
        let allowed = branch_allowed.to_device(device);
        assert_eq!(
            allowed.size(),
            [b, s - trunk, s],
            "branch_allowed must be [B, S - trunk, S]"
        );
        // Each branch slot attends itself: its column index is trunk + its row index.
        let own = Tensor::eye_m(s - trunk, s - trunk, (Kind::Bool, device));
        let own = Tensor::cat(
            &[Tensor::zeros([s - trunk, trunk], (Kind::Bool, device)), own],
            1,
        )
        .unsqueeze(0);
        let branches = allowed.ne(0).logical_or(&own).unsqueeze(1);
        let mask = AttnMask::Trunk { trunk, branches };
        self.train_hidden(&ids, &positions, mask)
    }
}

/// Attention mask `[B, 1, S, L]` for `S` new queries after `past` cached keys: a query may
/// see valid keys at or before its own slot. `key_valid` is `[B, L]` (L = past + S),
/// `query_valid` `[B, S]`. Padding queries also see themselves, so that no softmax row is
/// entirely masked (that gives NaN); their outputs are never used by real tokens.
pub(crate) fn causal_mask(key_valid: &Tensor, query_valid: &Tensor, past: i64) -> Tensor {
    let (_, l) = key_valid.size2().expect("key_valid is [B, L]");
    let s = query_valid.size()[1];
    let device = key_valid.device();
    let q_slot = Tensor::arange_start(past, past + s, (Kind::Int64, device)).unsqueeze(1);
    let k_slot = Tensor::arange(l, (Kind::Int64, device)).unsqueeze(0);
    let causal = k_slot.le_tensor(&q_slot); // [S, L]
    let own_slot = k_slot.eq_tensor(&q_slot); // [S, L]
    let allowed = causal.unsqueeze(0).logical_and(&key_valid.unsqueeze(1)); // [B, S, L]
    let padding_query = query_valid.logical_not().unsqueeze(2); // [B, S, 1]
    let fallback = own_slot.unsqueeze(0).logical_and(&padding_query);
    allowed.logical_or(&fallback).unsqueeze(1)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn tiny_policy(seed: i64) -> Policy {
        let mut c = ModelConfig::tiny(64);
        c.hidden_size = 64;
        c.intermediate_size = 128;
        c.head_dim = 16;
        c.max_position_embeddings = 256;
        Policy::new(c, Device::Cpu, seed)
    }

    /// A placeholder has every parameter of the model, under its name, with no elements,
    /// and knows each one's shape (an untied head and biases included).
    #[test]
    fn a_placeholder_has_every_parameter_by_name_and_shape_but_no_elements() {
        for tied in [true, false] {
            let mut c = ModelConfig::tiny(64);
            c.tie_word_embeddings = tied;
            let whole = Policy::zeroed(c.clone(), Device::Cpu);
            let want: std::collections::BTreeMap<String, Vec<i64>> = whole
                .var_store()
                .variables()
                .into_iter()
                .map(|(n, t)| (n, t.size()))
                .collect();
            let (p, shapes) = Policy::placeholder(c, Device::Cpu);
            assert_eq!(shapes, want);
            assert_eq!(shapes.contains_key("lm_head.weight"), !tied);
            let vars = p.var_store().variables();
            assert_eq!(vars.len(), want.len());
            for (name, t) in vars {
                assert_eq!((t.numel(), t.kind()), (0, Kind::Float), "{name}");
            }
        }
    }

    /// Gradients of every parameter after `loss(policy).backward()` (and the
    /// checkpointed part of the backward pass).
    fn gradients(policy: &Policy, loss: impl Fn(&Policy) -> Tensor) -> Vec<(String, Tensor)> {
        for mut v in policy.var_store().trainable_variables() {
            v.zero_grad();
        }
        loss(policy).backward();
        policy.backward_checkpointed();
        let mut g: Vec<(String, Tensor)> = policy
            .var_store()
            .variables()
            .into_iter()
            .map(|(n, v)| (n, v.grad().copy()))
            .collect();
        g.sort_by(|a, b| a.0.cmp(&b.0));
        g
    }

    /// Activation checkpointing recomputes the layers in the backward pass: same loss,
    /// same gradient for every parameter (tied embeddings too), for the plain, left-padded
    /// (explicit mask), tree and trunk forwards; a forward without gradients keeps
    /// nothing for a backward pass.
    #[test]
    fn checkpointed_activations_give_the_same_gradients() {
        for tied in [false, true] {
            let make = || {
                let mut c = tiny_policy(0).config().clone();
                c.tie_word_embeddings = tied;
                Policy::new(c, Device::Cpu, 11)
            };
            let plain = make();
            let mut checkpointed = make();
            checkpointed.set_checkpoint_activations(true);
            assert!(checkpointed.checkpoint_activations());
            let ids = Tensor::from_slice(&[5i64, 9, 3, 7, 1, 4, 8, 2, 6, 6, 0, 0]).view([2, 6]);
            let right = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]).view([2, 6]);
            let left = Tensor::from_slice(&[0i64, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]).view([2, 6]);
            // A fixed, uneven weighting of the logits, so every position and token counts.
            let w = Tensor::arange(2 * 6 * 64, (Kind::Float, Device::Cpu))
                .view([2, 6, 64])
                .sin();
            let causal = Tensor::ones([6, 6], (Kind::Bool, Device::Cpu))
                .tril(0)
                .unsqueeze(0)
                .expand([2, 6, 6], true);
            let positions = Tensor::arange(6, (Kind::Int64, Device::Cpu))
                .unsqueeze(0)
                .expand([2, 6], true);
            let none = Tensor::zeros([2, 0, 6], (Kind::Bool, Device::Cpu));
            type Forward = Box<dyn Fn(&Policy) -> Tensor>;
            let forwards: Vec<(&str, Forward)> = vec![
                (
                    "right-padded",
                    Box::new({
                        let (ids, m) = (ids.shallow_clone(), right.shallow_clone());
                        move |p: &Policy| p.forward(&ids, &m)
                    }),
                ),
                (
                    "left-padded",
                    Box::new({
                        let (ids, m) = (ids.shallow_clone(), left.shallow_clone());
                        move |p: &Policy| p.forward(&ids, &m)
                    }),
                ),
                (
                    "tree",
                    Box::new({
                        let (ids, pos, a) = (
                            ids.shallow_clone(),
                            positions.shallow_clone(),
                            causal.shallow_clone(),
                        );
                        move |p: &Policy| p.forward_tree(&ids, &pos, &a)
                    }),
                ),
                (
                    "trunk",
                    Box::new({
                        let (ids, pos, b) = (
                            ids.shallow_clone(),
                            positions.shallow_clone(),
                            none.shallow_clone(),
                        );
                        move |p: &Policy| p.forward_trunk(&ids, &pos, 6, &b)
                    }),
                ),
            ];
            for (what, forward) in &forwards {
                let loss = |p: &Policy| (forward(p) * &w).sum(Kind::Float);
                let a = gradients(&plain, loss);
                let b = gradients(&checkpointed, loss);
                let (la, lb) = (
                    tch::no_grad(|| loss(&plain)).double_value(&[]),
                    tch::no_grad(|| loss(&checkpointed)).double_value(&[]),
                );
                assert!(
                    (la - lb).abs() < 1e-5 * la.abs().max(1.0),
                    "{what}: {la} vs {lb}"
                );
                assert_eq!(a.len(), b.len());
                for ((name, ga), (_, gb)) in a.iter().zip(&b) {
                    assert!(
                        ga.defined() && gb.defined(),
                        "{what} tied={tied}: no gradient for {name}"
                    );
                    let scale = ga.abs().max().double_value(&[]).max(1e-6);
                    let diff = (ga - gb).abs().max().double_value(&[]);
                    assert!(
                        diff <= 1e-5 * scale,
                        "{what} tied={tied}: {name} differs by {diff} (scale {scale})"
                    );
                }
            }
            let _ = tch::no_grad(|| checkpointed.forward(&ids, &right));
            assert!(
                checkpointed.pending.lock().unwrap().is_empty(),
                "a forward without gradients keeps nothing"
            );
        }
    }

    #[test]
    fn parameter_names_follow_hugging_face() {
        let p = tiny_policy(0);
        let vars = p.var_store().variables();
        for name in [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.self_attn.k_proj.weight",
            "model.layers.1.self_attn.v_proj.weight",
            "model.layers.1.self_attn.o_proj.weight",
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.self_attn.k_norm.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.1.input_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight",
            "model.norm.weight",
            "lm_head.weight",
        ] {
            assert!(
                vars.contains_key(name),
                "missing {name}; have {:?}",
                vars.keys()
            );
        }
        assert_eq!(vars.len(), 2 + 2 * 11 + 1);
        let count: i64 = vars.values().map(|t| t.numel() as i64).sum();
        assert_eq!(count as usize, p.config().num_parameters());

        let mut tied = p.config().clone();
        tied.tie_word_embeddings = true;
        let t = Policy::new(tied, Device::Cpu, 0);
        assert!(!t.var_store().variables().contains_key("lm_head.weight"));
        let count: i64 = t
            .var_store()
            .variables()
            .values()
            .map(|t| t.numel() as i64)
            .sum();
        assert_eq!(count as usize, t.config().num_parameters());
    }

    /// Preparing for decoding (packed, or the transposed fallback) changes how the
    /// products run only: same names, shapes, saved bytes and (to summation order) logits
    /// and greedy tokens; weights loaded later are used; training with gradients is
    /// untouched.
    #[test]
    fn decode_layout_keeps_values_and_survives_loading_weights() {
        for transposed in [false, true] {
            check_decode_preparation(transposed);
        }
    }

    fn check_decode_preparation(transposed: bool) {
        let plain = tiny_policy(5);
        let mut fast = tiny_policy(5);
        let q = "model.layers.0.self_attn.q_proj.weight";
        let relaid = transposed || !packed::available();
        if transposed {
            fast.use_transposed_layout();
        } else {
            fast.use_decode_layout();
            assert_eq!(fast.model.is_packed(), packed::available());
        }
        let vars = fast.var_store().variables();
        assert_eq!(vars[q].size(), [64, 64]);
        if relaid {
            assert_eq!(vars[q].stride(), [1, 64], "stored transposed");
            assert_eq!(vars["lm_head.weight"].stride(), [1, 64]);
            assert_eq!(
                vars["model.embed_tokens.weight"].stride(),
                [64, 1],
                "an untied embedding stays row-major"
            );
            // The layers' own handles see the new layout, not only the VarStore's.
            assert_eq!(
                fast.model.layers[1].mlp.down_proj.weight.stride(),
                [1, 64], // [out 64, in 128] stored as [128, 64]
                "the layer uses the relaid tensor"
            );
        } else {
            assert_eq!(
                vars[q].stride(),
                [64, 1],
                "packing leaves the weights as they are"
            );
        }

        let ids = Tensor::from_slice(&[3i64, 9, 27, 17, 51, 2, 8, 40]).view([2, 4]);
        let mask = Tensor::ones([2, 4], (Kind::Int64, Device::Cpu));
        let max_diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
        let want = plain.forward(&ids, &mask);
        // Without gradients (how generation runs) packed products are used...
        let got = tch::no_grad(|| fast.forward(&ids, &mask));
        assert!(max_diff(&want, &got) < 1e-5, "logits moved");
        // ... and with them the plain ones, so training still gets gradients.
        let logits = fast.forward(&ids, &mask);
        assert!(max_diff(&want, &logits) < 1e-5, "logits moved");
        logits.sum(Kind::Float).backward();
        let grad = fast.model.layers[0].self_attn.q_proj.weight.grad();
        assert!(grad.defined() && grad.abs().sum(Kind::Float).double_value(&[]) > 0.0);

        let params = vec![
            crate::GenParams {
                temperature: 0.0,
                max_new_tokens: 12,
                ..Default::default()
            };
            2
        ];
        let prompts = vec![vec![3u32, 9, 27], vec![17u32, 51, 2, 8, 40]];
        let tokens = |p: &Policy| -> Vec<Vec<u32>> {
            p.generate(&prompts, &params)
                .into_iter()
                .map(|g| g.tokens)
                .collect()
        };
        assert_eq!(tokens(&plain), tokens(&fast));

        let dir = tempfile::tempdir().unwrap();
        plain
            .save_weights(&dir.path().join("a.safetensors"))
            .unwrap();
        fast.save_weights(&dir.path().join("b.safetensors"))
            .unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("a.safetensors")).unwrap(),
            std::fs::read(dir.path().join("b.safetensors")).unwrap(),
            "the saved bytes do not depend on the layout"
        );
        // New weights: the other model's values, used by generation too (re-packed, or
        // written through the transposed layout).
        let other = tiny_policy(6);
        other
            .save_weights(&dir.path().join("c.safetensors"))
            .unwrap();
        fast.load_weights(&dir.path().join("c.safetensors"))
            .unwrap();
        assert_eq!(fast.model.is_packed(), !relaid);
        let vars = fast.var_store().variables();
        if relaid {
            assert_eq!(vars[q].stride(), [1, 64]);
        }
        assert!(vars[q].equal(&other.var_store().variables()[q]));
        let want = other.forward(&ids, &mask);
        let got = tch::no_grad(|| fast.forward(&ids, &mask));
        assert!(max_diff(&want, &got) < 1e-5, "logits after loading moved");
        assert_eq!(tokens(&other), tokens(&fast));

        // Whoever takes the var store to change it gets the packs dropped.
        fast.var_store_mut();
        assert!(!fast.model.is_packed());
        let got = tch::no_grad(|| fast.forward(&ids, &mask));
        assert!(max_diff(&want, &got) < 1e-5);
    }

    #[test]
    fn family_parameters_and_counts() {
        let count =
            |p: &Policy| -> usize { p.var_store().variables().values().map(|t| t.numel()).sum() };
        for (model_type, arch, attention_bias, mlp_bias) in [
            ("llama", "LlamaForCausalLM", true, true),
            ("llama", "LlamaForCausalLM", false, false),
            ("qwen2", "Qwen2ForCausalLM", false, false),
            ("qwen3", "Qwen3ForCausalLM", true, false),
        ] {
            let mut c = tiny_policy(0).config().clone();
            c.model_type = model_type.to_string();
            c.architectures = vec![arch.to_string()];
            c.attention_bias = attention_bias;
            c.mlp_bias = mlp_bias;
            let p = Policy::new(c.clone(), Device::Cpu, 0);
            let vars = p.var_store().variables();
            let has = |n: &str| vars.contains_key(n);
            let what = format!("{model_type} bias={attention_bias}/{mlp_bias}");
            assert_eq!(count(&p), c.num_parameters(), "{what}");
            assert_eq!(
                has("model.layers.0.self_attn.q_norm.weight"),
                model_type == "qwen3",
                "{what}"
            );
            assert_eq!(
                has("model.layers.1.self_attn.k_proj.bias"),
                model_type == "qwen2" || attention_bias,
                "{what}"
            );
            assert_eq!(
                has("model.layers.1.self_attn.o_proj.bias"),
                model_type != "qwen2" && attention_bias,
                "{what}"
            );
            assert_eq!(has("model.layers.0.mlp.up_proj.bias"), mlp_bias, "{what}");
            // Biases start at zero, as in Hugging Face.
            if let Some(b) = vars.get("model.layers.0.self_attn.v_proj.bias") {
                assert_eq!(f64::try_from(b.abs().sum(Kind::Float)).unwrap(), 0.0);
            }
        }
    }

    #[test]
    fn init_is_deterministic_by_seed() {
        let a = tiny_policy(7).var_store().variables();
        let b = tiny_policy(7).var_store().variables();
        let c = tiny_policy(8).var_store().variables();
        let name = "model.layers.0.self_attn.q_proj.weight";
        assert!(a[name].equal(&b[name]));
        assert!(!a[name].equal(&c[name]));
        let std = f64::try_from(a[name].std(true)).unwrap();
        assert!((std - 0.02).abs() < 0.002, "std {std}");
        assert!(a["model.norm.weight"].equal(&Tensor::ones([64], (Kind::Float, Device::Cpu))));
    }

    #[test]
    fn forward_shapes_and_causality() {
        let p = tiny_policy(0);
        let ids = Tensor::from_slice(&[5i64, 6, 7, 8, 9, 10, 11, 12]).view([2, 4]);
        let mask = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 0, 0]).view([2, 4]);
        let logits = p.forward(&ids, &mask);
        assert_eq!(logits.size(), [2, 4, 64]);
        assert_eq!(logits.kind(), Kind::Float);
        assert!(bool::try_from(logits.isfinite().all()).unwrap());

        // Changing a later token must not change earlier logits (causal), and right padding
        // must not change the logits of real tokens.
        let ids2 = Tensor::from_slice(&[5i64, 6, 7, 13, 9, 10, 40, 41]).view([2, 4]);
        let logits2 = p.forward(&ids2, &mask);
        let close = |a: &Tensor, b: &Tensor| a.allclose(b, 1e-5, 1e-5, false);
        assert!(close(
            &logits.get(0).narrow(0, 0, 3),
            &logits2.get(0).narrow(0, 0, 3)
        ));
        assert!(close(
            &logits.get(1).narrow(0, 0, 2),
            &logits2.get(1).narrow(0, 0, 2)
        ));
        assert!(!logits.narrow(1, 3, 1).get(0).allclose(
            &logits2.narrow(1, 3, 1).get(0),
            1e-5,
            1e-5,
            false
        ));
        let alone = p.forward(
            &ids.get(1).narrow(0, 0, 2).unsqueeze(0),
            &Tensor::ones([1, 2], (Kind::Int64, Device::Cpu)),
        );
        assert!(alone
            .get(0)
            .allclose(&logits.get(1).narrow(0, 0, 2), 1e-5, 1e-5, false));
    }

    #[test]
    fn forward_left_padding_matches_unpadded() {
        let p = tiny_policy(1);
        let ids = Tensor::from_slice(&[0i64, 0, 9, 10]).view([1, 4]);
        let mask = Tensor::from_slice(&[0i64, 0, 1, 1]).view([1, 4]);
        let padded = p.forward(&ids, &mask).get(0).narrow(0, 2, 2);
        let alone = p
            .forward(&ids.narrow(1, 2, 2), &mask.narrow(1, 2, 2))
            .get(0);
        assert!(
            padded.allclose(&alone, 1e-5, 1e-5, false),
            "{padded} vs {alone}"
        );
    }

    #[test]
    fn backward_reaches_every_parameter() {
        let p = tiny_policy(3);
        let ids = Tensor::from_slice(&[5i64, 6, 7, 8, 9, 10, 0, 0]).view([2, 4]);
        let mask = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 0, 0]).view([2, 4]);
        let logits = p.forward(&ids, &mask);
        let targets = ids.narrow(1, 1, 3).reshape([-1]);
        let loss = logits
            .narrow(1, 0, 3)
            .reshape([-1, 64])
            .cross_entropy_for_logits(&targets);
        loss.backward();
        for (name, var) in p.var_store().variables() {
            let g = var.grad();
            assert!(g.defined(), "{name} has no gradient");
            let norm = f64::try_from(g.norm()).unwrap();
            assert!(norm.is_finite() && norm > 0.0, "{name}: grad norm {norm}");
        }
    }

    #[test]
    fn forward_tree_matches_forward_on_each_branch() {
        let p = tiny_policy(4);
        let ones = |n: i64| Tensor::ones([1, n], (Kind::Int64, Device::Cpu));
        // Causal structure and plain positions: the same as `forward`.
        let ids = Tensor::from_slice(&[3i64, 4, 5, 6, 7]).view([1, 5]);
        let pos = Tensor::arange(5, (Kind::Int64, Device::Cpu)).unsqueeze(0);
        let causal = Tensor::ones([5, 5], (Kind::Bool, Device::Cpu))
            .tril(0)
            .unsqueeze(0);
        let tree = p.forward_tree(&ids, &pos, &causal);
        let plain = p.forward(&ids, &ones(5));
        assert!(tree.allclose(&plain, 1e-5, 1e-5, false));

        // Prefix [3 4 5], branch A [6 7] after it, branch B [8 9] after it, in one row:
        // slots 0..3 prefix, 3..5 A, 5..7 B; B sees the prefix and itself, not A.
        let row = Tensor::from_slice(&[3i64, 4, 5, 6, 7, 8, 9]).view([1, 7]);
        let pos = Tensor::from_slice(&[0i64, 1, 2, 3, 4, 3, 4]).view([1, 7]);
        let parent = [None, Some(0), Some(1), Some(2), Some(3), Some(2), Some(5)];
        let mut allowed = vec![false; 49];
        for i in 0..7 {
            let mut j = Some(i);
            while let Some(k) = j {
                allowed[i * 7 + k] = true;
                j = parent[k];
            }
        }
        let allowed = Tensor::from_slice(&allowed).view([1, 7, 7]);
        let packed = p.forward_tree(&row, &pos, &allowed).get(0);
        let a = p
            .forward(
                &Tensor::from_slice(&[3i64, 4, 5, 6, 7]).view([1, 5]),
                &ones(5),
            )
            .get(0);
        let b = p
            .forward(
                &Tensor::from_slice(&[3i64, 4, 5, 8, 9]).view([1, 5]),
                &ones(5),
            )
            .get(0);
        let close = |x: &Tensor, y: &Tensor| x.allclose(y, 1e-5, 1e-5, false);
        assert!(close(&packed.narrow(0, 0, 5), &a));
        assert!(close(&packed.narrow(0, 5, 2), &b.narrow(0, 3, 2)));
        // The positions matter: B at slots' own indices (5, 6) gives other logits.
        let wrong_pos = Tensor::arange(7, (Kind::Int64, Device::Cpu)).unsqueeze(0);
        let shifted = p.forward_tree(&row, &wrong_pos, &allowed).get(0);
        assert!(!close(&shifted.narrow(0, 5, 2), &b.narrow(0, 3, 2)));
    }

    #[test]
    fn forward_trunk_matches_forward_tree() {
        let p = tiny_policy(4);
        // Trunk [3 4 5 6 7] (slots 0..5); branch A [8 9] after slot 2 (slots 5, 6);
        // branch B [10] after slot 4 (slot 7); branch C [11] after A's 8 (slot 8).
        let row = Tensor::from_slice(&[3i64, 4, 5, 6, 7, 8, 9, 10, 11]).view([1, 9]);
        let pos = Tensor::from_slice(&[0i64, 1, 2, 3, 4, 3, 4, 5, 4]).view([1, 9]);
        let parent = [
            None,
            Some(0),
            Some(1),
            Some(2),
            Some(3),
            Some(2),
            Some(5),
            Some(4),
            Some(5),
        ];
        let mut allowed = vec![false; 81];
        for i in 0..9 {
            let mut j = Some(i);
            while let Some(k) = j {
                allowed[i * 9 + k] = true;
                j = parent[k];
            }
        }
        let tree_mask = Tensor::from_slice(&allowed).view([1, 9, 9]);
        let tree = p.forward_tree(&row, &pos, &tree_mask);
        let branch_rows = tree_mask.narrow(1, 5, 4);
        let trunk = p.forward_trunk(&row, &pos, 5, &branch_rows);
        assert!(trunk.allclose(&tree, 1e-5, 1e-5, false));
        // A branch that may not see the trunk gives other logits (the mask is used).
        let blind = branch_rows.zeros_like();
        let other = p.forward_trunk(&row, &pos, 5, &blind);
        assert!(!other
            .narrow(1, 5, 4)
            .allclose(&tree.narrow(1, 5, 4), 1e-5, 1e-5, false));
        assert!(other
            .narrow(1, 0, 5)
            .allclose(&tree.narrow(1, 0, 5), 1e-5, 1e-5, false));
        // All trunk, no branch: plain forward.
        let ids = Tensor::from_slice(&[3i64, 4, 5, 6, 7]).view([1, 5]);
        let plain_pos = Tensor::arange(5, (Kind::Int64, Device::Cpu)).unsqueeze(0);
        let none = Tensor::zeros([1, 0, 5], (Kind::Bool, Device::Cpu));
        let all_trunk = p.forward_trunk(&ids, &plain_pos, 5, &none);
        let plain = p.forward(&ids, &Tensor::ones([1, 5], (Kind::Int64, Device::Cpu)));
        assert!(all_trunk.allclose(&plain, 1e-5, 1e-5, false));
    }

    #[test]
    fn rotate_half_matches_hugging_face() {
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]);
        let r: Vec<f32> = Vec::try_from(rotate_half(&x)).unwrap();
        assert_eq!(r, [-3.0, -4.0, 1.0, 2.0]);
        // apply_rope's form: x·cos + roll(x)·sin_rot = x·cos + rotate_half(x)·sin.
        let x = Tensor::randn([2, 3, 5, 8], (Kind::Float, Device::Cpu));
        let (c, s) = (
            Tensor::randn([2, 1, 5, 4], (Kind::Float, Device::Cpu)),
            Tensor::randn([2, 1, 5, 4], (Kind::Float, Device::Cpu)),
        );
        let rope = Rope {
            cos: Tensor::cat(&[&c, &c], -1),
            sin_rot: Tensor::cat(&[&s.neg(), &s], -1),
        };
        let sin = Tensor::cat(&[&s, &s], -1);
        let want = &x * &rope.cos + rotate_half(&x) * &sin;
        let diff = (apply_rope(&x, &rope) - want).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{diff}");
    }

    #[test]
    fn casting_the_var_store_casts_the_model() {
        let mut p = tiny_policy(2);
        p.var_store_mut().bfloat16();
        assert_eq!(p.model.compute_kind(), Kind::BFloat16);
        assert_eq!(
            p.model.layers[1].mlp.down_proj.weight.kind(),
            Kind::BFloat16
        );
        // bfloat16 matmuls crash (SIGILL in oneDNN) on some virtualized CPUs that
        // advertise AMX, so the half-precision forward itself is only run on a GPU.
        if tch::Cuda::is_available() {
            p.var_store_mut().set_device(Device::Cuda(0));
            let ids = Tensor::from_slice(&[1i64, 2, 3]).view([1, 3]);
            let logits = p.forward(&ids, &Tensor::ones([1, 3], (Kind::Int64, Device::Cpu)));
            assert_eq!(logits.kind(), Kind::Float);
            assert!(bool::try_from(logits.isfinite().all()).unwrap());
        }
    }
}
