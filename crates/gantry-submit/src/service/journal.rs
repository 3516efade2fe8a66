//! The queue's durable record: the change, build and landing documents as stored, and the
//! journal that feeds the planner.
//!
//! They live together because a restart depends on them agreeing. Every planner input is
//! appended to the journal before the planner sees it, and the actions it answers with are
//! carried out idempotently (a build already recorded is not recorded again, a rejection
//! is an upsert), so replaying the whole journal at startup rebuilds the planner and leaves
//! the documents as they were.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use gantry_core::task::spawn_named;
use gantry_core::{LandingRow, QueueDocRow};
use gantry_queue::{Action, BuildSpec, Event, Millis, PlannerConfig};
use serde::{Deserialize, Serialize};

use super::{Inner, QueueService, Result};
use crate::git::Patch;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ChangeState {
    Submitted,
    Pending,
    Landed,
    Rejected,
    Cancelled,
}

impl ChangeState {
    pub(crate) fn name(self) -> &'static str {
        match self {
            ChangeState::Submitted => "SUBMITTED",
            ChangeState::Pending => "PENDING",
            ChangeState::Landed => "LANDED",
            ChangeState::Rejected => "REJECTED",
            ChangeState::Cancelled => "CANCELLED",
        }
    }

    pub(crate) fn decided(self) -> bool {
        matches!(self, ChangeState::Landed | ChangeState::Rejected | ChangeState::Cancelled)
    }
}

/// A change as stored.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChangeDoc {
    pub id: String,
    pub seq: i64,
    pub change_ref: String,
    pub commit: String,
    pub merge_base: String,
    pub priority: i32,
    pub author: String,
    pub state: ChangeState,
    pub reason: String,
    pub submitted_ms: i64,
    pub decided_ms: Option<i64>,
    pub landed_commit: String,
    pub landed_version: u64,
    pub affected: Vec<String>,
    /// Affected rules (what `bazel test` is given); empty with `full_build`.
    pub test_targets: Vec<String>,
    pub alters_graph: bool,
    /// Test all of `//...`: the graph changed, or the analysis failed.
    pub full_build: bool,
}

impl ChangeDoc {
    pub(super) fn patch(&self) -> Patch {
        Patch {
            merge_base: self.merge_base.clone(),
            head: self.commit.clone(),
            name: format!("{} ({})", self.id, self.change_ref),
        }
    }
}

/// A build as stored.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BuildDoc {
    pub spec: BuildSpec,
    /// RUNNING, PASSED, FAILED or CANCELLED.
    pub state: String,
    pub commit: String,
    pub targets: Vec<String>,
    pub started_ms: i64,
    pub finished_ms: Option<i64>,
    pub message: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(super) struct LandingDoc {
    pub(super) build_id: u64,
    /// "fast-forward", "same-tree" or "verified"; or the queue's planner config on version 0.
    pub(super) how: String,
    pub(super) landed_ms: i64,
    pub(super) message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) planner_config: Option<PlannerConfig>,
}

pub(super) fn doc_row<T: Serialize>(id: &str, seq: i64, state: &str, doc: &T) -> Result<QueueDocRow> {
    Ok(QueueDocRow { id: id.to_string(), seq, state: state.to_string(), document: serde_json::to_string(doc)? })
}

impl QueueService {
    pub(super) async fn replay(self: &Arc<Self>) -> Result<()> {
        let events = self.store.list_events().await?;
        let mut inner = self.inner.lock().await;
        for row in &events {
            let event: Event = serde_json::from_str(&row.event)?;
            if let Event::Enqueue { change, .. } = &event
                && let Some(doc) = inner.changes.get_mut(&change.0)
                && doc.state == ChangeState::Submitted
            {
                // Enqueued, but the crash came before the document said so.
                doc.state = ChangeState::Pending;
            }
            inner.last_ms = inner.last_ms.max(row.at_ms as u64);
            match inner.planner.handle(Millis(row.at_ms as u64), event) {
                Ok(actions) => self.execute(&mut inner, actions, true).await,
                Err(e) => {
                    tracing::warn!(seq = row.seq, error = %e, "journal event refused on replay, as it was when applied")
                }
            }
        }
        // Before any build restarts: a landing failure it missed may cancel some.
        self.reconcile_landings(&mut inner).await?;
        // Builds the planner still counts as running died with the previous process.
        let running: BTreeSet<u64> = inner.planner.running_builds().iter().map(|b| b.id.0).collect();
        for (id, doc) in inner.builds.iter_mut() {
            if doc.state == "RUNNING" && !running.contains(id) {
                doc.state = "CANCELLED".into();
                self.store.put_build(&doc_row(&id.to_string(), *id as i64, &doc.state, doc)?).await?;
            }
        }
        for spec in inner.planner.running_builds() {
            if inner.tasks.contains_key(&spec.id.0) {
                continue; // started just now, by the reconciliation
            }
            tracing::info!(build = %spec.id, change = %spec.change, "restarting a build interrupted by the restart");
            let guard = spawn_named("queue-build", self.clone().run_build(spec.clone()));
            inner.tasks.insert(spec.id.0, guard);
        }
        let capacity = self.settings.capacity;
        if inner.planner.config().capacity != capacity {
            self.apply(&mut inner, Event::SetCapacity { capacity }, None).await?;
        }
        for doc in inner.changes.values().cloned().collect::<Vec<_>>() {
            self.store.put_change(&doc_row(&doc.id, doc.seq, doc.state.name(), &doc)?).await?;
        }
        if !events.is_empty() {
            tracing::info!(
                events = events.len(),
                pending = inner.planner.pending().len(),
                "submit queue resumed from its journal"
            );
        }
        self.wake_analyzer.notify_one();
        Ok(())
    }

