//! DAPO through the learner: trajectories sampled by the policy's own generator become
//! the coordinator's policy-gradient examples (old log-probs and group advantages per
//! token); the learner's step on them equals DAPO's loss computed by hand, and moves the
//! policy towards the better trajectory.

use tch::{Device, Kind, Tensor};
use tutor_coordinator::algorithms::{dapo_examples, GroupedEpisode};
use tutor_coordinator::dataset::policy_gradient_example;
use tutor_learner::loss::{RlExample, StepExamples};
use tutor_learner::{LearnerConfig, Trainer};
use tutor_policy::{GenParams, ModelConfig, Policy};
use tutor_proto::{Actor, TrainExample, TurnRecord};

fn trainer(lr: f64) -> Trainer {
    let mut mc = ModelConfig::tiny(64);
    mc.hidden_size = 32;
    mc.intermediate_size = 64;
    mc.head_dim = 8;
    Trainer::new(
        Policy::new(mc, Device::Cpu, 11),
        LearnerConfig {
            learning_rate: lr,
            warmup_steps: 0,
            weight_decay: 0.0,
            grad_clip: 0.0,
            clip_eps_low: 0.2,
            clip_eps_high: 0.28,
            ..Default::default()
        },
    )
    .unwrap()
}

/// A two-turn episode the student plays: it samples each reply (temperature 1, no
/// truncation, as unbiased RL sampling does) after the context so far, as a worker would.
fn sampled_episode(policy: &Policy, seed: u64) -> Vec<TurnRecord> {
    let deltas = [vec![1u32, 5, 9, 13, 17], vec![3u32, 7]];
    let mut history: Vec<u32> = Vec::new();
    let mut turns = Vec::new();
    for (i, delta) in deltas.iter().enumerate() {
        history.extend_from_slice(delta);
        let g = policy
            .generate(
                std::slice::from_ref(&history),
                &[GenParams {
                    temperature: 1.0,
                    top_p: 1.0,
                    max_new_tokens: 6,
                    seed: seed * 10 + i as u64,
                    stop_token_ids: vec![],
                }],
            )
            .remove(0);
        history.extend_from_slice(&g.tokens);
        turns.push(TurnRecord {
            turn_index: i as u32,
            context_delta_tokens: delta.clone(),
            student_tokens: g.tokens,
            student_logprobs: g.logprobs,
            student_generated: true,
            executed: Actor::Student as i32,
            ..Default::default()
        });
    }
    turns
}

/// A group of two episodes with rewards 1 and 0 (Â = +1 and −1), as the coordinator
/// sends them.
fn group_batch(policy: &Policy) -> Vec<RlExample> {
    let a = policy_gradient_example("good", &sampled_episode(policy, 1), 1024, true).unwrap();
    let b = policy_gradient_example("bad", &sampled_episode(policy, 2), 1024, true).unwrap();
    let (a, b) = (vec![a], vec![b]);
    let (examples, stats) = dapo_examples(
        &[
            GroupedEpisode {
                group: 0,
                reward: 1.0,
                examples: &a,
            },
            GroupedEpisode {
                group: 0,
                reward: 0.0,
                examples: &b,
            },
        ],
        1e-6,
    );
    assert_eq!((stats.kept, stats.dropped), (1, 0));
    match StepExamples::from_proto(examples).unwrap() {
        StepExamples::Dapo(e) => e,
        other => panic!("expected a DAPO step, got {other:?}"),
    }
}

