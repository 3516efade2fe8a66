//! Size class selection: the pure function [`select`] that maps (statistics
//! of a shape, statistics of similar shapes, available classes, requested
//! timeout, config, optional queue state, one random draw, now) to a
//! [`Decision`]: a class, and when to hedge on the largest class.
//!
//! # Rules, in order
//!
//! 1. **Failure boost.** If the shape failed or timed out on the largest class
//!    less than `failure_cache_duration` ago, and has not succeeded since, run
//!    on the largest class: a failing action (a compile error being fixed)
//!    would otherwise fail on a small class first and pay twice.
//! 2. **New shape.** Without any outcome of its own, a shape starts where
//!    similar shapes (same mnemonic, command or configuration; the caller
//!    builds the [`Prior`]) ended up: the smallest class at or above the best
//!    class of [`PRIOR_QUANTILE`] of them, hedged after
//!    `minimum_execution_timeout`. Without [`PRIOR_MIN_SHAPES`] similar
//!    shapes it runs on the largest class, which measures its baseline.
//! 3. **Estimates across classes.** Every class gets an expected run time
//!    `T(c)` from all of the shape's history, not only its own:
//!    * a class with outcomes: the median of its successes and of its
//!      censored runs (a run cancelled or killed after `d` took at least `d`);
//!    * a class between two measured ones: the Amdahl curve `a + b / c`
//!      through its neighbours (the shape's speedup curve);
//!    * a class below every measured one: optimistically the time of the
//!      nearest measured class above (no slowdown), marked *untried*;
//!    * a class above every measured one: the time of the nearest one below
//!      (no speedup assumed), also untried.
//!
//!    Times are then made monotone both ways: a larger class is never slower
//!    than a smaller class's median success, once it has [`CAP_MIN_SUCCESSES`] (so a shape that became faster on
//!    more cores is not held to its old times on a class it no longer runs
//!    on), and a smaller class is never faster (so a class measured too slow
//!    rules out every class below it). A class's history also starts over
//!    at a change point (see [`ActionStats::push`]).
//!    Memory failures are monotone too: a success on class `c` counts for
//!    every class above it, an attributed failure (the largest class then
//!    succeeded) on class `c` counts against every class below it. The fit
//!    probability is the posterior mean of a `Beta(prior_successes,
//!    prior_failures)` prior; a class *fits* when it reaches
//!    `success_threshold` (an unseen class gets 0.5 and fits at the default).
//! 4. **Choice.** With `L` the largest class and `x` the
//!    `acceptable_time_exponent`, class `c` is *acceptable* when its expected
//!    completion (queue wait plus `T(c)`) is at most
//!    `(wait(L) + T(L)) × (L / c)^x`: the slowdown we accept for the saving.
//!    Queue waits count only when the [`QueueState`] is given; a long queue
//!    on `L` makes small classes more acceptable and a saturated small class
//!    less. Among the acceptable classes that fit, measured or between
//!    measured ones, the one with the least expected cost `c × T(c)` wins
//!    (ties go to the larger, faster class); `L` is always acceptable.
//!    If a cheaper class is acceptable only on its optimistic untried
//!    estimate, or, between two measured classes, on its best case (the time
//!    of the measured class above it: the shape may stop speeding up at a few
//!    cores, where the Amdahl curve assumes it never does), it is tried
//!    instead (exploration); and with probability
//!    `exploration_factor` (on the draw) the fitting class just below the
//!    winner is retried, so a shape whose behaviour changed is noticed, unless
//!    it was measured past its hedge time (`acceptable × m`, `m` as in rule 5):
//!    such a class cannot win back a shape whose run times only drifted
//!    down; retried, it ran slower than the largest class with no hedge able
//!    to help. While that class's run time is over the accepted one by less
//!    than the noise of its own median (see [`UNCERTAIN_REFRESH`]), it is
//!    retried with probability `max(exploration_factor, UNCERTAIN_REFRESH)`
//!    instead (0 still turns retries off): on a shape with 30% run-to-run
//!    noise, a median of five runs on a small class is often unlucky, and
//!    without this a single-threaded shape could stay on a larger class for good.
//!    With probability `exploration_factor × REFRESH_UP_SHARE` (the
//!    top of the draw's range) the class just above the winner is
//!    re-measured instead, which is how a shape that became parallel is
//!    noticed on a small class.
//! 5. **Hedge.** A class below `L` gets `hedge_after` = its expected queue
//!    wait + `max(T(L) × (L / c)^x, T(c)) × m`, where `m` is `hedge_multiplier`
//!    or, for a shape whose runs vary more, `exp(`[`HEDGE_SPREADS`]` × spread)`
//!    of its log run times (see [`ActionStats::log_spread`]), at most
//!    [`HEDGE_MAX_FACTOR`]: if the action has not
//!    finished by then, a second copy starts on `L`, the first keeps running,
//!    the first to finish wins and the other is cancelled. The kill timeout
//!    is always the client's, so no run is killed for being slow and then
//!    run again from scratch.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::stats::median_f64;
use crate::{ActionStats, Error, Outcome, SelectionConfig, SizeClass, SizeClasses, Timestamp};

/// Similar shapes needed before a new shape trusts them (rule 2).
pub const PRIOR_MIN_SHAPES: u32 = 3;

/// Share of similar shapes whose best class a new shape's first class must
/// cover (rule 2): high, because a class too small costs a hedge.
pub const PRIOR_QUANTILE: f64 = 0.75;

/// Queue information about one size class.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClassQueue {
    /// Expected time a newly queued action waits before starting.
    #[serde(with = "crate::types::secs_f64", rename = "expected_wait_s")]
    pub expected_wait: Duration,
    /// Workers of this class that are idle right now.
    pub idle_workers: u32,
}

/// Per-class queue information, the optional input of queue awareness.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueState {
    classes: BTreeMap<SizeClass, ClassQueue>,
}

impl QueueState {
    /// No class known.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the information of `class`.
    pub fn set(&mut self, class: SizeClass, queue: ClassQueue) -> &mut Self {
        self.classes.insert(class, queue);
        self
    }

    /// Information of `class`, if known.
    pub fn get(&self, class: SizeClass) -> Option<ClassQueue> {
        self.classes.get(&class).copied()
    }

    /// Expected wait of `class`; zero when unknown.
    fn wait(&self, class: SizeClass) -> Duration {
        self.get(class).map_or(Duration::ZERO, |q| q.expected_wait)
    }
}

impl FromIterator<(SizeClass, ClassQueue)> for QueueState {
    fn from_iter<I: IntoIterator<Item = (SizeClass, ClassQueue)>>(iter: I) -> Self {
        Self { classes: iter.into_iter().collect() }
    }
}

/// What similar shapes teach about a shape never seen: how many of them
/// ended up best on each class (see [`best_class`]). The caller keeps one
/// per group (mnemonic, command basename, configuration) and updates it as
/// its shapes' best classes change.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prior {
    best: BTreeMap<SizeClass, u32>,
}

impl Prior {
    /// No similar shape known.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one shape whose best class is `class`.
    pub fn add(&mut self, class: SizeClass) {
        *self.best.entry(class).or_default() += 1;
    }

    /// Forgets one shape counted on `class` (its best class changed).
    pub fn remove(&mut self, class: SizeClass) {
        if let Some(n) = self.best.get_mut(&class) {
            *n -= 1;
            if *n == 0 {
                self.best.remove(&class);
            }
        }
    }

