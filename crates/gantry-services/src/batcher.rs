//! `gantry.batch.v1.Batcher`: EnqueueTargets streams targets in and builds out.
//!
//! Each request stream gets its own task running a `StreamingPlanner`, so memory per
//! stream is bounded by the planner's sort window, and a bounded channel back to the
//! client applies backpressure: a slow reader slows the planner, not the server's heap.
//! The models are shared and can be swapped while streams run; a stream keeps the models
//! it started with.
//!
//! With build runners attached (`[batch] runners > 0`), every build cut is also recorded
//! and queued to run with Bazel; GetBuild, WatchBuilds, ListBuilds and TrainModels serve
//! the build service's state.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};

use gantry_batch::{
    Batch, BatchError, BatchSizeReason, BuildContext, Corrected, Models, PlannerConfig, StreamingPlanner,
};
use gantry_builds::{BuildDoc, BuildOutcome, BuildService, BuildState, RetryKind};
use gantry_core::task::{spawn_named, GuardedStream};
use gantry_proto::batch::v1 as pb;
use pb::batcher_server::Batcher;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Responses buffered per stream before the planner waits for the client.
const RESPONSE_BUFFER: usize = 64;

pub struct BatcherService {
    models: Arc<RwLock<Arc<Models>>>,
    config: PlannerConfig,
    /// Set once the runners start (they need the server's bound address).
    builds: OnceLock<Arc<BuildService>>,
    /// Builds are to be run: until `builds` is set, EnqueueTargets is UNAVAILABLE
    /// rather than silently plan-only.
    runs_builds: bool,
}

impl BatcherService {
    pub fn new(config: PlannerConfig, models: Models) -> Result<Self, BatchError> {
        config.validate()?;
        Ok(BatcherService {
            models: Arc::new(RwLock::new(Arc::new(models))),
            config,
            builds: OnceLock::new(),
            runs_builds: false,
        })
    }

    /// Declares that builds will be run once [`attach_builds`](Self::attach_builds) is called.
    pub fn expect_builds(mut self) -> Self {
        self.runs_builds = true;
        self
    }

    /// The models handle the build service retrains and swaps.
    pub fn models(&self) -> Arc<RwLock<Arc<Models>>> {
        self.models.clone()
    }

    pub fn planner_config(&self) -> &PlannerConfig {
        &self.config
    }

    pub fn attach_builds(&self, builds: Arc<BuildService>) {
        let _ = self.builds.set(builds);
    }

    fn builds(&self) -> Result<&Arc<BuildService>, Status> {
        self.builds.get().ok_or_else(|| {
            if self.runs_builds {
                Status::unavailable("the build runners are starting")
            } else {
                Status::failed_precondition("this server runs no builds ([batch] runners = 0)")
            }
        })
    }

    /// Replaces the models for streams that start from now on.
    pub fn swap_models(&self, models: Models) {
        *self.models.write().expect("poisoned") = Arc::new(models);
    }

    pub fn has_models(&self) -> bool {
        let m = self.models.read().expect("poisoned");
        m.memory.is_some() || m.occupancy.is_some()
    }
}

fn invalid(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg.into())
}

