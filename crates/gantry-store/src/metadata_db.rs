//! `MetadataDb` (`[metadata] url`): the one SQL database every metadata store shares
//! (action cache, execution log, size-class statistics, batch builds, submit queue).
//!
//! One pool, one dialect, one schema version. SQLite is the embedded default and
//! PostgreSQL runs the same statements through sqlx's `Any` driver; the few places where
//! the two differ (column types, locking a table for an ordered append, connection
//! settings) are the methods of [`Dialect`] below and nowhere else.
//!
//! The schema is versioned with sqlx's migrator (its `_sqlx_migrations` table, a
//! PostgreSQL advisory lock while migrating, a checksum per applied version). Migration 1
//! creates the tables that gantry created unversioned before, with `IF NOT EXISTS`, so a
//! database written by such a gantry is adopted and upgraded in place. A database whose
//! version is newer than this binary's is refused before anything is changed.
//!
//! Single-statement writes go through [`MetadataDb::write`]. On SQLite they are group
//! committed: SQLite has one writer and each commit costs an fsync (the WAL, with
//! `synchronous = FULL`), so one task takes every write waiting, runs each in a savepoint
//! of one transaction (a failed statement fails only its own write), commits once and
//! answers them all. Under load, N writes cost one fsync instead of N. On PostgreSQL, which
//! group commits itself and has many writers, a write is just executed.

use std::borrow::Cow;
use std::time::Duration;

use futures::future::BoxFuture;
use gantry_core::{Error, Result};
use sqlx::any::AnyPoolOptions;
use sqlx::migrate::{Migration, MigrationSource, MigrationType, Migrator};
use sqlx::{AnyPool, Executor, Row};

/// The SQL dialect of a metadata URL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    Sqlite,
    Postgres,
}

impl Dialect {
    /// The dialect of `url`, or an error naming what is accepted.
    pub fn of(url: &str) -> Result<Dialect> {
        if url.starts_with("sqlite:") {
            Ok(Dialect::Sqlite)
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            Ok(Dialect::Postgres)
        } else {
            Err(Error::invalid(format!(
                "metadata.url '{}': expected sqlite://PATH or postgres://USER:PASSWORD@HOST:PORT/DATABASE",
                redact_url(url)
            )))
        }
    }

    /// The column type of opaque bytes.
    fn blob(self) -> &'static str {
        match self {
            Dialect::Sqlite => "BLOB",
            Dialect::Postgres => "BYTEA",
        }
    }

    /// The hidden column that names one row of any table, even one without a primary
    /// key, for `DELETE ... WHERE {row_id} IN (SELECT {row_id} ... LIMIT n)`: the
    /// portable way to delete a bounded batch (neither dialect in sqlx's reach has
    /// `DELETE ... LIMIT` on both sides). PostgreSQL's `ctid` is stable within the
    /// statement's snapshot, which is all this needs.
    pub fn row_id(self) -> &'static str {
        match self {
            Dialect::Sqlite => "rowid",
            Dialect::Postgres => "ctid",
        }
    }

    /// A statement, run first inside a transaction, that makes that transaction the only
    /// writer of `table` until it ends, so "read the last sequence number, write the next"
    /// cannot interleave with another writer. SQLite serialises writers by itself;
    /// PostgreSQL lets readers through (EXCLUSIVE conflicts only with writers and locks).
    pub fn lock_for_append(self, table: &str) -> Option<String> {
        match self {
            Dialect::Sqlite => None,
            Dialect::Postgres => Some(format!("LOCK TABLE {table} IN EXCLUSIVE MODE")),
        }
    }
}

/// `url` with any password replaced, for messages and logs: the one in the user-info
/// part (`user:PASSWORD@host`) and a `password=` query parameter.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let (authority, path) = match before_query.find('/') {
        Some(i) => before_query.split_at(i),
        None => (before_query, ""),
    };
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{user}:***@{host}"),
            None => format!("{userinfo}@{host}"),
        },
        None => authority.to_string(),
    };
    let query = query.map(|q| {
        let parts: Vec<&str> =
            q.split('&').map(|kv| if kv.starts_with("password=") { "password=***" } else { kv }).collect();
        format!("?{}", parts.join("&"))
    });
    format!("{scheme}://{authority}{path}{}", query.unwrap_or_default())
}

/// One value bound to a [`Write`]'s placeholder. Nulls are typed, as PostgreSQL needs.
#[derive(Clone, Debug)]
pub enum Value {
    I64(Option<i64>),
    F64(Option<f64>),
    Text(Option<String>),
    Bytes(Option<Vec<u8>>),
}

