//! Model-level tests: deterministic training, windows, monotonicity
//! (proptest), persistence, evaluation, and incremental planner estimates
//! against set-semantics predictions on a trained model.

use gantry_batch::history::{BuildRecord, Timestamp};
use gantry_batch::model::{MANIFEST_FILE, MEMORY_LONG_FILE, MEMORY_SHORT_FILE, OCCUPANCY_FILE};
use gantry_batch::sim::{generate, GroundTruth, SimConfig};
use gantry_batch::{
    eval, plan, train, BatchError, BuildContext, Command, Models, PlannerConfig, Priority, Target, TrainConfig,
};
use proptest::prelude::*;
use std::sync::OnceLock;

fn tiny_cfg() -> SimConfig {
    SimConfig {
        packages: 300,
        builds_per_day: 80,
        eval_small_streams: 0,
        eval_large_streams: 0,
        train: TrainConfig {
            hash_bits: 14,
            epochs: 4,
            max_crosses: 2,
            cross_search_max_examples: 300,
            min_short_window_builds: 20,
            ..TrainConfig::default()
        },
        ..SimConfig::default()
    }
}

struct Fixture {
    cfg: SimConfig,
    truth: GroundTruth,
    history: Vec<BuildRecord>,
    models: Models,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let cfg = tiny_cfg();
        let (truth, history, _) = generate(&cfg);
        let models = train(&history, &cfg.train, cfg.now).expect("train");
        Fixture { cfg, truth, history, models }
    })
}

fn ctx(tool: &str, prio: Priority) -> BuildContext {
    let mut c = BuildContext::new_workspace("ws", Command::Test, prio);
    c.tool_tag = tool.into();
    c.user = "tap-bot".into();
    c.flags = vec!["--keep_going".into()];
    c
}

#[test]
fn training_is_deterministic_for_a_seed() {
    let f = fixture();
    let again = train(&f.history, &f.cfg.train, f.cfg.now).unwrap();
    assert!(again == f.models, "same seed, same history -> identical models");
    let mut other = f.cfg.train.clone();
    other.seed ^= 1;
    let different = train(&f.history, &other, f.cfg.now).unwrap();
    let a = f.models.memory.as_ref().unwrap().long.weights();
    let b = different.memory.as_ref().unwrap().long.weights();
    assert_ne!(a, b, "a different seed shuffles differently");
}

#[test]
fn target_weights_are_non_negative() {
    let f = fixture();
    let m = f.models.memory.as_ref().unwrap();
    for model in [&m.long, m.short.as_ref().unwrap(), f.models.occupancy.as_ref().unwrap()] {
        let start = model.spec.nonneg_start();
        assert!(model.weights()[start..].iter().all(|&w| w >= 0.0));
        assert!(model.weights()[start..].iter().any(|&w| w > 0.0), "model learned something");
        assert!(model.calibration > 0.0);
    }
}

#[test]
fn windows_are_relative_to_now() {
    let f = fixture();
    let m = f.models.memory.as_ref().unwrap();
    let per_day = f.cfg.builds_per_day;
    // The long model saw (about) the 17-day training split, the short one a day.
    assert!(m.long.trained_examples > 10 * per_day, "{}", m.long.trained_examples);
    let short = m.short.as_ref().expect("enough builds in the last day");
    assert!(short.trained_examples < 2 * per_day, "{}", short.trained_examples);
    assert_eq!(short.window_days, 1.0);
    // Moving `now` 30 days ahead leaves nothing in the window.
    let later = Timestamp(f.cfg.now.0 + 30 * 86_400);
    match train(&f.history, &f.cfg.train, later) {
        Err(BatchError::Training(msg)) => assert!(msg.contains("17-day window"), "{msg}"),
        other => panic!("expected a training error, got {:?}", other.map(|_| ())),
    }
    // Now = 10 days ago: records after `now` are ignored.
    let earlier = Timestamp(f.cfg.now.0 - 10 * 86_400);
    let past = train(&f.history, &f.cfg.train, earlier).unwrap();
    let n_before = f.history.iter().filter(|r| r.time < earlier).count();
    let long = &past.memory.as_ref().unwrap().long;
    assert!(long.trained_examples <= n_before);
    // Too few builds for the short window -> no short model.
    let mut strict = f.cfg.train.clone();
    strict.min_short_window_builds = 10 * per_day;
    let no_short = train(&f.history, &strict, f.cfg.now).unwrap();
    assert!(no_short.memory.unwrap().short.is_none());
}

