//! The append-only trajectory store: every event a worker streamed, durably, once.
//! (Past 800 lines with its tests: the failure cases a disk can produce — torn tails,
//! corrupt middles, failed writes, fsyncs and rollbacks — are pinned down beside the code
//! that handles them.)
//!
//! Records are `[len u32 LE][crc32 u32 LE][EpisodeEvent protobuf]` appended to a
//! segment file. A batch of records is fsynced before any of them is acknowledged
//! (group commit). A batch whose write or fsync fails is cut off the file again (back to
//! the end of the last durable batch) and answered with the error, so the workers replay
//! it and the next batch never lands behind a torn record; if even that cut fails, the
//! store is poisoned: it refuses every later batch and its writer thread ends, which
//! stops the coordinator.
//!
//! Reopening scans the file, rebuilds the set of stored keys (a key stored twice is
//! recovered once, the first time) and cuts a torn tail left by a crash: a damaged last
//! record, or damage with no intact record after it. Damage followed by an intact record
//! is not a crash's tail but corruption in the middle of acknowledged data: open refuses
//! it ([`StoreError::Corrupt`]) rather than cut what follows. The scan streams the file
//! record by record (a record is at most [`MAX_RECORD_BYTES`]; a header announcing more
//! is damage), so memory stays bounded by one record whatever the file's size, and hands
//! each event on with its record's offset ([`TrajectoryStore::open_for_each`]): a
//! restarted coordinator keeps offsets and reads an iteration's events back
//! ([`StoreReader`]) when it replays it, instead of holding the whole history.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
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
        "reading the trajectory store {}: {error}; check the file's permissions (a torn \
         tail is cut on open, not an error)",
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
    /// A damaged record with an intact one after it: not a torn tail, so not cut.
    #[error(
        "the trajectory store {path} is corrupt at byte {offset}: the record there is \
         damaged, yet an intact record follows at byte {next}, so acknowledged events come \
         after the damage and the store will not cut them; restore {path} from a backup, or \
         cut it at the damage with `truncate -s {offset} {path}`, which loses the {after} \
         bytes from there to the end (the events stored after the damage; the workers do \
         not replay acknowledged events), then start again",
        path = path.display()
    )]
    Corrupt {
        path: PathBuf,
        /// Where the damaged record starts: the intact prefix's length.
        offset: u64,
        /// Where the first intact record after it starts.
        next: u64,
        /// Bytes from `offset` to the end of the file.
        after: u64,
    },
    /// A record found intact on open no longer is when read back.
    #[error(
        "the trajectory store {path} changed under the coordinator: the record at byte \
         {offset}, intact when the store was opened, is not any more; the file is \
         append-only and must not be edited, cut or replaced while a coordinator runs on \
         it: stop the coordinator, restore {path} from a backup and start again",
        path = path.display()
    )]
    Changed { path: PathBuf, offset: u64 },
    /// A write failed and cutting the file back to its durable length failed too.
    #[error(
        "the trajectory store {path} refuses every batch: writing a batch failed ({error}) \
         and cutting the file back to the end of the last durable batch, {durable_len} \
         bytes, failed too ({rollback}), so the file may end in a torn batch; stop the \
         coordinator, fix the disk (free space, look for I/O errors in the kernel log), \
         cut the file with `truncate -s {durable_len} {path}` (every acknowledged event \
         is in those bytes) and restart",
        path = path.display()
    )]
    Poisoned {
        path: PathBuf,
        durable_len: u64,
        /// Why the batch failed.
        error: Arc<std::io::Error>,
        /// Why the cut back failed.
        rollback: Arc<std::io::Error>,
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

/// The store's file access: a `File`, or in tests one that fails on demand.
trait StoreFile: Write + Send {
    fn sync_data(&self) -> std::io::Result<()>;
    fn set_len(&self, len: u64) -> std::io::Result<()>;
    /// Moves to the end of the file; returns the file's length.
    fn seek_end(&mut self) -> std::io::Result<u64>;
}

impl StoreFile for File {
    fn sync_data(&self) -> std::io::Result<()> {
        File::sync_data(self)
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        File::set_len(self, len)
    }

    fn seek_end(&mut self) -> std::io::Result<u64> {
        self.seek(SeekFrom::End(0))
    }
}

/// Encoded records of a batch are written to the file whenever this many are waiting
/// (and at the end of the batch).
const WRITE_CHUNK: usize = 256 * 1024;

pub struct TrajectoryStore {
    path: PathBuf,
    file: Box<dyn StoreFile>,
    /// The file's length at the end of the last batch written whole (and fsynced when
    /// `options.fsync`): what a failed batch is cut back to.
    durable_len: u64,
    /// Set once a failed batch could not be cut back: every later batch is refused.
    poisoned: Option<StoreError>,
    seen: HashSet<(String, u32)>,
    options: StoreOptions,
    /// Since open: batches written (one fsync each when `options.fsync`), bytes appended.
    commits: u64,
    bytes: u64,
    /// Records of the batch being written, not yet handed to the file.
    buf: Vec<u8>,
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

    /// `open_with` that also returns every intact stored event, in store order, each key
    /// once. It holds them all at once: for tests and tools; a coordinator recovers with
    /// [`TrajectoryStore::open_for_each`].
    pub fn open_recovering(
        dir: &Path,
        options: StoreOptions,
    ) -> Result<(Self, Vec<EpisodeEvent>), StoreError> {
        let mut events = Vec::new();
        let store = Self::open_for_each(dir, options, |_, ev| events.push(ev))?;
        Ok((store, events))
    }

    /// `open_with` that hands `each` every intact stored event, in store order, each key
    /// once (the first time it was stored), with the byte offset of its record (to read
    /// it back later with [`StoreReader`]): what a restarted coordinator rebuilds its
    /// iteration and datasets from. The file is read record by record, so memory stays
    /// bounded by the longest record, not the file. On an error, what `each` was given
    /// is not a recovery: drop it.
    pub fn open_for_each(
        dir: &Path,
        options: StoreOptions,
        each: impl FnMut(u64, EpisodeEvent),
    ) -> Result<Self, StoreError> {
        Self::open_inner(dir, options, each, |file| Box::new(file))
    }

    /// `open_for_each` with the file access wrapped by `wrap` (tests inject failures).
    fn open_inner(
        dir: &Path,
        options: StoreOptions,
        mut each: impl FnMut(u64, EpisodeEvent),
        wrap: impl FnOnce(File) -> Box<dyn StoreFile>,
    ) -> Result<Self, StoreError> {
        create_dir_durably(dir)?;
        let path = log_path(dir);
        // Each key once, the first time it was stored (older versions could store a
        // replay twice).
        let mut seen = HashSet::new();
        let mut doubled = 0u64;
        let valid_len = scan_with(&path, |offset, ev| {
            if seen.insert(event_key(&ev).expect("scan keeps keyed records only")) {
                each(offset, ev);
            } else {
                doubled += 1;
            }
        })?;
        if doubled > 0 {
            tracing::warn!(path = %path.display(), doubled, "the store holds some events twice: recovering each once");
        }
        let (mut file, created) = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) => (file, false),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let file = OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(StoreError::open(&path))?;
                (file, true)
            }
            Err(e) => return Err(StoreError::open(&path)(e)),
        };
        if created {
            // The new file's directory entry is durable only once the directory is
            // fsynced: without it a crash could lose the whole file, batches fsynced
            // into it and acknowledged included.
            sync_dir(dir)?;
        }
        let len = file.metadata().map_err(StoreError::open(&path))?.len();
        if len != valid_len {
            tracing::warn!(path = %path.display(), cut = len - valid_len, "cutting a torn tail");
            file.set_len(valid_len).map_err(StoreError::open(&path))?;
            file.sync_all().map_err(StoreError::open(&path))?;
        }
        file.seek(SeekFrom::End(0))
            .map_err(StoreError::open(&path))?;
        let store = Self {
            path,
            file: wrap(file),
            durable_len: valid_len,
            poisoned: None,
            seen,
            options,
            commits: 0,
            bytes: 0,
            buf: Vec::new(),
        };
        Ok(store)
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
    /// was a duplicate (already stored, or earlier in this batch: nothing written; an
    /// event with no key or longer than [`MAX_RECORD_BYTES`] is not written either and
    /// reads `true`: the Rollout service refuses both before they get here).
    /// Keys count as stored only once the batch is durable: after a failed write or
    /// fsync, the batch's bytes are cut off the file again and a replay of the same
    /// events is written again, not acked as a duplicate. A poisoned store (see
    /// [`StoreError::Poisoned`]) refuses every batch.
    pub fn append_batch<'a>(
        &mut self,
        events: impl IntoIterator<Item = &'a EpisodeEvent>,
    ) -> Result<Vec<bool>, StoreError> {
        if let Some(e) = &self.poisoned {
            return Err(e.clone());
        }
        let mut dup = Vec::new();
        let mut new_keys: HashSet<(String, u32)> = HashSet::new();
        let mut bytes = 0u64;
        self.buf.clear();
        for ev in events {
            let Some(key) = event_key(ev) else {
                dup.push(true);
                continue;
            };
            if ev.encoded_len() > MAX_RECORD_BYTES {
                // A record that recovery would take for damage. The Rollout service
                // refuses such events (MAX_EVENT_BYTES) before they get here.
                tracing::error!(episode = %key.0, turn = key.1, bytes = ev.encoded_len(), max = MAX_RECORD_BYTES, "an event too long for a store record: not stored");
                dup.push(true);
                continue;
            }
            if self.seen.contains(&key) || new_keys.contains(&key) {
                dup.push(true);
                continue;
            }
            let before = self.buf.len();
            encode_record(&mut self.buf, ev);
            bytes += (self.buf.len() - before) as u64;
            new_keys.insert(key);
            dup.push(false);
            if self.buf.len() >= WRITE_CHUNK {
                if let Err(e) = self.file.write_all(&self.buf) {
                    return Err(self.roll_back(e));
                }
                self.buf.clear();
            }
        }
        if new_keys.is_empty() {
            return Ok(dup);
        }
        if let Err(e) = self.commit() {
            return Err(self.roll_back(e));
        }
        self.durable_len += bytes;
        self.commits += 1;
        self.bytes += bytes;
        self.seen.extend(new_keys);
        Ok(dup)
    }

    /// Writes what is left of the batch and makes it durable.
    fn commit(&mut self) -> std::io::Result<()> {
        self.file.write_all(&self.buf)?;
        self.buf.clear();
        self.file.flush()?;
        if self.options.fsync {
            self.file.sync_data()?;
        }
        Ok(())
    }

    /// After `error` failed a batch: drops what is left of it and cuts what reached the
    /// file, so the file ends with the last durable batch again. Returns the batch's
    /// error; if the cut fails, poisons the store.
    fn roll_back(&mut self, error: std::io::Error) -> StoreError {
        self.buf.clear();
        let error = Arc::new(error);
        match self.cut_to_durable() {
            Ok(()) => StoreError::Write {
                path: self.path.clone(),
                error,
            },
            Err(rollback) => {
                let poisoned = StoreError::Poisoned {
                    path: self.path.clone(),
                    durable_len: self.durable_len,
                    error,
                    rollback: Arc::new(rollback),
                };
                tracing::error!(error = %poisoned, "trajectory store poisoned");
                self.poisoned = Some(poisoned.clone());
                poisoned
            }
        }
    }

    fn cut_to_durable(&mut self) -> std::io::Result<()> {
        self.file.set_len(self.durable_len)?;
        // fdatasync persists a size change (ftruncate) too.
        self.file.sync_data()?;
        let end = self.file.seek_end()?;
        if end != self.durable_len {
            return Err(std::io::Error::other(format!(
                "the file is {end} bytes long after the cut"
            )));
        }
        Ok(())
    }
}

