//! A frontend's Execution and Operations services (`[execution] scheduler = "grpc://…"`):
//! every call, streams included, is forwarded to the one scheduler, with the caller's
//! request metadata (Bazel's tool invocation id, action mnemonic) and deadline.
//!
//! The frontend keeps no operation state of its own, so any frontend can serve a
//! WaitExecution for an operation that another frontend started. When the scheduler
//! cannot be reached, or its stream breaks (it crashed), the caller gets UNAVAILABLE,
//! which Bazel retries: WaitExecution on the same operation, then Execute again if the
//! restarted scheduler answers NOT_FOUND.

use futures::StreamExt;
use gantry_core::client::GrpcChannel as Channel;
use gantry_core::google::longrunning::operations_client::OperationsClient;
use gantry_core::google::longrunning::operations_server::Operations;
use gantry_core::google::longrunning::{
    CancelOperationRequest, DeleteOperationRequest, GetOperationRequest, ListOperationsRequest, ListOperationsResponse,
    Operation, WaitOperationRequest,
};
use gantry_core::google::protobuf::Empty;
use gantry_core::reapi::execution_client::ExecutionClient;
use gantry_core::reapi::execution_server::Execution;
use gantry_core::reapi::{ExecuteRequest, WaitExecutionRequest};
use tonic::{Code, Request, Response, Status};

type OpStream = futures::stream::BoxStream<'static, Result<Operation, Status>>;

/// Forwards Execution and Operations calls to a scheduler.
#[derive(Clone)]
pub struct Forwarder {
    channel: Channel,
    /// Set at shutdown: forwarded streams end with UNAVAILABLE so the server can drain.
    stopping: std::sync::Arc<tokio::sync::watch::Sender<bool>>,
    /// The scheduler's address, for messages.
    target: String,
    max_message: usize,
}

impl Forwarder {
    pub fn new(channel: Channel, target: impl Into<String>, max_message: usize) -> Self {
        Forwarder {
            channel,
            stopping: std::sync::Arc::new(tokio::sync::watch::channel(false).0),
            target: target.into(),
            max_message,
        }
    }

    /// Ends every forwarded stream with UNAVAILABLE; the clients retry elsewhere or later.
    pub fn shutdown(&self) {
        self.stopping.send_replace(true);
    }

    fn execution(&self) -> ExecutionClient<Channel> {
        ExecutionClient::new(self.channel.clone())
            .max_decoding_message_size(self.max_message)
            .max_encoding_message_size(self.max_message)
    }

    fn operations(&self) -> OperationsClient<Channel> {
        OperationsClient::new(self.channel.clone())
            .max_decoding_message_size(self.max_message)
            .max_encoding_message_size(self.max_message)
    }

    /// A status from the scheduler, or about reaching it, as the client should see it.
    /// The scheduler answers with precise codes of its own; anything else (a refused
    /// connection, a stream cut by a crash) is UNAVAILABLE, so the client retries.
    fn upstream(&self, s: Status) -> Status {
        let transport = matches!(s.code(), Code::Unknown | Code::Internal | Code::Unavailable | Code::Cancelled)
            && std::error::Error::source(&s).is_some();
        if transport || s.code() == Code::Unknown {
            Status::unavailable(format!("scheduler {} unreachable: {}", self.target, s.message()))
        } else {
            s
        }
    }

    fn stream(&self, upstream: tonic::Streaming<Operation>) -> OpStream {
        let this = self.clone();
        let mut rx = self.stopping.subscribe();
        let stopped = futures::FutureExt::shared(futures::FutureExt::boxed(async move {
            let _ = rx.wait_for(|s| *s).await;
        }));
        futures::stream::unfold(Some(upstream), move |state| {
            let (this, stopped) = (this.clone(), stopped.clone());
            async move {
                let mut up = state?;
                tokio::select! {
                    item = up.next() => item.map(|r| (r.map_err(|s| this.upstream(s)), Some(up))),
                    _ = stopped => Some((Err(Status::unavailable("this frontend is shutting down; retry")), None)),
                }
            }
        })
        .boxed()
    }
}

/// The same request for the scheduler: message, metadata (tonic drops the transport's
/// own headers when it sends) and deadline.
fn forward<T>(req: Request<T>) -> Request<T> {
    let (metadata, _extensions, message) = req.into_parts();
    let mut out = Request::new(message);
    *out.metadata_mut() = metadata;
    out
}

#[tonic::async_trait]
impl Execution for Forwarder {
    type ExecuteStream = OpStream;

    async fn execute(&self, request: Request<ExecuteRequest>) -> Result<Response<OpStream>, Status> {
        let upstream = self.execution().execute(forward(request)).await.map_err(|s| self.upstream(s))?;
        Ok(Response::new(self.stream(upstream.into_inner())))
    }

    type WaitExecutionStream = OpStream;

    async fn wait_execution(&self, request: Request<WaitExecutionRequest>) -> Result<Response<OpStream>, Status> {
        let upstream = self.execution().wait_execution(forward(request)).await.map_err(|s| self.upstream(s))?;
        Ok(Response::new(self.stream(upstream.into_inner())))
    }
}

#[tonic::async_trait]
impl Operations for Forwarder {
    async fn list_operations(
        &self,
        request: Request<ListOperationsRequest>,
    ) -> Result<Response<ListOperationsResponse>, Status> {
        self.operations().list_operations(forward(request)).await.map_err(|s| self.upstream(s))
    }

    async fn get_operation(&self, request: Request<GetOperationRequest>) -> Result<Response<Operation>, Status> {
        self.operations().get_operation(forward(request)).await.map_err(|s| self.upstream(s))
    }

    async fn delete_operation(&self, request: Request<DeleteOperationRequest>) -> Result<Response<Empty>, Status> {
        self.operations().delete_operation(forward(request)).await.map_err(|s| self.upstream(s))
    }

    async fn cancel_operation(&self, request: Request<CancelOperationRequest>) -> Result<Response<Empty>, Status> {
        self.operations().cancel_operation(forward(request)).await.map_err(|s| self.upstream(s))
    }

    async fn wait_operation(&self, request: Request<WaitOperationRequest>) -> Result<Response<Operation>, Status> {
        self.operations().wait_operation(forward(request)).await.map_err(|s| self.upstream(s))
    }
}
