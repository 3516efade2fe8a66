//! `IntegrityStore`: a decorator that hashes every byte written and checks it against the
//! claimed digest before the inner store publishes it. A wrong size or hash fails with
//! INVALID_ARGUMENT and the inner write is dropped, so nothing is stored.
//!
//! It also answers for the empty blob, which REAPI clients may reference without ever
//! uploading it.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use gantry_core::{BlobStore, BlobStream, BlobWriter, Digest, Error, Hasher, Result, StoreUsage};

/// Chunks larger than this are hashed on the blocking pool, so a 64 MiB upload does not
/// stall the async workers.
const INLINE_HASH_LIMIT: usize = 256 << 10;

pub struct IntegrityStore {
    inner: Arc<dyn BlobStore>,
}

impl IntegrityStore {
    pub fn new(inner: Arc<dyn BlobStore>) -> Self {
        IntegrityStore { inner }
    }
}

#[async_trait]
impl BlobStore for IntegrityStore {
    async fn find_present(&self, digests: &[Digest]) -> Result<Vec<bool>> {
        // The empty blob is never stored, so the inner store is not asked for it: a miss
        // there can cost a look on disk (every no-op action's stdout and stderr are it).
        if !digests.iter().any(Digest::is_empty_blob) {
            return self.inner.find_present(digests).await;
        }
        let stored: Vec<Digest> = digests.iter().filter(|d| !d.is_empty_blob()).copied().collect();
        let mut inner = if stored.is_empty() { vec![] } else { self.inner.find_present(&stored).await? }.into_iter();
        Ok(digests.iter().map(|d| d.is_empty_blob() || inner.next().unwrap_or(false)).collect())
    }

    async fn read(&self, digest: &Digest, offset: u64, limit: Option<u64>) -> Result<BlobStream> {
        if digest.is_empty_blob() {
            gantry_core::blob_store::read_range(digest, offset, limit)?;
            return Ok(futures::stream::empty().boxed());
        }
        self.inner.read(digest, offset, limit).await
    }

    async fn begin_write(&self, digest: &Digest) -> Result<Box<dyn BlobWriter>> {
        let inner = if digest.is_empty_blob() { None } else { Some(self.inner.begin_write(digest).await?) };
        Ok(Box::new(VerifyingWriter { inner, expected: *digest, hasher: Some(digest.function.hasher()) }))
    }

    fn usage(&self) -> StoreUsage {
        self.inner.usage()
    }

    async fn check(&self) -> Result<()> {
        self.inner.check().await
    }
}

struct VerifyingWriter {
    /// None for the empty blob, which is never stored.
    inner: Option<Box<dyn BlobWriter>>,
    expected: Digest,
    hasher: Option<Hasher>,
}

#[async_trait]
impl BlobWriter for VerifyingWriter {
    fn committed(&self) -> u64 {
        self.hasher.as_ref().map_or(0, |h| h.len())
    }

    async fn write(&mut self, chunk: Bytes) -> Result<()> {
        let mut hasher = self.hasher.take().ok_or_else(|| Error::internal("writer used after a failed write"))?;
        let total = hasher.len() + chunk.len() as u64;
        if total > self.expected.size {
            return Err(Error::invalid(format!(
                "blob {}: received at least {total} bytes, more than the {} the digest declares",
                self.expected, self.expected.size
            )));
        }
        let chunk = if chunk.len() > INLINE_HASH_LIMIT {
            let (h, c) = tokio::task::spawn_blocking(move || {
                hasher.update(&chunk);
                (hasher, chunk)
            })
            .await
            .map_err(|e| Error::internal(format!("hashing task failed: {e}")))?;
            hasher = h;
            c
        } else {
            hasher.update(&chunk);
            chunk
        };
        if let Some(inner) = self.inner.as_mut() {
            inner.write(chunk).await?;
        }
        self.hasher = Some(hasher);
        Ok(())
    }

    fn buffered(&self) -> u64 {
        self.inner.as_ref().map_or(0, |w| w.buffered())
    }

    async fn spill(&mut self) -> Result<()> {
        match self.inner.as_mut() {
            Some(w) => w.spill().await,
            None => Ok(()),
        }
    }

    async fn commit(self: Box<Self>) -> Result<()> {
        let hasher = self.hasher.ok_or_else(|| Error::internal("writer used after a failed write"))?;
        let actual = hasher.finish();
        if actual.size != self.expected.size {
            return Err(Error::invalid(format!(
                "blob {}: received {} bytes, the digest declares {}",
                self.expected, actual.size, self.expected.size
            )));
        }
        if actual != self.expected {
            return Err(Error::invalid(format!(
                "blob {}: data hashes to {} ({}), not the claimed digest",
                self.expected,
                actual.hash_hex(),
                actual.function.name()
            )));
        }
        match self.inner {
            Some(inner) => inner.commit().await,
            None => Ok(()),
        }
    }
}
