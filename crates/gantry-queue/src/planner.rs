//! The planner: a pure, deterministic state machine driven by [`Event`]s.
//!
//! Every call to [`Planner::handle`] applies one event at a caller-supplied
//! time and returns the [`Action`]s to execute. Given the same events and
//! times, the planner produces the same actions, so the integrator can persist
//! the event journal and rebuild the state by replay.
//!
//! # Speculation model
//!
//! Pending changes are kept in queue (enqueue) order. For change `i`, `D(i)`
//! is the set of earlier pending changes not proven independent of `i`. A
//! build of `i` assumes a subset `S ⊆ D(i)` lands (and `D(i) \ S` is
//! rejected); changes outside `D(i)` are irrelevant to `i` by independence.
//! Such a build is *decisive* once every change in `D(i)` is resolved and
//! exactly `S` landed.
//!
//! The *value* of a candidate build is the probability that it is the
//! decisive one, `Π_{j∈D(i)} (π_j if j∈S else 1-π_j)`, where `π_j` is the
//! probability that `j` lands. `π` is computed once per event in queue order:
//! `π_j = ŝ_j · Π_{k∈D(j)} (1 − π_k·c_jk)` (ŝ = P(success) from the model or
//! the prior, c = P(conflict), 0 for independent pairs), refined by finished
//! builds of `j`: with known results on assumption sets `K`,
//! `π_j = Σ_K P(K)·[K passed] + (1 − Σ_K P(K))·ŝ_j·Π(…)`.
//! Outcomes of different earlier changes are treated as independent
//! (mean-field); the values are exact whenever no two changes on one
//! speculation path conflict (c = 0 between them), as on the paper's examples.
//!
//! Candidates per change are enumerated lazily in non-increasing value order
//! (most likely assignment first, then flips of its least certain members),
//! and merged across changes through one heap, so filling `k` free slots costs
//! O(k log n) after an O(edges) probability pass.
//!
//! Pairwise conflict hazards compound over every dependency, so the total
//! P(broken by a conflict) of a change is bounded
//! ([`PlannerConfig::max_conflict_probability`]); once the logistic model is
//! trained on landing outcomes it already prices conflicts and the learned
//! pairwise rate is no longer applied on top
//! ([`PlannerConfig::model_includes_conflicts`]). Explicit overrides always apply.
//!
//! # Overload
//!
//! When more changes are pending than there are slots
//! ([`PlannerConfig::overload_pending_factor`]), every slot has certain work
//! queued behind it and a speculative alternative displaces a needed build.
//! The planner then builds only each change's most likely path, in value
//! order, without preemption or hedged retries, and only for the head of the
//! queue ([`PlannerConfig::overload_window`]) plus changes whose build is
//! more likely than not to be needed.
//!
//! # Batching (opt-in, [`PlannerConfig::batching`])
//!
//! A passing tree decides every pending change in it when that set is closed
//! under pending dependencies (`land_a_batch`); it relies on failures being
//! monotone. A failed tree blames its members by their odds of being the
//! culprit (`blame`). Under a backlog, free slots go to batch trees instead of
//! per-change paths (`schedule_batches`, and the slots it leaves go to
//! per-change paths as without batching): batches cut in queue order, ended by
//! any change expected to fail (built alone, so the batch before it lands
//! without waiting for it), each tree closed over the dependencies its changes
//! expect to land, halved when it already failed, and lane heads always built
//! so that nothing waits on a cycle.
//!
//! Monotone failures also let a pass outlive its tree: a passed tree stays a
//! pass for its change when an assumed change is rejected (`build_key`), and
//! with [`PlannerConfig::attribution`] a failed tree whose build reports its
//! failing targets decides every member whose own targets passed
//! (`attribute`): it lands once the members it depends on are decided,
//! whatever their outcome, and the failure blames only the members whose
//! targets failed. A member of a failed tree independent of all the others
//! bypasses their bisection: it is built alone, ahead of other batches.
//!
//! # Priorities
//!
//! Queue order is arrival order within a priority. A change that arrives with
//! a higher priority than pending changes that depend on it is ordered before
//! them: they, and the changes behind them that depend on them, are re-queued
//! behind it under new indices (the old records become `Moved`, and their
//! builds, which did not hold the new change, are cancelled). Changes
//! independent of it keep their place and their builds. Among dependent
//! changes, queue order therefore never goes against priority, which is what
//! keeps every other record's dependencies valid. A change's most likely
//! build is ranked by its priority first.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::conflict::ChangeAnalysis;
use crate::error::QueueError;
use crate::model::{ChangeFeatures, FeatureVector, LogisticModel, TrainParams, TrainingExample};
use crate::types::{Action, BuildId, BuildOutcome, BuildSpec, ChangeId, Event, LandProof, Millis, RejectReason};

/// Most evidence snapshots per change used for training.
const MAX_SNAPSHOTS: usize = 4;

/// The format of [`Planner::save_state`]'s text; a change to the planner's
/// fields that old text cannot fill bumps it, and such text is refused.
const SAVED_STATE_FORMAT: u32 = 1;

/// [`Planner::save_state`]'s text: the planner, tagged with its format.
#[derive(Serialize)]
struct SavedState<'a> {
    format: u32,
    planner: &'a Planner,
}

/// How candidate builds are ranked. `Value` is SubmitQueue; the others exist
/// so the simulator can compare against the baselines with the same engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Strategy {
    /// Highest probability-of-being-needed first (SubmitQueue).
    Value,
    /// Breadth-first over the speculation tree, every candidate, no ranking.
    SpeculateAll,
    /// Only the "everything ahead lands" build per change, in queue order (Zuul-like).
    Optimistic,
}

/// Planner tuning. `Default` gives the SubmitQueue configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannerConfig {
    /// Number of builds that may run at once.
    pub capacity: usize,
    /// Extra attempts of the same tree before a failure is believed (flaky tests).
    pub max_retries: u32,
    /// P(success) used until the model is trained.
    pub prior_success: f64,
    /// P(conflict) for a dependent pair before any history exists.
    pub prior_conflict: f64,
    /// Weight (in pseudo-observations) of `prior_conflict` against learned evidence.
    pub conflict_prior_weight: f64,
    /// Upper bound on the total P(a change is broken by some conflict). Pairwise
    /// conflict hazards compound over all dependencies; without a bound a change
    /// with many (mostly harmless) dependencies looks almost certain to fail,
    /// and everything behind it speculates on the wrong outcome. Conflict rates
    /// observed in practice saturate (SubmitQueue: ~40% at 16 concurrent changes).
    pub max_conflict_probability: f64,
    /// Once a model is trained on landing outcomes it already prices the average
    /// conflict risk; with this set, pairwise conflict hazards then only apply
    /// to explicit overrides (no double counting).
    pub model_includes_conflicts: bool,
    /// Prior P(a retry passes after a failure), i.e. how flaky builds are.
    pub prior_retry_pass: f64,
    /// Weight (pseudo-observations) of `prior_retry_pass`.
    pub flake_prior_weight: f64,
    /// Offer a concurrent second attempt of a running build, valued at the
    /// build's value times P(its change fails there). Only matters with
    /// `max_retries > 0`: it turns "retry after failure" into "retry alongside".
    pub hedge_retries: bool,
    /// Candidate ranking.
    pub strategy: Strategy,
    /// When false, every pair of changes is treated as dependent.
    pub use_analyzer: bool,
    /// Builds whose value is not above this are never started.
    pub min_value: f64,
    /// Values are compared after rounding down to this step; within a step,
    /// the earlier change wins. 0 disables. Trades a little expected waste for
    /// queue-order fairness.
    pub value_quantum: f64,
    /// Preemption: with no free slot, a running build is cancelled for a
    /// candidate whose value is at least this factor times the running
    /// build's value per remaining slot-time (value / fraction of the typical
    /// build duration still to go, so nearly finished builds are kept).
    /// `None` never preempts (running builds only stop when impossible).
    pub preempt_factor: Option<f64>,
    /// ...and whose value exceeds that by at least this much (avoids churn
    /// among near-worthless builds).
    pub preempt_min_gain: f64,
    /// Most dependencies a candidate may assume the less likely outcome of
    /// (0: only the most likely path per change). `None`: unbounded.
    pub max_flips: Option<usize>,
    /// Overload mode: while more than this factor times `capacity` changes
    /// are pending, only the most likely path of each change is built, with
    /// no preemption and no hedged retries. `None` disables.
    pub overload_pending_factor: Option<f64>,
    /// Overload mode: only the first `overload_window × capacity` pending
    /// changes (queue order) are built, plus any later change whose most
    /// likely build is at least `overload_certain` likely to be needed (e.g.
    /// an independent lane). Deep in a backlog, a change still waits for many
    /// undecided predecessors, so its build would mostly be redone anyway.
    pub overload_window: Option<f64>,
    /// See `overload_window`.
    pub overload_certain: f64,
    /// Ranking weight per pending change waiting on the build's change:
    /// priority = value × (1 + w × dependents). 0 ranks by value alone.
    pub blocking_weight: f64,
    /// Retrain the model after this many decisions.
    pub retrain_every: usize,
    /// Do not train on fewer examples than this.
    pub min_training_examples: usize,
    /// Keep at most this many (most recent) training examples.
    pub max_history: usize,
    /// Gradient-descent settings.
    pub train: TrainParams,
    /// Number of recent decisions per author used for the author success rate.
    pub author_window: usize,
    /// Batch landing: a passing build decides every pending change its tree
    /// assumed, not only its own (see [`LandProof::batch`]). Off keeps the
    /// guarantee that every commit the mainline gains was built on its own.
    #[serde(default)]
    pub batching: bool,
    /// With batching, under a backlog: most changes in one batch.
    #[serde(default = "default_max_batch")]
    pub max_batch: usize,
    /// With batching: a batch stops growing before its predicted P(pass)
    /// would fall below this.
    #[serde(default = "default_batch_min_pass")]
    pub batch_min_pass: f64,
    /// With batching: use the failing targets a build reports to decide the
    /// members of a failed tree whose own targets passed (attribution).
    #[serde(default = "default_attribution")]
    pub attribution: bool,
    /// With batching: a failed tree whose failing targets (as its build reports
    /// them) are all known to be flaky is tried again whole instead of being
    /// bisected, and blames no one. A target is known flaky when at least this
    /// share of its failures passed on the same tree later (`flaky_targets`).
    /// Above 1 never.
    #[serde(default = "default_known_flaky_share")]
    pub known_flaky_share: f64,
    /// With batching: fixed batches, as GitHub's merge queue cuts them. Every slot
    /// goes to a batch of `max_batch` queued changes in queue order (a smaller one
    /// once its oldest change has waited a typical build), whatever the load and
    /// the predictions; a failed batch is bisected. For comparison in the simulator.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fixed_batches: bool,
    /// With batching, under a backlog: the slots the batch trees leave free
    /// wait for later batches instead of going to per-change speculation.
    /// Better only when batch trees rarely fail, as for the simulator's
    /// oracle; with predicted outcomes a failing tree decides little, and the
    /// slot is better spent on the most likely per-change builds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hold_free_slots: bool,
    /// Learn each change's own outcome early (value strategy, without a backlog): a
    /// change waiting on undecided changes it may conflict with also gets a build on
    /// the mainline alone, and that build's outcome (and any pass) then stands for its
    /// own success on every tree, in place of the model's guess. Speculation on the
    /// changes behind it then follows what it will do rather than the average change.
    /// Decisions still need a build of the exact tree. On by default; off when absent
    /// from a saved configuration, since a queue's journal written before it existed
    /// must replay to the same builds.
    #[serde(default)]
    pub learn_alone: bool,
}

fn default_known_flaky_share() -> f64 {
    0.3
}

/// A target whose failures are recorded (see [`Planner::flaky_targets`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlakyTarget {
    /// The target's label.
    pub target: String,
    /// Builds that reported it failing.
    pub failures: u32,
    /// Of those, the failures whose tree passed in another build (or passed
    /// before): flaky, not broken.
    pub flaky: u32,
}

fn default_attribution() -> bool {
    true
}

fn default_max_batch() -> usize {
    16
}

