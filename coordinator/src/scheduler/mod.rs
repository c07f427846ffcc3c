//! The scheduler actor: the one owner of leases, episode progress, workers, the policy
//! version and the DAgger dataset. Everything else talks to it through `SchedulerHandle`;
//! this file holds the handle, the command loop and the rules that join the parts (the
//! lease table, the worker registry, the iteration's plan, recovery, the datasets).
//! (Over 800 lines: the command loop and the admission, expiry and completion rules
//! each touch several parts; the parts themselves are in the child modules.)

mod lease;
mod plan;
mod recovery;
mod workers;

pub use recovery::Recovery;
pub use workers::{WorkerKey, HEARTBEAT_INTERVAL};

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tutor_proto::{
    episode_event, EpisodeEvent, HeartbeatResponse, LeaseResponse, PolicyVersion, Task,
    TrainExample, TurnRecord,
};

use self::lease::{episode_lease, Leases};
use self::plan::Plan;
use self::recovery::{Backlog, Grants};
use self::workers::Workers;
use crate::config::{Algorithm, CoordinatorConfig};
use crate::dataset::{DatasetExample, EpisodeData, ExampleSpill, IterationDatasets};
use crate::episode_id::{EpisodeId, Purpose};
use crate::rollouts::is_ungraded;
pub use crate::rollouts::IterationRollouts;
use crate::store::StoreRequest;

/// The `worker_id` of the events the coordinator stores itself: the outcomes of slots
/// whose attempts ran out, and the lease expiries that used those attempts up.
pub const COORDINATOR_WRITER: &str = "coordinator";

enum Cmd {
    Register {
        name: String,
        capacity: u32,
        reply: oneshot::Sender<(String, String, PolicyVersion)>,
    },
    Lease {
        worker_id: String,
        max: u32,
        reply: oneshot::Sender<LeaseResponse>,
    },
    /// The service could not record these leases (`LeaseGranted`), so `worker_id`
    /// never got them: they go back to the queue without spending an attempt.
    Withdraw {
        worker_id: String,
        episode_ids: Vec<String>,
        reply: oneshot::Sender<usize>,
    },
    /// May this outcome be stored? Claims its slot for the attempt (see
    /// `Slot::claimed_by`); false when another attempt already completed or claimed it.
    ClaimOutcome {
        event: Box<EpisodeEvent>,
        reply: oneshot::Sender<bool>,
    },
    /// May this event be stored, coming from a stream that claims to be `worker` (id
    /// and secret; `None`: it claims nobody)? Outcomes also claim their slot.
    Admit {
        episode_id: String,
        outcome: Option<Box<EpisodeEvent>>,
        worker: Option<(String, String)>,
        reply: oneshot::Sender<Admission>,
    },
    /// Does `secret` prove `worker_id`?
    Authenticate {
        worker_id: String,
        secret: String,
        reply: oneshot::Sender<bool>,
    },
    Stored {
        // Boxed: turns carry token vectors, the other commands are small.
        event: Box<EpisodeEvent>,
    },
    Heartbeat {
        worker_id: String,
        active: Vec<String>,
        loaded: u64,
        reply: oneshot::Sender<HeartbeatResponse>,
    },
    StartIteration {
        iteration: u32,
        beta: f64,
        reply: oneshot::Sender<IterationRollouts>,
    },
    SetPolicy {
        policy: PolicyVersion,
    },
    Examples {
        iteration: u32,
        aggregate: bool,
        reply: oneshot::Sender<Vec<DatasetExample>>,
    },
    WorkerVersions {
        reply: oneshot::Sender<BTreeMap<String, u64>>,
    },
    Progress {
        reply: oneshot::Sender<(u32, u32)>,
    },
    Snapshot {
        reply: oneshot::Sender<SchedulerSnapshot>,
    },
    TeacherLabels {
        iteration: u32,
        reply: oneshot::Sender<u64>,
    },
    Seal {
        iteration: u32,
        base_version: u64,
        reply: oneshot::Sender<u64>,
    },
    Drain,
    Finish,
    Tick,
}

/// Whether an event arriving on a worker's stream may be stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    Store,
    /// An outcome of an attempt whose slot another attempt completed: acknowledged as a
    /// duplicate, not stored.
    Superseded,
    /// Never stored (the worker drops it): why.
    Refused(String),
}

/// The scheduler's numbers at one instant, for metrics. Counters (`*_total`) count
/// since the coordinator started; the rest are gauges.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerSnapshot {
    pub policy_version: u64,
    pub iteration: u32,
    /// Episodes of the current iteration waiting for a worker (the lease queue).
    pub pending_episodes: u64,
    /// Leases handed out and not yet finished or expired.
    pub outstanding_leases: u64,
    /// Of those, the ones held by a live worker (episodes that may still finish).
    pub outstanding_live_leases: u64,
    /// Workers heard from within three heartbeat intervals.
    pub live_workers: u64,
    pub train_episodes_completed_total: u64,
    pub eval_episodes_completed_total: u64,
    pub lease_expiries_total: u64,
    /// Training episodes left out of training for lagging the learner by more than
    /// `max_staleness` (async mode), over the iterations sealed so far.
    pub stale_episodes_total: u64,
    pub run_finished: bool,
    /// No new leases: the coordinator is shutting down.
    pub draining: bool,
}

