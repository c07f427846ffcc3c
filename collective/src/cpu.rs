//! The CPU collective: every rank connects to rank 0 over TCP (a star), rank 0 reduces
//! and sends the results back. Frames carry an op and a sequence number so ranks that fall
//! out of step fail loudly instead of mixing tensors.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

use crate::{Collective, CollectiveError};

const MAGIC: &[u8; 8] = b"TUTORCC1";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Op {
    AllReduceSum = 1,
    Broadcast = 2,
    Barrier = 3,
    BroadcastBytes = 4,
}

impl Op {
    /// Rank 0 alone contributes: the others send an empty payload.
    fn root_only(self) -> bool {
        matches!(self, Op::Broadcast | Op::BroadcastBytes)
    }
}

/// Defaults for the CPU collective's deadlines.
#[derive(Debug, Clone, Copy)]
pub struct CpuCollectiveTimeouts {
    /// How long ranks wait for one another to join.
    pub connect: Duration,
    /// How long one read or write may block: bounds how far one rank may fall behind
    /// inside a collective (e.g. a slow forward pass on another rank).
    pub io: Duration,
}

impl Default for CpuCollectiveTimeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(60),
            io: Duration::from_secs(600),
        }
    }
}

/// Rank 0's listening socket, before the other ranks have joined.
pub struct CpuRendezvous {
    listener: TcpListener,
    addr: SocketAddr,
}

impl CpuRendezvous {
    /// Binds rank 0's socket (port 0 picks a free port; see `local_addr`).
    pub fn bind(addr: impl ToSocketAddrs) -> Result<Self, CollectiveError> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| CollectiveError::Setup(format!("rank 0 cannot listen: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| CollectiveError::Setup(format!("rank 0 socket address: {e}")))?;
        Ok(Self { listener, addr })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits for ranks 1..world_size to connect.
    pub fn accept(
        self,
        world_size: usize,
        timeouts: CpuCollectiveTimeouts,
    ) -> Result<CpuCollective, CollectiveError> {
        if world_size == 0 {
            return Err(CollectiveError::Setup(
                "world_size must be at least 1".into(),
            ));
        }
        let start = Instant::now();
        let mut peers: Vec<Option<(TcpStream, SocketAddr)>> =
            (1..world_size).map(|_| None).collect();
        self.listener
            .set_nonblocking(true)
            .map_err(|e| CollectiveError::Setup(format!("rank 0 listener: {e}")))?;
        while peers.iter().any(|p| p.is_none()) {
            if start.elapsed() > timeouts.connect {
                let missing: Vec<usize> = peers
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.is_none())
                    .map(|(i, _)| i + 1)
                    .collect();
                return Err(CollectiveError::Rendezvous {
                    addr: self.addr.to_string(),
                    joined: world_size - missing.len(),
                    world_size,
                    missing,
                    waited: start.elapsed(),
                });
            }
            let (mut stream, peer_addr) = match self.listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) => return Err(CollectiveError::Setup(format!("rank 0 accept: {e}"))),
            };
            configure(&stream, timeouts.io, timeouts.connect)
                .map_err(|e| CollectiveError::Setup(format!("socket from {peer_addr}: {e}")))?;
            // A stray connection (a port scan, a rank of another run) is dropped, not fatal.
            let hello = read_hello(&mut stream);
            let (rank, their_world) = match hello {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(%peer_addr, error = %e, "ignoring a connection that did not send a collective hello");
                    continue;
                }
            };
            if their_world != world_size {
                return Err(CollectiveError::Setup(format!(
                    "rank {rank} at {peer_addr} says world_size = {their_world}, rank 0 has {world_size}"
                )));
            }
            if rank == 0 || rank >= world_size {
                return Err(CollectiveError::Setup(format!(
                    "a peer at {peer_addr} claims rank {rank}, expected 1..{world_size}"
                )));
            }
            if peers[rank - 1].is_some() {
                return Err(CollectiveError::Setup(format!(
                    "two peers claim rank {rank} (the second from {peer_addr})"
                )));
            }
            stream
                .write_all(MAGIC)
                .map_err(|e| CollectiveError::Setup(format!("greeting rank {rank}: {e}")))?;
            stream
                .set_read_timeout(Some(timeouts.io))
                .and_then(|_| stream.set_write_timeout(Some(timeouts.io)))
                .map_err(|e| CollectiveError::Setup(format!("socket of rank {rank}: {e}")))?;
            peers[rank - 1] = Some((stream, peer_addr));
        }
        let peers = peers.into_iter().map(|p| p.expect("all joined")).collect();
        Ok(CpuCollective {
            rank: 0,
            world_size,
            link: Link::Root { peers },
            seq: 0,
        })
    }
}

