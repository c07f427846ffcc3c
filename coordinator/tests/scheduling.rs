//! Async mode: the next iteration is generated while the learner trains, and episodes
//! that lag the learner by more than `max_staleness` are not trained on.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tutor_coordinator::{CoordinatorConfig, ScheduleMode};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_mode_overlaps_rollouts_with_training_and_drops_stale_episodes() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let learner = FakeLearner {
        train_delay: Duration::from_millis(1500),
        ..Default::default()
    };
    let learner_addr = start_learner(learner.clone()).await;
    let config = CoordinatorConfig {
        iterations: 2,
        episodes_per_iteration: 4,
        heldout_episodes: 2,
        epochs_per_iteration: 1,
        mode: ScheduleMode::Async,
        max_staleness: 0,
        shutdown_grace_s: 0.3,
        ..Default::default()
    };
    let c = start_coordinator(
        &run_dir,
        &learner_addr,
        config,
        tasks("t", 3),
        tasks("h", 2),
    )
    .await;
    let mut w = Worker::register(&c.addr, "w").await;
    let id = w.id.clone();
    for l in w.lease_n(6).await {
        w.send(episode(&l, &id)).await;
    }
    // Iteration 1 is leased while iteration 0 trains, with the version before it.
    let next = w.lease_n(6).await;
    assert!(next.iter().all(|l| l.iteration == 1), "{next:?}");
    assert!(next.iter().all(|l| l.policy.as_ref().unwrap().version == 0));
    assert!(
        learner.log.lock().unwrap().trained.is_empty(),
        "iteration 1 was leased only after training"
    );
    let end = Instant::now() + Duration::from_secs(30);
    while learner.log.lock().unwrap().version == 0 {
        assert!(Instant::now() < end, "iteration 0 never published");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for l in &next {
        w.send(episode(l, &id)).await;
    }
    work_until_finished(&mut w, Duration::from_secs(60)).await;
    c.stop.send(()).unwrap();
    c.task.await.unwrap().unwrap();

    // Iteration 1's episodes (version 0) lag the version its training started from (1)
    // by one, more than max_staleness = 0: the learner saw only iteration 0's four.
    let log = learner.log.lock().unwrap();
    let trained: Vec<(u32, usize)> = log.trained.iter().map(|(i, e)| (*i, e.len())).collect();
    assert_eq!(trained, vec![(0, 4), (1, 4)]);
    assert!(log.trained[1].1.iter().all(|e| e.starts_with("it000-")));
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let stale: Vec<u64> = rows
        .iter()
        .map(|r| r["stale_episodes"].as_u64().unwrap())
        .collect();
    assert_eq!(stale, vec![0, 4]);
}