macro_rules! value_from {
    ($variant:ident, $t:ty, $conv:expr) => {
        impl From<$t> for Value {
            fn from(v: $t) -> Value {
                Value::$variant(Some($conv(v)))
            }
        }
        impl From<Option<$t>> for Value {
            fn from(v: Option<$t>) -> Value {
                Value::$variant(v.map($conv))
            }
        }
    };
}
value_from!(I64, i64, |v| v);
value_from!(F64, f64, |v| v);
value_from!(Text, String, |v| v);
value_from!(Text, &str, str::to_string);
value_from!(Text, &String, String::clone);
value_from!(Bytes, Vec<u8>, |v| v);

impl From<&Option<String>> for Value {
    fn from(v: &Option<String>) -> Value {
        Value::Text(v.clone())
    }
}

/// One statement that writes, with its values owned, so it can wait in the group
/// commit's queue.
#[derive(Clone, Debug)]
pub struct Write {
    sql: Cow<'static, str>,
    values: Vec<Value>,
}

impl Write {
    pub fn new(sql: impl Into<Cow<'static, str>>) -> Write {
        Write { sql: sql.into(), values: Vec::new() }
    }

    pub fn bind(mut self, v: impl Into<Value>) -> Write {
        self.values.push(v.into());
        self
    }

    fn query(&self) -> sqlx::query::Query<'_, sqlx::Any, sqlx::any::AnyArguments<'_>> {
        let mut q = sqlx::query(&self.sql);
        for v in &self.values {
            q = match v {
                Value::I64(x) => q.bind(*x),
                Value::F64(x) => q.bind(*x),
                Value::Text(x) => q.bind(x.as_deref()),
                Value::Bytes(x) => q.bind(x.as_deref()),
            };
        }
        q
    }
}

/// A write waiting for its group, and where its outcome goes (rows affected).
struct Pending {
    write: Write,
    what: Cow<'static, str>,
    done: tokio::sync::oneshot::Sender<Result<u64>>,
}

/// Most writes one group commits; the rest wait for the next.
const MAX_GROUP: usize = 512;

/// How many times the commit task lets the other ready tasks run before it commits, each
/// time taking what they queued meanwhile. Writes issued together (an action's result and
/// its execution record, `tokio::join!`ed) are sent one after the other, and the task,
/// woken on another thread by the first, used to commit it alone and the second in a
/// commit of its own: a fsync and a WAL page per table more. A yield costs a trip through
/// the scheduler, nothing next to a commit, and no timer: a lone write waits for nothing.
/// With 4 in-process workers running no-op actions it made 21% fewer commits.
const YIELDS_BEFORE_COMMIT: usize = 4;

/// The metadata database: a pool and its dialect. Cheap to clone; every clone shares
/// the pool.
#[derive(Clone, Debug)]
pub struct MetadataDb {
    pool: AnyPool,
    /// Where statements that write go. For a SQLite file, a pool of one connection: SQLite
    /// lets one connection write at a time, and a second writer waits in SQLite's busy
    /// handler, which polls with sleeps of up to 100 ms (with eight in-process workers
    /// writing results, most of their time went there). One writing connection makes
    /// writers queue in the pool, first come first served, and wake the moment it is
    /// free. Otherwise the same pool as `pool`.
    writer: AnyPool,
    /// SQLite files only: the queue of the group commit task (see the module doc).
    group: Option<GroupCommit>,
    dialect: Dialect,
    /// The URL without its password, to name the database in errors.
    name: String,
}

/// Settings of the pool, from `[metadata]`.
#[derive(Clone, Debug)]
pub struct MetadataOptions {
    pub max_connections: u32,
    pub connect_timeout: Duration,
}

impl Default for MetadataOptions {
    fn default() -> Self {
        MetadataOptions { max_connections: 8, connect_timeout: Duration::from_secs(10) }
    }
}

fn db_err(name: &str, what: &str, e: sqlx::Error) -> Error {
    db_error(name, what, &e)
}

/// A failed statement as the client sees it. A full disk (SQLite's SQLITE_FULL,
/// PostgreSQL's disk_full) is RESOURCE_EXHAUSTED: nothing was written, and the same write
/// succeeds once there is room. Anything else is UNAVAILABLE.
fn db_error(name: &str, what: &str, e: &sqlx::Error) -> Error {
    if is_disk_full(e) {
        return Error::ResourceExhausted(format!("metadata database {name}: {what}: the disk is full: {e}"));
    }
    Error::Unavailable(format!("metadata database {name}: {what}: {e}"))
}

