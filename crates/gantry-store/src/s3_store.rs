//! `S3Store` (`[cas] kind = "s3"`): blobs as objects in an S3-compatible bucket, at
//! `{prefix}{function}/{hash}-{size}`, shared by every `gantry serve` of a deployment.
//!
//! - Writes of up to `PART_SIZE` are buffered and sent as one PUT at commit; larger ones
//!   become a multipart upload whose parts are sent while the client is still sending
//!   (at most `PARTS_IN_FLIGHT` at once, so a slow bucket slows the upload instead of
//!   growing the heap). Nothing is visible under the key until commit completes the
//!   upload, and `IntegrityStore` checks the digest before that. A writer dropped
//!   before commit aborts its multipart upload. Every PUT carries a SHA-256 checksum
//!   that S3 verifies before it stores the bytes.
//! - Reads with an offset or a limit are ranged GETs.
//! - FindMissingBlobs asks S3 only about blobs not confirmed present recently (the
//!   `PresenceRecord`), with up to `max_concurrent_requests` HEADs in flight.
//! - Any failure other than "no such key" is UNAVAILABLE with S3's message: never a
//!   miss, never a lost write.
//! - With a bucket lifecycle rule (`expire_after`), a blob is answered present only while
//!   the rule leaves it at least `min_blob_lifetime` to live, judged by the object's
//!   Last-Modified. An older object that is asked about is refreshed first (copied away
//!   and back, server-side, which resets Last-Modified), so an action-cache hit's blobs
//!   stay downloadable for `min_blob_lifetime` after the hit, and an object the rule
//!   removed is a miss, never a hit Bazel cannot download.
//!
//! The `object_store` crate (not the AWS SDK) speaks S3: it is the Arrow project's
//! store abstraction, small, built on the reqwest/hyper stack gantry already uses, and it
//! talks to AWS and to S3-compatible servers alike (path-style with an endpoint).

use std::collections::{HashMap, VecDeque};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt, TryStreamExt};
use gantry_core::blob_store::read_range;
use gantry_core::task::{spawn_named, TaskGuard};
use gantry_core::{BlobStore, BlobStream, BlobWriter, Digest, Error, Result};
use object_store::aws::{AmazonS3Builder, Checksum};
use object_store::path::Path as ObjectPath;
use object_store::{
    ClientOptions, GetOptions, GetRange, MultipartUpload, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig,
};
use tokio::sync::mpsc;

/// Size of each part of a multipart upload, and the largest blob sent as one PUT.
/// S3 wants parts of at least 5 MiB (but the last) and at most 10,000 of them: 16 MiB
/// parts allow blobs up to 156 GiB.
pub const PART_SIZE: usize = 16 << 20;
/// Parts of one upload in flight at once; the next `write` waits for the oldest.
const PARTS_IN_FLIGHT: usize = 4;

/// Where credentials come from. Never from gantry.toml.
#[derive(Clone)]
pub enum S3Credentials {
    /// The standard AWS chain: `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/
    /// `AWS_SESSION_TOKEN`, then the shared credentials file (`AWS_SHARED_CREDENTIALS_FILE`
    /// or `~/.aws/credentials`, profile `AWS_PROFILE` or `default`), then web identity and
    /// the container or instance metadata service (object_store's own chain).
    Environment,
    /// Given by the caller (tests, which must not change the process environment).
    Static { key_id: String, secret_key: String },
}

