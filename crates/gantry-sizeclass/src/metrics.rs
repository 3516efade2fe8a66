//! Observability data: counters the scheduler exports on `/metrics`, and the
//! per-key history view behind `gantry sizeclass stats --key`. Data and
//! formatting only; exporting is the caller's business.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::select::estimates;
use crate::{
    ActionStats, Attribution, Decision, Outcome, Reason, RecordSummary, SelectionConfig, SizeClass, SizeClasses,
    Timestamp,
};

/// Cumulative selection counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectionMetrics {
    /// Decisions per chosen class.
    pub selections: BTreeMap<SizeClass, u64>,
    /// Decisions per reason.
    pub reasons: BTreeMap<Reason, u64>,
    /// Retries on the largest class, keyed by the class whose run failed.
    pub retries: BTreeMap<SizeClass, u64>,
    /// Smaller-class failures not counted because the largest failed too.
    pub dropped_action_fault: u64,
    /// Smaller-class failures not counted because the retry never finished.
    pub dropped_retry_unknown: u64,
    /// Decisions hedged on the largest class if still running at their hedge time.
    pub hedged_decisions: u64,
}

impl SelectionMetrics {
    /// Counts a decision.
    pub fn observe_decision(&mut self, d: &Decision) {
        *self.selections.entry(d.size_class).or_default() += 1;
        *self.reasons.entry(d.reason).or_default() += 1;
        if d.hedge_after.is_some() {
            self.hedged_decisions += 1;
        }
    }

    /// Counts a retry of a run that failed on `from`.
    pub fn observe_retry(&mut self, from: SizeClass) {
        *self.retries.entry(from).or_default() += 1;
    }

    /// Counts what [`crate::record`] did.
    pub fn observe_record(&mut self, s: &RecordSummary) {
        match s.smaller_class {
            Some(Attribution::ActionFault) => self.dropped_action_fault += 1,
            Some(Attribution::RetryUnknown) => self.dropped_retry_unknown += 1,
            Some(Attribution::Recorded) | None => {}
        }
    }

    /// Total decisions.
    pub fn total_selections(&self) -> u64 {
        self.selections.values().sum()
    }

    /// Total retries.
    pub fn total_retries(&self) -> u64 {
        self.retries.values().sum()
    }

    /// Adds `other`'s counts (e.g. to aggregate shards).
    pub fn merge(&mut self, other: &SelectionMetrics) {
        for (c, n) in &other.selections {
            *self.selections.entry(*c).or_default() += n;
        }
        for (r, n) in &other.reasons {
            *self.reasons.entry(*r).or_default() += n;
        }
        for (c, n) in &other.retries {
            *self.retries.entry(*c).or_default() += n;
        }
        self.dropped_action_fault += other.dropped_action_fault;
        self.dropped_retry_unknown += other.dropped_retry_unknown;
        self.hedged_decisions += other.hedged_decisions;
    }
}

impl fmt::Display for SelectionMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let classes: std::collections::BTreeSet<SizeClass> =
            self.selections.keys().chain(self.retries.keys()).copied().collect();
        writeln!(f, "{:>6} {:>12} {:>10}", "class", "selections", "retries")?;
        for c in classes {
            writeln!(
                f,
                "{:>6} {:>12} {:>10}",
                c,
                self.selections.get(&c).copied().unwrap_or(0),
                self.retries.get(&c).copied().unwrap_or(0)
            )?;
        }
        let reasons: Vec<String> = self.reasons.iter().map(|(r, n)| format!("{r}={n}")).collect();
        writeln!(f, "reasons: {}", reasons.join(" "))?;
        write!(
            f,
            "dropped smaller-class outcomes: action_fault={} retry_unknown={}; hedged decisions: {}",
            self.dropped_action_fault, self.dropped_retry_unknown, self.hedged_decisions
        )
    }
}

/// One class's row in [`KeyStatsView`].
#[derive(Clone, Debug, PartialEq)]
pub struct ClassHistoryView {
    pub size_class: SizeClass,
    /// Whether the class currently has workers.
    pub available: bool,
    pub successes: usize,
    pub timeouts: usize,
    pub failures: usize,
    pub median_success: Option<Duration>,
    /// Expected run time, acceptable time and memory fit probability, for
    /// available classes of a shape with history (see `select`).
    pub expected_run: Option<Duration>,
    pub acceptable_time: Option<Duration>,
    pub fit_probability: Option<f64>,
    /// The recorded outcomes, oldest first.
    pub history: Vec<Outcome>,
}

