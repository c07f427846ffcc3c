//! Tasks: the SWE-bench-style task record and the files that hold them.
//!
//! Loading (JSONL here, Parquet in `parquet`) and writing task files, and the conversion to
//! and from the proto; unified diffs are in `diff`.

pub mod diff;
mod parquet;

pub use diff::{
    apply_file_patch, find_block, join_lines, parse_unified_diff, patch_files, split_lines,
    DiffError, FilePatch, Hunk, HunkLine,
};

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

/// One repository file carried inline by a task (toy tasks carry their whole repo).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RepoFileRecord {
    pub path: String,
    pub content: String,
}

/// A task in the SWE-bench field spelling. Unknown fields are ignored on purpose: real
/// datasets (SWE-bench, SWE-rebench, SWE-Gym) carry many extra columns.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub instance_id: String,
    pub repo: String,
    #[serde(default, deserialize_with = "string_or_null")]
    pub base_commit: String,
    pub problem_statement: String,
    #[serde(default, deserialize_with = "string_or_null")]
    pub hints_text: String,
    pub patch: String,
    pub test_patch: String,
    #[serde(rename = "FAIL_TO_PASS", deserialize_with = "list_or_json_string")]
    pub fail_to_pass: Vec<String>,
    #[serde(rename = "PASS_TO_PASS", deserialize_with = "list_or_json_string")]
    pub pass_to_pass: Vec<String>,
    #[serde(default, deserialize_with = "version_string")]
    pub version: String,
    #[serde(default, deserialize_with = "files_or_null")]
    pub files: Vec<RepoFileRecord>,
    #[serde(default, deserialize_with = "string_or_null")]
    pub image: String,
    /// The test command (SWE-rebench `install_config.test_cmd`); the grader appends the
    /// test files. Empty: `python -m pytest -rA -p no:cacheprovider`.
    #[serde(default, deserialize_with = "string_or_null")]
    pub test_cmd: String,
    /// The harness log parser that reads the test command's output (`pytest`,
    /// `django`, … or `parse_log_pytest`; SWE-rebench's `install_config.log_parser`).
    /// Empty: the repository's harness parser, or pytest.
    #[serde(default, deserialize_with = "string_or_null")]
    pub log_parser: String,
}

/// Errors from reading or writing task files. Messages name the file and line so a
/// broken dataset can be fixed without a debugger.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("{path}: {source} (check that the task file exists and is readable/writable)")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Parse {
        path: String,
        line: usize,
        message: String,
    },
    #[error("{path}:{line}: duplicate instance_id `{instance_id}` (first seen on line {first_line}); instance ids must be unique")]
    Duplicate {
        path: String,
        line: usize,
        first_line: usize,
        instance_id: String,
    },
    #[error("{path}: no tasks found; the file must hold one JSON task object per line (JSONL)")]
    Empty { path: String },
    #[error("cannot serialise task `{instance_id}`: {message}")]
    Serialize {
        instance_id: String,
        message: String,
    },
}

fn string_or_null<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

fn files_or_null<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<RepoFileRecord>, D::Error> {
    Ok(Option::<Vec<RepoFileRecord>>::deserialize(d)?.unwrap_or_default())
}

/// `version` is a string in SWE-bench ("3.0") but some exports store it as a number.
fn version_string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    use serde::de::Error;
    match Value::deserialize(d)? {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s),
        Value::Number(n) => Ok(n.to_string()),
        other => Err(D::Error::custom(format!(
            "expected a string or a number, got {}",
            value_kind(&other)
        ))),
    }
}

/// FAIL_TO_PASS / PASS_TO_PASS: a JSON list (SWE-rebench) or a JSON string holding a
/// JSON list (SWE-bench on the Hub).
fn list_or_json_string<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    use serde::de::Error;
    match Value::deserialize(d)? {
        Value::Array(items) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                other => Err(D::Error::custom(format!(
                    "list items must be strings (pytest node ids), got {}",
                    value_kind(&other)
                ))),
            })
            .collect(),
        Value::String(s) => {
            if s.trim().is_empty() {
                return Ok(Vec::new());
            }
            serde_json::from_str::<Vec<String>>(&s).map_err(|e| {
                D::Error::custom(format!(
                    "string does not contain a JSON list of strings ({e})"
                ))
            })
        }
        other => Err(D::Error::custom(format!(
            "expected a list of strings or a string containing a JSON list, got {}",
            value_kind(&other)
        ))),
    }
}

