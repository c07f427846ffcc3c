//! Making the sandbox of each episode: [`SandboxFactory`] and its Docker settings.
//!
//! Local temporary repositories or Docker containers (fresh, or taken from the warm pool),
//! for a worker or for `tutor eval`, and the rule for which image a task's container runs.

use std::path::PathBuf;

use bollard::Docker;
use tokio::runtime::Handle;

use crate::sandbox::confine::{ConfineError, ConfineSettings, Confinement};
use crate::sandbox::docker::{ContainerSpec, DockerError, DockerSandbox};
use crate::sandbox::local::LocalSandboxError;
use crate::sandbox::pool::WarmPool;
use crate::sandbox::{BlockingDocker, LocalSandbox, Sandbox};
use crate::tasks::TaskRecord;

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
    /// The containers' ulimits (see [`ContainerSpec::nofile`], `fsize_bytes`).
    pub nofile: i64,
    pub fsize_bytes: i64,
    pub network: bool,
    /// See [`ContainerSpec::read_only_root`], `disk_bytes`, `tmp_bytes`.
    pub read_only_root: bool,
    pub disk_bytes: i64,
    pub tmp_bytes: i64,
    pub user: (u32, u32),
    /// Take each image's own user (see [`ContainerSpec::user_from_image`]).
    pub user_from_image: bool,
    /// Pull an image the engine lacks (see [`ContainerSpec::pull_missing`]).
    pub pull_missing: bool,
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
        spec.nofile = self.nofile;
        spec.fsize_bytes = self.fsize_bytes;
        spec.network = self.network;
        spec.read_only_root = self.read_only_root;
        spec.disk_bytes = self.disk_bytes;
        spec.tmp_bytes = self.tmp_bytes;
        spec.user = self.user;
        spec.user_from_image = self.user_from_image;
        spec.pull_missing = self.pull_missing;
        spec
    }
}

/// Why [`SandboxFactory::create`] made no sandbox.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error(transparent)]
    Local(#[from] LocalSandboxError),
    #[error("a Docker sandbox must be created inside the worker's runtime")]
    NoRuntime,
    /// Creating or taking the container failed; `image` is the one the task asked for.
    #[error("{source} (image {image})")]
    Docker {
        image: String,
        #[source]
        source: DockerError,
    },
}

/// Creates the sandboxes of a worker (or of `tutor eval`).
#[derive(Clone)]
pub enum SandboxFactory {
    /// Temporary directories under `root` (default: the system temp dir), named after
    /// `owner` when given (see `LocalSandbox::create_owned`), confined as
    /// [`Confinement::detected`] finds possible (unconfined, with a warning, where bwrap
    /// does not work): for tests and tools. A worker makes [`Self::LocalWith`] with
    /// [`Self::local`], which refuses where the commands cannot be confined.
    Local {
        root: Option<PathBuf>,
        owner: Option<String>,
    },
    /// As `Local`, with commands run as `confinement` says.
    LocalWith {
        root: Option<PathBuf>,
        owner: Option<String>,
        confinement: Confinement,
    },
    /// Boxed: the settings are much larger than the local variant.
    Docker(Box<DockerSettings>),
}

impl SandboxFactory {
    /// Local sandboxes (see `Local`) confined as `settings` ask: checked here, by building
    /// one with bubblewrap. Where that fails, [`ConfineError`] (naming what is missing and
    /// `[worker] allow_unconfined`) unless `settings.allow_unconfined`, which makes an
    /// unconfined factory and says so in a warning.
    pub fn local(
        root: Option<PathBuf>,
        owner: Option<String>,
        settings: &ConfineSettings,
    ) -> Result<Self, ConfineError> {
        let confinement = Confinement::new(settings)?;
        if confinement.is_confined() {
            tracing::info!(confinement = %confinement.describe(), "local sandboxes are confined");
        } else {
            tracing::warn!(
                confinement = %confinement.describe(),
                "local sandboxes run the model's commands UNCONFINED, as this process's user \
                 ([worker] allow_unconfined = true): nothing stands between them and the run's \
                 token, the Python venv and the host"
            );
        }
        Ok(SandboxFactory::LocalWith {
            root,
            owner,
            confinement,
        })
    }

    /// A fresh sandbox for `task`, labelled with `episode` (Docker). Blocking.
    pub fn create(
        &self,
        task: &TaskRecord,
        episode: &str,
    ) -> Result<Box<dyn Sandbox>, CreateError> {
        match self {
            SandboxFactory::Local { root, owner } => {
                let sb = LocalSandbox::create_owned(task, root.as_deref(), owner.as_deref())?;
                Ok(Box::new(sb))
            }
            SandboxFactory::LocalWith {
                root,
                owner,
                confinement,
            } => {
                let sb = LocalSandbox::create_confined(
                    task,
                    root.as_deref(),
                    owner.as_deref(),
                    confinement,
                )?;
                Ok(Box::new(sb))
            }
            SandboxFactory::Docker(d) => {
                let rt = Handle::try_current().map_err(|_| CreateError::NoRuntime)?;
                let spec = d.spec(task, episode);
                let sb = match &d.pool {
                    Some(pool) => rt.block_on(pool.acquire(&spec, task)),
                    None => rt.block_on(DockerSandbox::create(&d.docker, &spec, task)),
                }
                .map_err(|source| CreateError::Docker {
                    image: spec.image.clone(),
                    source,
                })?;
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
        match crate::sandbox::docker::remove_orphans(&d.docker, &d.run, Some(&d.worker)).await {
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
            SandboxFactory::Local { .. } | SandboxFactory::LocalWith { .. } => "local",
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
