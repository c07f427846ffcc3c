//! The run configuration: one TOML file with a section per service, every field
//! defaulted for the single-machine run, overridable by `TUTOR_SECTION__FIELD`
//! environment variables (e.g. `TUTOR_COORDINATOR__ITERATIONS=2`).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use tutor_coordinator::CoordinatorConfig;
use tutor_learner::LearnerConfig;
use tutor_policy::ModelConfig;
use tutor_rollout_worker::worker::WorkerConfig;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    pub run: RunSection,
    pub tasks: TasksSection,
    pub model: ModelSection,
    pub coordinator: CoordinatorConfig,
    pub learner: LearnerConfig,
    pub worker: WorkerConfig,
    pub tls: TlsSection,
}

/// `tutor run` with TLS: every process it starts gets these files as --tls-cert,
/// --tls-key and --tls-ca, so every gRPC call is mutual TLS on 127.0.0.1 (the
/// certificate must name IP 127.0.0.1 and allow both server and client use). Relative
/// paths are taken from the working directory. Empty: plaintext.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsSection {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub ca: Option<PathBuf>,
}

impl TlsSection {
    /// The files with relative paths made absolute (the children run elsewhere).
    pub fn files(&self) -> Result<tutor_proto::tls::TlsFiles> {
        let abs = |p: &Option<PathBuf>| -> Result<Option<PathBuf>> {
            p.as_ref()
                .map(|p| {
                    std::path::absolute(p).with_context(|| format!("resolving {}", p.display()))
                })
                .transpose()
        };
        Ok(tutor_proto::tls::TlsFiles {
            cert: abs(&self.cert)?,
            key: abs(&self.key)?,
            ca: abs(&self.ca)?,
        })
    }
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
    /// Toy tasks: plant bugs in this many of the bank's templates only (spread over the
    /// themes; unset: all of them). A short run from scratch learns a few kinds of fix
    /// well rather than many badly (docs/toy-world.md).
    pub toy_templates: Option<usize>,
    /// Toy tasks: name packages from this many names of the pool only (unset: all 40,
    /// some with a digit suffix).
    pub toy_packages: Option<usize>,
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
            toy_templates: None,
            toy_packages: None,
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
    /// Share the input embedding with the output layer (as small Qwen3 models do): a
    /// token the student copies from its context (a file path in the issue) needs no
    /// output row of its own to be learned, so copying generalises to rare names.
    pub tie_word_embeddings: bool,
    /// Start from trained weights instead of a random student with a tokenizer trained on
    /// the tasks: a run directory (its latest version; BC → RFT → DAPO chains this way)
    /// or a Hugging Face model directory (config.json, tokenizer.json with its chat
    /// template, or the ChatML tokens without one, safetensors; any family Tutor
    /// implements). The size fields above are then unused.
    pub init_from: Option<PathBuf>,
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
            tie_word_embeddings: false,
            init_from: None,
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
        c.tie_word_embeddings = self.tie_word_embeddings;
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
                    // TUTOR_LEARNER__ENGINES="http://e0:30000,http://e1:30000"
                    .list_separator(",")
                    .with_list_parse_key("learner.engines")
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
        let merged = merged.resolved();
        merged
            .validate()
            .map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Ok((merged, text))
    }

    /// Fills what one section derives from another: a cosine schedule with `[learner]
    /// total_steps = 0` (or unset) decays over the most optimizer steps the run can take,
    /// `[coordinator] iterations × max_steps_per_iteration`, so changing the run's length
    /// keeps the decay ending with it. (An upper bound: an iteration with less data takes
    /// fewer steps, and the run then ends a little above the floor.)
    pub fn resolved(mut self) -> Self {
        let l = &mut self.learner;
        if l.schedule == tutor_learner::schedule::ScheduleKind::Cosine && l.total_steps == 0 {
            let c = &self.coordinator;
            l.total_steps = c.iterations as u64 * c.max_steps_per_iteration.max(1) as u64;
        }
        self
    }

    pub fn validate(&self) -> Result<()> {
        // Each section is checked by the crate that owns it; what spans two sections here.
        let c = &self.coordinator;
        c.validate()?;
        if c.algorithm == tutor_coordinator::config::Algorithm::Distill
            && self.worker.teacher.kind
                != tutor_rollout_worker::teacher::endpoint::TeacherKind::Endpoint
        {
            bail!(
                "coordinator.algorithm = \"distill\" needs a teacher that scores the student's \
                 tokens: [worker.teacher] kind = \"endpoint\" (a vLLM or `tutor serve` model \
                 sharing the student's tokenizer)"
            );
        }
        self.learner.validate()?;
        self.worker.validate()?;
        if let Some(k) = self.tasks.toy_templates {
            let n = tutor_rollout_worker::toy::template_count();
            if k == 0 || k > n {
                bail!(
                    "tasks.toy_templates must be between 1 and {n} (the toy bank's templates), \
                     got {k}"
                );
            }
        }
        if let Some(k) = self.tasks.toy_packages {
            let n = tutor_rollout_worker::toy::package_count();
            if k == 0 || k > n {
                bail!("tasks.toy_packages must be between 1 and {n} (the toy name pool), got {k}");
            }
        }
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
        if m.init_from.is_none() && m.vocab_size < 300 {
            bail!("model.vocab_size must be at least 300 (256 bytes + special tokens + merges)");
        }
        let t = &self.tls;
        if t.cert.is_some() != t.key.is_some() {
            bail!("tls.cert and tls.key go together: give both or neither");
        }
        if t.cert.is_some() && t.ca.is_none() {
            bail!("tls.ca is required with tls.cert: every process verifies its peers with it");
        }
        if t.ca.is_some() && t.cert.is_none() {
            bail!("tls.ca needs tls.cert and tls.key: the learner and the coordinator serve with them");
        }
        if self.tasks.source == TaskSource::File && self.tasks.train_path.is_none() {
            bail!("tasks.train_path is required when tasks.source = \"file\"");
        }
        self.learner_engines()?;
        Ok(())
    }

    /// The student engines the learner loads each version into: `[learner] engines`, or,
    /// when there are none and `[worker.student] loaded_by = "learner"`, the workers'
    /// `base_url`. Each is `[worker.student]` with its url and the learner's group address
    /// (`engine_group_listen`, `engine_group_address`) in place of the worker's.
    pub fn learner_engines(
        &self,
    ) -> Result<Vec<tutor_rollout_worker::student_engine::StudentConfig>> {
        use tutor_rollout_worker::student_engine::{
            checked_base_url, checked_group_listen, LoadedBy, ReloadKind, StudentKind,
        };
        let (s, l) = (&self.worker.student, &self.learner);
        let learner_loads = s.loaded_by == LoadedBy::Learner;
        if learner_loads && s.kind != StudentKind::Engine {
            bail!(
                "worker.student.loaded_by = \"learner\" is for an external student engine \
                 (worker.student.kind = \"engine\"): the workers' in-process engines get each \
                 version from the learner already"
            );
        }
        if !l.engines.is_empty() && !learner_loads {
            bail!(
                "learner.engines names engines for the learner to load, but \
                 worker.student.loaded_by is \"worker\": set it to \"learner\" (else workers \
                 and the learner would both load versions into them)"
            );
        }
        if learner_loads
            && self.worker.weights_from == tutor_rollout_worker::worker::WeightsFrom::Broadcast
        {
            bail!(
                "worker.weights_from = \"broadcast\" with worker.student.loaded_by = \
                 \"learner\": the workers never load a version, so none should be sent to \
                 them (leave weights_from at \"grpc\")"
            );
        }
        for (i, url) in l.engines.iter().enumerate() {
            checked_base_url(url, &format!("learner.engines[{i}]"))?;
        }
        let urls = if !l.engines.is_empty() {
            l.engines.clone()
        } else if learner_loads {
            vec![s.base_url.clone()]
        } else {
            return Ok(Vec::new());
        };
        if s.reload == ReloadKind::Distributed {
            let listen = checked_group_listen(
                &l.engine_group_listen,
                l.engine_group_address.as_deref(),
                (
                    "learner.engine_group_listen",
                    "learner.engine_group_address",
                ),
            )?;
            if listen.port() != 0 && urls.len() > 1 {
                bail!(
                    "learner.engine_group_listen = {:?}: the learner forms a group with each of \
                     its {} engines at once, which cannot share one port: give port 0",
                    l.engine_group_listen,
                    urls.len()
                );
            }
        }
        Ok(urls
            .into_iter()
            .map(
                |base_url| tutor_rollout_worker::student_engine::StudentConfig {
                    base_url,
                    group_listen: l.engine_group_listen.clone(),
                    group_address: l.engine_group_address.clone(),
                    ..s.clone()
                },
            )
            .collect())
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

    /// `[learner] engines` and `[worker.student] loaded_by = "learner"`: the engines the
    /// learner loads, each a `[worker.student]` with its url and the learner's group
    /// address; settings that cannot work are refused naming the field.
    #[test]
    fn the_learners_engines_follow_the_student_settings_and_are_checked() {
        let student = "[worker.student]\nkind = \"engine\"\nbase_url = \"http://e0:30000\"\n\
                       api = \"vllm\"\nreload = \"distributed\"\n";
        // Workers load (the default): the learner loads nothing.
        let (_d, p) = write(student);
        assert!(RunConfig::load(&p)
            .unwrap()
            .0
            .learner_engines()
            .unwrap()
            .is_empty());
        // loaded_by = "learner": the workers' engine by default.
        let (_d, p) = write(&format!(
            "{student}loaded_by = \"learner\"\n[learner]\nengine_group_listen = \
             \"10.0.0.5:0\"\n"
        ));
        let engines = RunConfig::load(&p).unwrap().0.learner_engines().unwrap();
        assert_eq!(engines.len(), 1);
        let e = &engines[0];
        assert_eq!(
            (e.base_url.as_str(), e.group_listen.as_str()),
            ("http://e0:30000", "10.0.0.5:0")
        );
        assert_eq!(e.api, tutor_rollout_worker::student_engine::EngineApi::Vllm);
        // Or every engine named.
        let (_d, p) = write(&format!(
            "{student}loaded_by = \"learner\"\n[learner]\nengines = [\"http://e0:30000\", \
             \"http://e1:30000\"]\n"
        ));
        let engines = RunConfig::load(&p).unwrap().0.learner_engines().unwrap();
        assert_eq!(engines[1].base_url, "http://e1:30000");
        for (text, key) in [
            (
                "[worker.student]\nloaded_by = \"learner\"\n".to_string(),
                "worker.student.loaded_by",
            ),
            (
                format!("{student}loaded_by = \"learner\"\n[learner]\nengines = [\"e1:30000\"]\n"),
                "learner.engines[0]",
            ),
            (
                format!(
                    "{student}loaded_by = \"learner\"\n[learner]\nengines = \
                     [\"http://e1:30000/v1\"]\n"
                ),
                "learner.engines[0]",
            ),
            (
                format!("{student}[learner]\nengines = [\"http://e1:30000\"]\n"),
                "worker.student.loaded_by",
            ),
            (
                format!(
                    "[worker]\nweights_from = \"broadcast\"\n{student}loaded_by = \"learner\"\n"
                ),
                "worker.weights_from",
            ),
            (
                format!(
                    "{student}loaded_by = \"learner\"\n[learner]\nengines = [\"http://e0:1\", \
                     \"http://e1:1\"]\nengine_group_listen = \"10.0.0.5:7400\"\n"
                ),
                "give port 0",
            ),
            (
                format!(
                    "{student}loaded_by = \"learner\"\n[learner]\nengine_group_listen = \
                     \"0.0.0.0:0\"\n"
                ),
                "learner.engine_group_address",
            ),
            (
                format!(
                    "{student}loaded_by = \"learner\"\n[learner]\nengine_group_listen = \
                     \"learner:0\"\n"
                ),
                "learner.engine_group_listen",
            ),
        ] {
            let (_d, p) = write(&text);
            let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
            assert!(e.contains(key), "{key}: {e}");
        }
    }

    #[test]
    fn container_ulimits_are_worker_settings_and_are_checked() {
        let (_d, p) = write("[worker]\nnofile = 256\nfsize_mb = 8\n");
        let w = RunConfig::load(&p).unwrap().0.worker;
        assert_eq!((w.nofile, w.fsize_mb), (256, 8));
        for (text, key) in [
            ("[worker]\nnofile = 3\n", "worker.nofile"),
            ("[worker]\nfsize_mb = 0\n", "worker.fsize_mb"),
        ] {
            let (_d, p) = write(text);
            let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
            assert!(e.contains(key) && e.contains("run.toml"), "{e}");
        }
    }

    #[test]
    fn presets_load_with_their_algorithm_and_the_paper_settings() {
        use tutor_coordinator::Algorithm;
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let load = |name: &str| RunConfig::load(&dir.join(name)).unwrap().0;
        assert_eq!(
            load("quickstart.toml").coordinator.algorithm,
            Algorithm::Dagger
        );
        let bc = load("bc.toml").coordinator;
        assert_eq!(bc.algorithm, Algorithm::Bc);
        assert!(bc.bc_resolved_only);
        assert_eq!(bc.beta_at(3, 4), 1.0);
        let rft = load("rft.toml").coordinator;
        assert_eq!((rft.algorithm, rft.beta_at(0, 3)), (Algorithm::Rft, 0.0));
        let dapo = load("dapo.toml");
        assert_eq!(dapo.coordinator.algorithm, Algorithm::Dapo);
        assert!(dapo.coordinator.samples_unbiased());
        assert_eq!(
            (dapo.learner.clip_eps_low, dapo.learner.clip_eps_high),
            (0.2, 0.28)
        );
        let distill = load("distill.toml");
        assert_eq!(distill.coordinator.algorithm, Algorithm::Distill);
        assert!(distill.coordinator.samples_unbiased());
        assert!(!distill.coordinator.aggregates(), "on-policy");
        // Distillation without a teacher that can score tokens is refused up front.
        let text = std::fs::read_to_string(dir.join("distill.toml"))
            .unwrap()
            .replace("kind = \"endpoint\"", "kind = \"oracle\"");
        let (_d, oracle) = write(&text);
        let e = RunConfig::load(&oracle).unwrap_err().to_string();
        assert!(e.contains("distill") && e.contains("endpoint"), "{e}");
        // The paper-scale config: the DAgger paper's Qwen3-4B student on a node of 8
        // H200s (its plan is checked in plan::tests).
        let paper = load("paper-scale.toml");
        let c = &paper.coordinator;
        assert_eq!(c.algorithm, Algorithm::Dagger);
        assert_eq!(c.max_seq_len, 32768);
        let l = &paper.learner;
        assert_eq!(l.device(0), Ok(tch::Device::Cuda(0)));
        assert_eq!((l.world_size, l.gpu_memory_gib), (8, 140.0));
        assert!(l.checkpoint_activations);
        assert_eq!(
            paper.model.init_from.as_deref(),
            Some(Path::new("models/Qwen3-4B"))
        );
    }

    #[test]
    fn algorithm_settings_are_validated() {
        let (_d, p) = write("[coordinator]\nalgorithm = \"dapo\"\ngroup_size = 1\n");
        let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
        assert!(e.contains("group_size"), "{e}");
        let (_d, p) = write("[coordinator]\nalgorithm = \"ppo\"\n");
        let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
        assert!(e.contains("ppo") && e.contains("line 2"), "{e}");
    }

    #[test]
    fn tls_section_needs_all_three_files() {
        let (_d, p) = write("[tls]\ncert = \"a.crt\"\nkey = \"a.key\"\n");
        let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
        assert!(e.contains("run.toml") && e.contains("tls.ca"), "{e}");
        let (_d, p) = write("[tls]\ncert = \"a.crt\"\nca = \"ca.crt\"\n");
        let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
        assert!(e.contains("tls.key"), "{e}");
        let (_d, p) = write("[tls]\ncert = \"a.crt\"\nkey = \"a.key\"\nca = \"ca.crt\"\n");
        let (c, _) = RunConfig::load(&p).unwrap();
        let files = c.tls.files().unwrap();
        assert!(files.cert.unwrap().is_absolute() && files.ca.unwrap().ends_with("ca.crt"));
        let (_d, p) = write("[tls]\ncertificate = \"a.crt\"\n");
        let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
        assert!(e.contains("certificate") && e.contains("line 2"), "{e}");
    }

    #[test]
    fn a_cosine_without_total_steps_decays_over_the_runs_longest_length() {
        let (_d, p) = write(
            "[coordinator]\niterations = 8\nmax_steps_per_iteration = 150\n\
             [learner]\nschedule = \"cosine\"\nwarmup_steps = 20\n",
        );
        let (c, _) = RunConfig::load(&p).unwrap();
        assert_eq!(c.learner.total_steps, 1200);
        // Given, it is kept; the constant schedule does not use it and is left alone.
        let (_d, p) = write("[learner]\nschedule = \"cosine\"\ntotal_steps = 700\n");
        assert_eq!(RunConfig::load(&p).unwrap().0.learner.total_steps, 700);
        let (_d, p) = write("[coordinator]\niterations = 8\n");
        assert_eq!(RunConfig::load(&p).unwrap().0.learner.total_steps, 0);
        // Too short a run for its warmup is still refused, naming the field.
        let (_d, p) = write(
            "[coordinator]\niterations = 1\nmax_steps_per_iteration = 10\n\
             [learner]\nschedule = \"cosine\"\nwarmup_steps = 20\n",
        );
        let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
        assert!(e.contains("total_steps"), "{e}");
    }

    #[test]
    fn defaults_and_validation() {
        let (_d, p) = write("");
        let (c, _) = RunConfig::load(&p).unwrap();
        assert_eq!(c.run.workers, 2);
        let (_d, p) =
            write("[learner]\nschedule = \"cosine\"\nwarmup_steps = 10\ntotal_steps = 10\n");
        let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
        assert!(e.contains("total_steps"), "{e}");
        let (_d, p) = write("[coordinator]\niterations = 0\n");
        let e = format!("{:#}", RunConfig::load(&p).unwrap_err());
        assert!(e.contains("coordinator.iterations"), "{e}");
    }
}
