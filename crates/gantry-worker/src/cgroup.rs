//! A cgroup per action: the size class's memory and CPU enforced by the kernel over the
//! action's whole process tree, its peak memory read from the group, and an out-of-memory
//! kill told apart from an ordinary failure.
//!
//! Why not RLIMIT_AS: an address-space limit counts what a process reserves, not what it
//! uses. The JVM reserves 1 GiB of compressed class space and its whole maximum heap at
//! start, Go reserves arenas, so `java -version` fails under a 2 GiB RLIMIT_AS while
//! touching 40 MB. A memory cgroup counts pages actually charged, across every process of
//! the action, and its OOM killer ends the action when they pass the limit. RLIMIT_AS is
//! kept only as the last resort for machines that give gantry no cgroup.
//!
//! Which cgroups, detected once per worker process (`detect`):
//! - cgroup v2 where a hierarchy is delegated to us: our own cgroup, or its parent (the
//!   layout of systemd's `Delegate=yes` with `DelegateSubgroup=`, where the worker sits in
//!   a leaf next to the groups it makes), with `memory` enabled in that directory's
//!   `cgroup.subtree_control`, and writable;
//! - else cgroup v1's `memory` hierarchy, and `cpu` (CFS quota) when usable, each under
//!   the worker's own cgroup there (from /proc/self/cgroup), never under the root: a worker
//!   that was itself placed in a limited group must keep its actions inside that limit;
//! - else none, and the caller falls back to RLIMIT_AS.
//!
//! Each action's group, `gantry-{worker pid}-{n}`, is made before the action starts and
//! joined by the child between clone and exec (launch.rs), so no code of the action runs
//! outside it; after the action, everything left in it is killed and it is removed, also
//! when the run is dropped. Groups of a worker process that died are removed by the next
//! worker process to start.
//!
//! Why groups are reused (cgroup v1): making and removing a memory cgroup is most of what
//! a short action costs the kernel (per-CPU statistics to allocate, then an RCU-deferred
//! release on a kernel worker), about a tenth of a no-op action's CPU. A group whose
//! action left no process and at most [`REUSE_RESIDUE`] charged (the kernel objects and
//! page cache its processes left) is kept for the next action with the same limits: its
//! peak is reset (`memory.max_usage_in_bytes`), and its OOM kill counter, which cannot be
//! reset, is read as a baseline. A reused group's peak can therefore include up to
//! [`REUSE_RESIDUE`] that an earlier action left charged. cgroup v2 groups are not reused:
//! `memory.peak` is reset only per open file and only from Linux 6.12, which this code is
//! not tested on.
//!
//! A reused group keeps three of its control files open ([`V1Files`]): reading one by
//! path walks the cgroup filesystem's long paths and allocates an open file, and the
//! reads and writes after each action cost, that way, more than the rest of the group's
//! bookkeeping. Not `cgroup.procs`: v1 keeps the list of pids an open `cgroup.procs`
//! file read, and shows it again to reads for about a second, so a file held open would
//! call a group empty that an action had just left a process in.

use std::ffi::CString;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use gantry_config::LimitEnforcement;
use gantry_core::{Error, Result};

use crate::process::Limits;

/// Every action group's name starts with this, then the worker's pid.
const PREFIX: &str = "gantry-";

/// CFS period for CPU quotas: the kernel's default, 100 ms.
const CPU_PERIOD_US: u64 = 100_000;

/// How long tearing a group down may take before it is left with a warning: killed
/// processes leave the group as soon as they have exited, which is quick unless the
/// kernel is stuck in I/O for them.
const TEARDOWN_LIMIT: Duration = Duration::from_secs(5);

/// Most memory a finished action may leave charged to its group for the group to be
/// reused; past it the group is removed, so that no action's peak carries more than this
/// of another's. A no-op action leaves about 400 KiB (measured on Linux 6.18, v1).
pub const REUSE_RESIDUE: u64 = 1 << 20;

/// Idle groups kept per worker process. Each costs the kernel a memory cgroup's state
/// (per-CPU statistics, so more on bigger machines); a worker runs one action per slot, so
/// past this many slots some actions make a fresh group.
const POOL_MAX: usize = 64;

