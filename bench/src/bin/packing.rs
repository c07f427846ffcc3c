//! Prefix-shared DAgger rows vs separate examples: tokens processed and forward+backward
//! time for one trajectory, at 10 and 30 turns.
//!
//! `cargo run --release -p tutor-bench --bin packing [-- --turns 10,30 --reps 3 --student 0.5
//! --threads 1]`
//!
//! A seeded synthetic trajectory (prompt ~400 tokens, observations ~200, actions ~60; the
//! student executes a turn with probability `--student`) on a tiny random model
//! (`ModelConfig::tiny`, 2 layers, hidden 128) on the CPU. Naive: every DAgger example
//! (`dagger_examples`) as its own sequence, one forward+backward each, gradients
//! accumulated (no padding: the cheapest way to run them separately). Packed: the same
//! examples through `pack_examples` (a trie: shared prefixes get one slot) into one row,
//! one `forward_tree` + backward. Both compute the same summed label NLL (printed), so the
//! same gradients. Step times are wall seconds (median over `--reps` after a warm-up) and,
//! less sensitive to other load on the machine, the CPU seconds the process used.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use tch::{Device, Tensor};
use tutor_bench::median;
use tutor_coordinator::dataset::dagger_examples;
use tutor_learner::loss::{masked_cross_entropy, packed_nll_sum, PaddedBatch};
use tutor_learner::packing::{pack_examples, PackedBatch};
use tutor_policy::{ModelConfig, Policy};
use tutor_proto::{Actor, TurnRecord};

const VOCAB: u32 = 4096;

fn trajectory(turns: usize, student_p: f64, seed: u64) -> Vec<TurnRecord> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let toks = |rng: &mut rand_chacha::ChaCha8Rng, mean: usize| {
        let len = rng.gen_range(mean * 3 / 4..=mean * 5 / 4);
        (0..len)
            .map(|_| rng.gen_range(1..VOCAB))
            .collect::<Vec<u32>>()
    };
    (0..turns)
        .map(|i| {
            let delta = toks(&mut rng, if i == 0 { 400 } else { 200 });
            let teacher = toks(&mut rng, 60);
            let student = toks(&mut rng, 60);
            let executed = if rng.gen_bool(student_p) {
                Actor::Student
            } else {
                Actor::Teacher
            };
            TurnRecord {
                turn_index: i as u32,
                context_delta_tokens: delta,
                teacher_tokens: teacher,
                student_tokens: student,
                executed: executed as i32,
                ..Default::default()
            }
        })
        .collect()
}

/// CPU seconds (user + system, all threads) this process has used: less disturbed than
/// wall time by other work on the machine. Linux only (`/proc/self/stat`, 100 Hz ticks).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<f64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    f.iter().sum::<f64>() / 100.0
}

