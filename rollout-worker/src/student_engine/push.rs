//! The learner loading each policy version into the external student engines itself
//! (`[learner] engines`, with `[worker.student] loaded_by = "learner"`), instead of every
//! worker doing it when it leases an episode of a new version.
//!
//! Through each worker, a version crosses the network twice (learner to worker, worker to
//! engine) and every worker sharing an engine gets it; straight from the learner it goes
//! once per engine, as soon as it is published, while the workers only wait for their
//! engine to serve the leased version ([`RemoteEngine::await_version`]). The engine
//! clients are the workers' ([`RemoteEngine`], set up by `[worker.student]`: api, reload,
//! api key, reload timeout), so the protocols and their checks are the same: the engine
//! must report the version's label afterwards, a refused load keeps the old weights.
//!
//! [`EnginePush::run`] loads the newest published version into every engine that does
//! not serve it, all engines at once. An engine that fails (down, refused) is tried again
//! after a backoff that doubles up to [`MAX_BACKOFF`]; the failure is logged with the
//! engine and the version. While nothing new is published, every engine is asked what it
//! serves every `check_every`, so one that restarted (serving its own weights again) gets
//! the newest version back without waiting for the next publish.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::sync::watch;
/// A published version as the learner registered it: what the loader loads.
pub use tutor_collective::broadcast::VersionFile;

use super::{keep_newest_staged, stage_version, version_label, ReloadKind, RemoteEngine};

/// How often the engines are asked what they serve by default.
pub const CHECK_EVERY: Duration = Duration::from_secs(5);
/// The longest wait before loading again into an engine that failed.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// The learner's loader of versions into the student engines.
pub struct EnginePush {
    engines: Vec<Arc<RemoteEngine>>,
    model_dir: PathBuf,
    weights_dir: PathBuf,
    engine_dir: PathBuf,
    check_every: Duration,
}

/// What the loader knows of one engine.
#[derive(Default)]
struct EngineState {
    /// Failed loads in a row.
    failures: u32,
    /// Not tried again before this (after a failure).
    retry_at: Option<Instant>,
    /// The label it was last seen serving (for the log: loaded, lost, loaded again).
    serving: Option<String>,
}

/// A version's bytes (for engines that take tensors) and staged directory's name (for
/// engines that read disk), each made once for all engines.
#[derive(Clone, Default)]
struct Prepared {
    version: u64,
    bytes: Option<Arc<Vec<u8>>>,
    staged: Option<String>,
}

impl EnginePush {
    /// Loads into `engines` (clients set up from `[worker.student]`, each with its
    /// engine's url). With `reload = "disk"` each version is staged once under
    /// `weights_dir` (config and tokenizer files from `model_dir`), which the engines read
    /// as `engine_dir`.
    pub fn new(
        engines: Vec<RemoteEngine>,
        model_dir: PathBuf,
        weights_dir: PathBuf,
        engine_dir: PathBuf,
    ) -> anyhow::Result<Self> {
        if engines
            .iter()
            .any(|e| e.config().reload == ReloadKind::Disk)
        {
            std::fs::create_dir_all(&weights_dir).with_context(|| {
                format!(
                    "creating {} (where the learner stages versions for the student engines)",
                    weights_dir.display()
                )
            })?;
        }
        Ok(Self {
            engines: engines.into_iter().map(Arc::new).collect(),
            model_dir,
            weights_dir,
            engine_dir,
            check_every: CHECK_EVERY,
        })
    }

    /// How often the engines are asked what they serve while nothing new is published
    /// (default [`CHECK_EVERY`]).
    pub fn check_every(mut self, every: Duration) -> Self {
        self.check_every = every;
        self
    }

    /// Loads the newest version `versions` holds into every engine, again whenever a
    /// newer one is published or an engine stops serving it; returns when the sender is
    /// dropped.
    pub async fn run(self, mut versions: watch::Receiver<Option<VersionFile>>) {
        let mut state: Vec<EngineState> = self.engines.iter().map(|_| Default::default()).collect();
        // The newest version's bytes or directory, and the directories staged here (the
        // two newest are kept: an engine may still be reading the older).
        let mut prepared = Prepared::default();
        let mut staged: std::collections::VecDeque<PathBuf> = Default::default();
        tracing::info!(
            engines = ?self.engines.iter().map(|e| e.url()).collect::<Vec<_>>(),
            "the learner loads every policy version into the student engines"
        );
        loop {
            let newest = versions.borrow_and_update().clone();
            if let Some(pv) = newest {
                self.round(&pv, &mut state, &mut prepared, &mut staged)
                    .await;
            }
            let now = Instant::now();
            let wake = state
                .iter()
                .filter_map(|s| s.retry_at)
                .map(|t| t.saturating_duration_since(now))
                .fold(self.check_every, Duration::min);
            tokio::select! {
                changed = versions.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                _ = tokio::time::sleep(wake) => {}
            }
        }
    }

