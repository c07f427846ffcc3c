//! The DAgger schedule: for each iteration, roll out with β_i, train on the aggregated
//! dataset, publish the new version and wait until the workers have loaded it (sync
//! mode), or roll out the next iteration while training on this one (async mode). Each
//! step is recorded in the run state, so a restarted coordinator resumes where it was.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tokio::sync::mpsc;
use tonic::Request;
use tutor_proto::auth::{AuthChannel, ClientAuth};
use tutor_proto::learner_client::LearnerClient;
use tutor_proto::{
    run_event, IterationSummary, LearnerStatusRequest, OutcomeStatus, PolicyVersion,
    RolloutProgress, RunEvent, RunFinished, SaveCheckpointRequest, TrainingProgress,
};

use crate::config::{CoordinatorConfig, ScheduleMode};
use crate::dataset::{make_batches, make_episode_batches, split_oversized, DatasetExample, Step};
use crate::rollouts::submit_rate_and_mean_turns;
use crate::run_events::EventLog;
use crate::scheduler::{IterationRollouts, SchedulerHandle};
use crate::state::{state_path, Phase, RunState};

pub struct Driver {
    pub config: CoordinatorConfig,
    pub scheduler: SchedulerHandle,
    pub events: EventLog,
    pub learner_endpoint: String,
    /// Adds the deployment's token to every call to the learner.
    pub learner_auth: ClientAuth,
    pub run_dir: PathBuf,
    /// Where the run stands (saved on disk; `resumed`: loaded from a previous start).
    pub state: RunState,
    pub resumed: bool,
}

type Learner = LearnerClient<AuthChannel>;

/// Train streams tried per iteration before the run fails (each after reconnecting).
const TRAIN_ATTEMPTS: u32 = 10;

impl Driver {
    pub async fn run(mut self) -> Result<()> {
        let result = self.run_inner().await;
        if let Err(e) = &result {
            tracing::error!(error = %format!("{e:#}"), "run failed");
            self.events.publish(RunEvent {
                event: Some(run_event::Event::Finished(RunFinished {
                    error: format!("{e:#}"),
                    ..Default::default()
                })),
            });
            self.scheduler.finish().await;
        }
        result
    }