/// Converts the wire context, naming the offending field on error.
pub fn context_from_proto(c: pb::BuildContext) -> Result<BuildContext, Status> {
    let (workspace, git_repo, revision) = match c.execution.and_then(|e| e.source) {
        Some(pb::execution_context::Source::Workspace(w)) if !w.is_empty() => (Some(w), None, None),
        Some(pb::execution_context::Source::Workspace(_)) => {
            return Err(invalid("context.execution.workspace: empty path"));
        }
        Some(pb::execution_context::Source::Git(g)) => {
            if g.repository.is_empty() {
                return Err(invalid("context.execution.git.repository: required"));
            }
            if g.revision.is_empty() {
                return Err(invalid("context.execution.git.revision: required"));
            }
            (None, Some(g.repository), Some(g.revision))
        }
        None => return Err(invalid("context.execution: a workspace or a git repository and revision is required")),
    };
    let command = match pb::BazelCommand::try_from(c.command) {
        Ok(pb::BazelCommand::Build) => gantry_batch::Command::Build,
        Ok(pb::BazelCommand::Test) => gantry_batch::Command::Test,
        _ => return Err(invalid(format!("context.command: {} is not BUILD or TEST", c.command))),
    };
    let priority = match pb::Priority::try_from(c.priority) {
        Ok(pb::Priority::High) => gantry_batch::Priority::High,
        Ok(pb::Priority::Medium) => gantry_batch::Priority::Medium,
        Ok(pb::Priority::Low) => gantry_batch::Priority::Low,
        _ => return Err(invalid(format!("context.priority: {} is not HIGH, MEDIUM or LOW", c.priority))),
    };
    let ctx = BuildContext {
        workspace,
        git_repo,
        revision,
        command,
        flags: c.flags,
        priority,
        user: c.user,
        product_area: c.product_area,
        tool_tag: c.tool_tag,
    };
    ctx.validate().map_err(|e| invalid(format!("context: {e}")))?;
    Ok(ctx)
}

pub fn reason_to_proto(r: BatchSizeReason) -> pb::BatchSizeReason {
    match r {
        BatchSizeReason::OnlyOneTarget => pb::BatchSizeReason::OnlyOneTarget,
        BatchSizeReason::MaxTargets => pb::BatchSizeReason::MaxTargets,
        BatchSizeReason::AllRemainingTargets => pb::BatchSizeReason::AllRemainingTargets,
        BatchSizeReason::MaxMemory => pb::BatchSizeReason::MaxMemory,
        BatchSizeReason::MaxOccupancy => pb::BatchSizeReason::MaxOccupancy,
        BatchSizeReason::MemoryEstimateError => pb::BatchSizeReason::MemoryEstimateError,
        BatchSizeReason::OccupancyEstimateError => pb::BatchSizeReason::OccupancyEstimateError,
    }
}

fn build_to_proto(stream_id: &str, seq: u64, b: Batch) -> pb::EnqueueTargetsResponse {
    pb::EnqueueTargetsResponse {
        stream_id: stream_id.to_string(),
        build: Some(pb::Build {
            build_id: format!("{stream_id}-{seq}"),
            targets: b.targets,
            reason: reason_to_proto(b.reason) as i32,
            memory_estimate_bytes: b.memory_estimate_bytes,
            occupancy_estimate_esu: b.occupancy_estimate_esu,
            oom_probability: b.oom_probability,
            executor_types: b.executor_types.into_iter().collect(),
        }),
    }
}

fn target_from_proto(t: pb::Target) -> gantry_batch::Target {
    gantry_batch::Target { label: t.label, rule_kind: (!t.rule_kind.is_empty()).then_some(t.rule_kind), tags: t.tags }
}

type Tx = tokio::sync::mpsc::Sender<Result<pb::EnqueueTargetsResponse, Status>>;

/// Records and queues each build the planner cut, when builds are run.
struct Submitter {
    builds: Arc<BuildService>,
    ctx: BuildContext,
    stream_id: String,
    /// Targets pushed and not yet in a build: their tags decide a retry's executor types.
    pending: HashMap<String, gantry_batch::Target>,
    /// Reason notes read the build history: once per reason per stream is enough.
    notes: HashMap<BatchSizeReason, String>,
    /// When the stream's models were trained: the version its builds record.
    models_trained_at: Option<i64>,
}

impl Submitter {
    async fn submit(&mut self, seq: u64, b: &Batch) -> Result<(), Status> {
        let targets = b
            .targets
            .iter()
            .map(|l| {
                self.pending.remove(l).unwrap_or_else(|| gantry_batch::Target {
                    label: l.clone(),
                    rule_kind: None,
                    tags: vec![],
                })
            })
            .collect();
        let note = match self.notes.get(&b.reason) {
            Some(n) => n.clone(),
            None => {
                let n = self.builds.reason_note(b.reason).await.map_err(core_status)?;
                self.notes.insert(b.reason, n.clone());
                n
            }
        };
        let id = format!("{}-{seq}", self.stream_id);
        self.builds
            .submit(id, &self.stream_id, &self.ctx, targets, b, note, self.models_trained_at)
            .await
            .map_err(core_status)?;
        Ok(())
    }
}

