//! The worker process: registers with the coordinator, leases episodes up to its
//! capacity, runs them, streams their events (replaying unacknowledged ones after a
//! broken stream), heartbeats, and swaps in new policy versions between episodes.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tonic::transport::Channel;
use tonic::Request;
use tutor_policy::ChatTokenizer;
use tutor_proto::auth::{AuthChannel, ClientAuth};
use tutor_proto::rollout_client::RolloutClient;
use tutor_proto::{EpisodeEvent, HeartbeatRequest, LeaseRequest, RegisterRequest};

use crate::episode::{run_episode, EpisodeEnv, TeacherSource, DEFAULT_SYSTEM_PROMPT};
use crate::sandbox::WarmPool;
use crate::sandbox::{DockerSettings, ImageRule, SandboxFactory};
use crate::student::StudentHost;
use crate::teacher::endpoint::{ChatEndpoint, TeacherConfig, TeacherKind};

/// The worker's typed configuration (section `[worker]` of a run config).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Episodes run at once; the student decodes their turns as one batch.
    pub capacity: u32,
    /// Deadline for running the tests when grading a submission.
    pub grade_timeout_s: f64,
    /// Where episodes run: `local` (a temporary git working copy per episode) or
    /// `docker` (a container per episode, built with `make images`).
    pub sandbox: SandboxKind,
    /// Where local episode working copies are created (default: the system temp dir).
    pub sandbox_root: Option<PathBuf>,
    /// Docker: the image of tasks whose record names none. An image name, `swebench`
    /// (the SWE-bench naming rule), or a template with `{instance_id}`, `{repo}`,
    /// `{repo_slug}`, `{version}`.
    pub image: String,
    /// Docker: per-container limits.
    pub memory_mb: u64,
    pub cpus: f64,
    pub pids_limit: i64,
    /// Docker: give containers a network (off by default).
    pub network: bool,
    /// Docker: uid:gid the agent's shell runs as (the task image's unprivileged user).
    pub container_user: String,
    /// Docker: containers per image (and per worker) created and started ahead of
    /// demand (tools installed, shell running), so an episode or a grading only copies its
    /// task in; taken ones are refilled in the background and all are removed when the
    /// worker stops. Same limits and labels (run, worker, plus `tutor.pool`) as on-demand
    /// containers. Pools are kept for the 4 most recently used images. 0 (default): every
    /// container is created when an episode starts.
    pub warm_pool: u32,
    /// System prompt; empty means the built-in one. `{repo}` and `{tools}` are filled in.
    pub system_prompt: String,
    /// Who labels states (`[worker.teacher]`): the gold-patch oracle (default) or an
    /// OpenAI-compatible endpoint.
    pub teacher: TeacherConfig,
    /// Deadline of unary calls to the coordinator.
    pub rpc_timeout_s: f64,
    /// libtorch intra-op threads for the student. Several workers share a machine's
    /// cores; more threads than cores makes OpenMP spin and everything crawl.
    pub torch_threads: u32,
    /// The student's continuous batch: most turns decoded together.
    pub student_max_batch: usize,
    /// Key/value cache slots the student's batch may hold (rows × longest context). A
    /// turn that does not fit waits for others to finish; it is raised to the model's
    /// context when smaller, so that any single turn fits.
    pub student_cache_tokens: usize,
    /// Where policy versions come from: `"grpc"` (downloaded from the learner's Weights
    /// service when a lease names a new one), or `"broadcast"`: learner rank 0 pushes every
    /// version to its `[learner] weight_receivers` workers over a collective as soon as it
    /// is published, each worker with its own `tutor worker --weights-rank R` (1..N). The
    /// lease still decides which version runs (checked by sha256); gRPC stays the fallback.
    pub weights_from: WeightsFrom,
    /// `"broadcast"`: how long a lease's version may wait for the broadcast before it is
    /// downloaded over gRPC instead.
    pub broadcast_wait_s: f64,
    /// Where the student decodes: `"cpu"` (f32), `"cuda"` or `"cuda:N"` (bf16). With
    /// `weights_from = "broadcast"` over NCCL this is also the receiving GPU.
    pub student_device: String,
}

