//! Grading a submission the way the SWE-bench harness does: fresh repo, apply the patch,
//! activate the environment, reset the test files, apply the test patch, run the spec's
//! test command on its directives, read the log with the spec's parser, and resolve as
//! the harness does (see [`crate::harness`] for the specs). Tasks outside the harness's
//! table with no command of their own get the generic pytest grading here: `-rA`
//! summary lines after the summary header, resolved iff every FAIL_TO_PASS and
//! PASS_TO_PASS test passed.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use tutor_proto::OutcomeStatus;

use crate::harness::{spec_for, Resolution, TestSpec, TestsReport};
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
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GradeResult {
    pub status: OutcomeStatus,
    /// Test name → status, as the spec's log parser reads them: `PASSED`, `FAILED`,
    /// `ERROR`, `XFAIL`, `SKIPPED` (and `XPASS` under the generic pytest grading).
    pub test_statuses: BTreeMap<String, String>,
    /// The harness's resolution (`RESOLVED_FULL`/`PARTIAL`/`NO`) where a harness parser
    /// read the log; `None` where the tests did not run or the generic grading decided.
    pub resolution: Option<Resolution>,
    /// Which spec graded, in one line (empty when none was found).
    pub spec: String,
    /// Why the grade is neither RESOLVED nor UNRESOLVED, naming the task and what is
    /// missing (empty otherwise).
    pub reason: String,
    /// The mode that decided `status`.
    pub mode: GradingMode,
    /// Strict grading: the harness's verdict on the same submission.
    pub harness_status: Option<OutcomeStatus>,
    /// Strict grading: why its verdict and the harness's differ (empty when they agree).
    pub disagreement: String,
    /// What happened: patch application, test patch, the test log.
    pub log: String,
}

impl GradeResult {
    pub fn resolved(&self) -> bool {
        self.status == OutcomeStatus::Resolved
    }

    fn fail(status: OutcomeStatus, log: String) -> Self {
        GradeResult {
            status,
            log: truncate_head_tail(&log, MAX_LOG_CHARS),
            ..GradeResult::default()
        }
    }

    fn because(mut self, reason: String) -> Self {
        self.reason = reason;
        self
    }

    fn with_spec(mut self, spec: &TestSpec) -> Self {
        self.spec = spec.describe();
        self
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

/// How a submission is graded (`[worker] grading`, `tutor eval --grading`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GradingMode {
    /// Exactly what the SWE-bench harness reports (the default of `tutor eval`).
    Harness,
    /// For training rewards (the workers' default): files that change how tests are
    /// collected or reported, when the submission touches them, are reset to the base
    /// before the tests; pytest results are read from a report written by Tutor's own
    /// plugin instead of the log the tests print into; every FAIL_TO_PASS and
    /// PASS_TO_PASS test must pass (a skipped one does not count as passing). A verdict
    /// that differs from the harness's is logged.
    #[default]
    Strict,
}

impl GradingMode {
    pub fn name(self) -> &'static str {
        match self {
            GradingMode::Harness => "harness",
            GradingMode::Strict => "strict",
        }
    }
}

impl std::str::FromStr for GradingMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "harness" => Ok(GradingMode::Harness),
            "strict" => Ok(GradingMode::Strict),
            other => Err(format!(
                "unknown grading mode {other:?}: `harness` (what SWE-bench reports) or \
                 `strict` (reward-hacking files reset, results from Tutor's own report)"
            )),
        }
    }
}

/// Files a submission may not change under strict grading: they decide which tests are
/// collected and how results are reported (a `conftest.py` hook can turn every failure
/// into a pass; a `setup.py` entry point registers a plugin at the re-install), or run
/// code in every Python process (`sitecustomize`, `.pth`).
pub fn is_protected(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    matches!(
        name,
        "conftest.py"
            | "pytest.ini"
            | ".pytest.ini"
            | "pytest.toml"
            | ".pytest.toml"
            | "tox.ini"
            | "setup.cfg"
            | "setup.py"
            | "pyproject.toml"
            | "sitecustomize.py"
            | "usercustomize.py"
    ) || name.ends_with(".pth")
}

