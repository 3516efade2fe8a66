//! One Bazel runner: a directory with its own output base, reused between builds the way
//! a build worker keeps a warm server, and the code that runs one build in it with a
//! deadline and watches the server's memory while it runs, stopping it early when the
//! server is stuck out of memory ([`stuck`]).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use gantry_core::task::spawn_named;

use crate::bep::{self, BepSummary};
use crate::classify::{classify, oom_signal, BuildOutcome, OomSignal, RunFacts};
use crate::procfs;
use crate::stuck::{self, SpiralRule};

/// Runner settings from `[batch]`.
#[derive(Debug, Clone)]
pub struct RunnerSettings {
    pub bazel: PathBuf,
    pub startup_flags: Vec<String>,
    pub extra_flags: Vec<String>,
    /// `-Xmx` of every Bazel server.
    pub heap_bytes: u64,
    pub deadline: Duration,
    pub kill_grace: Duration,
    /// `[batch] gc_spiral_window`: a build whose server spends this long stuck out of
    /// memory (in a GC spiral, or after an OutOfMemoryError) is stopped as OOM (see
    /// [`stuck`]). Zero: never, and no GC log.
    pub gc_spiral_window: Duration,
    /// `--remote_executor` given to Bazel.
    pub remote_executor: String,
    /// What Bazel presents to a server with `[auth]` or TLS.
    pub credentials: BazelCredentials,
}

/// Credentials a runner's Bazel presents to the remote executor (`[batch] token_file`,
/// `tls_*`): Bazel's own TLS flags, and the bearer token as `--remote_header`.
#[derive(Debug, Clone, Default)]
pub struct BazelCredentials {
    /// Holds the token. Re-read before every build, so a rotated token is used at once;
    /// passed through a private bazelrc (mode 0600), never on a command line.
    pub token_file: Option<PathBuf>,
    /// `--tls_certificate`: the CA that signed the server's certificate.
    pub tls_certificate: Option<PathBuf>,
    /// `--tls_client_certificate` and `--tls_client_key`, for mTLS.
    pub tls_client_certificate: Option<PathBuf>,
    pub tls_client_key: Option<PathBuf>,
}

/// Writes the bazelrc that carries the token: `build` (which `test` inherits) gets the
/// header. Written to a temp file with mode 0600 and renamed, so Bazel never reads half
/// a token and nobody else reads any.
fn write_token_rc(token_file: &Path, rc: &Path) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let token = std::fs::read_to_string(token_file)
        .map_err(|e| format!("reading the token file {}: {e}", token_file.display()))?;
    let token = token.trim();
    // Bazel tokenizes rc lines like a shell: the value is quoted, so it may not hold
    // quotes or backslashes (no bearer token does).
    if token.is_empty() || token.chars().any(|c| c.is_whitespace() || c.is_control() || matches!(c, '"' | '\'' | '\\'))
    {
        return Err(format!("the token file {} must hold one token on one line", token_file.display()));
    }
    let tmp = rc.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| format!("creating {}: {e}", tmp.display()))?;
    writeln!(f, "build \"--remote_header=Authorization=Bearer {token}\"")
        .map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, rc).map_err(|e| format!("renaming {}: {e}", tmp.display()))
}

/// Flags every build gets before its own flags, so a build may override them.
///
/// - the eager OOM threshold turns minutes of GC thrashing into a quick exit 33;
/// - the used-heap metric forces a full GC after the build and puts the retained heap
///   in the BEP, which is the memory label (see README);
/// - dropping Skyframe state after each build keeps a warm server's heap about this
///   build only: without it, heap grows with every earlier build's targets and the
///   memory labels stop describing the build.
pub const RUNNER_FLAGS: [&str; 3] = [
    "--experimental_oom_more_eagerly_threshold=90",
    "--bep_publish_used_heap_size_post_build",
    "--nokeep_state_after_build",
];

