//! Raw process control for the local sandbox: process groups, deadlines, capped output.
//!
//! A command runs as the leader of a process group of its own, with a deadline and a
//! head+tail output cap, and the whole group is killed when its shell exits; a /proc scan
//! finds the processes that left the group on purpose.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::sandbox::{CommandOutput, TIMEOUT_EXIT_CODE};

/// Output read in one pass of the wait loop, at most (then the deadline is checked).
const READ_PER_PASS: usize = 1 << 20;

/// The exit status of a command killed at its memory ceiling: a SIGKILL's, as the kernel's
/// out-of-memory killer (and Docker's memory limit) gives.
pub(crate) const MEMORY_EXIT_CODE: i32 = 128 + libc::SIGKILL;

/// How long output is still collected after the shell exited, for stray writers.
const DRAIN_GRACE: Duration = Duration::from_millis(300);

/// Inodes kept free on a sandbox's file system whenever its disk floor is on: millions of
/// empty files exhaust a file system's inodes long before its blocks.
pub(crate) const MIN_FREE_INODES: u64 = 65_536;

/// A floor under the free space of the file system holding a sandbox
/// ([`crate::sandbox::Limits::min_free_disk_bytes`]), read through a descriptor of the
/// sandbox's directory opened when the sandbox was made: renaming or replacing the
/// directory does not move the check elsewhere.
#[derive(Debug)]
pub(crate) struct DiskFloor {
    dir: OwnedFd,
    bytes: u64,
}

impl DiskFloor {
    pub(crate) fn open(dir: &Path, bytes: u64) -> std::io::Result<Self> {
        let dir = std::fs::File::open(dir)?;
        Ok(DiskFloor {
            dir: OwnedFd::from(dir),
            bytes,
        })
    }

    /// (bytes, inodes) available to unprivileged users on the file system (`fstatvfs`:
    /// `f_bavail × f_frsize`, so blocks reserved for root do not count, and ext4, XFS and
    /// tmpfs count data written but not yet allocated as used; `f_favail`, `None` where
    /// the file system has no inode count).
    pub(crate) fn available(&self) -> std::io::Result<(u64, Option<u64>)> {
        // SAFETY: a zeroed statvfs is a valid out-parameter; the descriptor is ours.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstatvfs(self.dir.as_raw_fd(), &mut st) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let bytes = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
        let inodes = (st.f_files > 0).then_some(st.f_favail as u64);
        Ok((bytes, inodes))
    }

    /// What is under the floor, said for a person (`None`: nothing). A file system whose
    /// free space cannot be read counts as under it.
    pub(crate) fn crossed(&self) -> Option<String> {
        match self.available() {
            Ok((bytes, _)) if bytes < self.bytes => Some(format!(
                "{} MiB free, under the worker's floor of {} MiB ([worker] min_free_disk_mb)",
                bytes >> 20,
                self.bytes >> 20
            )),
            Ok((_, Some(inodes))) if inodes < MIN_FREE_INODES => Some(format!(
                "{inodes} inodes free, under the {MIN_FREE_INODES} the worker keeps \
                 ([worker] min_free_disk_mb is on)"
            )),
            Ok(_) => None,
            Err(e) => Some(format!(
                "free space unreadable ({e}); counted as under the floor"
            )),
        }
    }
}

/// The memory a command's processes hold together, at most
/// ([`crate::sandbox::Limits::memory_bytes`]): read from /proc every
/// [`crate::sandbox::confine::MEMORY_CHECK_EVERY`] while the command runs. Counted:
/// each process's proportional share (PSS) of anonymous and shared memory and of its
/// swap, so pages a fork shares with its parent count once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MemoryCeiling {
    pub(crate) bytes: u64,
}

impl MemoryCeiling {
    /// Bytes the processes of the tree under `root` hold (see the type; plus the memfds
    /// they hold open, each counted once), and their pids. The tree is read from every
    /// process's parent in /proc (a snapshot shared by the worker's commands, at most
    /// [`crate::sandbox::confine::MEMORY_CHECK_EVERY`] old): confined, a process whose
    /// parent ends is adopted by the pid namespace's first process, which is in the tree,
    /// so none leaves it.
    pub(crate) fn held(root: libc::pid_t) -> (u64, Vec<libc::pid_t>) {
        let tree = process_tree(root, &children_snapshot());
        let mut memfds = std::collections::HashSet::new();
        let bytes = tree
            .iter()
            .map(|&pid| process_memory(pid) + memfd_bytes(pid, &mut memfds))
            .sum();
        (bytes, tree)
    }
}

