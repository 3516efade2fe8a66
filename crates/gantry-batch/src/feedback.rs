//! Learning from the builds the planner cut, between two trainings.
//!
//! The models are trained on history and centred on held-out history builds. The
//! batches the planner cuts are not like those builds: they are as large as the cutoff
//! allows, and a stream covers code the history rarely built together. Measured on the
//! simulated workloads, the models under-read such batches by 4–16% (median, per
//! stream and tool) and their spread is about twice the held-out one, so a margin
//! taken from history alone promises far fewer OOMs than happen.
//!
//! [`Feedback`] keeps, per tool, the log error `ln(actual / estimate)` of the last
//! finished builds against the models that are loaded, and [`Corrected`] is the
//! estimator decorator that uses it: once a tool has [`MIN_OBSERVATIONS`] builds, its
//! memory estimates are scaled by the median error, and the margin takes the wider of
//! the model's held-out error and the spread of the recent builds around that median
//! (read from the side label noise cannot reach, as for the held-out one) once it has
//! the 30 builds an error model needs. An OOM build's label is the heap it died in, a
//! lower bound, counted when it is above the estimate. A retraining replaces the
//! models, and with them what the errors were measured against: feedback starts over.

use std::collections::{BTreeMap, VecDeque};

use crate::label::Label;
use crate::margin::{ErrorModel, TrustedSide};
use crate::planner::{Estimator, GroupEstimator};
use crate::types::BuildContext;
use crate::Result;

/// Builds a tool needs before its estimates are corrected: fewer would let one odd
/// build move every later estimate.
pub const MIN_OBSERVATIONS: usize = 10;
/// Builds per tool kept: recent enough to follow a shift, enough for a median.
pub const WINDOW: usize = 200;
/// The correction is kept within these log bounds (×0.74 to ×4). Down, because a
/// smaller estimate is the risky direction; up, only against absurd labels, since an
/// upward correction that stopped short would leave a bias the margin does not know of.
const MAX_DOWN: f64 = -0.3;
const MAX_UP: f64 = std::f64::consts::LN_2 * 2.0;

/// Recent memory errors per tool tag.
#[derive(Debug, Clone, Default)]
pub struct Feedback {
    by_tool: BTreeMap<String, VecDeque<f64>>,
}

/// What the recent builds of one tool say about the memory estimates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Correction {
    /// Median `ln(actual / estimate)`: the estimate is multiplied by its exponential.
    pub log_bias: f64,
    /// The spread around that median, once there are enough builds for it.
    pub error: Option<ErrorModel>,
    pub observations: usize,
}

impl Feedback {
    pub fn new() -> Feedback {
        Feedback::default()
    }

    /// A finished build of `tool`: the models' memory estimate for exactly its targets
    /// and what it used; for an OOM build (`oom`), the heap it ran out of. That is a
    /// lower bound, which says the models under-read only when it is above their
    /// estimate: an OOM of a build estimated over the heap anyway (one target over the
    /// cutoff) says nothing about them and is not counted. Ignored when either number
    /// is not positive.
    pub fn observe(&mut self, tool: &str, estimate: f64, actual: f64, oom: bool) {
        if !(estimate > 0.0 && actual > 0.0 && estimate.is_finite() && actual.is_finite()) {
            return;
        }
        if oom && actual <= estimate {
            return;
        }
        let q = self.by_tool.entry(tool.to_string()).or_default();
        if q.len() == WINDOW {
            q.pop_front();
        }
        q.push_back((actual / estimate).ln());
    }

    /// The correction for `tool`, once it has [`MIN_OBSERVATIONS`] builds.
    pub fn correction(&self, tool: &str) -> Option<Correction> {
        let q = self.by_tool.get(tool).filter(|q| q.len() >= MIN_OBSERVATIONS)?;
        let mut v: Vec<f64> = q.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        let median = v[(v.len() - 1) / 2];
        let centred: Vec<f64> = v.iter().map(|x| x - median).collect();
        Some(Correction {
            log_bias: median.clamp(MAX_DOWN, MAX_UP),
            error: ErrorModel::fit(&centred, TrustedSide::Lower),
            observations: v.len(),
        })
    }

    /// Builds observed for `tool`.
    pub fn observations(&self, tool: &str) -> usize {
        self.by_tool.get(tool).map_or(0, VecDeque::len)
    }
}

