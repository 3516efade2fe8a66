//! gantry-services owns the gRPC face of gantry: the REAPI cache services (Capabilities,
//! ContentAddressableStorage, ByteStream, ActionCache), the Prometheus metrics, and the
//! HTTP endpoint that serves them. Services work only through the gantry-core traits.
//!
//! `Services` assembles them from a CAS and an action cache; `RunningServer` serves them
//! on two listeners and shuts down gracefully.

pub mod action_cache;
pub mod auth;
pub mod batcher;
pub mod build_events;
pub mod bytestream;
pub mod bytestream_read;
pub mod cache_hits;
pub mod capabilities;
pub mod cas;
pub mod coalesce;
pub mod compression;
pub mod metrics;
pub mod tls;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use gantry_core::google::longrunning::operations_server::OperationsServer;
use gantry_core::reapi::action_cache_server::ActionCacheServer;
use gantry_core::reapi::capabilities_server::CapabilitiesServer;
use gantry_core::reapi::content_addressable_storage_server::ContentAddressableStorageServer;
use gantry_core::reapi::execution_server::ExecutionServer;
use gantry_core::task::{spawn_named, TaskGuard};
use gantry_core::{ActionCache, BlobStore, Error, ExecutionLog, Result};
use gantry_proto::batch::v1::batcher_server::BatcherServer;
use gantry_proto::queue::v1::submit_queue_server::SubmitQueueServer;
use gantry_proto::worker::v1::worker_service_server::WorkerServiceServer;
use tokio::net::TcpListener;
use tokio_stream::StreamExt as _;
use tonic::codec::CompressionEncoding;

pub use metrics::{Metrics, MetricsLayer};

/// Protocol limits, from `[server]` in gantry.toml.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_batch_size: u64,
    pub read_chunk_size: usize,
    pub upload_idle_timeout: Duration,
    /// Largest Action, Command or Directory read on a client's behalf.
    pub max_proto_size: u64,
    /// Uploads one client (identity, or address when anonymous) may have in progress.
    pub max_uploads_per_client: usize,
    /// Bytes all uploads in progress may hold in memory; one client a quarter of it.
    pub max_upload_memory: u64,
}

impl From<&gantry_config::ServerConfig> for Limits {
    fn from(s: &gantry_config::ServerConfig) -> Self {
        Limits {
            max_batch_size: s.max_batch_size.as_u64(),
            read_chunk_size: s.read_chunk_size.as_u64() as usize,
            upload_idle_timeout: s.upload_idle_timeout,
            max_proto_size: s.max_proto_size.as_u64(),
            max_uploads_per_client: s.max_uploads_per_client,
            max_upload_memory: s.max_upload_memory.as_u64(),
        }
    }
}

/// The defaults are `[server]`'s, kept in one place: gantry-config.
impl Default for Limits {
    fn default() -> Self {
        Limits::from(&gantry_config::ServerConfig::default())
    }
}

pub struct Services {
    pub cas: Arc<dyn BlobStore>,
    pub ac: Arc<dyn ActionCache>,
    pub metrics: Arc<Metrics>,
    pub limits: Limits,
    pub batcher: Arc<batcher::BatcherService>,
    /// Remote execution, when a scheduler is attached.
    pub scheduler: Option<Arc<gantry_execution::Scheduler>>,
    /// Remote execution on another process's scheduler (this server is a frontend).
    pub forwarder: Option<gantry_execution::forward::Forwarder>,
    /// `[auth]`: who may call. None: everyone may do everything.
    pub auth: Option<Arc<auth::Authenticator>>,
    /// The submit queue's endpoint; the queue attaches after the server starts.
    pub queue: Arc<gantry_submit::QueueEndpoint>,
    /// The Build Event Service, when invocations have a store.
    pub build_events: Option<Arc<build_events::BuildEventService>>,
    /// Remote cache hits per invocation: the ActionCache service counts, the Build Event
    /// Service records the counts in the invocation store.
    pub cache_hits: Arc<cache_hits::CacheHits>,
    /// The web pages on the HTTP port.
    pub web: Option<Arc<gantry_web::Web>>,
}

