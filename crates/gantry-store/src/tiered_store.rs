//! `TieredStore` (`[cas.local]`): a per-machine filesystem tier in front of a shared
//! remote store (the S3 bucket).
//!
//! - The remote store is the truth. A write is acknowledged only when the remote commit
//!   succeeded; the local copy is committed after it and only as a cache (its failure is
//!   logged, not returned), so the tier never holds a blob the bucket was never given.
//! - A whole-blob read that misses the tier streams from the remote store and fills the
//!   tier as the bytes go by; the fill is hash-checked (the tier sits behind its own
//!   `IntegrityStore`), so a corrupt remote object never enters the tier. Ranged reads
//!   that miss go to the remote store and do not fill.
//! - FindMissingBlobs answers from the tier first and asks the remote store only about
//!   the rest (which answers from its record of recent confirmations before it HEADs).
//!   When the bucket expires objects (`with_remote_presence`), the remote store alone
//!   answers: "present" must mean the bucket keeps the blob for its promised lifetime,
//!   which the tier cannot know.
//! - Losing the tier's directory loses nothing: `FsStore` reports a vanished file as a
//!   miss, and the read falls through to the remote store.
//! - The tier's LRU is this machine's: frontends sharing a bucket do not share tiers.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use gantry_core::{BlobStore, BlobStream, BlobWriter, Digest, Result, StoreUsage};

use crate::IntegrityStore;

pub struct TieredStore {
    /// The tier behind its own `IntegrityStore`: fills from the remote store go here.
    local: Arc<dyn BlobStore>,
    /// The tier itself: uploads go here, since the `IntegrityStore` in front of this
    /// whole store already verifies them before `commit` reaches us.
    local_raw: Arc<dyn BlobStore>,
    remote: Arc<dyn BlobStore>,
    /// Presence is the remote store's answer alone (see the module doc).
    remote_presence: bool,
}

impl TieredStore {
    /// `local` is wrapped in an `IntegrityStore` here, so fills from the remote store are
    /// verified like client uploads.
    pub fn new(local: Arc<dyn BlobStore>, remote: Arc<dyn BlobStore>) -> Self {
        TieredStore {
            local: Arc::new(IntegrityStore::new(local.clone())),
            local_raw: local,
            remote,
            remote_presence: false,
        }
    }

    /// FindMissingBlobs asks the remote store about every blob: for a bucket with a
    /// lifecycle rule, whose answer carries the promise of a lifetime.
    pub fn with_remote_presence(mut self) -> Self {
        self.remote_presence = true;
        self
    }

    /// A writer into the tier, or None when the tier cannot take the blob (too large for
    /// it, or its disk failing): the tier is a cache, so that only costs a later fill.
    async fn local_writer(&self, tier: &Arc<dyn BlobStore>, digest: &Digest) -> Option<Box<dyn BlobWriter>> {
        match tier.begin_write(digest).await {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::debug!(blob = %digest, error = %e, "not caching the blob in the local tier");
                None
            }
        }
    }
}

#[async_trait]
impl BlobStore for TieredStore {
    async fn find_present(&self, digests: &[Digest]) -> Result<Vec<bool>> {
        if self.remote_presence {
            return self.remote.find_present(digests).await;
        }
        let mut present = match self.local.find_present(digests).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "local tier lookup failed; asking the remote store");
                vec![false; digests.len()]
            }
        };
        let unknown: Vec<usize> = (0..digests.len()).filter(|&i| !present[i]).collect();
        if unknown.is_empty() {
            return Ok(present);
        }
        let ask: Vec<Digest> = unknown.iter().map(|&i| digests[i]).collect();
        // Remote errors propagate: an unreachable bucket is UNAVAILABLE, never "missing".
        let remote = self.remote.find_present(&ask).await?;
        for (i, p) in unknown.into_iter().zip(remote) {
            present[i] = p;
        }
        Ok(present)
    }

    async fn read(&self, digest: &Digest, offset: u64, limit: Option<u64>) -> Result<BlobStream> {
        match self.local.read(digest, offset, limit).await {
            Ok(s) => return Ok(s),
            Err(e) if e.is_not_found() => {}
            // The tier is a cache: a broken disk costs speed, not the read.
            Err(e) => {
                tracing::warn!(blob = %digest, error = %e, "local tier read failed; reading from the remote store")
            }
        }
        let whole = offset == 0 && limit.is_none_or(|l| l >= digest.size);
        let stream = self.remote.read(digest, offset, limit).await?;
        if !whole {
            return Ok(stream);
        }
        let Some(writer) = self.local_writer(&self.local, digest).await else { return Ok(stream) };
        // Tee: every chunk goes to the client and into the tier; the tier's copy is
        // committed (and verified) only once the last chunk passed. A client that stops
        // reading drops the writer, which leaves nothing in the tier.
        let d = *digest;
        let tee = futures::stream::unfold((stream, Some(writer)), move |(mut stream, mut writer)| async move {
            match stream.next().await {
                Some(Ok(chunk)) => {
                    if let Some(w) = writer.as_mut()
                        && let Err(e) = w.write(chunk.clone()).await
                    {
                        tracing::warn!(blob = %d, error = %e, "filling the local tier failed");
                        writer = None;
                    }
                    Some((Ok(chunk), (stream, writer)))
                }
                Some(Err(e)) => Some((Err(e), (stream, None))),
                None => {
                    if let Some(w) = writer.take()
                        && let Err(e) = w.commit().await
                    {
                        tracing::warn!(blob = %d, error = %e, "filling the local tier failed");
                    }
                    None
                }
            }
        });
        Ok(tee.boxed())
    }

    async fn begin_write(&self, digest: &Digest) -> Result<Box<dyn BlobWriter>> {
        let remote = self.remote.begin_write(digest).await?;
        let local = self.local_writer(&self.local_raw, digest).await;
        Ok(Box::new(TieredWriter { remote, local, digest: *digest }))
    }

    fn usage(&self) -> StoreUsage {
        self.local.usage()
    }

    async fn check(&self) -> Result<()> {
        self.remote.check().await?;
        self.local.check().await
    }
}

struct TieredWriter {
    remote: Box<dyn BlobWriter>,
    local: Option<Box<dyn BlobWriter>>,
    digest: Digest,
}

#[async_trait]
impl BlobWriter for TieredWriter {
    fn committed(&self) -> u64 {
        self.remote.committed()
    }

    async fn write(&mut self, chunk: Bytes) -> Result<()> {
        if let Some(w) = self.local.as_mut()
            && let Err(e) = w.write(chunk.clone()).await
        {
            tracing::warn!(blob = %self.digest, error = %e, "writing to the local tier failed; the upload goes on");
            self.local = None;
        }
        self.remote.write(chunk).await
    }

    fn buffered(&self) -> u64 {
        self.remote.buffered() + self.local.as_ref().map_or(0, |w| w.buffered())
    }

    async fn spill(&mut self) -> Result<()> {
        if let Some(w) = self.local.as_mut()
            && let Err(e) = w.spill().await
        {
            tracing::warn!(blob = %self.digest, error = %e, "spilling to the local tier failed; the upload goes on without it");
            self.local = None;
        }
        self.remote.spill().await
    }

    async fn commit(self: Box<Self>) -> Result<()> {
        // The bucket first: only a blob the bucket holds may be acknowledged or cached.
        self.remote.commit().await?;
        if let Some(w) = self.local
            && let Err(e) = w.commit().await
        {
            tracing::warn!(blob = %self.digest, error = %e, "caching the upload in the local tier failed");
        }
        Ok(())
    }
}
