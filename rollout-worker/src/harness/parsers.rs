//! The SWE-bench harness's log parsers, one per repository family, with the harness's
//! exact semantics: the same lines count, the same test names come out (spaces cut at
//! the same places, the same quirks), and a later line about a test overrides an
//! earlier one. FAIL_TO_PASS and PASS_TO_PASS lists in the datasets were made by these
//! parsers, so a name spelled any other way would never match.
//!
//! Written from the harness's published parsers (swebench/harness/log_parsers/python.py);
//! the unit tests below pin each one on excerpts of real logs in its format.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use regex::Regex;

/// The statuses a harness parser reports (`TestStatus` in the harness). `XPASS` is not
/// one of them: a line starting with it is not a test result to the harness.
pub const HARNESS_STATUSES: [&str; 5] = ["FAILED", "PASSED", "SKIPPED", "ERROR", "XFAIL"];

/// Which of the harness's parsers reads a repository's test log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogParser {
    /// pytest `-rA` summary lines (`parse_log_pytest`): flask, xarray, astroid, pytest,
    /// marshmallow, pvlib, pyvista, sqlfluff.
    Pytest,
    /// pytest with parametrize ids shortened (`parse_log_pytest_options`): requests,
    /// pylint, pydicom.
    PytestOptions,
    /// pytest, colour codes stripped and old `name STATUS` lines read too
    /// (`parse_log_pytest_v2`): astropy, scikit-learn, sphinx.
    PytestV2,
    /// Django's test runner at verbosity 2 (`test_x (module.Class) ... ok`).
    Django,
    /// seaborn's pytest output.
    Seaborn,
    /// sympy's `bin/test` (`test_name ok` / `F` / `E`, failure headers).
    Sympy,
    /// pytest, with matplotlib's `MouseButton` ids spelled as numbers.
    Matplotlib,
    /// SWE-Gym's pydantic parser (`parse_log_pytest_pydantic`): colour codes and control
    /// characters stripped, `FAILED [..]` read as `FAILED`, `NAME STATUS` lines read too
    /// (the name the first word, the status the second).
    PytestPydantic,
}

impl LogParser {
    /// Every parser.
    pub const ALL: [LogParser; 8] = [
        LogParser::Pytest,
        LogParser::PytestOptions,
        LogParser::PytestV2,
        LogParser::Django,
        LogParser::Seaborn,
        LogParser::Sympy,
        LogParser::Matplotlib,
        LogParser::PytestPydantic,
    ];

    /// The harness's name for the parser (as in its `MAP_REPO_TO_PARSER`).
    pub fn name(self) -> &'static str {
        match self {
            LogParser::Pytest => "pytest",
            LogParser::PytestOptions => "pytest_options",
            LogParser::PytestV2 => "pytest_v2",
            LogParser::Django => "django",
            LogParser::Seaborn => "seaborn",
            LogParser::Sympy => "sympy",
            LogParser::Matplotlib => "matplotlib",
            LogParser::PytestPydantic => "pytest_pydantic",
        }
    }

    /// [`LogParser::parse`], or the error where the harness's parser raises and reports
    /// nothing for the instance: Django's on a `FAIL:` or `ERROR:` line with no test name
    /// after it (`line.split()[1]`), such as a bare `FAIL:` or `ERROR:root:boom` from
    /// Python's logging.
    pub fn parse_checked(self, log: &str) -> Result<BTreeMap<String, String>, String> {
        if self == LogParser::Django {
            let bad = log.split('\n').map(py_strip).find(|line| {
                (line.starts_with("FAIL:") || line.starts_with("ERROR:"))
                    && py_split(line).len() < 2
            });
            if let Some(line) = bad {
                return Err(format!(
                    "the harness's django log parser fails on the line {line:?} (a FAIL:/ERROR: \
                     line with no test name) and reports nothing for the instance"
                ));
            }
        }
        if self == LogParser::PytestPydantic {
            // The fork indexes the second word without a length check.
            let bad = log.split('\n').map(pydantic_clean).find(|line| {
                if starts_with_status(line) {
                    let line = if line.starts_with("FAILED") {
                        line.replace(" - ", " ")
                    } else {
                        line.clone()
                    };
                    py_split(&line).len() < 2
                } else {
                    HARNESS_STATUSES.iter().any(|s| line.ends_with(s)) && py_split(line).len() < 2
                }
            });
            if let Some(line) = bad {
                return Err(format!(
                    "the harness's pytest_pydantic log parser fails on the line {line:?} (a \
                     status with no test name) and reports nothing for the instance"
                ));
            }
        }
        Ok(self.parse(log))
    }

    /// Test name → status, as the harness reads `log` (the part between its start and
    /// end markers).
    pub fn parse(self, log: &str) -> BTreeMap<String, String> {
        match self {
            LogParser::Pytest => parse_pytest(log),
            LogParser::PytestOptions => parse_pytest_options(log),
            LogParser::PytestV2 => parse_pytest_v2(log),
            LogParser::Django => parse_django(log),
            LogParser::Seaborn => parse_seaborn(log),
            LogParser::Sympy => parse_sympy(log),
            LogParser::Matplotlib => parse_matplotlib(log),
            LogParser::PytestPydantic => parse_pytest_pydantic(log),
        }
    }
}

