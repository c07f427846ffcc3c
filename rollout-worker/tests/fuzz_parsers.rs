//! Property tests for the parsers that untrusted bytes reach in a rollout worker: task
//! files (JSONL and Parquet), unified diffs, the model's replies (actions), command output
//! framing (observations, the edit rewriting), and pytest logs (grading).
//!
//! Each property says what a user relies on: no panic and no hang on arbitrary input, an
//! error that names the problem, and a round trip or an invariant where there is one.
//! Case counts are small so the file runs in seconds in a debug build; regressions are
//! not persisted to files: a real one found here is kept as a plain unit test.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;
use proptest::test_runner::{FileFailurePersistence, RngSeed};

use tutor_proto::OutcomeStatus;
use tutor_rollout_worker::action::{parse_action, Action, FormatError};
use tutor_rollout_worker::grade::{decide, parse_pytest_log};
use tutor_rollout_worker::observation::{format_observation, truncate_head_tail};
use tutor_rollout_worker::tasks::{
    apply_file_patch, load_tasks, parse_unified_diff, patch_files, write_tasks, DiffError,
    RepoFileRecord, TaskError, TaskRecord,
};
use tutor_rollout_worker::tools::prepare_command;

/// `cases` per property, from a fixed seed so every run (CI's too) tries the same
/// inputs and a failure reproduces; `PROPTEST_CASES` and `PROPTEST_RNG_SEED` override
/// both for a longer hunt.
fn config(cases: u32) -> ProptestConfig {
    let defaults = ProptestConfig::default();
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(cases),
        rng_seed: match std::env::var_os("PROPTEST_RNG_SEED") {
            Some(_) => defaults.rng_seed,
            None => RngSeed::Fixed(0x74_7574_6f72),
        },
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..defaults
    }
}

/// Arbitrary bytes turned into a string as a worker turns process output or a model
/// reply into one (lossy UTF-8).
fn lossy_text(max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(any::<u8>(), 0..max)
        .prop_map(|b| String::from_utf8_lossy(&b).into_owned())
}

/// Text built from the pieces a parser cares about, so that random input reaches its
/// branches instead of being rejected at the first byte.
fn structured_text(atoms: &'static [&'static str], max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            4 => proptest::sample::select(atoms).prop_map(str::to_string),
            1 => any::<char>().prop_map(|c| c.to_string()),
        ],
        0..max,
    )
    .prop_map(|v| v.concat())
}

// ---------------------------------------------------------------------------------------
// 1. Task records: JSONL and Parquet.
// ---------------------------------------------------------------------------------------

fn temp_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Any text without a line break (instance ids must be non-blank).
fn field_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => any::<String>(),
        1 => Just(String::new()),
        1 => "[\\[\\]{}\":,\\\\ nul\u{0}\n\r\t🦀é]{0,12}",
    ]
}

fn task_record() -> impl Strategy<Value = TaskRecord> {
    (
        (
            "[a-zA-Z0-9_.-]{1,12}",
            field_text(),
            field_text(),
            field_text(),
            field_text(),
            field_text(),
            field_text(),
        ),
        (
            proptest::collection::vec(field_text(), 0..3),
            proptest::collection::vec(field_text(), 0..3),
            field_text(),
            proptest::collection::vec((field_text(), field_text()), 0..3),
            field_text(),
            field_text(),
        ),
    )
        .prop_map(
            |(
                (id, repo, base_commit, problem_statement, hints_text, patch, test_patch),
                (fail_to_pass, pass_to_pass, version, files, image, test_cmd),
            )| TaskRecord {
                instance_id: id,
                repo,
                base_commit,
                problem_statement,
                hints_text,
                patch,
                test_patch,
                fail_to_pass,
                pass_to_pass,
                version,
                files: files
                    .into_iter()
                    .map(|(path, content)| RepoFileRecord { path, content })
                    .collect(),
                image,
                test_cmd,
                log_parser: String::new(),
            },
        )
}

/// Checks what every task-file error must do: name the file, and point at a line that
/// exists (or the line just after the last one).
fn check_task_error(e: &TaskError, path: &Path, lines: usize) {
    let shown = e.to_string();
    assert!(
        shown.contains(&path.display().to_string()),
        "error does not name the file: {shown}"
    );
    match e {
        TaskError::Parse { line, message, .. } => {
            assert!(!message.trim().is_empty(), "empty message: {shown}");
            assert!(*line <= lines + 1, "line {line} of {lines}: {shown}");
        }
        TaskError::Duplicate {
            line, first_line, ..
        } => assert!(first_line < line && *line <= lines, "{shown}"),
        TaskError::Empty { .. } | TaskError::Io { .. } => {}
        TaskError::Serialize { .. } => panic!("loading cannot fail to serialise: {shown}"),
    }
}

const JSONL_ATOMS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"",
    "\n",
    "\r\n",
    " ",
    "null",
    "true",
    "1e999",
    "-0",
    "\"instance_id\"",
    "\"repo\"",
    "\"patch\"",
    "\"test_patch\"",
    "\"problem_statement\"",
    "\"FAIL_TO_PASS\"",
    "\"PASS_TO_PASS\"",
    "\"files\"",
    "\"version\"",
    "\"install_config\"",
    "\"test_cmd\"",
    "\"[\\\"a::b\\\"]\"",
    "\"x\"",
    "\\u0000",
    "\\ud800",
    "\u{0}",
    "\u{feff}",
];

