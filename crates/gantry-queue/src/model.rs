//! P(success) model: a small logistic regression trained on the queue's own history.
//!
//! The planner turns every decided change into a [`TrainingExample`] (its
//! features as they were just before the decisive build, labelled with whether
//! the change landed) and periodically retrains. Training is full-batch gradient
//! descent from a zero start over standardised features, so the same examples
//! always give bit-identical weights: no shuffling, no random init, no threads.

use serde::{Deserialize, Serialize};

use crate::error::QueueError;

/// Number of model features; see [`FEATURE_NAMES`].
pub const NUM_FEATURES: usize = 7;

/// Names of the model inputs, in vector order (kept for persisted-model readability).
pub const FEATURE_NAMES: [&str; NUM_FEATURES] = [
    "ln_files_changed",
    "ln_lines_changed",
    "ln_affected_targets",
    "author_recent_success_rate",
    "presubmit_passed",
    "ln_speculative_builds_passed",
    "ln_speculative_builds_failed",
];

/// Static facts about a change, supplied by the integrator when it is enqueued.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChangeFeatures {
    /// Number of files the change touches.
    #[serde(default)]
    pub files_changed: u32,
    /// Lines added plus lines removed.
    #[serde(default)]
    pub lines_changed: u32,
    /// Number of affected build targets (the conflict analyzer's count, if known).
    #[serde(default)]
    pub affected_targets: u32,
    /// Author identity; the planner tracks each author's recent success rate itself.
    #[serde(default)]
    pub author: String,
    /// Whether presubmit checks passed.
    #[serde(default = "default_true")]
    pub presubmit_passed: bool,
}

fn default_true() -> bool {
    true
}

/// A model input vector. Counts are log-scaled because their effect is
/// roughly multiplicative (a 2000-line change is not 10x riskier than a 200-line one).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct FeatureVector(pub [f64; NUM_FEATURES]);

impl FeatureVector {
    /// Builds the vector from static features plus the dynamic ones the planner tracks.
    pub fn new(
        features: &ChangeFeatures,
        author_success_rate: f64,
        speculative_passed: u32,
        speculative_failed: u32,
    ) -> Self {
        FeatureVector([
            f64::from(features.files_changed).ln_1p(),
            f64::from(features.lines_changed).ln_1p(),
            f64::from(features.affected_targets).ln_1p(),
            author_success_rate,
            if features.presubmit_passed { 1.0 } else { 0.0 },
            f64::from(speculative_passed).ln_1p(),
            f64::from(speculative_failed).ln_1p(),
        ])
    }
}

/// One labelled observation: did a change with these features land?
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingExample {
    /// Input vector.
    pub features: FeatureVector,
    /// True when the change landed.
    pub landed: bool,
}

/// Gradient-descent hyper-parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainParams {
    /// Full-batch iterations.
    pub epochs: usize,
    /// Step size.
    pub learning_rate: f64,
    /// L2 penalty; keeps weights finite when a feature separates the data perfectly.
    pub l2: f64,
}

impl Default for TrainParams {
    fn default() -> Self {
        TrainParams { epochs: 300, learning_rate: 0.5, l2: 1e-3 }
    }
}

/// A trained logistic regression over [`FeatureVector`]s, with its standardisation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LogisticModel {
    /// Feature names, recorded so a persisted model documents its own inputs.
    pub feature_names: Vec<String>,
    /// Per-feature mean used for standardisation.
    pub means: Vec<f64>,
    /// Per-feature standard deviation (1.0 for constant features).
    pub stds: Vec<f64>,
    /// Weights on standardised features.
    pub weights: Vec<f64>,
    /// Intercept.
    pub bias: f64,
    /// Number of examples the model was trained on.
    pub trained_on: usize,
}

fn sigmoid(z: f64) -> f64 {
    if z >= 0.0 {
        1.0 / (1.0 + (-z).exp())
    } else {
        let e = z.exp();
        e / (1.0 + e)
    }
}

