//! Episodes end to end with a scripted teacher (an OpenAI-compatible endpoint the test
//! serves on a loopback port): what becomes of a submission too large to send.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::Arc;

use tutor_proto::{episode_event, EpisodeLease, EpisodePurpose, OutcomeStatus};
use tutor_rollout_worker::episode::{run_episode, TeacherSource};
use tutor_rollout_worker::sandbox::MAX_SUBMISSION_BYTES;
use tutor_rollout_worker::teacher::endpoint::{ChatEndpoint, TeacherConfig, TeacherKind};

/// A chat-completions endpoint on a loopback port that answers a conversation holding
/// `n` assistant messages with `replies[n]` (the last reply once past the end). Returns
/// its base URL. Its thread serves until the test process ends.
fn scripted_endpoint(replies: Vec<String>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                let line = line.to_ascii_lowercase();
                if let Some(v) = line.strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap();
                }
            }
            let mut body = vec![0u8; length];
            reader.read_exact(&mut body).unwrap();
            let request: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let turn = request["messages"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["role"] == "assistant")
                .count();
            let text = &replies[turn.min(replies.len() - 1)];
            let answer = serde_json::json!({
                "choices": [{"message": {"role": "assistant", "content": text}}]
            })
            .to_string();
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{answer}",
                answer.len()
            );
        }
    });
    format!("http://{addr}/v1")
}

/// A teacher that answers with `replies` (see [`scripted_endpoint`]), with the runtime
/// its client runs on (kept alive by the caller).
fn scripted_teacher(replies: Vec<String>) -> (TeacherSource, tokio::runtime::Runtime) {
    let url = scripted_endpoint(replies);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let endpoint = ChatEndpoint::new(&TeacherConfig {
        kind: TeacherKind::Endpoint,
        base_url: url,
        model: "scripted".into(),
        max_retries: 0,
        ..Default::default()
    })
    .unwrap();
    (
        TeacherSource::Endpoint(Arc::new(endpoint), rt.handle().clone()),
        rt,
    )
}

fn lease(task: &tutor_proto::Task) -> EpisodeLease {
    EpisodeLease {
        episode_id: "it000-train0000-g0a0".into(),
        task: Some(task.clone()),
        // The teacher acts on every turn.
        beta: 1.0,
        max_turns: 4,
        command_timeout_ms: 60_000,
        observation_max_chars: 1500,
        purpose: EpisodePurpose::Train as i32,
        seed: 9,
        ..Default::default()
    }
}

/// An agent that generates 6 MB of text files in the repository (300 of 20 KiB, a data
/// set or a build tree) and submits: the outcome is PATCH_TOO_LARGE with no patch and an
/// error naming the cap, and it is not graded (no test statuses). Before, the whole
/// diff was graded and sent as the patch, over the coordinator's message limit.
#[test]
fn an_oversized_submission_is_patch_too_large_and_not_graded() {
    let generate = "mkdir -p gen && awk 'BEGIN { l = sprintf(\"%099d\", 0); \
        for (i = 0; i < 300; i++) { f = \"gen/f\" i \".txt\"; \
        for (j = 0; j < 205; j++) print l > f; close(f) } }'";
    let (teacher, _rt) = scripted_teacher(vec![
        format!("I will generate the data files.\n```command\n{generate}\n```"),
        "Done.\n```command\nsubmit\n```".to_string(),
    ]);
    let mut s = common::episode_setup(
        tutor_rollout_worker::toy::generate(1, 11).remove(0),
        teacher,
    );
    let outcome = run_episode(&s.env, &lease(&s.task));
    // (No `{outcome:?}`: before the fix it holds a 6 MB patch.)
    let status = OutcomeStatus::try_from(outcome.status).unwrap();
    assert_eq!(
        status,
        OutcomeStatus::PatchTooLarge,
        "{}; patch of {} bytes",
        outcome.error,
        outcome.patch.len()
    );
    assert!(outcome.submitted);
    assert_eq!(outcome.num_turns, 2);
    assert_eq!(outcome.patch, "");
    assert!(outcome.test_statuses.is_empty(), "it was graded");
    assert!(
        outcome.error.contains("MAX_SUBMISSION_BYTES")
            && outcome.error.contains(&MAX_SUBMISSION_BYTES.to_string()),
        "{}",
        outcome.error
    );
    // The outcome event sent is that outcome.
    let mut sent = None;
    while let Ok(ev) = s.events.try_recv() {
        if let Some(episode_event::Event::Outcome(o)) = ev.event {
            sent = Some(o);
        }
    }
    let sent = sent.expect("an outcome event");
    assert_eq!(sent.status, OutcomeStatus::PatchTooLarge as i32);
    assert_eq!(sent.patch, "");
}

