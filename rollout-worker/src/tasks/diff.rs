//! Unified diffs: which files a patch touches, parsing into hunks, applying.
//!
//! Shared by the grader, the oracle teacher and the toy tasks; the applier places hunks
//! fuzzily, as the oracle needs on files a student edited.

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
            // A patch converted to CRLF as a whole (its headers end in CR too) carries CRs
            // that are not content. Otherwise a hunk line's CR is the file's own (a CRLF
            // file, as `git diff` writes it) and is kept, as `git apply` keeps it.
            let crlf_patch = lines[i].ends_with('\r');
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
                    let raw = if crlf_patch {
                        raw.strip_suffix('\r').unwrap_or(raw)
                    } else {
                        raw
                    };
                    // An empty line inside a hunk is an empty context line (some tools
                    // strip the trailing space); so is a lone CR (an empty line of a CRLF
                    // file, its space stripped).
                    let (tag, text) = match raw.chars().next() {
                        Some('\r') if raw.len() == 1 => (' ', raw),
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
    fn crlf_file_diff_keeps_its_carriage_returns() {
        // `git diff` of a CRLF file: the CRs are in the hunk lines only.
        let diff = "--- a/w.txt\n+++ b/w.txt\n@@ -1,2 +1,2 @@\n a\r\n-b\r\n+c\r\n";
        let fp = &parse_unified_diff(diff).unwrap()[0];
        assert_eq!(apply_file_patch("a\r\nb\r\n", fp).unwrap(), "a\r\nc\r\n");
        let create = "--- /dev/null\n+++ b/w.txt\n@@ -0,0 +1 @@\n+a\r\n";
        let fp = &parse_unified_diff(create).unwrap()[0];
        assert_eq!(apply_file_patch("", fp).unwrap(), "a\r\n");
        // A patch converted to CRLF as a whole (headers too) still applies to LF files.
        let converted = "--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n-b\n+c\n\n".replace('\n', "\r\n");
        let fp = &parse_unified_diff(&converted).unwrap()[0];
        assert_eq!(apply_file_patch("a\nb\n\n", fp).unwrap(), "a\nc\n\n");
    }

    #[test]
    fn malformed_diffs_error_instead_of_panicking() {
        assert!(parse_unified_diff("--- a/x\nnope").is_err());
        assert!(parse_unified_diff("--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n").is_err());
        assert!(parse_unified_diff("--- a/x\n+++ b/x\n@@ garbage @@\n").is_err());
        assert_eq!(parse_unified_diff("just text\n").unwrap(), vec![]);
    }
}
