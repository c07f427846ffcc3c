//! The CPU collective: every rank connects to rank 0 over TCP (a star), rank 0 reduces
//! and sends the results back. Frames carry an op and a sequence number so ranks that fall
//! out of step fail loudly instead of mixing tensors.
//! (Past 800 lines with its tests: the accept loop's refusals — bad hellos, unknown ranks,
//! oversized frames, silent peers — each have a test beside the code.)

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

use crate::hello::{self, CollectiveSecret, JoinError, Refusal};
use crate::{Collective, CollectiveError};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Op {
    AllReduceSum = 1,
    Broadcast = 2,
    Barrier = 3,
    BroadcastBytes = 4,
    ReduceScatter = 5,
    AllGather = 6,
    GatherToRoot = 7,
}

impl Op {
    /// Rank 0 alone contributes: the others send an empty payload.
    fn root_only(self) -> bool {
        matches!(self, Op::Broadcast | Op::BroadcastBytes)
    }

    fn what(self) -> &'static str {
        match self {
            Op::AllReduceSum => "an all-reduce",
            Op::Broadcast => "a broadcast",
            Op::Barrier => "a barrier",
            Op::BroadcastBytes => "a byte broadcast",
            Op::ReduceScatter => "a reduce-scatter",
            Op::AllGather => "an all-gather",
            Op::GatherToRoot => "a gather to rank 0",
        }
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
    secret: Option<CollectiveSecret>,
    /// Set: `accept` gives up at once (its caller no longer waits for the ranks).
    abandon: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// Connections whose hello rank 0 waits for at once; beyond it the oldest is dropped (a
/// real rank says hello as soon as it connects, a flood of silent connections does not).
const MAX_PENDING_HELLOS: usize = 64;
/// How many refused connections a rendezvous error lists.
const REFUSALS_REPORTED: usize = 8;

impl CpuRendezvous {
    /// Binds rank 0's socket (port 0 picks a free port; see `local_addr`).
    pub fn bind(addr: impl ToSocketAddrs) -> Result<Self, CollectiveError> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| CollectiveError::Setup(format!("rank 0 cannot listen: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| CollectiveError::Setup(format!("rank 0 socket address: {e}")))?;
        Ok(Self {
            listener,
            addr,
            secret: None,
            abandon: None,
        })
    }

    /// Requires every joining rank to prove it holds `secret` (see `CollectiveSecret`);
    /// `None`: any connection that says a valid hello may join (loopback, no auth token).
    pub fn with_secret(self, secret: Option<CollectiveSecret>) -> Self {
        Self { secret, ..self }
    }

    /// `accept` gives up, with an error, once `flag` is set (within a few milliseconds):
    /// for a caller that learns another way that the ranks will not come.
    pub fn abandoned_by(self, flag: std::sync::Arc<std::sync::atomic::AtomicBool>) -> Self {
        Self {
            abandon: Some(flag),
            ..self
        }
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits for ranks 1..world_size to connect and say a valid hello. Each connection's
    /// hello is read on a thread of its own, within `min(connect, io)`, so a silent or slow
    /// connection never holds up the others; a connection whose hello is not valid (wrong
    /// MAC, unknown rank, other world size, rank already joined) is refused, logged and
    /// closed, and rank 0 goes on waiting for the real ranks until `timeouts.connect`.
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
        let hello_time = timeouts.connect.min(timeouts.io);
        let mut peers: Vec<Option<(TcpStream, SocketAddr)>> =
            (1..world_size).map(|_| None).collect();
        self.listener
            .set_nonblocking(true)
            .map_err(|e| CollectiveError::Setup(format!("rank 0 listener: {e}")))?;
        let (done_tx, done_rx) = mpsc::channel::<Hello>();
        // The connections whose hello threads are running (a handle to close each).
        let mut pending: VecDeque<(SocketAddr, TcpStream)> = VecDeque::new();
        let mut refused: Vec<String> = Vec::new();
        let result = loop {
            if peers.iter().all(|p| p.is_some()) {
                break Ok(());
            }
            if let Some(flag) = &self.abandon {
                if flag.load(std::sync::atomic::Ordering::SeqCst) {
                    break Err(CollectiveError::Setup(format!(
                        "rank 0 at {} stopped waiting for the other ranks: abandoned by its caller",
                        self.addr
                    )));
                }
            }
            if start.elapsed() > timeouts.connect {
                let missing: Vec<usize> = peers
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.is_none())
                    .map(|(i, _)| i + 1)
                    .collect();
                break Err(CollectiveError::Rendezvous {
                    addr: self.addr.to_string(),
                    joined: world_size - missing.len(),
                    world_size,
                    missing,
                    waited: start.elapsed(),
                    refused: std::mem::take(&mut refused),
                });
            }
            let mut idle = true;
            while let Ok(Hello {
                mut stream,
                peer_addr,
                verdict,
            }) = done_rx.try_recv()
            {
                idle = false;
                pending.retain(|(a, _)| *a != peer_addr);
                let deadline = Instant::now() + hello_time;
                let joining = match verdict {
                    Ok(j) if peers[j.rank - 1].is_some() => {
                        Err(Refusal::RankTaken { rank: j.rank })
                    }
                    other => other,
                };
                let joining = match joining {
                    Ok(j) => j,
                    Err(why) => {
                        tracing::warn!(%peer_addr, reason = %why, "rank 0 refused a connection to the collective");
                        if refused.len() < REFUSALS_REPORTED {
                            refused.push(format!("{peer_addr}: {why}"));
                        }
                        why.send(&mut stream, deadline);
                        continue;
                    }
                };
                let admitted = hello::admit(&mut stream, &joining, self.secret.as_ref(), deadline)
                    .and_then(|_| {
                        stream.set_read_timeout(Some(timeouts.io))?;
                        stream.set_write_timeout(Some(timeouts.io))
                    });
                match admitted {
                    Ok(()) => {
                        tracing::debug!(rank = joining.rank, %peer_addr, "a rank joined the collective");
                        peers[joining.rank - 1] = Some((stream, peer_addr));
                    }
                    // It may try again.
                    Err(e) => {
                        tracing::warn!(rank = joining.rank, %peer_addr, error = %e, "lost a rank while admitting it to the collective")
                    }
                }
            }
            match self.listener.accept() {
                Ok((stream, peer_addr)) => {
                    idle = false;
                    if let Err(e) = self.start_hello(
                        stream,
                        peer_addr,
                        world_size,
                        hello_time,
                        &done_tx,
                        &mut pending,
                    ) {
                        tracing::warn!(%peer_addr, error = %e, "rank 0 dropped a connection to the collective");
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // The peer gave up before it was accepted.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => break Err(CollectiveError::Setup(format!("rank 0 accept: {e}"))),
            }
            if idle {
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        // Hellos still running are of no use now: end their threads.
        for (_, s) in pending {
            let _ = s.shutdown(Shutdown::Both);
        }
        result?;
        let peers = peers.into_iter().map(|p| p.expect("all joined")).collect();
        Ok(CpuCollective {
            rank: 0,
            world_size,
            link: Link::Root { peers },
            seq: 0,
        })
    }

    /// Reads the hello of a new connection on a thread of its own, which hands the
    /// connection and its verdict to `done`.
    fn start_hello(
        &self,
        stream: TcpStream,
        peer_addr: SocketAddr,
        world_size: usize,
        hello_time: Duration,
        done: &mpsc::Sender<Hello>,
        pending: &mut VecDeque<(SocketAddr, TcpStream)>,
    ) -> io::Result<()> {
        configure(&stream, hello_time, hello_time)?;
        if pending.len() >= MAX_PENDING_HELLOS {
            if let Some((oldest, s)) = pending.pop_front() {
                tracing::warn!(peer_addr = %oldest, pending = MAX_PENDING_HELLOS, "too many connections waiting to say hello: dropping the oldest");
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        let handle = stream.try_clone()?;
        let (secret, done) = (self.secret.clone(), done.clone());
        std::thread::Builder::new()
            .name("collective-hello".into())
            .spawn(move || {
                let mut stream = stream;
                let deadline = Instant::now() + hello_time;
                let verdict = hello::challenge(&mut stream, secret.as_ref(), world_size, deadline);
                // Rank 0 may have stopped waiting: then the connection just closes.
                let _ = done.send(Hello {
                    stream,
                    peer_addr,
                    verdict,
                });
            })?;
        pending.push_back((peer_addr, handle));
        Ok(())
    }
}

/// A connection whose hello was read (or failed), back from its thread.
struct Hello {
    stream: TcpStream,
    peer_addr: SocketAddr,
    verdict: Result<hello::Joining, Refusal>,
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
    /// connect deadline (rank 0 may start later). For a group without a secret (see
    /// `connect_with_secret`).
    pub fn connect(
        root: impl ToSocketAddrs,
        rank: usize,
        world_size: usize,
        timeouts: CpuCollectiveTimeouts,
    ) -> Result<Self, CollectiveError> {
        Self::connect_with_secret(root, rank, world_size, timeouts, None)
    }

    /// `connect`, proving to rank 0 that this rank holds `secret` (and checking that rank
    /// 0 holds it too); must match whether rank 0 has one. A refusal (by rank 0, or of
    /// rank 0) is final; a connection that fails is tried again until the deadline.
    pub fn connect_with_secret(
        root: impl ToSocketAddrs,
        rank: usize,
        world_size: usize,
        timeouts: CpuCollectiveTimeouts,
        secret: Option<&CollectiveSecret>,
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
        let hello_time = timeouts.connect.min(timeouts.io);
        let stream = loop {
            let left = timeouts.connect.saturating_sub(start.elapsed());
            let attempt = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(10)))
                .map_err(JoinError::Io)
                .and_then(|mut s| {
                    configure(&s, hello_time, hello_time)?;
                    let deadline = Instant::now() + hello_time;
                    hello::join(&mut s, rank, world_size, secret, deadline)?;
                    Ok(s)
                });
            match attempt {
                Ok(s) => break s,
                Err(JoinError::Refused(reason)) => {
                    return Err(CollectiveError::Refused {
                        rank,
                        addr: addr.to_string(),
                        reason,
                    })
                }
                Err(JoinError::Io(e)) if start.elapsed() >= timeouts.connect => {
                    return Err(CollectiveError::Connect {
                        rank,
                        addr: addr.to_string(),
                        waited: start.elapsed(),
                        source: e,
                    })
                }
                Err(JoinError::Io(_)) => std::thread::sleep(Duration::from_millis(20)),
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
    /// the combined payload back. `combine` sees the payloads in rank order. A frame
    /// longer than `limits` allows is refused before it is read (nor allocated).
    fn exchange(
        &mut self,
        op: Op,
        payload: Vec<u8>,
        limits: Limits,
        combine: impl FnOnce(Vec<Vec<u8>>) -> Vec<u8>,
    ) -> Result<Vec<u8>, CollectiveError> {
        self.exchange_each(op, payload, limits, |parts| Results::Same(combine(parts)))
    }

    /// `exchange` where rank 0 may send each rank a result of its own
    /// (`Results::PerRank`, indexed by rank: a reduce-scatter's shares).
    fn exchange_each(
        &mut self,
        op: Op,
        payload: Vec<u8>,
        limits: Limits,
        combine: impl FnOnce(Vec<Vec<u8>>) -> Results,
    ) -> Result<Vec<u8>, CollectiveError> {
        self.seq += 1;
        let seq = self.seq;
        let rank = self.rank;
        match &mut self.link {
            Link::Solo => Ok(combine(vec![payload]).take(0)),
            Link::Root { peers } => {
                let mut all = Vec::with_capacity(peers.len() + 1);
                let own_len = payload.len();
                all.push(payload);
                let mut failure = None;
                for (i, (stream, addr)) in peers.iter_mut().enumerate() {
                    let peer = i + 1;
                    match read_frame(stream, limits.from_peer) {
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
                        Err(FrameError::TooLarge {
                            op: pop,
                            seq: pseq,
                            len,
                            max,
                        }) => {
                            failure =
                                Some(oversized(rank, peer, addr, op, seq, pop, pseq, len, max));
                            break;
                        }
                        Err(FrameError::Io(e)) => {
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
                let mut results = combine(all);
                for (i, (stream, addr)) in peers.iter_mut().enumerate() {
                    write_frame(stream, op, seq, results.get(i + 1)).map_err(|e| {
                        CollectiveError::Peer {
                            rank,
                            peer: i + 1,
                            addr: addr.to_string(),
                            what: "sending a collective result",
                            source: e,
                        }
                    })?;
                }
                Ok(results.take(0))
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
                match read_frame(root, limits.from_root) {
                    Ok((pop, pseq, data)) if pop == op as u8 && pseq == seq => Ok(data),
                    Ok((pop, pseq, _)) => Err(CollectiveError::Mismatch {
                        rank,
                        peer: 0,
                        detail: format!(
                            "rank {rank} is at collective #{seq} ({op:?}), rank 0 answered #{pseq} (op {pop})"
                        ),
                    }),
                    Err(FrameError::TooLarge {
                        op: pop,
                        seq: pseq,
                        len,
                        max,
                    }) => Err(oversized(rank, 0, &addr, op, seq, pop, pseq, len, max)),
                    Err(FrameError::Io(e)) => Err(peer_err("receiving a collective result", e)),
                }
            }
        }
    }
}

/// What rank 0 sends back: the same bytes to every rank, or each rank its own.
enum Results {
    Same(Vec<u8>),
    PerRank(Vec<Vec<u8>>),
}

impl Results {
    fn get(&self, rank: usize) -> &[u8] {
        match self {
            Results::Same(v) => v,
            Results::PerRank(v) => &v[rank],
        }
    }

    fn take(&mut self, rank: usize) -> Vec<u8> {
        match self {
            Results::Same(v) => std::mem::take(v),
            Results::PerRank(v) => std::mem::take(&mut v[rank]),
        }
    }
}

/// The longest frames one collective may bring: a frame announcing more is refused
/// before it is read.
#[derive(Clone, Copy, Debug)]
struct Limits {
    /// What rank 0 accepts from each of the other ranks.
    from_peer: usize,
    /// What the other ranks accept from rank 0.
    from_root: usize,
}

impl Limits {
    /// Every rank sends the same number of bytes (an all-reduce: the layout of the
    /// tensors, which every rank knows).
    fn exactly(bytes: usize) -> Self {
        Self {
            from_peer: bytes,
            from_root: bytes,
        }
    }

    /// Rank 0 alone sends, at most `bytes`; the others send nothing.
    fn from_root(bytes: usize) -> Self {
        Self {
            from_peer: 0,
            from_root: bytes,
        }
    }
}

/// The error for a frame announcing more than `max` bytes: out of step when it is not
/// the collective this rank is at, or when both sides know the exact size (tensors),
/// else too large.
#[allow(clippy::too_many_arguments)]
fn oversized(
    rank: usize,
    peer: usize,
    addr: &SocketAddr,
    op: Op,
    seq: u64,
    their_op: u8,
    their_seq: u64,
    len: u64,
    max: usize,
) -> CollectiveError {
    if their_op != op as u8 || their_seq != seq {
        return CollectiveError::Mismatch {
            rank,
            peer,
            detail: format!(
                "rank {rank} is at collective #{seq} ({op:?}), rank {peer} sent #{their_seq} (op {their_op}) announcing {len} bytes"
            ),
        };
    }
    // Both sides know the exact size of tensors (rank 0's broadcast ones included).
    let exact = matches!(
        op,
        Op::AllReduceSum | Op::ReduceScatter | Op::AllGather | Op::GatherToRoot
    ) || (op == Op::Broadcast && peer == 0);
    if exact {
        return CollectiveError::Mismatch {
            rank,
            peer,
            detail: format!(
                "{op:?} #{seq}: rank {rank} expects {max} bytes of tensors, rank {peer} announced {len}"
            ),
        };
    }
    CollectiveError::FrameTooLarge {
        rank,
        peer,
        addr: addr.to_string(),
        what: op.what(),
        len,
        max,
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
        let summed = self.exchange(
            Op::AllReduceSum,
            payload,
            Limits::exactly(layout.bytes),
            |parts| layout.sum(parts),
        )?;
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
        let data = self.exchange(
            Op::Broadcast,
            payload,
            Limits::from_root(layout.bytes),
            |mut parts| parts.swap_remove(0),
        )?;
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

    fn broadcast_bytes_max(
        &mut self,
        data: &mut Vec<u8>,
        max: usize,
    ) -> Result<(), CollectiveError> {
        if self.world_size == 1 {
            return Ok(());
        }
        let payload = if self.rank == 0 {
            if data.len() > max {
                return Err(CollectiveError::Setup(format!(
                    "rank 0 would broadcast {} bytes, more than the {max} the other ranks accept",
                    data.len()
                )));
            }
            std::mem::take(data)
        } else {
            Vec::new()
        };
        *data = self.exchange(
            Op::BroadcastBytes,
            payload,
            Limits::from_root(max),
            |mut parts| parts.swap_remove(0),
        )?;
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        if self.world_size == 1 {
            return Ok(());
        }
        self.exchange(Op::Barrier, Vec::new(), Limits::exactly(0), |_| Vec::new())?;
        Ok(())
    }

    /// Rank 0 sums the ranks' inputs (in rank order, as `all_reduce_sum`) and sends each
    /// rank its share only.
    fn reduce_scatter_sum(
        &mut self,
        input: &Tensor,
        output: &mut Tensor,
    ) -> Result<(), CollectiveError> {
        crate::check_shares("reduce_scatter_sum", input, output, self.world_size)?;
        if self.world_size == 1 {
            // The sum over one rank is its input, wherever it lives (a lone trainer on a
            // GPU with a sharded state makes this call every step).
            tch::no_grad(|| output.copy_(&input.reshape(output.size())));
            return Ok(());
        }
        let flat = [input.reshape([-1])];
        let layout = WireLayout::of(&flat)?;
        let share = WireLayout::of(std::slice::from_ref(output))?;
        if share.items[0].1 != layout.items[0].1 {
            return Err(CollectiveError::Setup(
                "reduce_scatter_sum: input and output must both be f64 or both not".into(),
            ));
        }
        let world = self.world_size;
        let data = self.exchange_each(
            Op::ReduceScatter,
            layout.encode(&flat),
            Limits {
                from_peer: layout.bytes,
                from_root: share.bytes,
            },
            |parts| {
                let sum = layout.sum(parts);
                Results::PerRank(
                    (0..world)
                        .map(|r| sum[r * share.bytes..(r + 1) * share.bytes].to_vec())
                        .collect(),
                )
            },
        )?;
        share.decode_into(&data, std::slice::from_mut(output));
        Ok(())
    }

    /// Rank 0 concatenates the ranks' inputs and keeps them; the others get nothing back
    /// (an empty acknowledgement), so rank 0 sends nothing of the whole.
    fn gather_to_root(
        &mut self,
        input: &Tensor,
        output: Option<&mut Tensor>,
    ) -> Result<(), CollectiveError> {
        let share = WireLayout::of(std::slice::from_ref(input))?;
        let whole = match (&output, self.rank) {
            (Some(out), 0) => {
                crate::check_shares("gather_to_root", out, input, self.world_size)?;
                let whole = WireLayout::of(std::slice::from_ref(*out))?;
                if share.items[0].1 != whole.items[0].1 {
                    return Err(CollectiveError::Setup(
                        "gather_to_root: input and output must both be f64 or both not".into(),
                    ));
                }
                Some(whole)
            }
            (None, 0) => {
                return Err(CollectiveError::Setup(
                    "gather_to_root: rank 0 must pass an output".into(),
                ))
            }
            _ => None,
        };
        if self.world_size == 1 {
            if let Some(out) = output {
                tch::no_grad(|| out.copy_(&input.reshape(out.size())));
            }
            return Ok(());
        }
        let world = self.world_size;
        let data = self.exchange_each(
            Op::GatherToRoot,
            share.encode(std::slice::from_ref(input)),
            Limits {
                from_peer: share.bytes,
                from_root: 0,
            },
            |parts| {
                let mut each = vec![Vec::new(); world];
                each[0] = parts.concat();
                Results::PerRank(each)
            },
        )?;
        if let (Some(whole), Some(out)) = (whole, output) {
            whole.decode_into(&data, std::slice::from_mut(out));
        }
        Ok(())
    }

    /// Rank 0 concatenates the ranks' inputs and sends the whole to every rank.
    fn all_gather(&mut self, input: &Tensor, output: &mut Tensor) -> Result<(), CollectiveError> {
        crate::check_shares("all_gather", output, input, self.world_size)?;
        if self.world_size == 1 {
            tch::no_grad(|| output.copy_(&input.reshape(output.size())));
            return Ok(());
        }
        let share = WireLayout::of(std::slice::from_ref(input))?;
        let whole = WireLayout::of(std::slice::from_ref(output))?;
        if share.items[0].1 != whole.items[0].1 {
            return Err(CollectiveError::Setup(
                "all_gather: input and output must both be f64 or both not".into(),
            ));
        }
        let data = self.exchange(
            Op::AllGather,
            share.encode(std::slice::from_ref(input)),
            Limits {
                from_peer: share.bytes,
                from_root: whole.bytes,
            },
            |parts| parts.concat(),
        )?;
        whole.decode_into(&data, std::slice::from_mut(output));
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

    /// The tensors' values on the wire: on a little-endian machine each is copied once,
    /// straight into the payload (a tensor of another kind, or not contiguous, is first
    /// made an f32 / contiguous one, as it must be); else element by element.
    fn encode(&self, tensors: &[Tensor]) -> Vec<u8> {
        let mut out = vec![0u8; self.bytes];
        let mut off = 0;
        let _no_grad = tch::no_grad_guard();
        for (t, &(n, wide)) in tensors.iter().zip(&self.items) {
            let (kind, size) = if wide {
                (Kind::Double, 8)
            } else {
                (Kind::Float, 4)
            };
            let src = t.to_kind(kind).contiguous();
            let dst = &mut out[off..off + size * n];
            off += size * n;
            if cfg!(target_endian = "little") {
                src.copy_data_u8(dst, n);
            } else if wide {
                let mut v = vec![0f64; n];
                src.copy_data(&mut v, n);
                for (d, x) in dst.chunks_exact_mut(8).zip(v) {
                    d.copy_from_slice(&x.to_le_bytes());
                }
            } else {
                let mut v = vec![0f32; n];
                src.copy_data(&mut v, n);
                for (d, x) in dst.chunks_exact_mut(4).zip(v) {
                    d.copy_from_slice(&x.to_le_bytes());
                }
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
                let size = if wide { 8 } else { 4 };
                let src = tensor_of_le(&data[off..off + size * n], wide);
                off += size * n;
                t.copy_(&src.reshape(t.size()));
            }
        });
    }
}

/// A 1-d f64 (`wide`) or f32 tensor of the wire's little-endian `bytes`: on a
/// little-endian machine one copy of them (a tensor is received with no more than its
/// own size on top of the wire's bytes), else element by element.
fn tensor_of_le(bytes: &[u8], wide: bool) -> Tensor {
    let (kind, size) = if wide {
        (Kind::Double, 8)
    } else {
        (Kind::Float, 4)
    };
    let n = (bytes.len() / size) as i64;
    if cfg!(target_endian = "little") {
        return Tensor::from_data_size(bytes, &[n], kind);
    }
    if wide {
        let v: Vec<f64> = bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Tensor::from_slice(&v)
    } else {
        let v: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Tensor::from_slice(&v)
    }
}

fn configure(s: &TcpStream, io: Duration, handshake: Duration) -> io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(handshake.min(io)))?;
    s.set_write_timeout(Some(handshake.min(io)))
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

/// Why a frame could not be read.
#[derive(Debug)]
enum FrameError {
    Io(io::Error),
    /// The header announced more than the collective expects: refused unread.
    TooLarge {
        op: u8,
        seq: u64,
        len: u64,
        max: usize,
    },
}

/// Reads one frame of at most `max` bytes; a longer one is refused from its header,
/// before anything is allocated for it.
fn read_frame(s: &mut TcpStream, max: usize) -> Result<(u8, u64, Vec<u8>), FrameError> {
    let mut header = [0u8; 17];
    s.read_exact(&mut header).map_err(FrameError::Io)?;
    let op = header[0];
    let seq = u64::from_le_bytes(header[1..9].try_into().unwrap());
    let len = u64::from_le_bytes(header[9..17].try_into().unwrap());
    if len > max as u64 {
        return Err(FrameError::TooLarge { op, seq, len, max });
    }
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data).map_err(FrameError::Io)?;
    Ok((op, seq, data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hello::{testing, Verdict};
    use crate::{Collective, MAX_BROADCAST_BYTES};

    fn timeouts(connect_ms: u64, io_ms: u64) -> CpuCollectiveTimeouts {
        CpuCollectiveTimeouts {
            connect: Duration::from_millis(connect_ms),
            io: Duration::from_millis(io_ms),
        }
    }

    fn group(world: usize) -> Vec<CpuCollective> {
        group_with(world, None, timeouts(20_000, 20_000))
    }

    fn group_with(
        world: usize,
        secret: Option<CollectiveSecret>,
        t: CpuCollectiveTimeouts,
    ) -> Vec<CpuCollective> {
        let rdv = CpuRendezvous::bind("127.0.0.1:0")
            .unwrap()
            .with_secret(secret.clone());
        let addr = rdv.local_addr();
        let leaves: Vec<_> = (1..world)
            .map(|r| {
                let secret = secret.clone();
                std::thread::spawn(move || {
                    CpuCollective::connect_with_secret(addr, r, world, t, secret.as_ref()).unwrap()
                })
            })
            .collect();
        let mut all = vec![rdv.accept(world, t).unwrap()];
        all.extend(leaves.into_iter().map(|h| h.join().unwrap()));
        all
    }

    fn key(token: &str) -> CollectiveSecret {
        CollectiveSecret::from_token(token.as_bytes(), "")
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(20)
    }

    /// A connection to rank 0 that has read its challenge: (stream, mode, nonce).
    fn raw(addr: SocketAddr) -> (TcpStream, u8, [u8; 32]) {
        let mut s = TcpStream::connect(addr).unwrap();
        let (mode, nonce) = testing::read_challenge(&mut s, soon());
        (s, mode, nonce)
    }

    /// Says a hand-made hello and returns rank 0's verdict (`None`: closed without one).
    fn forge(
        addr: SocketAddr,
        rank: u64,
        world: u64,
        secret: Option<&CollectiveSecret>,
    ) -> Option<Verdict> {
        let (mut s, _, nonce) = raw(addr);
        s.write_all(&testing::hello(&nonce, rank, world, secret))
            .unwrap();
        let verdict = testing::verdict(&mut s, soon());
        if verdict != Some(Verdict::Accepted) {
            let mut rest = Vec::new();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            assert_eq!(
                s.read_to_end(&mut rest).unwrap_or(0),
                0,
                "rank 0 closes a refused connection"
            );
        }
        verdict
    }

    /// What the wire carries for each kind and layout a rank may hand in: every value as
    /// little-endian f32 (f64 for doubles), in order, and back to the same values.
    #[test]
    fn the_wire_holds_each_tensors_values_in_order_and_decodes_back() {
        let f = Tensor::from_slice(&[1.5f32, -2.25, 3.0e-8, f32::MAX]);
        let t = Tensor::from_slice(&[1f32, 2., 3., 4., 5., 6.])
            .reshape([2, 3])
            .transpose(0, 1);
        assert!(!t.is_contiguous());
        let b = Tensor::from_slice(&[0.5f32, -7.0, 1.0e3]).to_kind(Kind::BFloat16);
        let h = Tensor::from_slice(&[0.25f32, -3.5]).to_kind(Kind::Half);
        let i = Tensor::from_slice(&[3i64, -2]);
        let d = Tensor::from_slice(&[std::f64::consts::PI, -1.0e-300]);
        let empty = Tensor::zeros([0], (Kind::Float, Device::Cpu));
        let scalar = Tensor::from(9.75f32);
        let leaf = Tensor::from_slice(&[2.5f32]).set_requires_grad(true);
        let tensors = [f, t, b, h, i, d, empty, scalar, leaf];
        let layout = WireLayout::of(&tensors).unwrap();
        let wire = layout.encode(&tensors);

        let mut want = Vec::new();
        let f32s: &[f32] = &[1.5, -2.25, 3.0e-8, f32::MAX, 1., 4., 2., 5., 3., 6.];
        let f32s = [f32s, &[0.5, -7.0, 1.0e3, 0.25, -3.5, 3.0, -2.0]].concat();
        f32s.iter()
            .for_each(|e| want.extend_from_slice(&e.to_le_bytes()));
        for e in [std::f64::consts::PI, -1.0e-300] {
            want.extend_from_slice(&e.to_le_bytes());
        }
        for e in [9.75f32, 2.5] {
            want.extend_from_slice(&e.to_le_bytes());
        }
        assert_eq!(wire.len(), layout.bytes);
        assert_eq!(wire, want);

        let mut back: Vec<Tensor> = tensors.iter().map(Tensor::zeros_like).collect();
        layout.decode_into(&wire, &mut back);
        for (a, b) in tensors.iter().zip(&back) {
            assert_eq!(a.kind(), b.kind());
            assert_eq!(a.size(), b.size());
            assert!(a.equal(b), "{a:?} came back as {b:?}");
        }
    }

    /// Every rank adds its rank: the sum is 0 + 1 + … + (world − 1) on every rank.
    fn check_sums(ranks: Vec<CpuCollective>) {
        let world = ranks.len();
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || {
                    let mut t = [Tensor::from_slice(&[c.rank() as f32])];
                    c.all_reduce_sum(&mut t).unwrap();
                    f32::try_from(&t[0].reshape([])).unwrap()
                })
            })
            .collect();
        let want = (0..world).sum::<usize>() as f32;
        for h in handles {
            assert_eq!(h.join().unwrap(), want);
        }
    }

    /// Reduce-scatter gives each rank its share of the sum (bit-identical to slicing the
    /// all-reduce's result), all-gather the ranks' shares in rank order; a solo rank
    /// keeps its input; shapes that do not split into the ranks' shares are refused.
    #[test]
    fn reduce_scatter_and_all_gather_across_three_ranks() {
        let ranks = group(3);
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || {
                    let r = c.rank() as f32;
                    let input = Tensor::from_slice(&[0.1f32, 1.0, 2.0, 3.0, 4.0, 5.0])
                        .reshape([2, 3])
                        * (r as f64 + 1.0)
                        + 10.0 * r as f64;
                    let mut share = Tensor::zeros([2], (tch::Kind::Float, Device::Cpu));
                    c.reduce_scatter_sum(&input, &mut share).unwrap();
                    let mut all = [input.copy()];
                    c.all_reduce_sum(&mut all).unwrap();
                    let want = all[0].reshape([-1]).narrow(0, 2 * c.rank() as i64, 2);
                    assert!(
                        share.equal(&want),
                        "rank {}: {share:?} vs {want:?}",
                        c.rank()
                    );

                    let mine = Tensor::from_slice(&[r, r + 0.5]).to_kind(tch::Kind::BFloat16);
                    let mut gathered = Tensor::zeros([3, 2], (tch::Kind::BFloat16, Device::Cpu));
                    c.all_gather(&mine, &mut gathered).unwrap();
                    let v: Vec<f32> =
                        Vec::try_from(gathered.to_kind(tch::Kind::Float).reshape([-1])).unwrap();
                    assert_eq!(v, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);

                    let mut wrong = Tensor::zeros([4], (tch::Kind::Float, Device::Cpu));
                    let e = c
                        .reduce_scatter_sum(&input, &mut wrong)
                        .unwrap_err()
                        .to_string();
                    assert!(e.contains("not 3 ranks"), "{e}");
                    // The group is still in step after a refused call (nothing was sent).
                    c.barrier().unwrap();
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let mut solo = CpuCollective::solo();
        let x = Tensor::from_slice(&[1.5f32, 2.5]);
        let mut out = Tensor::zeros([2], (tch::Kind::Float, Device::Cpu));
        solo.reduce_scatter_sum(&x, &mut out).unwrap();
        assert!(out.equal(&x));
        let mut out = Tensor::zeros([2], (tch::Kind::Float, Device::Cpu));
        solo.all_gather(&x, &mut out).unwrap();
        assert!(out.equal(&x));
    }

    /// A gather to rank 0: rank 0 gets every rank's input in rank order; the others get
    /// nothing (they accept no byte from rank 0: anything sent would fail their read),
    /// and the group stays in step. A rank 0 without an output is refused before it
    /// sends anything; a solo rank copies its input.
    #[test]
    fn a_gather_to_root_gives_rank_zero_the_parts_and_the_others_nothing() {
        let ranks = group(3);
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || {
                    let r = c.rank() as f32;
                    let mine = Tensor::from_slice(&[r, r + 0.5]);
                    if c.rank() == 0 {
                        let e = c.gather_to_root(&mine, None).unwrap_err().to_string();
                        assert!(e.contains("rank 0 must pass an output"), "{e}");
                        let mut all = Tensor::zeros([6], (tch::Kind::Float, Device::Cpu));
                        c.gather_to_root(&mine, Some(&mut all)).unwrap();
                        let v: Vec<f32> = Vec::try_from(all).unwrap();
                        assert_eq!(v, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
                    } else {
                        c.gather_to_root(&mine, None).unwrap();
                    }
                    let mut sum = [Tensor::from_slice(&[1.0f32])];
                    c.all_reduce_sum(&mut sum).unwrap();
                    assert_eq!(f32::try_from(&sum[0]).unwrap(), 3.0);
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let mut solo = CpuCollective::solo();
        let x = Tensor::from_slice(&[1.5f32, 2.5]);
        let mut out = Tensor::zeros([2], (tch::Kind::Float, Device::Cpu));
        solo.gather_to_root(&x, Some(&mut out)).unwrap();
        assert!(out.equal(&x));
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

    #[test]
    fn a_group_with_a_secret_forms_and_refuses_hellos_without_the_right_mac() {
        let secret = key("the-run-token");
        let rdv = CpuRendezvous::bind("127.0.0.1:0")
            .unwrap()
            .with_secret(Some(secret.clone()));
        let addr = rdv.local_addr();
        let root = std::thread::spawn(move || rdv.accept(3, timeouts(20_000, 20_000)));
        // A MAC made with another token, none at all, and a real rank's MAC replayed
        // against a fresh challenge: each refused as a bad MAC, the connection closed.
        let (mut s, mode, _) = raw(addr);
        assert_eq!(
            mode, 1,
            "rank 0 with a secret asks for an authenticated hello"
        );
        let (_, _, old_nonce) = raw(addr);
        s.write_all(&testing::hello(&old_nonce, 1, 3, Some(&secret)))
            .unwrap();
        assert_eq!(testing::verdict(&mut s, soon()), Some(Verdict::BadMac));
        assert_eq!(
            forge(addr, 1, 3, Some(&key("another-token"))),
            Some(Verdict::BadMac)
        );
        assert_eq!(forge(addr, 2, 3, None), Some(Verdict::BadMac));
        // The real ranks still join, and only they are in the group.
        let leaves: Vec<_> = (1..3)
            .map(|r| {
                let secret = secret.clone();
                std::thread::spawn(move || {
                    CpuCollective::connect_with_secret(
                        addr,
                        r,
                        3,
                        timeouts(20_000, 20_000),
                        Some(&secret),
                    )
                    .unwrap()
                })
            })
            .collect();
        let mut all = vec![root.join().unwrap().unwrap()];
        all.extend(leaves.into_iter().map(|h| h.join().unwrap()));
        check_sums(all);
    }

    #[test]
    fn a_rank_with_another_secret_or_none_does_not_join() {
        let rdv = CpuRendezvous::bind("127.0.0.1:0")
            .unwrap()
            .with_secret(Some(key("the-run-token")));
        let addr = rdv.local_addr();
        let t = timeouts(20_000, 20_000);
        let root = std::thread::spawn(move || rdv.accept(2, t));
        let start = Instant::now();
        let err = CpuCollective::connect_with_secret(addr, 1, 2, t, Some(&key("another-token")))
            .err()
            .expect("joined with the wrong secret");
        let msg = err.to_string();
        assert!(
            matches!(err, CollectiveError::Refused { rank: 1, .. }),
            "{msg}"
        );
        assert!(
            msg.contains(&addr.to_string()) && msg.contains("auth token"),
            "{msg}"
        );
        let err = CpuCollective::connect(addr, 1, 2, t)
            .err()
            .expect("joined without a secret")
            .to_string();
        assert!(err.contains("requires an authenticated hello"), "{err}");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "a refusal is final, not retried until the deadline"
        );
        let leaf =
            CpuCollective::connect_with_secret(addr, 1, 2, t, Some(&key("the-run-token"))).unwrap();
        check_sums(vec![root.join().unwrap().unwrap(), leaf]);

        // A rank with a secret does not join a rank 0 without one either.
        let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
        let addr = rdv.local_addr();
        std::thread::spawn(move || rdv.accept(2, timeouts(3_000, 3_000)));
        let err = CpuCollective::connect_with_secret(addr, 1, 2, t, Some(&key("the-run-token")))
            .err()
            .expect("joined a group without a secret")
            .to_string();
        assert!(err.contains("runs without an auth token"), "{err}");
    }

    #[test]
    fn unknown_ranks_other_world_sizes_and_taken_ranks_are_refused() {
        for secret in [None, Some(key("the-run-token"))] {
            let rdv = CpuRendezvous::bind("127.0.0.1:0")
                .unwrap()
                .with_secret(secret.clone());
            let addr = rdv.local_addr();
            let t = timeouts(20_000, 20_000);
            let root = std::thread::spawn(move || rdv.accept(3, t));
            let s = secret.as_ref();
            assert_eq!(forge(addr, 0, 3, s), Some(Verdict::RankRange));
            assert_eq!(forge(addr, 3, 3, s), Some(Verdict::RankRange));
            assert_eq!(forge(addr, u64::MAX, 3, s), Some(Verdict::RankRange));
            assert_eq!(forge(addr, 1, 4, s), Some(Verdict::WorldSize));
            assert_eq!(forge(addr, 1, u64::MAX, s), Some(Verdict::WorldSize));
            // A real rank with another world size is told so, at once.
            let err = CpuCollective::connect_with_secret(addr, 1, 4, t, s)
                .err()
                .expect("joined with another world size")
                .to_string();
            assert!(err.contains("world size"), "{err}");
            // Rank 1 joins; a second rank 1 is refused and does not replace it.
            let first = CpuCollective::connect_with_secret(addr, 1, 3, t, s).unwrap();
            assert_eq!(forge(addr, 1, 3, s), Some(Verdict::RankTaken));
            let err = CpuCollective::connect_with_secret(addr, 1, 3, t, s)
                .err()
                .expect("a second rank 1 joined")
                .to_string();
            assert!(err.contains("already joined as rank 1"), "{err}");
            let last = CpuCollective::connect_with_secret(addr, 2, 3, t, s).unwrap();
            check_sums(vec![root.join().unwrap().unwrap(), first, last]);
        }
    }

    #[test]
    fn a_rendezvous_that_times_out_lists_the_connections_it_refused() {
        let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
        let addr = rdv.local_addr();
        let root = std::thread::spawn(move || rdv.accept(2, timeouts(1_500, 1_500)));
        let (mut s, _, nonce) = raw(addr);
        let stray = s.local_addr().unwrap();
        s.write_all(&testing::hello(&nonce, 7, 2, None)).unwrap();
        assert_eq!(testing::verdict(&mut s, soon()), Some(Verdict::RankRange));
        let err = root.join().unwrap().err().unwrap().to_string();
        assert!(err.contains("missing ranks: [1]"), "{err}");
        assert!(
            err.contains(&format!("{stray}: it claims rank 7, expected 1 to 1")),
            "{err}"
        );
    }

    /// Connections that say nothing, trickle their hello or send garbage (and more of
    /// them than rank 0 waits on at once) do not hold up the real ranks, and rank 0
    /// closes them once the group has formed.
    #[test]
    fn silent_and_slow_connections_do_not_keep_the_real_ranks_out() {
        let t = timeouts(4_000, 60_000);
        let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
        let addr = rdv.local_addr();
        let start = Instant::now();
        let root = std::thread::spawn(move || rdv.accept(3, t));
        let silent: Vec<TcpStream> = (0..MAX_PENDING_HELLOS + 8)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let (mut trickle, _, _) = raw(addr);
        let trickler = std::thread::spawn(move || {
            for b in hello::MAGIC {
                if trickle.write_all(&[*b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        });
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let leaves: Vec<_> = (1..3)
            .map(|r| std::thread::spawn(move || CpuCollective::connect(addr, r, 3, t).unwrap()))
            .collect();
        let mut all = vec![root.join().unwrap().expect("the real ranks could not join")];
        assert!(start.elapsed() < t.connect, "{:?}", start.elapsed());
        all.extend(leaves.into_iter().map(|h| h.join().unwrap()));
        // The last silent connections still had their hello pending: now closed.
        let mut last = silent.into_iter().last().unwrap();
        last.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut got = Vec::new();
        last.read_to_end(&mut got).unwrap();
        assert_eq!(&got[..8], hello::MAGIC, "it got the challenge, then EOF");
        assert!(
            start.elapsed() < t.connect,
            "closed when the group formed, not at the hello deadline"
        );
        trickler.join().unwrap();
        check_sums(all);
    }

    #[test]
    fn a_rank_silent_in_a_collective_is_timed_out_and_named() {
        let mut ranks = group_with(2, None, timeouts(20_000, 500));
        let mut leaf = ranks.pop().unwrap();
        let mut root = ranks.pop().unwrap();
        let leaf_addr = match &root.link {
            Link::Root { peers } => peers[0].1,
            _ => unreachable!(),
        };
        let err = root.barrier().unwrap_err().to_string();
        assert!(
            err.contains("rank 1") && err.contains(&leaf_addr.to_string()),
            "{err}"
        );
        assert!(err.contains("timed out"), "{err}");
        let err = leaf.barrier().unwrap_err().to_string();
        assert!(err.contains("rank 0") && err.contains("timed out"), "{err}");
    }

    /// A fake peer of rank 0's that has said a valid (open) hello.
    fn fake_leaf(addr: SocketAddr, rank: u64, world: u64) -> TcpStream {
        let (mut s, _, nonce) = raw(addr);
        s.write_all(&testing::hello(&nonce, rank, world, None))
            .unwrap();
        assert_eq!(testing::verdict(&mut s, soon()), Some(Verdict::Accepted));
        let mut mac = [0u8; 32];
        s.read_exact(&mut mac).unwrap();
        s
    }

    fn header(op: Op, seq: u64, len: u64) -> [u8; 17] {
        let mut h = [0u8; 17];
        h[0] = op as u8;
        h[1..9].copy_from_slice(&seq.to_le_bytes());
        h[9..].copy_from_slice(&len.to_le_bytes());
        h
    }

    const TIB: u64 = 1 << 40;

    #[test]
    fn rank_0_refuses_a_frame_larger_than_the_collective_needs_unread() {
        let t = timeouts(20_000, 60_000);
        let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
        let addr = rdv.local_addr();
        let root = std::thread::spawn(move || rdv.accept(2, t));
        let mut fake = fake_leaf(addr, 1, 2);
        let mut root = root.join().unwrap().unwrap();
        fake.write_all(&header(Op::Barrier, 1, TIB)).unwrap();
        let start = Instant::now();
        let err = root.barrier().unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                CollectiveError::FrameTooLarge {
                    peer: 1,
                    len: TIB,
                    max: 0,
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains("1099511627776 bytes") && msg.contains("at most 0 bytes"),
            "{msg}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "it waited for the body"
        );

        // An all-reduce: the sizes of the tensors bound it.
        let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
        let addr = rdv.local_addr();
        let root = std::thread::spawn(move || rdv.accept(2, t));
        let mut fake = fake_leaf(addr, 1, 2);
        let mut root = root.join().unwrap().unwrap();
        fake.write_all(&header(Op::AllReduceSum, 1, 16 << 30))
            .unwrap();
        let err = root
            .all_reduce_sum(&mut [Tensor::from_slice(&[1f32, 2.0])])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("17179869184") && err.contains("expects 8 bytes"),
            "{err}"
        );
    }

    /// A fake rank 0 that has admitted one real rank 1 (open hello).
    fn fake_root() -> (SocketAddr, std::thread::JoinHandle<TcpStream>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let h = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let j = hello::challenge(&mut s, None, 2, soon()).unwrap();
            hello::admit(&mut s, &j, None, soon()).unwrap();
            s
        });
        (addr, h)
    }

    #[test]
    fn a_rank_refuses_a_broadcast_larger_than_its_bound_unread() {
        let t = timeouts(20_000, 60_000);
        // The default bound.
        let (addr, root) = fake_root();
        let mut leaf = CpuCollective::connect(addr, 1, 2, t).unwrap();
        let mut root = root.join().unwrap();
        root.write_all(&header(Op::BroadcastBytes, 1, TIB)).unwrap();
        let start = Instant::now();
        let err = leaf.broadcast_bytes(&mut Vec::new()).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                CollectiveError::FrameTooLarge {
                    peer: 0,
                    len: TIB,
                    max: MAX_BROADCAST_BYTES,
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains("1099511627776 bytes")
                && msg.contains(&format!("at most {MAX_BROADCAST_BYTES} bytes")),
            "{msg}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "it waited for the body"
        );

        // A bound the caller passes, below the old fixed cap of 64 GiB.
        let (addr, root) = fake_root();
        let mut leaf = CpuCollective::connect(addr, 1, 2, t).unwrap();
        let mut root = root.join().unwrap();
        root.write_all(&header(Op::BroadcastBytes, 1, 16 << 30))
            .unwrap();
        let err = leaf
            .broadcast_bytes_max(&mut Vec::new(), 1000)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("17179869184 bytes") && err.contains("at most 1000 bytes"),
            "{err}"
        );

        // Rank 0 does not send more than the bound either.
        let mut ranks = group(2);
        let _leaf = ranks.pop().unwrap();
        let err = ranks[0]
            .broadcast_bytes_max(&mut vec![0; 10], 5)
            .unwrap_err()
            .to_string();
        assert!(err.contains("10 bytes") && err.contains("the 5"), "{err}");
    }
}