/// Human-readable view of one key's statistics.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyStatsView {
    pub key: String,
    pub last_largest_failure: Option<Timestamp>,
    /// Whether rule 1 (failure boost) applies at `now`.
    pub boosted: bool,
    /// Median success on the largest available class.
    pub largest_median: Option<Duration>,
    /// Rows for every available class and every class with history.
    pub classes: Vec<ClassHistoryView>,
}

impl KeyStatsView {
    /// Builds the view as selection would see `stats` at `now`.
    pub fn new(
        key: impl Into<String>,
        stats: &ActionStats,
        classes: &SizeClasses,
        config: &SelectionConfig,
        now: Timestamp,
    ) -> Self {
        let largest = classes.largest();
        let largest_median = stats.median_success(largest);
        let boosted =
            stats.last_largest_failure().is_some_and(|t| now.saturating_since(t) < config.failure_cache_duration);
        let estimates = estimates(config, stats, classes, None).unwrap_or_default();
        let all: std::collections::BTreeSet<SizeClass> = classes.iter().chain(stats.classes()).collect();
        let rows = all
            .into_iter()
            .map(|c| {
                let history: Vec<Outcome> = stats.outcomes(c).collect();
                let count = |pred: fn(&Outcome) -> bool| history.iter().filter(|o| pred(o)).count();
                let e = estimates.iter().find(|e| e.size_class == c);
                ClassHistoryView {
                    size_class: c,
                    available: classes.contains(c),
                    successes: count(|o| matches!(o, Outcome::Succeeded(_))),
                    timeouts: count(|o| matches!(o, Outcome::TimedOut(_))),
                    failures: count(|o| matches!(o, Outcome::Failed)),
                    median_success: stats.median_success(c),
                    expected_run: e.map(|e| e.expected_run),
                    acceptable_time: e.map(|e| e.acceptable_time),
                    fit_probability: e.map(|e| e.fit_probability),
                    history,
                }
            })
            .collect();
        KeyStatsView {
            key: key.into(),
            last_largest_failure: stats.last_largest_failure(),
            boosted,
            largest_median,
            classes: rows,
        }
    }
}

fn secs(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_string(), |d| format!("{:.1}s", d.as_secs_f64()))
}

fn compact(o: &Outcome) -> String {
    match o {
        Outcome::Succeeded(d) => format!("ok:{:.1}", d.as_secs_f64()),
        Outcome::TimedOut(d) => format!("to:{:.1}", d.as_secs_f64()),
        Outcome::Failed => "fail".to_string(),
    }
}

