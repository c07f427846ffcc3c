//! The DAgger dataset: one example per visited state, context h_t (attended to, not in
//! the loss) followed by the teacher's label y*_t (in the loss); the RFT dataset: one
//! example per resolved trajectory; the DAPO policy-gradient example of a trajectory
//! (old log-probs and advantages per token); and batching by a padded-token budget,
//! with a batch whose message would be over the learner's gRPC limit split into several
//! steps (`split_oversized`). Each iteration's dataset and the staleness filter are in
//! `iterations`.

mod iterations;
mod spill;

pub use iterations::{EpisodeData, IterationDatasets};
pub use spill::{BatchItem, DatasetExample, ExampleSpill};

use prost::Message;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use tutor_proto::{Actor, LossKind, TrainBatch, TrainExample, TurnRecord};

/// Builds the DAgger examples of one episode from its turns (sorted by turn index).
/// The history is rebuilt from the recorded token deltas and the executed tokens, so
/// nothing is re-tokenized; a turn whose context the worker rebuilt (older observations
/// elided, `context_rebuilt`) starts the history afresh, so every context is the one the
/// student was given. Turns whose teacher label is a format error are skipped; contexts
/// still longer than `max_seq_len` lose their oldest tokens (as at generation).
pub fn dagger_examples(
    episode_id: &str,
    turns: &[TurnRecord],
    max_seq_len: usize,
) -> Vec<TrainExample> {
    let mut history: Vec<u32> = Vec::new();
    let mut out = Vec::new();
    for t in turns {
        if t.context_rebuilt {
            history.clear();
        }
        history.extend_from_slice(&t.context_delta_tokens);
        if !t.teacher_format_error && !t.teacher_tokens.is_empty() {
            let label = &t.teacher_tokens;
            let room = max_seq_len.saturating_sub(label.len()).max(1);
            let ctx = &history[history.len().saturating_sub(room)..];
            let label = &label[..label
                .len()
                .min(max_seq_len.saturating_sub(ctx.len()).max(1))];
            let mut tokens = Vec::with_capacity(ctx.len() + label.len());
            tokens.extend_from_slice(ctx);
            tokens.extend_from_slice(label);
            let mut loss_mask = vec![false; ctx.len()];
            loss_mask.resize(tokens.len(), true);
            out.push(TrainExample {
                tokens,
                loss_mask,
                episode_id: episode_id.to_string(),
                turn_index: t.turn_index,
                ..Default::default()
            });
        }
        let executed = if t.executed == Actor::Student as i32 {
            &t.student_tokens
        } else {
            &t.teacher_tokens
        };
        history.extend_from_slice(executed);
    }
    out
}

/// The episode's turns (sorted by turn index) cut where the worker rebuilt the context
/// (`context_rebuilt`: older observations elided): within a segment each turn's history
/// extends the previous one, so a whole-trajectory example is one segment's
/// concatenation, exactly the tokens the student saw. One segment when nothing was elided.
pub fn context_segments(turns: &[TurnRecord]) -> Vec<&[TurnRecord]> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, t) in turns.iter().enumerate() {
        if t.context_rebuilt && i > start {
            out.push(&turns[start..i]);
            start = i;
        }
    }
    if start < turns.len() {
        out.push(&turns[start..]);
    }
    out
}

/// Builds the RFT examples of one episode (turns sorted by turn index): SFT on the
/// executed trajectory of a resolved episode. The example is the whole executed history
/// (context deltas and the executed actor's tokens of every turn); the loss mask is true
/// on the executed assistant tokens of turns that are not format errors (the executed
/// actor's flag, `student_format_error` or `teacher_format_error`) and false on context
/// tokens and on format-error turns, which stay in the context. One example per resolved
/// episode and context segment (`context_segments`), none for an unresolved one. A
/// history longer than `max_seq_len` is cut at the end (the task statement and the early
/// turns are kept); if no label token is left, there is no example. `turn_index` is the
/// segment's last turn's index.
pub fn rft_examples(
    episode_id: &str,
    turns: &[TurnRecord],
    resolved: bool,
    max_seq_len: usize,
) -> Vec<TrainExample> {
    if !resolved {
        return Vec::new();
    }
    per_segment(turns, |s| rft_segment_example(episode_id, s, max_seq_len))
}

/// `example` of each context segment of an episode (`context_segments`), the segments
/// with none left out.
fn per_segment<'a>(
    turns: &'a [TurnRecord],
    example: impl Fn(&'a [TurnRecord]) -> Option<TrainExample>,
) -> Vec<TrainExample> {
    context_segments(turns)
        .into_iter()
        .filter_map(example)
        .collect()
}

/// A context segment's executed history as one sequence: each turn's context delta
/// (never trained), then the tokens the turn executed (the student's or the teacher's),
/// trained where `trained(turn)` says. `logprobs` (when asked for) holds a trained
/// turn's `student_logprobs` and 0 elsewhere. Cut at `max_seq_len`; `None` when no
/// trained token is left.
struct Executed {
    tokens: Vec<u32>,
    loss_mask: Vec<bool>,
    logprobs: Vec<f32>,
}