impl std::fmt::Debug for S3Credentials {
    // Never print a secret, even in a debug dump.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            S3Credentials::Environment => f.write_str("Environment"),
            S3Credentials::Static { key_id, .. } => {
                write!(f, "Static {{ key_id: {key_id:?}, secret_key: <redacted> }}")
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct S3Options {
    pub bucket: String,
    pub endpoint: Option<String>,
    pub region: String,
    /// Extra certificate authorities (PEM) for an `https://` endpoint.
    pub ca_file: Option<std::path::PathBuf>,
    pub prefix: String,
    pub max_concurrent_requests: usize,
    pub presence_ttl: Duration,
    pub presence_entries: usize,
    /// How long a blob a HEAD found missing is answered missing without asking again
    /// (zero: always ask). A stale "missing" only costs an upload; see `AbsenceRecord`.
    pub absence_ttl: Duration,
    pub credentials: S3Credentials,
    /// Tries of one request before its error reaches the client. Default 3.
    pub max_retries: usize,
    /// Longest time spent retrying one request. Default 10 s.
    pub retry_timeout: Duration,
    /// The bucket's lifecycle rule: objects expire this long after Last-Modified. None:
    /// objects live until deleted.
    pub expire_after: Option<Duration>,
    /// With `expire_after`: how long a blob answered present is promised to stay.
    pub min_blob_lifetime: Duration,
}

impl S3Options {
    /// `bucket` with `[cas]`'s defaults for the rest (they are written in gantry-config).
    pub fn new(bucket: impl Into<String>) -> Self {
        S3Options::from_config(&gantry_config::S3StoreConfig::with_bucket(bucket))
    }

    pub fn from_config(c: &gantry_config::S3StoreConfig) -> Self {
        S3Options {
            bucket: c.bucket.clone(),
            endpoint: c.endpoint.clone(),
            region: c.region.clone(),
            ca_file: c.ca_file.clone(),
            prefix: c.prefix.clone(),
            max_concurrent_requests: c.max_concurrent_requests,
            presence_ttl: c.presence_ttl,
            presence_entries: c.presence_entries,
            absence_ttl: c.absence_ttl,
            expire_after: c.expire_after,
            min_blob_lifetime: c.min_blob_lifetime,
            // Not settings: how the store talks to S3 (see the fields' docs).
            credentials: S3Credentials::Environment,
            max_retries: 3,
            retry_timeout: Duration::from_secs(10),
        }
    }

    /// "bucket B at ENDPOINT" for messages; never includes credentials.
    fn describe(&self) -> String {
        match &self.endpoint {
            Some(e) => format!("S3 bucket {} at {e}", self.bucket),
            None => format!("S3 bucket {} (AWS, region {})", self.bucket, self.region),
        }
    }
}

/// Requests sent to S3 since the store was opened, by kind (for tests and metrics).
#[derive(Debug, Default)]
pub struct S3RequestCounts {
    pub head: AtomicU64,
    pub get: AtomicU64,
    pub put: AtomicU64,
    pub delete: AtomicU64,
    /// Server-side copies (lifetime refreshes make two each).
    pub copy: AtomicU64,
}

pub struct S3Store {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn ObjectStore>,
    opts: S3Options,
    what: String,
    presence: PresenceRecord,
    requests: S3RequestCounts,
    /// Commits in progress, by digest: a second writer of the same blob waits for the
    /// first one's commit instead of sending the same object again (S3 would keep either;
    /// some S3-compatible servers refuse concurrent writes of one key).
    flights: Mutex<HashMap<Digest, Flight>>,
    /// Multipart uploads of dropped writers, aborted in the background so `Drop` need not block.
    abandoned: mpsc::UnboundedSender<Box<dyn MultipartUpload>>,
    _aborter: TaskGuard,
}

impl S3Store {
    /// Builds the client. No request is sent: call `check` to prove the bucket usable.
    pub fn open(opts: S3Options) -> Result<S3Store> {
        let what = opts.describe();
        let allow_http = opts.endpoint.as_deref().is_some_and(|e| e.starts_with("http://"));
        // No overall request timeout: a multi-GiB GET legitimately streams for long. A dead
        // server is caught by the connect timeout, a stalled one by the read timeout.
        let mut client = ClientOptions::new()
            .with_allow_http(allow_http)
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout_disabled()
            .with_read_timeout(Duration::from_secs(60));
        if let Some(path) = &opts.ca_file {
            for cert in read_ca_file(path).map_err(|e| Error::FailedPrecondition(format!("{what}: {e}")))? {
                client = client.with_root_certificate(cert);
            }
        }
        install_crypto_provider();
        // The client options first: they replace what the builder's other setters put there.
        let mut b = AmazonS3Builder::from_env()
            .with_client_options(client)
            .with_bucket_name(&opts.bucket)
            .with_region(&opts.region);
        if let Some(endpoint) = &opts.endpoint {
            // S3-compatible servers are addressed path-style at their endpoint.
            b = b.with_endpoint(endpoint).with_virtual_hosted_style_request(false);
        }
        match &opts.credentials {
            S3Credentials::Static { key_id, secret_key } => {
                b = b.with_access_key_id(key_id).with_secret_access_key(secret_key);
            }
            S3Credentials::Environment => {
                if std::env::var_os("AWS_ACCESS_KEY_ID").is_none()
                    && let Some(p) = shared_credentials_profile()?
                {
                    b = b.with_access_key_id(p.key_id).with_secret_access_key(p.secret_key);
                    if let Some(t) = p.token {
                        b = b.with_token(t);
                    }
                }
            }
        }
        let store = b
            .with_checksum_algorithm(Checksum::SHA256)
            .with_retry(RetryConfig {
                max_retries: opts.max_retries,
                retry_timeout: opts.retry_timeout,
                ..Default::default()
            })
            // No overall request timeout: a multi-GiB GET legitimately streams for long.
            // A dead server is caught by the connect timeout and the retry bound.
            .build()
            .map_err(|e| Error::FailedPrecondition(format!("{what}: {e}")))?;
        let (tx, mut rx) = mpsc::unbounded_channel::<Box<dyn MultipartUpload>>();
        let aborter = spawn_named("s3-abort-uploads", async move {
            while let Some(mut upload) = rx.recv().await {
                if let Err(e) = upload.abort().await {
                    // The bucket's lifecycle rule for incomplete uploads removes it later.
                    tracing::warn!(error = %e, "could not abort an abandoned multipart upload");
                }
            }
        });
        let presence = PresenceRecord::new(opts.presence_entries, opts.presence_ttl, opts.absence_ttl);
        Ok(S3Store {
            inner: Arc::new(Inner {
                store: Arc::new(store),
                what,
                presence,
                flights: Mutex::new(HashMap::new()),
                requests: S3RequestCounts::default(),
                abandoned: tx,
                _aborter: aborter,
                opts,
            }),
        })
    }

    pub fn requests(&self) -> &S3RequestCounts {
        &self.inner.requests
    }

    /// The bucket's name.
    pub fn bucket(&self) -> String {
        self.inner.opts.bucket.clone()
    }

    /// The object key of a blob.
    pub fn key(&self, digest: &Digest) -> String {
        self.inner.key(digest)
    }
}

/// One commit of a blob, awaited by every writer of that blob that arrives meanwhile.
/// The error is S3's message (the future's output must be Clone).
type Flight = Shared<BoxFuture<'static, std::result::Result<(), Arc<String>>>>;

impl Inner {
    /// Runs `commit` unless a commit of `d` is already in flight, in which case this
    /// waits for that one instead. Returns whether `commit` ran. No lock is held while
    /// waiting: the map only hands out the shared future.
    async fn single_flight(
        &self,
        d: Digest,
        commit: impl FnOnce() -> BoxFuture<'static, std::result::Result<(), Arc<String>>>,
    ) -> Result<bool> {
        let (flight, led) = {
            let mut flights = self.flights.lock().expect("poisoned");
            match flights.get(&d) {
                Some(f) => (f.clone(), false),
                None => {
                    let f = commit().shared();
                    flights.insert(d, f.clone());
                    (f, true)
                }
            }
        };
        let res = flight.clone().await;
        {
            let mut flights = self.flights.lock().expect("poisoned");
            if flights.get(&d).is_some_and(|f| f.ptr_eq(&flight)) {
                flights.remove(&d);
            }
        }
        match res {
            Ok(()) => {
                // Last-Modified is at or after now: the commit finished just now.
                self.presence.insert(d, self.good_until(SystemTime::now()));
                Ok(led)
            }
            Err(msg) => Err(Error::Unavailable(msg.to_string())),
        }
    }

    fn key(&self, d: &Digest) -> String {
        format!("{}{}/{}-{}", self.opts.prefix, d.function.name(), d.hash_hex(), d.size)
    }

    fn path(&self, d: &Digest) -> ObjectPath {
        ObjectPath::from(self.key(d))
    }

    /// S3's failure as UNAVAILABLE, naming the bucket and what gantry was doing.
    fn unavailable(&self, doing: impl std::fmt::Display, e: object_store::Error) -> Error {
        Error::Unavailable(format!("{}: {doing}: {}", self.what, with_causes(&e)))
    }

    /// Until when a blob last modified at `modified` may be answered present: forever
    /// without a lifecycle rule, else until the rule would leave it less than
    /// `min_blob_lifetime`.
    fn good_until(&self, modified: SystemTime) -> Option<SystemTime> {
        let expire = self.opts.expire_after?;
        Some(modified + expire.saturating_sub(self.opts.min_blob_lifetime))
    }

    /// HEAD: true when present (with the blob's size), false when absent, Err otherwise.
    /// A present object too old to promise `min_blob_lifetime` is refreshed first.
    async fn head(&self, d: &Digest) -> Result<bool> {
        self.requests.head.fetch_add(1, Ordering::Relaxed);
        let path = self.path(d);
        let asked_at = Instant::now();
        let meta = match self.store.head(&path).await {
            Ok(meta) if meta.size == d.size => meta,
            Ok(_) => return Ok(false),
            Err(object_store::Error::NotFound { .. }) => {
                self.presence.mark_absent(*d, asked_at);
                return Ok(false);
            }
            Err(e) => return Err(self.unavailable(format_args!("HEAD of blob {d}"), e)),
        };
        let mut until = self.good_until(meta.last_modified.into());
        if until.is_some_and(|u| u <= SystemTime::now()) {
            self.refresh(d, &path).await?;
            until = self.good_until(SystemTime::now());
        }
        self.presence.insert(*d, until);
        Ok(true)
    }

    /// Resets an object's Last-Modified, so the lifecycle rule's clock starts again: a
    /// server-side copy to a scratch key and back (S3 refuses to copy an object onto
    /// itself unchanged), then the scratch key is deleted.
    async fn refresh(&self, d: &Digest, path: &ObjectPath) -> Result<()> {
        let scratch = ObjectPath::from(format!("{}gantry-refresh/{}", self.opts.prefix, uuid::Uuid::new_v4()));
        self.requests.copy.fetch_add(2, Ordering::Relaxed);
        let copied = async {
            self.store.copy(path, &scratch).await?;
            self.store.copy(&scratch, path).await
        }
        .await;
        self.requests.delete.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.store.delete(&scratch).await {
            tracing::warn!(key = %scratch, error = %e, "deleting the scratch copy of a refreshed blob failed");
        }
        copied.map_err(|e| {
            self.unavailable(format_args!("refreshing blob {d} before the bucket's lifecycle rule expires it"), e)
        })?;
        tracing::debug!(blob = %d, "refreshed an object the lifecycle rule would soon expire");
        Ok(())
    }
}

#[async_trait]
impl BlobStore for S3Store {
    async fn find_present(&self, digests: &[Digest]) -> Result<Vec<bool>> {
        let inner = &self.inner;
        let now = SystemTime::now();
        let mut present: Vec<bool> = digests.iter().map(|d| inner.presence.contains(d, now)).collect();
        let unknown: Vec<(usize, Digest)> = present
            .iter()
            .enumerate()
            .filter(|(i, p)| !**p && !inner.presence.known_absent(&digests[*i]))
            .map(|(i, _)| (i, digests[i]))
            .collect();
        let found: Vec<(usize, Digest, bool)> = futures::stream::iter(unknown)
            .map(|(i, d)| async move { inner.head(&d).await.map(|p| (i, d, p)) })
            .buffer_unordered(inner.opts.max_concurrent_requests)
            .try_collect()
            .await?;
        for (i, _, p) in found {
            present[i] = p;
        }
        Ok(present)
    }

    async fn read(&self, digest: &Digest, offset: u64, limit: Option<u64>) -> Result<BlobStream> {
        let (offset, len) = read_range(digest, offset, limit)?;
        let inner = self.inner.clone();
        if len == 0 {
            // S3 cannot serve an empty range; the answer is still "missing" or "empty".
            return if inner.head(digest).await? {
                Ok(futures::stream::empty().boxed())
            } else {
                Err(Error::not_found(format!("blob {digest} not found in {}", inner.what)))
            };
        }
        let range = (offset > 0 || len < digest.size).then_some(GetRange::Bounded(offset..offset + len));
        inner.requests.get.fetch_add(1, Ordering::Relaxed);
        let asked_at = Instant::now();
        let res = match inner.store.get_opts(&inner.path(digest), GetOptions { range, ..Default::default() }).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => {
                // Gone behind our back (a lifecycle rule): stop answering it as present.
                inner.presence.mark_absent(*digest, asked_at);
                return Err(Error::not_found(format!("blob {digest} not found in {}", inner.what)));
            }
            Err(e) => return Err(inner.unavailable(format_args!("GET of blob {digest}"), e)),
        };
        let until = inner.good_until(res.meta.last_modified.into());
        if until.is_none_or(|u| u > SystemTime::now()) {
            inner.presence.insert(*digest, until);
        }
        let d = *digest;
        // A connection cut mid-body must reach the client as an error, never as a short blob.
        let body = res.into_stream();
        let stream = futures::stream::unfold((body, 0u64, false), move |(mut body, received, done)| {
            let inner = inner.clone();
            async move {
                if done {
                    return None;
                }
                match body.next().await {
                    Some(Ok(chunk)) => {
                        let received = received + chunk.len() as u64;
                        Some((Ok(chunk), (body, received, false)))
                    }
                    Some(Err(e)) => {
                        Some((Err(inner.unavailable(format_args!("reading blob {d}"), e)), (body, received, true)))
                    }
                    None if received != len => Some((
                        Err(Error::Unavailable(format!(
                            "{}: GET of blob {d} ended after {received} of {len} bytes",
                            inner.what
                        ))),
                        (body, received, true),
                    )),
                    None => None,
                }
            }
        });
        Ok(stream.boxed())
    }

    async fn begin_write(&self, digest: &Digest) -> Result<Box<dyn BlobWriter>> {
        Ok(Box::new(S3Writer {
            inner: self.inner.clone(),
            digest: *digest,
            committed: 0,
            buf: BytesMut::new(),
            upload: None,
            in_flight: VecDeque::new(),
            failed: false,
        }))
    }

    async fn check(&self) -> Result<()> {
        // Write, read back and delete a probe, so that missing permissions or a wrong
        // bucket stop the server now instead of failing the first build.
        let inner = &self.inner;
        let path = ObjectPath::from(format!("{}gantry-check/{}", inner.opts.prefix, uuid::Uuid::new_v4()));
        let probe = Bytes::from_static(b"gantry startup check");
        inner.requests.put.fetch_add(1, Ordering::Relaxed);
        inner
            .store
            .put(&path, PutPayload::from(probe.clone()))
            .await
            .map_err(|e| inner.unavailable(format_args!("writing the probe object {path}"), e))?;
        inner.requests.get.fetch_add(1, Ordering::Relaxed);
        let got = async { inner.store.get(&path).await?.bytes().await }
            .await
            .map_err(|e| inner.unavailable(format_args!("reading back the probe object {path}"), e))?;
        if got != probe {
            return Err(Error::Unavailable(format!(
                "{}: the probe object {path} read back {} bytes that differ from the {} written",
                inner.what,
                got.len(),
                probe.len()
            )));
        }
        inner.requests.delete.fetch_add(1, Ordering::Relaxed);
        inner
            .store
            .delete(&path)
            .await
            .map_err(|e| inner.unavailable(format_args!("deleting the probe object {path}"), e))?;
        Ok(())
    }
}

struct S3Writer {
    inner: Arc<Inner>,
    digest: Digest,
    committed: u64,
    /// Bytes not yet sent: the whole blob while it is small, else the next part.
    buf: BytesMut,
    /// In a Mutex only because writers must be Sync; it is reached through `get_mut`,
    /// so no lock is ever taken, let alone held across an await.
    upload: Option<Mutex<Box<dyn MultipartUpload>>>,
    in_flight: VecDeque<tokio::task::JoinHandle<object_store::Result<()>>>,
    failed: bool,
}

impl S3Writer {
    fn fail(&mut self, doing: impl std::fmt::Display, e: object_store::Error) -> Error {
        self.failed = true;
        self.inner.unavailable(doing, e)
    }

