//! Sandboxes: where an episode's commands run, behind one blocking interface.
//!
//! Episodes, teachers and the grader use [`Sandbox`] whatever runs the commands: a
//! temporary local repository ([`LocalSandbox`], in `local`, with raw process control in
//! `process`) or a Docker container ([`DockerSandbox`], in `docker`, with its warm pool in
//! `pool`). [`SandboxFactory`] (in `factory`) makes one per episode. Episodes run on
//! blocking threads; the Docker side drives its async client on the runtime handle it was
//! created from.

pub mod docker;
pub mod factory;
pub mod local;
pub mod pool;
mod process;

pub use docker::{BlockingDocker, DockerError, DockerSandbox};
pub use factory::{CreateError, DockerSettings, ImageRule, SandboxFactory};
pub use local::{
    python_interpreter, remove_local_orphans, LocalSandbox, LocalSandboxError, REPO_DISPLAY,
};
pub use pool::WarmPool;

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

/// What episodes, teachers and the grader need from a sandbox.
pub trait Sandbox: Send {
    /// Runs one command (bash) in the sandbox's persistent working directory. Never fails:
    /// errors come back as output.
    fn run(&mut self, command: &str, timeout: Duration) -> CommandOutput;
    /// The current directory as shown to the model.
    fn cwd(&self) -> String;
    /// True when the current directory is the repository root.
    fn at_root(&self) -> bool;
    /// How the repository root is spelled in commands (`~/repo`, `/testbed`).
    fn repo_display(&self) -> &str;
    /// The file the tools have open, as shown in the footer.
    fn current_file(&self) -> Option<String>;
    /// Hash of the commit every diff is taken against.
    fn base_commit(&self) -> &str;
    /// Current HEAD.
    fn head(&self) -> Option<String>;
    /// A working-tree file relative to the repository root.
    fn read_file(&self, rel: &str) -> Option<String>;
    /// A file at the base commit.
    fn base_file(&self, rel: &str) -> Option<String>;
    /// The submission: every change against the base commit as a git patch.
    fn diff(&self) -> String;
    /// Paths changed against the base commit.
    fn changed_files(&self) -> Vec<String>;
    /// Contents of the files `patch` touches once applied to the base commit.
    fn apply_to_base(&self, patch: &str) -> Result<BTreeMap<String, Option<String>>, SandboxError>;
    /// Writes a file outside the repository; returns its path, shell-quoted.
    fn write_scratch(&mut self, name: &str, content: &str) -> Result<String, SandboxError>;
    /// `local` or `docker`.
    fn kind(&self) -> &'static str;
}

/// Exit code reported for a command killed by the timeout (as coreutils `timeout` does).
pub const TIMEOUT_EXIT_CODE: i32 = 124;

/// What never belongs in a submission (byte-code and pytest caches): every sandbox's
/// `.git/info/exclude`.
pub(crate) const SUBMISSION_EXCLUDE: &str = "__pycache__/\n*.pyc\n.pytest_cache/\n*.egg-info/\n";

/// The config (`-c` on every call) of a sandbox's bookkeeping git directory, the one its
/// own reads of the repository (the submission's diff, base files, patch checks) run
/// against, made before the agent acts: no hooks, no fsmonitor, no line-ending conversion. The repository's
/// `.git/config` and attributes are the agent's to write; an fsmonitor hook, a clean
/// filter or an include there would run the agent's code after its last command.
pub(crate) const BOOKKEEPING_CONFIG: [(&str, &str); 3] = [
    ("core.hooksPath", "/dev/null"),
    ("core.fsmonitor", "false"),
    ("core.autocrlf", "false"),
];

/// Why a sandbox could not carry out an operation ([`Sandbox::apply_to_base`],
/// [`Sandbox::write_scratch`]).
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// git refused the patch (or preparing its index): git's own message.
    #[error("{0}")]
    Git(String),
    /// A scratch file could not be written.
    #[error("could not write {name}: {source}")]
    Write {
        name: String,
        #[source]
        source: std::io::Error,
    },
    /// What runs the sandbox failed (git could not be started, the Docker engine
    /// refused): its error.
    #[error(transparent)]
    Backend(Box<dyn std::error::Error + Send + Sync>),
}

/// Result of one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandOutput {
    /// stdout and stderr interleaved, lossy UTF-8, head+tail capped.
    pub output: String,
    /// Exit status; `128 + signal` when killed by a signal; [`TIMEOUT_EXIT_CODE`] on timeout.
    pub exit_code: i32,
    pub timed_out: bool,
}

/// Quotes `s` for bash with single quotes.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Rejects absolute paths and `..` so task files and `read_file` stay inside the repo.
pub(crate) fn safe_rel(rel: &str) -> Option<PathBuf> {
    let p = Path::new(rel);
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(x) => out.push(x),
            Component::CurDir => {}
            _ => return None,
        }
    }
    if out.as_os_str().is_empty() {
        None
    } else {
        Some(out)
    }
}
