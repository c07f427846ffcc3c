//! What one iteration's rollouts produced, as the scheduler hands it to the driver:
//! the outcomes, the teacher/student turn counts and DAPO's group statistics.

use tutor_proto::{EpisodeOutcome, TurnRecord};

/// What one iteration's rollouts produced.
#[derive(Debug, Default, Clone)]
pub struct IterationRollouts {
    pub train: Vec<EpisodeOutcome>,
    pub eval: Vec<EpisodeOutcome>,
    /// Teacher labels (visited states with a usable label) this iteration.
    pub teacher_labels: u64,
    /// Turns where the student generated an action, and where it matched the teacher.
    pub student_turns: u64,
    pub agreements: u64,
    pub student_format_errors: u64,
    pub expired_leases: u64,
    /// Slots recorded as failed after `max_attempts` expired leases.
    pub failed_slots: u64,
    /// dapo: groups dynamic sampling kept and dropped, refill rounds run, and the mean
    /// reward of the training episodes.
    pub groups: GroupStats,
    pub refill_rounds: u32,
    pub mean_reward: f64,
    /// Turns of the training episodes, and those whose executed action was the student's.
    pub train_turns: u64,
    pub train_student_executed: u64,
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
    /// Counts the turns of a finished episode where the student generated an action:
    /// agreements with the teacher and format errors.
    /// Counts a training episode's turns and those the student's action was executed in.
    pub fn count_train_turns(&mut self, turns: &[TurnRecord]) {
        self.train_turns += turns.len() as u64;
        self.train_student_executed += turns
            .iter()
            .filter(|t| t.executed == tutor_proto::Actor::Student as i32)
            .count() as u64;
    }

    pub fn count_student_turns(&mut self, turns: &[TurnRecord]) {
        for t in turns.iter().filter(|t| t.student_generated) {
            self.student_turns += 1;
            self.agreements += t.agreement as u64;
            self.student_format_errors += t.student_format_error as u64;
        }
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
