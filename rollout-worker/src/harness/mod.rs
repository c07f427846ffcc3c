//! Harness-exact grading for the SWE-bench family of datasets: which test command, which
//! test directives, which environment and which log parser a task's repository and
//! version take, and how the parsed statuses become a resolution — as the SWE-bench
//! harness defines them (its `MAP_REPO_VERSION_TO_SPECS`, `get_test_directives`,
//! `MAP_REPO_TO_PARSER` and `get_eval_report`), so `tutor eval` reports what SWE-bench
//! would report.
//!
//! A task gets its spec from, in order:
//! 1. its own `test_cmd` (SWE-rebench's `install_config.test_cmd`), read with its
//!    `log_parser` (default: the harness's pytest parser);
//! 2. the harness's table, by `repo` and `version` (a known repository with a version
//!    the table lacks is refused with its own status, never graded by guesswork);
//! 3. otherwise Tutor's generic pytest grading (toy tasks and plain pytest repositories).

pub mod parsers;

use std::collections::BTreeMap;
use std::fmt;

pub use parsers::LogParser;

use crate::tasks::TaskRecord;

/// How SWE-bench images make their environment current (the harness's eval script).
pub const CONDA_ACTIVATE: &str = "source /opt/miniconda3/bin/activate && conda activate testbed";

/// File endings the harness never passes to the test command (`NON_TEST_EXTS`; `csv`
/// has no dot there, so `abccsv` is left out too).
const NON_TEST_EXTS: [&str; 11] = [
    ".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml",
];

/// One repository's specs in the harness's table.
struct RepoSpecs {
    repo: &'static str,
    parser: LogParser,
    groups: &'static [VersionSpec],
}

/// The versions of a repository that share their evaluation commands.
struct VersionSpec {
    versions: &'static [&'static str],
    test_cmd: &'static str,
    /// Run before the tests (after activation), e.g. Django's locale exports.
    eval_commands: &'static [&'static str],
    /// The harness re-installs the package before the tests (compiled parts included).
    install: &'static str,
}

/// Where a task's test spec came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecSource {
    /// The SWE-bench harness's table (repository and version).
    Harness,
    /// The task's own `test_cmd` (SWE-rebench and other datasets that carry one).
    Task,
    /// Tutor's generic pytest grading: no table entry and no command in the task.
    Generic,
}

/// Everything the grader needs to run and read a task's tests.
#[derive(Debug, Clone, PartialEq)]
pub struct TestSpec {
    pub source: SpecSource,
    /// The harness parser, or `None` for the generic pytest reading.
    pub parser: Option<LogParser>,
    pub test_cmd: String,
    /// What the test command is given (files, or Django's dotted modules).
    pub directives: Vec<String>,
    /// Shell commands run before the install and the tests, after activation.
    pub eval_commands: Vec<String>,
    pub install: Option<String>,
    /// The environment activation; required (a failure is ENVIRONMENT_ERROR) when set.
    pub activate: Option<String>,
}

impl TestSpec {
    /// One line for logs: where the spec came from and what it runs.
    pub fn describe(&self) -> String {
        let source = match self.source {
            SpecSource::Harness => "SWE-bench harness spec",
            SpecSource::Task => "the task's test_cmd",
            SpecSource::Generic => "generic pytest grading",
        };
        let parser = self.parser.map_or("tutor pytest", LogParser::name);
        format!("{source}: `{}`, {parser} log parser", self.test_cmd)
    }

    /// The shell prefix every grading step after the patches runs under: activation and
    /// the eval commands. As in the harness's script, a failing eval command does not
    /// stop the next one.
    pub fn prelude(&self) -> String {
        let mut parts: Vec<String> = self.activate.iter().cloned().collect();
        parts.extend(self.eval_commands.iter().cloned());
        parts.iter().map(|p| format!("{p}; ")).collect()
    }

    /// The test command with its directives.
    pub fn test_command(&self) -> String {
        let mut cmd = self.test_cmd.clone();
        for d in &self.directives {
            cmd.push(' ');
            cmd.push_str(&crate::sandbox::shell_quote(d));
        }
        cmd
    }
}