#[derive(Clone)]
pub struct SchedulerHandle {
    tx: mpsc::Sender<Cmd>,
}

impl SchedulerHandle {
    pub fn spawn(config: CoordinatorConfig, train: Vec<Task>, heldout: Vec<Task>) -> Self {
        Self::spawn_recovered(config, train, heldout, Recovery::default())
    }

    /// `spawn` for a coordinator restarted on a run directory: iterations rebuild their
    /// slots, completions and datasets from `recovery.history` when they start.
    pub fn spawn_recovered(
        config: CoordinatorConfig,
        train: Vec<Task>,
        heldout: Vec<Task>,
        recovery: Recovery,
    ) -> Self {
        Self::spawn_with_store(config, train, heldout, recovery, None, None)
    }

    /// `spawn_recovered` with the trajectory store's writer: a slot whose attempts run
    /// out is recorded there as its outcome (`fail_slot`), so a restarted coordinator
    /// replays it as done instead of giving it fresh attempts. The scheduler holds the
    /// writer weakly: it never keeps the store open past the coordinator's own sender.
    /// With `examples_file`, an aggregating run's examples are kept there rather than
    /// in memory (`IterationDatasets::with_spill`).
    pub fn spawn_with_store(
        config: CoordinatorConfig,
        train: Vec<Task>,
        heldout: Vec<Task>,
        recovery: Recovery,
        store: Option<&mpsc::Sender<StoreRequest>>,
        examples_file: Option<ExampleSpill>,
    ) -> Self {
        let (tx, rx) = mpsc::channel(1024);
        let mut state = Scheduler::new(config, train, heldout, recovery);
        state.datasets = IterationDatasets::with_spill(state.config.clone(), examples_file);
        state.store = store.map(mpsc::Sender::downgrade);
        tokio::spawn(state.run(rx));
        let handle = Self { tx };
        let ticker = handle.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(500));
            loop {
                every.tick().await;
                if ticker.tx.send(Cmd::Tick).await.is_err() {
                    return;
                }
            }
        });
        handle
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Option<T> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(make(reply)).await.ok()?;
        rx.await.ok()
    }

    pub async fn register(&self, name: String, capacity: u32) -> Option<(String, PolicyVersion)> {
        let (id, _secret, policy) = self.register_worker(name, capacity).await?;
        Some((id, policy))
    }
    /// Registers a worker: its id, the secret it proves that id with on its event
    /// streams, and the current policy.
    pub async fn register_worker(
        &self,
        name: String,
        capacity: u32,
    ) -> Option<(String, String, PolicyVersion)> {
        self.ask(|reply| Cmd::Register {
            name,
            capacity,
            reply,
        })
        .await
    }
    /// Whether `secret` proves `worker_id` (false once the scheduler stopped).
    pub async fn authenticate(&self, worker_id: String, secret: String) -> bool {
        self.ask(|reply| Cmd::Authenticate {
            worker_id,
            secret,
            reply,
        })
        .await
        .unwrap_or(false)
    }
    /// Before an event is stored: refused unless the stream proves (`worker`: id and
    /// secret) to be the worker its episode was leased to; for an outcome, also whether
    /// its slot is still open (see [`SchedulerHandle::claim_outcome`]). Checked per
    /// event, so a stream opened before its worker was known (a coordinator restart)
    /// counts once the worker is. A stopped scheduler allows everything.
    pub async fn admit(&self, event: &EpisodeEvent, worker: Option<(String, String)>) -> Admission {
        let outcome = matches!(event.event, Some(episode_event::Event::Outcome(_)))
            .then(|| Box::new(event.clone()));
        self.ask(|reply| Cmd::Admit {
            episode_id: event.episode_id.clone(),
            outcome,
            worker,
            reply,
        })
        .await
        .unwrap_or(Admission::Store)
    }
    pub async fn lease(&self, worker_id: String, max: u32) -> Option<LeaseResponse> {
        self.ask(|reply| Cmd::Lease {
            worker_id,
            max,
            reply,
        })
        .await
    }
    /// Takes back leases `worker_id` never received (the Lease call failed after the
    /// scheduler granted them): their slots go first in the queue, as their next
    /// attempt, and no attempt is spent. Returns how many were still out.
    pub async fn withdraw(&self, worker_id: String, episode_ids: Vec<String>) -> Option<usize> {
        self.ask(|reply| Cmd::Withdraw {
            worker_id,
            episode_ids,
            reply,
        })
        .await
    }
    /// Before an outcome is stored: false if another attempt of its slot already
    /// completed it (the caller then drops it). A stopped scheduler allows everything.
    pub async fn claim_outcome(&self, event: EpisodeEvent) -> bool {
        self.ask(|reply| Cmd::ClaimOutcome {
            event: Box::new(event),
            reply,
        })
        .await
        .unwrap_or(true)
    }
    /// Called after the event is durable in the store (and only for new events).
    pub async fn stored(&self, event: EpisodeEvent) {
        let _ = self
            .tx
            .send(Cmd::Stored {
                event: Box::new(event),
            })
            .await;
    }
    pub async fn heartbeat(
        &self,
        worker_id: String,
        active: Vec<String>,
        loaded: u64,
    ) -> Option<HeartbeatResponse> {
        self.ask(|reply| Cmd::Heartbeat {
            worker_id,
            active,
            loaded,
            reply,
        })
        .await
    }
    /// Queues the iteration's episodes and resolves when every one has an outcome.
    pub async fn run_iteration(&self, iteration: u32, beta: f64) -> Option<IterationRollouts> {
        self.ask(|reply| Cmd::StartIteration {
            iteration,
            beta,
            reply,
        })
        .await
    }
    pub async fn set_policy(&self, policy: PolicyVersion) {
        let _ = self.tx.send(Cmd::SetPolicy { policy }).await;
    }
    /// The training examples of `iteration` (with `aggregate`, of every iteration up to
    /// it), less the episodes the staleness filter left out: in memory or in the
    /// examples' file, with what batching needs of each.
    pub async fn dataset(&self, iteration: u32, aggregate: bool) -> Vec<DatasetExample> {
        self.ask(|reply| Cmd::Examples {
            iteration,
            aggregate,
            reply,
        })
        .await
        .unwrap_or_default()
    }
    /// `dataset`'s examples themselves, read from the examples' file where they are
    /// there (an example that cannot be read is an error naming it).
    pub async fn examples(&self, iteration: u32, aggregate: bool) -> Vec<TrainExample> {
        let dataset = self.dataset(iteration, aggregate).await;
        tokio::task::spawn_blocking(move || {
            dataset
                .iter()
                .map(|e| e.load())
                .collect::<std::io::Result<Vec<_>>>()
        })
        .await
        .expect("reading the examples")
        .expect("reading the examples' file")
    }
    /// Records that training on `iteration` starts from learner version `base_version`
    /// and returns how many of its episodes are too stale to train on (async mode).
    pub async fn seal(&self, iteration: u32, base_version: u64) -> u64 {
        self.ask(|reply| Cmd::Seal {
            iteration,
            base_version,
            reply,
        })
        .await
        .unwrap_or(0)
    }
    /// Teacher labels (DAgger examples) of the iterations up to `iteration`.
    pub async fn teacher_labels_through(&self, iteration: u32) -> u64 {
        self.ask(|reply| Cmd::TeacherLabels { iteration, reply })
            .await
            .unwrap_or(0)
    }
    /// Stops handing out leases; leases already out keep running.
    pub async fn drain(&self) {
        let _ = self.tx.send(Cmd::Drain).await;
    }
    /// The loaded policy version of every live worker.
    pub async fn worker_versions(&self) -> BTreeMap<String, u64> {
        self.ask(|reply| Cmd::WorkerVersions { reply })
            .await
            .unwrap_or_default()
    }
    /// (episodes done, episodes total) of the current iteration.
    pub async fn progress(&self) -> (u32, u32) {
        self.ask(|reply| Cmd::Progress { reply })
            .await
            .unwrap_or((0, 0))
    }
    /// The numbers behind the metrics endpoint.
    pub async fn snapshot(&self) -> Option<SchedulerSnapshot> {
        self.ask(|reply| Cmd::Snapshot { reply }).await
    }
    pub async fn finish(&self) {
        let _ = self.tx.send(Cmd::Finish).await;
    }
}

