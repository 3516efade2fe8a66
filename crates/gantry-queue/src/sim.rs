//! Discrete-event simulator: runs the real [`Planner`] in simulated time
//! against a trace, compares it with baseline policies and an oracle, and
//! checks every decision against ground truth.
//!
//! # Ground-truth semantics
//!
//! * Queue order is arrival order (ties keep trace order).
//! * `conflicts_with(C)` lists changes *earlier in queue order* that, when
//!   present in a tree together with `C`, make `C`'s build steps fail.
//! * A tree is a set of changes applied to the initial mainline. A build of
//!   `C` on tree `T` (the build's base `mainline[..base_version]` plus its
//!   `assumed` changes) passes iff `succeeds_alone(C)` and
//!   `conflicts_with(C) ∩ T = ∅`. With `flaky_rate > 0`, a build that should
//!   pass fails anyway with that probability, independently per attempt.
//!   Whether the assumptions turn out right is not part of the result; the
//!   planner must only *use* results whose assumptions came true.
//! * A tree is green iff every change `X` in it has `succeeds_alone(X)` and
//!   `conflicts_with(X) ∩ tree = ∅`.
//! * Reference outcome (serializability): process changes in queue order;
//!   `C` lands iff `succeeds_alone(C)` and none of the changes that landed
//!   before it is in `conflicts_with(C)`. Every policy must land exactly the
//!   reference set; anything else is reported as a violation.
//! * Two changes are independent iff both carry `affected_targets`, the sets
//!   are disjoint, and neither `alters_graph`, or one does and the other's
//!   targets lie outside its `graph_reach` (the conflict analyzer's rule).
//!   A trace whose conflicts cross independent changes is inconsistent, and
//!   the checks will expose it rather than hide it.
//!
//! Turnaround runs from arrival to the Land or Reject action.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::conflict::{ChangeAnalysis, ConflictAnalyzer, TargetGraph, TargetNode};
use crate::error::QueueError;
use crate::model::ChangeFeatures;
use crate::planner::{Planner, PlannerConfig, Strategy};
use crate::types::{Action, BuildId, BuildOutcome, ChangeId, Event, Millis};

/// One line of a JSONL trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceChange {
    /// Change id, unique in the trace.
    pub id: String,
    /// Arrival time in seconds.
    pub arrival_s: f64,
    /// Duration of any build of this change, in seconds.
    pub build_s: f64,
    /// Whether the change passes on the initial mainline with no other change.
    pub succeeds_alone: bool,
    /// Earlier changes that make this one fail when both are in the tree.
    #[serde(default)]
    pub conflicts_with: Vec<String>,
    /// Model features handed to the planner.
    #[serde(default)]
    pub features: ChangeFeatures,
    /// Affected targets from the conflict analyzer; absent = unknown (dependent on all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affected_targets: Option<Vec<String>>,
    /// Whether the change alters the build graph.
    #[serde(default)]
    pub alters_graph: bool,
    /// For a change that alters the graph, its reach (`ChangeAnalysis::graph_reach`);
    /// absent = unknown (dependent on all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub graph_reach: Option<Vec<String>>,
}

/// Parses a JSONL trace (blank lines ignored) and validates references.
pub fn parse_trace(jsonl: &str) -> Result<Vec<TraceChange>, QueueError> {
    let mut out = Vec::new();
    for (n, line) in jsonl.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let c: TraceChange =
            serde_json::from_str(line).map_err(|e| QueueError::InvalidInput { line: n + 1, message: e.to_string() })?;
        out.push(c);
    }
    validate(&out)?;
    Ok(out)
}

/// Serialises a trace as JSONL.
pub fn trace_to_jsonl(trace: &[TraceChange]) -> Result<String, QueueError> {
    let mut s = String::new();
    for c in trace {
        s.push_str(&serde_json::to_string(c)?);
        s.push('\n');
    }
    Ok(s)
}

fn queue_order(trace: &[TraceChange]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..trace.len()).collect();
    idx.sort_by(|&a, &b| trace[a].arrival_s.total_cmp(&trace[b].arrival_s).then(a.cmp(&b)));
    idx
}

fn validate(trace: &[TraceChange]) -> Result<(), QueueError> {
    let order = queue_order(trace);
    let mut rank = HashMap::new();
    for (r, &i) in order.iter().enumerate() {
        if rank.insert(trace[i].id.as_str(), r).is_some() {
            return Err(QueueError::InvalidInput { line: i + 1, message: format!("duplicate id {}", trace[i].id) });
        }
    }
    for (i, c) in trace.iter().enumerate() {
        if !(c.arrival_s.is_finite() && c.build_s.is_finite() && c.arrival_s >= 0.0 && c.build_s > 0.0) {
            return Err(QueueError::InvalidInput { line: i + 1, message: "bad arrival_s/build_s".into() });
        }
        for x in &c.conflicts_with {
            match rank.get(x.as_str()) {
                Some(&r) if r < rank[c.id.as_str()] => {}
                Some(_) => {
                    return Err(QueueError::InvalidInput {
                        line: i + 1,
                        message: format!("{x} is not earlier than {}", c.id),
                    });
                }
                None => return Err(QueueError::InvalidInput { line: i + 1, message: format!("unknown change {x}") }),
            }
        }
    }
    Ok(())
}