/// Python's `str.isspace` set as `str.split()` uses it: Unicode whitespace plus the
/// information separators 0x1c–0x1f.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.split()` (no argument).
fn py_split(s: &str) -> Vec<&str> {
    s.split(py_space).filter(|t| !t.is_empty()).collect()
}

/// Python's `str.strip()` (no argument).
fn py_strip(s: &str) -> &str {
    s.trim_matches(py_space)
}

fn starts_with_status(line: &str) -> bool {
    HARNESS_STATUSES.iter().any(|s| line.starts_with(s))
}

/// pytest's `SKIPPED [N] path:line: reason` summary, where `[N]` is a count, not a test
/// (the harness's `^\[\d+\]$`, Unicode digits included).
fn is_skip_summary(status: &str, name: &str) -> bool {
    static COUNT: OnceLock<Regex> = OnceLock::new();
    status == "SKIPPED"
        && COUNT
            .get_or_init(|| Regex::new(r"^\[\d+\]$").expect("count pattern"))
            .is_match(name)
}

/// The common pytest line rule: a line starting with a status; for `FAILED`, every
/// ` - ` becomes a space (so the message's first word never joins the name); the second
/// word is the test.
fn pytest_line(line: &str) -> Option<(String, String)> {
    if !starts_with_status(line) {
        return None;
    }
    let owned;
    let line = if line.starts_with("FAILED") {
        owned = line.replace(" - ", " ");
        owned.as_str()
    } else {
        line
    };
    let words = py_split(line);
    if words.len() <= 1 || is_skip_summary(words[0], words[1]) {
        return None;
    }
    Some((words[1].to_string(), words[0].to_string()))
}

fn parse_pytest(log: &str) -> BTreeMap<String, String> {
    log.split('\n').filter_map(pytest_line).collect()
}

fn parse_matplotlib(log: &str) -> BTreeMap<String, String> {
    log.split('\n')
        .filter_map(|line| {
            let line = line
                .replace("MouseButton.LEFT", "1")
                .replace("MouseButton.RIGHT", "3");
            pytest_line(&line)
        })
        .collect()
}

/// `parse_log_pytest_options`: a name with a parametrize id keeps the text before its
/// first `[` and the id up to the last `]`; an id that is a path (`/a/b/c`, not `//`,
/// no `*`) is shortened to its last component (`/c`), since the paths were the
/// dataset maker's machine's.
fn parse_pytest_options(log: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in log.split('\n') {
        let Some((name, status)) = pytest_line(line) else {
            continue;
        };
        let name = match (name.find('['), name.rfind(']')) {
            (Some(open), Some(close)) if close > open => {
                let main = &name[..open];
                let mut option = &name[open + 1..close];
                let short;
                if option.starts_with('/') && !option.starts_with("//") && !option.contains('*') {
                    short = format!("/{}", option.rsplit('/').next().unwrap_or(""));
                    option = &short;
                }
                format!("{main}[{option}]")
            }
            _ => name,
        };
        out.insert(name, status);
    }
    out
}

