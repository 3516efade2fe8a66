//! `SqlExecutionLog`: the execution log as a table in the metadata database (the same
//! SQLite file as the action cache by default), in the portable SQL of
//! `sql_action_cache.rs`.

use async_trait::async_trait;
use gantry_core::{ActionRecord, Error, ExecutionLog, Result};
use sqlx::{AnyPool, Executor, Row};

pub struct SqlExecutionLog {
    pool: AnyPool,
}

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS action_executions (
    operation TEXT NOT NULL,
    instance_name TEXT NOT NULL,
    action_digest TEXT NOT NULL,
    tool_invocation_id TEXT NOT NULL,
    action_mnemonic TEXT NOT NULL,
    target_id TEXT NOT NULL,
    worker TEXT NOT NULL,
    size_class BIGINT NOT NULL,
    exit_code BIGINT NOT NULL,
    status_code BIGINT NOT NULL,
    peak_memory_bytes BIGINT NOT NULL,
    user_cpu_seconds DOUBLE PRECISION NOT NULL,
    system_cpu_seconds DOUBLE PRECISION NOT NULL,
    wall_seconds DOUBLE PRECISION NOT NULL,
    queued_seconds DOUBLE PRECISION NOT NULL,
    metering TEXT NOT NULL,
    completed_unix_ms BIGINT NOT NULL
)";

const INDEX: &str =
    "CREATE INDEX IF NOT EXISTS action_executions_invocation ON action_executions (tool_invocation_id, completed_unix_ms)";

fn db_err(what: &str) -> impl FnOnce(sqlx::Error) -> Error + '_ {
    move |e| Error::Unavailable(format!("execution log database: {what}: {e}"))
}

impl SqlExecutionLog {
    /// Uses the pool of the action cache, so both live in one database.
    pub async fn new(pool: AnyPool) -> Result<Self> {
        pool.execute(SCHEMA).await.map_err(db_err("creating table action_executions"))?;
        pool.execute(INDEX).await.map_err(db_err("creating index"))?;
        Ok(SqlExecutionLog { pool })
    }

    pub async fn connect(url: &str) -> Result<Self> {
        Self::new(metadata_pool(url).await?).await
    }
}

/// A pool on the metadata database at `url`, opened (and created) the way the action
/// cache opens it, so every table lives in one database with one set of settings.
pub(crate) async fn metadata_pool(url: &str) -> Result<AnyPool> {
    Ok(crate::SqlActionCache::connect(url).await?.pool().clone())
}

