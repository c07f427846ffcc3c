//! The warm pool: Docker containers created, started and given their tools and shell
//! ahead of demand, up to N per image, so an episode only copies its task in.
//!
//! One task owns the pool's containers and answers requests on a bounded channel
//! ([`WarmPool`] is the cheap, cloneable handle). A taken container is refilled in the
//! background. Pooled containers carry the run and worker labels like every sandbox (so
//! [`crate::sandbox::docker::remove_orphans`] at the next worker start removes them) plus
//! [`LABEL_POOL`]; the episode label cannot be added once a container exists, so the
//! episode that takes one is recorded in a log line instead.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bollard::Docker;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::sandbox::docker::{ContainerSpec, DockerError, DockerSandbox, LABEL_RUN, LABEL_WORKER};
use crate::tasks::TaskRecord;

/// Label on pooled containers; its value names the pool.
pub const LABEL_POOL: &str = "tutor.pool";

/// Images a pool keeps containers for: the most recently requested ones. With the
/// SWE-bench rule every task has an image of its own, and a container per image seen
/// would pile up.
const MAX_IMAGES: usize = 4;

/// Containers created at once (the machine's cores run episodes too).
const MAX_CREATING: usize = 2;

/// Back-off after a failed creation, doubled per failure in a row up to the maximum.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);

enum Msg {
    /// Hand out a ready container of the image (none: the caller creates one).
    Take {
        image: String,
        reply: oneshot::Sender<Option<DockerSandbox>>,
    },
    /// Keep containers of this image ready from now on.
    Warm { image: String },
    /// Ids of the ready containers of an image.
    Ready {
        image: String,
        reply: oneshot::Sender<Vec<String>>,
    },
    /// Remove everything and stop; the reply comes when no pooled container is left.
    Shutdown { reply: oneshot::Sender<()> },
}

/// Handle on a warm pool. Clones talk to the same pool; when the last one is dropped
/// the pool removes its containers (if the runtime is still there to do it; call
/// [`WarmPool::shutdown`] to be sure).
#[derive(Clone)]
pub struct WarmPool {
    tx: mpsc::Sender<Msg>,
    docker: Docker,
    template: ContainerSpec,
    size: usize,
    name: String,
}