struct Scheduler {
    config: CoordinatorConfig,
    train_tasks: Vec<Task>,
    heldout_tasks: Vec<Task>,
    generation: u64,
    policy: PolicyVersion,
    /// The current iteration's slots.
    plan: Plan,
    leases: Leases,
    workers: Workers,
    datasets: IterationDatasets,
    /// Stored events not replayed yet, and early outcome claims.
    backlog: Backlog,
    /// The latest iteration the store had events or lease records of at start: an
    /// earlier coordinator of this run may have leased episodes of the one after it at
    /// most.
    recovered_horizon: u32,
    /// Whom earlier coordinators leased the attempts of iterations from the one before
    /// `recovered_horizon` on to (their `LeaseGranted` records).
    grants: Grants,
    /// The first generation that recorded its leases: from it on, an id with no record
    /// was never leased.
    lease_records_from: Option<u64>,
    /// Turns of the episodes in progress.
    turns: HashMap<EpisodeId, Vec<TurnRecord>>,
    rollouts: IterationRollouts,
    iteration_reply: Option<oneshot::Sender<IterationRollouts>>,
    finished: bool,
    draining: bool,
    /// Since start, across iterations: counted episodes by purpose.
    completed_train: u64,
    completed_eval: u64,
    /// Where failed slots are recorded (see `SchedulerHandle::spawn_with_store`).
    store: Option<mpsc::WeakSender<StoreRequest>>,
}

