//! gantry-testkit owns the real components gantry's tests start for themselves, so that
//! no test needs a system service or docker: a PostgreSQL server (`PgServer`), run from
//! Debian's `postgresql` package in a temporary directory on a free loopback port, as the
//! unprivileged `nobody` when the tests run as root, and an S3-compatible server
//! (`S3Server`, moto from PyPI) on a free loopback port; both stop when dropped.
//!
//! A component that cannot start is a skip on a developer's machine (with the reason on
//! stderr) and a failure when `CI=true`, so CI never passes by testing less.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free loopback port (free when asked; the caller binds it next).
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("finding a free port: {e}"))
}

/// Makes the spawned process get `signal` when the thread that spawned it dies, so a
/// test that dies without dropping its component does not leave it running.
fn die_with_parent(cmd: &mut Command, signal: libc::c_int) {
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, signal);
            Ok(())
        });
    }
}

/// True when running under CI, where every component must start.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Reports that a component could not start: a panic under CI, otherwise a note on
/// stderr and `None`, so the caller skips.
pub fn unavailable<T>(component: &str, why: &str) -> Option<T> {
    if in_ci() {
        panic!("{component} could not start and CI=true, so this is a failure, not a skip: {why}");
    }
    eprintln!("SKIPPING: {component} could not start ({why}); under CI=true this fails");
    None
}

/// The directory holding PostgreSQL's server binaries: where `initdb` on PATH resolves
/// to, else the newest `/usr/lib/postgresql/*/bin` (Debian does not put them on PATH).
pub fn pg_bin_dir() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("initdb");
            if p.is_file() {
                let real = std::fs::canonicalize(&p).unwrap_or(p);
                return real.parent().map(Path::to_path_buf);
            }
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, b)| b)
}

/// A PostgreSQL server of the tests' own. The superuser is `gantry`, with password
/// authentication (`gantry`) over TCP so clients exercise a real password handshake.
pub struct PgServer {
    child: Child,
    port: u16,
    bin: PathBuf,
    dir: tempfile::TempDir,
}

pub const PG_USER: &str = "gantry";
pub const PG_PASSWORD: &str = "gantry-test-password";

impl PgServer {
    /// Starts a server, or returns `None` (see [`unavailable`]).
    pub fn start() -> Option<PgServer> {
        let Some(bin) = pg_bin_dir() else {
            return unavailable(
                "PostgreSQL",
                "initdb not found on PATH or under /usr/lib/postgresql (apt-get install postgresql)",
            );
        };
        let mut last = String::new();
        // A free port is picked by binding port 0 and releasing it; another process could
        // take it in between, so try a few times.
        for _ in 0..3 {
            match Self::try_start(&bin) {
                Ok(s) => return Some(s),
                Err(e) => last = e,
            }
        }
        unavailable("PostgreSQL", &last)
    }