/// Action group numbers, process-wide so that every worker of one process (and every
/// test of one test binary) names its groups apart.
static NEXT: AtomicU64 = AtomicU64::new(0);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// Where this worker process makes its action groups.
#[derive(Debug)]
pub struct Cgroups {
    version: Version,
    /// v2: the delegated directory, for every controller. v1: the worker's own group in
    /// the memory hierarchy.
    memory: PathBuf,
    /// v1: the worker's own group in the cpu hierarchy; v2: `memory` again. None: CPU time
    /// is not limited (CPUs are still pinned), for the reason in `cpu_unusable`.
    cpu: Option<PathBuf>,
    cpu_unusable: Option<String>,
    /// Groups whose actions have finished, kept for reuse (v1 only; see the module doc).
    idle: Arc<Mutex<Vec<Idle>>>,
}

/// An empty group kept for the next action with its limits.
#[derive(Debug)]
struct Idle {
    dirs: Vec<PathBuf>,
    files: Option<V1Files>,
    limits: Limits,
    oom_kills_before: u64,
}

/// The memory group's control files that a reusable (v1) group reads and writes after
/// every action, kept open for its lifetime (see the module doc for `cgroup.procs`).
#[derive(Debug)]
struct V1Files {
    usage: File,
    max_usage: File,
    oom_control: File,
}

impl V1Files {
    fn open(memory: &Path) -> Result<V1Files> {
        let open = |name: &str, write: bool| {
            let path = memory.join(name);
            std::fs::OpenOptions::new()
                .read(true)
                .write(write)
                .open(&path)
                .map_err(|e| Error::io(format!("opening {}", path.display()), e))
        };
        Ok(V1Files {
            usage: open("memory.usage_in_bytes", false)?,
            max_usage: open("memory.max_usage_in_bytes", true)?,
            oom_control: open("memory.oom_control", false)?,
        })
    }
}

/// A control file's whole text, read from its start: the kernel renders it anew for
/// every read at offset 0.
fn read_control(file: &File) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    let n = file.read_at(&mut buf, 0).ok()?;
    buf.truncate(n);
    String::from_utf8(buf).ok()
}

impl Idle {
    /// The group again, for an action (`pool`: where it may return) or for removal.
    fn into_group(self, version: Version, pool: Option<Arc<Mutex<Vec<Idle>>>>) -> ActionCgroup {
        ActionCgroup {
            version,
            dirs: self.dirs,
            files: self.files,
            removed: false,
            limits: self.limits,
            oom_kills_before: self.oom_kills_before,
            pool,
        }
    }
}

/// How actions are metered with `cgroups` (None: without).
pub fn metering(cgroups: Option<&Cgroups>) -> &'static str {
    match cgroups.map(|c| c.version) {
        Some(Version::V2) => "cgroup-v2",
        Some(Version::V1) => "cgroup-v1",
        None => "rusage",
    }
}

/// Chooses, once at a worker process's startup, how it enforces its size class's limits
/// (`limited`: a memory or CPU limit is configured), and says so in the log. None: no
/// cgroups, so RLIMIT_AS and pinning enforce the limits.
pub fn setup(how: LimitEnforcement, limited: bool) -> Result<Option<Arc<Cgroups>>> {
    if how == LimitEnforcement::Rlimit {
        if limited {
            tracing::warn!(
                "limits = \"rlimit\": size class memory is enforced as an address-space limit (RLIMIT_AS), which \
                 fails runtimes that reserve more than they use (the JVM, Go), and CPUs by pinning only"
            );
        }
        tracing::info!("actions are metered with the rusage of their reaped processes and /proc samples");
        return Ok(None);
    }
    match detect() {
        Ok(c) => {
            tracing::info!(mechanism = %c.describe(), metering = metering(Some(&c)), "actions run in their own cgroup");
            if let (true, Some(why)) = (limited, &c.cpu_unusable) {
                tracing::warn!(reason = %why, "CPU time is not limited by cgroup: actions are only pinned to their CPUs");
            }
            Ok(Some(c))
        }
        Err(why) if how == LimitEnforcement::Cgroup => Err(Error::FailedPrecondition(format!(
            "limits = \"cgroup\", but this machine gives gantry no usable cgroup: {why}"
        ))),
        Err(why) => {
            if limited {
                tracing::warn!(
                    reason = %why,
                    "no usable cgroup: size class memory falls back to RLIMIT_AS, the last resort, which limits \
                     address space rather than memory used and so fails the JVM and Go; CPUs are only pinned. \
                     Delegate a cgroup v2 hierarchy with the memory controller to gantry, or run it as root with \
                     cgroup v1's memory controller mounted"
                );
            } else {
                tracing::info!(reason = %why, "no usable cgroup: actions are metered with rusage and /proc samples");
            }
            Ok(None)
        }
    }
}

