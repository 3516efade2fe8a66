use thiserror::Error;

/// Errors of the build service; each maps to a gRPC code through `gantry_core::Error`.
#[derive(Debug, Error)]
pub enum BuildsError {
    #[error("not found: {0}")]
    NotFound(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Io(String),
    #[error("{0}")]
    Internal(String),
    #[error(transparent)]
    Store(#[from] gantry_core::Error),
    #[error("training the batching models: {0}")]
    Training(#[from] gantry_batch::BatchError),
}

impl From<BuildsError> for gantry_core::Error {
    fn from(e: BuildsError) -> Self {
        match e {
            BuildsError::NotFound(m) => gantry_core::Error::NotFound(m),
            BuildsError::FailedPrecondition(m) => gantry_core::Error::FailedPrecondition(m),
            BuildsError::Store(e) => e,
            other => gantry_core::Error::Internal(other.to_string()),
        }
    }
}
