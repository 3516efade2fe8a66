//! The memory and occupancy regression models (design section IV).
//!
//! Owns training (MSE + L1 by normalised SGD with a proximal step and a
//! non-negativity projection on target-related slots), the feature-cross
//! search, residual calibration, the two-window [`MemoryEstimator`], the
//! [`Models`] bundle and its on-disk format.
//!
//! Why linear in raw space: a build's cost is close to a sum over the
//! distinct things it pulls in (targets, packages, directory subtrees), which
//! is exactly a linear model over set-valued features; and a linear model
//! lets the planner evaluate every prefix of a window with prefix sums.
//! Labels are divided by their training mean so SGD sees values near 1.

use crate::error::{BatchError, Result};
use crate::features::{BuildTargetValues, Cross, FeatureSpec};
use crate::history::{window, BuildRecord, Timestamp};
use crate::label::{parse_label, Label};
use crate::shared::{SharedConfig, SharedModel};
use crate::types::BuildContext;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// What a model predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// Peak post-GC heap of the Bazel process, bytes.
    MemoryBytes,
    /// Average executor occupancy, ESU.
    OccupancyEsu,
}

/// Training hyper-parameters. Defaults are what the simulation was tuned with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainConfig {
    /// Slot space is `2^hash_bits` (half of it for target-related features).
    pub hash_bits: u32,
    pub long_window_days: f64,
    pub short_window_days: f64,
    pub epochs: usize,
    /// Normalised-LMS step (stable below 2; decays per epoch).
    pub learning_rate: f64,
    /// L1 strength on scaled labels.
    pub l1: f64,
    /// Number of quantile boundaries for each count family.
    pub count_buckets: usize,
    /// Maximum number of feature crosses (design: 6).
    pub max_crosses: usize,
    pub cross_search: bool,
    pub cross_search_epochs: usize,
    /// Subsample size for the brief trainings of the cross search.
    pub cross_search_max_examples: usize,
    /// A cross must cut validation MSE by at least this fraction to be kept.
    pub cross_min_improvement: f64,
    /// After round one, only this many best candidates are re-tried.
    pub cross_beam: usize,
    /// Fraction of each window held out for cross search and calibration.
    pub validation_fraction: f64,
    /// The loss: `squared` (default) is plain least squares; `huber` caps
    /// each example's pull at `huber_delta` times its label, so the few
    /// builds whose labels are far off (a peak without a full GC, an
    /// occupancy served from the action cache) cannot drag the fit. Measured
    /// on the simulated workloads, the cap also slows SGD on the large builds
    /// so much that they are under-fitted (see README), so it is not the
    /// default: robustness to one-sided noise comes from the median
    /// calibration and the one-sided error fit instead.
    pub loss: Loss,
    pub huber_delta: f64,
    /// How the output is scaled after fitting: `median` (default) centres it
    /// on held-out builds and leaves safety to the planner's calibrated
    /// margin; `quantile` multiplies by the `calibration_quantile` of
    /// actual/predicted, a fixed safety factor (the first version's way).
    pub calibration: Calibration,
    /// Residual quantile used as the safety factor when `calibration = quantile`.
    pub calibration_quantile: f64,
    /// The shape of each tool's centring curve (`calibration = median`):
    /// `power` (default) fits `factor × x^power` through the held-out
    /// (prediction, label) pairs in log space; `line` fits `factor × x +
    /// offset`. A fitted linear model under-reads large builds by more than
    /// small ones (its many small target weights are shrunk towards the bias,
    /// and flags such as coverage multiply every cost), so its error grows
    /// with the build. Held-out builds are mostly small, while the planner
    /// cuts batches at the cutoff: a line through the small ones extrapolates
    /// that growth away, a power keeps it (README, "Centring").
    pub centring: Centring,
    /// Learning-rate scale of the crosses between a build-level family and
    /// a target (`ProductArea x Package`): below 1, the base features learn
    /// the costs the contexts share and the crosses only what differs. At 1
    /// (default) a cross that merely repeats its target takes half of its
    /// weight, which a build mixing product areas then gets from the cross's
    /// unseen prior instead. Measured: 0.1 did not help reliably (README).
    pub cross_rate: f64,
    /// A target, package or directory that no training build had gets the
    /// mean weight of its family instead of nothing: new code is charged
    /// like typical code, not as free.
    pub unseen_prior: bool,
    /// Only validation builds whose prediction is at least this many bytes
    /// are used for memory calibration (small builds never OOM).
    pub calibration_min_memory_bytes: f64,
    /// Same for occupancy, in ESU.
    pub calibration_min_occupancy_esu: f64,
    /// Fewer builds than this in the short window: no short model.
    pub min_short_window_builds: usize,
    pub seed: u64,
    /// Which learner the planner uses: `shared` (default) trains the shared-cost
    /// model ([`crate::shared`]) beside the linear ones and plans with it; `linear`
    /// plans with the linear models alone, as before it existed.
    pub learner: Learner,
    /// Settings of the shared-cost learner.
    pub shared: SharedConfig,
}

/// See [`TrainConfig::learner`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Learner {
    Linear,
    #[default]
    Shared,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            hash_bits: 20,
            long_window_days: 17.0,
            short_window_days: 1.0,
            epochs: 10,
            learning_rate: 0.6,
            l1: 1e-7,
            count_buckets: 16,
            max_crosses: 6,
            cross_search: true,
            cross_search_epochs: 3,
            cross_search_max_examples: 4000,
            cross_min_improvement: 0.01,
            cross_beam: 10,
            validation_fraction: 0.1,
            loss: Loss::Squared,
            huber_delta: 0.1,
            calibration: Calibration::Median,
            calibration_quantile: 0.95,
            centring: Centring::Power,
            unseen_prior: true,
            cross_rate: 1.0,
            calibration_min_memory_bytes: 2e9,
            calibration_min_occupancy_esu: 50.0,
            min_short_window_builds: 50,
            seed: 0x9a27_7e5b,
            learner: Learner::default(),
            shared: SharedConfig::default(),
        }
    }
}

impl TrainConfig {
    fn huber(&self) -> Option<f64> {
        (self.loss == Loss::Huber).then_some(self.huber_delta)
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(BatchError::InvalidConfig(m.to_string()));
        if !(4..=26).contains(&self.hash_bits) {
            return bad("hash_bits must be in 4..=26");
        }
        if self.long_window_days <= 0.0 || self.short_window_days <= 0.0 {
            return bad("window lengths must be positive");
        }
        if !(self.learning_rate > 0.0 && self.learning_rate < 2.0) {
            return bad("learning_rate must be in (0, 2) for normalised SGD");
        }
        if self.l1 < 0.0 {
            return bad("l1 must be >= 0");
        }
        if !(0.0..0.9).contains(&self.validation_fraction) {
            return bad("validation_fraction must be in [0, 0.9)");
        }
        if !(0.5..=1.0).contains(&self.calibration_quantile) {
            return bad("calibration_quantile must be in [0.5, 1]");
        }
        if self.max_crosses > 6 {
            return bad("max_crosses is at most 6");
        }
        if self.huber_delta.is_nan() || self.huber_delta <= 0.0 {
            return bad("huber_delta must be > 0");
        }
        if !(self.shared.prior_count.is_finite() && self.shared.prior_count >= 0.0) {
            return bad("shared.prior_count must be a finite number >= 0");
        }
        if !(self.shared.package_prior.is_finite() && self.shared.package_prior >= 0.0) {
            return bad("shared.package_prior must be a finite number >= 0");
        }
        Ok(())
    }
}

