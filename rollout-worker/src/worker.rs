//! The worker process: registers with the coordinator, leases episodes up to its
//! capacity, runs them, streams their events (replaying unacknowledged ones after a
//! broken stream), heartbeats, and swaps in new policy versions between episodes.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, Semaphore};
use tonic::transport::Channel;
use tonic::Request;
use tutor_policy::ChatTokenizer;
use tutor_proto::auth::{AuthChannel, ClientAuth};
use tutor_proto::rollout_client::RolloutClient;
use tutor_proto::{
    episode_event, EpisodeEvent, EpisodeLease, EpisodeOutcome, HeartbeatRequest, LeaseRequest,
    OutcomeStatus, RegisterRequest,
};

use crate::episode::{run_episode, EpisodeEnv, TeacherSource, DEFAULT_SYSTEM_PROMPT};
use crate::sandbox::WarmPool;
use crate::sandbox::{DockerSettings, ImageRule, SandboxFactory};
use crate::sink::{EventSink, WorkerIdentity};
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
    /// How submissions are graded for rewards: `strict` (files that change test
    /// collection or reporting reset, pytest results from Tutor's own report, skipped
    /// tests never count as passing; disagreements with the harness logged) or `harness`
    /// (exactly what the SWE-bench harness reports).
    pub grading: crate::grade::GradingMode,
    /// Where episodes run: `local` (a temporary git working copy per episode) or
    /// `docker` (a container per episode, built with `make images`).
    pub sandbox: SandboxKind,
    /// Where local episode working copies are created (default: the system temp dir).
    pub sandbox_root: Option<PathBuf>,
    /// Local sandboxes: run the model's commands even where they cannot be confined (no
    /// bubblewrap, or user namespaces disabled), as this worker's user on the host with
    /// the run's token, the Python venv and everything else of the user in reach
    /// (docs/security.md, "Local sandbox"). Off by default: such a worker refuses to start,
    /// naming what is missing.
    pub allow_unconfined: bool,
    /// Local sandboxes: the free space (MiB) kept on the file system that holds them. A
    /// command that brings the space available there under it is killed (checked every
    /// 50 ms and when it ends) and its episode ends unresolved without tests; a command
    /// that would start under it is not run and its episode ends ungraded (SANDBOX_ERROR);
    /// grading follows the same rule (docs/security.md, "Local sandbox"). A worker whose
    /// sandbox disk is under it refuses to start, and later leases nothing until space is
    /// freed. 0 turns the floor off. Docker sandboxes have `disk_mb` instead.
    pub min_free_disk_mb: u64,
    /// Docker: the image of tasks whose record names none. An image name, `swebench`
    /// (the SWE-bench naming rule), or a template with `{instance_id}`, `{repo}`,
    /// `{repo_slug}`, `{version}`.
    pub image: String,
    /// The memory (MiB) of one sandbox. Docker: the container's limit (swap included).
    /// Local: what a command's processes hold together (their proportional share of
    /// anonymous and shared memory and swap, read every 100 ms); over it they are killed,
    /// exit status 137 as from an out-of-memory killer, and the episode goes on
    /// (docs/security.md, "Local sandbox"). 0: no ceiling for local sandboxes.
    pub memory_mb: u64,
    /// Docker: per-container limits.
    pub cpus: f64,
    pub pids_limit: i64,
    /// Docker: open files per process in a container (`ulimit -n`, soft and hard).
    pub nofile: i64,
    /// Docker: the largest file a process in a container may write, in MiB (`ulimit -f`,
    /// soft and hard); a write past it fails (EFBIG, or SIGXFSZ in a shell).
    pub fsize_mb: u64,
    /// Docker: give containers a network (off by default).
    pub network: bool,
    /// Docker: a read-only root filesystem, the agent writing only to size-capped tmpfs
    /// mounts (the working directory, /tmp). Turn off for an image that must write
    /// elsewhere (a SWE-bench image whose tests install into its environment).
    pub read_only_root: bool,
    /// Docker: what the agent can write, in MiB (the working directory's tmpfs; with a
    /// writable root, the writable layer where the storage driver supports a quota).
    pub disk_mb: u64,
    /// Docker: /tmp's tmpfs, in MiB (read-only root only).
    pub tmp_mb: u64,
    /// Docker: uid:gid the agent's shell runs as (the task image's unprivileged user), or
    /// "image": each image's own `USER` where it is a numeric non-root uid[:gid] (an image
    /// that runs as root or names its user is refused, saying so). The repository is
    /// always the image's `WORKDIR` (/testbed where it names none).
    pub container_user: String,
    /// Docker: pull a sandbox image the engine does not have from its registry (with the
    /// engine's credentials) instead of failing the episode. For engines that start
    /// empty, such as a Kubernetes worker pod's Docker sidecar (deploy/k8s). Off by
    /// default: here images are built locally and no registry is reachable.
    pub pull_images: bool,
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
    /// Tokens of finished turns whose keys and values the student's engine keeps, so the
    /// next turn of an episode (the previous prompt, the reply and the observation)
    /// prefills only its new tokens; least recently used first out, emptied at each new
    /// policy version. 0 turns it off.
    pub student_prefix_cache_tokens: usize,
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
    /// `[worker.student]`: the in-process engine (default, the `student_*` settings above)
    /// or an external engine (SGLang's native API: SGLang, or `tutor serve`).
    pub student: crate::student_engine::StudentConfig,
}

