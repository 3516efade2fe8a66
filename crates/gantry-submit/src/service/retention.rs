//! The queue's retention (`[retention] queue_journal` and `[retention.queue]`): the
//! journal is cut at a snapshot of the planner, and the history past its bounds is
//! deleted, so a queue that runs for years keeps a database, a memory and a restart the
//! size of its recent work.
//!
//! Every `interval`, one pass:
//! 1. **Snapshot.** When `queue_journal` entries have been appended since the last
//!    snapshot and every effect of the journal so far is carried out (`settled`: every
//!    landing over and told, every record in step with the planner), a copy of the
//!    planner forgets the decided changes nothing refers to any more and is saved as of
//!    the journal's newest entry; the copy replaces the planner once the snapshot is
//!    stored. All of it happens under the queue's lock. A restart restores it and
//!    replays only what follows.
//! 2. **Journal.** The entries before the snapshot go, `batch_size` per statement, the
//!    oldest first. The snapshot's own entry stays, so the journal's numbering goes on.
//! 3. **History**, only when settled too (no landing under way). Decided changes older
//!    than `max_age`, or the oldest past `max_rows`,
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

use super::journal::{versions_of, ChangeState, LandingState};
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
                let since = last - inner.snapshot_seq;
                if since >= r.journal as i64 {
                    if settled(&inner) {
                        // Forgotten on a copy, kept only once a snapshot covers it: what
                        // the planner forgets, the history below may delete.
                        let mut planner = inner.planner.clone();
                        let forgotten = planner.forget_decided();
                        let state = planner.save_state()?;
                        let row = QueueSnapshotRow { seq: last, at_ms: inner.last_ms as i64, state };
                        self.store.put_snapshot(&row).await?;
                        inner.planner = planner;
                        inner.snapshot_seq = last;
                        (out.snapshot, out.forgotten) = (Some(last), forgotten);
                    } else if since >= 3 * r.journal as i64 {
                        // Normally a landing under way, over in seconds; this long means a
                        // record failed to write (a restart's replay writes it again).
                        tracing::warn!(
                            since_snapshot = since,
                            "queue retention: no snapshot, the queue's records are not in step with its planner"
                        );
                    }
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
            // Not while a landing is under way: it reads its build's record and the
            // version it starts from.
            if !settled(&inner) {
                return Ok(out);
            }
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

/// Whether every effect of the journal so far is carried out, so that a snapshot taken
/// now needs no action of an earlier entry carried out again (a restart replays only
/// what follows it) and no landing is under way:
/// - every landing the planner asked for is over, and a failed one told to it;
/// - every change's record agrees with the planner: a Pending one is pending there (its
///   Land or Reject was recorded), a Submitted one unknown to it (its Enqueue was
///   recorded, so that entry's dedup key is no longer needed);
/// - every build the planner runs has its record.
fn settled(inner: &Inner) -> bool {
    let versions = versions_of(&inner.landings);
    versions.count() == inner.planner.versions() + 1
        && inner.landings.values().all(|row| {
            LandingState::of(row) != Some(LandingState::Failed)
                || !inner.planner.is_landed(&ChangeId(row.change_id.clone()))
        })
        && inner.changes.values().all(|c| {
            let id = ChangeId(c.id.clone());
            match c.state {
                ChangeState::Pending => inner.planner.is_pending(&id),
                ChangeState::Submitted => inner.planner.enqueued_at(&id).is_none(),
                _ => true,
            }
        })
        && inner.planner.running_builds().iter().all(|b| inner.builds.contains_key(&b.id.0))
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
    // The newest finished version stays whatever the bounds: the next landing starts
    // from it.
    let newest = versions_of(&inner.landings).count().saturating_sub(1);
    let landings: Vec<i64> = inner
        .landings
        .range(1..oldest_base.min(newest).max(1))
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

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use gantry_core::LandingRow;
    use gantry_queue::{Action, BuildId, BuildOutcome, ChangeFeatures, Event, Millis, Planner, PlannerConfig};

    use super::*;
    use crate::service::journal::ChangeDoc;

    fn doc(id: &str, seq: i64, state: ChangeState) -> ChangeDoc {
        let doc = ChangeDoc::submitted(seq, id, seq);
        assert_eq!(doc.id, id);
        ChangeDoc { state, decided_ms: state.decided().then_some(seq), ..doc }
    }

    fn landing(version: i64, change: &str, state: LandingState) -> LandingRow {
        LandingRow {
            version,
            change_id: change.into(),
            old_commit: format!("commit{}", version - 1),
            new_commit: format!("commit{version}"),
            state: state.as_str().into(),
            document: String::new(),
        }
    }

    fn pass(planner: &mut Planner, i: u64) {
        let enqueue = Event::Enqueue {
            change: ChangeId(format!("c{i}")),
            features: ChangeFeatures::default(),
            analysis: None,
            priority: 0,
        };
        let acts = planner.handle(Millis(10 * i), enqueue).unwrap();
        let Some(Action::StartBuild { build }) = acts.first() else { panic!("{acts:?}") };
        let done =
            Event::BuildFinished { build: BuildId(build.id.0), outcome: BuildOutcome::Passed, failed_targets: None };
        let acts = planner.handle(Millis(10 * i + 5), done).unwrap();
        assert!(matches!(acts.first(), Some(Action::Land { .. })), "{acts:?}");
    }

    /// A queue whose planner landed c1..c3 (versions 1..3) and was asked to land c4 as
    /// version 4, with every record written up to there.
    fn queue() -> Inner {
        let mut planner = Planner::new(PlannerConfig { capacity: 1, max_retries: 0, ..PlannerConfig::default() });
        let mut changes = BTreeMap::new();
        let mut landings = BTreeMap::new();
        landings.insert(0, landing(0, "", LandingState::Done));
        for i in 1..=4u64 {
            pass(&mut planner, i);
            let id = format!("c{i}");
            let landed = i < 4;
            changes.insert(
                id.clone(),
                doc(&id, i as i64, if landed { ChangeState::Landed } else { ChangeState::Pending }),
            );
            if landed {
                landings.insert(i, landing(i as i64, &id, LandingState::Done));
            }
        }
        Inner {
            planner,
            changes,
            builds: BTreeMap::new(),
            tasks: HashMap::new(),
            landings,
            last_ms: 100,
            snapshot_seq: 0,
            forgotten_landing_failures: 0,
        }
    }

    #[test]
    fn nothing_is_settled_while_a_landing_is_under_way_and_the_version_it_starts_from_stays() {
        let mut inner = queue();
        assert!(!settled(&inner), "c4's landing as version 4 is under way");
        // The landing finishes: records in step, so a snapshot may be taken.
        inner.landings.insert(4, landing(4, "c4", LandingState::Done));
        inner.changes.get_mut("c4").unwrap().state = ChangeState::Landed;
        assert!(settled(&inner));
        // A Reject or Land whose record was not written: not settled.
        inner.changes.insert("c9".into(), doc("c9", 9, ChangeState::Pending));
        assert!(!settled(&inner), "c9 is Pending on record and unknown to the planner");
        inner.changes.remove("c9");

        // c5 passes and its landing as version 5 starts; meanwhile everything is past
        // the bounds and the planner forgot c1..c5. All but the newest change (c5: ids
        // are numbered from it) go, with their landings, except version 4, which c5's
        // landing starts from.
        pass(&mut inner.planner, 5);
        inner.changes.insert("c5".into(), doc("c5", 5, ChangeState::Pending));
        assert_eq!(inner.planner.forget_decided(), 5);
        let bounds = QueueRetention {
            interval: Duration::from_secs(1),
            batch_size: 10,
            max_age: Duration::from_millis(1),
            max_rows: 1,
            journal: 1,
            graphs: 0,
        };
        let (changes, builds, landings) = history_to_forget(&mut inner, &bounds, 1_000_000);
        assert_eq!(changes, ["c1", "c2", "c3", "c4"]);
        assert!(builds.is_empty());
        assert_eq!(landings, [1, 2, 3], "version 4 stays: {:?}", inner.landings.keys().collect::<Vec<_>>());
        let versions = versions_of(&inner.landings);
        assert_eq!((versions.count(), versions.get(4).map(String::as_str)), (5, Some("commit4")));
    }
}
