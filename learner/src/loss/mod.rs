//! The learner's objectives, one file each, with the trainer's step for each beside its
//! formula (docs/architecture.md, "Objectives"): `cross_entropy` (SFT, BC, DAgger, RFT:
//! `Trainer::step`), `dapo` (the clipped surrogate: `Trainer::dapo_step`) and `distill`
//! (the reverse-KL advantage of on-policy distillation, trained with DAPO's surrogate).
//! This module owns `StepExamples`, a batch's examples by objective, and
//! `Trainer::train_step`, which runs the step they ask for.
//!
//! Group advantages, dynamic sampling and the turn penalty are tensor-free: the
//! coordinator computes them (`tutor_coordinator::rewards`), the learner gets per-token
//! advantages in its examples.
//!
//! Tensor functions take per-token log-probabilities ℓ = log π(token | prefix) of the
//! sampled tokens as `[B, T]` tensors aligned with a `[B, T]` mask (1 on trained tokens,
//! 0 on context and padding). They compute in the kind of `logprobs` (use `Kind::Double`
//! where exactness matters, as the tests do); masks and advantages are converted to it.
//!
//! A new objective is a file here (its loss, its padded batch, its `impl Trainer` step
//! built on `Trainer::run_passes`) and a variant of `StepExamples`; `trainer` names no
//! objective.

pub mod chunked;
pub mod cross_entropy;
pub mod dapo;
pub mod distill;

pub use cross_entropy::{
    masked_cross_entropy, masked_nll_sum, packed_nll_sum, trunk_nll_sum, PaddedBatch,
};
pub use dapo::{dapo_clip_fraction, dapo_loss, token_logprobs, ClipFraction, RlBatch, RlExample};
pub use distill::reverse_kl_advantage;

use tutor_proto::{LossKind, TrainExample};

use crate::trainer::{rank_shard, StepError, StepReport, Trainer};

/// The examples of one training step, by objective.
#[derive(Debug, Clone, PartialEq)]
pub enum StepExamples {
    /// Token-level cross-entropy on the label tokens (SFT, BC, DAgger, RFT).
    CrossEntropy(Vec<(Vec<u32>, Vec<bool>)>),
    /// DAPO's clipped surrogate.
    Dapo(Vec<RlExample>),
}