impl fmt::Display for KeyStatsView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "key {}: ", self.key)?;
        match self.last_largest_failure {
            Some(t) => write!(
                f,
                "last largest-class failure at {} ms{}",
                t.unix_millis(),
                if self.boosted { " (failure boost active)" } else { " (expired)" }
            )?,
            None => write!(f, "no largest-class failure")?,
        }
        writeln!(f, "; largest-class median {}", secs(self.largest_median))?;
        writeln!(
            f,
            "{:>6} {:>4} {:>4} {:>4} {:>9} {:>9} {:>11} {:>7}  history (oldest first, seconds)",
            "class", "ok", "to", "fail", "median", "expected", "acceptable", "fit"
        )?;
        for r in &self.classes {
            let p = r.fit_probability.map_or_else(|| "-".to_string(), |p| format!("{p:.3}"));
            let hist: Vec<String> = r.history.iter().map(compact).collect();
            writeln!(
                f,
                "{:>5}{} {:>4} {:>4} {:>4} {:>9} {:>9} {:>11} {:>7}  {}",
                r.size_class,
                if r.available { " " } else { "*" },
                r.successes,
                r.timeouts,
                r.failures,
                secs(r.median_success),
                secs(r.expected_run),
                secs(r.acceptable_time),
                p,
                hist.join(" ")
            )?;
        }
        if self.classes.iter().any(|r| !r.available) {
            writeln!(f, "* class currently has no workers")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{record, select, Execution, SelectionInput};

    const NOW: Timestamp = Timestamp::from_unix_millis(10_000_000);

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    #[test]
    fn counters_follow_decisions_retries_and_records() {
        let cfg = SelectionConfig::default();
        let cls = SizeClasses::new([1, 8]).unwrap();
        let mut stats = ActionStats::new();
        let mut m = SelectionMetrics::default();
        let input = SelectionInput {
            stats: &stats,
            prior: None,
            classes: &cls,
            requested_timeout: s(60),
            queues: None,
            draw: 0.0,
            now: NOW,
        };
        let d = select(&cfg, &input).unwrap();
        m.observe_decision(&d);
        m.observe_retry(1);
        let ex = Execution { size_class: 1, outcome: Outcome::Failed, largest_outcome: Some(Outcome::Failed) };
        m.observe_record(&record(&mut stats, &cfg, 8, &ex, NOW).unwrap());
        let ex = Execution { size_class: 1, outcome: Outcome::Failed, largest_outcome: None };
        m.observe_record(&record(&mut stats, &cfg, 8, &ex, NOW).unwrap());
        assert_eq!(m.selections.get(&8), Some(&1));
        assert_eq!(m.reasons.get(&Reason::LargestBaseline), Some(&1));
        assert_eq!(m.total_retries(), 1);
        assert_eq!((m.dropped_action_fault, m.dropped_retry_unknown), (1, 1));

        let mut total = m.clone();
        total.merge(&m);
        assert_eq!(total.total_selections(), 2);
        assert_eq!(total.retries.get(&1), Some(&2));
        assert_eq!(total.dropped_action_fault, 2);

        let text = m.to_string();
        assert!(text.contains("reasons: largest_baseline=1"), "{text}");
        assert!(text.contains("action_fault=1 retry_unknown=1"), "{text}");
        let json = serde_json::to_string(&m).unwrap();
        assert!(json.contains(r#""reasons":{"largest_baseline":1}"#), "{json}");
        assert_eq!(serde_json::from_str::<SelectionMetrics>(&json).unwrap(), m);
    }

    #[test]
    fn key_view_summarises_history() {
        let cfg = SelectionConfig::default();
        let cls = SizeClasses::new([1, 2, 8]).unwrap();
        let mut stats = ActionStats::new();
        for o in [Outcome::Succeeded(s(60)), Outcome::Succeeded(s(60))] {
            stats.push(8, o, 32);
        }
        stats.push(1, Outcome::Succeeded(s(100)), 32);
        stats.push(1, Outcome::TimedOut(s(10)), 32);
        stats.push(1, Outcome::Failed, 32);
        stats.push(4, Outcome::Failed, 32); // class no longer in the fleet
        stats.set_last_largest_failure(Timestamp::from_unix_millis(NOW.unix_millis() - 1000));
        let v = KeyStatsView::new("k17", &stats, &cls, &cfg, NOW);
        assert!(v.boosted);
        assert_eq!(v.largest_median, Some(s(60)));
        let rows: Vec<SizeClass> = v.classes.iter().map(|r| r.size_class).collect();
        assert_eq!(rows, vec![1, 2, 4, 8]);
        let r1 = &v.classes[0];
        assert_eq!((r1.successes, r1.timeouts, r1.failures), (1, 1, 1));
        // 1 success and 1 attributed failure on class 1: (1+1)/(2+2).
        assert_eq!(r1.fit_probability, Some(0.5));
        // Median of the success (100 s) and the censored run (at least 10 s) is 55 s,
        // raised to the largest class's 60 s: a smaller class is never faster.
        assert_eq!(r1.expected_run, Some(s(60)));
        let x = cfg.acceptable_time_exponent;
        assert!((r1.acceptable_time.unwrap().as_secs_f64() - 60.0 * 8f64.powf(x)).abs() < 0.05);
        assert!(!v.classes[2].available);
        assert_eq!(v.classes[2].fit_probability, None);
        assert_eq!(v.classes[3].fit_probability, Some(1.0));

        let text = v.to_string();
        assert!(text.contains("key k17"), "{text}");
        assert!(text.contains("failure boost active"), "{text}");
        assert!(text.contains("ok:100.0 to:10.0 fail"), "{text}");
        assert!(text.contains("4*"), "{text}");
        assert!(text.contains("class currently has no workers"), "{text}");

        let later = Timestamp::from_unix_millis(NOW.unix_millis() + 2 * 86_400_000);
        let v = KeyStatsView::new("k17", &stats, &cls, &cfg, later);
        assert!(!v.boosted);
        assert!(v.to_string().contains("(expired)"));
    }
}