    /// Sends `part` of the multipart upload, after waiting for the oldest part if
    /// `PARTS_IN_FLIGHT` are already on their way.
    async fn send_part(&mut self, part: Bytes) -> Result<()> {
        while self.in_flight.len() >= PARTS_IN_FLIGHT {
            self.wait_oldest().await?;
        }
        let upload = self.upload.as_mut().expect("multipart upload started").get_mut().expect("poisoned");
        self.inner.requests.put.fetch_add(1, Ordering::Relaxed);
        // The part future must run while this writer waits for the client's next chunk.
        self.in_flight.push_back(tokio::spawn(upload.put_part(PutPayload::from(part))));
        Ok(())
    }

    async fn wait_oldest(&mut self) -> Result<()> {
        let Some(h) = self.in_flight.pop_front() else { return Ok(()) };
        let d = self.digest;
        match h.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(self.fail(format_args!("uploading a part of blob {d}"), e)),
            Err(e) => {
                self.failed = true;
                Err(Error::internal(format!("part upload task of blob {d} failed: {e}")))
            }
        }
    }
}

#[async_trait]
impl BlobWriter for S3Writer {
    fn committed(&self) -> u64 {
        self.committed
    }

    async fn write(&mut self, chunk: Bytes) -> Result<()> {
        if self.failed {
            return Err(Error::internal("writer used after a failed write"));
        }
        self.committed += chunk.len() as u64;
        self.buf.extend_from_slice(&chunk);
        while self.buf.len() > PART_SIZE {
            // More than one part's worth: this blob goes up in parts. The buffer keeps
            // at least one byte back so the last part is never empty.
            if self.upload.is_none() {
                let d = self.digest;
                self.inner.requests.put.fetch_add(1, Ordering::Relaxed);
                match self.inner.store.put_multipart(&self.inner.path(&d)).await {
                    Ok(u) => self.upload = Some(Mutex::new(u)),
                    Err(e) => return Err(self.fail(format_args!("starting the multipart upload of blob {d}"), e)),
                }
            }
            let part = self.buf.split_to(PART_SIZE).freeze();
            self.send_part(part).await?;
        }
        Ok(())
    }

