//! What the local sandbox keeps from the model's commands (docs/security.md, "Local
//! sandbox"), with real sandboxes running real commands: secrets outside the working copy
//! (files, the worker's home, environment and /proc), the Python venv and the rest of the
//! host for writing, other sandboxes, the worker's own git, and the host's processes and
//! disk (limits). Needs bubblewrap (`make setup` installs it); without it every test here
//! says SKIPPED.
//!
//! Only the API the sandbox had before it was confined is used here, so that these tests
//! build against that code too (and fail there).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tutor_rollout_worker::sandbox::LocalSandbox;
use tutor_rollout_worker::tasks::{RepoFileRecord, TaskRecord};
use tutor_rollout_worker::worker::WorkerConfig;

const T: Duration = Duration::from_secs(30);

/// True where bubblewrap is installed: the local sandbox must then confine its commands.
fn bwrap_installed() -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .any(|d| d.join("bwrap").is_file());
    if !found {
        eprintln!("SKIPPED: bubblewrap (bwrap) is not installed; local sandboxes run unconfined");
    }
    found
}

/// Points `TUTOR_PYTHON` at the workspace venv (which has pytest) when it exists.
fn init_python() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("TUTOR_PYTHON").is_none() {
            let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
            if venv.exists() {
                std::env::set_var("TUTOR_PYTHON", venv);
            }
        }
    });
}

fn task() -> TaskRecord {
    TaskRecord {
        instance_id: "confine-1".into(),
        repo: "t/t".into(),
        files: vec![RepoFileRecord {
            path: "a.txt".into(),
            content: "hello\n".into(),
        }],
        ..Default::default()
    }
}

