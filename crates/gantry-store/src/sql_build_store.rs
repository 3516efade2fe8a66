//! `SqlBuildStore`: the batching service's builds as a table in the metadata database,
//! in the portable SQL of `sql_action_cache.rs`.
//! Each build is one row, replaced whole by an upsert, so a crash leaves either the old
//! or the new record, never a mix.

use async_trait::async_trait;
use gantry_core::{BuildQuery, BuildRow, BuildStore, Error, Result};
use sqlx::Row;

use crate::{metadata_db::Write, MetadataDb};

pub struct SqlBuildStore {
    db: MetadataDb,
}

impl SqlBuildStore {
    pub fn new(db: MetadataDb) -> Self {
        SqlBuildStore { db }
    }
}

fn decode(row: &sqlx::any::AnyRow) -> std::result::Result<BuildRow, sqlx::Error> {
    Ok(BuildRow {
        id: row.try_get(0)?,
        stream_id: row.try_get(1)?,
        parent_id: row.try_get(2)?,
        state: row.try_get(3)?,
        created_unix_ms: row.try_get(4)?,
        finished_unix_ms: row.try_get(5)?,
        document: row.try_get(6)?,
    })
}

const COLUMNS: &str = "build_id, stream_id, parent_id, state, created_unix_ms, finished_unix_ms, document";

#[async_trait]
impl BuildStore for SqlBuildStore {
    async fn put(&self, r: &BuildRow) -> Result<()> {
        self.db.write("writing a build", Write::new(
            "INSERT INTO batch_builds (build_id, stream_id, parent_id, state, created_unix_ms, finished_unix_ms, document)
             VALUES ($1, $2, $3, $4, $5, $6, $7)
             ON CONFLICT (build_id) DO UPDATE SET stream_id = excluded.stream_id, parent_id = excluded.parent_id,
                state = excluded.state, created_unix_ms = excluded.created_unix_ms,
                finished_unix_ms = excluded.finished_unix_ms, document = excluded.document",
        )        .bind(&r.id)
        .bind(&r.stream_id)
        .bind(&r.parent_id)
        .bind(&r.state)
        .bind(r.created_unix_ms)
        .bind(r.finished_unix_ms)
        .bind(&r.document)).await?;
        Ok(())
    }

    async fn get(&self, id: &str) -> Result<Option<BuildRow>> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM batch_builds WHERE build_id = $1"))
            .bind(id)
            .fetch_optional(self.db.pool())
            .await
            .map_err(self.db.err("reading a build"))?;
        row.as_ref().map(decode).transpose().map_err(|e| Error::internal(format!("batch_builds: undecodable row: {e}")))
    }

    async fn list(&self, q: &BuildQuery) -> Result<Vec<BuildRow>> {
        // Bind parameters in a fixed order; absent filters compare against NULL-safe defaults.
        let mut sql = format!("SELECT {COLUMNS} FROM batch_builds WHERE 1 = 1");
        let mut n = 0;
        let mut next = || {
            n += 1;
            format!("${n}")
        };
        if q.stream_id.is_some() {
            sql += &format!(" AND stream_id = {}", next());
        }
        if q.unfinished_only {
            sql += " AND state <> 'DONE'";
        }
        if q.finished_since_unix_ms.is_some() {
            sql += &format!(" AND finished_unix_ms IS NOT NULL AND finished_unix_ms >= {}", next());
        }
        // The cursor compares (created, id), the listing's own order, so the index on
        // both serves it and no row is skipped or repeated between pages.
        let cmp = if q.oldest_first { ">" } else { "<" };
        if q.after.is_some() {
            let (t, id) = (next(), next());
            sql += &format!(" AND (created_unix_ms {cmp} {t} OR (created_unix_ms = {t} AND build_id {cmp} {id}))");
        }
        sql += if q.oldest_first {
            " ORDER BY created_unix_ms ASC, build_id ASC"
        } else {
            " ORDER BY created_unix_ms DESC, build_id DESC"
        };
        if q.limit > 0 {
            sql += &format!(" LIMIT {}", next());
        }
        let mut query = sqlx::query(&sql);
        if let Some(s) = &q.stream_id {
            query = query.bind(s.clone());
        }
        if let Some(t) = q.finished_since_unix_ms {
            query = query.bind(t);
        }
        if let Some((t, id)) = &q.after {
            query = query.bind(*t).bind(id.clone());
        }
        if q.limit > 0 {
            query = query.bind(q.limit as i64);
        }
        let rows = query.fetch_all(self.db.pool()).await.map_err(self.db.err("listing builds"))?;
        rows.iter()
            .map(decode)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::internal(format!("batch_builds: undecodable row: {e}")))
    }
}