    fn buffered(&self) -> u64 {
        // A part is sent only once it is full (S3's minimum part size), so a partial part
        // stays here; the server drops this upload when it is idle and memory runs short.
        self.buf.len() as u64
    }

    async fn commit(mut self: Box<Self>) -> Result<()> {
        if self.failed {
            return Err(Error::internal("writer used after a failed write"));
        }
        if self.committed != self.digest.size {
            return Err(Error::invalid(format!(
                "blob {}: received {} bytes, digest says {}",
                self.digest, self.committed, self.digest.size
            )));
        }
        let d = self.digest;
        let rest = std::mem::take(&mut self.buf).freeze();
        if self.upload.is_none() {
            let inner = self.inner.clone();
            let what = format!("{}: PUT of blob {d}", inner.what);
            self.inner
                .single_flight(d, move || {
                    async move {
                        inner.requests.put.fetch_add(1, Ordering::Relaxed);
                        inner
                            .store
                            .put(&inner.path(&d), PutPayload::from(rest))
                            .await
                            .map(|_| ())
                            .map_err(|e| Arc::new(format!("{what}: {e}")))
                    }
                    .boxed()
                })
                .await
                .inspect_err(|_| self.failed = true)?;
            return Ok(());
        }
        self.send_part(rest).await?;
        while !self.in_flight.is_empty() {
            self.wait_oldest().await?;
        }
        // Taken by the commit if it runs; left for this writer to abort if another
        // writer's commit of the same blob was already in flight.
        let upload = Arc::new(Mutex::new(self.upload.take()));
        let (inner, mine) = (self.inner.clone(), upload.clone());
        let what = format!("{}: completing the multipart upload of blob {d}", inner.what);
        let led = self
            .inner
            .single_flight(d, move || {
                let mut upload =
                    mine.lock().expect("poisoned").take().expect("started").into_inner().expect("poisoned");
                async move {
                    inner.requests.put.fetch_add(1, Ordering::Relaxed);
                    let res = upload.complete().await.map(|_| ()).map_err(|e| Arc::new(format!("{what}: {e}")));
                    if res.is_err() {
                        let _ = inner.abandoned.send(upload);
                    }
                    res
                }
                .boxed()
            })
            .await
            .inspect_err(|_| self.failed = true);
        if let Some(unused) = upload.lock().expect("poisoned").take() {
            // Another writer stored the blob: this upload's parts are not needed.
            let _ = self.inner.abandoned.send(unused.into_inner().expect("poisoned"));
        }
        led.map(|_| ())
    }
}

