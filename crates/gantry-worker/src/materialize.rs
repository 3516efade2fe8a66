//! Materializing an input root: the Directory tree is read from the CAS, every file is
//! brought into the worker's local cache once ([`InputCache`]), then hard-linked into the
//! action's fresh directory. Names are validated so a malicious tree cannot escape the
//! directory.

use std::collections::{HashMap, VecDeque};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use futures::{StreamExt, TryStreamExt};
use gantry_core::reapi::Directory;
use gantry_core::task::{spawn_named, TaskGuard};
use gantry_core::{BlobStore, Digest, DigestFunction, Error, Result, ResultExt};

use crate::executor::remove_tree;
use gantry_store::{Adoption, FsStore};
use prost::Message;

/// Files fetched into the cache at once.
const FETCH_CONCURRENCY: usize = 8;
/// At most this many input files and symlinks (files of at most
/// [`crate::INLINE_FILE_BYTES`] in all) are placed on the runtime's thread rather than the
/// blocking pool.
const INLINE_PLACE_FILES: usize = 16;

/// The worker's input cache: each input file once, as a read-only file that actions get
/// hard links to. A hard link shares its mode with the cache's file, so executables are
/// kept apart, in files of mode 0555: before, each action got its own copy of every
/// executable input, a whole compiler per action for a toolchain, and on ext4 without a
/// journal every inode freed and made again is dear (see `ActionDirs`).
pub struct InputCache {
    /// Files linked with mode 0444.
    files: FsStore,
    /// Files linked with mode 0555.
    executables: FsStore,
    /// The most bytes of executables one action's inputs may hold to be linked from
    /// `executables`: more would evict the action's own earlier ones before they are
    /// linked. Past it, they are kept with the plain files and copied into the action.
    executable_max: u64,
    /// Outputs being taken in ([`InputCache::adopt`]); aborted with the cache.
    adopting: Mutex<Vec<TaskGuard>>,
}

/// An output larger than this share of the executables' bytes is not kept: it would evict
/// much to make room for one file that may never be an input here.
const ADOPT_SHARE: u64 = 64;

impl InputCache {
    /// Opens the cache under `dir`: `max_bytes` for plain files (`cache/`), as before
    /// executables were kept apart, and half as much again for executables (`cache-x/`).
    /// Bazel marks every file an action generated executable, so in its input trees the
    /// generated files are executables and the sources are not.
    pub async fn open(dir: &Path, max_bytes: u64) -> Result<InputCache> {
        let executable_max = max_bytes / 2;
        Ok(InputCache {
            files: FsStore::open_for_links(dir.join("cache"), max_bytes, 0o444).await?,
            executables: FsStore::open_for_links(dir.join("cache-x"), executable_max, 0o555).await?,
            executable_max,
            adopting: Mutex::new(Vec::new()),
        })
    }

    /// Keeps the files of an action's outputs as cache entries, by link, so that a later
    /// action here that takes one as an input gets it with no fetch and no new file: a
    /// build's generated files mostly are inputs of its next actions, and on a remote
    /// worker each fetch is a download of what it just uploaded. They go with the
    /// executables, because Bazel marks every generated file executable in the input
    /// trees of the actions that use it. The caller guarantees that nothing will write
    /// to the files again (every process of the action has ended). Each file is linked
    /// now; its journal record and name follow in the background.
    pub fn adopt(&self, outputs: Vec<crate::outputs::WrittenFile>) {
        let adoptions: Vec<Adoption> = outputs
            .into_iter()
            .filter(|w| w.digest.size <= self.executable_max / ADOPT_SHARE)
            .filter_map(|w| self.executables.adopt(&w.digest, w.data, &w.path))
            .collect();
        if adoptions.is_empty() {
            return;
        }
        let task = spawn_named("adopt-outputs", async move {
            // Together, so that their journal records share a sync.
            for outcome in futures::future::join_all(adoptions.into_iter().map(Adoption::finish)).await {
                // The cache only misses a file it could have had: the next action that
                // needs it fetches it. A failure here is one of the disk's, which the
                // next write to the cache reports to its action.
                if let Err(e) = outcome {
                    tracing::warn!(error = %e, "could not keep an action's output in the input cache");
                }
            }
        });
        let mut adopting = self.adopting.lock().unwrap_or_else(|p| p.into_inner());
        adopting.retain(|t| !t.is_finished());
        adopting.push(task);
    }

    fn store(&self, executable: bool) -> &FsStore {
        if executable {
            &self.executables
        } else {
            &self.files
        }
    }

