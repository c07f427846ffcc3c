//! The `tutor.v1` contracts: every message that crosses a process boundary.

#[allow(clippy::all)]
pub mod v1 {
    tonic::include_proto!("tutor.v1");
}

pub mod auth;
pub mod net;
pub mod tls;

pub use v1::*;

/// Turn index used in acks and idempotency keys for an episode's outcome event.
pub const TURN_INDEX_OUTCOME: u32 = u32::MAX;

/// Turn index in idempotency keys for the coordinator's record that an attempt's lease
/// expired (`LeaseExpired`).
pub const TURN_INDEX_LEASE_EXPIRED: u32 = u32::MAX - 1;

/// Turn index in idempotency keys for the coordinator's record of whom it leased an
/// attempt to (`LeaseGranted`).
pub const TURN_INDEX_LEASE_GRANTED: u32 = u32::MAX - 2;

/// Largest gRPC message any Tutor service accepts or sends (weights travel chunked).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// Largest message a worker may send the coordinator's Rollout service. An episode event
/// is a few kilobytes; anything near this is a bug or an attack, refused before it is
/// buffered.
pub const MAX_ROLLOUT_REQUEST_BYTES: usize = 16 * 1024 * 1024;

/// Largest episode event the coordinator stores, encoded. A worker shrinks a larger
/// outcome (its patch is left out: `OUTCOME_STATUS_PATCH_TOO_LARGE`) or turn (its texts
/// cut) before sending it, and drops what still does not fit; the coordinator refuses
/// a larger event with a reason in its ack instead of ending the stream. Well under
/// [`MAX_ROLLOUT_REQUEST_BYTES`], so an event never breaks the stream it travels on.
pub const MAX_EVENT_BYTES: usize = 8 * 1024 * 1024;

/// gRPC metadata of a worker's event stream: the worker id its Register answer gave it,
/// and the secret that came with it. Events of an episode leased to a worker are
/// accepted only on a stream that proves to be that worker's.
pub const WORKER_ID_METADATA: &str = "tutor-worker-id";
/// See [`WORKER_ID_METADATA`].
pub const WORKER_SECRET_METADATA: &str = "tutor-worker-secret";

/// Size of one weights chunk on the Weights stream.
pub const WEIGHTS_CHUNK_BYTES: usize = 1024 * 1024;

/// Idempotency key of an episode event: (episode id, turn index), with
/// TURN_INDEX_OUTCOME for the outcome (TURN_INDEX_LEASE_EXPIRED for a lease expiry the
/// coordinator recorded). The worker keeps unacked events by it and the
/// coordinator's store deduplicates by it. `None` for an event with neither payload.
pub fn event_key(ev: &EpisodeEvent) -> Option<(String, u32)> {
    match ev.event.as_ref()? {
        episode_event::Event::Turn(t) => Some((ev.episode_id.clone(), t.turn_index)),
        episode_event::Event::Outcome(_) => Some((ev.episode_id.clone(), TURN_INDEX_OUTCOME)),
        episode_event::Event::LeaseExpired(_) => {
            Some((ev.episode_id.clone(), TURN_INDEX_LEASE_EXPIRED))
        }
        episode_event::Event::LeaseGranted(_) => {
            Some((ev.episode_id.clone(), TURN_INDEX_LEASE_GRANTED))
        }
    }
}