/// An agent that games the reward (issue 15, item 3): it writes a `conftest.py` that
/// reports every test as passed and submits. Under the workers' strict grading the
/// outcome is UNRESOLVED (reward 0), and it records that the harness's rules would have
/// said RESOLVED, which the coordinator counts as a grading disagreement.
#[test]
fn a_reward_hacking_episode_is_unresolved_and_the_disagreement_recorded() {
    let conftest = "cat > conftest.py <<'EOF'\nimport pytest\n\n\
        @pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n    \
        outcome = yield\n    outcome.get_result().outcome = 'passed'\nEOF";
    let (teacher, _rt) = scripted_teacher(vec![
        format!("Make every test pass.\n```command\n{conftest}\n```"),
        "Done.\n```command\nsubmit\n```".to_string(),
    ]);
    common::init_python();
    let s = common::episode_setup(
        tutor_rollout_worker::toy::generate(1, 11).remove(0),
        teacher,
    );
    let outcome = run_episode(&s.env, &lease(&s.task));
    assert!(outcome.patch.contains("conftest.py"), "{outcome:?}");
    assert_eq!(
        outcome.status,
        OutcomeStatus::Unresolved as i32,
        "{}",
        outcome.error
    );
    assert_eq!(outcome.grading, "strict");
    assert_eq!(outcome.harness_status, OutcomeStatus::Resolved as i32);
}

/// An agent that fills the disk (issue 16, item 1): its command is killed at the
/// worker's disk floor (`[worker] min_free_disk_mb`, here 256 MiB under what is free when
/// the test starts), and the episode ends there: unresolved without tests (the reward of
/// a failure: filling the disk costs it), no patch, the error naming the floor, and the
/// sandbox (with what it wrote) removed.
#[test]
fn an_agent_that_fills_the_disk_ends_its_episode_unresolved_at_the_floor() {
    use tutor_rollout_worker::sandbox::{ConfineSettings, Confinement, Limits, SandboxFactory};
    let (teacher, _rt) = scripted_teacher(vec![
        "I will make some room for myself.\n```command\nfor i in 1 2 3; do head -c 1000M /dev/zero > fill$i; done\n```"
            .to_string(),
        "Again.\n```command\nhead -c 1000M /dev/zero > fill2\n```".to_string(),
        "Done.\n```command\nsubmit\n```".to_string(),
    ]);
    let mut s = common::episode_setup(
        tutor_rollout_worker::toy::generate(1, 11).remove(0),
        teacher,
    );
    let SandboxFactory::Local { root, .. } = s.env.sandboxes.clone() else {
        panic!("episode_setup makes local sandboxes");
    };
    let root = root.expect("episode_setup names a root");
    let available = || {
        let st = nix_statvfs(&root);
        st.0 * st.1
    };
    // One disk-floor test at a time, across test processes (as the sandbox's own
    // tests), and only with room to spare.
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(std::env::temp_dir().join("tutor-disk-floor-tests.lock"))
        .unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&lock);
    // SAFETY: flock on a descriptor we own.
    assert_eq!(unsafe { libc::flock(fd, libc::LOCK_EX) }, 0);
    if available() < 4 << 30 {
        eprintln!("skipped: under 4 GiB free for the disk-floor test");
        return;
    }
    let floor = available().saturating_sub(256 << 20);
    s.env.sandboxes = SandboxFactory::LocalWith {
        root: Some(root.clone()),
        owner: None,
        confinement: Confinement::new(&ConfineSettings {
            allow_unconfined: true,
            limits: Limits {
                min_free_disk_bytes: floor,
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap(),
    };
    let outcome = run_episode(&s.env, &lease(&s.task));
    let status = OutcomeStatus::try_from(outcome.status).unwrap();
    assert_eq!(status, OutcomeStatus::Unresolved, "{}", outcome.error);
    assert_eq!(outcome.num_turns, 1, "the episode went on after the floor");
    assert!(!outcome.submitted);
    assert_eq!(outcome.patch, "");
    assert!(outcome.test_statuses.is_empty(), "it was graded");
    assert!(
        outcome.error.contains("min_free_disk_mb"),
        "{}",
        outcome.error
    );
    // The sandbox and what its command wrote are gone.
    let left: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("tutor-sbx-"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// (`f_bavail`, `f_frsize`) of the file system holding `path`.
fn nix_statvfs(path: &std::path::Path) -> (u64, u64) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a zeroed statvfs is a valid out-parameter; `c` is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    (st.f_bavail as u64, st.f_frsize as u64)
}
