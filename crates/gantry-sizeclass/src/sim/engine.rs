//! The discrete-event core: replays a trace on a fleet under one policy,
//! using the same selection, retry and recording code as the scheduler.
//!
//! Model: one FIFO queue per size class; a worker takes the head of its
//! class's queue when idle. Decisions are made at arrival with the
//! statistics known at that moment (results still running are not yet
//! known, as in a real scheduler). A run hedged by the learned policy gets a
//! second copy on the largest class at its hedge time (or is moved there if
//! it is still queued); the first copy to succeed wins and the other is
//! cancelled, its worker freed at once. A failure on a smaller class with no
//! hedge running is retried on the largest class. Cost is Σ class × run time
//! over every run, cancelled and failed ones included; latency is final
//! completion minus arrival.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::{Fleet, PolicyReport, TraceAction};
use crate::{
    best_class, record, retry_on_largest, select, ActionStats, ClassQueue, Execution, Outcome, Prior, QueueState,
    SelectionConfig, SelectionInput, SelectionMetrics, SizeClass, SizeClasses, Timestamp,
};

/// Simulated time 0 as a wall-clock instant (arbitrary; keeps timestamps realistic).
const SIM_EPOCH_MS: u64 = 1_700_000_000_000;

/// Weight of the newest run in each class's mean run time estimate.
const SERVICE_EMA_WEIGHT: f64 = 0.01;

/// The latency the oracle accepts over the largest class's completion: the
/// goal's 5%.
pub const ORACLE_LATENCY_TOLERANCE: f64 = 0.05;

/// A size class policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// [`crate::select()`] with learning, hedging and priors from similar shapes.
    Learned,
    /// Everything on the largest class with the requested timeout.
    AlwaysLargest,
    /// Everything on the smallest class with the requested timeout;
    /// failures and timeouts retried on the largest.
    SmallestThenLargest,
    /// Knows every action's run times and memory floor: the cheapest class
    /// whose completion (queue included) is within
    /// [`ORACLE_LATENCY_TOLERANCE`] of the largest class's.
    Oracle,
}

impl Policy {
    pub const ALL: [Policy; 4] = [Policy::Learned, Policy::AlwaysLargest, Policy::SmallestThenLargest, Policy::Oracle];

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Learned => "learned",
            Policy::AlwaysLargest => "always_largest",
            Policy::SmallestThenLargest => "smallest_then_largest",
            Policy::Oracle => "oracle",
        }
    }
}

/// Everything a policy run needs besides the trace and fleet.
#[derive(Clone, Debug)]
pub(crate) struct RunParams<'a> {
    pub selection: &'a SelectionConfig,
    pub queue_aware: bool,
    /// Give new shapes the prior of similar ones (same mnemonic and command).
    pub priors: bool,
    pub seed: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RunKind {
    /// The run the policy chose.
    Primary,
    /// A copy on the largest class started at the hedge time.
    Hedge,
    /// A re-run on the largest class after a failure on a smaller one.
    Retry,
}

#[derive(Clone, Copy, Debug)]
struct Run {
    action: usize,
    pool: usize,
    timeout_s: f64,
    kind: RunKind,
    /// Start time, once a worker took it.
    start: Option<f64>,
    /// Queued or running; false once finished or cancelled.
    live: bool,
}

/// Per-action progress.
#[derive(Clone, Copy, Debug, Default)]
struct ActionState {
    primary: Option<usize>,
    hedge: Option<usize>,
    /// The primary's class and outcome, once it ended without winning.
    first: Option<(SizeClass, Outcome)>,
    /// The primary was moved to the largest class before it started.
    moved: bool,
    done: bool,
}

#[derive(Debug)]
enum EventKind {
    Arrival(usize),
    Finish { run: usize, outcome: Outcome, run_s: f64 },
    Hedge(usize),
}

struct Event {
    time: f64,
    seq: u64,
    kind: EventKind,
}

// Min-heap order on (time, seq); seq makes simultaneous events deterministic.
impl Ord for Event {
    fn cmp(&self, other: &Self) -> Ordering {
        other.time.total_cmp(&self.time).then_with(|| other.seq.cmp(&self.seq))
    }
}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Event {}