impl WarmPool {
    /// Starts a pool keeping `size` containers per image with the limits, run and worker
    /// of `template` (its image and episode are not used). Must run inside a Tokio
    /// runtime.
    pub fn start(docker: &Docker, template: &ContainerSpec, size: usize) -> Self {
        // Unique per pool, so that one pool's clean-up never touches another's.
        static POOLS: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "{}-{}-{}",
            template.worker,
            std::process::id(),
            POOLS.fetch_add(1, Ordering::Relaxed)
        );
        let (tx, rx) = mpsc::channel(64);
        let owner = Owner {
            docker: docker.clone(),
            template: template.clone(),
            size,
            name: name.clone(),
            images: Vec::new(),
            creating: JoinSet::new(),
            creating_image: HashMap::new(),
            removing: JoinSet::new(),
            closed: false,
        };
        tokio::spawn(owner.run(rx));
        Self {
            tx,
            docker: docker.clone(),
            template: template.clone(),
            size,
            name,
        }
    }

    /// The value of [`LABEL_POOL`] on this pool's containers.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Containers kept ready per image.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Starts filling the pool for `image` now rather than at its first request.
    pub async fn warm(&self, image: &str) {
        let _ = self
            .tx
            .send(Msg::Warm {
                image: image.into(),
            })
            .await;
    }

    /// Ids of the containers of `image` ready to be taken.
    pub async fn ready(&self, image: &str) -> Vec<String> {
        let (reply, rx) = oneshot::channel();
        let msg = Msg::Ready {
            image: image.into(),
            reply,
        };
        if self.tx.send(msg).await.is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Waits until `image` has [`Self::size`] ready containers, or `limit` passes;
    /// returns how many are ready.
    pub async fn wait_ready(&self, image: &str, limit: Duration) -> usize {
        let end = Instant::now() + limit;
        loop {
            let n = self.ready(image).await.len();
            if n >= self.size || Instant::now() >= end {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The sandbox of an episode: a ready container of the pool, checked to be running
    /// and set up for `task` as [`DockerSandbox::create`] would, or, when none is ready
    /// (or `spec` asks for other limits than the pool's), a container created now.
    pub async fn acquire(
        &self,
        spec: &ContainerSpec,
        task: &TaskRecord,
    ) -> Result<DockerSandbox, DockerError> {
        if !self.fits(spec) {
            return DockerSandbox::create(&self.docker, spec, task).await;
        }
        // Each pass takes a container out of the pool, so this ends; the bound is for
        // a pool refilled with dead containers as fast as they are discarded.
        for _ in 0..=self.size {
            let (reply, rx) = oneshot::channel();
            let msg = Msg::Take {
                image: spec.image.clone(),
                reply,
            };
            if self.tx.send(msg).await.is_err() {
                break;
            }
            let Some(mut sb) = rx.await.ok().flatten() else {
                break;
            };
            if !sb.is_running().await {
                tracing::warn!(container = %sb.id(), pool = %self.name, "a warm container is no longer running; discarding it");
                sb.remove().await;
                continue;
            }
            match sb.setup_task(task).await {
                Ok(()) => {
                    sb.set_pooled();
                    tracing::info!(container = %sb.id(), pool = %self.name, episode = %spec.episode, image = %spec.image, "episode takes a warm container");
                    return Ok(sb);
                }
                Err(e) => {
                    // The task itself may be at fault: a fresh container tells.
                    tracing::warn!(container = %sb.id(), pool = %self.name, error = %e, "setting up a warm container failed; discarding it and creating one");
                    sb.remove().await;
                    break;
                }
            }
        }
        DockerSandbox::create(&self.docker, spec, task).await
    }

    /// Stops refilling and removes every container of the pool, ready or still being
    /// created. Later acquisitions create their containers on demand.
    pub async fn shutdown(&self) {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Msg::Shutdown { reply }).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// Whether the pool's containers are what `spec` asks for (apart from the image).
    fn fits(&self, spec: &ContainerSpec) -> bool {
        let t = &self.template;
        spec.run == t.run && spec.worker == t.worker && spec.same_limits(t)
    }
}

/// One image's ready containers.
struct ImagePool {
    image: String,
    ready: VecDeque<DockerSandbox>,
    creating: usize,
    failures: u32,
    retry_at: Option<Instant>,
}

/// The task that owns the containers.
struct Owner {
    docker: Docker,
    template: ContainerSpec,
    size: usize,
    name: String,
    /// Least recently requested first.
    images: Vec<ImagePool>,
    creating: JoinSet<Result<DockerSandbox, DockerError>>,
    /// The image each creation under way is for.
    creating_image: HashMap<tokio::task::Id, String>,
    removing: JoinSet<()>,
    closed: bool,
}

impl Owner {
    async fn run(mut self, mut rx: mpsc::Receiver<Msg>) {
        let mut shutdown_reply = None;
        loop {
            self.refill();
            let retry = self.images.iter().filter_map(|p| p.retry_at).min();
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(Msg::Take { image, reply }) => {
                        let p = self.touch(&image);
                        let sb = p.ready.pop_front();
                        // A caller that went away leaves the container to the drop.
                        let _ = reply.send(sb);
                    }
                    Some(Msg::Warm { image }) => {
                        self.touch(&image);
                    }
                    Some(Msg::Ready { image, reply }) => {
                        let ids = self
                            .images
                            .iter()
                            .find(|p| p.image == image)
                            .map(|p| p.ready.iter().map(|s| s.id().to_string()).collect())
                            .unwrap_or_default();
                        let _ = reply.send(ids);
                    }
                    Some(Msg::Shutdown { reply }) => {
                        shutdown_reply = Some(reply);
                        break;
                    }
                    // Every handle is gone.
                    None => break,
                },
                Some(done) = self.creating.join_next_with_id(), if !self.creating.is_empty() => {
                    self.created(done);
                }
                Some(_) = self.removing.join_next(), if !self.removing.is_empty() => {}
                _ = sleep_until_opt(retry), if retry.is_some() => {}
            }
        }
        self.close().await;
        if let Some(r) = shutdown_reply {
            let _ = r.send(());
        }
        // Later requests get nothing (their callers create containers themselves).
        while let Some(msg) = rx.recv().await {
            match msg {
                Msg::Take { reply, .. } => {
                    let _ = reply.send(None);
                }
                Msg::Ready { reply, .. } => {
                    let _ = reply.send(Vec::new());
                }
                Msg::Shutdown { reply } => {
                    let _ = reply.send(());
                }
                Msg::Warm { .. } => {}
            }
        }
    }

    /// The pool of `image`, now the most recently requested; the least recently
    /// requested image beyond [`MAX_IMAGES`] loses its containers.
    fn touch(&mut self, image: &str) -> &mut ImagePool {
        if let Some(i) = self.images.iter().position(|p| p.image == image) {
            let p = self.images.remove(i);
            self.images.push(p);
        } else {
            self.images.push(ImagePool {
                image: image.to_string(),
                ready: VecDeque::new(),
                creating: 0,
                failures: 0,
                retry_at: None,
            });
            while self.images.len() > MAX_IMAGES {
                let old = self.images.remove(0);
                tracing::debug!(pool = %self.name, image = %old.image, "no longer keeping containers of this image");
                for sb in old.ready {
                    self.discard(sb);
                }
            }
        }
        self.images.last_mut().expect("just pushed")
    }

    /// Starts creations until every image has `size` containers ready or on their way.
    fn refill(&mut self) {
        if self.closed {
            return;
        }
        let now = Instant::now();
        // The most recently requested image first.
        for i in (0..self.images.len()).rev() {
            let p = &mut self.images[i];
            if p.retry_at.is_some_and(|t| t > now) {
                continue;
            }
            p.retry_at = None;
            while p.ready.len() + p.creating < self.size && self.creating.len() < MAX_CREATING {
                p.creating += 1;
                let mut spec = self.template.clone();
                spec.image = p.image.clone();
                let labels = HashMap::from([
                    (LABEL_RUN.to_string(), spec.run.clone()),
                    (LABEL_WORKER.to_string(), spec.worker.clone()),
                    (LABEL_POOL.to_string(), self.name.clone()),
                ]);
                let docker = self.docker.clone();
                let task = self
                    .creating
                    .spawn(async move { DockerSandbox::launch(&docker, &spec, labels).await });
                self.creating_image.insert(task.id(), p.image.clone());
            }
        }
    }

    fn created(
        &mut self,
        done: Result<(tokio::task::Id, Result<DockerSandbox, DockerError>), tokio::task::JoinError>,
    ) {
        let id = match &done {
            Ok((id, _)) => *id,
            Err(e) => e.id(),
        };
        let image = self.creating_image.remove(&id).unwrap_or_default();
        let result = match done {
            Ok((_, r)) => r,
            // A panicked creation (its sandbox, if any, removes itself on drop).
            Err(e) => Err(DockerError::Shell(format!("the creation task failed: {e}"))),
        };
        let Some(p) = self.images.iter_mut().find(|p| p.image == image) else {
            // The image was dropped from the pool meanwhile.
            if let Ok(sb) = result {
                self.discard(sb);
            }
            return;
        };
        p.creating -= 1;
        match result {
            Ok(sb) => {
                p.failures = 0;
                tracing::debug!(pool = %self.name, container = %sb.id(), image = %image, "warm container ready");
                p.ready.push_back(sb);
            }
            Err(e) => {
                p.failures += 1;
                let wait = RETRY_MIN
                    .saturating_mul(1 << p.failures.min(6))
                    .min(RETRY_MAX);
                p.retry_at = Some(Instant::now() + wait);
                tracing::warn!(pool = %self.name, image = %image, error = %e, retry_in = ?wait, "creating a warm container failed");
            }
        }
    }

    /// Removes a container in the background (the owner keeps answering meanwhile).
    fn discard(&mut self, mut sb: DockerSandbox) {
        self.removing.spawn(async move { sb.remove().await });
    }

    /// Removes everything: ready containers and those still being created (waited for, so
    /// none appears afterwards). Containers already handed out are their episodes' to
    /// remove, though they carry the pool's label too.
    async fn close(&mut self) {
        self.closed = true;
        for p in std::mem::take(&mut self.images) {
            for sb in p.ready {
                self.discard(sb);
            }
        }
        while let Some(done) = self.creating.join_next().await {
            if let Ok(Ok(sb)) = done {
                self.discard(sb);
            }
        }
        while self.removing.join_next().await.is_some() {}
        tracing::debug!(pool = %self.name, "warm pool closed");
    }
}

async fn sleep_until_opt(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}
