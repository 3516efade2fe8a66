//! `SqlExecutionLog`: the execution log as a table in the metadata database, and
//! `SqlSizeClassStore`, the size-class learner's statistics, in the portable SQL of
//! `sql_action_cache.rs`.

use async_trait::async_trait;
use gantry_core::{ActionOrder, ActionRecord, ClassRuns, Error, ExecutionLog, InvocationSummary, Result, RunsOf};
use sqlx::Row;

use crate::{metadata_db::Write, MetadataDb};

pub struct SqlExecutionLog {
    db: MetadataDb,
}

impl SqlExecutionLog {
    pub fn new(db: MetadataDb) -> Self {
        SqlExecutionLog { db }
    }
}

#[async_trait]
impl ExecutionLog for SqlExecutionLog {
    async fn record(&self, r: &ActionRecord) -> Result<()> {
        self.db.write("recording an execution", Write::new(
            "INSERT INTO action_executions (operation, instance_name, action_digest, tool_invocation_id,
                action_mnemonic, target_id, worker, size_class, exit_code, status_code, peak_memory_bytes,
                user_cpu_seconds, system_cpu_seconds, wall_seconds, queued_seconds, metering, completed_unix_ms, shape_key)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18)",
        )        .bind(&r.operation)
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
        .bind(&r.shape_key)).await?;
        Ok(())
    }

    async fn actions(&self, id: &str) -> Result<Vec<ActionRecord>> {
        let rows = sqlx::query(&format!("{SELECT_RECORD} WHERE tool_invocation_id = $1 ORDER BY completed_unix_ms"))
            .bind(id)
            .fetch_all(self.db.pool())
            .await
            .map_err(self.db.err("reading executions"))?;
        rows.iter().map(record_of).collect()
    }

    async fn runs(&self, of: RunsOf<'_>, limit: usize) -> Result<Vec<ActionRecord>> {
        let (column, value) = match of {
            RunsOf::Action(digest) => ("action_digest", digest),
            RunsOf::Shape(key) => ("shape_key", key),
        };
        let rows =
            sqlx::query(&format!("{SELECT_RECORD} WHERE {column} = $1 ORDER BY completed_unix_ms DESC LIMIT $2"))
                .bind(value)
                .bind(limit.min(i64::MAX as usize) as i64)
                .fetch_all(self.db.pool())
                .await
                .map_err(self.db.err("reading an action's runs"))?;
        rows.iter().map(record_of).collect()
    }

    async fn class_runs(&self, since: i64, bucket_ms: i64) -> Result<Vec<ClassRuns>> {
        if bucket_ms <= 0 {
            return Err(Error::invalid(format!("bucket_ms: {bucket_ms} is not a positive length")));
        }
        // Integer division truncates toward zero in both dialects; times are positive.
        let rows = sqlx::query(
            "SELECT CAST((completed_unix_ms / $2) * $2 AS BIGINT) AS bucket, instance_name, size_class,
                CAST(COUNT(*) AS BIGINT),
                CAST(SUM(CASE WHEN status_code <> 0 OR exit_code <> 0 THEN 1 ELSE 0 END) AS BIGINT)
             FROM action_executions WHERE completed_unix_ms >= $1
             GROUP BY bucket, instance_name, size_class ORDER BY bucket, instance_name, size_class",
        )
        .bind(since)
        .bind(bucket_ms)
        .fetch_all(self.db.pool())
        .await
        .map_err(self.db.err("counting runs per size class"))?;
        let decode = |row: &sqlx::any::AnyRow| -> std::result::Result<ClassRuns, sqlx::Error> {
            Ok(ClassRuns {
                bucket_unix_ms: row.try_get(0)?,
                instance: row.try_get(1)?,
                size_class: row.try_get::<i64, _>(2)? as u32,
                runs: row.try_get::<i64, _>(3)? as u64,
                failed: row.try_get::<i64, _>(4)? as u64,
            })
        };
        rows.iter()
            .map(decode)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::internal(format!("execution log: undecodable run counts: {e}")))
    }

    /// Ordered and cut by the database, in `gantry_core::order_actions`'s order, so a page
    /// of an invocation with 100,000 actions reads one page of rows.
    async fn actions_page(
        &self,
        id: &str,
        order: ActionOrder,
        offset: usize,
        limit: usize,
    ) -> Result<Vec<ActionRecord>> {
        let sql = page_sql(order);
        let mut query = sqlx::query(&sql)
            .bind(id)
            .bind(limit.min(i64::MAX as usize) as i64)
            .bind(offset.min(i64::MAX as usize) as i64);
        // A bound, not a literal: the critical path's walk asks hundreds of bounds in a
        // row, and one statement text is prepared once (a literal each would be parsed
        // and planned each time, and crowd the connection's statement cache).
        if let ActionOrder::FinishedBy(at) = order {
            query = query.bind(at);
        }
        let rows = query.fetch_all(self.db.pool()).await.map_err(self.db.err("reading a page of executions"))?;
        rows.iter().map(record_of).collect()
    }

    /// The whole walk in one recursive query: each step is the same indexed lookup
    /// `path_back_by_pages` makes, run inside the database, so a path of hundreds of steps
    /// costs one round trip, not hundreds. The bound is `predecessor_bound` without its
    /// floor: for whole milliseconds, `c <= floor(r)` is `c <= r`.
    async fn path_back(&self, id: &str, limit: usize) -> Result<Vec<ActionRecord>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let rid = self.db.dialect().row_id();
        // The tie order's readiness (as FinishedBy sorts) and the bound's (clamped).
        let ready = |t: &str| format!("{t}.completed_unix_ms - 1000.0 * ({t}.wall_seconds + {t}.queued_seconds)");
        let clamp = |c: String| format!("(CASE WHEN {c} > 0 THEN {c} ELSE 0 END)");
        let ready_bound = |t: &str| {
            format!(
                "{t}.completed_unix_ms - 1000.0 * ({} + {})",
                clamp(format!("{t}.wall_seconds")),
                clamp(format!("{t}.queued_seconds"))
            )
        };
        // The walk carries only the row id: each step reads its row `p` by id in scalar
        // subqueries, so the next lookup's bounds are values an index search can use (a
        // join on the step's row made SQLite, once ANALYZEd, build a Bloom filter over the
        // whole table at every step, and PostgreSQL scan the invocation from its end). An untimed run (completed at or
        // before 0) sorts after every timed one, so "the latest by the bound, ending the walk
        // if untimed" is "the latest timed one by the bound, if any".
        let sql = format!(
            "WITH RECURSIVE walk (rid, n) AS (
                SELECT rid, 1 FROM (SELECT (
                    SELECT f.{rid} FROM action_executions f
                    WHERE f.tool_invocation_id = $1 AND f.completed_unix_ms > 0
                    ORDER BY f.completed_unix_ms DESC, {fr}, f.operation LIMIT 1
                ) AS rid) first WHERE rid IS NOT NULL
                UNION ALL
                SELECT (
                    SELECT x.{rid} FROM action_executions x
                    WHERE x.tool_invocation_id = $1 AND x.completed_unix_ms > 0
                        AND x.completed_unix_ms < (SELECT p.completed_unix_ms FROM action_executions p WHERE p.{rid} = w.rid)
                        AND x.completed_unix_ms <= (SELECT {pb} + {tol:.1} FROM action_executions p WHERE p.{rid} = w.rid)
                    ORDER BY x.completed_unix_ms DESC, {xr}, x.operation LIMIT 1
                ), w.n + 1
                FROM walk w WHERE w.n < $2 AND w.rid IS NOT NULL
            )
            {select} a JOIN walk ON a.{rid} = walk.rid ORDER BY walk.n",
            fr = ready("f"),
            pb = ready_bound("p"),
            xr = ready("x"),
            tol = gantry_core::PATH_TOLERANCE_MS,
            select = select_record_of("a"),
        );
        let rows = sqlx::query(&sql)
            .bind(id)
            .bind(limit.min(i64::MAX as usize) as i64)
            .fetch_all(self.db.pool())
            .await
            .map_err(self.db.err("walking an invocation's critical path"))?;
        rows.iter().map(record_of).collect()
    }

    /// One aggregate query, so a page listing many invocations does not read every
    /// action record of each.
    async fn invocation(&self, id: &str) -> Result<InvocationSummary> {
        let row = sqlx::query(&format!(
            "SELECT CAST(COUNT(*) AS BIGINT), COALESCE(SUM(wall_seconds), 0.0),
                COALESCE(SUM({}), 0.0),
                COALESCE(SUM(user_cpu_seconds + system_cpu_seconds), 0.0),
                CAST(COALESCE(MAX(peak_memory_bytes), 0) AS BIGINT),
                CAST(COALESCE(SUM(CASE WHEN status_code <> 0 OR exit_code <> 0 THEN 1 ELSE 0 END), 0) AS BIGINT)
             FROM action_executions WHERE tool_invocation_id = $1",
            esu_sql()
        ))
        .bind(id)
        .fetch_one(self.db.pool())
        .await
        .map_err(self.db.err("summing an invocation's executions"))?;
        let get = || -> std::result::Result<InvocationSummary, sqlx::Error> {
            Ok(InvocationSummary {
                tool_invocation_id: id.to_string(),
                actions: row.try_get::<i64, _>(0)? as u64,
                executor_service_seconds: row.try_get(1)?,
                executor_esu_seconds: row.try_get(2)?,
                cpu_seconds: row.try_get(3)?,
                max_peak_memory_bytes: row.try_get::<i64, _>(4)? as u64,
                failed_actions: row.try_get::<i64, _>(5)? as u64,
            })
        };
        get().map_err(|e| Error::internal(format!("execution log: undecodable summary: {e}")))
    }
}

