//! The crate's single error type; each variant maps to a gRPC code.

/// Everything `gantry run` can fail with before or around the race.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad command line: a path outside the root, an output that is also an input...
    #[error("{0}")]
    InvalidArgument(String),
    /// Storage, I/O or protocol errors from the shared gantry libraries.
    #[error(transparent)]
    Core(#[from] gantry_core::Error),
    /// The remote server refused or failed a call.
    #[error("{what}: {}: {}", .status.code(), .status.message())]
    Remote { what: String, status: tonic::Status },
    /// The local history database could not be used.
    #[error("history database {path}: {source}")]
    History { path: String, source: sqlx::Error },
    /// Persisted race history could not be read or written.
    #[error(transparent)]
    Dynamic(#[from] gantry_dynamic::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn invalid(msg: impl Into<String>) -> Error {
        Error::InvalidArgument(msg.into())
    }

    pub fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::Core(gantry_core::Error::io(context, source))
    }

    pub fn remote(what: impl Into<String>, status: tonic::Status) -> Error {
        Error::Remote { what: what.into(), status }
    }

    pub fn code(&self) -> tonic::Code {
        match self {
            Error::InvalidArgument(_) => tonic::Code::InvalidArgument,
            Error::Core(e) => e.code(),
            Error::Remote { status, .. } => status.code(),
            Error::History { .. } => tonic::Code::Unavailable,
            Error::Dynamic(_) => tonic::Code::DataLoss,
        }
    }
}