/// The pytest plugin behind strict grading's report: each test's outcome by node id,
/// with the line pytest's `-rA` summary would print for it, written at the end of the
/// session to `$TUTOR_GRADE_REPORT` (a fresh directory outside the repository, read by
/// the grader after the test command has ended). Loaded under a random module name, so
/// a submission cannot shadow it.
const REPORT_PLUGIN: &str = r#""""Tutor's grading report: each test's outcome by node id (strict grading)."""
import json
import os

import pytest

_RANK = {"PASSED": 0, "XFAIL": 0, "SKIPPED": 1, "XPASS": 1, "FAILED": 2, "ERROR": 2}
_out = {}
_config = []
# pytest >= 7.2 prints an xfail's reason after the id in the -rA summary.
_XFAIL_REASON = tuple(getattr(pytest, "version_tuple", (0,))[:2]) >= (7, 2)


def pytest_configure(config):
    _config.append(config)


def _set(report, status, reason=""):
    nodeid = report.nodeid
    prev = _out.get(nodeid)
    if prev is not None and _RANK[status] <= _RANK[prev["status"]]:
        return
    shown = nodeid
    if _config:
        try:
            shown = _config[0].cwd_relative_nodeid(nodeid)
        except Exception:
            pass
    line = status + " " + shown
    if status == "XFAIL" and reason and _XFAIL_REASON:
        line += " - " + str(reason).split("\n")[0]
    _out[nodeid] = {"nodeid": nodeid, "status": status, "line": line}


def pytest_runtest_logreport(report):
    if report.outcome == "rerun":
        return
    wasxfail = getattr(report, "wasxfail", None)
    if report.when == "call":
        if wasxfail is not None:
            _set(report, "XFAIL" if report.skipped else "XPASS", wasxfail)
        elif report.passed:
            _set(report, "PASSED")
        elif report.failed:
            _set(report, "FAILED")
        else:
            _set(report, "SKIPPED")
    elif report.failed:
        _set(report, "ERROR")
    elif report.skipped:
        _set(report, "XFAIL" if wasxfail is not None else "SKIPPED", wasxfail)


def pytest_collectreport(report):
    if report.failed:
        _set(report, "ERROR")


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("TUTOR_GRADE_REPORT")
    if path:
        with open(path, "w") as f:
            for entry in _out.values():
                f.write(json.dumps(entry) + "\n")
"#;

/// Whether a test command is one pytest run (so strict grading can add its plugin;
/// `tox` and other wrappers do not pass it on, and in a compound command it would land
/// on the wrong part).
/// `cmd` with `-p module` right after its `pytest` word, before any option: a command
/// ending in an option that takes the directives as its value (mypy's `-k`) keeps them.
fn with_plugin(cmd: &str, module: &str) -> String {
    let mut at = 0;
    for word in cmd.split_whitespace() {
        let start = at + cmd[at..].find(word).expect("a word of cmd");
        let end = start + word.len();
        if word == "pytest" || word.ends_with("/pytest") {
            return format!("{} -p {module}{}", &cmd[..end], &cmd[end..]);
        }
        at = end;
    }
    format!("{cmd} -p {module}")
}

fn runs_pytest(test_cmd: &str) -> bool {
    if ["&&", "||", ";", "|", "`", "$("]
        .iter()
        .any(|op| test_cmd.contains(op))
    {
        return false;
    }
    let words: Vec<&str> = test_cmd.split_whitespace().collect();
    let first = words
        .iter()
        .find(|w| !w.contains('='))
        .copied()
        .unwrap_or("");
    first == "pytest"
        || first.ends_with("/pytest")
        || words.windows(2).any(|w| w == ["-m", "pytest"])
}

