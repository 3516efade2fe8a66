//! The content-addressed blob store trait.
//!
//! Backends implement three methods: `find_present`, `read` and `begin_write`. Everything
//! else has a default built on those, and stacked behaviour (integrity checking, tiering)
//! is a decorator that implements the same trait around an inner store.

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures::stream::BoxStream;
use futures::StreamExt;

use crate::{Digest, Error, Result};

/// A stream of chunks of one blob.
pub type BlobStream = BoxStream<'static, Result<Bytes>>;

/// Occupancy figures for metrics and eviction reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreUsage {
    pub used_bytes: u64,
    pub max_bytes: u64,
    pub blobs: u64,
}

#[async_trait]
pub trait BlobStore: Send + Sync + 'static {
    /// For each digest, whether the store holds it. Every blob found is touched, so
    /// that a blob a client was just told exists is not the next one evicted.
    async fn find_present(&self, digests: &[Digest]) -> Result<Vec<bool>>;

    /// Reads `limit` bytes (all remaining bytes when `None`) starting at `offset`.
    /// Missing blobs give `NotFound`; an offset past the end gives `OutOfRange`.
    async fn read(&self, digest: &Digest, offset: u64, limit: Option<u64>) -> Result<BlobStream>;

    /// Starts writing the blob `digest`. Nothing is visible under the digest until
    /// `BlobWriter::commit` returns Ok; a writer dropped before that leaves nothing.
    async fn begin_write(&self, digest: &Digest) -> Result<Box<dyn BlobWriter>>;

    /// Current size and capacity.
    fn usage(&self) -> StoreUsage {
        StoreUsage::default()
    }

    /// Startup check that the backend is reachable and usable; errors say what is wrong.
    async fn check(&self) -> Result<()> {
        Ok(())
    }

    async fn has(&self, digest: &Digest) -> Result<bool> {
        Ok(self.find_present(std::slice::from_ref(digest)).await?[0])
    }

    /// Reads a whole blob into memory.
    async fn get(&self, digest: &Digest) -> Result<Bytes> {
        let mut stream = self.read(digest, 0, None).await?;
        let first = match stream.next().await {
            Some(chunk) => chunk?,
            None => return Ok(Bytes::new()),
        };
        // A blob that comes in one chunk (most do) is that chunk, not a copy of it. The
        // stream is still read to its end: a decorator may check the blob there.
        let second = match stream.next().await {
            Some(chunk) => chunk?,
            None => return Ok(first),
        };
        let mut buf = BytesMut::with_capacity(digest.size.min(64 << 20) as usize);
        buf.extend_from_slice(&first);
        buf.extend_from_slice(&second);
        while let Some(chunk) = stream.next().await {
            buf.extend_from_slice(&chunk?);
        }
        Ok(buf.freeze())
    }

    /// Writes a whole in-memory blob.
    async fn put(&self, digest: &Digest, data: Bytes) -> Result<()> {
        let mut w = self.begin_write(digest).await?;
        w.write(data).await?;
        w.commit().await
    }
}

/// An in-progress write of one blob. Chunks arrive in order; `committed` counts bytes
/// accepted so far, which is what a resumed ByteStream upload continues from.
#[async_trait]
pub trait BlobWriter: Send + Sync {
    fn committed(&self) -> u64;
    async fn write(&mut self, chunk: Bytes) -> Result<()>;
    /// Bytes this writer holds in memory, not yet on disk or sent: what an abandoned
    /// upload costs the server while it waits for its client.
    fn buffered(&self) -> u64 {
        0
    }
    /// Moves what `buffered` counts out of memory (to a temp file) when the writer can;
    /// the write goes on as before. Writers that cannot leave `buffered` unchanged, and
    /// the server drops such an idle upload instead when upload memory runs short.
    async fn spill(&mut self) -> Result<()> {
        Ok(())
    }
    /// Makes the blob visible under its digest, atomically. Fails with
    /// `InvalidArgument` if the bytes do not match the digest (when verified).
    async fn commit(self: Box<Self>) -> Result<()>;
}

/// Validates a read range against a blob's size and returns (offset, length).
pub fn read_range(digest: &Digest, offset: u64, limit: Option<u64>) -> Result<(u64, u64)> {
    if offset > digest.size {
        return Err(Error::OutOfRange(format!(
            "read_offset {offset} is past the end of blob {digest} ({} bytes)",
            digest.size
        )));
    }
    let remaining = digest.size - offset;
    Ok((offset, limit.map_or(remaining, |l| l.min(remaining))))
}