static DETECTED: OnceLock<std::result::Result<Arc<Cgroups>, String>> = OnceLock::new();

/// Removes the idle groups kept for reuse, for a worker process that is stopping (those
/// of one that died are removed by the next to start).
pub fn release_idle() {
    if let Some(Ok(cgroups)) = DETECTED.get() {
        let idle = std::mem::take(&mut *cgroups.idle.lock().unwrap_or_else(|p| p.into_inner()));
        for g in idle {
            g.into_group(cgroups.version, None).remove();
        }
    }
}

/// This machine's cgroups for actions, or why there are none. Detected once per process:
/// the first detection also removes groups left by worker processes that died.
pub fn detect() -> std::result::Result<Arc<Cgroups>, String> {
    DETECTED
        .get_or_init(|| {
            let read = |p: &str| std::fs::read_to_string(p).map_err(|e| format!("reading {p}: {e}"));
            let mounts = parse_mountinfo(&read("/proc/self/mountinfo")?);
            let own = parse_proc_cgroup(&read("/proc/self/cgroup")?);
            let cgroups = match detect_v2(&mounts, &own) {
                Ok(c) => c,
                Err(v2) => detect_v1(&mounts, &own).map_err(|v1| format!("cgroup v2: {v2}; cgroup v1: {v1}"))?,
            };
            for parent in cgroups.parents() {
                remove_stale(parent);
            }
            Ok(Arc::new(cgroups))
        })
        .clone()
}

impl Cgroups {
    pub fn version(&self) -> Version {
        self.version
    }

    /// Whether action groups hold an action to its CPUs' worth of time.
    pub fn limits_cpu_time(&self) -> bool {
        self.cpu.is_some()
    }

    /// The directories action groups are made in (v1: memory's, then cpu's).
    pub fn parents(&self) -> Vec<&Path> {
        let mut v = vec![self.memory.as_path()];
        if let Some(cpu) = self.cpu.as_deref().filter(|c| *c != self.memory) {
            v.push(cpu);
        }
        v
    }

    /// One line for the startup log.
    pub fn describe(&self) -> String {
        let cpu = match (&self.cpu, self.version) {
            (Some(_), Version::V2) => " and cpu.max".to_string(),
            (Some(p), Version::V1) => format!(", cpu (CFS quota) under {}", p.display()),
            (None, _) => ", CPU time not limited".to_string(),
        };
        match self.version {
            Version::V2 => format!("cgroup v2 under {} (memory.max{cpu})", self.memory.display()),
            Version::V1 => format!("cgroup v1: memory under {}{cpu}", self.memory.display()),
        }
    }

    /// An action's group with `limits` applied: an idle one with the same limits, else a
    /// new one. Dropping it kills what is left in it and removes it; [`ActionCgroup::finish`]
    /// may keep it for reuse instead.
    pub fn create(&self, limits: Limits) -> Result<ActionCgroup> {
        let idle = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            idle.iter().position(|g| g.limits == limits).map(|i| idle.swap_remove(i))
        };
        if let Some(g) = idle {
            return Ok(g.into_group(self.version, Some(self.idle.clone())));
        }
        let name = format!("{PREFIX}{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let mut group = ActionCgroup {
            version: self.version,
            dirs: Vec::new(),
            files: None,
            removed: false,
            limits,
            oom_kills_before: 0,
            // Only v1 groups are reused (see the module doc).
            pool: (self.version == Version::V1).then(|| self.idle.clone()),
        };
        let memory = self.memory.join(&name);
        make_dir(&memory)?;
        group.dirs.push(memory.clone());
        match self.version {
            Version::V2 => {
                if let Some(bytes) = limits.memory_bytes {
                    write(&memory.join("memory.max"), &bytes.to_string())?;
                    // Swap would let an action hold more than its class's memory; absent
                    // without swap accounting.
                    write_if_present(&memory.join("memory.swap.max"), "0")?;
                }
                // An OOM kill takes the whole action, not just its largest process, so a
                // build tool never carries on with a compiler that vanished.
                write_if_present(&memory.join("memory.oom.group"), "1")?;
                if let (Some(n), Some(_)) = (limits.cpus, &self.cpu) {
                    write(&memory.join("cpu.max"), &format!("{} {CPU_PERIOD_US}", n as u64 * CPU_PERIOD_US))?;
                }
            }
            Version::V1 => {
                if let Some(bytes) = limits.memory_bytes {
                    write(&memory.join("memory.limit_in_bytes"), &bytes.to_string())?;
                    write_if_present(&memory.join("memory.memsw.limit_in_bytes"), &bytes.to_string())?;
                }
                if let (Some(n), Some(parent)) = (limits.cpus, &self.cpu) {
                    let cpu = parent.join(&name);
                    make_dir(&cpu)?;
                    group.dirs.push(cpu.clone());
                    write(&cpu.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                    write(&cpu.join("cpu.cfs_quota_us"), &(n as u64 * CPU_PERIOD_US).to_string())?;
                }
                group.files = Some(V1Files::open(&memory)?);
            }
        }
        Ok(group)
    }
}