/// ℓ_θ(token j | tokens < j) of each token of one unpadded sequence (0 for token 0).
fn logprobs_of(policy: &Policy, tokens: &[u32]) -> Vec<f64> {
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

/// DAPO's loss written out token by token, in f64.
fn hand_dapo_loss(policy: &Policy, batch: &[RlExample], eps_low: f64, eps_high: f64) -> f64 {
    let (mut sum, mut n) = (0.0, 0.0);
    for e in batch {
        let lp = logprobs_of(policy, &e.tokens);
        for (j, l) in lp.iter().enumerate().skip(1) {
            if !e.loss_mask[j] {
                continue;
            }
            let r = (l - e.old_logprobs[j] as f64).exp();
            let a = e.advantages[j] as f64;
            sum += (r * a).min(r.clamp(1.0 - eps_low, 1.0 + eps_high) * a);
            n += 1.0;
        }
    }
    -sum / n
}

fn mean_trained_logprob(policy: &Policy, e: &RlExample) -> f64 {
    let lp = logprobs_of(policy, &e.tokens);
    let picked: Vec<f64> = (1..e.tokens.len())
        .filter(|&j| e.loss_mask[j])
        .map(|j| lp[j])
        .collect();
    picked.iter().sum::<f64>() / picked.len() as f64
}

#[test]
fn sampled_logprobs_line_up_with_the_learners() {
    // Token-in/token-out: the log-probs the generator recorded are the learner's ℓ_θ of
    // the same tokens under the same weights, so the first step's ratio is 1.
    let t = trainer(1e-2);
    let batch = group_batch(t.policy());
    for e in &batch {
        let lp = logprobs_of(t.policy(), &e.tokens);
        let mut trained = 0;
        for (j, l) in lp.iter().enumerate() {
            if e.loss_mask[j] {
                trained += 1;
                assert!(
                    (l - e.old_logprobs[j] as f64).abs() < 1e-4,
                    "token {j}: learner {l} vs sampler {}",
                    e.old_logprobs[j]
                );
            }
        }
        assert_eq!(trained, 12, "two turns of 6 sampled tokens");
    }
    let (_, cf) = t.eval_dapo(&batch).unwrap();
    assert_eq!(cf.total(), 0.0, "nothing clipped at ratio 1");
}

#[test]
fn one_dapo_step_equals_the_hand_computed_loss_and_moves_towards_the_better_trajectory() {
    let mut t = trainer(1e-2);
    let mut batch = group_batch(t.policy());
    // Make some ratios leave the clip range: the bad trajectory's old log-probs were
    // 0.5 higher on its first turn (r = e^−0.5 ≈ 0.61 < 1 − ε_low with Â < 0: clipped),
    // the good one's 0.4 lower on its second turn (r = e^0.4 ≈ 1.49 > 1 + ε_high with
    // Â > 0: clipped).
    let good = batch[0].advantages.iter().any(|a| *a > 0.0);
    let (gi, bi) = if good { (0, 1) } else { (1, 0) };
    let bad_first: Vec<usize> = (0..batch[bi].tokens.len())
        .filter(|&j| batch[bi].loss_mask[j])
        .take(6)
        .collect();
    for j in bad_first {
        batch[bi].old_logprobs[j] += 0.5;
    }
    let good_second: Vec<usize> = (0..batch[gi].tokens.len())
        .filter(|&j| batch[gi].loss_mask[j])
        .skip(6)
        .collect();
    for j in good_second {
        batch[gi].old_logprobs[j] -= 0.4;
    }

    let want = hand_dapo_loss(t.policy(), &batch, 0.2, 0.28);
    let (before, cf) = t.eval_dapo(&batch).unwrap();
    assert!(
        (cf.low - 0.25).abs() < 1e-9 && (cf.high - 0.25).abs() < 1e-9,
        "{cf:?}"
    );
    let good_before = mean_trained_logprob(t.policy(), &batch[gi]);
    let bad_before = mean_trained_logprob(t.policy(), &batch[bi]);

    let report = t.dapo_step(&batch).unwrap();
    assert_eq!(report.label_tokens, 24);
    assert!(
        (report.loss - want).abs() < 1e-5,
        "learner {} vs hand-computed {want}",
        report.loss
    );
    assert!((before - want).abs() < 1e-5);
    assert!(report.grad_norm > 0.0);

    // Gradient ascent on the surrogate: the loss on the same batch goes down, the good
    // trajectory becomes more likely and the bad one less.
    let (after, _) = t.eval_dapo(&batch).unwrap();
    assert!(after < before, "loss {before} -> {after}");
    let good_after = mean_trained_logprob(t.policy(), &batch[gi]);
    let bad_after = mean_trained_logprob(t.policy(), &batch[bi]);
    assert!(good_after > good_before, "{good_before} -> {good_after}");
    assert!(bad_after < bad_before, "{bad_before} -> {bad_after}");
}

#[test]
fn zero_advantages_leave_the_weights_alone() {
    // No KL term and no entropy bonus: a batch whose advantages are all 0 has no
    // gradient, so (without weight decay) the step changes nothing.
    let mut t = trainer(1e-2);
    let mut batch = group_batch(t.policy());
    for e in batch.iter_mut() {
        e.advantages.iter_mut().for_each(|a| *a = 0.0);
    }
    let before: Vec<Tensor> = t.named_parameters().map(|(_, p)| p.copy()).collect();
    let r = t.dapo_step(&batch).unwrap();
    assert_eq!(r.loss, 0.0);
    assert_eq!(r.grad_norm, 0.0);
    for ((name, p), q) in t.named_parameters().zip(&before) {
        assert!(p.equal(q), "{name} moved");
    }
}

#[test]
fn mixed_or_misaligned_batches_are_refused() {
    let dapo = TrainExample {
        tokens: vec![1, 2, 3],
        loss_mask: vec![false, true, true],
        advantages: vec![0.0, 1.0, 1.0],
        old_logprobs: vec![0.0, -1.0, -1.0],
        loss_kind: tutor_proto::LossKind::Dapo as i32,
        ..Default::default()
    };
    let ce = TrainExample {
        tokens: vec![1, 2],
        loss_mask: vec![false, true],
        ..Default::default()
    };
    let err = StepExamples::from_proto(vec![dapo.clone(), ce.clone()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("mixes loss kinds"), "{err}");
    let short = TrainExample {
        old_logprobs: vec![0.0],
        ..dapo.clone()
    };
    let err = StepExamples::from_proto(vec![short])
        .unwrap_err()
        .to_string();
    assert!(err.contains("old log-probs"), "{err}");
    assert_eq!(
        StepExamples::from_proto(vec![ce]).unwrap(),
        StepExamples::CrossEntropy(vec![(vec![1, 2], vec![false, true])])
    );
    assert!(matches!(
        StepExamples::from_proto(vec![dapo]).unwrap(),
        StepExamples::Dapo(_)
    ));
}

/// Issue 16, item 8: numbers the learner cannot train on are refused when the batch is
/// read, naming the episode and turn, before anything reaches a tensor: a cross-entropy
/// mask whose length is not the example's, a non-finite advantage or old log-prob.
#[test]
fn examples_the_learner_cannot_train_on_are_refused_naming_the_episode() {
    let ce = TrainExample {
        episode_id: "it000-train0001-g0a0".into(),
        turn_index: 3,
        tokens: vec![1, 2, 3],
        loss_mask: vec![false, true],
        ..Default::default()
    };
    let err = StepExamples::from_proto(vec![ce]).unwrap_err().to_string();
    assert!(
        err.contains("it000-train0001-g0a0") && err.contains("turn 3") && err.contains("mask"),
        "{err}"
    );
    let dapo = TrainExample {
        episode_id: "it001-train0002-g1a0".into(),
        turn_index: 0,
        tokens: vec![1, 2, 3],
        loss_mask: vec![false, true, true],
        advantages: vec![0.0, f32::NAN, 1.0],
        old_logprobs: vec![0.0, -1.0, -1.0],
        loss_kind: tutor_proto::LossKind::Dapo as i32,
    };
    let err = StepExamples::from_proto(vec![dapo.clone()])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("it001-train0002-g1a0") && err.contains("advantage") && err.contains("finite"),
        "{err}"
    );
    let inf = TrainExample {
        advantages: vec![0.0, 1.0, 1.0],
        old_logprobs: vec![0.0, f32::NEG_INFINITY, -1.0],
        ..dapo
    };
    let err = StepExamples::from_proto(vec![inf.clone()])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("old log-prob") && err.contains("finite"),
        "{err}"
    );
    // The same example with finite numbers is taken.
    let fine = TrainExample {
        old_logprobs: vec![0.0, -1.0, -1.0],
        ..inf
    };
    assert!(matches!(
        StepExamples::from_proto(vec![fine]).unwrap(),
        StepExamples::Dapo(_)
    ));
}