    /// One pass over the engines: those due and not serving `pv` get it.
    async fn round(
        &self,
        pv: &VersionFile,
        state: &mut [EngineState],
        prepared: &mut Prepared,
        staged: &mut std::collections::VecDeque<PathBuf>,
    ) {
        let label = version_label(pv.version, &pv.sha256);
        let now = Instant::now();
        let due: Vec<usize> = (0..self.engines.len())
            .filter(|&i| state[i].retry_at.is_none_or(|t| t <= now))
            .collect();
        let serving = futures::future::join_all(
            due.iter()
                .map(|&i| self.engines[i].served_version())
                .collect::<Vec<_>>(),
        )
        .await;
        let mut need = Vec::new();
        for (&i, served) in due.iter().zip(serving) {
            match served {
                Ok(s) if s == label => {
                    state[i] = EngineState {
                        serving: Some(label.clone()),
                        ..Default::default()
                    };
                }
                Ok(s) => {
                    if state[i].serving.as_deref() == Some(label.as_str()) {
                        tracing::warn!(
                            engine = %self.engines[i].url(),
                            version = pv.version,
                            serving = %s,
                            "the student engine no longer serves the newest policy version \
                             (restarted, or another client loaded other weights): loading it again"
                        );
                    }
                    state[i].serving = Some(s);
                    need.push(i);
                }
                // Down: the load below fails the same way and backs off.
                Err(_) => need.push(i),
            }
        }
        if need.is_empty() {
            return;
        }
        let source = match self.prepare(pv, &label, prepared, staged, &need).await {
            Ok(s) => s,
            Err(e) => {
                // The learner's own file: nothing an engine can fix. Tried again later.
                tracing::error!(
                    version = pv.version,
                    error = %format!("{e:#}"),
                    "could not prepare the policy version for the student engines"
                );
                for &i in &need {
                    self.failed(&mut state[i]);
                }
                return;
            }
        };
        let loads = need.iter().map(|&i| {
            let engine = self.engines[i].clone();
            let (label, source) = (label.clone(), source.clone());
            let engine_dir = self.engine_dir.clone();
            async move {
                let started = Instant::now();
                let r = match (engine.config().reload, source.bytes, source.staged) {
                    (ReloadKind::Distributed, Some(bytes), _) => {
                        engine.load_distributed(bytes, pv.version, &label).await
                    }
                    (ReloadKind::Disk, _, Some(name)) => {
                        engine
                            .load_from_disk(&engine_dir.join(name), pv.version, &label)
                            .await
                    }
                    _ => unreachable!("`prepare` makes what every engine in need loads"),
                };
                (i, r, started.elapsed())
            }
        });
        // A model's worth of memory: read again for a retry rather than kept.
        prepared.bytes = None;
        for (i, result, took) in futures::future::join_all(loads).await {
            let engine = &self.engines[i];
            match result {
                Ok(()) => {
                    tracing::info!(
                        engine = %engine.url(),
                        version = pv.version,
                        label = %label,
                        seconds = took.as_secs_f64(),
                        "loaded the policy version into the student engine"
                    );
                    state[i] = EngineState {
                        serving: Some(label.clone()),
                        ..Default::default()
                    };
                }
                Err(e) => {
                    let retry = self.failed(&mut state[i]);
                    tracing::warn!(
                        engine = %engine.url(),
                        version = pv.version,
                        error = %e,
                        failures = state[i].failures,
                        retry_in_s = retry.as_secs_f64(),
                        "could not load the policy version into the student engine \
                         (its workers wait for it)"
                    );
                }
            }
        }
    }

    /// Counts a failure of an engine; returns how long until it is tried again.
    fn failed(&self, s: &mut EngineState) -> Duration {
        s.failures += 1;
        let backoff = Duration::from_secs(1 << s.failures.min(6)).min(MAX_BACKOFF);
        s.retry_at = Some(Instant::now() + backoff);
        backoff
    }

    /// What the engines in `need` load `pv` from: its bytes (engines that take tensors)
    /// and its staged directory's name (engines that read disk), each made once per
    /// version (kept in `prepared`).
    async fn prepare(
        &self,
        pv: &VersionFile,
        label: &str,
        prepared: &mut Prepared,
        staged: &mut std::collections::VecDeque<PathBuf>,
        need: &[usize],
    ) -> anyhow::Result<Prepared> {
        if prepared.version != pv.version {
            *prepared = Prepared {
                version: pv.version,
                ..Default::default()
            };
        }
        let wants = |kind| {
            need.iter()
                .any(|&i| self.engines[i].config().reload == kind)
        };
        if wants(ReloadKind::Distributed) && prepared.bytes.is_none() {
            prepared.bytes = Some(Arc::new(
                tokio::fs::read(&pv.path)
                    .await
                    .with_context(|| format!("reading {}", pv.path.display()))?,
            ));
        }
        if wants(ReloadKind::Disk) && prepared.staged.is_none() {
            prepared.staged = Some(self.stage(pv, label, staged).await?);
        }
        Ok(prepared.clone())
    }

    /// Stages `pv` as a Hugging Face directory named `label` under `weights_dir` (a copy:
    /// the learner keeps its file).
    async fn stage(
        &self,
        pv: &VersionFile,
        label: &str,
        staged: &mut std::collections::VecDeque<PathBuf>,
    ) -> anyhow::Result<String> {
        let copy = self.weights_dir.join(format!(
            ".push-v{:06}-{:016x}.safetensors",
            pv.version,
            rand::random::<u64>()
        ));
        tokio::fs::copy(&pv.path, &copy)
            .await
            .with_context(|| format!("copying {} to {}", pv.path.display(), copy.display()))?;
        let (w, m, l) = (
            self.weights_dir.clone(),
            self.model_dir.clone(),
            label.to_string(),
        );
        let (name, created) = tokio::task::spawn_blocking(move || {
            let r = stage_version(&w, &m, &copy, &l, true);
            let _ = std::fs::remove_file(&copy);
            r
        })
        .await
        .context("staging the version for the student engines")??;
        if created {
            keep_newest_staged(staged, self.weights_dir.join(&name));
        }
        Ok(name)
    }
}