proptest! {
    #![proptest_config(config(256))]

    /// Arbitrary bytes as a JSONL task file: an error naming the file (and a real line),
    /// or tasks; never a panic.
    #[test]
    fn jsonl_arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let dir = tempfile::tempdir().unwrap();
        let p = temp_file(dir.path(), "tasks.jsonl", &bytes);
        let lines = bytes.split(|&b| b == b'\n').count();
        match load_tasks(&p) {
            Ok(tasks) => prop_assert!(!tasks.is_empty()),
            Err(e) => check_task_error(&e, &p, lines),
        }
    }

    /// JSON-shaped noise (the field names, nesting, escapes, huge numbers).
    #[test]
    fn jsonl_structured_noise_never_panics(text in structured_text(JSONL_ATOMS, 64)) {
        let dir = tempfile::tempdir().unwrap();
        let p = temp_file(dir.path(), "tasks.jsonl", text.as_bytes());
        let lines = text.split('\n').count();
        match load_tasks(&p) {
            Ok(tasks) => prop_assert!(tasks.iter().all(|t| !t.instance_id.trim().is_empty())),
            Err(e) => check_task_error(&e, &p, lines),
        }
    }

    /// What `write_tasks` writes, `load_tasks` reads back unchanged, whatever the strings
    /// hold (quotes, NULs, line breaks, lone surrogates' replacements, emoji).
    #[test]
    fn jsonl_round_trip(tasks in proptest::collection::vec(task_record(), 1..4)) {
        let mut tasks = tasks;
        for (i, t) in tasks.iter_mut().enumerate() {
            t.instance_id = format!("{}-{i}", t.instance_id);
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tasks.jsonl");
        write_tasks(&p, &tasks).unwrap();
        prop_assert_eq!(load_tasks(&p).unwrap(), tasks);
    }

    /// A valid line with one field removed or given the wrong type: the error names that
    /// field, the file and the line.
    #[test]
    fn jsonl_field_errors_name_the_field(
        task in task_record(),
        field in proptest::sample::select(&[
            "instance_id", "repo", "problem_statement", "patch", "test_patch",
            "FAIL_TO_PASS", "PASS_TO_PASS",
        ][..]),
        remove in any::<bool>(),
        bad in prop_oneof![
            Just(serde_json::json!(7)),
            Just(serde_json::json!({"a": 1})),
            Just(serde_json::json!(true)),
            Just(serde_json::json!([1, 2])),
        ],
        blank_lines in 0usize..3,
    ) {
        let mut v = serde_json::to_value(&task).unwrap();
        let obj = v.as_object_mut().unwrap();
        // A list field given a list (`[1, 2]`) is still wrong: its items are not strings.
        if remove {
            obj.remove(field);
        } else {
            obj.insert(field.to_string(), bad);
        }
        let text = format!("{}{}\n", "\n".repeat(blank_lines), v);
        let dir = tempfile::tempdir().unwrap();
        let p = temp_file(dir.path(), "t.jsonl", text.as_bytes());
        let e = load_tasks(&p).unwrap_err();
        let shown = e.to_string();
        prop_assert!(
            shown.contains(&format!("t.jsonl:{}:", blank_lines + 1)),
            "no file:line in {}", shown
        );
        prop_assert!(shown.contains(&format!("`{field}`")), "field not named: {}", shown);
    }
}

/// A small Parquet task file as the Hub publishes them (pyarrow, snappy, dictionary
/// pages, statistics), written once.
fn parquet_seed() -> &'static [u8] {
    static SEED: OnceLock<Vec<u8>> = OnceLock::new();
    SEED.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("seed.parquet");
        let script = format!(
            "import pyarrow as pa, pyarrow.parquet as pq\n\
             rows = [dict(instance_id=f'a__b-{{i}}', repo='a/b', problem_statement='p' * i, \
             patch='', test_patch='', FAIL_TO_PASS=['t::x'], PASS_TO_PASS='[]', version=1.5, \
             hints_text=None) for i in range(3)]\n\
             pq.write_table(pa.Table.from_pylist(rows), {:?}, compression='snappy')\n",
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
        let bytes = std::fs::read(&out).unwrap();
        assert_eq!(load_tasks(&out).unwrap().len(), 3, "the seed file loads");
        bytes
    })
}

/// A corruption of a valid file: byte flips, a cut, and bytes spliced in, anywhere
/// (the footer and its length are the interesting part).
#[derive(Debug, Clone)]
enum Mutation {
    Set(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    SetLe32FromEnd(usize, u32),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        // The footer length (4 bytes before the closing magic) and other length fields.
        2 => (0usize..64, prop_oneof![Just(0u32), Just(u32::MAX), Just(0x7fff_ffff), any::<u32>()])
            .prop_map(|(i, v)| Mutation::SetLe32FromEnd(i, v)),
    ]
}

