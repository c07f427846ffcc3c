//! One interface over the two sandboxes, so episodes, teachers and grading run the same
//! way in a local temporary repository ([`LocalSandbox`]) and in a Docker container
//! ([`DockerSandbox`]). The interface is blocking: episodes run on blocking threads; the
//! Docker side drives its async client on the runtime handle it was created from.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use bollard::Docker;
use tokio::runtime::Handle;

use crate::docker::{ContainerSpec, DockerSandbox};
use crate::pool::WarmPool;
use crate::sandbox::{shell_quote, CommandOutput, LocalSandbox, REPO_DISPLAY};
use crate::tasks::TaskRecord;

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
    fn apply_to_base(&self, patch: &str) -> Result<BTreeMap<String, Option<String>>, String>;
    /// Writes a file outside the repository; returns its path, shell-quoted.
    fn write_scratch(&mut self, name: &str, content: &str) -> Result<String, String>;
    /// `local` or `docker`.
    fn kind(&self) -> &'static str;
}

impl Sandbox for LocalSandbox {
    fn run(&mut self, command: &str, timeout: Duration) -> CommandOutput {
        LocalSandbox::run(self, command, timeout)
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
    fn diff(&self) -> String {
        LocalSandbox::diff(self)
    }
    fn changed_files(&self) -> Vec<String> {
        LocalSandbox::changed_files(self)
    }
    fn apply_to_base(&self, patch: &str) -> Result<BTreeMap<String, Option<String>>, String> {
        LocalSandbox::apply_to_base(self, patch)
    }
    fn write_scratch(&mut self, name: &str, content: &str) -> Result<String, String> {
        let p = self.scratch_dir().join(name);
        std::fs::write(&p, content)
            .map(|_| shell_quote(&p.display().to_string()))
            .map_err(|e| format!("could not write {name}: {e}"))
    }
    fn kind(&self) -> &'static str {
        "local"
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
        self.sb().cwd() == crate::docker::WORKDIR
    }
    fn repo_display(&self) -> &str {
        crate::docker::WORKDIR
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
    fn diff(&self) -> String {
        self.rt.block_on(self.sb().diff())
    }
    fn changed_files(&self) -> Vec<String> {
        self.rt.block_on(self.sb().changed_files())
    }
    fn apply_to_base(&self, patch: &str) -> Result<BTreeMap<String, Option<String>>, String> {
        self.rt.block_on(self.sb().apply_to_base(patch))
    }
    fn write_scratch(&mut self, name: &str, content: &str) -> Result<String, String> {
        self.rt
            .block_on(self.sb().write_scratch(name, content.as_bytes()))
            .map(|p| shell_quote(&p))
            .map_err(|e| e.to_string())
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

/// How a Docker sandbox's image is chosen for a task: the record's own `image` field
/// when set, else this rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageRule {
    /// One image for every task (e.g. `tutor/python-task:latest`).
    Fixed(String),
    /// The SWE-bench naming rule:
    /// `swebench/sweb.eval.x86_64.{instance_id with "__" → "_1776_"}:latest`.
    SweBench,
    /// A template with `{instance_id}`, `{repo}` (owner/name), `{repo_slug}`
    /// (owner__name), `{version}`.
    Template(String),
}

impl ImageRule {
    /// Parses the config spelling: `swebench`, a string with `{...}` placeholders, or an
    /// image name.
    pub fn parse(s: &str) -> Self {
        let s = s.trim();
        if s.eq_ignore_ascii_case("swebench") {
            ImageRule::SweBench
        } else if s.contains('{') {
            ImageRule::Template(s.to_string())
        } else {
            ImageRule::Fixed(s.to_string())
        }
    }

    pub fn image_for(&self, task: &TaskRecord) -> String {
        if !task.image.trim().is_empty() {
            return task.image.trim().to_string();
        }
        match self {
            ImageRule::Fixed(s) => s.clone(),
            ImageRule::SweBench => format!(
                "swebench/sweb.eval.x86_64.{}:latest",
                task.instance_id.replace("__", "_1776_")
            )
            .to_lowercase(),
            ImageRule::Template(t) => t
                .replace("{instance_id}", &task.instance_id)
                .replace("{repo_slug}", &task.repo.replace('/', "__"))
                .replace("{repo}", &task.repo)
                .replace("{version}", &task.version),
        }
    }
}

/// Settings of Docker sandboxes.
#[derive(Clone)]
pub struct DockerSettings {
    pub docker: Docker,
    pub image: ImageRule,
    /// Labels: the run and the worker, so a restarted worker can remove its orphans.
    pub run: String,
    pub worker: String,
    pub memory_bytes: i64,
    pub nano_cpus: i64,
    pub pids_limit: i64,
    pub network: bool,
    pub user: (u32, u32),
    /// Started containers kept ready per image (`[worker] warm_pool`); `None`: every
    /// sandbox is created on demand.
    pub pool: Option<WarmPool>,
}

impl DockerSettings {
    /// The container an episode (or a grading) of `task` gets.
    pub fn spec(&self, task: &TaskRecord, episode: &str) -> ContainerSpec {
        let mut spec = ContainerSpec::new(
            &self.image.image_for(task),
            &self.run,
            &self.worker,
            episode,
        );
        spec.memory_bytes = self.memory_bytes;
        spec.nano_cpus = self.nano_cpus;
        spec.pids_limit = self.pids_limit;
        spec.network = self.network;
        spec.user = self.user;
        spec
    }
}

/// Creates the sandboxes of a worker (or of `tutor eval`).
#[derive(Clone)]
pub enum SandboxFactory {
    /// Temporary directories under `root` (default: the system temp dir), named after
    /// `owner` when given (see `LocalSandbox::create_owned`).
    Local {
        root: Option<PathBuf>,
        owner: Option<String>,
    },
    /// Boxed: the settings are much larger than the local variant.
    Docker(Box<DockerSettings>),
}

impl SandboxFactory {
    /// A fresh sandbox for `task`, labelled with `episode` (Docker). Blocking.
    pub fn create(&self, task: &TaskRecord, episode: &str) -> Result<Box<dyn Sandbox>, String> {
        match self {
            SandboxFactory::Local { root, owner } => {
                LocalSandbox::create_owned(task, root.as_deref(), owner.as_deref())
                    .map(|s| Box::new(s) as Box<dyn Sandbox>)
                    .map_err(|e| e.to_string())
            }
            SandboxFactory::Docker(d) => {
                let rt = Handle::try_current().map_err(|_| {
                    "a Docker sandbox must be created inside the worker's runtime".to_string()
                })?;
                let spec = d.spec(task, episode);
                let sb = match &d.pool {
                    Some(pool) => rt.block_on(pool.acquire(&spec, task)),
                    None => rt.block_on(DockerSandbox::create(&d.docker, &spec, task)),
                }
                .map_err(|e| format!("{e} (image {})", spec.image))?;
                Ok(Box::new(BlockingDocker::new(sb, rt)))
            }
        }
    }

    /// Removes what the factory keeps between sandboxes (the warm pool's containers).
    /// Sandboxes created afterwards are made on demand.
    pub async fn shutdown(&self) {
        if let SandboxFactory::Docker(d) = self {
            if let Some(pool) = &d.pool {
                pool.shutdown().await;
            }
        }
    }

    /// Docker: removes every container still labelled with this factory's run and worker,
    /// whatever left it (a removal the engine kept refusing); call it once no sandbox of
    /// the factory is in use any more. Returns how many it removed (0 for local sandboxes).
    pub async fn remove_leftovers(&self) -> usize {
        let SandboxFactory::Docker(d) = self else {
            return 0;
        };
        match crate::docker::remove_orphans(&d.docker, &d.run, Some(&d.worker)).await {
            Ok(0) => 0,
            Ok(n) => {
                tracing::warn!(removed = n, run = %d.run, worker = %d.worker, "removed sandbox containers that were left behind");
                n
            }
            Err(e) => {
                tracing::warn!(run = %d.run, worker = %d.worker, error = %e, "listing or removing left-behind sandbox containers failed");
                0
            }
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            SandboxFactory::Local { .. } => "local",
            SandboxFactory::Docker(_) => "docker",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_rules() {
        let mut t = TaskRecord {
            instance_id: "django__django-11099".into(),
            repo: "django/django".into(),
            version: "3.0".into(),
            ..Default::default()
        };
        assert_eq!(
            ImageRule::parse("swebench").image_for(&t),
            "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
        );
        assert_eq!(
            ImageRule::parse("tutor/python-task:latest").image_for(&t),
            "tutor/python-task:latest"
        );
        assert_eq!(
            ImageRule::parse("reg.local/{repo_slug}:{version}-{instance_id}").image_for(&t),
            "reg.local/django__django:3.0-django__django-11099"
        );
        t.image = "own/image:1".into();
        assert_eq!(ImageRule::SweBench.image_for(&t), "own/image:1");
    }
}
