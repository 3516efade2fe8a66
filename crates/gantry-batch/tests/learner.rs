//! The learners on histories whose costs are known exactly: they must find the
//! costs that packages and directory prefixes share (not charge them per
//! target), and one-sided label noise must not pull their estimates up. The
//! shared-cost learner must also never lower an estimate for an added target.

use gantry_batch::history::{BuildRecord, Outcome, Timestamp};
use gantry_batch::model::Calibration;
use gantry_batch::shared::{SharedConfig, SharedModel};
use gantry_batch::{train, BuildContext, Command, Priority, TrainConfig};
use proptest::prelude::*;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const NOW: Timestamp = Timestamp(1_700_000_000);
const MB: f64 = 1e6;

/// 4 top directories x 40 packages x 6 targets. A build costs a base of
/// 500 MB, plus each distinct top directory it touches (800 MB x (1 + top)),
/// plus each distinct package (50 to 250 MB), plus 2 MB per target.
struct Repo {
    packages: Vec<(String, f64)>,
}

impl Repo {
    fn new(rng: &mut ChaCha8Rng) -> Repo {
        let mut packages = Vec::new();
        for top in 0..4 {
            for p in 0..40 {
                packages.push((format!("//top{top}/pkg{p:02}"), rng.random_range(50.0..250.0) * MB));
            }
        }
        Repo { packages }
    }

    fn cost(&self, targets: &[String]) -> f64 {
        let mut tops = std::collections::BTreeSet::new();
        let mut pkgs = std::collections::BTreeSet::new();
        for t in targets {
            let pkg = &t[..t.find(':').unwrap()];
            pkgs.insert(pkg.to_string());
            tops.insert(pkg[..pkg[2..].find('/').unwrap() + 2].to_string());
        }
        let top_cost: f64 = tops.iter().map(|t| 800.0 * MB * (1.0 + t[5..].parse::<f64>().unwrap())).sum();
        let pkg_cost: f64 = pkgs.iter().map(|p| self.packages.iter().find(|x| &x.0 == p).unwrap().1).sum();
        500.0 * MB + top_cost + pkg_cost + 2.0 * MB * targets.len() as f64
    }

    /// A build: a few random packages of one or two top directories, some of
    /// each package's targets.
    fn build(&self, rng: &mut ChaCha8Rng) -> Vec<String> {
        let n = rng.random_range(1..12);
        let tops: Vec<usize> = (0..rng.random_range(1..3)).map(|_| rng.random_range(0..4)).collect();
        let mut out = Vec::new();
        for _ in 0..n {
            let top = *tops.choose(rng).unwrap();
            let (pkg, _) = &self.packages[top * 40 + rng.random_range(0..40)];
            for t in 0..6 {
                if rng.random_bool(0.6) {
                    out.push(format!("{pkg}:t{t}"));
                }
            }
        }
        out.sort();
        out.dedup();
        if out.is_empty() {
            out.push(format!("{}:t0", self.packages[0].0));
        }
        out
    }
}

fn history(repo: &Repo, rng: &mut ChaCha8Rng, n: usize, noisy: f64) -> Vec<BuildRecord> {
    (0..n)
        .map(|i| {
            let targets = repo.build(rng);
            let mut mem = repo.cost(&targets);
            if rng.random::<f64>() < noisy {
                // A build that never ran a full GC reports a peak above its heap.
                mem *= rng.random_range(1.2..1.8);
            }
            BuildRecord {
                id: format!("b{i}"),
                time: Timestamp(NOW.0 - 1 - rng.random_range(0..16 * 86_400)),
                priority: Priority::Medium,
                command: Command::Build,
                user: "ci".into(),
                product_area: String::new(),
                tool_tag: "postsubmit".into(),
                flags: vec![],
                targets,
                peak_memory_bytes: mem as u64,
                executor_service_seconds: 100.0,
                wall_seconds: 100.0,
                outcome: Outcome::Success,
            }
        })
        .collect()
}

fn config() -> TrainConfig {
    TrainConfig {
        hash_bits: 16,
        max_crosses: 0,
        epochs: 30,
        calibration_min_memory_bytes: 0.0,
        ..TrainConfig::default()
    }
}

fn ctx() -> BuildContext {
    let mut c = BuildContext::new_workspace("w", Command::Build, Priority::Medium);
    c.user = "ci".into();
    c.tool_tag = "postsubmit".into();
    c
}

