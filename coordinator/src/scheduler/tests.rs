//! The scheduler's own tests (recovery's are in `recovery`).

use super::*;
use tutor_proto::EpisodeOutcome;

pub(crate) fn outcome(episode_id: &str) -> EpisodeEvent {
    EpisodeEvent {
        episode_id: episode_id.to_string(),
        worker_id: "w-0".into(),
        event: Some(episode_event::Event::Outcome(EpisodeOutcome::default())),
    }
}

#[tokio::test]
async fn snapshot_counts_completions_by_purpose_expiries_and_the_queue() {
    let config = CoordinatorConfig {
        episodes_per_iteration: 2,
        heldout_episodes: 1,
        lease_timeout_s: 0.05,
        ..Default::default()
    };
    let sched = SchedulerHandle::spawn(config, vec![Task::default()], vec![Task::default()]);
    let (worker, _) = sched.register("w".into(), 4).await.unwrap();
    sched
        .set_policy(PolicyVersion {
            version: 7,
            ..Default::default()
        })
        .await;
    let runner = sched.clone();
    let iteration = tokio::spawn(async move { runner.run_iteration(0, 1.0).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let s = sched.snapshot().await.unwrap();
    assert_eq!(
        (s.policy_version, s.pending_episodes, s.live_workers),
        (7, 3, 1)
    );

    // A lease nobody renews expires and goes back to the queue.
    let first = sched.lease(worker.clone(), 1).await.unwrap();
    assert_eq!(first.leases.len(), 1);
    assert_eq!(sched.snapshot().await.unwrap().outstanding_leases, 1);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let s = sched.snapshot().await.unwrap();
    assert_eq!(
        (s.lease_expiries_total, s.pending_episodes),
        (1, 3),
        "{s:?}"
    );

    let leases = sched.lease(worker.clone(), 3).await.unwrap().leases;
    assert_eq!(leases.len(), 3);
    for l in &leases {
        sched.stored(outcome(&l.episode_id)).await;
    }
    let rollouts = iteration.await.unwrap().unwrap();
    assert_eq!((rollouts.train.len(), rollouts.eval.len()), (2, 1));
    let s = sched.snapshot().await.unwrap();
    assert_eq!(
        (
            s.train_episodes_completed_total,
            s.eval_episodes_completed_total,
            s.pending_episodes,
            s.outstanding_leases
        ),
        (2, 1, 0, 0),
        "{s:?}"
    );
    assert!(!s.run_finished);
    sched.finish().await;
    assert!(sched.snapshot().await.unwrap().run_finished);
}

/// Heartbeats every 100 ms until `deadline`, keeping `episode` alive as far as they can.
async fn keep_alive(sched: &SchedulerHandle, worker: &str, episode: &str, for_: Duration) {
    let end = tokio::time::Instant::now() + for_;
    while tokio::time::Instant::now() < end {
        sched
            .heartbeat(worker.to_string(), vec![episode.to_string()], 0)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A worker that heartbeats forever for an episode that never ends (a hung sandbox)
/// cannot hold the iteration: the lease ends `lease_max_s` after it was granted
/// however often it is renewed, and after `max_attempts` such leases the slot is
/// recorded as failed (an unresolved outcome, counted) and the iteration completes.
/// Before, the heartbeats renewed the lease forever and the iteration never ended.
#[tokio::test]
async fn an_episode_that_never_ends_cannot_hold_its_iteration() {
    let config = CoordinatorConfig {
        episodes_per_iteration: 1,
        heldout_episodes: 0,
        lease_timeout_s: 60.0,
        lease_max_s: 1.0,
        max_attempts: 2,
        ..Default::default()
    };
    let sched = SchedulerHandle::spawn(config, vec![Task::default()], Vec::new());
    let (worker, _) = sched.register("w".into(), 4).await.unwrap();
    let runner = sched.clone();
    let iteration = tokio::spawn(async move { runner.run_iteration(0, 1.0).await });
    tokio::time::sleep(Duration::from_millis(100)).await;

    let first = sched.lease(worker.clone(), 1).await.unwrap().leases;
    assert_eq!(first.len(), 1);
    keep_alive(
        &sched,
        &worker,
        &first[0].episode_id,
        Duration::from_millis(2200),
    )
    .await;
    let s = sched.snapshot().await.unwrap();
    assert_eq!(
        (
            s.lease_expiries_total,
            s.pending_episodes,
            s.outstanding_leases
        ),
        (1, 1, 0),
        "a lease renewed by heartbeats must still end at lease_max_s: {s:?}"
    );

    let second = sched.lease(worker.clone(), 1).await.unwrap().leases;
    assert_eq!(second.len(), 1);
    assert_ne!(second[0].episode_id, first[0].episode_id, "a new attempt");
    keep_alive(
        &sched,
        &worker,
        &second[0].episode_id,
        Duration::from_millis(2200),
    )
    .await;
    let rollouts = tokio::time::timeout(Duration::from_secs(10), iteration)
        .await
        .expect("the iteration ends once the last attempt expired")
        .unwrap()
        .unwrap();
    assert_eq!(rollouts.failed_slots, 1);
    assert_eq!(rollouts.expired_leases, 2);
    assert_eq!(rollouts.train.len(), 1);
    let failed = &rollouts.train[0];
    assert_eq!(
        failed.status,
        tutor_proto::OutcomeStatus::SandboxError as i32
    );
    assert!(
        failed.error.contains("max_attempts = 2"),
        "{}",
        failed.error
    );
    assert!(failed.error.contains("lease_max_s"), "{}", failed.error);

    // The first attempt's outcome, arriving late, completes nothing.
    assert!(!sched.claim_outcome(outcome(&first[0].episode_id)).await);
    assert!(!sched.claim_outcome(outcome(&second[0].episode_id)).await);
}

/// The events of an episode are accepted only from the worker it was leased to, proven
/// by the secret of its registration: another worker, or a stream that proves nobody,
/// cannot complete (or pollute) an episode it does not hold. Before, any stream's
/// outcome completed the slot.
#[tokio::test]
async fn events_of_a_leased_episode_are_accepted_from_its_worker_only() {
    let config = CoordinatorConfig {
        episodes_per_iteration: 1,
        heldout_episodes: 0,
        ..Default::default()
    };
    let sched = SchedulerHandle::spawn(config, vec![Task::default()], Vec::new());
    let (w1, s1, _) = sched.register_worker("a".into(), 1).await.unwrap();
    let (w2, s2, _) = sched.register_worker("b".into(), 1).await.unwrap();
    assert_eq!(s1.len(), 64);
    assert_ne!(s1, s2);
    assert!(sched.authenticate(w1.clone(), s1.clone()).await);
    assert!(
        !sched.authenticate(w1.clone(), s2.clone()).await,
        "another worker's secret"
    );
    assert!(!sched.authenticate(w1.clone(), String::new()).await);
    assert!(!sched.authenticate("nobody".into(), s1.clone()).await);

    let runner = sched.clone();
    let _iteration = tokio::spawn(async move { runner.run_iteration(0, 1.0).await });
    let mut leases = Vec::new();
    for _ in 0..100 {
        leases = sched.lease(w1.clone(), 1).await.unwrap().leases;
        if !leases.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let id = leases[0].episode_id.clone();
    let turn = EpisodeEvent {
        episode_id: id.clone(),
        worker_id: w2.clone(),
        event: Some(episode_event::Event::Turn(TurnRecord::default())),
    };
    let as_w1 = Some((w1.clone(), s1.clone()));
    let as_w2 = Some((w2.clone(), s2.clone()));
    let w1_with_w2s_secret = Some((w1.clone(), s2.clone()));
    for from in [as_w2.clone(), w1_with_w2s_secret, None] {
        match sched.admit(&turn, from.clone()).await {
            Admission::Refused(why) => {
                assert!(why.contains(&format!("leased to worker {w1}")), "{why}")
            }
            other => panic!("{from:?}: {other:?}"),
        }
    }
    let stolen = outcome(&id);
    assert!(matches!(
        sched.admit(&stolen, as_w2).await,
        Admission::Refused(_)
    ));
    assert_eq!(sched.admit(&turn, as_w1.clone()).await, Admission::Store);
    assert_eq!(sched.admit(&stolen, as_w1).await, Admission::Store);
    // Events of episodes this coordinator did not lease (e.g. before a restart) are
    // judged by their slot alone, as before.
    assert_eq!(
        sched.admit(&outcome("not-an-episode-id"), None).await,
        Admission::Store
    );
}
