//! The scheduler actor: the one owner of leases, episode progress, workers, the policy
//! version and the DAgger dataset. Everything else talks to it through `SchedulerHandle`.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use tokio::sync::{mpsc, oneshot};
use tutor_proto::{
    episode_event, EpisodeEvent, EpisodeLease, EpisodeOutcome, EpisodePurpose, HeartbeatResponse,
    LeaseResponse, PolicyVersion, SamplingParams, Task, TrainExample, TurnRecord,
};

use crate::algorithms::{dapo_examples, group_stats, GroupStats, GroupedEpisode};
use crate::config::{Algorithm, CoordinatorConfig, ScheduleMode};

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
    /// dapo: groups dynamic sampling kept and dropped, refill rounds run, and the mean
    /// reward of the training episodes.
    pub groups: GroupStats,
    pub refill_rounds: u32,
    pub mean_reward: f64,
}

/// What a restarted coordinator hands its scheduler: its generation (see
/// `RunState::generation`) and every event the store holds, in store order.
#[derive(Debug, Default)]
pub struct Recovery {
    pub generation: u64,
    pub history: Vec<EpisodeEvent>,
}

/// The training examples of one counted training episode, with the policy version the
/// episode was sampled with (for the staleness filter), its group and its reward (dapo).
struct EpisodeData {
    policy_version: u64,
    examples: Vec<TrainExample>,
    group: u32,
    reward: f64,
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
    /// May this outcome be stored? Claims its slot for the attempt (see
    /// `Slot::claimed_by`); false when another attempt already completed or claimed it.
    ClaimOutcome {
        event: Box<EpisodeEvent>,
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
        let (tx, rx) = mpsc::channel(1024);
        let state = Scheduler::new(config, train, heldout, recovery);
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
    /// it), less the episodes the staleness filter left out.
    pub async fn examples(&self, iteration: u32, aggregate: bool) -> Vec<TrainExample> {
        self.ask(|reply| Cmd::Examples {
            iteration,
            aggregate,
            reply,
        })
        .await
        .unwrap_or_default()
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

#[derive(Debug, Clone, Copy, PartialEq)]
enum SlotKind {
    Train,
    Eval,
}

struct Slot {
    kind: SlotKind,
    task: usize,
    /// The samples of one task in one round share a group (dapo's G, rft's K).
    group: u32,
    attempt: u32,
    done: bool,
    /// The attempt whose outcome completes this slot: the first whose outcome reached
    /// the coordinator. Another attempt's outcome is acknowledged and dropped, so the
    /// store completes every slot exactly once.
    claimed_by: Option<String>,
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
    /// This iteration's shuffled training tasks; group k samples `train_order[k % len]`.
    train_order: Vec<usize>,
    groups_planned: u32,
    /// dapo: rounds of new groups leased after the first (dynamic sampling's refill).
    refills: u32,
    pending: VecDeque<usize>,
    outstanding: HashMap<String, Outstanding>,
    /// Every episode id ever leased in this iteration → its slot.
    episode_slot: HashMap<String, usize>,
    turns: HashMap<String, Vec<TurnRecord>>,
    rollouts: IterationRollouts,
    iteration_reply: Option<oneshot::Sender<IterationRollouts>>,
    /// Counted training episodes by iteration.
    datasets: BTreeMap<u32, Vec<EpisodeData>>,
    /// Per iteration whose training started: the learner version it started from, and
    /// how many of its episodes the staleness filter left out.
    train_bases: BTreeMap<u32, u64>,
    stale: BTreeMap<u32, u64>,
    workers: HashMap<String, WorkerInfo>,
    next_worker: u32,
    generation: u64,
    /// Stored events by iteration, not yet replayed (see `start_iteration`). Events that
    /// arrive for an iteration not planned yet (a worker that carries on with its episode
    /// while a restarted coordinator is still connecting to the learner) join them.
    history: BTreeMap<u32, Vec<EpisodeEvent>>,
    /// The iteration whose slots exist (`plan`), None before the first.
    planned: Option<u32>,
    /// Outcomes claimed before their iteration was planned: slot ("it000-train0002") →
    /// the attempt that claimed it, so a second attempt is refused as it would be later.
    early_claims: HashMap<String, String>,
    finished: bool,
    draining: bool,
    /// Since start, across iterations: counted episodes by purpose, expired leases.
    completed_train: u64,
    completed_eval: u64,
    lease_expiries: u64,
}

impl Scheduler {
    fn new(
        config: CoordinatorConfig,
        train_tasks: Vec<Task>,
        heldout_tasks: Vec<Task>,
        recovery: Recovery,
    ) -> Self {
        let mut history: BTreeMap<u32, Vec<EpisodeEvent>> = BTreeMap::new();
        for ev in recovery.history {
            match parse_episode_id(&ev.episode_id) {
                Some((iteration, _, _)) => history.entry(iteration).or_default().push(ev),
                None => {
                    tracing::warn!(episode = %ev.episode_id, "stored episode id not made by a coordinator: ignored")
                }
            }
        }
        Self {
            config,
            train_tasks,
            heldout_tasks,
            policy: PolicyVersion::default(),
            iteration: 0,
            beta: 1.0,
            slots: Vec::new(),
            train_order: Vec::new(),
            groups_planned: 0,
            refills: 0,
            pending: VecDeque::new(),
            outstanding: HashMap::new(),
            episode_slot: HashMap::new(),
            turns: HashMap::new(),
            rollouts: IterationRollouts::default(),
            iteration_reply: None,
            datasets: BTreeMap::new(),
            train_bases: BTreeMap::new(),
            stale: BTreeMap::new(),
            workers: HashMap::new(),
            next_worker: 0,
            generation: recovery.generation,
            history,
            planned: None,
            early_claims: HashMap::new(),
            finished: false,
            draining: false,
            completed_train: 0,
            completed_eval: 0,
            lease_expiries: 0,
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
                    // The generation keeps ids unique across coordinator restarts.
                    let id = format!("{name}-g{}-{}", self.generation, self.next_worker);
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
                Cmd::ClaimOutcome { event, reply } => {
                    let _ = reply.send(self.claim_outcome(&event));
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
                    let _ = reply.send(self.examples(iteration, aggregate));
                }
                Cmd::TeacherLabels { iteration, reply } => {
                    let n = self
                        .datasets
                        .range(..=iteration)
                        .flat_map(|(_, eps)| eps)
                        .map(|e| e.examples.len() as u64)
                        .sum();
                    let _ = reply.send(n);
                }
                Cmd::Seal {
                    iteration,
                    base_version,
                    reply,
                } => {
                    self.train_bases.insert(iteration, base_version);
                    let stale = self
                        .datasets
                        .get(&iteration)
                        .map(|eps| eps.iter().filter(|e| self.is_stale(iteration, e)).count())
                        .unwrap_or(0) as u64;
                    if stale > 0 {
                        tracing::warn!(
                            iteration,
                            stale,
                            base_version,
                            max_staleness = self.config.max_staleness,
                            "episodes too stale to train on"
                        );
                    }
                    self.stale.insert(iteration, stale);
                    let _ = reply.send(stale);
                }
                Cmd::Drain => {
                    tracing::info!(
                        outstanding = self.outstanding.len(),
                        "draining: no new leases"
                    );
                    self.draining = true;
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
            outstanding_live_leases: {
                let live: HashSet<&String> = self.live_workers().map(|(id, _)| id).collect();
                self.outstanding
                    .values()
                    .filter(|o| live.contains(&o.worker_id))
                    .count() as u64
            },
            live_workers: self.live_workers().count() as u64,
            train_episodes_completed_total: self.completed_train,
            eval_episodes_completed_total: self.completed_eval,
            lease_expiries_total: self.lease_expiries,
            stale_episodes_total: self.stale.values().sum(),
            run_finished: self.finished,
            draining: self.draining,
        }
    }

    /// Whether an episode of `iteration` lags the version its training started from by
    /// more than `max_staleness`. Only async mode filters: in sync mode an iteration's
    /// episodes are sampled with the version its training starts from.
    fn is_stale(&self, iteration: u32, e: &EpisodeData) -> bool {
        self.config.mode == ScheduleMode::Async
            && self.train_bases.get(&iteration).is_some_and(|base| {
                base.saturating_sub(e.policy_version) > self.config.max_staleness
            })
    }

    fn examples(&self, iteration: u32, aggregate: bool) -> Vec<TrainExample> {
        let first = if aggregate { 0 } else { iteration };
        if self.config.algorithm == Algorithm::Dapo {
            // Advantages are normalised within each iteration's groups.
            return self
                .datasets
                .range(first..=iteration)
                .flat_map(|(&k, eps)| {
                    let grouped: Vec<GroupedEpisode> = eps
                        .iter()
                        .filter(|e| !self.is_stale(k, e))
                        .map(|e| GroupedEpisode {
                            group: e.group,
                            reward: e.reward,
                            examples: &e.examples,
                        })
                        .collect();
                    dapo_examples(&grouped, self.config.advantage_eps).0
                })
                .collect();
        }
        self.datasets
            .range(first..=iteration)
            .flat_map(|(&k, eps)| eps.iter().map(move |e| (k, e)))
            .filter(|(k, e)| !self.is_stale(*k, e))
            .flat_map(|(_, e)| e.examples.iter().cloned())
            .collect()
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
        let past: Vec<u32> = self.history.range(..iteration).map(|(k, _)| *k).collect();
        for k in past {
            let events = self.history.remove(&k).expect("listed above");
            self.plan(k, 0.0);
            self.replay(events);
        }
        self.plan(iteration, beta);
        if let Some(events) = self.history.remove(&iteration) {
            self.replay(events);
        }
        let leased: HashSet<usize> = self.outstanding.values().map(|o| o.slot).collect();
        self.pending = (0..self.slots.len())
            .filter(|s| !self.slots[*s].done && !leased.contains(s))
            .collect();
        let done = self.slots.iter().filter(|s| s.done).count();
        tracing::info!(
            iteration,
            beta,
            kappa = ?self.config.kappa_at(iteration),
            episodes = self.slots.len(),
            recovered_done = done,
            recovered_leased = leased.len(),
            "iteration started"
        );
        self.iteration_reply = Some(reply);
        self.check_iteration_done();
    }

    /// The slots of `iteration`: the same for a given seed and task list, so a restarted
    /// coordinator maps stored episodes to the slots they were leased for.
    fn plan(&mut self, iteration: u32, beta: f64) {
        self.iteration = iteration;
        self.planned = Some(iteration);
        self.beta = beta;
        self.slots.clear();
        self.groups_planned = 0;
        self.refills = 0;
        self.pending.clear();
        self.outstanding.clear();
        self.episode_slot.clear();
        self.turns.clear();
        self.rollouts = IterationRollouts::default();
        self.datasets.insert(iteration, Vec::new());
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
            self.config.seed ^ (u64::from(iteration) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        );
        let mut order: Vec<usize> = (0..self.train_tasks.len()).collect();
        order.shuffle(&mut rng);
        self.train_order = order;
        self.add_train_groups(self.config.first_round_groups());
        // The same held-out tasks every iteration, so solve rates compare across iterations.
        for k in 0..self.config.heldout_episodes as usize {
            if self.heldout_tasks.is_empty() {
                break;
            }
            self.slots.push(Slot {
                kind: SlotKind::Eval,
                task: k % self.heldout_tasks.len(),
                group: 0,
                attempt: 0,
                done: false,
                claimed_by: None,
            });
        }
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
            for _ in 0..self.config.samples_per_group() {
                added.push(self.slots.len());
                self.slots.push(Slot {
                    kind: SlotKind::Train,
                    task,
                    group,
                    attempt: 0,
                    done: false,
                    claimed_by: None,
                });
            }
        }
        added
    }

    /// Feeds stored events of the planned iteration through `on_stored`, as if they had
    /// just arrived, in store order (so the first outcome of a slot is the counted one,
    /// as it was). Episodes with turns and no outcome stay leased to their worker.
    fn replay(&mut self, events: Vec<EpisodeEvent>) {
        let deadline = Instant::now() + Duration::from_secs_f64(self.config.lease_timeout_s);
        let mut open: HashMap<String, (usize, String)> = HashMap::new();
        for ev in events {
            if !self.adopt(&ev) {
                continue;
            }
            let slot = self.episode_slot[&ev.episode_id];
            if matches!(ev.event, Some(episode_event::Event::Outcome(_))) {
                open.remove(&ev.episode_id);
            } else {
                open.insert(ev.episode_id.clone(), (slot, ev.worker_id.clone()));
            }
            self.on_stored(ev);
        }
        for (id, (slot, worker_id)) in open {
            if self.slots[slot].done {
                self.turns.remove(&id);
            } else {
                self.outstanding.insert(
                    id,
                    Outstanding {
                        slot,
                        worker_id,
                        deadline,
                    },
                );
            }
        }
    }

    fn episode_id(&self, slot: usize) -> String {
        let s = &self.slots[slot];
        let kind = if s.kind == SlotKind::Train {
            "train"
        } else {
            "eval"
        };
        format!(
            "it{:03}-{kind}{slot:04}-g{}a{}",
            self.iteration, self.generation, s.attempt
        )
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
        if self.draining {
            return LeaseResponse {
                retry_after_ms: 1000,
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
                    unbiased: purpose == EpisodePurpose::Train && self.config.samples_unbiased(),
                }),
                max_turns: self.config.max_turns,
                command_timeout_ms: (self.config.command_timeout_s * 1000.0) as u32,
                observation_max_chars: self.config.observation_max_chars,
                purpose: purpose as i32,
                iteration: self.iteration,
                deadline_unix_ms: deadline_ms.as_millis() as u64,
                seed,
                student_turns: match purpose {
                    EpisodePurpose::Train => self.config.kappa_at(self.iteration),
                    _ => None,
                },
                score_student: purpose == EpisodePurpose::Train
                    && self.config.algorithm == Algorithm::Distill,
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

    /// Maps an episode of the current iteration that this coordinator did not lease (one
    /// leased before a restart) to its slot, so that it counts like any other: the first
    /// outcome of a slot counts, live or replayed. False if the event belongs elsewhere.
    fn adopt(&mut self, ev: &EpisodeEvent) -> bool {
        if self.episode_slot.contains_key(&ev.episode_id) {
            return true;
        }
        let Some((iteration, kind, slot)) = parse_episode_id(&ev.episode_id) else {
            return false;
        };
        if iteration != self.iteration {
            return false;
        }
        let task = self
            .slots
            .get(slot)
            .filter(|s| s.kind == kind)
            .map(|s| match kind {
                SlotKind::Train => &self.train_tasks[s.task],
                SlotKind::Eval => &self.heldout_tasks[s.task],
            });
        let fits = match (task, &ev.event) {
            (None, _) => false,
            (Some(t), Some(episode_event::Event::Outcome(o))) => {
                o.instance_id.is_empty() || o.instance_id == t.instance_id
            }
            _ => true,
        };
        if !fits {
            tracing::warn!(
                episode = %ev.episode_id,
                "stored episode does not fit this iteration's plan (did the task files, the \
                 seed or the episode counts change since the run started?): not counted"
            );
            return false;
        }
        self.episode_slot.insert(ev.episode_id.clone(), slot);
        true
    }

    /// The iteration of `ev` when its slots are not planned yet (it is kept for then).
    fn ahead_of_plan(&self, ev: &EpisodeEvent) -> Option<u32> {
        let (iteration, _, _) = parse_episode_id(&ev.episode_id)?;
        match self.planned {
            Some(p) if iteration <= p => None,
            _ => Some(iteration),
        }
    }

    fn claim_outcome(&mut self, ev: &EpisodeEvent) -> bool {
        if self.ahead_of_plan(ev).is_some() {
            let slot = ev
                .episode_id
                .rsplit_once('-')
                .map_or(ev.episode_id.as_str(), |(slot, _)| slot);
            let claimant = self
                .early_claims
                .entry(slot.to_string())
                .or_insert_with(|| ev.episode_id.clone());
            return claimant == &ev.episode_id;
        }
        if !self.adopt(ev) {
            return true; // another iteration's episode: stored, never counted
        }
        let Some(&slot) = self.episode_slot.get(&ev.episode_id) else {
            return true;
        };
        let s = &mut self.slots[slot];
        match &s.claimed_by {
            Some(c) => c == &ev.episode_id,
            None if s.done => false,
            None => {
                s.claimed_by = Some(ev.episode_id.clone());
                true
            }
        }
    }

    fn on_stored(&mut self, event: EpisodeEvent) {
        if let Some(iteration) = self.ahead_of_plan(&event) {
            tracing::debug!(episode = %event.episode_id, iteration, "event before its iteration started: kept for then");
            self.history.entry(iteration).or_default().push(event);
            return;
        }
        self.adopt(&event);
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
                self.slots[slot]
                    .claimed_by
                    .get_or_insert_with(|| id.clone());
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
                        let examples = self.config.episode_examples(&id, &turns, &outcome);
                        self.rollouts.teacher_labels += examples.len() as u64;
                        let reward = self.config.reward(&outcome);
                        self.datasets
                            .entry(self.iteration)
                            .or_default()
                            .push(EpisodeData {
                                policy_version: outcome.policy_version,
                                examples,
                                group: self.slots[slot].group,
                                reward,
                            });
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

    /// Dynamic sampling's refill (dapo): once every training slot is done, too few kept
    /// groups lease new ones, up to `max_refill_rounds` times. The iteration's rollouts
    /// are complete when every slot is done.
    fn check_iteration_done(&mut self) {
        let train_done = self
            .slots
            .iter()
            .all(|s| s.done || s.kind != SlotKind::Train);
        if train_done && self.config.algorithm == Algorithm::Dapo {
            let stats = self.group_stats();
            if let Some(n) = self.config.refill_groups(stats.kept, self.refills) {
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
                    self.pending.extend(added);
                    return;
                }
            }
        }
        if self.slots.iter().all(|s| s.done) {
            if let Some(reply) = self.iteration_reply.take() {
                let mut rollouts = std::mem::take(&mut self.rollouts);
                if self.config.algorithm == Algorithm::Dapo {
                    rollouts.groups = self.group_stats();
                    rollouts.refill_rounds = self.refills;
                }
                let rewards: Vec<f64> = self
                    .datasets
                    .get(&self.iteration)
                    .map(|eps| eps.iter().map(|e| e.reward).collect())
                    .unwrap_or_default();
                if !rewards.is_empty() {
                    rollouts.mean_reward = rewards.iter().sum::<f64>() / rewards.len() as f64;
                }
                let _ = reply.send(rollouts);
            }
        }
    }

    /// Kept and dropped groups among the current iteration's finished episodes.
    fn group_stats(&self) -> GroupStats {
        group_stats(
            self.datasets
                .get(&self.iteration)
                .into_iter()
                .flatten()
                .map(|e| (e.group, e.reward)),
        )
    }
}

/// (iteration, kind, slot) of an episode id made by `Scheduler::episode_id`.
fn parse_episode_id(id: &str) -> Option<(u32, SlotKind, usize)> {
    let mut parts = id.splitn(3, '-');
    let iteration = parts.next()?.strip_prefix("it")?.parse().ok()?;
    let slot = parts.next()?;
    let (kind, slot) = if let Some(n) = slot.strip_prefix("train") {
        (SlotKind::Train, n)
    } else {
        (SlotKind::Eval, slot.strip_prefix("eval")?)
    };
    Some((iteration, kind, slot.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn outcome(episode_id: &str) -> EpisodeEvent {
        EpisodeEvent {
            episode_id: episode_id.to_string(),
            worker_id: "w-0".into(),
            event: Some(episode_event::Event::Outcome(EpisodeOutcome::default())),
        }
    }

    /// Three training episodes sampled with versions 1, 2 and 3; training starts from
    /// version 3. With max_staleness 1 the version-1 episode (lag 2) is left out of
    /// training and counted; sync mode trains on everything.
    async fn stale_filter(mode: ScheduleMode) -> (u64, Vec<String>, u64) {
        let config = CoordinatorConfig {
            episodes_per_iteration: 3,
            heldout_episodes: 0,
            mode,
            max_staleness: 1,
            ..Default::default()
        };
        let sched = SchedulerHandle::spawn(config, vec![Task::default()], vec![]);
        let (worker, _) = sched.register("w".into(), 4).await.unwrap();
        let runner = sched.clone();
        let iteration = tokio::spawn(async move { runner.run_iteration(0, 1.0).await });
        let mut leases = Vec::new();
        while leases.len() < 3 {
            leases.extend(sched.lease(worker.clone(), 3).await.unwrap().leases);
        }
        for (l, version) in leases.iter().zip([1u64, 2, 3]) {
            sched
                .stored(EpisodeEvent {
                    episode_id: l.episode_id.clone(),
                    worker_id: worker.clone(),
                    event: Some(episode_event::Event::Turn(TurnRecord {
                        teacher_tokens: vec![7],
                        policy_version: version,
                        ..Default::default()
                    })),
                })
                .await;
            let mut ev = outcome(&l.episode_id);
            if let Some(episode_event::Event::Outcome(o)) = ev.event.as_mut() {
                o.policy_version = version;
            }
            sched.stored(ev).await;
        }
        iteration.await.unwrap().unwrap();
        let stale = sched.seal(0, 3).await;
        let trained = sched
            .examples(0, true)
            .await
            .into_iter()
            .map(|e| e.episode_id)
            .collect();
        let total = sched.snapshot().await.unwrap().stale_episodes_total;
        assert_eq!(total, stale);
        (stale, trained, leases.len() as u64)
    }

    #[tokio::test]
    async fn async_mode_leaves_out_episodes_staler_than_max_staleness() {
        let (stale, trained, _) = stale_filter(ScheduleMode::Async).await;
        assert_eq!(stale, 1);
        assert_eq!(trained.len(), 2, "{trained:?}");
        assert!(
            trained.iter().all(|id| id != "it000-train0000-g0a0"),
            "{trained:?}"
        );
        let (stale, trained, _) = stale_filter(ScheduleMode::Sync).await;
        assert_eq!((stale, trained.len()), (0, 3));
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

#[cfg(test)]
mod sampling_tests {
    use super::*;

    async fn leased(unbiased: bool) -> Vec<EpisodeLease> {
        let config = CoordinatorConfig {
            episodes_per_iteration: 2,
            heldout_episodes: 1,
            temperature: 0.7,
            unbiased_sampling: unbiased,
            ..Default::default()
        };
        let sched = SchedulerHandle::spawn(config, vec![Task::default()], vec![Task::default()]);
        let (worker, _) = sched.register("w".into(), 4).await.unwrap();
        let runner = sched.clone();
        let _iteration = tokio::spawn(async move { runner.run_iteration(0, 0.5).await });
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
            let sched =
                SchedulerHandle::spawn(config, vec![Task::default()], vec![Task::default()]);
            let (worker, _) = sched.register("w".into(), 4).await.unwrap();
            let runner = sched.clone();
            let _iteration = tokio::spawn(async move { runner.run_iteration(0, 0.5).await });
            let mut leases = Vec::new();
            while leases.len() < 3 {
                leases.extend(sched.lease(worker.clone(), 3).await.unwrap().leases);
            }
            for l in leases {
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
}

#[cfg(test)]
mod algorithm_tests {
    use super::*;
    use tutor_proto::{Actor, LossKind, OutcomeStatus};

    /// A student turn (logprobs recorded) and the outcome of an episode.
    async fn finish(sched: &SchedulerHandle, worker: &str, lease: &EpisodeLease, resolved: bool) {
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
        let status = if resolved {
            OutcomeStatus::Resolved
        } else {
            OutcomeStatus::Unresolved
        };
        sched
            .stored(EpisodeEvent {
                episode_id: lease.episode_id.clone(),
                worker_id: worker.to_string(),
                event: Some(episode_event::Event::Outcome(EpisodeOutcome {
                    num_turns: 1,
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
        assert!((rollouts.mean_reward - 3.0 / 8.0).abs() < 1e-12);

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

#[cfg(test)]
mod claim_tests {
    use super::tests::outcome;
    use super::*;

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