/// Training loss (see [`TrainConfig::loss`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Loss {
    Squared,
    Huber,
}

/// Output scaling (see [`TrainConfig::calibration`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Calibration {
    Quantile,
    Median,
}

/// The centring curve of [`TrainConfig::centring`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Centring {
    Line,
    Power,
}

/// How a context's raw score becomes the model's output:
/// `factor × x^power + offset` for `x` the raw score in the label's unit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Centre {
    pub factor: f64,
    pub offset: f64,
    pub power: f64,
}

impl Centre {
    /// `tool`'s curve if it has a factor, else `global` alone.
    fn of(
        tool: &str,
        global: f64,
        factors: &BTreeMap<String, f64>,
        offsets: &BTreeMap<String, f64>,
        powers: &BTreeMap<String, f64>,
    ) -> Centre {
        match factors.get(tool) {
            Some(&factor) => Centre {
                factor,
                offset: offsets.get(tool).copied().unwrap_or(0.0),
                power: powers.get(tool).copied().unwrap_or(1.0),
            },
            None => Centre { factor: global, offset: 0.0, power: 1.0 },
        }
    }

    #[inline]
    fn apply(&self, x: f64) -> f64 {
        let scaled = if self.power == 1.0 { x } else { x.powf(self.power) };
        self.factor * scaled + self.offset
    }
}

/// What a model charges for target-level values it never saw in training.
#[derive(Debug, Clone, PartialEq)]
pub struct UnseenPrior {
    /// Per target family (label, package, prefix): the mean trained weight.
    pub prior: [f64; 3],
    /// Per cross of the spec: the mean trained weight of its target-level
    /// slots (0 for build-level crosses). A build-level value crossed with a
    /// target it never met (a package built under a new product area, or by
    /// another command) would otherwise count for nothing.
    pub cross_prior: Vec<f64>,
    /// Bitset of the slots any training example had.
    seen: Vec<u64>,
}

impl UnseenPrior {
    #[inline]
    pub fn is_seen(&self, slot: u32) -> bool {
        self.seen.get(slot as usize / 64).is_some_and(|w| w >> (slot % 64) & 1 == 1)
    }

    fn seen_slots(&self) -> Vec<u32> {
        let mut out = Vec::new();
        for (i, &w) in self.seen.iter().enumerate() {
            let mut w = w;
            while w != 0 {
                let b = w.trailing_zeros();
                out.push(i as u32 * 64 + b);
                w &= w - 1;
            }
        }
        out
    }

    fn from_slots(
        slots: &[u32],
        prior: [f64; 3],
        cross_prior: Vec<f64>,
        total: usize,
    ) -> std::result::Result<Self, String> {
        let mut seen = vec![0u64; total.div_ceil(64)];
        for &s in slots {
            if s as usize >= total {
                return Err(format!("seen slot {s} outside the slot space"));
            }
            seen[s as usize / 64] |= 1 << (s % 64);
        }
        if prior.iter().chain(&cross_prior).any(|p| !(p.is_finite() && *p >= 0.0)) {
            return Err("unseen priors must be finite and non-negative".into());
        }
        Ok(UnseenPrior { prior, cross_prior, seen })
    }
}

/// A trained linear model over hashed features.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "PersistedModel", into = "PersistedModel")]
pub struct LinearModel {
    pub kind: ModelKind,
    pub spec: FeatureSpec,
    pub bias: f64,
    weights: Vec<f64>,
    /// Labels were divided by this before training.
    pub label_scale: f64,
    /// Multiplicative safety factor (>= 1) learned from validation
    /// residuals: the `calibration_quantile` of actual/predicted over
    /// held-out builds large enough to matter. A positive constant factor
    /// keeps the model monotone.
    pub calibration: f64,
    /// Per-tool-tag safety factors, used instead of `calibration` for
    /// contexts with that tool tag. Tools change costs multiplicatively
    /// (e.g. `--runs_per_test=5` from a flaky-test detector), which an
    /// additive model under-predicts for exactly that tool; a per-tool
    /// quantile corrects it while staying a positive constant per context.
    pub tool_calibration: BTreeMap<String, f64>,
    /// Per-tool offsets added after the factor (`Calibration::Median`): the
    /// output is `factor × raw + offset`, a line fitted to the tool's
    /// held-out builds. A flag that multiplies every cost (coverage) makes an
    /// additive model's error grow with the build; a constant factor centred
    /// on typical builds then still under-reads the large ones the planner
    /// cuts at the cutoff.
    pub tool_offset: BTreeMap<String, f64>,
    /// Per-tool powers (`Centring::Power`): the output is `factor × raw^power`
    /// (plus the tool's offset, none in that mode). A power above 1 makes the
    /// output grow faster than the raw score, which is how the held-out
    /// builds say the model under-reads the large ones.
    pub tool_power: BTreeMap<String, f64>,
    /// Held-out error of the calibrated output: the planner's margin.
    pub error: Option<crate::margin::ErrorModel>,
    pub unseen: Option<UnseenPrior>,
    pub window_days: f64,
    pub trained_examples: usize,
}

#[derive(Serialize, Deserialize)]
struct PersistedModel {
    format: u32,
    kind: ModelKind,
    spec: FeatureSpec,
    bias: f64,
    label_scale: f64,
    calibration: f64,
    #[serde(default)]
    tool_calibration: BTreeMap<String, f64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    tool_offset: BTreeMap<String, f64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    tool_power: BTreeMap<String, f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<crate::margin::ErrorModel>,
    /// Priors for unseen label, package and prefix values, and the seen slots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    unseen_prior: Option<[f64; 3]>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    unseen_cross_prior: Vec<f64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    seen_slots: Vec<u32>,
    window_days: f64,
    trained_examples: usize,
    /// Non-zero weights only: `[slot, weight]`.
    weights: Vec<(u32, f64)>,
}

/// The format written. Format 2 added per-tool powers (`tool_power`): a binary that
/// knows only format 1 would drop them and apply a power curve's factor as a straight
/// line's, so it must refuse these files rather than misread them.
const MODEL_FORMAT: u32 = 2;
/// Formats read: a format-1 model is a format-2 model with every power 1.
const READABLE_FORMATS: std::ops::RangeInclusive<u32> = 1..=MODEL_FORMAT;

