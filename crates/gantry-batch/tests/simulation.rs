//! End-to-end example: train on a simulated history, then check that the
//! planner with models causes fewer OOMs than a naive fixed batch size and
//! stays close to the oracle's density.

use gantry_batch::sim::{simulate, SimConfig};
use gantry_batch::{PlannerConfig, TrainConfig};

#[test]
fn models_beat_a_fixed_batch_size() {
    let cfg = SimConfig {
        seed: 3,
        packages: 1500,
        builds_per_day: 150,
        eval_small_streams: 100,
        eval_large_streams: 60,
        train: TrainConfig {
            hash_bits: 16,
            epochs: 6,
            max_crosses: 2,
            cross_search_max_examples: 800,
            ..TrainConfig::default()
        },
        planner: PlannerConfig {
            // The naive batcher: fixed batches of max_targets_per_batch.
            fallback_batch_size: 900,
            ..PlannerConfig::default()
        },
        ..SimConfig::default()
    };
    let run = simulate(&cfg).unwrap();
    let r = &run.report;
    println!("{r}");
    assert!(r.fixed.oom > 0, "the workload must be able to OOM a naive batcher");
    assert!(r.models.oom < r.fixed.oom, "models {} vs fixed {}", r.models.oom, r.fixed.oom);
    assert!(r.density_vs_oracle > 0.8, "density {}", r.density_vs_oracle);
    assert_eq!(r.models.targets, r.oracle.targets);
    // The service's planner (the models corrected by the feedback of earlier builds) plans
    // every target too, and is what the goal line judges.
    assert_eq!(r.service.targets, r.oracle.targets);
    assert!(r.service.oom < r.fixed.oom, "service {} vs fixed {}", r.service.oom, r.fixed.oom);
    assert!((r.density_vs_oracle - r.service.density() / r.oracle.density()).abs() < 1e-12);
}

/// The bound `compare` reports as `oracle-seen`: exact where the history looked, a
/// prior where it never did.
#[test]
fn the_seen_view_differs_from_the_truth_only_where_the_history_never_looked() {
    let cfg = SimConfig::small();
    let (truth, history, streams) = gantry_batch::sim::generate(&cfg);
    let seen = truth.seen_view();
    let ctx = &streams[0].0;
    let in_history: std::collections::HashSet<&str> =
        history.iter().flat_map(|r| r.targets.iter().map(String::as_str)).collect();
    let (mut unseen, mut differ, mut true_sum, mut seen_sum) = (0, 0, 0.0, 0.0);
    for (id, label) in truth.labels.iter().enumerate() {
        let one = |t: &gantry_batch::sim::GroundTruth| t.truth(ctx, &[id as u32], true).memory_bytes;
        if in_history.contains(label.as_str()) {
            assert_eq!(one(&seen), one(&truth), "{label} was built in the history");
        } else {
            unseen += 1;
            differ += (one(&seen) != one(&truth)) as usize;
            true_sum += one(&truth);
            seen_sum += one(&seen);
        }
    }
    // The small workload's packages are 5% new: they exist, and their targets are
    // charged a prior, not their hidden cost.
    assert!(differ > 0 && differ <= unseen, "{differ} of {unseen} unseen targets differ");
    // The prior is a mean of the seen costs, so over all unseen targets it is near the truth.
    let ratio = seen_sum / true_sum;
    assert!((0.5..2.0).contains(&ratio), "prior over truth {ratio}");
}

/// `gantry bench batch --compare --workload` names: each resolves to a shift of the
/// default workload, and the analysis power reaches the truth.
#[test]
fn every_named_workload_is_a_shift_of_the_default() {
    use gantry_batch::sim::WORKLOADS;
    let default = SimConfig::workload("default").unwrap();
    assert_eq!(default, SimConfig::large_streams());
    for name in WORKLOADS.iter().filter(|n| **n != "default") {
        let w = SimConfig::workload(name).unwrap_or_else(|| panic!("{name} is listed but unknown"));
        assert_ne!(w, default, "{name} is the default");
        assert_eq!(SimConfig { seed: 1, ..w.clone() }.packages, default.packages, "{name} keeps the repository's size");
    }
    assert_eq!(SimConfig::workload("heavier"), None);

    // The same repository and build under three powers: additive memory is the
    // largest for a build whose analysis cost exceeds 1 GB.
    let small = |power: f64| {
        let cfg = SimConfig { analysis_power: power, ..SimConfig::small() };
        // The repository comes first from the seed, so it is the same under every power.
        let (truth, _, _) = gantry_batch::sim::generate(&cfg);
        let ctx =
            gantry_batch::BuildContext::new_workspace("ws", gantry_batch::Command::Build, gantry_batch::Priority::Low);
        let ids: Vec<u32> = (0..truth.labels.len() as u32).collect();
        (truth.labels.len(), truth.truth(&ctx, &ids, false).memory_bytes)
    };
    let ((n1, compact), (n2, base), (n3, additive)) = (small(0.85), small(0.93), small(1.0));
    assert!(n1 == n2 && n2 == n3, "the repository changed with the power");
    assert!(compact < base && base < additive, "{compact} {base} {additive}");
}
