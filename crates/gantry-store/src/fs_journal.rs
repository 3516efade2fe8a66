//! The small-blob journal of [`FsStore`](crate::FsStore): how a small write is made
//! durable by one sync shared with every write in flight, instead of an fsync of its own
//! file and of its directory.
//!
//! Why: on the disks gantry runs on, an fsync costs milliseconds whatever its size, so a
//! build's thousands of 4 KiB uploads were bound by sync latency, not by bandwidth.
//!
//! How a journaled write goes: the store hands the blob to the journal's writer thread,
//! which takes every blob handed over since its last round and appends each one's digest
//! and bytes to this process's current segment; then one `fdatasync` makes the round
//! durable and every write in it is acknowledged.
//!
//! Files are put in place after the acknowledgement, by the placer thread (through the
//! store's [`BlobFiles`], with no sync). Why: creating a file costs the filesystem an inode
//! and a directory entry, tens of microseconds that swing to hundreds while writeback
//! holds the metadata blocks; done before the acknowledgement it bounded every batch
//! upload by the file rate, not by the sync. Until its file is in place a blob is served
//! from memory ([`Journal::unplaced`]), so this process sees its writes at once. The
//! placer leaves a burst of writes alone until it pauses or has half filled the budget
//! below (see `placer_pause`), and runs at a lower CPU priority. At most
//! [`UNPLACED_MAX`] bytes wait for the placer; past that, and always while another
//! process uses the directory (it can see only files, see [`DirUsers`]), a round puts
//! its files in place before it is acknowledged, as the placer would.
//!
//! A segment past [`SEGMENT_BYTES`] is sealed and a new one started. A background thread
//! retires sealed segments: one `syncfs(2)` of the CAS filesystem, begun once every file
//! they cover is in place, makes those files durable, and the segments are deleted.
//! Appends wait while too many sealed segments are still waiting, which bounds what a
//! crash leaves to replay.
//!
//! Each process holds an `flock` on its own segments, so processes sharing a CAS
//! directory never take each other's. After a crash, [`claim_orphans`] finds the segments
//! whose owner is gone; `FsStore::open` writes every whole, digest-verified record back
//! as a file. A record torn by the crash ends its segment: appends are sequential, so
//! nothing acknowledged follows it.