/// Median and 90th percentile of |ln(estimate / truth)| on fresh builds, and
/// the median signed error, of `predict`.
fn errors_of(repo: &Repo, rng: &mut ChaCha8Rng, predict: impl Fn(&[&str]) -> f64) -> (f64, f64, f64) {
    let mut signed = Vec::new();
    for _ in 0..400 {
        let targets = repo.build(rng);
        let labels: Vec<&str> = targets.iter().map(|s| s.as_str()).collect();
        signed.push((predict(&labels) / repo.cost(&targets)).ln());
    }
    let mut abs: Vec<f64> = signed.iter().map(|x| x.abs()).collect();
    abs.sort_by(f64::total_cmp);
    signed.sort_by(f64::total_cmp);
    (abs[abs.len() / 2], abs[abs.len() * 9 / 10], signed[signed.len() / 2])
}

/// `errors_of` the long-window linear model (the learner itself; the estimator's max
/// with the one-day model is tested in models.rs).
fn errors(repo: &Repo, rng: &mut ChaCha8Rng, models: &gantry_batch::Models) -> (f64, f64, f64) {
    let mem = models.memory.as_ref().unwrap();
    errors_of(repo, rng, |labels| mem.long.predict(&ctx(), labels).unwrap())
}

#[test]
fn recovers_shared_package_and_prefix_costs() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let repo = Repo::new(&mut rng);
    let hist = history(&repo, &mut rng, 4000, 0.0);
    let models = train(&hist, &config(), NOW).unwrap();
    let (median, p90, _) = errors(&repo, &mut rng, &models);
    assert!(median < 0.05 && p90 < 0.12, "|ln(est/true)|: median {median:.3}, p90 {p90:.3}");

    // Shared, not per target: one target of a package costs almost what all six do.
    let mem = models.memory.as_ref().unwrap();
    let (pkg, _) = &repo.packages[7];
    let one = mem.long.predict(&ctx(), &[&format!("{pkg}:t0")]).unwrap();
    let all: Vec<String> = (0..6).map(|t| format!("{pkg}:t{t}")).collect();
    let six = mem.long.predict(&ctx(), &all.iter().map(|s| s.as_str()).collect::<Vec<_>>()).unwrap();
    let true_step = repo.cost(&all) - repo.cost(&all[..1]);
    let pkg_cost = repo.packages[7].1;
    eprintln!(
        "five more targets of {pkg}: {:.0} MB (truly {:.0} MB; the package costs {:.0} MB)",
        (six - one) / MB,
        true_step / MB,
        pkg_cost / MB
    );
    assert!(six - one < true_step + 0.25 * pkg_cost, "the package's cost is charged per target");

    // A second package under the same top directory adds its package cost, not the top's again.
    let (other, other_cost) = &repo.packages[8];
    let two = mem.long.predict(&ctx(), &[&format!("{pkg}:t0"), &format!("{other}:t0")]).unwrap();
    let step = two - one;
    eprintln!("a second package: {:.0} MB (truly {:.0} MB)", step / MB, (other_cost + 2.0 * MB) / MB);
    assert!(
        (step - other_cost - 2.0 * MB).abs() < 0.35 * other_cost,
        "second package: {:.0} MB, truly {:.0} MB",
        step / MB,
        (other_cost + 2.0 * MB) / MB
    );
}

#[test]
fn one_sided_label_noise_does_not_pull_estimates_up() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let repo = Repo::new(&mut rng);
    // 8% of labels read 1.2-1.8x high.
    let hist = history(&repo, &mut rng, 4000, 0.08);
    let centred = train(&hist, &config(), NOW).unwrap();
    let (_, _, bias) = errors(&repo, &mut rng, &centred);
    assert!(bias.abs() < 0.03, "centred model's median ln(est/true) {bias:.3}");
    // The old q95 safety factor, for contrast, is pulled well above the truth.
    let padded = train(&hist, &TrainConfig { calibration: Calibration::Quantile, ..config() }, NOW).unwrap();
    let (_, _, padded_bias) = errors(&repo, &mut rng, &padded);
    assert!(padded_bias > bias + 0.05, "q95 factor {padded_bias:.3} vs centred {bias:.3}");
    // And the margin was read from the clean side: close to the noise-free spread.
    let err = centred.memory.as_ref().unwrap().long.error.expect("an error model");
    assert!(err.sigma < 0.08, "{err:?}");
}

// The shared-cost learner (`gantry_batch::shared`), on the same repositories.

fn shared_config() -> SharedConfig {
    // Every build of these histories is small: calibrate on all held-out ones.
    SharedConfig { calibration_min: [0.0, 0.0], ..SharedConfig::default() }
}