fn value_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Explains why an object failed to deserialize, naming the field: serde_json only
/// reports a column, which is useless on a 50 kB line.
fn diagnose(obj: &serde_json::Map<String, Value>) -> Option<String> {
    const REQUIRED: [&str; 7] = [
        "instance_id",
        "repo",
        "problem_statement",
        "patch",
        "test_patch",
        "FAIL_TO_PASS",
        "PASS_TO_PASS",
    ];
    for f in REQUIRED {
        if !obj.contains_key(f) {
            return Some(format!("missing field `{f}`"));
        }
    }
    for f in [
        "instance_id",
        "repo",
        "problem_statement",
        "patch",
        "test_patch",
    ] {
        if let Err(e) = String::deserialize(&obj[f]) {
            return Some(format!("field `{f}`: {e}"));
        }
    }
    for f in ["base_commit", "hints_text", "image"] {
        if let Some(v) = obj.get(f) {
            if let Err(e) = string_or_null(v) {
                return Some(format!("field `{f}`: {e}"));
            }
        }
    }
    for f in ["FAIL_TO_PASS", "PASS_TO_PASS"] {
        if let Err(e) = list_or_json_string(&obj[f]) {
            return Some(format!("field `{f}`: {e}"));
        }
    }
    if let Some(v) = obj.get("version") {
        if let Err(e) = version_string(v) {
            return Some(format!("field `version`: {e}"));
        }
    }
    if let Some(v) = obj.get("files") {
        if let Err(e) = files_or_null(v) {
            return Some(format!(
                "field `files`: {e} (expected a list of {{\"path\", \"content\"}} objects)"
            ));
        }
    }
    None
}

/// `install_config` (SWE-rebench), which may also be stored as a JSON string.
fn install_config(obj: &serde_json::Map<String, Value>) -> Value {
    match obj.get("install_config") {
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).unwrap_or(Value::Null),
        Some(v) => v.clone(),
        None => Value::Null,
    }
}

/// `install_config.test_cmd` (SWE-rebench): a string, or a list of commands joined
/// with `&&`.
fn install_test_cmd(cfg: &Value) -> String {
    match cfg.get("test_cmd") {
        Some(Value::String(s)) => s.trim().to_string(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .map(str::trim)
            .collect::<Vec<_>>()
            .join(" && "),
        _ => String::new(),
    }
}

/// Parses one JSONL line into a task, with an error message that names the field.
fn parse_line(text: &str) -> Result<TaskRecord, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| {
        // serde_json appends " at line L column C"; the line is always 1 here.
        let msg = e.to_string();
        let msg = msg.split(" at line ").next().unwrap_or(&msg).to_string();
        format!("invalid JSON at column {}: {msg}", e.column())
    })?;
    parse_value(value)
}

/// A task from one JSON object (a JSONL line or a Parquet row).
fn parse_value(value: Value) -> Result<TaskRecord, String> {
    let Value::Object(obj) = &value else {
        return Err(format!(
            "expected a JSON object (one task per line), got {}",
            value_kind(&value)
        ));
    };
    match TaskRecord::deserialize(&value) {
        Ok(mut t) => {
            if t.instance_id.trim().is_empty() {
                return Err("field `instance_id` is empty".into());
            }
            let cfg = install_config(obj);
            if t.test_cmd.is_empty() {
                t.test_cmd = install_test_cmd(&cfg);
            }
            if t.log_parser.is_empty() {
                if let Some(Value::String(p)) = cfg.get("log_parser") {
                    t.log_parser = p.trim().to_string();
                }
            }
            // The image under the names other datasets give it (SWE-rebench's
            // `docker_image`, `image_name`) when `image` is empty.
            if t.image.trim().is_empty() {
                if let Some(Value::String(image)) =
                    obj.get("docker_image").or_else(|| obj.get("image_name"))
                {
                    t.image = image.trim().to_string();
                }
            }
            Ok(t)
        }
        Err(e) => Err(diagnose(obj).unwrap_or_else(|| e.to_string())),
    }
}

