//! `FsStore` (`[cas] kind = "fs"`): the embedded default CAS. Each blob is one file at
//! `{path}/{function}/{first two hex digits}/{hash}-{size}`; the 256 shard directories of
//! each function are made when the store opens.
//!
//! Writes go to `{path}/tmp/` first, are fsynced, and are renamed into place only after
//! the caller has verified the digest, so a crash at any point leaves either the whole
//! blob under its name or nothing (leftover temp files are removed at the next start).
//! Small writes stay in memory until commit, which then costs one blocking task.
//!
//! A write is acknowledged only once it is durable, so a power loss or kernel crash
//! cannot take back a blob the client was told is stored. Two ways:
//! - Small writes (buffered, up to 1 MiB) go through the store's journal
//!   ([`crate::fs_journal`], on unless `[cas] journal = false`): the bytes are appended to
//!   a journal, one `fdatasync` serves every write in flight, and the file is put in place
//!   without a sync, usually after the acknowledgement (the blob is counted at once and
//!   read from memory until its file exists). A background `syncfs` later makes the files
//!   durable and retires the journal; after a crash the next open writes the journal's
//!   records back, and re-hashes the small files written since its oldest segment began
//!   (a power loss can keep a file's name and lose its data) before trusting them.
//! - Larger writes, and every write when the journal is off, fsync their temp file before
//!   the rename, then the shard directory (and, when the shard was just created, the
//!   function directory that holds it). Those directory fsyncs are group-committed per
//!   directory ([`DirSync`]): every commit into a shard that arrives while that shard's
//!   sync runs joins the next one, a single fsync for all of them.
//!
//! A caller that made a file itself may give it to the store as a blob's file, with no
//! copy (`adopt`, for a worker's input cache and its actions' outputs): it is linked into
//! the temp directory at once, and named only once its journal record is durable, so the
//! journal vouches for its bytes as for any small write.
//!
//! Recency is tracked in memory (O(1) per touch). At startup the index is rebuilt from
//! the files, oldest modification time first; that approximates the previous LRU order
//! without paying a metadata write on every read.
//!
//! Several gantry processes may share one directory (frontends beside a scheduler on one
//! host, or on a shared volume): a digest missing from this process's index is looked up
//! on disk before it is called missing, and adopted into the index if another process
//! wrote it. Each process evicts by its own index.

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use gantry_core::blob_store::read_range;
use gantry_core::{BlobStore, BlobStream, BlobWriter, Digest, DigestFunction, Error, Result, ResultExt, StoreUsage};

use crate::fs_journal::{self, DirUsers, Journal};
use crate::lru_index::LruIndex;

/// Writes up to this size are buffered in memory and written in one go at commit.
const SPILL_THRESHOLD: usize = 1 << 20;
/// A full disk evicts at least this much, however small the blob that found it full.
const MIN_ROOM: u64 = 1 << 20;
/// Reads are streamed in chunks of this size, with one more read ahead: a large read
/// holds up to three chunks (12 MiB: one being sent, the next, and one being read).
/// 4 MiB chunks read 64 MiB blobs 10-15% faster than 1 MiB ones (fewer blocking-pool
/// hops); ByteStream still sends them as `read_chunk_size` messages.
const READ_CHUNK: u64 = 4 << 20;
/// Reads of at most this many bytes run on the calling thread (see `FsStore::read`).
const INLINE_READ: u64 = 64 << 10;
/// A temp file this old belongs to no write in progress (an upload idle longer is
/// dropped), so an open removes it even beside live processes.
const STALE_TEMP: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

pub struct FsStore {
    inner: Arc<Inner>,
}

struct Inner {
    files: Arc<Files>,
    dir_sync: DirSync,
    /// A shared lock on `journal/users.lock` for this store's lifetime: how an opening
    /// process knows whether any other uses the directory.
    _user: File,
    /// None when `[cas] journal = false`: every write fsyncs its own file.
    journal: Option<Journal>,
    /// What the last open found of a crash (for tests and the startup log).
    recovered: Recovered,
    /// Whether other processes use the directory (shared with the journal).
    users: Arc<DirUsers>,
}

/// The blob files and their index: what the journal's writer thread shares with the
/// store (it puts journaled blobs' files in place).
struct Files {
    root: PathBuf,
    tmp: PathBuf,
    index: Mutex<LruIndex<()>>,
    /// The mode blob files are created with (before the umask).
    file_mode: u32,
}

impl std::ops::Deref for Inner {
    type Target = Files;
    fn deref(&self) -> &Files {
        &self.files
    }
}

/// What `open` repaired after an earlier process died with journal segments left.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Recovered {
    /// Records written back from orphaned journal segments.
    pub replayed: u64,
    /// Recent small files re-hashed because a crash could have lost their data.
    pub rehashed: u64,
    /// Of those, files whose bytes did not match their name, removed.
    pub removed: u64,
}

/// Group commit of directory fsyncs, per directory. A caller joins the open round of
/// its directory and waits; one caller per directory at a time leads: it closes the open
/// round, fsyncs the directory once, publishes the outcome to the round's members, and
/// the next round starts as soon as it is done. N concurrent commits into one shard cost
/// one fsync instead of N, commits into different shards sync in parallel (the journal
/// merges concurrent fsyncs), and no caller waits for more than the round in progress
/// plus its own.
#[derive(Default)]
struct DirSync {
    dirs: Mutex<std::collections::HashMap<PathBuf, Arc<OneDir>>>,
    /// Directory fsyncs done so far (what group commit saves is visible in tests).
    fsyncs: std::sync::atomic::AtomicU64,
}

/// The rounds of one directory.
#[derive(Default)]
struct OneDir {
    state: Mutex<OneDirState>,
    done: Condvar,
}

type Round = Arc<std::sync::OnceLock<std::result::Result<(), String>>>;

#[derive(Default)]
struct OneDirState {
    /// Where the open round's outcome will be published.
    open_round: Round,
    /// Whether a caller is syncing a round of this directory now.
    leading: bool,
}

impl DirSync {
    /// The directories `Inner::open` creates: the root and each digest function's
    /// directory.
    fn layout(root: &Path) -> Vec<PathBuf> {
        let mut v = vec![root.to_path_buf()];
        v.extend(DigestFunction::ALL.iter().map(|f| root.join(f.name())));
        v
    }

    /// Returns once every directory in `dirs` has been fsynced after this call began.
    fn sync(&self, dirs: impl IntoIterator<Item = PathBuf>) -> Result<()> {
        for dir in dirs {
            // Bounded: one entry per shard directory (256 per digest function) and their
            // parents.
            let one = self.dirs.lock().expect("poisoned").entry(dir.clone()).or_default().clone();
            self.sync_one(&one, &dir)
                .map_err(|e| Error::Unavailable(format!("fsync of CAS directory {} failed: {e}", dir.display())))?;
        }
        Ok(())
    }

    fn sync_one(&self, one: &OneDir, dir: &Path) -> std::result::Result<(), String> {
        let mut st = one.state.lock().expect("poisoned");
        let mine = st.open_round.clone();
        loop {
            if let Some(outcome) = mine.get() {
                return outcome.clone();
            }
            if !st.leading && Arc::ptr_eq(&st.open_round, &mine) {
                // Lead the round this caller is in: close it and sync with no lock held.
                st.leading = true;
                st.open_round = Round::default();
                drop(st);
                self.fsyncs.fetch_add(1, Ordering::Relaxed);
                let _ = mine.set(fsync_dir(dir).map_err(|e| e.to_string()));
                st = one.state.lock().expect("poisoned");
                st.leading = false;
                one.done.notify_all();
                continue;
            }
            st = one.done.wait(st).expect("poisoned");
        }
    }
}

/// Makes a directory's entries (a rename into it, a subdirectory created in it) durable.
fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Runs `f` on the blocking pool. It starts at the call, not at the first poll, so a
/// read can start its next chunk and await it later.
fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> impl std::future::Future<Output = Result<T>> {
    let task = tokio::task::spawn_blocking(f);
    async move { task.await.map_err(|e| Error::internal(format!("blocking task failed: {e}")))? }
}

/// A step of writing a `size`-byte blob, on the blocking pool. A full disk is answered
/// there too ([`Inner::write_failed`]): making room can wait for the journal's checkpoint,
/// which must not hold an async thread.
async fn write_blocking<T: Send + 'static>(
    inner: &Arc<Inner>,
    size: u64,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let inner = inner.clone();
    blocking(move || f().map_err(|e| inner.write_failed(e, size))).await
}

