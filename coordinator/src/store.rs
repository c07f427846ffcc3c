//! The append-only trajectory store: every event a worker streamed, durably, once.
//!
//! Records are `[len u32 LE][crc32 u32 LE][EpisodeEvent protobuf]` appended to a
//! segment file. A batch of records is fsynced before any of them is acknowledged
//! (group commit). Reopening scans the file, rebuilds the set of stored keys and cuts a
//! torn tail left by a crash.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use prost::Message;
use tokio::sync::{mpsc, oneshot};
use tutor_proto::EpisodeEvent;

use crate::counters::EventCounters;

pub use tutor_proto::event_key;

/// What went wrong with the trajectory store, and on which file.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error(
        "opening the trajectory store {}: {error}; check that the run directory exists, is \
         writable and is not on a full disk",
        path.display()
    )]
    Open {
        path: PathBuf,
        error: Arc<std::io::Error>,
    },
    #[error(
        "reading the trajectory store {}: {error}; check the file's permissions (a torn or \
         corrupt tail is cut on open, not an error)",
        path.display()
    )]
    Read {
        path: PathBuf,
        error: Arc<std::io::Error>,
    },
    #[error(
        "writing the trajectory store {}: {error}; nothing of this batch was acknowledged \
         and the workers replay it: free disk space or fix the permissions, then the \
         replays are stored",
        path.display()
    )]
    Write {
        path: PathBuf,
        error: Arc<std::io::Error>,
    },
}

impl StoreError {
    fn open(path: &Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |e| Self::Open {
            path: path.to_path_buf(),
            error: Arc::new(e),
        }
    }

    fn read(path: &Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |e| Self::Read {
            path: path.to_path_buf(),
            error: Arc::new(e),
        }
    }

    fn write(path: &Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |e| Self::Write {
            path: path.to_path_buf(),
            error: Arc::new(e),
        }
    }
}

/// How the store writes. The default is the only durable setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreOptions {
    /// fsync each batch before acknowledging it. Off only for benchmarks that measure
    /// what the fsync costs: without it an acknowledged event can be lost in a crash.
    pub fsync: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self { fsync: true }
    }
}

pub struct TrajectoryStore {
    path: PathBuf,
    file: BufWriter<File>,
    seen: HashSet<(String, u32)>,
    options: StoreOptions,
    /// Since open: batches written (one fsync each when `options.fsync`), bytes appended.
    commits: u64,
    bytes: u64,
    /// Reused buffer for encoding one record.
    scratch: Vec<u8>,
}

impl TrajectoryStore {
    /// Opens (or creates) `dir/events.log`, recovering what a previous run stored.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        Self::open_with(dir, StoreOptions::default())
    }

    /// `open` with explicit options.
    pub fn open_with(dir: &Path, options: StoreOptions) -> Result<Self, StoreError> {
        Ok(Self::open_recovering(dir, options)?.0)
    }

    /// `open_with` that also returns every intact stored event, in store order: what a
    /// restarted coordinator rebuilds its iteration and datasets from.
    pub fn open_recovering(
        dir: &Path,
        options: StoreOptions,
    ) -> Result<(Self, Vec<EpisodeEvent>), StoreError> {
        std::fs::create_dir_all(dir).map_err(StoreError::open(dir))?;
        let path = dir.join("events.log");
        let (events, valid_len) = scan(&path)?;
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(StoreError::open(&path))?;
        let len = file.metadata().map_err(StoreError::open(&path))?.len();
        if len != valid_len {
            tracing::warn!(path = %path.display(), cut = len - valid_len, "cutting a torn tail");
            file.set_len(valid_len).map_err(StoreError::open(&path))?;
            file.sync_all().map_err(StoreError::open(&path))?;
        }
        file.seek(SeekFrom::End(0))
            .map_err(StoreError::open(&path))?;
        let seen = events.iter().filter_map(event_key).collect();
        let store = Self {
            path,
            file: BufWriter::with_capacity(256 * 1024, file),
            seen,
            options,
            commits: 0,
            bytes: 0,
            scratch: Vec::new(),
        };
        Ok((store, events))
    }

    /// Batches written since open (each fsynced once when fsync is on).
    pub fn commits(&self) -> u64 {
        self.commits
    }

    /// Bytes appended since open.
    pub fn bytes_written(&self) -> u64 {
        self.bytes
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    /// Appends the events that are new and fsyncs once. Returns, per event, whether it
    /// was a duplicate (already stored, or earlier in this batch: nothing written).
    /// Keys count as stored only once the batch is durable: after a failed write or
    /// fsync, a replay of the same events is written again, not acked as a duplicate.
    pub fn append_batch<'a>(
        &mut self,
        events: impl IntoIterator<Item = &'a EpisodeEvent>,
    ) -> Result<Vec<bool>, StoreError> {
        let mut dup = Vec::new();
        let mut new_keys: HashSet<(String, u32)> = HashSet::new();
        let mut bytes = 0u64;
        for ev in events {
            let Some(key) = event_key(ev) else {
                dup.push(true);
                continue;
            };
            if self.seen.contains(&key) || new_keys.contains(&key) {
                dup.push(true);
                continue;
            }
            self.scratch.clear();
            ev.encode(&mut self.scratch)
                .expect("a Vec grows to hold any message");
            let record = &self.scratch;
            write_record(&mut self.file, record).map_err(StoreError::write(&self.path))?;
            bytes += 8 + record.len() as u64;
            new_keys.insert(key);
            dup.push(false);
        }
        if !new_keys.is_empty() {
            self.file.flush().map_err(StoreError::write(&self.path))?;
            if self.options.fsync {
                self.file
                    .get_ref()
                    .sync_data()
                    .map_err(StoreError::write(&self.path))?;
            }
            self.commits += 1;
            self.bytes += bytes;
            self.seen.extend(new_keys);
        }
        Ok(dup)
    }
}

