//! Seeded synthetic workload: a trace shaped like a real build cluster's,
//! for benchmarking when no recorded trace is given.
//!
//! Model (per action shape, then per execution):
//! * **Families**: every shape has a mnemonic and a program basename, and the
//!   family sets how parallel and how hungry it tends to be: C++ compiles are
//!   single-threaded and small, `lld` links use a few threads and much memory,
//!   `javac` runs a multi-threaded JVM with a memory floor of its own, tests
//!   are anything. Shapes of one family are similar, not equal.
//! * **Popularity**: executions pick a shape with Zipf popularity (exponent
//!   `key_popularity_exponent`), so popular shapes repeat a lot and a long
//!   tail is seen only a few times, as in real builds.
//! * **Scaling**: Amdahl with a parallelism `P` and a serial fraction `s`
//!   ~ U(0.05, 0.25): `T(C) = work × (s + (1 - s) / min(C, P))`; a
//!   single-threaded action runs no faster on bigger classes.
//! * **Work**: single-core run time Pareto(x_m = 2 s, α = 1.3) × √P × the
//!   family's scale, capped so the largest-class run stays under 600 s.
//! * **Memory floors**: Pareto per family, capped to fit the largest class;
//!   `min_class` is the smallest class with `class × memory_per_class_unit_mb`
//!   of memory. Below it the run is OOM-killed after U(0.2, 1) of its time.
//! * **Noise**: every execution scales by exp(N(0, `run_time_noise`)),
//!   0.1 by default, shared by all classes, and exp(N(0, 0.03)) per class.
//! * **New shapes**: a `late_shape_fraction` of shapes appear only from a
//!   random point in the trace on (new code), so some start mid-trace.
//! * **Drift**: a `drift_fraction` of shapes change at a random point: twice
//!   or half as parallel and three times the memory (a dependency upgrade).
//! * **Broken shapes**: a `broken_key_fraction` of shapes are being edited;
//!   each execution fails everywhere with probability `broken_instance_rate`
//!   (a compile error, after U(0.05, 0.3) of the run time), expressed as
//!   `min_class` above the largest class.
//! * **Arrivals**: Poisson, with the rate set so that running everything on
//!   the largest class would keep those workers `target_load` busy. From the
//!   middle of the trace, for `burst_fraction` of it, a burst of
//!   single-threaded compiles raises that to `burst_peak_load`: the baseline
//!   is still not overloaded, but on a fleet whose smallest class is sized for
//!   the usual load (such as [`super::SECOND_FLEET`]) the smallest class saturates.

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
    pub late_shape_fraction: f64,
    pub drift_fraction: f64,
    /// Utilisation of the largest-class workers during the burst if every action ran
    /// there (at most `target_load`: no burst).
    pub burst_peak_load: f64,
    /// Share of the trace's span the burst lasts.
    pub burst_fraction: f64,
    /// Weights of the families (see [`FAMILIES`]) in the shape mix, in that order.
    pub family_weights: Vec<f64>,
    pub requested_timeout_s: f64,
    /// Standard deviation of the log run time of one execution around its
    /// shape's (shared by all classes): 0.1 is about 10% run-to-run noise.
    pub run_time_noise: f64,
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
            late_shape_fraction: 0.25,
            drift_fraction: 0.05,
            burst_peak_load: 0.95,
            burst_fraction: 0.05,
            family_weights: FAMILIES.iter().map(|f| f.weight).collect(),
            requested_timeout_s: 900.0,
            run_time_noise: 0.1,
            seed: 42,
        }
    }
}

impl SyntheticConfig {
    /// A workload unlike the default, for scoring what was tuned on the
    /// default: test-heavy and more parallel, more new shapes, more drift, a
    /// longer and stronger burst, flatter popularity and a busier fleet.
    pub fn shifted() -> Self {
        Self {
            keys: 3_000,
            key_popularity_exponent: 0.7,
            target_load: 0.8,
            late_shape_fraction: 0.4,
            drift_fraction: 0.1,
            burst_peak_load: 0.97,
            burst_fraction: 0.08,
            family_weights: vec![0.25, 0.1, 0.15, 0.1, 0.35, 0.05],
            ..Self::default()
        }
    }