    /// Number of shapes counted.
    pub fn shapes(&self) -> u32 {
        self.best.values().sum()
    }

    /// The smallest available class at or above the best class of
    /// [`PRIOR_QUANTILE`] of the shapes; `None` with fewer than
    /// [`PRIOR_MIN_SHAPES`].
    pub fn start_class(&self, classes: &SizeClasses) -> Option<SizeClass> {
        let n = self.shapes();
        if n < PRIOR_MIN_SHAPES {
            return None;
        }
        let need = (f64::from(n) * PRIOR_QUANTILE).ceil() as u32;
        let mut seen = 0;
        let quantile_class = self.best.iter().find_map(|(&c, &k)| {
            seen += k;
            (seen >= need).then_some(c)
        })?;
        classes.iter().find(|&c| c >= quantile_class).or(Some(classes.largest()))
    }
}

/// Everything selection looks at, besides the config.
#[derive(Clone, Copy, Debug)]
pub struct SelectionInput<'a> {
    /// Statistics of the action's shape (empty for a new shape).
    pub stats: &'a ActionStats,
    /// Similar shapes, for a shape without history; `None` if unknown.
    pub prior: Option<&'a Prior>,
    /// Size classes that currently have workers.
    pub classes: &'a SizeClasses,
    /// The client's execution timeout (or the server default).
    pub requested_timeout: Duration,
    /// Queue state for queue awareness; `None` disables it.
    pub queues: Option<&'a QueueState>,
    /// A uniform random number in `[0, 1)`.
    pub draw: f64,
    /// Current time, for the failure boost.
    pub now: Timestamp,
}

/// Why a class was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Recent failure on the largest class.
    FailureBoost,
    /// A new shape, started where similar shapes ended up.
    Prior,
    /// A new shape without similar ones: measuring on the largest class.
    LargestBaseline,
    /// The cheapest acceptable class from the shape's estimates.
    Learned,
    /// A cheaper class tried on an optimistic or stale estimate.
    Explore,
}

impl Reason {
    /// Stable lowercase name, for metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::FailureBoost => "failure_boost",
            Reason::Prior => "prior",
            Reason::LargestBaseline => "largest_baseline",
            Reason::Learned => "learned",
            Reason::Explore => "explore",
        }
    }

    /// All reasons, for pre-registering metric label values.
    pub const ALL: [Reason; 5] =
        [Reason::FailureBoost, Reason::Prior, Reason::LargestBaseline, Reason::Learned, Reason::Explore];
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a class's expected run time comes from (rule 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Basis {
    /// The class's own outcomes.
    Measured,
    /// The speedup curve between two measured classes.
    Interpolated,
    /// No measured class on one side: an optimistic guess.
    Untried,
}

/// What selection computed for one class (rules 3 and 4); exposed for
/// observability and debugging.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClassEstimate {
    pub size_class: SizeClass,
    /// Expected run time.
    #[serde(with = "crate::types::secs_f64", rename = "expected_run_s")]
    pub expected_run: Duration,
    pub basis: Basis,
    /// Probability that the action's memory fits (monotone across classes).
    pub fit_probability: f64,
    /// The longest completion (queue wait included) this class is accepted with.
    #[serde(with = "crate::types::secs_f64", rename = "acceptable_time_s")]
    pub acceptable_time: Duration,
    /// Queue wait + expected run.
    #[serde(with = "crate::types::secs_f64", rename = "expected_completion_s")]
    pub expected_completion: Duration,
    /// Expected cost, class × expected run time (class-seconds).
    pub expected_cost: f64,
    /// Fits and completes within its acceptable time.
    pub acceptable: bool,
}

/// The result of [`select`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// Class to run on; always one of the available classes.
    pub size_class: SizeClass,
    /// Execution timeout the worker enforces: the client's.
    #[serde(with = "crate::types::secs_f64", rename = "timeout_s")]
    pub timeout: Duration,
    /// For a class below the largest: when (after queueing) a second copy
    /// starts on the largest class if the action has not finished.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "hedge_after_s", with = "opt_secs")]
    pub hedge_after: Option<Duration>,
    pub reason: Reason,
    /// Per-class estimates, ascending by class; empty for rules 1 and 2.
    pub estimates: Vec<ClassEstimate>,
}

impl Decision {
    /// The estimate of the chosen class, when estimates were made.
    pub fn chosen_estimate(&self) -> Option<&ClassEstimate> {
        self.estimates.iter().find(|e| e.size_class == self.size_class)
    }
}

mod opt_secs {
    use std::time::Duration;

    use serde::{de::Error as _, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&d.as_secs_f64()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Option::<f64>::deserialize(d)?.map(|s| Duration::try_from_secs_f64(s).map_err(D::Error::custom)).transpose()
    }
}

/// `reference × (largest / class)^x`: the completion time accepted on `class`
/// when the largest class would complete in `reference`.
///
/// With 60 s on class 8 and x = 0.5 this gives 84.9 s on class 4, 120 s on
/// class 2 and 169.7 s on class 1.
pub fn acceptable_time(reference: Duration, largest: SizeClass, class: SizeClass, exponent: f64) -> Duration {
    secs_to_duration(reference.as_secs_f64() * slack(largest, class, exponent))
}

fn slack(largest: SizeClass, class: SizeClass, exponent: f64) -> f64 {
    (f64::from(largest) / f64::from(class.max(1))).powf(exponent)
}

fn secs_to_duration(s: f64) -> Duration {
    if s.is_nan() || s <= 0.0 {
        Duration::ZERO
    } else {
        Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
    }
}

/// Posterior mean of a Beta(α, β) prior after `successes` of `trials`.
pub fn smoothed_probability(successes: u32, trials: u32, alpha: f64, beta: f64) -> f64 {
    (f64::from(successes) + alpha) / (f64::from(trials) + alpha + beta)
}

/// Successes a class needs before its median caps the times of larger classes.
pub const CAP_MIN_SUCCESSES: usize = 2;