impl Services {
    /// The cache services, with a batcher on default planner settings and no models.
    pub fn new(cas: Arc<dyn BlobStore>, ac: Arc<dyn ActionCache>, limits: Limits) -> Self {
        let batcher = batcher::BatcherService::new(Default::default(), Default::default())
            .expect("default planner config is valid");
        Self::with_batcher(cas, ac, limits, batcher)
    }

    pub fn with_batcher(
        cas: Arc<dyn BlobStore>,
        ac: Arc<dyn ActionCache>,
        limits: Limits,
        batcher: batcher::BatcherService,
    ) -> Self {
        let metrics = Metrics::new(cas.clone());
        Services {
            cas,
            ac,
            metrics,
            limits,
            batcher: Arc::new(batcher),
            scheduler: None,
            forwarder: None,
            auth: None,
            queue: Default::default(),
            build_events: None,
            cache_hits: Default::default(),
            web: None,
        }
    }

    /// Adds remote execution: Execution, Operations and the worker endpoint.
    pub fn with_scheduler(mut self, scheduler: Arc<gantry_execution::Scheduler>) -> Self {
        // The pages show this scheduler's workers and queue, whichever was added first.
        if let Some(web) = &self.web {
            self.web = Some(Arc::new(gantry_web::Web { fleet: Some(scheduler.clone()), ..(**web).clone() }));
        }
        self.scheduler = Some(scheduler);
        self
    }

    /// Adds remote execution on the scheduler behind `forwarder`: this server serves the
    /// caches itself and forwards Execution and Operations calls.
    pub fn with_forwarder(mut self, forwarder: gantry_execution::forward::Forwarder) -> Self {
        self.forwarder = Some(forwarder);
        self
    }

    /// Adds the Build Event Service, storing invocations in `store`.
    pub fn with_build_events(mut self, store: Arc<dyn gantry_core::InvocationStore>) -> Self {
        self.build_events =
            Some(Arc::new(build_events::BuildEventService::new(store).with_cache_hits(self.cache_hits.clone())));
        self
    }

    /// Adds the web pages over the metadata stores and the CAS.
    pub fn with_web(mut self, stores: WebStores) -> Self {
        let WebStores { invocations, log, builds, queue, sizes, selection } = stores;
        self.web = Some(Arc::new(gantry_web::Web {
            invocations,
            log,
            cas: self.cas.clone(),
            ac: self.ac.clone(),
            builds,
            queue,
            sizes,
            selection,
            fleet: self.scheduler.clone().map(|s| s as Arc<dyn gantry_core::Fleet>),
            history: Default::default(),
            login: None,
            replay: Default::default(),
        }));
        self
    }

    /// Requires the credentials of `[auth]` on every gRPC call.
    pub fn with_auth(mut self, auth: auth::Authenticator) -> Self {
        self.auth = Some(Arc::new(auth));
        self
    }

