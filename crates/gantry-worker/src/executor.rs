//! One assignment, end to end: materialize inputs into an empty directory, create
//! output parents, run metered and bounded, upload outputs and logs, clean up. Every
//! stage is timestamped in ExecutedActionMetadata.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use gantry_core::reapi::{ActionResult, ExecutedActionMetadata};
use gantry_core::{BlobStore, Digest, Error, Finished, Metering, Result, ResultExt, Work};

use crate::cgroup::Cgroups;
use crate::materialize::{InputCache, Materializer};
use crate::outputs::{Declared, Uploader};
use crate::process::{self, Ending};
use crate::spare_dirs::SpareDirs;

pub struct Executor {
    pub worker_id: String,
    pub cas: Arc<dyn BlobStore>,
    pub cache: Arc<InputCache>,
    /// Each action runs in a directory of `{work_root}` ([`ActionDirs`]).
    pub work_root: PathBuf,
    /// The directories of `work_root` not in use.
    pub dirs: ActionDirs,
    /// Starts and reaps the actions' commands (spawner.rs); None: started from this
    /// process, whose memory then pollutes their rusage peak.
    pub spawner: Option<Arc<crate::spawner::Spawner>>,
    /// Limits of this worker's size class.
    pub limits: process::Limits,
    /// Where actions get their cgroup (`cgroup::setup`); None: limits are enforced with
    /// RLIMIT_AS and pinning.
    pub cgroups: Option<Arc<Cgroups>>,
}

/// Action directories, kept from one action to the next: `{work_root}/a{n}`, holding the
/// action's input root `root/` and its `stdout` and `stderr`. Only the input root's
/// contents are removed after an action; the directory, `root/` itself and the two log
/// files (truncated, then opened with `O_TRUNC` by the next action) stay, unless the
/// command changed a log into something else (then it is removed and made anew).
///
/// Why: every inode an action creates and frees costs twice over on ext4 without a
/// journal, whose inode allocator reads every inode freed in the last minute or so
/// (`recently_deleted`) to skip it. A worker that made and removed four of them for each
/// no-op action spent a quarter of the machine's CPU in that scan (a `perf` profile of
/// `gantry bench exec`), and slowed every other file creation on the disk with it, the
/// CAS's included.
///
/// The log files being the same inodes means a process that escaped its action and
/// still holds one open would write into a later action's log; one whose working
/// directory was a subdirectory would write into a later action's tree, since those
/// directories are kept too. Actions leave nothing running: their process group is
/// killed when they end, and with cgroups their whole process tree; only a process that
/// left the group without cgroups could (see process.rs).
///
/// The directories inside an input root are kept too: in place, empty, for the next
/// action in the same directory (which makes only those it lacks and moves aside those
/// it does not declare, see `Materializer::materialize`), or as spares ([`SpareDirs`]).
#[derive(Default)]
pub struct ActionDirs {
    free: Arc<Mutex<Vec<Kept>>>,
    made: AtomicUsize,
    spare: SpareDirs,
}

/// An action directory not in use, and the empty directories its `root/` holds (each
/// after its parent).
struct Kept {
    dir: PathBuf,
    skeleton: Vec<PathBuf>,
}

/// Directories kept in place in one action directory; the rest become spares.
const MAX_SKELETON: usize = 256;

impl ActionDirs {
    /// A directory whose `root/` holds nothing but the empty directories returned, kept
    /// or new.
    fn take(&self, work_root: &Path) -> Result<(PathBuf, Vec<PathBuf>)> {
        self.spare.init(work_root);
        // A kept directory's root holds only its skeleton (`empty_action_dir` made sure).
        if let Some(k) = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok((k.dir, k.skeleton));
        }
        let dir = work_root.join(format!("a{}", self.made.fetch_add(1, Ordering::Relaxed)));
        remove_tree(&dir);
        let root = dir.join("root");
        std::fs::create_dir_all(&root).context(format_args!("creating {}", root.display()))?;
        Ok((dir, Vec::new()))
    }

    /// Empties `dir`'s input root and keeps it for the next action, or removes it whole
    /// when it cannot be emptied. A few unlinks are done on this thread (a handoff to the
    /// blocking pool costs more); more than that goes to the pool.
    async fn give_back(&self, dir: PathBuf) {
        let (emptied, skeleton) = match empty_action_dir(&dir, Some(INLINE_EMPTY_ENTRIES), &self.spare) {
            (Emptied::TooMuch, _) => {
                let (d, spare) = (dir.clone(), self.spare.clone());
                tokio::task::spawn_blocking(move || empty_action_dir(&d, None, &spare))
                    .await
                    .unwrap_or((Emptied::No, Vec::new()))
            }
            done => done,
        };
        if emptied == Emptied::Yes {
            self.free.lock().unwrap_or_else(|p| p.into_inner()).push(Kept { dir, skeleton });
        } else {
            let _ = tokio::task::spawn_blocking(move || remove_tree(&dir)).await;
        }
    }
}