fn is_disk_full(e: &sqlx::Error) -> bool {
    match e {
        // SQLite reports its primary result code (13, SQLITE_FULL) or an extended one with
        // the same low byte; PostgreSQL the SQLSTATE 53100.
        sqlx::Error::Database(d) => match d.code().as_deref() {
            Some("53100") => true,
            Some(code) => code.parse::<i64>().is_ok_and(|c| c & 0xff == 13),
            None => false,
        },
        // Seen when the full disk fails the file underneath rather than a statement.
        sqlx::Error::Io(io) => io.kind() == std::io::ErrorKind::StorageFull,
        _ => false,
    }
}

impl MetadataDb {
    /// Opens the database at `url` with default pool settings and brings its schema up
    /// to date. See [`MetadataDb::open_with`].
    pub async fn open(url: &str) -> Result<MetadataDb> {
        Self::open_with(url, &MetadataOptions::default()).await
    }

    /// Connects (creating a SQLite file and its directory if needed), refuses a schema
    /// newer than this binary's, and runs the migrations it lacks. Every failure is an
    /// error here, at startup, naming the database without its password.
    pub async fn open_with(url: &str, opts: &MetadataOptions) -> Result<MetadataDb> {
        let dialect = Dialect::of(url)?;
        let name = redact_url(url);
        sqlx::any::install_default_drivers();
        let mut url = url.to_string();
        let memory = url.contains(":memory:");
        if dialect == Dialect::Sqlite && !memory {
            let path = url.trim_start_matches("sqlite://").trim_start_matches("sqlite:");
            let path = path.split('?').next().unwrap_or(path);
            if let Some(parent) = std::path::Path::new(path).parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .map_err(|e| Error::io(format!("creating database directory {}", parent.display()), e))?;
            }
            if !url.contains("mode=") {
                url.push_str(if url.contains('?') { "&mode=rwc" } else { "?mode=rwc" });
            }
        }
        let connect = |max_connections: u32| {
            AnyPoolOptions::new()
                // An in-memory SQLite database exists per connection: keep exactly one, forever.
                .max_connections(if memory { 1 } else { max_connections.max(1) })
                .min_connections(if memory { 1 } else { 0 })
                .idle_timeout(if memory { None } else { Some(Duration::from_secs(600)) })
                .max_lifetime(if memory { None } else { Some(Duration::from_secs(1800)) })
                // A ping before each use finds a server that dropped the connection. An
                // embedded SQLite file has no server to lose, and its ping is a round trip
                // to the connection's thread (two thread switches) before every query.
                .test_before_acquire(dialect == Dialect::Postgres)
                .acquire_timeout(opts.connect_timeout)
                // A connection that still counts an open transaction is not handed out
                // again. After a COMMIT that failed (a full disk), SQLite may have rolled
                // the transaction back itself; sqlx's ROLLBACK then fails and its count
                // stays up, and the next transaction on that connection would be a
                // savepoint inside a transaction that never commits: writes answered OK
                // and silently lost. A fresh connection starts clean.
                .before_acquire(|conn, _| Box::pin(async move { Ok(!sqlx::Connection::is_in_transaction(conn)) }))
                .after_connect(move |conn, _| {
                    Box::pin(async move {
                        if dialect == Dialect::Sqlite {
                            // WAL lets readers run beside the writer. FULL, not NORMAL: a
                            // commit returns only after the WAL is fsynced, so a row the
                            // client was told about (an UpdateActionResult answered OK, a
                            // submitted change) survives a power loss or kernel crash, not
                            // just a process crash. In WAL mode that is one fsync per
                            // commit, and checkpoints stay in the background.
                            conn.execute("PRAGMA journal_mode = WAL").await?;
                            conn.execute("PRAGMA synchronous = FULL").await?;
                            conn.execute("PRAGMA busy_timeout = 5000").await?;
                        }
                        Ok(())
                    })
                })
                .connect(&url)
        };
        let pool = connect(opts.max_connections).await.map_err(|e| db_err(&name, "connecting", e))?;
        let writer = if dialect == Dialect::Sqlite && !memory {
            connect(1).await.map_err(|e| db_err(&name, "connecting", e))?
        } else {
            pool.clone()
        };
        let group = (dialect == Dialect::Sqlite && !memory).then(|| GroupCommit::start(writer.clone(), name.clone()));
        let db = MetadataDb { pool, writer, group, dialect, name };
        db.migrate().await?;
        Ok(db)
    }

    /// For statements that only read.
    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// For transactions that write (see the field's comment). A single statement goes
    /// through [`MetadataDb::write`] instead.
    pub fn writer(&self) -> &AnyPool {
        &self.writer
    }

    /// Runs one statement that writes and returns the rows it affected, once it is
    /// durable; `what` names it in errors.
    pub async fn write(&self, what: impl Into<Cow<'static, str>>, w: Write) -> Result<u64> {
        let what = what.into();
        let Some(group) = &self.group else {
            return w
                .query()
                .execute(&self.writer)
                .await
                .map(|d| d.rows_affected())
                .map_err(|e| db_err(&self.name, &what, e));
        };
        let (done, outcome) = tokio::sync::oneshot::channel();
        group
            .queue
            .send(Pending { write: w, what, done })
            .await
            .map_err(|_| Error::Unavailable(format!("metadata database {}: the writer has stopped", self.name)))?;
        outcome
            .await
            .map_err(|_| Error::Unavailable(format!("metadata database {}: the writer has stopped", self.name)))?
    }

    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// The database's URL without its password.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The error for a failed statement, naming the database and what was being done.
    /// Borrows `what`, so the success path of every query allocates nothing for it.
    pub fn err<'a>(&'a self, what: &'a str) -> impl FnOnce(sqlx::Error) -> Error + 'a {
        move |e| db_err(&self.name, what, e)
    }

    /// The newest schema version this binary knows.
    pub fn latest_version() -> i64 {
        MIGRATIONS.last().map_or(0, |m| m.version)
    }

    /// The schema version recorded in the database (0 for a database never migrated).
    pub async fn schema_version(&self) -> Result<i64> {
        let exists = match self.dialect {
            Dialect::Sqlite => "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
            Dialect::Postgres => {
                "SELECT COUNT(*) FROM information_schema.tables
                 WHERE table_schema = current_schema() AND table_name = '_sqlx_migrations'"
            }
        };
        let n: i64 = sqlx::query(exists)
            .fetch_one(&self.pool)
            .await
            .and_then(|r| r.try_get(0))
            .map_err(self.err("reading the schema version"))?;
        if n == 0 {
            return Ok(0);
        }
        sqlx::query("SELECT COALESCE(MAX(version), 0) FROM _sqlx_migrations WHERE success = true")
            .fetch_one(&self.pool)
            .await
            .and_then(|r| r.try_get::<i64, _>(0))
            .map_err(self.err("reading the schema version"))
    }

    /// The database's size on disk in bytes (SQLite: the main file's pages, not the WAL;
    /// PostgreSQL: the whole database), for `/metrics`.
    pub async fn size_bytes(&self) -> Result<i64> {
        let sql = match self.dialect {
            Dialect::Sqlite => {
                "SELECT p.page_count * s.page_size FROM pragma_page_count() AS p, pragma_page_size() AS s"
            }
            Dialect::Postgres => "SELECT pg_database_size(current_database())",
        };
        sqlx::query(sql)
            .fetch_one(&self.pool)
            .await
            .and_then(|r| r.try_get::<i64, _>(0))
            .map_err(self.err("reading the database size"))
    }

    /// Takes the lease `name` for `holder` until `now_ms + ttl`, or renews it if `holder`
    /// has it already. False when another holder's lease has not expired. One statement,
    /// so two processes racing for a free lease cannot both win.
    pub async fn acquire_lease(&self, name: &str, holder: &str, now_ms: i64, ttl: Duration) -> Result<bool> {
        let done = sqlx::query(
            "INSERT INTO leases (name, holder, expires_unix_ms) VALUES ($1, $2, $3)
             ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires_unix_ms = excluded.expires_unix_ms
             WHERE leases.holder = excluded.holder OR leases.expires_unix_ms < $4",
        )
        .bind(name)
        .bind(holder)
        .bind(now_ms + ttl.as_millis() as i64)
        .bind(now_ms)
        .execute(&self.writer)
        .await
        .map_err(self.err("taking a lease"))?;
        Ok(done.rows_affected() == 1)
    }

    /// Who holds the lease `name`, and until when (it may have expired).
    pub async fn lease_holder(&self, name: &str) -> Result<Option<(String, i64)>> {
        let row = sqlx::query("SELECT holder, expires_unix_ms FROM leases WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await
            .map_err(self.err("reading a lease"))?;
        row.map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .transpose()
            .map_err(|e: sqlx::Error| Error::internal(format!("leases: undecodable row: {e}")))
    }

    /// Gives up the lease `name` if `holder` has it, so a successor need not wait for it
    /// to expire.
    pub async fn release_lease(&self, name: &str, holder: &str) -> Result<()> {
        sqlx::query("DELETE FROM leases WHERE name = $1 AND holder = $2")
            .bind(name)
            .bind(holder)
            .execute(&self.writer)
            .await
            .map_err(self.err("releasing a lease"))?;
        Ok(())
    }

    async fn migrate(&self) -> Result<()> {
        let found = self.schema_version().await?;
        let latest = Self::latest_version();
        if found > latest {
            return Err(Error::FailedPrecondition(format!(
                "metadata database {} has schema version {found}, newer than version {latest}, the newest this \
                 gantry ({}) knows: it was written by a newer gantry; run that version (or newer), or restore a \
                 backup taken before the upgrade",
                self.name,
                env!("CARGO_PKG_VERSION")
            )));
        }
        let migrator = Migrator::new(Migrations(self.dialect))
            .await
            .map_err(|e| Error::internal(format!("metadata migrations: {e}")))?;
        migrator.run(&self.writer).await.map_err(|e| {
            Error::Unavailable(format!(
                "metadata database {}: upgrading the schema from version {found} to {latest}: {e}",
                self.name
            ))
        })?;
        if found < latest {
            tracing::info!(database = %self.name, from = found, to = latest, "metadata schema upgraded");
        }
        Ok(())
    }
}

