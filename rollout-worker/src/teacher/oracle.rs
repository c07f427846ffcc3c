//! The oracle teacher: a policy over the sandbox state that knows the gold patch.
//!
//! Long because the decision (which step the state calls for) and the shell commands it
//! chooses between are one policy, read together; about 110 lines are its tests.
//!
//! From whatever state the sandbox is in (including states a student wrecked) it returns
//! the best next action: revert stray changes, read the file to fix, apply the fix, run the
//! tests, submit.

use std::collections::HashSet;

use crate::sandbox::{shell_quote, Sandbox};
use crate::tasks::{
    apply_file_patch, find_block, parse_unified_diff, split_lines, FilePatch, Hunk, TaskRecord,
};
use crate::teacher::{
    format_reply, ExecutedStep, Teacher, TeacherError, TeacherReply, TeacherState,
};

/// Files larger than this are shown in a window around the change, not whole.
const VIEW_WHOLE_MAX_LINES: usize = 200;
const VIEW_WINDOW: usize = 30;
/// Largest wrongly edited stretch between a hunk's intact context lines that the oracle
/// replaces in place (beyond that it restores the file instead).
const ANCHOR_MAX_GAP: usize = 40;

/// Commands that display a file when given its path.
const VIEWERS: &[&str] = &[
    "cat",
    "head",
    "tail",
    "nl",
    "sed",
    "grep",
    "egrep",
    "less",
    "more",
    "awk",
    "bat",
    "open",
    "view",
    "search_file",
];

/// Commands that never change the working tree (for "were the tests run after the last
/// change?").
const READ_ONLY: &[&str] = &[
    "cat",
    "ls",
    "pwd",
    "head",
    "tail",
    "nl",
    "grep",
    "egrep",
    "rg",
    "find",
    "echo",
    "wc",
    "cd",
    "tree",
    "file",
    "stat",
    "open",
    "goto",
    "scroll_up",
    "scroll_down",
    "search_file",
    "search_dir",
    "find_file",
    "less",
    "more",
    "true",
    "diff",
];

/// The gold patch, digested for one task.
#[derive(Debug, Clone)]
struct GoldFile {
    path: String,
    patch: FilePatch,
    /// Content at the base commit (`None` if the gold patch creates the file).
    base: Option<String>,
    /// Content after the gold patch (`None` if the gold patch deletes the file).
    gold: Option<String>,
}

#[derive(Debug, Clone)]
enum Plan {
    Files(Vec<GoldFile>),
    /// The gold patch could not be digested (binary, does not apply in Rust): fix with
    /// `git apply` instead of targeted edits.
    Fallback,
}

/// State of one gold file in the working tree.
enum FileState {
    Done,
    /// Needs these edits (on the current content).
    Edit(Vec<Region>),
    /// Must be (re)written whole (creations).
    Write,
    /// Must be deleted.
    Delete,
    /// Unrecognisable: restore it first.
    Revert,
}

/// Replace `count` lines starting at 0-based `start` with `new`.
#[derive(Debug, Clone)]
struct Region {
    start: usize,
    count: usize,
    new: Vec<String>,
}

/// The oracle: reads the gold patch from the task and the state from the sandbox.
#[derive(Default)]
pub struct OracleTeacher {
    /// Digested gold patch, keyed by instance id and base commit.
    cache: Option<(String, Plan)>,
}

impl OracleTeacher {
    pub fn new() -> Self {
        Self::default()
    }

    fn plan(&mut self, task: &TaskRecord, sb: &dyn Sandbox) -> Plan {
        let key = format!("{}@{}", task.instance_id, sb.base_commit());
        if let Some((k, p)) = &self.cache {
            if *k == key {
                return p.clone();
            }
        }
        let plan = digest(task, sb);
        self.cache = Some((key, plan.clone()));
        plan
    }
}