    fn try_start(bin: &Path) -> Result<PgServer, String> {
        let dir = tempfile::Builder::new().prefix("gantry-pg-").tempdir().map_err(|e| format!("temp dir: {e}"))?;
        let data = dir.path().join("data");
        let run_as = unprivileged();
        if let Some((uid, gid)) = run_as {
            // The server refuses to run as root: its directory belongs to `nobody`.
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).map_err(|e| format!("chown: {e}"))?;
        }
        let pwfile = dir.path().join("pw");
        std::fs::write(&pwfile, PG_PASSWORD).map_err(|e| format!("writing the password file: {e}"))?;
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(&pwfile, Some(uid), Some(gid)).map_err(|e| format!("chown: {e}"))?;
        }
        let out = as_user(Command::new(bin.join("initdb")), run_as)
            .arg("-D")
            .arg(&data)
            .args(["-U", PG_USER, "--auth-local=trust", "--auth-host=scram-sha-256", "--no-sync", "-E", "UTF8"])
            .arg(format!("--pwfile={}", pwfile.display()))
            .current_dir(dir.path())
            .output()
            .map_err(|e| format!("running initdb: {e}"))?;
        if !out.status.success() {
            return Err(format!("initdb failed: {}", String::from_utf8_lossy(&out.stderr)));
        }
        let port = free_port()?;
        let log_path = dir.path().join("postgres.log");
        let log = std::fs::File::create(&log_path).map_err(|e| format!("creating the log: {e}"))?;
        if let Some((uid, gid)) = run_as {
            let _ = std::os::unix::fs::chown(&log_path, Some(uid), Some(gid));
        }
        let mut cmd = as_user(Command::new(bin.join("postgres")), run_as);
        cmd.arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", dir.path().display()))
            // Test data is thrown away: durability costs only time here.
            .args(["-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=200"])
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log.try_clone().map_err(|e| e.to_string())?);
        // The server must not outlive the test process if it dies without dropping us.
        die_with_parent(&mut cmd, libc::SIGQUIT);
        let child = cmd.spawn().map_err(|e| format!("starting postgres: {e}"))?;
        let mut server = PgServer { child, port, bin: bin.to_path_buf(), dir };
        let start = Instant::now();
        loop {
            let mut text = String::new();
            let _ = std::fs::File::open(&log_path).and_then(|mut f| f.read_to_string(&mut text));
            if text.contains("ready to accept connections") {
                return Ok(server);
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(format!("postgres exited with {status}: {text}"));
            }
            if start.elapsed() > Duration::from_secs(30) {
                return Err(format!("postgres not ready after 30 s: {text}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of database `db` (with the password).
    pub fn url(&self, db: &str) -> String {
        format!("postgres://{PG_USER}:{PG_PASSWORD}@127.0.0.1:{}/{db}", self.port)
    }

    /// psql connected to database `db` as the test user, stopping at the first error.
    fn psql_command(&self, db: &str) -> Command {
        let mut c = Command::new(self.bin.join("psql"));
        c.args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", PG_USER, "-d", db, "-v", "ON_ERROR_STOP=1"])
            .env("PGPASSWORD", PG_PASSWORD);
        c
    }

    /// Creates a fresh, empty database and returns its URL.
    pub fn create_database(&self, name: &str) -> String {
        let out = self
            .psql_command("postgres")
            .args(["-c", &format!("CREATE DATABASE \"{name}\"")])
            .output()
            .expect("running psql");
        assert!(out.status.success(), "CREATE DATABASE {name}: {}", String::from_utf8_lossy(&out.stderr));
        self.url(name)
    }

    /// Runs SQL in database `db` with psql, returning its unaligned output.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        let out = self.psql_command(db).args(["-At", "-c", sql]).output().expect("running psql");
        assert!(out.status.success(), "psql {sql}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        // SIGINT is PostgreSQL's fast shutdown: sessions are ended, nothing is waited on.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGINT);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The uid and gid to run PostgreSQL as: `nobody` when we are root, else ourselves.
fn unprivileged() -> Option<(u32, u32)> {
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.first() == Some(&"nobody")).then(|| Some((f.get(2)?.parse().ok()?, f.get(3)?.parse().ok()?)))?
    })
}

fn as_user(mut cmd: Command, run_as: Option<(u32, u32)>) -> Command {
    if let Some((uid, gid)) = run_as {
        cmd.uid(uid).gid(gid).env("HOME", "/tmp").env_remove("PGDATA");
    }
    cmd
}

/// Credentials the tests hand to gantry's S3 client. The test server accepts any.
pub const S3_KEY_ID: &str = "gantry-test-key";
pub const S3_SECRET_KEY: &str = "gantry-test-secret";

/// An S3-compatible server of the tests' own: moto's server (PyPI `moto[server]`,
/// installed by `scripts/test`), in memory, on a free loopback port, stopped when dropped.
/// It speaks path-style S3 with SigV4-signed requests and multipart uploads.
pub struct S3Server {
    child: Child,
    port: u16,
    /// Serving HTTPS with a certificate this CA (a PEM file) signed.
    tls_ca: Option<PathBuf>,
    _dir: tempfile::TempDir,
}

/// The certificate an HTTPS [`S3Server`] presents: PEM files of its certificate, its key
/// and the authority that signed the certificate (which clients must trust).
pub struct S3Tls<'a> {
    pub cert: &'a Path,
    pub key: &'a Path,
    pub ca: &'a Path,
}

/// What to do when the test binary exits (see [`at_exit`]).
type ExitWork = Box<dyn FnOnce() + Send>;
static AT_EXIT: std::sync::Mutex<Vec<ExitWork>> = std::sync::Mutex::new(Vec::new());

extern "C" fn run_at_exit() {
    let work = std::mem::take(&mut *AT_EXIT.lock().unwrap_or_else(|p| p.into_inner()));
    for f in work {
        f();
    }
}

/// Runs `f` when the test binary exits, for clean-up that must wait until every test and
/// every task they left behind is done.
pub fn at_exit(f: impl FnOnce() + Send + 'static) {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a plain function with no captured state, once.
    REGISTERED.call_once(|| unsafe {
        libc::atexit(run_at_exit);
    });
    AT_EXIT.lock().unwrap_or_else(|p| p.into_inner()).push(Box::new(f));
}

/// Removes `dir` when the test binary exits, for a directory something may still write to
/// after the test that made it is done: a leaked shared server's, or a store whose last
/// owner is a task that ends only when the test's runtime shuts down (a CAS journal
/// puts its last blobs in place then, recreating a directory removed before).
pub fn remove_at_exit(dir: PathBuf) {
    at_exit(move || {
        let _ = std::fs::remove_dir_all(dir);
    });
}

impl S3Server {
    /// Starts a server, or returns `None` (see [`unavailable`]).
    pub fn start() -> Option<S3Server> {
        Self::start_with(None, None)
    }

    /// Starts a server that speaks HTTPS only, presenting `tls.cert`.
    pub fn start_tls(tls: &S3Tls<'_>) -> Option<S3Server> {
        Self::start_with(None, Some(tls))
    }

    /// Starts a server on `port`: the S3 service coming back where its clients expect
    /// it, after `drop` killed it (empty: create the buckets again).
    pub fn start_on(port: u16) -> Option<S3Server> {
        Self::start_with(Some(port), None)
    }

    fn start_with(port: Option<u16>, tls: Option<&S3Tls<'_>>) -> Option<S3Server> {
        let mut last = String::new();
        for _ in 0..3 {
            match Self::try_start(port, tls) {
                Ok(s) => return Some(s),
                Err(e) => last = e,
            }
        }
        unavailable(if tls.is_some() { "S3 server (moto, HTTPS)" } else { "S3 server (moto)" }, &last)
    }

    /// One server for the whole test binary, started once by the first caller (tests
    /// that share it use buckets of their own). It runs from a thread that never ends,
    /// because the parent-death signal that stops it fires when the *thread* that
    /// started it exits, and test threads end with their test.
    pub fn shared() -> Option<&'static S3Server> {
        static SHARED: std::sync::OnceLock<Option<&'static S3Server>> = std::sync::OnceLock::new();
        *SHARED.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name("gantry-testkit-s3".into())
                .spawn(move || {
                    let server = Self::start().map(|s| &*Box::leak(Box::new(s)));
                    if let Some(s) = server {
                        // A leaked server is never dropped, so its temporary directory
                        // would outlive the test binary: remove it when the process exits.
                        remove_at_exit(s._dir.path().to_path_buf());
                    }
                    let _ = tx.send(server);
                    loop {
                        std::thread::park();
                    }
                })
                .expect("spawning the S3 server thread");
            rx.recv().expect("S3 server thread")
        })
    }

    fn command() -> Result<Command, String> {
        if let Some(path) = std::env::var_os("PATH") {
            for dir in std::env::split_paths(&path) {
                let p = dir.join("moto_server");
                if p.is_file() {
                    return Ok(Command::new(p));
                }
            }
        }
        let probe = Command::new("python3").args(["-c", "import moto.server, flask, werkzeug"]).output();
        match probe {
            Ok(o) if o.status.success() => {
                let mut c = Command::new("python3");
                c.args(["-m", "moto.server"]);
                Ok(c)
            }
            _ => {
                Err("moto_server not on PATH and python3 cannot import moto.server (pip install 'moto[server]')".into())
            }
        }
    }

    fn try_start(port: Option<u16>, tls: Option<&S3Tls<'_>>) -> Result<S3Server, String> {
        let mut cmd = Self::command()?;
        let dir = tempfile::Builder::new().prefix("gantry-s3-").tempdir().map_err(|e| format!("temp dir: {e}"))?;
        let port = match port {
            Some(p) => p,
            None => free_port()?,
        };
        let log_path = dir.path().join("s3.log");
        let log = std::fs::File::create(&log_path).map_err(|e| format!("creating the log: {e}"))?;
        cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
        if let Some(t) = tls {
            cmd.arg("--ssl-cert").arg(t.cert).arg("--ssl-key").arg(t.key);
        }
        cmd.current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        die_with_parent(&mut cmd, libc::SIGKILL);
        let child = cmd.spawn().map_err(|e| format!("starting moto_server: {e}"))?;
        let mut server = S3Server { child, port, tls_ca: tls.map(|t| t.ca.to_path_buf()), _dir: dir };
        let start = Instant::now();
        loop {
            // Ready when it answers S3's ListBuckets.
            if let Ok((status, _)) = server.request("GET", "/")
                && status == 200
            {
                return Ok(server);
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(format!(
                    "moto_server exited with {status}: {}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                ));
            }
            if start.elapsed() > Duration::from_secs(60) {
                return Err(format!(
                    "moto_server not ready after 60 s: {}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The endpoint URL to give an S3 client.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls_ca.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// One unsigned HTTP/1.1 request (the server accepts them): (status, body).
    pub fn request(&self, method: &str, path: &str) -> std::io::Result<(u16, String)> {
        use std::io::Write;
        if let Some(ca) = &self.tls_ca {
            return self.https_request(ca, method, path);
        }
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.port
        )?;
        let mut resp = String::new();
        s.read_to_string(&mut resp)?;
        let status = resp
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {resp:.200}")))?;
        let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        Ok((status, body))
    }

    /// [`S3Server::request`] over HTTPS, trusting only `ca`, through the Python that runs
    /// moto (this crate has no TLS client of its own).
    fn https_request(&self, ca: &Path, method: &str, path: &str) -> std::io::Result<(u16, String)> {
        const SCRIPT: &str = "import ssl, sys, urllib.request, urllib.error\n\
            ctx = ssl.create_default_context(cafile=sys.argv[1])\n\
            req = urllib.request.Request(sys.argv[3], method=sys.argv[2], data=b'' if sys.argv[2] == 'PUT' else None)\n\
            try:\n    r = urllib.request.urlopen(req, context=ctx, timeout=30)\n    code, body = r.status, r.read()\n\
            except urllib.error.HTTPError as e:\n    code, body = e.code, e.read()\n\
            sys.stdout.write(str(code) + '\\n' + body.decode('utf-8', 'replace'))\n";
        let out = Command::new("python3")
            .args(["-c", SCRIPT])
            .arg(ca)
            .arg(method)
            .arg(format!("{}{path}", self.endpoint()))
            .output()?;
        if !out.status.success() {
            return Err(std::io::Error::other(String::from_utf8_lossy(&out.stderr).into_owned()));
        }
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (code, body) = text.split_once('\n').unwrap_or((&text, ""));
        let status = code.trim().parse().map_err(|_| std::io::Error::other(format!("not a status: {text:.200}")))?;
        Ok((status, body.to_string()))
    }

    /// Creates a bucket (a fresh one per test keeps tests that share the server apart).
    pub fn create_bucket(&self, name: &str) {
        let (status, body) = self.request("PUT", &format!("/{name}")).expect("creating a bucket");
        assert_eq!(status, 200, "creating bucket {name}: {body}");
    }

    /// Deletes an object behind the client's back (an expiry, an operator).
    pub fn delete_object(&self, bucket: &str, key: &str) {
        let (status, body) = self.request("DELETE", &format!("/{bucket}/{key}")).expect("deleting an object");
        assert!(status == 204 || status == 200, "deleting {bucket}/{key}: {status} {body}");
    }

    /// Keys of the objects in a bucket (the first 1000).
    pub fn list(&self, bucket: &str) -> Vec<String> {
        let (status, body) = self.request("GET", &format!("/{bucket}?list-type=2")).expect("listing a bucket");
        assert_eq!(status, 200, "listing {bucket}: {body}");
        body.split("<Key>").skip(1).filter_map(|p| p.split_once("</Key>").map(|(k, _)| k.to_string())).collect()
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// chromedriver (Debian's `chromium-driver`) on a free loopback port, driving headless
/// Chromium for page tests; killed on drop (and with the test process).
pub struct ChromeDriver {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl ChromeDriver {
    pub fn start() -> Option<ChromeDriver> {
        match Self::try_start() {
            Ok(d) => Some(d),
            Err(e) => unavailable("chromedriver (Debian's chromium and chromium-driver)", &e),
        }
    }

    fn try_start() -> Result<ChromeDriver, String> {
        let dir = tempfile::Builder::new().prefix("gantry-chromedriver-").tempdir().map_err(|e| e.to_string())?;
        let port = free_port()?;
        let log_path = dir.path().join("chromedriver.log");
        let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
        let mut cmd = Command::new("chromedriver");
        cmd.args([format!("--port={port}"), "--allowed-ips=127.0.0.1".into()])
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        die_with_parent(&mut cmd, libc::SIGKILL);
        let mut child = cmd.spawn().map_err(|e| format!("starting chromedriver: {e}"))?;
        let start = Instant::now();
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(ChromeDriver { child, port, _dir: dir });
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "chromedriver exited with {status}: {}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                ));
            }
            if start.elapsed() > Duration::from_secs(30) {
                let _ = child.kill();
                return Err("chromedriver not listening after 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The WebDriver URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Capabilities for headless Chromium: no sandbox (tests may run as root), no GPU, a
    /// fixed window size so screenshots are comparable.
    pub fn headless_chromium() -> serde_json::Map<String, serde_json::Value> {
        let options = serde_json::json!({
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"],
        });
        let mut caps = serde_json::Map::new();
        caps.insert("browserName".into(), "chrome".into());
        caps.insert("goog:chromeOptions".into(), options);
        caps
    }
}

impl Drop for ChromeDriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s3_server_starts_serves_and_stops() {
        let Some(s3) = S3Server::start() else { return };
        s3.create_bucket("testkit-bucket");
        assert!(s3.list("testkit-bucket").is_empty());
        let (status, _) = s3.request("GET", "/no-such-bucket?list-type=2").unwrap();
        assert_eq!(status, 404);
        let port = s3.port();
        drop(s3);
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "server stopped on drop");
    }

    #[test]
    fn starts_serves_and_stops() {
        let Some(pg) = PgServer::start() else { return };
        let url = pg.create_database("t1");
        assert!(url.contains(&pg.port().to_string()));
        assert_eq!(pg.psql("t1", "SELECT 40 + 2"), "42");
        let port = pg.port();
        drop(pg);
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "server stopped on drop");
    }
}
