//! Replay simulator and benchmark: runs the real selection, retry, hedge and
//! recording code in simulated (discrete-event) time over a fleet, for the
//! `learned` policy, two fixed baselines and a clairvoyant oracle, on a
//! recorded JSONL trace or a seeded synthetic one. Everything is
//! deterministic for a seed. [`run_suite`] runs the benchmark over several
//! seeds, fleets and workloads and checks the goals on every run.
//!
//! Entry points for the CLI: [`run_bench`], [`run_suite`], [`parse_trace`], [`parse_fleet`].

mod engine;
mod fleet;
pub(crate) mod synth;
mod trace;

use std::fmt;

use serde::{Deserialize, Serialize};

pub use engine::{Policy, ORACLE_LATENCY_TOLERANCE};
pub use fleet::{parse_fleet, Fleet, DEFAULT_FLEET};
pub use synth::{generate as generate_synthetic, Family, SyntheticConfig, FAMILIES};
pub use trace::{parse_trace, TraceAction};

use crate::{Error, SelectionConfig, SelectionMetrics};

/// A second fleet shape for the goals: five classes up to 16, few large
/// workers, and a smallest class sized for the usual load, which the
/// synthetic burst saturates.
pub const SECOND_FLEET: &str = "1:8,2:16,4:16,8:8,16:16";

/// The goals, against always-largest on the same trace.
pub const GOAL_COST_RATIO: f64 = 0.30;
pub const GOAL_P95_RATIO: f64 = 1.05;
pub const GOAL_MEAN_RATIO: f64 = 1.05;

/// Benchmark parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchConfig {
    pub fleet: Fleet,
    /// A recorded trace; `None` generates one from `synthetic`.
    pub trace: Option<Vec<TraceAction>>,
    pub synthetic: SyntheticConfig,
    /// Configuration of the `learned` policy.
    pub selection: SelectionConfig,
    /// Give the `learned` policy live queue state (queue awareness).
    pub queue_aware: bool,
    /// Start new shapes from similar ones (same mnemonic and command).
    pub priors: bool,
    /// Seed of the `learned` policy's random draws.
    pub seed: u64,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            fleet: Fleet::default(),
            trace: None,
            synthetic: SyntheticConfig::default(),
            selection: SelectionConfig::default(),
            queue_aware: true,
            priors: true,
            seed: 1,
        }
    }
}

/// Results of one policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyReport {
    /// Σ size class × run time over every run (failed, retried, hedged and cancelled ones too).
    pub cost_class_seconds: f64,
    /// 95th percentile (nearest rank) of completion − arrival, queueing included.
    pub p95_latency_s: f64,
    pub mean_latency_s: f64,
    /// Re-executions on the largest class after a failure.
    pub retries: u64,
    /// Second copies started (or queued runs moved) on the largest class at a hedge time.
    pub hedges: u64,
    /// Actions whose final result was a failure or timeout.
    pub failed: u64,
    /// Of those, actions that would have succeeded on the largest class.
    pub lost: u64,
}

impl PolicyReport {
    fn from_run(cost: f64, latencies: &mut [f64], retries: u64, hedges: u64, failed: u64, lost: u64) -> Self {
        latencies.sort_unstable_by(f64::total_cmp);
        let n = latencies.len();
        let p95 = if n == 0 { 0.0 } else { latencies[(n * 95).div_ceil(100).max(1) - 1] };
        let mean = if n == 0 { 0.0 } else { latencies.iter().sum::<f64>() / n as f64 };
        PolicyReport {
            cost_class_seconds: cost,
            p95_latency_s: p95,
            mean_latency_s: mean,
            retries,
            hedges,
            failed,
            lost,
        }
    }
}

/// Per-policy results, serialized under their policy names.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyReports {
    pub learned: PolicyReport,
    pub always_largest: PolicyReport,
    pub smallest_then_largest: PolicyReport,
    pub oracle: PolicyReport,
}