/// A token id the model has no embedding for is refused when the batch is read, for the
/// model's vocabulary, naming the episode, turn, id and vocabulary size; ids below it are
/// taken. Both objectives.
#[test]
fn token_ids_outside_the_vocabulary_are_refused_naming_episode_turn_and_id() {
    let ce = TrainExample {
        episode_id: "it002-train0003-g0a1".into(),
        turn_index: 4,
        tokens: vec![1, 63, 64, 2],
        loss_mask: vec![false, false, true, true],
        ..Default::default()
    };
    let err = StepExamples::from_proto_for_vocab(vec![ce.clone()], 64)
        .unwrap_err()
        .to_string();
    for want in [
        "it002-train0003-g0a1",
        "turn 4",
        "token id 64",
        "at token 2",
        "vocabulary of 64",
    ] {
        assert!(err.contains(want), "{want:?} missing from: {err}");
    }
    assert!(matches!(
        StepExamples::from_proto_for_vocab(vec![ce], 65).unwrap(),
        StepExamples::CrossEntropy(_)
    ));
    let dapo = TrainExample {
        episode_id: "it002-train0004-g1a0".into(),
        turn_index: 1,
        tokens: vec![1, 2, 1000],
        loss_mask: vec![false, true, true],
        advantages: vec![0.0, 1.0, 1.0],
        old_logprobs: vec![0.0, -1.0, -1.0],
        loss_kind: tutor_proto::LossKind::Dapo as i32,
    };
    let err = StepExamples::from_proto_for_vocab(vec![dapo.clone()], 64)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("it002-train0004-g1a0") && err.contains("token id 1000"),
        "{err}"
    );
    assert!(matches!(
        StepExamples::from_proto_for_vocab(vec![dapo], 1001).unwrap(),
        StepExamples::Dapo(_)
    ));
}
