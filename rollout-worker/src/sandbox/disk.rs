//! The local sandbox's disk quota (`[worker] disk_mb` and `tmp_mb`, as Docker's tmpfs
//! caps): without root there is no file system quota, so the sandbox measures what its
//! writable directories hold (bytes on disk, blocks included, and entries) and stops a
//! command that grows them past the sandbox's size at creation plus the quota.
//!
//! - While a command runs, a watchdog measures every [`POLL`] and kills the command's
//!   processes once the directories are over the limit and larger than when it started
//!   (so a command that only deletes always runs).
//! - After it, the same check: a command that went over in less than a poll has the
//!   files it wrote removed (regular files modified since it started), as a write past a
//!   Docker sandbox's tmpfs fails. So what stays is bounded by the limit.
//! - More than [`MAX_ENTRIES`] entries counts as over (inodes; and a walk stays short).
//!
//! Unreadable directories (a command's `chmod 000`) are made readable to be measured: a
//! command cannot hide bytes from the count.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::process::Stop;

/// How often the watchdog measures a running command's directories.
pub(crate) const POLL: Duration = Duration::from_millis(100);

/// Entries (files, directories, links) the writable directories may hold.
pub(crate) const MAX_ENTRIES: u64 = 200_000;

/// What directories hold: bytes on disk and entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Usage {
    pub(crate) bytes: u64,
    pub(crate) entries: u64,
}

impl Usage {
    /// Over `limit` bytes (or entries), and grown since `start`.
    fn over(&self, limit: u64, start: &Usage) -> bool {
        (self.bytes > limit && self.bytes > start.bytes)
            || (self.entries > MAX_ENTRIES && self.entries > start.entries)
    }
}

/// Bytes on disk (allocated blocks: a sparse file counts what it takes) and entries under
/// `dirs`, links not followed. Stops counting past `MAX_ENTRIES + 1` entries.
pub(crate) fn usage(dirs: &[PathBuf]) -> Usage {
    use std::os::unix::fs::MetadataExt;
    let mut u = Usage::default();
    let mut stack: Vec<PathBuf> = dirs.to_vec();
    while let Some(dir) = stack.pop() {
        let Some(entries) = read_dir_anyway(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            u.entries += 1;
            if u.entries > MAX_ENTRIES {
                return u;
            }
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            u.bytes += meta.blocks() * 512;
            if meta.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    u
}

/// `dir`'s entries; one a command made unreadable is given back its owner's rights
/// (read, write, search) first.
fn read_dir_anyway(dir: &Path) -> Option<std::fs::ReadDir> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::read_dir(dir) {
        Ok(e) => Some(e),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            let mode = std::fs::symlink_metadata(dir).ok()?.permissions().mode();
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o700));
            std::fs::read_dir(dir).ok()
        }
        Err(_) => None,
    }
}

/// A watchdog measuring `dirs` while a command runs; sets `stop` with the reason once
/// they are over `limit` bytes and grown since the command started.
pub(crate) struct DiskWatch {
    dirs: Vec<PathBuf>,
    limit: u64,
    start: Usage,
    started: SystemTime,
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub(crate) stop: Stop,
}

impl DiskWatch {
    pub(crate) fn start(dirs: Vec<PathBuf>, limit: u64) -> Self {
        let start = usage(&dirs);
        let started = SystemTime::now();
        let done = Arc::new(AtomicBool::new(false));
        let stop = Stop::default();
        let thread = {
            let (dirs, done, stop) = (dirs.clone(), done.clone(), stop.clone());
            std::thread::Builder::new()
                .name("sandbox-disk".into())
                .spawn(move || {
                    while !done.load(Ordering::SeqCst) {
                        std::thread::sleep(POLL);
                        let now = usage(&dirs);
                        if now.over(limit, &start) {
                            stop.set(quota_message(limit, &now));
                            return;
                        }
                    }
                })
                .ok()
        };
        DiskWatch {
            dirs,
            limit,
            start,
            started,
            done,
            thread,
            stop,
        }
    }

    /// After the command: stops the watchdog and checks once more. Over the limit (and
    /// grown), the files the command wrote are removed; the reason, if any, for the
    /// command's output.
    pub(crate) fn finish(mut self) -> Option<String> {
        self.done.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let now = usage(&self.dirs);
        let stopped = self.stop.reason();
        if !now.over(self.limit, &self.start) {
            return stopped;
        }
        let removed = remove_written_since(&self.dirs, self.started);
        let after = usage(&self.dirs);
        tracing::warn!(
            bytes = now.bytes,
            entries = now.entries,
            limit = self.limit,
            removed,
            after = after.bytes,
            "a command took its sandbox over the disk quota: the files it wrote are removed"
        );
        Some(format!(
            "{}; the {removed} files the command wrote were removed",
            stopped.unwrap_or_else(|| quota_message(self.limit, &now))
        ))
    }
}

impl Drop for DiskWatch {
    fn drop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
    }
}

fn quota_message(limit: u64, now: &Usage) -> String {
    if now.entries > MAX_ENTRIES {
        format!("disk quota exceeded: more than {MAX_ENTRIES} files in the sandbox")
    } else {
        format!(
            "disk quota exceeded: the sandbox's files take {} MiB, over the {} MiB allowed",
            now.bytes >> 20,
            limit >> 20
        )
    }
}

/// Removes the regular files (and links) under `dirs` modified at or after `since`;
/// how many.
fn remove_written_since(dirs: &[PathBuf], since: SystemTime) -> u64 {
    let mut removed = 0;
    let mut stack: Vec<PathBuf> = dirs.to_vec();
    while let Some(dir) = stack.pop() {
        let Some(entries) = read_dir_anyway(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(meta) = path.symlink_metadata() else {
                continue;
            };
            if meta.is_dir() {
                stack.push(path);
            } else if meta.modified().is_ok_and(|m| m >= since)
                && std::fs::remove_file(&path).is_ok()
            {
                removed += 1;
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Usage counts blocks on disk (a sparse file its few blocks), every entry, and
    /// directories a command made unreadable.
    #[test]
    fn usage_counts_blocks_entries_and_unreadable_directories() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        std::fs::write(d.join("a"), vec![1u8; 1 << 20]).unwrap();
        let sparse = std::fs::File::create(d.join("sparse")).unwrap();
        sparse.set_len(1 << 30).unwrap();
        std::fs::create_dir(d.join("hidden")).unwrap();
        std::fs::write(d.join("hidden/b"), vec![2u8; 2 << 20]).unwrap();
        std::fs::set_permissions(d.join("hidden"), std::fs::Permissions::from_mode(0o000)).unwrap();
        let u = usage(std::slice::from_ref(&d));
        assert_eq!(u.entries, 4);
        assert!(u.bytes >= 3 << 20, "{u:?}");
        assert!(
            u.bytes < 4 << 20,
            "a sparse file counted by its length: {u:?}"
        );
    }
}
