//! A coordinator restarted on its run directory carries on where the previous one
//! stopped: same iteration, same datasets, completed episodes not run or counted again.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use tutor_coordinator::state::{state_path, Phase, RunState};
use tutor_coordinator::CoordinatorConfig;

fn config() -> CoordinatorConfig {
    CoordinatorConfig {
        iterations: 2,
        episodes_per_iteration: 4,
        heldout_episodes: 2,
        lease_timeout_s: 3.0,
        sync_timeout_s: 2.0,
        epochs_per_iteration: 1,
        shutdown_grace_s: 0.3,
        ..Default::default()
    }
}

/// "it000-train0002-g0a1" → "it000-train0002": the slot the episode was leased for.
fn slot_of(id: &str) -> String {
    id.rsplit_once('-').unwrap().0.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_mid_iteration_runs_and_counts_every_episode_once() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let learner = FakeLearner::default();
    let learner_addr = start_learner(learner.clone()).await;
    let (train, heldout) = (tasks("t", 3), tasks("h", 2));

    // First coordinator: two episodes complete, one in progress, one leased and silent.
    let a = start_coordinator(
        &run_dir,
        &learner_addr,
        config(),
        train.clone(),
        heldout.clone(),
    )
    .await;
    let mut w1 = Worker::register(&a.addr, "w1").await;
    let leases = w1.lease_n(4).await;
    let w1_id = w1.id.clone();
    for l in &leases[..2] {
        assert_eq!(w1.send(episode(l, &w1_id)).await.len(), 3);
    }
    let in_progress = &leases[2];
    w1.send(vec![turn(in_progress, &w1_id, 0)]).await;
    let silent = &leases[3];
    a.stop.send(()).unwrap();
    a.task.await.unwrap().unwrap();
    let st = RunState::load(&state_path(&run_dir)).unwrap().unwrap();
    assert_eq!(
        (st.generation, st.iteration, st.phase),
        (0, 0, Phase::Rollout)
    );

    // Second coordinator on the same directory.
    let b = start_coordinator(&run_dir, &learner_addr, config(), train, heldout).await;
    // Another registered worker cannot complete an attempt leased to w1 before the
    // restart: the first coordinator recorded whose lease it was.
    let mut intruder = Worker::register(&b.addr, "intruder").await;
    let intruder_id = intruder.id.clone();
    let acks = intruder.send(vec![outcome(silent, &intruder_id, 0)]).await;
    assert!(
        acks.len() == 1
            && acks[0]
                .refused
                .contains(&format!("leased to worker {w1_id}")),
        "{acks:?}"
    );
    // The worker that was running an episode carries on with it.
    let mut w1 = w1.reconnect(&b.addr).await;
    w1.heartbeat(vec![in_progress.episode_id.clone()], 0).await;
    let acks = w1
        .send(vec![
            turn(in_progress, &w1_id, 0), // replayed: unacked when the first one stopped
            turn(in_progress, &w1_id, 1),
            outcome(in_progress, &w1_id, 2),
        ])
        .await;
    assert_eq!(
        acks.iter().map(|a| a.duplicate).collect::<Vec<_>>(),
        vec![true, false, false]
    );
    let mut w2 = Worker::register(&b.addr, "w2").await;
    let ran = work_until_finished(&mut w2, Duration::from_secs(60)).await;
    b.stop.send(()).unwrap();
    b.task.await.unwrap().unwrap();

    // New leases carry the new generation; completed and in-progress slots were not
    // leased again, the silent lease was.
    assert!(ran.iter().all(|id| id.contains("-g1a")), "{ran:?}");
    let ran_slots: Vec<String> = ran.iter().map(|id| slot_of(id)).collect();
    for l in &leases[..3] {
        assert!(
            !ran_slots.contains(&slot_of(&l.episode_id)),
            "{} ran again: {ran:?}",
            l.episode_id
        );
    }
    assert!(ran_slots.contains(&slot_of(&silent.episode_id)), "{ran:?}");

    // Every stored episode is complete, and every slot of the schedule has exactly one
    // outcome: 2 iterations × (4 training + 2 held-out), then the final evaluation's 2
    // held-out episodes.
    let outcomes = stored_outcomes(&run_dir);
    let episodes = stored_episodes(&run_dir);
    assert_eq!(
        episodes.iter().cloned().collect::<Vec<_>>(),
        outcomes.keys().cloned().collect::<Vec<_>>(),
        "an episode without an outcome is in the store"
    );
    let mut per_slot: BTreeMap<String, usize> = BTreeMap::new();
    for (id, n) in &outcomes {
        assert_eq!(*n, 1, "{id}");
        *per_slot.entry(slot_of(id)).or_insert(0) += 1;
    }
    assert_eq!(per_slot.len(), 14, "{per_slot:?}");
    assert_eq!(
        per_slot
            .keys()
            .filter(|s| s.starts_with("it002-eval"))
            .count(),
        2,
        "the final evaluation: {per_slot:?}"
    );
    assert!(per_slot.values().all(|n| *n == 1), "{per_slot:?}");
    assert_eq!(
        per_slot.keys().filter(|s| s.contains("train")).count(),
        8,
        "{per_slot:?}"
    );

    // Training saw the datasets rebuilt from the store: iteration 0's four episodes
    // (two of them completed before the restart), then all eight (DAgger aggregation).
    let log = learner.log.lock().unwrap();
    let trained: Vec<(u32, usize)> = log.trained.iter().map(|(i, e)| (*i, e.len())).collect();
    assert_eq!(trained, vec![(0, 4), (1, 8)]);
    for l in &leases[..2] {
        assert!(log.trained[0].1.contains(&l.episode_id));
    }
    assert!(log.trained[0].1.contains(&in_progress.episode_id));
    let st = RunState::load(&state_path(&run_dir)).unwrap().unwrap();
    assert_eq!((st.generation, st.phase), (1, Phase::Finished));
    // The first start recorded its leases, and the restart kept that.
    assert_eq!(st.lease_records_from, Some(0));
    assert_eq!(st.policy_version, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_after_publishing_does_not_train_the_iteration_again() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let learner = FakeLearner::default();
    let learner_addr = start_learner(learner.clone()).await;
    let (train, heldout) = (tasks("t", 3), tasks("h", 2));
    let a = start_coordinator(
        &run_dir,
        &learner_addr,
        config(),
        train.clone(),
        heldout.clone(),
    )
    .await;
    let mut w1 = Worker::register(&a.addr, "w1").await;
    let id = w1.id.clone();
    for l in w1.lease_n(6).await {
        w1.send(episode(&l, &id)).await;
    }
    // Wait until iteration 0 is trained and published.
    let end = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let st = RunState::load(&state_path(&run_dir)).unwrap().unwrap();
        if st.phase == Phase::Published || st.iteration == 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < end,
            "iteration 0 never published"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.stop.send(()).unwrap();
    a.task.await.unwrap().unwrap();
    let run_id = RunState::load(&state_path(&run_dir))
        .unwrap()
        .unwrap()
        .run_id;
    assert!(run_id.starts_with("run-") && run_id.len() > 10, "{run_id}");

    let b = start_coordinator(&run_dir, &learner_addr, config(), train, heldout).await;
    let mut w2 = Worker::register(&b.addr, "w2").await;
    let ran = work_until_finished(&mut w2, Duration::from_secs(60)).await;
    b.stop.send(()).unwrap();
    b.task.await.unwrap().unwrap();
    // Iteration 1, then the final evaluation (held-out only, as iteration 2).
    assert!(
        ran.iter()
            .all(|id| id.starts_with("it001-") || id.starts_with("it002-eval")),
        "{ran:?}"
    );
    assert_eq!(ran.len(), 8, "{ran:?}");
    assert!(run_dir.join("final_eval.json").exists());
    let log = learner.log.lock().unwrap();
    let trained: Vec<(u32, usize)> = log.trained.iter().map(|(i, e)| (*i, e.len())).collect();
    assert_eq!(trained, vec![(0, 4), (1, 8)]);
    // Every batch, before and after the restart, carried the run's one id.
    assert_eq!(
        log.run_ids,
        std::collections::BTreeSet::from([run_id.clone()])
    );
    assert_eq!(
        RunState::load(&state_path(&run_dir))
            .unwrap()
            .unwrap()
            .run_id,
        run_id
    );
    let rows = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let iterations: Vec<u64> = rows
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["iteration"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(iterations, vec![0, 1]);
}

/// The summaries and the end a Control.WatchRun stream delivers, until `Finished`.
async fn watch_to_the_end(addr: String) -> (Vec<tutor_proto::IterationSummary>, bool) {
    use tutor_proto::control_client::ControlClient;
    use tutor_proto::run_event::Event;
    let mut stream = ControlClient::connect(addr)
        .await
        .unwrap()
        .watch_run(tutor_proto::WatchRunRequest {})
        .await
        .unwrap()
        .into_inner();
    let mut summaries = Vec::new();
    while let Some(ev) = stream.message().await.unwrap() {
        match ev.event {
            Some(Event::Iteration(s)) => summaries.push(s),
            Some(Event::Finished(f)) => return (summaries, f.error.is_empty()),
            _ => {}
        }
    }
    (summaries, false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_of_a_restarted_coordinator_gets_the_earlier_iterations() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let learner_addr = start_learner(FakeLearner::default()).await;
    let (train, heldout) = (tasks("t", 3), tasks("h", 2));
    let a = start_coordinator(
        &run_dir,
        &learner_addr,
        config(),
        train.clone(),
        heldout.clone(),
    )
    .await;
    let mut w1 = Worker::register(&a.addr, "w1").await;
    let id = w1.id.clone();
    for l in w1.lease_n(6).await {
        w1.send(episode(&l, &id)).await;
    }
    // Iteration 0 is over once its metrics row is written and iteration 1 begins.
    let end = std::time::Instant::now() + Duration::from_secs(30);
    while RunState::load(&state_path(&run_dir))
        .unwrap()
        .unwrap()
        .iteration
        < 1
    {
        assert!(std::time::Instant::now() < end, "iteration 0 never ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.stop.send(()).unwrap();
    a.task.await.unwrap().unwrap();
    let before = tutor_coordinator::driver::read_summaries(&run_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(before.len(), 1);
    assert_eq!(before[0].episodes, 4);

    // A torn last line (a crash mid-append) is skipped, not fatal.
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(run_dir.join("metrics.jsonl"))
            .unwrap();
        write!(f, "{{\"iteration\": 1, \"be").unwrap();
    }
    let b = start_coordinator(&run_dir, &learner_addr, config(), train, heldout).await;
    let watcher = tokio::spawn(watch_to_the_end(b.addr.clone()));
    // ...and one that joins after the run ended sees it all too.
    let mut w2 = Worker::register(&b.addr, "w2").await;
    work_until_finished(&mut w2, Duration::from_secs(60)).await;
    let (seen, ok) = watcher.await.unwrap();
    let (late, late_ok) = watch_to_the_end(b.addr.clone()).await;
    b.stop.send(()).unwrap();
    b.task.await.unwrap().unwrap();

    for (what, summaries, ok) in [("watcher", &seen, ok), ("late watcher", &late, late_ok)] {
        assert!(ok, "{what}: the run finished without error");
        let iterations: Vec<u32> = summaries.iter().map(|s| s.iteration).collect();
        assert_eq!(
            iterations,
            vec![0, 1],
            "{what}: each iteration once, in order"
        );
        assert_eq!(summaries[0], before[0], "{what}: iteration 0 as recorded");
        assert_eq!(summaries[1].episodes, 4, "{what}");
    }
}
