//! The dataset of each iteration (D_i, and D = ∪ D_i when aggregating): the counted
//! training episodes' examples, and the staleness filter that leaves out episodes lagging
//! the learner by more than `max_staleness` (async mode). Without aggregation
//! (`CoordinatorConfig::aggregates`) only the newest iteration is trained on: opening
//! iteration i drops the examples of the iterations before i − 1 (i − 1 may still be
//! training in async mode), keeping their label counts, so memory holds at most two
//! iterations' examples however long the run. With aggregation and an examples' file
//! (`ExampleSpill`, in the run directory) every example goes to the file as its episode
//! ends, and memory holds only what batching needs of each (`DatasetExample`).

use std::collections::BTreeMap;

use tutor_proto::TrainExample;

use super::spill::{DatasetExample, ExampleSpill};
use crate::algorithms::{dapo_examples, group_stats, GroupedEpisode};
use crate::config::{Algorithm, CoordinatorConfig, ScheduleMode};
use crate::rollouts::GroupStats;

/// The training examples of one counted training episode, with the policy version the
/// episode was sampled with (for the staleness filter), its group and its reward (dapo).
pub struct EpisodeData {
    /// The episode's slot in its iteration's plan: the dataset's order, so that the
    /// batches do not depend on which worker finished first.
    pub slot: usize,
    pub policy_version: u64,
    pub examples: Vec<TrainExample>,
    pub group: u32,
    pub reward: f64,
}

/// A pushed episode as the datasets keep it: its examples in memory or in the file.
struct StoredEpisode {
    slot: usize,
    policy_version: u64,
    examples: Vec<DatasetExample>,
    group: u32,
    reward: f64,
}

/// Counted training episodes by iteration, and per iteration whose training started:
/// the learner version it started from and how many of its episodes were too stale.
pub struct IterationDatasets {
    config: CoordinatorConfig,
    /// Where examples go when aggregating (None: they stay in memory).
    spill: Option<ExampleSpill>,
    /// Whether the last write to `spill` failed.
    spill_failing: bool,
    episodes: BTreeMap<u32, Vec<StoredEpisode>>,
    /// Iterations whose examples were dropped (not aggregating): their label counts.
    dropped: BTreeMap<u32, u64>,
    train_bases: BTreeMap<u32, u64>,
    stale: BTreeMap<u32, u64>,
}

impl IterationDatasets {
    /// Datasets keeping every example in memory.
    pub fn new(config: CoordinatorConfig) -> Self {
        Self::with_spill(config, None)
    }

    /// Datasets writing the examples to `spill` when the run aggregates (its examples
    /// then grow with the run); without aggregation `spill` is not used.
    pub fn with_spill(config: CoordinatorConfig, spill: Option<ExampleSpill>) -> Self {
        Self {
            spill: spill.filter(|_| config.aggregates()),
            spill_failing: false,
            config,
            episodes: BTreeMap::new(),
            dropped: BTreeMap::new(),
            train_bases: BTreeMap::new(),
            stale: BTreeMap::new(),
        }
    }

    /// Starts `iteration`'s dataset empty (a replanned iteration is counted again).
    /// Without aggregation, drops the examples of the iterations before the previous
    /// one: no batch needs them again.
    pub fn open(&mut self, iteration: u32) {
        self.dropped.remove(&iteration);
        self.episodes.insert(iteration, Vec::new());
        if !self.config.aggregates() {
            let kept = self.episodes.split_off(&iteration.saturating_sub(1));
            for (k, eps) in std::mem::replace(&mut self.episodes, kept) {
                let labels = eps.iter().map(|e| e.examples.len() as u64).sum();
                self.dropped.insert(k, labels);
            }
        }
    }

    /// Training examples held in memory (not in the examples' file), over every
    /// iteration.
    pub fn examples_in_memory(&self) -> usize {
        self.episodes
            .values()
            .flatten()
            .flat_map(|e| &e.examples)
            .filter(|x| !x.is_spilled())
            .count()
    }

