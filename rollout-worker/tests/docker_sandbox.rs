//! The Docker sandbox against the real engine: persistent shell, timeouts, output caps,
//! no network, diff, cleanup. Needs the image from `make images`; skips (saying so) only
//! when no Docker engine is reachable.

use std::time::{Duration, Instant};

use tutor_rollout_worker::sandbox::docker::{self, ContainerSpec, DockerError, DockerSandbox};

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
/// configured in the repository must not run (nor hang the worker), and the diff is
/// still the agent's change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookkeeping_git_runs_nothing_the_agent_configured() {
    let Some(d) = engine().await else { return };
    let run = format!("test-book-{}", std::process::id());
    let mut sb = sandbox(&d, &run).await;
    let t = Duration::from_secs(20);
    let out = sb
        .run(
            "mkdir -p /tmp/marks && git config core.fsmonitor 'touch /tmp/marks/fsmonitor; echo' \
             && git config filter.evil.clean 'touch /tmp/marks/clean; sleep 30; cat' \
             && git config filter.evil.required true \
             && printf '* filter=evil\\n' > .gitattributes && echo 'x = 1' > new_file.py",
            t,
        )
        .await;
    assert_eq!(out.exit_code, 0, "{}", out.output);
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