fn mutate(bytes: &mut Vec<u8>, m: &Mutation) {
    let n = bytes.len();
    match m {
        Mutation::Set(i, b) if n > 0 => bytes[i % n] = *b,
        Mutation::Truncate(i) => bytes.truncate(i % (n + 1)),
        Mutation::Insert(i, b) => {
            let at = i % (n + 1);
            bytes.splice(at..at, b.iter().copied());
        }
        Mutation::SetLe32FromEnd(back, v) if n >= back + 4 => {
            let at = n - back - 4;
            bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        _ => {}
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Arbitrary bytes named `.parquet`: an error naming the file, never a panic.
    #[test]
    fn parquet_arbitrary_bytes_give_an_error(
        body in proptest::collection::vec(any::<u8>(), 0..256),
        magic in any::<(bool, bool)>(),
        footer_len in any::<u32>(),
    ) {
        let mut bytes = Vec::new();
        if magic.0 {
            bytes.extend_from_slice(b"PAR1");
        }
        bytes.extend_from_slice(&body);
        if magic.1 {
            bytes.extend_from_slice(&footer_len.to_le_bytes());
            bytes.extend_from_slice(b"PAR1");
        }
        let dir = tempfile::tempdir().unwrap();
        let p = temp_file(dir.path(), "junk.parquet", &bytes);
        match load_tasks(&p) {
            Ok(tasks) => prop_assert!(!tasks.is_empty()),
            Err(e) => check_task_error(&e, &p, usize::MAX - 1),
        }
    }

    /// A real Parquet task file, corrupted: loads, or fails with an error naming the
    /// file; never a panic and never an abort on a huge allocation.
    #[test]
    fn parquet_corrupted_file_gives_an_error(
        mutations in proptest::collection::vec(mutation(), 1..4),
    ) {
        let mut bytes = parquet_seed().to_vec();
        for m in &mutations {
            mutate(&mut bytes, m);
        }
        let dir = tempfile::tempdir().unwrap();
        let p = temp_file(dir.path(), "tasks.parquet", &bytes);
        match load_tasks(&p) {
            Ok(tasks) => prop_assert!(!tasks.is_empty()),
            Err(e) => check_task_error(&e, &p, usize::MAX - 1),
        }
    }
}

/// Regression: one byte changed in the footer of a valid file (a column chunk's offset
/// made negative) made the `parquet` crate panic in `ColumnChunkMetaData::byte_range`
/// instead of returning an error. Every byte of the footer's column metadata (before
/// pyarrow's `ARROW:schema` blob), set to a varint continuation byte, must give an error
/// naming the file (or still load).
#[test]
fn parquet_footer_corruptions_give_errors() {
    let seed = parquet_seed();
    let n = seed.len();
    let footer_len = u32::from_le_bytes(seed[n - 8..n - 4].try_into().unwrap()) as usize;
    let footer = n - 8 - footer_len..n - 8;
    let schema_blob = seed[footer.clone()]
        .windows(12)
        .position(|w| w == b"ARROW:schema")
        .map_or(footer.end, |k| footer.start + k);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tasks.parquet");
    for at in footer.start..schema_blob {
        let mut bytes = seed.to_vec();
        bytes[at] = 0x95;
        std::fs::write(&p, &bytes).unwrap();
        match load_tasks(&p) {
            Ok(tasks) => assert!(!tasks.is_empty()),
            Err(e) => check_task_error(&e, &p, usize::MAX - 1),
        }
    }
}

// ---------------------------------------------------------------------------------------
// 2. Unified diffs.
// ---------------------------------------------------------------------------------------

const DIFF_ATOMS: &[&str] = &[
    "diff --git a/x b/x\n",
    "diff --git a/x\n",
    "--- a/x\n",
    "+++ b/x\n",
    "--- /dev/null\n",
    "+++ /dev/null\n",
    "--- \"a/q x\"\t2020-01-01\n",
    "new file mode 100644\n",
    "deleted file mode 100644\n",
    "GIT binary patch\n",
    "Binary files a/x and b/x differ\n",
    "@@ -1 +1 @@\n",
    "@@ -1,2 +1,3 @@\n",
    "@@ -0,0 +1 @@\n",
    "@@ -18446744073709551615,1 +1 @@\n",
    "@@ -1,18446744073709551615 +1 @@\n",
    "@@ -99999999999999999999 +1 @@\n",
    "@@ -1,3 +0,0 @@ section\n",
    "@@ garbage\n",
    " ctx\n",
    "-old\n",
    "+new\n",
    "\\ No newline at end of file\n",
    "\n",
    "\r\n",
    "\r",
    "é",
    "🦀\n",
    "-",
    "+",
    " ",
];

/// Lines for random file contents: few distinct ones, so diffs have context and
/// repeated blocks (where the applier's offset search matters), and some that look like
/// diff syntax.
const LINE_ATOMS: &[&str] = &[
    "a",
    "b",
    "c",
    "",
    " ",
    "def f():",
    "    return 1",
    "-x",
    "+y",
    "--- a/x",
    "+++ b/x",
    "@@ -1 +1 @@",
    "\\ No newline at end of file",
    "diff --git a/x b/x",
    "é🦀",
    "\t",
    "trailing space ",
];

fn file_text(crlf: bool) -> impl Strategy<Value = String> {
    (
        proptest::collection::vec(proptest::sample::select(LINE_ATOMS), 0..24),
        any::<bool>(),
    )
        .prop_map(move |(lines, trailing)| {
            let eol = if crlf { "\r\n" } else { "\n" };
            let mut s = lines.join(eol);
            if trailing && !lines.is_empty() {
                s.push_str(eol);
            }
            s
        })
}

/// A unified diff of `old` → `new` as `git diff` writes it (`-`/`+`/` ` lines holding
/// each line's own bytes, CR included; `\\ No newline at end of file` markers; hunks
/// merged when their context overlaps). Written here from an LCS, not with `similar`:
/// similar 2.7 sometimes emits hunk headers whose ranges disagree with the hunk's lines
/// (fixed upstream in 3.1, "Compact emitting inconsistent DiffOp cursor positions").
fn unified(old: &str, new: &str, path: &str, radius: usize) -> String {
    let a: Vec<&str> = old.split_inclusive('\n').collect();
    let b: Vec<&str> = new.split_inclusive('\n').collect();
    let (n, m) = (a.len(), b.len());
    let mut lcs = vec![vec![0usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    // (tag, old index, new index) for each line of the edit script.
    let mut ops: Vec<(char, usize, usize)> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < n || j < m {
        if i < n && j < m && a[i] == b[j] {
            ops.push((' ', i, j));
            i += 1;
            j += 1;
        } else if i < n && (j == m || lcs[i + 1][j] >= lcs[i][j + 1]) {
            ops.push(('-', i, j));
            i += 1;
        } else {
            ops.push(('+', i, j));
            j += 1;
        }
    }
    let changed: Vec<usize> = (0..ops.len()).filter(|&k| ops[k].0 != ' ').collect();
    if changed.is_empty() {
        return String::new();
    }
    let range = |start: usize, len: usize| match len {
        0 => format!("{start},0"),
        1 => format!("{}", start + 1),
        _ => format!("{},{len}", start + 1),
    };
    let mut out = format!("--- a/{path}\n+++ b/{path}\n");
    let mut k = 0;
    while k < changed.len() {
        let first = changed[k];
        while k + 1 < changed.len() && changed[k + 1] - changed[k] <= 2 * radius + 1 {
            k += 1;
        }
        let hunk = &ops[first.saturating_sub(radius)..(changed[k] + radius + 1).min(ops.len())];
        k += 1;
        let old_len = hunk.iter().filter(|o| o.0 != '+').count();
        let new_len = hunk.iter().filter(|o| o.0 != '-').count();
        out.push_str(&format!(
            "@@ -{} +{} @@\n",
            range(hunk[0].1, old_len),
            range(hunk[0].2, new_len)
        ));
        for &(tag, i, j) in hunk {
            let line = if tag == '+' { b[j] } else { a[i] };
            out.push(tag);
            out.push_str(line);
            if !line.ends_with('\n') {
                out.push_str("\n\\ No newline at end of file\n");
            }
        }
    }
    out
}

fn check_diff_error(e: &DiffError, text: &str) {
    if let DiffError::Malformed { line, message } = e {
        assert!(!message.is_empty());
        assert!(
            (1..=text.split('\n').count() + 1).contains(line),
            "line {line} is outside the patch: {e}"
        );
    }
    assert!(!e.to_string().is_empty());
}

proptest! {
    #![proptest_config(config(256))]

    /// Arbitrary text as a patch: parsing, listing its files and applying each file patch
    /// to arbitrary contents never panic; a parse error points into the patch.
    #[test]
    fn diff_arbitrary_text_never_panics(patch in lossy_text(512), old in lossy_text(128)) {
        let _ = patch_files(&patch);
        match parse_unified_diff(&patch) {
            Ok(files) => {
                for fp in &files {
                    let _ = apply_file_patch(&old, fp);
                }
            }
            Err(e) => check_diff_error(&e, &patch),
        }
    }

    /// Diff-shaped noise: headers, hunk headers with absurd numbers, markers, CRs.
    #[test]
    fn diff_structured_noise_never_panics(
        patch in structured_text(DIFF_ATOMS, 48),
        old in file_text(false),
    ) {
        let files = patch_files(&patch);
        prop_assert!(files.iter().all(|f| !f.contains('\n')));
        match parse_unified_diff(&patch) {
            Ok(parsed) => {
                for fp in &parsed {
                    if let Ok(new) = apply_file_patch(&old, fp) {
                        // What was applied can be applied in reverse... at least it is text
                        // made of the old lines and the hunks' lines.
                        let _ = new;
                    }
                }
            }
            Err(e) => check_diff_error(&e, &patch),
        }
    }

    /// A diff of two texts (as `git diff`/`similar` writes it, any context radius) applies
    /// to the old text and gives the new one, exactly: trailing newlines included.
    #[test]
    fn diff_round_trip(
        old in file_text(false),
        new in file_text(false),
        radius in 0usize..4,
    ) {
        let patch = unified(&old, &new, "src/m.py", radius);
        let files = parse_unified_diff(&patch).unwrap();
        if old == new {
            prop_assert!(files.is_empty());
        } else {
            prop_assert_eq!(files.len(), 1);
            prop_assert_eq!(files[0].path(), Some("src/m.py"));
            prop_assert_eq!(apply_file_patch(&old, &files[0]).unwrap(), new);
            prop_assert_eq!(patch_files(&patch), vec!["src/m.py".to_string()]);
        }
    }

    /// The same for files with Windows line endings: git keeps the CR of each line in
    /// the hunk (`-x\r`), and applying must give back the CRLF text.
    #[test]
    fn diff_round_trip_crlf(old in file_text(true), new in file_text(true)) {
        let patch = unified(&old, &new, "w.txt", 3);
        let files = parse_unified_diff(&patch).unwrap();
        if old != new {
            prop_assert_eq!(apply_file_patch(&old, &files[0]).unwrap(), new);
        }
    }

    /// A patch converted to CRLF as a whole (as a Windows editor saves it) still applies
    /// to the LF files it was made from.
    #[test]
    fn diff_crlf_converted_patch_applies(old in file_text(false), new in file_text(false)) {
        prop_assume!(old != new);
        let patch = unified(&old, &new, "x.py", 3).replace('\n', "\r\n");
        let files = parse_unified_diff(&patch).unwrap();
        prop_assert_eq!(files[0].path(), Some("x.py"));
        prop_assert_eq!(apply_file_patch(&old, &files[0]).unwrap(), new);
    }

    /// Several files in one patch: each applies to its own old text.
    #[test]
    fn diff_round_trip_many_files(
        pairs in proptest::collection::vec((file_text(false), file_text(false)), 1..4),
    ) {
        let mut patch = String::new();
        let mut changed = Vec::new();
        for (i, (old, new)) in pairs.iter().enumerate() {
            if old != new {
                let path = format!("d{i}/f.txt");
                patch.push_str(&format!("diff --git a/{path} b/{path}\n"));
                patch.push_str(&unified(old, new, &path, 3));
                changed.push((path, old, new));
            }
        }
        let files = parse_unified_diff(&patch).unwrap();
        prop_assert_eq!(files.len(), changed.len());
        for (fp, (path, old, new)) in files.iter().zip(&changed) {
            prop_assert_eq!(fp.path(), Some(path.as_str()));
            prop_assert_eq!(&apply_file_patch(old, fp).unwrap(), *new);
        }
    }

    /// Applied to the file with lines added above and below it (an offset, as on a file
    /// the student edited): with no repeated lines, each hunk is found at its one place and
    /// the result is exact.
    #[test]
    fn diff_applies_with_an_offset(
        n in 1usize..30,
        edits in proptest::collection::vec((0u8..4, 0u8..3), 30),
        above in 0usize..5,
        below in 0usize..5,
    ) {
        let old: Vec<String> = (0..n).map(|i| format!("line {i}")).collect();
        let mut new = Vec::new();
        for (i, line) in old.iter().enumerate() {
            let (op, extra) = edits[i];
            match op {
                0 => {}
                1 => new.push(format!("changed {i}")),
                _ => new.push(line.clone()),
            }
            for k in 0..extra {
                if op == 3 {
                    new.push(format!("inserted {i}.{k}"));
                }
            }
        }
        let text = |lines: &[String]| lines.iter().map(|l| format!("{l}\n")).collect::<String>();
        let (old_text, new_text) = (text(&old), text(&new));
        prop_assume!(old_text != new_text);
        let patch = unified(&old_text, &new_text, "f", 3);
        let fp = &parse_unified_diff(&patch).unwrap()[0];
        let head: String = (0..above).map(|k| format!("above {k}\n")).collect();
        let tail: String = (0..below).map(|k| format!("below {k}\n")).collect();
        prop_assert_eq!(
            apply_file_patch(&format!("{head}{old_text}{tail}"), fp).unwrap(),
            format!("{head}{new_text}{tail}")
        );
    }
}

// ---------------------------------------------------------------------------------------
// 3. Model actions.
// ---------------------------------------------------------------------------------------

const ACTION_ATOMS: &[&str] = &[
    "```",
    "````",
    "`",
    "``",
    "```command",
    "```command\n",
    "````command\n",
    "```command ls```",
    "```python\n",
    "\n```\n",
    "\n````\n",
    "command",
    "submit",
    "\n",
    "\r\n",
    "\r",
    " ",
    "\t",
    "ls -la",
    "\u{0}",
    "\u{FFFD}",
    "é",
    "🦀",
    "<command>",
    "</command>",
];

/// Prose around a command block: any text without backticks.
fn prose() -> impl Strategy<Value = String> {
    "[^`]{0,40}"
}

/// A command body: any text whose own backtick runs are shorter than the fence around it.
fn command_body() -> impl Strategy<Value = String> {
    prop_oneof![
        "[^\r]{0,60}",
        structured_text(
            &["ls", " ", "\n", "`", "``", "```", "&&", "é", "submit"],
            16
        ),
    ]
}

fn longest_backtick_run(s: &str) -> usize {
    s.split(|c| c != '`').map(str::len).max().unwrap_or(0)
}

/// A reply as the format asks: prose, a fence of `n` backticks opened with `command`,
/// the body, the closing fence, prose.
fn render_reply(before: &str, body: &str, after: &str) -> String {
    let fence = "`".repeat(longest_backtick_run(body).max(2) + 1);
    format!("{before}\n{fence}command\n{body}\n{fence}\n{after}")
}

/// What the parser must read from a block holding `body` (a CR before a line break is
/// part of the line break).
fn expected_action(body: &str) -> Result<Action, FormatError> {
    let body: Vec<&str> = body
        .split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .collect();
    let body = body.join("\n");
    let t = body.trim();
    if t.is_empty() {
        Err(FormatError::EmptyCommand)
    } else if t == "submit" {
        Ok(Action::Submit)
    } else {
        Ok(Action::Shell(t.to_string()))
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Any reply (bytes made lossy, NULs, CRs) parses to an action or to a format error
    /// whose text (the observation) explains the format; a parsed command is trimmed
    /// and non-empty.
    #[test]
    fn action_arbitrary_replies_never_panic(
        reply in prop_oneof![lossy_text(1024), structured_text(ACTION_ATOMS, 96)],
    ) {
        match parse_action(&reply) {
            Ok(Action::Shell(cmd)) => {
                prop_assert!(!cmd.is_empty());
                prop_assert_eq!(cmd.trim(), cmd.as_str());
                prop_assert_ne!(cmd.as_str(), "submit");
            }
            Ok(Action::Submit) => {}
            Err(e) => {
                let shown = e.to_string();
                prop_assert!(shown.starts_with("Format error"), "{}", shown);
                prop_assert!(shown.contains("```command"), "{}", shown);
            }
        }
    }

    /// A rendered reply parses back to its command (or to submit / the empty-block error).
    #[test]
    fn action_round_trip(before in prose(), body in command_body(), after in prose()) {
        let reply = render_reply(&before, &body, &after);
        prop_assert_eq!(parse_action(&reply), expected_action(&body));
        // With Windows line endings everywhere, the same command (CRs are line ends).
        if !body.contains('\r') {
            let crlf = reply.replace('\n', "\r\n");
            prop_assert_eq!(parse_action(&crlf), expected_action(&body));
        }
    }

    /// k rendered blocks are k blocks: more than one is refused with the count.
    #[test]
    fn action_counts_blocks(bodies in proptest::collection::vec(command_body(), 2..6)) {
        let reply: String = bodies.iter().map(|b| render_reply("Step.", b, "")).collect();
        prop_assert_eq!(
            parse_action(&reply),
            Err(FormatError::MultipleCommandBlocks(bodies.len()))
        );
    }

    /// A block quoted inside another fenced block does not count; only the real one does.
    #[test]
    fn action_quoted_blocks_do_not_count(quoted in command_body(), body in command_body()) {
        let inner = render_reply("", &quoted, "");
        let outer = "`".repeat(longest_backtick_run(&inner) + 1);
        let reply = format!("Example:\n{outer}markdown\n{inner}\n{outer}\nNow:\n{}", render_reply("", &body, ""));
        prop_assert_eq!(parse_action(&reply), expected_action(&body));
    }
}

#[test]
fn action_huge_adversarial_replies_are_linear() {
    let start = std::time::Instant::now();
    // Many openers and no closer; many closers; deep backtick runs; NULs.
    let inputs = [
        "```command\n".repeat(20_000),
        "````\n```\n".repeat(20_000),
        "`".repeat(1_000_000),
        format!("```command\n{}\n```", "\u{0}".repeat(1_000_000)),
        "```python\n```command\n".repeat(20_000),
    ];
    for s in &inputs {
        let _ = parse_action(s);
    }
    assert!(
        start.elapsed() < std::time::Duration::from_secs(20),
        "quadratic parse? {:?}",
        start.elapsed()
    );
}

// ---------------------------------------------------------------------------------------
// 4. Observations and the edit rewriting.
// ---------------------------------------------------------------------------------------

fn elision_marker(n: usize) -> String {
    format!("\n<... {n} characters elided ...>\n")
}

proptest! {
    #![proptest_config(config(256))]

    /// Head+tail truncation keeps exactly `max` characters (the first half and the last
    /// half), says how many it dropped, and is the identity under the cap. Strings are
    /// cut by character, so a multi-byte character is never split (it would panic).
    #[test]
    fn observation_truncation_respects_the_cap(
        s in prop_oneof![lossy_text(600), "[aé🦀\u{0}\n]{0,300}", any::<String>()],
        max in 0usize..200,
    ) {
        let out = truncate_head_tail(&s, max);
        let total = s.chars().count();
        if total <= max {
            prop_assert_eq!(out, s);
        } else {
            let head = max / 2;
            let tail = max - head;
            let head_s: String = s.chars().take(head).collect();
            let tail_s: String = s.chars().skip(total - tail).collect();
            prop_assert_eq!(
                out,
                format!("{head_s}{}{tail_s}", elision_marker(total - max))
            );
        }
    }

    /// An observation is the capped output, a status note, and the footer last; its
    /// length is bounded by the cap whatever the command printed.
    #[test]
    fn observation_format_is_bounded(
        output in prop_oneof![lossy_text(2000), "[x\n]{0,2000}"],
        exit_code in any::<i32>(),
        timed_out in any::<bool>(),
        cwd in "[^\n]{0,20}",
        file in proptest::option::of("[^\n]{0,20}"),
        max in 0usize..300,
    ) {
        let o = format_observation(&output, exit_code, timed_out, &cwd, file.as_deref(), max);
        let footer = format!(
            "(Current directory: {cwd}, current file: {}) bash-$",
            file.as_deref().unwrap_or("none")
        );
        prop_assert!(o.ends_with(&footer));
        // Cap + the elision marker + the longest status note + the footer.
        let bound = max + 60 + 200 + footer.chars().count();
        prop_assert!(o.chars().count() <= bound, "{} > {}", o.chars().count(), bound);
        if timed_out {
            prop_assert!(o.contains("timed out"));
        } else if exit_code != 0 {
            let note = format!("(exit code {exit_code})");
            prop_assert!(o.contains(&note));
        }
    }

    /// Any command: `prepare_command` never panics, and leaves non-edits alone.
    #[test]
    fn prepare_command_never_panics(cmd in prop_oneof![
        lossy_text(300),
        structured_text(&["edit ", "1", ":", "12", "\n", "end_of_edit", "TUTOR_END_OF_EDIT", " ", "\r\n", "x"], 24),
    ]) {
        let out = prepare_command(&cmd);
        if !cmd.trim_start().starts_with("edit ") {
            prop_assert_eq!(out, cmd);
        }
    }

    /// An `edit A:B … end_of_edit` becomes a here-document whose delimiter no body line
    /// contains, with the body unchanged.
    #[test]
    fn prepare_command_edit_round_trip(
        a in 0u32..10_000,
        b in 0u32..10_000,
        body in proptest::collection::vec(prop_oneof![
            "[^\r\n]{0,30}",
            Just("TUTOR_END_OF_EDIT".to_string()),
            Just("TUTOR_END_OF_EDIT_".to_string()),
            Just("end_of_edit".to_string()),
            Just("EOF".to_string()),
        ], 0..8),
    ) {
        let cmd = format!("edit {a}:{b}\n{}end_of_edit", body.iter().map(|l| format!("{l}\n")).collect::<String>());
        let out = prepare_command(&cmd);
        let lines: Vec<&str> = out.split('\n').collect();
        let head = format!("edit {a}:{b} <<'");
        prop_assert!(lines[0].starts_with(&head), "{}", out);
        let delim = lines[0][head.len()..].strip_suffix('\'').unwrap();
        prop_assert_eq!(*lines.last().unwrap(), delim);
        prop_assert_eq!(&lines[1..lines.len() - 1], &body.iter().map(String::as_str).collect::<Vec<_>>()[..]);
        prop_assert!(body.iter().all(|l| !l.contains(delim)));
    }
}

// ---------------------------------------------------------------------------------------
// 5. Pytest logs (grading).
// ---------------------------------------------------------------------------------------

const STATUSES: [&str; 6] = ["PASSED", "FAILED", "ERROR", "XFAIL", "XPASS", "SKIPPED"];

const LOG_ATOMS: &[&str] = &[
    "PASSED ",
    "FAILED ",
    "ERROR ",
    "XFAIL ",
    "XPASS ",
    "SKIPPED ",
    "SKIPPED [1] ",
    "short test summary info",
    "=== short test summary info ===\n",
    "tests/t.py::test_a",
    "[",
    "]",
    "[[",
    "]]",
    " - ",
    ": ",
    "] ",
    "\n",
    "\r\n",
    " ",
    "\u{1b}[",
    "\u{1b}[32m",
    "\u{1b}[0m",
    "\u{1b}",
    "é",
    "::",
];

/// A pytest node id: `path::name`, maybe with a parametrize id in brackets that can hold
/// spaces, ` - ` and nested brackets.
fn node_id() -> impl Strategy<Value = String> {
    (
        "[a-z_]{1,6}(/[a-z_]{1,6}){0,2}\\.py",
        proptest::collection::vec("[A-Za-z_][A-Za-z0-9_]{0,8}", 1..3),
        proptest::option::of(prop_oneof![
            "[a-z0-9 .:-]{0,10}",
            "[a-z0-9 -]{0,4}\\[[a-z0-9 ]{0,4}\\][a-z0-9 -]{0,4}",
        ]),
    )
        .prop_map(|(path, names, param)| {
            let mut id = format!("{path}::{}", names.join("::"));
            if let Some(p) = param {
                id.push_str(&format!("[{p}]"));
            }
            id
        })
}

proptest! {
    #![proptest_config(config(256))]

    /// Arbitrary logs: statuses are only the six pytest ones, keys are non-empty, and
    /// deciding on them never panics.
    #[test]
    fn pytest_log_arbitrary_never_panics(
        log in prop_oneof![lossy_text(1024), structured_text(LOG_ATOMS, 96)],
    ) {
        let statuses = parse_pytest_log(&log);
        for (k, v) in &statuses {
            prop_assert!(!k.is_empty());
            prop_assert!(STATUSES.contains(&v.as_str()), "status {}", v);
        }
        let task = TaskRecord {
            instance_id: "x".into(),
            fail_to_pass: statuses.keys().take(2).cloned().collect(),
            ..TaskRecord::default()
        };
        let _ = decide(&task, &statuses);
    }

    /// A `-rA` summary rendered from statuses parses back to them (noise printed before
    /// the summary, colours and messages after ` - ` included); all passing means
    /// resolved.
    #[test]
    fn pytest_log_round_trip(
        tests in proptest::collection::btree_map(
            node_id(),
            proptest::sample::select(&STATUSES[..5]),
            1..8,
        ),
        skipped in proptest::collection::btree_map("[a-z]{1,6}\\.py:[1-9][0-9]{0,3}", Just("SKIPPED"), 0..3),
        noise in proptest::collection::vec(
            prop_oneof![Just("PASSED bogus::t".to_string()), "[^\n\u{1b}]{0,30}"],
            0..4,
        ),
        colour in any::<bool>(),
        message in "[a-zA-Z][^\n\u{1b}]{0,19}",
    ) {
        let mut log = String::from("============ test session starts ============\n");
        for n in &noise {
            log.push_str(n);
            log.push('\n');
        }
        log.push_str("=========================== short test summary info ============================\n");
        for (id, status) in &tests {
            let shown = if colour {
                format!("\u{1b}[32m{status}\u{1b}[0m")
            } else {
                status.to_string()
            };
            match *status {
                "PASSED" => log.push_str(&format!("{shown} {id}\n")),
                _ => log.push_str(&format!("{shown} {id} - {message}\n")),
            }
        }
        for loc in skipped.keys() {
            log.push_str(&format!("SKIPPED [1] {loc}: {message}\n"));
        }
        log.push_str("==== 1 failed, 2 passed in 0.1s ====\n");
        let parsed = parse_pytest_log(&log);
        let mut expected: BTreeMap<String, String> =
            tests.iter().map(|(k, v)| (k.clone(), v.to_string())).collect();
        expected.extend(skipped.keys().map(|k| (k.clone(), "SKIPPED".to_string())));
        prop_assert_eq!(&parsed, &expected);

        let task = TaskRecord {
            instance_id: "x".into(),
            fail_to_pass: tests.keys().cloned().collect(),
            ..TaskRecord::default()
        };
        let all_pass = tests.values().all(|s| *s == "PASSED" || *s == "XFAIL");
        prop_assert_eq!(
            decide(&task, &parsed) == OutcomeStatus::Resolved,
            all_pass
        );
    }
}

/// Pieces of the logs the harness's other parsers read (Django's runner, sympy's
/// `bin/test`, verbose pytest), to mix with the pytest atoms.
const HARNESS_LOG_ATOMS: &[&str] = &[
    " ... ok",
    " ... FAIL",
    " ... ERROR",
    " ... skipped 'x'",
    " ...  OK",
    "FAIL: ",
    "ERROR: ",
    "ok\n",
    "test_a (m.T.test_a)",
    "Applying sites.0002_alter_domain_unique...test_no_migrations",
    "--version is equivalent to version",
    "System check identified no issues (0 silenced)\nok",
    "Internal Server Error: /x/\nok",
    "Testing against Django installed in '/x' silenced).\nok",
    "________ sympy/a.py:test_b ________",
    "test_c ok",
    " E",
    " F",
    "MouseButton.LEFT",
    " PASSED ",
    "\u{1b}[32m",
    "\t",
    "\u{1c}",
];

proptest! {
    #![proptest_config(config(256))]

    /// Every harness log parser on arbitrary and structured logs: never panics, and each
    /// status it reports starts or ends with one of the harness's five (the pytest
    /// parsers keep the first word as the harness does, so `PASSEDx` can be one, and
    /// `pytest_v2` the last word of a line ending in a status); `pytest_pydantic` takes
    /// the second word of such a line, whatever it is, as SWE-Gym's fork does.
    #[test]
    fn harness_parsers_never_panic(
        log in prop_oneof![
            lossy_text(1024),
            structured_text(LOG_ATOMS, 96),
            structured_text(HARNESS_LOG_ATOMS, 96),
        ],
    ) {
        use tutor_rollout_worker::harness::{parsers::HARNESS_STATUSES, LogParser};
        for parser in LogParser::ALL {
            let statuses = parser.parse(&log);
            if parser == LogParser::PytestPydantic {
                continue;
            }
            for status in statuses.values() {
                prop_assert!(
                    HARNESS_STATUSES
                        .iter()
                        .any(|s| status.starts_with(s) || status.ends_with(s)),
                    "{}: status {:?}",
                    parser.name(),
                    status
                );
            }
        }
    }
}
