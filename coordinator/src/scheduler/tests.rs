//! The scheduler's own tests (recovery's are in `recovery`).

use super::*;
use tutor_proto::EpisodeOutcome;

use super::recovery::History;

pub(crate) fn outcome(episode_id: &str) -> EpisodeEvent {
    EpisodeEvent {
        episode_id: episode_id.to_string(),
        worker_id: "w-0".into(),
        event: Some(episode_event::Event::Outcome(EpisodeOutcome::default())),
    }
}

/// The first non-empty lease answer `worker` gets within a second (the iteration is
/// started by another task).
async fn first_leases(sched: &SchedulerHandle, worker: &str) -> Vec<tutor_proto::EpisodeLease> {
    let mut leases = Vec::new();
    for _ in 0..100 {
        leases = sched.lease(worker.to_string(), 1).await.unwrap().leases;
        if !leases.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    leases
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
    let leases = first_leases(&sched, &w1).await;
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
}

/// Only episodes someone could have leased are accepted: not an id this coordinator
/// never gave (another attempt of a leased slot, even from a proven worker), not a
/// predecessor's episode from a stream that proves no worker, and not an iteration the
/// run has not got to. Before, each of these was
/// stored, and an unleased id of the current iteration could complete a queued slot
/// with a forged outcome; events of unplanned iterations were held in memory.
#[tokio::test]
async fn events_nobody_could_have_leased_are_refused() {
    let key = WorkerKey::default();
    let config = CoordinatorConfig {
        episodes_per_iteration: 2,
        heldout_episodes: 0,
        ..Default::default()
    };
    // The second start on this run: generation 1.
    let sched = SchedulerHandle::spawn_recovered(
        config,
        vec![Task::default()],
        Vec::new(),
        Recovery {
            generation: 1,
            worker_key: key,
            ..Default::default()
        },
    );
    let (w, secret, _) = sched.register_worker("a".into(), 1).await.unwrap();
    let (w2, secret2, _) = sched.register_worker("b".into(), 1).await.unwrap();
    let proven = Some((w.clone(), secret.clone()));
    let proven2 = Some((w2.clone(), secret2.clone()));
    let runner = sched.clone();
    let _iteration = tokio::spawn(async move { runner.run_iteration(0, 1.0).await });
    let leases = first_leases(&sched, &w).await;
    let leased: EpisodeId = leases[0].episode_id.parse().unwrap();
    assert_eq!(leased.generation, 1);
    let refused = |a: Admission, what: &str| match a {
        Admission::Refused(why) => why,
        other => panic!("{what}: {other:?}"),
    };

    // The slot that was not leased (queued), and another attempt of the leased one.
    let mut queued = leased;
    queued.slot.slot = 1 - leased.slot.slot;
    let mut other_attempt = leased;
    other_attempt.attempt += 3;
    for id in [queued, other_attempt] {
        let why = refused(
            sched.admit(&outcome(&id.to_string()), proven.clone()).await,
            "an id this coordinator never leased",
        );
        assert!(
            why.contains("was never leased by this coordinator"),
            "{why}"
        );
    }
    // What is no episode id completes no slot: stored, never counted (as before).
    assert_eq!(
        sched.admit(&outcome("not-an-episode-id"), None).await,
        Admission::Store
    );

    // A predecessor's lease of this iteration: from a proven worker it counts as
    // before (the worker carried on across the restart), and from then on from that
    // worker only; from nobody it is refused. (Nothing records a predecessor's leases,
    // so the first proven worker to use such an id gets it: docs/security.md says so.)
    let mut before_restart = queued;
    before_restart.generation = 0;
    let why = refused(
        sched
            .admit(&outcome(&before_restart.to_string()), None)
            .await,
        "a predecessor's episode from a stream that proves nobody",
    );
    assert!(why.contains("proves a registered worker"), "{why}");
    assert_eq!(
        sched
            .admit(&outcome(&before_restart.to_string()), proven.clone())
            .await,
        Admission::Store
    );
    let why = refused(
        sched
            .admit(&outcome(&before_restart.to_string()), proven2)
            .await,
        "another worker's use of a bound id",
    );
    assert!(why.contains(&format!("leased to worker {w}")), "{why}");
    // A later generation than this coordinator's: nobody leased it.
    let mut later = leased;
    later.generation = 2;
    let why = refused(
        sched
            .admit(&outcome(&later.to_string()), proven.clone())
            .await,
        "a later generation",
    );
    assert!(why.contains("no coordinator leased it"), "{why}");

    // Iteration 0 is planned; 1 may have been leased by a predecessor; 5 cannot.
    let mut next = before_restart;
    next.slot.iteration = 1;
    assert_eq!(
        sched
            .admit(&outcome(&next.to_string()), proven.clone())
            .await,
        Admission::Store
    );
    let mut far = before_restart;
    far.slot.iteration = 5;
    let turn = EpisodeEvent {
        episode_id: far.to_string(),
        worker_id: w.clone(),
        event: Some(episode_event::Event::Turn(TurnRecord::default())),
    };
    let why = refused(sched.admit(&turn, proven).await, "an unplanned iteration");
    assert!(
        why.contains("iteration 5, which no earlier coordinator"),
        "{why}"
    );
}

/// A coordinator restarted on the run directory (same worker key, next generation)
/// accepts the secret its predecessor gave a worker, and only that one. Before, it took
/// the first secret presented for a worker registered before the restart as that
/// worker's own, so whoever spoke first after a restart could be that worker.
#[tokio::test]
async fn a_restarted_coordinator_checks_the_secrets_its_predecessor_gave() {
    let key = WorkerKey::default();
    let spawn = |generation: u64, key: WorkerKey| {
        SchedulerHandle::spawn_recovered(
            CoordinatorConfig::default(),
            vec![Task::default()],
            Vec::new(),
            Recovery {
                generation,
                worker_key: key,
                ..Default::default()
            },
        )
    };
    let first = spawn(0, key.clone());
    let (id, secret, _) = first.register_worker("a".into(), 1).await.unwrap();
    first.finish().await;

    let restarted = spawn(1, key.clone());
    // The worker's heartbeat makes it known again, as after any restart.
    restarted.heartbeat(id.clone(), Vec::new(), 0).await;
    assert!(
        !restarted.authenticate(id.clone(), "f".repeat(64)).await,
        "a forged secret, presented first"
    );
    assert!(restarted.authenticate(id.clone(), secret.clone()).await);
    // Another run's key (or a state without this one) proves nothing.
    let other = spawn(1, WorkerKey::default());
    other.heartbeat(id.clone(), Vec::new(), 0).await;
    assert!(!other.authenticate(id.clone(), secret.clone()).await);
    // The key survives its hex form in the run state.
    assert_eq!(WorkerKey::from_hex(&key.to_hex()), Some(key));
    assert_eq!(WorkerKey::from_hex("abc"), None);
}

/// The coordinator records whom it leased each attempt to before the worker has it
/// (`LeaseGranted`, written by the Lease call). A restarted coordinator accepts an
/// attempt's events from that worker only, and an id its predecessor recorded no lease of
/// from nobody, also when that predecessor recorded nothing at all (it crashed before
/// leasing: every id of it is forged). Before, the first proven worker to send a
/// predecessor's id was bound to it, so another registered worker could take over an
/// attempt it never held. Generations before the first that recorded leases (a run
/// started by an older Tutor) keep that rule.
#[tokio::test]
async fn a_predecessors_recorded_leases_decide_who_may_send_its_events() {
    let key = WorkerKey::default();
    let config = CoordinatorConfig {
        episodes_per_iteration: 2,
        heldout_episodes: 0,
        ..Default::default()
    };
    let first = SchedulerHandle::spawn_recovered(
        config.clone(),
        vec![Task::default()],
        Vec::new(),
        Recovery {
            generation: 0,
            worker_key: key.clone(),
            ..Default::default()
        },
    );
    let (wa, secret_a, _) = first.register_worker("a".into(), 1).await.unwrap();
    let (wb, secret_b, _) = first.register_worker("b".into(), 1).await.unwrap();
    first.finish().await;
    let granted = |episode: &str, worker: &str| EpisodeEvent {
        episode_id: episode.into(),
        worker_id: COORDINATOR_WRITER.into(),
        event: Some(episode_event::Event::LeaseGranted(
            tutor_proto::LeaseGranted {
                worker_id: worker.into(),
            },
        )),
    };
    // Generation 0 ran before lease records. Generation 1 recorded its lease of slot 0
    // of iteration 0 to worker a (slot 1 it never leased); generation 2 leased nothing.
    let history = History::from(vec![granted("it000-train0000-g1a0", &wa)]);
    let restarted = SchedulerHandle::spawn_recovered(
        config,
        vec![Task::default()],
        Vec::new(),
        Recovery {
            generation: 3,
            worker_key: key,
            lease_records_from: Some(1),
            history,
        },
    );
    let a = Some((wa.clone(), secret_a));
    let b = Some((wb.clone(), secret_b));
    let refused = |adm: Admission, what: &str| match adm {
        Admission::Refused(why) => why,
        other => panic!("{what}: {other:?}"),
    };
    let why = refused(
        restarted
            .admit(&outcome("it000-train0000-g1a0"), b.clone())
            .await,
        "another worker's events of a recorded lease",
    );
    assert!(
        why.contains(&format!(
            "leased to worker {wa} before the coordinator restarted"
        )),
        "{why}"
    );
    assert_eq!(
        restarted
            .admit(&outcome("it000-train0000-g1a0"), a.clone())
            .await,
        Admission::Store
    );
    for never in [
        "it000-train0001-g1a0",
        "it001-train0000-g1a0",
        "it000-train0001-g2a0",
    ] {
        let why = refused(
            restarted.admit(&outcome(never), a.clone()).await,
            "an attempt its generation recorded no lease of",
        );
        assert!(why.contains("recorded no lease of it"), "{never}: {why}");
    }
    // Generation 0 recorded no leases: its ids go to the first proven worker, as before.
    assert_eq!(
        restarted
            .admit(&outcome("it000-train0001-g0a0"), b.clone())
            .await,
        Admission::Store
    );
    let why = refused(
        restarted.admit(&outcome("it000-train0001-g0a0"), a).await,
        "a bound id from another worker",
    );
    assert!(why.contains(&format!("leased to worker {wb}")), "{why}");
}

/// A slot whose attempts ran out stays failed across a coordinator restart: its outcome
/// is in the store, and the restarted scheduler replays it and completes the iteration
/// with no worker. Before, failed slots lived in memory only, and after a restart the
/// slot was queued again with fresh attempts.
#[tokio::test]
async fn a_failed_slot_stays_failed_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let config = CoordinatorConfig {
        episodes_per_iteration: 1,
        heldout_episodes: 0,
        lease_timeout_s: 0.2,
        max_attempts: 1,
        ..Default::default()
    };
    let on_store = OnStore::start(&config, dir.path(), Recovery::default());
    let sched = on_store.sched.clone();
    let (worker, _) = sched.register("w".into(), 1).await.unwrap();
    let runner = sched.clone();
    let iteration = tokio::spawn(async move { runner.run_iteration(0, 1.0).await });
    let leased = first_leases(&sched, &worker).await;
    assert_eq!(leased.len(), 1);
    // The worker goes silent: the only attempt expires and the slot fails.
    let rollouts = tokio::time::timeout(Duration::from_secs(10), iteration)
        .await
        .expect("the iteration ends once the attempt expired")
        .unwrap()
        .unwrap();
    assert_eq!(rollouts.failed_slots, 1);
    let (stored, recovery) = on_store.stop(dir.path()).await;
    // The lease's expiry, then the failed slot's outcome.
    assert_eq!(stored.len(), 2, "{stored:?}");
    assert!(stored.iter().all(|e| e.worker_id == COORDINATOR_WRITER));
    assert_eq!(stored[0].episode_id, leased[0].episode_id);
    assert!(matches!(
        stored[0].event,
        Some(episode_event::Event::LeaseExpired(
            tutor_proto::LeaseExpired { attempts: 1, .. }
        ))
    ));
    assert_ne!(
        stored[1].episode_id, leased[0].episode_id,
        "an attempt no lease had"
    );

    let restarted = SchedulerHandle::spawn_recovered(
        config,
        vec![Task::default()],
        Vec::new(),
        Recovery {
            generation: 1,
            ..recovery
        },
    );
    let rollouts = tokio::time::timeout(Duration::from_secs(5), restarted.run_iteration(0, 1.0))
        .await
        .expect("the failed slot is done after the restart: nothing to lease")
        .unwrap();
    assert_eq!(rollouts.train.len(), 1);
    assert_eq!(
        rollouts.train[0].status,
        tutor_proto::OutcomeStatus::SandboxError as i32
    );
    let s = restarted.snapshot().await.unwrap();
    assert_eq!((s.pending_episodes, s.outstanding_leases), (0, 0), "{s:?}");
}

