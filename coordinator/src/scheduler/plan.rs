//! The slots of one iteration: which task each planned episode samples, its group and
//! attempt, which attempt completes it, and DAPO's refill rounds (dynamic sampling).

use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::config::CoordinatorConfig;
use crate::episode_id::{EpisodeId, Purpose, SlotId};
use crate::rollouts::GroupStats;

/// One planned episode of the iteration.
pub struct Slot {
    pub purpose: Purpose,
    /// Index into the training or the held-out tasks, by `purpose`.
    pub task: usize,
    /// The samples of one task in one round share a group (dapo's G, rft's K).
    pub group: u32,
    /// The attempt its next lease is for (the attempt in its episode id).
    pub attempt: u32,
    /// Attempts whose lease was withdrawn before any worker had it (the coordinator
    /// could not record the grant): they took an id but spent nothing.
    withdrawn: u32,
    pub done: bool,
    /// The attempt whose outcome completes this slot: the first whose outcome reached
    /// the coordinator. Another attempt's outcome is acknowledged and dropped, so the
    /// store completes every slot exactly once.
    claimed_by: Option<EpisodeId>,
}

impl Slot {
    fn new(purpose: Purpose, task: usize, group: u32) -> Self {
        Self {
            purpose,
            task,
            group,
            attempt: 0,
            withdrawn: 0,
            done: false,
            claimed_by: None,
        }
    }

    /// May attempt `id` store the outcome of this slot? The first attempt to ask (or to
    /// complete it) may; every other is refused.
    pub fn claim(&mut self, id: EpisodeId) -> bool {
        match &self.claimed_by {
            Some(c) => c == &id,
            None if self.done => false,
            None => {
                self.claimed_by = Some(id);
                true
            }
        }
    }

    /// Attempts spent towards `max_attempts`: those whose lease expired.
    pub fn spent(&self) -> u32 {
        self.attempt - self.withdrawn
    }

    /// Gives up the current attempt's id without spending it: its lease was withdrawn
    /// before any worker had it. The next lease is the next attempt, so the withdrawn id
    /// is never leased twice.
    pub fn withdraw(&mut self) {
        self.attempt += 1;
        self.withdrawn += 1;
    }

    /// Marks the slot done with no attempt's outcome (its attempts ran out): every
    /// outcome that arrives later is refused.
    pub fn fail(&mut self) {
        self.done = true;
    }

    /// Marks the slot done by attempt `id` (unless another attempt claimed it first).
    pub fn complete(&mut self, id: EpisodeId) {
        self.done = true;
        self.claimed_by.get_or_insert(id);
    }
}

/// The iteration's slots: the same for a given seed and task list, so a restarted
/// coordinator maps stored episodes to the slots they were leased for.
pub struct Plan {
    pub iteration: u32,
    pub beta: f64,
    pub slots: Vec<Slot>,
    /// This iteration's shuffled training tasks; group k samples `train_order[k % len]`.
    train_order: Vec<usize>,
    groups_planned: u32,
    /// dapo: rounds of new groups leased after the first (dynamic sampling's refill).
    refills: u32,
    samples_per_group: u32,
    /// False before the first iteration is planned.
    planned: bool,
}

impl Plan {
    /// Before the first iteration: no slots.
    pub fn none() -> Self {
        Self {
            iteration: 0,
            beta: 1.0,
            slots: Vec::new(),
            train_order: Vec::new(),
            groups_planned: 0,
            refills: 0,
            samples_per_group: 1,
            planned: false,
        }
    }