impl FsStore {
    /// Opens (creating if needed) the store at `root`, with its journal, removes leftover
    /// temp files, repairs what a crash left (see the module doc) and rebuilds the LRU
    /// index from the blobs on disk.
    pub async fn open(root: impl Into<PathBuf>, max_bytes: u64) -> Result<Self> {
        Self::open_with_journal(root, max_bytes, true).await
    }

    /// As `open`; `journal = false` makes every write fsync its own file (`[cas] journal`).
    pub async fn open_with_journal(root: impl Into<PathBuf>, max_bytes: u64, journal: bool) -> Result<Self> {
        let root = root.into();
        let inner = blocking(move || Inner::open(root, max_bytes, journal, 0o644)).await?;
        Ok(FsStore { inner: Arc::new(inner) })
    }

    /// As `open`, for files that others get hard links to (a worker's input cache): each
    /// blob's file is created with `mode` (0444, or 0555 for executables), so that it is
    /// never seen with another, not even between its rename into place and a chmod.
    pub async fn open_for_links(root: impl Into<PathBuf>, max_bytes: u64, mode: u32) -> Result<Self> {
        let root = root.into();
        let inner = blocking(move || Inner::open(root, max_bytes, true, mode)).await?;
        Ok(FsStore { inner: Arc::new(inner) })
    }

    /// What this open repaired of an earlier crash.
    pub fn recovered(&self) -> Recovered {
        self.inner.recovered
    }

    /// Test-only: behave as if the process died now (the journal is left as it is).
    #[cfg(test)]
    fn crash(self) {
        if let Some(j) = &self.inner.journal {
            j.abandon();
        }
    }

    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// The file holding `digest`, if the store has it (touching it). Workers hard-link
    /// inputs from here; the file must be treated as read-only. An error is the failure
    /// to put an acknowledged blob's file in place (a full disk), not an absence.
    pub fn path_of(&self, digest: &Digest) -> Result<Option<PathBuf>> {
        // Acknowledged but not yet in place: put it there now (the placer then finds it
        // in place and leaves it). Only once: until the placer has been by, the journal
        // still calls it unplaced, and writing it again would rename a new file over the
        // one a worker has linked and made read-only, freeing an inode each time.
        if let Some(data) = self.inner.journal.as_ref().and_then(|j| j.unplaced(digest)) {
            self.inner.write_in_place(digest, &data)?;
        }
        let mut index = self.inner.index.lock().expect("poisoned");
        Ok(index.touch(digest).map(|_| blob_path(&self.inner.root, digest)))
    }

    /// Starts taking `file` as the file of the blob `digest` (whose bytes are `data`)
    /// with no copy: a hard link in the store's temp directory now, so the file outlives
    /// its own name, then its journal record and its name ([`Adoption::finish`]). For a
    /// caller that made the file and knows nothing will write to it again, as a worker
    /// knows of an action's output once every process of the action has ended. The file's
    /// mode becomes the store's.
    ///
    /// None when there is nothing to gain or it cannot be done safely: the store has the
    /// blob, keeps no journal (the record is what vouches for the file's bytes after a
    /// power loss), or the file is not a regular file of `data`'s length with no other
    /// name (another name could be written through), or on another filesystem.
    pub fn adopt(&self, digest: &Digest, data: Bytes, file: &Path) -> Option<Adoption> {
        use std::os::unix::fs::MetadataExt;
        self.inner.journal.as_ref()?;
        if data.len() as u64 != digest.size || digest.size > fs_journal::MAX_RECORD_DATA {
            return None;
        }
        if self.inner.index.lock().expect("poisoned").peek(digest).is_some() {
            return None;
        }
        let meta = fs::symlink_metadata(file).ok()?;
        if !meta.is_file() || meta.nlink() != 1 || meta.len() != digest.size {
            return None;
        }
        let link = self.inner.tmp.join(format!("adopt-{}", uuid::Uuid::new_v4()));
        fs::hard_link(file, &link).ok()?;
        Some(Adoption { inner: self.inner.clone(), digest: *digest, data, link: Some(link) })
    }

    /// Test-only: returns once every acknowledged blob's file is in place.
    #[cfg(test)]
    pub(crate) fn wait_placed(&self) {
        if let Some(j) = &self.inner.journal {
            j.wait_placed();
        }
    }

    fn writer(&self, digest: &Digest) -> Result<FsWriter> {
        let max = self.inner.index.lock().expect("poisoned").max_bytes();
        if digest.size > max {
            // INVALID_ARGUMENT, not RESOURCE_EXHAUSTED: retrying can never succeed.
            return Err(Error::invalid(format!("blob {digest} is larger than the whole store ({max} bytes)")));
        }
        Ok(FsWriter {
            inner: self.inner.clone(),
            digest: *digest,
            committed: 0,
            state: WriteState::Buffered(BytesMut::new()),
        })
    }
}

impl Files {
    /// Renames the temp file into place and accounts for it, with no sync. Returns the
    /// shard directory and whether it was just created.
    fn place(&self, tmp_path: &Path, digest: &Digest) -> Result<(PathBuf, bool)> {
        let mut index = self.index.lock().expect("poisoned");
        let placed = rename_into_place(&self.root, tmp_path, digest)?;
        self.account(&mut index, digest);
        Ok(placed)
    }

    /// Takes a blob whose file is in place into the index, removing the files of the
    /// blobs that makes room for.
    fn account(&self, index: &mut LruIndex<()>, digest: &Digest) {
        for (old, ()) in index.insert(*digest, digest.size, ()) {
            match fs::remove_file(blob_path(&self.root, &old)) {
                // Evicted before the journal's placer wrote its file: it never will.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(blob = %old, error = %e, "could not remove evicted blob"),
                Ok(()) => {}
            }
        }
    }

    /// Removes least recently used blobs worth at least `bytes`, of those `takes` accepts
    /// (the disk is full). Returns the bytes freed.
    fn evict(&self, bytes: u64, takes: impl FnMut(&Digest) -> bool) -> u64 {
        let evicted = self.index.lock().expect("poisoned").evict_bytes_where(bytes, takes);
        let mut freed = 0;
        for (old, ()) in evicted {
            match fs::remove_file(blob_path(&self.root, &old)) {
                Ok(()) => freed += old.size,
                Err(e) => tracing::warn!(blob = %old, error = %e, "could not remove evicted blob"),
            }
        }
        tracing::warn!(cas = %self.root.display(), freed, "disk full: evicted least recently used blobs");
        freed
    }

    /// Renames `tmp` to the name of `d` if the index holds `d` and no file has its name
    /// yet; whether it did. Under the index lock, as `place`: an eviction never races the
    /// rename, nor does `path_of` putting the file in place meanwhile.
    fn place_if_wanted(&self, tmp: &Path, d: &Digest) -> Result<bool> {
        let index = self.index.lock().expect("poisoned");
        if index.peek(d).is_none() || blob_path(&self.root, d).exists() {
            return Ok(false);
        }
        rename_into_place(&self.root, tmp, d)?;
        Ok(true)
    }

    /// Puts a small blob's file in place with no sync, and accounts for it: written in
    /// the temp directory and renamed, so that its name never points at part of it
    /// (another process sharing the directory may be looking). A journaled write needs no
    /// sync (see the module doc). A file already in place is kept, checked again under the
    /// index lock (as the placer's rename is): a worker may have linked it, and a second
    /// copy renamed over it would cost a file and free an inode.
    fn write_in_place(&self, digest: &Digest, data: &[u8]) -> Result<()> {
        let tmp = match blob_path(&self.root, digest).exists() {
            true => None,
            false => {
                let mut t = TempFile::create(&self.tmp, self.file_mode)?.with(data)?;
                t.file.take();
                Some(t)
            }
        };
        let mut index = self.index.lock().expect("poisoned");
        if let Some(t) = &tmp
            && !blob_path(&self.root, digest).exists()
        {
            rename_into_place(&self.root, &t.path, digest)?;
        }
        self.account(&mut index, digest);
        Ok(())
    }
}

impl fs_journal::BlobFiles for Files {
    fn place(&self, d: &Digest, data: &[u8]) -> Result<()> {
        self.write_in_place(d, data)
    }

    fn account(&self, ds: &[Digest]) {
        let mut index = self.index.lock().expect("poisoned");
        for d in ds {
            self.account(&mut index, d);
        }
    }

