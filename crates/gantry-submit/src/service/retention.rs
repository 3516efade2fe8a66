//! The queue's retention (`[retention] queue_journal` and `[retention.queue]`): the
//! journal is cut at a snapshot of the planner, and the history past its bounds is
//! deleted, so a queue that runs for years keeps a database, a memory and a restart the
//! size of its recent work.
//!
//! Every `interval`, one pass:
//! 1. **Snapshot.** When `queue_journal` entries have been appended since the last
//!    snapshot and every landing the planner asked for is over (its row finished, a
//!    failed one already told to the planner), the planner forgets the decided changes
//!    nothing refers to any more and is saved as of the journal's newest entry. All of it
//!    happens under the queue's lock, so the snapshot is of a state whose every action was
//!    carried out, except landings, which the condition covers. A restart restores it and
//!    replays only what follows.
//! 2. **Journal.** The entries before the snapshot go, `batch_size` per statement, the
//!    oldest first. The snapshot's own entry stays, so the journal's numbering goes on.
//! 3. **History.** Decided changes older than `max_age`, or the oldest past `max_rows`,
//!    once the planner has forgotten them; their landings, except those of versions a
//!    build the planner keeps may start from; and finished builds older than every build
//!    the planner keeps, by the same bounds. The newest change is always kept: change ids
//!    are numbered from it.
//! 4. **Graph cache.** Only the `queue_graphs` target graphs stored last stay; a change
//!    that needs an older one has it queried again.
//!
//! A crash between steps leaves rows a later pass deletes; the documents are removed from
//! memory first, and a restart reads back only what is still stored.

use std::sync::Arc;
use std::time::Duration;

use gantry_core::{QueueForget, QueueSnapshotRow};
use gantry_queue::ChangeId;

use super::journal::{versions_of, LandingState};
use super::{unix_ms, Inner, QueueService, Result};

/// `[retention]` as the queue applies it (gantry-config holds the defaults).
#[derive(Clone, Debug)]
pub struct QueueRetention {
    /// How often a pass runs.
    pub interval: Duration,
    /// Rows per delete statement.
    pub batch_size: u32,
    /// Decided changes and finished builds older than this go; zero: no age bound.
    pub max_age: Duration,
    /// At most this many changes, and this many builds; 0: no count bound.
    pub max_rows: u64,
    /// Journal entries between snapshots; 0: the journal is kept whole.
    pub journal: u64,
    /// Cached target graphs kept, the newest; 0: all.
    pub graphs: u64,
}

/// What one pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Retained {
    /// The journal entry a snapshot was taken at, if one was.
    pub snapshot: Option<i64>,
    /// Change records the planner forgot.
    pub forgotten: usize,
    /// Journal entries (and older snapshots) deleted.
    pub events: u64,
    pub changes: u64,
    pub builds: u64,
    pub landings: u64,
    pub graphs: u64,
}

impl QueueService {
    pub(super) async fn retention_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.settings.retention.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            if self.stopping() {
                return;
            }
            match self.retain().await {
                Ok(r) if r != Retained::default() => tracing::info!(
                    snapshot = ?r.snapshot,
                    forgotten = r.forgotten,
                    events = r.events,
                    changes = r.changes,
                    builds = r.builds,
                    landings = r.landings,
                    graphs = r.graphs,
                    "queue retention"
                ),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "queue retention"),
            }
        }
    }

    /// One retention pass (see the module docs).
    pub async fn retain(self: &Arc<Self>) -> Result<Retained> {
        let r = self.settings.retention.clone();
        let mut out = Retained::default();
        let snapshot_seq = {
            let mut inner = self.inner.lock().await;
            if r.journal > 0 {
                let last = self.store.last_event_seq().await?;
                if last - inner.snapshot_seq >= r.journal as i64 && landings_settled(&inner) {
                    out.forgotten = inner.planner.forget_decided();
                    let state = inner.planner.save_state()?;
                    let row = QueueSnapshotRow { seq: last, at_ms: inner.last_ms as i64, state };
                    self.store.put_snapshot(&row).await?;
                    inner.snapshot_seq = last;
                    out.snapshot = Some(last);
                }
            }
            inner.snapshot_seq
        };
        let batch = u64::from(r.batch_size.max(1));
        if snapshot_seq > 0 {
            loop {
                let n = self.store.forget(QueueForget::EventsBefore { seq: snapshot_seq, limit: batch }).await?;
                out.events += n;
                if n == 0 {
                    break;
                }
            }
        }
        let (changes, builds, landings) = {
            let mut inner = self.inner.lock().await;
            history_to_forget(&mut inner, &r, unix_ms())
        };
        for ids in changes.chunks(batch as usize) {
            out.changes += self.store.forget(QueueForget::Changes(ids)).await?;
        }
        for ids in builds.chunks(batch as usize) {
            out.builds += self.store.forget(QueueForget::Builds(ids)).await?;
        }
        for versions in landings.chunks(batch as usize) {
            out.landings += self.store.forget(QueueForget::Landings(versions)).await?;
        }
        if r.graphs > 0 {
            out.graphs = self.store.forget(QueueForget::GraphsBeyond { keep: r.graphs }).await?;
        }
        Ok(out)
    }
}

