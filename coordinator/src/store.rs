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

use anyhow::{Context, Result};
use prost::Message;
use tokio::sync::{mpsc, oneshot};
use tutor_proto::{episode_event, EpisodeEvent, TURN_INDEX_OUTCOME};

/// Idempotency key of an event: (episode id, turn index); outcomes use TURN_INDEX_OUTCOME.
pub fn event_key(ev: &EpisodeEvent) -> Option<(String, u32)> {
    match ev.event.as_ref()? {
        episode_event::Event::Turn(t) => Some((ev.episode_id.clone(), t.turn_index)),
        episode_event::Event::Outcome(_) => Some((ev.episode_id.clone(), TURN_INDEX_OUTCOME)),
    }
}

pub struct TrajectoryStore {
    path: PathBuf,
    file: BufWriter<File>,
    seen: HashSet<(String, u32)>,
}

impl TrajectoryStore {
    /// Opens (or creates) `dir/events.log`, recovering what a previous run stored.
    pub fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("events.log");
        let (events, valid_len) = scan(&path)?;
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let len = file.metadata()?.len();
        if len != valid_len {
            tracing::warn!(path = %path.display(), cut = len - valid_len, "cutting a torn tail");
            file.set_len(valid_len)?;
            file.sync_all()?;
        }
        file.seek(SeekFrom::End(0))?;
        let seen = events.iter().filter_map(event_key).collect();
        Ok(Self {
            path,
            file: BufWriter::new(file),
            seen,
        })
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
    /// was a duplicate (already stored, nothing written).
    pub fn append_batch(&mut self, events: &[EpisodeEvent]) -> Result<Vec<bool>> {
        let mut dup = Vec::with_capacity(events.len());
        let mut wrote = false;
        for ev in events {
            let Some(key) = event_key(ev) else {
                dup.push(true);
                continue;
            };
            if self.seen.contains(&key) {
                dup.push(true);
                continue;
            }
            let bytes = ev.encode_to_vec();
            self.file.write_all(&(bytes.len() as u32).to_le_bytes())?;
            self.file
                .write_all(&crc32fast::hash(&bytes).to_le_bytes())?;
            self.file.write_all(&bytes)?;
            self.seen.insert(key);
            dup.push(false);
            wrote = true;
        }
        if wrote {
            self.file.flush()?;
            self.file.get_ref().sync_data()?;
        }
        Ok(dup)
    }
}

/// Reads every intact record of a store file; returns them and the length of the intact
/// prefix (a torn or corrupt record ends the scan).
pub fn scan(path: &Path) -> Result<(Vec<EpisodeEvent>, u64)> {
    let mut events = Vec::new();
    let mut data = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut data)
                .with_context(|| format!("reading {}", path.display()))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((events, 0)),
        Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
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

/// A request to store one event; the reply says whether it was a duplicate.
pub struct StoreRequest {
    pub event: EpisodeEvent,
    pub reply: oneshot::Sender<Result<bool, String>>,
}

/// Runs the store on its own thread: drains whatever requests are waiting, writes them
/// with one fsync, then answers each. The bounded channel is the backpressure.
pub fn spawn_writer(mut store: TrajectoryStore) -> mpsc::Sender<StoreRequest> {
    let (tx, mut rx) = mpsc::channel::<StoreRequest>(1024);
    std::thread::Builder::new()
        .name("trajectory-store".into())
        .spawn(move || {
            while let Some(first) = rx.blocking_recv() {
                let mut batch = vec![first];
                while batch.len() < 512 {
                    match rx.try_recv() {
                        Ok(r) => batch.push(r),
                        Err(_) => break,
                    }
                }
                let events: Vec<EpisodeEvent> = batch.iter().map(|r| r.event.clone()).collect();
                match store.append_batch(&events) {
                    Ok(dups) => {
                        for (r, d) in batch.into_iter().zip(dups) {
                            let _ = r.reply.send(Ok(d));
                        }
                    }
                    Err(e) => {
                        tracing::error!(error = %format!("{e:#}"), path = %store.path().display(), "trajectory store write failed");
                        for r in batch {
                            let _ = r.reply.send(Err(format!("store write failed: {e:#}")));
                        }
                    }
                }
            }
        })
        .expect("starting the trajectory store thread");
    tx
}

#[cfg(test)]
mod tests {
    use super::*;
    use tutor_proto::{EpisodeOutcome, TurnRecord};

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
