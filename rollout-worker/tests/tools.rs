//! The SWE-agent tools (open, goto, scroll, create, edit, replace, search_*) behave as
//! documented, and identically in the local and the Docker sandbox: the same script of
//! commands gives the same outputs, exit codes and footer file in both (repository paths
//! aside: `~/repo` locally, `/testbed` in Docker). The Docker half skips, saying so, only
//! when no engine is reachable.

use std::time::Duration;

use tutor_rollout_worker::observation::format_observation;
use tutor_rollout_worker::sandbox::{Sandbox, SandboxFactory};
use tutor_rollout_worker::worker::{SandboxKind, WorkerConfig};

const T: Duration = Duration::from_secs(30);

/// One step's result: output, exit code, the footer.
#[derive(Debug, Clone, PartialEq)]
struct Step {
    output: String,
    exit_code: i32,
    footer: String,
}

fn exec(sb: &mut dyn Sandbox, cmd: &str) -> Step {
    let out = sb.run(&tutor_rollout_worker::tools::prepare_command(cmd), T);
    let obs = format_observation(
        &out.output,
        out.exit_code,
        out.timed_out,
        &sb.cwd(),
        sb.current_file().as_deref(),
        100_000,
    );
    let footer = obs.lines().last().unwrap_or("").to_string();
    // Repository paths are the one allowed difference between sandboxes.
    let norm = |s: &str| s.replace(sb.repo_display(), "<repo>");
    Step {
        output: norm(&out.output),
        exit_code: out.exit_code,
        footer: norm(&footer),
    }
}

fn body(n: usize) -> String {
    (1..=n).map(|i| format!("x{i} = {i}\n")).collect()
}