/// Whether every landing the planner asked for is over and told: a snapshot taken now
/// needs no `Land` action of an earlier journal entry to be carried out again.
fn landings_settled(inner: &Inner) -> bool {
    let versions = versions_of(&inner.landings);
    versions.count() == inner.planner.versions() + 1
        && inner.landings.values().all(|row| {
            LandingState::of(row) != Some(LandingState::Failed)
                || !inner.planner.is_landed(&ChangeId(row.change_id.clone()))
        })
}

/// The history past its bounds: removed from memory here, returned for the store.
fn history_to_forget(inner: &mut Inner, r: &QueueRetention, now_ms: i64) -> (Vec<String>, Vec<String>, Vec<i64>) {
    let cutoff = (!r.max_age.is_zero()).then(|| now_ms.saturating_sub(r.max_age.as_millis() as i64));
    // Oldest first, whatever is past the age bound, then the oldest past the count bound.
    let past = |candidates: Vec<(i64, String)>, total: usize| -> Vec<String> {
        let over = if r.max_rows == 0 { 0 } else { total.saturating_sub(r.max_rows as usize) };
        candidates
            .into_iter()
            .enumerate()
            .take_while(|(k, (at, _))| *k < over || cutoff.is_some_and(|c| *at < c))
            .map(|(_, (_, id))| id)
            .collect()
    };

    let newest = inner.changes.values().map(|c| c.seq).max();
    let mut candidates: Vec<(i64, String)> = inner
        .changes
        .values()
        .filter(|c| c.state.decided() && Some(c.seq) != newest)
        .filter(|c| inner.planner.enqueued_at(&ChangeId(c.id.clone())).is_none())
        .map(|c| (c.decided_ms.unwrap_or(c.submitted_ms), c.id.clone()))
        .collect();
    candidates.sort();
    let changes = past(candidates, inner.changes.len());
    for id in &changes {
        inner.changes.remove(id);
    }

    // A build the planner keeps may still start from its base version, or land from
    // its tested commit: nothing from the oldest of them on is forgotten.
    let kept = inner.planner.kept_builds();
    let (oldest_build, oldest_base) =
        kept.fold((u64::MAX, inner.planner.versions()), |(b, v), s| (b.min(s.id.0), v.min(s.base_version)));
    let mut candidates: Vec<(i64, String)> = inner
        .builds
        .iter()
        .filter(|&(&id, b)| id < oldest_build && b.state != super::BuildState::Running)
        .map(|(&id, b)| (b.finished_ms.unwrap_or(b.started_ms), id.to_string()))
        .collect();
    candidates.sort();
    let builds = past(candidates, inner.builds.len());
    for id in &builds {
        inner.builds.remove(&id.parse::<u64>().expect("numbered by us"));
    }

    // Version 0 keeps the queue's settings; the others go with their change, oldest
    // first and without a gap, so the versions remembered stay one run.
    let landings: Vec<i64> = inner
        .landings
        .range(1..oldest_base.max(1))
        .take_while(|(_, row)| {
            LandingState::of(row).is_some_and(LandingState::finished) && !inner.changes.contains_key(&row.change_id)
        })
        .map(|(&v, _)| v as i64)
        .collect();
    for v in &landings {
        if let Some(row) = inner.landings.remove(&(*v as u64))
            && LandingState::of(&row) == Some(LandingState::Failed)
        {
            inner.forgotten_landing_failures += 1;
        }
    }
    (changes, builds, landings)
}