impl Drop for S3Writer {
    fn drop(&mut self) {
        for h in self.in_flight.drain(..) {
            h.abort();
        }
        if let Some(upload) = self.upload.take().and_then(|u| u.into_inner().ok()) {
            // Unreferenced parts would cost storage until a lifecycle rule removed them.
            let _ = self.inner.abandoned.send(upload);
        }
    }
}

/// A bounded, expiring record of blobs confirmed in the bucket: written by this process,
/// read from it, or found by a HEAD. A blob in it is answered present without a request.
/// Entries expire `ttl` after their confirmation, or earlier when the bucket's lifecycle
/// rule would leave the blob less than its promised lifetime (`good_until`), and the
/// oldest go first past `capacity`, so a blob that left the bucket is believed present
/// for at most `ttl`, and never past the time the lifecycle rule could remove it.
///
/// It also remembers, for `absence_ttl`, blobs a HEAD or GET found missing, so asking
/// about them again soon costs no request. That is safe where a stale "present" is not:
/// a blob another frontend uploaded meanwhile is only uploaded once more, and a blob
/// written through this process leaves the absent side at once.
struct PresenceRecord {
    map: Mutex<lru::LruCache<Digest, (Instant, Option<SystemTime>)>>,
    ttl: Duration,
    absent: Mutex<lru::LruCache<Digest, Instant>>,
    absence_ttl: Duration,
}