    /// Every gRPC service on one router, behind the metrics layer.
    pub fn grpc_router(
        &self,
    ) -> tonic::transport::server::Router<
        tower::layer::util::Stack<
            auth::AuthLayer,
            tower::layer::util::Stack<MetricsLayer, tower::layer::util::Identity>,
        >,
    > {
        // Batches may be as large as advertised, plus protobuf framing.
        let max_msg = self.limits.max_batch_size as usize + (1 << 20);
        let cas = ContentAddressableStorageServer::new(cas::CasService::new(
            self.cas.clone(),
            self.metrics.clone(),
            self.limits.max_batch_size,
            self.limits.max_proto_size,
        ))
        .max_decoding_message_size(max_msg)
        // A batch response repeats each request entry's digest and adds a status (or the
        // data, which the batch limit bounds), so it may outgrow the largest request.
        .max_encoding_message_size(2 * max_msg)
        .accept_compressed(CompressionEncoding::Zstd)
        .send_compressed(CompressionEncoding::Zstd);
        let bs = bytestream_read::ByteStreamRoutes::new(
            bytestream::ByteStreamService::new(
                self.cas.clone(),
                self.metrics.clone(),
                self.limits.read_chunk_size,
                self.limits.upload_idle_timeout,
            )
            .with_per_client_limit(self.limits.max_uploads_per_client)
            .with_memory_limit(self.limits.max_upload_memory),
            |s| s.max_decoding_message_size(max_msg).max_encoding_message_size(max_msg),
        );
        let ac = ActionCacheServer::new(
            action_cache::ActionCacheService::new(self.ac.clone(), self.cas.clone(), self.metrics.clone())
                .with_cache_hits(self.cache_hits.clone()),
        )
        .max_decoding_message_size(max_msg)
        .max_encoding_message_size(max_msg);
        let executes = self.scheduler.is_some() || self.forwarder.is_some();
        let exec_caps = executes.then(|| gantry_core::reapi::ExecutionCapabilities {
            digest_function: gantry_core::reapi::digest_function::Value::Sha256 as i32,
            exec_enabled: true,
            execution_priority_capabilities: Some(gantry_core::reapi::PriorityCapabilities {
                priorities: vec![gantry_core::reapi::priority_capabilities::PriorityRange {
                    min_priority: i32::MIN,
                    max_priority: i32::MAX,
                }],
            }),
            supported_node_properties: vec![],
            digest_functions: gantry_core::DigestFunction::ALL.iter().map(|f| f.to_proto()).collect(),
        });
        let caps = CapabilitiesServer::new(capabilities::CapabilitiesService::new(
            self.limits.max_batch_size,
            self.cas.usage().max_bytes,
            exec_caps,
        ));
        let (exec, ops, workers) = match &self.scheduler {
            Some(s) => (
                Some(
                    ExecutionServer::new(
                        gantry_execution::operations::ExecutionService::new(
                            s.clone(),
                            self.cas.clone(),
                            self.ac.clone(),
                        )
                        .with_max_proto_size(self.limits.max_proto_size),
                    )
                    .max_encoding_message_size(max_msg),
                ),
                Some(OperationsServer::new(gantry_execution::operations::OperationsService::new(s.clone()))),
                Some(
                    WorkerServiceServer::new(gantry_execution::worker_service::WorkerService::new(s.clone()))
                        .max_decoding_message_size(max_msg)
                        .max_encoding_message_size(max_msg),
                ),
            ),
            None => (None, None, None),
        };
        let (forward_exec, forward_ops) = match (&self.scheduler, &self.forwarder) {
            (None, Some(f)) => (
                Some(ExecutionServer::new(f.clone()).max_encoding_message_size(max_msg)),
                Some(OperationsServer::new(f.clone())),
            ),
            _ => (None, None),
        };
        tonic::transport::Server::builder()
            // h2's default 64 KiB windows cap an upload at one window per round trip;
            // large windows let a client stream a 64 MiB blob at memory speed.
            .initial_stream_window_size(Some(16 << 20))
            .initial_connection_window_size(Some(64 << 20))
            // Detect half-open connections, so a vanished client cannot hold an upload
            // session (and graceful shutdown) forever.
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(Duration::from_secs(20)))
            // Outside authentication, so refusals are counted by method and code too.
            .layer(MetricsLayer(self.metrics.clone()))
            .layer(auth::AuthLayer(self.auth.clone()))
            .add_service(caps)
            .add_service(cas)
            .add_service(bs)
            .add_service(ac)
            .add_service(BatcherServer::from_arc(self.batcher.clone()))
            .add_service(SubmitQueueServer::from_arc(self.queue.clone()))
            .add_optional_service(exec)
            .add_optional_service(ops)
            .add_optional_service(workers)
            .add_optional_service(forward_exec)
            .add_optional_service(forward_ops)
            .add_optional_service(self.build_events.clone().map(|b| {
                gantry_proto::devtools_build::v1::publish_build_event_server::PublishBuildEventServer::from_arc(b)
                    .max_decoding_message_size(max_msg)
            }))
    }

    /// `/metrics` (Prometheus text format), `/healthz` and the web pages; with `[auth]` the
    /// pages need a sign-in with an `[auth]` token (its cookie `Secure` when `secure`).
    pub fn http_router(&self, secure: bool) -> axum::Router {
        let metrics = self.metrics.clone();
        let pages = match (&self.web, &self.auth) {
            (Some(web), None) => gantry_web::router(web.clone()),
            (Some(web), Some(auth)) => {
                let a = auth.clone();
                let authenticate: gantry_web::login::Authenticate = Arc::new(move |token: &str| {
                    let id = a.authenticate(Some(format!("Bearer {token}").as_bytes()), &[])?;
                    // A worker's credential reads every instance's blobs to run actions;
                    // it is not a person's and does not sign in.
                    if id.principal != gantry_core::auth::Principal::Client {
                        return Err("worker credentials cannot sign in to the web UI");
                    }
                    Ok(id)
                });
                let login =
                    gantry_web::login::Login { authenticate, secure, anonymous: auth.authenticate(None, &[]).ok() };
                gantry_web::router(Arc::new(gantry_web::Web { login: Some(Arc::new(login)), ..(**web).clone() }))
            }
            (None, _) => axum::Router::new(),
        };
        pages
            .route(
                "/metrics",
                axum::routing::get(move || {
                    let m = metrics.clone();
                    async move { ([(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], m.render()) }
                }),
            )
            .route("/healthz", axum::routing::get(|| async { "ok\n" }))
    }
}