impl From<LinearModel> for PersistedModel {
    fn from(m: LinearModel) -> Self {
        PersistedModel {
            format: MODEL_FORMAT,
            kind: m.kind,
            bias: m.bias,
            label_scale: m.label_scale,
            calibration: m.calibration,
            tool_calibration: m.tool_calibration,
            tool_offset: m.tool_offset,
            tool_power: m.tool_power,
            error: m.error,
            unseen_prior: m.unseen.as_ref().map(|u| u.prior),
            unseen_cross_prior: m.unseen.as_ref().map(|u| u.cross_prior.clone()).unwrap_or_default(),
            seen_slots: m.unseen.as_ref().map(|u| u.seen_slots()).unwrap_or_default(),
            window_days: m.window_days,
            trained_examples: m.trained_examples,
            weights: m.weights.iter().enumerate().filter(|(_, w)| **w != 0.0).map(|(i, &w)| (i as u32, w)).collect(),
            spec: m.spec,
        }
    }
}

impl TryFrom<PersistedModel> for LinearModel {
    type Error = String;
    fn try_from(p: PersistedModel) -> std::result::Result<Self, String> {
        if !READABLE_FORMATS.contains(&p.format) {
            return Err(format!("unsupported model format {}", p.format));
        }
        if !(4..=26).contains(&p.spec.hash_bits) {
            return Err(format!("hash_bits {} out of range", p.spec.hash_bits));
        }
        let mut weights = vec![0.0; p.spec.slots()];
        for (slot, w) in p.weights {
            let s = slot as usize;
            if s >= weights.len() {
                return Err(format!("weight slot {slot} outside 2^{}", p.spec.hash_bits));
            }
            weights[s] = w;
        }
        LinearModel::from_parts(p.kind, p.spec, p.bias, weights, p.label_scale, p.calibration)
            .and_then(|mut m| {
                if p.tool_calibration.values().any(|&c| c.is_nan() || c <= 0.0) {
                    return Err(BatchError::InvalidConfig("tool calibration must be positive".into()));
                }
                m.tool_calibration = p.tool_calibration;
                if p.tool_offset.values().any(|o| !o.is_finite()) {
                    return Err(BatchError::InvalidConfig("tool offsets must be finite".into()));
                }
                m.tool_offset = p.tool_offset;
                if p.tool_power.values().any(|&b| !(b.is_finite() && b > 0.0)) {
                    return Err(BatchError::InvalidConfig("tool powers must be positive".into()));
                }
                m.tool_power = p.tool_power;
                if p.error.is_some_and(|e| !(e.sigma.is_finite() && e.sigma > 0.0)) {
                    return Err(BatchError::InvalidConfig("error sigma must be positive".into()));
                }
                m.error = p.error;
                m.unseen = match p.unseen_prior {
                    Some(prior) => Some(
                        UnseenPrior::from_slots(&p.seen_slots, prior, p.unseen_cross_prior, m.spec.slots())
                            .map_err(BatchError::InvalidConfig)?,
                    ),
                    None => None,
                };
                m.window_days = p.window_days;
                m.trained_examples = p.trained_examples;
                Ok(m)
            })
            .map_err(|e| e.to_string())
    }
}

impl LinearModel {
    /// Build a model from explicit weights (tests, hand-made models). Fails
    /// if a target-related slot is negative, since that would break the
    /// monotonicity the planner's binary search relies on.
    pub fn from_parts(
        kind: ModelKind,
        spec: FeatureSpec,
        bias: f64,
        weights: Vec<f64>,
        label_scale: f64,
        calibration: f64,
    ) -> Result<Self> {
        if weights.len() != spec.slots() {
            return Err(BatchError::InvalidConfig(format!("expected {} weights, got {}", spec.slots(), weights.len())));
        }
        if let Some(i) = weights[spec.nonneg_start()..].iter().position(|&w| w < 0.0) {
            return Err(BatchError::InvalidConfig(format!(
                "target-related slot {} has a negative weight",
                spec.nonneg_start() + i
            )));
        }
        if label_scale.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
            || calibration.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
        {
            return Err(BatchError::InvalidConfig("label_scale and calibration must be positive".into()));
        }
        Ok(LinearModel {
            kind,
            spec,
            bias,
            weights,
            label_scale,
            calibration,
            tool_calibration: BTreeMap::new(),
            tool_offset: BTreeMap::new(),
            tool_power: BTreeMap::new(),
            error: None,
            unseen: None,
            window_days: 0.0,
            trained_examples: 0,
        })
    }

    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    #[inline]
    pub fn weight(&self, slot: u32) -> f64 {
        self.weights[slot as usize]
    }

    /// Sum of weights of the slots (no bias).
    pub fn sum_slots(&self, slots: &[u32]) -> f64 {
        slots.iter().map(|&s| self.weights[s as usize]).sum()
    }

    /// The centring of a context: its tool's curve if one was learned, else
    /// the global factor (no offset, power 1).
    pub fn calibration_for(&self, ctx: &BuildContext) -> Centre {
        Centre::of(&ctx.tool_tag, self.calibration, &self.tool_calibration, &self.tool_offset, &self.tool_power)
    }

    /// Turn a raw linear score (bias included) into the model's unit, given
    /// the context's centring. Clamping at zero, a positive factor and a
    /// positive power keep it monotone.
    #[inline]
    pub fn output(&self, raw: f64, centre: Centre) -> Result<f64> {
        if !raw.is_finite() {
            return Err(BatchError::Estimate(format!("{:?} model produced a non-finite score", self.kind)));
        }
        Ok(centre.apply(raw.max(0.0) * self.label_scale).max(0.0))
    }

    /// Predict for a build (set semantics over the labels).
    pub fn predict(&self, ctx: &BuildContext, labels: &[&str]) -> Result<f64> {
        with_target_values(labels, |btv| self.predict_values(ctx, btv))
    }

    /// The weight of target family `ti`'s base feature in `slot`: the
    /// family's prior when no training build had the slot.
    #[inline]
    pub fn target_weight(&self, ti: usize, slot: u32) -> f64 {
        match &self.unseen {
            Some(u) if !u.is_seen(slot) => u.prior[ti],
            _ => self.weights[slot as usize],
        }
    }

    /// The weight of cross `ci`'s target-level feature in `slot`: the
    /// cross's prior when no training build had the slot.
    #[inline]
    pub fn cross_weight(&self, ci: usize, slot: u32) -> f64 {
        match &self.unseen {
            Some(u) if !u.is_seen(slot) => u.cross_prior.get(ci).copied().unwrap_or(0.0),
            _ => self.weights[slot as usize],
        }
    }

    /// Predict from pre-extracted target values.
    pub fn predict_values(&self, ctx: &BuildContext, btv: &BuildTargetValues) -> Result<f64> {
        let pieces = self.spec.context_pieces(ctx);
        let slots = self.spec.build_slots(&pieces, btv);
        // An unseen slot's weight is 0 (training never touched it), so adding
        // the prior is the same as `target_weight`.
        let mut priors = 0.0;
        if let Some(u) = &self.unseen {
            for (ti, fam) in crate::features::Family::TARGET.iter().enumerate() {
                if self.spec.has(*fam) {
                    for &v in &btv.values[ti] {
                        let slot = self.spec.slot(crate::features::mix(fam.tag(), v), true);
                        if !u.is_seen(slot) {
                            priors += u.prior[ti];
                        }
                    }
                }
                for (&p, &ci) in pieces.target_prefixes[ti].iter().zip(&pieces.target_prefix_cross[ti]) {
                    for &v in &btv.values[ti] {
                        if !u.is_seen(self.spec.slot(crate::features::mix(p, v), true)) {
                            priors += u.cross_prior.get(ci).copied().unwrap_or(0.0);
                        }
                    }
                }
            }
        }
        self.output(self.bias + self.sum_slots(&slots) + priors, self.calibration_for(ctx))
    }

