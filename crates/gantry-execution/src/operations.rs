//! The REAPI Execution service (Execute, WaitExecution) and the google.longrunning
//! Operations service (Get, List, Cancel, Delete, Wait) over the scheduler.

use gantry_core::auth::{caller, require, require_somewhere, Caller, Permission};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gantry_core::google::longrunning::operations_server::Operations;
use gantry_core::google::longrunning::{
    self as lr, CancelOperationRequest, DeleteOperationRequest, GetOperationRequest, ListOperationsRequest,
    ListOperationsResponse, Operation, WaitOperationRequest,
};
use gantry_core::google::protobuf::{Any, Empty};
use gantry_core::reapi::execution_server::Execution;
use gantry_core::reapi::{self, execution_stage, ExecuteOperationMetadata, ExecuteResponse};
use gantry_core::{ActionCache, BlobStore, Digest, DigestFunction, Error, Result};
use prost::Message;
use tonic::{Request, Response, Status};

use crate::scheduler::{JobSpec, OpState, Requester, Scheduler, Stage};

pub struct ExecutionService {
    scheduler: Arc<Scheduler>,
    cas: Arc<dyn BlobStore>,
    ac: Arc<dyn ActionCache>,
    max_proto_size: u64,
}

/// Refuses, before any read, a client-named message blob larger than `max`: the size is
/// the client's claim, and the server would otherwise buffer the whole blob to decode it.
pub fn check_proto_size(d: &Digest, what: &str, max: u64) -> Result<()> {
    if d.size > max {
        return Err(Error::invalid(format!(
            "{what} {d} is {} bytes, over the {max}-byte limit on Action, Command and Directory blobs (server.max_proto_size)",
            d.size
        )));
    }
    Ok(())
}

fn any<M: Message>(type_name: &str, m: &M) -> Any {
    Any { type_url: format!("type.googleapis.com/{type_name}"), value: m.encode_to_vec() }
}

/// The longrunning form of an operation's state.
pub fn to_operation(s: &OpState) -> Operation {
    let stage = match s.stage {
        Stage::Queued => execution_stage::Value::Queued,
        Stage::Executing => execution_stage::Value::Executing,
        Stage::Completed => execution_stage::Value::Completed,
    };
    let metadata = ExecuteOperationMetadata {
        stage: stage as i32,
        action_digest: Some(s.action_digest.to_proto()),
        ..Default::default()
    };
    Operation {
        name: s.name.to_string(),
        metadata: Some(any("build.bazel.remote.execution.v2.ExecuteOperationMetadata", &metadata)),
        done: s.stage == Stage::Completed,
        result: s
            .response
            .as_ref()
            .map(|r| lr::operation::Result::Response(any("build.bazel.remote.execution.v2.ExecuteResponse", &**r))),
    }
}

type OpStream = futures::stream::BoxStream<'static, Result<Operation, Status>>;

/// How long a stream holds back its first message while the operation may still finish.
/// Most actions of a build take less, and then the stream carries one message, the result,
/// instead of QUEUED, EXECUTING and COMPLETED: each message is a write and a wake-up on both
/// ends. A client learns the operation's name this much later, which costs it nothing: a
/// client that reconnects before then sends Execute again and joins the same operation.
const FIRST_UPDATE_GRACE: Duration = Duration::from_millis(100);

/// Streams every state change until the operation completes, the first after at most
/// `FIRST_UPDATE_GRACE`. If the scheduler shuts down first, the stream ends with
/// UNAVAILABLE: Bazel then retries WaitExecution, and Execute again if the restarted
/// scheduler no longer knows the operation.
fn op_stream(
    rx: crate::op_watch::Receiver<OpState>,
    stopped: impl std::future::Future<Output = ()> + Send + 'static,
) -> OpStream {
    let stopped = futures::FutureExt::shared(futures::FutureExt::boxed(stopped));
    futures::stream::unfold((rx, false, false), move |(mut rx, first_sent, done)| {
        let stopped = stopped.clone();
        async move {
            if done {
                return None;
            }
            if !first_sent {
                tokio::select! {
                    // Done, dropped by the scheduler, or still running at the deadline: in
                    // every case the state as it is now goes out.
                    _ = tokio::time::timeout(FIRST_UPDATE_GRACE, rx.wait_for(|s| s.stage == Stage::Completed)) => {}
                    _ = stopped.clone() => {}
                }
            } else {
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() {
                        // The scheduler dropped the operation (deleted): end the stream.
                        return None;
                    },
                    _ = stopped => {
                        let e = Status::unavailable("the scheduler is shutting down; retry WaitExecution or Execute");
                        return Some((Err(e), (rx, true, true)));
                    }
                }
            }
            let (op, done) = {
                let s = rx.borrow_and_update();
                (to_operation(&s), s.stage == Stage::Completed)
            };
            Some((Ok(op), (rx, true, done)))
        }
    })
    .boxed()
}

