//! Learned local delay: per-command-shape history and the policy that turns it
//! into a [`DelayPlan`].
//!
//! # Model
//! For one command shape, the remote branch either hits the cache (probability
//! `p`, ready after `H`) or learns of a miss after `m` and is ready `X` later.
//! The local branch, once started, takes `L`. Starting local at `d`, the run
//! ends at `T = min(R, d + L)` and local burns `B = max(0, T - d)` of CPU.
//!
//! Starting local at once always minimises `T` alone, so a delay is only worth
//! anything because local work has a price (the shared local machine, the
//! battery, other jobs). The policy minimises
//!
//! ```text
//!     J(d) = E[T] + local_cost * E[B]
//! ```
//!
//! over the empirical distributions. This gives the intended behaviour:
//! a shape that nearly always hits waits about as long as a hit takes
//! (local work would almost surely be thrown away); a shape that never hits
//! and whose local run beats remote starts local at once; a shape whose
//! remote execution is reliably faster waits until remote is overdue.
//!
//! The plan has two parts because the coordinator learns about a miss early:
//! `after_miss` minimises `J` with `p = 0` over the remaining remote time, and
//! `initial` minimises `J` over the mixture, knowing a miss will re-plan.
//!
//! # Censoring
//! The losing branch is cancelled, so its duration is only known to exceed the
//! time it ran. Treating such samples as complete would make the loser look
//! as fast as the winner, and the delay would creep upward run after run.
//! Durations are therefore stored with a `censored` flag and turned into
//! distributions with the Kaplan-Meier estimator. Where the surviving tail
//! mass goes is unknowable, and the choice is deliberately asymmetric, biased
//! towards starting local early, because that error only costs local CPU while
//! the opposite error costs wall time and stops producing the samples that
//! would reveal it:
//! - remote tail at `horizon` ("may never come back in time");
//! - local tail at the longest censored run ("may finish right after we
//!   stopped watching"). A shape whose local runs were only ever cut short by
//!   quick cache hits thus still starts local after a miss and learns its real
//!   duration; a shape whose local runs were cut by remote executions learns
//!   that local is at least as slow as remote, and waits.
//!
//! `J` is piecewise linear in `d` with kinks at `r - l` and `r` for sample
//! pairs, so evaluating it at those candidates (clamped to `[0, max_delay]`)
//! finds the exact minimum over the (compressed) empirical distributions.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::coordinator::RaceReport;
use crate::Error;

/// When the coordinator starts the local branch in dynamic mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DelayPlan {
    /// Delay from the start of the run.
    pub initial: Duration,
    /// Delay from the moment the remote branch reports a cache miss
    /// (replaces `initial` if local has not started yet).
    pub after_miss: Duration,
}

impl DelayPlan {
    /// The same delay before and after a miss (e.g. Bazel's fixed 1 s).
    pub fn fixed(delay: Duration) -> DelayPlan {
        DelayPlan { initial: delay, after_miss: delay }
    }
}

/// Policy parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DelayConfig {
    /// Samples kept per series per shape (bounded history; oldest dropped).
    pub history: usize,
    /// Seconds of wall time one second of local work is worth (`local_cost` in `J`).
    pub local_cost: f64,
    /// Upper bound on any delay.
    pub max_delay: Duration,
    /// Where unfinished (censored-tail) probability mass is placed.
    pub horizon: Duration,
    /// Plan for shapes without usable history: race at once, which also
    /// yields a sample of both branches to learn from.
    pub cold_start: DelayPlan,
    /// Distributions are compressed to at most this many points to bound cost.
    pub max_points: usize,
}

impl Default for DelayConfig {
    fn default() -> DelayConfig {
        DelayConfig {
            history: 32,
            local_cost: 0.25,
            max_delay: Duration::from_secs(30),
            horizon: Duration::from_secs(600),
            cold_start: DelayPlan::fixed(Duration::ZERO),
            max_points: 12,
        }
    }
}

impl DelayConfig {
    pub fn validate(&self) -> Result<(), Error> {
        if self.history == 0 || self.max_points == 0 {
            return Err(Error::InvalidConfig("history and max_points must be positive".into()));
        }
        if !(self.local_cost.is_finite() && self.local_cost >= 0.0) {
            return Err(Error::InvalidConfig(format!("local_cost {} must be finite and >= 0", self.local_cost)));
        }
        if self.horizon <= self.max_delay {
            return Err(Error::InvalidConfig("horizon must exceed max_delay".into()));
        }
        Ok(())
    }
}