fn default_batch_min_pass() -> f64 {
    0.3
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            capacity: 100,
            max_retries: 1,
            prior_success: 0.9,
            prior_conflict: 0.05,
            conflict_prior_weight: 20.0,
            max_conflict_probability: 0.4,
            model_includes_conflicts: true,
            prior_retry_pass: 0.1,
            flake_prior_weight: 10.0,
            hedge_retries: true,
            strategy: Strategy::Value,
            use_analyzer: true,
            min_value: 0.0,
            value_quantum: 0.0,
            preempt_factor: Some(2.0),
            preempt_min_gain: 0.05,
            blocking_weight: 1.0,
            max_flips: None,
            overload_pending_factor: Some(1.0),
            overload_window: Some(1.0),
            overload_certain: 0.5,
            retrain_every: 50,
            min_training_examples: 50,
            max_history: 5000,
            train: TrainParams::default(),
            author_window: 20,
            batching: false,
            max_batch: default_max_batch(),
            batch_min_pass: default_batch_min_pass(),
            attribution: default_attribution(),
            known_flaky_share: default_known_flaky_share(),
            fixed_batches: false,
            hold_free_slots: false,
            learn_alone: true,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Status {
    Pending,
    /// Position in the mainline.
    Landed(usize),
    Rejected,
    Cancelled,
    /// Re-queued behind a higher-priority change: the change lives on in a
    /// later record (`by_id` points there); this one and its builds are dead.
    Moved,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Change {
    id: ChangeId,
    features: ChangeFeatures,
    /// Earlier changes (pending at enqueue time) not proven independent.
    deps: Vec<usize>,
    status: Status,
    /// Builds still worth remembering (running, or finished with possible assumptions).
    builds: Vec<u64>,
    success_override: Option<f64>,
    /// What its builds say about its own build steps (`learn_alone`): true once any
    /// build passed its targets, false once a build on the mainline alone failed in
    /// them (and none passed).
    #[serde(default)]
    learned: Option<bool>,
    spec_passed: u32,
    spec_failed: u32,
    /// Distinct (passed, failed) build counts seen before the decision; each
    /// becomes a training example, so the model learns P(lands | evidence so far)
    /// exactly as it is asked at prediction time.
    snapshots: Vec<(u32, u32)>,
    enqueued: Millis,
    /// See `Event::Enqueue::priority`.
    priority: i32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum BuildState {
    Running,
    Passed,
    Failed,
    /// No retry can change it (`BuildOutcome::FailedConclusively`).
    FailedConclusively,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct BuildRec {
    spec: BuildSpec,
    change: usize,
    /// Sorted change indices assumed landed.
    assumed: Vec<usize>,
    base: usize,
    state: BuildState,
    started: Millis,
    /// `Passed` here means only this change's own targets passed; the tree as
    /// a whole failed (attribution, with batching). Such a record proves this
    /// change, never a batch.
    member_only: bool,
    /// For a failed tree with attribution: the members whose targets failed.
    /// Only they are blamed for the failure.
    implicated: Option<Vec<usize>>,
    /// The failing targets the build reported (interned, sorted).
    failed_targets: Option<Vec<u32>>,
    /// Its failing targets were already counted as flaky.
    flake_counted: bool,
}

#[derive(Clone, Debug, Default)]
struct KeyStat {
    running: Option<u64>,
    running_n: u32,
    passed: Option<u64>,
    failures: u32,
    /// One of the failures was conclusive: no retry can pass.
    conclusive: bool,
    last_failed: Option<u64>,
}

impl KeyStat {
    /// Records an attempt of this tree that has just started.
    fn started(&mut self, id: u64) {
        self.running = Some(id);
        self.running_n += 1;
    }

    fn confirmed_failed(&self, max_attempts: u32) -> bool {
        self.passed.is_none() && (self.conclusive || self.failures >= max_attempts)
    }

    /// Whether another attempt of this tree may start, with `planned` attempts
    /// already running or about to: not passed, not conclusively failed, and
    /// attempts left.
    fn may_attempt(&self, max_attempts: u32, planned: u32) -> bool {
        self.passed.is_none() && !self.conclusive && self.failures + planned < max_attempts
    }
}

/// Counters for monitoring and the simulator.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlannerStats {
    /// Builds started (retries included).
    pub builds_started: u64,
    /// Builds cancelled by the planner (preemptions included).
    pub builds_cancelled: u64,
    /// Builds cancelled to make room for more valuable ones.
    pub builds_preempted: u64,
    /// Changes landed.
    pub landed: u64,
    /// Changes rejected.
    pub rejected: u64,
    /// Times the model was retrained.
    pub retrains: u64,
    /// Batch landings (several changes decided by one passing tree).
    #[serde(default)]
    pub batches: u64,
    /// Changes landed by those batches.
    #[serde(default)]
    pub batch_landed: u64,
    /// Changes re-queued behind a higher-priority arrival.
    #[serde(default)]
    pub requeued: u64,
    /// Builds of a half (a quarter, ...) of a failed batch tree: the bisections.
    #[serde(default)]
    pub bisection_builds: u64,
    /// Failed trees tried again whole because every failing target was known
    /// to be flaky (instead of a bisection).
    #[serde(default)]
    pub flaky_retries: u64,
    /// Builds of a change on the mainline alone, started to learn its own outcome.
    #[serde(default)]
    pub learn_builds: u64,
}

/// Read-only view of one pending change, for dashboards and debugging.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PendingView {
    /// The change.
    pub change: ChangeId,
    /// Current P(lands).
    pub landing_probability: f64,
    /// Earlier pending changes it waits for.
    pub waits_for: Vec<ChangeId>,
    /// Builds still relevant: spec, and `None` while running, else whether it passed.
    pub builds: Vec<(BuildSpec, Option<bool>)>,
}

/// A candidate in the global selection heap.
struct Cand {
    /// The change's `Event::Enqueue::priority` for its most likely path;
    /// 0 for speculative alternatives and hedges, which compete on value.
    urgency: i32,
    prio: f64,
    pos: usize,
    flips: Vec<u32>,
    value: f64,
    /// A concurrent second attempt of an already running build (hedged retry).
    hedge: bool,
    /// A build on the mainline alone, to learn the change's own outcome.
    learn: bool,
}

impl PartialEq for Cand {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Cand {}
impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Cand {
    fn cmp(&self, o: &Self) -> Ordering {
        // Max-heap: more urgent, then higher ranking, then earlier change,
        // then fewer flips, then higher exact value.
        self.urgency
            .cmp(&o.urgency)
            .then_with(|| self.prio.total_cmp(&o.prio))
            .then_with(|| o.pos.cmp(&self.pos))
            .then_with(|| o.flips.len().cmp(&self.flips.len()))
            .then_with(|| self.value.total_cmp(&o.value))
            .then_with(|| o.flips.cmp(&self.flips))
            .then_with(|| o.hedge.cmp(&self.hedge))
    }
}

/// Per-event view of one pending change used by scheduling.
struct View {
    /// Positions (in the pending order) of pending dependencies.
    pdeps: Vec<usize>,
    /// Most likely outcome of each pending dependency (true = lands).
    main: Vec<bool>,
    /// Lazily: indices into `pdeps` sorted by flip ratio, and the ratios.
    flip_order: Option<(Vec<u32>, Vec<f64>)>,
    /// Results per assumption set; computed on first use (most views are
    /// only ranked, never popped), then kept up to date incrementally.
    stats: FastMap<Vec<usize>, KeyStat>,
    stats_ready: bool,
}

/// Overrides waiting for their change to arrive.
#[derive(Clone, Serialize, Deserialize)]
struct Preset {
    success: f64,
    conflicts: Vec<(usize, f64)>,
}

/// The SubmitQueue planner. See the module docs for the model.
///
/// Its whole state can be saved and restored ([`Planner::save_state`]), and the
/// records of decided changes that nothing refers to any more can be forgotten
/// ([`Planner::forget_decided`]); neither changes a later decision, so a queue
/// can keep a saved state instead of its whole journal.
#[derive(Clone, Serialize, Deserialize)]
pub struct Planner {
    config: PlannerConfig,
    /// By change index. Indices are never reused; a forgotten prefix is gone.
    changes: Indexed<Change>,
    by_id: HashMap<ChangeId, usize>,
    pending: BTreeSet<usize>,
    /// Change index by mainline position (a version is a position + 1).
    mainline: Indexed<usize>,
    builds: BTreeMap<u64, BuildRec>,
    running: BTreeSet<u64>,
    next_build: u64,
    last_now: Millis,
    targets: HashMap<String, u32>,
    /// Per interned target: (failures reported, of which flaky).
    flakes: BTreeMap<u32, (u32, u32)>,
    /// Interned, sorted affected targets and graph flag per change (None = unknown).
    analysis: Indexed<Option<(Vec<u32>, bool)>>,
    /// Interned, sorted graph reach (`ChangeAnalysis::graph_reach`) of the
    /// changes that alter the graph and whose reach is known. States saved
    /// before it existed have none, which only keeps those changes dependent
    /// on every other, as they were then.
    #[serde(default)]
    reach: BTreeMap<usize, Vec<u32>>,
    #[serde(with = "pair_map")]
    conflict_override: HashMap<(usize, usize), f64>,
    /// Overrides for changes not enqueued yet (see [`Planner::preset`]).
    presets: HashMap<ChangeId, Preset>,
    model: Option<LogisticModel>,
    history: VecDeque<TrainingExample>,
    decisions_since_train: usize,
    authors: HashMap<String, VecDeque<bool>>,
    conflict_pairs: f64,
    conflict_events: f64,
    retry_trials: f64,
    retry_passes: f64,
    /// Decided changes with a learned own outcome, and how many of them landed, per
    /// outcome (index 0: failed on the mainline alone, 1: passed).
    #[serde(default)]
    learned_decided: [f64; 2],
    #[serde(default)]
    learned_landed: [f64; 2],
    duration_sum: f64,
    duration_n: f64,
    stats: PlannerStats,
}

/// Records under ever-growing indices whose oldest ones can be forgotten: index
/// `i` is `items[i - base]`. Indexing a forgotten record panics, as indexing past
/// the end does: `forget_decided` only forgets what nothing refers to.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Indexed<T> {
    base: usize,
    items: VecDeque<T>,
}

impl<T> Default for Indexed<T> {
    fn default() -> Self {
        Indexed { base: 0, items: VecDeque::new() }
    }
}

impl<T> Indexed<T> {
    /// The next index: how many records were ever pushed.
    fn len(&self) -> usize {
        self.base + self.items.len()
    }

    fn push(&mut self, t: T) {
        self.items.push_back(t);
    }

    /// The records from index `from` on (those still remembered).
    fn since(&self, from: usize) -> impl DoubleEndedIterator<Item = &T> {
        self.items.range(from.saturating_sub(self.base).min(self.items.len())..)
    }

    fn iter(&self) -> impl DoubleEndedIterator<Item = &T> {
        self.items.iter()
    }

    /// Forgets every record below index `end`.
    fn forget_before(&mut self, end: usize) {
        while self.base < end && self.items.pop_front().is_some() {
            self.base += 1;
        }
    }
}

impl<T> std::ops::Index<usize> for Indexed<T> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        let k = i.checked_sub(self.base).unwrap_or_else(|| panic!("record {i} was forgotten (base {})", self.base));
        &self.items[k]
    }
}

impl<T> std::ops::IndexMut<usize> for Indexed<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        let k = i.checked_sub(self.base).unwrap_or_else(|| panic!("record {i} was forgotten (base {})", self.base));
        &mut self.items[k]
    }
}

/// A map keyed by index pairs, stored as a list (JSON keys are strings).
mod pair_map {
    use std::collections::HashMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(m: &HashMap<(usize, usize), f64>, s: S) -> Result<S::Ok, S::Error> {
        let mut v: Vec<(usize, usize, f64)> = m.iter().map(|(&(a, b), &p)| (a, b, p)).collect();
        v.sort_by_key(|&(a, b, _)| (a, b));
        v.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<HashMap<(usize, usize), f64>, D::Error> {
        Ok(Vec::<(usize, usize, f64)>::deserialize(d)?.into_iter().map(|(a, b, p)| ((a, b), p)).collect())
    }
}

/// Position of each pending change in the per-event queue order, indexed by
/// change index from the oldest one remembered (a dense vector: these lookups
/// are the planner's inner loop).
struct PosMap {
    base: usize,
    pos: Vec<usize>,
}

impl PosMap {
    fn new(changes: &Indexed<Change>, order: &[usize]) -> Self {
        let base = changes.base;
        let mut pos = vec![usize::MAX; changes.len() - base];
        for (p, &c) in order.iter().enumerate() {
            pos[c - base] = p;
        }
        PosMap { base, pos }
    }