fn executed_history(
    turns: &[TurnRecord],
    max_seq_len: usize,
    with_logprobs: bool,
    trained: impl Fn(&TurnRecord) -> bool,
) -> Option<Executed> {
    let mut tokens: Vec<u32> = Vec::new();
    let mut loss_mask: Vec<bool> = Vec::new();
    let mut logprobs: Vec<f32> = Vec::new();
    for t in turns {
        tokens.extend_from_slice(&t.context_delta_tokens);
        let executed = if t.executed == Actor::Student as i32 {
            &t.student_tokens
        } else {
            &t.teacher_tokens
        };
        let train = trained(t);
        if with_logprobs {
            logprobs.resize(tokens.len(), 0.0);
            if train {
                logprobs.extend_from_slice(&t.student_logprobs);
            }
        }
        loss_mask.resize(tokens.len(), false);
        tokens.extend_from_slice(executed);
        loss_mask.resize(tokens.len(), train);
        if with_logprobs {
            logprobs.resize(tokens.len(), 0.0);
        }
    }
    tokens.truncate(max_seq_len);
    loss_mask.truncate(max_seq_len);
    logprobs.truncate(max_seq_len);
    loss_mask.iter().any(|m| *m).then_some(Executed {
        tokens,
        loss_mask,
        logprobs,
    })
}

/// `rft_examples` of one context segment: the loss on every executed action that
/// parsed, the student's or the teacher's.
fn rft_segment_example(
    episode_id: &str,
    turns: &[TurnRecord],
    max_seq_len: usize,
) -> Option<TrainExample> {
    let h = executed_history(turns, max_seq_len, false, |t| {
        if t.executed == Actor::Student as i32 {
            !t.student_format_error
        } else {
            !t.teacher_format_error
        }
    })?;
    Some(TrainExample {
        tokens: h.tokens,
        loss_mask: h.loss_mask,
        episode_id: episode_id.to_string(),
        turn_index: turns.last().map(|t| t.turn_index).unwrap_or(0),
        ..Default::default()
    })
}

/// Builds the policy-gradient example of one episode (turns sorted by turn index) for
/// DAPO: the whole executed history, like `rft_examples`, with the loss on the tokens the
/// student generated and executed, and `old_logprobs` set to the log-probs the sampler
/// recorded for them (0 elsewhere). Masked out, context kept: format-error turns (unless
/// `mask_format_errors` is false: then the reward's signal reaches them too), turns
/// the teacher executed (no sampling log-probs), and turns whose recorded log-probs do not
/// match their tokens one to one. `advantages` stays empty until the group is known (see
/// `with_advantage`). A history longer than `max_seq_len` is cut at the end; `None` if
/// no trained token is left. `turns` is one context segment (`context_segments`;
/// `policy_gradient_examples` does every segment of an episode).
pub fn policy_gradient_example(
    episode_id: &str,
    turns: &[TurnRecord],
    max_seq_len: usize,
    mask_format_errors: bool,
) -> Option<TrainExample> {
    let h = executed_history(turns, max_seq_len, true, |t| {
        t.executed == Actor::Student as i32
            && !(mask_format_errors && t.student_format_error)
            && t.student_logprobs.len() == t.student_tokens.len()
    })?;
    Some(TrainExample {
        tokens: h.tokens,
        loss_mask: h.loss_mask,
        episode_id: episode_id.to_string(),
        turn_index: turns.last().map(|t| t.turn_index).unwrap_or(0),
        old_logprobs: h.logprobs,
        advantages: Vec::new(),
        loss_kind: LossKind::Dapo as i32,
    })
}

/// `policy_gradient_example` of each context segment of an episode (one when nothing was
/// elided); the segments share the episode's reward.
pub fn policy_gradient_examples(
    episode_id: &str,
    turns: &[TurnRecord],
    max_seq_len: usize,
    mask_format_errors: bool,
) -> Vec<TrainExample> {
    per_segment(turns, |s| {
        policy_gradient_example(episode_id, s, max_seq_len, mask_format_errors)
    })
}

/// `distill_example` of each context segment of an episode.
pub fn distill_examples(
    episode_id: &str,
    turns: &[TurnRecord],
    max_seq_len: usize,
) -> Vec<TrainExample> {
    per_segment(turns, |s| distill_example(episode_id, s, max_seq_len))
}

