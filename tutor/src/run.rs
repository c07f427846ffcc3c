//! `tutor run`: the single-machine default. Starts the learner, the coordinator and the
//! workers as separate processes on 127.0.0.1 (the same gRPC path a cluster uses),
//! renders progress from the coordinator's Control stream, prints the table, and stops
//! every process on Ctrl-C. Every gRPC call carries a token generated for the run.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use tokio::process::{Child, Command};
use tonic::Request;
use tutor_proto::auth::{AuthToken, ClientAuth, Role};
use tutor_proto::control_client::ControlClient;
use tutor_proto::{run_event, IterationSummary, RunFinished, WatchRunRequest};

use crate::config::RunConfig;
use crate::logging::LogFormat;
use crate::prepare::{prepare, PreparedRun};

struct Proc {
    role: String,
    child: Child,
    log: PathBuf,
}

/// A fresh random token (32 bytes, hex) for one run, written 0600 to `path`.
fn write_run_token(path: &Path) -> Result<AuthToken> {
    use rand::RngCore;
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    let token = AuthToken::new(&hex::encode(bytes))?;
    write_token_file(path, &token)?;
    Ok(token)
}

/// Writes `token` to a new file at `path`, mode 0600.
fn write_token_file(path: &Path, token: &AuthToken) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating the auth token file {}", path.display()))?;
    f.write_all(token.expose().as_bytes())
        .and_then(|_| f.sync_all())
        .with_context(|| format!("writing the auth token file {}", path.display()))
}

/// Flags every child gets: the log format and a token file: the run's for the
/// coordinator, and for the learner ranks and the workers their role's token derived
/// from it (neither can shut the run down; a worker cannot train either).
struct ChildFlags {
    common: Vec<String>,
    learner_token_file: String,
    worker_token_file: String,
}

impl ChildFlags {
    fn for_role(&self, role: &str) -> Vec<String> {
        let mut flags = self.common.clone();
        let own = if role.starts_with("worker") {
            Some(&self.worker_token_file)
        } else if role.starts_with("learner") {
            Some(&self.learner_token_file)
        } else {
            None
        };
        if let (Some(file), Some(i)) = (own, flags.iter().position(|f| f == "--auth-token-file")) {
            flags[i + 1] = file.clone();
        }
        flags
    }
}

/// Children die with the parent even if it is killed with SIGKILL.
fn spawn(role: &str, args: &[String], flags: &ChildFlags, run: &PreparedRun) -> Result<Proc> {
    let exe = std::env::current_exe().context("locating the tutor binary")?;
    let log = run.dir.join("logs").join(format!("{role}.log"));
    let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let err = out.try_clone()?;
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .args(flags.for_role(role))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true);
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "info");
    }
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("starting the {role} process"))?;
    Ok(Proc {
        role: role.to_string(),
        child,
        log,
    })
}

