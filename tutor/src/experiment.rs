//! `tutor experiment`: arms × seeds of training runs, one `tutor run` child after the
//! other, and the tables they make (results.json, RESULTS.md). The experiment file and
//! its merge over a base run config live here too; both are checked whole before any run
//! starts.
//!
//! Past 800 lines because it is one command's three parts, in this order: the file and
//! its merge (`Experiment::load`), the tables (`arm_table`, `results_markdown`), and the
//! runs (`Runner`, `run`); each is short, and the unit tests sit at the end.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tokio::process::Command;
use tokio::sync::watch;

use crate::config::RunConfig;
use crate::logging::LogFormat;

#[derive(clap::Args)]
pub struct ExperimentArgs {
    /// Experiment file (TOML): a base run config, seeds and arms; see
    /// configs/experiments/dagger-vs-bc.toml and docs/experiments.md.
    pub file: PathBuf,
    /// Put the experiment directory here instead of under `[experiment] out_dir`.
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
}

// ---- The experiment file.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileToml {
    experiment: ExperimentToml,
    #[serde(default)]
    arm: Vec<ArmToml>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExperimentToml {
    name: String,
    base: PathBuf,
    #[serde(default = "default_seeds")]
    seeds: Vec<u64>,
    #[serde(default = "default_out_dir")]
    out_dir: PathBuf,
    results_doc: Option<PathBuf>,
    /// Overrides every arm starts from (then its own `set`).
    #[serde(default)]
    set: toml::Table,
}

fn default_seeds() -> Vec<u64> {
    vec![0]
}

fn default_out_dir() -> PathBuf {
    "runs/experiments".into()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ArmToml {
    name: String,
    init_from: Option<String>,
    #[serde(default)]
    set: toml::Table,
}

/// One arm: a run config (base + overrides), optionally started from another arm's
/// final weights.
pub struct Arm {
    pub name: String,
    /// Index of the arm whose run (same seed) this arm starts from; always earlier.
    pub init_from: Option<usize>,
}

/// One run of the experiment: an arm under one seed, its config merged and checked.
pub struct PlannedRun {
    pub arm: usize,
    pub seed: u64,
    /// The merged run config, less run.name/out_dir and model.init_from (set at run time).
    config: toml::Table,
    iterations: u32,
}

/// A loaded, checked experiment file.
pub struct Experiment {
    pub file: PathBuf,
    pub text: String,
    pub name: String,
    pub seeds: Vec<u64>,
    pub out_dir: PathBuf,
    pub results_doc: Option<PathBuf>,
    pub arms: Vec<Arm>,
    /// Every run in the order they run: seeds outer, arms in file order inner (so an arm
    /// always runs after the arm it starts from).
    pub runs: Vec<PlannedRun>,
}

/// Keys the experiment sets itself in every run config.
const MANAGED: [(&str, &str); 4] = [
    ("run.name", "every run is named <arm>-s<seed>"),
    ("run.out_dir", "runs go under the experiment directory"),
    ("coordinator.seed", "it comes from [experiment] seeds"),
    ("learner.seed", "it comes from [experiment] seeds"),
];

fn check_name(file: &Path, what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.');
    if !ok {
        bail!(
            "{}: {what} {name:?} must be a non-empty file name of letters, digits, '-', '_' \
             and '.' (it names directories)",
            file.display()
        );
    }
    Ok(())
}

/// A `set` table as (dotted key, value) leaves. Nested tables are walked key by key, so
/// `"coordinator.beta" = { start = 0.5 }` and `"coordinator.beta.start" = 0.5` agree:
/// both change one field of the base and keep the others.
fn leaves(prefix: &str, table: &toml::Table, out: &mut Vec<(String, toml::Value)>) {
    for (k, v) in table {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            toml::Value::Table(t) => leaves(&key, t, out),
            v => out.push((key, v.clone())),
        }
    }
}

/// Sets `key` (dotted: `section.field`, `coordinator.beta.kind`) in `config`, creating
/// the sections it names.
fn set_key(config: &mut toml::Table, key: &str, value: toml::Value) -> Result<()> {
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        bail!("{key:?} is not a dotted key such as \"coordinator.iterations\"");
    }
    let (last, sections) = parts.split_last().expect("split gives at least one part");
    let mut table = config;
    for (i, part) in sections.iter().enumerate() {
        let entry = table
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = match entry {
            toml::Value::Table(t) => t,
            _ => bail!(
                "{} is a value in the run config, not a section",
                parts[..=i].join(".")
            ),
        };
    }
    table.insert(last.to_string(), value);
    Ok(())
}