/// The harness's markers around the test command's output, and the lines whose
/// presence anywhere in its log makes it read no result (`get_logs_eval`).
const START_TEST_OUTPUT: &str = ">>>>> Start Test Output";
const END_TEST_OUTPUT: &str = ">>>>> End Test Output";
const HARNESS_BAD_CODES: [&str; 4] = [
    ">>>>> Patch Apply Failed",
    ">>>>> Reset Failed",
    ">>>>> Tests Errored",
    ">>>>> Tests Timed Out",
];

/// Grades `patch` for `task` in a fresh sandbox built from the task's files (never the
/// agent's sandbox) under the system temp dir, as the harness does. `timeout` bounds the
/// test run.
pub fn grade(task: &TaskRecord, patch: &str, timeout: Duration) -> GradeResult {
    grade_in(task, patch, timeout, None, GradingMode::Harness)
}

/// [`grade`] in `mode`, with the grading sandboxes created under `root`.
pub fn grade_in(
    task: &TaskRecord,
    patch: &str,
    timeout: Duration,
    root: Option<&std::path::Path>,
    mode: GradingMode,
) -> GradeResult {
    grade_with(task, patch, timeout, mode, || {
        LocalSandbox::create(task, root)
            .map(|sb| Box::new(sb) as Box<dyn Sandbox>)
            .map_err(|e| e.to_string())
    })
}

/// [`grade`] in `mode`, in fresh sandboxes from `factory` (new containers for Docker),
/// labelled `label`. The agent's own sandbox is never graded, so editing the tests gains
/// nothing.
pub fn grade_fresh(
    task: &TaskRecord,
    patch: &str,
    timeout: Duration,
    factory: &SandboxFactory,
    label: &str,
    mode: GradingMode,
) -> GradeResult {
    let mut n = 0;
    grade_with(task, patch, timeout, mode, || {
        n += 1;
        let label = if n == 1 {
            label.to_string()
        } else {
            format!("{label}-{n}")
        };
        factory
            .create(task, &label)
            .map_err(|e| format!("creating the grading sandbox: {e}"))
    })
}

/// Grades in `mode`, each run of the steps in a fresh sandbox from `sandbox`. Strict
/// grading runs the tests once, reading its verdict from its report and the harness's
/// from the log; when it had to reset protected files the submission changed, the
/// harness's steps run again, unchanged, in another fresh sandbox.
pub fn grade_with(
    task: &TaskRecord,
    patch: &str,
    timeout: Duration,
    mode: GradingMode,
    mut sandbox: impl FnMut() -> Result<Box<dyn Sandbox>, String>,
) -> GradeResult {
    // A grading sandbox stopped at its disk floor: no verdict from any run.
    let mut floor: Option<crate::sandbox::Stopped> = None;
    let mut run = |strict: bool| match sandbox() {
        Ok(mut sb) => {
            let ran = run_steps(task, patch, timeout, sb.as_mut(), strict);
            if let Some(stop) = sb.stopped() {
                floor.get_or_insert(stop);
            }
            ran
        }
        Err(e) => Ran::early(GradeResult::fail(OutcomeStatus::SandboxError, e.clone()).because(e)),
    };
    if mode == GradingMode::Harness {
        let verdict = run(false).harness_verdict(task, patch);
        return match floor {
            Some(stop) => floor_verdict(verdict, stop),
            None => verdict,
        };
    }
    let ran = run(true);
    let reset = ran.reset.clone();
    let harness = if reset.is_empty() {
        ran.clone().harness_verdict(task, patch)
    } else {
        run(false).harness_verdict(task, patch)
    };
    let mut strict = ran.strict_verdict(task);
    strict.harness_status = Some(harness.status);
    if harness.resolved() != strict.resolved() {
        strict.disagreement = format!(
            "task {}: strict grading says {}, the harness {}{}",
            task.instance_id,
            status_str(strict.status),
            status_str(harness.status),
            if reset.is_empty() {
                String::new()
            } else {
                format!(
                    " (the submission changes {}, which decide how tests are collected or \
                     reported)",
                    reset.join(", ")
                )
            }
        );
        tracing::warn!("{}", strict.disagreement);
    }
    match floor {
        Some(stop) => floor_verdict(strict, stop),
        None => strict,
    }
}