    /// The factor by which an estimate must stay under a hard limit so the
    /// chance of exceeding it is at most `rate`; 1 without an error model.
    pub fn margin(&self, rate: f64) -> f64 {
        self.error.map_or(1.0, |e| e.margin(rate))
    }
}

/// Parses `labels` and hands their target feature values to `f`.
fn with_target_values<T>(labels: &[&str], f: impl FnOnce(&BuildTargetValues) -> Result<T>) -> Result<T> {
    let parsed = labels.iter().map(|l| parse_label(l)).collect::<Result<Vec<Label<'_>>>>()?;
    f(&BuildTargetValues::from_labels(parsed.iter()))
}

/// Memory estimate = max(long-window model, short-window model). The short
/// model reacts within a day to e.g. a Bazel memory regression that the
/// 17-day model would average away.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryEstimator {
    pub long: LinearModel,
    pub short: Option<LinearModel>,
}

impl MemoryEstimator {
    pub fn predict(&self, ctx: &BuildContext, labels: &[&str]) -> Result<f64> {
        with_target_values(labels, |btv| self.predict_values(ctx, btv))
    }

    pub fn predict_values(&self, ctx: &BuildContext, btv: &BuildTargetValues) -> Result<f64> {
        let long = self.long.predict_values(ctx, btv)?;
        match &self.short {
            Some(s) => Ok(long.max(s.predict_values(ctx, btv)?)),
            None => Ok(long),
        }
    }
}

/// Everything the planner needs. A missing model makes the planner fall
/// back to `fallback_batch_size` with a `*_ESTIMATE_ERROR` reason.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Models {
    pub memory: Option<MemoryEstimator>,
    pub occupancy: Option<LinearModel>,
    /// The shared-cost learner ([`crate::shared`]): when present, the planner's
    /// memory and occupancy estimates come from it, and the linear models above are
    /// kept for reports and as what older model directories hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared: Option<SharedModel>,
    pub manifest: Manifest,
}

/// Metadata written as `manifest.json` in the model directory.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub trained_at: Option<Timestamp>,
    pub train_config: Option<TrainConfig>,
    /// Records skipped because a label failed validation.
    pub skipped_records: usize,
    /// Crosses chosen by the search, per model.
    pub memory_crosses: Vec<Cross>,
    pub occupancy_crosses: Vec<Cross>,
}

/// File names inside a model directory.
pub const MANIFEST_FILE: &str = "manifest.json";
pub const MEMORY_LONG_FILE: &str = "memory_long.json";
pub const MEMORY_SHORT_FILE: &str = "memory_short.json";
pub const OCCUPANCY_FILE: &str = "occupancy.json";
pub const SHARED_FILE: &str = "shared.json";

impl Models {
    /// Write the model directory (created if missing). Files absent from
    /// `self` are removed so a stale model is never loaded back.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| BatchError::io(dir, e))?;
        let write = |name: &str, value: &dyn erased::Json| -> Result<()> {
            let path = dir.join(name);
            let tmp = dir.join(format!(".{name}.tmp"));
            std::fs::write(&tmp, value.to_json()?).map_err(|e| BatchError::io(&tmp, e))?;
            std::fs::rename(&tmp, &path).map_err(|e| BatchError::io(&path, e))
        };
        let remove = |name: &str| -> Result<()> {
            let p = dir.join(name);
            match std::fs::remove_file(&p) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(BatchError::io(p, e)),
            }
        };
        match &self.memory {
            Some(m) => {
                write(MEMORY_LONG_FILE, &m.long)?;
                match &m.short {
                    Some(s) => write(MEMORY_SHORT_FILE, s)?,
                    None => remove(MEMORY_SHORT_FILE)?,
                }
            }
            None => {
                remove(MEMORY_LONG_FILE)?;
                remove(MEMORY_SHORT_FILE)?;
            }
        }
        match &self.occupancy {
            Some(o) => write(OCCUPANCY_FILE, o)?,
            None => remove(OCCUPANCY_FILE)?,
        }
        match &self.shared {
            Some(m) => write(SHARED_FILE, m)?,
            None => remove(SHARED_FILE)?,
        }
        let mut manifest = self.manifest.clone();
        manifest.format = MODEL_FORMAT;
        write(MANIFEST_FILE, &manifest)
    }

    /// Load a model directory written by [`Models::save`]. `manifest.json`
    /// must exist; each model file is optional.
    pub fn load(dir: &Path) -> Result<Models> {
        let read = |name: &str| -> Result<Option<String>> {
            match std::fs::read_to_string(dir.join(name)) {
                Ok(s) => Ok(Some(s)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(BatchError::io(dir.join(name), e)),
            }
        };
        let bad = |reason: String| BatchError::ModelDir { dir: dir.to_path_buf(), reason };
        let manifest: Manifest = match read(MANIFEST_FILE)? {
            Some(s) => serde_json::from_str(&s).map_err(|e| bad(format!("{MANIFEST_FILE}: {e}")))?,
            None => return Err(bad(format!("missing {MANIFEST_FILE}"))),
        };
        if !READABLE_FORMATS.contains(&manifest.format) {
            return Err(bad(format!("unsupported format {}", manifest.format)));
        }
        let model = |name: &str, kind: ModelKind| -> Result<Option<LinearModel>> {
            match read(name)? {
                None => Ok(None),
                Some(s) => {
                    let m: LinearModel = serde_json::from_str(&s).map_err(|e| bad(format!("{name}: {e}")))?;
                    if m.kind != kind {
                        return Err(bad(format!("{name} holds a {:?} model", m.kind)));
                    }
                    Ok(Some(m))
                }
            }
        };
        let long = model(MEMORY_LONG_FILE, ModelKind::MemoryBytes)?;
        let short = model(MEMORY_SHORT_FILE, ModelKind::MemoryBytes)?;
        if long.is_none() && short.is_some() {
            return Err(bad(format!("{MEMORY_SHORT_FILE} without {MEMORY_LONG_FILE}")));
        }
        let shared = match read(SHARED_FILE)? {
            None => None,
            Some(s) => Some(serde_json::from_str(&s).map_err(|e| bad(format!("{SHARED_FILE}: {e}")))?),
        };
        Ok(Models {
            memory: long.map(|long| MemoryEstimator { long, short }),
            occupancy: model(OCCUPANCY_FILE, ModelKind::OccupancyEsu)?,
            shared,
            manifest,
        })
    }

    /// Whether there is a memory model to plan with.
    pub fn has_memory(&self) -> bool {
        self.shared.is_some() || self.memory.is_some()
    }

    /// The memory estimate (bytes) of one build by the model the planner uses, before
    /// any feedback correction; `None` without a memory model.
    pub fn predict_memory(&self, ctx: &BuildContext, labels: &[&str]) -> Option<Result<f64>> {
        match (&self.shared, &self.memory) {
            (Some(s), _) => Some(s.predict(ctx, labels)),
            (None, Some(m)) => Some(m.predict(ctx, labels)),
            (None, None) => None,
        }
    }

    /// The occupancy estimate (ESU) of one build by the model the planner uses, before
    /// any feedback correction; `None` without an occupancy model.
    pub fn predict_occupancy(&self, ctx: &BuildContext, labels: &[&str]) -> Option<Result<f64>> {
        (self.shared.is_some() || self.occupancy.is_some()).then(|| crate::planner::occupancy_of(self, ctx, labels))
    }
}

