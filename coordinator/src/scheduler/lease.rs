//! The lease table: the queue of slots waiting for a worker, the leases out with their
//! deadlines (renewed by heartbeats, expired by the ticker), and what one lease carries.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tutor_proto::{EpisodeLease, EpisodePurpose, PolicyVersion, SamplingParams, Task};

use super::plan::Plan;
use crate::config::{Algorithm, CoordinatorConfig};
use crate::episode_id::{EpisodeId, Purpose};

/// A lease handed out and not yet finished or expired.
pub struct Outstanding {
    pub slot: usize,
    pub worker_id: String,
    /// Moved on by heartbeats, never past `hard_deadline`.
    pub deadline: Instant,
    /// When the lease ends however often it is renewed (`lease_max_s` after the grant).
    pub hard_deadline: Instant,
}

/// The current iteration's leases.
#[derive(Default)]
pub struct Leases {
    /// Slots waiting for a worker, in lease order.
    pending: VecDeque<usize>,
    outstanding: HashMap<EpisodeId, Outstanding>,
    /// Every episode leased (or adopted after a restart) in this iteration → its slot.
    episode_slot: HashMap<EpisodeId, usize>,
    /// Every episode this coordinator leased in this iteration → the worker it leased
    /// it to: the only one whose events of it are accepted, also after it expired.
    holder: HashMap<EpisodeId, String>,
    /// Every episode this coordinator leased, in any iteration (never cleared: a few
    /// bytes per episode of the run).
    granted: HashSet<EpisodeId>,
    /// Leases withdrawn before any worker had them (never cleared, like `granted`):
    /// their events are refused.
    withdrawn: HashSet<EpisodeId>,
    /// Leases that expired, since the coordinator started.
    expiries: u64,
}

impl Leases {
    /// Forgets the iteration's leases (a new iteration is planned); keeps the counts.
    pub fn clear(&mut self) {
        self.pending.clear();
        self.outstanding.clear();
        self.episode_slot.clear();
        self.holder.clear();
    }

    /// Replaces the queue with `slots`.
    pub fn set_queue(&mut self, slots: impl IntoIterator<Item = usize>) {
        self.pending = slots.into_iter().collect();
    }

    /// Queues `slots` behind the ones waiting.
    pub fn queue(&mut self, slots: impl IntoIterator<Item = usize>) {
        self.pending.extend(slots);
    }

    /// Puts `slot` first in the queue.
    pub fn queue_first(&mut self, slot: usize) {
        self.pending.push_front(slot);
    }

