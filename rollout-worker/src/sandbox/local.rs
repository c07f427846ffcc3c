//! The local sandbox: one temporary git repository per episode, commands run by `bash`.
//!
//! Commands run in their own process group with a timeout, an output cap and a persistent
//! directory, confined where the machine allows (`confine`: bubblewrap namespaces, a
//! read-only view of the system, resource limits; docs/security.md, "Local sandbox"). Long
//! because a quarter of it is tests that drive real processes; the raw process control
//! itself is in `process`.
//!
//! Layout of a sandbox (`O` = a fresh temporary directory; what a confined command sees of
//! it in brackets, at the same paths):
//! - `O/home` (`T`, `HOME`; writable) — `T/repo`, the task's repository, committed once as
//!   the base commit; `T/tmp`, `TMPDIR` and the command's `/tmp`; `T/.gitconfig`;
//! - `O/bin` (read-only) — the tools and the `python`/`pytest` shims;
//! - `O/ctl` (read-only) — the command file and scratch files ([`Sandbox::write_scratch`]);
//! - `O/state` (writable) — the tools' viewer state and the file the command's final
//!   directory is written to;
//! - `O/book` (not shown) — the bookkeeping git directory, its config and indexes: what the
//!   worker's own git runs with, so nothing a command writes configures it.
//!
//! `HOME` is `T`, so the repository root is `~/repo` inside commands, and that is how
//! [`LocalSandbox::cwd`] displays it (`~/repo`, `~/repo/tests`, …; `O` is `~/..`, other
//! paths are shown absolute). The same spelling works in commands (`cd ~/repo`), which
//! keeps teacher labels free of random temp-dir names. `$REPO` also holds the absolute
//! root; command output spells `T` and `O` the same way (`spell_sandbox_paths`), so the
//! model never reads the temporary directory's random name (and the grader reads the
//! same text).
//!
//! Each command runs in a fresh `bash` (`--noprofile --norc`) with an environment of its
//! own (nothing of the worker's); only the working directory carries over (recorded by an
//! EXIT trap). Environment changes and background jobs do not: when a command's shell
//! exits, its whole process group is killed, so `sleep 1000 &` never outlives its command
//! (and cannot keep the output pipe open). Confined, nothing does: the command's pid
//! namespace ends with its shell. Unconfined, a process that leaves the group on purpose
//! (`setsid`) escapes until the sandbox is dropped; output collection then stops after a
//! short grace period.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::sandbox::confine::{Bind, Confinement, SYSTEM_PATH};
use crate::sandbox::process::{
    kill_group, kill_tagged, run_in_own_group, DiskFloor, Isolation, MemoryCeiling,
};
use crate::sandbox::{
    safe_rel, shell_quote, CommandOutput, LeftOutReason, Sandbox, SandboxError, Stopped,
    Submission, BOOKKEEPING_CONFIG, MAX_SUBMISSION_BYTES, MAX_UNTRACKED_FILE_BYTES,
    SUBMISSION_EXCLUDE,
};
use crate::tasks::TaskRecord;

/// How the repository root is spelled in commands and in the observation footer.
pub const REPO_DISPLAY: &str = "~/repo";

/// Default cap on captured command output (head and tail halves are kept).
pub const DEFAULT_OUTPUT_CAP: usize = 1 << 20;

/// Environment variable naming the sandbox a process belongs to.
const SANDBOX_TAG: &str = "TUTOR_SANDBOX";

/// Pinned identity and dates: base commits get the same hash for the same files.
/// How long one of the worker's own git calls may run (as the Docker sandbox's
/// `GIT_LIMIT`): then its process group is killed and the call fails, naming the limit.
pub const GIT_TIMEOUT: Duration = Duration::from_secs(300);

const GIT_NAME: &str = "Tutor";
const GIT_EMAIL: &str = "tutor@localhost";
const GIT_DATE: &str = "2000-01-01T00:00:00Z";

/// Environment variable naming the interpreter local sandboxes run and grade with; it
/// wins over [`PYTHON_ENV`]. The Makefile points it at `.venv-sandbox`, a venv with pytest
/// only: pytest starts in half the time there (the project venv's plugins, anyio's among
/// them, load on every run), and commands see no torch, transformers or client library.
pub const SANDBOX_PYTHON_ENV: &str = "TUTOR_SANDBOX_PYTHON";

/// The project's interpreter (with torch), used by sandboxes when
/// [`SANDBOX_PYTHON_ENV`] is not set.
pub const PYTHON_ENV: &str = "TUTOR_PYTHON";

/// The Python interpreter commands and the grader use: `$TUTOR_SANDBOX_PYTHON`, else
/// `$TUTOR_PYTHON`, else `python3`. `python`, `python3` and `pytest` resolve to it inside
/// the sandbox. A launcher found on
/// PATH (a pyenv shim: a script that needs the user's pyenv tree, which a confined sandbox
/// does not show) is replaced by the interpreter it starts (`sys.executable`, a venv's
/// python left unresolved), asked once per process.
pub fn python_interpreter() -> PathBuf {
    static RESOLVED: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    RESOLVED
        .get_or_init(|| {
            let found = find_python();
            real_interpreter(&found).unwrap_or(found)
        })
        .clone()
}

/// Grading in a local sandbox runs pytest with `python`: an interpreter without it would
/// grade every episode TESTS_ERROR ("No module named pytest") while the run goes on, so a
/// worker checks it before its first lease. The error names the interpreter, where it was
/// found and the fix.
pub fn check_grading_python(python: &Path) -> Result<(), String> {
    let how = match python_setting(env_value(SANDBOX_PYTHON_ENV), env_value(PYTHON_ENV)) {
        Some((var, v)) => format!("{var}={}", Path::new(&v).display()),
        None => "python3 on PATH".to_string(),
    };
    // Nothing of the worker's environment (the run's token, API keys) but its PATH, which
    // finds the interpreter as the sandboxes do.
    let out = std::process::Command::new(python)
        .args(["-c", "import pytest"])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .stdin(std::process::Stdio::null())
        .output();
    let why = match out {
        Ok(o) if o.status.success() => return Ok(()),
        Ok(o) => String::from_utf8_lossy(&o.stderr)
            .lines()
            .last()
            .unwrap_or("it exited with an error")
            .trim()
            .to_string(),
        Err(e) => format!("it cannot be run: {e}"),
    };
    Err(format!(
        "the Python that local sandboxes grade with, {} ({how}), cannot import pytest ({why}); \
         every episode would end TESTS_ERROR. Put the project's venv first on PATH \
         (`make setup`, then `export PATH=$PWD/.venv/bin:$PATH`, as `make quickstart` does) \
         or set TUTOR_SANDBOX_PYTHON to an interpreter that has pytest (`make setup` makes \
         .venv-sandbox)",
        python.display()
    ))
}

/// What `python -c 'import sys; print(sys.executable)'` names, if it is an absolute path
/// to a file.
fn real_interpreter(python: &Path) -> Option<PathBuf> {
    let out = std::process::Command::new(python)
        .args(["-c", "import sys; print(sys.executable)"])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let p = PathBuf::from(text.trim());
    (out.status.success() && p.is_absolute() && p.is_file()).then_some(p)
}

/// A non-empty environment value.
fn env_value(var: &str) -> Option<std::ffi::OsString> {
    std::env::var_os(var).filter(|v| !v.is_empty())
}

/// Which setting names the sandboxes' interpreter: the sandbox's own, else the project's.
fn python_setting(
    sandbox: Option<std::ffi::OsString>,
    project: Option<std::ffi::OsString>,
) -> Option<(&'static str, std::ffi::OsString)> {
    sandbox
        .map(|v| (SANDBOX_PYTHON_ENV, v))
        .or(project.map(|v| (PYTHON_ENV, v)))
}

fn find_python() -> PathBuf {
    let name = python_setting(env_value(SANDBOX_PYTHON_ENV), env_value(PYTHON_ENV))
        .map(|(_, v)| PathBuf::from(v))
        .unwrap_or_else(|| PathBuf::from("python3"));
    if name.components().count() > 1 || name.is_absolute() {
        // A path: make it absolute but do not resolve symlinks (a venv's python is a
        // symlink, and resolving it would leave the venv).
        if name.is_absolute() {
            return name;
        }
        return std::env::current_dir()
            .map(|d| d.join(&name))
            .unwrap_or(name);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let cand = dir.join(&name);
            if cand.is_file() {
                return cand;
            }
        }
    }
    name
}

/// Why a sandbox could not be created.
#[derive(Debug, thiserror::Error)]
pub enum LocalSandboxError {
    #[error("task `{0}` carries no repository files; image-based tasks need a container sandbox, the local sandbox only runs tasks with inline `files`")]
    NoFiles(String),
    #[error("task file path `{0}` is not a safe relative path (absolute or containing `..`); fix the task record")]
    UnsafePath(String),
    #[error("sandbox I/O failed while {context}: {source} (check free disk space and permissions of the sandbox root)")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "`git {args}` failed while preparing the sandbox (is git installed and on PATH?): {output}"
    )]
    Git { args: String, output: String },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> LocalSandboxError {
    let context = context.into();
    move |source| LocalSandboxError::Io { context, source }
}

/// Output of an internal git invocation.
#[derive(Debug, Clone)]
pub struct GitOutput {
    pub success: bool,
    pub stdout: Vec<u8>,
    pub stderr: String,
}

/// A repository in a temporary directory, removed on drop.
pub struct LocalSandbox {
    dir: Option<tempfile::TempDir>,
    /// Canonical `O` (see the module docs), which tags the sandbox's processes.
    outer: PathBuf,
    /// `T` = `O/home`.
    home: PathBuf,
    repo: PathBuf,
    /// `O/state`: the tools' state, the final-directory file (commands write it).
    state: PathBuf,
    /// `O/ctl`: the command file, scratch files (commands read them only).
    ctl: PathBuf,
    /// `O/bin`: tools and shims.
    bin: PathBuf,
    /// `O/book`: bookkeeping git directory, config and indexes (never shown to commands).
    book: PathBuf,
    cwd: PathBuf,
    base: String,
    /// The whole environment of commands.
    env: Vec<(String, String)>,
    /// The whole environment of the worker's own git (config in `book`).
    git_env: Vec<(String, String)>,
    /// `git` on that environment's PATH, as a path: std starts a program named by path
    /// with posix_spawn, but looks a bare name up with a fork when the environment sets
    /// PATH, copying the worker's page tables for each of an episode's git calls.
    git_program: PathBuf,
    /// See [`GIT_TIMEOUT`].
    git_timeout: Duration,
    output_cap: usize,
    confinement: Confinement,
    /// The interpreter the shims start, as its path: output spells it `python` (it
    /// names itself by that path in messages such as `…/python: can't open file`), so
    /// what the agent sees does not depend on where the project is checked out.
    python_path: String,
    /// What a confined command sees of the Python interpreter (read-only).
    python_view: Vec<PathBuf>,
    /// The floor under the free space of the sandbox's file system
    /// ([`crate::sandbox::Limits::min_free_disk_bytes`]; `None`: no floor).
    disk_floor: Option<DiskFloor>,
    /// The memory a command's processes may hold together
    /// ([`crate::sandbox::Limits::memory_bytes`]; `None`: no ceiling).
    memory_ceiling: Option<MemoryCeiling>,
    /// Set at the disk floor: why no command runs any more.
    stopped: Option<Stopped>,
}

