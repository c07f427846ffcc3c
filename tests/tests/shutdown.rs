//! Ctrl-C on `tutor run` stops every process it started and leaves no sandbox behind.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

/// Processes whose command line mentions `needle` (the run's unique temp directory).
fn processes_mentioning(needle: &str) -> Vec<(u32, String)> {
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
    let before = processes_mentioning(&needle);
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
    let mut left = processes_mentioning(&needle);
    while !left.is_empty() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(200));
        left = processes_mentioning(&needle);
    }
    assert!(left.is_empty(), "orphans after Ctrl-C: {left:?}");
    let leftover: Vec<_> = std::fs::read_dir(&sandboxes)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(leftover.is_empty(), "sandboxes left behind: {leftover:?}");
}
