//! `SqlBuildStore`: the batching service's builds as a table in the metadata database,
//! in the portable SQL of `sql_action_cache.rs` (SQLite now, PostgreSQL by URL).
//! Each build is one row, replaced whole by an upsert, so a crash leaves either the old
//! or the new record, never a mix.

use async_trait::async_trait;
use gantry_core::{BuildQuery, BuildRow, BuildStore, Error, Result};
use sqlx::{AnyPool, Executor, Row};

pub struct SqlBuildStore {
    pool: AnyPool,
}

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS batch_builds (
    build_id TEXT NOT NULL PRIMARY KEY,
    stream_id TEXT NOT NULL,
    parent_id TEXT,
    state TEXT NOT NULL,
    created_unix_ms BIGINT NOT NULL,
    finished_unix_ms BIGINT,
    document TEXT NOT NULL
)";

const INDEXES: [&str; 2] = [
    "CREATE INDEX IF NOT EXISTS batch_builds_stream ON batch_builds (stream_id, created_unix_ms)",
    "CREATE INDEX IF NOT EXISTS batch_builds_finished ON batch_builds (finished_unix_ms)",
];

fn db_err(what: &str) -> impl FnOnce(sqlx::Error) -> Error + '_ {
    move |e| Error::Unavailable(format!("build history database: {what}: {e}"))
}

impl SqlBuildStore {
    pub async fn new(pool: AnyPool) -> Result<Self> {
        pool.execute(SCHEMA).await.map_err(db_err("creating table batch_builds"))?;
        for index in INDEXES {
            pool.execute(index).await.map_err(db_err("creating index"))?;
        }
        Ok(SqlBuildStore { pool })
    }

    pub async fn connect(url: &str) -> Result<Self> {
        Self::new(crate::sql_execution_log::metadata_pool(url).await?).await
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
        sqlx::query(
            "INSERT INTO batch_builds (build_id, stream_id, parent_id, state, created_unix_ms, finished_unix_ms, document)
             VALUES ($1, $2, $3, $4, $5, $6, $7)
             ON CONFLICT (build_id) DO UPDATE SET stream_id = excluded.stream_id, parent_id = excluded.parent_id,
                state = excluded.state, created_unix_ms = excluded.created_unix_ms,
                finished_unix_ms = excluded.finished_unix_ms, document = excluded.document",
        )
        .bind(&r.id)
        .bind(&r.stream_id)
        .bind(&r.parent_id)
        .bind(&r.state)
        .bind(r.created_unix_ms)
        .bind(r.finished_unix_ms)
        .bind(&r.document)
        .execute(&self.pool)
        .await
        .map_err(db_err("writing a build"))?;
        Ok(())
    }

    async fn get(&self, id: &str) -> Result<Option<BuildRow>> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM batch_builds WHERE build_id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err("reading a build"))?;
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
        sql += if q.oldest_first { " ORDER BY created_unix_ms ASC, build_id ASC" } else { " ORDER BY created_unix_ms DESC, build_id DESC" };
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
        if q.limit > 0 {
            query = query.bind(q.limit as i64);
        }
        let rows = query.fetch_all(&self.pool).await.map_err(db_err("listing builds"))?;
        rows.iter()
            .map(decode)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::internal(format!("batch_builds: undecodable row: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, stream: &str, state: &str, created: i64, finished: Option<i64>) -> BuildRow {
        BuildRow {
            id: id.into(),
            stream_id: stream.into(),
            parent_id: (id == "b").then(|| "a".to_string()),
            state: state.into(),
            created_unix_ms: created,
            finished_unix_ms: finished,
            document: format!("{{\"id\":\"{id}\"}}"),
        }
    }

    #[tokio::test]
    async fn upsert_get_and_filter() {
        let s = SqlBuildStore::connect("sqlite::memory:").await.unwrap();
        assert_eq!(s.get("a").await.unwrap(), None);
        s.put(&row("a", "s1", "QUEUED", 10, None)).await.unwrap();
        s.put(&row("b", "s1", "RUNNING", 20, None)).await.unwrap();
        s.put(&row("c", "s2", "DONE", 30, Some(40))).await.unwrap();
        // Replacing a row keeps one row with the new state.
        s.put(&row("a", "s1", "DONE", 10, Some(50))).await.unwrap();
        assert_eq!(s.get("a").await.unwrap().unwrap().state, "DONE");
        assert_eq!(s.get("b").await.unwrap().unwrap().parent_id.as_deref(), Some("a"));

        let ids = |rows: Vec<BuildRow>| rows.into_iter().map(|r| r.id).collect::<Vec<_>>();
        assert_eq!(ids(s.list(&BuildQuery::default()).await.unwrap()), ["c", "b", "a"]);
        let q = BuildQuery { stream_id: Some("s1".into()), oldest_first: true, ..Default::default() };
        assert_eq!(ids(s.list(&q).await.unwrap()), ["a", "b"]);
        let q = BuildQuery { unfinished_only: true, ..Default::default() };
        assert_eq!(ids(s.list(&q).await.unwrap()), ["b"]);
        let q = BuildQuery { finished_since_unix_ms: Some(45), ..Default::default() };
        assert_eq!(ids(s.list(&q).await.unwrap()), ["a"]);
        let q = BuildQuery { limit: 1, stream_id: Some("s1".into()), finished_since_unix_ms: Some(0), ..Default::default() };
        assert_eq!(ids(s.list(&q).await.unwrap()), ["a"]);
    }
}