/// The interpreter's prefixes as the host resolves them (venv, installation).
fn python_prefixes() -> Vec<PathBuf> {
    let out = std::process::Command::new(tutor_rollout_worker::sandbox::python_interpreter())
        .args([
            "-c",
            "import sys, os\nfor p in (sys.prefix, sys.base_prefix): print(os.path.realpath(p))",
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(PathBuf::from)
        .collect()
}

/// A secret where the run keeps its own (`<run_dir>/auth-token`), beside the sandboxes
/// (under `<dir>/sandboxes`), in the worker's environment (`TUTOR_AUTH_TOKEN`, an API key)
/// and in the `/proc/<pid>/environ` of a process of the worker's user started with it (as
/// the worker is): a command sees none of it, nor the worker's home, nor another sandbox;
/// its environment is exactly the sandbox's own list.
#[test]
fn a_command_cannot_read_the_workers_secrets_home_environment_or_other_sandboxes() {
    if !bwrap_installed() {
        return;
    }
    init_python();
    let secret = format!("s3cret-{}-{}", std::process::id(), rand::random::<u64>());
    std::env::set_var("TUTOR_AUTH_TOKEN", &secret);
    std::env::set_var("TUTOR_CONFINE_TEST_API_KEY", &secret);
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    std::fs::create_dir_all(&run_dir).unwrap();
    let token = run_dir.join("auth-token");
    std::fs::write(&token, &secret).unwrap();
    let root = dir.path().join("sandboxes");
    let mut sb = LocalSandbox::create(&task(), Some(&root)).unwrap();
    let other = LocalSandbox::create(&task(), Some(&root)).unwrap();
    std::fs::write(other.root().join("other.txt"), &secret).unwrap();

    // Every leak is collected, so that a failure names them all.
    let mut leaks: Vec<String> = Vec::new();
    // `set_var` does not reach this process's /proc/<pid>/environ (written at exec): a
    // stand-in for the worker, started with the token in its environment.
    let stand_in = std::process::Command::new("sleep")
        .arg("300")
        .env_clear()
        .env("TUTOR_AUTH_TOKEN", &secret)
        .spawn()
        .unwrap();
    let stand_in = KillOnDrop(stand_in);
    let worker = stand_in.0.id();
    let pid = std::process::id();
    let probes = [
        format!("cat /proc/{worker}/environ"),
        format!("cat {}", token.display()),
        format!("ls -la {} {}", run_dir.display(), dir.path().display()),
        format!("cat {}/other.txt", other.root().display()),
        format!("cat /proc/{pid}/environ"),
        "cat /proc/$PPID/environ".to_string(),
        "cat /proc/[0-9]*/environ".to_string(),
        "cat /proc/[0-9]*/cmdline".to_string(),
        "env".to_string(),
        "set".to_string(),
    ];
    for p in &probes {
        let out = sb.run(&format!("{p} 2>&1 | tr '\\0' '\\n'"), T);
        if out.output.contains(&secret) {
            leaks.push(format!("`{p}` read the secret"));
        }
    }
    // Not even its name: the run directory is not there.
    let out = sb.run(&format!("test -e {} && echo visible", token.display()), T);
    if out.output.contains("visible") {
        leaks.push("the run directory is visible".into());
    }
    let out = sb.run(&format!("ls {} 2>&1", other.home().display()), T);
    if out.exit_code == 0 || out.output.contains("repo") {
        leaks.push(format!("another sandbox is visible: {}", out.output));
    }

    // The environment is the sandbox's own list, nothing of the worker's.
    let allowed = [
        "PATH",
        "HOME",
        "REPO",
        "TMPDIR",
        "LANG",
        "LC_ALL",
        "TERM",
        "PAGER",
        "GIT_PAGER",
        "MANPAGER",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONUNBUFFERED",
        "PYTHONHASHSEED",
        "PIP_DISABLE_PIP_VERSION_CHECK",
        "GIT_CONFIG_NOSYSTEM",
        "GIT_CONFIG_GLOBAL",
        "GIT_TERMINAL_PROMPT",
        "GIT_AUTHOR_NAME",
        "GIT_AUTHOR_EMAIL",
        "GIT_COMMITTER_NAME",
        "GIT_COMMITTER_EMAIL",
        "GIT_AUTHOR_DATE",
        "GIT_COMMITTER_DATE",
        "TUTOR_SANDBOX",
        "TUTOR_STATE_DIR",
        "TUTOR_REPO",
        "TUTOR_REPO_DISPLAY",
        "TUTOR_CWD_FILE",
        "TUTOR_CMD_FILE",
        "TUTOR_START_DIR",
        // bash's own
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
    ];
    let out = sb.run("env -0 | tr '\\0' '\\n' | cut -d= -f1", T);
    for name in out.output.lines().filter(|l| !l.is_empty()) {
        if !allowed.contains(&name) {
            leaks.push(format!("{name} is in the command's environment"));
        }
    }

    // The worker's home shows nothing but the way to the interpreter (when it lives
    // there): no dotfiles, no caches, no keys.
    if let Some(home) = std::env::var_os("HOME").map(PathBuf::from) {
        let prefixes = python_prefixes();
        for e in std::fs::read_dir(&home).into_iter().flatten().flatten() {
            let p = e.path();
            if prefixes.iter().any(|pre| pre.starts_with(&p)) {
                continue;
            }
            let out = sb.run(&format!("test -e '{}' && echo visible", p.display()), T);
            if out.output.contains("visible") {
                leaks.push(format!("{} of the worker's home is visible", p.display()));
            }
        }
    }
    assert!(leaks.is_empty(), "{leaks:#?}");
}

/// The venv's site-packages (where a `.pth` file would run in every later episode and in
/// grading), the interpreter's installation, the system and everything beside the sandbox
/// are read-only to a command; its working copy and /tmp are not.
#[test]
fn a_command_cannot_write_the_venv_the_interpreter_or_outside_its_working_copy() {
    if !bwrap_installed() {
        return;
    }
    init_python();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sandboxes");
    let mut sb = LocalSandbox::create(&task(), Some(&root)).unwrap();
    let out = sb.run(
        "python -c 'import site, sys; print(site.getsitepackages()[0]); print(sys.base_prefix)'",
        T,
    );
    assert_eq!(out.exit_code, 0, "{}", out.output);
    let mut lines = out.output.lines();
    let site = PathBuf::from(lines.next().unwrap());
    let base = PathBuf::from(lines.next().unwrap());
    let name = format!("tutor-confine-probe-{}.txt", std::process::id());
    let targets = [
        site.join(&name),
        base.join(&name),
        base.join("lib").join(&name),
        PathBuf::from("/usr/local").join(&name),
        PathBuf::from("/etc").join(&name),
        dir.path().join(&name),
        root.join(&name),
        sb.home().parent().unwrap().join(&name),
    ];
    // Judged on the host: inside, `/tmp/...` is the sandbox's own /tmp.
    let mut written = Vec::new();
    for t in &targets {
        sb.run(&format!("echo x > '{}'", t.display()), T);
        if t.exists() {
            written.push(t.clone());
        }
    }
    // Leave nothing behind, even where it was written.
    for t in &targets {
        let _ = std::fs::remove_file(t);
    }
    assert!(
        written.is_empty(),
        "a command wrote outside its working copy: {written:?}"
    );
    // What it may write.
    let out = sb.run(
        "echo x > ~/repo/ok.txt && echo x > /tmp/ok.txt && echo x > \"$TMPDIR/ok2.txt\" \
         && cat /tmp/ok.txt",
        T,
    );
    assert_eq!(out.exit_code, 0, "{}", out.output);
    assert!(sb.root().join("ok.txt").exists());
    // /tmp lasts from one command to the next.
    let out = sb.run("cat /tmp/ok.txt", T);
    assert_eq!(out.output, "x\n");
}

/// The bookkeeping git directory the worker's own git (the submission) runs with is out
/// of a command's reach: not there, or read-only.
#[test]
fn a_command_cannot_write_the_bookkeeping_git_directory() {
    if !bwrap_installed() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("fsmonitor-ran");
    let mut sb = LocalSandbox::create(&task(), Some(&dir.path().join("sandboxes"))).unwrap();
    // Wherever the layout puts it.
    let book = find_dir(sb.home().parent().unwrap(), "bookkeeping.git", 4)
        .expect("a bookkeeping git directory");
    let config_before = std::fs::read(book.join("config")).unwrap();
    let out = sb.run(
        &format!(
            "printf '[core]\\n\\tfsmonitor = \"touch {m}; echo\"\\n' >> '{b}/config'; \
             mkdir -p '{b}/info' && echo '* filter=evil' >> '{b}/info/attributes'; \
             echo changed > a.txt",
            b = book.display(),
            m = marker.display()
        ),
        T,
    );
    let config_after = std::fs::read(book.join("config")).unwrap();
    let attributes = std::fs::read_to_string(book.join("info/attributes")).unwrap_or_default();
    let diff = sb.diff();
    assert!(
        config_after == config_before && !attributes.contains("evil"),
        "a command wrote the bookkeeping git directory ({})",
        out.output
    );
    assert!(
        !marker.exists(),
        "the worker's git ran an fsmonitor a command configured"
    );
    assert!(diff.contains("+changed"), "{diff}");
}

/// The worker's own git reads no global config a command can edit: a clean filter there
/// (for a `.gitattributes` of the working copy) would run on the host, outside any sandbox,
/// when the submission is read.
#[test]
fn the_workers_git_reads_no_global_config_a_command_wrote() {
    if !bwrap_installed() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("filter-ran");
    let mut sb = LocalSandbox::create(&task(), Some(&dir.path().join("sandboxes"))).unwrap();
    let out = sb.run(
        &format!(
            "git config --global filter.evil.clean 'touch {m}; cat' && \
             git config --global filter.evil.required true && \
             printf '* filter=evil\\n' > .gitattributes && echo changed > a.txt",
            m = marker.display()
        ),
        T,
    );
    assert_eq!(out.exit_code, 0, "{}", out.output);
    let diff = sb.diff();
    let changed = sb.changed_files();
    assert!(
        !marker.exists(),
        "the worker's git ran a clean filter a command configured"
    );
    assert!(diff.contains("+changed"), "{diff}");
    assert_eq!(changed, vec![".gitattributes", "a.txt"]);
}

/// Files the worker reads or writes for a sandbox are never reached through a link a
/// command planted: the tools' current file (shown to the model), a repository file (read
/// by the teacher), the command file (written before every command).
#[test]
fn the_worker_follows_no_link_a_command_planted() {
    if !bwrap_installed() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = format!("s3cret-{}", rand::random::<u64>());
    let token = dir.path().join("auth-token");
    std::fs::write(&token, &secret).unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "untouched").unwrap();
    let mut sb = LocalSandbox::create(&task(), Some(&dir.path().join("sandboxes"))).unwrap();
    sb.run(
        &format!(
            "ln -sf '{t}' \"$TUTOR_STATE_DIR/current_file\"; ln -s '{t}' leak.txt; \
             ln -sf '{v}' \"$TUTOR_CMD_FILE\"",
            t = token.display(),
            v = victim.display()
        ),
        T,
    );
    let mut followed = Vec::new();
    if sb.current_file().unwrap_or_default().contains(&secret) {
        followed.push("the current file shown to the model is the token");
    }
    if sb
        .read_file("leak.txt")
        .unwrap_or_default()
        .contains(&secret)
    {
        followed.push("read_file followed a link out of the repository");
    }
    let out = sb.run("echo next", T);
    if std::fs::read_to_string(&victim).unwrap() != "untouched" {
        followed.push("the next command was written through a link");
    }
    assert!(followed.is_empty(), "{followed:?}");
    assert_eq!(out.output, "next\n");
}

/// Every command's processes are limited: processes per sandbox, address space, file
/// size, open files, CPU time; its `/dev/shm` is a 64 MiB tmpfs of its own.
#[test]
fn resource_limits_apply_to_every_command() {
    if !bwrap_installed() {
        return;
    }
    let mut sb = LocalSandbox::create(&task(), None).unwrap();
    let out = sb.run(
        "ulimit -u; ulimit -v; ulimit -f; ulimit -n; ulimit -t; df -k /dev/shm | tail -1",
        T,
    );
    let v: Vec<&str> = out.output.lines().collect();
    assert_eq!(v.len(), 6, "{}", out.output);
    let shm: Vec<&str> = v[5].split_whitespace().collect();
    assert_eq!(
        (shm[0], shm[1]),
        ("tmpfs", (64u64 << 10).to_string().as_str()),
        "/dev/shm: {}",
        out.output
    );
    assert_eq!(v[0], "256", "processes: {}", out.output);
    assert_eq!(v[1], (4u64 << 20).to_string(), "address space (KiB)");
    assert_eq!(v[2], (1u64 << 20).to_string(), "file size (KiB)");
    assert_eq!(v[3], "1024", "open files");
    assert_ne!(v[4], "unlimited", "CPU seconds");
}

/// A command has no network, not even the host's loopback: a server the test listens
/// with on 127.0.0.1 (where a coordinator or `tutor serve` on loopback needs no token)
/// cannot be reached, and the only interface inside is its own `lo`. Python's socket
/// module is used, as the model's commands would.
#[test]
fn a_command_has_no_network_not_even_the_hosts_loopback() {
    if !bwrap_installed() {
        return;
    }
    init_python();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let mut sb = LocalSandbox::create(&task(), None).unwrap();
    let out = sb.run(
        &format!(
            "python -c 'import socket\ntry:\n    socket.create_connection((\"127.0.0.1\", {port}), timeout=5)\n    print(\"R:connected\")\nexcept OSError as e:\n    print(\"R:refused\", e.errno)\nprint(\"R:ifaces\", \" \".join(n for _, n in socket.if_nameindex()))'"
        ),
        T,
    );
    let v: Vec<&str> = out
        .output
        .lines()
        .filter_map(|l| l.strip_prefix("R:"))
        .collect();
    assert_eq!(v.len(), 2, "{}", out.output);
    assert!(v[0].starts_with("refused"), "{}", out.output);
    assert!(
        listener.accept().is_err(),
        "the host's listener got a connection from the sandbox"
    );
    assert_eq!(v[1].trim(), "ifaces lo", "{}", out.output);
}

/// Writing past the file-size limit (1 GiB) fails, sparse so that no disk is used; below
/// it works.
#[test]
fn a_file_larger_than_the_limit_cannot_be_written() {
    if !bwrap_installed() {
        return;
    }
    let mut sb = LocalSandbox::create(&task(), None).unwrap();
    // The shell reports the processes killed by SIGXFSZ on its stderr: only `R:` lines
    // are results.
    let out = sb.run(
        "cd \"$TMPDIR\" && dd if=/dev/zero of=big bs=1M count=1 seek=1100 2>/dev/null; \
         echo \"R:rc=$?\"; echo \"R:$(stat -c %s big)\"; truncate -s 2G big2 2>/dev/null; \
         echo \"R:rc=$?\"; dd if=/dev/zero of=ok bs=1M count=1 seek=1000 2>/dev/null; \
         echo \"R:rc=$?\"; rm -f big big2 ok",
        T,
    );
    let v: Vec<&str> = out
        .output
        .lines()
        .filter_map(|l| l.strip_prefix("R:"))
        .collect();
    assert_eq!(v.len(), 4, "{}", out.output);
    assert_ne!(v[0], "rc=0", "a write past 1 GiB succeeded: {}", out.output);
    assert!(v[1].parse::<u64>().unwrap() <= 1 << 30, "{}", out.output);
    assert_ne!(v[2], "rc=0", "a 2 GiB truncate succeeded: {}", out.output);
    assert_eq!(
        v[3], "rc=0",
        "a write below the limit failed: {}",
        out.output
    );
}

/// `/dev` is read-only (it is a tmpfs of half the host's memory, which no memory ceiling
/// would count), while its devices work and `/dev/shm` (64 MiB of its own) is writable.
#[test]
fn dev_is_read_only_but_its_devices_and_shm_work() {
    if !bwrap_installed() {
        return;
    }
    let mut sb = LocalSandbox::create(&task(), None).unwrap();
    let out = sb.run("touch /dev/x 2>&1; echo rc=$?", T);
    assert!(
        out.output.contains("Read-only file system"),
        "{}",
        out.output
    );
    let out = sb.run(
        "echo hi > /dev/null && head -c 4 /dev/zero | wc -c && echo ok > /dev/shm/x && cat /dev/shm/x",
        T,
    );
    assert_eq!(
        (out.exit_code, out.output.as_str()),
        (0, "4\nok\n"),
        "{}",
        out.output
    );
}

/// A fork bomb (bounded by `timeout`) fills its own sandbox's process limit, not the host:
/// another sandbox forks meanwhile, the bomb's command ends within its timeout, and the
/// next command in the same sandbox works. The limit is checked first, so that where it
/// is missing the bomb never runs.
#[test]
fn a_fork_bomb_is_contained_to_its_sandbox() {
    if !bwrap_installed() {
        return;
    }
    let mut sb = LocalSandbox::create(&task(), None).unwrap();
    let out = sb.run("ulimit -u", T);
    assert_eq!(out.output.trim(), "256", "no process limit: not bombing");
    // Counted: forks fail at the limit.
    let out = sb.run(
        "python3 -c \"\nimport os, time\nn = 0\ntry:\n    for _ in range(600):\n        \
         if os.fork() == 0:\n            time.sleep(30)\n            os._exit(0)\n        \
         n += 1\nexcept OSError:\n    pass\nprint(n)\n\"",
        T,
    );
    let forked: u32 = out.output.trim().parse().unwrap_or(9999);
    assert!(forked < 256, "{} forks: {}", forked, out.output);

    let mut other = LocalSandbox::create(&task(), None).unwrap();
    let beside = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        let out = other.run(
            "for i in $(seq 50); do /bin/true || exit 1; done; echo fine",
            T,
        );
        (out.exit_code, out.output)
    });
    let t0 = Instant::now();
    let out = sb.run(
        "timeout -s KILL 6 bash -c ':(){ :|:& };:' >/dev/null 2>&1; echo bomb-over",
        T,
    );
    let took = t0.elapsed();
    assert!(!out.timed_out, "{}", out.output);
    assert!(took < T, "{took:?}");
    assert!(out.output.contains("bomb-over"), "{}", out.output);
    let (code, output) = beside.join().unwrap();
    assert_eq!(
        (code, output.as_str()),
        (0, "fine\n"),
        "another sandbox could not fork during the bomb"
    );
    let out = sb.run("echo still-here", T);
    assert_eq!(out.output, "still-here\n");
}

