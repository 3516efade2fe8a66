//! The crate's single error type.
//!
//! Everything fallible in `gantry-queue` returns [`QueueError`]; the integrator
//! maps it onto its own error handling (gRPC status, log line, ...).

use thiserror::Error;

/// Errors reported by the planner, the conflict analyzer, the model and the simulator.
#[derive(Debug, Error)]
pub enum QueueError {
    /// A change id was enqueued twice while the first one is still known.
    #[error("change {0} is already enqueued")]
    DuplicateChange(String),
    /// An event named a change the planner has never seen.
    #[error("unknown change {0}")]
    UnknownChange(String),
    /// An event named a build the planner never started (or already forgot).
    #[error("unknown build {0}")]
    UnknownBuild(u64),
    /// `LandingFailed` named a change the planner has not landed.
    #[error("change {0} has not landed")]
    NotLanded(String),
    /// A build finished twice, or finished after it was cancelled.
    #[error("build {0} is not running")]
    BuildNotRunning(u64),
    /// The clock went backwards; the planner relies on monotonic time.
    #[error("time went backwards: {now_ms} < {last_ms}")]
    ClockWentBackwards { now_ms: u64, last_ms: u64 },
    /// The target graph has a dependency cycle, so target hashes are undefined.
    #[error("dependency cycle through target {0}")]
    DependencyCycle(String),
    /// A graph version was referenced before being registered with the analyzer.
    #[error("unknown graph version {0}")]
    UnknownGraph(String),
    /// Training was asked for but the examples cannot produce a model.
    #[error("cannot train: {0}")]
    Training(String),
    /// A trace or persisted model could not be parsed or is inconsistent.
    #[error("invalid input at line {line}: {message}")]
    InvalidInput { line: usize, message: String },
    /// JSON (de)serialisation failed.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}
