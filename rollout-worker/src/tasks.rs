//! SWE-bench-style task records: loading/writing JSONL, proto conversion, and a small
//! unified-diff parser/applier shared by the grader, the oracle teacher and the toy tasks.

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

/// `install_config.test_cmd` (SWE-rebench): a string, or a list of commands joined
/// with `&&`. The object may also be stored as a JSON string.
fn install_test_cmd(obj: &serde_json::Map<String, Value>) -> String {
    let cfg = match obj.get("install_config") {
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).unwrap_or(Value::Null),
        Some(v) => v.clone(),
        None => Value::Null,
    };
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
            if t.test_cmd.is_empty() {
                t.test_cmd = install_test_cmd(obj);
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
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let shown = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| TaskError::Io {
        path: shown.clone(),
        source,
    })?;
    let bad = |row: usize, message: String| TaskError::Parse {
        path: shown.clone(),
        line: row,
        message: if row == 0 {
            message
        } else {
            format!("row {row}: {message}")
        },
    };
    let reader = SerializedFileReader::new(file)
        .map_err(|e| bad(0, format!("not a readable Parquet file: {e}")))?;
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| bad(0, format!("reading rows: {e}")))?;
    let mut tasks = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (idx, row) in rows.enumerate() {
        let n = idx + 1;
        let row = row.map_err(|e| bad(n, format!("reading the row: {e}")))?;
        let task = parse_value(row.to_json_value()).map_err(|m| bad(n, m))?;
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
        }
    }
}

