//! Confining the local sandbox's commands (docs/security.md, "Local sandbox").
//!
//! Every command of a local sandbox runs under bubblewrap (`bwrap`) in namespaces of its
//! own: user, mount, pid, network, ipc, uts (and cgroup where the kernel has them). Its
//! file system is built from nothing: the system (`/usr`, `/etc`, the `/bin` and `/lib`
//! links) and the Python interpreter's prefixes read-only, the sandbox's own directories
//! as the sandbox asks (its home with the working copy, and its private `/tmp`, writable),
//! and nothing else of the host: not the worker's home, not the run directory and its
//! token, not other sandboxes. `/proc` is the command's own (its pid namespace), there is
//! no network, and every process of the namespace dies when the command's shell exits.
//!
//! Resource limits apply to every process of a command: processes (`RLIMIT_NPROC`, set
//! inside the sandbox's own user namespace, where the kernel counts it for that namespace
//! alone), address space, file size, open files and CPU time.
//!
//! A worker running as root does not run the commands as root: the kernel never limits
//! root's processes, and root reads every file. bwrap (as root, so that it can reach an
//! interpreter under root's own 0700 home) builds the view, then `setpriv` drops to
//! [`SANDBOX_UID`] with no capabilities and no new privileges, and `unshare` enters a user
//! namespace of its own, where the process limit counts. A worker running as another user
//! runs bwrap as that user with a user namespace (`--unshare-user`).
//!
//! Where bwrap is missing or cannot build a sandbox, [`Confinement::new`] refuses unless
//! the settings allow unconfined commands ([`ConfineSettings::allow_unconfined`]); those
//! get the resource limits except the process limit (counted per user on the host, it
//! would count the worker's own threads), and nothing else.

use std::collections::{HashMap, HashSet};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::sandbox::process::{run_in_own_group, Isolation};

/// The host uid (and gid) the commands of a root worker's sandboxes run as: `nobody`
/// (`nogroup`). Each sandbox counts its processes in a user namespace of its own, so
/// sandboxes sharing the uid do not share the process limit.
pub const SANDBOX_UID: u32 = 65534;
pub const SANDBOX_GID: u32 = 65534;

/// The `PATH` of a confined command after the sandbox's own directories: the system's.
pub const SYSTEM_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Size of the `/dev/shm` a confined command gets (a tmpfs: memory).
const SHM_BYTES: u64 = 64 << 20;

/// Resource limits of every process a sandbox's command starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Processes (and threads) of one sandbox at once (`RLIMIT_NPROC`; confined only).
    pub processes: u64,
    /// Address space of one process (`RLIMIT_AS`).
    pub address_space_bytes: u64,
    /// Largest file a process may write (`RLIMIT_FSIZE`; past it the write fails and the
    /// process gets `SIGXFSZ`).
    pub file_size_bytes: u64,
    /// Open files of one process (`RLIMIT_NOFILE`).
    pub open_files: u64,
    /// Not a process limit: a floor under the free space of the file system holding the
    /// sandbox (`[worker] min_free_disk_mb`, 1 GiB for a worker; 0 here, for tests and
    /// tools). A command that brings the space available there (or its free inodes,
    /// below 65,536) under it is killed at the next check (every [`DISK_CHECK_EVERY`]
    /// while it runs, and once when it ended) and its episode ends unresolved without
    /// tests; a command that would start under it is not run and its episode ends
    /// ungraded. Either way the sandbox stops (`Sandbox::stopped`). 0: no floor.
    pub min_free_disk_bytes: u64,
    /// Not a process limit: the memory a command's processes hold together
    /// (`[worker] memory_mb`, 2 GiB for a worker; 0 here, for tests and tools: none).
    /// Checked every [`MEMORY_CHECK_EVERY`] while the command runs; over it, the
    /// command's processes are killed, as by an out-of-memory killer (exit status 137,
    /// the output says why), and the sandbox goes on.
    pub memory_bytes: u64,
}

/// How often a running command's disk floor ([`Limits::min_free_disk_bytes`]) is checked.
pub const DISK_CHECK_EVERY: Duration = Duration::from_millis(50);

