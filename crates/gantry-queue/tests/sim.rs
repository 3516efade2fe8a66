//! Simulator tests: every policy decides correctly and keeps the mainline
//! green on generated traces, the oracle runs exactly one build per change,
//! traces round-trip, and the ground-truth checks do catch bad decisions.

use std::collections::HashMap;

use gantry_queue::sim::{
    compare_policies, generate, parse_trace, simulate, simulate_logged, trace_to_jsonl, Policy, SimOptions,
    TraceChange, WorkloadParams,
};
use gantry_queue::Action;

fn small(rate: f64, seed: u64) -> Vec<TraceChange> {
    generate(&WorkloadParams { hours: 0.75, ..WorkloadParams::at_rate(rate, seed) }).unwrap()
}

#[test]
fn every_policy_is_correct_and_green() {
    for seed in [1, 2] {
        let trace = small(120.0, seed);
        let opts = SimOptions { capacity: 20, ..SimOptions::default() };
        let cmp = compare_policies("test", &trace, &opts).unwrap();
        assert_eq!(cmp.reports.len(), Policy::ALL.len());
        for r in &cmp.reports {
            assert!(r.green, "{} went red: {:?}", r.policy, r.violation_examples);
            assert_eq!(r.violations, 0, "{}: {:?}", r.policy, r.violation_examples);
            assert_eq!(r.landed + r.rejected, trace.len(), "{}", r.policy);
        }
        let landed: Vec<usize> = cmp.reports.iter().map(|r| r.landed).collect();
        assert!(landed.windows(2).all(|w| w[0] == w[1]), "all policies land the same set size: {landed:?}");
        let oracle = &cmp.reports[0];
        assert_eq!(oracle.policy, "oracle");
        assert_eq!(oracle.builds_started as usize, trace.len(), "oracle runs one build per change");
        // Held to the retry rule, the oracle pays exactly one more build per
        // rejected change (nothing is flaky), and cannot be faster.
        let held = &cmp.reports[1];
        assert_eq!(held.policy, "oracle-retry");
        assert!(held.rejected > 0, "the trace rejects something");
        assert_eq!(held.builds_started as usize, trace.len() + held.rejected, "one retry per rejection");
        assert!(held.p50_s >= oracle.p50_s && held.p99_s >= oracle.p99_s);
        // Without batching nobody beats the oracle; batching policies may.
        let batching = ["oracle-batch", "oracle-batch-retry", "sq-batch", "batch-only"];
        assert!(
            cmp.normalized.iter().filter(|n| !batching.contains(&n.policy.as_str())).all(|n| n.p50_ratio >= 0.999),
            "nobody beats the oracle: {:?}",
            cmp.normalized
        );
        let ob = cmp.reports.iter().find(|r| r.policy == "oracle-batch").unwrap();
        assert!(ob.builds_started <= oracle.builds_started, "the batching oracle never needs more builds");
        // 20 slots for ~60 changes in flight: a backlog, where batches pay.
        assert!(
            ob.batches > 0 && ob.p50_s < oracle.p50_s,
            "batching beats the per-change oracle under a backlog: {ob:?} vs {oracle:?}"
        );
        for r in &cmp.reports {
            assert!(r.utilisation > 0.0 && r.utilisation <= 1.0 + 1e-9, "{}: utilisation {}", r.policy, r.utilisation);
        }
        // Only a batching policy lands by attribution.
        for r in cmp.reports.iter().filter(|r| !batching.contains(&r.policy.as_str())) {
            assert_eq!(r.attributed_landed, 0, "{} landed by attribution", r.policy);
        }
        let sb = cmp.reports.iter().find(|r| r.policy == "sq-batch").unwrap();
        assert!(sb.attributed_landed > 0, "sq-batch decides members of failed trees: {sb:?}");
        // Fixed batches with no attribution: the failing ones are bisected, and only a
        // batching policy ever bisects.
        let bo = cmp.reports.iter().find(|r| r.policy == "batch-only").unwrap();
        assert!(bo.batches > 0 && bo.bisection_builds > 0 && bo.attributed_landed == 0, "{bo:?}");
        for r in cmp.reports.iter().filter(|r| !batching.contains(&r.policy.as_str())) {
            assert_eq!(r.bisection_builds, 0, "{} bisected", r.policy);
        }
    }
}