impl StepExamples {
    /// Examples in the batch.
    pub fn len(&self) -> usize {
        match self {
            StepExamples::CrossEntropy(e) => e.len(),
            StepExamples::Dapo(e) => e.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sha256 (hex) of the batch's content: every example's token ids and loss mask,
    /// and for DAPO its advantages and old log-probs, in order. Two runs whose learners
    /// saw the same digest at a step trained on the same numbers there.
    pub fn digest(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        let tokens = |h: &mut Sha256, tokens: &[u32], mask: &[bool]| {
            h.update((tokens.len() as u64).to_le_bytes());
            for t in tokens {
                h.update(t.to_le_bytes());
            }
            h.update((mask.len() as u64).to_le_bytes());
            h.update(mask.iter().map(|&m| m as u8).collect::<Vec<u8>>());
        };
        match self {
            StepExamples::CrossEntropy(e) => {
                h.update(b"cross-entropy");
                for (t, m) in e {
                    tokens(&mut h, t, m);
                }
            }
            StepExamples::Dapo(e) => {
                h.update(b"dapo");
                for x in e {
                    tokens(&mut h, &x.tokens, &x.loss_mask);
                    for v in x.advantages.iter().chain(&x.old_logprobs) {
                        h.update(v.to_bits().to_le_bytes());
                    }
                }
            }
        }
        hex::encode(h.finalize())
    }

    /// This rank's share of the batch (`trainer::rank_shard`).
    pub fn shard(&self, rank: usize, world_size: usize) -> Self {
        match self {
            StepExamples::CrossEntropy(e) => {
                StepExamples::CrossEntropy(rank_shard(e, rank, world_size))
            }
            StepExamples::Dapo(e) => StepExamples::Dapo(rank_shard(e, rank, world_size)),
        }
    }

    /// The step a batch's examples ask for, for a model of `vocab_size` token ids. Every
    /// example of a batch must have the same loss kind, token ids below `vocab_size` and
    /// one loss-mask value per token, and a DAPO example one finite advantage and one
    /// finite old log-prob per token. What breaks a rule is refused with the episode and
    /// turn it came from, before anything reaches a tensor (an id outside the vocabulary
    /// would panic in the embedding lookup on the CPU, and corrupt the device on a GPU).
    pub fn from_proto_for_vocab(
        examples: Vec<TrainExample>,
        vocab_size: usize,
    ) -> Result<Self, BatchError> {
        Self::read(examples, Some(vocab_size))
    }

    /// `from_proto_for_vocab` without the vocabulary check: for a batch whose token ids
    /// were checked already (the other learner ranks get rank 0's batches after rank 0
    /// read them) or when no model is at hand.
    pub fn from_proto(examples: Vec<TrainExample>) -> Result<Self, BatchError> {
        Self::read(examples, None)
    }

    fn read(examples: Vec<TrainExample>, vocab_size: Option<usize>) -> Result<Self, BatchError> {
        let kind = examples
            .first()
            .map(|e| e.loss_kind)
            .unwrap_or(LossKind::CrossEntropy as i32);
        if let Some(e) = examples.iter().find(|e| e.loss_kind != kind) {
            return Err(BatchError::MixedKinds {
                first: kind,
                other: e.loss_kind,
                episode: e.episode_id.clone(),
                turn: e.turn_index,
            });
        }
        if let Some(vocab_size) = vocab_size {
            for e in &examples {
                if let Some(at) = e.tokens.iter().position(|&t| t as usize >= vocab_size) {
                    return Err(BatchError::OutOfVocabulary {
                        episode: e.episode_id.clone(),
                        turn: e.turn_index,
                        id: e.tokens[at],
                        at,
                        vocab_size,
                    });
                }
            }
        }
        match LossKind::try_from(kind) {
            Ok(LossKind::CrossEntropy) => examples
                .into_iter()
                .map(|e| {
                    if e.loss_mask.len() != e.tokens.len() {
                        return Err(BatchError::MaskLength {
                            episode: e.episode_id,
                            turn: e.turn_index,
                            tokens: e.tokens.len(),
                            mask: e.loss_mask.len(),
                        });
                    }
                    Ok((e.tokens, e.loss_mask))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Self::CrossEntropy),
            Ok(LossKind::Dapo) => examples
                .into_iter()
                .map(|e| {
                    let n = e.tokens.len();
                    if e.loss_mask.len() != n
                        || e.advantages.len() != n
                        || e.old_logprobs.len() != n
                    {
                        return Err(BatchError::DapoLengths {
                            episode: e.episode_id,
                            turn: e.turn_index,
                            tokens: n,
                            mask: e.loss_mask.len(),
                            advantages: e.advantages.len(),
                            old_logprobs: e.old_logprobs.len(),
                        });
                    }
                    for (what, values) in [
                        ("advantage", &e.advantages),
                        ("old log-prob", &e.old_logprobs),
                    ] {
                        if let Some(at) = values.iter().position(|v| !v.is_finite()) {
                            return Err(BatchError::NotFinite {
                                episode: e.episode_id,
                                turn: e.turn_index,
                                what,
                                at,
                                value: values[at],
                            });
                        }
                    }
                    Ok(RlExample {
                        tokens: e.tokens,
                        loss_mask: e.loss_mask,
                        advantages: e.advantages,
                        old_logprobs: e.old_logprobs,
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Self::Dapo),
            Err(_) => {
                let first = examples.first();
                Err(BatchError::UnknownKind {
                    kind,
                    episode: first.map(|e| e.episode_id.clone()).unwrap_or_default(),
                    turn: first.map_or(0, |e| e.turn_index),
                })
            }
        }
    }
}

impl Trainer {
    /// One optimizer step of the objective `examples` ask for.
    pub fn train_step(&mut self, examples: &StepExamples) -> Result<StepReport, StepError> {
        match examples {
            StepExamples::CrossEntropy(e) => self.step(e),
            StepExamples::Dapo(e) => self.dapo_step(e),
        }
    }
}

/// Why a `TrainBatch` cannot be trained on (the Train call answers INVALID_ARGUMENT).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BatchError {
    #[error(
        "a training batch mixes loss kinds ({first} and {other} at episode {episode} turn \
         {turn}): the coordinator sends one kind per batch"
    )]
    MixedKinds {
        first: i32,
        other: i32,
        episode: String,
        turn: u32,
    },
    #[error(
        "DAPO example of episode {episode} turn {turn} has {tokens} tokens but {mask} mask \
         values, {advantages} advantages and {old_logprobs} old log-probs (one each per token \
         expected)"
    )]
    DapoLengths {
        episode: String,
        turn: u32,
        tokens: usize,
        mask: usize,
        advantages: usize,
        old_logprobs: usize,
    },
    #[error("unknown loss kind {kind} in a training batch (episode {episode} turn {turn})")]
    UnknownKind {
        kind: i32,
        episode: String,
        turn: u32,
    },
    #[error(
        "the example of episode {episode} turn {turn} has {tokens} tokens but {mask} loss-mask \
         values (one per token expected)"
    )]
    MaskLength {
        episode: String,
        turn: u32,
        tokens: usize,
        mask: usize,
    },
    #[error(
        "the example of episode {episode} turn {turn} has a {what} that is not finite ({value} \
         at token {at}): nothing is trained on it"
    )]
    NotFinite {
        episode: String,
        turn: u32,
        what: &'static str,
        at: usize,
        value: f32,
    },
    #[error(
        "the example of episode {episode} turn {turn} has token id {id} (at token {at}), \
         outside the model's vocabulary of {vocab_size} ids: was it tokenized for another \
         model?"
    )]
    OutOfVocabulary {
        episode: String,
        turn: u32,
        id: u32,
        at: usize,
        vocab_size: usize,
    },
}

