//! The student host: the continuous-batching engine of the policy crate owns the tch
//! policy on its own thread; episodes submit their turns to it, and a turn joins the
//! running batch at the next decode step instead of waiting for the batch to finish.
//! Weight swaps go through the engine too: it lets the generations already running
//! finish, swaps, then admits the rest, so every generation has a single version.
//!
//! Or the student runs on an external engine (`[worker.student] kind = "engine"`,
//! crate::student_engine): versions are staged on disk for it to load, and every turn it
//! generates is checked to come from the episode's version.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use tutor_policy::{
    spawn_engine, ChatTokenizer, EngineConfig, EngineHandle, EngineRequest, GenParams, Generation,
    ModelConfig, Policy, WeightsSource,
};
use tutor_proto::auth::ClientAuth;
use tutor_proto::PolicyVersion;

use crate::student_engine::{
    keep_newest_staged, label_version, stage_version, version_label, EngineError, LoadedBy,
    ReloadKind, RemoteEngine, StudentConfig,
};

/// Reloads of an external engine refused in a row after which the worker stops leasing:
/// every episode would run on a version it was not leased for.
pub const RELOAD_FAILURES_TO_STOP: u32 = 3;

/// Version number meaning "no weights loaded yet".
pub const NO_VERSION: u64 = u64::MAX;

/// The bytes of a safetensors file held in memory.
pub type WeightBytes = Arc<Vec<u8>>;

/// Policy versions that arrived over the weights broadcast (version → sha256 and the
/// safetensors file's bytes, in memory), filled by the receiver thread
/// (`tutor_collective::broadcast::spawn_receiver`), taken by `StudentHost::ensure`. Keeps
/// only the newest version (a version's bytes are the model's size: a lease for an older
/// one downloads it over gRPC).
#[derive(Clone)]
pub struct BroadcastInbox {
    arrived: tokio::sync::watch::Sender<BTreeMap<u64, (String, WeightBytes)>>,
    /// Whether the receiver is in a formed group (else nothing will arrive: `ensure`
    /// does not wait).
    in_group: Arc<std::sync::atomic::AtomicBool>,
    /// How long `ensure` waits for a version before downloading it.
    wait: Duration,
}

impl BroadcastInbox {
    pub fn new(wait: Duration) -> Self {
        Self {
            arrived: tokio::sync::watch::channel(BTreeMap::new()).0,
            in_group: Default::default(),
            wait,
        }
    }

    /// The receiver joined (`true`) or lost (`false`) its group.
    pub fn set_in_group(&self, yes: bool) {
        self.in_group.store(yes, Ordering::SeqCst);
    }

    /// Records a version the receiver got (callable from any thread).
    pub fn arrived(&self, version: u64, sha256: String, bytes: WeightBytes) {
        self.arrived.send_modify(|m| {
            m.insert(version, (sha256, bytes));
            while m.len() > 1 {
                let oldest = *m.keys().next().expect("not empty");
                m.remove(&oldest);
            }
        });
    }

    /// The bytes of `version` once it has arrived with checksum `sha256`: at once if it is
    /// here, else within the wait while the receiver is in a group (out of one, nothing
    /// is coming).
    async fn take(&self, version: u64, sha256: &str) -> Option<WeightBytes> {
        let mut rx = self.arrived.subscribe();
        let wait = if self.in_group.load(Ordering::SeqCst) {
            self.wait
        } else {
            Duration::ZERO
        };
        let found = tokio::time::timeout(
            wait,
            rx.wait_for(|m| m.get(&version).is_some_and(|(s, _)| s == sha256)),
        )
        .await;
        let bytes = match found {
            Ok(Ok(m)) => m.get(&version).map(|(_, b)| b.clone()),
            _ => None,
        };
        // The engine reads it once; the inbox forgets it, and anything older.
        self.arrived.send_modify(|m| {
            m.retain(|&v, _| v > version);
        });
        bytes
    }
}

/// Where the student generates.
#[derive(Clone)]
enum Backend {
    /// Tutor's engine, on a thread of this process.
    Local(EngineHandle),
    /// An external engine: policy versions are staged in `weights_dir` (the engine sees
    /// it as `engine_dir`) as Hugging Face directories, with `model_dir`'s files.
    Remote {
        engine: Arc<RemoteEngine>,
        model_dir: PathBuf,
        weights_dir: PathBuf,
        engine_dir: PathBuf,
        max_request: usize,
        /// The worker's runtime: episodes' blocking threads wait on the HTTP client in it.
        rt: tokio::runtime::Handle,
    },
}