/// The store file of the store in `dir`.
pub fn log_path(dir: &Path) -> PathBuf {
    dir.join("events.log")
}

/// Creates `dir` and any missing parents, each one's entry made durable (its parent
/// fsynced) before the store writes into it: a crash cannot lose a directory, and the log
/// and batches acknowledged in it with it.
pub fn create_dir_durably(dir: &Path) -> Result<(), StoreError> {
    // The missing levels, deepest first.
    let mut missing = Vec::new();
    let mut at = Some(dir);
    while let Some(d) = at.filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        missing.push(d);
        at = d.parent();
    }
    std::fs::create_dir_all(dir).map_err(StoreError::open(dir))?;
    for d in missing.into_iter().rev() {
        sync_parent(d)?;
    }
    Ok(())
}

#[cfg(test)]
thread_local! {
    /// The directories this thread fsynced (tests check that new entries are made durable).
    static SYNCED_DIRS: std::cell::RefCell<Vec<PathBuf>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// fsyncs directory `dir`, so that an entry just created in it survives a crash.
fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    #[cfg(test)]
    SYNCED_DIRS.with(|d| d.borrow_mut().push(dir.to_path_buf()));
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(StoreError::open(dir))
}

/// fsyncs the directory holding `path` (just created), if it has one.
fn sync_parent(path: &Path) -> Result<(), StoreError> {
    match path.parent() {
        // A relative path's top level: its parent is the working directory.
        Some(parent) if parent.as_os_str().is_empty() => sync_dir(Path::new(".")),
        Some(parent) => sync_dir(parent),
        None => Ok(()),
    }
}