/// At most this many entries, none a directory, and logs of at most
/// [`crate::INLINE_FILE_BYTES`], are emptied on the runtime's thread.
const INLINE_EMPTY_ENTRIES: usize = 16;

#[derive(Debug, PartialEq, Eq)]
enum Emptied {
    Yes,
    /// Something could not be removed.
    No,
    /// More than the caller's bound; nothing was touched.
    TooMuch,
}

/// Removes what an action left in `dir`'s input root but its directories, which are left
/// empty and returned (each after its parent), and truncates its logs (a large log should
/// not take disk space until the next action). With `bound`, only when the root holds at
/// most that many entries, none a directory, and the logs are small.
fn empty_action_dir(dir: &Path, bound: Option<usize>, spare: &SpareDirs) -> (Emptied, Vec<PathBuf>) {
    let mut skeleton = Vec::new();
    let emptied = empty_action_dir_into(dir, bound, spare, &mut skeleton);
    (emptied, skeleton)
}

fn empty_action_dir_into(dir: &Path, bound: Option<usize>, spare: &SpareDirs, skeleton: &mut Vec<PathBuf>) -> Emptied {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let root = dir.join("root");
    // A command may have made its input root read-only; the next one must find it as new.
    if !spare.reset_mode(&root) {
        return Emptied::No;
    }
    let Ok(entries) = std::fs::read_dir(&root) else { return Emptied::No };
    let entries: Vec<std::fs::DirEntry> =
        match entries.take(bound.map_or(usize::MAX, |b| b + 1)).collect::<std::io::Result<_>>() {
            Ok(e) => e,
            Err(_) => return Emptied::No,
        };
    let is_dir = |e: &std::fs::DirEntry| e.file_type().is_ok_and(|t| t.is_dir());
    // A log's length, from a stat: an empty one (most are) needs no open and truncate.
    // One that is not a regular file of its own (the command can reach it as ../stdout,
    // and make it a link, or a hard link to a file of the input cache) is removed, so that
    // truncating it truncates nothing else; the next action's log is made anew.
    let logs: Vec<(PathBuf, Option<u64>)> = ["stdout", "stderr"]
        .iter()
        .map(|l| dir.join(l))
        .filter_map(|p| match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_file() && m.nlink() == 1 => Some((p, Some(m.len()))),
            Ok(_) => Some((p, None)),
            Err(_) => None,
        })
        .collect();
    if let Some(b) = bound {
        // Unlinking a file frees its blocks, which for a large one can wait on the disk;
        // a hard link into the input cache frees nothing.
        let large =
            |e: &std::fs::DirEntry| e.metadata().map_or(true, |m| m.nlink() == 1 && m.len() > crate::INLINE_FILE_BYTES);
        if entries.len() > b
            || entries.iter().any(|e| is_dir(e) || large(e))
            || logs.iter().any(|(_, len)| len.is_none_or(|l| l > crate::INLINE_FILE_BYTES))
        {
            return Emptied::TooMuch;
        }
    }
    for e in &entries {
        let path = e.path();
        let removed = if is_dir(e) {
            spare.keep_tree(&path, skeleton, MAX_SKELETON) || {
                // Not kept after all: nothing of it may stay listed.
                skeleton.retain(|k| !k.starts_with(&path));
                remove_tree(&path)
            }
        } else {
            unlink(&path)
        };
        if !removed {
            return Emptied::No;
        }
    }
    for (log, len) in &logs {
        let truncated = match len {
            Some(0) => true,
            Some(_) => std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(log)
                .and_then(|f| f.set_len(0))
                .is_ok(),
            None => false,
        };
        // A log that cannot be truncated (the command took away its write permission)
        // goes too: the next action's spawner makes a new one.
        if !truncated && !remove_entry(log) {
            return Emptied::No;
        }
    }
    Emptied::Yes
}

