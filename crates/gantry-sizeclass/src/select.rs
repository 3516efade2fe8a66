//! Size class selection: the pure function [`select`] that maps (statistics
//! of a key, available classes, requested timeout, config, optional queue
//! state, one random draw, now) to a [`Decision`].
//!
//! # Rules, in order
//!
//! 1. **Failure boost.** If the key failed or timed out on the largest class
//!    less than `failure_cache_duration` ago, run on the largest class with
//!    the requested timeout: a failing action (e.g. a compile error being
//!    fixed) would otherwise fail on a small class first and pay twice.
//! 2. **Probing.** Without any success on the largest class there is no
//!    baseline. Run on the smallest available class that has no outcomes
//!    yet, with `min(requested, minimum_execution_timeout)` so a bad guess
//!    is cheap. If that class is the largest one, or every class already
//!    has outcomes, run on the largest class with the requested timeout: a
//!    run there is never retried, so a shortened timeout would surface as a
//!    spurious client-visible timeout.
//! 3. **Learned.** With `T_L` = median successful time on the largest
//!    class `L`, every smaller class `S` gets
//!    `acceptable(S) = T_L * (L / S)^x` and
//!    `timeout(S) = min(max(acceptable(S) * timeout_multiplier, minimum_execution_timeout), requested)`.
//!    Past outcomes on `S` are Bernoulli trials:
//!    * `Succeeded(d)` is a success if `d <= acceptable(S)`, else a failure;
//!    * `Failed` is a failure;
//!    * `TimedOut(d)` is a failure if `d >= acceptable(S)`; a timeout that
//!      fired *before* the acceptable time (a probe's short timeout, or a
//!      requested timeout below the acceptable time) is censored: it proves
//!      nothing about meeting the acceptable time, so it is not a trial.
//!      Counting it would lock out a class forever after one probe of a
//!      slow action, because the class would never be tried again.
//!
//!    The success probability is the posterior mean under a
//!    `Beta(prior_successes, prior_failures)` prior (Laplace smoothing with
//!    the default 1/1): `p = (successes + α) / (trials + α + β)`. An unseen
//!    class gets `α / (α + β)` = 0.5.
//! 4. **Choice.** Each smaller class, smallest first, has a *take
//!    probability* `t = p` if `p >= success_threshold`, else
//!    `t = p * exploration_factor` (rarely tried, so its history is still
//!    refreshed), and `t = 0` if queue awareness demoted it (below). The
//!    classes form a cascade: class `S_i` is chosen with probability
//!    `c_i = t_i * Π_{j<i} (1 - t_j)`, the largest class with the rest
//!    `Π (1 - t_j)`. The draw `u` in `[0, 1)` maps to the choice by
//!    cumulative intervals in ascending class order: `S_i` is chosen iff
//!    `Σ_{j<i} c_j <= u < Σ_{j<=i} c_j`; if `u` is past all of them the
//!    largest class is chosen. So a small draw favours small classes, and
//!    the same draw always gives the same class.
//!
//! # Queue awareness (beyond the published design)
//!
//! With a [`QueueState`], a smaller class `S` is demoted (`t = 0`) when
//! * its expected completion `wait(S) + run(S)` exceeds
//!   `acceptable(S) * queue_tolerance` (queueing ate the slowdown we were
//!   willing to accept for the cost saving), and
//! * some larger class `C` has idle workers, is a real candidate (the
//!   largest class, or `p(C) >= success_threshold`), and would complete
//!   sooner: `wait(C) + run(C) < wait(S) + run(S)`.
//!
//! `run(S)` is the median of the successes on `S` within the acceptable
//! time, else the acceptable time; `run(L)` is `T_L`. Classes missing from
//! the queue state are never demoted and never count as idle. Probing and
//! boosted decisions ignore queues: they have no baseline to compare with.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::stats::median;
use crate::{ActionStats, Error, Outcome, SelectionConfig, SizeClass, SizeClasses, Timestamp};

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
}