fn parse_run_config(config: &toml::Table) -> Result<RunConfig> {
    toml::Value::Table(config.clone())
        .try_into::<RunConfig>()
        .map_err(|e| anyhow!("{}", e.to_string().trim_end()))
}

/// Applies `overrides` (named `origin` in errors) over `config`, one key at a time, so a
/// key the run config does not have is named in the error.
fn apply(
    file: &Path,
    origin: &str,
    config: &mut toml::Table,
    overrides: &[(String, toml::Value)],
) -> Result<()> {
    for (key, value) in overrides {
        if let Some((_, why)) = MANAGED.iter().find(|(k, _)| k == key) {
            bail!(
                "{}: {origin}: set {key:?}: the experiment sets this key itself ({why}); \
                 remove it",
                file.display()
            );
        }
        set_key(config, key, value.clone())
            .and_then(|_| parse_run_config(config).map(|_| ()))
            .map_err(|e| anyhow!("{}: {origin}: set {key:?} = {value}: {e}", file.display()))?;
    }
    Ok(())
}

impl Experiment {
    /// Reads and checks an experiment file: its fields, the arms (`init_from` naming an
    /// earlier arm), and every arm's run config merged over the base, as `tutor run`
    /// would check it. Errors name the file, and the arm and key where there is one.
    pub fn load(file: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("reading the experiment file {}", file.display()))?;
        let parsed: FileToml = toml::from_str(&text)
            .map_err(|e| anyhow!("{}: {}", file.display(), e.to_string().trim_end()))?;
        let e = parsed.experiment;
        check_name(file, "[experiment] name", &e.name)?;
        if e.seeds.is_empty() {
            bail!(
                "{}: [experiment] seeds is empty: give at least one",
                file.display()
            );
        }
        if let Some(s) = (1..e.seeds.len())
            .find_map(|i| e.seeds[..i].contains(&e.seeds[i]).then_some(e.seeds[i]))
        {
            bail!("{}: [experiment] seeds lists {s} twice", file.display());
        }
        if parsed.arm.is_empty() {
            bail!(
                "{}: no [[arm]]: add at least one ([[arm]] name = \"...\", set = {{ ... }})",
                file.display()
            );
        }
        let base_path = file.parent().unwrap_or(Path::new(".")).join(&e.base);
        let mut shared = read_base(file, &e.base, &base_path)?;
        let mut common = Vec::new();
        leaves("", &e.set, &mut common);
        apply(file, "[experiment]", &mut shared, &common)?;

        let mut arms: Vec<Arm> = Vec::new();
        let mut configs: Vec<toml::Table> = Vec::new();
        for a in &parsed.arm {
            check_name(file, "[[arm]] name", &a.name)?;
            if arms.iter().any(|b| b.name == a.name) {
                bail!("{}: two arms are named {:?}", file.display(), a.name);
            }
            let origin = format!("[[arm]] {:?}", a.name);
            let init_from = match &a.init_from {
                None => None,
                Some(src) => Some(earlier_arm(file, &origin, src, &arms, &parsed.arm)?),
            };
            let mut own = Vec::new();
            leaves("", &a.set, &mut own);
            if init_from.is_some() && own.iter().any(|(k, _)| k == "model.init_from") {
                bail!(
                    "{}: {origin}: give init_from (an arm) or set \"model.init_from\" (a \
                     directory), not both",
                    file.display()
                );
            }
            let mut config = shared.clone();
            apply(file, &origin, &mut config, &own)?;
            arms.push(Arm {
                name: a.name.clone(),
                init_from,
            });
            configs.push(config);
        }

        // Every (seed, arm) through the run config's own checks, the run directory an
        // init_from arm starts from stood in for.
        let mut runs = Vec::new();
        for &seed in &e.seeds {
            for (i, arm) in arms.iter().enumerate() {
                let mut config = configs[i].clone();
                let stand_in = arm
                    .init_from
                    .map(|src| format!("<the run directory of arm {}>", arms[src].name));
                fill_managed(&mut config, &arm.name, seed, Path::new("runs"), stand_in)?;
                let checked = parse_run_config(&config)
                    .map(RunConfig::resolved)
                    .and_then(|c| c.validate().map(|_| c))
                    .map_err(|err| {
                        anyhow!(
                            "{}: [[arm]] {:?} (merged over {}): {err:#}",
                            file.display(),
                            arm.name,
                            base_path.display()
                        )
                    })?;
                runs.push(PlannedRun {
                    arm: i,
                    seed,
                    config,
                    iterations: checked.coordinator.iterations,
                });
            }
        }
        Ok(Self {
            file: file.to_path_buf(),
            text,
            name: e.name,
            seeds: e.seeds,
            out_dir: e.out_dir,
            results_doc: e.results_doc,
            arms,
            runs,
        })
    }
}

