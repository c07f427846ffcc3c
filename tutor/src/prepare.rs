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

#[derive(Debug)]
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

/// The file a finished preparation leaves in its run directory: the settings it was made
/// from (`[tasks]` and `[model]`, environment overrides applied, as TOML). Written last,
/// so a directory without it is a preparation that was cut off.
const PREPARED_MARK: &str = "prepared.toml";

/// What a preparation writes into its run directory (besides [`PREPARED_MARK`]): the
/// leftovers of a cut-off one, which a new preparation may clear.
const PREPARED_ENTRIES: [&str; 4] = ["config.toml", "tasks", "model", "logs"];

/// The settings the prepared files depend on: tasks (which, how many, the seed) and the
/// model (its size, or the checkpoint it starts from). Comments, the other sections and
/// how the file is laid out do not change them.
fn preparation_key(config: &RunConfig) -> Result<String> {
    #[derive(serde::Serialize)]
    struct Key<'a> {
        tasks: &'a crate::config::TasksSection,
        model: &'a crate::config::ModelSection,
    }
    toml::to_string(&Key {
        tasks: &config.tasks,
        model: &config.model,
    })
    .context("writing the preparation's settings")
}

/// A name no other preparer picks (containers all run as PID 1).
fn unique_suffix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!("{}-{nanos}", std::process::id())
}

/// Prepares the run of `config` at exactly `dir` (containers and pods, where every role
/// must find the run at a path fixed in advance). Idempotent: when `dir` already holds a
/// finished preparation made with the same `[tasks]` and `[model]` settings it is used as
/// it is (a restarted init container changes nothing, and a changed `[coordinator]` or a
/// new comment does not stop it); with other settings, it is an error that names the
/// file. The files are made in a staging folder and moved into place with the mark
/// last, so a cut-off preparation is never taken for a finished one, and the next
/// preparation clears what it left. `dir` may be an empty mount point (`lost+found`
/// aside). Preparing is deterministic (tasks from the seed, the tokenizer from the tasks),
/// so pods that each prepare their own copy from the same config agree on every file.
pub fn prepare_at(config: &RunConfig, config_text: &str, dir: &Path) -> Result<PreparedRun> {
    let key = preparation_key(config)?;
    let mark = dir.join(PREPARED_MARK);
    if mark.exists() {
        return reuse(dir, &mark, &key);
    }
    let mut stale_staging = Vec::new();
    if dir.exists() {
        // Only an empty directory, or the leftovers of a cut-off preparation, may be
        // written into.
        for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let entry = entry?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(".preparing-") {
                stale_staging.push(entry.path());
            } else if !(PREPARED_ENTRIES.contains(&name.as_ref()) || name == "lost+found") {
                anyhow::bail!(
                    "{} is not empty ({name} is there) and holds no finished preparation \
                     ({PREPARED_MARK} is missing): refusing to write into it",
                    dir.display()
                );
            }
        }
    }
    let (train, heldout) = tasks_for(config)?;
    if train.is_empty() {
        anyhow::bail!("the run has no training tasks");
    }
    let suffix = unique_suffix();
    if dir.exists() {
        // The staging folders of cut-off preparations.
        for path in stale_staging {
            let _ = std::fs::remove_dir_all(path);
        }
        // A mount point: stage inside it (a rename out of another filesystem fails).
        let staging = dir.join(format!(".preparing-{suffix}"));
        let filled = fill(config, config_text, &staging, &train, &heldout).and_then(|_| {
            for name in PREPARED_ENTRIES {
                let target = dir.join(name);
                if target.exists() {
                    std::fs::remove_dir_all(&target)
                        .or_else(|_| std::fs::remove_file(&target))
                        .with_context(|| format!("clearing {}", target.display()))?;
                }
                std::fs::rename(staging.join(name), &target)
                    .with_context(|| format!("moving {} into place", target.display()))?;
            }
            write_mark(dir, &key)
        });
        let _ = std::fs::remove_dir_all(&staging);
        filled?;
    } else {
        let name = dir
            .file_name()
            .with_context(|| format!("--run-dir {} has no final component", dir.display()))?;
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent)
            .with_context(|| format!("creating {}", parent.display()))?;
        let staging = parent.join(format!(".{}.preparing-{suffix}", name.to_string_lossy()));
        let filled = fill(config, config_text, &staging, &train, &heldout)
            .and_then(|_| write_mark(&staging, &key));
        if let Err(e) = filled {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
        if let Err(e) = std::fs::rename(&staging, dir) {
            let _ = std::fs::remove_dir_all(&staging);
            // Another preparer got there first: use its preparation if it matches.
            if mark.exists() {
                return reuse(dir, &mark, &key);
            }
            return Err(e).with_context(|| format!("moving the preparation to {}", dir.display()));
        }
    }
    reopen(dir)
}

