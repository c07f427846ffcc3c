//! The learner's gRPC face: the Learner service (train stream, status, checkpoint) and
//! the Weights service, both on one socket. The trainer lives on its own thread and is
//! reached through `LearnerHandle`, so no tensor is shared across tasks.
//! (Over 800 lines: the restart rule below spans the Train stream, the trainer thread,
//! refusals, skipped steps and the checkpoint, and reads best in one place; the tests
//! are in `service/tests.rs`. Splitting the trainer thread's loop out is the next cut.)
//!
//! Restarts. The learner keeps its own checkpoint in `out_dir/checkpoint` and resumes
//! from it when started again on the same `out_dir`. The rule:
//! - every batch carries (iteration, step); the checkpoint's data cursor is the last
//!   batch applied and, per iteration, the version published after it;
//! - the checkpoint is written after every `checkpoint_every_steps` applied batches and
//!   always after a publish, *before* the reply: a version the coordinator hears of is
//!   on disk with the optimizer state that produced it, so a `kill -9` loses at most the
//!   steps since the last checkpoint (with the default of 1: the step in flight);
//! - a batch at or before the cursor is not trained again: the reply says
//!   `already_applied` (and repeats the published version of a `publish` batch);
//! - so the coordinator's recovery is one rule too: when a train stream breaks, it
//!   reconnects and sends the iteration's batches again from the first; the learner
//!   trains exactly the ones it lacks, and every batch is applied once.
//!
//! An `out_dir` belongs to one run: the first batch binds the learner to its `run_id`
//! (kept in the checkpoint's cursor at once), and a batch of any other run is refused
//! with FAILED_PRECONDITION, before and after a restart, so a second coordinator pointed
//! at it by mistake can neither train it nor have its batches taken as applied.
//!
//! Numbers are not trusted. A batch whose examples cannot be trained on (a token id
//! outside the model's vocabulary, a loss mask of the wrong length, a non-finite DAPO
//! advantage or old log-prob: `BatchError`) is refused with INVALID_ARGUMENT naming the
//! episode and turn, counted and logged. A step whose loss or gradient norm is not finite
//! is skipped (`StepReport::skipped`): the weights and the optimizer state stay as they
//! were, no version is published for it (a `publish` batch repeats the latest version
//! when nothing else changed the weights since), it triggers no checkpoint, and its reply
//! reports nothing trained (`label_tokens` 0); it is counted, logged, and has a line in
//! the train log whose `skipped` says why. The batch counts as consumed: sent again, it
//! is `already_applied`.
//!
//! A panic in the trainer thread ends the learner: it is logged as an error, every call
//! in flight or made after it is answered UNAVAILABLE with "the trainer thread panicked:
//! …", and `serve` returns that error (so `tutor learner` exits non-zero) once the calls
//! in flight had their answer (at most `PANIC_GRACE`). Restarted on the same `out_dir`,
//! the learner resumes from its checkpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use tutor_collective::rendezvous::GroupOptions;
use tutor_collective::CpuCollective;
use tutor_proto::auth::{AuthToken, Role, ServerAuth};
use tutor_proto::learner_server::{Learner, LearnerServer};
use tutor_proto::net::GrpcListener;
use tutor_proto::weights_server::WeightsServer;
use tutor_proto::{
    LearnerStatus, LearnerStatusRequest, SaveCheckpointRequest, SaveCheckpointResponse, TrainBatch,
    TrainProgress,
};

use crate::checkpoint;
use crate::config::LearnerConfig;
use crate::group::{encode_batch, GroupLead};
use crate::loss::{BatchError, StepExamples};
use crate::trainer::{StepError, StepReport, Trainer};
use crate::weights::{PublishedVersion, WeightsStore};

/// The learner's checkpoint inside its `out_dir`.
pub const CHECKPOINT_DIR: &str = "checkpoint";
/// One JSON line per applied batch, in `out_dir`: what was trained when.
pub const TRAIN_LOG: &str = "train-log.jsonl";
/// After the trainer thread panicked: how long `serve` lets the calls in flight receive
/// their error before it returns.
pub const PANIC_GRACE: Duration = Duration::from_secs(10);

/// Where the learner stands in the coordinator's batch stream: the data cursor of its
/// checkpoints.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainCursor {
    /// The last batch applied: (iteration, step).
    pub last: Option<(u32, u32)>,
    /// Per iteration, the version published after its `publish` batch.
    pub published: BTreeMap<u32, u64>,
    /// The run this learner trains for: the `run_id` of the first batch it took.
    #[serde(default)]
    pub run_id: Option<String>,
}

impl TrainCursor {
    /// Whether batch (iteration, step) is already in the weights.
    pub fn has_applied(&self, iteration: u32, step: u32) -> bool {
        self.last.is_some_and(|last| (iteration, step) <= last)
    }
}