    /// Whether the executables among `files` (one action's inputs) are linked from
    /// `executables`: they fit in it together. Otherwise they are copied.
    fn links_executables(&self, files: &[FileEntry]) -> bool {
        let mut executables: Vec<Digest> = files.iter().filter(|e| e.executable).map(|e| e.digest).collect();
        executables.sort();
        executables.dedup();
        executables.iter().map(|d| d.size).sum::<u64>() <= self.executable_max
    }
}

pub struct Materializer {
    pub cas: Arc<dyn BlobStore>,
    pub cache: Arc<InputCache>,
    /// Where directories are made from ([`SpareDirs::create_dir_all`]).
    pub dirs: crate::spare_dirs::SpareDirs,
}

struct FileEntry {
    path: PathBuf,
    digest: Digest,
    executable: bool,
}

fn check_name(name: &str, what: &str) -> Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(Error::invalid(format!("input tree: invalid {what} name '{name}'")));
    }
    Ok(())
}

impl Materializer {
    /// Creates the input tree under `root` (which must exist, holding nothing but the
    /// empty directories `kept`, each listed after its parent). Those the tree or `made`
    /// (directories the caller will make, with their parents) need stay; the others are
    /// moved aside first, so the command sees exactly its declared directories. Returns
    /// the number of files and bytes materialized.
    pub async fn materialize<'m>(
        &self,
        f: DigestFunction,
        input_root: Digest,
        root: &Path,
        kept: &[PathBuf],
        made: impl IntoIterator<Item = &'m Path>,
    ) -> Result<(usize, u64)> {
        let mut dirs: Vec<PathBuf> = Vec::new();
        let mut files = Vec::new();
        let mut symlinks = Vec::new();
        let mut queue = VecDeque::from([(input_root, root.to_path_buf())]);
        let mut fetched: HashMap<Digest, Directory> = HashMap::new();
        while let Some((d, path)) = queue.pop_front() {
            let dir = match fetched.get(&d) {
                Some(dir) => dir.clone(),
                None => {
                    let bytes = self.cas.get(&d).await.map_err(|e| {
                        if e.is_not_found() {
                            Error::MissingBlobs { what: "input directory".into(), digests: vec![d] }
                        } else {
                            e
                        }
                    })?;
                    let dir = Directory::decode(bytes)
                        .map_err(|e| Error::invalid(format!("input directory {d} does not decode: {e}")))?;
                    fetched.insert(d, dir.clone());
                    dir
                }
            };
            dirs.push(path.clone());
            // REAPI requires names sorted and unique within a directory; a duplicate would
            // make two inputs share a path, so it is refused rather than guessed at.
            let mut names: Vec<&str> = dir
                .files
                .iter()
                .map(|f| f.name.as_str())
                .chain(dir.directories.iter().map(|d| d.name.as_str()))
                .chain(dir.symlinks.iter().map(|s| s.name.as_str()))
                .collect();
            names.sort_unstable();
            if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
                return Err(Error::invalid(format!("input directory {d}: name '{}' appears twice", w[0])));
            }
            for file in &dir.files {
                check_name(&file.name, "file")?;
                files.push(FileEntry {
                    path: path.join(&file.name),
                    digest: Digest::from_proto(f, file.digest.as_ref(), &format!("file {}", file.name))?,
                    executable: file.is_executable,
                });
            }
            for sub in &dir.directories {
                check_name(&sub.name, "directory")?;
                queue.push_back((
                    Digest::from_proto(f, sub.digest.as_ref(), &format!("directory {}", sub.name))?,
                    path.join(&sub.name),
                ));
            }
            for link in &dir.symlinks {
                check_name(&link.name, "symlink")?;
                symlinks.push((path.join(&link.name), link.target.clone()));
            }
        }
        if !kept.is_empty() {
            let mut needed: std::collections::HashSet<&Path> = dirs.iter().map(PathBuf::as_path).collect();
            for d in made {
                needed.extend(d.ancestors().take_while(|a| a.starts_with(root)));
            }
            for k in kept {
                // The topmost of a subtree no longer needed takes its subtree with it (the
                // root is needed: it is the tree's first directory).
                let parent_stays = k.parent().is_some_and(|p| needed.contains(p));
                if !needed.contains(k.as_path()) && parent_stays && !self.dirs.recycle_tree(k) && !remove_tree(k) {
                    return Err(Error::internal(format!(
                        "could not remove the directory {} an earlier action left",
                        k.display()
                    )));
                }
            }
        }
        for d in &dirs {
            self.dirs.create_dir_all(d).context(format_args!("creating {}", d.display()))?;
        }
        let link_executables = self.cache.links_executables(&files);
        self.fill_cache(&files, link_executables).await?;
        let bytes: u64 = files.iter().map(|e| e.digest.size).sum();
        let count = files.len();
        let cache = self.cache.clone();
        // Mostly hard links, so a few small files do not wait long, even copied.
        let small = count + symlinks.len() <= INLINE_PLACE_FILES && bytes <= crate::INLINE_FILE_BYTES;
        crate::blocking_unless_small(small, move || -> Result<()> {
            for e in &files {
                let linked_executable = e.executable && link_executables;
                let src = cache
                    .store(linked_executable)
                    .path_of(&e.digest)?
                    .ok_or_else(|| Error::internal(format!("input {} vanished from the worker cache", e.digest)))?;
                match (e.executable, linked_executable) {
                    (true, false) => copy_executable(&src, &e.path)?,
                    (_, x) => place(&src, &e.path, if x { 0o555 } else { 0o444 })?,
                }
            }
            for (path, target) in &symlinks {
                std::os::unix::fs::symlink(target, path)
                    .context(format_args!("creating symlink {}", path.display()))?;
            }
            Ok(())
        })
        .await?;
        Ok((count, bytes))
    }

    /// Brings every missing input into the local cache, a few at a time.
    async fn fill_cache(&self, files: &[FileEntry], link_executables: bool) -> Result<()> {
        let (mut plain, mut executable): (Vec<Digest>, Vec<Digest>) = (Vec::new(), Vec::new());
        for e in files {
            if e.executable && link_executables {
                executable.push(e.digest)
            } else {
                plain.push(e.digest)
            }
        }
        let mut missing = Vec::new();
        for (is_executable, mut digests) in [(false, plain), (true, executable)] {
            digests.sort();
            digests.dedup();
            let present = self.cache.store(is_executable).find_present(&digests).await?;
            missing.extend(digests.into_iter().zip(present).filter(|(_, p)| !p).map(|(d, _)| (d, is_executable)));
        }
        // Report every input the CAS lacks at once, so the client uploads them in one go.
        let wanted: Vec<Digest> = missing.iter().map(|(d, _)| *d).collect();
        let in_cas = self.cas.find_present(&wanted).await?;
        let mut absent: Vec<Digest> = wanted.iter().zip(&in_cas).filter(|(_, p)| !**p).map(|(d, _)| *d).collect();
        if !absent.is_empty() {
            absent.sort();
            absent.dedup();
            return Err(Error::MissingBlobs { what: "input files".into(), digests: absent });
        }
        futures::stream::iter(missing)
            .map(|(d, is_executable)| async move {
                let store = self.cache.store(is_executable);
                let mut src = self.cas.read(&d, 0, None).await.map_err(|e| {
                    if e.is_not_found() {
                        Error::MissingBlobs { what: "input file".into(), digests: vec![d] }
                    } else {
                        e
                    }
                })?;
                let mut w = store.begin_write(&d).await?;
                while let Some(chunk) = src.next().await {
                    w.write(chunk?).await?;
                }
                // Its file is made read-only (`open_for_links`): links to it cannot write.
                w.commit().await?;
                Ok::<(), Error>(())
            })
            .buffer_unordered(FETCH_CONCURRENCY)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }
}