/// A duration in milliseconds; `censored` means "at least this long" (cancelled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sample {
    pub ms: u64,
    pub censored: bool,
}

/// Bounded per-shape history.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ShapeStats {
    /// Number of observations folded in.
    pub runs: u64,
    /// Recent cache lookups, `true` = hit.
    pub lookups: VecDeque<bool>,
    /// Start of run to remote ready, for cache hits.
    pub hit_ms: VecDeque<u64>,
    /// Start of run to "miss" known.
    pub miss_known_ms: VecDeque<u64>,
    /// Miss known to remote ready (censored if remote lost).
    pub remote_after_miss: VecDeque<Sample>,
    /// Local start to local ready (censored if local lost).
    pub local: VecDeque<Sample>,
}

/// What one race taught us about its shape. Unknown parts are `None`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Observation {
    /// `Some(true)` hit, `Some(false)` miss, `None` race ended before lookup.
    pub cache_hit: Option<bool>,
    pub hit_ms: Option<u64>,
    pub miss_known_ms: Option<u64>,
    pub remote_after_miss: Option<Sample>,
    pub local: Option<Sample>,
}

fn ms_between(from: Duration, to: Duration) -> u64 {
    u64::try_from(to.saturating_sub(from).as_millis()).unwrap_or(u64::MAX)
}

impl Observation {
    /// Extract durations from a finished race. Failures teach nothing about
    /// durations and are left out; a cancelled branch yields a censored sample
    /// ending when it was told to cancel.
    pub fn from_report(r: &RaceReport) -> Observation {
        let mut o = Observation::default();
        let Some(start) = r.started_at else { return o };
        if r.remote_from_cache {
            o.cache_hit = Some(true);
            o.hit_ms = r.remote.ready_at.map(|t| ms_between(start, t));
        } else if let Some(miss) = r.cache_miss_at {
            o.cache_hit = Some(false);
            o.miss_known_ms = Some(ms_between(start, miss));
            o.remote_after_miss = match (r.remote.ready_at, r.remote.cancel_requested_at) {
                (Some(t), _) => Some(Sample { ms: ms_between(miss, t), censored: false }),
                (None, Some(t)) => Some(Sample { ms: ms_between(miss, t), censored: true }),
                (None, None) => None,
            };
        }
        if let Some(ls) = r.local.started_at {
            o.local = match (r.local.ready_at, r.local.cancel_requested_at) {
                (Some(t), _) => Some(Sample { ms: ms_between(ls, t), censored: false }),
                (None, Some(t)) => Some(Sample { ms: ms_between(ls, t), censored: true }),
                (None, None) => None,
            };
        }
        o
    }
}

fn push_bounded<T>(q: &mut VecDeque<T>, v: T, cap: usize) {
    q.push_back(v);
    while q.len() > cap {
        q.pop_front();
    }
}

/// Fold one observation into the shape's bounded history.
pub fn update(stats: &mut ShapeStats, obs: &Observation, config: &DelayConfig) {
    let cap = config.history.max(1);
    stats.runs += 1;
    if let Some(hit) = obs.cache_hit {
        push_bounded(&mut stats.lookups, hit, cap);
    }
    if let Some(v) = obs.hit_ms {
        push_bounded(&mut stats.hit_ms, v, cap);
    }
    if let Some(v) = obs.miss_known_ms {
        push_bounded(&mut stats.miss_known_ms, v, cap);
    }
    if let Some(v) = obs.remote_after_miss {
        push_bounded(&mut stats.remote_after_miss, v, cap);
    }
    if let Some(v) = obs.local {
        push_bounded(&mut stats.local, v, cap);
    }
}

/// A discrete distribution over milliseconds; weights sum to 1.
#[derive(Debug, Clone, PartialEq)]
pub struct Dist {
    pub points: Vec<(f64, f64)>,
}

impl Dist {
    /// Kaplan-Meier estimate; the surviving tail mass goes to `tail_ms`, or
    /// to the longest (censored) sample if `tail_ms` is `None`.
    /// `None` for no samples.
    pub fn kaplan_meier(samples: impl IntoIterator<Item = Sample>, tail_ms: Option<f64>) -> Option<Dist> {
        let mut v: Vec<Sample> = samples.into_iter().collect();
        if v.is_empty() {
            return None;
        }
        // Events before censorings at equal times (the usual KM convention).
        v.sort_by_key(|s| (s.ms, s.censored));
        let mut at_risk = v.len() as f64;
        let mut survival = 1.0;
        let mut points = Vec::new();
        for s in &v {
            if !s.censored {
                let w = survival / at_risk;
                points.push((s.ms as f64, w));
                survival -= w;
            }
            at_risk -= 1.0;
        }
        if survival > 1e-12 {
            let longest = v.last().map_or(0.0, |s| s.ms as f64);
            points.push((tail_ms.unwrap_or(longest), survival));
        }
        Some(Dist { points })
    }