/// One action's group (in v1, one directory per hierarchy used).
#[derive(Debug)]
pub struct ActionCgroup {
    version: Version,
    /// The memory hierarchy's first.
    dirs: Vec<PathBuf>,
    /// The memory group's control files, open: Some exactly for a v1 group not yet
    /// removed (v2 groups are read by path).
    files: Option<V1Files>,
    removed: bool,
    limits: Limits,
    /// The group's OOM kill counter when this action got it (a reused group's counter
    /// holds its earlier actions' kills).
    oom_kills_before: u64,
    /// Where [`ActionCgroup::finish`] may keep it; None: never reused.
    pool: Option<Arc<Mutex<Vec<Idle>>>>,
}

impl ActionCgroup {
    /// The `cgroup.procs` files a process writes its pid to, to join the group.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    pub fn name(&self) -> &str {
        self.dirs[0].file_name().and_then(|n| n.to_str()).unwrap_or_default()
    }

    /// Highest memory charged to the group since it was made: every process of the
    /// action, also those killed or never reaped, and the page cache they dirtied.
    pub fn peak_memory(&self) -> Option<u64> {
        // A v1 group holds its files open until it is removed; v2 has none.
        let text = match &self.files {
            Some(f) => read_control(&f.max_usage)?,
            None => std::fs::read_to_string(self.dirs[0].join("memory.peak")).ok()?,
        };
        text.trim().parse().ok()
    }

    /// Whether the kernel killed a process of the group for want of memory. Kernels too
    /// old to count OOM kills in v1 report only that the limit was hit (memory.failcnt),
    /// which the caller counts as an OOM only together with a SIGKILL.
    pub fn oom(&self) -> Oom {
        let read = |f: &str| std::fs::read_to_string(self.dirs[0].join(f)).unwrap_or_default();
        let events = match &self.files {
            Some(f) => read_control(&f.oom_control).unwrap_or_default(),
            None => read("memory.events"),
        };
        match parse_counter(&events, "oom_kill") {
            Some(n) if n <= self.oom_kills_before => Oom::No,
            Some(_) => Oom::Killed,
            None if self.version == Version::V1 && read("memory.failcnt").trim().parse::<u64>().unwrap_or(0) > 0 => {
                Oom::HitLimit
            }
            None => Oom::No,
        }
    }

    /// Kills everything left in the group and removes it; blocks until the group is empty
    /// (or `TEARDOWN_LIMIT`, then leaves it with a warning). Returns whether it is gone,
    /// and with it every process of the action.
    pub fn remove(mut self) -> bool {
        self.teardown()
    }

    /// After the action: its peak memory and OOM verdict (read only when it `failed`),
    /// and the group kept for reuse if it may be (see the module doc). A group that may
    /// not is handed back, to be [`ActionCgroup::remove`]d: removal may block, while
    /// keeping one only reads and writes a few kernel counters, which never wait.
    pub fn finish(mut self, failed: bool) -> ((Option<u64>, Oom), Option<ActionCgroup>) {
        let figures = (self.peak_memory(), if failed { self.oom() } else { Oom::No });
        if let (Some(oom_kills), Some(pool)) = (self.reset_for_reuse(), &self.pool) {
            let mut pool = pool.lock().unwrap_or_else(|p| p.into_inner());
            if pool.len() < POOL_MAX {
                let dirs = std::mem::take(&mut self.dirs);
                pool.push(Idle { dirs, files: self.files.take(), limits: self.limits, oom_kills_before: oom_kills });
                drop(pool);
                // Its directories moved to the pool: nothing is left to remove.
                self.removed = true;
                return (figures, None);
            }
        }
        (figures, Some(self))
    }

    /// Makes the group ready for another action, if it may be: no process left in it,
    /// little left charged, a counter of OOM kills to take as the next baseline, and its
    /// peak reset. Returns that counter.
    fn reset_for_reuse(&self) -> Option<u64> {
        self.pool.as_ref()?;
        let f = self.files.as_ref()?;
        // Every process of the action joined both hierarchies' groups, and its children
        // inherit them, so the memory group's members are all of them.
        if !std::fs::read_to_string(self.dirs[0].join("cgroup.procs")).ok()?.trim().is_empty() {
            return None;
        }
        let usage: u64 = read_control(&f.usage)?.trim().parse().ok()?;
        if usage > REUSE_RESIDUE {
            return None;
        }
        // Kernels that do not count OOM kills say only that the limit was hit
        // (memory.failcnt), which could not tell one action's from another's.
        let oom_kills = parse_counter(&read_control(&f.oom_control)?, "oom_kill")?;
        f.max_usage.write_at(b"0", 0).ok()?;
        Some(oom_kills)
    }

    /// Whether every directory of the group is gone (true too when it already was).
    fn teardown(&mut self) -> bool {
        if std::mem::replace(&mut self.removed, true) {
            return true;
        }
        self.files = None;
        let deadline = Instant::now() + TEARDOWN_LIMIT;
        let mut gone = true;
        for dir in self.dirs.iter().rev() {
            if let Err(e) = empty_and_remove(dir, self.version, deadline) {
                tracing::warn!(cgroup = %dir.display(), error = %e, "could not remove an action's cgroup");
                gone = false;
            }
        }
        gone
    }
}

