//! The retry policy and the rule that turns a (possibly retried) execution
//! into history entries.
//!
//! # Retry policy
//!
//! A failure or timeout on a class smaller than the largest is retried once
//! on the largest class with the client's original timeout: that rules out
//! lack of resources as the cause. Outcomes on the largest class are final.
//!
//! # Recording rule
//!
//! The scheduler reports an execution once its final result is known, i.e.
//! after the retry (if any) has finished, via [`record`]:
//!
//! | first run on class `c`     | retry on largest `L` | appended to history                    | largest failure time |
//! |----------------------------|----------------------|----------------------------------------|----------------------|
//! | `c == L`, success          | —                    | `L`: outcome                           | cleared              |
//! | `c == L`, failure/timeout  | —                    | `L`: outcome                           | set to `now`         |
//! | `c < L`, success           | —                    | `c`: outcome                           | cleared              |
//! | `c < L`, failure/timeout   | success              | `c`: outcome, `L`: retry's success     | cleared              |
//! | `c < L`, failure/timeout   | failure/timeout      | `L`: retry's outcome (`c` dropped)     | set to `now`         |
//! | `c < L`, failure/timeout   | unknown (`None`)     | nothing                                | unchanged            |
//!
//! Why: a smaller-class failure is only evidence against that class if the
//! largest class then succeeded. If the largest class failed as well, the
//! action itself is broken (compile error, failing test), and counting the
//! smaller-class failure would wrongly teach us to avoid small classes for
//! a key that is fine on them once fixed. If the retry never finished
//! (client abandoned it), the failure cannot be attributed either way, so
//! it is dropped rather than guessed. The retry's own outcome is a genuine
//! largest-class sample (often the first baseline for a new key), so it is
//! always kept. Timeouts on the largest class arm the failure boost like
//! failures: an action that cannot finish even there would otherwise burn
//! a smaller-class attempt first every time. A success ends the boost: the
//! boost is for an action that keeps failing (a compile error being fixed),
//! and one that fails now and then (a flaky test, code in flux that often
//! builds) would otherwise stay on the largest class for good, re-armed by
//! every failure before `failure_cache_duration` ran out.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{ActionStats, Error, Outcome, SelectionConfig, SizeClass, SizeClasses, Timestamp};

/// A re-execution the scheduler must perform.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retry {
    /// Always the largest available class.
    pub size_class: SizeClass,
    /// The client's original (requested) timeout.
    #[serde(with = "crate::types::secs_f64", rename = "timeout_s")]
    pub timeout: Duration,
}

/// Whether `outcome` on `class` must be retried, and how: `Some` exactly
/// for a failure or timeout on a class smaller than the largest.
pub fn retry_on_largest(
    class: SizeClass,
    outcome: Outcome,
    classes: &SizeClasses,
    requested_timeout: Duration,
) -> Option<Retry> {
    (class < classes.largest() && !outcome.is_success())
        .then(|| Retry { size_class: classes.largest(), timeout: requested_timeout })
}

/// One execution as reported to [`record`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Execution {
    /// Class of the first run.
    pub size_class: SizeClass,
    /// Outcome of the first run.
    #[serde(with = "outcome_serde")]
    pub outcome: Outcome,
    /// Outcome of the retry on the largest class; `None` when there was no
    /// retry or its result is unknown.
    #[serde(default, with = "opt_outcome_serde")]
    pub largest_outcome: Option<Outcome>,
}

/// What happened to a smaller-class outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Attribution {
    /// Appended to the class's history.
    Recorded,
    /// Dropped: the largest class failed too, so the action is at fault.
    ActionFault,
    /// Dropped: the retry's result is unknown.
    RetryUnknown,
}

/// What [`record`] did, for metrics and logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordSummary {
    /// Entries appended, in order.
    pub appended: Vec<(SizeClass, Outcome)>,
    /// For first runs on a smaller class: what happened to that outcome.
    pub smaller_class: Option<Attribution>,
    /// True when the largest-class failure time was set.
    pub failure_boost_armed: bool,
}

