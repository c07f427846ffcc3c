//! The worker's event sink against a real coordinator: an event too large for the
//! coordinator's message limit (a patch of hundreds of MB from a `python -m venv venv`
//! inside the repository) must not wedge the stream.

use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tutor_coordinator::{serve, ServeOptions};
use tutor_proto::auth::ClientAuth;
use tutor_proto::rollout_client::RolloutClient;
use tutor_proto::{
    episode_event, EpisodeEvent, EpisodeOutcome, OutcomeStatus, TurnRecord, TURN_INDEX_OUTCOME,
};
use tutor_rollout_worker::sink::EventSink;

fn outcome(ep: &str, patch: String) -> EpisodeEvent {
    EpisodeEvent {
        episode_id: ep.into(),
        worker_id: "w".into(),
        event: Some(episode_event::Event::Outcome(EpisodeOutcome {
            status: OutcomeStatus::Unresolved as i32,
            patch,
            submitted: true,
            ..Default::default()
        })),
    }
}

fn turn(ep: &str, i: u32, observation: String) -> EpisodeEvent {
    EpisodeEvent {
        episode_id: ep.into(),
        worker_id: "w".into(),
        event: Some(episode_event::Event::Turn(TurnRecord {
            turn_index: i,
            observation,
            context_delta_tokens: vec![1, 2, 3],
            ..Default::default()
        })),
    }
}

/// A coordinator on loopback with its run directory in `dir` (stop it with the sender,
/// then await the handle), and a sink streaming to it as a worker does.
async fn coordinator_and_sink(
    dir: &std::path::Path,
) -> (
    EventSink,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    let addr_file = dir.join("addr");
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(serve(
        ServeOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            run_dir: dir.join("run"),
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
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    // As the worker builds its client.
    let client = RolloutClient::new(ClientAuth::new(None).channel(channel))
        .max_decoding_message_size(tutor_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(tutor_proto::MAX_MESSAGE_BYTES);
    let sink = EventSink::spawn(client, None);
    (sink, stop, server)
}

/// An event the coordinator refuses (here a lease expiry, which only the coordinator
/// itself writes) is acknowledged with its reason, counted, and dropped: the events
/// after it are stored, a later flush does not wait for it, and it is never replayed
/// (nor stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_event_is_dropped_and_never_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let (sink, stop, server) = coordinator_and_sink(dir.path()).await;
    let forged = EpisodeEvent {
        episode_id: "it000-train0000-g0a0".into(),
        worker_id: "coordinator".into(),
        event: Some(episode_event::Event::LeaseExpired(
            tutor_proto::LeaseExpired {
                reason: "forged".into(),
                attempts: 9,
            },
        )),
    };
    sink.events.send(forged).await.unwrap();
    sink.events
        .send(turn("ok", 0, "fine".into()))
        .await
        .unwrap();
    assert!(
        sink.flush(Duration::from_secs(30)).await,
        "the stream is wedged"
    );
    assert_eq!(
        sink.counters
            .refused
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    sink.events
        .send(outcome("ok", "diff --git a/x b/x\n".into()))
        .await
        .unwrap();
    assert!(sink.flush(Duration::from_secs(30)).await);
    assert_eq!(
        sink.counters
            .refused
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );

    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
    let (stored, _) =
        tutor_coordinator::store::scan(&dir.path().join("run/trajectories/events.log")).unwrap();
    let keys: Vec<_> = stored.iter().filter_map(tutor_proto::event_key).collect();
    assert_eq!(
        keys,
        vec![
            ("ok".to_string(), 0),
            ("ok".to_string(), TURN_INDEX_OUTCOME)
        ]
    );
}

/// An outcome with a 20 MB patch and a turn with a 20 MB observation go first, then an
/// ordinary episode. Before, the first event broke the stream (over the coordinator's
/// 16 MiB request limit) and was replayed first on every reconnect, so nothing after it
/// was ever stored. Now the outcome arrives without its patch, marked PATCH_TOO_LARGE,
/// the turn with its text cut and its tokens whole, and everything after them is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_event_is_shrunk_and_does_not_wedge_the_stream() {
    let dir = tempfile::tempdir().unwrap();
    let (sink, stop, server) = coordinator_and_sink(dir.path()).await;

    let big = 20 * 1024 * 1024;
    sink.events
        .send(outcome("venv", "+".repeat(big)))
        .await
        .unwrap();
    sink.events
        .send(turn("loud", 0, "y".repeat(big)))
        .await
        .unwrap();
    sink.events
        .send(turn("ok", 0, "fine".into()))
        .await
        .unwrap();
    sink.events
        .send(outcome("ok", "diff --git a/x b/x\n".into()))
        .await
        .unwrap();
    assert!(
        sink.flush(Duration::from_secs(60)).await,
        "events after an oversized one were never acknowledged: the stream is wedged"
    );

    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
    let (stored, _) =
        tutor_coordinator::store::scan(&dir.path().join("run/trajectories/events.log")).unwrap();
    let find = |ep: &str, turn: u32| {
        stored
            .iter()
            .find(|e| tutor_proto::event_key(e) == Some((ep.to_string(), turn)))
            .unwrap_or_else(|| panic!("{ep}/{turn} not stored"))
            .clone()
    };
    let Some(episode_event::Event::Outcome(o)) = find("venv", TURN_INDEX_OUTCOME).event else {
        panic!("not an outcome")
    };
    assert_eq!(o.status, OutcomeStatus::PatchTooLarge as i32);
    assert!(o.patch.is_empty());
    assert!(o.error.contains("left out"), "{}", o.error);
    let Some(episode_event::Event::Turn(t)) = find("loud", 0).event else {
        panic!("not a turn")
    };
    assert!(t.observation.len() < 100 * 1024, "{}", t.observation.len());
    assert!(t.observation.ends_with("bytes cut]"));
    assert_eq!(t.context_delta_tokens, [1, 2, 3]);
    find("ok", 0);
    let Some(episode_event::Event::Outcome(o)) = find("ok", TURN_INDEX_OUTCOME).event else {
        panic!("not an outcome")
    };
    assert_eq!(o.patch, "diff --git a/x b/x\n");
    assert_eq!(stored.len(), 4);
}
