//! The learner's gRPC face: the Learner service (train stream, status, checkpoint) and
//! the Weights service, both on one socket. The trainer lives on its own thread and is
//! reached through `LearnerHandle`, so no tensor is shared across tasks.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use anyhow::{Context, Result};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use tutor_proto::auth::{AuthToken, ServerAuth};
use tutor_proto::learner_server::{Learner, LearnerServer};
use tutor_proto::weights_server::WeightsServer;
use tutor_proto::{
    LearnerStatus, LearnerStatusRequest, SaveCheckpointRequest, SaveCheckpointResponse, TrainBatch,
    TrainProgress,
};

use crate::config::LearnerConfig;
use crate::trainer::{StepReport, Trainer};
use crate::weights::{PublishedVersion, WeightsStore};

enum Command {
    Step {
        examples: Vec<(Vec<u32>, Vec<bool>)>,
        publish: bool,
        reply: oneshot::Sender<Result<(StepReport, Option<PublishedVersion>), String>>,
    },
    Checkpoint {
        dir: PathBuf,
        reply: oneshot::Sender<Result<u64, String>>,
    },
    Status {
        reply: oneshot::Sender<(u64, Option<PublishedVersion>)>,
    },
}

/// Sends commands to the trainer thread.
#[derive(Clone)]
pub struct LearnerHandle {
    tx: mpsc::Sender<Command>,
}

impl LearnerHandle {
    /// Starts the trainer thread and publishes the initial weights as version 0.
    pub fn spawn(trainer: Trainer, store: WeightsStore, model_dir: PathBuf) -> Result<Self> {
        let path0 = store.path_for(0);
        trainer.save_weights(&path0)?;
        let v0 = store.register(0)?;
        tracing::info!(sha256 = %v0.sha256, bytes = v0.bytes, "published initial policy version 0");
        let (tx, mut rx) = mpsc::channel::<Command>(8);
        std::thread::Builder::new()
            .name("trainer".into())
            .spawn(move || {
                let mut trainer = trainer;
                while let Some(cmd) = rx.blocking_recv() {
                    match cmd {
                        Command::Step {
                            examples,
                            publish,
                            reply,
                        } => {
                            let report = trainer.step(&examples);
                            let published = if publish {
                                match publish_next(&trainer, &store) {
                                    Ok(pv) => Some(pv),
                                    Err(e) => {
                                        let _ =
                                            reply.send(Err(format!("publishing weights: {e:#}")));
                                        continue;
                                    }
                                }
                            } else {
                                None
                            };
                            let _ = reply.send(Ok((report, published)));
                        }
                        Command::Checkpoint { dir, reply } => {
                            let result = save_checkpoint(&trainer, &store, &model_dir, &dir)
                                .map_err(|e| format!("{e:#}"));
                            let _ = reply.send(result);
                        }
                        Command::Status { reply } => {
                            let _ = reply.send((trainer.steps(), store.latest()));
                        }
                    }
                }
            })
            .context("starting the trainer thread")?;
        Ok(Self { tx })
    }

    async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, Status> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| Status::unavailable("the trainer thread has stopped"))?;
        rx.await
            .map_err(|_| Status::internal("the trainer thread dropped a request"))
    }
}

fn publish_next(trainer: &Trainer, store: &WeightsStore) -> Result<PublishedVersion> {
    let next = store.latest().map(|v| v.version + 1).unwrap_or(0);
    trainer.save_weights(&store.path_for(next))?;
    let pv = store.register(next)?;
    tracing::info!(version = next, sha256 = %pv.sha256, "published policy version");
    Ok(pv)
}

fn save_checkpoint(
    trainer: &Trainer,
    store: &WeightsStore,
    model_dir: &Path,
    dir: &Path,
) -> Result<u64> {
    trainer.save_dir(dir)?;
    let tok = model_dir.join("tokenizer.json");
    if tok.exists() {
        std::fs::copy(&tok, dir.join("tokenizer.json"))
            .with_context(|| format!("copying {} into the checkpoint", tok.display()))?;
    }
    Ok(store.latest().map(|v| v.version).unwrap_or(0))
}

type ProgressStream = Pin<Box<dyn Stream<Item = Result<TrainProgress, Status>> + Send>>;

#[tonic::async_trait]
impl Learner for LearnerHandle {
    type TrainStream = ProgressStream;