/// Applies the recording rule (module docs) to `stats`.
///
/// `largest` is the largest class at the time of the execution. Errors if
/// the report contradicts the retry policy; `stats` is untouched then.
pub fn record(
    stats: &mut ActionStats,
    config: &SelectionConfig,
    largest: SizeClass,
    execution: &Execution,
    now: Timestamp,
) -> Result<RecordSummary, Error> {
    let Execution { size_class: class, outcome, largest_outcome } = *execution;
    if class == 0 || largest == 0 {
        return Err(Error::ZeroSizeClass);
    }
    if class > largest {
        return Err(Error::UnknownSizeClass { class, available: vec![largest] });
    }
    let h = config.history_size;
    let mut summary = RecordSummary { appended: Vec::new(), smaller_class: None, failure_boost_armed: false };
    let arm = |stats: &mut ActionStats, summary: &mut RecordSummary| {
        stats.set_last_largest_failure(now);
        summary.failure_boost_armed = true;
    };

    if class == largest {
        if largest_outcome.is_some() {
            return Err(Error::InconsistentExecution(format!(
                "run on the largest class {largest} cannot have a retry outcome"
            )));
        }
        stats.push(class, outcome, h);
        summary.appended.push((class, outcome.to_millis_precision()));
        if outcome.is_success() {
            stats.clear_last_largest_failure();
        } else {
            arm(stats, &mut summary);
        }
        return Ok(summary);
    }

    match (outcome.is_success(), largest_outcome) {
        (true, Some(_)) => Err(Error::InconsistentExecution(format!(
            "success on class {class} is never retried, but a retry outcome was given"
        ))),
        (true, None) => {
            stats.clear_last_largest_failure();
            stats.push(class, outcome, h);
            summary.appended.push((class, outcome.to_millis_precision()));
            summary.smaller_class = Some(Attribution::Recorded);
            Ok(summary)
        }
        (false, None) => {
            summary.smaller_class = Some(Attribution::RetryUnknown);
            Ok(summary)
        }
        (false, Some(lo)) if lo.is_success() => {
            stats.clear_last_largest_failure();
            stats.push(class, outcome, h);
            stats.push(largest, lo, h);
            summary.appended.push((class, outcome.to_millis_precision()));
            summary.appended.push((largest, lo.to_millis_precision()));
            summary.smaller_class = Some(Attribution::Recorded);
            Ok(summary)
        }
        (false, Some(lo)) => {
            stats.push(largest, lo, h);
            summary.appended.push((largest, lo.to_millis_precision()));
            summary.smaller_class = Some(Attribution::ActionFault);
            arm(stats, &mut summary);
            Ok(summary)
        }
    }
}

/// Serde for a single outcome in the same shape as the stats JSON form.
mod outcome_serde {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::Outcome;

    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub(super) enum Wire {
        OkMs(u64),
        TimeoutMs(u64),
        Failed,
    }

    pub(super) fn to_wire(o: Outcome) -> Wire {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        match o {
            Outcome::Succeeded(d) => Wire::OkMs(ms(d)),
            Outcome::TimedOut(d) => Wire::TimeoutMs(ms(d)),
            Outcome::Failed => Wire::Failed,
        }
    }

    pub(super) fn from_wire(w: Wire) -> Outcome {
        match w {
            Wire::OkMs(ms) => Outcome::Succeeded(Duration::from_millis(ms)),
            Wire::TimeoutMs(ms) => Outcome::TimedOut(Duration::from_millis(ms)),
            Wire::Failed => Outcome::Failed,
        }
    }

    pub fn serialize<S: Serializer>(o: &Outcome, s: S) -> Result<S::Ok, S::Error> {
        to_wire(*o).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Outcome, D::Error> {
        Wire::deserialize(d).map(from_wire)
    }
}

mod opt_outcome_serde {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::outcome_serde::{from_wire, to_wire, Wire};
    use crate::Outcome;