/// `result` replaced for a grading sandbox stopped at its disk floor, its log kept: the
/// disk crossed the floor while the grading's own commands ran (the submission's code, or
/// its patch): TESTS_ERROR, a failure the submission caused; already under it: no
/// verdict (SANDBOX_ERROR).
fn floor_verdict(result: GradeResult, stop: crate::sandbox::Stopped) -> GradeResult {
    let mut log = result.log;
    log.push_str(&format!("\n>>> {}\n", stop.why));
    let status = match stop.by_own_command {
        true => OutcomeStatus::TestsError,
        false => OutcomeStatus::SandboxError,
    };
    GradeResult::fail(status, log).because(stop.why)
}

fn status_str(s: OutcomeStatus) -> &'static str {
    s.as_str_name().trim_start_matches("OUTCOME_STATUS_")
}

/// The outcome of one run of the grading steps.
#[derive(Clone)]
struct Ran {
    /// The tests' output, or a verdict before it could decide one (the patch did not
    /// apply, no spec, no environment, the test patch failed, a timeout).
    tests: Result<TestsRun, GradeResult>,
    /// Protected files the submission changed that strict grading reset.
    reset: Vec<String>,
}

#[derive(Clone)]
struct TestsRun {
    spec: TestSpec,
    log: String,
    /// The test command's output between the harness's start and end markers.
    output: String,
    exit_code: i32,
    /// Strict grading's report (`None`: none was asked for, or the command does not
    /// run pytest directly): per node id, the worst status and its summary line.
    report: Option<BTreeMap<String, (String, String)>>,
}

impl Ran {
    fn early(g: GradeResult) -> Self {
        Ran {
            tests: Err(g),
            reset: Vec::new(),
        }
    }

    /// The harness's verdict: its log checks (`get_logs_eval`: a bad code anywhere in
    /// the log, which holds the submission's diff too, and no result is read), the
    /// spec's parser on the section between the markers, the harness's resolution.
    fn harness_verdict(self, task: &TaskRecord, patch: &str) -> GradeResult {
        let mut g = match self.tests {
            Err(g) => g,
            Ok(run) => match run.spec.parser {
                None => generic_verdict(task, &run.spec, run.log, parse_pytest_log(&run.output)),
                Some(parser) => {
                    let full = format!("{patch}\n{}", run.output);
                    match HARNESS_BAD_CODES.iter().find(|c| full.contains(*c)) {
                        Some(code) => {
                            let reason = format!(
                                "task {}: the log holds the harness's `{code}` line (printed \
                                 by the tests or in the submission's diff), so the harness \
                                 reads no result",
                                task.instance_id
                            );
                            tests_error(&run.spec, run.log, reason)
                        }
                        None => {
                            let statuses = parser.parse_checked(&run.output);
                            parsed_verdict(task, run, parser, statuses, |s| {
                                let r = TestsReport::new(task, s).resolution();
                                (r == Resolution::Full, Some(r))
                            })
                        }
                    }
                }
            },
        };
        g.mode = GradingMode::Harness;
        g
    }

