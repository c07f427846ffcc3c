//! Parsing a model reply into an action: free-text reasoning plus exactly one fenced
//! block opened with ```` ```command ````; anything else is a format error whose message
//! is shown to the model as the observation.

/// What the agent asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// End the episode; the submission is the working tree's diff.
    Submit,
    /// Run this text with bash in the sandbox.
    Shell(String),
}

const FORMAT_HELP: &str =
    "Every reply must contain a short reasoning part followed by exactly one fenced \
code block opened with ```command on its own line and closed with ``` on its own line, for example:

I will look at the files in the repository.
```command
ls -la
```

When you are done, reply with a command block that contains only `submit`.";

/// A reply that does not follow the action format. `Display` is the observation text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error(
        "Format error: your reply has no ```command block, so nothing was run.\n{FORMAT_HELP}"
    )]
    NoCommandBlock,
    #[error("Format error: your reply has {0} ```command blocks, but exactly one is allowed per reply, so nothing was run. Put a single command (you may chain commands with &&) in one block.\n{FORMAT_HELP}")]
    MultipleCommandBlocks(usize),
    #[error("Format error: your ```command block is empty, so nothing was run.\n{FORMAT_HELP}")]
    EmptyCommand,
    #[error("Format error: your ```command block is never closed (a line with only ``` must end it), so nothing was run.\n{FORMAT_HELP}")]
    UnclosedBlock,
}

/// A fence line: returns its backtick count and the info string after the backticks.
fn fence(line: &str) -> Option<(usize, &str)> {
    let t = line.trim();
    let n = t.bytes().take_while(|&b| b == b'`').count();
    if n < 3 {
        return None;
    }
    // Backticks are ASCII, so `n` is a char boundary.
    Some((n, t[n..].trim()))
}

/// True if `line` closes a fence opened with `open_len` backticks (CommonMark: at least as
/// many backticks, nothing else).
fn closes(line: &str, open_len: usize) -> bool {
    matches!(fence(line), Some((n, "")) if n >= open_len)
}

