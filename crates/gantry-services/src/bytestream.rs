//! ByteStream: Read with offset and limit, resumable Write, QueryWriteStatus, for both
//! `blobs/` and `compressed-blobs/zstd/` resource names.
//!
//! An upload is a session keyed by its full `uploads/{uuid}/...` name. If the client's
//! stream breaks, the session keeps the bytes received so far; the client asks
//! QueryWriteStatus for `committed_size` and continues with a Write at that offset.
//! Sessions idle longer than `upload_idle_timeout` are dropped by a background task.
//!
//! Bytes that uploads hold in memory have a ceiling (`[server] max_upload_memory`), and
//! one client may hold at most a quarter of it. Past either, idle uploads (the client's
//! own first, then the least recently active) are spilled to disk by their writer, or
//! dropped when their writer cannot spill; the client restarts those from offset 0.

use gantry_core::auth::Permission;
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
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
    digest: gantry_core::Digest,
    writer: Option<Box<dyn BlobWriter>>,
    decoder: Option<StreamDecoder>,
    /// Bytes received on the wire (compressed bytes for compressed uploads) and written.
    received: i64,
    /// Uncompressed bytes handed to the writer.
    written: u64,
    /// Set across every await that changes the writer. If a handler is dropped there
    /// (client timeout or reset), the writer's state is unknown and the next user of the
    /// session starts it over instead of trusting it.
    dirty: bool,
    last_active: Instant,
}

/// One resumable upload. `committed` mirrors `Upload::received` so QueryWriteStatus can
/// answer while a Write stream holds the upload.
struct Session {
    upload: tokio::sync::Mutex<Upload>,
    committed: AtomicI64,
    /// Who started it (see `owner_of`), for the per-client limits.
    owner: String,
    /// The writer's `buffered()` when last looked at; its share of `memory.total`.
    buffered: AtomicU64,
    memory: Arc<UploadMemory>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.memory.total.fetch_sub(self.buffered.load(Ordering::Acquire), Ordering::AcqRel);
    }
}

/// Bytes buffered in memory by every upload in progress, against the ceiling.
struct UploadMemory {
    total: AtomicU64,
    limit: u64,
    gauge: prometheus::IntGauge,
    relieved: prometheus::IntCounterVec,
}

impl Session {
    /// Records what the writer holds in memory now (call with the upload locked).
    fn account(&self, up: &Upload) {
        let now = up.writer.as_ref().map_or(0, |w| w.buffered());
        let before = self.buffered.swap(now, Ordering::AcqRel);
        if now >= before {
            self.memory.total.fetch_add(now - before, Ordering::AcqRel);
        } else {
            self.memory.total.fetch_sub(before - now, Ordering::AcqRel);
        }
        self.memory.gauge.set(self.memory.total.load(Ordering::Acquire) as i64);
    }
}

type Sessions = Arc<Mutex<HashMap<String, Arc<Session>>>>;

/// More concurrent uploads than this are refused (each may buffer up to 1 MiB).
const MAX_SESSIONS: usize = 10_000;

/// Whom an upload counts against: the authenticated identity, or the peer's address for
/// anonymous callers and servers without `[auth]`.
fn owner_of(caller: &gantry_core::auth::Caller, peer: Option<std::net::SocketAddr>) -> String {
    match caller {
        gantry_core::auth::Caller::Identity(id) if id.name != "anonymous" => format!("identity {}", id.name),
        _ => format!("peer {}", peer.map_or("unknown".to_string(), |a| a.ip().to_string())),
    }
}

