//! `tutor experiment`: a bad experiment file is refused up front with a message naming
//! the file, the arm and the key, and nothing is written; configs/experiments/smoke.toml
//! runs end to end (BC, DAgger, and RFT started from the BC run) into results.json and
//! RESULTS.md.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The venv interpreter with pytest (workers grade with it), as the Makefile exports it.
fn python() -> String {
    std::env::var("TUTOR_PYTHON").unwrap_or_else(|_| {
        let venv = repo().join(".venv/bin/python");
        if venv.exists() {
            venv.display().to_string()
        } else {
            "python3".into()
        }
    })
}

/// `tutor ARGS` in `cwd`, killed after `limit`: (success, stdout, stderr).
fn tutor(cwd: &Path, args: &[&str], limit: Duration) -> (bool, String, String) {
    let out_path = cwd.join("tutor.stdout");
    let err_path = cwd.join("tutor.stderr");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tutor"));
    cmd.args(args)
        .current_dir(cwd)
        .env("TUTOR_PYTHON", python())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap());
    // The experiment and its runs die with the test even if it panics half-way.
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("starting tutor");
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            // SAFETY: signalling our own child; SIGTERM lets it stop its runs.
            unsafe {
                libc::kill(child.id() as i32, libc::SIGTERM);
            }
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    assert!(
        status.is_some(),
        "tutor {args:?} did not finish within {limit:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    (status.unwrap().success(), stdout, stderr)
}

/// An experiment file over configs/quickstart.toml with these arms.
fn experiment(arms: &str) -> String {
    format!(
        "[experiment]\nname = \"bad\"\nbase = {:?}\nseeds = [0]\nout_dir = \"out\"\n\n{arms}",
        repo().join("configs/quickstart.toml").display().to_string()
    )
}

/// `tutor experiment bad.toml` with this text fails; returns its stderr.
fn refused(text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bad.toml"), text).unwrap();
    let (ok, _, stderr) = tutor(
        dir.path(),
        &["experiment", "bad.toml"],
        Duration::from_secs(60),
    );
    assert!(!ok, "a bad experiment file was accepted:\n{text}");
    assert!(stderr.contains("bad.toml"), "the file is named: {stderr}");
    assert!(
        !dir.path().join("out").exists(),
        "nothing is written for a bad experiment file"
    );
    stderr
}

#[test]
fn bad_experiment_files_are_refused_up_front() {
    // A field an arm does not have: named, with its line.
    let e = refused(&experiment(
        "[[arm]]\nname = \"bc\"\nseed = 3\nset = { \"coordinator.algorithm\" = \"bc\" }\n",
    ));
    assert!(e.contains("seed") && e.contains("line 9"), "{e}");

    // A field [experiment] does not have.
    let e = refused(&experiment("[[arm]]\nname = \"bc\"\n").replace("seeds", "seed"));
    assert!(e.contains("unknown field `seed`"), "{e}");

    // init_from naming a later arm, or no arm.
    let e = refused(&experiment(
        "[[arm]]\nname = \"rft\"\ninit_from = \"bc\"\n\n[[arm]]\nname = \"bc\"\n",
    ));
    assert!(
        e.contains("\"rft\"") && e.contains("init_from = \"bc\"") && e.contains("later"),
        "{e}"
    );
    let e = refused(&experiment(
        "[[arm]]\nname = \"bc\"\n\n[[arm]]\nname = \"rft\"\ninit_from = \"sft\"\n",
    ));
    assert!(
        e.contains("init_from = \"sft\"") && e.contains("names no arm"),
        "{e}"
    );

    // A key the run config does not have: the arm and the key are named.
    let e = refused(&experiment(
        "[[arm]]\nname = \"dagger\"\nset = { \"coordinator.itertions\" = 2 }\n",
    ));
    assert!(
        e.contains("\"dagger\"")
            && e.contains("coordinator.itertions")
            && e.contains("unknown field"),
        "{e}"
    );
    // A value the run config's check refuses once merged.
    let e = refused(&experiment(
        "[[arm]]\nname = \"dapo\"\nset = { \"coordinator.algorithm\" = \"dapo\", \"coordinator.group_size\" = 1 }\n",
    ));
    assert!(e.contains("\"dapo\"") && e.contains("group_size"), "{e}");
    // A key the experiment owns.
    let e = refused(&experiment(
        "[[arm]]\nname = \"bc\"\nset = { \"coordinator.seed\" = 4 }\n",
    ));
    assert!(e.contains("coordinator.seed") && e.contains("seeds"), "{e}");
}

