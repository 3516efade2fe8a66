//! `SqlQueueStore`: the submit queue's state as tables in the metadata database, in the
//! portable SQL of `sql_action_cache.rs`. Every write is one statement on one row, so a
//! crash leaves the old or the new record, never a mix; journal appends are keyed so that
//! a repeated append is a no-op, and run in a transaction that holds the journal alone,
//! so concurrent appenders (tasks, or processes on one PostgreSQL) get distinct,
//! gap-free sequence numbers in commit order.

use async_trait::async_trait;
use gantry_core::{Error, LandingRow, QueueDocRow, QueueEventRow, QueueForget, QueueSnapshotRow, QueueStore, Result};
use sqlx::{Executor, Row};

use crate::metadata_db::{now_ms, Write};
use crate::MetadataDb;

pub struct SqlQueueStore {
    db: MetadataDb,
}

fn undecodable(table: &str) -> impl FnOnce(sqlx::Error) -> Error + '_ {
    move |e| Error::internal(format!("{table}: undecodable row: {e}"))
}

impl SqlQueueStore {
    pub fn new(db: MetadataDb) -> Self {
        SqlQueueStore { db }
    }

    /// Changes and builds share one shape; `table` is one of our two constant names.
    async fn put_doc(&self, table: &'static str, r: &QueueDocRow) -> Result<()> {
        self.db
            .write(
                table,
                Write::new(format!(
                    "INSERT INTO {table} (id, seq, state, document) VALUES ($1, $2, $3, $4)
             ON CONFLICT (id) DO UPDATE SET seq = excluded.seq, state = excluded.state, document = excluded.document"
                ))
                .bind(&r.id)
                .bind(r.seq)
                .bind(&r.state)
                .bind(&r.document),
            )
            .await?;
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
        self.fetch_docs(table, q).await
    }

