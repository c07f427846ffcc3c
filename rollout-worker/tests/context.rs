//! The student's context within the training length: a real episode (toy task, local
//! sandbox, oracle teacher, tiny student) whose lease allows fewer tokens than its
//! history grows to. Older observations become a note; the prompt (system prompt and
//! issue) stays whole at every turn; the records rebuild, through the coordinator's
//! dataset builders, contexts that fit without cutting anything. And the student's
//! sampling log-probs, stored with its turns, are what a fresh forward pass of the same
//! weights gives on the training example built from those turns, elisions included: one
//! context, from generation to the loss.

mod common;

use tutor_coordinator::dataset::dagger_examples;
use tutor_proto::{episode_event, EpisodeLease, EpisodePurpose, OutcomeStatus, SamplingParams};
use tutor_proto::{EpisodeOutcome, TurnRecord};
use tutor_rollout_worker::episode::{run_episode, TeacherSource};

const MAX_NEW: u32 = 8;

fn lease(task: &tutor_proto::Task, max_context_tokens: u32) -> EpisodeLease {
    oracle_lease(task, max_context_tokens)
}

fn oracle_lease(task: &tutor_proto::Task, max_context_tokens: u32) -> EpisodeLease {
    EpisodeLease {
        episode_id: "it000-train0000-g0a0".into(),
        task: Some(task.clone()),
        // The oracle acts on every turn: open, replace, test, submit.
        beta: 1.0,
        sampling: Some(SamplingParams {
            temperature: 1.0,
            max_new_tokens: MAX_NEW,
            seed: 5,
            unbiased: false,
        }),
        max_turns: 6,
        command_timeout_ms: 30_000,
        observation_max_chars: 1500,
        purpose: EpisodePurpose::Train as i32,
        seed: 9,
        max_context_tokens,
        ..Default::default()
    }
}

/// DAPO's lease: the student acts on every turn, sampling unbiased; the teacher is never
/// asked.
fn student_lease(task: &tutor_proto::Task, max_context_tokens: u32) -> EpisodeLease {
    EpisodeLease {
        beta: 0.0,
        labels_unused: true,
        max_turns: 7,
        sampling: Some(SamplingParams {
            temperature: 1.0,
            max_new_tokens: MAX_NEW,
            seed: 5,
            unbiased: true,
        }),
        ..oracle_lease(task, max_context_tokens)
    }
}

fn run(s: &mut common::EpisodeSetup, max_context_tokens: u32) -> (EpisodeOutcome, Vec<TurnRecord>) {
    run_lease(s, &lease(&s.task, max_context_tokens))
}

fn run_lease(
    s: &mut common::EpisodeSetup,
    lease: &EpisodeLease,
) -> (EpisodeOutcome, Vec<TurnRecord>) {
    let outcome = run_episode(&s.env, lease);
    let mut turns = Vec::new();
    while let Ok(ev) = s.events.try_recv() {
        if let Some(episode_event::Event::Turn(t)) = ev.event {
            turns.push(t);
        }
    }
    (outcome, turns)
}

/// The context before each turn, as the coordinator rebuilds it (the DAgger examples'
/// context part: every oracle label is usable).
fn contexts(turns: &[TurnRecord]) -> Vec<Vec<u32>> {
    let examples = dagger_examples("e", turns, usize::MAX);
    assert_eq!(examples.len(), turns.len());
    examples
        .into_iter()
        .map(|ex| {
            let n = ex.loss_mask.iter().filter(|m| !**m).count();
            ex.tokens[..n].to_vec()
        })
        .collect()
}

#[test]
fn old_observations_are_elided_and_the_prompt_kept_within_the_lease_limit() {
    let mut s = common::episode_setup(
        tutor_rollout_worker::toy::generate(1, 11).remove(0),
        TeacherSource::Oracle,
    );
    // Unlimited: how long the history grows.
    let (outcome, full) = run(&mut s, 0);
    assert_eq!(
        outcome.status,
        OutcomeStatus::Resolved as i32,
        "{outcome:?}"
    );
    assert!(full.iter().all(|t| !t.context_rebuilt));
    let full_ctx = contexts(&full);
    let prompt = full[0].context_delta_tokens.clone();
    let longest = full_ctx.last().unwrap().len();
    assert!(full.len() >= 4, "{} turns", full.len());

    // A limit only the last context exceeds (the budget is the limit less
    // max_new_tokens): earlier contexts fit whole. The newest observation is never
    // elided, so a tighter limit could leave an earlier context over it (the model's cut
    // of the oldest tokens applies then).
    let limit = longest - 1 + MAX_NEW as usize;
    let budget = limit - MAX_NEW as usize;
    assert!(longest > budget, "{longest} tokens fit {budget} already");
    let (outcome, cut) = run(&mut s, limit as u32);
    assert_eq!(
        outcome.status,
        OutcomeStatus::Resolved as i32,
        "{outcome:?}"
    );
    assert_eq!(cut.len(), full.len());
    assert!(
        cut.iter().any(|t| t.context_rebuilt),
        "no context was rebuilt under a limit of {limit}"
    );
    let cut_ctx = contexts(&cut);
    for (i, ctx) in cut_ctx.iter().enumerate() {
        assert!(
            ctx.len() <= budget,
            "turn {i}: {} tokens over {budget}",
            ctx.len()
        );
        assert_eq!(
            &ctx[..prompt.len()],
            &prompt[..],
            "turn {i}: the prompt was cut"
        );
    }
    let text = s.env.tokenizer.decode(cut_ctx.last().unwrap());
    assert!(
        text.contains("output elided to keep the context short"),
        "no note in the last context:\n{text}"
    );
    // The executed commands are all still there, and the newest observation is whole.
    for t in &cut[..cut.len() - 1] {
        assert!(
            text.contains(t.command.as_str()),
            "{:?} lost:\n{text}",
            t.command
        );
    }
    let newest = &cut[cut.len() - 2].observation;
    let tail: String = newest
        .chars()
        .rev()
        .take(40)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    assert!(
        text.contains(tail.trim()),
        "the newest observation was elided:\n{text}"
    );
}

