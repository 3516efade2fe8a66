//! The crate's single error type. Every fallible public function returns
//! [`Error`], so the scheduler and the CLI map one enum to gRPC statuses or
//! exit codes.

use crate::SizeClass;

/// Everything that can go wrong in `gantry-sizeclass`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A set of size classes was empty.
    #[error("no size classes given")]
    NoSizeClasses,

    /// Size classes are positive integers; 0 was given.
    #[error("size class 0 is invalid: size classes are positive integers")]
    ZeroSizeClass,

    /// A class was named that is not among the available classes (or, for
    /// recording, is larger than the largest class).
    #[error("size class {class} is not among the available size classes {available:?}")]
    UnknownSizeClass { class: SizeClass, available: Vec<SizeClass> },

    /// A [`crate::SelectionConfig`] field is out of range.
    #[error("invalid size class configuration: `{field}` {reason}")]
    InvalidConfig { field: &'static str, reason: String },

    /// The random draw handed to selection was not in `[0, 1)`.
    #[error("random draw {0} is not in [0, 1)")]
    InvalidDraw(f64),

    /// The requested execution timeout was zero.
    #[error("requested execution timeout must be positive")]
    ZeroRequestedTimeout,

    /// An execution report contradicts the retry rule (e.g. a largest-class
    /// retry outcome for an execution that was not retried).
    #[error("inconsistent execution report: {0}")]
    InconsistentExecution(String),

    /// Persisted statistics could not be decoded.
    #[error("invalid size class statistics: {0}")]
    StatsFormat(String),

    /// Persisted statistics carry a format version this crate cannot read.
    #[error("unsupported size class statistics version {found} (supported: {supported})")]
    StatsVersion { found: u64, supported: u64 },

    /// A fleet specification such as `1:48,2:24` is malformed.
    /// `entry` is 1-based; `text` is the offending comma-separated entry.
    #[error("fleet spec entry {entry} (`{text}`): {reason}")]
    FleetSpec { entry: usize, text: String, reason: String },

    /// A trace JSONL line is malformed (1-based line number).
    #[error("trace line {line}: {reason}")]
    TraceLine { line: usize, reason: String },

    /// Reading the trace failed (1-based line number of the failed read).
    #[error("reading trace line {line}: {message}")]
    TraceIo { line: usize, message: String },

    /// A trace action lacks a duration for a class the fleet has.
    #[error("trace action #{index} (key `{key}`) has no duration for fleet size class {class}")]
    TraceMissingClass { index: usize, key: String, class: SizeClass },

    /// A simulation or synthetic-workload parameter is out of range.
    #[error("invalid simulation configuration: {0}")]
    InvalidSim(String),
}