/// How often the memory a running command's processes hold ([`Limits::memory_bytes`]) is
/// read (a scan of /proc).
pub const MEMORY_CHECK_EVERY: Duration = Duration::from_millis(100);

impl Default for Limits {
    fn default() -> Self {
        Limits {
            processes: 256,
            address_space_bytes: 4 << 30,
            file_size_bytes: 1 << 30,
            open_files: 1024,
            min_free_disk_bytes: 0,
            memory_bytes: 0,
        }
    }
}

impl Limits {
    /// CPU seconds one process of a command with this `timeout` may use
    /// (`RLIMIT_CPU`): the timeout on every core, plus one. A backstop: the timeout kills
    /// the command's processes first.
    pub fn cpu_seconds(timeout: Duration) -> u64 {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
        timeout
            .as_secs()
            .saturating_add(1)
            .saturating_mul(cores)
            .saturating_add(1)
    }
}

/// How local sandboxes are to be confined (from `[worker]`).
#[derive(Debug, Clone)]
pub struct ConfineSettings {
    /// bubblewrap: a path, or a name looked up on `PATH` (default `bwrap`).
    pub bwrap: PathBuf,
    /// Run the commands unconfined where bwrap is missing or cannot build a sandbox
    /// (`[worker] allow_unconfined`), instead of refusing.
    pub allow_unconfined: bool,
    pub limits: Limits,
}

impl Default for ConfineSettings {
    fn default() -> Self {
        ConfineSettings {
            bwrap: PathBuf::from("bwrap"),
            allow_unconfined: false,
            limits: Limits::default(),
        }
    }
}

/// Why local sandboxes cannot be made: they cannot be confined and running them
/// unconfined is not allowed.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error(
        "local sandboxes cannot confine the model's commands on this machine: {reason}. \
         Refusing to run them unconfined (as this process's user, with the run's token, the \
         Python venv and the rest of the host in reach). Install bubblewrap (`bwrap`; \
         Debian/Ubuntu: `apt-get install bubblewrap`, which `make setup` does), or set \
         `[worker] allow_unconfined = true` to run them anyway (docs/security.md, \"Local \
         sandbox\")"
    )]
    Unavailable { reason: String },
}

/// How a local sandbox's commands run: confined by bubblewrap, or unconfined.
#[derive(Debug, Clone)]
pub struct Confinement {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    bwrap: Option<Arc<Bwrap>>,
    limits: Limits,
    /// Unconfined: why.
    why_not: Option<String>,
}

/// A bubblewrap that builds sandboxes here (probed).
#[derive(Debug)]
struct Bwrap {
    path: PathBuf,
    /// Root: `setpriv` and `unshare`, which drop to [`SANDBOX_UID`] in a user namespace of
    /// its own. `None`: bwrap runs as this (unprivileged) user with `--unshare-user`.
    drop_root: Option<(PathBuf, PathBuf)>,
    /// This bwrap knows `--disable-userns` (no user namespaces inside the sandbox).
    disable_userns: bool,
    /// The read-only system view.
    system: Vec<SystemMount>,
}

#[derive(Debug, Clone)]
enum SystemMount {
    /// A directory bound read-only at its own path.
    Dir(PathBuf),
    /// A symbolic link (`/bin` → `usr/bin` where `/usr` is merged).
    Link { at: PathBuf, target: PathBuf },
}

/// A directory a sandbox shows to its commands, at the same path as on the host (or at
/// `dest`).
#[derive(Debug, Clone)]
pub(crate) struct Bind {
    pub src: PathBuf,
    pub dest: PathBuf,
    pub writable: bool,
}

impl Bind {
    pub fn read_only(p: &Path) -> Self {
        Bind {
            src: p.to_path_buf(),
            dest: p.to_path_buf(),
            writable: false,
        }
    }
    pub fn writable(p: &Path) -> Self {
        Bind {
            src: p.to_path_buf(),
            dest: p.to_path_buf(),
            writable: true,
        }
    }
}

