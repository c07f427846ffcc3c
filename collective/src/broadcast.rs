//! Policy versions pushed to rollout workers over a collective (`[learner]
//! weight_receivers = N`, `[worker] weights_from = "broadcast"`): NCCL when the workers
//! share a communicator with learner rank 0 (GPU workers), else the CPU collective.
//!
//! It only moves bytes ahead of time. The version a worker runs is still the one the
//! coordinator names in the lease, checked against the sha256 the learner registered: a
//! version that arrived over the broadcast is the same file the Weights service would have
//! streamed, and a worker that did not get it (not in the group yet, group broken, too
//! slow) downloads it over gRPC as before. So the version semantics are the same either
//! way, and a dead receiver never stops training.
//!
//! Rank 0 (the learner) publishes the rendezvous of group [`GROUP`] at the coordinator,
//! waits for the N receivers, then sends every version it registers: a JSON
//! [`Header`], then the safetensors file's bytes (`Collective::broadcast_bytes_max`, which
//! a receiver bounds by the size the header announced). A receiver keeps the bytes in
//! memory; a worker's in-process engine loads them from there (no file written, none
//! read back), and one whose student is an external engine writes them for it to load. While nothing is published it
//! sends a keepalive header every [`KEEPALIVE`]. A failed send (a receiver died) drops the
//! group; rank 0 publishes a new generation and the receivers, restarted or not, join it
//! and get the newest version at once. With a CPU group, a receiver joins through the
//! same hello as a learner rank (`rendezvous::join_rendezvous`): authenticated with a key
//! derived from the run's auth token and the group's name when there is a token.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use tutor_proto::CollectiveKind;

use crate::rendezvous::{fetch, form_as_rank0, join_rendezvous, CollectiveChoice, GroupOptions};
use crate::Collective;

/// A policy version on disk, as the learner published it (the learner's
/// `PublishedVersion`): what the broadcaster sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionFile {
    pub version: u64,
    pub sha256: String,
    pub bytes: u64,
    pub path: PathBuf,
}

/// The rendezvous group of learner rank 0 and the weight receivers.
pub const GROUP: &str = crate::WEIGHTS_GROUP;
/// How often rank 0 sends a keepalive while no version is published.
pub const KEEPALIVE: Duration = Duration::from_secs(5);
/// How long a receiver waits for rank 0's next message before it calls the group lost
/// (several keepalives).
pub const RECEIVE_TIMEOUT: Duration = Duration::from_secs(60);

/// The most bytes a [`Header`] may have on the wire (it has a few dozen).
const MAX_HEADER_BYTES: usize = 64 * 1024;

/// What precedes each version's bytes. `version` `None`: a keepalive, no bytes follow.
#[derive(Debug, Serialize, Deserialize)]
struct Header {
    version: Option<u64>,
    sha256: String,
    bytes: u64,
}

