//! The learner on histories whose costs are known exactly: it must find the
//! costs that packages and directory prefixes share (not charge them per
//! target), and one-sided label noise must not pull its estimates up.

use gantry_batch::history::{BuildRecord, Outcome, Timestamp};
use gantry_batch::model::Calibration;
use gantry_batch::{train, BuildContext, Command, Priority, TrainConfig};
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
/// the median signed error, of the long-window model (the learner itself;
/// the estimator's max with the one-day model is tested in models.rs).
fn errors(repo: &Repo, rng: &mut ChaCha8Rng, models: &gantry_batch::Models) -> (f64, f64, f64) {
    let mem = models.memory.as_ref().unwrap();
    let mut signed = Vec::new();
    for _ in 0..400 {
        let targets = repo.build(rng);
        let labels: Vec<&str> = targets.iter().map(|s| s.as_str()).collect();
        signed.push((mem.long.predict(&ctx(), &labels).unwrap() / repo.cost(&targets)).ln());
    }
    let mut abs: Vec<f64> = signed.iter().map(|x| x.abs()).collect();
    abs.sort_by(f64::total_cmp);
    signed.sort_by(f64::total_cmp);
    (abs[abs.len() / 2], abs[abs.len() * 9 / 10], signed[signed.len() / 2])
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
