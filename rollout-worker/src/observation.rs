//! Observation text shown to the model after each command: head+tail truncated output,
//! exit status / timeout notice, and the SWE-agent style prompt footer.

/// Keeps the first and last halves of `s` (by characters) when it is longer than
/// `max_chars`, with a marker saying how much was elided in between. The kept text is at
/// most `max_chars` characters; the marker comes on top. Never splits a UTF-8 character.
pub fn truncate_head_tail(s: &str, max_chars: usize) -> String {
    let total = s.chars().count();
    if total <= max_chars {
        return s.to_string();
    }
    let head = max_chars / 2;
    let tail = max_chars - head;
    let elided = total - head - tail;
    // Byte offsets of the head end and the tail start, found by character index.
    let head_end = s.char_indices().nth(head).map_or(s.len(), |(i, _)| i);
    let tail_start = s
        .char_indices()
        .nth(total - tail)
        .map_or(s.len(), |(i, _)| i);
    format!(
        "{}\n<... {elided} characters elided ...>\n{}",
        &s[..head_end],
        &s[tail_start..]
    )
}

/// Renders one observation: the command output (truncated to `max_chars`), a note when the
/// command timed out or failed, and the footer
/// `(Current directory: D, current file: F) bash-$`.
pub fn format_observation(
    output: &str,
    exit_code: i32,
    timed_out: bool,
    cwd: &str,
    current_file: Option<&str>,
    max_chars: usize,
) -> String {
    let mut out = String::new();
    let body = without_object_addresses(&without_test_durations(output)).into_owned();
    let body = truncate_head_tail(&body, max_chars);
    if body.trim().is_empty() {
        if !timed_out && exit_code == 0 {
            out.push_str("Your command ran successfully and did not produce any output.\n");
        }
    } else {
        out.push_str(&body);
        if !body.ends_with('\n') {
            out.push('\n');
        }
    }
    if timed_out {
        out.push_str(
            "The command timed out and was killed (with all processes it started). Avoid \
             interactive or long-running commands; run something quicker or in smaller steps.\n",
        );
    } else if exit_code != 0 {
        out.push_str(&format!("(exit code {exit_code})\n"));
    }
    out.push_str(&format!(
        "(Current directory: {cwd}, current file: {}) bash-$",
        current_file.unwrap_or("none")
    ));
    out
}

/// `output` with the address in Python's default reprs spelled `0x…`
/// (`<range_iterator object at 0x7fbc240a0db0>` → `<range_iterator object at 0x…>`): it
/// changes from run to run (ASLR), tells the model nothing, and made two runs of one seed
/// part when a failing test printed one. Only ` at 0x` + at least 6 hex digits + `>`.
pub fn without_object_addresses(output: &str) -> std::borrow::Cow<'_, str> {
    const MARK: &str = " at 0x";
    if !output.contains(MARK) {
        return std::borrow::Cow::Borrowed(output);
    }
    let mut out = String::with_capacity(output.len());
    let mut rest = output;
    while let Some(at) = rest.find(MARK) {
        let after = &rest[at + MARK.len()..];
        let digits = after.bytes().take_while(|b| b.is_ascii_hexdigit()).count();
        out.push_str(&rest[..at + MARK.len()]);
        if digits >= 6 && after[digits..].starts_with('>') {
            out.push('…');
            rest = &after[digits..];
        } else {
            rest = after;
        }
    }
    out.push_str(rest);
    std::borrow::Cow::Owned(out)
}

/// `output` with the duration taken off pytest's summary lines (`3 passed in 0.12s` →
/// `3 passed`; a centred line `=== 1 failed, 2 passed in 61.20s (0:01:01) ===` becomes
/// `===== 1 failed, 2 passed =====`). The model learns nothing from how fast the machine
/// was, and without it an episode's text, and so a seeded run, is the same on every run.
pub fn without_test_durations(output: &str) -> std::borrow::Cow<'_, str> {
    if !output.contains(" in ") {
        return output.into();
    }
    let mut out = String::with_capacity(output.len());
    for line in output.split_inclusive('\n') {
        match strip_duration(line) {
            Some(l) => out.push_str(&l),
            None => out.push_str(line),
        }
    }
    out.into()
}

/// One summary line without its duration, or None when `line` is not one.
fn strip_duration(line: &str) -> Option<String> {
    let (content, newline) = match line.strip_suffix('\n') {
        Some(c) => {
            let content = c.strip_suffix('\r').unwrap_or(c);
            (content, &line[content.len()..])
        }
        None => (line, ""),
    };
    let at = content.rfind(" in ")?;
    let (head, rest) = (&content[..at], &content[at + 4..]);
    // The counts: `N word, N word` or `no tests ran`, after an optional `=== `.
    let counts = head.trim_start_matches('=').trim_start();
    let counts_ok = counts == "no tests ran"
        || (!counts.is_empty()
            && counts.split(", ").all(|part| {
                part.split_once(' ').is_some_and(|(n, word)| {
                    !n.is_empty()
                        && n.bytes().all(|b| b.is_ascii_digit())
                        && PYTEST_OUTCOMES.contains(&word)
                })
            }));
    if !counts_ok {
        return None;
    }
    // The duration: `0.12s`, optionally ` (0:01:01)`, then optionally ` ===`.
    let digits = rest
        .bytes()
        .take_while(|b| b.is_ascii_digit() || *b == b'.')
        .count();
    if digits == 0 || !rest[digits..].starts_with('s') {
        return None;
    }
    let mut tail = &rest[digits + 1..];
    if let Some(t) = tail.strip_prefix(" (") {
        let close = t.find(')')?;
        if !t[..close].bytes().all(|b| b.is_ascii_digit() || b == b':') {
            return None;
        }
        tail = &t[close + 1..];
    }
    let equals = tail.trim();
    if !equals.bytes().all(|b| b == b'=') {
        return None;
    }
    // Without -q pytest centres the line in `=`, so the runs' lengths depend on the
    // duration's: a fixed run on each side instead.
    if head.starts_with('=') || !equals.is_empty() {
        return Some(format!("===== {counts} ====={newline}"));
    }
    Some(format!("{head}{newline}"))
}

