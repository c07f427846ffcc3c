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
//! [`EnginePush::run`] follows each engine on a task of its own (a slow or hanging engine
//! holds back no other): the newest published version is loaded into it when it does not
//! serve it. An engine that refuses a load is tried again after a backoff that doubles up
//! to [`MAX_BACKOFF`]; one that is down is asked again every `check_every` (a request that
//! finds nothing listening costs nothing, and its workers wait for it: a restarted engine
//! gets the newest version within `check_every`, not after the backoff the outage grew).
//! Each failure is logged with the engine and the version (an outage at its first, second,
//! fourth, ... failure).
//! While nothing new is published, an engine not backing off is asked what it serves every
//! `check_every`, so one that restarted (serving its own weights again) gets the newest
//! version back without waiting for the next publish. A version's bytes are read once
//! while any engine is loading them, and staged once for engines that read disk.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::sync::watch;
/// A published version as the learner registered it: what the loader loads.
pub use tutor_collective::broadcast::VersionFile;

use super::{
    keep_newest_staged, stage_version, version_label, EngineError, ReloadKind, RemoteEngine,
};

/// How often the engines are asked what they serve by default.
pub const CHECK_EVERY: Duration = Duration::from_secs(5);
/// The longest wait before loading again into an engine that failed.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// The learner's loader of versions into the student engines.
pub struct EnginePush {
    engines: Vec<Arc<RemoteEngine>>,
    shared: Arc<Shared>,
    check_every: Duration,
}

/// What the engines' tasks share: where and from what versions are staged, and the
/// newest version's bytes and staged directory.
struct Shared {
    model_dir: PathBuf,
    weights_dir: PathBuf,
    engine_dir: PathBuf,
    prepared: tokio::sync::Mutex<Prepared>,
}

/// A version (by number and checksum), its bytes while an engine holds them (read again
/// once every engine dropped them: a model's worth of memory is not kept), and its staged
/// directory's name with the directories staged here (the two newest are kept).
#[derive(Default)]
struct Prepared {
    version: Option<(u64, String)>,
    bytes: std::sync::Weak<Vec<u8>>,
    staged: Option<String>,
    staged_dirs: std::collections::VecDeque<PathBuf>,
}

/// What an engine's task knows of it.
#[derive(Default)]
struct EngineState {
    /// Failed loads in a row.
    failures: u32,
    /// Not tried again before this (after a failure).
    retry_at: Option<Instant>,
    /// The label it was last seen serving (to log a version it lost).
    serving: Option<String>,
    /// Whether the failures in a row are of an engine that is down (else refused loads):
    /// each kind counts its own, so an outage does not lengthen the backoff of the refusal
    /// after it, nor refusals the outage's.
    down: bool,
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
            shared: Arc::new(Shared {
                model_dir,
                weights_dir,
                engine_dir,
                prepared: Default::default(),
            }),
            check_every: CHECK_EVERY,
        })
    }

    /// How often an engine is asked what it serves while nothing new is published
    /// (default [`CHECK_EVERY`]).
    pub fn check_every(mut self, every: Duration) -> Self {
        self.check_every = every;
        self
    }

    /// Follows every engine until the sender of `versions` is dropped: the newest version
    /// is loaded into each engine that does not serve it, again whenever a newer one is
    /// published or an engine stops serving it.
    pub async fn run(self, versions: watch::Receiver<Option<VersionFile>>) {
        tracing::info!(
            engines = ?self.engines.iter().map(|e| e.url()).collect::<Vec<_>>(),
            "the learner loads every policy version into the student engines"
        );
        let tasks: Vec<_> = self
            .engines
            .iter()
            .map(|engine| {
                tokio::spawn(follow(
                    engine.clone(),
                    self.shared.clone(),
                    versions.clone(),
                    self.check_every,
                ))
            })
            .collect();
        for (task, engine) in tasks.into_iter().zip(&self.engines) {
            if let Err(e) = task.await {
                tracing::error!(
                    engine = %engine.url(),
                    error = %e,
                    "the learner's loader of this student engine stopped: versions no \
                     longer reach it"
                );
            }
        }
    }
}