/// Queueing policies under comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Policy {
    /// SubmitQueue: the planner with value ranking and the conflict analyzer.
    #[serde(rename = "sq")]
    Sq,
    /// One build at a time on the current mainline, queue order.
    #[serde(rename = "single")]
    Single,
    /// Zuul-like: each change on top of everything ahead; on failure rebuild behind.
    #[serde(rename = "optimistic")]
    Optimistic,
    /// Every candidate of the speculation tree, breadth-first, up to capacity.
    #[serde(rename = "speculate-all")]
    SpeculateAll,
    /// Knows every outcome and runs only the builds that decide changes.
    #[serde(rename = "oracle")]
    Oracle,
    /// The oracle held to the retry rule every real policy follows: a failed
    /// build is retried `max_retries` times before its change is rejected,
    /// even when nothing is flaky. Knowing the outcomes, it still cannot skip
    /// those retries, so it is the floor for any policy that obeys the rule.
    /// The gap between the two oracles is the price of the rule, not of
    /// speculation.
    #[serde(rename = "oracle-retry")]
    OracleRetry,
    /// Experimental: sq with batch landing, blame spread over a failed tree's
    /// members, and batches with bisection under a backlog
    /// (`PlannerConfig::batching`).
    #[serde(rename = "sq-batch")]
    SqBatch,
    /// The oracle allowed to batch: knowing every outcome, it builds each
    /// change that will be rejected alone and the others in batches under a
    /// backlog. The floor for any batching policy.
    #[serde(rename = "oracle-batch")]
    OracleBatch,
    /// `oracle-batch` held to the retry rule, as `oracle-retry` is: a change
    /// it knows will be rejected is still built `1 + max_retries` times on its
    /// final tree (all at once) before it is rejected. The floor for a
    /// batching policy that obeys the rule; the gap to `oracle-batch` is the
    /// rule's price once batching is allowed. With flaky builds both retry, and
    /// the two are the same policy.
    #[serde(rename = "oracle-batch-retry")]
    OracleBatchRetry,
    /// GitHub's merge queue: fixed batches of `BATCH_ONLY_SIZE` in queue order,
    /// each tested on top of the batches ahead assuming they pass, a failed
    /// batch bisected; no predictions, no conflict analyzer, no value ranking.
    #[serde(rename = "batch-only")]
    BatchOnly,
}

/// `batch-only`'s batch size: GitHub's merge queue's default maximum group size.
pub const BATCH_ONLY_SIZE: usize = 5;

impl Policy {
    /// All policies, oracle first (it is the normaliser).
    pub const ALL: [Policy; 10] = [
        Policy::Oracle,
        Policy::OracleRetry,
        Policy::OracleBatch,
        Policy::OracleBatchRetry,
        Policy::Sq,
        Policy::SqBatch,
        Policy::BatchOnly,
        Policy::SpeculateAll,
        Policy::Single,
        Policy::Optimistic,
    ];

    /// Name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Sq => "sq",
            Policy::SqBatch => "sq-batch",
            Policy::OracleBatch => "oracle-batch",
            Policy::OracleBatchRetry => "oracle-batch-retry",
            Policy::BatchOnly => "batch-only",
            Policy::Single => "single",
            Policy::Optimistic => "optimistic",
            Policy::SpeculateAll => "speculate-all",
            Policy::Oracle => "oracle",
            Policy::OracleRetry => "oracle-retry",
        }
    }

    /// Parses a report name.
    pub fn from_name(s: &str) -> Option<Policy> {
        Policy::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// Whether `target` is one of the flaky ones (`SimOptions::flaky_target_share`):
/// a fixed draw per target and seed (FNV-1a of both).
fn flaky_target(target: &str, seed: u64, share: f64) -> bool {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for b in target.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    ((h >> 11) as f64 / (1u64 << 53) as f64) < share
}

/// Simulation settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimOptions {
    /// Concurrent build slots.
    pub capacity: usize,
    /// Probability that a passing build fails spuriously.
    pub flaky_rate: f64,
    /// Retries of a failing build before rejection.
    pub max_retries: u32,
    /// Seed for flakiness draws.
    pub seed: u64,
    /// Planner configuration for `sq` (capacity and retries are overwritten).
    pub sq_config: PlannerConfig,
    /// Diagnostic: `sq` is told every true conflict pair as the later change
    /// arrives (P(conflict) = 1 for those pairs; other pairs stay learned).
    /// Measures how much of the gap to the oracle perfect conflict
    /// prediction would close; individual outcomes stay unknown.
    #[serde(default)]
    pub sq_knows_conflicts: bool,
    /// Diagnostic: `sq` is told, as each change arrives, whether it fails on its own
    /// (P(success) 1 or 0; conflicts stay learned). Measures how much of the gap to the
    /// oracle knowing individual outcomes, which building each change alone on the
    /// mainline would learn, would close.
    #[serde(default)]
    pub sq_knows_failures: bool,
    /// 0: a flaky failure fails the targets of a random member of the tree
    /// (every target is as flaky as any other). Above 0: only this share of
    /// the targets is flaky (a fixed set, chosen by the seed); a tree holding
    /// none of them never flakes, and a flaky failure fails one of them.
    #[serde(default)]
    pub flaky_target_share: f64,
    /// Test aid: every this many events, the planner forgets its decided
    /// changes ([`Planner::forget_decided`]) and is replaced by its own saved
    /// state, as a queue's restart from a snapshot does. 0: never. Nothing in
    /// the report may change.
    #[serde(default)]
    pub compact_every: u64,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            capacity: 100,
            flaky_rate: 0.0,
            max_retries: 1,
            seed: 1,
            sq_config: PlannerConfig::default(),
            sq_knows_conflicts: false,
            sq_knows_failures: false,
            flaky_target_share: 0.0,
            compact_every: 0,
        }
    }
}

