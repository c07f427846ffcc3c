//! The coordinator's gRPC services: Rollout (workers) and Control (operators, `tutor run`).

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{broadcast, mpsc, oneshot, Notify};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use tutor_proto::control_server::Control;
use tutor_proto::rollout_server::Rollout;
use tutor_proto::{
    EpisodeEvent, EventAck, HeartbeatRequest, HeartbeatResponse, LeaseRequest, LeaseResponse,
    RegisterRequest, RegisterResponse, RunEvent, ShutdownRequest, ShutdownResponse,
    WatchRunRequest,
};

use crate::counters::EventCounters;
use crate::run_events::EventLog;
use crate::scheduler::{SchedulerHandle, HEARTBEAT_INTERVAL};
use crate::store::{event_key, StoreReply, StoreRequest};

#[derive(Clone)]
pub struct RolloutService {
    pub scheduler: SchedulerHandle,
    pub store: mpsc::Sender<StoreRequest>,
    pub counters: Arc<EventCounters>,
}

type AckStream = Pin<Box<dyn Stream<Item = Result<EventAck, Status>> + Send>>;

/// Events of one stream handed to the store and not yet acknowledged, at most.
const STREAM_PIPELINE: usize = 256;

/// An event handed to the store, waiting for its commit; or the error that ends the
/// stream after the acks before it.
type Waiting = Result<InStore, Status>;

struct InStore {
    episode_id: String,
    turn_index: u32,
    stored: oneshot::Receiver<StoreReply>,
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
        let (worker_id, policy) = self
            .scheduler
            .register(r.worker_name, r.capacity.max(1))
            .await
            .ok_or_else(|| Status::unavailable("coordinator is shutting down"))?;
        Ok(Response::new(RegisterResponse {
            worker_id,
            heartbeat_interval_ms: HEARTBEAT_INTERVAL.as_millis() as u64,
            policy: Some(policy),
        }))
    }

    async fn lease(
        &self,
        request: Request<LeaseRequest>,
    ) -> Result<Response<LeaseResponse>, Status> {
        let r = request.into_inner();
        let resp = self
            .scheduler
            .lease(r.worker_id, r.max_episodes.min(64))
            .await
            .ok_or_else(|| Status::unavailable("coordinator is shutting down"))?;
        Ok(Response::new(resp))
    }

    type StreamEventsStream = AckStream;

    /// Each event is acknowledged only after the store made it durable; a replayed
    /// event is acknowledged as a duplicate and changes nothing. Events are pipelined:
    /// the next is handed to the store while earlier ones wait for their group commit,
    /// so one stream's events share fsyncs; acks (and a final error) keep stream order.
    async fn stream_events(
        &self,
        request: Request<Streaming<EpisodeEvent>>,
    ) -> Result<Response<Self::StreamEventsStream>, Status> {
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
                let Some((episode_id, turn_index)) = event_key(&ev) else {
                    let _ = waiting_tx
                        .send(Err(Status::invalid_argument(
                            "event without a turn or outcome",
                        )))
                        .await;
                    return;
                };
                let (reply, stored) = oneshot::channel();
                // An outcome of an attempt whose slot another attempt completed (a lease
                // that expired, or was handed out again after a coordinator restart,
                // while its worker kept going) is acknowledged and dropped: every slot is
                // completed exactly once in the store.
                if turn_index == tutor_proto::TURN_INDEX_OUTCOME
                    && !claims.claim_outcome(ev.clone()).await
                {
                    tracing::info!(episode = %episode_id, "outcome of a superseded attempt: acknowledged, not stored");
                    let _ = reply.send(StoreReply {
                        event: ev,
                        result: Ok(true),
                    });
                } else if store.send(StoreRequest { event: ev, reply }).await.is_err() {
                    let _ = waiting_tx
                        .send(Err(Status::unavailable("trajectory store stopped")))
                        .await;
                    return;
                }
                let waiting = Ok(InStore {
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
                    Ok(w) => w,
                    Err(status) => {
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

    /// A worker that sends everything before reading any ack: the events travel through
    /// the store pipelined, yet the acks come back in stream order, the replays in the
    /// same stream are duplicates, and the store holds each event once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pipelined_stream_acks_in_order_and_flags_replays() {
        let dir = tempfile::tempdir().unwrap();
        let addr_file = dir.path().join("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(crate::serve(
            ServeOptions {
                listen: "127.0.0.1:0".parse().unwrap(),
                run_dir: dir.path().join("run"),
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
        let mut client = RolloutClient::connect(format!("http://{addr}"))
            .await
            .unwrap();

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
}
