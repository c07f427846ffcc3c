//! Opening a trajectory store takes memory bounded by a record, not by the file: the
//! scan streams it, and a record header announcing gigabytes is damage, never an
//! allocation. Measured with a counting allocator, so this binary holds one test (the
//! allocator counts every thread's allocations).

use std::path::Path;

use tutor_coordinator::store::{self, StoreError, StoreOptions, TrajectoryStore};
use tutor_proto::{episode_event, EpisodeEvent, TurnRecord};

#[path = "common/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::peak_of;

const EVENTS: usize = 2000;
const OBSERVATION: usize = 16_000;
/// Far below the 32 MB file, far above a record and the read chunk.
const BOUND: usize = 4 << 20;

fn turn(i: usize) -> EpisodeEvent {
    EpisodeEvent {
        episode_id: format!("it000-train{:04}-g0a0", i / 10),
        worker_id: "w".into(),
        event: Some(episode_event::Event::Turn(TurnRecord {
            turn_index: (i % 10) as u32,
            observation: "o".repeat(OBSERVATION),
            ..Default::default()
        })),
    }
}

/// Opens the store of `dir` counting the events it recovers; returns the count and the
/// peak memory of the open.
fn open(dir: &Path) -> (Result<usize, StoreError>, usize) {
    peak_of(|| {
        let mut n = 0;
        TrajectoryStore::open_for_each(dir, StoreOptions::default(), |_, _| n += 1).map(|_| n)
    })
}

/// Sets the length field of the record at `at` to 3 GiB.
fn announce_three_gib(path: &Path, at: u64) {
    let mut data = std::fs::read(path).unwrap();
    let at = at as usize;
    data[at..at + 4].copy_from_slice(&(3u32 << 30).to_le_bytes());
    std::fs::write(path, data).unwrap();
}

#[test]
fn opening_a_large_store_takes_memory_bounded_by_a_record() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = TrajectoryStore::open_with(dir.path(), StoreOptions { fsync: false }).unwrap();
    let events: Vec<EpisodeEvent> = (0..EVENTS).map(turn).collect();
    for batch in events.chunks(100) {
        s.append_batch(batch).unwrap();
    }
    drop(s);
    let path = store::log_path(dir.path());
    let len = std::fs::metadata(&path).unwrap().len();
    assert!(len > 6 * BOUND as u64, "{len} bytes");
    // Where each record starts, as the store reports it.
    let mut offsets = Vec::new();
    store::scan_with(&path, |at, _| offsets.push(at)).unwrap();
    drop(events);

    // Intact: every event, in memory bounded by a record (not the file, not the events).
    let (n, peak) = open(dir.path());
    assert_eq!(n.unwrap(), EVENTS);
    assert!(peak < BOUND, "opening a {len}-byte store took {peak} bytes");

    // A header in the middle announcing 3 GiB: refused as corruption at its offset,
    // without allocating it, nor the rest of the file while looking for the next record.
    let middle = offsets[EVENTS / 2];
    announce_three_gib(&path, middle);
    let (refused, peak) = open(dir.path());
    match refused {
        Err(StoreError::Corrupt { offset, next, .. }) => {
            assert_eq!((offset, next), (middle, offsets[EVENTS / 2 + 1]))
        }
        other => panic!("not refused as corrupt: {other:?}"),
    }
    assert!(peak < BOUND, "{peak} bytes");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), len, "nothing cut");

    // The same in the last record: a torn tail, cut.
    let mut data = std::fs::read(&path).unwrap();
    data[middle as usize..middle as usize + 4]
        .copy_from_slice(&((offsets[EVENTS / 2 + 1] - middle - 8) as u32).to_le_bytes());
    std::fs::write(&path, data).unwrap();
    let last = *offsets.last().unwrap();
    announce_three_gib(&path, last);
    let (n, peak) = open(dir.path());
    assert_eq!(n.unwrap(), EVENTS - 1);
    assert!(peak < BOUND, "{peak} bytes");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), last);
}
