//! The submit queue's Prometheus metrics, served on `gantry serve`'s `/metrics`.
//!
//! They are refreshed from the queue's state after each of its updates, not counted
//! where things happen: the planner's counters and the documents are rebuilt from the
//! journal and the database at every start, so the figures cover the queue's whole life
//! and survive restarts. Only the infrastructure retries are counted as they happen
//! (since this start): nothing durable records them.

use std::collections::HashSet;

use gantry_queue::{FlakyTarget, PlannerStats};
use prometheus::{HistogramOpts, HistogramVec, IntCounter, IntGauge, IntGaugeVec, Opts, Registry};

use crate::error::SubmitError;
use crate::service::{ChangeDoc, ChangeState};

pub struct QueueMetrics {
    changes: IntGaugeVec,
    running_builds: IntGauge,
    builds_started: IntCounter,
    builds_cancelled: IntCounter,
    builds_preempted: IntCounter,
    landing_failures: IntCounter,
    pub(crate) infra_retries: IntCounter,
    batches: IntCounter,
    batch_landed: IntCounter,
    bisection_builds: IntCounter,
    flaky_retries: IntCounter,
    flaky_targets: IntGaugeVec,
    turnaround: HistogramVec,
    /// Decided changes already in the histogram.
    observed: std::sync::Mutex<HashSet<String>>,
}

impl QueueMetrics {
    pub fn new(registry: &Registry) -> Result<QueueMetrics, SubmitError> {
        let counter = |name: &str, help: &str| IntCounter::new(name, help);
        let m = QueueMetrics {
            changes: IntGaugeVec::new(
                Opts::new("gantry_queue_changes", "Submit queue changes by state (SUBMITTED: waiting for analysis)"),
                &["state"],
            )?,
            running_builds: IntGauge::new("gantry_queue_running_builds", "Submit queue builds running now")?,
            builds_started: counter("gantry_queue_builds_started_total", "Submit queue builds started (retries included)")?,
            builds_cancelled: counter(
                "gantry_queue_builds_cancelled_total",
                "Submit queue builds cancelled: their assumptions became impossible, or preempted",
            )?,
            builds_preempted: counter(
                "gantry_queue_builds_preempted_total",
                "Submit queue builds cancelled to make room for more valuable ones",
            )?,
            landing_failures: counter(
                "gantry_queue_landing_failures_total",
                "Changes that passed their build but the mainline did not move (combined-tree check failed, or the branch moved outside the queue)",
            )?,
            infra_retries: counter(
                "gantry_queue_infra_retries_total",
                "Build steps tried again after an infrastructure error, since gantry started",
            )?,
            batches: counter("gantry_queue_batches_total", "Batches landed: several changes in one mainline move")?,
            batch_landed: counter("gantry_queue_batch_landed_total", "Changes landed by batches")?,
            bisection_builds: counter(
                "gantry_queue_bisection_builds_total",
                "Builds of a half (a quarter, ...) of a failed batch: the bisections",
            )?,
            flaky_retries: counter(
                "gantry_queue_flaky_retries_total",
                "Failed batch trees tried again whole, not bisected, because every failing target is known flaky",
            )?,
            flaky_targets: IntGaugeVec::new(
                Opts::new(
                    "gantry_queue_flaky_target_failures",
                    "Failures of a target that passed on the same tree in another build (the most flaky targets)",
                ),
                &["target"],
            )?,
            turnaround: HistogramVec::new(
                HistogramOpts::new("gantry_queue_turnaround_seconds", "Submit queue time from submission to decision, by decision")
                    .buckets(vec![5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0]),
                &["state"],
            )?,
            observed: Default::default(),
        };
        registry.register(Box::new(m.changes.clone()))?;
        registry.register(Box::new(m.running_builds.clone()))?;
        registry.register(Box::new(m.builds_started.clone()))?;
        registry.register(Box::new(m.builds_cancelled.clone()))?;
        registry.register(Box::new(m.builds_preempted.clone()))?;
        registry.register(Box::new(m.landing_failures.clone()))?;
        registry.register(Box::new(m.infra_retries.clone()))?;
        registry.register(Box::new(m.batches.clone()))?;
        registry.register(Box::new(m.batch_landed.clone()))?;
        registry.register(Box::new(m.bisection_builds.clone()))?;
        registry.register(Box::new(m.flaky_retries.clone()))?;
        registry.register(Box::new(m.flaky_targets.clone()))?;
        registry.register(Box::new(m.turnaround.clone()))?;
        Ok(m)
    }

    /// Sets every figure from the queue's state: its planner's counters, the builds
    /// running, the failed landings and the change documents.
    pub(crate) fn refresh<'a>(
        &self,
        stats: &PlannerStats,
        flaky: &[FlakyTarget],
        running_builds: usize,
        landing_failures: u64,
        changes: impl IntoIterator<Item = &'a ChangeDoc>,
    ) {
        let mut by_state = [0i64; ChangeState::ALL.len()];
        let mut observed = self.observed.lock().expect("not poisoned");
        let mut decided_now = HashSet::new();
        for doc in changes {
            by_state[ChangeState::ALL.iter().position(|&st| st == doc.state).expect("every state is listed")] += 1;
            if let (true, Some(decided)) = (doc.state.decided(), doc.decided_ms) {
                decided_now.insert(doc.id.as_str());
                if observed.insert(doc.id.clone()) {
                    let seconds = (decided - doc.submitted_ms).max(0) as f64 / 1000.0;
                    self.turnaround.with_label_values(&[doc.state.as_str()]).observe(seconds);
                }
            }
        }
        // Changes retention deleted are not seen again: forget them here too.
        observed.retain(|id| decided_now.contains(id.as_str()));
        for (state, n) in ChangeState::ALL.iter().zip(by_state) {
            self.changes.with_label_values(&[state.as_str()]).set(n);
        }
        self.running_builds.set(running_builds as i64);
        advance(&self.builds_started, stats.builds_started);
        advance(&self.builds_cancelled, stats.builds_cancelled);
        advance(&self.builds_preempted, stats.builds_preempted);
        advance(&self.landing_failures, landing_failures);
        advance(&self.batches, stats.batches);
        advance(&self.batch_landed, stats.batch_landed);
        advance(&self.bisection_builds, stats.bisection_builds);
        advance(&self.flaky_retries, stats.flaky_retries);
        // One series per target, so only the most flaky few.
        for f in flaky.iter().take(MAX_FLAKY_SERIES) {
            self.flaky_targets.with_label_values(&[f.target.as_str()]).set(i64::from(f.flaky));
        }
    }
}

/// Flaky targets exported as series; the rest are in `gantry queue status`.
const MAX_FLAKY_SERIES: usize = 50;

/// Raises a counter to a total kept elsewhere (a counter only goes up).
fn advance(c: &IntCounter, total: u64) {
    let now = c.get();
    if total > now {
        c.inc_by(total - now);
    }
}
