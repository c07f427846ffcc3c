//! Preparing a run directory: the config copy, the task files, the tokenizer trained on
//! the task corpus and the student's config.json. Everything is validated before the
//! directory is created, so a bad input leaves nothing behind.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use tutor_policy::{ChatTokenizer, ModelConfig};
use tutor_rollout_worker::episode::DEFAULT_SYSTEM_PROMPT;
use tutor_rollout_worker::tasks::{load_tasks, write_tasks, TaskRecord};

use crate::config::{RunConfig, TaskSource};

pub struct PreparedRun {
    pub dir: PathBuf,
    pub model_dir: PathBuf,
    pub train_tasks: PathBuf,
    pub heldout_tasks: PathBuf,
    pub config_path: PathBuf,
    pub n_train: usize,
    pub n_heldout: usize,
    pub parameters: usize,
}

/// Loads or generates the tasks of a run: (train, held-out), sharing no instance.
pub fn tasks_for(config: &RunConfig) -> Result<(Vec<TaskRecord>, Vec<TaskRecord>)> {
    let t = &config.tasks;
    match t.source {
        TaskSource::Toy => {
            let all = tutor_rollout_worker::toy::generate_with(
                t.toy_train + t.toy_heldout,
                t.seed,
                tutor_rollout_worker::toy::ToyOptions {
                    templates: t.toy_templates,
                    packages: t.toy_packages,
                },
            );
            let frac = t.toy_heldout as f64 / (t.toy_train + t.toy_heldout).max(1) as f64;
            Ok(tutor_rollout_worker::toy::split(all, frac))
        }
        TaskSource::File => {
            let train_path = t.train_path.as_ref().expect("validated");
            let train = load_tasks(train_path)?;
            let heldout = match &t.heldout_path {
                Some(p) => load_tasks(p)?,
                None => Vec::new(),
            };
            let train_ids: std::collections::HashSet<&str> =
                train.iter().map(|t| t.instance_id.as_str()).collect();
            if let Some(dup) = heldout
                .iter()
                .find(|h| train_ids.contains(h.instance_id.as_str()))
            {
                anyhow::bail!(
                    "task {} is in both the training and the held-out file",
                    dup.instance_id
                );
            }
            Ok((train, heldout))
        }
    }
}

/// The text the tokenizer learns its merges from: everything an episode will show.
fn corpus(tasks: &[TaskRecord]) -> Vec<String> {
    let mut c = vec![DEFAULT_SYSTEM_PROMPT.to_string()];
    for t in tasks {
        c.push(t.problem_statement.clone());
        c.push(t.patch.clone());
        c.push(t.test_patch.clone());
        for f in &t.files {
            c.push(f.content.clone());
            c.push(format!(
                "In {p}: I will open the file the issue names.\n\n```command\nopen {p}\n```\n[File: ~/repo/{p} (9 lines total)]\n1:{}\n(Current directory: ~/repo, current file: ~/repo/{p}) bash-$\nI will fix the wrong line.",
                f.content.lines().next().unwrap_or(""),
                p = f.path
            ));
        }
    }
    c.push("```command\npython -m pytest -q tests\n```\n```command\nsubmit\n```\nreplace 'x' 'y'\nReplaced 1 occurrence(s).\nsed -i 's/.*/x/' git checkout -- .".into());
    c
}

pub fn prepare(config: &RunConfig, config_text: &str) -> Result<PreparedRun> {
    let (train, heldout) = tasks_for(config)?;
    if train.is_empty() {
        anyhow::bail!("the run has no training tasks");
    }
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let mut dir = config
        .run
        .out_dir
        .join(format!("{}-{stamp}", config.run.name));
    let mut k = 1;
    while dir.exists() {
        dir = config
            .run
            .out_dir
            .join(format!("{}-{stamp}-{k}", config.run.name));
        k += 1;
    }
    let result = fill(config, config_text, &dir, &train, &heldout);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn fill(
    config: &RunConfig,
    config_text: &str,
    dir: &Path,
    train: &[TaskRecord],
    heldout: &[TaskRecord],
) -> Result<PreparedRun> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the run directory {}", dir.display()))?;
    let dir = dir.canonicalize()?;
    let config_path = dir.join("config.toml");
    std::fs::write(&config_path, config_text).context("writing the config copy")?;
    let tasks_dir = dir.join("tasks");
    std::fs::create_dir_all(&tasks_dir)?;
    let train_tasks = tasks_dir.join("train.jsonl");
    let heldout_tasks = tasks_dir.join("heldout.jsonl");
    write_tasks(&train_tasks, train)?;
    write_tasks(&heldout_tasks, heldout)?;

    let model_dir = dir.join("model");
    std::fs::create_dir_all(&model_dir)?;
    let parameters = match &config.model.init_from {
        Some(source) => {
            let said = crate::export::install_initial_model(source, &model_dir)?;
            tracing::info!(from = %said, "the student starts from trained weights");
            ModelConfig::load(&model_dir.join("config.json"))?.num_parameters()
        }
        None => {
            let all: Vec<TaskRecord> = train.iter().chain(heldout.iter()).cloned().collect();
            let tokenizer = ChatTokenizer::train(&corpus(&all), config.model.vocab_size)
                .context("training the tokenizer")?;
            tokenizer.save(&model_dir.join("tokenizer.json"))?;
            let mut mc = config.model.model_config(tokenizer.vocab_size());
            mc.eos_token_id = Some(tokenizer.im_end_id());
            mc.save(&model_dir.join("config.json"))?;
            mc.num_parameters()
        }
    };
    std::fs::create_dir_all(dir.join("logs"))?;
    Ok(PreparedRun {
        parameters,
        dir,
        model_dir,
        train_tasks,
        heldout_tasks,
        config_path,
        n_train: train.len(),
        n_heldout: heldout.len(),
    })
}

/// `tutor prepare`: prepares the run of `config` and prints the paths the roles take as
/// one JSON object.
pub fn prepare_and_print(config: &Path) -> Result<()> {
    let (cfg, text) = RunConfig::load(config)?;
    let p = prepare(&cfg, &text)?;
    let s = |p: &std::path::Path| p.display().to_string();
    let out = serde_json::json!({
        "run_dir": s(&p.dir),
        "config": s(&p.config_path),
        "model_dir": s(&p.model_dir),
        "train_tasks": s(&p.train_tasks),
        "heldout_tasks": s(&p.heldout_tasks),
        "learner_out_dir": s(&p.dir.join("learner")),
        "n_train": p.n_train,
        "n_heldout": p.n_heldout,
        "parameters": p.parameters,
    });
    println!("{out}");
    Ok(())
}
