//! The coordinator's gRPC services: Rollout (workers) and Control (operators, `tutor run`).

use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::sync::{broadcast, mpsc, oneshot, Notify};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use tutor_proto::control_server::Control;
use tutor_proto::rollout_server::Rollout;
use tutor_proto::{
    run_event, EpisodeEvent, EventAck, HeartbeatRequest, HeartbeatResponse, LeaseRequest,
    LeaseResponse, RegisterRequest, RegisterResponse, RunEvent, ShutdownRequest, ShutdownResponse,
    WatchRunRequest,
};

use crate::metrics::EventCounters;
use crate::scheduler::{SchedulerHandle, HEARTBEAT_INTERVAL};
use crate::store::{event_key, StoreRequest};

/// Run events for watchers. Iteration summaries and the final event are kept, so a
/// watcher that connects late still sees the whole table.
#[derive(Clone)]
pub struct EventLog {
    tx: broadcast::Sender<RunEvent>,
    kept: Arc<Mutex<Vec<RunEvent>>>,
}

impl Default for EventLog {
    fn default() -> Self {
        Self {
            tx: broadcast::channel(1024).0,
            kept: Default::default(),
        }
    }
}

impl EventLog {
    pub fn publish(&self, ev: RunEvent) {
        let mut kept = self.kept.lock().expect("event log lock");
        if matches!(
            ev.event,
            Some(run_event::Event::Iteration(_)) | Some(run_event::Event::Finished(_))
        ) {
            kept.push(ev.clone());
        }
        let _ = self.tx.send(ev);
    }

    fn subscribe(&self) -> (Vec<RunEvent>, broadcast::Receiver<RunEvent>) {
        let kept = self.kept.lock().expect("event log lock");
        (kept.clone(), self.tx.subscribe())
    }
}

#[derive(Clone)]
pub struct RolloutService {
    pub scheduler: SchedulerHandle,
    pub store: mpsc::Sender<StoreRequest>,
    pub counters: Arc<EventCounters>,
}

type AckStream = Pin<Box<dyn Stream<Item = Result<EventAck, Status>> + Send>>;

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
    /// event is acknowledged as a duplicate and changes nothing.
    async fn stream_events(
        &self,
        request: Request<Streaming<EpisodeEvent>>,
    ) -> Result<Response<Self::StreamEventsStream>, Status> {
        let mut events = request.into_inner();
        let store = self.store.clone();
        let scheduler = self.scheduler.clone();
        let counters = self.counters.clone();
        let (tx, rx) = mpsc::channel(256);
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
                    let _ = tx
                        .send(Err(Status::invalid_argument(
                            "event without a turn or outcome",
                        )))
                        .await;
                    return;
                };
                let (reply, stored) = oneshot::channel();
                if store
                    .send(StoreRequest {
                        event: ev.clone(),
                        reply,
                    })
                    .await
                    .is_err()
                {
                    let _ = tx
                        .send(Err(Status::unavailable("trajectory store stopped")))
                        .await;
                    return;
                }
                let duplicate = match stored.await {
                    Ok(Ok(d)) => d,
                    Ok(Err(e)) => {
                        let _ = tx.send(Err(Status::internal(e))).await;
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
                    scheduler.stored(ev).await;
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