/// Every process's children, from a scan of /proc: one scan serves every command of the
/// worker for [`crate::sandbox::confine::MEMORY_CHECK_EVERY`], however many run.
fn children_snapshot() -> std::sync::Arc<Children> {
    static SNAPSHOT: std::sync::Mutex<Option<(Instant, std::sync::Arc<Children>)>> =
        std::sync::Mutex::new(None);
    let mut held = SNAPSHOT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((at, map)) = held.as_ref() {
        if at.elapsed() < crate::sandbox::confine::MEMORY_CHECK_EVERY {
            return map.clone();
        }
    }
    let mut children = Children::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            if let Some(parent) = parent_of(pid) {
                children.entry(parent).or_default().push(pid);
            }
        }
    }
    let map = std::sync::Arc::new(children);
    *held = Some((Instant::now(), map.clone()));
    map
}

type Children = std::collections::HashMap<libc::pid_t, Vec<libc::pid_t>>;

/// `root` and its descendants in `children`.
fn process_tree(root: libc::pid_t, children: &Children) -> Vec<libc::pid_t> {
    let mut tree = vec![root];
    let mut at = 0;
    while at < tree.len() {
        if let Some(kids) = children.get(&tree[at]) {
            tree.extend(kids);
        }
        at += 1;
    }
    tree
}

/// Bytes of the memfds `pid` holds open that are not in `seen` yet (by inode): memory
/// in a file no mapping may show.
fn memfd_bytes(pid: libc::pid_t, seen: &mut std::collections::HashSet<(u64, u64)>) -> u64 {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    let mut bytes = 0;
    for fd in fds.flatten() {
        let path = fd.path();
        if !std::fs::read_link(&path)
            .is_ok_and(|t| t.as_os_str().as_encoded_bytes().starts_with(b"/memfd:"))
        {
            continue;
        }
        if let Ok(m) = std::fs::metadata(&path) {
            use std::os::unix::fs::MetadataExt;
            if seen.insert((m.dev(), m.ino())) {
                bytes += m.blocks() * 512;
            }
        }
    }
    bytes
}

/// The parent pid of `pid` (field 4 of /proc/PID/stat, after the command name, which is
/// in parentheses and may contain anything).
fn parent_of(pid: libc::pid_t) -> Option<libc::pid_t> {
    stat_after_name(Path::new(&format!("/proc/{pid}")))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// `proc_dir/stat` from after the command name (which is in parentheses and may contain
/// anything): the state first, then the parent pid, ….
fn stat_after_name(proc_dir: &Path) -> Option<String> {
    let mut stat = std::fs::read_to_string(proc_dir.join("stat")).ok()?;
    let name_end = stat.rfind(')')?;
    Some(stat.split_off(name_end + 1))
}

/// Bytes of memory `pid` holds for the ceiling: its PSS of anonymous and shared memory
/// and of swap (`Pss_Anon`, `Pss_Shmem`, `SwapPss` of smaps_rollup; where the kernel
/// has no `Pss_Anon`, before Linux 5.0, its whole `Pss`). 0 once it is gone.
fn process_memory(pid: libc::pid_t) -> u64 {
    let Ok(rollup) = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) else {
        return 0;
    };
    let field = |name: &str| -> Option<u64> {
        rollup.lines().find_map(|l| {
            let v = l.strip_prefix(name)?.strip_prefix(':')?;
            v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()
        })
    };
    let kib = match field("Pss_Anon") {
        Some(anon) => anon + field("Pss_Shmem").unwrap_or(0),
        None => field("Pss").unwrap_or(0),
    } + field("SwapPss").unwrap_or(0);
    kib << 10
}

/// A command's file system under its [`DiskFloor`].
#[derive(Debug)]
pub(crate) struct DiskLow {
    /// What is under the floor ([`DiskFloor::crossed`]).
    pub what: String,
    /// Seen while the command ran (it was killed), not only once it had ended.
    pub while_running: bool,
}

