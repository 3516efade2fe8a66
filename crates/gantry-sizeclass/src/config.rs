//! Tunables of size class selection and history keeping, with the defaults
//! from the issue tracker, serde support (durations as float seconds) and
//! range validation.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::types::secs_f64;
use crate::Error;

/// Selection and learning parameters. `Default` gives the documented
/// defaults; call [`SelectionConfig::validate`] after loading user input
/// (selection also validates, so a bad config can never pick a class).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SelectionConfig {
    /// Outcomes kept per key and size class (oldest dropped first). Default 32.
    pub history_size: usize,

    /// How long a failure on the largest class boosts the key to the largest
    /// class. Default 24 h.
    #[serde(with = "secs_f64", rename = "failure_cache_duration_s")]
    pub failure_cache_duration: Duration,

    /// Hedge time of a new shape's first run on a class taken from similar
    /// shapes. Default 10 s.
    #[serde(with = "secs_f64", rename = "minimum_execution_timeout_s")]
    pub minimum_execution_timeout: Duration,

    /// Exponent `x` in `T_acceptable = T_largest * (S_largest / S)^x`.
    /// 0 tolerates no slowdown, 1 expects linear scaling. Default 0.1.
    pub acceptable_time_exponent: f64,

    /// A run on a smaller class is hedged on the largest class at its
    /// acceptable time × this, so runs close to it are not duplicated; a shape
    /// whose runs vary more gets more (see `select::HEDGE_SPREADS`). Default 1.2.
    pub hedge_multiplier: f64,

    /// A smaller class fits the action's memory when its smoothed fit
    /// probability is at least this. Default 0.5 (see `select` module docs).
    pub success_threshold: f64,

    /// Probability of retrying the fitting class just below the chosen one,
    /// so a shape whose behaviour changed is noticed; a fifth of it more
    /// re-measures the class just above. 0 disables both. At most 0.5, so
    /// that learned choices stay the rule. Default 0.05.
    pub exploration_factor: f64,

    /// Beta prior pseudo-successes (α). Default 1 (Laplace smoothing).
    pub prior_successes: f64,

    /// Beta prior pseudo-failures (β). Default 1 (Laplace smoothing).
    pub prior_failures: f64,
}

/// The settings users can change come from `[execution.size_classes]`'s defaults, kept
/// in one place: gantry-config.
impl Default for SelectionConfig {
    fn default() -> Self {
        Self::from_config(&gantry_config::SizeClassConfig::default())
    }
}

impl SelectionConfig {
    /// `[execution.size_classes]`; the settings it does not expose keep their defaults.
    pub fn from_config(c: &gantry_config::SizeClassConfig) -> Self {
        Self {
            history_size: c.history_size,
            failure_cache_duration: c.failure_cache_duration,
            minimum_execution_timeout: c.minimum_execution_timeout,
            acceptable_time_exponent: c.acceptable_time_exponent,
            hedge_multiplier: c.hedge_multiplier,
            success_threshold: 0.5,
            exploration_factor: c.exploration_factor,
            prior_successes: 1.0,
            prior_failures: 1.0,
        }
    }
}

fn check(ok: bool, field: &'static str, reason: impl FnOnce() -> String) -> Result<(), Error> {
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidConfig { field, reason: reason() })
    }
}

impl SelectionConfig {
    /// Checks every field's range.
    pub fn validate(&self) -> Result<(), Error> {
        check(self.history_size >= 1, "history_size", || "must be at least 1".into())?;
        check(!self.minimum_execution_timeout.is_zero(), "minimum_execution_timeout", || "must be positive".into())?;
        let x = self.acceptable_time_exponent;
        check(x.is_finite() && x >= 0.0, "acceptable_time_exponent", || format!("must be finite and >= 0, got {x}"))?;
        let m = self.hedge_multiplier;
        check(m.is_finite() && m >= 1.0, "hedge_multiplier", || format!("must be finite and >= 1, got {m}"))?;
        let t = self.success_threshold;
        check((0.0..=1.0).contains(&t), "success_threshold", || format!("must be in [0, 1], got {t}"))?;
        let e = self.exploration_factor;
        check((0.0..=0.5).contains(&e), "exploration_factor", || format!("must be in [0, 0.5], got {e}"))?;
        let a = self.prior_successes;
        check(a.is_finite() && a > 0.0, "prior_successes", || format!("must be finite and > 0, got {a}"))?;
        let b = self.prior_failures;
        check(b.is_finite() && b > 0.0, "prior_failures", || format!("must be finite and > 0, got {b}"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_spec() {
        let c = SelectionConfig::default();
        assert_eq!(c.history_size, 32);
        assert_eq!(c.failure_cache_duration, Duration::from_secs(86_400));
        assert_eq!(c.minimum_execution_timeout, Duration::from_secs(10));
        assert_eq!(c.acceptable_time_exponent, 0.1);
        assert_eq!(c.hedge_multiplier, 1.2);
        c.validate().unwrap();
    }

    #[test]
    fn validation_names_the_bad_field() {
        let cases: Vec<(SelectionConfig, &str)> = vec![
            (SelectionConfig { history_size: 0, ..Default::default() }, "history_size"),
            (
                SelectionConfig { minimum_execution_timeout: Duration::ZERO, ..Default::default() },
                "minimum_execution_timeout",
            ),
            (SelectionConfig { acceptable_time_exponent: -0.1, ..Default::default() }, "acceptable_time_exponent"),
            (SelectionConfig { hedge_multiplier: 0.9, ..Default::default() }, "hedge_multiplier"),
            (SelectionConfig { success_threshold: 1.5, ..Default::default() }, "success_threshold"),
            (SelectionConfig { exploration_factor: f64::NAN, ..Default::default() }, "exploration_factor"),
            // Above 0.5 the draw ranges of the retries below and above would overlap.
            (SelectionConfig { exploration_factor: 0.6, ..Default::default() }, "exploration_factor"),
            (SelectionConfig { prior_successes: 0.0, ..Default::default() }, "prior_successes"),
            (SelectionConfig { prior_failures: f64::INFINITY, ..Default::default() }, "prior_failures"),
        ];
        for (cfg, field) in cases {
            match cfg.validate() {
                Err(Error::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: expected InvalidConfig, got {other:?}"),
            }
        }
    }

    #[test]
    fn serde_uses_seconds_and_fills_defaults() {
        let c: SelectionConfig =
            serde_json::from_str(r#"{"failure_cache_duration_s": 3600, "acceptable_time_exponent": 0.3}"#).unwrap();
        assert_eq!(c.failure_cache_duration, Duration::from_secs(3600));
        assert_eq!(c.acceptable_time_exponent, 0.3);
        assert_eq!(c.history_size, 32);
        let back: SelectionConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        assert!(serde_json::from_str::<SelectionConfig>(r#"{"histroy_size": 3}"#).is_err());
    }
}