/// Expected run time per class from a shape's history (rule 3), ascending by
/// class, or `None` when no class has a success or a censored run.
pub fn speedup_curve(stats: &ActionStats, classes: &SizeClasses) -> Option<Vec<(SizeClass, f64, Basis)>> {
    // A larger class is never slower either: a class's time is capped by what a smaller
    // class was measured to take. Without that, times kept on a class the shape no longer
    // runs on would hide that it became faster there (a test that went parallel after a
    // dependency upgrade is re-measured only on the class above its learned one, and the
    // carry below would raise that fresh time back to the stale one). Only successes cap,
    // and only [`CAP_MIN_SUCCESSES`] of them: a censored run (cancelled or timed out) is a
    // lower bound, not a time, and one lucky run would make every larger class look fast.
    let mut fastest_success = f64::INFINITY;
    let measured: Vec<(SizeClass, f64)> = classes
        .iter()
        .filter_map(|c| {
            let (mut times, mut successes) = (Vec::new(), Vec::new());
            for o in stats.outcomes(c) {
                match o {
                    Outcome::Succeeded(d) => {
                        times.push(d.as_secs_f64());
                        successes.push(d.as_secs_f64());
                    }
                    Outcome::TimedOut(d) => times.push(d.as_secs_f64()),
                    Outcome::Failed => {}
                }
            }
            let t = median_f64(times)?.min(fastest_success);
            if successes.len() >= CAP_MIN_SUCCESSES {
                let m = median_f64(successes).expect("not empty");
                fastest_success = fastest_success.min(m);
            }
            Some((c, t))
        })
        .collect();
    if measured.is_empty() {
        return None;
    }
    let mut curve: Vec<(SizeClass, f64, Basis)> = classes
        .iter()
        .map(|c| {
            let below = measured.iter().rev().find(|(m, _)| *m < c);
            let above = measured.iter().find(|(m, _)| *m > c);
            match (measured.iter().find(|(m, _)| *m == c), below, above) {
                (Some(&(_, t)), _, _) => (c, t, Basis::Measured),
                (None, Some(&(a, ta)), Some(&(b, tb))) => {
                    // Amdahl through the neighbours: t = p + q / c with q >= 0.
                    let q = ((ta - tb) / (1.0 / f64::from(a) - 1.0 / f64::from(b))).max(0.0);
                    let p = tb - q / f64::from(b);
                    (c, (p + q / f64::from(c)).clamp(tb.min(ta), ta.max(tb)), Basis::Interpolated)
                }
                (None, None, Some(&(_, tb))) => (c, tb, Basis::Untried),
                (None, Some(&(_, ta)), None) => (c, ta, Basis::Untried),
                (None, None, None) => unreachable!("measured is not empty"),
            }
        })
        .collect();
    // A smaller class is never faster: carry the slowest time down from above.
    let mut slowest_above = 0.0f64;
    for e in curve.iter_mut().rev() {
        slowest_above = slowest_above.max(e.1);
        e.1 = slowest_above;
    }
    Some(curve)
}

/// Probability that the action's memory fits each class, monotone across
/// classes (rule 3): successes on a class and below count for it, attributed
/// failures on it and above (below the largest) count against it.
pub fn fit_probabilities(stats: &ActionStats, classes: &SizeClasses, config: &SelectionConfig) -> Vec<f64> {
    let largest = classes.largest();
    let counts: Vec<(u32, u32)> = classes
        .iter()
        .map(|c| {
            let ok = stats.outcomes(c).filter(|o| o.is_success()).count() as u32;
            let failed =
                if c < largest { stats.outcomes(c).filter(|o| *o == Outcome::Failed).count() as u32 } else { 0 };
            (ok, failed)
        })
        .collect();
    (0..counts.len())
        .map(|i| {
            if i + 1 == counts.len() {
                return 1.0;
            }
            let ok: u32 = counts[..=i].iter().map(|c| c.0).sum();
            let failed: u32 = counts[i..].iter().map(|c| c.1).sum();
            smoothed_probability(ok, ok + failed, config.prior_successes, config.prior_failures)
        })
        .collect()
}

/// Per-class estimates (rules 3 and 4) of a shape with history; `None` without one.
pub fn estimates(
    config: &SelectionConfig,
    stats: &ActionStats,
    classes: &SizeClasses,
    queues: Option<&QueueState>,
) -> Option<Vec<ClassEstimate>> {
    let curve = speedup_curve(stats, classes)?;
    let fits = fit_probabilities(stats, classes, config);
    let largest = classes.largest();
    let wait = |c| queues.map_or(0.0, |q| q.wait(c).as_secs_f64());
    let t_largest = curve.last().expect("classes are never empty").1;
    let reference = wait(largest) + t_largest;
    Some(
        curve
            .into_iter()
            .zip(fits)
            .map(|((c, t, basis), fit)| {
                let acceptable = reference * slack(largest, c, config.acceptable_time_exponent);
                let completion = wait(c) + t;
                ClassEstimate {
                    size_class: c,
                    expected_run: secs_to_duration(t),
                    basis,
                    fit_probability: fit,
                    acceptable_time: secs_to_duration(acceptable),
                    expected_completion: secs_to_duration(completion),
                    expected_cost: f64::from(c) * t,
                    acceptable: c == largest || fits_in_time(config, fit, completion, acceptable),
                }
            })
            .collect(),
    )
}

/// Whether a class below the largest is acceptable (rule 4): it fits, and its expected
/// completion is within the time accepted on it.
fn fits_in_time(config: &SelectionConfig, fit: f64, completion_s: f64, acceptable_s: f64) -> bool {
    fit >= config.success_threshold && completion_s <= acceptable_s * (1.0 + 1e-9)
}

/// The cheapest acceptable estimate among `pick`, ties to the larger class.
fn cheapest<'a>(estimates: impl Iterator<Item = &'a ClassEstimate>) -> Option<&'a ClassEstimate> {
    estimates
        .filter(|e| e.acceptable)
        .min_by(|a, b| a.expected_cost.total_cmp(&b.expected_cost).then_with(|| b.size_class.cmp(&a.size_class)))
}

/// Estimates a choice may rest on: measured or interpolated ones, and the
/// largest class, which needs no evidence.
fn settled(estimates: &[ClassEstimate], largest: SizeClass) -> impl Iterator<Item = &ClassEstimate> {
    estimates.iter().filter(move |e| e.basis != Basis::Untried || e.size_class == largest)
}

/// The class a shape settled on without queues or exploration (rule 4), for
/// building the [`Prior`] of its group: `None` until the class is measured and
/// the class below it (if any) has evidence too, so a shape seen only on the
/// largest class does not teach its group that the largest class is needed.
pub fn best_class(config: &SelectionConfig, stats: &ActionStats, classes: &SizeClasses) -> Option<SizeClass> {
    let estimates = estimates(config, stats, classes, None)?;
    let best = cheapest(settled(&estimates, classes.largest()))?;
    let i = estimates.iter().position(|e| e.size_class == best.size_class)?;
    let below_known = i == 0 || estimates[i - 1].basis != Basis::Untried || estimates[i - 1].fit_probability < 0.5;
    (best.basis == Basis::Measured && below_known).then_some(best.size_class)
}

/// Share of `exploration_factor` spent re-measuring the class above a shape's
/// learned one, on a draw range of its own at the top. Such a run costs more
/// than the learned class's, so it is kept rare: 1% of runs at the default 0.05.
pub const REFRESH_UP_SHARE: f64 = 0.2;

/// How many of a shape's own run-to-run spreads a run on its class must pass
/// before it is hedged (rule 5). Two spreads is one run in 44 of a normal
/// shape's. Each hedge pays for a copy on the largest class, which a run slow
/// from noise seldom needs: on the size-class bench's noisy workload (30%
/// noise) hedging at `hedge_multiplier` alone cost 0.359 of always-largest,
/// at two spreads 0.336 (1.5: 0.340, 2.5: 0.334), with the same p95. (The
/// bench's noise is shared by every class of one execution, so there a copy
/// of a run slowed by noise is as slow; on a real fleet part of the noise is
/// the machine's, which a copy escapes. The cap bounds what that costs.)
pub const HEDGE_SPREADS: f64 = 2.0;

/// The most the noise raises the hedge factor to: a shape whose runs vary by
/// more than σ ≈ 0.55 (two modes, a cache that is sometimes cold) is still
/// hedged at three times its accepted run time, not left to the client's
/// timeout. A `hedge_multiplier` above it wins.
pub const HEDGE_MAX_FACTOR: f64 = 3.0;