/// The base run config as a table, checked strictly first for line-precise errors.
fn read_base(file: &Path, given: &Path, base_path: &Path) -> Result<toml::Table> {
    let text = std::fs::read_to_string(base_path).with_context(|| {
        format!(
            "{}: [experiment] base = {:?}: reading {} (the path is taken from the \
             experiment file's folder)",
            file.display(),
            given.display(),
            base_path.display()
        )
    })?;
    let at = |e: toml::de::Error| anyhow!("{}: {}", base_path.display(), e.to_string().trim_end());
    toml::from_str::<RunConfig>(&text).map_err(at)?;
    toml::from_str(&text).map_err(at)
}

/// The index of the arm `init_from` names, which must come before this one.
fn earlier_arm(
    file: &Path,
    origin: &str,
    src: &str,
    earlier: &[Arm],
    all: &[ArmToml],
) -> Result<usize> {
    if let Some(i) = earlier.iter().position(|b| b.name == src) {
        return Ok(i);
    }
    if all.iter().any(|b| b.name == src) {
        bail!(
            "{}: {origin}: init_from = {src:?} names an arm that comes later in the file (or \
             this arm itself): an arm starts from the final weights of an arm listed before \
             it; move [[arm]] {src:?} up",
            file.display()
        );
    }
    let names: Vec<&str> = all.iter().map(|b| b.name.as_str()).collect();
    bail!(
        "{}: {origin}: init_from = {src:?} names no arm (arms: {})",
        file.display(),
        names.join(", ")
    )
}

/// The keys the experiment owns: run name and folder, the seeds, and where the student
/// starts from.
fn fill_managed(
    config: &mut toml::Table,
    arm: &str,
    seed: u64,
    runs_dir: &Path,
    init_from: Option<String>,
) -> Result<()> {
    let seed_value = toml::Value::Integer(
        i64::try_from(seed).map_err(|_| anyhow!("seed {seed} does not fit a TOML integer"))?,
    );
    set_key(config, "run.name", format!("{arm}-s{seed}").into())?;
    set_key(config, "run.out_dir", runs_dir.display().to_string().into())?;
    set_key(config, "coordinator.seed", seed_value.clone())?;
    set_key(config, "learner.seed", seed_value)?;
    if let Some(dir) = init_from {
        set_key(config, "model.init_from", dir.into())?;
    }
    Ok(())
}

// ---- Results.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ok,
    Failed,
    /// Its `init_from` arm did not finish for this seed.
    Skipped,
    /// Stopped by Ctrl-C or SIGTERM.
    Interrupted,
    /// Not started: the experiment was interrupted before.
    NotRun,
}

/// One row of results.json.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResult {
    pub arm: String,
    pub seed: u64,
    /// Relative to the experiment directory; empty when the run never made one.
    pub run_dir: String,
    pub status: Status,
    pub error: String,
    pub initial_heldout_solve_rate: Option<f64>,
    pub final_heldout_solve_rate: Option<f64>,
    pub final_heldout_episodes: Option<u32>,
    pub teacher_labels: Option<u64>,
    pub wall_seconds: f64,
}

impl RunResult {
    fn new(arm: &str, seed: u64, status: Status, error: String) -> Self {
        Self {
            arm: arm.into(),
            seed,
            run_dir: String::new(),
            status,
            error,
            initial_heldout_solve_rate: None,
            final_heldout_solve_rate: None,
            final_heldout_episodes: None,
            teacher_labels: None,
            wall_seconds: 0.0,
        }
    }