mod erased {
    //! Tiny helper so `save` can write differently typed values via one closure.
    pub trait Json {
        fn to_json(&self) -> crate::error::Result<String>;
    }
    impl<T: serde::Serialize> Json for T {
        fn to_json(&self) -> crate::error::Result<String> {
            Ok(serde_json::to_string(self)?)
        }
    }
}

// ---------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------

/// A history record reduced to what features need.
struct Prepared {
    /// Seconds since the epoch.
    time: i64,
    ctx: BuildContext,
    btv: BuildTargetValues,
    memory: f64,
    occupancy: Option<f64>,
    valid: bool,
    /// OOM build: its memory label is a lower bound.
    oom_censored: bool,
}

fn prepare(records: &[&BuildRecord], valid_fraction: f64) -> (Vec<Prepared>, usize) {
    let mut out = Vec::with_capacity(records.len());
    let mut skipped = 0;
    let cut = (valid_fraction * 1_000_000.0) as u64;
    for r in records {
        if r.outcome == crate::history::Outcome::InfraError {
            skipped += 1;
            continue;
        }
        let parsed: Result<Vec<Label<'_>>> = r.targets.iter().map(|t| parse_label(t)).collect();
        let Ok(parsed) = parsed else {
            skipped += 1;
            continue;
        };
        out.push(Prepared {
            time: r.time.0,
            ctx: r.context(),
            btv: BuildTargetValues::from_labels(parsed.iter()),
            memory: r.peak_memory_bytes as f64,
            occupancy: r.occupancy_esu(),
            // Split by id hash: stable when history is re-read or re-ordered.
            valid: crate::features::fnv1a(r.id.as_bytes()) % 1_000_000 < cut,
            oom_censored: r.outcome == crate::history::Outcome::Oom,
        });
    }
    (out, skipped)
}

/// One training example materialised for a spec.
struct Example {
    slots: Vec<u32>,
    y: f64,
    /// `y` is only a lower bound (the build died of OOM at about the
    /// allocation, so its real peak is unknown): the loss is one-sided.
    censored: bool,
}

fn materialise(spec: &FeatureSpec, data: &[(&Prepared, f64)], scale: f64, censor: bool) -> Vec<Example> {
    data.iter()
        .map(|(p, y)| {
            let censored = &(censor && p.oom_censored);
            let pieces = spec.context_pieces(&p.ctx);
            Example { slots: spec.build_slots(&pieces, &p.btv), y: y / scale, censored: *censored }
        })
        .collect()
}

/// The slots of crosses between a build-level and a target-level family
/// that `data` has, as a bitset.
fn target_cross_slots(spec: &FeatureSpec, data: &[(&Prepared, f64)]) -> Vec<u64> {
    let mut set = vec![0u64; spec.slots().div_ceil(64)];
    for (p, _) in data {
        let pieces = spec.context_pieces(&p.ctx);
        for ti in 0..3 {
            for &pre in &pieces.target_prefixes[ti] {
                for &v in &p.btv.values[ti] {
                    let s = spec.slot(crate::features::mix(pre, v), true);
                    set[s as usize / 64] |= 1 << (s % 64);
                }
            }
        }
    }
    set
}

/// Normalised SGD on MSE with an L1 proximal step; target-related slots
/// (upper half) are projected onto w >= 0 after every step, so the final
/// weights satisfy the monotonicity constraint exactly.
fn fit(spec: &FeatureSpec, examples: &[Example], cfg: &TrainConfig, epochs: usize, slow: &[u64]) -> (f64, Vec<f64>) {
    let mut w = vec![0.0f64; spec.slots()];
    let (lr, l1, seed, huber) = (cfg.learning_rate, cfg.l1, cfg.seed, cfg.huber());
    let rate_of = |s: u32| if slow[s as usize / 64] >> (s % 64) & 1 == 1 { cfg.cross_rate } else { 1.0 };
    let nonneg = spec.nonneg_start() as u32;
    let mut bias =
        if examples.is_empty() { 0.0 } else { examples.iter().map(|e| e.y).sum::<f64>() / examples.len() as f64 };
    let mut order: Vec<usize> = (0..examples.len()).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for epoch in 0..epochs {
        order.shuffle(&mut rng);
        let lr_e = lr / (1.0 + 0.5 * epoch as f64);
        for &i in &order {
            let ex = &examples[i];
            let pred = bias + ex.slots.iter().map(|&s| w[s as usize]).sum::<f64>();
            let mut err = pred - ex.y;
            if ex.censored && err > 0.0 {
                // Predicting above a lower bound is not an error.
                err = 0.0;
            }
            if let Some(d) = huber {
                let cap = d * ex.y.abs().max(1e-3);
                err = err.clamp(-cap, cap);
            }
            // NLMS: the step is divided by the squared norm of x (bias = 1).
            let step = lr_e / (1.0 + ex.slots.len() as f64);
            let delta = step * err;
            bias -= delta;
            let thr = step * l1;
            for &s in &ex.slots {
                let v = w[s as usize] - delta * rate_of(s);
                w[s as usize] = if s >= nonneg {
                    (v - thr).max(0.0)
                } else if v > thr {
                    v - thr
                } else if v < -thr {
                    v + thr
                } else {
                    0.0
                };
            }
        }
    }
    (bias, w)
}

fn mse(bias: f64, w: &[f64], examples: &[Example]) -> f64 {
    if examples.is_empty() {
        return 0.0;
    }
    examples
        .iter()
        .map(|e| {
            let p = (bias + e.slots.iter().map(|&s| w[s as usize]).sum::<f64>()).max(0.0);
            if e.censored && p > e.y {
                0.0
            } else {
                (p - e.y).powi(2)
            }
        })
        .sum::<f64>()
        / examples.len() as f64
}

/// Learn count boundaries from a window.
fn base_spec(cfg: &TrainConfig, data: &[(&Prepared, f64)]) -> FeatureSpec {
    let mut spec = FeatureSpec::new(cfg.hash_bits);
    let mut tc: Vec<u32> = data.iter().map(|(p, _)| p.btv.target_count as u32).collect();
    let mut pc: Vec<u32> = data.iter().map(|(p, _)| p.btv.package_count as u32).collect();
    spec.target_count_boundaries = FeatureSpec::learn_boundaries(&mut tc, cfg.count_buckets);
    spec.package_count_boundaries = FeatureSpec::learn_boundaries(&mut pc, cfg.count_buckets);
    spec
}

