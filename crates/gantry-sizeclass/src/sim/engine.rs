//! The discrete-event core: replays a trace on a fleet under one policy,
//! using the same selection, retry and recording code as the scheduler.
//!
//! Model: one FIFO queue per size class; a worker takes the head of its
//! class's queue when idle. Decisions are made at arrival with the
//! statistics known at that moment (results still running are not yet
//! known, as in a real scheduler). Retries join the back of the largest
//! class's queue. Cost is Σ class × run time over every run, including
//! failed and timed-out ones; latency is final completion minus arrival.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::{Fleet, PolicyReport, TraceAction};
use crate::{
    record, retry_on_largest, select, ActionStats, ClassQueue, Execution, Outcome, QueueState, SelectionConfig,
    SelectionInput, SelectionMetrics, SizeClass, SizeClasses, Timestamp,
};

/// Simulated time 0 as a wall-clock instant (arbitrary; keeps timestamps realistic).
const SIM_EPOCH_MS: u64 = 1_700_000_000_000;

/// Weight of the newest run in each class's mean run time estimate.
const SERVICE_EMA_WEIGHT: f64 = 0.01;

/// A size class policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// [`crate::select()`] with learning; failures retried on the largest class.
    Learned,
    /// Everything on the largest class with the requested timeout.
    AlwaysLargest,
    /// Everything on the smallest class with the requested timeout;
    /// failures and timeouts retried on the largest.
    SmallestThenLargest,
}

impl Policy {
    pub const ALL: [Policy; 3] = [Policy::Learned, Policy::AlwaysLargest, Policy::SmallestThenLargest];

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Learned => "learned",
            Policy::AlwaysLargest => "always_largest",
            Policy::SmallestThenLargest => "smallest_then_largest",
        }
    }
}

/// Everything a policy run needs besides the trace and fleet.
#[derive(Clone, Debug)]
pub(crate) struct RunParams<'a> {
    pub selection: &'a SelectionConfig,
    pub queue_aware: bool,
    pub seed: u64,
}

#[derive(Clone, Copy, Debug)]
struct Job {
    action: usize,
    timeout_s: f64,
    /// Set on a retry: the first run's class and outcome.
    first: Option<(SizeClass, Outcome)>,
}

#[derive(Debug)]
enum EventKind {
    Arrival(usize),
    Finish { pool: usize, job: Job, outcome: Outcome, run_s: f64 },
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
    queue: VecDeque<Job>,
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
    heap: BinaryHeap<Event>,
    seq: u64,
    cost: f64,
    latencies: Vec<f64>,
    retries: u64,
    failed: u64,
}

impl Sim<'_> {
    fn push(&mut self, time: f64, kind: EventKind) {
        self.seq += 1;
        self.heap.push(Event { time, seq: self.seq, kind });
    }

    fn pool_of(&self, class: SizeClass) -> usize {
        self.pools.iter().position(|p| p.class == class).expect("decision is a fleet class")
    }

    fn enqueue(&mut self, now: f64, pool: usize, job: Job) {
        self.pools[pool].queue.push_back(job);
        self.dispatch(now, pool);
    }

    fn dispatch(&mut self, now: f64, pool: usize) {
        while self.pools[pool].busy < self.pools[pool].workers {
            let Some(job) = self.pools[pool].queue.pop_front() else {
                break;
            };
            self.pools[pool].busy += 1;
            let (outcome, run_s) = execute(&self.trace[job.action], self.pools[pool].class, job.timeout_s);
            self.push(now + run_s, EventKind::Finish { pool, job, outcome, run_s });
        }
    }

    fn queue_state(&self) -> QueueState {
        self.pools
            .iter()
            .map(|p| {
                let idle = p.workers - p.busy;
                let wait =
                    if idle > 0 { 0.0 } else { (p.queue.len() + 1) as f64 * p.mean_run_s / f64::from(p.workers) };
                (p.class, ClassQueue { expected_wait: Duration::from_secs_f64(wait), idle_workers: idle })
            })
            .collect()
    }
}

