//! Coordinator: the one stateful brain of a run. Leases episodes to workers, stores
//! their turns durably, builds the DAgger dataset, drives the learner and the policy
//! versions.

pub mod algorithms;
pub mod config;
pub mod counters;
pub mod dataset;
pub mod driver;
pub mod episode_id;
pub mod learner_group;
pub mod metrics;
pub mod rewards;
pub mod rollouts;
pub mod run_events;
pub mod scheduler;
pub mod service;
pub mod state;
pub mod store;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokio::sync::Notify;
use tutor_proto::auth::{AuthToken, ClientAuth, Role, ServerAuth};
use tutor_proto::control_server::ControlServer;
use tutor_proto::learner_group_server::LearnerGroupServer;
use tutor_proto::net::GrpcListener;
use tutor_proto::rollout_server::RolloutServer;
use tutor_proto::Task;

pub use config::{Algorithm, BetaSchedule, BetaScheduleKind, CoordinatorConfig, ScheduleMode};

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
    /// Required on every Rollout, Control and LearnerGroup call, and sent to the learner. `None`:
    /// no authentication (single-role development), with a warning at start.
    pub auth_token: Option<AuthToken>,
    /// Serve Prometheus metrics over HTTP (`GET /metrics`) here; `None`: off.
    pub metrics_listen: Option<SocketAddr>,
    /// Written with the metrics endpoint's bound address.
    pub metrics_addr_file: Option<PathBuf>,
    /// How the trajectory store writes; the default (fsync on) is the durable one.
    pub store: store::StoreOptions,
    /// TLS: the server side for workers (client certificates required when `ca` is
    /// given) and, with `ca`, the client side towards an `https://` learner. Empty:
    /// plaintext.
    pub tls: tutor_proto::tls::TlsFiles,
    /// Listen on a non-loopback address with no token and no client certificates.
    /// Without it that is refused at start (`--insecure` on the command line).
    pub insecure: bool,
}

