//! The crate's error type; each variant maps to a gRPC code through `gantry_core::Error`.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum SubmitError {
    /// A request field is wrong; the message names it.
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    /// The request is valid but the change is in the wrong state for it.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The queue is not configured or not running.
    #[error("{0}")]
    Unavailable(String),
    #[error("git: {0}")]
    Git(#[from] crate::git::GitError),
    #[error(transparent)]
    Store(#[from] gantry_core::Error),
    #[error("planner: {0}")]
    Planner(#[from] gantry_queue::QueueError),
    #[error("queue record: {0}")]
    Json(#[from] serde_json::Error),
    #[error("queue metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

impl From<SubmitError> for gantry_core::Error {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::InvalidArgument(m) => gantry_core::Error::InvalidArgument(m),
            SubmitError::NotFound(m) => gantry_core::Error::NotFound(m),
            SubmitError::FailedPrecondition(m) => gantry_core::Error::FailedPrecondition(m),
            SubmitError::Unavailable(m) => gantry_core::Error::Unavailable(m),
            SubmitError::Store(e) => e,
            other => gantry_core::Error::Internal(other.to_string()),
        }
    }
}

impl From<SubmitError> for tonic::Status {
    fn from(e: SubmitError) -> Self {
        gantry_core::Error::from(e).into()
    }
}