/// How a command is kept apart from the worker's session and ended with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isolation {
    /// Here, between fork and exec: the child becomes a session leader (`setsid`) and
    /// gets `SIGKILL` when the worker dies (`PR_SET_PDEATHSIG`). That needs a real fork
    /// of the worker, which copies its page tables: for commands that cannot do it
    /// themselves (the unconfined shell).
    Here,
    /// By the command itself (bwrap's `--new-session --die-with-parent`, whose PID
    /// namespace ends with it): the child only leads a process group of its own, which
    /// std starts with posix_spawn (vfork) instead of a fork.
    ByCommand,
}

/// Runs `cmd` (stdio is set here: no stdin, stdout and stderr into one capped pipe) as a
/// process-group leader (and, with [`Isolation::Here`], a session leader). Returns once the
/// leader exited and the output is drained (at most [`DRAIN_GRACE`] after, for stray
/// writers), or, at `timeout`, kills the whole group and reports [`TIMEOUT_EXIT_CODE`].
/// Background jobs die with the leader. With a `disk` floor, the group is also killed
/// when the file system falls under it (checked every
/// [`crate::sandbox::confine::DISK_CHECK_EVERY`] while the command runs, and once more
/// when it ended); the second value then says what is under it, and when it was seen.
/// With a `memory` ceiling, the command's processes are killed when they hold more than
/// it together; it then ends with exit status 137 and its output says why.
pub(crate) fn run_in_own_group(
    mut cmd: Command,
    timeout: Duration,
    output_cap: usize,
    isolation: Isolation,
    disk: Option<&DiskFloor>,
    memory: Option<MemoryCeiling>,
) -> std::io::Result<(CommandOutput, Option<DiskLow>)> {
    let (read_end, write_end) = make_pipe()?;
    let write_file = File::from(write_end);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(write_file.try_clone()?))
        .stderr(Stdio::from(write_file));
    match isolation {
        // SAFETY: setsid and prctl are async-signal-safe; setsid makes the child a session
        // and process group leader, so the whole tree can be killed with one kill(-pgid).
        Isolation::Here => unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                // If the worker dies (even by SIGKILL) the command's shell dies with it.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        },
        Isolation::ByCommand => {
            cmd.process_group(0);
        }
    }
    let mut child = cmd.spawn()?;
    // Close our copies of the write end, or we would never see EOF.
    drop(cmd);
    let pgid = child.id() as libc::pid_t;

    let mut reader = File::from(read_end);
    let mut captured = Capture::new(output_cap);
    let mut buf = vec![0u8; 64 * 1024];
    let deadline = Instant::now() + timeout;
    let mut eof = false;
    let mut timed_out = false;
    let mut status: Option<std::process::ExitStatus> = None;
    let mut drain_until: Option<Instant> = None;
    let mut disk_low: Option<DiskLow> = None;
    let mut disk_checked = Instant::now();
    let mut memory_checked = Instant::now();
    // Bytes the command's processes held when they were killed for it.
    let mut memory_over: Option<u64> = None;
    loop {
        if !eof {
            let mut pfd = libc::pollfd {
                fd: reader.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pfd, 1, 20) };
            // At most this much per pass: a command that floods its output must not keep
            // the deadline and the disk floor from being checked.
            let mut budget = READ_PER_PASS;
            while budget > 0 {
                match reader.read(&mut buf) {
                    Ok(0) => {
                        eof = true;
                        break;
                    }
                    Ok(n) => {
                        captured.push(&buf[..n]);
                        budget = budget.saturating_sub(n);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        eof = true;
                        break;
                    }
                }
            }
        } else {
            std::thread::sleep(Duration::from_millis(5));
        }
        if status.is_none() {
            if leader_exited(pgid) {
                // The leader is a zombie until reaped, so the pgid cannot be reused yet:
                // kill the rest of the group (background jobs), then reap.
                kill_group(pgid);
                status = Some(child.wait()?);
                drain_until = Some(Instant::now() + DRAIN_GRACE);
            } else if Instant::now() >= deadline && !timed_out {
                timed_out = true;
                kill_group(pgid);
            } else {
                let memory_due = memory_over.is_none()
                    && memory_checked.elapsed() >= crate::sandbox::confine::MEMORY_CHECK_EVERY;
                if let Some(ceiling) = memory.filter(|_| memory_due) {
                    memory_checked = Instant::now();
                    let (held, tree) = MemoryCeiling::held(pgid);
                    if held > ceiling.bytes {
                        memory_over = Some(held);
                        // Unconfined, a process may have left the group: each one of the
                        // tree too (pids just seen). Confined, the pid namespace ends with
                        // the group's bwrap.
                        if isolation == Isolation::Here {
                            for pid in tree {
                                // SAFETY: plain syscall on a pid just seen; ESRCH is fine.
                                unsafe { libc::kill(pid, libc::SIGKILL) };
                            }
                        }
                        kill_group(pgid);
                    }
                }
                let disk_due = disk_low.is_none()
                    && disk_checked.elapsed() >= crate::sandbox::confine::DISK_CHECK_EVERY;
                if let Some(floor) = disk.filter(|_| disk_due) {
                    disk_checked = Instant::now();
                    if let Some(what) = floor.crossed() {
                        disk_low = Some(DiskLow {
                            what,
                            while_running: true,
                        });
                        kill_group(pgid);
                    }
                }
            }
        }
        if status.is_some() && (eof || drain_until.is_some_and(|d| Instant::now() >= d)) {
            break;
        }
    }

    // What the last check could not see: a command that ended within a check's interval.
    if let Some(floor) = disk.filter(|_| disk_low.is_none()) {
        disk_low = floor.crossed().map(|what| DiskLow {
            what,
            while_running: false,
        });
    }
    let mut output = captured.finish();
    if let (Some(held), Some(ceiling)) = (memory_over, memory) {
        output.push_str(&format!(
            "\n[killed: this command's processes held {} MiB of memory together, over the \
             sandbox's {} MiB ([worker] memory_mb)]\n",
            held >> 20,
            ceiling.bytes >> 20
        ));
    }
    let exit_code = if timed_out {
        TIMEOUT_EXIT_CODE
    } else if memory_over.is_some() {
        MEMORY_EXIT_CODE
    } else {
        let st = status.expect("loop exits only after reaping");
        st.code().unwrap_or_else(|| {
            use std::os::unix::process::ExitStatusExt;
            128 + st.signal().unwrap_or(0)
        })
    };
    Ok((
        CommandOutput {
            output,
            exit_code,
            timed_out,
        },
        disk_low,
    ))
}