    fn place_accounted(&self, d: &Digest, data: &[u8]) -> Result<()> {
        let attempt = || -> Result<()> {
            // Already in place (`path_of` put it there for a hard link, as a worker's
            // input cache does for every blob it fetches): a second copy renamed over it
            // would cost a file and free an inode, and on ext4 without a journal every
            // inode freed in the last minute slows each file created after it.
            {
                let index = self.index.lock().expect("poisoned");
                if index.peek(d).is_none() || blob_path(&self.root, d).exists() {
                    return Ok(());
                }
            }
            let mut t = TempFile::create(&self.tmp, self.file_mode)?.with(data)?;
            t.file.take();
            self.place_if_wanted(&t.path, d).map(drop)
        };
        match attempt() {
            // An acknowledged blob must reach its file: on a full disk, the least recently
            // used blobs that have files make room for it (the journal cannot be retired
            // first, as a client's write does, while it holds this blob's only durable
            // copy). With none to evict the placer retries: the space may be a failed
            // upload's, freed in a moment, or a client's write evicts by the index.
            Err(e) if is_disk_full(&e) => {
                self.evict((data.len() as u64).max(MIN_ROOM), |k| k != d && blob_path(&self.root, k).exists());
                attempt()
            }
            other => other,
        }
    }
}

impl Inner {
    fn open(root: PathBuf, max_bytes: u64, journal: bool, file_mode: u32) -> Result<Inner> {
        let tmp = root.join("tmp");
        fs::create_dir_all(&tmp).context(format_args!("creating CAS directory {}", tmp.display()))?;
        let journal_dir = root.join("journal");
        fs::create_dir_all(&journal_dir).context(format_args!("creating {}", journal_dir.display()))?;
        let lock_file = |name: &str| {
            let path = journal_dir.join(name);
            File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .context(format_args!("opening {}", path.display()))
        };
        // Opens of one directory take turns: one recovering from a crash must finish
        // before another trusts the files.
        let opening = lock_file("open.lock")?;
        opening.lock().context("locking the CAS directory for its open")?;
        // Alone, every temp file is a dead process's leftover; beside live processes,
        // only old ones are (theirs may be in use).
        let user = lock_file("users.lock")?;
        let alone = match lock_file("users.lock")?.try_lock() {
            Ok(()) => true,
            Err(std::fs::TryLockError::WouldBlock) => false,
            Err(std::fs::TryLockError::Error(e)) => return Err(Error::io("locking journal/users.lock", e)),
        };
        user.lock_shared().context("locking journal/users.lock")?;
        let stale = SystemTime::now() - STALE_TEMP;
        for entry in fs::read_dir(&tmp).context(format_args!("listing {}", tmp.display()))? {
            let entry = entry.context("listing temp dir")?;
            if alone || entry.metadata().and_then(|m| m.modified()).is_ok_and(|t| t < stale) {
                let _ = fs::remove_file(entry.path());
            }
        }
        // A process that died left its journal: write back what it acknowledged first,
        // then distrust every small file written since its oldest segment began.
        let orphans = fs_journal::claim_orphans(&journal_dir)?;
        let replayed = orphans.replay(|d, data| {
            let mut t = TempFile::create(&tmp, file_mode)?.with(data)?;
            t.file.take();
            rename_into_place(&root, &t.path, d).map(drop)
        })?;
        let mut recovered = Recovered { replayed, ..Default::default() };
        let suspect_since = orphans.oldest().map(|t| t.checked_sub(fs_journal::CLOCK_SLACK).unwrap_or(t));
        let mut found: Vec<(SystemTime, Digest)> = Vec::new();
        for function in DigestFunction::ALL {
            let fdir = root.join(function.name());
            fs::create_dir_all(&fdir).context(format_args!("creating {}", fdir.display()))?;
            for shard in fs::read_dir(&fdir).context(format_args!("listing {}", fdir.display()))? {
                let shard = shard.context("listing shard")?.path();
                if !shard.is_dir() {
                    continue;
                }
                for entry in fs::read_dir(&shard).context(format_args!("listing {}", shard.display()))? {
                    let entry = entry.context("listing blobs")?;
                    let path = entry.path();
                    let Some(digest) = parse_blob_name(function, &entry.file_name().to_string_lossy()) else {
                        tracing::warn!(path = %path.display(), "ignoring unexpected file in CAS directory");
                        continue;
                    };
                    let meta = entry.metadata().context(format_args!("stat {}", path.display()))?;
                    if meta.len() != digest.size {
                        // Only possible if something outside gantry touched the file.
                        tracing::warn!(path = %path.display(), "removing blob whose size does not match its name");
                        let _ = fs::remove_file(&path);
                        continue;
                    }
                    let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                    if suspect_since.is_some_and(|t| mtime >= t) && digest.size <= fs_journal::MAX_RECORD_DATA {
                        recovered.rehashed += 1;
                        let intact = fs::read(&path).is_ok_and(|data| function.digest_of(&data) == digest);
                        if !intact {
                            tracing::warn!(path = %path.display(), "removing a blob a crash left with the wrong bytes");
                            recovered.removed += 1;
                            // It must not stay for another process to take.
                            fs::remove_file(&path).context(format_args!("removing {}", path.display()))?;
                            continue;
                        }
                    }
                    found.push((mtime, digest));
                }
            }
            // Every shard is made now, not at its first blob: on ext4, a new directory's
            // inode is placed by a search of the block groups that reads the inode tables
            // (slow right after many files were freed), and a server's first build would
            // pay for up to 256 of them per function among its uploads (a seventh of its
            // CPU in a profile of a first Bazel build). Synced below with the layout.
            for i in 0..=u8::MAX {
                let shard = fdir.join(format!("{i:02x}"));
                match fs::create_dir(&shard) {
                    Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                        return Err(Error::io(format!("creating {}", shard.display()), e));
                    }
                    _ => {}
                }
            }
        }
        if !orphans.is_empty() {
            // What was replayed, and the files that were checked, are durable before the
            // segments that vouch for them go.
            let fs_root = File::open(&root).context(format_args!("opening {}", root.display()))?;
            fs_journal::syncfs(&fs_root).context(format_args!("syncfs of {}", root.display()))?;
            orphans.retire()?;
            tracing::warn!(root = %root.display(), replayed = recovered.replayed, rehashed = recovered.rehashed,
                removed = recovered.removed, "the CAS journal of a process that died was replayed");
        }
        // The layout itself must survive a crash before any blob is acknowledged in it.
        for d in DirSync::layout(&root) {
            fsync_dir(&d).context(format_args!("fsync {}", d.display()))?;
        }
        // The root's own entry: its parent may not be ours to open (a read-only /var/lib),
        // so a failure there is reported, not fatal.
        if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty())
            && let Err(e) = fsync_dir(parent)
        {
            tracing::warn!(dir = %parent.display(), error = %e, "could not fsync the CAS directory's parent");
        }
        found.sort();
        let mut index = LruIndex::new(max_bytes);
        let inner_root = root.clone();
        let mut evicted = Vec::new();
        for (_, d) in found {
            evicted.extend(index.insert(d, d.size, ()));
        }
        for (d, ()) in evicted {
            let _ = fs::remove_file(blob_path(&inner_root, &d));
        }
        tracing::info!(root = %root.display(), blobs = index.len(), bytes = index.used_bytes(), "opened filesystem CAS");
        // Whatever this process's own `journal` setting: another's journal must know.
        let users = Arc::new(DirUsers::note(&journal_dir, alone)?);
        drop(opening);
        let files = Arc::new(Files { root: root.clone(), tmp, index: Mutex::new(index), file_mode });
        let journal = if journal {
            Some(Journal::open(&journal_dir, &root, fs_journal::SEGMENT_BYTES, files.clone(), users.clone())?)
        } else {
            None
        };
        Ok(Inner { files, dir_sync: DirSync::default(), _user: user, journal, recovered, users })
    }

    /// Moves a fully written, fsynced temp file into place and accounts for it, evicting
    /// older blobs if needed. Done under the index lock so that an eviction can never
    /// delete a file that a concurrent commit of the same digest just renamed into place.
    ///
    /// Returns only once the directory entry is durable (see the module doc); the sync
    /// happens after the lock is released, so commits to other shards are not held up.
    fn publish(&self, tmp_path: &Path, digest: &Digest) -> Result<()> {
        let (parent, created_shard) = self.place(tmp_path, digest)?;
        // A new shard's own entry lives in the function directory: sync that too, or the
        // blob could survive a crash in a directory that did not.
        let function_dir = created_shard.then(|| parent.parent().expect("shard has a parent").to_path_buf());
        self.dir_sync
            .sync(std::iter::once(parent).chain(function_dir))
            .map_err(|e| e.context(format_args!("blob {digest}")))
    }

    /// The disk is full before the store's budget is (other files share it, or
    /// `max_size` is larger than the disk): removes least recently used blobs worth at
    /// least `bytes`, so that the next write fits. Returns the bytes freed.
    fn make_room(&self, bytes: u64) -> u64 {
        // The journal's segments go first: they only duplicate blobs that are files. Blobs
        // are evicted only for what the disk still lacks after that.
        if let Some(j) = &self.journal {
            j.checkpoint_now();
            if File::open(&self.root).ok().and_then(|f| fs_journal::free_bytes(&f)).is_some_and(|free| free >= bytes) {
                tracing::warn!(cas = %self.root.display(), "disk full: the CAS journal's segments were retired to make room");
                return 0;
            }
        }
        self.files.evict(bytes, |_| true)
    }

    /// What a failed write of a `size`-byte blob tells its client. A full disk makes
    /// room for the client's retry and becomes RESOURCE_EXHAUSTED naming this store (the
    /// I/O error alone names only a temp file); other errors pass unchanged.
    fn write_failed(&self, e: Error, size: u64) -> Error {
        if !is_disk_full(&e) {
            return e;
        }
        self.make_room(size.max(MIN_ROOM));
        Error::ResourceExhausted(format!(
            "CAS {}: the disk is full ({e}); least recently used blobs were evicted to make room, retry",
            self.root.display()
        ))
    }

    /// Takes a blob that another process wrote into this directory into the index, if
    /// its file is there with the right size. The lock is taken only after the stat.
    fn adopt(&self, digest: &Digest) -> bool {
        match fs::metadata(blob_path(&self.root, digest)) {
            Ok(m) if m.is_file() && m.len() == digest.size => {}
            _ => return false,
        }
        let mut index = self.index.lock().expect("poisoned");
        if index.touch(digest).is_some() {
            return true;
        }
        for (old, ()) in index.insert(*digest, digest.size, ()) {
            if old != *digest {
                let _ = fs::remove_file(blob_path(&self.root, &old));
            }
        }
        index.touch(digest).is_some()
    }

    /// Drops a blob whose file vanished. Re-checked under the lock: a concurrent upload
    /// of the same digest may have just put a fresh file in place.
    fn forget(&self, digest: &Digest) {
        let mut index = self.index.lock().expect("poisoned");
        if !blob_path(&self.root, digest).exists() {
            index.remove(digest);
        }
    }
}