fn now_ts(t: f64) -> Timestamp {
    Timestamp::from_unix_millis(SIM_EPOCH_MS + (t * 1000.0).round() as u64)
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
        .map(|(class, workers)| Pool { class, workers, busy: 0, queue: VecDeque::new(), mean_run_s: 0.0 })
        .collect();
    let mut sim = Sim {
        trace,
        classes: classes.clone(),
        pools,
        heap: BinaryHeap::with_capacity(trace.len() + 1024),
        seq: 0,
        cost: 0.0,
        latencies: Vec::with_capacity(trace.len()),
        retries: 0,
        failed: 0,
    };
    for (i, a) in trace.iter().enumerate() {
        sim.push(a.arrival_s, EventKind::Arrival(i));
    }

    // Per-key statistics, interned so the hot loop does no string hashing.
    let mut key_ids: HashMap<&str, usize> = HashMap::new();
    let key_of: Vec<usize> = trace
        .iter()
        .map(|a| {
            let n = key_ids.len();
            *key_ids.entry(a.key.as_str()).or_insert(n)
        })
        .collect();
    let mut stats = vec![ActionStats::new(); key_ids.len()];
    let mut rng = ChaCha8Rng::seed_from_u64(params.seed);
    let largest_pool = sim.pool_of(largest);

    while let Some(ev) = sim.heap.pop() {
        let now = ev.time;
        match ev.kind {
            EventKind::Arrival(i) => {
                let a = &trace[i];
                let (class, timeout_s) = match policy {
                    Policy::AlwaysLargest => (largest, a.requested_timeout_s),
                    Policy::SmallestThenLargest => (classes.smallest(), a.requested_timeout_s),
                    Policy::Learned => {
                        let queues = params.queue_aware.then(|| sim.queue_state());
                        let input = SelectionInput {
                            stats: &stats[key_of[i]],
                            classes: &sim.classes,
                            requested_timeout: Duration::from_secs_f64(a.requested_timeout_s),
                            queues: queues.as_ref(),
                            draw: rng.random::<f64>(),
                            now: now_ts(now),
                        };
                        let d = select(params.selection, &input)?;
                        metrics.observe_decision(&d);
                        (d.size_class, d.timeout.as_secs_f64())
                    }
                };
                let pool = sim.pool_of(class);
                sim.enqueue(now, pool, Job { action: i, timeout_s, first: None });
            }
            EventKind::Finish { pool, job, outcome, run_s } => {
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
                let a = &trace[job.action];
                let requested = Duration::from_secs_f64(a.requested_timeout_s);
                if job.first.is_none()
                    && let Some(retry) = retry_on_largest(class, outcome, &sim.classes, requested)
                {
                    sim.retries += 1;
                    if policy == Policy::Learned {
                        metrics.observe_retry(class);
                    }
                    let retry_job = Job {
                        action: job.action,
                        timeout_s: retry.timeout.as_secs_f64(),
                        first: Some((class, outcome)),
                    };
                    sim.enqueue(now, largest_pool, retry_job);
                } else {
                    sim.latencies.push(now - a.arrival_s);
                    if !outcome.is_success() {
                        sim.failed += 1;
                    }
                    if policy == Policy::Learned {
                        let execution = match job.first {
                            Some((c, o)) => Execution { size_class: c, outcome: o, largest_outcome: Some(outcome) },
                            None => Execution { size_class: class, outcome, largest_outcome: None },
                        };
                        let summary =
                            record(&mut stats[key_of[job.action]], params.selection, largest, &execution, now_ts(now))?;
                        metrics.observe_record(&summary);
                    }
                }
                sim.dispatch(now, pool);
            }
        }
    }
    Ok(PolicyReport::from_run(sim.cost, &mut sim.latencies, sim.retries, sim.failed))
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
