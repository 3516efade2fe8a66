//! Running one command: its own process group (so a timeout or cancel kills everything it
//! started), stdout/stderr to files, its size class's limits, and its metering. The
//! worker's spawner (spawner.rs) starts (launch.rs) and reaps it; without one (`gantry
//! run`'s local branch, unit tests) it is started and reaped here.
//!
//! With cgroups (cgroup.rs) the command runs in a group of its own, joined between clone
//! and exec: the kernel enforces its memory and CPU time over the whole process tree, its
//! peak memory is the group's, an OOM kill is recognised, and whatever it leaves running,
//! even outside its process group, is killed with the group.
//!
//! Without them, memory is limited by RLIMIT_AS (the last resort: it fails the JVM and
//! Go) and metered from `wait4` on the pid: the rusage of the process and the descendants
//! it reaped, peak RSS of the largest of them. The peak RSS (VmHWM) of every process in
//! the group is also sampled from /proc while it runs: a command killed at its timeout or
//! cancelled never reports its own rusage, and the processes it left are not reaped by
//! anyone we wait for, so the samples, taken last just before the kill, are its peak
//! memory instead of 0.
//!
//! CPU time comes from rusage either way, and the command is pinned to its class's CPUs
//! either way: tools size their thread pools from the affinity mask.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gantry_core::{Error, Result};

use crate::cgroup::{ActionCgroup, Cgroups, Oom};
use crate::spawner::{kill_group, wait_child, Exit, Launched, Spawner, StartAction};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Exited(i32),
    /// Killed by a signal (not by us).
    Signaled(i32),
    TimedOut,
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct RunOutcome {
    pub ending: Ending,
    pub peak_memory_bytes: u64,
    pub user_cpu_seconds: f64,
    pub system_cpu_seconds: f64,
    pub wall_seconds: f64,
    /// The command failed, and the kernel killed a process of it for want of memory (its
    /// cgroup's OOM kill counter moved): a resource failure. Only known with cgroups.
    pub out_of_memory: bool,
    /// Every process of the action is known to have ended: its cgroup was found empty
    /// (and kept for the next action) or removed. Without cgroups a process that left the
    /// process group may live on, so never.
    pub all_ended: bool,
}

/// Resource limits of a size class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: Option<u64>,
    pub cpus: Option<usize>,
}

pub struct Spec<'a> {
    pub limits: Limits,
    /// Where this machine makes action cgroups (see cgroup.rs). None: `limits` are
    /// enforced with RLIMIT_AS and pinning, and memory is metered from rusage and samples.
    pub cgroups: Option<&'a Cgroups>,
    /// The worker's spawner (spawner.rs); without it the command is started from this
    /// process, and its rusage peak memory includes this process's.
    pub spawner: Option<&'a Spawner>,
    pub args: &'a [String],
    pub env: &'a [(String, String)],
    pub cwd: &'a Path,
    pub stdout: &'a Path,
    pub stderr: &'a Path,
    pub timeout: Duration,
}

/// How often the group's memory is sampled while it runs.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);

/// The process group of a process, from the text of `/proc/PID/stat`. The command name
/// (in parentheses) may contain anything, so fields are counted after its last `)`:
/// state, ppid, pgrp.
fn parse_pgrp(stat: &str) -> Option<i32> {
    stat.rsplit_once(')')?.1.split_whitespace().nth(2)?.parse().ok()
}

/// Peak resident set size in bytes, from the text of `/proc/PID/status` (`VmHWM: N kB`).
fn parse_vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line["VmHWM:".len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

/// The largest peak RSS among the live processes of group `pgid` (0 if none is left).
/// Processes that exit while being read are skipped.
fn group_peak(pgid: i32) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    let mut peak = 0;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        if parse_pgrp(&stat) != Some(pgid) {
            continue;
        }
        if let Some(hwm) = std::fs::read_to_string(format!("/proc/{pid}/status")).ok().as_deref().and_then(parse_vm_hwm)
        {
            peak = peak.max(hwm);
        }
    }
    peak
}

