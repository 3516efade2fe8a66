//! `MemoryStore` (`[cas] kind = "memory"`): blobs held in RAM under a size-bounded LRU.
//! Used in tests and as a small fast tier; its contents are lost on restart.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use gantry_core::blob_store::read_range;
use gantry_core::{BlobStore, BlobStream, BlobWriter, Digest, Error, Result, StoreUsage};

use crate::lru_index::LruIndex;

/// Chunk size of streamed reads, so a large blob is not sent as one message.
const READ_CHUNK: usize = 1 << 20;

pub struct MemoryStore {
    index: Arc<Mutex<LruIndex<Bytes>>>,
}

impl MemoryStore {
    pub fn new(max_bytes: u64) -> Self {
        MemoryStore { index: Arc::new(Mutex::new(LruIndex::new(max_bytes))) }
    }
}

#[async_trait]
impl BlobStore for MemoryStore {
    async fn find_present(&self, digests: &[Digest]) -> Result<Vec<bool>> {
        let mut idx = self.index.lock().expect("poisoned");
        Ok(digests.iter().map(|d| idx.touch(d).is_some()).collect())
    }

    async fn read(&self, digest: &Digest, offset: u64, limit: Option<u64>) -> Result<BlobStream> {
        let data = self
            .index
            .lock()
            .expect("poisoned")
            .touch(digest)
            .cloned()
            .ok_or_else(|| Error::not_found(format!("blob {digest} not found")))?;
        let (off, len) = read_range(digest, offset, limit)?;
        let slice = data.slice(off as usize..(off + len) as usize);
        let chunks: Vec<Result<Bytes>> = (0..slice.len())
            .step_by(READ_CHUNK)
            .map(|i| Ok(slice.slice(i..(i + READ_CHUNK).min(slice.len()))))
            .collect();
        Ok(futures::stream::iter(chunks).boxed())
    }

    async fn begin_write(&self, digest: &Digest) -> Result<Box<dyn BlobWriter>> {
        let max = self.index.lock().expect("poisoned").max_bytes();
        if digest.size > max {
            // INVALID_ARGUMENT, not RESOURCE_EXHAUSTED: retrying can never succeed.
            return Err(Error::invalid(format!("blob {digest} is larger than the whole store ({max} bytes)")));
        }
        Ok(Box::new(MemoryWriter {
            index: self.index.clone(),
            digest: *digest,
            // The size is the client's claim: grow with the bytes that arrive instead of
            // reserving what a 1-byte upload declares.
            buf: BytesMut::with_capacity(digest.size.min(64 << 10) as usize),
        }))
    }

    fn usage(&self) -> StoreUsage {
        let idx = self.index.lock().expect("poisoned");
        StoreUsage { used_bytes: idx.used_bytes(), max_bytes: idx.max_bytes(), blobs: idx.len() as u64 }
    }
}

struct MemoryWriter {
    index: Arc<Mutex<LruIndex<Bytes>>>,
    digest: Digest,
    buf: BytesMut,
}

#[async_trait]
impl BlobWriter for MemoryWriter {
    fn committed(&self) -> u64 {
        self.buf.len() as u64
    }

    async fn write(&mut self, chunk: Bytes) -> Result<()> {
        self.buf.extend_from_slice(&chunk);
        Ok(())
    }

    fn buffered(&self) -> u64 {
        self.buf.len() as u64
    }

    async fn commit(self: Box<Self>) -> Result<()> {
        if self.buf.len() as u64 != self.digest.size {
            return Err(Error::invalid(format!(
                "blob {}: received {} bytes, digest says {}",
                self.digest,
                self.buf.len(),
                self.digest.size
            )));
        }
        let size = self.digest.size;
        self.index.lock().expect("poisoned").insert(self.digest, size, self.buf.freeze());
        Ok(())
    }
}