/// Cheap to clone; every clone talks to the same engine.
#[derive(Clone)]
pub struct StudentHost {
    engine: Backend,
    loaded: Arc<AtomicU64>,
    /// External engine: the policy version loaded and the weight version string the
    /// engine serves it under, set and read together.
    current: Arc<std::sync::Mutex<(u64, String)>>,
    /// External engine: reloads refused in a row (the worker stops leasing at
    /// [`RELOAD_FAILURES_TO_STOP`]).
    reload_failures: Arc<std::sync::atomic::AtomicU32>,
    /// External engine: the version directories this worker staged, oldest first.
    staged: Arc<std::sync::Mutex<std::collections::VecDeque<PathBuf>>>,
    load_lock: Arc<tokio::sync::Mutex<()>>,
    /// Running episodes hold it for reading ([`StudentHost::hold`]); a swap into the
    /// in-process engine takes it for writing, so the weights never change under a running
    /// episode: a new version waits for the episodes of the old one to end.
    episodes: Arc<tokio::sync::RwLock<()>>,
    cache_dir: PathBuf,
    /// Sent with every weights download.
    auth: ClientAuth,
    broadcast: Option<BroadcastInbox>,
}

impl StudentHost {
    /// Builds the model from `model_dir/config.json` (random weights until a version is
    /// loaded) and starts its engine with `engine`'s limits (batch rows, cached tokens,
    /// intra-op threads). Weights are downloaded with `auth`. On the CPU the model is f32;
    /// use `on_device` for a GPU.
    pub fn start(
        model_dir: &Path,
        cache_dir: &Path,
        tokenizer: ChatTokenizer,
        engine: EngineConfig,
        auth: ClientAuth,
    ) -> Result<Self> {
        Self::on_device(
            model_dir,
            cache_dir,
            tokenizer,
            engine,
            auth,
            tch::Device::Cpu,
        )
    }

    /// `start` on `device`; on a GPU the model decodes in bf16 (versions are cast as they
    /// load).
    pub fn on_device(
        model_dir: &Path,
        cache_dir: &Path,
        tokenizer: ChatTokenizer,
        engine: EngineConfig,
        auth: ClientAuth,
        device: tch::Device,
    ) -> Result<Self> {
        let cfg_path = model_dir.join("config.json");
        let config = ModelConfig::load(&cfg_path)
            .with_context(|| format!("reading {}", cfg_path.display()))?;
        // Any single turn must fit, or it would wait for ever.
        let mut engine = engine;
        engine.max_cached_tokens = engine.max_cached_tokens.max(config.max_position_embeddings);
        let mut policy = Policy::new(config, device, 0);
        if device.is_cuda() {
            policy.var_store_mut().bfloat16();
        }
        // The engine thread ends when the last handle is dropped.
        let (engine, _thread) = spawn_engine(policy, tokenizer, engine);
        Ok(Self::with_backend(Backend::Local(engine), cache_dir, auth))
    }

    /// A host of `engine` with no version loaded yet.
    fn with_backend(engine: Backend, cache_dir: &Path, auth: ClientAuth) -> Self {
        Self {
            engine,
            loaded: Arc::new(AtomicU64::new(NO_VERSION)),
            current: Arc::new(std::sync::Mutex::new((NO_VERSION, String::new()))),
            reload_failures: Default::default(),
            staged: Default::default(),
            load_lock: Default::default(),
            episodes: Default::default(),
            cache_dir: cache_dir.to_path_buf(),
            auth,
            broadcast: None,
        }
    }