    /// Strict grading's verdict: the report when there is one (its summary lines read
    /// by the spec's parser: the datasets name tests as the harness's parser cuts them),
    /// else the parser on the log; every FAIL_TO_PASS and PASS_TO_PASS test must be
    /// PASSED or XFAIL.
    fn strict_verdict(self, task: &TaskRecord) -> GradeResult {
        let mut g = match self.tests {
            Err(g) => g,
            Ok(mut run) => match (run.spec.parser, run.report.take()) {
                (None, report) => {
                    let statuses = match report {
                        Some(r) => r
                            .into_iter()
                            .map(|(id, (status, _))| (id, status))
                            .collect(),
                        None => parse_pytest_log(&run.output),
                    };
                    generic_verdict(task, &run.spec, run.log, statuses)
                }
                (Some(parser), report) => {
                    let statuses = match report {
                        Some(r) => Ok(parser.parse(
                            &r.values()
                                .map(|(_, line)| format!("{line}\n"))
                                .collect::<String>(),
                        )),
                        None => parser.parse_checked(&run.output),
                    };
                    parsed_verdict(task, run, parser, statuses, |s| {
                        let passed = |t: &String| {
                            matches!(s.get(t).map(String::as_str), Some("PASSED" | "XFAIL"))
                        };
                        let all = task
                            .fail_to_pass
                            .iter()
                            .chain(&task.pass_to_pass)
                            .all(passed);
                        (all, None)
                    })
                }
            },
        };
        g.mode = GradingMode::Strict;
        g
    }
}

/// The verdict on the statuses `parser` read: TESTS_ERROR where it could not read the
/// log (the harness's parser raises) or found no test in it, else RESOLVED or
/// UNRESOLVED as `decide` says (with the harness's resolution where it gives one).
fn parsed_verdict(
    task: &TaskRecord,
    run: TestsRun,
    parser: crate::harness::LogParser,
    statuses: Result<BTreeMap<String, String>, String>,
    decide: impl FnOnce(&BTreeMap<String, String>) -> (bool, Option<Resolution>),
) -> GradeResult {
    let statuses = match statuses {
        Err(e) => {
            return tests_error(
                &run.spec,
                run.log,
                format!("task {}: {e}", task.instance_id),
            )
        }
        Ok(s) => s,
    };
    if statuses.is_empty() {
        let reason = format!(
            "task {}: the test log (exit {}) has no line the {} log parser reads: the tests \
             did not run, or the spec's parser does not fit this repository",
            task.instance_id,
            run.exit_code,
            parser.name()
        );
        return tests_error(&run.spec, run.log, reason);
    }
    let (resolved, resolution) = decide(&statuses);
    GradeResult {
        status: if resolved {
            OutcomeStatus::Resolved
        } else {
            OutcomeStatus::Unresolved
        },
        test_statuses: statuses,
        resolution,
        spec: run.spec.describe(),
        log: truncate_head_tail(&run.log, MAX_LOG_CHARS),
        ..GradeResult::default()
    }
}

/// The generic pytest decision (see [`decide`]).
fn generic_verdict(
    task: &TaskRecord,
    spec: &TestSpec,
    log: String,
    test_statuses: BTreeMap<String, String>,
) -> GradeResult {
    let status = decide(task, &test_statuses);
    let reason = if status == OutcomeStatus::TestsError {
        format!(
            "task {}: no test ran (collection errors, or no pytest summary in the log)",
            task.instance_id
        )
    } else {
        String::new()
    };
    GradeResult {
        status,
        test_statuses,
        spec: spec.describe(),
        reason,
        log: truncate_head_tail(&log, MAX_LOG_CHARS),
        ..GradeResult::default()
    }
}

/// TESTS_ERROR with `reason`, logged.
fn tests_error(spec: &TestSpec, mut log: String, reason: String) -> GradeResult {
    log.push_str(&format!("\n>>> TESTS_ERROR: {reason}\n"));
    GradeResult::fail(OutcomeStatus::TestsError, log)
        .with_spec(spec)
        .because(reason)
}

/// Lines of the report read per command (each well under a command's output cap).
const REPORT_LINES_PER_READ: usize = 2_000;