/// The group commit task of a SQLite database (see the module doc). Stops when the last
/// clone of the database is dropped.
#[derive(Clone)]
struct GroupCommit {
    queue: tokio::sync::mpsc::Sender<Pending>,
    /// Transactions committed (read by the tests; cheap enough to keep counting).
    #[cfg_attr(not(test), allow(dead_code))]
    commits: std::sync::Arc<std::sync::atomic::AtomicU64>,
    _task: std::sync::Arc<gantry_core::TaskGuard>,
}

impl std::fmt::Debug for GroupCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupCommit").field("waiting", &(self.queue.max_capacity() - self.queue.capacity())).finish()
    }
}

impl GroupCommit {
    fn start(writer: AnyPool, name: String) -> GroupCommit {
        let (queue, mut rx) = tokio::sync::mpsc::channel::<Pending>(4 * MAX_GROUP);
        let commits = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = commits.clone();
        let task = gantry_core::task::spawn_named("metadata-group-commit", async move {
            let mut group = Vec::with_capacity(MAX_GROUP);
            while rx.recv_many(&mut group, MAX_GROUP).await > 0 {
                for _ in 0..YIELDS_BEFORE_COMMIT {
                    tokio::task::yield_now().await;
                    while group.len() < MAX_GROUP
                        && let Ok(p) = rx.try_recv()
                    {
                        group.push(p);
                    }
                }
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                match commit_group(&writer, &group).await {
                    Ok(outcomes) => {
                        for (p, outcome) in group.drain(..).zip(outcomes) {
                            let _ = p.done.send(outcome.map_err(|e| db_err(&name, &p.what, e)));
                        }
                    }
                    // Nothing of the group was committed: each write fails with the cause.
                    Err(e) => {
                        for p in group.drain(..) {
                            let what = format!("{} (committing)", p.what);
                            let _ = p.done.send(Err(db_error(&name, &what, &e)));
                        }
                    }
                }
            }
        });
        GroupCommit { queue, commits, _task: std::sync::Arc::new(task) }
    }
}

