//! A fake learner and a scripted worker that speak the real gRPC contracts on loopback,
//! for tests that start whole coordinators.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};
use tutor_coordinator::{CoordinatorConfig, ServeOptions};
use tutor_proto::learner_server::{Learner, LearnerServer};
use tutor_proto::rollout_client::RolloutClient;
use tutor_proto::{
    episode_event, EpisodeEvent, EpisodeLease, EpisodeOutcome, EventAck, HeartbeatRequest,
    LearnerStatus, LearnerStatusRequest, LeaseRequest, LeaseResponse, OutcomeStatus,
    RegisterRequest, SaveCheckpointRequest, SaveCheckpointResponse, Task, TrainBatch,
    TrainProgress, TurnRecord,
};

/// What the fake learner was asked to do.
#[derive(Debug, Default)]
pub struct LearnerLog {
    pub version: u64,
    /// Per Train call: the iteration and the episode ids of its examples.
    pub trained: Vec<(u32, std::collections::BTreeSet<String>)>,
    /// The run ids the batches carried.
    pub run_ids: std::collections::BTreeSet<String>,
}

#[derive(Clone, Default)]
pub struct FakeLearner {
    pub log: Arc<Mutex<LearnerLog>>,
    /// How long each training phase takes before its first step.
    pub train_delay: Duration,
}

type ProgressStream = Pin<Box<dyn Stream<Item = Result<TrainProgress, Status>> + Send>>;

#[tonic::async_trait]
impl Learner for FakeLearner {
    type TrainStream = ProgressStream;

