//! ContentAddressableStorage: FindMissingBlobs, BatchUpdateBlobs, BatchReadBlobs and
//! GetTree (paged). Chunked-blob RPCs (SplitBlob and friends) are not offered and are
//! not advertised in GetCapabilities.

use gantry_core::auth::{require, Permission};
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use gantry_core::reapi::content_addressable_storage_server::ContentAddressableStorage;
use gantry_core::reapi::{self, batch_read_blobs_response, batch_update_blobs_response, compressor};
use gantry_core::resource::Compressor;
use gantry_core::{BlobStore, Digest, DigestFunction, Error, Result};
use prost::Message;
use tonic::{Request, Response, Status};

use crate::compression;
use crate::metrics::Metrics;

/// Blobs in one batch are written or read this many at a time. Journaled writes (see
/// gantry-store's `FsStore`) share one sync per round, so the more in flight, the fewer
/// syncs; their waits hold no thread.
const BATCH_CONCURRENCY: usize = 64;
const DEFAULT_TREE_PAGE: usize = 1000;
const MAX_TREE_PAGE: usize = 10_000;

pub struct CasService {
    cas: Arc<dyn BlobStore>,
    metrics: Arc<Metrics>,
    max_batch_size: u64,
    max_proto_size: u64,
}

impl CasService {
    pub fn new(cas: Arc<dyn BlobStore>, metrics: Arc<Metrics>, max_batch_size: u64, max_proto_size: u64) -> Self {
        CasService { cas, metrics, max_batch_size, max_proto_size }
    }

    fn check_batch_size(&self, field: &str, total: u64) -> Result<()> {
        if total > self.max_batch_size {
            return Err(Error::invalid(format!(
                "{field}: {total} bytes in one batch exceed max_batch_total_size_bytes {}; use ByteStream",
                self.max_batch_size
            )));
        }
        Ok(())
    }

    async fn update_one(
        &self,
        f: DigestFunction,
        i: usize,
        r: reapi::batch_update_blobs_request::Request,
    ) -> Result<()> {
        let d = Digest::from_proto(f, r.digest.as_ref(), &format!("requests[{i}].digest"))?;
        if d.size > self.max_batch_size {
            // Checked before decompressing: the declared size sizes the output buffer.
            return Err(Error::invalid(format!(
                "requests[{i}]: blob {d} is larger than max_batch_total_size_bytes {}; use ByteStream",
                self.max_batch_size
            )));
        }
        let data = match Compressor::from_proto(r.compressor).map_err(|e| e.context(format_args!("requests[{i}]")))? {
            Compressor::Identity => r.data,
            Compressor::Zstd => {
                compression::decompress(&r.data, d.size).map_err(|e| e.context(format_args!("requests[{i}]")))?
            }
        };
        self.cas.put(&d, Bytes::from(data)).await.map_err(|e| e.context(format_args!("requests[{i}]")))
    }
}

/// The directories of the tree under `root`, breadth first, from `skip` on, at most
/// `take` of them. Subdirectories missing from the CAS are left out, as REAPI allows.
/// A breadth-first walk of a Directory tree that hands out pages and resumes where the
/// last page stopped, so streaming a whole tree reads each directory once.
struct TreeWalk {
    root: Digest,
    queue: VecDeque<Digest>,
    seen: HashSet<Digest>,
    /// Directories passed so far, in BFS order: what a page token counts.
    index: usize,
    max_proto: u64,
}

impl TreeWalk {
    fn new(root: Digest, max_proto: u64) -> Self {
        TreeWalk { root, queue: VecDeque::from([root]), seen: HashSet::from([root]), index: 0, max_proto }
    }

    /// The next directory in BFS order; missing subdirectories are skipped (the root is
    /// NOT_FOUND).
    async fn next(&mut self, cas: &dyn BlobStore) -> Result<Option<reapi::Directory>> {
        while let Some(d) = self.queue.pop_front() {
            gantry_execution::operations::check_proto_size(&d, "directory", self.max_proto)?;
            let bytes = match cas.get(&d).await {
                Ok(b) => b,
                Err(e) if e.is_not_found() && d != self.root => continue,
                Err(e) if e.is_not_found() => {
                    return Err(Error::not_found(format!("root_digest: directory {d} is not in the CAS")));
                }
                Err(e) => return Err(e),
            };
            let dir = reapi::Directory::decode(bytes)
                .map_err(|e| Error::invalid(format!("blob {d} in the tree is not a Directory: {e}")))?;
            for (j, sub) in dir.directories.iter().enumerate() {
                let sd =
                    Digest::from_proto(d.function, sub.digest.as_ref(), &format!("directory {d}: directories[{j}]"))?;
                if self.seen.insert(sd) {
                    self.queue.push_back(sd);
                }
            }
            self.index += 1;
            return Ok(Some(dir));
        }
        Ok(None)
    }

    /// The next `take` directories (fewer at the end of the tree).
    async fn page(&mut self, cas: &dyn BlobStore, take: usize) -> Result<Vec<reapi::Directory>> {
        let mut page = Vec::new();
        while page.len() < take {
            match self.next(cas).await? {
                Some(dir) => page.push(dir),
                None => break,
            }
        }
        Ok(page)
    }
}

