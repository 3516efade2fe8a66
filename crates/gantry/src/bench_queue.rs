//! `gantry bench queue`: the submit queue's discrete-event simulator. It runs the real
//! planner (`gantry-queue`) in simulated time over a trace (`--trace FILE.jsonl`, one
//! change per line) or, without one, over generated streams at 100, 300 and 500
//! changes/hour, and reports every policy against the oracle.

use std::path::PathBuf;

use anyhow::Context;
use gantry_queue::sim::{self, Policy, SimOptions};

#[derive(clap::Args)]
pub struct QueueBenchArgs {
    /// A trace: one change per line, {"id","arrival_s","build_s","succeeds_alone","conflicts_with":[..],"features":{..}}.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Concurrent builds.
    #[arg(long, default_value_t = 100)]
    capacity: usize,
    /// One policy (sq, sq-batch, batch-only, single, optimistic, speculate-all, oracle, oracle-retry, oracle-batch, oracle-batch-retry) [default: all, with ratios to the oracle].
    #[arg(long)]
    policy: Option<String>,
    /// Probability that a build that should pass fails anyway (flaky tests).
    #[arg(long, default_value_t = 0.0)]
    flaky_rate: f64,
    /// Only this share of the targets is flaky (a fixed set per seed): a tree holding
    /// none of them never flakes, and a flaky failure fails one of them. 0: a flaky
    /// failure fails a random member's targets.
    #[arg(long, default_value_t = 0.0)]
    flaky_targets: f64,
    /// Batching policies keep no flaky-target records, so a failure in a known flaky
    /// target is bisected like any other (how much the records buy).
    #[arg(long)]
    no_flaky_records: bool,
    /// Retries of a failing build before its change is rejected (the queue's
    /// `max_retries`; `oracle-retry` and `oracle-batch-retry` are held to it too).
    #[arg(long, default_value_t = 1)]
    max_retries: u32,
    /// Arrival rates of the generated streams, changes per hour (repeat the flag).
    #[arg(long = "rate", default_values_t = [100.0, 300.0, 500.0])]
    rates: Vec<f64>,
    /// Mean probability that a generated change fails on its own.
    #[arg(long, default_value_t = 0.10)]
    failure_rate: f64,
    /// Seed of the generated streams and of flakiness.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Diagnostic: tell sq every true conflict pair as a change arrives (how much of
    /// the gap to the oracle perfect conflict prediction would close).
    #[arg(long)]
    sq_knows_conflicts: bool,
    /// Diagnostic: tell sq whether each change fails on its own as it arrives (how much
    /// of the gap to the oracle knowing individual outcomes would close).
    #[arg(long)]
    sq_knows_failures: bool,
    /// Batching policies ignore which targets a failed build reports failing, so a
    /// failed tree decides none of its members (how much attribution buys).
    #[arg(long)]
    no_attribution: bool,
    /// sq and sq-batch do not learn a change's own outcome from a build on the
    /// mainline alone (how much learning buys; the queue's `learn_alone = false`).
    #[arg(long)]
    no_learn: bool,
    /// Print JSON: one object per policy (with --policy: exactly one object).
    #[arg(long)]
    json: bool,
}

fn policy(name: &str) -> anyhow::Result<Policy> {
    Policy::from_name(name).with_context(|| {
        let names: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).collect();
        format!("--policy {name}: expected one of {}", names.join(", "))
    })
}

fn report_json(r: &sim::Report) -> serde_json::Value {
    serde_json::json!({
        "policy": r.policy, "p50_s": r.p50_s, "p95_s": r.p95_s, "p99_s": r.p99_s,
        "builds_per_landed": r.builds_per_landed, "batches": r.batches, "batch_landed": r.batch_landed, "attributed_landed": r.attributed_landed, "flaky_retries": r.flaky_retries, "flaky_targets": r.flaky_targets, "learn_builds": r.learn_builds, "utilisation": r.utilisation, "landed": r.landed, "rejected": r.rejected, "green": r.green, "violations": r.violations, "flaky_rejections": r.flaky_rejections,
    })
}

