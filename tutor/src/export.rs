//! Models in and out of runs: `tutor export` writes a run's policy version as a Hugging
//! Face model directory (transformers' `from_pretrained`, vLLM and `tutor serve` load it
//! unchanged), and `[model] init_from` starts a run from such a directory or from an
//! earlier run's last version (BC → RFT → DAPO, as the papers chain them).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::json;
use tch::Device;
use tutor_policy::{ChatTokenizer, ModelConfig, Policy, ENDOFTEXT, HF_EXTRAS, IM_END};

/// Where `tutor learner` (and so `tutor run`) publishes versions inside a run directory.
const VERSIONS: &str = "learner/versions";
const CONFIG: &str = "config.json";
const TOKENIZER: &str = "tokenizer.json";

/// The ChatML template the built-in rendering follows (`ChatTokenizer::render_chat`):
/// transformers' `apply_chat_template` with it gives the same text.
const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// What an export wrote.
#[derive(Debug)]
pub struct Exported {
    pub version: u64,
    pub parameters: usize,
    pub out: PathBuf,
}

/// The policy versions a run directory holds: version → weights file.
pub fn run_versions(run_dir: &Path) -> Result<BTreeMap<u64, PathBuf>> {
    let dir = run_dir.join(VERSIONS);
    let entries = std::fs::read_dir(&dir).with_context(|| {
        format!(
            "{} has no published versions ({} cannot be read): is it a run directory written \
             by `tutor run`?",
            run_dir.display(),
            dir.display()
        )
    })?;
    let mut out = BTreeMap::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(v) = name
            .strip_prefix("policy-v")
            .and_then(|s| s.strip_suffix(".safetensors"))
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        out.insert(v, e.path());
    }
    if out.is_empty() {
        bail!("{} holds no policy-v*.safetensors", dir.display());
    }
    Ok(out)
}

/// Whether `dir` looks like a run directory (its config copy and student model dir).
pub fn is_run_dir(dir: &Path) -> bool {
    dir.join("config.toml").is_file() && dir.join("model").join(CONFIG).is_file()
}

/// Writes version `version` (default: the latest) of the run in `run_dir` to `out` as a
/// Hugging Face model directory: config.json, model.safetensors, tokenizer.json, and a
/// tokenizer_config.json with the chat template the run used. `out` must not exist or
/// be empty; nothing is left there when it fails.
pub fn export_version(run_dir: &Path, version: Option<u64>, out: &Path) -> Result<Exported> {
    let versions = run_versions(run_dir)?;
    let (version, weights) = match version {
        Some(v) => {
            let w = versions.get(&v).with_context(|| {
                format!(
                    "{} has no version {v}; it has {:?}",
                    run_dir.display(),
                    versions.keys().collect::<Vec<_>>()
                )
            })?;
            (v, w.clone())
        }
        None => {
            let (v, w) = versions.iter().next_back().expect("not empty");
            (*v, w.clone())
        }
    };
    ensure_empty(out)?;
    let result = write_export(&run_dir.join("model"), &weights, out);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(out);
    }
    let parameters = result?;
    Ok(Exported {
        version,
        parameters,
        out: out.to_path_buf(),
    })
}

fn ensure_empty(out: &Path) -> Result<()> {
    if out.exists() {
        let mut entries = std::fs::read_dir(out)
            .with_context(|| format!("{} exists and is not a directory", out.display()))?;
        if entries.next().is_some() {
            bail!(
                "{} exists and is not empty: choose another output directory or remove it",
                out.display()
            );
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))
}

fn write_export(model_dir: &Path, weights: &Path, out: &Path) -> Result<usize> {
    let config_path = model_dir.join(CONFIG);
    let config = ModelConfig::load(&config_path)?;
    let tokenizer_path = model_dir.join(TOKENIZER);
    let tokenizer = ChatTokenizer::from_dir(model_dir)?;
    // Loading checks every tensor's presence and shape against the config.
    let mut policy = Policy::new(config.clone(), Device::Cpu, 0);
    policy
        .load_weights(weights)
        .with_context(|| format!("loading {}", weights.display()))?;
    policy.save_dir(out)?;
    copy(&tokenizer_path, &out.join(TOKENIZER))?;
    for extra in HF_EXTRAS {
        let from = model_dir.join(extra);
        if from.is_file() {
            copy(&from, &out.join(extra))?;
        }
    }
    if tokenizer.template().is_none() {
        // The run rendered chats in the built-in ChatML (from_dir refuses a tokenizer
        // without its tokens and without a template): a directory transformers'
        // AutoTokenizer loads, rendering chats as the run did. A tokenizer_config.json
        // the model came with keeps its fields and gains the template.
        let config_path = out.join("tokenizer_config.json");
        let mut tokenizer_config = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .filter(|v| v.is_object())
                .with_context(|| format!("{}: not a JSON object", config_path.display()))?,
            Err(_) => json!({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": config.max_position_embeddings,
                "clean_up_tokenization_spaces": false,
            }),
        };
        let fields = tokenizer_config.as_object_mut().expect("an object");
        fields.insert("chat_template".into(), json!(CHATML_TEMPLATE));
        fields.entry("eos_token").or_insert(json!(IM_END));
        if tokenizer.token_id(ENDOFTEXT).is_some() {
            fields.entry("pad_token").or_insert(json!(ENDOFTEXT));
        }
        write_json(&config_path, &tokenizer_config)?;
        if !out.join("generation_config.json").is_file() {
            let generation = json!({
                "eos_token_id": tokenizer.turn_end_id(),
                "pad_token_id": tokenizer.token_id(ENDOFTEXT),
            });
            write_json(&out.join("generation_config.json"), &generation)?;
        }
    }
    Ok(config.num_parameters())
}