/// Removes whatever is at `p`: a directory tree, or anything else as one entry.
fn remove_entry(p: &Path) -> bool {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => remove_tree(p),
        Ok(_) => unlink(p),
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

/// Unlinks a non-directory; true once nothing is at `p`.
pub(crate) fn unlink(p: &Path) -> bool {
    match std::fs::remove_file(p) {
        Ok(()) => true,
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

fn ts() -> gantry_core::google::protobuf::Timestamp {
    let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    gantry_core::google::protobuf::Timestamp { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 }
}

/// Removes an action directory; false if it is still there. Unlinking needs write permission on directories only, so
/// only directories are made writable: files may be hard links into the input cache, and
/// changing their mode would change the cache's copy.
pub fn remove_tree(dir: &std::path::Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    if std::fs::remove_dir_all(dir).is_ok() {
        return true;
    }
    fn open_dirs(d: &std::path::Path) {
        let _ = std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700));
        if let Ok(entries) = std::fs::read_dir(d) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    open_dirs(&e.path());
                }
            }
        }
    }
    open_dirs(dir);
    match std::fs::remove_dir_all(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "could not remove an action directory");
            false
        }
    }
}

/// Bytes as MiB, for messages.
fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn safe_relative(p: &str, what: &str) -> Result<()> {
    if p.starts_with('/') || p.split('/').any(|s| s == "..") {
        return Err(Error::invalid(format!("{what} '{p}' must be a relative path inside the input root")));
    }
    Ok(())
}

impl Executor {
    /// Runs the work; never fails, because every failure is reported to the client as a
    /// finished run with a status.
    pub async fn execute(&self, a: Work, cancel: impl std::future::Future<Output = ()>) -> Finished {
        let res = match self.dirs.take(&self.work_root) {
            Ok((dir, skeleton)) => {
                let res = self.execute_in(&a, &dir, skeleton, cancel).await;
                self.dirs.give_back(dir).await;
                res
            }
            Err(e) => Err(e),
        };
        match res {
            Ok(f) => f,
            Err(e) => self.refused(a.job_id, &e),
        }
    }

    /// The report of a run that failed before or instead of running: the error as its
    /// status, and any missing inputs named for the client.
    pub fn refused(&self, job_id: String, e: &Error) -> Finished {
        Finished {
            job_id,
            action_result: None,
            status_code: e.code() as i32,
            status_message: e.to_string(),
            metering: None,
            message: format!("worker {}: {e}", self.worker_id),
            out_of_memory: false,
            missing_blobs: match e {
                Error::MissingBlobs { digests, .. } => {
                    digests.iter().map(gantry_core::resource::missing_subject).collect()
                }
                _ => vec![],
            },
        }
    }