fn digest(task: &TaskRecord, sb: &dyn Sandbox) -> Plan {
    let Ok(patches) = parse_unified_diff(&task.patch) else {
        return Plan::Fallback;
    };
    let mut files = Vec::new();
    for fp in patches {
        let Some(path) = fp.path().map(str::to_string) else {
            return Plan::Fallback;
        };
        if fp.binary
            || (fp.old_path.is_some() && fp.new_path.is_some() && fp.old_path != fp.new_path)
        {
            return Plan::Fallback;
        }
        let base = sb.base_file(&path);
        if base.is_none() && !fp.is_creation() {
            return Plan::Fallback;
        }
        let gold = if fp.is_deletion() {
            None
        } else {
            match apply_file_patch(base.as_deref().unwrap_or(""), &fp) {
                Ok(g) => Some(g),
                Err(_) => return Plan::Fallback,
            }
        };
        files.push(GoldFile {
            path,
            patch: fp,
            base,
            gold,
        });
    }
    if files.is_empty() {
        return Plan::Fallback;
    }
    Plan::Files(files)
}

impl Teacher for OracleTeacher {
    fn name(&self) -> &str {
        "oracle"
    }

    fn next_action(&mut self, state: &TeacherState<'_>) -> Result<TeacherReply, TeacherError> {
        let plan = self.plan(state.task, state.sandbox);
        let (reason, command) = decide(&plan, state);
        Ok(TeacherReply::text(format_reply(&reason, &command)))
    }
}

fn file_state(gf: &GoldFile, current: Option<&str>) -> FileState {
    match (&gf.gold, current) {
        (None, None) => FileState::Done,
        (None, Some(_)) => FileState::Delete,
        (Some(g), Some(c)) if c == g => FileState::Done,
        (Some(_), _) if gf.base.is_none() => FileState::Write,
        (Some(_), None) => FileState::Revert,
        (Some(g), Some(c)) => match pending_regions(&gf.patch.hunks, c, g) {
            Some(r) => FileState::Edit(r),
            None => FileState::Revert,
        },
    }
}

/// Edits that turn `current` into `gold`, found hunk by hunk on the current content: a
/// hunk whose result is already there is skipped, one whose original is there is applied.
/// `None` if that does not reproduce `gold` exactly (the file was edited elsewhere).
fn pending_regions(hunks: &[Hunk], current: &str, gold: &str) -> Option<Vec<Region>> {
    let (lines, trailing) = split_lines(current);
    let (_, gold_trailing) = split_lines(gold);
    if trailing != gold_trailing {
        return None;
    }
    let mut regions: Vec<Region> = Vec::new();
    let mut delta: isize = 0;
    let mut floor = 0usize;
    for h in hunks {
        let old = h.old_lines();
        let new = h.new_lines();
        let start = h.old_start.saturating_sub(1);
        let hint = ((start as isize) + delta).max(0) as usize;
        let old_at = find_block(&lines, &old, hint).filter(|&p| p >= floor);
        let new_at = find_block(&lines, &new, hint).filter(|&p| p >= floor);
        // Shared context at both ends of the hunk; the edit touches only what is between.
        let pre = old.iter().zip(&new).take_while(|(a, b)| a == b).count();
        let max_suf = old.len().min(new.len()) - pre;
        let suf = old
            .iter()
            .rev()
            .zip(new.iter().rev())
            .take(max_suf)
            .take_while(|(a, b)| a == b)
            .count();
        let middle: Vec<String> = new[pre..new.len() - suf]
            .iter()
            .map(|s| s.to_string())
            .collect();
        // Prefer the match closest to where the hunk belongs.
        let dist = |p: usize| p.abs_diff(hint);
        let applied = match (old_at, new_at) {
            (Some(o), Some(n)) => dist(n) < dist(o),
            (None, Some(_)) => true,
            _ => false,
        };
        if applied {
            // The current content already has this hunk's size change; later hunks'
            // base line numbers shift by it.
            let n = new_at?;
            floor = n + new.len();
            delta += new.len() as isize - old.len() as isize;
            continue;
        }
        if let Some(o) = old_at {
            regions.push(Region {
                start: o + pre,
                count: old.len() - pre - suf,
                new: middle,
            });
            // Pending edits are applied later (bottom-up), so they do not shift positions
            // in the current content.
            floor = o + old.len();
            continue;
        }
        // Neither version is there: if the surrounding context is intact, the lines
        // between were edited wrongly and can be replaced directly. A hunk without
        // leading (trailing) context sits at the start (end) of the file.
        let head = &old[..pre];
        let tail = &old[old.len() - suf..];
        let from = if pre == 0 {
            if floor > 0 {
                return None;
            }
            0
        } else {
            find_block(&lines, head, hint).filter(|&p| p >= floor)? + pre
        };
        let tp = if suf == 0 {
            Some(lines.len()).filter(|&e| e >= from && e - from <= ANCHOR_MAX_GAP)?
        } else {
            (from..=lines.len().saturating_sub(suf).min(from + ANCHOR_MAX_GAP))
                .find(|&p| tail.iter().enumerate().all(|(k, l)| lines[p + k] == *l))?
        };
        regions.push(Region {
            start: from,
            count: tp - from,
            new: middle,
        });
        floor = tp + suf;
    }
    // Verify: the edits must give exactly the gold content.
    let mut out: Vec<String> = lines.clone();
    for r in regions.iter().rev() {
        out.splice(r.start..r.start + r.count, r.new.iter().cloned());
    }
    let rebuilt = crate::tasks::join_lines(&out, trailing);
    (rebuilt == gold).then_some(regions)
}