struct Pool {
    class: SizeClass,
    workers: u32,
    busy: u32,
    queue: VecDeque<usize>,
    /// Live runs in `queue` (cancelled ones are skipped when reached).
    queued: usize,
    mean_run_s: f64,
}

/// Outcome of running `action` on `class` with `timeout_s`, and its run time.
pub(crate) fn execute(action: &TraceAction, class: SizeClass, timeout_s: f64) -> (Outcome, f64) {
    let d = action.duration_s[&class];
    if d > timeout_s {
        return (Outcome::TimedOut(Duration::from_secs_f64(timeout_s)), timeout_s);
    }
    if class < action.min_class {
        (Outcome::Failed, d)
    } else {
        (Outcome::Succeeded(Duration::from_secs_f64(d)), d)
    }
}

struct Sim<'a> {
    trace: &'a [TraceAction],
    classes: SizeClasses,
    pools: Vec<Pool>,
    runs: Vec<Run>,
    actions: Vec<ActionState>,
    heap: BinaryHeap<Event>,
    seq: u64,
    cost: f64,
    latencies: Vec<f64>,
    retries: u64,
    hedges: u64,
    failed: u64,
    lost: u64,
}

impl Sim<'_> {
    fn push(&mut self, time: f64, kind: EventKind) {
        self.seq += 1;
        self.heap.push(Event { time, seq: self.seq, kind });
    }

    fn pool_of(&self, class: SizeClass) -> usize {
        self.pools.iter().position(|p| p.class == class).expect("decision is a fleet class")
    }

    fn enqueue(&mut self, now: f64, pool: usize, action: usize, timeout_s: f64, kind: RunKind) -> usize {
        let id = self.runs.len();
        self.runs.push(Run { action, pool, timeout_s, kind, start: None, live: true });
        self.pools[pool].queue.push_back(id);
        self.pools[pool].queued += 1;
        self.dispatch(now, pool);
        id
    }

    fn dispatch(&mut self, now: f64, pool: usize) {
        while self.pools[pool].busy < self.pools[pool].workers {
            let Some(id) = self.pools[pool].queue.pop_front() else {
                break;
            };
            if !self.runs[id].live {
                continue;
            }
            self.pools[pool].queued -= 1;
            self.pools[pool].busy += 1;
            let run = &mut self.runs[id];
            run.start = Some(now);
            let (outcome, run_s) = execute(&self.trace[run.action], self.pools[pool].class, run.timeout_s);
            self.push(now + run_s, EventKind::Finish { run: id, outcome, run_s });
        }
    }

    /// Stops a live run: a queued one never starts, a running one frees its
    /// worker now and costs what it ran. Returns how long it had run.
    fn cancel(&mut self, now: f64, id: usize) -> Option<f64> {
        let run = self.runs[id];
        if !run.live {
            return None;
        }
        self.runs[id].live = false;
        let pool = run.pool;
        match run.start {
            None => {
                self.pools[pool].queued -= 1;
                None
            }
            Some(start) => {
                self.pools[pool].busy -= 1;
                self.cost += f64::from(self.pools[pool].class) * (now - start);
                self.dispatch(now, pool);
                Some(now - start)
            }
        }
    }

    fn queue_state(&self) -> QueueState {
        self.pools
            .iter()
            .map(|p| {
                let idle = p.workers - p.busy;
                let wait = if idle > 0 { 0.0 } else { (p.queued + 1) as f64 * p.mean_run_s / f64::from(p.workers) };
                (p.class, ClassQueue { expected_wait: Duration::from_secs_f64(wait), idle_workers: idle })
            })
            .collect()
    }

    fn complete(&mut self, now: f64, action: usize, success: bool) {
        let a = &self.trace[action];
        self.actions[action].done = true;
        self.latencies.push(now - a.arrival_s);
        if !success {
            self.failed += 1;
            if a.min_class <= self.classes.largest() {
                self.lost += 1;
            }
        }
    }
}

