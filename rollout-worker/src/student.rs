//! The student host: one thread owns the tch policy; episodes ask it for generations
//! over a channel, and requests that arrive together are decoded as one batch. Weight
//! swaps go through the same channel, so they happen between generations.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use tokio::sync::{mpsc, oneshot};
use tutor_policy::{GenParams, Generation, ModelConfig, Policy};
use tutor_proto::auth::ClientAuth;
use tutor_proto::PolicyVersion;

/// Version number meaning "no weights loaded yet".
pub const NO_VERSION: u64 = u64::MAX;

/// Most requests decoded together in one batch.
const MAX_BATCH: usize = 16;

enum Cmd {
    Generate {
        prompt: Vec<u32>,
        params: GenParams,
        reply: oneshot::Sender<Generation>,
    },
    Load {
        path: PathBuf,
        reply: oneshot::Sender<Result<(), String>>,
    },
}

/// Cheap to clone; every clone talks to the same model thread.
#[derive(Clone)]
pub struct StudentHost {
    tx: mpsc::Sender<Cmd>,
    loaded: Arc<AtomicU64>,
    load_lock: Arc<tokio::sync::Mutex<()>>,
    cache_dir: PathBuf,
    /// Sent with every weights download.
    auth: ClientAuth,
}

impl StudentHost {
    /// Builds the model from `model_dir/config.json` (random weights until a version is
    /// loaded) on its own thread, with `torch_threads` intra-op threads (0: libtorch's
    /// default). Weights are downloaded with `auth`.
    pub fn start(
        model_dir: &Path,
        cache_dir: &Path,
        torch_threads: u32,
        auth: ClientAuth,
    ) -> Result<Self> {
        let cfg_path = model_dir.join("config.json");
        let config = ModelConfig::load(&cfg_path)
            .with_context(|| format!("reading {}", cfg_path.display()))?;
        let (tx, mut rx) = mpsc::channel::<Cmd>(64);
        std::thread::Builder::new()
            .name("student".into())
            .spawn(move || {
                // OpenMP thread counts are per thread: set it on the thread that decodes.
                if torch_threads > 0 {
                    tch::set_num_threads(torch_threads as i32);
                }
                let mut policy = Policy::new(config, tch::Device::Cpu, 0);
                while let Some(first) = rx.blocking_recv() {
                    let mut gens: Vec<(Vec<u32>, GenParams, oneshot::Sender<Generation>)> =
                        Vec::new();
                    let mut next = Some(first);
                    // Collect what is already waiting; a Load ends the batch so a swap
                    // never lands in the middle of one.
                    while let Some(cmd) = next.take() {
                        match cmd {
                            Cmd::Generate {
                                prompt,
                                params,
                                reply,
                            } => {
                                gens.push((prompt, params, reply));
                                if gens.len() < MAX_BATCH {
                                    next = rx.try_recv().ok();
                                }
                            }
                            Cmd::Load { path, reply } => {
                                run_batch(&policy, std::mem::take(&mut gens));
                                let r = policy
                                    .load_weights(&path)
                                    .map_err(|e| format!("loading {}: {e}", path.display()));
                                let _ = reply.send(r);
                            }
                        }
                    }
                    run_batch(&policy, gens);
                }
            })
            .context("starting the student thread")?;
        Ok(Self {
            tx,
            loaded: Arc::new(AtomicU64::new(NO_VERSION)),
            load_lock: Default::default(),
            cache_dir: cache_dir.to_path_buf(),
            auth,
        })
    }

    pub fn loaded_version(&self) -> u64 {
        self.loaded.load(Ordering::SeqCst)
    }

    /// Makes sure `policy` is the loaded version: downloads it from its weights
    /// endpoint (checksum verified) and swaps it in. Concurrent callers load once.
    pub async fn ensure(&self, policy: &PolicyVersion) -> Result<()> {
        let _guard = self.load_lock.lock().await;
        if self.loaded_version() == policy.version {
            return Ok(());
        }
        let path = self
            .cache_dir
            .join(format!("policy-v{:06}.safetensors", policy.version));
        let t = std::time::Instant::now();
        crate::weights::download_weights(
            &policy.weights_endpoint,
            policy.version,
            &policy.sha256,
            &path,
            &self.auth,
        )
        .await?;
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Cmd::Load {
                path: path.clone(),
                reply,
            })
            .await
            .map_err(|_| anyhow!("the student thread has stopped"))?;
        rx.await
            .map_err(|_| anyhow!("the student thread dropped a load"))?
            .map_err(|e| anyhow!(e))?;
        let _ = std::fs::remove_file(&path);
        self.loaded.store(policy.version, Ordering::SeqCst);
        tracing::info!(
            version = policy.version,
            seconds = t.elapsed().as_secs_f64(),
            "loaded policy version"
        );
        Ok(())
    }

    /// Samples one assistant message. Blocking: call it from a blocking thread.
    pub fn generate_blocking(&self, prompt: Vec<u32>, params: GenParams) -> Result<Generation> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .blocking_send(Cmd::Generate {
                prompt,
                params,
                reply,
            })
            .map_err(|_| anyhow!("the student thread has stopped"))?;
        rx.blocking_recv()
            .map_err(|_| anyhow!("the student thread dropped a generation"))
    }
}

fn run_batch(policy: &Policy, gens: Vec<(Vec<u32>, GenParams, oneshot::Sender<Generation>)>) {
    if gens.is_empty() {
        return;
    }
    let prompts: Vec<Vec<u32>> = gens.iter().map(|g| g.0.clone()).collect();
    let params: Vec<GenParams> = gens.iter().map(|g| g.1.clone()).collect();
    let out = policy.generate(&prompts, &params);
    for ((_, _, reply), g) in gens.into_iter().zip(out) {
        let _ = reply.send(g);
    }
}
