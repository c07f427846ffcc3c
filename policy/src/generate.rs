//! Batched sampling with a KV cache, returning the sampled tokens and their logprobs.
//!
//! Prompts of different lengths are left-padded into one batch so that every row's next
//! token sits in the same (last) column. Each row gets its own positions (counted over its
//! real tokens), a mask hiding its padding, its own parameters and its own random stream,
//! so a row's output does not depend on which other rows share the batch.
//!
//! The logprob recorded for a sampled token is taken under the distribution it was
//! actually drawn from (softmax(logits / T), renormalized over the nucleus when `top_p`
//! < 1); DAPO's importance ratio needs exactly that as ℓ_old. Nucleus truncation happens
//! only when a caller asks for it (`top_p` defaults to 1): the design forbids silent
//! truncation of RL rollouts.
//!
//! Over 800 lines because its tests (380 lines) sit beside the sampling code they pin down.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Device, Kind, Tensor};

use crate::model::{AttnMask, KvCache};
use crate::Policy;

/// Sampling parameters for one prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct GenParams {
    /// 0 = greedy; otherwise sample from softmax(logits / temperature).
    pub temperature: f32,
    /// Nucleus sampling: draw only from the smallest set of most likely tokens whose
    /// probability (after temperature) reaches `top_p`, renormalized. 1 = no truncation.
    /// Ignored by greedy rows.
    pub top_p: f32,
    pub max_new_tokens: usize,
    /// Seeds this row's random stream; the same prompt and params give the same tokens.
    pub seed: u64,
    /// Sampling any of these ends the row (the stop token is kept in the output).
    pub stop_token_ids: Vec<u32>,
}

/// How a prompt of `prompt_len` tokens and a budget of `max_new_tokens` fit in a context
/// of `context` tokens: at least one prompt token, at most `context − 1` new tokens, and the
/// prompt's last `context − new` tokens. Returns (index of the first prompt token kept,
/// new tokens allowed).
pub fn fit_context(prompt_len: usize, max_new_tokens: usize, context: usize) -> (usize, usize) {
    let max_new = max_new_tokens.min(context.saturating_sub(1));
    let keep = context - max_new;
    (prompt_len.saturating_sub(keep), max_new)
}