/// Renames a written temp file to the blob's name, creating its shard directory when
/// missing. Returns the shard directory and whether it was just created.
fn rename_into_place(root: &Path, tmp_path: &Path, digest: &Digest) -> Result<(PathBuf, bool)> {
    let dest = blob_path(root, digest);
    let parent = dest.parent().expect("blob path has a parent").to_path_buf();
    match fs::rename(tmp_path, &dest) {
        Ok(()) => Ok((parent, false)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            fs::create_dir_all(&parent).context(format_args!("creating {}", parent.display()))?;
            fs::rename(tmp_path, &dest).context(format_args!("renaming blob {digest} into place"))?;
            Ok((parent, true))
        }
        Err(e) => Err(Error::io(format!("renaming blob {digest} into place"), e)),
    }
}

/// ENOSPC or EDQUOT, from any step of a write.
fn is_disk_full(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if matches!(source.kind(), std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded))
}

fn blob_path(root: &Path, d: &Digest) -> PathBuf {
    let hex = d.hash_hex();
    root.join(d.function.name()).join(&hex[..2]).join(format!("{hex}-{}", d.size))
}

fn parse_blob_name(function: DigestFunction, name: &str) -> Option<Digest> {
    let (hash, size) = name.split_once('-')?;
    Digest::parse(function, hash, size.parse().ok()?).ok()
}

#[async_trait]
impl BlobStore for FsStore {
    async fn find_present(&self, digests: &[Digest]) -> Result<Vec<bool>> {
        let mut present: Vec<bool> = {
            let mut idx = self.inner.index.lock().expect("poisoned");
            digests.iter().map(|d| idx.touch(d).is_some()).collect()
        };
        let unknown: Vec<(usize, Digest)> =
            present.iter().enumerate().filter(|(_, p)| !**p).map(|(i, _)| (i, digests[i])).collect();
        // A blob missing from the index can only be another process's file: with no other
        // process using the directory, the index is the answer, and looking on disk would
        // cost a stat and a trip to a blocking thread and back per upload of new blobs.
        if unknown.is_empty() || !self.inner.users.shared() {
            return Ok(present);
        }
        let inner = self.inner.clone();
        let adopted = blocking(move || {
            Ok(unknown.into_iter().filter(|(_, d)| inner.adopt(d)).map(|(i, _)| i).collect::<Vec<_>>())
        })
        .await?;
        for i in adopted {
            present[i] = true;
        }
        Ok(present)
    }

    async fn read(&self, digest: &Digest, offset: u64, limit: Option<u64>) -> Result<BlobStream> {
        let (offset, len) = read_range(digest, offset, limit)?;
        if self.inner.index.lock().expect("poisoned").touch(digest).is_none() {
            let (inner, d) = (self.inner.clone(), *digest);
            if !blocking(move || Ok(inner.adopt(&d))).await? {
                return Err(Error::not_found(format!("blob {digest} not found")));
            }
        }
        // Acknowledged but not yet a file (written moments ago: an action and its command
        // are read right after the client uploads them): served from memory, without a
        // blocking task, which is a handoff between threads and back.
        if let Some(data) = self.inner.journal.as_ref().and_then(|j| j.unplaced(digest)) {
            let chunk = data.slice(offset as usize..(offset + len) as usize);
            return Ok(futures::stream::once(async move { Ok(chunk) }).boxed());
        }
        let path = blob_path(&self.inner.root, digest);
        let inner = self.inner.clone();
        let d = *digest;
        let first = (len.min(READ_CHUNK)) as usize;
        // Open and read the first chunk in one step: most blobs fit in it. A small one is
        // read on this thread (an Action, a Command, a Directory: mostly a page-cache copy
        // of a few KiB; cold, one read of at most 64 KiB waits on the disk), since a
        // blocking task is a handoff to another thread and back that costs more than the
        // read.
        let open_first = move || {
            let mut f = match File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    // Acknowledged, with its file still to come from the journal's placer;
                    // or placed between the open and this look: open once more.
                    if let Some(data) = inner.journal.as_ref().and_then(|j| j.unplaced(&d)) {
                        return Ok(Err(data));
                    }
                    match File::open(&path) {
                        Ok(f) => f,
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                            inner.forget(&d);
                            return Err(Error::not_found(format!("blob {d} not found (file vanished)")));
                        }
                        Err(e) => return Err(Error::io(format!("opening blob {d}"), e)),
                    }
                }
                Err(e) => return Err(Error::io(format!("opening blob {d}"), e)),
            };
            if offset > 0 {
                f.seek(SeekFrom::Start(offset)).context(format_args!("seeking blob {d}"))?;
            }
            let chunk = read_exact_chunk(&mut f, first, &d)?;
            Ok(Ok((f, chunk)))
        };
        let res = if len <= INLINE_READ { open_first()? } else { blocking(open_first).await? };
        let (file, first_chunk) = match res {
            Ok(opened) => opened,
            Err(unplaced) => {
                let chunk = unplaced.slice(offset as usize..(offset + len) as usize);
                return Ok(futures::stream::once(async move { Ok(chunk) }).boxed());
            }
        };
        let remaining = len - first as u64;
        let head = futures::stream::once(async move { Ok(first_chunk) });
        if remaining == 0 {
            return Ok(head.boxed());
        }
        // One chunk is read ahead while the one before it is sent, so the disk (or page
        // cache) and the network overlap; a task per chunk, not one per blob, so a slow
        // reader never holds a blocking thread while it waits.
        let read_next = move |mut file: File, remaining: u64| {
            let n = remaining.min(READ_CHUNK) as usize;
            blocking(move || Ok((read_exact_chunk(&mut file, n, &d)?, file, remaining - n as u64)))
        };
        let tail = futures::stream::unfold(
            Some(futures::FutureExt::boxed(read_next(file, remaining))),
            move |next| async move {
                match next?.await {
                    Ok((chunk, _, 0)) => Some((Ok(chunk), None)),
                    Ok((chunk, file, left)) => {
                        Some((Ok(chunk), Some(futures::FutureExt::boxed(read_next(file, left)))))
                    }
                    Err(e) => Some((Err(e), None)),
                }
            },
        );
        Ok(head.chain(tail).boxed())
    }

    async fn begin_write(&self, digest: &Digest) -> Result<Box<dyn BlobWriter>> {
        Ok(Box::new(self.writer(digest)?))
    }

    fn usage(&self) -> StoreUsage {
        let idx = self.inner.index.lock().expect("poisoned");
        StoreUsage { used_bytes: idx.used_bytes(), max_bytes: idx.max_bytes(), blobs: idx.len() as u64 }
    }

    async fn check(&self) -> Result<()> {
        // Prove the directory is writable now rather than on the first client upload.
        let tmp = self.inner.tmp.join(format!("check-{}", uuid::Uuid::new_v4()));
        blocking(move || {
            fs::write(&tmp, b"gantry").context(format_args!("writing {}", tmp.display()))?;
            fs::remove_file(&tmp).context(format_args!("removing {}", tmp.display()))
        })
        .await
    }
}