/// Runs the group's writes in one transaction and commits it: every write's own outcome,
/// or an error for the whole group (nothing of it was committed).
///
/// Each statement is a round trip to SQLite's worker thread (two thread switches), so
/// the writes first run bare, which is one trip per write; only a group in which a write
/// fails is rolled back and run again with each write in a savepoint of its own, so
/// that the failure is that write's alone.
async fn commit_group(
    writer: &AnyPool,
    group: &[Pending],
) -> std::result::Result<Vec<std::result::Result<u64, sqlx::Error>>, sqlx::Error> {
    let mut tx = writer.begin().await?;
    let mut outcomes = Vec::with_capacity(group.len());
    for p in group {
        match p.write.query().execute(&mut *tx).await {
            Ok(done) => outcomes.push(Ok(done.rows_affected())),
            Err(_) => {
                tx.rollback().await?;
                return commit_group_isolated(writer, group).await;
            }
        }
    }
    tx.commit().await?;
    Ok(outcomes)
}

/// `commit_group` with each write in a savepoint, for a group in which one fails.
async fn commit_group_isolated(
    writer: &AnyPool,
    group: &[Pending],
) -> std::result::Result<Vec<std::result::Result<u64, sqlx::Error>>, sqlx::Error> {
    use sqlx::Acquire;
    let mut tx = writer.begin().await?;
    let mut outcomes = Vec::with_capacity(group.len());
    for p in group {
        let mut savepoint = tx.begin().await?;
        match p.write.query().execute(&mut *savepoint).await {
            Ok(done) => {
                savepoint.commit().await?;
                outcomes.push(Ok(done.rows_affected()));
            }
            Err(e) => {
                savepoint.rollback().await?;
                outcomes.push(Err(e));
            }
        }
    }
    tx.commit().await?;
    Ok(outcomes)
}

