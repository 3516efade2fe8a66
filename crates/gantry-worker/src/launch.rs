//! Starting an action's command: `clone(CLONE_VM | CLONE_VFORK)`, the way posix_spawn
//! starts a program, plus the steps gantry needs between clone and exec (its cgroups, its
//! address-space limit, its CPUs, its death signal) that posix_spawn has no hook for.
//!
//! Why not fork (std's `Command` with `pre_exec`): fork copies the page tables of the
//! process that starts the command, and the exec right after tears the copy down again.
//! On `gantry bench exec` that copy and teardown, with the fork's own work, were a sixth of
//! the whole machine's CPU per no-op action, about as much as the command itself. A
//! vfork-style child borrows the parent's address space until it execs, and the parent's
//! thread waits meanwhile, so nothing is copied.
//!
//! The price is discipline. Until it execs, the child runs on memory it shares with the
//! parent, so it only makes system calls on data prepared before the clone: no
//! allocation, no locks, no panics, and it reports a failure by writing to the shared
//! [`Child`] before `_exit`. It runs on a stack of its own, allocated by the parent.
//!
//! What the child inherits is what std's `Command` gave it: signal dispositions reset
//! (handled signals and SIGPIPE to the default; other ignored signals stay ignored), an
//! empty signal mask, a process group of its own, stdin from /dev/null, stdout and stderr
//! to the action's files, the action's directory and environment (the last value of a
//! name repeated wins). As with execvp, a program named without a slash is looked up in
//! the action's PATH (or `/bin:/usr/bin` without one), and a file the kernel cannot
//! execute for want of a `#!` line is run by `/bin/sh`.
//!
//! Two things this relies on, as glibc's own posix_spawn does: glibc 2.25 or later, whose
//! `clone` no longer rewrites the calling thread's cached ids in the memory the child
//! shares; and glibc's two internal signals (32 and 33, which `sigfillset` leaves out)
//! staying harmless while the child shares the parent's memory: glibc sends them only to
//! its own process's threads, by thread id, and its handlers ignore any other sender.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::spawner::{wait_child, StartAction};

/// The child's stack. It makes a few system calls in shallow frames; no guard page
/// protects it, so it is generous.
const STACK: usize = 128 * 1024;

/// Where the child failed, for the error message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Group,
    Stdio,
    Directory,
    Cgroup,
    AddressSpace,
    OpenFiles,
    DeathSignal,
    ParentGone,
    Exec,
}

impl Step {
    fn describe(self) -> &'static str {
        match self {
            Step::Group => "making its process group",
            Step::Stdio => "redirecting its output",
            Step::Directory => "entering its working directory",
            Step::Cgroup => "joining its cgroup",
            Step::AddressSpace => "limiting its address space",
            Step::OpenFiles => "restoring its limit on open files",
            Step::DeathSignal => "setting its death signal",
            Step::ParentGone => "the worker exited while starting the action",
            Step::Exec => "executing it",
        }
    }
}

/// Everything the child reads, prepared by the parent, and the two words it writes back.
struct Child<'a> {
    /// Paths to execve in turn (one, unless the program is looked up in PATH).
    candidates: Vec<CString>,
    /// Null-terminated pointer arrays into the caller's C strings.
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    /// `/bin/sh`, the candidate (filled in by the child), then `argv[1..]`: the command
    /// for a file without a `#!` line.
    sh_argv: Vec<*const libc::c_char>,
    cwd: CString,
    stdin: libc::c_int,
    stdout: libc::c_int,
    stderr: libc::c_int,
    cgroup_procs: &'a [CString],
    address_space: Option<u64>,
    /// RLIMIT_NOFILE as the command gets it (the server raised its own).
    open_files: Option<libc::rlimit>,
    cpus: Option<usize>,
    /// The pid that will be the child's parent: if another one is, the parent died.
    parent: i32,
    failed: Option<Step>,
    errno: i32,
}