/// On-policy distillation's example of an episode: the student's executed tokens with
/// their sampling log-probs, as for DAPO, and on each the per-token advantage
/// ℓ_teacher − ℓ_student = −(ℓ_student − ℓ_teacher) (the reverse-KL estimate), from the
/// teacher's scores recorded with the turn. Turns the teacher did not score (or scored
/// with a different length) stay in the context, untrained. None when nothing is trained.
/// `turns` is one context segment (`distill_examples` does every segment).
pub fn distill_example(
    episode_id: &str,
    turns: &[TurnRecord],
    max_seq_len: usize,
) -> Option<TrainExample> {
    let scored: Vec<TurnRecord> = turns
        .iter()
        .map(|t| {
            let mut t = t.clone();
            if t.teacher_logprobs_of_student.len() != t.student_tokens.len() {
                t.student_logprobs.clear(); // untrained (see policy_gradient_example)
            }
            t
        })
        .collect();
    let mut ex = policy_gradient_example(episode_id, &scored, max_seq_len, true)?;
    let mut advantages: Vec<f32> = Vec::with_capacity(ex.tokens.len());
    for t in &scored {
        advantages.resize(advantages.len() + t.context_delta_tokens.len(), 0.0);
        let by_student = t.executed == Actor::Student as i32;
        let trained = by_student
            && !t.student_format_error
            && !t.student_logprobs.is_empty()
            && t.student_logprobs.len() == t.student_tokens.len();
        if trained {
            advantages.extend(
                t.teacher_logprobs_of_student
                    .iter()
                    .zip(&t.student_logprobs)
                    .map(|(teacher, student)| teacher - student),
            );
        } else {
            let n = if by_student {
                t.student_tokens.len()
            } else {
                t.teacher_tokens.len()
            };
            advantages.resize(advantages.len() + n, 0.0);
        }
    }
    advantages.truncate(ex.tokens.len());
    debug_assert_eq!(advantages.len(), ex.tokens.len());
    ex.advantages = advantages;
    Some(ex)
}

/// The example with its trajectory's advantage on every trained token (0 elsewhere).
pub fn with_advantage(mut example: TrainExample, advantage: f64) -> TrainExample {
    example.advantages = example
        .loss_mask
        .iter()
        .map(|&m| if m { advantage as f32 } else { 0.0 })
        .collect();
    example
}

/// `make_batches` for prefix-shared packing (`[learner] packing = "tree"`): every episode's
/// examples stay together in one batch (its DAgger labels branch off one trajectory, which
/// the learner then computes once). Episodes are shuffled per epoch; a batch's budget
/// counts each episode's longest example once (about its packed size) plus the label
/// tokens of its other examples. An episode larger than the budget forms a batch alone.
pub fn make_episode_batches<E: BatchItem>(
    examples: &[E],
    iteration: u32,
    batch_tokens: usize,
    epochs: u32,
    max_steps: u32,
    seed: u64,
) -> Vec<Step<E>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ ((iteration as u64) << 32));
    // Episodes in first-appearance order, each with its examples and packed-size estimate.
    let mut index: std::collections::HashMap<&str, usize> = Default::default();
    let mut episodes: Vec<(Vec<usize>, usize)> = Vec::new();
    for (i, e) in examples.iter().enumerate() {
        let k = *index.entry(e.episode()).or_insert_with(|| {
            episodes.push((Vec::new(), 0));
            episodes.len() - 1
        });
        episodes[k].0.push(i);
    }
    for (members, size) in &mut episodes {
        let longest = members
            .iter()
            .map(|&i| examples[i].token_count())
            .max()
            .unwrap_or(0);
        let labels: usize = members.iter().map(|&i| examples[i].label_count()).sum();
        *size = longest + labels;
    }
    let mut batches: Vec<Vec<E>> = Vec::new();
    'epochs: for _ in 0..epochs.max(1) {
        let mut order: Vec<usize> = (0..episodes.len()).collect();
        order.shuffle(&mut rng);
        let mut cur: Vec<E> = Vec::new();
        let mut cur_size = 0usize;
        let mut epoch_batches: Vec<Vec<E>> = Vec::new();
        for k in order {
            let (members, size) = &episodes[k];
            if !cur.is_empty() && cur_size + size > batch_tokens {
                epoch_batches.push(std::mem::take(&mut cur));
                cur_size = 0;
            }
            cur_size += size;
            cur.extend(members.iter().map(|&i| examples[i].clone()));
        }
        if !cur.is_empty() {
            epoch_batches.push(cur);
        }
        for b in epoch_batches {
            if batches.len() as u32 >= max_steps.max(1) {
                break 'epochs;
            }
            batches.push(b);
        }
    }
    numbered(batches, iteration)
}

/// Groups examples into batches whose padded size (rows × longest row) stays within
/// `batch_tokens`, for `epochs` passes in a seeded order, at most `max_steps` batches.
/// The last batch is marked `publish`. Always returns at least one batch, so a phase
/// with no data still publishes a version.
pub fn make_batches<E: BatchItem>(
    examples: &[E],
    iteration: u32,
    batch_tokens: usize,
    epochs: u32,
    max_steps: u32,
    seed: u64,
) -> Vec<Step<E>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ ((iteration as u64) << 32));
    let mut batches: Vec<Vec<E>> = Vec::new();
    'epochs: for _ in 0..epochs.max(1) {
        // Similar lengths together wastes less padding; the batch order is shuffled.
        let mut order: Vec<usize> = (0..examples.len()).collect();
        order.shuffle(&mut rng);
        order.sort_by_key(|&i| examples[i].token_count());
        let mut epoch_batches: Vec<Vec<E>> = Vec::new();
        let mut cur: Vec<E> = Vec::new();
        let mut cur_max = 0usize;
        for i in order {
            let len = examples[i].token_count();
            let new_max = cur_max.max(len);
            if !cur.is_empty() && new_max * (cur.len() + 1) > batch_tokens {
                epoch_batches.push(std::mem::take(&mut cur));
                cur_max = 0;
            }
            cur_max = cur_max.max(len);
            cur.push(examples[i].clone());
        }
        if !cur.is_empty() {
            epoch_batches.push(cur);
        }
        epoch_batches.shuffle(&mut rng);
        for b in epoch_batches {
            if batches.len() as u32 >= max_steps.max(1) {
                break 'epochs;
            }
            batches.push(b);
        }
    }
    numbered(batches, iteration)
}

