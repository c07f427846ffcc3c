//! The `tutor` command's behaviour on good and bad input.

mod common;

use common::tutor;

#[test]
fn bad_config_names_file_line_and_field_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("runs");
    let cfg = dir.path().join("bad.toml");
    std::fs::write(
        &cfg,
        format!(
            "[run]\nout_dir = {:?}\n\n[coordinator]\niterations = 2\nmax_turns = -3\n",
            out_dir.display().to_string()
        ),
    )
    .unwrap();
    let out = tutor(&["run", "--config", cfg.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("bad.toml") && err.contains("line 6") && err.contains("max_turns"),
        "{err}"
    );
    assert!(!out_dir.exists(), "nothing is written for a bad config");

    std::fs::write(&cfg, "[coordinator.beta]\nkind = \"sometimes\"\n").unwrap();
    let out = tutor(&["run", "--config", cfg.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("sometimes") && err.contains("line 2"), "{err}");
}

/// A machine whose sandbox Python lacks pytest is told so by `tutor run` itself, before
/// a run directory is made or a process started. Before, the run started its learner,
/// coordinator and workers, and only the workers' logs said why they had stopped.
#[test]
fn a_sandbox_python_without_pytest_stops_the_run_before_it_starts() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("python3");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'pytest'\" >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out_dir = dir.path().join("runs");
    let cfg = dir.path().join("run.toml");
    std::fs::write(
        &cfg,
        format!(
            "[run]\nout_dir = {:?}\n\n[worker]\nallow_unconfined = true\n",
            out_dir.display().to_string()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(common::tutor_bin())
        .args(["run", "--config", cfg.to_str().unwrap()])
        .env("TUTOR_SANDBOX_PYTHON", &fake)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    for want in ["run.toml", "cannot import pytest", "TUTOR_SANDBOX_PYTHON"] {
        assert!(err.contains(want), "{want:?} missing from: {err}");
    }
    assert!(!out_dir.exists(), "nothing is written before the check");
}

#[test]
fn toy_tasks_are_deterministic_and_split_without_overlap() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    for name in ["a.jsonl", "b.jsonl"] {
        let out = tutor(&[
            "tasks",
            "toy",
            "--n",
            "12",
            "--seed",
            "5",
            "--out",
            &p(name),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let a = std::fs::read(p("a.jsonl")).unwrap();
    assert_eq!(
        a,
        std::fs::read(p("b.jsonl")).unwrap(),
        "same seed, same tasks"
    );
    assert_eq!(a.iter().filter(|b| **b == b'\n').count(), 12);

    let out = tutor(&[
        "tasks",
        "toy",
        "--n",
        "12",
        "--seed",
        "5",
        "--out",
        &p("train.jsonl"),
        "--heldout-out",
        &p("heldout.jsonl"),
    ]);
    assert!(out.status.success());
    let ids = |f: &str| -> std::collections::BTreeSet<String> {
        std::fs::read_to_string(p(f))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["instance_id"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect()
    };
    let (train, heldout) = (ids("train.jsonl"), ids("heldout.jsonl"));
    assert!(!train.is_empty() && !heldout.is_empty());
    assert!(train.is_disjoint(&heldout));
    assert_eq!(train.len() + heldout.len(), 12);
}

#[test]
fn malformed_task_file_names_the_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = dir.path().join("tasks.jsonl");
    let good = tutor(&[
        "tasks",
        "toy",
        "--n",
        "2",
        "--seed",
        "1",
        "--out",
        tasks.to_str().unwrap(),
    ]);
    assert!(good.status.success());
    let text = std::fs::read_to_string(&tasks).unwrap();
    let mut second: serde_json::Value = serde_json::from_str(text.lines().nth(1).unwrap()).unwrap();
    second.as_object_mut().unwrap().remove("patch");
    std::fs::write(
        &tasks,
        format!("{}\n{}\n", text.lines().next().unwrap(), second),
    )
    .unwrap();
    let cfg = dir.path().join("run.toml");
    let out_dir = dir.path().join("runs");
    std::fs::write(
        &cfg,
        format!(
            "[run]\nout_dir = {:?}\n[tasks]\nsource = \"file\"\ntrain_path = {:?}\n",
            out_dir.display().to_string(),
            tasks.display().to_string()
        ),
    )
    .unwrap();
    let out = tutor(&["run", "--config", cfg.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("tasks.jsonl:2") && err.contains("patch"),
        "{err}"
    );
    assert!(!out_dir.exists(), "nothing is written for a bad task file");
}