/// Starts `a`'s command as a child of this process (whose pid is `parent`), in a process
/// group of its own; returns its pid. The caller reaps it (see `spawner::wait_child`).
pub(crate) fn launch(a: &StartAction, parent: i32) -> io::Result<i32> {
    if a.program.as_os_str().is_empty() {
        return Err(io::Error::new(io::ErrorKind::NotFound, "the program's name is empty"));
    }
    let c = |s: &OsStr| CString::new(s.as_bytes()).map_err(|_| io::Error::other("a NUL byte in an argument"));
    let program = c(a.program.as_os_str())?;
    let strings: Vec<CString> = std::iter::once(Ok(program.clone()))
        .chain(a.args.iter().map(|s| c(OsStr::new(s))))
        .collect::<io::Result<_>>()?;
    // One value per name, the last given, as std's Command kept them.
    let vars: std::collections::BTreeMap<&str, &str> = a.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let env: Vec<CString> = vars
        .iter()
        .map(|(k, v)| {
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            CString::new(kv).map_err(|_| io::Error::other("a NUL byte in an environment variable"))
        })
        .collect::<io::Result<_>>()?;
    let candidates = if a.program.as_os_str().as_bytes().contains(&b'/') {
        vec![program]
    } else {
        let path = vars.get("PATH").copied().unwrap_or("/bin:/usr/bin");
        path_candidates(path, a.program.as_os_str().as_bytes())?
    };
    let cgroup_procs: Vec<CString> = a.cgroup_procs.iter().map(|p| c(p.as_os_str())).collect::<io::Result<_>>()?;
    let stdin = File::open("/dev/null")?;
    // Not through a link: the worker removes a log an earlier command turned into one,
    // and this makes sure a link never sends a command's output somewhere else.
    let log = |p: &Path| {
        use std::os::unix::fs::OpenOptionsExt;
        File::options().write(true).create(true).truncate(true).custom_flags(libc::O_NOFOLLOW).open(p)
    };
    let stdout = log(&a.stdout)?;
    let stderr = log(&a.stderr)?;
    let nul_terminated = |v: &[CString]| v.iter().map(|s| s.as_ptr()).chain([std::ptr::null()]).collect::<Vec<_>>();
    let mut sh_argv = nul_terminated(&strings);
    sh_argv.insert(0, c"/bin/sh".as_ptr());
    let mut child = Child {
        candidates,
        argv: nul_terminated(&strings),
        envp: nul_terminated(&env),
        sh_argv,
        cwd: c(a.cwd.as_os_str())?,
        stdin: stdin.as_raw_fd(),
        stdout: stdout.as_raw_fd(),
        stderr: stderr.as_raw_fd(),
        cgroup_procs: &cgroup_procs,
        address_space: a.address_space,
        open_files: a.open_files.map(crate::open_files::with_soft).transpose()?,
        cpus: a.cpus,
        parent,
        failed: None,
        errno: 0,
    };
    // Not zeroed: the child writes before it reads, as on any stack.
    let mut stack: Vec<u8> = Vec::with_capacity(STACK);
    // SAFETY: the stack grows down from its 16-byte aligned top, inside the allocation.
    let top = unsafe { stack.as_mut_ptr().add(STACK) };
    let top = (top as usize & !15) as *mut libc::c_void;
    // Block every signal around the clone, so no handler of ours runs in the child while
    // it shares our memory (the child resets handlers before unblocking).
    // SAFETY: sigset_t is plain data filled in by sigfillset; pthread_sigmask on this thread.
    let pid = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        // SAFETY: CLONE_VFORK suspends this thread until the child execs or exits, so
        // `child` and `stack` outlive every use the child makes of them, and nothing else
        // touches them meanwhile.
        let pid = libc::clone(
            child_main,
            top,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (&mut child as *mut Child).cast(),
        );
        let err = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        if pid < 0 {
            return Err(err);
        }
        pid
    };
    // SAFETY: the child has exec'd or exited, so nothing writes these any more; volatile
    // because the compiler cannot see the child's writes.
    let (failed, errno) = unsafe { (std::ptr::read_volatile(&child.failed), std::ptr::read_volatile(&child.errno)) };
    drop(stack);
    let Some(failed) = failed else { return Ok(pid) };
    // The child exited without running the command: reap it here.
    let _ = wait_child(pid);
    Err(match (failed, errno) {
        (Step::ParentGone, _) | (_, 0) => io::Error::other(failed.describe()),
        (Step::Exec, e) => io::Error::from_raw_os_error(e),
        (step, e) => {
            let os = io::Error::from_raw_os_error(e);
            io::Error::new(os.kind(), format!("{}: {os}", step.describe()))
        }
    })
}