    /// The student on the external engine `config` names (`kind = "engine"`), for the
    /// model of `model_dir` (its config.json bounds token ids and requests). Waits up to
    /// `down_s` for the engine to answer; the error names it.
    pub async fn remote(
        model_dir: &Path,
        cache_dir: &Path,
        config: &StudentConfig,
        auth: ClientAuth,
    ) -> Result<Self> {
        let cfg_path = model_dir.join("config.json");
        let model = ModelConfig::load(&cfg_path)
            .with_context(|| format!("reading {}", cfg_path.display()))?;
        let engine = Arc::new(RemoteEngine::new(config, model.vocab_size)?);
        engine.wait_up().await?;
        let served = engine.served_version().await;
        tracing::info!(engine = %engine.url(), serving = ?served.as_ref().ok(), "student engine answers");
        let weights_dir = config
            .weights_dir
            .clone()
            .unwrap_or_else(|| cache_dir.join("engine-weights"));
        std::fs::create_dir_all(&weights_dir).with_context(|| {
            format!(
                "creating worker.student.weights_dir {}",
                weights_dir.display()
            )
        })?;
        let engine_dir = config
            .engine_weights_dir
            .clone()
            .unwrap_or_else(|| weights_dir.clone());
        let backend = Backend::Remote {
            engine,
            model_dir: model_dir.to_path_buf(),
            weights_dir,
            engine_dir,
            max_request: model.max_position_embeddings,
            rt: tokio::runtime::Handle::current(),
        };
        Ok(Self::with_backend(backend, cache_dir, auth))
    }

    /// The external engine, when the student runs on one.
    pub fn remote_engine(&self) -> Option<&RemoteEngine> {
        match &self.engine {
            Backend::Remote { engine, .. } => Some(engine),
            Backend::Local(_) => None,
        }
    }

    /// Takes versions from `inbox` (the weights broadcast) when they arrive in time.
    pub fn with_broadcast(mut self, inbox: Option<BroadcastInbox>) -> Self {
        self.broadcast = inbox;
        self
    }

    /// Held by a running episode, from after its `ensure` to its end: the in-process
    /// engine's weights do not change meanwhile (a swap waits for every holder). An
    /// external engine is shared with other clients; its turns are checked by version
    /// instead.
    pub async fn hold(&self) -> tokio::sync::OwnedRwLockReadGuard<()> {
        self.episodes.clone().read_owned().await
    }

    pub fn loaded_version(&self) -> u64 {
        self.loaded.load(Ordering::SeqCst)
    }

    /// Makes sure `policy` is the loaded version: downloads it from its weights
    /// endpoint (checksum verified) and swaps it in. Concurrent callers load once.
    pub async fn ensure(&self, policy: &PolicyVersion) -> Result<()> {
        let _guard = self.load_lock.lock().await;
        let t = std::time::Instant::now();
        match &self.engine {
            Backend::Local(_) if self.loaded_version() == policy.version => return Ok(()),
            Backend::Local(_) => {}
            Backend::Remote { engine, .. } => {
                // What the engine serves, not what this worker last loaded: it may have
                // restarted, or another worker sharing it may have loaded this version
                // already (the label holds the checksum: the same weights, whichever run
                // published them).
                let label = version_label(policy.version, &policy.sha256);
                match engine.served_version().await {
                    Ok(served) if served == label => {
                        self.reload_failures.store(0, Ordering::SeqCst);
                        self.set_current(policy.version, label);
                        return Ok(());
                    }
                    // Down: nothing to load into (the worker waits for it before leasing).
                    Err(e @ EngineError::Down { .. }) => return Err(e.into()),
                    _ => {}
                }
                if engine.config().loaded_by == LoadedBy::Learner {
                    // The learner loads it: wait for the engine to serve it.
                    let waited = engine.await_version(policy.version, &label).await;
                    match &waited {
                        Ok(()) => {}
                        // A newer version is served (no reload failed): the episode runs on
                        // it and is reported under it, as after a failed load.
                        Err(EngineError::Superseded { served, .. }) => {
                            let newer = label_version(served).unwrap_or(NO_VERSION);
                            self.set_current(newer, served.clone());
                        }
                        // Down: waited for before leasing, not a refusal.
                        Err(e) => {
                            if !matches!(e, EngineError::Down { .. }) {
                                self.reload_failures.fetch_add(1, Ordering::SeqCst);
                            }
                            self.set_current(NO_VERSION, String::new());
                        }
                    }
                    waited?;
                    self.reload_failures.store(0, Ordering::SeqCst);
                    self.set_current(policy.version, label);
                    tracing::info!(
                        version = policy.version,
                        seconds = t.elapsed().as_secs_f64(),
                        "the student engine serves the policy version (the learner loaded it)"
                    );
                    return Ok(());
                }
            }
        }
        let pushed = match &self.broadcast {
            Some(inbox) => inbox.take(policy.version, &policy.sha256).await,
            None => None,
        };
        let (source, via) = match pushed {
            Some(bytes) => (
                WeightsSource::Bytes {
                    bytes,
                    name: format!("policy version {} (in memory)", policy.version),
                },
                "broadcast",
            ),
            None => {
                if let Some(inbox) = &self.broadcast {
                    tracing::warn!(
                        version = policy.version,
                        in_group = inbox.in_group.load(Ordering::SeqCst),
                        wait_s = inbox.wait.as_secs_f64(),
                        "the policy version did not arrive over the weights broadcast: downloading it over gRPC"
                    );
                }
                let path = self
                    .cache_dir
                    .join(format!("policy-v{:06}.safetensors", policy.version));
                crate::weights::download_weights(
                    &policy.weights_endpoint,
                    policy.version,
                    &policy.sha256,
                    &path,
                    &self.auth,
                )
                .await?;
                (WeightsSource::Path(path), "grpc")
            }
        };
        let swapped = self.swap_in(source, policy.version, &policy.sha256).await;
        if let Backend::Remote { .. } = &self.engine {
            if let Err(e) = &swapped {
                // Refusals count towards stopping; an engine that is down is waited for.
                let down = matches!(
                    e.downcast_ref::<EngineError>(),
                    Some(EngineError::Down { .. })
                );
                if !down {
                    self.reload_failures.fetch_add(1, Ordering::SeqCst);
                }
                // What the engine serves now is unknown: no turn is taken until a reload
                // succeeds.
                self.set_current(NO_VERSION, String::new());
            } else {
                self.reload_failures.store(0, Ordering::SeqCst);
            }
        }
        swapped?;
        tracing::info!(
            version = policy.version,
            via,
            seconds = t.elapsed().as_secs_f64(),
            "loaded policy version"
        );
        Ok(())
    }

