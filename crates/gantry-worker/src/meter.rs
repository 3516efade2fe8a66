//! The metering trampoline, `gantry __meter RESULT_FILE -- PROGRAM ARGS...`.
//!
//! Why it exists: a child spawned directly from the server inherits the server's address
//! space until it execs, and Linux folds that address space's high-water RSS into the
//! child's `ru_maxrss`, so every action would "use" as much memory as gantry itself. The
//! trampoline is a fresh, tiny process: the command it spawns inherits only its small
//! footprint, and the rusage it reaps (the command and all descendants it waited for) is
//! written to RESULT_FILE as `maxrss_kib utime_s stime_s`. It then exits the way the
//! command did, so the worker sees the command's exit status.
//!
//! The size class's limits (cgroup, or RLIMIT_AS, and CPU pinning) are applied by the
//! worker to the trampoline itself before it execs (process.rs), and the command inherits
//! them; with a cgroup, the worker takes peak memory from the cgroup and only CPU time
//! from here.

use std::io::Write;

/// The hidden subcommand name; `main` must dispatch it before starting any runtime.
pub const SUBCOMMAND: &str = "__meter";

/// Runs the trampoline with `args` = [RESULT_FILE, "--", PROGRAM, ARGS...]. Never returns.
pub fn meter_main(args: &[String]) -> ! {
    let cmd = match args {
        [_, sep, cmd @ ..] if sep == "--" && !cmd.is_empty() => cmd,
        _ => {
            eprintln!("usage: gantry {SUBCOMMAND} RESULT_FILE -- PROGRAM [ARGS...]");
            std::process::exit(2);
        }
    };
    let result_file = &args[0];
    // The worker asked the kernel to send us SIGTERM if it dies (PR_SET_PDEATHSIG, see
    // process.rs). Nobody would then wait for the action or kill it at its timeout, so
    // take the whole process group (us, the command, everything it started) down with
    // it. The handler is reset to the default in the command when it execs.
    // SAFETY: the handler only calls kill(2), which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, kill_own_group as extern "C" fn(libc::c_int) as libc::sighandler_t);
    }
    // The environment and working directory were set up by the worker for us; the
    // command inherits them, and stays in our process group.
    let err = match std::process::Command::new(&cmd[0]).args(&cmd[1..]).spawn() {
        Ok(child) => {
            let pid = child.id() as i32;
            drop(child);
            let (r, status, ru) = wait_child(pid);
            if r == -1 {
                // Never report success for a child we could not wait for.
                eprintln!("gantry: waiting for {}: {}", cmd[0], std::io::Error::last_os_error());
                std::process::exit(125);
            }
            if let Ok(mut f) = std::fs::File::create(result_file) {
                let _ = writeln!(f, "{} {} {}", ru.ru_maxrss, secs(ru.ru_utime), secs(ru.ru_stime));
            }
            if libc::WIFEXITED(status) {
                std::process::exit(libc::WEXITSTATUS(status));
            }
            if libc::WIFSIGNALED(status) {
                let sig = libc::WTERMSIG(status);
                // SAFETY: restore default action and die of the same signal.
                unsafe {
                    libc::signal(sig, libc::SIG_DFL);
                    libc::raise(sig);
                }
            }
            std::process::exit(128);
        }
        Err(e) => e,
    };
    // Could not start it: mirror a shell's "command not found".
    eprintln!("gantry: could not start {}: {err}", cmd[0]);
    std::process::exit(127);
}

extern "C" fn kill_own_group(_: libc::c_int) {
    // SAFETY: kill(0, ...) signals our own process group; no memory is touched.
    unsafe {
        libc::kill(0, libc::SIGKILL);
    }
}

/// Waits for child `pid` with wait4, retrying on EINTR: (return value, status, rusage).
/// std's Child::wait cannot give the rusage of one specific child.
pub fn wait_child(pid: i32) -> (i32, i32, libc::rusage) {
    let mut status = 0;
    // SAFETY: rusage is plain old data; wait4 fills it in.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: waiting on our own child pid with valid out-pointers.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
        if r == -1 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        return (r, status, ru);
    }
}

/// Seconds in a timeval.
pub fn secs(tv: libc::timeval) -> f64 {
    tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6
}

/// Parses the trampoline's result file.
pub fn read_result(path: &std::path::Path) -> Option<(u64, f64, f64)> {
    let s = std::fs::read_to_string(path).ok()?;
    let mut it = s.split_whitespace();
    let kib: u64 = it.next()?.parse().ok()?;
    let user: f64 = it.next()?.parse().ok()?;
    let sys: f64 = it.next()?.parse().ok()?;
    Some((kib * 1024, user, sys))
}
