//! Replay simulator and benchmark: runs the real selection, retry and
//! recording code in simulated (discrete-event) time over a fleet, for the
//! `learned` policy and two fixed baselines, on a recorded JSONL trace or a
//! seeded synthetic one. Everything is deterministic for a seed.
//!
//! Entry points for the CLI: [`run_bench`], [`parse_trace`], [`parse_fleet`].

mod engine;
mod fleet;
mod synth;
mod trace;

use std::fmt;

use serde::{Deserialize, Serialize};

pub use engine::Policy;
pub use fleet::{parse_fleet, Fleet, DEFAULT_FLEET};
pub use synth::{generate as generate_synthetic, SyntheticConfig};
pub use trace::{parse_trace, TraceAction};

use crate::{Error, SelectionConfig, SelectionMetrics};

/// A latency-oriented acceptable-time exponent, for comparison with the default.
///
/// The published default 0.5 lets a class-1 run take 2.83x the class-8 time; on the
/// synthetic workload that pushes parallel actions near the latency tail past the "p95
/// within 10%" goal (measured 115-126% over seeds 1-5). 0.2 (class 1 may take 1.52x,
/// class 4 1.15x) meets it at about the same cost. The benchmark measures the default
/// unless asked (`gantry bench sizeclass --exponent 0.2`), so it reports what a user gets.
pub const BENCH_ACCEPTABLE_TIME_EXPONENT: f64 = 0.2;

/// Benchmark parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchConfig {
    pub fleet: Fleet,
    /// A recorded trace; `None` generates one from `synthetic`.
    pub trace: Option<Vec<TraceAction>>,
    pub synthetic: SyntheticConfig,
    /// Configuration of the `learned` policy. The default differs from
    /// [`SelectionConfig::default`] in one field: `acceptable_time_exponent`
    /// is [`BENCH_ACCEPTABLE_TIME_EXPONENT`] (see there).
    pub selection: SelectionConfig,
    /// Give the `learned` policy live queue state (queue awareness).
    pub queue_aware: bool,
    /// Seed of the `learned` policy's random draws.
    pub seed: u64,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            fleet: Fleet::default(),
            trace: None,
            synthetic: SyntheticConfig::default(),
            selection: SelectionConfig {
                acceptable_time_exponent: SelectionConfig::default().acceptable_time_exponent,
                ..SelectionConfig::default()
            },
            queue_aware: true,
            seed: 1,
        }
    }
}

/// Results of one policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyReport {
    /// Σ size class × run time over every run (failed and retried ones too).
    pub cost_class_seconds: f64,
    /// 95th percentile (nearest rank) of completion − arrival, queueing included.
    pub p95_latency_s: f64,
    pub mean_latency_s: f64,
    /// Re-executions on the largest class.
    pub retries: u64,
    /// Actions whose final result was a failure or timeout.
    pub failed: u64,
}

impl PolicyReport {
    fn from_run(cost: f64, latencies: &mut [f64], retries: u64, failed: u64) -> Self {
        latencies.sort_unstable_by(f64::total_cmp);
        let n = latencies.len();
        let p95 = if n == 0 { 0.0 } else { latencies[(n * 95).div_ceil(100).max(1) - 1] };
        let mean = if n == 0 { 0.0 } else { latencies.iter().sum::<f64>() / n as f64 };
        PolicyReport { cost_class_seconds: cost, p95_latency_s: p95, mean_latency_s: mean, retries, failed }
    }
}

/// Per-policy results, serialized under their policy names.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyReports {
    pub learned: PolicyReport,
    pub always_largest: PolicyReport,
    pub smallest_then_largest: PolicyReport,
}

impl PolicyReports {
    pub fn get(&self, p: Policy) -> &PolicyReport {
        match p {
            Policy::Learned => &self.learned,
            Policy::AlwaysLargest => &self.always_largest,
            Policy::SmallestThenLargest => &self.smallest_then_largest,
        }
    }
}

