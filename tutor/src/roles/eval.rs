//! `tutor eval`: run one agent on a task file in local or Docker sandboxes, grade every
//! submission in a fresh sandbox, print the resolve rate and write per-task results.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::Semaphore;
use tutor_rollout_worker::eval::{eval_task, EvalResult, EvalSettings, SubmitNothing};
use tutor_rollout_worker::tasks::{load_tasks, TaskRecord};
use tutor_rollout_worker::teacher::endpoint::{
    ChatEndpoint, EndpointTeacher, TeacherConfig, TeacherKind,
};
use tutor_rollout_worker::teacher::{OracleTeacher, Teacher};
use tutor_rollout_worker::worker::{SandboxKind, WorkerConfig};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AgentKind {
    /// The gold-patch oracle (reads the task's `patch`): must resolve every valid task.
    Oracle,
    /// Submits at once without changes: must resolve none.
    Noop,
    /// A model behind an OpenAI-compatible chat-completions endpoint (--base-url, --model).
    Endpoint,
}

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// Tasks (JSONL, SWE-bench field spelling).
    #[arg(long)]
    tasks: PathBuf,
    /// Which agent acts.
    #[arg(long, value_enum, default_value_t = AgentKind::Oracle)]
    agent: AgentKind,
    /// Where episodes run: `local` or `docker` (images from `make images`).
    #[arg(long, default_value = "local")]
    sandbox: SandboxKind,
    /// Docker image for tasks that name none: an image, `swebench`, or a template with
    /// {instance_id}, {repo}, {repo_slug}, {version}.
    #[arg(long, default_value = "tutor/python-task:latest")]
    image: String,
    /// Episodes run at once.
    #[arg(long, short = 'j', default_value_t = 2)]
    jobs: usize,
    /// Docker: keep N started containers per image ready ahead of demand (episodes and
    /// gradings take one and only copy their task in); 0 creates each on demand.
    #[arg(long, value_name = "N", default_value_t = 0)]
    warm_pool: u32,
    /// Turn limit per episode.
    #[arg(long, default_value_t = 30)]
    max_turns: u32,
    /// Per-command timeout (seconds).
    #[arg(long, default_value_t = 60.0)]
    command_timeout: f64,
    /// Test-run timeout when grading (seconds).
    #[arg(long, default_value_t = 300.0)]
    grade_timeout: f64,
    /// How submissions are graded: `harness` (exactly what the SWE-bench harness
    /// reports) or `strict` (the workers' reward grading: files that change how tests
    /// are collected or reported are reset, pytest results come from Tutor's own report,
    /// skipped tests never count as passing).
    #[arg(long, default_value = "harness", value_parser = clap::value_parser!(String))]
    grading: String,
    /// Evaluate only the first N tasks.
    #[arg(long)]
    limit: Option<usize>,
    /// Write one JSON object per task here (status, turns, commands, patch).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Endpoint agent: base URL up to /v1, e.g. http://127.0.0.1:8000/v1.
    #[arg(long, required_if_eq("agent", "endpoint"))]
    base_url: Option<String>,
    /// Endpoint agent: the served model's name.
    #[arg(long, required_if_eq("agent", "endpoint"))]
    model: Option<String>,
    /// Endpoint agent: environment variable holding the API key (never logged).
    #[arg(long, default_value = "TUTOR_TEACHER_API_KEY")]
    api_key_env: String,
    /// Endpoint agent: deadline of one request (seconds).
    #[arg(long, default_value_t = 120.0)]
    request_timeout: f64,
    /// Endpoint agent: retries on 429, 5xx, timeouts and connection errors.
    #[arg(long, default_value_t = 4)]
    max_retries: u32,
    /// Endpoint agent: sampling temperature.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
}

