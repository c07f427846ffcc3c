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

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use prost::Message;
use tonic::{Code, Request};
use tutor_proto::auth::ClientAuth;
use tutor_proto::learner_group_client::LearnerGroupClient;
use tutor_proto::{CollectiveKind, GetRendezvousRequest, PublishRendezvousRequest, Rendezvous};

use crate::collective::{Collective, CpuCollective, CpuCollectiveTimeouts, CpuRendezvous};
use crate::config::CollectiveChoice;
use crate::rl::StepExamples;
use crate::trainer::Trainer;

/// How rank 0 tells the others what comes next (first byte of each broadcast).
const MSG_STEP: u8 = 1;
const MSG_KEEPALIVE: u8 = 2;
const MSG_STOP: u8 = 3;

/// Deadline of one call to the coordinator (a GetRendezvous long poll adds its wait).
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the coordinator holds one GetRendezvous open.
const POLL_WAIT: Duration = Duration::from_secs(10);

/// One rank's place in the group and how to reach the others.
#[derive(Clone, Debug)]
pub struct GroupOptions {
    pub rank: usize,
    pub world_size: usize,
    pub collective: CollectiveChoice,
    /// The coordinator's gRPC endpoint (`http://host:port`), where the rendezvous is.
    pub coordinator: String,
    /// Token and TLS for the calls to the coordinator.
    pub auth: ClientAuth,
    /// CPU, rank 0: where its collective listens (port 0: any free port).
    pub collective_listen: SocketAddr,
    /// CPU, rank 0: the host:port the other ranks connect to (default: the bound
    /// address; required when listening on 0.0.0.0).
    pub collective_advertise: Option<String>,
    /// NCCL: this rank's CUDA device.
    pub gpu: usize,
    pub rendezvous_timeout: Duration,
    pub collective_timeout: Duration,
    /// The rendezvous slot at the coordinator: "" for the learner ranks,
    /// `broadcast::GROUP` for learner rank 0 and the workers it pushes weights to.
    pub group: String,
}

impl GroupOptions {
    /// How often rank 0 sends a keepalive while no batch comes, so that the other ranks'
    /// wait for the next message (bounded by `collective_timeout`) does not run out.
    pub fn keepalive(&self) -> Duration {
        (self.collective_timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(10))
    }

    /// This process in messages.
    pub(crate) fn who(&self) -> String {
        if self.group.is_empty() {
            format!("learner rank {} of {}", self.rank, self.world_size)
        } else {
            format!(
                "receiver {} of {} in group {:?}",
                self.rank, self.world_size, self.group
            )
        }
    }

    pub(crate) fn kind(&self) -> CollectiveKind {
        match self.collective {
            CollectiveChoice::Cpu => CollectiveKind::Cpu,
            CollectiveChoice::Nccl => CollectiveKind::Nccl,
        }
    }

    /// Checks what can be checked before anything starts.
    pub fn validate(&self) -> Result<()> {
        if self.world_size < 2 {
            bail!("a learner group needs world size 2 or more (1 runs alone, without one)");
        }
        if self.rank >= self.world_size {
            bail!(
                "--rank {} is not below --world-size {} (ranks are 0..{})",
                self.rank,
                self.world_size,
                self.world_size - 1
            );
        }
        if self.coordinator.is_empty() {
            bail!(
                "world size {} needs the coordinator's endpoint for the rendezvous: pass \
                 --coordinator http://HOST:PORT (or TUTOR_COORDINATOR)",
                self.world_size
            );
        }
        self.auth
            .endpoint(&self.coordinator)
            .context("the --coordinator endpoint")?;
        if self.collective == CollectiveChoice::Nccl && !cfg!(feature = "nccl") {
            bail!(
                "--collective nccl: this tutor was built without NCCL; rebuild with \
                 `cargo build --features tutor-learner/nccl` (or use --collective cpu)"
            );
        }
        if self.rank == 0
            && self.collective == CollectiveChoice::Cpu
            && self.collective_advertise.is_none()
            && self.collective_listen.ip().is_unspecified()
        {
            bail!(
                "--collective-listen {} accepts connections on every interface, but the other \
                 ranks need one address to connect to: pass --collective-advertise HOST:PORT",
                self.collective_listen
            );
        }
        Ok(())
    }

    fn cpu_timeouts(&self) -> CpuCollectiveTimeouts {
        CpuCollectiveTimeouts {
            connect: self.rendezvous_timeout,
            io: self.collective_timeout,
        }
    }
}

async fn client(opts: &GroupOptions) -> Result<LearnerGroupClient<tutor_proto::auth::AuthChannel>> {
    let channel = opts
        .auth
        .endpoint(&opts.coordinator)?
        .connect_timeout(CALL_TIMEOUT)
        .connect()
        .await
        .with_context(|| format!("connecting to the coordinator at {}", opts.coordinator))?;
    Ok(LearnerGroupClient::new(opts.auth.channel(channel)))
}