    async fn train(
        &self,
        request: Request<Streaming<TrainBatch>>,
    ) -> Result<Response<Self::TrainStream>, Status> {
        let mut batches = request.into_inner();
        let handle = self.clone();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            while let Some(batch) = batches.next().await {
                let batch = match batch {
                    Ok(b) => b,
                    Err(status) => {
                        tracing::warn!(%status, "train stream from the coordinator broke");
                        return;
                    }
                };
                let examples: Vec<(Vec<u32>, Vec<bool>)> = batch
                    .examples
                    .into_iter()
                    .map(|e| (e.tokens, e.loss_mask))
                    .collect();
                let publish = batch.publish;
                let result = handle
                    .call(|reply| Command::Step {
                        examples,
                        publish,
                        reply,
                    })
                    .await
                    .and_then(|r| r.map_err(Status::internal));
                let msg = result.map(|(report, published)| TrainProgress {
                    iteration: batch.iteration,
                    step: batch.step,
                    loss: report.loss,
                    label_tokens: report.label_tokens,
                    grad_norm: report.grad_norm,
                    step_seconds: report.seconds,
                    published_version: published.as_ref().map(|p| p.version).unwrap_or(0),
                    published_sha256: published.map(|p| p.sha256).unwrap_or_default(),
                    learning_rate: report.learning_rate,
                });
                if tx.send(msg).await.is_err() {
                    return; // the coordinator went away
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn status(
        &self,
        _request: Request<LearnerStatusRequest>,
    ) -> Result<Response<LearnerStatus>, Status> {
        let (steps, latest) = self.call(|reply| Command::Status { reply }).await?;
        Ok(Response::new(LearnerStatus {
            latest_version: latest.as_ref().map(|v| v.version).unwrap_or(0),
            latest_sha256: latest.map(|v| v.sha256).unwrap_or_default(),
            optimizer_steps: steps,
        }))
    }

    async fn save_checkpoint(
        &self,
        request: Request<SaveCheckpointRequest>,
    ) -> Result<Response<SaveCheckpointResponse>, Status> {
        let dir = request.into_inner().dir;
        if dir.is_empty() {
            return Err(Status::invalid_argument("SaveCheckpoint needs a directory"));
        }
        let path = PathBuf::from(&dir);
        let version = self
            .call(|reply| Command::Checkpoint { dir: path, reply })
            .await?
            .map_err(Status::internal)?;
        Ok(Response::new(SaveCheckpointResponse { dir, version }))
    }
}

/// Everything `tutor learner` needs to start.
pub struct ServeOptions {
    pub listen: SocketAddr,
    pub model_dir: PathBuf,
    pub out_dir: PathBuf,
    pub config: LearnerConfig,
    /// Written with the bound address once the socket listens (useful with port 0).
    pub addr_file: Option<PathBuf>,
    /// Required on every Learner and Weights call; `None`: no authentication, with a
    /// warning at start.
    pub auth_token: Option<AuthToken>,
}

/// Runs the learner until `shutdown` resolves.
pub async fn serve(
    opts: ServeOptions,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    let trainer = Trainer::from_model_dir(&opts.model_dir, opts.config.clone())?;
    tracing::info!(
        parameters = trainer.policy().config().num_parameters(),
        model_dir = %opts.model_dir.display(),
        "learner model ready"
    );
    let store = WeightsStore::new(&opts.out_dir.join("versions"))?;
    let handle = LearnerHandle::spawn(trainer, store.clone(), opts.model_dir.clone())?;
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .with_context(|| format!("binding the learner to {}", opts.listen))?;
    let local = listener.local_addr()?;
    if let Some(f) = &opts.addr_file {
        tutor_proto::net::write_addr_file(f, local)
            .with_context(|| format!("writing {}", f.display()))?;
    }
    tracing::info!(addr = %local, "learner listening");
    let auth = ServerAuth::new(opts.auth_token);
    if !auth.is_enabled() {
        tracing::warn!(
            addr = %local,
            "no auth token (--auth-token-file or TUTOR_AUTH_TOKEN): the learner accepts \
             gRPC calls from anyone who can reach it"
        );
    }
    // Probes carry no secrets: the health service is the one left unauthenticated.
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<LearnerServer<LearnerHandle>>().await;
    health.set_serving::<WeightsServer<WeightsStore>>().await;
    tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(
            auth.intercept(
                LearnerServer::new(handle)
                    .max_decoding_message_size(tutor_proto::MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(tutor_proto::MAX_MESSAGE_BYTES),
            ),
        )
        .add_service(auth.intercept(WeightsServer::new(store)))
        .serve_with_incoming_shutdown(
            // tonic sets TCP_NODELAY only on listeners it binds itself; without it small
            // replies wait on delayed ACKs (~40 ms each).
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            async move {
                shutdown.await;
                health
                    .set_service_status("", tonic_health::ServingStatus::NotServing)
                    .await;
            },
        )
        .await
        .context("learner server")?;
    tracing::info!("learner stopped");
    Ok(())
}
