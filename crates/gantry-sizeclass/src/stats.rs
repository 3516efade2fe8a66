//! The Initial Size Class Cache value: per action-shape key, a bounded
//! history of recent outcomes per size class plus the time of the last
//! failure on the largest class, and its compact, versioned JSON form.
//!
//! The caller owns the key (a reduced action digest) and the storage; this
//! module only defines the value and how it serializes.
//!
//! # JSON form (version 1)
//!
//! ```json
//! {"v":1,"classes":{"1":[{"ok_ms":5200},{"timeout_ms":10000},"failed"],"8":[{"ok_ms":2100}]},"largest_failure_ms":1700000000000}
//! ```
//!
//! * `v`: format version, currently 1; other values are rejected.
//! * `classes`: size class (decimal string key, sorted numerically) to its
//!   outcomes, oldest first. An outcome is `{"ok_ms":N}` (succeeded after N
//!   ms), `{"timeout_ms":N}` (killed after N ms) or `"failed"`.
//! * `largest_failure_ms`: Unix milliseconds of the last failure on the
//!   largest class; omitted when there is none.
//!
//! Durations are whole milliseconds. Outcomes are rounded to the millisecond
//! when recorded, so decoding an encoded value gives back an equal value.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{Error, SizeClass, Timestamp};

/// The current JSON format version.
pub const STATS_FORMAT_VERSION: u64 = 1;

/// How far (as a ratio to the older runs' median) two successive runs on a
/// class must both be to start its history over; see [`ActionStats::push`].
/// Run-to-run noise of a few percent to a few tens of percent stays inside it.
pub const CHANGE_RATIO: f64 = 0.75;

/// How many robust standard deviations of the older runs' log times two
/// successive runs must both be beyond, as well as beyond [`CHANGE_RATIO`], to
/// start a class's history over. On run times with log-normal noise of
/// σ = 0.3 that happened on 0.3% of pushes (9% with the ratio alone; 1.2%
/// at 2 spreads), and a run time that halved is still noticed up to σ ≈ 0.2.
pub const CHANGE_SPREADS: f64 = 2.5;

/// Older successes a class needs before a change point can drop them.
const CHANGE_MIN_OLDER: usize = 3;

/// Successes a class needs before [`ActionStats::log_spread`] reports its noise.
pub const SPREAD_MIN_SUCCESSES: usize = 5;

/// The outcome of one execution on one size class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Completed successfully after the given execution time.
    Succeeded(Duration),
    /// Was killed when its timeout (the given duration) expired.
    TimedOut(Duration),
    /// Failed (non-zero exit, OOM kill, ...). The time is not kept: a failure
    /// says nothing about how long a successful run would take.
    Failed,
}

impl Outcome {
    /// True for [`Outcome::Succeeded`].
    pub fn is_success(self) -> bool {
        matches!(self, Outcome::Succeeded(_))
    }

    /// The same outcome with its duration rounded to the nearest millisecond
    /// (the precision of the persisted form).
    pub fn to_millis_precision(self) -> Self {
        match self {
            Outcome::Succeeded(d) => Outcome::Succeeded(round_ms(d)),
            Outcome::TimedOut(d) => Outcome::TimedOut(round_ms(d)),
            Outcome::Failed => Outcome::Failed,
        }
    }
}

fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(millis_rounded(d))
}

fn millis_rounded(d: Duration) -> u64 {
    let ms = (d.as_nanos() + 500_000) / 1_000_000;
    u64::try_from(ms).unwrap_or(u64::MAX)
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Succeeded(d) => write!(f, "ok {:.3}s", d.as_secs_f64()),
            Outcome::TimedOut(d) => write!(f, "timeout {:.3}s", d.as_secs_f64()),
            Outcome::Failed => f.write_str("failed"),
        }
    }
}

