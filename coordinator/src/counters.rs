//! The event counters the Rollout service and the trajectory store bump as events pass
//! (atomics, read by the metrics endpoint).

use std::sync::atomic::{AtomicU64, Ordering};

/// Counts of events the Rollout service ingests; bumped where they happen.
#[derive(Debug, Default)]
pub struct EventCounters {
    /// Turn events stored for the first time.
    pub turns_ingested: AtomicU64,
    /// Outcome events stored for the first time (counted or not by the scheduler).
    pub outcomes_ingested: AtomicU64,
    /// Events a worker replayed that were already stored.
    pub duplicate_events: AtomicU64,
    /// Events refused with a reason in their ack (no payload, over
    /// `tutor_proto::MAX_EVENT_BYTES`): never stored; the stream went on.
    pub refused_events: AtomicU64,
    /// Group commits of the trajectory store: one write of a batch and one fsync each.
    pub store_commits: AtomicU64,
    /// Bytes appended to the trajectory store (records with their headers).
    pub store_bytes: AtomicU64,
}

impl EventCounters {
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
