//! Bazel's RequestMetadata: who is asking (invocation, action mnemonic, target,
//! configuration), sent as a binary header on every REAPI call. Services read it to
//! attribute work; a missing or undecodable header attributes it to no one.

use prost::Message;

use crate::reapi::RequestMetadata;

/// The header REAPI clients send RequestMetadata in.
pub const METADATA_HEADER: &str = "build.bazel.remote.execution.v2.requestmetadata-bin";

/// The request's RequestMetadata; None when absent or undecodable.
pub fn request_metadata<T>(req: &tonic::Request<T>) -> Option<RequestMetadata> {
    let bytes = req.metadata().get_bin(METADATA_HEADER)?.to_bytes().ok()?;
    RequestMetadata::decode(bytes).ok()
}