    pub fn serialize<S: Serializer>(o: &Option<Outcome>, s: S) -> Result<S::Ok, S::Error> {
        o.map(to_wire).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Outcome>, D::Error> {
        Ok(Option::<Wire>::deserialize(d)?.map(from_wire))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: Timestamp = Timestamp::from_unix_millis(5_000_000);

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    #[test]
    fn retry_policy() {
        let cls = SizeClasses::new([1, 2, 8]).unwrap();
        let req = s(900);
        let retry = Some(Retry { size_class: 8, timeout: req });
        assert_eq!(retry_on_largest(1, Outcome::Failed, &cls, req), retry);
        assert_eq!(retry_on_largest(2, Outcome::TimedOut(s(10)), &cls, req), retry);
        assert_eq!(retry_on_largest(1, Outcome::Succeeded(s(3)), &cls, req), None);
        assert_eq!(retry_on_largest(8, Outcome::Failed, &cls, req), None);
        assert_eq!(retry_on_largest(8, Outcome::TimedOut(s(900)), &cls, req), None);
    }

    struct Case {
        name: &'static str,
        class: SizeClass,
        outcome: Outcome,
        largest_outcome: Option<Outcome>,
        appended: Vec<(SizeClass, Outcome)>,
        attribution: Option<Attribution>,
        armed: bool,
    }

    #[test]
    fn recording_rule_table() {
        let ok = Outcome::Succeeded(s(5));
        let ok_l = Outcome::Succeeded(s(2));
        let to = Outcome::TimedOut(s(10));
        let to_l = Outcome::TimedOut(s(900));
        let cases = vec![
            Case {
                name: "largest ok",
                class: 8,
                outcome: ok_l,
                largest_outcome: None,
                appended: vec![(8, ok_l)],
                attribution: None,
                armed: false,
            },
            Case {
                name: "largest fails",
                class: 8,
                outcome: Outcome::Failed,
                largest_outcome: None,
                appended: vec![(8, Outcome::Failed)],
                attribution: None,
                armed: true,
            },
            Case {
                name: "largest times out",
                class: 8,
                outcome: to_l,
                largest_outcome: None,
                appended: vec![(8, to_l)],
                attribution: None,
                armed: true,
            },
            Case {
                name: "small ok",
                class: 1,
                outcome: ok,
                largest_outcome: None,
                appended: vec![(1, ok)],
                attribution: Some(Attribution::Recorded),
                armed: false,
            },
            Case {
                name: "small fails, largest ok",
                class: 1,
                outcome: Outcome::Failed,
                largest_outcome: Some(ok_l),
                appended: vec![(1, Outcome::Failed), (8, ok_l)],
                attribution: Some(Attribution::Recorded),
                armed: false,
            },
            Case {
                name: "small times out, largest ok",
                class: 2,
                outcome: to,
                largest_outcome: Some(ok_l),
                appended: vec![(2, to), (8, ok_l)],
                attribution: Some(Attribution::Recorded),
                armed: false,
            },
            Case {
                name: "small fails, largest fails",
                class: 1,
                outcome: Outcome::Failed,
                largest_outcome: Some(Outcome::Failed),
                appended: vec![(8, Outcome::Failed)],
                attribution: Some(Attribution::ActionFault),
                armed: true,
            },
            Case {
                name: "small times out, largest times out",
                class: 1,
                outcome: to,
                largest_outcome: Some(to_l),
                appended: vec![(8, to_l)],
                attribution: Some(Attribution::ActionFault),
                armed: true,
            },
            Case {
                name: "retry unknown",
                class: 2,
                outcome: Outcome::Failed,
                largest_outcome: None,
                appended: vec![],
                attribution: Some(Attribution::RetryUnknown),
                armed: false,
            },
        ];
        let cfg = SelectionConfig::default();
        for c in cases {
            let mut stats = ActionStats::new();
            let ex = Execution { size_class: c.class, outcome: c.outcome, largest_outcome: c.largest_outcome };
            let sum = record(&mut stats, &cfg, 8, &ex, NOW).unwrap();
            assert_eq!(sum.appended, c.appended, "{}", c.name);
            assert_eq!(sum.smaller_class, c.attribution, "{}", c.name);
            assert_eq!(sum.failure_boost_armed, c.armed, "{}", c.name);
            assert_eq!(stats.last_largest_failure(), c.armed.then_some(NOW), "{}", c.name);
            for class in [1, 2, 8] {
                let want: Vec<Outcome> = c.appended.iter().filter(|(k, _)| *k == class).map(|(_, o)| *o).collect();
                assert_eq!(stats.outcomes(class).collect::<Vec<_>>(), want, "{} class {class}", c.name);
            }
        }
    }

    #[test]
    fn a_success_ends_the_failure_boost() {
        let cfg = SelectionConfig::default();
        let ok = Outcome::Succeeded(s(5));
        let successes = [
            Execution { size_class: 8, outcome: ok, largest_outcome: None },
            Execution { size_class: 1, outcome: ok, largest_outcome: None },
            Execution { size_class: 1, outcome: Outcome::Failed, largest_outcome: Some(ok) },
        ];
        for ex in successes {
            let mut stats = ActionStats::new();
            stats.set_last_largest_failure(NOW);
            record(&mut stats, &cfg, 8, &ex, NOW).unwrap();
            assert_eq!(stats.last_largest_failure(), None, "{ex:?}");
        }
        // Neither an unknown retry nor another failure ends it.
        let others = [
            Execution { size_class: 2, outcome: Outcome::Failed, largest_outcome: None },
            Execution { size_class: 8, outcome: Outcome::Failed, largest_outcome: None },
        ];
        for ex in others {
            let mut stats = ActionStats::new();
            stats.set_last_largest_failure(NOW);
            record(&mut stats, &cfg, 8, &ex, NOW).unwrap();
            assert_eq!(stats.last_largest_failure(), Some(NOW), "{ex:?}");
        }
    }

    #[test]
    fn record_respects_history_size() {
        let cfg = SelectionConfig { history_size: 2, ..Default::default() };
        let mut stats = ActionStats::new();
        for i in 1..=4 {
            let ex = Execution { size_class: 1, outcome: Outcome::Succeeded(s(i)), largest_outcome: None };
            record(&mut stats, &cfg, 8, &ex, NOW).unwrap();
        }
        assert_eq!(stats.outcomes(1).collect::<Vec<_>>(), vec![Outcome::Succeeded(s(3)), Outcome::Succeeded(s(4))]);
    }

    #[test]
    fn inconsistent_reports_are_rejected_without_side_effects() {
        let cfg = SelectionConfig::default();
        let bad = [
            Execution { size_class: 8, outcome: Outcome::Failed, largest_outcome: Some(Outcome::Failed) },
            Execution { size_class: 1, outcome: Outcome::Succeeded(s(1)), largest_outcome: Some(Outcome::Failed) },
        ];
        for ex in bad {
            let mut stats = ActionStats::new();
            assert!(matches!(record(&mut stats, &cfg, 8, &ex, NOW), Err(Error::InconsistentExecution(_))));
            assert!(stats.is_empty());
        }
        let mut stats = ActionStats::new();
        let ex = Execution { size_class: 16, outcome: Outcome::Failed, largest_outcome: None };
        assert!(matches!(record(&mut stats, &cfg, 8, &ex, NOW), Err(Error::UnknownSizeClass { class: 16, .. })));
        let ex = Execution { size_class: 0, outcome: Outcome::Failed, largest_outcome: None };
        assert_eq!(record(&mut stats, &cfg, 8, &ex, NOW), Err(Error::ZeroSizeClass));
    }

    #[test]
    fn execution_serializes_like_stats_outcomes() {
        let ex = Execution {
            size_class: 2,
            outcome: Outcome::TimedOut(s(10)),
            largest_outcome: Some(Outcome::Succeeded(Duration::from_millis(2500))),
        };
        let json = serde_json::to_string(&ex).unwrap();
        assert_eq!(json, r#"{"size_class":2,"outcome":{"timeout_ms":10000},"largest_outcome":{"ok_ms":2500}}"#);
        assert_eq!(serde_json::from_str::<Execution>(&json).unwrap(), ex);
        let plain: Execution = serde_json::from_str(r#"{"size_class":8,"outcome":"failed"}"#).unwrap();
        assert_eq!(plain.largest_outcome, None);
    }

    #[test]
    fn learning_loop_converges_to_the_small_class() {
        // A single-threaded 30 s action: gets a baseline, explores, then settles on class 1.
        let cfg = SelectionConfig::default();
        let cls = SizeClasses::new([1, 2, 4, 8]).unwrap();
        let mut stats = ActionStats::new();
        let mut chosen = Vec::new();
        for i in 0..40u32 {
            let input = crate::SelectionInput {
                stats: &stats,
                prior: None,
                classes: &cls,
                requested_timeout: s(900),
                queues: None,
                draw: f64::from(i % 10) / 10.0,
                now: NOW,
            };
            let d = crate::select(&cfg, &input).unwrap();
            chosen.push(d.size_class);
            // Runs take 30 s everywhere.
            let outcome = if d.timeout < s(30) { Outcome::TimedOut(d.timeout) } else { Outcome::Succeeded(s(30)) };
            let largest_outcome =
                retry_on_largest(d.size_class, outcome, &cls, s(900)).map(|_| Outcome::Succeeded(s(30)));
            let ex = Execution { size_class: d.size_class, outcome, largest_outcome };
            record(&mut stats, &cfg, 8, &ex, NOW).unwrap();
        }
        // The baseline on the largest class, then the smallest class at once.
        assert_eq!(&chosen[..2], &[8, 1]);
        let tail = &chosen[20..];
        let on_one = tail.iter().filter(|c| **c == 1).count();
        assert!(on_one >= 16, "{chosen:?}");
    }
}