/// Samples the group's peak RSS every `SAMPLE_EVERY` into `peak` until dropped.
fn sample_group(pgid: i32, peak: Arc<AtomicU64>) -> gantry_core::TaskGuard {
    gantry_core::task::spawn_named("action-memory-sampler", async move {
        loop {
            let p = peak.clone();
            // /proc reads never wait on a disk, but a scan of many processes is still
            // work better kept off the runtime's threads.
            let _ = tokio::task::spawn_blocking(move || p.fetch_max(group_peak(pgid), Ordering::Relaxed)).await;
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
    })
}

/// A started command, waited for either by its spawner or by this process.
enum Running {
    Spawned(Launched),
    /// Started from this process (no spawner): reaped here with wait4.
    Direct {
        pid: i32,
        wait: tokio::task::JoinHandle<std::io::Result<(i32, libc::rusage)>>,
    },
}

impl Running {
    fn kill(&self) {
        match self {
            Running::Spawned(l) => l.kill(),
            Running::Direct { pid, .. } => kill_group(*pid),
        }
    }

    async fn exited(&mut self) -> Result<Exit> {
        match self {
            Running::Spawned(l) => l.exited().await,
            Running::Direct { pid, wait } => {
                let pid = *pid;
                // By reference: a select that timed out polls it again.
                let waited = wait.await.map_err(|e| Error::internal(format!("wait task: {e}")))?;
                // Whatever the command left running in its group goes with it.
                kill_group(pid);
                let (status, ru) = waited.map_err(|e| Error::internal(format!("wait4({pid}): {e}")))?;
                Ok(Exit::from_wait(status, &ru))
            }
        }
    }
}

/// Kills a directly started command's group if the future running it is dropped (a
/// worker session that broke, a shutdown); a spawned one's `Launched` does the same.
struct GroupGuard {
    pgid: i32,
    armed: bool,
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if self.armed {
            kill_group(self.pgid);
        }
    }
}