fn main() {
    let mut turn_counts = vec![10usize, 30];
    let mut reps = 3usize;
    let mut student_p = 0.5f64;
    // One thread by default: with other work on the machine, OpenMP threads spinning on
    // busy cores distort both wall and CPU time (see docs/internals.md, worker threads).
    let mut threads = 1i32;
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        match (pair[0].as_str(), pair.get(1)) {
            ("--turns", Some(v)) => {
                turn_counts = v.split(',').map(|x| x.parse().expect("--turns")).collect()
            }
            ("--reps", Some(v)) => reps = v.parse().expect("--reps"),
            ("--student", Some(v)) => student_p = v.parse().expect("--student"),
            ("--threads", Some(v)) => threads = v.parse().expect("--threads"),
            _ => panic!("usage: packing [--turns 10,30] [--reps 3] [--student 0.5] [--threads 1]"),
        }
    }
    tch::set_num_threads(threads);
    let device = Device::Cpu;
    let policy = Policy::new(ModelConfig::tiny(VOCAB as usize), device, 0);
    let vars: Vec<Tensor> = policy.var_store().trainable_variables();
    let zero_grads = || {
        for v in &vars {
            let mut g = v.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    };
    println!(
        "tiny model ({} params), CPU, {} torch threads, student executes p={student_p}, median of {reps}",
        policy.config().num_parameters(),
        tch::get_num_threads()
    );
    println!(
        "{:>5} {:>8} {:>9} {:>9} {:>9} {:>6} {:>9} {:>9} {:>6} {:>12}",
        "turns",
        "examples",
        "naive tok",
        "padded",
        "packed L",
        "ratio",
        "naive s",
        "packed s",
        "ratio",
        "loss n / p"
    );
    for &n in &turn_counts {
        let turns = trajectory(n, student_p, 7 + n as u64);
        let max_seq_len = 1 << 20;
        let examples: Vec<(Vec<u32>, Vec<bool>)> = dagger_examples("bench", &turns, max_seq_len)
            .into_iter()
            .map(|e| (e.tokens, e.loss_mask))
            .collect();
        let naive_tokens: usize = examples.iter().map(|e| e.0.len()).sum();
        let padded_tokens = examples.len() * examples.iter().map(|e| e.0.len()).max().unwrap_or(0);

        let mut naive_times = Vec::new();
        let mut naive_cpu = Vec::new();
        let mut naive_loss = 0.0;
        for _ in 0..=reps {
            zero_grads();
            let (start, cpu) = (Instant::now(), cpu_seconds());
            let mut total = 0.0;
            for ex in &examples {
                let b = PaddedBatch::new(std::slice::from_ref(ex), device);
                let logits = policy.forward(&b.input_ids, &b.attention_mask);
                let loss = masked_cross_entropy(&logits, &b.input_ids, &b.loss_mask)
                    * b.label_tokens as f64;
                loss.backward();
                total += loss.double_value(&[]);
            }
            naive_times.push(start.elapsed().as_secs_f64());
            naive_cpu.push(cpu_seconds() - cpu);
            naive_loss = total;
        }
        naive_times.remove(0); // warm-up
        naive_cpu.remove(0);

        let mut packed_times = Vec::new();
        let mut packed_cpu = Vec::new();
        let mut prep_times = Vec::new();
        let mut packed_loss = 0.0;
        let mut packed_len = 0;
        for _ in 0..=reps {
            zero_grads();
            let start = Instant::now();
            // One row budget as large as the longest allowed example: the trajectory's
            // examples share their first token, so they form one tree in one row.
            let rows = pack_examples(&examples, max_seq_len);
            let b = PackedBatch::new(&rows, device);
            prep_times.push(start.elapsed().as_secs_f64());
            let (start, cpu) = (Instant::now(), cpu_seconds());
            let logits = policy.forward_tree(&b.input_ids, &b.position_ids, &b.allowed);
            let loss = packed_nll_sum(&logits, &b);
            loss.backward();
            packed_loss = loss.double_value(&[]);
            packed_times.push(start.elapsed().as_secs_f64());
            packed_cpu.push(cpu_seconds() - cpu);
            packed_len = rows.iter().map(|r| r.len()).sum::<usize>();
        }
        packed_times.remove(0);
        packed_cpu.remove(0);
        prep_times.remove(0);
        let (tn, tp) = (median(naive_times), median(packed_times));
        let (cn, cp) = (median(naive_cpu), median(packed_cpu));
        println!(
            "{:>5} {:>8} {:>9} {:>9} {:>9} {:>6.2} {:>9.3} {:>9.3} {:>6.2} {:>12}",
            n,
            examples.len(),
            naive_tokens,
            padded_tokens,
            packed_len,
            naive_tokens as f64 / packed_len as f64,
            tn,
            tp,
            tn / tp,
            format!("{naive_loss:.1}/{packed_loss:.1}"),
        );
        println!(
            "      CPU seconds: naive {cn:.2}, packed {cp:.2}, ratio {:.2}; packing + [L, L] mask \
             build {:.3} s wall (not in the packed step time)",
            cn / cp.max(0.01),
            median(prep_times)
        );
    }
}
