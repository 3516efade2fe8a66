//! Empty directories kept from one action to the next: when an action directory is
//! emptied, its subdirectories are emptied and left in place (`keep_tree`) instead of
//! removed; the next action in it keeps those it declares and has the others moved aside
//! (a rename, `recycle_tree`), and directories are made by moving spares back.
//!
//! Why: a Bazel action's inputs and outputs sit a few directories deep
//! (`bazel-out/k8-fastbuild/bin/pkg/`), so each action made and removed about eight
//! directory inodes, most of the inodes a worker allocated (counted with the
//! `ext4_allocate_inode` tracepoint during `gantry bench bazel`). On ext4 without a journal
//! every inode freed in the last minute or so slows each later allocation (the allocator
//! reads it to skip it, see `ActionDirs`); a rename allocates and frees nothing.
//!
//! A directory moved back is empty (checked again when it is taken: the spares' home is
//! reachable from an action's directory) and has the mode a new directory gets here (an
//! action may have changed it). It keeps what a command running as the worker's user
//! could set and gantry does not reset: owner, extended attributes (default ACLs among
//! them) and inode flags; a new directory's timestamps are newer. Only directories this
//! worker emptied are kept, and at most [`MAX_SPARE`]; the rest are removed.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// Spare directories kept per worker: each is an inode and a block.
pub const MAX_SPARE: usize = 1024;

/// Cheap to clone; the clones share one pool.
#[derive(Default, Clone)]
pub struct SpareDirs(Arc<Inner>);

#[derive(Default)]
struct Inner {
    /// Where spares wait, and the mode a new directory gets; unset until `init`, or when
    /// that directory could not be made (then directories are made and removed as usual).
    home: OnceLock<Option<(PathBuf, u32)>>,
    free: Mutex<Vec<PathBuf>>,
    made: AtomicUsize,
}

impl SpareDirs {
    /// Keeps spares in `{work_root}/spare` (the same filesystem as the action directories,
    /// so that a rename moves them). Only the first call does anything.
    pub fn init(&self, work_root: &Path) {
        self.0.home.get_or_init(|| {
            let home = work_root.join("spare");
            // Left by an earlier worker in the same place: its spares are not counted.
            crate::executor::remove_tree(&home);
            std::fs::create_dir_all(&home).ok()?;
            let mode = std::fs::metadata(&home).ok()?.permissions().mode() & 0o7777;
            Some((home, mode))
        });
    }

    fn home(&self) -> Option<&(PathBuf, u32)> {
        self.0.home.get().and_then(Option::as_ref)
    }

    /// The spares waiting. Nothing breaks a list of paths half-way, so a poisoned lock
    /// is taken as it is.
    fn free(&self) -> MutexGuard<'_, Vec<PathBuf>> {
        self.0.free.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// As `std::fs::create_dir_all`, moving spare directories into place where it can.
    pub fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        if self.home().is_none() {
            return std::fs::create_dir_all(path);
        }
        let mut missing = Vec::new();
        let mut p = path;
        loop {
            match std::fs::metadata(p) {
                Ok(m) if m.is_dir() => break,
                Ok(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!("{} exists and is not a directory", p.display()),
                    ));
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    missing.push(p);
                    match p.parent() {
                        Some(parent) => p = parent,
                        None => break,
                    }
                }
                Err(e) => return Err(e),
            }
        }
        for dir in missing.into_iter().rev() {
            let spare = self.free().pop();
            if let Some(spare) = spare {
                if is_empty_dir(&spare) && std::fs::rename(&spare, dir).is_ok() {
                    continue;
                }
                crate::executor::remove_tree(&spare);
            }
            match std::fs::create_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Empties the directory tree at `path`, keeping its directories as spares (or
    /// removing them once the pool is full). False when something could not be removed
    /// or moved: the caller removes what is left.
    pub fn recycle_tree(&self, path: &Path) -> bool {
        let Some((home, _)) = self.home() else { return false };
        let Ok(entries) = std::fs::read_dir(path) else { return false };
        for e in entries {
            let Ok(e) = e else { return false };
            let child = e.path();
            let emptied = if e.file_type().is_ok_and(|t| t.is_dir()) {
                self.recycle_tree(&child)
            } else {
                crate::executor::unlink(&child)
            };
            if !emptied {
                return false;
            }
        }
        if self.free().len() >= MAX_SPARE {
            return std::fs::remove_dir(path).is_ok();
        }
        // As a new directory would be: the action may have changed its mode. Not through
        // a link that replaced the directory meanwhile.
        if !self.reset_mode(path) {
            return false;
        }
        let name = home.join(format!("d{}", self.0.made.fetch_add(1, Ordering::Relaxed)));
        if std::fs::rename(path, &name).is_err() {
            return false;
        }
        self.free().push(name);
        true
    }

    /// Empties the directory tree at `path` of everything but its directories, which stay
    /// where they are (with a new directory's mode) and are appended to `kept`, each after
    /// its parent: the next action in the same action directory usually needs most of
    /// them (`bazel-out/k8-fastbuild/bin`), and keeping them costs no rename at all. Past
    /// `budget` directories kept, the rest are recycled as spares. False when something
    /// could not be removed or moved: the caller removes what is left.
    pub fn keep_tree(&self, path: &Path, kept: &mut Vec<PathBuf>, budget: usize) -> bool {
        if kept.len() >= budget {
            return self.recycle_tree(path);
        }
        // As a new directory would be; not through a link that replaced it meanwhile.
        if !self.reset_mode(path) {
            return false;
        }
        kept.push(path.to_path_buf());
        let Ok(entries) = std::fs::read_dir(path) else { return false };
        for e in entries {
            let Ok(e) = e else { return false };
            let child = e.path();
            let emptied = if e.file_type().is_ok_and(|t| t.is_dir()) {
                self.keep_tree(&child, kept, budget)
            } else {
                crate::executor::unlink(&child)
            };
            if !emptied {
                return false;
            }
        }
        true
    }

    /// Gives `path`, a directory kept from an earlier action, a new directory's mode if an
    /// action changed it. False if it is not a directory (a link is not followed).
    pub fn reset_mode(&self, path: &Path) -> bool {
        let mode = self.home().map_or(0o755, |(_, m)| *m);
        match std::fs::symlink_metadata(path) {
            Ok(m) if !m.is_dir() => false,
            Ok(m) if m.permissions().mode() & 0o7777 == mode => true,
            Ok(_) => std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).is_ok(),
            Err(_) => false,
        }
    }

    /// How many spares wait.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.free().len()
    }
}