    /// Bytes written to the examples' file (0 without one).
    pub fn spilled_bytes(&self) -> u64 {
        self.spill.as_ref().map_or(0, ExampleSpill::len)
    }

    /// Adds a finished episode, in slot order: the examples (and so the seeded batch
    /// order) of an iteration are the same whichever order its episodes finished in.
    /// With an examples' file they are written there; one that cannot be written (a
    /// full disk) is kept in memory instead, with a warning: nothing is lost.
    pub fn push(&mut self, iteration: u32, episode: EpisodeData) {
        // Sized for the handles (not reusing the examples' larger allocation).
        let mut examples = Vec::with_capacity(episode.examples.len());
        for x in episode.examples {
            examples.push(match self.spill.as_mut().map(|f| f.append(&x)) {
                Some(Ok(stored)) => {
                    if std::mem::take(&mut self.spill_failing) {
                        tracing::info!("training examples go to the examples' file again");
                    }
                    stored
                }
                Some(Err(e)) => {
                    // Said once until a write succeeds again (a full disk fails them all).
                    if !std::mem::replace(&mut self.spill_failing, true) {
                        tracing::warn!(
                            iteration,
                            episode = %x.episode_id,
                            turn = x.turn_index,
                            error = %e,
                            "could not write a training example to the examples' file in the \
                             run directory: it and the next ones that fail are kept in memory"
                        );
                    }
                    DatasetExample::in_memory(x)
                }
                None => DatasetExample::in_memory(x),
            });
        }
        let episode = StoredEpisode {
            slot: episode.slot,
            policy_version: episode.policy_version,
            examples,
            group: episode.group,
            reward: episode.reward,
        };
        let eps = self.episodes.entry(iteration).or_default();
        let at = eps.partition_point(|e| e.slot <= episode.slot);
        eps.insert(at, episode);
    }

    /// Teacher labels (DAgger examples) of the iterations up to `iteration`.
    pub fn teacher_labels_through(&self, iteration: u32) -> u64 {
        let dropped: u64 = self.dropped.range(..=iteration).map(|(_, n)| n).sum();
        self.episodes
            .range(..=iteration)
            .flat_map(|(_, eps)| eps)
            .map(|e| e.examples.len() as u64)
            .sum::<u64>()
            + dropped
    }

    /// Records that training on `iteration` starts from learner version `base_version`
    /// and returns how many of its episodes are too stale to train on.
    /// An iteration whose examples were dropped keeps the count it was sealed with.
    pub fn seal(&mut self, iteration: u32, base_version: u64) -> u64 {
        self.train_bases.insert(iteration, base_version);
        if self.dropped.contains_key(&iteration) {
            return self.stale.get(&iteration).copied().unwrap_or(0);
        }
        let stale = self
            .episodes
            .get(&iteration)
            .map(|eps| eps.iter().filter(|e| self.is_stale(iteration, e)).count())
            .unwrap_or(0) as u64;
        if stale > 0 {
            tracing::warn!(
                iteration,
                stale,
                base_version,
                max_staleness = self.config.max_staleness,
                "episodes too stale to train on"
            );
        }
        self.stale.insert(iteration, stale);
        stale
    }

    /// Episodes left out for staleness, over the iterations sealed so far.
    pub fn stale_total(&self) -> u64 {
        self.stale.values().sum()
    }

    /// Whether an episode of `iteration` lags the version its training started from by
    /// more than `max_staleness`. Only async mode filters: in sync mode an iteration's
    /// episodes are sampled with the version its training starts from.
    fn is_stale(&self, iteration: u32, e: &StoredEpisode) -> bool {
        self.config.mode == ScheduleMode::Async
            && self.train_bases.get(&iteration).is_some_and(|base| {
                base.saturating_sub(e.policy_version) > self.config.max_staleness
            })
    }

