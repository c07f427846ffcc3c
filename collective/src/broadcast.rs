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

/// Bytes of a version per collective call: a receiver hashes and keeps one part while
/// the next arrives, so the sha256 overlaps the transfer instead of following it.
const PART_BYTES: usize = 32 << 20;

/// What precedes each version's bytes. `version` `None`: a keepalive, no bytes follow.
#[derive(Debug, Serialize, Deserialize)]
struct Header {
    version: Option<u64>,
    sha256: String,
    bytes: u64,
    /// The bytes come in parts of this many (the last shorter), one collective call
    /// each; 0: in one call (a sender before parts).
    #[serde(default)]
    part: u64,
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
                    part: 0,
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
/// bytes in parts of [`PART_BYTES`], as the broadcaster does.
pub fn send_version(c: &mut dyn Collective, pv: &VersionFile) -> Result<()> {
    send_version_in_parts(c, pv, PART_BYTES)
}

/// `send_version` in parts of `part` bytes (`usize::MAX`: one part, so the receivers
/// hash only after every byte arrived; the `weights_move` bench compares the two).
pub fn send_version_in_parts(c: &mut dyn Collective, pv: &VersionFile, part: usize) -> Result<()> {
    // The whole file is read before the header goes out: a file that cannot be read
    // fails here, not halfway through a version the receivers are taking.
    let reading = || format!("reading {}", pv.path.display());
    let mut file = std::fs::File::open(&pv.path).with_context(reading)?;
    let bytes = file.metadata().with_context(reading)?.len();
    let part = part.max(1);
    let mut parts = Vec::new();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(part as u64) as usize;
        let mut buf = vec![0u8; n];
        std::io::Read::read_exact(&mut file, &mut buf).with_context(reading)?;
        parts.push(buf);
        left -= n as u64;
    }
    if parts.is_empty() {
        // An empty file: the receivers still take one (empty) call.
        parts.push(Vec::new());
    }
    send_header(
        c,
        &Header {
            version: Some(pv.version),
            sha256: pv.sha256.clone(),
            bytes,
            part: part as u64,
        },
    )?;
    for mut buf in parts {
        // The receivers expect the size the header announced.
        let n = buf.len();
        c.broadcast_bytes_max(&mut buf, n)
            .with_context(|| format!("sending policy version {}", pv.version))?;
    }
    Ok(())
}

