//! `SqlInvocationStore`: Build Event Service invocations in the metadata database, in the
//! portable SQL of `sql_action_cache.rs`. An invocation is one row (its header as columns
//! for the list, the rest as a JSON document) replaced whole by an upsert, so a crash
//! leaves the old invocation or the new one, never part of one.

use std::collections::BTreeMap;

use async_trait::async_trait;
use gantry_core::{CacheCounts, Error, Invocation, InvocationStore, Result, TargetOutcome, TestOutcome};
use serde::{Deserialize, Serialize};
use sqlx::Row;

use crate::{metadata_db::Write, MetadataDb};

pub struct SqlInvocationStore {
    db: MetadataDb,
}

impl SqlInvocationStore {
    pub fn new(db: MetadataDb) -> Self {
        SqlInvocationStore { db }
    }
}

/// The stored document: gantry's own format, versioned, independent of the core types.
#[derive(Serialize, Deserialize)]
struct Document {
    v: u32,
    options: Vec<String>,
    metadata: BTreeMap<String, String>,
    targets: Vec<TargetDoc>,
    tests: Vec<TestDoc>,
    /// Added to version 1 without a new version: older documents lack it (read as empty),
    /// and older gantry ignores it.
    #[serde(default)]
    critical_path: String,
}

#[derive(Serialize, Deserialize)]
struct TargetDoc {
    label: String,
    kind: String,
    success: Option<bool>,
}

#[derive(Serialize, Deserialize)]
struct TestDoc {
    label: String,
    run: i32,
    shard: i32,
    attempt: i32,
    status: String,
    duration_ms: i64,
    cached_locally: bool,
    logs: Vec<(String, String)>,
}

const DOCUMENT_VERSION: u32 = 1;

/// The list's columns. The cache counts add every process's rows (one indexed lookup per
/// invocation, by the table's primary key) to what an older gantry stored in the row.
const HEADER: &str = "invocation_id, build_id, owner, command, started_unix_ms, finished_unix_ms, exit_code, \
    exit_name, target_count, failed_targets, patterns, user_name, instance_name, \
    CAST(cache_lookups + COALESCE((SELECT SUM(c.lookups) FROM invocation_cache_counts c \
        WHERE c.invocation_id = invocations.invocation_id), 0) AS BIGINT), \
    CAST(cache_hits + COALESCE((SELECT SUM(c.hits) FROM invocation_cache_counts c \
        WHERE c.invocation_id = invocations.invocation_id), 0) AS BIGINT)";

fn header(row: &sqlx::any::AnyRow) -> std::result::Result<Invocation, sqlx::Error> {
    let patterns: String = row.try_get(10)?;
    Ok(Invocation {
        id: row.try_get(0)?,
        build_id: row.try_get(1)?,
        owner: row.try_get(2)?,
        command: row.try_get(3)?,
        started_unix_ms: row.try_get(4)?,
        finished_unix_ms: row.try_get(5)?,
        exit_code: row.try_get::<i64, _>(6)? as i32,
        exit_name: row.try_get(7)?,
        target_count: row.try_get::<i64, _>(8)?.max(0) as u64,
        failed_targets: row.try_get::<i64, _>(9)?.max(0) as u64,
        patterns: serde_json::from_str(&patterns).map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
        user: row.try_get(11)?,
        instance: row.try_get(12)?,
        cache_lookups: row.try_get::<i64, _>(13)?.max(0) as u64,
        cache_hits: row.try_get::<i64, _>(14)?.max(0) as u64,
        ..Default::default()
    })
}