/// Probe results per bwrap setting (`Err`: why it cannot confine).
type Probed = Mutex<HashMap<PathBuf, Result<Arc<Bwrap>, String>>>;

/// The probe runs once per process and program.
fn probed() -> &'static Probed {
    static P: OnceLock<Probed> = OnceLock::new();
    P.get_or_init(Default::default)
}

impl Confinement {
    /// The confinement `settings` ask for: bubblewrap when it builds a sandbox here
    /// (checked by running one), else unconfined if `allow_unconfined`, else
    /// [`ConfineError::Unavailable`] naming what is missing.
    pub fn new(settings: &ConfineSettings) -> Result<Self, ConfineError> {
        let found = {
            let mut cache = probed().lock().unwrap_or_else(|e| e.into_inner());
            cache
                .entry(settings.bwrap.clone())
                .or_insert_with(|| Bwrap::probe(&settings.bwrap, &settings.limits))
                .clone()
        };
        match found {
            Ok(bwrap) => Ok(Confinement {
                inner: Arc::new(Inner {
                    bwrap: Some(bwrap),
                    limits: settings.limits,
                    why_not: None,
                }),
            }),
            Err(reason) if settings.allow_unconfined => {
                Ok(Confinement::unconfined(settings.limits, reason))
            }
            Err(reason) => Err(ConfineError::Unavailable { reason }),
        }
    }

    /// Unconfined commands (resource limits but the process limit, nothing else); `why`
    /// says why, for [`Self::describe`].
    pub fn unconfined(limits: Limits, why: impl Into<String>) -> Self {
        Confinement {
            inner: Arc::new(Inner {
                bwrap: None,
                limits,
                why_not: Some(why.into()),
            }),
        }
    }

    /// What this process's local sandboxes get when nobody chose (`LocalSandbox::create`,
    /// `SandboxFactory::Local`: tests, tools): bubblewrap when it works here, else
    /// unconfined, with a warning once. A worker chooses with [`Self::new`], which refuses.
    pub fn detected() -> Self {
        static D: OnceLock<Confinement> = OnceLock::new();
        D.get_or_init(|| {
            let settings = ConfineSettings {
                allow_unconfined: true,
                ..Default::default()
            };
            let c = Confinement::new(&settings).expect("allow_unconfined never refuses");
            if !c.is_confined() {
                tracing::warn!(
                    "local sandboxes run the model's commands UNCONFINED: {}",
                    c.describe()
                );
            }
            c
        })
        .clone()
    }

    /// True when commands run under bubblewrap.
    pub fn is_confined(&self) -> bool {
        self.inner.bwrap.is_some()
    }

    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// In words, for logs.
    pub fn describe(&self) -> String {
        match (&self.inner.bwrap, &self.inner.why_not) {
            (Some(b), _) => match b.drop_root {
                Some(_) => format!(
                    "bubblewrap ({}), commands as uid {SANDBOX_UID}",
                    b.path.display()
                ),
                None => format!("bubblewrap ({}), commands as this user", b.path.display()),
            },
            (None, Some(why)) => format!("unconfined ({why})"),
            (None, None) => "unconfined".into(),
        }
    }

    /// The host user a sandbox's writable directories must belong to, when it is not
    /// this process's (a root worker's commands run as [`SANDBOX_UID`]).
    pub(crate) fn sandbox_owner(&self) -> Option<(u32, u32)> {
        self.inner
            .bwrap
            .as_ref()
            .and_then(|b| b.drop_root.as_ref())
            .map(|_| (SANDBOX_UID, SANDBOX_GID))
    }

