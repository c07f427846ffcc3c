//! The coordinator's gRPC services: Rollout (workers) and Control (operators, `tutor run`).

use std::pin::Pin;
use std::sync::Arc;

use prost::Message;
use tokio::sync::{broadcast, mpsc, oneshot, Notify};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use tutor_proto::control_server::Control;
use tutor_proto::rollout_server::Rollout;
use tutor_proto::{
    episode_event, EpisodeEvent, EventAck, HeartbeatRequest, HeartbeatResponse, LeaseRequest,
    LeaseResponse, RegisterRequest, RegisterResponse, RunEvent, ShutdownRequest, ShutdownResponse,
    WatchRunRequest,
};

use crate::counters::EventCounters;
use crate::run_events::EventLog;
use crate::scheduler::{Admission, SchedulerHandle, HEARTBEAT_INTERVAL};
use crate::store::{event_key, StoreReply, StoreRequest};

#[derive(Clone)]
pub struct RolloutService {
    pub scheduler: SchedulerHandle,
    pub store: mpsc::Sender<StoreRequest>,
    pub counters: Arc<EventCounters>,
}

type AckStream = Pin<Box<dyn Stream<Item = Result<EventAck, Status>> + Send>>;

/// Longest worker id a Lease call may name (Register makes ids far shorter).
const MAX_WORKER_ID_BYTES: usize = 256;

/// Events of one stream handed to the store and not yet acknowledged, at most.
const STREAM_PIPELINE: usize = 256;

/// One stream's events in stream order, as the acking task answers them: handed to the
/// store and waiting for its commit, refused with a reason (the stream goes on), or the
/// error that ends the stream after the acks before it.
enum Waiting {
    Stored(InStore),
    Refused(EventAck),
    End(Status),
}

struct InStore {
    episode_id: String,
    turn_index: u32,
    stored: oneshot::Receiver<StoreReply>,
}

/// The ack of an event the coordinator will never store, saying why.
fn refused_ack(episode_id: String, turn_index: u32, reason: String) -> EventAck {
    EventAck {
        is_outcome: turn_index == tutor_proto::TURN_INDEX_OUTCOME,
        episode_id,
        turn_index,
        duplicate: false,
        refused: reason,
    }
}

/// Why the coordinator will never store `ev` (it is acknowledged as refused, so the
/// worker drops it instead of replaying it on every reconnect), or `None` if it may.
pub(crate) fn refusal(ev: &EpisodeEvent) -> Option<String> {
    match &ev.event {
        None => return Some("an event with neither a turn nor an outcome".into()),
        Some(episode_event::Event::LeaseExpired(_)) => {
            return Some(
                "a lease expiry is recorded by the coordinator itself, never by a worker".into(),
            )
        }
        Some(episode_event::Event::LeaseGranted(_)) => {
            return Some(
                "a lease grant is recorded by the coordinator itself, never by a worker".into(),
            )
        }
        Some(episode_event::Event::Turn(t))
            if t.turn_index >= tutor_proto::TURN_INDEX_LEASE_GRANTED =>
        {
            return Some(format!(
                "turn index {} is reserved for the coordinator's records",
                t.turn_index
            ))
        }
        _ => {}
    }
    let size = ev.encoded_len();
    if size > tutor_proto::MAX_EVENT_BYTES {
        return Some(format!(
            "the event is {size} bytes, over the {} an event may be (tutor_proto::MAX_EVENT_BYTES); \
             a worker leaves a too-large patch out before sending",
            tutor_proto::MAX_EVENT_BYTES
        ));
    }
    None
}