/// One build to run.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub workspace: PathBuf,
    /// "build" or "test".
    pub command: String,
    pub flags: Vec<String>,
    pub targets: Vec<String>,
    /// Bazel's `--invocation_id` (a UUID); gantry's execution log files actions under it.
    pub invocation_id: String,
}

#[derive(Debug, Clone)]
pub struct RunReport {
    pub outcome: BuildOutcome,
    /// What said OOM; Some exactly when the outcome is OOM.
    pub oom_signal: Option<OomSignal>,
    pub exit_code: Option<i32>,
    pub bep: BepSummary,
    /// Peak resident memory of the Bazel server JVM during the build.
    pub server_vm_hwm: Option<u64>,
    pub wall_seconds: f64,
    /// One line for status displays: why it ended, in Bazel's words where possible.
    pub message: String,
}

impl RunReport {
    /// A build that never got to run Bazel (unusable workspace, Bazel missing...).
    pub fn infra_error(message: String, wall_seconds: f64) -> RunReport {
        RunReport {
            outcome: BuildOutcome::InfraError,
            oom_signal: None,
            exit_code: None,
            bep: BepSummary::default(),
            server_vm_hwm: None,
            wall_seconds,
            message,
        }
    }
}

pub struct Runner {
    pub index: usize,
    dir: PathBuf,
    settings: std::sync::Arc<RunnerSettings>,
}

/// Kills Bazel (client group and server) if a run is abandoned, e.g. the service's
/// task is aborted at shutdown, so no build outlives its runner unaccounted.
struct StopGuard {
    pgid: Option<i32>,
    output_base: PathBuf,
    armed: bool,
}

impl Drop for StopGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(pgid) = self.pgid {
            procfs::signal_group(pgid, libc::SIGKILL);
        }
        if let Some(pid) = procfs::server_pid(&self.output_base) {
            procfs::signal(pid, libc::SIGKILL);
        }
    }
}

fn tail(path: &Path, max: usize) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let start = text.len().saturating_sub(max);
    String::from_utf8_lossy(&text[start..]).into_owned()
}

/// The line of Bazel's output that says what went wrong, if any.
fn error_line(log: &str) -> Option<String> {
    log.lines()
        .rev()
        .find(|l| {
            l.starts_with("ERROR:")
                || l.contains("FAILED:")
                || l.contains("OutOfMemoryError")
                || l.contains("Server terminated")
        })
        .map(|l| l.chars().take(300).collect())
}