impl Drop for ActionCgroup {
    fn drop(&mut self) {
        // A run dropped mid-action (a broken session, a shutdown): nothing of the action
        // may outlive it, and its group must not leak.
        self.teardown();
    }
}

/// What the group's counters say about memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Oom {
    No,
    /// The OOM killer killed a process of the group.
    Killed,
    /// The limit was reached (no OOM kill counter on this kernel).
    HitLimit,
}

/// Kills every process in `dir` until none is left, then removes it.
fn empty_and_remove(dir: &Path, version: Version, deadline: Instant) -> std::io::Result<()> {
    if version == Version::V2 {
        // cgroup.kill (Linux 5.14) kills atomically, racing no fork; without it, the loop.
        let _ = std::fs::write(dir.join("cgroup.kill"), "1");
    }
    let mut pause = Duration::from_millis(1);
    loop {
        let procs = match std::fs::read_to_string(dir.join("cgroup.procs")) {
            Ok(p) => p,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        for pid in procs.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
            // SAFETY: kill(2) on a pid; no memory is touched.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        // Killed processes leave the group once they have exited; rmdir says when.
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => {}
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Removes the groups of worker processes that are gone (and any of this process's pid,
/// which a dead worker that had it left: this process has made none yet).
fn remove_stale(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    let own = std::process::id();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)).and_then(|r| r.split('-').next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid == own || !Path::new(&format!("/proc/{pid}")).exists() {
            let version = if parent.join("cgroup.controllers").exists() { Version::V2 } else { Version::V1 };
            let path = entry.path();
            match empty_and_remove(&path, version, Instant::now() + TEARDOWN_LIMIT) {
                Ok(()) => tracing::info!(cgroup = %path.display(), "removed the cgroup of a worker that died"),
                Err(e) => tracing::warn!(cgroup = %path.display(), error = %e, "could not remove a stale cgroup"),
            }
        }
    }
}

/// A mount from /proc/self/mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    /// The directory of the filesystem mounted (for cgroups, the group at the mount point).
    root: String,
    point: PathBuf,
    fstype: String,
    super_options: Vec<String>,
}

/// Mounts from the text of /proc/self/mountinfo: `ID PARENT MAJ:MIN ROOT POINT OPTIONS
/// [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS`, paths with octal escapes.
fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let mut right = right.split(' ');
            let (fstype, _source, opts) = (right.next()?, right.next()?, right.next().unwrap_or(""));
            Some(Mount {
                root: unescape(left.get(3)?),
                point: PathBuf::from(unescape(left.get(4)?)),
                fstype: fstype.to_string(),
                super_options: opts.split(',').map(str::to_string).collect(),
            })
        })
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8)
        {
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// (controllers, path) per line of /proc/self/cgroup: `ID:CONTROLLERS:PATH`, where v2's
/// line is `0::PATH` (no controllers).
fn parse_proc_cgroup(text: &str) -> Vec<(Vec<String>, String)> {
    text.lines()
        .filter_map(|line| {
            let mut it = line.splitn(3, ':');
            let (_id, controllers, path) = (it.next()?, it.next()?, it.next()?);
            let controllers = controllers.split(',').filter(|c| !c.is_empty()).map(str::to_string).collect();
            Some((controllers, path.to_string()))
        })
        .collect()
}

/// The directory of cgroup `path` (as /proc/self/cgroup names it) under `mount`.
fn group_dir(mount: &Mount, path: &str) -> PathBuf {
    // A mount of a group below the hierarchy's root shows that group at its mount point;
    // inside a cgroup namespace, paths are already relative to it.
    let rel = match path.strip_prefix(mount.root.as_str()) {
        Some(rest) if mount.root != "/" && (rest.is_empty() || rest.starts_with('/')) => rest,
        _ => path,
    };
    match rel.trim_start_matches('/') {
        "" => mount.point.clone(),
        rel => mount.point.join(rel),
    }
}

fn detect_v2(mounts: &[Mount], own: &[(Vec<String>, String)]) -> std::result::Result<Cgroups, String> {
    let mount = mounts.iter().find(|m| m.fstype == "cgroup2").ok_or("no cgroup2 filesystem is mounted")?;
    let (_, path) = own.iter().find(|(c, _)| c.is_empty()).ok_or("this process has no cgroup v2 group")?;
    let dir = group_dir(mount, path);
    let mut candidates = vec![dir.clone()];
    if let Some(parent) = dir.parent().filter(|p| p.starts_with(&mount.point)) {
        candidates.push(parent.to_path_buf());
    }
    let mut why = Vec::new();
    for candidate in candidates {
        let enabled = std::fs::read_to_string(candidate.join("cgroup.subtree_control")).unwrap_or_default();
        let enabled: Vec<&str> = enabled.split_whitespace().collect();
        if !enabled.contains(&"memory") {
            why.push(format!(
                "{}: the memory controller is not enabled in cgroup.subtree_control (enabled: {})",
                candidate.display(),
                if enabled.is_empty() { "none".to_string() } else { enabled.join(" ") }
            ));
            continue;
        }
        let cgroups = Cgroups {
            idle: Default::default(),
            version: Version::V2,
            cpu: enabled.contains(&"cpu").then(|| candidate.clone()),
            cpu_unusable: (!enabled.contains(&"cpu")).then(|| {
                format!("the cpu controller is not enabled in {}/cgroup.subtree_control", candidate.display())
            }),
            memory: candidate,
        };
        match probe(&cgroups) {
            Ok(()) => return Ok(cgroups),
            Err(e) => why.push(e),
        }
    }
    Err(why.join("; "))
}

fn detect_v1(mounts: &[Mount], own: &[(Vec<String>, String)]) -> std::result::Result<Cgroups, String> {
    let hierarchy = |controller: &str| -> std::result::Result<PathBuf, String> {
        let mount = mounts
            .iter()
            .find(|m| m.fstype == "cgroup" && m.super_options.iter().any(|o| o == controller))
            .ok_or_else(|| format!("no v1 {controller} hierarchy is mounted"))?;
        let (_, path) = own
            .iter()
            .find(|(c, _)| c.iter().any(|c| c == controller))
            .ok_or_else(|| format!("this process has no v1 {controller} group"))?;
        Ok(group_dir(mount, path))
    };
    let memory = hierarchy("memory")?;
    let mut cgroups = Cgroups { version: Version::V1, memory, cpu: None, cpu_unusable: None, idle: Default::default() };
    probe(&cgroups)?;
    match hierarchy("cpu") {
        Ok(cpu) => {
            cgroups.cpu = Some(cpu);
            if let Err(e) = probe(&cgroups) {
                cgroups.cpu = None;
                cgroups.cpu_unusable = Some(e);
            }
        }
        Err(e) => cgroups.cpu_unusable = Some(e),
    }
    Ok(cgroups)
}

/// Makes and removes a group with limits, to learn at startup rather than at the first
/// action whether this process may.
fn probe(cgroups: &Cgroups) -> std::result::Result<(), String> {
    let group = cgroups
        .create(Limits { memory_bytes: Some(1 << 30), cpus: Some(1) })
        .map_err(|e| format!("cannot make a cgroup with limits: {e}"))?;
    let files = group.procs_files();
    group.remove();
    // Joining needs write access to cgroup.procs of the common ancestor too (v2's
    // delegation rule); root passes, a delegated user owns the files.
    for f in files {
        let parent = f.parent().and_then(Path::parent);
        if let Some(procs) = parent.map(|p| p.join("cgroup.procs")) {
            let c = CString::new(procs.as_os_str().as_bytes()).expect("paths have no NUL");
            // SAFETY: access(2) on a valid C string.
            if unsafe { libc::access(c.as_ptr(), libc::W_OK) } != 0 {
                return Err(format!("{} is not writable", procs.display()));
            }
        }
    }
    Ok(())
}

fn make_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir(dir).map_err(|e| Error::io(format!("creating cgroup {}", dir.display()), e))
}