/// One optimizer step as the coordinator plans it: a `TrainBatch` whose examples may
/// still be in the examples' file (`DatasetExample`); it becomes the message as it is
/// sent (`Step::load`, or `Step::into_batch` for examples in memory).
#[derive(Debug, Clone, PartialEq)]
pub struct Step<E> {
    pub iteration: u32,
    pub step: u32,
    pub publish: bool,
    pub run_id: String,
    pub examples: Vec<E>,
}

impl<E> Step<E> {
    /// The message with every field but the examples.
    fn header(&self) -> TrainBatch {
        TrainBatch {
            iteration: self.iteration,
            step: self.step,
            examples: Vec::new(),
            publish: self.publish,
            run_id: self.run_id.clone(),
        }
    }
}

impl<E: BatchItem> Step<E> {
    /// Bytes of the `TrainBatch` message this step becomes.
    pub fn encoded_len(&self) -> usize {
        self.header().encoded_len()
            + self
                .examples
                .iter()
                .map(|e| example_field_len(e.encoded_bytes()))
                .sum::<usize>()
    }
}

impl Step<TrainExample> {
    pub fn into_batch(self) -> TrainBatch {
        let header = self.header();
        TrainBatch {
            examples: self.examples,
            ..header
        }
    }
}

impl Step<DatasetExample> {
    /// The message, its examples read from the examples' file (blocking).
    pub fn load(&self) -> std::io::Result<TrainBatch> {
        Ok(TrainBatch {
            examples: self
                .examples
                .iter()
                .map(DatasetExample::load)
                .collect::<std::io::Result<_>>()?,
            ..self.header()
        })
    }
}

/// What an example of `n` encoded bytes adds to a `TrainBatch`: tag, length, bytes.
fn example_field_len(n: usize) -> usize {
    1 + prost::length_delimiter_len(n) + n
}

/// The batches of an iteration as steps numbered in order, the last one marked
/// `publish`; at least one (empty) batch, so a phase with no data still publishes.
fn numbered<E>(mut batches: Vec<Vec<E>>, iteration: u32) -> Vec<Step<E>> {
    if batches.is_empty() {
        batches.push(Vec::new());
    }
    let n = batches.len();
    batches
        .into_iter()
        .enumerate()
        .map(|(i, examples)| Step {
            iteration,
            step: i as u32,
            examples,
            publish: i + 1 == n,
            // Set by the driver, which holds the run state.
            run_id: String::new(),
        })
        .collect()
}

/// A training example that no `TrainBatch` the learner accepts can carry.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "the training example of episode {episode_id} turn {turn_index} is {bytes} bytes \
     encoded: a TrainBatch holding it alone would be over the {max} bytes a message to the \
     learner may be (tutor_proto::MAX_MESSAGE_BYTES); lower coordinator.max_seq_len (an \
     example has at most that many tokens)"
)]
pub struct ExampleTooLarge {
    pub episode_id: String,
    pub turn_index: u32,
    pub bytes: usize,
    pub max: usize,
}