    /// Loads the safetensors file `path` as policy version `version` (checksum `sha256`,
    /// which names it on an external engine): swapped into the local engine, or staged and
    /// loaded by the external one. The file is consumed.
    pub async fn load_file(&self, path: &Path, version: u64, sha256: &str) -> Result<()> {
        let _guard = self.load_lock.lock().await;
        self.swap_in(WeightsSource::Path(path.to_path_buf()), version, sha256)
            .await
    }

    /// Loads `source` as policy version `version`; a file is consumed.
    async fn swap_in(&self, source: WeightsSource, version: u64, sha256: &str) -> Result<()> {
        match &self.engine {
            Backend::Local(engine) => {
                // Not under a running episode: it finishes on the weights it started on.
                let _no_episode = self.episodes.write().await;
                if let Err(e) = engine.load(source.clone()).await {
                    if let tutor_policy::LoadError::Weights {
                        error: tutor_policy::PolicyError::Torch { .. },
                        ..
                    } = &e
                    {
                        // Some tensors were copied: the weights are no version at all.
                        self.loaded.store(NO_VERSION, Ordering::SeqCst);
                    }
                    return Err(e.into());
                }
                if let WeightsSource::Path(path) = &source {
                    let _ = std::fs::remove_file(path);
                }
            }
            Backend::Remote {
                engine,
                model_dir,
                weights_dir,
                engine_dir,
                ..
            } => {
                let label = version_label(version, sha256);
                if engine.config().reload == ReloadKind::Distributed {
                    // Sent as tensors: nothing is staged for the engine to read.
                    let (bytes, consumed) = match source {
                        WeightsSource::Bytes { bytes, .. } => (bytes, None),
                        WeightsSource::Path(path) => (
                            Arc::new(
                                tokio::fs::read(&path)
                                    .await
                                    .with_context(|| format!("reading {}", path.display()))?,
                            ),
                            Some(path),
                        ),
                    };
                    engine.load_distributed(bytes, version, &label).await?;
                    if let Some(path) = consumed {
                        let _ = std::fs::remove_file(path);
                    }
                    self.set_current(version, label);
                    return Ok(());
                }
                // The engine reads files: bytes from the broadcast are written for it.
                let path = match source {
                    WeightsSource::Path(path) => path,
                    WeightsSource::Bytes { bytes, .. } => {
                        let path = self
                            .cache_dir
                            .join(format!("policy-v{version:06}.safetensors"));
                        tokio::fs::write(&path, &bytes[..])
                            .await
                            .with_context(|| format!("writing {}", path.display()))?;
                        path
                    }
                };
                let (name, created) = {
                    let (w, m, l) = (weights_dir.clone(), model_dir.clone(), label.clone());
                    let named_by_content = !sha256.is_empty();
                    tokio::task::spawn_blocking(move || {
                        stage_version(&w, &m, &path, &l, named_by_content)
                    })
                    .await
                    .context("staging the version for the student engine")??
                };
                if created {
                    self.keep_staged(weights_dir.join(&name));
                }
                engine
                    .load_from_disk(&engine_dir.join(name), version, &label)
                    .await?;
                self.set_current(version, label);
                return Ok(());
            }
        }
        self.loaded.store(version, Ordering::SeqCst);
        Ok(())
    }

