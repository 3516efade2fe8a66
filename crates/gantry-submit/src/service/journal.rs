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

/// A state enum whose stored form is a fixed string. The macro is the one place where a
/// variant and its string are paired: the rows' `state` column, the documents' JSON and the
/// API all use them, and rows written by earlier versions must keep reading, so the strings
/// never change and are never spelled out anywhere else.
macro_rules! stored_state {
    ($(#[$meta:meta])* $vis:vis enum $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        $vis enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every state, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The stored string.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownState;

            fn from_str(s: &str) -> std::result::Result<Self, UnknownState> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(UnknownState { kind: stringify!($name), text: s.to_string() }),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
                s.parse().map_err(|_| serde::de::Error::unknown_variant(&s, &[$($text),+]))
            }
        }
    };
}

/// A stored state string that no state enum knows.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {text:?}")]
pub struct UnknownState {
    kind: &'static str,
    text: String,
}

stored_state! {
    pub enum ChangeState {
        Submitted = "SUBMITTED",
        Pending = "PENDING",
        Landed = "LANDED",
        Rejected = "REJECTED",
        Cancelled = "CANCELLED",
    }
}

impl ChangeState {
    pub(crate) fn decided(self) -> bool {
        matches!(self, ChangeState::Landed | ChangeState::Rejected | ChangeState::Cancelled)
    }
}

stored_state! {
    /// A queue build's state.
    pub enum BuildState {
        Running = "RUNNING",
        Passed = "PASSED",
        /// Failed, whether conclusively or not: the planner keeps the difference.
        Failed = "FAILED",
        /// Cancelled by the planner, or found running at a start without the planner
        /// counting it as running.
        Cancelled = "CANCELLED",
    }
}

stored_state! {
    /// A landing's state, in `LandingRow::state` (a string in the store's row, which
    /// does not interpret it).
    pub enum LandingState {
        /// About to move the mainline: recorded before the compare-and-swap.
        Intent = "INTENT",
        Done = "DONE",
        /// The mainline did not move.
        Failed = "FAILED",
    }
}

impl LandingState {
    /// A landing row's state; `None` for a string no version wrote, which every reader
    /// treats like an intent (not finished).
    pub(super) fn of(row: &LandingRow) -> Option<LandingState> {
        row.state.parse().ok()
    }

    /// The landing is over, whether the mainline moved or not.
    pub(super) fn finished(self) -> bool {
        matches!(self, LandingState::Done | LandingState::Failed)
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
    /// Change number `seq` (id `c{seq}`), just submitted as `change_ref`, before its
    /// commits are resolved or anything is known of it.
    pub(super) fn submitted(seq: i64, change_ref: &str, submitted_ms: i64) -> ChangeDoc {
        ChangeDoc {
            id: format!("c{seq}"),
            seq,
            change_ref: change_ref.to_string(),
            commit: String::new(),
            merge_base: String::new(),
            priority: 0,
            author: String::new(),
            state: ChangeState::Submitted,
            reason: String::new(),
            submitted_ms,
            decided_ms: None,
            landed_commit: String::new(),
            landed_version: 0,
            affected: vec![],
            test_targets: vec![],
            alters_graph: false,
            full_build: false,
        }
    }

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
    pub state: BuildState,
    pub commit: String,
    pub targets: Vec<String>,
    pub started_ms: i64,
    pub finished_ms: Option<i64>,
    pub message: String,
    /// See `Finished::failed_targets`; empty when unknown.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed_targets: Vec<String>,
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
        let mut inner = self.inner.lock().await;
        let events = self.store.list_events_after(inner.snapshot_seq).await?;
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
            if doc.state == BuildState::Running && !running.contains(id) {
                doc.state = BuildState::Cancelled;
                self.store.put_build(&doc_row(&id.to_string(), *id as i64, doc.state.as_str(), doc)?).await?;
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
            self.store.put_change(&doc_row(&doc.id, doc.seq, doc.state.as_str(), &doc)?).await?;
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
                        state: BuildState::Running,
                        commit: String::new(),
                        targets: Vec::new(),
                        started_ms: inner.last_ms as i64,
                        finished_ms: None,
                        message: String::new(),
                        failed_targets: Vec::new(),
                    };
                    self.store.put_build(&doc_row(&id.to_string(), id as i64, doc.state.as_str(), &doc)?).await?;
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
                    && doc.state == BuildState::Running
                {
                    doc.state = BuildState::Cancelled;
                    doc.finished_ms = Some(now);
                    self.store.put_build(&doc_row(&id.0.to_string(), id.0 as i64, doc.state.as_str(), doc)?).await?;
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
                    self.store.put_change(&doc_row(&doc.id, doc.seq, doc.state.as_str(), doc)?).await?;
                }
            }
        }
        Ok(())
    }
}

