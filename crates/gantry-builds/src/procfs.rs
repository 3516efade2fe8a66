//! The Bazel server JVM's resident memory, from /proc: its pid comes from the output
//! base's `server/server.pid.txt`, its peak from `VmHWM`, and writing "5" to
//! `clear_refs` restarts the peak, so a warm server's peak is per build.

use std::path::Path;

pub fn server_pid(output_base: &Path) -> Option<i32> {
    let text = std::fs::read_to_string(output_base.join("server/server.pid.txt")).ok()?;
    let pid: i32 = text.trim().parse().ok()?;
    // A stale pid file outlives a killed server; only a live process counts.
    alive(pid).then_some(pid)
}

/// Whether `pid` exists and has not exited: a zombie its parent has not reaped yet
/// (Bazel's daemonised server is reaped by whatever adopted it) counts as gone.
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|s| s != "Z" && s != "X"),
        Err(_) => false,
    }
}

/// Peak resident set size of `pid` in bytes.
pub fn vm_hwm(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Restarts the peak RSS counter of `pid` (Linux >= 4.0). Failure only means the next
/// reading may include an earlier build's peak; it is logged, not fatal.
pub fn reset_hwm(pid: i32) {
    if let Err(e) = std::fs::write(format!("/proc/{pid}/clear_refs"), "5") {
        tracing::debug!(pid, error = %e, "could not reset VmHWM");
    }
}

pub fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) with a pid we read from our own runner's output base.
    unsafe {
        libc::kill(pid, sig);
    }
}

pub fn signal_group(pgid: i32, sig: i32) {
    // SAFETY: a negative pid signals the process group the runner created.
    unsafe {
        libc::kill(-pgid, sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_our_own_peak_and_rejects_stale_pid_files() {
        let me = std::process::id() as i32;
        let hwm = vm_hwm(me).expect("VmHWM of this process");
        assert!(hwm > 1 << 20, "{hwm}");
        reset_hwm(me);
        assert!(vm_hwm(me).unwrap() > 0);
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("server")).unwrap();
        std::fs::write(dir.path().join("server/server.pid.txt"), format!("{me}\n")).unwrap();
        assert_eq!(server_pid(dir.path()), Some(me));
        std::fs::write(dir.path().join("server/server.pid.txt"), "999999999").unwrap();
        assert_eq!(server_pid(dir.path()), None);
    }

    #[test]
    fn an_unreaped_zombie_is_not_alive() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let t = std::time::Instant::now();
        while alive(pid) && t.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(std::path::Path::new(&format!("/proc/{pid}")).exists(), "not reaped yet, so still in /proc");
        assert!(!alive(pid));
        child.wait().unwrap();
        assert!(!alive(pid));
        assert!(alive(std::process::id() as i32));
    }
}