impl BatchError {
    /// The episode of the example that broke the rule (empty for an empty episode id).
    pub fn episode(&self) -> &str {
        match self {
            BatchError::MixedKinds { episode, .. }
            | BatchError::DapoLengths { episode, .. }
            | BatchError::UnknownKind { episode, .. }
            | BatchError::MaskLength { episode, .. }
            | BatchError::NotFinite { episode, .. }
            | BatchError::OutOfVocabulary { episode, .. } => episode,
        }
    }

    /// The turn of that example.
    pub fn turn(&self) -> u32 {
        match self {
            BatchError::MixedKinds { turn, .. }
            | BatchError::DapoLengths { turn, .. }
            | BatchError::UnknownKind { turn, .. }
            | BatchError::MaskLength { turn, .. }
            | BatchError::NotFinite { turn, .. }
            | BatchError::OutOfVocabulary { turn, .. } => *turn,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_changes_with_any_token_mask_or_order_and_only_then() {
        let a = (vec![1u32, 2, 3], vec![false, true, true]);
        let b = (vec![4u32, 5], vec![false, true]);
        let batch = StepExamples::CrossEntropy(vec![a.clone(), b.clone()]);
        let d = batch.digest();
        assert_eq!(d.len(), 64);
        assert_eq!(d, batch.clone().digest());
        let one_token = StepExamples::CrossEntropy(vec![(vec![1, 2, 4], a.1.clone()), b.clone()]);
        let one_mask = StepExamples::CrossEntropy(vec![(a.0.clone(), vec![true; 3]), b.clone()]);
        let swapped = StepExamples::CrossEntropy(vec![b.clone(), a.clone()]);
        // The same numbers split differently between examples.
        let regrouped = StepExamples::CrossEntropy(vec![
            (vec![1, 2, 3, 4], vec![false, true, true, false]),
            (vec![5], vec![true]),
        ]);
        let dapo = StepExamples::Dapo(vec![RlExample {
            tokens: a.0.clone(),
            loss_mask: a.1.clone(),
            advantages: vec![0.0, 1.0, 1.0],
            old_logprobs: vec![0.0, -0.5, -0.25],
        }]);
        let mut other = dapo.clone();
        if let StepExamples::Dapo(e) = &mut other {
            e[0].advantages[1] = -1.0;
        }
        let all = [
            d,
            one_token.digest(),
            one_mask.digest(),
            swapped.digest(),
            regrouped.digest(),
            dapo.digest(),
            other.digest(),
        ];
        for (i, x) in all.iter().enumerate() {
            for y in &all[i + 1..] {
                assert_ne!(x, y);
            }
        }
    }
}
