//! The Docker sandbox: one container per episode, and a persistent shell inside it.
//!
//! Long (about 1,500 lines) because the container's lifecycle, the shell protocol and
//! the file operations run over that shell share one private state (the container and its
//! open exec), and the blocking adapter [`BlockingDocker`] closes it; its tests need an
//! engine and live in tests/docker_*.rs.
//!
//! The shell is one `docker exec` of bash kept open for the whole episode (not one exec
//! per command, which costs a round trip through the daemon each time). Each command is
//! sent as a here-document (delimited by a unique marker) to a helper function that runs it
//! in a forked subshell, a background job with a process group of its own, armed on the
//! shell's one watchdog job, which kills that group at the deadline (Docker has no API to
//! kill an exec, so the deadline is enforced inside the container). One fork and no exec
//! per command, and per-command files on the container's tmpfs, keep the round trip
//! short. The function records the directory the command ended in and prints a marker
//! line with the exit code.
//! The caller reads until the marker; if the marker does not come in time the shell is
//! replaced. Containers carry labels (run, worker, episode) so a restarted worker can
//! remove the orphans of its predecessor.
//!
//! Limits ([`ContainerSpec`]; docs/security.md, "Docker sandbox", says what each is
//! for): memory without swap, CPU, pids, open files and file size, no network, no
//! capabilities, and a read-only root whose writable places are size-capped tmpfs
//! mounts (the image's own repository directory copied in). The repository is the
//! image's working directory (`WORKDIR`; /testbed where it names none), as SWE-bench,
//! SWE-Gym and SWE-rebench images keep it. Files go in through `tar` in an exec,
//! and the worker's own execs are cut at [`EXEC_OUTPUT_CAP`] and a time limit inside
//! the container.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bollard::container::LogOutput;
use bollard::models::{ContainerCreateBody, ExecConfig, HostConfig, ResourcesUlimits};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, DownloadFromContainerOptionsBuilder,
    ListContainersOptionsBuilder, RemoveContainerOptionsBuilder,
};
use bollard::Docker;
use futures::StreamExt;
use tokio::io::AsyncWriteExt;
use tokio::runtime::Handle;

use crate::observation::truncate_head_tail;
use crate::sandbox::{
    shell_quote, CommandOutput, LeftOutReason, Sandbox, SandboxError, Submission,
    BOOKKEEPING_CONFIG, LEFT_OUT_LISTED, MAX_SUBMISSION_BYTES, MAX_UNTRACKED_FILE_BYTES,
    SUBMISSION_EXCLUDE,
};
use crate::tasks::TaskRecord;

/// Label keys on every container Tutor creates.
pub const LABEL_RUN: &str = "tutor.run";
pub const LABEL_WORKER: &str = "tutor.worker";
pub const LABEL_EPISODE: &str = "tutor.episode";

/// Where the repository lives inside the container when the image names no working
/// directory (or `/`): SWE-bench's layout.
pub const DEFAULT_WORKDIR: &str = "/testbed";

/// The repository directory for an image whose working directory is `image_wd`: that
/// directory, else [`DEFAULT_WORKDIR`]. It goes into shell scripts unquoted, so only an
/// absolute path of plain characters is taken; anything else is an error naming the
/// image.
pub fn repo_dir(image: &str, image_wd: Option<&str>) -> Result<String, DockerError> {
    let wd = image_wd.map(str::trim).unwrap_or_default();
    if wd.is_empty() || wd.trim_end_matches('/').is_empty() {
        return Ok(DEFAULT_WORKDIR.to_string());
    }
    let wd = wd.trim_end_matches('/');
    let plain = wd
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-+@".contains(c));
    // The sandbox's own mounts and the kernel's, and the system's top-level directories,
    // which a tmpfs over the repository would hide.
    const UNDER: [&str; 5] = ["/tmp", "/dev", "/proc", "/sys", "/run"];
    const EXACTLY: [&str; 15] = [
        "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc", "/boot", "/var", "/opt",
        "/home", "/root", "/srv", "/mnt", "/media",
    ];
    let clashes = UNDER
        .iter()
        .any(|d| wd == *d || wd.starts_with(&format!("{d}/")))
        || EXACTLY.contains(&wd);
    if clashes {
        return Err(DockerError::Shell(format!(
            "image {image}: its working directory {wd} is a system or sandbox directory (the \
             repository's tmpfs would hide or clash with it); rebuild the image with WORKDIR \
             /testbed"
        )));
    }
    if !wd.starts_with('/') || !plain || wd.split('/').any(|p| p == ".." || p == ".") {
        return Err(DockerError::Shell(format!(
            "image {image}: its working directory {wd:?} is not an absolute path of plain \
             characters (letters, digits, / . _ - + @), so the repository cannot be placed \
             there; rebuild the image with WORKDIR /testbed"
        )));
    }
    Ok(wd.to_string())
}

/// The user the agent's shell runs as for an image whose own user (`USER`) is
/// `image_user`, where the worker takes the image's (`container_user = "image"`): a
/// numeric, non-root `uid[:gid]` (gid = uid when absent). Root or a name is an error
/// naming the image: with every capability dropped root is not confined by ownership of
/// the image's files, and a name would need the image's /etc/passwd.
pub fn image_user(image: &str, image_user: Option<&str>) -> Result<(u32, u32), DockerError> {
    let u = image_user.map(str::trim).unwrap_or_default();
    let (uid, gid) = u.split_once(':').unwrap_or((u, u));
    match (uid.parse::<u32>(), gid.parse::<u32>()) {
        (Ok(uid), Ok(gid)) if uid != 0 => Ok((uid, gid)),
        _ => Err(DockerError::Shell(format!(
            "image {image} runs as {:?}, but worker.container_user = \"image\" takes only a \
             numeric non-root user (uid or uid:gid): set worker.container_user to the uid:gid \
             the agent should run as (1000:1000 by default)",
            if u.is_empty() { "root" } else { u }
        ))),
    }
}

/// Where the tools (crate::tools) are installed inside the container.
const TOOLS_DIR: &str = "/tmp/.tutor/bin";
/// The home of the bookkeeping user ([`book_owner`]) in the container, made by that user
/// (mode 0700) before the agent acts: the agent can neither write nor read what is in
/// it. `/tmp` is sticky, so the agent cannot remove or rename it either.
const BOOK_HOME: &str = "/tmp/.tutor-book";
/// The bookkeeping git directory (see [`BOOKKEEPING_CONFIG`]), in [`BOOK_HOME`]: our
/// config only, the repository's objects borrowed through `objects/info/alternates`.
const BOOK_DIR: &str = "/tmp/.tutor-book/bookkeeping.git";

/// The uid and gid the sandbox's own git reads run as: not the agent's (`agent`), so no
/// config, attributes file or hook the agent writes is one git reads there (the agent's
/// own work tree is read through its files' modes, as any user may).
fn book_owner(agent: (u32, u32)) -> (u32, u32) {
    let uid = if agent.0 == 65532 { 65531 } else { 65532 };
    (uid, uid)
}

/// `uid:gid`, as Docker takes a user.
fn as_user((uid, gid): (u32, u32)) -> String {
    format!("{uid}:{gid}")
}

/// Marks the base's submodules skip-worktree in the index being built (`@GIT@`: the
/// bookkeeping git): `add` would otherwise run `git status` inside each, which reads the
/// submodule's config, the agent's to write (a clean filter there would run as the
/// bookkeeping user).
const SKIP_SUBMODULES: &str = r#"@GIT@ ls-files -s -z | while IFS= read -r -d '' l; do
  case $l in 160000' '*) printf '%s\0' "${l#*$'\t'}";; esac
done | @GIT@ update-index -z --skip-worktree --stdin"#;

/// `git` against [`BOOK_DIR`] with the repository `workdir` as its work tree, bounded in
/// time (an exec cannot be killed from outside). Run by [`book_owner`], whose execs have
/// no global or system config either (`GIT_CONFIG_GLOBAL=/dev/null`,
/// `GIT_CONFIG_NOSYSTEM`); the work tree is another user's, hence `safe.directory`.
fn book_git(workdir: &str) -> String {
    let mut git = format!(
        "timeout -k 5 120 git --git-dir={BOOK_DIR} --work-tree={workdir} -c 'safe.directory=*'"
    );
    for (key, value) in BOOKKEEPING_CONFIG {
        git.push_str(&format!(" -c {key}={value}"));
    }
    git
}