impl Scheduler {
    fn new(
        config: CoordinatorConfig,
        train_tasks: Vec<Task>,
        heldout_tasks: Vec<Task>,
        recovery: Recovery,
    ) -> Self {
        let mut recovery = recovery;
        let mut grants = recovery.history.take_grants();
        let backlog = Backlog::new(recovery.history);
        let recovered_horizon = backlog
            .last_iteration()
            .max(grants.last_iteration())
            .unwrap_or(0);
        // The iteration before the horizon too: in async mode the next iteration may
        // have been leased before this one's last records were written.
        grants.keep_from(recovered_horizon.saturating_sub(1));
        Self {
            recovered_horizon,
            grants,
            lease_records_from: recovery.lease_records_from,
            datasets: IterationDatasets::new(config.clone()),
            config,
            train_tasks,
            heldout_tasks,
            generation: recovery.generation,
            policy: PolicyVersion::default(),
            plan: Plan::none(),
            leases: Leases::default(),
            workers: Workers::new(recovery.generation, recovery.worker_key),
            backlog,
            turns: HashMap::new(),
            rollouts: IterationRollouts::default(),
            iteration_reply: None,
            finished: false,
            draining: false,
            completed_train: 0,
            completed_eval: 0,
            store: None,
        }
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Cmd>) {
        while let Some(cmd) = rx.recv().await {
            match cmd {
                Cmd::Register {
                    name,
                    capacity,
                    reply,
                } => {
                    let (id, secret) = self.workers.register(name, capacity);
                    let _ = reply.send((id, secret, self.policy.clone()));
                }
                Cmd::Lease {
                    worker_id,
                    max,
                    reply,
                } => {
                    let _ = reply.send(self.lease(&worker_id, max));
                }
                Cmd::Withdraw {
                    worker_id,
                    episode_ids,
                    reply,
                } => {
                    let _ = reply.send(self.withdraw(&worker_id, &episode_ids));
                }
                Cmd::Stored { event } => self.on_stored(*event),
                Cmd::ClaimOutcome { event, reply } => {
                    let _ = reply.send(self.claim_outcome(&event));
                }
                Cmd::Admit {
                    episode_id,
                    outcome,
                    worker,
                    reply,
                } => {
                    let _ = reply.send(self.admit(&episode_id, outcome.as_deref(), worker));
                }
                Cmd::Authenticate {
                    worker_id,
                    secret,
                    reply,
                } => {
                    let _ = reply.send(self.workers.authenticate(&worker_id, &secret));
                }
                Cmd::Heartbeat {
                    worker_id,
                    active,
                    loaded,
                    reply,
                } => {
                    let _ = reply.send(self.heartbeat(&worker_id, &active, loaded));
                }
                Cmd::StartIteration {
                    iteration,
                    beta,
                    reply,
                } => self.start_iteration(iteration, beta, reply),
                Cmd::SetPolicy { policy } => {
                    tracing::info!(version = policy.version, "policy version is now current");
                    self.policy = policy;
                }
                Cmd::Examples {
                    iteration,
                    aggregate,
                    reply,
                } => {
                    let _ = reply.send(self.datasets.examples(iteration, aggregate));
                }
                Cmd::TeacherLabels { iteration, reply } => {
                    let _ = reply.send(self.datasets.teacher_labels_through(iteration));
                }
                Cmd::Seal {
                    iteration,
                    base_version,
                    reply,
                } => {
                    let _ = reply.send(self.datasets.seal(iteration, base_version));
                }
                Cmd::Drain => {
                    tracing::info!(
                        outstanding = self.leases.outstanding_len(),
                        "draining: no new leases"
                    );
                    self.draining = true;
                }
                Cmd::WorkerVersions { reply } => {
                    let _ = reply.send(self.workers.live_versions());
                }
                Cmd::Snapshot { reply } => {
                    let _ = reply.send(self.snapshot());
                }
                Cmd::Progress { reply } => {
                    let done = self.plan.done_count() as u32;
                    let _ = reply.send((done, self.plan.slots.len() as u32));
                }
                Cmd::Finish => self.finished = true,
                Cmd::Tick => self.expire_leases(),
            }
        }
    }

    fn snapshot(&self) -> SchedulerSnapshot {
        SchedulerSnapshot {
            policy_version: self.policy.version,
            iteration: self.plan.iteration,
            pending_episodes: self.leases.pending_len() as u64,
            outstanding_leases: self.leases.outstanding_len() as u64,
            outstanding_live_leases: self.leases.held_by(&self.workers.live_ids()) as u64,
            live_workers: self.workers.live_count() as u64,
            train_episodes_completed_total: self.completed_train,
            eval_episodes_completed_total: self.completed_eval,
            lease_expiries_total: self.leases.expiries(),
            stale_episodes_total: self.datasets.stale_total(),
            run_finished: self.finished,
            draining: self.draining,
        }
    }

    /// The task a slot samples.
    fn task_of(&self, slot: usize) -> &Task {
        let s = &self.plan.slots[slot];
        match s.purpose {
            Purpose::Train => &self.train_tasks[s.task],
            Purpose::Eval => &self.heldout_tasks[s.task],
        }
    }

    /// Sets up `iteration`'s slots and queues them. After a restart, the iterations the
    /// store holds events of are replayed first: earlier ones only for their datasets;
    /// this one also marks its completed slots done and keeps the episodes in progress
    /// leased (to the worker that streamed them, with a fresh deadline), so only the
    /// rest is leased again and nothing is counted twice.
    fn start_iteration(
        &mut self,
        iteration: u32,
        beta: f64,
        reply: oneshot::Sender<IterationRollouts>,
    ) {
        for (k, events) in self.backlog.take_before(iteration) {
            self.plan_iteration(k, 0.0);
            self.replay(events);
        }
        self.plan_iteration(iteration, beta);
        if let Some(events) = self.backlog.take(iteration) {
            self.replay(events);
        }
        let leased = self.leases.leased_slots();
        let slots = &self.plan.slots;
        self.leases
            .set_queue((0..slots.len()).filter(|s| !slots[*s].done && !leased.contains(s)));
        tracing::info!(
            iteration,
            beta,
            kappa = ?self.config.kappa_at(iteration),
            episodes = self.plan.slots.len(),
            recovered_done = self.plan.done_count(),
            recovered_leased = leased.len(),
            "iteration started"
        );
        self.iteration_reply = Some(reply);
        self.check_iteration_done();
    }

