//! The oracle teacher as a policy: it solves toy tasks from scratch and recovers from
//! states a student wrecked.

mod common;

use common::{drive, exec};
use tutor_proto::OutcomeStatus;
use tutor_rollout_worker::action::{parse_action, Action};
use tutor_rollout_worker::grade::grade;
use tutor_rollout_worker::sandbox::{shell_quote, LocalSandbox};
use tutor_rollout_worker::tasks::{RepoFileRecord, TaskRecord};
use tutor_rollout_worker::teacher::{ExecutedStep, OracleTeacher, Teacher, TeacherState};
use tutor_rollout_worker::toy::generate;

fn commands(history: &[ExecutedStep]) -> Vec<String> {
    history.iter().filter_map(|s| s.command.clone()).collect()
}

fn assert_resolved(task: &TaskRecord, sb: &LocalSandbox, history: &[ExecutedStep]) {
    let g = grade(task, &sb.diff(), common::GRADE_TIMEOUT);
    assert_eq!(
        g.status,
        OutcomeStatus::Resolved,
        "{}: not resolved\ncommands: {:#?}\n{}",
        task.instance_id,
        commands(history),
        g.log
    );
    // Nothing but the gold files changed.
    let mut changed = sb.changed_files();
    changed.sort();
    let mut gold = task.gold_files();
    gold.sort();
    assert_eq!(changed, gold, "{}", task.instance_id);
}

#[test]
fn oracle_alone_resolves_every_toy_task_within_six_turns() {
    common::init_python();
    for task in generate(10, 5) {
        let mut sb = LocalSandbox::create(&task, None).unwrap();
        let mut oracle = OracleTeacher::new();
        let mut history = Vec::new();
        let (submitted, turns) = drive(&mut oracle, &task, &mut sb, &mut history, 6);
        assert!(
            submitted,
            "{}: no submit in 6 turns: {:#?}",
            task.instance_id,
            commands(&history)
        );
        assert!(turns <= 6);
        // Open, fix with the viewer's replace (a toy fix is one unique line), test, submit.
        let cmds = commands(&history);
        assert!(cmds[0].starts_with("open "), "{cmds:?}");
        assert!(cmds[1].starts_with("replace '"), "{cmds:?}");
        assert_eq!(cmds.len(), 3, "open, replace, test: {cmds:?}");
        assert!(cmds.iter().any(|c| c.contains("pytest")), "{cmds:?}");
        assert!(history.iter().all(|s| s.exit_code == 0), "{:#?}", history);
        assert_resolved(&task, &sb, &history);
    }
}

#[test]
fn oracle_replies_are_one_reasoning_sentence_and_one_block() {
    let task = generate(1, 9).remove(0);
    let sb = LocalSandbox::create(&task, None).unwrap();
    let mut oracle = OracleTeacher::new();
    let reply = oracle
        .next_action(&TeacherState {
            task: &task,
            system_prompt: "",
            sandbox: &sb,
            history: &[],
            turn: 0,
            max_turns: 30,
        })
        .unwrap()
        .text;
    let (reason, block) = reply.split_once("\n\n```command\n").unwrap();
    assert!(!reason.contains('\n') && reason.ends_with('.'), "{reply}");
    assert!(block.ends_with("\n```"));
    assert!(matches!(parse_action(&reply), Ok(Action::Shell(_))));
    assert_eq!(oracle.name(), "oracle");
}

#[test]
fn oracle_recovers_after_wrong_edits() {
    common::init_python();
    for task in generate(4, 21) {
        let gold_file = task.gold_files().remove(0);
        let other = task
            .files
            .iter()
            .map(|f| f.path.clone())
            .find(|p| p.ends_with(".py") && *p != gold_file && !p.starts_with("tests/"))
            .unwrap();
        let mut sb = LocalSandbox::create(&task, None).unwrap();
        let mut history = Vec::new();
        // A student breaks another module, edits the gold file wrongly and adds a file.
        exec(
            &mut sb,
            &mut history,
            &format!("echo 'x = 1 +' >> {}", shell_quote(&other)),
        );
        exec(
            &mut sb,
            &mut history,
            &format!(
                "sed -i '5s/.*/    return None/' {}",
                shell_quote(&gold_file)
            ),
        );
        exec(&mut sb, &mut history, "echo 'print(1)' > reproduce.py");
        let mut oracle = OracleTeacher::new();
        let (submitted, _) = drive(&mut oracle, &task, &mut sb, &mut history, 10);
        assert!(submitted, "{:#?}", commands(&history));
        assert!(
            commands(&history)[3].contains("git checkout HEAD --"),
            "{:#?}",
            commands(&history)
        );
        assert_resolved(&task, &sb, &history);
    }
}

