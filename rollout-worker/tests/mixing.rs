//! Who acts in an episode: turn-level mixing (β per turn) and trajectory-level mixing
//! (the student for the first κ turns, the teacher after), with the teacher labelling
//! every visited state either way. Real episodes: a toy task in a local sandbox, a tiny
//! random student, the oracle teacher.

mod common;

use tutor_proto::{episode_event, Actor, EpisodeLease, EpisodePurpose, SamplingParams, TurnRecord};
use tutor_rollout_worker::episode::{run_episode, TeacherSource};

fn setup() -> common::EpisodeSetup {
    common::episode_setup(
        tutor_rollout_worker::toy::generate(1, 11).remove(0),
        TeacherSource::Oracle,
    )
}

fn lease(task: &tutor_proto::Task, beta: f64, student_turns: Option<u32>) -> EpisodeLease {
    EpisodeLease {
        episode_id: "it000-train0000-g0a0".into(),
        task: Some(task.clone()),
        beta,
        sampling: Some(SamplingParams {
            temperature: 1.0,
            max_new_tokens: 8,
            seed: 5,
            unbiased: false,
        }),
        max_turns: 5,
        command_timeout_ms: 20_000,
        observation_max_chars: 1500,
        purpose: EpisodePurpose::Train as i32,
        seed: 9,
        student_turns,
        ..Default::default()
    }
}

fn turns(events: &mut tokio::sync::mpsc::Receiver<tutor_proto::EpisodeEvent>) -> Vec<TurnRecord> {
    let mut out = Vec::new();
    while let Ok(ev) = events.try_recv() {
        if let Some(episode_event::Event::Turn(t)) = ev.event {
            out.push(t);
        }
    }
    out
}

/// (executed by the student, the student generated) per turn.
fn actors(turns: &[TurnRecord]) -> Vec<(bool, bool)> {
    turns
        .iter()
        .map(|t| (t.executed == Actor::Student as i32, t.student_generated))
        .collect()
}

#[test]
fn trajectory_mixing_lets_the_student_act_for_kappa_turns_then_the_teacher() {
    let mut s = setup();
    // κ = 2: the random student acts (and fails to submit) on turns 0 and 1; from turn 2
    // the teacher acts and the student is not asked. β plays no part.
    let outcome = run_episode(&s.env, &lease(&s.task, 1.0, Some(2)));
    let t = turns(&mut s.events);
    assert!(t.len() >= 3, "{outcome:?}");
    let a = actors(&t);
    assert_eq!(&a[..2], &[(true, true), (true, true)], "{a:?}");
    assert!(a[2..].iter().all(|x| *x == (false, false)), "{a:?}");
    // The teacher labelled every state, the student's ones included.
    assert!(t.iter().all(|t| !t.teacher_tokens.is_empty()));

    // κ = 0: the teacher acts throughout, the same as β = 1 at turn level.
    let _ = run_episode(&s.env, &lease(&s.task, 0.0, Some(0)));
    let a0 = actors(&turns(&mut s.events));
    let _ = run_episode(&s.env, &lease(&s.task, 1.0, None));
    let b1 = actors(&turns(&mut s.events));
    assert!(a0.iter().all(|x| *x == (false, false)), "{a0:?}");
    assert_eq!(a0, b1);

    // Turn level with β = 0: the student acts on every turn.
    let _ = run_episode(&s.env, &lease(&s.task, 0.0, None));
    let s0 = actors(&turns(&mut s.events));
    assert_eq!(s0.len(), 5, "the random student never submits: {s0:?}");
    assert!(s0.iter().all(|x| *x == (true, true)), "{s0:?}");
}

/// A lease whose labels nothing trains on (held-out evaluation, rft, dapo, distill) asks
/// the teacher only on the turns it acts: none with β = 0 (so an unreachable teacher
/// endpoint does not fail the episode), exactly the teacher-executed turns with β = 0.5.
/// A labelled lease (dagger) asks it on every turn.
#[test]
fn the_teacher_is_asked_only_where_its_label_is_used_or_its_action_runs() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let endpoint = tutor_rollout_worker::teacher::endpoint::ChatEndpoint::new(
        &tutor_rollout_worker::teacher::endpoint::TeacherConfig {
            kind: tutor_rollout_worker::teacher::endpoint::TeacherKind::Endpoint,
            // Nothing listens there: any call fails.
            base_url: "http://127.0.0.1:1/v1".into(),
            model: "unreachable".into(),
            max_retries: 0,
            ..Default::default()
        },
    )
    .unwrap();
    let mut dead = common::episode_setup(
        tutor_rollout_worker::toy::generate(1, 11).remove(0),
        TeacherSource::Endpoint(std::sync::Arc::new(endpoint), rt.handle().clone()),
    );
    let unused = EpisodeLease {
        labels_unused: true,
        ..lease(&dead.task, 0.0, None)
    };
    let outcome = run_episode(&dead.env, &unused);
    assert_ne!(
        outcome.status,
        tutor_proto::OutcomeStatus::SandboxError as i32,
        "{outcome:?}"
    );
    let t = turns(&mut dead.events);
    assert_eq!(t.len(), 5, "{outcome:?}");
    assert!(t
        .iter()
        .all(|t| !t.teacher_asked && t.teacher_tokens.is_empty()));
    assert!(t.iter().all(|t| !t.teacher_format_error && !t.agreement));
    // The same lease with its labels used fails at once on that teacher.
    let outcome = run_episode(&dead.env, &lease(&dead.task, 0.0, None));
    assert_eq!(
        outcome.status,
        tutor_proto::OutcomeStatus::SandboxError as i32
    );

    let mut s = setup();
    let _ = run_episode(
        &s.env,
        &EpisodeLease {
            labels_unused: true,
            ..lease(&s.task, 0.5, None)
        },
    );
    let t = turns(&mut s.events);
    let asked: Vec<bool> = t.iter().map(|t| t.teacher_asked).collect();
    let teacher_ran: Vec<bool> = t
        .iter()
        .map(|t| t.executed == Actor::Teacher as i32)
        .collect();
    assert_eq!(asked, teacher_ran, "asked exactly where the teacher acted");
    assert!(asked.iter().any(|&a| a) || t.len() < 2, "{asked:?}");
    let _ = run_episode(&s.env, &lease(&s.task, 0.5, None));
    let t = turns(&mut s.events);
    assert!(t
        .iter()
        .all(|t| t.teacher_asked && !t.teacher_tokens.is_empty()));
}