pub struct ByteStreamService {
    cas: Arc<dyn BlobStore>,
    metrics: Arc<Metrics>,
    chunk_size: usize,
    /// Uploads one client may have in progress at once, so one client cannot take every
    /// session (`[server] max_uploads_per_client`).
    per_client: usize,
    sessions: Sessions,
    memory: Arc<UploadMemory>,
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
                map.retain(|name, session| match session.upload.try_lock() {
                    Ok(u) if u.last_active.elapsed() > idle_timeout => {
                        tracing::info!(upload = %name, "dropping idle upload");
                        false
                    }
                    _ => true,
                });
            }
        });
        let gauge = prometheus::IntGauge::new(
            "gantry_upload_buffered_bytes",
            "Bytes held in memory by ByteStream uploads in progress",
        )
        .expect("valid metric");
        let relieved = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "gantry_upload_memory_relief_total",
                "Idle uploads spilled to disk or dropped because upload memory passed its ceiling",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        for c in [Box::new(gauge.clone()) as Box<dyn prometheus::core::Collector>, Box::new(relieved.clone())] {
            if let Err(e) = metrics.registry().register(c) {
                tracing::warn!(error = %e, "upload memory metrics not registered");
            }
        }
        let memory = Arc::new(UploadMemory { total: AtomicU64::new(0), limit: u64::MAX, gauge, relieved });
        ByteStreamService { cas, metrics, chunk_size, per_client: MAX_SESSIONS, sessions, memory, _reaper: reaper }
    }

    /// Sets the ceiling on bytes buffered in memory by uploads (`[server] max_upload_memory`).
    pub fn with_memory_limit(mut self, bytes: u64) -> Self {
        let m = Arc::get_mut(&mut self.memory).expect("set before any upload");
        m.limit = bytes.max(1);
        self
    }

    /// Bytes buffered in memory by uploads in progress.
    pub fn buffered_bytes(&self) -> u64 {
        self.memory.total.load(Ordering::Acquire)
    }

    /// Brings upload memory back under its ceilings after `session` (locked by the caller
    /// as `up`) grew: idle uploads give their memory back, the owner's own first, then
    /// the least recently active; if that is not enough, this upload spills too.
    async fn relieve(&self, session: &Arc<Session>, up: &mut Upload) -> Result<()> {
        let share = (self.memory.limit / 4).max(1);
        let total = || self.memory.total.load(Ordering::Acquire);
        let over_total = || total() > self.memory.limit;
        // No client can hold more than a share while everyone together holds less.
        if total() <= share {
            return Ok(());
        }
        // One pass over the sessions: the owner's sum, and every other upload holding
        // memory as a candidate. None is locked here; each is tried without waiting later,
        // and a busy one is skipped.
        let (mut owner_held, others) = {
            let map = self.sessions.lock().expect("poisoned");
            let mut held = 0u64;
            let mut others: Vec<(String, Arc<Session>)> = Vec::new();
            for (n, s) in map.iter() {
                let b = s.buffered.load(Ordering::Acquire);
                if s.owner == session.owner {
                    held += b;
                }
                if b > 0 && !Arc::ptr_eq(s, session) {
                    others.push((n.clone(), s.clone()));
                }
            }
            (held, others)
        };
        if !over_total() && owner_held <= share {
            return Ok(());
        }
        let mut idle: Vec<(bool, Instant, String, Arc<Session>)> = Vec::new();
        for (name, s) in others {
            let last = s.upload.try_lock().map(|u| u.last_active).ok();
            if let Some(last) = last {
                idle.push((s.owner != session.owner, last, name, s));
            }
        }
        idle.sort_by_key(|a| (a.0, a.1));
        for (foreign, _, name, s) in idle {
            if !over_total() && (foreign || owner_held <= share) {
                break;
            }
            let Ok(mut u) = s.upload.try_lock() else { continue };
            let before = s.buffered.load(Ordering::Acquire);
            let dirty = u.dirty;
            let spilled = match u.writer.as_mut() {
                Some(w) if !dirty => w.spill().await.is_ok() && w.buffered() == 0,
                _ => false,
            };
            s.account(&u);
            drop(u);
            if spilled {
                self.memory.relieved.with_label_values(&["spilled"]).inc();
            } else {
                tracing::info!(upload = %name, "dropping an idle upload: upload memory is at its ceiling");
                self.remove_session(&name, &s);
                self.memory.relieved.with_label_values(&["dropped"]).inc();
            }
            // Spilled or dropped, its memory is no longer the owner's.
            if !foreign {
                owner_held -= before.min(owner_held);
            }
        }
        if (over_total() || owner_held > share)
            && let Some(w) = up.writer.as_mut()
        {
            up.dirty = true;
            w.spill().await?;
            up.dirty = false;
            session.account(up);
        }
        Ok(())
    }

    /// Limits the uploads one client may have in progress (at most the global limit).
    pub fn with_per_client_limit(mut self, n: usize) -> Self {
        self.per_client = n.clamp(1, MAX_SESSIONS);
        self
    }

    pub fn sessions_in_progress(&self) -> usize {
        self.sessions.lock().expect("poisoned").len()
    }

    async fn new_upload(&self, resource: &ResourceName) -> Result<Upload> {
        let writer = self.cas.begin_write(&resource.digest).await?;
        let decoder = match resource.compressor {
            Compressor::Zstd => Some(StreamDecoder::new()?),
            Compressor::Identity => None,
        };
        Ok(Upload {
            digest: resource.digest,
            writer: Some(writer),
            decoder,
            received: 0,
            written: 0,
            dirty: false,
            last_active: Instant::now(),
        })
    }

    /// Removes `name` only if it still maps to `session`, so a finished or failed stream
    /// never removes a newer upload that reused the name.
    fn remove_session(&self, name: &str, session: &Arc<Session>) {
        let mut map = self.sessions.lock().expect("poisoned");
        if map.get(name).is_some_and(|s| Arc::ptr_eq(s, session)) {
            map.remove(name);
        }
    }

    /// Feeds one request's data into the upload; commits on `finish_write`.
    async fn apply(&self, up: &mut Upload, session: &Session, name: &str, msg: WriteRequest) -> Result<bool> {
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
        let n = msg.data.len() as i64;
        self.metrics.bytes_received.inc_by(n as u64);
        up.dirty = true;
        let writer = up.writer.as_mut().ok_or_else(|| Error::invalid("data after finish_write"))?;
        match up.decoder.as_mut() {
            Some(dec) => {
                let budget = up.digest.size - up.written;
                for chunk in dec.feed(&msg.data, budget)? {
                    up.written += chunk.len() as u64;
                    writer.write(chunk).await?;
                }
            }
            None => {
                if !msg.data.is_empty() {
                    up.written += msg.data.len() as u64;
                    writer.write(Bytes::from(msg.data)).await?;
                }
            }
        }
        up.received += n;
        session.committed.store(up.received, Ordering::Release);
        if msg.finish_write {
            if let Some(dec) = &up.decoder {
                dec.finish()?;
            }
            up.writer.take().expect("checked above").commit().await?;
            up.dirty = false;
            return Ok(true);
        }
        up.dirty = false;
        Ok(false)
    }
}

