//! The execution log: one record per executed action with what it cost (peak memory,
//! CPU, wall and queue time) and who asked for it (Bazel's tool_invocation_id and
//! action_mnemonic). The batching service's occupancy model and the size-class learner
//! are trained from it, so it is a storage trait like the caches, with backends elsewhere.

use async_trait::async_trait;

use crate::Result;

#[derive(Debug, Clone, PartialEq, Default)]
pub struct ActionRecord {
    pub operation: String,
    pub instance: String,
    /// `{hash}/{size}` of the action.
    pub action_digest: String,
    pub tool_invocation_id: String,
    pub action_mnemonic: String,
    pub target_id: String,
    pub worker: String,
    pub size_class: u32,
    pub exit_code: i32,
    /// gRPC status code of the execution (0 for a completed run, whatever its exit code).
    pub status_code: i32,
    pub peak_memory_bytes: u64,
    pub user_cpu_seconds: f64,
    pub system_cpu_seconds: f64,
    pub wall_seconds: f64,
    pub queued_seconds: f64,
    /// How memory was measured: "cgroup-v2", "cgroup-v1" or "rusage".
    pub metering: String,
    pub completed_unix_ms: i64,
    /// The size-class learner's key for the action's shape; empty when it was not learned.
    pub shape_key: String,
}

impl ActionRecord {
    /// Executor service time: the wall time the action held a worker slot.
    pub fn service_seconds(&self) -> f64 {
        self.wall_seconds
    }

    /// Executor service time in ESU·s: an action on a size-class-S worker occupies S
    /// executor standard units, or its peak memory in units of [`ESU_MEMORY_BYTES`] when
    /// that is larger (a small-class action that used a lot of memory still crowded its
    /// machine).
    pub fn esu_seconds(&self) -> f64 {
        let by_memory = self.peak_memory_bytes as f64 / ESU_MEMORY_BYTES as f64;
        self.service_seconds() * (self.size_class.max(1) as f64).max(by_memory)
    }
}

/// Memory of one executor standard unit (ESU): 2.5 GB.
pub const ESU_MEMORY_BYTES: u64 = 2_500_000_000;

/// Totals of one Bazel invocation.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct InvocationSummary {
    pub tool_invocation_id: String,
    pub actions: u64,
    pub executor_service_seconds: f64,
    /// Executor service time weighted by the ESU each action occupied.
    pub executor_esu_seconds: f64,
    pub cpu_seconds: f64,
    pub max_peak_memory_bytes: u64,
    pub failed_actions: u64,
}

/// Whose runs [`ExecutionLog::runs`] lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunsOf<'a> {
    /// One action, by `{hash}/{size}`.
    Action(&'a str),
    /// Every action with this size-class shape key.
    Shape(&'a str),
}

/// In which order [`ExecutionLog::actions_page`] lists an invocation's actions. Every
/// order ends in the completion time and then the operation name, so pages are stable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActionOrder {
    /// Dearest first, by [`ActionRecord::esu_seconds`].
    Dearest,
    /// Exactly the reverse of [`ActionOrder::Dearest`]: the end of its list, read from that
    /// end, so a page far down it costs no more than one near its top.
    Cheapest,
    /// Longest run first, by wall time.
    Longest,
    /// Only the actions completed at or before this Unix time in ms, the latest first,
    /// and of those completed at once the one queued earliest (the longest queue plus run).
    FinishedBy(i64),
}

/// Runs of one size class in one instance that completed in one time bucket, as counted
/// by [`ExecutionLog::class_runs`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClassRuns {
    /// The bucket's start, a multiple of the bucket length in Unix ms.
    pub bucket_unix_ms: i64,
    pub instance: String,
    pub size_class: u32,
    pub runs: u64,
    /// Runs that failed (a status or exit code other than 0): those the scheduler retried
    /// on a larger class when it could.
    pub failed: u64,
}

