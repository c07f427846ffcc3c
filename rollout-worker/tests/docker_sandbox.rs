//! The Docker sandbox against the real engine: persistent shell, timeouts, output caps,
//! no network, diff, cleanup, and the container's limits (ulimits, disk quota, read-only
//! root, swap; docs/security.md, "Docker sandbox"). Needs the image from `make images`; skips (saying so) only
//! when no Docker engine is reachable.

use std::time::{Duration, Instant};

use tutor_rollout_worker::sandbox::docker::{self, ContainerSpec, DockerError, DockerSandbox};
use tutor_rollout_worker::sandbox::{LeftOutReason, Submission, MAX_SUBMISSION_BYTES};

const IMAGE: &str = "tutor/python-task:latest";

async fn engine() -> Option<bollard::Docker> {
    match docker::connect().await {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIPPED: no Docker engine reachable: {e}");
            None
        }
    }
}

fn task() -> tutor_rollout_worker::tasks::TaskRecord {
    tutor_rollout_worker::toy::generate(1, 11).remove(0)
}

fn spec(run: &str, episode: &str) -> ContainerSpec {
    ContainerSpec::new(IMAGE, run, "test-worker", episode)
}

async fn sandbox(d: &bollard::Docker, run: &str) -> DockerSandbox {
    match DockerSandbox::create(d, &spec(run, "e1"), &task()).await {
        Ok(s) => s,
        Err(e @ DockerError::MissingImage(_)) => panic!("{e}"),
        Err(e) => panic!("creating the sandbox: {e}"),
    }
}