/// A role that only one gantry process may play per metadata database (running the
/// submit queue, running the batch builds), held through a lease that a named task
/// renews every third of its lifetime. Dropping it stops the renewal; `release` also
/// frees the role at once for a successor.
pub struct RoleLease {
    db: MetadataDb,
    role: &'static str,
    holder: String,
    lost: tokio::sync::watch::Receiver<bool>,
    _renewal: gantry_core::TaskGuard,
}

/// Wall-clock milliseconds since the epoch, the unit of every time column gantry writes.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

impl RoleLease {
    /// Takes `role` for `holder`, or fails with FAILED_PRECONDITION naming who has it.
    /// `holder` should name the host and what makes this process the same one after a
    /// restart, so a crashed process restarted takes its role back without waiting.
    pub async fn take(db: &MetadataDb, role: &'static str, holder: String, ttl: Duration) -> Result<RoleLease> {
        if !db.acquire_lease(role, &holder, now_ms(), ttl).await? {
            let (other, until) = db.lease_holder(role).await?.unwrap_or_default();
            return Err(Error::FailedPrecondition(format!(
                "{role}: metadata database {} already has one, run by {other} (its lease runs {} s more); \
                 only one gantry serve per metadata database may play this role",
                db.name(),
                (until - now_ms()).max(0) / 1000
            )));
        }
        let (lost_tx, lost) = tokio::sync::watch::channel(false);
        let (renew_db, renew_holder) = (db.clone(), holder.clone());
        let renewal = gantry_core::task::spawn_named("role-lease", async move {
            loop {
                tokio::time::sleep(ttl / 3).await;
                match renew_db.acquire_lease(role, &renew_holder, now_ms(), ttl).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::error!(role, "another gantry serve took over this role's lease");
                        lost_tx.send_replace(true);
                        return;
                    }
                    // The database is away: the role cannot write anything either; the
                    // lease expires only if the outage outlasts it.
                    Err(e) => tracing::warn!(role, error = %e, "renewing a lease"),
                }
            }
        });
        Ok(RoleLease { db: db.clone(), role, holder, lost, _renewal: renewal })
    }

    /// Resolves if another process takes the role over (this one must then stop it).
    pub fn lost(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut lost = self.lost.clone();
        async move {
            let _ = lost.wait_for(|l| *l).await;
        }
    }

    /// Frees the role now (at a clean shutdown).
    pub async fn release(self) -> Result<()> {
        self.db.release_lease(self.role, &self.holder).await
    }
}

/// One schema version: a description and its statements, with `{blob}` standing for the
/// dialect's bytes type. Append only: an applied version's text must never change (the
/// migrator refuses a checksum mismatch).
struct Version {
    version: i64,
    description: &'static str,
    sql: &'static str,
}

const MIGRATIONS: &[Version] = &[
    Version {
        version: 1,
        description: "tables of the unversioned schema",
        sql: include_str!("../migrations/0001_initial.sql"),
    },
    Version {
        version: 2,
        description: "leases held by one gantry process at a time",
        sql: include_str!("../migrations/0002_leases.sql"),
    },
    Version { version: 3, description: "indexes for retention", sql: include_str!("../migrations/0003_retention.sql") },
    Version {
        version: 4,
        description: "invocations from the Build Event Service",
        sql: include_str!("../migrations/0004_invocations.sql"),
    },
    Version {
        version: 5,
        description: "runs of one action and invocations by instance, for the web UI",
        sql: include_str!("../migrations/0005_action_runs.sql"),
    },
    Version {
        version: 6,
        description: "indexes for the web pages' paging",
        sql: include_str!("../migrations/0006_web_paging.sql"),
    },
    Version {
        version: 7,
        description: "remote cache hits of an invocation",
        sql: include_str!("../migrations/0007_invocation_cache_hits.sql"),
    },
    Version {
        version: 8,
        description: "remote cache counts of an invocation from every process",
        sql: include_str!("../migrations/0008_invocation_cache_counts.sql"),
    },
    Version {
        version: 9,
        description: "an invocation's actions ready-sorted for its page",
        sql: include_str!("../migrations/0009_action_pages.sql"),
    },
    Version {
        version: 10,
        description: "snapshots of the submit queue's planner",
        sql: include_str!("../migrations/0010_queue_snapshots.sql"),
    },
    Version {
        version: 11,
        description: "the age of each cached target graph of the submit queue",
        sql: include_str!("../migrations/0011_queue_graph_age.sql"),
    },
];