/// See `WorkerConfig::weights_from`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightsFrom {
    #[default]
    Grpc,
    Broadcast,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            capacity: 1,
            grade_timeout_s: 120.0,
            sandbox: SandboxKind::Local,
            sandbox_root: None,
            image: "tutor/python-task:latest".into(),
            memory_mb: 2048,
            cpus: 1.0,
            pids_limit: 512,
            network: false,
            container_user: "1000:1000".into(),
            warm_pool: 0,
            system_prompt: String::new(),
            teacher: TeacherConfig::default(),
            rpc_timeout_s: 30.0,
            torch_threads: 1,
            student_max_batch: 16,
            student_cache_tokens: 65_536,
            weights_from: WeightsFrom::Grpc,
            broadcast_wait_s: 30.0,
            student_device: "cpu".into(),
        }
    }
}

/// Which sandbox runs episodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SandboxKind {
    #[default]
    Local,
    Docker,
}

impl std::str::FromStr for SandboxKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "local" => Ok(SandboxKind::Local),
            "docker" => Ok(SandboxKind::Docker),
            other => Err(format!("unknown sandbox {other:?}: use local or docker")),
        }
    }
}

impl WorkerConfig {
    /// The limits of the student's generation engine.
    /// The device `student_device` names, checked against what libtorch sees.
    pub fn student_device(&self) -> Result<tch::Device> {
        let Some(device) = tutor_policy::parse_device(&self.student_device, 0) else {
            anyhow::bail!(
                "worker.student_device must be \"cpu\", \"cuda\" or \"cuda:N\", got {:?}",
                self.student_device
            );
        };
        tutor_policy::check_device(device).map_err(|e| {
            anyhow::anyhow!("worker.student_device = {:?}: {e}", self.student_device)
        })?;
        Ok(device)
    }

    pub fn student_engine(&self) -> tutor_policy::EngineConfig {
        tutor_policy::EngineConfig {
            max_batch: self.student_max_batch.max(1),
            max_cached_tokens: self.student_cache_tokens,
            queue: 4 * self.student_max_batch.max(1),
            torch_threads: self.torch_threads,
        }
    }

    /// The sandbox factory this configuration describes, after removing what a previous
    /// incarnation of this worker (same run and worker name) left behind: for Docker its
    /// labelled containers, for local sandboxes the directories named after it.
    pub async fn sandboxes(&self, run: &str, worker: &str) -> Result<SandboxFactory> {
        match self.sandbox {
            SandboxKind::Local => {
                let owner = format!("{run}-{worker}");
                let removed =
                    crate::sandbox::remove_local_orphans(self.sandbox_root.as_deref(), &owner);
                if removed > 0 {
                    tracing::warn!(
                        removed,
                        run,
                        worker,
                        "removed sandboxes a previous worker left behind"
                    );
                }
                Ok(SandboxFactory::Local {
                    root: self.sandbox_root.clone(),
                    owner: Some(owner),
                })
            }
            SandboxKind::Docker => {
                let user = parse_user(&self.container_user).with_context(|| {
                    format!("worker.container_user = {:?}", self.container_user)
                })?;
                let docker = crate::sandbox::docker::connect().await?;
                let removed =
                    crate::sandbox::docker::remove_orphans(&docker, run, Some(worker)).await?;
                if removed > 0 {
                    tracing::warn!(
                        removed,
                        run,
                        worker,
                        "removed containers a previous worker left behind"
                    );
                }
                let mut settings = DockerSettings {
                    docker,
                    image: ImageRule::parse(&self.image),
                    run: run.to_string(),
                    worker: worker.to_string(),
                    memory_bytes: (self.memory_mb as i64) << 20,
                    nano_cpus: (self.cpus * 1e9) as i64,
                    pids_limit: self.pids_limit,
                    network: self.network,
                    user,
                    pool: None,
                };
                if self.warm_pool > 0 {
                    let template = settings.spec(&Default::default(), "");
                    let pool =
                        WarmPool::start(&settings.docker, &template, self.warm_pool as usize);
                    // One image for every task: fill now. Otherwise an image's pool
                    // fills at its first request.
                    if let ImageRule::Fixed(image) = &settings.image {
                        pool.warm(image).await;
                    }
                    tracing::info!(
                        size = self.warm_pool,
                        pool = pool.name(),
                        "warm container pool started"
                    );
                    settings.pool = Some(pool);
                }
                Ok(SandboxFactory::Docker(Box::new(settings)))
            }
        }
    }
}