/// One line of `train-log.jsonl`. A line is written before the checkpoint that covers it,
/// so after a crash the same (iteration, step) may appear twice, with the same batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainLogEntry {
    pub iteration: u32,
    pub step: u32,
    /// Optimizer steps taken after this batch (the schedule position).
    pub optimizer_steps: u64,
    pub examples: u64,
    pub label_tokens: u64,
    pub loss: f64,
    /// The distinct episodes the batch's examples came from.
    pub episodes: Vec<String>,
    /// The version published after this batch (0: none).
    pub published_version: u64,
    /// `StepExamples::digest` of the whole batch (empty in logs written before it was
    /// recorded): equal digests, equal training data.
    #[serde(default)]
    pub batch_sha256: String,
    /// Set when the step was skipped because its loss or gradient norm was not finite:
    /// why (the non-finite values). Nothing was trained (`loss` and `label_tokens` are 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// Reads `out_dir/train-log.jsonl`: one entry per (iteration, step), the last line of a
/// repeated one kept; a torn last line (no newline: the learner was killed while it
/// appended) is not read.
pub fn read_train_log(out_dir: &Path) -> Result<BTreeMap<(u32, u32), TrainLogEntry>> {
    let path = out_dir.join(TRAIN_LOG);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let mut out = BTreeMap::new();
    // A last line without its newline is an append a kill cut short (the next append
    // removes it): not an entry, whatever it holds.
    let whole = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    for (i, line) in whole.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let e: TrainLogEntry = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a train log entry", path.display(), i + 1))?;
        out.insert((e.iteration, e.step), e);
    }
    Ok(out)
}

/// Appends `line` and its newline to the log at `path` in one write, synced. A tail
/// without its newline (a learner killed in the middle of an earlier append, or a log
/// written before appends were one write) is cut first: the step it logged is not in the
/// checkpoint, so it is trained and logged again, and the log stays one entry per line.
fn append_log_line(path: &Path, line: &str) -> Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let len = f.metadata()?.len();
    if len > 0 {
        let mut last = [0u8];
        f.seek(SeekFrom::Start(len - 1))?;
        f.read_exact(&mut last)?;
        if last[0] != b'\n' {
            // Rare (after a kill): the whole log read once to find where its last whole
            // line ends (0: none is whole).
            let mut text = Vec::new();
            f.seek(SeekFrom::Start(0))?;
            f.read_to_end(&mut text)?;
            let keep = text
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i as u64 + 1);
            tracing::warn!(
                path = %path.display(),
                torn_bytes = len - keep,
                "the train log ends in a torn line (the learner was killed while it wrote); cutting it"
            );
            f.set_len(keep)
                .with_context(|| format!("cutting the torn line of {}", path.display()))?;
        }
    }
    let mut bytes = Vec::with_capacity(line.len() + 1);
    bytes.extend_from_slice(line.as_bytes());
    bytes.push(b'\n');
    f.write_all(&bytes)
        .and_then(|_| f.sync_data())
        .with_context(|| format!("writing {}", path.display()))
}

struct StepRequest {
    run_id: String,
    iteration: u32,
    step: u32,
    examples: StepExamples,
    episodes: Vec<String>,
    publish: bool,
    /// The batch as the other learner ranks receive it (empty without a group).
    wire: Vec<u8>,
}

struct StepDone {
    report: StepReport,
    published: Option<PublishedVersion>,
    already_applied: bool,
}

enum Command {
    Step {
        request: StepRequest,
        reply: oneshot::Sender<Result<StepDone, Status>>,
    },
    Checkpoint {
        dir: PathBuf,
        reply: oneshot::Sender<Result<u64, String>>,
    },
    Status {
        reply: oneshot::Sender<(u64, Option<PublishedVersion>)>,
    },
    /// Time passes: rank 0 sends the other ranks a keepalive when it is due.
    Tick,
    /// The run is over: rank 0 tells the other ranks to exit.
    StopGroup { reply: oneshot::Sender<()> },
}

/// What the learner refused or skipped since it started (not checkpointed). Each one is
/// also logged when it happens, naming the batch and the episode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LearnerStats {
    /// Training batches refused with INVALID_ARGUMENT (`BatchError`).
    pub refused_batches: u64,
    /// The examples those batches held.
    pub refused_examples: u64,
    /// Steps skipped because their loss or gradient norm was not finite.
    pub skipped_steps: u64,
}

/// `LearnerStats` as the service and the trainer thread update them.
#[derive(Debug, Default)]
struct Counters {
    refused_batches: AtomicU64,
    refused_examples: AtomicU64,
    skipped_steps: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> LearnerStats {
        LearnerStats {
            refused_batches: self.refused_batches.load(Ordering::Relaxed),
            refused_examples: self.refused_examples.load(Ordering::Relaxed),
            skipped_steps: self.skipped_steps.load(Ordering::Relaxed),
        }
    }
}

/// Sends commands to the trainer thread.
#[derive(Clone)]
pub struct LearnerHandle {
    tx: mpsc::Sender<Command>,
    /// Learner ranks (1: no group); above 1 this process is rank 0.
    world_size: usize,
    /// The model's vocabulary: token ids at or above it are refused.
    vocab_size: usize,
    counters: Arc<Counters>,
    /// Set (to the panic's message) when the trainer thread panicked; closed without a
    /// value when it ended otherwise.
    panicked: watch::Receiver<Option<String>>,
}