    /// The first round of training groups (tasks in an order shuffled by the seed and
    /// the iteration), then the held-out slots.
    pub fn new(
        config: &CoordinatorConfig,
        iteration: u32,
        beta: f64,
        train_tasks: usize,
        heldout_tasks: usize,
    ) -> Self {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
            config.seed ^ (u64::from(iteration) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        );
        let mut order: Vec<usize> = (0..train_tasks).collect();
        order.shuffle(&mut rng);
        let mut plan = Self {
            iteration,
            beta,
            slots: Vec::new(),
            train_order: order,
            groups_planned: 0,
            refills: 0,
            samples_per_group: config.samples_per_group(),
            planned: true,
        };
        // The final evaluation (one past the last iteration) has held-out slots only.
        let heldout_episodes = if config.is_final_eval(iteration) {
            config.final_eval_episodes()
        } else {
            plan.add_train_groups(config.first_round_groups());
            config.heldout_episodes
        };
        // The same held-out tasks every iteration, so solve rates compare across iterations.
        for k in 0..heldout_episodes as usize {
            if heldout_tasks == 0 {
                break;
            }
            plan.slots
                .push(Slot::new(Purpose::Eval, k % heldout_tasks, 0));
        }
        plan
    }

    /// The planned iteration; None before the first.
    pub fn planned(&self) -> Option<u32> {
        self.planned.then_some(self.iteration)
    }

    /// Appends `n` groups of training slots (the next tasks of `train_order`, each
    /// sampled `samples_per_group` times) and returns the new slots. Deterministic given
    /// the plan, so a restarted coordinator that replays the same outcomes refills alike.
    fn add_train_groups(&mut self, n: u32) -> Vec<usize> {
        let mut added = Vec::new();
        if self.train_order.is_empty() {
            return added;
        }
        for _ in 0..n {
            let group = self.groups_planned;
            self.groups_planned += 1;
            let task = self.train_order[group as usize % self.train_order.len()];
            for _ in 0..self.samples_per_group {
                added.push(self.slots.len());
                self.slots.push(Slot::new(Purpose::Train, task, group));
            }
        }
        added
    }

    /// Dynamic sampling's refill (dapo), once every training slot is done: with too few
    /// groups `stats.kept`, a new round of groups, up to `max_refill_rounds`. Returns the
    /// new slots (none: no refill).
    pub fn refill(&mut self, config: &CoordinatorConfig, stats: GroupStats) -> Vec<usize> {
        let Some(n) = config.refill_groups(stats.kept, self.refills) else {
            return Vec::new();
        };
        let added = self.add_train_groups(n);
        if !added.is_empty() {
            self.refills += 1;
            tracing::info!(
                iteration = self.iteration,
                kept = stats.kept,
                dropped = stats.dropped,
                new_groups = n,
                round = self.refills,
                "dynamic sampling: refilling dropped groups"
            );
        }
        added
    }

    pub fn refills(&self) -> u32 {
        self.refills
    }

    pub fn train_done(&self) -> bool {
        self.slots
            .iter()
            .all(|s| s.done || s.purpose != Purpose::Train)
    }

    pub fn done_count(&self) -> usize {
        self.slots.iter().filter(|s| s.done).count()
    }

    pub fn all_done(&self) -> bool {
        self.slots.iter().all(|s| s.done)
    }

    /// The id of the next lease of `slot` (its current attempt).
    pub fn episode_id(&self, slot: usize, generation: u64) -> EpisodeId {
        let s = &self.slots[slot];
        EpisodeId {
            slot: SlotId {
                iteration: self.iteration,
                purpose: s.purpose,
                slot,
            },
            generation,
            attempt: s.attempt,
        }
    }

