//! TLS on gantry's listeners (`[server.tls]`), with rustls: the server certificate, and
//! optionally a CA whose client certificates are required (mTLS).
//!
//! Handshakes run in their own tasks, off the accept loop, so a client that opens a
//! connection and never speaks cannot stall others; a handshake that does not finish in
//! `HANDSHAKE_TIMEOUT` is dropped. The configuration is re-read on SIGHUP (and on
//! `reload`): a renewed certificate applies to new connections without a restart, and a
//! file that does not load leaves the previous configuration in place, with an error in
//! the log.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use gantry_core::task::{spawn_named, TaskGuard};
use gantry_core::{Error, Result};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The files of `[server.tls]`.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
    /// Clients may connect without a certificate (and authenticate otherwise).
    pub client_certificates_optional: bool,
}

fn read_certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| Error::invalid(format!("{what} {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(Error::invalid(format!("{what} {}: no PEM certificate in it", path.display())));
    }
    Ok(certs)
}

/// The rustls configuration for `files`, offering HTTP/2 (gRPC) and HTTP/1.1.
pub fn server_config(files: &TlsFiles) -> Result<rustls::ServerConfig> {
    let certs = read_certs(&files.cert, "server.tls.cert")?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| Error::invalid(format!("server.tls.key {}: {e}", files.key.display())))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::internal(format!("TLS versions: {e}")))?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in read_certs(ca, "server.tls.client_ca")? {
                roots.add(c).map_err(|e| Error::invalid(format!("server.tls.client_ca {}: {e}", ca.display())))?;
            }
            let mut verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            if files.client_certificates_optional {
                verifier = verifier.allow_unauthenticated();
            }
            let verifier =
                verifier.build().map_err(|e| Error::invalid(format!("server.tls.client_ca {}: {e}", ca.display())))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| Error::invalid(format!("server.tls: the key does not fit the certificate: {e}")))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// The current configuration, swapped whole on reload.
#[derive(Clone)]
pub struct Tls {
    files: TlsFiles,
    current: Arc<RwLock<Arc<rustls::ServerConfig>>>,
}

impl Tls {
    /// Loads the files now: a bad certificate stops the server at startup.
    pub fn load(files: TlsFiles) -> Result<Tls> {
        let config = server_config(&files)?;
        Ok(Tls { files, current: Arc::new(RwLock::new(Arc::new(config))) })
    }

    /// Re-reads the files; on failure the previous configuration stays.
    pub fn reload(&self) -> Result<()> {
        let config = server_config(&self.files)?;
        *self.current.write().expect("poisoned") = Arc::new(config);
        tracing::info!(cert = %self.files.cert.display(), "TLS configuration reloaded");
        Ok(())
    }

    fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current.read().expect("poisoned").clone())
    }

    /// Reloads on every SIGHUP until the guard is dropped.
    pub fn reload_on_sighup(&self) -> Result<TaskGuard> {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = signal(SignalKind::hangup()).map_err(|e| Error::io("installing the SIGHUP handler", e))?;
        let tls = self.clone();
        Ok(spawn_named("tls-reload", async move {
            while hup.recv().await.is_some() {
                if let Err(e) = tls.reload() {
                    tracing::error!(error = %e, "TLS reload failed; keeping the previous certificate");
                }
            }
        }))
    }

    /// Accepts on `listener` and hands out connections whose handshake completed. The
    /// accept loop lives as long as the returned guard.
    pub fn incoming(
        &self,
        listener: TcpListener,
    ) -> (tokio::sync::mpsc::Receiver<(TlsStream<BufferedTcp>, SocketAddr)>, TaskGuard) {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let tls = self.clone();
        let guard = spawn_named("tls-accept", async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: wait rather than spin.
                        tracing::warn!(error = %e, "accepting a connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let (acceptor, tx) = (tls.acceptor(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(BufferedTcp::new(tcp))).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send((stream, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        (rx, guard)
    }
}

/// A connection's socket with a read buffer under TLS. rustls asks for at most 4 KiB of
/// ciphertext per read, so without it a request of 7 KiB (FindMissingBlobs of 100
/// digests) took two recvfrom calls and a 4 MiB upload a thousand, where plaintext
/// hyper reads whole requests at once. 32 KiB holds two full TLS records; it costs that
/// much memory per open connection.
pub struct BufferedTcp(tokio::io::BufReader<TcpStream>);

const READ_BUFFER: usize = 32 * 1024;

impl BufferedTcp {
    pub fn new(tcp: TcpStream) -> BufferedTcp {
        BufferedTcp(tokio::io::BufReader::with_capacity(READ_BUFFER, tcp))
    }
}

impl tokio::io::AsyncRead for BufferedTcp {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for BufferedTcp {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// The peer address, as for a plain TCP connection (the TLS layer adds the certificates).
impl tonic::transport::server::Connected for BufferedTcp {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.0.get_ref().connect_info()
    }
}

/// The HTTP listener over TLS, for axum.
pub struct TlsListener {
    pub rx: tokio::sync::mpsc::Receiver<(TlsStream<BufferedTcp>, SocketAddr)>,
    pub addr: SocketAddr,
    pub _accept: TaskGuard,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<BufferedTcp>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task ended (shutdown): never hand out another connection.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}
