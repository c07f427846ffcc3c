//! The `tutor.v1` contracts: every message that crosses a process boundary.

#[allow(clippy::all)]
pub mod v1 {
    tonic::include_proto!("tutor.v1");
}

pub use v1::*;

/// Turn index used in acks and idempotency keys for an episode's outcome event.
pub const TURN_INDEX_OUTCOME: u32 = u32::MAX;

/// Largest gRPC message any Tutor service accepts or sends (weights travel chunked).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// Size of one weights chunk on the Weights stream.
pub const WEIGHTS_CHUNK_BYTES: usize = 1024 * 1024;
