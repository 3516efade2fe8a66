//! gantry-testkit owns the real components gantry's tests start for themselves, so that
//! no test needs a system service or docker: today a PostgreSQL server (`PgServer`),
//! run from Debian's `postgresql` package in a temporary directory on a free loopback
//! port, as the unprivileged `nobody` when the tests run as root, and stopped when
//! dropped.
//!
//! A component that cannot start is a skip on a developer's machine (with the reason on
//! stderr) and a failure when `CI=true`, so CI never passes by testing less.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
            return unavailable("PostgreSQL", "initdb not found on PATH or under /usr/lib/postgresql (apt-get install postgresql)");
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
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("finding a free port: {e}"))?
            .port();
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
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGQUIT);
                Ok(())
            });
        }
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

    /// Creates a fresh, empty database and returns its URL.
    pub fn create_database(&self, name: &str) -> String {
        let out = Command::new(self.bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", PG_USER, "-d", "postgres", "-v", "ON_ERROR_STOP=1"])
            .args(["-c", &format!("CREATE DATABASE \"{name}\"")])
            .env("PGPASSWORD", PG_PASSWORD)
            .output()
            .expect("running psql");
        assert!(out.status.success(), "CREATE DATABASE {name}: {}", String::from_utf8_lossy(&out.stderr));
        self.url(name)
    }

    /// Runs SQL in database `db` with psql, returning its unaligned output.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        let out = Command::new(self.bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", PG_USER, "-d", db, "-v", "ON_ERROR_STOP=1", "-At"])
            .args(["-c", sql])
            .env("PGPASSWORD", PG_PASSWORD)
            .output()
            .expect("running psql");
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

#[cfg(test)]
mod tests {
    use super::*;

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