/// Writes [`PREPARED_MARK`] into `dir` atomically (a temporary file renamed).
fn write_mark(dir: &Path, key: &str) -> Result<()> {
    let tmp = dir.join(format!(".{PREPARED_MARK}.{}", unique_suffix()));
    std::fs::write(&tmp, key).context("writing the preparation mark")?;
    std::fs::rename(&tmp, dir.join(PREPARED_MARK)).context("writing the preparation mark")
}

/// A finished preparation at `dir`, if it was made with the settings `key`.
fn reuse(dir: &Path, mark: &Path, key: &str) -> Result<PreparedRun> {
    let before =
        std::fs::read_to_string(mark).with_context(|| format!("reading {}", mark.display()))?;
    if before != key {
        anyhow::bail!(
            "{} was prepared with other [tasks] or [model] settings (they are in {}): use \
             another --run-dir, or delete that directory to start the run over",
            dir.display(),
            mark.display()
        );
    }
    tracing::info!(dir = %dir.display(), "the run directory is prepared already: using it");
    reopen(dir)
}

/// The paths of a finished preparation at `dir`.
fn reopen(dir: &Path) -> Result<PreparedRun> {
    let dir = dir
        .canonicalize()
        .with_context(|| format!("opening {}", dir.display()))?;
    let train_tasks = dir.join("tasks/train.jsonl");
    let heldout_tasks = dir.join("tasks/heldout.jsonl");
    let model_dir = dir.join("model");
    let count = |p: &Path| -> Result<usize> { Ok(load_tasks(p)?.len()) };
    let parameters = match ModelConfig::load(&model_dir.join("config.json")) {
        Ok(mc) => mc.num_parameters(),
        Err(e) => anyhow::bail!(
            "{}: the prepared model is unreadable: {e}",
            model_dir.join("config.json").display()
        ),
    };
    Ok(PreparedRun {
        parameters,
        n_train: count(&train_tasks)?,
        n_heldout: count(&heldout_tasks)?,
        config_path: dir.join("config.toml"),
        train_tasks,
        heldout_tasks,
        model_dir,
        dir,
    })
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
            mc.eos_token_id = Some(tokenizer.turn_end_id());
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

/// `tutor prepare`: prepares the run of `config` (under `[run] out_dir`, or at `run_dir`) and prints the paths the roles take as
/// one JSON object.
pub fn prepare_and_print(config: &Path, run_dir: Option<&Path>) -> Result<()> {
    let (cfg, text) = RunConfig::load(config)?;
    let p = match run_dir {
        Some(dir) => prepare_at(&cfg, &text, dir)?,
        None => prepare(&cfg, &text)?,
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = r#"
[run]
name = "prep"

[tasks]
source = "toy"
toy_train = 12
toy_heldout = 3
seed = 4

[model]
vocab_size = 400
"#;

    fn load(dir: &Path, text: &str) -> (RunConfig, String) {
        let path = dir.join("config.toml");
        std::fs::write(&path, text).unwrap();
        RunConfig::load(&path).unwrap()
    }

    /// Pods each prepare their own copy of the run (deploy/k8s): the copies must agree on
    /// every byte, or workers would tokenize with another vocabulary than the learner's.
    #[test]
    fn preparing_twice_from_one_config_gives_identical_files() {
        let tmp = tempfile::tempdir().unwrap();
        let (cfg, text) = load(tmp.path(), CONFIG);
        let a = prepare_at(&cfg, &text, &tmp.path().join("a/run")).unwrap();
        let b = prepare_at(&cfg, &text, &tmp.path().join("b/run")).unwrap();
        assert_eq!((a.n_train, a.n_heldout), (12, 3));
        for f in [
            "model/tokenizer.json",
            "model/config.json",
            "tasks/train.jsonl",
            "tasks/heldout.jsonl",
            "config.toml",
            PREPARED_MARK,
        ] {
            let x = std::fs::read(a.dir.join(f)).unwrap();
            let y = std::fs::read(b.dir.join(f)).unwrap();
            assert!(x == y, "{f} differs between two preparations of one config");
        }
        // Nothing but the run directory is left beside it (no staging folder).
        let beside: Vec<_> = std::fs::read_dir(tmp.path().join("a"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(beside, vec![std::ffi::OsString::from("run")]);
    }

    /// A restarted init container finds its run and changes nothing (also after an edit
    /// that leaves [tasks] and [model] alone); other [tasks] settings at the same path are
    /// refused naming the mark; a non-empty foreign directory is not written into; a
    /// volume's mount point is filled, clearing a cut-off preparation's leftovers.
    #[test]
    fn prepare_at_reuses_refuses_and_fills_mount_points() {
        let tmp = tempfile::tempdir().unwrap();
        let (cfg, text) = load(tmp.path(), CONFIG);
        let dir = tmp.path().join("run");
        prepare_at(&cfg, &text, &dir).unwrap();
        let tok = dir.join("model/tokenizer.json");
        let before = std::fs::metadata(&tok).unwrap().modified().unwrap();
        let again = prepare_at(&cfg, &text, &dir).unwrap();
        assert_eq!(again.n_train, 12);
        assert_eq!(
            std::fs::metadata(&tok).unwrap().modified().unwrap(),
            before,
            "a second preparation rewrote the tokenizer"
        );

        // A comment or another section changes nothing the preparation made.
        let edited = format!("# tuned\n{CONFIG}\n[coordinator]\niterations = 3\n");
        let (cfg3, text3) = load(tmp.path(), &edited);
        prepare_at(&cfg3, &text3, &dir).unwrap();

        let other = CONFIG.replace("seed = 4", "seed = 5");
        let (cfg2, text2) = load(tmp.path(), &other);
        let e = prepare_at(&cfg2, &text2, &dir).unwrap_err().to_string();
        assert!(
            e.contains("other [tasks] or [model] settings") && e.contains(PREPARED_MARK),
            "{e}"
        );

        let foreign = tmp.path().join("foreign");
        std::fs::create_dir_all(&foreign).unwrap();
        std::fs::write(foreign.join("notes.txt"), "mine").unwrap();
        let e = prepare_at(&cfg, &text, &foreign).unwrap_err().to_string();
        assert!(e.contains("not empty"), "{e}");
        assert_eq!(std::fs::read_dir(&foreign).unwrap().count(), 1);

        // A fresh volume (lost+found in it) holding the leftovers of a cut-off
        // preparation: cleared and prepared, nothing of the staging left.
        let mount = tmp.path().join("mount");
        std::fs::create_dir_all(mount.join("lost+found")).unwrap();
        std::fs::create_dir_all(mount.join("tasks")).unwrap();
        std::fs::write(mount.join("tasks/train.jsonl"), "half a line").unwrap();
        std::fs::create_dir_all(mount.join(".preparing-1-2/model")).unwrap();
        let p = prepare_at(&cfg, &text, &mount).unwrap();
        assert!(p.model_dir.join("tokenizer.json").exists());
        assert_eq!(p.n_train, 12);
        assert!(mount.join(PREPARED_MARK).exists());
        let mut left: Vec<String> = std::fs::read_dir(&mount)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                "config.toml",
                "logs",
                "lost+found",
                "model",
                PREPARED_MARK,
                "tasks"
            ]
        );
    }
}