/// Previous execution statistics of one action-shape key.
///
/// Mutate it with [`crate::record`] (which applies the retry attribution
/// rule); [`ActionStats::push`] is the raw append it builds on.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "StatsWire", try_from = "StatsWire")]
pub struct ActionStats {
    classes: BTreeMap<SizeClass, VecDeque<Outcome>>,
    last_largest_failure: Option<Timestamp>,
}

impl ActionStats {
    /// Statistics of a key never seen before.
    pub fn new() -> Self {
        Self::default()
    }

    /// True when nothing has been recorded.
    pub fn is_empty(&self) -> bool {
        self.classes.values().all(VecDeque::is_empty) && self.last_largest_failure.is_none()
    }

    /// Outcomes recorded on `class`, oldest first.
    pub fn outcomes(&self, class: SizeClass) -> impl Iterator<Item = Outcome> + '_ {
        self.classes.get(&class).into_iter().flatten().copied()
    }

    /// Number of outcomes recorded on `class`.
    pub fn sample_count(&self, class: SizeClass) -> usize {
        self.classes.get(&class).map_or(0, VecDeque::len)
    }

    /// Classes that have at least one outcome, ascending.
    pub fn classes(&self) -> impl Iterator<Item = SizeClass> + '_ {
        self.classes.iter().filter(|(_, h)| !h.is_empty()).map(|(c, _)| *c)
    }

    /// When the action last failed (or timed out) on the largest class.
    pub fn last_largest_failure(&self) -> Option<Timestamp> {
        self.last_largest_failure
    }

    /// Sets the time of the last failure on the largest class.
    pub fn set_last_largest_failure(&mut self, at: Timestamp) {
        // Keep the latest; outcomes may be reported out of order.
        self.last_largest_failure = Some(self.last_largest_failure.map_or(at, |t| t.max(at)));
    }

    /// Forgets the last failure on the largest class: the action succeeded since.
    pub fn clear_last_largest_failure(&mut self) {
        self.last_largest_failure = None;
    }

    /// Appends `outcome` (rounded to milliseconds) to `class`'s history and
    /// drops the oldest entries beyond `history_size` (at least 1 is kept).
    ///
    /// A change point also drops older runs: when the two newest runs on the
    /// class both succeeded far below the older successes' median, or both far
    /// above it, the older times describe an action that no longer exists (a
    /// dependency upgrade made a test parallel). A median over them would take
    /// half a history of new runs to move, and on a class the shape seldom runs
    /// that is hundreds of executions. "Far" is beyond [`CHANGE_RATIO`] and
    /// beyond [`CHANGE_SPREADS`] robust standard deviations of the older log
    /// times, so a shape whose runs vary a lot needs a larger jump: with a
    /// fixed ratio alone, noise of 30% started histories over on one push in
    /// eleven. Older failures stay: the action's memory did not get smaller
    /// because it got faster, and they are the fit evidence of the class.
    pub fn push(&mut self, class: SizeClass, outcome: Outcome, history_size: usize) {
        let h = self.classes.entry(class).or_default();
        h.push_back(outcome.to_millis_precision());
        while h.len() > history_size.max(1) {
            h.pop_front();
        }
        let n = h.len();
        if n < CHANGE_MIN_OLDER + 2 {
            return;
        }
        let (Some(a), Some(b)) = (log_success(&h[n - 1]), log_success(&h[n - 2])) else {
            return;
        };
        let older: Vec<f64> = h.iter().take(n - 2).filter_map(log_success).collect();
        if older.len() < CHANGE_MIN_OLDER {
            return;
        }
        let (m, spread) = log_median_spread(&older).expect("not empty");
        let far = (-CHANGE_RATIO.ln()).max(CHANGE_SPREADS * spread);
        let faster = a < m - far && b < m - far;
        let slower = a > m + far && b > m + far;
        if faster || slower {
            let kept: VecDeque<Outcome> =
                h.iter().take(n - 2).filter(|o| **o == Outcome::Failed).chain(h.iter().skip(n - 2)).copied().collect();
            *h = kept;
        }
    }

    /// The run-to-run noise of the shape on `class`: a robust standard
    /// deviation of its successes' log times (1.4826 × their median absolute
    /// deviation, which estimates σ for normal noise and ignores a few outliers).
    /// `None` below [`SPREAD_MIN_SUCCESSES`] successes, too few to tell noise
    /// from luck. exp(spread) is the typical factor between two runs' times.
    pub fn log_spread(&self, class: SizeClass) -> Option<f64> {
        let logs: Vec<f64> = self.classes.get(&class)?.iter().filter_map(log_success).collect();
        if logs.len() < SPREAD_MIN_SUCCESSES {
            return None;
        }
        log_median_spread(&logs).map(|(_, spread)| spread)
    }

    /// Median of the successful execution times on `class`; the mean of the
    /// two middle values for an even count. `None` without successes.
    pub fn median_success(&self, class: SizeClass) -> Option<Duration> {
        let durations: Vec<Duration> = self
            .classes
            .get(&class)?
            .iter()
            .filter_map(|o| match o {
                Outcome::Succeeded(d) => Some(*d),
                _ => None,
            })
            .collect();
        median(durations)
    }

    /// Encodes the version-1 JSON form (see the module docs).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("stats wire form always serializes")
    }

    /// Decodes the JSON form, checking the version and every field.
    pub fn from_json(s: &str) -> Result<Self, Error> {
        // Peek at the version first so a future format gets a precise error
        // instead of an "unknown field" one.
        let raw: serde_json::Value = serde_json::from_str(s).map_err(|e| Error::StatsFormat(e.to_string()))?;
        match raw.get("v").and_then(serde_json::Value::as_u64) {
            Some(STATS_FORMAT_VERSION) => {}
            Some(found) => {
                return Err(Error::StatsVersion { found, supported: STATS_FORMAT_VERSION });
            }
            None => return Err(Error::StatsFormat("missing or non-integer `v`".into())),
        }
        serde_json::from_value(raw).map_err(|e| Error::StatsFormat(e.to_string()))
    }
}