type ReadStream = futures::stream::BoxStream<'static, Result<ReadResponse, Status>>;

/// What a Read sends: the blob's bytes in pieces of at most the read chunk size, each
/// one message. The pieces share the store's buffers; nothing is copied here.
pub(crate) type ReadChunks = futures::stream::BoxStream<'static, Result<Bytes, Status>>;

impl ByteStreamService {
    /// Checks and authorizes a Read and opens the bytes it asks for. Both ways of
    /// answering a Read use it: the generated service below, and the zero-copy route
    /// (`bytestream_read`) that serves the wire.
    pub(crate) async fn open_read(&self, request: Request<ReadRequest>) -> Result<ReadChunks, Status> {
        let caller = gantry_core::auth::caller(&request);
        let req = request.into_inner();
        let rn = ResourceName::parse_read(&req.resource_name)?;
        gantry_core::auth::check(&caller, Permission::Read, &rn.instance)?;
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
        Ok(stream
            .flat_map(move |r| {
                let parts: Vec<Result<Bytes, Status>> = match r {
                    Ok(b) => {
                        metrics.bytes_sent.inc_by(b.len() as u64);
                        (0..b.len()).step_by(chunk).map(|i| Ok(b.slice(i..(i + chunk).min(b.len())))).collect()
                    }
                    Err(e) => vec![Err(e.into())],
                };
                futures::stream::iter(parts)
            })
            .boxed())
    }
}

#[tonic::async_trait]
impl ByteStream for ByteStreamService {
    type ReadStream = ReadStream;

    /// Reads that arrive over the network take the zero-copy route instead
    /// (`bytestream_read::ByteStreamRoutes`); this answers the rest, such as calls made
    /// on the service value directly.
    async fn read(&self, request: Request<ReadRequest>) -> Result<Response<ReadStream>, Status> {
        let chunks = self.open_read(request).await?;
        Ok(Response::new(chunks.map(|r| r.map(|b| ReadResponse { data: b.to_vec() })).boxed()))
    }