/// Errors that calling again will not fix.
fn is_final(code: Code) -> bool {
    matches!(
        code,
        Code::Unauthenticated
            | Code::PermissionDenied
            | Code::InvalidArgument
            | Code::Unimplemented
    )
}

/// Rank 0: hands `rendezvous` to the coordinator, retrying until it answers (it may start
/// after the learner), within the rendezvous timeout. Returns the generation.
pub async fn publish(opts: &GroupOptions, rendezvous: Rendezvous) -> Result<u64> {
    let start = Instant::now();
    loop {
        let attempt = async {
            let mut c = client(opts).await?;
            let mut req = Request::new(PublishRendezvousRequest {
                rendezvous: Some(rendezvous.clone()),
            });
            req.set_timeout(CALL_TIMEOUT);
            Ok::<_, anyhow::Error>(c.publish_rendezvous(req).await)
        };
        let last = match attempt.await {
            Ok(Ok(r)) => return Ok(r.into_inner().generation),
            Ok(Err(status)) if is_final(status.code()) => bail!(
                "the coordinator at {} refused learner rank 0's rendezvous: {}",
                opts.coordinator,
                status.message()
            ),
            Ok(Err(status)) => format!("{:?}: {}", status.code(), status.message()),
            Err(e) => format!("{e:#}"),
        };
        if start.elapsed() >= opts.rendezvous_timeout {
            bail!(
                "learner rank 0 could not publish its rendezvous to the coordinator at {} \
                 within {:?} (is the coordinator running there?): {last}",
                opts.coordinator,
                opts.rendezvous_timeout
            );
        }
        tracing::debug!(error = %last, "coordinator not reachable yet for the rendezvous");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Ranks 1..K−1: waits for a rendezvous of a generation above `after` (0: any) at the
/// coordinator, within the rendezvous timeout.
pub async fn fetch(opts: &GroupOptions, after: u64) -> Result<Rendezvous> {
    let start = Instant::now();
    let mut last = String::from("no answer yet");
    loop {
        let left = opts.rendezvous_timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            bail!(
                "{}: rank 0 published no rendezvous{} at the coordinator {} \
                 within {:?}: is `tutor learner --rank 0 --world-size {} --coordinator {}` \
                 running? (last answer: {last})",
                opts.who(),
                if after > 0 {
                    format!(" newer than generation {after}")
                } else {
                    String::new()
                },
                opts.coordinator,
                opts.rendezvous_timeout,
                opts.world_size,
                opts.coordinator
            );
        }
        let wait = left.min(POLL_WAIT);
        let attempt = async {
            let mut c = client(opts).await?;
            let mut req = Request::new(GetRendezvousRequest {
                after_generation: after,
                wait_ms: wait.as_millis() as u32,
                group: opts.group.clone(),
            });
            req.set_timeout(wait + CALL_TIMEOUT);
            Ok::<_, anyhow::Error>(c.get_rendezvous(req).await)
        };
        // The call itself is bounded too (a coordinator that hangs).
        match tokio::time::timeout(wait + CALL_TIMEOUT, attempt).await {
            Ok(Ok(Ok(r))) => return Ok(r.into_inner()),
            Ok(Ok(Err(status))) if is_final(status.code()) => bail!(
                "the coordinator at {} refused learner rank {}'s rendezvous request: {}",
                opts.coordinator,
                opts.rank,
                status.message()
            ),
            Ok(Ok(Err(status))) => {
                let not_found = status.code() == Code::NotFound;
                last = format!("{:?}: {}", status.code(), status.message());
                if not_found {
                    continue; // the long poll ran out: ask again
                }
            }
            Ok(Err(e)) => last = format!("{e:#}"),
            Err(_) => last = "the coordinator did not answer in time".into(),
        }
        tokio::time::sleep(Duration::from_millis(200).min(left)).await;
    }
}

/// Rank 0: publishes a new generation of `o.group` at the coordinator and waits for the
/// other ranks to join it (CPU: within the rendezvous timeout; NCCL: until they come).
/// `what` names the group in logs. An advertised address ending in `:0` gets the port
/// the CPU collective was bound to.
pub(crate) fn form_as_rank0(
    o: &GroupOptions,
    rt: &tokio::runtime::Handle,
    what: &str,
) -> Result<(Box<dyn Collective>, u64)> {
    match o.collective {
        CollectiveChoice::Cpu => {
            let rdv = CpuRendezvous::bind(o.collective_listen)?;
            let bound = rdv.local_addr();
            let addr = match &o.collective_advertise {
                Some(a) => match a.strip_suffix(":0") {
                    Some(host) => format!("{host}:{}", bound.port()),
                    None => a.clone(),
                },
                None => bound.to_string(),
            };
            let generation = rt.block_on(publish(
                o,
                Rendezvous {
                    generation: 0,
                    world_size: o.world_size as u32,
                    kind: CollectiveKind::Cpu as i32,
                    cpu_address: addr.clone(),
                    nccl_unique_id: Vec::new(),
                    group: o.group.clone(),
                },
            ))?;
            tracing::info!(generation, %addr, world_size = o.world_size, "{what} rendezvous published: waiting for the other ranks");
            let c = rdv
                .accept(o.world_size, o.cpu_timeouts())
                .with_context(|| format!("forming the {what} of generation {generation}"))?;
            Ok((Box::new(c), generation))
        }
        CollectiveChoice::Nccl => form_nccl(o, rt, what),
    }
}

#[cfg(feature = "nccl")]
fn form_nccl(
    o: &GroupOptions,
    rt: &tokio::runtime::Handle,
    what: &str,
) -> Result<(Box<dyn Collective>, u64)> {
    use crate::collective::NcclCollective;
    let id = NcclCollective::unique_id()?;
    let generation = rt.block_on(publish(
        o,
        Rendezvous {
            generation: 0,
            world_size: o.world_size as u32,
            kind: CollectiveKind::Nccl as i32,
            cpu_address: String::new(),
            nccl_unique_id: id.to_vec(),
            group: o.group.clone(),
        },
    ))?;
    tracing::info!(
        generation,
        world_size = o.world_size,
        "{what}: NCCL unique id published: waiting for the other ranks"
    );
    let c = NcclCollective::new(&id, 0, o.world_size, o.gpu)?;
    Ok((Box::new(c), generation))
}

#[cfg(not(feature = "nccl"))]
fn form_nccl(
    _o: &GroupOptions,
    _rt: &tokio::runtime::Handle,
    _what: &str,
) -> Result<(Box<dyn Collective>, u64)> {
    bail!("this tutor was built without the `nccl` feature")
}

/// Ranks 1..K−1: joins the collective of generation `rdv`.
pub(crate) fn join_rendezvous(
    opts: &GroupOptions,
    rdv: &Rendezvous,
) -> Result<Box<dyn Collective>> {
    Ok(match opts.collective {
        CollectiveChoice::Cpu => Box::new(CpuCollective::connect(
            rdv.cpu_address.as_str(),
            opts.rank,
            opts.world_size,
            opts.cpu_timeouts(),
        )?),
        CollectiveChoice::Nccl => nccl_join(opts, rdv)?,
    })
}

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
    loop {
        let rdv = match fetch(&opts, after).await {
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
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (o, r) = (opts.clone(), rdv.clone());
        std::thread::Builder::new()
            .name(format!("rank-{}", opts.rank))
            .spawn(move || {
                let _ = tx.send(follow_generation(&o, &r));
            })
            .context("starting the follower thread")?;
        match rx.await.context("the follower thread died")? {
            Ok(()) => {
                tracing::info!(rank = opts.rank, "rank 0 ended the run: exiting");
                return Ok(());
            }
            Err(e) => {
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
fn follow_generation(opts: &GroupOptions, rdv: &Rendezvous) -> Result<()> {
    let collective = join_rendezvous(opts, rdv)?;
    let mut trainer = Trainer::join_group(collective)?;
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
                let examples = StepExamples::from_proto(batch.examples)
                    .map_err(anyhow::Error::msg)?
                    .shard(opts.rank, opts.world_size);
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
            Some(&MSG_KEEPALIVE) => {}
            Some(&MSG_STOP) => return Ok(()),
            other => bail!("rank 0 sent an unknown group message {other:?}"),
        }
    }
}

#[cfg(feature = "nccl")]
fn nccl_join(opts: &GroupOptions, rdv: &Rendezvous) -> Result<Box<dyn Collective>> {
    let id: crate::collective::NcclUniqueId = rdv
        .nccl_unique_id
        .as_slice()
        .try_into()
        .context("the NCCL unique id must be 128 bytes")?;
    Ok(Box::new(crate::collective::NcclCollective::new(
        &id,
        opts.rank,
        opts.world_size,
        opts.gpu,
    )?))
}

#[cfg(not(feature = "nccl"))]
fn nccl_join(_opts: &GroupOptions, _rdv: &Rendezvous) -> Result<Box<dyn Collective>> {
    bail!("this tutor was built without the `nccl` feature")
}

/// Encodes a batch for `GroupLead::send_step`.
pub fn encode_batch(batch: &tutor_proto::TrainBatch) -> Vec<u8> {
    batch.encode_to_vec()
}