#[test]
fn the_batching_oracle_held_to_the_retry_rule_builds_every_rejection_twice() {
    // A backlog (300/h on 20 slots) where oracle-batch batches. Held to the rule,
    // it still knows every outcome, but each change it rejects was built on its own
    // (as the build's change) 1 + max_retries times, and it is never faster.
    let trace = small(300.0, 4);
    let opts = SimOptions { capacity: 20, ..SimOptions::default() };
    let free = simulate(&trace, Policy::OracleBatch, &opts).unwrap();
    let mut own: HashMap<String, u32> = HashMap::new();
    let mut rejections = Vec::new();
    let held = simulate_logged(&trace, Policy::OracleBatchRetry, &opts, &mut |_, _, acts| {
        for a in acts {
            match a {
                Action::StartBuild { build } => *own.entry(build.change.0.clone()).or_default() += 1,
                Action::Reject { change, reason } => rejections.push((own[&change.0], reason.attempts)),
                _ => {}
            }
        }
    })
    .unwrap();
    for r in [&free, &held] {
        assert_eq!(r.violations, 0, "{}: {:?}", r.policy, r.violation_examples);
        assert!(r.green);
    }
    assert_eq!((held.landed, held.rejected), (free.landed, free.rejected));
    assert!(held.batches > 0, "it still batches: {held:?}");
    assert_eq!(rejections.len(), held.rejected);
    assert!(rejections.iter().all(|&(built, attempts)| built >= 2 && attempts == 2), "{rejections:?}");
    assert!(free.rejected > 0 && held.builds_started > free.builds_started, "{held:?} vs {free:?}");
    // Still an oracle: about one extra build per rejection, not a search (without
    // the presets it would need several times the builds).
    let extra = held.rejected as u64 * u64::from(opts.max_retries);
    assert!(held.builds_started <= free.builds_started + extra, "{held:?} vs {free:?}");
    assert!(held.p50_s >= free.p50_s, "{held:?} vs {free:?}");
}

#[test]
fn sq_told_the_true_conflicts_stays_correct_and_uses_them() {
    let trace = small(300.0, 3);
    assert!(trace.iter().any(|c| !c.conflicts_with.is_empty()), "the trace has conflicts to tell");
    let base = SimOptions { capacity: 20, ..SimOptions::default() };
    let told = SimOptions { sq_knows_conflicts: true, ..base.clone() };
    let a = simulate(&trace, Policy::Sq, &base).unwrap();
    let b = simulate(&trace, Policy::Sq, &told).unwrap();
    for r in [&a, &b] {
        assert_eq!(r.violations, 0, "{:?}", r.violation_examples);
        assert!(r.green);
    }
    assert_eq!(a.landed, b.landed);
    // The hint changes the plan (it is applied, not ignored).
    assert_ne!((a.builds_started, a.p50_s.to_bits()), (b.builds_started, b.p50_s.to_bits()));
}

#[test]
fn sq_told_the_individual_outcomes_stays_correct_and_uses_them() {
    let trace = small(300.0, 3);
    assert!(trace.iter().any(|c| !c.succeeds_alone), "the trace has failures to tell");
    let base = SimOptions { capacity: 20, ..SimOptions::default() };
    let told = SimOptions { sq_knows_failures: true, ..base.clone() };
    for policy in [Policy::Sq, Policy::SqBatch] {
        let a = simulate(&trace, policy, &base).unwrap();
        let b = simulate(&trace, policy, &told).unwrap();
        for r in [&a, &b] {
            assert_eq!(r.violations, 0, "{:?}", r.violation_examples);
            assert!(r.green);
        }
        assert_eq!(a.landed, b.landed);
        // The hint changes the plan (it is applied, not ignored).
        assert_ne!((a.builds_started, a.p50_s.to_bits()), (b.builds_started, b.p50_s.to_bits()));
    }
}

