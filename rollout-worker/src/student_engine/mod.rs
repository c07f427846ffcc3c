//! The student on an external inference engine (`[worker.student] kind = "engine"`):
//! SGLang's native HTTP API (`api = "sglang"`, below) or vLLM's (`api = "vllm"`, in
//! `vllm.rs`), both of which `tutor serve` also serves.
//!
//! - Rollouts stay token-in/token-out: `POST /generate` with the prompt's token ids; the
//!   sampled ids and the log-probability of each come back (`output_ids`,
//!   `meta_info.output_token_logprobs`). Nothing is re-tokenized. Sampling is unbiased
//!   unless the lease says otherwise: no top-k, no min-p, top-p as given (1 at train time).
//! - Every answer names the weight version that produced it (`meta_info.weight_version`);
//!   an answer from any other version than the episode's is an error, never a turn, so no
//!   episode is trained on with another version's log-probabilities.
//! - A new policy version reaches the engine one of two ways (`reload`), and the engine's
//!   `/model_info` must then report it:
//!   - `disk` (default): staged as a Hugging Face directory the engine can read
//!     (`weights_dir`), loaded with `POST /update_weights_from_disk` under its version;
//!   - `distributed`: sent as tensors over Tutor's CPU collective, the worker as rank 0 and
//!     the engine as rank 1 of a group formed for the reload (`POST
//!     /init_weights_update_group`, `/update_weights_from_distributed`,
//!     `/destroy_weights_update_group`: SGLang's routes, backend "tutor-cpu", which `tutor
//!     serve --distributed-updates` serves). No directory is shared with the engine.
//!
//! Answers are checked before use: ids inside the vocabulary, one finite log-probability
//! per sampled id, no more tokens than asked for. Errors name the engine and the version.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tutor_policy::{FinishReason, GenParams, Generation};

use tutor_collective::{engine_update, CollectiveSecret, CpuCollectiveTimeouts, CpuRendezvous};

use crate::teacher::endpoint::excerpt;

pub mod push;
mod vllm;

/// `[worker.student]`: where the student generates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StudentConfig {
    /// `local`: Tutor's in-process engine (the `student_*` settings of `[worker]`), or
    /// `engine`: an external engine at `base_url` speaking `api`.
    pub kind: StudentKind,
    /// The engine's API: `sglang` (SGLang's native routes: SGLang itself or `tutor
    /// serve`) or `vllm` (vLLM's OpenAI-compatible server with its weight-transfer control
    /// plane, `VLLM_SERVER_DEV_MODE=1`: vLLM itself or `tutor serve`).
    pub api: EngineApi,
    /// The engine's address, without a path: e.g. `http://127.0.0.1:30000`.
    pub base_url: String,
    /// Environment variable holding the engine's API key (sent as a bearer token).
    pub api_key_env: String,
    /// File holding the API key (used when the variable is unset or empty).
    pub api_key_file: Option<PathBuf>,
    /// Deadline of one turn's generation, retries included, seconds.
    pub timeout_s: f64,
    /// Deadline of one weight reload, seconds.
    pub reload_timeout_s: f64,
    /// Retries of a generation after connection errors, timeouts and 5xx answers, while
    /// the turn's `timeout_s` lasts.
    pub max_retries: u32,
    /// How long the engine may be unreachable (at start, or between episodes) before the
    /// worker stops with an error. While it is down the worker leases nothing.
    pub down_s: f64,
    /// Where policy versions are staged for the engine to load, as Hugging Face
    /// directories (`policy-vNNNNNN/`); the two newest are kept. Default: the worker's
    /// cache directory. It must be readable by the engine.
    pub weights_dir: Option<PathBuf>,
    /// The same directory as the engine sees it, when it mounts it elsewhere (a shared
    /// volume in another container). Default: `weights_dir`.
    pub engine_weights_dir: Option<PathBuf>,
    /// How a new policy version reaches the engine: `disk` (staged in `weights_dir`, then
    /// `/update_weights_from_disk`; SGLang or tutor serve --weights-root) or `distributed`
    /// (tensors over Tutor's CPU collective; tutor serve --distributed-updates).
    pub reload: ReloadKind,
    /// `reload = "distributed"`: where this worker listens for the engine to join its
    /// weight-update group, host:port (port 0: any free port).
    pub group_listen: String,
    /// `reload = "distributed"`: the host the engine dials to reach `group_listen` (this
    /// worker's address as the engine sees it, e.g. its pod's IP). Default:
    /// `group_listen`'s host, which must then not be 0.0.0.0.
    pub group_address: Option<String>,
    /// Who loads each policy version into the engine: `worker` (each worker, when it
    /// leases an episode of a version the engine does not serve) or `learner` (the
    /// learner, as soon as it publishes the version, into every engine of `[learner]
    /// engines`: the weights go once per engine, straight from the learner; workers only
    /// wait, up to `reload_timeout_s`, for their engine to serve the leased version).
    pub loaded_by: LoadedBy,
}

/// `[worker.student] loaded_by`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LoadedBy {
    #[default]
    Worker,
    Learner,
}

/// `[worker.student] api`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum EngineApi {
    #[default]
    Sglang,
    Vllm,
}

/// `[worker.student] reload`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ReloadKind {
    #[default]
    Disk,
    Distributed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum StudentKind {
    #[default]
    Local,
    Engine,
}

impl Default for StudentConfig {
    fn default() -> Self {
        Self {
            kind: StudentKind::Local,
            api: EngineApi::Sglang,
            base_url: String::new(),
            api_key_env: "TUTOR_STUDENT_API_KEY".into(),
            api_key_file: None,
            timeout_s: 600.0,
            reload_timeout_s: 600.0,
            max_retries: 3,
            down_s: 300.0,
            weights_dir: None,
            engine_weights_dir: None,
            reload: ReloadKind::Disk,
            group_listen: "127.0.0.1:0".into(),
            group_address: None,
            loaded_by: LoadedBy::Worker,
        }
    }
}

/// The weight version string an engine serves Tutor's policy version `version` (of
/// checksum `sha256`) under: the checksum's head makes it name these weights, not just a
/// number another run sharing the engine may also have published.
pub fn version_label(version: u64, sha256: &str) -> String {
    let head: String = sha256.chars().take(12).collect();
    if head.is_empty() {
        format!("tutor-v{version}")
    } else {
        format!("tutor-v{version}-{head}")
    }
}