#[async_trait]
impl InvocationStore for SqlInvocationStore {
    async fn put(&self, inv: &Invocation) -> Result<()> {
        let doc = Document {
            v: DOCUMENT_VERSION,
            options: inv.options.clone(),
            metadata: inv.metadata.clone(),
            targets: inv
                .targets
                .iter()
                .map(|t| TargetDoc { label: t.label.clone(), kind: t.kind.clone(), success: t.success })
                .collect(),
            tests: inv
                .tests
                .iter()
                .map(|t| TestDoc {
                    label: t.label.clone(),
                    run: t.run,
                    shard: t.shard,
                    attempt: t.attempt,
                    status: t.status.clone(),
                    duration_ms: t.duration_ms,
                    cached_locally: t.cached_locally,
                    logs: t.logs.clone(),
                })
                .collect(),
            critical_path: inv.critical_path.clone(),
        };
        let document = serde_json::to_string(&doc).map_err(|e| Error::internal(format!("invocation document: {e}")))?;
        let patterns =
            serde_json::to_string(&inv.patterns).map_err(|e| Error::internal(format!("invocation patterns: {e}")))?;
        self.db.write("writing an invocation", Write::new(
            "INSERT INTO invocations (invocation_id, build_id, owner, command, started_unix_ms, finished_unix_ms,
                exit_code, exit_name, target_count, failed_targets, patterns, document, user_name, instance_name,
                cache_lookups, cache_hits)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, 0, 0)
             ON CONFLICT (invocation_id) DO UPDATE SET build_id = excluded.build_id, owner = excluded.owner,
                command = excluded.command, started_unix_ms = excluded.started_unix_ms,
                finished_unix_ms = excluded.finished_unix_ms, exit_code = excluded.exit_code,
                exit_name = excluded.exit_name, target_count = excluded.target_count,
                failed_targets = excluded.failed_targets, patterns = excluded.patterns, document = excluded.document,
                user_name = excluded.user_name, instance_name = excluded.instance_name",
        )        .bind(&inv.id)
        .bind(&inv.build_id)
        .bind(&inv.owner)
        .bind(&inv.command)
        .bind(inv.started_unix_ms)
        .bind(inv.finished_unix_ms)
        .bind(i64::from(inv.exit_code))
        .bind(&inv.exit_name)
        .bind(inv.targets.len() as i64)
        .bind(inv.targets.iter().filter(|t| t.success == Some(false)).count() as i64)
        .bind(&patterns)
        .bind(&document)
        .bind(Invocation::user_of(&inv.owner, &inv.metadata))
        .bind(Invocation::instance_of(&inv.options))).await?;
        Ok(())
    }

    async fn get(&self, id: &str) -> Result<Option<Invocation>> {
        let row = sqlx::query(&format!("SELECT {HEADER}, document FROM invocations WHERE invocation_id = $1"))
            .bind(id)
            .fetch_optional(self.db.pool())
            .await
            .map_err(self.db.err("reading an invocation"))?;
        let Some(row) = row else { return Ok(None) };
        let undecodable = |e: String| Error::internal(format!("invocations: undecodable row {id}: {e}"));
        let mut inv = header(&row).map_err(|e| undecodable(e.to_string()))?;
        let document: String = row.try_get(15).map_err(|e| undecodable(e.to_string()))?;
        let doc: Document = serde_json::from_str(&document).map_err(|e| undecodable(e.to_string()))?;
        if doc.v != DOCUMENT_VERSION {
            return Err(undecodable(format!("document version {} (this gantry reads {DOCUMENT_VERSION})", doc.v)));
        }
        inv.options = doc.options;
        inv.metadata = doc.metadata;
        inv.critical_path = doc.critical_path;
        inv.targets = doc
            .targets
            .into_iter()
            .map(|t| TargetOutcome { label: t.label, kind: t.kind, success: t.success })
            .collect();
        inv.tests = doc
            .tests
            .into_iter()
            .map(|t| TestOutcome {
                label: t.label,
                run: t.run,
                shard: t.shard,
                attempt: t.attempt,
                status: t.status,
                duration_ms: t.duration_ms,
                cached_locally: t.cached_locally,
                logs: t.logs,
            })
            .collect();
        Ok(Some(inv))
    }

    async fn list(&self, limit: usize, before_unix_ms: Option<i64>) -> Result<Vec<Invocation>> {
        let rows = sqlx::query(&format!(
            "SELECT {HEADER} FROM invocations WHERE started_unix_ms < $1 ORDER BY started_unix_ms DESC LIMIT $2"
        ))
        .bind(before_unix_ms.unwrap_or(i64::MAX))
        .bind(limit.min(i64::MAX as usize) as i64)
        .fetch_all(self.db.pool())
        .await
        .map_err(self.db.err("listing invocations"))?;
        rows.iter()
            .map(header)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::internal(format!("invocations: undecodable row: {e}")))
    }

    async fn record_cache_counts(&self, process: &str, counts: &[CacheCounts]) -> Result<()> {
        if counts.is_empty() {
            return Ok(());
        }
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        let what = "recording remote cache counts";
        let mut tx = self.db.writer().begin().await.map_err(self.db.err(what))?;
        for c in counts {
            sqlx::query(
                "INSERT INTO invocation_cache_counts (invocation_id, process_id, lookups, hits, updated_unix_ms)
                 VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (invocation_id, process_id) DO UPDATE SET lookups = excluded.lookups,
                    hits = excluded.hits, updated_unix_ms = excluded.updated_unix_ms",
            )
            .bind(&c.invocation)
            .bind(process)
            .bind(c.lookups.min(i64::MAX as u64) as i64)
            .bind(c.hits.min(i64::MAX as u64) as i64)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(self.db.err(what))?;
        }
        tx.commit().await.map_err(self.db.err(what))?;
        Ok(())
    }
}