/// A task no spec can grade.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpecError {
    /// The repository is in the harness's table, its version is not.
    UnknownVersion {
        instance_id: String,
        repo: String,
        version: String,
        known: Vec<&'static str>,
    },
    /// The task names a log parser that does not exist.
    UnknownParser { instance_id: String, name: String },
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpecError::UnknownVersion {
                instance_id,
                repo,
                version,
                known,
            } => {
                let version = if version.is_empty() {
                    "no version (the task's `version` field is empty)".to_string()
                } else {
                    format!("version {version:?}")
                };
                write!(
                    f,
                    "task {instance_id}: the SWE-bench harness has no test spec for {repo} at \
                     {version}; known versions: {}. Fix the task's `version`, or give it a \
                     `test_cmd` (and `log_parser`) to grade with",
                    known.join(", ")
                )
            }
            SpecError::UnknownParser { instance_id, name } => write!(
                f,
                "task {instance_id}: unknown log_parser {name:?}; known: {}",
                LogParser::ALL.map(LogParser::name).join(", ")
            ),
        }
    }
}

/// A parser by the harness's name (`pytest` or `parse_log_pytest`, and its per-repository
/// aliases such as `parse_log_astropy`), or by a repository whose parser it is
/// (`django/django`).
pub fn parser_named(name: &str) -> Option<LogParser> {
    let short = name.trim().trim_start_matches("parse_log_");
    if let Some(p) = LogParser::ALL.iter().find(|p| p.name() == short) {
        return Some(*p);
    }
    let alias = match short {
        "astroid" | "flask" | "marshmallow" | "pvlib" | "pyvista" | "sqlfluff" | "xarray" => {
            Some(LogParser::Pytest)
        }
        "pydicom" | "requests" | "pylint" => Some(LogParser::PytestOptions),
        "astropy" | "scikit" | "sphinx" => Some(LogParser::PytestV2),
        // SWE-Gym's fork.
        "mypy" | "moto" | "conan" | "modin" | "monai" | "dvc" | "dask" | "bokeh" | "mne"
        | "hypothesis" | "pandas" | "hydra" => Some(LogParser::Pytest),
        "pydantic" => Some(LogParser::PytestPydantic),
        _ => None,
    };
    if alias.is_some() {
        return alias;
    }
    repo_specs(name).map(|r| r.parser)
}

/// The test spec for `task` (see the module docs for the order).
pub fn spec_for(task: &TaskRecord) -> Result<TestSpec, SpecError> {
    let named_parser = if task.log_parser.trim().is_empty() {
        None
    } else {
        Some(
            parser_named(&task.log_parser).ok_or_else(|| SpecError::UnknownParser {
                instance_id: task.instance_id.clone(),
                name: task.log_parser.clone(),
            })?,
        )
    };
    let table = repo_specs(&task.repo);
    if !task.test_cmd.trim().is_empty() {
        return Ok(TestSpec {
            source: SpecSource::Task,
            parser: Some(
                named_parser
                    .or(table.map(|r| r.parser))
                    .unwrap_or(LogParser::Pytest),
            ),
            test_cmd: task.test_cmd.trim().to_string(),
            directives: test_directives(&task.repo, &task.test_patch),
            eval_commands: Vec::new(),
            install: None,
            activate: None,
        });
    }
    let Some(repo) = table else {
        return Ok(TestSpec {
            source: SpecSource::Generic,
            parser: named_parser,
            test_cmd: crate::grade::DEFAULT_TEST_CMD.to_string(),
            directives: task.test_files(),
            eval_commands: Vec::new(),
            install: None,
            activate: None,
        });
    };
    let version = task.version.trim();
    let Some(group) = repo.groups.iter().find(|g| g.versions.contains(&version)) else {
        return Err(SpecError::UnknownVersion {
            instance_id: task.instance_id.clone(),
            repo: task.repo.clone(),
            version: task.version.clone(),
            known: repo
                .groups
                .iter()
                .flat_map(|g| g.versions.iter().copied())
                .collect(),
        });
    };
    Ok(TestSpec {
        source: SpecSource::Harness,
        parser: Some(named_parser.unwrap_or(repo.parser)),
        test_cmd: group.test_cmd.to_string(),
        // A command ending in `-k` (SWE-Gym's mypy) selects cases by name, not files.
        directives: if group.test_cmd.trim_end().ends_with(" -k") {
            vec![mypy_cases(&task.test_patch)]
        } else {
            test_directives(repo.repo, &task.test_patch)
        },
        eval_commands: group.eval_commands.iter().map(|c| c.to_string()).collect(),
        install: Some(group.install.to_string()),
        activate: Some(CONDA_ACTIVATE.to_string()),
    })
}

