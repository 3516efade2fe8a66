//! The local history database of `gantry run` (SQLite, one file per user):
//! - `file_digests`: path → digest, valid while the file's device, inode, size, mtime
//!   and ctime are unchanged, so a rerun does not re-hash unchanged inputs;
//! - `shapes`: per command shape, the delay history (`gantry_dynamic::delay`) and the
//!   race counters (`gantry_dynamic::race_stats`), as JSON.
//!
//! Several `gantry run`s may finish at once (`make -j`): every read-modify-write of a
//! shape runs in a `BEGIN IMMEDIATE` transaction, and a busy database is waited for.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use gantry_core::{Digest, DigestFunction};
use gantry_dynamic::coordinator::RaceReport;
use gantry_dynamic::delay::{self, DelayConfig, DelayPlan, Observation, ShapeStats};
use gantry_dynamic::race_stats::{RaceStats, ShapeRaceStats};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::{Executor, Row};

use crate::{Error, Result};

/// File name of the database inside the cache directory.
pub const DB_FILE: &str = "run.db";

/// Where the database lives unless `--cache-dir`/`GANTRY_CACHE_DIR` says otherwise:
/// `$XDG_CACHE_HOME/gantry`, else `~/.cache/gantry`.
pub fn default_dir() -> Option<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(x).join("gantry"));
    }
    std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache/gantry"))
}

/// What identifies one version of a file without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileKey {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl FileKey {
    pub fn of(meta: &std::fs::Metadata) -> FileKey {
        FileKey {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: meta.mtime() * 1_000_000_000 + meta.mtime_nsec(),
            ctime_ns: meta.ctime() * 1_000_000_000 + meta.ctime_nsec(),
        }
    }
}

pub struct History {
    pool: SqlitePool,
    path: PathBuf,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS file_digests (
    path TEXT PRIMARY KEY,
    dev INTEGER NOT NULL, ino INTEGER NOT NULL, size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
    function TEXT NOT NULL, hash TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS shapes (
    shape TEXT PRIMARY KEY,
    history TEXT NOT NULL,
    race TEXT NOT NULL
);
";

impl History {
    /// Opens (creating if needed) `dir/run.db`.
    pub async fn open(dir: &Path) -> Result<History> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating cache directory {}", dir.display()), e))?;
        let path = dir.join(DB_FILE);
        let opts = SqliteConnectOptions::from_str("sqlite:")
            .map_err(|e| Error::History { path: path.display().to_string(), source: e })?
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(10));
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(opts)
            .await
            .map_err(|e| Error::History { path: path.display().to_string(), source: e })?;
        let h = History { pool, path };
        h.pool.execute(SCHEMA).await.map_err(|e| h.err(e))?;
        Ok(h)
    }

    fn err(&self, source: sqlx::Error) -> Error {
        Error::History { path: self.path.display().to_string(), source }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The remembered digest of `path`, if the file is unchanged since it was stored.
    pub async fn cached_digest(&self, path: &Path, key: &FileKey, f: DigestFunction) -> Result<Option<Digest>> {
        let row =
            sqlx::query("SELECT dev, ino, size, mtime_ns, ctime_ns, function, hash FROM file_digests WHERE path = ?")
                .bind(path.to_string_lossy().as_ref())
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| self.err(e))?;
        let Some(row) = row else { return Ok(None) };
        let stored = FileKey {
            dev: row.get::<i64, _>(0) as u64,
            ino: row.get::<i64, _>(1) as u64,
            size: row.get::<i64, _>(2) as u64,
            mtime_ns: row.get(3),
            ctime_ns: row.get(4),
        };
        if stored != *key || row.get::<String, _>(5) != f.name() {
            return Ok(None);
        }
        // A corrupt row is a miss, not an error: the file is simply hashed again.
        Ok(Digest::parse(f, &row.get::<String, _>(6), key.size as i64).ok())
    }