impl RolloutService {
    /// Records whom each of `resp`'s leases went to (`LeaseGranted`), durably, before the
    /// worker has them: a restarted coordinator then accepts each attempt's events from
    /// its holder only. If the store cannot, the lease call fails and the caller withdraws
    /// the leases granted in memory (nobody has them; no attempt is spent).
    async fn record_grants(&self, worker_id: &str, resp: &LeaseResponse) -> Result<(), Status> {
        let mut answers = Vec::with_capacity(resp.leases.len());
        for lease in &resp.leases {
            let (reply, answer) = oneshot::channel();
            let event = EpisodeEvent {
                episode_id: lease.episode_id.clone(),
                worker_id: crate::scheduler::COORDINATOR_WRITER.into(),
                event: Some(episode_event::Event::LeaseGranted(
                    tutor_proto::LeaseGranted {
                        worker_id: worker_id.to_string(),
                    },
                )),
            };
            self.store
                .send(StoreRequest { event, reply })
                .await
                .map_err(|_| Status::unavailable("the coordinator's store stopped"))?;
            answers.push(answer);
        }
        for answer in answers {
            match answer.await {
                Ok(StoreReply {
                    result: Ok(duplicate),
                    event,
                }) => {
                    if duplicate {
                        // Never for a new lease: each attempt's id is leased once.
                        tracing::warn!(episode = %event.episode_id, worker = worker_id, "a lease record was already in the store");
                    }
                }
                Ok(StoreReply { result: Err(e), .. }) => {
                    tracing::error!(worker = worker_id, error = %e, "could not record a lease: the lease call fails");
                    return Err(Status::unavailable(format!(
                        "the coordinator could not record the lease: {e}"
                    )));
                }
                Err(_) => return Err(Status::unavailable("the coordinator's store stopped")),
            }
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl Rollout for RolloutService {
    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let r = request.into_inner();
        if r.worker_name.is_empty() || r.worker_name.len() > 128 {
            return Err(Status::invalid_argument(
                "worker_name must be 1 to 128 characters",
            ));
        }
        let (worker_id, worker_secret, policy) = self
            .scheduler
            .register_worker(r.worker_name, r.capacity.max(1))
            .await
            .ok_or_else(|| Status::unavailable("coordinator is shutting down"))?;
        Ok(Response::new(RegisterResponse {
            worker_id,
            heartbeat_interval_ms: HEARTBEAT_INTERVAL.as_millis() as u64,
            policy: Some(policy),
            worker_secret,
        }))
    }

    async fn lease(
        &self,
        request: Request<LeaseRequest>,
    ) -> Result<Response<LeaseResponse>, Status> {
        let r = request.into_inner();
        // Recorded with every lease: a worker id is what Register gave, never megabytes.
        if r.worker_id.is_empty() || r.worker_id.len() > MAX_WORKER_ID_BYTES {
            return Err(Status::invalid_argument(format!(
                "worker_id must be 1 to {MAX_WORKER_ID_BYTES} bytes (the id Register gave), \
                 got {}",
                r.worker_id.len()
            )));
        }
        // In a task of its own: if the call is cancelled (the worker's deadline) while the
        // grants are being recorded, the withdrawal below still runs.
        let service = self.clone();
        tokio::spawn(async move {
            let worker_id = r.worker_id.clone();
            let resp = service
                .scheduler
                .lease(r.worker_id, r.max_episodes.min(64))
                .await
                .ok_or_else(|| Status::unavailable("coordinator is shutting down"))?;
            if let Err(status) = service.record_grants(&worker_id, &resp).await {
                // Nobody will have these leases: back to the queue, no attempt spent
                // (they would otherwise expire and count against their slots).
                let ids = resp.leases.iter().map(|l| l.episode_id.clone()).collect();
                service.scheduler.withdraw(worker_id, ids).await;
                return Err(status);
            }
            Ok(Response::new(resp))
        })
        .await
        .map_err(|e| Status::internal(format!("the lease task failed: {e}")))?
    }

    type StreamEventsStream = AckStream;

    /// Each event is acknowledged only after the store made it durable; a replayed
    /// event is acknowledged as a duplicate and changes nothing. Events are pipelined:
    /// the next is handed to the store while earlier ones wait for their group commit,
    /// so one stream's events share fsyncs; acks (and a final error) keep stream order.
    /// An event the coordinator will never store (see [`refusal`]) is acknowledged with
    /// its reason and the stream goes on: a worker must not replay it forever.
    async fn stream_events(
        &self,
        request: Request<Streaming<EpisodeEvent>>,
    ) -> Result<Response<Self::StreamEventsStream>, Status> {
        // Which worker this stream claims to be; proven, per event, by the secret its
        // Register answer gave it.
        let text = |key: &str| {
            request
                .metadata()
                .get(key)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let worker =
            text(tutor_proto::WORKER_ID_METADATA).zip(text(tutor_proto::WORKER_SECRET_METADATA));
        let mut events = request.into_inner();
        let store = self.store.clone();
        let scheduler = self.scheduler.clone();
        let counters = self.counters.clone();
        let (tx, rx) = mpsc::channel(256);
        // Events handed to the store, in stream order, waiting for their commit.
        let (waiting_tx, mut waiting_rx) = mpsc::channel::<Waiting>(STREAM_PIPELINE);
        let claims = scheduler.clone();
        tokio::spawn(async move {
            while let Some(ev) = events.next().await {
                let ev = match ev {
                    Ok(ev) => ev,
                    Err(status) => {
                        tracing::debug!(%status, "event stream from a worker ended");
                        return;
                    }
                };
                if let Some(reason) = refusal(&ev) {
                    let (episode_id, turn_index) =
                        event_key(&ev).unwrap_or_else(|| (ev.episode_id.clone(), 0));
                    tracing::warn!(episode = %episode_id, turn = turn_index, worker = %ev.worker_id, %reason, "event refused");
                    let ack = refused_ack(episode_id, turn_index, reason);
                    if waiting_tx.send(Waiting::Refused(ack)).await.is_err() {
                        return;
                    }
                    continue;
                }
                let (episode_id, turn_index) = event_key(&ev).expect("refusal checks the key");
                let (reply, stored) = oneshot::channel();
                match claims.admit(&ev, worker.clone()).await {
                    Admission::Refused(reason) => {
                        tracing::warn!(episode = %episode_id, turn = turn_index, %reason, "event refused");
                        let ack = refused_ack(episode_id, turn_index, reason);
                        if waiting_tx.send(Waiting::Refused(ack)).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    // An outcome of an attempt whose slot another attempt completed (a
                    // lease that expired, or was handed out again after a coordinator
                    // restart, while its worker kept going) is acknowledged and dropped:
                    // every slot is completed exactly once in the store.
                    Admission::Superseded => {
                        tracing::info!(episode = %episode_id, "outcome of a superseded attempt: acknowledged, not stored");
                        let _ = reply.send(StoreReply {
                            event: ev,
                            result: Ok(true),
                        });
                    }
                    Admission::Store => {
                        if store.send(StoreRequest { event: ev, reply }).await.is_err() {
                            let _ = waiting_tx
                                .send(Waiting::End(Status::unavailable(
                                    "trajectory store stopped",
                                )))
                                .await;
                            return;
                        }
                    }
                }
                let waiting = Waiting::Stored(InStore {
                    episode_id,
                    turn_index,
                    stored,
                });
                if waiting_tx.send(waiting).await.is_err() {
                    return; // the acking task stopped: the worker went away
                }
            }
        });
        tokio::spawn(async move {
            while let Some(waiting) = waiting_rx.recv().await {
                let InStore {
                    episode_id,
                    turn_index,
                    stored,
                } = match waiting {
                    Waiting::Stored(w) => w,
                    Waiting::Refused(ack) => {
                        EventCounters::bump(&counters.refused_events);
                        if tx.send(Ok(ack)).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    Waiting::End(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                };
                let (event, duplicate) = match stored.await {
                    Ok(StoreReply {
                        event,
                        result: Ok(d),
                    }) => (event, d),
                    Ok(StoreReply { result: Err(e), .. }) => {
                        let _ = tx.send(Err(Status::internal(e.to_string()))).await;
                        return;
                    }
                    Err(_) => {
                        let _ = tx
                            .send(Err(Status::unavailable("trajectory store stopped")))
                            .await;
                        return;
                    }
                };
                let is_outcome = turn_index == tutor_proto::TURN_INDEX_OUTCOME;
                EventCounters::bump(match (duplicate, is_outcome) {
                    (true, _) => &counters.duplicate_events,
                    (false, false) => &counters.turns_ingested,
                    (false, true) => &counters.outcomes_ingested,
                });
                if !duplicate {
                    scheduler.stored(event).await;
                }
                let ack = EventAck {
                    episode_id,
                    turn_index,
                    is_outcome,
                    duplicate,
                    refused: String::new(),
                };
                if tx.send(Ok(ack)).await.is_err() {
                    return; // the worker went away; it will replay unacked events
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let r = request.into_inner();
        let resp = self
            .scheduler
            .heartbeat(r.worker_id, r.active_episodes, r.loaded_version)
            .await
            .ok_or_else(|| Status::unavailable("coordinator is shutting down"))?;
        Ok(Response::new(resp))
    }
}

#[derive(Clone)]
pub struct ControlService {
    pub events: EventLog,
    pub shutdown: Arc<Notify>,
}

type RunEventStream = Pin<Box<dyn Stream<Item = Result<RunEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Control for ControlService {
    type WatchRunStream = RunEventStream;

    async fn watch_run(
        &self,
        _request: Request<WatchRunRequest>,
    ) -> Result<Response<Self::WatchRunStream>, Status> {
        let (kept, mut live) = self.events.subscribe();
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            for ev in kept {
                if tx.send(Ok(ev)).await.is_err() {
                    return;
                }
            }
            loop {
                match live.recv().await {
                    Ok(ev) => {
                        if tx.send(Ok(ev)).await.is_err() {
                            return;
                        }
                    }
                    // A slow watcher misses progress ticks, never the stream itself.
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn shutdown(
        &self,
        _request: Request<ShutdownRequest>,
    ) -> Result<Response<ShutdownResponse>, Status> {
        tracing::info!("shutdown requested over Control");
        self.shutdown.notify_one();
        Ok(Response::new(ShutdownResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tutor_proto::rollout_client::RolloutClient;
    use tutor_proto::{episode_event, EpisodeOutcome, TurnRecord, TURN_INDEX_OUTCOME};

    use super::*;
    use crate::ServeOptions;

    fn event(ep: &str, turn: Option<u32>) -> EpisodeEvent {
        EpisodeEvent {
            episode_id: ep.into(),
            worker_id: "w".into(),
            event: Some(match turn {
                Some(i) => episode_event::Event::Turn(TurnRecord {
                    turn_index: i,
                    observation: "x".repeat(1500),
                    ..Default::default()
                }),
                None => episode_event::Event::Outcome(EpisodeOutcome::default()),
            }),
        }
    }

    /// A coordinator on a loopback port with no learner; stop it with the sender, then
    /// await the handle.
    async fn start_coordinator(
        dir: &std::path::Path,
    ) -> (
        RolloutClient<tonic::transport::Channel>,
        oneshot::Sender<()>,
        tokio::task::JoinHandle<anyhow::Result<()>>,
    ) {
        let addr_file = dir.join("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(crate::serve(
            ServeOptions {
                listen: "127.0.0.1:0".parse().unwrap(),
                run_dir: dir.join("run"),
                // No learner listens there: the driver never reaches it in this test.
                learner_endpoint: "http://127.0.0.1:9".into(),
                config: Default::default(),
                train_tasks: Vec::new(),
                heldout_tasks: Vec::new(),
                addr_file: Some(addr_file.clone()),
                auth_token: None,
                metrics_listen: None,
                metrics_addr_file: None,
                store: Default::default(),
                tls: Default::default(),
                insecure: false,
            },
            async move {
                let _ = stopped.await;
            },
        ));
        let end = Instant::now() + Duration::from_secs(30);
        let addr = loop {
            if let Ok(a) = std::fs::read_to_string(&addr_file) {
                break a;
            }
            assert!(Instant::now() < end, "the coordinator never listened");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let client = RolloutClient::connect(format!("http://{addr}"))
            .await
            .unwrap()
            .max_encoding_message_size(tutor_proto::MAX_MESSAGE_BYTES);
        (client, stop, server)
    }

    /// A worker that sends everything before reading any ack: the events travel through
    /// the store pipelined, yet the acks come back in stream order, the replays in the
    /// same stream are duplicates, and the store holds each event once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pipelined_stream_acks_in_order_and_flags_replays() {
        let dir = tempfile::tempdir().unwrap();
        let (mut client, stop, server) = start_coordinator(dir.path()).await;

        let mut sent: Vec<EpisodeEvent> = (0..200).map(|i| event("e1", Some(i))).collect();
        sent.extend((0..10).map(|i| event("e1", Some(i))));
        sent.push(event("e1", None));
        let (tx, rx) = mpsc::channel(sent.len());
        for ev in &sent {
            tx.send(ev.clone()).await.unwrap();
        }
        drop(tx);
        let mut acks = client
            .stream_events(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut got = Vec::new();
        while let Some(a) = acks.message().await.unwrap() {
            got.push((a.turn_index, a.duplicate));
        }
        let mut want: Vec<(u32, bool)> = (0..200).map(|i| (i, false)).collect();
        want.extend((0..10).map(|i| (i, true)));
        want.push((TURN_INDEX_OUTCOME, false));
        assert_eq!(got, want);

        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
        let (stored, _) =
            crate::store::scan(&dir.path().join("run/trajectories/events.log")).unwrap();
        assert_eq!(stored.len(), 201);
    }

    /// A Lease call whose grants the store cannot record fails, and its leases go back
    /// to the queue without spending an attempt: with `max_attempts = 2` and the store
    /// failing twice, the slot is leased again (as its next attempt, a fresh id) once the
    /// store writes; when that lease expires it is the slot's first spent attempt, so the
    /// slot is leased once more, not failed. Before, the ungiven leases stayed out until
    /// they expired, and each expiry spent an attempt (here: the slot failed).
    #[tokio::test]
    async fn leases_the_store_could_not_record_go_back_without_spending_an_attempt() {
        let config = crate::config::CoordinatorConfig {
            episodes_per_iteration: 1,
            heldout_episodes: 0,
            max_attempts: 2,
            lease_timeout_s: 0.5,
            ..Default::default()
        };
        // A store whose first two writes fail (a full disk that is then freed).
        let (store, mut requests) = mpsc::channel::<StoreRequest>(16);
        let recorded = Arc::new(std::sync::Mutex::new(Vec::<EpisodeEvent>::new()));
        let kept = recorded.clone();
        tokio::spawn(async move {
            let mut failures = 2;
            while let Some(StoreRequest { event, reply }) = requests.recv().await {
                let result = if failures > 0 {
                    failures -= 1;
                    Err(crate::store::StoreError::Write {
                        path: "events.log".into(),
                        error: Arc::new(std::io::Error::from_raw_os_error(28)),
                    })
                } else {
                    kept.lock().unwrap().push(event.clone());
                    Ok(false)
                };
                let _ = reply.send(StoreReply { event, result });
            }
        });
        let scheduler = crate::scheduler::SchedulerHandle::spawn_with_store(
            config,
            vec![tutor_proto::Task::default()],
            Vec::new(),
            Default::default(),
            Some(&store),
            None,
        );
        let service = RolloutService {
            scheduler: scheduler.clone(),
            store,
            counters: Default::default(),
        };
        let (worker, secret, _) = scheduler.register_worker("w".into(), 1).await.unwrap();
        let runner = scheduler.clone();
        let iteration = tokio::spawn(async move { runner.run_iteration(0, 1.0).await });
        let request = || {
            Request::new(LeaseRequest {
                worker_id: worker.clone(),
                max_episodes: 1,
            })
        };
        let mut failed_calls = 0;
        let end = Instant::now() + Duration::from_secs(10);
        let granted = loop {
            assert!(Instant::now() < end, "no lease within 10 s");
            match service.lease(request()).await {
                Ok(r) if r.get_ref().leases.is_empty() => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                Ok(r) => break r.into_inner().leases,
                Err(status) => {
                    assert_eq!(status.code(), tonic::Code::Unavailable, "{status}");
                    assert!(status.message().contains("could not record"), "{status}");
                    let s = scheduler.snapshot().await.unwrap();
                    assert_eq!(
                        (
                            s.outstanding_leases,
                            s.pending_episodes,
                            s.lease_expiries_total
                        ),
                        (0, 1, 0),
                        "the lease went back to the queue: {s:?}"
                    );
                    failed_calls += 1;
                }
            }
        };
        assert_eq!(failed_calls, 2, "two failed calls, then the lease");
        assert_eq!(granted.len(), 1);
        // The third attempt's id: the two withdrawn ones are never leased again.
        assert!(
            granted[0].episode_id.ends_with("-g0a2"),
            "{}",
            granted[0].episode_id
        );
        assert_eq!(recorded.lock().unwrap().len(), 1, "one grant recorded");
        assert!(matches!(
            recorded.lock().unwrap()[0].event,
            Some(episode_event::Event::LeaseGranted(_))
        ));
        // The withdrawn ids are refused, even from the worker they were granted to.
        let withdrawn = granted[0].episode_id.replace("-g0a2", "-g0a0");
        let mut outcome = event(&withdrawn, None);
        outcome.worker_id = worker.clone();
        let admission = scheduler
            .admit(&outcome, Some((worker.clone(), secret.clone())))
            .await;
        assert!(
            matches!(&admission, crate::scheduler::Admission::Refused(why) if why.contains("withdrawn")),
            "{admission:?}"
        );
        // Nobody renews the granted lease: it expires, the slot's first spent attempt of
        // two (the withdrawn ones spent none), so the slot is leased again as a3, not
        // failed.
        let end = Instant::now() + Duration::from_secs(15);
        let again = loop {
            assert!(
                Instant::now() < end,
                "the slot was not leased again within 15 s"
            );
            match service.lease(request()).await {
                Ok(r) if !r.get_ref().leases.is_empty() => break r.into_inner().leases,
                Ok(r) => assert!(!r.get_ref().run_finished),
                Err(status) => panic!("{status}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(
            again[0].episode_id.ends_with("-g0a3"),
            "{}",
            again[0].episode_id
        );
        let expiries: Vec<u32> = recorded
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match &e.event {
                Some(episode_event::Event::LeaseExpired(x)) => Some(x.attempts),
                _ => None,
            })
            .collect();
        assert_eq!(expiries, vec![1], "one attempt spent, recorded as such");
        outcome.episode_id = again[0].episode_id.clone();
        assert_eq!(
            scheduler.admit(&outcome, Some((worker, secret))).await,
            crate::scheduler::Admission::Store
        );
        scheduler.stored(outcome).await;
        let rollouts = tokio::time::timeout(Duration::from_secs(10), iteration)
            .await
            .expect("the iteration ends")
            .unwrap()
            .unwrap();
        assert_eq!((rollouts.train.len(), rollouts.failed_slots), (1, 0));
    }

    /// A worker cannot write the coordinator's records: a lease expiry it sends (which,
    /// replayed after a restart, would spend another worker's attempt or fail its slot)
    /// and a turn under the expiry's reserved index are refused with a reason; ordinary
    /// turns and outcomes are not.
    #[test]
    fn a_worker_cannot_write_the_coordinators_records() {
        let forged = EpisodeEvent {
            episode_id: "it000-train0000-g0a0".into(),
            worker_id: "coordinator".into(),
            event: Some(episode_event::Event::LeaseExpired(
                tutor_proto::LeaseExpired {
                    reason: "forged".into(),
                    attempts: 99,
                },
            )),
        };
        let why = refusal(&forged).expect("a worker's lease expiry is refused");
        assert!(why.contains("coordinator itself"), "{why}");
        // A grant it sends would, replayed after a restart, hand it another worker's lease.
        let granted = EpisodeEvent {
            episode_id: "it000-train0000-g0a0".into(),
            worker_id: "coordinator".into(),
            event: Some(episode_event::Event::LeaseGranted(
                tutor_proto::LeaseGranted {
                    worker_id: "w-evil".into(),
                },
            )),
        };
        let why = refusal(&granted).expect("a worker's lease grant is refused");
        assert!(why.contains("coordinator itself"), "{why}");
        for index in [
            tutor_proto::TURN_INDEX_LEASE_EXPIRED,
            tutor_proto::TURN_INDEX_LEASE_GRANTED,
        ] {
            let mut reserved = event("e1", Some(0));
            if let Some(episode_event::Event::Turn(t)) = reserved.event.as_mut() {
                t.turn_index = index;
            }
            let why = refusal(&reserved).expect("the reserved turn index is refused");
            assert!(why.contains("reserved"), "{why}");
        }
        assert_eq!(refusal(&event("e1", Some(3))), None);
        assert_eq!(refusal(&event("e1", None)), None);
    }

    /// An event the coordinator will never store (no payload; over MAX_EVENT_BYTES) is
    /// acknowledged as refused with its reason, and the stream goes on: the events after
    /// it are stored. Before, the first ended the stream and the worker replayed it
    /// first on every reconnect, forever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_event_that_cannot_be_stored_is_refused_and_the_stream_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let (mut client, stop, server) = start_coordinator(dir.path()).await;

        let empty = EpisodeEvent {
            episode_id: "e0".into(),
            worker_id: "w".into(),
            event: None,
        };
        let mut huge = event("e1", Some(0));
        if let Some(episode_event::Event::Turn(t)) = huge.event.as_mut() {
            t.observation = "x".repeat(tutor_proto::MAX_EVENT_BYTES + 1);
        }
        let sent = vec![empty, huge, event("e1", Some(1)), event("e1", None)];
        let mut acks = client
            .stream_events(tokio_stream::iter(sent))
            .await
            .unwrap()
            .into_inner();
        let mut got = Vec::new();
        while let Some(a) = tokio::time::timeout(Duration::from_secs(30), acks.message())
            .await
            .expect("an ack within 30 s")
            .unwrap()
        {
            got.push((a.episode_id, a.turn_index, a.refused));
        }
        assert_eq!(got.len(), 4, "{got:?}");
        assert_eq!((got[0].0.as_str(), got[0].1), ("e0", 0));
        assert!(
            got[0].2.contains("neither a turn nor an outcome"),
            "{got:?}"
        );
        assert_eq!((got[1].0.as_str(), got[1].1), ("e1", 0));
        assert!(got[1].2.contains("MAX_EVENT_BYTES"), "{}", got[1].2);
        assert_eq!(
            got[2..],
            [
                ("e1".to_string(), 1, String::new()),
                ("e1".to_string(), TURN_INDEX_OUTCOME, String::new())
            ]
        );

        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
        let (stored, _) =
            crate::store::scan(&dir.path().join("run/trajectories/events.log")).unwrap();
        let keys: Vec<_> = stored.iter().filter_map(event_key).collect();
        assert_eq!(
            keys,
            [
                ("e1".to_string(), 1),
                ("e1".to_string(), TURN_INDEX_OUTCOME)
            ]
        );
    }
}