/// The paths execvp would try for `file`, from a PATH value (an empty entry is the current
/// directory).
fn path_candidates(path: &str, file: &[u8]) -> io::Result<Vec<CString>> {
    path.split(':')
        .map(|dir| {
            let mut p = if dir.is_empty() { b".".to_vec() } else { dir.as_bytes().to_vec() };
            p.push(b'/');
            p.extend_from_slice(file);
            CString::new(p).map_err(|_| io::Error::other("a NUL byte in PATH"))
        })
        .collect()
}

/// The child, between clone and exec. Returns only by `_exit`.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the parent's `Child`, alive and untouched by anyone else until this
    // process execs or exits (CLONE_VFORK).
    let child = unsafe { &mut *arg.cast::<Child>() };
    // SAFETY: only system calls on prepared memory (see the module doc).
    let (step, errno) = unsafe { prepare_and_exec(&mut *child) };
    // SAFETY: as above; volatile so the parent's read sees them.
    unsafe {
        std::ptr::write_volatile(&mut child.failed, Some(step));
        std::ptr::write_volatile(&mut child.errno, errno);
        libc::_exit(127)
    }
}

fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Sets the child up and execs the command; returns where it failed and the errno.
///
/// # Safety
/// Only in a vfork child, on memory the parent prepared.
unsafe fn prepare_and_exec(c: &mut Child) -> (Step, i32) {
    // SAFETY: system calls on memory the parent prepared and keeps alive, and on this
    // frame's own; the caller is a vfork child.
    unsafe {
        // Signals: a handler of the parent's must not run here, and SIGPIPE, which the Rust
        // runtime ignores, must be the default again for the command (std does the same).
        let mut query: libc::sigaction = std::mem::zeroed();
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        for sig in 1..65 {
            if sig == libc::SIGKILL || sig == libc::SIGSTOP {
                continue;
            }
            if libc::sigaction(sig, std::ptr::null(), &mut query) != 0 {
                continue;
            }
            if sig == libc::SIGPIPE || (query.sa_sigaction != libc::SIG_IGN && query.sa_sigaction != libc::SIG_DFL) {
                libc::sigaction(sig, &default, std::ptr::null_mut());
            }
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        if libc::setpgid(0, 0) != 0 {
            return (Step::Group, errno());
        }
        for (fd, to) in [(c.stdin, 0), (c.stdout, 1), (c.stderr, 2)] {
            if libc::dup2(fd, to) < 0 {
                return (Step::Stdio, errno());
            }
        }
        if libc::chdir(c.cwd.as_ptr()) != 0 {
            return (Step::Directory, errno());
        }
        for procs in c.cgroup_procs {
            if let Err(e) = join_cgroup(procs) {
                return (Step::Cgroup, e.raw_os_error().unwrap_or(0));
            }
        }
        if let Some(Err(e)) = c.address_space.map(limit_address_space) {
            return (Step::AddressSpace, e.raw_os_error().unwrap_or(0));
        }
        if let Some(rl) = &c.open_files
            && libc::setrlimit(libc::RLIMIT_NOFILE, rl) != 0
        {
            return (Step::OpenFiles, errno());
        }
        if let Some(n) = c.cpus {
            pin_to_cpus(n);
        }
        // If the process that started it dies, nobody would supervise the action.
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
            return (Step::DeathSignal, errno());
        }
        // It died between the clone and the prctl: nobody will reap us.
        if libc::getppid() != c.parent {
            return (Step::ParentGone, 0);
        }
        // As execvp: a directory that does not hold the file is skipped; EACCES is remembered
        // and reported if nothing else ran; a file without a `#!` line goes to /bin/sh; any
        // other error ends the search.
        let mut denied = false;
        let mut last = libc::ENOENT;
        for path in &c.candidates {
            libc::execve(path.as_ptr(), c.argv.as_ptr(), c.envp.as_ptr());
            last = errno();
            if last == libc::ENOEXEC {
                c.sh_argv[1] = path.as_ptr();
                libc::execve(c.sh_argv[0], c.sh_argv.as_ptr(), c.envp.as_ptr());
                return (Step::Exec, errno());
            }
            match last {
                libc::EACCES => denied = true,
                libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT => {}
                _ => return (Step::Exec, last),
            }
        }
        (Step::Exec, if denied { libc::EACCES } else { last })
    }
}

