//! The calibrated safety margin: how wrong a model is, learned from held-out
//! history, turned into the largest estimate that still keeps the chance of
//! exceeding a hard limit under a target rate.
//!
//! A batch is cut where its estimate reaches the priority's cutoff *or* where
//! `estimate × margin(rate)` reaches the real limit (the Bazel heap, the
//! executor pool), whichever comes first. With a centred model the cutoff
//! binds almost always and batches are as dense as the cutoff allows; the
//! margin only binds when the model is unsure, which is exactly when a fixed
//! cutoff alone would run out of memory. The planner never lets a memory margin fall
//! below `PlannerConfig::min_memory_margin`: this error is measured on whole builds,
//! and a heavy target the history never told apart from its package is a jump of a
//! few gigabytes that no such spread foresees.
//!
//! The error is modelled in log space, `ln(actual / estimate)`, with a
//! normal scale fitted from one side of the held-out residuals only: labels
//! are noisy on one side (a memory peak taken without a full GC is too high;
//! an occupancy that hit the action cache is too low), so the other side is
//! the one that describes the model's own error. A tail heavier than normal
//! (new targets, heavy-tailed target costs) gets an exponential tail fitted
//! through the central and the 2% points, which is exact for Laplace errors
//! and never thinner than the normal.

use serde::{Deserialize, Serialize};

/// Which side of the residuals is free of label noise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrustedSide {
    /// Labels may overestimate (memory): read the spread below the median.
    Lower,
    /// Labels may underestimate (occupancy): read the spread above it.
    Upper,
}

/// A model's log-error distribution on held-out builds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ErrorModel {
    /// Normal scale of `ln(actual / estimate)` for a centred estimate.
    pub sigma: f64,
    /// Beyond `tail.at`, the tail is exponential (a heavy tail was seen).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail: Option<ExpTail>,
    /// Held-out builds it was fitted on.
    pub samples: usize,
}

/// `P(ε > x) = level · exp(-(x - at) / beta)` for `x >= at`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ExpTail {
    pub level: f64,
    pub at: f64,
    pub beta: f64,
}

/// Fewer held-out residuals than this give no error model (and no margin).
pub const MIN_SAMPLES: usize = 30;

/// Tail level used to detect a tail heavier than normal, when there are at
/// least `TAIL_MIN_POINTS` residuals beyond it.
const TAIL_LEVEL: f64 = 0.02;
const TAIL_MIN_POINTS: f64 = 8.0;
/// The tail replaces the central scale only when it is this much wider:
/// below that, the difference is sampling noise of a normal tail, and taking
/// the wider of two noisy estimates would make the margin needlessly timid.
const HEAVY_TAIL_RATIO: f64 = 1.2;

impl ErrorModel {
    /// Fit from held-out log ratios `ln(actual / estimate)` of a centred
    /// model. `None` with fewer than [`MIN_SAMPLES`].
    pub fn fit(log_ratios: &[f64], side: TrustedSide) -> Option<ErrorModel> {
        let mut r: Vec<f64> = log_ratios.iter().copied().filter(|x| x.is_finite()).collect();
        if r.len() < MIN_SAMPLES {
            return None;
        }
        r.sort_by(f64::total_cmp);
        let q = |p: f64| r[((r.len() - 1) as f64 * p).round() as usize];
        let median = q(0.5);
        // Distance from the median to the trusted side's p-quantile.
        let dev_at = |p: f64| -> f64 {
            let dev = match side {
                TrustedSide::Lower => median - q(p),
                TrustedSide::Upper => q(1.0 - p) - median,
            };
            dev.max(0.0)
        };
        const CENTRAL: f64 = 0.158_655_25;
        let sigma = (dev_at(CENTRAL) / normal_quantile(1.0 - CENTRAL)).max(1e-6);
        let mut tail = None;
        if r.len() as f64 * TAIL_LEVEL >= TAIL_MIN_POINTS {
            let at = dev_at(TAIL_LEVEL);
            if at > HEAVY_TAIL_RATIO * sigma * normal_quantile(1.0 - TAIL_LEVEL) {
                // Exponential through the central and the tail point.
                let beta = (at - dev_at(CENTRAL)).max(1e-6) / (CENTRAL / TAIL_LEVEL).ln();
                tail = Some(ExpTail { level: TAIL_LEVEL, at, beta });
            }
        }
        Some(ErrorModel { sigma, tail, samples: r.len() })
    }

    /// P(actual > estimate × e^x): the chance that the truth exceeds the
    /// estimate by more than the log headroom `x`.
    pub fn exceed_probability(&self, log_headroom: f64) -> f64 {
        match self.tail {
            Some(t) if log_headroom >= t.at => t.level * (-(log_headroom - t.at) / t.beta).exp(),
            _ => normal_sf(log_headroom / self.sigma),
        }
    }