type TreeStream = futures::stream::BoxStream<'static, Result<reapi::GetTreeResponse, Status>>;
type ChunkStream = futures::stream::BoxStream<'static, Result<reapi::GetChunkMappingResponse, Status>>;

#[tonic::async_trait]
impl ContentAddressableStorage for CasService {
    async fn find_missing_blobs(
        &self,
        request: Request<reapi::FindMissingBlobsRequest>,
    ) -> Result<Response<reapi::FindMissingBlobsResponse>, Status> {
        require(&request, Permission::Read, &request.get_ref().instance_name)?;
        let req = request.into_inner();
        let f = DigestFunction::from_proto(req.digest_function)?;
        let digests = req
            .blob_digests
            .iter()
            .enumerate()
            .map(|(i, d)| Digest::from_proto(f, Some(d), &format!("blob_digests[{i}]")))
            .collect::<Result<Vec<_>>>()?;
        let present = self.cas.find_present(&digests).await?;
        let missing = digests.iter().zip(present).filter(|(_, p)| !p).map(|(d, _)| d.to_proto()).collect();
        Ok(Response::new(reapi::FindMissingBlobsResponse { missing_blob_digests: missing }))
    }

    async fn batch_update_blobs(
        &self,
        request: Request<reapi::BatchUpdateBlobsRequest>,
    ) -> Result<Response<reapi::BatchUpdateBlobsResponse>, Status> {
        require(&request, Permission::WriteCas, &request.get_ref().instance_name)?;
        let req = request.into_inner();
        let f = DigestFunction::from_proto(req.digest_function)?;
        let total: u64 = req.requests.iter().map(|r| r.data.len() as u64).sum();
        self.check_batch_size("requests", total)?;
        self.metrics.bytes_received.inc_by(total);
        let responses = futures::stream::iter(req.requests.into_iter().enumerate())
            .map(|(i, r)| async move {
                let digest = r.digest.clone();
                let status = match self.update_one(f, i, r).await {
                    Ok(()) => gantry_core::google::rpc::Status::default(),
                    Err(e) => e.to_rpc_status(),
                };
                batch_update_blobs_response::Response { digest, status: Some(status) }
            })
            .buffered(BATCH_CONCURRENCY)
            .collect()
            .await;
        Ok(Response::new(reapi::BatchUpdateBlobsResponse { responses }))
    }

    async fn batch_read_blobs(
        &self,
        request: Request<reapi::BatchReadBlobsRequest>,
    ) -> Result<Response<reapi::BatchReadBlobsResponse>, Status> {
        require(&request, Permission::Read, &request.get_ref().instance_name)?;
        let req = request.into_inner();
        let f = DigestFunction::from_proto(req.digest_function)?;
        let digests = req
            .digests
            .iter()
            .enumerate()
            .map(|(i, d)| Digest::from_proto(f, Some(d), &format!("digests[{i}]")))
            .collect::<Result<Vec<_>>>()?;
        // Saturating: client-declared sizes must not wrap the sum past the limit.
        let total = digests.iter().fold(0u64, |a, d| a.saturating_add(d.size));
        self.check_batch_size("digests", total)?;
        let zstd = req.acceptable_compressors.contains(&(compressor::Value::Zstd as i32));
        let responses: Vec<_> = futures::stream::iter(digests)
            .map(|d| async move {
                let (data, comp, status) = match self.cas.get(&d).await {
                    Ok(data) => {
                        self.metrics.bytes_sent.inc_by(data.len() as u64);
                        match zstd.then(|| compression::compress(&data)) {
                            Some(Ok(c)) => (c, compressor::Value::Zstd, Default::default()),
                            Some(Err(e)) => (vec![], compressor::Value::Identity, e.to_rpc_status()),
                            None => (data.to_vec(), compressor::Value::Identity, Default::default()),
                        }
                    }
                    // The entry names its digest already: a miss says only that, so a
                    // batch of many misses stays within the response limit.
                    Err(e) if e.is_not_found() => (vec![], compressor::Value::Identity, not_found_status()),
                    Err(e) => (vec![], compressor::Value::Identity, e.to_rpc_status()),
                };
                batch_read_blobs_response::Response {
                    digest: Some(d.to_proto()),
                    data,
                    compressor: comp as i32,
                    status: Some(status),
                }
            })
            .buffered(BATCH_CONCURRENCY)
            .collect()
            .await;
        Ok(Response::new(reapi::BatchReadBlobsResponse { responses }))
    }

    type GetTreeStream = TreeStream;