/// Writes the calling process's pid to the cgroup.procs file `procs`, which moves it into
/// that group. Runs between clone and exec, so only async-signal-safe calls and no
/// allocation: the pid is formatted on the stack.
fn join_cgroup(procs: &CString) -> std::io::Result<()> {
    // SAFETY: getpid, open, write and close are async-signal-safe; the buffers live on
    // this stack frame and `procs` is a valid C string.
    unsafe {
        // itoa formats into a buffer on this stack, with no allocation and no lock.
        let mut digits = itoa::Buffer::new();
        let pid = digits.format(libc::getpid() as u32).as_bytes();
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let written = libc::write(fd, pid.as_ptr().cast(), pid.len());
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if written != pid.len() as isize {
            return Err(err);
        }
    }
    Ok(())
}

/// Limits the address space of the calling process (and what it starts) to `bytes`.
fn limit_address_space(bytes: u64) -> std::io::Result<()> {
    let rl = libc::rlimit { rlim_cur: bytes as libc::rlim_t, rlim_max: bytes as libc::rlim_t };
    // SAFETY: setrlimit with a valid struct; async-signal-safe.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &rl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Restricts the calling process (and what it starts) to the first `n` CPUs it may use.
/// Async-signal-safe: two syscalls on stack memory.
fn pin_to_cpus(n: usize) {
    // SAFETY: cpu_set_t is plain data, manipulated with the libc macros' equivalents.
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut allowed) != 0 {
            return;
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let mut taken = 0;
        for cpu in 0..libc::CPU_SETSIZE as usize {
            if taken == n {
                break;
            }
            if libc::CPU_ISSET(cpu, &allowed) {
                libc::CPU_SET(cpu, &mut set);
                taken += 1;
            }
        }
        if taken > 0 {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn action(dir: &std::path::Path, program: &str, args: &[&str], env: &[(&str, &str)]) -> StartAction {
        StartAction {
            id: 0,
            program: program.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            cwd: dir.to_owned(),
            stdout: dir.join("out"),
            stderr: dir.join("err"),
            cgroup_procs: Vec::new(),
            address_space: None,
            open_files: None,
            cpus: None,
        }
    }

    fn me() -> i32 {
        // SAFETY: getpid has no preconditions.
        unsafe { libc::getpid() }
    }

    /// Runs `a` to its end: its exit code and stdout.
    fn run(a: &StartAction) -> (i32, String) {
        let pid = launch(a, me()).unwrap();
        let (status, _) = wait_child(pid).unwrap();
        assert!(libc::WIFEXITED(status), "ended by a signal: {status}");
        (libc::WEXITSTATUS(status), std::fs::read_to_string(&a.stdout).unwrap())
    }

    /// Writes files by a shell of its own: a file this process held open for writing could
    /// be inherited by another test's child for the moment before it execs, and running
    /// the file meanwhile fails with ETXTBSY.
    fn write_files(dir: &std::path::Path, script: &str) {
        let st = std::process::Command::new("/bin/sh").arg("-c").arg(script).current_dir(dir).status().unwrap();
        assert!(st.success());
    }

    #[test]
    fn the_command_gets_the_open_file_limit_it_is_given() {
        let d = tempfile::tempdir().unwrap();
        let mut a = action(d.path(), "/bin/sh", &["-c", "ulimit -Sn"], &[]);
        a.open_files = Some(200);
        let (_, out) = run(&a);
        assert_eq!(out.trim(), "200");
        // Never above the hard limit, which only a privileged process could raise.
        let hard = crate::open_files::with_soft(u64::MAX).unwrap().rlim_max;
        a.open_files = Some(u64::MAX);
        let (code, out) = run(&a);
        let hard = if hard == libc::RLIM_INFINITY { "unlimited".to_string() } else { hard.to_string() };
        assert_eq!((code, out.trim()), (0, hard.as_str()));
    }

    #[test]
    fn the_command_gets_its_arguments_environment_directory_group_and_files() {
        let d = tempfile::tempdir().unwrap();
        let script = "echo \"$0 $1 [$V] $(pwd)\"; echo err >&2; read -r _ _ _ _ pg _ < /proc/$$/stat; echo $pg; \
                      readlink /proc/$$/fd/0; exit 7";
        let env = [("V", "first"), ("PATH", "/usr/bin:/bin"), ("V", "a b")];
        let a = action(d.path(), "/bin/sh", &["-c", script, "zero", "one"], &env);
        let pid = launch(&a, me()).unwrap();
        let (status, _) = wait_child(pid).unwrap();
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 7, "{status}");
        let out = std::fs::read_to_string(d.path().join("out")).unwrap();
        let mut lines = out.lines();
        // A name given twice has its last value.
        assert_eq!(lines.next().unwrap(), format!("zero one [a b] {}", d.path().canonicalize().unwrap().display()));
        assert_eq!(lines.next().unwrap().trim(), pid.to_string(), "its own process group");
        assert_eq!(lines.next().unwrap(), "/dev/null", "stdin");
        assert_eq!(std::fs::read_to_string(d.path().join("err")).unwrap(), "err\n");
    }

    #[test]
    fn a_bare_name_is_looked_up_in_the_actions_path() {
        let d = tempfile::tempdir().unwrap();
        write_files(
            d.path(),
            "mkdir bin && printf '#!/bin/sh\\necho found\\n' > bin/hello && chmod 755 bin/hello && \
             printf '#!/bin/sh\\necho never\\n' > bin/locked && chmod 644 bin/locked",
        );
        let path = format!("/nonexistent:{}", d.path().join("bin").display());
        assert_eq!(run(&action(d.path(), "hello", &[], &[("PATH", &path)])), (0, "found\n".into()));
        // Not in the action's PATH, though it is in ours.
        let e = launch(&action(d.path(), "sh", &[], &[("PATH", "/nonexistent")]), me()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        // Found but not executable: EACCES, as execvp says.
        let e = launch(&action(d.path(), "locked", &[], &[("PATH", &path)]), me()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
        let e = launch(&action(d.path(), "", &[], &[]), me()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
    }

    #[test]
    fn a_script_without_an_interpreter_line_runs_in_sh() {
        let d = tempfile::tempdir().unwrap();
        write_files(d.path(), "printf 'echo \"plain $0 $1\"\\n' > plain && chmod 755 plain");
        let script = d.path().join("plain");
        let by_path = action(d.path(), script.to_str().unwrap(), &["arg"], &[]);
        assert_eq!(run(&by_path), (0, format!("plain {} arg\n", script.display())));
        let by_name = action(d.path(), "plain", &["arg"], &[("PATH", d.path().to_str().unwrap())]);
        assert_eq!(run(&by_name), (0, format!("plain {} arg\n", script.display())));
    }

    #[test]
    fn the_command_starts_with_default_handlers_and_no_blocked_signal() {
        extern "C" fn on_usr1(_: libc::c_int) {}
        let d = tempfile::tempdir().unwrap();
        // SAFETY: a handler that does nothing, an ignored signal, and a mask on this thread
        // only; the other tests neither send nor expect these signals.
        let old = unsafe {
            libc::signal(libc::SIGUSR1, on_usr1 as *const () as libc::sighandler_t);
            libc::signal(libc::SIGUSR2, libc::SIG_IGN);
            let mut set: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
            old
        };
        let (code, status) = run(&action(d.path(), "/bin/cat", &["/proc/self/status"], &[]));
        // SAFETY: restores this thread's mask.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
        assert_eq!(code, 0);
        let mask = |name: &str| {
            let line = status.lines().find(|l| l.starts_with(name)).unwrap();
            u64::from_str_radix(line[name.len()..].trim(), 16).unwrap()
        };
        let bit = |sig: libc::c_int| 1u64 << (sig - 1);
        assert_eq!(mask("SigBlk:"), 0, "the caller's blocked SIGTERM is not inherited");
        assert_eq!(mask("SigCgt:") & bit(libc::SIGUSR1), 0, "a handled signal is back to the default");
        assert_ne!(mask("SigIgn:") & bit(libc::SIGUSR2), 0, "an ignored signal stays ignored");
        assert_eq!(mask("SigIgn:") & bit(libc::SIGPIPE), 0, "SIGPIPE, which Rust ignores, is the default");
    }

    #[test]
    fn a_failure_before_exec_names_its_step() {
        let d = tempfile::tempdir().unwrap();
        let mut a = action(d.path(), "/bin/true", &[], &[]);
        a.cwd = d.path().join("missing");
        let e = launch(&a, me()).unwrap_err();
        assert!(e.to_string().contains("working directory"), "{e}");
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        let e = launch(&action(d.path(), "/bin/true", &[], &[]), me() + 1).unwrap_err();
        assert!(e.to_string().contains("worker exited"), "{e}");
    }
}