/// A weight-update group being formed (`RemoteEngine::update_group`).
struct UpdateGroup {
    /// Its name (the label and a random suffix).
    group: String,
    /// Where the engine dials: host and port.
    host: String,
    port: u16,
    /// This worker's end, once the engine joined.
    joined: tokio::task::JoinHandle<
        Result<tutor_collective::CpuCollective, tutor_collective::CollectiveError>,
    >,
    /// Set when the reload is over.
    abandon: Abandon,
}

impl UpdateGroup {
    /// What asks the engine to join: rank 1 of 2 at this worker's address, over Tutor's
    /// CPU collective.
    fn init_fields(&self) -> Value {
        json!({
            "master_address": self.host,
            "master_port": self.port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": self.group,
            "backend": engine_update::BACKEND,
        })
    }
}

/// Set on drop: a rendezvous waiting for the engine gives up (see
/// `RemoteEngine::load_distributed`).
struct Abandon(std::sync::Arc<AtomicBool>);

impl Abandon {
    fn set(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Drop for Abandon {
    fn drop(&mut self) {
        self.set();
    }
}

/// Why the engine could not give a turn or load a version. Every message names the
/// engine (its base URL).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Unreachable, timed out, or a 5xx answer, after the retries.
    #[error("the student engine at {url} is unreachable: {message}")]
    Down { url: String, message: String },
    /// The engine answered, but not with what was asked for.
    #[error("the student engine at {url}: {message}")]
    Refused { url: String, message: String },
    /// The turn was generated by another weight version than the episode's.
    #[error(
        "the student engine at {url} generated with weight version {served:?}, but this \
         episode runs on {expected:?}: another client reloaded it, or a reload did not take; \
         the turn is not used"
    )]
    WrongVersion {
        url: String,
        served: String,
        expected: String,
    },
    /// `loaded_by = "learner"`: the engine serves a newer policy version than the lease's,
    /// and the learner loads only the newest (an asynchronous run leases older versions
    /// while newer ones are published). Not the engine's fault: no reload failed.
    #[error(
        "the student engine at {url} serves {served:?}, a newer policy version than this \
         lease's version {leased}: the learner loads only the newest version, so the \
         episode runs on that one and is reported under it"
    )]
    Superseded {
        url: String,
        served: String,
        leased: u64,
    },
    /// The worker is stopping: the turn was abandoned while the engine had not answered.
    #[error("the turn on the student engine at {url} was abandoned: the worker is stopping")]
    Cancelled { url: String },
}

/// A client of one external engine; shared by the worker's episodes.
pub struct RemoteEngine {
    http: reqwest::Client,
    base: String,
    key: String,
    config: StudentConfig,
    /// Every sampled id must be below it (the worker's model's `vocab_size`).
    vocab: usize,
    /// False after a request could not reach the engine; the worker then probes it before
    /// leasing again.
    up: AtomicBool,
    /// The setting `config.group_listen` came from, as errors name it.
    group_listen_field: &'static str,
}

impl std::fmt::Debug for RemoteEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the API key.
        f.debug_struct("RemoteEngine")
            .field("base", &self.base)
            .field("vocab", &self.vocab)
            .finish_non_exhaustive()
    }
}

impl RemoteEngine {
    /// This client's `group_listen` came from `field` (e.g. `learner.engine_group_listen`
    /// for the learner's clients): errors binding it name that setting.
    pub fn with_group_listen_field(mut self, field: &'static str) -> Self {
        self.group_listen_field = field;
        self
    }

    /// Checks `[worker.student]` (errors name the field) and reads the API key.
    pub fn new(config: &StudentConfig, vocab: usize) -> anyhow::Result<Self> {
        let base = checked_base_url(&config.base_url, "worker.student.base_url")?;
        for (name, v) in [
            ("timeout_s", config.timeout_s),
            ("reload_timeout_s", config.reload_timeout_s),
            ("down_s", config.down_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                anyhow::bail!(
                    "worker.student.{name} must be a positive number of seconds, got {v}"
                );
            }
        }
        if config.reload == ReloadKind::Distributed {
            checked_group_listen(
                &config.group_listen,
                config.group_address.as_deref(),
                (
                    "worker.student.group_listen",
                    "worker.student.group_address",
                ),
            )?;
        }
        let mut key = std::env::var(&config.api_key_env).unwrap_or_default();
        if key.trim().is_empty() {
            if let Some(p) = &config.api_key_file {
                key = std::fs::read_to_string(p).map_err(|e| {
                    anyhow::anyhow!("worker.student.api_key_file = {}: {e}", p.display())
                })?;
            }
        }
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()?;
        Ok(Self {
            http,
            base: base.to_string(),
            key: key.trim().to_string(),
            config: config.clone(),
            vocab,
            up: AtomicBool::new(true),
            group_listen_field: "worker.student.group_listen",
        })
    }

    pub fn url(&self) -> &str {
        &self.base
    }

    /// `[worker.student]` as given.
    pub fn config(&self) -> &StudentConfig {
        &self.config
    }

    /// Whether the last request reached the engine.
    pub fn seems_up(&self) -> bool {
        self.up.load(Ordering::SeqCst)
    }

    fn down(&self, message: String) -> EngineError {
        self.up.store(false, Ordering::SeqCst);
        EngineError::Down {
            url: self.base.clone(),
            message,
        }
    }

    fn refused(&self, message: impl Into<String>) -> EngineError {
        EngineError::Refused {
            url: self.base.clone(),
            message: message.into(),
        }
    }

