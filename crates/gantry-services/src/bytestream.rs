//! ByteStream: Read with offset and limit, resumable Write, QueryWriteStatus, for both
//! `blobs/` and `compressed-blobs/zstd/` resource names.
//!
//! An upload is a session keyed by its full `uploads/{uuid}/...` name. If the client's
//! stream breaks, the session keeps the bytes received so far; the client asks
//! QueryWriteStatus for `committed_size` and continues with a Write at that offset.
//! Sessions idle longer than `upload_idle_timeout` are dropped by a background task.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use gantry_core::google::bytestream::byte_stream_server::ByteStream;
use gantry_core::google::bytestream::{
    QueryWriteStatusRequest, QueryWriteStatusResponse, ReadRequest, ReadResponse, WriteRequest, WriteResponse,
};
use gantry_core::resource::{Compressor, ResourceName};
use gantry_core::task::{spawn_named, TaskGuard};
use gantry_core::{BlobStore, BlobWriter, Error, Result};
use tonic::{Request, Response, Status, Streaming};

use crate::compression::{StreamDecoder, StreamEncoder};
use crate::metrics::Metrics;

struct Upload {
    writer: Option<Box<dyn BlobWriter>>,
    decoder: Option<StreamDecoder>,
    /// Bytes received on the wire (compressed bytes for compressed uploads).
    received: i64,
    last_active: Instant,
}

type Sessions = Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<Upload>>>>>;

pub struct ByteStreamService {
    cas: Arc<dyn BlobStore>,
    metrics: Arc<Metrics>,
    chunk_size: usize,
    sessions: Sessions,
    _reaper: TaskGuard,
}

impl ByteStreamService {
    pub fn new(cas: Arc<dyn BlobStore>, metrics: Arc<Metrics>, chunk_size: usize, idle_timeout: Duration) -> Self {
        let sessions: Sessions = Arc::default();
        let s = sessions.clone();
        let reaper = spawn_named("bytestream-upload-reaper", async move {
            let mut tick = tokio::time::interval((idle_timeout / 4).max(Duration::from_millis(100)));
            loop {
                tick.tick().await;
                let mut map = s.lock().expect("poisoned");
                map.retain(|name, up| match up.try_lock() {
                    Ok(u) if u.last_active.elapsed() > idle_timeout => {
                        tracing::info!(upload = %name, "dropping idle upload");
                        false
                    }
                    _ => true,
                });
            }
        });
        ByteStreamService { cas, metrics, chunk_size, sessions, _reaper: reaper }
    }

    pub fn sessions_in_progress(&self) -> usize {
        self.sessions.lock().expect("poisoned").len()
    }

    async fn new_upload(&self, resource: ResourceName) -> Result<Upload> {
        let writer = self.cas.begin_write(&resource.digest).await?;
        let decoder = match resource.compressor {
            Compressor::Zstd => Some(StreamDecoder::new()?),
            Compressor::Identity => None,
        };
        Ok(Upload { writer: Some(writer), decoder, received: 0, last_active: Instant::now() })
    }

    /// Feeds one request's data into the upload; commits on `finish_write`.
    async fn apply(&self, up: &mut Upload, name: &str, msg: WriteRequest) -> Result<bool> {
        if !msg.resource_name.is_empty() && msg.resource_name != name {
            return Err(Error::invalid(format!(
                "resource_name '{}' changed in the middle of a write of '{name}'",
                msg.resource_name
            )));
        }
        if msg.write_offset != up.received {
            return Err(Error::invalid(format!(
                "write_offset {} does not match committed_size {} of upload '{name}'",
                msg.write_offset, up.received
            )));
        }
        up.last_active = Instant::now();
        up.received += msg.data.len() as i64;
        self.metrics.bytes_received.inc_by(msg.data.len() as u64);
        let writer = up.writer.as_mut().ok_or_else(|| Error::invalid("data after finish_write"))?;
        match up.decoder.as_mut() {
            Some(dec) => {
                for chunk in dec.feed(&msg.data)? {
                    writer.write(chunk).await?;
                }
            }
            None => {
                if !msg.data.is_empty() {
                    writer.write(Bytes::from(msg.data)).await?;
                }
            }
        }
        if msg.finish_write {
            if let Some(dec) = &up.decoder {
                dec.finish()?;
            }
            up.writer.take().expect("checked above").commit().await?;
            return Ok(true);
        }
        Ok(false)
    }
}

type ReadStream = futures::stream::BoxStream<'static, Result<ReadResponse, Status>>;

#[tonic::async_trait]
impl ByteStream for ByteStreamService {
    type ReadStream = ReadStream;