/// The commit of each mainline version the queue still remembers: from `first` on, up
/// to the first landing still in progress. Retention deletes the landings of versions no
/// build can still start from, so after it `first` is the oldest version kept (version
/// 0, the mainline when the queue was created, stays for its settings but is then no
/// longer contiguous with the rest).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Versions {
    first: u64,
    commits: Vec<String>,
}

impl Versions {
    /// The commit of `version`, when it is remembered and its landing is over.
    pub(super) fn get(&self, version: u64) -> Option<&String> {
        version.checked_sub(self.first).and_then(|k| self.commits.get(usize::try_from(k).ok()?))
    }

    /// The mainline's newest version's commit.
    pub(super) fn last(&self) -> Option<&String> {
        self.commits.last()
    }

    /// How many versions exist up to the newest finished one: the next one's number.
    pub(super) fn count(&self) -> u64 {
        self.first + self.commits.len() as u64
    }
}

/// The versions of `landings`. A landing that failed leaves the mainline where it was, so
/// its version is that commit.
pub(super) fn versions_of(landings: &BTreeMap<u64, LandingRow>) -> Versions {
    // After retention the rows are version 0 and then a run starting past 1.
    let first = match landings.keys().find(|&&v| v > 0) {
        Some(&v) if v > 1 => v,
        _ => 0,
    };
    let mut v = Versions { first, commits: Vec::new() };
    for (&version, r) in landings.range(first..) {
        if version != v.count() {
            break;
        }
        match LandingState::of(r) {
            Some(LandingState::Done) => v.commits.push(r.new_commit.clone()),
            Some(LandingState::Failed) => v.commits.push(r.old_commit.clone()),
            _ => break,
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_keep_the_strings_already_stored() {
        assert_eq!(
            ChangeState::ALL.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
            ["SUBMITTED", "PENDING", "LANDED", "REJECTED", "CANCELLED"]
        );
        assert_eq!(
            BuildState::ALL.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
            ["RUNNING", "PASSED", "FAILED", "CANCELLED"]
        );
        assert_eq!(LandingState::ALL.iter().map(|s| s.as_str()).collect::<Vec<_>>(), ["INTENT", "DONE", "FAILED"]);
        for &s in ChangeState::ALL {
            assert_eq!(s.as_str().parse(), Ok(s));
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{s}\""));
        }
        for &s in BuildState::ALL {
            assert_eq!(s.as_str().parse(), Ok(s));
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{s}\""));
        }
        for &s in LandingState::ALL {
            assert_eq!(s.as_str().parse(), Ok(s));
        }
        assert!("landed".parse::<ChangeState>().is_err());
        assert!(serde_json::from_str::<BuildState>("\"DONE\"").is_err());
    }

    #[test]
    fn documents_written_before_the_state_enums_read_and_write_back_byte_for_byte() {
        let change = r#"{"id":"c3","seq":3,"change_ref":"feature","commit":"abc","merge_base":"def","priority":0,"author":"dev@example.com","state":"PENDING","reason":"","submitted_ms":1000,"decided_ms":null,"landed_commit":"","landed_version":0,"affected":["//a:a"],"test_targets":["//a:a_test"],"alters_graph":false,"full_build":false}"#;
        let doc: ChangeDoc = serde_json::from_str(change).unwrap();
        assert_eq!(doc.state, ChangeState::Pending);
        assert_eq!(serde_json::to_string(&doc).unwrap(), change);
        let build = r#"{"spec":{"id":7,"change":"c3","base_version":2,"assumed":["c1"],"attempt":1},"state":"RUNNING","commit":"","targets":[],"started_ms":1000,"finished_ms":null,"message":""}"#;
        let doc: BuildDoc = serde_json::from_str(build).unwrap();
        assert_eq!(doc.state, BuildState::Running);
        assert_eq!(serde_json::to_string(&doc).unwrap(), build);
        let row = doc_row("7", 7, doc.state.as_str(), &doc).unwrap();
        assert_eq!((row.state.as_str(), row.document.as_str()), ("RUNNING", build));
    }
}
