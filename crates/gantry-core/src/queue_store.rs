//! The submit queue's durable state: the storage trait only. The queue service owns the
//! meaning of every record and keeps changes and builds as JSON documents; a store only
//! knows the few columns it keys and orders by, so a backend never depends on queue types.
//!
//! Four kinds of record:
//! - **changes**: one row per submitted change, replaced whole on every state change;
//! - **events**: the planner's input journal, append-only; replaying it rebuilds the
//!   planner exactly (the planner is deterministic), so a restart resumes where it was.
//!   An event may carry a `dedup_key`; appending a second event with the same key is a
//!   no-op, so a retried append never duplicates a change or a build result;
//! - **landings**: one row per mainline version (the intent to move the branch, then its
//!   outcome), so a crash between "move the ref" and "record it" is reconciled at startup;
//! - **builds** and per-commit **graphs** (the conflict analyzer's cache);
//! - **snapshots**: the planner's saved state as of one journal entry, so the entries
//!   before it, and the history the planner has forgotten, can be deleted (retention).

use async_trait::async_trait;

use crate::Result;

/// One stored document with the columns a store indexes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueDocRow {
    pub id: String,
    /// Ordering key (submission sequence for changes, build number for builds).
    pub seq: i64,
    /// The service's state name; the store only returns it.
    pub state: String,
    pub document: String,
}

/// One journal entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueEventRow {
    /// Assigned by the store on append, increasing.
    pub seq: i64,
    /// The planner clock at which the event was applied.
    pub at_ms: i64,
    pub dedup_key: Option<String>,
    /// The planner event (JSON).
    pub event: String,
}

/// One mainline version: the branch moved from `old_commit` to `new_commit` for `change_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LandingRow {
    pub version: i64,
    pub change_id: String,
    pub old_commit: String,
    pub new_commit: String,
    /// "INTENT" (about to move the ref), "DONE", or "FAILED" (the ref did not move).
    pub state: String,
    /// The service's details (JSON).
    pub document: String,
}

/// The planner's saved state as of journal entry `seq` (that entry applied).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSnapshotRow {
    pub seq: i64,
    /// The planner clock after entry `seq`.
    pub at_ms: i64,
    /// The planner's saved state (text the queue service owns).
    pub state: String,
}

/// History rows a queue's retention deletes.
#[derive(Debug, Clone, Copy)]
pub enum QueueForget<'a> {
    /// Up to `limit` journal entries before `seq`, the oldest first, and the snapshots
    /// before `seq`: a snapshot at `seq` covers them. The entry at `seq` stays, so the
    /// journal's numbering goes on from it.
    EventsBefore { seq: i64, limit: u64 },
    /// Changes, by id.
    Changes(&'a [String]),
    /// Builds, by id.
    Builds(&'a [String]),
    /// Landings, by version.
    Landings(&'a [i64]),
    /// Cached graphs but the `keep` stored last.
    GraphsBeyond { keep: u64 },
}

#[async_trait]
pub trait QueueStore: Send + Sync + 'static {
    /// Inserts or replaces a change, atomically.
    async fn put_change(&self, row: &QueueDocRow) -> Result<()>;
    async fn get_change(&self, id: &str) -> Result<Option<QueueDocRow>>;
    /// All changes in `seq` order.
    async fn list_changes(&self) -> Result<Vec<QueueDocRow>>;
    /// One page of changes, newest (highest `seq`) first: those whose state is one of
    /// `states` (any state when empty) and whose `seq` is below `before_seq` when given,
    /// at most `limit` (0: no limit). The default reads every change; stores override it
    /// to read only the page, so a long history does not slow the web pages down.
    async fn list_changes_page(
        &self,
        states: &[&str],
        before_seq: Option<i64>,
        limit: usize,
    ) -> Result<Vec<QueueDocRow>> {
        let mut rows: Vec<QueueDocRow> = self
            .list_changes()
            .await?
            .into_iter()
            .filter(|r| states.is_empty() || states.contains(&r.state.as_str()))
            .filter(|r| before_seq.is_none_or(|b| r.seq < b))
            .collect();
        rows.sort_by(|a, b| b.seq.cmp(&a.seq).then_with(|| b.id.cmp(&a.id)));
        if limit > 0 {
            rows.truncate(limit);
        }
        Ok(rows)
    }
    /// Appends to the journal; returns false (and writes nothing) when an event with the
    /// same `dedup_key` is already there.
    async fn append_event(&self, at_ms: i64, dedup_key: Option<&str>, event: &str) -> Result<bool>;
    /// The whole journal in append order.
    async fn list_events(&self) -> Result<Vec<QueueEventRow>>;
    /// The journal's entries after `after_seq`, in append order: what a reader that has
    /// applied the journal up to there still needs. The default reads the whole journal;
    /// stores override it.
    async fn list_events_after(&self, after_seq: i64) -> Result<Vec<QueueEventRow>> {
        Ok(self.list_events().await?.into_iter().filter(|e| e.seq > after_seq).collect())
    }
    /// Inserts or replaces the landing of one version, atomically.
    async fn put_landing(&self, row: &LandingRow) -> Result<()>;
    /// All landings by version.
    async fn list_landings(&self) -> Result<Vec<LandingRow>>;
    /// Inserts or replaces a build, atomically.
    async fn put_build(&self, row: &QueueDocRow) -> Result<()>;
    /// All builds in `seq` order.
    async fn list_builds(&self) -> Result<Vec<QueueDocRow>>;
    /// The builds whose `seq` is at least `from_seq`, in `seq` order: the recent ones
    /// (build numbers only grow). The default reads every build; stores override it.
    async fn list_builds_from(&self, from_seq: i64) -> Result<Vec<QueueDocRow>> {
        Ok(self.list_builds().await?.into_iter().filter(|r| r.seq >= from_seq).collect())
    }
    /// The sequence number of the journal's newest entry (0 when it never had one).
    async fn last_event_seq(&self) -> Result<i64>;
    /// Stores a snapshot, atomically; an older one may be kept until `forget` drops it.
    async fn put_snapshot(&self, row: &QueueSnapshotRow) -> Result<()>;
    /// The newest snapshot.
    async fn latest_snapshot(&self) -> Result<Option<QueueSnapshotRow>>;
    /// Deletes history rows; returns how many went.
    async fn forget(&self, what: QueueForget<'_>) -> Result<u64>;
    /// Caches a commit's target graph (JSON); the same commit always has the same graph.
    async fn put_graph(&self, commit: &str, graph: &str) -> Result<()>;
    async fn get_graph(&self, commit: &str) -> Result<Option<String>>;
}
