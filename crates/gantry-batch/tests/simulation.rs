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

/// The bound `compare` reports as `oracle-identified`: a target is exact when some
/// build of the history told it apart from every other target; targets held by exactly
/// the same builds share their sum evenly; a target no build held gets a prior.
#[test]
fn the_identified_view_keeps_only_what_the_history_tells_apart() {
    use std::collections::{BTreeSet, HashMap};
    let cfg = SimConfig::small();
    let (truth, history, streams) = gantry_batch::sim::generate(&cfg);
    let ident = truth.identified_view(&history);
    let ctx = &streams[0].0;
    let one = |t: &gantry_batch::sim::GroundTruth, id: usize| t.truth(ctx, &[id as u32], true).memory_bytes;
    let mut builds_of: HashMap<u32, BTreeSet<usize>> = HashMap::new();
    for (b, r) in history.iter().enumerate() {
        for l in &r.targets {
            builds_of.entry(truth.id_of(l).expect("history labels exist")).or_default().insert(b);
        }
    }
    let mut groups: HashMap<&BTreeSet<usize>, Vec<usize>> = HashMap::new();
    for (id, set) in &builds_of {
        groups.entry(set).or_default().push(*id as usize);
    }
    let (mut exact, mut shared, mut differ) = (0, 0, 0);
    for g in groups.values() {
        if g.len() == 1 {
            assert_eq!(one(&ident, g[0]), one(&truth, g[0]), "{} was told apart", truth.labels[g[0]]);
            exact += 1;
            continue;
        }
        shared += g.len();
        // Same builds, same charge: each is the group's mean, so a build of the whole
        // group costs what it truly does, and its members' own charges differ.
        let ids: Vec<u32> = g.iter().map(|&i| i as u32).collect();
        let (t, v) = (truth.truth(ctx, &ids, true).memory_bytes, ident.truth(ctx, &ids, true).memory_bytes);
        assert!((v / t - 1.0).abs() < 1e-9, "a group of {} costs {v}, truly {t}", g.len());
        differ += g.iter().filter(|&&i| (one(&ident, i) / one(&truth, i) - 1.0).abs() > 1e-6).count();
    }
    assert!(exact > 0 && shared > 0, "{exact} told apart, {shared} in groups");
    assert!(differ > 0, "no grouped target's charge moved");
    // A target no build held gets the prior, as in the seen view for new packages.
    let never: Vec<usize> = (0..truth.labels.len()).filter(|i| !builds_of.contains_key(&(*i as u32))).collect();
    assert!(!never.is_empty());
    let moved = never.iter().filter(|&&i| one(&ident, i) != one(&truth, i)).count();
    assert!(moved * 10 > never.len() * 9, "{moved} of {} never-built targets were charged a prior", never.len());
    // The prior is a mean of the built targets' costs: what a second never-built target
    // of a package adds to a build of the first is near what it truly adds, summed over
    // packages.
    let mut by_pkg: HashMap<&str, Vec<u32>> = HashMap::new();
    for &i in &never {
        by_pkg.entry(truth.labels[i].split(':').next().unwrap()).or_default().push(i as u32);
    }
    let (mut charged, mut true_added) = (0.0, 0.0);
    for ids in by_pkg.values().filter(|ids| ids.len() >= 2) {
        let added = |t: &gantry_batch::sim::GroundTruth| {
            t.truth(ctx, &ids[..2], true).memory_bytes - t.truth(ctx, &ids[..1], true).memory_bytes
        };
        assert!(added(&ident) > 0.0, "a never-built target is charged nothing");
        charged += added(&ident);
        true_added += added(&truth);
    }
    assert!(true_added > 0.0);
    assert!((0.3..3.0).contains(&(charged / true_added)), "prior over truth {}", charged / true_added);
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