fn read_exact_chunk(f: &mut File, n: usize, d: &Digest) -> Result<Bytes> {
    // `read_to_end` reads into the spare capacity as it is, so the buffer is not zeroed
    // first: that memset was a tenth of the read path's own CPU.
    let mut buf = Vec::with_capacity(n);
    f.take(n as u64).read_to_end(&mut buf).context(format_args!("reading blob {d}"))?;
    if buf.len() < n {
        return Err(Error::io(
            format!("reading blob {d}"),
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{} of {n} bytes: the file is short", buf.len()),
            ),
        ));
    }
    Ok(Bytes::from(buf))
}

enum WriteState {
    Buffered(BytesMut),
    Spilled(TempFile),
    /// Transient state while a blocking task owns the file.
    Busy,
}

/// A temp file that removes itself unless it was renamed into place.
struct TempFile {
    path: PathBuf,
    file: Option<File>,
}

/// A file on its way to being a blob's own file ([`FsStore::adopt`]). Dropped unfinished,
/// it takes its link back.
pub struct Adoption {
    inner: Arc<Inner>,
    digest: Digest,
    data: Bytes,
    link: Option<PathBuf>,
}

impl Adoption {
    /// Makes the blob durable (its journal record), then gives the linked file the blob's
    /// name, unless a file is there already. Returns whether the linked file is now the
    /// blob's.
    pub async fn finish(mut self) -> Result<bool> {
        let store = FsStore { inner: self.inner.clone() };
        // The record first: once the name points at the file, a power loss must find the
        // journal vouching for its bytes (replayed over it, or the file re-hashed).
        if self.inner.index.lock().expect("poisoned").peek(&self.digest).is_none() {
            store.put(&self.digest, self.data.clone()).await?;
        }
        let link = self.link.take().expect("an adoption is finished once");
        // The store's mode before the name: the file is never seen under it with another.
        // As the placer would, it leaves a file already in place alone.
        let placed = {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&link, fs::Permissions::from_mode(self.inner.file_mode))
                .context(format_args!("chmod {}", link.display()))
                .and_then(|()| self.inner.place_if_wanted(&link, &self.digest))
        };
        if !matches!(placed, Ok(true)) {
            let _ = fs::remove_file(&link);
        }
        placed
    }
}

impl Drop for Adoption {
    fn drop(&mut self) {
        if let Some(link) = self.link.take() {
            let _ = fs::remove_file(link);
        }
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if self.file.take().is_some() || self.path.exists() {
            let _ = fs::remove_file(&self.path);
        }
    }
}

impl TempFile {
    /// A new file in `dir`, created with `mode` (before the umask).
    fn create(dir: &Path, mode: u32) -> Result<TempFile> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(uuid::Uuid::new_v4().to_string());
        let create = |p: &Path| File::options().write(true).create_new(true).mode(mode).open(p);
        let file = match create(&path) {
            // Something (a tmp cleaner) removed the directory: recreate it once.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fs::create_dir_all(dir).context(format_args!("recreating {}", dir.display()))?;
                create(&path)
            }
            other => other,
        }
        .context(format_args!("creating temp file {}", path.display()))?;
        Ok(TempFile { path, file: Some(file) })
    }

    fn with(mut self, data: &[u8]) -> Result<TempFile> {
        self.write_all(data)?;
        Ok(self)
    }

    fn write_all(&mut self, data: &[u8]) -> Result<()> {
        self.file.as_mut().expect("open").write_all(data).context(format_args!("writing {}", self.path.display()))
    }
}

struct FsWriter {
    inner: Arc<Inner>,
    digest: Digest,
    committed: u64,
    state: WriteState,
}

/// A blob that is complete and fsynced in the temp directory but not yet visible.
pub(crate) struct Staged {
    inner: Arc<Inner>,
    digest: Digest,
    tmp: TempFile,
}

impl Staged {
    pub(crate) async fn publish(mut self) -> Result<()> {
        blocking(move || {
            self.tmp.file.take();
            self.inner.publish(&self.tmp.path, &self.digest)
        })
        .await
    }
}

impl FsWriter {
    /// Appends `chunk` to the temp file, first moving any buffered bytes there.
    async fn spill_to_file(&mut self, chunk: Bytes) -> Result<()> {
        let state = std::mem::replace(&mut self.state, WriteState::Busy);
        let (dir, mode) = (self.inner.tmp.clone(), self.inner.file_mode);
        self.state = write_blocking(&self.inner, self.digest.size, move || {
            let mut tmp = match state {
                WriteState::Buffered(buf) => {
                    let mut t = TempFile::create(&dir, mode)?;
                    t.write_all(&buf)?;
                    t
                }
                WriteState::Spilled(t) => t,
                WriteState::Busy => return Err(Error::internal("writer used after a failed write")),
            };
            if !chunk.is_empty() {
                tmp.write_all(&chunk)?;
            }
            Ok(WriteState::Spilled(tmp))
        })
        // What was written of a streamed upload is gone with its temp file.
        .await?;
        Ok(())
    }

    fn check_complete(&self) -> Result<()> {
        if self.committed != self.digest.size {
            return Err(Error::invalid(format!(
                "blob {}: received {} bytes, digest says {}",
                self.digest, self.committed, self.digest.size
            )));
        }
        Ok(())
    }

    /// Writes everything to a temp file and fsyncs it; the blob is not visible yet.
    pub(crate) async fn stage(mut self: Box<Self>) -> Result<Staged> {
        self.check_complete()?;
        let state = std::mem::replace(&mut self.state, WriteState::Busy);
        let (inner, digest) = (self.inner.clone(), self.digest);
        let tmp = write_blocking(&self.inner, digest.size, move || {
            let synced = |t: TempFile| -> Result<TempFile> {
                t.file.as_ref().expect("open").sync_all().context(format_args!("fsync {}", t.path.display()))?;
                Ok(t)
            };
            match state {
                WriteState::Buffered(buf) => {
                    let attempt = || synced(TempFile::create(&inner.tmp, inner.file_mode)?.with(&buf)?);
                    match attempt() {
                        // The bytes are still here: make room and try once more.
                        Err(e) if is_disk_full(&e) => {
                            inner.make_room(digest.size.max(MIN_ROOM));
                            attempt()
                        }
                        other => other,
                    }
                }
                WriteState::Spilled(t) => synced(t),
                WriteState::Busy => Err(Error::internal("writer used after a failed write")),
            }
        })
        .await?;
        Ok(Staged { inner: self.inner.clone(), digest: self.digest, tmp })
    }
}

#[async_trait]
impl BlobWriter for FsWriter {
    fn committed(&self) -> u64 {
        self.committed
    }

    async fn write(&mut self, chunk: Bytes) -> Result<()> {
        let n = chunk.len() as u64;
        match &mut self.state {
            WriteState::Buffered(buf) if buf.len() + chunk.len() <= SPILL_THRESHOLD => buf.extend_from_slice(&chunk),
            _ => self.spill_to_file(chunk).await?,
        }
        self.committed += n;
        Ok(())
    }

    fn buffered(&self) -> u64 {
        match &self.state {
            WriteState::Buffered(buf) => buf.len() as u64,
            _ => 0,
        }
    }

    async fn spill(&mut self) -> Result<()> {
        match &self.state {
            WriteState::Buffered(buf) if !buf.is_empty() => self.spill_to_file(Bytes::new()).await,
            _ => Ok(()),
        }
    }