/// Result of simulating one policy on one trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Policy name.
    pub policy: String,
    /// Median turnaround (arrival to decision), seconds.
    pub p50_s: f64,
    /// 95th percentile turnaround, seconds.
    pub p95_s: f64,
    /// 99th percentile turnaround, seconds.
    pub p99_s: f64,
    /// Builds started (retries and cancelled ones included) per landed change.
    pub builds_per_landed: f64,
    /// Changes landed.
    pub landed: usize,
    /// Changes rejected.
    pub rejected: usize,
    /// True iff every mainline tree was green under ground truth.
    pub green: bool,
    /// Number of violated checks (wrong decisions, red trees, unproven lands, undecided changes).
    pub violations: usize,
    /// Of those, rejections of a change the serial reference lands on a tree that
    /// passes: every failure on it was a flake, and `1 + max_retries` flakes in a
    /// row reject a change under the retry rule.
    #[serde(default)]
    pub flaky_rejections: usize,
    /// The first few violation messages.
    pub violation_examples: Vec<String>,
    /// Builds started.
    pub builds_started: u64,
    /// Builds cancelled.
    pub builds_cancelled: u64,
    /// Of those, cancelled to make room for a more valuable build.
    pub builds_preempted: u64,
    /// Batch landings (one passing tree deciding several changes).
    pub batches: u64,
    /// Changes landed by batch landings.
    pub batch_landed: u64,
    /// Changes landed because their own targets passed on a failed tree.
    #[serde(default)]
    pub attributed_landed: u64,
    /// Builds of a half (a quarter, ...) of a failed batch tree.
    #[serde(default)]
    pub bisection_builds: u64,
    /// Failed trees retried whole because their failing targets were known flaky.
    #[serde(default)]
    pub flaky_retries: u64,
    /// Builds on the mainline alone, to learn a change's own outcome.
    #[serde(default)]
    pub learn_builds: u64,
    /// Targets the planner has recorded as flaky (a failure that passed on the
    /// same tree), at the end.
    #[serde(default)]
    pub flaky_targets: usize,
    /// Slot utilisation: build time spent (cancelled builds up to their
    /// cancellation) over `capacity ×` the time from the first arrival to
    /// the last decision.
    #[serde(default)]
    pub utilisation: f64,
    /// Wall-clock seconds the simulation took (not deterministic).
    pub wall_s: f64,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    // Nearest-rank.
    let r = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[r - 1]
}

fn to_ms(s: f64) -> u64 {
    (s * 1000.0).round() as u64
}

struct Truth {
    order: Vec<usize>,
    /// Position of each change in queue order.
    rank: Vec<usize>,
    idx: HashMap<String, usize>,
    conflicts: Vec<HashSet<usize>>,
    /// x -> changes listing x in their conflicts.
    rev_conflicts: Vec<Vec<usize>>,
    reference_lands: Vec<bool>,
    analysis: Vec<Option<ChangeAnalysis>>,
}

impl Truth {
    fn new(trace: &[TraceChange]) -> Result<Self, QueueError> {
        validate(trace)?;
        let order = queue_order(trace);
        let idx: HashMap<String, usize> = trace.iter().enumerate().map(|(i, c)| (c.id.clone(), i)).collect();
        let conflicts: Vec<HashSet<usize>> =
            trace.iter().map(|c| c.conflicts_with.iter().map(|x| idx[x]).collect()).collect();
        let mut rev_conflicts = vec![Vec::new(); trace.len()];
        for (i, cs) in conflicts.iter().enumerate() {
            for &x in cs {
                rev_conflicts[x].push(i);
            }
        }
        let mut reference_lands = vec![false; trace.len()];
        let mut landed = HashSet::new();
        for &i in &order {
            if trace[i].succeeds_alone && conflicts[i].is_disjoint(&landed) {
                reference_lands[i] = true;
                landed.insert(i);
            }
        }
        let analysis = trace
            .iter()
            .map(|c| {
                c.affected_targets.as_ref().map(|a| ChangeAnalysis {
                    affected: a.iter().cloned().collect(),
                    alters_graph: c.alters_graph,
                    graph_reach: c.graph_reach.as_ref().map(|r| r.iter().cloned().collect()),
                })
            })
            .collect();
        let mut rank = vec![0; trace.len()];
        for (r, &i) in order.iter().enumerate() {
            rank[i] = r;
        }
        Ok(Truth { order, rank, idx, conflicts, rev_conflicts, reference_lands, analysis })
    }

    fn independent(&self, a: usize, b: usize) -> bool {
        match (&self.analysis[a], &self.analysis[b]) {
            (Some(x), Some(y)) => x.independent_of(y),
            _ => false,
        }
    }
}