/// How long tonic may take to close its connections once the drain is over; after it,
/// they are dropped (a worker's event stream never ends by itself).
const SERVER_CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the last store batch may take to be written at exit.
const STORE_CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs the coordinator until `shutdown` resolves or a Control.Shutdown call arrives,
/// then shuts down gracefully: no new leases; the leased episodes may keep streaming
/// for `shutdown_grace_s` (or until none is left); the server stops; the store's last
/// batch is written. On a run directory that holds a previous coordinator's state, it
/// recovers the iteration, the phase, the datasets and the episodes in progress and
/// carries on from there.
pub async fn serve(
    opts: ServeOptions,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    // TLS files are checked first: a typo fails before anything is written.
    let server_tls = opts.tls.server()?;
    let mut server_builder = tutor_proto::tls::server_builder(server_tls.as_ref())?;
    if let Some(role) = opts.auth_token.as_ref().map(|t| t.role()) {
        if role != Role::Operator {
            anyhow::bail!(
                "the coordinator was given a {} token: it needs the run's own token (it \
                 checks every role's token, and derives the learner's and the workers')",
                role.as_str()
            );
        }
    }
    // The learner is called with the learner's token, the one it serves with.
    let learner_token = opts.auth_token.as_ref().map(|t| t.derive(Role::Learner));
    let learner_auth = ClientAuth::new(learner_token.as_ref()).with_tls(match opts.tls.ca {
        Some(_) => opts.tls.client()?,
        None => None,
    });
    learner_auth
        .endpoint(&opts.learner_endpoint)
        .context("the --learner endpoint")?;
    // Durably: a crash must not lose the run directory, and the events acknowledged in it.
    store::create_dir_durably(&opts.run_dir)
        .with_context(|| format!("creating {}", opts.run_dir.display()))?;
    let state_path = state::state_path(&opts.run_dir);
    let (run_state, resumed) = match state::RunState::load(&state_path)? {
        Some(s) => (s, true),
        None => (state::RunState::default(), false),
    };
    // The stored events are kept as offsets in the store file: each iteration's are read
    // back when the scheduler replays it.
    let store_dir = opts.run_dir.join("trajectories");
    let mut recovery = scheduler::Recovery::in_store(&store::log_path(&store_dir));
    let store = store::TrajectoryStore::open_for_each(&store_dir, opts.store, |offset, ev| {
        recovery.history.push_stored(offset, &ev)
    })?;
    tracing::info!(path = %store.path().display(), events = store.len(), fsync = opts.store.fsync, "trajectory store open");
    if !opts.store.fsync {
        tracing::warn!("trajectory store fsync is off: acknowledged events can be lost in a crash");
    }
    if !resumed && !recovery.history.is_empty() {
        anyhow::bail!(
            "{} holds {} stored events but {} is missing: this run directory was not written \
             by a coordinator that can resume it; use a fresh --run-dir",
            store.path().display(),
            recovery.history.len(),
            state_path.display()
        );
    }
    // Saved before anything is leased: ids of this generation are new for good.
    let run_id = if run_state.run_id.is_empty() {
        state::new_run_id(&opts.run_dir)
    } else {
        run_state.run_id.clone()
    };
    let worker_key = match scheduler::WorkerKey::from_hex(&run_state.worker_key) {
        Some(key) => key,
        None => {
            if resumed {
                tracing::warn!(
                    "{} has no worker key (written before one was kept): workers registered \
                     before this restart must register again",
                    state_path.display()
                );
            }
            scheduler::WorkerKey::default()
        }
    };
    let generation = if resumed { run_state.generation + 1 } else { 0 };
    let run_state = state::RunState {
        generation,
        run_id,
        worker_key: worker_key.to_hex(),
        // This coordinator records its leases: from it on, every generation does.
        lease_records_from: run_state.lease_records_from.or(Some(generation)),
        ..run_state
    };
    run_state.save(&state_path)?;
    if resumed {
        tracing::info!(
            run_id = %run_state.run_id,
            generation = run_state.generation,
            iteration = run_state.iteration,
            phase = ?run_state.phase,
            events = recovery.history.len(),
            "resuming the run from its state and store"
        );
    }
    let counters = Arc::new(counters::EventCounters::default());
    let (store_tx, store_thread) = store::spawn_writer(store, counters.clone());
    // Closes when the store's writer thread ends early (a poisoned store): the
    // coordinator then stops with the store's error. Dropped before the writer is joined.
    let store_watch = store_tx.clone();
    // DAgger's aggregated dataset grows with the run: its examples live in a file in
    // the run directory (unnamed: it goes with the process), not in memory.
    let examples_file = if opts.config.aggregates() {
        Some(
            dataset::ExampleSpill::create_in(&opts.run_dir)
                .context("the aggregated dataset's examples are kept in the run directory")?,
        )
    } else {
        None
    };
    let scheduler = scheduler::SchedulerHandle::spawn_with_store(
        opts.config.clone(),
        opts.train_tasks,
        opts.heldout_tasks,
        scheduler::Recovery {
            generation: run_state.generation,
            worker_key,
            lease_records_from: run_state.lease_records_from,
            ..recovery
        },
        Some(&store_tx),
        examples_file,
    );
    // A restarted coordinator's watchers still get the earlier iterations' summaries.
    let events = run_events::EventLog::with_history(if resumed {
        driver::read_summaries(&opts.run_dir.join("metrics.jsonl"))?
    } else {
        Vec::new()
    });
    let stop = Arc::new(Notify::new());
    let auth = ServerAuth::new(opts.auth_token.clone());
    if opts.config.metrics_require_token && !auth.is_enabled() {
        anyhow::bail!(
            "[coordinator] metrics_require_token = true needs the run's token \
             (--auth-token-file or TUTOR_AUTH_TOKEN): there is nothing to require"
        );
    }

    let listener = GrpcListener::bind("coordinator", opts.listen).await?;
    listener.refuse_unprotected(
        &auth,
        server_tls.as_ref().is_some_and(|t| t.is_mutual()),
        opts.insecure,
    )?;
    let metrics_task = match opts.metrics_listen {
        Some(addr) => Some(
            metrics::start(
                addr,
                opts.metrics_addr_file.as_deref(),
                metrics::MetricsSource {
                    scheduler: scheduler.clone(),
                    events: counters.clone(),
                    // A scrape that must carry a token carries the run's.
                    auth: auth.allowing(&[]),
                    run_events: events.clone(),
                    require_token: opts.config.metrics_require_token,
                },
            )
            .await?,
        ),
        None => None,
    };
    // Last: the address file tells `tutor run` that everything is up.
    listener.write_addr_file(opts.addr_file.as_deref())?;
    tracing::info!(
        addr = %listener.local_addr(),
        learner = %opts.learner_endpoint,
        tls = server_tls.is_some(),
        client_certificates = server_tls.as_ref().is_some_and(|t| t.is_mutual()),
        "coordinator listening"
    );
    listener.warn_if_unauthenticated(&auth);

    let grace = Duration::from_secs_f64(opts.config.shutdown_grace_s.max(0.0));
    let driver = driver::Driver {
        config: opts.config,
        scheduler: scheduler.clone(),
        events: events.clone(),
        learner_endpoint: opts.learner_endpoint,
        learner_auth,
        run_dir: opts.run_dir,
        state: run_state,
        resumed,
    };
    let driver_task = tokio::spawn(driver.run());
    let draining = scheduler.clone();

    let rollout = service::RolloutService {
        scheduler,
        store: store_tx,
        counters,
    };
    let (close_tx, close_rx) = tokio::sync::oneshot::channel::<()>();
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
    health
        .set_serving::<LearnerGroupServer<learner_group::LearnerGroupService>>()
        .await;
    let server = server_builder
        .add_service(health_service)
        // Workers' tokens reach Rollout and the rendezvous (the weights broadcast's
        // receivers), the learner's the rendezvous only; Control (watching, shutting
        // down) takes the run's token only.
        .add_service(
            auth.allowing(&[Role::Worker]).intercept(
                RolloutServer::new(rollout)
                    .max_decoding_message_size(tutor_proto::MAX_ROLLOUT_REQUEST_BYTES)
                    .max_encoding_message_size(tutor_proto::MAX_MESSAGE_BYTES),
            ),
        )
        .add_service(auth.allowing(&[]).intercept(ControlServer::new(control)))
        // Data-parallel learner ranks find rank 0's collective here.
        .add_service(auth.allowing(&[Role::Learner, Role::Worker]).intercept(
            LearnerGroupServer::new(learner_group::LearnerGroupService::default()),
        ))
        .serve_with_incoming_shutdown(
            listener.incoming(),
            tutor_proto::net::not_serving_after(
                async move {
                    let _ = close_rx.await;
                },
                health,
            ),
        );
    let mut server = Box::pin(server);
    let stop_requested = async {
        tokio::select! {
            _ = shutdown => {}
            _ = stop_wait.notified() => {}
        }
    };
    let result = tokio::select! {
        r = &mut server => r.context("coordinator server"),
        _ = store_watch.closed() => {
            driver_task.abort();
            Err(anyhow::anyhow!("the trajectory store stopped"))
        }
        _ = stop_requested => {
            drain(&draining, grace).await;
            // The driver holds no state that is not on disk: a restart carries on.
            driver_task.abort();
            let _ = close_tx.send(());
            match tokio::time::timeout(SERVER_CLOSE_TIMEOUT, &mut server).await {
                Ok(r) => r.context("coordinator server"),
                Err(_) => {
                    tracing::info!("closing the connections still open");
                    Ok(())
                }
            }
        }
    };
    // Dropping the server drops its store senders; the event streams' tasks drop theirs
    // once their connections close. The writer then writes what it has and ends.
    drop(server);
    drop(store_watch);
    let joined = tokio::time::timeout(
        STORE_CLOSE_TIMEOUT,
        tokio::task::spawn_blocking(move || store_thread.join()),
    )
    .await;
    let stored = match joined {
        Ok(Ok(Ok(stored))) => {
            stored.context("the trajectory store failed, so the coordinator stopped")
        }
        Ok(Ok(Err(_))) => Err(anyhow::anyhow!(
            "the trajectory store's writer thread panicked (see the log above); \
             acknowledged events are on disk"
        )),
        _ => {
            tracing::warn!(
                "the trajectory store did not close in time; acknowledged events are on disk"
            );
            Ok(())
        }
    };
    if let Some(t) = metrics_task {
        t.abort();
    }
    stored?;
    result?;
    tracing::info!("coordinator stopped");
    Ok(())
}

/// Stops leasing and waits until no live worker holds a lease or `grace` has passed, so
/// that episodes in flight can stream their last turns and outcomes. (A lease of a worker
/// that stopped heartbeating will not finish: waiting for it only delays the exit.)
async fn drain(scheduler: &scheduler::SchedulerHandle, grace: Duration) {
    scheduler.drain().await;
    let deadline = Instant::now() + grace;
    loop {
        let outstanding = match scheduler.snapshot().await {
            Some(s) if !s.run_finished => s.outstanding_live_leases,
            _ => 0,
        };
        if outstanding == 0 {
            tracing::info!("no lease outstanding: stopping");
            return;
        }
        if Instant::now() >= deadline {
            tracing::warn!(
                outstanding,
                "shutdown grace period over: stopping with leases outstanding (a restarted \
                 coordinator keeps them leased or hands them out again)"
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