fn requester<T>(req: &Request<T>) -> Requester {
    match gantry_core::request_metadata::request_metadata(req) {
        Some(m) => Requester {
            tool_invocation_id: m.tool_invocation_id,
            action_mnemonic: m.action_mnemonic,
            target_id: m.target_id,
            configuration_id: m.configuration_id,
        },
        None => Requester::default(),
    }
}

impl ExecutionService {
    pub fn new(scheduler: Arc<Scheduler>, cas: Arc<dyn BlobStore>, ac: Arc<dyn ActionCache>) -> Self {
        ExecutionService { scheduler, cas, ac, max_proto_size: 4 << 20 }
    }

    /// The largest Action or Command this service reads for a client (`[server] max_proto_size`).
    pub fn with_max_proto_size(mut self, bytes: u64) -> Self {
        self.max_proto_size = bytes;
        self
    }

    async fn fetch<M: Message + Default>(&self, d: &Digest, what: &str) -> Result<M> {
        check_proto_size(d, what, self.max_proto_size)?;
        let bytes = self.cas.get(d).await.map_err(|e| {
            if e.is_not_found() {
                // REAPI: a missing input is FAILED_PRECONDITION, so the client re-uploads.
                Error::MissingBlobs { what: what.to_string(), digests: vec![*d] }
            } else {
                e
            }
        })?;
        M::decode(bytes).map_err(|e| Error::invalid(format!("{what} {d} does not decode: {e}")))
    }
}

#[tonic::async_trait]
impl Execution for ExecutionService {
    type ExecuteStream = OpStream;

    async fn execute(&self, request: Request<reapi::ExecuteRequest>) -> Result<Response<OpStream>, Status> {
        self.execute_inner(request).await.map_err(|e| match e {
            ExecError::Status(s) => s,
            // The Status keeps the error's details (MISSING violations for missing inputs).
            ExecError::Gantry(e) => e.into(),
        })
    }

    type WaitExecutionStream = OpStream;

    async fn wait_execution(
        &self,
        request: Request<reapi::WaitExecutionRequest>,
    ) -> Result<Response<OpStream>, Status> {
        require_somewhere(&request, Permission::Execute)?;
        let name = request.into_inner().name;
        let rx = self
            .scheduler
            .watch(&name)
            .ok_or_else(|| Status::not_found(format!("no operation {}", crate::scheduler::shown_name(&name))))?;
        Ok(Response::new(op_stream(rx, self.scheduler.stopped())))
    }
}

enum ExecError {
    Status(Status),
    Gantry(Error),
}

impl From<Error> for ExecError {
    fn from(e: Error) -> Self {
        ExecError::Gantry(e)
    }
}

impl From<Status> for ExecError {
    fn from(s: Status) -> Self {
        ExecError::Status(s)
    }
}

impl ExecutionService {
    async fn execute_inner(&self, request: Request<reapi::ExecuteRequest>) -> Result<Response<OpStream>, ExecError> {
        require(&request, Permission::Execute, &request.get_ref().instance_name)?;
        let who = requester(&request);
        let owner = match caller(&request) {
            Caller::Identity(id) => Some(id.name.clone()),
            Caller::Unrestricted => None,
        };
        let req = request.into_inner();
        let f = DigestFunction::from_proto(req.digest_function)?;
        let digest = Digest::from_proto(f, req.action_digest.as_ref(), "action_digest")?;
        if !req.skip_cache_lookup
            && let Some(result) = self.ac.get(&req.instance_name, &digest).await?
        {
            let state = OpState {
                name: format!("operations/cached-{}", uuid::Uuid::new_v4()).into(),
                stage: Stage::Completed,
                action_digest: digest,
                response: Some(Box::new(ExecuteResponse {
                    result: Some(result),
                    cached_result: true,
                    status: Some(Default::default()),
                    ..Default::default()
                })),
            };
            return Ok(Response::new(futures::stream::once(async move { Ok(to_operation(&state)) }).boxed()));
        }
        let action: reapi::Action = self.fetch(&digest, "action").await?;
        let cmd_digest = Digest::from_proto(f, action.command_digest.as_ref(), "action.command_digest")?;
        Digest::from_proto(f, action.input_root_digest.as_ref(), "action.input_root_digest")?;
        let command: reapi::Command = self.fetch(&cmd_digest, "command").await?;
        if command.arguments.is_empty() {
            return Err(Error::invalid("command.arguments: empty").into());
        }
        let priority = req.execution_policy.as_ref().map_or(0, |p| p.priority);
        let (_, rx) = self
            .scheduler
            .submit(JobSpec {
                instance: req.instance_name,
                action_digest: digest,
                action: action.into(),
                command: command.into(),
                priority,
                requester: who,
                owner,
            })
            .await?;
        Ok(Response::new(op_stream(rx, self.scheduler.stopped())))
    }
}

/// Whose operations a call may list, cancel or delete: everyone's (None) for an
/// administrator or a server without `[auth]`, else the caller's own, which needs
/// `execute` somewhere.
fn scope<T>(req: &Request<T>) -> Result<Option<String>, Status> {
    match caller(req) {
        Caller::Unrestricted => Ok(None),
        Caller::Identity(_) if require_somewhere(req, Permission::Admin).is_ok() => Ok(None),
        Caller::Identity(id) => {
            require_somewhere(req, Permission::Execute)?;
            Ok(Some(id.name.clone()))
        }
    }
}

