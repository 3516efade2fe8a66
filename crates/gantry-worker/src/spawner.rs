//! The action spawner, `gantry __spawner`: one small process per worker that starts every
//! action's command and reaps it.
//!
//! Why a process of its own: a command started from the server has the server's address
//! space until it execs, and Linux folds that address space's high-water RSS into
//! the command's `ru_maxrss` (after vfork and posix_spawn too), so every action would
//! "use" as much memory as gantry itself. Started from this small process, a command
//! inherits only its few MiB. Starting is cheap too: the command is started vfork-style
//! (launch.rs), so nothing is copied, and each action costs one exec, its command's. (The
//! trampoline this replaced, `gantry __meter`, cost a fork of the server and a second exec
//! of the whole gantry binary per action: half the server's CPU on no-op actions.)
//!
//! The worker talks to it over a socket pair on its stdin, one JSON message per line.
//! [`Request::Start`] (argv, environment, directory, output files, cgroups to join,
//! limits) is answered by [`Response::Started`] with the pid, or [`Response::Failed`].
//! When the command ends, the spawner kills what is left of its process group, reaps it
//! and sends [`Response::Exited`] with its wait status and rusage. [`Request::Kill`]
//! kills an action's process group. The spawner does the killing because only it knows
//! whether a pid is still its unreaped child: a pid it has reaped may already name
//! someone else's process.
//!
//! If the worker dies, the socket reads end of file: the spawner kills every action's
//! process group and exits. If the spawner dies, its actions get SIGKILL
//! (`PR_SET_PDEATHSIG`); the worker fails the runs in flight and starts a new spawner for
//! the next one.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use gantry_core::{Error, Result};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// The hidden subcommand name; `main` must dispatch it before starting any runtime.
pub const SUBCOMMAND: &str = "__spawner";

/// What to start: everything `process::command` needs to build the command.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StartAction {
    /// Chosen by the worker's side of the connection; echoed in every response.
    pub id: u64,
    pub program: PathBuf,
    /// Arguments after the program.
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    /// `cgroup.procs` files the command joins before it execs.
    pub cgroup_procs: Vec<PathBuf>,
    /// RLIMIT_AS, when memory is not limited by a cgroup.
    pub address_space: Option<u64>,
    /// The soft limit on open files the command starts with; None: the spawner's own.
    #[serde(default)]
    pub open_files: Option<u64>,
    pub cpus: Option<usize>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "t")]
pub enum Request {
    Start(Box<StartAction>),
    Kill { id: u64 },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "t")]
pub enum Response {
    Started { id: u64, pid: i32 },
    Failed { id: u64, error: String },
    Exited { id: u64, exit: Exit },
}

/// How a command ended: its wait status and the rusage of it and the descendants it
/// reaped.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Exit {
    pub status: i32,
    pub maxrss_kib: i64,
    pub user_seconds: f64,
    pub system_seconds: f64,
}

impl Exit {
    pub fn from_wait(status: i32, ru: &libc::rusage) -> Exit {
        Exit { status, maxrss_kib: ru.ru_maxrss, user_seconds: secs(ru.ru_utime), system_seconds: secs(ru.ru_stime) }
    }
}

/// Seconds in a timeval.
fn secs(tv: libc::timeval) -> f64 {
    tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6
}