    /// Reads what a run directory records: iteration 0's held-out solve rate, the final
    /// evaluation (final_eval.json, else the last metrics row) and the teacher labels.
    /// A held-out rate over 0 episodes is no measurement and stays empty.
    fn read_metrics(&mut self, run_dir: &Path) {
        use tutor_coordinator::driver::{read_final_eval, read_summaries};
        let rows = read_summaries(&run_dir.join("metrics.jsonl")).unwrap_or_default();
        let measured = |rate: f64, episodes: u32| (episodes > 0).then_some(rate);
        self.initial_heldout_solve_rate = rows
            .iter()
            .find(|r| r.iteration == 0)
            .and_then(|r| measured(r.heldout_solve_rate, r.heldout_episodes));
        self.teacher_labels = rows.last().map(|r| r.teacher_labels_total);
        let last = read_final_eval(&run_dir.join("final_eval.json")).or(rows.last().cloned());
        if let Some(f) = last {
            self.final_heldout_solve_rate = measured(f.heldout_solve_rate, f.heldout_episodes);
            self.final_heldout_episodes = Some(f.heldout_episodes);
        }
    }
}

#[derive(Serialize, Deserialize)]
pub struct ResultsFile {
    pub experiment: String,
    pub command: String,
    pub runs: Vec<RunResult>,
}

fn mean(xs: &[f64]) -> Option<f64> {
    (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64)
}

/// Sample standard deviation (n − 1); none below two values.
fn sample_sd(xs: &[f64]) -> Option<f64> {
    if xs.len() < 2 {
        return None;
    }
    let m = mean(xs)?;
    let ss: f64 = xs.iter().map(|x| (x - m).powi(2)).sum();
    Some((ss / (xs.len() - 1) as f64).sqrt())
}

/// The per-arm table (Markdown): the ok runs' numbers, every seed's final value.
pub fn arm_table(arms: &[String], seeds: &[u64], results: &[RunResult]) -> String {
    let mut out = String::from(
        "| arm | runs ok | start held-out solve (mean) | final held-out solve (mean ± sd) \
         | final per seed | teacher labels (mean) | wall s per run (mean) |\n\
         |---|---|---|---|---|---|---|\n",
    );
    let dash = || "–".to_string();
    for arm in arms {
        let rows: Vec<&RunResult> = results.iter().filter(|r| &r.arm == arm).collect();
        let ok: Vec<&&RunResult> = rows.iter().filter(|r| r.status == Status::Ok).collect();
        let initial: Vec<f64> = ok
            .iter()
            .filter_map(|r| r.initial_heldout_solve_rate)
            .collect();
        let finals: Vec<f64> = ok
            .iter()
            .filter_map(|r| r.final_heldout_solve_rate)
            .collect();
        let labels: Vec<f64> = ok
            .iter()
            .filter_map(|r| r.teacher_labels.map(|l| l as f64))
            .collect();
        let walls: Vec<f64> = ok.iter().map(|r| r.wall_seconds).collect();
        let final_cell = match (mean(&finals), sample_sd(&finals)) {
            (Some(m), Some(sd)) => format!("{m:.3} ± {sd:.3}"),
            (Some(m), None) => format!("{m:.3}"),
            _ => dash(),
        };
        let per_seed: Vec<String> = seeds
            .iter()
            .map(|s| match rows.iter().find(|r| r.seed == *s) {
                Some(r) if r.status == Status::Ok => {
                    match (r.final_heldout_solve_rate, r.final_heldout_episodes) {
                        (Some(rate), Some(n)) => {
                            let solved = (rate * n as f64).round() as u64;
                            format!("s{s} {rate:.3} ({solved}/{n})")
                        }
                        _ => format!("s{s} –"),
                    }
                }
                Some(r) => format!("s{s} {}", status_word(r.status)),
                None => format!("s{s} –"),
            })
            .collect();
        out.push_str(&format!(
            "| {arm} | {}/{} | {} | {final_cell} | {} | {} | {} |\n",
            ok.len(),
            seeds.len(),
            mean(&initial).map_or_else(dash, |m| format!("{m:.3}")),
            per_seed.join(", "),
            mean(&labels).map_or_else(dash, |m| format!("{m:.1}")),
            mean(&walls).map_or_else(dash, |m| format!("{m:.1}")),
        ));
    }
    out
}

fn status_word(s: Status) -> &'static str {
    match s {
        Status::Ok => "ok",
        Status::Failed => "failed",
        Status::Skipped => "skipped",
        Status::Interrupted => "interrupted",
        Status::NotRun => "not run",
    }
}

/// What RESULTS.md says besides the table: how to reproduce it, when, where.
pub struct Provenance {
    pub command: String,
    pub date: String,
    pub machine: String,
    pub experiment_dir: String,
    pub file: String,
    pub text: String,
}