/// An [`Estimator`] whose memory estimates and margin are corrected by [`Feedback`].
/// `inner` is any pointer to the models (`&Models`, `Arc<Models>`).
pub struct Corrected<M> {
    pub inner: M,
    pub feedback: Feedback,
}

/// The group of a [`Corrected`] estimator.
pub struct CorrectedGroup<G> {
    inner: G,
    factor: f64,
    error: Option<ErrorModel>,
}

impl<M> Estimator for Corrected<M>
where
    M: std::ops::Deref,
    M::Target: Estimator,
{
    type Group<'a>
        = CorrectedGroup<<M::Target as Estimator>::Group<'a>>
    where
        Self: 'a;

    fn group<'a>(&'a self, ctx: &BuildContext) -> Self::Group<'a> {
        let c = self.feedback.correction(&ctx.tool_tag);
        CorrectedGroup {
            inner: self.inner.group(ctx),
            factor: c.map_or(1.0, |c| c.log_bias.exp()),
            error: c.and_then(|c| c.error),
        }
    }
}

impl<G: GroupEstimator> GroupEstimator for CorrectedGroup<G> {
    fn push(&mut self, label: &Label<'_>) {
        self.inner.push(label);
    }

    fn pop_front(&mut self, n: usize) {
        self.inner.pop_front(n);
    }

    fn memory_bytes(&mut self, len: usize) -> Result<f64> {
        // A positive constant factor keeps the estimate monotone in `len`.
        Ok(self.inner.memory_bytes(len)? * self.factor)
    }

    fn occupancy_esu(&mut self, len: usize) -> Result<f64> {
        self.inner.occupancy_esu(len)
    }

    fn errors(&self) -> (Option<ErrorModel>, Option<ErrorModel>) {
        let (memory, occupancy) = self.inner.errors();
        (ErrorModel::wider(memory, self.error), occupancy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_correction_before_enough_builds_then_the_median() {
        let mut f = Feedback::new();
        for _ in 0..MIN_OBSERVATIONS - 1 {
            f.observe("coverage", 10.0, 13.0, false);
        }
        assert_eq!(f.correction("coverage"), None);
        f.observe("coverage", 10.0, 13.0, false);
        let c = f.correction("coverage").unwrap();
        assert!((c.log_bias - 1.3f64.ln()).abs() < 1e-12, "{c:?}");
        assert_eq!(f.correction("postsubmit"), None, "per tool");
        // Nonsense is ignored, as is an OOM under its estimate; the window keeps the newest.
        f.observe("coverage", 0.0, 5.0, false);
        f.observe("coverage", f64::NAN, 5.0, false);
        f.observe("coverage", 20.0, 13.0, true);
        assert_eq!(f.observations("coverage"), MIN_OBSERVATIONS);
        for _ in 0..WINDOW {
            f.observe("coverage", 10.0, 9.0, false);
        }
        assert_eq!(f.observations("coverage"), WINDOW);
        assert!((f.correction("coverage").unwrap().log_bias - 0.9f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn the_correction_is_bounded_and_the_spread_read_below_the_median() {
        let mut up = Feedback::new();
        let mut down = Feedback::new();
        for _ in 0..20 {
            up.observe("t", 1.0, 5.0, false);
            down.observe("t", 1.0, 0.5, false);
        }
        assert_eq!(up.correction("t").unwrap().log_bias, MAX_UP);
        assert_eq!(down.correction("t").unwrap().log_bias, MAX_DOWN);
        // One build in ten reads 3x high (no full GC ran): the median barely moves and
        // the spread, read below it, not at all.
        let mut f = Feedback::new();
        for i in 0..100 {
            let noise = [-0.08, -0.04, 0.0, 0.04, 0.08][i % 5];
            let actual = if i % 10 == 9 { 30.0 } else { 10.0 * f64::exp(0.1 + noise) };
            f.observe("t", 10.0, actual, false);
        }
        let c = f.correction("t").unwrap();
        assert!((c.log_bias - 0.1).abs() < 0.05, "{c:?}");
        let e = c.error.expect("100 builds give a spread");
        assert!(e.sigma < 0.1, "the high labels do not widen it: {e:?}");
    }
}
