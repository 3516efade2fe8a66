//! The floor under `gantry bench auth`: the same two calls answered by a tonic server with
//! none of gantry's request path in it (no store, no auth layer, no metrics), plaintext,
//! with tonic's own rustls TLS, or behind gantry's TLS listener (`--gantry-listener`:
//! its accept loop and read buffer, nothing after the handshake). What TLS costs this
//! server per call is what rustls, tokio-rustls and h2 cost, and no server built on them
//! can do the calls for less; `bench auth` runs it beside `gantry serve` so the costs are
//! measured side by side in one run.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use gantry_core::reapi::{
    self, action_cache_server::ActionCache, action_cache_server::ActionCacheServer,
    content_addressable_storage_server::ContentAddressableStorage,
    content_addressable_storage_server::ContentAddressableStorageServer,
};
use tonic::{Request, Response, Status};

#[derive(clap::Args)]
pub struct FloorServerArgs {
    /// Address to serve on.
    #[arg(long)]
    listen: SocketAddr,
    /// Serve TLS with this certificate (PEM) and --tls-key, through tonic's own rustls.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve TLS through gantry's own listener (`gantry_services::tls`) instead of tonic's.
    #[arg(long, requires = "tls_cert")]
    gantry_listener: bool,
}

/// Answers every GetActionResult with an empty result and every FindMissingBlobs with
/// "none missing": the least a server can do for them after decoding the request.
#[derive(Clone, Copy)]
struct Floor;

#[tonic::async_trait]
impl ActionCache for Floor {
    async fn get_action_result(
        &self,
        _: Request<reapi::GetActionResultRequest>,
    ) -> Result<Response<reapi::ActionResult>, Status> {
        Ok(Response::new(reapi::ActionResult::default()))
    }

    async fn update_action_result(
        &self,
        request: Request<reapi::UpdateActionResultRequest>,
    ) -> Result<Response<reapi::ActionResult>, Status> {
        Ok(Response::new(request.into_inner().action_result.unwrap_or_default()))
    }
}

type Unsupported<T> = futures::stream::Empty<Result<T, Status>>;

#[tonic::async_trait]
impl ContentAddressableStorage for Floor {
    async fn find_missing_blobs(
        &self,
        _: Request<reapi::FindMissingBlobsRequest>,
    ) -> Result<Response<reapi::FindMissingBlobsResponse>, Status> {
        Ok(Response::new(reapi::FindMissingBlobsResponse::default()))
    }

    async fn batch_update_blobs(
        &self,
        request: Request<reapi::BatchUpdateBlobsRequest>,
    ) -> Result<Response<reapi::BatchUpdateBlobsResponse>, Status> {
        let responses = request
            .into_inner()
            .requests
            .into_iter()
            .map(|r| reapi::batch_update_blobs_response::Response { digest: r.digest, status: None })
            .collect();
        Ok(Response::new(reapi::BatchUpdateBlobsResponse { responses }))
    }

    async fn batch_read_blobs(
        &self,
        _: Request<reapi::BatchReadBlobsRequest>,
    ) -> Result<Response<reapi::BatchReadBlobsResponse>, Status> {
        Err(Status::unimplemented("the floor server keeps no blobs"))
    }

    type GetTreeStream = Unsupported<reapi::GetTreeResponse>;

    async fn get_tree(&self, _: Request<reapi::GetTreeRequest>) -> Result<Response<Self::GetTreeStream>, Status> {
        Err(Status::unimplemented("the floor server keeps no trees"))
    }

    async fn split_blob(
        &self,
        _: Request<reapi::SplitBlobRequest>,
    ) -> Result<Response<reapi::SplitBlobResponse>, Status> {
        Err(Status::unimplemented("SplitBlob"))
    }

    type GetChunkMappingStream = Unsupported<reapi::GetChunkMappingResponse>;

    async fn get_chunk_mapping(
        &self,
        _: Request<reapi::GetChunkMappingRequest>,
    ) -> Result<Response<Self::GetChunkMappingStream>, Status> {
        Err(Status::unimplemented("GetChunkMapping"))
    }

    async fn splice_blob(
        &self,
        _: Request<reapi::SpliceBlobRequest>,
    ) -> Result<Response<reapi::SpliceBlobResponse>, Status> {
        Err(Status::unimplemented("SpliceBlob"))
    }

    async fn register_chunk_mapping(
        &self,
        _: Request<tonic::Streaming<reapi::RegisterChunkMappingRequest>>,
    ) -> Result<Response<reapi::RegisterChunkMappingResponse>, Status> {
        Err(Status::unimplemented("RegisterChunkMapping"))
    }
}

/// Serves until killed (`bench auth` kills it when done).
pub async fn serve(args: FloorServerArgs) -> anyhow::Result<()> {
    let mut server = tonic::transport::Server::builder().tcp_nodelay(true);
    if let (Some(cert), Some(key), true) = (&args.tls_cert, &args.tls_key, args.gantry_listener) {
        use futures::StreamExt;
        let files = gantry_services::tls::TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: None,
            client_certificates_optional: false,
        };
        let tls = gantry_services::tls::Tls::load(files)?;
        let listener = tokio::net::TcpListener::bind(args.listen).await.context("--listen")?;
        let (conns, _accept) = tls.incoming(listener);
        let incoming = tokio_stream::wrappers::ReceiverStream::new(conns).map(|(s, _)| Ok::<_, std::io::Error>(s));
        return server
            .add_service(ActionCacheServer::new(Floor))
            .add_service(ContentAddressableStorageServer::new(Floor))
            .serve_with_incoming(incoming)
            .await
            .context("the floor server");
    }
    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        // tonic's TLS takes the process default provider: ring, as gantry's own listeners.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let read = |p: &PathBuf| std::fs::read(p).with_context(|| p.display().to_string());
        let identity = tonic::transport::Identity::from_pem(read(cert)?, read(key)?);
        server = server.tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))?;
    }
    server
        .add_service(ActionCacheServer::new(Floor))
        .add_service(ContentAddressableStorageServer::new(Floor))
        .serve(args.listen)
        .await
        .context("the floor server")
}