    /// The training examples of `iteration` (with `aggregate`, of every iteration up to
    /// it), less the episodes the staleness filter left out, in memory or in the
    /// examples' file. `aggregate` is `config.aggregates()`: without it, iterations
    /// before `iteration - 1` are gone.
    pub fn examples(&self, iteration: u32, aggregate: bool) -> Vec<DatasetExample> {
        let first = if aggregate { 0 } else { iteration };
        if self.config.algorithm == Algorithm::Dapo {
            // Advantages are normalised within each iteration's groups. DAPO does not
            // aggregate, so its examples are in memory.
            return self
                .episodes
                .range(first..=iteration)
                .flat_map(|(&k, eps)| {
                    let kept: Vec<(&StoredEpisode, Vec<TrainExample>)> = eps
                        .iter()
                        .filter(|e| !self.is_stale(k, e))
                        .filter_map(|e| match load_all(&e.examples) {
                            Ok(examples) => Some((e, examples)),
                            Err(err) => {
                                tracing::error!(
                                    iteration = k,
                                    slot = e.slot,
                                    error = %err,
                                    "a DAPO episode's examples could not be read: left out"
                                );
                                None
                            }
                        })
                        .collect();
                    let grouped: Vec<GroupedEpisode> = kept
                        .iter()
                        .map(|(e, examples)| GroupedEpisode {
                            group: e.group,
                            reward: e.reward,
                            examples,
                        })
                        .collect();
                    dapo_examples(&grouped, self.config.advantage_eps).0
                })
                .map(DatasetExample::in_memory)
                .collect();
        }
        self.episodes
            .range(first..=iteration)
            .flat_map(|(&k, eps)| eps.iter().map(move |e| (k, e)))
            .filter(|(k, e)| !self.is_stale(*k, e))
            .flat_map(|(_, e)| e.examples.iter().cloned())
            .collect()
    }

    /// Kept and dropped groups among `iteration`'s finished episodes.
    pub fn group_stats(&self, iteration: u32) -> GroupStats {
        group_stats(
            self.episodes
                .get(&iteration)
                .into_iter()
                .flatten()
                .map(|e| (e.group, e.reward)),
        )
    }

    /// The mean reward of `iteration`'s training episodes; None before the first.
    pub fn mean_reward(&self, iteration: u32) -> Option<f64> {
        let rewards: Vec<f64> = self
            .episodes
            .get(&iteration)
            .map(|eps| eps.iter().map(|e| e.reward).collect())
            .unwrap_or_default();
        (!rewards.is_empty()).then(|| rewards.iter().sum::<f64>() / rewards.len() as f64)
    }
}

/// The examples themselves, read from the file where they are there.
fn load_all(examples: &[DatasetExample]) -> std::io::Result<Vec<TrainExample>> {
    examples.iter().map(DatasetExample::load).collect()
}

#[cfg(test)]
mod tests {
    use tutor_proto::{episode_event, EpisodeEvent, Task, TrainExample, TurnRecord};

    use super::{EpisodeData, IterationDatasets};
    use crate::dataset::{BatchItem, ExampleSpill};

    use crate::config::{CoordinatorConfig, ScheduleMode};
    use crate::scheduler::tests::outcome;
    use crate::scheduler::SchedulerHandle;

