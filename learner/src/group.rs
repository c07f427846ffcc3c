//! Data-parallel learner ranks as separate processes: the rendezvous through the
//! coordinator's LearnerGroup service, rank 0's side of the group (`GroupLead`: forms it,
//! sends each batch, keepalives and the end of the run) and the loop of ranks 1..K−1
//! (`run_follower`), which train their share of every batch in lockstep with rank 0.
//!
//! Rank 0 alone talks to the coordinator's Train stream, answers it, publishes weights
//! and writes checkpoints. When the group breaks (a rank died, hung or went out of step),
//! rank 0 goes on alone until its next batch, then publishes a new rendezvous generation
//! and waits for the others; the others, having lost the group, wait for that newer
//! generation and join it with rank 0's state (weights, optimizer, schedule).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use prost::Message;
use tutor_collective::rendezvous::{fetch, form_as_rank0, join_rendezvous, GroupOptions};
use tutor_proto::{CollectiveKind, Rendezvous};

use crate::loss::StepExamples;
use crate::trainer::Trainer;

/// How rank 0 tells the others what comes next (first byte of each broadcast).
const MSG_STEP: u8 = 1;
const MSG_KEEPALIVE: u8 = 2;
const MSG_STOP: u8 = 3;
/// Rank 0 writes a checkpoint of a sharded state: every rank sends its slice.
const MSG_CHECKPOINT: u8 = 4;

/// Rank 0's side of the group, owned by the trainer thread beside the trainer.
pub struct GroupLead {
    opts: GroupOptions,
    rt: tokio::runtime::Handle,
    /// The generation of the group the trainer is in; `None`: not formed (or broken).
    generation: Option<u64>,
    last_message: Instant,
}

impl GroupLead {
    /// Rank 0 of `opts` (which must say rank 0); `rt` runs the calls to the coordinator.
    pub fn new(opts: GroupOptions, rt: tokio::runtime::Handle) -> Result<Self> {
        opts.validate()?;
        if opts.rank != 0 {
            bail!("GroupLead is rank 0's side, not rank {}'s", opts.rank);
        }
        Ok(Self {
            opts,
            rt,
            generation: None,
            last_message: Instant::now(),
        })
    }

    pub fn world_size(&self) -> usize {
        self.opts.world_size
    }

    pub fn keepalive(&self) -> Duration {
        self.opts.keepalive()
    }

    /// Forms the group if it is not formed: publishes a new generation and waits for
    /// every other rank (within the rendezvous timeout), then brings them to the
    /// trainer's state.
    pub fn ensure(&mut self, trainer: &mut Trainer) -> Result<()> {
        if self.generation.is_some() {
            return Ok(());
        }
        let (collective, generation) = form_as_rank0(&self.opts, &self.rt, "learner group")?;
        trainer
            .lead_group(collective)
            .with_context(|| format!("starting the learner group of generation {generation}"))?;
        tracing::info!(
            generation,
            world_size = self.opts.world_size,
            steps = trainer.steps(),
            shard = trainer.config().shard.name(),
            "learner group formed"
        );
        self.generation = Some(generation);
        self.last_message = Instant::now();
        Ok(())
    }

    fn send(&mut self, trainer: &mut Trainer, mut msg: Vec<u8>) -> Result<()> {
        self.ensure(trainer)?;
        let r = trainer.broadcast_bytes(&mut msg);
        self.last_message = Instant::now();
        if let Err(e) = r {
            self.broken(trainer, &e);
            return Err(e).context("sending the batch to the other learner ranks");
        }
        Ok(())
    }

    /// Sends a batch (the coordinator's `TrainBatch`, encoded) to every rank; forms the
    /// group first if it is not formed.
    pub fn send_step(&mut self, trainer: &mut Trainer, batch: &[u8]) -> Result<()> {
        let mut msg = Vec::with_capacity(batch.len() + 1);
        msg.push(MSG_STEP);
        msg.extend_from_slice(batch);
        self.send(trainer, msg)
    }

    /// Before rank 0 writes a checkpoint: with `[learner] shard` the other ranks hold
    /// slices of the optimizer state, so they are told to send theirs
    /// (`Trainer::save_checkpoint` then gathers them). Nothing to do unsharded or while
    /// the group is not formed.
    pub fn send_checkpoint(&mut self, trainer: &mut Trainer) -> Result<()> {
        if self.generation.is_none() || !trainer.is_sharded() {
            return Ok(());
        }
        self.send(trainer, vec![MSG_CHECKPOINT])
    }

    /// While no batch comes: a keepalive every `keepalive()`, so waiting ranks know rank
    /// 0 is alive. Does nothing while the group is not formed.
    pub fn tick(&mut self, trainer: &mut Trainer) {
        if self.generation.is_none() || self.last_message.elapsed() < self.keepalive() {
            return;
        }
        if let Err(e) = self.send(trainer, vec![MSG_KEEPALIVE]) {
            tracing::warn!(error = %format!("{e:#}"), "learner group keepalive failed: the group will be formed again at the next batch");
        }
    }

    /// The run is over: tells the other ranks to exit.
    pub fn stop(&mut self, trainer: &mut Trainer) {
        if self.generation.is_none() {
            return;
        }
        let mut msg = vec![MSG_STOP];
        match trainer.broadcast_bytes(&mut msg) {
            Ok(()) => tracing::info!("told the other learner ranks to stop"),
            Err(e) => tracing::warn!(error = %e, "could not tell the other learner ranks to stop"),
        }
        trainer.leave_group();
        self.generation = None;
    }

    /// The group failed: rank 0 goes on alone and forms a new group (a new generation)
    /// at its next batch.
    pub fn broken(&mut self, trainer: &mut Trainer, why: &dyn std::fmt::Display) {
        if let Some(g) = self.generation.take() {
            tracing::warn!(generation = g, error = %why, "the learner group broke: it is formed again (new generation) at the next batch");
        }
        trainer.leave_group();
    }
}