/// Greedy forward selection of up to `max_crosses` crosses: each round
/// briefly trains one model per candidate on a subsample and keeps the
/// candidate with the lowest validation MSE if it beats the current best
/// by `cross_min_improvement`.
fn search_crosses(
    cfg: &TrainConfig,
    spec: &FeatureSpec,
    train: &[(&Prepared, f64)],
    valid: &[(&Prepared, f64)],
    scale: f64,
    censor: bool,
) -> Vec<Cross> {
    if !cfg.cross_search || cfg.max_crosses == 0 || valid.len() < 10 || train.len() < 20 {
        return Vec::new();
    }
    let sub = |d: &[(&Prepared, f64)], n: usize| -> Vec<usize> {
        let step = (d.len() as f64 / n as f64).max(1.0);
        (0..n.min(d.len())).map(|k| (k as f64 * step) as usize).collect()
    };
    let tr: Vec<(&Prepared, f64)> = sub(train, cfg.cross_search_max_examples).into_iter().map(|i| train[i]).collect();
    let va: Vec<(&Prepared, f64)> =
        sub(valid, cfg.cross_search_max_examples / 4 + 1).into_iter().map(|i| valid[i]).collect();
    let score = |crosses: &[Cross]| -> f64 {
        let mut s = spec.clone();
        s.crosses = crosses.to_vec();
        let tx = materialise(&s, &tr, scale, censor);
        let vx = materialise(&s, &va, scale, censor);
        let slow = target_cross_slots(&s, &tr);
        let (b, w) = fit(&s, &tx, cfg, cfg.cross_search_epochs, &slow);
        mse(b, &w, &vx)
    };
    let mut chosen: Vec<Cross> = Vec::new();
    let mut best = score(&chosen);
    let mut pool = Cross::candidates();
    for round in 0..cfg.max_crosses {
        let mut scored: Vec<(f64, Cross)> = pool
            .iter()
            .filter(|c| !chosen.contains(c))
            .map(|&c| {
                let mut trial = chosen.clone();
                trial.push(c);
                (score(&trial), c)
            })
            .collect();
        scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        if round == 0 {
            pool = scored.iter().take(cfg.cross_beam).map(|x| x.1).collect();
        }
        match scored.first() {
            Some(&(loss, c)) if loss < best * (1.0 - cfg.cross_min_improvement) => {
                best = loss;
                chosen.push(c);
            }
            _ => break,
        }
    }
    chosen
}

/// Bounds of a tool's centring slope (`Centring::Line`).
const LINE_SLOPES: (f64, f64) = (0.5, 2.0);
/// Bounds of a tool's centring power (`Centring::Power`). Held-out builds span a narrow
/// range of sizes, so the slope of their logs is uncertain; a power far from 1 would
/// make every batch tiny or bring back the under-reading.
const POWERS: (f64, f64) = (0.8, 1.4);

/// What [`calibrate`] learned: the global factor, each tool's curve
/// (factor, offset, power) and the held-out error around it.
struct Calibrated {
    global: f64,
    tools: BTreeMap<String, f64>,
    offsets: BTreeMap<String, f64>,
    powers: BTreeMap<String, f64>,
    error: Option<crate::margin::ErrorModel>,
}

/// Output scaling learned on held-out builds whose (uncalibrated)
/// prediction is at least `min_pred`: a global factor, per-tool factors
/// (tools with fewer than 20 such builds use the global), and with
/// `Calibration::Median` the error distribution left after centring.
///
/// * `Quantile`: the `q` quantile of actual/predicted, floored at 1, a fixed
///   safety factor;
/// * `Median`: the median of actual/predicted (which the few far-off labels
///   barely move), so the output is centred; safety comes from the margin.
///
/// In `Median` mode the factors also follow drift: when the builds since
/// `recent_since` (the short window; training builds too, since one day of
/// 17 barely moves the fit) are enough to tell, every factor is multiplied
/// by their median ratio over the held-out builds'. A Bazel release
/// that needs 12% more heap moves the last day's residuals at once, while
/// weights fitted on 17 days barely move.
fn calibrate(
    model: &LinearModel,
    data: &[(&Prepared, f64)],
    valid: &[(&Prepared, f64)],
    cfg: &TrainConfig,
    min_pred: f64,
    recent_since: i64,
) -> Calibrated {
    // An OOM build's label is only a lower bound (the heap it died in): not a
    // measurement of actual / predicted.
    let ratio = |p: &Prepared, y: f64| -> Option<f64> {
        let pred = model.predict_values(&p.ctx, &p.btv).ok()?;
        (pred >= min_pred && pred > 0.0 && y > 0.0 && !p.oom_censored).then(|| y / pred)
    };
    let all: Vec<(f64, &str, f64)> =
        valid.iter().filter_map(|(p, y)| ratio(p, *y).map(|r| (r, p.ctx.tool_tag.as_str(), *y / r))).collect();
    let recent: Vec<f64> =
        data.iter().filter(|(p, _)| p.time >= recent_since).filter_map(|(p, y)| ratio(p, *y)).collect();
    let median_mode = cfg.calibration == Calibration::Median;
    let quantile = |mut v: Vec<f64>| -> Option<f64> {
        if v.len() < 20 {
            return None;
        }
        v.sort_by(f64::total_cmp);
        if median_mode {
            Some(v[(v.len() - 1) / 2].clamp(0.5, 2.0))
        } else {
            Some(v[((v.len() - 1) as f64 * cfg.calibration_quantile).round() as usize].max(1.0))
        }
    };
    let mut by_tool: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (r, t, _) in &all {
        by_tool.entry(t.to_string()).or_default().push(*r);
    }
    let mut global = quantile(all.iter().map(|x| x.0).collect()).unwrap_or(1.0);
    let mut tools: BTreeMap<String, f64> =
        by_tool.into_iter().filter_map(|(t, v)| quantile(v).map(|c| (t, c))).collect();
    // Median mode: each tool's line through its held-out (prediction, label)
    // pairs, slope by Theil-Sen (the median of pairwise slopes, which the few
    // far-off labels barely move), offset the median residual.
    // With `Centring::Power` the line is drawn through the logs instead:
    // slope the power, intercept the log of the factor.
    let mut offsets: BTreeMap<String, f64> = BTreeMap::new();
    let mut powers: BTreeMap<String, f64> = BTreeMap::new();
    if median_mode {
        for (tool, f) in tools.iter_mut() {
            let pairs = all.iter().filter(|x| x.1 == tool).map(|x| (x.2, x.0 * x.2));
            match cfg.centring {
                Centring::Line => {
                    if let Some((slope, off)) = theil_sen(&pairs.collect::<Vec<_>>(), LINE_SLOPES) {
                        *f = slope;
                        offsets.insert(tool.clone(), off);
                    }
                }
                Centring::Power => {
                    let logs: Vec<(f64, f64)> = pairs.map(|(x, y)| (x.ln(), y.ln())).collect();
                    if let Some((power, log_factor)) = theil_sen(&logs, POWERS) {
                        *f = log_factor.exp();
                        powers.insert(tool.clone(), power);
                    }
                }
            }
        }
    }
    let (base_global, base_tools, base_offsets) = (global, tools.clone(), offsets.clone());
    if median_mode && let Some(r) = quantile(recent) {
        let drift = r / global;
        global *= drift;
        for c in tools.values_mut() {
            *c *= drift;
        }
        for o in offsets.values_mut() {
            *o *= drift;
        }
    }
    let error = if median_mode {
        let side = match model.kind {
            ModelKind::MemoryBytes => crate::margin::TrustedSide::Lower,
            ModelKind::OccupancyEsu => crate::margin::TrustedSide::Upper,
        };
        // Drift is a shift of the centre, not error: measure the spread
        // around each tool's own centre before the drift correction.
        let logs: Vec<f64> = all
            .iter()
            .filter_map(|&(r, t, pred)| {
                let centre = Centre::of(t, base_global, &base_tools, &base_offsets, &powers).apply(pred);
                (centre > 0.0).then(|| (r * pred / centre).ln())
            })
            .collect();
        crate::margin::ErrorModel::fit(&logs, side)
    } else {
        None
    };
    Calibrated { global, tools, offsets, powers, error }
}