/// Data-parallel collectives for CPU ranks: rank 0 listens, the others connect to it; a
/// reduction gathers every rank's tensors at rank 0, which sums them in rank order and
/// sends the result back, so all ranks hold bit-identical sums. Works across processes
/// (over loopback or a network) and between threads of one process.
pub struct CpuCollective {
    rank: usize,
    world_size: usize,
    link: Link,
    seq: u64,
}

enum Link {
    Solo,
    Root { peers: Vec<(TcpStream, SocketAddr)> },
    Leaf { root: TcpStream, addr: SocketAddr },
}

impl CpuCollective {
    /// A group of one: every operation is the identity.
    pub fn solo() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            link: Link::Solo,
            seq: 0,
        }
    }

    /// Joins as `rank` (≥ 1) the group whose rank 0 listens at `root`, retrying until the
    /// connect deadline (rank 0 may start later).
    pub fn connect(
        root: impl ToSocketAddrs,
        rank: usize,
        world_size: usize,
        timeouts: CpuCollectiveTimeouts,
    ) -> Result<Self, CollectiveError> {
        if rank == 0 || rank >= world_size {
            return Err(CollectiveError::Setup(format!(
                "connect is for ranks 1..{world_size}, got rank {rank} (rank 0 uses CpuRendezvous)"
            )));
        }
        let addr = root
            .to_socket_addrs()
            .map_err(|e| CollectiveError::Setup(format!("resolving rank 0's address: {e}")))?
            .next()
            .ok_or_else(|| CollectiveError::Setup("rank 0's address resolves to nothing".into()))?;
        let start = Instant::now();
        let stream = loop {
            let left = timeouts.connect.saturating_sub(start.elapsed());
            let attempt = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(10)))
                .and_then(|mut s| {
                    configure(&s, timeouts.connect, timeouts.connect)?;
                    s.write_all(MAGIC)?;
                    s.write_all(&(rank as u64).to_le_bytes())?;
                    s.write_all(&(world_size as u64).to_le_bytes())?;
                    let mut magic = [0u8; 8];
                    s.read_exact(&mut magic)?;
                    if &magic != MAGIC {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "the listener is not a Tutor CPU collective",
                        ));
                    }
                    Ok(s)
                });
            match attempt {
                Ok(s) => break s,
                Err(e) if start.elapsed() >= timeouts.connect => {
                    return Err(CollectiveError::Connect {
                        rank,
                        addr: addr.to_string(),
                        waited: start.elapsed(),
                        source: e,
                    })
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        stream
            .set_read_timeout(Some(timeouts.io))
            .and_then(|_| stream.set_write_timeout(Some(timeouts.io)))
            .map_err(|e| CollectiveError::Setup(format!("socket to rank 0: {e}")))?;
        Ok(Self {
            rank,
            world_size,
            link: Link::Leaf { root: stream, addr },
            seq: 0,
        })
    }

    /// Rank 0 binds and waits for the others; other ranks connect to `root`.
    pub fn init(
        root: SocketAddr,
        rank: usize,
        world_size: usize,
        timeouts: CpuCollectiveTimeouts,
    ) -> Result<Self, CollectiveError> {
        if world_size == 1 {
            return Ok(Self::solo());
        }
        if rank == 0 {
            CpuRendezvous::bind(root)?.accept(world_size, timeouts)
        } else {
            Self::connect(root, rank, world_size, timeouts)
        }
    }

    /// The core exchange: rank 0 receives every rank's payload, combines them, and sends
    /// the combined payload back. `combine` sees the payloads in rank order.
    fn exchange(
        &mut self,
        op: Op,
        payload: Vec<u8>,
        combine: impl FnOnce(Vec<Vec<u8>>) -> Vec<u8>,
    ) -> Result<Vec<u8>, CollectiveError> {
        self.seq += 1;
        let seq = self.seq;
        let rank = self.rank;
        match &mut self.link {
            Link::Solo => Ok(combine(vec![payload])),
            Link::Root { peers } => {
                let mut all = Vec::with_capacity(peers.len() + 1);
                let own_len = payload.len();
                all.push(payload);
                let mut failure = None;
                for (i, (stream, addr)) in peers.iter_mut().enumerate() {
                    let peer = i + 1;
                    match read_frame(stream) {
                        Ok((pop, pseq, data)) => {
                            if pop != op as u8 || pseq != seq {
                                failure = Some(CollectiveError::Mismatch {
                                    rank,
                                    peer,
                                    detail: format!(
                                        "rank 0 is at collective #{seq} ({op:?}), rank {peer} sent #{pseq} (op {pop})"
                                    ),
                                });
                                break;
                            }
                            if !op.root_only() && data.len() != own_len {
                                failure = Some(CollectiveError::Mismatch {
                                    rank,
                                    peer,
                                    detail: format!(
                                        "{op:?} #{seq}: rank 0 has {own_len} bytes, rank {peer} sent {}",
                                        data.len()
                                    ),
                                });
                                break;
                            }
                            all.push(data);
                        }
                        Err(e) => {
                            failure = Some(CollectiveError::Peer {
                                rank,
                                peer,
                                addr: addr.to_string(),
                                what: "receiving a collective payload",
                                source: e,
                            });
                            break;
                        }
                    }
                }
                if let Some(f) = failure {
                    return Err(f);
                }
                let result = combine(all);
                for (i, (stream, addr)) in peers.iter_mut().enumerate() {
                    write_frame(stream, op, seq, &result).map_err(|e| CollectiveError::Peer {
                        rank,
                        peer: i + 1,
                        addr: addr.to_string(),
                        what: "sending a collective result",
                        source: e,
                    })?;
                }
                Ok(result)
            }
            Link::Leaf { root, addr } => {
                let addr = *addr;
                let peer_err = |what, source| CollectiveError::Peer {
                    rank,
                    peer: 0,
                    addr: addr.to_string(),
                    what,
                    source,
                };
                // Broadcast receivers have nothing to contribute.
                let sent: &[u8] = if op.root_only() { &[] } else { &payload };
                write_frame(root, op, seq, sent)
                    .map_err(|e| peer_err("sending a collective payload", e))?;
                match read_frame(root) {
                    Ok((pop, pseq, data)) if pop == op as u8 && pseq == seq => Ok(data),
                    Ok((pop, pseq, _)) => Err(CollectiveError::Mismatch {
                        rank,
                        peer: 0,
                        detail: format!(
                            "rank {rank} is at collective #{seq} ({op:?}), rank 0 answered #{pseq} (op {pop})"
                        ),
                    }),
                    Err(e) => Err(peer_err("receiving a collective result", e)),
                }
            }
        }
    }
}

