//! Where local sandboxes cannot be confined (simulated: a bubblewrap path that does not
//! exist), making them is refused with a message naming what is missing and the setting
//! that allows it anyway; with `allow_unconfined` they run, unconfined.

use std::path::PathBuf;
use std::time::Duration;

use tutor_rollout_worker::sandbox::{ConfineSettings, SandboxFactory};
use tutor_rollout_worker::tasks::{RepoFileRecord, TaskRecord};
use tutor_rollout_worker::worker::{SandboxKind, WorkerConfig};

fn task() -> TaskRecord {
    TaskRecord {
        instance_id: "refusal-1".into(),
        repo: "t/t".into(),
        files: vec![RepoFileRecord {
            path: "a.txt".into(),
            content: "hello\n".into(),
        }],
        ..Default::default()
    }
}

#[test]
fn unconfinable_local_sandboxes_are_refused_unless_allowed() {
    let missing = ConfineSettings {
        bwrap: PathBuf::from("/nonexistent/tutor-test/bwrap"),
        ..Default::default()
    };
    let err = SandboxFactory::local(None, None, &missing)
        .err()
        .expect("refused")
        .to_string();
    for part in [
        "/nonexistent/tutor-test/bwrap",
        "bubblewrap",
        "allow_unconfined",
        "apt-get install bubblewrap",
    ] {
        assert!(err.contains(part), "{part:?} not in: {err}");
    }

    let dir = tempfile::tempdir().unwrap();
    let allowed = ConfineSettings {
        allow_unconfined: true,
        ..missing
    };
    let factory = SandboxFactory::local(Some(dir.path().to_path_buf()), None, &allowed).unwrap();
    let SandboxFactory::LocalWith { confinement, .. } = &factory else {
        panic!("a local factory");
    };
    assert!(!confinement.is_confined());
    assert!(
        confinement.describe().contains("unconfined"),
        "{}",
        confinement.describe()
    );
    let mut sb = factory.create(&task(), "t").unwrap();
    // Unconfined: the host's files are there (here: the test's own directory).
    let out = sb.run(
        &format!("cat a.txt && test -d {} && echo host", dir.path().display()),
        Duration::from_secs(30),
    );
    assert_eq!(out.output, "hello\nhost\n", "{out:?}");
}

/// The worker's own path: `[worker]` settings make a confined factory where bubblewrap
/// works, and the worker process non-dumpable (skipped where bubblewrap is not
/// installed).
#[test]
fn a_worker_makes_confined_local_sandboxes() {
    if !std::path::Path::new("/usr/bin/bwrap").exists()
        && std::process::Command::new("bwrap")
            .arg("--version")
            .output()
            .is_err()
    {
        eprintln!("SKIPPED: bubblewrap (bwrap) is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let beside = dir.path().join("auth-token");
    std::fs::write(&beside, "secret").unwrap();
    let config = WorkerConfig {
        sandbox: SandboxKind::Local,
        sandbox_root: Some(dir.path().join("sandboxes")),
        ..Default::default()
    };
    assert!(!config.allow_unconfined);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let factory = rt.block_on(config.sandboxes("run", "w")).unwrap();
    let SandboxFactory::LocalWith { confinement, .. } = &factory else {
        panic!("a local factory");
    };
    assert!(confinement.is_confined(), "{}", confinement.describe());
    // Making local sandboxes also made this process non-dumpable: its /proc (the run's
    // token and API keys in its environment, its memory) is not the sandbox user's to
    // read.
    assert!(
        !tutor_rollout_worker::sandbox::confine::is_dumpable(),
        "a worker with local sandboxes is still dumpable"
    );
    let mut sb = factory.create(&task(), "t").unwrap();
    let out = sb.run(
        &format!("test -e {} || echo hidden", beside.display()),
        Duration::from_secs(30),
    );
    assert_eq!(out.output, "hidden\n", "{out:?}");
}