pub fn results_markdown(name: &str, table: &str, results: &[RunResult], p: &Provenance) -> String {
    let mut md = format!(
        "# Experiment `{name}`\n\n\
         Reproduce: `{}`\n\n\
         - date: {}\n\
         - machine: {}\n\
         - experiment directory: `{}` (results.json, every run's merged config in \
         configs/, its output in logs/)\n\n\
         {table}\n\
         Columns: runs ok / runs planned (one per seed); *start held-out solve*: iteration 0's \
         held-out evaluation, the policy each run starts from (the untrained student, or the \
         `init_from` arm's final weights); *final held-out solve*: the last trained policy on \
         the held-out tasks (final_eval.json, else the last iteration's evaluation), mean ± \
         sample standard deviation over the ok runs' seeds, and each seed's value (solved / \
         episodes); *teacher labels*: the last metrics row's teacher_labels_total; *wall s*: \
         the whole `tutor run`, start-up included. Means are over the ok runs.\n",
        p.command, p.date, p.machine, p.experiment_dir
    );
    let not_ok: Vec<&RunResult> = results.iter().filter(|r| r.status != Status::Ok).collect();
    if !not_ok.is_empty() {
        md.push_str("\nRuns not ok:\n\n");
        for r in not_ok {
            let first = r.error.lines().rev().find(|l| !l.trim().is_empty());
            md.push_str(&format!(
                "- {} s{}: {}{}\n",
                r.arm,
                r.seed,
                status_word(r.status),
                first
                    .map(|l| format!(": `{}`", l.trim()))
                    .unwrap_or_default()
            ));
        }
    }
    md.push_str(&format!(
        "\n## Experiment file (`{}`)\n\n```toml\n{}\n```\n",
        p.file,
        p.text.trim_end()
    ));
    md
}

/// `YYYY-MM-DD HH:MM:SS UTC` of a Unix time (the proleptic Gregorian calendar).
fn utc_date(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

/// CPUs (as `nproc` counts them), the CPU model and total memory.
fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .map(|m| format!(" ({m})"))
        .unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or_else(
            || "unknown memory".to_string(),
            |kb| format!("{:.1} GiB memory (MemTotal)", kb as f64 / 1_048_576.0),
        );
    format!("{cpus} CPUs (nproc){model}, {mem}")
}

fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The command that reproduces this experiment: the config overrides from the
/// environment (`TUTOR_SECTION__FIELD`, which every run applies), then `tutor` and its
/// arguments.
fn command_line() -> String {
    let mut env: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("TUTOR_") && k.contains("__"))
        .map(|(k, v)| format!("{k}={}", shell_quote(&v)))
        .collect();
    env.sort();
    let args: Vec<String> = std::env::args().skip(1).map(|a| shell_quote(&a)).collect();
    env.push("tutor".into());
    env.extend(args);
    env.join(" ")
}

// ---- Running.

/// Ctrl-C and SIGTERM, counted: the first stops the current run and the experiment, a
/// second kills the run's process at once.
fn watch_signals() -> Result<watch::Receiver<u32>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt()).context("listening for Ctrl-C")?;
    let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    let (tx, rx) = watch::channel(0u32);
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            tx.send_modify(|n| *n += 1);
        }
    });
    Ok(rx)
}

/// The next signal; never, if the watcher is gone.
async fn next_signal(signals: &mut watch::Receiver<u32>) {
    if signals.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The run directory a `tutor run` log names in its `run directory PATH` line.
fn run_dir_in_log(log: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("run directory "))
        .map(|p| PathBuf::from(p.trim()))
}

fn log_tail(log: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

enum Ended {
    Exited(ExitStatus),
    Interrupted,
}

/// One `tutor run` to its end (or to a signal): SIGTERM on the first signal, which stops
/// its own processes, SIGKILL on a second or after `STOP_GRACE`.
async fn run_child(
    mut cmd: Command,
    signals: &mut watch::Receiver<u32>,
    mut progress: impl FnMut(),
) -> Result<Ended> {
    // `tutor run` stops every process it started, each with a 20 s grace.
    const STOP_GRACE: Duration = Duration::from_secs(180);
    let mut child = cmd.spawn().context("starting `tutor run`")?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            status = child.wait() => return Ok(Ended::Exited(status?)),
            _ = next_signal(signals) => break,
            _ = tick.tick() => progress(),
        }
    }
    if let Some(pid) = child.id() {
        // SAFETY: plain kill(2) on our own child.
        unsafe {
            libc::kill(pid as i32, libc::SIGTERM);
        }
    }
    tokio::select! {
        _ = child.wait() => {}
        _ = next_signal(signals) => { let _ = child.kill().await; }
        _ = tokio::time::sleep(STOP_GRACE) => { let _ = child.kill().await; }
    }
    Ok(Ended::Interrupted)
}