    /// Plans `iteration` (see `Plan::new`) and forgets the previous one's leases, turns
    /// and rollouts.
    fn plan_iteration(&mut self, iteration: u32, beta: f64) {
        self.plan = Plan::new(
            &self.config,
            iteration,
            beta,
            self.train_tasks.len(),
            self.heldout_tasks.len(),
        );
        self.leases.clear();
        self.turns.clear();
        self.rollouts = IterationRollouts::default();
        self.datasets.open(iteration);
    }

    /// Feeds stored events of the planned iteration through `on_stored`, as if they had
    /// just arrived, in store order (so the first outcome of a slot is the counted one,
    /// as it was). Episodes with turns and no outcome (nor lease expiry) stay leased to
    /// their worker; recorded expiries count against the slot's attempts.
    fn replay(&mut self, events: Vec<EpisodeEvent>) {
        let deadline = Instant::now() + Duration::from_secs_f64(self.config.lease_timeout_s);
        let hard_deadline = Instant::now() + Duration::from_secs_f64(self.config.lease_max_s);
        let mut open: HashMap<EpisodeId, (usize, String)> = HashMap::new();
        for ev in events {
            let Some((id, slot)) = self.adopt(&ev) else {
                continue;
            };
            if matches!(
                ev.event,
                Some(episode_event::Event::Outcome(_) | episode_event::Event::LeaseExpired(_))
            ) {
                open.remove(&id);
            } else {
                open.insert(id, (slot, ev.worker_id.clone()));
            }
            self.on_stored(ev);
        }
        for (id, (slot, worker_id)) in open {
            if self.plan.slots[slot].done {
                self.turns.remove(&id);
            } else {
                // Its later events are accepted from the worker that stored the earlier
                // ones only.
                self.leases.bind(id, &worker_id);
                self.leases
                    .keep(id, slot, worker_id, deadline, hard_deadline);
            }
        }
    }

    fn lease(&mut self, worker_id: &str, max: u32) -> LeaseResponse {
        self.workers.seen(worker_id);
        if self.finished {
            return LeaseResponse {
                run_finished: true,
                ..Default::default()
            };
        }
        if self.draining {
            return LeaseResponse {
                retry_after_ms: 1000,
                ..Default::default()
            };
        }
        let timeout = Duration::from_secs_f64(self.config.lease_timeout_s);
        let held_at_most = Duration::from_secs_f64(self.config.lease_max_s);
        let mut leases = Vec::new();
        while (leases.len() as u32) < max.max(1) {
            let Some(slot) = self.leases.next_pending() else {
                break;
            };
            let id = self.plan.episode_id(slot, self.generation);
            let task = self.task_of(slot).clone();
            leases.push(episode_lease(
                &self.config,
                &self.plan,
                slot,
                &id,
                task,
                &self.policy,
                timeout,
            ));
            let now = Instant::now();
            self.leases
                .grant(id, slot, worker_id, now + timeout, now + held_at_most);
        }
        let retry_after_ms = if leases.is_empty() { 200 } else { 0 };
        LeaseResponse {
            leases,
            run_finished: false,
            retry_after_ms,
        }
    }

    fn withdraw(&mut self, worker_id: &str, episode_ids: &[String]) -> usize {
        let mut taken = 0;
        // In reverse, so the slots are first in the queue in the order they were leased.
        for ep in episode_ids.iter().rev() {
            let Ok(id) = ep.parse::<EpisodeId>() else {
                continue;
            };
            let Some(slot) = self.leases.withdraw(&id, worker_id) else {
                continue;
            };
            self.turns.remove(&id);
            if self.plan.slots[slot].done {
                // Another attempt completed it meanwhile: nothing to lease again.
                continue;
            }
            self.plan.slots[slot].withdraw();
            self.leases.queue_first(slot);
            taken += 1;
            tracing::warn!(episode = %id, worker = worker_id, "lease withdrawn before the worker had it (it could not be recorded): the slot is leased again, no attempt spent");
        }
        taken
    }

    fn heartbeat(&mut self, worker_id: &str, active: &[String], loaded: u64) -> HeartbeatResponse {
        let renew = Instant::now() + Duration::from_secs_f64(self.config.lease_timeout_s);
        self.workers.heartbeat(worker_id, loaded);
        self.leases.renew(worker_id, active, renew);
        HeartbeatResponse {
            latest: Some(self.policy.clone()),
            shutdown: self.finished,
        }
    }

