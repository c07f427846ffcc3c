//! Ctrl-C on `tutor run` stops every process it started and leaves no sandbox behind.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

fn wait_for(path: &Path, timeout: Duration) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

#[test]
fn ctrl_c_stops_every_process_and_cleans_sandboxes() {
    let dir = tempfile::tempdir().unwrap();
    let sandboxes = dir.path().join("sandboxes");
    std::fs::create_dir_all(&sandboxes).unwrap();
    let out_dir = dir.path().join("runs");
    let cfg = dir.path().join("long.toml");
    std::fs::write(
        &cfg,
        format!(
            "[run]\nout_dir = {:?}\nworkers = 2\n[tasks]\ntoy_train = 8\ntoy_heldout = 2\n\
             [model]\nvocab_size = 400\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 1\n\
             num_attention_heads = 2\nnum_key_value_heads = 1\nhead_dim = 16\n\
             [coordinator]\niterations = 50\nepisodes_per_iteration = 200\nmax_turns = 6\n\
             [worker]\nsandbox_root = {:?}\n",
            out_dir.display().to_string(),
            sandboxes.display().to_string()
        ),
    )
    .unwrap();
    let mut child = std::process::Command::new(common::tutor_bin())
        .args(["run", "--config", cfg.to_str().unwrap()])
        .env("TUTOR_PYTHON", common::python())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until episodes are running: workers registered and a sandbox exists.
    let coord_addr = || {
        std::fs::read_dir(&out_dir)
            .ok()
            .and_then(|mut d| d.next())
            .map(|e| e.unwrap().path().join("addr/coordinator"))
    };
    let end = Instant::now() + Duration::from_secs(120);
    while coord_addr().is_none_or(|p| !p.exists()) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        coord_addr().is_some_and(|p| wait_for(&p, Duration::from_secs(5))),
        "the run never started"
    );
    let end = Instant::now() + Duration::from_secs(60);
    while std::fs::read_dir(&sandboxes).unwrap().count() == 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        std::fs::read_dir(&sandboxes).unwrap().count() > 0,
        "no episode started within 60 s"
    );
    let needle = dir.path().display().to_string();
    let before = common::processes_mentioning(&needle);
    assert!(
        before.len() >= 4,
        "learner, coordinator and two workers should be running: {before:?}"
    );

    // SAFETY: signalling our own child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGINT);
    }
    let end = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < end,
            "tutor run did not stop within 60 s of Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "an interrupted run exits non-zero");
    assert!(stderr.contains("interrupted"), "{stderr}");
    // Children are gone (allow a moment for the kernel to reap them).
    let end = Instant::now() + Duration::from_secs(10);
    let mut left = common::processes_mentioning(&needle);
    while !left.is_empty() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(200));
        left = common::processes_mentioning(&needle);
    }
    assert!(left.is_empty(), "orphans after Ctrl-C: {left:?}");
    let leftover: Vec<_> = std::fs::read_dir(&sandboxes)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(leftover.is_empty(), "sandboxes left behind: {leftover:?}");
}

/// Waits for a child to exit; None if it is still running after `timeout`.
fn wait_exit(
    child: &mut std::process::Child,
    timeout: Duration,
) -> Option<std::process::ExitStatus> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `tutor coordinator` stops on SIGTERM with exit status 0, and a second one started on
/// the same run directory resumes it (its state file says it is the second start).
#[test]
fn sigterm_stops_the_coordinator_with_exit_0_and_a_restart_resumes_the_run_dir() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    let out = common::tutor(&["tasks", "toy", "--n", "4", "--out", &p("train.jsonl")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(
        p("c.toml"),
        "[coordinator]\niterations = 1\nshutdown_grace_s = 5.0\n",
    )
    .unwrap();
    for generation in 0..2u64 {
        let addr_file = dir.path().join(format!("addr{generation}"));
        let mut child = std::process::Command::new(common::tutor_bin())
            .args([
                "coordinator",
                "--config",
                &p("c.toml"),
                "--run-dir",
                &p("run"),
                // Nothing listens there: the coordinator waits for its learner.
                "--learner",
                "http://127.0.0.1:9",
                "--train-tasks",
                &p("train.jsonl"),
                "--listen",
                "127.0.0.1:0",
                "--addr-file",
                addr_file.to_str().unwrap(),
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        assert!(
            wait_for(&addr_file, Duration::from_secs(30)),
            "the coordinator never listened"
        );
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        let status = match wait_exit(&mut child, Duration::from_secs(20)) {
            Some(s) => s,
            None => {
                let _ = child.kill();
                panic!("the coordinator did not stop within 20 s of SIGTERM");
            }
        };
        let mut stderr = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
        assert_eq!(status.code(), Some(0), "{stderr}");
        let state: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("run/coordinator-state.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(state["generation"].as_u64(), Some(generation), "{state}");
        assert!(dir.path().join("run/trajectories/events.log").exists());
    }
}