/// Fills `model_dir` (a new run's student directory) from `source`: a run directory (its
/// latest version is exported) or a Hugging Face model directory (config.json,
/// tokenizer.json and the weights are copied). Returns a line saying what was used.
pub fn install_initial_model(source: &Path, model_dir: &Path) -> Result<String> {
    if is_run_dir(source) {
        let e = export_version(source, None, model_dir)
            .with_context(|| format!("model.init_from = {}", source.display()))?;
        return Ok(format!(
            "version {} of the run {} ({} parameters)",
            e.version,
            source.display(),
            e.parameters
        ));
    }
    if !source.join(CONFIG).is_file() {
        bail!(
            "model.init_from = {}: neither a run directory (config.toml and model/) nor a \
             Hugging Face model directory (config.json)",
            source.display()
        );
    }
    let config = ModelConfig::load(&source.join(CONFIG))
        .with_context(|| format!("model.init_from = {}", source.display()))?;
    // The tokenizer and its chat format: the directory's template (any model family) or,
    // without one, ChatML's tokens.
    let tokenizer = ChatTokenizer::from_dir(source).with_context(|| {
        format!(
            "model.init_from = {}: the student's tokenizer.json must load, with a chat \
             template (chat_template.jinja or tokenizer_config.json's chat_template) or the \
             ChatML tokens <|im_start|> and {IM_END}",
            source.display()
        )
    })?;
    if tokenizer.vocab_size() > config.vocab_size {
        bail!(
            "model.init_from = {}: tokenizer.json has {} ids but config.json's vocab_size is {}",
            source.display(),
            tokenizer.vocab_size(),
            config.vocab_size
        );
    }
    let weights = weight_files(source)?;
    ensure_empty(model_dir)?;
    let result = (|| -> Result<()> {
        copy(&source.join(CONFIG), &model_dir.join(CONFIG))?;
        copy(&source.join(TOKENIZER), &model_dir.join(TOKENIZER))?;
        for extra in HF_EXTRAS {
            let from = source.join(extra);
            if from.is_file() {
                copy(&from, &model_dir.join(extra))?;
            }
        }
        for w in &weights {
            let name = w.file_name().expect("a file");
            link_or_copy(w, &model_dir.join(name))?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(model_dir);
    }
    result?;
    Ok(format!(
        "the model directory {} ({} parameters)",
        source.display(),
        config.num_parameters()
    ))
}

/// `model.safetensors`, or the index and every shard it names (which must exist).
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let files = tutor_policy::weight_files(dir)?;
    let index = dir.join(tutor_policy::INDEX_FILE);
    if !index.is_file() {
        return Ok(files);
    }
    for f in &files {
        if !f.is_file() {
            let name = f.file_name().unwrap_or_default().to_string_lossy();
            bail!("{}: shard {name} is missing", index.display());
        }
    }
    Ok(std::iter::once(index).chain(files).collect())
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .map(|_| ())
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))
}

