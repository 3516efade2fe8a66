//! The build service: a queue of planned builds, a pool of runners that run them with
//! Bazel, the record of every build (state, labels, outcome) in the metadata store, the
//! retries the design calls for, and the learning loop that retrains the planner's models
//! from that record.
//!
//! State lives in the store: every change to a build is one atomic upsert, so a crash
//! loses nothing, and builds found QUEUED or RUNNING at start are queued again (a build
//! that was running when the process died is run again from the start: its finished
//! actions hit the cache).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gantry_batch::{
    Batch, BatchSizeReason, BuildContext, BuildRecord, Corrected, Ended, Estimator, Feedback, Models, PlannerConfig,
    StreamingPlanner, Target, Timestamp, TrainConfig,
};
use gantry_core::task::{spawn_named, TaskGuard};
use gantry_core::{BuildQuery, BuildRow, BuildStore, ExecutionLog};
use serde::{Deserialize, Serialize};

use crate::classify::{BuildOutcome, OomSignal};
use crate::error::BuildsError;
use crate::runner::{RunReport, RunSpec, Runner, RunnerSettings};

/// The models the planner uses; swapped whole when training finishes.
pub type SharedModels = Arc<RwLock<Arc<Models>>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum BuildState {
    Queued,
    Running,
    Done,
}

impl BuildState {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildState::Queued => "QUEUED",
            BuildState::Running => "RUNNING",
            BuildState::Done => "DONE",
        }
    }
}

/// Why a build exists besides its stream's plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RetryKind {
    /// Half of an out-of-memory build, planned again.
    OomSplit,
    /// A deadline-exceeded build run once more as it was.
    DeadlineRerun,
}

/// The memory measurement used as the models' label: `[batch] memory_label` itself.
pub use gantry_config::MemoryLabel;

/// Everything known about one build; stored as the row's document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BuildDoc {
    pub id: String,
    pub stream_id: String,
    pub parent_id: Option<String>,
    pub retry_kind: Option<RetryKind>,
    pub context: BuildContext,
    pub targets: Vec<Target>,
    pub reason: BatchSizeReason,
    /// Why the reason is what it is, when that is not obvious (no models yet...).
    pub reason_note: String,
    pub memory_estimate_bytes: Option<u64>,
    pub occupancy_estimate_esu: Option<f64>,
    /// The planner's chance that this build runs out of memory. Records written before
    /// it existed read as None.
    #[serde(default)]
    pub oom_probability: Option<f64>,
    pub executor_types: Vec<String>,
    pub state: BuildState,
    pub outcome: Option<BuildOutcome>,
    /// What said the build ran out of memory (exit 33, OutOfMemoryError in a log, or the
    /// runner finding the server stuck in GC); set exactly when the outcome is OOM.
    /// Records written before it existed read as None.
    #[serde(default)]
    pub oom_signal: Option<OomSignal>,
    pub exit_code: Option<i32>,
    pub message: String,
    pub invocation_id: Option<String>,
    pub runner: Option<usize>,
    pub attempts: u32,
    pub created_unix_ms: i64,
    pub started_unix_ms: Option<i64>,
    pub finished_unix_ms: Option<i64>,
    pub wall_seconds: Option<f64>,
    pub used_heap_post_build: Option<u64>,
    pub peak_post_gc_heap: Option<u64>,
    pub server_vm_hwm: Option<u64>,
    pub actions_executed: u64,
    pub executor_esu_seconds: Option<f64>,
    pub execution_wall_seconds: Option<f64>,
    pub occupancy_esu: Option<f64>,
    /// Builds made from this one (split halves or the rerun).
    pub retries: Vec<String>,
    /// The version of the models that planned it: when they were trained (unix seconds,
    /// from their manifest). None when it was planned without models, or recorded before
    /// gantry kept this.
    #[serde(default)]
    pub models_trained_at: Option<i64>,
}

impl BuildDoc {
    pub fn labels(&self) -> Vec<String> {
        self.targets.iter().map(|t| t.label.clone()).collect()
    }

    /// The memory label of a finished build: the chosen measurement, or for an OOM build
    /// the heap it ran out of (a lower bound; training treats it as censored).
    pub fn memory_label(&self, label: MemoryLabel, heap_bytes: u64) -> Option<u64> {
        if self.outcome == Some(BuildOutcome::Oom) {
            return Some(heap_bytes);
        }
        match label {
            MemoryLabel::UsedHeapPostBuild => self.used_heap_post_build,
            MemoryLabel::PeakPostGcHeap => self.peak_post_gc_heap,
            MemoryLabel::ServerVmHwm => self.server_vm_hwm,
        }
    }