    pub fn next_pending(&mut self) -> Option<usize> {
        self.pending.pop_front()
    }

    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Leases `slot` to `worker_id` as episode `id` until `deadline` (renewable up to
    /// `hard_deadline`).
    pub fn grant(
        &mut self,
        id: EpisodeId,
        slot: usize,
        worker_id: &str,
        deadline: Instant,
        hard_deadline: Instant,
    ) {
        self.episode_slot.insert(id, slot);
        self.holder.insert(id, worker_id.to_string());
        self.granted.insert(id);
        self.keep(id, slot, worker_id.to_string(), deadline, hard_deadline);
    }

    /// The worker this coordinator leased `id` to (`None`: not leased by it, e.g. an
    /// episode leased before a restart).
    pub fn holder(&self, id: &EpisodeId) -> Option<&str> {
        self.holder.get(id).map(String::as_str)
    }

    /// Whether this coordinator leased `id`, in any iteration.
    pub fn was_granted(&self, id: &EpisodeId) -> bool {
        self.granted.contains(id)
    }

    /// Accepts the events of `id` (leased by an earlier coordinator) from `worker_id` only,
    /// for the rest of the iteration; a binding made earlier stays.
    pub fn bind(&mut self, id: EpisodeId, worker_id: &str) {
        self.holder
            .entry(id)
            .or_insert_with(|| worker_id.to_string());
    }

    /// Keeps `id` (already mapped to its slot) leased to `worker_id` until `deadline`
    /// (renewable up to `hard_deadline`): an episode in progress when the coordinator
    /// restarted.
    pub fn keep(
        &mut self,
        id: EpisodeId,
        slot: usize,
        worker_id: String,
        deadline: Instant,
        hard_deadline: Instant,
    ) {
        self.outstanding.insert(
            id,
            Outstanding {
                slot,
                worker_id,
                deadline: deadline.min(hard_deadline),
                hard_deadline,
            },
        );
    }

    /// Maps an episode this coordinator did not lease (one leased before a restart) to
    /// its slot.
    pub fn adopt(&mut self, id: EpisodeId, slot: usize) {
        self.episode_slot.insert(id, slot);
    }

    /// The slot of an episode leased or adopted in this iteration.
    pub fn slot_of(&self, id: &EpisodeId) -> Option<usize> {
        self.episode_slot.get(id).copied()
    }

    /// Takes back the lease of `id` from `worker_id`, which never received it: returns
    /// its slot, or `None` if `id` is not out to that worker (it expired, or a new
    /// iteration was planned). Its events are refused from then on.
    pub fn withdraw(&mut self, id: &EpisodeId, worker_id: &str) -> Option<usize> {
        if self.outstanding.get(id)?.worker_id != worker_id {
            return None;
        }
        let o = self.outstanding.remove(id).expect("looked up above");
        self.withdrawn.insert(*id);
        Some(o.slot)
    }

    /// Whether the lease of `id` was withdrawn (see `withdraw`).
    pub fn was_withdrawn(&self, id: &EpisodeId) -> bool {
        self.withdrawn.contains(id)
    }

    /// The lease of `id` ended with its outcome.
    pub fn finish(&mut self, id: &EpisodeId) {
        self.outstanding.remove(id);
    }

    /// Moves the deadline of the leases `worker_id` holds among `active` to `deadline`,
    /// never past a lease's hard deadline.
    pub fn renew(&mut self, worker_id: &str, active: &[String], deadline: Instant) {
        for ep in active {
            let Ok(id) = ep.parse::<EpisodeId>() else {
                continue;
            };
            if let Some(o) = self.outstanding.get_mut(&id) {
                if o.worker_id == worker_id {
                    o.deadline = deadline.min(o.hard_deadline);
                }
            }
        }
    }

    /// Removes and returns the leases whose deadline has passed at `now`.
    pub fn take_expired(&mut self, now: Instant) -> Vec<(EpisodeId, Outstanding)> {
        let expired: Vec<EpisodeId> = self
            .outstanding
            .iter()
            .filter(|(_, o)| o.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        self.expiries += expired.len() as u64;
        expired
            .into_iter()
            .map(|id| {
                let o = self.outstanding.remove(&id).expect("listed above");
                (id, o)
            })
            .collect()
    }

    pub fn expiries(&self) -> u64 {
        self.expiries
    }

    pub fn outstanding_len(&self) -> usize {
        self.outstanding.len()
    }

    /// Leases held by the workers `live` lists.
    pub fn held_by(&self, live: &HashSet<&String>) -> usize {
        self.outstanding
            .values()
            .filter(|o| live.contains(&o.worker_id))
            .count()
    }

    /// The slots with a lease out.
    pub fn leased_slots(&self) -> HashSet<usize> {
        self.outstanding.values().map(|o| o.slot).collect()
    }
}

/// What the lease of `slot` (episode `id`, task `task`) tells its worker: β, sampling,
/// limits and the deadline `timeout` from now.
pub fn episode_lease(
    config: &CoordinatorConfig,
    plan: &Plan,
    slot: usize,
    id: &EpisodeId,
    task: Task,
    policy: &PolicyVersion,
    timeout: Duration,
) -> EpisodeLease {
    let s = &plan.slots[slot];
    let purpose = EpisodePurpose::from(s.purpose);
    let (beta, temperature) = match s.purpose {
        Purpose::Train => (plan.beta, config.temperature),
        Purpose::Eval => (0.0, config.eval_temperature),
    };
    let seed =
        config.seed ^ ((plan.iteration as u64) << 40) ^ ((slot as u64) << 8) ^ s.attempt as u64;
    let deadline_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        + timeout;
    EpisodeLease {
        episode_id: id.to_string(),
        task: Some(task),
        beta,
        policy: Some(policy.clone()),
        sampling: Some(SamplingParams {
            temperature,
            max_new_tokens: config.max_new_tokens,
            seed,
            unbiased: purpose == EpisodePurpose::Train && config.samples_unbiased(),
        }),
        max_turns: config.max_turns,
        command_timeout_ms: (config.command_timeout_s * 1000.0) as u32,
        observation_max_chars: config.observation_max_chars,
        purpose: purpose as i32,
        iteration: plan.iteration,
        deadline_unix_ms: deadline_ms.as_millis() as u64,
        seed,
        student_turns: match purpose {
            EpisodePurpose::Train => config.kappa_at(plan.iteration),
            _ => None,
        },
        score_student: purpose == EpisodePurpose::Train && config.algorithm == Algorithm::Distill,
        // Only dagger and bc train on the teacher's labels, and only of training episodes.
        labels_unused: purpose != EpisodePurpose::Train
            || matches!(
                config.algorithm,
                Algorithm::Rft | Algorithm::Dapo | Algorithm::Distill
            ),
        // Held-out episodes too: the student is evaluated on the contexts it trains on.
        max_context_tokens: u32::try_from(config.max_seq_len).unwrap_or(u32::MAX),
    }
}

#[cfg(test)]
mod tests {
    use tutor_proto::{EpisodeLease, EpisodePurpose, Task};

    use crate::config::CoordinatorConfig;
    use crate::scheduler::SchedulerHandle;

    async fn leased(unbiased: bool) -> Vec<EpisodeLease> {
        leases_of(
            CoordinatorConfig {
                episodes_per_iteration: 2,
                heldout_episodes: 1,
                temperature: 0.7,
                unbiased_sampling: unbiased,
                ..Default::default()
            },
            0.5,
        )
        .await
    }

    /// The first three leases of iteration 0 (β = `beta`) of a scheduler on `config`, with
    /// one training and one held-out task.
    async fn leases_of(config: CoordinatorConfig, beta: f64) -> Vec<EpisodeLease> {
        let sched = SchedulerHandle::spawn(config, vec![Task::default()], vec![Task::default()]);
        let (worker, _) = sched.register("w".into(), 4).await.unwrap();
        let runner = sched.clone();
        let _iteration = tokio::spawn(async move { runner.run_iteration(0, beta).await });
        let mut leases = Vec::new();
        while leases.len() < 3 {
            leases.extend(sched.lease(worker.clone(), 3).await.unwrap().leases);
        }
        leases
    }

    /// Trajectory-level mixing: training leases carry κ of their iteration; held-out
    /// ones (student only) and turn-level runs carry none.
    #[tokio::test]
    async fn trajectory_mixing_leases_kappa_for_training_episodes() {
        for (mixing, want) in [
            (crate::config::Mixing::Turn, None),
            (crate::config::Mixing::Trajectory, Some(2)),
        ] {
            let config = CoordinatorConfig {
                episodes_per_iteration: 2,
                heldout_episodes: 1,
                mixing,
                kappa_start: 2,
                ..Default::default()
            };
            for l in leases_of(config, 0.5).await {
                let train = l.purpose == EpisodePurpose::Train as i32;
                assert_eq!(l.student_turns, if train { want } else { None }, "{l:?}");
            }
        }
    }

    #[tokio::test]
    async fn unbiased_sampling_is_leased_for_training_episodes_only() {
        for unbiased in [false, true] {
            for l in leased(unbiased).await {
                let s = l.sampling.unwrap();
                let train = l.purpose == EpisodePurpose::Train as i32;
                assert_eq!(s.unbiased, unbiased && train, "{l:?}");
                assert_eq!(s.temperature, if train { 0.7 } else { 0.0 });
            }
        }
    }

    /// Only dagger and bc train on the teacher's labels, and only of training episodes:
    /// every other lease tells the worker not to ask the teacher where it does not act.
    #[tokio::test]
    async fn labels_are_leased_as_unused_where_nothing_trains_on_them() {
        use crate::config::Algorithm;
        for (algorithm, train_labels) in [
            (Algorithm::Dagger, true),
            (Algorithm::Bc, true),
            (Algorithm::Rft, false),
            (Algorithm::Dapo, false),
            (Algorithm::Distill, false),
        ] {
            let config = CoordinatorConfig {
                episodes_per_iteration: 2,
                heldout_episodes: 1,
                tasks_per_iteration: 1,
                samples_per_task: 2,
                group_size: 2,
                algorithm,
                ..Default::default()
            };
            config.validate_algorithm().unwrap();
            let (mut train, mut eval) = (0, 0);
            for l in leases_of(config, 0.0).await {
                if l.purpose == EpisodePurpose::Train as i32 {
                    train += 1;
                    assert_eq!(l.labels_unused, !train_labels, "{algorithm:?}: {l:?}");
                } else {
                    eval += 1;
                    assert!(l.labels_unused, "{algorithm:?}: held-out {l:?}");
                }
            }
            assert!(train > 0 && eval > 0, "{algorithm:?}: {train} {eval}");
        }
    }
}