/// The migrations in a dialect, for sqlx's migrator.
#[derive(Debug)]
struct Migrations(Dialect);

impl<'s> MigrationSource<'s> for Migrations {
    fn resolve(self) -> BoxFuture<'s, std::result::Result<Vec<Migration>, sqlx::error::BoxDynError>> {
        let blob = self.0.blob();
        Box::pin(async move {
            Ok(MIGRATIONS
                .iter()
                .map(|v| {
                    Migration::new(
                        v.version,
                        Cow::Borrowed(v.description),
                        MigrationType::Simple,
                        Cow::Owned(v.sql.replace("{blob}", blob)),
                        false,
                    )
                })
                .collect())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(redact_url("postgres://gantry:s3cret@db:5432/meta"), "postgres://gantry:***@db:5432/meta");
        assert_eq!(redact_url("postgres://gantry@db/meta"), "postgres://gantry@db/meta");
        assert_eq!(
            redact_url("postgres://db/meta?user=g&password=s3cret&sslmode=require"),
            "postgres://db/meta?user=g&password=s3cret&sslmode=require".replace("s3cret", "***")
        );
        assert_eq!(redact_url("sqlite:///var/lib/gantry/metadata.db"), "sqlite:///var/lib/gantry/metadata.db");
        let e = Dialect::of("mysql://u:s3cret@h/db").unwrap_err().to_string();
        assert!(!e.contains("s3cret") && e.contains("postgres://"), "{e}");
    }

    #[tokio::test]
    async fn bad_urls_are_clear_errors() {
        let e = MetadataDb::open("mysql://x").await.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("sqlite://"), "{e}");
        let e = MetadataDb::open("sqlite:///proc/no/such/dir/ac.db").await.unwrap_err();
        assert!(e.to_string().contains("database"), "{e}");
        let quick = MetadataOptions { connect_timeout: Duration::from_secs(2), ..Default::default() };
        let e = MetadataDb::open_with("postgres://gantry:s3cret@127.0.0.1:1/none", &quick).await.unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, Error::Unavailable(_)) && !text.contains("s3cret") && text.contains("***"), "{text}");
    }

    #[tokio::test]
    async fn sqlite_commits_are_durable_wal_with_full_sync() {
        let dir = tempfile::tempdir().unwrap();
        let db = MetadataDb::open(&format!("sqlite://{}/meta.db", dir.path().display())).await.unwrap();
        let mode: String = sqlx::query("PRAGMA journal_mode").fetch_one(db.pool()).await.unwrap().try_get(0).unwrap();
        assert_eq!(mode.to_lowercase(), "wal");
        // 2 is FULL: every commit fsyncs the WAL before it returns.
        let sync: i64 = sqlx::query("PRAGMA synchronous").fetch_one(db.pool()).await.unwrap().try_get(0).unwrap();
        assert_eq!(sync, 2);
    }

    /// A row of the size-class statistics, the table these tests write to.
    fn stats_row(key: String) -> Write {
        Write::new("INSERT INTO size_class_stats (stats_key, stats, updated_unix_ms) VALUES ($1, $2, $3)")
            .bind(key)
            .bind("{}")
            .bind(1i64)
    }

    /// Two writes issued together share a commit, even when the second is queued a
    /// scheduler turn after the first has woken the commit task (as an action's result
    /// and its execution record are, behind a lock or a lookup). On one thread the order
    /// is fixed: without the commit task's yields, every pair takes two commits.
    #[tokio::test(flavor = "current_thread")]
    async fn writes_issued_together_share_a_commit() {
        let dir = tempfile::tempdir().unwrap();
        let db = MetadataDb::open(&format!("sqlite://{}/meta.db", dir.path().display())).await.unwrap();
        let put = |key: String| db.write("writing stats", stats_row(key));
        let commits = || db.group.as_ref().expect("a SQLite file").commits.load(std::sync::atomic::Ordering::Relaxed);
        let before = commits();
        let pairs = 50;
        for i in 0..pairs {
            let (a, b) = tokio::join!(put(format!("a{i}")), async {
                tokio::task::yield_now().await;
                put(format!("b{i}")).await
            });
            a.unwrap();
            b.unwrap();
        }
        assert_eq!(commits() - before, pairs, "commits for {pairs} pairs of writes");
    }

    /// Concurrent writes share commits, and a write that fails fails alone: the others in
    /// its group are committed, and it changed nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn group_commit_isolates_a_failing_write() {
        let dir = tempfile::tempdir().unwrap();
        let db = MetadataDb::open(&format!("sqlite://{}/meta.db", dir.path().display())).await.unwrap();
        let put = |key: String| {
            let db = db.clone();
            async move { db.write("writing stats", stats_row(key)).await }
        };
        let mut tasks: Vec<_> = (0..300).map(|i| tokio::spawn(put(format!("k{i}")))).collect();
        // The same key again: a primary key violation, in the middle of the others.
        tasks.insert(150, tokio::spawn(put("k7".into())));
        let mut failed = Vec::new();
        for t in tasks {
            if let Err(e) = t.await.unwrap() {
                failed.push(e);
            }
        }
        assert!(failed.len() <= 1, "{failed:?}");
        let n: i64 = sqlx::query("SELECT COUNT(*) FROM size_class_stats")
            .fetch_one(db.pool())
            .await
            .unwrap()
            .try_get(0)
            .unwrap();
        assert_eq!(n, 300, "every distinct key landed once");
        // Whichever of the two k7 writes came second failed, naming what it was.
        assert_eq!(failed.len(), 1);
        assert!(failed[0].to_string().contains("writing stats"), "{}", failed[0]);
        // Nothing is left open: a transaction on the writer still works.
        let done =
            db.write("deleting", Write::new("DELETE FROM size_class_stats WHERE stats_key = $1").bind("k1")).await;
        assert_eq!(done.unwrap(), 1);
    }

    /// The metadata database on a 2 MiB tmpfs that fills up. Runs only inside a mount
    /// namespace of its own, where this test process is root (see
    /// `a_full_disk_fails_metadata_writes_cleanly_and_recovers`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "run by a_full_disk_fails_metadata_writes_cleanly_and_recovers in a namespace"]
    async fn metadata_full_disk_inside_a_namespace() {
        let Ok(root) = std::env::var("GANTRY_TEST_TMPFS") else {
            panic!("run by a_full_disk_fails_metadata_writes_cleanly_and_recovers")
        };
        let root = std::path::PathBuf::from(root);
        let st = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"])
            .arg(&root)
            .status()
            .unwrap();
        assert!(st.success(), "mount tmpfs");
        let db = MetadataDb::open(&format!("sqlite://{}/meta.db", root.display())).await.unwrap();
        let put = |key: &str, bytes: usize| {
            let db = db.clone();
            let w = Write::new("INSERT INTO size_class_stats (stats_key, stats, updated_unix_ms) VALUES ($1, $2, $3)")
                .bind(key)
                .bind("x".repeat(bytes))
                .bind(1i64);
            async move { db.write("writing stats", w).await }
        };
        let count = || async {
            sqlx::query("SELECT COUNT(*) FROM size_class_stats")
                .fetch_one(db.pool())
                .await
                .unwrap()
                .try_get::<i64, _>(0)
                .unwrap()
        };
        put("before", 1000).await.unwrap();
        // Take the rest of the disk.
        let filler = root.join("filler");
        let mut f = std::fs::File::create(&filler).unwrap();
        let chunk = vec![7u8; 64 << 10];
        while std::io::Write::write_all(&mut f, &chunk).is_ok() {}
        drop(f);
        // Writes fail as RESOURCE_EXHAUSTED, alone or in a group, and change nothing.
        let writes: Vec<_> = (0..8).map(|i| tokio::spawn(put(&format!("full{i}"), 200_000))).collect();
        for w in writes {
            let e = w.await.unwrap().unwrap_err();
            assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
            assert!(e.to_string().contains("disk is full") && e.to_string().contains("writing stats"), "{e}");
        }
        // Reads go on.
        assert_eq!(count().await, 1);
        // Room again: the same writes succeed on the same database object.
        std::fs::remove_file(&filler).unwrap();
        for i in 0..4 {
            put(&format!("after{i}"), 200_000).await.unwrap();
        }
        assert_eq!(count().await, 5);
    }

    /// Disk full for the metadata database, for real: the test above in a user and mount
    /// namespace (`unshare -Urm`). Under CI=true a machine without them fails, not skips.
    #[test]
    fn a_full_disk_fails_metadata_writes_cleanly_and_recovers() {
        crate::run_in_a_namespace("metadata_db::tests::metadata_full_disk_inside_a_namespace");
    }
}
