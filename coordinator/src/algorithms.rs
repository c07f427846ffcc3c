//! Per-algorithm rules of a run (dagger, bc, rft, dapo): β of an iteration, how many
//! samples each task gets, which training examples a finished episode gives, and DAPO's
//! groups (rewards, dynamic sampling with refill, advantages per token).

use std::collections::BTreeMap;

use tutor_proto::{EpisodeOutcome, OutcomeStatus, TrainExample, TurnRecord};

use crate::config::{Algorithm, CoordinatorConfig, Mixing};
use crate::dataset::{
    dagger_examples, distill_examples, policy_gradient_examples, rft_examples, with_advantage,
};
use crate::rewards::{group_advantages, keep_group, trajectory_reward};
pub use crate::rollouts::GroupStats;
use crate::rollouts::IterationRollouts;

/// One finished training episode as DAPO's batch building sees it.
#[derive(Debug, Clone, Copy)]
pub struct GroupedEpisode<'a> {
    /// The group (one task, G samples) the episode belongs to.
    pub group: u32,
    pub reward: f64,
    /// Its policy-gradient example (none when no token could be trained on).
    pub examples: &'a [TrainExample],
}

impl CoordinatorConfig {
    /// β of iteration `i` of `n`: the schedule for dagger, 1 for bc (the teacher acts),
    /// 0 for rft and dapo (the student acts).
    pub fn beta_at(&self, i: u32, n: u32) -> f64 {
        match self.algorithm {
            Algorithm::Dagger => self.beta.at(i, n),
            Algorithm::Bc => 1.0,
            Algorithm::Rft | Algorithm::Dapo | Algorithm::Distill => 0.0,
        }
    }

    /// Trajectory-level mixing: the student's turns (κ) in training episodes of iteration
    /// `i`, the teacher finishing. None: turn-level mixing with β (or no mixing: bc,
    /// rft, dapo).
    pub fn kappa_at(&self, i: u32) -> Option<u32> {
        (self.algorithm == Algorithm::Dagger && self.mixing == Mixing::Trajectory).then(|| {
            self.kappa_start
                .saturating_add(self.kappa_step.saturating_mul(i))
                .min(self.max_turns)
        })
    }

    /// Whether training sees every iteration's data (D = ∪ D_i) or the newest only.
    /// DAPO is on-policy: always the newest iteration.
    pub fn aggregates(&self) -> bool {
        !matches!(self.algorithm, Algorithm::Dapo | Algorithm::Distill) && self.aggregate
    }

    /// Whether training episodes sample unbiased (temperature 1, no truncation): forced
    /// for dapo, whose importance ratio needs the policy's own log-probs.
    pub fn samples_unbiased(&self) -> bool {
        self.unbiased_sampling || matches!(self.algorithm, Algorithm::Dapo | Algorithm::Distill)
    }

    /// Training episodes per task in an iteration: 1 (dagger, bc), K (rft), G (dapo).
    pub fn samples_per_group(&self) -> u32 {
        match self.algorithm {
            Algorithm::Dagger | Algorithm::Bc | Algorithm::Distill => 1,
            Algorithm::Rft => self.samples_per_task.max(1),
            Algorithm::Dapo => self.group_size.max(1),
        }
    }

    /// Tasks (groups) leased in an iteration's first round.
    pub fn first_round_groups(&self) -> u32 {
        match self.algorithm {
            Algorithm::Dagger | Algorithm::Bc | Algorithm::Distill => self.episodes_per_iteration,
            Algorithm::Rft | Algorithm::Dapo => self.tasks_per_iteration,
        }
    }