#[test]
fn oracle_recovers_after_cd_and_deleting_the_gold_file() {
    common::init_python();
    for (k, task) in generate(4, 33).into_iter().enumerate() {
        let gold_file = task.gold_files().remove(0);
        let mut sb = LocalSandbox::create(&task, None).unwrap();
        let mut history = Vec::new();
        exec(
            &mut sb,
            &mut history,
            &format!("cat -n {}", shell_quote(&gold_file)),
        );
        if k % 2 == 0 {
            exec(
                &mut sb,
                &mut history,
                &format!("rm {}", shell_quote(&gold_file)),
            );
        }
        exec(&mut sb, &mut history, "cd tests");
        assert_eq!(sb.cwd(), "~/repo/tests");
        let mut oracle = OracleTeacher::new();
        let (submitted, _) = drive(&mut oracle, &task, &mut sb, &mut history, 8);
        assert!(submitted, "{:#?}", commands(&history));
        assert_resolved(&task, &sb, &history);
    }
}

#[test]
fn oracle_recovers_after_a_wrong_commit_and_from_outside_the_repo() {
    common::init_python();
    let task = generate(1, 44).remove(0);
    let gold_file = task.gold_files().remove(0);
    let mut sb = LocalSandbox::create(&task, None).unwrap();
    let mut history = Vec::new();
    exec(
        &mut sb,
        &mut history,
        &format!(
            "echo '# junk' >> {} && echo y > new.txt",
            shell_quote(&gold_file)
        ),
    );
    exec(
        &mut sb,
        &mut history,
        "git add -A && git commit -qm wip && cd /",
    );
    assert_eq!(sb.cwd(), "/");
    let mut oracle = OracleTeacher::new();
    let (submitted, _) = drive(&mut oracle, &task, &mut sb, &mut history, 10);
    assert!(submitted, "{:#?}", commands(&history));
    assert_resolved(&task, &sb, &history);
}

#[test]
fn oracle_submits_at_once_when_already_fixed_and_tested() {
    common::init_python();
    let task = generate(1, 55).remove(0);
    let mut sb = LocalSandbox::create(&task, None).unwrap();
    let mut history = Vec::new();
    exec(
        &mut sb,
        &mut history,
        &format!("git apply <<'EOF'\n{}EOF", task.patch),
    );
    let mut oracle = OracleTeacher::new();
    let state = |h: &[ExecutedStep], sb: &LocalSandbox, turn| oracle_action(&task, sb, h, turn, 30);
    // Fixed but untested: run the tests. Tested: submit.
    assert!(state(&history, &sb, 1).contains("pytest"));
    exec(&mut sb, &mut history, "python -m pytest -q");
    assert!(state(&history, &sb, 2).contains("```command\nsubmit\n```"));
    // On the last turn it submits without testing.
    let fresh: Vec<ExecutedStep> = history[..1].to_vec();
    assert!(state(&fresh, &sb, 29).contains("submit"));
    let _ = &mut oracle;
}

fn oracle_action(
    task: &TaskRecord,
    sb: &LocalSandbox,
    history: &[ExecutedStep],
    turn: usize,
    max_turns: usize,
) -> String {
    OracleTeacher::new()
        .next_action(&TeacherState {
            task,
            system_prompt: "",
            sandbox: sb,
            history,
            turn,
            max_turns,
        })
        .unwrap()
        .text
}