/// The harness's `get_test_directives`: every `diff --git a/… b/PATH` of the test patch
/// (the last ` b/` of such a line, wherever it stands), less non-test files; for Django,
/// dotted module names without `tests/` and `.py`.
pub fn test_directives(repo: &str, test_patch: &str) -> Vec<String> {
    const HEAD: &str = "diff --git a/";
    let mut out = Vec::new();
    for line in test_patch.split('\n') {
        // re.findall: a match takes the rest of its line; a line's first header without
        // a " b/" after it means no later one on that line has one either.
        if let Some(i) = line.find(HEAD) {
            let after = &line[i + HEAD.len()..];
            if let Some(j) = after.rfind(" b/") {
                out.push(after[j + 3..].to_string());
            }
        }
    }
    out.retain(|d| !NON_TEST_EXTS.iter().any(|ext| d.ends_with(ext)));
    if repo == "django/django" {
        for d in &mut out {
            let mut s = d.as_str();
            s = s.strip_suffix(".py").unwrap_or(s);
            s = s.strip_prefix("tests/").unwrap_or(s);
            *d = s.replace('/', ".");
        }
    }
    out
}

/// SWE-Gym's mypy selection (its fork's `make_test_command`): the `[case NAME]` headers
/// of the test patch (added, removed or context lines) joined by ` or `, the value of the
/// test command's trailing `-k`.
fn mypy_cases(test_patch: &str) -> String {
    static CASE: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let case = CASE.get_or_init(|| regex::Regex::new(r"\[case ([^\]]+)\]").expect("case"));
    let names: Vec<&str> = case
        .captures_iter(test_patch)
        .map(|c| c.get(1).expect("group").as_str())
        .collect();
    names.join(" or ")
}

/// The harness's resolution of an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    Full,
    Partial,
    No,
}

impl Resolution {
    /// The harness's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Resolution::Full => "RESOLVED_FULL",
            Resolution::Partial => "RESOLVED_PARTIAL",
            Resolution::No => "RESOLVED_NO",
        }
    }
}

/// The harness's per-test report (`get_eval_tests_report`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TestsReport {
    pub f2p_success: Vec<String>,
    pub f2p_failure: Vec<String>,
    pub p2p_success: Vec<String>,
    pub p2p_failure: Vec<String>,
}

impl TestsReport {
    /// The harness's rules: a test passed if its status is PASSED or XFAIL; failed if it
    /// is missing, FAILED or ERROR; anything else (SKIPPED) counts as neither.
    pub fn new(task: &TaskRecord, statuses: &BTreeMap<String, String>) -> Self {
        let mut r = TestsReport::default();
        let check =
            |case: &String, success: &mut Vec<String>, failure: &mut Vec<String>| match statuses
                .get(case)
                .map(String::as_str)
            {
                Some("PASSED" | "XFAIL") => success.push(case.clone()),
                None | Some("FAILED" | "ERROR") => failure.push(case.clone()),
                Some(_) => {}
            };
        for case in &task.fail_to_pass {
            check(case, &mut r.f2p_success, &mut r.f2p_failure);
        }
        for case in &task.pass_to_pass {
            check(case, &mut r.p2p_success, &mut r.p2p_failure);
        }
        r
    }

    /// FULL when no FAIL_TO_PASS and no PASS_TO_PASS test failed (an empty list, or one
    /// whose tests were all skipped, counts as 1.0, as in the harness); PARTIAL when some
    /// FAIL_TO_PASS passed and some failed with PASS_TO_PASS intact; NO otherwise.
    pub fn resolution(&self) -> Resolution {
        let p2p_ok = self.p2p_failure.is_empty();
        if self.f2p_failure.is_empty() && p2p_ok {
            Resolution::Full
        } else if !self.f2p_success.is_empty() && p2p_ok {
            Resolution::Partial
        } else {
            Resolution::No
        }
    }
}

/// The harness's table, by repository (generated from the harness's published specs:
/// versions that share their test command, eval commands and install are grouped).
const HARNESS_SPECS: &[RepoSpecs] = &include!("specs_table.rs");
/// SWE-Gym's repositories, from its harness fork.
const SWEGYM_SPECS: &[RepoSpecs] = &include!("specs_swegym.rs");

/// Every repository with harness specs: SWE-bench's, then SWE-Gym's.
fn harness_specs() -> impl Iterator<Item = &'static RepoSpecs> {
    HARNESS_SPECS.iter().chain(SWEGYM_SPECS)
}

/// The specs of `repo` (as the harness forks look them up, case aside:
/// `Project-MONAI/MONAI` and `project-monai/monai` are one repository).
fn repo_specs(repo: &str) -> Option<&'static RepoSpecs> {
    let repo = repo.trim();
    harness_specs().find(|r| r.repo.eq_ignore_ascii_case(repo))
}

#[cfg(test)]
mod tests;