/// Appends one record to `buf`: its length, its CRC, its bytes.
fn encode_record(buf: &mut Vec<u8>, ev: &EpisodeEvent) {
    let start = buf.len();
    buf.extend_from_slice(&[0; 8]);
    ev.encode(buf).expect("a Vec grows to hold any message");
    let len = u32::try_from(buf.len() - start - 8).expect("an event is under 4 GiB");
    let crc = crc32fast::hash(&buf[start + 8..]);
    buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
    buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// Longest record payload the store writes or reads back. An event reaches the store
/// inside one Rollout request, which the coordinator refuses above
/// `tutor_proto::MAX_ROLLOUT_REQUEST_BYTES` (and before that tonic's 4 MiB default), so
/// no store ever held a longer one; `append_batch` writes none (see
/// `tutor_proto::MAX_EVENT_BYTES`, the limit it is given events under). A header that
/// announces more is damage, and reading never allocates more than this per record.
pub const MAX_RECORD_BYTES: usize = tutor_proto::MAX_ROLLOUT_REQUEST_BYTES;

/// Bytes read from the file at a time.
const READ_CHUNK: usize = 64 * 1024;

/// The event of a record whose header is `header` and payload `payload`, if the record
/// is intact: its CRC matches and it decodes as an event with a key (the store writes no
/// other).
fn decode_record(header: &[u8], payload: &[u8]) -> Option<EpisodeEvent> {
    let crc = u32::from_le_bytes(header[4..8].try_into().unwrap());
    if crc32fast::hash(payload) != crc {
        return None;
    }
    let ev = EpisodeEvent::decode(payload).ok()?;
    event_key(&ev)?;
    Some(ev)
}

/// The payload length a record header announces, if the store could have written it.
fn record_len(header: &[u8]) -> Option<usize> {
    let len = u32::from_le_bytes(header[..4].try_into().unwrap()) as usize;
    (len <= MAX_RECORD_BYTES).then_some(len)
}

/// A window on a store file: the bytes from `start`, read in chunks as asked for. It
/// holds at most about the longest span asked for (a record, at most
/// [`MAX_RECORD_BYTES`] + 8) and what was read with it, never the whole file.
struct Window {
    file: File,
    /// The file offset of `buf[0]`; the file's cursor is at `start + buf.len()`.
    start: u64,
    buf: Vec<u8>,
}

impl Window {
    fn new(file: File) -> Self {
        Self {
            file,
            start: 0,
            buf: Vec::new(),
        }
    }

    /// The `n` bytes at file offset `at`; `None` if the file ends before them. Bytes
    /// before `at` are dropped from the window.
    fn get(&mut self, at: u64, n: usize) -> std::io::Result<Option<&[u8]>> {
        let end = self.start + self.buf.len() as u64;
        if at < self.start || at > end {
            self.file.seek(SeekFrom::Start(at))?;
            self.start = at;
            self.buf.clear();
        }
        let from = (at - self.start) as usize;
        if from + n > self.buf.len() {
            self.buf.drain(..from);
            self.start = at;
            while self.buf.len() < n {
                // Doubling: what is read at least matches what was kept (moving the
                // kept bytes stays linear) and the buffer stays within twice what the
                // file holds or was asked for.
                let old = self.buf.len();
                self.buf.resize(old + old.max(READ_CHUNK), 0);
                match self.file.read(&mut self.buf[old..]) {
                    Ok(0) => {
                        self.buf.truncate(old);
                        break;
                    }
                    Ok(k) => self.buf.truncate(old + k),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => self.buf.truncate(old),
                    Err(e) => {
                        self.buf.truncate(old);
                        return Err(e);
                    }
                }
            }
            if self.buf.len() < n {
                return Ok(None);
            }
            return Ok(Some(&self.buf[..n]));
        }
        Ok(Some(&self.buf[from..from + n]))
    }

    /// Whether the `len` bytes at `at` have CRC `crc` (false if the file ends first),
    /// read a chunk at a time: the window stays about a chunk long whatever `len`.
    fn crc_matches(&mut self, at: u64, len: usize, crc: u32) -> std::io::Result<bool> {
        let mut hasher = crc32fast::Hasher::new();
        let mut done = 0;
        while done < len {
            let n = (len - done).min(READ_CHUNK);
            let Some(bytes) = self.get(at + done as u64, n)? else {
                return Ok(false);
            };
            hasher.update(bytes);
            done += n;
        }
        Ok(hasher.finalize() == crc)
    }

    /// The intact record at `at` and where it ends; `None` if it is damaged, announces
    /// more than [`MAX_RECORD_BYTES`] or runs past the end of the file.
    fn record(&mut self, at: u64) -> std::io::Result<Option<(EpisodeEvent, u64)>> {
        let Some(header) = self.get(at, 8)? else {
            return Ok(None);
        };
        let header: [u8; 8] = header.try_into().unwrap();
        let Some(len) = record_len(&header) else {
            return Ok(None);
        };
        let Some(payload) = self.get(at + 8, len)? else {
            return Ok(None);
        };
        Ok(decode_record(&header, payload).map(|ev| (ev, at + 8 + len as u64)))
    }
}

/// Reads every intact record of a store file, in file order (a key stored twice is
/// returned twice); returns them and the length of the intact prefix. A torn tail (a
/// damaged record with no intact record after it) ends the scan; a damaged record
/// followed by an intact one is an error, [`StoreError::Corrupt`]. Holds every event:
/// for reports and tests; [`scan_with`] streams.
pub fn scan(path: &Path) -> Result<(Vec<EpisodeEvent>, u64), StoreError> {
    let mut events = Vec::new();
    let len = scan_with(path, |_, ev| events.push(ev))?;
    Ok((events, len))
}

/// `scan` that hands each intact record to `each` (its byte offset and event, in file
/// order) instead of collecting them, reading the file record by record: memory stays
/// bounded by the longest record ([`MAX_RECORD_BYTES`]), whatever the file's size.
/// Returns the length of the intact prefix. On [`StoreError::Corrupt`] (found only after
/// the intact prefix was handed out) or a read error, what `each` was given is not a
/// recovery: drop it.
pub fn scan_with(path: &Path, mut each: impl FnMut(u64, EpisodeEvent)) -> Result<u64, StoreError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(StoreError::read(path)(e)),
    };
    let file_len = file.metadata().map_err(StoreError::read(path))?.len();
    let mut window = Window::new(file);
    let mut pos = 0u64;
    while let Some((ev, end)) = window.record(pos).map_err(StoreError::read(path))? {
        each(pos, ev);
        pos = end;
    }
    // A crash tears only the tail: an intact record after the damage means the damage
    // is in the middle, among acknowledged records. Each byte after the damage may start
    // one: its CRC is checked in chunks (a second reader), so a garbage header that
    // announces a long record costs reading, not holding, it.
    let mut probe: Option<Window> = None;
    for at in pos + 1..file_len.saturating_sub(7) {
        let Some(header) = window.get(at, 8).map_err(StoreError::read(path))? else {
            break;
        };
        let header: [u8; 8] = header.try_into().unwrap();
        let Some(len) = record_len(&header) else {
            continue;
        };
        if at + 8 + len as u64 > file_len {
            continue;
        }
        let probe = match &mut probe {
            Some(p) => p,
            None => probe.insert(Window::new(
                File::open(path).map_err(StoreError::read(path))?,
            )),
        };
        let crc = u32::from_le_bytes(header[4..].try_into().unwrap());
        if probe
            .crc_matches(at + 8, len, crc)
            .map_err(StoreError::read(path))?
            && probe.record(at).map_err(StoreError::read(path))?.is_some()
        {
            return Err(StoreError::Corrupt {
                path: path.to_path_buf(),
                offset: pos,
                next: at,
                after: file_len - pos,
            });
        }
    }
    Ok(pos)
}

