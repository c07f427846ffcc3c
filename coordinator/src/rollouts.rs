//! What one iteration's rollouts produced, as the scheduler hands it to the driver:
//! the outcomes, the teacher/student turn counts and DAPO's group statistics.

use tutor_proto::{EpisodeOutcome, OutcomeStatus, TurnRecord};

/// What one iteration's rollouts produced.
#[derive(Debug, Default, Clone)]
pub struct IterationRollouts {
    pub train: Vec<EpisodeOutcome>,
    pub eval: Vec<EpisodeOutcome>,
    /// Teacher labels (visited states with a usable label) this iteration.
    pub teacher_labels: u64,
    /// Turns where the student generated an action; of those, the ones the teacher
    /// labelled too (`teacher_asked`; a lease with `labels_unused` asks it only where it
    /// acts), and where the two matched: agreement rates are over the labelled ones.
    pub student_turns: u64,
    pub labelled_student_turns: u64,
    pub agreements: u64,
    pub student_format_errors: u64,
    pub expired_leases: u64,
    /// Slots recorded as failed after `max_attempts` expired leases.
    pub failed_slots: u64,
    /// dapo: groups dynamic sampling kept and dropped, refill rounds run, and the mean
    /// reward of the training episodes.
    pub groups: GroupStats,
    pub refill_rounds: u32,
    /// `None` when no training episode had a verdict.
    pub mean_reward: Option<f64>,
    /// Turns of the training episodes, and those whose executed action was the student's.
    pub train_turns: u64,
    pub train_student_executed: u64,
    /// The student's tokens the teacher scored (on-policy distillation) with the sum of
    /// log π_student − log π_teacher over them: a Monte Carlo estimate of the reverse KL
    /// KL(π_student ‖ π_teacher), summed per token. Only tokens sampled from the policy's
    /// own distribution (temperature 1) count.
    pub kl_tokens: u64,
    pub kl_sum: f64,
    /// Turns of every finished episode (training and held-out) where the teacher was
    /// asked for an action, and the tokens of its replies: what a paid endpoint bills.
    pub teacher_calls: u64,
    pub teacher_tokens: u64,
}

/// Whether the episode ended without a verdict on the submission: the sandbox failed
/// (SANDBOX_ERROR, also a slot whose attempts ran out), the task's test patch does not
/// apply (TEST_PATCH_FAIL), no test spec fits it (NO_TEST_SPEC) or the image lacks its
/// environment (ENVIRONMENT_ERROR). Such an episode has no reward: DAPO leaves it out of
/// its group instead of counting a 0 (with the turn penalty, a broken task's group would
/// otherwise train on episode lengths). Failures a submission causes (APPLY_PATCH_FAIL,
/// TESTS_TIMEOUT, TESTS_ERROR, PATCH_TOO_LARGE) are graded: unresolved. Leaving an episode
/// out gives its actions no gradient, so causing one of these pays nothing.
pub fn is_ungraded(outcome: &EpisodeOutcome) -> bool {
    [
        OutcomeStatus::SandboxError,
        OutcomeStatus::TestPatchFail,
        OutcomeStatus::NoTestSpec,
        OutcomeStatus::EnvironmentError,
    ]
    .iter()
    .any(|&s| outcome.status == s as i32)
}

/// Share of `outcomes` that submitted and their mean number of turns (0 and 0 for none).
pub fn submit_rate_and_mean_turns(outcomes: &[EpisodeOutcome]) -> (f64, f64) {
    if outcomes.is_empty() {
        return (0.0, 0.0);
    }
    let n = outcomes.len() as f64;
    let submitted = outcomes.iter().filter(|o| o.submitted).count() as f64;
    let turns: u64 = outcomes.iter().map(|o| u64::from(o.num_turns)).sum();
    (submitted / n, turns as f64 / n)
}

impl IterationRollouts {
    /// Counts a training episode's turns and those the student's action was executed in.
    pub fn count_train_turns(&mut self, turns: &[TurnRecord]) {
        self.train_turns += turns.len() as u64;
        self.train_student_executed += turns
            .iter()
            .filter(|t| t.executed == tutor_proto::Actor::Student as i32)
            .count() as u64;
    }

    /// Counts the turns of a finished episode where the teacher was asked, and its tokens.
    pub fn count_teacher_calls(&mut self, turns: &[TurnRecord]) {
        for t in turns.iter().filter(|t| t.teacher_asked) {
            self.teacher_calls += 1;
            self.teacher_tokens += t.teacher_tokens.len() as u64;
        }
    }

    /// Counts the turns of a finished episode where the student generated an action:
    /// agreements with the teacher, format errors, and the reverse KL of the tokens the
    /// teacher scored.
    pub fn count_student_turns(&mut self, turns: &[TurnRecord]) {
        for t in turns.iter().filter(|t| t.student_generated) {
            self.student_turns += 1;
            self.labelled_student_turns += t.teacher_asked as u64;
            // Records of workers from before `teacher_asked` say agreement without it.
            self.agreements += (t.agreement && t.teacher_asked) as u64;
            self.student_format_errors += t.student_format_error as u64;
            // The estimator needs samples from the student's own distribution.
            let own_distribution = t.unbiased_sampling || t.sampling_temperature == 1.0;
            if own_distribution
                && !t.teacher_logprobs_of_student.is_empty()
                && t.teacher_logprobs_of_student.len() == t.student_logprobs.len()
            {
                let pairs = t
                    .student_logprobs
                    .iter()
                    .zip(&t.teacher_logprobs_of_student);
                let sum: f64 = pairs.map(|(s, q)| f64::from(*s) - f64::from(*q)).sum();
                if sum.is_finite() {
                    self.kl_tokens += t.student_logprobs.len() as u64;
                    self.kl_sum += sum;
                }
            }
        }
    }