/// The submission's script (see [`DockerSandbox::submission`]); `@GIT@` is [`book_git`],
/// `@REPO@` the repository, the other `@…@` the base commit and the caps. Its stderr goes to a file, shown when a
/// step fails (exit 1). Its answer, on stdout: a line `<diff bytes> <large files> <binary
/// files>`, then the first `@LISTED@` of the large files as `<size>\t<path>\0` records,
/// the first `@LISTED@` of the binary ones as `<path>\0`, then the patch unless the
/// diff was over the cap. Every list of paths is NUL-separated and never word-split.
const SUBMISSION_SCRIPT: &str = r#"
S=@HOME@/submission
rm -rf "$S" && mkdir -p "$S" || { echo "cannot make $S"; exit 1; }
exec 2>"$S/err"
fail() { printf '%s failed: ' "$1"; head -c 2000 "$S/err"; exit 1; }
cd @REPO@ || fail cd
export GIT_INDEX_FILE=@HOME@/diff-index
rm -f "$GIT_INDEX_FILE"
@GIT@ read-tree @BASE@ || fail read-tree
# Submodules of the base are not looked into (see SKIP_SUBMODULES).
@SKIP_SUBMODULES@ || fail skip-submodules
# Untracked files over the cap: named, and excluded from `add`.
@GIT@ ls-files -o --exclude-standard -z > "$S/untracked" || fail ls-files
xargs -0 -r stat --printf '%s\t%F\t%n\0' -- < "$S/untracked" > "$S/sizes"
printf '.\0' > "$S/spec"
: > "$S/large"
while IFS= read -r -d '' l; do
  n=${l%%$'\t'*}; r=${l#*$'\t'}
  if [ "${r%%$'\t'*}" = "regular file" ] && [ "$n" -gt @FILE_CAP@ ]; then
    printf ':(exclude,literal)%s\0' "${r#*$'\t'}" >> "$S/spec"
    printf '%s\t%s\0' "$n" "${r#*$'\t'}" >> "$S/large"
  fi
done < "$S/sizes"
# A file this user cannot read (the agent's mode 0600) is left out, not the whole
# submission: --ignore-errors adds the rest and exits 1.
@GIT@ add -A --ignore-errors --pathspec-from-file="$S/spec" --pathspec-file-nul
[ $? -le 1 ] || fail add
# Binary changes (numstat shows "-<tab>-<tab>" for them): reset to the base.
@GIT@ diff --cached --numstat -z --no-renames @BASE@ -- > "$S/numstat" || fail numstat
: > "$S/binary"
while IFS= read -r -d '' l; do
  case $l in $'-\t-\t'*) printf '%s\0' "${l#$'-\t-\t'}" >> "$S/binary";; esac
done < "$S/numstat"
if [ -s "$S/binary" ]; then
  GIT_LITERAL_PATHSPECS=1 @GIT@ reset -q @BASE@ --pathspec-from-file="$S/binary" --pathspec-file-nul || fail reset
fi
# The diff, at most the cap + 1 bytes of it: past that git is cut off (SIGPIPE).
@GIT@ -c core.quotepath=off diff --cached --binary --no-color --no-ext-diff --no-textconv \
  --no-renames --src-prefix=a/ --dst-prefix=b/ @BASE@ -- | head -c @CAP1@ > "$S/patch"
rc=${PIPESTATUS[0]}
size=$(stat -c %s "$S/patch") || fail size
[ "$rc" -eq 0 ] || [ "$size" -gt @CAP@ ] || fail diff
printf '%s %s %s\n' "$size" "$(tr -cd '\0' < "$S/large" | wc -c)" "$(tr -cd '\0' < "$S/binary" | wc -c)"
head -z -n @LISTED@ "$S/large"
head -z -n @LISTED@ "$S/binary"
[ "$size" -gt @CAP@ ] || cat "$S/patch"
"#;