impl Collective for CpuCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&mut self, tensors: &mut [Tensor]) -> Result<(), CollectiveError> {
        if self.world_size == 1 {
            return Ok(());
        }
        let layout = WireLayout::of(tensors)?;
        let payload = layout.encode(tensors);
        let summed = self.exchange(Op::AllReduceSum, payload, |parts| layout.sum(parts))?;
        layout.decode_into(&summed, tensors);
        Ok(())
    }

    fn broadcast(&mut self, tensors: &mut [Tensor]) -> Result<(), CollectiveError> {
        if self.world_size == 1 {
            return Ok(());
        }
        let layout = WireLayout::of(tensors)?;
        let payload = if self.rank == 0 {
            layout.encode(tensors)
        } else {
            Vec::new()
        };
        let data = self.exchange(Op::Broadcast, payload, |mut parts| parts.swap_remove(0))?;
        if data.len() != layout.bytes {
            return Err(CollectiveError::Mismatch {
                rank: self.rank,
                peer: 0,
                detail: format!(
                    "broadcast: rank 0 sent {} bytes, rank {} expects {}",
                    data.len(),
                    self.rank,
                    layout.bytes
                ),
            });
        }
        if self.rank != 0 {
            layout.decode_into(&data, tensors);
        }
        Ok(())
    }

    fn broadcast_bytes(&mut self, data: &mut Vec<u8>) -> Result<(), CollectiveError> {
        if self.world_size == 1 {
            return Ok(());
        }
        let payload = if self.rank == 0 {
            std::mem::take(data)
        } else {
            Vec::new()
        };
        *data = self.exchange(Op::BroadcastBytes, payload, |mut parts| {
            parts.swap_remove(0)
        })?;
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        if self.world_size == 1 {
            return Ok(());
        }
        self.exchange(Op::Barrier, Vec::new(), |_| Vec::new())?;
        Ok(())
    }
}

