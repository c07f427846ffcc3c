//! Crash recovery: the stored events a restarted coordinator replays, by iteration, when
//! each iteration starts; and the events and outcome claims that arrive for an iteration
//! not planned yet, kept until it is.

use std::collections::{BTreeMap, HashMap};

use tutor_proto::EpisodeEvent;

use crate::episode_id::{EpisodeId, SlotId};

/// What a restarted coordinator hands its scheduler: its generation (see
/// `RunState::generation`) and every event the store holds, in store order.
#[derive(Debug, Default)]
pub struct Recovery {
    pub generation: u64,
    pub history: Vec<EpisodeEvent>,
}

/// Events not replayed yet, by iteration, and the early outcome claims.
pub struct Backlog {
    /// Stored events by iteration, not yet replayed (see `Scheduler::start_iteration`).
    /// Events that arrive for an iteration not planned yet (a worker that carries on with
    /// its episode while a restarted coordinator is still connecting to the learner)
    /// join them.
    events: BTreeMap<u32, Vec<EpisodeEvent>>,
    /// Outcomes claimed before their iteration was planned: slot → the attempt that
    /// claimed it, so a second attempt is refused as it would be later.
    early_claims: HashMap<SlotId, EpisodeId>,
}

impl Backlog {
    /// The stored events by iteration; ids no coordinator made are left out.
    pub fn new(history: Vec<EpisodeEvent>) -> Self {
        let mut events: BTreeMap<u32, Vec<EpisodeEvent>> = BTreeMap::new();
        for ev in history {
            match ev.episode_id.parse::<EpisodeId>() {
                Ok(id) => events.entry(id.slot.iteration).or_default().push(ev),
                Err(_) => {
                    tracing::warn!(episode = %ev.episode_id, "stored episode id not made by a coordinator: ignored")
                }
            }
        }
        Self {
            events,
            early_claims: HashMap::new(),
        }
    }

    /// Removes and returns the events of the iterations before `iteration`, oldest first.
    pub fn take_before(&mut self, iteration: u32) -> Vec<(u32, Vec<EpisodeEvent>)> {
        let later = self.events.split_off(&iteration);
        std::mem::replace(&mut self.events, later)
            .into_iter()
            .collect()
    }

    /// Removes and returns the events of `iteration`.
    pub fn take(&mut self, iteration: u32) -> Option<Vec<EpisodeEvent>> {
        self.events.remove(&iteration)
    }

    /// Keeps an event of an iteration not planned yet.
    pub fn keep(&mut self, iteration: u32, event: EpisodeEvent) {
        self.events.entry(iteration).or_default().push(event);
    }

    /// An outcome of an iteration not planned yet: the first attempt of its slot to
    /// claim it may store it, every other is refused.
    pub fn claim_early(&mut self, id: EpisodeId) -> bool {
        *self.early_claims.entry(id.slot).or_insert(id) == id
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tutor_proto::{episode_event, EpisodeEvent, Task, TurnRecord};

    use super::Recovery;
    use crate::config::CoordinatorConfig;
    use crate::scheduler::tests::outcome;
    use crate::scheduler::SchedulerHandle;

    /// A lease expires and its slot goes to a second attempt while the first worker keeps
    /// going: whichever outcome arrives first completes the slot; the other is refused,
    /// before and after the winner is stored, and a replay of the winner is allowed.
    #[tokio::test]
    async fn only_one_attempt_of_a_slot_may_store_its_outcome() {
        let config = CoordinatorConfig {
            episodes_per_iteration: 1,
            heldout_episodes: 0,
            lease_timeout_s: 0.05,
            ..Default::default()
        };
        let sched = SchedulerHandle::spawn(config, vec![Task::default()], vec![]);
        let (worker, _) = sched.register("w".into(), 4).await.unwrap();
        let runner = sched.clone();
        let iteration = tokio::spawn(async move { runner.run_iteration(0, 1.0).await });
        let first = loop {
            if let Some(l) = sched.lease(worker.clone(), 1).await.unwrap().leases.pop() {
                break l.episode_id;
            }
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let second = loop {
            if let Some(l) = sched.lease(worker.clone(), 1).await.unwrap().leases.pop() {
                break l.episode_id;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_ne!(
            first, second,
            "the expired lease is handed out as a new attempt"
        );
        assert!(sched.claim_outcome(outcome(&second)).await);
        assert!(
            !sched.claim_outcome(outcome(&first)).await,
            "claimed by the other attempt"
        );
        assert!(
            sched.claim_outcome(outcome(&second)).await,
            "a replay of the winner"
        );
        sched.stored(outcome(&second)).await;
        assert!(
            !sched.claim_outcome(outcome(&first)).await,
            "completed by the other attempt"
        );
        iteration.await.unwrap().unwrap();
    }

    /// A restarted coordinator: the store held turn 0 of an episode in progress. Its
    /// worker streams the rest and the outcome before the driver has started the
    /// iteration (it is still connecting to the learner). Those events count when the
    /// iteration starts: the slot is done, not leased again, and a second attempt's
    /// outcome for it is refused.
    #[tokio::test]
    async fn events_that_arrive_before_their_iteration_starts_are_counted_then() {
        let config = CoordinatorConfig {
            episodes_per_iteration: 2,
            heldout_episodes: 0,
            ..Default::default()
        };
        let id = "it000-train0000-g0a0";
        let turn = |turn_index: u32| EpisodeEvent {
            episode_id: id.into(),
            worker_id: "w-0".into(),
            event: Some(episode_event::Event::Turn(TurnRecord {
                turn_index,
                ..Default::default()
            })),
        };
        let recovery = Recovery {
            generation: 1,
            history: vec![turn(0)],
        };
        let sched = SchedulerHandle::spawn_recovered(
            config,
            vec![Task::default(), Task::default()],
            vec![],
            recovery,
        );
        let (worker, _) = sched.register("w".into(), 4).await.unwrap();
        sched.stored(turn(1)).await;
        assert!(sched.claim_outcome(outcome(id)).await);
        assert!(
            !sched.claim_outcome(outcome("it000-train0000-g1a1")).await,
            "another attempt of the same slot"
        );
        sched.stored(outcome(id)).await;
        let runner = sched.clone();
        let iteration = tokio::spawn(async move { runner.run_iteration(0, 1.0).await });
        let mut leased = Vec::new();
        for _ in 0..100 {
            leased.extend(sched.lease(worker.clone(), 4).await.unwrap().leases);
            if !leased.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let ids: Vec<&str> = leased.iter().map(|l| l.episode_id.as_str()).collect();
        assert_eq!(ids.len(), 1, "{ids:?}");
        assert!(ids[0].starts_with("it000-train0001-"), "{ids:?}");
        sched.stored(outcome(ids[0])).await;
        let rollouts = iteration.await.unwrap().unwrap();
        assert_eq!(rollouts.train.len(), 2);
    }
}