impl FromIterator<(SizeClass, ClassQueue)> for QueueState {
    fn from_iter<I: IntoIterator<Item = (SizeClass, ClassQueue)>>(iter: I) -> Self {
        Self { classes: iter.into_iter().collect() }
    }
}

/// Everything selection looks at, besides the config.
#[derive(Clone, Copy, Debug)]
pub struct SelectionInput<'a> {
    /// Statistics of the action's key (empty for a new key).
    pub stats: &'a ActionStats,
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
    /// No baseline yet: probing an unsampled smaller class.
    Probe,
    /// No baseline yet and nothing left to probe: measuring on the largest.
    LargestBaseline,
    /// Chosen from learned success probabilities.
    Learned,
}

impl Reason {
    /// Stable lowercase name, for metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::FailureBoost => "failure_boost",
            Reason::Probe => "probe",
            Reason::LargestBaseline => "largest_baseline",
            Reason::Learned => "learned",
        }
    }

    /// All reasons, for pre-registering metric label values.
    pub const ALL: [Reason; 4] = [Reason::FailureBoost, Reason::Probe, Reason::LargestBaseline, Reason::Learned];
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What selection computed for one class in the learned case (rule 3/4);
/// exposed for observability and debugging.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClassEstimate {
    pub size_class: SizeClass,
    /// Acceptable execution time; `T_L` itself for the largest class.
    #[serde(with = "crate::types::secs_f64", rename = "acceptable_time_s")]
    pub acceptable_time: Duration,
    /// Timeout the action would get on this class.
    #[serde(with = "crate::types::secs_f64", rename = "timeout_s")]
    pub timeout: Duration,
    /// Successful trials (successes within the acceptable time).
    pub successes: u32,
    /// Counted trials (censored timeouts excluded).
    pub trials: u32,
    /// Smoothed success probability; 1 for the largest class.
    pub success_probability: f64,
    /// Probability of taking this class if the cascade reaches it.
    pub take_probability: f64,
    /// Unconditional probability that this class is chosen.
    pub choice_probability: f64,
    /// Expected run time on this class (see module docs).
    #[serde(with = "crate::types::secs_f64", rename = "expected_run_s")]
    pub expected_run: Duration,
    /// Queue wait + expected run, when the queue of this class is known.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "expected_completion_s", with = "opt_secs")]
    pub expected_completion: Option<Duration>,
    /// True when queue awareness removed this class from the cascade.
    pub queue_demoted: bool,
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

/// The result of [`select`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// Class to run on; always one of the available classes.
    pub size_class: SizeClass,
    /// Execution timeout the worker must enforce; always within
    /// `[min(minimum_execution_timeout, requested), requested]`.
    #[serde(with = "crate::types::secs_f64", rename = "timeout_s")]
    pub timeout: Duration,
    pub reason: Reason,
    /// Per-class estimates, ascending by class; empty unless `reason` is
    /// [`Reason::Learned`].
    pub estimates: Vec<ClassEstimate>,
}

impl Decision {
    /// The estimate of the chosen class, for learned decisions.
    pub fn chosen_estimate(&self) -> Option<&ClassEstimate> {
        self.estimates.iter().find(|e| e.size_class == self.size_class)
    }
}

/// `T_L * (L / S)^x`, the acceptable execution time on `class`.
///
/// With `T_L` = 60 s on class 8 and x = 0.5 this gives 84.9 s on class 4,
/// 120 s on class 2 and 169.7 s on class 1.
pub fn acceptable_time(largest_median: Duration, largest: SizeClass, class: SizeClass, exponent: f64) -> Duration {
    let ratio = f64::from(largest) / f64::from(class.max(1));
    secs_to_duration(largest_median.as_secs_f64() * ratio.powf(exponent))
}

/// The timeout for a smaller class: `acceptable * multiplier`, raised to
/// `minimum` and then capped at `requested` (the client's limit wins when
/// it is below the minimum).
pub fn smaller_class_timeout(
    acceptable: Duration,
    multiplier: f64,
    minimum: Duration,
    requested: Duration,
) -> Duration {
    secs_to_duration(acceptable.as_secs_f64() * multiplier).max(minimum).min(requested)
}