impl LocalSandbox {
    /// Creates the sandbox under `root` (default: the system temp dir), writes the task's
    /// files and commits them as the base commit. Confined as [`Confinement::detected`]
    /// finds possible; a worker chooses with [`Self::create_confined`].
    pub fn create(task: &TaskRecord, root: Option<&Path>) -> Result<Self, LocalSandboxError> {
        Self::create_owned(task, root, None)
    }

    /// As `create`, with the directory named after `owner` (a worker), so that a
    /// restarted owner finds what its killed predecessor left (`remove_local_orphans`).
    pub fn create_owned(
        task: &TaskRecord,
        root: Option<&Path>,
        owner: Option<&str>,
    ) -> Result<Self, LocalSandboxError> {
        Self::create_confined(task, root, owner, &Confinement::detected())
    }

    /// As `create_owned`, with commands run as `confinement` says.
    pub fn create_confined(
        task: &TaskRecord,
        root: Option<&Path>,
        owner: Option<&str>,
        confinement: &Confinement,
    ) -> Result<Self, LocalSandboxError> {
        if task.files.is_empty() {
            return Err(LocalSandboxError::NoFiles(task.instance_id.clone()));
        }
        let prefix = owner
            .map(owned_prefix)
            .unwrap_or_else(|| "tutor-sbx-".into());
        let builder = {
            let mut b = tempfile::Builder::new();
            b.prefix(&prefix);
            b
        };
        let dir = match root {
            Some(r) => {
                std::fs::create_dir_all(r).map_err(io_err(format!("creating {}", r.display())))?;
                builder.tempdir_in(r)
            }
            None => builder.tempdir(),
        }
        .map_err(io_err("creating the sandbox directory"))?;
        // Canonical, because bash reports the physical cwd and we compare against it.
        let outer = dir
            .path()
            .canonicalize()
            .map_err(io_err("resolving the sandbox directory"))?;
        let home = outer.join("home");
        let repo = home.join("repo");
        let state = outer.join("state");
        let ctl = outer.join("ctl");
        let bin = outer.join("bin");
        let book = outer.join("book");
        for d in [&repo, &home.join("tmp"), &state, &ctl, &bin, &book] {
            std::fs::create_dir_all(d).map_err(io_err(format!("creating {}", d.display())))?;
        }

        let python = python_interpreter();
        write_shims(&bin, &python)?;
        write_tools(&bin)?;
        let mut path_var = bin.display().to_string();
        if let Some(pdir) = python.parent().filter(|p| !p.as_os_str().is_empty()) {
            path_var.push(':');
            path_var.push_str(&pdir.display().to_string());
        }
        path_var.push(':');
        if confinement.is_confined() {
            path_var.push_str(SYSTEM_PATH);
        } else {
            let inherited = std::env::var("PATH").unwrap_or_else(|_| SYSTEM_PATH.into());
            path_var.push_str(&inherited);
        }

        let gitconfig = format!(
            "[user]\n\tname = {GIT_NAME}\n\temail = {GIT_EMAIL}\n[commit]\n\tgpgsign = false\n\
             [tag]\n\tgpgsign = false\n[core]\n\thooksPath = /dev/null\n\tpager = cat\n\
             [init]\n\tdefaultBranch = main\n[advice]\n\tdetachedHead = false\n"
        );
        // The commands' own (theirs to change) and the worker's (out of their reach).
        let home_gitconfig = home.join(".gitconfig");
        let book_gitconfig = book.join("gitconfig");
        for p in [&home_gitconfig, &book_gitconfig] {
            std::fs::write(p, &gitconfig).map_err(io_err(format!("writing {}", p.display())))?;
        }

        let s = |v: &Path| v.display().to_string();
        let env: Vec<(String, String)> = vec![
            ("PATH".into(), path_var),
            ("HOME".into(), s(&home)),
            ("REPO".into(), s(&repo)),
            ("TMPDIR".into(), s(&home.join("tmp"))),
            ("LANG".into(), "C.UTF-8".into()),
            ("LC_ALL".into(), "C.UTF-8".into()),
            ("TERM".into(), "dumb".into()),
            ("PAGER".into(), "cat".into()),
            ("GIT_PAGER".into(), "cat".into()),
            ("MANPAGER".into(), "cat".into()),
            ("PYTHONDONTWRITEBYTECODE".into(), "1".into()),
            ("PYTHONUNBUFFERED".into(), "1".into()),
            // Set and dict-of-str orders in output stay the same from run to run.
            ("PYTHONHASHSEED".into(), "0".into()),
            ("PIP_DISABLE_PIP_VERSION_CHECK".into(), "1".into()),
            ("GIT_CONFIG_NOSYSTEM".into(), "1".into()),
            ("GIT_CONFIG_GLOBAL".into(), s(&home_gitconfig)),
            ("GIT_TERMINAL_PROMPT".into(), "0".into()),
            ("GIT_AUTHOR_NAME".into(), GIT_NAME.into()),
            ("GIT_AUTHOR_EMAIL".into(), GIT_EMAIL.into()),
            ("GIT_COMMITTER_NAME".into(), GIT_NAME.into()),
            ("GIT_COMMITTER_EMAIL".into(), GIT_EMAIL.into()),
            ("GIT_AUTHOR_DATE".into(), GIT_DATE.into()),
            ("GIT_COMMITTER_DATE".into(), GIT_DATE.into()),
            // Tags every process of this sandbox, so Drop can find ones that left the
            // process group (setsid, daemons).
            (SANDBOX_TAG.into(), s(&outer)),
            // The tools (crate::tools) keep the viewer state here and show repository
            // paths as `~/repo/...`.
            ("TUTOR_STATE_DIR".into(), s(&state)),
            ("TUTOR_REPO".into(), s(&repo)),
            ("TUTOR_REPO_DISPLAY".into(), REPO_DISPLAY.into()),
        ];
        // The worker's git: the same, but its home and global config are in `book`, which
        // no command can write (a filter or an fsmonitor there would run on the host).
        let git_env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| match k.as_str() {
                "HOME" | "TMPDIR" => (k.clone(), s(&book)),
                "GIT_CONFIG_GLOBAL" => (k.clone(), s(&book_gitconfig)),
                _ => (k.clone(), v.clone()),
            })
            .chain([("XDG_CONFIG_HOME".to_string(), s(&book.join(".config")))])
            .collect();
        let git_program = git_env
            .iter()
            .find(|(k, _)| k == "PATH")
            .and_then(|(_, path)| {
                std::env::split_paths(path)
                    .map(|d| d.join("git"))
                    .find(|p| p.is_absolute() && p.is_file())
            })
            .unwrap_or_else(|| PathBuf::from("git"));

