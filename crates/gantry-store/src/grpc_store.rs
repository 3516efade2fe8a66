//! `GrpcStore`: a `BlobStore` backed by a remote REAPI server (FindMissingBlobs and
//! ByteStream). Separate `gantry worker` processes read inputs and write outputs through
//! it; it is also the building block for a local cache in front of a remote one.

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use gantry_core::client::GrpcChannel as Channel;
use gantry_core::google::bytestream::byte_stream_client::ByteStreamClient;
use gantry_core::google::bytestream::{ReadRequest, WriteRequest};
use gantry_core::reapi::content_addressable_storage_client::ContentAddressableStorageClient;
use gantry_core::reapi::FindMissingBlobsRequest;
use gantry_core::{BlobStore, BlobStream, BlobWriter, Digest, DigestFunction, Error, Result};

pub struct GrpcStore {
    channel: Channel,
    instance: String,
}

/// Maps a remote status to the error a local backend would have returned.
pub fn status_to_error(s: tonic::Status, what: &str) -> Error {
    let msg = format!("{what}: {}", s.message());
    match s.code() {
        tonic::Code::NotFound => Error::NotFound(msg),
        tonic::Code::InvalidArgument => Error::InvalidArgument(msg),
        tonic::Code::FailedPrecondition => Error::FailedPrecondition(msg),
        tonic::Code::ResourceExhausted => Error::ResourceExhausted(msg),
        tonic::Code::OutOfRange => Error::OutOfRange(msg),
        tonic::Code::Unauthenticated => Error::Unauthenticated(msg),
        tonic::Code::PermissionDenied => Error::PermissionDenied(msg),
        tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::DeadlineExceeded => Error::Unavailable(msg),
        _ => Error::Internal(msg),
    }
}

impl GrpcStore {
    pub fn new(channel: Channel, instance: impl Into<String>) -> Self {
        GrpcStore { channel, instance: instance.into() }
    }
}

#[async_trait]
impl BlobStore for GrpcStore {
    async fn find_present(&self, digests: &[Digest]) -> Result<Vec<bool>> {
        let mut present = vec![true; digests.len()];
        let mut client = ContentAddressableStorageClient::new(self.channel.clone());
        for (ci, chunk) in digests.chunks(10_000).enumerate() {
            // One request per digest function, as the protocol carries one per request.
            for f in DigestFunction::ALL {
                let idx: Vec<usize> = (0..chunk.len()).filter(|&i| chunk[i].function == f).collect();
                if idx.is_empty() {
                    continue;
                }
                let missing = client
                    .find_missing_blobs(FindMissingBlobsRequest {
                        instance_name: self.instance.clone(),
                        blob_digests: idx.iter().map(|&i| chunk[i].to_proto()).collect(),
                        digest_function: f.to_proto(),
                    })
                    .await
                    .map_err(|s| status_to_error(s, "FindMissingBlobs"))?
                    .into_inner()
                    .missing_blob_digests;
                let missing: std::collections::HashSet<_> =
                    missing.into_iter().map(|d| (d.hash, d.size_bytes)).collect();
                for &i in &idx {
                    let d = &chunk[i];
                    if missing.contains(&(d.hash_hex(), d.size as i64)) {
                        present[ci * 10_000 + i] = false;
                    }
                }
            }
        }
        Ok(present)
    }

    async fn read(&self, digest: &Digest, offset: u64, limit: Option<u64>) -> Result<BlobStream> {
        let mut client = ByteStreamClient::new(self.channel.clone()).max_decoding_message_size(64 << 20);
        let d = *digest;
        let stream = client
            .read(ReadRequest {
                resource_name: gantry_core::resource::read_name(&self.instance, digest),
                read_offset: offset as i64,
                read_limit: limit.unwrap_or(0) as i64,
            })
            .await
            .map_err(|s| status_to_error(s, &format!("reading blob {d}")))?
            .into_inner();
        Ok(stream
            .map(move |r| r.map(|m| Bytes::from(m.data)).map_err(|s| status_to_error(s, &format!("reading blob {d}"))))
            .boxed())
    }

    async fn begin_write(&self, digest: &Digest) -> Result<Box<dyn BlobWriter>> {
        let (tx, rx) = tokio::sync::mpsc::channel::<WriteRequest>(4);
        let mut client = ByteStreamClient::new(self.channel.clone());
        let call = tokio::spawn(async move { client.write(tokio_stream::wrappers::ReceiverStream::new(rx)).await });
        let name = gantry_core::resource::upload_name(&self.instance, &uuid::Uuid::new_v4().to_string(), digest);
        Ok(Box::new(GrpcWriter { digest: *digest, name, offset: 0, tx: Some(tx), call }))
    }

    async fn check(&self) -> Result<()> {
        self.find_present(&[DigestFunction::Sha256.digest_of(b"gantry startup check")]).await.map(|_| ())
    }
}

struct GrpcWriter {
    digest: Digest,
    name: String,
    offset: u64,
    tx: Option<tokio::sync::mpsc::Sender<WriteRequest>>,
    call: tokio::task::JoinHandle<
        std::result::Result<tonic::Response<gantry_core::google::bytestream::WriteResponse>, tonic::Status>,
    >,
}

impl Drop for GrpcWriter {
    fn drop(&mut self) {
        // An abandoned write must not finish: abort the call so the server drops it.
        self.call.abort();
    }
}

impl GrpcWriter {
    async fn send(&mut self, data: Bytes, finish: bool) -> Result<()> {
        let req = WriteRequest {
            resource_name: if self.offset == 0 { self.name.clone() } else { String::new() },
            write_offset: self.offset as i64,
            finish_write: finish,
            data: data.to_vec(),
        };
        self.offset += data.len() as u64;
        let tx = self.tx.as_ref().ok_or_else(|| Error::internal("write after commit"))?;
        if tx.send(req).await.is_err() {
            // The call ended early: either the server already has the blob or it failed.
            return Ok(());
        }
        Ok(())
    }
}

#[async_trait]
impl BlobWriter for GrpcWriter {
    fn committed(&self) -> u64 {
        self.offset
    }

    async fn write(&mut self, chunk: Bytes) -> Result<()> {
        // Keep messages well under the default 4 MiB gRPC limit.
        for part in chunk.chunks(1 << 20) {
            self.send(Bytes::copy_from_slice(part), false).await?;
        }
        Ok(())
    }

    async fn commit(mut self: Box<Self>) -> Result<()> {
        self.send(Bytes::new(), true).await?;
        self.tx.take();
        let d = self.digest;
        let res = (&mut self.call).await.map_err(|e| Error::internal(format!("upload task: {e}")))?;
        let resp = res.map_err(|s| status_to_error(s, &format!("writing blob {d}")))?.into_inner();
        if resp.committed_size != d.size as i64
            && resp.committed_size != -1
            && resp.committed_size != self.offset as i64
        {
            return Err(Error::internal(format!("writing blob {d}: server committed {} bytes", resp.committed_size)));
        }
        Ok(())
    }
}