    async fn read(&self, request: Request<ReadRequest>) -> Result<Response<ReadStream>, Status> {
        let req = request.into_inner();
        let rn = ResourceName::parse_read(&req.resource_name)?;
        if req.read_offset < 0 {
            return Err(Error::invalid(format!("read_offset {} is negative", req.read_offset)).into());
        }
        if req.read_limit < 0 {
            return Err(Error::invalid(format!("read_limit {} is negative", req.read_limit)).into());
        }
        let limit = (req.read_limit > 0).then_some(req.read_limit as u64);
        let metrics = self.metrics.clone();
        let chunk = self.chunk_size;
        let stream = match rn.compressor {
            Compressor::Identity => self.cas.read(&rn.digest, req.read_offset as u64, limit).await?,
            Compressor::Zstd => {
                // Offsets of a compressed read count compressed bytes, so compress from
                // the start and window the output.
                let raw = self.cas.read(&rn.digest, 0, None).await?;
                compressed_window(raw, req.read_offset as u64, limit)?
            }
        };
        let out = stream
            .flat_map(move |r| {
                let parts: Vec<Result<ReadResponse, Status>> = match r {
                    Ok(b) => {
                        metrics.bytes_sent.inc_by(b.len() as u64);
                        (0..b.len())
                            .step_by(chunk)
                            .map(|i| Ok(ReadResponse { data: b.slice(i..(i + chunk).min(b.len())).to_vec() }))
                            .collect()
                    }
                    Err(e) => vec![Err(e.into())],
                };
                futures::stream::iter(parts)
            })
            .boxed();
        Ok(Response::new(out))
    }

    async fn write(&self, request: Request<Streaming<WriteRequest>>) -> Result<Response<WriteResponse>, Status> {
        let mut stream = request.into_inner();
        let first = stream.message().await?.ok_or_else(|| Error::invalid("empty Write stream"))?;
        if first.resource_name.is_empty() {
            return Err(Error::invalid("resource_name: the first WriteRequest must name the resource").into());
        }
        let name = first.resource_name.clone();
        let rn = ResourceName::parse_write(&name)?;

        // Another client may already have stored this blob: finish at once, as REAPI allows.
        if first.write_offset == 0 && self.cas.has(&rn.digest).await? {
            let committed = if rn.compressor == Compressor::Zstd { -1 } else { rn.digest.size as i64 };
            self.sessions.lock().expect("poisoned").remove(&name);
            return Ok(Response::new(WriteResponse { committed_size: committed }));
        }

        let existing = self.sessions.lock().expect("poisoned").get(&name).cloned();
        let session = match existing {
            Some(s) if first.write_offset != 0 => s,
            _ => {
                if first.write_offset != 0 {
                    return Err(Error::invalid(format!(
                        "write_offset {}: no upload of '{name}' is in progress; start at offset 0",
                        first.write_offset
                    ))
                    .into());
                }
                let s = Arc::new(tokio::sync::Mutex::new(self.new_upload(rn).await?));
                self.sessions.lock().expect("poisoned").insert(name.clone(), s.clone());
                s
            }
        };
        let mut up = session.try_lock().map_err(|_| {
            Error::FailedPrecondition(format!("upload '{name}' is being written by another stream"))
        })?;

        let mut msg = first;
        loop {
            match self.apply(&mut up, &name, msg).await {
                Ok(true) => {
                    self.sessions.lock().expect("poisoned").remove(&name);
                    return Ok(Response::new(WriteResponse { committed_size: up.received }));
                }
                Ok(false) => {}
                Err(e) => {
                    // Bad data poisons the upload: it must start again from zero.
                    self.sessions.lock().expect("poisoned").remove(&name);
                    return Err(e.into());
                }
            }
            msg = match stream.message().await {
                Ok(Some(m)) => m,
                // The client went away: keep the session so it can resume.
                Ok(None) => {
                    return Err(Error::invalid(format!(
                        "Write stream of '{name}' ended before finish_write at {} bytes; resume from there",
                        up.received
                    ))
                    .into());
                }
                Err(status) => return Err(status),
            };
        }
    }

    async fn query_write_status(
        &self,
        request: Request<QueryWriteStatusRequest>,
    ) -> Result<Response<QueryWriteStatusResponse>, Status> {
        let name = request.into_inner().resource_name;
        let rn = ResourceName::parse_write(&name)?;
        let session = self.sessions.lock().expect("poisoned").get(&name).cloned();
        if let Some(s) = session {
            let up = s.lock().await;
            return Ok(Response::new(QueryWriteStatusResponse { committed_size: up.received, complete: false }));
        }
        if self.cas.has(&rn.digest).await? {
            return Ok(Response::new(QueryWriteStatusResponse {
                committed_size: rn.digest.size as i64,
                complete: true,
            }));
        }
        Err(Error::not_found(format!("no upload of '{name}' is in progress")).into())
    }
}

/// Compresses a blob stream and returns bytes [offset, offset+limit) of the result.
fn compressed_window(raw: gantry_core::BlobStream, offset: u64, limit: Option<u64>) -> Result<gantry_core::BlobStream> {
    let mut enc = Some(StreamEncoder::new()?);
    let mut pos = 0u64;
    let end = limit.map(|l| offset.saturating_add(l));
    let compressed = raw
        .map(Some)
        .chain(futures::stream::once(async { None }))
        .map(move |item| -> Result<Bytes> {
            let Some(e) = enc.as_mut() else { return Ok(Bytes::new()) };
            let out = match item {
                Some(chunk) => e.feed(&chunk?)?,
                None => {
                    let tail = e.finish()?;
                    enc = None;
                    tail
                }
            };
            let (start, stop) = (pos, pos + out.len() as u64);
            pos = stop;
            let lo = offset.clamp(start, stop) - start;
            let hi = end.map_or(stop, |e| e.clamp(start, stop)) - start;
            Ok(Bytes::from(out).slice(lo as usize..hi.max(lo) as usize))
        })
        .filter(|r| futures::future::ready(!matches!(r, Ok(b) if b.is_empty())));
    Ok(compressed.boxed())
}