/// The query for one page of an invocation's actions in `order` (binding the invocation,
/// the limit, the offset and, for [`ActionOrder::FinishedBy`], its time). The first two orders are those of migration 9's indexes, so
/// the database reads them ready-sorted; the last walks the (invocation, completion)
/// index backwards.
fn page_sql(order: ActionOrder) -> String {
    let tie = "completed_unix_ms, operation";
    let (filter, by) = match order {
        ActionOrder::Dearest => (String::new(), format!("{} DESC, {tie}", esu_sql())),
        // The dearest index read backwards.
        ActionOrder::Cheapest => (String::new(), format!("{}, completed_unix_ms DESC, operation DESC", esu_sql())),
        ActionOrder::Longest => (String::new(), format!("wall_seconds DESC, {tie}")),
        ActionOrder::FinishedBy(_) => (
            " AND completed_unix_ms <= $4".to_string(),
            "completed_unix_ms DESC, completed_unix_ms - 1000.0 * (wall_seconds + queued_seconds), operation"
                .to_string(),
        ),
    };
    format!("{SELECT_RECORD} WHERE tool_invocation_id = $1{filter} ORDER BY {by} LIMIT $2 OFFSET $3")
}

/// `ActionRecord::esu_seconds` in SQL: wall time × the larger of the class and the peak
/// memory in ESU. Migration 9 indexes this very expression (a test checks they agree).
fn esu_sql() -> String {
    let class = "(CASE WHEN size_class < 1 THEN 1 ELSE size_class END)";
    let by_memory = format!("(peak_memory_bytes / {}.0)", gantry_core::ESU_MEMORY_BYTES);
    format!("(wall_seconds * (CASE WHEN {by_memory} > {class} THEN {by_memory} ELSE {class} END))")
}