    /// Leases past their deadline (unrenewed, or held past `lease_max_s`): the slot goes
    /// back to the queue as its next attempt, or, after `max_attempts`, is failed. Each
    /// expiry is recorded in the store, so a restarted coordinator counts it too.
    fn expire_leases(&mut self) {
        let now = Instant::now();
        for (id, o) in self.leases.take_expired(now) {
            self.rollouts.expired_leases += 1;
            self.turns.remove(&id);
            if self.plan.slots[o.slot].done {
                continue;
            }
            let why = if o.hard_deadline <= now {
                format!("held past lease_max_s = {} s", self.config.lease_max_s)
            } else {
                format!(
                    "not renewed for lease_timeout_s = {} s",
                    self.config.lease_timeout_s
                )
            };
            let attempts = self.plan.slots[o.slot].spent() + 1;
            let expiry = EpisodeEvent {
                episode_id: id.to_string(),
                worker_id: COORDINATOR_WRITER.into(),
                event: Some(episode_event::Event::LeaseExpired(
                    tutor_proto::LeaseExpired {
                        reason: why.clone(),
                        attempts,
                    },
                )),
            };
            if attempts >= self.config.max_attempts {
                tracing::error!(episode = %id, worker = %o.worker_id, attempts, "lease expired ({why}) on the last attempt: the slot is recorded as failed");
            } else {
                tracing::warn!(episode = %id, worker = %o.worker_id, attempt = attempts, "lease expired ({why}): episode goes to another worker");
            }
            let failure = self.attempt_expired(o.slot, &why);
            self.record(std::iter::once(expiry).chain(failure).collect());
        }
        self.workers.forget_silent();
    }

    /// Counts an expired attempt of `slot` (live, or replayed from the store): the slot
    /// is queued for its next attempt, or, its attempts run out, failed; then the failed
    /// slot's outcome, for the store, is returned.
    fn attempt_expired(&mut self, slot: usize, why: &str) -> Option<EpisodeEvent> {
        let state = &mut self.plan.slots[slot];
        state.attempt += 1;
        let attempts = state.spent();
        if attempts < self.config.max_attempts {
            self.leases.queue([slot]);
            return None;
        }
        Some(self.fail_slot(
            slot,
            format!(
                "no attempt of this slot finished: {attempts} leases expired (the last \
                 {why}; max_attempts = {})",
                self.config.max_attempts
            ),
        ))
    }

    /// Records `slot` as failed, its attempts run out: an unresolved outcome
    /// (SANDBOX_ERROR, `error`) counts in the iteration's rollouts (so solve rates count
    /// it as unsolved), no training examples. A later outcome of any attempt of the slot
    /// is acknowledged and dropped, as for any completed slot. Returns the outcome to
    /// store, under an attempt id no lease had (the attempt after the last), written by
    /// "coordinator": replayed after a restart, it completes the slot as any first
    /// outcome does.
    fn fail_slot(&mut self, slot: usize, error: String) -> EpisodeEvent {
        let task = self.task_of(slot).instance_id.clone();
        let purpose = self.plan.slots[slot].purpose;
        let episode_id = self.plan.episode_id(slot, self.generation).to_string();
        self.plan.slots[slot].fail();
        let outcome = tutor_proto::EpisodeOutcome {
            status: tutor_proto::OutcomeStatus::SandboxError as i32,
            error,
            purpose: tutor_proto::EpisodePurpose::from(purpose) as i32,
            iteration: self.plan.iteration,
            instance_id: task,
            policy_version: self.policy.version,
            ..Default::default()
        };
        self.rollouts.failed_slots += 1;
        let event = EpisodeEvent {
            episode_id,
            worker_id: COORDINATOR_WRITER.into(),
            event: Some(episode_event::Event::Outcome(outcome.clone())),
        };
        match purpose {
            Purpose::Train => {
                self.rollouts.train.push(outcome);
                self.completed_train += 1;
            }
            Purpose::Eval => {
                self.rollouts.eval.push(outcome);
                self.completed_eval += 1;
            }
        }
        self.check_iteration_done();
        event
    }

    /// Stores the coordinator's own `events` (lease expiries, failed slots), in order,
    /// in the background: the scheduler has counted them already. A crash before the
    /// write loses them, and the restarted coordinator gives those attempts again.
    fn record(&self, events: Vec<EpisodeEvent>) {
        let Some(store) = self.store.as_ref().and_then(mpsc::WeakSender::upgrade) else {
            return;
        };
        tokio::spawn(async move {
            for event in events {
                let episode = event.episode_id.clone();
                let (reply, answer) = oneshot::channel();
                let written = match store.send(StoreRequest { event, reply }).await {
                    Ok(()) => match answer.await {
                        Ok(r) => r.result.map(drop).map_err(|e| e.to_string()),
                        Err(_) => Err("the store stopped".to_string()),
                    },
                    Err(_) => Err("the store stopped".to_string()),
                };
                match written {
                    Ok(()) => tracing::debug!(episode, "coordinator's record stored"),
                    Err(e) => {
                        tracing::warn!(episode, error = %e, "could not store a lease expiry or failed slot: after a restart that attempt is given again");
                        return;
                    }
                }
            }
        });
    }

