//! Grading against real pytest runs on toy tasks.

mod common;

use std::time::Duration;

use tutor_proto::OutcomeStatus;
use tutor_rollout_worker::grade::grade;
use tutor_rollout_worker::sandbox::{shell_quote, LocalSandbox};
use tutor_rollout_worker::tasks::TaskRecord;
use tutor_rollout_worker::toy::generate;

fn task() -> TaskRecord {
    generate(1, 42).remove(0)
}

fn module_path(t: &TaskRecord) -> String {
    t.gold_files().remove(0)
}

#[test]
fn gold_resolves_and_empty_does_not() {
    common::init_python();
    let t = task();
    let g = grade(&t, &t.patch, common::GRADE_TIMEOUT);
    assert_eq!(g.status, OutcomeStatus::Resolved, "{}", g.log);
    for id in t.fail_to_pass.iter().chain(&t.pass_to_pass) {
        assert_eq!(g.test_statuses.get(id).map(String::as_str), Some("PASSED"));
    }
    let g = grade(&t, "", common::GRADE_TIMEOUT);
    assert_eq!(g.status, OutcomeStatus::Unresolved, "{}", g.log);
    let g = grade(&t, "  \n", common::GRADE_TIMEOUT);
    assert_eq!(g.status, OutcomeStatus::Unresolved, "{}", g.log);
}

#[test]
fn garbage_patch_fails_to_apply() {
    common::init_python();
    let t = task();
    let g = grade(&t, "this is not a patch\n", common::GRADE_TIMEOUT);
    assert_eq!(g.status, OutcomeStatus::ApplyPatchFail, "{}", g.log);
    let wrong_context = "--- a/README.md\n+++ b/README.md\n@@ -1,1 +1,1 @@\n-no such line\n+x\n";
    let g = grade(&t, wrong_context, common::GRADE_TIMEOUT);
    assert_eq!(g.status, OutcomeStatus::ApplyPatchFail, "{}", g.log);
}

#[test]
fn editing_the_tests_gains_nothing() {
    common::init_python();
    let t = task();
    let test_file = t.test_files().remove(0);
    let mut sb = LocalSandbox::create(&t, None).unwrap();
    // Write trivially passing versions of the hidden tests into the test file.
    let mut cheat = String::new();
    for id in &t.fail_to_pass {
        let name = id.rsplit("::").next().unwrap();
        cheat.push_str(&format!("\n\ndef {name}():\n    assert True\n"));
    }
    let out = sb.run(
        &format!(
            "printf %s {} >> {}",
            shell_quote(&cheat),
            shell_quote(&test_file)
        ),
        common::CMD_TIMEOUT,
    );
    assert_eq!(out.exit_code, 0);
    let patch = sb.diff();
    assert!(patch.contains(&test_file));
    let g = grade(&t, &patch, common::GRADE_TIMEOUT);
    assert_eq!(g.status, OutcomeStatus::Unresolved, "{}", g.log);
    // Same with the real fix on top: the fix still counts.
    let out = sb.run(
        &format!("git apply <<'EOF'\n{}EOF", t.patch),
        common::CMD_TIMEOUT,
    );
    assert_eq!(out.exit_code, 0, "{}", out.output);
    let g = grade(&t, &sb.diff(), common::GRADE_TIMEOUT);
    assert_eq!(g.status, OutcomeStatus::Resolved, "{}", g.log);
}

#[test]
fn agent_diff_with_new_files_round_trips() {
    common::init_python();
    let t = task();
    let mut sb = LocalSandbox::create(&t, None).unwrap();
    let out = sb.run(
        &format!("git apply <<'EOF'\n{}EOF\necho 'notes' > NOTES.txt && mkdir -p scratch && echo x > scratch/a.py", t.patch),
        common::CMD_TIMEOUT,
    );
    assert_eq!(out.exit_code, 0, "{}", out.output);
    let d = sb.diff();
    assert!(d.contains("NOTES.txt") && d.contains("scratch/a.py"));
    let g = grade(&t, &d, common::GRADE_TIMEOUT);
    assert_eq!(g.status, OutcomeStatus::Resolved, "{}", g.log);
}

#[test]
fn hanging_tests_time_out() {
    common::init_python();
    let t = task();
    let mut sb = LocalSandbox::create(&t, None).unwrap();
    let m = module_path(&t);
    sb.run(
        &format!(
            "printf '\\nimport time\\ntime.sleep(1000)\\n' >> {}",
            shell_quote(&m)
        ),
        common::CMD_TIMEOUT,
    );
    let t0 = std::time::Instant::now();
    let g = grade(&t, &sb.diff(), Duration::from_secs(3));
    assert_eq!(g.status, OutcomeStatus::TestsTimeout, "{}", g.log);
    assert!(t0.elapsed() < Duration::from_secs(30));
}

#[test]
fn collection_errors_are_test_errors() {
    common::init_python();
    let t = task();
    let mut sb = LocalSandbox::create(&t, None).unwrap();
    let m = module_path(&t);
    sb.run(
        &format!("echo 'def broken(:' >> {}", shell_quote(&m)),
        common::CMD_TIMEOUT,
    );
    let g = grade(&t, &sb.diff(), common::GRADE_TIMEOUT);
    assert_eq!(g.status, OutcomeStatus::TestsError, "{}", g.log);
}