impl WorkerConfig {
    /// The teacher this configuration describes (checks the endpoint settings).
    pub fn teacher_source(&self) -> Result<TeacherSource> {
        Ok(match self.teacher.kind {
            TeacherKind::Oracle => TeacherSource::Oracle,
            TeacherKind::Endpoint => {
                let e = ChatEndpoint::new(&self.teacher).map_err(anyhow::Error::msg)?;
                tracing::info!(url = %self.teacher.base_url, model = %self.teacher.model, "teacher: OpenAI-compatible endpoint");
                TeacherSource::Endpoint(Arc::new(e), tokio::runtime::Handle::current())
            }
        })
    }
}

fn parse_user(s: &str) -> Result<(u32, u32)> {
    let (u, g) = s.split_once(':').unwrap_or((s, s));
    Ok((
        u.trim()
            .parse()
            .context("expected uid:gid, e.g. 1000:1000")?,
        g.trim()
            .parse()
            .context("expected uid:gid, e.g. 1000:1000")?,
    ))
}

pub struct WorkerOptions {
    pub name: String,
    /// The run this worker belongs to (labels its containers).
    pub run: String,
    pub coordinator: String,
    /// config.json and tokenizer.json of the student.
    pub model_dir: PathBuf,
    /// Downloaded weights are staged here.
    pub cache_dir: PathBuf,
    pub config: WorkerConfig,
    /// The deployment's token, sent to the coordinator and the learner's Weights service.
    pub auth: ClientAuth,
    /// Versions arriving over the weights broadcast (`weights_from = "broadcast"`; the
    /// caller runs the receiver that fills it). `None`: gRPC only.
    pub broadcast: Option<crate::student::BroadcastInbox>,
}