/// A hard link where the file system allows (weights can be large), else a copy.
fn link_or_copy(from: &Path, to: &Path) -> Result<()> {
    if std::fs::hard_link(from, to).is_ok() {
        return Ok(());
    }
    copy(from, to)
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).expect("json");
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run directory as `tutor run` leaves it: model/ (config, tokenizer) and two
    /// published versions with different weights.
    fn fake_run(dir: &Path) -> (Policy, Policy) {
        let model = dir.join("model");
        std::fs::create_dir_all(&model).unwrap();
        std::fs::write(dir.join("config.toml"), "").unwrap();
        let corpus: Vec<String> = (0..50)
            .map(|i| format!("def f{i}(x):\n    return x + {i}\n"))
            .collect();
        let tok = ChatTokenizer::train(&corpus, 320).unwrap();
        tok.save(&model.join(TOKENIZER)).unwrap();
        let mut mc = ModelConfig::tiny(tok.vocab_size());
        mc.eos_token_id = Some(tok.turn_end_id());
        mc.save(&model.join(CONFIG)).unwrap();
        let versions = dir.join(VERSIONS);
        let v0 = Policy::new(mc.clone(), Device::Cpu, 1);
        let v1 = Policy::new(mc, Device::Cpu, 2);
        v0.save_weights(&versions.join("policy-v000000.safetensors"))
            .unwrap();
        v1.save_weights(&versions.join("policy-v000001.safetensors"))
            .unwrap();
        (v0, v1)
    }

    fn same_weights(a: &Policy, b: &Policy) -> bool {
        let mut va = a.var_store().variables().into_iter().collect::<Vec<_>>();
        let vb = b.var_store().variables();
        va.sort_by(|x, y| x.0.cmp(&y.0));
        va.iter().all(|(n, t)| vb[n].equal(t))
    }

    #[test]
    fn export_writes_a_loadable_directory_of_the_chosen_version() {
        let d = tempfile::tempdir().unwrap();
        let run = d.path().join("run");
        let (v0, v1) = fake_run(&run);
        let out = d.path().join("latest");
        let e = export_version(&run, None, &out).unwrap();
        assert_eq!(e.version, 1);
        let loaded = Policy::load_dir(&out, Device::Cpu).unwrap();
        assert!(same_weights(&loaded, &v1));
        assert!(!same_weights(&loaded, &v0));
        ChatTokenizer::from_file(&out.join(TOKENIZER)).unwrap();
        let tc: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(tc["eos_token"], IM_END);

        let first = d.path().join("first");
        export_version(&run, Some(0), &first).unwrap();
        assert!(same_weights(
            &Policy::load_dir(&first, Device::Cpu).unwrap(),
            &v0
        ));
    }

    #[test]
    fn export_errors_name_what_is_wrong_and_leave_nothing() {
        let d = tempfile::tempdir().unwrap();
        let run = d.path().join("run");
        fake_run(&run);
        let out = d.path().join("out");
        let e = export_version(&run, Some(7), &out).unwrap_err().to_string();
        assert!(e.contains("no version 7") && e.contains("[0, 1]"), "{e}");
        // A non-empty output directory is never overwritten.
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join("keep.txt"), "mine").unwrap();
        let e = export_version(&run, None, &out).unwrap_err().to_string();
        assert!(e.contains("not empty"), "{e}");
        assert_eq!(
            std::fs::read_to_string(out.join("keep.txt")).unwrap(),
            "mine"
        );
        // Weights that do not fit the config: the error names the tensor, no output left.
        let bad = run.join(VERSIONS).join("policy-v000002.safetensors");
        let other = {
            let mut mc = ModelConfig::tiny(400);
            mc.hidden_size = 32;
            mc.head_dim = 16;
            Policy::new(mc, Device::Cpu, 3)
        };
        other.save_weights(&bad).unwrap();
        let fresh = d.path().join("fresh");
        let e = format!("{:#}", export_version(&run, None, &fresh).unwrap_err());
        assert!(e.contains("policy-v000002"), "{e}");
        assert!(!fresh.exists());
        let e = export_version(&d.path().join("nowhere"), None, &fresh)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no published versions"), "{e}");
    }

    #[test]
    fn init_from_takes_a_run_or_a_model_directory() {
        let d = tempfile::tempdir().unwrap();
        let run = d.path().join("run");
        let (_, v1) = fake_run(&run);
        let a = d.path().join("a");
        let said = install_initial_model(&run, &a).unwrap();
        assert!(said.contains("version 1"), "{said}");
        assert!(same_weights(
            &Policy::load_dir(&a, Device::Cpu).unwrap(),
            &v1
        ));
        // A Hugging Face directory (here the export) is copied with its tokenizer files.
        let b = d.path().join("b");
        install_initial_model(&a, &b).unwrap();
        assert!(same_weights(
            &Policy::load_dir(&b, Device::Cpu).unwrap(),
            &v1
        ));
        assert!(b.join("tokenizer_config.json").is_file());
        // Neither: the error says what was expected.
        let e = install_initial_model(d.path(), &d.path().join("c"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("neither a run directory"), "{e}");
        // A model directory with a missing shard.
        let sharded = d.path().join("sharded");
        std::fs::create_dir_all(&sharded).unwrap();
        std::fs::copy(a.join(CONFIG), sharded.join(CONFIG)).unwrap();
        std::fs::copy(a.join(TOKENIZER), sharded.join(TOKENIZER)).unwrap();
        std::fs::write(
            sharded.join("model.safetensors.index.json"),
            r#"{"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let e = install_initial_model(&sharded, &d.path().join("e"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model-00001-of-00002.safetensors is missing"),
            "{e}"
        );
    }
}