#[test]
fn short_window_catches_a_last_day_regression() {
    // Double every memory label of the last day: only the short model sees
    // enough of it to react, and the estimator takes the max of the two.
    let f = fixture();
    let day_start = f.cfg.now.0 - 86_400;
    let mut history = f.history.clone();
    for r in history.iter_mut().filter(|r| r.time.0 >= day_start) {
        r.peak_memory_bytes *= 2;
    }
    let models = train(&history, &f.cfg.train, f.cfg.now).unwrap();
    let m = models.memory.as_ref().unwrap();
    let short = m.short.as_ref().unwrap();
    let c = ctx("postsubmit", Priority::Medium);
    let labels: Vec<&str> = f.truth.labels.iter().take(400).map(String::as_str).collect();
    let l = m.long.predict(&c, &labels).unwrap();
    let s = short.predict(&c, &labels).unwrap();
    assert!(s > 1.3 * l, "short {s} vs long {l}");
    assert_eq!(m.predict(&c, &labels).unwrap(), s);
}

#[test]
fn save_load_roundtrip_and_errors() {
    let f = fixture();
    let dir = std::env::temp_dir().join(format!("gantry-batch-models-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    f.models.save(&dir).unwrap();
    for name in [MANIFEST_FILE, MEMORY_LONG_FILE, MEMORY_SHORT_FILE, OCCUPANCY_FILE] {
        assert!(dir.join(name).exists(), "{name}");
    }
    let back = Models::load(&dir).unwrap();
    assert!(back == f.models, "round trip is exact");
    // Saving models without a short window removes the stale file.
    let mut no_short = f.models.clone();
    no_short.memory.as_mut().unwrap().short = None;
    no_short.save(&dir).unwrap();
    assert!(!dir.join(MEMORY_SHORT_FILE).exists());
    assert!(Models::load(&dir).unwrap() == no_short);
    // Corrupt and missing files are reported with the directory.
    std::fs::write(dir.join(OCCUPANCY_FILE), "{not json").unwrap();
    let e = Models::load(&dir).unwrap_err().to_string();
    assert!(e.contains(OCCUPANCY_FILE), "{e}");
    std::fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
    let e = Models::load(&dir).unwrap_err().to_string();
    assert!(e.contains("missing manifest.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eval_reports_bins_and_over_under() {
    let f = fixture();
    let report = eval(&f.models, &f.history).unwrap();
    let mem = report.memory.as_ref().unwrap();
    assert_eq!(mem.all.count, f.history.len());
    assert_eq!(mem.bins.iter().map(|b| b.all.count).sum::<usize>(), mem.all.count);
    assert!(mem.over.count > 0 && mem.under.count > 0);
    assert!(mem.all.rmse > 0.0 && mem.all.rmse.is_finite());
    let text = report.to_string();
    assert!(text.contains("memory model") && text.contains("occupancy model"), "{text}");
    // No models -> no sections.
    let empty = eval(&Models::default(), &f.history).unwrap();
    assert!(empty.memory.is_none() && empty.occupancy.is_none());
}

#[test]
fn planner_estimates_never_below_model_prediction() {
    let f = fixture();
    let c = ctx("postsubmit", Priority::Medium);
    let targets: Vec<Target> = f.truth.labels.iter().map(|l| Target::new(l.clone())).collect();
    let batches = plan(&c, targets, &PlannerConfig::default(), &f.models).unwrap();
    assert!(batches.len() > 1);
    let mut exact = 0;
    for b in batches.iter().filter(|b| b.targets.len() > 1) {
        let labels: Vec<&str> = b.targets.iter().map(String::as_str).collect();
        let set = f.models.predict_memory(&c, &labels).unwrap().unwrap();
        let inc = b.memory_estimate_bytes.unwrap() as f64;
        assert!(inc >= set - 1.0, "{inc} < {set}");
        if (inc - set).abs() <= 1.0 {
            exact += 1;
        }
    }
    assert!(exact > 0, "most windows have contiguous prefixes");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Adding a target never lowers either estimate: the binary search
    /// depends on it.
    #[test]
    fn adding_a_target_never_lowers_estimates(
        picks in proptest::collection::vec(any::<prop::sample::Index>(), 0..120),
        extra in any::<prop::sample::Index>(),
        tool in prop::sample::select(vec!["postsubmit", "presubmit", "coverage", "flaky_detector", "unknown"]),
        prio in prop::sample::select(vec![Priority::High, Priority::Medium, Priority::Low]),
    ) {
        let f = fixture();
        let all = &f.truth.labels;
        let base: Vec<&str> = picks.iter().map(|i| all[i.index(all.len())].as_str()).collect();
        let mut more = base.clone();
        more.push(all[extra.index(all.len())].as_str());
        let c = ctx(tool, prio);
        let mem = f.models.memory.as_ref().unwrap();
        let occ = f.models.occupancy.as_ref().unwrap();
        if !base.is_empty() {
            prop_assert!(mem.predict(&c, &more).unwrap() >= mem.predict(&c, &base).unwrap());
            prop_assert!(occ.predict(&c, &more).unwrap() >= occ.predict(&c, &base).unwrap());
        }
        // Also for a label the models never saw.
        more.push("//never/seen/before:target");
        let with_new = mem.predict(&c, &more).unwrap();
        more.pop();
        prop_assert!(with_new >= mem.predict(&c, &more).unwrap());
    }
}