/// The benchmark result; serializes as `{"policies":{...}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    pub policies: PolicyReports,
    /// Number of actions replayed (not serialized).
    #[serde(skip)]
    pub actions: usize,
    /// Selection counters of the `learned` run (not serialized).
    #[serde(skip)]
    pub learned_metrics: SelectionMetrics,
}

impl BenchReport {
    /// Learned cost as a fraction of always-largest cost.
    pub fn learned_cost_ratio(&self) -> f64 {
        self.policies.learned.cost_class_seconds / self.policies.always_largest.cost_class_seconds
    }

    /// Learned p95 latency as a fraction of always-largest p95 latency.
    pub fn learned_p95_ratio(&self) -> f64 {
        self.policies.learned.p95_latency_s / self.policies.always_largest.p95_latency_s
    }

    /// The project goal: cost <= 60% and p95 <= 110% of always-largest.
    pub fn goal_met(&self) -> bool {
        self.learned_cost_ratio() <= 0.60 && self.learned_p95_ratio() <= 1.10
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let base = &self.policies.always_largest;
        writeln!(
            f,
            "{:<22} {:>16} {:>8} {:>10} {:>8} {:>10} {:>9} {:>7}",
            "policy", "cost class*s", "cost %", "p95 s", "p95 %", "mean s", "retries", "failed"
        )?;
        for p in Policy::ALL {
            let r = self.policies.get(p);
            writeln!(
                f,
                "{:<22} {:>16.0} {:>7.1}% {:>10.2} {:>7.1}% {:>10.2} {:>9} {:>7}",
                p.as_str(),
                r.cost_class_seconds,
                100.0 * r.cost_class_seconds / base.cost_class_seconds,
                r.p95_latency_s,
                100.0 * r.p95_latency_s / base.p95_latency_s,
                r.mean_latency_s,
                r.retries,
                r.failed
            )?;
        }
        write!(
            f,
            "{} actions; goal (learned cost <= 60% and p95 <= 110% of always_largest): {}",
            self.actions,
            if self.goal_met() { "met" } else { "NOT met" }
        )
    }
}

/// Sorts the trace by arrival (stable) and checks every action has a
/// duration for every fleet class.
fn prepare_trace(mut trace: Vec<TraceAction>, fleet: &Fleet) -> Result<Vec<TraceAction>, Error> {
    if trace.is_empty() {
        return Err(Error::InvalidSim("trace has no actions".into()));
    }
    for (index, a) in trace.iter().enumerate() {
        if let Some(class) = fleet.classes().iter().find(|c| !a.duration_s.contains_key(c)) {
            return Err(Error::TraceMissingClass { index, key: a.key.clone(), class });
        }
    }
    trace.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    Ok(trace)
}

