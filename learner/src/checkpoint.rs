//! Training checkpoints: everything needed to continue a run exactly, written atomically.
//!
//! A checkpoint directory holds the model in Hugging Face layout (`config.json`,
//! `model.safetensors`, so it also loads as a plain policy), `optimizer.safetensors`
//! (AdamW's `exp_avg.<param>` and `exp_avg_sq.<param>`) and `trainer_state.json` (schedule
//! position, optimizer step, the trainer's RNG, the caller's data cursor, the config).

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::config::LearnerConfig;

pub const STATE_FILE: &str = "trainer_state.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const FORMAT: u32 = 1;

/// `trainer_state.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    pub format: u32,
    /// Optimizer steps taken: the schedule position.
    pub steps: u64,
    /// AdamW's bias-correction step.
    pub optimizer_steps: u64,
    pub rng: RngState,
    /// Opaque to the learner: where the caller's data stream continues.
    pub data_cursor: serde_json::Value,
    pub config: LearnerConfig,
    /// Parameter names in the order of the optimizer state.
    pub parameters: Vec<String>,
    pub world_size: usize,
}

impl TrainerState {
    pub fn new(
        steps: u64,
        optimizer_steps: u64,
        rng: RngState,
        data_cursor: serde_json::Value,
        config: LearnerConfig,
        parameters: Vec<String>,
        world_size: usize,
    ) -> Self {
        Self {
            format: FORMAT,
            steps,
            optimizer_steps,
            rng,
            data_cursor,
            config,
            parameters,
            world_size,
        }
    }
}

/// A ChaCha8 stream position: key, stream and word position (strings: JSON numbers lose
/// precision past 2^53).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    pub seed_hex: String,
    pub stream: u64,
    pub word_pos: String,
}

impl RngState {
    pub fn of(rng: &rand_chacha::ChaCha8Rng) -> Self {
        Self {
            seed_hex: hex::encode(rng.get_seed()),
            stream: rng.get_stream(),
            word_pos: rng.get_word_pos().to_string(),
        }
    }

    pub fn restore(&self) -> Result<rand_chacha::ChaCha8Rng> {
        use rand::SeedableRng;
        let seed: [u8; 32] = hex::decode(&self.seed_hex)
            .ok()
            .and_then(|b| b.try_into().ok())
            .context("rng.seed_hex must be 64 hex digits")?;
        let word_pos: u128 = self
            .word_pos
            .parse()
            .context("rng.word_pos must be a decimal integer")?;
        let mut rng = rand_chacha::ChaCha8Rng::from_seed(seed);
        rng.set_stream(self.stream);
        rng.set_word_pos(word_pos);
        Ok(rng)
    }
}

pub fn read_state(dir: &Path) -> Result<TrainerState> {
    let path = dir.join(STATE_FILE);
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let state: TrainerState =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    if state.format != FORMAT {
        bail!(
            "{}: checkpoint format {} is not the supported {FORMAT}",
            path.display(),
            state.format
        );
    }
    Ok(state)
}

fn names(dir: &Path) -> Result<(PathBuf, String)> {
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("checkpoint path {} has no usable final name", dir.display()))?
        .to_string();
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name))
}

/// The directory to load for checkpoint `dir`: `dir` itself, or, if a crash hit the
/// instant between moving the previous checkpoint aside and moving the new one in, the
/// previous one.
pub fn resolve(dir: &Path) -> Result<PathBuf> {
    if dir.join(STATE_FILE).exists() {
        return Ok(dir.to_path_buf());
    }
    let (parent, name) = names(dir)?;
    let prefix = format!(".{name}.old-");
    if let Ok(entries) = fs::read_dir(&parent) {
        for e in entries.flatten() {
            let n = e.file_name();
            if n.to_string_lossy().starts_with(&prefix) && e.path().join(STATE_FILE).exists() {
                return Ok(e.path());
            }
        }
    }
    bail!(
        "no checkpoint at {}: expected {} there (written by Trainer::save_checkpoint)",
        dir.display(),
        STATE_FILE
    )
}

/// Whether `dir` (or its crash-time fallback) holds a checkpoint.
pub fn exists(dir: &Path) -> bool {
    resolve(dir).is_ok()
}

/// Fills a fresh temporary sibling of `dir` with `fill`, flushes it to disk, then moves it
/// to `dir`, replacing any previous checkpoint there. A reader sees the old checkpoint or
/// the new one, never a half-written one.
pub fn write_atomically(dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let (parent, name) = names(dir)?;
    fs::create_dir_all(&parent).with_context(|| format!("creating {}", parent.display()))?;
    // Leftovers of writers that died mid-way.
    if let Ok(entries) = fs::read_dir(&parent) {
        for e in entries.flatten() {
            if e.file_name()
                .to_string_lossy()
                .starts_with(&format!(".{name}.tmp-"))
            {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
    let tag = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    );
    let tmp = parent.join(format!(".{name}.tmp-{tag}"));
    fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    fill(&tmp)?;
    for e in fs::read_dir(&tmp).with_context(|| format!("listing {}", tmp.display()))? {
        let p = e?.path();
        fs::File::open(&p)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("flushing {}", p.display()))?;
    }
    sync_dir(&tmp)?;
    if dir.exists() {
        let old = parent.join(format!(".{name}.old-{tag}"));
        fs::rename(dir, &old)
            .with_context(|| format!("moving the previous {} aside", dir.display()))?;
        fs::rename(&tmp, dir)
            .with_context(|| format!("moving the new checkpoint to {}", dir.display()))?;
        sync_dir(&parent)?;
        fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))?;
    } else {
        fs::rename(&tmp, dir)
            .with_context(|| format!("moving the new checkpoint to {}", dir.display()))?;
    }
    // Earlier `.old-` directories are stale once the new checkpoint is in place.
    if let Ok(entries) = fs::read_dir(&parent) {
        for e in entries.flatten() {
            if e.file_name()
                .to_string_lossy()
                .starts_with(&format!(".{name}.old-"))
            {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
    sync_dir(&parent)
}

fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("flushing directory {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_atomically_and_falls_back_to_the_previous_one() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ckpt");
        assert!(!exists(&dir));
        let write = |v: &str| {
            write_atomically(&dir, |tmp| {
                fs::write(tmp.join(STATE_FILE), v)?;
                Ok(())
            })
        };
        write("one").unwrap();
        write("two").unwrap();
        assert_eq!(fs::read_to_string(dir.join(STATE_FILE)).unwrap(), "two");
        let left: Vec<String> = fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            left,
            vec!["ckpt".to_string()],
            "no temporary directories left"
        );
        // A failing writer leaves the previous checkpoint untouched.
        assert!(write_atomically(&dir, |_| bail!("disk full")).is_err());
        assert_eq!(fs::read_to_string(dir.join(STATE_FILE)).unwrap(), "two");
        // Crash between the two renames: the previous checkpoint is found.
        fs::rename(&dir, root.path().join(".ckpt.old-1-2")).unwrap();
        assert_eq!(resolve(&dir).unwrap(), root.path().join(".ckpt.old-1-2"));
        write("three").unwrap();
        assert_eq!(resolve(&dir).unwrap(), dir);
        assert_eq!(fs::read_dir(root.path()).unwrap().count(), 1);
    }
}
