//! The DAgger dataset: one example per visited state, context h_t (attended to, not in
//! the loss) followed by the teacher's label y*_t (in the loss); the RFT dataset: one
//! example per resolved trajectory; and batching by a padded-token budget.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use tutor_proto::{Actor, TrainBatch, TrainExample, TurnRecord};

/// Builds the DAgger examples of one episode from its turns (sorted by turn index).
/// The history is rebuilt from the recorded token deltas and the executed tokens, so
/// nothing is re-tokenized. Turns whose teacher label is a format error are skipped;
/// contexts longer than `max_seq_len` lose their oldest tokens.
pub fn dagger_examples(
    episode_id: &str,
    turns: &[TurnRecord],
    max_seq_len: usize,
) -> Vec<TrainExample> {
    let mut history: Vec<u32> = Vec::new();
    let mut out = Vec::new();
    for t in turns {
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

/// Builds the RFT example of one episode (turns sorted by turn index): SFT on the
/// executed trajectory of a resolved episode. The example is the whole executed history
/// (context deltas and the executed actor's tokens of every turn); the loss mask is true
/// on the executed assistant tokens of turns that are not format errors (the executed
/// actor's flag, `student_format_error` or `teacher_format_error`) and false on context
/// tokens and on format-error turns, which stay in the context. One example per resolved
/// episode, none for an unresolved one. A history longer than `max_seq_len` is cut at
/// the end (the task statement and the early turns are kept); if no label token is
/// left, there is no example. `turn_index` is the last turn's index.
pub fn rft_examples(
    episode_id: &str,
    turns: &[TurnRecord],
    resolved: bool,
    max_seq_len: usize,
) -> Vec<TrainExample> {
    if !resolved {
        return Vec::new();
    }
    let mut tokens: Vec<u32> = Vec::new();
    let mut loss_mask: Vec<bool> = Vec::new();
    for t in turns {
        tokens.extend_from_slice(&t.context_delta_tokens);
        loss_mask.resize(tokens.len(), false);
        let (executed, format_error) = if t.executed == Actor::Student as i32 {
            (&t.student_tokens, t.student_format_error)
        } else {
            (&t.teacher_tokens, t.teacher_format_error)
        };
        tokens.extend_from_slice(executed);
        loss_mask.resize(tokens.len(), !format_error);
    }
    tokens.truncate(max_seq_len);
    loss_mask.truncate(max_seq_len);
    if !loss_mask.iter().any(|m| *m) {
        return Vec::new();
    }
    vec![TrainExample {
        tokens,
        loss_mask,
        episode_id: episode_id.to_string(),
        turn_index: turns.last().map(|t| t.turn_index).unwrap_or(0),
    }]
}

/// Groups examples into batches whose padded size (rows × longest row) stays within
/// `batch_tokens`, for `epochs` passes in a seeded order, at most `max_steps` batches.
/// The last batch is marked `publish`. Always returns at least one batch, so a phase
/// with no data still publishes a version.
pub fn make_batches(
    examples: &[TrainExample],
    iteration: u32,
    batch_tokens: usize,
    epochs: u32,
    max_steps: u32,
    seed: u64,
) -> Vec<TrainBatch> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ ((iteration as u64) << 32));
    let mut batches: Vec<Vec<TrainExample>> = Vec::new();
    'epochs: for _ in 0..epochs.max(1) {
        // Similar lengths together wastes less padding; the batch order is shuffled.
        let mut order: Vec<usize> = (0..examples.len()).collect();
        order.shuffle(&mut rng);
        order.sort_by_key(|&i| examples[i].tokens.len());
        let mut epoch_batches: Vec<Vec<TrainExample>> = Vec::new();
        let mut cur: Vec<TrainExample> = Vec::new();
        let mut cur_max = 0usize;
        for i in order {
            let len = examples[i].tokens.len();
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
    if batches.is_empty() {
        batches.push(Vec::new());
    }
    let n = batches.len();
    batches
        .into_iter()
        .enumerate()
        .map(|(i, examples)| TrainBatch {
            iteration,
            step: i as u32,
            examples,
            publish: i + 1 == n,
        })
        .collect()
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
        let empty = make_batches(&[], 0, 200, 2, 3, 1);
        assert_eq!(empty.len(), 1);
        assert!(empty[0].publish);
    }
}