impl Drop for Submitter {
    fn drop(&mut self) {
        self.builds.stream_finished(&self.stream_id);
    }
}

/// Runs one stream to its end. Returns Err(()) once the client has gone away.
#[allow(clippy::too_many_arguments)]
async fn run_stream(
    ctx: BuildContext,
    config: PlannerConfig,
    models: Arc<Models>,
    first_targets: Vec<pb::Target>,
    mut inbound: Streaming<pb::EnqueueTargetsRequest>,
    stream_id: String,
    tx: Tx,
    builds: Option<Arc<BuildService>>,
) -> Result<(), ()> {
    // The stream plans with the feedback of the builds run so far, as with its models.
    let feedback = builds.as_ref().map(|b| b.feedback()).unwrap_or_default();
    let mut submitter = builds.map(|builds| {
        builds.stream_started(&stream_id);
        Submitter {
            builds,
            ctx: ctx.clone(),
            stream_id: stream_id.clone(),
            pending: HashMap::new(),
            notes: HashMap::new(),
            // The stream plans with the models it started with, so its builds carry them.
            models_trained_at: models.manifest.trained_at.map(|t| t.0),
        }
    });
    let estimator = Corrected { inner: models.clone(), feedback };
    let mut planner = match StreamingPlanner::new(ctx, config, &estimator) {
        Ok(p) => p,
        Err(e) => return tx.send(Err(invalid(e.to_string()))).await.map_err(|_| ()),
    };
    let mut seq = 0u64;
    let mut request_no = 0usize;
    let mut targets = first_targets;
    loop {
        for (i, t) in targets.into_iter().enumerate() {
            let t = target_from_proto(t);
            if let Some(s) = &mut submitter {
                s.pending.insert(t.label.clone(), t.clone());
            }
            if let Err(e) = planner.push(t) {
                let msg = format!("request {request_no}, targets[{i}]: {e}");
                return tx.send(Err(invalid(msg))).await.map_err(|_| ());
            }
        }
        for b in planner.take_ready() {
            if let Some(s) = &mut submitter
                && let Err(status) = s.submit(seq, &b).await
            {
                return tx.send(Err(status)).await.map_err(|_| ());
            }
            tx.send(Ok(build_to_proto(&stream_id, seq, b))).await.map_err(|_| ())?;
            seq += 1;
        }
        request_no += 1;
        match inbound.message().await {
            Ok(Some(req)) => {
                if req.context.is_some() {
                    let msg = format!("request {request_no}: context may only be sent in the first request");
                    return tx.send(Err(invalid(msg))).await.map_err(|_| ());
                }
                targets = req.targets;
            }
            Ok(None) => break,
            Err(status) => return tx.send(Err(status)).await.map_err(|_| ()),
        }
    }
    for b in planner.finish() {
        if let Some(s) = &mut submitter
            && let Err(status) = s.submit(seq, &b).await
        {
            return tx.send(Err(status)).await.map_err(|_| ());
        }
        tx.send(Ok(build_to_proto(&stream_id, seq, b))).await.map_err(|_| ())?;
        seq += 1;
    }
    tracing::info!(stream_id, builds = seq, "EnqueueTargets stream finished");
    Ok(())
}

#[tonic::async_trait]
impl Batcher for BatcherService {
    type EnqueueTargetsStream = GuardedStream<ReceiverStream<Result<pb::EnqueueTargetsResponse, Status>>>;