async fn containers_of(d: &bollard::Docker, run: &str) -> usize {
    let filters = std::collections::HashMap::from([(
        "label".to_string(),
        vec![format!("{}={run}", docker::LABEL_RUN)],
    )]);
    d.list_containers(Some(
        bollard::query_parameters::ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build(),
    ))
    .await
    .unwrap()
    .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_shell_keeps_state_and_reports_exit_codes() {
    let Some(d) = engine().await else { return };
    let run = format!("test-shell-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    let t = Duration::from_secs(20);
    let out = sb.run("pwd && ls", t).await;
    assert_eq!(out.exit_code, 0, "{}", out.output);
    assert!(out.output.starts_with("/testbed\n"), "{}", out.output);
    assert!(out.output.contains("tests"), "{}", out.output);
    let out = sb.run("cd tests && export FOO=bar", t).await;
    assert_eq!(out.exit_code, 0);
    assert_eq!(sb.cwd(), "/testbed/tests");
    let out = sb.run("pwd", t).await;
    assert_eq!(out.output.trim(), "/testbed/tests");
    assert_eq!(sb.run("false", t).await.exit_code, 1);
    assert_eq!(sb.run("exit 3", t).await.exit_code, 3);
    let out = sb.run("echo to-stderr >&2; printf 'no newline'", t).await;
    assert!(
        out.output.contains("to-stderr") && out.output.ends_with("no newline"),
        "{:?}",
        out.output
    );
    // Quotes, a here-document and backslashes reach bash unchanged.
    let out = sb
        .run(
            "printf '%s|' \"a'b\" 'c\"d' 'e\\f'; cat <<'EOF'\nx $HOME `y`\nEOF",
            t,
        )
        .await;
    assert_eq!(
        out.output, "a'b|c\"d|e\\f|x $HOME `y`\n",
        "{:?}",
        out.output
    );
    // Tests run in the container with the image's pytest.
    let out = sb
        .run(
            "cd /testbed && python -m pytest -q tests 2>&1 | tail -1",
            Duration::from_secs(60),
        )
        .await;
    assert!(
        out.output.contains("passed") || out.output.contains("failed"),
        "{}",
        out.output
    );
    // No network: only the loopback interface exists.
    let out = sb.run("cat /proc/net/dev", t).await;
    let ifaces: Vec<&str> = out
        .output
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(ifaces, vec!["lo"], "{}", out.output);
    sb.remove().await;
    assert_eq!(containers_of(&d, &run).await, 0);
}

/// The end-of-command framing cannot be forged from inside a command (issue 15): the
/// marker was `__TUTOR_DONE_<counter>_<worker pid>__` and the function's `$2`, so a
/// command could print a fake end with exit 0 (a failing test run reported as passing),
/// or hold a line equal to the next marker, which ended the here-document early and ran
/// the rest of the command in the shell itself, outside the watchdog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_cannot_forge_the_end_of_its_output() {
    let Some(d) = engine().await else { return };
    let run = format!("test-forge-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    let t = Duration::from_secs(20);
    // Neither the marker nor the deadline is visible to the command.
    let out = sb
        .run("echo \"[$1][$2][${__mark-unset}][${__secs-unset}]\"", t)
        .await;
    assert_eq!(out.output.trim(), "[][][unset][unset]", "{:?}", out.output);
    // Old-style markers for the next few commands, printed and as lines of the command.
    let pid = std::process::id();
    let mut fake = String::new();
    for n in 0..8 {
        fake.push_str(&format!(
            "printf '\\n__TUTOR_DONE_{n}_{pid}__ 0\\t/testbed\\t\\n'\n"
        ));
    }
    let cmd = format!("{fake}echo after-the-fake-ends; exit 3");
    let out = sb.run(&cmd, t).await;
    assert_eq!(out.exit_code, 3, "{:?}", out.output);
    assert!(
        out.output.contains("after-the-fake-ends"),
        "{:?}",
        out.output
    );
    let lines: String = (0..8)
        .map(|n| format!("__TUTOR_DONE_{n}_{pid}__\n"))
        .collect();
    let out = sb
        .run(
            &format!("echo in-command\n{lines}touch /tmp/ran-in-the-shell; exit 4"),
            t,
        )
        .await;
    assert_eq!(out.exit_code, 4, "{:?}", out.output);
    let out = sb.run("echo next", t).await;
    assert_eq!(
        (out.exit_code, out.output.trim()),
        (0, "next"),
        "the shell stays in step"
    );
    sb.remove().await;
}

/// Builds tests/fixtures/swebench-mimic with a one-commit repository as /testbed and no
/// python3 on the default PATH (issue 15, item 2).
fn build_mimic_without_system_python(tag: &str) {
    build_mimic(tag, &["HIDE_SYSTEM_PYTHON=1"]);
}

/// The SWE-bench-like fixture image (tests/fixtures/swebench-mimic) with `build_args`.
fn build_mimic(tag: &str, build_args: &[&str]) {
    use std::process::Command;
    let ctx = tempfile::tempdir().unwrap();
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/swebench-mimic");
    for f in ["Dockerfile", "activate"] {
        std::fs::copy(fixture.join(f), ctx.path().join(f)).unwrap();
    }
    let repo = ctx.path().join("testbed");
    std::fs::create_dir_all(repo.join("pkg")).unwrap();
    std::fs::write(repo.join("pkg/text.py"), "def f():\n    return 1\n").unwrap();
    for args in [
        &["init", "-q"][..],
        &["add", "-A"],
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-q",
            "-m",
            "base",
        ],
    ] {
        let ok = Command::new("git")
            .current_dir(&repo)
            .args(args)
            .status()
            .unwrap();
        assert!(ok.success(), "git {args:?}");
    }
    let mut build = Command::new("docker");
    build.args(["build", "-q", "-t", tag]);
    for a in build_args {
        build.args(["--build-arg", a]);
    }
    let o = build.arg(ctx.path()).output().unwrap();
    assert!(
        o.status.success(),
        "docker build of {tag} (base tutor/base:bookworm from `make images`): {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A SWE-bench-style image as it is: the agent's commands run with its conda env
/// activated (`python` exists only there), and the tools work although the image has no
/// python3 on the default PATH (the shims find /opt/miniconda3's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swebench_style_image_runs_commands_in_its_environment() {
    let Some(d) = engine().await else { return };
    let tag = "tutor/test-swebench-mimic:nopython";
    build_mimic_without_system_python(tag);
    let run = format!("test-mimic-{}", std::process::id());
    let task = tutor_rollout_worker::tasks::TaskRecord {
        instance_id: "mimic-1".into(),
        repo: "django/django".into(),
        ..Default::default()
    };
    let mut sb = DockerSandbox::create(
        &d,
        &ContainerSpec::new(tag, &run, "test-worker", "e1"),
        &task,
    )
    .await
    .unwrap();
    let t = Duration::from_secs(30);
    let out = sb
        .run(
            "env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin sh -c \
             'command -v python3 || echo no-system-python3'; \
             python -c 'import sys; print(\"major\", sys.version_info[0])'; \
             echo \"env=$CONDA_DEFAULT_ENV\"",
            t,
        )
        .await;
    assert_eq!(out.exit_code, 0, "{}", out.output);
    for want in ["no-system-python3", "major 3", "env=testbed"] {
        assert!(out.output.contains(want), "{want}: {}", out.output);
    }
    let out = sb.run("find_file text.py && open pkg/text.py", t).await;
    assert_eq!(out.exit_code, 0, "{}", out.output);
    assert!(out.output.contains("return 1"), "{}", out.output);
    sb.remove().await;
}

/// An image that keeps its repository elsewhere than /testbed and names its own
/// (numeric, non-root) user: the sandbox works in the image's WORKDIR, as the image's
/// user where the worker takes it (`container_user = "image"`), and the submission is
/// the diff there. An image running as root is refused for `"image"`, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_with_its_own_workdir_and_user_is_used_as_it_is() {
    let Some(d) = engine().await else { return };
    let tag = "tutor/test-swebench-mimic:workdir";
    build_mimic(tag, &["REPO_DIR=/work/project", "IMAGE_USER=1234:1234"]);
    let run = format!("test-workdir-{}", std::process::id());
    let task = tutor_rollout_worker::tasks::TaskRecord {
        instance_id: "workdir-1".into(),
        ..Default::default()
    };
    let mut spec = ContainerSpec::new(tag, &run, "test-worker", "e1");
    spec.user_from_image = true;
    let mut sb = DockerSandbox::create(&d, &spec, &task).await.unwrap();
    let t = Duration::from_secs(30);
    let out = sb.run("pwd; id -u; echo \"repo=$TUTOR_REPO\"", t).await;
    assert_eq!(out.exit_code, 0, "{}", out.output);
    for want in ["/work/project\n", "1234\n", "repo=/work/project"] {
        assert!(out.output.contains(want), "{want:?}: {}", out.output);
    }
    let out = sb
        .run("open pkg/text.py && replace 'return 1' 'return 2'", t)
        .await;
    assert!(out.output.contains("return 2"), "{}", out.output);
    let sub = sb.submission().await;
    assert!(
        sub.patch.contains("a/pkg/text.py") && sub.patch.contains("+    return 2"),
        "{}",
        sub.patch
    );
    sb.remove().await;

    // The stock mimic runs as root: "image" refuses it.
    let root_tag = "tutor/test-swebench-mimic:root";
    build_mimic(root_tag, &[]);
    let mut spec = ContainerSpec::new(root_tag, &run, "test-worker", "e2");
    spec.user_from_image = true;
    let err = match DockerSandbox::create(&d, &spec, &task).await {
        Ok(mut sb) => {
            sb.remove().await;
            panic!("an image running as root was taken for container_user = \"image\"");
        }
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(root_tag) && err.contains("non-root") && err.contains("container_user"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_command_is_killed_and_the_shell_stays_usable() {
    let Some(d) = engine().await else { return };
    let run = format!("test-timeout-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    let start = Instant::now();
    let out = sb
        .run("sleep 1000 & sleep 1000", Duration::from_secs(2))
        .await;
    assert!(out.timed_out, "{out:?}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    let out = sb
        .run(
            "echo alive; pgrep -fc 'sleep 1000' || true",
            Duration::from_secs(10),
        )
        .await;
    assert!(
        out.output.starts_with("alive\n0"),
        "the shell works and no sleep survived: {:?}",
        out.output
    );
    sb.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_output_is_truncated_not_buffered() {
    let Some(d) = engine().await else { return };
    let run = format!("test-output-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    let out = sb
        .run(
            "head -c 20000000 /dev/zero | tr '\\0' x; echo; echo END",
            Duration::from_secs(60),
        )
        .await;
    assert_eq!(out.exit_code, 0);
    assert!(
        out.output.len() < 2_000_000,
        "{} bytes kept",
        out.output.len()
    );
    assert!(out.output.trim_end().ends_with("END"), "the tail is kept");
    assert!(
        out.output.contains("dropped") || out.output.contains("elided"),
        "the cut is marked"
    );
    let out = sb.run("echo next", Duration::from_secs(10)).await;
    assert_eq!(out.output.trim(), "next");
    sb.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diff_has_edits_and_new_files_and_orphans_are_removed() {
    let Some(d) = engine().await else { return };
    let run = format!("test-diff-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    let t = Duration::from_secs(20);
    let first = task()
        .files
        .iter()
        .find(|f| f.path.ends_with(".py") && !f.path.starts_with("tests"))
        .unwrap()
        .path
        .clone();
    sb.run(
        &format!("echo '# touched' >> {first} && echo 'x = 1' > new_file.py && git add {first}"),
        t,
    )
    .await;
    let diff = sb.diff().await;
    assert!(
        diff.contains(&format!("+++ b/{first}")) && diff.contains("+# touched"),
        "{diff}"
    );
    assert!(diff.contains("+++ b/new_file.py"), "{diff}");
    // A worker killed with -9 leaves its container; the next one removes it by label.
    std::mem::forget(sb);
    assert_eq!(containers_of(&d, &run).await, 1);
    let removed = docker::remove_orphans(&d, &run, Some("test-worker"))
        .await
        .unwrap();
    assert_eq!(removed, 1);
    assert_eq!(containers_of(&d, &run).await, 0);
}

/// The submission is read with git after the agent's last command, outside its timeout,
/// through execs that cannot be killed: an fsmonitor hook or a clean filter the agent
/// configured must not run (nor hang the worker), and the diff is still the agent's
/// change. The agent tries every config git reads: the repository's, its global one (its
/// `$HOME` and the execs' `HOME`, `/tmp/.tutor`), and the bookkeeping git directory's own
/// config and attributes, which it can neither write nor enter (another user's, 0700).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookkeeping_git_runs_nothing_the_agent_configured() {
    let Some(d) = engine().await else { return };
    let run = format!("test-book-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    let t = Duration::from_secs(20);
    let out = sb
        .run(
            "mkdir -p /tmp/marks && chmod 777 /tmp/marks \
             && git config core.fsmonitor 'touch /tmp/marks/fsmonitor; echo' \
             && git config filter.evil.clean 'touch /tmp/marks/clean; sleep 30; cat' \
             && git config filter.evil.required true \
             && for h in \"$HOME\" /tmp/.tutor; do \
                  HOME=$h git config --global filter.evil.clean 'touch /tmp/marks/global; sleep 30; cat'; \
                  HOME=$h git config --global filter.evil.required true; done \
             && printf '* filter=evil\\n' > .gitattributes && echo 'x = 1' > new_file.py",
            t,
        )
        .await;
    assert_eq!(out.exit_code, 0, "{}", out.output);
    let book = sb
        .run(
            "git config --file /tmp/.tutor-book/bookkeeping.git/config filter.evil.clean \
             'touch /tmp/marks/book; cat' 2>&1; echo '* filter=evil' \
             >> /tmp/.tutor-book/bookkeeping.git/info/attributes 2>&1; ls /tmp/.tutor-book 2>&1",
            t,
        )
        .await;
    assert!(
        book.output.matches("Permission denied").count() >= 3,
        "the agent reached the bookkeeping git directory: {}",
        book.output
    );
    let started = Instant::now();
    let diff = sb.diff().await;
    let changed = sb.changed_files().await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the agent's clean filter ran (it sleeps 30 s)"
    );
    let marks = sb.run("ls -A /tmp/marks", t).await;
    assert_eq!(marks.output, "", "the agent's git configuration ran");
    assert!(
        diff.contains("+++ b/new_file.py") && diff.contains("+x = 1"),
        "{diff}"
    );
    assert_eq!(
        changed,
        vec![".gitattributes".to_string(), "new_file.py".to_string()]
    );
    let files = sb.apply_to_base(&diff).await.unwrap();
    assert_eq!(files["new_file.py"].as_deref(), Some("x = 1\n"));
    // The patch applied for the oracle is nowhere the agent can read it.
    let seen = sb
        .run(
            "cat /tmp/.tutor/oracle.patch /tmp/.tutor-book/oracle.patch 2>&1",
            t,
        )
        .await;
    assert!(!seen.output.contains("x = 1"), "{}", seen.output);
    sb.remove().await;
}

/// A file the agent makes unreadable to others (mode 0600) is left out of its
/// submission, not the whole submission (the bookkeeping user cannot read it); the
/// rest of the change is the patch, and the changed files are listed without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_file_is_left_out_not_the_whole_submission() {
    let Some(d) = engine().await else { return };
    let run = format!("test-unreadable-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    let t = Duration::from_secs(20);
    let out = sb
        .run(
            "echo 'y = 2' > fix.py && echo secret > hidden.txt && chmod 600 hidden.txt",
            t,
        )
        .await;
    assert_eq!(out.exit_code, 0, "{}", out.output);
    let sub = sb.submission().await;
    assert!(sub.patch.contains("+++ b/fix.py"), "{sub:?}");
    assert!(!sub.patch.contains("hidden.txt"), "{}", sub.patch);
    assert_eq!(sb.changed_files().await, vec!["fix.py".to_string()]);
    sb.remove().await;
}

/// An agent that leaves a compiled binary (with an odd name), a large untracked file and
/// 6 MB of generated text files (300 of 20 KiB) beside its fix: the submission is "too
/// large", with no patch (inside the container git's output goes through `head -c`, so no
/// more than the cap + 1 bytes ever leave it), and the left-out paths are named. Once the
/// generated files are gone, the patch is the text fix alone. Before, the whole diff,
/// binary included, came back as the patch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_submission_is_too_large_and_binaries_are_left_out() {
    let Some(d) = engine().await else { return };
    let run = format!("test-submission-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    let t = Duration::from_secs(60);
    let out = sb
        .run(
            "echo '# touched' >> README.md && printf '\\177ELF\\0\\1' > $'-lib\\n(x).so' \
             && head -c 2000000 /dev/zero | tr '\\0' x > 'big file.txt' && mkdir -p gen \
             && awk 'BEGIN { l = sprintf(\"%099d\", 0); for (i = 0; i < 300; i++) { \
                  f = \"gen/f\" i \".txt\"; for (j = 0; j < 205; j++) print l > f; close(f) } }'",
            t,
        )
        .await;
    assert_eq!(out.exit_code, 0, "{}", out.output);
    let left = |sub: &Submission| {
        let mut l: Vec<(String, LeftOutReason)> = sub
            .left_out
            .iter()
            .map(|l| (l.path.clone(), l.reason))
            .collect();
        l.sort_by(|a, b| a.0.cmp(&b.0));
        l
    };
    let expected = vec![
        ("-lib\n(x).so".to_string(), LeftOutReason::Binary),
        ("big file.txt".to_string(), LeftOutReason::Large(2_000_000)),
    ];

    let sub = sb.submission().await;
    assert_eq!(sub.too_large, Some(MAX_SUBMISSION_BYTES as u64 + 1));
    assert_eq!(sub.patch, "");
    assert_eq!(left(&sub), expected);
    assert_eq!(sub.left_out_total, 2);
    let note = sub.too_large_note().unwrap();
    assert!(note.contains(&MAX_SUBMISSION_BYTES.to_string()), "{note}");

    let out = sb.run("rm -rf gen", t).await;
    assert_eq!(out.exit_code, 0, "{}", out.output);
    let sub = sb.submission().await;
    assert_eq!(sub.too_large, None);
    assert!(sub.patch.contains("+# touched"), "{}", sub.patch);
    assert!(sub.patch.len() < 2000, "{}", sub.patch);
    assert_eq!(left(&sub), expected);
    let files = sb.apply_to_base(&sub.patch).await.unwrap();
    assert_eq!(files.keys().collect::<Vec<_>>(), vec!["README.md"]);
    assert_eq!(sb.diff().await, sub.patch);
    sb.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_image_is_a_clear_error() {
    let Some(d) = engine().await else { return };
    let mut s = spec("test-missing", "e1");
    s.image = "tutor/does-not-exist:0".into();
    let err = DockerSandbox::create(&d, &s, &task())
        .await
        .err()
        .expect("must fail");
    assert!(
        err.to_string().contains("tutor/does-not-exist:0")
            && err.to_string().contains("make images"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_hits_the_pid_limit_and_the_sandbox_survives() {
    let Some(d) = engine().await else { return };
    let run = format!("test-forkbomb-{}", std::process::id());
    let mut s = spec(&run, "e1");
    s.pids_limit = 64;
    let mut sb = DockerSandbox::create(&d, &s, &task()).await.unwrap();
    let start = Instant::now();
    let out = sb
        .run("b() { b | b & }; b; sleep 30", Duration::from_secs(5))
        .await;
    assert!(out.timed_out, "{out:?}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
    // The bomb's processes die with the command (its process group is killed); the
    // shell answers again once they are gone.
    let mut alive = String::new();
    for _ in 0..20 {
        alive = sb.run("echo alive", Duration::from_secs(10)).await.output;
        if alive.trim() == "alive" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(alive.trim(), "alive");
    sb.remove().await;
    assert_eq!(containers_of(&d, &run).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_network_is_unreachable_by_default() {
    let Some(d) = engine().await else { return };
    let run = format!("test-net-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    let out = sb
        .run(
            "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)\"; \
             echo rc=$?; cat /sys/class/net/*/operstate 2>/dev/null | sort | tr '\\n' ' '; echo; ls /sys/class/net",
            Duration::from_secs(20),
        )
        .await;
    assert!(out.output.contains("rc=1"), "{}", out.output);
    assert!(
        out.output.contains("Network is unreachable") || out.output.contains("OSError"),
        "{}",
        out.output
    );
    // Only the loopback interface exists.
    assert_eq!(
        out.output.lines().last().unwrap().trim(),
        "lo",
        "{}",
        out.output
    );
    sb.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_jobs_end_with_their_command_as_in_the_local_sandbox() {
    let Some(d) = engine().await else { return };
    let run = format!("test-bg-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    let t = Duration::from_secs(20);
    let out = sb.run("sleep 1000 & echo started", t).await;
    assert_eq!(
        (out.output.trim(), out.exit_code),
        ("started", 0),
        "{out:?}"
    );
    let out = sb.run("pgrep -fc 'sleep 1000' || true", t).await;
    assert_eq!(
        out.output.trim(),
        "0",
        "a background job outlived its command"
    );
    sb.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_kills_the_watchdog_does_not_lift_the_deadline() {
    let Some(d) = engine().await else { return };
    let run = format!("test-watchdog-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    // The shell's one watchdog job is a process the agent can see and kill.
    let out = sb
        .run(
            "kill -KILL \"$__tutor_wd\" && echo killed",
            Duration::from_secs(20),
        )
        .await;
    assert_eq!(out.output.trim(), "killed", "{out:?}");
    // The next command gets a new watchdog, so its deadline still holds: killed in the
    // container (exit 137), not abandoned by the caller's own deadline (a sandbox error).
    let out = sb.run("sleep 1000", Duration::from_secs(2)).await;
    assert!(out.timed_out, "{out:?}");
    let out = sb.run("echo alive", Duration::from_secs(10)).await;
    assert_eq!(out.output.trim(), "alive");
    sb.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_removed_behind_the_sandboxs_back_counts_as_removed() {
    let Some(d) = engine().await else { return };
    let run = format!("test-gone-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    d.remove_container(
        sb.id(),
        Some(
            bollard::query_parameters::RemoveContainerOptionsBuilder::default()
                .force(true)
                .build(),
        ),
    )
    .await
    .unwrap();
    assert!(!sb.is_removed());
    let started = Instant::now();
    sb.remove().await;
    assert!(sb.is_removed(), "the engine's 404 was taken for a failure");
    // Not retried: gone is gone.
    assert!(
        started.elapsed() < Duration::from_millis(250),
        "{:?}",
        started.elapsed()
    );
}

/// What `tutor eval` and a stopping worker do last: every container still labelled with
/// the factory's run and worker goes, whatever left it behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_factory_removes_its_leftover_containers() {
    if engine().await.is_none() {
        return;
    }
    let run = format!("test-leftover-{}", std::process::id());
    let config = tutor_rollout_worker::worker::WorkerConfig {
        sandbox: tutor_rollout_worker::worker::SandboxKind::Docker,
        image: IMAGE.into(),
        ..Default::default()
    };
    let factory = config.sandboxes(&run, "w-left").await.unwrap();
    let f = factory.clone();
    tokio::task::spawn_blocking(move || {
        let sb = f.create(&task(), "e1").unwrap();
        // As if its removal had failed: the handle goes without removing the container.
        std::mem::forget(sb);
    })
    .await
    .unwrap();
    let d = engine().await.unwrap();
    assert_eq!(containers_of(&d, &run).await, 1);
    assert_eq!(factory.remove_leftovers().await, 1);
    assert_eq!(containers_of(&d, &run).await, 0);
    assert_eq!(factory.remove_leftovers().await, 0);
}

/// Creates a sandbox with `spec` for the toy task.
async fn sandbox_with(d: &bollard::Docker, spec: &ContainerSpec) -> DockerSandbox {
    match DockerSandbox::create(d, spec, &task()).await {
        Ok(s) => s,
        Err(e) => panic!("creating the sandbox: {e}"),
    }
}

/// `ulimit -n` and `ulimit -f` hold in the agent's shell: a file past the size limit is
/// cut there (bash's redirect: "File size limit exceeded", exit 153; Python, which ignores
/// SIGXFSZ: EFBIG), and opening more files than the limit fails. Before, the engine's
/// defaults (a million open files, no file size limit) applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ulimits_cap_open_files_and_file_size() {
    let Some(d) = engine().await else { return };
    let run = format!("test-ulimit-{}", std::process::id());
    let mut s = spec(&run, "e1");
    s.fsize_bytes = 8 << 20;
    let mut sb = sandbox_with(&d, &s).await;
    let t = Duration::from_secs(30);
    let out = sb
        .run("ulimit -Sn; ulimit -Hn; ulimit -Sf; ulimit -Hf", t)
        .await;
    // bash shows the file size limit in blocks of 1024 bytes.
    assert_eq!(out.output, "1024\n1024\n8192\n8192\n", "{out:?}");
    let out = sb
        .run(
            "head -c 9M /dev/zero > big.bin; echo rc=$?; stat -c %s big.bin",
            t,
        )
        .await;
    assert!(
        out.output.contains("rc=153") && out.output.contains(&format!("\n{}\n", 8 << 20)),
        "{out:?}"
    );
    let out = sb
        .run(
            "python3 -c \"open('big2.bin', 'wb').write(b'x' * (9 << 20))\" 2>&1 | tail -1; \
             python3 -c \"fs = [open('README.md') for _ in range(2000)]\" 2>&1 | tail -1",
            t,
        )
        .await;
    assert!(out.output.contains("File too large"), "{out:?}");
    assert!(out.output.contains("Too many open files"), "{out:?}");
    // Set on the container, so every exec has them (the shell is one, as are the
    // worker's own git and file reads).
    let host = d
        .inspect_container(sb.id(), None)
        .await
        .unwrap()
        .host_config
        .unwrap();
    let mut ulimits: Vec<(String, i64, i64)> = host
        .ulimits
        .unwrap_or_default()
        .into_iter()
        .map(|u| (u.name.unwrap(), u.soft.unwrap(), u.hard.unwrap()))
        .collect();
    ulimits.sort();
    assert_eq!(
        ulimits,
        vec![
            ("fsize".to_string(), 8 << 20, 8 << 20),
            ("nofile".to_string(), 1024, 1024)
        ]
    );
    assert_eq!(sb.run("echo alive", t).await.output.trim(), "alive");
    sb.remove().await;
}

/// The writable places are capped: /testbed at `disk_bytes`, /tmp at `tmp_bytes`.
/// Writing past them fails with ENOSPC inside the container (the host's disk is never
/// touched), and the sandbox works again once the file is gone. Before, 200 MB went to
/// the host's disk through the container's writable layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_past_the_disk_quota_fail_with_no_space_left() {
    let Some(d) = engine().await else { return };
    let run = format!("test-quota-{}", std::process::id());
    let mut s = spec(&run, "e1");
    s.disk_bytes = 128 << 20;
    s.tmp_bytes = 32 << 20;
    let mut sb = sandbox_with(&d, &s).await;
    let t = Duration::from_secs(60);
    let started = Instant::now();
    let out = sb
        .run(
            "dd if=/dev/zero of=/testbed/fill bs=1M count=200 2>&1 | grep -v records; echo rc=${PIPESTATUS[0]}; \
             dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>&1 | grep -v records; echo rc=${PIPESTATUS[0]}",
            t,
        )
        .await;
    assert_eq!(
        out.output.matches("No space left on device").count(),
        2,
        "{out:?}"
    );
    assert_eq!(out.output.matches("rc=1").count(), 2, "{out:?}");
    let out = sb
        .run(
            "stat -c %s /testbed/fill /tmp/fill; df -B1 --output=size /testbed /tmp | tail -2",
            t,
        )
        .await;
    let sizes: Vec<u64> = out
        .output
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    assert!(
        sizes[0] <= 128 << 20 && sizes[1] <= 32 << 20,
        "{:?}",
        out.output
    );
    assert_eq!(sizes[2..], [128 << 20, 32 << 20], "{:?}", out.output);
    // Room again: the shell, git and the submission work.
    let out = sb
        .run(
            "rm /testbed/fill /tmp/fill && echo 'x = 1' > new_file.py",
            t,
        )
        .await;
    assert_eq!(out.exit_code, 0, "{out:?}");
    assert!(sb.diff().await.contains("+x = 1"));
    eprintln!("quota test: {:?}", started.elapsed());
    sb.remove().await;
}

/// The root filesystem is read-only: only /testbed, /tmp and /dev/shm take writes. For
/// the unprivileged agent the image's home directory and /var/tmp were writable before;
/// for an agent running as root (capabilities dropped, but the owner of /etc and
/// site-packages) /etc and the Python packages were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_root_filesystem_is_read_only_outside_the_writable_places() {
    let Some(d) = engine().await else { return };
    let run = format!("test-rootfs-{}", std::process::id());
    let t = Duration::from_secs(30);
    let writes = |paths: &[&str]| {
        paths
            .iter()
            .map(|p| format!("(echo x > {p}) 2>&1 | sed 's/.*: //'; "))
            .collect::<String>()
    };
    let mut sb = sandbox(&d, &run).await;
    let out = sb
        .run(&writes(&["/home/agent/.bashrc", "/var/tmp/x", "/x"]), t)
        .await;
    assert_eq!(
        out.output,
        "Read-only file system\n".repeat(3),
        "{:?}",
        out.output
    );
    let out = sb
        .run(
            "echo a > /testbed/a && echo b > /tmp/b && echo c > /dev/shm/c && cat /testbed/a /tmp/b /dev/shm/c",
            t,
        )
        .await;
    assert_eq!(out.output, "a\nb\nc\n", "{out:?}");
    let host = d
        .inspect_container(sb.id(), None)
        .await
        .unwrap()
        .host_config
        .unwrap();
    assert_eq!(host.readonly_rootfs, Some(true));
    sb.remove().await;

    let mut s = spec(&run, "e2");
    s.user = (0, 0);
    let mut sb = sandbox_with(&d, &s).await;
    let out = sb
        .run(
            &format!(
                "{}{}",
                writes(&["/etc/passwd", "/usr/bin/python3"]),
                "touch \"$(python3 -c 'import os; print(os.path.dirname(os.__file__))')/evil.py\" 2>&1 | sed 's/.*: //'"
            ),
            t,
        )
        .await;
    assert_eq!(
        out.output,
        "Read-only file system\n".repeat(3),
        "{:?}",
        out.output
    );
    let out = sb.run("echo 'x = 1' > new_file.py && id -u", t).await;
    assert_eq!(out.output, "0\n", "{out:?}");
    assert!(sb.diff().await.contains("+x = 1"));
    sb.remove().await;
    assert_eq!(containers_of(&d, &run).await, 0);
}

/// The peak resident memory of this process, in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// The worker's own execs (here `cat` through `read_file`) take at most
/// `EXEC_OUTPUT_CAP` bytes: a file of 100 MB, or a symlink to /dev/zero, is "no file",
/// quickly, and the worker's memory stays where it was; the sandbox keeps working.
/// Before, the whole output was buffered (twice: bytes, then the string), and /dev/zero
/// never ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_internal_exec_with_huge_output_is_capped() {
    let Some(d) = engine().await else { return };
    let run = format!("test-execcap-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    let t = Duration::from_secs(60);
    let out = sb
        .run(
            "yes | head -c 100M > big.txt && ln -s /dev/zero zero.txt && echo small > small.txt",
            t,
        )
        .await;
    assert_eq!(out.exit_code, 0, "{out:?}");
    let before = peak_rss();
    let started = Instant::now();
    // (Lengths only: a failure must not print 100 MB.)
    let big = sb.read_file("big.txt").await.map(|s| s.len());
    assert_eq!(big, None, "bytes of big.txt read");
    let zero = sb.read_file("zero.txt").await.map(|s| s.len());
    assert_eq!(zero, None, "bytes of zero.txt read");
    let took = started.elapsed();
    let grew = peak_rss().saturating_sub(before);
    assert!(
        grew < 3 * docker::EXEC_OUTPUT_CAP as u64,
        "the worker's peak memory grew by {grew} bytes"
    );
    assert!(took < Duration::from_secs(30), "{took:?}");
    // The commands were stopped in the container, not left writing.
    let out = sb
        .run("pgrep -c -x cat || true; pgrep -c -x yes || true", t)
        .await;
    assert_eq!(out.output, "0\n0\n", "{out:?}");
    assert_eq!(sb.read_file("small.txt").await.as_deref(), Some("small\n"));
    assert_eq!(sb.run("echo alive", t).await.output.trim(), "alive");
    eprintln!("exec cap: two reads in {took:?}, peak memory +{grew} bytes");
    sb.remove().await;
}

/// No swap beyond the memory limit: `memory_swap` equals `memory`, and the container's
/// memory cgroup says so (cgroup v1: memsw = memory; v2: swap.max = 0). Before,
/// Docker's default allowed as much swap again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swap_is_limited_to_the_memory_limit() {
    let Some(d) = engine().await else { return };
    let run = format!("test-swap-{}", std::process::id());
    let mut s = spec(&run, "e1");
    s.memory_bytes = 512 << 20;
    let mut sb = sandbox_with(&d, &s).await;
    let host = d
        .inspect_container(sb.id(), None)
        .await
        .unwrap()
        .host_config
        .unwrap();
    assert_eq!(host.memory, Some(512 << 20));
    assert_eq!(host.memory_swap, Some(512 << 20));
    let out = sb
        .run(
            "cd /sys/fs/cgroup; if [ -e memory.swap.max ]; then echo v2 $(cat memory.max memory.swap.max); \
             else echo v1 $(cat memory/memory.limit_in_bytes memory/memory.memsw.limit_in_bytes 2>/dev/null); fi",
            Duration::from_secs(10),
        )
        .await;
    let f: Vec<&str> = out.output.split_whitespace().collect();
    match f[..] {
        ["v2", max, swap] => assert_eq!((max, swap), ("536870912", "0"), "{out:?}"),
        ["v1", mem, memsw] => assert_eq!((mem, memsw), ("536870912", "536870912"), "{out:?}"),
        // A v1 kernel without swap accounting has no memsw file: the inspection above
        // is all there is.
        ["v1", _] => eprintln!("no memsw accounting in this kernel: {out:?}"),
        _ => panic!("{out:?}"),
    }
    sb.remove().await;
}

/// The agent's shell holds no capability and cannot gain one (no-new-privileges, so a
/// setuid binary does not help), runs as the unprivileged user 1000, and its CPU share is
/// the spec's (`nano_cpus`: the cgroup's quota over its period). Before this test these
/// limits were configuration only (docs/security.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_are_dropped_privileges_fixed_and_cpus_limited() {
    let Some(d) = engine().await else { return };
    let run = format!("test-caps-{}", std::process::id());
    let mut s = spec(&run, "e1");
    s.nano_cpus = 500_000_000;
    let mut sb = sandbox_with(&d, &s).await;
    let out = sb
        .run(
            "grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs):' /proc/self/status; echo uid $(id -u); \
             cd /sys/fs/cgroup; if [ -e cpu.max ]; then echo cpu $(cat cpu.max); \
             else echo cpu $(cat cpu/cpu.cfs_quota_us cpu/cpu.cfs_period_us 2>/dev/null); fi",
            Duration::from_secs(10),
        )
        .await;
    let field = |name: &str| -> String {
        out.output
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {out:?}"))
            .trim()
            .to_string()
    };
    for cap in ["CapEff:", "CapPrm:", "CapBnd:"] {
        assert_eq!(field(cap), "0000000000000000", "{cap} {out:?}");
    }
    assert_eq!(field("NoNewPrivs:"), "1", "{out:?}");
    assert_eq!(field("uid "), "1000", "{out:?}");
    let cpu: Vec<f64> = field("cpu ")
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    if cpu.len() == 2 {
        assert!(
            (cpu[0] / cpu[1] - 0.5).abs() < 1e-9,
            "a CPU quota of half a core: {out:?}"
        );
    } else {
        // The container's own cgroup is not at /sys/fs/cgroup (cgroup v2 with the host's
        // cgroup namespace): the engine's record is what there is to check.
        eprintln!("no cgroup CPU files in the container: {out:?}");
        let host = d
            .inspect_container(sb.id(), None)
            .await
            .unwrap()
            .host_config
            .unwrap();
        assert_eq!(host.nano_cpus, Some(500_000_000));
    }
    sb.remove().await;
}

/// Makes `image` (`repo:tag`) from the sandbox image: a container that runs `script`
/// in /testbed as 1000:1000, committed.
async fn commit_image(d: &bollard::Docker, image: &str, script: &str) {
    let body = bollard::models::ContainerCreateBody {
        image: Some(IMAGE.into()),
        user: Some("1000:1000".into()),
        working_dir: Some("/testbed".into()),
        cmd: Some(vec!["bash".into(), "-c".into(), script.into()]),
        ..Default::default()
    };
    let c = d
        .create_container(
            Some(bollard::query_parameters::CreateContainerOptionsBuilder::default().build()),
            body,
        )
        .await
        .unwrap();
    d.start_container(
        &c.id,
        None::<bollard::query_parameters::StartContainerOptions>,
    )
    .await
    .unwrap();
    let mut waited = d.wait_container(
        &c.id,
        None::<bollard::query_parameters::WaitContainerOptions>,
    );
    while let Some(w) = futures::StreamExt::next(&mut waited).await {
        assert_eq!(w.unwrap().status_code, 0);
    }
    let (repo, tag) = image.split_once(':').unwrap();
    d.commit_container(
        bollard::query_parameters::CommitContainerOptionsBuilder::default()
            .container(&c.id)
            .repo(repo)
            .tag(tag)
            .build(),
        bollard::models::ContainerConfig::default(),
    )
    .await
    .unwrap();
    let rm = bollard::query_parameters::RemoveContainerOptionsBuilder::default()
        .force(true)
        .build();
    d.remove_container(&c.id, Some(rm)).await.unwrap();
}

/// A sandbox of `image`, whose task names no files (the image ships its repository).
async fn image_sandbox(
    d: &bollard::Docker,
    run: &str,
    image: &str,
    instance_id: &str,
) -> Result<DockerSandbox, String> {
    let mut s = spec(run, "e1");
    s.image = image.to_string();
    let no_files = tutor_rollout_worker::tasks::TaskRecord {
        instance_id: instance_id.into(),
        ..Default::default()
    };
    DockerSandbox::create(d, &s, &no_files)
        .await
        .map_err(|e| format!("creating the sandbox: {e}"))
}

/// Removes `image` whatever the test's `result`, then fails with it, and checks that no
/// container of `run` is left.
async fn end_image_test(d: &bollard::Docker, run: &str, image: &str, result: Result<(), String>) {
    remove_image(d, image).await;
    result.unwrap();
    assert_eq!(containers_of(d, run).await, 0);
}

async fn remove_image(d: &bollard::Docker, image: &str) {
    let _ = d
        .remove_image(
            image,
            Some(
                bollard::query_parameters::RemoveImageOptionsBuilder::default()
                    .force(true)
                    .build(),
            ),
            None,
        )
        .await;
}

/// A submodule of the base (older astropy ships one) is not looked into by the
/// sandbox's own git: `add` would run `git status` inside it, which reads the
/// submodule's config, the agent's to write, so a clean filter there would run as the
/// bookkeeping user (who owns the submission's files). The agent's change beside it is
/// still the patch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submodule_of_the_base_runs_nothing_the_agent_configured() {
    let Some(d) = engine().await else { return };
    let pid = std::process::id();
    let run = format!("test-submodule-{pid}");
    let image = format!("tutor/test-submodule:{pid}");
    commit_image(
        &d,
        &image,
        "git init -q && git config user.email a@b && git config user.name a \
         && git init -q sub && git -C sub config user.email a@b && git -C sub config user.name a \
         && echo a > sub/a && git -C sub add -A && git -C sub commit -qm sub \
         && echo 'x = 1' > mod.py && git add -A 2>/dev/null && git commit -qm shipped",
    )
    .await;
    let created = image_sandbox(&d, &run, &image, "submodule").await;
    let result = async {
        let mut sb = created?;
        let t = Duration::from_secs(30);
        let setup = sb
            .run(
                "git ls-files -s sub | cut -c1-6 && mkdir -p /tmp/marks && chmod 777 /tmp/marks \
                 && git -C sub config filter.evil.clean 'touch /tmp/marks/sub; sleep 30; cat' \
                 && git -C sub config filter.evil.required true \
                 && printf '* filter=evil\\n' > sub/.gitattributes && echo b > sub/a \
                 && echo 'x = 2' > mod.py",
                t,
            )
            .await;
        let started = Instant::now();
        let sub = sb.submission().await;
        let changed = sb.changed_files().await;
        let took = started.elapsed();
        let marks = sb.run("ls -A /tmp/marks", t).await;
        sb.remove().await;
        if setup.exit_code != 0 || !setup.output.starts_with("160000") {
            return Err(format!("no submodule in the base: {setup:?}"));
        }
        if !marks.output.is_empty() || took > Duration::from_secs(20) {
            return Err(format!(
                "the submodule's filter ran: {marks:?} after {took:?}"
            ));
        }
        if !sub.patch.contains("+x = 2") || changed != vec!["mod.py".to_string()] {
            return Err(format!("{sub:?} {changed:?}"));
        }
        Ok(())
    }
    .await;
    end_image_test(&d, &run, &image, result).await;
}

/// An image that ships its repository in /testbed (as SWE-bench images do) keeps it on
/// a read-only root: it is copied into the tmpfs at launch, with its modes, and the
/// episode's base is the image's commit. The image is made here with `docker commit`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_that_ships_its_repository_keeps_it_on_a_read_only_root() {
    let Some(d) = engine().await else { return };
    let pid = std::process::id();
    let run = format!("test-shipped-{pid}");
    let image = format!("tutor/test-shipped:{pid}");
    // A container that commits a repository in /testbed, then becomes the image.
    commit_image(
        &d,
        &image,
        "git init -q && git config user.email a@b && git config user.name a \
         && printf 'def f():\\n    return 1\\n' > mod.py && mkdir -p bin && printf '#!/bin/sh\\necho ran\\n' > bin/run \
         && chmod +x bin/run && git add -A && git commit -qm shipped",
    )
    .await;

    let created = image_sandbox(&d, &run, &image, "shipped").await;
    let result = async {
        let mut sb = created?;
        let t = Duration::from_secs(30);
        let out = sb
            .run(
                "bin/run && git log --format=%s && git status --short && stat -c %U mod.py && stat -f -c %T /testbed",
                t,
            )
            .await;
        let head = sb.head().await;
        let base = sb.base_commit().to_string();
        sb.run("echo '# edited' >> mod.py", t).await;
        let diff = sb.diff().await;
        sb.remove().await;
        if out.output != "ran\nshipped\nagent\ntmpfs\n" {
            return Err(format!("{out:?}"));
        }
        if head.as_deref() != Some(base.as_str()) {
            return Err(format!("head {head:?}, base {base}"));
        }
        if !diff.contains("+# edited") {
            return Err(diff);
        }
        Ok(())
    }
    .await;
    end_image_test(&d, &run, &image, result).await;
}

/// `read_only_root = false` (an image that must write elsewhere): the root is writable
/// again, and where the storage driver has no quota (fuse-overlayfs, overlay2 on ext4)
/// the container is made without `--storage-opt` rather than refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writable_root_is_a_setting_and_works_without_a_driver_quota() {
    let Some(d) = engine().await else { return };
    let run = format!("test-rwroot-{}", std::process::id());
    let mut s = spec(&run, "e1");
    s.read_only_root = false;
    let mut sb = sandbox_with(&d, &s).await;
    let out = sb
        .run(
            "echo x > /home/agent/x && cat /home/agent/x && ulimit -n",
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(out.output, "x\n1024\n", "{out:?}");
    let host = d
        .inspect_container(sb.id(), None)
        .await
        .unwrap()
        .host_config
        .unwrap();
    assert_eq!(host.readonly_rootfs, Some(false));
    assert_eq!(host.memory_swap, host.memory);
    sb.remove().await;
}

/// The Docker limits are `[worker]` settings: a worker configured with a 64 MiB disk
/// gets containers whose working directory fills at 64 MiB, and one configured with a
/// writable root (what a SWE-bench image that installs into its environment needs) gets
/// containers where the agent can write outside it. Before, both were fixed in code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_limits_come_from_the_worker_settings() {
    if engine().await.is_none() {
        return;
    }
    let defaults = tutor_rollout_worker::worker::WorkerConfig::default();
    assert!(defaults.read_only_root);
    assert_eq!((defaults.disk_mb, defaults.tmp_mb), (1024, 256));
    let run = format!("test-settings-{}", std::process::id());
    for (read_only_root, command, want) in [
        (
            true,
            "dd if=/dev/zero of=/testbed/fill bs=1M count=100 2>&1 | head -3",
            "No space left on device",
        ),
        (false, "echo x > /home/agent/x && cat /home/agent/x", "x\n"),
    ] {
        let config: tutor_rollout_worker::worker::WorkerConfig =
            serde_json::from_value(serde_json::json!({
                "sandbox": "docker",
                "image": IMAGE,
                "read_only_root": read_only_root,
                "disk_mb": 64,
                "tmp_mb": 32,
            }))
            .unwrap();
        let factory = config.sandboxes(&run, "w-settings").await.unwrap();
        let f = factory.clone();
        let out = tokio::task::spawn_blocking(move || {
            let mut sb = f.create(&task(), "e1").unwrap();
            sb.run(command, Duration::from_secs(30))
        })
        .await
        .unwrap();
        assert!(
            out.output.contains(want),
            "read_only_root = {read_only_root}: {out:?}"
        );
        factory.remove_leftovers().await;
    }
}

/// `[worker] nofile` and `fsize_mb` reach the worker's containers. Before, the ulimits
/// were fixed at 1024 open files and 1 GiB whatever the operator set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_ulimit_settings_reach_its_containers() {
    if engine().await.is_none() {
        return;
    }
    let run = format!("test-ulimit-settings-{}", std::process::id());
    let config: tutor_rollout_worker::worker::WorkerConfig =
        serde_json::from_value(serde_json::json!({
            "sandbox": "docker",
            "image": IMAGE,
            "nofile": 200,
            "fsize_mb": 4,
        }))
        .unwrap();
    config.validate().unwrap();
    let factory = config.sandboxes(&run, "w-ulimits").await.unwrap();
    let f = factory.clone();
    let out = tokio::task::spawn_blocking(move || {
        let mut sb = f.create(&task(), "e1").unwrap();
        sb.run(
            "ulimit -Hn; ulimit -Hf; head -c 5M /dev/zero > big.bin; echo size=$(stat -c %s big.bin)",
            Duration::from_secs(30),
        )
    })
    .await
    .unwrap();
    // bash shows the file size limit in blocks of 1024 bytes; the write stops at 4 MiB.
    assert!(out.output.starts_with("200\n4096\n"), "{out:?}");
    assert!(
        out.output.contains(&format!("size={}\n", 4 << 20)),
        "{out:?}"
    );
    factory.remove_leftovers().await;
}

/// An image the engine lacks: an error naming it at once, or, with `pull_missing`
/// (`[worker] pull_images`, for engines that start empty), a pull from its registry whose
/// failure names the image and the registry's answer; no container is left either way.
/// (No registry is reachable on the project's machines, so only the failing pull can be
/// tested here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_image_fails_clearly_with_and_without_pulling() {
    let Some(d) = engine().await else { return };
    let run = format!("test-pull-{}", std::process::id());
    // Port 9 (discard) on loopback: nothing answers, so the pull fails at once.
    let image = "127.0.0.1:9/tutor/absent:never";
    let mut s = ContainerSpec::new(image, &run, "test-worker", "e1");
    match DockerSandbox::create(&d, &s, &task()).await {
        Err(DockerError::MissingImage(i)) => assert_eq!(i, image),
        Err(e) => panic!("expected MissingImage, got {e}"),
        Ok(_) => panic!("a sandbox from an image that does not exist"),
    }
    s.pull_missing = true;
    match DockerSandbox::create(&d, &s, &task()).await {
        Err(e @ DockerError::PullFailed { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(image) && msg.contains("127.0.0.1:9"), "{msg}");
        }
        Err(e) => panic!("expected PullFailed, got {e}"),
        Ok(_) => panic!("a sandbox from an image that does not exist"),
    }
    assert_eq!(containers_of(&d, &run).await, 0);
}
