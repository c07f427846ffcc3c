//! Coordinator: the one stateful brain of a run. Leases episodes to workers, stores
//! their turns durably, builds the DAgger dataset, drives the learner and the policy
//! versions.

pub mod config;
pub mod dataset;
pub mod driver;
pub mod metrics;
pub mod scheduler;
pub mod service;
pub mod store;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use tokio::sync::Notify;
use tutor_proto::auth::{AuthToken, ClientAuth, ServerAuth};
use tutor_proto::control_server::ControlServer;
use tutor_proto::rollout_server::RolloutServer;
use tutor_proto::Task;

pub use config::{BetaSchedule, BetaScheduleKind, CoordinatorConfig};

/// Everything `tutor coordinator` needs to start.
pub struct ServeOptions {
    pub listen: SocketAddr,
    pub run_dir: PathBuf,
    pub learner_endpoint: String,
    pub config: CoordinatorConfig,
    pub train_tasks: Vec<Task>,
    pub heldout_tasks: Vec<Task>,
    /// Written with the bound address once the socket listens (useful with port 0).
    pub addr_file: Option<PathBuf>,
    /// Required on every Rollout and Control call, and sent to the learner. `None`:
    /// no authentication (single-role development), with a warning at start.
    pub auth_token: Option<AuthToken>,
    /// Serve Prometheus metrics over HTTP (`GET /metrics`) here; `None`: off.
    pub metrics_listen: Option<SocketAddr>,
    /// Written with the metrics endpoint's bound address.
    pub metrics_addr_file: Option<PathBuf>,
    /// How the trajectory store writes; the default (fsync on) is the durable one.
    pub store: store::StoreOptions,
}

/// Runs the coordinator until `shutdown` resolves or a Control.Shutdown call arrives.
pub async fn serve(
    opts: ServeOptions,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    let store = store::TrajectoryStore::open_with(&opts.run_dir.join("trajectories"), opts.store)?;
    tracing::info!(path = %store.path().display(), events = store.len(), fsync = opts.store.fsync, "trajectory store open");
    if !opts.store.fsync {
        tracing::warn!("trajectory store fsync is off: acknowledged events can be lost in a crash");
    }
    let counters = Arc::new(metrics::EventCounters::default());
    let store_tx = store::spawn_writer(store, counters.clone());
    let scheduler = scheduler::SchedulerHandle::spawn(
        opts.config.clone(),
        opts.train_tasks,
        opts.heldout_tasks,
    );
    let events = service::EventLog::default();
    let stop = Arc::new(Notify::new());
    let auth = ServerAuth::new(opts.auth_token.clone());

    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .with_context(|| format!("binding the coordinator to {}", opts.listen))?;
    let local = listener.local_addr()?;
    let metrics_task = match opts.metrics_listen {
        Some(addr) => Some(
            metrics::start(
                addr,
                opts.metrics_addr_file.as_deref(),
                metrics::MetricsSource {
                    scheduler: scheduler.clone(),
                    events: counters.clone(),
                    auth: auth.clone(),
                },
            )
            .await?,
        ),
        None => None,
    };
    // Last: the address file tells `tutor run` that everything is up.
    if let Some(f) = &opts.addr_file {
        tutor_proto::net::write_addr_file(f, local)
            .with_context(|| format!("writing {}", f.display()))?;
    }
    tracing::info!(addr = %local, learner = %opts.learner_endpoint, "coordinator listening");
    if !auth.is_enabled() {
        tracing::warn!(
            addr = %local,
            "no auth token (--auth-token-file or TUTOR_AUTH_TOKEN): the coordinator accepts \
             gRPC calls from anyone who can reach it"
        );
    }

    let driver = driver::Driver {
        config: opts.config,
        scheduler: scheduler.clone(),
        events: events.clone(),
        learner_endpoint: opts.learner_endpoint,
        learner_auth: ClientAuth::new(opts.auth_token.as_ref()),
        run_dir: opts.run_dir,
    };
    tokio::spawn(driver.run());

    let rollout = service::RolloutService {
        scheduler,
        store: store_tx,
        counters,
    };
    let control = service::ControlService {
        events,
        shutdown: stop.clone(),
    };
    let stop_wait = stop.clone();
    // Probes carry no secrets: the health service is the one left unauthenticated.
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<RolloutServer<service::RolloutService>>()
        .await;
    health
        .set_serving::<ControlServer<service::ControlService>>()
        .await;
    let result = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(
            auth.intercept(
                RolloutServer::new(rollout)
                    .max_decoding_message_size(tutor_proto::MAX_ROLLOUT_REQUEST_BYTES)
                    .max_encoding_message_size(tutor_proto::MAX_MESSAGE_BYTES),
            ),
        )
        .add_service(auth.intercept(ControlServer::new(control)))
        // TCP_NODELAY, as tonic sets it on the sockets it binds itself (it does not on a
        // listener handed in): without it Nagle holds back small acks until the peer's
        // delayed ACK, ~40 ms on Linux, whenever a stream is not busy.
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            async move {
                tokio::select! {
                    _ = shutdown => {}
                    _ = stop_wait.notified() => {}
                }
                health
                    .set_service_status("", tonic_health::ServingStatus::NotServing)
                    .await;
            },
        )
        .await
        .context("coordinator server");
    if let Some(t) = metrics_task {
        t.abort();
    }
    result?;
    tracing::info!("coordinator stopped");
    Ok(())
}
