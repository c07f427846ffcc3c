//! DAgger's aggregated dataset grows with the run, but the coordinator's memory does
//! not: with the examples' file (`ExampleSpill`, what `tutor coordinator` makes in its
//! run directory) every example goes to disk as its episode ends, memory keeps a few
//! dozen bytes of each, and a step's examples are read back only as the step is sent.
//! Measured with a counting allocator, so this binary holds one test.

use tutor_coordinator::config::CoordinatorConfig;
use tutor_coordinator::dataset::{
    make_batches, DatasetExample, EpisodeData, ExampleSpill, IterationDatasets, Step,
};
use tutor_proto::TrainExample;

#[path = "common/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::{allocated_now, peak_of};

const ITERATIONS: u32 = 6;
const EPISODES: u32 = 16;
const TURNS: u32 = 8;
/// Tokens of the first turn's example; each later turn's context is longer.
const TOKENS: usize = 1024;
/// About 12 examples a step.
const BATCH_TOKENS: usize = 16 * 1024;

/// The example of turn `t` of episode `ep` of iteration `k`: its content is a function of
/// the three, so a read-back example can be checked against it.
fn example(k: u32, ep: u32, t: u32) -> TrainExample {
    let n = TOKENS + 64 * t as usize;
    TrainExample {
        tokens: (0..n)
            .map(|i| (i as u32 * 7 + k * 131 + ep * 17 + t) % 50_000)
            .collect(),
        loss_mask: (0..n).map(|i| i + 40 >= n).collect(),
        episode_id: format!("it{k:03}-train{ep:04}-g0a0"),
        turn_index: t,
        ..Default::default()
    }
}

fn key(e: &TrainExample) -> (u32, u32, u32) {
    let k = e.episode_id[2..5].parse().unwrap();
    let ep = e.episode_id[11..15].parse().unwrap();
    (k, ep, e.turn_index)
}

/// Pushes every iteration's episodes as the scheduler does; returns the bytes the
/// datasets kept and the most allocated at once while pushing.
fn fill(datasets: &mut IterationDatasets) -> (usize, usize) {
    let before = allocated_now();
    let ((), peak) = peak_of(|| {
        for k in 0..ITERATIONS {
            datasets.open(k);
            for ep in 0..EPISODES {
                datasets.push(
                    k,
                    EpisodeData {
                        slot: ep as usize,
                        policy_version: u64::from(k),
                        examples: (0..TURNS).map(|t| example(k, ep, t)).collect(),
                        group: ep,
                        reward: 1.0,
                    },
                );
            }
            datasets.seal(k, u64::from(k));
        }
    });
    (allocated_now().saturating_sub(before), peak)
}

#[test]
fn an_aggregated_dataset_lives_on_disk_and_steps_are_read_as_they_are_sent() {
    let examples = (ITERATIONS * EPISODES * TURNS) as usize;
    let one = example(0, 0, TURNS - 1);
    let example_bytes = one.tokens.len() * 4 + one.loss_mask.len();
    let dataset_bytes = examples * example_bytes;
    let last = ITERATIONS - 1;

    // In memory (no examples' file): the dataset costs what its examples do.
    let mut in_memory = IterationDatasets::new(CoordinatorConfig::default());
    let (kept_in_memory, _) = fill(&mut in_memory);
    assert!(
        kept_in_memory > dataset_bytes / 2,
        "in memory: {kept_in_memory} bytes kept"
    );
    let planned_in_memory = make_batches(
        &in_memory.examples(last, true),
        last,
        BATCH_TOKENS,
        2,
        10_000,
        7,
    );
    drop(in_memory);

    // With the file: memory keeps a small share of that; the file holds the examples.
    let dir = tempfile::tempdir().unwrap();
    let spill = ExampleSpill::create_in(dir.path()).unwrap();
    let mut datasets = IterationDatasets::with_spill(CoordinatorConfig::default(), Some(spill));
    let (kept, peak) = fill(&mut datasets);
    assert_eq!(datasets.examples_in_memory(), 0);
    assert!(
        datasets.spilled_bytes() as usize > dataset_bytes / 2,
        "{} bytes in the file",
        datasets.spilled_bytes()
    );
    assert!(
        kept < dataset_bytes / 20,
        "{kept} bytes kept in memory for a {dataset_bytes}-byte dataset of {examples} examples"
    );
    // While pushing: what is kept, one episode's examples (made by this test) and one
    // encoded example.
    let episode_bytes = TURNS as usize * example_bytes;
    assert!(
        peak < kept + 3 * episode_bytes,
        "{peak} bytes at once while pushing ({kept} kept, an episode {episode_bytes})"
    );

    // The last iteration trains on all of it, two epochs: the plan holds handles only.
    let (steps, plan_peak) = peak_of(|| {
        let dataset: Vec<DatasetExample> = datasets.examples(last, true);
        assert_eq!(dataset.len(), examples);
        make_batches(&dataset, last, BATCH_TOKENS, 2, 10_000, 7)
    });
    assert!(steps.len() > 2 * examples / 16, "{} steps", steps.len());
    assert!(
        plan_peak < dataset_bytes / 10,
        "planning took {plan_peak} bytes at once"
    );
    // The same steps as from memory: where the examples are does not change training.
    let ids_of = |steps: &[Step<DatasetExample>]| -> Vec<(u32, Vec<(String, u32)>)> {
        steps
            .iter()
            .map(|s| {
                let loaded = s.load().unwrap();
                (
                    s.step,
                    loaded
                        .examples
                        .iter()
                        .map(|e| (e.episode_id.clone(), e.turn_index))
                        .collect(),
                )
            })
            .collect()
    };
    let spilled_plan = ids_of(&steps);
    let memory_plan = ids_of(&planned_in_memory);
    assert!(planned_in_memory
        .iter()
        .all(|s| s.examples.iter().all(|e| !e.is_spilled())));
    assert!(steps
        .iter()
        .all(|s| s.examples.iter().all(|e| e.is_spilled())));
    assert_eq!(spilled_plan, memory_plan);

    // Sending: each step is read as it goes, equal to what was pushed; memory holds
    // about one step at a time, and nothing stays.
    // Counts by example, allocated before the measure.
    let mut seen = vec![0u32; examples];
    let before = allocated_now();
    let mut most = 0usize;
    for s in &steps {
        let (batch, peak) = peak_of(|| s.load().unwrap());
        most = most.max(peak);
        for e in &batch.examples {
            let (k, ep, t) = key(e);
            assert_eq!(*e, example(k, ep, t), "read back as pushed");
            seen[((k * EPISODES + ep) * TURNS + t) as usize] += 1;
        }
    }
    assert!(seen.iter().all(|&n| n == 2), "each example once per epoch");
    let step_bytes = BATCH_TOKENS * 5;
    assert!(
        most < 3 * step_bytes,
        "reading a step took {most} bytes at once (a step is about {step_bytes})"
    );
    let left = allocated_now().saturating_sub(before);
    assert!(left <= 4096, "{left} bytes of the steps read were kept");
    eprintln!(
        "{examples} examples ({dataset_bytes} bytes of tokens and masks), {kept_in_memory} bytes kept in memory without the file; with it: \
         {kept} bytes kept, {} bytes in the file, {} steps planned in {plan_peak} bytes, \
         at most {most} bytes to read a step",
        datasets.spilled_bytes(),
        steps.len()
    );
}