/// `errors_of` the shared-cost learner.
fn shared_errors(repo: &Repo, rng: &mut ChaCha8Rng, model: &SharedModel) -> (f64, f64, f64) {
    errors_of(repo, rng, |labels| model.predict(&ctx(), labels).unwrap())
}

#[test]
fn the_shared_cost_learner_recovers_package_and_prefix_costs() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let repo = Repo::new(&mut rng);
    let hist = history(&repo, &mut rng, 4000, 0.0);
    let model = SharedModel::train(&hist, &shared_config(), NOW).unwrap();
    let (median, p90, _) = shared_errors(&repo, &mut rng, &model);
    assert!(median < 0.05 && p90 < 0.12, "|ln(est/true)|: median {median:.3}, p90 {p90:.3}");

    // The package's cost is charged once: five more of its targets cost far less than
    // the package itself, where a per-target model would charge it six times.
    let (pkg, pkg_cost) = &repo.packages[7];
    let all: Vec<String> = (0..6).map(|t| format!("{pkg}:t{t}")).collect();
    let labels: Vec<&str> = all.iter().map(|s| s.as_str()).collect();
    let one = model.predict(&ctx(), &labels[..1]).unwrap();
    let six = model.predict(&ctx(), &labels).unwrap();
    eprintln!(
        "five more targets: {:.0} MB (truly {:.0} MB; the package costs {:.0} MB)",
        (six - one) / MB,
        10.0,
        pkg_cost / MB
    );
    assert!(six - one < 0.3 * pkg_cost, "five more targets: {:.0} MB", (six - one) / MB);
    // A package under another top directory adds that directory's cost (800 MB or more)
    // with its own; one under the same top adds only its own. How the learner splits a
    // package's cost from its targets' is loosely pinned by this history (a build holds
    // most of a package's targets), so the steps are checked against the directory's.
    let near = &repo.packages[8].0;
    let far = &repo.packages[3 * 40 + 5].0;
    let step = |other: &str| model.predict(&ctx(), &[labels[0], &format!("{other}:t0")]).unwrap() - one;
    let true_step = |other: &str| repo.cost(&[all[0].clone(), format!("{other}:t0")]) - repo.cost(&all[..1]);
    let (near_step, far_step) = (step(near), step(far));
    eprintln!(
        "a package under the same top: {:.0} MB (truly {:.0}); under another: {:.0} MB (truly {:.0})",
        near_step / MB,
        true_step(near) / MB,
        far_step / MB,
        true_step(far) / MB
    );
    assert!((far_step / true_step(far) - 1.0).abs() < 0.1, "another top directory's step");
    assert!(
        (far_step - near_step - (true_step(far) - true_step(near))).abs() < 0.15 * 3200.0 * MB,
        "the directory's own cost"
    );
    assert!(near_step < 0.25 * far_step, "the top directory is charged again for a package under it");
}

#[test]
fn one_sided_label_noise_does_not_pull_the_shared_cost_learner_up() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let repo = Repo::new(&mut rng);
    // 8% of labels read 1.2-1.8x high.
    let hist = history(&repo, &mut rng, 4000, 0.08);
    let model = SharedModel::train(&hist, &shared_config(), NOW).unwrap();
    let (median, _, bias) = shared_errors(&repo, &mut rng, &model);
    assert!(bias.abs() < 0.02 && median < 0.03, "median ln(est/true) {bias:.3}, |.| {median:.3}");
    // Not only through centring on held-out builds: the fit itself, with none held out
    // (so nothing centres it), is not pulled up either.
    let raw = SharedModel::train(&hist, &SharedConfig { validation_fraction: 0.0, ..shared_config() }, NOW).unwrap();
    let (_, _, raw_bias) = shared_errors(&repo, &mut rng, &raw);
    // (0.004 here; least squares on the same labels reads 0.02 high.)
    assert!(raw_bias.abs() < 0.01, "uncentred fit: median ln(est/true) {raw_bias:.3}");
    // The margin was read from the clean side.
    let err = model.errors().0.expect("an error model");
    assert!(err.sigma < 0.05, "{err:?}");
}