/// Runs the command to completion, timeout or cancellation.
pub async fn run(spec: Spec<'_>, cancel: impl std::future::Future<Output = ()>) -> Result<RunOutcome> {
    let program = &spec.args[0];
    // A relative program path with a slash is relative to the action's working directory.
    if !spec.cwd.is_absolute() {
        // The spawner is another process: a relative directory would be its own.
        return Err(Error::internal(format!("working directory {} is not absolute", spec.cwd.display())));
    }
    let program_path =
        if program.contains('/') && !program.starts_with('/') { spec.cwd.join(program) } else { program.into() };
    // Made before the fork and joined by the child before it execs: nothing of the action
    // runs outside its group. Dropped (on any early return), it is removed again.
    let cgroup: Option<ActionCgroup> = spec.cgroups.map(|c| c.create(spec.limits)).transpose()?;
    let action = StartAction {
        id: 0,
        program: program_path.clone(),
        args: spec.args[1..].to_vec(),
        env: spec.env.to_vec(),
        cwd: spec.cwd.to_path_buf(),
        stdout: spec.stdout.to_path_buf(),
        stderr: spec.stderr.to_path_buf(),
        cgroup_procs: cgroup.as_ref().map(ActionCgroup::procs_files).unwrap_or_default(),
        address_space: if cgroup.is_none() { spec.limits.memory_bytes } else { None },
        open_files: crate::open_files::for_actions(),
        cpus: spec.limits.cpus,
    };
    let could_not_start = |e: &dyn std::fmt::Display| {
        Error::FailedPrecondition(format!("could not start {}: {e}", program_path.display()))
    };
    let start = Instant::now();
    let (pid, mut running, mut guard) = match spec.spawner {
        Some(spawner) => {
            let mut launched = spawner.start(action)?;
            let pid = match launched.started().await {
                Ok(pid) => pid,
                Err(Error::FailedPrecondition(e)) => return Err(could_not_start(&e)),
                Err(e) => return Err(e),
            };
            (pid, Running::Spawned(launched), None)
        }
        None => {
            // SAFETY: getpid has no preconditions.
            let me = unsafe { libc::getpid() };
            let pid = crate::launch::launch(&action, me).map_err(|e| could_not_start(&e))?;
            let wait = tokio::task::spawn_blocking(move || wait_child(pid));
            (pid, Running::Direct { pid, wait }, Some(GroupGuard { pgid: pid, armed: true }))
        }
    };
    // The group's peak covers every process, killed or not; samples are for without one.
    let sampled = Arc::new(AtomicU64::new(0));
    let sampler = cgroup.is_none().then(|| sample_group(pid, sampled.clone()));
    tokio::pin!(cancel);
    let mut forced = None;
    // The last figures before a forced kill: afterwards there is nothing left to read.
    let sampling = sampler.is_some();
    let last_sample = || {
        if sampling {
            sampled.fetch_max(group_peak(pid), Ordering::Relaxed);
        }
    };
    let exit = tokio::select! {
        res = running.exited() => res,
        _ = tokio::time::sleep(spec.timeout) => {
            last_sample();
            running.kill();
            forced = Some(Ending::TimedOut);
            running.exited().await
        }
        _ = &mut cancel => {
            last_sample();
            running.kill();
            forced = Some(Ending::Cancelled);
            running.exited().await
        }
    };
    drop(sampler);
    if let Some(g) = guard.as_mut() {
        g.armed = false;
    }
    let exit = exit?;
    let status = exit.status;
    let ending = forced.unwrap_or(if libc::WIFEXITED(status) {
        Ending::Exited(libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        Ending::Signaled(libc::WTERMSIG(status))
    } else {
        Ending::Exited(-1)
    });
    let failed = matches!(ending, Ending::Signaled(_)) || matches!(ending, Ending::Exited(c) if c != 0);
    // Read the group's figures, then keep it for the next action (cgroup.rs), or kill
    // what is left in it (also what left the process group) and remove it. Only removal
    // can wait (rmdir waits for the killed to exit), so only it goes off the runtime: a
    // handoff to a blocking thread costs a no-op action more than the counters do. Its
    // OOM counters matter only to a failure (below), so a success does not read them.
    let mut all_ended = false;
    let from_cgroup = match cgroup {
        Some(g) => {
            let (figures, left) = g.finish(failed);
            all_ended = match left {
                Some(g) => tokio::task::spawn_blocking(move || g.remove())
                    .await
                    .map_err(|e| Error::internal(format!("cgroup task: {e}")))?,
                None => true,
            };
            Some(figures)
        }
        None => None,
    };
    // Linux reports ru_maxrss in KiB.
    let mut peak = exit.maxrss_kib.max(0) as u64 * 1024;
    if forced.is_some() || peak == 0 {
        // The reaped processes' rusage misses what was killed and never reaped (the
        // command's children, when it died first): the samples cover them.
        peak = peak.max(sampled.load(Ordering::Relaxed));
    }
    let mut out_of_memory = false;
    if let Some((group_peak, oom)) = from_cgroup {
        peak = group_peak.unwrap_or(peak);
        // A failure is an OOM failure when the kernel OOM-killed a process of it (old v1
        // kernels only say the limit was hit: then the command must have died of SIGKILL,
        // which is what the OOM killer sends). A run that exited 0 despite a killed
        // child succeeded, and a timeout is a timeout.
        out_of_memory = failed
            && match oom {
                Oom::Killed => true,
                Oom::HitLimit => ending == Ending::Signaled(libc::SIGKILL),
                Oom::No => false,
            };
    }
    Ok(RunOutcome {
        ending,
        peak_memory_bytes: peak,
        user_cpu_seconds: exit.user_seconds,
        system_cpu_seconds: exit.system_seconds,
        wall_seconds: start.elapsed().as_secs_f64(),
        out_of_memory,
        all_ended,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec<'a>(dir: &'a Path, args: &'a [String], timeout: Duration) -> Spec<'a> {
        Spec {
            limits: Limits::default(),
            cgroups: None,
            spawner: None,
            args,
            env: &[],
            cwd: dir,
            stdout: Box::leak(dir.join("out").into_boxed_path()),
            stderr: Box::leak(dir.join("err").into_boxed_path()),
            timeout,
        }
    }

    fn sh(script: &str) -> Vec<String> {
        vec!["/bin/sh".into(), "-c".into(), script.into()]
    }

    #[tokio::test]
    async fn exit_code_output_and_metering() {
        let d = tempfile::tempdir().unwrap();
        // allocate ~50 MB in a child process so the peak is clearly above a shell's
        let args = sh("echo hello; echo oops >&2; head -c 50000000 /dev/zero | python3 -c 'import sys; d=sys.stdin.buffer.read(); print(len(d))'; exit 3");
        let out = run(spec(d.path(), &args, Duration::from_secs(30)), std::future::pending()).await.unwrap();
        assert_eq!(out.ending, Ending::Exited(3));
        let stdout = std::fs::read_to_string(d.path().join("out")).unwrap();
        assert_eq!(stdout, "hello\n50000000\n");
        assert_eq!(std::fs::read_to_string(d.path().join("err")).unwrap(), "oops\n");
        assert!(out.peak_memory_bytes > 45_000_000, "peak {}", out.peak_memory_bytes);
        assert!(out.user_cpu_seconds + out.system_cpu_seconds > 0.0);
    }

    #[tokio::test]
    async fn timeout_kills_the_whole_group() {
        let d = tempfile::tempdir().unwrap();
        let marker = d.path().join("grandchild-alive");
        // The grandchild would write the marker after 2 s unless the group is killed.
        let script = format!("(sleep 2; touch {}) & sleep 30", marker.display());
        let args = sh(&script);
        let start = Instant::now();
        let out = run(spec(d.path(), &args, Duration::from_millis(300)), std::future::pending()).await.unwrap();
        assert_eq!(out.ending, Ending::TimedOut);
        assert!(start.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(2500));
        assert!(!marker.exists(), "the background grandchild was killed with the group");
    }

    #[test]
    fn proc_parsers() {
        // A command name with spaces and parentheses does not shift the fields.
        assert_eq!(parse_pgrp("4242 (we (ird) name) S 1 4240 4240 0 -1 4194560"), Some(4240));
        assert_eq!(parse_pgrp("garbage"), None);
        let status = "Name:\tpython3\nVmPeak:\t  200000 kB\nVmHWM:\t   81234 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(parse_vm_hwm(status), Some(81234 * 1024));
        assert_eq!(parse_vm_hwm("Name: kthreadd\n"), None, "kernel threads have no VmHWM");
    }

    /// Killed at its timeout, an action still reports the memory it reached: the
    /// 80 MB the grandchild holds, not 0 and not the shell's few hundred KiB.
    #[tokio::test]
    async fn timed_out_action_reports_its_real_peak_memory() {
        let d = tempfile::tempdir().unwrap();
        let args = sh("python3 -c 'import time; b = bytearray(80_000_000); time.sleep(60)'; true");
        let out = run(spec(d.path(), &args, Duration::from_millis(1500)), std::future::pending()).await.unwrap();
        assert_eq!(out.ending, Ending::TimedOut);
        assert!(out.peak_memory_bytes > 80_000_000, "peak {}", out.peak_memory_bytes);
    }

    #[tokio::test]
    async fn cancel_kills_and_reports_cancelled() {
        let d = tempfile::tempdir().unwrap();
        let args = sh("sleep 30");
        let out = run(spec(d.path(), &args, Duration::from_secs(60)), tokio::time::sleep(Duration::from_millis(200)))
            .await
            .unwrap();
        assert_eq!(out.ending, Ending::Cancelled);
        assert!(out.wall_seconds < 5.0);
    }

    #[tokio::test]
    async fn dropping_the_run_kills_the_group() {
        let d = tempfile::tempdir().unwrap();
        let pidfile = d.path().join("pid");
        let args = sh(&format!("echo $$ > {}; exec sleep 60", pidfile.display()));
        let fut = run(spec(d.path(), &args, Duration::from_secs(60)), std::future::pending());
        // Poll the run until the command has started, then drop it.
        let _ = tokio::time::timeout(Duration::from_millis(500), fut).await;
        let pid: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit(')').next().unwrap_or("").trim_start().chars().next();
        assert!(stat.is_empty() || state == Some('Z'), "process {pid} still alive after the run was dropped: {stat}");
    }

    #[tokio::test]
    async fn missing_program_is_a_clear_error() {
        let d = tempfile::tempdir().unwrap();
        let args = vec!["./no-such-tool".to_string()];
        let e = run(spec(d.path(), &args, Duration::from_secs(5)), std::future::pending()).await.unwrap_err();
        assert!(e.to_string().contains("no-such-tool"), "{e}");
    }
}