    fn get(&self, c: &usize) -> Option<&usize> {
        c.checked_sub(self.base).and_then(|k| self.pos.get(k)).filter(|&&p| p != usize::MAX)
    }
}

/// Small multiplicative hasher for the planner's internal integer-keyed maps
/// (deterministic, no DoS exposure: keys are the planner's own indices).
#[derive(Default, Clone, Copy)]
struct FastHasher(u64);

impl std::hash::Hasher for FastHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
}

type FastMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<FastHasher>>;

/// A rate observed as `hits` in `trials`, starting from `prior` worth `weight` trials.
fn prior_weighted(prior: f64, weight: f64, hits: f64, trials: f64) -> f64 {
    (weight * prior + hits) / (weight + trials)
}

fn disjoint(a: &[u32], b: &[u32]) -> bool {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            Ordering::Less => i += 1,
            Ordering::Greater => j += 1,
            Ordering::Equal => return false,
        }
    }
    true
}

impl Planner {
    /// A planner with no history, using the configured priors.
    pub fn new(config: PlannerConfig) -> Self {
        Planner {
            config,
            changes: Indexed::default(),
            by_id: HashMap::new(),
            pending: BTreeSet::new(),
            mainline: Indexed::default(),
            builds: BTreeMap::new(),
            running: BTreeSet::new(),
            next_build: 0,
            last_now: Millis(0),
            targets: HashMap::new(),
            flakes: BTreeMap::new(),
            analysis: Indexed::default(),
            reach: BTreeMap::new(),
            conflict_override: HashMap::new(),
            presets: HashMap::new(),
            model: None,
            history: VecDeque::new(),
            decisions_since_train: 0,
            authors: HashMap::new(),
            conflict_pairs: 0.0,
            conflict_events: 0.0,
            retry_trials: 0.0,
            learned_decided: [0.0; 2],
            learned_landed: [0.0; 2],
            retry_passes: 0.0,
            duration_sum: 0.0,
            duration_n: 0.0,
            stats: PlannerStats::default(),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &PlannerConfig {
        &self.config
    }

    /// Installs a previously persisted model (e.g. from another queue's history).
    pub fn set_model(&mut self, model: Option<LogisticModel>) {
        self.model = model;
    }

    /// The current P(success) model, if one has been trained or installed.
    pub fn model(&self) -> Option<&LogisticModel> {
        self.model.as_ref()
    }

    /// Training examples gathered so far (most recent last).
    pub fn training_history(&self) -> impl Iterator<Item = &TrainingExample> {
        self.history.iter()
    }

    /// Counters.
    pub fn stats(&self) -> &PlannerStats {
        &self.stats
    }

    /// Landed changes in landing order. A change whose landing failed
    /// (`Event::LandingFailed`) is left out, so this is the mainline's content,
    /// not an index of versions.
    pub fn mainline(&self) -> Vec<ChangeId> {
        self.mainline.iter().filter(|&&i| self.landed(i)).map(|&i| self.changes[i].id.clone()).collect()
    }

    /// Pending changes in queue order.
    pub fn pending(&self) -> Vec<ChangeId> {
        self.pending.iter().map(|&i| self.changes[i].id.clone()).collect()
    }

    /// Whether the change is on the mainline (landed, and its landing did not fail).
    pub fn is_landed(&self, change: &ChangeId) -> bool {
        self.by_id.get(change).is_some_and(|&i| self.landed(i))
    }

    /// Whether the change is still undecided in the queue.
    pub fn is_pending(&self, change: &ChangeId) -> bool {
        self.by_id.get(change).is_some_and(|i| self.pending.contains(i))
    }

    /// Number of builds running.
    pub fn running_count(&self) -> usize {
        self.running.len()
    }

    /// Builds currently running.
    pub fn running_builds(&self) -> Vec<BuildSpec> {
        self.running.iter().map(|b| self.builds[b].spec.clone()).collect()
    }

    /// Builds the planner still keeps: running ones, and finished ones that can still
    /// decide a pending change. Everything older may go from a queue's history.
    pub fn kept_builds(&self) -> impl Iterator<Item = &BuildSpec> {
        self.builds.values().map(|b| &b.spec)
    }

    /// How many mainline versions the planner has handed out (the newest is this one).
    pub fn versions(&self) -> u64 {
        self.mainline.len() as u64
    }

    /// Start time of a running build.
    pub fn build_started(&self, id: BuildId) -> Option<Millis> {
        self.builds.get(&id.0).map(|b| b.started)
    }

    /// Time a change was enqueued.
    pub fn enqueued_at(&self, change: &ChangeId) -> Option<Millis> {
        self.by_id.get(change).map(|&i| self.changes[i].enqueued)
    }

    /// Replaces the model's P(success) of a change with a known value (an
    /// oracle in simulation, or an operator hint). Takes effect at the next event.
    pub fn override_success(&mut self, change: &ChangeId, p: f64) -> Result<(), QueueError> {
        let i = self.index(change)?;
        self.changes[i].success_override = Some(p.clamp(0.0, 1.0));
        Ok(())
    }

    /// Replaces P(conflict) of `later` given that `earlier` lands first.
    /// Has no effect on pairs proven independent.
    pub fn override_conflict(&mut self, later: &ChangeId, earlier: &ChangeId, p: f64) -> Result<(), QueueError> {
        let (l, e) = (self.index(later)?, self.index(earlier)?);
        self.conflict_override.insert((l, e), p.clamp(0.0, 1.0));
        Ok(())
    }

    /// Overrides for a change that is about to be enqueued, applied as it
    /// arrives so that the plan made for its arrival already uses them. An
    /// override installed after the enqueue only counts from the next event,
    /// by which time the arrival's hedged retry may already run. `earlier`
    /// conflict partners must be enqueued first. For oracles in simulation.
    pub fn preset(&mut self, change: ChangeId, success: f64, conflicts: &[(ChangeId, f64)]) -> Result<(), QueueError> {
        if self.by_id.contains_key(&change) {
            return Err(QueueError::DuplicateChange(change.0));
        }
        let conflicts = conflicts
            .iter()
            .map(|(e, p)| Ok((self.index(e)?, p.clamp(0.0, 1.0))))
            .collect::<Result<_, QueueError>>()?;
        self.presets.insert(change, Preset { success: success.clamp(0.0, 1.0), conflicts });
        Ok(())
    }

    /// Whether the planner treats two changes as dependent (the later one must
    /// wait for the earlier one's decision).
    pub fn dependent(&self, a: &ChangeId, b: &ChangeId) -> Result<bool, QueueError> {
        let (a, b) = (self.index(a)?, self.index(b)?);
        let (lo, hi) = if a < b { (a, b) } else { (b, a) };
        Ok(self.changes[hi].deps.contains(&lo))
    }

    fn index(&self, c: &ChangeId) -> Result<usize, QueueError> {
        self.by_id.get(c).copied().ok_or_else(|| QueueError::UnknownChange(c.0.clone()))
    }

    /// Forgets the records of decided changes that nothing refers to any more,
    /// so a long-running queue's planner (and its saved state) stays the size
    /// of its recent work. Returns how many change records it dropped.
    ///
    /// Records are forgotten oldest first, up to the oldest one still referred
    /// to: a pending change, a dependency of one, a member of a build still
    /// kept, a change on the mainline since a kept build's base, or a preset's
    /// conflict partner. Learned state (the model, its training history, the
    /// rates, flaky-target counts) is kept whole. Nothing a later event can
    /// reach is forgotten, so every later decision is the one the planner would
    /// have made anyway; only calls naming a forgotten change by id (a `Cancel`
    /// or `LandingFailed` of it, `dependent`) now find it unknown, and an
    /// `Enqueue` reusing its id is no longer refused as a duplicate (the caller
    /// must not reuse ids).
    pub fn forget_decided(&mut self) -> usize {
        let mut end = self.changes.len();
        let mut mainline_end = self.mainline.len();
        if let Some(&first) = self.pending.first() {
            end = end.min(first);
        }
        for &p in &self.pending {
            // `deps` is sorted: it is collected from the ordered pending set.
            if let Some(&d) = self.changes[p].deps.first() {
                end = end.min(d);
            }
        }
        for b in self.builds.values() {
            end = end.min(b.change);
            end = b.assumed.iter().chain(b.implicated.iter().flatten()).fold(end, |e, &m| e.min(m));
            mainline_end = mainline_end.min(b.base);
        }
        for pre in self.presets.values() {
            end = pre.conflicts.iter().fold(end, |e, &(m, _)| e.min(m));
        }
        end = self.mainline.since(mainline_end).fold(end, |e, &m| e.min(m));
        let forgotten = end.saturating_sub(self.changes.base);
        for c in self.changes.iter().take(forgotten) {
            // A re-queued change's id names its newer record.
            if self.by_id.get(&c.id).is_some_and(|&i| i < end) {
                self.by_id.remove(&c.id);
            }
        }
        self.changes.forget_before(end);
        self.analysis.forget_before(end);
        self.reach = self.reach.split_off(&end);
        self.mainline.forget_before(mainline_end);
        self.conflict_override.retain(|&(l, e), _| l >= end && e >= end);
        forgotten
    }

    /// The planner's whole state as text, to be given to [`Planner::restore_state`].
    pub fn save_state(&self) -> Result<String, QueueError> {
        Ok(serde_json::to_string(&SavedState { format: SAVED_STATE_FORMAT, planner: self })?)
    }

    /// A planner from [`Planner::save_state`]'s text: it makes the same decisions
    /// for the same later events as the planner that was saved.
    pub fn restore_state(text: &str) -> Result<Planner, QueueError> {
        #[derive(Deserialize)]
        struct Format {
            format: u32,
        }
        #[derive(Deserialize)]
        struct Restored {
            planner: Planner,
        }
        let format = serde_json::from_str::<Format>(text)?.format;
        if format != SAVED_STATE_FORMAT {
            return Err(QueueError::InvalidInput {
                line: 1,
                message: format!("saved planner state of format {format}; this version reads {SAVED_STATE_FORMAT}"),
            });
        }
        Ok(serde_json::from_str::<Restored>(text)?.planner)
    }

    /// Every pending change in queue order with what it waits for.
    pub fn snapshot(&self) -> Vec<PendingView> {
        let (order, pi) = self.probabilities();
        order
            .iter()
            .zip(pi)
            .map(|(&i, p)| PendingView {
                change: self.changes[i].id.clone(),
                landing_probability: p,
                waits_for: self.changes[i]
                    .deps
                    .iter()
                    .filter(|&&d| self.changes[d].status == Status::Pending)
                    .map(|&d| self.changes[d].id.clone())
                    .collect(),
                builds: self.changes[i]
                    .builds
                    .iter()
                    .map(|b| {
                        let r = &self.builds[b];
                        let state = match r.state {
                            BuildState::Running => None,
                            BuildState::Passed => Some(true),
                            BuildState::Failed | BuildState::FailedConclusively => Some(false),
                        };
                        (r.spec.clone(), state)
                    })
                    .collect(),
            })
            .collect()
    }

    /// Current P(lands) of every pending change, in queue order.
    pub fn landing_probabilities(&self) -> Vec<(ChangeId, f64)> {
        let (order, pi) = self.probabilities();
        order.iter().zip(pi).map(|(&i, p)| (self.changes[i].id.clone(), p)).collect()
    }

    /// Value (probability of being the decisive build) of building `change`
    /// assuming exactly `assumed` among its pending dependencies land.
    /// Returns `None` if `change` is not pending or `assumed` names a change
    /// that is not a pending dependency of it.
    pub fn value_of(&self, change: &ChangeId, assumed: &[ChangeId]) -> Option<f64> {
        let i = *self.by_id.get(change)?;
        if self.changes[i].status != Status::Pending {
            return None;
        }
        let (order, pi) = self.probabilities();
        let pos = PosMap::new(&self.changes, &order);
        let mut set = BTreeSet::new();
        for a in assumed {
            let j = *self.by_id.get(a)?;
            if self.changes[j].status != Status::Pending || !self.changes[i].deps.contains(&j) {
                return None;
            }
            set.insert(j);
        }
        let mut v = 1.0;
        for &d in &self.changes[i].deps {
            if let Some(&p) = pos.get(&d) {
                v *= if set.contains(&d) { pi[p] } else { 1.0 - pi[p] };
            }
        }
        Some(v)
    }

    /// Applies one event at time `now` and returns the actions to execute, in order.
    pub fn handle(&mut self, now: Millis, event: Event) -> Result<Vec<Action>, QueueError> {
        if now < self.last_now {
            return Err(QueueError::ClockWentBackwards { now_ms: now.0, last_ms: self.last_now.0 });
        }
        self.last_now = now;
        let mut actions = Vec::new();
        match event {
            Event::Enqueue { change, features, analysis, priority } => {
                self.enqueue(now, change, features, analysis, priority)?
            }
            Event::BuildFinished { build, outcome, failed_targets } => {
                if build.0 >= self.next_build {
                    return Err(QueueError::UnknownBuild(build.0));
                }
                if !self.running.remove(&build.0) {
                    // A result racing with our own cancellation: harmless, ignore.
                    return Ok(actions);
                }
                let rec = self.builds.get_mut(&build.0).expect("running builds are recorded");
                self.duration_sum += now.0.saturating_sub(rec.started.0) as f64;
                self.duration_n += 1.0;
                if rec.spec.attempt > 1 {
                    self.retry_trials += 1.0;
                    if outcome == BuildOutcome::Passed {
                        self.retry_passes += 1.0;
                    }
                }
                let ch = &mut self.changes[rec.change];
                match outcome {
                    BuildOutcome::Passed => {
                        rec.state = BuildState::Passed;
                        ch.spec_passed += 1;
                    }
                    BuildOutcome::Failed => {
                        rec.state = BuildState::Failed;
                        ch.spec_failed += 1;
                    }
                    BuildOutcome::FailedConclusively => {
                        rec.state = BuildState::FailedConclusively;
                        ch.spec_failed += 1;
                    }
                }
                // Bounded so a change with many builds does not dominate training.
                if ch.snapshots.len() < MAX_SNAPSHOTS {
                    ch.snapshots.push((ch.spec_passed, ch.spec_failed));
                }
                if self.config.batching
                    && self.config.attribution
                    && outcome == BuildOutcome::Failed
                    && let Some(failed) = &failed_targets
                {
                    self.attribute(build.0, failed);
                }
                self.record_flakes(build.0, outcome, failed_targets.as_deref());
                self.learn_from(build.0, outcome);
            }
            Event::SetCapacity { capacity } => self.config.capacity = capacity,
            Event::FlakyTargets { targets } => {
                for t in &targets {
                    let id = self.intern(t);
                    self.count_failure(id, true);
                }
            }
            Event::LandingFailed { change } => {
                let i = self.index(&change)?;
                if !self.landed(i) {
                    return Err(QueueError::NotLanded(change.0));
                }
                // The version slot stays (versions are positions the
                // integrator has already mapped to commits); every reader
                // of `mainline` skips slots whose change is not landed.
                // Builds that assumed the change are now impossible and
                // are cancelled by `cleanup`; builds that did not assume it
                // tested exactly what the mainline now holds.
                self.changes[i].status = Status::Rejected;
                self.stats.landed -= 1;
                self.stats.rejected += 1;
                // Its training example stays "landed": the change did pass its
                // own build, and the model predicts exactly that.
            }
            Event::Cancel { change } => {
                let i = self.index(&change)?;
                if self.changes[i].status == Status::Pending {
                    self.changes[i].status = Status::Cancelled;
                    self.pending.remove(&i);
                }
            }
        }
        self.decide(&mut actions);
        self.cleanup(&mut actions);
        self.schedule(now, &mut actions);
        Ok(actions)
    }

    fn enqueue(
        &mut self,
        now: Millis,
        id: ChangeId,
        features: ChangeFeatures,
        analysis: Option<ChangeAnalysis>,
        priority: i32,
    ) -> Result<(), QueueError> {
        if self.by_id.contains_key(&id) {
            return Err(QueueError::DuplicateChange(id.0));
        }
        let mut sorted = |targets: &BTreeSet<String>| {
            let mut v: Vec<u32> = targets.iter().map(|t| self.intern(t)).collect();
            v.sort_unstable();
            v
        };
        let reach = analysis.as_ref().and_then(|a| a.graph_reach.as_ref().filter(|_| a.alters_graph)).map(&mut sorted);
        let interned = analysis.map(|a| (sorted(&a.affected), a.alters_graph));
        // Pending changes of lower priority that must come after this one:
        // the ones that depend on it, and, to keep every dependent pair in
        // order, the ones behind those that depend on them. Nothing else
        // moves: an independent change's place does not matter to this one.
        // Queue order among dependent changes is therefore never against
        // priority, so no change left in place depends on a moved one.
        let mut moved: Vec<usize> = Vec::new();
        for &j in &self.pending {
            if self.changes[j].priority < priority
                && (self.dependent_on(&interned, reach.as_deref(), j)
                    || self.changes[j].deps.iter().any(|d| moved.binary_search(d).is_ok()))
            {
                moved.push(j);
            }
        }
        for &j in &moved {
            self.pending.remove(&j);
            self.changes[j].status = Status::Moved;
        }
        let change = Change {
            id: id.clone(),
            features,
            deps: Vec::new(),
            status: Status::Pending,
            builds: Vec::new(),
            success_override: None,
            learned: None,
            spec_passed: 0,
            spec_failed: 0,
            snapshots: vec![(0, 0)],
            enqueued: now,
            priority,
        };
        let i = self.push_change(change, interned, reach);
        if let Some(pre) = self.presets.remove(&id) {
            self.changes[i].success_override = Some(pre.success);
            for (e, p) in pre.conflicts {
                self.conflict_override.insert((i, e), p);
            }
        }
        // Re-queue the moved changes behind it, in their order. They keep
        // what describes them (features, overrides, evidence counts, arrival
        // time); their builds stay with the dead records and are cancelled.
        let mut renumbered: HashMap<usize, usize> = HashMap::new();
        for j in moved {
            let old = &self.changes[j];
            let change = Change { deps: Vec::new(), status: Status::Pending, builds: Vec::new(), ..old.clone() };
            let interned = self.analysis[j].clone();
            let reach = self.reach.get(&j).cloned();
            renumbered.insert(j, self.push_change(change, interned, reach));
            self.stats.requeued += 1;
        }
        if !renumbered.is_empty() {
            let map = |x: usize| renumbered.get(&x).copied().unwrap_or(x);
            let touched: Vec<((usize, usize), f64)> = self
                .conflict_override
                .iter()
                .filter(|((l, e), _)| renumbered.contains_key(l) || renumbered.contains_key(e))
                .map(|(&k, &p)| (k, p))
                .collect();
            for ((l, e), p) in touched {
                // Keyed (later, earlier): a pair whose order flipped swaps.
                let (l2, e2) = (map(l), map(e));
                self.conflict_override.insert((l2.max(e2), l2.min(e2)), p);
            }
        }
        Ok(())
    }

    /// Whether a change with analysis `a` (and graph reach `a_reach`) depends
    /// on change `j`: `ChangeAnalysis::independent_of` on interned targets.
    fn dependent_on(&self, a: &Option<(Vec<u32>, bool)>, a_reach: Option<&[u32]>, j: usize) -> bool {
        if !self.config.use_analyzer {
            return true;
        }
        match (a, &self.analysis[j]) {
            (Some((a, ga)), Some((b, gb))) => !crate::conflict::independent(
                (a.as_slice(), *ga, a_reach),
                (b.as_slice(), *gb, self.reach.get(&j).map(Vec::as_slice)),
                disjoint,
            ),
            _ => true,
        }
    }

    /// Appends `change` at the end of the queue (a new index), with its
    /// dependencies among the pending changes ahead of it.
    fn push_change(
        &mut self,
        mut change: Change,
        analysis: Option<(Vec<u32>, bool)>,
        reach: Option<Vec<u32>>,
    ) -> usize {
        change.deps =
            self.pending.iter().copied().filter(|&j| self.dependent_on(&analysis, reach.as_deref(), j)).collect();
        let i = self.changes.len();
        self.by_id.insert(change.id.clone(), i);
        self.changes.push(change);
        self.analysis.push(analysis);
        if let Some(r) = reach {
            self.reach.insert(i, r);
        }
        self.pending.insert(i);
        i
    }

    /// Attribution of a failed tree (batching only): each pending member whose
    /// affected targets are all outside `failed` passed on the tree, so by
    /// monotone failures it passes on any part of the tree that holds it.
    /// Each such member, the build's own change included, gets a passed
    /// record (`member_only`) whose tree is the members before it that it
    /// depends on, which decides it once they are decided, whatever their
    /// outcome. The build itself stays failed: its tree did fail, and
    /// bisection must not build that tree again. Failing targets no member
    /// claims, or a member whose targets are unknown, make the attribution
    /// worthless: nothing is cleared then.
    fn attribute(&mut self, bid: u64, failed: &[String]) {
        let mut f: Vec<u32> = Vec::with_capacity(failed.len());
        for t in failed {
            match self.targets.get(t) {
                Some(&n) => f.push(n),
                None => return,
            }
        }
        if f.is_empty() {
            return;
        }
        f.sort_unstable();
        let rec = &self.builds[&bid];
        let members: Vec<usize> = rec.assumed.iter().copied().chain([rec.change]).collect();
        let claimed = |t: &u32| {
            members.iter().any(|&m| self.analysis[m].as_ref().is_some_and(|(a, _)| a.binary_search(t).is_ok()))
        };
        if !f.iter().all(claimed) {
            return;
        }
        let (mut cleared, mut implicated) = (Vec::new(), Vec::new());
        for &m in &members {
            match &self.analysis[m] {
                Some((a, _)) if disjoint(a, &f) => cleared.push(m),
                _ => implicated.push(m),
            }
        }
        let (spec, base, started) = (rec.spec.clone(), rec.base, rec.started);
        let assumed = rec.assumed.clone();
        self.builds.get_mut(&bid).expect("looked up above").implicated = Some(implicated);
        for m in cleared {
            if self.changes[m].status != Status::Pending {
                continue;
            }
            // Only the members it depends on can matter to its targets.
            let deps = &self.changes[m].deps;
            let before: Vec<usize> =
                assumed.iter().copied().filter(|&a| a < m && deps.binary_search(&a).is_ok()).collect();
            let id = self.next_build;
            self.next_build += 1;
            self.builds.insert(
                id,
                BuildRec {
                    spec: spec.clone(),
                    change: m,
                    assumed: before,
                    base,
                    state: BuildState::Passed,
                    started,
                    member_only: true,
                    implicated: None,
                    failed_targets: None,
                    flake_counted: false,
                },
            );
            self.changes[m].builds.push(id);
            self.changes[m].spec_passed += 1;
        }
    }

    /// Per-target flaky records. A failed build keeps the targets it reported
    /// failing, each counted as a failure. When the same tree (same change and
    /// same pending assumptions, up to independent changes) passes in another
    /// build, before or after, each of those failures was flaky.
    fn record_flakes(&mut self, bid: u64, outcome: BuildOutcome, failed: Option<&[String]>) {
        let change = self.builds[&bid].change;
        let Some(key) = self.build_key(&self.builds[&bid]) else { return };
        let same_tree = |p: &Planner, o: &BuildRec| o.change == change && p.build_key(o).as_ref() == Some(&key);
        match (outcome, failed) {
            (BuildOutcome::Failed, Some(failed)) if !failed.is_empty() => {
                let mut ids: Vec<u32> = failed.iter().map(|t| self.intern(t)).collect();
                ids.sort_unstable();
                ids.dedup();
                let passed_before = self.changes[change].builds.iter().any(|o| {
                    let o = &self.builds[o];
                    o.state == BuildState::Passed && !o.member_only && same_tree(self, o)
                });
                for &t in &ids {
                    self.count_failure(t, passed_before);
                }
                let rec = self.builds.get_mut(&bid).expect("recorded");
                rec.failed_targets = Some(ids);
                rec.flake_counted = passed_before;
            }
            (BuildOutcome::Passed, _) => {
                let explained: Vec<u64> = self.changes[change]
                    .builds
                    .iter()
                    .copied()
                    .filter(|o| {
                        let o = &self.builds[o];
                        o.state == BuildState::Failed
                            && !o.flake_counted
                            && o.failed_targets.is_some()
                            && same_tree(self, o)
                    })
                    .collect();
                for o in explained {
                    let rec = self.builds.get_mut(&o).expect("listed");
                    rec.flake_counted = true;
                    for t in rec.failed_targets.clone().unwrap_or_default() {
                        self.flakes.entry(t).or_default().1 += 1;
                    }
                }
            }
            _ => {}
        }
    }

    /// What a finished build says about its change's own build steps (`learn_alone`):
    /// a pass on any tree means they pass; a failure on the mainline alone, unless the
    /// attribution puts it on other targets, means they fail (or flaked).
    fn learn_from(&mut self, bid: u64, outcome: BuildOutcome) {
        let Some(b) = self.builds.get(&bid) else { return };
        let i = b.change;
        let passed = match outcome {
            BuildOutcome::Passed => true,
            _ if !b.assumed.is_empty() || b.implicated.as_ref().is_some_and(|m| !m.contains(&i)) => return,
            BuildOutcome::Failed | BuildOutcome::FailedConclusively => false,
        };
        // A pass stands: the same steps failing elsewhere was a flake or a conflict.
        if self.changes[i].learned != Some(true) {
            self.changes[i].learned = Some(passed);
        }
    }

    /// P(lands) of a change whose own outcome was learned: how often the decided
    /// changes with that outcome landed (conflicts and flakes included), from a prior of
    /// `prior_success` after a pass and `prior_retry_pass` after a failure.
    fn learned_rate(&self, passed: bool) -> f64 {
        let k = usize::from(passed);
        let prior = if passed { self.config.prior_success } else { self.config.prior_retry_pass };
        prior_weighted(prior, self.config.flake_prior_weight, self.learned_landed[k], self.learned_decided[k])
    }

    /// Whether change `i` should get a build on the mainline alone to learn its own
    /// outcome: it waits on a pending dependency it expects to land (else its most
    /// likely tree is that build already), nothing is learned or told yet, and no
    /// such build is running or remembered.
    fn wants_to_learn(&self, i: usize, view: &View) -> bool {
        let ch = &self.changes[i];
        ch.learned.is_none()
            && ch.success_override.is_none()
            && view.main.iter().any(|&lands| lands)
            && !ch.builds.iter().any(|b| self.builds[b].assumed.is_empty())
    }

    /// The interned id of a target label (new labels get the next id).
    fn intern(&mut self, target: &str) -> u32 {
        let n = self.targets.len() as u32;
        *self.targets.entry(target.to_string()).or_insert(n)
    }

    /// One reported failure of target `t`, flaky when its tree also passed.
    fn count_failure(&mut self, t: u32, flaky: bool) {
        let e = self.flakes.entry(t).or_default();
        e.0 += 1;
        e.1 += u32::from(flaky);
    }

    /// For a failed build whose failure known flaky targets explain (batching
    /// only: it reported its failing targets and each of them is known to be
    /// flaky), the odds it was a flake: the least flaky share among them.
    /// `None`: a real failure, as far as the records tell.
    fn flake_odds(&self, bid: Option<u64>) -> Option<f64> {
        let b = bid.and_then(|b| self.builds.get(&b))?;
        let failed = b.failed_targets.as_ref().filter(|f| self.config.batching && !f.is_empty())?;
        let mut odds: f64 = 1.0;
        for t in failed {
            let &(n, k) = self.flakes.get(t)?;
            let share = f64::from(k) / f64::from(n);
            if k == 0 || share < self.config.known_flaky_share {
                return None;
            }
            odds = odds.min(share);
        }
        Some(odds)
    }

    /// Targets that failed and later passed on the same tree, most flaky first:
    /// for `gantry queue status` and the metrics.
    pub fn flaky_targets(&self) -> Vec<FlakyTarget> {
        let names: HashMap<u32, &str> = self.targets.iter().map(|(k, &v)| (v, k.as_str())).collect();
        let mut out: Vec<FlakyTarget> = self
            .flakes
            .iter()
            .filter(|(_, v)| v.1 > 0)
            .map(|(t, &(n, k))| FlakyTarget { target: names[t].to_string(), failures: n, flaky: k })
            .collect();
        out.sort_by(|a, b| b.flaky.cmp(&a.flaky).then_with(|| a.target.cmp(&b.target)));
        out
    }

    /// Whether change `i` holds a pass that decides it whatever its pending
    /// dependencies do (batching only): a passed tree that holds every one
    /// of them. Such a change needs no more builds.
    fn certified(&self, i: usize) -> bool {
        self.config.batching
            && self.changes[i].builds.iter().any(|bid| {
                let b = &self.builds[bid];
                b.state == BuildState::Passed
                    && self.build_key(b).is_some()
                    && self.changes[i]
                        .deps
                        .iter()
                        .all(|d| self.changes[*d].status != Status::Pending || b.assumed.binary_search(d).is_ok())
            })
    }

    /// The set of pending changes a build assumes, or `None` when its
    /// assumptions can no longer all hold (the build can never be decisive).
    ///
    /// With batching (monotone failures), a passed tree stays a pass for every
    /// part of it: assumed changes that were rejected or cancelled are
    /// dropped from its key instead of voiding it.
    fn build_key(&self, b: &BuildRec) -> Option<Vec<usize>> {
        let monotone = self.config.batching && b.state == BuildState::Passed;
        for &a in &b.assumed {
            if !monotone && matches!(self.changes[a].status, Status::Rejected | Status::Cancelled | Status::Moved) {
                return None;
            }
        }
        // A dependency that landed after the base must be among the assumed
        // changes. Walk the (short) mainline suffix rather than all deps;
        // `deps` is sorted because it is collected from the ordered pending set.
        let deps = &self.changes[b.change].deps;
        for &x in self.mainline.since(b.base) {
            if deps.binary_search(&x).is_ok() && b.assumed.binary_search(&x).is_err() && self.landed(x) {
                return None;
            }
        }
        Some(b.assumed.iter().copied().filter(|&a| self.changes[a].status == Status::Pending).collect())
    }

    fn landed(&self, i: usize) -> bool {
        matches!(self.changes[i].status, Status::Landed(_))
    }

    fn key_stats(&self, i: usize) -> FastMap<Vec<usize>, KeyStat> {
        let mut m: FastMap<Vec<usize>, KeyStat> = FastMap::default();
        for bid in &self.changes[i].builds {
            let b = &self.builds[bid];
            let Some(k) = self.build_key(b) else { continue };
            let s = m.entry(k).or_default();
            match b.state {
                BuildState::Running => {
                    s.running = Some(*bid);
                    s.running_n += 1;
                }
                BuildState::Passed => s.passed = Some(*bid),
                BuildState::Failed => {
                    s.failures += 1;
                    s.last_failed = Some(*bid);
                }
                BuildState::FailedConclusively => {
                    s.failures += 1;
                    s.conclusive = true;
                    s.last_failed = Some(*bid);
                }
            }
        }
        m
    }

    fn max_attempts(&self) -> u32 {
        1 + self.config.max_retries
    }

    /// Lands or rejects every change whose decisive build is done, then lands
    /// batches, until neither finds anything more: a decision only unblocks
    /// later changes.
    fn decide(&mut self, actions: &mut Vec<Action>) {
        loop {
            self.decide_singly(actions);
            if !self.config.batching || !self.land_a_batch(actions) {
                return;
            }
        }
    }

    /// Lands the first batch (in queue order of its last change) whose tree
    /// passed: a passing build of `k` assuming the pending changes `K` decides
    /// all of `K ∪ {k}` at once when that set is closed (every pending
    /// dependency of a member is a member) and the tree is the mainline's up to
    /// independent changes for every member. It relies on failures being
    /// monotone: a tree holding a broken change or a conflicting pair fails.
    /// Returns whether a batch landed.
    fn land_a_batch(&mut self, actions: &mut Vec<Action>) -> bool {
        let mut passed: Vec<(usize, u64)> = self
            .builds
            .iter()
            .filter(|(_, b)| {
                b.state == BuildState::Passed && !b.member_only && self.changes[b.change].status == Status::Pending
            })
            .map(|(&id, b)| (b.change, id))
            .collect();
        passed.sort_unstable();
        for (k, bid) in passed {
            let b = &self.builds[&bid];
            let Some(mut members) = self.build_key(b) else { continue };
            if members.is_empty() {
                // A build of one change: `decide_singly` owns it.
                continue;
            }
            members.push(k);
            let closed = members.iter().all(|&j| {
                let deps = &self.changes[j].deps;
                deps.iter().all(|&d| self.changes[d].status != Status::Pending || members.binary_search(&d).is_ok())
                    && self.mainline.since(b.base).all(|&x| {
                        !self.landed(x) || b.assumed.binary_search(&x).is_ok() || deps.binary_search(&x).is_err()
                    })
            });
            if !closed {
                continue;
            }
            let spec = b.spec.clone();
            let batch: Vec<ChangeId> = members.iter().map(|&j| self.changes[j].id.clone()).collect();
            let since = self.landed_since_base(b);
            // Assumed changes rejected or cancelled since (monotone failures).
            let omitted: Vec<ChangeId> = b
                .assumed
                .iter()
                .filter(|&&a| members.binary_search(&a).is_err() && !self.landed(a))
                .map(|&a| self.changes[a].id.clone())
                .collect();
            for j in members {
                self.changes[j].status = Status::Landed(self.mainline.len());
                self.mainline.push(j);
                self.pending.remove(&j);
                self.record_decision(j, true, false);
                self.stats.landed += 1;
                self.stats.batch_landed += 1;
                actions.push(Action::Land {
                    change: self.changes[j].id.clone(),
                    proof: LandProof {
                        build: spec.clone(),
                        new_version: self.mainline.len() as u64,
                        landed_since_base: since.clone(),
                        batch: batch.clone(),
                        omitted: omitted.clone(),
                        by_attribution: false,
                    },
                });
            }
            self.stats.batches += 1;
            return true;
        }
        false
    }

    /// The changes that landed after `b`'s base without being in its tree
    /// (independent ones, by the landing rules): `LandProof::landed_since_base`.
    fn landed_since_base(&self, b: &BuildRec) -> Vec<ChangeId> {
        self.mainline
            .since(b.base)
            .filter(|&&c| b.assumed.binary_search(&c).is_err() && self.landed(c))
            .map(|&c| self.changes[c].id.clone())
            .collect()
    }

    /// One pass in queue order deciding each change by a build of its own.
    fn decide_singly(&mut self, actions: &mut Vec<Action>) {
        let order: Vec<usize> = self.pending.iter().copied().collect();
        for i in order {
            // Newest dependencies first: they are the ones most likely still pending.
            if self.changes[i].deps.iter().rev().any(|&d| self.changes[d].status == Status::Pending) {
                continue;
            }
            let stats = self.key_stats(i);
            let Some(s) = stats.get(&Vec::new()) else { continue };
            if let Some(bid) = s.passed {
                let b = &self.builds[&bid];
                let since = self.landed_since_base(b);
                let spec = b.spec.clone();
                let by_attribution = b.member_only;
                // Members of the tested tree not on the mainline it lands on:
                // rejected or cancelled ones, and (for a pass by attribution)
                // those after this change.
                let omitted: Vec<ChangeId> = spec
                    .assumed
                    .iter()
                    .chain([&spec.change])
                    .filter(|&x| *x != self.changes[i].id && self.by_id.get(x).is_none_or(|&j| !self.landed(j)))
                    .cloned()
                    .collect();
                self.changes[i].status = Status::Landed(self.mainline.len());
                self.mainline.push(i);
                self.pending.remove(&i);
                self.record_decision(
                    i,
                    true,
                    stats.len() > 1 && stats.values().any(|k| k.confirmed_failed(self.max_attempts())),
                );
                self.stats.landed += 1;
                actions.push(Action::Land {
                    change: self.changes[i].id.clone(),
                    proof: LandProof {
                        build: spec,
                        new_version: self.mainline.len() as u64,
                        landed_since_base: since,
                        batch: Vec::new(),
                        omitted,
                        by_attribution,
                    },
                });
            } else if s.confirmed_failed(self.max_attempts()) {
                let bid = s.last_failed.expect("failures recorded");
                let attempts = s.failures;
                let spec = self.builds[&bid].spec.clone();
                self.changes[i].status = Status::Rejected;
                self.pending.remove(&i);
                self.record_decision(i, false, stats.values().any(|k| k.passed.is_some()));
                self.stats.rejected += 1;
                actions.push(Action::Reject {
                    change: self.changes[i].id.clone(),
                    reason: RejectReason { build: spec, attempts },
                });
            }
        }
    }

    /// Adds a training example and updates author and conflict statistics.
    /// `conflict_evidence`: the change both passed and failed on different
    /// assumption sets, which only a conflict explains (flakes are retried).
    fn record_decision(&mut self, i: usize, landed: bool, conflict_evidence: bool) {
        if let Some(passed) = self.changes[i].learned {
            let k = usize::from(passed);
            self.learned_decided[k] += 1.0;
            self.learned_landed[k] += f64::from(u8::from(landed));
        }
        let ch = &self.changes[i];
        let author_rate = self.author_rate(&ch.features.author);
        // The snapshot taken when the decisive result arrived already reflects
        // the outcome; everything before it was genuinely uncertain.
        let n_snap = ch.snapshots.len().saturating_sub(1).max(1);
        let xs: Vec<FeatureVector> =
            ch.snapshots[..n_snap].iter().map(|&(p, f)| FeatureVector::new(&ch.features, author_rate, p, f)).collect();
        let dep_landed = ch.deps.iter().filter(|&&d| matches!(self.changes[d].status, Status::Landed(_))).count();
        self.conflict_pairs += dep_landed as f64;
        if conflict_evidence {
            self.conflict_events += 1.0;
        }
        let author = ch.features.author.clone();
        let w = self.authors.entry(author).or_default();
        w.push_back(landed);
        while w.len() > self.config.author_window {
            w.pop_front();
        }
        for x in xs {
            self.history.push_back(TrainingExample { features: x, landed });
        }
        while self.history.len() > self.config.max_history {
            self.history.pop_front();
        }
        self.decisions_since_train += 1;
        if self.decisions_since_train >= self.config.retrain_every
            && self.history.len() >= self.config.min_training_examples
        {
            self.decisions_since_train = 0;
            let examples: Vec<TrainingExample> = self.history.iter().cloned().collect();
            // A one-sided history cannot be fitted; keep the previous model.
            if let Ok(m) = LogisticModel::train(&examples, &self.config.train) {
                self.model = Some(m);
                self.stats.retrains += 1;
            }
        }
    }

    fn author_rate(&self, author: &str) -> f64 {
        let (succ, n) = self
            .authors
            .get(author)
            .map(|w| (w.iter().filter(|&&b| b).count() as f64, w.len() as f64))
            .unwrap_or((0.0, 0.0));
        // Two pseudo-observations at the prior keep new authors near it.
        (succ + 2.0 * self.config.prior_success) / (n + 2.0)
    }

    /// Mean duration of finished builds, once any finished.
    pub fn mean_build_ms(&self) -> Option<f64> {
        (self.duration_n > 0.0).then(|| self.duration_sum / self.duration_n)
    }

    /// Learned P(a retry passes | the first attempt of the same tree failed).
    pub fn retry_pass_rate(&self) -> f64 {
        prior_weighted(
            self.config.prior_retry_pass,
            self.config.flake_prior_weight,
            self.retry_passes,
            self.retry_trials,
        )
    }

    /// Learned P(conflict) for a dependent pair: prior-weighted rate.
    pub fn conflict_rate(&self) -> f64 {
        prior_weighted(
            self.config.prior_conflict,
            self.config.conflict_prior_weight,
            self.conflict_events,
            self.conflict_pairs,
        )
    }

    fn success_probability(&self, i: usize) -> f64 {
        let ch = &self.changes[i];
        if let Some(p) = ch.success_override {
            return p;
        }
        if let (true, Some(passed)) = (self.config.learn_alone, ch.learned) {
            return self.learned_rate(passed);
        }
        match &self.model {
            Some(m) => m.predict(&FeatureVector::new(
                &ch.features,
                self.author_rate(&ch.features.author),
                ch.spec_passed,
                ch.spec_failed,
            )),
            None => self.config.prior_success,
        }
    }

    /// Cancels running builds that can no longer be decisive (their change is
    /// decided or cancelled, an assumption became false, or the same
    /// assumption set already passed), and forgets dead build records.
    fn cleanup(&mut self, actions: &mut Vec<Action>) {
        let mut cancel = Vec::new();
        let mut forget = Vec::new();
        let mut passed_keys: HashSet<(usize, Vec<usize>)> = HashSet::new();
        for b in self.builds.values() {
            if b.state == BuildState::Passed
                && self.changes[b.change].status == Status::Pending
                && let Some(k) = self.build_key(b)
            {
                passed_keys.insert((b.change, k));
            }
        }
        for (&bid, b) in &self.builds {
            let dead = self.changes[b.change].status != Status::Pending;
            let key = if dead { None } else { self.build_key(b) };
            let running = b.state == BuildState::Running;
            // A build on the mainline alone still tells its change's own outcome once a
            // dependency landed, though it can no longer decide it (`learn_alone`).
            let learning =
                self.config.learn_alone && !dead && b.assumed.is_empty() && self.changes[b.change].learned.is_none();
            match key {
                None if running && learning => {}
                None if running => cancel.push(bid),
                None => forget.push(bid),
                Some(k) => {
                    if running && passed_keys.contains(&(b.change, k)) {
                        cancel.push(bid);
                    }
                }
            }
        }
        for bid in cancel {
            self.running.remove(&bid);
            self.stats.builds_cancelled += 1;
            actions.push(Action::CancelBuild { id: BuildId(bid) });
            forget.push(bid);
        }
        for bid in forget {
            if let Some(b) = self.builds.remove(&bid) {
                self.changes[b.change].builds.retain(|&x| x != bid);
            }
        }
    }

    /// π for every pending change, in queue order (see module docs).
    fn probabilities(&self) -> (Vec<usize>, Vec<f64>) {
        let (order, pi, _) = self.probabilities_full();
        (order, pi)
    }

    /// π, plus each change's P(pass) on its most likely tree (ignoring
    /// finished builds), which prices hedged retries.
    fn probabilities_full(&self) -> (Vec<usize>, Vec<f64>, Vec<f64>) {
        let order: Vec<usize> = self.pending.iter().copied().collect();
        let pos = PosMap::new(&self.changes, &order);
        let c_default = self.conflict_rate();
        let mut pi = vec![0.0; order.len()];
        let mut bases = vec![0.0; order.len()];
        let blame = self.blame(&order, &pos);
        for (p, &i) in order.iter().enumerate() {
            let mut pdeps = Vec::new();
            let mut mf = 1.0;
            let mut mf_override = 1.0;
            for &d in &self.changes[i].deps {
                // Dependencies that already landed are certain (π = 1): the
                // change still has to survive a possible conflict with them.
                let p_lands = match (pos.get(&d), self.changes[d].status) {
                    (Some(&q), _) => {
                        pdeps.push(q);
                        pi[q]
                    }
                    (None, Status::Landed(_)) => 1.0,
                    (None, _) => continue,
                };
                match self.conflict_override.get(&(i, d)) {
                    Some(&c) => mf_override *= 1.0 - p_lands * c,
                    None => mf *= 1.0 - p_lands * c_default,
                }
            }
            if self.config.model_includes_conflicts
                && self.model.is_some()
                && self.changes[i].success_override.is_none()
            {
                mf = 1.0;
            }
            let mf = mf.max(1.0 - self.config.max_conflict_probability) * mf_override;
            let base = self.success_probability(i) * mf * blame[p];
            bases[p] = base;
            let retry_pass = self.retry_pass_rate();
            let mut known_mass = 0.0;
            let mut pass_mass = 0.0;
            // With batching, a pass holds for every part of its tree: it
            // decides the change unless a dependency outside it lands.
            let mut certain: f64 = 0.0;
            if !self.changes[i].builds.is_empty() {
                for (k, s) in self.key_stats(i) {
                    if self.config.batching && s.passed.is_some() {
                        let held: f64 = pdeps
                            .iter()
                            .filter(|&&q| k.binary_search(&order[q]).is_err())
                            .map(|&q| 1.0 - pi[q])
                            .product();
                        certain = certain.max(held);
                    }
                    // P(this assumption set passes eventually): certain after a
                    // pass or confirmed failure; after an unconfirmed failure,
                    // only a flake would save it.
                    let p_pass = if s.passed.is_some() {
                        1.0
                    } else if s.failures == 0 {
                        continue;
                    } else if s.confirmed_failed(self.max_attempts()) {
                        0.0
                    } else {
                        // Known flaky targets make a flake likelier than usual.
                        self.flake_odds(s.last_failed).unwrap_or(0.0).max(retry_pass)
                    };
                    let mut pk = 1.0;
                    for &q in &pdeps {
                        pk *= if k.binary_search(&order[q]).is_ok() { pi[q] } else { 1.0 - pi[q] };
                    }
                    known_mass += pk;
                    pass_mass += pk * p_pass;
                }
            }
            pi[p] = (pass_mass + (1.0 - known_mass).max(0.0) * base).max(certain).clamp(0.0, 1.0);
        }
        (order, pi, bases)
    }

    /// Starts a build of change `i` assuming the pending changes `key` (sorted)
    /// on the current mainline, and returns its id.
    fn start_build(&mut self, now: Millis, i: usize, key: Vec<usize>, attempt: u32, actions: &mut Vec<Action>) -> u64 {
        let id = self.next_build;
        self.next_build += 1;
        let spec = BuildSpec {
            id: BuildId(id),
            change: self.changes[i].id.clone(),
            base_version: self.mainline.len() as u64,
            assumed: key.iter().map(|&a| self.changes[a].id.clone()).collect(),
            attempt,
        };
        self.builds.insert(
            id,
            BuildRec {
                spec: spec.clone(),
                change: i,
                assumed: key,
                base: self.mainline.len(),
                state: BuildState::Running,
                started: now,
                member_only: false,
                implicated: None,
                failed_targets: None,
                flake_counted: false,
            },
        );
        self.changes[i].builds.push(id);
        self.running.insert(id);
        self.stats.builds_started += 1;
        actions.push(Action::StartBuild { build: spec });
        id
    }

    /// Fills free slots with batch trees, under a backlog with batching.
    ///
    /// Walking the pending changes in queue order, skipping those already in
    /// the tree of a running build, a change more likely rejected than landed
    /// is built on its own (and left out of every other tree, which assume it
    /// rejected); the others are cut into batches of `target` changes (the
    /// backlog per slot, at most `max_batch`), shorter where the batch's
    /// predicted P(pass) would fall below `batch_min_pass`. A batch's tree is
    /// its changes plus every pending change they depend on and expect to
    /// land, so it decides them all when it passes (`land_a_batch`), lanes of
    /// independent changes included. A batch whose tree already failed is
    /// halved, and halved again, until its tree is new: bisection. The last,
    /// short batch waits to fill for up to a typical build's duration.
    ///
    /// Returns the slots still free. The caller gives them to per-change
    /// speculation: under a backlog an idle slot is pure loss, and the batch
    /// trees leave slots free whenever every change is already in a running
    /// tree, or waits for the decisions ahead of it.
    fn schedule_batches(
        &mut self,
        now: Millis,
        order: &[usize],
        pos: &PosMap,
        pi: &[f64],
        mut free: usize,
        actions: &mut Vec<Action>,
    ) -> usize {
        let n = order.len();
        if free == 0 || n == 0 {
            return free;
        }
        let target = if self.config.fixed_batches {
            self.config.max_batch.max(1)
        } else {
            (n as f64 / self.config.capacity.max(1) as f64).ceil().clamp(1.0, self.config.max_batch.max(1) as f64)
                as usize
        };
        let patience = self.mean_build_ms().unwrap_or(0.0) as u64;
        // A running tree holds its changes in flight, unless its own change is
        // expected to fail: such a tree decides nothing for the others.
        let mut in_flight = vec![false; n];
        for (p, &c) in order.iter().enumerate() {
            // Passed by attribution on a tree that holds all it waits for.
            in_flight[p] = self.certified(c);
        }
        for bid in &self.running {
            let b = &self.builds[bid];
            if pos.get(&b.change).is_some_and(|&q| pi[q] < 0.5) {
                continue;
            }
            if let Some(key) = self.build_key(b) {
                for m in key.iter().chain([&b.change]) {
                    if let Some(&q) = pos.get(m) {
                        in_flight[q] = true;
                    }
                }
            }
        }
        // Bypass: a member of a failed tree that no other member depends on,
        // and that depends on none of them, can neither be the culprit of the
        // others nor theirs. It is not held by their bisection: it is built
        // alone, ahead of the other batches (its own lane).
        let mut bypass = vec![false; n];
        for b in self.builds.values() {
            if !matches!(b.state, BuildState::Failed | BuildState::FailedConclusively) || b.assumed.is_empty() {
                continue;
            }
            let members: Vec<usize> = b.assumed.iter().copied().chain([b.change]).collect();
            for &m in &members {
                if let Some(&q) = pos.get(&m)
                    && !bypass[q]
                    && members.iter().all(|&o| {
                        o == m
                            || (self.changes[m].deps.binary_search(&o).is_err()
                                && self.changes[o].deps.binary_search(&m).is_err())
                    })
                {
                    bypass[q] = true;
                }
            }
        }
        let min = self.config.batch_min_pass;
        let mut groups: Vec<Vec<usize>> = Vec::new();
        // The current batch, its tree so far (`seen`) and that tree's P(pass).
        let (mut cur, mut cur_pass): (Vec<usize>, f64) = (Vec::new(), 1.0);
        let mut seen = vec![false; n];
        // The changes p's tree adds to a tree `seen`: p and, transitively,
        // the pending dependencies expected to land; and their P(pass). Stops
        // early once that falls below `floor` (the caller then drops p).
        let mut stamp = vec![0u32; n];
        let mut round = 0u32;
        let mut grow = |p: usize, seen: &[bool], floor: f64| -> (Vec<usize>, f64) {
            round += 1;
            stamp[p] = round;
            let (mut added, mut pass) = (vec![p], pi[p]);
            let mut i = 0;
            while i < added.len() && pass >= floor {
                for d in &self.changes[order[added[i]]].deps {
                    if let Some(&q) = pos.get(d)
                        && pi[q] >= 0.5
                        && !seen[q]
                        && stamp[q] != round
                    {
                        stamp[q] = round;
                        added.push(q);
                        pass *= pi[q];
                    }
                }
                i += 1;
            }
            (added, pass)
        };
        for p in 0..n {
            // Enough candidates for the free slots, with room for some that
            // cannot start.
            if groups.len() > 2 * free + 4 {
                break;
            }
            if in_flight[p] {
                continue;
            }
            if bypass[p] {
                // Independent of the batch being cut too: it does not end it.
                groups.push(vec![p]);
                continue;
            }
            if pi[p] < 0.5 {
                // It ends the batch before it: that batch can land without
                // waiting for its decision, which in turn needs that batch.
                if !cur.is_empty() {
                    groups.push(std::mem::take(&mut cur));
                    (cur_pass, seen) = (1.0, vec![false; n]);
                }
                groups.push(vec![p]);
                continue;
            }
            let (mut added, mut pass) = grow(p, &seen, if cur.is_empty() { min } else { min / cur_pass });
            if !cur.is_empty() && (cur.len() >= target || cur_pass * pass < min) {
                groups.push(std::mem::take(&mut cur));
                (cur_pass, seen) = (1.0, vec![false; n]);
                (added, pass) = grow(p, &seen, min);
            }
            // A tree unlikely to pass (a long chain of undecided changes
            // ahead) waits for the changes ahead to be decided.
            if pass < min {
                continue;
            }
            for q in added {
                seen[q] = true;
            }
            cur.push(p);
            cur_pass *= pass;
        }
        if !cur.is_empty() {
            let oldest = cur.iter().map(|&p| self.changes[order[p]].enqueued.0).min().unwrap_or(now.0);
            if cur.len() >= target || now.0.saturating_sub(oldest) >= patience {
                groups.push(cur);
            }
        }
        // The most urgent first, then the bypassing changes, then queue order.
        groups.sort_by_key(|g| {
            (std::cmp::Reverse(g.iter().map(|&p| self.changes[order[p]].priority).max()), !bypass[g[0]], g[0])
        });
        let max_attempts = self.max_attempts();
        for mut g in groups {
            if free == 0 {
                break;
            }
            // A failure every failing target of which is known to be flaky is
            // tried again whole, while attempts remain, instead of bisected.
            let flaky =
                |s: &KeyStat| self.flake_odds(s.last_failed).is_some() && s.may_attempt(max_attempts, s.running_n);
            let mut halved = false;
            let (k, key, stats) = loop {
                let (k, key) = self.batch_tree(&g, order, pos, pi);
                let stats = self.key_stats(k);
                let failed = stats.get(&key).is_some_and(|s| s.failures > 0 && s.passed.is_none() && !flaky(s));
                if failed && g.len() > 1 && !key.is_empty() {
                    g.truncate(g.len().div_ceil(2));
                    halved = true;
                    continue;
                }
                break (k, key, stats);
            };
            // A failed tree of several changes is split, not retried; a
            // change's own tree is retried before it is rejected.
            //
            // A change told that it fails (its success overridden, and its
            // landing probability 0: its own success is 0, or it conflicts with
            // a change certain to land), before any build of it failed, whose
            // tree holds only changes certain to land, is built alone on that
            // tree, every attempt the retry rule asks for at once, without
            // waiting for its dependencies to be decided: once they land, those
            // failures are on its final tree and reject it, and the changes
            // behind it stop waiting one build later instead of one build per
            // attempt. Predictions never qualify (a blamed change's tree may
            // still change, and the attempts on the old one would be wasted).
            let certain_failure = g.len() == 1
                && pi[g[0]] <= 0.0
                && self.changes[order[g[0]]].success_override.is_some()
                && key.iter().all(|m| pos.get(m).is_some_and(|&q| pi[q] >= 1.0))
                && self.changes[order[g[0]]]
                    .builds
                    .iter()
                    .all(|b| !matches!(self.builds[b].state, BuildState::Failed | BuildState::FailedConclusively));
            let attempt = match stats.get(&key) {
                None => 1,
                Some(s)
                    if (s.running_n == 0 || certain_failure)
                        && s.may_attempt(max_attempts, s.running_n)
                        && (key.is_empty() || certain_failure || s.failures == 0 || flaky(s)) =>
                {
                    s.failures + s.running_n + 1
                }
                Some(_) => continue,
            };
            if attempt > 1 && !key.is_empty() && !certain_failure {
                self.stats.flaky_retries += 1;
            }
            self.stats.bisection_builds += u64::from(halved);
            // A certain failure also starts its remaining attempts, as slots allow.
            let last =
                if certain_failure { max_attempts.min(attempt.saturating_add(free as u32 - 1)) } else { attempt };
            for a in attempt..last {
                self.start_build(now, k, key.clone(), a, actions);
            }
            self.start_build(now, k, key, last, actions);
            free -= (last - attempt + 1) as usize;
        }
        // Liveness: a change with no pending dependency (the head of its
        // lane) not in any running tree gets a build of its own, which decides
        // it. Batches whose trees failed wait on such decisions.
        for p in 0..n {
            if free == 0 {
                break;
            }
            let c = order[p];
            if in_flight[p] || self.changes[c].deps.iter().any(|d| pos.get(d).is_some()) {
                continue;
            }
            let attempt = match self.key_stats(c).get(&Vec::new()) {
                None => 1,
                Some(s) if s.running_n == 0 && s.may_attempt(max_attempts, 0) => s.failures + 1,
                Some(_) => continue,
            };
            self.start_build(now, c, Vec::new(), attempt, actions);
            free -= 1;
        }
        free
    }

    /// The tree of a batch (positions in the pending order): its last change,
    /// and as assumed changes the others plus every pending change any of
    /// them depends on and expects to land, transitively (sorted indices).
    fn batch_tree(&self, group: &[usize], order: &[usize], pos: &PosMap, pi: &[f64]) -> (usize, Vec<usize>) {
        let last = *group.last().expect("groups are not empty");
        let mut seen = vec![false; last + 1];
        let mut stack: Vec<usize> = group.to_vec();
        for &p in group {
            seen[p] = true;
        }
        while let Some(p) = stack.pop() {
            for d in &self.changes[order[p]].deps {
                if let Some(&q) = pos.get(d)
                    && pi[q] >= 0.5
                    && !seen[q]
                {
                    seen[q] = true;
                    stack.push(q);
                }
            }
        }
        // Positions follow change indices, so the key comes out sorted.
        (order[last], (0..last).filter(|&q| seen[q]).map(|q| order[q]).collect())
    }

    /// Per pending position, the factor by which failed trees it was assumed
    /// in lower its P(passes). With batching the build steps run on the whole
    /// tree, so a failure blames every member, not only the change whose build
    /// it was (that one's own results are in its key statistics). For a failed
    /// tree of members with P(pass) `p_m` and `P = Π p_m`, member `j` is fine
    /// with probability `r + (1 − r)·(1 − P/p_j)/(1 − P)` relative to its
    /// prior, where `r` is the chance the failure was a flake: the posterior
    /// of "some other member broke it". Trees are treated as independent.
    fn blame(&self, order: &[usize], pos: &PosMap) -> Vec<f64> {
        let mut factor = vec![1.0; order.len()];
        if !self.config.batching {
            return factor;
        }
        // (the build's own change, the members the failure may blame).
        let mut trees: BTreeSet<(usize, Vec<usize>)> = BTreeSet::new();
        for (&bid, b) in &self.builds {
            let failed = matches!(b.state, BuildState::Failed | BuildState::FailedConclusively);
            // Known flaky targets explain the failure: it blames no one.
            if failed && self.flake_odds(Some(bid)).is_some() {
                continue;
            }
            if (failed || b.implicated.is_some())
                && self.changes[b.change].status == Status::Pending
                && let Some(mut key) = self.build_key(b)
            {
                key.push(b.change);
                if let Some(implicated) = &b.implicated {
                    // Attribution: only the members whose targets failed.
                    key.retain(|m| implicated.contains(m));
                }
                // A failure the build's own change alone is blamed for is
                // already in its key statistics.
                if key.iter().any(|&m| m != b.change) {
                    trees.insert((b.change, key));
                }
            }
        }
        if trees.is_empty() {
            return factor;
        }
        let r = self.retry_pass_rate();
        // Smallest trees first, each update using the posteriors so far: once a
        // small failed tree has blamed its culprit, the larger trees holding it
        // are already explained and barely blame their other members.
        let mut trees: Vec<(usize, Vec<usize>)> = trees
            .into_iter()
            .map(|(k, key)| {
                (pos.get(&k).copied().unwrap_or(usize::MAX), key.iter().filter_map(|m| pos.get(m).copied()).collect())
            })
            .collect();
        trees.sort_by_key(|(_, members): &(usize, Vec<usize>)| members.len());
        let mut q: Vec<Option<f64>> = vec![None; order.len()];
        for (own, members) in trees {
            let mut p_all = 1.0;
            for &m in &members {
                p_all *= *q[m].get_or_insert_with(|| self.success_probability(order[m]));
            }
            if 1.0 - p_all < 1e-9 {
                continue;
            }
            for &m in &members {
                let p_m = q[m].expect("computed above");
                if p_m <= 0.0 {
                    continue;
                }
                let f = r + (1.0 - r) * (1.0 - p_all / p_m) / (1.0 - p_all);
                q[m] = Some(p_m * f);
                if m != own {
                    factor[m] *= f;
                }
            }
        }
        factor
    }

    fn view(&self, i: usize, pos: &PosMap, pi: &[f64]) -> View {
        let pdeps: Vec<usize> = self.changes[i].deps.iter().filter_map(|d| pos.get(d).copied()).collect();
        let main: Vec<bool> = match self.config.strategy {
            Strategy::Value => pdeps.iter().map(|&q| pi[q] >= 0.5).collect(),
            Strategy::SpeculateAll | Strategy::Optimistic => vec![true; pdeps.len()],
        };
        // Without builds the (empty) stats are already exact.
        let stats_ready = self.changes[i].builds.is_empty();
        View { pdeps, main, flip_order: None, stats: FastMap::default(), stats_ready }
    }

    fn ensure_stats(&self, view: &mut View, i: usize) {
        if !view.stats_ready {
            view.stats = self.key_stats(i);
            view.stats_ready = true;
        }
    }

    fn quantize(&self, v: f64) -> f64 {
        let q = self.config.value_quantum;
        if q > 0.0 {
            (v / q).floor() * q
        } else {
            v
        }
    }

    /// Fills free capacity with the best candidates.
    fn schedule(&mut self, now: Millis, actions: &mut Vec<Action>) {
        let mut free = self.config.capacity.saturating_sub(self.running.len());
        let strategy = self.config.strategy;
        // Backlog: more pending changes than slots. Every slot then has a
        // queue of certain work waiting for it, so a speculative alternative
        // costs a needed build; speculate on the most likely path only, and
        // neither preempt nor hedge (with batching, a change told that it
        // fails still runs its attempts together: `schedule_batches`).
        let overloaded = strategy == Strategy::Value
            && self
                .config
                .overload_pending_factor
                .is_some_and(|f| self.pending.len() as f64 > f * self.config.capacity as f64);
        let preempt = strategy == Strategy::Value && self.config.preempt_factor.is_some() && !overloaded;
        if self.pending.is_empty() || (free == 0 && !preempt) {
            return;
        }
        // Only value ranking needs probabilities; the baselines skip the O(edges) pass.
        let (order, pi, bases) = if strategy == Strategy::Value {
            self.probabilities_full()
        } else {
            let order: Vec<usize> = self.pending.iter().copied().collect();
            let n = order.len();
            (order, vec![1.0; n], vec![1.0; n])
        };
        let hedge = strategy == Strategy::Value && self.config.hedge_retries && !overloaded;
        // Under a backlog a slot spent learning is a needed build not started.
        let learn = strategy == Strategy::Value && self.config.learn_alone && !overloaded;
        let window = match self.config.overload_window {
            Some(w) if overloaded => (w * self.config.capacity as f64).ceil() as usize,
            _ => usize::MAX,
        };
        let pos = PosMap::new(&self.changes, &order);
        // Deciding a change also unblocks every pending change that waits for
        // it, so rank by value times (1 + w·direct dependents): the expected
        // number of decisions the build can advance.
        let mut weight = vec![1.0; order.len()];
        if strategy == Strategy::Value && self.config.blocking_weight > 0.0 {
            for &i in &order {
                for d in &self.changes[i].deps {
                    if let Some(&q) = pos.get(d) {
                        weight[q] += self.config.blocking_weight;
                    }
                }
            }
        }
        // Under a backlog with batching (always, with fixed batches), slots go to
        // batch trees first; with adaptive batching, what they leave goes to the
        // per-change candidates below.
        if self.config.batching && (overloaded || self.config.fixed_batches) {
            free = self.schedule_batches(now, &order, &pos, &pi, free, actions);
            if free == 0 || self.config.fixed_batches || self.config.hold_free_slots {
                return;
            }
        }
        let mut views: Vec<Option<View>> = (0..order.len()).map(|_| None).collect();
        let mut heap = BinaryHeap::new();
        for (p, &i) in order.iter().enumerate() {
            // Decided once its dependencies are; no build can add to that.
            let certified = self.certified(i);
            if strategy == Strategy::Value {
                let view = self.view(i, &pos, &pi);
                let main_value: f64 =
                    view.pdeps.iter().zip(&view.main).map(|(&q, &m)| if m { pi[q] } else { 1.0 - pi[q] }).product();
                // Under overload, changes deep in the queue wait unless their
                // build is nearly certain to be needed (e.g. an independent lane).
                let urgency = self.changes[i].priority;
                if !certified && (p < window || main_value >= self.config.overload_certain || urgency > 0) {
                    heap.push(Cand {
                        urgency,
                        prio: self.quantize(main_value) * weight[p],
                        pos: p,
                        flips: Vec::new(),
                        value: main_value,
                        hedge: false,
                        learn: false,
                    });
                }
                if learn && !certified && self.wants_to_learn(i, &view) {
                    // Valued at the chance that its own steps fail, which every tree
                    // assuming it (its own, and those of the changes behind it) now
                    // prices at the model's guess, times the chance that its most
                    // likely tree is wrong: a change whose tree is nearly certain is
                    // decided by that build soon enough.
                    let v = (1.0 - self.success_probability(i)) * (1.0 - main_value);
                    heap.push(Cand {
                        urgency: 0,
                        prio: self.quantize(v) * weight[p],
                        pos: p,
                        flips: Vec::new(),
                        value: v,
                        hedge: false,
                        learn: true,
                    });
                }
                views[p] = Some(view);
            } else if !certified {
                // Baselines rank by queue position only; views are built on demand.
                heap.push(Cand {
                    urgency: self.changes[i].priority,
                    prio: 0.0,
                    pos: p,
                    flips: Vec::new(),
                    value: 1.0,
                    hedge: false,
                    learn: false,
                });
            }
        }
        let max_attempts = self.max_attempts();
        // Running builds by current value, cheapest first: the preemption victims.
        let mut victims: Vec<(f64, u64, usize, Vec<usize>)> = Vec::new();
        if preempt {
            for &bid in &self.running {
                let b = &self.builds[&bid];
                let (Some(&p), Some(key)) = (pos.get(&b.change), self.build_key(b)) else { continue };
                let view = views[p].as_mut().expect("value strategy builds every view");
                self.ensure_stats(view, b.change);
                // A concurrent extra attempt is only needed if the other one fails.
                let hedged = b.spec.attempt > 1 && view.stats.get(&key).is_some_and(|s| s.running_n > 1);
                let p_needed = if hedged { 1.0 - bases[p] } else { 1.0 };
                let v: f64 = p_needed
                    * view
                        .pdeps
                        .iter()
                        .map(|&q| if key.binary_search(&order[q]).is_ok() { pi[q] } else { 1.0 - pi[q] })
                        .product::<f64>();
                // Value per remaining slot-time: sunk work is not wasted by finishing.
                let remaining = match self.mean_build_ms() {
                    Some(mean) => (1.0 - now.0.saturating_sub(b.started.0) as f64 / mean).max(0.05),
                    None => 1.0,
                };
                victims.push((v * weight[p] / remaining, bid, p, key));
            }
            // Cheapest first; among equals, the newest build (least sunk work).
            victims.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
        }
        let factor = self.config.preempt_factor.unwrap_or(f64::INFINITY);
        let max_flips = match strategy {
            Strategy::Value if overloaded => 0,
            Strategy::Value => self.config.max_flips.unwrap_or(usize::MAX),
            _ => usize::MAX,
        };
        let min_gain = self.config.preempt_min_gain;
        let mut next_victim = 0;
        while free > 0 || (preempt && next_victim < victims.len()) {
            let Some(c) = heap.pop() else { break };
            if strategy == Strategy::Value && c.value <= self.config.min_value {
                // Values only decrease along each change's enumeration, but a
                // quantised priority may hide a later non-zero one; skip, don't stop.
                continue;
            }
            if c.learn {
                // Never worth preempting a build that may decide something.
                if free == 0 {
                    continue;
                }
                let i = order[c.pos];
                let view = views[c.pos].get_or_insert_with(|| self.view(i, &pos, &pi));
                // Its most likely trees, popped since, may include the mainline alone.
                if !self.wants_to_learn(i, view) {
                    continue;
                }
                self.ensure_stats(view, i);
                let id = self.start_build(now, i, Vec::new(), 1, actions);
                self.stats.learn_builds += 1;
                views[c.pos].as_mut().expect("built above").stats.entry(Vec::new()).or_default().started(id);
                free -= 1;
                continue;
            }
            let (key, startable) = {
                let view = views[c.pos].get_or_insert_with(|| self.view(order[c.pos], &pos, &pi));
                self.ensure_stats(view, order[c.pos]);
                // Key: assumed-landed set after applying the flips to the main assignment.
                let mut assign = view.main.clone();
                if let Some((ord, _)) = &view.flip_order {
                    for &f in &c.flips {
                        let k = ord[f as usize] as usize;
                        assign[k] = !assign[k];
                    }
                }
                let mut key: Vec<usize> =
                    view.pdeps.iter().zip(&assign).filter(|(_, a)| **a).map(|(&q, _)| order[q]).collect();
                key.sort_unstable();
                let startable = match (c.hedge, view.stats.get(&key)) {
                    (false, None) => Some(1),
                    (false, Some(s)) if s.running_n == 0 && s.may_attempt(max_attempts, 0) => Some(s.failures + 1),
                    (true, Some(s)) if s.running_n > 0 && s.may_attempt(max_attempts, s.running_n) => {
                        Some(s.failures + s.running_n + 1)
                    }
                    _ => None,
                };
                // Offer a concurrent retry of a first attempt that is (or is
                // about to be) running: if the first attempt fails, the
                // confirmation arrives with it instead of one build later.
                let can_hedge = match view.stats.get(&key) {
                    _ if c.hedge || !hedge => false,
                    None => startable.is_some() && max_attempts > 1,
                    Some(s) => s.may_attempt(max_attempts, s.running_n + u32::from(startable.is_some())),
                };
                if can_hedge {
                    let v = c.value * (1.0 - bases[c.pos]);
                    heap.push(Cand {
                        urgency: 0,
                        prio: self.quantize(v) * weight[c.pos],
                        pos: c.pos,
                        flips: c.flips.clone(),
                        value: v,
                        hedge: true,
                        learn: false,
                    });
                }
                (key, startable)
            };
            if startable.is_some() && free == 0 {
                // Only worth it if the candidate is clearly more likely to be
                // needed than the least valuable running build.
                let Some((v, bid, vp, vkey)) = victims.get(next_victim).cloned() else { break };
                if c.prio < v * factor || c.prio - v < min_gain {
                    break;
                }
                next_victim += 1;
                self.running.remove(&bid);
                if let Some(b) = self.builds.remove(&bid) {
                    self.changes[b.change].builds.retain(|&x| x != bid);
                }
                if let Some(vv) = views[vp].as_mut()
                    && let Some(st) = vv.stats.get_mut(&vkey)
                {
                    st.running = None;
                    st.running_n = st.running_n.saturating_sub(1);
                }
                self.stats.builds_cancelled += 1;
                self.stats.builds_preempted += 1;
                actions.push(Action::CancelBuild { id: BuildId(bid) });
                free += 1;
            }
            let view = views[c.pos].as_mut().expect("view built above");
            if let Some(attempt) = startable {
                let id = self.start_build(now, order[c.pos], key.clone(), attempt, actions);
                view.stats.entry(key).or_default().started(id);
                free -= 1;
            }
            if strategy == Strategy::Optimistic || view.pdeps.is_empty() || c.hedge {
                continue;
            }
            // Successors in the k-best subset enumeration: from a flip set
            // ending at t, "extend with t+1" and "replace t by t+1".
            if view.flip_order.is_none() {
                let mut idx: Vec<u32> = (0..view.pdeps.len() as u32).collect();
                let ratio = |k: usize| -> f64 {
                    if strategy != Strategy::Value {
                        return 1.0;
                    }
                    let p = pi[view.pdeps[k]];
                    let (hi, lo) = if view.main[k] { (p, 1.0 - p) } else { (1.0 - p, p) };
                    if hi > 0.0 {
                        lo / hi
                    } else {
                        0.0
                    }
                };
                let ratios_raw: Vec<f64> = (0..view.pdeps.len()).map(ratio).collect();
                idx.sort_by(|&a, &b| ratios_raw[b as usize].total_cmp(&ratios_raw[a as usize]).then(a.cmp(&b)));
                let ratios = idx.iter().map(|&k| ratios_raw[k as usize]).collect();
                view.flip_order = Some((idx, ratios));
            }
            let (_, ratios) = view.flip_order.as_ref().expect("just built");
            let d = ratios.len() as u32;
            let t = c.flips.last().copied();
            let next = t.map_or(0, |t| t + 1);
            if next < d {
                if c.flips.len() < max_flips {
                    let mut ext = c.flips.clone();
                    ext.push(next);
                    let v = c.value * ratios[next as usize];
                    let prio = if strategy == Strategy::Value { self.quantize(v) * weight[c.pos] } else { 0.0 };
                    heap.push(Cand { urgency: 0, prio, pos: c.pos, flips: ext, value: v, hedge: false, learn: false });
                }
                if let Some(t) = t {
                    let mut rep = c.flips.clone();
                    *rep.last_mut().expect("non-empty") = next;
                    let rt = ratios[t as usize];
                    let v = if rt > 0.0 { c.value / rt * ratios[next as usize] } else { 0.0 };
                    let prio = if strategy == Strategy::Value { self.quantize(v) * weight[c.pos] } else { 0.0 };
                    heap.push(Cand { urgency: 0, prio, pos: c.pos, flips: rep, value: v, hedge: false, learn: false });
                }
            }
        }
    }
}