    /// The id and slot of an event of the current iteration. An episode this coordinator
    /// did not lease (one leased before a restart) is mapped to its slot, so that it
    /// counts like any other: the first outcome of a slot counts, live or replayed.
    /// None if the event belongs elsewhere.
    fn adopt(&mut self, ev: &EpisodeEvent) -> Option<(EpisodeId, usize)> {
        let id: EpisodeId = ev.episode_id.parse().ok()?;
        if let Some(slot) = self.leases.slot_of(&id) {
            return Some((id, slot));
        }
        if id.slot.iteration != self.plan.iteration {
            return None;
        }
        let fitting = self.plan.slot(&id.slot).filter(|&s| match &ev.event {
            Some(episode_event::Event::Outcome(o)) => {
                o.instance_id.is_empty() || o.instance_id == self.task_of(s).instance_id
            }
            _ => true,
        });
        let Some(slot) = fitting else {
            tracing::warn!(
                episode = %ev.episode_id,
                "stored episode does not fit this iteration's plan (did the task files, the \
                 seed or the episode counts change since the run started?): not counted"
            );
            return None;
        };
        self.leases.adopt(id, slot);
        Some((id, slot))
    }

    /// The iteration of `id` when its slots are not planned yet (it is kept for then).
    fn ahead_of_plan(&self, id: &EpisodeId) -> Option<u32> {
        let iteration = id.slot.iteration;
        match self.plan.planned() {
            Some(p) if iteration <= p => None,
            _ => Some(iteration),
        }
    }

    fn admit(
        &mut self,
        episode_id: &str,
        outcome: Option<&EpisodeEvent>,
        claimed: Option<(String, String)>,
    ) -> Admission {
        let worker = claimed
            .filter(|(id, secret)| self.workers.authenticate(id, secret))
            .map(|(id, _)| id);
        let Ok(id) = episode_id.parse::<EpisodeId>() else {
            // No slot of any iteration: stored, never counted, nothing kept in memory.
            return Admission::Store;
        };
        if self.leases.was_withdrawn(&id) {
            return Admission::Refused(format!(
                "episode {episode_id}: its lease was withdrawn before any worker had it (the \
                 coordinator could not record it); its events are not accepted"
            ));
        }
        if let Some(holder) = self.leases.holder(&id) {
            if worker.as_deref() != Some(holder) {
                let from = match &worker {
                    Some(w) => format!("worker {w}"),
                    None => "a stream that did not prove a worker id".to_string(),
                };
                return Admission::Refused(format!(
                    "episode {episode_id} is leased to worker {holder}; its events are \
                     accepted from that worker only, not from {from}"
                ));
            }
        } else if id.generation == self.generation {
            // This coordinator's own ids are in `holder` from their grant until the next
            // iteration is planned. A late event of an earlier iteration's lease is stored
            // and never counted (as a replay of a stored one is a duplicate); an id it
            // never leased is refused.
            if !self.leases.was_granted(&id) {
                return Admission::Refused(format!(
                    "episode {episode_id} was never leased by this coordinator (generation \
                     {}): its events are not accepted",
                    self.generation
                ));
            }
        } else if id.generation > self.generation {
            return Admission::Refused(format!(
                "episode {episode_id} names generation {}, but this coordinator is generation \
                 {}: no coordinator leased it",
                id.generation, self.generation
            ));
        } else {
            // Leased by an earlier coordinator of this run, which recorded no lease: its
            // events are accepted from a proven worker, for an iteration that coordinator
            // can have run, and from then on from that worker only.
            let Some(w) = worker.as_deref() else {
                return Admission::Refused(format!(
                    "episode {episode_id} was leased before the coordinator restarted; its \
                     events are accepted from a stream that proves a registered worker only"
                ));
            };
            let horizon = self.recovered_horizon + 1;
            if id.slot.iteration > horizon {
                return Admission::Refused(format!(
                    "episode {episode_id} is of iteration {}, which no earlier coordinator of \
                     this run can have leased (its store ends at iteration {})",
                    id.slot.iteration, self.recovered_horizon
                ));
            }
            // The earlier coordinator recorded whom it leased each attempt to before the
            // worker had the lease: from that worker only, and an attempt it recorded no
            // lease of from nobody. (Attempts of older iterations are stored and never
            // counted; the generations of a run started before these records have none,
            // and the first proven worker is bound, as before.)
            let recorded = self
                .lease_records_from
                .is_some_and(|first| id.generation >= first);
            if recorded && id.slot.iteration + 1 >= self.recovered_horizon {
                match self.grants.holder(&id) {
                    Some(h) if h == w => {}
                    Some(h) => {
                        return Admission::Refused(format!(
                            "episode {episode_id} was leased to worker {h} before the \
                             coordinator restarted; its events are accepted from that worker \
                             only, not from worker {w}"
                        ))
                    }
                    None => {
                        return Admission::Refused(format!(
                            "episode {episode_id}: the coordinator of generation {} recorded \
                             no lease of it, so nobody holds it; its events are not accepted",
                            id.generation
                        ))
                    }
                }
            }
            self.leases.bind(id, w);
        }
        match outcome {
            Some(ev) if !self.claim_outcome(ev) => Admission::Superseded,
            _ => Admission::Store,
        }
    }

    fn claim_outcome(&mut self, ev: &EpisodeEvent) -> bool {
        let Ok(id) = ev.episode_id.parse::<EpisodeId>() else {
            return true; // not a coordinator's episode: stored, never counted
        };
        if self.ahead_of_plan(&id).is_some() {
            return self.backlog.claim_early(id);
        }
        let Some((id, slot)) = self.adopt(ev) else {
            return true; // another iteration's episode: stored, never counted
        };
        self.plan.slots[slot].claim(id)
    }

