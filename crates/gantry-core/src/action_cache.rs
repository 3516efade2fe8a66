//! The action cache trait: ActionResults keyed by instance name and action digest.
//!
//! Instance names partition the cache: a lookup under one instance never returns an entry
//! stored under another. Decorators (such as the completeness check in gantry-store)
//! implement the same trait around an inner cache.

use async_trait::async_trait;

use crate::{reapi::ActionResult, Digest, Result};

#[async_trait]
pub trait ActionCache: Send + Sync + 'static {
    async fn get(&self, instance: &str, action: &Digest) -> Result<Option<ActionResult>>;
    async fn put(&self, instance: &str, action: &Digest, result: &ActionResult) -> Result<()>;

    /// Startup check that the backend is reachable and usable.
    async fn check(&self) -> Result<()> {
        Ok(())
    }
}

/// The blobs an ActionResult references: files, stdout and stderr (`direct`), and the
/// Tree blobs of output directories (`trees`, whose files the caller may also need).
/// Errors name the malformed field.
pub struct ReferencedBlobs {
    pub direct: Vec<Digest>,
    pub trees: Vec<Digest>,
}

pub fn referenced_blobs(function: crate::DigestFunction, result: &ActionResult) -> Result<ReferencedBlobs> {
    let mut direct = Vec::new();
    for (i, o) in result.output_files.iter().enumerate() {
        direct.push(Digest::from_proto(function, o.digest.as_ref(), &format!("output_files[{i}].digest"))?);
    }
    let mut trees = Vec::new();
    for (i, o) in result.output_directories.iter().enumerate() {
        trees.push(Digest::from_proto(
            function,
            o.tree_digest.as_ref(),
            &format!("output_directories[{i}].tree_digest"),
        )?);
    }
    for (d, field) in [(&result.stdout_digest, "stdout_digest"), (&result.stderr_digest, "stderr_digest")] {
        if d.is_some() {
            direct.push(Digest::from_proto(function, d.as_ref(), field)?);
        }
    }
    Ok(ReferencedBlobs { direct, trees })
}
