//! Every generated toy task is checked for real with pytest: the planted bug makes the
//! FAIL_TO_PASS tests fail while PASS_TO_PASS pass, the gold patch (applied with
//! `git apply`) makes all pass, and the issue text states what the buggy code really does.

mod common;

use std::sync::Mutex;

use tutor_proto::OutcomeStatus;
use tutor_rollout_worker::grade::grade;
use tutor_rollout_worker::sandbox::{shell_quote, LocalSandbox};
use tutor_rollout_worker::toy::{generate_detailed, ToyTask};

fn check(t: &ToyTask) -> Result<(), String> {
    let r = &t.record;
    let id = &r.instance_id;

    // The buggy repo: F2P fail, P2P pass.
    let before = grade(r, "", common::GRADE_TIMEOUT);
    if before.status != OutcomeStatus::Unresolved {
        return Err(format!(
            "{id}: buggy repo graded {:?}\n{}",
            before.status, before.log
        ));
    }
    for f in &r.fail_to_pass {
        let s = before.test_statuses.get(f).map(String::as_str);
        if s != Some("FAILED") {
            return Err(format!(
                "{id}: F2P {f} is {s:?} on the buggy code\n{}",
                before.log
            ));
        }
    }
    for p in &r.pass_to_pass {
        let s = before.test_statuses.get(p).map(String::as_str);
        if s != Some("PASSED") {
            return Err(format!(
                "{id}: P2P {p} is {s:?} on the buggy code\n{}",
                before.log
            ));
        }
    }

    // The gold patch resolves it.
    let after = grade(r, &r.patch, common::GRADE_TIMEOUT);
    if after.status != OutcomeStatus::Resolved {
        return Err(format!(
            "{id}: gold patch graded {:?}\n{}",
            after.status, after.log
        ));
    }

    // `git apply` (not the fuzzy fallback) takes the gold patch, and the claim
    // about the buggy output is what Python prints.
    let mut sb = LocalSandbox::create(r, None).map_err(|e| e.to_string())?;
    let patch_file = sb.scratch_dir().join("gold.patch");
    std::fs::write(&patch_file, &r.patch).map_err(|e| e.to_string())?;
    let script = format!(
        "from {pkg} import {module}\ntry:\n    print(repr({call}))\nexcept Exception as e:\n    print('raises ' + type(e).__name__)\n",
        pkg = t.package,
        module = t.module,
        call = t.example_call
    );
    let out = sb.run(
        &format!(
            "git apply --check {} && python -c {}",
            shell_quote(&patch_file.display().to_string()),
            shell_quote(&script)
        ),
        common::CMD_TIMEOUT,
    );
    if out.exit_code != 0 || out.output.trim() != t.buggy {
        return Err(format!(
            "{id}: expected buggy output {:?}, got (exit {}) {:?}",
            t.buggy, out.exit_code, out.output
        ));
    }
    Ok(())
}

#[test]
fn every_toy_task_is_valid_under_pytest() {
    common::init_python();
    let tasks = generate_detailed(30, 7);
    let next = Mutex::new(0usize);
    let errors = Mutex::new(Vec::<String>::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let i = {
                    let mut n = next.lock().unwrap();
                    *n += 1;
                    *n - 1
                };
                let Some(t) = tasks.get(i) else { break };
                if let Err(e) = check(t) {
                    errors.lock().unwrap().push(e);
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap();
    assert!(
        errors.is_empty(),
        "{} invalid tasks:\n{}",
        errors.len(),
        errors.join("\n\n")
    );
}