fn shared_fixture() -> &'static (Repo, SharedModel) {
    static F: std::sync::OnceLock<(Repo, SharedModel)> = std::sync::OnceLock::new();
    F.get_or_init(|| {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let repo = Repo::new(&mut rng);
        let hist = history(&repo, &mut rng, 1500, 0.05);
        let model = SharedModel::train(&hist, &SharedConfig { iterations: 150, ..shared_config() }, NOW).unwrap();
        (repo, model)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Adding a target, seen or not, never lowers either estimate: the planner's binary
    /// search depends on it.
    #[test]
    fn adding_a_target_never_lowers_the_shared_cost_estimates(
        picks in proptest::collection::vec(any::<prop::sample::Index>(), 1..80),
        extra in any::<prop::sample::Index>(),
        unseen in proptest::bool::ANY,
    ) {
        let (repo, model) = shared_fixture();
        let label = |i: &prop::sample::Index| {
            let k = i.index(repo.packages.len() * 6);
            format!("{}:t{}", repo.packages[k / 6].0, k % 6)
        };
        let base: Vec<String> = picks.iter().map(label).collect();
        let mut more = base.clone();
        more.push(if unseen { format!("//top9/new{}:t0", extra.index(50)) } else { label(&extra) });
        let (m0, o0) = model.estimate(&ctx(), &base.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        let (m1, o1) = model.estimate(&ctx(), &more.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        prop_assert!(m1 >= m0 * (1.0 - 1e-12), "memory {m1} < {m0}");
        prop_assert!(o1 >= o0 * (1.0 - 1e-12), "occupancy {o1} < {o0}");
    }
}

/// A clean history of 2,000 builds and one more: a random build with `label` added,
/// whose peak is `peak` of the rest's true cost.
fn with_one_odd_build(seed: u64, label: &str, peak: impl Fn(f64) -> f64) -> Vec<BuildRecord> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let repo = Repo::new(&mut rng);
    let mut hist = history(&repo, &mut rng, 2000, 0.0);
    let mut odd = hist[0].clone();
    let mut targets = repo.build(&mut rng);
    odd.peak_memory_bytes = peak(repo.cost(&targets)) as u64;
    targets.push(label.into());
    targets.sort();
    odd.id = "odd".into();
    odd.targets = targets;
    hist.push(odd);
    hist
}

/// What `label` adds to the estimate of a small build elsewhere.
fn added(model: &SharedModel, label: &str) -> f64 {
    let base = ["//top1/pkg03:t0", "//top1/pkg04:t1"];
    let mut with = base.to_vec();
    with.push(label);
    model.predict(&ctx(), &with).unwrap() - model.predict(&ctx(), &base).unwrap()
}

/// A directory the history built once, in one build whose only target there was
/// costly: its packages the history never saw are not all priced at that target's
/// cost (`prior_count`, `package_prior`), while the directory the build showed stays
/// charged.
#[test]
fn one_build_does_not_price_a_whole_directory() {
    let hist = with_one_odd_build(4, "//top0/rare/lib:t0", |rest| rest + 6000.0 * MB);
    let train = |prior_count: f64, package_prior: f64| {
        SharedModel::train(&hist, &SharedConfig { prior_count, package_prior, ..shared_config() }, NOW).unwrap()
    };
    // Two priors pool the one build's evidence: the package's common target cost is held
    // near its top directory's (`package_prior`), so more of the excess lands on
    // `//top0/rare` itself, and a new package's mean leans on its directory's
    // (`prior_count`). Without both, the new package is charged the costly target's cost.
    let d = SharedConfig::default();
    let (pooled, alone) = (train(d.prior_count, d.package_prior), train(0.0, 0.0));
    // A package new to the history under `//top0` (the odd build's top), as the typical
    // new package is priced, and one under `//top0/rare`.
    let typical = added(&pooled, "//top0/fresh:t0");
    let (rare, rare_alone) = (added(&pooled, "//top0/rare/fresh:t0"), added(&alone, "//top0/rare/fresh:t0"));
    eprintln!(
        "a new package under //top0: {:.0} MB; under //top0/rare: {:.0} MB, {:.0} MB with neither prior",
        typical / MB,
        rare / MB,
        rare_alone / MB
    );
    assert!(rare < 0.75 * rare_alone, "the priors barely moved the directory's price");
    assert!(rare > typical, "the one build said //top0/rare is costly; it is priced as any other");
}

/// A package the history built once, in a build whose peak read 1.8x high: the package
/// does not take that build's whole excess (`package_prior`), which it would with no
/// prior, since nothing else the history holds prices its targets.
#[test]
fn a_package_built_once_with_a_high_label_is_not_charged_the_excess() {
    // Truly a typical package: 150 MB, and 2 MB for its target.
    let hist = with_one_odd_build(5, "//top1/once:t0", |rest| 1.8 * (rest + 152.0 * MB));
    let train = |package_prior: f64| {
        SharedModel::train(&hist, &SharedConfig { package_prior, ..shared_config() }, NOW).unwrap()
    };
    let once = "//top1/once:t0";
    let (held, free) = (added(&train(SharedConfig::default().package_prior), once), added(&train(0.0), once));
    eprintln!("the package built once: {:.0} MB, {:.0} MB with no package prior (truly 152 MB)", held / MB, free / MB);
    assert!(held < 0.5 * free, "the prior barely held the package: {:.0} MB against {:.0} MB", held / MB, free / MB);
    assert!(held < 3.0 * 152.0 * MB, "the package took the high label's excess: {:.0} MB", held / MB);
}

/// Targets that every training build held together or not at all share a history
/// group (the planner keeps such a group whole at a memory cut); a target held by a
/// different set of builds is in another, and one training never saw in none.
#[test]
fn targets_the_history_always_built_together_share_a_group() {
    use gantry_batch::{parse_label, Estimator, GroupEstimator};
    let mut hist = with_one_odd_build(5, "//top0/rare/lib:t0", |rest| rest);
    let odd = hist.last_mut().unwrap();
    odd.targets.push("//top0/rare/lib:t1".into());
    odd.targets.sort();
    let model = SharedModel::train(&hist, &SharedConfig { validation_fraction: 0.0, ..shared_config() }, NOW).unwrap();
    let labels = ["//top0/pkg00:t0", "//top0/rare/lib:t0", "//top0/rare/lib:t1", "//top9/new:t0"];
    let mut g = model.group(&ctx());
    for l in labels {
        g.push(&parse_label(l).unwrap());
    }
    let ids: Vec<Option<u64>> = (0..labels.len()).map(|i| g.cost_group(i)).collect();
    assert!(ids[0].is_some() && ids[1].is_some(), "{ids:?}");
    assert_eq!(ids[1], ids[2], "built only together");
    assert_ne!(ids[0], ids[1], "built in other builds");
    assert_eq!(ids[3], None, "never built");
    // After the queue's front is cut off, indices follow the queue.
    g.pop_front(1);
    assert_eq!(g.cost_group(0), ids[1]);
}

/// Executors are busy per action: in this history a build's occupancy is 1 ESU per
/// target, but `t3` of every fifth package is a heavy test of 20 ESU. The builds hold
/// random subsets of their packages' targets, so the history tells each target apart.
/// The occupancy part prices the heavy test on its own (`occupancy_shrink`), where at
/// memory's shrinkage it would be priced near its package's other targets, and every
/// batch holding it under-read.
#[test]
fn the_occupancy_part_prices_a_heavy_test_on_its_own() {
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let repo = Repo::new(&mut rng);
    let esu = |t: &str| {
        if t.ends_with(":t3") && t[t.len() - 5..t.len() - 3].parse::<u32>().unwrap() % 5 == 0 {
            20.0
        } else {
            1.0
        }
    };
    let mut hist = history(&repo, &mut rng, 3000, 0.0);
    for r in &mut hist {
        r.executor_service_seconds = r.wall_seconds * r.targets.iter().map(|t| esu(t)).sum::<f64>();
    }
    let occupancy = |model: &SharedModel, label: &str| model.estimate(&ctx(), &[label]).unwrap().1;
    let ratio = |model: &SharedModel| occupancy(model, "//top1/pkg10:t3") / occupancy(model, "//top1/pkg10:t2");
    let free = SharedModel::train(&hist, &shared_config(), NOW).unwrap();
    let held = SharedModel::train(&hist, &SharedConfig { occupancy_shrink: 0.05, ..shared_config() }, NOW).unwrap();
    let (free_ratio, held_ratio) = (ratio(&free), ratio(&held));
    eprintln!("heavy test / its neighbour: {free_ratio:.1} at the default, {held_ratio:.1} at memory's shrinkage");
    // Truly 20: a package of one target is estimated with its package's cost, so the
    // ratio is of (20 + package) to (1 + package) estimates.
    assert!(free_ratio > 5.0, "the heavy test priced on its own: {free_ratio:.2}");
    assert!(held_ratio < 0.6 * free_ratio, "memory's shrinkage holds it near its package: {held_ratio:.2}");
    // And a build of the whole package is estimated near its truth (25 ESU).
    let whole: Vec<String> = (0..6).map(|t| format!("//top1/pkg10:t{t}")).collect();
    let labels: Vec<&str> = whole.iter().map(String::as_str).collect();
    let est = free.estimate(&ctx(), &labels).unwrap().1;
    assert!((est / 25.0 - 1.0).abs() < 0.15, "the whole package: {est:.1} ESU");
}
