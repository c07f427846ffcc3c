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

/// How rollouts and training interleave.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleMode {
    /// Generate every episode of an iteration, train, publish, wait until the workers
    /// loaded the new version, repeat: no policy lag.
    Sync,
    /// The next iteration's episodes are generated while the learner trains; an episode
    /// whose policy version lags the version training starts from by more than
    /// `max_staleness` is not trained on (counted and reported).
    Async,
}

/// How a dagger episode's turns are shared between student and teacher.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mixing {
    /// Per turn: the teacher's action is executed with probability β (`beta`).
    #[default]
    Turn,
    /// Per trajectory: the student acts for the first κ turns, the teacher finishes; κ of
    /// iteration i is `kappa_start + kappa_step × i` (capped at `max_turns`).
    Trajectory,
}

/// The training algorithm of a run (docs/architecture.md, "Objectives").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Turn-level DAgger: β from `beta`, cross-entropy on the teacher's label of every
    /// visited state.
    #[default]
    Dagger,
    /// Behaviour cloning: β = 1 every iteration, cross-entropy on the teacher's turns;
    /// with `bc_resolved_only`, only on resolved episodes (rejection sampling).
    Bc,
    /// Rejection fine-tuning: student-only episodes (β = 0), `samples_per_task` per task,
    /// cross-entropy on the executed turns of resolved episodes, format errors masked.
    Rft,
    /// Multi-turn DAPO: student-only episodes, `group_size` per task, sampled unbiased;
    /// group-normalised advantages of resolved + turn penalty; groups whose rewards are
    /// all equal are dropped and refilled; the learner's clipped token-level objective.
    Dapo,
    /// On-policy distillation: student-only episodes sampled unbiased; the teacher (an
    /// endpoint sharing the student's tokenizer) scores every student token, and the
    /// per-token advantage −(ℓ_student − ℓ_teacher) drives the learner's clipped
    /// policy-gradient objective (the reverse KL to the teacher goes down).
    Distill,
}

impl Algorithm {
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::Dagger => "dagger",
            Algorithm::Bc => "bc",
            Algorithm::Rft => "rft",
            Algorithm::Dapo => "dapo",
            Algorithm::Distill => "distill",
        }
    }
}