    /// The training record, if this build can teach the models anything.
    pub fn history_record(&self, label: MemoryLabel, heap_bytes: u64) -> Option<BuildRecord> {
        let outcome = self.outcome?;
        if outcome == BuildOutcome::InfraError {
            return None;
        }
        let ctx = &self.context;
        Some(BuildRecord {
            id: self.id.clone(),
            time: Timestamp(self.finished_unix_ms? / 1000),
            priority: ctx.priority,
            command: ctx.command,
            user: ctx.user.clone(),
            product_area: ctx.product_area.clone(),
            tool_tag: ctx.tool_tag.clone(),
            flags: ctx.flags.clone(),
            targets: self.labels(),
            peak_memory_bytes: self.memory_label(label, heap_bytes)?,
            executor_service_seconds: self.executor_esu_seconds.unwrap_or(0.0),
            wall_seconds: self.execution_wall_seconds.or(self.wall_seconds).unwrap_or(0.0),
            outcome: outcome.to_history(),
        })
    }

    fn row(&self) -> Result<BuildRow, BuildsError> {
        Ok(BuildRow {
            id: self.id.clone(),
            stream_id: self.stream_id.clone(),
            parent_id: self.parent_id.clone(),
            state: self.state.as_str().to_string(),
            created_unix_ms: self.created_unix_ms,
            finished_unix_ms: self.finished_unix_ms,
            document: serde_json::to_string(self)
                .map_err(|e| BuildsError::Internal(format!("encoding build {}: {e}", self.id)))?,
        })
    }

    pub fn from_row(row: &BuildRow) -> Result<BuildDoc, BuildsError> {
        serde_json::from_str(&row.document)
            .map_err(|e| BuildsError::Internal(format!("build {}: undecodable record: {e}", row.id)))
    }
}

/// Settings of the service from `[batch]`.
#[derive(Debug, Clone)]
pub struct ServiceSettings {
    pub runners: usize,
    pub runner_dir: PathBuf,
    pub runner: RunnerSettings,
    pub memory_label: MemoryLabel,
    pub model_dir: PathBuf,
    pub retrain_interval: Duration,
    pub min_history_builds: usize,
    /// Correct the planner by the builds the current models planned (`[batch] feedback`).
    pub feedback: bool,
    pub long_window: Duration,
    pub short_window: Duration,
    /// The model that plans (`[batch] learner`).
    pub learner: gantry_config::Learner,
}

/// What one training produced.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainSummary {
    pub builds: usize,
    pub oom_builds: usize,
    pub memory_model: bool,
    pub occupancy_model: bool,
    pub seconds: f64,
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

fn priority_rank(p: gantry_batch::Priority) -> u8 {
    match p {
        gantry_batch::Priority::High => 0,
        gantry_batch::Priority::Medium => 1,
        gantry_batch::Priority::Low => 2,
    }
}

#[derive(Default)]
struct State {
    /// Queued builds by (priority, arrival), so HIGH runs first and FIFO within a priority.
    queue: BTreeMap<(u8, u64), String>,
    next_seq: u64,
    /// Streams whose EnqueueTargets call is still planning.
    planning: HashSet<String>,
    /// Targets of queued and running builds, for retries (tags decide executor types).
    running: HashMap<String, BuildDoc>,
    shutting_down: bool,
}

/// What the builds planned by the current models said of them (see
/// `gantry_batch::feedback`): their memory errors, for the models trained at
/// `trained_at`. Builds planned by other models are not counted, and a retraining
/// starts it over: the new models learned from those builds.
#[derive(Default)]
struct Learned {
    trained_at: Option<i64>,
    feedback: Feedback,
}

struct Inner {
    store: Arc<dyn BuildStore>,
    log: Arc<dyn ExecutionLog>,
    settings: ServiceSettings,
    planner_config: PlannerConfig,
    models: SharedModels,
    state: Mutex<State>,
    /// Wakes runners when a build is queued.
    queued: tokio::sync::Notify,
    /// Bumped on every change a watcher may care about.
    changes: tokio::sync::watch::Sender<u64>,
    /// Serialises training (the loop and on-demand requests).
    training: tokio::sync::Mutex<()>,
    learned: Mutex<Learned>,
    runners: Vec<Arc<Runner>>,
}

