//! Graceful shutdown: no new leases, the episodes in flight may finish until the grace
//! deadline, everything acknowledged is in the store, and `serve` returns Ok.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tutor_coordinator::CoordinatorConfig;

fn config(grace: f64) -> CoordinatorConfig {
    CoordinatorConfig {
        iterations: 1,
        episodes_per_iteration: 4,
        heldout_episodes: 0,
        shutdown_grace_s: grace,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_leasing_and_lets_the_episode_in_flight_finish() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let learner_addr = start_learner(FakeLearner::default()).await;
    let c = start_coordinator(&run_dir, &learner_addr, config(30.0), tasks("t", 2), vec![]).await;
    let mut w = Worker::register(&c.addr, "w").await;
    let id = w.id.clone();
    let lease = w.lease_n(1).await.remove(0);
    w.send(vec![turn(&lease, &id, 0)]).await;

    let t0 = Instant::now();
    c.stop.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!c.task.is_finished(), "stopped with an episode in flight");
    let resp = w.lease(4).await;
    assert!(resp.leases.is_empty() && !resp.run_finished, "{resp:?}");
    w.heartbeat(vec![lease.episode_id.clone()], 0).await;
    let acks = w
        .send(vec![turn(&lease, &id, 1), outcome(&lease, &id, 2)])
        .await;
    assert_eq!(acks.len(), 2);
    assert!(acks.iter().all(|a| !a.duplicate));
    tokio::time::timeout(Duration::from_secs(10), c.task)
        .await
        .expect("the coordinator did not stop once the episode finished")
        .unwrap()
        .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "waited for the grace period"
    );
    let outcomes = stored_outcomes(&run_dir);
    assert_eq!(outcomes.keys().collect::<Vec<_>>(), vec![&lease.episode_id]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_gives_up_on_leases_at_the_grace_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let learner_addr = start_learner(FakeLearner::default()).await;
    let c = start_coordinator(&run_dir, &learner_addr, config(1.0), tasks("t", 2), vec![]).await;
    let mut w = Worker::register(&c.addr, "w").await;
    let lease = w.lease_n(1).await.remove(0);
    let t0 = Instant::now();
    c.stop.send(()).unwrap();
    // The worker stays alive (heartbeats) but never finishes its episode.
    let mut beat = tokio::spawn(async move {
        loop {
            // Errors once the coordinator is gone: this worker does not care.
            let _ = w
                .client
                .heartbeat(tutor_proto::HeartbeatRequest {
                    worker_id: w.id.clone(),
                    active_episodes: vec![lease.episode_id.clone()],
                    loaded_version: 0,
                })
                .await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    tokio::time::timeout(Duration::from_secs(10), c.task)
        .await
        .expect("the coordinator outlived its grace period")
        .unwrap()
        .unwrap();
    let waited = t0.elapsed();
    assert!(waited >= Duration::from_millis(900), "{waited:?}");
    beat.abort();
    let _ = (&mut beat).await;
}