/// Schedule, episode and batching settings. Defaults suit the single-machine CPU run.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoordinatorConfig {
    /// What the run trains with: "dagger" (the default), "bc", "rft", "dapo" or "distill".
    pub algorithm: Algorithm,
    /// Iterations (rollout → train → publish).
    pub iterations: u32,
    /// dagger and bc: training episodes per iteration, drawn from the training tasks
    /// (rft and dapo size their iterations with `tasks_per_iteration` instead).
    pub episodes_per_iteration: u32,
    /// bc: train only on resolved episodes (rejection sampling).
    pub bc_resolved_only: bool,
    /// rft and dapo: distinct tasks per iteration; for dapo, the number of kept groups
    /// the batch is filled to.
    pub tasks_per_iteration: u32,
    /// rft: episodes per task (K).
    pub samples_per_task: u32,
    /// dapo: episodes per task (the group size G).
    pub group_size: u32,
    /// dapo: after the first round, at most this many rounds of new groups replace the
    /// groups dynamic sampling dropped.
    pub max_refill_rounds: u32,
    /// dapo: L_thr of the turn penalty (0 below L_thr turns, falling linearly to −1 at
    /// T_max = `max_turns`). Unset: no penalty.
    pub turn_penalty_start: Option<u32>,
    /// dapo: δ in Â = (R − mean_G)/(std_G + δ).
    pub advantage_eps: f64,
    /// dapo: keep format-error turns out of the policy-gradient loss (in the context
    /// only), as docs/architecture.md ("Objectives") asks of every loss. False trains them with the trajectory's
    /// advantage, so a negative reward pushes malformed replies down.
    pub mask_format_errors: bool,
    /// Student-only (β = 0) episodes per iteration on held-out tasks; never trained on.
    pub heldout_episodes: u32,
    /// Student-only episodes of the final evaluation, run on the held-out tasks after the
    /// last iteration's training (the last trained policy). Unset: `heldout_episodes`;
    /// 0: no final evaluation.
    pub final_heldout_episodes: Option<u32>,
    pub beta: BetaSchedule,
    /// dagger: turn-level mixing with `beta` (the default) or trajectory-level mixing
    /// with κ (`kappa_start`, `kappa_step`).
    pub mixing: Mixing,
    /// Trajectory-level mixing: the student's turns at iteration 0, and how many more
    /// each iteration (the teacher finishes every episode).
    pub kappa_start: u32,
    pub kappa_step: u32,
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
    /// Training episodes sample unbiased (temperature 1, no truncation), as RL objectives
    /// (DAPO, on-policy distillation) need; recorded per turn.
    pub unbiased_sampling: bool,
    /// A lease not renewed by heartbeat for this long is given to another worker.
    pub lease_timeout_s: f64,
    /// However often it is renewed, a lease ends this long after it was granted: an
    /// episode stuck with a live worker (a hung sandbox, a wedged teacher) cannot hold
    /// its iteration forever. Its slot goes to another attempt.
    pub lease_max_s: f64,
    /// Attempts one slot gets (a lease that expired, by either deadline, counts as one);
    /// after the last, the slot is recorded as failed (an unresolved SANDBOX_ERROR
    /// outcome, no training examples) and the iteration goes on.
    pub max_attempts: u32,
    /// Padded tokens per training batch (rows × longest row); with `batch_by_episode`,
    /// the episodes' packed size (each one's longest example plus its label tokens).
    pub batch_tokens: usize,
    /// Keep every episode's examples in one batch (episodes shuffled, the budget counting
    /// each episode's longest example plus its label tokens): what `[learner] packing =
    /// "trunk"` (or "tree") needs to compute a trajectory's shared prefix once.
    pub batch_by_episode: bool,
    /// Longest training example; longer contexts lose their oldest tokens.
    pub max_seq_len: usize,
    pub epochs_per_iteration: u32,
    pub max_steps_per_iteration: u32,
    /// Deadline of one training phase (the Train stream to the learner).
    pub train_timeout_s: f64,
    /// How long to wait for every live worker to load a new version.
    pub sync_timeout_s: f64,
    pub seed: u64,
    pub mode: ScheduleMode,
    /// Async mode: the largest policy lag (versions) of an episode still trained on.
    pub max_staleness: u64,
    /// On SIGTERM: how long episodes already leased may keep streaming before the
    /// coordinator stops (no new leases are handed out meanwhile).
    pub shutdown_grace_s: f64,
    /// `GET /metrics` requires `Authorization: Bearer <the run's token>` (Prometheus:
    /// `authorization: {credentials_file: ...}` in the scrape config). Needs a token.
    pub metrics_require_token: bool,
}

impl CoordinatorConfig {
    /// Episodes of the final evaluation (`final_heldout_episodes`, else `heldout_episodes`).
    pub fn final_eval_episodes(&self) -> u32 {
        self.final_heldout_episodes.unwrap_or(self.heldout_episodes)
    }

    /// The iteration number the final evaluation runs as: one past the last iteration.
    /// Its plan has held-out slots only.
    pub fn is_final_eval(&self, iteration: u32) -> bool {
        iteration >= self.iterations
    }
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            algorithm: Algorithm::Dagger,
            iterations: 3,
            episodes_per_iteration: 16,
            bc_resolved_only: false,
            tasks_per_iteration: 8,
            samples_per_task: 4,
            group_size: 4,
            max_refill_rounds: 2,
            turn_penalty_start: None,
            advantage_eps: 1e-6,
            mask_format_errors: true,
            heldout_episodes: 8,
            final_heldout_episodes: None,
            beta: BetaSchedule::default(),
            mixing: Mixing::Turn,
            kappa_start: 0,
            kappa_step: 1,
            aggregate: true,
            max_turns: 6,
            command_timeout_s: 20.0,
            observation_max_chars: 1500,
            max_new_tokens: 96,
            temperature: 1.0,
            eval_temperature: 0.0,
            unbiased_sampling: false,
            lease_timeout_s: 300.0,
            lease_max_s: 3600.0,
            max_attempts: 3,
            batch_tokens: 12288,
            batch_by_episode: false,
            max_seq_len: 2048,
            epochs_per_iteration: 2,
            max_steps_per_iteration: 60,
            train_timeout_s: 3600.0,
            sync_timeout_s: 120.0,
            seed: 0,
            mode: ScheduleMode::Sync,
            max_staleness: 1,
            shutdown_grace_s: 30.0,
            metrics_require_token: false,
        }
    }
}