/// A scheduler writing to the trajectory store in a directory, as a coordinator's does.
struct OnStore {
    sched: SchedulerHandle,
    store_tx: tokio::sync::mpsc::Sender<crate::store::StoreRequest>,
    store_thread: std::thread::JoinHandle<Result<(), crate::store::StoreError>>,
}

impl OnStore {
    fn start(config: &CoordinatorConfig, dir: &std::path::Path, recovery: Recovery) -> Self {
        use crate::store::{spawn_writer, TrajectoryStore};
        let (store_tx, store_thread) =
            spawn_writer(TrajectoryStore::open(dir).unwrap(), Default::default());
        let sched = SchedulerHandle::spawn_with_store(
            config.clone(),
            vec![Task::default()],
            Vec::new(),
            recovery,
            Some(&store_tx),
            Some(crate::dataset::ExampleSpill::create_in(dir).unwrap()),
        );
        Self {
            sched,
            store_tx,
            store_thread,
        }
    }

    /// Stops the scheduler once its background records are written (the store's writer
    /// ends with its sender) and returns what the store holds, with the recovery a
    /// restarted coordinator reads from it.
    async fn stop(self, dir: &std::path::Path) -> (Vec<EpisodeEvent>, Recovery) {
        use crate::store::{log_path, StoreOptions, TrajectoryStore};
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.sched.finish().await;
        drop(self.store_tx);
        let thread = self.store_thread;
        tokio::task::spawn_blocking(move || thread.join())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let mut recovery = Recovery::in_store(&log_path(dir));
        let mut stored = Vec::new();
        TrajectoryStore::open_for_each(dir, StoreOptions::default(), |at, ev| {
            stored.push(ev.clone());
            recovery.history.push_stored(at, &ev)
        })
        .unwrap();
        (stored, recovery)
    }
}