    async fn write(&self, request: Request<Streaming<WriteRequest>>) -> Result<Response<WriteResponse>, Status> {
        let caller = gantry_core::auth::caller(&request);
        let owner = owner_of(&caller, request.remote_addr());
        let mut stream = request.into_inner();
        let first = stream.message().await?.ok_or_else(|| Error::invalid("empty Write stream"))?;
        if first.resource_name.is_empty() {
            return Err(Error::invalid("resource_name: the first WriteRequest must name the resource").into());
        }
        let name = first.resource_name.clone();
        let rn = ResourceName::parse_write(&name)?;
        gantry_core::auth::check(&caller, Permission::WriteCas, &rn.instance)?;
        if first.write_offset < 0 {
            return Err(Error::invalid(format!("write_offset {} is negative", first.write_offset)).into());
        }

        // Another client may already have stored this blob: finish at once, as REAPI allows.
        if first.write_offset == 0 && self.cas.has(&rn.digest).await? {
            let committed = if rn.compressor == Compressor::Zstd { -1 } else { rn.digest.size as i64 };
            return Ok(Response::new(WriteResponse { committed_size: committed }));
        }

        let session = if first.write_offset == 0 {
            let up = self.new_upload(&rn).await?;
            let s = Arc::new(Session {
                upload: tokio::sync::Mutex::new(up),
                committed: AtomicI64::new(0),
                owner: owner.clone(),
                buffered: AtomicU64::new(0),
                memory: self.memory.clone(),
            });
            let mut map = self.sessions.lock().expect("poisoned");
            if !map.contains_key(&name) {
                if map.len() >= MAX_SESSIONS {
                    return Err(Error::ResourceExhausted(format!(
                        "{MAX_SESSIONS} uploads are already in progress; retry later"
                    ))
                    .into());
                }
                if map.values().filter(|s| s.owner == owner).count() >= self.per_client {
                    return Err(Error::ResourceExhausted(format!(
                        "{} uploads of yours are already in progress (server.max_uploads_per_client); finish or abandon some",
                        self.per_client
                    ))
                    .into());
                }
            }
            map.insert(name.clone(), s.clone());
            s
        } else {
            self.sessions.lock().expect("poisoned").get(&name).cloned().ok_or_else(|| {
                Error::invalid(format!(
                    "write_offset {}: no upload of '{name}' is in progress; QueryWriteStatus and start at offset 0",
                    first.write_offset
                ))
            })?
        };
        // ABORTED: a resume can race the drop of the previous handler; clients retry it.
        let mut up = session
            .upload
            .try_lock()
            .map_err(|_| Status::aborted(format!("upload '{name}' is being written by another stream; retry")))?;
        if up.dirty {
            // The previous handler was dropped mid-write: start the upload over.
            *up = self.new_upload(&rn).await?;
            session.committed.store(0, Ordering::Release);
            session.account(&up);
        }

        let mut msg = first;
        loop {
            let applied = self.apply(&mut up, &session, &name, msg).await;
            session.account(&up);
            let applied = match applied {
                Ok(false) => self.relieve(&session, &mut up).await.map(|_| false),
                other => other,
            };
            match applied {
                Ok(true) => {
                    self.remove_session(&name, &session);
                    return Ok(Response::new(WriteResponse { committed_size: up.received }));
                }
                Ok(false) => {}
                Err(e) => {
                    // Bad data poisons the upload: it must start again from zero.
                    self.remove_session(&name, &session);
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
        let caller = gantry_core::auth::caller(&request);
        let name = request.into_inner().resource_name;
        let rn = ResourceName::parse_write(&name)?;
        gantry_core::auth::check(&caller, Permission::WriteCas, &rn.instance)?;
        if self.cas.has(&rn.digest).await? {
            return Ok(Response::new(QueryWriteStatusResponse {
                committed_size: rn.digest.size as i64,
                complete: true,
            }));
        }
        let session = self.sessions.lock().expect("poisoned").get(&name).cloned();
        // An unknown upload is reported as committed_size 0 rather than NOT_FOUND: Bazel
        // restarts from 0 on that, but gives up on an error.
        let committed = match session {
            Some(s) => match s.upload.try_lock() {
                Ok(up) if up.dirty => 0,
                _ => s.committed.load(Ordering::Acquire),
            },
            None => 0,
        };
        Ok(Response::new(QueryWriteStatusResponse { committed_size: committed, complete: false }))
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