    /// The wider of two optional error models (judged at the default 0.1%
    /// OOM rate), or whichever exists: when an estimate is the max of two
    /// models, the margin must be honest for either.
    pub fn wider(a: Option<ErrorModel>, b: Option<ErrorModel>) -> Option<ErrorModel> {
        match (a, b) {
            (Some(a), Some(b)) => Some(if a.margin(0.001) >= b.margin(0.001) { a } else { b }),
            (a, b) => a.or(b),
        }
    }

    /// The factor `m` such that P(actual > estimate × m) = `rate`.
    pub fn margin(&self, rate: f64) -> f64 {
        let rate = rate.clamp(1e-9, 0.5);
        match self.tail {
            Some(t) if rate <= t.level => (t.at + t.beta * (t.level / rate).ln()).exp(),
            _ => (self.sigma * normal_quantile(1.0 - rate)).exp(),
        }
    }
}

/// Builds finished since the loaded models were trained, and how many of them ran out
/// of memory above their estimate: what the margin promised, against what happened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OomRecord {
    pub builds: u64,
    pub ooms: u64,
}

/// The OOM rate and the floor a memory margin is taken at, once the builds since the
/// models were trained ran out of memory more often than `target_rate` allows.
///
/// The error model is calibrated on held-out history, and there it holds: summed over
/// the held-out builds, its chances of passing the heap match the held-out OOMs. The
/// stream is not the history (new targets, larger batches), and there it can promise
/// several times fewer OOMs than happen. An OOM is the one outcome no label noise
/// reaches, so counting them is an honest check of the promise. Each OOM beyond
/// `target_rate × builds` scales the log margin by `1 + per_excess`: the floor is
/// raised to that power, and the rate is lowered to the one whose normal quantile is
/// that many times the target's, so a normal error's margin widens alike. Builds that
/// fit lower the excess again, so the margin relaxes once the rate is back within the
/// target. It never loosens below the configured margin.
pub fn tightened(target_rate: f64, floor: f64, record: OomRecord, per_excess: f64) -> (f64, f64) {
    let excess = (record.ooms as f64 - target_rate * record.builds as f64).max(0.0);
    let scale = 1.0 + per_excess * excess;
    if scale <= 1.0 || !scale.is_finite() {
        return (target_rate, floor);
    }
    (rate_at_quantile(scale * normal_quantile(1.0 - target_rate), target_rate), floor.powf(scale))
}