pub async fn eval(args: EvalArgs) -> Result<()> {
    let mut tasks = load_tasks(&args.tasks)?;
    if let Some(n) = args.limit {
        tasks.truncate(n);
    }
    if tasks.is_empty() {
        anyhow::bail!("{} holds no tasks", args.tasks.display());
    }
    let worker = WorkerConfig {
        sandbox: args.sandbox,
        image: args.image.clone(),
        warm_pool: args.warm_pool,
        ..Default::default()
    };
    let run = format!("eval-{}", std::process::id());
    let factory = worker
        .sandboxes(&run, "eval")
        .await
        .context("setting up the sandboxes")?;
    let settings = EvalSettings {
        max_turns: args.max_turns.max(1),
        command_timeout: Duration::from_secs_f64(args.command_timeout.max(1.0)),
        grade_timeout: Duration::from_secs_f64(args.grade_timeout.max(1.0)),
        grading: args
            .grading
            .parse()
            .map_err(|e: String| anyhow::anyhow!("--grading: {e}"))?,
        ..Default::default()
    };
    let endpoint = match args.agent {
        AgentKind::Endpoint => Some(Arc::new(
            ChatEndpoint::new(&TeacherConfig {
                kind: TeacherKind::Endpoint,
                base_url: args.base_url.clone().unwrap_or_default(),
                model: args.model.clone().unwrap_or_default(),
                api_key_env: args.api_key_env.clone(),
                timeout_s: args.request_timeout,
                max_retries: args.max_retries,
                concurrency: args.jobs.max(1) as u32,
                temperature: args.temperature,
                ..Default::default()
            })
            .map_err(anyhow::Error::msg)?,
        )),
        _ => None,
    };
    let bar = ProgressBar::new(tasks.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} eval [{bar:30}] {pos}/{len} {msg} ({elapsed})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let resolved = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let slots = Arc::new(Semaphore::new(args.jobs.max(1)));
    let started = Instant::now();
    let mut handles = Vec::new();
    for (i, task) in tasks.into_iter().enumerate() {
        let permit = slots.clone().acquire_owned().await.expect("semaphore open");
        let (factory, settings, bar, resolved) = (
            factory.clone(),
            settings.clone(),
            bar.clone(),
            resolved.clone(),
        );
        let agent = match (&endpoint, args.agent) {
            (Some(e), _) => Agent::Endpoint(e.clone(), tokio::runtime::Handle::current()),
            (None, AgentKind::Noop) => Agent::Noop,
            (None, _) => Agent::Oracle,
        };
        let label = format!("{run}-{i}");
        handles.push(tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let r = run_one(&task, agent, &factory, &settings, &label);
            if r.resolved {
                resolved.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            bar.inc(1);
            bar.set_message(format!(
                "{} resolved",
                resolved.load(std::sync::atomic::Ordering::Relaxed)
            ));
            r
        }));
    }
    let mut results: Vec<EvalResult> = Vec::new();
    let mut panicked = None;
    for h in handles {
        match h.await {
            Ok(r) => results.push(r),
            Err(e) => panicked = Some(e),
        }
    }
    // The warm pool's containers (if any) go before the report, and any a removal missed.
    factory.shutdown().await;
    factory.remove_leftovers().await;
    if let Some(e) = panicked {
        return Err(e).context("an evaluation task panicked");
    }
    bar.finish_and_clear();

    if let Some(out) = &args.out {
        let mut text = String::new();
        for r in &results {
            text.push_str(&serde_json::to_string(r)?);
            text.push('\n');
        }
        std::fs::write(out, text).with_context(|| format!("writing {}", out.display()))?;
    }
    let mut by_status: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &results {
        *by_status.entry(r.status.as_str()).or_default() += 1;
    }
    let n = results.len();
    let solved = results.iter().filter(|r| r.resolved).count();
    println!(
        "{:<40} {:<17} {:>5} {:>8}",
        "instance", "status", "turns", "seconds"
    );
    for r in &results {
        println!(
            "{:<40} {:<17} {:>5} {:>8.1}",
            r.instance_id, r.status, r.turns, r.duration_s
        );
        if !r.error.is_empty() {
            let first = r.error.lines().next().unwrap_or("");
            println!("    error: {first}");
        }
    }
    let statuses: Vec<String> = by_status.iter().map(|(k, v)| format!("{k} {v}")).collect();
    println!(
        "resolved {solved}/{n} ({:.1}%) with agent {:?} in {} sandboxes, {:.1}s; {}",
        100.0 * solved as f64 / n as f64,
        args.agent,
        factory.kind(),
        started.elapsed().as_secs_f64(),
        statuses.join(", ")
    );
    if let Some(out) = &args.out {
        println!("per-task results: {}", out.display());
    }
    Ok(())
}

enum Agent {
    Oracle,
    Noop,
    Endpoint(Arc<ChatEndpoint>, tokio::runtime::Handle),
}

fn run_one(
    task: &TaskRecord,
    agent: Agent,
    factory: &tutor_rollout_worker::sandbox::SandboxFactory,
    settings: &EvalSettings,
    label: &str,
) -> EvalResult {
    let mut agent: Box<dyn Teacher> = match agent {
        Agent::Oracle => Box::new(OracleTeacher::new()),
        Agent::Noop => Box::new(SubmitNothing),
        Agent::Endpoint(e, rt) => Box::new(EndpointTeacher::new(e, rt, None)),
    };
    eval_task(task, agent.as_mut(), factory, settings, label)
}