impl PolicyReports {
    pub fn get(&self, p: Policy) -> &PolicyReport {
        match p {
            Policy::Learned => &self.learned,
            Policy::AlwaysLargest => &self.always_largest,
            Policy::SmallestThenLargest => &self.smallest_then_largest,
            Policy::Oracle => &self.oracle,
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
    /// A policy's cost as a fraction of always-largest cost.
    pub fn cost_ratio(&self, p: Policy) -> f64 {
        self.policies.get(p).cost_class_seconds / self.policies.always_largest.cost_class_seconds
    }

    /// A policy's p95 latency as a fraction of always-largest p95 latency.
    pub fn p95_ratio(&self, p: Policy) -> f64 {
        self.policies.get(p).p95_latency_s / self.policies.always_largest.p95_latency_s
    }

    /// A policy's mean latency as a fraction of always-largest mean latency.
    pub fn mean_ratio(&self, p: Policy) -> f64 {
        self.policies.get(p).mean_latency_s / self.policies.always_largest.mean_latency_s
    }

    /// The goals: learned cost, p95 and mean within [`GOAL_COST_RATIO`],
    /// [`GOAL_P95_RATIO`] and [`GOAL_MEAN_RATIO`], and nothing lost.
    pub fn goal_met(&self) -> bool {
        let l = Policy::Learned;
        self.cost_ratio(l) <= GOAL_COST_RATIO
            && self.p95_ratio(l) <= GOAL_P95_RATIO
            && self.mean_ratio(l) <= GOAL_MEAN_RATIO
            && self.policies.learned.lost == 0
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let base = &self.policies.always_largest;
        writeln!(
            f,
            "{:<22} {:>16} {:>8} {:>10} {:>8} {:>10} {:>8} {:>8} {:>8} {:>7} {:>5}",
            "policy",
            "cost class*s",
            "cost %",
            "p95 s",
            "p95 %",
            "mean s",
            "mean %",
            "retries",
            "hedges",
            "failed",
            "lost"
        )?;
        for p in Policy::ALL {
            let r = self.policies.get(p);
            writeln!(
                f,
                "{:<22} {:>16.0} {:>7.1}% {:>10.2} {:>7.1}% {:>10.2} {:>7.1}% {:>8} {:>8} {:>7} {:>5}",
                p.as_str(),
                r.cost_class_seconds,
                100.0 * r.cost_class_seconds / base.cost_class_seconds,
                r.p95_latency_s,
                100.0 * r.p95_latency_s / base.p95_latency_s,
                r.mean_latency_s,
                100.0 * r.mean_latency_s / base.mean_latency_s,
                r.retries,
                r.hedges,
                r.failed,
                r.lost
            )?;
        }
        write!(
            f,
            "{} actions; goal (learned cost <= {:.0}%, p95 and mean <= {:.0}% of always_largest, nothing lost): {}",
            self.actions,
            100.0 * GOAL_COST_RATIO,
            100.0 * GOAL_P95_RATIO,
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

/// Runs every policy on the configured trace (or the synthetic one).
pub fn run_bench(config: &BenchConfig) -> Result<BenchReport, Error> {
    config.selection.validate()?;
    let trace = match &config.trace {
        Some(t) => t.clone(),
        None => synth::generate(&config.synthetic, &config.fleet)?,
    };
    let trace = prepare_trace(trace, &config.fleet)?;
    let params = engine::RunParams {
        selection: &config.selection,
        queue_aware: config.queue_aware,
        priors: config.priors,
        seed: config.seed,
    };
    let mut learned_metrics = SelectionMetrics::default();
    let mut run = |p| engine::run_policy(p, &trace, &config.fleet, &params, &mut learned_metrics);
    let learned = run(Policy::Learned)?;
    let always_largest = run(Policy::AlwaysLargest)?;
    let smallest_then_largest = run(Policy::SmallestThenLargest)?;
    let oracle = run(Policy::Oracle)?;
    Ok(BenchReport {
        policies: PolicyReports { learned, always_largest, smallest_then_largest, oracle },
        actions: trace.len(),
        learned_metrics,
    })
}

/// One run of a suite.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SuiteRun {
    pub workload: String,
    pub fleet: String,
    pub seed: u64,
    pub report: BenchReport,
}

/// The benchmark over named synthetic workloads × fleets × seeds, with the
/// same selection config (and queue awareness on or off). Each seed seeds
/// both the trace and the draws.
pub fn run_suite(
    workloads: &[(String, SyntheticConfig)],
    fleets: &[Fleet],
    seeds: &[u64],
    selection: &SelectionConfig,
    queue_aware: bool,
    mut progress: impl FnMut(&SuiteRun),
) -> Result<Vec<SuiteRun>, Error> {
    let mut runs = Vec::new();
    for (name, synthetic) in workloads {
        for fleet in fleets {
            for &seed in seeds {
                let cfg = BenchConfig {
                    fleet: fleet.clone(),
                    synthetic: SyntheticConfig { seed, ..synthetic.clone() },
                    selection: selection.clone(),
                    seed,
                    queue_aware,
                    ..BenchConfig::default()
                };
                let run = SuiteRun { workload: name.clone(), fleet: fleet.to_string(), seed, report: run_bench(&cfg)? };
                progress(&run);
                runs.push(run);
            }
        }
    }
    Ok(runs)
}

/// The goals table of a suite: per workload and fleet, the worst and mean
/// ratios over its seeds for the learned policy, and the oracle's cost.
pub fn goals_table(runs: &[SuiteRun]) -> String {
    use std::fmt::Write as _;
    let mut groups: Vec<(&str, &str, Vec<&BenchReport>)> = Vec::new();
    for r in runs {
        match groups.iter_mut().find(|g| g.0 == r.workload && g.1 == r.fleet) {
            Some(g) => g.2.push(&r.report),
            None => groups.push((&r.workload, &r.fleet, vec![&r.report])),
        }
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| workload | fleet | seeds | cost (mean / worst) | p95 (mean / worst) | mean latency (mean / worst) | lost | oracle cost | goals |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|");
    let l = Policy::Learned;
    for (w, fleet, reports) in &groups {
        let n = reports.len() as f64;
        let stat = |f: &dyn Fn(&BenchReport) -> f64| {
            let v: Vec<f64> = reports.iter().map(|r| f(r)).collect();
            (v.iter().sum::<f64>() / n, v.iter().copied().fold(f64::MIN, f64::max))
        };
        let cost = stat(&|r| r.cost_ratio(l));
        let p95 = stat(&|r| r.p95_ratio(l));
        let mean = stat(&|r| r.mean_ratio(l));
        let oracle = stat(&|r| r.cost_ratio(Policy::Oracle));
        let lost: u64 = reports.iter().map(|r| r.policies.learned.lost).sum();
        let met = reports.iter().filter(|r| r.goal_met()).count();
        let _ = writeln!(
            out,
            "| {w} | {fleet} | {} | {:.3} / {:.3} | {:.3} / {:.3} | {:.3} / {:.3} | {lost} | {:.3} | {met}/{} met |",
            reports.len(),
            cost.0,
            cost.1,
            p95.0,
            p95.1,
            mean.0,
            mean.1,
            oracle.0,
            reports.len()
        );
    }
    out
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
            mnemonic: None,
            command: None,
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
        assert_eq!((l.failed, l.retries, l.hedges), (0, 0, 0), "{r}");
        // No latency is paid for it: the same 20 s everywhere.
        assert_eq!(l.p95_latency_s, al.p95_latency_s);
        assert!(r.learned_metrics.selections.get(&1).copied().unwrap_or(0) > 250, "{:?}", r.learned_metrics);
    }

    #[test]
    fn a_slow_run_is_hedged_on_the_largest_class_and_the_loser_cancelled() {
        // 100 s on class 1, 10 s on class 8; arrivals far apart. Run 1 measures 10 s on 8.
        // Run 2 explores class 1 and is hedged at 10 × 8^x × 1.2 s; the copy on 8 wins
        // 10 s later and the class-1 run is cancelled. Run 3 knows class 1 is slow.
        let trace: Vec<TraceAction> = (0..3).map(|i| act("k", f64::from(i) * 1000.0, 100.0, 10.0, 1)).collect();
        let selection = SelectionConfig { exploration_factor: 0.0, ..SelectionConfig::default() };
        let cfg = BenchConfig {
            fleet: parse_fleet("1:1,8:1").unwrap(),
            trace: Some(trace),
            selection: selection.clone(),
            ..Default::default()
        };
        let r = run_bench(&cfg).unwrap();
        let l = &r.policies.learned;
        let hedge_at = 10.0 * 8f64.powf(selection.acceptable_time_exponent) * selection.hedge_multiplier;
        let loser_ran = hedge_at + 10.0;
        assert_eq!((l.hedges, l.retries, l.failed, l.lost), (1, 0, 0, 0), "{r}");
        assert!((l.cost_class_seconds - (80.0 + loser_ran + 80.0 + 80.0)).abs() < 1e-6, "{r}");
        // Latencies 10, hedge_at + 10 and 10: the client saw one result per action.
        assert!((l.mean_latency_s - (30.0 + hedge_at) / 3.0).abs() < 1e-6, "{r}");
        assert_eq!(r.learned_metrics.selections, std::collections::BTreeMap::from([(1, 1), (8, 2)]));
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
        for name in ["learned", "always_largest", "smallest_then_largest", "oracle"] {
            let p = pols[name].as_object().unwrap();
            let mut keys: Vec<&str> = p.keys().map(String::as_str).collect();
            keys.sort_unstable();
            assert_eq!(
                keys,
                vec!["cost_class_seconds", "failed", "hedges", "lost", "mean_latency_s", "p95_latency_s", "retries"]
            );
        }
        let text = r.to_string();
        for name in ["learned", "always_largest", "smallest_then_largest", "oracle", "goal"] {
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
    fn queue_awareness_cuts_latency_when_the_smallest_class_saturates() {
        // The second fleet's smallest class is sized for the usual load; the burst saturates it.
        let fleet = parse_fleet(SECOND_FLEET).unwrap();
        let with = run_bench(&BenchConfig { fleet: fleet.clone(), ..small_synthetic(3, true) }).unwrap();
        let without = run_bench(&BenchConfig { fleet, ..small_synthetic(3, false) }).unwrap();
        let (w, wo) = (&with.policies.learned, &without.policies.learned);
        assert!(w.p95_latency_s < 0.9 * wo.p95_latency_s, "with {w:?} without {wo:?}");
        assert!(w.mean_latency_s < wo.mean_latency_s, "with {w:?} without {wo:?}");
    }

    #[test]
    fn priors_from_similar_shapes_cut_the_cost_of_new_shapes() {
        let with = run_bench(&small_synthetic(4, true)).unwrap();
        let without = run_bench(&BenchConfig { priors: false, ..small_synthetic(4, true) }).unwrap();
        assert!(with.learned_metrics.reasons.get(&crate::Reason::Prior).copied().unwrap_or(0) > 100);
        let baselines = |r: &BenchReport| r.learned_metrics.reasons.get(&crate::Reason::LargestBaseline).copied();
        assert!(baselines(&with) < baselines(&without), "{:?} {:?}", with.learned_metrics, without.learned_metrics);
        assert!(with.policies.learned.cost_class_seconds < without.policies.learned.cost_class_seconds);
    }

    /// The full default benchmark (100k synthetic actions, and the shifted workload on the
    /// second fleet): no latency lost, nothing lost, and well under half the cost.
    #[test]
    fn default_bench_keeps_the_latency_of_the_largest_class_at_a_fraction_of_its_cost() {
        let shifted = BenchConfig {
            fleet: parse_fleet(SECOND_FLEET).unwrap(),
            synthetic: SyntheticConfig::shifted(),
            ..BenchConfig::default()
        };
        for cfg in [BenchConfig::default(), shifted] {
            let r = run_bench(&cfg).unwrap();
            assert!(r.actions >= 100_000);
            let l = Policy::Learned;
            assert!(r.p95_ratio(l) <= GOAL_P95_RATIO && r.mean_ratio(l) <= GOAL_MEAN_RATIO, "{r}");
            assert_eq!(r.policies.learned.lost, 0, "{r}");
            assert!(r.cost_ratio(l) < 0.4, "{r}");
            // The naive policy is cheap but its latency is far worse.
            assert!(r.p95_ratio(Policy::SmallestThenLargest) > 2.0, "{r}");
        }
    }
}
