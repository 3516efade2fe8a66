//! The crate's single error type. Every fallible public function returns
//! [`BatchError`], so the gRPC service and CLI can map one enum to status
//! codes / exit codes.

use std::path::PathBuf;

/// Everything that can go wrong in `gantry-batch`.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// A Bazel label failed validation; `reason` says which part is wrong.
    #[error("invalid label `{label}`: {reason}")]
    InvalidLabel { label: String, reason: String },

    /// A line of a `targets.txt` file could not be parsed (1-based line number).
    #[error("targets file line {line}: {reason}")]
    TargetsLine { line: usize, reason: String },

    /// The build context JSON is malformed or inconsistent.
    #[error("invalid build context: {0}")]
    InvalidContext(String),

    /// A history JSONL line could not be parsed (1-based line number).
    #[error("history line {line}: {reason}")]
    HistoryLine { line: usize, reason: String },

    /// An RFC 3339 timestamp could not be parsed.
    #[error("invalid RFC 3339 timestamp `{value}`: {reason}")]
    InvalidTimestamp { value: String, reason: String },

    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    /// Training could not produce a model (e.g. an empty window).
    #[error("training failed: {0}")]
    Training(String),

    /// A model could not produce an estimate (missing model, non-finite output).
    /// The planner turns this into a `*_ESTIMATE_ERROR` batch.
    #[error("estimate unavailable: {0}")]
    Estimate(String),

    /// Model directory is missing files or holds an incompatible model.
    #[error("model directory {dir}: {reason}")]
    ModelDir { dir: PathBuf, reason: String },

    /// Underlying I/O failure, with the path involved when known.
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// JSON (de)serialisation failure.
    #[error("JSON error: {0}")]
    Json(#[from] serde_json::Error),
}

impl BatchError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        BatchError::Io { path: path.into(), source }
    }
}

/// Convenience alias used throughout the crate.
pub type Result<T, E = BatchError> = std::result::Result<T, E>;