    async fn fetch_docs<'q>(
        &self,
        table: &'static str,
        q: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>,
    ) -> Result<Vec<QueueDocRow>> {
        let rows = q.fetch_all(self.db.pool()).await.map_err(self.db.err(table))?;
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

    async fn list_changes_page(
        &self,
        states: &[&str],
        before_seq: Option<i64>,
        limit: usize,
    ) -> Result<Vec<QueueDocRow>> {
        // Walks the seq index from the newest end and stops at the page's last row.
        let mut sql = "SELECT id, seq, state, document FROM queue_changes WHERE 1 = 1".to_string();
        let mut n = 0;
        let mut next = || {
            n += 1;
            format!("${n}")
        };
        if !states.is_empty() {
            let marks: Vec<String> = states.iter().map(|_| next()).collect();
            sql += &format!(" AND state IN ({})", marks.join(", "));
        }
        if before_seq.is_some() {
            sql += &format!(" AND seq < {}", next());
        }
        sql += " ORDER BY seq DESC, id DESC";
        if limit > 0 {
            sql += &format!(" LIMIT {}", next());
        }
        let mut q = sqlx::query(&sql);
        for s in states {
            q = q.bind(s.to_string());
        }
        if let Some(b) = before_seq {
            q = q.bind(b);
        }
        if limit > 0 {
            q = q.bind(limit as i64);
        }
        self.fetch_docs("queue_changes", q).await
    }

    async fn append_event(&self, at_ms: i64, dedup_key: Option<&str>, event: &str) -> Result<bool> {
        // The sequence number is taken inside the insert, and the transaction first makes
        // itself the journal's only writer (a no-op on SQLite, which serialises writers):
        // two PostgreSQL transactions could otherwise both read the same MAX(seq).
        // `WHERE true` lets SQLite parse the upsert clause after a SELECT.
        let err = self.db.err("appending to the journal");
        let mut tx = match self.db.writer().begin().await {
            Ok(tx) => tx,
            Err(e) => return Err(err(e)),
        };
        if let Some(lock) = self.db.dialect().lock_for_append("queue_events")
            && let Err(e) = tx.execute(lock.as_str()).await
        {
            return Err(err(e));
        }
        let done = sqlx::query(
            "INSERT INTO queue_events (seq, at_ms, dedup_key, event)
             SELECT COALESCE(MAX(seq), 0) + 1, $1, $2, $3 FROM queue_events WHERE true
             ON CONFLICT (dedup_key) DO NOTHING",
        )
        .bind(at_ms)
        .bind(dedup_key.map(str::to_string))
        .bind(event)
        .execute(&mut *tx)
        .await;
        let done = match done {
            Ok(d) => d,
            Err(e) => return Err(err(e)),
        };
        tx.commit().await.map_err(err)?;
        Ok(done.rows_affected() == 1)
    }

    async fn list_events(&self) -> Result<Vec<QueueEventRow>> {
        self.list_events_after(i64::MIN).await
    }

    async fn list_events_after(&self, after_seq: i64) -> Result<Vec<QueueEventRow>> {
        let rows = sqlx::query("SELECT seq, at_ms, dedup_key, event FROM queue_events WHERE seq > $1 ORDER BY seq ASC")
            .bind(after_seq)
            .fetch_all(self.db.pool())
            .await
            .map_err(self.db.err("reading the journal"))?;
        rows.iter()
            .map(|r| {
                Ok(QueueEventRow {
                    seq: r.try_get(0)?,
                    at_ms: r.try_get(1)?,
                    dedup_key: r.try_get(2)?,
                    event: r.try_get(3)?,
                })
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(undecodable("queue_events"))
    }

    async fn put_landing(&self, r: &LandingRow) -> Result<()> {
        self.db
            .write(
                "writing a landing",
                Write::new(
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
                .bind(&r.document),
            )
            .await?;
        Ok(())
    }

    async fn list_landings(&self) -> Result<Vec<LandingRow>> {
        let rows = sqlx::query(
            "SELECT version, change_id, old_commit, new_commit, state, document FROM queue_landings ORDER BY version ASC",
        )
        .fetch_all(self.db.pool())
        .await
        .map_err(self.db.err("reading landings"))?;
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

    async fn list_builds_from(&self, from_seq: i64) -> Result<Vec<QueueDocRow>> {
        let q =
            sqlx::query("SELECT id, seq, state, document FROM queue_builds WHERE seq >= $1 ORDER BY seq ASC, id ASC")
                .bind(from_seq);
        self.fetch_docs("queue_builds", q).await
    }

    async fn last_event_seq(&self) -> Result<i64> {
        sqlx::query_scalar::<_, i64>("SELECT COALESCE(MAX(seq), 0) FROM queue_events")
            .fetch_one(self.db.pool())
            .await
            .map_err(self.db.err("reading the journal's end"))
    }

    async fn put_snapshot(&self, r: &QueueSnapshotRow) -> Result<()> {
        self.db
            .write(
                "saving the queue's planner",
                Write::new(
                    "INSERT INTO queue_snapshots (seq, at_ms, state) VALUES ($1, $2, $3)
                     ON CONFLICT (seq) DO UPDATE SET at_ms = excluded.at_ms, state = excluded.state",
                )
                .bind(r.seq)
                .bind(r.at_ms)
                .bind(&r.state),
            )
            .await?;
        Ok(())
    }

    async fn latest_snapshot(&self) -> Result<Option<QueueSnapshotRow>> {
        let row = sqlx::query("SELECT seq, at_ms, state FROM queue_snapshots ORDER BY seq DESC LIMIT 1")
            .fetch_optional(self.db.pool())
            .await
            .map_err(self.db.err("reading the queue's planner snapshot"))?;
        row.map(|r| Ok(QueueSnapshotRow { seq: r.try_get(0)?, at_ms: r.try_get(1)?, state: r.try_get(2)? }))
            .transpose()
            .map_err(undecodable("queue_snapshots"))
    }

    async fn forget(&self, what: QueueForget<'_>) -> Result<u64> {
        // Long id lists go a chunk per statement, so no statement outgrows a backend's
        // limit on bound parameters.
        const CHUNK: usize = 500;
        let marks = |n: usize| (1..=n).map(|i| format!("${i}")).collect::<Vec<_>>().join(", ");
        let mut deleted = 0;
        match what {
            QueueForget::EventsBefore { seq, limit } => {
                // By sequence number, the oldest first: a crash part-way leaves a
                // journal that is whole from some entry on.
                deleted += self
                    .db
                    .write(
                        "deleting journal entries",
                        Write::new(
                            "DELETE FROM queue_events WHERE seq IN
                             (SELECT seq FROM queue_events WHERE seq < $1 ORDER BY seq ASC LIMIT $2)",
                        )
                        .bind(seq)
                        .bind(i64::try_from(limit).unwrap_or(i64::MAX)),
                    )
                    .await?;
                deleted += self
                    .db
                    .write("deleting old snapshots", Write::new("DELETE FROM queue_snapshots WHERE seq < $1").bind(seq))
                    .await?;
            }
            QueueForget::Changes(ids) | QueueForget::Builds(ids) => {
                let table = if matches!(what, QueueForget::Changes(_)) { "queue_changes" } else { "queue_builds" };
                for chunk in ids.chunks(CHUNK) {
                    let mut w = Write::new(format!("DELETE FROM {table} WHERE id IN ({})", marks(chunk.len())));
                    for id in chunk {
                        w = w.bind(id.clone());
                    }
                    deleted += self.db.write(format!("deleting from {table}"), w).await?;
                }
            }
            QueueForget::GraphsBeyond { keep } => {
                // Older than the newest `keep` (graphs stored in the same millisecond
                // as the last one kept stay too).
                deleted += self
                    .db
                    .write(
                        "deleting cached graphs",
                        Write::new(
                            "DELETE FROM queue_graphs WHERE stored_ms <
                             (SELECT stored_ms FROM queue_graphs ORDER BY stored_ms DESC LIMIT 1 OFFSET $1)",
                        )
                        .bind(i64::try_from(keep.saturating_sub(1)).unwrap_or(i64::MAX)),
                    )
                    .await?;
            }
            QueueForget::Landings(versions) => {
                for chunk in versions.chunks(CHUNK) {
                    let mut w =
                        Write::new(format!("DELETE FROM queue_landings WHERE version IN ({})", marks(chunk.len())));
                    for v in chunk {
                        w = w.bind(*v);
                    }
                    deleted += self.db.write("deleting landings", w).await?;
                }
            }
        }
        Ok(deleted)
    }

    async fn put_graph(&self, commit: &str, graph: &str) -> Result<()> {
        self.db
            .write(
                "caching a target graph",
                Write::new(
                    "INSERT INTO queue_graphs (commit_id, graph, stored_ms) VALUES ($1, $2, $3)
                     ON CONFLICT (commit_id) DO NOTHING",
                )
                .bind(commit)
                .bind(graph)
                .bind(now_ms()),
            )
            .await?;
        Ok(())
    }

    async fn get_graph(&self, commit: &str) -> Result<Option<String>> {
        let row = sqlx::query("SELECT graph FROM queue_graphs WHERE commit_id = $1")
            .bind(commit)
            .fetch_optional(self.db.pool())
            .await
            .map_err(self.db.err("reading a target graph"))?;
        row.map(|r| r.try_get(0)).transpose().map_err(undecodable("queue_graphs"))
    }
}