/// The factor on the accepted run time past which a run on `class` is hedged:
/// `hedge_multiplier`, or `exp(HEDGE_SPREADS × spread)` (at most
/// [`HEDGE_MAX_FACTOR`]) when the shape's own noise (on `class`, else on the
/// largest class) is wider, so that a noisy shape is hedged for being slow,
/// not for being noisy. The spread is of successes only: a run cancelled by
/// its hedge is not among them.
fn hedge_factor(config: &SelectionConfig, stats: &ActionStats, class: SizeClass, largest: SizeClass) -> f64 {
    let spread = shape_spread(stats, class, largest).unwrap_or(0.0);
    config.hedge_multiplier.max((HEDGE_SPREADS * spread).exp().min(HEDGE_MAX_FACTOR))
}

/// The shape's run-to-run noise as seen on `class`, or on the largest class
/// while `class` has too few successes to say.
fn shape_spread(stats: &ActionStats, class: SizeClass, largest: SizeClass) -> Option<f64> {
    stats.log_spread(class).or_else(|| stats.log_spread(largest))
}

/// Chance of re-measuring the fitting class just below the winner (instead of
/// `exploration_factor`, when that is larger and not 0) while its own median
/// is too uncertain to have lost (rule 4): its run time is over the accepted
/// one by less than [`NOISE_ERRORS`] standard errors of that median. Each retry
/// adds a run to the class and shrinks the error by √n, so the retries stop
/// once its median is known well enough, or go on at a fifth of the runs on a
/// class within a few percent of acceptable (1.14× at 30% noise and 32 runs),
/// which the hedge bounds. The reference, the largest class's time, is not
/// counted: retries on the small class cannot make it surer. Queue waits are
/// not either: a class that lost to its queue lost to a fact, not to noise.
/// On the size-class bench's noisy workload this took the cost from 0.319 to
/// 0.308 of always-largest (see README for the figures with this rule).
pub const UNCERTAIN_REFRESH: f64 = 0.2;

/// Standard errors of a class's median within which its loss counts as noise
/// (see [`UNCERTAIN_REFRESH`]).
pub const NOISE_ERRORS: f64 = 2.0;

/// √(π/2): a median of n runs with normal noise σ has a standard error of
/// this × σ / √n.
const MEDIAN_STANDARD_ERROR: f64 = 1.2533;

/// True when `e`'s expected run time is over the run time accepted on it
/// (`t_largest × (L / c)^x`, queues aside) by less than [`NOISE_ERRORS`]
/// standard errors of its median; false for a class without successes, a
/// shape without a spread, or a class not slower than accepted.
fn within_noise(
    config: &SelectionConfig,
    stats: &ActionStats,
    e: &ClassEstimate,
    t_largest: f64,
    largest: SizeClass,
) -> bool {
    let n = stats.outcomes(e.size_class).filter(|o| o.is_success()).count();
    let (true, Some(spread)) = (n > 0, shape_spread(stats, e.size_class, largest)) else {
        return false;
    };
    let accepted = t_largest * slack(largest, e.size_class, config.acceptable_time_exponent);
    let margin = (e.expected_run.as_secs_f64() / accepted.max(1e-9)).ln();
    margin > 0.0 && margin < NOISE_ERRORS * MEDIAN_STANDARD_ERROR * spread / (n as f64).sqrt()
}

