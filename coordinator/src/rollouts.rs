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
}

impl IterationRollouts {
    /// Counts the turns of a finished episode where the student generated an action:
    /// agreements with the teacher and format errors.
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