#[test]
fn flaky_builds_are_retried() {
    let trace = small(60.0, 3);
    let opts = SimOptions { capacity: 30, flaky_rate: 0.05, max_retries: 2, ..SimOptions::default() };
    let r = simulate(&trace, Policy::Sq, &opts).unwrap();
    assert!(r.green);
    // With two retries at a 5% flake rate a wrong rejection needs three flakes in a row.
    assert_eq!(r.violations, 0, "{:?}", r.violation_examples);
}

#[test]
fn flaky_targets_confine_flakes_and_batching_stays_correct() {
    // Only a fixed share of the targets flakes. sq-batch, with and without its
    // flaky-target records, keeps the mainline green, and decides every change as
    // the serial reference does unless flakes alone rejected one: at a 20% flake
    // rate, two flakes in a row on a change's passing tree reject it under the
    // retry-once rule, and the changes after it are then judged against a
    // reference that had it. Over seeds 1-30 (both settings of the records) that
    // happened 66 times, with and without `learn_alone` (1,776 and 1,778
    // rejections), and every other wrong decision followed one of those.
    let trace = small(200.0, 5);
    let base =
        SimOptions { capacity: 10, flaky_rate: 0.2, max_retries: 1, flaky_target_share: 0.3, ..SimOptions::default() };
    for known_flaky_share in [0.3, 2.0] {
        let opts = SimOptions {
            sq_config: gantry_queue::PlannerConfig { known_flaky_share, ..Default::default() },
            ..base.clone()
        };
        let r = simulate(&trace, Policy::SqBatch, &opts).unwrap();
        assert!(r.green, "{:?}", r.violation_examples);
        assert!(r.violations == 0 || r.flaky_rejections > 0, "{:?}", r.violation_examples);
        assert_eq!(r.landed + r.rejected, trace.len());
    }
    // No flaky target in any tree: no flakes at all, whatever the rate.
    let none = SimOptions { flaky_target_share: 1e-12, ..base };
    let clean = SimOptions { flaky_rate: 0.0, ..none.clone() };
    let (a, b) = (simulate(&trace, Policy::Sq, &none).unwrap(), simulate(&trace, Policy::Sq, &clean).unwrap());
    assert_eq!((a.p50_s, a.landed), (b.p50_s, b.landed));
}

#[test]
fn checks_catch_an_analyzer_that_is_wrong() {
    // b conflicts with a although the analyzer calls them independent: a
    // policy trusting the analyzer lands b on a tree it never tested.
    let jsonl = r#"{"id":"a","arrival_s":0,"build_s":100,"succeeds_alone":true,"affected_targets":["//a"]}
{"id":"b","arrival_s":1,"build_s":100,"succeeds_alone":true,"conflicts_with":["a"],"affected_targets":["//b"]}
"#;
    let trace = parse_trace(jsonl).unwrap();
    let r = simulate(&trace, Policy::Sq, &SimOptions { capacity: 4, ..SimOptions::default() }).unwrap();
    assert!(!r.green);
    assert!(r.violations > 0);
    // Without analysis the same trace is handled correctly.
    let safe: Vec<TraceChange> = trace.into_iter().map(|c| TraceChange { affected_targets: None, ..c }).collect();
    let r = simulate(&safe, Policy::Sq, &SimOptions { capacity: 4, ..SimOptions::default() }).unwrap();
    assert!(r.green && r.violations == 0, "{:?}", r.violation_examples);
    assert_eq!((r.landed, r.rejected), (1, 1));
}