/// The words of pytest's summary line (`3 passed, 1 warning`).
const PYTEST_OUTCOMES: &[&str] = &[
    "passed",
    "failed",
    "error",
    "errors",
    "skipped",
    "xfailed",
    "xpassed",
    "warning",
    "warnings",
    "deselected",
    "rerun",
    "selected",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_text_is_unchanged() {
        assert_eq!(truncate_head_tail("hello", 5), "hello");
        assert_eq!(truncate_head_tail("", 0), "");
    }

    #[test]
    fn long_text_keeps_head_and_tail() {
        let s: String = (0..100)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        let t = truncate_head_tail(&s, 10);
        assert!(t.starts_with(&s[..5]));
        assert!(t.ends_with(&s[95..]));
        assert!(t.contains("<... 90 characters elided ...>"));
    }

    #[test]
    fn multibyte_characters_are_never_split() {
        let s = "é🦀".repeat(50);
        for max in 0..30 {
            let t = truncate_head_tail(&s, max);
            let kept = t.chars().filter(|c| *c == 'é' || *c == '🦀').count();
            assert_eq!(kept, max);
        }
    }

    #[test]
    fn footer_and_status_lines() {
        let o = format_observation("out", 0, false, "~/repo", None, 100);
        assert_eq!(
            o,
            "out\n(Current directory: ~/repo, current file: none) bash-$"
        );
        let o = format_observation("", 2, false, "~/repo/tests", Some("a.py"), 100);
        assert!(o.contains("(exit code 2)"));
        assert!(o.ends_with("(Current directory: ~/repo/tests, current file: a.py) bash-$"));
        let o = format_observation("partial", 124, true, "~/repo", None, 100);
        assert!(o.contains("timed out"));
        assert!(!o.contains("exit code"));
        let o = format_observation("", 0, false, "~/repo", None, 100);
        assert!(o.contains("did not produce any output"));
        let big = "x".repeat(1000);
        let o = format_observation(&big, 0, false, "~/repo", None, 100);
        assert!(o.contains("900 characters elided"));
    }

    #[test]
    fn pytest_summary_lines_lose_their_duration_and_nothing_else_changes() {
        let cases = [
            ("1 passed in 0.01s\n", "1 passed\n"),
            (
                "2 failed, 3 passed, 1 error in 12.34s",
                "2 failed, 3 passed, 1 error",
            ),
            (
                "===== 1 failed, 2 passed in 61.20s (0:01:01) =====\r\n",
                "===== 1 failed, 2 passed =====\r\n",
            ),
            // Centred in `=` runs whose length depends on the duration's: fixed runs.
            (
                "=================== 3 passed, 1 warning in 10.01s ===================\n",
                "===== 3 passed, 1 warning =====\n",
            ),
            ("no tests ran in 0.00s\n", "no tests ran\n"),
            (
                "F.\n=== FAILURES ===\nassert 3 == 4\n1 failed, 1 passed in 0.05s\n(x)",
                "F.\n=== FAILURES ===\nassert 3 == 4\n1 failed, 1 passed\n(x)",
            ),
        ];
        for (output, want) in cases {
            assert_eq!(without_test_durations(output), want, "{output:?}");
        }
        // Lines that only look alike keep their text.
        for output in [
            "print('1 passed in 0.01s')",
            "the bug is in 2.5s of code",
            "1 passed in 0.01s because",
            "1 Passed in 0.01s",
            "1 passed in s",
            "loaded 3 files in 0.2s (fast)",
            "3 files in 2s",
            "",
        ] {
            assert_eq!(without_test_durations(output), output, "{output:?}");
        }
        let obs = format_observation("1 passed in 0.31s\n", 0, false, "~/repo", None, 100);
        assert!(obs.starts_with("1 passed\n"), "{obs}");
    }

    #[test]
    fn object_addresses_in_reprs_are_spelled_alike() {
        let cases = [
            (
                ".0 = <range_iterator object at 0x7fbc240a0db0>\n",
                ".0 = <range_iterator object at 0x…>\n",
            ),
            (
                "[<Foo at 0x7f0001>, <function f at 0x55d1e2a3b4c0>]",
                "[<Foo at 0x…>, <function f at 0x…>]",
            ),
        ];
        for (output, want) in cases {
            assert_eq!(without_object_addresses(output), want);
        }
        // Hex that is not a repr's address keeps its text.
        for output in [
            "mask = 0xff",
            "jump at 0x7fbc240a0db0 failed",
            "<x at 0x1f>",
            "at 0x7fbc240a0db0>",
            "",
        ] {
            assert_eq!(without_object_addresses(output), output, "{output:?}");
        }
        let obs = format_observation("<A object at 0x7f3a2b1c>\n", 1, false, "~", None, 100);
        assert!(obs.starts_with("<A object at 0x…>\n"), "{obs}");
    }
}