/// Splits every batch whose encoded message is over `max_bytes` (the learner's limit,
/// `tutor_proto::MAX_MESSAGE_BYTES`) into consecutive batches of about equal size, each
/// within it, every example in exactly one of them, in order. A TrainBatch is one
/// optimizer step and the learner has no step in several parts, so a split batch
/// becomes several smaller steps (as with a smaller `batch_tokens`); the batches are
/// numbered again in order, the last one marked `publish`. The split is a function of
/// the batches only, so an iteration's batches built again (a resend after a broken
/// stream or a restart) get the same steps. Set `run_id` before: it counts in the size.
pub fn split_oversized<E: BatchItem>(
    batches: Vec<Step<E>>,
    max_bytes: usize,
) -> Result<Vec<Step<E>>, ExampleTooLarge> {
    if batches.iter().all(|b| b.encoded_len() <= max_bytes) {
        return Ok(batches);
    }
    let mut out = Vec::with_capacity(batches.len() + 1);
    for mut batch in batches {
        let size = batch.encoded_len();
        if size <= max_bytes {
            out.push(batch);
            continue;
        }
        let examples = std::mem::take(&mut batch.examples);
        // The batch's fields besides the examples, at their longest (a step number
        // of five bytes, publish set).
        let header = TrainBatch {
            step: u32::MAX,
            publish: true,
            ..batch.header()
        }
        .encoded_len();
        let room = max_bytes.saturating_sub(header);
        // What each example adds to the message: tag, length, bytes.
        let sizes: Vec<usize> = examples
            .iter()
            .map(|e| example_field_len(e.encoded_bytes()))
            .collect();
        if let Some(i) = sizes.iter().position(|&n| n > room) {
            let e = &examples[i];
            return Err(ExampleTooLarge {
                episode_id: e.episode().to_string(),
                turn_index: e.turn(),
                bytes: e.encoded_bytes(),
                max: max_bytes,
            });
        }
        let total: usize = sizes.iter().sum();
        let target = total.div_ceil(total.div_ceil(room));
        let mut parts: Vec<Vec<E>> = vec![Vec::new()];
        let mut part_size = 0usize;
        for (e, n) in examples.into_iter().zip(sizes) {
            if part_size > 0 && (part_size + n > room || part_size >= target) {
                parts.push(Vec::new());
                part_size = 0;
            }
            part_size += n;
            parts.last_mut().expect("one part at least").push(e);
        }
        tracing::warn!(
            iteration = batch.iteration,
            step = batch.step,
            bytes = size,
            max_bytes,
            parts = parts.len(),
            "a batch over the learner's message limit is split into several steps (lower \
             coordinator.batch_tokens to avoid it)"
        );
        out.extend(parts.into_iter().map(|examples| Step {
            iteration: batch.iteration,
            step: batch.step,
            publish: batch.publish,
            run_id: batch.run_id.clone(),
            examples,
        }));
    }
    let n = out.len();
    for (i, b) in out.iter_mut().enumerate() {
        b.step = i as u32;
        b.publish = i + 1 == n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(
        i: u32,
        delta: &[u32],
        teacher: &[u32],
        student: &[u32],
        executed: Actor,
    ) -> TurnRecord {
        TurnRecord {
            turn_index: i,
            context_delta_tokens: delta.to_vec(),
            teacher_tokens: teacher.to_vec(),
            student_tokens: student.to_vec(),
            executed: executed as i32,
            ..Default::default()
        }
    }

    #[test]
    fn labels_branch_off_the_executed_history() {
        let turns = vec![
            turn(0, &[1, 2, 3], &[10, 11], &[20], Actor::Student),
            turn(1, &[4], &[12, 13], &[21, 22], Actor::Teacher),
            turn(2, &[5], &[14], &[], Actor::Teacher),
        ];
        let ex = dagger_examples("e", &turns, 100);
        assert_eq!(ex.len(), 3);
        assert_eq!(ex[0].tokens, vec![1, 2, 3, 10, 11]);
        assert_eq!(ex[0].loss_mask, vec![false, false, false, true, true]);
        // The student acted at turn 0: its tokens, not the teacher's, are the context.
        assert_eq!(ex[1].tokens, vec![1, 2, 3, 20, 4, 12, 13]);
        assert_eq!(
            ex[1].loss_mask,
            vec![false, false, false, false, false, true, true]
        );
        assert_eq!(ex[2].tokens, vec![1, 2, 3, 20, 4, 12, 13, 5, 14]);
        assert_eq!(ex[2].loss_mask.iter().filter(|m| **m).count(), 1);
    }

    /// A turn whose context the worker rebuilt (older observations elided) carries the
    /// whole history: the DAgger context restarts there, and the whole-trajectory
    /// objectives (RFT, DAPO) make one example per segment, each the exact tokens the
    /// student saw, with the segment's own actions trained.
    #[test]
    fn a_rebuilt_context_restarts_the_history() {
        let mut t2 = turn(2, &[1, 2, 3, 20, 8, 21, 5], &[14], &[22], Actor::Student);
        t2.context_rebuilt = true; // turn 0's observation (4) is now the note 8
        let mut turns = vec![
            turn(0, &[1, 2, 3], &[10], &[20], Actor::Student),
            turn(1, &[4], &[12], &[21], Actor::Student),
            t2,
            turn(3, &[6], &[15], &[23], Actor::Student),
        ];
        for t in &mut turns {
            t.student_logprobs = vec![-0.5; t.student_tokens.len()];
        }
        let ex = dagger_examples("e", &turns, 100);
        assert_eq!(ex[1].tokens, vec![1, 2, 3, 20, 4, 12]);
        assert_eq!(ex[2].tokens, vec![1, 2, 3, 20, 8, 21, 5, 14]);
        assert_eq!(ex[3].tokens, vec![1, 2, 3, 20, 8, 21, 5, 22, 6, 15]);

        let segments = context_segments(&turns);
        assert_eq!(segments.iter().map(|s| s.len()).collect::<Vec<_>>(), [2, 2]);
        let rft = rft_examples("e", &turns, true, 100);
        assert_eq!(rft.len(), 2);
        assert_eq!(rft[0].tokens, vec![1, 2, 3, 20, 4, 21]);
        assert_eq!(rft[0].turn_index, 1);
        // The actions inside the rebuilt context (20, 21) were trained in the first
        // segment; here they are context.
        assert_eq!(rft[1].tokens, vec![1, 2, 3, 20, 8, 21, 5, 22, 6, 23]);
        let trained: Vec<u32> = rft[1]
            .tokens
            .iter()
            .zip(&rft[1].loss_mask)
            .filter(|(_, m)| **m)
            .map(|(t, _)| *t)
            .collect();
        assert_eq!(trained, vec![22, 23]);
        let pg = policy_gradient_examples("e", &turns, 100, true);
        assert_eq!(pg.len(), 2);
        assert_eq!(pg[1].tokens, rft[1].tokens);
        assert_eq!(pg[1].old_logprobs.iter().filter(|x| **x != 0.0).count(), 2);
        // Nothing rebuilt: one segment, as before.
        assert_eq!(context_segments(&turns[..2]).len(), 1);
        assert!(context_segments(&[]).is_empty());
    }

    #[test]
    fn format_error_labels_are_skipped_and_long_contexts_cut() {
        let mut bad = turn(0, &[1, 2, 3, 4, 5, 6], &[9, 9], &[], Actor::Teacher);
        bad.teacher_format_error = true;
        let turns = vec![bad, turn(1, &[7], &[10, 11], &[], Actor::Teacher)];
        let ex = dagger_examples("e", &turns, 5);
        assert_eq!(ex.len(), 1);
        assert_eq!(ex[0].tokens, vec![9, 9, 7, 10, 11]);
        assert_eq!(ex[0].loss_mask, vec![false, false, false, true, true]);
    }

    #[test]
    fn rft_trains_on_executed_turns_without_format_errors() {
        let mut t1 = turn(1, &[4], &[12, 13], &[21, 22], Actor::Student);
        t1.student_format_error = true; // the executed reply was malformed: masked
        t1.teacher_format_error = false;
        let mut t2 = turn(2, &[5], &[14, 15], &[23], Actor::Teacher);
        t2.student_format_error = true; // not executed: irrelevant
        let turns = vec![
            turn(0, &[1, 2, 3], &[10, 11], &[20], Actor::Student),
            t1,
            t2,
            turn(3, &[6, 7], &[16], &[24, 25], Actor::Student),
        ];
        let ex = rft_examples("ep", &turns, true, 100);
        assert_eq!(ex.len(), 1);
        // delta(1 2 3) student(20) delta(4) student(21 22, format error) delta(5)
        // teacher(14 15) delta(6 7) student(24 25)
        assert_eq!(
            ex[0].tokens,
            vec![1, 2, 3, 20, 4, 21, 22, 5, 14, 15, 6, 7, 24, 25]
        );
        let f = false;
        let t = true;
        assert_eq!(
            ex[0].loss_mask,
            vec![f, f, f, t, f, f, f, f, t, t, f, f, t, t]
        );
        assert_eq!(ex[0].episode_id, "ep");
        assert_eq!(ex[0].turn_index, 3);
    }

    #[test]
    fn rft_skips_unresolved_and_label_free_trajectories() {
        let turns = vec![
            turn(0, &[1, 2, 3], &[10, 11], &[20], Actor::Student),
            turn(1, &[4], &[12], &[], Actor::Teacher),
        ];
        assert!(rft_examples("ep", &turns, false, 100).is_empty());
        assert!(rft_examples("ep", &[], true, 100).is_empty());
        // Teacher format error on the executed teacher turn: masked, context kept.
        let mut bad = turn(0, &[1, 2], &[9, 9], &[30], Actor::Teacher);
        bad.teacher_format_error = true;
        assert!(rft_examples("ep", std::slice::from_ref(&bad), true, 100).is_empty());
        let ex = rft_examples(
            "ep",
            &[bad, turn(1, &[3], &[10], &[], Actor::Teacher)],
            true,
            100,
        );
        assert_eq!(ex[0].tokens, vec![1, 2, 9, 9, 3, 10]);
        assert_eq!(
            ex[0].loss_mask,
            vec![false, false, false, false, false, true]
        );
    }

    #[test]
    fn rft_cuts_long_histories_at_the_end() {
        let turns = vec![
            turn(0, &[1, 2, 3], &[10, 11], &[], Actor::Teacher),
            turn(1, &[4, 5], &[12, 13], &[], Actor::Teacher),
        ];
        let ex = rft_examples("ep", &turns, true, 6);
        assert_eq!(ex[0].tokens, vec![1, 2, 3, 10, 11, 4]);
        assert_eq!(
            ex[0].loss_mask,
            vec![false, false, false, true, true, false]
        );
        // Cut before the first label token: no example.
        assert!(rft_examples("ep", &turns, true, 3).is_empty());
    }

    #[test]
    fn distill_example_has_the_reverse_kl_advantage_on_scored_student_tokens() {
        let mut t0 = turn(0, &[1, 2], &[10], &[20, 21], Actor::Student);
        t0.student_logprobs = vec![-0.5, -1.5];
        t0.teacher_logprobs_of_student = vec![-0.25, -3.0];
        let mut t1 = turn(1, &[4], &[12], &[22], Actor::Student);
        t1.student_logprobs = vec![-0.1]; // not scored: context only
        let mut t2 = turn(2, &[5], &[14], &[25, 26], Actor::Student);
        t2.student_logprobs = vec![-2.0, -0.7];
        t2.teacher_logprobs_of_student = vec![-1.0, -0.7];
        let ex = distill_example("ep", &[t0, t1, t2], 100).unwrap();
        assert_eq!(ex.tokens, vec![1, 2, 20, 21, 4, 22, 5, 25, 26]);
        let (f, t) = (false, true);
        assert_eq!(ex.loss_mask, vec![f, f, t, t, f, f, f, t, t]);
        assert_eq!(
            ex.advantages,
            vec![0.0, 0.0, 0.25, -1.5, 0.0, 0.0, 0.0, 1.0, 0.0]
        );
        assert_eq!(ex.old_logprobs[2..4], [-0.5, -1.5]);
        assert_eq!(ex.loss_kind, LossKind::Dapo as i32);
        // Nothing scored: nothing to train.
        let mut u = turn(0, &[1], &[10], &[20], Actor::Student);
        u.student_logprobs = vec![-0.5];
        assert!(distill_example("ep", &[u], 100).is_none());
    }

    #[test]
    fn policy_gradient_example_carries_the_sampling_logprobs_of_trained_tokens() {
        let mut t0 = turn(0, &[1, 2, 3], &[10, 11], &[20, 21], Actor::Student);
        t0.student_logprobs = vec![-0.5, -1.5];
        let mut t1 = turn(1, &[4], &[12], &[22, 23, 24], Actor::Student);
        t1.student_logprobs = vec![-0.1, -0.2, -0.3];
        t1.student_format_error = true; // masked, kept in the context
        let t2 = turn(2, &[5], &[14, 15], &[], Actor::Teacher); // no sampling log-probs
        let mut t3 = turn(3, &[6], &[16], &[25], Actor::Student);
        t3.student_logprobs = vec![-2.0];
        let ex = policy_gradient_example(
            "ep",
            &[t0.clone(), t1.clone(), t2.clone(), t3.clone()],
            100,
            true,
        )
        .unwrap();
        assert_eq!(
            ex.tokens,
            vec![1, 2, 3, 20, 21, 4, 22, 23, 24, 5, 14, 15, 6, 25]
        );
        let (f, t) = (false, true);
        assert_eq!(ex.loss_mask, vec![f, f, f, t, t, f, f, f, f, f, f, f, f, t]);
        let mut want = vec![0.0f32; 14];
        want[3] = -0.5;
        want[4] = -1.5;
        want[13] = -2.0;
        assert_eq!(ex.old_logprobs, want);
        assert_eq!(ex.loss_kind, LossKind::Dapo as i32);
        assert!(ex.advantages.is_empty());
        // With format errors trained on, turn 1's tokens and log-probs are in too.
        let all = policy_gradient_example("ep", &[t0, t1, t2, t3.clone()], 100, false).unwrap();
        assert_eq!(
            all.loss_mask,
            vec![f, f, f, t, t, f, t, t, t, f, f, f, f, t]
        );
        assert_eq!(&all.old_logprobs[6..9], &[-0.1, -0.2, -0.3]);
        let ex = with_advantage(ex, -0.75);
        let adv: Vec<f32> = ex
            .loss_mask
            .iter()
            .map(|&m| if m { -0.75 } else { 0.0 })
            .collect();
        assert_eq!(ex.advantages, adv);
        // Log-probs that do not match the tokens one to one: the turn is not trained.
        let mut bad = t3;
        bad.student_logprobs = vec![-1.0, -1.0];
        assert!(policy_gradient_example("ep", &[bad], 100, true).is_none());
        // Cut at the end before the first trained token: no example.
        let mut t0 = turn(0, &[1, 2, 3], &[], &[20], Actor::Student);
        t0.student_logprobs = vec![-1.0];
        assert!(policy_gradient_example("ep", std::slice::from_ref(&t0), 3, true).is_none());
        assert_eq!(
            policy_gradient_example("ep", &[t0], 4, true)
                .unwrap()
                .loss_mask,
            vec![f, f, f, t]
        );
    }

    #[test]
    fn episode_batches_keep_each_episodes_examples_together() {
        let mut examples = Vec::new();
        for ep in 0..6u32 {
            for t in 0..3u32 {
                let n = 20 + 10 * t as usize; // growing prefixes, 4 label tokens each
                let mut mask = vec![false; n];
                mask[n - 4..].fill(true);
                examples.push(TrainExample {
                    tokens: vec![1; n],
                    loss_mask: mask,
                    episode_id: format!("ep{ep}"),
                    turn_index: t,
                    ..Default::default()
                });
            }
        }
        // Each episode: longest 40 + 12 labels = 52; a budget of 110 holds two.
        let batches = make_episode_batches(&examples, 0, 110, 2, 100, 7);
        assert_eq!(batches.len(), 6, "2 epochs x 3 batches");
        let mut seen = std::collections::BTreeMap::new();
        for b in &batches {
            let eps: std::collections::BTreeSet<&str> =
                b.examples.iter().map(|e| e.episode_id.as_str()).collect();
            assert_eq!(eps.len(), 2);
            for ep in eps {
                let n = b.examples.iter().filter(|e| e.episode_id == ep).count();
                assert_eq!(n, 3, "an episode's examples are never split");
                *seen.entry(ep.to_string()).or_insert(0) += 1;
            }
        }
        assert!(seen.values().all(|&k| k == 2), "{seen:?}");
        assert!(batches.last().unwrap().publish);
        let capped = make_episode_batches(&examples, 0, 110, 2, 4, 7);
        assert_eq!(capped.len(), 4);
    }

    #[test]
    fn batches_respect_the_budget_and_publish_last() {
        let examples: Vec<TrainExample> = (1..=10)
            .map(|n| TrainExample {
                tokens: vec![1; n * 10],
                loss_mask: vec![true; n * 10],
                ..Default::default()
            })
            .collect();
        let batches = make_batches(&examples, 0, 200, 2, 100, 1);
        for b in &batches {
            let max = b.examples.iter().map(|e| e.tokens.len()).max().unwrap();
            assert!(max * b.examples.len() <= 200 || b.examples.len() == 1);
        }
        let total: usize = batches.iter().map(|b| b.examples.len()).sum();
        assert_eq!(total, 20);
        assert!(batches.last().unwrap().publish);
        assert_eq!(batches.iter().filter(|b| b.publish).count(), 1);
        let capped = make_batches(&examples, 0, 200, 2, 3, 1);
        assert_eq!(capped.len(), 3);
        let empty = make_batches::<TrainExample>(&[], 0, 200, 2, 3, 1);
        assert_eq!(empty.len(), 1);
        assert!(empty[0].publish);
    }

    /// Examples with DAPO's per-token floats, so size grows with length.
    fn long_example(episode: u32, turn: u32, n: usize) -> TrainExample {
        TrainExample {
            tokens: vec![50_000; n],
            loss_mask: vec![true; n],
            episode_id: format!("ep{episode}"),
            turn_index: turn,
            old_logprobs: vec![-1.5; n],
            advantages: vec![0.25; n],
            loss_kind: LossKind::Dapo as i32,
        }
    }

    /// A batch whose message is over the limit goes as several steps, each within it,
    /// every example exactly once and in order; the steps are numbered again and only
    /// the last publishes; batches within the limit are left as they are.
    #[test]
    fn oversized_batches_are_split_into_steps_under_the_limit() {
        let examples: Vec<TrainExample> = (0..40u32)
            .map(|i| long_example(i / 4, i % 4, 20 + (i as usize * 37) % 90))
            .collect();
        let mut batches = make_batches(&examples, 3, 1 << 20, 2, 100, 9);
        assert_eq!(batches.len(), 2, "one batch per epoch");
        for b in &mut batches {
            b.run_id = "run-1".into();
        }
        let limit = 4096;
        assert!(batches.iter().all(|b| b.encoded_len() > 3 * limit));
        let unchanged = split_oversized(batches.clone(), usize::MAX).unwrap();
        assert_eq!(unchanged, batches);

        let split = split_oversized(batches.clone(), limit).unwrap();
        assert!(split.len() > 6, "{} steps", split.len());
        for (i, b) in split.iter().enumerate() {
            assert_eq!(
                b.encoded_len(),
                b.clone().into_batch().encoded_len(),
                "a step's size is its message's"
            );
            assert!(
                b.encoded_len() <= limit,
                "step {i}: {} bytes",
                b.encoded_len()
            );
            assert_eq!(
                (b.iteration, b.step, b.run_id.as_str()),
                (3, i as u32, "run-1")
            );
            assert_eq!(b.publish, i + 1 == split.len());
            assert!(!b.examples.is_empty());
        }
        let sent: Vec<&TrainExample> = split.iter().flat_map(|b| &b.examples).collect();
        let built: Vec<&TrainExample> = batches.iter().flat_map(|b| &b.examples).collect();
        assert_eq!(sent, built, "every example once, in order");
        // About equal parts: none is a small remainder.
        let sizes: Vec<usize> = split.iter().map(|b| b.encoded_len()).collect();
        assert!(
            sizes.iter().all(|&s| s > limit / 3),
            "uneven parts: {sizes:?}"
        );

        // An example no batch within the limit can carry: the error names it.
        let huge = vec![long_example(7, 2, 2000)];
        let err = split_oversized(make_batches(&huge, 0, 1 << 20, 1, 1, 0), limit).unwrap_err();
        assert_eq!((err.episode_id.as_str(), err.turn_index), ("ep7", 2));
        assert!(err.to_string().contains("max_seq_len"), "{err}");
    }
}