/// Planner configuration used for each policy.
pub fn policy_config(policy: Policy, opts: &SimOptions) -> PlannerConfig {
    let base = PlannerConfig { capacity: opts.capacity, max_retries: opts.max_retries, ..PlannerConfig::default() };
    match policy {
        Policy::Sq => {
            PlannerConfig { capacity: opts.capacity, max_retries: opts.max_retries, ..opts.sq_config.clone() }
        }
        Policy::SqBatch => PlannerConfig {
            capacity: opts.capacity,
            max_retries: opts.max_retries,
            batching: true,
            ..opts.sq_config.clone()
        },
        Policy::Single => PlannerConfig { capacity: 1, strategy: Strategy::Optimistic, use_analyzer: false, ..base },
        Policy::Optimistic => PlannerConfig { strategy: Strategy::Optimistic, use_analyzer: false, ..base },
        Policy::SpeculateAll => PlannerConfig { strategy: Strategy::SpeculateAll, ..base },
        // Exact probabilities come from overrides; the learned conflict rate
        // must not leak in, so pin it at zero with an overwhelming prior.
        // It also never starts a build that is not certainly needed.
        // Knowing outcomes, it retries only when flakes exist at all;
        // `oracle-retry` always retries, as the queue's rule says.
        // Plain queue order among its (all certain) builds.
        Policy::Oracle | Policy::OracleRetry => PlannerConfig {
            blocking_weight: 0.0,
            prior_conflict: 0.0,
            conflict_prior_weight: 1e12,
            min_value: 0.5,
            max_retries: if opts.flaky_rate > 0.0 || policy == Policy::OracleRetry { opts.max_retries } else { 0 },
            // Its probabilities are exact: none of sq's heuristics for
            // uncertain ones applies (and the oracle stays what it was).
            overload_pending_factor: None,
            max_conflict_probability: 1.0,
            model_includes_conflicts: false,
            ..base
        },
        Policy::BatchOnly => PlannerConfig {
            strategy: Strategy::Optimistic,
            use_analyzer: false,
            batching: true,
            fixed_batches: true,
            max_batch: BATCH_ONLY_SIZE,
            batch_min_pass: 0.0,
            attribution: false,
            known_flaky_share: 2.0,
            ..base
        },
        Policy::OracleBatch => PlannerConfig {
            batching: true,
            // Its batches never fail: a free slot is worth more to the next batch
            // than to a single change (0.59-0.67x the oracle's P50 at 300/h
            // holding them, 0.97-1.04x filling them).
            hold_free_slots: true,
            // Batches only pay under a backlog; below it, one build per change.
            overload_pending_factor: Some(1.0),
            ..policy_config(Policy::Oracle, opts)
        },
        Policy::OracleBatchRetry => {
            PlannerConfig { max_retries: opts.max_retries, ..policy_config(Policy::OracleBatch, opts) }
        }
    }
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
enum SimEv {
    BuildDone(u64),
    Arrival(usize),
}

struct SimBuild {
    passes: bool,
    started_ms: u64,
    /// When it fails: the targets whose build steps failed (per-target test
    /// results), `None` when a failing member's targets are unknown.
    failed_targets: Option<Vec<String>>,
}

/// Runs one policy over a trace in simulated time.
pub fn simulate(trace: &[TraceChange], policy: Policy, opts: &SimOptions) -> Result<Report, QueueError> {
    simulate_logged(trace, policy, opts, &mut |_, _, _| {})
}

/// Like [`simulate`], calling `log` with every event and the planner's answer
/// (for debugging a policy, or replaying a run through another consumer).
pub fn simulate_logged(
    trace: &[TraceChange],
    policy: Policy,
    opts: &SimOptions,
    log: &mut dyn FnMut(Millis, &Event, &[Action]),
) -> Result<Report, QueueError> {
    let started = std::time::Instant::now();
    let truth = Truth::new(trace)?;
    let mut planner = Planner::new(policy_config(policy, opts));
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    // Min-heap on (time, sequence) so simultaneous events keep a fixed order.
    let mut events: BinaryHeap<Reverse<(u64, u64, SimEv)>> = BinaryHeap::new();
    let mut seq = 0u64;
    for &i in &truth.order {
        events.push(Reverse((to_ms(trace[i].arrival_s), seq, SimEv::Arrival(i))));
        seq += 1;
    }
    let mut running: HashMap<u64, SimBuild> = HashMap::new();
    let mut passed_builds: HashSet<u64> = HashSet::new();
    // Builds whose tree passes but that failed anyway (flaky), and the wrong
    // rejections they alone explain.
    let mut flaked_builds: HashSet<u64> = HashSet::new();
    let mut flaky_rejections = 0usize;
    // (build, member) whose own build steps truly pass on the build's tree.
    let mut member_pass: HashSet<(u64, usize)> = HashSet::new();
    let mut mainline: Vec<usize> = Vec::new();
    let mut landed: HashSet<usize> = HashSet::new();
    let mut decided: HashMap<usize, bool> = HashMap::new();
    let mut turnaround = Vec::new();
    let mut violations: Vec<String> = Vec::new();
    let mut green = true;
    let mut builds_started = 0u64;
    let mut busy_ms = 0u64;
    let mut last_decision_ms = 0u64;
    let mut attributed = 0u64;
    let mut handled = 0u64;

    // A policy that stops deciding would otherwise build forever in simulated
    // time; no sane policy comes near this many builds per change.
    let build_limit = 200 * trace.len() as u64 + 1000;
    while let Some(Reverse((now, _, ev))) = events.pop() {
        if builds_started > build_limit {
            violations.push(format!("stopped after {builds_started} builds: the policy makes no progress"));
            break;
        }
        let event = match ev {
            SimEv::Arrival(i) => Event::Enqueue {
                change: ChangeId(trace[i].id.clone()),
                features: trace[i].features.clone(),
                analysis: truth.analysis[i].clone(),
                priority: 0,
            },
            SimEv::BuildDone(b) => {
                let Some(sb) = running.remove(&b) else { continue }; // cancelled
                busy_ms += now - sb.started_ms;
                if sb.passes {
                    passed_builds.insert(b);
                }
                Event::BuildFinished {
                    build: BuildId(b),
                    outcome: if sb.passes { BuildOutcome::Passed } else { BuildOutcome::Failed },
                    failed_targets: if sb.passes { None } else { sb.failed_targets },
                }
            }
        };
        let arrival = match ev {
            SimEv::Arrival(i) => Some(i),
            SimEv::BuildDone(_) => None,
        };
        handled += 1;
        if opts.compact_every > 0 && handled.is_multiple_of(opts.compact_every) {
            planner.forget_decided();
            planner = Planner::restore_state(&planner.save_state()?)?;
        }
        if let (Policy::Oracle | Policy::OracleRetry | Policy::OracleBatch | Policy::OracleBatchRetry, Some(i)) =
            (policy, arrival)
        {
            // The oracle learns the truth about a change as it arrives, before
            // the arrival is planned (a hedged retry is priced by it).
            // Only a pending partner can be a dependency, where conflicts count; a
            // decided one may already be forgotten (`compact_every`).
            let conflicts: Vec<(ChangeId, f64)> = truth.conflicts[i]
                .iter()
                .map(|&x| ChangeId(trace[x].id.clone()))
                .filter(|x| planner.is_pending(x))
                .map(|x| (x, 1.0))
                .collect();
            planner.preset(
                ChangeId(trace[i].id.clone()),
                if trace[i].succeeds_alone { 1.0 } else { 0.0 },
                &conflicts,
            )?;
        }
        let acts = planner.handle(Millis(now), event.clone())?;
        log(Millis(now), &event, &acts);
        for a in &acts {
            match a {
                Action::CancelBuild { id } => {
                    if let Some(sb) = running.get(&id.0) {
                        busy_ms += now - sb.started_ms;
                    }
                }
                Action::Land { proof, .. } => {
                    last_decision_ms = now;
                    attributed += u64::from(proof.by_attribution);
                }
                Action::Reject { .. } => last_decision_ms = now,
                Action::StartBuild { .. } => {}
            }
        }
        if let (Policy::Sq | Policy::SqBatch, Some(i), true) = (policy, arrival, opts.sq_knows_failures) {
            let p = if trace[i].succeeds_alone { 1.0 } else { 0.0 };
            planner.override_success(&ChangeId(trace[i].id.clone()), p)?;
        }
        if let (Policy::Sq | Policy::SqBatch, Some(i), true) = (policy, arrival, opts.sq_knows_conflicts) {
            let id = ChangeId(trace[i].id.clone());
            for &x in &truth.conflicts[i] {
                // A partner already forgotten was decided before `i` arrived, so it
                // is no dependency of `i` and the override would change nothing.
                let x = ChangeId(trace[x].id.clone());
                if planner.enqueued_at(&x).is_some() {
                    planner.override_conflict(&id, &x, 1.0)?;
                }
            }
        }
        execute(
            acts,
            now,
            trace,
            &truth,
            &mut events,
            &mut seq,
            &mut running,
            &passed_builds,
            &mut flaked_builds,
            &mut flaky_rejections,
            &mut member_pass,
            &mut mainline,
            &mut landed,
            &mut decided,
            &mut turnaround,
            &mut violations,
            &mut green,
            &mut builds_started,
            &mut rng,
            opts,
        );
    }
    let undecided: Vec<&str> =
        (0..trace.len()).filter(|i| !decided.contains_key(i)).map(|i| trace[i].id.as_str()).collect();
    if !undecided.is_empty() {
        violations.push(format!("{} changes never decided, e.g. {}", undecided.len(), undecided[0]));
    }
    turnaround.sort_by(f64::total_cmp);
    let n_landed = decided.values().filter(|&&l| l).count();
    let n_rejected = decided.len() - n_landed;
    let st = planner.stats();
    Ok(Report {
        policy: policy.name().to_string(),
        p50_s: percentile(&turnaround, 0.50),
        p95_s: percentile(&turnaround, 0.95),
        p99_s: percentile(&turnaround, 0.99),
        builds_per_landed: if n_landed > 0 { builds_started as f64 / n_landed as f64 } else { 0.0 },
        landed: n_landed,
        rejected: n_rejected,
        green,
        violations: violations.len(),
        flaky_rejections,
        violation_examples: violations.into_iter().take(5).collect(),
        builds_started: st.builds_started,
        builds_cancelled: st.builds_cancelled,
        builds_preempted: st.builds_preempted,
        batches: st.batches,
        batch_landed: st.batch_landed,
        attributed_landed: attributed,
        bisection_builds: st.bisection_builds,
        flaky_retries: st.flaky_retries,
        learn_builds: st.learn_builds,
        flaky_targets: planner.flaky_targets().len(),
        utilisation: {
            let first = truth.order.first().map_or(0, |&i| to_ms(trace[i].arrival_s));
            let span = last_decision_ms.saturating_sub(first) as f64 * opts.capacity as f64;
            if span > 0.0 {
                busy_ms as f64 / span
            } else {
                0.0
            }
        },
        wall_s: started.elapsed().as_secs_f64(),
    })
}

#[allow(clippy::too_many_arguments)]
fn execute(
    acts: Vec<Action>,
    now: u64,
    trace: &[TraceChange],
    truth: &Truth,
    events: &mut BinaryHeap<Reverse<(u64, u64, SimEv)>>,
    seq: &mut u64,
    running: &mut HashMap<u64, SimBuild>,
    passed_builds: &HashSet<u64>,
    flaked_builds: &mut HashSet<u64>,
    flaky_rejections: &mut usize,
    member_pass: &mut HashSet<(u64, usize)>,
    mainline: &mut Vec<usize>,
    landed: &mut HashSet<usize>,
    decided: &mut HashMap<usize, bool>,
    turnaround: &mut Vec<f64>,
    violations: &mut Vec<String>,
    green: &mut bool,
    builds_started: &mut u64,
    rng: &mut ChaCha8Rng,
    opts: &SimOptions,
) {
    for a in acts {
        match a {
            Action::StartBuild { build } => {
                let c = truth.idx[&build.change.0];
                let base = build.base_version as usize;
                if base != mainline.len() {
                    violations.push(format!(
                        "build {} based on version {base}, mainline is {}",
                        build.id,
                        mainline.len()
                    ));
                }
                let mut tree: HashSet<usize> = mainline[..base.min(mainline.len())].iter().copied().collect();
                tree.extend(build.assumed.iter().map(|x| truth.idx[&x.0]));
                // The build steps run on the whole tree (as the queue's `bazel test`
                // does), so a broken or conflicting assumed change fails it too.
                // Failures are monotone: adding a change to a tree never fixes it.
                tree.insert(c);
                let members: Vec<usize> = build.assumed.iter().map(|x| truth.idx[&x.0]).chain([c]).collect();
                // Each member's own build steps (its affected targets) fail when
                // it is broken or a change it conflicts with is in the tree.
                let failing: Vec<usize> = members
                    .iter()
                    .copied()
                    .filter(|&m| !(trace[m].succeeds_alone && truth.conflicts[m].is_disjoint(&tree)))
                    .collect();
                for &m in &members {
                    if !failing.contains(&m) {
                        member_pass.insert((build.id.0, m));
                    }
                }
                let mut passes = failing.is_empty();
                let tree_passes = passes;
                // A failing member fails its targets (conservatively: all of
                // them); a flaky failure fails the targets of one member.
                let mut culprits = failing;
                let mut flaked: Option<Vec<String>> = None;
                if passes && opts.flaky_rate > 0.0 && opts.flaky_target_share > 0.0 {
                    let mut flaky: Vec<&String> = members
                        .iter()
                        .flat_map(|&m| trace[m].affected_targets.iter().flatten())
                        .filter(|t| flaky_target(t, opts.seed, opts.flaky_target_share))
                        .collect();
                    flaky.sort();
                    flaky.dedup();
                    if !flaky.is_empty() && rng.random::<f64>() < opts.flaky_rate {
                        passes = false;
                        flaked = Some(vec![flaky[rng.random_range(0..flaky.len())].clone()]);
                    }
                } else if passes && opts.flaky_rate > 0.0 && rng.random::<f64>() < opts.flaky_rate {
                    passes = false;
                    culprits = vec![members[rng.random_range(0..members.len())]];
                }
                let failed_targets = flaked.or_else(|| {
                    culprits
                        .iter()
                        .map(|&m| trace[m].affected_targets.clone())
                        .collect::<Option<Vec<Vec<String>>>>()
                        .map(|v| {
                            let mut f: Vec<String> = v.into_iter().flatten().collect();
                            f.sort();
                            f.dedup();
                            f
                        })
                });
                *builds_started += 1;
                if tree_passes && !passes {
                    flaked_builds.insert(build.id.0);
                }
                running.insert(build.id.0, SimBuild { passes, started_ms: now, failed_targets });
                events.push(Reverse((now + to_ms(trace[c].build_s), *seq, SimEv::BuildDone(build.id.0))));
                *seq += 1;
            }
            Action::CancelBuild { id } => {
                if running.remove(&id.0).is_none() {
                    violations.push(format!("cancel of build {id} that is not running"));
                }
            }
            Action::Land { change, proof } => {
                let c = truth.idx[&change.0];
                let b = &proof.build;
                // A batch landing decides every change on the passing tree; the
                // members after this one land in the same move.
                let in_batch = !proof.batch.is_empty();
                let later_members: HashSet<&ChangeId> =
                    proof.batch.iter().skip_while(|x| **x != change).skip(1).collect();
                let proved = if in_batch {
                    passed_builds.contains(&b.id.0)
                        && proof.batch.contains(&change)
                        && proof.batch.last() == Some(&b.change)
                } else if proof.by_attribution {
                    // Its own targets passed on a tree that failed as a whole.
                    member_pass.contains(&(b.id.0, c)) && (b.change == change || b.assumed.contains(&change))
                } else {
                    passed_builds.contains(&b.id.0) && b.change == change
                };
                if !proved {
                    violations.push(format!("{change} landed on build {} that did not pass for it", b.id));
                }
                for x in &b.assumed {
                    let xi = truth.idx[&x.0];
                    if proof.omitted.contains(x) {
                        // Left out of the landed tree: it must come after the
                        // change or have been turned down.
                        if truth.rank[xi] < truth.rank[c]
                            && decided.get(&xi) != Some(&false)
                            && !truth.independent(c, xi)
                        {
                            violations.push(format!("{change} landed omitting {x}, which was not rejected"));
                        }
                    } else if !landed.contains(&xi) && !later_members.contains(x) && *x != change {
                        violations.push(format!("{change} landed assuming {x}, which has not landed"));
                    }
                }
                let assumed: HashSet<usize> = b.assumed.iter().map(|x| truth.idx[&x.0]).collect();
                for &x in &mainline[(b.base_version as usize).min(mainline.len())..] {
                    if !assumed.contains(&x) && !truth.independent(c, x) {
                        violations
                            .push(format!("{change} landed on a tree with {} it was not tested with", trace[x].id));
                    }
                }
                // Every earlier change it is not independent of must be decided first.
                for &e in &truth.order {
                    if e == c {
                        break;
                    }
                    if !decided.contains_key(&e) && !truth.independent(c, e) {
                        violations.push(format!("{change} landed before dependent earlier {}", trace[e].id));
                    }
                }
                if !truth.reference_lands[c] {
                    violations.push(format!("{change} landed but the serial reference rejects it"));
                }
                let red = !trace[c].succeeds_alone
                    || !truth.conflicts[c].is_disjoint(landed)
                    || truth.rev_conflicts[c].iter().any(|x| landed.contains(x));
                if red {
                    *green = false;
                    violations.push(format!("mainline red after landing {change}"));
                }
                if proof.new_version as usize != mainline.len() + 1 {
                    violations.push(format!(
                        "{change} landed as version {}, expected {}",
                        proof.new_version,
                        mainline.len() + 1
                    ));
                }
                mainline.push(c);
                landed.insert(c);
                decided.insert(c, true);
                turnaround.push(now as f64 / 1000.0 - trace[c].arrival_s);
            }
            Action::Reject { change, reason } => {
                let c = truth.idx[&change.0];
                if truth.reference_lands[c] {
                    // Its tree passes: every failure on it was a flake, which the
                    // retry rule accepts as a (rare) wrong rejection.
                    if flaked_builds.contains(&reason.build.id.0) {
                        *flaky_rejections += 1;
                    }
                    violations.push(format!(
                        "{change} rejected (build {} failed {}x) but the serial reference lands it",
                        reason.build.id, reason.attempts
                    ));
                }
                decided.insert(c, false);
                turnaround.push(now as f64 / 1000.0 - trace[c].arrival_s);
            }
        }
    }
}

/// Turnaround ratios of a policy to the oracle.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Normalized {
    /// Policy name.
    pub policy: String,
    /// p50 / oracle p50.
    pub p50_ratio: f64,
    /// p95 / oracle p95.
    pub p95_ratio: f64,
    /// p99 / oracle p99.
    pub p99_ratio: f64,
}