/// `parse_log_pytest_v2`: `[NNm` colour codes and control characters are removed first;
/// a `FAILED` line loses everything from its first ` - `; the name is every word after
/// the status joined by one space (so names with spaces survive, whitespace collapsed).
/// Lines that end with a status (`name PASSED`, pytest's older verbose style) count too.
fn parse_pytest_v2(log: &str) -> BTreeMap<String, String> {
    static COLOUR: OnceLock<Regex> = OnceLock::new();
    let colour = COLOUR.get_or_init(|| Regex::new(r"\[(\d+)m").expect("colour pattern"));
    let mut out = BTreeMap::new();
    for line in log.split('\n') {
        let line = colour.replace_all(line, "");
        let line: String = line
            .chars()
            .filter(|&c| !('\u{1}'..='\u{1f}').contains(&c))
            .collect();
        if starts_with_status(&line) {
            let line = if line.starts_with("FAILED") {
                line.split(" - ").next().unwrap_or("")
            } else {
                &line
            };
            let words = py_split(line);
            if words.len() >= 2 && !is_skip_summary(words[0], words[1]) {
                out.insert(words[1..].join(" "), words[0].to_string());
            }
        } else if HARNESS_STATUSES.iter().any(|s| line.ends_with(s)) {
            let words = py_split(&line);
            if words.len() >= 2 {
                let (status, name) = words.split_last().expect("two words");
                out.insert(name.join(" "), status.to_string());
            }
        }
    }
    out
}

/// A line as SWE-Gym's pydantic parser sees it: `[NNm` colour codes and the control
/// characters 0x01–0x1f removed, then `FAILED [...]` (pytest's progress percentage)
/// shortened to `FAILED`.
fn pydantic_clean(line: &str) -> String {
    static COLOUR: OnceLock<Regex> = OnceLock::new();
    static FAILED: OnceLock<Regex> = OnceLock::new();
    let colour = COLOUR.get_or_init(|| Regex::new(r"\[(\d+)m").expect("colour pattern"));
    let failed = FAILED.get_or_init(|| Regex::new(r"FAILED\s*\[.*?\]").expect("failed pattern"));
    let line = colour.replace_all(line, "");
    let line: String = line
        .chars()
        .filter(|&c| !('\u{1}'..='\u{1f}').contains(&c))
        .collect();
    failed.replace_all(&line, "FAILED").into_owned()
}

/// SWE-Gym's `parse_log_pytest_pydantic`. Lines with a status and no second word make
/// the fork's parser raise ([`LogParser::parse_checked`] says so); here they are skipped.
fn parse_pytest_pydantic(log: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in log.split('\n') {
        let line = pydantic_clean(line);
        if starts_with_status(&line) {
            let line = if line.starts_with("FAILED") {
                line.replace(" - ", " ")
            } else {
                line
            };
            let words = py_split(&line);
            if words.len() >= 2 {
                out.insert(words[1].to_string(), words[0].to_string());
            }
        } else if HARNESS_STATUSES.iter().any(|s| line.ends_with(s)) {
            let words = py_split(&line);
            if words.len() >= 2 {
                out.insert(words[0].to_string(), words[1].to_string());
            }
        }
    }
    out
}

fn parse_seaborn(log: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in log.split('\n') {
        let parts = py_split(line);
        if parts.len() < 2 {
            continue;
        }
        if line.starts_with("FAILED") {
            out.insert(parts[1].to_string(), "FAILED".to_string());
        } else if line.contains(" PASSED ") {
            if parts[1] == "PASSED" {
                out.insert(parts[0].to_string(), "PASSED".to_string());
            }
        } else if line.starts_with("PASSED") {
            out.insert(parts[1].to_string(), "PASSED".to_string());
        }
    }
    out
}