pub struct OperationsService {
    scheduler: Arc<Scheduler>,
}

impl OperationsService {
    pub fn new(scheduler: Arc<Scheduler>) -> Self {
        OperationsService { scheduler }
    }
}

#[tonic::async_trait]
impl Operations for OperationsService {
    async fn list_operations(
        &self,
        request: Request<ListOperationsRequest>,
    ) -> Result<Response<ListOperationsResponse>, Status> {
        let by = scope(&request)?;
        let req = request.into_inner();
        let all = self.scheduler.list(by.as_deref());
        let start: usize = if req.page_token.is_empty() {
            0
        } else {
            req.page_token
                .parse()
                .map_err(|_| Status::invalid_argument(format!("page_token '{}' is not valid", req.page_token)))?
        };
        let size = if req.page_size <= 0 { 1000 } else { req.page_size as usize };
        let page: Vec<Operation> = all.iter().skip(start).take(size).map(to_operation).collect();
        let next = if start + page.len() < all.len() { (start + page.len()).to_string() } else { String::new() };
        Ok(Response::new(ListOperationsResponse { operations: page, next_page_token: next, unreachable: vec![] }))
    }

    async fn get_operation(&self, request: Request<GetOperationRequest>) -> Result<Response<Operation>, Status> {
        require_somewhere(&request, Permission::Execute)?;
        let name = request.into_inner().name;
        let rx = self
            .scheduler
            .watch(&name)
            .ok_or_else(|| Status::not_found(format!("no operation {}", crate::scheduler::shown_name(&name))))?;
        let s = rx.borrow().clone();
        Ok(Response::new(to_operation(&s)))
    }

    async fn delete_operation(&self, request: Request<DeleteOperationRequest>) -> Result<Response<Empty>, Status> {
        let by = scope(&request)?;
        self.scheduler.delete(&request.into_inner().name, by.as_deref())?;
        Ok(Response::new(Empty {}))
    }

    async fn cancel_operation(&self, request: Request<CancelOperationRequest>) -> Result<Response<Empty>, Status> {
        let by = scope(&request)?;
        self.scheduler.cancel(&request.into_inner().name, by.as_deref())?;
        Ok(Response::new(Empty {}))
    }

    async fn wait_operation(&self, request: Request<WaitOperationRequest>) -> Result<Response<Operation>, Status> {
        require_somewhere(&request, Permission::Execute)?;
        let req = request.into_inner();
        let mut rx = self
            .scheduler
            .watch(&req.name)
            .ok_or_else(|| Status::not_found(format!("no operation {}", crate::scheduler::shown_name(&req.name))))?;
        let timeout = req
            .timeout
            .map(|d| Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32))
            .filter(|d| !d.is_zero())
            .unwrap_or(Duration::from_secs(60));
        let s = match tokio::time::timeout(timeout, rx.wait_for(|s| s.stage == Stage::Completed)).await {
            Ok(Ok(done)) => done,
            // Not done in time (or dropped meanwhile): its state as it is.
            _ => rx.borrow().clone(),
        };
        Ok(Response::new(to_operation(&s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_core::DigestFunction;
    use tokio::time::{sleep, Instant};

    fn state(stage: Stage) -> OpState {
        OpState { name: "operations/t".into(), stage, action_digest: DigestFunction::Sha256.empty(), response: None }
    }

    /// Sends `changes` (delay, stage) in order on a fresh operation and returns the stages
    /// its stream carried, each with when it came.
    async fn stream_of(changes: Vec<(u64, Stage)>) -> Vec<(Duration, i32)> {
        let (tx, rx) = crate::op_watch::channel(state(Stage::Queued));
        let start = Instant::now();
        let mut stream = op_stream(rx, futures::future::pending());
        let sender = tokio::spawn(async move {
            for (ms, stage) in changes {
                sleep(Duration::from_millis(ms)).await;
                tx.send_modify(|s| s.stage = stage);
            }
        });
        let mut seen = Vec::new();
        while let Some(op) = stream.next().await {
            let md = ExecuteOperationMetadata::decode(op.unwrap().metadata.unwrap().value.as_slice()).unwrap();
            seen.push((start.elapsed(), md.stage));
        }
        sender.await.unwrap();
        seen
    }

    #[tokio::test(start_paused = true)]
    async fn a_quick_operation_streams_only_its_result() {
        let seen = stream_of(vec![(20, Stage::Executing), (20, Stage::Completed)]).await;
        assert_eq!(seen, vec![(Duration::from_millis(40), execution_stage::Value::Completed as i32)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_operation_streams_its_state_after_the_grace_then_every_change() {
        let seen = stream_of(vec![(20, Stage::Executing), (980, Stage::Completed)]).await;
        assert_eq!(
            seen,
            vec![
                (FIRST_UPDATE_GRACE, execution_stage::Value::Executing as i32),
                (Duration::from_secs(1), execution_stage::Value::Completed as i32)
            ]
        );
    }
}