    async fn train(
        &self,
        request: Request<Streaming<TrainBatch>>,
    ) -> Result<Response<Self::TrainStream>, Status> {
        let mut batches = request.into_inner();
        let log = self.log.clone();
        let (tx, rx) = mpsc::channel(4);
        let delay = self.train_delay;
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let mut episodes = std::collections::BTreeSet::new();
            while let Ok(Some(b)) = batches.message().await {
                log.lock().unwrap().run_ids.insert(b.run_id.clone());
                episodes.extend(b.examples.iter().map(|e| e.episode_id.clone()));
                let mut p = TrainProgress {
                    iteration: b.iteration,
                    step: b.step,
                    loss: 1.0,
                    label_tokens: b.examples.len() as u64,
                    ..Default::default()
                };
                if b.publish {
                    let mut log = log.lock().unwrap();
                    log.version += 1;
                    log.trained
                        .push((b.iteration, std::mem::take(&mut episodes)));
                    p.published_version = log.version;
                    p.published_sha256 = format!("sha-{}", log.version);
                }
                if tx.send(Ok(p)).await.is_err() {
                    return;
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
        let v = self.log.lock().unwrap().version;
        Ok(Response::new(LearnerStatus {
            latest_version: v,
            latest_sha256: format!("sha-{v}"),
            optimizer_steps: 0,
        }))
    }

    async fn save_checkpoint(
        &self,
        request: Request<SaveCheckpointRequest>,
    ) -> Result<Response<SaveCheckpointResponse>, Status> {
        Ok(Response::new(SaveCheckpointResponse {
            dir: request.into_inner().dir,
            version: self.log.lock().unwrap().version,
        }))
    }
}

/// Serves the fake learner on loopback; returns its endpoint.
pub async fn start_learner(learner: FakeLearner) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(LearnerServer::new(learner))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    format!("http://{addr}")
}

pub fn tasks(prefix: &str, n: usize) -> Vec<Task> {
    (0..n)
        .map(|i| Task {
            instance_id: format!("{prefix}{i}"),
            ..Default::default()
        })
        .collect()
}

/// A coordinator running in this process until `stop` is sent.
pub struct Coordinator {
    pub addr: String,
    pub stop: oneshot::Sender<()>,
    pub task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

pub async fn start_coordinator(
    run_dir: &Path,
    learner: &str,
    config: CoordinatorConfig,
    train: Vec<Task>,
    heldout: Vec<Task>,
) -> Coordinator {
    let addr_file: PathBuf = run_dir.with_extension(format!("addr{}", rand_suffix()));
    let _ = std::fs::remove_file(&addr_file);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(tutor_coordinator::serve(
        ServeOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            run_dir: run_dir.to_path_buf(),
            learner_endpoint: learner.to_string(),
            config,
            train_tasks: train,
            heldout_tasks: heldout,
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
    Coordinator {
        addr: format!("http://{addr}"),
        stop,
        task,
    }
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// A worker driven step by step by the test.
pub struct Worker {
    pub client: RolloutClient<Channel>,
    pub id: String,
    /// What proves `id` on the event stream (from the Register answer).
    pub secret: String,
}

impl Worker {
    pub async fn register(addr: &str, name: &str) -> Self {
        let mut client = RolloutClient::connect(addr.to_string()).await.unwrap();
        let registered = client
            .register(RegisterRequest {
                worker_name: name.into(),
                capacity: 4,
            })
            .await
            .unwrap()
            .into_inner();
        Self {
            client,
            id: registered.worker_id,
            secret: registered.worker_secret,
        }
    }

    /// The same worker (id) talking to another coordinator, as after a restart.
    pub async fn reconnect(&self, addr: &str) -> Self {
        Self {
            client: RolloutClient::connect(addr.to_string()).await.unwrap(),
            id: self.id.clone(),
            secret: self.secret.clone(),
        }
    }

    pub async fn lease(&mut self, max: u32) -> LeaseResponse {
        self.client
            .lease(LeaseRequest {
                worker_id: self.id.clone(),
                max_episodes: max,
            })
            .await
            .unwrap()
            .into_inner()
    }

    /// Leases until `n` leases came back (the driver may not have started the iteration).
    pub async fn lease_n(&mut self, n: usize) -> Vec<EpisodeLease> {
        let end = Instant::now() + Duration::from_secs(30);
        let mut got = Vec::new();
        while got.len() < n {
            assert!(Instant::now() < end, "only {} leases in 30 s", got.len());
            got.extend(self.lease((n - got.len()) as u32).await.leases);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        got
    }

    /// Returns the latest policy version.
    pub async fn heartbeat(&mut self, active: Vec<String>, loaded: u64) -> u64 {
        self.client
            .heartbeat(HeartbeatRequest {
                worker_id: self.id.clone(),
                active_episodes: active,
                loaded_version: loaded,
            })
            .await
            .unwrap()
            .into_inner()
            .latest
            .map(|p| p.version)
            .unwrap_or(0)
    }

    /// Streams the events on one stream and returns the acks.
    pub async fn send(&mut self, events: Vec<EpisodeEvent>) -> Vec<EventAck> {
        let n = events.len();
        let mut request = tonic::Request::new(tokio_stream::iter(events));
        let md = request.metadata_mut();
        md.insert(tutor_proto::WORKER_ID_METADATA, self.id.parse().unwrap());
        md.insert(
            tutor_proto::WORKER_SECRET_METADATA,
            self.secret.parse().unwrap(),
        );
        let mut acks = self
            .client
            .stream_events(request)
            .await
            .unwrap()
            .into_inner();
        let mut got = Vec::new();
        while got.len() < n {
            match acks.message().await.unwrap() {
                Some(a) => got.push(a),
                None => break,
            }
        }
        got
    }
}

pub fn turn(lease: &EpisodeLease, worker: &str, i: u32) -> EpisodeEvent {
    EpisodeEvent {
        episode_id: lease.episode_id.clone(),
        worker_id: worker.into(),
        event: Some(episode_event::Event::Turn(TurnRecord {
            turn_index: i,
            context_delta_tokens: vec![1, 2, 3],
            teacher_tokens: vec![10 + i, 11],
            policy_version: lease.policy.as_ref().map(|p| p.version).unwrap_or(0),
            ..Default::default()
        })),
    }
}

pub fn outcome(lease: &EpisodeLease, worker: &str, turns: u32) -> EpisodeEvent {
    EpisodeEvent {
        episode_id: lease.episode_id.clone(),
        worker_id: worker.into(),
        event: Some(episode_event::Event::Outcome(EpisodeOutcome {
            num_turns: turns,
            status: OutcomeStatus::Unresolved as i32,
            purpose: lease.purpose,
            iteration: lease.iteration,
            instance_id: lease.task.as_ref().unwrap().instance_id.clone(),
            policy_version: lease.policy.as_ref().map(|p| p.version).unwrap_or(0),
            ..Default::default()
        })),
    }
}

/// Two turns and the outcome of a leased episode.
pub fn episode(lease: &EpisodeLease, worker: &str) -> Vec<EpisodeEvent> {
    vec![
        turn(lease, worker, 0),
        turn(lease, worker, 1),
        outcome(lease, worker, 2),
    ]
}

/// Leases and completes episodes until the coordinator says the run is finished,
/// heartbeating with the newest version loaded. Returns the episode ids it ran.
pub async fn work_until_finished(w: &mut Worker, timeout: Duration) -> Vec<String> {
    let end = Instant::now() + timeout;
    let mut loaded = 0;
    let mut ran = Vec::new();
    loop {
        assert!(
            Instant::now() < end,
            "the run did not finish in {timeout:?}"
        );
        loaded = w.heartbeat(Vec::new(), loaded).await;
        let resp = w.lease(4).await;
        if resp.run_finished {
            return ran;
        }
        for l in &resp.leases {
            let id = w.id.clone();
            let acks = w.send(episode(l, &id)).await;
            assert_eq!(acks.len(), 3);
            ran.push(l.episode_id.clone());
        }
        if resp.leases.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Outcomes in the store by episode id, in store order.
pub fn stored_outcomes(run_dir: &Path) -> BTreeMap<String, usize> {
    let (events, _) =
        tutor_coordinator::store::scan(&run_dir.join("trajectories/events.log")).unwrap();
    let mut out = BTreeMap::new();
    for ev in events {
        if matches!(ev.event, Some(episode_event::Event::Outcome(_))) {
            *out.entry(ev.episode_id).or_insert(0) += 1;
        }
    }
    out
}

/// Every stored episode id (with a turn or an outcome).
pub fn stored_episodes(run_dir: &Path) -> std::collections::BTreeSet<String> {
    let (events, _) =
        tutor_coordinator::store::scan(&run_dir.join("trajectories/events.log")).unwrap();
    events
        .into_iter()
        .filter(|e| {
            matches!(
                e.event,
                Some(episode_event::Event::Turn(_) | episode_event::Event::Outcome(_))
            )
        })
        .map(|e| e.episode_id)
        .collect()
}