/// Waits for child `pid` with wait4, retrying on EINTR: its wait status and rusage, or
/// wait4's error (read on the thread that called it: errno is per thread). std's
/// Child::wait cannot give the rusage of one specific child.
pub fn wait_child(pid: i32) -> std::io::Result<(i32, libc::rusage)> {
    let mut status = 0;
    // SAFETY: rusage is plain old data; wait4 fills it in.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: waiting on our own child pid with valid out-pointers.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
        if r == pid {
            return Ok((status, ru));
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

pub fn kill_group(pgid: i32) {
    // SAFETY: kill(2) with a negative pid signals the process group; no memory is touched.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

// ---------------------------------------------------------------------------------------
// The spawner process.

/// The spawner's children that are not reaped yet: pid → the worker's id for it. Held
/// while a child is started, so the reaper never sees a pid before it is recorded here.
type Live = Arc<(Mutex<HashMap<i32, u64>>, Condvar)>;

/// Runs the spawner on the socket that is its stdin. Never returns.
pub fn spawner_main() -> ! {
    // SAFETY: fd 0 is the socket the worker handed over; it is owned here from now on.
    let socket = unsafe { UnixStream::from_raw_fd(0) };
    // Move the socket off fd 0 (the copy is close-on-exec) and put /dev/null there, so no
    // command can inherit the worker's channel.
    let socket = match socket.try_clone() {
        Ok(s) => s,
        Err(e) => die(&format!("cloning the worker's socket: {e}")),
    };
    if let Ok(null) = std::fs::File::open("/dev/null") {
        // SAFETY: dup2 onto fd 0, which this process owns; the file is closed after.
        unsafe {
            libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), 0);
        }
    }
    let writer = match socket.try_clone() {
        Ok(w) => Arc::new(Mutex::new(w)),
        Err(e) => die(&format!("cloning the worker's socket: {e}")),
    };
    let live: Live = Arc::new((Mutex::new(HashMap::new()), Condvar::new()));
    {
        let (live, writer) = (live.clone(), writer.clone());
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || reap(&live, &writer))
            .unwrap_or_else(|e| die(&format!("starting the reaper thread: {e}")));
    }
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    for line in BufReader::new(socket).lines() {
        let Ok(line) = line else { break };
        match serde_json::from_str::<Request>(&line) {
            Ok(Request::Start(a)) => {
                let mut children = live.0.lock().unwrap_or_else(|p| p.into_inner());
                let response = match crate::launch::launch(&a, me) {
                    Ok(pid) => {
                        // Reaped by the reaper thread with wait4.
                        children.insert(pid, a.id);
                        live.1.notify_all();
                        Response::Started { id: a.id, pid }
                    }
                    Err(e) => Response::Failed { id: a.id, error: e.to_string() },
                };
                // Sent before the lock is released: a Started always precedes its Exited.
                send(&writer, &response, &children);
            }
            Ok(Request::Kill { id }) => {
                let children = live.0.lock().unwrap_or_else(|p| p.into_inner());
                if let Some((&pid, _)) = children.iter().find(|(_, i)| **i == id) {
                    kill_group(pid);
                }
            }
            Err(e) => eprintln!("gantry spawner: ignoring a malformed request: {e}"),
        }
    }
    // The worker is gone: nobody would supervise these actions.
    kill_all_and_exit(&live.0.lock().unwrap_or_else(|p| p.into_inner()))
}

fn die(what: &str) -> ! {
    eprintln!("gantry spawner: {what}");
    std::process::exit(1)
}

fn kill_all_and_exit(children: &HashMap<i32, u64>) -> ! {
    for &pid in children.keys() {
        kill_group(pid);
    }
    std::process::exit(0)
}

/// Writes one response; a worker that cannot be written to is gone.
fn send(writer: &Mutex<UnixStream>, response: &Response, children: &HashMap<i32, u64>) {
    let mut line = serde_json::to_string(response).expect("responses serialize");
    line.push('\n');
    let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
    if w.write_all(line.as_bytes()).is_err() {
        kill_all_and_exit(children);
    }
}

/// Reaps children as they exit and reports each.
fn reap(live: &Live, writer: &Mutex<UnixStream>) {
    loop {
        {
            let mut children = live.0.lock().unwrap_or_else(|p| p.into_inner());
            while children.is_empty() {
                children = live.1.wait(children).unwrap_or_else(|p| p.into_inner());
            }
        }
        // Learn which child exited without reaping it: as an unreaped zombie it still
        // holds its pid and process group, so the group can be killed safely below.
        // SAFETY: siginfo_t is plain data; waitid fills it in.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer; P_ALL ignores the id.
        let r = unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                // ECHILD: a child whose start failed was reaped by `launch` meanwhile.
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            continue;
        }
        // SAFETY: waitid filled in a child's exit, whose si_pid is valid.
        let pid = unsafe { info.si_pid() };
        // Taken after waitid, so a start in progress has recorded its pid; a pid not
        // recorded was a failed start that `launch` has reaped itself.
        let mut children = live.0.lock().unwrap_or_else(|p| p.into_inner());
        let Some(id) = children.remove(&pid) else { continue };
        // Whatever the command left running in its group goes with it.
        kill_group(pid);
        let response = match wait_child(pid) {
            Ok((status, ru)) => Response::Exited { id, exit: Exit::from_wait(status, &ru) },
            Err(e) => Response::Failed { id, error: format!("wait4({pid}): {e}") },
        };
        send(writer, &response, &children);
    }
}