    /// Three training episodes sampled with versions 1, 2 and 3; training starts from
    /// version 3. With max_staleness 1 the version-1 episode (lag 2) is left out of
    /// training and counted; sync mode trains on everything.
    async fn stale_filter(mode: ScheduleMode) -> (u64, Vec<String>, u64) {
        let config = CoordinatorConfig {
            episodes_per_iteration: 3,
            heldout_episodes: 0,
            mode,
            max_staleness: 1,
            ..Default::default()
        };
        let sched = SchedulerHandle::spawn(config, vec![Task::default()], vec![]);
        let (worker, _) = sched.register("w".into(), 4).await.unwrap();
        let runner = sched.clone();
        let iteration = tokio::spawn(async move { runner.run_iteration(0, 1.0).await });
        let mut leases = Vec::new();
        while leases.len() < 3 {
            leases.extend(sched.lease(worker.clone(), 3).await.unwrap().leases);
        }
        for (l, version) in leases.iter().zip([1u64, 2, 3]) {
            sched
                .stored(EpisodeEvent {
                    episode_id: l.episode_id.clone(),
                    worker_id: worker.clone(),
                    event: Some(episode_event::Event::Turn(TurnRecord {
                        teacher_tokens: vec![7],
                        policy_version: version,
                        ..Default::default()
                    })),
                })
                .await;
            let mut ev = outcome(&l.episode_id);
            if let Some(episode_event::Event::Outcome(o)) = ev.event.as_mut() {
                o.policy_version = version;
            }
            sched.stored(ev).await;
        }
        iteration.await.unwrap().unwrap();
        let stale = sched.seal(0, 3).await;
        let trained = sched
            .examples(0, true)
            .await
            .into_iter()
            .map(|e| e.episode_id)
            .collect();
        let total = sched.snapshot().await.unwrap().stale_episodes_total;
        assert_eq!(total, stale);
        (stale, trained, leases.len() as u64)
    }

    #[tokio::test]
    async fn async_mode_leaves_out_episodes_staler_than_max_staleness() {
        let (stale, trained, _) = stale_filter(ScheduleMode::Async).await;
        assert_eq!(stale, 1);
        assert_eq!(trained.len(), 2, "{trained:?}");
        assert!(
            trained.iter().all(|id| id != "it000-train0000-g0a0"),
            "{trained:?}"
        );
        let (stale, trained, _) = stale_filter(ScheduleMode::Sync).await;
        assert_eq!((stale, trained.len()), (0, 3));
    }

    /// Runs `iterations` iterations of 2 episodes of 3 examples each through datasets
    /// of `config`, training each on `examples(k, aggregates)` as the driver does;
    /// returns the datasets and the examples each iteration trained on.
    fn run(config: CoordinatorConfig, iterations: u32) -> (IterationDatasets, Vec<usize>) {
        run_with(config, iterations, None)
    }

    /// `run` with an examples' file.
    fn run_with(
        config: CoordinatorConfig,
        iterations: u32,
        spill: Option<ExampleSpill>,
    ) -> (IterationDatasets, Vec<usize>) {
        let aggregate = config.aggregates();
        let mut datasets = IterationDatasets::with_spill(config, spill);
        let mut trained = Vec::new();
        for k in 0..iterations {
            datasets.open(k);
            for ep in 0..2 {
                datasets.push(
                    k,
                    EpisodeData {
                        slot: ep as usize,
                        policy_version: u64::from(k),
                        examples: (0..3)
                            .map(|t| TrainExample {
                                tokens: vec![k + 1; 8 + t as usize],
                                loss_mask: vec![true; 8 + t as usize],
                                episode_id: format!("it{k}-ep{ep}"),
                                turn_index: t,
                                ..Default::default()
                            })
                            .collect(),
                        group: ep,
                        reward: 1.0,
                    },
                );
            }
            datasets.seal(k, u64::from(k));
            trained.push(datasets.examples(k, aggregate).len());
        }
        (datasets, trained)
    }

    /// Without aggregation only the newest iteration is trained on: after many
    /// iterations the datasets hold the last two iterations' examples (the previous one
    /// may still be training in async mode), and the label counts of all. With
    /// aggregation every iteration is kept and trained on.
    #[test]
    fn without_aggregation_finished_iterations_are_not_kept() {
        let config = CoordinatorConfig {
            aggregate: false,
            ..Default::default()
        };
        let (datasets, trained) = run(config, 10);
        assert_eq!(trained, vec![6; 10]);
        assert_eq!(datasets.examples_in_memory(), 12, "iterations 8 and 9");
        assert_eq!(datasets.teacher_labels_through(9), 60);
        assert_eq!(datasets.teacher_labels_through(4), 30);
        assert_eq!(datasets.examples(9, false).len(), 6);

        let (datasets, trained) = run(CoordinatorConfig::default(), 10);
        assert_eq!(trained, (1..=10).map(|k| 6 * k).collect::<Vec<_>>());
        assert_eq!(datasets.examples_in_memory(), 60);
        assert_eq!(datasets.teacher_labels_through(9), 60);
    }