    async fn get_tree(&self, request: Request<reapi::GetTreeRequest>) -> Result<Response<TreeStream>, Status> {
        require(&request, Permission::Read, &request.get_ref().instance_name)?;
        let req = request.into_inner();
        let f = DigestFunction::from_proto(req.digest_function)?;
        let root = Digest::from_proto(f, req.root_digest.as_ref(), "root_digest")?;
        if req.page_size < 0 {
            return Err(Error::invalid(format!("page_size {} is negative", req.page_size)).into());
        }
        let page_size = match req.page_size as usize {
            0 => DEFAULT_TREE_PAGE,
            n => n.min(MAX_TREE_PAGE),
        };
        // The page token is the number of directories already returned, in BFS order.
        let start: usize = if req.page_token.is_empty() {
            0
        } else {
            req.page_token
                .parse()
                .map_err(|_| Error::invalid(format!("page_token '{}' was not issued by this server", req.page_token)))?
        };
        // A token from an earlier call resumes by walking past what it already returned
        // (a broken stream's retry); within one call the walk goes on from page to page.
        let cas = self.cas.clone();
        let mut walk = TreeWalk::new(root, self.max_proto_size);
        while walk.index < start {
            if walk.next(cas.as_ref()).await?.is_none() {
                break;
            }
        }
        // The first page now, so a missing root is an immediate NOT_FOUND.
        let first = walk.page(cas.as_ref(), page_size).await?;
        let stream = futures::stream::try_unfold(Some((first, walk)), move |state| {
            let cas = cas.clone();
            async move {
                let Some((page, mut walk)) = state else { return Ok::<_, Error>(None) };
                // The next page is read ahead: only a page that has a successor gets a
                // token (the rest of the tree may be missing directories only).
                let position = walk.index;
                let next = if page.len() < page_size { Vec::new() } else { walk.page(cas.as_ref(), page_size).await? };
                let next_page_token = if next.is_empty() { String::new() } else { position.to_string() };
                let resp = reapi::GetTreeResponse { directories: page, next_page_token };
                Ok(Some((resp, (!next.is_empty()).then_some((next, walk)))))
            }
        })
        .map_err(Status::from);
        Ok(Response::new(stream.boxed()))
    }

    async fn split_blob(
        &self,
        _: Request<reapi::SplitBlobRequest>,
    ) -> Result<Response<reapi::SplitBlobResponse>, Status> {
        Err(Status::unimplemented("SplitBlob is not supported (split_blob_support is false)"))
    }

    type GetChunkMappingStream = ChunkStream;

    async fn get_chunk_mapping(
        &self,
        _: Request<reapi::GetChunkMappingRequest>,
    ) -> Result<Response<ChunkStream>, Status> {
        Err(Status::unimplemented("GetChunkMapping is not supported"))
    }

    async fn splice_blob(
        &self,
        _: Request<reapi::SpliceBlobRequest>,
    ) -> Result<Response<reapi::SpliceBlobResponse>, Status> {
        Err(Status::unimplemented("SpliceBlob is not supported"))
    }

    async fn register_chunk_mapping(
        &self,
        _: Request<tonic::Streaming<reapi::RegisterChunkMappingRequest>>,
    ) -> Result<Response<reapi::RegisterChunkMappingResponse>, Status> {
        Err(Status::unimplemented("RegisterChunkMapping is not supported"))
    }
}

/// The status of one missing blob in a batch response.
fn not_found_status() -> gantry_core::google::rpc::Status {
    gantry_core::google::rpc::Status {
        code: tonic::Code::NotFound as i32,
        message: "not found".into(),
        details: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts reads, to show how many times a walk fetches each directory.
    struct Counting {
        inner: gantry_store::MemoryStore,
        reads: AtomicUsize,
    }

    #[async_trait::async_trait]
    impl BlobStore for Counting {
        async fn find_present(&self, digests: &[Digest]) -> Result<Vec<bool>> {
            self.inner.find_present(digests).await
        }
        async fn read(&self, digest: &Digest, offset: u64, limit: Option<u64>) -> Result<gantry_core::BlobStream> {
            self.reads.fetch_add(1, Ordering::Relaxed);
            self.inner.read(digest, offset, limit).await
        }
        async fn begin_write(&self, digest: &Digest) -> Result<Box<dyn gantry_core::BlobWriter>> {
            self.inner.begin_write(digest).await
        }
    }

    /// Paging through a tree reads each directory once, however small the pages: the
    /// walk resumes where the last page stopped instead of starting over at the root.
    #[tokio::test]
    async fn tree_pages_resume_the_walk() {
        use prost::Message;
        let cas = Counting { inner: gantry_store::MemoryStore::new(1 << 30), reads: AtomicUsize::new(0) };
        // A chain of 60 directories, each holding the next.
        let mut child: Option<Digest> = None;
        for i in 0..60 {
            let dir = reapi::Directory {
                directories: child
                    .iter()
                    .map(|d| reapi::DirectoryNode { name: format!("d{i}"), digest: Some(d.to_proto()) })
                    .collect(),
                ..Default::default()
            };
            let bytes = dir.encode_to_vec();
            let d = DigestFunction::Sha256.digest_of(&bytes);
            cas.put(&d, bytes.into()).await.unwrap();
            child = Some(d);
        }
        let mut walk = TreeWalk::new(child.unwrap(), 4 << 20);
        let mut total = 0;
        loop {
            let page = walk.page(&cas, 5).await.unwrap();
            if page.is_empty() {
                break;
            }
            total += page.len();
        }
        assert_eq!(total, 60);
        assert_eq!(cas.reads.load(Ordering::Relaxed), 60, "each directory read once");
    }
}