/// Creates a pipe; the read end is non-blocking, both are close-on-exec (the child gets
/// dup2'ed copies).
fn make_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: fds is a valid 2-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two fresh descriptors we now own.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: fcntl on a valid fd.
    unsafe {
        let flags = libc::fcntl(r.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(r.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
    Ok((r, w))
}

/// Has `pid` exited? Checks without reaping (WNOWAIT), so the pid stays reserved.
fn leader_exited(pid: libc::pid_t) -> bool {
    // SAFETY: zeroed siginfo_t is a valid out-parameter.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer; WNOHANG makes this non-blocking.
    let r = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    // SAFETY: si_pid is valid to read after waitid fills the struct (0 if nothing exited).
    r == 0 && unsafe { info.si_pid() } == pid
}

/// SIGKILL to process group `pgid` (nothing for 0 or 1).
pub(crate) fn kill_group(pgid: libc::pid_t) {
    if pgid > 1 {
        // SAFETY: plain syscall; ESRCH (group already gone) is fine.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
}

/// Head+tail capped byte capture: keeps the first and last halves of the cap and counts
/// what was dropped in between, so a 100 MB print costs bounded memory and the end of a
/// log (e.g. pytest's summary) survives.
struct Capture {
    head_cap: usize,
    tail_cap: usize,
    head: Vec<u8>,
    tail: VecDeque<u8>,
    dropped: u64,
}

impl Capture {
    fn new(cap: usize) -> Self {
        let head_cap = cap / 2;
        Capture {
            head_cap,
            tail_cap: cap - head_cap,
            head: Vec::new(),
            tail: VecDeque::new(),
            dropped: 0,
        }
    }

    fn push(&mut self, mut data: &[u8]) {
        let take = (self.head_cap - self.head.len()).min(data.len());
        self.head.extend_from_slice(&data[..take]);
        data = &data[take..];
        if data.is_empty() {
            return;
        }
        if data.len() >= self.tail_cap {
            self.dropped += (self.tail.len() + data.len() - self.tail_cap) as u64;
            self.tail.clear();
            self.tail.extend(&data[data.len() - self.tail_cap..]);
        } else {
            self.tail.extend(data);
            let over = self.tail.len().saturating_sub(self.tail_cap);
            if over > 0 {
                self.tail.drain(..over);
                self.dropped += over as u64;
            }
        }
    }

    fn finish(self) -> String {
        let tail: Vec<u8> = self.tail.into_iter().collect();
        if self.dropped == 0 {
            let mut all = self.head;
            all.extend_from_slice(&tail);
            return String::from_utf8_lossy(&all).into_owned();
        }
        let (head, tail, cut) = super::cut_at_chars(&self.head, &tail);
        format!(
            "{head}\n<... {} bytes of output dropped ...>\n{tail}",
            self.dropped + cut as u64,
        )
    }
}

/// Kills processes (other than this one) whose environment carries `tag`: the ones that
/// escaped their command's process group. Linux only (reads /proc); best effort.
///
/// One scan of /proc is not enough. A process caught in the middle of `execve` shows an
/// empty environment for a moment, and a process may fork while the scan runs; either
/// would escape a single pass. So this scans again, with a growing pause, while the
/// previous pass killed something or met a live process with an empty environment that
/// has not yet been seen empty four times (one started with `env -i` stays empty and is
/// then left alone); at least twice, for at most about a second.
pub(crate) fn kill_tagged(tag: &str) {
    const MIN_PASSES: usize = 2;
    const EMPTY_SIGHTINGS: u32 = 4;
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut empty_seen: std::collections::HashMap<u32, u32> = Default::default();
    let mut pause = Duration::from_millis(5);
    for pass in 1.. {
        let (killed, empty) = kill_tagged_once(tag);
        let mut unsure = false;
        for pid in empty {
            let n = empty_seen.entry(pid).or_insert(0);
            *n += 1;
            unsure |= *n < EMPTY_SIGHTINGS;
        }
        let again = killed > 0 || unsure || pass < MIN_PASSES;
        if !again || Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// One pass of [`kill_tagged`]: how many processes it killed, and the live processes whose
/// environment read back empty and so could not be checked.
fn kill_tagged_once(tag: &str) -> (usize, Vec<u32>) {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return (0, Vec::new());
    };
    let me = std::process::id();
    let needle = tag.as_bytes();
    let (mut killed, mut empty) = (0, Vec::new());
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        // Unreadable for other users' processes, which cannot be ours anyway.
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        if env.is_empty() {
            if live_user_process(&e.path()) {
                empty.push(pid);
            }
            continue;
        }
        if env.split(|&b| b == 0).any(|kv| kv == needle) {
            // SAFETY: plain syscall on a pid we just saw; ESRCH is fine.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            killed += 1;
        }
    }
    (killed, empty)
}

/// Whether /proc/PID describes a running user process: not a zombie, not a kernel thread
/// (kernel threads and zombies have an empty environment for good).
fn live_user_process(proc_dir: &Path) -> bool {
    const PF_KTHREAD: u64 = 0x0020_0000;
    let Some(rest) = stat_after_name(proc_dir) else {
        return false;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first().copied().unwrap_or("Z");
    let flags: u64 = fields
        .get(6)
        .and_then(|f| f.parse().ok())
        .unwrap_or(PF_KTHREAD);
    !matches!(state, "Z" | "X" | "x") && flags & PF_KTHREAD == 0
}

#[cfg(test)]
mod capture_tests {
    use super::Capture;

    /// A cap counts bytes; the kept head and tail are cut at whole characters, so no
    /// half of a character shows up as U+FFFD beside the gap, and the count of bytes
    /// dropped includes the halves cut.
    #[test]
    fn a_capped_capture_cuts_at_whole_characters() {
        // "é" is two bytes: a cap of 10 keeps the first 5 and the last 5 of 80, so both
        // cuts fall mid-character.
        let text = "é".repeat(40);
        let mut c = Capture::new(10);
        c.push(text.as_bytes());
        let out = c.finish();
        assert!(!out.contains('\u{fffd}'), "{out:?}");
        assert_eq!(out, "éé\n<... 72 bytes of output dropped ...>\néé");
        // Output that fits, or that is not UTF-8 at all, is shown as before.
        let mut c = Capture::new(100);
        c.push(&[b'a', 0xff, b'b']);
        assert_eq!(c.finish(), "a\u{fffd}b");
    }
}