/// Splits a shell command into simple-command segments (on `;`, `&&`, `||`, `|`, newlines).
fn segments(cmd: &str) -> Vec<Vec<String>> {
    cmd.split(['\n', ';', '&', '|'])
        .map(|seg| {
            seg.split_whitespace()
                .map(|w| w.trim_matches(|c| c == '\'' || c == '"').to_string())
                .collect::<Vec<_>>()
        })
        .filter(|w| !w.is_empty())
        .collect()
}

fn program(words: &[String]) -> &str {
    // Skip `sudo`, env assignments and `command`.
    words
        .iter()
        .find(|w| !w.contains('=') && *w != "sudo" && *w != "command")
        .map_or("", |w| w.rsplit('/').next().unwrap_or(w))
}

fn names_file(word: &str, path: &str) -> bool {
    let base = path.rsplit('/').next().unwrap_or(path);
    let word = word.trim_start_matches("./");
    word == path
        || word.ends_with(&format!("/{path}"))
        || word == base
        || word.ends_with(&format!("/{base}"))
}

/// Did a successful command display `path`?
fn viewed(history: &[ExecutedStep], path: &str) -> bool {
    history.iter().any(|s| {
        s.exit_code == 0
            && s.command.as_deref().is_some_and(|c| {
                segments(c).iter().any(|w| {
                    VIEWERS.contains(&program(w))
                        && !w.iter().any(|x| x == "-i" || x.starts_with("-i"))
                        && w.iter().skip(1).any(|x| names_file(x, path))
                })
            })
    })
}

fn is_test_command(cmd: &str) -> bool {
    cmd.contains("pytest")
        || cmd.contains("unittest")
        || cmd.contains("tox")
        || cmd.contains("manage.py test")
}

fn is_read_only(cmd: &str) -> bool {
    if cmd.contains('>') {
        return false;
    }
    segments(cmd).iter().all(|w| {
        let p = program(w);
        if p == "git" {
            return matches!(
                w.get(1).map(String::as_str),
                Some("diff" | "status" | "log" | "show" | "grep" | "blame")
            );
        }
        if p == "sed" {
            return !w.iter().any(|x| x.starts_with("-i") || x == "--in-place");
        }
        READ_ONLY.contains(&p)
    })
}

/// True if tests ran after the last command that may have changed files.
fn tested_since_change(history: &[ExecutedStep]) -> bool {
    for s in history.iter().rev() {
        let Some(c) = s.command.as_deref() else {
            continue;
        };
        if is_test_command(c) {
            return true;
        }
        if !is_read_only(c) {
            return false;
        }
    }
    false
}

fn join_paths(paths: &[String]) -> String {
    paths
        .iter()
        .map(|p| shell_quote(p))
        .collect::<Vec<_>>()
        .join(" ")
}