/// The bytes of the version `header` announces and their sha256 (hex). In parts, each
/// hashed and kept by a thread of its own while the next arrives; never more than the
/// header announced (a longer part is refused unread).
fn receive_parts(c: &mut dyn Collective, header: &Header) -> Result<(Vec<u8>, String)> {
    let total = usize::try_from(header.bytes).unwrap_or(usize::MAX);
    // In one call (a sender before parts, or a version of one part): hashed once here.
    if header.part == 0 || header.part >= header.bytes {
        let mut data = Vec::new();
        c.broadcast_bytes_max(&mut data, total)?;
        let sha = hex::encode(Sha256::digest(&data));
        return Ok((data, sha));
    }
    let part = usize::try_from(header.part).unwrap_or(usize::MAX);
    let mut data = Vec::new();
    data.try_reserve_exact(total).map_err(|e| {
        anyhow::anyhow!("no memory for the {total} bytes the header announced: {e}")
    })?;
    std::thread::scope(|scope| {
        let (parts, arrived) = std::sync::mpsc::sync_channel::<Vec<u8>>(2);
        let keeper = scope.spawn(move || {
            let mut hasher = Sha256::new();
            for p in arrived {
                hasher.update(&p);
                data.extend_from_slice(&p);
            }
            (data, hex::encode(hasher.finalize()))
        });
        let mut got = 0usize;
        let received = (|| -> Result<()> {
            while got < total {
                let want = part.min(total - got);
                let mut p = Vec::new();
                c.broadcast_bytes_max(&mut p, want)?;
                if p.len() != want {
                    bail!(
                        "a part of {} bytes arrived at byte {got}, the header announced {want}",
                        p.len()
                    );
                }
                got += want;
                if parts.send(p).is_err() {
                    bail!("the thread hashing the parts stopped");
                }
            }
            Ok(())
        })();
        drop(parts);
        let kept = keeper
            .join()
            .map_err(|_| anyhow::anyhow!("the thread hashing the parts panicked"))?;
        received.map(|()| kept)
    })
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
        let (data, sha) = receive_parts(c, &header)
            .with_context(|| format!("receiving policy version {version}"))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::{CpuCollective, CpuCollectiveTimeouts, CpuRendezvous};

    fn pair() -> (CpuCollective, CpuCollective) {
        let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
        let addr = rdv.local_addr();
        let t = CpuCollectiveTimeouts::default();
        let leaf = std::thread::spawn(move || CpuCollective::connect(addr, 1, 2, t).unwrap());
        let root = rdv.accept(2, t).unwrap();
        (root, leaf.join().unwrap())
    }

    fn version_file(dir: &std::path::Path, data: &[u8], sha256: Option<&str>) -> VersionFile {
        let path = dir.join("model.safetensors");
        std::fs::write(&path, data).unwrap();
        VersionFile {
            version: 3,
            sha256: sha256.map_or_else(|| hex::encode(Sha256::digest(data)), str::to_string),
            bytes: data.len() as u64,
            path,
        }
    }

    /// A version sent in parts (the last one shorter) arrives whole, with the sha256 the
    /// header announced, also an empty one and one sent with parts of 0 bytes (taken as
    /// 1); a file whose bytes do not match the announced sha256 is refused, naming both
    /// checksums. Then the group goes on.
    #[test]
    fn a_version_in_parts_arrives_whole_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..10_500u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let (mut root, mut leaf) = pair();
        let empty = Vec::new();
        for (data, part, sha) in [
            (&data, 1000, None),
            (&data, PART_BYTES, None),
            (&empty, 1000, None),
            (&data, 0, None),
            (&data, 1000, Some("00ff")),
        ] {
            let pv = version_file(dir.path(), data, sha);
            let sender = std::thread::spawn(move || {
                send_version_in_parts(&mut root, &pv, part).unwrap();
                root
            });
            let got = receive_one(&mut leaf);
            root = sender.join().unwrap();
            match sha {
                None => {
                    let got = got.unwrap().expect("a version, not a keepalive");
                    assert_eq!(got.version, 3);
                    assert_eq!(got.bytes.as_slice(), data.as_slice());
                    assert_eq!(got.sha256, hex::encode(Sha256::digest(data)));
                }
                Some(announced) => {
                    let e = format!("{:#}", got.unwrap_err());
                    assert!(
                        e.contains(announced) && e.contains(&hex::encode(Sha256::digest(data))),
                        "{e}"
                    );
                }
            }
        }
    }

    /// A sender before parts (`part` absent from its header: all bytes in one call) is
    /// still received.
    #[test]
    fn a_version_in_one_call_is_still_received() {
        let data = b"weights in one piece".to_vec();
        let (mut root, mut leaf) = pair();
        let sent = data.clone();
        let sender = std::thread::spawn(move || {
            let mut header = serde_json::to_vec(&serde_json::json!({
                "version": 5,
                "sha256": hex::encode(Sha256::digest(&sent)),
                "bytes": sent.len(),
            }))
            .unwrap();
            root.broadcast_bytes_max(&mut header, MAX_HEADER_BYTES)
                .unwrap();
            let mut bytes = sent;
            let n = bytes.len();
            root.broadcast_bytes_max(&mut bytes, n).unwrap();
        });
        let got = receive_one(&mut leaf).unwrap().unwrap();
        sender.join().unwrap();
        assert_eq!((got.version, got.bytes.as_slice()), (5, data.as_slice()));
    }
}
