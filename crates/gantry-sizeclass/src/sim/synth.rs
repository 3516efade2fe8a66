//! Seeded synthetic workload: a trace shaped like a real build cluster's,
//! for benchmarking when no recorded trace is given.
//!
//! Model (per action-shape key, then per execution):
//! * **Keys**: `keys` shapes; executions pick a key with Zipf popularity
//!   (exponent `key_popularity_exponent`), so popular shapes repeat a lot
//!   and a long tail is seen only a few times, as in real builds.
//! * **Parallelism** `P` (cores the action can use): Pareto(x_m = 1,
//!   α = 2) rounded down to a power of two and capped at the largest class:
//!   about 75% single-threaded, 19% two cores, 5% four, 1-2% eight.
//! * **Work**: single-core run time Pareto(x_m = 2 s, α = 1.3) × √P
//!   (parallel actions tend to be bigger: links, test suites), capped so the
//!   largest-class run stays under 600 s (well under the 900 s timeout).
//! * **Scaling**: Amdahl with a serial fraction `s` ~ U(0.05, 0.25):
//!   `T(C) = work × (s + (1 - s) / min(C, P))`; single-threaded actions run
//!   no faster on bigger classes.
//! * **Memory**: Pareto(x_m = 20 MB, α = 0.9), capped to fit the largest
//!   class: ~76% under 100 MB, ~1.5% over 2 GiB. `min_class` is the smallest
//!   fleet class with `class × memory_per_class_unit_mb` of memory; below
//!   it the run is OOM-killed after U(0.2, 1) of its run time.
//! * **Noise**: every execution scales by exp(N(0, 0.1)) shared by all
//!   classes and exp(N(0, 0.03)) per class.
//! * **Broken shapes**: a `broken_key_fraction` of keys are being edited;
//!   each of their executions fails everywhere with probability
//!   `broken_instance_rate` (a compile error: fails fast, after U(0.05, 0.3)
//!   of the run time), expressed as `min_class` above the largest class.
//! * **Arrivals**: Poisson, with the rate set so that running everything on
//!   the largest class would keep those workers `target_load` busy: the
//!   baseline is loaded but not overloaded.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::{Fleet, TraceAction};
use crate::{Error, SizeClass};

/// Parameters of the synthetic workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SyntheticConfig {
    pub actions: usize,
    pub keys: usize,
    pub key_popularity_exponent: f64,
    /// Utilisation of the largest-class workers if every action ran there.
    pub target_load: f64,
    pub memory_per_class_unit_mb: f64,
    pub broken_key_fraction: f64,
    pub broken_instance_rate: f64,
    pub requested_timeout_s: f64,
    pub seed: u64,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        Self {
            actions: 100_000,
            keys: 2_000,
            key_popularity_exponent: 0.9,
            target_load: 0.7,
            memory_per_class_unit_mb: 2048.0,
            broken_key_fraction: 0.02,
            broken_instance_rate: 0.3,
            requested_timeout_s: 900.0,
            seed: 42,
        }
    }
}

impl SyntheticConfig {
    fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::InvalidSim(m));
        if self.actions == 0 || self.keys == 0 {
            return bad("synthetic actions and keys must be positive".into());
        }
        if !(self.target_load > 0.0 && self.target_load.is_finite()) {
            return bad(format!("target_load must be > 0, got {}", self.target_load));
        }
        if !(self.key_popularity_exponent >= 0.0 && self.key_popularity_exponent.is_finite()) {
            return bad("key_popularity_exponent must be finite and >= 0".into());
        }
        if !(self.memory_per_class_unit_mb > 0.0 && self.memory_per_class_unit_mb.is_finite()) {
            return bad("memory_per_class_unit_mb must be > 0".into());
        }
        for (name, v) in
            [("broken_key_fraction", self.broken_key_fraction), ("broken_instance_rate", self.broken_instance_rate)]
        {
            if !(0.0..=1.0).contains(&v) {
                return bad(format!("{name} must be in [0, 1], got {v}"));
            }
        }
        if !(self.requested_timeout_s > 0.0 && self.requested_timeout_s.is_finite()) {
            return bad("requested_timeout_s must be > 0".into());
        }
        Ok(())
    }
}