/// The trainer thread's state beside the trainer: versions, cursor, checkpoint policy.
struct TrainerHost {
    trainer: Trainer,
    store: WeightsStore,
    model_dir: PathBuf,
    out_dir: PathBuf,
    cursor: TrainCursor,
    checkpoint_every: u64,
    since_checkpoint: u64,
    /// Rank 0's side of a data-parallel group; `None`: this learner trains alone.
    group: Option<GroupLead>,
    counters: Arc<Counters>,
    /// The optimizer step count when the latest version was published; `None` when not
    /// known (after a resume). A skipped `publish` batch publishes a new version only
    /// when the weights may differ from the latest one.
    published_at_steps: Option<u64>,
}

impl LearnerHandle {
    /// Starts the trainer thread on `out_dir`: resumes from `out_dir/checkpoint` when it
    /// holds one (weights, optimizer, schedule, cursor; the versions it lists are served
    /// again), else starts from `model_dir`, publishes version 0 and writes the first
    /// checkpoint.
    pub fn start(
        model_dir: &Path,
        out_dir: &Path,
        config: LearnerConfig,
        store: WeightsStore,
    ) -> Result<Self> {
        Ok(Self::start_with_group(model_dir, out_dir, config, store, None)?.0)
    }

    /// `start` as rank 0 of a data-parallel group (`None`: alone). The trainer thread
    /// forms the group before it takes any command; the receiver says whether that
    /// worked (an error there should end the process: the other ranks never came).
    pub fn start_with_group(
        model_dir: &Path,
        out_dir: &Path,
        config: LearnerConfig,
        store: WeightsStore,
        group: Option<GroupLead>,
    ) -> Result<(Self, oneshot::Receiver<Result<()>>)> {
        let world_size = group.as_ref().map_or(1, |g| g.world_size());
        let keepalive = group.as_ref().map(|g| g.keepalive());
        let ckpt = out_dir.join(CHECKPOINT_DIR);
        let checkpoint_every = config.checkpoint_every_steps;
        let host = if checkpoint::exists(&ckpt) {
            // Rank 0 of a group starts alone: sharded, its state waits in host memory
            // until the group forms and it keeps its slice.
            let resumed = if group.is_some() {
                Trainer::resume_for_group(&ckpt)
            } else {
                Trainer::resume(&ckpt, Box::new(CpuCollective::solo()))
            };
            let (trainer, cursor) =
                resumed.with_context(|| format!("resuming from {}", ckpt.display()))?;
            let cursor: TrainCursor = serde_json::from_value(cursor).with_context(|| {
                format!(
                    "{}: data_cursor is not a learner train cursor (was the checkpoint written                      by `tutor learner`?)",
                    ckpt.join(checkpoint::STATE_FILE).display()
                )
            })?;
            for v in std::iter::once(0).chain(cursor.published.values().copied()) {
                store.register(v).with_context(|| {
                    format!("re-registering published version {v} of the checkpoint")
                })?;
            }
            tracing::info!(
                steps = trainer.steps(),
                last_batch = ?cursor.last,
                versions = cursor.published.len() + 1,
                "learner resumed from its checkpoint"
            );
            TrainerHost {
                trainer,
                store,
                model_dir: model_dir.to_path_buf(),
                out_dir: out_dir.to_path_buf(),
                cursor,
                checkpoint_every,
                since_checkpoint: 0,
                group: None,
                counters: Arc::default(),
                published_at_steps: None,
            }
        } else {
            let trainer = if group.is_some() {
                Trainer::from_model_dir_for_group(model_dir, config)?
            } else {
                Trainer::from_model_dir(model_dir, config)?
            };
            write_version(&trainer, &store, 0)?;
            let v0 = store.register(0)?;
            tracing::info!(sha256 = %v0.sha256, bytes = v0.bytes, "published initial policy version 0");
            let mut host = TrainerHost {
                trainer,
                store,
                model_dir: model_dir.to_path_buf(),
                out_dir: out_dir.to_path_buf(),
                cursor: TrainCursor::default(),
                checkpoint_every,
                since_checkpoint: 0,
                group: None,
                counters: Arc::default(),
                published_at_steps: Some(0),
            };
            host.save_checkpoint(&ckpt)?;
            host
        };
        tracing::info!(
            parameters = host.trainer.policy().config().num_parameters(),
            "learner model ready"
        );
        let (tx, rx) = mpsc::channel::<Command>(8);
        let (ready_tx, ready) = oneshot::channel();
        let (panic_tx, panicked) = watch::channel(None);
        let mut host = host;
        host.group = group;
        let vocab_size = host.trainer.policy().config().vocab_size;
        let counters = host.counters.clone();
        std::thread::Builder::new()
            .name("trainer".into())
            .spawn(move || {
                // The host and the command receiver go down with a panic: the request in
                // flight loses its reply, later ones find the channel closed, and both
                // then read the panic's message from `panic_tx`, which outlives them.
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                    host.run(rx, ready_tx)
                }));
                if let Err(payload) = run {
                    let message = panic_message(payload.as_ref());
                    tracing::error!(
                        panic = %message,
                        "the trainer thread panicked: the learner stops (restart it on the \
                         same --out-dir to resume from its checkpoint)"
                    );
                    let _ = panic_tx.send(Some(message));
                }
            })
            .context("starting the trainer thread")?;
        if let Some(every) = keepalive {
            // Holds no sender between ticks: the trainer thread still ends when the
            // handles are dropped.
            let weak = tx.downgrade();
            std::thread::Builder::new()
                .name("group-keepalive".into())
                .spawn(move || loop {
                    std::thread::sleep(every);
                    let Some(tx) = weak.upgrade() else { return };
                    // Busy trainer: it is training, which the other ranks see anyway.
                    let _ = tx.try_send(Command::Tick);
                })
                .context("starting the keepalive thread")?;
        }
        Ok((
            Self {
                tx,
                world_size,
                vocab_size,
                counters,
                panicked,
            },
            ready,
        ))
    }

    /// What the learner refused or skipped since it started.
    pub fn stats(&self) -> LearnerStats {
        self.counters.snapshot()
    }

    /// The trainer thread's panic message, once it panicked.
    pub fn panic_message(&self) -> Option<String> {
        self.panicked.borrow().clone()
    }

    /// Resolves with the panic's message when the trainer thread panics; never when it
    /// ends otherwise.
    pub async fn trainer_panicked(&self) -> String {
        match self.wait_for_panic().await {
            Some(message) => message,
            None => std::future::pending().await,
        }
    }

    /// The panic's message once the trainer thread panicked; `None` once it ended
    /// otherwise.
    async fn wait_for_panic(&self) -> Option<String> {
        let mut rx = self.panicked.clone();
        let message = rx.wait_for(Option::is_some).await.ok()?.clone();
        message
    }

    /// The answer to a call the trainer thread will not reply to: its panic (waiting for
    /// the thread to record it: the reply is dropped while the panic unwinds, just before
    /// the message is set), or that it stopped.
    async fn stopped(&self) -> Status {
        match self.wait_for_panic().await {
            Some(message) => Status::unavailable(format!(
                "the trainer thread panicked: {}; the learner is stopping (restarted on the \
                 same --out-dir, it resumes from its checkpoint)",
                panic_summary(&message)
            )),
            None => Status::unavailable("the trainer thread has stopped"),
        }
    }

    /// A refused batch: counted and logged with the episode it names.
    fn refused(&self, batch: &TrainBatch, examples: usize, e: &BatchError) {
        let batches = self
            .counters
            .refused_batches
            .fetch_add(1, Ordering::Relaxed)
            + 1;
        self.counters
            .refused_examples
            .fetch_add(examples as u64, Ordering::Relaxed);
        tracing::warn!(
            iteration = batch.iteration,
            step = batch.step,
            episode = %e.episode(),
            turn = e.turn(),
            examples,
            refused_batches = batches,
            error = %e,
            "refused a training batch"
        );
    }

    /// Rank 0 at the end of the run: tells the other ranks to exit (bounded wait).
    pub async fn stop_group(&self) {
        if self.world_size < 2 {
            return;
        }
        let stopped = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            self.call(|reply| Command::StopGroup { reply }),
        )
        .await;
        if !matches!(stopped, Ok(Ok(()))) {
            tracing::warn!("could not tell the other learner ranks to stop in time");
        }
    }

    async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, Status> {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(make(reply)).await.is_err() {
            return Err(self.stopped().await);
        }
        match rx.await {
            Ok(r) => Ok(r),
            Err(_) => Err(self.stopped().await),
        }
    }
}