use std::collections::VecDeque;
use std::fs::{self, File};
use std::io::{BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gantry_core::{Digest, DigestFunction, Error, Result, ResultExt};

/// A segment is sealed once it holds this much. Together with [`MAX_SEALED`] it bounds
/// what a crash leaves to replay (and to re-hash) at the next start.
pub(crate) const SEGMENT_BYTES: u64 = 64 << 20;
/// Sealed segments that may wait for their checkpoint before appends wait for them.
const MAX_SEALED: usize = 4;
/// The largest blob the journal takes (FsStore journals only writes it buffered).
pub(crate) const MAX_RECORD_DATA: u64 = 1 << 20;
/// Acknowledged bytes that may wait in memory for the placer (see the module doc).
pub(crate) const UNPLACED_MAX: u64 = 128 << 20;
/// The placer starts once writes have paused this long... Long enough to tell the end of
/// a build from the pauses inside it: with 10 ms, a Bazel build's gaps between actions let
/// the placer in, and its file creation took the CPU the build's next actions wanted
/// (gantry's CPU per action of a 600-genrule build fell by a quarter at 500 ms).
const QUIET: Duration = Duration::from_millis(500);
/// ...or once this much waits for it, so that a long burst does not reach
/// [`UNPLACED_MAX`] before the placer has begun.
const PLACE_DURING_BURST: u64 = UNPLACED_MAX / 2;
/// Rounds defer their files only while the disk has this much free: room for every
/// unplaced blob's file many times over.
const DEFER_MIN_FREE: u64 = 4 * UNPLACED_MAX;
/// The file whose presence says that more than one process uses the directory.
const SHARED_MARKER: &str = "shared";
/// Between the wall clock that names a segment and the filesystem's timestamps.
pub(crate) const CLOCK_SLACK: Duration = Duration::from_secs(2);

const RECORD_MAGIC: [u8; 4] = *b"GJR1";
/// magic (4), digest function (1), reserved (3), size (8, LE), hash (32).
const HEADER: usize = 48;
const SUFFIX: &str = ".journal";

/// How long the placer should still leave a burst of writes alone, if at all: while
/// rounds keep coming it would take the CPU and the filesystem from the requests (on a
/// 2-core machine, a sixth of a 20,000-blob upload's rate), and the bytes wait in memory
/// either way. Not once a long burst has half filled the budget, nor when closing.
fn placer_pause(unplaced_bytes: u64, since_last_round: Duration, closing: bool) -> Option<Duration> {
    (!closing && unplaced_bytes < PLACE_DURING_BURST && since_last_round < QUIET).then(|| QUIET - since_last_round)
}

/// Appends `d` and its bytes to `out` as one record.
fn encode(out: &mut Vec<u8>, d: &Digest, data: &[u8]) {
    out.extend_from_slice(&RECORD_MAGIC);
    let function = DigestFunction::ALL.iter().position(|f| *f == d.function).expect("known function") as u8;
    out.extend_from_slice(&[function, 0, 0, 0]);
    out.extend_from_slice(&d.size.to_le_bytes());
    out.extend_from_slice(&d.hash);
    out.extend_from_slice(data);
}

/// Reads the next record: None at the end of the segment or at a record that is not
/// whole and true to its digest (a crash tore it; nothing acknowledged follows it). An
/// I/O error is an error: the segment must not be retired over what it could not read.
fn decode(r: &mut impl Read) -> std::io::Result<Option<(Digest, Vec<u8>)>> {
    let short = |e: std::io::Error| if e.kind() == std::io::ErrorKind::UnexpectedEof { Ok(None) } else { Err(e) };
    let mut h = [0u8; HEADER];
    if let Err(e) = r.read_exact(&mut h) {
        return short(e);
    }
    let Some(&function) = DigestFunction::ALL.get(h[4] as usize) else { return Ok(None) };
    let size = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    // Bounded before the allocation: a torn header may claim anything.
    if h[..4] != RECORD_MAGIC || size > MAX_RECORD_DATA {
        return Ok(None);
    }
    let mut data = vec![0u8; size as usize];
    if let Err(e) = r.read_exact(&mut data) {
        return short(e);
    }
    let d = function.digest_of(&data);
    Ok((d.hash[..] == h[16..48]).then_some((d, data)))
}

fn segment_name(created: SystemTime, seq: u64) -> String {
    let nanos = created.duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos();
    format!("{nanos:020}-{}-{seq}{SUFFIX}", std::process::id())
}

/// When a segment was started, from its name.
fn segment_created(path: &Path) -> Option<SystemTime> {
    let name = path.file_name()?.to_str()?.strip_suffix(SUFFIX)?;
    let nanos: u64 = name.split('-').next()?.parse().ok()?;
    Some(UNIX_EPOCH + Duration::from_nanos(nanos))
}

/// Makes everything written to the filesystem holding `fd` durable.
pub(crate) fn syncfs(fd: &File) -> std::io::Result<()> {
    // SAFETY: syncfs only reads the descriptor, which `fd` keeps open.
    if unsafe { libc::syncfs(fd.as_raw_fd()) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Bytes an unprivileged writer may still use on the filesystem of `fd`.
pub(crate) fn free_bytes(fd: &File) -> Option<u64> {
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `fd` is an open descriptor and `st` a buffer fstatvfs fills on success.
    if unsafe { libc::fstatvfs(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: fstatvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Whether other processes use the store's directory, by a marker in the journal
/// directory. Another process can read this one's blobs only as files, so while the
/// marker exists every journal writes files before acknowledging; and a blob missing
/// from a store's index can be on disk only once the marker has been there.
pub(crate) struct DirUsers {
    marker: PathBuf,
    /// The marker has been seen since this process opened the directory.
    shared: AtomicBool,
}

impl DirUsers {
    /// Records whether the process opening the store in `dir` is its only user. Called
    /// with the directory's open lock held. An opening process that is not alone writes
    /// the marker before it writes any blob; the first process to open a directory alone
    /// clears it, which none can while another holds the directory.
    pub(crate) fn note(dir: &Path, alone: bool) -> Result<DirUsers> {
        let marker = dir.join(SHARED_MARKER);
        if alone {
            match fs::remove_file(&marker) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::io(format!("removing {}", marker.display()), e));
                }
                _ => {}
            }
        } else {
            fs::write(&marker, b"").context(format_args!("writing {}", marker.display()))?;
        }
        Ok(DirUsers { marker, shared: AtomicBool::new(!alone) })
    }

    /// Whether another process has used the directory since this one opened it. Once
    /// true, stays true; until then, a stat of a name the kernel's dentry cache holds (a
    /// negative entry while it is absent): no I/O.
    pub(crate) fn shared(&self) -> bool {
        if self.shared.load(Ordering::Relaxed) {
            return true;
        }
        let seen = self.marker.exists();
        if seen {
            self.shared.store(true, Ordering::Relaxed);
        }
        seen
    }
}

/// Segments left by processes that are gone, locked by this one until `retire`.
pub(crate) struct Orphans {
    segments: Vec<(PathBuf, File)>,
}

/// Takes every segment in `dir` that no live process holds.
pub(crate) fn claim_orphans(dir: &Path) -> Result<Orphans> {
    let mut segments = Vec::new();
    for entry in fs::read_dir(dir).context(format_args!("listing {}", dir.display()))? {
        let path = entry.context("listing journal")?.path();
        if path.to_string_lossy().ends_with(".new") {
            // A segment its process died before naming: empty, and unlocked once dead.
            if File::open(&path).is_ok_and(|f| f.try_lock().is_ok()) {
                let _ = fs::remove_file(&path);
            }
            continue;
        }
        if !path.to_string_lossy().ends_with(SUFFIX) {
            continue;
        }
        let file = match File::open(&path) {
            Ok(f) => f,
            // Retired by its owner meanwhile.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(format!("opening journal segment {}", path.display()), e)),
        };
        match file.try_lock() {
            Ok(()) => {
                // Retired by its owner between the open and the lock: not an orphan.
                use std::os::unix::fs::MetadataExt;
                let held = file.metadata().context("stat journal segment")?;
                let named = fs::metadata(&path).ok();
                if held.nlink() > 0 && named.is_some_and(|m| m.ino() == held.ino() && m.dev() == held.dev()) {
                    segments.push((path, file));
                }
            }
            Err(std::fs::TryLockError::WouldBlock) => {}
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(Error::io(format!("locking journal segment {}", path.display()), e));
            }
        }
    }
    segments.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(Orphans { segments })
}

impl Orphans {
    pub(crate) fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    /// When the oldest orphan was started: every file written before then by its owner
    /// was made durable by the checkpoint that retired the segment before it. A segment
    /// whose name does not say counts as written at the epoch (the whole store is
    /// suspect).
    pub(crate) fn oldest(&self) -> Option<SystemTime> {
        self.segments.iter().map(|(p, _)| segment_created(p).unwrap_or(UNIX_EPOCH)).min()
    }

    /// Calls `f` with every whole record, oldest segment first; returns how many.
    pub(crate) fn replay(&self, mut f: impl FnMut(&Digest, &[u8]) -> Result<()>) -> Result<u64> {
        let mut n = 0;
        for (path, file) in &self.segments {
            let mut r = BufReader::with_capacity(1 << 20, file);
            let read_err = |e| Error::io(format!("reading journal segment {}", path.display()), e);
            let mut offset = 0u64;
            while let Some((d, data)) = decode(&mut r).map_err(read_err)? {
                f(&d, &data).map_err(|e| e.context(format_args!("replaying journal segment {}", path.display())))?;
                offset += (HEADER + data.len()) as u64;
                n += 1;
            }
            let len = file.metadata().map_err(read_err)?.len();
            if len > offset + HEADER as u64 {
                // More than a torn append: the disk returned something else. What
                // follows cannot be read as records; say so.
                tracing::warn!(segment = %path.display(), offset, len,
                    "CAS journal: a record that is not whole ends this segment before its end");
            }
        }
        Ok(n)
    }

    /// Deletes the segments; call once what they hold is durable elsewhere.
    pub(crate) fn retire(self) -> Result<()> {
        for (path, _lock) in self.segments {
            match fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::io(format!("removing journal segment {}", path.display()), e));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// This process's journal. Dropping it retires every segment (a clean shutdown leaves
/// nothing to replay).
pub(crate) struct Journal {
    shared: Arc<Shared>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// The store's half of a journaled write: its files and its index.
pub(crate) trait BlobFiles: Send + Sync {
    /// Puts the blob's file in place, unsynced, and accounts for it (the writer thread,
    /// when it does not defer).
    fn place(&self, d: &Digest, data: &[u8]) -> Result<()>;
    /// Accounts for acknowledged blobs whose files the placer will write: from here on
    /// the store counts them, and may evict them.
    fn account(&self, ds: &[Digest]);
    /// Puts the file of a blob `account` took in place, unsynced, unless it was evicted
    /// meanwhile (the placer thread).
    fn place_accounted(&self, d: &Digest, data: &[u8]) -> Result<()>;
}

type Waiter = tokio::sync::oneshot::Sender<Outcome>;

struct Shared {
    dir: PathBuf,
    files: Arc<dyn BlobFiles>,
    users: Arc<DirUsers>,
    /// Any descriptor on the CAS filesystem, for syncfs; held for the store's lifetime so
    /// that a writeback error is reported to it.
    fs: File,
    segment_bytes: u64,
    state: Mutex<State>,
    /// The writer waits here for blobs (or a rotation, or the end).
    work: Condvar,
    /// Segments sealed or retired, or files placed: the checkpointer, a rotation waiting
    /// for room, and `checkpoint_now` wait here.
    changed: Condvar,
    /// The placer waits here for acknowledged blobs.
    to_place: Condvar,
    seq: AtomicU64,
    /// Set by a test that simulates a crash: drop retires nothing.
    abandoned: AtomicBool,
    /// Rounds synced and segments retired (what group commit saves is visible in tests).
    syncs: AtomicU64,
    retired: AtomicU64,
    /// Segments that could not be started (the disk is full past its inodes).
    failed_rotations: AtomicU64,
}

/// A round's outcome: the io error's kind survives, so a full disk stays a full disk.
type Outcome = std::result::Result<(), (std::io::ErrorKind, String)>;

struct Segment {
    path: PathBuf,
    file: File,
    len: u64,
    /// Once sealed: the blobs deferred to the placer up to the seal (`State::deferred`),
    /// whose files must be in place before a syncfs can retire the segment.
    through: u64,
}

struct State {
    /// Blobs handed over since the writer took the last round, and who waits for each.
    pending: Vec<(Digest, bytes::Bytes, Waiter)>,
    /// Whether the writer waits for work (only then does an append wake it).
    writer_idle: bool,
    /// Only the writer thread writes to it.
    current: Segment,
    /// A write to `current` failed, it is full, or space is wanted: the writer starts a
    /// new segment before its next write.
    rotate: bool,
    /// Sealed, waiting for the checkpoint that retires them.
    sealed: VecDeque<Segment>,
    closing: bool,
    /// Set once the writer has returned: nothing more will be deferred.
    writer_done: bool,
    /// Acknowledged blobs whose files are not in place yet, oldest first: the placer's
    /// queue. `unplaced_by_digest` is the same for readers.
    unplaced: VecDeque<(Digest, bytes::Bytes)>,
    unplaced_by_digest: std::collections::HashMap<Digest, bytes::Bytes>,
    unplaced_bytes: u64,
    /// Blobs deferred to the placer so far, and of those placed so far (in order).
    deferred: u64,
    placed: u64,
    /// The placer's last attempt failed (a full or broken disk): rounds place their own
    /// files meanwhile, so their clients hear of it.
    placer_failing: bool,
    /// The placer stopped with blobs unplaced (it failed while closing): their segments
    /// must be kept for the next start to replay.
    placer_gave_up: bool,
    /// When the writer last finished a round: the placer leaves a burst alone.
    last_round: std::time::Instant,
}

impl Journal {
    /// Starts a journal in `dir` on the filesystem of `fs_root`, with its writer and
    /// checkpoint threads.
    pub(crate) fn open(
        dir: &Path,
        fs_root: &Path,
        segment_bytes: u64,
        files: Arc<dyn BlobFiles>,
        users: Arc<DirUsers>,
    ) -> Result<Journal> {
        let fs = File::open(fs_root).context(format_args!("opening {}", fs_root.display()))?;
        let seq = AtomicU64::new(0);
        let current = new_segment(dir, &seq)?;
        let shared = Arc::new(Shared {
            dir: dir.to_owned(),
            files,
            users,
            fs,
            segment_bytes,
            state: Mutex::new(State {
                pending: Vec::new(),
                writer_idle: false,
                current,
                rotate: false,
                sealed: VecDeque::new(),
                closing: false,
                writer_done: false,
                unplaced: VecDeque::new(),
                unplaced_by_digest: std::collections::HashMap::new(),
                unplaced_bytes: 0,
                deferred: 0,
                placed: 0,
                placer_failing: false,
                placer_gave_up: false,
                last_round: std::time::Instant::now(),
            }),
            work: Condvar::new(),
            changed: Condvar::new(),
            to_place: Condvar::new(),
            seq,
            abandoned: AtomicBool::new(false),
            syncs: AtomicU64::new(0),
            retired: AtomicU64::new(0),
            failed_rotations: AtomicU64::new(0),
        });
        let mut journal = Journal { shared: shared.clone(), threads: Vec::new() };
        // Joined in this order at drop: each finishes what the one before handed it.
        for (name, work) in [
            ("cas-journal", Shared::writes as fn(&Shared)),
            ("cas-place", Shared::placements),
            ("cas-checkpoint", Shared::checkpoints),
        ] {
            let sh = shared.clone();
            let t = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || work(&sh))
                .context("starting the CAS journal's threads")?;
            journal.threads.push(t);
        }
        Ok(journal)
    }

    /// Writes the blob `d` (its record appended, its file in place now or soon); the
    /// future resolves once the record is durable. Waiting holds no thread.
    pub(crate) fn append(
        &self,
        d: &Digest,
        data: bytes::Bytes,
    ) -> impl std::future::Future<Output = Result<()>> + use<> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let idle = {
            let mut st = self.shared.lock();
            st.pending.push((*d, data, tx));
            st.writer_idle
        };
        if idle {
            self.shared.work.notify_one();
        }
        let (d, dir) = (*d, self.shared.dir.clone());
        async move {
            let outcome =
                rx.await.map_err(|_| Error::Unavailable(format!("the CAS journal in {} stopped", dir.display())))?;
            outcome.map_err(|(kind, msg)| {
                Error::io(format!("journal of blob {d} in {}", dir.display()), std::io::Error::new(kind, msg))
            })
        }
    }

    /// An acknowledged blob whose file is not in place yet: its bytes.
    pub(crate) fn unplaced(&self, d: &Digest) -> Option<bytes::Bytes> {
        self.shared.lock().unplaced_by_digest.get(d).cloned()
    }

    /// Returns once every blob acknowledged before the call has its file in place (or
    /// the placer has stopped). Blocks.
    #[cfg(test)]
    pub(crate) fn wait_placed(&self) {
        let sh = &*self.shared;
        let mut st = sh.lock();
        let wanted = st.deferred;
        while st.placed < wanted && !st.placer_gave_up && !sh.abandoned.load(Ordering::SeqCst) {
            st = sh.changed.wait_timeout(st, Duration::from_millis(100)).expect("poisoned").0;
        }
    }

    /// Seals the current segment and returns once every sealed segment is retired: the
    /// journal then holds no space beyond an empty segment (the disk is full). Blocks.
    pub(crate) fn checkpoint_now(&self) {
        let sh = &*self.shared;
        // A segment that cannot be started (no inode left) or a checkpoint that cannot
        // finish: past this, the caller goes on to evict and report the full disk.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut st = sh.lock();
        let wanted = sh.retired.load(Ordering::Relaxed) + st.sealed.len() as u64 + 1;
        let failed = sh.failed_rotations.load(Ordering::Relaxed);
        st.rotate = true;
        sh.work.notify_all();
        // Done once the segments sealed before this call and the one it sealed are
        // retired, whatever later calls seal meanwhile.
        while sh.retired.load(Ordering::Relaxed) < wanted && !st.closing {
            if sh.failed_rotations.load(Ordering::Relaxed) > failed {
                tracing::warn!(dir = %sh.dir.display(), "CAS journal: no new segment can be started on the full disk");
                return;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                tracing::warn!(dir = %sh.dir.display(), "CAS journal: no checkpoint within 10s of a full disk");
                return;
            }
            st = sh.changed.wait_timeout(st, left).expect("poisoned").0;
        }
    }

    #[cfg(test)]
    pub(crate) fn syncs(&self) -> u64 {
        self.shared.syncs.load(Ordering::Relaxed)
    }

    #[cfg(test)]
    pub(crate) fn retired(&self) -> u64 {
        self.shared.retired.load(Ordering::Relaxed)
    }

    /// Test-only: behave as if the process died here. Nothing is synced or removed; the
    /// segments' locks go with their descriptors.
    #[cfg(test)]
    pub(crate) fn abandon(&self) {
        self.shared.abandoned.store(true, Ordering::SeqCst);
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        let sh = &self.shared;
        sh.lock().closing = true;
        sh.work.notify_all();
        sh.changed.notify_all();
        sh.to_place.notify_all();
        // The writer finishes what is pending first, then the placer what the writer
        // deferred, then the checkpointer what is sealed.
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if sh.abandoned.load(Ordering::SeqCst) {
            return;
        }
        // No appender is left (the store is being dropped): every segment's files are in
        // place, so one more sync retires them all, unless the placer could not finish.
        let st = sh.lock();
        if st.placer_gave_up {
            tracing::error!(dir = %sh.dir.display(), unplaced = st.unplaced.len(),
                "CAS journal: blobs could not be put in place; the segments are kept for the next start to replay");
            return;
        }
        match syncfs(&sh.fs) {
            Ok(()) => {
                for seg in st.sealed.iter().chain([&st.current]) {
                    let _ = fs::remove_file(&seg.path);
                }
            }
            Err(e) => tracing::error!(dir = %sh.dir.display(), error = %e,
                "CAS journal: the final sync failed; its segment is kept for the next start to replay"),
        }
    }
}

/// Starts a segment. It is created and locked under a name no one claims, then renamed:
/// a process opening the store meanwhile can never take a live segment for an orphan.
/// Its name holds the filesystem's own timestamp of its creation, the clock the blob
/// files' modification times come from (see `Orphans::oldest`).
fn new_segment(dir: &Path, seq: &AtomicU64) -> Result<Segment> {
    let n = seq.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!("{}-{n}.new", std::process::id()));
    let made = (|| -> Result<Segment> {
        let file = File::options()
            .read(true)
            .append(true)
            .create_new(true)
            .open(&tmp)
            .context(format_args!("creating journal segment {}", tmp.display()))?;
        file.lock().context(format_args!("locking journal segment {}", tmp.display()))?;
        let created = file.metadata().and_then(|m| m.modified()).context(format_args!("stat {}", tmp.display()))?;
        let path = dir.join(segment_name(created, n));
        fs::rename(&tmp, &path).context(format_args!("naming journal segment {}", path.display()))?;
        // The segment's name must survive a crash before any record in it is acknowledged.
        fsync_dir(dir).context(format_args!("fsync {}", dir.display()))?;
        Ok(Segment { path, file, len: 0, through: 0 })
    })();
    if made.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    made
}

fn io_outcome(e: &Error) -> (std::io::ErrorKind, String) {
    let kind = match e {
        Error::Io { source, .. } => source.kind(),
        _ => std::io::ErrorKind::Other,
    };
    (kind, e.to_string())
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("poisoned")
    }

    /// The writer thread: each round takes every blob handed over since the last one,
    /// appends their records, syncs once, tells every waiter, and hands the blobs to the
    /// placer (or puts their files in place first, see the module doc).
    fn writes(&self) {
        // The last round's buffer, emptied, becomes the next round's: a round's few MiB
        // are not allocated (and faulted in) afresh each time.
        let mut buf = Vec::new();
        let mut st = self.lock();
        loop {
            while st.pending.is_empty() && !st.rotate && !st.closing {
                st.writer_idle = true;
                st = self.work.wait(st).expect("poisoned");
                st.writer_idle = false;
            }
            if self.abandoned.load(Ordering::SeqCst) || (st.closing && st.pending.is_empty()) {
                st.writer_done = true;
                self.to_place.notify_all();
                return;
            }
            let blobs = std::mem::take(&mut st.pending);
            let mut outcome: Outcome = Ok(());
            if st.rotate {
                // Before writing: never after a torn record, where replay would stop.
                (st, outcome) = self.rotate(st);
            }
            if let Err(e) = &outcome {
                for (_, _, w) in blobs {
                    let _ = w.send(Err(e.clone()));
                }
                // Likely a full disk: let eviction work before trying again.
                st = self.changed.wait_timeout(st, Duration::from_millis(200)).expect("poisoned").0;
                continue;
            }
            // A stat per round until it is: another process may have opened the directory.
            let shared_dir = self.users.shared();
            let round_bytes: u64 = blobs.iter().map(|(_, data, _)| data.len() as u64).sum();
            // Deferred files need room later: on a disk near full (or tiny) a round places
            // its own, so that a full disk is met by the client whose write found it.
            let roomy = free_bytes(&self.fs).is_some_and(|free| free >= DEFER_MIN_FREE);
            let defer = roomy && !shared_dir && !st.placer_failing && st.unplaced_bytes + round_bytes <= UNPLACED_MAX;
            // The current segment is the writer's alone: work with no lock held.
            let file = st.current.file.try_clone();
            drop(st);
            let mut waiting = Vec::with_capacity(blobs.len());
            let mut deferred = Vec::with_capacity(if defer { blobs.len() } else { 0 });
            for (d, data, w) in blobs {
                if defer {
                    encode(&mut buf, &d, &data);
                    deferred.push((d, data));
                    waiting.push(w);
                    continue;
                }
                // The file first, then its record: what the checkpoints rely on.
                match self.files.place(&d, &data) {
                    Ok(()) => {
                        encode(&mut buf, &d, &data);
                        waiting.push(w);
                    }
                    Err(e) => {
                        let _ = w.send(Err(io_outcome(&e)));
                    }
                }
            }
            let res = match &file {
                _ if waiting.is_empty() => Ok(()),
                Ok(f) => {
                    let mut w: &File = f;
                    w.write_all(&buf).and_then(|()| f.sync_data())
                }
                Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
            };
            self.syncs.fetch_add(u64::from(!waiting.is_empty()), Ordering::Relaxed);
            st = self.lock();
            st.current.len += buf.len() as u64;
            if res.is_err() || st.current.len >= self.segment_bytes {
                st.rotate = true;
            }
            if res.is_ok() && !deferred.is_empty() {
                // Counted by the store, and readable from memory, before anyone hears of
                // them. Both under the state lock: a reader that finds a blob counted but
                // without its file waits for this lock to look in memory, and must not
                // find it missing there and forget it.
                self.files.account(&deferred.iter().map(|(d, _)| *d).collect::<Vec<_>>());
                st.deferred += deferred.len() as u64;
                for (d, data) in deferred {
                    st.unplaced_bytes += data.len() as u64;
                    st.unplaced_by_digest.insert(d, data.clone());
                    st.unplaced.push_back((d, data));
                }
                self.to_place.notify_one();
            }
            st.last_round = std::time::Instant::now();
            let outcome: Outcome = res.map_err(|e| (e.kind(), e.to_string()));
            for w in waiting {
                let _ = w.send(outcome.clone());
            }
            buf.clear();
        }
    }

    /// The placer thread: puts the files of acknowledged blobs in place, oldest first,
    /// and only then forgets their bytes. A failure (a full disk) is retried: the blob is
    /// acknowledged, so it must reach its file or stay in the journal for a replay.
    fn placements(&self) {
        const BATCH: usize = 256;
        // Background work: requests come first on a busy machine; the placer catches up
        // when they pause, and past UNPLACED_MAX rounds place their own files anyway.
        // SAFETY: setpriority on this thread's own id; a failure leaves the priority as is.
        unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 10);
        }
        let mut st = self.lock();
        loop {
            while st.unplaced.is_empty() && !st.writer_done {
                st = self.to_place.wait(st).expect("poisoned");
            }
            if self.abandoned.load(Ordering::SeqCst) || (st.unplaced.is_empty() && st.writer_done) {
                return;
            }
            if let Some(wait) = placer_pause(st.unplaced_bytes, st.last_round.elapsed(), st.closing) {
                st = self.to_place.wait_timeout(st, wait).expect("poisoned").0;
                continue;
            }
            // Left in the queue while placed: readers find them until their files exist.
            let batch: Vec<(Digest, bytes::Bytes)> = st.unplaced.iter().take(BATCH).cloned().collect();
            drop(st);
            let (done, failed) = self.place_run(&batch);
            if self.abandoned.load(Ordering::SeqCst) {
                return;
            }
            st = self.lock();
            for _ in 0..done {
                let (d, data) = st.unplaced.pop_front().expect("placed from the queue");
                st.unplaced_bytes -= data.len() as u64;
                // A later upload of the same digest may wait behind it; its file is this one.
                st.unplaced_by_digest.remove(&d);
            }
            st.placed += done as u64;
            let was_failing = st.placer_failing;
            st.placer_failing = failed.is_some();
            self.changed.notify_all();
            if let Some(e) = failed {
                if st.closing && st.writer_done {
                    st.placer_gave_up = true;
                    self.changed.notify_all();
                    tracing::error!(dir = %self.dir.display(), error = %e,
                        "CAS journal: could not put an acknowledged blob in place while closing");
                    return;
                }
                if !was_failing {
                    tracing::warn!(dir = %self.dir.display(), error = %e,
                        "CAS journal: could not put an acknowledged blob in place; it stays in the journal, retrying");
                }
                st = self.to_place.wait_timeout(st, Duration::from_millis(200)).expect("poisoned").0;
            } else if was_failing {
                tracing::info!(dir = %self.dir.display(), "CAS journal: acknowledged blobs are being put in place again");
            }
        }
    }

    /// Places `blobs` in order up to the first failure: how many were placed, and it.
    fn place_run(&self, blobs: &[(Digest, bytes::Bytes)]) -> (usize, Option<Error>) {
        for (i, (d, data)) in blobs.iter().enumerate() {
            if self.abandoned.load(Ordering::SeqCst) {
                return (i, None);
            }
            if let Err(e) = self.files.place_accounted(d, data) {
                return (i, Some(e));
            }
        }
        (blobs.len(), None)
    }

    /// Seals the current segment and starts a new one, waiting first while too many
    /// sealed segments wait for their checkpoint. On failure `rotate` stays set.
    fn rotate<'a>(&'a self, mut st: MutexGuard<'a, State>) -> (MutexGuard<'a, State>, Outcome) {
        while st.sealed.len() >= MAX_SEALED && !st.closing {
            st = self.changed.wait(st).expect("poisoned");
        }
        drop(st);
        let fresh = new_segment(&self.dir, &self.seq);
        let mut st = self.lock();
        let outcome = fresh.map(|seg| {
            let mut old = std::mem::replace(&mut st.current, seg);
            old.through = st.deferred;
            st.sealed.push_back(old);
            st.rotate = false;
        });
        if outcome.is_err() {
            self.failed_rotations.fetch_add(1, Ordering::Relaxed);
        }
        self.changed.notify_all();
        (st, outcome.map_err(|e| io_outcome(&e)))
    }

    /// The checkpoint thread: retires sealed segments, one syncfs for all that are
    /// waiting.
    fn checkpoints(&self) {
        loop {
            let mut st = self.lock();
            while st.sealed.is_empty() && !st.closing {
                st = self.changed.wait(st).expect("poisoned");
            }
            if self.abandoned.load(Ordering::SeqCst) || st.sealed.is_empty() {
                return;
            }
            // The syncfs must begin after every file the segments cover is in place: the
            // oldest ones whose files all are go now.
            let placed = st.placed;
            let n = st.sealed.iter().take_while(|seg| seg.through <= placed).count();
            if n == 0 {
                if st.placer_gave_up || self.abandoned.load(Ordering::SeqCst) {
                    return;
                }
                drop(self.changed.wait(st).expect("poisoned"));
                continue;
            }
            drop(st);
            let res = syncfs(&self.fs);
            let done: Vec<Segment> = self.lock().sealed.drain(..n).collect();
            match res {
                Ok(()) => {
                    for seg in done {
                        if let Err(e) = fs::remove_file(&seg.path) {
                            tracing::warn!(segment = %seg.path.display(), error = %e, "CAS journal: could not remove a retired segment");
                        }
                        // Closed before it counts as retired: its space is free only at
                        // the last close, and a full disk's `checkpoint_now` looks at the
                        // free space as soon as the count moves (else it evicts blobs the
                        // retired segment had made room for).
                        drop(seg);
                        self.retired.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(e) => {
                    // Some file's data may not be on disk: keep the segments for the
                    // next start to replay. Their descriptors, and so their locks, stay
                    // open for this process's lifetime, so no other process takes them.
                    tracing::error!(dir = %self.dir.display(), error = %e, segments = done.len(),
                        "CAS journal: syncfs failed; keeping the segments for the next start to replay");
                    std::mem::forget(done);
                }
            }
            self.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store with no files (the journal alone is under test).
    struct NoFiles;
    impl BlobFiles for NoFiles {
        fn place(&self, _: &Digest, _: &[u8]) -> Result<()> {
            Ok(())
        }
        fn account(&self, _: &[Digest]) {}
        fn place_accounted(&self, _: &Digest, _: &[u8]) -> Result<()> {
            Ok(())
        }
    }

    fn no_files() -> Arc<dyn BlobFiles> {
        Arc::new(NoFiles)
    }

    fn blob(i: u32, size: usize) -> (Digest, Vec<u8>) {
        let data: Vec<u8> = (0..size).map(|j| (j as u32).wrapping_mul(7).wrapping_add(i) as u8).collect();
        (DigestFunction::Sha256.digest_of(&data), data)
    }

    /// Files whose placer waits at a gate, recording what each call did.
    #[derive(Default)]
    struct GatedFiles {
        open: Mutex<bool>,
        opened: Condvar,
        placed_now: Mutex<Vec<Digest>>,
        accounted: Mutex<Vec<Digest>>,
        placed_later: Mutex<Vec<Digest>>,
    }
    impl GatedFiles {
        fn open_gate(&self) {
            *self.open.lock().unwrap() = true;
            self.opened.notify_all();
        }
    }
    impl BlobFiles for GatedFiles {
        fn place(&self, d: &Digest, _: &[u8]) -> Result<()> {
            self.placed_now.lock().unwrap().push(*d);
            Ok(())
        }
        fn account(&self, ds: &[Digest]) {
            self.accounted.lock().unwrap().extend_from_slice(ds);
        }
        fn place_accounted(&self, d: &Digest, _: &[u8]) -> Result<()> {
            let mut open = self.open.lock().unwrap();
            while !*open {
                open = self.opened.wait(open).unwrap();
            }
            self.placed_later.lock().unwrap().push(*d);
            Ok(())
        }
    }

    /// The users of a directory that this process opened alone.
    fn alone(jdir: &Path) -> Arc<DirUsers> {
        Arc::new(DirUsers::note(jdir, true).unwrap())
    }

    /// A journal in a fresh directory over gated files.
    fn gated(segment_bytes: u64) -> (tempfile::TempDir, PathBuf, Arc<GatedFiles>, Journal) {
        let dir = tempfile::tempdir().unwrap();
        let jdir = dir.path().join("journal");
        fs::create_dir(&jdir).unwrap();
        let files = Arc::new(GatedFiles::default());
        let j = Journal::open(&jdir, dir.path(), segment_bytes, files.clone(), alone(&jdir)).unwrap();
        (dir, jdir, files, j)
    }

    fn journal_files(jdir: &Path) -> usize {
        fs::read_dir(jdir).unwrap().filter(|e| e.as_ref().unwrap().path().to_string_lossy().ends_with(SUFFIX)).count()
    }

    /// An acknowledgement waits for the record, not the file: the blob is counted and
    /// readable from memory at once, its segment outlives it until the placer has put the
    /// file in place, and a crash before that replays it.
    #[test]
    fn files_are_placed_after_the_acknowledgement_and_segments_wait_for_them() {
        // 8 KiB segments: every other round seals one.
        let (_dir, jdir, files, j) = gated(8 << 10);
        let blobs: Vec<_> = (0..6).map(|i| blob(i, 3000)).collect();
        for (d, data) in &blobs {
            futures::executor::block_on(j.append(d, data.clone().into())).unwrap();
        }
        let ds: Vec<Digest> = blobs.iter().map(|b| b.0).collect();
        assert_eq!(*files.accounted.lock().unwrap(), ds, "counted before the acknowledgement");
        assert!(files.placed_now.lock().unwrap().is_empty() && files.placed_later.lock().unwrap().is_empty());
        for (d, data) in &blobs {
            assert_eq!(j.unplaced(d).as_deref(), Some(&data[..]), "served from memory");
        }
        // Sealed segments stay while their files are not in place.
        std::thread::sleep(Duration::from_millis(300));
        assert!(journal_files(&jdir) >= 3, "{} segments", journal_files(&jdir));
        assert_eq!(j.retired(), 0);
        files.open_gate();
        j.wait_placed();
        assert_eq!(*files.placed_later.lock().unwrap(), ds, "placed in order");
        assert!(blobs.iter().all(|(d, _)| j.unplaced(d).is_none()));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while journal_files(&jdir) > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(journal_files(&jdir), 1, "the sealed segments are retired once placed");

        // A crash before the placer ran: the next start replays what was acknowledged.
        let (_dir, jdir, files, j) = gated(SEGMENT_BYTES);
        for (d, data) in &blobs {
            futures::executor::block_on(j.append(d, data.clone().into())).unwrap();
        }
        j.abandon();
        files.open_gate();
        drop(j);
        let mut seen = Vec::new();
        claim_orphans(&jdir)
            .unwrap()
            .replay(|d, _| {
                seen.push(*d);
                Ok(())
            })
            .unwrap();
        assert_eq!(seen, ds);
    }

    /// While another process uses the directory, a round puts its files in place before
    /// it is acknowledged: the other process can see only files.
    #[test]
    fn a_shared_directory_places_files_before_acknowledging() {
        let (_dir, jdir, files, j) = gated(SEGMENT_BYTES);
        let (d0, data0) = blob(0, 100);
        futures::executor::block_on(j.append(&d0, data0.into())).unwrap();
        DirUsers::note(&jdir, false).unwrap();
        let (d1, data1) = blob(1, 100);
        futures::executor::block_on(j.append(&d1, data1.into())).unwrap();
        assert_eq!(*files.placed_now.lock().unwrap(), vec![d1]);
        assert_eq!(*files.accounted.lock().unwrap(), vec![d0]);
        assert!(j.unplaced(&d1).is_none());
        files.open_gate();
        drop(j);
        // The next process to open the directory alone clears the mark.
        DirUsers::note(&jdir, true).unwrap();
        assert!(!jdir.join(SHARED_MARKER).exists());
    }

    #[test]
    fn the_placer_leaves_a_burst_alone_until_it_pauses_or_fills_half_the_budget() {
        let ms = Duration::from_millis;
        // Mid-burst: wait for the rest of the quiet period.
        assert_eq!(placer_pause(4096, ms(3), false), Some(QUIET - ms(3)));
        assert_eq!(placer_pause(PLACE_DURING_BURST - 1, ms(0), false), Some(QUIET));
        // Writes paused: place now.
        assert_eq!(placer_pause(4096, QUIET, false), None);
        assert_eq!(placer_pause(4096, ms(500), false), None);
        // A long burst: place now, however busy.
        assert_eq!(placer_pause(PLACE_DURING_BURST, ms(0), false), None);
        // Closing: nothing waits.
        assert_eq!(placer_pause(4096, ms(0), true), None);
    }

    #[test]
    fn records_round_trip_and_a_torn_one_ends_the_segment() {
        let mut buf = Vec::new();
        let blobs: Vec<_> = (0..3).map(|i| blob(i, 100 + i as usize)).collect();
        for (d, data) in &blobs {
            encode(&mut buf, d, data);
        }
        let b3 = DigestFunction::Blake3.digest_of(b"blake");
        encode(&mut buf, &b3, b"blake");
        let mut r = &buf[..];
        for (d, data) in &blobs {
            assert_eq!(decode(&mut r).unwrap(), Some((*d, data.clone())));
        }
        assert_eq!(decode(&mut r).unwrap(), Some((b3, b"blake".to_vec())));
        assert_eq!(decode(&mut r).unwrap(), None);
        // Cut anywhere inside the last record: the ones before it still decode.
        for cut in [buf.len() - 1, buf.len() - 5 - HEADER + 3] {
            let mut r = &buf[..cut];
            assert_eq!((0..3).filter_map(|_| decode(&mut r).unwrap()).count(), 3);
            assert_eq!(decode(&mut r).unwrap(), None);
        }
        // A flipped data byte fails its digest; a huge claimed size is refused unread.
        let mut bad = buf.clone();
        bad[HEADER + 5] ^= 1;
        assert_eq!(decode(&mut &bad[..]).unwrap(), None);
        let mut huge = buf.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(decode(&mut &huge[..]).unwrap(), None);
    }

    #[test]
    fn concurrent_appends_share_syncs_and_full_segments_are_retired() {
        let dir = tempfile::tempdir().unwrap();
        let jdir = dir.path().join("journal");
        fs::create_dir(&jdir).unwrap();
        let j = Arc::new(Journal::open(&jdir, dir.path(), 64 << 10, no_files(), alone(&jdir)).unwrap());
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let j = j.clone();
                std::thread::spawn(move || {
                    // Ten appends in flight per thread.
                    for i in (0..50).step_by(10) {
                        let waits: Vec<_> = (i..i + 10)
                            .map(|i| {
                                let (d, data) = blob(t * 1000 + i, 4096);
                                j.append(&d, data.into())
                            })
                            .collect();
                        for w in waits {
                            futures::executor::block_on(w).unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        // 1.6 MiB of records in 64 KiB segments: every segment but the current one is
        // retired once the checkpoint thread catches up.
        assert!(j.syncs() < 400, "{} syncs for 400 appends", j.syncs());
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        // A segment's file goes before it is counted as retired: wait for both.
        let caught_up =
            || fs::read_dir(&jdir).unwrap().count() == 1 && j.retired() + 1 == j.shared.seq.load(Ordering::Relaxed);
        while !caught_up() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(fs::read_dir(&jdir).unwrap().count(), 1, "only the current segment is left");
        let started = j.shared.seq.load(Ordering::Relaxed);
        assert!(started >= 2 && j.retired() == started - 1, "{started} segments, {} retired", j.retired());
        // The current segment is this process's: not an orphan.
        assert!(claim_orphans(&jdir).unwrap().is_empty());
        drop(Arc::into_inner(j).unwrap());
        assert_eq!(fs::read_dir(&jdir).unwrap().count(), 0, "a clean drop retires the last segment");
    }

    #[test]
    fn an_abandoned_journal_is_an_orphan_that_replays_what_was_acknowledged() {
        let dir = tempfile::tempdir().unwrap();
        let jdir = dir.path().join("journal");
        fs::create_dir(&jdir).unwrap();
        let blobs: Vec<_> = (0..20).map(|i| blob(i, 3000)).collect();
        let j = Journal::open(&jdir, dir.path(), SEGMENT_BYTES, no_files(), alone(&jdir)).unwrap();
        for (d, data) in &blobs {
            futures::executor::block_on(j.append(d, data.clone().into())).unwrap();
        }
        let before = SystemTime::now();
        j.abandon();
        drop(j);
        // A torn append after the last acknowledged one.
        let seg = fs::read_dir(&jdir).unwrap().next().unwrap().unwrap().path();
        File::options().append(true).open(&seg).unwrap().write_all(&RECORD_MAGIC).unwrap();
        let orphans = claim_orphans(&jdir).unwrap();
        assert!(orphans.oldest().unwrap() <= before);
        let mut seen = Vec::new();
        let replayed = orphans.replay(|d, data| {
            seen.push((*d, data.to_vec()));
            Ok(())
        });
        assert_eq!(replayed.unwrap(), 20);
        assert_eq!(seen, blobs);
        // While claimed, nobody else gets them; retired, they are gone.
        assert!(claim_orphans(&jdir).unwrap().is_empty());
        orphans.retire().unwrap();
        assert_eq!(fs::read_dir(&jdir).unwrap().count(), 0);
    }
}
