//! The coordinator's typed configuration (section `[coordinator]` of a run config).

use serde::{Deserialize, Serialize};

/// How β (the probability that the teacher's action is executed) moves across
/// DAgger iterations. Iteration 0 with β = 1 is behaviour cloning.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BetaScheduleKind {
    /// β = start at every iteration.
    Constant,
    /// From `start` at iteration 0 to `end` at the last iteration.
    Linear,
    /// β_i = start · decay^i.
    Exponential,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BetaSchedule {
    pub kind: BetaScheduleKind,
    pub start: f64,
    pub end: f64,
    pub decay: f64,
}

impl Default for BetaSchedule {
    fn default() -> Self {
        Self {
            kind: BetaScheduleKind::Exponential,
            start: 1.0,
            end: 0.0,
            decay: 0.5,
        }
    }
}

impl BetaSchedule {
    /// β at iteration `i` of `n`, clamped to [0, 1].
    pub fn at(&self, i: u32, n: u32) -> f64 {
        let b = match self.kind {
            BetaScheduleKind::Constant => self.start,
            BetaScheduleKind::Linear => {
                if n <= 1 {
                    self.start
                } else {
                    self.start + (self.end - self.start) * i as f64 / (n - 1) as f64
                }
            }
            BetaScheduleKind::Exponential => self.start * self.decay.powi(i as i32),
        };
        b.clamp(0.0, 1.0)
    }
}

/// Schedule, episode and batching settings. Defaults suit the single-machine CPU run.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoordinatorConfig {
    /// DAgger iterations (rollout → train → publish).
    pub iterations: u32,
    /// Training episodes per iteration, drawn from the training tasks.
    pub episodes_per_iteration: u32,
    /// Student-only (β = 0) episodes per iteration on held-out tasks; never trained on.
    pub heldout_episodes: u32,
    pub beta: BetaSchedule,
    /// Train on the union of all iterations' data (DAgger's D = ∪ D_i) rather than the
    /// newest iteration only.
    pub aggregate: bool,
    pub max_turns: u32,
    pub command_timeout_s: f64,
    pub observation_max_chars: u32,
    /// Student sampling: tokens per assistant message and temperature.
    pub max_new_tokens: u32,
    pub temperature: f32,
    /// Temperature of the held-out student evaluation (0 = greedy).
    pub eval_temperature: f32,
    /// A lease not renewed by heartbeat for this long is given to another worker.
    pub lease_timeout_s: f64,
    /// Padded tokens per training batch (rows × longest row).
    pub batch_tokens: usize,
    /// Longest training example; longer contexts lose their oldest tokens.
    pub max_seq_len: usize,
    pub epochs_per_iteration: u32,
    pub max_steps_per_iteration: u32,
    /// Deadline of one training phase (the Train stream to the learner).
    pub train_timeout_s: f64,
    /// How long to wait for every live worker to load a new version.
    pub sync_timeout_s: f64,
    pub seed: u64,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            iterations: 3,
            episodes_per_iteration: 16,
            heldout_episodes: 8,
            beta: BetaSchedule::default(),
            aggregate: true,
            max_turns: 6,
            command_timeout_s: 20.0,
            observation_max_chars: 1500,
            max_new_tokens: 96,
            temperature: 1.0,
            eval_temperature: 0.0,
            lease_timeout_s: 300.0,
            batch_tokens: 12288,
            max_seq_len: 2048,
            epochs_per_iteration: 2,
            max_steps_per_iteration: 60,
            train_timeout_s: 3600.0,
            sync_timeout_s: 120.0,
            seed: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beta_schedules() {
        let e = BetaSchedule::default();
        assert_eq!(e.at(0, 3), 1.0);
        assert_eq!(e.at(2, 3), 0.25);
        let l = BetaSchedule {
            kind: BetaScheduleKind::Linear,
            ..Default::default()
        };
        assert_eq!(l.at(0, 3), 1.0);
        assert_eq!(l.at(1, 3), 0.5);
        assert_eq!(l.at(2, 3), 0.0);
        let c = BetaSchedule {
            kind: BetaScheduleKind::Constant,
            start: 0.3,
            ..Default::default()
        };
        assert_eq!(c.at(5, 9), 0.3);
    }
}