struct Shape {
    parallelism: u32,
    work_s: f64,
    serial: f64,
    min_class: SizeClass,
    broken: bool,
}

fn unit_open(rng: &mut ChaCha8Rng) -> f64 {
    // (0, 1]: safe for ln() and negative powers.
    1.0 - rng.random::<f64>()
}

fn pareto(rng: &mut ChaCha8Rng, xm: f64, alpha: f64) -> f64 {
    xm * unit_open(rng).powf(-1.0 / alpha)
}

fn normal(rng: &mut ChaCha8Rng) -> f64 {
    // Box-Muller; one value per call keeps the stream simple to reason about.
    let (u1, u2) = (unit_open(rng), rng.random::<f64>());
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

fn uniform(rng: &mut ChaCha8Rng, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo) * rng.random::<f64>()
}

/// Amdahl run time of a shape on `class`.
fn run_time(shape: &Shape, class: SizeClass) -> f64 {
    let cores = f64::from(class.min(shape.parallelism));
    shape.work_s * (shape.serial + (1.0 - shape.serial) / cores)
}

/// Generates the synthetic trace for `fleet` (durations for every fleet
/// class). Deterministic for a given config and fleet.
pub fn generate(cfg: &SyntheticConfig, fleet: &Fleet) -> Result<Vec<TraceAction>, Error> {
    cfg.validate()?;
    let classes = fleet.classes();
    let largest = classes.largest();
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);

    let max_mem = f64::from(largest) * cfg.memory_per_class_unit_mb * 0.9;
    let shapes: Vec<Shape> = (0..cfg.keys)
        .map(|_| {
            let p_raw = pareto(&mut rng, 1.0, 2.0).min(f64::from(largest));
            // Largest power of two <= p_raw (p_raw >= 1).
            let parallelism = 1u32 << (p_raw.log2().floor() as u32);
            let serial = if parallelism > 1 { uniform(&mut rng, 0.05, 0.25) } else { 1.0 };
            let mut shape = Shape {
                parallelism,
                work_s: pareto(&mut rng, 2.0, 1.3) * f64::from(parallelism).sqrt(),
                serial,
                min_class: 1,
                broken: false,
            };
            let t_largest = run_time(&shape, largest);
            if t_largest > 600.0 {
                shape.work_s *= 600.0 / t_largest;
            }
            let mem_mb = pareto(&mut rng, 20.0, 0.9).min(max_mem);
            shape.min_class =
                classes.iter().find(|c| f64::from(*c) * cfg.memory_per_class_unit_mb >= mem_mb).unwrap_or(largest);
            shape.broken = rng.random::<f64>() < cfg.broken_key_fraction;
            shape
        })
        .collect();

    // Zipf popularity: cumulative weights, sampled by binary search.
    let mut cdf = Vec::with_capacity(cfg.keys);
    let mut total = 0.0;
    for k in 0..cfg.keys {
        total += 1.0 / ((k + 1) as f64).powf(cfg.key_popularity_exponent);
        cdf.push(total);
    }

    let mut actions = Vec::with_capacity(cfg.actions);
    for _ in 0..cfg.actions {
        let u = rng.random::<f64>() * total;
        let k = cdf.partition_point(|&c| c <= u).min(cfg.keys - 1);
        let shape = &shapes[k];
        let shared = (0.1 * normal(&mut rng)).exp();
        let broken_now = shape.broken && rng.random::<f64>() < cfg.broken_instance_rate;
        let min_class = if broken_now { largest.saturating_mul(2) } else { shape.min_class };
        let duration_s = classes
            .iter()
            .map(|c| {
                let mut d = run_time(shape, c) * shared * (0.03 * normal(&mut rng)).exp();
                if broken_now {
                    d *= uniform(&mut rng, 0.05, 0.3);
                } else if c < min_class {
                    d *= uniform(&mut rng, 0.2, 1.0);
                }
                // Millisecond resolution keeps JSONL dumps short and exact.
                (c, (d * 1000.0).round() / 1000.0)
            })
            .collect();
        actions.push(TraceAction {
            key: format!("k{k}"),
            arrival_s: 0.0,
            duration_s,
            min_class,
            requested_timeout_s: cfg.requested_timeout_s,
        });
    }

    let mean_largest: f64 = actions.iter().map(|a| a.duration_s[&largest]).sum::<f64>() / actions.len() as f64;
    let rate = cfg.target_load * f64::from(fleet.workers(largest)) / mean_largest.max(1e-9);
    let mut t = 0.0;
    for a in &mut actions {
        t += -unit_open(&mut rng).ln() / rate;
        a.arrival_s = (t * 1000.0).round() / 1000.0;
    }
    Ok(actions)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::parse_fleet;

    fn small() -> SyntheticConfig {
        SyntheticConfig { actions: 20_000, keys: 1_000, ..Default::default() }
    }

    #[test]
    fn deterministic_for_a_seed_and_different_across_seeds() {
        let fleet = Fleet::default();
        let a = generate(&small(), &fleet).unwrap();
        let b = generate(&small(), &fleet).unwrap();
        assert_eq!(a, b);
        let c = generate(&SyntheticConfig { seed: 7, ..small() }, &fleet).unwrap();
        assert_ne!(a, c);
    }

    #[test]
    fn workload_has_the_documented_shape() {
        let fleet = Fleet::default();
        let t = generate(&small(), &fleet).unwrap();
        assert_eq!(t.len(), 20_000);
        // Arrivals sorted, every fleet class has a duration.
        assert!(t.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
        assert!(t.iter().all(|a| { fleet.classes().iter().all(|c| a.duration_s.contains_key(&c)) }));
        // Most actions gain nothing from 8 cores; a few gain a lot.
        let speedup = |a: &TraceAction| a.duration_s[&1] / a.duration_s[&8];
        let ok: Vec<&TraceAction> = t.iter().filter(|a| a.min_class == 1).collect();
        let flat = ok.iter().filter(|a| speedup(a) < 1.2).count() as f64 / ok.len() as f64;
        let fast = ok.iter().filter(|a| speedup(a) > 3.0).count() as f64 / ok.len() as f64;
        assert!(flat > 0.6 && flat < 0.9, "single-threaded share {flat}");
        assert!(fast > 0.005 && fast < 0.15, "highly parallel share {fast}");
        // Memory: most fit class 1, a few need more.
        let big_mem = t.iter().filter(|a| a.min_class > 1 && a.min_class <= 8).count() as f64 / t.len() as f64;
        assert!(big_mem > 0.002 && big_mem < 0.06, "big-memory share {big_mem}");
        // Broken executions exist but are rare.
        let broken = t.iter().filter(|a| a.min_class > 8).count() as f64 / t.len() as f64;
        assert!(broken > 0.0 && broken < 0.03, "broken share {broken}");
        // Repeats: far fewer distinct keys than actions.
        let keys: std::collections::HashSet<&str> = t.iter().map(|a| a.key.as_str()).collect();
        assert!(keys.len() > 300 && keys.len() <= 1_000, "{}", keys.len());
        // Largest-class run times stay below the timeout.
        assert!(t.iter().all(|a| a.duration_s[&8] < 900.0));
    }

    #[test]
    fn offered_load_matches_target() {
        let fleet = parse_fleet("1:10,8:20").unwrap();
        let cfg = SyntheticConfig { actions: 50_000, keys: 500, target_load: 0.5, ..Default::default() };
        let t = generate(&cfg, &fleet).unwrap();
        let work: f64 = t.iter().map(|a| a.duration_s[&8]).sum();
        let span = t.last().unwrap().arrival_s;
        let load = work / span / 20.0;
        assert!((load - 0.5).abs() < 0.05, "offered load {load}");
    }

    #[test]
    fn rejects_bad_parameters() {
        let fleet = Fleet::default();
        for cfg in [
            SyntheticConfig { actions: 0, ..Default::default() },
            SyntheticConfig { target_load: 0.0, ..Default::default() },
            SyntheticConfig { broken_key_fraction: 1.5, ..Default::default() },
        ] {
            assert!(matches!(generate(&cfg, &fleet), Err(Error::InvalidSim(_))));
        }
    }
}
