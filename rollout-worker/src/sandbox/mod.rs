//! Sandboxes: where an episode's commands run, behind one blocking interface.
//!
//! Episodes, teachers and the grader use [`Sandbox`] whatever runs the commands: a
//! temporary local repository ([`LocalSandbox`], in `local`, with raw process control in
//! `process` and its confinement in `confine`) or a Docker container ([`DockerSandbox`],
//! in `docker`, with its warm pool in `pool`). [`SandboxFactory`] (in `factory`) makes one
//! per episode. Episodes run on blocking threads; the Docker side drives its async client
//! on the runtime handle it was created from.

pub mod confine;
pub mod docker;
pub mod factory;
pub mod local;
pub mod pool;
mod process;

pub use confine::{ConfineError, ConfineSettings, Confinement, Limits};
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
    /// Why this sandbox runs no more commands (a local sandbox at its disk floor,
    /// `[worker] min_free_disk_mb`): the episode ends there, without tests. `None` while
    /// it can go on.
    fn stopped(&self) -> Option<Stopped> {
        None
    }
    /// [`Self::stopped`] after [`Self::submission`] was read: the worker's own
    /// bookkeeping (`git add` of what the agent left) writes too, and a disk it took under
    /// the floor stops the sandbox as the agent's doing.
    fn stopped_after_submission(&mut self) -> Option<Stopped> {
        self.stopped()
    }
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
    /// The submission: every text change against the base commit as a git patch, binary
    /// changes and large untracked files left out, or "too large" (see [`Submission`]).
    /// Never reads more of git's output than [`MAX_SUBMISSION_BYTES`] + 1.
    fn submission(&self) -> Submission;
    /// [`Self::submission`]'s patch alone: empty when the submission is too large. For
    /// callers that only want the text; the episode uses `submission` so that a
    /// too-large one is reported as such.
    fn diff(&self) -> String {
        self.submission().patch
    }
    /// Paths changed against the base commit; `None` if they could not be listed (git
    /// failed).
    fn try_changed_files(&self) -> Option<Vec<String>>;
    /// [`Self::try_changed_files`], empty where they could not be listed: for callers
    /// to whom a failure means no change (the teachers); grading must not read it so.
    fn changed_files(&self) -> Vec<String> {
        self.try_changed_files().unwrap_or_default()
    }
    /// Contents of the files `patch` touches once applied to the base commit.
    fn apply_to_base(&self, patch: &str) -> Result<BTreeMap<String, Option<String>>, SandboxError>;
    /// Writes a file outside the repository; returns its path, shell-quoted.
    fn write_scratch(&mut self, name: &str, content: &str) -> Result<String, SandboxError>;
    /// `local` or `docker`.
    fn kind(&self) -> &'static str;
}

/// Why a sandbox stopped running commands ([`Sandbox::stopped`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stopped {
    pub why: String,
    /// The disk crossed the floor while this sandbox's own command ran (or its end was
    /// the first check to see it): most likely its doing, so the episode is graded
    /// unresolved without tests (reward as for any failure: filling the disk costs the
    /// reward). False: it found the disk under the floor before its command, someone
    /// else's doing as far as it knows: ungraded (SANDBOX_ERROR, no reward either way).
    pub by_own_command: bool,
}

impl Stopped {
    /// The outcome of an episode (or `tutor eval` task) this stop ended, without tests:
    /// UNRESOLVED when its own command took the disk under the floor, SANDBOX_ERROR
    /// (ungraded) when it found the disk there.
    pub fn outcome_status(&self) -> tutor_proto::OutcomeStatus {
        match self.by_own_command {
            true => tutor_proto::OutcomeStatus::Unresolved,
            false => tutor_proto::OutcomeStatus::SandboxError,
        }
    }
}

/// What an episode submits at its end: `sandbox`'s submission, or the stop that ended it
/// (`stopped`, the one seen during the episode; else one seen now, before the submission
/// is read; else one its bookkeeping caused, [`Sandbox::stopped_after_submission`]), with
/// no submission.
pub fn final_submission(
    sandbox: &mut dyn Sandbox,
    stopped: Option<Stopped>,
) -> Result<Submission, Stopped> {
    if let Some(stop) = stopped.or_else(|| sandbox.stopped()) {
        return Err(stop);
    }
    let submission = sandbox.submission();
    match sandbox.stopped_after_submission() {
        Some(stop) => Err(stop),
        None => Ok(submission),
    }
}

/// Exit code reported for a command killed by the timeout (as coreutils `timeout` does).
pub const TIMEOUT_EXIT_CODE: i32 = 124;

/// What never belongs in a submission (byte-code and pytest caches): every sandbox's
/// `.git/info/exclude`.
pub(crate) const SUBMISSION_EXCLUDE: &str = "__pycache__/\n*.pyc\n.pytest_cache/\n*.egg-info/\n";