/// Theil-Sen line through `pts` (x, y): slope the median of pairwise slopes,
/// clamped to `(lo, hi)` so the model stays monotone and sane, offset the
/// median of `y - slope x` at that slope. `None` under 20 points.
fn theil_sen(pts: &[(f64, f64)], (lo, hi): (f64, f64)) -> Option<(f64, f64)> {
    if pts.len() < 20 {
        return None;
    }
    // At most ~200 points: 20,000 pairs.
    let step = pts.len().div_ceil(200);
    let p: Vec<(f64, f64)> = pts.iter().step_by(step).copied().collect();
    let mut slopes = Vec::with_capacity(p.len() * p.len() / 2);
    for i in 0..p.len() {
        for j in i + 1..p.len() {
            let dx = p[j].0 - p[i].0;
            if dx.abs() > 1e-9 * p[i].0.abs().max(1.0) {
                slopes.push((p[j].1 - p[i].1) / dx);
            }
        }
    }
    if slopes.is_empty() {
        return None;
    }
    slopes.sort_by(f64::total_cmp);
    let slope = slopes[slopes.len() / 2].clamp(lo, hi);
    let mut res: Vec<f64> = pts.iter().map(|(x, y)| y - slope * x).collect();
    res.sort_by(f64::total_cmp);
    Some((slope, res[res.len() / 2]))
}

/// The mean trained weight of each target family's base features over the
/// values the training builds had, and the set of slots they had.
fn unseen_prior(spec: &FeatureSpec, train: &[(&Prepared, f64)], examples: &[Example], weights: &[f64]) -> UnseenPrior {
    let mut seen = vec![0u64; spec.slots().div_ceil(64)];
    for ex in examples {
        for &s in &ex.slots {
            seen[s as usize / 64] |= 1 << (s % 64);
        }
    }
    let mut prior = [0.0; 3];
    for (ti, fam) in crate::features::Family::TARGET.iter().enumerate() {
        if !spec.has(*fam) {
            continue;
        }
        let mut slots: Vec<u32> = train
            .iter()
            .flat_map(|(p, _)| p.btv.values[ti].iter().map(|&v| spec.slot(crate::features::mix(fam.tag(), v), true)))
            .collect();
        slots.sort_unstable();
        slots.dedup();
        if !slots.is_empty() {
            prior[ti] = slots.iter().map(|&s| weights[s as usize]).sum::<f64>() / slots.len() as f64;
        }
    }
    let mut cross_slots: Vec<Vec<u32>> = vec![Vec::new(); spec.crosses.len()];
    for (p, _) in train {
        let pieces = spec.context_pieces(&p.ctx);
        for ti in 0..3 {
            for (&pre, &ci) in pieces.target_prefixes[ti].iter().zip(&pieces.target_prefix_cross[ti]) {
                cross_slots[ci].extend(p.btv.values[ti].iter().map(|&v| spec.slot(crate::features::mix(pre, v), true)));
            }
        }
    }
    let cross_prior = cross_slots
        .into_iter()
        .map(|mut s| {
            s.sort_unstable();
            s.dedup();
            if s.is_empty() {
                0.0
            } else {
                s.iter().map(|&x| weights[x as usize]).sum::<f64>() / s.len() as f64
            }
        })
        .collect();
    UnseenPrior { prior, cross_prior, seen }
}

/// Train one model on `data` (label already chosen), with a fixed spec or,
/// when `crosses` is `None`, a searched one.
fn train_one(
    cfg: &TrainConfig,
    kind: ModelKind,
    data: &[(&Prepared, f64)],
    spec: Option<&FeatureSpec>,
    window_days: f64,
    recent_since: i64,
) -> Result<LinearModel> {
    let train: Vec<(&Prepared, f64)> = data.iter().filter(|(p, _)| !p.valid).copied().collect();
    let valid: Vec<(&Prepared, f64)> = data.iter().filter(|(p, _)| p.valid).copied().collect();
    // With very little data, train on everything rather than nothing.
    let train = if train.is_empty() { data.to_vec() } else { train };
    if train.is_empty() {
        return Err(BatchError::Training(format!("no {kind:?} examples in the window")));
    }
    let scale = train.iter().map(|x| x.1).sum::<f64>() / train.len() as f64;
    let scale = if scale > 0.0 { scale } else { 1.0 };
    // OOM builds only bound the memory label from below.
    let censor = kind == ModelKind::MemoryBytes;
    let spec = match spec {
        Some(s) => s.clone(),
        None => {
            let mut s = base_spec(cfg, &train);
            s.crosses = search_crosses(cfg, &s, &train, &valid, scale, censor);
            s
        }
    };
    let ex = materialise(&spec, &train, scale, censor);
    let slow = target_cross_slots(&spec, &train);
    let (bias, weights) = fit(&spec, &ex, cfg, cfg.epochs, &slow);
    let unseen = cfg.unseen_prior.then(|| unseen_prior(&spec, &train, &ex, &weights));
    let mut model = LinearModel::from_parts(kind, spec, bias, weights, scale, 1.0)?;
    model.unseen = unseen;
    model.window_days = window_days;
    model.trained_examples = ex.len();
    let min_pred = match kind {
        ModelKind::MemoryBytes => cfg.calibration_min_memory_bytes,
        ModelKind::OccupancyEsu => cfg.calibration_min_occupancy_esu,
    };
    // Calibrate the uncalibrated model (factor 1 everywhere).
    let c = calibrate(&model, data, &valid, cfg, min_pred, recent_since);
    model.calibration = c.global;
    model.tool_calibration = c.tools;
    model.tool_offset = c.offsets;
    model.tool_power = c.powers;
    model.error = c.error;
    Ok(model)
}