/// One run of the grading steps; `strict` resets the protected files the submission
/// changed (the gold patch's own files aside) and asks a pytest command for the report.
fn run_steps(
    task: &TaskRecord,
    patch: &str,
    timeout: Duration,
    sb: &mut dyn Sandbox,
    strict: bool,
) -> Ran {
    let spec = match spec_for(task) {
        Ok(s) => s,
        Err(e) => {
            return Ran::early(
                GradeResult::fail(OutcomeStatus::NoTestSpec, format!(">>> {e}\n"))
                    .because(e.to_string()),
            )
        }
    };
    let mut log = format!(">>> {}\n", spec.describe());
    let mut reset = Vec::new();
    let fail = |status: OutcomeStatus, log: String, reason: String, reset: &Vec<String>| Ran {
        tests: Err(GradeResult::fail(status, log)
            .with_spec(&spec)
            .because(reason)),
        reset: reset.clone(),
    };
    // 1. The submission.
    if !patch.trim().is_empty() {
        let p = match sb.write_scratch("model.patch", &ensure_newline(patch)) {
            Ok(p) => p,
            Err(e) => return fail(OutcomeStatus::SandboxError, log, e.to_string(), &reset),
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
            return Ran::early(
                GradeResult::fail(OutcomeStatus::ApplyPatchFail, log).with_spec(&spec),
            );
        }
    }
    // 1b. Strict grading: the protected files the submission changed, as the sandbox
    // sees them (renames, quoted paths and deletions included), go back to the base.
    if strict {
        let gold = task.gold_files();
        let Some(changed) = sb.try_changed_files() else {
            // Read as "nothing changed", the protected files would not be reset.
            let reason = "strict grading: the files the submission changed could not be \
                          listed (git failed in the grading sandbox), so the protected ones \
                          could not be reset"
                .to_string();
            log.push_str(&format!(">>> {reason}\n"));
            return fail(OutcomeStatus::SandboxError, log, reason, &reset);
        };
        reset = changed
            .into_iter()
            .filter(|f| is_protected(f) && !gold.contains(f))
            .collect();
        if !reset.is_empty() {
            log.push_str(&format!(">>> strict: reset {}\n", reset.join(" ")));
            if let Err(reason) = reset_to_base(sb, &reset, &mut log) {
                return fail(OutcomeStatus::SandboxError, log, reason, &reset);
            }
        }
    }

    // 2. The environment: activation must work; eval commands and the re-install run
    // as in the harness's script, whose failures do not stop the tests.
    let prelude = spec.prelude();
    if let Some(activate) = &spec.activate {
        let out = sb.run(activate, GIT_STEP_TIMEOUT);
        log.push_str(&format!(">>> {activate}\n"));
        log.push_str(&out.output);
        if out.exit_code != 0 || out.timed_out {
            let reason = format!(
                "task {}: the image{} has no environment for `{activate}` (exit {}): \
                 SWE-bench images keep one at /opt/miniconda3 (env `testbed`)",
                task.instance_id,
                if task.image.is_empty() {
                    String::new()
                } else {
                    format!(" {}", task.image)
                },
                out.exit_code
            );
            log.push_str(&format!("\n>>> ENVIRONMENT_ERROR: {reason}\n"));
            return fail(OutcomeStatus::EnvironmentError, log, reason, &reset);
        }
    }
    if let Some(install) = &spec.install {
        let out = sb.run(&format!("{prelude}{install}"), timeout);
        log.push_str(&format!(">>> {install}\n"));
        log.push_str(&truncate_head_tail(&out.output, MAX_LOG_CHARS / 4));
        log.push_str(&format!("\n>>> install exit {}\n", out.exit_code));
        if out.timed_out {
            log.push_str("\n>>> TESTS_TIMEOUT (install)\n");
            return fail(OutcomeStatus::TestsTimeout, log, String::new(), &reset);
        }
    }

    // 3. Reset the test files to the base, so edits to tests cannot make them pass.
    let test_files = task.test_files();
    if !test_files.is_empty() {
        log.push_str(">>> reset test files\n");
        if reset_to_base(sb, &test_files, &mut log).is_err() {
            let reason = format!("task {}: resetting the test files failed", task.instance_id);
            return fail(OutcomeStatus::SandboxError, log, reason, &reset);
        }
    }

    // 4. The test patch.
    if !task.test_patch.trim().is_empty() {
        let p = match sb.write_scratch("test.patch", &ensure_newline(&task.test_patch)) {
            Ok(p) => p,
            Err(e) => return fail(OutcomeStatus::SandboxError, log, e.to_string(), &reset),
        };
        let out = sb.run(&format!("git apply --verbose {p}"), GIT_STEP_TIMEOUT);
        log.push_str(">>> apply test patch\n");
        log.push_str(&out.output);
        if out.exit_code != 0 {
            let reason = format!(
                "task {}: its test_patch does not apply at base commit {} after the \
                 submission (usually a broken task; a submission that puts files where the \
                 test patch needs them can cause it too)",
                task.instance_id,
                sb.base_commit()
            );
            log.push_str(&format!("\n>>> TEST_PATCH_FAIL: {reason}\n"));
            return fail(OutcomeStatus::TestPatchFail, log, reason, &reset);
        }
    }

    // 5. The tests, between the harness's markers (the eval commands' output stays
    // outside). Strict grading adds its report plugin to a pytest command, under a
    // random module name, writing to a fresh directory read after the command ends.
    let cmd = spec.test_command();
    log.push_str(&format!(">>> {cmd}\n"));
    let report = if strict && runs_pytest(&spec.test_cmd) {
        let module = format!("tutor_grade_report_{:016x}", rand::random::<u64>());
        let plugin = match sb.write_scratch(&format!("{module}.py"), REPORT_PLUGIN) {
            Ok(p) => p,
            Err(e) => return fail(OutcomeStatus::SandboxError, log, e.to_string(), &reset),
        };
        // A fresh directory under the sandbox's temporary directory (stable from one
        // command to the next; the local sandbox shows paths in its output rewritten,
        // so the path is named, not read back).
        let dir = format!(
            "${{TMPDIR:-/tmp}}/tutor-grade-{:016x}",
            rand::random::<u64>()
        );
        let made = sb.run(&format!("mkdir -m 700 \"{dir}\""), GIT_STEP_TIMEOUT);
        if made.exit_code != 0 {
            return fail(
                OutcomeStatus::SandboxError,
                log,
                format!("making the report directory failed: {}", made.output),
                &reset,
            );
        }
        Some((module, plugin, dir))
    } else {
        None
    };
    let test_cmd = match &report {
        None => cmd.clone(),
        Some((module, plugin, dir)) => format!(
            "TUTOR_GRADE_REPORT=\"{dir}/report.jsonl\" \
             PYTHONPATH=\"$(dirname {plugin})${{PYTHONPATH:+:$PYTHONPATH}}\" {}",
            with_plugin(&cmd, module)
        ),
    };
    let out = sb.run(
        &format!(
            "{prelude}printf '%s\\n' '{START_TEST_OUTPUT}'; {test_cmd}; __rc=$?; \
             printf '%s\\n' '{END_TEST_OUTPUT}'; exit $__rc"
        ),
        timeout,
    );
    log.push_str(&out.output);
    if out.timed_out {
        log.push_str("\n>>> TESTS_TIMEOUT\n");
        return fail(OutcomeStatus::TestsTimeout, log, String::new(), &reset);
    }
    // The harness's section: after the first start marker, up to the next end marker.
    let output = out
        .output
        .split(START_TEST_OUTPUT)
        .nth(1)
        .map(|s| s.split(END_TEST_OUTPUT).next().unwrap_or(""))
        .unwrap_or("")
        .to_string();
    let report = report.map(|(_, _, dir)| read_report(sb, &dir));
    Ran {
        tests: Ok(TestsRun {
            spec,
            log,
            output,
            exit_code: out.exit_code,
            report,
        }),
        reset,
    }
}