/// Learner rank 0: a thread that keeps the group of `opts` (rank 0, world size N + 1,
/// group [`GROUP`]) formed and sends it the newest version `latest` returns, newest first
/// when a group forms. Runs until `stop` is set (checked between messages).
pub fn spawn_broadcaster(
    opts: GroupOptions,
    latest: impl Fn() -> Option<VersionFile> + Send + 'static,
    rt: tokio::runtime::Handle,
    stop: Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<()>> {
    if opts.rank != 0 || opts.group != GROUP {
        bail!("the weights broadcaster is rank 0 of group {GROUP:?}");
    }
    opts.validate()?;
    std::thread::Builder::new()
        .name("weights-broadcast".into())
        .spawn(move || broadcaster(opts, &latest, rt, stop))
        .context("starting the weights broadcaster thread")
}

fn broadcaster(
    opts: GroupOptions,
    latest: &dyn Fn() -> Option<VersionFile>,
    rt: tokio::runtime::Handle,
    stop: Arc<AtomicBool>,
) {
    let receivers = opts.world_size - 1;
    let mut group: Option<(Box<dyn Collective>, u64)> = None;
    // The version the current group has; `None` right after it formed.
    let mut sent: Option<u64> = None;
    let mut last_message = Instant::now();
    while !stop.load(Ordering::SeqCst) {
        let Some((collective, generation)) = group.as_mut() else {
            match form_as_rank0(&opts, &rt, "weights broadcast group") {
                Ok(g) => {
                    tracing::info!(
                        generation = g.1,
                        receivers,
                        "weight receivers joined: new policy versions go to them over the collective"
                    );
                    group = Some(g);
                    sent = None;
                    last_message = Instant::now();
                }
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), receivers, "the weight receivers did not all join; trying again (workers download over gRPC meanwhile)");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            continue;
        };
        let newest = latest().filter(|pv| Some(pv.version) != sent);
        let result = match &newest {
            Some(pv) => send_version(collective.as_mut(), pv),
            None if last_message.elapsed() >= KEEPALIVE => send_header(
                collective.as_mut(),
                &Header {
                    version: None,
                    sha256: String::new(),
                    bytes: 0,
                },
            ),
            None => {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        last_message = Instant::now();
        match result {
            Ok(()) => {
                if let Some(pv) = newest {
                    tracing::info!(
                        version = pv.version,
                        bytes = pv.bytes,
                        generation = *generation,
                        "sent policy version to the weight receivers"
                    );
                    sent = Some(pv.version);
                }
            }
            Err(e) => {
                tracing::warn!(
                    generation = *generation,
                    error = %format!("{e:#}"),
                    "lost a weight receiver: forming the group again (workers download over gRPC meanwhile)"
                );
                group = None;
            }
        }
    }
}

fn send_header(c: &mut dyn Collective, header: &Header) -> Result<()> {
    let mut bytes = serde_json::to_vec(header)?;
    c.broadcast_bytes_max(&mut bytes, MAX_HEADER_BYTES)
        .context("sending a header to the weight receivers")
}

/// A version a receiver got: the safetensors file's bytes, whose sha256 is `sha256`, in
/// memory (an in-process engine loads them from there: no file written or read back).
#[derive(Clone, PartialEq, Eq)]
pub struct Arrived {
    pub version: u64,
    pub sha256: String,
    pub bytes: Arc<Vec<u8>>,
}

impl std::fmt::Debug for Arrived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the bytes: gigabytes.
        f.debug_struct("Arrived")
            .field("version", &self.version)
            .field("sha256", &self.sha256)
            .field("len", &self.bytes.len())
            .finish()
    }
}

/// What a receiver reports to its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReceiverEvent {
    /// It is in a formed group: new versions will come.
    Joined {
        generation: u64,
    },
    /// Its group broke (or never formed): nothing comes until it joins again, so there
    /// is no point waiting for a version.
    Left,
    Arrived(Arrived),
}

/// A weight receiver (a rollout worker): a thread that joins the newest generation of
/// group [`GROUP`] as `opts.rank` (1..N; the world size comes from the rendezvous),
/// and reports each version it receives (checksum verified, bytes in memory), and its
/// joining and leaving groups, to `on_event`. Joins again whenever the group breaks; runs
/// for the life of the process.
pub fn spawn_receiver(
    opts: GroupOptions,
    rt: tokio::runtime::Handle,
    on_event: impl Fn(ReceiverEvent) + Send + 'static,
) -> Result<std::thread::JoinHandle<()>> {
    if opts.rank == 0 || opts.group != GROUP {
        bail!(
            "a weight receiver has a rank of 1 or more in group {GROUP:?} (got rank {})",
            opts.rank
        );
    }
    std::thread::Builder::new()
        .name("weights-receive".into())
        .spawn(move || receiver(opts, rt, &on_event))
        .context("starting the weights receiver thread")
}