/// Chooses a size class, timeout and hedge time. Pure and deterministic: the
/// same inputs always give the same decision. See the module docs for the rules.
pub fn select(config: &SelectionConfig, input: &SelectionInput<'_>) -> Result<Decision, Error> {
    config.validate()?;
    if !(input.draw.is_finite() && (0.0..1.0).contains(&input.draw)) {
        return Err(Error::InvalidDraw(input.draw));
    }
    if input.requested_timeout.is_zero() {
        return Err(Error::ZeroRequestedTimeout);
    }
    let classes = input.classes;
    let stats = input.stats;
    let largest = classes.largest();
    let requested = input.requested_timeout;
    let wait = |c| input.queues.map_or(Duration::ZERO, |q| q.wait(c));
    let on_largest =
        |reason, estimates| Decision { size_class: largest, timeout: requested, hedge_after: None, reason, estimates };

    // Rule 1: failure boost.
    if let Some(failed_at) = stats.last_largest_failure()
        && input.now.saturating_since(failed_at) < config.failure_cache_duration
    {
        return Ok(on_largest(Reason::FailureBoost, Vec::new()));
    }

    // Rules 3 and 4 need a history; rule 2 is for shapes without one.
    let Some(estimates) = estimates(config, stats, classes, input.queues) else {
        return Ok(match input.prior.and_then(|p| p.start_class(classes)) {
            Some(c) if c < largest => Decision {
                size_class: c,
                timeout: requested,
                hedge_after: Some(wait(c).saturating_add(config.minimum_execution_timeout).min(requested)),
                reason: Reason::Prior,
                estimates: Vec::new(),
            },
            _ => on_largest(Reason::LargestBaseline, Vec::new()),
        });
    };

    let learned = cheapest(settled(&estimates, largest)).expect("the largest class is always acceptable");
    let explore_untried = cheapest(estimates.iter().filter(|e| e.size_class < learned.size_class))
        .filter(|e| e.basis == Basis::Untried && e.expected_cost < learned.expected_cost);
    // A class between two measured ones, on the time of the measured class above it: its
    // best case. The Amdahl curve assumes the shape keeps speeding up to the largest
    // class, but most shapes stop at a few cores (a link, a test with three threads), so
    // it over-reads the classes between, and a shape measured only on the smallest and
    // the largest class would never try them.
    let optimistic: Vec<ClassEstimate> = estimates
        .iter()
        .enumerate()
        .filter(|(_, e)| e.basis == Basis::Interpolated && e.size_class < learned.size_class)
        .filter_map(|(i, e)| {
            let above = estimates[i + 1..].iter().find(|m| m.basis == Basis::Measured)?;
            let t = above.expected_run;
            let completion = wait(e.size_class).saturating_add(t);
            Some(ClassEstimate {
                expected_run: t,
                expected_completion: completion,
                expected_cost: f64::from(e.size_class) * t.as_secs_f64(),
                acceptable: fits_in_time(
                    config,
                    e.fit_probability,
                    completion.as_secs_f64(),
                    e.acceptable_time.as_secs_f64(),
                ),
                ..e.clone()
            })
        })
        .collect();
    let explore_between = cheapest(optimistic.iter()).filter(|e| e.expected_cost < learned.expected_cost);
    // Stale evidence: now and then retry the fitting class just below the winner.
    let t_largest = estimates.last().expect("classes are never empty").expected_run.as_secs_f64();
    let refresh = || {
        estimates
            .iter()
            .rev()
            .find(|e| e.size_class < learned.size_class && e.fit_probability >= config.success_threshold)
            .filter(|e| {
                // exploration_factor 0 turns every retry off, this one too.
                let p = if config.exploration_factor > 0.0 && within_noise(config, stats, e, t_largest, largest) {
                    config.exploration_factor.max(UNCERTAIN_REFRESH)
                } else {
                    config.exploration_factor
                };
                input.draw < p
            })
            // Only a class whose evidence leaves it a chance: one measured past its hedge
            // time would run slower than the largest class, and a copy started there at the
            // hedge time would finish later still. On the size-class bench such retries were a
            // tenth of the runs slower than always-largest's p95.
            .filter(|e| {
                e.expected_completion.as_secs_f64()
                    <= e.acceptable_time.as_secs_f64() * hedge_factor(config, stats, e.size_class, largest)
            })
    };
    // Stale evidence the other way: now and then re-measure the class just above the
    // winner. Nothing else would: a shape that became parallel (a dependency upgrade)
    // keeps its old times on the largest class, which it no longer runs on, so its small
    // class still looks acceptable, and it finishes before its hedge time. On the
    // size-class bench one such shape ran at 1.65x always-largest's time for 2,000 runs.
    let refresh_up = || {
        (input.draw >= 1.0 - config.exploration_factor * REFRESH_UP_SHARE)
            .then(|| {
                estimates
                    .iter()
                    .find(|e| e.size_class > learned.size_class && e.fit_probability >= config.success_threshold)
            })
            .flatten()
    };
    let (chosen, reason) = match explore_untried.or(explore_between) {
        Some(e) => (e, Reason::Explore),
        None => match refresh().or_else(refresh_up) {
            Some(e) => (e, Reason::Explore),
            None => (learned, Reason::Learned),
        },
    };
    let c = chosen.size_class;
    let hedge_after = (c < largest).then(|| {
        // The run time accepted on c, queues aside; never below what c is expected to take.
        let run =
            (t_largest * slack(largest, c, config.acceptable_time_exponent)).max(chosen.expected_run.as_secs_f64());
        wait(c).saturating_add(secs_to_duration(run * hedge_factor(config, stats, c, largest))).min(requested)
    });
    Ok(Decision { size_class: c, timeout: requested, hedge_after, reason, estimates })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const NOW: Timestamp = Timestamp::from_unix_millis(1_000_000_000_000);

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn classes() -> SizeClasses {
        SizeClasses::new([1, 2, 4, 8]).unwrap()
    }

    fn config() -> SelectionConfig {
        SelectionConfig { exploration_factor: 0.0, ..SelectionConfig::default() }
    }

    fn decide_with(
        config: &SelectionConfig,
        stats: &ActionStats,
        prior: Option<&Prior>,
        queues: Option<&QueueState>,
        draw: f64,
    ) -> Decision {
        let cls = classes();
        let input =
            SelectionInput { stats, prior, classes: &cls, requested_timeout: secs(900.0), queues, draw, now: NOW };
        select(config, &input).unwrap()
    }

    fn decide(stats: &ActionStats) -> Decision {
        decide_with(&config(), stats, None, None, 0.5)
    }

    fn stats(entries: &[(SizeClass, Outcome, usize)]) -> ActionStats {
        let mut s = ActionStats::new();
        for &(c, o, n) in entries {
            for _ in 0..n {
                s.push(c, o, 32);
            }
        }
        s
    }

    fn ok(s: f64) -> Outcome {
        Outcome::Succeeded(secs(s))
    }

    #[test]
    fn a_new_shape_without_similar_ones_measures_on_the_largest_class() {
        let d = decide(&ActionStats::new());
        assert_eq!((d.size_class, d.reason, d.hedge_after, d.timeout), (8, Reason::LargestBaseline, None, secs(900.0)));
    }

    #[test]
    fn a_new_shape_starts_where_similar_shapes_ended_up() {
        let mut prior = Prior::new();
        for c in [1, 1, 1, 2] {
            prior.add(c);
        }
        // 75% of 4 shapes = 3 are best on class 1.
        let d = decide_with(&config(), &ActionStats::new(), Some(&prior), None, 0.5);
        assert_eq!((d.size_class, d.reason), (1, Reason::Prior));
        assert_eq!(d.hedge_after, Some(SelectionConfig::default().minimum_execution_timeout));
        prior.add(4);
        prior.add(8);
        // 1,1,1,2,4,8: the 75% quantile (5th shape) is best on 4.
        assert_eq!(decide_with(&config(), &ActionStats::new(), Some(&prior), None, 0.5).size_class, 4);
        prior.remove(1);
        prior.remove(1);
        prior.remove(1);
        // Too few shapes left to trust.
        assert_eq!(prior.shapes(), 3);
        prior.remove(2);
        assert_eq!(
            decide_with(&config(), &ActionStats::new(), Some(&prior), None, 0.5).reason,
            Reason::LargestBaseline
        );
        // A shape with history ignores the prior.
        let mut many = Prior::new();
        (0..10).for_each(|_| many.add(1));
        let s = stats(&[(8, ok(60.0), 3), (1, ok(300.0), 3)]);
        assert_ne!(decide_with(&config(), &s, Some(&many), None, 0.5).reason, Reason::Prior);
    }

    #[test]
    fn after_a_baseline_the_cheapest_class_is_explored_and_hedged_at_its_acceptable_time() {
        let d = decide(&stats(&[(8, ok(60.0), 1)]));
        assert_eq!((d.size_class, d.reason), (1, Reason::Explore));
        let e = d.chosen_estimate().unwrap();
        assert_eq!(e.basis, Basis::Untried);
        // Hedged at the acceptable time × hedge_multiplier; the kill timeout is the client's.
        let cfg = SelectionConfig::default();
        let acceptable = 60.0 * 8f64.powf(cfg.acceptable_time_exponent);
        assert!((d.hedge_after.unwrap().as_secs_f64() - acceptable * cfg.hedge_multiplier).abs() < 1e-6, "{d:?}");
        assert_eq!(d.timeout, secs(900.0));
    }

    #[test]
    fn a_noisy_shape_is_hedged_for_being_slow_not_for_being_noisy() {
        // Single-threaded, a 60 s median everywhere: class 1 is learned either way.
        let quiet = stats(&[(8, ok(60.0), 5), (1, ok(60.0), 7)]);
        let mut noisy = ActionStats::new();
        [60.0, 45.0, 80.0, 60.0, 47.0].into_iter().for_each(|t| noisy.push(8, ok(t), 32));
        [60.0, 44.0, 82.0, 58.0, 75.0, 46.0, 62.0].into_iter().for_each(|t| noisy.push(1, ok(t), 32));
        assert_eq!((noisy.sample_count(8), noisy.sample_count(1)), (5, 7), "no change point");
        let cfg = config();
        let accepted = 60.0 * 8f64.powf(cfg.acceptable_time_exponent);
        let (q, n) = (decide(&quiet), decide(&noisy));
        assert_eq!((q.size_class, q.reason, n.size_class, n.reason), (1, Reason::Learned, 1, Reason::Learned));
        // Quiet: the configured multiplier.
        assert!((q.hedge_after.unwrap().as_secs_f64() - accepted * cfg.hedge_multiplier).abs() < 1e-6, "{q:?}");
        // Noisy: two of its spreads on class 1 (1.4826 x the median |log deviation|,
        // ln(75/60) here), a factor of 1.94 where the quiet shape gets 1.2.
        let spread = noisy.log_spread(1).unwrap();
        assert!((spread - 1.4826 * (75f64 / 60.0).ln()).abs() < 1e-3, "{spread}");
        let factor = (HEDGE_SPREADS * spread).exp();
        assert!(factor > 1.9 && factor < 2.0, "{factor}");
        assert!((n.hedge_after.unwrap().as_secs_f64() - accepted * factor).abs() < 1e-3, "{n:?}");
        // Class 1 has too few runs to say: the largest class's spread stands in.
        let mut young = stats(&[(1, ok(60.0), 2)]);
        [60.0, 45.0, 80.0, 60.0, 47.0].into_iter().for_each(|t| young.push(8, ok(t), 32));
        let y = decide(&young);
        let factor8 = (HEDGE_SPREADS * young.log_spread(8).unwrap()).exp();
        assert!(factor8 > cfg.hedge_multiplier, "{factor8}");
        assert_eq!(y.size_class, 1);
        assert!((y.hedge_after.unwrap().as_secs_f64() - accepted * factor8).abs() < 1e-3, "{y:?}");
    }

    #[test]
    fn a_class_that_lost_within_the_noise_is_measured_again_more_often() {
        // Classes 2 to 8 take 60 s, so 2 is learned; class 1 is accepted up to
        // 60 x 8^x = 73.9 s.
        let with_class_1 = |times: &[f64]| {
            let mut s = stats(&[(2, ok(60.0), 5), (4, ok(60.0), 5)]);
            [60.0, 45.0, 80.0, 60.0, 47.0].into_iter().for_each(|t| s.push(8, ok(t), 32));
            times.iter().for_each(|&t| s.push(1, ok(t), 32));
            assert_eq!(s.sample_count(1), times.len(), "no change point");
            s
        };
        // Seven noisy runs around a median of 80 s (a spread of 0.33).
        let noisy = |median: f64| -> Vec<f64> {
            [80.0, 60.0, 105.0, 80.0, 62.0, 100.0, 82.0].iter().map(|t| t * median / 80.0).collect()
        };
        let explore = SelectionConfig { exploration_factor: 0.05, ..config() };
        let pick = |cfg: &SelectionConfig, s: &ActionStats, queues: Option<&QueueState>, draw: f64| {
            let d = decide_with(cfg, s, None, queues, draw);
            (d.size_class, d.reason)
        };
        // Quiet runs: 80 s is 80 s, and class 1 is retried only at exploration_factor.
        let quiet = with_class_1(&[80.0; 7]);
        assert_eq!(pick(&explore, &quiet, None, 0.04), (1, Reason::Explore));
        assert_eq!(pick(&explore, &quiet, None, 0.1), (2, Reason::Learned));
        // Noisy: 80 against 73.9 is 0.08 in log terms, well within two standard errors of
        // class 1's median (2 x 1.2533 x 0.33 / sqrt 7 = 0.31), so UNCERTAIN_REFRESH of the draws.
        let s = with_class_1(&noisy(80.0));
        assert_eq!(pick(&explore, &s, None, UNCERTAIN_REFRESH - 0.01), (1, Reason::Explore));
        assert_eq!(pick(&explore, &s, None, UNCERTAIN_REFRESH + 0.01), (2, Reason::Learned));
        // exploration_factor 0 turns this retry off too.
        assert_eq!(pick(&config(), &s, None, 0.01), (2, Reason::Learned));
        // The same noise around 130 s (0.57 over): beyond the noise, retried at 5% only.
        assert_eq!(pick(&explore, &with_class_1(&noisy(130.0)), None, 0.1), (2, Reason::Learned));
        assert_eq!(pick(&explore, &with_class_1(&noisy(130.0)), None, 0.04), (1, Reason::Explore));
        // Class 1 runs in 72 s, within what it is accepted with, but a 20 s queue makes it
        // lose (92 s, 0.22 over): a fact, not noise, so no extra retries.
        let queues: QueueState = [(1, ClassQueue { expected_wait: secs(20.0), idle_workers: 0 })].into_iter().collect();
        assert_eq!(pick(&explore, &with_class_1(&noisy(72.0)), Some(&queues), 0.1), (2, Reason::Learned));
    }

    #[test]
    fn a_noisy_class_measured_past_the_fixed_hedge_time_is_still_retried() {
        // As above, with class 1's median at 100 s: past 73.9 x 1.2 = 88.7 s, the hedge time
        // of a quiet shape, but not past 73.9 x 1.94 = 143 s, a noisy one's.
        let with_class_1 = |times: &[f64]| {
            let mut s = stats(&[(2, ok(60.0), 5), (4, ok(60.0), 5), (8, ok(60.0), 5)]);
            times.iter().for_each(|&t| s.push(1, ok(t), 32));
            s
        };
        let cfg = SelectionConfig { exploration_factor: 0.05, ..config() };
        let quiet = decide_with(&cfg, &with_class_1(&[100.0; 7]), None, None, 0.01);
        assert_eq!((quiet.size_class, quiet.reason), (2, Reason::Learned));
        let noisy = with_class_1(&[100.0, 75.0, 131.0, 100.0, 77.0, 125.0, 102.0]);
        assert!(noisy.log_spread(1).unwrap() > 0.3);
        let d = decide_with(&cfg, &noisy, None, None, 0.01);
        assert_eq!((d.size_class, d.reason), (1, Reason::Explore));
    }

    #[test]
    fn the_noise_raises_the_hedge_time_at_most_to_its_cap() {
        // Runs on class 1 that vary tenfold: exp(2 x spread) is far above the cap.
        let mut s = stats(&[(8, ok(60.0), 5)]);
        [60.0, 6.0, 600.0, 60.0, 6.0, 600.0, 60.0].into_iter().for_each(|t| s.push(1, ok(t), 32));
        let d = decide(&s);
        assert_eq!(d.size_class, 1, "{d:?}");
        let run = d.chosen_estimate().unwrap().expected_run.as_secs_f64().max(60.0 * 8f64.powf(0.1));
        assert!((d.hedge_after.unwrap().as_secs_f64() - run * HEDGE_MAX_FACTOR).abs() < 1e-3, "{d:?}");
    }

    #[test]
    fn a_single_threaded_shape_settles_on_the_smallest_class() {
        let d = decide(&stats(&[(8, ok(60.0), 3), (1, ok(61.0), 5)]));
        assert_eq!((d.size_class, d.reason), (1, Reason::Learned));
    }

    #[test]
    fn speedup_curve_interpolates_between_measured_classes() {
        // Perfectly parallel on 1 and 8: t = 80 / c, so 2 -> 40 and 4 -> 20.
        let s = stats(&[(1, ok(80.0), 3), (8, ok(10.0), 3)]);
        let curve = speedup_curve(&s, &classes()).unwrap();
        let t: Vec<(u32, f64, Basis)> = curve.iter().map(|&(c, t, b)| (c, (t * 1000.0).round() / 1000.0, b)).collect();
        assert_eq!(
            t,
            vec![
                (1, 80.0, Basis::Measured),
                (2, 40.0, Basis::Interpolated),
                (4, 20.0, Basis::Interpolated),
                (8, 10.0, Basis::Measured)
            ]
        );
        // Amdahl with a 50% serial part: t(c) = 50 + 50 / c through 1 (100) and 8 (56.25).
        let s = stats(&[(1, ok(100.0), 1), (8, ok(56.25), 1)]);
        let curve = speedup_curve(&s, &classes()).unwrap();
        assert!((curve[1].1 - 75.0).abs() < 1e-9 && (curve[2].1 - 62.5).abs() < 1e-9, "{curve:?}");
        // Untried classes: no slowdown below, no speedup above; censored runs count as at least their time.
        let s = stats(&[(2, ok(30.0), 1), (2, Outcome::TimedOut(secs(50.0)), 2)]);
        let curve = speedup_curve(&s, &classes()).unwrap();
        assert_eq!(
            curve.iter().map(|e| (e.1, e.2)).collect::<Vec<_>>(),
            vec![(50.0, Basis::Untried), (50.0, Basis::Measured), (50.0, Basis::Untried), (50.0, Basis::Untried)]
        );
        // Noise never makes a smaller class faster than a larger one: a larger class is
        // capped by a smaller one's successes, once there are two of them.
        let s = stats(&[(1, ok(9.0), 2), (8, ok(10.0), 1)]);
        let times: Vec<f64> = speedup_curve(&s, &classes()).unwrap().iter().map(|e| e.1).collect();
        assert_eq!(times, vec![9.0, 9.0, 9.0, 9.0]);
        // One lucky run caps nothing; the carry from above raises it.
        let s = stats(&[(1, ok(9.0), 1), (8, ok(10.0), 1)]);
        let times: Vec<f64> = speedup_curve(&s, &classes()).unwrap().iter().map(|e| e.1).collect();
        assert_eq!(times, vec![10.0, 10.0, 10.0, 10.0]);
        // A censored run is a lower bound, not a time: it caps nothing, and the carry from
        // above still raises it.
        let s = stats(&[(1, Outcome::TimedOut(secs(9.0)), 1), (8, ok(10.0), 1)]);
        let times: Vec<f64> = speedup_curve(&s, &classes()).unwrap().iter().map(|e| e.1).collect();
        assert_eq!(times, vec![10.0, 10.0, 10.0, 10.0]);
    }

    #[test]
    fn a_shape_that_became_parallel_leaves_its_small_class() {
        // Learned on class 1 when it was single-threaded (40 s everywhere). It became
        // parallel: re-measured on class 2 it takes 22 s. The old 40 s on 8 is stale; a
        // larger class is never slower, so 8 reads 22 s and class 1 is no longer acceptable.
        let before = stats(&[(8, ok(40.0), 5), (1, ok(40.0), 10)]);
        assert_eq!(decide(&before).size_class, 1);
        let after = stats(&[(8, ok(40.0), 5), (1, ok(40.0), 10), (2, ok(22.0), 2)]);
        let d = decide(&after);
        assert_eq!((d.size_class, d.reason), (2, Reason::Learned), "{d:?}");
        assert_eq!(d.estimates[3].expected_run, secs(22.0));
    }

    #[test]
    fn the_class_above_is_re_measured_now_and_then() {
        let cfg = SelectionConfig { exploration_factor: 0.05, ..config() };
        let s = stats(&[(8, ok(40.0), 5), (1, ok(40.0), 10)]);
        let up = 1.0 - cfg.exploration_factor * REFRESH_UP_SHARE;
        let d = decide_with(&cfg, &s, None, None, up);
        assert_eq!((d.size_class, d.reason), (2, Reason::Explore), "{d:?}");
        let d = decide_with(&cfg, &s, None, None, up - 1e-9);
        assert_eq!((d.size_class, d.reason), (1, Reason::Learned), "{d:?}");
        // With no exploration there is none upward either.
        let d = decide_with(&config(), &s, None, None, 0.999_999);
        assert_eq!(d.size_class, 1, "{d:?}");
    }

    #[test]
    fn a_class_measured_too_slow_rules_out_every_smaller_class() {
        // Class 4 takes 2x the largest: classes 1 and 2 are at least as slow,
        // so they are neither chosen nor explored even though never tried.
        let d = decide(&stats(&[(8, ok(60.0), 3), (4, ok(120.0), 3)]));
        assert_eq!(d.size_class, 8, "{d:?}");
        assert!(d.estimates[..2].iter().all(|e| e.expected_run >= secs(120.0) && !e.acceptable));
    }

    #[test]
    fn a_class_between_measured_ones_is_tried_on_its_best_case() {
        // A shape that uses two cores: 6.5 s on class 1, 3.7 s on 8. Amdahl through them reads
        // 4.9 s on 2 and 4.1 s on 4, over the 4.25 s and 3.97 s that x = 0.1 accepts there, so
        // the curve alone keeps it on 8. At best class 2 takes what 8 takes: that is tried.
        let cfg = SelectionConfig { acceptable_time_exponent: 0.1, hedge_multiplier: 1.2, ..config() };
        let at = |s: &ActionStats| decide_with(&cfg, s, None, None, 0.5);
        let d = at(&stats(&[(1, ok(6.5), 3), (8, ok(3.7), 3)]));
        assert_eq!((d.size_class, d.reason), (2, Reason::Explore), "{d:?}");
        let learned = cheapest(settled(&d.estimates, 8)).unwrap();
        assert_eq!(learned.size_class, 8, "the curve alone stays on the largest class");
        // Hedged at the time accepted on class 2, 3.7 x 4^0.1, times the multiplier.
        let hedge = 3.7 * 4f64.powf(0.1) * 1.2;
        assert!((d.hedge_after.unwrap().as_secs_f64() - hedge).abs() < 1e-6, "{d:?}");
        // Measured fast enough, class 2 is learned.
        let d = at(&stats(&[(1, ok(6.5), 3), (8, ok(3.7), 3), (2, ok(3.9), 1)]));
        assert_eq!((d.size_class, d.reason), (2, Reason::Learned), "{d:?}");
        // Measured as slow as Amdahl said: class 4, now between 2 and 8, is tried next...
        let d = at(&stats(&[(1, ok(6.5), 3), (8, ok(3.7), 3), (2, ok(4.9), 1)]));
        assert_eq!((d.size_class, d.reason), (4, Reason::Explore), "{d:?}");
        // ...and once it too is measured too slow, nothing is left to try.
        let d = at(&stats(&[(1, ok(6.5), 3), (8, ok(3.7), 3), (2, ok(4.9), 1), (4, ok(4.1), 1)]));
        assert_eq!((d.size_class, d.reason), (8, Reason::Learned), "{d:?}");
        // A class the shape does not fit in is not tried on its best case: with class 2 out of
        // memory twice (class 1 only timed out), class 4 is the one tried.
        let d = at(&stats(&[(1, Outcome::TimedOut(secs(20.0)), 1), (2, Outcome::Failed, 2), (8, ok(3.7), 3)]));
        assert_eq!((d.size_class, d.reason), (4, Reason::Explore), "{d:?}");
    }

    #[test]
    fn memory_failures_are_monotone_across_classes() {
        // An attributed failure on class 4: classes 1, 2 and 4 do not fit; 8 does.
        let s = stats(&[(8, ok(60.0), 3), (4, Outcome::Failed, 1)]);
        let fits = fit_probabilities(&s, &classes(), &config());
        assert!(fits[..3].iter().all(|&p| p < 0.5), "{fits:?}");
        assert_eq!(decide(&s).size_class, 8);
        // A success on class 2 counts for 4 and 8, not for 1.
        let s = stats(&[(8, ok(60.0), 3), (2, ok(60.0), 3), (1, Outcome::Failed, 1)]);
        let fits = fit_probabilities(&s, &classes(), &config());
        assert!(fits[0] < 0.5 && fits[1] > 0.7 && fits[2] > 0.7 && fits[3] == 1.0, "{fits:?}");
        assert_eq!(decide(&s).size_class, 2);
    }

    #[test]
    fn the_cheapest_acceptable_class_wins_and_the_exponent_trades_cost_for_latency() {
        // t(c) = 10 + 80 / c: 90, 50, 30, 20 s; costs 90, 100, 120, 160 class-s.
        let s = stats(&[(1, ok(90.0), 3), (2, ok(50.0), 3), (4, ok(30.0), 3), (8, ok(20.0), 3)]);
        let at =
            |x: f64| decide_with(&SelectionConfig { acceptable_time_exponent: x, ..config() }, &s, None, None, 0.5);
        // x = 0: nothing slower than class 8 is accepted.
        assert_eq!(at(0.0).size_class, 8);
        // x = 0.5: class 4 may take 28.3 s (no), class 2 40 s (no), class 1 56.6 s (no).
        assert_eq!(at(0.5).size_class, 8);
        // x = 1: 40, 80 and 160 s: all acceptable; class 1 is the cheapest.
        assert_eq!(at(1.0).size_class, 1);
        // x = 0.8: 30.3 s on 4 (yes), 52.8 s on 2 (yes), 92.1 s on 1 (yes).
        assert_eq!(at(0.8).size_class, 1);
        // x = 0.7: 1 needs 85.7 s (no), 2 gets 51.3 s (yes, 100 class-s), 4 gets 32.5 (120).
        assert_eq!(at(0.7).size_class, 2);
    }

    #[test]
    fn queues_count_on_both_sides() {
        let s = stats(&[(8, ok(60.0), 3), (1, ok(60.0), 5)]);
        let q = |w1: f64, w8: f64| {
            QueueState::from_iter([1, 2, 4, 8].map(|c| {
                let w = match c {
                    1 => w1,
                    8 => w8,
                    _ => 0.0,
                };
                (c, ClassQueue { expected_wait: secs(w), idle_workers: 0 })
            }))
        };
        // A saturated class 1 (5 min queue) loses to an idle class 2, which is
        // untried but no slower as far as we know: explored, hedged after its wait.
        let d = decide_with(&config(), &s, None, Some(&q(300.0, 0.0)), 0.5);
        assert_eq!(d.size_class, 2, "{d:?}");
        // A long queue on the largest class too: class 1's wait is then acceptable.
        let d = decide_with(&config(), &s, None, Some(&q(300.0, 400.0)), 0.5);
        assert_eq!(d.size_class, 1, "{d:?}");
        assert!(d.hedge_after.unwrap() >= secs(300.0));
    }

    #[test]
    fn failure_boost_and_refresh() {
        // Class 4 took 70 s, over the 64.3 s (60 x 2^0.1) accepted there; class 2 took 140 s.
        let mut s = stats(&[(8, ok(60.0), 3), (4, ok(70.0), 3), (2, ok(140.0), 3)]);
        // A low draw retries the class below the winner now and then.
        let cfg = SelectionConfig { exploration_factor: 0.1, acceptable_time_exponent: 0.1, ..config() };
        let d = decide_with(&cfg, &s, None, None, 0.05);
        assert_eq!((d.size_class, d.reason), (4, Reason::Explore));
        assert!(d.hedge_after.is_some());
        assert_eq!(decide_with(&cfg, &s, None, None, 0.5).size_class, 8);
        // Not a class measured beyond its hedge time (64.3 s x 1.2): a copy started then on
        // the largest class would finish later still, so that retry would only be slow.
        let slow = stats(&[(8, ok(60.0), 3), (4, ok(120.0), 3), (2, ok(140.0), 3)]);
        assert_eq!(decide_with(&cfg, &slow, None, None, 0.05).size_class, 8);
        s.set_last_largest_failure(NOW);
        let d = decide_with(&cfg, &s, None, None, 0.05);
        assert_eq!((d.size_class, d.reason, d.hedge_after), (8, Reason::FailureBoost, None));
    }

    #[test]
    fn best_class_waits_until_the_class_below_has_evidence() {
        let best = |entries: &[(SizeClass, Outcome, usize)]| best_class(&config(), &stats(entries), &classes());
        assert_eq!(best(&[]), None);
        // Only the baseline: class 4 might do as well, so nothing is taught yet.
        assert_eq!(best(&[(8, ok(60.0), 1)]), None);
        assert_eq!(best(&[(8, ok(60.0), 1), (4, ok(120.0), 1)]), Some(8));
        assert_eq!(best(&[(8, ok(60.0), 1), (2, ok(60.0), 1)]), None);
        assert_eq!(best(&[(8, ok(60.0), 1), (2, ok(60.0), 1), (1, ok(120.0), 1)]), Some(2));
        assert_eq!(best(&[(8, ok(60.0), 1), (1, ok(60.0), 1)]), Some(1));
        // A memory failure below is evidence too.
        assert_eq!(best(&[(8, ok(60.0), 1), (4, ok(60.0), 1), (2, Outcome::Failed, 1)]), Some(4));
    }

    #[test]
    fn bad_inputs_are_errors() {
        let cls = classes();
        let s = ActionStats::new();
        let input = SelectionInput {
            stats: &s,
            prior: None,
            classes: &cls,
            requested_timeout: secs(1.0),
            queues: None,
            draw: 1.0,
            now: NOW,
        };
        assert!(matches!(select(&config(), &input), Err(Error::InvalidDraw(_))));
        let input = SelectionInput { draw: 0.5, requested_timeout: Duration::ZERO, ..input };
        assert!(matches!(select(&config(), &input), Err(Error::ZeroRequestedTimeout)));
        let bad = SelectionConfig { acceptable_time_exponent: -1.0, ..config() };
        let input = SelectionInput { requested_timeout: secs(1.0), ..input };
        assert!(matches!(select(&bad, &input), Err(Error::InvalidConfig { .. })));
    }

    fn outcome() -> impl Strategy<Value = Outcome> {
        prop_oneof![
            (1u64..600_000).prop_map(|ms| Outcome::Succeeded(Duration::from_millis(ms))),
            (1u64..600_000).prop_map(|ms| Outcome::TimedOut(Duration::from_millis(ms))),
            Just(Outcome::Failed),
        ]
    }

    proptest! {
        #[test]
        fn decisions_are_available_classes_within_the_requested_timeout(
            history in proptest::collection::vec((prop_oneof![Just(1u32), Just(2), Just(4), Just(8)], outcome()), 0..40),
            prior in proptest::collection::vec(prop_oneof![Just(1u32), Just(2), Just(4), Just(8)], 0..6),
            waits in proptest::collection::vec(0u64..1_000_000, 4),
            requested_ms in 1u64..2_000_000,
            draw in 0.0f64..1.0,
            queue_aware: bool,
        ) {
            let mut s = ActionStats::new();
            for (c, o) in history {
                s.push(c, o, 32);
            }
            let mut p = Prior::new();
            prior.into_iter().for_each(|c| p.add(c));
            let q: QueueState = [1, 2, 4, 8].into_iter().zip(waits)
                .map(|(c, w)| (c, ClassQueue { expected_wait: Duration::from_millis(w), idle_workers: 0 })).collect();
            let cls = classes();
            let requested = Duration::from_millis(requested_ms);
            let input = SelectionInput {
                stats: &s, prior: Some(&p), classes: &cls, requested_timeout: requested,
                queues: queue_aware.then_some(&q), draw, now: NOW,
            };
            let d = select(&SelectionConfig::default(), &input).unwrap();
            prop_assert!(cls.contains(d.size_class));
            prop_assert_eq!(d.timeout, requested);
            prop_assert_eq!(d.hedge_after.is_some(), d.size_class < 8);
            prop_assert!(d.hedge_after.is_none_or(|h| h <= requested));
            // Monotone estimates: a smaller class is never expected to be faster.
            prop_assert!(d.estimates.windows(2).all(|w| w[0].expected_run >= w[1].expected_run));
            prop_assert!(d.estimates.windows(2).all(|w| w[0].fit_probability <= w[1].fit_probability + 1e-12));
            prop_assert_eq!(select(&SelectionConfig::default(), &input).unwrap(), d);
        }
    }
}