/// [`SELECT_RECORD`] with each column taken from the table aliased `alias`, for joins.
fn select_record_of(alias: &str) -> String {
    let columns = SELECT_RECORD.trim_start_matches("SELECT ").trim_end_matches(" FROM action_executions");
    let columns: Vec<String> = columns.split(',').map(|c| format!("{alias}.{}", c.trim())).collect();
    format!("SELECT {} FROM action_executions", columns.join(", "))
}

const SELECT_RECORD: &str = "SELECT operation, instance_name, action_digest, tool_invocation_id, action_mnemonic,
    target_id, worker, size_class, exit_code, status_code, peak_memory_bytes, user_cpu_seconds,
    system_cpu_seconds, wall_seconds, queued_seconds, metering, completed_unix_ms, shape_key FROM action_executions";

fn record_of(row: &sqlx::any::AnyRow) -> Result<ActionRecord> {
    let get = || -> std::result::Result<ActionRecord, sqlx::Error> {
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
            shape_key: row.try_get(17)?,
        })
    };
    get().map_err(|e| Error::internal(format!("execution log: undecodable row: {e}")))
}

/// `SqlSizeClassStore`: the size-class learner's per-key statistics, one row per key.
pub struct SqlSizeClassStore {
    db: MetadataDb,
}

impl SqlSizeClassStore {
    pub fn new(db: MetadataDb) -> Self {
        SqlSizeClassStore { db }
    }
}