    fn on_stored(&mut self, event: EpisodeEvent) {
        let parsed = event.episode_id.parse::<EpisodeId>().ok();
        if let Some(iteration) = parsed.as_ref().and_then(|id| self.ahead_of_plan(id)) {
            tracing::debug!(episode = %event.episode_id, iteration, "event before its iteration started: kept for then");
            self.backlog.keep(iteration, event);
            return;
        }
        let adopted = self.adopt(&event);
        match (event.event, adopted) {
            (Some(episode_event::Event::Turn(t)), Some((id, _))) => {
                self.turns.entry(id).or_default().push(t);
            }
            (Some(episode_event::Event::Outcome(outcome)), Some((id, slot))) => {
                self.leases.finish(&id);
                let turns = self.turns.remove(&id).unwrap_or_default();
                if self.plan.slots[slot].done {
                    tracing::warn!(episode = %id, "a second attempt finished after the first: not counted");
                    return;
                }
                self.plan.slots[slot].complete(id);
                self.count_outcome(&id, slot, turns, outcome);
                self.check_iteration_done();
            }
            (Some(episode_event::Event::Outcome(_)), None) => {
                tracing::warn!(episode = %event.episode_id, "outcome for an episode of another iteration: stored, not counted");
            }
            // A lease expiry recorded before a restart: the attempt is spent.
            (Some(episode_event::Event::LeaseExpired(e)), Some((id, slot))) => {
                self.leases.finish(&id);
                self.turns.remove(&id);
                if self.plan.slots[slot].done {
                    return;
                }
                tracing::debug!(episode = %id, reason = %e.reason, "replayed lease expiry: counts as a spent attempt");
                // Set when the restart came between the expiry's record and the failed
                // slot's: the slot fails now, and the record is written.
                if let Some(failure) = self.attempt_expired(slot, &e.reason) {
                    self.record(vec![failure]);
                }
            }
            // Turns of an episode of another iteration: stored, not part of this dataset.
            (Some(episode_event::Event::Turn(_) | episode_event::Event::LeaseExpired(_)), None)
            | (None, _) => {}
            // Lease records are read at start (`Grants`), never replayed as events.
            (Some(episode_event::Event::LeaseGranted(_)), _) => {}
        }
    }

    /// Counts the outcome that completed `slot`: the iteration's rollouts, and for a
    /// training episode its examples in the dataset.
    fn count_outcome(
        &mut self,
        id: &EpisodeId,
        slot: usize,
        mut turns: Vec<TurnRecord>,
        outcome: tutor_proto::EpisodeOutcome,
    ) {
        turns.sort_by_key(|t| t.turn_index);
        self.rollouts.count_student_turns(&turns);
        self.rollouts.count_teacher_calls(&turns);
        match self.plan.slots[slot].purpose {
            Purpose::Train => {
                self.rollouts.count_train_turns(&turns);
                let examples = self
                    .config
                    .episode_examples(&id.to_string(), &turns, &outcome);
                let reward = self.config.reward(&outcome);
                if self.config.algorithm == Algorithm::Dapo && is_ungraded(&outcome) {
                    // No verdict, no reward: out of its group (see `is_ungraded`).
                    let status = tutor_proto::OutcomeStatus::try_from(outcome.status)
                        .map(|s| s.as_str_name())
                        .unwrap_or("?");
                    tracing::warn!(
                        episode = %id,
                        task = %outcome.instance_id,
                        status,
                        error = %outcome.error,
                        "the episode ended without a verdict: left out of its DAPO group"
                    );
                } else {
                    self.rollouts.teacher_labels += examples.len() as u64;
                    self.datasets.push(
                        self.plan.iteration,
                        EpisodeData {
                            slot,
                            policy_version: outcome.policy_version,
                            examples,
                            group: self.plan.slots[slot].group,
                            reward,
                        },
                    );
                }
                self.rollouts.train.push(outcome);
                self.completed_train += 1;
            }
            Purpose::Eval => {
                self.rollouts.eval.push(outcome);
                self.completed_eval += 1;
            }
        }
    }

    /// Dynamic sampling's refill (dapo): once every training slot is done, too few kept
    /// groups lease new ones, up to `max_refill_rounds` times. The iteration's rollouts
    /// are complete when every slot is done.
    fn check_iteration_done(&mut self) {
        let iteration = self.plan.iteration;
        if self.plan.train_done() && self.config.algorithm == Algorithm::Dapo {
            let stats = self.datasets.group_stats(iteration);
            let added = self.plan.refill(&self.config, stats);
            if !added.is_empty() {
                self.leases.queue(added);
                return;
            }
        }
        if self.plan.all_done() {
            if let Some(reply) = self.iteration_reply.take() {
                let mut rollouts = std::mem::take(&mut self.rollouts);
                if self.config.algorithm == Algorithm::Dapo {
                    rollouts.groups = self.datasets.group_stats(iteration);
                    rollouts.refill_rounds = self.plan.refills();
                }
                if let Some(mean) = self.datasets.mean_reward(iteration) {
                    rollouts.mean_reward = Some(mean);
                }
                let _ = reply.send(rollouts);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
