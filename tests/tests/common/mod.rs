//! Helpers shared by the cross-process tests: find the `tutor` binary, run it.
// Each test binary uses a subset of these.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The `tutor` binary: $TUTOR_BIN, else target/debug/tutor of this workspace (built by
/// `make test` before the suite runs).
pub fn tutor_bin() -> PathBuf {
    if let Ok(p) = std::env::var("TUTOR_BIN") {
        return PathBuf::from(p);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    let bin = target.join("debug").join("tutor");
    assert!(
        bin.exists(),
        "{} is missing: build it first with `make test-build` (the test build with the tests' features; make test does)",
        bin.display()
    );
    bin
}

/// The venv interpreter with pytest, as the Makefile exports it.
pub fn python() -> String {
    std::env::var("TUTOR_PYTHON").unwrap_or_else(|_| {
        let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
        if venv.exists() {
            venv.display().to_string()
        } else {
            "python3".into()
        }
    })
}

pub fn tutor(args: &[&str]) -> Output {
    Command::new(tutor_bin())
        .args(args)
        .env("TUTOR_PYTHON", python())
        .output()
        .expect("running tutor")
}

/// `tutor prepare --config CFG` with run directories under `runs`: the paths it prints
/// (run_dir, config, model_dir, learner_out_dir, train_tasks, …). Panics with its stderr
/// when it fails.
pub fn prepare(cfg: &Path, runs: &Path) -> serde_json::Value {
    let out = Command::new(tutor_bin())
        .args(["prepare", "--config", cfg.to_str().unwrap()])
        .env("TUTOR_RUN__OUT_DIR", runs)
        .output()
        .expect("running tutor prepare");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("tutor prepare prints its paths as JSON")
}

/// Processes whose command line mentions `needle` (the run's unique temp directory).
pub fn processes_mentioning(needle: &str) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(needle) {
            found.push((pid, cmd));
        }
    }
    found
}

/// One role's process, started again with the same arguments after a kill.
pub struct Role {
    pub name: String,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
    starts: u32,
    env: Vec<(String, String)>,
}

impl Role {
    pub fn new(name: &str, args: Vec<String>, logs: &Path) -> Self {
        Self {
            name: name.into(),
            args,
            log: logs.join(format!("{name}.log")),
            child: None,
            starts: 0,
            env: Vec::new(),
        }
    }

    /// Sets an environment variable for every start.
    pub fn with_env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    pub fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut cmd = Command::new(tutor_bin());
        cmd.args(&self.args)
            .env("TUTOR_PYTHON", python())
            .env("RUST_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        // Children die with the test even if it panics half-way.
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        self.child = Some(cmd.spawn().unwrap());
        self.starts += 1;
    }

    pub fn kill9(&mut self) {
        let mut c = self.child.take().expect("running");
        c.kill().unwrap(); // SIGKILL
        c.wait().unwrap();
    }

