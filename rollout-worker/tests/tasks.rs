//! Loading and writing task files.

use std::path::Path;

use tutor_rollout::tasks::{load_tasks, write_tasks, TaskError, TaskRecord};
use tutor_rollout::toy::generate;

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

const GOOD: &str = r#"{"instance_id":"a__b-1","repo":"a/b","base_commit":"abc","problem_statement":"p","hints_text":"","patch":"","test_patch":"","FAIL_TO_PASS":"[\"t::x\"]","PASS_TO_PASS":[],"version":"1.0","environment_setup_commit":"zzz","created_at":"2023"}"#;

#[test]
fn round_trip_through_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = generate(5, 1);
    let p = dir.path().join("tasks.jsonl");
    write_tasks(&p, &tasks).unwrap();
    assert_eq!(load_tasks(&p).unwrap(), tasks);
    // Overwrite in place; no temp files are left behind.
    write_tasks(&p, &tasks[..2]).unwrap();
    assert_eq!(load_tasks(&p).unwrap().len(), 2);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("tasks.jsonl")]);
}

#[test]
fn swe_bench_lines_with_extra_fields_load() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "t.jsonl", &format!("{GOOD}\n\n"));
    let t: Vec<TaskRecord> = load_tasks(&p).unwrap();
    assert_eq!(t[0].fail_to_pass, vec!["t::x"]);
    assert_eq!(t[0].base_commit, "abc");
    assert!(t[0].files.is_empty());
}

#[test]
fn errors_name_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let missing = GOOD.replace(r#""patch":"","#, "");
    let second = GOOD.replace("a__b-1", "a__b-2");
    let p = write(
        dir.path(),
        "tasks.jsonl",
        &format!("{GOOD}\n{second}\n{missing}\n"),
    );
    let e = load_tasks(&p).unwrap_err().to_string();
    assert!(e.ends_with("tasks.jsonl:3: missing field `patch`"), "{e}");

    let bad_type = GOOD.replace(r#""repo":"a/b""#, r#""repo":7"#);
    let p = write(dir.path(), "t2.jsonl", &format!("\n{bad_type}\n"));
    let e = load_tasks(&p).unwrap_err().to_string();
    assert!(e.contains("t2.jsonl:2: field `repo`"), "{e}");

    let p = write(
        dir.path(),
        "t3.jsonl",
        &format!("{GOOD}\n{{\"instance_id\": \"x\",\n"),
    );
    let e = load_tasks(&p).unwrap_err().to_string();
    assert!(e.contains("t3.jsonl:2: invalid JSON at column"), "{e}");
}

#[test]
fn duplicates_and_empty_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "dup.jsonl", &format!("{GOOD}\n{GOOD}\n"));
    match load_tasks(&p) {
        Err(TaskError::Duplicate {
            line: 2,
            first_line: 1,
            instance_id,
            ..
        }) => assert_eq!(instance_id, "a__b-1"),
        other => panic!("{other:?}"),
    }
    let p = write(dir.path(), "empty.jsonl", "\n  \n");
    let e = load_tasks(&p).unwrap_err();
    assert!(matches!(e, TaskError::Empty { .. }));
    assert!(e.to_string().contains("no tasks found"));
    let e = load_tasks(&dir.path().join("nope.jsonl")).unwrap_err();
    assert!(matches!(e, TaskError::Io { .. }));
    assert!(e.to_string().contains("nope.jsonl"));
}

#[test]
fn writing_into_a_missing_directory_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("missing/tasks.jsonl");
    assert!(matches!(
        write_tasks(&p, &generate(1, 1)),
        Err(TaskError::Io { .. })
    ));
    assert!(!p.exists());
}
