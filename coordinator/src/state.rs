//! The run's progress checkpoint: which iteration, which phase of it, which coordinator
//! start. A small JSON file beside the trajectory store, replaced atomically, so that a
//! restarted coordinator knows where the driver was; everything else it recovers from
//! the store itself.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// Where the driver stands in the current iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Episodes of `iteration` are being generated.
    Rollout,
    /// The learner is training on `iteration`'s data (from `train_bases[iteration]`).
    Train,
    /// The learner published the version trained on `iteration`.
    Published,
    /// Every iteration is done and the final checkpoint saved.
    Finished,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunState {
    /// Coordinator starts on this run directory, this one included. Episode and worker
    /// ids carry it, so an id handed out before a restart is never handed out again.
    pub generation: u64,
    pub iteration: u32,
    pub phase: Phase,
    /// Per iteration whose training started: the learner version it started from. The
    /// staleness filter measures an episode's lag against it, before and after a restart.
    #[serde(default)]
    pub train_bases: BTreeMap<u32, u64>,
    /// The newest version the learner published for this run (0: none yet).
    #[serde(default)]
    pub policy_version: u64,
    /// This run's id, sent on every TrainBatch: the learner refuses batches of any run
    /// but the one it trains. Made at the first start (run directory name + random
    /// suffix) and kept across restarts; empty only in a state written before run ids.
    #[serde(default)]
    pub run_id: String,
    /// The key worker secrets are derived from (hex; `scheduler::WorkerKey`), made at the
    /// first start and kept, so that a restarted coordinator checks the secrets of workers
    /// registered before it. A secret: this file is written readable by its owner only.
    /// Empty only in a state written before the key existed.
    #[serde(default)]
    pub worker_key: String,
    /// The first generation that recorded its leases in the store (`LeaseGranted`); every
    /// later one does too. Set by the first coordinator that records them, before it
    /// leases anything: an id of such a generation with no record was never leased, even
    /// if that generation recorded nothing at all. `None` in a state written before.
    #[serde(default)]
    pub lease_records_from: Option<u64>,
}

impl Default for RunState {
    fn default() -> Self {
        Self {
            generation: 0,
            iteration: 0,
            phase: Phase::Rollout,
            train_bases: BTreeMap::new(),
            policy_version: 0,
            run_id: String::new(),
            worker_key: String::new(),
            lease_records_from: None,
        }
    }
}

/// A new run id for the run directory `run_dir`: its name and 64 random bits.
pub fn new_run_id(run_dir: &Path) -> String {
    let name = run_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "run".into());
    format!("{name}-{:016x}", rand::random::<u64>())
}

/// `run_dir/coordinator-state.json`.
pub fn state_path(run_dir: &Path) -> PathBuf {
    run_dir.join("coordinator-state.json")
}

impl RunState {
    /// Reads the checkpoint; `None` when the run directory has none (a fresh run).
    pub fn load(path: &Path) -> Result<Option<Self>> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).with_context(|| {
                format!(
                    "{} is not a coordinator state file; move it away to start the run afresh",
                    path.display()
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }

    /// Replaces the file atomically: a crash leaves the old state or the new one, never
    /// a torn mix (write a temp file, fsync, rename over, fsync the directory).
    pub fn save(&self, path: &Path) -> Result<()> {
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let tmp = path.with_extension("json.tmp");
        let mut f = {
            let mut o = std::fs::OpenOptions::new();
            o.write(true).create(true).truncate(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
            o.open(&tmp)
                .with_context(|| format!("creating {}", tmp.display()))?
        };
        f.write_all(&serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("syncing {}", dir.display()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_replaces_and_load_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = state_path(dir.path());
        assert_eq!(RunState::load(&path).unwrap(), None);
        let mut s = RunState {
            generation: 2,
            iteration: 1,
            phase: Phase::Train,
            ..Default::default()
        };
        s.train_bases.insert(1, 4);
        s.save(&path).unwrap();
        s.phase = Phase::Published;
        s.save(&path).unwrap();
        assert_eq!(RunState::load(&path).unwrap(), Some(s));
        assert!(!path.with_extension("json.tmp").exists());
        std::fs::write(&path, b"{\"generation\": ").unwrap();
        let e = format!("{:#}", RunState::load(&path).unwrap_err());
        assert!(e.contains("coordinator-state.json"), "{e}");
    }
}
