//! Retention (`[retention]`): keeps the metadata database's history tables within their
//! bounds by age and by row count, in the background.
//!
//! Each sweep deletes, table by table, first the rows older than `max_age`, then the
//! oldest rows past `max_rows`, `batch_size` rows per statement with a pause between
//! statements, so a sweep that has months to catch up never holds a long write lock
//! (SQLite has one writer) or a long transaction in front of requests. The statements
//! are portable; the one dialect difference (which hidden column names a row) lives in
//! `Dialect::row_id`. The sweep also counts every table's rows and the database's size
//! for `/metrics`.
//!
//! Several processes may sweep one PostgreSQL database: deletes of rows another sweep
//! already removed simply affect fewer rows.

use std::time::Duration;

use gantry_config::{RetentionBound, RetentionConfig};
use gantry_core::task::{spawn_named, TaskGuard};
use gantry_core::Result;
use sqlx::Row;

use crate::metadata_db::{now_ms, Write};
use crate::MetadataDb;

/// A table under retention.
struct Table {
    /// Name in metrics and messages.
    name: &'static str,
    table: &'static str,
    /// The column that ages a row.
    time_column: &'static str,
    /// Milliseconds per unit of `time_column` (the action cache stores seconds).
    unit_ms: i64,
    /// Rows never deleted are excluded by this condition (may be empty).
    only: &'static str,
}

const ACTION_CACHE: Table =
    Table { name: "action_cache", table: "action_cache", time_column: "updated_at", unit_ms: 1000, only: "" };
const EXECUTION_LOG: Table =
    Table { name: "execution_log", table: "action_executions", time_column: "completed_unix_ms", unit_ms: 1, only: "" };
const BUILDS: Table = Table {
    name: "builds",
    table: "batch_builds",
    time_column: "finished_unix_ms",
    unit_ms: 1,
    // Builds still queued or running are the batch service's work, not history.
    only: "finished_unix_ms IS NOT NULL",
};

const INVOCATIONS: Table =
    Table { name: "invocations", table: "invocations", time_column: "started_unix_ms", unit_ms: 1, only: "" };
/// Kept as long as invocations (the same bound): each process's counts of one.
const CACHE_COUNTS: Table = Table {
    name: "invocation_cache_counts",
    table: "invocation_cache_counts",
    time_column: "updated_unix_ms",
    unit_ms: 1,
    only: "",
};

/// Every table of the metadata database, for the row-count gauges.
const ALL_TABLES: &[&str] = &[
    "action_cache",
    "action_executions",
    "size_class_stats",
    "batch_builds",
    "queue_changes",
    "queue_builds",
    "queue_events",
    "queue_landings",
    "queue_graphs",
    "queue_snapshots",
    "leases",
    "invocations",
    "invocation_cache_counts",
];

/// The oldest time (in the table's unit) a row may have at `now_ms` under `max_age`;
/// rows strictly older go. None when the age bound is off (0).
pub fn cutoff(now_ms: i64, max_age: Duration, unit_ms: i64) -> Option<i64> {
    if max_age.is_zero() {
        return None;
    }
    let age_ms = i64::try_from(max_age.as_millis()).unwrap_or(i64::MAX);
    Some(now_ms.saturating_sub(age_ms).div_euclid(unit_ms))
}

/// How many of `rows` are past `max_rows` (0 when the count bound is off).
pub fn excess(rows: u64, max_rows: u64) -> u64 {
    if max_rows == 0 {
        0
    } else {
        rows.saturating_sub(max_rows)
    }
}

/// What one sweep did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Sweep {
    /// Rows deleted per table name, in sweep order.
    pub deleted: Vec<(&'static str, u64)>,
}

pub struct Retention {
    db: MetadataDb,
    config: RetentionConfig,
    /// Pause between two delete statements, so requests get the database in between.
    pause: Duration,
}

impl Retention {
    pub fn new(db: MetadataDb, config: RetentionConfig) -> Self {
        Retention { db, config, pause: Duration::from_millis(20) }
    }