/// All policies on one trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// Label of the workload (e.g. "500/h").
    pub workload: String,
    /// Number of changes in the trace.
    pub changes: usize,
    /// Raw reports, oracle first.
    pub reports: Vec<Report>,
    /// Ratios to the oracle, same order.
    pub normalized: Vec<Normalized>,
}

/// Runs every policy on the trace (two threads: the machine has two cores)
/// and normalises against the oracle.
pub fn compare_policies(workload: &str, trace: &[TraceChange], opts: &SimOptions) -> Result<Comparison, QueueError> {
    // Two worker threads (the machine has two cores), alternating over
    // `Policy::ALL`: the expensive sq and speculate-all land on different
    // threads.
    let (first, second): (Vec<Policy>, Vec<Policy>) =
        Policy::ALL.iter().enumerate().fold((Vec::new(), Vec::new()), |(mut a, mut b), (k, &p)| {
            if k % 2 == 0 {
                a.push(p)
            } else {
                b.push(p)
            }
            (a, b)
        });
    let (ra, rb) = std::thread::scope(|s| {
        let ha = s.spawn(|| first.iter().map(|&p| simulate(trace, p, opts)).collect::<Vec<_>>());
        let hb = s.spawn(|| second.iter().map(|&p| simulate(trace, p, opts)).collect::<Vec<_>>());
        (ha.join().expect("simulation thread panicked"), hb.join().expect("simulation thread panicked"))
    });
    let mut results = Vec::new();
    let (mut ia, mut ib) = (ra.into_iter(), rb.into_iter());
    for k in 0..Policy::ALL.len() {
        results.push(if k % 2 == 0 { ia.next() } else { ib.next() }.expect("every policy simulated"));
    }
    let reports = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    let oracle = reports.iter().find(|r| r.policy == "oracle").expect("oracle ran").clone();
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let normalized = reports
        .iter()
        .map(|r| Normalized {
            policy: r.policy.clone(),
            p50_ratio: ratio(r.p50_s, oracle.p50_s),
            p95_ratio: ratio(r.p95_s, oracle.p95_s),
            p99_ratio: ratio(r.p99_s, oracle.p99_s),
        })
        .collect();
    Ok(Comparison { workload: workload.to_string(), changes: trace.len(), reports, normalized })
}