/// The rate `r <= upper` whose [`normal_quantile`]`(1 - r)` is `z`, by bisection in log
/// space: the exact inverse of the quantile [`ErrorModel::margin`] reads, which the
/// survival approximation is not to the last digit.
fn rate_at_quantile(z: f64, upper: f64) -> f64 {
    let (mut lo, mut hi) = (1e-12f64, upper);
    for _ in 0..60 {
        let mid = (lo * hi).sqrt();
        if normal_quantile(1.0 - mid) > z {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi
}

/// Upper tail of the standard normal, P(Z > z), by Abramowitz and Stegun
/// 7.1.26 (absolute error below 1.5e-7, plenty for rates of 1e-4 and up).
pub fn normal_sf(z: f64) -> f64 {
    if z < 0.0 {
        return 1.0 - normal_sf(-z);
    }
    let x = z / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly =
        t * (0.254_829_592 + t * (-0.284_496_736 + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    0.5 * poly * (-x * x).exp()
}

/// The standard normal quantile (Acklam's rational approximation, relative
/// error below 1.2e-9), for `p` in (0, 1).
pub fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] =
        [7.784_695_709_041_462e-3, 3.224_671_290_700_398e-1, 2.445_134_137_142_996, 3.754_408_661_907_416];
    let p = p.clamp(1e-300, 1.0 - 1e-16);
    let lo = 0.024_25;
    if p < lo {
        let q = (-2.0 * p.ln()).sqrt();
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    } else if p <= 1.0 - lo {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        -normal_quantile(1.0 - p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn normal(rng: &mut ChaCha8Rng) -> f64 {
        let u1: f64 = rng.random::<f64>().max(1e-12);
        let u2: f64 = rng.random::<f64>();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    #[test]
    fn normal_functions_agree_with_tables() {
        for (z, sf) in [(0.0, 0.5), (1.0, 0.158_655_25), (1.959_964, 0.025), (3.090_232, 0.001), (3.719_016, 0.0001)] {
            assert!((normal_sf(z) - sf).abs() < 2e-7 + sf * 1e-3, "sf({z}) = {}", normal_sf(z));
            assert!(
                (normal_quantile(1.0 - sf) - z).abs() < 1e-5,
                "quantile({}) = {}",
                1.0 - sf,
                normal_quantile(1.0 - sf)
            );
        }
        assert!((normal_sf(-1.0) - (1.0 - 0.158_655_25)).abs() < 1e-6);
    }

    #[test]
    fn recovers_a_normal_scale_despite_one_sided_label_noise() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        // 4% of labels are up to 1.8x too high: the upper side is useless.
        let r: Vec<f64> = (0..3000)
            .map(|_| {
                let e = 0.08 * normal(&mut rng);
                if rng.random::<f64>() < 0.04 {
                    e + rng.random_range(0.0..1.8f64.ln())
                } else {
                    e
                }
            })
            .collect();
        let m = ErrorModel::fit(&r, TrustedSide::Lower).unwrap();
        assert!((m.sigma - 0.08).abs() < 0.01, "{m:?}");
        assert_eq!(m.tail, None, "a normal error needs no heavy tail");
        // The margin is the normal one: 0.1% above e^(3.09 sigma).
        assert!((m.margin(0.001).ln() / m.sigma - 3.09).abs() < 0.01);
        let upper = ErrorModel::fit(&r, TrustedSide::Upper).unwrap();
        assert!(upper.margin(0.001) > 1.2 * m.margin(0.001), "the contaminated side reads wider: {upper:?}");
    }

    #[test]
    fn a_heavy_tail_widens_the_scale() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        // Laplace errors: same central spread as the normal, far heavier tail.
        let r: Vec<f64> = (0..4000)
            .map(|_| {
                let u: f64 = rng.random::<f64>() - 0.5;
                -0.06 * u.signum() * (1.0 - 2.0 * u.abs()).max(1e-12).ln()
            })
            .collect();
        let m = ErrorModel::fit(&r, TrustedSide::Upper).unwrap();
        // Laplace(b) has P(X > t) = exp(-t/b)/2: the 0.1% point is b ln 500.
        let true_margin = (0.06 * 500f64.ln()).exp();
        let got = m.margin(0.001);
        assert!(m.tail.is_some(), "{m:?}");
        assert!((got.ln() / true_margin.ln() - 1.0).abs() < 0.12, "{got} vs {true_margin}");
        assert!(
            (m.exceed_probability(true_margin.ln()) / 0.001 - 1.0).abs() < 0.5,
            "{}",
            m.exceed_probability(true_margin.ln())
        );
    }

    #[test]
    fn excess_ooms_tighten_the_margin_and_builds_that_fit_relax_it() {
        let m = ErrorModel { sigma: 0.08, tail: None, samples: 100 };
        let at = |builds, ooms| tightened(0.001, 1.37, OomRecord { builds, ooms }, 0.05);
        // Within the rate (1 OOM in 2,000 builds allows 2), or nothing seen: unchanged.
        assert_eq!(at(0, 0), (0.001, 1.37));
        assert_eq!(at(2000, 1), (0.001, 1.37));
        assert_eq!(at(2000, 2), (0.001, 1.37));
        // Six OOMs in 1,000 builds: five in excess, the log margin ×1.25.
        let (rate, floor) = at(1000, 6);
        assert!((floor.ln() / 1.37f64.ln() - 1.25).abs() < 1e-9, "{floor}");
        assert!((m.margin(rate).ln() / m.margin(0.001).ln() - 1.25).abs() < 1e-6, "{rate}");
        assert!(rate < 0.001 && rate > 1e-5);
        // More OOMs, tighter; more builds that fit, looser again, never past the target.
        let mut last = (0.001, 1.37);
        for ooms in 1..20 {
            let now = at(1000, ooms);
            assert!(now.0 <= last.0 && now.1 >= last.1, "{ooms}: {now:?} after {last:?}");
            last = now;
        }
        let mut last = at(1000, 6);
        for builds in (1000..8000).step_by(500) {
            let now = at(builds, 6);
            assert!(now.0 >= last.0 && now.1 <= last.1 && now.0 <= 0.001 && now.1 >= 1.37, "{builds}");
            last = now;
        }
        assert_eq!(at(6000, 6), (0.001, 1.37));
        // Off.
        assert_eq!(tightened(0.001, 1.37, OomRecord { builds: 10, ooms: 9 }, 0.0), (0.001, 1.37));
    }

    #[test]
    fn too_few_samples_give_no_model() {
        assert_eq!(ErrorModel::fit(&[0.1; 10], TrustedSide::Lower), None);
    }
}