        for f in &task.files {
            let rel =
                safe_rel(&f.path).ok_or_else(|| LocalSandboxError::UnsafePath(f.path.clone()))?;
            let dest = repo.join(rel);
            if let Some(parent) = dest.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(io_err(format!("creating {}", parent.display())))?;
            }
            std::fs::write(&dest, &f.content).map_err(io_err(format!("writing {}", f.path)))?;
        }

        let python_view = if confinement.is_confined() {
            crate::sandbox::confine::python_view(&python)
                .iter()
                .filter(|p| !outer.starts_with(p))
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        let min_free = confinement.limits().min_free_disk_bytes;
        let disk_floor = match min_free {
            0 => None,
            bytes => Some(
                DiskFloor::open(&outer, bytes)
                    .map_err(io_err("opening the sandbox directory for its disk floor"))?,
            ),
        };
        let mut sb = LocalSandbox {
            dir: Some(dir),
            outer,
            home,
            repo: repo.clone(),
            state,
            ctl,
            bin,
            book,
            cwd: repo,
            base: String::new(),
            env,
            git_env,
            git_program,
            git_timeout: GIT_TIMEOUT,
            python_path: python.display().to_string(),
            output_cap: DEFAULT_OUTPUT_CAP,
            confinement: confinement.clone(),
            python_view,
            disk_floor,
            memory_ceiling: match confinement.limits().memory_bytes {
                0 => None,
                bytes => Some(MemoryCeiling { bytes }),
            },
            stopped: None,
        };
        sb.git_ok(&["init", "-q"])?;
        // Appended in one write rather than a `git config` per key (each a process: a
        // third of sandbox creation). A later section adds to the one `init` wrote. No
        // automatic gc or maintenance: the commit below would start one in the background.
        let config = sb.repo.join(".git/config");
        let mut text = std::fs::read_to_string(&config).map_err(io_err("reading .git/config"))?;
        text.push_str(&format!(
            "[user]\n\tname = {GIT_NAME}\n\temail = {GIT_EMAIL}\n[commit]\n\tgpgsign = false\n\
             [core]\n\thooksPath = /dev/null\n\tautocrlf = false\n[gc]\n\tauto = 0\n\
             [maintenance]\n\tauto = false\n"
        ));
        std::fs::write(&config, text).map_err(io_err("writing .git/config"))?;
        // Byte-code and pytest caches never belong in a submission.
        let exclude = sb.repo.join(".git/info/exclude");
        if let Some(p) = exclude.parent() {
            std::fs::create_dir_all(p).map_err(io_err("creating .git/info"))?;
        }
        std::fs::write(&exclude, SUBMISSION_EXCLUDE)
            .map_err(io_err("writing .git/info/exclude"))?;
        sb.git_ok(&["add", "-A"])?;
        sb.git_ok(&["commit", "-q", "--no-verify", "--no-gpg-sign", "-m", "base"])?;
        let head = sb.git_ok(&["rev-parse", "HEAD"])?;
        sb.base = String::from_utf8_lossy(&head).trim().to_string();
        sb.init_bookkeeping()?;
        // A root worker's commands run as another user: what they write is theirs.
        if let Some((uid, gid)) = confinement.sandbox_owner() {
            for d in [&sb.home, &sb.state] {
                chown_tree(d, uid, gid)
                    .map_err(io_err(format!("handing {} to uid {uid}", d.display())))?;
            }
        }
        Ok(sb)
    }

    /// How this sandbox's commands are confined.
    pub fn confinement(&self) -> &Confinement {
        &self.confinement
    }

    /// The bookkeeping git directory (see [`BOOKKEEPING_CONFIG`]): our config only, the
    /// repository's objects borrowed through `objects/info/alternates`.
    fn init_bookkeeping(&self) -> Result<(), LocalSandboxError> {
        let book = self.bookkeeping_dir();
        let book_s = book.display().to_string();
        self.git_ok(&["init", "-q", "--bare", &book_s])?;
        let objects = self.repo.join(".git/objects");
        let write = |rel: &str, text: String| {
            let path = book.join(rel);
            if let Some(p) = path.parent() {
                std::fs::create_dir_all(p).map_err(io_err(format!("creating {}", p.display())))?;
            }
            std::fs::write(&path, text).map_err(io_err(format!("writing {}", path.display())))
        };
        write(
            "objects/info/alternates",
            format!("{}\n", objects.display()),
        )?;
        write("info/exclude", SUBMISSION_EXCLUDE.to_string())
    }

    /// The bookkeeping git directory (tests break it to make the sandbox's git fail).
    pub(crate) fn bookkeeping_dir(&self) -> PathBuf {
        self.book.join("bookkeeping.git")
    }

    /// Git against [`Self::init_bookkeeping`]'s directory, with the repository as its work
    /// tree.
    fn git_book(
        &self,
        args: &[&str],
        stdin: Option<&[u8]>,
        extra_env: &[(&str, &str)],
    ) -> std::io::Result<GitOutput> {
        let all = self.book_args(args);
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        self.git_env(&all, stdin, extra_env)
    }

    /// `args` preceded by what points git at the bookkeeping directory.
    fn book_args(&self, args: &[&str]) -> Vec<String> {
        let mut all = vec![
            "--git-dir".to_string(),
            self.bookkeeping_dir().display().to_string(),
            "--work-tree".to_string(),
            self.repo.display().to_string(),
        ];
        for (k, v) in BOOKKEEPING_CONFIG {
            all.push("-c".into());
            all.push(format!("{k}={v}"));
        }
        all.extend(args.iter().map(|a| a.to_string()));
        all
    }

    /// [`Self::git_book`], `Err` with git's message unless it succeeds.
    fn git_book_checked(&self, args: &[&str], extra_env: &[(&str, &str)]) -> std::io::Result<()> {
        let out = self.git_book(args, None, extra_env)?;
        if out.success {
            Ok(())
        } else {
            Err(std::io::Error::other(format!(
                "git {}: {}",
                args.join(" "),
                out.stderr.trim()
            )))
        }
    }

    /// Bookkeeping git with its stdout read as it comes (see [`GitStream`]).
    fn git_book_stream(
        &self,
        args: &[&str],
        extra_env: &[(&str, &str)],
    ) -> std::io::Result<GitStream> {
        let stderr_path = self.book.join("git-stderr");
        let stderr = File::create(&stderr_path)?;
        let mut cmd = self.git_command(&self.book_args(args), extra_env);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr));
        let mut child = cmd.spawn()?;
        let watchdog = GitWatchdog::start(&child, self.git_timeout);
        let out = BufReader::new(child.stdout.take().expect("stdout is piped"));
        Ok(GitStream {
            child,
            out,
            stderr_path,
            what: args.iter().take(2).copied().collect::<Vec<_>>().join(" "),
            watchdog: Some(watchdog),
        })
    }

    /// Sets how long one of the worker's own git calls may run (default [`GIT_TIMEOUT`]).
    pub fn set_git_timeout(&mut self, limit: Duration) {
        self.git_timeout = limit;
    }

    /// Sets the cap (bytes) on captured output per command.
    pub fn set_output_cap(&mut self, bytes: usize) {
        self.output_cap = bytes.max(2);
    }

    /// The repository root (absolute, canonical).
    pub fn root(&self) -> &Path {
        &self.repo
    }

    /// The sandbox's home directory (`T`), which holds the repo.
    pub fn home(&self) -> &Path {
        &self.home
    }

    /// A scratch directory outside the repository (never part of a diff) that commands
    /// can read but not write (when confined). Write to it between commands.
    pub fn scratch_dir(&self) -> &Path {
        &self.ctl
    }

    /// Hash of the base commit every diff is taken against.
    pub fn base_commit(&self) -> &str {
        &self.base
    }

    /// Current directory as shown to the model: `~/repo[/sub]`, `~[/sub]`, or absolute.
    pub fn cwd(&self) -> String {
        if let Ok(rel) = self.cwd.strip_prefix(&self.repo) {
            if rel.as_os_str().is_empty() {
                return REPO_DISPLAY.to_string();
            }
            return format!("{REPO_DISPLAY}/{}", rel.display());
        }
        if let Ok(rel) = self.cwd.strip_prefix(&self.home) {
            if rel.as_os_str().is_empty() {
                return "~".to_string();
            }
            return format!("~/{}", rel.display());
        }
        spell_sandbox_paths(&self.cwd.display().to_string(), &self.home)
    }

    /// The file the tools have open, as shown in the footer (`~/repo/...`), if any.
    pub fn current_file(&self) -> Option<String> {
        // Written by the tools, so by the commands: never through a link they planted.
        let f = read_written_by_commands(&self.state.join("current_file"), 4096)?;
        let f = f.trim();
        (!f.is_empty()).then(|| spell_sandbox_paths(f, &self.home))
    }

    /// True when the current directory is the repository root.
    pub fn at_root(&self) -> bool {
        self.cwd == self.repo
    }

    /// Reads a file relative to the repository root (`None` if missing, not a regular
    /// file, or the path escapes the repo, also through a link). Invalid UTF-8 is replaced.
    pub fn read_file(&self, rel: &str) -> Option<String> {
        let p = self.repo.join(safe_rel(rel)?).canonicalize().ok()?;
        // A link the agent made to the run's token, or a FIFO that would block forever.
        if !p.starts_with(&self.repo) || !std::fs::metadata(&p).ok()?.is_file() {
            return None;
        }
        let bytes = std::fs::read(p).ok()?;
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// A file's content at the base commit (`None` if it did not exist there).
    pub fn base_file(&self, rel: &str) -> Option<String> {
        safe_rel(rel)?;
        let spec = format!("{}:{}", self.base, rel.trim_start_matches("./"));
        let out = self
            .git_book(&["cat-file", "blob", &spec], None, &[])
            .ok()?;
        out.success
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Current `HEAD` (differs from the base if the agent committed).
    pub fn head(&self) -> Option<String> {
        let out = self
            .git(&["rev-parse", "-q", "--verify", "HEAD"], None)
            .ok()?;
        out.success
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// The submission (see [`Sandbox::submission`]): every text change relative to the
    /// base commit, new files included, as a git-apply-able patch, on a private index so
    /// the agent's staging area is untouched. Untracked files over
    /// [`MAX_UNTRACKED_FILE_BYTES`] are never added to that index; binary changes are reset
    /// in it to the base; the diff is read up to [`MAX_SUBMISSION_BYTES`] + 1 bytes and git
    /// is killed past that ("too large"). Every git output is streamed, never held whole.
    /// An empty patch if git fails (e.g. the agent deleted `.git`; logged).
    pub fn submission(&self) -> Submission {
        match self.submission_inner() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "sandbox submission: git failed; no patch");
                Submission::default()
            }
        }
    }

    /// [`Self::submission`]'s patch (empty when too large).
    pub fn diff(&self) -> String {
        self.submission().patch
    }

    fn submission_inner(&self) -> std::io::Result<Submission> {
        let mut sub = Submission::default();
        let index = self.book.join("diff-index");
        let _ = std::fs::remove_file(&index);
        let index_s = index.display().to_string();
        let env = [("GIT_INDEX_FILE", index_s.as_str())];
        self.git_book_checked(&["read-tree", &self.base], &env)?;

        // 1. Untracked files over the cap: named, and excluded from `add` (pathspecs from
        // a NUL-separated file, so any file name is taken literally).
        let spec = self.book.join("submission-add.pathspecs");
        let mut specs = BufWriter::new(File::create(&spec)?);
        specs.write_all(b".\0")?;
        let mut git =
            self.git_book_stream(&["ls-files", "-o", "--exclude-standard", "-z"], &env)?;
        let mut rec = Vec::new();
        while next_record(&mut git.out, &mut rec)? {
            let rel = Path::new(std::ffi::OsStr::from_bytes(&rec));
            let Ok(meta) = std::fs::symlink_metadata(self.repo.join(rel)) else {
                continue; // gone meanwhile: `add` will not see it either
            };
            if meta.is_file() && meta.len() > MAX_UNTRACKED_FILE_BYTES {
                specs.write_all(b":(exclude,literal)")?;
                specs.write_all(&rec)?;
                specs.write_all(b"\0")?;
                sub.leave_out(lossy(&rec), LeftOutReason::Large(meta.len()));
            }
        }
        git.finish()?;
        specs.into_inner().map_err(|e| e.into_error())?;
        let from = format!("--pathspec-from-file={}", spec.display());
        self.git_book_checked(&["add", "-A", &from, "--pathspec-file-nul"], &env)?;

        // 2. Binary changes (numstat shows `-\t-\t` for them): reset to the base.
        let binaries = self.book.join("submission-binary.pathspecs");
        let mut paths = BufWriter::new(File::create(&binaries)?);
        let mut any = false;
        let numstat = [
            "diff",
            "--cached",
            "--numstat",
            "-z",
            "--no-renames",
            &self.base,
            "--",
        ];
        let mut git = self.git_book_stream(&numstat, &env)?;
        while next_record(&mut git.out, &mut rec)? {
            if let Some(path) = rec.strip_prefix(b"-\t-\t") {
                paths.write_all(path)?;
                paths.write_all(b"\0")?;
                sub.leave_out(lossy(path), LeftOutReason::Binary);
                any = true;
            }
        }
        git.finish()?;
        paths.into_inner().map_err(|e| e.into_error())?;
        if any {
            let from = format!("--pathspec-from-file={}", binaries.display());
            let env = [env[0], ("GIT_LITERAL_PATHSPECS", "1")];
            let args = ["reset", "-q", &self.base, &from, "--pathspec-file-nul"];
            self.git_book_checked(&args, &env)?;
        }

        // 3. The diff, never more of it than the cap + 1 bytes.
        let mut git = self.git_book_stream(
            &[
                "diff",
                "--cached",
                "--binary",
                "--no-color",
                "--no-ext-diff",
                "--no-textconv",
                "--no-renames",
                "--src-prefix=a/",
                "--dst-prefix=b/",
                &self.base,
                "--",
            ],
            &env,
        )?;
        let mut patch = Vec::new();
        (&mut git.out)
            .take(MAX_SUBMISSION_BYTES as u64 + 1)
            .read_to_end(&mut patch)?;
        if patch.len() > MAX_SUBMISSION_BYTES {
            drop(git); // killed: the rest is not wanted
            sub.too_large = Some(patch.len() as u64);
            return Ok(sub);
        }
        git.finish()?;
        sub.patch = String::from_utf8_lossy(&patch).into_owned();
        Ok(sub)
    }

    /// Paths changed relative to the base commit (added, modified or deleted).
    pub fn changed_files(&self) -> Vec<String> {
        self.try_changed_files().unwrap_or_default()
    }

    /// [`Self::changed_files`]; `None` if git failed.
    pub fn try_changed_files(&self) -> Option<Vec<String>> {
        let b = self.diff_cached(&["--name-only", "-z", "--no-renames"])?;
        Some(
            b.split(|&c| c == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect(),
        )
    }

    fn diff_cached(&self, extra: &[&str]) -> Option<Vec<u8>> {
        let index = self.book.join("diff-index");
        let _ = std::fs::remove_file(&index);
        let index_s = index.display().to_string();
        let env = [("GIT_INDEX_FILE", index_s.as_str())];
        let steps: [&[&str]; 2] = [&["read-tree", &self.base], &["add", "-A", "--", "."]];
        for args in steps {
            let out = self.git_book(args, None, &env).ok()?;
            if !out.success {
                tracing::warn!(args = ?args, stderr = %out.stderr, "sandbox diff: git failed");
                return None;
            }
        }
        let mut args = vec!["diff", "--cached"];
        args.extend_from_slice(extra);
        args.push(&self.base);
        args.push("--");
        let out = self.git_book(&args, None, &env).ok()?;
        if !out.success {
            tracing::warn!(stderr = %out.stderr, "sandbox diff: git diff failed");
            return None;
        }
        Some(out.stdout)
    }

    /// Contents of the files `patch` touches once applied to the base commit (`None` for
    /// files it deletes), computed on a private index without touching the working tree.
    /// `Err` with git's message if the patch does not apply to the base.
    pub fn apply_to_base(
        &self,
        patch: &str,
    ) -> Result<BTreeMap<String, Option<String>>, SandboxError> {
        let index = self.book.join("apply-index");
        let _ = std::fs::remove_file(&index);
        let index_s = index.display().to_string();
        let env = [("GIT_INDEX_FILE", index_s.as_str())];
        let run = |args: &[&str], stdin: Option<&[u8]>| -> Result<GitOutput, SandboxError> {
            self.git_book(args, stdin, &env)
                .map_err(|e| SandboxError::Backend(Box::new(e)))
        };
        let out = run(&["read-tree", &self.base], None)?;
        if !out.success {
            return Err(SandboxError::Git(out.stderr));
        }
        let mut body = patch.to_string();
        if !body.ends_with('\n') {
            body.push('\n');
        }
        let out = run(&["apply", "--cached", "-"], Some(body.as_bytes()))?;
        if !out.success {
            return Err(SandboxError::Git(out.stderr));
        }
        let mut files = BTreeMap::new();
        for path in crate::tasks::patch_files(patch)
            .into_iter()
            .chain(renamed_sources(patch))
        {
            let out = run(&["cat-file", "blob", &format!(":{path}")], None)?;
            let content = out
                .success
                .then(|| String::from_utf8_lossy(&out.stdout).into_owned());
            files.insert(path, content);
        }
        Ok(files)
    }

    /// Runs git in the repository with the sandbox environment (no shell, no timeout: only
    /// for quick local operations).
    pub fn git(&self, args: &[&str], stdin: Option<&[u8]>) -> std::io::Result<GitOutput> {
        self.git_env(args, stdin, &[])
    }

    /// `git` with the sandbox's environment and our `-c` flags, in the repository.
    fn git_command<S: AsRef<std::ffi::OsStr>>(
        &self,
        args: &[S],
        extra_env: &[(&str, &str)],
    ) -> Command {
        let mut cmd = Command::new(&self.git_program);
        cmd.args([
            "-c",
            "core.quotepath=off",
            "-c",
            "diff.noprefix=false",
            "-c",
            "core.hooksPath=/dev/null",
            // A root worker's sandbox belongs to the sandbox's user.
            "-c",
            "safe.directory=*",
        ])
        .args(args)
        .current_dir(&self.repo)
        .env_clear()
        .envs(self.git_env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .envs(extra_env.iter().copied());
        // Its own process group, so that a watchdog can end git with whatever it started.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        cmd
    }

    fn git_env(
        &self,
        args: &[&str],
        stdin: Option<&[u8]>,
        extra_env: &[(&str, &str)],
    ) -> std::io::Result<GitOutput> {
        let mut cmd = self.git_command(args, extra_env);
        cmd.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = cmd.spawn()?;
        let watchdog = GitWatchdog::start(&child, self.git_timeout);
        if let (Some(data), Some(mut w)) = (stdin, child.stdin.take()) {
            // Ignore EPIPE: git may stop reading early; its exit status tells the story.
            let _ = w.write_all(data);
        }
        let out = child.wait_with_output()?;
        watchdog.finish(args.iter().take(2).copied().collect::<Vec<_>>().join(" "))?;
        Ok(GitOutput {
            success: out.status.success(),
            stdout: out.stdout,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    fn git_ok(&self, args: &[&str]) -> Result<Vec<u8>, LocalSandboxError> {
        let out = self.git(args, None).map_err(|e| LocalSandboxError::Git {
            args: args.join(" "),
            output: e.to_string(),
        })?;
        if !out.success {
            return Err(LocalSandboxError::Git {
                args: args.join(" "),
                output: out.stderr,
            });
        }
        Ok(out.stdout)
    }

    /// Runs `command` with bash in the current directory. See the module docs for the
    /// process-group, timeout and output-cap behaviour. Never panics; failures to start
    /// bash are reported as output with exit code 127.
    pub fn run(&mut self, command: &str, timeout: Duration) -> CommandOutput {
        match self.run_inner(command, timeout) {
            Ok(o) => o,
            Err(e) => CommandOutput {
                output: format!("sandbox error: could not run the command: {e}\n"),
                exit_code: 127,
                timed_out: false,
            },
        }
    }

    /// Stops the sandbox at its disk floor: logged, and, unconfined, the `setsid`
    /// daemons of its commands killed at once (confined, a command's pid namespace ends
    /// with it), not when the sandbox is dropped. Returns `stop`.
    fn stop_at_floor(&mut self, stop: Stopped) -> Stopped {
        tracing::warn!(sandbox = %self.outer.display(), "{}", stop.why);
        if !self.confinement.is_confined() {
            kill_tagged(&format!("{SANDBOX_TAG}={}", self.outer.display()));
        }
        self.stopped = Some(stop.clone());
        stop
    }

    fn run_inner(&mut self, command: &str, timeout: Duration) -> std::io::Result<CommandOutput> {
        if let Some(stop) = &self.stopped {
            return Ok(CommandOutput {
                output: format!("{}\n", stop.why),
                exit_code: 1,
                timed_out: false,
            });
        }
        if let Some(what) = self.disk_floor.as_ref().and_then(DiskFloor::crossed) {
            // Nothing runs here on a full disk, whoever filled it (`Sandbox::stopped`).
            let stop = self.stop_at_floor(floor_stop(&what, "the command was not run", false));
            return Ok(CommandOutput {
                output: format!("{}\n", stop.why),
                exit_code: 1,
                timed_out: false,
            });
        }
        let cmd_file = self.ctl.join("command.sh");
        let cwd_file = self.state.join("cwd");
        write_fresh(&cmd_file, command.as_bytes())?;
        let _ = std::fs::remove_file(&cwd_file);
        let confined = self.confinement.is_confined();
        let mut binds = Vec::new();
        if confined {
            // `T/tmp` is the command's `/tmp`; a command may have replaced it (with a link
            // to anywhere) through `T`.
            let tmp = self.home.join("tmp");
            if !std::fs::symlink_metadata(&tmp).is_ok_and(|m| m.is_dir()) {
                let _ = std::fs::remove_file(&tmp);
                std::fs::create_dir(&tmp)?;
                if let Some((uid, gid)) = self.confinement.sandbox_owner() {
                    std::os::unix::fs::lchown(&tmp, Some(uid), Some(gid))?;
                }
            }
            binds.push(Bind {
                src: tmp,
                dest: PathBuf::from("/tmp"),
                writable: true,
            });
            binds.extend(self.python_view.iter().map(|p| Bind::read_only(p)));
            binds.extend([
                Bind::writable(&self.home),
                Bind::read_only(&self.bin),
                Bind::read_only(&self.ctl),
                Bind::writable(&self.state),
            ]);
        }
        let mut env = self.env.clone();
        let s = |p: &Path| p.display().to_string();
        env.extend([
            ("TUTOR_CWD_FILE".to_string(), s(&cwd_file)),
            ("TUTOR_CMD_FILE".to_string(), s(&cmd_file)),
            ("TUTOR_START_DIR".to_string(), s(&self.cwd)),
        ]);
        // The trap records the final directory even when the command calls `exit`. A
        // start directory that is gone falls back to the repository, then home.
        let script = "trap 'pwd >\"$TUTOR_CWD_FILE\" 2>/dev/null' EXIT\n\
            cd -- \"$TUTOR_START_DIR\" 2>/dev/null || cd -- \"$REPO\" 2>/dev/null || cd\n\
            . \"$TUTOR_CMD_FILE\"";
        let cmd = self
            .confinement
            .command(&binds, &self.home, script, &env, timeout)?;
        let isolation = if self.confinement.is_confined() {
            Isolation::ByCommand
        } else {
            Isolation::Here
        };
        let (mut out, disk_low) = run_in_own_group(
            cmd,
            timeout,
            self.output_cap,
            isolation,
            self.disk_floor.as_ref(),
            self.memory_ceiling,
        )?;
        if let Some(low) = disk_low {
            let done = match low.while_running {
                true => "the command was killed",
                false => "it was under it when the command ended",
            };
            let stop = self.stop_at_floor(floor_stop(&low.what, done, true));
            out.output.push_str(&format!("\n{}\n", stop.why));
        }
        // bash names the script it sources in its messages (`…/ctl/command.sh: line 1:
        // submit: command not found`): the agent sees `bash:` as in a terminal. Other paths
        // of the sandbox's temporary directory are spelled as commands can spell them.
        let script_name = format!("{}: ", cmd_file.display());
        if out.output.contains(&script_name) {
            out.output = out
                .output
                .split_inclusive('\n')
                .map(|l| match l.strip_prefix(&script_name) {
                    Some(rest) => format!("bash: {rest}"),
                    None => l.to_string(),
                })
                .collect();
        }
        out.output = spell_sandbox_paths(&out.output, &self.home);
        out.output = replace_path(&out.output, &self.python_path, "python");
        if let Some(p) = read_written_by_commands(&cwd_file, 8192) {
            let p = PathBuf::from(p.trim_end_matches('\n'));
            // Confined, the directory is in the command's view, not necessarily the host's.
            if p.is_absolute() && (confined || p.is_dir()) {
                self.cwd = p;
            }
        }
        Ok(out)
    }
}

/// What of `dir`'s file system is under a disk floor of `bytes` (see
/// [`crate::sandbox::Limits::min_free_disk_bytes`]), said for a person; `None`: nothing.
/// `dir` is created if missing.
pub fn disk_under_floor(dir: &Path, bytes: u64) -> Option<String> {
    if let Err(e) = std::fs::create_dir_all(dir) {
        return Some(format!("no directory there ({e})"));
    }
    match DiskFloor::open(dir, bytes) {
        Ok(floor) => floor.crossed(),
        Err(e) => Some(format!("a directory that cannot be opened ({e})")),
    }
}

/// A sandbox stopped at its disk floor: `what` is under it, `done` to the command.
fn floor_stop(what: &str, done: &str, by_own_command: bool) -> Stopped {
    let ends = match by_own_command {
        true => "unresolved, without tests",
        false => "ungraded",
    };
    Stopped {
        why: format!(
            "sandbox stopped: the disk holding it has {what}; {done}, and the episode ends \
             here ({ends})"
        ),
        by_own_command,
    }
}

/// `output` with the sandbox's temporary paths as commands can spell them: the home
/// directory `O/home` as `~` (so the repository is `~/repo`, as in the footer) and the
/// rest of `O` as `~/..`. The temporary directory's name is random and names the run and
/// worker: the model learns nothing from it, it would tell the agent where on the host it
/// is, and with it no two runs of one seed would see the same text.
fn spell_sandbox_paths(output: &str, home: &Path) -> String {
    let mut out = replace_path(output, &home.display().to_string(), "~");
    if let Some(root) = home.parent().filter(|r| r.parent().is_some()) {
        out = replace_path(&out, &root.display().to_string(), "~/..");
    }
    out
}

/// Replaces `path` where it is a whole path or a path's leading components (followed by
/// `/` or by a character no file name goes on with), not where it starts a longer name.
fn replace_path(s: &str, path: &str, with: &str) -> String {
    if path.is_empty() || !s.contains(path) {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find(path) {
        let after = &rest[at + path.len()..];
        let boundary = after
            .chars()
            .next()
            .is_none_or(|c| !(c.is_alphanumeric() || "._-".contains(c)));
        out.push_str(&rest[..at]);
        out.push_str(if boundary { with } else { path });
        rest = after;
    }
    out.push_str(rest);
    out
}

impl Sandbox for LocalSandbox {
    fn run(&mut self, command: &str, timeout: Duration) -> CommandOutput {
        LocalSandbox::run(self, command, timeout)
    }
    fn stopped(&self) -> Option<Stopped> {
        self.stopped.clone().or_else(|| {
            let what = self.disk_floor.as_ref().and_then(DiskFloor::crossed)?;
            Some(floor_stop(&what, "no more commands run", false))
        })
    }

    fn stopped_after_submission(&mut self) -> Option<Stopped> {
        if self.stopped.is_none() {
            let what = self.disk_floor.as_ref().and_then(DiskFloor::crossed)?;
            let done = "the submission's bookkeeping (git add) took it there";
            self.stop_at_floor(floor_stop(&what, done, true));
        }
        self.stopped.clone()
    }
    fn cwd(&self) -> String {
        LocalSandbox::cwd(self)
    }
    fn at_root(&self) -> bool {
        LocalSandbox::at_root(self)
    }
    fn repo_display(&self) -> &str {
        REPO_DISPLAY
    }
    fn current_file(&self) -> Option<String> {
        LocalSandbox::current_file(self)
    }
    fn base_commit(&self) -> &str {
        LocalSandbox::base_commit(self)
    }
    fn head(&self) -> Option<String> {
        LocalSandbox::head(self)
    }
    fn read_file(&self, rel: &str) -> Option<String> {
        LocalSandbox::read_file(self, rel)
    }
    fn base_file(&self, rel: &str) -> Option<String> {
        LocalSandbox::base_file(self, rel)
    }
    fn submission(&self) -> Submission {
        LocalSandbox::submission(self)
    }
    fn try_changed_files(&self) -> Option<Vec<String>> {
        LocalSandbox::try_changed_files(self)
    }
    fn apply_to_base(&self, patch: &str) -> Result<BTreeMap<String, Option<String>>, SandboxError> {
        LocalSandbox::apply_to_base(self, patch)
    }
    fn write_scratch(&mut self, name: &str, content: &str) -> Result<String, SandboxError> {
        let p = self.scratch_dir().join(name);
        write_fresh(&p, content.as_bytes())
            .map(|_| shell_quote(&p.display().to_string()))
            .map_err(|source| SandboxError::Write {
                name: name.to_string(),
                source,
            })
    }
    fn kind(&self) -> &'static str {
        "local"
    }
}

/// A running git whose stdout is read as it comes, so no output of it is ever held
/// whole; its stderr goes to a file. Dropped before [`GitStream::finish`], git is killed
/// (what it has not written yet is not wanted).
struct GitStream {
    child: std::process::Child,
    out: BufReader<std::process::ChildStdout>,
    stderr_path: PathBuf,
    /// The subcommand, for messages.
    what: String,
    watchdog: Option<GitWatchdog>,
}

/// Kills a git process's group when it runs past its limit (a hung filter, a huge
/// repository). Ended (and its thread with it) when dropped or finished.
struct GitWatchdog {
    stop: Option<std::sync::mpsc::Sender<()>>,
    fired: std::sync::Arc<std::sync::atomic::AtomicBool>,
    limit: Duration,
}

impl GitWatchdog {
    fn start(child: &std::process::Child, limit: Duration) -> Self {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let fired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let pgid = child.id() as libc::pid_t;
        let flag = fired.clone();
        let spawned = std::thread::Builder::new()
            .name("git-watchdog".into())
            .spawn(move || {
                // Only a timeout fires: a dropped sender (git done) ends the thread.
                if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(limit)
                {
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                    kill_group(pgid);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no watchdog thread for git: it runs without a limit");
        }
        Self {
            stop: Some(stop),
            fired,
            limit,
        }
    }

    /// Stops the watchdog; `Err` naming the limit if it had to kill git.
    fn finish(mut self, what: String) -> std::io::Result<()> {
        self.stop.take();
        if self.fired.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "git {what} ran past its limit of {} s and was killed",
                    self.limit.as_secs_f64()
                ),
            ));
        }
        Ok(())
    }
}

impl GitStream {
    /// Reads what is left of the output (dropping it) and waits for git; `Err` with its
    /// message unless it succeeded.
    fn finish(mut self) -> std::io::Result<()> {
        std::io::copy(&mut self.out, &mut std::io::sink())?;
        let status = self.child.wait()?;
        if let Some(watchdog) = self.watchdog.take() {
            watchdog.finish(self.what.clone())?;
        }
        if status.success() {
            return Ok(());
        }
        let mut stderr = String::new();
        if let Ok(f) = File::open(&self.stderr_path) {
            let mut bytes = Vec::new();
            let _ = f.take(4096).read_to_end(&mut bytes);
            stderr = String::from_utf8_lossy(&bytes).trim().to_string();
        }
        Err(std::io::Error::other(format!(
            "git {} ({status}): {stderr}",
            self.what
        )))
    }
}

impl Drop for GitStream {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // The whole group: what git started goes with it (see `git_command`).
            kill_group(self.child.id() as libc::pid_t);
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Reads the next NUL-terminated record of `out` into `rec` (without the NUL); false at
/// the end. Empty records are skipped.
fn next_record(out: &mut impl BufRead, rec: &mut Vec<u8>) -> std::io::Result<bool> {
    loop {
        rec.clear();
        if out.read_until(0, rec)? == 0 {
            return Ok(false);
        }
        if rec.last() == Some(&0) {
            rec.pop();
        }
        if !rec.is_empty() {
            return Ok(true);
        }
    }
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Source paths of renames/copies in a git patch (`rename from X`), which
/// [`crate::tasks::patch_files`] does not list.
fn renamed_sources(patch: &str) -> Vec<String> {
    patch
        .lines()
        .filter_map(|l| l.strip_prefix("rename from "))
        .map(|p| p.trim().to_string())
        .collect()
}

fn write_tools(bin: &Path) -> Result<(), LocalSandboxError> {
    use std::os::unix::fs::PermissionsExt;
    for (name, body) in crate::tools::tool_files(&bin.display().to_string()) {
        let p = bin.join(&name);
        std::fs::write(&p, body).map_err(io_err(format!("writing tool {name}")))?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))
            .map_err(io_err(format!("chmod tool {name}")))?;
    }
    Ok(())
}

fn write_shims(bin: &Path, python: &Path) -> Result<(), LocalSandboxError> {
    use std::os::unix::fs::PermissionsExt;
    // Shell shims rather than symlinks: a symlinked venv python would not find its
    // pyvenv.cfg and would lose the venv's packages.
    let py = shell_quote(&python.display().to_string());
    for (name, body) in [
        ("python", format!("#!/bin/sh\nexec {py} \"$@\"\n")),
        ("python3", format!("#!/bin/sh\nexec {py} \"$@\"\n")),
        ("pytest", format!("#!/bin/sh\nexec {py} -m pytest \"$@\"\n")),
    ] {
        let p = bin.join(name);
        std::fs::write(&p, body).map_err(io_err(format!("writing shim {name}")))?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))
            .map_err(io_err(format!("chmod shim {name}")))?;
    }
    Ok(())
}

