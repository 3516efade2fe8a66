//! `gantry.batch.v1.Batcher`: EnqueueTargets streams targets in and builds out.
//!
//! Each request stream gets its own task running a `StreamingPlanner`, so memory per
//! stream is bounded by the planner's sort window, and a bounded channel back to the
//! client applies backpressure: a slow reader slows the planner, not the server's heap.
//! The models are shared and can be swapped while streams run; a stream keeps the models
//! it started with.

use std::sync::{Arc, RwLock};

use gantry_batch::{Batch, BatchError, BatchSizeReason, BuildContext, Models, PlannerConfig, StreamingPlanner};
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
}

impl BatcherService {
    pub fn new(config: PlannerConfig, models: Models) -> Result<Self, BatchError> {
        config.validate()?;
        Ok(BatcherService { models: Arc::new(RwLock::new(Arc::new(models))), config })
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

/// The planner settings from `[batch]` in gantry.toml.
pub fn planner_config(cfg: &gantry_config::BatchConfig) -> PlannerConfig {
    let mut p = PlannerConfig {
        max_targets_per_batch: cfg.max_targets_per_batch,
        fallback_batch_size: cfg.fallback_batch_size,
        bazel_memory_bytes: cfg.bazel_memory.as_u64(),
        memory_cutoff_bytes: gantry_batch::MemoryCutoffs {
            high: cfg.memory_cutoff_high.as_u64(),
            medium: cfg.memory_cutoff_medium.as_u64(),
            low: cfg.memory_cutoff_low.as_u64(),
        },
        occupancy_cutoff_esu: cfg.occupancy_cutoff_esu,
        occupancy_limit_esu: cfg.occupancy_limit_esu,
        stream_sort_window: cfg.stream_sort_window,
        ..PlannerConfig::default()
    };
    p.executors.tag_types.extend(cfg.tag_executor_types.clone());
    p.executors.rule_kind_types.extend(cfg.rule_kind_executor_types.clone());
    p
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
            executor_types: b.executor_types.into_iter().collect(),
        }),
    }
}

fn target_from_proto(t: pb::Target) -> gantry_batch::Target {
    gantry_batch::Target {
        label: t.label,
        rule_kind: (!t.rule_kind.is_empty()).then_some(t.rule_kind),
        tags: t.tags,
    }
}

type Tx = tokio::sync::mpsc::Sender<Result<pb::EnqueueTargetsResponse, Status>>;

/// Runs one stream to its end. Returns Err(()) once the client has gone away.
async fn run_stream(
    ctx: BuildContext,
    config: PlannerConfig,
    models: Arc<Models>,
    first_targets: Vec<pb::Target>,
    mut inbound: Streaming<pb::EnqueueTargetsRequest>,
    stream_id: String,
    tx: Tx,
) -> Result<(), ()> {
    let mut planner = match StreamingPlanner::new(ctx, config, &*models) {
        Ok(p) => p,
        Err(e) => return tx.send(Err(invalid(e.to_string()))).await.map_err(|_| ()),
    };
    let mut seq = 0u64;
    let mut request_no = 0usize;
    let mut targets = first_targets;
    loop {
        for (i, t) in targets.into_iter().enumerate() {
            if let Err(e) = planner.push(target_from_proto(t)) {
                let msg = format!("request {request_no}, targets[{i}]: {e}");
                return tx.send(Err(invalid(msg))).await.map_err(|_| ());
            }
        }
        for b in planner.take_ready() {
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
        let mut inbound = request.into_inner();
        let first = inbound.message().await?.ok_or_else(|| invalid("empty EnqueueTargets stream"))?;
        let ctx = context_from_proto(
            first.context.ok_or_else(|| invalid("context: the first request must carry the build context"))?,
        )?;
        let stream_id = uuid::Uuid::new_v4().simple().to_string();
        let models = self.models.read().expect("poisoned").clone();
        let (tx, rx) = tokio::sync::mpsc::channel(RESPONSE_BUFFER);
        let config = self.config.clone();
        let sid = stream_id.clone();
        let guard = spawn_named("batcher-stream", async move {
            let _ = run_stream(ctx, config, models, first.targets, inbound, sid, tx).await;
        });
        // The response stream owns the planner task: dropped together.
        Ok(Response::new(GuardedStream::new(ReceiverStream::new(rx), guard)))
    }
}
