//! The run configuration: one TOML file with a section per service, every field
//! defaulted for the single-machine run, overridable by `TUTOR_SECTION__FIELD`
//! environment variables (e.g. `TUTOR_COORDINATOR__ITERATIONS=2`).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use tutor_coordinator::CoordinatorConfig;
use tutor_learner::LearnerConfig;
use tutor_policy::ModelConfig;
use tutor_rollout::worker::WorkerConfig;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    pub run: RunSection,
    pub tasks: TasksSection,
    pub model: ModelSection,
    pub coordinator: CoordinatorConfig,
    pub learner: LearnerConfig,
    pub worker: WorkerConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunSection {
    /// Name prefix of the run directory.
    pub name: String,
    /// Run directories are created under this folder.
    pub out_dir: PathBuf,
    /// Rollout worker processes `tutor run` starts.
    pub workers: u32,
}

impl Default for RunSection {
    fn default() -> Self {
        Self {
            name: "run".into(),
            out_dir: "runs".into(),
            workers: 2,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskSource {
    /// Generated toy repositories (`tutor tasks toy`).
    Toy,
    /// SWE-bench-style JSONL files (`train_path`, `heldout_path`).
    File,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TasksSection {
    pub source: TaskSource,
    /// Toy tasks: how many to generate for training and for held-out evaluation.
    pub toy_train: usize,
    pub toy_heldout: usize,
    pub seed: u64,
    pub train_path: Option<PathBuf>,
    pub heldout_path: Option<PathBuf>,
}

impl Default for TasksSection {
    fn default() -> Self {
        Self {
            source: TaskSource::Toy,
            toy_train: 32,
            toy_heldout: 8,
            seed: 0,
            train_path: None,
            heldout_path: None,
        }
    }
}

/// The student's size; the tokenizer is trained to `vocab_size` on the task corpus.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            vocab_size: 1024,
            hidden_size: 128,
            intermediate_size: 384,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            max_position_embeddings: 4096,
        }
    }
}

impl ModelSection {
    pub fn model_config(&self, vocab_size: usize) -> ModelConfig {
        let mut c = ModelConfig::tiny(vocab_size);
        c.hidden_size = self.hidden_size;
        c.intermediate_size = self.intermediate_size;
        c.num_hidden_layers = self.num_hidden_layers;
        c.num_attention_heads = self.num_attention_heads;
        c.num_key_value_heads = self.num_key_value_heads;
        c.head_dim = self.head_dim;
        c.max_position_embeddings = self.max_position_embeddings;
        c
    }
}

impl RunConfig {
    /// Loads and validates a run config. Errors name the file, line and field.
    pub fn load(path: &Path) -> Result<(Self, String)> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the config file {}", path.display()))?;
        // A strict first pass for precise messages (line, column, field)...
        let _: RunConfig = toml::from_str(&text)
            .map_err(|e| anyhow!("{}: {}", path.display(), e.to_string().trim_end()))?;
        // ...then the same text with environment overrides on top.
        let overrides: std::collections::HashMap<String, String> = std::env::vars()
            .filter(|(k, _)| k.starts_with("TUTOR_") && k.contains("__"))
            .collect();
        let names: Vec<String> = overrides.keys().cloned().collect();
        let merged = config::Config::builder()
            .add_source(config::File::from_str(&text, config::FileFormat::Toml))
            .add_source(
                config::Environment::with_prefix("TUTOR")
                    .prefix_separator("_")
                    .separator("__")
                    .try_parsing(true)
                    .source(Some(overrides)),
            )
            .build()
            .and_then(|c| c.try_deserialize::<RunConfig>())
            .map_err(|e| {
                anyhow!(
                    "{} with environment overrides {names:?}: {e}",
                    path.display()
                )
            })?;
        merged
            .validate()
            .map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Ok((merged, text))
    }

    pub fn validate(&self) -> Result<()> {
        let c = &self.coordinator;
        if c.iterations == 0 {
            bail!("coordinator.iterations must be at least 1");
        }
        if c.max_turns == 0 {
            bail!("coordinator.max_turns must be at least 1");
        }
        if c.batch_tokens < 16 || c.max_seq_len < 16 {
            bail!("coordinator.batch_tokens and coordinator.max_seq_len must be at least 16");
        }
        if !(0.0..=1.0).contains(&c.beta.start) || !(0.0..=1.0).contains(&c.beta.end) {
            bail!("coordinator.beta.start and coordinator.beta.end must lie in [0, 1]");
        }
        self.learner.validate().map_err(|e| anyhow!(e))?;
        if self.run.workers == 0 {
            bail!("run.workers must be at least 1");
        }
        let m = &self.model;
        if m.num_attention_heads == 0
            || m.num_key_value_heads == 0
            || !m.num_attention_heads.is_multiple_of(m.num_key_value_heads)
        {
            bail!("model.num_attention_heads must be a positive multiple of model.num_key_value_heads");
        }
        if m.vocab_size < 300 {
            bail!("model.vocab_size must be at least 300 (256 bytes + special tokens + merges)");
        }
        if self.tasks.source == TaskSource::File && self.tasks.train_path.is_none() {
            bail!("tasks.train_path is required when tasks.source = \"file\"");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("run.toml");
        std::fs::write(&p, text).unwrap();
        (d, p)
    }

    #[test]
    fn errors_name_file_line_and_field() {
        let (_d, p) = write("[coordinator]\niterations = 2\nmax_turns = \"six\"\n");
        let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
        assert!(e.contains("run.toml"), "{e}");
        assert!(e.contains("line 3"), "{e}");
        assert!(e.contains("max_turns"), "{e}");

        let (_d, p) = write("[coordinator]\nitertions = 2\n");
        let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
        assert!(e.contains("itertions") && e.contains("line 2"), "{e}");

        let (_d, p) = write("[coordinator.beta]\nkind = \"cosine\"\n");
        let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
        assert!(e.contains("cosine") && e.contains("line 2"), "{e}");
    }

    #[test]
    fn defaults_and_validation() {
        let (_d, p) = write("");
        let (c, _) = RunConfig::load(&p).unwrap();
        assert_eq!(c.run.workers, 2);
        let (_d, p) = write("[learner]\nschedule = \"cosine\"\nwarmup_steps = 10\n");
        let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
        assert!(e.contains("total_steps"), "{e}");
        let (_d, p) = write("[coordinator]\niterations = 0\n");
        let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
        assert!(e.contains("coordinator.iterations"), "{e}");
    }
}