impl PresenceRecord {
    fn new(capacity: usize, ttl: Duration, absence_ttl: Duration) -> Self {
        let cap = NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN);
        PresenceRecord {
            map: Mutex::new(lru::LruCache::new(cap)),
            ttl,
            absent: Mutex::new(lru::LruCache::new(cap)),
            absence_ttl,
        }
    }

    fn contains(&self, d: &Digest, now: SystemTime) -> bool {
        if self.ttl.is_zero() {
            return false;
        }
        let mut map = self.map.lock().expect("poisoned");
        match map.peek(d) {
            Some((at, until)) if at.elapsed() < self.ttl && until.is_none_or(|u| now < u) => true,
            Some(_) => {
                map.pop(d);
                false
            }
            None => false,
        }
    }

    /// Whether `d` was found missing within `absence_ttl`.
    fn known_absent(&self, d: &Digest) -> bool {
        if self.absence_ttl.is_zero() {
            return false;
        }
        let mut absent = self.absent.lock().expect("poisoned");
        match absent.peek(d) {
            Some(at) if at.elapsed() < self.absence_ttl => true,
            Some(_) => {
                absent.pop(d);
                false
            }
            None => false,
        }
    }

    /// `d` was found missing by a request sent at `asked_at`. A confirmation newer than
    /// the request (a write that finished while it was in flight) wins over it.
    fn mark_absent(&self, d: Digest, asked_at: Instant) {
        {
            let mut map = self.map.lock().expect("poisoned");
            if map.peek(&d).is_some_and(|(at, _)| *at > asked_at) {
                return;
            }
            map.pop(&d);
        }
        if !self.absence_ttl.is_zero() {
            self.absent.lock().expect("poisoned").put(d, Instant::now());
        }
    }

    fn insert(&self, d: Digest, good_until: Option<SystemTime>) {
        self.absent.lock().expect("poisoned").pop(&d);
        if !self.ttl.is_zero() {
            self.map.lock().expect("poisoned").put(d, (Instant::now(), good_until));
        }
    }
}

