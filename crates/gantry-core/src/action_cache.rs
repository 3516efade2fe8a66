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
