//! Collectives between processes: the `Collective` interface, a CPU implementation over
//! TCP (a star through rank 0) and, behind the `nccl` feature, NCCL; the rendezvous through
//! the coordinator's LearnerGroup service that forms a group; and the weights broadcast
//! from learner rank 0 to rollout workers built on it. Used by the learner (gradient
//! all-reduce between data-parallel ranks) and the rollout worker (weights receiver);
//! it knows neither training nor episodes.

pub mod broadcast;
mod cpu;
pub mod engine_update;
mod hello;
#[cfg(feature = "nccl")]
mod nccl;
pub mod rendezvous;

/// The rendezvous group of learner rank 0 and the weight receivers (`broadcast::GROUP`):
/// the one group with rollout workers in it, whose hello key therefore comes from the
/// workers' token.
pub const WEIGHTS_GROUP: &str = "weights";

use std::io;
use std::time::Duration;

use tch::{Device, Tensor};

pub use cpu::{CpuCollective, CpuCollectiveTimeouts, CpuRendezvous};
pub use hello::CollectiveSecret;
#[cfg(feature = "nccl")]
pub use nccl::{NcclCollective, NcclUniqueId};
pub use rendezvous::{CollectiveChoice, GroupOptions};

/// Why a collective failed. Messages name the peer so a hung or dead rank can be found.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("rank {rank}: {what} with rank {peer} ({addr}) failed: {source}{hint}", hint = timeout_hint(source))]
    Peer {
        rank: usize,
        peer: usize,
        addr: String,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("rank {rank}: could not reach rank 0 at {addr} within {waited:?}: {source} (is rank 0 running and listening there?)")]
    Connect {
        rank: usize,
        addr: String,
        waited: Duration,
        #[source]
        source: io::Error,
    },
    #[error("rank 0: only {joined} of {world_size} ranks joined at {addr} within {waited:?} (missing ranks: {missing:?}){}", refusals(refused))]
    Rendezvous {
        addr: String,
        joined: usize,
        world_size: usize,
        missing: Vec<usize>,
        waited: Duration,
        /// The connections rank 0 refused meanwhile (the first few): address and why.
        refused: Vec<String>,
    },
    #[error("rank {rank}: rank 0 at {addr} refused to form a group with this rank: {reason}")]
    Refused {
        rank: usize,
        addr: String,
        reason: String,
    },
    #[error("rank {rank}: rank {peer} ({addr}) announced a frame of {len} bytes in {what}, which expects at most {max} bytes: refused unread")]
    FrameTooLarge {
        rank: usize,
        peer: usize,
        addr: String,
        what: &'static str,
        len: u64,
        max: usize,
    },
    #[error("rank {rank}: rank {peer} is out of step: {detail} (every rank must issue the same collectives in the same order with the same tensor shapes)")]
    Mismatch {
        rank: usize,
        peer: usize,
        detail: String,
    },
    #[error("invalid collective setup: {0}")]
    Setup(String),
    #[error("NCCL: {0}")]
    Nccl(String),
}

/// Checks the sizes `reduce_scatter_sum` (`full` = input, `share` = output) and
/// `all_gather` (`full` = output, `share` = input) need: `full` is `world_size` shares.
pub(crate) fn check_shares(
    what: &str,
    full: &Tensor,
    share: &Tensor,
    world_size: usize,
) -> Result<(), CollectiveError> {
    if full.numel() != share.numel() * world_size {
        return Err(CollectiveError::Setup(format!(
            "{what}: the whole tensor has {} elements, which is not {world_size} ranks × the \
             share's {}",
            full.numel(),
            share.numel()
        )));
    }
    Ok(())
}

fn refusals(refused: &[String]) -> String {
    if refused.is_empty() {
        String::new()
    } else {
        format!("; refused connections: {}", refused.join("; "))
    }
}

fn timeout_hint(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            " (timed out: the peer is stuck, dead, or slower than the collective timeout)"
        }
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe => " (the peer closed the connection: it probably exited)",
        _ => "",
    }
}