/// The message a panic was raised with (`panic!`'s formatted text).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// A panic's message cut to `PANIC_SUMMARY_CHARS` for a gRPC status and `serve`'s error
/// (a libtorch error carries its C++ stack, kilobytes; the log has it whole).
/// An out-of-memory error (CUDA or the CPU allocator's) also says what to change.
fn panic_summary(message: &str) -> String {
    let hint = if message.contains("out of memory") || message.contains("DefaultCPUAllocator") {
        " — a training pass did not fit in memory: `tutor plan --config F` shows what one \
         needs; lower [learner] micro_batch_tokens, turn on checkpoint_activations, or keep \
         logits_budget_mb above 0"
    } else {
        ""
    };
    match message.char_indices().nth(PANIC_SUMMARY_CHARS) {
        Some((cut, _)) => format!("{}… (cut; the log has it whole){hint}", &message[..cut]),
        None => format!("{message}{hint}"),
    }
}

const PANIC_SUMMARY_CHARS: usize = 400;

impl TrainerHost {
    /// The trainer thread: forms the group (if any; the result goes to `ready`), then
    /// serves commands until every handle is dropped.
    fn run(mut self, mut rx: mpsc::Receiver<Command>, ready: oneshot::Sender<Result<()>>) {
        let formed = match &mut self.group {
            Some(g) => g.ensure(&mut self.trainer),
            None => Ok(()),
        };
        let failed = formed.is_err();
        let _ = ready.send(formed);
        if failed {
            return;
        }
        let mut stopped = false;
        while let Some(cmd) = rx.blocking_recv() {
            match cmd {
                Command::Step { request, reply } => {
                    let _ = reply.send(self.step(request));
                }
                Command::Checkpoint { dir, reply } => {
                    let result = self
                        .save_checkpoint(&dir)
                        .map(|_| self.store.latest().map(|v| v.version).unwrap_or(0))
                        .map_err(|e| format!("{e:#}"));
                    let _ = reply.send(result);
                }
                Command::Status { reply } => {
                    let _ = reply.send((self.trainer.steps(), self.store.latest()));
                }
                Command::Tick => {
                    if let Some(g) = &mut self.group {
                        g.tick(&mut self.trainer);
                    }
                }
                Command::StopGroup { reply } => {
                    if let Some(g) = &mut self.group {
                        g.stop(&mut self.trainer);
                    }
                    // The run is over: the other ranks' slices leave with them as planned.
                    stopped = true;
                    let _ = reply.send(());
                }
            }
            if self.trainer.lost_shards() && !stopped {
                // Deliberately through the trainer's stop path (a panic: calls are answered
                // UNAVAILABLE, `serve` returns an error): the process ends, and restarted
                // on the same --out-dir it resumes from the checkpoint, which the
                // coordinator's batches since then replay onto.
                panic!(
                    "the learner group broke and with learner.shard = \"{}\" the optimizer \
                     state of the lost ranks went with them, so rank 0 cannot go on alone: \
                     restart the learner on the same --out-dir to resume from its last \
                     checkpoint",
                    self.trainer.config().shard.name()
                );
            }
        }
    }