/// Parameters of the synthetic workload. Fixed before any tuning; the planner
/// is tuned against it, never the other way round.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkloadParams {
    /// Arrival rate (Poisson).
    pub changes_per_hour: f64,
    /// Length of the arrival window.
    pub hours: f64,
    /// Mean probability that a change fails on its own.
    pub failure_rate: f64,
    /// Build duration of every change, seconds.
    pub build_s: f64,
    /// P(conflict) of a change with 1 potentially conflicting concurrent change (2 concurrent).
    pub conflict_at_2: f64,
    /// P(conflict) with 15 potentially conflicting concurrent changes (16 concurrent).
    pub conflict_at_16: f64,
    /// Fraction of changes that alter the build graph.
    pub graph_change_rate: f64,
    /// Services in the synthetic repository (Zipf-popular, exponent 1).
    pub services: usize,
    /// Shared core libraries (each used by ~20% of services).
    pub core_libs: usize,
    /// Fraction of changes editing a core library.
    pub core_change_rate: f64,
    /// RNG seed.
    pub seed: u64,
}

impl WorkloadParams {
    /// The default stream at a given rate.
    pub fn at_rate(changes_per_hour: f64, seed: u64) -> Self {
        WorkloadParams {
            changes_per_hour,
            hours: 3.0,
            failure_rate: 0.10,
            build_s: 1800.0,
            conflict_at_2: 0.05,
            conflict_at_16: 0.40,
            graph_change_rate: 0.02,
            services: 100,
            core_libs: 10,
            core_change_rate: 0.05,
            seed,
        }
    }