/// The endpoint of a role once its address file appears: `scheme://ADDR`.
async fn wait_addr(file: &Path, scheme: &str, proc_: &mut Proc) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(s) = std::fs::read_to_string(file) {
            return Ok(format!("{scheme}://{}", s.trim()));
        }
        if let Some(status) = proc_.child.try_wait()? {
            bail!(
                "the {} exited ({status}) before listening; see {}\n{}",
                proc_.role,
                proc_.log.display(),
                tail(&proc_.log)
            );
        }
        if Instant::now() > deadline {
            bail!(
                "the {} did not start listening within 120 s; see {}",
                proc_.role,
                proc_.log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A port that was free a moment ago on 127.0.0.1.
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Stops processes in order (workers, coordinator, learner): SIGTERM, then SIGKILL
/// after the grace period.
async fn stop_all(procs: &mut [Proc], grace: Duration) {
    for p in procs.iter_mut().rev() {
        if let Some(pid) = p.child.id() {
            if p.child.try_wait().ok().flatten().is_none() {
                // SAFETY: plain kill(2) on our own child.
                unsafe {
                    libc::kill(pid as i32, libc::SIGTERM);
                }
            }
        }
        if tokio::time::timeout(grace, p.child.wait()).await.is_err() {
            eprintln!("{} did not stop within {grace:?}: killing it", p.role);
            let _ = p.child.kill().await;
        }
    }
}

pub fn header() -> String {
    format!(
        "{:>5} {:>6} {:>8} {:>7} {:>10} {:>14} {:>7} {:>6} {:>9} {:>8} {:>9} {:>8} {:>7}",
        "iter",
        "beta",
        "episodes",
        "labels",
        "train_loss",
        "heldout_solve",
        "submit",
        "turns",
        "valid_cmd",
        "student",
        "rollout_s",
        "train_s",
        "sync_s"
    )
}

/// One table row. The held-out columns (`heldout_solve`, `submit`: share submitted,
/// `turns`: mean turns) are the policy the iteration started with, alone and greedy;
/// `valid_cmd`: share of the student's replies with exactly one command block (the first
/// thing a student learns); `student`: share of the training episodes' turns the
/// student's action was executed in.
pub fn row(s: &IterationSummary) -> String {
    row_labelled(&s.iteration.to_string(), s)
}

/// The final evaluation's row: the last trained policy on the held-out tasks.
pub fn final_row(s: &IterationSummary) -> String {
    row_labelled("final", s)
}

fn row_labelled(label: &str, s: &IterationSummary) -> String {
    let solved = (s.heldout_solve_rate * s.heldout_episodes as f64).round() as u32;
    let final_eval = label == "final";
    let dash = |v: String| if final_eval { "-".to_string() } else { v };
    format!(
        "{:>5} {:>6} {:>8} {:>7} {:>10} {:>14} {:>7.2} {:>6.2} {:>9.2} {:>8} {:>9.1} {:>8} {:>7}",
        label,
        dash(format!("{:.3}", s.beta)),
        dash(s.episodes.to_string()),
        s.teacher_labels_total,
        dash(format!("{:.4}", s.train_loss)),
        format!(
            "{:.2} ({}/{})",
            s.heldout_solve_rate, solved, s.heldout_episodes
        ),
        s.heldout_submit_rate,
        s.heldout_mean_turns,
        1.0 - s.student_format_error_rate,
        dash(format!("{:.2}", s.student_turn_share)),
        s.rollout_seconds,
        dash(format!("{:.1}", s.train_seconds)),
        dash(format!("{:.2}", s.sync_seconds))
    )
}

/// The GPU of each learner rank `tutor run` starts (`None`: the learner trains on the
/// CPU). With `[learner] device = "cuda"` rank r gets GPU r, so K ranks need K GPUs that
/// libtorch sees (`visible`); one rank may name its GPU (`"cuda:N"`), several may not
/// (they would all share it, and NCCL refuses two ranks on one GPU).
fn learner_gpus(
    learner: &tutor_learner::LearnerConfig,
    world: usize,
    visible: i64,
) -> Result<Option<Vec<usize>>> {
    let device = learner.device.trim();
    if learner.device(0)? == tch::Device::Cpu {
        return Ok(None);
    }
    let gpus: Vec<usize> = if device == "cuda" {
        (0..world).collect()
    } else if world == 1 {
        match learner.device(0)? {
            tch::Device::Cuda(n) => vec![n],
            _ => Vec::new(),
        }
    } else {
        bail!(
            "learner.device = {device:?} would put all {world} ranks on one GPU: use device = \
             \"cuda\" (rank r trains on GPU r)"
        );
    };
    if let Some(&top) = gpus.iter().max() {
        if top as i64 >= visible {
            bail!(
                "{world} learner rank(s) on {device:?} need GPU {top}, but libtorch sees {visible} \
                 GPU(s) (a CPU-only libtorch, no driver, or CUDA_VISIBLE_DEVICES hides them): \
                 lower learner.world_size or use device = \"cpu\""
            );
        }
    }
    Ok(Some(gpus))
}

pub async fn run(config_path: &Path, log_format: LogFormat) -> Result<()> {
    let (config, text) = RunConfig::load(config_path)?;
    let broadcast =
        config.worker.weights_from == tutor_rollout_worker::worker::WeightsFrom::Broadcast;
    if broadcast && config.learner.weight_receivers != config.run.workers as usize {
        bail!(
            "{}: [worker] weights_from = \"broadcast\" needs [learner] weight_receivers = {} \
             (one per worker, [run] workers), got {}",
            config_path.display(),
            config.run.workers,
            config.learner.weight_receivers
        );
    }
    // [tls]: checked here (files named on error) before the run directory is made.
    let tls_files = config.tls.files()?;
    let client_tls = tls_files
        .client()
        .with_context(|| format!("the [tls] section of {}", config_path.display()))?;
    tls_files
        .server()
        .with_context(|| format!("the [tls] section of {}", config_path.display()))?;
    // Each learner rank's GPU, checked against what libtorch sees before anything starts.
    let gpus = learner_gpus(
        &config.learner,
        config.learner.world_size.max(1),
        tch::Cuda::device_count(),
    )
    .with_context(|| format!("the [learner] settings of {}", config_path.display()))?;
    // What every worker would refuse to start without, said before anything is made.
    config
        .worker
        .preflight()
        .with_context(|| format!("the [worker] settings of {}", config_path.display()))?;
    let prepared = prepare(&config, &text)?;
    println!(
        "run directory {}\n{} training tasks, {} held-out, student with {} parameters, {} workers",
        prepared.dir.display(),
        prepared.n_train,
        prepared.n_heldout,
        prepared.parameters,
        config.run.workers
    );
    let token_file = prepared.dir.join("auth-token");
    let token = write_run_token(&token_file)?;
    let learner_token_file = prepared.dir.join("learner-token");
    write_token_file(&learner_token_file, &token.derive(Role::Learner))?;
    let worker_token_file = prepared.dir.join("worker-token");
    write_token_file(&worker_token_file, &token.derive(Role::Worker))?;
    let mut flags = vec![
        "--log-format".into(),
        log_format.as_arg().into(),
        "--auth-token-file".into(),
        token_file.display().to_string(),
    ];
    for (flag, path) in [
        ("--tls-cert", &tls_files.cert),
        ("--tls-key", &tls_files.key),
        ("--tls-ca", &tls_files.ca),
    ] {
        if let Some(p) = path {
            flags.push(flag.into());
            flags.push(p.display().to_string());
        }
    }
    let flags = ChildFlags {
        common: flags,
        learner_token_file: learner_token_file.display().to_string(),
        worker_token_file: worker_token_file.display().to_string(),
    };
    let client = ClientAuth::new(Some(&token)).with_tls(client_tls);
    let mut procs: Vec<Proc> = Vec::new();
    let result = orchestrate(&config, gpus, &prepared, &flags, &client, &mut procs).await;
    stop_all(&mut procs, Duration::from_secs(20)).await;
    match &result {
        Ok(fin) => {
            println!("checkpoint: {}", fin.checkpoint_dir);
            println!(
                "metrics:    {}",
                prepared.dir.join("metrics.jsonl").display()
            );
        }
        Err(e) => eprintln!(
            "run failed: {e:#}\nlogs: {}",
            prepared.dir.join("logs").display()
        ),
    }
    result.map(|_| ())
}

/// Starts the roles and watches the run; `gpus`: each learner rank's GPU
/// ([`learner_gpus`]).
async fn orchestrate(
    config: &RunConfig,
    gpus: Option<Vec<usize>>,
    run: &PreparedRun,
    flags: &ChildFlags,
    client: &ClientAuth,
    procs: &mut Vec<Proc>,
) -> Result<RunFinished> {
    let addr_dir = run.dir.join("addr");
    let scheme = if client.tls().is_some() {
        "https"
    } else {
        "http"
    };
    let s = |p: &Path| p.display().to_string();
    let cfg = s(&run.config_path);

    // With several learner ranks (`[learner] world_size`), rank 0 publishes its
    // rendezvous at the coordinator, which starts after rank 0 (it needs rank 0's address):
    // the coordinator's port is chosen first.
    let world = config.learner.world_size.max(1);
    let broadcast = config.learner.weight_receivers > 0;
    let coord_listen = if world > 1 || broadcast {
        format!("127.0.0.1:{}", free_port()?)
    } else {
        "127.0.0.1:0".into()
    };
    let group_flags = |rank: usize| -> Vec<String> {
        let coordinator = vec!["--coordinator".into(), format!("{scheme}://{coord_listen}")];
        if world == 1 {
            // The weights broadcast's rendezvous is at the coordinator too.
            return if broadcast { coordinator } else { Vec::new() };
        }
        let mut flags = vec![
            "--rank".into(),
            rank.to_string(),
            "--world-size".into(),
            world.to_string(),
        ];
        if let Some(gpus) = &gpus {
            flags.extend(["--gpu".into(), gpus[rank].to_string()]);
        }
        flags.extend(coordinator);
        flags
    };
    let learner_addr_file = addr_dir.join("learner");
    let mut learner_args: Vec<String> = vec![
        "learner".into(),
        "--config".into(),
        cfg.clone(),
        "--model-dir".into(),
        s(&run.model_dir),
        "--out-dir".into(),
        s(&run.dir.join("learner")),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--addr-file".into(),
        s(&learner_addr_file),
    ];
    learner_args.extend(group_flags(0));
    procs.push(spawn("learner", &learner_args, flags, run)?);
    let learner = wait_addr(&learner_addr_file, scheme, procs.last_mut().unwrap()).await?;

    let coord_addr_file = addr_dir.join("coordinator");
    procs.push(spawn(
        "coordinator",
        &[
            "coordinator".into(),
            "--config".into(),
            cfg.clone(),
            "--run-dir".into(),
            s(&run.dir),
            "--learner".into(),
            learner.clone(),
            "--train-tasks".into(),
            s(&run.train_tasks),
            "--heldout-tasks".into(),
            s(&run.heldout_tasks),
            "--listen".into(),
            coord_listen.clone(),
            "--addr-file".into(),
            s(&coord_addr_file),
            "--metrics-listen".into(),
            "127.0.0.1:0".into(),
            "--metrics-addr-file".into(),
            s(&addr_dir.join("metrics")),
        ],
        flags,
        run,
    )?);
    let coordinator = wait_addr(&coord_addr_file, scheme, procs.last_mut().unwrap()).await?;
    // Ranks 1..K−1 find rank 0 through the coordinator. They go first in `procs`, so they
    // are stopped last: rank 0 stops first and tells them to end.
    for rank in 1..world {
        let mut args: Vec<String> = vec!["learner".into(), "--config".into(), cfg.clone()];
        args.extend(group_flags(rank));
        procs.insert(0, spawn(&format!("learner-{rank}"), &args, flags, run)?);
    }
    // The coordinator writes its metrics address before its own.
    if let Ok(m) = std::fs::read_to_string(addr_dir.join("metrics")) {
        println!("metrics at http://{}/metrics", m.trim());
    }

    for i in 0..config.run.workers {
        procs.push(spawn(
            &format!("worker-{i}"),
            &[
                "worker".into(),
                "--config".into(),
                cfg.clone(),
                "--coordinator".into(),
                coordinator.clone(),
                "--model-dir".into(),
                s(&run.model_dir),
                "--name".into(),
                format!("worker-{i}"),
                "--run".into(),
                run.dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "tutor".into()),
                "--cache-dir".into(),
                s(&run.dir.join("cache").join(format!("worker-{i}"))),
                "--weights-rank".into(),
                (i + 1).to_string(),
            ],
            flags,
            run,
        )?);
    }

    let watch = watch(&coordinator, config, client);
    tokio::pin!(watch);
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut check = tokio::time::interval(Duration::from_millis(500));
    let finished = loop {
        tokio::select! {
            r = &mut watch => break r?,
            _ = tokio::signal::ctrl_c() => bail!("interrupted (Ctrl-C): stopping every process"),
            _ = sigterm.recv() => bail!("terminated (SIGTERM): stopping every process"),
            _ = check.tick() => {
                for p in procs.iter_mut() {
                    if let Some(status) = p.child.try_wait()? {
                        bail!("the {} exited unexpectedly ({status}); see {}\n{}", p.role, p.log.display(), tail(&p.log));
                    }
                }
            }
        }
    };
    if !finished.error.is_empty() {
        bail!("the coordinator reports: {}", finished.error);
    }
    // Workers leave on their own once told the run is finished.
    let deadline = Instant::now() + Duration::from_secs(60);
    for p in procs.iter_mut().filter(|p| p.role.starts_with("worker")) {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, p.child.wait()).await {
            Ok(Ok(st)) if !st.success() => {
                eprintln!("{} exited with {st}; see {}", p.role, p.log.display())
            }
            Ok(_) => {}
            Err(_) => eprintln!("{} did not exit after the run finished", p.role),
        }
    }
    let final_eval = finished.final_eval.as_ref().map(|f| {
        serde_json::json!({
            "policy_version": f.policy_version,
            "heldout_solve_rate": f.heldout_solve_rate,
            "heldout_episodes": f.heldout_episodes,
            "heldout_submit_rate": f.heldout_submit_rate,
            "heldout_mean_turns": f.heldout_mean_turns,
            "student_format_error_rate": f.student_format_error_rate,
        })
    });
    let summary = serde_json::json!({
        "final_version": finished.final_version,
        "worker_versions": finished.worker_versions,
        "checkpoint_dir": finished.checkpoint_dir,
        "final_eval": final_eval,
    });
    let path = run.dir.join("summary.json");
    std::fs::write(&path, format!("{summary:#}\n"))
        .with_context(|| format!("writing {}", path.display()))?;
    let versions: Vec<String> = finished
        .worker_versions
        .iter()
        .map(|(w, v)| format!("{w}=v{v}"))
        .collect();
    println!(
        "final policy version v{}; workers ended on: {}",
        finished.final_version,
        versions.join(", ")
    );
    Ok(finished)
}