    /// Trains one batch of this learner's run (binding it to the run of its first
    /// batch); a batch of another run is refused with FAILED_PRECONDITION.
    fn step(&mut self, r: StepRequest) -> Result<StepDone, Status> {
        #[cfg(test)]
        if r.run_id == tests::PANIC_RUN_ID {
            panic!("{}", tests::PANIC_MESSAGE);
        }
        if r.run_id.is_empty() {
            return Err(Status::invalid_argument(
                "TrainBatch.run_id is empty: the coordinator must send its run id",
            ));
        }
        match &self.cursor.run_id {
            Some(mine) if *mine != r.run_id => {
                return Err(Status::failed_precondition(format!(
                    "this learner trains run {mine:?} (its checkpoint in {} says so) and refuses                      batches of run {:?}: point each coordinator at its own learner (its own                      --out-dir)",
                    self.out_dir.display(),
                    r.run_id
                )))
            }
            Some(_) => {}
            None => {
                self.cursor.run_id = Some(r.run_id.clone());
                // On disk before the first batch is trained: a restarted learner keeps
                // refusing other runs.
                self.save_checkpoint(&self.out_dir.join(CHECKPOINT_DIR))
                    .map_err(|e| Status::internal(format!("{e:#}")))?;
                tracing::info!(run_id = %r.run_id, "learner bound to its run");
            }
        }
        self.apply(r)
            .map_err(|e| Status::internal(format!("{e:#}")))
    }

    fn apply(&mut self, r: StepRequest) -> Result<StepDone> {
        if self.cursor.has_applied(r.iteration, r.step) {
            let published = if r.publish {
                let v = self.cursor.published.get(&r.iteration).with_context(|| {
                    format!(
                        "batch {}/{} asks to publish, was applied before, but no version was                          published for iteration {}",
                        r.iteration, r.step, r.iteration
                    )
                })?;
                Some(
                    self.store
                        .get(*v)
                        .with_context(|| format!("version {v} is not registered"))?,
                )
            } else {
                None
            };
            tracing::info!(
                iteration = r.iteration,
                step = r.step,
                "batch already applied: not training it again"
            );
            return Ok(StepDone {
                report: StepReport {
                    loss: 0.0,
                    grad_norm: 0.0,
                    label_tokens: 0,
                    learning_rate: 0.0,
                    seconds: 0.0,
                    micro_batches: 0,
                    skipped: None,
                },
                published,
                already_applied: true,
            });
        }
        let report = match &mut self.group {
            None => self
                .trainer
                .train_step(&r.examples)
                .context("training step")?,
            Some(group) => {
                // Every rank gets the whole batch and trains its share; the gradients
                // are summed over the ranks in the step.
                group.send_step(&mut self.trainer, &r.wire)?;
                let share = r.examples.shard(0, group.world_size());
                match self.trainer.train_step(&share) {
                    Ok(report) => report,
                    Err(e @ StepError::Collective { .. }) => {
                        // A rank died, hung or went out of step: rank 0 goes on alone and
                        // forms the group again at its next batch (sharded, it stops: see
                        // `run`).
                        let e = anyhow::Error::new(e);
                        group.broken(&mut self.trainer, &format!("{e:#}"));
                        return Err(e.context("training step"));
                    }
                    Err(e @ StepError::ShardLost(_)) => {
                        return Err(anyhow::Error::new(e).context("training step"))
                    }
                }
            }
        };
        self.cursor.last = Some((r.iteration, r.step));
        if let Some(why) = report.skipped {
            return self.skipped(r, report, why);
        }
        let published = if r.publish {
            Some(
                self.publish_for(r.iteration)
                    .context("publishing weights")?,
            )
        } else {
            None
        };
        self.append_log(&r, &report, published.as_ref())?;
        self.since_checkpoint += 1;
        if published.is_some()
            || (self.checkpoint_every > 0 && self.since_checkpoint >= self.checkpoint_every)
        {
            self.save_checkpoint(&self.out_dir.join(CHECKPOINT_DIR))?;
            self.since_checkpoint = 0;
        }
        Ok(StepDone {
            report,
            published,
            already_applied: false,
        })
    }