/// Loads a task file: JSONL (one task object per line; blank lines are skipped), or
/// Parquet (`.parquet`, one task per row, as SWE-bench, SWE-Gym and SWE-rebench are
/// published on the Hub). Errors name the file and the line or row.
pub fn load_tasks(path: &Path) -> Result<Vec<TaskRecord>, TaskError> {
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
    {
        return load_parquet(path);
    }
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| TaskError::Io {
        path: shown.clone(),
        source,
    })?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let upto = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        TaskError::Parse {
            path: shown.clone(),
            line: upto.iter().filter(|&&b| b == b'\n').count() + 1,
            message: "file is not valid UTF-8".into(),
        }
    })?;
    let mut tasks = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (idx, line) in text.lines().enumerate() {
        let lineno = idx + 1;
        if line.trim().is_empty() {
            continue;
        }
        let task = parse_line(line).map_err(|message| TaskError::Parse {
            path: shown.clone(),
            line: lineno,
            message,
        })?;
        if let Some(&first_line) = seen.get(&task.instance_id) {
            return Err(TaskError::Duplicate {
                path: shown,
                line: lineno,
                first_line,
                instance_id: task.instance_id,
            });
        }
        seen.insert(task.instance_id.clone(), lineno);
        tasks.push(task);
    }
    if tasks.is_empty() {
        return Err(TaskError::Empty { path: shown });
    }
    Ok(tasks)
}

/// Parquet rows → tasks. Row numbers in errors are 1-based.
fn load_parquet(path: &Path) -> Result<Vec<TaskRecord>, TaskError> {
    let shown = path.display().to_string();
    let bad = |row: usize, message: String| TaskError::Parse {
        path: shown.clone(),
        line: row,
        message: if row == 0 {
            message
        } else {
            format!("row {row}: {message}")
        },
    };
    let rows = self::parquet::rows(path).map_err(|e| match e {
        self::parquet::OpenError::Io(source) => TaskError::Io {
            path: shown.clone(),
            source,
        },
        self::parquet::OpenError::Format(message) => bad(0, message),
    })?;
    let mut tasks = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (idx, row) in rows.enumerate() {
        let n = idx + 1;
        let task = parse_value(row.map_err(|m| bad(n, m))?).map_err(|m| bad(n, m))?;
        if let Some(&first_line) = seen.get(&task.instance_id) {
            return Err(TaskError::Duplicate {
                path: shown,
                line: n,
                first_line,
                instance_id: task.instance_id,
            });
        }
        seen.insert(task.instance_id.clone(), n);
        tasks.push(task);
    }
    if tasks.is_empty() {
        return Err(TaskError::Empty { path: shown });
    }
    Ok(tasks)
}

/// Writes tasks as JSONL atomically: a temp file in the same directory is renamed over
/// `path`, so readers never see a partial file.
pub fn write_tasks(path: &Path, tasks: &[TaskRecord]) -> Result<(), TaskError> {
    let shown = path.display().to_string();
    let io = |source| TaskError::Io {
        path: shown.clone(),
        source,
    };
    let dir: PathBuf = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut tmp = tempfile::Builder::new()
        .prefix(".tasks-")
        .suffix(".tmp")
        .tempfile_in(&dir)
        .map_err(io)?;
    {
        let mut w = std::io::BufWriter::new(tmp.as_file_mut());
        for t in tasks {
            let line = serde_json::to_string(t).map_err(|e| TaskError::Serialize {
                instance_id: t.instance_id.clone(),
                message: e.to_string(),
            })?;
            w.write_all(line.as_bytes()).map_err(io)?;
            w.write_all(b"\n").map_err(io)?;
        }
        w.flush().map_err(io)?;
    }
    tmp.as_file().sync_all().map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    Ok(())
}

impl From<&TaskRecord> for tutor_proto::Task {
    fn from(t: &TaskRecord) -> Self {
        tutor_proto::Task {
            instance_id: t.instance_id.clone(),
            repo: t.repo.clone(),
            problem_statement: t.problem_statement.clone(),
            files: t
                .files
                .iter()
                .map(|f| tutor_proto::RepoFile {
                    path: f.path.clone(),
                    content: f.content.clone(),
                })
                .collect(),
            patch: t.patch.clone(),
            test_patch: t.test_patch.clone(),
            fail_to_pass: t.fail_to_pass.clone(),
            pass_to_pass: t.pass_to_pass.clone(),
            base_commit: t.base_commit.clone(),
            image: t.image.clone(),
            test_cmd: t.test_cmd.clone(),
            version: t.version.clone(),
            log_parser: t.log_parser.clone(),
        }
    }
}