    fn tables(&self) -> [(&'static Table, RetentionBound); 5] {
        [
            (&ACTION_CACHE, self.config.action_cache),
            (&EXECUTION_LOG, self.config.execution_log),
            (&BUILDS, self.config.builds),
            (&INVOCATIONS, self.config.invocations),
            (&CACHE_COUNTS, self.config.invocations),
        ]
    }

    /// Applies every bound as of `now_ms` until each table is within it.
    pub async fn sweep(&self, now_ms: i64) -> Result<Sweep> {
        let mut out = Sweep::default();
        for (t, bound) in self.tables() {
            let mut deleted = 0;
            if let Some(cut) = cutoff(now_ms, bound.max_age, t.unit_ms) {
                deleted += self.delete_older(t, cut).await?;
            }
            if bound.max_rows > 0 {
                deleted += self.delete_excess(t, bound.max_rows).await?;
            }
            if deleted > 0 {
                tracing::info!(table = t.name, deleted, "retention: deleted old rows");
            }
            out.deleted.push((t.name, deleted));
        }
        Ok(out)
    }

    fn and_only(t: &Table) -> String {
        if t.only.is_empty() {
            String::new()
        } else {
            format!(" AND {}", t.only)
        }
    }

    async fn delete_older(&self, t: &Table, cut: i64) -> Result<u64> {
        let rid = self.db.dialect().row_id();
        let sql = format!(
            "DELETE FROM {table} WHERE {rid} IN (SELECT {rid} FROM {table} WHERE {col} < $1{only} LIMIT $2)",
            table = t.table,
            col = t.time_column,
            only = Self::and_only(t)
        );
        let batch = self.config.batch_size.max(1) as u64;
        let mut total = 0;
        loop {
            let n = self
                .db
                .write(format!("retention of {}", t.name), Write::new(sql.clone()).bind(cut).bind(batch as i64))
                .await?;
            total += n;
            if n < batch {
                return Ok(total);
            }
            tokio::time::sleep(self.pause).await;
        }
    }

    async fn delete_excess(&self, t: &Table, max_rows: u64) -> Result<u64> {
        let rows = self.count(t.table, &Self::and_only(t)).await?;
        let mut left = excess(rows, max_rows);
        let rid = self.db.dialect().row_id();
        let sql = format!(
            "DELETE FROM {table} WHERE {rid} IN (SELECT {rid} FROM {table} WHERE 1 = 1{only} ORDER BY {col} ASC LIMIT $1)",
            table = t.table,
            col = t.time_column,
            only = Self::and_only(t)
        );
        let mut total = 0;
        while left > 0 {
            let n = left.min(self.config.batch_size.max(1) as u64);
            let done =
                self.db.write(format!("retention of {}", t.name), Write::new(sql.clone()).bind(n as i64)).await?;
            total += done;
            // Another process may have deleted some of them already.
            if done < n {
                break;
            }
            left -= n;
            if left > 0 {
                tokio::time::sleep(self.pause).await;
            }
        }
        Ok(total)
    }

    async fn count(&self, table: &str, and_only: &str) -> Result<u64> {
        let n: i64 = sqlx::query(&format!("SELECT COUNT(*) FROM {table} WHERE 1 = 1{and_only}"))
            .fetch_one(self.db.pool())
            .await
            .and_then(|r| r.try_get(0))
            .map_err(self.db.err(&format!("counting {table}")))?;
        Ok(n.max(0) as u64)
    }

    /// Rows in every table of the metadata database.
    pub async fn table_rows(&self) -> Result<Vec<(&'static str, u64)>> {
        let mut v = Vec::with_capacity(ALL_TABLES.len());
        for t in ALL_TABLES {
            v.push((*t, self.count(t, "").await?));
        }
        Ok(v)
    }

    /// Sweeps every `interval` (the first right away) and refreshes the gauges in
    /// `registry`: `gantry_metadata_rows{table}`, `gantry_metadata_size_bytes` and
    /// `gantry_retention_deleted_rows_total{table}`. A failed sweep is logged and tried
    /// again at the next interval.
    pub fn spawn(self, registry: &prometheus::Registry) -> TaskGuard {
        let rows = prometheus::IntGaugeVec::new(
            prometheus::Opts::new("gantry_metadata_rows", "Rows per table of the metadata database"),
            &["table"],
        )
        .expect("valid metric");
        let size = prometheus::IntGauge::new("gantry_metadata_size_bytes", "Size of the metadata database")
            .expect("valid metric");
        let deleted = prometheus::IntCounterVec::new(
            prometheus::Opts::new("gantry_retention_deleted_rows_total", "Rows deleted by retention, by table"),
            &["table"],
        )
        .expect("valid metric");
        let _ = registry.register(Box::new(rows.clone()));
        let _ = registry.register(Box::new(size.clone()));
        let _ = registry.register(Box::new(deleted.clone()));
        spawn_named("metadata-retention", async move {
            let mut tick = tokio::time::interval(self.config.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match self.sweep(now_ms()).await {
                    Ok(s) => {
                        for (t, n) in s.deleted {
                            deleted.with_label_values(&[t]).inc_by(n);
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "retention sweep failed; retrying at the next interval"),
                }
                match self.table_rows().await {
                    Ok(v) => {
                        for (t, n) in v {
                            rows.with_label_values(&[t]).set(n as i64);
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "counting metadata rows"),
                }
                match self.db.size_bytes().await {
                    Ok(n) => size.set(n),
                    Err(e) => tracing::warn!(error = %e, "reading the metadata database size"),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cutoff_in_the_tables_unit() {
        let now = 1_000_000_000_000;
        assert_eq!(cutoff(now, Duration::ZERO, 1), None, "0 turns the age bound off");
        assert_eq!(cutoff(now, Duration::from_secs(60), 1), Some(now - 60_000));
        assert_eq!(cutoff(now, Duration::from_secs(60), 1000), Some(now / 1000 - 60), "seconds for the action cache");
        assert_eq!(cutoff(5, Duration::MAX, 1), Some(5 - i64::MAX), "no overflow on absurd ages");
    }

    #[test]
    fn excess_rows() {
        assert_eq!(excess(10, 0), 0, "0 turns the count bound off");
        assert_eq!(excess(10, 12), 0);
        assert_eq!(excess(10, 7), 3);
    }
}