#[test]
fn traces_round_trip_and_are_validated() {
    let trace = small(100.0, 4);
    let back = parse_trace(&trace_to_jsonl(&trace).unwrap()).unwrap();
    assert_eq!(trace, back);
    let later = r#"{"id":"a","arrival_s":0,"build_s":1,"succeeds_alone":true,"conflicts_with":["b"]}
{"id":"b","arrival_s":1,"build_s":1,"succeeds_alone":true}"#;
    assert!(parse_trace(later).is_err(), "conflicts must point to earlier changes");
    assert!(
        parse_trace(r#"{"id":"a","arrival_s":0,"build_s":1,"succeeds_alone":true,"conflicts_with":["zz"]}"#).is_err()
    );
    assert!(parse_trace("{not json}").is_err());
}

#[test]
fn generator_follows_the_issue_parameters() {
    let trace = generate(&WorkloadParams::at_rate(300.0, 7)).unwrap();
    let n = trace.len() as f64;
    assert!((n - 900.0).abs() < 120.0, "≈300/h for 3h, got {n}");
    let fail = trace.iter().filter(|c| !c.succeeds_alone).count() as f64 / n;
    assert!((0.06..0.14).contains(&fail), "≈10% individual failures, got {fail}");
    assert!(trace.iter().all(|c| c.build_s == 1800.0));
    let p = WorkloadParams::at_rate(300.0, 7);
    assert!((p.conflict_probability(2) - 0.05).abs() < 1e-12);
    assert!((p.conflict_probability(16) - 0.40).abs() < 1e-12);
    assert_eq!(generate(&WorkloadParams::at_rate(300.0, 7)).unwrap(), trace, "deterministic");
}

/// A planner that forgets its decided changes and is restored from its saved
/// state every few events decides exactly as one that keeps everything: the
/// submit queue's retention (a snapshot instead of the whole journal) relies
/// on it. Every policy, with and without flakes, must report the same
/// decisions, builds and turnaround.
#[test]
fn forgetting_decided_changes_and_restoring_from_a_saved_state_changes_no_decision() {
    // Light load, so that most changes are decided while the stream goes on and
    // there is much to forget.
    let trace = generate(&WorkloadParams { hours: 3.0, ..WorkloadParams::at_rate(40.0, 3) }).unwrap();
    for (flaky_rate, compact_every) in [(0.0, 7), (0.05, 1), (0.05, 50)] {
        let plain = SimOptions { capacity: 40, flaky_rate, ..SimOptions::default() };
        let compacted = SimOptions { compact_every, ..plain.clone() };
        for policy in Policy::ALL {
            let mut a = simulate(&trace, policy, &plain).unwrap();
            let mut b = simulate(&trace, policy, &compacted).unwrap();
            // Flakes may wrongly reject at one retry; without them every policy is exact.
            assert!(flaky_rate > 0.0 || a.violations == 0, "{}: {:?}", a.policy, a.violation_examples);
            (a.wall_s, b.wall_s) = (0.0, 0.0);
            assert_eq!(a, b, "{} with a compaction every {compact_every} events", a.policy);
        }
    }
}

#[test]
fn under_a_backlog_batching_keeps_every_slot_busy() {
    // 20 slots for ~150 changes in flight: slots the batch trees leave free go
    // to per-change speculation instead of idling. (Deterministic; measured 0.96-1.00,
    // against 0.90-0.94 when those slots idled.)
    for seed in [1, 2, 3] {
        let trace = small(300.0, seed);
        let opts = SimOptions { capacity: 20, ..SimOptions::default() };
        let r = simulate(&trace, Policy::SqBatch, &opts).unwrap();
        assert_eq!(r.violations, 0, "{:?}", r.violation_examples);
        assert!(r.utilisation > 0.95, "seed {seed}: utilisation {:.3}", r.utilisation);
    }
}