    /// The command that runs `script` (bash) for a sandbox: under bubblewrap with `binds`
    /// (in order; a later one may sit inside an earlier one) and `home` as its first
    /// directory, or, unconfined, plain bash in `home`. `env` is the whole environment
    /// (nothing of this process's is passed on). The resource limits are set in the
    /// child, the CPU limit from `timeout`. Directories a bind needs inside an earlier
    /// writable bind are made (or repaired, should a command have put a link or a file
    /// there) on the host first.
    pub(crate) fn command(
        &self,
        binds: &[Bind],
        home: &Path,
        script: &str,
        env: &[(String, String)],
        timeout: Duration,
    ) -> std::io::Result<Command> {
        let limits = self.inner.limits;
        let cpu = Limits::cpu_seconds(timeout);
        if let Some(b) = &self.inner.bwrap {
            // No pre_exec: std then starts bwrap with posix_spawn (vfork), not fork, which
            // would copy the page tables of the worker (a few hundred MB with its policy)
            // for every command. What the closure did is done by bwrap and the script:
            // the limits by the shell's first line (as this user, before the command;
            // both soft and hard, so nothing in the sandbox raises them), the session by
            // `--new-session`, dying with the worker by `--die-with-parent`.
            let mut cmd = Command::new(&b.path);
            cmd.args(b.args(binds, home)?);
            let script = format!("{}{script}", shell_limits(&limits, cpu));
            cmd.args(["bash", "--noprofile", "--norc", "-c", &script]);
            // bwrap resolves its own paths; a root worker's sandbox user may not
            // enter this process's directory.
            cmd.current_dir("/");
            cmd.env_clear()
                .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            return Ok(cmd);
        }
        let mut cmd = Command::new("bash");
        cmd.args(["--noprofile", "--norc", "-c", script]);
        cmd.current_dir(home);
        cmd.env_clear()
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        // SAFETY: setrlimit is async-signal-safe; the closure allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                set_limit(libc::RLIMIT_AS, limits.address_space_bytes)?;
                set_limit(libc::RLIMIT_FSIZE, limits.file_size_bytes)?;
                set_limit(libc::RLIMIT_NOFILE, limits.open_files)?;
                set_limit(libc::RLIMIT_CPU, cpu)?;
                // No core files of the sandbox's processes on the host.
                set_limit(libc::RLIMIT_CORE, 0)
            });
        }
        Ok(cmd)
    }
}

/// The first line of a confined command's script: its limits, set inside the sandbox
/// (the process limit inside the user namespace, where the kernel counts it for that
/// namespace alone), soft and hard, before anything the agent wrote runs. bash's units:
/// KiB for `-v` and `-f`, seconds for `-t`.
fn shell_limits(limits: &Limits, cpu_seconds: u64) -> String {
    format!(
        "ulimit -u {} -v {} -f {} -n {} -t {} -c 0 || \
         {{ echo 'sandbox: could not set its limits' >&2; exit 126; }}\n",
        limits.processes,
        limits.address_space_bytes / 1024,
        limits.file_size_bytes / 1024,
        limits.open_files,
        cpu_seconds,
    )
}

