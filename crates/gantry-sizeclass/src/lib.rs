//! `gantry-sizeclass`: automatic worker size class selection for gantry's
//! scheduler, after Buildbarn ADR #7 and past its future work: hedging on
//! the largest class instead of killing, learning across classes, priors
//! from similar shapes, queue-aware choice, and a replay simulator.
//!
//! Pure logic: no I/O, clocks, gRPC or databases. The caller computes the
//! action-shape key (a reduced action digest), loads and stores
//! [`ActionStats`] (JSON via [`ActionStats::to_json`]), passes the current
//! time and a random draw, and enforces decisions.
//!
//! Typical use by the scheduler:
//! 1. `let d = select(&cfg, &SelectionInput { stats, prior, classes, requested_timeout, queues, draw, now })?;`
//!    run on `d.size_class` with `d.timeout`; if still unfinished `d.hedge_after`
//!    after queueing, start a copy on the largest class; the first to finish wins.
//! 2. On a failure with no hedge running, `retry_on_largest(class, outcome, classes, requested_timeout)`;
//!    if it returns a [`Retry`], run again there. A cancelled hedge loser is
//!    reported as `TimedOut(how long it ran)`.
//! 3. When the final result is known, `record(&mut stats, &cfg, largest, &Execution { .. }, now)?`
//!    and persist `stats`.
//!
//! Module map:
//! * [`types`]: [`SizeClass`], [`SizeClasses`], [`Timestamp`].
//! * [`config`]: [`SelectionConfig`] and its defaults.
//! * [`stats`]: [`Outcome`], [`ActionStats`] and the persisted JSON form.
//! * [`mod@select`]: the selection function and [`Decision`].
//! * [`retry`]: retry policy and the outcome attribution rule ([`record`]).
//! * [`metrics`]: counters and the per-key history view.
//! * [`sim`]: discrete-event replay simulator and benchmark.
//! * [`error`]: the crate's [`Error`].

pub mod config;
pub mod error;
pub mod metrics;
pub mod retry;
pub mod select;
pub mod sim;
pub mod stats;
pub mod types;

pub use config::SelectionConfig;

/// Prefix of the statistics store's keys that hold a group's prior (a family of similar
/// shapes), beside the shapes' own statistics, whose keys are hex digests. Whoever lists
/// the store's shapes skips these.
pub const GROUP_KEY_PREFIX: &str = "group:";
pub use error::Error;
pub use metrics::{ClassHistoryView, KeyStatsView, SelectionMetrics};
pub use retry::{record, retry_on_largest, Attribution, Execution, RecordSummary, Retry};
pub use select::{
    acceptable_time, best_class, estimates, fit_probabilities, select, smoothed_probability, speedup_curve, Basis,
    ClassEstimate, ClassQueue, Decision, Prior, QueueState, Reason, SelectionInput, PRIOR_MIN_SHAPES,
};
pub use stats::{ActionStats, Outcome, STATS_FORMAT_VERSION};
pub use types::{SizeClass, SizeClasses, Timestamp};
