//! The Docker sandbox: one container per episode, and a persistent shell inside it.
//!
//! The shell is one `docker exec` of bash kept open for the whole episode (not one exec
//! per command, which costs a round trip through the daemon each time). Each command is
//! sent as a here-document (delimited by a unique marker) to a helper function that runs it in a child bash under
//! `timeout -s KILL` (Docker has no API to kill an exec, so the deadline is enforced
//! inside the container; `timeout` signals the command's whole process group), records
//! the directory the command ended in, and prints a marker line with the exit code.
//! The caller reads until the marker; if the marker does not come in time the shell is
//! replaced. Containers carry labels (run, worker, episode) so a restarted worker can
//! remove the orphans of its predecessor.

use std::collections::HashMap;
use std::time::Duration;

use bollard::container::LogOutput;
use bollard::models::{ContainerCreateBody, ExecConfig, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, ListContainersOptionsBuilder, RemoveContainerOptionsBuilder,
    UploadToContainerOptionsBuilder,
};
use bollard::Docker;
use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use crate::observation::truncate_head_tail;
use crate::sandbox::CommandOutput;
use crate::tasks::TaskRecord;

/// Label keys on every container Tutor creates.
pub const LABEL_RUN: &str = "tutor.run";
pub const LABEL_WORKER: &str = "tutor.worker";
pub const LABEL_EPISODE: &str = "tutor.episode";

/// Where the repository lives inside the container.
pub const WORKDIR: &str = "/testbed";

/// Output kept per command before head+tail truncation (the rest is read and dropped).
const CAPTURE_BYTES: usize = 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum DockerError {
    #[error("the Docker engine is not reachable ({0}); is the daemon running and is /var/run/docker.sock readable?")]
    Unreachable(String),
    #[error(
        "image {0} is not present; build it with `make images` (no registry is reachable here)"
    )]
    MissingImage(String),
    #[error("docker: {0}")]
    Api(#[from] bollard::errors::Error),
    #[error("sandbox shell: {0}")]
    Shell(String),
}

/// Limits and identity of a sandbox container.
#[derive(Debug, Clone)]
pub struct ContainerSpec {
    pub image: String,
    pub run: String,
    pub worker: String,
    pub episode: String,
    pub memory_bytes: i64,
    pub nano_cpus: i64,
    pub pids_limit: i64,
    pub network: bool,
    /// uid:gid the shell runs as and the task files belong to. With every capability
    /// dropped, root could not write files owned by anyone else, so the agent runs as
    /// the image's unprivileged user (1000 in deploy/images/python-task).
    pub user: (u32, u32),
}

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
        }
    }
}