    async fn connect_learner(&self) -> Result<Learner> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let endpoint = self
                .learner_auth
                .endpoint(&self.learner_endpoint)
                .context("the learner endpoint")?;
            match endpoint.connect().await {
                Ok(channel) => {
                    return Ok(LearnerClient::new(self.learner_auth.channel(channel))
                        .max_decoding_message_size(tutor_proto::MAX_MESSAGE_BYTES)
                        .max_encoding_message_size(tutor_proto::MAX_MESSAGE_BYTES))
                }
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(error = %e, "learner not reachable yet");
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!("connecting to the learner at {}", self.learner_endpoint)
                    })
                }
            }
        }
    }

    fn save_state(&self) -> Result<()> {
        self.state.save(&state_path(&self.run_dir))
    }

    async fn run_inner(&mut self) -> Result<()> {
        let mut learner = self.connect_learner().await?;
        let mut req = Request::new(LearnerStatusRequest {});
        req.set_timeout(Duration::from_secs(30));
        let status = learner
            .status(req)
            .await
            .context("asking the learner for its status")?
            .into_inner();
        if status.latest_version < self.state.policy_version {
            bail!(
                "the learner at {} serves policy version {} but this run published version {}: \
                 it was started without the run's learner directory (its --out-dir holds the \
                 checkpoint it resumes from); start it on that directory",
                self.learner_endpoint,
                status.latest_version,
                self.state.policy_version
            );
        }
        let mut policy = PolicyVersion {
            version: status.latest_version,
            weights_endpoint: self.learner_endpoint.clone(),
            sha256: status.latest_sha256,
        };
        self.scheduler.set_policy(policy.clone()).await;
        // The staleness filter of the iterations trained before a restart.
        for (&k, &base) in &self.state.train_bases {
            self.scheduler.seal(k, base).await;
        }
        let metrics_path = self.run_dir.join("metrics.jsonl");
        let n = self.config.iterations;
        let resume_at = self
            .resumed
            .then_some((self.state.iteration, self.state.phase));
        let first = if self.state.phase == Phase::Finished {
            n
        } else {
            self.state.iteration
        };
        // Async mode: the next iteration's rollouts, started before this one's training.
        let mut next_rollouts: Option<tokio::task::JoinHandle<Option<IterationRollouts>>> = None;
        for iteration in first..n {
            let beta = self.config.beta_at(iteration, n);
            let resuming = resume_at.filter(|(i, _)| *i == iteration).map(|(_, p)| p);
            if resuming.is_none() {
                self.state.iteration = iteration;
                self.state.phase = Phase::Rollout;
                self.save_state()?;
            }
            // Rollouts, with progress ticks for watchers.
            let t0 = Instant::now();
            let ticker = self.spawn_rollout_ticker(iteration);
            let rollouts = match next_rollouts.take() {
                Some(started) => started.await.ok().flatten(),
                None => self.scheduler.run_iteration(iteration, beta).await,
            }
            .context("the scheduler stopped during rollouts")?;
            ticker.abort();
            let rollout_seconds = t0.elapsed().as_secs_f64();
            if self.config.mode == ScheduleMode::Async && iteration + 1 < n {
                let scheduler = self.scheduler.clone();
                let beta_next = self.config.beta_at(iteration + 1, n);
                next_rollouts = Some(tokio::spawn(async move {
                    scheduler.run_iteration(iteration + 1, beta_next).await
                }));
            }

            // Training on the (aggregated) DAgger dataset, unless the learner already
            // published this iteration's version before a restart.
            let t1 = Instant::now();
            let trained_before = match resuming {
                Some(Phase::Published) => true,
                Some(Phase::Train) => self
                    .state
                    .train_bases
                    .get(&iteration)
                    .is_some_and(|base| policy.version > *base),
                _ => false,
            };
            let (losses, stale_episodes, train_examples) = if trained_before {
                tracing::info!(
                    iteration,
                    version = policy.version,
                    "the learner published this iteration's version before the restart: not \
                     training again"
                );
                let base = self.state.train_bases.get(&iteration).copied().unwrap_or(0);
                let stale = self.scheduler.seal(iteration, base).await;
                let examples = self
                    .scheduler
                    .dataset(iteration, self.config.aggregates())
                    .await;
                (Vec::new(), stale, examples.len() as u64)
            } else {
                let base = policy.version;
                self.state.train_bases.insert(iteration, base);
                self.state.phase = Phase::Train;
                self.save_state()?;
                let stale = self.scheduler.seal(iteration, base).await;
                let examples = self
                    .scheduler
                    .dataset(iteration, self.config.aggregates())
                    .await;
                let batcher = if self.config.batch_by_episode {
                    make_episode_batches::<DatasetExample>
                } else {
                    make_batches::<DatasetExample>
                };
                let mut batches = batcher(
                    &examples,
                    iteration,
                    self.config.batch_tokens,
                    self.config.epochs_per_iteration,
                    self.config.max_steps_per_iteration,
                    self.config.seed,
                );
                for b in &mut batches {
                    b.run_id = self.state.run_id.clone();
                }
                // A batch over the learner's message limit would fail the stream on
                // every attempt: it goes as several smaller steps.
                let batches = split_oversized(batches, tutor_proto::MAX_MESSAGE_BYTES)
                    .with_context(|| format!("building the batches of iteration {iteration}"))?;
                // The steps hold handles (the examples in memory or in the examples'
                // file): each step's examples are read as it is sent.
                let train_examples = examples.len() as u64;
                drop(examples);
                let (losses, published) = self.train(&mut learner, iteration, batches).await?;
                policy = PolicyVersion {
                    version: published.0,
                    weights_endpoint: self.learner_endpoint.clone(),
                    sha256: published.1,
                };
                (losses, stale, train_examples)
            };
            self.state.phase = Phase::Published;
            self.state.policy_version = policy.version;
            self.save_state()?;
            let train_seconds = t1.elapsed().as_secs_f64();

            // Weight sync: in sync mode every live worker loads the new version before
            // more rollouts; in async mode they load it while they keep generating.
            let t2 = Instant::now();
            self.scheduler.set_policy(policy.clone()).await;
            if self.config.mode == ScheduleMode::Sync {
                self.wait_for_sync(policy.version).await;
            }
            let sync_seconds = t2.elapsed().as_secs_f64();

            let summary = IterationSummary {
                iteration,
                beta,
                episodes: rollouts.train.len() as u32,
                teacher_labels_total: self.scheduler.teacher_labels_through(iteration).await,
                // Mean over the steps that had label tokens (the learner skips empty ones).
                train_loss: if losses.is_empty() {
                    0.0
                } else {
                    losses.iter().sum::<f64>() / losses.len() as f64
                },
                heldout_solve_rate: solve_rate(&rollouts.eval),
                heldout_episodes: rollouts.eval.len() as u32,
                rollout_seconds,
                train_seconds,
                sync_seconds,
                policy_version: policy.version,
                train_solve_rate: solve_rate(&rollouts.train),
                first_step_loss: losses.first().copied().unwrap_or(0.0),
                last_step_loss: losses.last().copied().unwrap_or(0.0),
                train_examples,
                agreement_rate: ratio(rollouts.agreements, rollouts.labelled_student_turns),
                student_format_error_rate: ratio(
                    rollouts.student_format_errors,
                    rollouts.student_turns,
                ),
                stale_episodes,
                ..behaviour(&rollouts)
            };
            tracing::info!(?summary, "iteration done");
            // A restart between the row and the next state save must not add it twice.
            if !metrics_has_iteration(&metrics_path, iteration) {
                append_metrics(
                    &metrics_path,
                    &summary,
                    &losses,
                    self.config.metrics_fields(&rollouts),
                )?;
            }
            self.events.publish(RunEvent {
                event: Some(run_event::Event::Iteration(summary)),
            });
        }

        // The final evaluation: the last trained policy on the held-out tasks, as the
        // iteration after the last (held-out slots only). After a restart in it, the
        // episodes already stored count and the rest run.
        let final_eval_path = self.run_dir.join("final_eval.json");
        if self.state.phase != Phase::Finished && self.config.final_eval_episodes() > 0 {
            let t0 = Instant::now();
            let ticker = self.spawn_rollout_ticker(n);
            let rollouts = self
                .scheduler
                .run_iteration(n, 0.0)
                .await
                .context("the scheduler stopped during the final evaluation")?;
            ticker.abort();
            if !rollouts.eval.is_empty() {
                let summary = IterationSummary {
                    iteration: n,
                    heldout_solve_rate: solve_rate(&rollouts.eval),
                    heldout_episodes: rollouts.eval.len() as u32,
                    rollout_seconds: t0.elapsed().as_secs_f64(),
                    policy_version: policy.version,
                    teacher_labels_total: self.scheduler.teacher_labels_through(n).await,
                    student_format_error_rate: ratio(
                        rollouts.student_format_errors,
                        rollouts.student_turns,
                    ),
                    ..behaviour(&rollouts)
                };
                tracing::info!(?summary, "final evaluation done");
                write_final_eval(&final_eval_path, &summary)?;
            }
        }
        let final_eval = read_final_eval(&final_eval_path);

        let checkpoint_dir = self.run_dir.join("checkpoint");
        if self.state.phase != Phase::Finished {
            let mut req = Request::new(SaveCheckpointRequest {
                dir: checkpoint_dir.display().to_string(),
            });
            req.set_timeout(Duration::from_secs(120));
            learner
                .save_checkpoint(req)
                .await
                .context("asking the learner to save the final checkpoint")?;
            self.state.phase = Phase::Finished;
            self.save_state()?;
        }
        let worker_versions = self.scheduler.worker_versions().await;
        self.scheduler.finish().await;
        self.events.publish(RunEvent {
            event: Some(run_event::Event::Finished(RunFinished {
                final_version: policy.version,
                checkpoint_dir: checkpoint_dir.display().to_string(),
                error: String::new(),
                worker_versions: worker_versions.into_iter().collect(),
                final_eval,
            })),
        });
        tracing::info!(version = policy.version, "run finished");
        Ok(())
    }

    fn spawn_rollout_ticker(&self, iteration: u32) -> tokio::task::JoinHandle<()> {
        let scheduler = self.scheduler.clone();
        let events = self.events.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(500));
            loop {
                every.tick().await;
                let (done, total) = scheduler.progress().await;
                events.publish(RunEvent {
                    event: Some(run_event::Event::Rollout(RolloutProgress {
                        iteration,
                        episodes_done: done,
                        episodes_total: total,
                    })),
                });
            }
        })
    }

    /// Streams the batches to the learner (bounded: the learner's pace sets ours) and
    /// collects the per-step losses and the published version. If the stream breaks (the
    /// learner was killed or restarted), reconnects and sends every batch of the
    /// iteration again: the learner trains only the ones it has not applied (see
    /// `tutor_learner::service`), so each batch is trained exactly once.
    async fn train(
        &self,
        learner: &mut Learner,
        iteration: u32,
        batches: Vec<Step<DatasetExample>>,
    ) -> Result<(Vec<f64>, (u64, String))> {
        // Shared by the attempts; each batch is made (its examples copied or read from
        // the examples' file) only as it is sent.
        let batches = Arc::new(batches);
        let mut losses = BTreeMap::new();
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            match self
                .train_once(learner, iteration, batches.clone(), &mut losses)
                .await
            {
                Ok(published) => return Ok((losses.into_values().collect(), published)),
                // The learner belongs to another run: sending again will not change that.
                Err(e)
                    if e.chain().any(|c| {
                        c.downcast_ref::<tonic::Status>()
                            .is_some_and(|s| s.code() == tonic::Code::FailedPrecondition)
                    }) =>
                {
                    return Err(e).with_context(|| {
                        format!(
                            "training iteration {iteration}: the learner at {} refuses this run",
                            self.learner_endpoint
                        )
                    })
                }
                // The examples' file cannot be read: sending again will not change that.
                Err(e) if e.chain().any(|c| c.is::<StepUnreadable>()) => {
                    return Err(e).with_context(|| format!("training iteration {iteration}"))
                }
                Err(e) if attempt < TRAIN_ATTEMPTS => {
                    tracing::warn!(
                        iteration,
                        attempt,
                        error = %format!("{e:#}"),
                        "the train stream to the learner broke: reconnecting and sending the \
                         iteration's batches again (the learner skips the ones it applied)"
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    *learner = self.connect_learner().await?;
                }
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!("training iteration {iteration} ({attempt} attempts)")
                    })
                }
            }
        }
    }

    /// One Train stream: sends `batches`, records the loss of every step trained now
    /// (by step, so a second attempt does not count a step twice).
    async fn train_once(
        &self,
        learner: &mut Learner,
        iteration: u32,
        batches: Arc<Vec<Step<DatasetExample>>>,
        losses: &mut BTreeMap<u32, f64>,
    ) -> Result<(u64, String)> {
        let total = batches.len() as u32;
        let (tx, rx) = mpsc::channel(2);
        // Memory holds the step being sent and the two the channel holds, however large
        // the dataset. A step that cannot be read ends the stream; its error is the
        // attempt's.
        let sender = tokio::spawn(async move {
            for i in 0..batches.len() {
                let steps = batches.clone();
                let batch = tokio::task::spawn_blocking(move || steps[i].load())
                    .await
                    .context("reading a step's examples")?
                    .map_err(|e| StepUnreadable {
                        step: batches[i].step,
                        iteration,
                        error: e,
                    })?;
                if tx.send(batch).await.is_err() {
                    break;
                }
            }
            anyhow::Ok(())
        });
        let mut req = Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        req.set_timeout(Duration::from_secs_f64(self.config.train_timeout_s));
        let streamed = async {
            let mut progress = learner
                .train(req)
                .await
                .context("starting the train stream")?
                .into_inner();
            let mut published = None;
            while let Some(p) = progress
                .message()
                .await
                .context("train stream from the learner")?
            {
                if p.label_tokens > 0 && !p.already_applied {
                    losses.insert(p.step, p.loss);
                }
                self.events.publish(RunEvent {
                    event: Some(run_event::Event::Training(TrainingProgress {
                        iteration,
                        step: p.step + 1,
                        steps_total: total,
                        loss: p.loss,
                    })),
                });
                if !p.published_sha256.is_empty() {
                    published = Some((p.published_version, p.published_sha256));
                }
            }
            match published {
                Some(p) => Ok(p),
                None => bail!("the learner ended the train stream without publishing a version"),
            }
        }
        .await;
        sender.abort();
        if streamed.is_err() {
            // A step that could not be read ended the stream: that is the cause. (An
            // aborted task that had finished keeps its result.)
            if let Ok(Err(e)) = sender.await {
                return Err(e);
            }
        }
        streamed
    }

    async fn wait_for_sync(&self, version: u64) {
        let deadline = Instant::now() + Duration::from_secs_f64(self.config.sync_timeout_s);
        loop {
            let versions = self.scheduler.worker_versions().await;
            if versions.values().all(|v| *v == version) {
                return;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    ?versions,
                    version,
                    "not every worker loaded the new version in time"
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A step's examples could not be read from the examples' file in the run directory.
#[derive(Debug, thiserror::Error)]
#[error(
    "reading the examples of step {step} of iteration {iteration} from the examples' file in \
     the run directory: {error}"
)]
struct StepUnreadable {
    step: u32,
    iteration: u32,
    error: std::io::Error,
}

/// Share of `outcomes` resolved (0 for none).
fn solve_rate(outcomes: &[tutor_proto::EpisodeOutcome]) -> f64 {
    if outcomes.is_empty() {
        return 0.0;
    }
    outcomes
        .iter()
        .filter(|x| x.status == OutcomeStatus::Resolved as i32)
        .count() as f64
        / outcomes.len() as f64
}

/// Writes the final evaluation's summary (`final_eval.json`, the metrics row's fields),
/// atomically.
fn write_final_eval(path: &std::path::Path, s: &IterationSummary) -> Result<()> {
    let text = format!("{:#}\n", summary_row(s, &[]));
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

/// The final evaluation a run directory records (`final_eval.json`), if any.
pub fn read_final_eval(path: &std::path::Path) -> Option<IterationSummary> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    Some(summary_from_row(&v))
}

/// The student's behaviour in an iteration's rollouts (the summary's behaviour fields).
fn behaviour(r: &IterationRollouts) -> IterationSummary {
    let (heldout_submit_rate, heldout_mean_turns) = submit_rate_and_mean_turns(&r.eval);
    let (train_submit_rate, train_mean_turns) = submit_rate_and_mean_turns(&r.train);
    IterationSummary {
        heldout_submit_rate,
        heldout_mean_turns,
        train_submit_rate,
        train_mean_turns,
        student_turn_share: ratio(r.train_student_executed, r.train_turns),
        disagreement_rate: if r.labelled_student_turns == 0 {
            0.0
        } else {
            1.0 - ratio(r.agreements, r.labelled_student_turns)
        },
        reverse_kl: r.reverse_kl(),
        ..Default::default()
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// The iteration summary a metrics.jsonl row records (the inverse of `append_metrics`).
pub fn summary_from_row(v: &serde_json::Value) -> IterationSummary {
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let losses: Vec<f64> = v["step_losses"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        .unwrap_or_default();
    IterationSummary {
        iteration: n("iteration") as u32,
        beta: f("beta"),
        episodes: n("episodes") as u32,
        teacher_labels_total: n("teacher_labels_total"),
        train_loss: f("train_loss"),
        heldout_solve_rate: f("heldout_solve_rate"),
        heldout_episodes: n("heldout_episodes") as u32,
        rollout_seconds: f("rollout_seconds"),
        train_seconds: f("train_seconds"),
        sync_seconds: f("sync_seconds"),
        policy_version: n("policy_version"),
        train_solve_rate: f("train_solve_rate"),
        first_step_loss: losses.first().copied().unwrap_or(0.0),
        last_step_loss: losses.last().copied().unwrap_or(0.0),
        train_examples: n("train_examples"),
        agreement_rate: f("agreement_rate"),
        student_format_error_rate: f("student_format_error_rate"),
        stale_episodes: n("stale_episodes"),
        heldout_submit_rate: f("heldout_submit_rate"),
        heldout_mean_turns: f("heldout_mean_turns"),
        train_submit_rate: f("train_submit_rate"),
        train_mean_turns: f("train_mean_turns"),
        student_turn_share: f("student_turn_share"),
        disagreement_rate: f("disagreement_rate"),
        reverse_kl: v["reverse_kl"].as_f64(),
    }
}

/// The summaries of the iterations metrics.jsonl records, one per iteration (the last
/// row of a repeated one), in order. A line that is not a row (a write torn by a crash)
/// is skipped with a warning naming the file and line; no file: none.
pub fn read_summaries(path: &std::path::Path) -> Result<Vec<IterationSummary>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let mut rows = std::collections::BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<serde_json::Value>(line) {
            Ok(v) if v["iteration"].is_u64() => {
                let s = summary_from_row(&v);
                rows.insert(s.iteration, s);
            }
            _ => tracing::warn!(
                file = %path.display(),
                line = i + 1,
                "not a metrics row (torn by a crash?): skipped"
            ),
        }
    }
    Ok(rows.into_values().collect())
}

/// Whether metrics.jsonl already has the row of `iteration`.
fn metrics_has_iteration(path: &std::path::Path, iteration: u32) -> bool {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .any(|row| row["iteration"].as_u64() == Some(u64::from(iteration)))
}

fn append_metrics(
    path: &std::path::Path,
    s: &IterationSummary,
    losses: &[f64],
    algorithm_fields: serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    let mut row = summary_row(s, losses);
    if let Some(obj) = row.as_object_mut() {
        obj.extend(algorithm_fields);
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(f, "{row}").with_context(|| format!("writing {}", path.display()))?;
    f.sync_data()?;
    Ok(())
}

/// A summary as a metrics row (the inverse of `summary_from_row`).
fn summary_row(s: &IterationSummary, losses: &[f64]) -> serde_json::Value {
    let mut row = serde_json::json!({
        "iteration": s.iteration,
        "beta": s.beta,
        "episodes": s.episodes,
        "teacher_labels_total": s.teacher_labels_total,
        "train_examples": s.train_examples,
        "train_loss": s.train_loss,
        "step_losses": losses,
        "train_solve_rate": s.train_solve_rate,
        "heldout_solve_rate": s.heldout_solve_rate,
        "heldout_episodes": s.heldout_episodes,
        "agreement_rate": s.agreement_rate,
        "student_format_error_rate": s.student_format_error_rate,
        "rollout_seconds": s.rollout_seconds,
        "train_seconds": s.train_seconds,
        "sync_seconds": s.sync_seconds,
        "policy_version": s.policy_version,
        "stale_episodes": s.stale_episodes,
        "heldout_submit_rate": s.heldout_submit_rate,
        "heldout_mean_turns": s.heldout_mean_turns,
        "train_submit_rate": s.train_submit_rate,
        "train_mean_turns": s.train_mean_turns,
        "student_turn_share": s.student_turn_share,
        "disagreement_rate": s.disagreement_rate,
    });
    if let (Some(kl), Some(obj)) = (s.reverse_kl, row.as_object_mut()) {
        obj.insert("reverse_kl".into(), kl.into());
    }
    row
}
