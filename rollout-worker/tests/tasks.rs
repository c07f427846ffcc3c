//! Loading and writing task files.

mod common;

use std::path::Path;

use tutor_rollout_worker::tasks::{load_tasks, write_tasks, TaskError, TaskRecord};
use tutor_rollout_worker::toy::generate;

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

/// Writes `rows` (a Python literal) as Parquet with pyarrow, as the Hub publishes
/// SWE-bench, SWE-Gym and SWE-rebench.
fn parquet(dir: &Path, name: &str, rows: &str, compression: &str) -> std::path::PathBuf {
    let out = dir.join(name);
    let script = format!(
        "import pyarrow as pa, pyarrow.parquet as pq\nrows = {rows}\npq.write_table(pa.Table.from_pylist(rows), {:?}, compression={compression:?})\n",
        out.display().to_string()
    );
    let o = std::process::Command::new(common::project_python())
        .args(["-c", &script])
        .output()
        .expect("python");
    assert!(
        o.status.success(),
        "pyarrow (requirements-dev.txt) wrote no Parquet: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

#[test]
fn swe_bench_parquet_in_both_spellings_loads() {
    let dir = tempfile::tempdir().unwrap();
    // SWE-bench: FAIL_TO_PASS as a JSON string, version a string, extra columns.
    // SWE-rebench: lists, install_config with test_cmd and log_parser, version a
    // number, the image as docker_image.
    let swe_bench = r#"[{"repo": "astropy/astropy", "instance_id": "astropy__astropy-12907",
   "base_commit": "d16bfe05", "patch": "diff --git a/x b/x\n", "test_patch": "diff --git a/t b/t\n",
   "problem_statement": "Bug é", "hints_text": "", "created_at": "2022-03-03", "version": "4.3",
   "FAIL_TO_PASS": "[\"t.py::test_a\", \"t.py::test_b\"]", "PASS_TO_PASS": "[]",
   "environment_setup_commit": "298ccb47"}]"#;
    let swe_rebench = r#"[{"repo": "o/r", "instance_id": "o__r-1", "base_commit": "abc", "patch": "p",
   "test_patch": "tp", "problem_statement": "s", "hints_text": None, "version": 1.5,
   "FAIL_TO_PASS": ["a::b"], "PASS_TO_PASS": ["c::d", "e::f"],
   "install_config": {"test_cmd": "pytest -rA -x", "python": "3.9", "log_parser": "parse_log_pytest"},
   "docker_image": "swerebench/sweb.eval.x86_64.o_1776_r-1"}]"#;
    // One file per spelling (a Parquet column has one type), two compressions.
    for (i, (rows, compression)) in [(swe_bench, "snappy"), (swe_rebench, "zstd")]
        .into_iter()
        .enumerate()
    {
        let p = parquet(dir.path(), &format!("{i}.parquet"), rows, compression);
        let tasks = load_tasks(&p).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(tasks.len(), 1);
        let t = &tasks[0];
        if i == 0 {
            assert_eq!(t.instance_id, "astropy__astropy-12907");
            assert_eq!(t.fail_to_pass, vec!["t.py::test_a", "t.py::test_b"]);
            assert!(t.pass_to_pass.is_empty());
            assert_eq!(t.version, "4.3");
            assert_eq!(t.problem_statement, "Bug é");
            assert_eq!(t.test_cmd, "");
        } else {
            assert_eq!(t.fail_to_pass, vec!["a::b"]);
            assert_eq!(t.pass_to_pass, vec!["c::d", "e::f"]);
            assert_eq!(t.version, "1.5");
            assert_eq!(t.hints_text, "");
            assert_eq!(t.test_cmd, "pytest -rA -x");
            assert_eq!(t.log_parser, "parse_log_pytest");
            assert_eq!(t.image, "swerebench/sweb.eval.x86_64.o_1776_r-1");
        }
    }
}

#[test]
fn bad_parquet_rows_name_file_row_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let p = parquet(
        dir.path(),
        "bad.parquet",
        r#"[{"instance_id": "a", "repo": "r", "problem_statement": "s", "patch": "", "test_patch": "", "FAIL_TO_PASS": "[]", "PASS_TO_PASS": "[]"},
            {"instance_id": "b", "repo": "r", "problem_statement": "s", "patch": "", "test_patch": "", "FAIL_TO_PASS": "not json", "PASS_TO_PASS": "[]"}]"#,
        "snappy",
    );
    let e = load_tasks(&p).unwrap_err().to_string();
    assert!(
        e.contains("bad.parquet") && e.contains("row 2") && e.contains("FAIL_TO_PASS"),
        "{e}"
    );
    let junk = write(dir.path(), "junk.parquet", "not parquet at all");
    let e = load_tasks(&junk).unwrap_err().to_string();
    assert!(e.contains("junk.parquet") && e.contains("Parquet"), "{e}");
}