    async fn enqueue_targets(
        &self,
        request: Request<Streaming<pb::EnqueueTargetsRequest>>,
    ) -> Result<Response<Self::EnqueueTargetsStream>, Status> {
        gantry_core::auth::require_somewhere(&request, gantry_core::auth::Permission::Batch)?;
        let mut inbound = request.into_inner();
        let first = inbound.message().await?.ok_or_else(|| invalid("empty EnqueueTargets stream"))?;
        let ctx = context_from_proto(
            first.context.ok_or_else(|| invalid("context: the first request must carry the build context"))?,
        )?;
        let builds = match self.builds() {
            Ok(b) => Some(b.clone()),
            Err(status) if self.runs_builds => return Err(status),
            Err(_) => None,
        };
        let stream_id = uuid::Uuid::new_v4().simple().to_string();
        let models = self.models.read().expect("poisoned").clone();
        let (tx, rx) = tokio::sync::mpsc::channel(RESPONSE_BUFFER);
        let config = self.config.clone();
        let sid = stream_id.clone();
        let guard = spawn_named("batcher-stream", async move {
            let _ = run_stream(ctx, config, models, first.targets, inbound, sid, tx, builds).await;
        });
        // The response stream owns the planner task: dropped together.
        Ok(Response::new(GuardedStream::new(ReceiverStream::new(rx), guard)))
    }

    async fn get_build(&self, request: Request<pb::GetBuildRequest>) -> Result<Response<pb::BuildStatus>, Status> {
        gantry_core::auth::require_somewhere(&request, gantry_core::auth::Permission::Batch)?;
        let id = request.into_inner().build_id;
        if id.is_empty() {
            return Err(invalid("build_id: required"));
        }
        let doc = self.builds()?.get(&id).await.map_err(core_status)?;
        Ok(Response::new(status_to_proto(&doc)))
    }

    type WatchBuildsStream = GuardedStream<ReceiverStream<Result<pb::BuildStatus, Status>>>;