impl TaskRecord {
    /// Inverse of `From<&TaskRecord> for Task`. The proto has no `hints_text` or
    /// `version` (workers never need them), so those come back empty.
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
            version: String::new(),
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

/// Paths touched by a unified diff (new path, or the old path for deletions).
pub fn patch_files(patch: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    match parse_unified_diff(patch) {
        Ok(files) => {
            for f in files {
                if let Some(p) = f.path() {
                    if !out.contains(&p.to_string()) {
                        out.push(p.to_string());
                    }
                }
            }
        }
        Err(_) => {
            // Fall back to the header lines so a slightly malformed patch still names its files.
            for line in patch.lines() {
                if let Some(rest) = line.strip_prefix("+++ ") {
                    if let Some(p) = header_path(rest) {
                        if !out.contains(&p) {
                            out.push(p);
                        }
                    }
                }
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// Unified diff parsing and application.

/// One line of a hunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HunkLine {
    Context(String),
    Remove(String),
    Add(String),
}

/// One `@@ -a,b +c,d @@` hunk. `old_no_newline`/`new_no_newline` record a
/// `\ No newline at end of file` marker on the last old/new line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hunk {
    pub old_start: usize,
    pub old_len: usize,
    pub new_start: usize,
    pub new_len: usize,
    pub lines: Vec<HunkLine>,
    pub old_no_newline: bool,
    pub new_no_newline: bool,
}

impl Hunk {
    /// The lines the hunk expects to find (context and removed), without newlines.
    pub fn old_lines(&self) -> Vec<&str> {
        self.lines
            .iter()
            .filter_map(|l| match l {
                HunkLine::Context(s) | HunkLine::Remove(s) => Some(s.as_str()),
                HunkLine::Add(_) => None,
            })
            .collect()
    }

    /// The lines the hunk leaves behind (context and added), without newlines.
    pub fn new_lines(&self) -> Vec<&str> {
        self.lines
            .iter()
            .filter_map(|l| match l {
                HunkLine::Context(s) | HunkLine::Add(s) => Some(s.as_str()),
                HunkLine::Remove(_) => None,
            })
            .collect()
    }
}

/// The changes to one file. `None` paths stand for `/dev/null` (creation/deletion).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilePatch {
    pub old_path: Option<String>,
    pub new_path: Option<String>,
    pub hunks: Vec<Hunk>,
    /// Binary or otherwise unsupported content (e.g. `GIT binary patch`).
    pub binary: bool,
}

impl FilePatch {
    /// The path this patch is about: the new path, or the old one for a deletion.
    pub fn path(&self) -> Option<&str> {
        self.new_path.as_deref().or(self.old_path.as_deref())
    }
    pub fn is_creation(&self) -> bool {
        self.old_path.is_none() && self.new_path.is_some()
    }
    pub fn is_deletion(&self) -> bool {
        self.new_path.is_none() && self.old_path.is_some()
    }
}

/// Errors from the diff parser/applier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiffError {
    #[error("malformed unified diff at line {line}: {message}")]
    Malformed { line: usize, message: String },
    #[error("hunk {hunk} does not apply: its context was not found in the file")]
    HunkMismatch { hunk: usize },
}

/// Strips the `a/`/`b/` prefix (and a trailing tab + timestamp, and quotes) from a
/// `---`/`+++` header path; `None` for `/dev/null`.
fn header_path(rest: &str) -> Option<String> {
    let rest = rest.split('\t').next().unwrap_or(rest).trim_end();
    let rest = if rest.len() >= 2 && rest.starts_with('"') && rest.ends_with('"') {
        &rest[1..rest.len() - 1]
    } else {
        rest
    };
    if rest == "/dev/null" {
        return None;
    }
    let p = rest
        .strip_prefix("a/")
        .or_else(|| rest.strip_prefix("b/"))
        .unwrap_or(rest);
    Some(p.to_string())
}

fn parse_range(s: &str) -> Option<(usize, usize)> {
    let mut it = s.splitn(2, ',');
    let start = it.next()?.parse().ok()?;
    let len = match it.next() {
        Some(l) => l.parse().ok()?,
        None => 1,
    };
    Some((start, len))
}

fn parse_hunk_header(line: &str) -> Option<(usize, usize, usize, usize)> {
    // "@@ -a,b +c,d @@ optional section"
    let rest = line.strip_prefix("@@ -")?;
    let (old, rest) = rest.split_once(' ')?;
    let rest = rest.strip_prefix('+')?;
    let (new, _) = rest.split_once(' ').unwrap_or((rest, ""));
    let (a, b) = parse_range(old)?;
    let (c, d) = parse_range(new)?;
    Some((a, b, c, d))
}

/// Parses a (git or traditional) unified diff into per-file patches.
pub fn parse_unified_diff(patch: &str) -> Result<Vec<FilePatch>, DiffError> {
    let lines: Vec<&str> = patch.split('\n').collect();
    let mut files: Vec<FilePatch> = Vec::new();
    let mut i = 0;
    // Paths from a `diff --git` header, used when `---`/`+++` are absent (pure renames,
    // mode changes, binary files).
    let mut pending_git: Option<(Option<String>, Option<String>)> = None;
    while i < lines.len() {
        let line = lines[i].strip_suffix('\r').unwrap_or(lines[i]);
        if let Some(rest) = line.strip_prefix("diff --git ") {
            flush_pending(&mut pending_git, &mut files, false);
            let (a, b) = rest.split_once(" b/").unwrap_or((rest, rest));
            let a = a.strip_prefix("a/").unwrap_or(a).to_string();
            pending_git = Some((Some(a), Some(b.to_string())));
            i += 1;
        } else if line.starts_with("new file mode") {
            if let Some(p) = pending_git.as_mut() {
                p.0 = None;
            }
            i += 1;
        } else if line.starts_with("deleted file mode") {
            if let Some(p) = pending_git.as_mut() {
                p.1 = None;
            }
            i += 1;
        } else if line.starts_with("GIT binary patch") || line.starts_with("Binary files ") {
            flush_pending(&mut pending_git, &mut files, true);
            i += 1;
        } else if let Some(rest) = line.strip_prefix("--- ") {
            let next = lines.get(i + 1).copied().unwrap_or("");
            let next = next.strip_suffix('\r').unwrap_or(next);
            let Some(new_rest) = next.strip_prefix("+++ ") else {
                return Err(DiffError::Malformed {
                    line: i + 1,
                    message: "`---` header not followed by `+++`".into(),
                });
            };
            pending_git = None;
            let mut fp = FilePatch {
                old_path: header_path(rest),
                new_path: header_path(new_rest),
                hunks: Vec::new(),
                binary: false,
            };
            i += 2;
            while i < lines.len() && lines[i].starts_with("@@ ") {
                let header = lines[i].strip_suffix('\r').unwrap_or(lines[i]);
                let (a, b, c, d) =
                    parse_hunk_header(header).ok_or_else(|| DiffError::Malformed {
                        line: i + 1,
                        message: format!("bad hunk header `{header}`"),
                    })?;
                i += 1;
                let mut hunk = Hunk {
                    old_start: a,
                    old_len: b,
                    new_start: c,
                    new_len: d,
                    lines: Vec::new(),
                    old_no_newline: false,
                    new_no_newline: false,
                };
                let (mut old_left, mut new_left) = (b, d);
                while old_left > 0 || new_left > 0 {
                    let Some(raw) = lines.get(i) else {
                        return Err(DiffError::Malformed {
                            line: i + 1,
                            message: "patch ends inside a hunk".into(),
                        });
                    };
                    let raw = raw.strip_suffix('\r').unwrap_or(raw);
                    // An empty line inside a hunk is an empty context line (some tools
                    // strip the trailing space).
                    let (tag, text) = match raw.chars().next() {
                        Some(c) => (c, &raw[c.len_utf8()..]),
                        None => (' ', ""),
                    };
                    match tag {
                        ' ' if old_left > 0 && new_left > 0 => {
                            hunk.lines.push(HunkLine::Context(text.to_string()));
                            old_left -= 1;
                            new_left -= 1;
                        }
                        '-' if old_left > 0 => {
                            hunk.lines.push(HunkLine::Remove(text.to_string()));
                            old_left -= 1;
                        }
                        '+' if new_left > 0 => {
                            hunk.lines.push(HunkLine::Add(text.to_string()));
                            new_left -= 1;
                        }
                        '\\' => {}
                        _ => {
                            return Err(DiffError::Malformed {
                                line: i + 1,
                                message: "hunk is shorter than its header says".into(),
                            })
                        }
                    }
                    i += 1;
                    mark_no_newline(&lines, i, &mut hunk);
                }
                // A marker right after the last line of the hunk.
                while i < lines.len() && lines[i].starts_with('\\') {
                    i += 1;
                }
                fp.hunks.push(hunk);
            }
            files.push(fp);
        } else {
            i += 1;
        }
    }
    flush_pending(&mut pending_git, &mut files, false);
    Ok(files)
}

/// Records a `\ No newline at end of file` marker that follows the line just consumed.
fn mark_no_newline(lines: &[&str], i: usize, hunk: &mut Hunk) {
    if lines.get(i).is_some_and(|l| l.starts_with('\\')) {
        match hunk.lines.last() {
            Some(HunkLine::Remove(_)) => hunk.old_no_newline = true,
            Some(HunkLine::Add(_)) => hunk.new_no_newline = true,
            Some(HunkLine::Context(_)) => {
                hunk.old_no_newline = true;
                hunk.new_no_newline = true;
            }
            None => {}
        }
    }
}

fn flush_pending(
    pending: &mut Option<(Option<String>, Option<String>)>,
    files: &mut Vec<FilePatch>,
    binary: bool,
) {
    if let Some((old_path, new_path)) = pending.take() {
        files.push(FilePatch {
            old_path,
            new_path,
            hunks: Vec::new(),
            binary,
        });
    }
}

/// Splits text into lines without terminators, remembering whether it ended in `\n`.
pub fn split_lines(text: &str) -> (Vec<String>, bool) {
    if text.is_empty() {
        return (Vec::new(), true);
    }
    let trailing = text.ends_with('\n');
    let body = if trailing {
        &text[..text.len() - 1]
    } else {
        text
    };
    (body.split('\n').map(|s| s.to_string()).collect(), trailing)
}

/// Joins lines back, adding the final newline when `trailing`.
pub fn join_lines(lines: &[String], trailing: bool) -> String {
    let mut out = lines.join("\n");
    if trailing && !lines.is_empty() {
        out.push('\n');
    }
    out
}

/// Finds `needle` in `hay`, preferring the position closest to `hint` (like `patch`'s
/// offset search). An empty needle matches at `hint` (clamped).
pub fn find_block(hay: &[String], needle: &[&str], hint: usize) -> Option<usize> {
    if needle.is_empty() {
        return Some(hint.min(hay.len()));
    }
    if needle.len() > hay.len() {
        return None;
    }
    let last = hay.len() - needle.len();
    let matches = |at: usize| -> bool { needle.iter().enumerate().all(|(k, l)| hay[at + k] == *l) };
    let hint = hint.min(last);
    for d in 0..=last {
        if hint >= d && matches(hint - d) {
            return Some(hint - d);
        }
        if d > 0 && hint + d <= last && matches(hint + d) {
            return Some(hint + d);
        }
        if d > hint && hint + d > last {
            break;
        }
    }
    None
}

/// Applies one file's hunks to `old` content (empty for creations). Hunks are matched
/// exactly, at their stated position or the nearest offset.
pub fn apply_file_patch(old: &str, fp: &FilePatch) -> Result<String, DiffError> {
    let (mut lines, mut trailing) = split_lines(old);
    // Offset between the hunk headers' line numbers and the current content, as hunks
    // earlier in the file change its length.
    let mut delta: isize = 0;
    for (k, h) in fp.hunks.iter().enumerate() {
        let old_block = h.old_lines();
        let new_block: Vec<String> = h.new_lines().iter().map(|s| s.to_string()).collect();
        let start = if h.old_len == 0 {
            h.old_start
        } else {
            h.old_start.saturating_sub(1)
        };
        let hint = (start as isize + delta).max(0) as usize;
        let at =
            find_block(&lines, &old_block, hint).ok_or(DiffError::HunkMismatch { hunk: k + 1 })?;
        let end = at + old_block.len();
        if end == lines.len() && h.new_no_newline {
            trailing = false;
        } else if end == lines.len() && h.old_no_newline {
            trailing = true;
        }
        lines.splice(at..end, new_block.iter().cloned());
        delta += new_block.len() as isize - old_block.len() as isize;
    }
    if lines.is_empty() {
        return Ok(String::new());
    }
    Ok(join_lines(&lines, trailing))
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
        assert_eq!(
            back,
            TaskRecord {
                version: String::new(),
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

    #[test]
    fn diff_parse_and_apply_multi_hunk() {
        let old: String = (1..=30).map(|i| format!("line {i}\n")).collect();
        let mut new_lines: Vec<String> = (1..=30).map(|i| format!("line {i}")).collect();
        new_lines[2] = "LINE 3".into();
        new_lines.insert(20, "inserted".into());
        new_lines.remove(27);
        let new = join_lines(&new_lines, true);
        let diff = similar::TextDiff::from_lines(&old, &new)
            .unified_diff()
            .context_radius(3)
            .header("a/f.txt", "b/f.txt")
            .to_string();
        let files = parse_unified_diff(&diff).unwrap();
        assert_eq!(files.len(), 1);
        assert!(files[0].hunks.len() >= 2);
        assert_eq!(apply_file_patch(&old, &files[0]).unwrap(), new);
        // Applies with an offset too (two lines prepended).
        let shifted = format!("a\nb\n{old}");
        assert_eq!(
            apply_file_patch(&shifted, &files[0]).unwrap(),
            format!("a\nb\n{new}")
        );
        assert!(matches!(
            apply_file_patch("nothing\n", &files[0]),
            Err(DiffError::HunkMismatch { hunk: 1 })
        ));
    }

    #[test]
    fn diff_no_newline_and_creation() {
        let old = "a\nb";
        let new = "a\nc\n";
        let diff = similar::TextDiff::from_lines(old, new)
            .unified_diff()
            .header("a/f", "b/f")
            .to_string();
        let fp = &parse_unified_diff(&diff).unwrap()[0];
        assert_eq!(apply_file_patch(old, fp).unwrap(), new);
        let back = similar::TextDiff::from_lines(new, old)
            .unified_diff()
            .header("a/f", "b/f")
            .to_string();
        let fp = &parse_unified_diff(&back).unwrap()[0];
        assert_eq!(apply_file_patch(new, fp).unwrap(), old);

        let create = "diff --git a/n.py b/n.py\nnew file mode 100644\n--- /dev/null\n+++ b/n.py\n@@ -0,0 +1,2 @@\n+x\n+y\n";
        let fp = &parse_unified_diff(create).unwrap()[0];
        assert!(fp.is_creation());
        assert_eq!(fp.path(), Some("n.py"));
        assert_eq!(apply_file_patch("", fp).unwrap(), "x\ny\n");
        let delete = "diff --git a/n.py b/n.py\ndeleted file mode 100644\n--- a/n.py\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-x\n-y\n";
        let fp = &parse_unified_diff(delete).unwrap()[0];
        assert!(fp.is_deletion());
        assert_eq!(apply_file_patch("x\ny\n", fp).unwrap(), "");
    }

    #[test]
    fn malformed_diffs_error_instead_of_panicking() {
        assert!(parse_unified_diff("--- a/x\nnope").is_err());
        assert!(parse_unified_diff("--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n").is_err());
        assert!(parse_unified_diff("--- a/x\n+++ b/x\n@@ garbage @@\n").is_err());
        assert_eq!(parse_unified_diff("just text\n").unwrap(), vec![]);
    }
}