/// How a list of tensors travels: f64 tensors as f64, everything else as f32
/// (little-endian), concatenated.
struct WireLayout {
    /// Per tensor: element count and whether it travels as f64.
    items: Vec<(usize, bool)>,
    bytes: usize,
}

impl WireLayout {
    fn of(tensors: &[Tensor]) -> Result<Self, CollectiveError> {
        let mut items = Vec::with_capacity(tensors.len());
        let mut bytes = 0;
        for t in tensors {
            if t.device() != Device::Cpu {
                return Err(CollectiveError::Setup(format!(
                    "the CPU collective got a tensor on {:?}; use the NCCL collective for GPU ranks",
                    t.device()
                )));
            }
            let wide = t.kind() == Kind::Double;
            let n = t.numel();
            bytes += n * if wide { 8 } else { 4 };
            items.push((n, wide));
        }
        Ok(Self { items, bytes })
    }

    fn encode(&self, tensors: &[Tensor]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.bytes);
        for (t, &(n, wide)) in tensors.iter().zip(&self.items) {
            if wide {
                let mut v = vec![0f64; n];
                t.contiguous().copy_data(&mut v, n);
                v.iter()
                    .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
            } else {
                let mut v = vec![0f32; n];
                t.to_kind(Kind::Float).contiguous().copy_data(&mut v, n);
                v.iter()
                    .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
            }
        }
        out
    }

    /// Element-wise sum of the ranks' payloads, accumulated in rank order.
    fn sum(&self, parts: Vec<Vec<u8>>) -> Vec<u8> {
        let mut parts = parts.into_iter();
        let mut acc = parts.next().unwrap_or_default();
        for part in parts {
            let mut off = 0;
            for &(n, wide) in &self.items {
                if wide {
                    for k in 0..n {
                        let r = off + 8 * k..off + 8 * k + 8;
                        let a = f64::from_le_bytes(acc[r.clone()].try_into().unwrap());
                        let b = f64::from_le_bytes(part[r.clone()].try_into().unwrap());
                        acc[r].copy_from_slice(&(a + b).to_le_bytes());
                    }
                    off += 8 * n;
                } else {
                    for k in 0..n {
                        let r = off + 4 * k..off + 4 * k + 4;
                        let a = f32::from_le_bytes(acc[r.clone()].try_into().unwrap());
                        let b = f32::from_le_bytes(part[r.clone()].try_into().unwrap());
                        acc[r].copy_from_slice(&(a + b).to_le_bytes());
                    }
                    off += 4 * n;
                }
            }
        }
        acc
    }

    fn decode_into(&self, data: &[u8], tensors: &mut [Tensor]) {
        let mut off = 0;
        tch::no_grad(|| {
            for (t, &(n, wide)) in tensors.iter_mut().zip(&self.items) {
                let src = if wide {
                    let v: Vec<f64> = data[off..off + 8 * n]
                        .chunks_exact(8)
                        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                        .collect();
                    off += 8 * n;
                    Tensor::from_slice(&v)
                } else {
                    let v: Vec<f32> = data[off..off + 4 * n]
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect();
                    off += 4 * n;
                    Tensor::from_slice(&v)
                };
                t.copy_(&src.reshape(t.size()));
            }
        });
    }
}

fn configure(s: &TcpStream, io: Duration, handshake: Duration) -> io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(handshake.min(io)))?;
    s.set_write_timeout(Some(handshake.min(io)))
}

fn read_hello(s: &mut TcpStream) -> io::Result<(usize, usize)> {
    let mut magic = [0u8; 8];
    s.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "bad magic"));
    }
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    let rank = u64::from_le_bytes(b) as usize;
    s.read_exact(&mut b)?;
    let world = u64::from_le_bytes(b) as usize;
    Ok((rank, world))
}

fn write_frame(s: &mut TcpStream, op: Op, seq: u64, data: &[u8]) -> io::Result<()> {
    let mut header = [0u8; 17];
    header[0] = op as u8;
    header[1..9].copy_from_slice(&seq.to_le_bytes());
    header[9..17].copy_from_slice(&(data.len() as u64).to_le_bytes());
    s.write_all(&header)?;
    s.write_all(data)?;
    s.flush()
}

/// Frames larger than this are refused (a corrupt length would otherwise allocate it).
const MAX_FRAME: u64 = 64 << 30;