/// An executable of an action whose executables do not fit the cache's: a copy of its own.
fn copy_executable(src: &Path, dest: &Path) -> Result<()> {
    std::fs::copy(src, dest).context(format_args!("copying input {}", dest.display()))?;
    std::fs::set_permissions(dest, std::fs::Permissions::from_mode(0o555))
        .context(format_args!("chmod {}", dest.display()))
}

/// Links the cache's file `src` at `dest`; it is to have `mode` (0444 or 0555).
fn place(src: &Path, dest: &Path, mode: u32) -> Result<()> {
    match std::fs::hard_link(src, dest) {
        // An action may have changed the mode of the one inode all links share: set it
        // back.
        Ok(()) if mode & 0o111 != 0 => {
            let meta = std::fs::metadata(dest).context(format_args!("reading input {}", dest.display()))?;
            if meta.permissions().mode() & 0o777 == mode {
                return Ok(());
            }
            std::fs::set_permissions(dest, std::fs::Permissions::from_mode(mode))
                .context(format_args!("chmod {}", dest.display()))
        }
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) || e.raw_os_error() == Some(libc::EMLINK) => {
            // Different filesystem, or link limits: a copy, into a new file only, so an
            // existing path (a hard link into the cache) is never truncated.
            let mut from =
                std::fs::File::open(src).context(format_args!("opening cached input for {}", dest.display()))?;
            let mut to = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(dest)
                .context(format_args!("creating input {}", dest.display()))?;
            std::io::copy(&mut from, &mut to).context(format_args!("copying input {}", dest.display()))?;
            std::fs::set_permissions(dest, std::fs::Permissions::from_mode(mode))
                .context(format_args!("chmod {}", dest.display()))
        }
        Err(e) => Err(Error::io(format!("linking input {}", dest.display()), e)),
    }
}