impl Runner {
    pub fn new(index: usize, root: &Path, settings: std::sync::Arc<RunnerSettings>) -> std::io::Result<Runner> {
        let dir = root.join(format!("r{index}"));
        std::fs::create_dir_all(&dir)?;
        Ok(Runner { index, dir, settings })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn output_base(&self) -> PathBuf {
        self.dir.join("output_base")
    }

    /// Startup options: the same for every command of this runner, or Bazel would
    /// restart its server to change them.
    pub fn startup_args(&self) -> Vec<String> {
        let s = &self.settings;
        // An OutOfMemoryError caught where Bazel's crash handler never sees it (code that
        // logs it and goes on) can leave work unfinished that Bazel then waits on, quiet,
        // until the deadline. Bazel counts any OutOfMemoryError as fatal anyway: the JVM
        // ends at the first one, saying so in jvm.out, which the runner reads as OOM. It
        // comes before `startup_flags`, so a deployment can turn it off (the JVM takes
        // the last of its options).
        let mut a = vec!["--host_jvm_args=-XX:+ExitOnOutOfMemoryError".to_string()];
        a.extend(s.startup_flags.iter().cloned());
        a.push(format!("--output_base={}", self.output_base().display()));
        a.push(format!("--host_jvm_args=-Xmx{}k", (s.heap_bytes / 1024).max(4096)));
        // A heap dump of a dying server is hundreds of MB per OOM build and minutes of I/O.
        a.push("--host_jvm_args=-XX:-HeapDumpOnOutOfMemoryError".into());
        if !s.gc_spiral_window.is_zero() {
            a.extend(stuck::jvm_args(&self.gc_log()));
        }
        if s.credentials.token_file.is_some() {
            a.push(format!("--bazelrc={}", self.token_rc().display()));
        }
        a
    }

    /// The server's GC log (see [`stuck::jvm_args`]), tailed while a build runs.
    pub fn gc_log(&self) -> PathBuf {
        self.dir.join("gc.log")
    }

    /// The private bazelrc that carries the bearer token (see [`BazelCredentials`]).
    pub fn token_rc(&self) -> PathBuf {
        self.dir.join("credentials.bazelrc")
    }

    /// The full command line (without the program), for logs and tests.
    pub fn args(&self, spec: &RunSpec, bep_file: &Path) -> Vec<String> {
        let s = &self.settings;
        let mut a = self.startup_args();
        a.push(spec.command.clone());
        a.extend(RUNNER_FLAGS.iter().map(|f| f.to_string()));
        a.extend(spec.flags.iter().cloned());
        a.extend(s.extra_flags.iter().cloned());
        a.push(format!("--remote_executor={}", s.remote_executor));
        let c = &s.credentials;
        for (flag, path) in [
            ("--tls_certificate", &c.tls_certificate),
            ("--tls_client_certificate", &c.tls_client_certificate),
            ("--tls_client_key", &c.tls_client_key),
        ] {
            if let Some(p) = path {
                a.push(format!("{flag}={}", p.display()));
            }
        }
        a.push(format!("--invocation_id={}", spec.invocation_id));
        a.push(format!("--build_event_json_file={}", bep_file.display()));
        a.push("--".into());
        a.extend(spec.targets.iter().cloned());
        a
    }

    /// Runs one build to its end or its deadline. Never fails: everything that goes
    /// wrong is an outcome (INFRA_ERROR when Bazel could not even start).
    pub async fn run(&self, spec: &RunSpec) -> RunReport {
        let started = Instant::now();
        let bep_file = self.dir.join("bep.json");
        let log_file = self.dir.join("bazel.log");
        let _ = std::fs::remove_file(&bep_file);
        let ob = self.output_base();
        let mut facts = RunFacts::default();
        let fail_start = |message: String| RunReport::infra_error(message, started.elapsed().as_secs_f64());
        if let Some(t) = &self.settings.credentials.token_file
            && let Err(e) = write_token_rc(t, &self.token_rc())
        {
            return fail_start(e);
        }
        let log = match std::fs::File::create(&log_file) {
            Ok(f) => f,
            Err(e) => return fail_start(format!("creating {}: {e}", log_file.display())),
        };
        let log2 = match log.try_clone() {
            Ok(f) => f,
            Err(e) => return fail_start(format!("{}: {e}", log_file.display())),
        };
        let mut cmd = tokio::process::Command::new(&self.settings.bazel);
        cmd.args(self.args(spec, &bep_file))
            .current_dir(&spec.workspace)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .process_group(0)
            .kill_on_drop(true);
        // What the GC log and jvm.out hold now belongs to earlier builds (a warm server).
        let tails = (!self.settings.gc_spiral_window.is_zero())
            .then(|| (stuck::Tail::at_end(&self.gc_log()), stuck::Tail::at_end(&ob.join("server/jvm.out"))));
        // A warm server's peak RSS so far belongs to earlier builds.
        if let Some(pid) = procfs::server_pid(&ob) {
            procfs::reset_hwm(pid);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => return fail_start(format!("starting {}: {e}", self.settings.bazel.display())),
        };
        let mut guard = StopGuard { pgid: child.id().map(|p| p as i32), output_base: ob.clone(), armed: true };
        let mut hwm: Option<u64> = None;
        let sample = |hwm: &mut Option<u64>| {
            if let Some(v) = procfs::server_pid(&ob).and_then(procfs::vm_hwm) {
                *hwm = Some(hwm.map_or(v, |h| h.max(v)));
            }
        };
        let deadline = tokio::time::sleep(self.settings.deadline);
        tokio::pin!(deadline);
        // The watcher reports a stuck server once; it is aborted when this build ends.
        let (stuck_tx, mut stuck_rx) = tokio::sync::mpsc::channel(1);
        // What it last saw goes into the message of a build that reaches its deadline.
        let (seen_tx, seen_rx) = tokio::sync::watch::channel(None);
        let watcher = tails.map(|(gc_log, jvm_out)| {
            // The file was removed above: every line of it is this build's.
            let bep = stuck::Tail::at_end(&bep_file);
            let (heap, rule) = (self.settings.heap_bytes, SpiralRule::with_window(self.settings.gc_spiral_window));
            spawn_named("oom-watch", async move {
                let stuck = stuck::watch(gc_log, jvm_out, bep, heap, rule, started, seen_tx).await;
                let _ = stuck_tx.send(stuck).await;
            })
        });
        let mut stuck_note = None;
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let status = loop {
            tokio::select! {
                s = child.wait() => break s,
                _ = tick.tick() => sample(&mut hwm),
                _ = &mut deadline => {
                    facts.deadline_hit = true;
                    tracing::warn!(runner = self.index, invocation = %spec.invocation_id, "build reached its deadline; stopping Bazel");
                    break self.stop(&mut child, guard.pgid, &ob).await;
                }
                Some(stuck) = stuck_rx.recv() => {
                    facts.stopped_stuck = Some(stuck.signal());
                    let note = stuck.describe(self.settings.heap_bytes, self.settings.gc_spiral_window);
                    tracing::warn!(runner = self.index, invocation = %spec.invocation_id, "{note}; stopping Bazel");
                    stuck_note = Some(note);
                    break self.stop(&mut child, guard.pgid, &ob).await;
                }
            }
        };
        drop(watcher);
        sample(&mut hwm);
        guard.armed = false;
        facts.exit_code = status.ok().and_then(|s| s.code());
        facts.bep = bep::read(&bep_file);
        let log_tail = tail(&log_file, 16 * 1024);
        let jvm_out = ob.join("server/jvm.out");
        let jvm_fresh = std::fs::metadata(&jvm_out)
            .and_then(|m| m.modified())
            .map(|t| t.elapsed().map_or(true, |age| age <= started.elapsed()))
            .unwrap_or(false);
        facts.oom_in_log = log_tail.contains("java.lang.OutOfMemoryError")
            || log_tail.contains("RetainedHeapLimiter")
            || (jvm_fresh && tail(&jvm_out, 64 * 1024).contains("java.lang.OutOfMemoryError"));
        let outcome = classify(&facts);
        // A server stopped as stuck is OOM (classify), and the note says why.
        let message = stuck_note.unwrap_or_else(|| match outcome {
            BuildOutcome::Success => String::new(),
            BuildOutcome::DeadlineExceeded => {
                let seen = seen_rx
                    .borrow()
                    .map(|s| format!("; {}", s.describe(self.settings.heap_bytes, self.settings.gc_spiral_window)));
                format!("stopped at the {:?} deadline{}", self.settings.deadline, seen.unwrap_or_default())
            }
            _ => error_line(&log_tail).unwrap_or_else(|| {
                format!(
                    "bazel exited with {:?} ({})",
                    facts.exit_code,
                    facts.bep.exit_code_name.as_deref().unwrap_or("no BEP")
                )
            }),
        });
        RunReport {
            outcome,
            oom_signal: oom_signal(&facts),
            exit_code: facts.exit_code,
            bep: facts.bep,
            server_vm_hwm: hwm,
            wall_seconds: started.elapsed().as_secs_f64(),
            message,
        }
    }

    /// Stops a build the runner gave up on (deadline, stuck server): SIGTERM to the server
    /// and SIGINT to the client, `kill_grace` for both to go, then SIGKILL to what is
    /// left. Returns the client's exit status.
    async fn stop(
        &self,
        child: &mut tokio::process::Child,
        pgid: Option<i32>,
        ob: &Path,
    ) -> std::io::Result<std::process::ExitStatus> {
        if let Some(pid) = procfs::server_pid(ob) {
            procfs::signal(pid, libc::SIGTERM);
        }
        if let Some(pgid) = pgid {
            procfs::signal_group(pgid, libc::SIGINT);
        }
        // The client may exit at once on SIGINT while the server lives on (a JVM
        // thrashing in GC ignores SIGTERM), and a server still starting has no pid file
        // yet: wait for both to be gone, then SIGKILL whatever is left at the end of the
        // grace.
        let grace = tokio::time::sleep(self.settings.kill_grace);
        tokio::pin!(grace);
        let mut poll = tokio::time::interval(Duration::from_millis(100));
        let mut exited = None;
        while exited.is_none() || procfs::server_pid(ob).is_some() {
            tokio::select! {
                s = child.wait(), if exited.is_none() => exited = Some(s),
                _ = poll.tick() => {}
                _ = &mut grace => break,
            }
        }
        if let Some(pid) = procfs::server_pid(ob) {
            procfs::signal(pid, libc::SIGKILL);
            // SIGKILL is delivered asynchronously: the next build must not find this
            // server still there.
            let t = Instant::now();
            while procfs::alive(pid) && t.elapsed() < Duration::from_secs(2) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        if let Some(s) = exited {
            return s;
        }
        if let Some(pgid) = pgid {
            procfs::signal_group(pgid, libc::SIGKILL);
        }
        child.wait().await
    }

    /// Stops this runner's Bazel server (at service shutdown).
    pub async fn shutdown(&self) {
        let ob = self.output_base();
        if procfs::server_pid(&ob).is_none() {
            return;
        }
        let mut cmd = tokio::process::Command::new(&self.settings.bazel);
        cmd.args(self.startup_args())
            .arg("shutdown")
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let _ = tokio::time::timeout(Duration::from_secs(20), cmd.status()).await;
        if let Some(pid) = procfs::server_pid(&ob) {
            procfs::signal(pid, libc::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// The server ends at its first OutOfMemoryError, and a deployment's own startup
    /// flags come after, so they can turn that off; the heap and the GC log follow them.
    #[test]
    fn the_exit_on_out_of_memory_error_comes_before_the_deployments_startup_flags() {
        let d = tempfile::tempdir().unwrap();
        let off = "--host_jvm_args=-XX:-ExitOnOutOfMemoryError".to_string();
        let settings = RunnerSettings {
            bazel: "bazel".into(),
            startup_flags: vec![off.clone()],
            extra_flags: vec![],
            heap_bytes: 64 << 20,
            deadline: Duration::from_secs(20),
            kill_grace: Duration::from_secs(1),
            gc_spiral_window: Duration::from_secs(30),
            remote_executor: "grpc://localhost:1".into(),
            credentials: BazelCredentials::default(),
        };
        let runner = Runner::new(0, d.path(), std::sync::Arc::new(settings)).unwrap();
        let a = runner.startup_args();
        let at = |f: &str| a.iter().position(|x| x == f).unwrap_or_else(|| panic!("{f} in {a:?}"));
        assert!(at("--host_jvm_args=-XX:+ExitOnOutOfMemoryError") < at(&off), "{a:?}");
        assert!(at(&off) < at("--host_jvm_args=-Xmx65536k"), "{a:?}");
        assert!(a.iter().any(|x| x.starts_with("--host_jvm_args=-Xlog:gc:file=")), "{a:?}");
    }

    /// The token reaches Bazel through a private bazelrc, re-read before every build,
    /// and never appears on the command line; TLS files go as Bazel's own flags.
    #[tokio::test]
    async fn credentials_reach_bazel_without_the_token_on_its_command_line() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        // A "bazel" that records its arguments and the rc files it was given.
        let bazel = d.path().join("bazel");
        std::fs::write(
            &bazel,
            "#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; case \"$a\" in --bazelrc=*) cat \"${a#--bazelrc=}\";; esac; done > \"$PWD/seen.txt\"\nexit 0\n",
        )
        .unwrap();
        std::fs::set_permissions(&bazel, std::fs::Permissions::from_mode(0o755)).unwrap();
        let ws = d.path().join("ws");
        std::fs::create_dir_all(&ws).unwrap();
        let token_file = d.path().join("batch.token");
        std::fs::write(&token_file, "first-secret\n").unwrap();
        let settings = RunnerSettings {
            bazel,
            startup_flags: vec![],
            extra_flags: vec![],
            heap_bytes: 64 << 20,
            deadline: Duration::from_secs(20),
            kill_grace: Duration::from_secs(1),
            gc_spiral_window: Duration::from_secs(30),
            remote_executor: "grpcs://localhost:1".into(),
            credentials: BazelCredentials {
                token_file: Some(token_file.clone()),
                tls_certificate: Some("/etc/ca.pem".into()),
                tls_client_certificate: Some("/etc/c.pem".into()),
                tls_client_key: Some("/etc/c.key".into()),
            },
        };
        let runner = Runner::new(0, &d.path().join("runners"), std::sync::Arc::new(settings)).unwrap();
        let spec = RunSpec {
            workspace: ws.clone(),
            command: "build".into(),
            flags: vec![],
            targets: vec!["//:t".into()],
            invocation_id: "00000000-0000-0000-0000-000000000000".into(),
        };
        let args = runner.args(&spec, Path::new("/tmp/bep.json"));
        assert!(!args.iter().any(|a| a.contains("secret")), "{args:?}");
        for f in ["--tls_certificate=/etc/ca.pem", "--tls_client_certificate=/etc/c.pem", "--tls_client_key=/etc/c.key"]
        {
            assert!(args.iter().any(|a| a == f), "{f} in {args:?}");
        }
        runner.run(&spec).await;
        let seen = std::fs::read_to_string(ws.join("seen.txt")).unwrap();
        assert!(seen.contains("build \"--remote_header=Authorization=Bearer first-secret\""), "{seen}");
        let mode = std::fs::metadata(runner.token_rc()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // A rotated token is used by the next build.
        std::fs::write(&token_file, "second-secret").unwrap();
        runner.run(&spec).await;
        let seen = std::fs::read_to_string(ws.join("seen.txt")).unwrap();
        assert!(seen.contains("Bearer second-secret") && !seen.contains("first-secret"), "{seen}");
        // An unreadable or malformed token is an infrastructure error, before Bazel starts.
        std::fs::write(&token_file, "two words").unwrap();
        let r = runner.run(&spec).await;
        assert_eq!(r.outcome, BuildOutcome::InfraError, "{r:?}");
    }

    /// Whether a stand-in's server was still alive after the build; kills it if so.
    fn kill_stand_in_server(runner: &Runner) -> bool {
        let pid: i32 = std::fs::read_to_string(runner.output_base().join("server/server.pid.txt"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let alive = procfs::alive(pid);
        procfs::signal(pid, libc::SIGKILL);
        alive
    }

    /// A stand-in for Bazel whose client exits at once on SIGINT and whose server (in a
    /// session of its own, like Bazel's daemon) ignores SIGTERM, as a JVM thrashing in GC
    /// does: the deadline must still leave no server behind.
    #[tokio::test]
    async fn deadline_kills_a_server_that_ignores_sigterm_after_its_client_exited() {
        let d = tempfile::tempdir().unwrap();
        let bazel = d.path().join("fake-bazel");
        std::fs::write(
            &bazel,
            "#!/bin/sh\n\
             for a in \"$@\"; do case \"$a\" in --output_base=*) ob=\"${a#--output_base=}\" ;; esac; done\n\
             mkdir -p \"$ob/server\"\n\
             setsid sh -c 'trap \"\" TERM; exec sleep 30' </dev/null >/dev/null 2>&1 &\n\
             echo $! > \"$ob/server/server.pid.txt\"\n\
             trap 'exit 8' INT\n\
             sleep 30 &\n\
             wait\n",
        )
        .unwrap();
        std::fs::set_permissions(&bazel, std::fs::Permissions::from_mode(0o755)).unwrap();
        let ws = d.path().join("ws");
        std::fs::create_dir_all(&ws).unwrap();
        let settings = RunnerSettings {
            bazel,
            startup_flags: vec![],
            extra_flags: vec![],
            heap_bytes: 64 << 20,
            deadline: Duration::from_millis(800),
            kill_grace: Duration::from_secs(2),
            gc_spiral_window: Duration::from_secs(30),
            remote_executor: "grpc://127.0.0.1:1".into(),
            credentials: BazelCredentials::default(),
        };
        let runner = Runner::new(0, &d.path().join("runners"), std::sync::Arc::new(settings)).unwrap();
        let spec = RunSpec {
            workspace: ws,
            command: "build".into(),
            flags: vec![],
            targets: vec!["//:t".into()],
            invocation_id: "00000000-0000-0000-0000-000000000000".into(),
        };
        let report = runner.run(&spec).await;
        let survived = kill_stand_in_server(&runner);
        assert_eq!(report.outcome, BuildOutcome::DeadlineExceeded, "{report:?}");
        assert_eq!(report.exit_code, Some(8), "the client exited on SIGINT: {report:?}");
        assert!(!survived, "the server that ignored SIGTERM outlived the build's deadline and grace");
        assert!(report.wall_seconds < 5.0, "{report:?}");
        // What the watcher saw says it was no GC: the next person knows where to look.
        assert!(report.message.starts_with("stopped at the 800ms deadline; in the 30s before "), "{report:?}");
        assert!(report.message.contains("did 0 full GCs and spent 0% of the time in GC"), "{report:?}");
    }

    /// A stand-in for Bazel with a server (its own session, deaf to SIGTERM like a JVM in
    /// GC) that writes the GC log it is given with `-Xlog`: for `//:stuck`, a full GC
    /// leaving 60 of 64 MiB every 100 ms, 80 ms each, and no BEP event, forever; for
    /// `//:crawl`, the same with a BEP `progress` event (stderr text) every 300 ms; for
    /// `//:busy`, the same GCs for 4 s while a target completes every 300 ms, then
    /// success; for `//:oom`, no GC at all but an OutOfMemoryError in `jvm.out`, and
    /// no end.
    const GC_BAZEL: &str = r#"#!/bin/sh
for a in "$@"; do
  case "$a" in
    --output_base=*) ob="${a#--output_base=}" ;;
    --build_event_json_file=*) bep="${a#--build_event_json_file=}" ;;
    --host_jvm_args=-Xlog:gc:file=*) gc="${a#*file=\"}"; gc="${gc%%\"*}" ;;
  esac
  target="$a"
done
mkdir -p "$ob/server"
if [ "$target" = "//:oom" ]; then
  setsid sh -c 'trap "" TERM; echo "Exception: java.lang.OutOfMemoryError thrown from the UncaughtExceptionHandler in thread \"skyframe-evaluator 1\"" >> "$0"; exec sleep 60' "$ob/server/jvm.out" </dev/null >/dev/null 2>&1 &
else
  setsid sh -c 'trap "" TERM; while :; do echo "[9.9s] GC(7) Pause Full (G1 Compaction Pause) 61M->60M(64M) 80.000ms" >> "$0"; sleep 0.1; done' "$gc" </dev/null >/dev/null 2>&1 &
fi
echo $! > "$ob/server/server.pid.txt"
trap 'exit 8' INT
if [ "$target" = "//:crawl" ]; then
  while :; do echo '{"id":{"progress":{"opaqueCount":1}},"progress":{"stderr":"[1 / 9] 1 action running"}}' >> "$bep"; sleep 0.3; done
fi
if [ "$target" = "//:busy" ]; then
  for i in 1 2 3 4 5 6 7 8 9 10 11 12 13; do echo '{"id":{"targetCompleted":{"label":"//:t'$i'"}},"completed":{"success":true}}' >> "$bep"; sleep 0.3; done
  kill -9 "$(cat "$ob/server/server.pid.txt")"
  echo '{"id":{"buildFinished":{}},"finished":{"exitCode":{"name":"SUCCESS"}}}' >> "$bep"
  exit 0
fi
sleep 60 &
wait
"#;

    fn gc_runner(d: &Path) -> Runner {
        let bazel = d.join("gc-bazel");
        std::fs::write(&bazel, GC_BAZEL).unwrap();
        std::fs::set_permissions(&bazel, std::fs::Permissions::from_mode(0o755)).unwrap();
        let settings = RunnerSettings {
            bazel,
            startup_flags: vec![],
            extra_flags: vec![],
            heap_bytes: 64 << 20,
            deadline: Duration::from_secs(60),
            kill_grace: Duration::from_secs(1),
            gc_spiral_window: Duration::from_secs(2),
            remote_executor: "grpc://127.0.0.1:1".into(),
            credentials: BazelCredentials::default(),
        };
        Runner::new(0, &d.join("runners"), std::sync::Arc::new(settings)).unwrap()
    }

    fn gc_spec(d: &Path, target: &str) -> RunSpec {
        let ws = d.join("ws");
        std::fs::create_dir_all(&ws).unwrap();
        RunSpec {
            workspace: ws,
            command: "build".into(),
            flags: vec![],
            targets: vec![target.into()],
            invocation_id: "00000000-0000-0000-0000-000000000000".into(),
        }
    }

    /// Runs `target` on the stand-in and checks that the runner stopped its stuck server
    /// as OOM with `signal`: after the window (2 s) of no progress, the grace (1 s) and
    /// polling, long before the 60 s deadline, with a message that `says` why.
    async fn assert_stopped_stuck(target: &str, signal: OomSignal, says: &str) {
        let d = tempfile::tempdir().unwrap();
        let runner = gc_runner(d.path());
        let report = runner.run(&gc_spec(d.path(), target)).await;
        let survived = kill_stand_in_server(&runner);
        assert_eq!((report.outcome, report.oom_signal), (BuildOutcome::Oom, Some(signal)), "{report:?}");
        assert!(!survived, "the stuck server outlived the stop");
        assert!(report.wall_seconds > 2.0 && report.wall_seconds < 8.0, "{report:?}");
        assert!(report.message.contains(says), "{report:?}");
    }

    #[tokio::test]
    async fn a_server_stuck_in_gc_is_stopped_long_before_the_deadline_as_oom() {
        assert_stopped_stuck("//:stuck", OomSignal::GcSpiral, "of its 64 MiB heap in use").await;
    }

    #[tokio::test]
    async fn a_server_idle_after_an_out_of_memory_error_is_stopped_as_oom() {
        assert_stopped_stuck("//:oom", OomSignal::OomErrorInLog, "OutOfMemoryError in its jvm.out").await;
    }

    /// Bazel writes its buffered stderr into the BEP on a timer while its server crawls
    /// from one full GC to the next: the file grows, the build does not.
    #[tokio::test]
    async fn a_server_in_gc_that_only_reports_progress_text_is_stopped_as_oom() {
        assert_stopped_stuck("//:crawl", OomSignal::GcSpiral, "of its 64 MiB heap in use").await;
    }

    #[tokio::test]
    async fn a_build_that_progresses_through_heavy_gc_is_left_alone() {
        let d = tempfile::tempdir().unwrap();
        let runner = gc_runner(d.path());
        let report = runner.run(&gc_spec(d.path(), "//:busy")).await;
        assert_eq!((report.outcome, report.oom_signal), (BuildOutcome::Success, None), "{report:?}");
        assert!(report.wall_seconds > 3.5, "ran to its end: {report:?}");
        // The same GCs with the BEP quiet: what made the difference is the progress.
        assert!(std::fs::read_to_string(runner.gc_log()).unwrap().lines().count() > 20);
    }
}