/// A hand-written task whose gold patch has two hunks in one file (one a one-line
/// replacement, one an insertion), a second modified file and a new file.
fn multi_hunk_task() -> TaskRecord {
    let filler: String = (0..12)
        .map(|i| format!("def helper_{i}(x):\n    return x + {i}\n\n\n"))
        .collect();
    let core_base = format!(
        "\"\"\"Core arithmetic.\"\"\"\n\n\ndef add(a, b):\n    return a - b\n\n\n{filler}def mul(a, b):\n    return a + b\n"
    );
    let core_gold = format!(
        "\"\"\"Core arithmetic.\"\"\"\n\n\ndef add(a, b):\n    return a + b\n\n\n{filler}def mul(a, b):\n    # multiply, do not add\n    return a * b\n"
    );
    let util_base = "def neg(x):\n    return x\n";
    let util_gold = "def neg(x):\n    return -x\n";
    let version = "VERSION = \"1.0\"\n";
    let tests_base =
        "from calc import core\n\n\ndef test_helper():\n    assert core.helper_3(1) == 4\n";
    let tests_gold = format!(
        "{tests_base}\n\ndef test_fixed():\n    from calc import util, version\n    assert core.add(2, 3) == 5\n    assert core.mul(2, 3) == 6\n    assert util.neg(4) == -4\n    assert version.VERSION == \"1.0\"\n"
    );
    let d = |p: &str, a: &str, b: &str| {
        let body = similar::TextDiff::from_lines(a, b)
            .unified_diff()
            .context_radius(3)
            .header(&format!("a/{p}"), &format!("b/{p}"))
            .to_string();
        format!("diff --git a/{p} b/{p}\n{body}")
    };
    let patch = format!(
        "{}{}diff --git a/calc/version.py b/calc/version.py\nnew file mode 100644\n--- /dev/null\n+++ b/calc/version.py\n@@ -0,0 +1 @@\n+{}",
        d("calc/core.py", &core_base, &core_gold),
        d("calc/util.py", util_base, util_gold),
        version
    );
    let file = |p: &str, c: &str| RepoFileRecord {
        path: p.into(),
        content: c.into(),
    };
    TaskRecord {
        instance_id: "hand__calc-1".into(),
        repo: "hand/calc".into(),
        base_commit: String::new(),
        problem_statement: "add, mul and neg are wrong; also add calc/version.py".into(),
        hints_text: String::new(),
        patch,
        test_patch: d("tests/test_core.py", tests_base, &tests_gold),
        fail_to_pass: vec!["tests/test_core.py::test_fixed".into()],
        pass_to_pass: vec!["tests/test_core.py::test_helper".into()],
        version: String::new(),
        files: vec![
            file("calc/__init__.py", ""),
            file("calc/core.py", &core_base),
            file("calc/util.py", util_base),
            file("tests/test_core.py", tests_base),
            file("pytest.ini", "[pytest]\npythonpath = .\n"),
        ],
        image: String::new(),
        test_cmd: String::new(),
        log_parser: String::new(),
    }
}

#[test]
fn oracle_handles_multi_hunk_multi_file_patches_and_partial_progress() {
    common::init_python();
    let task = multi_hunk_task();
    let parsed = tutor_rollout_worker::tasks::parse_unified_diff(&task.patch).unwrap();
    assert_eq!(parsed.len(), 3);
    assert_eq!(parsed[0].hunks.len(), 2);
    assert_eq!(
        grade(&task, &task.patch, common::GRADE_TIMEOUT).status,
        OutcomeStatus::Resolved
    );
    assert_eq!(
        grade(&task, "", common::GRADE_TIMEOUT).status,
        OutcomeStatus::Unresolved
    );

    // From scratch.
    let mut sb = LocalSandbox::create(&task, None).unwrap();
    let mut history = Vec::new();
    let (submitted, _) = drive(&mut OracleTeacher::new(), &task, &mut sb, &mut history, 12);
    assert!(submitted, "{:#?}", commands(&history));
    assert!(history.iter().all(|s| s.exit_code == 0), "{history:#?}");
    assert_resolved(&task, &sb, &history);

    // With the first hunk already fixed by the student: no revert, only the rest.
    let mut sb = LocalSandbox::create(&task, None).unwrap();
    let mut history = Vec::new();
    exec(
        &mut sb,
        &mut history,
        "sed -i '5s/a - b/a + b/' calc/core.py",
    );
    let (submitted, _) = drive(&mut OracleTeacher::new(), &task, &mut sb, &mut history, 12);
    assert!(submitted);
    assert!(
        !commands(&history)
            .iter()
            .any(|c| c.contains("git checkout")),
        "{:#?}",
        commands(&history)
    );
    assert_resolved(&task, &sb, &history);

    // With a wrong version of the new file and the second file deleted.
    let mut sb = LocalSandbox::create(&task, None).unwrap();
    let mut history = Vec::new();
    exec(
        &mut sb,
        &mut history,
        "echo 'VERSION = 2' > calc/version.py && rm calc/util.py && cd calc",
    );
    let (submitted, _) = drive(&mut OracleTeacher::new(), &task, &mut sb, &mut history, 14);
    assert!(submitted, "{:#?}", commands(&history));
    assert_resolved(&task, &sb, &history);
}

#[test]
fn oracle_falls_back_to_git_apply_for_patches_it_cannot_digest() {
    common::init_python();
    let mut task = multi_hunk_task();
    // A rename is beyond the targeted-edit planner.
    let (core_and_util, version) = task
        .patch
        .split_once("diff --git a/calc/version.py")
        .unwrap();
    let core = core_and_util
        .split("diff --git a/calc/util.py")
        .next()
        .unwrap();
    task.patch = format!(
        "{core}diff --git a/calc/version.py{version}diff --git a/calc/util.py b/calc/helpers.py\nsimilarity index 50%\nrename from calc/util.py\nrename to calc/helpers.py\n--- a/calc/util.py\n+++ b/calc/helpers.py\n@@ -1,2 +1,2 @@\n def neg(x):\n-    return x\n+    return -x\n"
    );
    let mut sb = LocalSandbox::create(&task, None).unwrap();
    let mut history = Vec::new();
    exec(&mut sb, &mut history, "echo junk >> calc/core.py");
    let (submitted, turns) = drive(&mut OracleTeacher::new(), &task, &mut sb, &mut history, 6);
    assert!(submitted, "{:#?}", history);
    assert!(turns <= 4, "{:#?}", commands(&history));
    let mut changed = sb.changed_files();
    changed.sort();
    assert_eq!(
        changed,
        [
            "calc/core.py",
            "calc/helpers.py",
            "calc/util.py",
            "calc/version.py"
        ]
    );
    assert!(commands(&history).iter().any(|c| c.contains("git apply")));
    assert_eq!(
        sb.read_file("calc/helpers.py").as_deref(),
        Some("def neg(x):\n    return -x\n")
    );
    assert!(sb.read_file("calc/util.py").is_none());
    assert!(sb
        .read_file("calc/core.py")
        .unwrap()
        .contains("return a * b"));
}