/// Runs the worker until the coordinator says the run is finished or `shutdown` fires.
pub async fn run_worker(
    opts: WorkerOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    // tokenizer.json, and the directory's chat template when it has one (else ChatML).
    let tokenizer = ChatTokenizer::from_dir(&opts.model_dir)
        .with_context(|| format!("loading the tokenizer of {}", opts.model_dir.display()))?;
    // Episodes append observations after generated tokens: a template that cannot do
    // that fails here, not in the middle of the first episode.
    tokenizer
        .render_observation("probe")
        .with_context(|| format!("the chat template of {}", opts.model_dir.display()))?;
    let tokenizer = Arc::new(tokenizer);
    let student = StudentHost::on_device(
        &opts.model_dir,
        &opts.cache_dir,
        (*tokenizer).clone(),
        opts.config.student_engine(),
        opts.auth.clone(),
        opts.config.student_device()?,
    )?
    .with_broadcast(opts.broadcast.clone());
    let rpc_timeout = Duration::from_secs_f64(opts.config.rpc_timeout_s);
    let channel = connect(&opts.auth, &opts.coordinator).await?;
    let mut client = RolloutClient::new(opts.auth.channel(channel))
        .max_decoding_message_size(tutor_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(tutor_proto::MAX_MESSAGE_BYTES);
    let mut req = Request::new(RegisterRequest {
        worker_name: opts.name.clone(),
        capacity: opts.config.capacity,
    });
    req.set_timeout(rpc_timeout);
    let reg = client
        .register(req)
        .await
        .context("registering with the coordinator")?
        .into_inner();
    let worker_id = reg.worker_id.clone();
    tracing::info!(worker = %worker_id, coordinator = %opts.coordinator, "registered");

    let sandboxes = opts.config.sandboxes(&opts.run, &opts.name).await?;
    let teacher = opts.config.teacher_source()?;
    tracing::info!(sandbox = sandboxes.kind(), "sandboxes ready");
    let cancel = Arc::new(AtomicBool::new(false));
    let active: Arc<Mutex<HashSet<String>>> = Default::default();
    let sink = EventSink::spawn(client.clone());
    let heartbeat = tokio::spawn(heartbeat_loop(
        client.clone(),
        worker_id.clone(),
        Duration::from_millis(reg.heartbeat_interval_ms.max(100)),
        active.clone(),
        student.clone(),
        rpc_timeout,
    ));
    {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            shutdown.await;
            tracing::info!("shutdown: finishing the current turns, leasing no more");
            cancel.store(true, Ordering::SeqCst);
        });
    }

    let env = EpisodeEnv {
        worker_id: worker_id.clone(),
        tokenizer,
        student: student.clone(),
        events: sink.events.clone(),
        system_prompt: if opts.config.system_prompt.is_empty() {
            DEFAULT_SYSTEM_PROMPT.to_string()
        } else {
            opts.config.system_prompt.clone()
        },
        sandboxes,
        teacher,
        grade_timeout: Duration::from_secs_f64(opts.config.grade_timeout_s),
        cancel: cancel.clone(),
    };
    let capacity = opts.config.capacity.max(1) as usize;
    let slots = Arc::new(Semaphore::new(capacity));
    let mut failures = 0u32;
    let mut lost = None;
    while !cancel.load(Ordering::SeqCst) {
        let first = slots.clone().acquire_owned().await.expect("semaphore open");
        let free = slots.available_permits() as u32 + 1;
        let mut req = Request::new(LeaseRequest {
            worker_id: worker_id.clone(),
            max_episodes: free,
        });
        req.set_timeout(rpc_timeout);
        let resp = match client.lease(req).await {
            Ok(r) => {
                failures = 0;
                r.into_inner()
            }
            Err(status) => {
                failures += 1;
                drop(first);
                if failures > 60 {
                    lost = Some(anyhow::anyhow!(
                        "the coordinator at {} stopped answering: {status}",
                        opts.coordinator
                    ));
                    break;
                }
                tracing::warn!(%status, "lease failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        if resp.run_finished {
            tracing::info!("the coordinator says the run is finished");
            break;
        }
        if resp.leases.is_empty() {
            drop(first);
            tokio::time::sleep(Duration::from_millis(resp.retry_after_ms.clamp(50, 5000))).await;
            continue;
        }
        let mut permit = Some(first);
        for lease in resp.leases {
            let permit = match permit.take() {
                Some(p) => p,
                None => slots.clone().acquire_owned().await.expect("semaphore open"),
            };
            let env = env.clone();
            let active = active.clone();
            let student = student.clone();
            active
                .lock()
                .expect("active set")
                .insert(lease.episode_id.clone());
            tokio::spawn(async move {
                let id = lease.episode_id.clone();
                // Weights are swapped between episodes, never during one.
                if let Some(p) = &lease.policy {
                    if let Err(e) = student.ensure(p).await {
                        tracing::error!(episode = %id, error = %format!("{e:#}"), "could not load the leased policy version");
                    }
                }
                let result = tokio::task::spawn_blocking(move || run_episode(&env, &lease)).await;
                match result {
                    Ok(o) => {
                        tracing::info!(episode = %id, status = o.status, turns = o.num_turns, seconds = o.duration_s, "episode done")
                    }
                    Err(e) => tracing::error!(episode = %id, error = %e, "episode thread panicked"),
                }
                active.lock().expect("active set").remove(&id);
                drop(permit);
            });
        }
    }
    if let Some(e) = lost {
        env.sandboxes.shutdown().await;
        return Err(e);
    }
    // Let running episodes end (they stop early when cancelled), then deliver every event.
    let _all = slots
        .acquire_many(capacity as u32)
        .await
        .expect("semaphore open");
    // On shutdown the coordinator may be stopping too: wait less for the last acks.
    let grace = if cancel.load(Ordering::SeqCst) {
        10
    } else {
        60
    };
    sink.flush(Duration::from_secs(grace)).await;
    heartbeat.abort();
    // The warm pool's containers go with the worker, and any a removal missed.
    env.sandboxes.shutdown().await;
    env.sandboxes.remove_leftovers().await;
    tracing::info!(worker = %worker_id, version = student.loaded_version(), "worker stopped");
    Ok(())
}

async fn connect(auth: &ClientAuth, endpoint: &str) -> Result<Channel> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let ep = auth
            .endpoint(endpoint)
            .context("the --coordinator endpoint")?
            .connect_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(Duration::from_secs(20));
        match ep.connect().await {
            Ok(c) => return Ok(c),
            Err(e) if std::time::Instant::now() < deadline => {
                tracing::debug!(error = %e, "coordinator not reachable yet");
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("connecting to the coordinator at {endpoint}"))
            }
        }
    }
}