/// Reads the report the plugin wrote into `dir` (in pieces, each under a command's
/// output cap), then removes `dir`. A node id reported twice keeps its worst status.
/// Lines that are not the plugin's JSON are ignored; a missing report is empty.
fn read_report(sb: &mut dyn Sandbox, dir: &str) -> BTreeMap<String, (String, String)> {
    // `dir` is `${TMPDIR:-/tmp}/<name>`: expanded by the shell, so double-quoted.
    let file = format!("\"{dir}/report.jsonl\"");
    let mut out: BTreeMap<String, (String, String)> = BTreeMap::new();
    let mut first = 1;
    loop {
        let last = first + REPORT_LINES_PER_READ - 1;
        let chunk = sb.run(
            &format!("sed -n '{first},{last}p' {file}"),
            GIT_STEP_TIMEOUT,
        );
        let mut lines = 0;
        for line in chunk.output.lines() {
            lines += 1;
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let (Some(id), Some(status), Some(text)) = (
                v["nodeid"].as_str(),
                v["status"].as_str(),
                v["line"].as_str(),
            ) else {
                continue;
            };
            if !STATUSES.contains(&status) {
                continue;
            }
            match out.get(id) {
                Some((prev, _)) if severity(prev) >= severity(status) => {}
                _ => {
                    out.insert(id.to_string(), (status.to_string(), text.to_string()));
                }
            }
        }
        if chunk.exit_code != 0 || lines < REPORT_LINES_PER_READ || first > 500_000 {
            break;
        }
        first = last + 1;
    }
    let _ = sb.run(&format!("rm -rf \"{dir}\""), GIT_STEP_TIMEOUT);
    out
}

