//! The limit on open files: a server raises its own to the hard limit, and every action
//! it starts gets back the limit the server was started with.
//!
//! Why raise it: a server holds a socket per client connection and, for each reusable
//! cgroup, that group's open control files (cgroup.rs); the usual soft limit of 1,024
//! (systemd's default for services and sessions) is reached by a few hundred of each, and
//! then connections and actions fail with EMFILE. Why give actions the original back:
//! an action should run as it would anywhere else, and some programs size tables by the
//! limit or still use select(2), which cannot watch a descriptor past 1,023.
//!
//! Only actions get it back. The programs a server runs itself keep the raised limit:
//! Bazel (batch builds, the submit queue's builds), whose JVM raises its own soft limit
//! to the hard one at start anyway (HotSpot's `MaxFDLimit`, on by default), and git,
//! which does not depend on it.

use std::sync::OnceLock;

/// Most a raised soft limit may be, whatever the hard limit: a limit in the millions makes
/// some programs that close every possible descriptor (as daemons do) crawl.
const MOST: u64 = 1 << 20;

/// The soft limit actions get: the one this process started with, when it raised its own.
static FOR_ACTIONS: OnceLock<u64> = OnceLock::new();

/// Raises this process's soft limit on open files to its hard limit (at most [`MOST`])
/// and records the limit its actions get. Returns the limit before and after.
pub fn raise() -> std::io::Result<(u64, u64)> {
    let rl = current()?;
    let before: u64 = rl.rlim_cur;
    let after = rl.rlim_max.min(MOST).max(before);
    if after > before {
        let raised = libc::rlimit { rlim_cur: after, rlim_max: rl.rlim_max };
        // SAFETY: setrlimit with a valid struct.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let _ = FOR_ACTIONS.set(before);
    }
    Ok((before, after))
}

/// The soft limit on open files an action starts with, if it is not this process's own.
pub fn for_actions() -> Option<u64> {
    FOR_ACTIONS.get().copied()
}

/// The RLIMIT_NOFILE that gives a command `soft` open files, under this process's hard
/// limit (made in the parent: a launched child only applies it).
pub(crate) fn with_soft(soft: u64) -> std::io::Result<libc::rlimit> {
    let mut rl = current()?;
    rl.rlim_cur = soft.min(rl.rlim_max);
    Ok(rl)
}

/// This process's RLIMIT_NOFILE.
fn current() -> std::io::Result<libc::rlimit> {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit with a valid struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rl)
}
