//! Staging and committing outputs.
//!
//! Each branch works in its own temporary directory inside the input root (same
//! filesystem, so committing is a rename). Remote outputs are downloaded there under
//! unique counter names, never names derived from their paths: a derived name breaks
//! tree outputs or grows past NAME_MAX (the lesson of Bazel's dynamic strategy). Only
//! once a branch has everything staged does it take the output lock and rename its
//! outputs into place; a directory replaces an existing one with an atomic exchange, so
//! a reader never sees it missing or half-written.

use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use gantry_core::reapi::{ActionResult, Directory, Tree};
use gantry_core::{BlobStore, Digest, DigestFunction};
use prost::Message;

use crate::action::TEMP_PREFIX;
use crate::{Error, Result};

/// A per-branch temporary directory. `remove` is the normal way out; dropping it
/// removes it too, so a panic or an aborted run leaves nothing behind either.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
    removed: bool,
}

impl TempDir {
    /// Creates `root/.gantry-run-<uuid>-<tag>`.
    pub fn create(root: &Path, tag: &str) -> Result<TempDir> {
        let path = root.join(format!("{TEMP_PREFIX}{}-{tag}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir(&path).map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        Ok(TempDir { path, removed: false })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn remove(&mut self) {
        if !self.removed {
            gantry_worker::executor::remove_tree(&self.path);
            self.removed = true;
        }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        self.remove();
    }
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

/// A fresh name inside a staging directory.
pub fn unique_name(dir: &Path) -> PathBuf {
    dir.join(UNIQUE.fetch_add(1, Ordering::Relaxed).to_string())
}

/// One output ready to be moved into place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staged {
    /// The declared output path, relative to the working directory.
    pub rel: String,
    /// Where it is staged now.
    pub path: PathBuf,
}

/// The output lock: an exclusive `flock` on the working directory itself, so that two
/// `gantry run`s writing into the same directory commit one at a time without leaving
/// a lock file behind.
pub struct OutputLock {
    _dir: std::fs::File,
}

impl OutputLock {
    /// Takes the lock if it is free.
    pub fn try_acquire(dir: &Path) -> Result<Option<OutputLock>> {
        use std::os::fd::AsRawFd;
        let f = std::fs::File::open(dir).map_err(|e| Error::io(format!("opening {} to lock it", dir.display()), e))?;
        // SAFETY: flock(2) on a file descriptor we own; no memory is passed.
        let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r == 0 {
            return Ok(Some(OutputLock { _dir: f }));
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            Ok(None)
        } else {
            Err(Error::io(format!("locking {}", dir.display()), e))
        }
    }
}

fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    let ca = std::ffi::CString::new(a.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let cb = std::ffi::CString::new(b.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: both paths are valid NUL-terminated strings that outlive the call.
    let r = unsafe { libc::renameat2(libc::AT_FDCWD, ca.as_ptr(), libc::AT_FDCWD, cb.as_ptr(), libc::RENAME_EXCHANGE) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Moves the staged outputs into `outdir`, and moves away declared outputs the winner
/// did not produce (a stale file must not pass for this run's output). Whatever is
/// replaced ends up in `trash`, which the caller removes with its temp dir.
/// Must be called with the output lock held.
pub fn move_into_place(outdir: &Path, staged: &[Staged], declared: &[String], trash: &Path) -> Result<()> {
    for rel in declared {
        if staged.iter().any(|s| &s.rel == rel) {
            continue;
        }
        let dest = outdir.join(rel);
        if std::fs::symlink_metadata(&dest).is_ok() {
            std::fs::rename(&dest, unique_name(trash))
                .map_err(|e| Error::io(format!("moving away stale output {}", dest.display()), e))?;
        }
    }
    for s in staged {
        let dest = outdir.join(&s.rel);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
        }
        let staged_is_dir = std::fs::symlink_metadata(&s.path).map(|m| m.is_dir()).unwrap_or(false);
        match std::fs::symlink_metadata(&dest) {
            // rename(2) cannot replace a directory (or put one over a file): swap them
            // atomically, then the old one is in the staging area and goes with it.
            Ok(m) if m.is_dir() || staged_is_dir => {
                exchange(&s.path, &dest).map_err(|e| Error::io(format!("replacing output {}", dest.display()), e))?;
                std::fs::rename(&s.path, unique_name(trash))
                    .map_err(|e| Error::io(format!("moving away old output {}", dest.display()), e))?;
            }
            _ => std::fs::rename(&s.path, &dest)
                .map_err(|e| Error::io(format!("moving output {} into place", dest.display()), e))?,
        }
    }
    Ok(())
}

/// Downloads blobs into a staging directory.
pub struct Downloader {
    pub cas: Arc<dyn BlobStore>,
    pub function: DigestFunction,
}

impl Downloader {
    pub async fn file(&self, d: Digest, path: &Path, executable: bool) -> Result<()> {
        use tokio::io::AsyncWriteExt;
        let mut out =
            tokio::fs::File::create(path).await.map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        if d.size > 0 {
            let mut s = self.cas.read(&d, 0, None).await?;
            while let Some(chunk) = s.next().await {
                out.write_all(&chunk?).await.map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
            }
        }
        out.flush().await.map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
        let mode = if executable { 0o755 } else { 0o644 };
        tokio::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .await
            .map_err(|e| Error::io(format!("chmod {}", path.display()), e))?;
        Ok(())
    }

    async fn bytes(&self, inline: &[u8], d: Option<&gantry_core::reapi::Digest>, what: &str) -> Result<Bytes> {
        if !inline.is_empty() {
            return Ok(Bytes::copy_from_slice(inline));
        }
        match d {
            Some(p) => {
                let d = Digest::from_proto(self.function, Some(p), what)?;
                if d.size == 0 {
                    Ok(Bytes::new())
                } else {
                    Ok(self.cas.get(&d).await?)
                }
            }
            None => Ok(Bytes::new()),
        }
    }

    /// Recreates a Tree under `dir` (which must not exist).
    pub async fn tree(&self, tree_digest: Digest, dir: &Path) -> Result<()> {
        let tree = Tree::decode(self.cas.get(&tree_digest).await?)
            .map_err(|e| gantry_core::Error::invalid(format!("output tree {tree_digest} does not decode: {e}")))?;
        let mut children = std::collections::HashMap::new();
        for c in &tree.children {
            children.insert(self.function.digest_of(&c.encode_to_vec()), c.clone());
        }
        let root = tree.root.unwrap_or_default();
        let mut queue = vec![(root, dir.to_path_buf())];
        while let Some((d, path)) = queue.pop() {
            tokio::fs::create_dir(&path).await.map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
            for f in &d.files {
                check_name(&f.name)?;
                let digest = Digest::from_proto(self.function, f.digest.as_ref(), &f.name)?;
                self.file(digest, &path.join(&f.name), f.is_executable).await?;
            }
            for s in &d.symlinks {
                check_name(&s.name)?;
                std::os::unix::fs::symlink(&s.target, path.join(&s.name))
                    .map_err(|e| Error::io(format!("creating symlink {}", path.join(&s.name).display()), e))?;
            }
            for sub in &d.directories {
                check_name(&sub.name)?;
                let digest = Digest::from_proto(self.function, sub.digest.as_ref(), &sub.name)?;
                let child: Directory = children.get(&digest).cloned().ok_or_else(|| {
                    gantry_core::Error::invalid(format!("output tree {tree_digest} lacks directory {digest}"))
                })?;
                queue.push((child, path.join(&sub.name)));
            }
        }
        Ok(())
    }

    /// Downloads every output of `result` into `stage` under unique names, and the
    /// command's stdout and stderr into memory.
    pub async fn result(&self, result: &ActionResult, stage: &Path) -> Result<(Vec<Staged>, Bytes, Bytes)> {
        let mut staged = Vec::new();
        for f in &result.output_files {
            let d = Digest::from_proto(self.function, f.digest.as_ref(), &f.path)?;
            let path = unique_name(stage);
            self.file(d, &path, f.is_executable).await?;
            staged.push(Staged { rel: f.path.clone(), path });
        }
        for o in &result.output_directories {
            let d = Digest::from_proto(self.function, o.tree_digest.as_ref(), &o.path)?;
            let path = unique_name(stage);
            self.tree(d, &path).await?;
            staged.push(Staged { rel: o.path.clone(), path });
        }
        #[allow(deprecated)]
        let links =
            result.output_symlinks.iter().chain(&result.output_file_symlinks).chain(&result.output_directory_symlinks);
        for l in links {
            if staged.iter().any(|s| s.rel == l.path) {
                continue; // servers may report a symlink in both the new and old fields
            }
            let path = unique_name(stage);
            std::os::unix::fs::symlink(&l.target, &path)
                .map_err(|e| Error::io(format!("creating symlink {}", path.display()), e))?;
            staged.push(Staged { rel: l.path.clone(), path });
        }
        let stdout = self.bytes(&result.stdout_raw, result.stdout_digest.as_ref(), "stdout").await?;
        let stderr = self.bytes(&result.stderr_raw, result.stderr_digest.as_ref(), "stderr").await?;
        Ok((staged, stdout, stderr))
    }
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(Error::invalid(format!("output tree has an invalid name '{name}'")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(p: &Path) -> String {
        std::fs::read_to_string(p).unwrap()
    }

    #[test]
    fn directories_and_files_replace_what_was_there() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("out");
        std::fs::create_dir_all(out.join("tree/old")).unwrap();
        std::fs::write(out.join("tree/old/f"), "old").unwrap();
        std::fs::write(out.join("file"), "old").unwrap();
        std::fs::write(out.join("stale"), "old").unwrap();
        let mut tmp = TempDir::create(d.path(), "t").unwrap();
        let t = unique_name(tmp.path());
        std::fs::create_dir_all(t.join("new")).unwrap();
        std::fs::write(t.join("new/f"), "new").unwrap();
        let f = unique_name(tmp.path());
        std::fs::write(&f, "new").unwrap();
        let g = unique_name(tmp.path());
        std::fs::write(&g, "fresh").unwrap();
        let staged = vec![
            Staged { rel: "tree".into(), path: t },
            Staged { rel: "file".into(), path: f },
            Staged { rel: "sub/dir/g".into(), path: g },
        ];
        let declared = vec!["tree".into(), "file".into(), "sub/dir/g".into(), "stale".into()];
        move_into_place(&out, &staged, &declared, tmp.path()).unwrap();
        assert_eq!(read(&out.join("tree/new/f")), "new");
        assert!(!out.join("tree/old").exists());
        assert_eq!(read(&out.join("file")), "new");
        assert_eq!(read(&out.join("sub/dir/g")), "fresh");
        assert!(!out.join("stale").exists(), "a declared output the winner did not produce is not left stale");
        tmp.remove();
        let left: Vec<_> = std::fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("out")]);
    }

    #[test]
    fn the_lock_is_exclusive_and_leaves_no_file() {
        let d = tempfile::tempdir().unwrap();
        let a = OutputLock::try_acquire(d.path()).unwrap();
        assert!(a.is_some());
        assert!(OutputLock::try_acquire(d.path()).unwrap().is_none());
        drop(a);
        assert!(OutputLock::try_acquire(d.path()).unwrap().is_some());
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }

    #[test]
    fn dropping_a_temp_dir_removes_it() {
        let d = tempfile::tempdir().unwrap();
        let t = TempDir::create(d.path(), "x").unwrap();
        std::fs::create_dir_all(t.path().join("a/b")).unwrap();
        std::fs::write(t.path().join("a/b/c"), "x").unwrap();
        drop(t);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }
}