/// `<out_dir>/<name>-<stamp>` (a suffix if taken), with configs/, logs/, runs/ and the
/// experiment file's copy; returned absolute.
fn create_experiment_dir(exp: &Experiment, stamp: u64) -> Result<PathBuf> {
    std::fs::create_dir_all(&exp.out_dir)
        .with_context(|| format!("creating {}", exp.out_dir.display()))?;
    let mut dir = exp.out_dir.join(format!("{}-{stamp}", exp.name));
    let mut k = 1;
    loop {
        match std::fs::create_dir(&dir) {
            Ok(()) => break,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                dir = exp.out_dir.join(format!("{}-{stamp}-{k}", exp.name));
                k += 1;
            }
            Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
        }
    }
    let dir = dir.canonicalize()?;
    for sub in ["configs", "logs", "runs"] {
        std::fs::create_dir(dir.join(sub))
            .with_context(|| format!("creating {}", dir.join(sub).display()))?;
    }
    std::fs::write(dir.join("experiment.toml"), &exp.text)
        .with_context(|| format!("writing {}", dir.join("experiment.toml").display()))?;
    Ok(dir)
}

fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

fn write_results(dir: &Path, results: &ResultsFile) -> Result<()> {
    let text = serde_json::to_string_pretty(results)? + "\n";
    write_atomically(&dir.join("results.json"), &text)
}

/// The finished run's line above the progress bar.
fn finished_line(r: &RunResult) -> String {
    let head = format!("{} s{}", r.arm, r.seed);
    match r.status {
        Status::Ok => {
            let solve = match (r.final_heldout_solve_rate, r.final_heldout_episodes) {
                (Some(rate), Some(n)) => {
                    format!("{rate:.3} ({}/{n})", (rate * n as f64).round() as u64)
                }
                _ => "–".into(),
            };
            format!(
                "{head:<16} ok       final held-out solve {solve}, {:.1} s, {}",
                r.wall_seconds, r.run_dir
            )
        }
        status => {
            let last = r.error.lines().rev().find(|l| !l.trim().is_empty());
            format!(
                "{head:<16} {:<8} {}",
                status_word(status),
                last.unwrap_or("").trim()
            )
        }
    }
}

/// What every run of an experiment shares: where it writes, how it starts `tutor run`,
/// the progress bar and the signals.
struct Runner {
    dir: PathBuf,
    exe: PathBuf,
    log_format: LogFormat,
    bar: ProgressBar,
    signals: watch::Receiver<u32>,
}

impl Runner {
    /// A line above the progress bar (on stdout, terminal or not).
    fn say(&self, line: String) {
        self.bar.suspend(|| println!("{line}"));
    }

    /// Writes the run's merged config, runs `tutor run` on it to its end (or a signal)
    /// and reads what its run directory records.
    async fn run_one(
        &mut self,
        exp: &Experiment,
        planned: &PlannedRun,
        source: Option<&Path>,
    ) -> Result<RunResult> {
        let arm = &exp.arms[planned.arm].name;
        let label = format!("{arm}-s{}", planned.seed);
        let mut config = planned.config.clone();
        let init_from = source.map(|d| d.display().to_string());
        fill_managed(
            &mut config,
            arm,
            planned.seed,
            &self.dir.join("runs"),
            init_from,
        )?;
        let config_path = self.dir.join("configs").join(format!("{label}.toml"));
        let config_text = format!(
            "# Written by `tutor experiment` ({}): arm {arm:?}, seed {}.\n\n{}",
            exp.file.display(),
            planned.seed,
            toml::to_string(&config).context("writing a run config as TOML")?
        );
        std::fs::write(&config_path, config_text)
            .with_context(|| format!("writing {}", config_path.display()))?;

        let log = self.dir.join("logs").join(format!("{label}.log"));
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = Command::new(&self.exe);
        cmd.args(["--log-format", self.log_format.as_arg(), "run", "--config"])
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .kill_on_drop(true);
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }

        self.bar.set_message(format!("{label}: starting"));
        let t0 = Instant::now();
        let mut run_dir: Option<PathBuf> = None;
        let n = planned.iterations;
        let bar = &self.bar;
        let ended = run_child(cmd, &mut self.signals, || {
            if run_dir.is_none() {
                run_dir = run_dir_in_log(&log);
            }
            let done = run_dir.as_ref().map_or(0, |d| {
                std::fs::read_to_string(d.join("metrics.jsonl"))
                    .map(|t| t.lines().filter(|l| !l.trim().is_empty()).count())
                    .unwrap_or(0)
            });
            let phase = if done as u32 >= n {
                "final evaluation".to_string()
            } else {
                format!("iteration {}/{n}", done + 1)
            };
            let secs = t0.elapsed().as_secs();
            bar.set_message(format!("{label}: {phase}, {secs} s"));
        })
        .await?;
        let (status, error) = match ended {
            Ended::Exited(st) if st.success() => (Status::Ok, String::new()),
            Ended::Exited(st) => (
                Status::Failed,
                format!(
                    "`tutor run` exited with {st}; logs/{label}.log ends:\n{}",
                    log_tail(&log, 15)
                ),
            ),
            Ended::Interrupted => (Status::Interrupted, "stopped by Ctrl-C or SIGTERM".into()),
        };
        let mut r = RunResult::new(arm, planned.seed, status, error);
        r.wall_seconds = t0.elapsed().as_secs_f64();
        if let Some(d) = run_dir.or_else(|| run_dir_in_log(&log)) {
            r.run_dir = d
                .strip_prefix(&self.dir)
                .unwrap_or(&d)
                .display()
                .to_string();
            r.read_metrics(&d);
        }
        Ok(r)
    }
}

pub async fn run(args: ExperimentArgs, log_format: LogFormat) -> Result<()> {
    let mut exp = Experiment::load(&args.file)?;
    if let Some(out) = args.out_dir {
        exp.out_dir = out;
    }
    let command = command_line();
    let signals = watch_signals()?;
    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let dir = create_experiment_dir(&exp, started)?;
    println!(
        "experiment directory {}\n{} arms × {} seeds = {} runs",
        dir.display(),
        exp.arms.len(),
        exp.seeds.len(),
        exp.runs.len()
    );
    let mut runner = Runner {
        dir: dir.clone(),
        exe: std::env::current_exe().context("locating the tutor binary")?,
        log_format,
        bar: ProgressBar::new(exp.runs.len() as u64).with_style(
            ProgressStyle::with_template("runs [{bar:30}] {pos}/{len} {msg} ({elapsed})")
                .expect("valid template")
                .progress_chars("=> "),
        ),
        signals,
    };
    let mut results = ResultsFile {
        experiment: exp.name.clone(),
        command: command.clone(),
        runs: Vec::new(),
    };
    for planned in &exp.runs {
        let arm = &exp.arms[planned.arm];
        let interrupted = *runner.signals.borrow() > 0;
        // The run this arm starts from: same seed, finished ok (earlier in the order).
        let source = arm.init_from.map(|src| {
            let name = &exp.arms[src].name;
            results
                .runs
                .iter()
                .find(|r| {
                    &r.arm == name
                        && r.seed == planned.seed
                        && r.status == Status::Ok
                        && !r.run_dir.is_empty()
                })
                .map(|r| dir.join(&r.run_dir))
                .ok_or_else(|| {
                    format!(
                        "init_from arm {name:?} did not finish for seed {}",
                        planned.seed
                    )
                })
        });
        let r = match source {
            _ if interrupted => {
                RunResult::new(&arm.name, planned.seed, Status::NotRun, String::new())
            }
            Some(Err(why)) => RunResult::new(&arm.name, planned.seed, Status::Skipped, why),
            Some(Ok(src)) => runner.run_one(&exp, planned, Some(&src)).await?,
            None => runner.run_one(&exp, planned, None).await?,
        };
        if r.status != Status::NotRun {
            runner.say(finished_line(&r));
            runner.bar.inc(1);
        }
        results.runs.push(r);
        write_results(&dir, &results)?;
    }
    runner.bar.finish_and_clear();
    finish(&exp, &dir, &results, started)
}

