//! Batched sampling with a KV cache, returning the sampled tokens and their logprobs.
//!
//! Prompts of different lengths are left-padded into one batch so that every row's next
//! token sits in the same (last) column. Each row gets its own positions (counted over its
//! real tokens), a mask hiding its padding, its own parameters and its own random stream,
//! so a row's output does not depend on which other rows share the batch.
//!
//! The logprob recorded for a sampled token is taken under the distribution it was
//! actually drawn from (softmax(logits / T)); DAPO's importance ratio needs exactly that
//! as ℓ_old. Sampling is plain: no top-k/top-p (the design forbids silent truncation).

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
    pub max_new_tokens: usize,
    /// Seeds this row's random stream; the same prompt and params give the same tokens.
    pub seed: u64,
    /// Sampling any of these ends the row (the stop token is kept in the output).
    pub stop_token_ids: Vec<u32>,
}

impl Default for GenParams {
    fn default() -> Self {
        GenParams {
            temperature: 1.0,
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
            // bounds the KV cache): at least one prompt token, then at most max_pos - 1 new.
            let max_new = p.max_new_tokens.min(max_pos.saturating_sub(1));
            if prompt.is_empty() || max_new == 0 {
                continue;
            }
            let keep = max_pos - max_new;
            let start = prompt.len().saturating_sub(keep);
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
    /// Returns the float32 logits for every row's next token, `[B, V]`.
    ///
    /// Prompts are prefilled one at a time with plain causal attention rather than as one
    /// padded batch: that needs no `[B, P, P]` mask (gigabytes for agent-length contexts),
    /// lets SDPA use its fused causal kernels, and makes a row's prefill independent of
    /// its batch mates. Identical prompts (a DAPO group) are computed once and copied.
    pub(crate) fn prefill(&self, prompts: &[&[u32]], cache: &mut KvCache) -> Tensor {
        let device = self.device();
        let kind = self.model.compute_kind();
        let p = prompts.iter().map(|x| x.len()).max().unwrap_or(0) as i64;
        let mut first_seen: HashMap<&[u32], usize> = HashMap::new();
        let mut logits: Vec<Tensor> = Vec::with_capacity(prompts.len());
        for (i, &prompt) in prompts.iter().enumerate() {
            let len = prompt.len() as i64;
            if let Some(&j) = first_seen.get(prompt) {
                cache.copy_row(j as i64, i as i64, p - len, len);
                let copied = logits[j].shallow_clone();
                logits.push(copied);
                continue;
            }
            first_seen.insert(prompt, i);
            let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
            let ids = Tensor::from_slice(&ids).view([1, len]).to_device(device);
            let positions = Tensor::arange(len, (Kind::Int64, device)).unsqueeze(0);
            let mut row_cache = KvCache::new(&self.config, 1, len, kind, device);
            let hidden =
                self.model
                    .hidden_states(&ids, &positions, &AttnMask::Causal, Some(&mut row_cache));
            logits.push(self.model.logits(&hidden.select(1, len - 1)));
            cache.write_row(i as i64, p - len, &row_cache);
        }
        cache.len = p;
        Tensor::cat(&logits, 0)
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

        // Per-row temperature for the whole run; greedy rows use 1 so their logprobs come
        // from the untempered distribution.
        let temps: Vec<f32> = rows
            .iter()
            .map(|r| {
                if r.params.temperature > 0.0 {
                    r.params.temperature
                } else {
                    1.0
                }
            })
            .collect();
        let temps = Tensor::from_slice(&temps).to_device(device).unsqueeze(1);
        let greedy: Vec<bool> = rows.iter().map(|r| r.params.temperature <= 0.0).collect();
        let greedy_t = Tensor::from_slice(&greedy).to_device(device);
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
            let (tokens, logprobs) = sample(&logits, &temps, &greedy_t, &uniforms);

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

/// Picks one token per row from float32 `logits` `[B, V]`: the argmax for greedy rows,
/// otherwise inverse-CDF sampling of softmax(logits / T) with the given uniform draw.
/// Sampling happens on the logits' device so that only B tokens and B logprobs cross to
/// the host; the CDF is built in float64 so that draws near 1 are not lost to rounding.
fn sample(
    logits: &Tensor,
    temps: &Tensor,
    greedy: &Tensor,
    uniforms: &[f64],
) -> (Vec<i64>, Vec<f32>) {
    let device = logits.device();
    let vocab = logits.size()[1];
    let logp = (logits / temps).log_softmax(-1, Kind::Float);
    let argmax = logits.argmax(-1, false);
    let cdf = logp.to_kind(Kind::Double).exp().cumsum(-1, Kind::Double);
    let total = cdf.narrow(1, vocab - 1, 1);
    let u = Tensor::from_slice(uniforms).to_device(device).unsqueeze(1) * total;
    // First index whose CDF exceeds u: zero-probability tokens can never be chosen.
    let drawn = u
        .searchsorted(&cdf, false, true, "right", None::<Tensor>)
        .squeeze_dim(1)
        .clamp_max(vocab - 1);
    let tokens = argmax.where_self(greedy, &drawn);
    let lp = logp.gather(1, &tokens.unsqueeze(1), false).squeeze_dim(1);
    let tokens = Vec::<i64>::try_from(tokens.to_device(Device::Cpu)).expect("token ids are int64");
    let lp = Vec::<f32>::try_from(lp.to_device(Device::Cpu)).expect("logprobs are float32");
    (tokens, lp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::tiny_policy;

    fn greedy(n: usize) -> GenParams {
        GenParams {
            temperature: 0.0,
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

    #[test]
    fn sampling_follows_the_distribution() {
        // A crafted 3-token distribution, drawn many times: empirical frequencies must match.
        let logits = Tensor::from_slice(&[0.0f32, (3.0f32).ln(), f32::NEG_INFINITY]).unsqueeze(0);
        let temps = Tensor::from_slice(&[1.0f32]).unsqueeze(1);
        let greedy = Tensor::from_slice(&[false]);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let mut counts = [0usize; 3];
        for _ in 0..2000 {
            let (t, lp) = sample(&logits, &temps, &greedy, &[rng.gen::<f64>()]);
            counts[t[0] as usize] += 1;
            let want = if t[0] == 0 {
                0.25f32.ln()
            } else {
                0.75f32.ln()
            };
            assert!((lp[0] - want).abs() < 1e-5);
        }
        assert_eq!(counts[2], 0, "a zero-probability token was sampled");
        assert!(
            (counts[1] as f64 / 2000.0 - 0.75).abs() < 0.04,
            "{counts:?}"
        );
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