/// `[worker] allow_unconfined` exists, is off unless set, and is the only new key.
#[test]
fn allow_unconfined_is_a_worker_setting_off_by_default() {
    let c: WorkerConfig = serde_json::from_str("{}").unwrap();
    let v = serde_json::to_value(&c).unwrap();
    assert_eq!(v["allow_unconfined"], serde_json::Value::Bool(false));
    let c: WorkerConfig = serde_json::from_str(r#"{"allow_unconfined": true}"#).unwrap();
    let v = serde_json::to_value(&c).unwrap();
    assert_eq!(v["allow_unconfined"], serde_json::Value::Bool(true));
}

/// `[worker] min_free_disk_mb` is on by default (1024), and a worker whose sandbox disk
/// is already under it refuses to start, naming the directory and the setting, instead
/// of starting episodes that would all stop at their first command.
#[test]
fn a_worker_refuses_to_start_on_a_disk_under_its_floor() {
    let c: WorkerConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(c.min_free_disk_mb, 1024);
    let root = tempfile::tempdir().unwrap();
    let mut c = WorkerConfig {
        sandbox_root: Some(root.path().join("sandboxes")),
        allow_unconfined: true,
        ..Default::default()
    };
    c.preflight()
        .expect("this machine has 1 GiB free for the test");
    // No disk has an exbibyte free.
    c.min_free_disk_mb = 1 << 40;
    let e = format!("{:#}", c.preflight().unwrap_err());
    assert!(
        e.contains("min_free_disk_mb") && e.contains("sandboxes") && e.contains("MiB free"),
        "{e}"
    );
    c.min_free_disk_mb = 0;
    c.preflight().unwrap();
}

fn find_dir(root: &Path, name: &str, depth: usize) -> Option<PathBuf> {
    for e in std::fs::read_dir(root).ok()?.flatten() {
        let p = e.path();
        if !e.file_type().ok()?.is_dir() {
            continue;
        }
        if e.file_name() == name {
            return Some(p);
        }
        if depth > 0 {
            if let Some(f) = find_dir(&p, name, depth - 1) {
                return Some(f);
            }
        }
    }
    None
}

/// Kills its child when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