/// Parses a model reply. Other fenced blocks (```python …) are skipped as a unit, so a
/// ```command line quoted inside them does not count. Never panics.
pub fn parse_action(text: &str) -> Result<Action, FormatError> {
    let lines: Vec<&str> = text
        .split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .collect();
    // suffix_close[j] = longest pure closing fence at or after line j, so that looking
    // for a closer is O(1) when none exists (keeps pathological inputs linear).
    let mut suffix_close = vec![0usize; lines.len() + 1];
    for j in (0..lines.len()).rev() {
        let here = match fence(lines[j]) {
            Some((n, "")) => n,
            _ => 0,
        };
        suffix_close[j] = suffix_close[j + 1].max(here);
    }
    let mut blocks: Vec<String> = Vec::new();
    let mut unclosed = false;
    let mut i = 0;
    while i < lines.len() {
        let Some((n, info)) = fence(lines[i]) else {
            i += 1;
            continue;
        };
        // `command`, optionally followed by text on the same line.
        let after = info
            .strip_prefix("command")
            .filter(|r| r.is_empty() || r.starts_with(char::is_whitespace) || r.starts_with('`'));
        let first = after.map(str::trim).unwrap_or("");
        if after.is_some() {
            if let Some(body) = first.strip_suffix("```") {
                // One-line form: ```command ls -la```
                blocks.push(body.trim_end_matches('`').to_string());
                i += 1;
                continue;
            }
        }
        let close = if suffix_close[i + 1] >= n {
            (i + 1..lines.len()).find(|&j| closes(lines[j], n))
        } else {
            None
        };
        match close {
            Some(j) => {
                if after.is_some() {
                    let mut body: Vec<&str> = Vec::with_capacity(j - i);
                    if !first.is_empty() {
                        body.push(first);
                    }
                    body.extend_from_slice(&lines[i + 1..j]);
                    blocks.push(body.join("\n"));
                }
                i = j + 1;
            }
            None => {
                if after.is_some() {
                    unclosed = true;
                    break;
                }
                // An unclosed non-command fence: treat it as prose and keep scanning.
                i += 1;
            }
        }
    }
    let count = blocks.len() + usize::from(unclosed);
    if count > 1 {
        return Err(FormatError::MultipleCommandBlocks(count));
    }
    if unclosed {
        return Err(FormatError::UnclosedBlock);
    }
    let Some(body) = blocks.pop() else {
        return Err(FormatError::NoCommandBlock);
    };
    let body = body.trim();
    if body.is_empty() {
        return Err(FormatError::EmptyCommand);
    }
    if body == "submit" {
        return Ok(Action::Submit);
    }
    Ok(Action::Shell(body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn one_block_is_a_shell_command() {
        let a = parse_action("I will list files.\n```command\nls -la\n```\n").unwrap();
        assert_eq!(a, Action::Shell("ls -la".into()));
        let a = parse_action("```command\n  cd src &&\n  grep -n x *.py  \n```").unwrap();
        assert_eq!(a, Action::Shell("cd src &&\n  grep -n x *.py".into()));
        let a = parse_action("Windows.\r\n```command\r\npwd\r\n```\r\n").unwrap();
        assert_eq!(a, Action::Shell("pwd".into()));
    }

    #[test]
    fn submit_alone_submits() {
        assert_eq!(
            parse_action("Done.\n```command\nsubmit\n```").unwrap(),
            Action::Submit
        );
        assert_eq!(
            parse_action("```command\n  submit \n```").unwrap(),
            Action::Submit
        );
        assert_eq!(
            parse_action("```command\nsubmit now\n```").unwrap(),
            Action::Shell("submit now".into())
        );
    }

    #[test]
    fn format_errors() {
        assert_eq!(parse_action(""), Err(FormatError::NoCommandBlock));
        assert_eq!(parse_action("just talk"), Err(FormatError::NoCommandBlock));
        assert_eq!(
            parse_action("```bash\nls\n```"),
            Err(FormatError::NoCommandBlock)
        );
        assert_eq!(
            parse_action("```command\nls\n```\n```command\npwd\n```"),
            Err(FormatError::MultipleCommandBlocks(2))
        );
        assert_eq!(
            parse_action("```command\n\n  \n```"),
            Err(FormatError::EmptyCommand)
        );
        assert_eq!(
            parse_action("```command\nls\n"),
            Err(FormatError::UnclosedBlock)
        );
        assert_eq!(
            parse_action("```command\nls\n```\n```command\npwd"),
            Err(FormatError::MultipleCommandBlocks(2))
        );
    }

    #[test]
    fn command_fence_inside_other_block_is_ignored() {
        let text = "Example:\n```text\n```command\nrm -rf /\n```\nNow:\n```command\nls\n```";
        // The ```text block runs to the first bare ``` line, so the quoted ```command
        // line inside it does not count.
        assert_eq!(parse_action(text).unwrap(), Action::Shell("ls".into()));
        let text = "````md\n```command\nrm -rf /\n```\n````\n```command\nls\n```";
        assert_eq!(parse_action(text).unwrap(), Action::Shell("ls".into()));
    }

    #[test]
    fn one_line_form_and_long_fences() {
        assert_eq!(
            parse_action("```command ls -la```").unwrap(),
            Action::Shell("ls -la".into())
        );
        assert_eq!(
            parse_action("````command\necho '```'\n````").unwrap(),
            Action::Shell("echo '```'".into())
        );
        assert_eq!(
            parse_action("```command```"),
            Err(FormatError::EmptyCommand)
        );
        assert_eq!(
            parse_action("```command ls\n```").unwrap(),
            Action::Shell("ls".into())
        );
        let many_open = "```python\n".repeat(50_000);
        assert_eq!(parse_action(&many_open), Err(FormatError::NoCommandBlock));
    }

    #[test]
    fn error_messages_explain_the_format() {
        for e in [
            FormatError::NoCommandBlock,
            FormatError::MultipleCommandBlocks(3),
            FormatError::EmptyCommand,
            FormatError::UnclosedBlock,
        ] {
            let s = e.to_string();
            assert!(s.contains("```command"), "{s}");
            assert!(s.contains("submit"), "{s}");
        }
        assert!(FormatError::MultipleCommandBlocks(3)
            .to_string()
            .contains('3'));
    }

    #[test]
    fn random_inputs_never_panic() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1234);
        let atoms = [
            "```",
            "`",
            "``",
            "````",
            "command",
            "submit",
            "\n",
            "\r\n",
            " ",
            "ls",
            "é",
            "🦀",
            "\u{0}",
            "\u{FFFD}",
            "```command",
            "```command\n",
            "\n```\n",
            "\t",
        ];
        for _ in 0..20_000 {
            let n = rng.gen_range(0..40);
            let mut s = String::new();
            for _ in 0..n {
                if rng.gen_bool(0.8) {
                    s.push_str(atoms[rng.gen_range(0..atoms.len())]);
                } else {
                    s.push(char::from_u32(rng.gen_range(0..0x11000)).unwrap_or('x'));
                }
            }
            let _ = parse_action(&s);
        }
        // Huge input.
        let huge = "```command\n".to_string() + &"x".repeat(5_000_000) + "\n```";
        assert!(matches!(parse_action(&huge), Ok(Action::Shell(_))));
        let many = "```command\nls\n```\n".repeat(10_000);
        assert_eq!(
            parse_action(&many),
            Err(FormatError::MultipleCommandBlocks(10_000))
        );
    }
}
