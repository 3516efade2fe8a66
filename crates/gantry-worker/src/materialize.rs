//! Materializing an input root: the Directory tree is read from the CAS, every file is
//! brought into the worker's local cache once, then hard-linked into the action's fresh
//! directory (executables are copied, since a hard link shares permission bits with the
//! cache file). Names are validated so a malicious tree cannot escape the directory.

use std::collections::{HashMap, VecDeque};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use gantry_core::reapi::Directory;
use gantry_core::{BlobStore, Digest, DigestFunction, Error, Result, ResultExt};
use gantry_store::FsStore;
use prost::Message;

/// Files fetched into the cache at once.
const FETCH_CONCURRENCY: usize = 8;
/// At most this many input files and symlinks (files of at most
/// [`crate::INLINE_FILE_BYTES`] in all) are placed on the runtime's thread rather than the
/// blocking pool.
const INLINE_PLACE_FILES: usize = 16;

pub struct Materializer {
    pub cas: Arc<dyn BlobStore>,
    pub cache: Arc<FsStore>,
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
    /// Creates the input tree under `root` (which must exist). Returns the number of
    /// files and bytes materialized.
    pub async fn materialize(&self, f: DigestFunction, input_root: Digest, root: &Path) -> Result<(usize, u64)> {
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
            self.dirs.create_dir_all(&path).context(format_args!("creating {}", path.display()))?;
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
        self.fill_cache(&files).await?;
        let bytes: u64 = files.iter().map(|e| e.digest.size).sum();
        let count = files.len();
        let cache = self.cache.clone();
        // Mostly hard links, so a few small files do not wait long, even copied.
        let small = count + symlinks.len() <= INLINE_PLACE_FILES && bytes <= crate::INLINE_FILE_BYTES;
        crate::blocking_unless_small(small, move || -> Result<()> {
            for e in &files {
                let src = cache
                    .path_of(&e.digest)
                    .ok_or_else(|| Error::internal(format!("input {} vanished from the worker cache", e.digest)))?;
                place(&src, &e.path, e.executable)?;
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
    async fn fill_cache(&self, files: &[FileEntry]) -> Result<()> {
        let mut unique: Vec<Digest> = files.iter().map(|e| e.digest).collect();
        unique.sort();
        unique.dedup();
        let present = self.cache.find_present(&unique).await?;
        let missing: Vec<Digest> = unique.into_iter().zip(present).filter(|(_, p)| !p).map(|(d, _)| d).collect();
        // Report every input the CAS lacks at once, so the client uploads them in one go.
        let in_cas = self.cas.find_present(&missing).await?;
        let absent: Vec<Digest> = missing.iter().zip(&in_cas).filter(|(_, p)| !**p).map(|(d, _)| *d).collect();
        if !absent.is_empty() {
            return Err(Error::MissingBlobs { what: "input files".into(), digests: absent });
        }
        futures::stream::iter(missing)
            .map(|d| async move {
                let mut src = self.cas.read(&d, 0, None).await.map_err(|e| {
                    if e.is_not_found() {
                        Error::MissingBlobs { what: "input file".into(), digests: vec![d] }
                    } else {
                        e
                    }
                })?;
                let mut w = self.cache.begin_write(&d).await?;
                while let Some(chunk) = src.next().await {
                    w.write(chunk?).await?;
                }
                w.commit().await?;
                // Cache files are shared by hard links: make accidental writes fail.
                if let Some(p) = self.cache.path_of(&d) {
                    let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o444));
                }
                Ok::<(), Error>(())
            })
            .buffer_unordered(FETCH_CONCURRENCY)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }
}

fn place(src: &Path, dest: &Path, executable: bool) -> Result<()> {
    if executable {
        std::fs::copy(src, dest).context(format_args!("copying input {}", dest.display()))?;
        std::fs::set_permissions(dest, std::fs::Permissions::from_mode(0o555))
            .context(format_args!("chmod {}", dest.display()))?;
        return Ok(());
    }
    match std::fs::hard_link(src, dest) {
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
            std::fs::set_permissions(dest, std::fs::Permissions::from_mode(0o444))
                .context(format_args!("chmod {}", dest.display()))
        }
        Err(e) => Err(Error::io(format!("linking input {}", dest.display()), e)),
    }
}
