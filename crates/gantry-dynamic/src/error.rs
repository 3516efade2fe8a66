//! The crate's single error type.
//!
//! The state machine itself never fails (bad or late events are ignored and
//! counted, see [`crate::coordinator`]); errors come from persisted data and
//! from the invariant audit.

use thiserror::Error;

/// Everything that can go wrong in this crate.
#[derive(Debug, Error)]
pub enum Error {
    /// The persisted delay history could not be parsed or serialized.
    #[error("delay history JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The persisted delay history was written by an incompatible version.
    #[error("delay history has version {found}, this build understands version {expected}")]
    UnsupportedVersion { found: u32, expected: u32 },
    /// A configuration value is out of its valid range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A trace of coordinator events and commands broke a race invariant.
    #[error("race invariant violated at step {step}: {message}")]
    InvariantViolated { step: usize, message: String },
}