    /// The default workload with three times its run-to-run noise (30%), as on
    /// shared CI machines: tests race each other, caches are cold or warm. A
    /// learner tuned on quiet histories mistakes such noise for change. The
    /// clients' timeout is an hour, so a run slowed by noise is not lost.
    pub fn noisy() -> Self {
        Self { run_time_noise: 0.3, requested_timeout_s: 3600.0, ..Self::default() }
    }

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
        for (name, v) in [
            ("broken_key_fraction", self.broken_key_fraction),
            ("broken_instance_rate", self.broken_instance_rate),
            ("late_shape_fraction", self.late_shape_fraction),
            ("drift_fraction", self.drift_fraction),
            ("burst_fraction", self.burst_fraction),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return bad(format!("{name} must be in [0, 1], got {v}"));
            }
        }
        if !(self.burst_peak_load >= 0.0 && self.burst_peak_load.is_finite()) {
            return bad(format!("burst_peak_load must be finite and >= 0, got {}", self.burst_peak_load));
        }
        if self.family_weights.len() != FAMILIES.len()
            || self.family_weights.iter().any(|w| !(w.is_finite() && *w >= 0.0))
            || self.family_weights.iter().sum::<f64>() <= 0.0
        {
            return bad(format!("family_weights must be {} non-negative weights, not all 0", FAMILIES.len()));
        }
        if !(self.requested_timeout_s > 0.0 && self.requested_timeout_s.is_finite()) {
            return bad("requested_timeout_s must be > 0".into());
        }
        if !(self.run_time_noise >= 0.0 && self.run_time_noise.is_finite()) {
            return bad(format!("run_time_noise must be finite and >= 0, got {}", self.run_time_noise));
        }
        Ok(())
    }
}

/// A family of similar shapes.
pub struct Family {
    pub mnemonic: &'static str,
    /// Program basenames; a shape takes one.
    pub commands: &'static [&'static str],
    /// Share of shapes in the default mix.
    pub weight: f64,
    /// Weights of parallelism 1, 2, 4, 8 and 16.
    pub parallelism: [f64; 5],
    /// Memory floor: Pareto(x_m MB, α).
    pub memory_mb: (f64, f64),
    /// Work scale against a compile.
    pub work_scale: f64,
}

/// The families of the synthetic workload.
pub const FAMILIES: [Family; 6] = [
    Family {
        mnemonic: "CppCompile",
        commands: &["clang", "gcc"],
        weight: 0.55,
        parallelism: [0.95, 0.05, 0.0, 0.0, 0.0],
        memory_mb: (40.0, 1.3),
        work_scale: 1.0,
    },
    Family {
        mnemonic: "CppLink",
        commands: &["ld.lld", "ld.gold"],
        weight: 0.08,
        parallelism: [0.3, 0.3, 0.3, 0.1, 0.0],
        memory_mb: (300.0, 1.0),
        work_scale: 2.0,
    },
    Family {
        mnemonic: "Javac",
        commands: &["javac"],
        weight: 0.12,
        parallelism: [0.1, 0.5, 0.4, 0.0, 0.0],
        memory_mb: (600.0, 1.5),
        work_scale: 1.5,
    },
    Family {
        mnemonic: "GoCompile",
        commands: &["compile"],
        weight: 0.08,
        parallelism: [0.4, 0.4, 0.2, 0.0, 0.0],
        memory_mb: (50.0, 1.2),
        work_scale: 1.0,
    },
    Family {
        mnemonic: "TestRunner",
        commands: &["test-unit", "test-integration", "test-e2e", "pytest"],
        weight: 0.12,
        parallelism: [0.55, 0.2, 0.12, 0.08, 0.05],
        memory_mb: (20.0, 0.9),
        work_scale: 3.0,
    },
    Family {
        mnemonic: "Genrule",
        commands: &["bash", "python3"],
        weight: 0.05,
        parallelism: [0.8, 0.1, 0.05, 0.05, 0.0],
        memory_mb: (20.0, 1.0),
        work_scale: 1.0,
    },
];

#[derive(Clone, Copy)]
struct Behaviour {
    parallelism: u32,
    work_s: f64,
    serial: f64,
    min_class: SizeClass,
}

struct Shape {
    family: usize,
    command: usize,
    before: Behaviour,
    /// Behaviour from `drift_at` (a share of the trace) on.
    after: Option<(f64, Behaviour)>,
    /// Share of the trace from which the shape exists.
    born_at: f64,
    broken: bool,
}

fn unit_open(rng: &mut ChaCha8Rng) -> f64 {
    // (0, 1]: safe for ln() and negative powers.
    1.0 - rng.random::<f64>()
}

fn pareto(rng: &mut ChaCha8Rng, xm: f64, alpha: f64) -> f64 {
    xm * unit_open(rng).powf(-1.0 / alpha)
}

pub(crate) fn normal(rng: &mut ChaCha8Rng) -> f64 {
    // Box-Muller; one value per call keeps the stream simple to reason about.
    let (u1, u2) = (unit_open(rng), rng.random::<f64>());
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

fn uniform(rng: &mut ChaCha8Rng, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo) * rng.random::<f64>()
}