fn now_ts(t: f64) -> Timestamp {
    Timestamp::from_unix_millis(SIM_EPOCH_MS + (t * 1000.0).round() as u64)
}

/// The oracle's class for `a` given the current queues.
fn oracle_class(a: &TraceAction, classes: &SizeClasses, queues: &QueueState) -> SizeClass {
    let largest = classes.largest();
    let wait = |c| queues.get(c).map_or(0.0, |q| q.expected_wait.as_secs_f64());
    let budget = (wait(largest) + a.duration_s[&largest]) * (1.0 + ORACLE_LATENCY_TOLERANCE);
    classes
        .iter()
        .filter(|&c| c >= a.min_class && wait(c) + a.duration_s[&c] <= budget)
        .min_by(|&x, &y| (f64::from(x) * a.duration_s[&x]).total_cmp(&(f64::from(y) * a.duration_s[&y])))
        .unwrap_or(largest)
}

/// Similar shapes of an action: the same mnemonic and command, else the same mnemonic.
fn group_keys(a: &TraceAction) -> [Option<String>; 2] {
    match (&a.mnemonic, &a.command) {
        (Some(m), Some(c)) => [Some(format!("{m}\u{0}{c}")), Some(m.clone())],
        (Some(m), None) => [None, Some(m.clone())],
        (None, Some(c)) => [Some(format!("\u{0}{c}")), None],
        (None, None) => [None, None],
    }
}

/// The learned policy's per-shape and per-group memory.
struct Learner<'p> {
    params: &'p RunParams<'p>,
    stats: Vec<ActionStats>,
    /// Each shape's current best class, counted in its groups' priors.
    best: Vec<Option<SizeClass>>,
    groups_of: Vec<[Option<usize>; 2]>,
    priors: Vec<Prior>,
    rng: ChaCha8Rng,
}

impl Learner<'_> {
    fn prior(&self, key: usize) -> Option<&Prior> {
        if !self.params.priors {
            return None;
        }
        let [specific, broad] = self.groups_of[key];
        let enough =
            |g: Option<usize>| g.map(|g| &self.priors[g]).filter(|p| p.shapes() >= crate::select::PRIOR_MIN_SHAPES);
        enough(specific).or_else(|| enough(broad))
    }

    fn record(
        &mut self,
        key: usize,
        classes: &SizeClasses,
        execution: &Execution,
        now: f64,
        metrics: &mut SelectionMetrics,
    ) -> Result<(), crate::Error> {
        let summary = record(&mut self.stats[key], self.params.selection, classes.largest(), execution, now_ts(now))?;
        metrics.observe_record(&summary);
        if !self.params.priors {
            return Ok(()); // nobody reads the groups' priors
        }
        let best = best_class(self.params.selection, &self.stats[key], classes);
        if best != self.best[key] {
            for g in self.groups_of[key].into_iter().flatten() {
                if let Some(old) = self.best[key] {
                    self.priors[g].remove(old);
                }
                if let Some(new) = best {
                    self.priors[g].add(new);
                }
            }
            self.best[key] = best;
        }
        Ok(())
    }
}