    /// With an examples' file an aggregating run keeps no example in memory, and trains
    /// on the same examples; a run without aggregation does not use the file; an example
    /// the file cannot take (a full disk) is kept in memory, not lost.
    #[test]
    fn with_an_examples_file_aggregated_examples_are_kept_there() {
        let load = |d: &IterationDatasets, k: u32| {
            d.examples(k, true)
                .iter()
                .map(|e| e.load().unwrap())
                .collect::<Vec<_>>()
        };
        let dir = tempfile::tempdir().unwrap();
        let (memory, _) = run(CoordinatorConfig::default(), 4);
        let spill = ExampleSpill::create_in(dir.path()).unwrap();
        let (on_disk, trained) = run_with(CoordinatorConfig::default(), 4, Some(spill));
        assert_eq!(trained, vec![6, 12, 18, 24]);
        assert_eq!(on_disk.examples_in_memory(), 0);
        assert!(on_disk.spilled_bytes() > 24 * 8);
        assert_eq!(on_disk.teacher_labels_through(3), 24);
        assert_eq!(load(&on_disk, 3), load(&memory, 3));
        assert_eq!(load(&on_disk, 1), load(&memory, 1));

        let config = CoordinatorConfig {
            aggregate: false,
            ..Default::default()
        };
        let spill = ExampleSpill::create_in(dir.path()).unwrap();
        let (plain, _) = run_with(config, 4, Some(spill));
        assert_eq!((plain.spilled_bytes(), plain.examples_in_memory()), (0, 12));

        // A file that refuses every write (opened read-only).
        let path = dir.path().join("read-only");
        std::fs::write(&path, b"").unwrap();
        let refusing = ExampleSpill::from_file(std::fs::File::open(&path).unwrap());
        let (kept, _) = run_with(CoordinatorConfig::default(), 2, Some(refusing));
        assert_eq!(kept.examples_in_memory(), 12);
        assert_eq!(load(&kept, 1), load(&memory, 1));
    }

    /// Two workers finish an iteration's episodes in whatever order their timing gives:
    /// the dataset, and so the seeded batches, are the same for every finishing order.
    #[test]
    fn the_batches_do_not_depend_on_the_order_episodes_finish_in() {
        let episode = |slot: usize| EpisodeData {
            slot,
            policy_version: 0,
            examples: (0..3)
                .map(|t| TrainExample {
                    // Lengths shared across episodes: the batcher's length sort keeps
                    // ties in the shuffled order, which depends on the list's order.
                    tokens: vec![slot as u32 + 1; 8 + 4 * (t as usize % 2)],
                    episode_id: format!("it000-train{slot:04}-g0a0"),
                    turn_index: t,
                    ..Default::default()
                })
                .collect(),
            group: 0,
            reward: 1.0,
        };
        let batches_for = |finish_order: &[usize]| {
            let mut datasets = IterationDatasets::new(CoordinatorConfig::default());
            datasets.open(0);
            for &slot in finish_order {
                datasets.push(0, episode(slot));
            }
            let examples = datasets.examples(0, true);
            crate::dataset::make_batches(&examples, 0, 40, 2, 100, 7)
                .into_iter()
                .map(|b| {
                    b.examples
                        .iter()
                        .map(|e| (e.episode().to_string(), e.turn()))
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        };
        let reference = batches_for(&[0, 1, 2, 3, 4, 5]);
        assert!(reference.len() > 2, "{reference:?}");
        for order in [[5, 4, 3, 2, 1, 0], [2, 0, 5, 1, 3, 4], [1, 0, 3, 2, 5, 4]] {
            assert_eq!(batches_for(&order), reference, "finish order {order:?}");
        }
    }
}