    /// Equal-weight empirical distribution of complete samples.
    pub fn empirical(values: impl IntoIterator<Item = u64>) -> Option<Dist> {
        let mut v: Vec<f64> = values.into_iter().map(|x| x as f64).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let w = 1.0 / v.len() as f64;
        Some(Dist { points: v.into_iter().map(|x| (x, w)).collect() })
    }

    /// Merge neighbouring points into at most `k` weighted means, keeping the
    /// policy's cost bounded for long histories.
    pub fn compress(mut self, k: usize) -> Dist {
        let k = k.max(1);
        if self.points.len() <= k {
            return self;
        }
        self.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let n = self.points.len();
        let mut out = Vec::with_capacity(k);
        for chunk in 0..k {
            let (lo, hi) = (chunk * n / k, (chunk + 1) * n / k);
            let w: f64 = self.points[lo..hi].iter().map(|p| p.1).sum();
            if w > 0.0 {
                let mean = self.points[lo..hi].iter().map(|p| p.0 * p.1).sum::<f64>() / w;
                out.push((mean, w));
            }
        }
        Dist { points: out }
    }

    /// Smallest value with cumulative weight >= `q`.
    pub fn quantile(&self, q: f64) -> f64 {
        let mut sorted = self.points.clone();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut acc = 0.0;
        for (x, w) in &sorted {
            acc += w;
            if acc + 1e-12 >= q {
                return *x;
            }
        }
        sorted.last().map_or(0.0, |p| p.0)
    }
}

/// Cost of one (remote end, local start, local duration) case, in ms.
fn case_cost(remote_end: f64, local_start: f64, local_ms: f64, lambda: f64) -> f64 {
    let end = remote_end.min(local_start + local_ms);
    end + lambda * (end - local_start).max(0.0)
}

/// Distributions the policy works on (all in ms).
struct Model {
    p_hit: f64,
    hits: Option<Dist>,
    miss_known: f64,
    after_miss: Dist,
    local: Dist,
}

fn model(stats: &ShapeStats, config: &DelayConfig) -> Option<Model> {
    let horizon = config.horizon.as_secs_f64() * 1000.0;
    let k = config.max_points;
    let local = Dist::kaplan_meier(stats.local.iter().copied(), None)?.compress(k);
    if stats.lookups.is_empty() {
        return None;
    }
    let p_hit = stats.lookups.iter().filter(|h| **h).count() as f64 / stats.lookups.len() as f64;
    let hits = Dist::empirical(stats.hit_ms.iter().copied()).map(|d| d.compress(k));
    let miss_known = Dist::empirical(stats.miss_known_ms.iter().copied()).map_or(0.0, |d| d.quantile(0.5));
    // No miss ever observed: assume remote execution may never come back in
    // time, which makes a miss start local at once (the safe direction).
    let after_miss = Dist::kaplan_meier(stats.remote_after_miss.iter().copied(), Some(horizon))
        .unwrap_or(Dist { points: vec![(horizon, 1.0)] })
        .compress(k);
    Some(Model { p_hit, hits, miss_known, after_miss, local })
}

fn argmin(candidates: impl IntoIterator<Item = f64>, max_ms: f64, cost: impl Fn(f64) -> f64) -> f64 {
    let mut cands: Vec<f64> = candidates.into_iter().map(|d| d.clamp(0.0, max_ms)).collect();
    cands.push(0.0);
    cands.sort_by(f64::total_cmp);
    cands.dedup();
    let mut best = (f64::INFINITY, 0.0);
    for d in cands {
        let c = cost(d);
        // Strictly better only: ties go to the smaller delay (earlier fallback).
        if c < best.0 - 1e-9 {
            best = (c, d);
        }
    }
    best.1
}

fn to_duration(ms: f64) -> Duration {
    Duration::from_micros((ms * 1000.0).round().max(0.0) as u64)
}

/// Expected cost of starting local `d` ms after a miss is known.
fn after_miss_cost(m: &Model, d: f64, lambda: f64) -> f64 {
    let mut c = 0.0;
    for &(r, wr) in &m.after_miss.points {
        for &(l, wl) in &m.local.points {
            c += wr * wl * case_cost(r, d, l, lambda);
        }
    }
    c
}