/// Makes every directory under `p` writable/searchable so a tree the agent chmod'ed can be
/// removed.
fn make_writable(p: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(meta) = std::fs::symlink_metadata(p) else {
        return;
    };
    if meta.is_dir() {
        let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755));
        if let Ok(rd) = std::fs::read_dir(p) {
            for e in rd.flatten() {
                make_writable(&e.path());
            }
        }
    }
}

/// Writes `path` as a new file: whatever is there (a link a command planted, pointing
/// anywhere) is removed first, and the file is created exclusively, never through a link.
fn write_fresh(path: &Path, data: &[u8]) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    f.write_all(data)
}

/// The first `cap` bytes of a file commands write (the tools' current file, the final
/// directory), as text; `None` unless it is a regular file reached without a link (a
/// command could point it at the run's token).
fn read_written_by_commands(path: &Path, cap: u64) -> Option<String> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut bytes = Vec::new();
    f.take(cap).read_to_end(&mut bytes).ok()?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// Gives `root` and everything under it (links themselves, never what they point to) to
/// `uid:gid`.
fn chown_tree(root: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    std::os::unix::fs::lchown(root, Some(uid), Some(gid))?;
    let meta = std::fs::symlink_metadata(root)?;
    if meta.is_dir() {
        for e in std::fs::read_dir(root)? {
            chown_tree(&e?.path(), uid, gid)?;
        }
    }
    Ok(())
}