    /// The training examples of one finished episode (turns sorted by turn index). DAPO
    /// examples have no advantages yet: those need the episode's group (`dapo_examples`).
    pub fn episode_examples(
        &self,
        episode_id: &str,
        turns: &[TurnRecord],
        outcome: &EpisodeOutcome,
    ) -> Vec<TrainExample> {
        let resolved = is_resolved(outcome);
        match self.algorithm {
            Algorithm::Dagger => dagger_examples(episode_id, turns, self.max_seq_len),
            Algorithm::Bc if self.bc_resolved_only && !resolved => Vec::new(),
            Algorithm::Bc => dagger_examples(episode_id, turns, self.max_seq_len),
            Algorithm::Rft => rft_examples(episode_id, turns, resolved, self.max_seq_len),
            Algorithm::Dapo => policy_gradient_examples(
                episode_id,
                turns,
                self.max_seq_len,
                self.mask_format_errors,
            ),
            Algorithm::Distill => distill_examples(episode_id, turns, self.max_seq_len),
        }
    }

    /// DAPO's reward of an episode: resolved ∈ {0, 1} plus the turn penalty with
    /// L_thr = `turn_penalty_start` and T_max = `max_turns` (no penalty when unset).
    pub fn reward(&self, outcome: &EpisodeOutcome) -> f64 {
        let t_max = self.max_turns;
        let l_thr = self.turn_penalty_start.unwrap_or(t_max);
        trajectory_reward(is_resolved(outcome), outcome.num_turns, l_thr, t_max)
    }

    /// Dynamic sampling's refill: how many new groups the next round of an iteration
    /// leases, given the groups kept so far and the refill rounds already run. `None`:
    /// the iteration's rollouts are complete (not dapo, the batch is full, or the cap of
    /// `max_refill_rounds` is reached).
    pub fn refill_groups(&self, kept: u32, refills_done: u32) -> Option<u32> {
        if self.algorithm != Algorithm::Dapo
            || refills_done >= self.max_refill_rounds
            || kept >= self.tasks_per_iteration
        {
            return None;
        }
        Some(self.tasks_per_iteration - kept)
    }

    /// The algorithm's columns of a metrics.jsonl row: its name, and for dapo the groups
    /// dynamic sampling kept and dropped, the refill rounds and the mean reward.
    pub fn metrics_fields(
        &self,
        rollouts: &IterationRollouts,
    ) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        m.insert("algorithm".into(), self.algorithm.as_str().into());
        // Every algorithm: what the teacher was asked (the cost of a paid endpoint).
        m.insert("teacher_calls".into(), rollouts.teacher_calls.into());
        m.insert("teacher_tokens".into(), rollouts.teacher_tokens.into());
        // Every algorithm: submissions strict grading and the harness judged differently
        // (a patch that changes how tests are collected or reported: reward hacking).
        m.insert(
            "grading_disagreements".into(),
            rollouts.grading_disagreements().into(),
        );
        // Every algorithm: episodes without a verdict (a broken task, image or sandbox):
        // left out of DAPO's groups, unsolved in the held-out rate.
        let (train, heldout) = rollouts.ungraded();
        m.insert("ungraded_train".into(), train.into());
        m.insert("ungraded_heldout".into(), heldout.into());
        if self.algorithm == Algorithm::Dapo {
            m.insert("groups_kept".into(), rollouts.groups.kept.into());
            m.insert("groups_dropped".into(), rollouts.groups.dropped.into());
            m.insert("refill_rounds".into(), rollouts.refill_rounds.into());
            // null when no training episode had a verdict (not a reward of 0).
            m.insert("mean_reward".into(), rollouts.mean_reward.into());
        }
        m
    }
}

pub fn is_resolved(outcome: &EpisodeOutcome) -> bool {
    outcome.status == OutcomeStatus::Resolved as i32
}

/// Rewards of each group, by group id.
fn by_group(episodes: impl IntoIterator<Item = (u32, f64)>) -> BTreeMap<u32, Vec<f64>> {
    let mut groups: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
    for (g, r) in episodes {
        groups.entry(g).or_default().push(r);
    }
    groups
}