/// Runs all three policies on the configured trace (or the synthetic one).
pub fn run_bench(config: &BenchConfig) -> Result<BenchReport, Error> {
    config.selection.validate()?;
    let trace = match &config.trace {
        Some(t) => t.clone(),
        None => synth::generate(&config.synthetic, &config.fleet)?,
    };
    let trace = prepare_trace(trace, &config.fleet)?;
    let params = engine::RunParams { selection: &config.selection, queue_aware: config.queue_aware, seed: config.seed };
    let mut learned_metrics = SelectionMetrics::default();
    let mut run = |p| engine::run_policy(p, &trace, &config.fleet, &params, &mut learned_metrics);
    let learned = run(Policy::Learned)?;
    let always_largest = run(Policy::AlwaysLargest)?;
    let smallest_then_largest = run(Policy::SmallestThenLargest)?;
    Ok(BenchReport {
        policies: PolicyReports { learned, always_largest, smallest_then_largest },
        actions: trace.len(),
        learned_metrics,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn act(key: &str, arrival: f64, d1: f64, d8: f64, min_class: u32) -> TraceAction {
        TraceAction {
            key: key.into(),
            arrival_s: arrival,
            duration_s: BTreeMap::from([(1, d1), (8, d8)]),
            min_class,
            requested_timeout_s: 100.0,
        }
    }

    fn bench(trace: Vec<TraceAction>, fleet: &str) -> BenchReport {
        let cfg = BenchConfig { fleet: parse_fleet(fleet).unwrap(), trace: Some(trace), ..Default::default() };
        run_bench(&cfg).unwrap()
    }

    #[test]
    fn baselines_on_a_hand_computed_trace() {
        // a: 10 s on class 1, 4 s on class 8. b: OOM on class 1 after 3 s, 5 s on 8.
        // c: broken everywhere, fails after 1 s on both.
        let trace = vec![act("a", 0.0, 10.0, 4.0, 1), act("b", 0.0, 3.0, 5.0, 8), act("c", 100.0, 1.0, 1.0, 16)];
        let r = bench(trace, "1:1,8:1");
        let al = &r.policies.always_largest;
        assert_eq!(al.cost_class_seconds, 8.0 * (4.0 + 5.0 + 1.0));
        // One class-8 worker: a runs 0-4, b waits and runs 4-9, c at 100-101.
        assert_eq!((al.retries, al.failed), (0, 1));
        assert!((al.mean_latency_s - (4.0 + 9.0 + 1.0) / 3.0).abs() < 1e-9);
        assert_eq!(al.p95_latency_s, 9.0);
        let st = &r.policies.smallest_then_largest;
        // a holds the only class-1 worker 0-10; b runs there 10-13, fails,
        // is retried on class 8 13-18; c fails on 1 (1 s) and again on 8 (1 s).
        assert_eq!(st.cost_class_seconds, 10.0 + 3.0 + 8.0 * 5.0 + 1.0 + 8.0 * 1.0);
        assert_eq!((st.retries, st.failed), (2, 1));
        assert_eq!(st.p95_latency_s, 18.0);
        assert_eq!(r.actions, 3);
    }

    #[test]
    fn learned_policy_learns_to_use_the_small_class() {
        // One single-threaded 20 s key, 300 runs spaced so they never overlap.
        let trace: Vec<TraceAction> = (0..300).map(|i| act("k", f64::from(i) * 100.0, 20.0, 20.0, 1)).collect();
        let r = bench(trace, "1:4,8:4");
        let l = &r.policies.learned;
        let al = &r.policies.always_largest;
        assert_eq!(al.cost_class_seconds, 8.0 * 20.0 * 300.0);
        assert!(l.cost_class_seconds < 0.25 * al.cost_class_seconds, "{r}");
        assert_eq!(l.failed, 0);
        // The first probe (10 s timeout) fails and is retried; little else is.
        assert!(l.retries >= 1 && l.retries < 15, "{r}");
        assert!(r.learned_metrics.selections.get(&1).copied().unwrap_or(0) > 250, "{:?}", r.learned_metrics);
    }

    #[test]
    fn learned_policy_keeps_big_memory_actions_on_the_largest_class() {
        // OOMs on class 1 after 5 s; 20 s on class 8.
        let trace: Vec<TraceAction> = (0..200).map(|i| act("m", f64::from(i) * 100.0, 5.0, 20.0, 8)).collect();
        let r = bench(trace, "1:4,8:4");
        let l = &r.policies.learned;
        assert_eq!(l.failed, 0);
        // Exploration may try class 1 now and then, but rarely.
        assert!(l.retries < 20, "{r}");
        assert!(l.cost_class_seconds < 1.1 * r.policies.always_largest.cost_class_seconds, "{r}");
    }

    #[test]
    fn report_serializes_under_policy_names() {
        let r = bench(vec![act("a", 0.0, 1.0, 1.0, 1)], "1:1,8:1");
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        let obj = v.as_object().unwrap();
        assert_eq!(obj.keys().collect::<Vec<_>>(), vec!["policies"]);
        let pols = v["policies"].as_object().unwrap();
        for name in ["learned", "always_largest", "smallest_then_largest"] {
            let p = pols[name].as_object().unwrap();
            let mut keys: Vec<&str> = p.keys().map(String::as_str).collect();
            keys.sort_unstable();
            assert_eq!(keys, vec!["cost_class_seconds", "failed", "mean_latency_s", "p95_latency_s", "retries"]);
        }
        let text = r.to_string();
        for name in ["learned", "always_largest", "smallest_then_largest", "goal"] {
            assert!(text.contains(name), "{text}");
        }
    }

    #[test]
    fn trace_errors() {
        let cfg = BenchConfig {
            fleet: parse_fleet("1:1,4:1,8:1").unwrap(),
            trace: Some(vec![act("a", 0.0, 1.0, 1.0, 1)]),
            ..Default::default()
        };
        assert!(matches!(run_bench(&cfg), Err(Error::TraceMissingClass { index: 0, class: 4, .. })));
        let cfg = BenchConfig { trace: Some(vec![]), ..Default::default() };
        assert!(matches!(run_bench(&cfg), Err(Error::InvalidSim(_))));
    }

    #[test]
    fn unsorted_traces_are_replayed_in_arrival_order() {
        let sorted = vec![act("a", 0.0, 5.0, 5.0, 1), act("b", 1.0, 5.0, 5.0, 1), act("c", 2.0, 5.0, 5.0, 1)];
        let mut shuffled = sorted.clone();
        shuffled.reverse();
        assert_eq!(bench(sorted, "1:1,8:1").policies, bench(shuffled, "1:1,8:1").policies);
    }

    fn small_synthetic(seed: u64, queue_aware: bool) -> BenchConfig {
        BenchConfig {
            synthetic: SyntheticConfig { actions: 20_000, keys: 500, seed, ..Default::default() },
            queue_aware,
            seed,
            ..Default::default()
        }
    }

    #[test]
    fn bench_is_deterministic_for_a_seed() {
        let a = run_bench(&small_synthetic(5, true)).unwrap();
        let b = run_bench(&small_synthetic(5, true)).unwrap();
        assert_eq!(a, b);
        let c = run_bench(&BenchConfig { seed: 6, ..small_synthetic(5, true) }).unwrap();
        assert_ne!(a.policies.learned, c.policies.learned);
        assert_eq!(a.policies.always_largest, c.policies.always_largest);
    }

    #[test]
    fn queue_awareness_cuts_latency_when_small_classes_saturate() {
        // A fleet with few small workers: without queue awareness the class-1
        // queue explodes while class 8 idles.
        let fleet = parse_fleet("1:16,2:8,4:8,8:64").unwrap();
        let with = run_bench(&BenchConfig { fleet: fleet.clone(), ..small_synthetic(3, true) }).unwrap();
        let without = run_bench(&BenchConfig { fleet, ..small_synthetic(3, false) }).unwrap();
        let (w, wo) = (&with.policies.learned, &without.policies.learned);
        assert!(w.p95_latency_s < 0.5 * wo.p95_latency_s, "with {w:?} without {wo:?}");
        assert!(w.cost_class_seconds > wo.cost_class_seconds, "spilling costs something");
        assert!(with.learned_metrics.queue_adjusted > 0);
        assert_eq!(without.learned_metrics.queue_adjusted, 0);
    }

    /// The full default benchmark (100k synthetic actions) against the goal.
    #[test]
    fn default_bench_meets_the_goal() {
        let r = run_bench(&BenchConfig::default()).unwrap();
        assert_eq!(r.actions, 100_000);
        assert!(r.goal_met(), "{r}");
        // The naive policy is cheap but its latency is far worse.
        let st = &r.policies.smallest_then_largest;
        assert!(st.p95_latency_s > 2.0 * r.policies.always_largest.p95_latency_s, "{r}");
    }
}