struct ProfileCredentials {
    key_id: String,
    secret_key: String,
    token: Option<String>,
}

/// An error and the causes under it that its message does not already say: an HTTP
/// client's "error sending request" says nothing of the refused connection or the
/// untrusted certificate beneath it, which is what an operator needs.
fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let said = c.to_string();
        if !text.contains(&said) {
            text = format!("{text}: {said}");
        }
        cause = c.source();
    }
    text
}

/// The certificates of a PEM file of certificate authorities (`[cas] ca_file`).
fn read_ca_file(path: &std::path::Path) -> std::result::Result<Vec<object_store::Certificate>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("cas.ca_file {}: {e}", path.display()))?;
    let certs = object_store::Certificate::from_pem_bundle(&pem)
        .map_err(|e| format!("cas.ca_file {}: not PEM certificates: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("cas.ca_file {}: holds no PEM certificate", path.display()));
    }
    Ok(certs)
}

/// Makes ring the process's rustls provider, if none is yet. object_store's HTTPS client
/// (reqwest) is built on the process default, and gantry links ring alone: the second
/// provider reqwest would bring (aws-lc-rs) costs a C build and adds nothing.
pub(crate) fn install_crypto_provider() {
    // An error means a provider is installed already (ring, by gantry): nothing to do.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The profile `AWS_PROFILE` (or `default`) of the shared credentials file, if the file
/// exists and has it. A profile that exists without both keys is an error naming the file.
fn shared_credentials_profile() -> Result<Option<ProfileCredentials>> {
    let path = match std::env::var_os("AWS_SHARED_CREDENTIALS_FILE") {
        Some(p) => std::path::PathBuf::from(p),
        None => match std::env::var_os("HOME") {
            Some(h) => std::path::PathBuf::from(h).join(".aws").join("credentials"),
            None => return Ok(None),
        },
    };
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
    let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".into());
    parse_profile(&text, &profile).map_err(|m| Error::FailedPrecondition(format!("{}: {m}", path.display())))
}

fn parse_profile(text: &str, profile: &str) -> std::result::Result<Option<ProfileCredentials>, String> {
    let mut in_profile = false;
    let mut found = false;
    let (mut key_id, mut secret_key, mut token) = (None, None, None);
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            in_profile = name.trim() == profile;
            found |= in_profile;
            continue;
        }
        if !in_profile {
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            let v = v.trim().to_string();
            match k.trim() {
                "aws_access_key_id" => key_id = Some(v),
                "aws_secret_access_key" => secret_key = Some(v),
                "aws_session_token" => token = Some(v),
                _ => {}
            }
        }
    }
    match (found, key_id, secret_key) {
        (false, _, _) => Ok(None),
        (true, Some(key_id), Some(secret_key)) => Ok(Some(ProfileCredentials { key_id, secret_key, token })),
        // The message names the profile, never a value from it.
        (true, _, _) => Err(format!("profile [{profile}] lacks aws_access_key_id or aws_secret_access_key")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_credentials_file_profiles() {
        let text = "[default]\naws_access_key_id = AK1\naws_secret_access_key = s1\n\n# c\n[ci]\naws_access_key_id=AK2\naws_secret_access_key=s2\naws_session_token = t2\n[broken]\naws_access_key_id = AK3\n";
        let p = parse_profile(text, "default").unwrap().unwrap();
        assert_eq!((p.key_id.as_str(), p.secret_key.as_str(), p.token), ("AK1", "s1", None));
        let p = parse_profile(text, "ci").unwrap().unwrap();
        assert_eq!((p.key_id.as_str(), p.secret_key.as_str(), p.token.as_deref()), ("AK2", "s2", Some("t2")));
        assert!(parse_profile(text, "absent").unwrap().is_none());
        let e = parse_profile(text, "broken").err().unwrap();
        assert!(e.contains("[broken]") && !e.contains("AK3"), "{e}");
    }

    #[test]
    fn presence_record_expires_and_is_bounded() {
        let d = |i: u32| gantry_core::DigestFunction::Sha256.digest_of(&i.to_le_bytes());
        let now = SystemTime::now();
        let r = PresenceRecord::new(2, Duration::from_secs(3600), Duration::ZERO);
        r.insert(d(1), None);
        r.insert(d(2), None);
        r.insert(d(3), None);
        assert_eq!([r.contains(&d(1), now), r.contains(&d(2), now), r.contains(&d(3), now)], [false, true, true]);
        let r = PresenceRecord::new(10, Duration::from_millis(1), Duration::ZERO);
        r.insert(d(1), None);
        std::thread::sleep(Duration::from_millis(5));
        assert!(!r.contains(&d(1), now), "an old confirmation is not trusted");
        let off = PresenceRecord::new(10, Duration::ZERO, Duration::ZERO);
        off.insert(d(1), None);
        assert!(!off.contains(&d(1), now));
        // A lifecycle rule ends the promise at good_until, whatever the ttl.
        let r = PresenceRecord::new(10, Duration::from_secs(3600), Duration::ZERO);
        r.insert(d(1), Some(now + Duration::from_secs(60)));
        assert!(r.contains(&d(1), now + Duration::from_secs(59)));
        assert!(!r.contains(&d(1), now + Duration::from_secs(60)), "not past the time the rule leaves too little");
        assert!(!r.contains(&d(1), now), "and the expired entry is gone");
        // Absences: remembered for absence_ttl, forgotten at once when the blob is written.
        let r = PresenceRecord::new(10, Duration::from_secs(3600), Duration::from_millis(50));
        let asked = Instant::now();
        r.insert(d(1), None);
        r.mark_absent(d(1), asked);
        assert!(r.contains(&d(1), now), "a write that finished while the HEAD was in flight wins");
        r.mark_absent(d(1), Instant::now());
        assert!(!r.contains(&d(1), now) && r.known_absent(&d(1)), "found missing: no longer present");
        r.insert(d(1), None);
        assert!(r.contains(&d(1), now) && !r.known_absent(&d(1)), "written: present, not absent");
        r.mark_absent(d(2), Instant::now());
        std::thread::sleep(Duration::from_millis(60));
        assert!(!r.known_absent(&d(2)), "absences expire");
        let off = PresenceRecord::new(10, Duration::from_secs(1), Duration::ZERO);
        off.mark_absent(d(3), Instant::now());
        assert!(!off.known_absent(&d(3)));
    }

    #[test]
    fn credentials_debug_hides_the_secret() {
        let c = S3Credentials::Static { key_id: "AKID".into(), secret_key: "hunter2".into() };
        let s = format!("{c:?}");
        assert!(s.contains("AKID") && !s.contains("hunter2"), "{s}");
    }
}
