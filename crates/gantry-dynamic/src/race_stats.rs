//! Race statistics for `gantry run --stats`: who wins, how often the cache
//! answers, and how much time racing saved, per command shape.
//!
//! "Time saved" for a completed run is how much longer the run would have
//! taken with only the losing branch: `max(0, est(loser) - t_winner)`, where
//! `t_winner` is the winner's time from run start to ready, and `est(loser)`
//! is the loser's standalone estimate from the shape's history (the loser was
//! cancelled, so its real time is unknown): for local, the Kaplan-Meier median
//! local duration; for remote,
//! `p * median(hit) + (1 - p) * (median(miss known) + median(after miss))`. Runs without an estimate are counted separately
//! instead of being guessed.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::coordinator::{Branch, RaceReport, RunResult};
use crate::delay::{DelayConfig, Dist, ShapeStats};

/// Counters for one command shape.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShapeRaceStats {
    pub runs: u64,
    pub local_wins: u64,
    pub remote_wins: u64,
    /// Remote wins served from the action cache (a subset of `remote_wins`).
    pub cache_hits: u64,
    /// Runs whose first finisher failed, or whose outputs could not be written.
    pub failures: u64,
    /// Cancelled, timed out, or cache-only misses.
    pub other: u64,
    /// Sum of time saved over completed runs with an estimate, in ms.
    pub saved_ms: u64,
    /// Completed runs for which no loser estimate existed.
    pub saved_unknown: u64,
    /// Sum of wall time (start to finish), in ms.
    pub wall_ms: u64,
}

/// Statistics for all shapes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RaceStats {
    pub shapes: BTreeMap<String, ShapeRaceStats>,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Standalone duration estimate of `branch` from a shape's history (see module docs).
pub fn estimate_standalone(stats: &ShapeStats, branch: Branch, config: &DelayConfig) -> Option<Duration> {
    let horizon = config.horizon.as_secs_f64() * 1000.0;
    let est_ms = match branch {
        Branch::Local => {
            let m = Dist::kaplan_meier(stats.local.iter().copied(), Some(horizon))?.quantile(0.5);
            // A median in the tail means "we never saw it finish": no estimate.
            if m >= horizon {
                return None;
            }
            m
        }
        Branch::Remote => {
            if stats.lookups.is_empty() {
                return None;
            }
            let p = stats.lookups.iter().filter(|h| **h).count() as f64 / stats.lookups.len() as f64;
            let hit = Dist::empirical(stats.hit_ms.iter().copied()).map(|d| d.quantile(0.5));
            let miss = match (
                Dist::empirical(stats.miss_known_ms.iter().copied()),
                Dist::kaplan_meier(stats.remote_after_miss.iter().copied(), Some(horizon)),
            ) {
                (Some(k), Some(x)) if x.quantile(0.5) < horizon => Some(k.quantile(0.5) + x.quantile(0.5)),
                _ => None,
            };
            match (hit, miss) {
                (Some(h), Some(m)) => p * h + (1.0 - p) * m,
                (Some(h), None) if p >= 1.0 => h,
                (None, Some(m)) if p <= 0.0 => m,
                _ => return None,
            }
        }
    };
    Some(Duration::from_secs_f64(est_ms / 1000.0))
}

impl RaceStats {
    /// Count one finished race. `history` is the shape's delay history, used
    /// only for the time-saved estimate. Unfinished reports are ignored.
    pub fn record(&mut self, shape: &str, report: &RaceReport, history: Option<&ShapeStats>, config: &DelayConfig) {
        let (Some(outcome), Some(start), Some(end)) = (&report.outcome, report.started_at, report.finished_at) else {
            return;
        };
        let s = self.shapes.entry(shape.to_string()).or_default();
        s.runs += 1;
        s.wall_ms += ms(end.saturating_sub(start));
        match (&outcome.result, outcome.winner) {
            (RunResult::Completed { from_cache, .. }, Some(w)) => {
                match w {
                    Branch::Local => s.local_wins += 1,
                    Branch::Remote => s.remote_wins += 1,
                }
                if *from_cache {
                    s.cache_hits += 1;
                }
                let times = match w {
                    Branch::Local => &report.local,
                    Branch::Remote => &report.remote,
                };
                let est = history.and_then(|h| estimate_standalone(h, w.other(), config));
                match (est, times.ready_at) {
                    (Some(est), Some(ready)) => s.saved_ms += ms(est.saturating_sub(ready.saturating_sub(start))),
                    _ => s.saved_unknown += 1,
                }
            }
            (RunResult::BranchFailed { .. } | RunResult::OutputsWriteFailed { .. }, _) => s.failures += 1,
            _ => s.other += 1,
        }
    }

    /// Sum over all shapes.
    pub fn total(&self) -> ShapeRaceStats {
        let mut t = ShapeRaceStats::default();
        for s in self.shapes.values() {
            t.runs += s.runs;
            t.local_wins += s.local_wins;
            t.remote_wins += s.remote_wins;
            t.cache_hits += s.cache_hits;
            t.failures += s.failures;
            t.other += s.other;
            t.saved_ms += s.saved_ms;
            t.saved_unknown += s.saved_unknown;
            t.wall_ms += s.wall_ms;
        }
        t
    }
}

fn row(f: &mut fmt::Formatter<'_>, name: &str, s: &ShapeRaceStats, width: usize) -> fmt::Result {
    writeln!(
        f,
        "{name:<width$}  {:>5}  {:>5}  {:>6}  {:>5}  {:>6}  {:>5}  {:>9.1}  {:>9.1}  {:>6}",
        s.runs,
        s.local_wins,
        s.remote_wins,
        s.cache_hits,
        s.failures,
        s.other,
        s.wall_ms as f64 / 1000.0,
        s.saved_ms as f64 / 1000.0,
        s.saved_unknown,
    )
}

impl fmt::Display for RaceStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self.shapes.keys().map(|k| k.len()).max().unwrap_or(0).max(5);
        writeln!(
            f,
            "{:<width$}  {:>5}  {:>5}  {:>6}  {:>5}  {:>6}  {:>5}  {:>9}  {:>9}  {:>6}",
            "shape", "runs", "local", "remote", "cache", "failed", "other", "wall s", "saved s", "no est"
        )?;
        for (name, s) in &self.shapes {
            row(f, name, s, width)?;
        }
        row(f, "total", &self.total(), width)
    }
}