// ---------------------------------------------------------------------------------------
// The worker's side.

/// A worker's handle on its spawner process, started on first use and again after it
/// died.
pub struct Spawner {
    program: PathBuf,
    conn: Mutex<Option<Arc<Conn>>>,
}

/// One spawner process and the runs waiting on it.
struct Conn {
    requests: mpsc::UnboundedSender<String>,
    pending: Arc<Mutex<HashMap<u64, mpsc::UnboundedSender<Response>>>>,
    next_id: AtomicU64,
    alive: Arc<AtomicBool>,
    /// Dropping these closes the socket: the spawner then kills what it runs and exits.
    _io: [gantry_core::TaskGuard; 2],
}

impl Conn {
    fn send(&self, request: &Request) -> bool {
        self.requests.send(serde_json::to_string(request).expect("requests serialize")).is_ok()
    }
}

impl Spawner {
    /// `program` is a binary that understands [`SUBCOMMAND`] (gantry itself).
    pub fn new(program: impl Into<PathBuf>) -> Spawner {
        Spawner { program: program.into(), conn: Mutex::new(None) }
    }

    fn conn(&self) -> Result<Arc<Conn>> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = conn.as_ref().filter(|c| c.alive.load(Ordering::Acquire)) {
            return Ok(c.clone());
        }
        let c = Arc::new(start(&self.program)?);
        *conn = Some(c.clone());
        Ok(c)
    }

    /// Asks the spawner to start `a` (its id is assigned here).
    pub fn start(&self, mut a: StartAction) -> Result<Launched> {
        let conn = self.conn()?;
        a.id = conn.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, events) = mpsc::unbounded_channel();
        conn.pending.lock().unwrap_or_else(|p| p.into_inner()).insert(a.id, tx);
        let id = a.id;
        if !conn.send(&Request::Start(Box::new(a))) {
            conn.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            return Err(Error::Unavailable("the action spawner has exited".into()));
        }
        Ok(Launched { conn, id, events, done: false })
    }
}

fn start(program: &Path) -> Result<Conn> {
    let (ours, theirs) = UnixStream::pair().map_err(|e| Error::io("creating the spawner's socket", e))?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.arg(SUBCOMMAND)
        .stdin(Stdio::from(OwnedFd::from(theirs)))
        .stdout(Stdio::null())
        // Its own process group: a Ctrl-C meant for the server must not kill the spawner
        // before the server has stopped its actions.
        .process_group(0);
    // Reaped by tokio once it exits (after the socket closes).
    cmd.spawn().map_err(|e| Error::io(format!("starting the action spawner {}", program.display()), e))?;
    ours.set_nonblocking(true).map_err(|e| Error::io("configuring the spawner's socket", e))?;
    let (read, mut write) = tokio::net::UnixStream::from_std(ours)
        .map_err(|e| Error::io("registering the spawner's socket", e))?
        .into_split();
    let (requests, mut to_send) = mpsc::unbounded_channel::<String>();
    let pending: Arc<Mutex<HashMap<u64, mpsc::UnboundedSender<Response>>>> = Arc::default();
    let alive = Arc::new(AtomicBool::new(true));
    let writer = gantry_core::task::spawn_named("spawner-writer", async move {
        while let Some(mut line) = to_send.recv().await {
            line.push('\n');
            if write.write_all(line.as_bytes()).await.is_err() {
                break;
            }
        }
    });
    let reader = {
        let (pending, alive) = (pending.clone(), alive.clone());
        gantry_core::task::spawn_named("spawner-reader", async move {
            let mut lines = tokio::io::BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let response: Response = match serde_json::from_str(&line) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::error!(error = %e, "the action spawner sent a malformed message");
                        break;
                    }
                };
                let (id, last) = match &response {
                    Response::Started { id, .. } => (*id, false),
                    Response::Failed { id, .. } | Response::Exited { id, .. } => (*id, true),
                };
                let mut pending = pending.lock().unwrap_or_else(|p| p.into_inner());
                let tx = if last { pending.remove(&id) } else { pending.get(&id).cloned() };
                if let Some(tx) = tx {
                    let _ = tx.send(response);
                }
            }
            // The spawner is gone: the runs waiting on it learn so when their senders drop.
            alive.store(false, Ordering::Release);
            pending.lock().unwrap_or_else(|p| p.into_inner()).clear();
            tracing::warn!("the action spawner exited; the next action starts a new one");
        })
    };
    Ok(Conn { requests, pending, next_id: AtomicU64::new(1), alive, _io: [writer, reader] })
}

