//! `SqlActionCache` (`[action_cache] kind = "sql"`): ActionResults as rows in an SQL
//! database, through sqlx's `Any` driver.
//!
//! The statements use only portable SQL (`$n` placeholders, `INSERT ... ON CONFLICT`), so
//! the same code runs on SQLite today and on PostgreSQL when that backend is enabled; only
//! the binary column type differs per dialect, in `schema()`.

use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use gantry_core::reapi::ActionResult;
use gantry_core::{ActionCache, Digest, Error, Result};
use prost::Message;
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Executor, Row};

pub struct SqlActionCache {
    pool: AnyPool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dialect {
    Sqlite,
}

fn dialect(url: &str) -> Result<Dialect> {
    if url.starts_with("sqlite:") {
        Ok(Dialect::Sqlite)
    } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        Err(Error::FailedPrecondition(
            "action_cache.url: PostgreSQL is not enabled in this build of gantry yet; use a sqlite:// URL".into(),
        ))
    } else {
        Err(Error::invalid(format!("action_cache.url '{url}': expected a sqlite:// URL")))
    }
}

fn schema(d: Dialect) -> String {
    let blob = match d {
        Dialect::Sqlite => "BLOB",
    };
    format!(
        "CREATE TABLE IF NOT EXISTS action_cache (
            instance_name TEXT NOT NULL,
            digest_function TEXT NOT NULL,
            action_hash TEXT NOT NULL,
            action_size BIGINT NOT NULL,
            result {blob} NOT NULL,
            updated_at BIGINT NOT NULL,
            PRIMARY KEY (instance_name, digest_function, action_hash, action_size)
        )"
    )
}

fn db_err(what: &str) -> impl FnOnce(sqlx::Error) -> Error + '_ {
    move |e| Error::Unavailable(format!("action cache database: {what}: {e}"))
}

impl SqlActionCache {
    /// Connects, creating the SQLite file and its directory if needed, and creates the
    /// table. A database that cannot be opened is an error here, at startup.
    pub async fn connect(url: &str) -> Result<Self> {
        let d = dialect(url)?;
        sqlx::any::install_default_drivers();
        let mut url = url.to_string();
        if d == Dialect::Sqlite && !url.contains(":memory:") {
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
        let opts = AnyPoolOptions::new()
            // An in-memory SQLite database exists per connection: keep exactly one.
            .max_connections(if url.contains(":memory:") { 1 } else { 8 })
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if d == Dialect::Sqlite {
                        // WAL lets readers run beside the writer; NORMAL sync keeps every
                        // committed row across a process crash.
                        conn.execute("PRAGMA journal_mode = WAL").await?;
                        conn.execute("PRAGMA synchronous = NORMAL").await?;
                        conn.execute("PRAGMA busy_timeout = 5000").await?;
                    }
                    Ok(())
                })
            });
        let pool = opts.connect(&url).await.map_err(db_err("connecting"))?;
        pool.execute(schema(d).as_str()).await.map_err(db_err("creating table action_cache"))?;
        Ok(SqlActionCache { pool })
    }

    /// The connection pool, shared by other tables of the metadata database.
    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }
}

#[async_trait]
impl ActionCache for SqlActionCache {
    async fn get(&self, instance: &str, action: &Digest) -> Result<Option<ActionResult>> {
        let row: Option<AnyRow> = sqlx::query(
            "SELECT result FROM action_cache
             WHERE instance_name = $1 AND digest_function = $2 AND action_hash = $3 AND action_size = $4",
        )
        .bind(instance)
        .bind(action.function.name())
        .bind(action.hash_hex())
        .bind(action.size as i64)
        .fetch_optional(&self.pool)
        .await
        .map_err(db_err("reading an entry"))?;
        let Some(row) = row else { return Ok(None) };
        let bytes: Vec<u8> = row
            .try_get(0)
            .map_err(|e| Error::internal(format!("action cache entry for {action}: undecodable row: {e}")))?;
        let result = ActionResult::decode(bytes.as_slice())
            .map_err(|e| Error::internal(format!("action cache entry for {action} is corrupt: {e}")))?;
        Ok(Some(result))
    }

    async fn put(&self, instance: &str, action: &Digest, result: &ActionResult) -> Result<()> {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        sqlx::query(
            "INSERT INTO action_cache (instance_name, digest_function, action_hash, action_size, result, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (instance_name, digest_function, action_hash, action_size)
             DO UPDATE SET result = excluded.result, updated_at = excluded.updated_at",
        )
        .bind(instance)
        .bind(action.function.name())
        .bind(action.hash_hex())
        .bind(action.size as i64)
        .bind(result.encode_to_vec())
        .bind(now)
        .execute(&self.pool)
        .await
        .map_err(db_err("writing an entry"))?;
        Ok(())
    }

    async fn check(&self) -> Result<()> {
        sqlx::query("SELECT COUNT(*) FROM action_cache")
            .fetch_one(&self.pool)
            .await
            .map_err(db_err("startup check"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_core::DigestFunction;

    fn result(code: i32) -> ActionResult {
        ActionResult { exit_code: code, ..Default::default() }
    }

    #[tokio::test]
    async fn round_trip_instances_and_functions_are_separate() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/sub/ac.db", dir.path().display());
        let ac = SqlActionCache::connect(&url).await.unwrap();
        ac.check().await.unwrap();
        let a = DigestFunction::Sha256.digest_of(b"action");
        let mut b3 = DigestFunction::Blake3.digest_of(b"action");
        b3.hash = a.hash; // same hex under another function must not alias
        assert_eq!(ac.get("", &a).await.unwrap(), None);
        ac.put("", &a, &result(1)).await.unwrap();
        ac.put("other", &a, &result(2)).await.unwrap();
        assert_eq!(ac.get("", &a).await.unwrap(), Some(result(1)));
        assert_eq!(ac.get("other", &a).await.unwrap(), Some(result(2)));
        assert_eq!(ac.get("", &b3).await.unwrap(), None);
        ac.put("", &a, &result(3)).await.unwrap();
        assert_eq!(ac.get("", &a).await.unwrap(), Some(result(3)));
        drop(ac);
        // persisted across reopen
        let ac = SqlActionCache::connect(&url).await.unwrap();
        assert_eq!(ac.get("", &a).await.unwrap(), Some(result(3)));
    }

    #[tokio::test]
    async fn bad_urls_are_clear_errors() {
        let e = SqlActionCache::connect("mysql://x").await.err().unwrap();
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("sqlite://"), "{e}");
        let e = SqlActionCache::connect("postgres://localhost/x").await.err().unwrap();
        assert!(e.to_string().contains("PostgreSQL"), "{e}");
        let e = SqlActionCache::connect("sqlite:///proc/no/such/dir/ac.db").await.err().unwrap();
        assert!(e.to_string().contains("database"), "{e}");
    }
}