    async fn watch_builds(
        &self,
        request: Request<pb::WatchBuildsRequest>,
    ) -> Result<Response<Self::WatchBuildsStream>, Status> {
        gantry_core::auth::require_somewhere(&request, gantry_core::auth::Permission::Batch)?;
        let stream_id = request.into_inner().stream_id;
        if stream_id.is_empty() {
            return Err(invalid("stream_id: required"));
        }
        let builds = self.builds()?.clone();
        let mut changes = builds.changes();
        // An unknown stream is an error now, not an empty stream later.
        builds.stream_complete(&stream_id).await.map_err(core_status)?;
        let (tx, rx) = tokio::sync::mpsc::channel(RESPONSE_BUFFER);
        let guard = spawn_named("batcher-watch", async move {
            let mut sent: HashMap<String, String> = HashMap::new();
            loop {
                changes.borrow_and_update();
                if builds.is_shutting_down() {
                    // A watch would otherwise hold the server's drain until its builds end.
                    let _ =
                        tx.send(Err(Status::unavailable("gantry is shutting down: watch again once it is back"))).await;
                    return;
                }
                let (done, docs) = match builds.stream_complete(&stream_id).await {
                    Ok(v) => v,
                    Err(e) => {
                        let _ = tx.send(Err(core_status(e))).await;
                        return;
                    }
                };
                for d in &docs {
                    // Send a build again only when something a client sees has changed.
                    let key = format!("{:?}/{:?}/{}/{}", d.state, d.outcome, d.retries.len(), d.attempts);
                    if sent.get(&d.id) != Some(&key) {
                        if tx.send(Ok(status_to_proto(d))).await.is_err() {
                            return;
                        }
                        sent.insert(d.id.clone(), key);
                    }
                }
                if done || changes.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(GuardedStream::new(ReceiverStream::new(rx), guard)))
    }

    async fn list_builds(
        &self,
        request: Request<pb::ListBuildsRequest>,
    ) -> Result<Response<pb::ListBuildsResponse>, Status> {
        gantry_core::auth::require_somewhere(&request, gantry_core::auth::Permission::Batch)?;
        let r = request.into_inner();
        let limit = match r.limit {
            0 => 100,
            n if n > 10_000 => return Err(invalid(format!("limit: {n} is above the maximum of 10000"))),
            n => n as usize,
        };
        let query = gantry_core::BuildQuery {
            oldest_first: !r.stream_id.is_empty(),
            stream_id: (!r.stream_id.is_empty()).then_some(r.stream_id),
            limit,
            ..Default::default()
        };
        let docs = self.builds()?.list(&query).await.map_err(core_status)?;
        Ok(Response::new(pb::ListBuildsResponse { builds: docs.iter().map(status_to_proto).collect() }))
    }

    async fn train_models(
        &self,
        request: Request<pb::TrainModelsRequest>,
    ) -> Result<Response<pb::TrainModelsResponse>, Status> {
        gantry_core::auth::require_somewhere(&request, gantry_core::auth::Permission::Admin)?;
        let s = self.builds()?.train_now().await.map_err(core_status)?;
        Ok(Response::new(pb::TrainModelsResponse {
            builds: s.builds as u64,
            oom_builds: s.oom_builds as u64,
            memory_model: s.memory_model,
            occupancy_model: s.occupancy_model,
            seconds: s.seconds,
        }))
    }
}

fn core_status(e: gantry_builds::BuildsError) -> Status {
    Status::from(gantry_core::Error::from(e))
}

/// The wire form of a build's status.
pub fn status_to_proto(d: &BuildDoc) -> pb::BuildStatus {
    pb::BuildStatus {
        build_id: d.id.clone(),
        stream_id: d.stream_id.clone(),
        parent_build_id: d.parent_id.clone().unwrap_or_default(),
        retry_kind: match d.retry_kind {
            None => pb::RetryKind::Unspecified,
            Some(RetryKind::OomSplit) => pb::RetryKind::OomSplit,
            Some(RetryKind::DeadlineRerun) => pb::RetryKind::DeadlineRerun,
        } as i32,
        state: match d.state {
            BuildState::Queued => pb::BuildState::Queued,
            BuildState::Running => pb::BuildState::Running,
            BuildState::Done => pb::BuildState::Done,
        } as i32,
        outcome: match d.outcome {
            None => pb::BuildOutcome::Unspecified,
            Some(BuildOutcome::Success) => pb::BuildOutcome::Success,
            Some(BuildOutcome::BuildFailed) => pb::BuildOutcome::BuildFailed,
            Some(BuildOutcome::TestsFailed) => pb::BuildOutcome::TestsFailed,
            Some(BuildOutcome::Oom) => pb::BuildOutcome::Oom,
            Some(BuildOutcome::DeadlineExceeded) => pb::BuildOutcome::DeadlineExceeded,
            Some(BuildOutcome::InfraError) => pb::BuildOutcome::InfraError,
        } as i32,
        targets: d.labels(),
        reason: reason_to_proto(d.reason) as i32,
        reason_note: d.reason_note.clone(),
        memory_estimate_bytes: d.memory_estimate_bytes,
        occupancy_estimate_esu: d.occupancy_estimate_esu,
        oom_probability: d.oom_probability,
        executor_types: d.executor_types.clone(),
        used_heap_post_build_bytes: d.used_heap_post_build,
        peak_post_gc_heap_bytes: d.peak_post_gc_heap,
        server_vm_hwm_bytes: d.server_vm_hwm,
        occupancy_esu: d.occupancy_esu,
        actions_executed: d.actions_executed,
        wall_seconds: d.wall_seconds,
        exit_code: d.exit_code,
        message: d.message.clone(),
        invocation_id: d.invocation_id.clone().unwrap_or_default(),
        retry_build_ids: d.retries.clone(),
        created_unix_ms: d.created_unix_ms,
        started_unix_ms: d.started_unix_ms,
        finished_unix_ms: d.finished_unix_ms,
        oom_signal: d.oom_signal.map_or("", |s| s.as_str()).to_string(),
    }
}
