//! Grading a submission the way the SWE-bench harness does: fresh repo, apply the patch,
//! reset the test files, apply the test patch, run pytest on the test files, parse the
//! `-rA` summary, resolved iff every FAIL_TO_PASS and PASS_TO_PASS test passes.

use std::collections::BTreeMap;
use std::time::Duration;

use tutor_proto::OutcomeStatus;

use crate::observation::truncate_head_tail;
use crate::sandbox::LocalSandbox;
use crate::sandbox::{Sandbox, SandboxFactory};
use crate::tasks::TaskRecord;

/// Timeout for the git steps (they are local and quick; this only guards against hangs).
const GIT_STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// The test command when the task names none (pytest with per-test statuses).
pub const DEFAULT_TEST_CMD: &str = "python -m pytest -rA -p no:cacheprovider";

/// Largest log kept in a [`GradeResult`] (head and tail are kept).
const MAX_LOG_CHARS: usize = 200_000;

/// Outcome of grading one patch.
#[derive(Debug, Clone, PartialEq)]
pub struct GradeResult {
    pub status: OutcomeStatus,
    /// pytest node id (or file, for collection errors) → `PASSED`, `FAILED`, `ERROR`,
    /// `XFAIL`, `XPASS` or `SKIPPED`.
    pub test_statuses: BTreeMap<String, String>,
    /// What happened: patch application, test patch, the pytest log.
    pub log: String,
}

impl GradeResult {
    pub fn resolved(&self) -> bool {
        self.status == OutcomeStatus::Resolved
    }

    fn fail(status: OutcomeStatus, log: String) -> Self {
        GradeResult {
            status,
            test_statuses: BTreeMap::new(),
            log: truncate_head_tail(&log, MAX_LOG_CHARS),
        }
    }
}

const STATUSES: [&str; 6] = ["PASSED", "FAILED", "ERROR", "XFAIL", "XPASS", "SKIPPED"];

/// Severity used when a test is reported twice (e.g. `PASSED` then `ERROR` at teardown):
/// the worse status wins.
fn severity(status: &str) -> u8 {
    match status {
        "PASSED" | "XFAIL" => 0,
        "SKIPPED" | "XPASS" => 1,
        _ => 2,
    }
}

