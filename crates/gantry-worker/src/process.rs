//! Running one command: its own process group (so a timeout or cancel kills everything it
//! started), stdout/stderr to files, and `wait4` on its pid for the rusage of the process
//! and the descendants it reaped: peak RSS of the largest of them, user and system CPU.
//!
//! While the command runs, the peak RSS (VmHWM) of every process in its group is also
//! sampled from /proc. A command killed at its timeout or cancelled never reports its
//! own rusage, and the processes it left are not reaped by anyone we wait for: the
//! samples, taken last just before the kill, are then its peak memory instead of 0.
//!
//! cgroup v2 would measure the whole tree's peak, but needs a delegated cgroup2
//! hierarchy; `metering_method()` says which one this machine allows.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gantry_core::{Error, Result};

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
}

/// How actions are metered: always rusage of the reaped processes today. Metering
/// through a cgroup v2 child group is not implemented (the machines gantry is developed
/// on delegate no cgroup2 hierarchy to test it on), so it is never claimed.
pub fn metering_method() -> &'static str {
    "rusage"
}

/// Kills the process group if the future running it is dropped (a worker session that
/// broke, a shutdown): an action must never outlive the task that owns it.
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

/// Resource limits of a size class (applied through the trampoline).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: Option<u64>,
    pub cpus: Option<usize>,
}

pub struct Spec<'a> {
    pub limits: Limits,
    /// A binary that understands `__meter` (gantry itself); without it the command is
    /// spawned directly and its peak memory includes this process's (see meter.rs).
    pub meter: Option<&'a Path>,
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

fn kill_group(pgid: i32) {
    // SAFETY: kill(2) with a negative pid signals the process group; no memory is touched.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

/// Runs the command to completion, timeout or cancellation.
pub async fn run(spec: Spec<'_>, cancel: impl std::future::Future<Output = ()>) -> Result<RunOutcome> {
    let program = &spec.args[0];
    // A relative program path with a slash is relative to the action's working directory.
    if !spec.cwd.is_absolute() {
        // The trampoline runs inside cwd, so a relative cwd would be resolved twice.
        return Err(Error::internal(format!("working directory {} is not absolute", spec.cwd.display())));
    }
    let program_path = if program.contains('/') && !program.starts_with('/') {
        spec.cwd.join(program).into_os_string()
    } else {
        program.into()
    };
    let result_file = spec.stdout.with_extension("meter");
    let mut cmd = match spec.meter {
        Some(meter) => {
            // Resolve the program now: the trampoline does no PATH magic of its own
            // beyond what the action's environment gives it.
            let mut c = std::process::Command::new(meter);
            c.arg(crate::meter::SUBCOMMAND).arg(&result_file);
            if let Some(m) = spec.limits.memory_bytes {
                c.arg("--memory-limit").arg(m.to_string());
            }
            if let Some(n) = spec.limits.cpus {
                c.arg("--cpus").arg(n.to_string());
            }
            c.arg("--").arg(&program_path).args(&spec.args[1..]);
            c
        }
        None => {
            let mut c = std::process::Command::new(&program_path);
            c.args(&spec.args[1..]);
            c
        }
    };
    cmd.env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(spec.cwd)
        .stdin(Stdio::null())
        .stdout(File::create(spec.stdout).map_err(|e| Error::io("creating stdout file", e))?)
        .stderr(File::create(spec.stderr).map_err(|e| Error::io("creating stderr file", e))?)
        .process_group(0);
    // If this worker dies (SIGKILL, OOM kill), nobody would supervise the action: ask the
    // kernel to signal it then. The trampoline turns SIGTERM into a kill of the whole
    // process group (meter.rs); a command started directly can only be killed itself.
    let on_parent_death = if spec.meter.is_some() { libc::SIGTERM } else { libc::SIGKILL };
    // SAFETY: getpid before the fork; the closure runs between fork and exec and calls
    // only async-signal-safe functions (prctl, getppid).
    let parent = unsafe { libc::getpid() };
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, on_parent_death as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The worker died between the fork and the prctl: nobody will reap us.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("the worker exited while starting the action"));
            }
            Ok(())
        });
    }
    let start = Instant::now();
    let child = cmd
        .spawn()
        .map_err(|e| Error::FailedPrecondition(format!("could not start {}: {e}", program_path.to_string_lossy())))?;
    let pid = child.id() as i32;
    // We reap with wait4 ourselves to get this child's rusage; std's Child would not.
    drop(child);
    let mut guard = GroupGuard { pgid: pid, armed: true };
    let sampled = Arc::new(AtomicU64::new(0));
    let sampler = sample_group(pid, sampled.clone());
    let mut wait = tokio::task::spawn_blocking(move || crate::meter::wait_child(pid));
    tokio::pin!(cancel);
    let mut forced = None;
    // The last figures before a forced kill: afterwards there is nothing left to read.
    let last_sample = || sampled.fetch_max(group_peak(pid), Ordering::Relaxed);
    let (r, status, ru) = tokio::select! {
        res = &mut wait => res.map_err(|e| Error::internal(format!("wait task: {e}")))?,
        _ = tokio::time::sleep(spec.timeout) => {
            last_sample();
            kill_group(pid);
            forced = Some(Ending::TimedOut);
            wait.await.map_err(|e| Error::internal(format!("wait task: {e}")))?
        }
        _ = &mut cancel => {
            last_sample();
            kill_group(pid);
            forced = Some(Ending::Cancelled);
            wait.await.map_err(|e| Error::internal(format!("wait task: {e}")))?
        }
    };
    drop(sampler);
    // Whatever the command left running in its group goes with it.
    kill_group(pid);
    guard.armed = false;
    if r == -1 {
        return Err(Error::internal(format!("wait4({pid}): {}", std::io::Error::last_os_error())));
    }
    let ending = forced.unwrap_or(if libc::WIFEXITED(status) {
        Ending::Exited(libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        Ending::Signaled(libc::WTERMSIG(status))
    } else {
        Ending::Exited(-1)
    });
    let secs = crate::meter::secs;
    let (mut peak, mut user, mut sys) = (ru.ru_maxrss.max(0) as u64 * 1024, secs(ru.ru_utime), secs(ru.ru_stime));
    if spec.meter.is_some() {
        // The trampoline's own numbers are polluted the same way; its report on the
        // command is not. Killed before it could report: the samples, CPU kept.
        match crate::meter::read_result(&result_file) {
            Some((p, u, s)) => (peak, user, sys) = (p, u, s),
            None => peak = 0,
        }
        let _ = std::fs::remove_file(&result_file);
    }
    if forced.is_some() || peak == 0 {
        // The reaped processes' rusage misses what was killed before it was reaped (the
        // command's children, when the trampoline died first): the samples cover them.
        peak = peak.max(sampled.load(Ordering::Relaxed));
    }
    Ok(RunOutcome {
        ending,
        // Linux reports ru_maxrss in KiB.
        peak_memory_bytes: peak,
        user_cpu_seconds: user,
        system_cpu_seconds: sys,
        wall_seconds: start.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec<'a>(dir: &'a Path, args: &'a [String], timeout: Duration) -> Spec<'a> {
        Spec {
            limits: Limits::default(),
            meter: None,
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