/// One command started through the spawner. Dropped before it exited, it kills the
/// command's process group: an action never outlives the task that owns it.
pub struct Launched {
    conn: Arc<Conn>,
    id: u64,
    events: mpsc::UnboundedReceiver<Response>,
    done: bool,
}

fn spawner_died() -> Error {
    Error::Unavailable("the action spawner exited while the action ran".into())
}

impl Launched {
    /// Waits for the command's pid. An error means it did not start.
    pub async fn started(&mut self) -> Result<i32> {
        match self.events.recv().await {
            Some(Response::Started { pid, .. }) => Ok(pid),
            Some(Response::Failed { error, .. }) => {
                self.done = true;
                Err(Error::FailedPrecondition(error))
            }
            Some(Response::Exited { .. }) => Err(Error::internal("the spawner reported an exit before a start")),
            None => {
                self.done = true;
                Err(spawner_died())
            }
        }
    }

    /// Waits for the command to end.
    pub async fn exited(&mut self) -> Result<Exit> {
        let r = match self.events.recv().await {
            Some(Response::Exited { exit, .. }) => Ok(exit),
            Some(Response::Failed { error, .. }) => Err(Error::internal(error)),
            Some(Response::Started { .. }) => Err(Error::internal("the spawner reported a second start")),
            None => Err(spawner_died()),
        };
        self.done = true;
        r
    }

    /// Kills the command's process group (if it is still running).
    pub fn kill(&self) {
        self.conn.send(&Request::Kill { id: self.id });
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        if !self.done {
            self.kill();
            self.conn.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_as_one_line_each() {
        let start = Request::Start(Box::new(StartAction {
            id: 7,
            program: "/bin/sh".into(),
            args: vec!["-c".into(), "echo 'a\nb'".into()],
            env: vec![("K".into(), "v=1".into())],
            cwd: "/tmp/x".into(),
            stdout: "/tmp/x/out".into(),
            stderr: "/tmp/x/err".into(),
            cgroup_procs: vec!["/sys/fs/cgroup/memory/g/cgroup.procs".into()],
            address_space: Some(1 << 30),
            open_files: Some(1024),
            cpus: None,
        }));
        let line = serde_json::to_string(&start).unwrap();
        assert!(!line.contains('\n'), "{line}");
        match serde_json::from_str::<Request>(&line).unwrap() {
            Request::Start(a) => {
                assert_eq!(a.id, 7);
                assert_eq!(a.args[1], "echo 'a\nb'");
                assert_eq!(a.address_space, Some(1 << 30));
                assert_eq!(a.open_files, Some(1024));
            }
            other => panic!("{other:?}"),
        }
        let exit = Response::Exited {
            id: 7,
            exit: Exit { status: 256, maxrss_kib: 1024, user_seconds: 0.5, system_seconds: 0.25 },
        };
        let back: Response = serde_json::from_str(&serde_json::to_string(&exit).unwrap()).unwrap();
        assert!(matches!(back, Response::Exited { id: 7, exit } if exit.status == 256 && exit.maxrss_kib == 1024));
    }
}