/// Appends one record: its length, its CRC, its bytes.
fn write_record(file: &mut impl Write, record: &[u8]) -> std::io::Result<()> {
    file.write_all(&(record.len() as u32).to_le_bytes())?;
    file.write_all(&crc32fast::hash(record).to_le_bytes())?;
    file.write_all(record)
}

/// Reads every intact record of a store file; returns them and the length of the intact
/// prefix (a torn or corrupt record ends the scan).
pub fn scan(path: &Path) -> Result<(Vec<EpisodeEvent>, u64), StoreError> {
    let mut events = Vec::new();
    let mut data = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut data).map_err(StoreError::read(path))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((events, 0)),
        Err(e) => return Err(StoreError::read(path)(e)),
    }
    let mut pos = 0usize;
    while pos + 8 <= data.len() {
        let len = u32::from_le_bytes(data[pos..pos + 4].try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(data[pos + 4..pos + 8].try_into().unwrap());
        let end = pos + 8 + len;
        if end > data.len() || crc32fast::hash(&data[pos + 8..end]) != crc {
            break;
        }
        match EpisodeEvent::decode(&data[pos + 8..end]) {
            Ok(ev) => events.push(ev),
            Err(_) => break,
        }
        pos = end;
    }
    Ok((events, pos as u64))
}

/// A request to store one event. The reply hands the event back (so the caller need
/// not keep a copy) with whether it was a duplicate.
pub struct StoreRequest {
    pub event: EpisodeEvent,
    pub reply: oneshot::Sender<StoreReply>,
}

/// The answer to a `StoreRequest`, sent once the event's batch is durable (or failed).
pub struct StoreReply {
    pub event: EpisodeEvent,
    /// Whether the event was a duplicate; an error if the batch could not be written.
    pub result: Result<bool, StoreError>,
}

/// Largest batch one group commit writes.
const MAX_BATCH: usize = 1024;

/// Runs the store on its own thread: drains whatever requests are waiting, writes them
/// with one fsync, then answers each. The bounded channel is the backpressure.
/// `counters` gets the store's commits and bytes.
/// The thread ends, after answering every request it received, once every sender is
/// dropped: join the handle to know the last batch is written.
pub fn spawn_writer(
    mut store: TrajectoryStore,
    counters: Arc<EventCounters>,
) -> (mpsc::Sender<StoreRequest>, std::thread::JoinHandle<()>) {
    let (tx, mut rx) = mpsc::channel::<StoreRequest>(MAX_BATCH);
    let thread = std::thread::Builder::new()
        .name("trajectory-store".into())
        .spawn(move || {
            let mut batch = Vec::with_capacity(MAX_BATCH);
            while let Some(first) = rx.blocking_recv() {
                batch.push(first);
                while batch.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(r) => batch.push(r),
                        Err(_) => break,
                    }
                }
                let result = store.append_batch(batch.iter().map(|r| &r.event));
                counters
                    .store_commits
                    .store(store.commits(), Ordering::Relaxed);
                counters
                    .store_bytes
                    .store(store.bytes_written(), Ordering::Relaxed);
                match result {
                    Ok(dups) => {
                        for (r, d) in batch.drain(..).zip(dups) {
                            let _ = r.reply.send(StoreReply {
                                event: r.event,
                                result: Ok(d),
                            });
                        }
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "trajectory store write failed");
                        for r in batch.drain(..) {
                            let _ = r.reply.send(StoreReply {
                                event: r.event,
                                result: Err(e.clone()),
                            });
                        }
                    }
                }
            }
        })
        .expect("starting the trajectory store thread");
    (tx, thread)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tutor_proto::{episode_event, EpisodeOutcome, TurnRecord};

    fn turn(ep: &str, i: u32) -> EpisodeEvent {
        EpisodeEvent {
            episode_id: ep.into(),
            worker_id: "w".into(),
            event: Some(episode_event::Event::Turn(TurnRecord {
                turn_index: i,
                ..Default::default()
            })),
        }
    }

    #[test]
    fn duplicates_are_not_written_twice_and_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = TrajectoryStore::open(dir.path()).unwrap();
        assert_eq!(
            s.append_batch(&[turn("e1", 0), turn("e1", 1)]).unwrap(),
            vec![false, false]
        );
        assert_eq!(
            s.append_batch(&[turn("e1", 1), turn("e1", 2)]).unwrap(),
            vec![true, false]
        );
        drop(s);
        let mut s = TrajectoryStore::open(dir.path()).unwrap();
        assert_eq!(s.len(), 3);
        let out = EpisodeEvent {
            episode_id: "e1".into(),
            worker_id: "w".into(),
            event: Some(episode_event::Event::Outcome(EpisodeOutcome::default())),
        };
        assert_eq!(
            s.append_batch(&[turn("e1", 0), out.clone(), out]).unwrap(),
            vec![true, false, true]
        );
        let (events, _) = scan(&dir.path().join("events.log")).unwrap();
        assert_eq!(events.len(), 4);
    }

    #[test]
    fn torn_tail_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = TrajectoryStore::open(dir.path()).unwrap();
        s.append_batch(&[turn("e1", 0), turn("e1", 1)]).unwrap();
        drop(s);
        let path = dir.path().join("events.log");
        let full = std::fs::metadata(&path).unwrap().len();
        // A crash in the middle of the second record.
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(full - 3).unwrap();
        let mut s = TrajectoryStore::open(dir.path()).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s.append_batch(&[turn("e1", 1)]).unwrap(), vec![false]);
        let (events, len) = scan(&path).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(len, std::fs::metadata(&path).unwrap().len());
    }
}