fn set_limit(resource: libc::__rlimit_resource_t, value: u64) -> std::io::Result<()> {
    let lim = libc::rlimit {
        rlim_cur: value as libc::rlim_t,
        rlim_max: value as libc::rlim_t,
    };
    // SAFETY: a valid rlimit.
    if unsafe { libc::setrlimit(resource, &lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Bwrap {
    /// Finds bwrap and, for a root worker, `setpriv` and `unshare`, then builds a sandbox
    /// with them that must find bash and git and take the process limit. `Err`: why not.
    fn probe(setting: &Path, limits: &Limits) -> Result<Arc<Bwrap>, String> {
        let path = find_program(setting).ok_or_else(|| {
            format!(
                "bubblewrap (`{}`) was not found{}",
                setting.display(),
                if setting.components().count() > 1 {
                    String::new()
                } else {
                    " on PATH".to_string()
                }
            )
        })?;
        // SAFETY: plain syscall.
        let root = unsafe { libc::geteuid() } == 0;
        let drop_root = if root {
            let tool = |name: &str| {
                find_program(Path::new(name)).ok_or_else(|| {
                    format!(
                        "`{name}` (util-linux) was not found; a worker running as root \
                         needs it to run the commands as uid {SANDBOX_UID}"
                    )
                })
            };
            Some((tool("setpriv")?, tool("unshare")?))
        } else {
            None
        };
        let help = Command::new(&path)
            .arg("--help")
            .env_clear()
            .output()
            .map_err(|e| format!("`{}` could not be run: {e}", path.display()))?;
        let disable_userns =
            !root && String::from_utf8_lossy(&help.stdout).contains("--disable-userns");
        let shown = path.display().to_string();
        let bwrap = Bwrap {
            path,
            drop_root,
            disable_userns,
            system: system_mounts(),
        };
        let confinement = Confinement {
            inner: Arc::new(Inner {
                bwrap: Some(Arc::new(bwrap)),
                limits: *limits,
                why_not: None,
            }),
        };
        let env = [("PATH".to_string(), SYSTEM_PATH.to_string())];
        let cmd = confinement
            .command(
                &[],
                Path::new("/"),
                "command -v git >/dev/null || { echo 'git is not in the sandbox view' >&2; exit 1; }\necho tutor-confined",
                &env,
                Duration::from_secs(30),
            )
            .map_err(|e| e.to_string())?;
        let out = run_in_own_group(
            cmd,
            Duration::from_secs(30),
            8192,
            Isolation::ByCommand,
            None,
            None,
        )
        .map(|(out, _)| out)
        .map_err(|e| format!("bubblewrap could not be started: {e}"))?;
        if out.exit_code != 0 || !out.output.contains("tutor-confined") {
            return Err(format!(
                "bubblewrap ({shown}) could not build a sandbox (exit {}): {} (are user \
                 namespaces disabled? see sysctl user.max_user_namespaces and \
                 kernel.unprivileged_userns_clone)",
                out.exit_code,
                out.output.trim()
            ));
        }
        Ok(confinement.inner.bwrap.clone().expect("confined"))
    }

    /// bwrap's arguments up to and including `--` and the user switch (a root worker's).
    fn args(&self, binds: &[Bind], home: &Path) -> std::io::Result<Vec<String>> {
        let mut a: Vec<String> = [
            "--unshare-ipc",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            "--hostname",
            "sandbox",
        ]
        .map(String::from)
        .to_vec();
        let s = |p: &Path| p.display().to_string();
        if self.drop_root.is_some() {
            // Root builds the view; what runs in it may only switch users (setpriv).
            for c in [
                "--cap-drop",
                "ALL",
                "--cap-add",
                "CAP_SETUID",
                "--cap-add",
                "CAP_SETGID",
                "--cap-add",
                "CAP_SETPCAP",
            ] {
                a.push(c.into());
            }
        } else {
            a.push("--unshare-user".into());
            if self.disable_userns {
                a.push("--disable-userns".into());
            }
        }
        // What is mounted where so far: (dest, host source if writable).
        let mut mounts: Vec<(PathBuf, Option<PathBuf>)> = Vec::new();
        for m in &self.system {
            match m {
                SystemMount::Dir(d) => {
                    a.extend(["--ro-bind".into(), s(d), s(d)]);
                    mounts.push((d.clone(), None));
                }
                SystemMount::Link { at, target } => {
                    a.extend(["--symlink".into(), s(target), s(at)]);
                }
            }
        }
        a.extend(
            [
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "--perms",
                "1777",
                "--size",
                &SHM_BYTES.to_string(),
                "--tmpfs",
                "/dev/shm",
                // /dev is a tmpfs (half the host's memory) the command could fill, and
                // memory no process maps counts toward no ceiling: read-only, /dev/shm
                // (its own 64 MiB) apart.
                "--remount-ro",
                "/dev",
            ]
            .map(String::from),
        );
        mounts.push(("/proc".into(), None));
        mounts.push(("/dev".into(), None));
        let mut made: HashSet<PathBuf> = HashSet::new();
        for b in binds {
            let ancestors: Vec<&Path> = b.dest.ancestors().skip(1).collect();
            for dir in ancestors
                .into_iter()
                .rev()
                .chain(std::iter::once(b.dest.as_path()))
            {
                if dir == Path::new("/") || made.contains(dir) {
                    continue;
                }
                let cover = mounts.iter().rev().find(|(dest, _)| dir.starts_with(dest));
                match cover {
                    // The mount point itself exists.
                    Some((dest, _)) if dest == dir => {}
                    // Inside a writable bind: the directory is made on the host, where a
                    // command may have left anything in its place.
                    Some((dest, Some(src))) => {
                        let rel = dir.strip_prefix(dest).expect("starts_with");
                        ensure_real_dir(src, rel)?;
                    }
                    // Inside a read-only one: it exists or bwrap says so.
                    Some((_, None)) => {}
                    // In the sandbox's own root (a tmpfs, read-only once built).
                    None if dir != b.dest => {
                        a.extend(["--perms".into(), "0755".into(), "--dir".into(), s(dir)]);
                    }
                    None => {}
                }
                made.insert(dir.to_path_buf());
            }
            let op = if b.writable { "--bind" } else { "--ro-bind" };
            a.extend([op.into(), s(&b.src), s(&b.dest)]);
            mounts.push((b.dest.clone(), b.writable.then(|| b.src.clone())));
        }
        a.extend(["--remount-ro".into(), "/".into(), "--chdir".into(), s(home)]);
        a.push("--".into());
        if let Some((setpriv, unshare)) = &self.drop_root {
            a.extend([
                s(setpriv),
                format!("--reuid={SANDBOX_UID}"),
                format!("--regid={SANDBOX_GID}"),
                "--clear-groups".into(),
                "--no-new-privs".into(),
                "--inh-caps=-all".into(),
                "--bounding-set=-all".into(),
                "--".into(),
                s(unshare),
                "--user".into(),
                "--map-current-user".into(),
                "--".into(),
            ]);
        }
        Ok(a)
    }
}

/// Makes `base/rel` a real directory, component by component: a missing one is made, a
/// link or a file in the way is removed first.
fn ensure_real_dir(base: &Path, rel: &Path) -> std::io::Result<()> {
    let mut p = base.to_path_buf();
    for c in rel.components() {
        p.push(c);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => std::fs::remove_file(&p)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::fs::create_dir(&p)?;
    }
    Ok(())
}

/// The read-only system view: `/usr` and `/etc`, and `/bin`, `/sbin` and the `/lib`s as
/// the host has them (links where `/usr` is merged, else directories).
fn system_mounts() -> Vec<SystemMount> {
    let mut v = Vec::new();
    for d in ["/usr", "/etc"] {
        if Path::new(d).is_dir() {
            v.push(SystemMount::Dir(d.into()));
        }
    }
    for d in ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"] {
        let p = Path::new(d);
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.file_type().is_symlink() => {
                if let Ok(target) = std::fs::read_link(p) {
                    v.push(SystemMount::Link {
                        at: p.into(),
                        target,
                    });
                }
            }
            Ok(m) if m.is_dir() => v.push(SystemMount::Dir(p.into())),
            _ => {}
        }
    }
    v
}

/// True when `p` is in the read-only system view (or is one of its roots).
fn in_system_view(p: &Path) -> bool {
    [
        "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
    ]
    .iter()
    .any(|d| p.starts_with(d))
}

/// `name` as a program: a path as given, or the first executable file of that name on
/// `PATH` (then `/usr/bin`, `/bin`).
fn find_program(name: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if name.components().count() > 1 {
        return executable(name).then(|| name.to_path_buf());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/bin")])
        .map(|d| d.join(name))
        .find(|p| p.is_absolute() && executable(p))
}

/// What a confined command must see of the Python interpreter `python` (read-only): its
/// prefixes (a venv's and the installation's under it), its directory and the entries of
/// its `sys.path`, less what the system view already shows and anything that would show
/// this process's home or working directory whole. Asked of the interpreter once per
/// process (with an empty environment, as commands run it).
pub(crate) fn python_view(python: &Path) -> Arc<Vec<PathBuf>> {
    static CACHE: OnceLock<Mutex<HashMap<PathBuf, Arc<Vec<PathBuf>>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(v) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(python) {
        return v.clone();
    }
    let v = Arc::new(ask_python(python));
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(python.to_path_buf(), v.clone());
    v
}

fn ask_python(python: &Path) -> Vec<PathBuf> {
    const ASK: &str = "import json, os, sys\n\
        print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,\n\
        os.path.dirname(os.path.realpath(sys.executable))] + [p for p in sys.path if p]))";
    let mut found: Vec<PathBuf> = Vec::new();
    if let Some(dir) = python.parent().filter(|d| d.is_absolute()) {
        found.push(dir.to_path_buf());
    }
    match Command::new(python)
        .args(["-I", "-c", ASK])
        .env_clear()
        .env("PATH", SYSTEM_PATH)
        .output()
    {
        Ok(out) if out.status.success() => {
            match serde_json::from_slice::<Vec<String>>(&out.stdout) {
                Ok(paths) => found.extend(paths.into_iter().map(PathBuf::from)),
                Err(e) => {
                    tracing::warn!(python = %python.display(), error = %e, "could not read the interpreter's paths")
                }
            }
        }
        Ok(out) => tracing::warn!(
            python = %python.display(),
            stderr = %String::from_utf8_lossy(&out.stderr),
            "the interpreter did not say its paths; confined commands may not find it"
        ),
        Err(e) => {
            tracing::warn!(python = %python.display(), error = %e, "the interpreter could not be run; confined commands will not find it")
        }
    }
    let keep_out: Vec<PathBuf> = [
        std::env::current_dir().ok(),
        std::env::var_os("HOME").map(PathBuf::from),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut dirs: Vec<PathBuf> = Vec::new();
    for p in found {
        if !p.is_absolute() || in_system_view(&p) || !p.exists() {
            continue;
        }
        // A directory holding the worker's home or working directory (its run directory)
        // would show them whole: never.
        if p == Path::new("/") || keep_out.iter().any(|k| k.starts_with(&p)) {
            tracing::warn!(path = %p.display(), "not showing this interpreter path to confined commands: it holds the worker's home or working directory");
            continue;
        }
        dirs.push(p);
    }
    dirs.sort();
    dirs.dedup();
    // Only the outermost of nested directories.
    let mut out: Vec<PathBuf> = Vec::new();
    for d in dirs {
        if !out.iter().any(|o| d.starts_with(o)) {
            out.push(d);
        }
    }
    out
}

/// Makes this process non-dumpable: its `/proc` files (the environment with the run's
/// token and API keys, its memory) become root's, unreadable to the other processes of
/// its user, and no core file is written. Call at start.
pub fn harden_process() {
    // SAFETY: plain prctl.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "could not make this process non-dumpable");
    }
}

/// True when this process is dumpable (see [`harden_process`]).
pub fn is_dumpable() -> bool {
    // SAFETY: plain prctl.
    unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) == 1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_bwrap_is_refused_naming_the_setting_and_the_tool() {
        let settings = ConfineSettings {
            bwrap: PathBuf::from("/nonexistent/bwrap"),
            ..Default::default()
        };
        let err = Confinement::new(&settings).unwrap_err().to_string();
        assert!(err.contains("allow_unconfined"), "{err}");
        assert!(
            err.contains("/nonexistent/bwrap") && err.contains("bubblewrap"),
            "{err}"
        );
        let c = Confinement::new(&ConfineSettings {
            allow_unconfined: true,
            ..settings
        })
        .unwrap();
        assert!(!c.is_confined());
        assert!(
            c.describe().contains("/nonexistent/bwrap"),
            "{}",
            c.describe()
        );
    }

    #[test]
    fn ensure_real_dir_replaces_links_and_files() {
        let d = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), d.path().join("a")).unwrap();
        ensure_real_dir(d.path(), Path::new("a/b/c")).unwrap();
        assert!(!std::fs::symlink_metadata(d.path().join("a"))
            .unwrap()
            .file_type()
            .is_symlink());
        assert!(d.path().join("a/b/c").is_dir());
        assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
        std::fs::remove_dir(d.path().join("a/b/c")).unwrap();
        std::fs::write(d.path().join("a/b/c"), "x").unwrap();
        ensure_real_dir(d.path(), Path::new("a/b/c")).unwrap();
        assert!(d.path().join("a/b/c").is_dir());
    }

    #[test]
    fn harden_process_makes_this_process_non_dumpable() {
        harden_process();
        assert!(!is_dumpable());
    }
}
