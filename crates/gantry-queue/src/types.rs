//! Vocabulary shared by the planner, the simulator and the integrator:
//! identifiers, time, events in and actions out.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::conflict::ChangeAnalysis;
use crate::model::ChangeFeatures;

/// Integrator-chosen identifier of a change (e.g. a review id).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ChangeId(pub String);

impl fmt::Display for ChangeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for ChangeId {
    fn from(s: &str) -> Self {
        ChangeId(s.to_string())
    }
}

impl From<String> for ChangeId {
    fn from(s: String) -> Self {
        ChangeId(s)
    }
}

/// Planner-chosen identifier of a build; unique for the planner's lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BuildId(pub u64);

impl fmt::Display for BuildId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "b{}", self.0)
    }
}

/// Milliseconds on the integrator's clock. Only differences and ordering matter;
/// the planner never reads a clock itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Millis(pub u64);

/// What a build tests: `change` applied on top of the first `base_version`
/// changes of the planner's mainline, plus the still-pending changes in
/// `assumed` (in queue order), which the build speculates will land.
///
/// The tested tree is therefore `mainline[..base_version] ⊕ assumed ⊕ change`.
/// `base_version` is an index into [`crate::Planner::mainline`]; the integrator
/// maps it to its commit id (version 0 is the mainline head when the planner started).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildSpec {
    /// Identifier used in later `BuildFinished` events and `CancelBuild` actions.
    pub id: BuildId,
    /// The change whose build steps are run.
    pub change: ChangeId,
    /// Number of landed changes the base includes.
    pub base_version: u64,
    /// Pending changes assumed to land before `change`, in queue order.
    pub assumed: Vec<ChangeId>,
    /// 1 for the first try of this assumption set; higher for flaky-failure retries.
    pub attempt: u32,
}

/// Result of a build, as reported by the integrator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BuildOutcome {
    /// All build steps passed.
    Passed,
    /// Some build step failed (possibly flakily).
    Failed,
    /// The tree could not even be made or failed for a reason no retry can
    /// change (the change's patch does not apply on it). Counts as a
    /// confirmed failure of this tree at once: retrying it would only waste
    /// a build slot.
    FailedConclusively,
}

fn is_zero(p: &i32) -> bool {
    *p == 0
}

/// Inputs to the planner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Event {
    /// A developer enqueued a change. Queue order is enqueue order, except
    /// that a change goes ahead of the dependent changes of lower `priority`.
    Enqueue {
        /// New change id.
        change: ChangeId,
        /// Model features.
        features: ChangeFeatures,
        /// Conflict analysis against the current mainline; `None` means unknown,
        /// which makes the change dependent on every other change.
        analysis: Option<ChangeAnalysis>,
        /// Higher is more urgent. The change is ordered before every pending
        /// change of lower priority that depends on it (and the ones behind
        /// those that depend on them); those are re-queued behind it and
        /// their builds, which did not include it, are cancelled. Changes it
        /// is independent of keep their place and their builds. Equal
        /// priorities keep enqueue order.
        #[serde(default, skip_serializing_if = "is_zero")]
        priority: i32,
    },
    /// A build started by a `StartBuild` action finished.
    BuildFinished {
        /// The build.
        build: BuildId,
        /// Its outcome.
        outcome: BuildOutcome,
        /// When the build failed, the targets whose build steps failed, if the
        /// integrator knows them (per-target test results). It must be
        /// complete: a target that did not run to a pass (skipped after an
        /// earlier failure, say, without `--keep_going`) counts as failed.
        /// `None`: unknown, so the whole tree failed. With batching, a member
        /// change whose affected targets are all outside this set passed on
        /// the tree (attribution), even though the tree as a whole failed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        failed_targets: Option<Vec<String>>,
    },
    /// The developer withdrew a pending change.
    Cancel {
        /// The withdrawn change.
        change: ChangeId,
    },
    /// The integrator could not move the mainline for a `Land` action (its
    /// final check of the combined tree failed, or the branch moved outside
    /// the queue). The change counts as rejected; its mainline version stays
    /// as a version without it (same tree as the one before), so versions
    /// already handed out keep their meaning.
    LandingFailed {
        /// The change whose landing failed.
        change: ChangeId,
    },
    /// A build's test runner retried these targets within the build and they
    /// passed on a later attempt (Bazel's FLAKY status): each had a failure
    /// that passed on the same tree, which the flaky-target records count.
    FlakyTargets {
        /// The targets.
        targets: Vec<String>,
    },
    /// The build farm's capacity changed. Lowering it cancels nothing:
    /// running builds finish and no new ones start until below capacity.
    SetCapacity {
        /// New number of concurrent build slots.
        capacity: usize,
    },
}

/// Evidence attached to every `Land`: the build that proved the change.
///
/// Check: `build.assumed` ⊆ landed changes ∪ `omitted`, every change in
/// `landed_since_base` was proven independent of `change`, and then the new
/// mainline tree equals the tested tree up to those independent changes and
/// without the omitted ones.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LandProof {
    /// The passing build whose tree decides the change.
    pub build: BuildSpec,
    /// Mainline version after this landing (`mainline.len()`).
    pub new_version: u64,
    /// Changes that landed after the build's base and are not in `assumed`;
    /// all are independent of the landing change (parallel lanes). Empty means
    /// the new mainline tree is exactly the tested tree.
    pub landed_since_base: Vec<ChangeId>,
    /// A batch landing: every change that lands on this build's tree in the same
    /// mainline move, in queue order (`build.assumed` still pending, then
    /// `build.change`). The integrator applies them all and moves the mainline
    /// once, after the last, so it only ever points at the tree that passed;
    /// each change keeps its own commit in history, but the commits inside the
    /// batch were not built on their own. Empty for a change decided by a build
    /// of its own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batch: Vec<ChangeId>,
    /// Only with batching, which assumes failures are monotone (removing a
    /// change from a tree never breaks it): changes of the tested tree that
    /// are not on the mainline this change lands on, because they were
    /// rejected or cancelled, come after it in queue order (the build was of
    /// a later change and this change's own targets passed on it), or are
    /// independent of it and still pending.
    /// Empty: the landed tree is the tested one (up to `landed_since_base`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub omitted: Vec<ChangeId>,
    /// The change's own build steps passed on the tree although the tree as a
    /// whole failed (another member's targets failed: see
    /// `Event::BuildFinished::failed_targets`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub by_attribution: bool,
}

/// Why a change was rejected.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectReason {
    /// The last failing build; its assumptions equal the real outcome of every
    /// earlier dependent change, so its base is (up to independent changes) the mainline.
    pub build: BuildSpec,
    /// How many times that exact assumption set failed (retries included).
    pub attempts: u32,
}

/// Outputs of the planner, to be executed by the integrator in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    /// Start a build of the tree described by the spec.
    StartBuild {
        /// What to build.
        build: BuildSpec,
    },
    /// Stop a running build; its result is no longer useful.
    CancelBuild {
        /// The build to stop.
        id: BuildId,
    },
    /// Push the change to the mainline.
    Land {
        /// The landing change.
        change: ChangeId,
        /// The build that proved it.
        proof: LandProof,
    },
    /// Reject the change back to its author.
    Reject {
        /// The rejected change.
        change: ChangeId,
        /// The decisive failing build.
        reason: RejectReason,
    },
}