    /// P(the change conflicts with one of its concurrent, potentially
    /// conflicting predecessors) given `n` concurrent such changes including
    /// itself: linear between the two published points, flat beyond 16.
    pub fn conflict_probability(&self, n: usize) -> f64 {
        if n < 2 {
            return 0.0;
        }
        let t = ((n as f64 - 2.0) / 14.0).min(1.0);
        self.conflict_at_2 + t * (self.conflict_at_16 - self.conflict_at_2)
    }
}

fn synthetic_repo(p: &WorkloadParams, rng: &mut ChaCha8Rng) -> TargetGraph {
    let mut g = TargetGraph::default();
    for c in 0..p.core_libs {
        g.targets.insert(
            format!("//core:c{c}"),
            TargetNode { attrs_digest: "cc_library".into(), srcs: vec![format!("c{c}.cc#0")], deps: vec![] },
        );
    }
    for s in 0..p.services {
        let mut deps = Vec::new();
        for _ in 0..2 {
            deps.push(format!("//core:c{}", rng.random_range(0..p.core_libs)));
        }
        g.targets.insert(
            format!("//svc{s}:lib"),
            TargetNode { attrs_digest: "cc_library".into(), srcs: vec![format!("svc{s}/lib.cc#0")], deps },
        );
        for kind in ["bin", "test"] {
            g.targets.insert(
                format!("//svc{s}:{kind}"),
                TargetNode {
                    attrs_digest: format!("cc_{kind}"),
                    srcs: vec![format!("svc{s}/{kind}.cc#0")],
                    deps: vec![format!("//svc{s}:lib")],
                },
            );
        }
    }
    g
}