#[async_trait]
impl gantry_core::SizeClassStore for SqlSizeClassStore {
    async fn get(&self, key: &str) -> Result<Option<String>> {
        let row = sqlx::query("SELECT stats FROM size_class_stats WHERE stats_key = $1")
            .bind(key)
            .fetch_optional(self.db.pool())
            .await
            .map_err(self.db.err("reading size class stats"))?;
        row.map(|r| r.try_get::<String, _>(0))
            .transpose()
            .map_err(|e| Error::internal(format!("size class stats: undecodable row: {e}")))
    }

    async fn put(&self, key: &str, stats: &str) -> Result<()> {
        let now = crate::metadata_db::now_ms();
        self.db
            .write(
                "writing size class stats",
                Write::new(
                    "INSERT INTO size_class_stats (stats_key, stats, updated_unix_ms) VALUES ($1, $2, $3)
             ON CONFLICT (stats_key) DO UPDATE SET stats = excluded.stats, updated_unix_ms = excluded.updated_unix_ms",
                )
                .bind(key)
                .bind(stats)
                .bind(now),
            )
            .await?;
        Ok(())
    }

    async fn keys(&self, limit: usize) -> Result<Vec<String>> {
        let rows = sqlx::query("SELECT stats_key FROM size_class_stats ORDER BY updated_unix_ms DESC LIMIT $1")
            .bind(limit as i64)
            .fetch_all(self.db.pool())
            .await
            .map_err(self.db.err("listing size class stats"))?;
        rows.iter()
            .map(|r| r.try_get::<String, _>(0))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::internal(format!("size class stats: undecodable row: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan SQLite chooses for `order`'s page, one line per step.
    async fn plan(db: &MetadataDb, order: ActionOrder) -> String {
        let sql = format!("EXPLAIN QUERY PLAN {}", page_sql(order));
        let mut query = sqlx::query(&sql).bind("inv").bind(100i64).bind(0i64);
        if let ActionOrder::FinishedBy(at) = order {
            query = query.bind(at);
        }
        let rows = query.fetch_all(db.pool()).await.unwrap();
        rows.iter().map(|r| r.try_get::<String, _>(3).unwrap()).collect::<Vec<_>>().join("\n")
    }

    /// A page of the dearest or the longest actions reads an index in its order: no sort of
    /// every action of the invocation (which made the last page of 100,000 take 0.5 s).
    #[tokio::test]
    async fn pages_read_an_index_in_their_order_without_sorting() {
        assert!(
            include_str!("../migrations/0009_action_pages.sql").contains(&esu_sql()),
            "migration 9 must index esu_sql()'s expression: a changed cost needs a new index"
        );
        let db = MetadataDb::open("sqlite::memory:").await.unwrap();
        for (order, index) in [
            (ActionOrder::Dearest, "action_executions_dearest"),
            (ActionOrder::Cheapest, "action_executions_dearest"),
            (ActionOrder::Longest, "action_executions_longest"),
            (ActionOrder::FinishedBy(5), "action_executions_invocation"),
        ] {
            let plan = plan(&db, order).await;
            assert!(plan.contains(index), "{order:?}: {plan}");
            // The completion index gives the first key; only ties are ordered after.
            if order != ActionOrder::FinishedBy(5) {
                assert!(!plan.contains("TEMP B-TREE"), "{order:?} sorts: {plan}");
            }
        }
    }
}