    async fn execute_in(
        &self,
        a: &Work,
        dir: &std::path::Path,
        skeleton: Vec<PathBuf>,
        cancel: impl std::future::Future<Output = ()>,
    ) -> Result<Finished> {
        let mut md = ExecutedActionMetadata {
            worker: self.worker_id.clone(),
            worker_start_timestamp: Some(ts()),
            ..Default::default()
        };
        let (f, action, command) = (a.function, &a.action, &a.command);
        let input_root = Digest::from_proto(f, action.input_root_digest.as_ref(), "action.input_root_digest")?;
        if command.arguments.is_empty() {
            return Err(Error::invalid("command.arguments: empty"));
        }
        safe_relative(&command.working_directory, "working_directory")?;
        #[allow(deprecated)]
        let declared = Declared {
            files: &command.output_files,
            directories: &command.output_directories,
            paths: &command.output_paths,
        };
        for p in declared.files.iter().chain(declared.directories).chain(declared.paths) {
            safe_relative(p, "output path")?;
        }
        let exec_root = dir.join("root");
        let cwd = exec_root.join(&command.working_directory);
        // Directories the command gets beside its input tree: its working directory and
        // its outputs' parents.
        let mut made: Vec<(PathBuf, String)> = Vec::new();
        if !command.working_directory.is_empty() {
            made.push((cwd.clone(), "the working directory".into()));
        }
        for p in declared.files.iter().chain(declared.directories).chain(declared.paths) {
            if let Some(parent) = cwd.join(p).parent()
                && parent != cwd
            {
                made.push((parent.to_path_buf(), format!("the parent of output {p}")));
            }
        }

        md.input_fetch_start_timestamp = Some(ts());
        let materializer =
            Materializer { cas: self.cas.clone(), cache: self.cache.clone(), dirs: self.dirs.spare.clone() };
        materializer.materialize(f, input_root, &exec_root, &skeleton, made.iter().map(|(d, _)| d.as_path())).await?;
        md.input_fetch_completed_timestamp = Some(ts());

        // The input root exists (materialized), and so does what is made once below.
        for (d, what) in &made {
            self.dirs.spare.create_dir_all(d).context(format_args!("creating {what}"))?;
        }
        let env: Vec<(String, String)> =
            command.environment_variables.iter().map(|e| (e.name.clone(), e.value.clone())).collect();
        let (stdout, stderr) = (dir.join("stdout"), dir.join("stderr"));
        let timeout = a.timeout;
        md.execution_start_timestamp = Some(ts());
        let outcome = process::run(
            process::Spec {
                limits: self.limits,
                cgroups: self.cgroups.as_deref(),
                spawner: self.spawner.as_deref(),
                args: &command.arguments,
                env: &env,
                cwd: &cwd,
                stdout: &stdout,
                stderr: &stderr,
                timeout,
            },
            cancel,
        )
        .await?;
        md.execution_completed_timestamp = Some(ts());

        md.output_upload_start_timestamp = Some(ts());
        let up = Uploader { cas: self.cas.clone(), function: f };
        let mut result = ActionResult::default();
        let (out, err) = up.upload_logs(&stdout, &stderr).await?;
        result.stdout_digest = Some(out.to_proto());
        result.stderr_digest = Some(err.to_proto());
        // A timed-out action still reports whatever outputs it produced.
        let written = up.collect(&cwd, &declared, &mut result).await?;
        // Linked into the input cache only once nothing of the action can write to them.
        if outcome.all_ended {
            self.cache.adopt(written);
        }
        md.output_upload_completed_timestamp = Some(ts());
        md.worker_completed_timestamp = Some(ts());

        let (code, mut message) = match outcome.ending {
            Ending::Exited(c) => {
                result.exit_code = c;
                (0, String::new())
            }
            Ending::Signaled(sig) => {
                result.exit_code = 128 + sig;
                (0, format!("killed by signal {sig}"))
            }
            Ending::TimedOut => {
                result.exit_code = -1;
                (tonic::Code::DeadlineExceeded as i32, format!("timed out after {timeout:?}"))
            }
            Ending::Cancelled => {
                result.exit_code = -1;
                (tonic::Code::Cancelled as i32, "cancelled".to_string())
            }
        };
        if outcome.out_of_memory {
            // Still a completed run (status OK, the exit code it died with), but the
            // scheduler must know the class was too small rather than the action broken.
            let limit = self
                .limits
                .memory_bytes
                .map_or_else(|| "the machine's memory limit".to_string(), |b| format!("its size class's {}", mib(b)));
            message = format!(
                "out of memory: the kernel killed it at {limit} (peak {}), {message}",
                mib(outcome.peak_memory_bytes)
            );
        }
        result.execution_metadata = Some(md);
        Ok(Finished {
            job_id: a.job_id.clone(),
            action_result: Some(result),
            status_code: code,
            status_message: message.clone(),
            metering: Some(Metering {
                peak_memory_bytes: outcome.peak_memory_bytes,
                user_cpu_seconds: outcome.user_cpu_seconds,
                system_cpu_seconds: outcome.system_cpu_seconds,
                wall_seconds: outcome.wall_seconds,
                method: crate::cgroup::metering(self.cgroups.as_deref()).to_string(),
            }),
            message,
            missing_blobs: vec![],
            out_of_memory: outcome.out_of_memory,
        })
    }
}