/// Follows the coordinator's run events: progress bars on stderr, the table on stdout.
async fn watch(coordinator: &str, config: &RunConfig, auth: &ClientAuth) -> Result<RunFinished> {
    let channel = auth
        .endpoint(coordinator)?
        .connect()
        .await
        .with_context(|| format!("connecting to the coordinator at {coordinator}"))?;
    let mut client = ControlClient::new(auth.channel(channel));
    let mut events = client
        .watch_run(Request::new(WatchRunRequest {}))
        .await?
        .into_inner();
    let mp = MultiProgress::new();
    let style =
        ProgressStyle::with_template("{prefix:>10} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
            .expect("valid template")
            .progress_chars("=> ");
    let rollout = mp.add(
        ProgressBar::new(0)
            .with_style(style.clone())
            .with_prefix("rollout"),
    );
    let train = mp.add(ProgressBar::new(0).with_style(style).with_prefix("train"));
    let out = |line: String| {
        let _ = mp.suspend(|| {
            println!("{line}");
            std::io::stdout().flush()
        });
    };
    out(header());
    let n = config.coordinator.iterations;
    while let Some(ev) = events
        .message()
        .await
        .context("the coordinator's event stream broke")?
    {
        match ev.event {
            Some(run_event::Event::Rollout(r)) => {
                rollout.set_length(r.episodes_total as u64);
                rollout.set_position(r.episodes_done as u64);
                rollout.set_message(format!("episodes, iteration {}/{n}", r.iteration + 1));
            }
            Some(run_event::Event::Training(t)) => {
                train.set_length(t.steps_total as u64);
                train.set_position(t.step as u64);
                train.set_message(format!("steps, loss {:.4}", t.loss));
            }
            Some(run_event::Event::Iteration(s)) => out(row(&s)),
            Some(run_event::Event::Finished(f)) => {
                rollout.finish_and_clear();
                train.finish_and_clear();
                if let Some(fe) = &f.final_eval {
                    out(final_row(fe));
                }
                return Ok(f);
            }
            None => {}
        }
    }
    bail!("the coordinator closed its event stream before the run finished")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn learner(device: &str) -> tutor_learner::LearnerConfig {
        tutor_learner::LearnerConfig {
            device: device.into(),
            ..Default::default()
        }
    }

    /// `tutor run` gives learner rank r GPU r, and refuses, naming the setting, a run with
    /// fewer GPUs than ranks or several ranks pinned to one GPU.
    #[test]
    fn each_learner_rank_gets_its_own_gpu() {
        assert_eq!(learner_gpus(&learner("cpu"), 4, 0).unwrap(), None);
        assert_eq!(
            learner_gpus(&learner("cuda"), 4, 8).unwrap(),
            Some(vec![0, 1, 2, 3])
        );
        assert_eq!(
            learner_gpus(&learner("cuda:3"), 1, 4).unwrap(),
            Some(vec![3])
        );
        let e = learner_gpus(&learner("cuda"), 2, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sees 1 GPU") && e.contains("world_size"), "{e}");
        let e = learner_gpus(&learner("cuda:1"), 2, 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("one GPU") && e.contains("\"cuda\""), "{e}");
        let e = learner_gpus(&learner("cuda:2"), 1, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("need GPU 2"), "{e}");
        let e = learner_gpus(&learner("cuda"), 1, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sees 0 GPU"), "{e}");
    }
}