pub struct BuildService {
    inner: Arc<Inner>,
    tasks: Mutex<Vec<TaskGuard>>,
}

impl BuildService {
    /// Opens the service: checks the runner directory, queues again the builds a
    /// previous process left unfinished, and starts the runners and the learning loop.
    pub async fn start(
        settings: ServiceSettings,
        store: Arc<dyn BuildStore>,
        log: Arc<dyn ExecutionLog>,
        planner_config: PlannerConfig,
        models: SharedModels,
    ) -> Result<Arc<BuildService>, BuildsError> {
        std::fs::create_dir_all(&settings.runner_dir)
            .map_err(|e| BuildsError::Io(format!("creating {}: {e}", settings.runner_dir.display())))?;
        let runner_settings = Arc::new(settings.runner.clone());
        let runners = (0..settings.runners)
            .map(|i| Runner::new(i, &settings.runner_dir, runner_settings.clone()).map(Arc::new))
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| BuildsError::Io(format!("runner directory {}: {e}", settings.runner_dir.display())))?;
        let (changes, _) = tokio::sync::watch::channel(0);
        let inner = Arc::new(Inner {
            store,
            log,
            settings,
            planner_config,
            models,
            state: Mutex::new(State::default()),
            queued: tokio::sync::Notify::new(),
            changes,
            training: tokio::sync::Mutex::new(()),
            learned: Mutex::new(Learned::default()),
            runners,
        });
        inner.seed_feedback().await?;
        let unfinished =
            inner.store.list(&BuildQuery { unfinished_only: true, oldest_first: true, ..Default::default() }).await?;
        for row in &unfinished {
            let mut doc = BuildDoc::from_row(row)?;
            if doc.state == BuildState::Running {
                doc.state = BuildState::Queued;
                doc.message = "requeued: gantry restarted while it ran".into();
                inner.put(&doc).await?;
            }
            inner.enqueue(doc);
        }
        if !unfinished.is_empty() {
            tracing::info!(builds = unfinished.len(), "queued again the builds a previous run left unfinished");
        }
        let mut tasks = Vec::new();
        for runner in &inner.runners {
            let (inner, runner) = (inner.clone(), runner.clone());
            tasks.push(spawn_named("batch-runner", async move { inner.run_loop(runner).await }));
        }
        if !inner.settings.retrain_interval.is_zero() {
            let inner = inner.clone();
            tasks.push(spawn_named("batch-learner", async move { inner.learn_loop().await }));
        }
        Ok(Arc::new(BuildService { inner, tasks: Mutex::new(tasks) }))
    }

    pub fn models(&self) -> SharedModels {
        self.inner.models.clone()
    }

    /// The feedback of the builds the current models planned, for a planner to start
    /// with ([`gantry_batch::Corrected`]); empty with `[batch] feedback = false`.
    pub fn feedback(&self) -> Feedback {
        self.inner.feedback()
    }

    /// A stream starts planning: its watchers wait for it to finish.
    pub fn stream_started(&self, stream_id: &str) {
        self.inner.state.lock().expect("poisoned").planning.insert(stream_id.to_string());
        self.inner.bump();
    }

    /// A stream finished planning (or its client went away).
    pub fn stream_finished(&self, stream_id: &str) {
        self.inner.state.lock().expect("poisoned").planning.remove(stream_id);
        self.inner.bump();
    }

    /// Records and queues a build the planner cut; `reason_note` (from
    /// [`reason_note`](Self::reason_note)) says why its reason applies, and
    /// `models_trained_at` which models planned it (see [`BuildDoc::models_trained_at`]).
    #[allow(clippy::too_many_arguments)]
    pub async fn submit(
        &self,
        id: String,
        stream_id: &str,
        ctx: &BuildContext,
        targets: Vec<Target>,
        batch: &Batch,
        reason_note: String,
        models_trained_at: Option<i64>,
    ) -> Result<BuildDoc, BuildsError> {
        let doc = new_doc(id, stream_id, None, None, ctx, targets, batch, reason_note, models_trained_at);
        self.inner.put(&doc).await?;
        self.inner.enqueue(doc.clone());
        Ok(doc)
    }

    /// Why a batch size reason applies, e.g. "no models yet (3 of 20 ...)". It reads the
    /// history, so callers compute it once per stream and reason, not once per build.
    pub async fn reason_note(&self, reason: BatchSizeReason) -> Result<String, BuildsError> {
        self.inner.reason_note(reason).await
    }

    pub async fn get(&self, id: &str) -> Result<BuildDoc, BuildsError> {
        let row = self.inner.store.get(id).await?.ok_or_else(|| BuildsError::NotFound(format!("build {id}")))?;
        BuildDoc::from_row(&row)
    }

    pub async fn list(&self, query: &BuildQuery) -> Result<Vec<BuildDoc>, BuildsError> {
        self.inner.store.list(query).await?.iter().map(BuildDoc::from_row).collect()
    }

    /// True once the stream finished planning and each of its builds, retries
    /// included, reached an outcome.
    pub async fn stream_complete(&self, stream_id: &str) -> Result<(bool, Vec<BuildDoc>), BuildsError> {
        let planning = self.inner.state.lock().expect("poisoned").planning.contains(stream_id);
        let builds = self
            .list(&BuildQuery { stream_id: Some(stream_id.into()), oldest_first: true, ..Default::default() })
            .await?;
        if !planning && builds.is_empty() {
            return Err(BuildsError::NotFound(format!("stream {stream_id}: no builds")));
        }
        let done = !planning && builds.iter().all(|b| b.state == BuildState::Done);
        Ok((done, builds))
    }

    /// Whether `shutdown` was called: watchers end their streams then.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.state.lock().expect("poisoned").shutting_down
    }

    /// A receiver that changes whenever a build changes state or a stream finishes planning.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.changes.subscribe()
    }

    /// The training history: every finished build in the long window that can teach
    /// the models, as the JSONL records of `gantry model train --history`.
    pub async fn history(&self) -> Result<Vec<BuildRecord>, BuildsError> {
        self.inner.history().await
    }

    /// Retrains now from the live history and swaps the planner to the new models.
    pub async fn train_now(&self) -> Result<TrainSummary, BuildsError> {
        self.inner.train().await
    }

    /// Stops the runners (their builds are killed and stay queued for the next start)
    /// and shuts the Bazel servers down.
    pub async fn shutdown(&self) {
        self.inner.state.lock().expect("poisoned").shutting_down = true;
        // Wake the watchers, so their streams end and the server can drain.
        self.inner.changes.send_modify(|v| *v += 1);
        let tasks = std::mem::take(&mut *self.tasks.lock().expect("poisoned"));
        drop(tasks);
        for r in &self.inner.runners {
            r.shutdown().await;
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn new_doc(
    id: String,
    stream_id: &str,
    parent_id: Option<String>,
    retry_kind: Option<RetryKind>,
    ctx: &BuildContext,
    targets: Vec<Target>,
    batch: &Batch,
    reason_note: String,
    models_trained_at: Option<i64>,
) -> BuildDoc {
    BuildDoc {
        id,
        stream_id: stream_id.to_string(),
        parent_id,
        retry_kind,
        context: ctx.clone(),
        targets,
        reason: batch.reason,
        reason_note,
        memory_estimate_bytes: batch.memory_estimate_bytes,
        occupancy_estimate_esu: batch.occupancy_estimate_esu,
        oom_probability: batch.oom_probability,
        executor_types: batch.executor_types.iter().cloned().collect(),
        state: BuildState::Queued,
        outcome: None,
        oom_signal: None,
        exit_code: None,
        message: String::new(),
        invocation_id: None,
        runner: None,
        attempts: 0,
        created_unix_ms: now_ms(),
        started_unix_ms: None,
        finished_unix_ms: None,
        wall_seconds: None,
        used_heap_post_build: None,
        peak_post_gc_heap: None,
        server_vm_hwm: None,
        actions_executed: 0,
        executor_esu_seconds: None,
        execution_wall_seconds: None,
        occupancy_esu: None,
        retries: Vec::new(),
        models_trained_at,
    }
}

impl Inner {
    fn bump(&self) {
        self.changes.send_modify(|v| *v += 1);
    }

    async fn put(&self, doc: &BuildDoc) -> Result<(), BuildsError> {
        self.store.put(&doc.row()?).await?;
        self.bump();
        Ok(())
    }

    fn enqueue(&self, doc: BuildDoc) {
        let mut st = self.state.lock().expect("poisoned");
        let seq = st.next_seq;
        st.next_seq += 1;
        st.queue.insert((priority_rank(doc.context.priority), seq), doc.id.clone());
        st.running.insert(doc.id.clone(), doc);
        drop(st);
        self.queued.notify_one();
    }

    async fn next(&self) -> BuildDoc {
        loop {
            let notified = self.queued.notified();
            {
                let mut st = self.state.lock().expect("poisoned");
                if let Some((_, id)) = st.queue.pop_first() {
                    let doc = st.running.get(&id).cloned().expect("queued builds are tracked");
                    // Another runner may be waiting too.
                    if !st.queue.is_empty() {
                        self.queued.notify_one();
                    }
                    return doc;
                }
            }
            notified.await;
        }
    }

    async fn reason_note(&self, reason: BatchSizeReason) -> Result<String, BuildsError> {
        let has_models = {
            let m = self.models.read().expect("poisoned");
            m.memory.is_some() || m.occupancy.is_some()
        };
        Ok(match reason {
            BatchSizeReason::MemoryEstimateError | BatchSizeReason::OccupancyEstimateError if !has_models => {
                let have = self.history().await?.len();
                format!(
                    "no models yet ({have} of {} finished builds needed to train): fallback batch size {}",
                    self.settings.min_history_builds, self.planner_config.fallback_batch_size
                )
            }
            BatchSizeReason::MemoryEstimateError | BatchSizeReason::OccupancyEstimateError => {
                "a model could not estimate these targets: fallback batch size".into()
            }
            _ => String::new(),
        })
    }

    fn feedback(&self) -> Feedback {
        if !self.settings.feedback {
            return Feedback::new();
        }
        let current = self.models.read().expect("poisoned").manifest.trained_at.map(|t| t.0);
        let learned = self.learned.lock().expect("poisoned");
        if learned.trained_at == current {
            learned.feedback.clone()
        } else {
            Feedback::new()
        }
    }

    /// A finished build planned by the current models: its memory error against them.
    fn observe(&self, doc: &BuildDoc) {
        if !self.settings.feedback {
            return;
        }
        let models = self.models.read().expect("poisoned").clone();
        if let Some(m) = measure(&models, doc, self.settings.memory_label, self.settings.runner.heap_bytes) {
            self.learn(&models, [m]);
        }
    }

    /// Records measurements made against `models`, if they are still the current ones.
    fn learn(&self, models: &Models, measured: impl IntoIterator<Item = Measured>) {
        let trained_at = models.manifest.trained_at.map(|t| t.0);
        if self.models.read().expect("poisoned").manifest.trained_at.map(|t| t.0) != trained_at {
            return;
        }
        let mut learned = self.learned.lock().expect("poisoned");
        if learned.trained_at != trained_at {
            *learned = Learned { trained_at, feedback: Feedback::new() };
        }
        for m in measured {
            let targets: Vec<&str> = m.targets.iter().map(String::as_str).collect();
            learned.feedback.observe(&m.tool, &targets, m.estimate, m.actual, m.ended);
            if let Some((estimate, actual)) = m.occupancy {
                learned.feedback.observe_occupancy(&m.tool, estimate, actual, m.ended);
            }
        }
    }

    /// At startup: the builds finished since the loaded models were trained (the newest
    /// `SEED_LIMIT`), so a restart keeps what they taught. Estimating them runs on the
    /// blocking pool; a row that cannot be read is skipped, since this is only a head start.
    async fn seed_feedback(&self) -> Result<(), BuildsError> {
        let models = self.models.read().expect("poisoned").clone();
        let Some(trained_at) = models.manifest.trained_at.map(|t| t.0).filter(|_| self.settings.feedback) else {
            return Ok(());
        };
        // `trained_at` is the end of the training window, a second past its newest build,
        // and another process's clock may differ: look an hour further back, and let
        // `measure` keep exactly the builds these models planned.
        let since = (trained_at - 3600) * 1000;
        let rows = self
            .store
            .list(&BuildQuery { finished_since_unix_ms: Some(since), limit: SEED_LIMIT, ..Default::default() })
            .await?;
        let (label, heap) = (self.settings.memory_label, self.settings.runner.heap_bytes);
        let m = models.clone();
        let measured = tokio::task::spawn_blocking(move || {
            // Newest first from the store; observed oldest first, so the window keeps the newest.
            rows.iter()
                .rev()
                .filter_map(|row| match BuildDoc::from_row(row) {
                    Ok(doc) => measure(&m, &doc, label, heap),
                    Err(e) => {
                        tracing::warn!(build = %row.id, error = %e, "build record skipped by the feedback");
                        None
                    }
                })
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|e| BuildsError::Internal(format!("reading the feedback: {e}")))?;
        self.learn(&models, measured);
        Ok(())
    }

    async fn run_loop(self: Arc<Self>, runner: Arc<Runner>) {
        loop {
            let doc = self.next().await;
            let id = doc.id.clone();
            if let Err(e) = self.run_one(&runner, doc).await {
                // The store failed: the build stays as last written (queued or running)
                // and is taken up again at the next start; say so loudly.
                tracing::error!(build = %id, error = %e, "could not record a build");
            }
        }
    }

    async fn run_one(&self, runner: &Runner, mut doc: BuildDoc) -> Result<(), BuildsError> {
        let invocation_id = uuid::Uuid::new_v4().to_string();
        doc.state = BuildState::Running;
        doc.runner = Some(runner.index);
        doc.attempts += 1;
        doc.started_unix_ms = Some(now_ms());
        doc.invocation_id = Some(invocation_id.clone());
        self.put(&doc).await?;
        tracing::info!(build = %doc.id, runner = runner.index, targets = doc.targets.len(), invocation = %invocation_id, "build started");

        let ctx = doc.context.clone();
        let dir = runner.dir().to_path_buf();
        let prepared = tokio::task::spawn_blocking(move || crate::workspace::prepare(&ctx, &dir))
            .await
            .map_err(|e| BuildsError::Internal(format!("preparing the workspace: {e}")))?;
        let report = match prepared {
            Ok(workspace) => {
                let spec = RunSpec {
                    workspace,
                    command: match doc.context.command {
                        gantry_batch::Command::Build => "build".into(),
                        gantry_batch::Command::Test => "test".into(),
                    },
                    flags: doc.context.flags.clone(),
                    targets: doc.labels(),
                    invocation_id: invocation_id.clone(),
                };
                runner.run(&spec).await
            }
            Err(message) => RunReport::infra_error(message, 0.0),
        };
        // Executor occupancy from gantry's own invocation records: ESU-seconds over the
        // span in which the build had actions on the executors.
        let actions = self.log.actions(&invocation_id).await?;
        // fold from +0.0: an empty f64 sum is -0.0, which status displays would show.
        let esu: f64 = actions.iter().map(|a| a.esu_seconds()).fold(0.0, |a, b| a + b);
        let span = if actions.is_empty() {
            None
        } else {
            let start = actions
                .iter()
                .map(|a| a.completed_unix_ms as f64 / 1000.0 - a.wall_seconds - a.queued_seconds)
                .fold(f64::MAX, f64::min);
            let end = actions.iter().map(|a| a.completed_unix_ms as f64 / 1000.0).fold(f64::MIN, f64::max);
            Some((end - start).max(0.001))
        };
        let exec_wall = span.unwrap_or(report.wall_seconds.max(0.001));
        doc.actions_executed = actions.len() as u64;
        doc.executor_esu_seconds = Some(esu);
        doc.execution_wall_seconds = Some(exec_wall);
        doc.occupancy_esu = Some(esu / exec_wall);
        doc.outcome = Some(report.outcome);
        doc.oom_signal = report.oom_signal;
        doc.exit_code = report.exit_code;
        doc.message = report.message.clone();
        doc.wall_seconds = Some(report.wall_seconds);
        doc.used_heap_post_build = report.bep.used_heap_post_build;
        doc.peak_post_gc_heap = report.bep.peak_post_gc_heap;
        doc.server_vm_hwm = report.server_vm_hwm;

        doc.finished_unix_ms = Some(now_ms());
        // Observed before its retries are planned: an OOM's halves are charged its deficit.
        self.observe(&doc);
        // Retries are recorded before the parent is marked done, so a watcher that sees
        // the parent finished also sees its children.
        let children = self.retries_for(&doc);
        for child in &children {
            self.put(child).await?;
        }
        doc.retries = children.iter().map(|c| c.id.clone()).collect();
        doc.state = BuildState::Done;
        self.put(&doc).await?;
        self.state.lock().expect("poisoned").running.remove(&doc.id);
        for child in children {
            self.enqueue(child);
        }
        tracing::info!(
            build = %doc.id,
            outcome = report.outcome.as_str(),
            oom_signal = report.oom_signal.map(OomSignal::as_str),
            wall_s = format!("{:.1}", report.wall_seconds),
            used_heap = ?doc.used_heap_post_build,
            retries = doc.retries.len(),
            "build finished"
        );
        Ok(())
    }

    /// OOM with several targets: each half goes through the planner again. OOM with one
    /// target: nothing more can be done. Deadline exceeded: once more as it was (its
    /// finished actions now hit the cache).
    fn retries_for(&self, doc: &BuildDoc) -> Vec<BuildDoc> {
        match doc.outcome {
            Some(BuildOutcome::Oom) if doc.targets.len() > 1 => {
                let mid = doc.targets.len() / 2;
                let models = self.models.read().expect("poisoned").clone();
                let estimator = Corrected { inner: &*models, feedback: self.feedback() };
                let mut out = Vec::new();
                for half in [&doc.targets[..mid], &doc.targets[mid..]] {
                    let batches = match plan_again(&doc.context, &self.planner_config, &estimator, half) {
                        Ok(b) => b,
                        Err(e) => {
                            // Planning the same targets again cannot fail on input; if the
                            // planner refuses, run the half as it is rather than lose it.
                            tracing::warn!(build = %doc.id, error = %e, "re-planning an OOM half failed; running the half as one build");
                            vec![Batch {
                                targets: half.iter().map(|t| t.label.clone()).collect(),
                                reason: BatchSizeReason::MemoryEstimateError,
                                memory_estimate_bytes: None,
                                occupancy_estimate_esu: None,
                                oom_probability: None,
                                executor_types: doc.executor_types.iter().cloned().collect(),
                            }]
                        }
                    };
                    for b in batches {
                        let by_label: HashMap<&str, &Target> = half.iter().map(|t| (t.label.as_str(), t)).collect();
                        let targets = b.targets.iter().map(|l| by_label[l.as_str()].clone()).collect();
                        let id = format!("{}.{}", doc.id, out.len() + 1);
                        out.push(new_doc(
                            id,
                            &doc.stream_id,
                            Some(doc.id.clone()),
                            Some(RetryKind::OomSplit),
                            &doc.context,
                            targets,
                            &b,
                            format!("half of OOM build {}", doc.id),
                            models.manifest.trained_at.map(|t| t.0),
                        ));
                    }
                }
                out
            }
            Some(BuildOutcome::DeadlineExceeded) if doc.retry_kind != Some(RetryKind::DeadlineRerun) => {
                // The same build as planned: targets, reason and estimates carry over.
                let planned = Batch {
                    targets: doc.labels(),
                    reason: doc.reason,
                    memory_estimate_bytes: doc.memory_estimate_bytes,
                    occupancy_estimate_esu: doc.occupancy_estimate_esu,
                    oom_probability: doc.oom_probability,
                    executor_types: doc.executor_types.iter().cloned().collect(),
                };
                vec![new_doc(
                    format!("{}.r", doc.id),
                    &doc.stream_id,
                    Some(doc.id.clone()),
                    Some(RetryKind::DeadlineRerun),
                    &doc.context,
                    doc.targets.clone(),
                    &planned,
                    format!("rerun of deadline-exceeded build {}", doc.id),
                    doc.models_trained_at,
                )]
            }
            _ => Vec::new(),
        }
    }

    async fn history(&self) -> Result<Vec<BuildRecord>, BuildsError> {
        read_history(
            &*self.store,
            self.settings.memory_label,
            self.settings.runner.heap_bytes,
            self.settings.long_window,
        )
        .await
    }

    async fn train(&self) -> Result<TrainSummary, BuildsError> {
        let _one_at_a_time = self.training.lock().await;
        let history = self.history().await?;
        if history.len() < self.settings.min_history_builds {
            return Err(BuildsError::FailedPrecondition(format!(
                "the build history holds {} usable finished builds; {} are needed before training (batch.min_history_builds)",
                history.len(),
                self.settings.min_history_builds
            )));
        }
        let config = TrainConfig {
            long_window_days: self.settings.long_window.as_secs_f64() / 86_400.0,
            short_window_days: self.settings.short_window.as_secs_f64() / 86_400.0,
            learner: learner_of(self.settings.learner),
            ..TrainConfig::default()
        };
        let dir = self.settings.model_dir.clone();
        let started = std::time::Instant::now();
        let oom_builds = history.iter().filter(|r| r.outcome == gantry_batch::Outcome::Oom).count();
        let n = history.len();
        // Windows end just after the newest build, so it is inside them.
        let now = Timestamp(now_ms() / 1000 + 1);
        let models = tokio::task::spawn_blocking(move || -> Result<Models, BuildsError> {
            let models = gantry_batch::train(&history, &config, now)?;
            models.save(&dir)?;
            Ok(models)
        })
        .await
        .map_err(|e| BuildsError::Internal(format!("training task: {e}")))??;
        let summary = TrainSummary {
            builds: n,
            oom_builds,
            memory_model: models.has_memory(),
            occupancy_model: models.occupancy.is_some() || models.shared.is_some(),
            seconds: started.elapsed().as_secs_f64(),
        };
        // New streams and retries plan with the new models from now on; running streams
        // keep the models they started with.
        *self.models.write().expect("poisoned") = Arc::new(models);
        tracing::info!(
            builds = n,
            oom_builds,
            seconds = format!("{:.2}", summary.seconds),
            "batching models retrained and swapped in"
        );
        Ok(summary)
    }

    async fn learn_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.settings.retrain_interval);
        tick.tick().await;
        let mut trained_on = 0usize;
        loop {
            tick.tick().await;
            let n = match self.history().await {
                Ok(h) => h.len(),
                Err(e) => {
                    tracing::error!(error = %e, "reading the build history for training");
                    continue;
                }
            };
            if n < self.settings.min_history_builds || n == trained_on {
                continue;
            }
            match self.train().await {
                Ok(s) => trained_on = s.builds,
                Err(e) => tracing::error!(error = %e, "retraining the batching models"),
            }
        }
    }
}

/// The training history in a build store: every build finished within `long_window`
/// that can teach the models, oldest first, labelled with `label` (OOM builds with
/// `heap_bytes`). The live service and `gantry model export-history` both read it here.
pub async fn read_history(
    store: &dyn BuildStore,
    label: MemoryLabel,
    heap_bytes: u64,
    long_window: Duration,
) -> Result<Vec<BuildRecord>, BuildsError> {
    let since = now_ms() - long_window.as_millis() as i64;
    let rows = store
        .list(&BuildQuery { finished_since_unix_ms: Some(since), oldest_first: true, ..Default::default() })
        .await?;
    let mut out = Vec::new();
    for row in &rows {
        if let Some(r) = BuildDoc::from_row(row)?.history_record(label, heap_bytes) {
            out.push(r);
        }
    }
    Ok(out)
}

/// Builds read at startup for the feedback: more than its window holds for a few tools.
const SEED_LIMIT: usize = 5000;

/// The training configuration's learner for `[batch] learner`.
pub fn learner_of(l: gantry_config::Learner) -> gantry_batch::model::Learner {
    match l {
        gantry_config::Learner::Shared => gantry_batch::model::Learner::Shared,
        gantry_config::Learner::Linear => gantry_batch::model::Learner::Linear,
    }
}

/// One finished build as the feedback sees it.
struct Measured {
    tool: String,
    targets: Vec<String>,
    estimate: f64,
    actual: f64,
    ended: Ended,
    /// Its occupancy (ESU) estimate against what it had, when both are known.
    occupancy: Option<(f64, f64)>,
}

/// `doc`'s memory against `models`' estimate, if `models` planned it and it has a label.
fn measure(models: &Models, doc: &BuildDoc, label: MemoryLabel, heap_bytes: u64) -> Option<Measured> {
    if !models.has_memory() {
        return None;
    }
    if doc.models_trained_at.is_none() || doc.models_trained_at != models.manifest.trained_at.map(|t| t.0) {
        return None;
    }
    let record = doc.history_record(label, heap_bytes)?;
    let labels: Vec<&str> = record.targets.iter().map(String::as_str).collect();
    let estimate = models.predict_memory(&doc.context, &labels)?.ok()?;
    let occupancy = doc
        .occupancy_esu
        .zip(models.predict_occupancy(&doc.context, &labels).and_then(|r| r.ok()))
        .map(|(actual, estimate)| (estimate, actual));
    Some(Measured {
        occupancy,
        tool: doc.context.tool_tag.clone(),
        estimate,
        actual: record.peak_memory_bytes as f64,
        ended: match doc.outcome {
            Some(BuildOutcome::Oom) => Ended::Oom,
            // Every target was built, whatever its tests said.
            Some(BuildOutcome::Success | BuildOutcome::TestsFailed) => Ended::Complete,
            _ => Ended::Partial,
        },
        targets: record.targets,
    })
}

/// Plans `targets` (one executor group) again with the current models.
fn plan_again<E: Estimator>(
    ctx: &BuildContext,
    config: &PlannerConfig,
    estimator: &E,
    targets: &[Target],
) -> Result<Vec<Batch>, gantry_batch::BatchError> {
    let mut p = StreamingPlanner::new(ctx.clone(), config.clone(), estimator)?;
    for t in targets {
        p.push(t.clone())?;
    }
    Ok(p.finish())
}