/// The directory-name prefix of `owner`'s sandboxes. The owner is reduced to
/// `[A-Za-z0-9_-]` and closed by a dot, so no owner's prefix is another's.
fn owned_prefix(owner: &str) -> String {
    let clean: String = owner
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("tutor-sbx-{clean}.")
}

/// Removes the local sandboxes `owner` left under `root` (default: the system temp dir)
/// when it was killed before it could drop them, with the processes still running in
/// them. Call it before the owner creates any sandbox. Returns how many it removed.
pub fn remove_local_orphans(root: Option<&Path>, owner: &str) -> usize {
    let root = root
        .map(Path::to_path_buf)
        .unwrap_or_else(std::env::temp_dir);
    let prefix = owned_prefix(owner);
    let Ok(rd) = std::fs::read_dir(&root) else {
        return 0;
    };
    let mut removed = 0;
    for e in rd.flatten() {
        if !e.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        let path = e.path();
        let home = path.canonicalize().unwrap_or_else(|_| path.clone());
        kill_tagged(&format!("{SANDBOX_TAG}={}", home.display()));
        make_writable(&path);
        match std::fs::remove_dir_all(&path) {
            Ok(()) => removed += 1,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "could not remove an orphaned sandbox")
            }
        }
    }
    removed
}

impl Drop for LocalSandbox {
    fn drop(&mut self) {
        kill_tagged(&format!("{SANDBOX_TAG}={}", self.outer.display()));
        if let Some(dir) = self.dir.take() {
            let path = dir.path().to_path_buf();
            if dir.close().is_err() {
                make_writable(&path);
                if let Err(e) = std::fs::remove_dir_all(&path) {
                    tracing::warn!(path = %path.display(), error = %e, "could not remove sandbox");
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {

    #[test]
    fn a_restarted_owner_removes_only_its_own_orphans() {
        let root = tempfile::tempdir().unwrap();
        let mk = |name: &str| {
            let d = root.path().join(name);
            std::fs::create_dir_all(d.join("repo")).unwrap();
            std::fs::write(d.join("repo/f"), "x").unwrap();
        };
        mk(&format!("{}abc", owned_prefix("run-w0")));
        mk(&format!("{}def", owned_prefix("run-w0")));
        mk(&format!("{}ghi", owned_prefix("run-w0-x")));
        mk("tutor-sbx-anonymous");
        assert_eq!(remove_local_orphans(Some(root.path()), "run-w0"), 2);
        let mut left: Vec<String> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, vec!["tutor-sbx-anonymous", "tutor-sbx-run-w0-x.ghi"]);
        assert_eq!(remove_local_orphans(Some(root.path()), "run-w0"), 0);
    }
    use super::*;
    use crate::sandbox::TIMEOUT_EXIT_CODE;

    #[test]
    fn the_sandbox_interpreter_wins_over_the_project_one() {
        let v = |s: &str| Some(std::ffi::OsString::from(s));
        assert_eq!(
            python_setting(v("/sbx/bin/python"), v("/proj/bin/python")),
            Some((SANDBOX_PYTHON_ENV, "/sbx/bin/python".into()))
        );
        assert_eq!(
            python_setting(None, v("/proj/bin/python")),
            Some((PYTHON_ENV, "/proj/bin/python".into()))
        );
        assert_eq!(python_setting(None, None), None);
    }
    use crate::tasks::RepoFileRecord;
    use std::time::Instant;

    pub(crate) fn tiny_task() -> TaskRecord {
        TaskRecord {
            instance_id: "t-1".into(),
            repo: "t/t".into(),
            base_commit: String::new(),
            problem_statement: String::new(),
            hints_text: String::new(),
            patch: String::new(),
            test_patch: String::new(),
            fail_to_pass: vec![],
            pass_to_pass: vec![],
            version: String::new(),
            files: vec![
                RepoFileRecord {
                    path: "a.txt".into(),
                    content: "hello\n".into(),
                },
                RepoFileRecord {
                    path: "sub/dir/b.txt".into(),
                    content: "b\n".into(),
                },
            ],
            image: String::new(),
            test_cmd: String::new(),
            log_parser: String::new(),
        }
    }

    const T: Duration = Duration::from_secs(10);

    /// Bytes available now on the temp dir's file system.
    pub(crate) fn temp_dir_available() -> u64 {
        DiskFloor::open(&std::env::temp_dir(), 1)
            .and_then(|f| f.available())
            .expect("fstatvfs of the temp dir")
            .0
    }

    /// The disk-floor tests move the temp dir's free space by hundreds of MiB, so they
    /// run one at a time, across test processes too (an exclusive `flock`); and only
    /// where 4 GiB are free (else they say so and pass: the floor is the machine's).
    pub(crate) fn disk_floor_test_lock() -> Option<std::fs::File> {
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(std::env::temp_dir().join("tutor-disk-floor-tests.lock"))
            .unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&lock);
        // SAFETY: flock on a descriptor we own; blocks until the other holder is done.
        assert_eq!(unsafe { libc::flock(fd, libc::LOCK_EX) }, 0);
        if temp_dir_available() < 4 << 30 {
            eprintln!("skipped: under 4 GiB free in the temp dir for the disk-floor tests");
            return None;
        }
        Some(lock)
    }

    /// A sandbox (confined where bwrap can) with `limits`.
    fn sandbox_with(limits: crate::sandbox::Limits) -> LocalSandbox {
        let confinement = Confinement::new(&crate::sandbox::ConfineSettings {
            allow_unconfined: true,
            limits,
            ..Default::default()
        })
        .unwrap();
        LocalSandbox::create_confined(&tiny_task(), None, None, &confinement).unwrap()
    }

    /// A sandbox whose commands' processes may hold `mb` MiB together.
    fn sandbox_with_memory(mb: u64) -> LocalSandbox {
        sandbox_with(crate::sandbox::Limits {
            memory_bytes: mb << 20,
            ..Default::default()
        })
    }

    /// Memory as a whole (issue 16): four processes of 150 MiB each, every one far under
    /// the per-process address-space limit, hold more than the sandbox's 256 MiB
    /// together. They are killed within seconds, not at the timeout, with a status of
    /// 137 and a line that names the setting; the sandbox goes on.
    #[test]
    fn processes_that_hold_more_memory_together_than_the_sandbox_may_are_killed() {
        let mut sb = sandbox_with_memory(256);
        let t0 = std::time::Instant::now();
        let out = sb.run(
            "python3 -c \"\nimport os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        \
             b = b'x' * (150 << 20)\n        time.sleep(60)\n        os._exit(0)\n\
             for _ in range(4):\n    os.wait()\nprint('all held')\n\"",
            Duration::from_secs(120),
        );
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
        assert!(!out.timed_out, "{out:?}");
        assert_eq!(out.exit_code, 137, "{out:?}");
        assert!(!out.output.contains("all held"), "{}", out.output);
        assert!(
            out.output.contains("memory_mb") && out.output.contains("256 MiB"),
            "{}",
            out.output
        );
        assert_eq!(sb.stopped(), None);
        assert_eq!(sb.run("echo fine", T).output, "fine\n");
    }

    /// A memfd is memory no mapping shows: 300 MiB in one, held open, cross a ceiling of
    /// 256 MiB.
    #[test]
    fn memory_in_a_memfd_counts_toward_the_ceiling() {
        let mut sb = sandbox_with_memory(256);
        let out = sb.run(
            "python3 -c \"\nimport os, time\nfd = os.memfd_create('x')\n\
             os.posix_fallocate(fd, 0, 300 << 20)\ntime.sleep(30)\nprint('still here')\n\"",
            Duration::from_secs(60),
        );
        assert_eq!(out.exit_code, 137, "{out:?}");
        assert!(!out.output.contains("still here"), "{}", out.output);
        assert!(out.output.contains("memory_mb"), "{}", out.output);
    }

    /// Pages a fork shares with its parent count once: a parent holding 200 MiB and
    /// three children that only read it (600 MiB more if each counted in full) stay
    /// under a ceiling of 400 MiB.
    #[test]
    fn memory_shared_by_forks_counts_once() {
        let mut sb = sandbox_with_memory(400);
        let out = sb.run(
            "python3 -c \"\nimport os, time\nb = b'x' * (200 << 20)\nfor _ in range(3):\n    \
             if os.fork() == 0:\n        time.sleep(2)\n        os._exit(0)\n\
             for _ in range(3):\n    os.wait()\nprint('shared', len(b) >> 20)\n\"",
            Duration::from_secs(60),
        );
        assert_eq!(
            (out.exit_code, out.output.as_str()),
            (0, "shared 200\n"),
            "{out:?}"
        );
    }

    /// A sandbox in the system temp dir whose disk floor sits `below` bytes under the
    /// space available there now (negative: above it).
    fn sandbox_with_floor(below: i64) -> LocalSandbox {
        let floor = (temp_dir_available() as i64).saturating_sub(below).max(1) as u64;
        sandbox_with(crate::sandbox::Limits {
            min_free_disk_bytes: floor,
            ..Default::default()
        })
    }

    /// A command that writes until the disk would fill (issue 16, item 1: "fill its
    /// disk"): it is killed once the space left crosses the worker's floor, well before
    /// it wrote what it meant to, the output says why, and the sandbox runs nothing more.
    /// The floor is 256 MiB under what is free now; the command means to write 1000 MiB.
    #[test]
    fn a_command_that_fills_the_disk_to_the_floor_is_killed_and_the_sandbox_stops() {
        let Some(_lock) = disk_floor_test_lock() else {
            return;
        };
        let mut sb = sandbox_with_floor(256 << 20);
        assert_eq!(sb.stopped(), None);
        let out = sb.run(
            "head -c 1000M /dev/zero > fill; echo finished",
            Duration::from_secs(120),
        );
        assert!(!out.timed_out, "{out:?}");
        assert_ne!(out.exit_code, 0, "{out:?}");
        assert!(!out.output.contains("finished"), "{}", out.output);
        assert!(
            out.output.contains("sandbox stopped") && out.output.contains("min_free_disk_mb"),
            "{}",
            out.output
        );
        let written = std::fs::metadata(sb.repo.join("fill")).map_or(0, |m| m.len());
        assert!(
            written < 1000 << 20,
            "the command wrote all {written} bytes"
        );
        let stop = sb.stopped().expect("the sandbox stopped");
        assert!(stop.why.contains("min_free_disk_mb"), "{stop:?}");
        assert!(stop.by_own_command, "{stop:?}");
        // Nothing runs any more, not even a harmless command.
        let out = sb.run("touch marker", T);
        assert_ne!(out.exit_code, 0);
        assert!(out.output.contains("sandbox stopped"), "{}", out.output);
        assert!(!sb.repo.join("marker").exists());
        // Dropping the sandbox gives the space back.
        let outer = sb.outer.clone();
        drop(sb);
        assert!(!outer.exists());
    }

    /// A command that ends within one check's interval is still caught: one
    /// `fallocate` takes the space in a single call (and `--keep-size` escapes the file
    /// size limit), and the check after the command sees it.
    #[test]
    fn a_command_that_takes_the_space_at_once_is_caught_when_it_ends() {
        let Some(_lock) = disk_floor_test_lock() else {
            return;
        };
        let mut sb = sandbox_with_floor(256 << 20);
        let out = sb.run(
            "touch blob && fallocate --keep-size -l 600M blob && echo taken",
            T,
        );
        if !out.output.contains("taken") && !out.output.contains("sandbox stopped") {
            eprintln!("skipped: fallocate does not work here: {}", out.output);
            return;
        }
        assert!(
            out.output.contains("sandbox stopped") && out.output.contains("min_free_disk_mb"),
            "{}",
            out.output
        );
        assert!(sb.stopped().is_some_and(|s| s.by_own_command));
        assert!(sb.run("true", T).exit_code != 0);
    }

    /// Under the floor already (another sandbox, or anything else on the host, filled
    /// the disk): a command is refused before it runs, and the sandbox stops (its
    /// episode ends ungraded: a turn on a full disk says nothing about the model).
    #[test]
    fn under_the_disk_floor_a_command_is_refused_and_the_sandbox_stops() {
        let Some(_lock) = disk_floor_test_lock() else {
            return;
        };
        let mut sb = sandbox_with_floor(-(1 << 30));
        let out = sb.run("touch marker", T);
        assert_eq!(out.exit_code, 1);
        assert!(
            out.output.contains("not run") && out.output.contains("min_free_disk_mb"),
            "{}",
            out.output
        );
        assert!(!sb.repo.join("marker").exists());
        let stop = sb.stopped().expect("the sandbox stopped");
        assert!(!stop.by_own_command, "{stop:?}");
        // With the floor 1 GiB under what is free, the same command runs.
        let mut free = sandbox_with_floor(1 << 30);
        assert_eq!(free.run("touch marker", T).exit_code, 0);
        assert!(free.repo.join("marker").exists());
        assert_eq!(free.stopped(), None);
    }

    #[test]
    fn creates_repo_and_runs_commands() {
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        assert_eq!(sb.cwd(), "~/repo");
        assert!(sb.at_root());
        let out = sb.run("cat a.txt; echo err >&2; exit 3", T);
        assert_eq!(out.exit_code, 3);
        assert!(!out.timed_out);
        assert!(out.output.contains("hello") && out.output.contains("err"));
        assert_eq!(sb.read_file("sub/dir/b.txt").as_deref(), Some("b\n"));
        assert_eq!(sb.read_file("../x"), None);
        assert_eq!(sb.base_file("a.txt").as_deref(), Some("hello\n"));
        assert_eq!(sb.base_file("nope.txt"), None);
        assert_eq!(sb.diff(), "");
        assert!(sb.changed_files().is_empty());
        assert_eq!(sb.head().as_deref(), Some(sb.base_commit()));
        // HOME is the sandbox dir, so ~/repo works in commands.
        let out = sb.run("cd ~/repo && pwd && echo $REPO && basename $REPO", T);
        assert!(sb.root().is_absolute() && sb.root().is_dir());
        // Output spells the sandbox's temporary paths as `~`, as the footer does.
        assert_eq!(out.output, "~/repo\n~/repo\nrepo\n");
        // The interpreter's own path (the checkout's venv) is spelled `python`.
        let out = sb.run("python no_such_script.py", T);
        assert!(
            out.output
                .starts_with("python: can't open file '~/repo/no_such_script.py'"),
            "{}",
            out.output
        );
        let out = sb.run("cd ~/.. && ls -d \"$PWD\"/ctl; cat ~/../ctl/nope", T);
        assert!(out.output.starts_with("~/../ctl\n"), "{}", out.output);
        assert_eq!(sb.cwd(), "~/..", "the footer spells it as the output does");
        assert!(
            out.output.contains("~/../ctl/nope: No such file"),
            "{}",
            out.output
        );
        let outside = sb
            .root()
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .display()
            .to_string();
        assert!(!out.output.contains(&outside), "{}", out.output);
        // A longer name that starts like the sandbox's directory is left alone.
        let out = sb.run("cd ~/.. && echo \"$PWD\"x", T);
        assert!(
            out.output.ends_with("x\n") && out.output.contains(&outside),
            "{}",
            out.output
        );
        let out = sb.run("echo $(", T);
        assert!(out.output.starts_with("bash: "), "{}", out.output);
        assert!(!out.output.contains("command.sh"), "{}", out.output);
    }

    /// The submission is read with git, after the agent's last command and outside its
    /// timeout: nothing the agent wrote into the repository's git config or attributes
    /// (an fsmonitor hook, a clean filter, an include) may run then, and the diff is
    /// still the agent's change.
    #[test]
    fn bookkeeping_git_runs_nothing_the_agent_configured() {
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        let marks = sb.home().join("marks");
        let m = marks.display().to_string();
        let setup = format!(
            "mkdir -p {m} && git config core.fsmonitor 'touch {m}/fsmonitor; echo' && \
             git config filter.evil.clean 'touch {m}/clean; sleep 30; cat' && \
             git config filter.evil.required true && \
             printf 'x\\n' > {m}/inc && git config include.path {m}/inc && \
             printf '* filter=evil\\n' > .gitattributes && echo changed > a.txt"
        );
        let out = sb.run(&setup, T);
        assert_eq!(out.exit_code, 0, "{}", out.output);
        let started = std::time::Instant::now();
        let diff = sb.diff();
        let changed = sb.changed_files();
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the agent's clean filter ran (it sleeps 30 s)"
        );
        let ran: Vec<_> = std::fs::read_dir(&marks)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n != "inc")
            .collect();
        assert!(ran.is_empty(), "the agent's git configuration ran: {ran:?}");
        assert!(diff.contains("+changed"), "{diff}");
        assert!(diff.contains("b/.gitattributes"), "{diff}");
        assert_eq!(
            changed,
            vec![".gitattributes".to_string(), "a.txt".to_string()]
        );
        // The patch applies to the base commit as before.
        let files = sb.apply_to_base(&diff).unwrap();
        assert_eq!(files["a.txt"].as_deref(), Some("changed\n"));
    }

    /// The worker's own git cannot hold an episode: a git that hangs (here the program
    /// itself, standing for a filter, a lock or a huge repository) is killed with its
    /// process group at the limit, and the submission is empty instead of never coming.
    /// Before, the local sandbox waited for its git without a limit.
    #[test]
    fn bookkeeping_git_that_hangs_is_killed_at_its_deadline() {
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let pids = dir.path().join("pids");
        let hanging = dir.path().join("git");
        std::fs::write(
            &hanging,
            format!(
                "#!/bin/sh\nsleep 60 &\necho $$ $! >> {}\nwait\n",
                pids.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(
            &hanging,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        sb.git_program = hanging;
        sb.set_git_timeout(Duration::from_secs(1));
        let started = std::time::Instant::now();
        let submission = sb.submission();
        let changed = sb.changed_files();
        let head = sb.head();
        let took = started.elapsed();
        assert!(submission.patch.is_empty() && changed.is_empty() && head.is_none());
        assert!(
            took < Duration::from_secs(20),
            "git was waited for: {took:?}"
        );
        // Every git started (and the sleep each started) is gone, not left running.
        let recorded = std::fs::read_to_string(&pids).unwrap();
        assert!(!recorded.is_empty());
        // (SIGKILL is delivered at once, but a loaded machine may take a moment to run
        // the exits: each process gets up to 10 s.)
        for pid in recorded.split_whitespace() {
            let gone_by = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                // Gone, or a zombie that only its parent's reaping would remove.
                let state = stat
                    .rsplit(')')
                    .next()
                    .unwrap_or("")
                    .split_whitespace()
                    .next();
                if stat.is_empty() || state == Some("Z") {
                    break;
                }
                assert!(
                    std::time::Instant::now() < gone_by,
                    "process {pid} outlived its git: {stat}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // The message names the limit.
        let err = sb.git_env(&["status"], None, &[]).unwrap_err();
        assert!(err.to_string().contains("limit of 1 s"), "{err}");
    }

    #[test]
    fn base_commit_is_deterministic() {
        let a = LocalSandbox::create(&tiny_task(), None).unwrap();
        let b = LocalSandbox::create(&tiny_task(), None).unwrap();
        assert_eq!(a.base_commit(), b.base_commit());
        assert_ne!(a.root(), b.root());
    }

    #[test]
    fn cwd_persists_across_commands_and_exit() {
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        sb.run("cd sub", T);
        assert_eq!(sb.cwd(), "~/repo/sub");
        sb.run("cd dir && exit 1", T);
        assert_eq!(sb.cwd(), "~/repo/sub/dir");
        let out = sb.run("cat b.txt", T);
        assert_eq!(out.output, "b\n");
        sb.run("cd ..", T);
        sb.run("cd /", T);
        assert_eq!(sb.cwd(), "/");
        sb.run("cd ~", T);
        assert_eq!(sb.cwd(), "~");
        // A deleted cwd falls back to the repo root.
        sb.run("mkdir -p ~/repo/gone && cd ~/repo/gone", T);
        assert_eq!(sb.cwd(), "~/repo/gone");
        sb.run("rm -rf ~/repo/gone", T);
        let out = sb.run("pwd", T);
        assert_eq!(out.output.trim(), "~/repo");
        assert_eq!(sb.cwd(), "~/repo");
    }

    #[test]
    fn diff_includes_new_files_and_leaves_index_alone() {
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        sb.run(
            "echo bye > a.txt && echo new > new.txt && rm sub/dir/b.txt",
            T,
        );
        let d = sb.diff();
        assert!(d.contains("--- a/a.txt") && d.contains("+bye"), "{d}");
        assert!(d.contains("+++ b/new.txt"), "{d}");
        assert!(d.contains("deleted file mode"), "{d}");
        let mut files = sb.changed_files();
        files.sort();
        assert_eq!(files, vec!["a.txt", "new.txt", "sub/dir/b.txt"]);
        // The agent's staging area is untouched: new.txt is still untracked.
        let st = sb.run("git status --porcelain", T);
        assert!(st.output.contains("?? new.txt"), "{}", st.output);
        // Caches never show up.
        sb.run("mkdir -p __pycache__ && echo x > __pycache__/m.pyc", T);
        assert!(!sb.diff().contains("pyc"));
        // Committing does not hide changes from the diff.
        sb.run("git add -A && git commit -qm wip", T);
        assert_eq!(sb.diff(), d);
    }

    /// A compiled binary, an image and a large generated file beside a small fix: the
    /// patch holds the fix alone (text only, applies to the base), and the left-out paths
    /// are named, odd names included. Before, the patch carried every byte of them.
    #[test]
    fn binary_and_large_untracked_files_are_left_out_of_the_submission() {
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        let out = sb.run(
            "echo bye > a.txt && echo new > new.txt && printf '\\177ELF\\0\\1\\2' > lib.so \
             && printf 'b\\0\\0\\0' > sub/dir/b.txt \
             && head -c 2000000 /dev/zero | tr '\\0' x > big.txt \
             && mkdir -p 'odd dir' && printf 'x\\0y' > $'odd dir/-we\\nird :(x).png' \
             && head -c 1100000 /dev/zero | tr '\\0' y > $'odd dir/big\\tone'",
            T,
        );
        assert_eq!(out.exit_code, 0, "{}", out.output);
        let sub = sb.submission();
        assert_eq!(sub.too_large, None);
        let patch = &sub.patch;
        assert!(
            patch.contains("+bye") && patch.contains("+++ b/new.txt"),
            "{patch}"
        );
        for left in [
            "lib.so",
            "big.txt",
            "sub/dir/b.txt",
            "odd dir",
            "GIT binary patch",
        ] {
            assert!(!patch.contains(left), "{left} is in the patch:\n{patch}");
        }
        assert!(patch.len() < 2000, "{} bytes", patch.len());
        let files = sb.apply_to_base(patch).unwrap();
        assert_eq!(
            files.keys().collect::<Vec<_>>(),
            vec!["a.txt", "new.txt"],
            "{patch}"
        );
        assert_eq!(files["a.txt"].as_deref(), Some("bye\n"));
        let mut left: Vec<(String, LeftOutReason)> = sub
            .left_out
            .iter()
            .map(|l| (l.path.clone(), l.reason))
            .collect();
        left.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            left,
            vec![
                ("big.txt".to_string(), LeftOutReason::Large(2_000_000)),
                ("lib.so".to_string(), LeftOutReason::Binary),
                (
                    "odd dir/-we\nird :(x).png".to_string(),
                    LeftOutReason::Binary
                ),
                (
                    "odd dir/big\tone".to_string(),
                    LeftOutReason::Large(1_100_000)
                ),
                ("sub/dir/b.txt".to_string(), LeftOutReason::Binary),
            ]
        );
        assert_eq!(sub.left_out_total, 5);
        let note = sub.left_out_note().unwrap();
        assert!(note.contains("\"lib.so\" (binary)"), "{note}");
        assert!(
            note.contains("\"big.txt\" (untracked, 2000000 bytes"),
            "{note}"
        );
        // The trait's `diff` is the same patch; the agent's own index is untouched.
        assert_eq!(Sandbox::diff(&sb), sub.patch);
        let st = sb.run("git status --porcelain", T);
        assert!(st.output.contains("?? lib.so"), "{}", st.output);
    }

    /// A diff over MAX_SUBMISSION_BYTES (300 generated text files of 20 KiB, none large on
    /// its own) is reported as too large with the bytes read, and no patch; git's output
    /// is read no further than the cap + 1. Before, the whole diff came back as the patch.
    #[test]
    fn a_diff_over_the_cap_is_too_large_not_a_patch() {
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        let out = sb.run(GENERATE_6_MB, T);
        assert_eq!(out.exit_code, 0, "{}", out.output);
        let sub = sb.submission();
        assert_eq!(sub.too_large, Some(MAX_SUBMISSION_BYTES as u64 + 1));
        assert_eq!(sub.patch, "");
        assert_eq!(sub.left_out_total, 0);
        assert_eq!(Sandbox::diff(&sb), "");
        let note = sub.too_large_note().unwrap();
        assert!(
            note.contains(&MAX_SUBMISSION_BYTES.to_string())
                && note.contains("MAX_SUBMISSION_BYTES"),
            "{note}"
        );
        // Once the generated files are gone, the fix is submitted as usual.
        sb.run("rm -rf gen && echo bye > a.txt", T);
        let sub = sb.submission();
        assert_eq!(sub.too_large, None);
        assert!(sub.patch.contains("+bye"), "{}", sub.patch);
    }

    /// 300 text files of 20 KiB (205 lines of 100 bytes) under `gen/`: about 6 MB of diff.
    pub(crate) const GENERATE_6_MB: &str = "mkdir -p gen && awk 'BEGIN { l = sprintf(\"%099d\", 0); \
        for (i = 0; i < 300; i++) { f = \"gen/f\" i \".txt\"; for (j = 0; j < 205; j++) print l > f; close(f) } }'";

    #[test]
    fn timeout_kills_the_whole_process_group() {
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        let marker = sb.home().join("tmp/alive");
        let t0 = Instant::now();
        let out = sb.run(
            &format!(
                "(sleep 2; touch {}) & echo started; sleep 1000",
                marker.display()
            ),
            Duration::from_millis(500),
        );
        assert!(out.timed_out);
        assert_eq!(out.exit_code, TIMEOUT_EXIT_CODE);
        assert!(out.output.contains("started"));
        assert!(t0.elapsed() < Duration::from_secs(3));
        std::thread::sleep(Duration::from_millis(2500));
        assert!(!marker.exists(), "background child survived the timeout");
    }

    #[test]
    fn background_jobs_do_not_block_or_survive() {
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        let t0 = Instant::now();
        let out = sb.run("sleep 1000 & echo done", T);
        assert!(!out.timed_out);
        assert_eq!(out.exit_code, 0);
        assert_eq!(out.output, "done\n");
        assert!(t0.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn drop_kills_processes_that_left_the_group() {
        // Found on the host by its arguments: a confined command's `$!` is a pid of its
        // own namespace.
        let secs = format!(
            "1000.{}{:06}",
            std::process::id(),
            rand::random::<u32>() % 1_000_000
        );
        let needle = format!("sleep\0{secs}\0");
        let alive = || {
            std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
                let dir = e.path();
                std::fs::read(dir.join("cmdline")).is_ok_and(|c| c.starts_with(needle.as_bytes()))
                    && std::fs::read_to_string(dir.join("stat")).is_ok_and(|s| !s.contains(") Z"))
            })
        };
        let root = tempfile::tempdir().unwrap();
        {
            let mut sb = LocalSandbox::create(&tiny_task(), Some(root.path())).unwrap();
            let t0 = Instant::now();
            let out = sb.run(
                &format!("setsid sleep {secs} >/dev/null 2>&1 & echo started"),
                T,
            );
            assert_eq!(out.exit_code, 0, "{}", out.output);
            assert!(t0.elapsed() < Duration::from_secs(3));
            // Unconfined it escaped its command; confined, its pid namespace ended with
            // the command's shell (the kernel kills the namespace's processes
            // asynchronously: on a loaded machine that shows a little later).
            if sb.confinement().is_confined() {
                let t = Instant::now();
                while alive() && t.elapsed() < Duration::from_secs(10) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                assert!(!alive(), "outlived its confined command");
            } else {
                assert!(alive(), "an unconfined setsid process outlives its command");
            }
        }
        // SIGKILL is delivered asynchronously; on a loaded machine the state change can
        // take a while to show, so wait (bounded) before concluding it survived.
        for _ in 0..500 {
            if !alive() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!alive(), "escaped process survived the sandbox");
    }

    #[test]
    fn huge_output_is_capped_head_and_tail() {
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        sb.set_output_cap(1000);
        let out = sb.run(
            "echo START; head -c 100000000 /dev/zero | tr '\\0' x; echo; echo END",
            T,
        );
        assert!(!out.timed_out);
        assert_eq!(out.exit_code, 0);
        assert!(out.output.starts_with("START"));
        assert!(out.output.ends_with("END\n"));
        assert!(out.output.contains("bytes of output dropped"));
        assert!(out.output.len() < 2000);
    }

    #[test]
    fn stdin_is_empty_and_invalid_utf8_is_replaced() {
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        let out = sb.run("cat; printf '\\xff\\xfeok'", T);
        assert_eq!(out.exit_code, 0);
        assert!(out.output.ends_with("ok"));
        assert!(out.output.contains('\u{FFFD}'));
    }

    #[test]
    fn shell_errors_name_bash_not_the_sandbox_path() {
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        let out = sb.run("submit_this_now", T);
        assert_eq!(out.exit_code, 127);
        assert!(
            out.output
                .starts_with("bash: line 1: submit_this_now: command not found"),
            "{}",
            out.output
        );
        assert!(!out.output.contains("command.sh"), "{}", out.output);
    }

    #[test]
    fn python_interpreter_is_a_real_interpreter_not_a_launcher() {
        // A launcher script (a pyenv shim) would not run where its own tree is hidden.
        let py = python_interpreter();
        assert!(py.is_absolute(), "{}", py.display());
        let out = std::process::Command::new(&py)
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            py.display().to_string()
        );
    }

    #[test]
    fn python_shims_resolve() {
        crate::grade::tests_support::init_python();
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        let out = sb.run("python -c 'import sys; print(sys.version_info[0])'", T);
        assert_eq!(out.output.trim(), "3", "{}", out.output);
        let out = sb.run("python -m pytest --version", T);
        assert_eq!(out.exit_code, 0, "{}", out.output);
    }

    #[test]
    fn rejects_unsafe_paths_and_empty_tasks() {
        let mut t = tiny_task();
        t.files[0].path = "../evil".into();
        assert!(matches!(
            LocalSandbox::create(&t, None),
            Err(LocalSandboxError::UnsafePath(_))
        ));
        t.files.clear();
        assert!(matches!(
            LocalSandbox::create(&t, None),
            Err(LocalSandboxError::NoFiles(_))
        ));
    }

    #[test]
    fn drop_removes_even_read_only_trees() {
        let root = tempfile::tempdir().unwrap();
        let home;
        {
            let mut sb = LocalSandbox::create(&tiny_task(), Some(root.path())).unwrap();
            home = sb.home().to_path_buf();
            sb.run("mkdir -p ro/x && touch ro/x/f && chmod 0555 ro/x ro", T);
        }
        assert!(!home.exists());
    }

    #[test]
    fn shell_quote_round_trips() {
        let mut sb = LocalSandbox::create(&tiny_task(), None).unwrap();
        for s in ["plain", "it's", "a b", "$HOME `x`", "", "\"q\""] {
            let out = sb.run(&format!("printf %s {}", shell_quote(s)), T);
            assert_eq!(out.output, s);
        }
    }
}