fn secs_to_duration(s: f64) -> Duration {
    if s.is_nan() || s <= 0.0 {
        Duration::ZERO
    } else {
        Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
    }
}

/// Counts Bernoulli trials of `outcomes` against `acceptable`: returns
/// `(successes, trials)` following the rules in the module docs.
pub fn count_trials(outcomes: impl IntoIterator<Item = Outcome>, acceptable: Duration) -> (u32, u32) {
    let (mut successes, mut trials) = (0u32, 0u32);
    for o in outcomes {
        match o {
            Outcome::Succeeded(d) => {
                trials += 1;
                if d <= acceptable {
                    successes += 1;
                }
            }
            Outcome::Failed => trials += 1,
            Outcome::TimedOut(d) if d >= acceptable => trials += 1,
            Outcome::TimedOut(_) => {} // censored
        }
    }
    (successes, trials)
}

/// Posterior mean of a Beta(α, β) prior after `successes` of `trials`.
pub fn smoothed_probability(successes: u32, trials: u32, alpha: f64, beta: f64) -> f64 {
    (f64::from(successes) + alpha) / (f64::from(trials) + alpha + beta)
}

/// Chooses a size class and timeout. Pure and deterministic: the same
/// inputs always give the same decision. See the module docs for the rules.
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
    let simple = |size_class, timeout, reason| Decision { size_class, timeout, reason, estimates: Vec::new() };

    // Rule 1: failure boost.
    if let Some(failed_at) = stats.last_largest_failure()
        && input.now.saturating_since(failed_at) < config.failure_cache_duration
    {
        return Ok(simple(largest, requested, Reason::FailureBoost));
    }

    // Rule 2: no baseline on the largest class.
    let Some(t_l) = stats.median_success(largest) else {
        let unsampled = classes.iter().find(|&c| stats.sample_count(c) == 0);
        return Ok(match unsampled {
            Some(c) if c != largest => simple(c, requested.min(config.minimum_execution_timeout), Reason::Probe),
            _ => simple(largest, requested, Reason::LargestBaseline),
        });
    };

    // Rule 3: per-class estimates.
    let mut estimates: Vec<ClassEstimate> = classes
        .iter()
        .map(|c| {
            if c == largest {
                return ClassEstimate {
                    size_class: c,
                    acceptable_time: t_l,
                    timeout: requested,
                    successes: 0,
                    trials: 0,
                    success_probability: 1.0,
                    take_probability: 1.0,
                    choice_probability: 0.0,
                    expected_run: t_l,
                    expected_completion: None,
                    queue_demoted: false,
                };
            }
            let acceptable = acceptable_time(t_l, largest, c, config.acceptable_time_exponent);
            let timeout = smaller_class_timeout(
                acceptable,
                config.timeout_multiplier,
                config.minimum_execution_timeout,
                requested,
            );
            let (successes, trials) = count_trials(stats.outcomes(c), acceptable);
            let p = smoothed_probability(successes, trials, config.prior_successes, config.prior_failures);
            let take = if p >= config.success_threshold { p } else { p * config.exploration_factor };
            let fast_successes: Vec<Duration> = stats
                .outcomes(c)
                .filter_map(|o| match o {
                    Outcome::Succeeded(d) if d <= acceptable => Some(d),
                    _ => None,
                })
                .collect();
            ClassEstimate {
                size_class: c,
                acceptable_time: acceptable,
                timeout,
                successes,
                trials,
                success_probability: p,
                take_probability: take,
                choice_probability: 0.0,
                expected_run: median(fast_successes).unwrap_or(acceptable),
                expected_completion: None,
                queue_demoted: false,
            }
        })
        .collect();

    if let Some(queues) = input.queues {
        apply_queue_awareness(config, queues, &mut estimates);
    }

    // Rule 4: cascade and draw.
    let mut remaining = 1.0f64;
    let mut cumulative = 0.0f64;
    let mut chosen: Option<usize> = None;
    let last = estimates.len() - 1;
    for (i, e) in estimates.iter_mut().enumerate() {
        let c = if i == last { remaining } else { remaining * e.take_probability };
        e.choice_probability = c;
        if chosen.is_none() && i < last && input.draw < cumulative + c {
            chosen = Some(i);
        }
        cumulative += c;
        remaining *= 1.0 - e.take_probability;
    }
    let chosen = chosen.unwrap_or(last);
    Ok(Decision {
        size_class: estimates[chosen].size_class,
        timeout: estimates[chosen].timeout,
        reason: Reason::Learned,
        estimates,
    })
}