impl Default for GenParams {
    fn default() -> Self {
        GenParams {
            temperature: 1.0,
            top_p: 1.0,
            max_new_tokens: 256,
            seed: 0,
            stop_token_ids: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was sampled; it is the last element of `tokens`.
    Stop,
    /// `max_new_tokens` were generated (or nothing could be generated).
    Length,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// `logprobs[i]` = log-probability of `tokens[i]` under the distribution it was drawn
    /// from (greedy: the untempered distribution).
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
}

/// One prompt's state during generation.
struct Row {
    /// Index into the caller's `prompts`.
    index: usize,
    prompt: Vec<u32>,
    params: GenParams,
    rng: ChaCha8Rng,
    out: Generation,
    done: bool,
}

impl Policy {
    /// Generates continuations for a batch of prompts, one [`Generation`] per prompt.
    ///
    /// A prompt longer than `max_position_embeddings - max_new_tokens` keeps its last
    /// tokens; `max_new_tokens` is capped at `max_position_embeddings - 1`. An empty prompt (or `max_new_tokens == 0`) gives an empty generation with
    /// [`FinishReason::Length`]. Runs under `no_grad`.
    ///
    /// Panics if `prompts` and `params` differ in length or a token id is outside the
    /// model's vocabulary (a tokenizer/model mismatch the caller must fix).
    pub fn generate(&self, prompts: &[Vec<u32>], params: &[GenParams]) -> Vec<Generation> {
        assert_eq!(
            prompts.len(),
            params.len(),
            "generate needs one GenParams per prompt"
        );
        let vocab = self.config.vocab_size;
        let max_pos = self.config.max_position_embeddings;
        let mut results: Vec<Generation> = vec![
            Generation {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                finish: FinishReason::Length,
            };
            prompts.len()
        ];
        let mut rows = Vec::new();
        for (index, (prompt, p)) in prompts.iter().zip(params).enumerate() {
            if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
                panic!("prompt {index} has token id {bad}, outside the model's vocabulary of {vocab}; the tokenizer does not match the model");
            }
            // Prompt and generation together must fit in max_position_embeddings (which also
            // bounds the KV cache).
            let (start, max_new) = fit_context(prompt.len(), p.max_new_tokens, max_pos);
            if prompt.is_empty() || max_new == 0 {
                continue;
            }
            let keep = max_pos - max_new;
            if start > 0 {
                tracing::warn!(
                    prompt = index,
                    len = prompt.len(),
                    kept = keep,
                    "prompt too long for max_position_embeddings; keeping its last tokens"
                );
            }
            rows.push(Row {
                index,
                prompt: prompt[start..].to_vec(),
                params: GenParams {
                    max_new_tokens: max_new,
                    ..p.clone()
                },
                rng: ChaCha8Rng::seed_from_u64(p.seed),
                out: Generation {
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    finish: FinishReason::Length,
                },
                done: false,
            });
        }
        if !rows.is_empty() {
            tch::no_grad(|| self.generate_rows(&mut rows));
        }
        for row in rows {
            results[row.index] = row.out;
        }
        results
    }

    /// Runs each prompt through the model and stores its keys and values in `cache`,
    /// left-padded to the longest prompt `P` (row `i` fills slots `P - len_i .. P`).
    /// Returns the float32 logits for every row's next token, `[B, V]`. Identical prompts
    /// (a DAPO group) are computed once and copied.
    pub(crate) fn prefill(&self, prompts: &[&[u32]], cache: &mut KvCache) -> Tensor {
        let p = prompts.iter().map(|x| x.len()).max().unwrap_or(0) as i64;
        let mut first_seen: HashMap<&[u32], usize> = HashMap::new();
        let (mut unique, mut unique_rows, mut source) = (Vec::new(), Vec::new(), Vec::new());
        for (i, &prompt) in prompts.iter().enumerate() {
            let u = *first_seen.entry(prompt).or_insert_with(|| {
                unique.push(prompt);
                unique_rows.push(i as i64);
                unique.len() - 1
            });
            source.push(u as i64);
        }
        let none = vec![false; unique.len()];
        let done = self.prefill_rows(
            &unique,
            &unique_rows,
            p,
            &none,
            &vec![0; unique.len()],
            cache,
        );
        for (i, &u) in source.iter().enumerate() {
            let from = unique_rows[u as usize];
            if from != i as i64 {
                let len = prompts[i].len() as i64;
                cache.copy_row(from, i as i64, p - len, len);
            }
        }
        cache.len = p;
        let source = Tensor::from_slice(&source).to_device(self.device());
        done.logits.index_select(0, &source)
    }

    /// Runs `prompts` (none empty) through the model and writes prompt `j`'s keys and
    /// values to row `rows[j]` of `cache`, slots `end - len_j .. end` (`cache.len` is left
    /// to the caller). The first `reused[j]` tokens of prompt `j` (fewer than all) already
    /// have theirs in those slots (the engine's prefix cache): only the rest runs, and its
    /// hidden states are the rest's.
    ///
    /// Each prompt is a pass of its own, with plain causal attention: that needs no `[B,
    /// P, P]` mask (gigabytes for agent-length contexts), lets SDPA use its fused causal
    /// kernels, and keeps a prompt's prefill independent of its batch mates to the bit.
    /// (Packing several prompts into one pass would multiply fewer, larger matrices, but
    /// MKL's products are not bitwise independent of the number of rows, so a row's
    /// result would depend on which prompts happened to join with it.)
    pub(crate) fn prefill_rows(
        &self,
        prompts: &[&[u32]],
        rows: &[i64],
        end: i64,
        keep_hidden: &[bool],
        reused: &[usize],
        cache: &mut KvCache,
    ) -> Prefill {
        assert!(prompts.len() == rows.len() && prompts.len() == keep_hidden.len());
        assert_eq!(prompts.len(), reused.len());
        let device = self.device();
        let mut logits = Vec::with_capacity(prompts.len());
        let mut hidden = Vec::with_capacity(prompts.len());
        for (((prompt, &row), &keep), &m) in prompts.iter().zip(rows).zip(keep_hidden).zip(reused) {
            let len = prompt.len() as i64;
            let m = m as i64;
            assert!(len > 0, "prefill of an empty prompt");
            assert!(m < len, "a reused prefix must leave a token to run");
            let ids: Vec<i64> = prompt[m as usize..].iter().map(|&t| t as i64).collect();
            let ids = Tensor::from_slice(&ids)
                .view([1, len - m])
                .to_device(device);
            let positions = Tensor::arange_start(m, len, (Kind::Int64, device)).unsqueeze(0);
            let start = end - len;
            let h = if m > 0 {
                self.model
                    .prefill_row_after(&ids, &positions, row, start, start + m, cache)
            } else {
                self.model.prefill_row(&ids, &positions, row, start, cache)
            }
            .squeeze_dim(0);
            logits.push(self.model.logits(&h.narrow(0, len - m - 1, 1)));
            hidden.push(keep.then_some(h));
        }
        Prefill {
            logits: Tensor::cat(&logits, 0),
            hidden,
        }
    }

    fn generate_rows(&self, rows: &mut [Row]) {
        let device = self.device();
        let b = rows.len() as i64;
        let p = rows.iter().map(|r| r.prompt.len()).max().unwrap_or(0) as i64;
        let steps = rows
            .iter()
            .map(|r| r.params.max_new_tokens)
            .max()
            .unwrap_or(0) as i64;
        let capacity = p + steps;
        let mut cache = KvCache::new(&self.config, b, capacity, self.model.compute_kind(), device);
        let prompts: Vec<&[u32]> = rows.iter().map(|r| r.prompt.as_slice()).collect();
        let mut logits = self.prefill(&prompts, &mut cache);

        // Which cache slots hold real keys, per row: everything after the row's left
        // padding (prompt slots, then one generated slot per step).
        let mut valid = vec![false; (b * capacity) as usize];
        for (r, row) in rows.iter().enumerate() {
            let pad = (p as usize) - row.prompt.len();
            valid[r * capacity as usize + pad..(r + 1) * capacity as usize].fill(true);
        }
        let key_valid = Tensor::from_slice(&valid)
            .view([b, capacity])
            .to_device(device);

        let params: Vec<&GenParams> = rows.iter().map(|r| &r.params).collect();
        let sampling = RowSampling::new(&params, device);
        let prompt_lens: Vec<i64> = rows.iter().map(|r| r.prompt.len() as i64).collect();
        let prompt_lens = Tensor::from_slice(&prompt_lens).to_device(device);

        for step in 0..steps {
            // One uniform draw per sampling row and step, from that row's own stream.
            let uniforms: Vec<f64> = rows
                .iter_mut()
                .map(|r| {
                    if r.done || r.params.temperature <= 0.0 {
                        0.0
                    } else {
                        r.rng.gen::<f64>()
                    }
                })
                .collect();
            let Sampled {
                tokens, logprobs, ..
            } = sample(&logits, &sampling, &uniforms, 0);

            for ((row, &tok), &lp) in rows.iter_mut().zip(&tokens).zip(&logprobs) {
                if row.done {
                    continue;
                }
                let tok = tok as u32;
                row.out.tokens.push(tok);
                row.out.logprobs.push(lp);
                if row.params.stop_token_ids.contains(&tok) {
                    row.out.finish = FinishReason::Stop;
                    row.done = true;
                } else if row.out.tokens.len() >= row.params.max_new_tokens {
                    row.done = true;
                }
            }
            if rows.iter().all(|r| r.done) {
                break;
            }
            // Finished rows keep feeding their (ignored) samples; slicing them out of the
            // batch would cost a cache copy, which is dearer than their share of the step.
            let next = Tensor::from_slice(&tokens).view([b, 1]).to_device(device);
            let positions = (&prompt_lens + step).unsqueeze(1);
            let slot = p + step;
            let mask = key_valid.narrow(1, 0, slot + 1).view([b, 1, 1, slot + 1]);
            let hidden = self.model.hidden_states(
                &next,
                &positions,
                &AttnMask::Explicit(mask),
                Some(&mut cache),
            );
            logits = self.model.logits(&hidden.squeeze_dim(1));
        }
    }
}

/// What [`Policy::prefill_rows`] gives back.
pub(crate) struct Prefill {
    /// Next-token logits after each prompt, `[n, V]`, float32.
    pub(crate) logits: Tensor,
    /// Final hidden states `[len, H]` of each prompt whose `keep_hidden` was set.
    pub(crate) hidden: Vec<Option<Tensor>>,
}

/// Per-row sampling settings as tensors on the logits' device, built once per batch
/// layout rather than every step.
pub(crate) struct RowSampling {
    /// `[B, 1]`; greedy rows use 1 so that their logprobs come from the untempered
    /// distribution.
    temps: Tensor,
    /// `[B, 1]` nucleus mass, +inf for rows that do not truncate; `None` when no row does
    /// (the common case skips the sort).
    top_p: Option<Tensor>,
    /// `[B]` bool.
    greedy: Tensor,
    /// Every row is greedy: `sample` needs no CDF.
    all_greedy: bool,
}

impl RowSampling {
    pub(crate) fn new(params: &[&GenParams], device: Device) -> Self {
        let greedy: Vec<bool> = params.iter().map(|p| p.temperature <= 0.0).collect();
        let temps: Vec<f32> = params
            .iter()
            .map(|p| {
                if p.temperature > 0.0 {
                    p.temperature
                } else {
                    1.0
                }
            })
            .collect();
        let top_p: Vec<f32> = params
            .iter()
            .map(|p| {
                if p.temperature > 0.0 && p.top_p < 1.0 {
                    p.top_p
                } else {
                    f32::INFINITY
                }
            })
            .collect();
        let top_p = top_p
            .iter()
            .any(|t| t.is_finite())
            .then(|| Tensor::from_slice(&top_p).to_device(device).unsqueeze(1));
        RowSampling {
            temps: Tensor::from_slice(&temps).to_device(device).unsqueeze(1),
            top_p,
            all_greedy: greedy.iter().all(|&g| g),
            greedy: Tensor::from_slice(&greedy).to_device(device),
        }
    }
}

/// What [`sample`] picked, one entry per row.
pub(crate) struct Sampled {
    pub(crate) tokens: Vec<i64>,
    pub(crate) logprobs: Vec<f32>,
    /// The `top_n` most likely tokens of each row's sampling distribution with their
    /// logprobs, most likely first (empty when `top_n` is 0).
    pub(crate) top: Vec<Vec<(u32, f32)>>,
}

/// The log-probabilities each row samples from: log_softmax(logits / T), restricted to
/// the nucleus for rows with a finite `top_p` (tokens outside it get -inf).
fn sampling_logprobs(logits: &Tensor, s: &RowSampling) -> Tensor {
    let scaled = logits / &s.temps;
    let Some(top_p) = &s.top_p else {
        return scaled.log_softmax(-1, Kind::Float);
    };
    let (sorted, order) = scaled.sort(-1, true);
    let probs = sorted.softmax(-1, Kind::Float);
    // Mass strictly before each token (in descending order): a token stays while that is
    // below top_p, so the most likely token always stays and the kept set is the smallest
    // whose mass reaches top_p.
    let before = probs.cumsum(-1, Kind::Float) - &probs;
    let drop_sorted = before.ge_tensor(top_p);
    let drop = drop_sorted.zeros_like().scatter(1, &order, &drop_sorted);
    scaled
        .masked_fill(&drop, f64::NEG_INFINITY)
        .log_softmax(-1, Kind::Float)
}

/// Picks one token per row from float32 `logits` `[B, V]`: the argmax for greedy rows,
/// otherwise inverse-CDF sampling of the row's sampling distribution (see
/// [`sampling_logprobs`]) with the given uniform draw. Sampling happens on the logits'
/// device so that only B tokens and B logprobs (and B × `top_n` alternatives) cross to the
/// host; the CDF is built in float64 so that draws near 1 are not lost to rounding.
pub(crate) fn sample(logits: &Tensor, s: &RowSampling, uniforms: &[f64], top_n: usize) -> Sampled {
    let device = logits.device();
    let (b, vocab) = logits.size2().expect("logits are [B, V]");
    let logp = sampling_logprobs(logits, s);
    let argmax = logits.argmax(-1, false);
    let tokens = if s.all_greedy {
        // No row draws: the float64 CDF over the vocabulary would only be thrown away.
        argmax
    } else {
        let cdf = logp.to_kind(Kind::Double).exp().cumsum(-1, Kind::Double);
        let total = cdf.narrow(1, vocab - 1, 1);
        let u = Tensor::from_slice(uniforms).to_device(device).unsqueeze(1) * total;
        // First index whose CDF exceeds u: zero-probability tokens can never be chosen.
        let drawn = u
            .searchsorted(&cdf, false, true, "right", None::<Tensor>)
            .squeeze_dim(1)
            .clamp_max(vocab - 1);
        argmax.where_self(&s.greedy, &drawn)
    };
    let lp = logp.gather(1, &tokens.unsqueeze(1), false).squeeze_dim(1);
    let tokens = Vec::<i64>::try_from(tokens.to_device(Device::Cpu)).expect("token ids are int64");
    let logprobs = Vec::<f32>::try_from(lp.to_device(Device::Cpu)).expect("logprobs are float32");
    let n = (top_n as i64).min(vocab);
    let top = if n > 0 {
        let (values, indices) = logp.topk(n, -1, true, true);
        let values = Vec::<f32>::try_from(values.to_device(Device::Cpu).view([-1]))
            .expect("logprobs are float32");
        let indices = Vec::<i64>::try_from(indices.to_device(Device::Cpu).view([-1]))
            .expect("token ids are int64");
        (0..b as usize)
            .map(|r| {
                let row = r * n as usize..(r + 1) * n as usize;
                indices[row.clone()]
                    .iter()
                    .zip(&values[row])
                    .filter(|(_, v)| v.is_finite())
                    .map(|(&i, &v)| (i as u32, v))
                    .collect()
            })
            .collect()
    } else {
        vec![Vec::new(); b as usize]
    };
    Sampled {
        tokens,
        logprobs,
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::tiny_policy;

    #[test]
    fn prompts_keep_their_last_tokens_to_fit_the_context() {
        // 10 + 4 > 8: the last 4 prompt tokens stay.
        assert_eq!(fit_context(10, 4, 8), (6, 4));
        // The budget is capped at context − 1, leaving one prompt token.
        assert_eq!(fit_context(3, 100, 8), (2, 7));
        assert_eq!(fit_context(3, 5, 8), (0, 5));
        assert_eq!(fit_context(5, 0, 8), (0, 0));
    }

    fn greedy(n: usize) -> GenParams {
        GenParams {
            temperature: 0.0,
            top_p: 1.0,
            max_new_tokens: n,
            seed: 0,
            stop_token_ids: vec![],
        }
    }

    fn ones(n: usize) -> Tensor {
        Tensor::ones([1, n as i64], (Kind::Int64, Device::Cpu))
    }

    fn ids(tokens: &[u32]) -> Tensor {
        let v: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
        Tensor::from_slice(&v).unsqueeze(0)
    }

    #[test]
    fn prefill_logits_match_full_forward() {
        let p = tiny_policy(3);
        let a: &[u32] = &[3, 14, 15, 9, 26, 5];
        let b: &[u32] = &[35, 8];
        let mut cache = KvCache::new(&p.config, 3, 8, Kind::Float, Device::Cpu);
        let logits = tch::no_grad(|| p.prefill(&[a, b, a], &mut cache));
        assert_eq!(cache.len, 6);
        for (r, prompt) in [a, b, a].iter().enumerate() {
            let full = p
                .forward(&ids(prompt), &ones(prompt.len()))
                .get(0)
                .get(prompt.len() as i64 - 1);
            let diff = f64::try_from((&full - logits.get(r as i64)).abs().max()).unwrap();
            assert!(diff < 1e-4, "row {r}: max |diff| {diff}");
        }
    }

    /// A prompt's prefill does not depend on its batch mates, to the bit: the same keys,
    /// values, logits and hidden states whichever prompts share the batch and whichever
    /// row and slots it gets (runs that batch differently, e.g. under other timing,
    /// generate the same tokens). Also with the model prepared for decoding.
    #[test]
    fn a_prompts_prefill_does_not_depend_on_its_batch_mates() {
        for prepared in [false, true] {
            let mut p = tiny_policy(3);
            if prepared {
                p.use_decode_layout();
            }
            let prompts: [&[u32]; 4] = [&[3, 14, 15, 9, 26, 5], &[35, 8], &[7], &[2, 61, 42, 8, 1]];
            let rows = [2i64, 0, 3, 1];
            let mut cache = KvCache::new(&p.config, 4, 9, Kind::Float, Device::Cpu);
            let all = tch::no_grad(|| {
                p.prefill_rows(&prompts, &rows, 7, &[true; 4], &[0; 4], &mut cache)
            });
            for (j, prompt) in prompts.iter().enumerate() {
                let len = prompt.len() as i64;
                let mut alone = KvCache::new(&p.config, 1, len, Kind::Float, Device::Cpu);
                let one = tch::no_grad(|| {
                    p.prefill_rows(&[prompt], &[0], len, &[true], &[0], &mut alone)
                });
                let at = format!("prepared {prepared}, prompt {j}");
                assert!(
                    all.logits.get(j as i64).equal(&one.logits.get(0)),
                    "{at}: logits"
                );
                let (h, h1) = (all.hidden[j].as_ref(), one.hidden[0].as_ref());
                assert!(h.unwrap().equal(h1.unwrap()), "{at}: hidden states");
                for ((k, v), (k1, v1)) in cache.layers.iter().zip(&alone.layers) {
                    let slots = |t: &Tensor| t.get(rows[j]).narrow(1, 7 - len, len);
                    assert!(slots(k).equal(&k1.get(0)), "{at}: keys");
                    assert!(slots(v).equal(&v1.get(0)), "{at}: values");
                }
                // And it is the model's forward pass (to rounding).
                let full = p
                    .forward(&ids(prompt), &ones(prompt.len()))
                    .get(0)
                    .get(len - 1);
                let diff = f64::try_from((full - one.logits.get(0)).abs().max()).unwrap();
                assert!(diff < 1e-4, "{at}: logits off the forward pass by {diff}");
            }
        }
    }

    #[test]
    fn cached_decode_matches_full_forward() {
        // Every generated token's logprob, recomputed from one full forward over
        // prompt + generation, checks each KV-cache decode step.
        let p = tiny_policy(4);
        let prompt = vec![7u32, 1, 30, 2];
        let g = &p.generate(std::slice::from_ref(&prompt), &[greedy(12)])[0];
        assert_eq!(g.tokens.len(), 12);
        let all: Vec<u32> = prompt.iter().chain(&g.tokens).copied().collect();
        let logp = p
            .forward(&ids(&all), &ones(all.len()))
            .get(0)
            .log_softmax(-1, Kind::Float);
        for (i, (&tok, &lp)) in g.tokens.iter().zip(&g.logprobs).enumerate() {
            let row = logp.get((prompt.len() + i - 1) as i64);
            assert_eq!(
                i64::try_from(row.argmax(0, false)).unwrap(),
                tok as i64,
                "step {i}"
            );
            let want = f64::try_from(row.get(tok as i64)).unwrap();
            assert!((want - lp as f64).abs() < 1e-4, "step {i}: {want} vs {lp}");
        }
    }

    #[test]
    fn batched_greedy_equals_unbatched() {
        let p = tiny_policy(5);
        // Different lengths (left padding), and a repeated prompt (shared prefill).
        let prompts = vec![
            vec![11u32, 12, 13, 14, 15, 16, 17],
            vec![40u32, 41],
            vec![9u32; 4],
            vec![40u32, 41],
        ];
        let params = vec![greedy(10), greedy(6), greedy(8), greedy(9)];
        let batched = p.generate(&prompts, &params);
        for (i, prompt) in prompts.iter().enumerate() {
            let alone = &p.generate(std::slice::from_ref(prompt), &[params[i].clone()])[0];
            assert_eq!(batched[i].tokens, alone.tokens, "prompt {i}");
            assert_eq!(batched[i].tokens.len(), params[i].max_new_tokens);
            for (a, b) in batched[i].logprobs.iter().zip(&alone.logprobs) {
                assert!((a - b).abs() < 1e-4, "prompt {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn sampling_is_deterministic_by_seed_and_batch_independent() {
        let p = tiny_policy(6);
        let params = |seed| GenParams {
            temperature: 1.0,
            top_p: 1.0,
            max_new_tokens: 16,
            seed,
            stop_token_ids: vec![],
        };
        let prompt = vec![3u32, 4, 5];
        let a = &p.generate(std::slice::from_ref(&prompt), &[params(1)])[0];
        let b = p.generate(&[vec![60u32; 9], prompt.clone()], &[params(99), params(1)]);
        let c = &p.generate(std::slice::from_ref(&prompt), &[params(2)])[0];
        assert_eq!(a.tokens, b[1].tokens);
        assert_ne!(
            a.tokens, c.tokens,
            "different seeds should give different samples"
        );
        for g in [a, c, &b[0]] {
            assert_eq!(g.logprobs.len(), g.tokens.len());
            assert!(
                g.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0),
                "{:?}",
                g.logprobs
            );
        }
    }

    #[test]
    fn sampled_logprob_is_tempered_log_softmax() {
        let p = tiny_policy(7);
        let prompt = vec![20u32, 21, 22];
        for t in [0.5f32, 1.0, 2.0] {
            let g = &p.generate(
                std::slice::from_ref(&prompt),
                &[GenParams {
                    temperature: t,
                    top_p: 1.0,
                    max_new_tokens: 8,
                    seed: 5,
                    stop_token_ids: vec![],
                }],
            )[0];
            let all: Vec<u32> = prompt.iter().chain(&g.tokens).copied().collect();
            let logits = p.forward(&ids(&all), &ones(all.len())).get(0);
            let logp = (logits / t as f64).log_softmax(-1, Kind::Float);
            for (i, (&tok, &lp)) in g.tokens.iter().zip(&g.logprobs).enumerate() {
                let want =
                    f64::try_from(logp.get((prompt.len() + i - 1) as i64).get(tok as i64)).unwrap();
                assert!(
                    (want - lp as f64).abs() < 1e-4,
                    "T={t} step {i}: {want} vs {lp}"
                );
            }
        }
    }

    fn row(temperature: f32, top_p: f32) -> GenParams {
        GenParams {
            temperature,
            top_p,
            ..GenParams::default()
        }
    }

    /// Draws `n` times from one row of `logits` and returns the counts per token, checking
    /// every sampled token's logprob against `want_logp`.
    fn draw(logits: &[f32], params: &GenParams, n: usize, want_logp: &[f32]) -> Vec<usize> {
        let logits = Tensor::from_slice(logits).unsqueeze(0);
        let s = RowSampling::new(&[params], Device::Cpu);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let mut counts = vec![0usize; want_logp.len()];
        for _ in 0..n {
            let out = sample(&logits, &s, &[rng.gen::<f64>()], 0);
            let t = out.tokens[0] as usize;
            counts[t] += 1;
            assert!(
                (out.logprobs[0] - want_logp[t]).abs() < 1e-5,
                "token {t}: {} vs {}",
                out.logprobs[0],
                want_logp[t]
            );
        }
        counts
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // A crafted 3-token distribution, drawn many times: empirical frequencies must match.
        let logits = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let want = [0.25f32.ln(), 0.75f32.ln(), f32::NEG_INFINITY];
        let counts = draw(&logits, &row(1.0, 1.0), 2000, &want);
        assert_eq!(counts[2], 0, "a zero-probability token was sampled");
        assert!(
            (counts[1] as f64 / 2000.0 - 0.75).abs() < 0.04,
            "{counts:?}"
        );
    }

    #[test]
    fn top_p_samples_the_renormalized_nucleus() {
        // p = [0.15, 0.5, 0.05, 0.3]: the nucleus for top_p = 0.7 is {1, 3} (0.5 alone is
        // short of 0.7; 0.5 + 0.3 reaches it), renormalized to 0.625 / 0.375.
        let probs = [0.15f32, 0.5, 0.05, 0.3];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
        let want = [
            f32::NEG_INFINITY,
            (0.5f32 / 0.8).ln(),
            f32::NEG_INFINITY,
            (0.3f32 / 0.8).ln(),
        ];
        let counts = draw(&logits, &row(1.0, 0.7), 4000, &want);
        assert_eq!(counts[0] + counts[2], 0, "outside the nucleus: {counts:?}");
        assert!(
            (counts[1] as f64 / 4000.0 - 0.625).abs() < 0.03,
            "{counts:?}"
        );
        // A nucleus of exactly the top token's mass keeps only that token.
        let counts = draw(&logits, &row(1.0, 0.5), 200, &[0.0; 4]);
        assert_eq!(counts[1], 200);
        // top_p applies after temperature: at T = 2 the probabilities flatten to
        // sqrt(p) / Σ sqrt(p), and 0.7 then needs three tokens.
        let flat: Vec<f32> = probs.iter().map(|p| p.sqrt()).collect();
        let z: f32 = flat.iter().sum();
        let q: Vec<f32> = flat.iter().map(|f| f / z).collect();
        assert!(q[1] + q[3] < 0.7 && q[1] + q[3] + q[0] >= 0.7, "{q:?}");
        let kept = q[1] + q[3] + q[0];
        let want = [
            (q[0] / kept).ln(),
            (q[1] / kept).ln(),
            f32::NEG_INFINITY,
            (q[3] / kept).ln(),
        ];
        let counts = draw(&logits, &row(2.0, 0.7), 2000, &want);
        assert_eq!(counts[2], 0, "{counts:?}");
        assert!(counts[0] > 0, "{counts:?}");
    }

    #[test]
    fn top_n_lists_the_sampling_distribution() {
        let probs = [0.15f32, 0.5, 0.05, 0.3];
        let logits = Tensor::from_slice(&probs.map(|p| p.ln())).unsqueeze(0);
        let full = RowSampling::new(&[&row(1.0, 1.0)], Device::Cpu);
        let out = sample(&logits, &full, &[0.5], 3);
        let top: Vec<u32> = out.top[0].iter().map(|t| t.0).collect();
        assert_eq!(top, vec![1, 3, 0]);
        assert!((out.top[0][0].1 - 0.5f32.ln()).abs() < 1e-5);
        // Under a nucleus the alternatives are the renormalized kept tokens only.
        let nucleus = RowSampling::new(&[&row(1.0, 0.7)], Device::Cpu);
        let out = sample(&logits, &nucleus, &[0.5], 3);
        assert_eq!(out.top[0].len(), 2, "{:?}", out.top[0]);
        assert!((out.top[0][1].1 - (0.3f32 / 0.8).ln()).abs() < 1e-5);
    }

    #[test]
    fn top_p_logprobs_are_exact_in_generation() {
        // Each sampled token's logprob, recomputed from a full forward as the log of its
        // renormalized nucleus probability, must equal the recorded one.
        let p = tiny_policy(11);
        let prompt = vec![20u32, 21, 22];
        let (t, top_p) = (1.5f32, 0.6f32);
        let g = &p.generate(
            std::slice::from_ref(&prompt),
            &[GenParams {
                temperature: t,
                top_p,
                max_new_tokens: 12,
                seed: 3,
                stop_token_ids: vec![],
            }],
        )[0];
        let all: Vec<u32> = prompt.iter().chain(&g.tokens).copied().collect();
        let logits = p.forward(&ids(&all), &ones(all.len())).get(0);
        let probs = (logits / t as f64).softmax(-1, Kind::Double);
        let mut truncated = false;
        for (i, (&tok, &lp)) in g.tokens.iter().zip(&g.logprobs).enumerate() {
            let mut q = Vec::<f64>::try_from(probs.get((prompt.len() + i - 1) as i64)).unwrap();
            let mine = q[tok as usize];
            q.sort_by(|a, b| b.partial_cmp(a).unwrap());
            let (mut mass, mut kept) = (0.0, 0.0);
            for &x in &q {
                if mass >= top_p as f64 {
                    break;
                }
                mass += x;
                kept += x;
            }
            truncated |= kept < 0.999;
            let want = (mine / kept).ln();
            assert!((want - lp as f64).abs() < 1e-4, "step {i}: {want} vs {lp}");
        }
        assert!(truncated, "top_p never truncated; the test checks nothing");
    }

    #[test]
    fn stop_token_ends_only_its_row() {
        let p = tiny_policy(8);
        let prompt = vec![1u32, 2, 3];
        let free = &p.generate(std::slice::from_ref(&prompt), &[greedy(10)])[0];
        let stop = free.tokens[3];
        let first = free.tokens.iter().position(|&t| t == stop).unwrap();
        let mut with_stop = greedy(10);
        with_stop.stop_token_ids = vec![stop];
        let out = p.generate(&[prompt.clone(), prompt.clone()], &[with_stop, greedy(10)]);
        assert_eq!(out[0].finish, FinishReason::Stop);
        assert_eq!(out[0].tokens, free.tokens[..=first].to_vec());
        assert_eq!(*out[0].tokens.last().unwrap(), stop);
        assert_eq!(out[1].finish, FinishReason::Length);
        assert_eq!(out[1].tokens, free.tokens);
    }

    #[test]
    fn empty_and_overlong_prompts() {
        let p = tiny_policy(9); // max_position_embeddings 256
        let long: Vec<u32> = (0..400).map(|i| (i % 60) as u32).collect();
        let out = p.generate(
            &[vec![], long.clone(), vec![5]],
            &[greedy(4), greedy(6), greedy(0)],
        );
        assert_eq!(
            out[0],
            Generation {
                tokens: vec![],
                logprobs: vec![],
                finish: FinishReason::Length
            }
        );
        assert_eq!(out[1].tokens.len(), 6);
        assert!(out[2].tokens.is_empty());
        // The long prompt behaves as its last 250 tokens.
        let tail = &p.generate(&[long[400 - 250..].to_vec()], &[greedy(6)])[0];
        assert_eq!(out[1].tokens, tail.tokens);
        assert!(p.generate(&[], &[]).is_empty());
        // An absurd max_new_tokens is capped by max_position_embeddings instead of
        // allocating a cache for it.
        let huge = p.generate(&[vec![3]], &[greedy(usize::MAX)]);
        assert_eq!(huge[0].tokens.len(), 255);
    }
}