/// The metadata stores the web pages read (the CAS and action cache come from [`Services`]).
pub struct WebStores {
    pub invocations: Arc<dyn gantry_core::InvocationStore>,
    pub log: Arc<dyn ExecutionLog>,
    pub builds: Arc<dyn gantry_core::BuildStore>,
    pub queue: Arc<dyn gantry_core::QueueStore>,
    pub sizes: Arc<dyn gantry_core::SizeClassStore>,
    /// `[execution.size_classes]`, for the acceptable times the pages show.
    pub selection: gantry_sizeclass::SelectionConfig,
}

/// How long shutdown waits for in-flight calls before abandoning them.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// A server serving gRPC and HTTP until `shutdown` is called or the guard is dropped.
pub struct RunningServer {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    stop: Option<tokio::sync::watch::Sender<bool>>,
    grpc: Option<tokio::task::JoinHandle<Result<()>>>,
    _http: TaskGuard,
    /// The TLS accept loops and the SIGHUP reloader, when serving TLS, and the pages'
    /// queue-depth sampler.
    _tasks: Vec<TaskGuard>,
}

impl RunningServer {
    /// Binds both listeners (port 0 picks a free port) and starts serving.
    pub async fn start(services: &Services, grpc_listen: SocketAddr, http_listen: SocketAddr) -> Result<Self> {
        Self::start_tls(services, grpc_listen, http_listen, None).await
    }