/// ℓ_θ(token j | tokens < j) of every token of `tokens` (0 for token 0), by one forward
/// pass over the whole sequence.
fn fresh_logprobs(policy: &tutor_policy::Policy, tokens: &[u32]) -> Vec<f64> {
    use tch::{Device, Kind, Tensor};
    let _g = tch::no_grad_guard();
    let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    let n = ids.len() as i64;
    let input = Tensor::from_slice(&ids).reshape([1, n]);
    let logits = policy.forward(&input, &Tensor::ones([1, n], (Kind::Int64, Device::Cpu)));
    let lsm = logits.log_softmax(-1, Kind::Double);
    let mut out = vec![0.0];
    for (j, &tok) in tokens.iter().enumerate().skip(1) {
        out.push(lsm.double_value(&[0, j as i64 - 1, tok as i64]));
    }
    out
}

#[test]
fn stored_old_logprobs_equal_a_fresh_forward_on_the_training_examples() {
    let mut s = common::episode_setup(
        tutor_rollout_worker::toy::generate(1, 11).remove(0),
        TeacherSource::Oracle,
    );
    // The weights the student samples with: the model directory's configuration,
    // initialised as the student host initialises it (seed 0; no version loaded).
    let config = tutor_policy::ModelConfig::load(&s.dir.path().join("config.json")).unwrap();
    let policy = tutor_policy::Policy::new(config, tch::Device::Cpu, 0);

    // How long the history grows unlimited; then a limit the last turns exceed, so the
    // context is rebuilt with old observations elided.
    let unlimited = student_lease(&s.task, 0);
    let (_, full) = run_lease(&mut s, &unlimited);
    assert!(full.len() >= 6, "{} turns", full.len());
    assert!(full
        .iter()
        .all(|t| t.executed == tutor_proto::Actor::Student as i32));
    // The context the last turn generated from: every delta, and every message before it.
    let longest: usize = full
        .iter()
        .map(|t| t.context_delta_tokens.len())
        .sum::<usize>()
        + full[..full.len() - 1]
            .iter()
            .map(|t| t.student_tokens.len())
            .sum::<usize>();
    let limit = longest - 1 + MAX_NEW as usize;
    let limited = student_lease(&s.task, limit as u32);
    let (_, cut) = run_lease(&mut s, &limited);
    assert!(
        cut.iter().any(|t| t.context_rebuilt),
        "no context was rebuilt under a limit of {limit}"
    );

    for (name, turns) in [("unlimited", &full), ("elided", &cut)] {
        let examples =
            tutor_coordinator::dataset::policy_gradient_examples("e", turns, usize::MAX, false);
        let rebuilt = turns.iter().filter(|t| t.context_rebuilt).count();
        assert_eq!(
            examples.len(),
            1 + rebuilt,
            "{name}: one example per context segment"
        );
        let mut checked = 0;
        for ex in &examples {
            assert_eq!(ex.old_logprobs.len(), ex.tokens.len(), "{name}");
            let fresh = fresh_logprobs(&policy, &ex.tokens);
            for (j, &trained) in ex.loss_mask.iter().enumerate() {
                if !trained {
                    continue;
                }
                let old = ex.old_logprobs[j] as f64;
                assert!(
                    (fresh[j] - old).abs() < 1e-3,
                    "{name}: token {j} of {}: stored {old} vs fresh forward {}",
                    ex.tokens.len(),
                    fresh[j]
                );
                checked += 1;
            }
        }
        let generated: usize = turns.iter().map(|t| t.student_tokens.len()).sum();
        assert!(generated > 0, "{name}: the student generated nothing");
        assert_eq!(
            checked, generated,
            "{name}: every generated token is trained"
        );
    }
}