/// The tables: RESULTS.md (and `results_doc`), printed too; an error if the experiment
/// was interrupted or a run did not finish ok.
fn finish(exp: &Experiment, dir: &Path, results: &ResultsFile, started: u64) -> Result<()> {
    let arm_names: Vec<String> = exp.arms.iter().map(|a| a.name.clone()).collect();
    let table = arm_table(&arm_names, &exp.seeds, &results.runs);
    let provenance = Provenance {
        command: results.command.clone(),
        date: utc_date(started),
        machine: machine(),
        experiment_dir: dir.display().to_string(),
        file: exp.file.display().to_string(),
        text: exp.text.clone(),
    };
    let md = results_markdown(&exp.name, &table, &results.runs, &provenance);
    let md_path = dir.join("RESULTS.md");
    std::fs::write(&md_path, &md).with_context(|| format!("writing {}", md_path.display()))?;
    println!("\n{table}");
    println!("results:    {}", dir.join("results.json").display());
    println!("table:      {}", md_path.display());
    let stopped = |s: Status| matches!(s, Status::Interrupted | Status::NotRun);
    if results.runs.iter().any(|r| stopped(r.status)) {
        bail!(
            "interrupted: results written for the runs that finished{}",
            exp.results_doc
                .as_ref()
                .map(|p| format!(" ({} left as it was)", p.display()))
                .unwrap_or_default()
        );
    }
    if let Some(doc) = &exp.results_doc {
        if let Some(parent) = doc.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(doc, &md).with_context(|| format!("writing {}", doc.display()))?;
        println!("also:       {}", doc.display());
    }
    let not_ok = results
        .runs
        .iter()
        .filter(|r| r.status != Status::Ok)
        .count();
    if not_ok > 0 {
        bail!(
            "{not_ok} of {} runs did not finish ok (see {} and the logs in {})",
            results.runs.len(),
            md_path.display(),
            dir.join("logs").display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_keys_merge_leaf_by_leaf() {
        let mut base: toml::Table =
            toml::from_str("[coordinator]\niterations = 8\n[coordinator.beta]\nkind = \"exponential\"\ndecay = 0.5\n")
                .unwrap();
        let set: toml::Table = toml::from_str(
            "\"coordinator.beta\" = { kind = \"constant\" }\n\"learner.learning_rate\" = 0.1\n",
        )
        .unwrap();
        let mut flat = Vec::new();
        leaves("", &set, &mut flat);
        for (k, v) in flat {
            set_key(&mut base, &k, v).unwrap();
        }
        let c = parse_run_config(&base).unwrap();
        assert_eq!(c.coordinator.iterations, 8);
        assert_eq!(c.coordinator.beta.decay, 0.5, "the other beta keys stay");
        assert_eq!(
            c.coordinator.beta.kind,
            tutor_coordinator::BetaScheduleKind::Constant
        );
        assert_eq!(c.learner.learning_rate, 0.1);
        let e = set_key(&mut base, "coordinator.iterations.x", 1.into()).unwrap_err();
        assert!(e.to_string().contains("not a section"), "{e}");
        assert!(set_key(&mut base, "coordinator..x", 1.into()).is_err());
    }

    #[test]
    fn mean_and_sample_sd() {
        assert_eq!(mean(&[]), None);
        assert_eq!(sample_sd(&[0.5]), None);
        let sd = sample_sd(&[0.25, 0.5, 0.75]).unwrap();
        assert!((sd - 0.25).abs() < 1e-12, "{sd}");
    }

    #[test]
    fn dates_are_utc_calendar_dates() {
        assert_eq!(utc_date(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc_date(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc_date(1_795_500_000), "2026-11-24 06:00:00 UTC");
    }

    #[test]
    fn table_counts_ok_runs_and_lists_every_seed() {
        let ok = |seed, rate| RunResult {
            run_dir: format!("runs/bc-s{seed}"),
            initial_heldout_solve_rate: Some(0.0),
            final_heldout_solve_rate: Some(rate),
            final_heldout_episodes: Some(8),
            teacher_labels: Some(100),
            wall_seconds: 10.0,
            ..RunResult::new("bc", seed, Status::Ok, String::new())
        };
        let results = vec![
            ok(0, 0.25),
            ok(1, 0.75),
            RunResult::new("bc", 2, Status::Failed, "boom".into()),
            RunResult::new("rft", 0, Status::Skipped, String::new()),
        ];
        let t = arm_table(&["bc".into(), "rft".into()], &[0, 1, 2], &results);
        assert!(t.contains("| bc | 2/3 | 0.000 | 0.500 ± 0.354 |"), "{t}");
        assert!(
            t.contains("s0 0.250 (2/8), s1 0.750 (6/8), s2 failed"),
            "{t}"
        );
        assert!(t.contains("| rft | 0/3 | – | – |"), "{t}");
    }
}