/// Puts `files` back as they are at the base commit (removing the ones it lacks).
fn reset_to_base(sb: &mut dyn Sandbox, files: &[String], log: &mut String) -> Result<(), String> {
    let base = sb.base_commit().to_string();
    let reset: Vec<String> = files
        .iter()
        .map(|f| {
            let q = crate::sandbox::shell_quote(f);
            if sb.base_file(f).is_some() {
                format!("git checkout -q {base} -- {q}")
            } else {
                format!("rm -rf -- {q}")
            }
        })
        .collect();
    let out = sb.run(&reset.join(" && "), GIT_STEP_TIMEOUT);
    log.push_str(&out.output);
    if out.exit_code != 0 {
        return Err(format!(
            "resetting {} failed: {}",
            files.join(" "),
            out.output
        ));
    }
    Ok(())
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

    /// Strict grading resets the protected files the submission changed; when the
    /// grading sandbox's git cannot list them, that is a sandbox error, not "nothing
    /// changed" (which would leave a conftest.py the submission planted in place).
    #[test]
    fn strict_grading_whose_changed_files_cannot_be_listed_is_a_sandbox_error() {
        tests_support::init_python();
        let task = crate::toy::generate(1, 11).remove(0);
        let result = grade_with(
            &task,
            &task.patch,
            Duration::from_secs(120),
            GradingMode::Strict,
            || {
                let sb = LocalSandbox::create(&task, None).map_err(|e| e.to_string())?;
                std::fs::remove_dir_all(sb.bookkeeping_dir()).map_err(|e| e.to_string())?;
                Ok(Box::new(sb) as Box<dyn Sandbox>)
            },
        );
        assert_eq!(result.status, OutcomeStatus::SandboxError, "{}", result.log);
        assert!(
            result.reason.contains("could not be listed"),
            "{}",
            result.reason
        );
        // With its git whole, the same submission is graded.
        let whole = grade_in(
            &task,
            &task.patch,
            Duration::from_secs(120),
            None,
            GradingMode::Strict,
        );
        assert_eq!(whole.status, OutcomeStatus::Resolved, "{}", whole.log);
    }

    #[test]
    fn the_report_plugin_goes_right_after_pytest() {
        assert_eq!(
            with_plugin("pytest -rA -k 'testA or testB'", "m"),
            "pytest -p m -rA -k 'testA or testB'"
        );
        assert_eq!(
            with_plugin("python -m pytest -rA tests/a.py", "m"),
            "python -m pytest -p m -rA tests/a.py"
        );
        assert_eq!(
            with_plugin("FOO=pytest /opt/env/bin/pytest -rA", "m"),
            "FOO=pytest /opt/env/bin/pytest -p m -rA"
        );
    }

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