fn pick(rng: &mut ChaCha8Rng, weights: &[f64]) -> usize {
    let total: f64 = weights.iter().sum();
    let mut u = rng.random::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i;
        }
        u -= w;
    }
    weights.iter().rposition(|w| *w > 0.0).unwrap_or(0)
}

/// Amdahl run time of a behaviour on `class`.
fn run_time(b: &Behaviour, class: SizeClass) -> f64 {
    let cores = f64::from(class.min(b.parallelism));
    b.work_s * (b.serial + (1.0 - b.serial) / cores)
}

fn min_class_for(classes: &crate::SizeClasses, unit_mb: f64, mem_mb: f64) -> SizeClass {
    classes.iter().find(|c| f64::from(*c) * unit_mb >= mem_mb).unwrap_or(classes.largest())
}

/// Generates the synthetic trace for `fleet` (durations for every fleet
/// class). Deterministic for a given config and fleet.
pub fn generate(cfg: &SyntheticConfig, fleet: &Fleet) -> Result<Vec<TraceAction>, Error> {
    cfg.validate()?;
    let classes = fleet.classes();
    let largest = classes.largest();
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);

    let max_mem = f64::from(largest) * cfg.memory_per_class_unit_mb * 0.9;
    let behaviour = |rng: &mut ChaCha8Rng, parallelism: u32, work_s: f64, mem_mb: f64| {
        let parallelism = parallelism.min(largest).max(1);
        let serial = if parallelism > 1 { uniform(rng, 0.05, 0.25) } else { 1.0 };
        let mut b = Behaviour { parallelism, work_s, serial, min_class: 1 };
        let t_largest = run_time(&b, largest);
        if t_largest > 600.0 {
            b.work_s *= 600.0 / t_largest;
        }
        b.min_class = min_class_for(&classes, cfg.memory_per_class_unit_mb, mem_mb.min(max_mem));
        b
    };
    let shapes: Vec<Shape> = (0..cfg.keys)
        .map(|_| {
            let family = pick(&mut rng, &cfg.family_weights);
            let f = &FAMILIES[family];
            let command = rng.random_range(0..f.commands.len());
            let parallelism = 1u32 << pick(&mut rng, &f.parallelism);
            let work_s = pareto(&mut rng, 2.0, 1.3) * f64::from(parallelism).sqrt() * f.work_scale;
            let mem_mb = pareto(&mut rng, f.memory_mb.0, f.memory_mb.1);
            let before = behaviour(&mut rng, parallelism, work_s, mem_mb);
            let after = (rng.random::<f64>() < cfg.drift_fraction).then(|| {
                let p = if rng.random::<bool>() { parallelism * 2 } else { (parallelism / 2).max(1) };
                (uniform(&mut rng, 0.3, 0.7), behaviour(&mut rng, p, work_s, mem_mb * 3.0))
            });
            let born_at = if rng.random::<f64>() < cfg.late_shape_fraction { uniform(&mut rng, 0.1, 0.9) } else { 0.0 };
            Shape { family, command, before, after, born_at, broken: rng.random::<f64>() < cfg.broken_key_fraction }
        })
        .collect();

    // Zipf popularity: cumulative weights, sampled by binary search.
    let mut cdf = Vec::with_capacity(cfg.keys);
    let mut total = 0.0;
    for k in 0..cfg.keys {
        total += 1.0 / ((k + 1) as f64).powf(cfg.key_popularity_exponent);
        cdf.push(total);
    }
    let first_born = shapes.iter().position(|s| s.born_at == 0.0).unwrap_or(0);

    let execution = |rng: &mut ChaCha8Rng, k: usize, at: f64| {
        let shape = &shapes[k];
        let b = match shape.after {
            Some((when, after)) if at >= when => after,
            _ => shape.before,
        };
        let shared = (cfg.run_time_noise * normal(rng)).exp();
        let broken_now = shape.broken && rng.random::<f64>() < cfg.broken_instance_rate;
        let min_class = if broken_now { largest.saturating_mul(2) } else { b.min_class };
        let duration_s = classes
            .iter()
            .map(|c| {
                let mut d = run_time(&b, c) * shared * (0.03 * normal(rng)).exp();
                if broken_now {
                    d *= uniform(rng, 0.05, 0.3);
                } else if c < min_class {
                    d *= uniform(rng, 0.2, 1.0);
                }
                // Millisecond resolution keeps JSONL dumps short and exact.
                (c, (d * 1000.0).round() / 1000.0)
            })
            .collect();
        let f = &FAMILIES[shape.family];
        TraceAction {
            key: format!("k{k}"),
            arrival_s: 0.0,
            duration_s,
            min_class,
            requested_timeout_s: cfg.requested_timeout_s,
            mnemonic: Some(f.mnemonic.to_string()),
            command: Some(f.commands[shape.command].to_string()),
        }
    };

    let mut actions = Vec::with_capacity(cfg.actions);
    for i in 0..cfg.actions {
        let at = i as f64 / cfg.actions as f64;
        // A shape not born yet is drawn again: popularity among the living.
        let k = (0..32)
            .map(|_| {
                let u = rng.random::<f64>() * total;
                cdf.partition_point(|&c| c <= u).min(cfg.keys - 1)
            })
            .find(|&k| shapes[k].born_at <= at)
            .unwrap_or(first_born);
        actions.push(execution(&mut rng, k, at));
    }

    let mean_largest: f64 = actions.iter().map(|a| a.duration_s[&largest]).sum::<f64>() / actions.len() as f64;
    let rate = cfg.target_load * f64::from(fleet.workers(largest)) / mean_largest.max(1e-9);
    let mut t = 0.0;
    for a in &mut actions {
        t += -unit_open(&mut rng).ln() / rate;
        a.arrival_s = (t * 1000.0).round() / 1000.0;
    }

    // The burst: single-threaded compiles (the family that lives on the smallest class).
    let compiles: Vec<usize> = (0..cfg.keys)
        .filter(|&k| shapes[k].family == 0 && shapes[k].before.parallelism == 1 && shapes[k].born_at == 0.0)
        .filter(|&k| !shapes[k].broken && shapes[k].after.is_none())
        .collect();
    if cfg.burst_peak_load > cfg.target_load && cfg.burst_fraction > 0.0 && !compiles.is_empty() {
        let span = t;
        let (start, end) = (0.5 * span, (0.5 + cfg.burst_fraction) * span);
        let mean_s: f64 =
            compiles.iter().map(|&k| run_time(&shapes[k].before, largest)).sum::<f64>() / compiles.len() as f64;
        let extra = (cfg.burst_peak_load - cfg.target_load) * f64::from(fleet.workers(largest));
        let burst_rate = extra / mean_s.max(1e-9);
        let mut bt = start;
        loop {
            bt += -unit_open(&mut rng).ln() / burst_rate;
            if bt >= end {
                break;
            }
            let k = compiles[rng.random_range(0..compiles.len())];
            let mut a = execution(&mut rng, k, bt / span.max(1e-9));
            a.arrival_s = (bt * 1000.0).round() / 1000.0;
            actions.push(a);
        }
    }
    actions.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
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
        // The burst adds actions to the 20,000.
        assert!(t.len() > 20_000 && t.len() < 24_000, "{}", t.len());
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
        // Every action has a family; shapes of a family share its mnemonic.
        assert!(t.iter().all(|a| a.mnemonic.is_some() && a.command.is_some()));
        let mnemonics: std::collections::HashSet<&str> = t.iter().filter_map(|a| a.mnemonic.as_deref()).collect();
        assert_eq!(mnemonics.len(), FAMILIES.len());
        // Some shapes appear only after the first tenth of the trace.
        let first_tenth: std::collections::HashSet<&str> = t[..t.len() / 10].iter().map(|a| a.key.as_str()).collect();
        let late = t[t.len() / 2..].iter().filter(|a| !first_tenth.contains(a.key.as_str())).count();
        assert!(late > 500, "{late}");
    }

    #[test]
    fn the_burst_raises_the_offered_load_to_its_peak() {
        let fleet = parse_fleet("1:10,8:20").unwrap();
        let cfg = SyntheticConfig {
            actions: 50_000,
            keys: 500,
            target_load: 0.5,
            burst_peak_load: 0.9,
            burst_fraction: 0.1,
            ..Default::default()
        };
        let t = generate(&cfg, &fleet).unwrap();
        let span = t.last().unwrap().arrival_s;
        let load_in = |from: f64, to: f64| {
            let work: f64 = t
                .iter()
                .filter(|a| a.arrival_s >= from * span && a.arrival_s < to * span)
                .map(|a| a.duration_s[&8])
                .sum();
            work / ((to - from) * span) / 20.0
        };
        let (before, during) = (load_in(0.1, 0.45), load_in(0.5, 0.58));
        assert!((before - 0.5).abs() < 0.08, "before {before}");
        assert!((during - 0.9).abs() < 0.15, "during {during}");
    }

    #[test]
    fn offered_load_matches_target() {
        let fleet = parse_fleet("1:10,8:20").unwrap();
        let cfg = SyntheticConfig {
            actions: 50_000,
            keys: 500,
            target_load: 0.5,
            burst_peak_load: 0.0,
            ..Default::default()
        };
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
            SyntheticConfig { run_time_noise: -0.1, ..Default::default() },
            SyntheticConfig { run_time_noise: f64::NAN, ..Default::default() },
        ] {
            assert!(matches!(generate(&cfg, &fleet), Err(Error::InvalidSim(_))));
        }
    }
}