    /// One request: the answer's status and text, or `Down` when it never arrived.
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<(reqwest::StatusCode, String), EngineError> {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .timeout(timeout);
        if let Some(b) = body {
            req = req.json(b);
        }
        if !self.key.is_empty() {
            req = req.bearer_auth(&self.key);
        }
        let resp = req.send().await.map_err(|e| {
            self.down(if e.is_timeout() {
                format!("{path}: no answer within {} s", timeout.as_secs_f64())
            } else {
                format!("{path}: {e}")
            })
        })?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| self.down(format!("{path}: reading the answer: {e}")))?;
        self.up.store(true, Ordering::SeqCst);
        Ok((status, text))
    }

    /// The weight version the engine serves (`/model_info`, else SGLang's older
    /// `/get_model_info`; vLLM's `/weight_info`).
    pub async fn served_version(&self) -> Result<String, EngineError> {
        Ok(self.weight_info().await?.0)
    }

    /// Whether the engine serves weight version `label` already (another client sharing
    /// it loaded it). A reload of what it serves is skipped: besides the wasted transfer,
    /// vLLM's swap would refuse the turns other clients are running on that version (their
    /// swap count changes under them). An engine that cannot say is reloaded (the reload
    /// reports why it fails).
    pub(super) async fn serves(&self, label: &str, version: u64) -> bool {
        let serves = matches!(self.served_version().await, Ok(served) if served == label);
        if serves {
            tracing::debug!(
                engine = %self.base,
                version,
                "the student engine serves this version already (another client loaded it)"
            );
        }
        serves
    }

    /// The weight version the engine serves and, where it reports one (`tutor serve`'s
    /// `weight_generation`), how many swaps it made so far: from SGLang's `/model_info`
    /// (else its older `/get_model_info`) or vLLM's `/weight_info`.
    pub(super) async fn weight_info(&self) -> Result<(String, Option<u64>), EngineError> {
        let t = Duration::from_secs(10);
        let mut last = String::new();
        let paths: &[&str] = match self.config.api {
            EngineApi::Sglang => &["/model_info", "/get_model_info"],
            EngineApi::Vllm => &["/weight_info"],
        };
        for &path in paths {
            let (status, text) = self.send(reqwest::Method::GET, path, None, t).await?;
            if status.as_u16() == 404 {
                last = format!("{path}: HTTP 404");
                continue;
            }
            if !status.is_success() {
                if status.is_server_error() {
                    return Err(self.down(format!("{path}: HTTP {status}: {}", excerpt(&text))));
                }
                return Err(self.refused(format!("{path}: HTTP {status}: {}", excerpt(&text))));
            }
            let v: Value = serde_json::from_str(&text).map_err(|e| {
                self.refused(format!("{path} is not JSON ({e}): {}", excerpt(&text)))
            })?;
            let version = v
                .get("weight_version")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    self.refused(format!(
                        "{path} names no weight_version, so the version it serves cannot be \
                         checked: {}",
                        excerpt(&text)
                    ))
                })?;
            return Ok((
                version.to_string(),
                v.get("weight_generation").and_then(Value::as_u64),
            ));
        }
        Err(self.refused(format!("it has no model info route ({last})")))
    }

    /// Loads the checkpoint directory `engine_path` (as the engine sees it), policy
    /// version `version`, under the weight version `label`, then checks that the engine
    /// reports it.
    pub async fn load_from_disk(
        &self,
        engine_path: &Path,
        version: u64,
        label: &str,
    ) -> Result<(), EngineError> {
        if self.config.api == EngineApi::Vllm {
            return self.vllm_load_from_disk(engine_path, version, label).await;
        }
        if self.serves(label, version).await {
            return Ok(());
        }
        let body = json!({
            "model_path": engine_path.display().to_string(),
            "weight_version": label,
            "flush_cache": true,
        });
        let t = Duration::from_secs_f64(self.config.reload_timeout_s);
        if let Err(m) = self
            .post_update("/update_weights_from_disk", &body, t)
            .await?
        {
            return Err(self.refused(format!(
                "refused to load policy version {version} from {} ({m})",
                engine_path.display()
            )));
        }
        self.check_served(version, label).await
    }

    /// `loaded_by = "learner"`: waits up to `reload_timeout_s` for the engine to serve
    /// weight version `label` (policy version `version`), which the learner loads into it.
    /// An engine that is down is an error at once (the worker leases nothing until it
    /// answers again).
    pub async fn await_version(&self, version: u64, label: &str) -> Result<(), EngineError> {
        let limit = Duration::from_secs_f64(self.config.reload_timeout_s);
        let start = Instant::now();
        let mut logged = false;
        loop {
            let served = self.served_version().await?;
            if served == label {
                return Ok(());
            }
            if label_version(&served).is_some_and(|v| v > version) {
                return Err(EngineError::Superseded {
                    url: self.base.clone(),
                    served,
                    leased: version,
                });
            }
            if start.elapsed() >= limit {
                return Err(self.refused(format!(
                    "did not serve policy version {version} ({label}) within {:.0} s \
                     (worker.student.reload_timeout_s); it serves {served:?}. With \
                     worker.student.loaded_by = \"learner\" the learner loads each version into \
                     it: is this engine among the learner's ([learner] engines), and does the \
                     learner's log say why it could not load it?",
                    start.elapsed().as_secs_f64()
                )));
            }
            if !logged {
                tracing::info!(
                    engine = %self.base,
                    version,
                    serving = %served,
                    "waiting for the learner to load the policy version into the student engine"
                );
                logged = true;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// After a reload: the engine must report weight version `label`.
    async fn check_served(&self, version: u64, label: &str) -> Result<(), EngineError> {
        let served = self.served_version().await?;
        if served != label {
            return Err(self.refused(format!(
                "loaded policy version {version} but reports weight version {served:?} instead \
                 of {label:?}: it does not take weight_version from its reload routes"
            )));
        }
        Ok(())
    }

    /// A weight-update route's answer: `Ok(Err(message))` when the engine answered that it
    /// did not succeed (SGLang's `success: false`, or an error status).
    async fn post_update(
        &self,
        path: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<Result<(), String>, EngineError> {
        let (status, text) = self
            .send(reqwest::Method::POST, path, Some(body), timeout)
            .await?;
        let answer: Option<Value> = serde_json::from_str(&text).ok();
        let success = answer
            .as_ref()
            .and_then(|v| v.get("success"))
            .and_then(Value::as_bool);
        if status.is_success() && success == Some(true) {
            return Ok(Ok(()));
        }
        let message = answer
            .as_ref()
            .and_then(|v| {
                v.get("message")
                    .or_else(|| v.pointer("/error/message"))
                    .and_then(Value::as_str)
            })
            .map(str::to_string)
            .unwrap_or_else(|| excerpt(&text));
        Ok(Err(format!("{path}: HTTP {status}: {message}")))
    }

    /// Sends the safetensors file `file`, policy version `version`, to the engine as
    /// tensors over Tutor's CPU collective and has it served under `label`; then checks
    /// that the engine reports it. A group is formed for this reload (this worker rank 0,
    /// listening at `group_listen`; its hello keyed by the engine's API key when there is
    /// one) and destroyed after it.
    pub async fn load_distributed(
        &self,
        file: std::sync::Arc<Vec<u8>>,
        version: u64,
        label: &str,
    ) -> Result<(), EngineError> {
        let metas = engine_update::tensors_of(&file)
            .map_err(|e| self.refused(format!("policy version {version} cannot be sent: {e}")))?;
        let t = Duration::from_secs_f64(self.config.reload_timeout_s);
        if self.config.api == EngineApi::Vllm {
            return self
                .vllm_load_distributed(file, metas, version, label)
                .await;
        }
        if self.serves(label, version).await {
            return Ok(());
        }
        let update_group = self.update_group(version, label)?;
        let init = update_group.init_fields();
        let UpdateGroup {
            group,
            host,
            port,
            joined,
            abandon,
        } = update_group;
        // From here on the engine may hold the group (even if its answer is lost): it is
        // destroyed whatever happens next.
        let result = async {
            let answer = self
                .post_update("/init_weights_update_group", &init, t)
                .await;
            if !matches!(answer, Ok(Ok(()))) {
                abandon.set();
            }
            if let Err(m) = answer? {
                return Err(self.refused(format!(
                    "refused to form a weight-update group with this worker at {host}:{port} for \
                     policy version {version}: {m}"
                )));
            }
            let mut collective = self.joined(joined, &group, version).await?;
            let body = json!({
                "names": metas.iter().map(|m| &m.name).collect::<Vec<_>>(),
                "dtypes": metas.iter().map(|m| &m.dtype).collect::<Vec<_>>(),
                "shapes": metas.iter().map(|m| &m.shape).collect::<Vec<_>>(),
                "group_name": group,
                "weight_version": label,
                "flush_cache": true,
            });
            let started = Instant::now();
            let sending = {
                let file = file.clone();
                tokio::task::spawn_blocking(move || engine_update::send(&mut collective, &file))
            };
            let answer = self
                .post_update("/update_weights_from_distributed", &body, t)
                .await;
            // The group is destroyed before the sender is waited for: an engine that
            // never started receiving (the request refused, or lost) closes its end, and
            // the sender stops instead of waiting out the io timeout.
            self.destroy_group(&group).await;
            let sent = sending.await;
            if let Err(m) = answer? {
                return Err(self.refused(format!(
                    "refused policy version {version} sent over weight-update group \
                     {group:?}: {m}"
                )));
            }
            match sent {
                Ok(Ok(bytes)) => tracing::debug!(
                    version,
                    bytes,
                    seconds = started.elapsed().as_secs_f64(),
                    "sent the version to the student engine over the collective"
                ),
                Ok(Err(e)) => {
                    return Err(self.refused(format!(
                        "took policy version {version} though sending it failed: {e}"
                    )))
                }
                Err(e) => {
                    return Err(self.refused(format!("sending policy version {version}: {e}")))
                }
            }
            Ok(())
        }
        .await;
        abandon.set();
        if result.is_err() {
            self.destroy_group(&group).await;
        }
        result?;
        self.check_served(version, label).await
    }

    /// A weight-update group for policy version `version` (served as `label`), this
    /// worker its rank 0: listening at `group_listen`, its hello keyed by the engine's
    /// API key when there is one, waiting (in a blocking task) for the engine to join.
    fn update_group(&self, version: u64, label: &str) -> Result<UpdateGroup, EngineError> {
        let t = Duration::from_secs_f64(self.config.reload_timeout_s);
        let group = format!("{label}-{:016x}", rand::random::<u64>());
        let secret = (!self.key.is_empty()).then(|| {
            CollectiveSecret::from_token(
                self.key.as_bytes(),
                &format!("{}{group}", engine_update::SECRET_CONTEXT),
            )
        });
        let rdv = CpuRendezvous::bind(self.config.group_listen.as_str())
            .map_err(|e| {
                self.refused(format!(
                    "policy version {version}: {} = {:?}: {e}",
                    self.group_listen_field, self.config.group_listen
                ))
            })?
            .with_secret(secret);
        let at = rdv.local_addr();
        let host = self
            .config
            .group_address
            .clone()
            .unwrap_or_else(|| at.ip().to_string());
        let timeouts = CpuCollectiveTimeouts {
            connect: t.min(Duration::from_secs(60)),
            io: t,
        };
        // Set when this reload is over, however it ends (an error, or the caller giving
        // up on it): the rendezvous thread stops waiting for the engine at once instead of
        // after the connect timeout, and does not hold up a worker that stops.
        let abandon = Abandon(std::sync::Arc::new(AtomicBool::new(false)));
        let rdv = rdv.abandoned_by(abandon.0.clone());
        let joined = tokio::task::spawn_blocking(move || rdv.accept(2, timeouts));
        Ok(UpdateGroup {
            group,
            host,
            port: at.port(),
            joined,
            abandon,
        })
    }

    /// This worker's end of group `group` once the engine joined it (after the engine
    /// answered its init).
    async fn joined(
        &self,
        joined: tokio::task::JoinHandle<
            Result<tutor_collective::CpuCollective, tutor_collective::CollectiveError>,
        >,
        group: &str,
        version: u64,
    ) -> Result<tutor_collective::CpuCollective, EngineError> {
        match joined.await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(self.refused(format!(
                "said it joined weight-update group {group:?} for policy version {version} but \
                 never did: {e}"
            ))),
            Err(e) => Err(self.refused(format!(
                "forming the weight-update group for policy version {version}: {e}"
            ))),
        }
    }

    /// Best effort: asks the engine to close weight-update group `group` (an engine that
    /// has none of that name, or is down, changes nothing).
    async fn destroy_group(&self, group: &str) {
        let body = json!({"group_name": group});
        if let Ok(Err(m)) = self
            .post_update(
                "/destroy_weights_update_group",
                &body,
                Duration::from_secs(10),
            )
            .await
        {
            tracing::debug!(group, message = %m, "destroying a weight-update group");
        }
    }

    /// Samples one assistant message after `prompt` under `params`, from the engine's
    /// weights of weight version `label` (checked on the answer). Connection errors,
    /// timeouts and 5xx answers are retried `max_retries` times with backoff, within one
    /// deadline of `timeout_s` for the whole turn: a wedged engine holds a turn that long,
    /// not once per retry.
    pub async fn generate(
        &self,
        prompt: &[u32],
        params: &GenParams,
        label: &str,
    ) -> Result<Generation, EngineError> {
        if self.config.api == EngineApi::Vllm {
            return self.vllm_generate(prompt, params, label).await;
        }
        let body = json!({
            "input_ids": prompt,
            "sampling_params": {
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": -1,
                "min_p": 0.0,
                "max_new_tokens": params.max_new_tokens,
                "stop_token_ids": params.stop_token_ids,
                "skip_special_tokens": false,
                "no_stop_trim": true,
                // Neutral, whatever the server's preferred sampling parameters say: the
                // log-probs must be those of the distribution sampled from.
                "repetition_penalty": 1.0,
                "frequency_penalty": 0.0,
                "presence_penalty": 0.0,
                "min_new_tokens": 0,
                // The episode's seed: a turn the engine repeats samples the same tokens
                // (SGLang's `sampling_seed`; tutor serve honours it).
                // 63 bits: SGLang takes it as a signed 64-bit integer.
                "sampling_seed": params.seed & (i64::MAX as u64),
            },
            "return_logprob": true,
            "stream": false,
        });
        let text = self.post_turn("/generate", &body).await?;
        self.parse_generation(&text, params.max_new_tokens, label)
    }

    /// One turn's request to `path`: connection errors, timeouts, 429 and 5xx answers
    /// retried `max_retries` times with backoff, within one deadline of `timeout_s` for
    /// the whole turn. The text of a successful answer; any other answer is refused.
    async fn post_turn(&self, path: &str, body: &Value) -> Result<String, EngineError> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(self.config.timeout_s);
        let mut attempt = 0;
        let (status, text) = loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let err = match self
                .send(reqwest::Method::POST, path, Some(body), left)
                .await
            {
                Ok((status, _)) if status.is_server_error() || status.as_u16() == 429 => {
                    self.down(format!("{path}: HTTP {status}"))
                }
                Ok(answer) => break answer,
                Err(e) => e,
            };
            let pause = Duration::from_millis(500u64 << attempt.min(4));
            if attempt >= self.config.max_retries || tokio::time::Instant::now() + pause >= deadline
            {
                return Err(err);
            }
            tracing::warn!(engine = %self.base, attempt, error = %err, "student generation failed; retrying");
            tokio::time::sleep(pause).await;
            attempt += 1;
        };
        if !status.is_success() {
            return Err(self.refused(format!("{path} answered HTTP {status}: {}", excerpt(&text))));
        }
        Ok(text)
    }

    /// [`RemoteEngine::generate`], abandoned (`Cancelled`) as soon as `cancel` is set:
    /// a stopping worker does not wait out a turn its engine does not answer.
    pub async fn generate_unless(
        &self,
        prompt: &[u32],
        params: &GenParams,
        label: &str,
        cancel: &AtomicBool,
    ) -> Result<Generation, EngineError> {
        let set = async {
            while !cancel.load(std::sync::atomic::Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        tokio::select! {
            turn = self.generate(prompt, params, label) => turn,
            () = set => Err(EngineError::Cancelled { url: self.base.clone() }),
        }
    }

    /// Reads and checks a `/generate` answer.
    fn parse_generation(
        &self,
        text: &str,
        max_new: usize,
        label: &str,
    ) -> Result<Generation, EngineError> {
        #[derive(Deserialize)]
        struct Answer {
            output_ids: Option<Vec<i64>>,
            meta_info: Option<Meta>,
        }
        #[derive(Deserialize)]
        struct Meta {
            output_token_logprobs: Option<Vec<(Option<f64>, i64, Value)>>,
            finish_reason: Option<Value>,
            weight_version: Option<String>,
        }
        let bad = |m: String| self.refused(format!("/generate answered {m}"));
        let a: Answer = serde_json::from_str(text)
            .map_err(|e| bad(format!("an unreadable answer ({e}): {}", excerpt(text))))?;
        let meta = a.meta_info.ok_or_else(|| bad("no meta_info".into()))?;
        let served = meta.weight_version.ok_or_else(|| {
            bad(
                "no meta_info.weight_version: the version that generated it cannot be checked"
                    .into(),
            )
        })?;
        if served != label {
            return Err(EngineError::WrongVersion {
                url: self.base.clone(),
                served,
                expected: label.to_string(),
            });
        }
        let ids = a.output_ids.ok_or_else(|| bad("no output_ids".into()))?;
        let lps: Vec<(Option<f64>, Option<i64>)> = meta
            .output_token_logprobs
            .ok_or_else(|| bad("no meta_info.output_token_logprobs".into()))?
            .into_iter()
            .map(|(lp, id, _)| (lp, Some(id)))
            .collect();
        let (tokens, logprobs) = self.checked_tokens("/generate", &ids, &lps, max_new)?;
        let finish = meta.finish_reason.unwrap_or(Value::Null);
        let finish = match finish.get("type").and_then(Value::as_str) {
            Some("stop") => FinishReason::Stop,
            Some("length") => FinishReason::Length,
            _ => {
                return Err(bad(format!(
                    "finish_reason {finish}: the generation did not finish"
                )))
            }
        };
        Ok(Generation {
            tokens,
            logprobs,
            finish,
        })
    }

    /// The sampled ids of an answer from `path` and their log-probabilities (each with the
    /// id it is for, where the answer says), checked: one finite log-probability per id,
    /// for that id; ids inside the vocabulary; at most `max_new` of them.
    fn checked_tokens(
        &self,
        path: &str,
        ids: &[i64],
        lps: &[(Option<f64>, Option<i64>)],
        max_new: usize,
    ) -> Result<(Vec<u32>, Vec<f32>), EngineError> {
        let bad = |m: String| self.refused(format!("{path} answered {m}"));
        if lps.len() != ids.len() {
            return Err(bad(format!(
                "{} log-probabilities for {} sampled tokens",
                lps.len(),
                ids.len()
            )));
        }
        if ids.len() > max_new {
            return Err(bad(format!(
                "{} tokens where at most {max_new} were asked for",
                ids.len()
            )));
        }
        let mut tokens = Vec::with_capacity(ids.len());
        let mut logprobs = Vec::with_capacity(ids.len());
        for (i, (&id, (lp, lp_id))) in ids.iter().zip(lps).enumerate() {
            if id < 0 || id as usize >= self.vocab {
                return Err(bad(format!(
                    "token id {id} at position {i}, outside the vocabulary of {} tokens",
                    self.vocab
                )));
            }
            if let Some(lp_id) = lp_id.filter(|&l| l != id) {
                return Err(bad(format!(
                    "the log-probability at position {i} for token {lp_id}, but token {id} was sampled"
                )));
            }
            match lp {
                Some(lp) if lp.is_finite() && *lp <= 1e-3 => logprobs.push(*lp as f32),
                other => {
                    return Err(bad(format!(
                        "log-probability {other:?} at position {i}: not a finite log-probability"
                    )))
                }
            }
            tokens.push(id as u32);
        }
        Ok((tokens, logprobs))
    }

    /// Waits until the engine answers, up to `down_s`; the error names the engine.
    pub async fn wait_up(&self) -> anyhow::Result<()> {
        let start = Instant::now();
        let limit = Duration::from_secs_f64(self.config.down_s);
        let mut said = Instant::now();
        loop {
            match self.served_version().await {
                Ok(_) => return Ok(()),
                Err(e @ EngineError::Down { .. }) => {
                    if start.elapsed() >= limit {
                        anyhow::bail!(
                            "{e}, for {:.0} s (worker.student.down_s): stopping",
                            start.elapsed().as_secs_f64()
                        );
                    }
                    if said.elapsed() >= Duration::from_secs(10)
                        || start.elapsed() < Duration::from_millis(10)
                    {
                        tracing::warn!(engine = %self.base, error = %e, "the student engine is down: leasing nothing until it answers");
                        said = Instant::now();
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                // It answers, if not as hoped: up.
                Err(_) => return Ok(()),
            }
        }
    }
}

/// An engine's base url (the setting `field`) without trailing slashes, checked: not
/// empty, http(s), the server's root rather than its OpenAI /v1 path. Errors name `field`.
pub fn checked_base_url<'a>(url: &'a str, field: &str) -> anyhow::Result<&'a str> {
    let base = url.trim().trim_end_matches('/');
    if base.is_empty() {
        anyhow::bail!(
            "{field} is empty: with kind = \"engine\" name the engine, e.g. \
             http://127.0.0.1:30000 (SGLang's native API, or tutor serve)"
        );
    }
    if !(base.starts_with("http://") || base.starts_with("https://")) {
        anyhow::bail!("{field} = {base:?}: must start with http:// or https://");
    }
    if base.ends_with("/v1") {
        anyhow::bail!(
            "{field} = {base:?}: give the server's root, not its OpenAI /v1 path (the \
             student adds the routes it uses)"
        );
    }
    Ok(base)
}

/// Where rank 0 of weight-update groups listens (`listen`, an ip:port) and the host
/// engines dial to reach it (`address`; default the listen ip, which must then not be
/// 0.0.0.0), checked; `fields` name the two settings in errors. Returns the listen address.
pub fn checked_group_listen(
    listen: &str,
    address: Option<&str>,
    (listen_field, address_field): (&str, &str),
) -> anyhow::Result<std::net::SocketAddr> {
    let at: std::net::SocketAddr = listen
        .parse()
        .map_err(|e| anyhow::anyhow!("{listen_field} = {listen:?}: not an ip:port ({e})"))?;
    match address {
        Some(a) if a.trim().is_empty() => anyhow::bail!(
            "{address_field} is empty: name the host the engine dials, or leave it out"
        ),
        None if at.ip().is_unspecified() => anyhow::bail!(
            "{listen_field} = {listen:?} listens on every address: set {address_field} to the \
             one the engine dials"
        ),
        _ => Ok(at),
    }
}

/// The policy version a weight version label names (`tutor-vN-…` or `tutor-vN`, see
/// [`version_label`]); `None` for any other label (an engine's own weights).
pub fn label_version(label: &str) -> Option<u64> {
    let rest = label.strip_prefix("tutor-v")?;
    let digits = rest.split_once('-').map_or(rest, |(n, _)| n);
    digits.parse().ok()
}

/// Adds `dir`, a directory this process staged, to `staged` (oldest first) and removes
/// the oldest beyond the two newest (the engines have copied them in; the newer may still
/// be loading). Only the caller's own directories are ever removed.
pub fn keep_newest_staged(staged: &mut std::collections::VecDeque<PathBuf>, dir: PathBuf) {
    staged.retain(|d| d != &dir);
    staged.push_back(dir);
    while staged.len() > 2 {
        if let Some(old) = staged.pop_front() {
            let _ = std::fs::remove_dir_all(old);
        }
    }
}

/// Stages `weights` (a safetensors file) as a Hugging Face directory named `label` under
/// `dir` — config, tokenizer and chat files copied from `model_dir`, the file moved in as
/// `model.safetensors` — and returns its name, and whether this call made it. It is built
/// under a name of its own and renamed into place, so workers sharing `dir` never see each
/// other's halves. With `content_addressed` (a label with a checksum, `tutor-vN-<sha>`)
/// the name names the content: a directory of that name already there is kept as it is
/// (and not made here). Nothing else in `dir` is touched.
pub fn stage_version(
    dir: &Path,
    model_dir: &Path,
    weights: &Path,
    label: &str,
    content_addressed: bool,
) -> anyhow::Result<(String, bool)> {
    use anyhow::Context;
    if label.is_empty()
        || !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        anyhow::bail!("cannot stage weight version {label:?}: not a plain directory name");
    }
    let target = dir.join(label);
    if content_addressed && target.join("model.safetensors").exists() {
        let _ = std::fs::remove_file(weights);
        return Ok((label.to_string(), false));
    }
    let tmp = dir.join(format!(
        ".{label}.{}-{:016x}.staging",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    // Ok(false): another worker staged the same content-addressed version meanwhile.
    let staged = (|| -> anyhow::Result<bool> {
        for f in ["config.json", "tokenizer.json"]
            .into_iter()
            .chain(tutor_policy::HF_EXTRAS)
        {
            let src = model_dir.join(f);
            if src.exists() {
                std::fs::copy(&src, tmp.join(f))
                    .with_context(|| format!("copying {} into {}", src.display(), tmp.display()))?;
            }
        }
        let dst = tmp.join("model.safetensors");
        if std::fs::rename(weights, &dst).is_err() {
            std::fs::copy(weights, &dst)
                .with_context(|| format!("copying {} to {}", weights.display(), dst.display()))?;
            let _ = std::fs::remove_file(weights);
        }
        // A content-addressed directory that appeared meanwhile holds the same weights
        // and may be loading into the engine this moment: it is used, never replaced.
        if content_addressed && target.join("model.safetensors").exists() {
            return Ok(false);
        }
        if target.exists() {
            let _ = std::fs::remove_dir_all(&target);
        }
        match std::fs::rename(&tmp, &target) {
            Ok(()) => Ok(true),
            Err(_) if content_addressed && target.join("model.safetensors").exists() => Ok(false),
            Err(e) => Err(e)
                .with_context(|| format!("renaming {} to {}", tmp.display(), target.display())),
        }
    })();
    if !matches!(staged, Ok(true)) {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok((label.to_string(), staged?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn engine() -> RemoteEngine {
        let config = StudentConfig {
            kind: StudentKind::Engine,
            base_url: "http://127.0.0.1:9".into(),
            ..Default::default()
        };
        RemoteEngine::new(&config, 100).unwrap()
    }

    fn answer(ids: &[i64], lps: Value, version: &str) -> String {
        json!({
            "text": "",
            "output_ids": ids,
            "meta_info": {
                "finish_reason": {"type": "stop", "matched": 7},
                "output_token_logprobs": lps,
                "weight_version": version,
            }
        })
        .to_string()
    }

    /// A weight-update group that cannot listen names the setting its address came from:
    /// the worker's `[worker.student] group_listen`, or the learner's
    /// `[learner] engine_group_listen` for the learner's clients.
    #[tokio::test]
    async fn a_group_that_cannot_listen_names_the_setting_it_came_from() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let config = StudentConfig {
            kind: StudentKind::Engine,
            base_url: "http://127.0.0.1:9".into(),
            reload: ReloadKind::Distributed,
            group_listen: taken.local_addr().unwrap().to_string(),
            ..Default::default()
        };
        for (client, field) in [
            (
                RemoteEngine::new(&config, 100).unwrap(),
                "worker.student.group_listen",
            ),
            (
                RemoteEngine::new(&config, 100)
                    .unwrap()
                    .with_group_listen_field("learner.engine_group_listen"),
                "learner.engine_group_listen",
            ),
        ] {
            let err = match client.update_group(3, "tutor-v3-abc") {
                Err(e) => e.to_string(),
                Ok(_) => panic!("listened on a taken port"),
            };
            assert!(
                err.contains(&format!("{field} = {:?}", config.group_listen))
                    && err.contains("policy version 3"),
                "{err}"
            );
        }
    }

    /// A wedged engine (it accepts the connection, reads the request and never answers)
    /// holds a turn for `timeout_s` in all, retries included, not once per retry; and a
    /// worker that is stopping abandons the turn at once. Before, the same engine held a
    /// turn for `timeout_s × (max_retries + 1)` whatever the worker did.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wedged_engine_holds_a_turn_for_timeout_s_at_most_and_a_stop_abandons_it() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                held.push(socket); // read nothing, answer nothing, never close
            }
        });
        let config = StudentConfig {
            kind: StudentKind::Engine,
            base_url: format!("http://{addr}"),
            timeout_s: 1.5,
            max_retries: 5,
            ..Default::default()
        };
        let e = RemoteEngine::new(&config, 100).unwrap();
        let params = GenParams {
            max_new_tokens: 4,
            ..Default::default()
        };
        let started = std::time::Instant::now();
        let err = e.generate(&[1, 2, 3], &params, "v1").await.unwrap_err();
        let took = started.elapsed();
        assert!(matches!(err, EngineError::Down { .. }), "{err}");
        // 1.5 s in all (one attempt used it up), not 6 × 1.5 s.
        assert!(
            took >= Duration::from_millis(1400) && took < Duration::from_secs(4),
            "{took:?}"
        );
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "no retry after the deadline"
        );

        let config = StudentConfig {
            timeout_s: 600.0,
            ..config
        };
        let e = RemoteEngine::new(&config, 100).unwrap();
        let cancel = Arc::new(AtomicBool::new(false));
        let flag = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            flag.store(true, Ordering::SeqCst);
        });
        let started = std::time::Instant::now();
        let err = e
            .generate_unless(&[1, 2, 3], &params, "v1", &cancel)
            .await
            .unwrap_err();
        assert!(matches!(err, EngineError::Cancelled { .. }), "{err}");
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
        assert!(started.elapsed() < Duration::from_secs(3));
    }

    /// What the worker takes from an answer, and every answer it must refuse.
    #[test]
    fn answers_are_checked_before_they_become_turns() {
        let e = engine();
        let ok = answer(
            &[5, 7],
            json!([[-0.5, 5, null], [-0.25, 7, null]]),
            "tutor-v3",
        );
        let g = e.parse_generation(&ok, 8, "tutor-v3").unwrap();
        assert_eq!(g.tokens, vec![5, 7]);
        assert_eq!(g.logprobs, vec![-0.5, -0.25]);
        assert_eq!(g.finish, FinishReason::Stop);

        let refused = |text: String, want: &str| {
            let err = e
                .parse_generation(&text, 8, "tutor-v3")
                .unwrap_err()
                .to_string();
            assert!(err.contains(want) && err.contains("127.0.0.1:9"), "{err}");
        };
        // Another version's turn.
        refused(
            answer(&[5], json!([[-0.5, 5, null]]), "tutor-v2"),
            "runs on \"tutor-v3\"",
        );
        refused(
            answer(&[5], json!([[-0.5, 5, null]]), "default"),
            "\"default\"",
        );
        // Log-probs of the wrong length, for other tokens, or not log-probs at all.
        refused(
            answer(&[5, 7], json!([[-0.5, 5, null]]), "tutor-v3"),
            "1 log-probabilities for 2 sampled tokens",
        );
        refused(
            answer(&[5], json!([[-0.5, 6, null]]), "tutor-v3"),
            "for token 6, but token 5",
        );
        refused(answer(&[5], json!([[null, 5, null]]), "tutor-v3"), "None");
        refused(answer(&[5], json!([[0.7, 5, null]]), "tutor-v3"), "0.7");
        // Ids outside the vocabulary; more tokens than asked for.
        refused(
            answer(&[100], json!([[-0.5, 100, null]]), "tutor-v3"),
            "outside the vocabulary",
        );
        refused(
            answer(&[1; 9], json!(vec![json!([-0.1, 1, null]); 9]), "tutor-v3"),
            "at most 8",
        );
        // No version at all; not JSON; an aborted generation.
        refused(
            json!({"output_ids": [5], "meta_info": {"output_token_logprobs": [[-0.5, 5, null]]}})
                .to_string(),
            "weight_version",
        );
        refused("<html>".into(), "unreadable");
        let mut aborted: Value = serde_json::from_str(&ok).unwrap();
        aborted["meta_info"]["finish_reason"] = json!({"type": "abort", "message": "x"});
        refused(aborted.to_string(), "did not finish");
    }

    #[test]
    fn settings_are_checked_naming_the_field() {
        let err = |c: StudentConfig| RemoteEngine::new(&c, 10).unwrap_err().to_string();
        let base = StudentConfig {
            kind: StudentKind::Engine,
            base_url: "http://h:1".into(),
            ..Default::default()
        };
        assert!(err(StudentConfig {
            base_url: String::new(),
            ..base.clone()
        })
        .contains("worker.student.base_url is empty"));
        assert!(err(StudentConfig {
            base_url: "h:1".into(),
            ..base.clone()
        })
        .contains("http://"));
        assert!(err(StudentConfig {
            base_url: "http://h:1/v1".into(),
            ..base.clone()
        })
        .contains("/v1"));
        assert!(err(StudentConfig {
            timeout_s: 0.0,
            ..base
        })
        .contains("worker.student.timeout_s"));
    }

    #[test]
    fn workers_staging_one_version_at_once_never_remove_each_others_directory() {
        // Two workers sharing an engine stage the same version at the same moment. Before,
        // the second removed the first's directory while the engine loaded from it, the
        // first's reload failed, and its episode ran on no version (a flaky DAPO test).
        let model = tempfile::tempdir().unwrap();
        std::fs::write(model.path().join("config.json"), "{}").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let label = "tutor-v3-cccc";
        let target = dir.path().join(label).join("model.safetensors");
        let done = Arc::new(AtomicBool::new(false));
        let reader = {
            let (done, target) = (done.clone(), target.clone());
            std::thread::spawn(move || {
                let mut seen = false;
                let mut vanished = 0;
                while !done.load(Ordering::SeqCst) {
                    match std::fs::read_to_string(&target) {
                        Ok(text) => {
                            assert_eq!(text, "same weights");
                            seen = true;
                        }
                        Err(_) if seen => vanished += 1,
                        Err(_) => {}
                    }
                }
                vanished
            })
        };
        // All at once, so that several find nothing staged yet.
        let start = Arc::new(std::sync::Barrier::new(8));
        let created: Vec<bool> = (0..8)
            .map(|i| {
                let w = dir.path().join(format!("download-{i}"));
                std::fs::write(&w, "same weights").unwrap();
                let (d, m) = (dir.path().to_path_buf(), model.path().to_path_buf());
                let start = start.clone();
                std::thread::spawn(move || {
                    start.wait();
                    stage_version(&d, &m, &w, label, true).unwrap().1
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        done.store(true, Ordering::SeqCst);
        assert_eq!(reader.join().unwrap(), 0, "the staged weights vanished");
        assert_eq!(created.iter().filter(|&&c| c).count(), 1, "{created:?}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "same weights");
        let leftovers = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name() != label)
            .count();
        assert_eq!(leftovers, 0, "temporary directories and downloads are gone");
    }

    #[test]
    fn a_labels_policy_version_is_read_back() {
        assert_eq!(
            label_version(&version_label(12, "abcdef0123456789")),
            Some(12)
        );
        assert_eq!(label_version(&version_label(3, "")), Some(3));
        for other in ["default", "reload-4", "tutor-vx-12", "tutor-v"] {
            assert_eq!(label_version(other), None, "{other}");
        }
    }

    #[test]
    fn staging_makes_model_directories_named_by_their_version() {
        let model = tempfile::tempdir().unwrap();
        std::fs::write(model.path().join("config.json"), "{}").unwrap();
        std::fs::write(model.path().join("tokenizer.json"), "{}").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let weights = |v: &str| {
            let w = dir.path().join(format!("download-{v}"));
            std::fs::write(&w, format!("weights {v}")).unwrap();
            w
        };
        let w = weights("a");
        let (name, created) =
            stage_version(dir.path(), model.path(), &w, "tutor-v1-aaaa", true).unwrap();
        assert_eq!((name.as_str(), created), ("tutor-v1-aaaa", true));
        let staged = dir.path().join(&name);
        assert_eq!(
            std::fs::read_to_string(staged.join("model.safetensors")).unwrap(),
            "weights a"
        );
        assert!(staged.join("config.json").exists() && staged.join("tokenizer.json").exists());
        assert!(!w.exists(), "the download is moved, not kept twice");
        // The same checksum names the same content: kept, the new download dropped.
        let w = weights("b");
        let (_, created) =
            stage_version(dir.path(), model.path(), &w, "tutor-v1-aaaa", true).unwrap();
        assert!(
            !created,
            "another's directory of the same content is not this one's"
        );
        assert_eq!(
            std::fs::read_to_string(staged.join("model.safetensors")).unwrap(),
            "weights a"
        );
        assert!(!w.exists());
        // Without a checksum a version is staged again; other directories stay.
        std::fs::write(weights("c"), "x").unwrap();
        stage_version(dir.path(), model.path(), &weights("c"), "tutor-v2", false).unwrap();
        stage_version(dir.path(), model.path(), &weights("d"), "tutor-v2", false).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("tutor-v2/model.safetensors")).unwrap(),
            "weights d"
        );
        assert!(staged.exists());
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".staging"))
            .collect();
        assert!(leftovers.is_empty());
        // A label that is no plain name is refused.
        assert!(stage_version(dir.path(), model.path(), &weights("e"), "../x", false).is_err());
    }
}