fn zipf_pick(cdf: &[f64], u: f64) -> usize {
    cdf.partition_point(|&c| c < u).min(cdf.len() - 1)
}

/// Generates a synthetic trace. Affected targets come from running the real
/// [`ConflictAnalyzer`] on a synthetic repository graph.
pub fn generate(p: &WorkloadParams) -> Result<Vec<TraceChange>, QueueError> {
    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
    let base = synthetic_repo(p, &mut rng);
    let mut analyzer = ConflictAnalyzer::new();
    analyzer.add_graph("base", base.clone());
    let weights: Vec<f64> = (1..=p.services).map(|k| 1.0 / k as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    let cdf: Vec<f64> = weights
        .iter()
        .map(|w| {
            acc += w / total;
            acc
        })
        .collect();
    let authors: Vec<f64> = (0..40).map(|_| 0.3 + 1.4 * rng.random::<f64>()).collect();

    let mut out: Vec<TraceChange> = Vec::new();
    let mut analyses: Vec<ChangeAnalysis> = Vec::new();
    let mut t = 0.0;
    let horizon = p.hours * 3600.0;
    loop {
        t += -(1.0 - rng.random::<f64>()).ln() * 3600.0 / p.changes_per_hour;
        if t >= horizon {
            break;
        }
        let n = out.len();
        let mut g = base.clone();
        let svc = zipf_pick(&cdf, rng.random::<f64>());
        let u = rng.random::<f64>();
        let edited = if u < p.core_change_rate {
            format!("//core:c{}", rng.random_range(0..p.core_libs))
        } else if rng.random::<f64>() < 0.3 {
            format!("//svc{svc}:test")
        } else {
            format!("//svc{svc}:lib")
        };
        g.targets.get_mut(&edited).expect("edited target exists").srcs[0] = format!("edit#{n}");
        if rng.random::<f64>() < p.graph_change_rate {
            let core = format!("//core:c{}", rng.random_range(0..p.core_libs));
            g.targets.get_mut(&format!("//svc{svc}:bin")).expect("bin exists").deps.push(core);
        }
        let id = format!("c{n}");
        analyzer.add_graph(id.clone(), g);
        let analysis = (*analyzer.analyze("base", &id)?).clone();
        // The change's graph is no longer needed once analysed.
        analyzer.forget(&id);

        // Features and individual outcome.
        let author = rng.random_range(0..authors.len());
        let z: f64 = {
            // Box-Muller standard normal.
            let (u1, u2) = (1.0 - rng.random::<f64>(), rng.random::<f64>());
            (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
        };
        let lines = (4.5 + 1.2 * z).exp().round().max(1.0);
        let p_fail = (p.failure_rate * authors[author] * (0.4 * z - 0.08).exp()).min(0.95);
        let succeeds_alone = rng.random::<f64>() >= p_fail;
        let presubmit_passed = if succeeds_alone { rng.random::<f64>() >= 0.03 } else { rng.random::<f64>() >= 0.5 };
        let features = ChangeFeatures {
            files_changed: 1 + (lines / 40.0) as u32 + rng.random_range(0..3),
            lines_changed: lines as u32,
            affected_targets: analysis.affected.len() as u32,
            author: format!("dev{author}"),
            presubmit_passed,
        };

        // Conflicts with concurrent, potentially conflicting predecessors.
        let window: Vec<usize> = (0..n)
            .rev()
            .take_while(|&j| out[j].arrival_s > t - p.build_s)
            .filter(|&j| !analysis.independent_of(&analyses[j]))
            .collect();
        let mut conflicts_with = Vec::new();
        if !window.is_empty() && rng.random::<f64>() < p.conflict_probability(window.len() + 1) {
            let j = window[rng.random_range(0..window.len())];
            conflicts_with.push(out[j].id.clone());
        }
        out.push(TraceChange {
            id,
            arrival_s: (t * 1000.0).round() / 1000.0,
            build_s: p.build_s,
            succeeds_alone,
            conflicts_with,
            features,
            affected_targets: Some(analysis.affected.iter().cloned().collect()),
            alters_graph: analysis.alters_graph,
            graph_reach: analysis.graph_reach.as_ref().map(|r| r.iter().cloned().collect()),
        });
        analyses.push(analysis);
    }
    Ok(out)
}

/// The default evaluation: 100, 300 and 500 changes/hour, every policy,
/// normalised to the oracle.
pub fn default_evaluation(opts: &SimOptions, seed: u64) -> Result<Vec<Comparison>, QueueError> {
    [100.0, 300.0, 500.0]
        .into_iter()
        .map(|rate| {
            let trace = generate(&WorkloadParams::at_rate(rate, seed))?;
            compare_policies(&format!("{rate}/h"), &trace, opts)
        })
        .collect()
}

/// Summary statistics of a trace, for reports.
pub fn describe(trace: &[TraceChange]) -> String {
    let n = trace.len();
    let fail = trace.iter().filter(|c| !c.succeeds_alone).count();
    let conf = trace.iter().filter(|c| !c.conflicts_with.is_empty()).count();
    let graph = trace.iter().filter(|c| c.alters_graph).count();
    let truth = Truth::new(trace).ok();
    let lands = truth.map(|t| t.reference_lands.iter().filter(|&&b| b).count()).unwrap_or(0);
    format!("{n} changes, {fail} fail alone, {conf} with a conflict, {graph} alter the graph, {lands} land in the serial reference")
}