#[test]
fn tasks_without_files_are_sandbox_errors() {
    let mut t = task();
    t.files.clear();
    let g = grade(&t, &t.patch.clone(), common::GRADE_TIMEOUT);
    assert_eq!(g.status, OutcomeStatus::SandboxError);
    assert!(g.log.contains("no repository files"), "{}", g.log);
}

#[test]
fn the_tasks_test_command_is_the_one_run() {
    common::init_python();
    let mut t = task();
    // A test command that selects no test: the gold patch no longer resolves (no test
    // ran: TESTS_ERROR), which shows the task's command ran, with the test files appended.
    t.test_cmd = "python -m pytest -rA -p no:cacheprovider -k no_test_has_this_name".into();
    let g = grade(&t, &t.patch, common::GRADE_TIMEOUT);
    assert_eq!(g.status, OutcomeStatus::TestsError, "{}", g.log);
    assert!(
        g.log.contains("-k no_test_has_this_name tests/"),
        "{}",
        g.log
    );
    t.test_cmd = "python -m pytest -rA -p no:cacheprovider -q".into();
    let g = grade(&t, &t.patch, common::GRADE_TIMEOUT);
    assert_eq!(g.status, OutcomeStatus::Resolved, "{}", g.log);
}

/// A worker whose Python has no pytest would grade every episode TESTS_ERROR ("No module
/// named pytest") and train on nothing but failures: it is refused before the first
/// lease, with the interpreter, the import error and the fix named.
#[test]
fn a_python_without_pytest_is_refused_with_the_fix_named() {
    use std::os::unix::fs::PermissionsExt;
    use tutor_rollout_worker::sandbox::local::{check_grading_python, python_interpreter};
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("python3");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'pytest'\" >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let err = check_grading_python(&fake).unwrap_err();
    for want in [
        fake.to_str().unwrap(),
        "cannot import pytest",
        "No module named 'pytest'",
        "TESTS_ERROR",
        ".venv/bin",
        "TUTOR_SANDBOX_PYTHON",
        ".venv-sandbox",
    ] {
        assert!(err.contains(want), "{want:?} missing from: {err}");
    }
    let missing = dir.path().join("no-such-python");
    let err = check_grading_python(&missing).unwrap_err();
    assert!(err.contains("cannot be run"), "{err}");
    // The interpreter the tests grade with has pytest.
    common::init_python();
    check_grading_python(&python_interpreter()).unwrap();
}

/// A new file as a unified diff.
fn new_file_patch(path: &str, content: &str) -> String {
    let lines: Vec<&str> = content.lines().collect();
    let mut p = format!(
        "diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{} @@\n",
        lines.len()
    );
    for l in lines {
        p.push_str(&format!("+{l}\n"));
    }
    p
}

/// Issue 15, item 3: a submission that adds a `conftest.py` turning every failure into
/// a pass (and prints fake summary lines) is RESOLVED by the harness's rules, which read
/// what the tests print, and UNRESOLVED by strict grading, which removes the conftest and
/// reads its own report; the disagreement is recorded. The gold patch is RESOLVED both
/// ways.
#[test]
fn a_conftest_that_forces_passes_fools_the_harness_but_not_strict_grading() {
    use tutor_rollout_worker::grade::{grade_in, GradingMode};
    common::init_python();
    let t = task();
    let hostile = new_file_patch(
        "conftest.py",
        "import pytest\n\
         \n\
         @pytest.hookimpl(hookwrapper=True)\n\
         def pytest_runtest_makereport(item, call):\n\
         \x20   outcome = yield\n\
         \x20   report = outcome.get_result()\n\
         \x20   report.outcome = 'passed'\n",
    );
    let harness = grade_in(
        &t,
        &hostile,
        common::GRADE_TIMEOUT,
        None,
        GradingMode::Harness,
    );
    assert_eq!(harness.status, OutcomeStatus::Resolved, "{}", harness.log);
    let strict = grade_in(
        &t,
        &hostile,
        common::GRADE_TIMEOUT,
        None,
        GradingMode::Strict,
    );
    assert_eq!(strict.status, OutcomeStatus::Unresolved, "{}", strict.log);
    assert_eq!(strict.harness_status, Some(OutcomeStatus::Resolved));
    assert!(
        strict
            .disagreement
            .contains("strict grading says UNRESOLVED, the harness RESOLVED"),
        "{}",
        strict.disagreement
    );
    assert!(
        strict.log.contains(">>> strict: reset conftest.py"),
        "{}",
        strict.log
    );
    for id in &t.fail_to_pass {
        assert_eq!(
            strict.test_statuses.get(id).map(String::as_str),
            Some("FAILED")
        );
    }

    let gold = grade_in(
        &t,
        &t.patch,
        common::GRADE_TIMEOUT,
        None,
        GradingMode::Strict,
    );
    assert_eq!(gold.status, OutcomeStatus::Resolved, "{}", gold.log);
    assert!(gold.disagreement.is_empty(), "{}", gold.disagreement);
    assert_eq!(gold.harness_status, Some(OutcomeStatus::Resolved));
}