    /// Records what the external engine serves: policy `version` under `label`.
    fn set_current(&self, version: u64, label: String) {
        let mut current = self.current.lock().expect("current version");
        *current = (version, label);
        self.loaded.store(version, Ordering::SeqCst);
    }

    /// Remembers a directory this worker staged; the oldest beyond the two newest are
    /// removed (the engine has copied them in). Only this worker's own.
    fn keep_staged(&self, dir: PathBuf) {
        keep_newest_staged(&mut self.staged.lock().expect("staged"), dir);
    }

    /// Forgets that the engine serves `version` (it answered with another).
    fn forget_current(&self, version: u64) {
        let mut current = self.current.lock().expect("current version");
        if current.0 == version {
            *current = (NO_VERSION, String::new());
            self.loaded.store(NO_VERSION, Ordering::SeqCst);
        }
    }

    /// External engine: reloads refused in a row.
    pub fn reload_failures(&self) -> u32 {
        self.reload_failures.load(Ordering::SeqCst)
    }

    /// The most tokens one request may hold, prompt and reply (the model's context and the
    /// engine's cache).
    pub fn max_request_tokens(&self) -> usize {
        match &self.engine {
            Backend::Local(engine) => engine.max_request_tokens(),
            Backend::Remote { max_request, .. } => *max_request,
        }
    }

    /// Samples one assistant message. Blocking: call it from a blocking thread.
    ///
    /// A prompt longer than the model's context allows with `max_new_tokens` keeps its
    /// last tokens, and `max_new_tokens` is capped below the context, as
    /// [`Policy::generate`] does.
    pub fn generate_blocking(&self, prompt: Vec<u32>, params: GenParams) -> Result<Generation> {
        self.generate_as(prompt, params, self.loaded_version(), None)
    }