/// Demotes smaller classes whose queue is long while a larger candidate
/// idles (see module docs). Fills `expected_completion` for known queues.
fn apply_queue_awareness(config: &SelectionConfig, queues: &QueueState, estimates: &mut [ClassEstimate]) {
    for e in estimates.iter_mut() {
        if let Some(q) = queues.get(e.size_class) {
            e.expected_completion = Some(q.expected_wait.saturating_add(e.expected_run));
        }
    }
    let last = estimates.len() - 1;
    for i in 0..last {
        let Some(completion) = estimates[i].expected_completion else {
            continue;
        };
        let budget = secs_to_duration(estimates[i].acceptable_time.as_secs_f64() * config.queue_tolerance);
        if completion <= budget {
            continue;
        }
        let better_idle_larger = estimates[i + 1..].iter().enumerate().any(|(j, c)| {
            let is_largest = i + 1 + j == last;
            let candidate = is_largest || c.success_probability >= config.success_threshold;
            let idle = queues.get(c.size_class).is_some_and(|q| q.idle_workers > 0);
            candidate && idle && c.expected_completion.is_some_and(|cc| cc < completion)
        });
        if better_idle_larger {
            estimates[i].queue_demoted = true;
            estimates[i].take_probability = 0.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    const NOW: Timestamp = Timestamp::from_unix_millis(1_000_000_000_000);

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn classes() -> SizeClasses {
        SizeClasses::new([1, 2, 4, 8]).unwrap()
    }

    fn decide(stats: &ActionStats, cls: &SizeClasses, requested: f64, draw: f64) -> Decision {
        decide_q(stats, cls, requested, draw, None)
    }

    fn decide_q(
        stats: &ActionStats,
        cls: &SizeClasses,
        requested: f64,
        draw: f64,
        queues: Option<&QueueState>,
    ) -> Decision {
        let input = SelectionInput { stats, classes: cls, requested_timeout: secs(requested), queues, draw, now: NOW };
        select(&SelectionConfig::default(), &input).unwrap()
    }

    /// Stats with a 60 s baseline on class 8 and `n_ok` fast successes and
    /// `n_bad` failures on each of `small`.
    fn learned_stats(small: &[SizeClass], n_ok: usize, n_bad: usize) -> ActionStats {
        let mut s = ActionStats::new();
        for _ in 0..3 {
            s.push(8, Outcome::Succeeded(secs(60.0)), 32);
        }
        for &c in small {
            for _ in 0..n_ok {
                s.push(c, Outcome::Succeeded(secs(60.0)), 32);
            }
            for _ in 0..n_bad {
                s.push(c, Outcome::Failed, 32);
            }
        }
        s
    }

    #[test]
    fn acceptable_time_matches_the_worked_example() {
        // (class, x, expected seconds): 60 s on class 8.
        let table = [
            (8, 0.5, 60.0),
            (4, 0.5, 84.9),
            (2, 0.5, 120.0),
            (1, 0.5, 169.7),
            (4, 0.3, 73.9),
            (2, 0.3, 90.9),
            (1, 0.3, 112.0),
            (4, 0.7, 97.5),
            (2, 0.7, 158.3),
            (1, 0.7, 257.2),
        ];
        for (class, x, want) in table {
            let got = acceptable_time(secs(60.0), 8, class, x).as_secs_f64();
            assert!((got - want).abs() < 0.05, "class {class} x {x}: {got} != {want}");
        }
    }

    #[test]
    fn learned_decision_reports_the_worked_example() {
        let d = decide(&learned_stats(&[], 0, 0), &classes(), 900.0, 0.0);
        assert_eq!(d.reason, Reason::Learned);
        let acc: Vec<f64> =
            d.estimates.iter().map(|e| (e.acceptable_time.as_secs_f64() * 10.0).round() / 10.0).collect();
        assert_eq!(acc, vec![169.7, 120.0, 84.9, 60.0]);
        // Timeouts are 1.5 x acceptable on smaller classes, requested on the largest.
        let to: Vec<f64> = d.estimates.iter().map(|e| (e.timeout.as_secs_f64() * 10.0).round() / 10.0).collect();
        assert_eq!(to, vec![254.6, 180.0, 127.3, 900.0]);
    }

    #[test]
    fn timeout_clamping() {
        let min = secs(10.0);
        // Below the minimum: raised to it.
        assert_eq!(smaller_class_timeout(secs(2.0), 1.5, min, secs(900.0)), min);
        // In range: acceptable x multiplier.
        assert_eq!(smaller_class_timeout(secs(20.0), 1.5, min, secs(900.0)), secs(30.0));
        // Above requested: capped.
        assert_eq!(smaller_class_timeout(secs(700.0), 1.5, min, secs(900.0)), secs(900.0));
        // Requested below the minimum: the client's limit wins.
        assert_eq!(smaller_class_timeout(secs(2.0), 1.5, min, secs(5.0)), secs(5.0));

        // Same through select(): a 1 s baseline gives 10 s on small classes.
        let mut s = ActionStats::new();
        s.push(8, Outcome::Succeeded(secs(1.0)), 32);
        let d = decide(&s, &classes(), 900.0, 0.0);
        assert_eq!(d.size_class, 1);
        assert_eq!(d.timeout, secs(10.0));
        // A 500 s baseline with a 600 s request caps class 1 at 600 s.
        let mut s = ActionStats::new();
        s.push(8, Outcome::Succeeded(secs(500.0)), 32);
        let d = decide(&s, &classes(), 600.0, 0.0);
        assert_eq!((d.size_class, d.timeout), (1, secs(600.0)));
    }

    #[test]
    fn failure_boost_runs_on_the_largest_class() {
        let cfg = SelectionConfig::default();
        let mut s = learned_stats(&[1, 2, 4], 20, 0);
        s.set_last_largest_failure(Timestamp::from_unix_millis(NOW.unix_millis() - 3_600_000));
        let d = decide(&s, &classes(), 900.0, 0.0);
        assert_eq!((d.size_class, d.timeout, d.reason), (8, secs(900.0), Reason::FailureBoost));
        assert!(d.estimates.is_empty());

        // Just past the failure cache duration the boost is gone.
        let mut s = learned_stats(&[1, 2, 4], 20, 0);
        let expired = NOW.unix_millis() - cfg.failure_cache_duration.as_millis() as u64;
        s.set_last_largest_failure(Timestamp::from_unix_millis(expired));
        let d = decide(&s, &classes(), 900.0, 0.0);
        assert_eq!((d.size_class, d.reason), (1, Reason::Learned));
    }

    #[test]
    fn probing_goes_smallest_unsampled_first() {
        let cls = classes();
        let mut s = ActionStats::new();
        let mut seen = Vec::new();
        for expected in [1, 2, 4] {
            let d = decide(&s, &cls, 900.0, 0.5);
            assert_eq!((d.size_class, d.reason, d.timeout), (expected, Reason::Probe, secs(10.0)));
            seen.push(d.size_class);
            s.push(d.size_class, Outcome::TimedOut(secs(10.0)), 32);
        }
        // Nothing left to probe below the largest: baseline with the requested timeout.
        let d = decide(&s, &cls, 900.0, 0.5);
        assert_eq!((d.size_class, d.reason, d.timeout), (8, Reason::LargestBaseline, secs(900.0)));
        assert_eq!(seen, vec![1, 2, 4]);

        // The probe timeout never exceeds the requested one.
        let d = decide(&ActionStats::new(), &cls, 3.0, 0.5);
        assert_eq!((d.size_class, d.timeout), (1, secs(3.0)));

        // Only available classes are probed; history of absent classes is ignored.
        let mut s = ActionStats::new();
        s.push(1, Outcome::Failed, 32);
        let d = decide(&s, &SizeClasses::new([2, 4, 16]).unwrap(), 900.0, 0.5);
        assert_eq!(d.size_class, 2);
    }

    #[test]
    fn all_classes_sampled_without_largest_success_runs_largest() {
        let mut s = ActionStats::new();
        for c in [1, 2, 4, 8] {
            s.push(c, Outcome::Failed, 32);
        }
        // Failure time long expired, so rule 1 does not apply.
        s.set_last_largest_failure(Timestamp::from_unix_millis(0));
        let d = decide(&s, &classes(), 900.0, 0.0);
        assert_eq!((d.size_class, d.timeout, d.reason), (8, secs(900.0), Reason::LargestBaseline));
        // A single-class fleet is always the largest class.
        let d = decide(&ActionStats::new(), &SizeClasses::new([4]).unwrap(), 900.0, 0.0);
        assert_eq!((d.size_class, d.reason), (4, Reason::LargestBaseline));
    }

    #[test]
    fn bernoulli_trials_and_smoothing() {
        let acc = secs(100.0);
        let outcomes = [
            Outcome::Succeeded(secs(50.0)),  // success
            Outcome::Succeeded(secs(100.0)), // success (boundary)
            Outcome::Succeeded(secs(101.0)), // too slow: failure
            Outcome::Failed,                 // failure
            Outcome::TimedOut(secs(150.0)),  // reached acceptable: failure
            Outcome::TimedOut(secs(10.0)),   // censored probe timeout
        ];
        assert_eq!(count_trials(outcomes, acc), (2, 5));
        assert_eq!(smoothed_probability(2, 5, 1.0, 1.0), 3.0 / 7.0);
        assert_eq!(smoothed_probability(0, 0, 1.0, 1.0), 0.5);
        assert_eq!(smoothed_probability(9, 9, 2.0, 1.0), 11.0 / 12.0);
    }

    #[test]
    fn draw_maps_to_cumulative_intervals() {
        // Class 1: 2/2 successes -> p = 3/4. Classes 2 and 4: no data -> p = 1/2.
        let mut s = learned_stats(&[1], 2, 0);
        s.push(2, Outcome::TimedOut(secs(1.0)), 32); // censored: no trial
        let d = decide(&s, &classes(), 900.0, 0.0);
        let c: Vec<f64> = d.estimates.iter().map(|e| e.choice_probability).collect();
        let want = [0.75, 0.25 * 0.5, 0.25 * 0.5 * 0.5, 0.25 * 0.5 * 0.5];
        for (got, want) in c.iter().zip(want) {
            assert!((got - want).abs() < 1e-12, "{c:?}");
        }
        assert!((c.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        for (draw, class) in
            [(0.0, 1), (0.7499, 1), (0.75, 2), (0.8749, 2), (0.875, 4), (0.9374, 4), (0.9375, 8), (0.999_999, 8)]
        {
            assert_eq!(decide(&s, &classes(), 900.0, draw).size_class, class, "draw {draw}");
        }
    }

    #[test]
    fn below_threshold_classes_are_only_explored() {
        // Class 1: 0/2 -> p = 0.25 < 0.5 -> take = 0.025. Class 2: 5/5 -> p = 6/7.
        let mut s = learned_stats(&[2], 5, 0);
        s.push(1, Outcome::Failed, 32);
        s.push(1, Outcome::Succeeded(secs(1000.0)), 32); // too slow
        let d = decide(&s, &classes(), 900.0, 0.02);
        let e1 = &d.estimates[0];
        assert_eq!((e1.successes, e1.trials), (0, 2));
        assert!((e1.take_probability - 0.025).abs() < 1e-12);
        assert_eq!(d.size_class, 1);
        assert_eq!(decide(&s, &classes(), 900.0, 0.03).size_class, 2);
    }

    #[test]
    fn choices_follow_the_probabilities_over_a_fixed_seed() {
        let s = learned_stats(&[1, 2], 3, 1); // p = 4/6 on classes 1 and 2; 4 unseen: 1/2
        let cls = classes();
        let reference = decide(&s, &cls, 900.0, 0.0);
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let n = 20_000;
        let mut counts = BTreeMap::<SizeClass, u32>::new();
        let mut first = Vec::new();
        for i in 0..n {
            let d = decide(&s, &cls, 900.0, rng.random::<f64>());
            *counts.entry(d.size_class).or_default() += 1;
            if i < 20 {
                first.push(d.size_class);
            }
        }
        for e in &reference.estimates {
            let freq = f64::from(counts.get(&e.size_class).copied().unwrap_or(0)) / f64::from(n);
            // 4 standard errors of a binomial proportion.
            let tol = 4.0 * (e.choice_probability * (1.0 - e.choice_probability) / f64::from(n)).sqrt();
            assert!(
                (freq - e.choice_probability).abs() <= tol,
                "class {}: freq {freq} vs p {}",
                e.size_class,
                e.choice_probability
            );
        }
        // Same seed, same sequence of choices.
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let again: Vec<SizeClass> = (0..20).map(|_| decide(&s, &cls, 900.0, rng.random::<f64>()).size_class).collect();
        assert_eq!(again, first);
    }

    fn queues(wait1: f64, idle8: u32) -> QueueState {
        [
            (1, ClassQueue { expected_wait: secs(wait1), idle_workers: 0 }),
            (2, ClassQueue { expected_wait: secs(wait1), idle_workers: 0 }),
            (4, ClassQueue { expected_wait: secs(wait1), idle_workers: 0 }),
            (8, ClassQueue { expected_wait: Duration::ZERO, idle_workers: idle8 }),
        ]
        .into_iter()
        .collect()
    }

    #[test]
    fn queue_awareness_spills_to_an_idle_larger_class() {
        // Single-threaded action: 60 s everywhere; acceptable on class 1 is 169.7 s.
        let s = learned_stats(&[1, 2, 4], 10, 0);
        let cls = classes();
        assert_eq!(decide(&s, &cls, 900.0, 0.0).size_class, 1);
        // 50 s queue: 110 s < 169.7 s, still worth the wait.
        let q = queues(50.0, 3);
        let d = decide_q(&s, &cls, 900.0, 0.0, Some(&q));
        assert_eq!(d.size_class, 1);
        assert_eq!(d.estimates[0].expected_completion, Some(secs(110.0)));
        // 200 s queue with class 8 idle: every smaller class is demoted.
        let q = queues(200.0, 3);
        let d = decide_q(&s, &cls, 900.0, 0.0, Some(&q));
        assert_eq!((d.size_class, d.timeout), (8, secs(900.0)));
        assert!(d.estimates[..3].iter().all(|e| e.queue_demoted && e.choice_probability == 0.0));
        assert_eq!(d.estimates[3].choice_probability, 1.0);
        // Same queue but class 8 busy too: no point moving.
        let q = queues(200.0, 0);
        assert_eq!(decide_q(&s, &cls, 900.0, 0.0, Some(&q)).size_class, 1);
        // Unknown queue for class 1: never demoted.
        let q: QueueState = [(8, ClassQueue { expected_wait: Duration::ZERO, idle_workers: 5 })].into_iter().collect();
        assert_eq!(decide_q(&s, &cls, 900.0, 0.0, Some(&q)).size_class, 1);
    }

    #[test]
    fn queue_awareness_prefers_an_idle_middle_class() {
        let s = learned_stats(&[1, 2, 4], 10, 0);
        let mut q = queues(200.0, 0);
        q.set(2, ClassQueue { expected_wait: Duration::ZERO, idle_workers: 1 });
        let d = decide_q(&s, &classes(), 900.0, 0.0, Some(&q));
        assert_eq!(d.size_class, 2);
        assert!(d.estimates[0].queue_demoted);
        assert!(!d.estimates[1].queue_demoted);
    }

    #[test]
    fn rejects_bad_inputs() {
        let s = ActionStats::new();
        let cls = classes();
        for draw in [1.0, -0.1, f64::NAN] {
            let input =
                SelectionInput { stats: &s, classes: &cls, requested_timeout: secs(1.0), queues: None, draw, now: NOW };
            assert!(matches!(select(&SelectionConfig::default(), &input), Err(Error::InvalidDraw(_))));
        }
        let input = SelectionInput {
            stats: &s,
            classes: &cls,
            requested_timeout: Duration::ZERO,
            queues: None,
            draw: 0.0,
            now: NOW,
        };
        assert_eq!(select(&SelectionConfig::default(), &input), Err(Error::ZeroRequestedTimeout));
        let bad = SelectionConfig { timeout_multiplier: 0.5, ..Default::default() };
        let input = SelectionInput { requested_timeout: secs(1.0), ..input };
        assert!(matches!(select(&bad, &input), Err(Error::InvalidConfig { .. })));
    }

    fn outcome() -> impl Strategy<Value = Outcome> {
        prop_oneof![
            (0u64..2_000_000).prop_map(|ms| Outcome::Succeeded(Duration::from_millis(ms))),
            (0u64..2_000_000).prop_map(|ms| Outcome::TimedOut(Duration::from_millis(ms))),
            Just(Outcome::Failed),
        ]
    }

    proptest! {
        #[test]
        fn decisions_are_always_valid(
            class_set in proptest::collection::btree_set(1u32..64, 1..6),
            history in proptest::collection::vec((1u32..64, outcome()), 0..80),
            failure_age_ms in proptest::option::of(0u64..200_000_000),
            requested_ms in 1u64..3_000_000,
            draw in 0.0f64..1.0,
            waits in proptest::collection::vec((0u64..1_000_000, 0u32..3), 64),
            use_queues: bool,
        ) {
            let cls = SizeClasses::new(class_set).unwrap();
            let mut s = ActionStats::new();
            for (c, o) in history {
                s.push(c, o, 32);
            }
            if let Some(age) = failure_age_ms {
                s.set_last_largest_failure(Timestamp::from_unix_millis(NOW.unix_millis() - age));
            }
            let q: QueueState = waits
                .iter()
                .enumerate()
                .map(|(i, (w, idle))| (i as u32 + 1, ClassQueue { expected_wait: Duration::from_millis(*w), idle_workers: *idle }))
                .collect();
            let cfg = SelectionConfig::default();
            let requested = Duration::from_millis(requested_ms);
            let input = SelectionInput {
                stats: &s,
                classes: &cls,
                requested_timeout: requested,
                queues: use_queues.then_some(&q),
                draw,
                now: NOW,
            };
            let d = select(&cfg, &input).unwrap();
            prop_assert!(cls.contains(d.size_class));
            prop_assert!(d.timeout <= requested);
            prop_assert!(d.timeout >= requested.min(cfg.minimum_execution_timeout));
            if d.reason == Reason::Learned {
                let total: f64 = d.estimates.iter().map(|e| e.choice_probability).sum();
                prop_assert!((total - 1.0).abs() < 1e-9);
                prop_assert!(d.chosen_estimate().is_some_and(|e| e.choice_probability > 0.0));
                prop_assert!(d.estimates.iter().all(|e| (0.0..=1.0).contains(&e.success_probability)));
            }
            // Determinism.
            prop_assert_eq!(select(&cfg, &input).unwrap(), d);
        }
    }
}