    async fn commit(mut self: Box<Self>) -> Result<()> {
        if self.inner.journal.is_none() || !matches!(self.state, WriteState::Buffered(_)) {
            return self.stage().await?.publish().await;
        }
        self.check_complete()?;
        let WriteState::Buffered(buf) = std::mem::replace(&mut self.state, WriteState::Busy) else {
            unreachable!("checked above")
        };
        let buf = buf.freeze();
        let journal = self.inner.journal.as_ref().expect("checked above");
        match journal.append(&self.digest, buf.clone()).await {
            // No room for the file or the journal: the way without the journal makes room
            // (the journal's too) and tries once more.
            Err(e) if is_disk_full(&e) => {
                self.state = WriteState::Buffered(BytesMut::from(&buf[..]));
                self.stage().await?.publish().await
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The store on a 4 MiB tmpfs whose `max_size` (64 MiB) the disk cannot hold: the
    /// disk fills first. Runs only inside a mount namespace of its own, where this test
    /// process is root (see `a_full_disk_is_resource_exhausted_and_recovers`).
    #[tokio::test]
    #[ignore = "run by a_full_disk_is_resource_exhausted_and_recovers in a namespace"]
    async fn full_disk_inside_a_namespace() {
        use futures::TryStreamExt;
        let Ok(root) = std::env::var("GANTRY_TEST_TMPFS") else {
            panic!("run by a_full_disk_is_resource_exhausted_and_recovers")
        };
        let root = PathBuf::from(root);
        let st = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
            .arg(&root)
            .status()
            .unwrap();
        assert!(st.success(), "mount tmpfs");
        let store = FsStore::open(root.join("cas"), 64 << 20).await.unwrap();
        let blob = |i: u32, size: usize| {
            let data =
                Bytes::from((0..size).map(|j| (j as u32).wrapping_mul(31).wrapping_add(i) as u8).collect::<Vec<u8>>());
            (DigestFunction::Sha256.digest_of(&data), data)
        };
        let put = |d: Digest, data: Bytes, chunk: usize| {
            let store = &store;
            async move {
                let mut w = store.begin_write(&d).await?;
                for c in data.chunks(chunk) {
                    w.write(Bytes::copy_from_slice(c)).await?;
                }
                w.commit().await
            }
        };
        let get = |d: Digest| {
            let store = &store;
            async move {
                let chunks: Vec<Bytes> = store.read(&d, 0, None).await?.try_collect().await?;
                Ok::<_, Error>(chunks.concat())
            }
        };
        let tmp_files = || fs::read_dir(root.join("cas/tmp")).unwrap().count();
        // 2.8 MiB of blobs fit. Their size keeps every step at least 128 KiB from a
        // threshold (with 512 KiB blobs the last left exactly `MIN_ROOM` free).
        let small: Vec<_> = (0..6).map(|i| blob(i, 480 << 10)).collect();
        for (d, data) in &small {
            put(*d, data.clone(), 64 << 10).await.unwrap();
        }
        // A streamed 2 MiB upload runs out of disk part way: RESOURCE_EXHAUSTED naming the
        // store, no temp file left, and room made from the oldest blobs.
        let (big_d, big) = blob(100, 2 << 20);
        // The test's premise, checked: the upload cannot fit as things stand.
        let free = fs_journal::free_bytes(&File::open(&root).unwrap()).unwrap();
        assert!(free < big.len() as u64 / 2, "{free} bytes free before a {}-byte upload", big.len());
        let e = put(big_d, big.clone(), 256 << 10).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
        assert!(e.to_string().contains(&format!("CAS {}", root.join("cas").display())), "{e}");
        assert_eq!(tmp_files(), 0, "a partial upload was left behind");
        // Reads go on: the newest blobs are still there, byte for byte.
        assert_eq!(get(small[5].0).await.unwrap(), small[5].1.to_vec());
        assert!(get(small[0].0).await.unwrap_err().is_not_found(), "the oldest blob made the room");
        // The client's retry fits, and so does a stream of buffered writes twice the
        // disk's size: each that finds the disk full makes room and tries again.
        put(big_d, big.clone(), 256 << 10).await.unwrap();
        assert_eq!(get(big_d).await.unwrap(), big.to_vec());
        let more: Vec<_> = (10..26).map(|i| blob(i, 512 << 10)).collect();
        for (d, data) in &more {
            put(*d, data.clone(), 512 << 10).await.unwrap();
        }
        for (d, data) in &more[more.len() - 4..] {
            assert_eq!(get(*d).await.unwrap(), data.to_vec());
        }
        assert_eq!(tmp_files(), 0);
    }

    /// Disk full, for real: the test above in a user and mount namespace (`unshare -Urm`),
    /// where it may mount a small tmpfs. No privileges needed beyond user namespaces;
    /// under CI=true a machine without them fails rather than skips.
    #[test]
    fn a_full_disk_is_resource_exhausted_and_recovers() {
        crate::run_in_a_namespace("fs_store::tests::full_disk_inside_a_namespace");
    }

    #[tokio::test]
    async fn crash_between_write_and_rename_leaves_nothing_visible() {
        let dir = tempfile::tempdir().unwrap();
        let data = Bytes::from(vec![7u8; 3 << 20]); // spills to a temp file
        let d = DigestFunction::Sha256.digest_of(&data);
        {
            let store = FsStore::open(dir.path(), 1 << 30).await.unwrap();
            let mut w = Box::new(store.writer(&d).unwrap());
            w.write(data.clone()).await.unwrap();
            let staged = w.stage().await.unwrap();
            // Simulate the process dying here: no destructor runs, the temp file stays.
            // (The store itself goes, as the process would: its lock on the directory too.)
            let Staged { tmp, .. } = staged;
            std::mem::forget(tmp);
            assert!(!store.has(&d).await.unwrap());
            assert_eq!(fs::read_dir(dir.path().join("tmp")).unwrap().count(), 1);
            assert!(!blob_path(dir.path(), &d).exists());
        }
        // "Restart": the leftover is cleaned and the blob is still not there.
        let store = FsStore::open(dir.path(), 1 << 30).await.unwrap();
        assert!(!store.has(&d).await.unwrap());
        assert_eq!(fs::read_dir(dir.path().join("tmp")).unwrap().count(), 0);
        assert!(store.read(&d, 0, None).await.err().unwrap().is_not_found());
    }

    #[tokio::test]
    async fn a_commit_syncs_its_shard_and_a_new_shards_parent() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open_with_journal(dir.path(), 1 << 30, false).await.unwrap();
        // Every shard of every function is made at open, none at a first blob.
        for f in DigestFunction::ALL {
            let shards =
                fs::read_dir(dir.path().join(f.name())).unwrap().filter(|e| e.as_ref().unwrap().path().is_dir());
            assert_eq!(shards.count(), 256, "{}", f.name());
        }
        let fsyncs = || store.inner.dir_sync.fsyncs.load(std::sync::atomic::Ordering::Relaxed);
        let a = Bytes::from_static(b"first blob");
        let d = DigestFunction::Sha256.digest_of(&a);
        store.put(&d, a).await.unwrap();
        assert_eq!(fsyncs(), 1, "only the shard: it existed");
        // A shard removed behind the store's back is made again, and then its parent is
        // synced too.
        let other = (0u32..)
            .map(|i| Bytes::from(format!("blob {i}")))
            .find(|b| DigestFunction::Sha256.digest_of(b).hash_hex()[..2] != d.hash_hex()[..2])
            .unwrap();
        let od = DigestFunction::Sha256.digest_of(&other);
        fs::remove_dir(dir.path().join("sha256").join(&od.hash_hex()[..2])).unwrap();
        store.put(&od, other).await.unwrap();
        assert_eq!(fsyncs(), 3, "the new shard and the function directory holding it");
        assert_eq!(store.get(&od).await.unwrap().len() as u64, od.size);
    }

    #[tokio::test]
    async fn an_adopted_file_becomes_the_blob_file_with_no_copy() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open_for_links(dir.path().join("cache"), 1 << 30, 0o555).await.unwrap();
        let temp_files = || fs::read_dir(dir.path().join("cache/tmp")).unwrap().count();
        let out = dir.path().join("out");
        let data = Bytes::from_static(b"an action's output");
        let d = DigestFunction::Sha256.digest_of(&data);
        fs::write(&out, &data).unwrap();
        let ino = fs::metadata(&out).unwrap().ino();

        // Refused: the wrong bytes for the digest, and a file with a second name.
        assert!(store.adopt(&d, Bytes::from_static(b"other"), &out).is_none());
        fs::hard_link(&out, dir.path().join("second")).unwrap();
        assert!(store.adopt(&d, data.clone(), &out).is_none(), "a file with another name");
        fs::remove_file(dir.path().join("second")).unwrap();

        // Dropped unfinished: its link is taken back, the file left as it was.
        drop(store.adopt(&d, data.clone(), &out).unwrap());
        assert_eq!(temp_files(), 0);
        assert!(!store.has(&d).await.unwrap());

        let adoption = store.adopt(&d, data.clone(), &out).unwrap();
        // The action's directory is emptied meanwhile: the link keeps the file.
        fs::remove_file(&out).unwrap();
        assert!(adoption.finish().await.unwrap(), "the linked file is the blob's");
        let path = store.path_of(&d).unwrap().unwrap();
        let meta = fs::metadata(&path).unwrap();
        assert_eq!(meta.ino(), ino, "the same inode: no copy");
        assert_eq!(meta.permissions().mode() & 0o777, 0o555, "the store's mode");
        assert_eq!(fs::read(&path).unwrap(), data);
        assert_eq!(temp_files(), 0);
        // Present now: nothing to adopt.
        fs::write(&out, &data).unwrap();
        assert!(store.adopt(&d, data.clone(), &out).is_none());

        // A blob whose file came first keeps it; the adopted link goes.
        let data2 = Bytes::from_static(b"another output");
        let d2 = DigestFunction::Sha256.digest_of(&data2);
        let out2 = dir.path().join("out2");
        fs::write(&out2, &data2).unwrap();
        let adoption = store.adopt(&d2, data2.clone(), &out2).unwrap();
        store.put(&d2, data2.clone()).await.unwrap();
        let first = store.path_of(&d2).unwrap().unwrap();
        let first_ino = fs::metadata(&first).unwrap().ino();
        assert!(!adoption.finish().await.unwrap());
        assert_eq!(fs::metadata(&first).unwrap().ino(), first_ino);
        assert_eq!(temp_files(), 0);

        // The journal vouches for an adopted file: after a crash, it is whole.
        let store_path = dir.path().join("cache");
        store.crash();
        let store = FsStore::open_for_links(&store_path, 1 << 30, 0o555).await.unwrap();
        assert_eq!(store.get(&d).await.unwrap(), data);
    }

    #[test]
    fn dir_sync_group_commit_reports_each_rounds_outcome() {
        let dir = tempfile::tempdir().unwrap();
        let sync = Arc::new(DirSync::default());
        let good = dir.path().to_path_buf();
        let threads: Vec<_> = (0..32)
            .map(|_| {
                let (sync, good) = (sync.clone(), good.clone());
                std::thread::spawn(move || sync.sync([good]))
            })
            .collect();
        for t in threads {
            t.join().unwrap().unwrap();
        }
        let n = sync.fsyncs.load(std::sync::atomic::Ordering::Relaxed);
        assert!((1..=32).contains(&n), "{n} fsyncs for 32 callers");
        // A failed round fails its members and does not poison later rounds.
        let e = sync.sync([dir.path().join("missing")]).unwrap_err();
        assert!(matches!(e, Error::Unavailable(_)) && e.to_string().contains("missing"), "{e}");
        sync.sync([good]).unwrap();
    }

    /// A power loss after small writes were acknowledged through the journal: files that
    /// vanished or lost their bytes come back from the journal, a file whose write was
    /// never acknowledged (its bytes lost) is removed, and a large blob (fsynced on its
    /// own) is untouched. A clean shutdown then leaves nothing to repair.
    #[tokio::test]
    async fn a_crash_after_journaled_writes_is_repaired_at_the_next_open() {
        let dir = tempfile::tempdir().unwrap();
        let blobs: Vec<(Digest, Bytes)> = (0..50u32)
            .map(|i| {
                let b = Bytes::from(format!("small blob {i} ").repeat(100));
                (DigestFunction::Sha256.digest_of(&b), b)
            })
            .collect();
        let large = Bytes::from(vec![9u8; 3 << 20]);
        let large_d = DigestFunction::Sha256.digest_of(&large);
        let store = FsStore::open(dir.path(), 1 << 30).await.unwrap();
        futures::future::try_join_all(blobs.iter().map(|(d, b)| store.put(d, b.clone()))).await.unwrap();
        store.put(&large_d, large.clone()).await.unwrap();
        assert!(store.inner.journal.as_ref().unwrap().syncs() < 51, "appends in flight share their syncs");
        store.crash();
        // What a power loss can do to files that were never synced.
        // (The crash may have come before the journal's placer wrote some of them.)
        for (d, _) in &blobs[..10] {
            let _ = fs::remove_file(blob_path(dir.path(), d));
        }
        for (d, b) in &blobs[10..15] {
            fs::create_dir_all(blob_path(dir.path(), d).parent().unwrap()).unwrap();
            fs::write(blob_path(dir.path(), d), vec![0u8; b.len()]).unwrap();
        }
        let unacked = DigestFunction::Sha256.digest_of(b"never acknowledged");
        fs::create_dir_all(blob_path(dir.path(), &unacked).parent().unwrap()).unwrap();
        fs::write(blob_path(dir.path(), &unacked), vec![0u8; unacked.size as usize]).unwrap();

        let store = FsStore::open(dir.path(), 1 << 30).await.unwrap();
        let r = store.recovered();
        assert_eq!((r.replayed, r.removed), (50, 1), "{r:?}");
        assert!(r.rehashed >= 51, "{r:?}");
        for (d, b) in &blobs {
            assert_eq!(store.get(d).await.unwrap(), *b, "{d}");
        }
        assert_eq!(store.get(&large_d).await.unwrap(), large);
        assert!(!store.has(&unacked).await.unwrap());
        assert_eq!(segments(dir.path()), 1, "only the new journal segment");
        drop(store);
        assert_eq!(segments(dir.path()), 0, "a clean close retires the journal");
        let store = FsStore::open(dir.path(), 1 << 30).await.unwrap();
        assert_eq!(store.recovered(), Recovered::default());
        assert_eq!(store.usage().blobs, 51);
    }

    fn segments(root: &Path) -> usize {
        fs::read_dir(root.join("journal"))
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".journal"))
            .count()
    }

    /// What a power loss may do to a file whose data was never synced.
    #[derive(Debug, Clone, Copy)]
    enum Damage {
        None,
        Gone,
        Zeroed,
        Truncated,
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 12, ..Default::default() })]
        /// Any acknowledged small writes, any damage a power loss could do to their files
        /// and to the journal's tail, any unacknowledged garbage beside them: after the
        /// next open every acknowledged blob reads back byte for byte, and nothing else
        /// is served.
        #[test]
        fn after_any_crash_every_acknowledged_blob_is_intact(
            sizes in proptest::collection::vec(1usize..9000, 1..60),
            damage in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::strategy::Just(Damage::None),
                    proptest::strategy::Just(Damage::Gone),
                    proptest::strategy::Just(Damage::Zeroed),
                    proptest::strategy::Just(Damage::Truncated),
                ],
                60,
            ),
            garbage in 0usize..4,
            torn_tail in 0usize..100,
        ) {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            rt.block_on(async {
                let dir = tempfile::tempdir().unwrap();
                let blobs: Vec<(Digest, Bytes)> = sizes
                    .iter()
                    .enumerate()
                    .map(|(i, n)| {
                        let b = Bytes::from((0..*n).map(|j| (j * 131 + i * 7) as u8).collect::<Vec<u8>>());
                        (DigestFunction::Sha256.digest_of(&b), b)
                    })
                    .collect();
                let store = FsStore::open(dir.path(), 1 << 30).await.unwrap();
                futures::future::try_join_all(blobs.iter().map(|(d, b)| store.put(d, b.clone()))).await.unwrap();
                store.crash();
                for ((d, _), damage) in blobs.iter().zip(&damage) {
                    let path = blob_path(dir.path(), d);
                    // The crash may have come before the journal's placer wrote it.
                    fs::create_dir_all(path.parent().unwrap()).unwrap();
                    match damage {
                        Damage::None => {}
                        Damage::Gone => {
                            let _ = fs::remove_file(&path);
                        }
                        Damage::Zeroed => fs::write(&path, vec![0u8; d.size as usize]).unwrap(),
                        Damage::Truncated => fs::write(&path, b"").unwrap(),
                    }
                }
                let garbage: Vec<Digest> = (0..garbage)
                    .map(|i| {
                        let d = DigestFunction::Sha256.digest_of(format!("never acknowledged {i}").as_bytes());
                        let path = blob_path(dir.path(), &d);
                        fs::create_dir_all(path.parent().unwrap()).unwrap();
                        fs::write(&path, vec![0xAB; d.size as usize]).unwrap();
                        d
                    })
                    .collect();
                let segment = fs::read_dir(dir.path().join("journal"))
                    .unwrap()
                    .map(|e| e.unwrap().path())
                    .find(|p| p.to_string_lossy().ends_with(".journal"))
                    .unwrap();
                File::options().append(true).open(&segment).unwrap().write_all(&vec![0x47; torn_tail]).unwrap();

                let store = FsStore::open(dir.path(), 1 << 30).await.unwrap();
                for (d, b) in &blobs {
                    assert_eq!(&store.get(d).await.unwrap(), b, "{d}");
                }
                for d in &garbage {
                    assert!(!store.has(d).await.unwrap(), "unacknowledged garbage {d} is served");
                }
                let unique: std::collections::HashSet<_> = blobs.iter().map(|(d, _)| *d).collect();
                assert_eq!(store.usage().blobs, unique.len() as u64);
            });
        }
    }

    /// A process opening a directory that another uses leaves the other's temp files
    /// alone: an upload in progress there still commits.
    #[tokio::test]
    async fn an_open_beside_a_live_process_keeps_its_uploads_in_progress() {
        let dir = tempfile::tempdir().unwrap();
        let a = FsStore::open(dir.path(), 1 << 30).await.unwrap();
        let data = Bytes::from(vec![5u8; 3 << 20]);
        let d = DigestFunction::Sha256.digest_of(&data);
        let mut w = a.begin_write(&d).await.unwrap();
        w.write(data.slice(..2 << 20)).await.unwrap(); // spilled to a temp file
        let b = FsStore::open(dir.path(), 1 << 30).await.unwrap();
        w.write(data.slice(2 << 20..)).await.unwrap();
        w.commit().await.unwrap();
        assert_eq!(b.get(&d).await.unwrap(), data);
        // Once every process is gone, the next open is alone and clears what is left.
        let leftover = dir.path().join("tmp").join("left-by-a-crash");
        fs::write(&leftover, b"x").unwrap();
        drop((a, b));
        let _c = FsStore::open(dir.path(), 1 << 30).await.unwrap();
        assert!(!leftover.exists());
    }

    #[tokio::test]
    async fn dropped_writer_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path(), 1 << 30).await.unwrap();
        let data = Bytes::from(vec![1u8; 2 << 20]);
        let d = DigestFunction::Sha256.digest_of(&data);
        let mut w = store.begin_write(&d).await.unwrap();
        w.write(data.slice(..(1 << 20) + 10)).await.unwrap();
        drop(w);
        assert_eq!(fs::read_dir(dir.path().join("tmp")).unwrap().count(), 0);
        assert!(!store.has(&d).await.unwrap());
    }

    #[tokio::test]
    async fn restart_rebuilds_index_and_lru_order_from_mtime() {
        let dir = tempfile::tempdir().unwrap();
        let blobs: Vec<Bytes> = (0..3u8).map(|i| Bytes::from(vec![i; 100])).collect();
        let ds: Vec<Digest> = blobs.iter().map(|b| DigestFunction::Sha256.digest_of(b)).collect();
        {
            let store = FsStore::open(dir.path(), 1000).await.unwrap();
            for (b, d) in blobs.iter().zip(&ds) {
                store.put(d, b.clone()).await.unwrap();
                // Each file in place before the next is written, with distinct mtimes, so
                // that the rebuilt order is unambiguous.
                store.wait_placed();
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            assert_eq!(store.usage().blobs, 3);
        }
        // Reopen with room for two: the oldest (first written) goes.
        let store = FsStore::open(dir.path(), 250).await.unwrap();
        assert_eq!(store.find_present(&ds).await.unwrap(), vec![false, true, true]);
        assert_eq!(store.usage().used_bytes, 200);
        assert_eq!(store.get(&ds[2]).await.unwrap(), blobs[2]);
        assert!(!blob_path(dir.path(), &ds[0]).exists());
    }

    #[tokio::test]
    async fn a_file_put_in_place_for_a_hard_link_is_not_replaced_by_the_placer_or_by_path_of() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path(), 1 << 20).await.unwrap();
        // (digest, inode) of each blob whose file `path_of` made before the placer did.
        let mut made = Vec::new();
        for i in 0..20u8 {
            let data = Bytes::from(vec![i; 1000]);
            let d = DigestFunction::Sha256.digest_of(&data);
            store.put(&d, data).await.unwrap();
            let before = blob_path(dir.path(), &d).exists();
            let path = store.path_of(&d).unwrap().unwrap();
            if !before {
                let ino = fs::metadata(&path).unwrap().ino();
                // A worker links it and looks again (to set its mode, to link it into
                // the next action) before the placer has been by: the same file.
                let again = store.path_of(&d).unwrap().unwrap();
                assert_eq!(fs::metadata(&again).unwrap().ino(), ino, "{d}: path_of wrote it a second time");
                made.push((d, ino));
            }
        }
        // The placer waits for a pause in the writes: most files are made by path_of.
        assert!(!made.is_empty(), "every blob was placed before path_of looked");
        store.wait_placed();
        for (d, ino) in made {
            let m = fs::metadata(blob_path(dir.path(), &d)).unwrap();
            assert_eq!(m.ino(), ino, "{d}: the placer wrote a second copy over the first");
            assert_eq!(m.len(), 1000);
        }
        assert_eq!(fs::read_dir(dir.path().join("tmp")).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn a_store_for_links_makes_its_files_read_only_and_path_of_never_replaces_one() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FsStore::open_for_links(dir.path(), 1 << 20, 0o555).await.unwrap());
        for i in 0..20u8 {
            let data = Bytes::from(vec![i; 300]);
            let d = DigestFunction::Sha256.digest_of(&data);
            store.put(&d, data).await.unwrap();
            // Workers of one cache ask at once, while the journal still holds the blob.
            let askers: Vec<_> = (0..4)
                .map(|_| {
                    let store = store.clone();
                    std::thread::spawn(move || {
                        let m = fs::metadata(store.path_of(&d).unwrap().unwrap()).unwrap();
                        (m.ino(), m.mode() & 0o777)
                    })
                })
                .collect();
            let seen: Vec<(u64, u32)> = askers.into_iter().map(|a| a.join().unwrap()).collect();
            store.wait_placed();
            let m = fs::metadata(blob_path(dir.path(), &d)).unwrap();
            assert!(seen.iter().all(|s| *s == (m.ino(), 0o555)), "{d}: {seen:?}, then {}", m.ino());
        }
    }

    #[tokio::test]
    async fn externally_deleted_file_is_a_clean_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path(), 1 << 20).await.unwrap();
        let data = Bytes::from_static(b"hello");
        let d = DigestFunction::Sha256.digest_of(&data);
        store.put(&d, data).await.unwrap();
        store.wait_placed();
        fs::remove_file(blob_path(dir.path(), &d)).unwrap();
        assert!(store.read(&d, 0, None).await.err().unwrap().is_not_found());
        assert!(!store.has(&d).await.unwrap(), "index forgets a vanished blob");
    }

    #[tokio::test]
    async fn two_processes_sharing_a_directory_see_each_others_blobs() {
        let dir = tempfile::tempdir().unwrap();
        let a = FsStore::open(dir.path(), 1 << 20).await.unwrap();
        let b = FsStore::open(dir.path(), 1 << 20).await.unwrap();
        let data = Bytes::from_static(b"written by a");
        let d = DigestFunction::Sha256.digest_of(&data);
        let other = DigestFunction::Sha256.digest_of(b"nobody wrote this");
        assert_eq!(b.find_present(&[d, other]).await.unwrap(), [false, false]);
        a.put(&d, data.clone()).await.unwrap();
        // b never saw the write, and finds the blob on disk all the same.
        assert_eq!(b.find_present(&[other, d]).await.unwrap(), [false, true]);
        assert_eq!(b.usage().blobs, 1, "adopted into b's index");
        let fresh = FsStore::open(dir.path().join("unused"), 1 << 20).await.unwrap();
        drop(fresh);
        let c = FsStore::open(dir.path(), 1 << 20).await.unwrap();
        let data2 = Bytes::from_static(b"also written by a");
        let d2 = DigestFunction::Sha256.digest_of(&data2);
        a.put(&d2, data2.clone()).await.unwrap();
        assert_eq!(c.get(&d2).await.unwrap(), data2, "a read adopts too");
        // A file of the wrong size under a blob's name is not taken for the blob.
        let bad = DigestFunction::Sha256.digest_of(b"0123456789");
        let path = blob_path(dir.path(), &bad);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, b"short").unwrap();
        assert_eq!(b.find_present(&[bad]).await.unwrap(), [false]);
    }

    #[tokio::test]
    async fn a_store_alone_answers_presence_from_its_index_until_another_opens_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let a = FsStore::open(dir.path(), 1 << 20).await.unwrap();
        // Alone, no other process can have written a file: the index answers (a file put
        // there by hand is not looked for). A read still looks on disk.
        let d = DigestFunction::Sha256.digest_of(b"not through the store");
        let path = blob_path(dir.path(), &d);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, b"not through the store").unwrap();
        assert_eq!(a.find_present(&[d]).await.unwrap(), [false]);
        assert_eq!(a.get(&d).await.unwrap(), Bytes::from_static(b"not through the store"));
        // Once another process has opened the directory, a looks on disk for what its
        // index lacks.
        let b = FsStore::open(dir.path(), 1 << 20).await.unwrap();
        let by_b = Bytes::from_static(b"written by b");
        let e = DigestFunction::Sha256.digest_of(&by_b);
        b.put(&e, by_b).await.unwrap();
        b.wait_placed();
        assert_eq!(a.find_present(&[e]).await.unwrap(), [true]);
    }
}