/// The largest diff a sandbox submits, in bytes. A larger one is reported as too large
/// (`OUTCOME_STATUS_PATCH_TOO_LARGE`), never truncated: a cut patch does not apply. Well
/// under `tutor_proto::MAX_EVENT_BYTES` (the outcome event that carries the patch), and so
/// under `MAX_ROLLOUT_REQUEST_BYTES`, with room for the rest of the event. A real fix is a
/// few kilobytes; this much is a virtualenv, a build tree or generated data in the
/// repository.
pub const MAX_SUBMISSION_BYTES: usize = 4 * 1024 * 1024;
const _: () = assert!(MAX_SUBMISSION_BYTES <= tutor_proto::MAX_EVENT_BYTES / 2);

/// Untracked files larger than this (bytes) are left out of the submission, not even
/// added to the private index (so never hashed): a data file, a downloaded archive, a
/// compiled binary. Changes to files of the base commit are never left out for size; they
/// count towards [`MAX_SUBMISSION_BYTES`].
pub const MAX_UNTRACKED_FILE_BYTES: u64 = 1024 * 1024;

/// How many left-out paths a [`Submission`] names; the rest are only counted.
pub const LEFT_OUT_LISTED: usize = 20;

/// What a sandbox submits at the end of an episode ([`Sandbox::submission`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Submission {
    /// Every text change against the base commit as a git patch (`git apply`-able to the
    /// base). Empty when [`Self::too_large`] is set, or when git failed (the agent
    /// deleted `.git`; logged).
    pub patch: String,
    /// `Some(bytes)`: the diff was over [`MAX_SUBMISSION_BYTES`], so there is no patch.
    /// `bytes` is how much of it was read before git was stopped (more than the cap; the
    /// full size is not measured, which would cost the time and memory the cap saves).
    pub too_large: Option<u64>,
    /// The first [`LEFT_OUT_LISTED`] paths left out of the patch, with why.
    pub left_out: Vec<LeftOut>,
    /// How many paths were left out in all (`left_out` names the first of them).
    pub left_out_total: usize,
}

/// A path left out of a [`Submission`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftOut {
    pub path: String,
    pub reason: LeftOutReason,
}

/// Why a path was left out of a [`Submission`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeftOutReason {
    /// git sees a binary change (a compiled `.so`, an image): the patch is text only, and
    /// its change is reset to the base commit.
    Binary,
    /// An untracked file of this many bytes, over [`MAX_UNTRACKED_FILE_BYTES`].
    Large(u64),
}

impl Submission {
    /// Notes a left-out path (named if fewer than [`LEFT_OUT_LISTED`] are already).
    pub(crate) fn leave_out(&mut self, path: String, reason: LeftOutReason) {
        if self.left_out.len() < LEFT_OUT_LISTED {
            self.left_out.push(LeftOut { path, reason });
        }
        self.left_out_total += 1;
    }

    /// What was left out of the patch, in words (`None` if nothing was).
    pub fn left_out_note(&self) -> Option<String> {
        if self.left_out_total == 0 {
            return None;
        }
        let names: Vec<String> = self
            .left_out
            .iter()
            .map(|l| match l.reason {
                LeftOutReason::Binary => format!("{:?} (binary)", l.path),
                LeftOutReason::Large(n) => format!(
                    "{:?} (untracked, {n} bytes > {MAX_UNTRACKED_FILE_BYTES})",
                    l.path
                ),
            })
            .collect();
        let more = self.left_out_total - self.left_out.len();
        let more = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        Some(format!(
            "left out of the patch ({} paths): {}{more}",
            self.left_out_total,
            names.join(", ")
        ))
    }

    /// Why there is no patch, in words (`None` unless [`Self::too_large`]).
    pub fn too_large_note(&self) -> Option<String> {
        self.too_large.map(|seen| {
            format!(
                "the submission's diff is over the {MAX_SUBMISSION_BYTES}-byte cap \
                 (MAX_SUBMISSION_BYTES): git was stopped after {seen} bytes; no patch is \
                 submitted (binary files and untracked files over {MAX_UNTRACKED_FILE_BYTES} \
                 bytes were already left out)"
            )
        })
    }
}

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

/// The head and tail kept of an output whose middle was dropped, cut at whole
/// characters: the head loses an incomplete UTF-8 sequence at its end, the tail the
/// continuation bytes at its start (a cap counts bytes, and would otherwise leave a
/// character's halves on either side of the gap, each shown as U+FFFD). Returns the
/// text of each and the bytes cut, to add to the count dropped.
pub(crate) fn cut_at_chars(head: &[u8], tail: &[u8]) -> (String, String, usize) {
    let head_end = match std::str::from_utf8(head) {
        // An incomplete sequence at the very end: cut before it. Invalid bytes elsewhere
        // are the program's own, shown as U+FFFD as before.
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        _ => head.len(),
    };
    let tail_start = tail
        .iter()
        .take(3)
        .take_while(|&&b| b & 0b1100_0000 == 0b1000_0000)
        .count();
    (
        String::from_utf8_lossy(&head[..head_end]).into_owned(),
        String::from_utf8_lossy(&tail[tail_start..]).into_owned(),
        head.len() - head_end + tail_start,
    )
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