#[async_trait]
impl ExecutionLog for SqlExecutionLog {
    async fn record(&self, r: &ActionRecord) -> Result<()> {
        sqlx::query(
            "INSERT INTO action_executions (operation, instance_name, action_digest, tool_invocation_id,
                action_mnemonic, target_id, worker, size_class, exit_code, status_code, peak_memory_bytes,
                user_cpu_seconds, system_cpu_seconds, wall_seconds, queued_seconds, metering, completed_unix_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)",
        )
        .bind(&r.operation)
        .bind(&r.instance)
        .bind(&r.action_digest)
        .bind(&r.tool_invocation_id)
        .bind(&r.action_mnemonic)
        .bind(&r.target_id)
        .bind(&r.worker)
        .bind(r.size_class as i64)
        .bind(r.exit_code as i64)
        .bind(r.status_code as i64)
        .bind(r.peak_memory_bytes as i64)
        .bind(r.user_cpu_seconds)
        .bind(r.system_cpu_seconds)
        .bind(r.wall_seconds)
        .bind(r.queued_seconds)
        .bind(&r.metering)
        .bind(r.completed_unix_ms)
        .execute(&self.pool)
        .await
        .map_err(db_err("recording an execution"))?;
        Ok(())
    }

    async fn actions(&self, id: &str) -> Result<Vec<ActionRecord>> {
        let rows = sqlx::query(
            "SELECT operation, instance_name, action_digest, tool_invocation_id, action_mnemonic, target_id,
                worker, size_class, exit_code, status_code, peak_memory_bytes, user_cpu_seconds,
                system_cpu_seconds, wall_seconds, queued_seconds, metering, completed_unix_ms
             FROM action_executions WHERE tool_invocation_id = $1 ORDER BY completed_unix_ms",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await
        .map_err(db_err("reading executions"))?;
        rows.iter()
            .map(|row| -> std::result::Result<ActionRecord, sqlx::Error> {
                Ok(ActionRecord {
                    operation: row.try_get(0)?,
                    instance: row.try_get(1)?,
                    action_digest: row.try_get(2)?,
                    tool_invocation_id: row.try_get(3)?,
                    action_mnemonic: row.try_get(4)?,
                    target_id: row.try_get(5)?,
                    worker: row.try_get(6)?,
                    size_class: row.try_get::<i64, _>(7)? as u32,
                    exit_code: row.try_get::<i64, _>(8)? as i32,
                    status_code: row.try_get::<i64, _>(9)? as i32,
                    peak_memory_bytes: row.try_get::<i64, _>(10)? as u64,
                    user_cpu_seconds: row.try_get(11)?,
                    system_cpu_seconds: row.try_get(12)?,
                    wall_seconds: row.try_get(13)?,
                    queued_seconds: row.try_get(14)?,
                    metering: row.try_get(15)?,
                    completed_unix_ms: row.try_get(16)?,
                })
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::internal(format!("execution log: undecodable row: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn records_and_sums_an_invocation() {
        let log = SqlExecutionLog::connect("sqlite::memory:").await.unwrap();
        let rec = |op: &str, inv: &str, wall: f64, mem: u64, exit: i32| ActionRecord {
            operation: op.into(),
            tool_invocation_id: inv.into(),
            action_mnemonic: "Genrule".into(),
            wall_seconds: wall,
            user_cpu_seconds: wall / 2.0,
            peak_memory_bytes: mem,
            exit_code: exit,
            metering: "rusage".into(),
            completed_unix_ms: 1000 + op.len() as i64,
            ..Default::default()
        };
        log.record(&rec("a", "inv1", 1.5, 10 << 20, 0)).await.unwrap();
        log.record(&rec("bb", "inv1", 2.5, 30 << 20, 1)).await.unwrap();
        log.record(&rec("c", "inv2", 9.0, 1, 0)).await.unwrap();
        let s = log.invocation("inv1").await.unwrap();
        assert_eq!(s.actions, 2);
        assert!((s.executor_service_seconds - 4.0).abs() < 1e-9);
        assert!((s.cpu_seconds - 2.0).abs() < 1e-9);
        assert_eq!(s.max_peak_memory_bytes, 30 << 20);
        assert_eq!(s.failed_actions, 1);
        let acts = log.actions("inv1").await.unwrap();
        assert_eq!(acts[1], rec("bb", "inv1", 2.5, 30 << 20, 1));
        assert_eq!(log.invocation("none").await.unwrap().actions, 0);
    }
}

/// `SqlSizeClassStore`: the size-class learner's per-key statistics, one row per key.
pub struct SqlSizeClassStore {
    pool: AnyPool,
}

impl SqlSizeClassStore {
    pub async fn new(pool: AnyPool) -> Result<Self> {
        pool.execute(
            "CREATE TABLE IF NOT EXISTS size_class_stats (
                stats_key TEXT NOT NULL PRIMARY KEY,
                stats TEXT NOT NULL,
                updated_unix_ms BIGINT NOT NULL
            )",
        )
        .await
        .map_err(db_err("creating table size_class_stats"))?;
        Ok(SqlSizeClassStore { pool })
    }

    pub async fn connect(url: &str) -> Result<Self> {
        Self::new(metadata_pool(url).await?).await
    }
}

#[async_trait]
impl gantry_core::SizeClassStore for SqlSizeClassStore {
    async fn get(&self, key: &str) -> Result<Option<String>> {
        let row = sqlx::query("SELECT stats FROM size_class_stats WHERE stats_key = $1")
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err("reading size class stats"))?;
        row.map(|r| r.try_get::<String, _>(0))
            .transpose()
            .map_err(|e| Error::internal(format!("size class stats: undecodable row: {e}")))
    }

    async fn put(&self, key: &str, stats: &str) -> Result<()> {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0);
        sqlx::query(
            "INSERT INTO size_class_stats (stats_key, stats, updated_unix_ms) VALUES ($1, $2, $3)
             ON CONFLICT (stats_key) DO UPDATE SET stats = excluded.stats, updated_unix_ms = excluded.updated_unix_ms",
        )
        .bind(key)
        .bind(stats)
        .bind(now)
        .execute(&self.pool)
        .await
        .map_err(db_err("writing size class stats"))?;
        Ok(())
    }

    async fn keys(&self, limit: usize) -> Result<Vec<String>> {
        let rows = sqlx::query("SELECT stats_key FROM size_class_stats ORDER BY updated_unix_ms DESC LIMIT $1")
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await
            .map_err(db_err("listing size class stats"))?;
        rows.iter()
            .map(|r| r.try_get::<String, _>(0))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::internal(format!("size class stats: undecodable row: {e}")))
    }
}

#[cfg(test)]
mod size_class_store_tests {
    use super::*;
    use gantry_core::SizeClassStore;

    #[tokio::test]
    async fn upsert_and_list() {
        let s = SqlSizeClassStore::connect("sqlite::memory:").await.unwrap();
        assert_eq!(s.get("k").await.unwrap(), None);
        s.put("k", "{\"v\":1}").await.unwrap();
        s.put("k", "{\"v\":2}").await.unwrap();
        s.put("j", "{}").await.unwrap();
        assert_eq!(s.get("k").await.unwrap().as_deref(), Some("{\"v\":2}"));
        let keys = s.keys(10).await.unwrap();
        assert_eq!(keys.len(), 2);
        assert!(keys.contains(&"k".to_string()) && keys.contains(&"j".to_string()));
    }
}