/// Train all models from history, with windows ending at `now`.
///
/// * memory, long window (`long_window_days`, default 17): cross search,
///   train, calibrate;
/// * memory, short window (`short_window_days`, default 1): same features
///   as the long model, own weights and calibration; skipped when the window
///   has fewer than `min_short_window_builds` builds;
/// * occupancy, long window: own cross search.
pub fn train(history: &[BuildRecord], config: &TrainConfig, now: Timestamp) -> Result<Models> {
    config.validate()?;
    let long = window(history, now, config.long_window_days);
    if long.is_empty() {
        return Err(BatchError::Training(format!(
            "no builds in the {}-day window before {}",
            config.long_window_days,
            now.to_rfc3339()
        )));
    }
    let (prepared, skipped) = prepare(&long, config.validation_fraction);
    let mem: Vec<(&Prepared, f64)> = prepared.iter().map(|p| (p, p.memory)).collect();
    let short_start = now.0 - (config.short_window_days * 86_400.0).round() as i64;
    let long_model = train_one(config, ModelKind::MemoryBytes, &mem, None, config.long_window_days, short_start)?;

    let short_records: Vec<&BuildRecord> = long.iter().copied().filter(|r| r.time.0 >= short_start).collect();
    let short_model = if short_records.len() >= config.min_short_window_builds {
        let (sp, _) = prepare(&short_records, config.validation_fraction);
        let sm: Vec<(&Prepared, f64)> = sp.iter().map(|p| (p, p.memory)).collect();
        let mut m = train_one(
            config,
            ModelKind::MemoryBytes,
            &sm,
            Some(&long_model.spec),
            config.short_window_days,
            short_start,
        )?;
        // A day of data rarely has enough large held-out builds to calibrate
        // on its own; never be less cautious than the long model.
        if config.calibration == Calibration::Quantile {
            m.calibration = m.calibration.max(long_model.calibration);
            for (tool, &c) in &long_model.tool_calibration {
                let e = m.tool_calibration.entry(tool.clone()).or_insert(c);
                *e = e.max(c);
            }
        }
        // Nor less sure: a day's few held-out builds under-read the tails.
        m.error = crate::margin::ErrorModel::wider(m.error, long_model.error);
        Some(m)
    } else {
        None
    };

    let occ: Vec<(&Prepared, f64)> = prepared.iter().filter_map(|p| p.occupancy.map(|o| (p, o))).collect();
    let occupancy = if occ.is_empty() {
        None
    } else {
        Some(train_one(config, ModelKind::OccupancyEsu, &occ, None, config.long_window_days, short_start)?)
    };
    // The shared-cost learner on the same window, its last day marked as recent. A
    // window too small for it keeps the linear models alone.
    let shared = match config.learner {
        Learner::Linear => None,
        Learner::Shared => {
            let cfg = SharedConfig { recent_days: config.short_window_days, ..config.shared.clone() };
            match SharedModel::train(long.iter().copied(), &cfg, now) {
                Ok(m) => Some(m),
                Err(BatchError::Training(_)) => None,
                Err(e) => return Err(e),
            }
        }
    };
    Ok(Models {
        shared,
        manifest: Manifest {
            format: MODEL_FORMAT,
            trained_at: Some(now),
            train_config: Some(config.clone()),
            skipped_records: skipped,
            memory_crosses: long_model.spec.crosses.clone(),
            occupancy_crosses: occupancy.as_ref().map(|o| o.spec.crosses.clone()).unwrap_or_default(),
        },
        memory: Some(MemoryEstimator { long: long_model, short: short_model }),
        occupancy,
    })
}

/// Which families the features of a model touch (for reports).
pub fn describe_spec(spec: &FeatureSpec) -> String {
    let fams: Vec<String> = spec.families.iter().map(|f| format!("{f:?}")).collect();
    let crosses: Vec<String> = spec.crosses.iter().map(|c| c.to_string()).collect();
    format!(
        "2^{} slots; families [{}]; crosses [{}]; {} target-count and {} package-count buckets",
        spec.hash_bits,
        fams.join(", "),
        crosses.join(", "),
        spec.target_count_boundaries.len(),
        spec.package_count_boundaries.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prior_that_is_no_weight_is_refused() {
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            let mut c = TrainConfig::default();
            c.shared.prior_count = bad;
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains("shared.prior_count"), "{bad}: {err}");
        }
        let mut c = TrainConfig::default();
        c.shared.prior_count = 0.0;
        c.validate().unwrap();
        for bad in [-0.01, f64::NAN, f64::INFINITY] {
            let mut c = TrainConfig::default();
            c.shared.package_prior = bad;
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains("shared.package_prior"), "{bad}: {err}");
        }
    }

    /// Held-out builds mostly small, the truth growing faster than the raw score: the
    /// power drawn through their logarithms reads a build five times the largest one
    /// right, where the straight line through the same points under-reads it.
    #[test]
    fn the_power_curve_extrapolates_what_the_line_misses() {
        let truth = |x: f64| 0.8 * x.powf(1.15);
        let mut pts = Vec::new();
        for i in 0..300 {
            let x = 1.0 + (i % 30) as f64 / 10.0; // 1 to 4
            let wobble = [0.97, 1.0, 1.03][i % 3];
            pts.push((x, truth(x) * wobble));
        }
        let (power, log_factor) =
            theil_sen(&pts.iter().map(|&(x, y)| (x.ln(), y.ln())).collect::<Vec<_>>(), POWERS).unwrap();
        assert!((power - 1.15).abs() < 0.03, "{power}");
        let curve = Centre { factor: log_factor.exp(), offset: 0.0, power };
        let (slope, offset) = theil_sen(&pts, LINE_SLOPES).unwrap();
        let line = Centre { factor: slope, offset, power: 1.0 };
        let far = 20.0;
        let (c, l, t) = (curve.apply(far), line.apply(far), truth(far));
        assert!((c / t - 1.0).abs() < 0.03, "curve {c} against {t}");
        assert!(l / t < 0.9, "the line under-reads: {l} against {t}");
        // Monotone, as the binary search needs.
        assert!((1..100).all(|i| curve.apply(i as f64) < curve.apply(i as f64 + 0.5)));
    }

    /// Files of format 1 (no powers) still load, as power 1; a format this binary does not
    /// know is refused rather than misread; and powers survive a round trip.
    #[test]
    fn model_formats_one_and_two_load_and_others_are_refused() {
        let spec = FeatureSpec::new(8);
        let mut m =
            LinearModel::from_parts(ModelKind::MemoryBytes, spec.clone(), 1.0, vec![0.0; spec.slots()], 1e9, 1.0)
                .unwrap();
        m.tool_calibration.insert("t".into(), 0.5);
        m.tool_power.insert("t".into(), 1.2);
        let json = serde_json::to_string(&m).unwrap();
        assert!(json.contains("\"format\":2"), "{json}");
        let back: LinearModel = serde_json::from_str(&json).unwrap();
        assert_eq!(back.tool_power, m.tool_power);
        let mut ctx = BuildContext::new_workspace("w", crate::types::Command::Build, crate::types::Priority::Low);
        ctx.tool_tag = "t".into();
        assert_eq!(back.calibration_for(&ctx).power, 1.2);

        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v.as_object_mut().unwrap().remove("tool_power");
        v["format"] = 1.into();
        let old: LinearModel = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(old.calibration_for(&ctx), Centre { factor: 0.5, offset: 0.0, power: 1.0 });
        v["format"] = 3.into();
        let err = serde_json::from_value::<LinearModel>(v).unwrap_err().to_string();
        assert!(err.contains("unsupported model format 3"), "{err}");
    }
}