/// The most bytes `Collective::broadcast_bytes` carries: what the learner group sends, a
/// coordinator batch (which came as one gRPC message, at most
/// `tutor_proto::MAX_MESSAGE_BYTES`) with its tag byte, or rank 0's training-state header
/// (JSON: the configuration and the parameter names), with room to spare. Larger payloads
/// (policy files) pass their own bound to `broadcast_bytes_max`.
pub const MAX_BROADCAST_BYTES: usize = tutor_proto::MAX_MESSAGE_BYTES + (1 << 20);

/// Operations between the ranks of one data-parallel group. Every rank must call the same
/// operations in the same order with tensors of the same shapes; each call blocks until all
/// ranks have made it.
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Replaces each tensor by its sum over the ranks, in place. Every rank ends with
    /// bit-identical values (the reduction order does not depend on the rank).
    fn all_reduce_sum(&mut self, tensors: &mut [Tensor]) -> Result<(), CollectiveError>;

    /// Replaces each tensor by its mean over the ranks, in place.
    fn all_reduce_mean(&mut self, tensors: &mut [Tensor]) -> Result<(), CollectiveError> {
        self.all_reduce_sum(tensors)?;
        let n = self.world_size() as f64;
        if n > 1.0 {
            tch::no_grad(|| {
                for t in tensors.iter_mut() {
                    let _ = t.g_div_scalar_(n);
                }
            });
        }
        Ok(())
    }

    /// Overwrites each tensor on every rank with rank 0's values.
    fn broadcast(&mut self, tensors: &mut [Tensor]) -> Result<(), CollectiveError>;

    /// Replaces `data` on every rank with rank 0's bytes, at most [`MAX_BROADCAST_BYTES`]
    /// of them (what the other ranks pass in is ignored). Rank 0 shares batches and its
    /// training state with it.
    fn broadcast_bytes(&mut self, data: &mut Vec<u8>) -> Result<(), CollectiveError> {
        self.broadcast_bytes_max(data, MAX_BROADCAST_BYTES)
    }

    /// `broadcast_bytes` of at most `max` bytes, which every rank must pass alike: rank 0
    /// fails with more, and the others refuse a longer message before allocating it.
    fn broadcast_bytes_max(
        &mut self,
        data: &mut Vec<u8>,
        max: usize,
    ) -> Result<(), CollectiveError>;

    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<(), CollectiveError>;

    /// Sums `input` over the ranks and writes this rank's share of the sum into `output`
    /// (ZeRO's gradient reduce-scatter): `input` has the same shape on every rank and
    /// `world_size × n` elements, n = `output.numel()`; rank r gets elements
    /// `r·n .. (r+1)·n` of the flattened sum.
    fn reduce_scatter_sum(
        &mut self,
        input: &Tensor,
        output: &mut Tensor,
    ) -> Result<(), CollectiveError>;

    /// Writes every rank's `input` (n elements on every rank), in rank order, into
    /// `output` (`world_size × n` elements, flattened) on every rank (ZeRO's parameter
    /// all-gather).
    fn all_gather(&mut self, input: &Tensor, output: &mut Tensor) -> Result<(), CollectiveError>;

    /// Every rank's `input` (n elements on every rank), in rank order, into rank 0's
    /// `output` (`world_size × n` elements); the other ranks pass `None` and receive
    /// nothing. By default an all-gather whose result the other ranks drop (NCCL); the CPU
    /// collective sends rank 0 the parts only.
    fn gather_to_root(
        &mut self,
        input: &Tensor,
        output: Option<&mut Tensor>,
    ) -> Result<(), CollectiveError> {
        match output {
            Some(out) => self.all_gather(input, out),
            None => {
                let mut dropped = Tensor::empty(
                    [input.numel() as i64 * self.world_size() as i64],
                    (input.kind(), input.device()),
                );
                self.all_gather(input, &mut dropped)
            }
        }
    }

    /// Sums host scalars over the ranks (counts, loss sums), exactly in f64.
    fn all_reduce_sum_f64(&mut self, values: &mut [f64]) -> Result<(), CollectiveError> {
        if self.world_size() == 1 {
            return Ok(());
        }
        let mut t = [Tensor::from_slice(values).to_device(self.device())];
        self.all_reduce_sum(&mut t)?;
        let back = t[0].to_device(Device::Cpu);
        back.copy_data(values, values.len());
        Ok(())
    }

    /// Where this collective's tensors live.
    fn device(&self) -> Device {
        Device::Cpu
    }
}
