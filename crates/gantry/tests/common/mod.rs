//! Test harness shared by the binary's integration tests: start a real `gantry serve`
//! process on free loopback ports, and run Bazel 4.2.3 offline against it.

#![allow(dead_code)]

pub mod batch;
pub mod batch_workspace;
pub mod browser;
pub mod reapi;
pub mod tls;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub struct GantryServer {
    pub child: Child,
    pub grpc: String,
    pub http: String,
    pub data_dir: PathBuf,
}

impl GantryServer {
    /// Starts `gantry serve` with ports picked by the OS, and waits for its ready line.
    pub fn start(data_dir: &Path, extra: &[&str]) -> GantryServer {
        Self::start_in(None, data_dir, extra)
    }

    /// Like `start`, with the server's working directory set (for relative paths).
    pub fn start_in(cwd: Option<&Path>, data_dir: &Path, extra: &[&str]) -> GantryServer {
        Self::spawn(cwd, "127.0.0.1:0", data_dir, extra)
    }

    /// Like `start`, on a given gRPC address (to restart a server where clients expect it).
    pub fn start_at(listen: &str, data_dir: &Path, extra: &[&str]) -> GantryServer {
        Self::spawn(None, listen, data_dir, extra)
    }

    /// Like `start`, with extra environment (`AWS_ACCESS_KEY_ID`, ...).
    pub fn start_env(data_dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> GantryServer {
        Self::spawn_env(None, "127.0.0.1:0", data_dir, extra, env)
    }

    fn spawn(cwd: Option<&Path>, listen: &str, data_dir: &Path, extra: &[&str]) -> GantryServer {
        Self::spawn_env(cwd, listen, data_dir, extra, &[])
    }

    /// Like `start`, with the data directory on a tmpfs of `size` ("24m") that only this
    /// server sees: it runs in a user and mount namespace of its own (`unshare -Urm`),
    /// where it may mount one. See [`namespaces_usable`].
    pub fn start_on_tmpfs(data_dir: &Path, size: &str, extra: &[&str]) -> GantryServer {
        let mut cmd = Command::new("unshare");
        cmd.args(["--user", "--map-root-user", "--mount", "--", "sh", "-c"])
            .arg(format!("mount -t tmpfs -o size={size} tmpfs \"$1\" && shift && exec \"$@\""))
            .arg("sh")
            .arg(data_dir)
            .arg(env!("CARGO_BIN_EXE_gantry"));
        Self::spawn_cmd(cmd, "127.0.0.1:0", data_dir, extra)
    }

    fn spawn_env(
        cwd: Option<&Path>,
        listen: &str,
        data_dir: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> GantryServer {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gantry"));
        cmd.envs(env.iter().copied());
        if let Some(c) = cwd {
            cmd.current_dir(c);
        }
        Self::spawn_cmd(cmd, listen, data_dir, extra)
    }

    /// Starts `cmd` (gantry, or a wrapper that execs it last) with serve's arguments.
    fn spawn_cmd(mut cmd: Command, listen: &str, data_dir: &Path, extra: &[&str]) -> GantryServer {
        let mut child = cmd
            .args(["serve", "--listen", listen, "--http-listen", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning gantry serve");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).expect("reading gantry's ready line");
        let line = line.trim().to_string();
        let rest = line.strip_prefix("gantry serving ").unwrap_or_else(|| panic!("unexpected first line: {line:?}"));
        let mut grpc = String::new();
        let mut http = String::new();
        for part in rest.split(' ') {
            if let Some(a) = part.strip_prefix("grpc=") {
                grpc = a.to_string();
            } else if let Some(a) = part.strip_prefix("http=") {
                http = a.to_string();
            }
        }
        GantryServer { child, grpc, http, data_dir: data_dir.to_owned() }
    }

    /// Sends SIGTERM and asserts a clean exit.
    pub fn stop(mut self) {
        let pid = self.child.id() as i32;
        Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "gantry serve exited with {status}");
                return;
            }
            assert!(Instant::now() < deadline, "gantry serve did not stop within 20 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Whether this machine lets an unprivileged process make a user and mount namespace and
/// mount a tmpfs in it. Under CI=true it must.
pub fn namespaces_usable() -> bool {
    let ok = Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "--", "sh", "-c", "mount -t tmpfs tmpfs /mnt"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok || std::env::var("CI").as_deref() != Ok("true"), "CI=true: user and mount namespaces are needed");
    ok
}

impl GantryServer {
    /// SIGKILL: the process gets no chance to clean up, as in a crash.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `gantry worker` process connected to a scheduler; killed when dropped.
pub struct WorkerProcess {
    pub child: Child,
}

impl WorkerProcess {
    pub fn start(scheduler_grpc: &str, work_dir: &Path, slots: u32) -> WorkerProcess {
        Self::start_env(scheduler_grpc, work_dir, slots, &[])
    }

    /// Like `start`, with extra environment (`GANTRY_TOKEN`, ...).
    pub fn start_env(scheduler_grpc: &str, work_dir: &Path, slots: u32, env: &[(&str, &str)]) -> WorkerProcess {
        Self::start_url(&format!("grpc://{scheduler_grpc}"), work_dir, slots, env)
    }

    /// Like `start_env`, with the scheduler's full URL (`grpcs://...`).
    pub fn start_url(scheduler: &str, work_dir: &Path, slots: u32, env: &[(&str, &str)]) -> WorkerProcess {
        let child = Command::new(env!("CARGO_BIN_EXE_gantry"))
            .envs(env.iter().copied())
            .args(["worker", "--scheduler", scheduler, "--slots", &slots.to_string(), "--work-dir"])
            .arg(work_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning gantry worker");
        WorkerProcess { child }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback address, for a server that must come back on the same one.
pub fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

impl Drop for GantryServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A private copy of the fixture workspace (Bazel must not write into the source tree)
/// and private Bazel output directories.
/// The fixture flags (offline repositories), minus the local spawn strategy: builds run
/// on gantry's executor.
pub fn fixture_flags() -> Vec<String> {
    let text = std::fs::read_to_string(fixtures().join("bazel_flags.txt")).unwrap();
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with("--spawn_strategy"))
        .map(|l| l.replace("@FIXTURES@", &fixtures().display().to_string()))
        .collect()
}

/// A TOML array of strings.
pub fn toml_list(v: &[String]) -> String {
    format!("[{}]", v.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", "))
}

pub struct BazelWorkspace {
    pub dir: tempfile::TempDir,
    /// Extra startup options, before the command.
    startup: Vec<String>,
}

impl BazelWorkspace {
    pub fn new() -> BazelWorkspace {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(&fixtures().join("ws"), &dir.path().join("ws"));
        BazelWorkspace { dir, startup: Vec::new() }
    }

    /// Lets Debian's Bazel 4.2.3 open TLS channels. Its netty was built without the
    /// JDK's ALPN, so TLS needs netty-tcnative's OpenSSL provider, whose JNI library
    /// (Debian's `libnetty-tcnative-jni`) netty looks up as `libnetty_tcnative.so` on
    /// `java.library.path` and checks by file name, so it is copied, not linked.
    /// README's "Securing gantry" gives users the same recipe.
    pub fn with_tls(mut self) -> BazelWorkspace {
        self.startup.push(bazel_tls_startup_flag(self.dir.path()));
        self
    }

    pub fn ws(&self) -> PathBuf {
        self.dir.path().join("ws")
    }

    fn base_flags(&self) -> Vec<String> {
        let text = std::fs::read_to_string(fixtures().join("bazel_flags.txt")).unwrap();
        let fx = fixtures();
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| l.replace("@FIXTURES@", &fx.display().to_string()))
            .collect()
    }

    /// Runs `bazel <command> <fixture flags> <extra>` in batch mode with private output dirs.
    pub fn bazel(&self, command: &str, extra: &[String]) -> Output {
        self.bazel_with_strategy(command, extra, "local")
    }

    /// Like `bazel`, with `--spawn_strategy=<strategy>` instead of the fixture's `local`.
    pub fn bazel_with_strategy(&self, command: &str, extra: &[String], strategy: &str) -> Output {
        let mut cmd = Command::new("bazel");
        cmd.arg("--batch")
            .arg(format!("--output_user_root={}", self.dir.path().join("user_root").display()))
            .arg(format!("--output_base={}", self.dir.path().join("base").display()))
            .arg("--nohome_rc")
            .arg("--noworkspace_rc")
            .args(&self.startup)
            .arg(command);
        if command != "clean" && command != "shutdown" {
            cmd.args(self.base_flags().into_iter().map(|f| {
                if f.starts_with("--spawn_strategy=") {
                    format!("--spawn_strategy={strategy}")
                } else {
                    f
                }
            }));
        }
        cmd.args(extra).current_dir(self.ws()).stdin(Stdio::null());
        let out = cmd.output().expect("running bazel (is Debian's bazel-bootstrap installed? .ci/run installs it)");
        eprintln!("---- bazel {command} {extra:?}: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        out
    }

    /// The bazel-testlogs directory of the fixture workspace.
    pub fn testlogs(&self) -> PathBuf {
        let execroot = self.dir.path().join("base/execroot/gantry_fixture/bazel-out");
        for entry in std::fs::read_dir(&execroot).unwrap() {
            let p = entry.unwrap().path().join("testlogs");
            if p.exists() {
                return p;
            }
        }
        panic!("no testlogs under {}", execroot.display());
    }

    /// The bazel-bin directory of the fixture workspace.
    pub fn bin(&self) -> PathBuf {
        let execroot = self.dir.path().join("base/execroot/gantry_fixture/bazel-out");
        for entry in std::fs::read_dir(&execroot).unwrap() {
            let p = entry.unwrap().path().join("bin");
            if p.join("big.txt").exists() {
                return p;
            }
        }
        panic!("no bazel-bin with outputs under {}", execroot.display());
    }
}

/// The startup option that lets Debian's Bazel 4.2.3 speak TLS (see
/// [`BazelWorkspace::with_tls`]), with the library copied under `dir`.
pub fn bazel_tls_startup_flag(dir: &Path) -> String {
    let lib = std::fs::read_dir("/usr/lib")
        .unwrap()
        .filter_map(|e| Some(e.ok()?.path().join("jni/libnetty-tcnative.so")))
        .find(|p| p.exists())
        .expect("no /usr/lib/*/jni/libnetty-tcnative.so: install libnetty-tcnative-jni (scripts/test does)");
    let jni = dir.join("jni");
    std::fs::create_dir_all(&jni).unwrap();
    std::fs::copy(&lib, jni.join("libnetty_tcnative.so")).unwrap();
    format!("--host_jvm_args=-Djava.library.path={}", jni.display())
}

/// Writes `text` to `dir/name` and returns the path.
pub fn write_file(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

/// A finished process's stdout and stderr, for assertion messages.
pub fn output_text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// Parses Bazel's "INFO: N processes: 6 remote cache hit, 7 internal." line into
/// (kind, count) pairs.
pub fn process_summary(stderr: &str) -> Vec<(String, u64)> {
    let line = stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("INFO:") && l.contains(" processes"))
        .unwrap_or_else(|| panic!("no process summary in Bazel output:\n{stderr}"));
    let rest = line.split_once("processes").unwrap().1.trim_start_matches(':').trim().trim_end_matches('.');
    rest.split(", ")
        .filter(|s| !s.is_empty())
        .map(|part| {
            let (n, kind) = part.split_once(' ').unwrap();
            (kind.to_string(), n.parse().unwrap())
        })
        .collect()
}

/// A plain HTTP GET on the server's HTTP port (for /metrics and /status).
pub fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The value of one series (`name` or `name{label="value"}`) in /metrics text.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Polls the server's /metrics until `ok` holds for it (metrics may trail the state
/// they describe by a moment), and returns that text; panics after `limit`.
pub fn wait_metrics(http: &str, limit: Duration, ok: impl Fn(&str) -> bool) -> String {
    let start = Instant::now();
    loop {
        let text = http_get(http, "/metrics");
        if ok(&text) {
            return text;
        }
        assert!(start.elapsed() < limit, "metrics not as expected after {limit:?}:\n{text}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The `gantry` binary under test.
pub fn gantry() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gantry"))
}

/// Runs git in `dir`; panics with git's stderr on failure; returns trimmed stdout.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git").arg("-C").arg(dir).args(args).output().unwrap();
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}