/// Connects to the local engine and checks it answers.
pub async fn connect() -> Result<Docker, DockerError> {
    let docker = Docker::connect_with_local_defaults()
        .map_err(|e| DockerError::Unreachable(e.to_string()))?;
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

/// The bash function every command goes through (see the module comment).
const SHELL_PRELUDE: &str = r#"
# The shell's own stderr carries only its notices ("Killed" when a command times out);
# every command's stderr is merged into its stdout below.
exec 2>/dev/null
mkdir -p /tmp/.tutor; echo /testbed > /tmp/.tutor/cwd; __tutor_cwd=/testbed
__tutor_run() {
  # The command arrives as a here-document (delimited by the unique marker) on the
  # function's stdin; `read` and `printf` are builtins, so no process is spawned for it.
  local __cmd; IFS= read -r -d '' __cmd
  printf '%s' "$__cmd" > /tmp/.tutor/cmd.sh
  cd "$__tutor_cwd" 2>/dev/null || cd /testbed
  ( timeout -s KILL "$1" bash --noprofile --norc -c 'trap "pwd > /tmp/.tutor/cwd" EXIT; . /tmp/.tutor/cmd.sh' </dev/null 2>&1 ) 2>/dev/null
  local rc=$?
  read -r __tutor_cwd < /tmp/.tutor/cwd
  printf '\n%s %d %s\n' "$2" "$rc" "$__tutor_cwd"
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
    shell: Option<Shell>,
    cwd: String,
    counter: u64,
    removed: bool,
}

impl DockerSandbox {
    /// Creates and starts the container, copies the task's files into /testbed as a tar
    /// and commits them as the base of the episode's diff.
    pub async fn create(
        docker: &Docker,
        spec: &ContainerSpec,
        task: &TaskRecord,
    ) -> Result<Self, DockerError> {
        if docker.inspect_image(&spec.image).await.is_err() {
            return Err(DockerError::MissingImage(spec.image.clone()));
        }
        let labels = HashMap::from([
            (LABEL_RUN.to_string(), spec.run.clone()),
            (LABEL_WORKER.to_string(), spec.worker.clone()),
            (LABEL_EPISODE.to_string(), spec.episode.clone()),
        ]);
        let body = ContainerCreateBody {
            image: Some(spec.image.clone()),
            cmd: Some(vec!["sleep".into(), "infinity".into()]),
            working_dir: Some(WORKDIR.into()),
            labels: Some(labels),
            network_disabled: Some(!spec.network),
            host_config: Some(HostConfig {
                memory: Some(spec.memory_bytes),
                nano_cpus: Some(spec.nano_cpus),
                pids_limit: Some(spec.pids_limit),
                network_mode: Some(if spec.network {
                    "bridge".into()
                } else {
                    "none".into()
                }),
                cap_drop: Some(vec!["ALL".into()]),
                security_opt: Some(vec!["no-new-privileges".into()]),
                init: Some(true),
                ..Default::default()
            }),
            ..Default::default()
        };
        let created = docker
            .create_container(Some(CreateContainerOptionsBuilder::default().build()), body)
            .await?;
        let mut sb = Self {
            docker: docker.clone(),
            id: created.id,
            user: format!("{}:{}", spec.user.0, spec.user.1),
            shell: None,
            cwd: WORKDIR.into(),
            counter: 0,
            removed: false,
        };
        if let Err(e) = sb.init(task, spec.user).await {
            sb.remove().await;
            return Err(e);
        }
        Ok(sb)
    }

    async fn init(&mut self, task: &TaskRecord, (uid, gid): (u32, u32)) -> Result<(), DockerError> {
        self.docker
            .start_container(
                &self.id,
                None::<bollard::query_parameters::StartContainerOptions>,
            )
            .await?;
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
        self.docker
            .upload_to_container(
                &self.id,
                Some(
                    UploadToContainerOptionsBuilder::default()
                        .path(WORKDIR)
                        .build(),
                ),
                bollard::body_full(tar.into()),
            )
            .await?;
        self.start_shell().await?;
        let setup = "git init -q && git config user.email tutor@localhost && git config user.name tutor \
                     && git config commit.gpgsign false && git add -A && git commit -q -m base && git tag tutor-base";
        let out = self.run(setup, Duration::from_secs(60)).await;
        if out.exit_code != 0 {
            return Err(DockerError::Shell(format!(
                "setting up the repository failed: {}",
                out.output
            )));
        }
        Ok(())
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
                    working_dir: Some(WORKDIR.into()),
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
                input
                    .write_all(SHELL_PRELUDE.as_bytes())
                    .await
                    .map_err(|e| DockerError::Shell(format!("starting the shell: {e}")))?;
                self.shell = Some(Shell { input, output });
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
        let marker = format!("__TUTOR_DONE_{}_{}__", self.counter, std::process::id());
        let secs = timeout.as_secs().max(1);
        let line = format!("__tutor_run {secs} {marker} <<'{marker}'\n{command}\n{marker}\n");
        let shell = self.shell.as_mut().expect("started above");
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
        let mut new_cwd = None;
        let exit_code = loop {
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
            if let Some(i) = find(&tail, needle.as_bytes()) {
                let rest = &tail[i + needle.len()..];
                if let Some(nl) = rest.iter().position(|&b| b == b'\n') {
                    // "<exit code> <directory the command ended in>"
                    let status = String::from_utf8_lossy(&rest[..nl]).into_owned();
                    let (code, cwd) = status.split_once(' ').unwrap_or((status.as_str(), ""));
                    if !cwd.trim().is_empty() {
                        new_cwd = Some(cwd.trim().to_string());
                    }
                    let code = code.trim().parse().unwrap_or(-1);
                    tail.truncate(i);
                    break code;
                }
                continue; // the exit code is still on its way
            }
            if tail.len() > CAPTURE_BYTES {
                let excess = tail.len() - CAPTURE_BYTES / 2;
                if head.is_empty() {
                    head = tail[..CAPTURE_BYTES / 2].to_vec();
                    dropped += excess - CAPTURE_BYTES / 2;
                } else {
                    dropped += excess;
                }
                tail.drain(..excess);
            }
        };
        let mut text = String::from_utf8_lossy(&head).into_owned();
        if dropped > 0 {
            text.push_str(&format!("\n<... {dropped} bytes dropped ...>\n"));
        }
        text.push_str(&String::from_utf8_lossy(&tail));
        if let Some(cwd) = new_cwd {
            self.cwd = cwd;
        }
        // `timeout -s KILL` makes the command end with 137 (128 + SIGKILL).
        let timed_out = exit_code == 137;
        Ok(CommandOutput {
            output: truncate_head_tail(&text, CAPTURE_BYTES),
            exit_code,
            timed_out,
        })
    }

    /// Runs a short command as its own exec and returns stdout (for bookkeeping reads).
    async fn exec_capture(&self, cmd: &[&str]) -> Result<String, DockerError> {
        let exec = self
            .docker
            .create_exec(
                &self.id,
                ExecConfig {
                    attach_stdout: Some(true),
                    attach_stderr: Some(true),
                    cmd: Some(cmd.iter().map(|s| s.to_string()).collect()),
                    working_dir: Some(WORKDIR.into()),
                    user: Some(self.user.clone()),
                    env: Some(vec!["HOME=/tmp/.tutor".into()]),
                    ..Default::default()
                },
            )
            .await?;
        let mut out = Vec::new();
        if let bollard::exec::StartExecResults::Attached { mut output, .. } =
            self.docker.start_exec(&exec.id, None).await?
        {
            while let Some(Ok(chunk)) = output.next().await {
                if let LogOutput::StdOut { message } = chunk {
                    out.extend_from_slice(&message);
                }
            }
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    /// The submission: every change against the base commit, new files included,
    /// without touching the agent's own index.
    pub async fn diff(&self) -> String {
        self.exec_capture(&[
            "bash",
            "-c",
            "cd /testbed && export GIT_INDEX_FILE=/tmp/.tutor/index && git read-tree tutor-base && git add -A && git diff --cached tutor-base",
        ])
        .await
        .unwrap_or_default()
    }

    /// Removes the container. Safe to call twice.
    pub async fn remove(&mut self) {
        if self.removed {
            return;
        }
        self.shell = None;
        match self
            .docker
            .remove_container(
                &self.id,
                Some(RemoveContainerOptionsBuilder::default().force(true).build()),
            )
            .await
        {
            Ok(()) => self.removed = true,
            Err(e) => {
                tracing::warn!(container = %self.id, error = %e, "removing a sandbox container failed")
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
