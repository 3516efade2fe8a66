//! `SqlQueueStore`: the submit queue's state as tables in the metadata database, in the
//! portable SQL of `sql_action_cache.rs` (SQLite now, PostgreSQL by URL). Every write is
//! one statement on one row, so a crash leaves the old or the new record, never a mix;
//! journal appends are keyed so that a repeated append is a no-op.

use async_trait::async_trait;
use gantry_core::{Error, LandingRow, QueueDocRow, QueueEventRow, QueueStore, Result};
use sqlx::{AnyPool, Executor, Row};

pub struct SqlQueueStore {
    pool: AnyPool,
}

const SCHEMA: [&str; 5] = [
    "CREATE TABLE IF NOT EXISTS queue_changes (
        id TEXT NOT NULL PRIMARY KEY, seq BIGINT NOT NULL, state TEXT NOT NULL, document TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS queue_builds (
        id TEXT NOT NULL PRIMARY KEY, seq BIGINT NOT NULL, state TEXT NOT NULL, document TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS queue_events (
        seq BIGINT NOT NULL PRIMARY KEY, at_ms BIGINT NOT NULL, dedup_key TEXT UNIQUE, event TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS queue_landings (
        version BIGINT NOT NULL PRIMARY KEY, change_id TEXT NOT NULL, old_commit TEXT NOT NULL,
        new_commit TEXT NOT NULL, state TEXT NOT NULL, document TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS queue_graphs (commit_id TEXT NOT NULL PRIMARY KEY, graph TEXT NOT NULL)",
];

fn db_err(what: &str) -> impl FnOnce(sqlx::Error) -> Error + '_ {
    move |e| Error::Unavailable(format!("queue database: {what}: {e}"))
}

fn undecodable(table: &str) -> impl FnOnce(sqlx::Error) -> Error + '_ {
    move |e| Error::internal(format!("{table}: undecodable row: {e}"))
}

impl SqlQueueStore {
    pub async fn new(pool: AnyPool) -> Result<Self> {
        for stmt in SCHEMA {
            pool.execute(stmt).await.map_err(db_err("creating the queue tables"))?;
        }
        Ok(SqlQueueStore { pool })
    }

    pub async fn connect(url: &str) -> Result<Self> {
        Self::new(crate::sql_execution_log::metadata_pool(url).await?).await
    }

    /// Changes and builds share one shape; `table` is one of our two constant names.
    async fn put_doc(&self, table: &'static str, r: &QueueDocRow) -> Result<()> {
        sqlx::query(&format!(
            "INSERT INTO {table} (id, seq, state, document) VALUES ($1, $2, $3, $4)
             ON CONFLICT (id) DO UPDATE SET seq = excluded.seq, state = excluded.state, document = excluded.document"
        ))
        .bind(&r.id)
        .bind(r.seq)
        .bind(&r.state)
        .bind(&r.document)
        .execute(&self.pool)
        .await
        .map_err(db_err(table))?;
        Ok(())
    }

    async fn list_docs(&self, table: &'static str, id: Option<&str>) -> Result<Vec<QueueDocRow>> {
        let sql = match id {
            Some(_) => format!("SELECT id, seq, state, document FROM {table} WHERE id = $1"),
            None => format!("SELECT id, seq, state, document FROM {table} ORDER BY seq ASC, id ASC"),
        };
        let mut q = sqlx::query(&sql);
        if let Some(id) = id {
            q = q.bind(id.to_string());
        }
        let rows = q.fetch_all(&self.pool).await.map_err(db_err(table))?;
        rows.iter()
            .map(|r| {
                Ok(QueueDocRow { id: r.try_get(0)?, seq: r.try_get(1)?, state: r.try_get(2)?, document: r.try_get(3)? })
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(undecodable(table))
    }
}

#[async_trait]
impl QueueStore for SqlQueueStore {
    async fn put_change(&self, row: &QueueDocRow) -> Result<()> {
        self.put_doc("queue_changes", row).await
    }

    async fn get_change(&self, id: &str) -> Result<Option<QueueDocRow>> {
        Ok(self.list_docs("queue_changes", Some(id)).await?.pop())
    }

    async fn list_changes(&self) -> Result<Vec<QueueDocRow>> {
        self.list_docs("queue_changes", None).await
    }

    async fn append_event(&self, at_ms: i64, dedup_key: Option<&str>, event: &str) -> Result<bool> {
        // The sequence number is taken inside the insert, so there is no gap between
        // reading the last number and writing the next. `WHERE true` lets SQLite parse
        // the upsert clause after a SELECT.
        let done = sqlx::query(
            "INSERT INTO queue_events (seq, at_ms, dedup_key, event)
             SELECT COALESCE(MAX(seq), 0) + 1, $1, $2, $3 FROM queue_events WHERE true
             ON CONFLICT (dedup_key) DO NOTHING",
        )
        .bind(at_ms)
        .bind(dedup_key.map(str::to_string))
        .bind(event)
        .execute(&self.pool)
        .await
        .map_err(db_err("appending to the journal"))?;
        Ok(done.rows_affected() == 1)
    }

    async fn list_events(&self) -> Result<Vec<QueueEventRow>> {
        let rows = sqlx::query("SELECT seq, at_ms, dedup_key, event FROM queue_events ORDER BY seq ASC")
            .fetch_all(&self.pool)
            .await
            .map_err(db_err("reading the journal"))?;
        rows.iter()
            .map(|r| Ok(QueueEventRow { seq: r.try_get(0)?, at_ms: r.try_get(1)?, dedup_key: r.try_get(2)?, event: r.try_get(3)? }))
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(undecodable("queue_events"))
    }

    async fn put_landing(&self, r: &LandingRow) -> Result<()> {
        sqlx::query(
            "INSERT INTO queue_landings (version, change_id, old_commit, new_commit, state, document)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (version) DO UPDATE SET change_id = excluded.change_id, old_commit = excluded.old_commit,
                new_commit = excluded.new_commit, state = excluded.state, document = excluded.document",
        )
        .bind(r.version)
        .bind(&r.change_id)
        .bind(&r.old_commit)
        .bind(&r.new_commit)
        .bind(&r.state)
        .bind(&r.document)
        .execute(&self.pool)
        .await
        .map_err(db_err("writing a landing"))?;
        Ok(())
    }

    async fn list_landings(&self) -> Result<Vec<LandingRow>> {
        let rows = sqlx::query(
            "SELECT version, change_id, old_commit, new_commit, state, document FROM queue_landings ORDER BY version ASC",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(db_err("reading landings"))?;
        rows.iter()
            .map(|r| {
                Ok(LandingRow {
                    version: r.try_get(0)?,
                    change_id: r.try_get(1)?,
                    old_commit: r.try_get(2)?,
                    new_commit: r.try_get(3)?,
                    state: r.try_get(4)?,
                    document: r.try_get(5)?,
                })
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(undecodable("queue_landings"))
    }

    async fn put_build(&self, row: &QueueDocRow) -> Result<()> {
        self.put_doc("queue_builds", row).await
    }

    async fn list_builds(&self) -> Result<Vec<QueueDocRow>> {
        self.list_docs("queue_builds", None).await
    }

    async fn put_graph(&self, commit: &str, graph: &str) -> Result<()> {
        sqlx::query("INSERT INTO queue_graphs (commit_id, graph) VALUES ($1, $2) ON CONFLICT (commit_id) DO NOTHING")
            .bind(commit)
            .bind(graph)
            .execute(&self.pool)
            .await
            .map_err(db_err("caching a target graph"))?;
        Ok(())
    }

    async fn get_graph(&self, commit: &str) -> Result<Option<String>> {
        let row = sqlx::query("SELECT graph FROM queue_graphs WHERE commit_id = $1")
            .bind(commit)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err("reading a target graph"))?;
        row.map(|r| r.try_get(0)).transpose().map_err(undecodable("queue_graphs"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn journal_is_ordered_and_deduplicated() {
        let s = SqlQueueStore::connect("sqlite::memory:").await.unwrap();
        assert!(s.append_event(5, Some("enqueue:c1"), "{\"a\":1}").await.unwrap());
        assert!(s.append_event(6, None, "{\"b\":2}").await.unwrap());
        assert!(!s.append_event(7, Some("enqueue:c1"), "{\"a\":1}").await.unwrap(), "same key twice");
        assert!(s.append_event(8, None, "{\"c\":3}").await.unwrap());
        let ev = s.list_events().await.unwrap();
        assert_eq!(ev.iter().map(|e| (e.seq, e.at_ms)).collect::<Vec<_>>(), [(1, 5), (2, 6), (3, 8)]);
        assert_eq!(ev[0].dedup_key.as_deref(), Some("enqueue:c1"));
    }

    #[tokio::test]
    async fn documents_landings_and_graphs_round_trip() {
        let s = SqlQueueStore::connect("sqlite::memory:").await.unwrap();
        let doc = |id: &str, seq, state: &str| QueueDocRow { id: id.into(), seq, state: state.into(), document: format!("{{\"{id}\":0}}") };
        s.put_change(&doc("c2", 2, "PENDING")).await.unwrap();
        s.put_change(&doc("c1", 1, "PENDING")).await.unwrap();
        s.put_change(&doc("c1", 1, "LANDED")).await.unwrap();
        let ids: Vec<_> = s.list_changes().await.unwrap().into_iter().map(|r| (r.id, r.state)).collect();
        assert_eq!(ids, [("c1".to_string(), "LANDED".to_string()), ("c2".into(), "PENDING".into())]);
        assert_eq!(s.get_change("c2").await.unwrap().unwrap().state, "PENDING");
        assert_eq!(s.get_change("nope").await.unwrap(), None);
        s.put_build(&doc("b0", 0, "RUNNING")).await.unwrap();
        assert_eq!(s.list_builds().await.unwrap().len(), 1);
        let land = |state: &str| LandingRow {
            version: 1,
            change_id: "c1".into(),
            old_commit: "a".into(),
            new_commit: "b".into(),
            state: state.into(),
            document: "{}".into(),
        };
        s.put_landing(&land("INTENT")).await.unwrap();
        s.put_landing(&land("DONE")).await.unwrap();
        assert_eq!(s.list_landings().await.unwrap(), [land("DONE")]);
        s.put_graph("abc", "{\"targets\":{}}").await.unwrap();
        s.put_graph("abc", "ignored: a commit's graph never changes").await.unwrap();
        assert_eq!(s.get_graph("abc").await.unwrap().as_deref(), Some("{\"targets\":{}}"));
        assert_eq!(s.get_graph("def").await.unwrap(), None);
    }
}