/// The natural log of a success's time (at least 1 ms, so 0 s has a log).
fn log_success(o: &Outcome) -> Option<f64> {
    match o {
        Outcome::Succeeded(d) => Some(d.as_secs_f64().max(1e-3).ln()),
        _ => None,
    }
}

/// The median of `logs` and 1.4826 × their median absolute deviation, a
/// robust estimate of their standard deviation. `None` when empty.
fn log_median_spread(logs: &[f64]) -> Option<(f64, f64)> {
    let m = median_f64(logs.to_vec())?;
    median_f64(logs.iter().map(|x| (x - m).abs()).collect()).map(|mad| (m, 1.4826 * mad))
}

/// Median of `v`; the mean of the two middle values for an even count.
pub(crate) fn median_f64(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// Median of durations; mean of the middle two for even counts.
pub(crate) fn median(mut v: Vec<Duration>) -> Option<Duration> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2 })
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StatsWire {
    v: u64,
    classes: BTreeMap<SizeClass, Vec<WireOutcome>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    largest_failure_ms: Option<u64>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum WireOutcome {
    OkMs(u64),
    TimeoutMs(u64),
    Failed,
}

impl From<ActionStats> for StatsWire {
    fn from(s: ActionStats) -> Self {
        let classes = s
            .classes
            .into_iter()
            .filter(|(_, h)| !h.is_empty())
            .map(|(c, h)| {
                let v = h
                    .into_iter()
                    .map(|o| match o {
                        Outcome::Succeeded(d) => WireOutcome::OkMs(millis_rounded(d)),
                        Outcome::TimedOut(d) => WireOutcome::TimeoutMs(millis_rounded(d)),
                        Outcome::Failed => WireOutcome::Failed,
                    })
                    .collect();
                (c, v)
            })
            .collect();
        StatsWire {
            v: STATS_FORMAT_VERSION,
            classes,
            largest_failure_ms: s.last_largest_failure.map(Timestamp::unix_millis),
        }
    }
}

impl TryFrom<StatsWire> for ActionStats {
    type Error = Error;
    fn try_from(w: StatsWire) -> Result<Self, Error> {
        if w.v != STATS_FORMAT_VERSION {
            return Err(Error::StatsVersion { found: w.v, supported: STATS_FORMAT_VERSION });
        }
        let mut classes = BTreeMap::new();
        for (c, outcomes) in w.classes {
            if c == 0 {
                return Err(Error::StatsFormat("size class 0 in `classes`".into()));
            }
            if outcomes.is_empty() {
                continue;
            }
            let h: VecDeque<Outcome> = outcomes
                .into_iter()
                .map(|o| match o {
                    WireOutcome::OkMs(ms) => Outcome::Succeeded(Duration::from_millis(ms)),
                    WireOutcome::TimeoutMs(ms) => Outcome::TimedOut(Duration::from_millis(ms)),
                    WireOutcome::Failed => Outcome::Failed,
                })
                .collect();
            classes.insert(c, h);
        }
        Ok(ActionStats { classes, last_largest_failure: w.largest_failure_ms.map(Timestamp::from_unix_millis) })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn log_spread_is_a_robust_sigma_of_the_successes() {
        let mut s = ActionStats::new();
        let ok = |t: f64| Outcome::Succeeded(Duration::from_secs_f64(t));
        for t in [10.0, 20.0, 10.0, 5.0] {
            s.push(1, ok(t), 32);
        }
        s.push(1, Outcome::Failed, 32);
        s.push(1, Outcome::TimedOut(Duration::from_secs(500)), 32);
        // Four successes: too few to tell noise from luck.
        assert_eq!(s.log_spread(1), None);
        s.push(1, ok(10.0), 32);
        // Logs around ln 10: deviations 0, ln 2, 0, ln 2, 0; failures and timeouts are ignored.
        assert!((s.log_spread(1).unwrap() - 0.0).abs() < 1e-12);
        s.push(1, ok(40.0), 32);
        // Deviations 0, ln2, 0, ln2, 0, ln4: median ln2 / 2.
        assert!((s.log_spread(1).unwrap() - 1.4826 * 2f64.ln() / 2.0).abs() < 1e-9);
        // One wild run (after a usual one, or it and the 40 s run would be a change
        // point) does not move it: it is a median.
        s.push(1, ok(10.0), 32);
        s.push(1, ok(10_000.0), 32);
        assert_eq!(s.sample_count(1), 10);
        assert!((s.log_spread(1).unwrap() - 1.4826 * 2f64.ln() / 2.0).abs() < 1e-9);
        assert_eq!(s.log_spread(2), None);
    }

    #[test]
    fn push_keeps_the_newest_entries() {
        let mut s = ActionStats::new();
        for i in 1..=5 {
            s.push(2, Outcome::Succeeded(ms(i)), 3);
        }
        assert_eq!(
            s.outcomes(2).collect::<Vec<_>>(),
            vec![Outcome::Succeeded(ms(3)), Outcome::Succeeded(ms(4)), Outcome::Succeeded(ms(5))]
        );
        // A history size of 0 still keeps the newest outcome.
        s.push(4, Outcome::Failed, 0);
        s.push(4, Outcome::TimedOut(ms(7)), 0);
        assert_eq!(s.outcomes(4).collect::<Vec<_>>(), vec![Outcome::TimedOut(ms(7))]);
        assert_eq!(s.sample_count(8), 0);
        assert_eq!(s.classes().collect::<Vec<_>>(), vec![2, 4]);
    }

    #[test]
    fn two_runs_far_from_the_median_start_the_history_over() {
        let ok = |n| Outcome::Succeeded(ms(n));
        let history = |s: &ActionStats| s.outcomes(2).collect::<Vec<_>>();
        // Faster: 40 s, then twice 22 s (under 0.75 x 40 s).
        let mut s = ActionStats::new();
        for t in [40_000, 41_000, 39_000, 40_000] {
            s.push(2, ok(t), 32);
        }
        s.push(2, ok(22_000), 32);
        assert_eq!(history(&s).len(), 5, "one run far out is noise");
        s.push(2, ok(23_000), 32);
        assert_eq!(history(&s), vec![ok(22_000), ok(23_000)]);
        // Slower: twice over 40 s / 0.75.
        let mut s = ActionStats::new();
        for t in [40_000, 41_000, 39_000, 60_000, 61_000] {
            s.push(2, ok(t), 32);
        }
        assert_eq!(history(&s), vec![ok(60_000), ok(61_000)]);
        // Older failures are fit evidence and stay.
        let mut s = ActionStats::new();
        for o in [ok(40_000), Outcome::Failed, ok(41_000), ok(39_000), ok(40_000), ok(20_000), ok(21_000)] {
            s.push(2, o, 32);
        }
        assert_eq!(history(&s), vec![Outcome::Failed, ok(20_000), ok(21_000)]);
        // Inside the spread of noisy older runs: kept, though past the ratio.
        let mut s = ActionStats::new();
        for t in [40_000, 70_000, 25_000, 55_000, 30_000, 45_000, 28_000, 28_000] {
            s.push(2, ok(t), 32);
        }
        assert_eq!(history(&s).len(), 8);
        // Inside the ratio, or one run each way, or a failure between: kept.
        let mut s = ActionStats::new();
        for o in [ok(40_000), ok(41_000), ok(39_000), ok(31_000), ok(52_000), ok(20_000), Outcome::Failed, ok(20_000)] {
            s.push(2, o, 32);
        }
        assert_eq!(history(&s).len(), 8);
        // Too few older runs to judge: kept.
        let mut s = ActionStats::new();
        for t in [40_000, 41_000, 20_000, 20_000] {
            s.push(2, ok(t), 32);
        }
        assert_eq!(history(&s).len(), 4);
    }

    #[test]
    fn noise_alone_seldom_starts_the_history_over() {
        use rand::SeedableRng;
        // Log-normal run times with sigma 0.3, a noisy test: a fixed ratio alone started
        // the history over on about 1 push in 11.
        for seed in 1..=3 {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let mut s = ActionStats::new();
            let (mut pushes, mut restarts) = (0, 0);
            for _ in 0..20_000 {
                let z = crate::sim::synth::normal(&mut rng);
                let before = s.sample_count(1);
                s.push(1, Outcome::Succeeded(Duration::from_secs_f64(30.0 * (0.3 * z).exp())), 32);
                pushes += 1;
                if s.sample_count(1) < before {
                    restarts += 1;
                }
            }
            let rate = f64::from(restarts) / f64::from(pushes);
            assert!(rate < 0.005, "seed {seed}: {restarts} restarts in {pushes} pushes");
        }
    }

    #[test]
    fn push_rounds_to_milliseconds() {
        let mut s = ActionStats::new();
        s.push(1, Outcome::Succeeded(Duration::from_micros(1_234_500)), 32);
        s.push(1, Outcome::TimedOut(Duration::from_micros(2_000_499)), 32);
        assert_eq!(s.outcomes(1).collect::<Vec<_>>(), vec![Outcome::Succeeded(ms(1235)), Outcome::TimedOut(ms(2000))]);
    }

    #[test]
    fn median_uses_successes_only() {
        let mut s = ActionStats::new();
        assert_eq!(s.median_success(8), None);
        s.push(8, Outcome::Failed, 32);
        s.push(8, Outcome::TimedOut(ms(100_000)), 32);
        assert_eq!(s.median_success(8), None);
        for d in [30, 10, 20] {
            s.push(8, Outcome::Succeeded(ms(d)), 32);
        }
        assert_eq!(s.median_success(8), Some(ms(20)));
        s.push(8, Outcome::Succeeded(ms(40)), 32);
        assert_eq!(s.median_success(8), Some(ms(25)));
    }

    #[test]
    fn last_largest_failure_keeps_the_latest() {
        let mut s = ActionStats::new();
        assert!(s.is_empty());
        s.set_last_largest_failure(Timestamp::from_unix_millis(50));
        s.set_last_largest_failure(Timestamp::from_unix_millis(20));
        assert_eq!(s.last_largest_failure(), Some(Timestamp::from_unix_millis(50)));
        assert!(!s.is_empty());
    }

    #[test]
    fn json_form_is_the_documented_one() {
        let mut s = ActionStats::new();
        s.push(8, Outcome::Succeeded(ms(2100)), 32);
        s.push(1, Outcome::Succeeded(ms(5200)), 32);
        s.push(1, Outcome::TimedOut(ms(10_000)), 32);
        s.push(1, Outcome::Failed, 32);
        s.push(10, Outcome::Failed, 32);
        s.set_last_largest_failure(Timestamp::from_unix_millis(1_700_000_000_000));
        let json = s.to_json();
        assert_eq!(
            json,
            r#"{"v":1,"classes":{"1":[{"ok_ms":5200},{"timeout_ms":10000},"failed"],"8":[{"ok_ms":2100}],"10":["failed"]},"largest_failure_ms":1700000000000}"#
        );
        assert_eq!(ActionStats::from_json(&json).unwrap(), s);
        assert_eq!(ActionStats::new().to_json(), r#"{"v":1,"classes":{}}"#);
    }

    #[test]
    fn from_json_rejects_bad_input() {
        let cases = [
            (r#"{"v":2,"classes":{}}"#, "version"),
            (r#"{"classes":{}}"#, "`v`"),
            (r#"[]"#, "`v`"),
            (r#"{"v":1,"classes":{"0":["failed"]}}"#, "class 0"),
            (r#"{"v":1,"classes":{"1":[{"ok":5}]}}"#, "unknown variant"),
            (r#"{"v":1,"classes":{},"extra":true}"#, "unknown field"),
            (r#"{"v":1,"classes":{"x":[]}}"#, "invalid"),
            ("{", "EOF"),
        ];
        for (input, want) in cases {
            let e = ActionStats::from_json(input).unwrap_err();
            assert!(e.to_string().contains(want), "{input}: {e}");
        }
        assert_eq!(
            ActionStats::from_json(r#"{"v":2,"classes":{}}"#),
            Err(Error::StatsVersion { found: 2, supported: 1 })
        );
    }

    fn outcome() -> impl Strategy<Value = Outcome> {
        prop_oneof![
            (0u64..10_000_000).prop_map(|n| Outcome::Succeeded(Duration::from_micros(n * 7))),
            (0u64..10_000_000).prop_map(|n| Outcome::TimedOut(Duration::from_micros(n * 3))),
            Just(Outcome::Failed),
        ]
    }

    proptest! {
        #[test]
        fn json_round_trips(
            entries in proptest::collection::vec((1u32..20, outcome()), 0..60),
            failure in proptest::option::of(0u64..u64::MAX / 2),
            cap in 1usize..40,
        ) {
            let mut s = ActionStats::new();
            for (c, o) in entries {
                s.push(c, o, cap);
            }
            if let Some(t) = failure {
                s.set_last_largest_failure(Timestamp::from_unix_millis(t));
            }
            for c in s.classes() {
                prop_assert!(s.sample_count(c) <= cap);
            }
            let back = ActionStats::from_json(&s.to_json()).unwrap();
            prop_assert_eq!(back, s);
        }
    }
}