/// The script: each command with what must hold afterwards.
fn script(sb: &mut dyn Sandbox) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut go = |sb: &mut dyn Sandbox, cmd: &str| {
        let s = exec(sb, cmd);
        steps.push(s.clone());
        s
    };

    let s = go(
        sb,
        &format!("create notes/demo.py <<'EOF'\n{}EOF", body(150)),
    );
    assert_eq!(s.exit_code, 0, "{s:?}");
    assert!(
        s.output
            .starts_with("[File: <repo>/notes/demo.py (150 lines total)]\n1:x1 = 1\n"),
        "{s:?}"
    );
    assert!(
        s.output.contains("\n100:x100 = 100\n(50 more lines below)"),
        "{s:?}"
    );
    assert_eq!(
        s.footer,
        "(Current directory: <repo>, current file: <repo>/notes/demo.py) bash-$"
    );
    assert_eq!(sb.read_file("notes/demo.py").unwrap(), body(150));

    let s = go(sb, "scroll_down");
    assert!(
        s.output.contains("(98 more lines above)\n99:x99 = 99\n"),
        "{s:?}"
    );
    assert!(s.output.trim_end().ends_with("150:x150 = 150"), "{s:?}");
    let s = go(sb, "scroll_down");
    assert!(
        s.output.starts_with("Already at the end of the file."),
        "{s:?}"
    );
    let s = go(sb, "scroll_up");
    assert!(s.output.contains("\n1:x1 = 1\n"), "{s:?}");
    let s = go(sb, "goto 60");
    assert!(
        s.output.contains("(9 more lines above)\n10:x10 = 10\n"),
        "{s:?}"
    );
    assert!(
        s.output.contains("\n109:x109 = 109\n(41 more lines below)"),
        "{s:?}"
    );
    // Near the end the window stops at the last line.
    let s = go(sb, "goto 140");
    assert!(
        s.output.contains("(50 more lines above)\n51:x51 = 51\n"),
        "{s:?}"
    );
    let s = go(sb, "goto 999");
    assert_eq!(s.exit_code, 1, "{s:?}");
    assert!(s.output.contains("out of range"), "{s:?}");

    // edit with a here-document, and the SWE-agent end_of_edit spelling.
    let s = go(sb, "edit 3:4 <<'EOF'\ny = [\n    1,\n]\nEOF");
    assert_eq!(s.exit_code, 0, "{s:?}");
    assert!(s.output.contains("(151 lines total)"), "{s:?}");
    let text = sb.read_file("notes/demo.py").unwrap();
    assert!(
        text.starts_with("x1 = 1\nx2 = 2\ny = [\n    1,\n]\nx5 = 5\n"),
        "{text}"
    );
    let s = go(sb, "edit 1:1\nz = 0\nend_of_edit");
    assert_eq!(s.exit_code, 0, "{s:?}");
    assert!(sb
        .read_file("notes/demo.py")
        .unwrap()
        .starts_with("z = 0\nx2 = 2\n"));
    // Insert before line 2 (END = START - 1).
    let s = go(sb, "edit 2:1 <<'EOF'\ninserted = True\nEOF");
    assert_eq!(s.exit_code, 0, "{s:?}");
    assert!(sb
        .read_file("notes/demo.py")
        .unwrap()
        .starts_with("z = 0\ninserted = True\nx2 = 2\n"));

    // An edit that breaks Python syntax is refused and changes nothing.
    let before = sb.read_file("notes/demo.py").unwrap();
    let s = go(sb, "edit 2:2 <<'EOF'\ndef broken(:\nEOF");
    assert_eq!(s.exit_code, 1, "{s:?}");
    assert!(s.output.contains("syntax error"), "{s:?}");
    assert_eq!(sb.read_file("notes/demo.py").unwrap(), before);

    // replace: unique, ambiguous, --replace-all, absent.
    let s = go(sb, "replace 'x10 = 10' 'x10 = 1000'");
    assert_eq!(s.exit_code, 0, "{s:?}");
    // A snippet around the change, not the whole window.
    assert!(
        s.output
            .contains("lines 8-16 after the change]\n8:x6 = 6\n"),
        "{s:?}"
    );
    assert!(s.output.contains("\n12:x10 = 1000\n"), "{s:?}");
    assert!(s.output.trim_end().ends_with("16:x14 = 14"), "{s:?}");
    assert!(sb
        .read_file("notes/demo.py")
        .unwrap()
        .contains("\nx10 = 1000\n"));
    let s = go(sb, "replace 'x14' 'w14'");
    assert_eq!(s.exit_code, 1, "{s:?}");
    assert!(s.output.contains("occurs 11 times"), "{s:?}");
    let s = go(sb, "replace 'x14' 'w14' --replace-all");
    assert_eq!(s.exit_code, 0, "{s:?}");
    assert!(sb
        .read_file("notes/demo.py")
        .unwrap()
        .contains("\nw14 = 14\n"));
    let s = go(sb, "replace 'no such text' 'x'");
    assert_eq!(s.exit_code, 1, "{s:?}");

    let s = go(sb, "search_file 'x12'");
    assert!(
        s.output
            .starts_with("Found 11 matches for \"x12\" in <repo>/notes/demo.py:\n"),
        "{s:?}"
    );
    let s = go(sb, "search_dir 'x150' notes");
    assert!(
        s.output.contains("<repo>/notes/demo.py (1 matches)"),
        "{s:?}"
    );
    let s = go(sb, "find_file 'demo*'");
    assert!(s.output.contains("<repo>/notes/demo.py"), "{s:?}");

    // Errors are clear and leave the state alone; the footer follows cd and open.
    let s = go(sb, "open missing.py");
    assert_eq!(s.exit_code, 1, "{s:?}");
    assert!(s.output.contains("missing.py not found"), "{s:?}");
    assert!(
        s.footer.contains("current file: <repo>/notes/demo.py"),
        "{s:?}"
    );
    let s = go(sb, "cd notes && open demo.py 75");
    assert_eq!(s.exit_code, 0, "{s:?}");
    assert_eq!(
        s.footer,
        "(Current directory: <repo>/notes, current file: <repo>/notes/demo.py) bash-$"
    );
    let s = go(sb, "create demo.py");
    assert_eq!(s.exit_code, 1, "{s:?}");
    assert!(s.output.contains("already exists"), "{s:?}");
    let s = go(sb, "cd .. && create empty.txt");
    assert_eq!(s.exit_code, 0, "{s:?}");
    assert!(s.output.contains("(0 lines total)"), "{s:?}");

    // The tools' files and the viewer state never reach the submission.
    let changed = sb.changed_files();
    assert_eq!(changed, vec!["empty.txt", "notes/demo.py"], "{changed:?}");
    steps
}

fn task() -> tutor_rollout_worker::tasks::TaskRecord {
    tutor_rollout_worker::toy::generate(1, 5).remove(0)
}

#[test]
fn tools_in_the_local_sandbox() {
    let factory = SandboxFactory::Local {
        root: None,
        owner: None,
    };
    let mut sb = factory.create(&task(), "tools").unwrap();
    script(sb.as_mut());
}

#[test]
fn tools_behave_the_same_in_docker_and_locally() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let run = format!("test-tools-{}", std::process::id());
    let config = WorkerConfig {
        sandbox: SandboxKind::Docker,
        ..Default::default()
    };
    let factory = match rt.block_on(config.sandboxes(&run, "w")) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("SKIPPED: no Docker engine reachable: {e:#}");
            return;
        }
    };
    let docker_steps = rt
        .spawn_blocking(move || {
            let mut sb = factory.create(&task(), "tools").expect("docker sandbox");
            script(sb.as_mut())
        })
        .join_blocking();
    let mut local = SandboxFactory::Local {
        root: None,
        owner: None,
    }
    .create(&task(), "tools")
    .unwrap();
    let local_steps = script(local.as_mut());
    assert_eq!(docker_steps.len(), local_steps.len());
    for (d, l) in docker_steps.iter().zip(&local_steps) {
        assert_eq!(d, l);
    }
}

trait JoinBlocking<T> {
    fn join_blocking(self) -> T;
}

impl<T: Send + 'static> JoinBlocking<T> for tokio::task::JoinHandle<T> {
    fn join_blocking(self) -> T {
        futures::executor::block_on(self).expect("the Docker half panicked")
    }
}