fn list_names(paths: &[String]) -> String {
    paths
        .iter()
        .map(|p| format!("`{p}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The `open` tool's window (tutor_tools.py `WINDOW`): longer files are opened at a line.
const VIEWER_WINDOW: usize = 100;

/// The `replace` tool's arguments for a one-line fix: the old line's text (without its
/// indentation) and the new one's, if the old text occurs exactly once in `current` and
/// replacing it gives exactly `gold`.
fn replace_edit(regions: &[Region], current: &str, gold: Option<&str>) -> Option<(String, String)> {
    let [r] = regions else { return None };
    if r.count != 1 || r.new.len() != 1 || current.contains('\r') {
        return None;
    }
    let (lines, _) = split_lines(current);
    let old_line = lines.get(r.start)?;
    let indent = old_line.len() - old_line.trim_start().len();
    let new_line = &r.new[0];
    if new_line.get(..indent)? != old_line.get(..indent)? {
        return None;
    }
    let (old, new) = (
        old_line.trim().to_string(),
        new_line.get(indent..)?.trim_end().to_string(),
    );
    if old.is_empty() || current.matches(old.as_str()).count() != 1 {
        return None;
    }
    (current.replacen(&old, &new, 1) == gold?).then_some((old, new))
}

/// A heredoc delimiter that does not occur as a line of `body`.
fn delimiter(body: &str, base: &str) -> String {
    let mut d = base.to_string();
    let mut n = 0;
    while body.lines().any(|l| l == d) {
        n += 1;
        d = format!("{base}_{n}");
    }
    d
}

/// A Python string literal (JSON string syntax is valid Python).
fn py_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// sed replacement text escaping (delimiter `/`), then shell single-quote escaping.
fn sed_replacement(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('&', "\\&")
        .replace('/', "\\/")
        .replace('\'', "'\\''")
}

fn edit_command(path: &str, regions: &[Region], current: &str) -> String {
    let simple = regions
        .iter()
        .all(|r| r.count == 1 && r.new.len() == 1 && !r.new[0].contains('\r'));
    if simple && !current.contains('\r') {
        let exprs: Vec<String> = regions
            .iter()
            .map(|r| format!("'{}s/.*/{}/'", r.start + 1, sed_replacement(&r.new[0])))
            .collect();
        let script = if exprs.len() == 1 {
            exprs[0].clone()
        } else {
            exprs
                .iter()
                .map(|e| format!("-e {e}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        return format!("sed -i {script} {}", shell_quote(path));
    }
    // Line-ending style of the file, so CRLF files stay CRLF.
    let eol = if current.contains("\r\n") {
        "\r\n"
    } else {
        "\n"
    };
    let mut script = format!(
        "path = {}\nwith open(path, encoding=\"utf-8\", newline=\"\") as f:\n    lines = f.readlines()\n",
        py_str(path)
    );
    // Bottom-up, so earlier line numbers stay valid.
    for r in regions.iter().rev() {
        // Hunk lines of a CRLF file carry their CR (see `parse_unified_diff`).
        let new: Vec<String> = r
            .new
            .iter()
            .map(|l| py_str(&format!("{}{eol}", l.strip_suffix('\r').unwrap_or(l))))
            .collect();
        script.push_str(&format!(
            "lines[{}:{}] = [{}]\n",
            r.start,
            r.start + r.count,
            new.join(", ")
        ));
    }
    script.push_str("with open(path, \"w\", encoding=\"utf-8\", newline=\"\") as f:\n    f.write(\"\".join(lines))\n");
    let d = delimiter(&script, "EOF");
    format!("python - <<'{d}'\n{script}{d}")
}

fn write_command(path: &str, content: &str) -> String {
    let mkdir = match path.rsplit_once('/') {
        Some((dir, _)) => format!("mkdir -p {} && ", shell_quote(dir)),
        None => String::new(),
    };
    if content.ends_with('\n') && !content.contains('\r') {
        let d = delimiter(content, "EOF");
        return format!("{mkdir}cat > {} <<'{d}'\n{content}{d}", shell_quote(path));
    }
    let script = format!(
        "with open({}, \"w\", encoding=\"utf-8\", newline=\"\") as f:\n    f.write({})\n",
        py_str(path),
        py_str(content)
    );
    let d = delimiter(&script, "EOF");
    format!("{mkdir}python - <<'{d}'\n{script}{d}")
}

fn view_command(path: &str, content: &str, first_change: Option<usize>) -> String {
    let n = content.lines().count();
    if n <= VIEW_WHOLE_MAX_LINES {
        return format!("cat -n {}", shell_quote(path));
    }
    let center = first_change.unwrap_or(0);
    let from = center.saturating_sub(VIEW_WINDOW) + 1;
    let to = (center + VIEW_WINDOW).min(n);
    format!("nl -ba {} | sed -n '{from},{to}p'", shell_quote(path))
}

/// The oracle's decision: (one reasoning sentence, command).
fn decide(plan: &Plan, st: &TeacherState<'_>) -> (String, String) {
    let sb = st.sandbox;
    let cd = if sb.at_root() {
        String::new()
    } else {
        format!("cd {} && ", sb.repo_display())
    };
    // Revert with HEAD normally (it reads naturally); if the agent committed, HEAD moved
    // and only the base commit itself restores the original files.
    let base_ref = match sb.head() {
        Some(h) if h == sb.base_commit() => "HEAD".to_string(),
        _ => sb.base_commit().to_string(),
    };
    let remaining = st.max_turns.saturating_sub(st.turn);

    let Plan::Files(gold) = plan else {
        return fallback(st, &cd, &base_ref);
    };
    let gold_paths: HashSet<&str> = gold.iter().map(|g| g.path.as_str()).collect();

    // (1) Stray changes and unrecognisable gold files are restored first.
    let changed = sb.changed_files();
    let mut restore: Vec<String> = Vec::new();
    let mut remove: Vec<String> = Vec::new();
    for f in changed.iter().filter(|f| !gold_paths.contains(f.as_str())) {
        if sb.base_file(f).is_some() {
            restore.push(f.clone());
        } else {
            remove.push(f.clone());
        }
    }
    let states: Vec<(&GoldFile, Option<String>, FileState)> = gold
        .iter()
        .map(|g| {
            let cur = sb.read_file(&g.path);
            let s = file_state(g, cur.as_deref());
            (g, cur, s)
        })
        .collect();
    let broken: Vec<String> = states
        .iter()
        .filter(|(_, _, s)| matches!(s, FileState::Revert))
        .map(|(g, _, _)| g.path.clone())
        .collect();
    if !restore.is_empty() || !remove.is_empty() || !broken.is_empty() {
        let mut parts = Vec::new();
        let mut all_restore = restore.clone();
        all_restore.extend(broken.iter().cloned());
        if !all_restore.is_empty() {
            parts.push(format!(
                "git checkout {base_ref} -- {}",
                join_paths(&all_restore)
            ));
        }
        if !remove.is_empty() {
            parts.push(format!("rm -f -- {}", join_paths(&remove)));
        }
        let mut why = Vec::new();
        if !restore.is_empty() || !remove.is_empty() {
            let mut stray = restore.clone();
            stray.extend(remove.iter().cloned());
            why.push(format!(
                "{} should not be changed for this fix",
                list_names(&stray)
            ));
        }
        if !broken.is_empty() {
            why.push(format!(
                "{} was edited in a way that does not fix the bug",
                list_names(&broken)
            ));
        }
        let reason = format!(
            "{}, so I will restore the original version first.",
            capitalize(&why.join(", and "))
        );
        return (reason, format!("{cd}{}", parts.join(" && ")));
    }

    // (2)/(3) Per gold file, in patch order: read it, then fix it.
    for (g, cur, s) in &states {
        let path = &g.path;
        match s {
            FileState::Done | FileState::Revert => continue,
            FileState::Delete => {
                return (
                    format!("`{path}` is no longer needed, so I will delete it."),
                    format!("{cd}rm -f -- {}", shell_quote(path)),
                );
            }
            FileState::Write => {
                let content = g.gold.as_deref().unwrap_or("");
                return (
                    format!("The fix needs a new file `{path}`; I will create it."),
                    format!("{cd}{}", write_command(path, content)),
                );
            }
            FileState::Edit(regions) => {
                let cur = cur.as_deref().unwrap_or("");
                // A one-line fix whose line is unique in the file: open the file in the
                // viewer and replace that line's text (the SWE-agent way, no line numbers
                // to copy; the viewer shows the result).
                if let Some((old, new)) = replace_edit(regions, cur, g.gold.as_deref()) {
                    let open = sb.current_file().is_some_and(|f| names_file(&f, path));
                    if !open {
                        let at = regions.first().map_or(1, |r| r.start + 1);
                        let line = if cur.lines().count() > VIEWER_WINDOW {
                            format!(" {at}")
                        } else {
                            String::new()
                        };
                        return (
                            "I will open the file the issue names.".to_string(),
                            format!("{cd}open {}{line}", shell_quote(path)),
                        );
                    }
                    return (
                        "I will fix the wrong line.".to_string(),
                        format!("{cd}replace {} {}", shell_quote(&old), shell_quote(&new)),
                    );
                }
                if !viewed(st.history, path) {
                    return (
                        format!("The problem points at `{path}`; let me read it before changing anything."),
                        format!("{cd}{}", view_command(path, cur, regions.first().map(|r| r.start))),
                    );
                }
                let lines: Vec<String> = regions
                    .iter()
                    .map(|r| {
                        if r.count == 0 {
                            format!("after line {}", r.start)
                        } else if r.count == 1 {
                            format!("line {}", r.start + 1)
                        } else {
                            format!("lines {}-{}", r.start + 1, r.start + r.count)
                        }
                    })
                    .collect();
                return (
                    format!(
                        "The bug is in `{path}` ({}); I will correct the code there.",
                        lines.join(", ")
                    ),
                    format!("{cd}{}", edit_command(path, regions, cur)),
                );
            }
        }
    }

    // (4) The fix is in place: run the tests unless they ran after the last change.
    let tests: Vec<String> = st
        .task
        .test_files()
        .into_iter()
        .filter(|f| sb.base_file(f).is_some())
        .collect();
    if remaining > 1 && !tests.is_empty() && !tested_since_change(st.history) {
        return (
            "Let me run the tests.".into(),
            format!("{cd}python -m pytest -q {}", join_paths(&tests)),
        );
    }
    // (5) Done.
    (
        "The fix is complete, so I will submit.".into(),
        "submit".into(),
    )
}

/// When the gold patch cannot be digested: restore the touched files and `git apply` it.
fn fallback(st: &TeacherState<'_>, cd: &str, base_ref: &str) -> (String, String) {
    let sb = st.sandbox;
    let patch = &st.task.patch;
    // What the gold patch makes of each file it touches; if it does not even apply to
    // the base, there is nothing sensible to do but submit.
    let Ok(gold) = sb.apply_to_base(patch) else {
        return (
            "The reference change cannot be reproduced here, so I will submit as is.".into(),
            "submit".into(),
        );
    };
    let changed = sb.changed_files();
    let applied = changed.iter().all(|f| gold.contains_key(f))
        && gold.iter().all(|(f, g)| sb.read_file(f) == *g);
    if applied {
        let tests: Vec<String> = st
            .task
            .test_files()
            .into_iter()
            .filter(|f| sb.base_file(f).is_some())
            .collect();
        if !tests.is_empty()
            && !tested_since_change(st.history)
            && st.max_turns.saturating_sub(st.turn) > 1
        {
            return (
                "The fix is in place; let me run the tests to check it.".into(),
                format!("{cd}python -m pytest -q {}", join_paths(&tests)),
            );
        }
        return (
            "The fix is complete, so I will submit.".into(),
            "submit".into(),
        );
    }
    let mut restore: Vec<String> = Vec::new();
    let mut remove: Vec<String> = Vec::new();
    for f in changed.iter().chain(gold.keys()) {
        if restore.contains(f) || remove.contains(f) {
            continue;
        }
        if sb.base_file(f).is_some() {
            restore.push(f.clone());
        } else {
            remove.push(f.clone());
        }
    }
    let mut parts = Vec::new();
    if !restore.is_empty() {
        parts.push(format!(
            "git checkout {base_ref} -- {}",
            join_paths(&restore)
        ));
    }
    if !remove.is_empty() {
        parts.push(format!("rm -f -- {}", join_paths(&remove)));
    }
    let body = if patch.ends_with('\n') {
        patch.clone()
    } else {
        format!("{patch}\n")
    };
    let d = delimiter(&body, "PATCH");
    parts.push(format!("git apply <<'{d}'\n{body}{d}"));
    (
        "I will restore the affected files and apply the fix as a patch.".into(),
        format!("{cd}{}", parts.join(" && ")),
    )
}

fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().collect::<String>() + c.as_str(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(c: &str) -> ExecutedStep {
        ExecutedStep {
            command: Some(c.into()),
            output: String::new(),
            exit_code: 0,
            ..Default::default()
        }
    }

    #[test]
    fn view_detection() {
        let p = "pkg/stats.py";
        assert!(viewed(&[step("cat -n pkg/stats.py")], p));
        assert!(viewed(&[step("cd pkg && cat stats.py")], p));
        assert!(viewed(&[step("sed -n '1,40p' pkg/stats.py")], p));
        assert!(viewed(&[step("grep -n def ./pkg/stats.py")], p));
        assert!(viewed(&[step("nl -ba pkg/stats.py | sed -n '1,9p'")], p));
        assert!(!viewed(&[step("sed -i 's/a/b/' pkg/stats.py")], p));
        assert!(!viewed(&[step("cat pkg/other.py")], p));
        let mut failed = step("cat pkg/stats.py");
        failed.exit_code = 1;
        assert!(!viewed(&[failed], p));
        assert!(!viewed(&[ExecutedStep::default()], p));
    }

    #[test]
    fn test_run_tracking() {
        assert!(!tested_since_change(&[]));
        assert!(tested_since_change(&[
            step("sed -i 's/a/b/' x"),
            step("python -m pytest -q")
        ]));
        assert!(tested_since_change(&[
            step("python -m pytest -q"),
            step("cat x"),
            step("git diff")
        ]));
        assert!(!tested_since_change(&[step("pytest"), step("echo x > y")]));
        assert!(!tested_since_change(&[
            step("pytest"),
            step("python - <<'EOF'\nEOF")
        ]));
        assert!(!tested_since_change(&[
            step("pytest"),
            step("git checkout HEAD -- a")
        ]));
    }

    #[test]
    fn pending_regions_handle_partial_progress() {
        let base: String = (1..=30).map(|i| format!("l{i}\n")).collect();
        let mut g: Vec<String> = (1..=30).map(|i| format!("l{i}")).collect();
        g[2] = "L3".into();
        g[25] = "L26".into();
        g.insert(26, "extra".into());
        let gold = crate::tasks::join_lines(&g, true);
        let diff = similar::TextDiff::from_lines(&base, &gold)
            .unified_diff()
            .header("a/f", "b/f")
            .to_string();
        let fp = &parse_unified_diff(&diff).unwrap()[0];
        assert_eq!(fp.hunks.len(), 2);
        let r = pending_regions(&fp.hunks, &base, &gold).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].start, r[0].count), (2, 1));
        // First hunk done by hand: only the second remains.
        let partial = base.replace("l3\n", "L3\n");
        let r = pending_regions(&fp.hunks, &partial, &gold).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].start, 25);
        // An unrelated edit makes the file unrecognisable.
        let wrecked = base.replace("l10\n", "oops\n");
        assert!(pending_regions(&fp.hunks, &wrecked, &gold).is_none());
        // A wrong edit of the very lines the fix changes is replaced in place, even if it
        // changed the line count.
        let wrong = base.replace("l3\n", "bad\nworse\n");
        let r = pending_regions(&fp.hunks, &wrong, &gold).unwrap();
        assert_eq!(
            (r[0].start, r[0].count, r[0].new.clone()),
            (2, 2, vec!["L3".to_string()])
        );
        assert_eq!(r[1].start, 26);
        assert!(pending_regions(&fp.hunks, &gold, &gold).unwrap().is_empty());
        // The same at the very end and start of a file (no context on one side).
        let base = "a\nb\nc\nd\nlast\n";
        let gold = "a\nb\nc\nd\nLAST\n";
        let diff = similar::TextDiff::from_lines(base, gold)
            .unified_diff()
            .header("a/f", "b/f")
            .to_string();
        let fp = &parse_unified_diff(&diff).unwrap()[0];
        let r = pending_regions(&fp.hunks, "a\nb\nc\nd\nwrong\nwrong2\n", gold).unwrap();
        assert_eq!((r[0].start, r[0].count), (4, 2));
        let diff = similar::TextDiff::from_lines("first\nb\nc\nd\ne\n", "FIRST\nb\nc\nd\ne\n")
            .unified_diff()
            .header("a/f", "b/f")
            .to_string();
        let fp = &parse_unified_diff(&diff).unwrap()[0];
        let r = pending_regions(&fp.hunks, "oops\nb\nc\nd\ne\n", "FIRST\nb\nc\nd\ne\n").unwrap();
        assert_eq!((r[0].start, r[0].count), (0, 1));
    }

    #[test]
    fn sed_escaping() {
        assert_eq!(sed_replacement(r"a/b&c\d'e"), r"a\/b\&c\\d'\''e");
    }
}