    /// The slot `id` names, if this plan has it (same iteration, index and purpose).
    pub fn slot(&self, id: &SlotId) -> Option<usize> {
        (id.iteration == self.iteration)
            .then_some(id.slot)
            .filter(|&k| self.slots.get(k).is_some_and(|s| s.purpose == id.purpose))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tutor_proto::{
        episode_event, Actor, EpisodeEvent, EpisodeLease, EpisodeOutcome, LossKind, OutcomeStatus,
        Task, TurnRecord,
    };

    use crate::config::{Algorithm, CoordinatorConfig};
    use crate::rollouts::GroupStats;
    use crate::scheduler::SchedulerHandle;

    /// A student turn (logprobs recorded) and the outcome of an episode.
    async fn finish(sched: &SchedulerHandle, worker: &str, lease: &EpisodeLease, resolved: bool) {
        let status = if resolved {
            OutcomeStatus::Resolved
        } else {
            OutcomeStatus::Unresolved
        };
        finish_with(sched, worker, lease, status, 1).await
    }

    /// `finish` with any status and number of turns.
    async fn finish_with(
        sched: &SchedulerHandle,
        worker: &str,
        lease: &EpisodeLease,
        status: OutcomeStatus,
        num_turns: u32,
    ) {
        sched
            .stored(EpisodeEvent {
                episode_id: lease.episode_id.clone(),
                worker_id: worker.to_string(),
                event: Some(episode_event::Event::Turn(TurnRecord {
                    context_delta_tokens: vec![1, 2, 3],
                    student_tokens: vec![7, 8],
                    student_logprobs: vec![-0.5, -0.25],
                    student_generated: true,
                    executed: Actor::Student as i32,
                    ..Default::default()
                })),
            })
            .await;
        sched
            .stored(EpisodeEvent {
                episode_id: lease.episode_id.clone(),
                worker_id: worker.to_string(),
                event: Some(episode_event::Event::Outcome(EpisodeOutcome {
                    num_turns,
                    status: status as i32,
                    ..Default::default()
                })),
            })
            .await;
    }

    /// Leases until `n` leases came back (the refill rounds appear as leases too).
    async fn lease_n(sched: &SchedulerHandle, worker: &str, n: usize) -> Vec<EpisodeLease> {
        let mut out = Vec::new();
        for _ in 0..200 {
            out.extend(sched.lease(worker.to_string(), 8).await.unwrap().leases);
            if out.len() >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(out.len(), n, "leases: {out:?}");
        // Nothing more is handed out before these finish.
        assert!(sched
            .lease(worker.to_string(), 8)
            .await
            .unwrap()
            .leases
            .is_empty());
        out
    }

    #[tokio::test]
    async fn dapo_refills_dropped_groups_until_the_cap_and_trains_the_kept_ones() {
        let config = CoordinatorConfig {
            algorithm: Algorithm::Dapo,
            group_size: 2,
            tasks_per_iteration: 2,
            max_refill_rounds: 2,
            heldout_episodes: 0,
            temperature: 0.7,
            ..Default::default()
        };
        let tasks: Vec<Task> = (0..5)
            .map(|i| Task {
                instance_id: format!("t{i}"),
                ..Default::default()
            })
            .collect();
        let sched = SchedulerHandle::spawn(config, tasks, vec![]);
        let (worker, _) = sched.register("w".into(), 8).await.unwrap();
        let runner = sched.clone();
        let iteration = tokio::spawn(async move { runner.run_iteration(0, 0.0).await });

        // Round 1: 2 groups × 2 samples. Group 0 gets rewards [1, 0] (kept), group 1
        // [0, 0] (dropped): one group is missing.
        let round1 = lease_n(&sched, &worker, 4).await;
        for l in &round1 {
            let s = l.sampling.as_ref().unwrap();
            assert!(s.unbiased, "dapo forces unbiased sampling: {l:?}");
            assert_eq!(l.beta, 0.0);
        }
        // Both samples of a group are the same task.
        assert_eq!(round1[0].task, round1[1].task);
        assert_eq!(round1[2].task, round1[3].task);
        for (l, resolved) in round1.iter().zip([true, false, false, false]) {
            finish(&sched, &worker, l, resolved).await;
        }
        // Round 2 (refill 1): one new group of 2, rewards [0, 0]: dropped again.
        let round2 = lease_n(&sched, &worker, 2).await;
        assert_eq!(round2[0].task, round2[1].task);
        for l in &round2 {
            finish(&sched, &worker, l, false).await;
        }
        // Round 3 (refill 2 = the cap): rewards [1, 1], dropped; no round 4.
        let round3 = lease_n(&sched, &worker, 2).await;
        for l in &round3 {
            finish(&sched, &worker, l, true).await;
        }
        let rollouts = tokio::time::timeout(Duration::from_secs(5), iteration)
            .await
            .expect("the iteration ends at the refill cap")
            .unwrap()
            .unwrap();
        assert_eq!(rollouts.train.len(), 8);
        assert_eq!(
            rollouts.groups,
            GroupStats {
                kept: 1,
                dropped: 3
            }
        );
        assert_eq!(rollouts.refill_rounds, 2);
        assert!((rollouts.mean_reward.unwrap() - 3.0 / 8.0).abs() < 1e-12);

        // Training data: only group 0, its two episodes with Â = ±1 on their tokens.
        let examples = sched.examples(0, false).await;
        assert_eq!(examples.len(), 2);
        let ids: Vec<&str> = examples.iter().map(|e| e.episode_id.as_str()).collect();
        assert_eq!(
            ids,
            vec![round1[0].episode_id.as_str(), round1[1].episode_id.as_str()]
        );
        for (e, sign) in examples.iter().zip([1.0f32, -1.0]) {
            assert_eq!(e.loss_kind, LossKind::Dapo as i32);
            assert_eq!(e.tokens, vec![1, 2, 3, 7, 8]);
            assert_eq!(e.old_logprobs, vec![0.0, 0.0, 0.0, -0.5, -0.25]);
            let want: Vec<f32> = [0.0, 0.0, 0.0, sign, sign].to_vec();
            for (a, w) in e.advantages.iter().zip(&want) {
                assert!((a - w).abs() < 1e-4, "{:?} vs {want:?}", e.advantages);
            }
        }
    }

    /// Episodes without a verdict (a broken sandbox, task or image) are no reward of 0:
    /// they leave their group. A group of [resolved, unresolved, SANDBOX_ERROR] trains its
    /// two graded episodes with Â = ±1; a broken task's group, whose episodes differ only
    /// in length, would train on the turn penalty if counted, and is dropped instead.
    #[tokio::test]
    async fn dapo_leaves_episodes_without_a_verdict_out_of_their_groups() {
        let config = CoordinatorConfig {
            algorithm: Algorithm::Dapo,
            group_size: 3,
            tasks_per_iteration: 2,
            max_refill_rounds: 0,
            heldout_episodes: 0,
            max_turns: 10,
            turn_penalty_start: Some(2),
            ..Default::default()
        };
        let tasks: Vec<Task> = (0..2)
            .map(|i| Task {
                instance_id: format!("t{i}"),
                ..Default::default()
            })
            .collect();
        let sched = SchedulerHandle::spawn(config, tasks, vec![]);
        let (worker, _) = sched.register("w".into(), 8).await.unwrap();
        let runner = sched.clone();
        let iteration = tokio::spawn(async move { runner.run_iteration(0, 0.0).await });
        let leases = lease_n(&sched, &worker, 6).await;
        let ended = [
            (OutcomeStatus::Resolved, 1),
            (OutcomeStatus::Unresolved, 1),
            (OutcomeStatus::SandboxError, 1),
            // The broken task: every episode NO_TEST_SPEC / ENVIRONMENT_ERROR /
            // TEST_PATCH_FAIL, after different numbers of turns.
            (OutcomeStatus::NoTestSpec, 2),
            (OutcomeStatus::EnvironmentError, 6),
            (OutcomeStatus::TestPatchFail, 9),
        ];
        for (l, (status, turns)) in leases.iter().zip(ended) {
            finish_with(&sched, &worker, l, status, turns).await;
        }
        let rollouts = iteration.await.unwrap().unwrap();
        assert_eq!(
            rollouts.groups,
            GroupStats {
                kept: 1,
                dropped: 0
            },
            "the broken task's group has no graded episode"
        );
        assert_eq!(rollouts.ungraded(), (4, 0));
        assert!(
            (rollouts.mean_reward.unwrap() - 0.5).abs() < 1e-12,
            "{:?}",
            rollouts.mean_reward
        );
        let examples = sched.examples(0, false).await;
        let ids: Vec<&str> = examples.iter().map(|e| e.episode_id.as_str()).collect();
        assert_eq!(
            ids,
            vec![leases[0].episode_id.as_str(), leases[1].episode_id.as_str()]
        );
        for (e, sign) in examples.iter().zip([1.0f32, -1.0]) {
            assert!((e.advantages[4] - sign).abs() < 1e-4, "{:?}", e.advantages);
        }
    }

    #[tokio::test]
    async fn dapo_stops_refilling_once_the_batch_is_full() {
        let config = CoordinatorConfig {
            algorithm: Algorithm::Dapo,
            group_size: 3,
            tasks_per_iteration: 2,
            max_refill_rounds: 5,
            heldout_episodes: 0,
            ..Default::default()
        };
        let sched = SchedulerHandle::spawn(config, vec![Task::default()], vec![]);
        let (worker, _) = sched.register("w".into(), 8).await.unwrap();
        let runner = sched.clone();
        let iteration = tokio::spawn(async move { runner.run_iteration(0, 0.0).await });
        // Round 1: both groups mixed → kept; no refill.
        let leases = lease_n(&sched, &worker, 6).await;
        for (l, r) in leases.iter().zip([true, false, false, false, true, true]) {
            finish(&sched, &worker, l, r).await;
        }
        let rollouts = iteration.await.unwrap().unwrap();
        assert_eq!(
            rollouts.groups,
            GroupStats {
                kept: 2,
                dropped: 0
            }
        );
        assert_eq!(rollouts.refill_rounds, 0);
        assert_eq!(sched.examples(0, false).await.len(), 6);
    }

    #[tokio::test]
    async fn rft_samples_each_task_k_times_and_keeps_resolved_episodes() {
        let config = CoordinatorConfig {
            algorithm: Algorithm::Rft,
            samples_per_task: 3,
            tasks_per_iteration: 2,
            episodes_per_iteration: 99, // not used by rft
            heldout_episodes: 0,
            ..Default::default()
        };
        let tasks: Vec<Task> = (0..4)
            .map(|i| Task {
                instance_id: format!("t{i}"),
                ..Default::default()
            })
            .collect();
        let sched = SchedulerHandle::spawn(config, tasks, vec![]);
        let (worker, _) = sched.register("w".into(), 8).await.unwrap();
        let runner = sched.clone();
        let iteration = tokio::spawn(async move { runner.run_iteration(0, 0.0).await });
        let leases = lease_n(&sched, &worker, 6).await;
        let ids: Vec<String> = leases
            .iter()
            .map(|l| l.task.as_ref().unwrap().instance_id.clone())
            .collect();
        assert_eq!(ids[0], ids[1]);
        assert_eq!(ids[1], ids[2]);
        assert_eq!(ids[3], ids[4]);
        assert_ne!(ids[0], ids[3]);
        assert!(leases.iter().all(|l| l.beta == 0.0));
        let resolved = [true, false, true, false, false, false];
        for (l, r) in leases.iter().zip(resolved) {
            finish(&sched, &worker, l, r).await;
        }
        let rollouts = iteration.await.unwrap().unwrap();
        assert_eq!(rollouts.train.len(), 6);
        assert_eq!(rollouts.refill_rounds, 0);
        let examples = sched.examples(0, true).await;
        let trained: Vec<&str> = examples.iter().map(|e| e.episode_id.as_str()).collect();
        assert_eq!(
            trained,
            vec![leases[0].episode_id.as_str(), leases[2].episode_id.as_str()]
        );
        assert!(examples
            .iter()
            .all(|e| e.loss_kind == LossKind::CrossEntropy as i32 && e.advantages.is_empty()));
    }
}