/// Ranks 1..K−1 until rank 0 ends the run (`Ok`) or no rank 0 comes back within the
/// rendezvous timeout after the group broke (`Err`).
pub async fn run_follower(opts: GroupOptions) -> Result<()> {
    opts.validate()?;
    if opts.rank == 0 {
        bail!("run_follower is for ranks 1..K-1; rank 0 serves the coordinator");
    }
    let mut after = 0;
    let mut lost: Option<String> = None;
    let mut next: Option<Rendezvous> = None;
    loop {
        let rdv = match next.take() {
            Some(r) => r,
            None => match fetch(&opts, after).await {
                Ok(r) => r,
                Err(e) => match lost {
                    Some(why) => {
                        return Err(e.context(format!(
                            "learner rank {} lost its group of generation {after} ({why})",
                            opts.rank
                        )))
                    }
                    None => return Err(e),
                },
            },
        };
        if rdv.world_size as usize != opts.world_size || rdv.kind != opts.kind() as i32 {
            bail!(
                "learner rank {} has --world-size {} and --collective {:?}, but rank 0 published \
                 world size {} with collective {:?} at {}: start every rank with the same settings",
                opts.rank,
                opts.world_size,
                opts.collective,
                rdv.world_size,
                CollectiveKind::try_from(rdv.kind).unwrap_or(CollectiveKind::Unspecified),
                opts.coordinator
            );
        }
        tracing::info!(
            generation = rdv.generation,
            rank = opts.rank,
            "joining the learner group"
        );
        // A thread of its own (not the runtime's blocking pool): the process may exit while
        // it waits on a socket.
        let (tx, mut done) = tokio::sync::oneshot::channel();
        let (joined_tx, mut joined) = tokio::sync::oneshot::channel();
        let (o, r) = (opts.clone(), rdv.clone());
        std::thread::Builder::new()
            .name(format!("rank-{}", opts.rank))
            .spawn(move || {
                let _ = tx.send(follow_generation(&o, &r, joined_tx));
            })
            .context("starting the follower thread")?;
        // While the join is under way, a newer generation means this one is stale (its
        // rank 0 is gone: a rank started just before rank 0 restarted read the old
        // rendezvous): join the newer one rather than wait out a dead address. The
        // abandoned thread fails on its own.
        let newer = fetch(&opts, rdv.generation);
        tokio::pin!(newer);
        let (mut is_joined, mut watching) = (false, true);
        let outcome = loop {
            tokio::select! {
                r = &mut done => break Some(r.context("the follower thread died")?),
                // Joined (or the join failed, and `done` comes next): from here the group's
                // own failures say when it breaks.
                _ = &mut joined, if !is_joined => is_joined = true,
                n = &mut newer, if watching && !is_joined => {
                    watching = false;
                    if let Ok(n) = n {
                        tracing::warn!(
                            stale = rdv.generation,
                            generation = n.generation,
                            rank = opts.rank,
                            "rank 0 published a newer generation while this rank was joining: \
                             joining that one"
                        );
                        next = Some(n);
                        break None;
                    }
                }
            }
        };
        match outcome {
            None => {
                after = rdv.generation;
            }
            Some(Ok(())) => {
                tracing::info!(rank = opts.rank, "rank 0 ended the run: exiting");
                return Ok(());
            }
            Some(Err(e)) => {
                let why = format!("{e:#}");
                tracing::warn!(
                    generation = rdv.generation,
                    error = %why,
                    "left the learner group: waiting for rank 0 to publish a newer generation"
                );
                after = rdv.generation;
                lost = Some(why);
            }
        }
    }
}

/// Joins generation `rdv` and trains in lockstep until rank 0 says stop (`Ok`) or the
/// group fails (`Err`).
fn follow_generation(
    opts: &GroupOptions,
    rdv: &Rendezvous,
    joined: tokio::sync::oneshot::Sender<()>,
) -> Result<()> {
    let collective = join_rendezvous(opts, rdv)?;
    let mut trainer = Trainer::join_group(collective)?;
    let _ = joined.send(());
    tracing::info!(
        generation = rdv.generation,
        rank = opts.rank,
        steps = trainer.steps(),
        "joined the learner group"
    );
    loop {
        let mut msg = Vec::new();
        trainer
            .broadcast_bytes(&mut msg)
            .context("waiting for rank 0's next batch")?;
        match msg.first() {
            Some(&MSG_STEP) => {
                let batch = tutor_proto::TrainBatch::decode(&msg[1..])
                    .context("rank 0 sent a batch this rank cannot decode")?;
                let (iteration, step) = (batch.iteration, batch.step);
                let examples =
                    StepExamples::from_proto(batch.examples)?.shard(opts.rank, opts.world_size);
                let report = trainer
                    .train_step(&examples)
                    .with_context(|| format!("training batch {iteration}/{step}"))?;
                tracing::debug!(
                    iteration,
                    step,
                    examples = examples.len(),
                    loss = report.loss,
                    "trained this rank's share"
                );
            }
            Some(&MSG_CHECKPOINT) => trainer.send_checkpoint_state().context(
                "sending this rank's slice of the optimizer state for rank 0's checkpoint",
            )?,
            Some(&MSG_KEEPALIVE) => {}
            Some(&MSG_STOP) => return Ok(()),
            other => bail!("rank 0 sent an unknown group message {other:?}"),
        }
    }
}

/// Encodes a batch for `GroupLead::send_step`.
pub fn encode_batch(batch: &tutor_proto::TrainBatch) -> Vec<u8> {
    batch.encode_to_vec()
}