    pub async fn store_digests(&self, entries: &[(PathBuf, FileKey, Digest)]) -> Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        let mut tx = self.pool.begin().await.map_err(|e| self.err(e))?;
        for (path, k, d) in entries {
            sqlx::query(
                "INSERT OR REPLACE INTO file_digests (path, dev, ino, size, mtime_ns, ctime_ns, function, hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            )
            .bind(path.to_string_lossy().as_ref())
            .bind(k.dev as i64)
            .bind(k.ino as i64)
            .bind(k.size as i64)
            .bind(k.mtime_ns)
            .bind(k.ctime_ns)
            .bind(d.function.name())
            .bind(d.hash_hex())
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(e))?;
        }
        tx.commit().await.map_err(|e| self.err(e))
    }

    async fn load_shape(&self, shape: &str) -> Result<(ShapeStats, ShapeRaceStats)> {
        let row = sqlx::query("SELECT history, race FROM shapes WHERE shape = ?")
            .bind(shape)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        decode_shape(row.as_ref().map(|r| (r.get::<String, _>(0), r.get::<String, _>(1))))
    }

    /// The learned local delay for this shape (the cold-start plan for a new shape).
    pub async fn plan(&self, shape: &str, config: &DelayConfig) -> Result<DelayPlan> {
        let (stats, _) = self.load_shape(shape).await?;
        Ok(if stats.runs == 0 { config.cold_start } else { delay::choose_delay(&stats, config) })
    }

    /// Folds one finished race into the shape's history and counters.
    pub async fn record(&self, shape: &str, report: &RaceReport, config: &DelayConfig) -> Result<()> {
        let mut conn = self.pool.acquire().await.map_err(|e| self.err(e))?;
        // IMMEDIATE takes the write lock up front, so two runs finishing together queue
        // on busy_timeout instead of one failing to upgrade its read lock.
        conn.execute("BEGIN IMMEDIATE").await.map_err(|e| self.err(e))?;
        let result = async {
            let row = sqlx::query("SELECT history, race FROM shapes WHERE shape = ?")
                .bind(shape)
                .fetch_optional(&mut *conn)
                .await
                .map_err(|e| self.err(e))?;
            let (mut stats, race) = decode_shape(row.as_ref().map(|r| (r.get::<String, _>(0), r.get::<String, _>(1))))?;
            // Time saved is estimated from the history *before* this run.
            let mut counters = RaceStats::default();
            counters.shapes.insert(shape.to_string(), race);
            counters.record(shape, report, Some(&stats), config);
            delay::update(&mut stats, &Observation::from_report(report), config);
            let race = counters.shapes.remove(shape).unwrap_or_default();
            sqlx::query("INSERT OR REPLACE INTO shapes (shape, history, race) VALUES (?, ?, ?)")
                .bind(shape)
                .bind(serde_json::to_string(&stats).map_err(gantry_dynamic::Error::from)?)
                .bind(serde_json::to_string(&race).map_err(gantry_dynamic::Error::from)?)
                .execute(&mut *conn)
                .await
                .map_err(|e| self.err(e))?;
            Ok::<(), Error>(())
        }
        .await;
        let end = if result.is_ok() { "COMMIT" } else { "ROLLBACK" };
        conn.execute(end).await.map_err(|e| self.err(e))?;
        result
    }

    /// Race counters of every shape, for `gantry run --stats`.
    pub async fn race_stats(&self) -> Result<RaceStats> {
        let rows = sqlx::query("SELECT shape, race FROM shapes ORDER BY shape")
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        let mut all = RaceStats::default();
        for r in rows {
            let race: ShapeRaceStats =
                serde_json::from_str(&r.get::<String, _>(1)).map_err(gantry_dynamic::Error::from)?;
            all.shapes.insert(r.get(0), race);
        }
        Ok(all)
    }

    pub async fn close(self) {
        self.pool.close().await;
    }
}

fn decode_shape(row: Option<(String, String)>) -> Result<(ShapeStats, ShapeRaceStats)> {
    match row {
        None => Ok(Default::default()),
        Some((h, r)) => Ok((
            serde_json::from_str(&h).map_err(gantry_dynamic::Error::from)?,
            serde_json::from_str(&r).map_err(gantry_dynamic::Error::from)?,
        )),
    }
}
