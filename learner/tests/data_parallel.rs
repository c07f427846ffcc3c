//! Data parallel on CPU: two ranks, each on its share of every batch, end with the same
//! parameters as one rank on the whole batch.

mod common;

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tutor_collective::{CpuCollective, CpuCollectiveTimeouts, CpuRendezvous};
use tutor_learner::trainer::rank_shard;
use tutor_learner::{LearnerConfig, Trainer};

use common::{max_rel_diff, params, tiny_policy, Snapshot};

type Example = (Vec<u32>, Vec<bool>);

fn config() -> LearnerConfig {
    LearnerConfig {
        learning_rate: 1e-2,
        warmup_steps: 1,
        weight_decay: 0.01,
        grad_clip: 1.0,
        ..Default::default()
    }
}

/// Batches of examples with uneven lengths and label counts, so the ranks' shares hold
/// different numbers of label tokens (a plain mean of per-rank means would be wrong).
fn batches(n: usize) -> Vec<Vec<Example>> {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    (0..n)
        .map(|_| {
            (0..5)
                .map(|_| {
                    let len = rng.gen_range(4..20);
                    let ctx = rng.gen_range(1..len - 1);
                    let tokens = (0..len).map(|_| rng.gen_range(1..64)).collect();
                    let mask = (0..len).map(|j| j >= ctx).collect();
                    (tokens, mask)
                })
                .collect()
        })
        .collect()
}

/// Norm-wise relative error ‖a − b‖₂ / ‖b‖₂ over all parameters.
fn rel_error(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        for (x, y) in va.iter().zip(vb) {
            num += ((x - y) as f64).powi(2);
            den += (*y as f64).powi(2);
        }
    }
    (num / den).sqrt()
}

/// Runs `batches` on two ranks (threads, TCP loopback). Rank 1 starts from different
/// random weights: the initial broadcast must make them rank 0's. Returns each rank's
/// parameters after step 1 and after the last step.
fn two_ranks(batches: &[Vec<Example>]) -> Vec<[Snapshot; 2]> {
    let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
    let addr = rdv.local_addr();
    let timeouts = CpuCollectiveTimeouts {
        connect: Duration::from_secs(30),
        io: Duration::from_secs(60),
    };
    let run = |trainer: &mut Trainer, rank: usize| {
        let mut snaps = Vec::new();
        for (k, batch) in batches.iter().enumerate() {
            let share = rank_shard(batch, rank, 2);
            trainer.step(&share).unwrap();
            if k == 0 || k + 1 == batches.len() {
                snaps.push(params(trainer));
            }
        }
        [snaps.remove(0), snaps.remove(0)]
    };
    std::thread::scope(|s| {
        let leaf = s.spawn(|| {
            let c = CpuCollective::connect(addr, 1, 2, timeouts).unwrap();
            let mut t = Trainer::with_collective(tiny_policy(99), config(), Box::new(c)).unwrap();
            run(&mut t, 1)
        });
        let c = rdv.accept(2, timeouts).unwrap();
        let mut t = Trainer::with_collective(tiny_policy(3), config(), Box::new(c)).unwrap();
        let root = run(&mut t, 0);
        vec![root, leaf.join().unwrap()]
    })
}

#[test]
fn two_cpu_ranks_on_split_batches_equal_one_rank_on_the_union() {
    let batches = batches(3);
    // Sanity: the split really is uneven in label tokens.
    let labels = |ex: &[Example]| -> usize {
        ex.iter()
            .map(|(_, m)| m.iter().skip(1).filter(|&&b| b).count())
            .sum()
    };
    assert_ne!(
        labels(&rank_shard(&batches[0], 0, 2)),
        labels(&rank_shard(&batches[0], 1, 2))
    );

    let mut single = Trainer::new(tiny_policy(3), config()).unwrap();
    let mut single_snaps = Vec::new();
    for batch in &batches {
        single.step(batch).unwrap();
        single_snaps.push(params(&single));
    }
    let union_after_1 = &single_snaps[0];
    let union_after_3 = &single_snaps[2];

    let ranks = two_ranks(&batches);
    for (rank, [after_1, after_3]) in ranks.iter().enumerate() {
        // Over all weights: f32 rounding (measured ~3e-7).
        let n1 = rel_error(after_1, union_after_1);
        let n3 = rel_error(after_3, union_after_3);
        assert!(n1 <= 1e-5, "rank {rank} after 1 step: relative error {n1}");
        assert!(n3 <= 1e-5, "rank {rank} after 3 steps: relative error {n3}");
        // Weight by weight the bound is looser: Adam's update lr·m/(√v + eps) turns the
        // f32 rounding of a near-zero gradient (the reduced gradients agree to ~2e-7
        // relative, tensor by tensor) into a visible share of lr for that one weight
        // (measured 3e-5 of the tensor's scale in one MLP weight).
        let d1 = max_rel_diff(after_1, union_after_1);
        let d3 = max_rel_diff(after_3, union_after_3);
        assert!(
            d1 <= 1e-4,
            "rank {rank} after 1 step: max relative diff {d1}"
        );
        assert!(
            d3 <= 1e-4,
            "rank {rank} after 3 steps: max relative diff {d3}"
        );
    }
    // The ranks agree with each other exactly: they apply the same reduced gradients.
    assert_eq!(ranks[0][1], ranks[1][1]);

    // Without the all-reduce (each rank alone on its share) the result is far off: the
    // comparison above can fail.
    let mut alone = Trainer::new(tiny_policy(3), config()).unwrap();
    for batch in &batches {
        alone.step(&rank_shard(batch, 0, 2)).unwrap();
    }
    let d = max_rel_diff(&params(&alone), union_after_3);
    assert!(
        d > 1e-3,
        "training on half the batch should differ, diff {d}"
    );
}