/// See `WorkerConfig::weights_from`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightsFrom {
    #[default]
    Grpc,
    Broadcast,
}

impl WorkerConfig {
    /// What a worker of these settings checks on this machine before its first lease:
    /// local sandboxes that can be confined (or `allow_unconfined`), and a Python that
    /// can grade (pytest). `tutor run` calls it too, before it makes the run directory
    /// and starts any process.
    pub fn preflight(&self) -> Result<()> {
        if self.sandbox == SandboxKind::Local {
            crate::sandbox::Confinement::new(&self.confine_settings())?;
            let python = crate::sandbox::local::python_interpreter();
            crate::sandbox::local::check_grading_python(&python).map_err(anyhow::Error::msg)?;
            if let Some((root, bytes)) = self.local_disk_floor() {
                if let Some(what) = crate::sandbox::local::disk_under_floor(&root, bytes) {
                    anyhow::bail!(
                        "the file system of the local sandboxes ({}) has {what}: every episode \
                         would stop at its first command. Free space there, point \
                         [worker] sandbox_root at another disk, or lower min_free_disk_mb",
                        root.display()
                    );
                }
            }
        }
        Ok(())
    }

    /// Settings no container could start with, named by their `[worker]` key.
    pub fn validate(&self) -> Result<()> {
        if !(16..=1 << 20).contains(&self.nofile) {
            anyhow::bail!(
                "worker.nofile must be between 16 (a shell and the worker's execs need a few \
                 descriptors) and 1048576, got {}",
                self.nofile
            );
        }
        if self.fsize_mb == 0 || self.fsize_mb > 1 << 30 {
            anyhow::bail!(
                "worker.fsize_mb must be at least 1 (the largest file a command may write, \
                 in MiB), got {}",
                self.fsize_mb
            );
        }
        Ok(())
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            capacity: 1,
            grade_timeout_s: 120.0,
            grading: crate::grade::GradingMode::Strict,
            sandbox: SandboxKind::Local,
            sandbox_root: None,
            allow_unconfined: false,
            min_free_disk_mb: 1024,
            image: "tutor/python-task:latest".into(),
            memory_mb: 2048,
            cpus: 1.0,
            pids_limit: 512,
            nofile: 1024,
            fsize_mb: 1024,
            network: false,
            read_only_root: true,
            disk_mb: 1024,
            tmp_mb: 256,
            container_user: "1000:1000".into(),
            pull_images: false,
            warm_pool: 0,
            system_prompt: String::new(),
            teacher: TeacherConfig::default(),
            rpc_timeout_s: 30.0,
            torch_threads: 1,
            student_max_batch: 16,
            student_cache_tokens: 65_536,
            student_prefix_cache_tokens: 65_536,
            weights_from: WeightsFrom::Grpc,
            broadcast_wait_s: 30.0,
            student_device: "cpu".into(),
            student: Default::default(),
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
            prefix_cache_tokens: self.student_prefix_cache_tokens,
        }
    }

    /// The sandbox factory this configuration describes, after removing what a previous
    /// incarnation of this worker (same run and worker name) left behind: for Docker its
    /// labelled containers, for local sandboxes the directories named after it.
    pub async fn sandboxes(&self, run: &str, worker: &str) -> Result<SandboxFactory> {
        match self.sandbox {
            SandboxKind::Local => {
                // The model's commands run on this host: this process's /proc (its
                // environment, its memory) stays out of their user's reach.
                crate::sandbox::confine::harden_process();
                let owner = format!("{run}-{worker}");
                let factory = SandboxFactory::local(
                    self.sandbox_root.clone(),
                    Some(owner.clone()),
                    &self.confine_settings(),
                )?;
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
                Ok(factory)
            }
            SandboxKind::Docker => {
                // "image": each image's own (numeric, non-root) user.
                let user_from_image = self.container_user.trim() == "image";
                let user = if user_from_image {
                    (1000, 1000)
                } else {
                    parse_user(&self.container_user).with_context(|| {
                        format!(
                            "worker.container_user = {:?} (uid:gid, or \"image\")",
                            self.container_user
                        )
                    })?
                };
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
                    nofile: self.nofile,
                    fsize_bytes: (self.fsize_mb as i64) << 20,
                    network: self.network,
                    read_only_root: self.read_only_root,
                    disk_bytes: (self.disk_mb as i64) << 20,
                    tmp_bytes: (self.tmp_mb as i64) << 20,
                    user,
                    user_from_image,
                    pull_missing: self.pull_images,
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
    /// `min_free_disk_mb` in bytes.
    fn min_free_disk_bytes(&self) -> u64 {
        self.min_free_disk_mb.saturating_mul(1 << 20)
    }

    /// Where local sandboxes are made and the free bytes their disk must keep; `None`
    /// for Docker sandboxes or with `min_free_disk_mb = 0`.
    fn local_disk_floor(&self) -> Option<(PathBuf, u64)> {
        let bytes = self.min_free_disk_bytes();
        (self.sandbox == SandboxKind::Local && bytes > 0).then(|| {
            let root = self.sandbox_root.clone().unwrap_or_else(std::env::temp_dir);
            (root, bytes)
        })
    }

    /// How local sandboxes are to be confined (`allow_unconfined`).
    pub fn confine_settings(&self) -> crate::sandbox::ConfineSettings {
        crate::sandbox::ConfineSettings {
            allow_unconfined: self.allow_unconfined,
            limits: crate::sandbox::Limits {
                min_free_disk_bytes: self.min_free_disk_bytes(),
                memory_bytes: self.memory_mb.saturating_mul(1 << 20),
                ..Default::default()
            },
            ..Default::default()
        }
    }

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
    // Before anything else: a worker whose episodes cannot be confined refuses here, and
    // its /proc (the run's token and API keys in its environment) is no other process's.
    crate::sandbox::confine::harden_process();
    opts.config.preflight()?;
    // tokenizer.json, and the directory's chat template when it has one (else ChatML).
    let tokenizer = ChatTokenizer::from_dir(&opts.model_dir)
        .with_context(|| format!("loading the tokenizer of {}", opts.model_dir.display()))?;
    // Episodes append observations after generated tokens: a template that cannot do
    // that fails here, not in the middle of the first episode.
    tokenizer
        .render_observation("probe")
        .with_context(|| format!("the chat template of {}", opts.model_dir.display()))?;
    let tokenizer = Arc::new(tokenizer);
    let student = match opts.config.student.kind {
        crate::student_engine::StudentKind::Local => StudentHost::on_device(
            &opts.model_dir,
            &opts.cache_dir,
            (*tokenizer).clone(),
            opts.config.student_engine(),
            opts.auth.clone(),
            opts.config.student_device()?,
        )?,
        crate::student_engine::StudentKind::Engine => StudentHost::remote(
            &opts.model_dir,
            &opts.cache_dir,
            &opts.config.student,
            opts.auth.clone(),
        )
        .await
        .context("worker.student: the external student engine")?,
    }
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
    let sink = EventSink::spawn(
        client.clone(),
        Some(WorkerIdentity {
            worker_id: worker_id.clone(),
            secret: reg.worker_secret.clone(),
        }),
    );
    let heartbeat = tokio::spawn(heartbeat_loop(
        client.clone(),
        worker_id.clone(),
        Duration::from_millis(reg.heartbeat_interval_ms.max(100)),
        active.clone(),
        student.clone(),
        rpc_timeout,
        cancel.clone(),
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
        grading: opts.config.grading,
        cancel: cancel.clone(),
    };
    let capacity = opts.config.capacity.max(1) as usize;
    let slots = Arc::new(Semaphore::new(capacity));
    let mut failures = 0u32;
    let mut lost = None;
    // Set when the student engine is lost: running episodes are drained and their events
    // delivered before the worker stops with it.
    let mut engine_lost = None;
    let disk_floor = opts.config.local_disk_floor();
    while !cancel.load(Ordering::SeqCst) {
        // An external engine that stopped answering: lease nothing until it answers again
        // (episodes would only fail), and stop after `down_s`.
        if let Some(engine) = student.remote_engine() {
            if !engine.seems_up() {
                if let Err(e) = engine.wait_up().await {
                    engine_lost = Some(e);
                    break;
                }
            }
            if student.reload_failures() >= crate::student::RELOAD_FAILURES_TO_STOP {
                engine_lost = Some(anyhow::anyhow!(
                    "the student engine at {} refused (or, loaded by the learner, never served) \
                     {} policy versions in a row: stopping (episodes would run on versions they \
                     were not leased for; the log says why each reload failed)",
                    engine.url(),
                    student.reload_failures()
                ));
                break;
            }
        }
        let Some(first) = free_slot(&slots, disk_floor.as_ref(), &cancel, DISK_PAUSE_POLL).await
        else {
            break;
        };
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
                // Weights are swapped between episodes, never during one: the episode
                // holds the student from here to its end, and a swap waits for holders.
                let mut lease = lease;
                if let Some(p) = &lease.policy {
                    if let Err(e) = student.ensure(p).await {
                        tracing::error!(episode = %id, error = %format!("{e:#}"), "could not load the leased policy version");
                    }
                }
                let held = student.hold().await;
                under_loaded_version(&mut lease, student.loaded_version());
                let events = env.events.clone();
                let worker_id = env.worker_id.clone();
                let leased = lease.clone();
                let o = run_guarded(&events, &worker_id, &leased, move || {
                    run_episode(&env, &lease)
                })
                .await;
                tracing::info!(episode = %id, status = o.status, turns = o.num_turns, seconds = o.duration_s, "episode done");
                drop(held);
                active.lock().expect("active set").remove(&id);
                drop(permit);
            });
        }
    }
    if let Some(e) = lost {
        env.sandboxes.shutdown().await;
        return Err(e);
    }
    if engine_lost.is_some() {
        // Running episodes stop after their current turn.
        cancel.store(true, Ordering::SeqCst);
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
    let _ = sink.flush(Duration::from_secs(grace)).await;
    heartbeat.abort();
    // The warm pool's containers go with the worker, and any a removal missed.
    env.sandboxes.shutdown().await;
    env.sandboxes.remove_leftovers().await;
    tracing::info!(worker = %worker_id, version = student.loaded_version(), "worker stopped");
    match engine_lost {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A free episode slot to lease for, once the sandbox disk (`floor`: its root and the
/// bytes to keep) is above its floor: every episode leased under it would stop at its
/// first command, ungraded. The disk is checked after the slot is free, since episodes
/// that fill the disk end at the floor and free their slots. `None` on shutdown.
async fn free_slot(
    slots: &Arc<Semaphore>,
    floor: Option<&(PathBuf, u64)>,
    cancel: &AtomicBool,
    poll: Duration,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    let permit = slots.clone().acquire_owned().await.expect("semaphore open");
    if let Some((root, bytes)) = floor {
        wait_for_disk(root, *bytes, cancel, poll).await;
    }
    (!cancel.load(Ordering::SeqCst)).then_some(permit)
}

/// How often a worker paused on a full sandbox disk looks at it again.
const DISK_PAUSE_POLL: Duration = Duration::from_secs(2);

/// Returns once the file system of `root` has `bytes` free (and the floor's inodes), or
/// `cancel` is set: the worker leases nothing meanwhile (its running episodes and
/// heartbeats go on). Says when it pauses, every minute while paused, and when it goes
/// on.
async fn wait_for_disk(root: &std::path::Path, bytes: u64, cancel: &AtomicBool, poll: Duration) {
    let mut paused: Option<(std::time::Instant, std::time::Instant)> = None;
    loop {
        let Some(what) = crate::sandbox::local::disk_under_floor(root, bytes) else {
            if let Some((since, _)) = paused {
                tracing::info!(dir = %root.display(), paused_s = since.elapsed().as_secs(), "the sandbox disk is above its floor again: leasing");
            }
            return;
        };
        if cancel.load(Ordering::SeqCst) {
            return;
        }
        let now = std::time::Instant::now();
        let first = paused.is_none();
        let (since, said) = paused.get_or_insert((now, now));
        if first || said.elapsed() >= Duration::from_secs(60) {
            tracing::warn!(
                dir = %root.display(),
                paused_s = since.elapsed().as_secs(),
                "the sandbox disk has {what}: leasing no episodes until space is freed there \
                 (episodes would stop at their first command); running episodes go on"
            );
            *said = now;
        }
        tokio::time::sleep(poll).await;
    }
}

/// Makes `lease` report its episode under `loaded`, the version the student actually
/// runs, when that is not the leased one (its download or load failed): the
/// coordinator's staleness rule and the datasets then see the truth. True if it changed.
fn under_loaded_version(lease: &mut EpisodeLease, loaded: u64) -> bool {
    match lease.policy.as_mut() {
        Some(p) if p.version != loaded => {
            tracing::warn!(episode = %lease.episode_id, leased = p.version, loaded, "the episode runs on, and is reported under, the version loaded");
            p.version = loaded;
            p.sha256.clear();
            true
        }
        _ => false,
    }
}

/// Runs `episode` on a blocking thread. If it panics, the panic is reported as the
/// episode's outcome (SANDBOX_ERROR, naming the panic; never counted as solved), so its
/// slot completes at once instead of holding the iteration until the lease expires, and
/// the worker goes on with its next lease.
async fn run_guarded(
    events: &mpsc::Sender<EpisodeEvent>,
    worker_id: &str,
    lease: &EpisodeLease,
    episode: impl FnOnce() -> EpisodeOutcome + Send + 'static,
) -> EpisodeOutcome {
    let panic = match tokio::task::spawn_blocking(episode).await {
        Ok(outcome) => return outcome,
        Err(e) if e.is_panic() => e.into_panic(),
        Err(e) => Box::new(e.to_string()),
    };
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into());
    tracing::error!(episode = %lease.episode_id, panic = %message, "the episode panicked: reported as a SANDBOX_ERROR outcome");
    let outcome = EpisodeOutcome {
        status: OutcomeStatus::SandboxError as i32,
        error: format!("the worker's episode code panicked: {message}"),
        purpose: lease.purpose,
        iteration: lease.iteration,
        instance_id: lease
            .task
            .as_ref()
            .map(|t| t.instance_id.clone())
            .unwrap_or_default(),
        policy_version: lease.policy.as_ref().map(|p| p.version).unwrap_or(0),
        ..Default::default()
    };
    let event = EpisodeEvent {
        episode_id: lease.episode_id.clone(),
        worker_id: worker_id.to_string(),
        event: Some(episode_event::Event::Outcome(outcome.clone())),
    };
    if events.send(event).await.is_err() {
        tracing::error!(episode = %lease.episode_id, "event sink stopped: the panic's outcome is lost");
    }
    outcome
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
    cancel: Arc<AtomicBool>,
) {
    let mut tick = tokio::time::interval(every);
    // A prefetch runs beside the heartbeats, one at a time: a swap waits for the
    // episodes holding the student, and heartbeats must go on meanwhile, or their
    // leases would expire.
    let prefetching = Arc::new(std::sync::atomic::AtomicBool::new(false));
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
                // The run is over: a worker that leases nothing now (paused on a full disk)
                // would never hear it from a Lease answer.
                if r.shutdown && !cancel.swap(true, Ordering::SeqCst) {
                    tracing::info!("the coordinator says the run is finished: stopping");
                }
                // New weights: load them now if idle, so the next episode starts at once.
                if let Some(latest) = r.latest {
                    if !latest.sha256.is_empty()
                        && latest.version != student.loaded_version()
                        && active_now.is_empty()
                        && !prefetching.swap(true, std::sync::atomic::Ordering::SeqCst)
                    {
                        let (student, prefetching) = (student.clone(), prefetching.clone());
                        tokio::spawn(async move {
                            if let Err(e) = student.ensure(&latest).await {
                                tracing::warn!(version = latest.version, error = %format!("{e:#}"), "prefetching weights failed");
                            }
                            prefetching.store(false, std::sync::atomic::Ordering::SeqCst);
                        });
                    }
                }
            }
            Err(status) => tracing::warn!(%status, "heartbeat failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker whose sandbox disk goes under its floor leases nothing until space is
    /// freed (issue 16): every episode leased meanwhile would stop at its first command,
    /// ungraded, and spend the lease. `free_slot`, which the lease loop awaits before
    /// each Lease call, gives a slot at once above the floor; under it (a 600 MiB file
    /// past a floor 300 MiB under what was free) it gives none, also after the running
    /// episode ends and frees its slot (episodes that fill the disk end at the floor);
    /// once the file is removed it does, and a shutdown ends the wait.
    #[tokio::test]
    async fn leasing_pauses_while_the_sandbox_disk_is_under_its_floor() {
        use crate::sandbox::local::tests::{disk_floor_test_lock, temp_dir_available};
        let Some(_lock) = disk_floor_test_lock() else {
            return;
        };
        let root = tempfile::tempdir().unwrap();
        let floor = Arc::new((
            root.path().to_path_buf(),
            temp_dir_available() - (300 << 20),
        ));
        let cancel = Arc::new(AtomicBool::new(false));
        let slots = Arc::new(Semaphore::new(1));
        let poll = Duration::from_millis(50);
        let gate = |slots: &Arc<Semaphore>| {
            let (slots, floor, cancel) = (slots.clone(), floor.clone(), cancel.clone());
            tokio::spawn(async move { free_slot(&slots, Some(&floor), &cancel, poll).await })
        };
        let running = free_slot(&slots, Some(&floor), &cancel, poll)
            .await
            .expect("a slot at once above the floor");

        let blob = root.path().join("blob");
        let take_space = || {
            let f = std::fs::File::create(&blob).unwrap();
            let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
            // SAFETY: a descriptor we own, a range in bytes.
            assert_eq!(unsafe { libc::posix_fallocate(fd, 0, 600 << 20) }, 0);
        };
        take_space();
        let waiting = gate(&slots);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "a slot while the only one is busy");
        // The running episode ends (at the floor) and frees its slot: still no lease.
        drop(running);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!waiting.is_finished(), "leasing went on under the floor");
        std::fs::remove_file(&blob).unwrap();
        let permit = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("leasing goes on once space is freed")
            .unwrap();
        assert!(permit.is_some());
        drop(permit);

        // Paused again, a shutdown ends the wait, with no slot.
        take_space();
        let waiting = gate(&slots);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished());
        cancel.store(true, Ordering::SeqCst);
        let permit = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("a shutdown ends the wait")
            .unwrap();
        assert!(permit.is_none());
    }

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

    /// An episode that panics is reported as its outcome (SANDBOX_ERROR naming the
    /// panic), so its slot completes instead of waiting for the lease to expire; before,
    /// the worker only logged it.
    #[tokio::test]
    async fn a_panicking_episode_is_reported_as_its_outcome() {
        let (tx, mut rx) = mpsc::channel(4);
        let lease = EpisodeLease {
            episode_id: "it0-train-s3-a0".into(),
            iteration: 2,
            task: Some(tutor_proto::Task {
                instance_id: "toy-7".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let o = run_guarded(&tx, "w-1", &lease, || panic!("index out of bounds: 9")).await;
        assert_eq!(o.status, OutcomeStatus::SandboxError as i32);
        let ev = rx.try_recv().expect("the panic is reported");
        assert_eq!(
            (ev.episode_id.as_str(), ev.worker_id.as_str()),
            ("it0-train-s3-a0", "w-1")
        );
        let Some(episode_event::Event::Outcome(sent)) = ev.event else {
            panic!("an outcome")
        };
        assert_eq!(sent.status, OutcomeStatus::SandboxError as i32);
        assert!(
            sent.error.contains("index out of bounds: 9"),
            "{}",
            sent.error
        );
        assert_eq!((sent.iteration, sent.instance_id.as_str()), (2, "toy-7"));

        // An episode that returns is passed through, nothing extra sent.
        let o = run_guarded(&tx, "w-1", &lease, || EpisodeOutcome {
            num_turns: 3,
            ..Default::default()
        })
        .await;
        assert_eq!(o.num_turns, 3);
        assert!(rx.try_recv().is_err());
    }

    /// When the leased version could not be loaded, the episode is reported under the
    /// version the student runs; before, it carried the leased version it never ran.
    #[test]
    fn an_episode_is_reported_under_the_version_loaded() {
        let mut lease = EpisodeLease {
            episode_id: "e".into(),
            policy: Some(tutor_proto::PolicyVersion {
                version: 5,
                sha256: "ab".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(!under_loaded_version(&mut lease, 5));
        assert_eq!(lease.policy.as_ref().unwrap().version, 5);
        assert!(under_loaded_version(&mut lease, 3));
        let p = lease.policy.unwrap();
        assert_eq!((p.version, p.sha256.as_str()), (3, ""));
    }
}
