//! The scheduler actor: the one owner of leases, episode progress, workers, the policy
//! version and the DAgger dataset. Everything else talks to it through `SchedulerHandle`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use tokio::sync::{mpsc, oneshot};
use tutor_proto::{
    episode_event, EpisodeEvent, EpisodeLease, EpisodeOutcome, EpisodePurpose, HeartbeatResponse,
    LeaseResponse, PolicyVersion, SamplingParams, Task, TrainExample, TurnRecord,
};

use crate::config::CoordinatorConfig;
use crate::dataset::dagger_examples;

/// How often workers heartbeat; a worker silent for three intervals counts as gone.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(1000);

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
}

enum Cmd {
    Register {
        name: String,
        capacity: u32,
        reply: oneshot::Sender<(String, PolicyVersion)>,
    },
    Lease {
        worker_id: String,
        max: u32,
        reply: oneshot::Sender<LeaseResponse>,
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
        aggregate: bool,
        reply: oneshot::Sender<Vec<TrainExample>>,
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
    Finish,
    Tick,
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
    /// Workers heard from within three heartbeat intervals.
    pub live_workers: u64,
    pub train_episodes_completed_total: u64,
    pub eval_episodes_completed_total: u64,
    pub lease_expiries_total: u64,
    pub run_finished: bool,
}

#[derive(Clone)]
pub struct SchedulerHandle {
    tx: mpsc::Sender<Cmd>,
}

impl SchedulerHandle {
    pub fn spawn(config: CoordinatorConfig, train: Vec<Task>, heldout: Vec<Task>) -> Self {
        let (tx, rx) = mpsc::channel(1024);
        let state = Scheduler::new(config, train, heldout);
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
        self.ask(|reply| Cmd::Register {
            name,
            capacity,
            reply,
        })
        .await
    }
    pub async fn lease(&self, worker_id: String, max: u32) -> Option<LeaseResponse> {
        self.ask(|reply| Cmd::Lease {
            worker_id,
            max,
            reply,
        })
        .await
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
    pub async fn examples(&self, aggregate: bool) -> Vec<TrainExample> {
        self.ask(|reply| Cmd::Examples { aggregate, reply })
            .await
            .unwrap_or_default()
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

#[derive(Debug, Clone, Copy, PartialEq)]
enum SlotKind {
    Train,
    Eval,
}

struct Slot {
    kind: SlotKind,
    task: usize,
    attempt: u32,
    done: bool,
}

struct Outstanding {
    slot: usize,
    worker_id: String,
    deadline: Instant,
}

struct WorkerInfo {
    name: String,
    last_seen: Instant,
    loaded: u64,
}

struct Scheduler {
    config: CoordinatorConfig,
    train_tasks: Vec<Task>,
    heldout_tasks: Vec<Task>,
    policy: PolicyVersion,
    iteration: u32,
    beta: f64,
    slots: Vec<Slot>,
    pending: VecDeque<usize>,
    outstanding: HashMap<String, Outstanding>,
    /// Every episode id ever leased in this iteration → its slot.
    episode_slot: HashMap<String, usize>,
    turns: HashMap<String, Vec<TurnRecord>>,
    rollouts: IterationRollouts,
    iteration_reply: Option<oneshot::Sender<IterationRollouts>>,
    datasets: Vec<Vec<TrainExample>>,
    workers: HashMap<String, WorkerInfo>,
    next_worker: u32,
    finished: bool,
    /// Since start, across iterations: counted episodes by purpose, expired leases.
    completed_train: u64,
    completed_eval: u64,
    lease_expiries: u64,
    rng: rand_chacha::ChaCha8Rng,
}

impl Scheduler {
    fn new(config: CoordinatorConfig, train_tasks: Vec<Task>, heldout_tasks: Vec<Task>) -> Self {
        let rng = rand_chacha::ChaCha8Rng::seed_from_u64(config.seed);
        Self {
            config,
            train_tasks,
            heldout_tasks,
            policy: PolicyVersion::default(),
            iteration: 0,
            beta: 1.0,
            slots: Vec::new(),
            pending: VecDeque::new(),
            outstanding: HashMap::new(),
            episode_slot: HashMap::new(),
            turns: HashMap::new(),
            rollouts: IterationRollouts::default(),
            iteration_reply: None,
            datasets: Vec::new(),
            workers: HashMap::new(),
            next_worker: 0,
            finished: false,
            completed_train: 0,
            completed_eval: 0,
            lease_expiries: 0,
            rng,
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
                    let id = format!("{name}-{}", self.next_worker);
                    self.next_worker += 1;
                    tracing::info!(worker = %id, capacity, "worker registered");
                    self.workers.insert(
                        id.clone(),
                        WorkerInfo {
                            name,
                            last_seen: Instant::now(),
                            loaded: u64::MAX,
                        },
                    );
                    let _ = reply.send((id, self.policy.clone()));
                }
                Cmd::Lease {
                    worker_id,
                    max,
                    reply,
                } => {
                    let _ = reply.send(self.lease(&worker_id, max));
                }
                Cmd::Stored { event } => self.on_stored(*event),
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
                Cmd::Examples { aggregate, reply } => {
                    let ex = if aggregate {
                        self.datasets.iter().flatten().cloned().collect()
                    } else {
                        self.datasets.last().cloned().unwrap_or_default()
                    };
                    let _ = reply.send(ex);
                }
                Cmd::WorkerVersions { reply } => {
                    let v = self
                        .live_workers()
                        .map(|(id, w)| (id.clone(), w.loaded))
                        .collect();
                    let _ = reply.send(v);
                }
                Cmd::Snapshot { reply } => {
                    let _ = reply.send(self.snapshot());
                }
                Cmd::Progress { reply } => {
                    let done = self.slots.iter().filter(|s| s.done).count() as u32;
                    let _ = reply.send((done, self.slots.len() as u32));
                }
                Cmd::Finish => self.finished = true,
                Cmd::Tick => self.expire_leases(),
            }
        }
    }

    fn live_workers(&self) -> impl Iterator<Item = (&String, &WorkerInfo)> {
        let live = HEARTBEAT_INTERVAL * 3;
        self.workers
            .iter()
            .filter(move |(_, w)| w.last_seen.elapsed() < live)
    }

    fn snapshot(&self) -> SchedulerSnapshot {
        SchedulerSnapshot {
            policy_version: self.policy.version,
            iteration: self.iteration,
            pending_episodes: self.pending.len() as u64,
            outstanding_leases: self.outstanding.len() as u64,
            live_workers: self.live_workers().count() as u64,
            train_episodes_completed_total: self.completed_train,
            eval_episodes_completed_total: self.completed_eval,
            lease_expiries_total: self.lease_expiries,
            run_finished: self.finished,
        }
    }

    fn start_iteration(
        &mut self,
        iteration: u32,
        beta: f64,
        reply: oneshot::Sender<IterationRollouts>,
    ) {
        self.iteration = iteration;
        self.beta = beta;
        self.slots.clear();
        self.pending.clear();
        self.outstanding.clear();
        self.episode_slot.clear();
        self.turns.clear();
        self.rollouts = IterationRollouts::default();
        self.datasets.push(Vec::new());
        let mut order: Vec<usize> = (0..self.train_tasks.len()).collect();
        order.shuffle(&mut self.rng);
        for k in 0..self.config.episodes_per_iteration as usize {
            if order.is_empty() {
                break;
            }
            self.slots.push(Slot {
                kind: SlotKind::Train,
                task: order[k % order.len()],
                attempt: 0,
                done: false,
            });
        }
        // The same held-out tasks every iteration, so solve rates compare across iterations.
        for k in 0..self.config.heldout_episodes as usize {
            if self.heldout_tasks.is_empty() {
                break;
            }
            self.slots.push(Slot {
                kind: SlotKind::Eval,
                task: k % self.heldout_tasks.len(),
                attempt: 0,
                done: false,
            });
        }
        self.pending = (0..self.slots.len()).collect();
        tracing::info!(
            iteration,
            beta,
            episodes = self.slots.len(),
            "iteration started"
        );
        self.iteration_reply = Some(reply);
        self.check_iteration_done();
    }

    fn episode_id(&self, slot: usize) -> String {
        let s = &self.slots[slot];
        let kind = if s.kind == SlotKind::Train {
            "train"
        } else {
            "eval"
        };
        format!("it{:03}-{kind}{slot:04}-a{}", self.iteration, s.attempt)
    }

    fn lease(&mut self, worker_id: &str, max: u32) -> LeaseResponse {
        if let Some(w) = self.workers.get_mut(worker_id) {
            w.last_seen = Instant::now();
        } else {
            tracing::warn!(
                worker = worker_id,
                "lease request from an unregistered worker"
            );
        }
        if self.finished {
            return LeaseResponse {
                run_finished: true,
                ..Default::default()
            };
        }
        let mut leases = Vec::new();
        while (leases.len() as u32) < max.max(1) {
            let Some(slot) = self.pending.pop_front() else {
                break;
            };
            let episode_id = self.episode_id(slot);
            let s = &self.slots[slot];
            let (task, beta, temperature, purpose) = match s.kind {
                SlotKind::Train => (
                    self.train_tasks[s.task].clone(),
                    self.beta,
                    self.config.temperature,
                    EpisodePurpose::Train,
                ),
                SlotKind::Eval => (
                    self.heldout_tasks[s.task].clone(),
                    0.0,
                    self.config.eval_temperature,
                    EpisodePurpose::Eval,
                ),
            };
            let seed = self.config.seed
                ^ ((self.iteration as u64) << 40)
                ^ ((slot as u64) << 8)
                ^ s.attempt as u64;
            let timeout = Duration::from_secs_f64(self.config.lease_timeout_s);
            let deadline_ms = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                + timeout;
            leases.push(EpisodeLease {
                episode_id: episode_id.clone(),
                task: Some(task),
                beta,
                policy: Some(self.policy.clone()),
                sampling: Some(SamplingParams {
                    temperature,
                    max_new_tokens: self.config.max_new_tokens,
                    seed,
                }),
                max_turns: self.config.max_turns,
                command_timeout_ms: (self.config.command_timeout_s * 1000.0) as u32,
                observation_max_chars: self.config.observation_max_chars,
                purpose: purpose as i32,
                iteration: self.iteration,
                deadline_unix_ms: deadline_ms.as_millis() as u64,
                seed,
            });
            self.episode_slot.insert(episode_id.clone(), slot);
            self.outstanding.insert(
                episode_id,
                Outstanding {
                    slot,
                    worker_id: worker_id.to_string(),
                    deadline: Instant::now() + timeout,
                },
            );
        }
        let retry_after_ms = if leases.is_empty() { 200 } else { 0 };
        LeaseResponse {
            leases,
            run_finished: false,
            retry_after_ms,
        }
    }

    fn heartbeat(&mut self, worker_id: &str, active: &[String], loaded: u64) -> HeartbeatResponse {
        let renew = Instant::now() + Duration::from_secs_f64(self.config.lease_timeout_s);
        match self.workers.get_mut(worker_id) {
            Some(w) => {
                w.last_seen = Instant::now();
                w.loaded = loaded;
            }
            None => {
                tracing::warn!(
                    worker = worker_id,
                    "heartbeat from an unknown worker: registering it"
                );
                self.workers.insert(
                    worker_id.to_string(),
                    WorkerInfo {
                        name: worker_id.to_string(),
                        last_seen: Instant::now(),
                        loaded,
                    },
                );
            }
        }
        for ep in active {
            if let Some(o) = self.outstanding.get_mut(ep) {
                if o.worker_id == worker_id {
                    o.deadline = renew;
                }
            }
        }
        HeartbeatResponse {
            latest: Some(self.policy.clone()),
            shutdown: self.finished,
        }
    }

    fn expire_leases(&mut self) {
        let now = Instant::now();
        let expired: Vec<String> = self
            .outstanding
            .iter()
            .filter(|(_, o)| o.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            let o = self.outstanding.remove(&id).expect("listed above");
            self.rollouts.expired_leases += 1;
            self.lease_expiries += 1;
            self.turns.remove(&id);
            let slot = &mut self.slots[o.slot];
            if !slot.done {
                slot.attempt += 1;
                tracing::warn!(episode = %id, worker = %o.worker_id, "lease expired: episode goes to another worker");
                self.pending.push_back(o.slot);
            }
        }
        let live = HEARTBEAT_INTERVAL * 30;
        self.workers.retain(|id, w| {
            let keep = w.last_seen.elapsed() < live;
            if !keep {
                tracing::warn!(worker = %id, name = %w.name, "worker silent: forgotten");
            }
            keep
        });
    }

    fn on_stored(&mut self, event: EpisodeEvent) {
        let id = event.episode_id.clone();
        match event.event {
            Some(episode_event::Event::Turn(t)) if self.episode_slot.contains_key(&id) => {
                self.turns.entry(id).or_default().push(t);
            }
            Some(episode_event::Event::Outcome(outcome)) => {
                let Some(&slot) = self.episode_slot.get(&id) else {
                    tracing::warn!(episode = %id, "outcome for an episode of another iteration: stored, not counted");
                    return;
                };
                self.outstanding.remove(&id);
                let mut turns = self.turns.remove(&id).unwrap_or_default();
                if self.slots[slot].done {
                    tracing::warn!(episode = %id, "a second attempt finished after the first: not counted");
                    return;
                }
                self.slots[slot].done = true;
                turns.sort_by_key(|t| t.turn_index);
                for t in &turns {
                    if t.student_generated {
                        self.rollouts.student_turns += 1;
                        self.rollouts.agreements += t.agreement as u64;
                        self.rollouts.student_format_errors += t.student_format_error as u64;
                    }
                }
                match self.slots[slot].kind {
                    SlotKind::Train => {
                        let examples = dagger_examples(&id, &turns, self.config.max_seq_len);
                        self.rollouts.teacher_labels += examples.len() as u64;
                        self.datasets
                            .last_mut()
                            .expect("an iteration is running")
                            .extend(examples);
                        self.rollouts.train.push(outcome);
                        self.completed_train += 1;
                    }
                    SlotKind::Eval => {
                        self.rollouts.eval.push(outcome);
                        self.completed_eval += 1;
                    }
                }
                self.check_iteration_done();
            }
            // Turns of an episode of another iteration: stored, not part of this dataset.
            Some(episode_event::Event::Turn(_)) | None => {}
        }
    }

    fn check_iteration_done(&mut self) {
        if self.slots.iter().all(|s| s.done) {
            if let Some(reply) = self.iteration_reply.take() {
                let _ = reply.send(std::mem::take(&mut self.rollouts));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(episode_id: &str) -> EpisodeEvent {
        EpisodeEvent {
            episode_id: episode_id.to_string(),
            worker_id: "w-0".into(),
            event: Some(episode_event::Event::Outcome(EpisodeOutcome::default())),
        }
    }

    #[tokio::test]
    async fn snapshot_counts_completions_by_purpose_expiries_and_the_queue() {
        let config = CoordinatorConfig {
            episodes_per_iteration: 2,
            heldout_episodes: 1,
            lease_timeout_s: 0.05,
            ..Default::default()
        };
        let sched = SchedulerHandle::spawn(config, vec![Task::default()], vec![Task::default()]);
        let (worker, _) = sched.register("w".into(), 4).await.unwrap();
        sched
            .set_policy(PolicyVersion {
                version: 7,
                ..Default::default()
            })
            .await;
        let runner = sched.clone();
        let iteration = tokio::spawn(async move { runner.run_iteration(0, 1.0).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let s = sched.snapshot().await.unwrap();
        assert_eq!(
            (s.policy_version, s.pending_episodes, s.live_workers),
            (7, 3, 1)
        );

        // A lease nobody renews expires and goes back to the queue.
        let first = sched.lease(worker.clone(), 1).await.unwrap();
        assert_eq!(first.leases.len(), 1);
        assert_eq!(sched.snapshot().await.unwrap().outstanding_leases, 1);
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let s = sched.snapshot().await.unwrap();
        assert_eq!(
            (s.lease_expiries_total, s.pending_episodes),
            (1, 3),
            "{s:?}"
        );

        let leases = sched.lease(worker.clone(), 3).await.unwrap().leases;
        assert_eq!(leases.len(), 3);
        for l in &leases {
            sched.stored(outcome(&l.episode_id)).await;
        }
        let rollouts = iteration.await.unwrap().unwrap();
        assert_eq!((rollouts.train.len(), rollouts.eval.len()), (2, 1));
        let s = sched.snapshot().await.unwrap();
        assert_eq!(
            (
                s.train_episodes_completed_total,
                s.eval_episodes_completed_total,
                s.pending_episodes,
                s.outstanding_leases
            ),
            (2, 1, 0, 0),
            "{s:?}"
        );
        assert!(!s.run_finished);
        sched.finish().await;
        assert!(sched.snapshot().await.unwrap().run_finished);
    }
}