impl CoordinatorConfig {
    /// Checks `[coordinator]`; the message names the field and what it needs.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.iterations == 0 {
            return Err(ConfigError::AtLeastOne("coordinator.iterations"));
        }
        if self.max_turns == 0 {
            return Err(ConfigError::AtLeastOne("coordinator.max_turns"));
        }
        if self.max_attempts == 0 {
            return Err(ConfigError::AtLeastOne("coordinator.max_attempts"));
        }
        for (field, value) in [
            ("coordinator.lease_timeout_s", self.lease_timeout_s),
            ("coordinator.lease_max_s", self.lease_max_s),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(ConfigError::Seconds { field, got: value });
            }
        }
        if self.batch_tokens < 16 || self.max_seq_len < 16 {
            return Err(ConfigError::TooFewTokens);
        }
        if !(0.0..=1.0).contains(&self.beta.start) || !(0.0..=1.0).contains(&self.beta.end) {
            return Err(ConfigError::Beta);
        }
        Ok(self.validate_algorithm()?)
    }

    /// Checks the algorithm's settings; the message names the field.
    pub fn validate_algorithm(&self) -> Result<(), AlgorithmConfigError> {
        if self.mixing == Mixing::Trajectory && self.algorithm != Algorithm::Dagger {
            return Err(AlgorithmConfigError::TrajectoryMixing {
                algorithm: self.algorithm.as_str(),
            });
        }
        match self.algorithm {
            Algorithm::Dagger | Algorithm::Bc => Ok(()),
            Algorithm::Rft if self.samples_per_task == 0 || self.tasks_per_iteration == 0 => {
                Err(AlgorithmConfigError::RftCounts)
            }
            Algorithm::Rft => Ok(()),
            Algorithm::Dapo if self.group_size < 2 => Err(AlgorithmConfigError::DapoGroupSize {
                got: self.group_size,
            }),
            Algorithm::Dapo if self.tasks_per_iteration == 0 => {
                Err(AlgorithmConfigError::DapoTasks)
            }
            Algorithm::Dapo if self.advantage_eps.is_nan() || self.advantage_eps <= 0.0 => {
                Err(AlgorithmConfigError::AdvantageEps {
                    got: self.advantage_eps,
                })
            }
            Algorithm::Dapo => Ok(()),
            Algorithm::Distill => Ok(()),
        }
    }
}

/// A `[coordinator]` setting the coordinator cannot run with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("{0} must be at least 1")]
    AtLeastOne(&'static str),
    #[error("coordinator.batch_tokens and coordinator.max_seq_len must be at least 16")]
    TooFewTokens,
    #[error("coordinator.beta.start and coordinator.beta.end must lie in [0, 1]")]
    Beta,
    #[error("{field} must be a positive number of seconds (got {got})")]
    Seconds { field: &'static str, got: f64 },
    #[error(transparent)]
    Algorithm(#[from] AlgorithmConfigError),
}

/// A `[coordinator]` setting the chosen algorithm cannot run with; the message names the
/// field and what it needs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AlgorithmConfigError {
    #[error(
        "coordinator.mixing = \"trajectory\" is a dagger variant; algorithm = \"{algorithm}\" \
         decides who acts by itself"
    )]
    TrajectoryMixing { algorithm: &'static str },
    #[error(
        "algorithm = \"rft\" needs coordinator.samples_per_task and \
         coordinator.tasks_per_iteration of at least 1"
    )]
    RftCounts,
    #[error(
        "algorithm = \"dapo\" needs coordinator.group_size of at least 2 (got {got}): \
         advantages are normalised within a group"
    )]
    DapoGroupSize { got: u32 },
    #[error("algorithm = \"dapo\" needs coordinator.tasks_per_iteration of at least 1")]
    DapoTasks,
    #[error("coordinator.advantage_eps must be positive (got {got})")]
    AdvantageEps { got: f64 },
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