/// Runs one policy over the whole trace. The trace must be sorted by
/// arrival and have durations for every fleet class (checked by the caller).
pub(crate) fn run_policy(
    policy: Policy,
    trace: &[TraceAction],
    fleet: &Fleet,
    params: &RunParams<'_>,
    metrics: &mut SelectionMetrics,
) -> Result<PolicyReport, crate::Error> {
    let classes = fleet.classes();
    let largest = classes.largest();
    let pools = fleet
        .iter()
        .map(|(class, workers)| Pool { class, workers, busy: 0, queue: VecDeque::new(), queued: 0, mean_run_s: 0.0 })
        .collect();
    let mut sim = Sim {
        trace,
        classes: classes.clone(),
        pools,
        runs: Vec::with_capacity(trace.len() * 5 / 4),
        actions: vec![ActionState::default(); trace.len()],
        heap: BinaryHeap::with_capacity(trace.len() + 1024),
        seq: 0,
        cost: 0.0,
        latencies: Vec::with_capacity(trace.len()),
        retries: 0,
        hedges: 0,
        failed: 0,
        lost: 0,
    };
    for (i, a) in trace.iter().enumerate() {
        sim.push(a.arrival_s, EventKind::Arrival(i));
    }

    // Per-shape statistics and per-group priors, interned so the hot loop does no string hashing.
    let mut key_ids: HashMap<&str, usize> = HashMap::new();
    let mut group_ids: HashMap<String, usize> = HashMap::new();
    let mut groups_of: Vec<[Option<usize>; 2]> = Vec::new();
    let key_of: Vec<usize> = trace
        .iter()
        .map(|a| {
            let n = key_ids.len();
            let k = *key_ids.entry(a.key.as_str()).or_insert(n);
            if k == groups_of.len() {
                groups_of.push(group_keys(a).map(|g| {
                    g.map(|g| {
                        let n = group_ids.len();
                        *group_ids.entry(g).or_insert(n)
                    })
                }));
            }
            k
        })
        .collect();
    let mut learner = Learner {
        params,
        stats: vec![ActionStats::new(); key_ids.len()],
        best: vec![None; key_ids.len()],
        groups_of,
        priors: vec![Prior::new(); group_ids.len()],
        rng: ChaCha8Rng::seed_from_u64(params.seed),
    };
    let largest_pool = sim.pool_of(largest);

    while let Some(ev) = sim.heap.pop() {
        let now = ev.time;
        match ev.kind {
            EventKind::Arrival(i) => {
                let a = &trace[i];
                let (class, timeout_s, hedge_after) = match policy {
                    Policy::AlwaysLargest => (largest, a.requested_timeout_s, None),
                    Policy::SmallestThenLargest => (classes.smallest(), a.requested_timeout_s, None),
                    Policy::Oracle => (oracle_class(a, &classes, &sim.queue_state()), a.requested_timeout_s, None),
                    Policy::Learned => {
                        let queues = params.queue_aware.then(|| sim.queue_state());
                        let draw = learner.rng.random::<f64>();
                        let input = SelectionInput {
                            stats: &learner.stats[key_of[i]],
                            prior: learner.prior(key_of[i]),
                            classes: &sim.classes,
                            requested_timeout: Duration::from_secs_f64(a.requested_timeout_s),
                            queues: queues.as_ref(),
                            draw,
                            now: now_ts(now),
                        };
                        let d = select(params.selection, &input)?;
                        metrics.observe_decision(&d);
                        (d.size_class, d.timeout.as_secs_f64(), d.hedge_after)
                    }
                };
                let pool = sim.pool_of(class);
                let run = sim.enqueue(now, pool, i, timeout_s, RunKind::Primary);
                sim.actions[i].primary = Some(run);
                if let Some(h) = hedge_after {
                    sim.push(now + h.as_secs_f64(), EventKind::Hedge(i));
                }
            }
            EventKind::Hedge(i) => {
                let state = sim.actions[i];
                let Some(primary) = state.primary.filter(|&p| !state.done && sim.runs[p].live) else {
                    continue;
                };
                let timeout_s = trace[i].requested_timeout_s;
                if sim.runs[primary].start.is_none() {
                    // Still queued: move it rather than run it twice.
                    sim.cancel(now, primary);
                    sim.actions[i].moved = true;
                }
                sim.hedges += 1;
                let run = sim.enqueue(now, largest_pool, i, timeout_s, RunKind::Hedge);
                sim.actions[i].hedge = Some(run);
            }
            EventKind::Finish { run: id, outcome, run_s } => {
                let run = sim.runs[id];
                if !run.live {
                    continue; // cancelled; its worker was freed then
                }
                sim.runs[id].live = false;
                let pool = run.pool;
                let class = sim.pools[pool].class;
                {
                    let p = &mut sim.pools[pool];
                    p.busy -= 1;
                    p.mean_run_s = if p.mean_run_s == 0.0 {
                        run_s
                    } else {
                        p.mean_run_s + SERVICE_EMA_WEIGHT * (run_s - p.mean_run_s)
                    };
                }
                sim.cost += f64::from(class) * run_s;
                let i = run.action;
                let a = &trace[i];
                let requested = Duration::from_secs_f64(a.requested_timeout_s);
                // What to learn, once the action's final result is known.
                let mut learned: Option<Execution> = None;
                match run.kind {
                    RunKind::Primary => {
                        let hedge_live = sim.actions[i].hedge.is_some_and(|h| sim.runs[h].live);
                        if outcome.is_success() || class == largest {
                            if let Some(h) = sim.actions[i].hedge {
                                sim.cancel(now, h);
                            }
                            sim.complete(now, i, outcome.is_success());
                            learned = Some(Execution { size_class: class, outcome, largest_outcome: None });
                        } else if hedge_live {
                            sim.actions[i].first = Some((class, outcome));
                        } else if let Some(retry) = retry_on_largest(class, outcome, &sim.classes, requested) {
                            sim.retries += 1;
                            if policy == Policy::Learned {
                                metrics.observe_retry(class);
                            }
                            sim.actions[i].first = Some((class, outcome));
                            sim.enqueue(now, largest_pool, i, retry.timeout.as_secs_f64(), RunKind::Retry);
                        }
                    }
                    RunKind::Hedge | RunKind::Retry => {
                        let state = sim.actions[i];
                        let first = match (state.first, state.primary) {
                            (Some(f), _) => Some(f),
                            (None, Some(p)) if !state.moved => {
                                let primary_class = sim.pools[sim.runs[p].pool].class;
                                // The primary lost the race: it took at least as long as it ran.
                                sim.cancel(now, p)
                                    .map(|ran| (primary_class, Outcome::TimedOut(Duration::from_secs_f64(ran))))
                            }
                            _ => None,
                        };
                        sim.complete(now, i, outcome.is_success());
                        learned = Some(match first {
                            Some((c, o)) => Execution { size_class: c, outcome: o, largest_outcome: Some(outcome) },
                            None => Execution { size_class: class, outcome, largest_outcome: None },
                        });
                    }
                }
                if policy == Policy::Learned
                    && let Some(execution) = learned
                {
                    learner.record(key_of[i], &classes, &execution, now, metrics)?;
                }
                sim.dispatch(now, pool);
            }
        }
    }
    Ok(PolicyReport::from_run(sim.cost, &mut sim.latencies, sim.retries, sim.hedges, sim.failed, sim.lost))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn action(min_class: SizeClass, d1: f64, d8: f64) -> TraceAction {
        TraceAction {
            key: "k".into(),
            arrival_s: 0.0,
            duration_s: BTreeMap::from([(1, d1), (8, d8)]),
            min_class,
            requested_timeout_s: 100.0,
            mnemonic: None,
            command: None,
        }
    }

    #[test]
    fn execute_applies_min_class_and_timeouts() {
        assert_eq!(execute(&action(1, 5.0, 2.0), 1, 10.0), (Outcome::Succeeded(Duration::from_secs(5)), 5.0));
        assert_eq!(execute(&action(8, 5.0, 2.0), 1, 10.0), (Outcome::Failed, 5.0));
        assert_eq!(execute(&action(1, 50.0, 2.0), 1, 10.0), (Outcome::TimedOut(Duration::from_secs(10)), 10.0));
        // A failure that would only show after the timeout is a timeout.
        assert_eq!(execute(&action(8, 50.0, 2.0), 1, 10.0), (Outcome::TimedOut(Duration::from_secs(10)), 10.0));
        assert_eq!(execute(&action(16, 5.0, 2.0), 8, 10.0), (Outcome::Failed, 2.0));
    }

    #[test]
    fn events_pop_in_time_then_sequence_order() {
        let mut h = BinaryHeap::new();
        for (time, seq) in [(2.0, 1), (1.0, 3), (1.0, 2), (0.5, 4)] {
            h.push(Event { time, seq, kind: EventKind::Arrival(0) });
        }
        let order: Vec<(f64, u64)> = std::iter::from_fn(|| h.pop().map(|e| (e.time, e.seq))).collect();
        assert_eq!(order, vec![(0.5, 4), (1.0, 2), (1.0, 3), (2.0, 1)]);
    }
}