async fn heartbeat_loop(
    mut client: RolloutClient<AuthChannel>,
    worker_id: String,
    every: Duration,
    active: Arc<Mutex<HashSet<String>>>,
    student: StudentHost,
    rpc_timeout: Duration,
) {
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        let active_now: Vec<String> = active.lock().expect("active set").iter().cloned().collect();
        let mut req = Request::new(HeartbeatRequest {
            worker_id: worker_id.clone(),
            active_episodes: active_now.clone(),
            loaded_version: student.loaded_version(),
        });
        req.set_timeout(rpc_timeout);
        match client.heartbeat(req).await {
            Ok(r) => {
                let r = r.into_inner();
                // New weights: load them now if idle, so the next episode starts at once.
                if let Some(latest) = r.latest {
                    if !latest.sha256.is_empty()
                        && latest.version != student.loaded_version()
                        && active_now.is_empty()
                    {
                        if let Err(e) = student.ensure(&latest).await {
                            tracing::warn!(version = latest.version, error = %format!("{e:#}"), "prefetching weights failed");
                        }
                    }
                }
            }
            Err(status) => tracing::warn!(%status, "heartbeat failed"),
        }
    }
}

/// Delivers episode events at least once: keeps each event until the coordinator acks
/// it (after its durable write) and replays the unacked ones on a new stream.
struct EventSink {
    events: mpsc::Sender<EpisodeEvent>,
    flush: mpsc::Sender<oneshot::Sender<()>>,
}

impl EventSink {
    fn spawn(client: RolloutClient<AuthChannel>) -> Self {
        let (events, rx) = mpsc::channel(256);
        let (flush, flush_rx) = mpsc::channel(4);
        tokio::spawn(sink_loop(client, rx, flush_rx));
        Self { events, flush }
    }

    async fn flush(&self, timeout: Duration) {
        let (tx, rx) = oneshot::channel();
        if self.flush.send(tx).await.is_ok() && tokio::time::timeout(timeout, rx).await.is_err() {
            tracing::error!("events still unacknowledged after {timeout:?}: they may be lost");
        }
    }
}

async fn sink_loop(
    mut client: RolloutClient<AuthChannel>,
    mut events: mpsc::Receiver<EpisodeEvent>,
    mut flush_rx: mpsc::Receiver<oneshot::Sender<()>>,
) {
    let mut pending: BTreeMap<u64, EpisodeEvent> = BTreeMap::new();
    let mut seq_of: BTreeMap<(String, u32), u64> = BTreeMap::new();
    let mut next_seq = 0u64;
    let mut waiters: Vec<oneshot::Sender<()>> = Vec::new();
    let mut events_open = true;
    loop {
        let (stx, srx) = mpsc::channel::<EpisodeEvent>(256);
        let mut acks = match client
            .stream_events(tokio_stream::wrappers::ReceiverStream::new(srx))
            .await
        {
            Ok(r) => r.into_inner(),
            Err(status) => {
                tracing::warn!(%status, "event stream to the coordinator failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let mut ok = true;
        for ev in pending.values() {
            if stx.send(ev.clone()).await.is_err() {
                ok = false;
                break;
            }
        }
        while ok {
            if pending.is_empty() {
                for w in waiters.drain(..) {
                    let _ = w.send(());
                }
            }
            tokio::select! {
                ev = events.recv(), if events_open => match ev {
                    Some(ev) => {
                        let Some(key) = tutor_proto::event_key(&ev) else { continue };
                        seq_of.insert(key, next_seq);
                        pending.insert(next_seq, ev.clone());
                        next_seq += 1;
                        if stx.send(ev).await.is_err() {
                            ok = false;
                        }
                    }
                    None => events_open = false,
                },
                w = flush_rx.recv() => match w {
                    Some(w) => waiters.push(w),
                    None => return,
                },
                ack = acks.message() => match ack {
                    Ok(Some(ack)) => {
                        if let Some(seq) = seq_of.remove(&(ack.episode_id, ack.turn_index)) {
                            pending.remove(&seq);
                        }
                    }
                    Ok(None) | Err(_) => {
                        tracing::warn!(unacked = pending.len(), "event stream broke; reconnecting and replaying");
                        ok = false;
                    }
                },
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn student_device_is_parsed_and_checked() {
        let mut c = WorkerConfig::default();
        assert_eq!(c.student_device().unwrap(), tch::Device::Cpu);
        c.student_device = "gpu".into();
        let e = c.student_device().unwrap_err().to_string();
        assert!(
            e.contains("worker.student_device") && e.contains("gpu"),
            "{e}"
        );
        // More GPUs than any machine here has: a clear error, not a crash in libtorch.
        c.student_device = "cuda:63".into();
        let e = c.student_device().unwrap_err().to_string();
        assert!(e.contains("cuda:63") && e.contains("CUDA device"), "{e}");
    }
}