    /// Publishes the weights as the next version, for `r.iteration`.
    fn publish_for(&mut self, iteration: u32) -> Result<PublishedVersion> {
        let pv = publish_next(&self.trainer, &self.store)?;
        self.cursor.published.insert(iteration, pv.version);
        self.published_at_steps = Some(self.trainer.steps());
        Ok(pv)
    }

    /// A batch whose step was skipped (loss or gradient norm not finite; the trainer left
    /// the weights and the optimizer state alone and warned): counted, logged with the
    /// batch and its episodes, consumed (the cursor moved past it). No checkpoint for it;
    /// a `publish` batch publishes only when earlier steps changed the weights since the
    /// latest version, else its reply repeats that version.
    fn skipped(
        &mut self,
        r: StepRequest,
        report: StepReport,
        why: crate::trainer::NonFinite,
    ) -> Result<StepDone> {
        let skipped = self.counters.skipped_steps.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::warn!(
            iteration = r.iteration,
            step = r.step,
            optimizer_steps = self.trainer.steps(),
            episodes = ?r.episodes,
            skipped_steps = skipped,
            "batch not trained: {why}; the step was skipped"
        );
        let unchanged = self.published_at_steps == Some(self.trainer.steps());
        let published = match (r.publish, unchanged) {
            (false, _) => None,
            (true, true) => {
                let latest = self
                    .store
                    .latest()
                    .context("no published version to repeat")?;
                self.cursor.published.insert(r.iteration, latest.version);
                Some(latest)
            }
            (true, false) => Some(
                self.publish_for(r.iteration)
                    .context("publishing weights")?,
            ),
        };
        let report = StepReport {
            loss: 0.0,
            grad_norm: 0.0,
            label_tokens: 0,
            ..report
        };
        self.append_log(&r, &report, published.as_ref())?;
        if r.publish && !unchanged {
            // A new version (of the steps before this one): on disk with its optimizer
            // state before the reply, as every published version.
            self.save_checkpoint(&self.out_dir.join(CHECKPOINT_DIR))?;
            self.since_checkpoint = 0;
        }
        Ok(StepDone {
            report,
            published,
            already_applied: false,
        })
    }

    fn append_log(
        &self,
        r: &StepRequest,
        report: &StepReport,
        published: Option<&PublishedVersion>,
    ) -> Result<()> {
        let entry = TrainLogEntry {
            iteration: r.iteration,
            step: r.step,
            optimizer_steps: self.trainer.steps(),
            examples: r.examples.len() as u64,
            label_tokens: report.label_tokens,
            loss: report.loss,
            episodes: r.episodes.clone(),
            published_version: published.map(|p| p.version).unwrap_or(0),
            batch_sha256: r.examples.digest(),
            skipped: report.skipped.map(|why| why.to_string()),
        };
        append_log_line(
            &self.out_dir.join(TRAIN_LOG),
            &serde_json::to_string(&entry)?,
        )
    }

    /// A full training checkpoint (model in Hugging Face layout, optimizer state,
    /// schedule, RNG; see `Trainer::save_checkpoint`) with the tokenizer beside it and
    /// the train cursor as its data cursor.
    fn save_checkpoint(&mut self, dir: &Path) -> Result<()> {
        // The tokenizer and the chat format it renders with (a Llama-3 student's
        // template and stop ids), so the checkpoint loads as the run's model.
        let files: Vec<PathBuf> = [
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "generation_config.json",
            "special_tokens_map.json",
        ]
        .iter()
        .map(|f| self.model_dir.join(f))
        .filter(|p| p.exists())
        .collect();
        let extra: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
        if let Some(g) = &mut self.group {
            g.send_checkpoint(&mut self.trainer)?;
        }
        self.trainer
            .save_checkpoint(dir, &serde_json::to_value(&self.cursor)?, &extra)
    }
}