/// Expected cost of an initial delay `d`, given the miss re-plan `d_miss`.
fn initial_cost(m: &Model, d: f64, d_miss: f64, lambda: f64) -> f64 {
    let mut c = 0.0;
    if let Some(hits) = &m.hits {
        for &(h, wh) in &hits.points {
            for &(l, wl) in &m.local.points {
                c += m.p_hit * wh * wl * case_cost(h, d, l, lambda);
            }
        }
    }
    // If local has not started when the miss is known, the coordinator
    // re-plans to start at miss + d_miss.
    let start = if d <= m.miss_known { d } else { m.miss_known + d_miss };
    for &(r, wr) in &m.after_miss.points {
        for &(l, wl) in &m.local.points {
            c += (1.0 - m.p_hit) * wr * wl * case_cost(m.miss_known + r, start, l, lambda);
        }
    }
    c
}

/// Choose when to start the local branch for a shape with this history.
pub fn choose_delay(stats: &ShapeStats, config: &DelayConfig) -> DelayPlan {
    let Some(m) = model(stats, config) else {
        return config.cold_start;
    };
    let lambda = config.local_cost;
    let max_ms = config.max_delay.as_secs_f64() * 1000.0;

    let mut miss_cands = Vec::new();
    for &(r, _) in &m.after_miss.points {
        miss_cands.push(r);
        for &(l, _) in &m.local.points {
            miss_cands.push(r - l);
        }
    }
    let d_miss = argmin(miss_cands, max_ms, |d| after_miss_cost(&m, d, lambda));

    let mut cands = vec![m.miss_known];
    if let Some(hits) = &m.hits {
        for &(h, _) in &hits.points {
            cands.push(h);
            for &(l, _) in &m.local.points {
                cands.push(h - l);
            }
        }
    }
    for &(r, _) in &m.after_miss.points {
        cands.push(m.miss_known + r);
        for &(l, _) in &m.local.points {
            cands.push(m.miss_known + r - l);
        }
    }
    let d0 = argmin(cands, max_ms, |d| initial_cost(&m, d, d_miss, lambda));
    DelayPlan { initial: to_duration(d0), after_miss: to_duration(d_miss) }
}

/// Current format version of [`DelayStore`] JSON.
pub const STORE_VERSION: u32 = 1;

/// All shapes' histories, persisted between `gantry run` invocations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DelayStore {
    pub version: u32,
    pub shapes: BTreeMap<String, ShapeStats>,
}

impl Default for DelayStore {
    fn default() -> DelayStore {
        DelayStore { version: STORE_VERSION, shapes: BTreeMap::new() }
    }
}

impl DelayStore {
    pub fn to_json(&self) -> Result<String, Error> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    /// Parse, refusing other versions (the caller may then start afresh).
    pub fn from_json(text: &str) -> Result<DelayStore, Error> {
        #[derive(Deserialize)]
        struct Header {
            version: u32,
        }
        let header: Header = serde_json::from_str(text)?;
        if header.version != STORE_VERSION {
            return Err(Error::UnsupportedVersion { found: header.version, expected: STORE_VERSION });
        }
        Ok(serde_json::from_str(text)?)
    }

    pub fn plan(&self, shape: &str, config: &DelayConfig) -> DelayPlan {
        self.shapes.get(shape).map_or(config.cold_start, |s| choose_delay(s, config))
    }

    pub fn record(&mut self, shape: &str, obs: &Observation, config: &DelayConfig) {
        update(self.shapes.entry(shape.to_string()).or_default(), obs, config);
    }
}

/// Reduce a command line to its "shape": the program's base name, flags
/// without their values, and operands replaced by their extension class.
/// Commands of one shape (e.g. `cc -c *.c -o *.o`) tend to share timing and
/// cacheability, while the exact key (input digests) never repeats on a miss.
pub fn shape_key(argv: &[String]) -> String {
    let mut parts = Vec::with_capacity(argv.len());
    for (i, arg) in argv.iter().enumerate() {
        if i == 0 {
            parts.push(arg.rsplit('/').next().unwrap_or(arg).to_string());
        } else if arg.starts_with('-') {
            parts.push(arg.split('=').next().unwrap_or(arg).to_string());
        } else {
            let base = arg.rsplit('/').next().unwrap_or(arg);
            parts.push(match base.rsplit_once('.') {
                Some((stem, ext)) if !stem.is_empty() && !ext.is_empty() => format!("*.{ext}"),
                _ => "*".to_string(),
            });
        }
    }
    parts.join(" ")
}