fn write(file: &Path, value: &str) -> Result<()> {
    std::fs::write(file, value).map_err(|e| Error::io(format!("writing {value} to {}", file.display()), e))
}

/// Writes a control file that not every kernel or configuration has.
fn write_if_present(file: &Path, value: &str) -> Result<()> {
    if file.exists() {
        write(file, value)
    } else {
        Ok(())
    }
}

/// `NAME N` from a flat-keyed cgroup file (memory.events, memory.oom_control).
fn parse_counter(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_finds_cgroup_mounts() {
        let text = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
                    32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime shared:9 - cgroup cgroup rw,cpu\n\
                    35 31 0:32 /sub /sys/fs/cgroup/my\\040memory rw,relatime - cgroup cgroup rw,memory\n\
                    41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 4);
        assert_eq!((m[1].fstype.as_str(), m[1].super_options.as_slice()), ("cgroup", &["rw".into(), "cpu".into()][..]));
        assert_eq!(m[2].point, PathBuf::from("/sys/fs/cgroup/my memory"), "octal escapes undone");
        assert_eq!(m[2].root, "/sub");
        assert_eq!(m[3].fstype, "cgroup2");
    }

    #[test]
    fn proc_cgroup_and_group_directories() {
        let own = parse_proc_cgroup("4:memory:/process_api/abc\n1:cpu,cpuacct:/\n0::/user.slice/w.service\n");
        assert_eq!(own[0], (vec!["memory".to_string()], "/process_api/abc".to_string()));
        assert_eq!(own[1].0, vec!["cpu".to_string(), "cpuacct".to_string()]);
        assert_eq!(own[2], (vec![], "/user.slice/w.service".to_string()));
        let mount = |root: &str| Mount {
            root: root.into(),
            point: "/sys/fs/cgroup/memory".into(),
            fstype: "cgroup".into(),
            super_options: vec![],
        };
        assert_eq!(group_dir(&mount("/"), "/process_api/abc"), PathBuf::from("/sys/fs/cgroup/memory/process_api/abc"));
        assert_eq!(group_dir(&mount("/"), "/"), PathBuf::from("/sys/fs/cgroup/memory"));
        // The mount shows group /process_api at its mount point.
        assert_eq!(group_dir(&mount("/process_api"), "/process_api/abc"), PathBuf::from("/sys/fs/cgroup/memory/abc"));
        assert_eq!(
            group_dir(&mount("/process"), "/process_api/abc"),
            PathBuf::from("/sys/fs/cgroup/memory/process_api/abc")
        );
    }

    #[test]
    fn counters() {
        assert_eq!(parse_counter("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n", "oom_kill"), Some(2));
        assert_eq!(parse_counter("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\noom_group_kill 1\n", "oom_kill"), Some(1));
        assert_eq!(parse_counter("oom_kill_disable 0\nunder_oom 0\n", "oom_kill"), None, "old kernels");
    }
}
