//! The local sandbox's disk quota (`sandbox::disk`, docs/security.md "Local sandbox"):
//! with no file system quota to lean on, a watchdog stops a command whose files grow past
//! the quota, and what such a command wrote is removed, so that what the sandbox keeps on
//! the host's disk stays bounded; the sandbox goes on working after.

use std::path::PathBuf;
use std::time::Duration;

use tutor_rollout_worker::sandbox::confine::{ConfineSettings, Confinement, Limits};
use tutor_rollout_worker::sandbox::LocalSandbox;
use tutor_rollout_worker::tasks::{RepoFileRecord, TaskRecord};

const T: Duration = Duration::from_secs(60);
const QUOTA: u64 = 64 << 20;

fn init_python() {
    if std::env::var_os("TUTOR_PYTHON").is_none() {
        let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
        if venv.exists() {
            std::env::set_var("TUTOR_PYTHON", venv);
        }
    }
}

/// Bytes on disk under the sandbox's home, as the host sees them (`du`).
fn home_bytes(sb: &mut LocalSandbox) -> u64 {
    let out = sb.run("du -s -B1 ~ | cut -f1", T);
    out.output
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{}", out.output))
}

#[test]
fn a_command_cannot_fill_the_disk_past_the_quota() {
    init_python();
    let settings = ConfineSettings {
        // Confined where bubblewrap works, unconfined elsewhere: the quota is the same.
        allow_unconfined: true,
        limits: Limits {
            disk_bytes: QUOTA,
            ..Limits::default()
        },
        ..ConfineSettings::default()
    };
    let confinement = Confinement::new(&settings).unwrap();
    let task = TaskRecord {
        instance_id: "disk-1".into(),
        repo: "t/t".into(),
        files: vec![RepoFileRecord {
            path: "a.txt".into(),
            content: "hello\n".into(),
        }],
        ..Default::default()
    };
    let mut sb = LocalSandbox::create_confined(&task, None, None, &confinement).unwrap();
    let start = home_bytes(&mut sb);

    // A steady writer (1 MiB files, one every 10 ms, up to 500 MiB): stopped at the quota,
    // its files removed.
    let out = sb.run(
        "cd ~/repo; for i in $(seq 1 500); do head -c 1048576 /dev/zero > f$i; sleep 0.01; \
         done; echo R:finished",
        T,
    );
    assert!(!out.output.contains("R:finished"), "{}", out.output);
    assert!(
        out.output.contains("disk quota exceeded") && out.output.contains("were removed"),
        "{}",
        out.output
    );
    assert_ne!(out.exit_code, 0);
    assert!(home_bytes(&mut sb) < start + QUOTA, "{}", out.output);
    let out = sb.run("ls ~/repo/f1 2>&1; echo R:$?", T);
    assert!(out.output.contains("R:2"), "{}", out.output);

    // One fast write past the quota, over before the watchdog looks: found after the
    // command, and removed.
    let out = sb.run("head -c 209715200 /dev/zero > ~/burst; echo R:wrote", T);
    assert!(out.output.contains("disk quota exceeded"), "{}", out.output);
    assert!(home_bytes(&mut sb) < start + QUOTA, "{}", out.output);

    // A command within the quota works, and the repository's files are there.
    let out = sb.run(
        "head -c 10485760 /dev/zero > ~/ok && echo R:ok; cat ~/repo/a.txt; rm ~/ok",
        T,
    );
    assert!(out.output.contains("R:ok"), "{}", out.output);
    assert!(out.output.contains("hello"), "{}", out.output);
    assert!(!out.output.contains("quota"), "{}", out.output);
    assert_eq!(out.exit_code, 0);
}
