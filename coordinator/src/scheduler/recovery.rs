//! Crash recovery: the stored events a restarted coordinator replays, by iteration, when
//! each iteration starts; and the events and outcome claims that arrive for an iteration
//! not planned yet, kept until it is. Stored events are kept as their offsets in the
//! store file and read back when their iteration is replayed, one iteration at a time,
//! so a restart never holds the whole history in memory.

use std::collections::{btree_map, BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use tutor_proto::{episode_event, EpisodeEvent};

use crate::episode_id::{EpisodeId, SlotId};
use crate::store::StoreReader;

use super::workers::WorkerKey;

/// What a restarted coordinator hands its scheduler: its generation (see
/// `RunState::generation`) and every event the store holds, in store order (as offsets
/// in the store file, see [`History`]).
#[derive(Debug, Default)]
pub struct Recovery {
    pub generation: u64,
    /// The key worker secrets are derived from, kept across restarts (`RunState`).
    pub worker_key: WorkerKey,
    /// The first generation that recorded its leases (`RunState::lease_records_from`).
    pub lease_records_from: Option<u64>,
    pub history: History,
}

impl Recovery {
    /// Generation 0 and an empty history of the store file `log`, to be filled with
    /// `history.push_stored` as the store is opened (see
    /// `TrajectoryStore::open_for_each`).
    pub fn in_store(log: &Path) -> Self {
        Self {
            generation: 0,
            worker_key: WorkerKey::default(),
            lease_records_from: None,
            history: History::in_store(log),
        }
    }
}

/// The events a store holds, by iteration, in store order: the offsets of their records
/// in the store file ([`History::in_store`]), or the events themselves (tests).
#[derive(Debug, Default)]
pub struct History {
    /// The store file the offsets are in.
    log: Option<PathBuf>,
    events: BTreeMap<u32, Vec<Entry>>,
    len: usize,
    /// The coordinators' records of whom they leased each attempt to (`LeaseGranted`):
    /// kept apart, never replayed as events.
    grants: Grants,
}

/// Whom earlier coordinators of the run leased attempts to, from their `LeaseGranted`
/// records. Only the attempts of the latest two iterations with records are kept, also
/// while the store is read: older attempts' events are stored and never counted.
#[derive(Debug, Default)]
pub struct Grants {
    holders: HashMap<EpisodeId, String>,
    /// The latest iteration a record was of.
    latest: Option<u32>,
}

impl Grants {
    fn record(&mut self, id: EpisodeId, worker_id: &str) {
        let iteration = id.slot.iteration;
        if self.latest.is_some_and(|l| iteration + 1 < l) {
            return;
        }
        if self.latest.is_none_or(|l| iteration > l) {
            self.latest = Some(iteration);
            self.keep_from(iteration.saturating_sub(1));
        }
        self.holders.insert(id, worker_id.to_string());
    }

    /// The worker an earlier coordinator leased `id` to, when it recorded it.
    pub fn holder(&self, id: &EpisodeId) -> Option<&str> {
        self.holders.get(id).map(String::as_str)
    }

    /// The latest iteration an attempt was leased in.
    pub fn last_iteration(&self) -> Option<u32> {
        self.latest
    }

    /// Forgets the attempts of iterations before `iteration`.
    pub fn keep_from(&mut self, iteration: u32) {
        self.holders.retain(|id, _| id.slot.iteration >= iteration);
    }

    pub fn len(&self) -> usize {
        self.holders.len()
    }
}

/// The attempt and holder of a coordinator's `LeaseGranted` record.
fn grant_of(ev: &EpisodeEvent) -> Option<(EpisodeId, &str)> {
    match &ev.event {
        Some(episode_event::Event::LeaseGranted(g)) => {
            Some((ev.episode_id.parse().ok()?, g.worker_id.as_str()))
        }
        _ => None,
    }
}

#[derive(Debug)]
enum Entry {
    /// The record at this byte offset of the store file.
    Stored(u64),
    /// Boxed: an entry is mostly an offset.
    Event(Box<EpisodeEvent>),
}

impl History {
    /// An empty history of the store file `log`, filled by [`History::push_stored`].
    pub fn in_store(log: &Path) -> Self {
        Self {
            log: Some(log.to_path_buf()),
            ..Self::default()
        }
    }

    /// Adds `ev`, stored at byte `offset` of the store file, keeping only the offset;
    /// an id no coordinator made is left out.
    pub fn push_stored(&mut self, offset: u64, ev: &EpisodeEvent) {
        assert!(self.log.is_some(), "History::in_store keeps offsets");
        self.len += 1;
        if let Some((id, worker)) = grant_of(ev) {
            self.grants.record(id, worker);
            return;
        }
        if let Some(k) = iteration_of(ev) {
            self.events
                .entry(k)
                .or_default()
                .push(Entry::Stored(offset));
        }
    }

    /// Events recovered, those of ids no coordinator made included.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Takes the lease records out (the rest is replayed as events).
    pub fn take_grants(&mut self) -> Grants {
        std::mem::take(&mut self.grants)
    }

    /// Events held in memory rather than as offsets.
    #[cfg(test)]
    fn events_in_memory(&self) -> usize {
        self.events
            .values()
            .flatten()
            .filter(|e| matches!(e, Entry::Event(_)))
            .count()
    }
}

/// The events themselves, in store order (tests, tools).
impl From<Vec<EpisodeEvent>> for History {
    fn from(events: Vec<EpisodeEvent>) -> Self {
        let mut history = Self::default();
        for ev in events {
            history.len += 1;
            if let Some((id, worker)) = grant_of(&ev) {
                history.grants.record(id, worker);
                continue;
            }
            if let Some(k) = iteration_of(&ev) {
                let entries = history.events.entry(k).or_default();
                entries.push(Entry::Event(Box::new(ev)));
            }
        }
        history
    }
}

/// The iteration of a stored event's episode; `None` (with a warning) for an id no
/// coordinator made.
fn iteration_of(ev: &EpisodeEvent) -> Option<u32> {
    match ev.episode_id.parse::<EpisodeId>() {
        Ok(id) => Some(id.slot.iteration),
        Err(_) => {
            tracing::warn!(episode = %ev.episode_id, "stored episode id not made by a coordinator: ignored");
            None
        }
    }
}

/// Events not replayed yet, by iteration, and the early outcome claims.
pub struct Backlog {
    /// The store file of the `Stored` entries.
    log: Option<PathBuf>,
    /// Stored events by iteration, not yet replayed (see `Scheduler::start_iteration`).
    /// Events that arrive for an iteration not planned yet (a worker that carries on with
    /// its episode while a restarted coordinator is still connecting to the learner)
    /// join them.
    events: BTreeMap<u32, Vec<Entry>>,
    /// Outcomes claimed before their iteration was planned: slot → the attempt that
    /// claimed it, so a second attempt is refused as it would be later.
    early_claims: HashMap<SlotId, EpisodeId>,
}

impl Backlog {
    /// The stored events by iteration (ids no coordinator made are left out).
    pub fn new(history: History) -> Self {
        Self {
            log: history.log,
            events: history.events,
            early_claims: HashMap::new(),
        }
    }

    /// Removes the events of the iterations before `iteration` and returns them, oldest
    /// iteration first, each iteration's read back from the store only when the
    /// iterator gets to it.
    pub fn take_before(&mut self, iteration: u32) -> Replays {
        let later = self.events.split_off(&iteration);
        Replays {
            log: self.log.clone(),
            reader: None,
            iterations: std::mem::replace(&mut self.events, later).into_iter(),
        }
    }

    /// Removes and returns the events of `iteration`.
    pub fn take(&mut self, iteration: u32) -> Option<Vec<EpisodeEvent>> {
        let entries = self.events.remove(&iteration)?;
        let mut reader = None;
        Some(load(self.log.as_deref(), &mut reader, iteration, entries))
    }

    /// The latest iteration with events kept (stored before a restart, or early).
    pub fn last_iteration(&self) -> Option<u32> {
        self.events.keys().next_back().copied()
    }

    /// Keeps an event of an iteration not planned yet.
    pub fn keep(&mut self, iteration: u32, event: EpisodeEvent) {
        self.events
            .entry(iteration)
            .or_default()
            .push(Entry::Event(Box::new(event)));
    }

    /// An outcome of an iteration not planned yet: the first attempt of its slot to
    /// claim it may store it, every other is refused.
    pub fn claim_early(&mut self, id: EpisodeId) -> bool {
        *self.early_claims.entry(id.slot).or_insert(id) == id
    }
}

/// The events of earlier iterations, one iteration at a time (see
/// [`Backlog::take_before`]).
pub struct Replays {
    log: Option<PathBuf>,
    reader: Option<StoreReader>,
    iterations: btree_map::IntoIter<u32, Vec<Entry>>,
}

impl Iterator for Replays {
    type Item = (u32, Vec<EpisodeEvent>);

    fn next(&mut self) -> Option<Self::Item> {
        let (k, entries) = self.iterations.next()?;
        Some((k, load(self.log.as_deref(), &mut self.reader, k, entries)))
    }
}

/// The events of `entries` (of `iteration`), the stored ones read back from `log`.
///
/// # Panics
/// If a record cannot be read back (the store file changed under the coordinator, or a
/// disk error): the scheduler cannot go on without the iteration's events, so it stops,
/// and the coordinator with it, with the store's error.
fn load(
    log: Option<&Path>,
    reader: &mut Option<StoreReader>,
    iteration: u32,
    entries: Vec<Entry>,
) -> Vec<EpisodeEvent> {
    let mut read = |offset: u64| -> Result<EpisodeEvent, crate::store::StoreError> {
        let log = log.expect("stored entries come with their store file");
        let reader = match reader {
            Some(r) => r,
            None => reader.insert(StoreReader::open(log)?),
        };
        reader.read_at(offset)
    };
    entries
        .into_iter()
        .map(|entry| match entry {
            Entry::Event(ev) => *ev,
            Entry::Stored(offset) => read(offset).unwrap_or_else(|e| {
                tracing::error!(iteration, error = %e, "reading back a stored event to replay failed: the scheduler stops");
                panic!("replaying iteration {iteration}: {e}")
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tutor_proto::{episode_event, EpisodeEvent, Task, TrainExample, TurnRecord};

    use super::{History, Recovery};
    use crate::config::CoordinatorConfig;
    use crate::scheduler::tests::outcome;
    use crate::scheduler::SchedulerHandle;
    use crate::store::{StoreOptions, TrajectoryStore};

    /// A lease expires and its slot goes to a second attempt while the first worker keeps
    /// going: whichever outcome arrives first completes the slot; the other is refused,
    /// before and after the winner is stored, and a replay of the winner is allowed.
    /// Lease records are kept for the latest two iterations with records only, also
    /// while the store is read: a long run's restart holds two iterations' leases, not
    /// every lease of the run.
    #[test]
    fn lease_records_of_older_iterations_are_not_kept() {
        let mut grants = super::Grants::default();
        for iteration in 0..50u32 {
            for slot in 0..10 {
                let id: crate::episode_id::EpisodeId =
                    format!("it{iteration:03}-train{slot:04}-g0a0")
                        .parse()
                        .unwrap();
                grants.record(id, "w");
            }
        }
        assert_eq!(grants.len(), 20);
        assert_eq!(grants.last_iteration(), Some(49));
        let old: crate::episode_id::EpisodeId = "it047-train0000-g0a0".parse().unwrap();
        let kept: crate::episode_id::EpisodeId = "it048-train0003-g0a0".parse().unwrap();
        assert_eq!(grants.holder(&old), None);
        assert_eq!(grants.holder(&kept), Some("w"));
        // A record of an older iteration read late changes nothing.
        grants.record(old, "x");
        assert_eq!((grants.len(), grants.holder(&old)), (20, None));
    }

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
            history: vec![turn(0)].into(),
            ..Default::default()
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

    /// Stored events of iterations 0 to 2, iteration 0's and 1's complete, one turn of
    /// iteration 2 (in store order, iterations interleaved as in async mode).
    fn stored_history() -> Vec<EpisodeEvent> {
        let turn = |id: &str, turn_index: u32| EpisodeEvent {
            episode_id: id.into(),
            worker_id: "w-0".into(),
            event: Some(episode_event::Event::Turn(TurnRecord {
                turn_index,
                teacher_tokens: vec![7, 8],
                context_delta_tokens: vec![1, 2, 3],
                ..Default::default()
            })),
        };
        let mut events = Vec::new();
        for k in 0..2 {
            for slot in 0..2 {
                let id = format!("it{k:03}-train{slot:04}-g0a0");
                events.push(turn(&id, 0));
                events.push(turn(&id, 1));
                if k == 1 && slot == 1 {
                    events.push(turn("it002-train0000-g0a0", 0));
                }
                events.push(outcome(&id));
            }
        }
        events
    }

    /// What a scheduler recovered from `history` does: iterations 0 and 1 complete with
    /// no worker, with their examples; the episode of iteration 2 in progress stays
    /// leased to its worker, so only the other slot is leased.
    async fn replayed(history: History) -> (Vec<usize>, Vec<Vec<TrainExample>>, Vec<String>) {
        let config = CoordinatorConfig {
            episodes_per_iteration: 2,
            heldout_episodes: 0,
            ..Default::default()
        };
        let sched = SchedulerHandle::spawn_recovered(
            config,
            vec![Task::default(), Task::default()],
            vec![],
            Recovery {
                generation: 1,
                history,
                ..Default::default()
            },
        );
        let mut trained = Vec::new();
        let mut examples = Vec::new();
        for k in 0..2 {
            let rollouts = sched.run_iteration(k, 1.0).await.unwrap();
            trained.push(rollouts.train.len());
            examples.push(sched.examples(k, false).await);
        }
        let (worker, _) = sched.register("w".into(), 4).await.unwrap();
        let runner = sched.clone();
        tokio::spawn(async move { runner.run_iteration(2, 1.0).await });
        let mut leased = Vec::new();
        for _ in 0..100 {
            leased.extend(sched.lease(worker.clone(), 4).await.unwrap().leases);
            if !leased.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (
            trained,
            examples,
            leased.into_iter().map(|l| l.episode_id).collect(),
        )
    }

    /// A history read from the store keeps offsets only, and replays each iteration
    /// (read back from the file when it starts) as the same events held in memory do.
    #[tokio::test]
    async fn a_history_in_the_store_replays_as_the_events_do() {
        let dir = tempfile::tempdir().unwrap();
        let events = stored_history();
        let mut store = TrajectoryStore::open(dir.path()).unwrap();
        store.append_batch(&events).unwrap();
        drop(store);
        let mut history = History::in_store(&crate::store::log_path(dir.path()));
        TrajectoryStore::open_for_each(dir.path(), StoreOptions::default(), |at, ev| {
            history.push_stored(at, &ev)
        })
        .unwrap();
        assert_eq!(history.len(), events.len());
        assert_eq!(history.events_in_memory(), 0, "offsets only");

        let from_store = replayed(history).await;
        let in_memory = replayed(events.into()).await;
        assert_eq!(from_store, in_memory);
        let (trained, examples, leased) = from_store;
        assert_eq!(trained, vec![2, 2]);
        assert!(examples.iter().all(|e| e.len() == 4), "{examples:?}");
        assert_eq!(leased.len(), 1, "{leased:?}");
        assert!(leased[0].starts_with("it002-train0001-"), "{leased:?}");
    }
}
