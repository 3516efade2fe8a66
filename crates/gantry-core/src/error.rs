//! The one error type of gantry's libraries. Each variant corresponds to a gRPC status code,
//! so a failure deep in a backend reaches the client with the right code and a message that
//! names what went wrong.

use std::fmt::Display;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is malformed; the message names the offending field or part.
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// Blobs a request needs are not in the CAS (FAILED_PRECONDITION with MISSING
    /// violations, so clients upload them and retry).
    #[error("{what}: missing from the CAS: {}", .digests.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))]
    MissingBlobs { what: String, digests: Vec<crate::Digest> },
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    OutOfRange(String),
    #[error("{0}")]
    Unavailable(String),
    /// No credentials, or credentials that are not valid. Says nothing of what exists.
    #[error("{0}")]
    Unauthenticated(String),
    /// A known identity without the permission the call needs.
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    Internal(String),
    /// An I/O failure with a description of what gantry was doing at the time.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
    pub fn not_found(msg: impl Into<String>) -> Self {
        Error::NotFound(msg.into())
    }
    pub fn internal(msg: impl Into<String>) -> Self {
        Error::Internal(msg.into())
    }
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }

    pub fn code(&self) -> tonic::Code {
        match self {
            Error::InvalidArgument(_) => tonic::Code::InvalidArgument,
            Error::NotFound(_) => tonic::Code::NotFound,
            Error::FailedPrecondition(_) | Error::MissingBlobs { .. } => tonic::Code::FailedPrecondition,
            Error::ResourceExhausted(_) => tonic::Code::ResourceExhausted,
            Error::OutOfRange(_) => tonic::Code::OutOfRange,
            Error::Unavailable(_) => tonic::Code::Unavailable,
            Error::Unauthenticated(_) => tonic::Code::Unauthenticated,
            Error::PermissionDenied(_) => tonic::Code::PermissionDenied,
            Error::Internal(_) => tonic::Code::Internal,
            // A missing file deep in a backend is a server fault, not the client's NOT_FOUND;
            // backends convert the cases that really mean "no such blob" themselves.
            Error::Io { source, .. } => match source.kind() {
                std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded => tonic::Code::ResourceExhausted,
                _ => tonic::Code::Internal,
            },
        }
    }

    pub fn is_not_found(&self) -> bool {
        self.code() == tonic::Code::NotFound
    }

    /// Prefix the message with what the caller was doing, keeping the code.
    pub fn context(self, ctx: impl Display) -> Self {
        match self {
            Error::InvalidArgument(m) => Error::InvalidArgument(format!("{ctx}: {m}")),
            Error::NotFound(m) => Error::NotFound(format!("{ctx}: {m}")),
            Error::FailedPrecondition(m) => Error::FailedPrecondition(format!("{ctx}: {m}")),
            Error::MissingBlobs { what, digests } => Error::MissingBlobs { what: format!("{ctx}: {what}"), digests },
            Error::ResourceExhausted(m) => Error::ResourceExhausted(format!("{ctx}: {m}")),
            Error::OutOfRange(m) => Error::OutOfRange(format!("{ctx}: {m}")),
            Error::Unavailable(m) => Error::Unavailable(format!("{ctx}: {m}")),
            Error::Unauthenticated(m) => Error::Unauthenticated(m),
            Error::PermissionDenied(m) => Error::PermissionDenied(format!("{ctx}: {m}")),
            Error::Internal(m) => Error::Internal(format!("{ctx}: {m}")),
            Error::Io { context, source } => Error::Io { context: format!("{ctx}: {context}"), source },
        }
    }

    /// The `google.rpc.Status` form, for per-item results in batch RPCs.
    /// The google.rpc.Status of this error, with its details: a PreconditionFailure with
    /// one MISSING violation per blob for `MissingBlobs` (what REAPI clients read to
    /// upload what is missing).
    pub fn to_rpc_status(&self) -> crate::google::rpc::Status {
        let mut details = vec![];
        if let Error::MissingBlobs { digests, .. } = self {
            details.push(missing_details(digests.iter().map(crate::resource::missing_subject)));
        }
        crate::google::rpc::Status { code: self.code() as i32, message: self.to_string(), details }
    }
}

/// A PreconditionFailure with one MISSING violation per subject, packed in an Any.
pub fn missing_details(subjects: impl Iterator<Item = String>) -> crate::google::protobuf::Any {
    use gantry_proto::rpc::{precondition_failure::Violation, PreconditionFailure};
    let pf = PreconditionFailure {
        violations: subjects
            .map(|s| Violation { r#type: "MISSING".into(), subject: s, description: String::new() })
            .collect(),
    };
    crate::google::protobuf::Any {
        type_url: "type.googleapis.com/google.rpc.PreconditionFailure".into(),
        value: prost::Message::encode_to_vec(&pf),
    }
}

/// Every service's errors reach the client with their code, message and details (in
/// grpc-status-details-bin), whichever call site returns them.
impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        let st = e.to_rpc_status();
        if st.details.is_empty() {
            return tonic::Status::new(e.code(), e.to_string());
        }
        tonic::Status::with_details(e.code(), e.to_string(), prost::Message::encode_to_vec(&st).into())
    }
}

/// Adds context to results at layer boundaries.
pub trait ResultExt<T> {
    fn context(self, ctx: impl Display) -> Result<T>;
}

impl<T> ResultExt<T> for Result<T> {
    fn context(self, ctx: impl Display) -> Result<T> {
        self.map_err(|e| e.context(ctx))
    }
}

impl<T> ResultExt<T> for std::io::Result<T> {
    fn context(self, ctx: impl Display) -> Result<T> {
        self.map_err(|e| Error::io(ctx.to_string(), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_keeps_code_and_prefixes_message() {
        let e = Error::invalid("hash is not hex").context("digest of blob 3");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(e.to_string(), "digest of blob 3: hash is not hex");
        let io: std::io::Result<()> = Err(std::io::Error::from(std::io::ErrorKind::NotFound));
        let e = io.context("opening blob").unwrap_err();
        assert!(!e.is_not_found(), "an I/O NotFound is an internal error");
        assert!(e.to_string().starts_with("opening blob: "));
        let s: tonic::Status = e.into();
        assert_eq!(s.code(), tonic::Code::Internal);
        assert!(s.details().is_empty());
    }

    /// Any call site that returns a `MissingBlobs` error gives the client the MISSING
    /// violations it needs to upload what is missing.
    #[test]
    fn missing_blobs_reach_the_client_with_their_violations() {
        use gantry_proto::rpc::PreconditionFailure;
        use prost::Message;
        let d = crate::DigestFunction::Sha256.digest_of(b"input");
        let s: tonic::Status = Error::MissingBlobs { what: "inputs".into(), digests: vec![d] }.into();
        assert_eq!(s.code(), tonic::Code::FailedPrecondition);
        let st = crate::google::rpc::Status::decode(s.details()).unwrap();
        assert_eq!(st.code, tonic::Code::FailedPrecondition as i32);
        assert_eq!(st.details[0].type_url, "type.googleapis.com/google.rpc.PreconditionFailure");
        let pf = PreconditionFailure::decode(st.details[0].value.as_slice()).unwrap();
        assert_eq!(pf.violations.len(), 1);
        assert_eq!(
            (pf.violations[0].r#type.as_str(), pf.violations[0].subject.clone()),
            ("MISSING", crate::resource::missing_subject(&d))
        );
    }
}