/// Runs a scheduler on the store in `dir` until it has leased `leases_to_take`
/// attempts and each has expired (its worker is silent), then stops it as a crash would
/// (its iteration left unfinished) and returns the attempts' ids and what the store
/// holds, with the recovery of the next generation.
async fn run_until_crash(
    config: &CoordinatorConfig,
    dir: &std::path::Path,
    recovery: Recovery,
    leases_to_take: usize,
) -> (Vec<String>, Vec<EpisodeEvent>, Recovery) {
    let generation = recovery.generation;
    let on_store = OnStore::start(config, dir, recovery);
    let sched = on_store.sched.clone();
    let (worker, _) = sched.register("w".into(), 1).await.unwrap();
    let runner = sched.clone();
    let iteration = tokio::spawn(async move { runner.run_iteration(0, 1.0).await });
    let mut leased = Vec::new();
    // Each lease is left to expire (the worker is silent) before the next is taken.
    for _ in 0..500 {
        if leased.len() == leases_to_take {
            let s = sched.snapshot().await.unwrap();
            if s.outstanding_leases == 0 {
                break;
            }
        } else if let Some(l) = sched.lease(worker.clone(), 1).await.unwrap().leases.pop() {
            leased.push(l.episode_id);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(leased.len(), leases_to_take, "{leased:?}");
    // The "crash": the iteration never ends.
    iteration.abort();
    let (stored, mut recovery) = on_store.stop(dir).await;
    recovery.generation = generation + 1;
    (leased, stored, recovery)
}

/// Attempts spent before a coordinator restart stay spent: each lease expiry is
/// recorded in the store, and the restarted scheduler counts the recorded ones against
/// `max_attempts`. Here the slot's first attempt expires before the restart and its
/// second after: with max_attempts = 2 the slot fails and the iteration ends. Before,
/// expiries lived in memory only, so every restart gave the slot all its attempts again
/// (a task whose episode brings the coordinator down could hold a run forever).
#[tokio::test]
async fn attempts_spent_before_a_restart_stay_spent() {
    let dir = tempfile::tempdir().unwrap();
    let config = CoordinatorConfig {
        episodes_per_iteration: 1,
        heldout_episodes: 0,
        lease_timeout_s: 0.2,
        max_attempts: 2,
        ..Default::default()
    };
    let (leased, stored, recovery) =
        run_until_crash(&config, dir.path(), Recovery::default(), 1).await;
    assert_eq!(stored.len(), 1, "only the expiry: {stored:?}");
    assert_eq!(stored[0].episode_id, leased[0]);
    assert_eq!(stored[0].worker_id, COORDINATOR_WRITER);
    match &stored[0].event {
        Some(episode_event::Event::LeaseExpired(e)) => {
            assert_eq!(e.attempts, 1);
            assert!(e.reason.contains("lease_timeout_s"), "{}", e.reason);
        }
        other => panic!("{other:?}"),
    }

    // The restarted coordinator leases the slot once more; that attempt is its last.
    let (leased_after, stored, _) = run_until_crash(&config, dir.path(), recovery, 1).await;
    assert_ne!(leased_after[0], leased[0], "a new attempt id");
    let failed: Vec<_> = stored
        .iter()
        .filter_map(|e| match &e.event {
            Some(episode_event::Event::Outcome(o)) => Some(o),
            _ => None,
        })
        .collect();
    assert_eq!(
        failed.len(),
        1,
        "the slot failed after its second attempt: {stored:?}"
    );
    assert!(
        failed[0].error.contains("2 leases expired"),
        "{}",
        failed[0].error
    );
    assert!(matches!(
        stored[1].event,
        Some(episode_event::Event::LeaseExpired(
            tutor_proto::LeaseExpired { attempts: 2, .. }
        ))
    ));
}

/// What a restart finds in the store of an attempt that expired: its turns and the
/// expiry. The attempt is not waited for again as one in progress (before, its turns
/// made it "leased to its worker" until a second expiry), and a store whose last
/// expiry used the slot's attempts up but whose failure record never got written (the
/// crash came between the two) fails the slot at once and writes the record.
#[tokio::test]
async fn a_replayed_expiry_closes_its_attempt_and_can_fail_the_slot() {
    let config = |max_attempts| CoordinatorConfig {
        episodes_per_iteration: 1,
        heldout_episodes: 0,
        max_attempts,
        ..Default::default()
    };
    let id = "it000-train0000-g0a0";
    let turn = EpisodeEvent {
        episode_id: id.into(),
        worker_id: "w-0".into(),
        event: Some(episode_event::Event::Turn(TurnRecord::default())),
    };
    let expiry = EpisodeEvent {
        episode_id: id.into(),
        worker_id: COORDINATOR_WRITER.into(),
        event: Some(episode_event::Event::LeaseExpired(
            tutor_proto::LeaseExpired {
                reason: "not renewed for lease_timeout_s = 60 s".into(),
                attempts: 1,
            },
        )),
    };
    let spawn = |max_attempts| {
        SchedulerHandle::spawn_recovered(
            config(max_attempts),
            vec![Task::default()],
            Vec::new(),
            Recovery {
                generation: 1,
                history: vec![turn.clone(), expiry.clone()].into(),
                ..Default::default()
            },
        )
    };

    let sched = spawn(2);
    let runner = sched.clone();
    let iteration = tokio::spawn(async move { runner.run_iteration(0, 1.0).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let s = sched.snapshot().await.unwrap();
    assert_eq!(
        (s.outstanding_leases, s.pending_episodes),
        (0, 1),
        "the expired attempt is not waited for; the slot waits for its second: {s:?}"
    );
    let (worker, _) = sched.register("w".into(), 1).await.unwrap();
    let lease = sched.lease(worker, 1).await.unwrap().leases;
    assert_eq!(
        lease[0].episode_id, "it000-train0000-g1a1",
        "the second attempt"
    );
    iteration.abort();
    sched.finish().await;

    let rollouts = tokio::time::timeout(Duration::from_secs(5), spawn(1).run_iteration(0, 1.0))
        .await
        .expect("the slot's only attempt expired before the restart: it fails at once")
        .unwrap();
    assert_eq!(rollouts.failed_slots, 1);
    assert!(
        rollouts.train[0].error.contains("max_attempts = 1"),
        "{}",
        rollouts.train[0].error
    );
}
