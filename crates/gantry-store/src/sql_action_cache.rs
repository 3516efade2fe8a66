//! `SqlActionCache` (`[action_cache] kind = "sql"`): ActionResults as rows in the
//! metadata database (`MetadataDb`), SQLite or PostgreSQL.
//!
//! The statements of every SQL store use only portable SQL (`$n` placeholders,
//! `INSERT ... ON CONFLICT`), so one code path serves both dialects; what differs lives in
//! `metadata_db.rs`.

use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use gantry_core::reapi::ActionResult;
use gantry_core::{ActionCache, Digest, Error, Result};
use prost::Message;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::MetadataDb;

pub struct SqlActionCache {
    db: MetadataDb,
}

impl SqlActionCache {
    /// The action cache in `db`, whose migrations created its table.
    pub fn new(db: MetadataDb) -> Self {
        SqlActionCache { db }
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
        .execute(self.db.pool())
        .await
        .map_err(self.db.err("writing an action cache entry"))?;
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