/// Reads [`SUBMISSION_SCRIPT`]'s answer.
fn parse_submission(out: &[u8]) -> Result<Submission, String> {
    let nl = out
        .iter()
        .position(|&b| b == b'\n')
        .ok_or("no header line")?;
    let header = String::from_utf8_lossy(&out[..nl]);
    let nums: Vec<u64> = header
        .split_whitespace()
        .map(|n| {
            n.parse::<u64>()
                .map_err(|e| format!("header {header:?}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let [size, large, binary] = nums[..] else {
        return Err(format!("header {header:?}: three numbers expected"));
    };
    let mut rest = &out[nl + 1..];
    let mut record = || -> Result<&[u8], String> {
        let z = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or("a left-out path is cut short")?;
        let (rec, after) = rest.split_at(z);
        rest = &after[1..];
        Ok(rec)
    };
    let mut sub = Submission::default();
    for _ in 0..(large as usize).min(LEFT_OUT_LISTED) {
        let rec = record()?;
        let tab = rec
            .iter()
            .position(|&b| b == b'\t')
            .ok_or("a large file without its size")?;
        let bytes = String::from_utf8_lossy(&rec[..tab])
            .parse::<u64>()
            .map_err(|e| format!("a large file's size: {e}"))?;
        let path = String::from_utf8_lossy(&rec[tab + 1..]).into_owned();
        sub.leave_out(path, LeftOutReason::Large(bytes));
    }
    for _ in 0..(binary as usize).min(LEFT_OUT_LISTED) {
        let path = String::from_utf8_lossy(record()?).into_owned();
        sub.leave_out(path, LeftOutReason::Binary);
    }
    sub.left_out_total = (large + binary) as usize;
    if size > MAX_SUBMISSION_BYTES as u64 {
        sub.too_large = Some(size);
    } else if rest.len() as u64 != size {
        return Err(format!(
            "the patch is {} bytes, the header says {size}",
            rest.len()
        ));
    } else {
        sub.patch = String::from_utf8_lossy(rest).into_owned();
    }
    Ok(sub)
}

/// Output kept per command before head+tail truncation (the rest is read and dropped).
const CAPTURE_BYTES: usize = 1024 * 1024;

/// The most stdout the worker takes from one of its own execs (git, `cat` of a file, the
/// submission script), in bytes. Inside the container the output goes through
/// `head -c` one byte past it, so the command is stopped (SIGPIPE) there; the worker keeps
/// no more than this and fails the exec with [`DockerError::OutputTooLarge`]. Above
/// the submission's own cap ([`MAX_SUBMISSION_BYTES`] plus the left-out paths).
pub const EXEC_OUTPUT_CAP: usize = 8 << 20;
const _: () = assert!(MAX_SUBMISSION_BYTES + 2 * LEFT_OUT_LISTED * 8192 < EXEC_OUTPUT_CAP);

/// Time limits of the worker's own execs (killed inside the container by `timeout`, the
/// worker waiting 30 s more): a file read, one git command, the submission script (several
/// git commands of 120 s at most each), copying files in.
const FILE_LIMIT: Duration = Duration::from_secs(60);
const GIT_LIMIT: Duration = Duration::from_secs(300);
const SUBMISSION_LIMIT: Duration = Duration::from_secs(900);
const COPY_LIMIT: Duration = Duration::from_secs(600);

#[derive(Debug, thiserror::Error)]
pub enum DockerError {
    #[error("the Docker engine is not reachable ({0}); is the daemon running and is /var/run/docker.sock readable?")]
    Unreachable(String),
    #[error(
        "image {0} is not present; build it with `make images` (no registry is reachable here)"
    )]
    MissingImage(String),
    #[error("image {image} is not present and pulling it failed: {error}")]
    PullFailed { image: String, error: String },
    #[error("docker: {0}")]
    Api(#[from] bollard::errors::Error),
    #[error("sandbox shell: {0}")]
    Shell(String),
    /// One of the worker's own execs wrote more than [`EXEC_OUTPUT_CAP`] bytes; it was
    /// stopped and its output dropped.
    #[error("the output of `{command}` is over {cap} bytes; the command was stopped and its output dropped")]
    OutputTooLarge { command: String, cap: usize },
    #[error("`{command}` did not finish within {limit:?}")]
    ExecTimeout { command: String, limit: Duration },
}

/// Limits and identity of a sandbox container (docs/security.md, "Docker sandbox", says
/// what each limit is for).
#[derive(Debug, Clone)]
pub struct ContainerSpec {
    pub image: String,
    pub run: String,
    pub worker: String,
    pub episode: String,
    /// Memory limit; swap is limited to it too (`memory_swap` = `memory`: no swap beyond
    /// it). The tmpfs mounts of a read-only root are charged to it as they fill.
    pub memory_bytes: i64,
    pub nano_cpus: i64,
    pub pids_limit: i64,
    pub network: bool,
    /// uid:gid the shell runs as and the task files belong to. With every capability
    /// dropped, root could not write files owned by anyone else, so the agent runs as
    /// the image's unprivileged user (1000 in deploy/images/python-task).
    pub user: (u32, u32),
    /// Take the image's own user instead of [`Self::user`] (`[worker] container_user =
    /// "image"`): a numeric non-root one, else the launch fails (see [`image_user`]).
    pub user_from_image: bool,
    /// Open files per process (`ulimit -n`, soft and hard).
    pub nofile: i64,
    /// Largest file a process may write, in bytes (`ulimit -f`, soft and hard): a write
    /// past it fails with EFBIG (SIGXFSZ, "File size limit exceeded", where not ignored).
    pub fsize_bytes: i64,
    /// The root filesystem read-only; the writable places are size-capped tmpfs mounts:
    /// the repository ([`Self::disk_bytes`], the image's own content copied in at launch),
    /// /tmp ([`Self::tmp_bytes`]) and /dev/shm ([`SHM_BYTES`]). Off for an image that
    /// must write elsewhere (a SWE-bench image whose tests install into its environment);
    /// then [`Self::disk_bytes`] caps the container's writable layer where the storage
    /// driver supports `--storage-opt size` (overlay2 on xfs with pquota, btrfs, zfs,
    /// devicemapper), and nothing but [`Self::fsize_bytes`] caps the disk elsewhere
    /// (fuse-overlayfs, overlay2 on ext4; a warning says so once).
    pub read_only_root: bool,
    /// What the agent can write: the size of the repository's tmpfs (read-only root), or of
    /// the writable layer (writable root, where supported). Past it: ENOSPC.
    pub disk_bytes: i64,
    /// The size of /tmp's tmpfs (read-only root only; the tools and the bookkeeping git
    /// directory live there too).
    pub tmp_bytes: i64,
    /// Pull [`Self::image`] from its registry when the engine lacks it (`[worker]
    /// pull_images`): a Kubernetes worker pod's engine sidecar starts with no image. Off,
    /// a missing image is an error at once.
    pub pull_missing: bool,
}

/// /dev/shm's size (Docker's default, set explicitly): the shell's per-command state
/// lives there, and it is writable even on a read-only root.
pub const SHM_BYTES: i64 = 64 << 20;

impl ContainerSpec {
    pub fn new(image: &str, run: &str, worker: &str, episode: &str) -> Self {
        Self {
            image: image.into(),
            run: run.into(),
            worker: worker.into(),
            episode: episode.into(),
            memory_bytes: 2 << 30,
            nano_cpus: 1_000_000_000,
            pids_limit: 512,
            network: false,
            user: (1000, 1000),
            user_from_image: false,
            nofile: 1024,
            fsize_bytes: 1 << 30,
            read_only_root: true,
            // With /tmp and /dev/shm, 1.3 GiB of the 2 GiB of memory at most: a full
            // disk leaves the processes 0.7 GiB.
            disk_bytes: 1 << 30,
            tmp_bytes: 256 << 20,
            pull_missing: false,
        }
    }

    /// Whether containers made from `self` and from `other` get the same limits (the
    /// image, run and episode aside): what the warm pool checks before handing one out.
    pub fn same_limits(&self, other: &ContainerSpec) -> bool {
        self.memory_bytes == other.memory_bytes
            && self.nano_cpus == other.nano_cpus
            && self.pids_limit == other.pids_limit
            && self.network == other.network
            && self.user == other.user
            && self.user_from_image == other.user_from_image
            && self.nofile == other.nofile
            && self.fsize_bytes == other.fsize_bytes
            && self.read_only_root == other.read_only_root
            && self.disk_bytes == other.disk_bytes
            && self.tmp_bytes == other.tmp_bytes
    }

    /// The container's host configuration for the repository at `workdir`, its files
    /// owned by `user`; `storage_quota`: give a writable root `--storage-opt size` (only
    /// where the engine's driver supports it).
    fn host_config(&self, storage_quota: bool, workdir: &str, user: (u32, u32)) -> HostConfig {
        let ulimit = |name: &str, n: i64| ResourcesUlimits {
            name: Some(name.into()),
            soft: Some(n),
            hard: Some(n),
        };
        let mut host = HostConfig {
            memory: Some(self.memory_bytes),
            memory_swap: Some(self.memory_bytes),
            nano_cpus: Some(self.nano_cpus),
            pids_limit: Some(self.pids_limit),
            ulimits: Some(vec![
                ulimit("nofile", self.nofile),
                ulimit("fsize", self.fsize_bytes),
            ]),
            shm_size: Some(SHM_BYTES),
            network_mode: Some(if self.network {
                "bridge".into()
            } else {
                "none".into()
            }),
            cap_drop: Some(vec!["ALL".into()]),
            security_opt: Some(vec!["no-new-privileges".into()]),
            init: Some(true),
            ..Default::default()
        };
        if self.read_only_root {
            let (uid, gid) = user;
            host.readonly_rootfs = Some(true);
            // Docker's tmpfs defaults to noexec: the tools in /tmp and whatever the agent
            // builds in the repository must run.
            host.tmpfs = Some(HashMap::from([
                (
                    workdir.to_string(),
                    format!(
                        "rw,exec,nosuid,nodev,size={},uid={uid},gid={gid},mode=0755",
                        self.disk_bytes
                    ),
                ),
                (
                    "/tmp".to_string(),
                    format!("rw,exec,nosuid,nodev,size={},mode=1777", self.tmp_bytes),
                ),
            ]));
        } else if storage_quota {
            host.storage_opt = Some(HashMap::from([(
                "size".to_string(),
                self.disk_bytes.to_string(),
            )]));
        }
        host
    }
}

/// Whether the engine's storage driver takes `--storage-opt size` (0: not known yet,
/// 1: yes, 2: no): learnt from the first writable-root container, for the process.
static STORAGE_QUOTA: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Connects to the engine `DOCKER_HOST` names (`unix://PATH`, or `tcp://HOST:PORT` such
/// as a Kubernetes worker pod's Docker sidecar; default the local socket) and checks it
/// answers.
pub async fn connect() -> Result<Docker, DockerError> {
    let docker =
        Docker::connect_with_defaults().map_err(|e| DockerError::Unreachable(e.to_string()))?;
    let docker = docker
        .negotiate_version()
        .await
        .map_err(|e| DockerError::Unreachable(e.to_string()))?;
    docker
        .ping()
        .await
        .map_err(|e| DockerError::Unreachable(e.to_string()))?;
    Ok(docker)
}

/// How long one image pull may take before the sandbox gives up on it.
const PULL_LIMIT: Duration = Duration::from_secs(1800);

/// Pulls `image` (`name[:tag]`, `name@digest`; no tag means `latest`) from its registry,
/// logging progress once per layer; the engine deduplicates concurrent pulls of one
/// image. No credentials are sent: the registry must allow anonymous pulls (or be a
/// mirror the engine is configured with). Errors name the image.
pub async fn pull(docker: &Docker, image: &str) -> Result<(), DockerError> {
    use futures::StreamExt;
    let failed = |error: String| DockerError::PullFailed {
        image: image.to_string(),
        error,
    };
    tracing::info!(%image, "pulling the sandbox image (not present on the engine)");
    // Without a tag or digest the engine would pull every tag of the repository.
    let last = image.rsplit('/').next().unwrap_or(image);
    let reference = if last.contains(':') || last.contains('@') {
        image.to_string()
    } else {
        format!("{image}:latest")
    };
    let options = bollard::query_parameters::CreateImageOptionsBuilder::default()
        .from_image(&reference)
        .build();
    let started = std::time::Instant::now();
    let mut layers = std::collections::HashSet::new();
    let mut stream = docker.create_image(Some(options), None, None);
    let drained = tokio::time::timeout(PULL_LIMIT, async {
        while let Some(item) = stream.next().await {
            let info = item.map_err(|e| failed(e.to_string()))?;
            if let Some(e) = info.error_detail.and_then(|d| d.message) {
                return Err(failed(e));
            }
            if let (Some(id), Some(status)) = (info.id, info.status) {
                if status.starts_with("Pull complete") && layers.insert(id.clone()) {
                    tracing::info!(%image, layer = %id, "layer pulled");
                }
            }
        }
        Ok(())
    })
    .await;
    match drained {
        Err(_) => return Err(failed(format!("not done after {PULL_LIMIT:?}"))),
        Ok(r) => r?,
    }
    docker
        .inspect_image(image)
        .await
        .map_err(|e| failed(format!("pulled, but the engine does not show it: {e}")))?;
    tracing::info!(%image, seconds = started.elapsed().as_secs_f64(), "sandbox image pulled");
    Ok(())
}

/// How often `DockerSandbox::remove` asks the engine before it gives up (waiting 0.25 s,
/// then twice as long each time).
const REMOVE_ATTEMPTS: u32 = 4;

/// Removes every container labelled with `run` (and `worker`, when given): what a
/// killed worker left behind. Returns how many were removed.
pub async fn remove_orphans(
    docker: &Docker,
    run: &str,
    worker: Option<&str>,
) -> Result<usize, DockerError> {
    let mut labels = vec![format!("{LABEL_RUN}={run}")];
    if let Some(w) = worker {
        labels.push(format!("{LABEL_WORKER}={w}"));
    }
    let filters = HashMap::from([("label".to_string(), labels)]);
    let list = docker
        .list_containers(Some(
            ListContainersOptionsBuilder::default()
                .all(true)
                .filters(&filters)
                .build(),
        ))
        .await?;
    let mut n = 0;
    for c in list {
        if let Some(id) = c.id {
            docker
                .remove_container(
                    &id,
                    Some(RemoveContainerOptionsBuilder::default().force(true).build()),
                )
                .await?;
            n += 1;
        }
    }
    Ok(n)
}

/// The bash function every command goes through (see the module comment); the shell is
/// given `__tutor_repo` (the repository directory, readonly) before it.
const SHELL_PRELUDE: &str = r#"
# The shell's own stderr carries only its notices (job status, "Killed"); every command's
# stderr is merged into its stdout below.
exec 2>/dev/null
# Job control: each command runs as a background job in a process group of its own, so
# a timeout or the clean-up after it kills the whole group.
set -m
# Per-command state (the command, the directory it ended in, the tools' state) lives on
# the container's tmpfs when it has a writable one: the root filesystem can be
# fuse-overlayfs, where each open, write and stat is a trip through a userspace daemon
# (that cost several ms per command). Read-only, so no command can redirect it.
__tutor_s=/dev/shm/.tutor
{ mkdir -p "$__tutor_s" && [ -w "$__tutor_s" ]; } 2>/dev/null || __tutor_s=/tmp/.tutor
readonly __tutor_s
mkdir -p /tmp/.tutor "$__tutor_s"; echo "$__tutor_repo" > "$__tutor_s/cwd"; __tutor_cwd=$__tutor_repo
# A SWE-bench image keeps its environment in a conda env that must be activated (its
# `python` and the repository's dependencies are there): every command runs in it.
if [ -f /opt/miniconda3/bin/activate ]; then
  . /opt/miniconda3/bin/activate >/dev/null 2>&1 && conda activate testbed >/dev/null 2>&1
fi
export PATH="/tmp/.tutor/bin:$PATH" TUTOR_STATE_DIR="$__tutor_s" TUTOR_REPO="$__tutor_repo" TUTOR_REPO_DISPLAY="$__tutor_repo"
# The watchdog: one job for the whole shell, not one per command. It reads
# "<process group> <seconds>" to arm and any line to disarm from a FIFO the shell keeps
# open read-write on fd 9, and kills the group at the deadline (`read -t` is its timer,
# so it never execs; it exists before the command, so a fork bomb that exhausts the pid
# limit cannot stop it).
__tutor_watchdog() {
  local pid secs ack
  while read -r pid secs; do
    read -r -t "$secs" ack || { kill -KILL -- -"$pid"; read -r ack; }
  done
}
__tutor_start_watchdog() {
  rm -f "$__tutor_s/wd"; mkfifo "$__tutor_s/wd"; exec 9<> "$__tutor_s/wd"
  __tutor_watchdog <&9 >/dev/null 2>&1 &
  __tutor_wd=$!
}
__tutor_start_watchdog
__tutor_run() {
  # The command arrives as a here-document (delimited by the unique marker) on the
  # function's stdin; `read` and `printf` are builtins, so no process is spawned for it.
  local __cmd; IFS= read -r -d '' __cmd
  # The deadline and the end marker leave the positional parameters, and the marker is
  # unset in the command's subshell: the command cannot print it to fake its own end.
  local __secs=$1 __mark=$2; set --
  if ! printf '%s' "$__cmd" > "$__tutor_s/cmd.sh"; then
    printf 'sandbox: could not write the command to %s (is it full?)\n\n%s %d\t%s\t\n' "$__tutor_s" "$__mark" 126 "$__tutor_cwd"
    return
  fi
  # A watchdog that died (a command may kill it) is replaced before it is needed.
  kill -0 "$__tutor_wd" 2>/dev/null || __tutor_start_watchdog
  cd "$__tutor_cwd" 2>/dev/null || cd "$__tutor_repo"
  # The command: a forked subshell (no exec), job control off inside so everything it
  # starts stays in its group, without the watchdog's FIFO; the EXIT trap records where
  # it ended.
  ( unset __mark __secs; set +m; trap 'pwd > "$__tutor_s/cwd"' EXIT; . "$__tutor_s/cmd.sh" ) </dev/null 9>&- 2>&1 &
  local __pid=$!
  echo "$__pid $__secs" >&9
  wait "$__pid"; local rc=$?
  echo >&9
  # Whatever the command left running in the background goes with it.
  kill -KILL -- -"$__pid" 2>/dev/null
  local __file=
  read -r __tutor_cwd < "$__tutor_s/cwd"
  [ -f "$__tutor_s/current_file" ] && read -r __file < "$__tutor_s/current_file"
  printf '\n%s %d\t%s\t%s\n' "$__mark" "$rc" "$__tutor_cwd" "$__file"
}
"#;

struct Shell {
    input: std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
    output: std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<LogOutput, bollard::errors::Error>> + Send>,
    >,
}

/// One episode's container with its persistent shell.
pub struct DockerSandbox {
    docker: Docker,
    id: String,
    user: String,
    /// In a Mutex only so that the sandbox is `Sync` (a `&DockerSandbox` held across an
    /// await in a spawned task, as the warm pool does); it is never locked, only reached
    /// through `get_mut`.
    shell: Option<std::sync::Mutex<Shell>>,
    cwd: String,
    current_file: Option<String>,
    /// Hash of the commit every diff is taken against.
    base: String,
    /// Files at the base commit, read once (they never change).
    base_files: std::sync::Mutex<HashMap<String, Option<String>>>,
    counter: u64,
    removed: bool,
    /// uid and gid the shell runs as and the task files belong to.
    owner: (u32, u32),
    /// The repository: the image's working directory, else [`DEFAULT_WORKDIR`].
    workdir: String,
    /// Taken from the warm pool (its container carries the pool label, not the episode's).
    pooled: bool,
}

impl DockerSandbox {
    /// Creates and starts the container, copies the task's files into its repository
    /// directory as a tar
    /// and commits them as the base of the episode's diff.
    pub async fn create(
        docker: &Docker,
        spec: &ContainerSpec,
        task: &TaskRecord,
    ) -> Result<Self, DockerError> {
        let labels = HashMap::from([
            (LABEL_RUN.to_string(), spec.run.clone()),
            (LABEL_WORKER.to_string(), spec.worker.clone()),
            (LABEL_EPISODE.to_string(), spec.episode.clone()),
        ]);
        let mut sb = Self::launch(docker, spec, labels).await?;
        if let Err(e) = sb.setup_task(task).await {
            sb.remove().await;
            return Err(e);
        }
        Ok(sb)
    }

    /// Creates and starts a container labelled `labels`, with the tools installed and the
    /// shell running but no task yet: everything of [`Self::create`] that does not depend on
    /// the task, which is what the warm pool (crate::sandbox::pool) does ahead of demand.
    pub(crate) async fn launch(
        docker: &Docker,
        spec: &ContainerSpec,
        labels: HashMap<String, String>,
    ) -> Result<Self, DockerError> {
        let info = match docker.inspect_image(&spec.image).await {
            Ok(info) => info,
            Err(_) if spec.pull_missing => {
                pull(docker, &spec.image).await?;
                docker.inspect_image(&spec.image).await?
            }
            Err(_) => return Err(DockerError::MissingImage(spec.image.clone())),
        };
        // The image's own layout: its working directory holds the repository, and its
        // user runs the shell where the worker is told to take it.
        let config = info.config.unwrap_or_default();
        let workdir = repo_dir(&spec.image, config.working_dir.as_deref())?;
        let user = if spec.user_from_image {
            image_user(&spec.image, config.user.as_deref())?
        } else {
            spec.user
        };
        let body = |host_config| ContainerCreateBody {
            image: Some(spec.image.clone()),
            cmd: Some(vec!["sleep".into(), "infinity".into()]),
            working_dir: Some(workdir.clone()),
            labels: Some(labels.clone()),
            network_disabled: Some(!spec.network),
            host_config: Some(host_config),
            ..Default::default()
        };
        use std::sync::atomic::Ordering::Relaxed;
        let quota = !spec.read_only_root && STORAGE_QUOTA.load(Relaxed) != 2;
        let options = || CreateContainerOptionsBuilder::default().build();
        let created = match docker
            .create_container(
                Some(options()),
                body(spec.host_config(quota, &workdir, user)),
            )
            .await
        {
            Ok(c) => {
                if quota {
                    STORAGE_QUOTA.store(1, Relaxed);
                }
                c
            }
            // "--storage-opt is not supported", "... supported only for overlay over xfs
            // with 'pquota' mount option": the driver has no quota.
            Err(e) if quota && e.to_string().to_lowercase().contains("storage-opt") => {
                if STORAGE_QUOTA.swap(2, Relaxed) != 2 {
                    tracing::warn!(error = %e, "the Docker storage driver has no disk quota: sandboxes with a writable root have no cap on what they write but the file size limit (a read-only root caps it with tmpfs; see docs/security.md)");
                }
                docker
                    .create_container(
                        Some(options()),
                        body(spec.host_config(false, &workdir, user)),
                    )
                    .await?
            }
            Err(e) => return Err(e.into()),
        };
        let mut sb = Self {
            docker: docker.clone(),
            id: created.id,
            user: format!("{}:{}", user.0, user.1),
            owner: user,
            shell: None,
            cwd: workdir.clone(),
            workdir,
            current_file: None,
            base: String::new(),
            base_files: Default::default(),
            counter: 0,
            removed: false,
            pooled: false,
        };
        if let Err(e) = sb.prepare(spec.read_only_root).await {
            sb.remove().await;
            return Err(e);
        }
        Ok(sb)
    }

    /// Starts the container, installs the tools and starts the shell. With a read-only
    /// root, the repository directory is a tmpfs that hides the image's own content (a SWE-bench image
    /// ships its repository there): that content is read before the start and copied in.
    async fn prepare(&mut self, read_only_root: bool) -> Result<(), DockerError> {
        let image_workdir = if read_only_root {
            self.image_workdir().await?
        } else {
            None
        };
        self.docker
            .start_container(
                &self.id,
                None::<bollard::query_parameters::StartContainerOptions>,
            )
            .await?;
        if let Some((file, size)) = image_workdir {
            let cmd = [
                "tar",
                "-x",
                "--no-same-owner",
                "--preserve-permissions",
                "--strip-components=1",
                "-f",
                "-",
                "-C",
                &self.workdir,
            ];
            let workdir = self.workdir.clone();
            self.exec_stdin(&self.user, &cmd, file, COPY_LIMIT)
                .await
                .map_err(|e| {
                    DockerError::Shell(format!(
                        "copying the image's {workdir} ({size} bytes as tar) into the container's \
                     tmpfs failed (too large for disk_bytes, or for memory_bytes, which the \
                     tmpfs is charged to? a writable root avoids the copy): {e}"
                    ))
                })?;
        }
        self.install_tools(self.owner.0, self.owner.1).await?;
        self.start_shell().await
    }

    /// The image's own repository directory as a tar archive in a temporary file, with its size,
    /// read from the created container before it starts (its tmpfs is mounted at the
    /// start); `None` when the image has no such directory or an empty one.
    async fn image_workdir(&self) -> Result<Option<(tokio::fs::File, u64)>, DockerError> {
        use tokio::io::AsyncSeekExt;
        let io = |e: std::io::Error| {
            DockerError::Shell(format!(
                "reading the image's {} into a temporary file: {e}",
                self.workdir
            ))
        };
        let mut stream = self.docker.download_from_container(
            &self.id,
            Some(
                DownloadFromContainerOptionsBuilder::default()
                    .path(&self.workdir)
                    .build(),
            ),
        );
        let mut file = tokio::fs::File::from_std(tempfile::tempfile().map_err(io)?);
        let mut size = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(bollard::errors::Error::DockerResponseServerError {
                    status_code: 404, ..
                }) => return Ok(None),
                Err(e) => return Err(e.into()),
            };
            size += chunk.len() as u64;
            file.write_all(&chunk).await.map_err(io)?;
        }
        file.flush().await.map_err(io)?;
        file.rewind().await.map_err(io)?;
        // An empty directory is its own entry and the end of the archive.
        if size <= 16 * 1024 {
            let mut tar = Vec::new();
            tokio::io::AsyncReadExt::read_to_end(&mut file, &mut tar)
                .await
                .map_err(io)?;
            let entries = tar::Archive::new(&tar[..]).entries().map_err(io)?.count();
            if entries <= 1 {
                return Ok(None);
            }
            file.rewind().await.map_err(io)?;
        }
        Ok(Some((file, size)))
    }

    /// Copies the task's files into the repository directory and commits them as the base of the diff
    /// (or tags the image's own checkout as the base).
    pub(crate) async fn setup_task(&mut self, task: &TaskRecord) -> Result<(), DockerError> {
        let (uid, gid) = self.owner;
        // Directories get entries of their own: ones the engine creates implicitly would
        // belong to root, and the unprivileged shell could not write into them.
        let mut builder = tar::Builder::new(Vec::new());
        let mut dirs = std::collections::BTreeSet::new();
        for f in &task.files {
            let mut p = std::path::Path::new(&f.path).parent();
            while let Some(d) = p.filter(|d| !d.as_os_str().is_empty()) {
                dirs.insert(d.to_path_buf());
                p = d.parent();
            }
        }
        let header = |size: u64, mode: u32, kind: tar::EntryType| {
            let mut h = tar::Header::new_gnu();
            h.set_size(size);
            h.set_mode(mode);
            h.set_mtime(0);
            h.set_uid(uid as u64);
            h.set_gid(gid as u64);
            h.set_entry_type(kind);
            h
        };
        for d in &dirs {
            let mut h = header(0, 0o755, tar::EntryType::Directory);
            builder
                .append_data(&mut h, d, std::io::empty())
                .map_err(|e| DockerError::Shell(format!("packing {}: {e}", d.display())))?;
        }
        for f in &task.files {
            let mut h = header(f.content.len() as u64, 0o644, tar::EntryType::Regular);
            builder
                .append_data(&mut h, &f.path, f.content.as_bytes())
                .map_err(|e| DockerError::Shell(format!("packing {}: {e}", f.path)))?;
        }
        let tar = builder
            .into_inner()
            .map_err(|e| DockerError::Shell(format!("packing the task files: {e}")))?;
        let uploading = !task.files.is_empty();
        if uploading {
            let workdir = self.workdir.clone();
            self.upload(&workdir, tar).await?;
        }
        // Our own tasks are committed here as the base; images that ship the repository
        // (SWE-bench) are at the base commit already.
        let setup = if uploading {
            "git init -q && git config user.email tutor@localhost && git config user.name tutor \
             && git config commit.gpgsign false && git add -A && git commit -q -m base && git tag tutor-base"
        } else {
            "git rev-parse -q --verify HEAD >/dev/null && git tag -f tutor-base >/dev/null"
        };
        let out = self.run(setup, Duration::from_secs(60)).await;
        if out.exit_code != 0 {
            return Err(DockerError::Shell(format!(
                "setting up the repository in {} failed (exit {}): {}",
                self.workdir, out.exit_code, out.output
            )));
        }
        let setup = format!(
            "printf %s {} >> .git/info/exclude && git rev-parse tutor-base",
            shell_quote(SUBMISSION_EXCLUDE),
        );
        let out = self.run(&setup, Duration::from_secs(30)).await;
        self.base = out.output.trim().to_string();
        if out.exit_code != 0 || self.base.len() < 40 {
            return Err(DockerError::Shell(format!(
                "reading the base commit failed: {}",
                out.output
            )));
        }
        // The bookkeeping git directory, made by the bookkeeping user before the agent
        // acts, in a home only that user may enter.
        let book = format!(
            "umask 077 && mkdir {BOOK_HOME} && git init -q --bare {BOOK_DIR} \
             && echo {workdir}/.git/objects > {BOOK_DIR}/objects/info/alternates \
             && cp {workdir}/.git/info/exclude {BOOK_DIR}/info/exclude 2>&1",
            workdir = self.workdir
        );
        match self
            .book_exec(&["bash", "-c", &book], Duration::from_secs(30))
            .await
        {
            Ok((0, _)) => {}
            Ok((code, out)) => {
                return Err(DockerError::Shell(format!(
                    "making the bookkeeping git directory {BOOK_DIR} as user {} failed (exit \
                     {code}): {}",
                    as_user(book_owner(self.owner)),
                    String::from_utf8_lossy(&out).trim()
                )))
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// Unpacks `tar` into `path` as the shell's user, through `tar` in the container (the
    /// engine's archive upload refuses a read-only root, and writes beside a tmpfs, not
    /// into it).
    async fn upload(&self, path: &str, tar: Vec<u8>) -> Result<(), DockerError> {
        self.upload_as(&self.user, path, tar).await
    }

    /// `upload` by `user` (who must be able to write `path`).
    async fn upload_as(&self, user: &str, path: &str, tar: Vec<u8>) -> Result<(), DockerError> {
        let cmd = ["tar", "-x", "--no-same-owner", "-f", "-", "-C", path];
        self.exec_stdin(user, &cmd, &tar[..], COPY_LIMIT).await
    }

    /// Runs `cmd` as its own exec with `input` on its stdin (closed at its end); an error
    /// with the start of its output if it fails.
    async fn exec_stdin<R>(
        &self,
        user: &str,
        cmd: &[&str],
        mut input: R,
        limit: Duration,
    ) -> Result<(), DockerError>
    where
        R: tokio::io::AsyncRead + Unpin + Send,
    {
        let command = cmd.join(" ");
        let exec = self
            .docker
            .create_exec(
                &self.id,
                ExecConfig {
                    attach_stdin: Some(true),
                    attach_stdout: Some(true),
                    attach_stderr: Some(true),
                    cmd: Some(cmd.iter().map(|s| s.to_string()).collect()),
                    working_dir: Some("/".into()),
                    user: Some(user.to_string()),
                    env: Some(vec!["HOME=/tmp/.tutor".into(), "LC_ALL=C.UTF-8".into()]),
                    ..Default::default()
                },
            )
            .await?;
        let bollard::exec::StartExecResults::Attached {
            mut output,
            input: mut stdin,
        } = self.docker.start_exec(&exec.id, None).await?
        else {
            return Err(DockerError::Shell("exec started detached".into()));
        };
        let write = async move {
            let copied = tokio::io::copy(&mut input, &mut stdin).await;
            // The end of stdin: the command sees EOF.
            let closed = stdin.shutdown().await;
            copied.and(closed)
        };
        // Drained as it comes (so the command never blocks on a full pipe), the first
        // 4 KiB kept for the error message.
        let read = async {
            let mut said = Vec::new();
            while let Some(chunk) = output.next().await {
                let bytes = chunk?.into_bytes();
                let room = 4096usize.saturating_sub(said.len());
                said.extend_from_slice(&bytes[..bytes.len().min(room)]);
            }
            Ok::<_, bollard::errors::Error>(said)
        };
        let (written, said) = tokio::time::timeout(limit, async { tokio::join!(write, read) })
            .await
            .map_err(|_| DockerError::ExecTimeout {
                command: command.clone(),
                limit,
            })?;
        let said = said?;
        let code = self
            .docker
            .inspect_exec(&exec.id)
            .await?
            .exit_code
            .unwrap_or(-1);
        if code != 0 {
            return Err(DockerError::Shell(format!(
                "`{command}` failed (exit {code}): {}",
                String::from_utf8_lossy(&said).trim()
            )));
        }
        written.map_err(|e| DockerError::Shell(format!("writing to `{command}`: {e}")))
    }

    /// Puts the tool helper and its shims (crate::tools) into /tmp/.tutor/bin, owned by
    /// the shell's user.
    async fn install_tools(&self, uid: u32, gid: u32) -> Result<(), DockerError> {
        let mut builder = tar::Builder::new(Vec::new());
        let header = |size: u64, mode: u32, kind: tar::EntryType| {
            let mut h = tar::Header::new_gnu();
            h.set_size(size);
            h.set_mode(mode);
            h.set_mtime(0);
            h.set_uid(uid as u64);
            h.set_gid(gid as u64);
            h.set_entry_type(kind);
            h
        };
        let pack = |e: std::io::Error| DockerError::Shell(format!("packing the tools: {e}"));
        for d in [".tutor", ".tutor/bin"] {
            let mut h = header(0, 0o755, tar::EntryType::Directory);
            builder
                .append_data(&mut h, d, std::io::empty())
                .map_err(pack)?;
        }
        for (name, body) in crate::tools::tool_files(TOOLS_DIR) {
            let mut h = header(body.len() as u64, 0o755, tar::EntryType::Regular);
            builder
                .append_data(&mut h, format!(".tutor/bin/{name}"), body.as_bytes())
                .map_err(pack)?;
        }
        let tar = builder.into_inner().map_err(pack)?;
        self.upload("/tmp", tar).await
    }

    /// Writes `content` to `/tmp/.tutor/NAME` (outside the repository) and returns the
    /// path.
    pub async fn write_scratch(&self, name: &str, content: &[u8]) -> Result<String, DockerError> {
        self.upload_file("/tmp/.tutor", name, content, self.owner, 0o644)
            .await
    }

    /// Writes `content` to `BOOK_HOME/NAME`, the bookkeeping user's (mode 0600): what the
    /// agent must not read or replace (the oracle's patch). Returns the path.
    async fn write_book_file(&self, name: &str, content: &[u8]) -> Result<String, DockerError> {
        self.upload_file(BOOK_HOME, name, content, book_owner(self.owner), 0o600)
            .await
    }

    async fn upload_file(
        &self,
        dir: &str,
        name: &str,
        content: &[u8],
        owner: (u32, u32),
        mode: u32,
    ) -> Result<String, DockerError> {
        let mut builder = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(content.len() as u64);
        h.set_mode(mode);
        h.set_mtime(0);
        h.set_uid(owner.0 as u64);
        h.set_gid(owner.1 as u64);
        h.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut h, name, content)
            .map_err(|e| DockerError::Shell(format!("packing {name}: {e}")))?;
        let tar = builder
            .into_inner()
            .map_err(|e| DockerError::Shell(format!("packing {name}: {e}")))?;
        self.upload_as(&as_user(owner), dir, tar).await?;
        Ok(format!("{dir}/{name}"))
    }

    async fn start_shell(&mut self) -> Result<(), DockerError> {
        let exec = self
            .docker
            .create_exec(
                &self.id,
                ExecConfig {
                    attach_stdin: Some(true),
                    attach_stdout: Some(true),
                    attach_stderr: Some(true),
                    cmd: Some(vec!["bash".into(), "--noprofile".into(), "--norc".into()]),
                    working_dir: Some(self.workdir.clone()),
                    user: Some(self.user.clone()),
                    env: Some(vec![
                        "HOME=/tmp/.tutor".into(),
                        "PYTHONDONTWRITEBYTECODE=1".into(),
                    ]),
                    ..Default::default()
                },
            )
            .await?;
        match self.docker.start_exec(&exec.id, None).await? {
            bollard::exec::StartExecResults::Attached { output, mut input } => {
                let prelude = format!(
                    "readonly __tutor_repo={}\n{SHELL_PRELUDE}",
                    shell_quote(&self.workdir)
                );
                input
                    .write_all(prelude.as_bytes())
                    .await
                    .map_err(|e| DockerError::Shell(format!("starting the shell: {e}")))?;
                self.shell = Some(std::sync::Mutex::new(Shell { input, output }));
                Ok(())
            }
            bollard::exec::StartExecResults::Detached => {
                Err(DockerError::Shell("exec started detached".into()))
            }
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether `remove` has removed the container (or found it gone).
    pub fn is_removed(&self) -> bool {
        self.removed
    }

    /// True when the container came from the warm pool (crate::sandbox::pool).
    pub fn pooled(&self) -> bool {
        self.pooled
    }

    pub(crate) fn set_pooled(&mut self) {
        self.pooled = true;
    }

    /// Asks the engine whether the container is still running (not exited, killed,
    /// paused or restarting).
    pub(crate) async fn is_running(&self) -> bool {
        match self.docker.inspect_container(&self.id, None).await {
            Ok(c) => c.state.is_some_and(|s| {
                s.running == Some(true) && s.paused != Some(true) && s.restarting != Some(true)
            }),
            Err(_) => false,
        }
    }

    /// The directory the last command ended in.
    pub fn cwd(&self) -> &str {
        &self.cwd
    }

    /// Runs one command in the persistent shell. Never fails: errors become the output.
    pub async fn run(&mut self, command: &str, timeout: Duration) -> CommandOutput {
        match self.run_inner(command, timeout).await {
            Ok(o) => o,
            Err(e) => {
                // The shell is in an unknown state: the next command gets a new one.
                self.shell = None;
                CommandOutput {
                    output: format!("sandbox error: {e}\n"),
                    exit_code: 127,
                    timed_out: false,
                }
            }
        }
    }

    async fn run_inner(
        &mut self,
        command: &str,
        timeout: Duration,
    ) -> Result<CommandOutput, DockerError> {
        if self.shell.is_none() {
            self.start_shell().await?;
        }
        self.counter += 1;
        // A fresh random marker per command: one a command could predict would let it
        // print a fake end (and exit code) or end the here-document early and run the
        // rest of its text in the shell itself, outside the watchdog.
        let marker = loop {
            let m = format!("__TUTOR_DONE_{:032x}__", rand::random::<u128>());
            if !command.contains(&m) {
                break m;
            }
        };
        let secs = timeout.as_secs().max(1);
        let line = format!("__tutor_run {secs} {marker} <<'{marker}'\n{command}\n{marker}\n");
        let shell = self
            .shell
            .as_mut()
            .expect("started above")
            .get_mut()
            .expect("never locked");
        shell
            .input
            .write_all(line.as_bytes())
            .await
            .map_err(|e| DockerError::Shell(format!("writing: {e}")))?;
        shell
            .input
            .flush()
            .await
            .map_err(|e| DockerError::Shell(format!("writing: {e}")))?;

        // The command is killed inside the container at `timeout`; the extra grace is for
        // the shell itself. Past it the shell is considered wedged and replaced.
        let deadline = tokio::time::Instant::now() + timeout + Duration::from_secs(10);
        let needle = format!("\n{marker} ");
        // The first bytes and a rolling window of the newest ones; the marker is printed
        // last, so it is always in the window.
        let mut head: Vec<u8> = Vec::new();
        let mut tail: Vec<u8> = Vec::new();
        let mut dropped = 0usize;
        // Bytes of `tail` already searched for the marker: each chunk is searched once
        // (with an overlap the length of the marker), not the whole window again.
        let mut scanned = 0usize;
        let mut new_cwd = None;
        let (exit_code, new_file) = loop {
            let chunk = match tokio::time::timeout_at(deadline, shell.output.next()).await {
                Err(_) => {
                    return Err(DockerError::Shell(format!(
                        "no answer within {timeout:?} + 10 s"
                    )))
                }
                Ok(None) => return Err(DockerError::Shell("the shell exited".into())),
                Ok(Some(Err(e))) => return Err(e.into()),
                Ok(Some(Ok(c))) => c.into_bytes(),
            };
            tail.extend_from_slice(&chunk);
            let from = scanned.saturating_sub(needle.len() - 1);
            if let Some(i) = find(&tail[from..], needle.as_bytes()).map(|i| from + i) {
                let rest = &tail[i + needle.len()..];
                if let Some(nl) = rest.iter().position(|&b| b == b'\n') {
                    // "<exit code>\t<directory the command ended in>\t<current file>"
                    let status = String::from_utf8_lossy(&rest[..nl]).into_owned();
                    let mut fields = status.split('\t');
                    let code = fields.next().unwrap_or("");
                    if let Some(cwd) = fields.next().filter(|c| !c.trim().is_empty()) {
                        new_cwd = Some(cwd.trim().to_string());
                    }
                    let file = fields.next().map(|f| f.trim().to_string());
                    let code = code.trim().parse().unwrap_or(-1);
                    tail.truncate(i);
                    break (code, file);
                }
                continue; // the exit code is still on its way
            }
            scanned = tail.len();
            if tail.len() > CAPTURE_BYTES {
                let excess = tail.len() - CAPTURE_BYTES / 2;
                if head.is_empty() {
                    head = tail[..CAPTURE_BYTES / 2].to_vec();
                    dropped += excess - CAPTURE_BYTES / 2;
                } else {
                    dropped += excess;
                }
                tail.drain(..excess);
                scanned = tail.len();
            }
        };
        let text = if dropped > 0 {
            let (head, tail, cut) = super::cut_at_chars(&head, &tail);
            format!("{head}\n<... {} bytes dropped ...>\n{tail}", dropped + cut)
        } else {
            let mut all = String::from_utf8_lossy(&head).into_owned();
            all.push_str(&String::from_utf8_lossy(&tail));
            all
        };
        if let Some(cwd) = new_cwd {
            self.cwd = cwd;
        }
        if let Some(f) = new_file {
            self.current_file = Some(f).filter(|f| !f.is_empty());
        }
        // The watchdog kills with SIGKILL: the command ends with 137 (128 + 9).
        let timed_out = exit_code == 137;
        Ok(CommandOutput {
            output: truncate_head_tail(&text, CAPTURE_BYTES),
            exit_code,
            timed_out,
        })
    }

    /// Runs a short command as its own exec (not through the agent's shell) and returns
    /// its exit code and stdout: bookkeeping reads that must not disturb the episode.
    /// Bounded inside the container, where an exec cannot be stopped from outside: killed
    /// at `limit` (`timeout`, exit 124), its stdout cut one byte past
    /// [`EXEC_OUTPUT_CAP`] (`head -c`; the command dies of SIGPIPE). More than the cap is
    /// [`DockerError::OutputTooLarge`]: the worker never holds more of it (a `cat` of a
    /// symlink to /dev/zero, a generated file of gigabytes). Its stderr is dropped in the
    /// container (a script that wants it redirects it to stdout). Run by the agent's user.
    async fn exec_capture(
        &self,
        cmd: &[&str],
        limit: Duration,
    ) -> Result<(i64, Vec<u8>), DockerError> {
        let env = [
            "HOME=/tmp/.tutor",
            "GIT_CONFIG_NOSYSTEM=1",
            "LC_ALL=C.UTF-8",
        ];
        self.exec_capture_as(&self.user, &env, cmd, limit).await
    }

    /// [`Self::exec_capture`] run by the bookkeeping user ([`book_owner`]), at home in
    /// [`BOOK_HOME`], with no global or system git config.
    async fn book_exec(
        &self,
        cmd: &[&str],
        limit: Duration,
    ) -> Result<(i64, Vec<u8>), DockerError> {
        let home = format!("HOME={BOOK_HOME}");
        // The system's directories only: one the agent can write (a venv in the
        // repository, an image's user-owned conda) could hold its own `git` or `bash`.
        let path = format!("PATH={}", crate::sandbox::confine::SYSTEM_PATH);
        let env = [
            home.as_str(),
            path.as_str(),
            "GIT_CONFIG_NOSYSTEM=1",
            "GIT_CONFIG_GLOBAL=/dev/null",
            "LC_ALL=C.UTF-8",
        ];
        self.exec_capture_as(&as_user(book_owner(self.owner)), &env, cmd, limit)
            .await
    }

    async fn exec_capture_as(
        &self,
        user: &str,
        env: &[&str],
        cmd: &[&str],
        limit: Duration,
    ) -> Result<(i64, Vec<u8>), DockerError> {
        let mut command = cmd.join(" ");
        if command.len() > 120 {
            let cut = (0..=117)
                .rev()
                .find(|&i| command.is_char_boundary(i))
                .unwrap_or(0);
            command.truncate(cut);
            command.push_str("...");
        }
        let bounded = format!(
            "set -o pipefail; timeout -k 5 {} \"$@\" 2>/dev/null | head -c {}",
            limit.as_secs().max(1),
            EXEC_OUTPUT_CAP + 1
        );
        let mut argv = vec!["bash", "-c", &bounded, "tutor-exec"];
        argv.extend_from_slice(cmd);
        let exec = self
            .docker
            .create_exec(
                &self.id,
                ExecConfig {
                    attach_stdout: Some(true),
                    attach_stderr: Some(true),
                    cmd: Some(argv.iter().map(|s| s.to_string()).collect()),
                    working_dir: Some(self.workdir.clone()),
                    user: Some(user.to_string()),
                    env: Some(env.iter().map(|e| e.to_string()).collect()),
                    ..Default::default()
                },
            )
            .await?;
        let bollard::exec::StartExecResults::Attached { mut output, .. } =
            self.docker.start_exec(&exec.id, None).await?
        else {
            return Err(DockerError::Shell("exec started detached".into()));
        };
        // `None`: over the cap (the rest is not read; the stream is dropped).
        let read = async {
            let mut out = Vec::new();
            while let Some(chunk) = output.next().await {
                if let LogOutput::StdOut { message } = chunk? {
                    if out.len() + message.len() > EXEC_OUTPUT_CAP {
                        return Ok(None);
                    }
                    out.extend_from_slice(&message);
                }
            }
            Ok::<_, bollard::errors::Error>(Some(out))
        };
        // The container kills the command at `limit`; this is for an engine that hangs.
        let wait = limit + Duration::from_secs(30);
        let out = match tokio::time::timeout(wait, read).await {
            Err(_) => {
                return Err(DockerError::ExecTimeout {
                    command,
                    limit: wait,
                })
            }
            Ok(r) => r?,
        };
        let Some(out) = out else {
            return Err(DockerError::OutputTooLarge {
                command,
                cap: EXEC_OUTPUT_CAP,
            });
        };
        let code = self
            .docker
            .inspect_exec(&exec.id)
            .await?
            .exit_code
            .unwrap_or(-1);
        Ok((code, out))
    }

    /// A git command in the repository through [`Self::exec_capture`]; `index` names a private
    /// index file (so the agent's staging area is untouched).
    async fn git(&self, args: &[&str], index: Option<&str>) -> Option<Vec<u8>> {
        self.git_in(true, args, index).await
    }

    /// As [`Self::git`], or (`bookkeeping` false) plain `git` for reading the agent's own
    /// HEAD, run by the agent's user (`rev-parse` runs no hook, filter or fsmonitor).
    async fn git_in(
        &self,
        bookkeeping: bool,
        args: &[&str],
        index: Option<&str>,
    ) -> Option<Vec<u8>> {
        let git = match bookkeeping {
            true => book_git(&self.workdir),
            // Bounded too: a FIFO the agent put at .git/HEAD would hold the exec.
            false => "timeout -k 5 30 git".to_string(),
        };
        let mut script = format!("cd {} && ", self.workdir);
        if let Some(i) = index {
            // As the submission's script: the base's submodules not looked into, files
            // this user cannot read left out.
            script.push_str(&format!(
                "export GIT_INDEX_FILE={BOOK_HOME}/{i} && rm -f \"$GIT_INDEX_FILE\" && {git} read-tree {} \
                 && {{ {} ; }} && {{ {git} add -A --ignore-errors 2>/dev/null; [ $? -le 1 ]; }} && ",
                self.base,
                SKIP_SUBMODULES.replace("@GIT@", &git)
            ));
        }
        script.push_str(&git);
        script.push_str(" -c core.quotepath=off");
        for a in args {
            script.push(' ');
            script.push_str(&shell_quote(a));
        }
        let ran = match bookkeeping {
            true => self.book_exec(&["bash", "-c", &script], GIT_LIMIT).await,
            false => self.exec_capture(&["bash", "-c", &script], GIT_LIMIT).await,
        };
        match ran {
            Ok((0, out)) => Some(out),
            Ok((code, _)) => {
                tracing::debug!(container = %self.id, ?args, code, "sandbox git failed");
                None
            }
            Err(e) => {
                tracing::warn!(container = %self.id, error = %e, "sandbox git failed");
                None
            }
        }
    }

    /// The submission (see [`Sandbox::submission`]), made by one bash script in an exec
    /// of its own ([`SUBMISSION_SCRIPT`]): untracked files over
    /// [`MAX_UNTRACKED_FILE_BYTES`] never added to the private index, binary changes reset
    /// in it to the base, and at most [`MAX_SUBMISSION_BYTES`] + 1 bytes of the diff kept
    /// (through `head -c`, inside the container). An empty patch if git fails (logged).
    pub async fn submission(&self) -> Submission {
        let script = SUBMISSION_SCRIPT
            .replace("@SKIP_SUBMODULES@", SKIP_SUBMODULES)
            .replace("@GIT@", &book_git(&self.workdir))
            .replace("@REPO@", &self.workdir)
            .replace("@HOME@", BOOK_HOME)
            .replace("@BASE@", &shell_quote(&self.base))
            .replace("@CAP@", &MAX_SUBMISSION_BYTES.to_string())
            .replace("@CAP1@", &(MAX_SUBMISSION_BYTES + 1).to_string())
            .replace("@FILE_CAP@", &MAX_UNTRACKED_FILE_BYTES.to_string())
            .replace("@LISTED@", &LEFT_OUT_LISTED.to_string());
        match self.book_exec(&["bash", "-c", &script], SUBMISSION_LIMIT).await {
            Ok((0, out)) => parse_submission(&out).unwrap_or_else(|e| {
                tracing::warn!(container = %self.id, error = %e, "sandbox submission: unreadable answer; no patch");
                Submission::default()
            }),
            Ok((code, out)) => {
                let out = String::from_utf8_lossy(&out[..out.len().min(4096)]).into_owned();
                tracing::warn!(container = %self.id, code, output = %out, "sandbox submission: git failed; no patch");
                Submission::default()
            }
            Err(e) => {
                tracing::warn!(container = %self.id, error = %e, "sandbox submission failed; no patch");
                Submission::default()
            }
        }
    }

    /// [`Self::submission`]'s patch (empty when too large).
    pub async fn diff(&self) -> String {
        self.submission().await.patch
    }

    /// Paths changed relative to the base commit.
    pub async fn changed_files(&self) -> Vec<String> {
        self.try_changed_files().await.unwrap_or_default()
    }

    /// [`Self::changed_files`]; `None` if git failed.
    pub async fn try_changed_files(&self) -> Option<Vec<String>> {
        self.git(
            &[
                "diff",
                "--cached",
                "--name-only",
                "-z",
                "--no-renames",
                &self.base,
                "--",
            ],
            Some("diff-index"),
        )
        .await
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        })
    }

    /// Hash of the base commit.
    pub fn base_commit(&self) -> &str {
        &self.base
    }

    /// Current HEAD (differs from the base if the agent committed).
    pub async fn head(&self) -> Option<String> {
        self.git_in(false, &["rev-parse", "-q", "--verify", "HEAD"], None)
            .await
            .map(|b| String::from_utf8_lossy(&b).trim().to_string())
    }

    /// A file of the working tree, relative to the repository (`None` if missing or
    /// outside).
    pub async fn read_file(&self, rel: &str) -> Option<String> {
        let rel = crate::sandbox::safe_rel(rel)?;
        let path = format!("{}/{}", self.workdir, rel.display());
        match self.exec_capture(&["cat", "--", &path], FILE_LIMIT).await {
            Ok((0, out)) => Some(String::from_utf8_lossy(&out).into_owned()),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(container = %self.id, file = %path, error = %e, "sandbox: reading a file failed");
                None
            }
        }
    }

    /// A file at the base commit (`None` if it did not exist there).
    pub async fn base_file(&self, rel: &str) -> Option<String> {
        let rel = crate::sandbox::safe_rel(rel)?.display().to_string();
        if let Some(hit) = self.base_files.lock().expect("not poisoned").get(&rel) {
            return hit.clone();
        }
        let spec = format!("{}:{rel}", self.base);
        let content = self
            .git(&["cat-file", "blob", &spec], None)
            .await
            .map(|b| String::from_utf8_lossy(&b).into_owned());
        self.base_files
            .lock()
            .expect("not poisoned")
            .insert(rel, content.clone());
        content
    }

    /// Contents of the files `patch` touches once applied to the base commit, computed
    /// on a private index; `Err` with git's message if it does not apply.
    pub async fn apply_to_base(
        &self,
        patch: &str,
    ) -> Result<BTreeMap<String, Option<String>>, SandboxError> {
        let mut body = patch.to_string();
        if !body.ends_with('\n') {
            body.push('\n');
        }
        // In the bookkeeping user's home: the agent can neither read the oracle's patch
        // (the answer) nor swap it before git reads it. Removed once applied.
        let path = self
            .write_book_file("oracle.patch", body.as_bytes())
            .await
            .map_err(|e| SandboxError::Backend(Box::new(e)))?;
        let script = format!(
            "cd {repo} && export GIT_INDEX_FILE={BOOK_HOME}/apply-index && rm -f \"$GIT_INDEX_FILE\" \
             && {git} read-tree {} && {git} apply --cached {path} 2>&1; rc=$?; rm -f {path}; exit $rc",
            self.base,
            repo = self.workdir,
            git = book_git(&self.workdir)
        );
        match self.book_exec(&["bash", "-c", &script], GIT_LIMIT).await {
            Ok((0, _)) => {}
            Ok((_, out)) => {
                return Err(SandboxError::Git(
                    String::from_utf8_lossy(&out).into_owned(),
                ))
            }
            Err(e) => return Err(SandboxError::Backend(Box::new(e))),
        }
        let mut files = BTreeMap::new();
        for f in crate::tasks::patch_files(patch) {
            let script = format!(
                "cd {} && GIT_INDEX_FILE={BOOK_HOME}/apply-index {} cat-file blob {}",
                self.workdir,
                book_git(&self.workdir),
                shell_quote(&format!(":{f}"))
            );
            let content = match self.book_exec(&["bash", "-c", &script], GIT_LIMIT).await {
                Ok((0, out)) => Some(String::from_utf8_lossy(&out).into_owned()),
                Ok(_) => None,
                Err(e) => {
                    tracing::warn!(container = %self.id, file = %f, error = %e, "sandbox: reading a patched file failed");
                    None
                }
            };
            files.insert(f, content);
        }
        Ok(files)
    }

    /// The file the tools have open (as shown in the footer), if any.
    pub fn current_file(&self) -> Option<&str> {
        self.current_file.as_deref()
    }

    /// Removes the container. Safe to call twice. A container already gone counts as
    /// removed; other refusals (a busy engine: "could not kill", "removal already in
    /// progress") are tried again, `REMOVE_ATTEMPTS` times in all.
    pub async fn remove(&mut self) {
        if self.removed {
            return;
        }
        self.shell = None;
        let mut wait = Duration::from_millis(250);
        for attempt in 1..=REMOVE_ATTEMPTS {
            match self
                .docker
                .remove_container(
                    &self.id,
                    Some(RemoveContainerOptionsBuilder::default().force(true).build()),
                )
                .await
            {
                Ok(())
                | Err(bollard::errors::Error::DockerResponseServerError {
                    status_code: 404, ..
                }) => {
                    self.removed = true;
                    return;
                }
                Err(e) if attempt < REMOVE_ATTEMPTS => {
                    tracing::debug!(container = %self.id, error = %e, attempt, "removing a sandbox container failed; trying again");
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                }
                Err(e) => {
                    tracing::warn!(container = %self.id, error = %e, attempts = REMOVE_ATTEMPTS, "removing a sandbox container failed; `docker rm -f` removes it, and so does the next start of this worker")
                }
            }
        }
    }
}

/// A [`DockerSandbox`] behind the blocking interface. Must not be used from inside an
/// async task (it blocks on the runtime); episodes run on blocking threads.
pub struct BlockingDocker {
    inner: Option<DockerSandbox>,
    rt: Handle,
}

impl BlockingDocker {
    pub fn new(inner: DockerSandbox, rt: Handle) -> Self {
        Self {
            inner: Some(inner),
            rt,
        }
    }

    fn sb(&self) -> &DockerSandbox {
        self.inner.as_ref().expect("present until drop")
    }

    /// The container id.
    pub fn id(&self) -> &str {
        self.sb().id()
    }
}

impl Sandbox for BlockingDocker {
    fn run(&mut self, command: &str, timeout: Duration) -> CommandOutput {
        let sb = self.inner.as_mut().expect("present until drop");
        self.rt.block_on(sb.run(command, timeout))
    }
    fn cwd(&self) -> String {
        self.sb().cwd().to_string()
    }
    fn at_root(&self) -> bool {
        self.sb().cwd() == self.sb().workdir
    }
    fn repo_display(&self) -> &str {
        &self.sb().workdir
    }
    fn current_file(&self) -> Option<String> {
        self.sb().current_file().map(str::to_string)
    }
    fn base_commit(&self) -> &str {
        self.sb().base_commit()
    }
    fn head(&self) -> Option<String> {
        self.rt.block_on(self.sb().head())
    }
    fn read_file(&self, rel: &str) -> Option<String> {
        self.rt.block_on(self.sb().read_file(rel))
    }
    fn base_file(&self, rel: &str) -> Option<String> {
        self.rt.block_on(self.sb().base_file(rel))
    }
    fn submission(&self) -> Submission {
        self.rt.block_on(self.sb().submission())
    }
    fn try_changed_files(&self) -> Option<Vec<String>> {
        self.rt.block_on(self.sb().try_changed_files())
    }
    fn apply_to_base(&self, patch: &str) -> Result<BTreeMap<String, Option<String>>, SandboxError> {
        self.rt.block_on(self.sb().apply_to_base(patch))
    }
    fn write_scratch(&mut self, name: &str, content: &str) -> Result<String, SandboxError> {
        self.rt
            .block_on(self.sb().write_scratch(name, content.as_bytes()))
            .map(|p| shell_quote(&p))
            .map_err(|e| SandboxError::Backend(Box::new(e)))
    }
    fn kind(&self) -> &'static str {
        "docker"
    }
}

impl Drop for BlockingDocker {
    /// Removes the container before returning. A thread of its own, so dropping is safe
    /// from blocking threads and from async tasks alike.
    fn drop(&mut self) {
        if let Some(mut sb) = self.inner.take() {
            let rt = self.rt.clone();
            let joined = std::thread::Builder::new()
                .name("tutor-sandbox-rm".into())
                .spawn(move || rt.block_on(sb.remove()))
                .map(|h| h.join());
            if !matches!(joined, Ok(Ok(()))) {
                tracing::warn!("removing a sandbox container: the cleanup thread failed");
            }
        }
    }
}

impl Drop for DockerSandbox {
    /// A sandbox dropped without `remove` (an error path, a panic) still goes away.
    fn drop(&mut self) {
        if self.removed {
            return;
        }
        let docker = self.docker.clone();
        let id = self.id.clone();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = docker
                    .remove_container(
                        &id,
                        Some(RemoveContainerOptionsBuilder::default().force(true).build()),
                    )
                    .await;
            });
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_repository_is_the_images_workdir() {
        assert_eq!(repo_dir("i", None).unwrap(), "/testbed");
        assert_eq!(repo_dir("i", Some("")).unwrap(), "/testbed");
        assert_eq!(repo_dir("i", Some("/")).unwrap(), "/testbed");
        assert_eq!(
            repo_dir("i", Some("/work/project/")).unwrap(),
            "/work/project"
        );
        assert_eq!(repo_dir("i", Some("/usr/src/app")).unwrap(), "/usr/src/app");
        for bad in [
            "relative/dir",
            "/a b",
            "/x;rm -rf /",
            "/a/../etc",
            "/$(id)",
            "/.",
            "/tmp",
            "/tmp/.tutor/x",
            "/dev/shm",
            "/usr",
            "/etc/",
        ] {
            let e = repo_dir("img:1", Some(bad)).unwrap_err().to_string();
            assert!(e.contains("img:1") && e.contains("WORKDIR"), "{bad}: {e}");
        }
    }

    #[test]
    fn only_a_numeric_non_root_image_user_is_taken() {
        assert_eq!(image_user("i", Some("1234")).unwrap(), (1234, 1234));
        assert_eq!(image_user("i", Some("1000:1001")).unwrap(), (1000, 1001));
        for bad in [
            None,
            Some(""),
            Some("root"),
            Some("0"),
            Some("0:0"),
            Some("agent"),
        ] {
            let e = image_user("img:1", bad).unwrap_err().to_string();
            assert!(
                e.contains("img:1") && e.contains("container_user"),
                "{bad:?}: {e}"
            );
        }
    }
}