/// Reads records back from a store file by the offsets [`scan_with`] and
/// [`TrajectoryStore::open_for_each`] hand out (what a restarted coordinator replays
/// when an iteration starts, instead of holding every event from open on). The file is
/// append-only, so the record at such an offset stays what it was.
pub struct StoreReader {
    path: PathBuf,
    window: Window,
}

impl StoreReader {
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let file = File::open(path).map_err(StoreError::read(path))?;
        Ok(Self {
            path: path.to_path_buf(),
            window: Window::new(file),
        })
    }

    /// The event of the record at byte `offset` (cheapest in increasing offsets).
    pub fn read_at(&mut self, offset: u64) -> Result<EpisodeEvent, StoreError> {
        match self.window.record(offset) {
            Ok(Some((ev, _))) => Ok(ev),
            Ok(None) => Err(StoreError::Changed {
                path: self.path.clone(),
                offset,
            }),
            Err(e) => Err(StoreError::read(&self.path)(e)),
        }
    }
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
/// dropped: join the handle to know the last batch is written. It also ends if the
/// store is poisoned ([`StoreError::Poisoned`]), after answering the batch and every
/// request already queued with that error; its channel then refuses new requests
/// (`Sender::closed` resolves) and the handle returns the error.
pub fn spawn_writer(
    mut store: TrajectoryStore,
    counters: Arc<EventCounters>,
) -> (
    mpsc::Sender<StoreRequest>,
    std::thread::JoinHandle<Result<(), StoreError>>,
) {
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
                        let poisoned = matches!(e, StoreError::Poisoned { .. });
                        if poisoned {
                            tracing::error!(error = %e, "trajectory store poisoned: refusing every event, the coordinator stops");
                            // No new request gets in; the queued ones are refused below.
                            rx.close();
                        } else {
                            tracing::error!(error = %e, "trajectory store write failed");
                        }
                        for r in batch.drain(..) {
                            let _ = r.reply.send(StoreReply {
                                event: r.event,
                                result: Err(e.clone()),
                            });
                        }
                        if poisoned {
                            while let Some(r) = rx.blocking_recv() {
                                let _ = r.reply.send(StoreReply {
                                    event: r.event,
                                    result: Err(e.clone()),
                                });
                            }
                            return Err(e);
                        }
                    }
                }
            }
            Ok(())
        })
        .expect("starting the trajectory store thread");
    (tx, thread)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use tutor_proto::{episode_event, EpisodeOutcome, TurnRecord};

    /// A store opened in a directory that does not exist yet makes every entry it
    /// creates durable: each new directory level (its parent fsynced) and the log (its
    /// directory fsynced), relative paths included. Reopening creates nothing and syncs no
    /// directory. (That a
    /// lost entry loses data needs a power cut to show; this checks the fsyncs are made.)
    #[test]
    fn new_directories_and_the_log_are_made_durable() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("a").join("b").join("run");
        super::SYNCED_DIRS.with(|d| d.borrow_mut().clear());
        let store = TrajectoryStore::open(&dir).unwrap();
        drop(store);
        let synced = super::SYNCED_DIRS.with(|d| d.borrow_mut().split_off(0));
        let want = [
            root.path().to_path_buf(),
            root.path().join("a"),
            root.path().join("a").join("b"),
            dir.clone(),
        ];
        assert_eq!(synced, want, "a new entry whose directory was not fsynced");
        TrajectoryStore::open(&dir).unwrap();
        let synced = super::SYNCED_DIRS.with(|d| d.borrow_mut().split_off(0));
        assert!(synced.is_empty(), "{synced:?}");

        // A relative path's first level: its parent is the working directory.
        let cwd = std::env::current_dir().unwrap();
        std::env::set_current_dir(root.path()).unwrap();
        super::create_dir_durably(Path::new("rel/run")).unwrap();
        std::env::set_current_dir(cwd).unwrap();
        let synced = super::SYNCED_DIRS.with(|d| d.borrow_mut().split_off(0));
        assert_eq!(synced, [PathBuf::from("."), PathBuf::from("rel")]);
    }

    /// What the next operations on a [`FaultyFile`] do.
    #[derive(Default)]
    struct Faults {
        /// Bytes the file still takes before every write fails with ENOSPC (a short
        /// write first, as a real full disk does); `None`: no limit.
        write_budget: Option<usize>,
        /// fsyncs that fail with EIO before they succeed again.
        failing_syncs: u32,
        /// `set_len` fails with EIO.
        failing_set_len: bool,
    }

    /// A real file that fails on demand.
    struct FaultyFile {
        file: File,
        faults: Arc<Mutex<Faults>>,
    }

    fn os_error(code: i32) -> std::io::Error {
        std::io::Error::from_raw_os_error(code)
    }
    const ENOSPC: i32 = 28;
    const EIO: i32 = 5;

    impl Write for FaultyFile {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let mut faults = self.faults.lock().unwrap();
            match &mut faults.write_budget {
                None => self.file.write(buf),
                Some(0) => Err(os_error(ENOSPC)),
                Some(left) => {
                    let n = self.file.write(&buf[..buf.len().min(*left)])?;
                    *left -= n;
                    Ok(n)
                }
            }
        }

        fn flush(&mut self) -> std::io::Result<()> {
            self.file.flush()
        }
    }

    impl StoreFile for FaultyFile {
        fn sync_data(&self) -> std::io::Result<()> {
            let mut faults = self.faults.lock().unwrap();
            if faults.failing_syncs > 0 {
                faults.failing_syncs -= 1;
                return Err(os_error(EIO));
            }
            self.file.sync_data()
        }

        fn set_len(&self, len: u64) -> std::io::Result<()> {
            if self.faults.lock().unwrap().failing_set_len {
                return Err(os_error(EIO));
            }
            self.file.set_len(len)
        }

        fn seek_end(&mut self) -> std::io::Result<u64> {
            self.file.seek(SeekFrom::End(0))
        }
    }

    /// Opens the store of `dir` with its file access going through a [`FaultyFile`].
    fn open_faulty(dir: &Path) -> (TrajectoryStore, Arc<Mutex<Faults>>) {
        let faults = Arc::new(Mutex::new(Faults::default()));
        let f = faults.clone();
        let store = TrajectoryStore::open_inner(
            dir,
            StoreOptions::default(),
            |_, _| {},
            move |file| Box::new(FaultyFile { file, faults: f }),
        )
        .unwrap();
        (store, faults)
    }

    /// A turn whose record takes about `size` bytes.
    fn big_turn(ep: &str, i: u32, size: usize) -> EpisodeEvent {
        EpisodeEvent {
            episode_id: ep.into(),
            worker_id: "w".into(),
            event: Some(episode_event::Event::Turn(TurnRecord {
                turn_index: i,
                observation: "o".repeat(size),
                ..Default::default()
            })),
        }
    }

    fn keys(events: &[EpisodeEvent]) -> Vec<(String, u32)> {
        events.iter().map(|e| event_key(e).unwrap()).collect()
    }

    /// The keys of every record in the file, in file order (doubles included).
    fn stored_keys(dir: &Path) -> Vec<(String, u32)> {
        keys(&scan(&dir.join("events.log")).unwrap().0)
    }

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

    /// A full disk in the middle of a batch bigger than the write buffer: part of it
    /// reaches the file. It is cut off again, so the next batch is not stored behind a
    /// torn record (where a reopen would cut it, acknowledged), and the failed batch is
    /// stored when it is replayed.
    #[test]
    fn failed_write_mid_batch_loses_no_acknowledged_batch() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, faults) = open_faulty(dir.path());
        let batch1 = [turn("e1", 0), turn("e1", 1)];
        let batch2: Vec<_> = (0..4).map(|i| big_turn("e2", i, 100_000)).collect();
        let batch3 = [turn("e3", 0)];
        assert_eq!(s.append_batch(&batch1).unwrap(), vec![false, false]);
        faults.lock().unwrap().write_budget = Some(150_000);
        let err = s.append_batch(&batch2).unwrap_err();
        assert!(matches!(err, StoreError::Write { .. }), "{err}");
        faults.lock().unwrap().write_budget = None;
        assert_eq!(s.append_batch(&batch3).unwrap(), vec![false]);
        drop(s);

        let (s, events) =
            TrajectoryStore::open_recovering(dir.path(), StoreOptions::default()).unwrap();
        let want: Vec<_> = keys(&batch1).into_iter().chain(keys(&batch3)).collect();
        assert_eq!(keys(&events), want);
        assert_eq!(s.len(), 3);
        drop(s);

        // The workers replay batch 2: it is written, not acked as a duplicate.
        let (mut s, _) = open_faulty(dir.path());
        assert_eq!(s.append_batch(&batch2).unwrap(), vec![false; 4]);
        drop(s);
        let want: Vec<_> = want.into_iter().chain(keys(&batch2)).collect();
        assert_eq!(stored_keys(dir.path()), want);
    }

    /// A failed fsync: the batch's bytes are in the file but may not be durable. They
    /// are cut, the batch is not acknowledged, and its replay (in the same store) is
    /// written once, not acked as a duplicate nor stored twice.
    #[test]
    fn failed_fsync_is_rolled_back_and_the_replay_is_stored_once() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, faults) = open_faulty(dir.path());
        let batch1 = [turn("e1", 0)];
        let batch2 = [turn("e2", 0), turn("e2", 1)];
        let batch3 = [turn("e3", 0)];
        assert_eq!(s.append_batch(&batch1).unwrap(), vec![false]);
        faults.lock().unwrap().failing_syncs = 1;
        let err = s.append_batch(&batch2).unwrap_err();
        assert!(matches!(err, StoreError::Write { .. }), "{err}");
        assert_eq!(s.append_batch(&batch3).unwrap(), vec![false]);
        let want: Vec<_> = keys(&batch1).into_iter().chain(keys(&batch3)).collect();
        assert_eq!(stored_keys(dir.path()), want);

        assert_eq!(s.append_batch(&batch2).unwrap(), vec![false, false]);
        assert_eq!(s.append_batch(&batch2).unwrap(), vec![true, true]);
        assert_eq!(s.len(), 4);
        drop(s);
        let want: Vec<_> = want.into_iter().chain(keys(&batch2)).collect();
        assert_eq!(stored_keys(dir.path()), want);
        let (_, events) =
            TrajectoryStore::open_recovering(dir.path(), StoreOptions::default()).unwrap();
        assert_eq!(keys(&events), want);
    }

    /// When the rollback after a failed write fails too, the store refuses every later
    /// batch (even once the disk is fine again) with an error that names the file, the
    /// durable length and the way out.
    #[test]
    fn failed_rollback_poisons_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, faults) = open_faulty(dir.path());
        assert_eq!(s.append_batch(&[turn("e1", 0)]).unwrap(), vec![false]);
        let path = dir.path().join("events.log");
        let durable = std::fs::metadata(&path).unwrap().len();
        {
            let mut f = faults.lock().unwrap();
            f.failing_syncs = 1;
            f.failing_set_len = true;
        }
        let err = s.append_batch(&[turn("e2", 0)]).unwrap_err();
        match &err {
            StoreError::Poisoned {
                path: p,
                durable_len,
                ..
            } => {
                assert_eq!(p, &path);
                assert_eq!(*durable_len, durable);
            }
            e => panic!("not poisoned: {e}"),
        }
        let msg = err.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(
            msg.contains(&format!("truncate -s {durable} {}", path.display())),
            "{msg}"
        );
        *faults.lock().unwrap() = Faults::default();
        let later = s.append_batch(&[turn("e3", 0)]).unwrap_err();
        assert!(matches!(later, StoreError::Poisoned { .. }), "{later}");
        assert_eq!(s.len(), 1);
        drop(s);
        // What a restart recovers after `truncate -s durable`: the acknowledged batch.
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(durable)
            .unwrap();
        assert_eq!(stored_keys(dir.path()), keys(&[turn("e1", 0)]));
    }

    /// The writer thread of a poisoned store answers the batch with the error, refuses
    /// what is queued, and ends with the error: the coordinator sees the store stop.
    #[test]
    fn poisoned_writer_thread_ends_with_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let (s, faults) = open_faulty(dir.path());
        {
            let mut f = faults.lock().unwrap();
            f.write_budget = Some(3);
            f.failing_set_len = true;
        }
        let (tx, thread) = spawn_writer(s, Arc::new(EventCounters::default()));
        let (reply, stored) = oneshot::channel();
        tx.blocking_send(StoreRequest {
            event: turn("e1", 0),
            reply,
        })
        .unwrap();
        let answer = stored.blocking_recv().unwrap();
        assert!(
            matches!(answer.result, Err(StoreError::Poisoned { .. })),
            "the batch is answered with the poisoning"
        );
        let ended = thread.join().unwrap();
        assert!(matches!(ended, Err(StoreError::Poisoned { .. })));
        assert!(tx.is_closed(), "later events are refused");
    }

    /// Writes `events` as records, as the store does, to a fresh `dir/events.log`.
    fn write_log(dir: &Path, events: &[EpisodeEvent]) -> Vec<u64> {
        let mut buf = Vec::new();
        let mut offsets = Vec::new();
        for ev in events {
            offsets.push(buf.len() as u64);
            encode_record(&mut buf, ev);
        }
        std::fs::write(dir.join("events.log"), &buf).unwrap();
        offsets
    }

    fn flip_byte(path: &Path, at: u64) {
        let mut data = std::fs::read(path).unwrap();
        data[at as usize] ^= 0x5a;
        std::fs::write(path, data).unwrap();
    }

    /// A damaged record followed by intact ones is not a torn tail: cutting it would
    /// drop acknowledged events, so open refuses, naming the offset and the way out.
    #[test]
    fn corrupt_middle_record_is_refused_naming_the_offset() {
        let dir = tempfile::tempdir().unwrap();
        let offsets = write_log(dir.path(), &[turn("e1", 0), turn("e1", 1), turn("e1", 2)]);
        let path = dir.path().join("events.log");
        let len = std::fs::metadata(&path).unwrap().len();
        flip_byte(&path, offsets[1] + 10);
        let err = TrajectoryStore::open(dir.path()).err().expect("refused");
        match &err {
            StoreError::Corrupt {
                path: p,
                offset,
                next,
                after,
            } => {
                assert_eq!(p, &path);
                assert_eq!(*offset, offsets[1]);
                assert_eq!(*next, offsets[2]);
                assert_eq!(*after, len - offsets[1]);
            }
            e => panic!("not refused as corrupt: {e}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("truncate -s {} {}", offsets[1], path.display())),
            "{msg}"
        );
        assert!(matches!(scan(&path), Err(StoreError::Corrupt { .. })));
        // Nothing was cut.
        assert_eq!(std::fs::metadata(&path).unwrap().len(), len);
    }

    /// Damage in the last record is a torn tail: cut, as before.
    #[test]
    fn corrupt_last_record_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        let offsets = write_log(dir.path(), &[turn("e1", 0), turn("e1", 1), turn("e1", 2)]);
        let path = dir.path().join("events.log");
        flip_byte(&path, offsets[2] + 10);
        let (s, events) =
            TrajectoryStore::open_recovering(dir.path(), StoreOptions::default()).unwrap();
        assert_eq!(keys(&events), keys(&[turn("e1", 0), turn("e1", 1)]));
        assert_eq!(s.len(), 2);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), offsets[2]);
    }

    /// A crash can leave the file longer than what was written, the rest zeros; eight
    /// zero bytes would pass as an empty record (CRC of nothing is 0), but the store never
    /// writes an event without a key: the zeros are a torn tail.
    #[test]
    fn zero_filled_tail_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        write_log(dir.path(), &[turn("e1", 0)]);
        let path = dir.path().join("events.log");
        let len = std::fs::metadata(&path).unwrap().len();
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len + 4096)
            .unwrap();
        let (s, events) =
            TrajectoryStore::open_recovering(dir.path(), StoreOptions::default()).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(s.len(), 1);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), len);
    }

    /// A log that holds a key twice (older versions could write one) recovers it once,
    /// the first occurrence, and later copies are duplicates.
    #[test]
    fn doubled_keys_are_recovered_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut second = turn("e1", 0);
        second.worker_id = "w2".into();
        write_log(
            dir.path(),
            &[turn("e1", 0), turn("e1", 1), second, turn("e1", 2)],
        );
        let (mut s, events) =
            TrajectoryStore::open_recovering(dir.path(), StoreOptions::default()).unwrap();
        assert_eq!(
            keys(&events),
            keys(&[turn("e1", 0), turn("e1", 1), turn("e1", 2)])
        );
        assert_eq!(events[0].worker_id, "w", "the first occurrence is kept");
        assert_eq!(s.len(), 3);
        assert_eq!(
            s.append_batch(&[turn("e1", 0), turn("e1", 3)]).unwrap(),
            vec![true, false]
        );
    }

    /// Sets the length field of the record at `at` to `len`.
    fn set_record_len(path: &Path, at: u64, len: u32) {
        let mut data = std::fs::read(path).unwrap();
        data[at as usize..at as usize + 4].copy_from_slice(&len.to_le_bytes());
        std::fs::write(path, data).unwrap();
    }

    /// A header announcing 3 GiB, more than any record holds ([`MAX_RECORD_BYTES`]), is
    /// damage like any other (see `store_memory.rs` for the memory it takes: none of
    /// it): in the middle, with intact records after it, open refuses naming the
    /// offset; in the last record, it is a torn tail and is cut.
    #[test]
    fn a_header_announcing_gigabytes_is_damage() {
        let three_gib = 3u32 << 30;
        let dir = tempfile::tempdir().unwrap();
        let events = [turn("e1", 0), turn("e1", 1), turn("e1", 2)];
        let offsets = write_log(dir.path(), &events);
        let path = dir.path().join("events.log");
        let len = std::fs::metadata(&path).unwrap().len();
        set_record_len(&path, offsets[1], three_gib);
        match TrajectoryStore::open(dir.path()).err().expect("refused") {
            StoreError::Corrupt {
                offset,
                next,
                after,
                ..
            } => assert_eq!(
                (offset, next, after),
                (offsets[1], offsets[2], len - offsets[1])
            ),
            e => panic!("not refused as corrupt: {e}"),
        }
        assert_eq!(std::fs::metadata(&path).unwrap().len(), len, "nothing cut");

        let offsets = write_log(dir.path(), &events);
        set_record_len(&path, offsets[2], three_gib);
        let (s, recovered) =
            TrajectoryStore::open_recovering(dir.path(), StoreOptions::default()).unwrap();
        assert_eq!(keys(&recovered), keys(&events[..2]));
        assert_eq!(s.len(), 2);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), offsets[2]);
    }

    /// Many records of many sizes, some longer than the read chunk: the streaming scan
    /// finds each at its offset, in order, and a torn tail in the middle of a long
    /// record is cut at its start.
    #[test]
    fn streaming_scan_reads_every_record_at_its_offset() {
        let dir = tempfile::tempdir().unwrap();
        let events: Vec<_> = (0..300u32)
            .map(|i| big_turn(&format!("e{}", i % 7), i, (i as usize * 7919) % 150_000))
            .collect();
        let offsets = write_log(dir.path(), &events);
        let mut seen = Vec::new();
        let len = scan_with(&dir.path().join("events.log"), |at, ev| seen.push((at, ev))).unwrap();
        assert_eq!(
            len,
            std::fs::metadata(dir.path().join("events.log"))
                .unwrap()
                .len()
        );
        assert_eq!(seen.iter().map(|(at, _)| *at).collect::<Vec<_>>(), offsets);
        assert!(seen.iter().map(|(_, ev)| ev).eq(events.iter()));

        let path = dir.path().join("events.log");
        let last = *offsets.last().unwrap();
        let torn = last + 8 + 1000;
        assert!(torn < len, "the last record is long");
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(torn)
            .unwrap();
        let s = TrajectoryStore::open(dir.path()).unwrap();
        assert_eq!(s.len(), events.len() - 1);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), last);
    }

    /// `open_for_each` hands out each key once with its record's offset, and a
    /// `StoreReader` reads the same event back from there, in any order.
    #[test]
    fn stored_events_are_read_back_by_offset() {
        let dir = tempfile::tempdir().unwrap();
        let mut doubled = turn("e1", 0);
        doubled.worker_id = "w2".into();
        let events = [
            turn("e1", 0),
            big_turn("e2", 0, 200_000),
            doubled,
            turn("e1", 1),
        ];
        let offsets = write_log(dir.path(), &events);
        let mut handed = Vec::new();
        let s = TrajectoryStore::open_for_each(dir.path(), StoreOptions::default(), |at, ev| {
            handed.push((at, ev))
        })
        .unwrap();
        let want = [
            (offsets[0], &events[0]),
            (offsets[1], &events[1]),
            (offsets[3], &events[3]),
        ];
        assert_eq!(handed.len(), 3);
        for ((at, ev), (want_at, want_ev)) in handed.iter().zip(want) {
            assert_eq!((*at, ev), (want_at, want_ev));
        }
        let mut reader = StoreReader::open(s.path()).unwrap();
        for (at, ev) in handed.iter().rev().chain(&handed) {
            assert_eq!(&reader.read_at(*at).unwrap(), ev);
        }

        // The file changed under the store: the record is not there any more.
        flip_byte(s.path(), offsets[3] + 12);
        let mut reader = StoreReader::open(s.path()).unwrap();
        let err = reader.read_at(offsets[3]).unwrap_err();
        assert!(
            matches!(err, StoreError::Changed { offset, .. } if offset == offsets[3]),
            "{err}"
        );
        assert!(
            err.to_string().contains(&s.path().display().to_string()),
            "{err}"
        );
    }
}