    /// Journals an event, feeds it to the planner and carries out the actions.
    pub(super) async fn apply(self: &Arc<Self>, inner: &mut Inner, event: Event, dedup: Option<String>) -> Result<()> {
        let now = inner.tick();
        let text = serde_json::to_string(&event)?;
        if !self.store.append_event(now as i64, dedup.as_deref(), &text).await? {
            return Ok(());
        }
        let actions = inner.planner.handle(Millis(now), event)?;
        self.execute(inner, actions, false).await;
        self.updates.send_modify(|n| *n += 1);
        Ok(())
    }

    /// Carries out planner actions. Idempotent, so a replay can run them again; on
    /// replay builds are only recorded (the survivors are restarted afterwards).
    async fn execute(self: &Arc<Self>, inner: &mut Inner, actions: Vec<Action>, replay: bool) {
        for action in actions {
            if let Err(e) = self.execute_one(inner, action, replay).await {
                tracing::error!(error = %e, "carrying out a queue action");
            }
        }
    }

    async fn execute_one(self: &Arc<Self>, inner: &mut Inner, action: Action, replay: bool) -> Result<()> {
        match action {
            Action::StartBuild { build } => {
                let id = build.id.0;
                if !inner.builds.contains_key(&id) {
                    let doc = BuildDoc {
                        spec: build.clone(),
                        state: "RUNNING".into(),
                        commit: String::new(),
                        targets: Vec::new(),
                        started_ms: inner.last_ms as i64,
                        finished_ms: None,
                        message: String::new(),
                    };
                    self.store.put_build(&doc_row(&id.to_string(), id as i64, "RUNNING", &doc)?).await?;
                    inner.builds.insert(id, doc);
                }
                if !replay {
                    inner.tasks.insert(id, spawn_named("queue-build", self.clone().run_build(build)));
                }
            }
            Action::CancelBuild { id } => {
                inner.tasks.remove(&id.0);
                let now = inner.last_ms as i64;
                if let Some(doc) = inner.builds.get_mut(&id.0)
                    && doc.state == "RUNNING"
                {
                    doc.state = "CANCELLED".into();
                    doc.finished_ms = Some(now);
                    self.store.put_build(&doc_row(&id.0.to_string(), id.0 as i64, "CANCELLED", doc)?).await?;
                }
            }
            Action::Land { change, proof } => {
                // The lander records and reconciles; it skips versions already done.
                let _ = self.land_tx.send((change, proof));
            }
            Action::Reject { change, reason } => {
                let build = inner.builds.get(&reason.build.id.0);
                let why = build.map(|b| b.message.clone()).unwrap_or_default();
                let on = if reason.build.assumed.is_empty() {
                    format!("mainline version {}", reason.build.base_version)
                } else {
                    let assumed: Vec<&str> = reason.build.assumed.iter().map(|c| c.0.as_str()).collect();
                    format!("mainline version {} + {}", reason.build.base_version, assumed.join(" + "))
                };
                let now = inner.last_ms as i64;
                if let Some(doc) = inner.changes.get_mut(&change.0)
                    && !doc.state.decided()
                {
                    doc.state = ChangeState::Rejected;
                    doc.reason = format!("build {} on {on} failed {} time(s): {why}", reason.build.id, reason.attempts);
                    doc.decided_ms = Some(now);
                    self.store.put_change(&doc_row(&doc.id, doc.seq, doc.state.name(), doc)?).await?;
                }
            }
        }
        Ok(())
    }
}

/// Commit of each mainline version, up to the first landing still in progress. A
/// landing that failed leaves the mainline where it was, so its version is that commit.
pub(super) fn versions_of(landings: &BTreeMap<u64, LandingRow>) -> Vec<String> {
    let mut v = Vec::new();
    for (&version, r) in landings {
        if version != v.len() as u64 {
            break;
        }
        match r.state.as_str() {
            "DONE" => v.push(r.new_commit.clone()),
            "FAILED" => v.push(r.old_commit.clone()),
            _ => break,
        }
    }
    v
}