/// Strips ANSI colour escapes (pytest colours its output when forced to).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            // A CSI sequence: parameter and intermediate bytes (0x20-0x3F), then one
            // final byte (0x40-0x7E). An unfinished one ends at anything else (never
            // swallowing a newline and the status line after it).
            chars.next();
            while let Some(&d) = chars.peek() {
                if ('\u{20}'..='\u{3f}').contains(&d) {
                    chars.next();
                } else {
                    if ('\u{40}'..='\u{7e}').contains(&d) {
                        chars.next();
                    }
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The node id at the start of `rest`: up to the first whitespace, except that a
/// parametrize id in brackets may contain spaces and ` - `.
fn node_id(rest: &str) -> &str {
    let bracket = rest.find('[');
    let space = rest.find(char::is_whitespace).unwrap_or(rest.len());
    if let Some(b) = bracket.filter(|&b| b < space) {
        let mut depth = 0usize;
        for (i, c) in rest[b..].char_indices() {
            match c {
                '[' => depth += 1,
                ']' => {
                    depth -= 1;
                    if depth == 0 {
                        return &rest[..b + i + 1];
                    }
                }
                _ => {}
            }
        }
    }
    &rest[..space]
}

/// Parses pytest `-rA` short-summary lines into test statuses. Only the part after the
/// "short test summary info" header is read when it is present, so test output that
/// happens to start with `PASSED` does not count.
pub fn parse_pytest_log(log: &str) -> BTreeMap<String, String> {
    let clean = strip_ansi(log);
    let start = clean
        .rfind("short test summary info")
        .map(|i| clean[i..].find('\n').map_or(clean.len(), |n| i + n))
        .unwrap_or(0);
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    for line in clean[start..].lines() {
        let line = line.trim_end();
        let Some(status) = STATUSES
            .iter()
            .find(|s| line.starts_with(*s) && line[s.len()..].starts_with(' '))
        else {
            continue;
        };
        let rest = line[status.len()..].trim_start();
        let key = if *status == "SKIPPED" && rest.starts_with('[') {
            // "SKIPPED [1] tests/test_a.py:8: reason" has a location, not a node id.
            let loc = rest.split_once("] ").map_or(rest, |(_, r)| r);
            loc.split(": ").next().unwrap_or(loc).to_string()
        } else {
            node_id(rest).to_string()
        };
        if key.is_empty() {
            continue;
        }
        match out.get(&key) {
            Some(prev) if severity(prev) >= severity(status) => {}
            _ => {
                out.insert(key, status.to_string());
            }
        }
    }
    out
}

/// Decides the outcome from parsed statuses.
pub fn decide(task: &TaskRecord, statuses: &BTreeMap<String, String>) -> OutcomeStatus {
    // Collection errors report files, not tests: no `::` anywhere means no test ran.
    if !statuses.keys().any(|k| k.contains("::")) {
        return OutcomeStatus::TestsError;
    }
    let passed = |t: &String| {
        statuses
            .get(t)
            .is_some_and(|s| s == "PASSED" || s == "XFAIL")
    };
    if task.fail_to_pass.iter().all(passed) && task.pass_to_pass.iter().all(passed) {
        OutcomeStatus::Resolved
    } else {
        OutcomeStatus::Unresolved
    }
}

/// Grades `patch` for `task` in a fresh sandbox built from the task's files (never the
/// agent's sandbox) under the system temp dir. `timeout` bounds the test run.
pub fn grade(task: &TaskRecord, patch: &str, timeout: Duration) -> GradeResult {
    grade_in(task, patch, timeout, None)
}

/// [`grade`] with the grading sandbox created under `root`.
pub fn grade_in(
    task: &TaskRecord,
    patch: &str,
    timeout: Duration,
    root: Option<&std::path::Path>,
) -> GradeResult {
    match LocalSandbox::create(task, root) {
        Ok(mut sb) => grade_in_sandbox(task, patch, timeout, &mut sb),
        Err(e) => GradeResult::fail(OutcomeStatus::SandboxError, e.to_string()),
    }
}

/// [`grade`] in a fresh sandbox from `factory` (a new container for Docker), labelled
/// `label`. The agent's own sandbox is never graded, so editing the tests gains nothing.
pub fn grade_fresh(
    task: &TaskRecord,
    patch: &str,
    timeout: Duration,
    factory: &SandboxFactory,
    label: &str,
) -> GradeResult {
    match factory.create(task, label) {
        Ok(mut sb) => grade_in_sandbox(task, patch, timeout, sb.as_mut()),
        Err(e) => GradeResult::fail(
            OutcomeStatus::SandboxError,
            format!("creating the grading sandbox: {e}"),
        ),
    }
}

/// The grading steps in `sb`, which must be a fresh sandbox at the base commit.
pub fn grade_in_sandbox(
    task: &TaskRecord,
    patch: &str,
    timeout: Duration,
    sb: &mut dyn Sandbox,
) -> GradeResult {
    let mut log = String::new();
    // 1. The submission.
    if !patch.trim().is_empty() {
        let p = match sb.write_scratch("model.patch", &ensure_newline(patch)) {
            Ok(p) => p,
            Err(e) => return GradeResult::fail(OutcomeStatus::SandboxError, e.to_string()),
        };
        // As in the SWE-bench harness: git apply, then GNU patch with fuzz as a fallback.
        let out = sb.run(
            &format!(
                "git apply --verbose {p} || {{ command -v patch >/dev/null && patch --batch --fuzz=5 -p1 --no-backup-if-mismatch -i {p}; }}"
            ),
            GIT_STEP_TIMEOUT,
        );
        log.push_str(">>> apply patch\n");
        log.push_str(&out.output);
        if out.exit_code != 0 || out.timed_out {
            log.push_str("\n>>> APPLY_PATCH_FAIL\n");
            return GradeResult::fail(OutcomeStatus::ApplyPatchFail, log);
        }
    }

    // 2. Reset the test files to the base, so edits to tests cannot make them pass.
    let test_files = task.test_files();
    let base = sb.base_commit().to_string();
    let mut reset = Vec::new();
    for f in &test_files {
        let q = crate::sandbox::shell_quote(f);
        if sb.base_file(f).is_some() {
            reset.push(format!("git checkout -q {base} -- {q}"));
        } else {
            reset.push(format!("rm -rf -- {q}"));
        }
    }
    if !reset.is_empty() {
        let out = sb.run(&reset.join(" && "), GIT_STEP_TIMEOUT);
        log.push_str(">>> reset test files\n");
        log.push_str(&out.output);
        if out.exit_code != 0 {
            return GradeResult::fail(OutcomeStatus::SandboxError, log);
        }
    }

    // 3. The test patch.
    if !task.test_patch.trim().is_empty() {
        let p = match sb.write_scratch("test.patch", &ensure_newline(&task.test_patch)) {
            Ok(p) => p,
            Err(e) => return GradeResult::fail(OutcomeStatus::SandboxError, e.to_string()),
        };
        let out = sb.run(&format!("git apply --verbose {p}"), GIT_STEP_TIMEOUT);
        log.push_str(">>> apply test patch\n");
        log.push_str(&out.output);
        if out.exit_code != 0 {
            log.push_str("\n>>> the task's test_patch does not apply\n");
            return GradeResult::fail(OutcomeStatus::TestsError, log);
        }
    }

    // 4. The tests.
    let files: Vec<String> = test_files
        .iter()
        .map(|f| crate::sandbox::shell_quote(f))
        .collect();
    // As the SWE-bench harness: the task's test command on the test files.
    let test_cmd = if task.test_cmd.trim().is_empty() {
        DEFAULT_TEST_CMD
    } else {
        task.test_cmd.trim()
    };
    let cmd = format!("{test_cmd} {}", files.join(" "));
    log.push_str(&format!(">>> {cmd}\n"));
    let out = sb.run(&cmd, timeout);
    log.push_str(&out.output);
    if out.timed_out {
        log.push_str("\n>>> TESTS_TIMEOUT\n");
        return GradeResult::fail(OutcomeStatus::TestsTimeout, log);
    }
    let test_statuses = parse_pytest_log(&out.output);
    let status = decide(task, &test_statuses);
    GradeResult {
        status,
        test_statuses,
        log: truncate_head_tail(&log, MAX_LOG_CHARS),
    }
}

fn ensure_newline(s: &str) -> String {
    if s.ends_with('\n') {
        s.to_string()
    } else {
        format!("{s}\n")
    }
}

#[cfg(test)]
pub(crate) mod tests_support {
    /// Points `TUTOR_PYTHON` at the workspace venv (which has pytest) when it exists.
    pub fn init_python() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            if std::env::var_os("TUTOR_PYTHON").is_none() {
                let venv =
                    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
                if venv.exists() {
                    std::env::set_var("TUTOR_PYTHON", venv);
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An escape sequence cut short stops at the first byte that cannot belong to it:
    /// before, `\x1b[` swallowed everything up to the next letter, newline and the start
    /// of the next status line included, and that test's status was lost.
    #[test]
    fn an_unfinished_escape_sequence_does_not_eat_the_next_line() {
        assert_eq!(
            strip_ansi("foo\x1b[\nPASSED t.py::x"),
            "foo\nPASSED t.py::x"
        );
        assert_eq!(
            strip_ansi("\x1b[1;31mFAILED\x1b[0m t.py::y"),
            "FAILED t.py::y"
        );
        assert_eq!(strip_ansi("a\x1b[?25lb"), "ab");
        assert_eq!(strip_ansi("end\x1b["), "end");
    }

    const CANNED: &str = "\
============================= test session starts ==============================
collected 9 items

tests/test_a.py .F.xXsE.F                                                 [100%]
PASSED something printed by a test (ignored: before the summary)
=========================== short test summary info ============================
PASSED tests/test_a.py::test_pass
PASSED tests/test_a.py::test_teardown_err
PASSED tests/test_a.py::test_param[a b]
SKIPPED [1] tests/test_a.py:8: sk
XFAIL tests/test_a.py::test_xfail - known
XPASS tests/test_a.py::test_xpass - kn
ERROR tests/test_a.py::test_teardown_err - RuntimeError: teardown
FAILED tests/test_a.py::test_fail - AssertionError: boom - x
FAILED tests/test_a.py::test_param[c - d] - AssertionError: assert 'c - d' ==...
\u{1b}[32mPASSED\u{1b}[0m tests/test_a.py::TestK::test_colored
==== 2 failed, 3 passed, 1 skipped, 1 xfailed, 1 xpassed, 1 error in 0.02s =====
";

    #[test]
    fn parses_canned_log() {
        let s = parse_pytest_log(CANNED);
        let get = |k: &str| s.get(k).map(String::as_str);
        assert_eq!(get("tests/test_a.py::test_pass"), Some("PASSED"));
        assert_eq!(get("tests/test_a.py::test_teardown_err"), Some("ERROR"));
        assert_eq!(get("tests/test_a.py::test_param[a b]"), Some("PASSED"));
        assert_eq!(get("tests/test_a.py::test_param[c - d]"), Some("FAILED"));
        assert_eq!(get("tests/test_a.py::test_xfail"), Some("XFAIL"));
        assert_eq!(get("tests/test_a.py::test_xpass"), Some("XPASS"));
        assert_eq!(get("tests/test_a.py::test_fail"), Some("FAILED"));
        assert_eq!(get("tests/test_a.py:8"), Some("SKIPPED"));
        assert_eq!(get("tests/test_a.py::TestK::test_colored"), Some("PASSED"));
        assert!(!s.keys().any(|k| k.contains("something")));
        assert_eq!(s.len(), 9);
    }

    fn task_with(f2p: &[&str], p2p: &[&str]) -> TaskRecord {
        let mut t = crate::sandbox::local::tests::tiny_task();
        t.fail_to_pass = f2p.iter().map(|s| s.to_string()).collect();
        t.pass_to_pass = p2p.iter().map(|s| s.to_string()).collect();
        t
    }

    #[test]
    fn decision_rules() {
        let s = parse_pytest_log(CANNED);
        let t = task_with(
            &["tests/test_a.py::test_pass"],
            &["tests/test_a.py::test_xfail"],
        );
        assert_eq!(decide(&t, &s), OutcomeStatus::Resolved);
        let t = task_with(&["tests/test_a.py::test_xpass"], &[]);
        assert_eq!(decide(&t, &s), OutcomeStatus::Unresolved);
        let t = task_with(&["tests/test_a.py::missing"], &[]);
        assert_eq!(decide(&t, &s), OutcomeStatus::Unresolved);
        let t = task_with(&[], &["tests/test_a.py::test_teardown_err"]);
        assert_eq!(decide(&t, &s), OutcomeStatus::Unresolved);
        let collection = "=== short test summary info ===\nERROR tests/test_b.py\n!!! Interrupted: 1 error during collection !!!\n";
        let s = parse_pytest_log(collection);
        assert_eq!(s.get("tests/test_b.py").map(String::as_str), Some("ERROR"));
        assert_eq!(decide(&t, &s), OutcomeStatus::TestsError);
        assert_eq!(decide(&t, &BTreeMap::new()), OutcomeStatus::TestsError);
    }
}