/// Writes version `v`'s weights to a temporary file and renames it into place, so a
/// crash never leaves a torn version file under the final name.
fn write_version(trainer: &Trainer, store: &WeightsStore, v: u64) -> Result<()> {
    let path = store.path_for(v);
    let tmp = path.with_extension("safetensors.tmp");
    trainer.save_weights(&tmp)?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("flushing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

fn publish_next(trainer: &Trainer, store: &WeightsStore) -> Result<PublishedVersion> {
    let next = store.latest().map(|v| v.version + 1).unwrap_or(0);
    write_version(trainer, store, next)?;
    let pv = store.register(next)?;
    tracing::info!(version = next, sha256 = %pv.sha256, "published policy version");
    Ok(pv)
}

type ProgressStream = Pin<Box<dyn Stream<Item = Result<TrainProgress, Status>> + Send>>;

#[tonic::async_trait]
impl Learner for LearnerHandle {
    type TrainStream = ProgressStream;

    async fn train(
        &self,
        request: Request<Streaming<TrainBatch>>,
    ) -> Result<Response<Self::TrainStream>, Status> {
        let mut batches = request.into_inner();
        let handle = self.clone();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            while let Some(batch) = batches.next().await {
                let mut batch = match batch {
                    Ok(b) => b,
                    Err(status) => {
                        tracing::warn!(%status, "train stream from the coordinator broke");
                        return;
                    }
                };
                let wire = if handle.world_size > 1 {
                    encode_batch(&batch)
                } else {
                    Vec::new()
                };
                let episodes: BTreeSet<String> = batch
                    .examples
                    .iter()
                    .map(|e| e.episode_id.clone())
                    .collect();
                let count = batch.examples.len();
                let examples = match StepExamples::from_proto_for_vocab(
                    std::mem::take(&mut batch.examples),
                    handle.vocab_size,
                ) {
                    Ok(e) => e,
                    Err(e) => {
                        handle.refused(&batch, count, &e);
                        let _ = tx.send(Err(Status::invalid_argument(e.to_string()))).await;
                        return;
                    }
                };
                let request = StepRequest {
                    wire,
                    run_id: batch.run_id.clone(),
                    iteration: batch.iteration,
                    step: batch.step,
                    examples,
                    episodes: episodes.into_iter().collect(),
                    publish: batch.publish,
                };
                let result = handle
                    .call(|reply| Command::Step { request, reply })
                    .await
                    .and_then(|r| r);
                let failed = result.is_err();
                let msg = result.map(|done| {
                    let StepDone {
                        report,
                        published,
                        already_applied,
                    } = done;
                    TrainProgress {
                        iteration: batch.iteration,
                        step: batch.step,
                        loss: report.loss,
                        label_tokens: report.label_tokens,
                        grad_norm: report.grad_norm,
                        step_seconds: report.seconds,
                        published_version: published.as_ref().map(|p| p.version).unwrap_or(0),
                        published_sha256: published.map(|p| p.sha256).unwrap_or_default(),
                        learning_rate: report.learning_rate,
                        already_applied,
                    }
                });
                if tx.send(msg).await.is_err() || failed {
                    return; // the coordinator went away, or the stream ends with the error
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn status(
        &self,
        _request: Request<LearnerStatusRequest>,
    ) -> Result<Response<LearnerStatus>, Status> {
        let (steps, latest) = self.call(|reply| Command::Status { reply }).await?;
        Ok(Response::new(LearnerStatus {
            latest_version: latest.as_ref().map(|v| v.version).unwrap_or(0),
            latest_sha256: latest.map(|v| v.sha256).unwrap_or_default(),
            optimizer_steps: steps,
        }))
    }

    async fn save_checkpoint(
        &self,
        request: Request<SaveCheckpointRequest>,
    ) -> Result<Response<SaveCheckpointResponse>, Status> {
        let dir = request.into_inner().dir;
        if dir.is_empty() {
            return Err(Status::invalid_argument("SaveCheckpoint needs a directory"));
        }
        let path = PathBuf::from(&dir);
        let version = self
            .call(|reply| Command::Checkpoint { dir: path, reply })
            .await?
            .map_err(Status::internal)?;
        Ok(Response::new(SaveCheckpointResponse { dir, version }))
    }
}

/// Everything `tutor learner` needs to start.
pub struct ServeOptions {
    pub listen: SocketAddr,
    pub model_dir: PathBuf,
    /// Versions, `checkpoint/` and `train-log.jsonl`; resumed from when it holds a
    /// checkpoint.
    pub out_dir: PathBuf,
    pub config: LearnerConfig,
    /// Written with the bound address once the socket listens (useful with port 0).
    pub addr_file: Option<PathBuf>,
    /// Required on every Learner and Weights call; `None`: no authentication, with a
    /// warning at start.
    pub auth_token: Option<AuthToken>,
    /// TLS: `cert`/`key` serve over TLS, `ca` requires client certificates signed by it
    /// (the coordinator's and the workers'). Empty: plaintext.
    pub tls: tutor_proto::tls::TlsFiles,
    /// This learner as rank 0 of a data-parallel group (see `group`); `None`: alone.
    pub group: Option<GroupOptions>,
    /// Rank 0 of the weights broadcast group (see `broadcast`): every published version
    /// also goes to the workers over a collective. `None`: gRPC downloads only.
    pub broadcast: Option<GroupOptions>,
    /// Listen on a non-loopback address with no token and no client certificates.
    /// Without it that is refused at start (`--insecure` on the command line).
    pub insecure: bool,
    /// Called once, at start, with the newest published version now and as each newer
    /// one is published (`tutor learner` loads them into the student engines of
    /// `[learner] engines`). `None`: nothing to call.
    pub on_versions: Option<VersionsHook>,
}

/// See [`ServeOptions::on_versions`].
pub type VersionsHook =
    Box<dyn FnOnce(tokio::sync::watch::Receiver<Option<PublishedVersion>>) + Send>;

/// Runs the learner until `shutdown` resolves.
/// A learner rank's token must be the learner's or the run's: a worker's could neither
/// check the coordinator's calls nor train.
pub fn refuse_worker_token(token: Option<&AuthToken>) -> Result<()> {
    if token.map(|t| t.role()) == Some(Role::Worker) {
        anyhow::bail!(
            "the learner was given a worker token: it needs the learner's token (`tutor \
             learner-token`) or the run's"
        );
    }
    Ok(())
}

pub async fn serve(
    opts: ServeOptions,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    refuse_worker_token(opts.auth_token.as_ref())?;
    // TLS files are checked first: a typo fails before the model is loaded.
    let server_tls = opts.tls.server()?;
    let mut server_builder = tutor_proto::tls::server_builder(server_tls.as_ref())?;
    let store = WeightsStore::new(&opts.out_dir.join("versions"))?;
    let group = opts
        .group
        .map(|g| GroupLead::new(g, tokio::runtime::Handle::current()))
        .transpose()?;
    let (handle, group_ready) = LearnerHandle::start_with_group(
        &opts.model_dir,
        &opts.out_dir,
        opts.config.clone(),
        store.clone(),
        group,
    )?;
    // The group forms while the server already answers (the coordinator's calls wait
    // for the trainer thread); when it cannot form, the learner exits with the reason.
    let group_failed = async move {
        match group_ready.await {
            Ok(Err(e)) => e,
            Ok(Ok(())) => std::future::pending().await,
            Err(_) => anyhow::anyhow!("the trainer thread stopped before the group formed"),
        }
    };
    if let Some(hook) = opts.on_versions {
        hook(store.subscribe());
    }
    let stopper = handle.clone();
    let broadcast_stop = Arc::new(AtomicBool::new(false));
    if let Some(b) = opts.broadcast {
        let store = store.clone();
        tutor_collective::broadcast::spawn_broadcaster(
            b,
            move || store.latest(),
            tokio::runtime::Handle::current(),
            broadcast_stop.clone(),
        )?;
    }
    let auth = ServerAuth::new(opts.auth_token);
    let listener = GrpcListener::bind("learner", opts.listen).await?;
    listener.refuse_unprotected(
        &auth,
        server_tls.as_ref().is_some_and(|t| t.is_mutual()),
        opts.insecure,
    )?;
    listener.write_addr_file(opts.addr_file.as_deref())?;
    tracing::info!(
        addr = %listener.local_addr(),
        tls = server_tls.is_some(),
        client_certificates = server_tls.as_ref().is_some_and(|t| t.is_mutual()),
        "learner listening"
    );
    listener.warn_if_unauthenticated(&auth);
    // Probes carry no secrets: the health service is the one left unauthenticated.
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<LearnerServer<LearnerHandle>>().await;
    health.set_serving::<WeightsServer<WeightsStore>>().await;
    // A trainer panic shuts the server down as the shutdown signal would: the calls in
    // flight get their error before their connections close.
    let panicked = handle.clone();
    let shutdown = async move {
        tokio::select! {
            () = shutdown => {}
            _ = panicked.trainer_panicked() => {}
        }
    };
    let server = server_builder
        .add_service(health_service)
        // Training and publishing take the learner's token (what the coordinator sends)
        // or the run's; workers' tokens may download weights.
        .add_service(
            auth.allowing(&[Role::Learner]).intercept(
                LearnerServer::new(handle)
                    .max_decoding_message_size(tutor_proto::MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(tutor_proto::MAX_MESSAGE_BYTES),
            ),
        )
        .add_service(
            auth.allowing(&[Role::Learner, Role::Worker])
                .intercept(WeightsServer::new(store)),
        )
        .serve_with_incoming_shutdown(
            listener.incoming(),
            tutor_proto::net::not_serving_after(shutdown, health),
        );
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => r.context("learner server")?,
        e = group_failed => return Err(e.context("forming the data-parallel learner group")),
        message = stopper.trainer_panicked() => {
            // The server is shutting down; bounded, in case a client holds a stream open.
            if tokio::time::timeout(PANIC_GRACE, &mut server).await.is_err() {
                tracing::warn!(
                    grace_s = PANIC_GRACE.as_secs_f64(),
                    "calls still open after the trainer thread panicked: closing them"
                );
            }
            broadcast_stop.store(true, Ordering::SeqCst);
            anyhow::bail!("the trainer thread panicked: {}", panic_summary(&message));
        }
    }
    broadcast_stop.store(true, Ordering::SeqCst);
    if let Some(message) = stopper.panic_message() {
        // The panic shut the server down before `select!` saw it.
        anyhow::bail!("the trainer thread panicked: {}", panic_summary(&message));
    }
    stopper.stop_group().await;
    let stats = stopper.stats();
    tracing::info!(
        refused_batches = stats.refused_batches,
        refused_examples = stats.refused_examples,
        skipped_steps = stats.skipped_steps,
        "learner stopped"
    );
    Ok(())
}

#[cfg(test)]
mod tests;