/// sympy's `bin/test -C --verbose`: failure headers (`____ path.py:test_x ____`) mark
/// failures; then `test_x ok` / `test_x F` / `test_x E` lines, which win.
fn parse_sympy(log: &str) -> BTreeMap<String, String> {
    static HEADER: OnceLock<Regex> = OnceLock::new();
    let header =
        HEADER.get_or_init(|| Regex::new(r"(_*) (.*)\.py:(.*) (_*)").expect("sympy pattern"));
    let mut out = BTreeMap::new();
    for caps in header.captures_iter(log) {
        out.insert(
            format!("{}.py:{}", &caps[2], &caps[3]),
            "FAILED".to_string(),
        );
    }
    for line in log.split('\n') {
        let line = py_strip(line);
        if !line.starts_with("test_") {
            continue;
        }
        let first = || py_split(line)[0].to_string();
        if line.ends_with(" E") {
            out.insert(first(), "ERROR".to_string());
        }
        if line.ends_with(" F") {
            out.insert(first(), "FAILED".to_string());
        }
        if line.ends_with(" ok") {
            out.insert(first(), "PASSED".to_string());
        }
    }
    out
}

/// Django's runner at `--verbosity 2`: `name ... ok|FAIL|ERROR|skipped '…'`, `FAIL:` and
/// `ERROR:` headers, an `ok` on a later line after output the test printed, and three
/// known interleavings of Django's own prints with a result.
fn parse_django(log: &str) -> BTreeMap<String, String> {
    const VERSION_TEST: &str = "--version is equivalent to version";
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    let set = |out: &mut BTreeMap<String, String>, test: &str, status: &str| {
        out.insert(test.to_string(), status.to_string());
    };
    let mut prev_test: Option<String> = None;
    for raw in log.split('\n') {
        let mut line = py_strip(raw).to_string();
        if line.contains(VERSION_TEST) {
            set(&mut out, VERSION_TEST, "PASSED");
        }
        if let Some((before, _)) = line.split_once(" ... ") {
            prev_test = Some(before.to_string());
        }
        for suffix in [" ... ok", " ... OK", " ...  OK"] {
            if line.ends_with(suffix) {
                // The harness's fix for django__django-7188: a migration's print and the
                // test's name on one line.
                if py_strip(&line)
                    .starts_with("Applying sites.0002_alter_domain_unique...test_no_migrations")
                {
                    line = py_strip(line.split_once("...").map_or("", |(_, r)| r)).to_string();
                }
                let test = line.rsplit_once(suffix).map_or(line.as_str(), |(t, _)| t);
                set(&mut out, test, "PASSED");
                break;
            }
        }
        if let Some((test, _)) = line.split_once(" ... skipped") {
            set(&mut out, test, "SKIPPED");
        }
        if line.ends_with(" ... FAIL") {
            let test = line.split_once(" ... FAIL").map_or("", |(t, _)| t);
            set(&mut out, test, "FAILED");
        }
        if line.starts_with("FAIL:") {
            if let Some(test) = py_split(&line).get(1) {
                set(&mut out, py_strip(test), "FAILED");
            }
        }
        if line.ends_with(" ... ERROR") {
            let test = line.split_once(" ... ERROR").map_or("", |(t, _)| t);
            set(&mut out, test, "ERROR");
        }
        if line.starts_with("ERROR:") {
            if let Some(test) = py_split(&line).get(1) {
                set(&mut out, py_strip(test), "ERROR");
            }
        }
        if line.trim_start_matches(py_space).starts_with("ok") {
            if let Some(test) = &prev_test {
                set(&mut out, test, "PASSED");
            }
        }
    }
    static INTERLEAVED: OnceLock<[Regex; 3]> = OnceLock::new();
    let patterns = INTERLEAVED.get_or_init(|| {
        [
            // Python's `\s` (str patterns) also matches 0x1c-0x1f; Rust's does not.
            r"(?m)^(.*?)[\s\x1c-\x1f]\.\.\.[\s\x1c-\x1f]Testing against Django installed in ((?s:.*?)) silenced\)\.\nok$",
            r"(?m)^(.*?)[\s\x1c-\x1f]\.\.\.[\s\x1c-\x1f]Internal Server Error: /(.*)/\nok$",
            r"(?m)^(.*?)[\s\x1c-\x1f]\.\.\.[\s\x1c-\x1f]System check identified no issues \(0 silenced\)\nok$",
        ]
        .map(|p| Regex::new(p).expect("django pattern"))
    });
    for pattern in patterns {
        for caps in pattern.captures_iter(log) {
            set(&mut out, &caps[1], "PASSED");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get<'a>(m: &'a BTreeMap<String, String>, k: &str) -> Option<&'a str> {
        m.get(k).map(String::as_str)
    }

    /// A pytest `-rA` log with a crash, a collection error, parametrize ids with spaces,
    /// brackets and `::`, an XPASS (not a harness status) and the SKIPPED count form.
    const PYTEST_LOG: &str = "\
============================= test session starts ==============================
collected 7 items / 1 error

tests/test_a.py ..F.x                                                    [100%]
==================================== ERRORS ====================================
______________________ ERROR collecting tests/test_b.py _______________________
E   SyntaxError: invalid syntax
=========================== short test summary info ============================
PASSED tests/test_a.py::test_ok
PASSED tests/test_a.py::TestK::test_method
PASSED tests/test_a.py::test_param[a b]
PASSED tests/test_a.py::test_param[x::y]
XFAIL tests/test_a.py::test_xfail - reason
XPASS tests/test_a.py::test_xpass
SKIPPED [1] tests/test_a.py:8: no network
FAILED tests/test_a.py::test_boom - AssertionError: assert 1 == 2
FAILED tests/test_a.py::test_dash[c - d] - ValueError
ERROR tests/test_b.py - SyntaxError: invalid syntax
Fatal Python error: Segmentation fault
!!!!!!!!!!!!!!!!!!!! Interrupted: 1 error during collection !!!!!!!!!!!!!!!!!!!!
";

    #[test]
    fn pytest_names_are_cut_where_the_harness_cuts_them() {
        let m = LogParser::Pytest.parse(PYTEST_LOG);
        assert_eq!(get(&m, "tests/test_a.py::test_ok"), Some("PASSED"));
        assert_eq!(
            get(&m, "tests/test_a.py::TestK::test_method"),
            Some("PASSED")
        );
        // A space in a parametrize id cuts the name: the datasets spell it so too.
        assert_eq!(get(&m, "tests/test_a.py::test_param[a"), Some("PASSED"));
        assert_eq!(get(&m, "tests/test_a.py::test_param[x::y]"), Some("PASSED"));
        assert_eq!(get(&m, "tests/test_a.py::test_xfail"), Some("XFAIL"));
        assert_eq!(
            get(&m, "tests/test_a.py::test_xpass"),
            None,
            "XPASS is no status"
        );
        assert_eq!(get(&m, "tests/test_a.py::test_boom"), Some("FAILED"));
        // " - " inside the id became a space before the split.
        assert_eq!(get(&m, "tests/test_a.py::test_dash[c"), Some("FAILED"));
        assert_eq!(
            get(&m, "tests/test_b.py"),
            Some("ERROR"),
            "a collection error"
        );
        assert!(
            !m.keys().any(|k| k.starts_with('[')),
            "SKIPPED [1] is a count"
        );
        // "Fatal Python error" starts with no status; the crash adds nothing.
        assert_eq!(m.len(), 8, "{m:?}");
    }

    #[test]
    fn a_later_line_overrides_an_earlier_one() {
        let m = LogParser::Pytest.parse("PASSED t.py::x\nERROR t.py::x - teardown\n");
        assert_eq!(get(&m, "t.py::x"), Some("ERROR"));
        let m = LogParser::Pytest.parse("ERROR t.py::x\nPASSED t.py::x\n");
        assert_eq!(get(&m, "t.py::x"), Some("PASSED"));
    }

    #[test]
    fn matplotlib_spells_mouse_buttons_as_numbers() {
        let m = LogParser::Matplotlib.parse(
            "PASSED lib/matplotlib/tests/test_widgets.py::test_span[MouseButton.LEFT-x]\n\
             FAILED lib/matplotlib/tests/test_widgets.py::test_span[MouseButton.RIGHT-y] - E\n",
        );
        assert_eq!(
            get(&m, "lib/matplotlib/tests/test_widgets.py::test_span[1-x]"),
            Some("PASSED")
        );
        assert_eq!(
            get(&m, "lib/matplotlib/tests/test_widgets.py::test_span[3-y]"),
            Some("FAILED")
        );
    }

    #[test]
    fn pytest_options_shortens_path_ids() {
        let m = LogParser::PytestOptions.parse(
            "PASSED tests/test_requests.py::test_path[/home/someone/data/file.txt]\n\
             PASSED tests/test_requests.py::test_url[//host/path]\n\
             PASSED tests/test_requests.py::test_glob[/a/*.py]\n\
             PASSED tests/test_lint.py::test_functional[unused_import]\n\
             FAILED tests/test_lint.py::test_x[a]tail - AssertionError\n\
             PASSED tests/test_plain.py::test_plain\n",
        );
        assert_eq!(
            get(&m, "tests/test_requests.py::test_path[/file.txt]"),
            Some("PASSED")
        );
        assert_eq!(
            get(&m, "tests/test_requests.py::test_url[//host/path]"),
            Some("PASSED")
        );
        assert_eq!(
            get(&m, "tests/test_requests.py::test_glob[/a/*.py]"),
            Some("PASSED")
        );
        assert_eq!(
            get(&m, "tests/test_lint.py::test_functional[unused_import]"),
            Some("PASSED")
        );
        // Text after the last ']' is dropped.
        assert_eq!(get(&m, "tests/test_lint.py::test_x[a]"), Some("FAILED"));
        assert_eq!(get(&m, "tests/test_plain.py::test_plain"), Some("PASSED"));
        assert_eq!(m.len(), 6);
    }

    #[test]
    fn pytest_pydantic_reads_swegym_logs() {
        let log = "\
tests/test_main.py::test_ok PASSED
\u{1b}[31mFAILED\u{1b}[0m [ 42%] tests/test_main.py::test_bad - AssertionError: x
FAILED tests/test_main.py::test_p[a - b] - boom
tests/test_types.py::test_old[1 2] PASSED
SKIPPED [1] tests/test_x.py:3: needs email-validator
ERROR tests/test_collect.py
";
        let m = LogParser::PytestPydantic.parse(log);
        assert_eq!(get(&m, "tests/test_main.py::test_ok"), Some("PASSED"));
        // The progress percentage after FAILED is dropped, colours first.
        assert_eq!(get(&m, "tests/test_main.py::test_bad"), Some("FAILED"));
        // " - " becomes a space, and the second word is the name.
        assert_eq!(get(&m, "tests/test_main.py::test_p[a"), Some("FAILED"));
        // Old-style lines: the first word is the name, the second the "status".
        assert_eq!(get(&m, "tests/test_types.py::test_old[1"), Some("2]"));
        // A skip summary's count is taken as a name, as in the fork.
        assert_eq!(get(&m, "[1]"), Some("SKIPPED"));
        assert_eq!(get(&m, "tests/test_collect.py"), Some("ERROR"));
        assert!(LogParser::PytestPydantic.parse_checked(log).is_ok());
        // A bare status line makes the fork's parser raise: nothing is reported.
        let e = LogParser::PytestPydantic
            .parse_checked("PASSED tests/a.py::t\nFAILED\n")
            .unwrap_err();
        assert!(e.contains("pytest_pydantic"), "{e}");
        // "FAILED - " is one word once " - " becomes a space: the fork raises there too.
        assert!(LogParser::PytestPydantic
            .parse_checked("FAILED - ")
            .is_err());
        assert_eq!(
            crate::harness::parser_named("parse_log_pydantic"),
            Some(LogParser::PytestPydantic)
        );
        assert_eq!(
            crate::harness::parser_named("Project-MONAI/MONAI"),
            Some(LogParser::Pytest)
        );
    }

    #[test]
    fn pytest_v2_keeps_spaces_and_reads_colours_and_old_style_lines() {
        let log = "\
astropy/io/fits/tests/test_header.py::test_old_style PASSED
astropy/io/fits/tests/test_header.py::test_old_fail FAILED
\u{1b}[32mPASSED\u{1b}[0m sklearn/tests/test_a.py::test_colour
PASSED sklearn/tests/test_a.py::test_p[a  b]
FAILED sklearn/tests/test_a.py::test_q[x - y] - AssertionError: no
SKIPPED [2] sklearn/tests/test_a.py:10: needs scipy
ERROR\tsklearn/tests/test_b.py
";
        let m = LogParser::PytestV2.parse(log);
        assert_eq!(
            get(&m, "astropy/io/fits/tests/test_header.py::test_old_style"),
            Some("PASSED")
        );
        assert_eq!(
            get(&m, "astropy/io/fits/tests/test_header.py::test_old_fail"),
            Some("FAILED")
        );
        assert_eq!(
            get(&m, "sklearn/tests/test_a.py::test_colour"),
            Some("PASSED")
        );
        // Runs of spaces collapse to one; the name keeps its space.
        assert_eq!(
            get(&m, "sklearn/tests/test_a.py::test_p[a b]"),
            Some("PASSED")
        );
        // A FAILED line is cut at its first " - ", even inside an id.
        assert_eq!(get(&m, "sklearn/tests/test_a.py::test_q[x"), Some("FAILED"));
        // The tab is a control character: removed, which glues the words.
        assert_eq!(get(&m, "ERRORsklearn/tests/test_b.py"), None);
        assert_eq!(m.len(), 5, "{m:?}");
    }

    #[test]
    fn seaborn_reads_verbose_and_summary_lines() {
        let m = LogParser::Seaborn.parse(
            "tests/test_core.py::TestSemantic::test_a PASSED [ 10%]\n\
             tests/test_core.py::test_b FAILED [ 20%]\n\
             PASSED tests/test_core.py::test_c\n\
             FAILED tests/test_core.py::test_b - AssertionError\n",
        );
        assert_eq!(
            get(&m, "tests/test_core.py::TestSemantic::test_a"),
            Some("PASSED")
        );
        assert_eq!(get(&m, "tests/test_core.py::test_b"), Some("FAILED"));
        assert_eq!(get(&m, "tests/test_core.py::test_c"), Some("PASSED"));
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn sympy_reads_results_and_failure_headers() {
        let log = "\
============================= test process starts ==============================
executable:         /opt/miniconda3/envs/testbed/bin/python  (3.9.19-final-0) [CPython]

sympy/core/tests/test_basic.py[3]
test_structure ok
test_equality F
test_matches_basic E
test_printing_slow f

________________________________________________________________________________
_________ sympy/core/tests/test_basic.py:test_equality _________________________
Traceback (most recent call last):
AssertionError
____________________ sympy/core/tests/test_other.py:test_crash _________________
ZeroDivisionError
=========== tests finished: 1 passed, 1 failed, 1 exceptions, in 0.10 seconds ==========
";
        let m = LogParser::Sympy.parse(log);
        assert_eq!(get(&m, "test_structure"), Some("PASSED"));
        assert_eq!(get(&m, "test_equality"), Some("FAILED"));
        assert_eq!(get(&m, "test_matches_basic"), Some("ERROR"));
        assert_eq!(
            get(&m, "test_printing_slow"),
            None,
            "expected failures are not counted"
        );
        assert_eq!(
            get(&m, "sympy/core/tests/test_basic.py:test_equality"),
            Some("FAILED")
        );
        assert_eq!(
            get(&m, "sympy/core/tests/test_other.py:test_crash"),
            Some("FAILED")
        );
    }

    #[test]
    fn django_reads_its_runner_with_interleaved_output() {
        let log = "\
Testing against Django installed in '/testbed/django'
Importing application admin_views
Creating test database for alias 'default' ('file:memorydb_default?mode=memory&cache=shared')...
test_ok (admin_views.tests.AdminViewBasicTest) ... ok
test_fails (admin_views.tests.AdminViewBasicTest) ... FAIL
test_errors (admin_views.tests.AdminViewBasicTest) ... ERROR
test_skip (admin_views.tests.AdminViewBasicTest) ... skipped 'Database has feature(s) supports_x'
test_printing (admin_views.tests.PrintTest) ... some printed output
more output
ok
test_unicode (i18n.tests.Tests.test_unicode) \"Ünïcode [x] :: y\" ... ok
test_sys (check_framework.tests.CheckTest) ... System check identified no issues (0 silenced).
ok
test_internal (view_tests.tests.ErrTest) ... Internal Server Error: /raises/
ok
Applying sites.0002_alter_domain_unique...test_no_migrations (migrations.tests.T) ... ok

======================================================================
FAIL: test_fails (admin_views.tests.AdminViewBasicTest)
----------------------------------------------------------------------
Traceback (most recent call last):
AssertionError: 1 != 2

======================================================================
ERROR: test_setup_crash (admin_views.tests.SetupClassTest)
----------------------------------------------------------------------
ImportError: boom
----------------------------------------------------------------------
Ran 8 tests in 0.101s

FAILED (failures=1, errors=2, skipped=1)
";
        let m = LogParser::Django.parse(log);
        let at = |k: &str| get(&m, k);
        assert_eq!(
            at("test_ok (admin_views.tests.AdminViewBasicTest)"),
            Some("PASSED")
        );
        // "FAIL:" headers give the first word only, as the harness's split does.
        assert_eq!(at("test_fails"), Some("FAILED"));
        assert_eq!(
            at("test_fails (admin_views.tests.AdminViewBasicTest)"),
            Some("FAILED")
        );
        assert_eq!(
            at("test_errors (admin_views.tests.AdminViewBasicTest)"),
            Some("ERROR")
        );
        assert_eq!(at("test_setup_crash"), Some("ERROR"));
        assert_eq!(
            at("test_skip (admin_views.tests.AdminViewBasicTest)"),
            Some("SKIPPED")
        );
        assert_eq!(
            at("test_printing (admin_views.tests.PrintTest)"),
            Some("PASSED")
        );
        assert_eq!(
            at("test_unicode (i18n.tests.Tests.test_unicode) \"Ünïcode [x] :: y\""),
            Some("PASSED")
        );
        assert_eq!(
            at("test_sys (check_framework.tests.CheckTest)"),
            Some("PASSED")
        );
        assert_eq!(
            at("test_internal (view_tests.tests.ErrTest)"),
            Some("PASSED")
        );
        assert_eq!(
            at("test_no_migrations (migrations.tests.T)"),
            Some("PASSED")
        );
    }

    #[test]
    fn django_version_test_and_a_crash_mid_run() {
        let log = "\
test_version (admin_scripts.tests.CommandTypes)
--version is equivalent to version ... ok
test_crash (admin_scripts.tests.Crash) ... Fatal Python error: Segmentation fault
";
        let m = LogParser::Django.parse(log);
        assert_eq!(
            get(&m, "--version is equivalent to version"),
            Some("PASSED")
        );
        assert_eq!(get(&m, "test_crash (admin_scripts.tests.Crash)"), None);
    }

    /// Where the harness's Django parser raises (IndexError), no result is read; Unicode
    /// digits make a skip count; 0x1c-0x1f count as the regexes' whitespace.
    #[test]
    fn the_harness_quirks_at_the_edges() {
        for log in ["test_a (m.T) ... ok\nFAIL:\n", "ERROR:root:boom\n"] {
            let e = LogParser::Django.parse_checked(log).unwrap_err();
            assert!(e.contains("django log parser fails"), "{e}");
        }
        assert!(LogParser::Django
            .parse_checked("FAIL: test_x (m.T)\n")
            .is_ok());
        assert!(LogParser::Pytest
            .parse("SKIPPED [\u{663}] t.py:1: x\n")
            .is_empty());
        let m = LogParser::Django
            .parse("t\u{1c}...\u{1c}System check identified no issues (0 silenced)\nok\n");
        assert_eq!(get(&m, "t"), Some("PASSED"), "{m:?}");
    }

    #[test]
    fn hostile_lines_do_not_panic() {
        for parser in LogParser::ALL {
            for log in [
                "",
                "FAILED",
                "FAIL:",
                "ERROR:\n ok",
                "SKIPPED [",
                "PASSED ]]][[[",
                "test_ E",
                "\u{1b}[",
                " ... ",
                "x ...  OK",
                "\u{85}PASSED\u{a0}t",
            ] {
                let _ = parser.parse(log);
            }
        }
    }
}