/// One engine's task: see [`EnginePush::run`].
async fn follow(
    engine: Arc<RemoteEngine>,
    shared: Arc<Shared>,
    mut versions: watch::Receiver<Option<VersionFile>>,
    check_every: Duration,
) {
    let mut state = EngineState::default();
    loop {
        let newest = versions.borrow_and_update().clone();
        if let Some(pv) = newest {
            if state.retry_at.is_none_or(|t| t <= Instant::now()) {
                load_newest(&engine, &shared, &pv, &mut state, check_every).await;
            }
        }
        let wake = state.retry_at.map_or(check_every, |t| {
            t.saturating_duration_since(Instant::now()).min(check_every)
        });
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

/// Loads `pv` into `engine` unless it serves it; counts and logs a failure (an engine that
/// is down is asked again after `check_every`).
async fn load_newest(
    engine: &RemoteEngine,
    shared: &Shared,
    pv: &VersionFile,
    state: &mut EngineState,
    check_every: Duration,
) {
    let label = version_label(pv.version, &pv.sha256);
    match engine.served_version().await {
        Ok(s) if s == label => {
            *state = EngineState {
                serving: Some(label),
                ..Default::default()
            };
            return;
        }
        Ok(s) => {
            if state.serving.as_deref() == Some(label.as_str()) {
                tracing::warn!(
                    engine = %engine.url(),
                    version = pv.version,
                    serving = %s,
                    "the student engine no longer serves the newest policy version \
                     (restarted, or another client loaded other weights): loading it again"
                );
            }
            state.serving = Some(s);
        }
        // Nothing to load into: no file is read for it.
        Err(e @ EngineError::Down { .. }) => {
            failed(engine, pv, state, &e.to_string(), Retry::Every(check_every));
            return;
        }
        // It answers, if not as asked: the load says what is wrong.
        Err(_) => {}
    }
    let started = Instant::now();
    let result = match engine.config().reload {
        ReloadKind::Distributed => match shared.bytes(pv).await {
            Ok(bytes) => engine
                .load_distributed(bytes, pv.version, &label)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(format!("{e:#}")),
        },
        ReloadKind::Disk => match shared.staged(pv, &label).await {
            Ok(name) => engine
                .load_from_disk(&shared.engine_dir.join(name), pv.version, &label)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(format!("{e:#}")),
        },
    };
    match result {
        Ok(()) => {
            tracing::info!(
                engine = %engine.url(),
                version = pv.version,
                label = %label,
                seconds = started.elapsed().as_secs_f64(),
                "loaded the policy version into the student engine"
            );
            *state = EngineState {
                serving: Some(label),
                ..Default::default()
            };
        }
        Err(e) => failed(engine, pv, state, &e, Retry::Backoff),
    }
}

/// When to try an engine again after a failure.
#[derive(Clone, Copy)]
enum Retry {
    /// It is down: ask again after the given interval (`check_every`) at the latest.
    Every(Duration),
    /// It refused the load: back off up to [`MAX_BACKOFF`].
    Backoff,
}

/// Counts a failure to load `pv` into `engine`, logs it and sets when to try again: after
/// a backoff that doubles with each failure of the same kind in a row, up to what `retry`
/// allows (an outage is then logged at its 1st, 2nd, 4th, 8th, ... failure only).
fn failed(
    engine: &RemoteEngine,
    pv: &VersionFile,
    state: &mut EngineState,
    error: &str,
    retry: Retry,
) {
    let (down, longest) = match retry {
        Retry::Every(every) => (true, every),
        Retry::Backoff => (false, MAX_BACKOFF),
    };
    if state.down != down {
        state.failures = 0;
        state.down = down;
    }
    state.failures += 1;
    // At least 100 ms: a `check_every` of zero must not spin on a down engine.
    let backoff = Duration::from_secs(1 << state.failures.min(6))
        .min(longest)
        .max(Duration::from_millis(100));
    state.retry_at = Some(Instant::now() + backoff);
    if down && !state.failures.is_power_of_two() {
        return;
    }
    tracing::warn!(
        engine = %engine.url(),
        version = pv.version,
        error,
        failures = state.failures,
        retry_in_s = backoff.as_secs_f64(),
        "could not load the policy version into the student engine (its workers wait for it)"
    );
}

impl Shared {
    /// `prepared`, reset when `pv` is another version than the one it holds.
    async fn prepared_for(&self, pv: &VersionFile) -> tokio::sync::MutexGuard<'_, Prepared> {
        let mut p = self.prepared.lock().await;
        let key = Some((pv.version, pv.sha256.clone()));
        if p.version != key {
            p.version = key;
            p.bytes = Default::default();
            p.staged = None;
        }
        p
    }

    /// `pv`'s bytes: those another engine's load holds, else read from its file.
    async fn bytes(&self, pv: &VersionFile) -> anyhow::Result<Arc<Vec<u8>>> {
        let mut p = self.prepared_for(pv).await;
        if let Some(b) = p.bytes.upgrade() {
            return Ok(b);
        }
        let b = Arc::new(
            tokio::fs::read(&pv.path)
                .await
                .with_context(|| format!("reading {}", pv.path.display()))?,
        );
        p.bytes = Arc::downgrade(&b);
        Ok(b)
    }

    /// The name of `pv`'s directory under `weights_dir`, staged as `label` (once; a copy:
    /// the learner keeps its file).
    async fn staged(&self, pv: &VersionFile, label: &str) -> anyhow::Result<String> {
        let mut p = self.prepared_for(pv).await;
        if let Some(name) = &p.staged {
            return Ok(name.clone());
        }
        let name = if self
            .weights_dir
            .join(label)
            .join("model.safetensors")
            .exists()
        {
            // Staged before (content-addressed: the same weights).
            label.to_string()
        } else {
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
                keep_newest_staged(&mut p.staged_dirs, self.weights_dir.join(&name));
            }
            name
        };
        p.staged = Some(name.clone());
        Ok(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::student_engine::{StudentConfig, StudentKind};

    /// An engine that is down is asked again every `check_every` however long the outage,
    /// so a restarted engine gets the newest version within `check_every`; a refused load
    /// backs off up to `MAX_BACKOFF`. Before, an outage grew the wait to 60 s, and the
    /// workers waited as long after the engine was back.
    #[test]
    fn a_down_engine_is_asked_again_every_check_and_a_refusal_backs_off() {
        let config = StudentConfig {
            kind: StudentKind::Engine,
            base_url: "http://127.0.0.1:9".into(),
            ..Default::default()
        };
        let engine = RemoteEngine::new(&config, 100).unwrap();
        let pv = VersionFile {
            version: 2,
            sha256: "ab".into(),
            bytes: 0,
            path: "v2.safetensors".into(),
        };
        let wait = |state: &EngineState| {
            state
                .retry_at
                .unwrap()
                .saturating_duration_since(Instant::now())
        };
        let mut down = EngineState::default();
        for _ in 0..10 {
            failed(&engine, &pv, &mut down, "down", Retry::Every(CHECK_EVERY));
            assert!(wait(&down) <= CHECK_EVERY, "{:?}", wait(&down));
        }
        assert_eq!(down.failures, 10);
        let mut refused = EngineState::default();
        for _ in 0..10 {
            failed(&engine, &pv, &mut refused, "refused", Retry::Backoff);
        }
        assert!(wait(&refused) > CHECK_EVERY * 10, "{:?}", wait(&refused));
        assert!(wait(&refused) <= MAX_BACKOFF);
        // A long outage, then a refusal: the refusal's backoff starts again (2 s), not at
        // the outage's count (60 s); and the other way round.
        failed(&engine, &pv, &mut down, "refused", Retry::Backoff);
        assert_eq!(down.failures, 1);
        assert!(wait(&down) <= Duration::from_secs(2), "{:?}", wait(&down));
        failed(
            &engine,
            &pv,
            &mut refused,
            "down",
            Retry::Every(CHECK_EVERY),
        );
        assert_eq!(refused.failures, 1);
        assert!(
            wait(&refused) <= Duration::from_secs(2),
            "{:?}",
            wait(&refused)
        );
        // A zero check_every does not spin.
        let mut spin = EngineState::default();
        failed(
            &engine,
            &pv,
            &mut spin,
            "down",
            Retry::Every(Duration::ZERO),
        );
        assert!(
            wait(&spin) >= Duration::from_millis(90),
            "{:?}",
            wait(&spin)
        );
    }
}
