//! `SqlActionCache` (`[action_cache] kind = "sql"`): ActionResults as rows in the
//! metadata database (`MetadataDb`), SQLite or PostgreSQL.
//!
//! The statements of every SQL store use only portable SQL (`$n` placeholders,
//! `INSERT ... ON CONFLICT`), so one code path serves both dialects; what differs lives in
//! `metadata_db.rs`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use gantry_core::reapi::ActionResult;
use gantry_core::{ActionCache, Digest, Error, Result};
use prost::Message;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{metadata_db::Write, MetadataDb};

pub struct SqlActionCache {
    db: MetadataDb,
    /// Entries written longer ago than this are misses (`[retention.action_cache]
    /// max_age`); zero: no limit.
    max_age: Duration,
}

impl SqlActionCache {
    /// The action cache in `db`, whose migrations created its table.
    pub fn new(db: MetadataDb) -> Self {
        SqlActionCache { db, max_age: Duration::ZERO }
    }

    /// Serves no entry older than `max_age` (zero: any age), so an entry past its
    /// retention is a miss at once, not only once the retention task has deleted it.
    pub fn with_max_age(mut self, max_age: Duration) -> Self {
        self.max_age = max_age;
        self
    }
}

impl SqlActionCache {
    /// The oldest `updated_at` (seconds) served now.
    fn oldest_served(&self) -> i64 {
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0);
        crate::retention::cutoff(now_ms, self.max_age, 1000).unwrap_or(i64::MIN)
    }
}

#[async_trait]
impl ActionCache for SqlActionCache {
    async fn get(&self, instance: &str, action: &Digest) -> Result<Option<ActionResult>> {
        let row: Option<AnyRow> = sqlx::query(
            "SELECT result FROM action_cache
             WHERE instance_name = $1 AND digest_function = $2 AND action_hash = $3 AND action_size = $4
                AND updated_at >= $5",
        )
        .bind(instance)
        .bind(action.function.name())
        .bind(action.hash_hex())
        .bind(action.size as i64)
        .bind(self.oldest_served())
        .fetch_optional(self.db.pool())
        .await
        .map_err(self.db.err("reading an action cache entry"))?;
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
        self.db.write("writing an action cache entry", Write::new(
            "INSERT INTO action_cache (instance_name, digest_function, action_hash, action_size, result, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (instance_name, digest_function, action_hash, action_size)
             DO UPDATE SET result = excluded.result, updated_at = excluded.updated_at",
        )        .bind(instance)
        .bind(action.function.name())
        .bind(action.hash_hex())
        .bind(action.size as i64)
        .bind(result.encode_to_vec())
        .bind(now)).await?;
        Ok(())
    }

    async fn check(&self) -> Result<()> {
        sqlx::query("SELECT COUNT(*) FROM action_cache")
            .fetch_one(self.db.pool())
            .await
            .map_err(self.db.err("action cache startup check"))?;
        Ok(())
    }
}