impl LogisticModel {
    /// Trains deterministically. Requires at least one example of each label,
    /// otherwise the maximum-likelihood fit is degenerate and the caller
    /// should keep using its prior.
    pub fn train(examples: &[TrainingExample], params: &TrainParams) -> Result<Self, QueueError> {
        let n = examples.len();
        let positives = examples.iter().filter(|e| e.landed).count();
        if positives == 0 || positives == n {
            return Err(QueueError::Training(format!("need both outcomes, have {positives} landed of {n}")));
        }
        let nf = n as f64;
        let mut means = vec![0.0; NUM_FEATURES];
        for e in examples {
            for (m, x) in means.iter_mut().zip(e.features.0) {
                *m += x / nf;
            }
        }
        let mut stds = vec![0.0; NUM_FEATURES];
        for e in examples {
            for ((s, x), m) in stds.iter_mut().zip(e.features.0).zip(&means) {
                *s += (x - m) * (x - m) / nf;
            }
        }
        for s in &mut stds {
            *s = if *s > 1e-12 { s.sqrt() } else { 1.0 };
        }
        let xs: Vec<[f64; NUM_FEATURES]> = examples
            .iter()
            .map(|e| {
                let mut z = [0.0; NUM_FEATURES];
                for i in 0..NUM_FEATURES {
                    z[i] = (e.features.0[i] - means[i]) / stds[i];
                }
                z
            })
            .collect();
        // Start the intercept at the base-rate log-odds so few epochs suffice.
        let rate = positives as f64 / nf;
        let mut bias = (rate / (1.0 - rate)).ln();
        let mut weights = vec![0.0; NUM_FEATURES];
        for _ in 0..params.epochs {
            let mut gw = [0.0; NUM_FEATURES];
            let mut gb = 0.0;
            for (x, e) in xs.iter().zip(examples) {
                let z = bias + x.iter().zip(&weights).map(|(a, w)| a * w).sum::<f64>();
                let err = sigmoid(z) - if e.landed { 1.0 } else { 0.0 };
                gb += err;
                for i in 0..NUM_FEATURES {
                    gw[i] += err * x[i];
                }
            }
            bias -= params.learning_rate * gb / nf;
            for i in 0..NUM_FEATURES {
                weights[i] -= params.learning_rate * (gw[i] / nf + params.l2 * weights[i]);
            }
        }
        Ok(LogisticModel {
            feature_names: FEATURE_NAMES.iter().map(|s| s.to_string()).collect(),
            means,
            stds,
            weights,
            bias,
            trained_on: n,
        })
    }

    /// Probability that a change with these features lands.
    pub fn predict(&self, x: &FeatureVector) -> f64 {
        let z = self.bias
            + (0..NUM_FEATURES).map(|i| self.weights[i] * (x.0[i] - self.means[i]) / self.stds[i]).sum::<f64>();
        sigmoid(z)
    }

    /// Serialises to JSON for the integrator's state store.
    pub fn to_json(&self) -> Result<String, QueueError> {
        Ok(serde_json::to_string(self)?)
    }

    /// Restores a model persisted with [`LogisticModel::to_json`].
    pub fn from_json(s: &str) -> Result<Self, QueueError> {
        let m: LogisticModel = serde_json::from_str(s)?;
        let ok = [m.means.len(), m.stds.len(), m.weights.len()].iter().all(|&l| l == NUM_FEATURES);
        if !ok {
            return Err(QueueError::InvalidInput {
                line: 1,
                message: format!("model must have {NUM_FEATURES} features"),
            });
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data() -> Vec<TrainingExample> {
        // Presubmit failure and big changes make landing unlikely.
        (0..200u32)
            .map(|i| {
                let presubmit = i % 5 != 0;
                let lines = 10 + (i * 37) % 900;
                let f = ChangeFeatures {
                    files_changed: 1 + i % 7,
                    lines_changed: lines,
                    affected_targets: 1 + i % 11,
                    author: format!("a{}", i % 4),
                    presubmit_passed: presubmit,
                };
                let landed = presubmit && (lines < 700 || i % 3 == 0);
                TrainingExample { features: FeatureVector::new(&f, 0.9, 0, 0), landed }
            })
            .collect()
    }

    #[test]
    fn training_is_deterministic() {
        let d = data();
        let a = LogisticModel::train(&d, &TrainParams::default()).unwrap();
        let b = LogisticModel::train(&d, &TrainParams::default()).unwrap();
        // Bit-identical, not merely close: persisted models must be reproducible.
        assert_eq!(a.to_json().unwrap(), b.to_json().unwrap());
    }

    #[test]
    fn model_learns_the_signal() {
        let d = data();
        let m = LogisticModel::train(&d, &TrainParams::default()).unwrap();
        let good = ChangeFeatures {
            files_changed: 2,
            lines_changed: 50,
            affected_targets: 3,
            author: "x".into(),
            presubmit_passed: true,
        };
        let bad = ChangeFeatures { presubmit_passed: false, ..good.clone() };
        let pg = m.predict(&FeatureVector::new(&good, 0.9, 0, 0));
        let pb = m.predict(&FeatureVector::new(&bad, 0.9, 0, 0));
        assert!(pg > 0.8, "good change predicted {pg}");
        assert!(pb < 0.2, "bad change predicted {pb}");
        let correct = d.iter().filter(|e| (m.predict(&e.features) >= 0.5) == e.landed).count();
        assert!(correct as f64 / d.len() as f64 > 0.85);
    }

    #[test]
    fn persistence_round_trips_and_validates() {
        let m = LogisticModel::train(&data(), &TrainParams::default()).unwrap();
        let back = LogisticModel::from_json(&m.to_json().unwrap()).unwrap();
        assert_eq!(m, back);
        let mut broken = m.clone();
        broken.weights.pop();
        assert!(LogisticModel::from_json(&broken.to_json().unwrap()).is_err());
    }

    #[test]
    fn single_label_is_rejected() {
        let d: Vec<_> = data().into_iter().filter(|e| e.landed).collect();
        assert!(matches!(LogisticModel::train(&d, &TrainParams::default()), Err(QueueError::Training(_))));
    }
}
