//! The batching service's build records: the storage trait only. The service owns the
//! record's meaning and keeps it as a JSON document; a store only needs the few columns
//! it indexes (stream, parent, state, times), so a backend never depends on batching types.

use async_trait::async_trait;

use crate::Result;

/// One build as stored: indexed columns plus the service's document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildRow {
    pub id: String,
    pub stream_id: String,
    /// The build this one retries (an OOM split half or a deadline rerun).
    pub parent_id: Option<String>,
    /// "QUEUED", "RUNNING" or "DONE"; the store does not interpret it beyond filtering.
    pub state: String,
    pub created_unix_ms: i64,
    /// Set once the build reached a final outcome.
    pub finished_unix_ms: Option<i64>,
    /// The service's full record (JSON).
    pub document: String,
}

/// Which rows `BuildStore::list` returns.
#[derive(Debug, Clone, Default)]
pub struct BuildQuery {
    pub stream_id: Option<String>,
    /// Only rows whose state is not "DONE".
    pub unfinished_only: bool,
    /// Only rows finished at or after this time (implies finished rows).
    pub finished_since_unix_ms: Option<i64>,
    /// Most rows returned; 0 means no limit.
    pub limit: usize,
    /// Oldest first (by creation) instead of newest first.
    pub oldest_first: bool,
    /// Only the rows listed after the row with this `(created_unix_ms, id)` in the order
    /// asked: the next page after a page that ended there. Both parts, because split
    /// halves are created in the same millisecond and a page may end between them.
    pub after: Option<(i64, String)>,
}

#[async_trait]
pub trait BuildStore: Send + Sync + 'static {
    /// Inserts or replaces the row with this id, atomically.
    async fn put(&self, row: &BuildRow) -> Result<()>;
    async fn get(&self, id: &str) -> Result<Option<BuildRow>>;
    async fn list(&self, query: &BuildQuery) -> Result<Vec<BuildRow>>;
}