#[test]
fn oracle_fixes_a_wrong_edit_of_the_buggy_line_in_place() {
    common::init_python();
    for task in generate(3, 66) {
        let gold_file = task.gold_files().remove(0);
        // The line the gold patch removes, and its number in the buggy file.
        let removed = task
            .patch
            .lines()
            .find(|l| l.starts_with('-') && !l.starts_with("---"))
            .unwrap()[1..]
            .to_string();
        let content = task
            .files
            .iter()
            .find(|f| f.path == gold_file)
            .unwrap()
            .content
            .clone();
        let lineno = content.lines().position(|l| l == removed).unwrap() + 1;
        let mut sb = LocalSandbox::create(&task, None).unwrap();
        let mut history = Vec::new();
        exec(&mut sb, &mut history, &format!("cat -n {gold_file}"));
        exec(
            &mut sb,
            &mut history,
            &format!("sed -i '{lineno}s/.*/    x = 1\\n    return 12345/' {gold_file}"),
        );
        let (submitted, turns) = drive(&mut OracleTeacher::new(), &task, &mut sb, &mut history, 6);
        assert!(submitted);
        assert_eq!(turns, 3, "fix, test, submit: {:#?}", commands(&history));
        assert!(!commands(&history)
            .iter()
            .any(|c| c.contains("git checkout")));
        assert_resolved(&task, &sb, &history);
    }
}

/// DAgger-style mixing: a random "student" acts on some turns, the oracle on the others;
/// whatever state results, the oracle alone must then finish the task.
#[test]
fn oracle_finishes_from_states_a_random_student_leaves() {
    use rand::{Rng, SeedableRng};
    common::init_python();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2024);
    for (episode, task) in generate(8, 77).into_iter().enumerate() {
        let paths: Vec<String> = task.files.iter().map(|f| f.path.clone()).collect();
        let gold = task.gold_files().remove(0);
        let pkg = gold.split('/').next().unwrap().to_string();
        let mut sb = LocalSandbox::create(&task, None).unwrap();
        let mut history = Vec::new();
        let mut oracle = OracleTeacher::new();
        for turn in 0..12 {
            if rng.gen_bool(0.5) {
                let f = &paths[rng.gen_range(0..paths.len())];
                let cmd = match rng.gen_range(0..12) {
                    0 => "cd tests".to_string(),
                    1 => "cd /".to_string(),
                    2 => format!("cd ~/repo/{pkg}"),
                    3 => format!("rm -f ~/repo/{f}"),
                    4 => format!("sed -i '{}s/.*/    pass/' ~/repo/{f}", rng.gen_range(1..12)),
                    5 => format!("echo junk >> ~/repo/{f}"),
                    6 => format!("echo 'x = {turn}' > ~/repo/new_{turn}.py"),
                    7 => "cd ~/repo && git add -A && git commit -qm wip".to_string(),
                    8 => "cd ~/repo && mkdir -p scratch/deep && echo 1 > scratch/deep/a.txt"
                        .to_string(),
                    9 => "cd ~/repo && python -m pytest -q".to_string(),
                    10 => format!("cat -n ~/repo/{gold}"),
                    _ => "cd ~/repo && rm -rf tests".to_string(),
                };
                exec(&mut sb, &mut history, &cmd);
            } else {
                let reply = oracle
                    .next_action(&TeacherState {
                        task: &task,
                        system_prompt: "",
                        sandbox: &sb,
                        history: &history,
                        turn,
                        max_turns: 40,
                    })
                    .unwrap()
                    .text;
                match parse_action(&reply).unwrap() {
                    Action::Submit => {}
                    Action::Shell(c) => exec(&mut sb, &mut history, &c),
                }
            }
        }
        let (submitted, _) = drive(&mut oracle, &task, &mut sb, &mut history, 10);
        assert!(submitted, "episode {episode}: {:#?}", commands(&history));
        assert_resolved(&task, &sb, &history);
    }
}