fn receiver(opts: GroupOptions, rt: tokio::runtime::Handle, on_event: &dyn Fn(ReceiverEvent)) {
    let mut after = 0;
    loop {
        let rdv = match rt.block_on(fetch(&opts, after)) {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %format!("{e:#}"), "no weights broadcast group yet");
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        let mut o = opts.clone();
        o.world_size = rdv.world_size as usize;
        if o.rank >= o.world_size {
            tracing::warn!(
                rank = o.rank,
                receivers = o.world_size - 1,
                "this worker's weights rank is not below the learner's weight_receivers + 1: \
                 it downloads every version over gRPC"
            );
            after = rdv.generation;
            continue;
        }
        // The learner chose the collective (`[learner] broadcast_collective`).
        o.collective = match CollectiveKind::try_from(rdv.kind) {
            Ok(CollectiveKind::Nccl) => CollectiveChoice::Nccl,
            _ => CollectiveChoice::Cpu,
        };
        let result = join_rendezvous(&o, &rdv).and_then(|mut c| {
            tracing::info!(
                generation = rdv.generation,
                rank = o.rank,
                "joined the weights broadcast group"
            );
            on_event(ReceiverEvent::Joined {
                generation: rdv.generation,
            });
            receive(c.as_mut(), on_event)
        });
        on_event(ReceiverEvent::Left);
        if let Err(e) = result {
            tracing::warn!(
                generation = rdv.generation,
                error = %format!("{e:#}"),
                "left the weights broadcast group: waiting for a newer one (versions come over gRPC meanwhile)"
            );
        }
        after = rdv.generation;
    }
}

/// Receives versions until the group fails.
fn receive(c: &mut dyn Collective, on_event: &dyn Fn(ReceiverEvent)) -> Result<()> {
    loop {
        if let Some(arrived) = receive_one(c)? {
            on_event(ReceiverEvent::Arrived(arrived));
        }
    }
}

/// Sends policy version `pv` to the group of `c` (rank 0): its header, then the file's
/// bytes, as the broadcaster does.
pub fn send_version(c: &mut dyn Collective, pv: &VersionFile) -> Result<()> {
    let mut data =
        std::fs::read(&pv.path).with_context(|| format!("reading {}", pv.path.display()))?;
    send_header(
        c,
        &Header {
            version: Some(pv.version),
            sha256: pv.sha256.clone(),
            bytes: data.len() as u64,
        },
    )?;
    // The receivers expect the size the header announced.
    let max = data.len();
    c.broadcast_bytes_max(&mut data, max)
        .with_context(|| format!("sending policy version {}", pv.version))
}

/// Receives rank 0's next message: a version (checked against the sha256 and size its
/// header announced), or `None` for a keepalive.
pub fn receive_one(c: &mut dyn Collective) -> Result<Option<Arrived>> {
    {
        let mut bytes = Vec::new();
        c.broadcast_bytes_max(&mut bytes, MAX_HEADER_BYTES)
            .context("waiting for learner rank 0's next message")?;
        let header: Header = serde_json::from_slice(&bytes).context(
            "learner rank 0 sent a header this worker cannot read (same tutor version?)",
        )?;
        let Some(version) = header.version else {
            return Ok(None); // keepalive
        };
        // No more than the header announced (a corrupt length is refused unread).
        let mut data = Vec::new();
        let max = usize::try_from(header.bytes).unwrap_or(usize::MAX);
        c.broadcast_bytes_max(&mut data, max)
            .with_context(|| format!("receiving policy version {version}"))?;
        let sha = hex::encode(Sha256::digest(&data));
        if data.len() as u64 != header.bytes || sha != header.sha256 {
            bail!(
                "policy version {version} arrived with {} bytes and sha256 {sha}, the header said {} bytes and {}",
                data.len(),
                header.bytes,
                header.sha256
            );
        }
        tracing::info!(
            version,
            bytes = data.len(),
            "policy version arrived over the weights broadcast"
        );
        Ok(Some(Arrived {
            version,
            sha256: sha,
            bytes: Arc::new(data),
        }))
    }
}