#[async_trait]
pub trait ExecutionLog: Send + Sync + 'static {
    async fn record(&self, record: &ActionRecord) -> Result<()>;
    /// Every action recorded for the invocation, oldest first.
    async fn actions(&self, tool_invocation_id: &str) -> Result<Vec<ActionRecord>>;
    /// Runs newest first, at most `limit`: of one action (its retries, hedge copies and the
    /// runs of earlier invocations), or of every action of one shape.
    async fn runs(&self, of: RunsOf<'_>, limit: usize) -> Result<Vec<ActionRecord>>;
    /// Runs per time bucket (`bucket_ms` long), instance and size class, of every action
    /// completed at or after `since_unix_ms`, oldest bucket first: what the scheduler chose
    /// over time across the fleet.
    async fn class_runs(&self, since_unix_ms: i64, bucket_ms: i64) -> Result<Vec<ClassRuns>>;

    /// One page of the invocation's actions in `order`: at most `limit` after skipping
    /// `offset`. A page of a large invocation need not read the rest, so a store should
    /// order and cut where the records are; this default reads them all.
    async fn actions_page(
        &self,
        tool_invocation_id: &str,
        order: ActionOrder,
        offset: usize,
        limit: usize,
    ) -> Result<Vec<ActionRecord>> {
        let mut actions = self.actions(tool_invocation_id).await?;
        order_actions(&mut actions, order);
        Ok(actions.into_iter().skip(offset).take(limit).collect())
    }

    /// The invocation's runs along its inferred critical path, the last to finish first, at
    /// most `limit`: the run that finished last, then each time the latest run completed by
    /// [`predecessor_bound`] of the one before, ties in [`ActionOrder::FinishedBy`]'s order,
    /// until none is (an untimed record ends it too). This default,
    /// [`path_back_by_pages`], asks one page per step; a store should walk where the
    /// records are, in one round trip.
    async fn path_back(&self, tool_invocation_id: &str, limit: usize) -> Result<Vec<ActionRecord>> {
        path_back_by_pages(self, tool_invocation_id, limit).await
    }

    /// The invocation's action count and total executor service time. The batching
    /// service divides the latter by build wall time to get occupancy. (A store should
    /// aggregate where the records are: the invocation list asks this for every row.)
    async fn invocation(&self, tool_invocation_id: &str) -> Result<InvocationSummary> {
        let actions = self.actions(tool_invocation_id).await?;
        Ok(InvocationSummary {
            tool_invocation_id: tool_invocation_id.to_string(),
            actions: actions.len() as u64,
            executor_service_seconds: actions.iter().map(|a| a.service_seconds()).sum(),
            executor_esu_seconds: actions.iter().map(|a| a.esu_seconds()).sum(),
            cpu_seconds: actions.iter().map(|a| a.user_cpu_seconds + a.system_cpu_seconds).sum(),
            max_peak_memory_bytes: actions.iter().map(|a| a.peak_memory_bytes).max().unwrap_or(0),
            failed_actions: actions.iter().filter(|a| a.status_code != 0 || a.exit_code != 0).count() as u64,
        })
    }
}

/// How far a run may seem to end after the next one on a critical path became ready and
/// still count as what it waited for: the times come from different clocks (the worker's
/// wall time, the scheduler's queue time, the server's completion time) and are rounded
/// to ms.
pub const PATH_TOLERANCE_MS: f64 = 50.0;

/// Where the run before `a` on a critical path must have completed, at the latest, in Unix
/// ms: by `a`'s readiness (its completion less its run and queue times, within
/// [`PATH_TOLERANCE_MS`]), and strictly before `a` ended, which keeps the walk finite
/// whatever the tolerance and keeps a run from waiting on itself.
pub fn predecessor_bound(a: &ActionRecord) -> i64 {
    let ready_ms = a.completed_unix_ms as f64 - 1000.0 * (a.wall_seconds.max(0.0) + a.queued_seconds.max(0.0));
    ((ready_ms + PATH_TOLERANCE_MS).floor() as i64).min(a.completed_unix_ms - 1)
}

/// [`ExecutionLog::path_back`] one [`ExecutionLog::actions_page`] of one run per step: the
/// definition a store's own walk must agree with.
pub async fn path_back_by_pages<L: ExecutionLog + ?Sized>(
    log: &L,
    tool_invocation_id: &str,
    limit: usize,
) -> Result<Vec<ActionRecord>> {
    let mut path = Vec::new();
    let mut bound = i64::MAX;
    while path.len() < limit {
        let page = log.actions_page(tool_invocation_id, ActionOrder::FinishedBy(bound), 0, 1).await?;
        let Some(a) = page.into_iter().next().filter(|a| a.completed_unix_ms > 0) else { break };
        bound = predecessor_bound(&a);
        path.push(a);
    }
    Ok(path)
}

/// `actions` kept and sorted as [`ActionOrder`] says: the order a store's query must give.
pub fn order_actions(actions: &mut Vec<ActionRecord>, order: ActionOrder) {
    let tie = |a: &ActionRecord, b: &ActionRecord| {
        a.completed_unix_ms.cmp(&b.completed_unix_ms).then_with(|| a.operation.cmp(&b.operation))
    };
    // Queued at, in ms as a store computes it, so both break ties alike.
    let ready = |a: &ActionRecord| a.completed_unix_ms as f64 - 1000.0 * (a.wall_seconds + a.queued_seconds);
    if let ActionOrder::FinishedBy(at) = order {
        actions.retain(|a| a.completed_unix_ms <= at);
    }
    actions.sort_by(|a, b| match order {
        ActionOrder::Dearest => b.esu_seconds().total_cmp(&a.esu_seconds()).then_with(|| tie(a, b)),
        ActionOrder::Cheapest => a.esu_seconds().total_cmp(&b.esu_seconds()).then_with(|| tie(b, a)),
        ActionOrder::Longest => b.wall_seconds.total_cmp(&a.wall_seconds).then_with(|| tie(a, b)),
        ActionOrder::FinishedBy(_) => b
            .completed_unix_ms
            .cmp(&a.completed_unix_ms)
            .then_with(|| ready(a).total_cmp(&ready(b)))
            .then_with(|| a.operation.cmp(&b.operation)),
    });
}

/// Persisted per-key statistics of the size-class learner (an opaque JSON document per
/// action shape key), so learning survives restarts.
#[async_trait]
pub trait SizeClassStore: Send + Sync + 'static {
    async fn get(&self, key: &str) -> Result<Option<String>>;
    async fn put(&self, key: &str, stats_json: &str) -> Result<()>;
    /// Every key, most recently updated first, at most `limit`.
    async fn keys(&self, limit: usize) -> Result<Vec<String>>;
}
