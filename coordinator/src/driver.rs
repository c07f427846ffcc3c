//! The DAgger schedule: for each iteration, roll out with β_i, train on the aggregated
//! dataset, publish the new version and wait until the workers have loaded it.

use std::io::Write;
use std::path::PathBuf;
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

use crate::config::CoordinatorConfig;
use crate::dataset::make_batches;
use crate::scheduler::SchedulerHandle;
use crate::service::EventLog;

pub struct Driver {
    pub config: CoordinatorConfig,
    pub scheduler: SchedulerHandle,
    pub events: EventLog,
    pub learner_endpoint: String,
    /// Adds the deployment's token to every call to the learner.
    pub learner_auth: ClientAuth,
    pub run_dir: PathBuf,
}

type Learner = LearnerClient<AuthChannel>;

impl Driver {
    pub async fn run(self) -> Result<()> {
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
            let endpoint =
                tonic::transport::Endpoint::from_shared(self.learner_endpoint.clone())
                    .with_context(|| format!("bad learner address {:?}", self.learner_endpoint))?;
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

    async fn run_inner(&self) -> Result<()> {
        let mut learner = self.connect_learner().await?;
        let mut req = Request::new(LearnerStatusRequest {});
        req.set_timeout(Duration::from_secs(30));
        let status = learner
            .status(req)
            .await
            .context("asking the learner for its status")?
            .into_inner();
        let mut policy = PolicyVersion {
            version: status.latest_version,
            weights_endpoint: self.learner_endpoint.clone(),
            sha256: status.latest_sha256,
        };
        self.scheduler.set_policy(policy.clone()).await;
        let metrics_path = self.run_dir.join("metrics.jsonl");
        let mut teacher_labels_total = 0u64;
        let n = self.config.iterations;
        for iteration in 0..n {
            let beta = self.config.beta.at(iteration, n);
            // Rollouts, with progress ticks for watchers.
            let t0 = Instant::now();
            let ticker = self.spawn_rollout_ticker(iteration);
            let rollouts = self
                .scheduler
                .run_iteration(iteration, beta)
                .await
                .context("the scheduler stopped during rollouts")?;
            ticker.abort();
            let rollout_seconds = t0.elapsed().as_secs_f64();
            teacher_labels_total += rollouts.teacher_labels;

            // Training on the (aggregated) DAgger dataset.
            let t1 = Instant::now();
            let examples = self.scheduler.examples(self.config.aggregate).await;
            let batches = make_batches(
                &examples,
                iteration,
                self.config.batch_tokens,
                self.config.epochs_per_iteration,
                self.config.max_steps_per_iteration,
                self.config.seed,
            );
            let (losses, published) = self.train(&mut learner, iteration, batches).await?;
            let train_seconds = t1.elapsed().as_secs_f64();

            // Weight sync: every live worker loads the new version before more rollouts.
            let t2 = Instant::now();
            policy = PolicyVersion {
                version: published.0,
                weights_endpoint: self.learner_endpoint.clone(),
                sha256: published.1,
            };
            self.scheduler.set_policy(policy.clone()).await;
            self.wait_for_sync(policy.version).await;
            let sync_seconds = t2.elapsed().as_secs_f64();

            let solved = |o: &[tutor_proto::EpisodeOutcome]| {
                if o.is_empty() {
                    0.0
                } else {
                    o.iter()
                        .filter(|x| x.status == OutcomeStatus::Resolved as i32)
                        .count() as f64
                        / o.len() as f64
                }
            };
            let summary = IterationSummary {
                iteration,
                beta,
                episodes: rollouts.train.len() as u32,
                teacher_labels_total,
                // Mean over the steps that had label tokens (the learner skips empty ones).
                train_loss: if losses.is_empty() {
                    0.0
                } else {
                    losses.iter().sum::<f64>() / losses.len() as f64
                },
                heldout_solve_rate: solved(&rollouts.eval),
                heldout_episodes: rollouts.eval.len() as u32,
                rollout_seconds,
                train_seconds,
                sync_seconds,
                policy_version: policy.version,
                train_solve_rate: solved(&rollouts.train),
                first_step_loss: losses.first().copied().unwrap_or(0.0),
                last_step_loss: losses.last().copied().unwrap_or(0.0),
                train_examples: examples.len() as u64,
                agreement_rate: ratio(rollouts.agreements, rollouts.student_turns),
                student_format_error_rate: ratio(
                    rollouts.student_format_errors,
                    rollouts.student_turns,
                ),
            };
            tracing::info!(?summary, "iteration done");
            append_metrics(&metrics_path, &summary, &losses)?;
            self.events.publish(RunEvent {
                event: Some(run_event::Event::Iteration(summary)),
            });
        }

        let checkpoint_dir = self.run_dir.join("checkpoint");
        let mut req = Request::new(SaveCheckpointRequest {
            dir: checkpoint_dir.display().to_string(),
        });
        req.set_timeout(Duration::from_secs(120));
        learner
            .save_checkpoint(req)
            .await
            .context("asking the learner to save the final checkpoint")?;
        let worker_versions = self.scheduler.worker_versions().await;
        self.scheduler.finish().await;
        self.events.publish(RunEvent {
            event: Some(run_event::Event::Finished(RunFinished {
                final_version: policy.version,
                checkpoint_dir: checkpoint_dir.display().to_string(),
                error: String::new(),
                worker_versions: worker_versions.into_iter().collect(),
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
    /// collects the per-step losses and the published version.
    async fn train(
        &self,
        learner: &mut Learner,
        iteration: u32,
        batches: Vec<tutor_proto::TrainBatch>,
    ) -> Result<(Vec<f64>, (u64, String))> {
        let total = batches.len() as u32;
        let (tx, rx) = mpsc::channel(2);
        tokio::spawn(async move {
            for b in batches {
                if tx.send(b).await.is_err() {
                    return;
                }
            }
        });
        let mut req = Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        req.set_timeout(Duration::from_secs_f64(self.config.train_timeout_s));
        let mut progress = learner
            .train(req)
            .await
            .context("starting the train stream")?
            .into_inner();
        let mut losses = Vec::new();
        let mut published = None;
        while let Some(p) = progress
            .message()
            .await
            .context("train stream from the learner")?
        {
            if p.label_tokens > 0 {
                losses.push(p.loss);
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
            Some(p) => Ok((losses, p)),
            None => bail!("the learner ended the train stream without publishing a version"),
        }
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

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

fn append_metrics(path: &std::path::Path, s: &IterationSummary, losses: &[f64]) -> Result<()> {
    let row = serde_json::json!({
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
    });
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(f, "{row}").with_context(|| format!("writing {}", path.display()))?;
    f.sync_data()?;
    Ok(())
}
