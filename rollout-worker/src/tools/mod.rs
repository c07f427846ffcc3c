//! The SWE-agent tool set (`open`, `goto`, `scroll_up`, `scroll_down`, `create`, `edit`,
//! `replace`, `search_file`, `search_dir`, `find_file`) as one Python helper installed
//! into every sandbox, local or Docker, so both behave identically. `submit` is not a
//! tool: the episode loop handles it (see [`crate::action`]).

/// The helper, installed as `tutor_tools.py` in the sandbox's tool directory.
pub const TOOLS_PY: &str = include_str!("tutor_tools.py");

/// Tool commands, each installed as a shim that runs the helper.
pub const TOOL_NAMES: &[&str] = &[
    "open",
    "goto",
    "scroll_up",
    "scroll_down",
    "create",
    "edit",
    "replace",
    "search_file",
    "search_dir",
    "find_file",
];

/// Where the tool shims look for a Python 3 after `python3` on the PATH: conda's own and
/// the SWE-bench env's (an image's `python` may be Python 2, so it is not tried).
pub const PYTHON_FALLBACKS: &str =
    "/opt/miniconda3/bin/python3 /opt/miniconda3/envs/testbed/bin/python3 /opt/conda/bin/python3";

/// The files to install in a tool directory `bin_dir` (as seen inside the sandbox):
/// `(file name, content)`; every file is executable.
pub fn tool_files(bin_dir: &str) -> Vec<(String, String)> {
    let helper = format!("{bin_dir}/tutor_tools.py");
    let mut files = vec![("tutor_tools.py".to_string(), TOOLS_PY.to_string())];
    let helper = crate::sandbox::shell_quote(&helper);
    for name in TOOL_NAMES {
        // Images need not have `python3` on the default PATH (a SWE-bench image keeps its
        // Pythons under /opt/miniconda3): the first Python 3 found runs the helper.
        files.push((
            name.to_string(),
            format!(
                "#!/bin/sh\nfor p in python3 {PYTHON_FALLBACKS}; do\n  \
                 command -v \"$p\" >/dev/null 2>&1 && exec \"$p\" {helper} {name} \"$@\"\n\
                 done\necho \"{name}: no Python 3 in this sandbox (tried python3 {PYTHON_FALLBACKS})\" >&2\n\
                 exit 127\n"
            ),
        ));
    }
    files
}

/// The part of the system prompt that documents the tools.
pub const TOOLS_DOC: &str = "Besides any shell command you can use these tools:
  open FILE [LINE]          show FILE in a 100-line window with line numbers (around LINE)
  goto LINE                 move the window of the open file to LINE
  scroll_down / scroll_up   move the window of the open file
  create FILE               create a new file (content as a here-document) and open it
  edit START:END <<'EOF'    replace lines START..END of the open file with the lines up to EOF
  replace SEARCH REPLACE [--replace-all]   replace text in the open file (quote both)
  search_file TERM [FILE]   lines containing TERM in FILE (default: the open file)
  search_dir TERM [DIR]     files under DIR containing TERM
  find_file NAME [DIR]      files under DIR named NAME (wildcards allowed)
  submit                    finish; your changes to the repository are the submission";

/// Rewrites the SWE-agent spelling of an edit, whose body ends with a line
/// `end_of_edit`, into the here-document form bash understands:
///
/// ```text
/// edit 3:4                 edit 3:4 <<'TUTOR_END_OF_EDIT'
///     return a + b    →        return a + b
/// end_of_edit              TUTOR_END_OF_EDIT
/// ```
///
/// Anything else is returned unchanged.
pub fn prepare_command(command: &str) -> String {
    let mut lines = command.lines();
    let Some(first) = lines.next() else {
        return command.to_string();
    };
    let first = first.trim();
    let is_edit = first
        .strip_prefix("edit ")
        .map(|r| {
            let r = r.trim();
            r.split_once(':').is_some_and(|(a, b)| {
                !a.is_empty()
                    && !b.is_empty()
                    && a.bytes().all(|c| c.is_ascii_digit())
                    && b.bytes().all(|c| c.is_ascii_digit())
            })
        })
        .unwrap_or(false);
    let body: Vec<&str> = lines.collect();
    if !is_edit || body.last().map(|l| l.trim()) != Some("end_of_edit") {
        return command.to_string();
    }
    let body = &body[..body.len() - 1];
    // A delimiter that does not occur in the body.
    let mut delim = "TUTOR_END_OF_EDIT".to_string();
    while body.iter().any(|l| l.contains(&delim)) {
        delim.push('_');
    }
    let mut out = format!("{first} <<'{delim}'\n");
    for l in body {
        out.push_str(l);
        out.push('\n');
    }
    out.push_str(&delim);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_of_edit_becomes_a_here_document() {
        let c = prepare_command("edit 3:4\n    return a + b\nend_of_edit");
        assert_eq!(
            c,
            "edit 3:4 <<'TUTOR_END_OF_EDIT'\n    return a + b\nTUTOR_END_OF_EDIT"
        );
        let c = prepare_command("edit 1:1\nTUTOR_END_OF_EDIT\nend_of_edit\n");
        assert!(c.starts_with("edit 1:1 <<'TUTOR_END_OF_EDIT_'\n"), "{c}");
        // Not an edit, or already a here-document: unchanged.
        for s in [
            "ls",
            "edit 3:4 <<'EOF'\nx\nEOF",
            "edit a:b\nx\nend_of_edit",
            "echo edit 1:2\nend_of_edit",
        ] {
            assert_eq!(prepare_command(s), s);
        }
    }

    #[test]
    fn every_tool_has_a_shim() {
        let files = tool_files("/tmp/.tutor/bin");
        assert_eq!(files.len(), TOOL_NAMES.len() + 1);
        for name in TOOL_NAMES {
            assert!(TOOLS_DOC.contains(name), "{name} undocumented");
            let (_, body) = files.iter().find(|(n, _)| n == name).unwrap();
            assert!(body.contains(&format!("tutor_tools.py {name} ")), "{body}");
        }
    }
}