fn read_json(p: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

#[test]
fn smoke_experiment_runs_every_arm_and_writes_the_tables() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("experiments");
    let file = repo().join("configs/experiments/smoke.toml");
    let (ok, stdout, stderr) = tutor(
        dir.path(),
        &[
            "experiment",
            file.to_str().unwrap(),
            "--out-dir",
            out.to_str().unwrap(),
        ],
        Duration::from_secs(900),
    );
    let exp_dirs: Vec<PathBuf> = std::fs::read_dir(&out)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    let logs: String = exp_dirs
        .iter()
        .flat_map(|d| std::fs::read_dir(d.join("logs")).into_iter().flatten())
        .flatten()
        .map(|e| {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            format!(
                "== {}\n{}\n",
                e.path().display(),
                lines[lines.len().saturating_sub(30)..].join("\n")
            )
        })
        .collect();
    assert!(
        ok,
        "tutor experiment failed\nstdout:\n{stdout}\nstderr:\n{stderr}\n{logs}"
    );
    assert_eq!(exp_dirs.len(), 1, "{exp_dirs:?}");
    let exp = &exp_dirs[0];
    assert!(exp
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("smoke-"));
    assert_eq!(
        std::fs::read_to_string(exp.join("experiment.toml")).unwrap(),
        std::fs::read_to_string(&file).unwrap(),
        "the experiment file is copied"
    );

    let results = read_json(&exp.join("results.json"));
    assert_eq!(results["experiment"], "smoke");
    assert!(
        results["command"]
            .as_str()
            .unwrap()
            .starts_with("tutor experiment "),
        "{results}"
    );
    let runs = results["runs"].as_array().unwrap();
    let arms: Vec<(&str, u64)> = runs
        .iter()
        .map(|r| (r["arm"].as_str().unwrap(), r["seed"].as_u64().unwrap()))
        .collect();
    assert_eq!(arms, [("bc", 0), ("dagger", 0), ("rft", 0)], "{results}");
    for r in runs {
        assert_eq!(r["status"], "ok", "{r}");
        assert_eq!(r["error"], "", "{r}");
        let run_dir = exp.join(r["run_dir"].as_str().unwrap());
        assert!(
            r["run_dir"].as_str().unwrap().starts_with("runs/")
                && run_dir.join("metrics.jsonl").exists(),
            "{r}"
        );
        let solve = r["final_heldout_solve_rate"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&solve), "{r}");
        assert_eq!(r["final_heldout_episodes"], 1, "{r}");
        assert!(r["initial_heldout_solve_rate"].is_f64(), "{r}");
        assert!(r["teacher_labels"].is_u64(), "{r}");
        assert!(r["wall_seconds"].as_f64().unwrap() > 0.0, "{r}");
    }
    // BC trains on the teacher's labels.
    assert!(runs[0]["teacher_labels"].as_u64().unwrap() > 0, "{results}");

    // Every run's merged config; RFT starts from the BC run of the same seed.
    let config = |name: &str| -> toml::Table {
        let p = exp.join("configs").join(format!("{name}.toml"));
        toml::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
    };
    let bc_dir = exp.join(runs[0]["run_dir"].as_str().unwrap());
    let rft = config("rft-s0");
    let init_from = PathBuf::from(rft["model"]["init_from"].as_str().unwrap());
    assert!(init_from.is_absolute(), "{rft:#?}");
    assert_eq!(
        init_from.canonicalize().unwrap(),
        bc_dir.canonicalize().unwrap(),
        "{rft:#?}"
    );
    assert_eq!(rft["coordinator"]["algorithm"].as_str(), Some("rft"));
    assert_eq!(rft["run"]["name"].as_str(), Some("rft-s0"));
    let bc = config("bc-s0");
    assert!(bc["model"].get("init_from").is_none(), "{bc:#?}");
    assert_eq!(bc["coordinator"]["seed"].as_integer(), Some(0));
    assert_eq!(bc["learner"]["seed"].as_integer(), Some(0));
    assert_eq!(bc["coordinator"]["iterations"].as_integer(), Some(1));
    assert_eq!(bc["tasks"]["toy_train"].as_integer(), Some(4));
    assert!(exp.join("logs/rft-s0.log").exists());

    let md = std::fs::read_to_string(exp.join("RESULTS.md")).unwrap();
    for needle in [
        "| bc | 1/1 |",
        "| dagger | 1/1 |",
        "| rft | 1/1 |",
        "nproc",
        "MemTotal",
    ] {
        assert!(
            md.contains(needle),
            "{needle:?} missing from RESULTS.md:\n{md}"
        );
    }
    assert!(md.contains("tutor experiment "), "{md}");
    assert!(
        md.contains("name = \"smoke\""),
        "the experiment file is quoted:\n{md}"
    );
    assert!(
        stdout.contains("| dagger | 1/1 |"),
        "the table is printed:\n{stdout}"
    );
}