/// A directory (not a link to one) with nothing in it.
fn is_empty_dir(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir())
        && std::fs::read_dir(p).is_ok_and(|mut entries| entries.next().is_none())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool keeping its spares under `dir`.
    fn pool(dir: &Path) -> SpareDirs {
        let spare = SpareDirs::default();
        spare.init(dir);
        spare
    }

    #[test]
    fn directories_come_back_empty_with_a_new_directorys_mode() {
        let d = tempfile::tempdir().unwrap();
        let spare = pool(d.path());
        let root = d.path().join("root");
        std::fs::create_dir(&root).unwrap();

        spare.create_dir_all(&root.join("a/b/c")).unwrap();
        std::fs::write(root.join("a/b/c/f"), "x").unwrap();
        std::fs::write(root.join("a/g"), "y").unwrap();
        std::fs::set_permissions(root.join("a/b"), std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(spare.recycle_tree(&root.join("a")));
        assert!(!root.join("a").exists());
        assert_eq!(spare.len(), 3);

        // Taken back for another path; each is empty and has the default mode.
        let new_mode = std::fs::metadata(d.path().join("spare")).unwrap().permissions().mode() & 0o7777;
        spare.create_dir_all(&root.join("x/y/z/w")).unwrap();
        assert_eq!(spare.len(), 0);
        for p in ["x", "x/y", "x/y/z"] {
            let m = std::fs::metadata(root.join(p)).unwrap();
            assert_eq!(m.permissions().mode() & 0o7777, new_mode, "{p}");
        }
        assert_eq!(std::fs::read_dir(root.join("x/y/z/w")).unwrap().count(), 0);
        assert_eq!(std::fs::read_dir(root.join("x/y/z")).unwrap().count(), 1);

        // A spare something was put into (its home is reachable from an action's
        // directory) is removed, not handed out.
        assert!(spare.recycle_tree(&root.join("x/y/z/w")));
        let (home, _) = spare.home().unwrap().clone();
        let kept: Vec<_> = std::fs::read_dir(&home).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(kept.len(), 1);
        std::fs::write(kept[0].join("planted"), "x").unwrap();
        spare.create_dir_all(&root.join("v")).unwrap();
        assert_eq!(std::fs::read_dir(root.join("v")).unwrap().count(), 0);
        assert!(!kept[0].exists());

        // An existing file in the way is an error, as with std's create_dir_all.
        std::fs::write(root.join("file"), "").unwrap();
        assert!(spare.create_dir_all(&root.join("file/sub")).is_err());
        // An existing directory is fine.
        spare.create_dir_all(&root.join("x/y")).unwrap();
    }

    #[test]
    fn a_tree_that_cannot_be_emptied_is_reported() {
        let d = tempfile::tempdir().unwrap();
        let spare = pool(d.path());
        let a = d.path().join("a");
        std::fs::create_dir_all(a.join("b")).unwrap();
        std::fs::write(a.join("b/f"), "x").unwrap();
        // Read-only: its file cannot be unlinked (unless running as root, which may).
        std::fs::set_permissions(a.join("b"), std::fs::Permissions::from_mode(0o500)).unwrap();
        let root = unsafe { libc::geteuid() } == 0;
        assert_eq!(spare.recycle_tree(&a), root);
        if !root {
            assert!(a.join("b/f").exists());
            assert!(crate::executor::remove_tree(&a));
        }
    }
}