/// A rank that joins late (a restart) gets rank 0's whole state — weights, AdamW moments
/// and step, schedule — so the group goes on exactly as one rank would.
#[test]
fn a_rank_joining_later_continues_from_rank_zeros_exact_state() {
    let batches = batches(4);
    let mut single = Trainer::new(tiny_policy(3), config()).unwrap();
    for batch in &batches {
        single.step(batch).unwrap();
    }

    // Rank 0 trains two batches alone, then leads a group; rank 1 starts from nothing.
    let mut lead = Trainer::new(tiny_policy(3), config()).unwrap();
    for batch in &batches[..2] {
        lead.step(batch).unwrap();
    }
    let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
    let addr = rdv.local_addr();
    let timeouts = CpuCollectiveTimeouts {
        connect: Duration::from_secs(30),
        io: Duration::from_secs(60),
    };
    let rest = batches[2..].to_vec();
    let theirs = rest.clone();
    let follower = std::thread::spawn(move || {
        let c = CpuCollective::connect(addr, 1, 2, timeouts).unwrap();
        let mut t = Trainer::join_group(Box::new(c)).unwrap();
        assert_eq!(t.steps(), 2);
        for batch in &theirs {
            t.step(&rank_shard(batch, 1, 2)).unwrap();
        }
        params(&t)
    });
    lead.lead_group(Box::new(rdv.accept(2, timeouts).unwrap()))
        .unwrap();
    for batch in &rest {
        lead.step(&rank_shard(batch, 0, 2)).unwrap();
    }
    let follower = follower.join().unwrap();
    assert_eq!(params(&lead), follower, "the ranks agree exactly");
    let d = max_rel_diff(&follower, &params(&single));
    assert!(d <= 1e-4, "max relative diff to one rank: {d}");
    // Without the optimizer state (fresh AdamW moments on rank 1) the ranks would apply
    // different updates and the assertion above would fail.
}

/// Mixed precision in a group: a joining rank gets rank 0's fp32 master weights (not the
/// bf16 parameters' rounding), and the ranks stay equal to the bit.
#[test]
fn a_bf16_rank_joining_later_gets_rank_zeros_fp32_master() {
    if std::env::var_os("ONEDNN_MAX_CPU_ISA").is_none() {
        std::env::set_var("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16");
    }
    let config = LearnerConfig {
        precision: tutor_learner::config::Precision::Bf16,
        ..config()
    };
    let batches = batches(3);
    let master = |t: &Trainer| -> Snapshot {
        t.master_weights()
            .expect("bf16 keeps master weights")
            .map(|(n, p)| (n.to_string(), Vec::try_from(p.reshape([-1])).unwrap()))
            .collect()
    };
    let mut lead = Trainer::new(tiny_policy(3), config).unwrap();
    lead.step(&batches[0]).unwrap();
    let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
    let addr = rdv.local_addr();
    let timeouts = CpuCollectiveTimeouts {
        connect: Duration::from_secs(30),
        io: Duration::from_secs(60),
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let rest = batches[1..].to_vec();
    let theirs = rest.clone();
    let follower = std::thread::spawn(move || {
        let c = CpuCollective::connect(addr, 1, 2, timeouts).unwrap();
        let mut t = Trainer::join_group(Box::new(c)).unwrap();
        tx.send(master(&t)).unwrap();
        for batch in &theirs {
            t.step(&rank_shard(batch, 1, 2)).unwrap();
        }
        master(&t)
    });
    lead.lead_group(Box::new(rdv.accept(2, timeouts).unwrap()))
        .unwrap();
    let joined = rx.recv().unwrap();
    assert!(
        joined == master(&lead),
        "the joining rank starts from rank 0's master"
    );
    let rounded: Snapshot = master(&lead)
        .into_iter()
        .map(|(n, v)| {
            let t = tch::Tensor::from_slice(&v).to_kind(tch::Kind::BFloat16);
            (n, Vec::try_from(t.to_kind(tch::Kind::Float)).unwrap())
        })
        .collect();
    assert!(
        joined != rounded,
        "the master holds more than the bf16 weights"
    );
    for batch in &rest {
        lead.step(&rank_shard(batch, 0, 2)).unwrap();
    }
    assert_eq!(
        master(&lead),
        follower.join().unwrap(),
        "the ranks agree exactly"
    );
}