    /// [`StudentHost::generate_blocking`] for an episode of policy version `version`: on
    /// an external engine, a turn generated by any other version is an error (the local
    /// engine's swaps are the worker's own, between leases), and a turn the engine has not
    /// answered when `cancel` is set (the worker stopping) is abandoned with an error.
    pub fn generate_as(
        &self,
        prompt: Vec<u32>,
        params: GenParams,
        version: u64,
        cancel: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<Generation> {
        let mut params = params;
        // The same rule as `Policy::generate`: keep the prompt's last tokens.
        let (start, max_new) = tutor_policy::fit_context(
            prompt.len(),
            params.max_new_tokens.max(1),
            self.max_request_tokens(),
        );
        params.max_new_tokens = max_new;
        let prompt = if start > 0 {
            prompt[start..].to_vec()
        } else {
            prompt
        };
        let engine = match &self.engine {
            Backend::Local(engine) => engine,
            Backend::Remote { engine, rt, .. } => {
                let (loaded, label) = self.current.lock().expect("current version").clone();
                if version != loaded || loaded == NO_VERSION {
                    anyhow::bail!(
                        "the student cannot run this turn: the episode runs on policy version \
                         {version}, but the student engine at {} now serves version {}",
                        engine.url(),
                        if loaded == NO_VERSION {
                            "none".to_string()
                        } else {
                            loaded.to_string()
                        }
                    );
                }
                let turn = async {
                    match cancel {
                        Some(flag) => engine.generate_unless(&prompt, &params, &label, flag).await,
                        None => engine.generate(&prompt, &params, &label).await,
                    }
                };
                return rt.block_on(turn).map_err(|e| {
                    if let EngineError::WrongVersion { .. } = e {
                        // Restarted, or reloaded by another client: the next lease
                        // checks and loads again.
                        self.forget_current(version);
                    }
                    anyhow!("the student cannot run this turn: {e}")
                });
            }
        };
        let done = engine
            .generate_blocking(|events| EngineRequest {
                prompt,
                params,
                stop: Vec::new(),
                top_logprobs: 0,
                prompt_logprobs: false,
                text: false,
                events,
            })
            .map_err(|e| anyhow!("the student cannot run this turn: {e}"))?;
        Ok(Generation {
            tokens: done.tokens.iter().map(|t| t.id).collect(),
            logprobs: done.tokens.iter().map(|t| t.logprob).collect(),
            finish: done.done.finish,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With episodes of several versions in flight on one worker, the in-process engine's
    /// weights never change under a running episode: a new version waits for the
    /// episodes holding the student, and loads once they end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_version_waits_for_the_running_episodes_of_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer =
            ChatTokenizer::train(&["fix the bug in the code".to_string()], 300).unwrap();
        let config = ModelConfig::tiny(tokenizer.vocab_size());
        config.save(&dir.path().join("config.json")).unwrap();
        let host = StudentHost::start(
            dir.path(),
            dir.path(),
            tokenizer,
            EngineConfig::default(),
            ClientAuth::default(),
        )
        .unwrap();
        let version = |v: u64| {
            let path = dir.path().join(format!("v{v}.safetensors"));
            Policy::new(config.clone(), tch::Device::Cpu, v as i64)
                .save_weights(&path)
                .unwrap();
            path
        };
        host.load_file(&version(1), 1, "").await.unwrap();
        assert_eq!(host.loaded_version(), 1);

        // An episode of version 1 runs; another asks for version 2.
        let running = host.hold().await;
        let loading = {
            let (host, path) = (host.clone(), version(2));
            tokio::spawn(async move { host.load_file(&path, 2, "").await })
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !loading.is_finished(),
            "version 2 loaded under a running episode"
        );
        assert_eq!(host.loaded_version(), 1);
        // An episode that starts meanwhile waits too, and then runs on version 2.
        let next = {
            let host = host.clone();
            tokio::spawn(async move {
                let _held = host.hold().await;
                host.loaded_version()
            })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!next.is_finished());
        drop(running);
        loading.await.unwrap().unwrap();
        assert_eq!(host.loaded_version(), 2);
        assert_eq!(next.await.unwrap(), 2);
    }

    /// A version is taken only with the checksum the lease names; anything else waits
    /// out `broadcast_wait` (and the worker downloads over gRPC). Only the two newest
    /// files are kept.
    #[tokio::test]
    async fn the_inbox_hands_out_versions_with_the_leased_checksum_only() {
        let file = |v: u64| Arc::new(format!("weights {v}").into_bytes());
        let inbox = BroadcastInbox::new(Duration::from_millis(200));
        // Out of a group nothing is coming: no wait at all.
        let t = std::time::Instant::now();
        assert_eq!(inbox.take(1, "aa").await, None);
        assert!(
            t.elapsed() < Duration::from_millis(150),
            "{:?}",
            t.elapsed()
        );
        inbox.set_in_group(true);
        // Arrives while `take` waits.
        let late = inbox.clone();
        let p1 = file(1);
        let sender = {
            let p1 = p1.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                late.arrived(1, "aa".into(), p1);
            })
        };
        assert_eq!(inbox.take(1, "aa").await, Some(p1));
        sender.await.unwrap();
        // Wrong checksum, or a version that never comes: nothing after the wait.
        inbox.arrived(2, "bb".into(), file(2));
        let t = std::time::Instant::now();
        assert_eq!(inbox.take(2, "cc").await, None);
        assert!(t.elapsed() >= Duration::from_millis(200));
        assert_eq!(inbox.take(9, "dd").await, None);
        // Only the newest version is kept in memory as newer ones arrive.
        inbox.arrived(3, "x".into(), file(3));
        inbox.arrived(4, "y".into(), file(4));
        inbox.arrived(5, "z".into(), file(5));
        let kept: Vec<u64> = inbox.arrived.borrow().keys().copied().collect();
        assert_eq!(kept, vec![5]);
    }
}