/// Dynamic sampling's count over (group, reward) pairs: groups whose rewards are not all
/// equal are kept.
pub fn group_stats(episodes: impl IntoIterator<Item = (u32, f64)>) -> GroupStats {
    let mut s = GroupStats::default();
    for rewards in by_group(episodes).values() {
        if keep_group(rewards) {
            s.kept += 1;
        } else {
            s.dropped += 1;
        }
    }
    s
}

/// DAPO's training examples of an iteration: the groups whose rewards are not all equal,
/// each episode's example with its group-normalised advantage Â = (R − mean_G)/(std_G +
/// δ) on every trained token; the dropped groups give nothing. Episodes come in any
/// order; the output is in group order, then input order.
pub fn dapo_examples(
    episodes: &[GroupedEpisode<'_>],
    delta: f64,
) -> (Vec<TrainExample>, GroupStats) {
    let mut members: BTreeMap<u32, Vec<&GroupedEpisode<'_>>> = BTreeMap::new();
    for e in episodes {
        members.entry(e.group).or_default().push(e);
    }
    let mut out = Vec::new();
    let mut stats = GroupStats::default();
    for group in members.values() {
        let rewards: Vec<f64> = group.iter().map(|e| e.reward).collect();
        if !keep_group(&rewards) {
            stats.dropped += 1;
            continue;
        }
        stats.kept += 1;
        let advantages = group_advantages(&rewards, rewards.len(), delta);
        for (e, a) in group.iter().zip(advantages) {
            out.extend(e.examples.iter().map(|x| with_advantage(x.clone(), a)));
        }
    }
    (out, stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tutor_proto::{Actor, LossKind};

    fn outcome(resolved: bool, turns: u32) -> EpisodeOutcome {
        EpisodeOutcome {
            num_turns: turns,
            status: if resolved {
                OutcomeStatus::Resolved
            } else {
                OutcomeStatus::Unresolved
            } as i32,
            ..Default::default()
        }
    }

    fn config(algorithm: Algorithm) -> CoordinatorConfig {
        CoordinatorConfig {
            algorithm,
            ..Default::default()
        }
    }

    /// Two turns, the student executing both (β = 0), sampling log-probs recorded.
    fn student_turns() -> Vec<TurnRecord> {
        let t = |i: u32, delta: Vec<u32>, tokens: Vec<u32>| TurnRecord {
            turn_index: i,
            context_delta_tokens: delta,
            teacher_tokens: vec![90, 91],
            student_tokens: tokens.clone(),
            student_logprobs: tokens.iter().map(|&x| -(x as f32) / 100.0).collect(),
            student_generated: true,
            executed: Actor::Student as i32,
            ..Default::default()
        };
        vec![t(0, vec![1, 2], vec![10, 11]), t(1, vec![3], vec![12])]
    }

    #[test]
    fn beta_aggregation_and_sampling_per_algorithm() {
        let dagger = config(Algorithm::Dagger);
        // The default is dagger, with the β schedule as before.
        assert_eq!(CoordinatorConfig::default().algorithm, Algorithm::Dagger);
        for i in 0..3 {
            assert_eq!(dagger.beta_at(i, 3), dagger.beta.at(i, 3));
            assert_eq!(config(Algorithm::Bc).beta_at(i, 3), 1.0);
            assert_eq!(config(Algorithm::Rft).beta_at(i, 3), 0.0);
            assert_eq!(config(Algorithm::Dapo).beta_at(i, 3), 0.0);
        }
        assert!(dagger.aggregates() && !dagger.samples_unbiased());
        let dapo = config(Algorithm::Dapo);
        assert!(!dapo.aggregates(), "DAPO trains on-policy data only");
        assert!(dapo.samples_unbiased(), "DAPO forces unbiased sampling");
        assert_eq!(
            (dagger.samples_per_group(), dagger.first_round_groups()),
            (1, dagger.episodes_per_iteration)
        );
        let rft = CoordinatorConfig {
            samples_per_task: 5,
            tasks_per_iteration: 3,
            ..config(Algorithm::Rft)
        };
        assert_eq!((rft.samples_per_group(), rft.first_round_groups()), (5, 3));
        let dapo = CoordinatorConfig {
            group_size: 6,
            tasks_per_iteration: 2,
            ..dapo
        };
        assert_eq!(
            (dapo.samples_per_group(), dapo.first_round_groups()),
            (6, 2)
        );
        assert!(dapo.validate_algorithm().is_ok());
        let bad = CoordinatorConfig {
            group_size: 1,
            ..dapo
        };
        assert!(bad
            .validate_algorithm()
            .unwrap_err()
            .to_string()
            .contains("group_size"));
    }

    #[test]
    fn kappa_grows_per_iteration_up_to_max_turns_for_trajectory_mixing_only() {
        let traj = CoordinatorConfig {
            mixing: Mixing::Trajectory,
            kappa_start: 1,
            kappa_step: 2,
            max_turns: 6,
            ..config(Algorithm::Dagger)
        };
        let kappas: Vec<Option<u32>> = (0..5).map(|i| traj.kappa_at(i)).collect();
        assert_eq!(kappas, vec![Some(1), Some(3), Some(5), Some(6), Some(6)]);
        assert!(traj.validate_algorithm().is_ok());
        assert_eq!(config(Algorithm::Dagger).kappa_at(2), None, "turn-level");
        let bad = CoordinatorConfig {
            algorithm: Algorithm::Rft,
            ..traj
        };
        assert!(bad
            .validate_algorithm()
            .unwrap_err()
            .to_string()
            .contains("mixing"));
    }

    #[test]
    fn examples_of_an_episode_per_algorithm() {
        let turns = student_turns();
        let (won, lost) = (outcome(true, 2), outcome(false, 2));
        // dagger and bc: one teacher label per turn, resolved or not.
        assert_eq!(
            config(Algorithm::Dagger)
                .episode_examples("e", &turns, &lost)
                .len(),
            2
        );
        let bc = config(Algorithm::Bc);
        assert_eq!(bc.episode_examples("e", &turns, &lost).len(), 2);
        let rejecting = CoordinatorConfig {
            bc_resolved_only: true,
            ..bc
        };
        assert!(rejecting.episode_examples("e", &turns, &lost).is_empty());
        assert_eq!(rejecting.episode_examples("e", &turns, &won).len(), 2);
        // rft: the executed trajectory of resolved episodes only.
        let rft = config(Algorithm::Rft);
        assert!(rft.episode_examples("e", &turns, &lost).is_empty());
        let ex = rft.episode_examples("e", &turns, &won);
        assert_eq!(ex.len(), 1);
        assert_eq!(ex[0].tokens, vec![1, 2, 10, 11, 3, 12]);
        assert_eq!(ex[0].loss_kind, LossKind::CrossEntropy as i32);
        // dapo: one policy-gradient example, resolved or not, with the old log-probs.
        let dapo = config(Algorithm::Dapo);
        let ex = dapo.episode_examples("e", &turns, &lost);
        assert_eq!(ex.len(), 1);
        assert_eq!(ex[0].loss_kind, LossKind::Dapo as i32);
        assert_eq!(ex[0].old_logprobs, vec![0.0, 0.0, -0.1, -0.11, 0.0, -0.12]);
    }

    #[test]
    fn rewards_follow_resolution_and_the_turn_penalty() {
        let mut c = CoordinatorConfig {
            max_turns: 10,
            ..config(Algorithm::Dapo)
        };
        // No penalty unless configured.
        assert_eq!(c.reward(&outcome(true, 10)), 1.0);
        assert_eq!(c.reward(&outcome(false, 10)), 0.0);
        // L_thr = 6, T_max = 10: (6 − 8)/4 = −0.5.
        c.turn_penalty_start = Some(6);
        assert_eq!(c.reward(&outcome(true, 8)), 0.5);
        assert_eq!(c.reward(&outcome(false, 8)), -0.5);
        assert_eq!(c.reward(&outcome(true, 5)), 1.0);
        assert_eq!(c.reward(&outcome(false, 10)), -1.0);
    }

    #[test]
    fn dapo_groups_drop_equal_rewards_and_attach_advantages_per_token() {
        let turns = student_turns();
        let dapo = config(Algorithm::Dapo);
        let example = dapo.episode_examples("e", &turns, &outcome(true, 2));
        let none: Vec<TrainExample> = Vec::new();
        // Group 0: rewards [1, 0] → Â = ±1 (δ → 0); group 1: [0, 0] dropped; group 2:
        // [1, 1] dropped; group 3: [0, 1, 1] (one episode with no example).
        let eps = [
            GroupedEpisode {
                group: 0,
                reward: 1.0,
                examples: &example,
            },
            GroupedEpisode {
                group: 1,
                reward: 0.0,
                examples: &example,
            },
            GroupedEpisode {
                group: 0,
                reward: 0.0,
                examples: &example,
            },
            GroupedEpisode {
                group: 1,
                reward: 0.0,
                examples: &example,
            },
            GroupedEpisode {
                group: 2,
                reward: 1.0,
                examples: &example,
            },
            GroupedEpisode {
                group: 2,
                reward: 1.0,
                examples: &example,
            },
            GroupedEpisode {
                group: 3,
                reward: 0.0,
                examples: &none,
            },
            GroupedEpisode {
                group: 3,
                reward: 1.0,
                examples: &example,
            },
            GroupedEpisode {
                group: 3,
                reward: 1.0,
                examples: &example,
            },
        ];
        let (out, stats) = dapo_examples(&eps, 1e-9);
        assert_eq!(
            stats,
            GroupStats {
                kept: 2,
                dropped: 2
            }
        );
        assert_eq!(group_stats(eps.iter().map(|e| (e.group, e.reward))), stats);
        assert_eq!(out.len(), 4, "2 from group 0, 2 from group 3");
        let mask = &out[0].loss_mask;
        let on_trained = |ex: &TrainExample| -> Vec<f32> {
            ex.advantages
                .iter()
                .zip(mask)
                .filter(|(_, m)| **m)
                .map(|(a, _)| *a)
                .collect()
        };
        // Per token: Â on every trained token, 0 on context.
        for ex in &out {
            assert_eq!(ex.advantages.len(), ex.tokens.len());
            for (a, m) in ex.advantages.iter().zip(&ex.loss_mask) {
                if !m {
                    assert_eq!(*a, 0.0);
                }
            }
        }
        let close = |v: Vec<f32>, want: f32| {
            assert!(v.iter().all(|a| (a - want).abs() < 1e-5), "{v:?} vs {want}");
            assert_eq!(v.len(), 3);
        };
        close(on_trained(&out[0]), 1.0);
        close(on_trained(&out[1]), -1.0);
        // Group 3: mean 2/3, std √2/3: the two resolved get (1/3)/(√2/3) = 1/√2 each.
        close(on_trained(&out[2]), std::f32::consts::FRAC_1_SQRT_2);
        close(on_trained(&out[3]), std::f32::consts::FRAC_1_SQRT_2);
        // The old log-probs travel unchanged.
        assert_eq!(out[0].old_logprobs, example[0].old_logprobs);
    }

    #[test]
    fn refill_until_the_batch_is_full_or_the_cap_is_hit() {
        let dapo = CoordinatorConfig {
            tasks_per_iteration: 4,
            max_refill_rounds: 2,
            ..config(Algorithm::Dapo)
        };
        assert_eq!(dapo.refill_groups(1, 0), Some(3));
        assert_eq!(dapo.refill_groups(3, 1), Some(1));
        assert_eq!(dapo.refill_groups(4, 1), None, "full");
        assert_eq!(dapo.refill_groups(2, 2), None, "cap reached");
        assert_eq!(config(Algorithm::Dagger).refill_groups(0, 0), None);
        assert_eq!(config(Algorithm::Rft).refill_groups(0, 0), None);
    }
}