    /// Finished episodes (training and held-out) that strict grading and the harness's
    /// rules resolve differently (one RESOLVED, the other not; two kinds of failure
    /// are no disagreement).
    pub fn grading_disagreements(&self) -> u64 {
        let resolved = OutcomeStatus::Resolved as i32;
        self.train
            .iter()
            .chain(&self.eval)
            .filter(|o| {
                o.harness_status != 0 && (o.harness_status == resolved) != (o.status == resolved)
            })
            .count() as u64
    }

    /// Training and held-out episodes that ended without a verdict on their submission
    /// ([`is_ungraded`]).
    pub fn ungraded(&self) -> (u64, u64) {
        let count = |o: &[EpisodeOutcome]| o.iter().filter(|o| is_ungraded(o)).count() as u64;
        (count(&self.train), count(&self.eval))
    }

    /// The mean per-token reverse KL estimate (nats per token) over the scored student
    /// tokens; `None` when the teacher scored none (the oracle cannot).
    pub fn reverse_kl(&self) -> Option<f64> {
        (self.kl_tokens > 0).then(|| self.kl_sum / self.kl_tokens as f64)
    }
}

/// How many groups dynamic sampling kept and dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupStats {
    /// Groups whose rewards differ: they carry gradient and are trained on.
    pub kept: u32,
    /// Groups whose rewards are all equal (every advantage 0): left out.
    pub dropped: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scored(student: &[f32], teacher: &[f32], temperature: f32, unbiased: bool) -> TurnRecord {
        TurnRecord {
            student_generated: true,
            student_tokens: vec![7; student.len()],
            student_logprobs: student.to_vec(),
            teacher_logprobs_of_student: teacher.to_vec(),
            sampling_temperature: temperature,
            unbiased_sampling: unbiased,
            ..Default::default()
        }
    }

    /// The reverse KL is the per-token mean of log π_s − log π_t over the scored tokens
    /// the student sampled from its own distribution; greedy or tempered turns and turns
    /// nobody scored do not count, and without any scored token there is no figure.
    #[test]
    fn reverse_kl_is_the_mean_log_ratio_of_scored_tokens() {
        let mut r = IterationRollouts::default();
        r.count_student_turns(&[TurnRecord {
            student_generated: true,
            student_logprobs: vec![-1.0],
            ..Default::default()
        }]);
        assert_eq!(r.reverse_kl(), None, "the oracle scores nothing");
        r.count_student_turns(&[
            // (−0.5 − −1.5) + (−1.0 − −1.0) = 1.0 over 2 tokens
            scored(&[-0.5, -1.0], &[-1.5, -1.0], 1.0, true),
            // −0.2 − −0.1 = −0.1 over 1 token (temperature 1, not flagged unbiased)
            scored(&[-0.2], &[-0.1], 1.0, false),
            // sampled at 0.7: not the student's distribution, left out
            scored(&[-0.1], &[-9.0], 0.7, false),
            // lengths differ: left out
            scored(&[-0.1, -0.2], &[-9.0], 1.0, true),
        ]);
        let kl = r.reverse_kl().unwrap();
        assert!((kl - 0.9 / 3.0).abs() < 1e-6, "{kl}");
        assert_eq!(r.kl_tokens, 3);
        assert_eq!(r.student_turns, 5);
    }

    /// Agreement is counted over the student's turns the teacher labelled: the turns of
    /// a lease whose labels nothing uses (no teacher call) do not dilute it.
    #[test]
    fn agreement_counts_only_labelled_student_turns() {
        let mut r = IterationRollouts::default();
        let turn = |asked: bool, agreement: bool| TurnRecord {
            student_generated: true,
            teacher_asked: asked,
            agreement,
            ..Default::default()
        };
        r.count_student_turns(&[turn(true, true), turn(true, false), turn(false, false)]);
        assert_eq!(
            (r.student_turns, r.labelled_student_turns, r.agreements),
            (3, 2, 1)
        );
    }

    /// Outcomes whose strict grade differs from the harness's are counted, held-out ones
    /// too; harness-graded outcomes (no harness_status) and agreements are not.
    #[test]
    fn grading_disagreements_count_strict_grades_the_harness_disputes() {
        use tutor_proto::OutcomeStatus::{Resolved, Unresolved};
        let outcome = |status: tutor_proto::OutcomeStatus, harness: i32| EpisodeOutcome {
            status: status as i32,
            harness_status: harness,
            ..Default::default()
        };
        let r = IterationRollouts {
            train: vec![
                outcome(Unresolved, Resolved as i32),
                outcome(Resolved, Resolved as i32),
                outcome(Unresolved, 0),
                outcome(Unresolved, tutor_proto::OutcomeStatus::TestsError as i32),
            ],
            eval: vec![outcome(Unresolved, Resolved as i32)],
            ..Default::default()
        };
        assert_eq!(r.grading_disagreements(), 2);
    }
}