pub fn run(args: QueueBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.capacity > 0, "--capacity must be at least 1");
    anyhow::ensure!((0.0..1.0).contains(&args.flaky_rate), "--flaky-rate must be in [0, 1)");
    anyhow::ensure!((0.0..=1.0).contains(&args.flaky_targets), "--flaky-targets must be in [0, 1]");
    anyhow::ensure!((0.0..1.0).contains(&args.failure_rate), "--failure-rate must be in [0, 1)");
    anyhow::ensure!(
        args.rates.iter().all(|r| r.is_finite() && *r > 0.0 && *r <= 100_000.0),
        "--rate must be above 0 and at most 100000 changes/hour"
    );
    // Reject a bad policy name before generating any stream.
    let only = args.policy.as_deref().map(policy).transpose()?;
    let opts = SimOptions {
        capacity: args.capacity,
        flaky_rate: args.flaky_rate,
        max_retries: args.max_retries,
        seed: args.seed,
        sq_knows_conflicts: args.sq_knows_conflicts,
        sq_knows_failures: args.sq_knows_failures,
        sq_config: gantry_queue::PlannerConfig {
            attribution: !args.no_attribution,
            learn_alone: !args.no_learn,
            // Above 1: no target is ever known flaky.
            known_flaky_share: if args.no_flaky_records {
                2.0
            } else {
                gantry_queue::PlannerConfig::default().known_flaky_share
            },
            ..gantry_queue::PlannerConfig::default()
        },
        flaky_target_share: args.flaky_targets,
        compact_every: 0,
    };
    let workloads: Vec<(String, Vec<sim::TraceChange>)> = match &args.trace {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            vec![(p.display().to_string(), sim::parse_trace(&text).with_context(|| format!("trace {}", p.display()))?)]
        }
        None => args
            .rates
            .iter()
            .map(|&rate| {
                let params = sim::WorkloadParams {
                    failure_rate: args.failure_rate,
                    ..sim::WorkloadParams::at_rate(rate, args.seed)
                };
                Ok((format!("{rate}/h"), sim::generate(&params)?))
            })
            .collect::<anyhow::Result<_>>()?,
    };
    let mut failed = false;
    for (name, trace) in &workloads {
        if let Some(p) = only {
            let r = sim::simulate(trace, p, &opts)?;
            failed |= r.violations > 0 || !r.green;
            for v in &r.violation_examples {
                eprintln!("{name} {}: violation: {v}", r.policy);
            }
            if args.json {
                println!("{}", report_json(&r));
            } else {
                eprintln!("{name}: {}", sim::describe(trace));
                println!("{:<18} p50 {:>8.0}s p95 {:>8.0}s p99 {:>8.0}s  builds/landed {:>5.2}  util {:>4.2}  landed {:>5} rejected {:>5} green {}", r.policy, r.p50_s, r.p95_s, r.p99_s, r.builds_per_landed, r.utilisation, r.landed, r.rejected, r.green);
            }
            continue;
        }
        let c = sim::compare_policies(name, trace, &opts)?;
        if !args.json {
            println!("{name} ({}), capacity {}:", sim::describe(trace), args.capacity);
            println!(
                "{:<18} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7} {:>10} {:>5} {:>7} {:>8} {:>6}",
                "policy",
                "p50 s",
                "p95 s",
                "p99 s",
                "p50/or",
                "p95/or",
                "p99/or",
                "builds/lnd",
                "util",
                "landed",
                "rejected",
                "green"
            );
        }
        for (r, n) in c.reports.iter().zip(&c.normalized) {
            failed |= r.violations > 0 || !r.green;
            if args.json {
                let mut v = report_json(r);
                v["workload"] = serde_json::json!(name);
                v["p50_ratio"] = serde_json::json!(n.p50_ratio);
                v["p99_ratio"] = serde_json::json!(n.p99_ratio);
                println!("{v}");
            } else {
                println!(
                    "{:<18} {:>9.0} {:>9.0} {:>9.0} {:>7.2} {:>7.2} {:>7.2} {:>10.2} {:>5.2} {:>7} {:>8} {:>6}",
                    r.policy,
                    r.p50_s,
                    r.p95_s,
                    r.p99_s,
                    n.p50_ratio,
                    n.p95_ratio,
                    n.p99_ratio,
                    r.builds_per_landed,
                    r.utilisation,
                    r.landed,
                    r.rejected,
                    r.green
                );
            }
            for v in &r.violation_examples {
                eprintln!("  {} decision violation: {v}", r.policy);
            }
        }
    }
    anyhow::ensure!(!failed, "a policy landed a wrong set of changes or turned the mainline red (see above)");
    Ok(())
}