    /// Like `start`, with TLS on both listeners when `tls` is given.
    pub async fn start_tls(
        services: &Services,
        grpc_listen: SocketAddr,
        http_listen: SocketAddr,
        tls: Option<&tls::Tls>,
    ) -> Result<Self> {
        let grpc_listener = TcpListener::bind(grpc_listen)
            .await
            .map_err(|e| Error::io(format!("binding gRPC listener on {grpc_listen}"), e))?;
        let http_listener = TcpListener::bind(http_listen)
            .await
            .map_err(|e| Error::io(format!("binding HTTP listener on {http_listen}"), e))?;
        let grpc_addr = grpc_listener.local_addr().map_err(|e| Error::io("reading gRPC address", e))?;
        let http_addr = http_listener.local_addr().map_err(|e| Error::io("reading HTTP address", e))?;
        let (stop, rx) = tokio::sync::watch::channel(false);
        let mut rx_http = rx.clone();
        let http = services.http_router(tls.is_some());
        let mut tasks: Vec<TaskGuard> = services.web.as_ref().and_then(|w| w.start_sampler()).into_iter().collect();
        tasks.extend(services.build_events.as_ref().and_then(|b| b.start_cache_hits_flusher()));
        let http_task = match tls {
            None => spawn_named("http-server", async move {
                let res = axum::serve(http_listener, http)
                    .with_graceful_shutdown(async move {
                        let _ = rx_http.wait_for(|s| *s).await;
                    })
                    .await;
                if let Err(e) = res {
                    tracing::error!(error = %e, "HTTP server failed");
                }
            }),
            Some(tls) => {
                let (conns, accept) = tls.incoming(http_listener);
                let listener = tls::TlsListener { rx: conns, addr: http_addr, _accept: accept };
                spawn_named("https-server", async move {
                    let res = axum::serve(listener, http)
                        .with_graceful_shutdown(async move {
                            let _ = rx_http.wait_for(|s| *s).await;
                        })
                        .await;
                    if let Err(e) = res {
                        tracing::error!(error = %e, "HTTPS server failed");
                    }
                })
            }
        };
        let router = services.grpc_router();
        let mut rx_grpc = rx;
        let shutdown = async move {
            let _ = rx_grpc.wait_for(|s| *s).await;
        };
        let grpc = match tls {
            None => {
                // Small gRPC frames (a cache hit's headers, message and trailers) must not
                // wait for Nagle's algorithm: with delayed ACKs that adds ~40 ms to some calls.
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(grpc_listener).map(|s| {
                    s.map(|s| {
                        let _ = s.set_nodelay(true);
                        coalesce::CoalescedWrites::new(s)
                    })
                });
                tokio::spawn(async move {
                    router
                        .serve_with_incoming_shutdown(incoming, shutdown)
                        .await
                        .map_err(|e| Error::Unavailable(format!("gRPC server failed: {e}")))
                })
            }
            Some(tls) => {
                let (conns, accept) = tls.incoming(grpc_listener);
                tasks.push(accept);
                tasks.push(tls.reload_on_sighup()?);
                let incoming = tokio_stream::wrappers::ReceiverStream::new(conns)
                    .map(|(s, _)| Ok::<_, std::io::Error>(coalesce::CoalescedWrites::new(s)));
                tokio::spawn(async move {
                    router
                        .serve_with_incoming_shutdown(incoming, shutdown)
                        .await
                        .map_err(|e| Error::Unavailable(format!("gRPC server failed: {e}")))
                })
            }
        };
        tracing::info!(%grpc_addr, %http_addr, "gantry serving");
        Ok(RunningServer { grpc_addr, http_addr, stop: Some(stop), grpc: Some(grpc), _http: http_task, _tasks: tasks })
    }

    /// Serves until `signal` resolves, then stops accepting and drains in-flight calls.
    pub async fn run_until(mut self, signal: impl Future<Output = ()>) -> Result<()> {
        let grpc = self.grpc.take().expect("running");
        tokio::pin!(grpc);
        tokio::select! {
            res = &mut grpc => return res.map_err(|e| Error::internal(format!("gRPC task: {e}")))?,
            _ = signal => {}
        }
        tracing::info!("shutting down: draining in-flight requests");
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        match tokio::time::timeout(DRAIN_TIMEOUT, &mut grpc).await {
            Ok(res) => res.map_err(|e| Error::internal(format!("gRPC task: {e}")))?,
            Err(_) => {
                tracing::warn!("requests still running after {DRAIN_TIMEOUT:?}; stopping anyway");
                grpc.abort();
                Ok(())
            }
        }
    }

    pub async fn shutdown(self) -> Result<()> {
        self.run_until(async {}).await
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(g) = self.grpc.take() {
            g.abort();
        }
    }
}