impl TaskRecord {
    /// Inverse of `From<&TaskRecord> for Task`. The proto has no `hints_text` (workers
    /// never need it), so it comes back empty.
    pub fn from_proto(t: &tutor_proto::Task) -> Self {
        TaskRecord {
            instance_id: t.instance_id.clone(),
            repo: t.repo.clone(),
            base_commit: t.base_commit.clone(),
            problem_statement: t.problem_statement.clone(),
            hints_text: String::new(),
            patch: t.patch.clone(),
            test_patch: t.test_patch.clone(),
            fail_to_pass: t.fail_to_pass.clone(),
            pass_to_pass: t.pass_to_pass.clone(),
            version: t.version.clone(),
            files: t
                .files
                .iter()
                .map(|f| RepoFileRecord {
                    path: f.path.clone(),
                    content: f.content.clone(),
                })
                .collect(),
            image: t.image.clone(),
            test_cmd: t.test_cmd.clone(),
            log_parser: t.log_parser.clone(),
        }
    }

    /// Files the test patch touches, in patch order, deduplicated. These are the files the
    /// grader resets and runs.
    pub fn test_files(&self) -> Vec<String> {
        patch_files(&self.test_patch)
    }

    /// Files the gold patch touches.
    pub fn gold_files(&self) -> Vec<String> {
        patch_files(&self.patch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> TaskRecord {
        TaskRecord {
            instance_id: "toy__a-1".into(),
            repo: "toy/a".into(),
            base_commit: String::new(),
            problem_statement: "it breaks".into(),
            hints_text: String::new(),
            patch: "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n".into(),
            test_patch: "diff --git a/tests/t.py b/tests/t.py\n--- a/tests/t.py\n+++ b/tests/t.py\n@@ -1 +1,2 @@\n a\n++++ b/not_a_file\n".into(),
            fail_to_pass: vec!["tests/t.py::test_x".into()],
            pass_to_pass: vec![],
            version: "1".into(),
            files: vec![RepoFileRecord {
                path: "a.py".into(),
                content: "x = 1\n".into(),
            }],
            image: String::new(),
            test_cmd: String::new(),
            log_parser: String::new(),
        }
    }

    #[test]
    fn test_files_ignore_hunk_content_that_looks_like_a_header() {
        assert_eq!(sample().test_files(), vec!["tests/t.py".to_string()]);
        assert_eq!(sample().gold_files(), vec!["a.py".to_string()]);
    }

    #[test]
    fn proto_round_trip_keeps_what_the_proto_carries() {
        let t = sample();
        let p: tutor_proto::Task = (&t).into();
        let back = TaskRecord::from_proto(&p);
        // Everything but hints_text, which workers never need (version and log_parser
        // pick the grading spec).
        assert_eq!(
            back,
            TaskRecord {
                hints_text: String::new(),
                ..t
            }
        );
    }

    #[test]
    fn swe_bench_string_lists_and_numeric_version_are_accepted() {
        let line = r#"{"instance_id":"x__y-1","repo":"x/y","problem_statement":"p","patch":"","test_patch":"","FAIL_TO_PASS":"[\"a::b\"]","PASS_TO_PASS":"[]","version":3.1,"hints_text":null,"created_at":"2020"}"#;
        let t = parse_line(line).unwrap();
        assert_eq!(t.fail_to_pass, vec!["a::b"]);
        assert!(t.pass_to_pass.is_empty());
        assert_eq!(t.version, "3.1");
        assert_eq!(t.hints_text, "");
    }

    #[test]
    fn field_errors_name_the_field() {
        let line = r#"{"instance_id":"x","repo":"x/y","problem_statement":"p","patch":"","test_patch":"","FAIL_TO_PASS":3,"PASS_TO_PASS":[]}"#;
        let e = parse_line(line).unwrap_err();
        assert!(e.contains("`FAIL_TO_PASS`"), "{e}");
        let line = r#"{"instance_id":"x","repo":"x/y","problem_statement":"p","patch":"","test_patch":"","FAIL_TO_PASS":"not json","PASS_TO_PASS":[]}"#;
        assert!(parse_line(line).unwrap_err().contains("`FAIL_TO_PASS`"));
        let e = parse_line("{\"instance_id\": ").unwrap_err();
        assert!(e.starts_with("invalid JSON at column"), "{e}");
        assert!(parse_line("[1]").unwrap_err().contains("JSON object"));
    }
}