    pub fn signal_term(&self) {
        if let Some(c) = &self.child {
            // SAFETY: signalling our own child.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
        }
    }

    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().unwrap())
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait() {
                self.child = None;
                return Some(s);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "== {} ({} starts)\n{}",
            self.name,
            self.starts,
            lines[lines.len().saturating_sub(25)..].join("\n")
        )
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn coordinator_state(run_dir: &Path) -> serde_json::Value {
    std::fs::read(run_dir.join("coordinator-state.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// Waits for `cond`, polling; panics with `what` and the logs after `timeout`.
pub fn wait_until(
    what: &str,
    timeout: Duration,
    roles: &mut [&mut Role],
    mut cond: impl FnMut() -> bool,
) {
    let end = Instant::now() + timeout;
    while !cond() {
        let exited = roles
            .iter_mut()
            .find_map(|r| r.try_wait().map(|s| (r.name.clone(), s)));
        if let Some((name, s)) = exited {
            let logs: Vec<String> = roles.iter().map(|r| r.log_tail()).collect();
            panic!(
                "{name} exited ({s}) while waiting for {what}\n{}",
                logs.join("\n")
            );
        }
        if Instant::now() >= end {
            let logs: Vec<String> = roles.iter().map(|r| r.log_tail()).collect();
            panic!("timed out waiting for {what}\n{}", logs.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A tiny random Qwen3 checkpoint in `out` made by transformers (tests/serve/make_model.py;
/// `args`: its optional MAX_POSITIONS and HIDDEN_SIZE).
pub fn make_model(out: &Path, args: &[&str]) -> PathBuf {
    std::fs::create_dir_all(out).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("serve/make_model.py");
    let made = Command::new(python())
        .arg(&script)
        .arg(out)
        .args(args)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{} failed (is transformers installed? `make setup`):\n{}",
        script.display(),
        String::from_utf8_lossy(&made.stderr)
    );
    out.to_path_buf()
}

/// A running `tutor serve`, killed on drop.
pub struct Served {
    pub child: Child,
    /// host:port it listens on.
    pub addr: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `tutor serve --model MODEL --served-model-name NAME --port 0 --device cpu EXTRA`
/// with its log and address file in `dir`, and waits until it listens.
pub fn serve(model: &Path, name: &str, dir: &Path, extra: &[&str]) -> Served {
    let mut args: Vec<String> = ["serve", "--model"].map(String::from).to_vec();
    args.push(model.display().to_string());
    args.extend(
        [
            "--served-model-name",
            name,
            "--port",
            "0",
            "--device",
            "cpu",
        ]
        .map(String::from),
    );
    args.extend(extra.iter().map(|a| a.to_string()));
    serve_with(&args, dir, &[])
}

/// Starts `tutor ARGS --addr-file DIR/serve-addr` (ARGS: global flags, `serve` and its
/// flags, with `--port 0`) with `env` and its log at DIR/serve.log, and waits until it
/// listens.
pub fn serve_with(args: &[String], dir: &Path, env: &[(&str, &str)]) -> Served {
    let addr_file = dir.join("serve-addr");
    let log_path = dir.join("serve.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let child = Command::new(tutor_bin())
        .args(args)
        .arg("--addr-file")
        .arg(&addr_file)
        .envs(env.iter().copied())
        // Weight reloads are logged at info.
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let mut served = Served {
        child,
        addr: String::new(),
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while !addr_file.exists() {
        if let Some(status) = served.child.try_wait().unwrap() {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            panic!("tutor serve exited with {status}:\n{log}");
        }
        assert!(Instant::now() < deadline, "tutor serve did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    served.addr = std::fs::read_to_string(&addr_file)
        .unwrap()
        .trim()
        .to_string();
    served
}

/// The logs of a run's processes (RUN/logs) whose file names start with `role`, one after
/// another.
pub fn role_logs(run: &Path, role: &str) -> String {
    std::fs::read_dir(run.join("logs"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(role))
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect()
}

/// What a run whose learner loads every version into `tutor serve` (`[worker.student]
/// loaded_by = "learner"`) must show, for each of the `versions` its episodes ran on: the
/// learner loaded it, the engine received it over the collective exactly once (not once
/// per worker), and no worker loaded one. The logs are the learner's, the workers' and the
/// engine's (text or JSON).
pub fn assert_the_learner_loaded_each_version_once(
    versions: &std::collections::BTreeSet<u64>,
    learner_log: &str,
    worker_log: &str,
    serve_log: &str,
) {
    for v in versions {
        assert!(
            learner_log.lines().any(|l| {
                l.contains("loaded the policy version into the student engine")
                    && l.contains(&format!("label=tutor-v{v}-"))
            }),
            "the learner never loaded version {v}:\n{learner_log}"
        );
        let received = serve_log
            .lines()
            .filter(|l| {
                l.contains("received weights over the collective")
                    && l.contains(&format!("tutor-v{v}-"))
            })
            .count();
        assert_eq!(received, 1, "version {v}:\n{serve_log}");
    }
    assert!(
        !worker_log.contains("loaded policy version"),
        "{worker_log}"
    );
}

/// The trajectory store of a finished run, checked for what every restart test relies
/// on: each (episode, turn) stored once; each outcome stored once and with all its turns;
/// each planned slot (`it000-train0003` of `it000-train0003-g0a1`) completed by exactly
/// one attempt; an attempt left incomplete (a killed worker's) only where another
/// attempt completed its slot.
pub struct StoredRun {
    /// Events in the store (turns and outcomes).
    pub events: usize,
    /// Turn events in the store.
    pub turn_events: usize,
    /// Complete episodes: id → outcome.
    pub outcomes: std::collections::BTreeMap<String, tutor_proto::EpisodeOutcome>,
    /// Planned slot → the id of the attempt that completed it.
    pub completed_slots: std::collections::BTreeMap<String, String>,
    /// Attempts with turns but no outcome.
    pub abandoned: Vec<String>,
}

pub fn check_store(run_dir: &Path) -> StoredRun {
    use std::collections::{BTreeMap, BTreeSet};
    use tutor_proto::episode_event::Event;
    let (events, _) =
        tutor_coordinator::store::scan(&run_dir.join("trajectories/events.log")).unwrap();
    let mut turns: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
    let mut outcomes = BTreeMap::new();
    let mut turn_events = 0;
    let mut expired = BTreeSet::new();
    let mut granted = BTreeSet::new();
    for ev in &events {
        match ev.event.as_ref().unwrap() {
            Event::Turn(t) => {
                turn_events += 1;
                assert!(
                    turns
                        .entry(ev.episode_id.clone())
                        .or_default()
                        .insert(t.turn_index),
                    "turn stored twice: {} {}",
                    ev.episode_id,
                    t.turn_index
                );
            }
            Event::Outcome(o) => assert!(
                outcomes.insert(ev.episode_id.clone(), o.clone()).is_none(),
                "outcome stored twice: {}",
                ev.episode_id
            ),
            // The coordinator's record of whom it leased an attempt to: written once,
            // by the coordinator, before any event of the attempt.
            Event::LeaseGranted(g) => {
                assert_eq!(ev.worker_id, "coordinator", "{ev:?}");
                assert!(!g.worker_id.is_empty(), "{ev:?}");
                assert!(
                    granted.insert(ev.episode_id.clone()),
                    "lease grant stored twice: {}",
                    ev.episode_id
                );
                assert!(
                    !turns.contains_key(&ev.episode_id) && !outcomes.contains_key(&ev.episode_id),
                    "a lease grant stored after its episode's events: {}",
                    ev.episode_id
                );
            }
            // The coordinator's record that an attempt's lease expired: written once.
            Event::LeaseExpired(_) => {
                assert_eq!(ev.worker_id, "coordinator", "{ev:?}");
                assert!(
                    expired.insert(ev.episode_id.clone()),
                    "lease expiry stored twice: {}",
                    ev.episode_id
                );
            }
        }
    }
    let slot = |id: &str| id.rsplit_once('-').unwrap().0.to_string();
    let mut completed_slots = BTreeMap::new();
    for (id, o) in &outcomes {
        let n = o.num_turns;
        let got = turns.get(id).cloned().unwrap_or_default();
        assert_eq!(
            got,
            (0..n).collect::<BTreeSet<u32>>(),
            "episode {id} is stored with turns {got:?} but its outcome says {n} turns"
        );
        if let Some(other) = completed_slots.insert(slot(id), id.clone()) {
            panic!(
                "slot {} completed more than once: {other} and {id}",
                slot(id)
            );
        }
    }
    let abandoned: Vec<String> = turns
        .keys()
        .filter(|id| !outcomes.contains_key(*id))
        .cloned()
        .collect();
    for id in &abandoned {
        assert!(
            completed_slots.contains_key(&slot(id)),
            "episode {id} was left incomplete and its slot never completed"
        );
    }
    StoredRun {
        events: events.len(),
        turn_events,
        outcomes,
        completed_slots,
        abandoned,
    }
}
