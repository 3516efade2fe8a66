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
}