fn read_frame(s: &mut TcpStream) -> io::Result<(u8, u64, Vec<u8>)> {
    let mut header = [0u8; 17];
    s.read_exact(&mut header)?;
    let seq = u64::from_le_bytes(header[1..9].try_into().unwrap());
    let len = u64::from_le_bytes(header[9..17].try_into().unwrap());
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes announced"),
        ));
    }
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data)?;
    Ok((header[0], seq, data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Collective;

    fn group(world: usize) -> Vec<CpuCollective> {
        let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
        let addr = rdv.local_addr();
        let t = CpuCollectiveTimeouts {
            connect: Duration::from_secs(20),
            io: Duration::from_secs(20),
        };
        let leaves: Vec<_> = (1..world)
            .map(|r| std::thread::spawn(move || CpuCollective::connect(addr, r, world, t).unwrap()))
            .collect();
        let mut all = vec![rdv.accept(world, t).unwrap()];
        all.extend(leaves.into_iter().map(|h| h.join().unwrap()));
        all
    }

    #[test]
    fn all_reduce_broadcast_and_scalars_across_three_ranks() {
        let ranks = group(3);
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || {
                    let r = c.rank() as f32;
                    let mut ts = [
                        Tensor::from_slice(&[r, 10.0 * r, 1.0]).reshape([3, 1]),
                        Tensor::from_slice(&[r as f64 + 0.5]),
                    ];
                    c.all_reduce_sum(&mut ts).unwrap();
                    let a: Vec<f32> = Vec::try_from(ts[0].reshape([-1])).unwrap();
                    let b: Vec<f64> = Vec::try_from(&ts[1]).unwrap();
                    assert_eq!(ts[0].size(), vec![3, 1]);
                    assert_eq!(a, vec![3.0, 30.0, 3.0]);
                    assert_eq!(b, vec![4.5]);
                    let mut m = [Tensor::from_slice(&[r * 2.0])];
                    c.all_reduce_mean(&mut m).unwrap();
                    assert_eq!(f32::try_from(&m[0].reshape([])).unwrap(), 2.0);
                    let mut s = [c.rank() as f64, 1e-300];
                    c.all_reduce_sum_f64(&mut s).unwrap();
                    assert_eq!(s, [3.0, 3e-300]);
                    let mut bc = [Tensor::from_slice(&[r + 7.0, r])];
                    c.broadcast(&mut bc).unwrap();
                    let v: Vec<f32> = Vec::try_from(&bc[0]).unwrap();
                    assert_eq!(v, vec![7.0, 0.0]);
                    let mut bytes = if c.rank() == 0 {
                        b"a batch".to_vec()
                    } else {
                        vec![9; 3]
                    };
                    c.broadcast_bytes(&mut bytes).unwrap();
                    assert_eq!(bytes, b"a batch");
                    let mut empty = Vec::new();
                    c.broadcast_bytes(&mut empty).unwrap();
                    assert!(empty.is_empty());
                    c.barrier().unwrap();
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    fn a_dead_peer_is_named_in_the_error() {
        let mut ranks = group(2);
        let leaf = ranks.pop().unwrap();
        drop(leaf); // rank 1 exits
        let mut root = ranks.pop().unwrap();
        let err = root
            .all_reduce_sum(&mut [Tensor::from_slice(&[1f32])])
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank 1"), "{err}");
        assert!(
            err.contains("closed the connection") || err.contains("reset"),
            "{err}"
        );
    }

    #[test]
    fn mismatched_collectives_are_reported() {
        let ranks = group(2);
        let mut it = ranks.into_iter();
        let mut root = it.next().unwrap();
        let mut leaf = it.next().unwrap();
        let h = std::thread::spawn(move || {
            leaf.all_reduce_sum(&mut [Tensor::from_slice(&[1f32, 2.0])])
        });
        let err = root
            .all_reduce_sum(&mut [Tensor::from_slice(&[1f32])])
            .unwrap_err();
        assert!(
            matches!(err, CollectiveError::Mismatch { peer: 1, .. }),
            "{err}"
        );
        drop(root);
        assert!(h.join().unwrap().is_err());
    }

    #[test]
    fn connect_deadline_names_the_address() {
        // Bind then drop to get a port that nothing listens on.
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let t = CpuCollectiveTimeouts {
            connect: Duration::from_millis(300),
            io: Duration::from_secs(1),
        };
        let err = CpuCollective::connect(addr, 1, 2, t)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains(&addr.to_string()), "{err}");
        let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
        let err = rdv.accept(3, t).err().unwrap().to_string();
        assert!(err.contains("missing ranks: [1, 2]"), "{err}");
    }
}
