//! The submit queue service.
//!
//! Every input of the planner (a change entering the queue, a build result, a
//! cancellation, a capacity change) is appended to the journal in the metadata store
//! *before* the planner sees it; the planner is deterministic, so replaying the journal
//! at startup rebuilds exactly the state it had, and the actions it produces are carried
//! out idempotently (a landing that is already recorded is skipped, a rejection is an
//! upsert). Builds that were running when gantry stopped are started again.
//!
//! Three tasks do the slow work, each alone so the order of their effects is the
//! queue's order:
//! - the **analyzer** takes submitted changes (highest priority first, then submission
//!   order), makes "change on mainline" as a commit, runs `bazel query` at the mainline
//!   and at that commit, and enqueues the change with its affected targets;
//! - the **lander** moves the mainline for each `Land`, in version order: record the
//!   intent, `update-ref NEW OLD`, record it done. NEW is the tested commit itself when
//!   the build's base is the mainline (a fast-forward), or a commit with the tested tree;
//!   when independent changes landed meanwhile (parallel lanes) the combined tree is
//!   built first and the ref moves only if it passes. When the ref cannot move, the
//!   change is rejected and the planner hears of it (`Event::LandingFailed`), so it
//!   stops counting the change as landed and re-plans the changes behind it;
//! - the **event loop** applies build results, so a build task never has to outlive
//!   its own cancellation.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gantry_builds::runner::{RunReport, RunSpec, Runner, RunnerSettings};
use gantry_core::task::{spawn_named, GuardedStream, TaskGuard};
use gantry_core::{LandingRow, QueueDocRow, QueueStore};
use gantry_proto::queue::v1 as pb;
use gantry_queue::{
    Action, BuildOutcome, BuildSpec, ChangeAnalysis, ChangeFeatures, ChangeId, ConflictAnalyzer, Event, LandProof,
    Millis, Planner, PlannerConfig, TargetGraph,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch, Mutex, Notify, Semaphore};

use crate::analyzer;
use crate::error::SubmitError;
use crate::git::{short, Patch, Repo};
use crate::metrics::QueueMetrics;

type Result<T, E = SubmitError> = std::result::Result<T, E>;

/// `[queue]` plus the Bazel settings the builds use.
#[derive(Debug, Clone)]
pub struct QueueSettings {
    pub repository: PathBuf,
    pub mainline: String,
    pub capacity: usize,
    pub max_retries: u32,
    /// Empty: `bazel test` of the affected targets.
    pub build_command: Vec<String>,
    pub work_dir: PathBuf,
    pub runner: RunnerSettings,
    pub prior_success: f64,
    pub prior_conflict: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ChangeState {
    Submitted,
    Pending,
    Landed,
    Rejected,
    Cancelled,
}

impl ChangeState {
    pub(crate) fn name(self) -> &'static str {
        match self {
            ChangeState::Submitted => "SUBMITTED",
            ChangeState::Pending => "PENDING",
            ChangeState::Landed => "LANDED",
            ChangeState::Rejected => "REJECTED",
            ChangeState::Cancelled => "CANCELLED",
        }
    }

    pub(crate) fn decided(self) -> bool {
        matches!(self, ChangeState::Landed | ChangeState::Rejected | ChangeState::Cancelled)
    }
}

/// A change as stored.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChangeDoc {
    pub id: String,
    pub seq: i64,
    pub change_ref: String,
    pub commit: String,
    pub merge_base: String,
    pub priority: i32,
    pub author: String,
    pub state: ChangeState,
    pub reason: String,
    pub submitted_ms: i64,
    pub decided_ms: Option<i64>,
    pub landed_commit: String,
    pub landed_version: u64,
    pub affected: Vec<String>,
    /// Affected rules (what `bazel test` is given); empty with `full_build`.
    pub test_targets: Vec<String>,
    pub alters_graph: bool,
    /// Test all of `//...`: the graph changed, or the analysis failed.
    pub full_build: bool,
}

impl ChangeDoc {
    fn patch(&self) -> Patch {
        Patch {
            merge_base: self.merge_base.clone(),
            head: self.commit.clone(),
            name: format!("{} ({})", self.id, self.change_ref),
        }
    }
}

/// A build as stored.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BuildDoc {
    pub spec: BuildSpec,
    /// RUNNING, PASSED, FAILED or CANCELLED.
    pub state: String,
    pub commit: String,
    pub targets: Vec<String>,
    pub started_ms: i64,
    pub finished_ms: Option<i64>,
    pub message: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct LandingDoc {
    build_id: u64,
    /// "fast-forward", "same-tree" or "verified"; or the queue's planner config on version 0.
    how: String,
    landed_ms: i64,
    message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    planner_config: Option<PlannerConfig>,
}

struct Inner {
    planner: Planner,
    changes: BTreeMap<String, ChangeDoc>,
    builds: BTreeMap<u64, BuildDoc>,
    /// Running build tasks; dropping one stops its Bazel.
    tasks: HashMap<u64, TaskGuard>,
    landings: BTreeMap<u64, LandingRow>,
    last_ms: u64,
}

impl Inner {
    /// The planner clock: wall time, never going backwards.
    fn tick(&mut self) -> u64 {
        self.last_ms = self.last_ms.max(unix_ms() as u64);
        self.last_ms
    }
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// A build's result for the planner, sent to the event loop.
struct Finished {
    id: u64,
    outcome: BuildOutcome,
    commit: String,
    targets: Vec<String>,
    message: String,
}

pub struct QueueService {
    settings: QueueSettings,
    repo: Repo,
    store: Arc<dyn QueueStore>,
    inner: Mutex<Inner>,
    runners: std::sync::Mutex<Vec<Runner>>,
    runner_slots: Arc<Semaphore>,
    /// Runs the analyzer's queries and landing verifications, one at a time.
    aux: Mutex<Runner>,
    graphs: std::sync::Mutex<Graphs>,
    /// Commit of every mainline version known so far (index = version).
    versions: watch::Sender<Vec<String>>,
    /// Bumped on every change of state, for Watch.
    updates: watch::Sender<u64>,
    wake_analyzer: Notify,
    land_tx: mpsc::UnboundedSender<(ChangeId, LandProof)>,
    finished_tx: mpsc::UnboundedSender<Finished>,
    background: std::sync::Mutex<Vec<TaskGuard>>,
    /// Set by `shutdown`: a build or verification cut short by the stop is reported
    /// nowhere (it runs again after the next start) instead of being judged.
    stopping: AtomicBool,
    metrics: QueueMetrics,
}

/// What the build steps made of a tree.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Verdict {
    Passed,
    /// The tree's doing: a test or the build failed, or it ran past the deadline.
    Failed(String),
    /// Not the tree's doing (Bazel could not run or lost the remote executor, the build
    /// command could not be started, the worktree could not be checked out): judging
    /// the change on it would reject a good change, so the same tree is tried again.
    Infra(String),
}

impl Verdict {
    /// Bazel's outcome, as `gantry-builds` classified it.
    fn of_bazel(report: &RunReport) -> Verdict {
        match report.outcome {
            gantry_builds::BuildOutcome::Success => Verdict::Passed,
            gantry_builds::BuildOutcome::InfraError => Verdict::Infra(format!("INFRA_ERROR: {}", report.message)),
            o => Verdict::Failed(format!("{}: {}", o.as_str(), report.message)),
        }
    }
}

/// How long to wait before trying build steps again after an infrastructure error:
/// quickly at first (a restarting executor), then every 30 s until it comes back.
fn infra_backoff(retry: u32) -> Duration {
    const FIRST: [u64; 3] = [2, 5, 15];
    Duration::from_secs(FIRST.get(retry as usize).copied().unwrap_or(30))
}

/// `[queue] build_command` in a tree: passed when it exits 0. Only a command that cannot
/// be started is an infrastructure error; whatever it does once running is the tree's.
async fn run_build_command(command: &[String], tree: &std::path::Path, deadline: Duration) -> Verdict {
    let Some((program, args)) = command.split_first() else { return Verdict::Failed("empty build_command".into()) };
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args).current_dir(tree).stdin(std::process::Stdio::null()).kill_on_drop(true);
    match tokio::time::timeout(deadline, cmd.output()).await {
        Err(_) => Verdict::Failed(format!("stopped at the {deadline:?} deadline")),
        Ok(Err(e)) => Verdict::Infra(format!("starting {program}: {e}")),
        Ok(Ok(out)) if out.status.success() => Verdict::Passed,
        Ok(Ok(out)) => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
            Verdict::Failed(format!("{program} exited with {}: {last}", out.status))
        }
    }
}

/// How one try of a queue build ended.
enum Attempt {
    /// A result for the planner (`FailedConclusively`: the patch does not apply on the tree).
    Done(Finished),
    /// Not the tree's doing: try the same build again later.
    Infra(String),
    /// The queue is stopping: report nothing.
    Stopping,
}

/// What the lander may do for one landing.
enum Move {
    /// Move the mainline to this commit; `how` says why that commit is the tested tree.
    To { commit: String, how: String },
    /// Do not move it, and reject the change for this reason.
    Refuse(String),
    /// The queue is stopping: record nothing; the replay emits the Land again.
    Stopping,
}

fn doc_row<T: Serialize>(id: &str, seq: i64, state: &str, doc: &T) -> Result<QueueDocRow> {
    Ok(QueueDocRow { id: id.to_string(), seq, state: state.to_string(), document: serde_json::to_string(doc)? })
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, String> + Send + 'static) -> Result<T, String> {
    tokio::task::spawn_blocking(f).await.map_err(|e| format!("git task: {e}"))?
}

impl QueueService {
    /// Opens the queue: loads its state, replays the journal, restarts interrupted
    /// builds and starts the analyzer, lander and event loop. Its metrics go to `registry`.
    pub async fn start(
        settings: QueueSettings,
        store: Arc<dyn QueueStore>,
        registry: &prometheus::Registry,
    ) -> Result<Arc<QueueService>> {
        let repo = Repo::new(&settings.repository, &settings.mainline);
        let head = repo.head().map_err(|e| {
            SubmitError::FailedPrecondition(format!(
                "queue.repository {} / queue.mainline {}: {e}",
                settings.repository.display(),
                settings.mainline
            ))
        })?;
        let mut runners = Vec::new();
        for i in 0..=settings.capacity {
            let r = Runner::new(i, &settings.work_dir, Arc::new(settings.runner.clone())).map_err(|e| {
                SubmitError::Unavailable(format!("queue.work_dir {}: {e}", settings.work_dir.display()))
            })?;
            runners.push(r);
        }
        let aux = runners.pop().expect("capacity + 1 runners");

        let mut landings: BTreeMap<u64, LandingRow> =
            store.list_landings().await?.into_iter().map(|r| (r.version as u64, r)).collect();
        let wanted = PlannerConfig {
            capacity: settings.capacity,
            max_retries: settings.max_retries,
            prior_success: settings.prior_success,
            prior_conflict: settings.prior_conflict,
            ..PlannerConfig::default()
        };
        // Version 0 is the mainline when the queue was created; its record also keeps the
        // planner settings the journal was written with, so a replay makes the same decisions.
        let planner_config = match landings.get(&0) {
            Some(r) => serde_json::from_str::<LandingDoc>(&r.document)?.planner_config.unwrap_or(wanted.clone()),
            None => {
                let doc = LandingDoc {
                    how: "initial".into(),
                    landed_ms: unix_ms(),
                    planner_config: Some(wanted.clone()),
                    ..Default::default()
                };
                let row = LandingRow {
                    version: 0,
                    change_id: String::new(),
                    old_commit: head.clone(),
                    new_commit: head.clone(),
                    state: "DONE".into(),
                    document: serde_json::to_string(&doc)?,
                };
                store.put_landing(&row).await?;
                landings.insert(0, row);
                wanted.clone()
            }
        };
        if planner_config.max_retries != wanted.max_retries
            || planner_config.prior_success != wanted.prior_success
            || planner_config.prior_conflict != wanted.prior_conflict
        {
            tracing::warn!(
                "queue.max_retries and the priors are those the queue was created with; changed values are ignored"
            );
        }
        let versions = versions_of(&landings);
        let changes = store
            .list_changes()
            .await?
            .into_iter()
            .map(|r| Ok((r.id, serde_json::from_str::<ChangeDoc>(&r.document)?)))
            .collect::<Result<BTreeMap<_, _>>>()?;
        let builds = store
            .list_builds()
            .await?
            .into_iter()
            .map(|r| Ok((r.seq as u64, serde_json::from_str::<BuildDoc>(&r.document)?)))
            .collect::<Result<BTreeMap<_, _>>>()?;
        let (land_tx, land_rx) = mpsc::unbounded_channel();
        let (finished_tx, finished_rx) = mpsc::unbounded_channel();
        let capacity = settings.capacity;
        let this = Arc::new(QueueService {
            repo,
            store,
            inner: Mutex::new(Inner {
                planner: Planner::new(planner_config),
                changes,
                builds,
                tasks: HashMap::new(),
                landings,
                last_ms: 0,
            }),
            runners: std::sync::Mutex::new(runners),
            runner_slots: Arc::new(Semaphore::new(capacity)),
            aux: Mutex::new(aux),
            graphs: std::sync::Mutex::new(Graphs::default()),
            versions: watch::Sender::new(versions),
            updates: watch::Sender::new(0),
            wake_analyzer: Notify::new(),
            land_tx,
            finished_tx,
            background: std::sync::Mutex::new(Vec::new()),
            stopping: AtomicBool::new(false),
            metrics: QueueMetrics::new(registry)?,
            settings,
        });
        this.replay().await?;
        let tasks = vec![
            spawn_named("queue-lander", this.clone().lander(land_rx)),
            spawn_named("queue-events", this.clone().event_loop(finished_rx)),
            spawn_named("queue-analyzer", this.clone().analyzer_loop()),
            spawn_named("queue-metrics", this.clone().metrics_loop()),
        ];
        *this.background.lock().expect("not poisoned") = tasks;
        Ok(this)
    }

    /// Stops the background tasks and every build (their Bazel processes are killed).
    pub async fn shutdown(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Wake the watchers: they end their streams, so the server can drain.
        self.updates.send_modify(|n| *n += 1);
        self.background.lock().expect("not poisoned").clear();
        self.inner.lock().await.tasks.clear();
        let runners: Vec<Runner> = std::mem::take(&mut *self.runners.lock().expect("not poisoned"));
        let aux = self.aux.lock().await;
        futures::future::join_all(runners.iter().chain(std::iter::once(&*aux)).map(|r| r.shutdown())).await;
    }

    /// Keeps the metrics in step with the queue: one refresh per batch of updates.
    async fn metrics_loop(self: Arc<Self>) {
        let mut updates = self.updates.subscribe();
        loop {
            {
                let inner = self.inner.lock().await;
                let failed = inner.landings.values().filter(|r| r.state == "FAILED").count() as u64;
                let running = inner.planner.running_count();
                self.metrics.refresh(inner.planner.stats(), running, failed, inner.changes.values());
            }
            if updates.changed().await.is_err() {
                return;
            }
        }
    }

    async fn replay(self: &Arc<Self>) -> Result<()> {
        let events = self.store.list_events().await?;
        let mut inner = self.inner.lock().await;
        for row in &events {
            let event: Event = serde_json::from_str(&row.event)?;
            if let Event::Enqueue { change, .. } = &event
                && let Some(doc) = inner.changes.get_mut(&change.0)
                && doc.state == ChangeState::Submitted
            {
                // Enqueued, but the crash came before the document said so.
                doc.state = ChangeState::Pending;
            }
            inner.last_ms = inner.last_ms.max(row.at_ms as u64);
            match inner.planner.handle(Millis(row.at_ms as u64), event) {
                Ok(actions) => self.execute(&mut inner, actions, true).await,
                Err(e) => {
                    tracing::warn!(seq = row.seq, error = %e, "journal event refused on replay, as it was when applied")
                }
            }
        }
        // Before any build restarts: a landing failure it missed may cancel some.
        self.reconcile_landings(&mut inner).await?;
        // Builds the planner still counts as running died with the previous process.
        let running: BTreeSet<u64> = inner.planner.running_builds().iter().map(|b| b.id.0).collect();
        for (id, doc) in inner.builds.iter_mut() {
            if doc.state == "RUNNING" && !running.contains(id) {
                doc.state = "CANCELLED".into();
                self.store.put_build(&doc_row(&id.to_string(), *id as i64, &doc.state, doc)?).await?;
            }
        }
        for spec in inner.planner.running_builds() {
            if inner.tasks.contains_key(&spec.id.0) {
                continue; // started just now, by the reconciliation
            }
            tracing::info!(build = %spec.id, change = %spec.change, "restarting a build interrupted by the restart");
            let guard = spawn_named("queue-build", self.clone().run_build(spec.clone()));
            inner.tasks.insert(spec.id.0, guard);
        }
        let capacity = self.settings.capacity;
        if inner.planner.config().capacity != capacity {
            self.apply(&mut inner, Event::SetCapacity { capacity }, None).await?;
        }
        for doc in inner.changes.values().cloned().collect::<Vec<_>>() {
            self.store.put_change(&doc_row(&doc.id, doc.seq, doc.state.name(), &doc)?).await?;
        }
        if !events.is_empty() {
            tracing::info!(
                events = events.len(),
                pending = inner.planner.pending().len(),
                "submit queue resumed from its journal"
            );
        }
        self.wake_analyzer.notify_one();
        Ok(())
    }

    /// Journals an event, feeds it to the planner and carries out the actions.
    async fn apply(self: &Arc<Self>, inner: &mut Inner, event: Event, dedup: Option<String>) -> Result<()> {
        let now = inner.tick();
        let text = serde_json::to_string(&event)?;
        if !self.store.append_event(now as i64, dedup.as_deref(), &text).await? {
            return Ok(());
        }
        let actions = inner.planner.handle(Millis(now), event)?;
        self.execute(inner, actions, false).await;
        self.updates.send_modify(|n| *n += 1);
        Ok(())
    }

    /// Carries out planner actions. Idempotent, so a replay can run them again; on
    /// replay builds are only recorded (the survivors are restarted afterwards).
    async fn execute(self: &Arc<Self>, inner: &mut Inner, actions: Vec<Action>, replay: bool) {
        for action in actions {
            if let Err(e) = self.execute_one(inner, action, replay).await {
                tracing::error!(error = %e, "carrying out a queue action");
            }
        }
    }

    async fn execute_one(self: &Arc<Self>, inner: &mut Inner, action: Action, replay: bool) -> Result<()> {
        match action {
            Action::StartBuild { build } => {
                let id = build.id.0;
                if !inner.builds.contains_key(&id) {
                    let doc = BuildDoc {
                        spec: build.clone(),
                        state: "RUNNING".into(),
                        commit: String::new(),
                        targets: Vec::new(),
                        started_ms: inner.last_ms as i64,
                        finished_ms: None,
                        message: String::new(),
                    };
                    self.store.put_build(&doc_row(&id.to_string(), id as i64, "RUNNING", &doc)?).await?;
                    inner.builds.insert(id, doc);
                }
                if !replay {
                    inner.tasks.insert(id, spawn_named("queue-build", self.clone().run_build(build)));
                }
            }
            Action::CancelBuild { id } => {
                inner.tasks.remove(&id.0);
                let now = inner.last_ms as i64;
                if let Some(doc) = inner.builds.get_mut(&id.0)
                    && doc.state == "RUNNING"
                {
                    doc.state = "CANCELLED".into();
                    doc.finished_ms = Some(now);
                    self.store.put_build(&doc_row(&id.0.to_string(), id.0 as i64, "CANCELLED", doc)?).await?;
                }
            }
            Action::Land { change, proof } => {
                // The lander records and reconciles; it skips versions already done.
                let _ = self.land_tx.send((change, proof));
            }
            Action::Reject { change, reason } => {
                let build = inner.builds.get(&reason.build.id.0);
                let why = build.map(|b| b.message.clone()).unwrap_or_default();
                let on = if reason.build.assumed.is_empty() {
                    format!("mainline version {}", reason.build.base_version)
                } else {
                    let assumed: Vec<&str> = reason.build.assumed.iter().map(|c| c.0.as_str()).collect();
                    format!("mainline version {} + {}", reason.build.base_version, assumed.join(" + "))
                };
                let now = inner.last_ms as i64;
                if let Some(doc) = inner.changes.get_mut(&change.0)
                    && !doc.state.decided()
                {
                    doc.state = ChangeState::Rejected;
                    doc.reason = format!("build {} on {on} failed {} time(s): {why}", reason.build.id, reason.attempts);
                    doc.decided_ms = Some(now);
                    self.store.put_change(&doc_row(&doc.id, doc.seq, doc.state.name(), doc)?).await?;
                }
            }
        }
        Ok(())
    }

    // ---- builds -------------------------------------------------------------------

    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Counts and logs an infrastructure error, and says how long to wait before the
    /// next try.
    fn infra_retry(&self, what: &str, retry: u32, why: &str) -> Duration {
        let wait = infra_backoff(retry);
        self.metrics.infra_retries.inc();
        tracing::warn!(
            what,
            retry = retry + 1,
            wait_s = wait.as_secs(),
            reason = why,
            "infrastructure error: trying again, not judging the change on it"
        );
        wait
    }

    /// Runs a build until it has a result for the planner. An infrastructure error is
    /// never a result: the build is tried again after a backoff, with the reason in its
    /// document meanwhile, until it gets one or is cancelled (the task is dropped).
    async fn run_build(self: Arc<Self>, spec: BuildSpec) {
        let id = spec.id.0;
        let mut retry = 0;
        let finished = loop {
            match self.build(&spec).await {
                Attempt::Done(f) => break f,
                Attempt::Stopping => return,
                Attempt::Infra(_) if self.stopping() => return,
                Attempt::Infra(why) => {
                    let wait = self.infra_retry(&format!("build {} of {}", spec.id, spec.change), retry, &why);
                    retry += 1;
                    let note = format!("infrastructure error, try {} in {} s: {why}", retry + 1, wait.as_secs());
                    if let Err(e) = self.note_build(id, note).await {
                        tracing::error!(build = %spec.id, error = %e, "recording a build's infrastructure error");
                    }
                    tokio::time::sleep(wait).await;
                }
            }
        };
        if self.stopping() {
            return;
        }
        tracing::info!(build = %spec.id, change = %spec.change, outcome = ?finished.outcome, commit = short(&finished.commit), "queue build finished");
        let _ = self.finished_tx.send(finished);
    }

    /// Sets the message of a running build (shown by `gantry queue status`).
    async fn note_build(&self, id: u64, message: String) -> Result<()> {
        let mut inner = self.inner.lock().await;
        let Some(doc) = inner.builds.get_mut(&id) else { return Ok(()) };
        if doc.state != "RUNNING" {
            return Ok(());
        }
        doc.message = message;
        self.store.put_build(&doc_row(&id.to_string(), id as i64, &doc.state, doc)?).await?;
        drop(inner);
        self.updates.send_modify(|n| *n += 1);
        Ok(())
    }

    /// The changes of a build, in order: assumed ones, then the change itself.
    async fn patches(&self, spec: &BuildSpec) -> Result<Vec<ChangeDoc>, String> {
        let inner = self.inner.lock().await;
        spec.assumed
            .iter()
            .chain(std::iter::once(&spec.change))
            .map(|c| inner.changes.get(&c.0).cloned().ok_or_else(|| format!("unknown change {c}")))
            .collect()
    }

    /// What the build steps test for these changes: the union of their affected rules,
    /// or everything when one alters the graph (or could not be analysed).
    fn targets_of(docs: &[ChangeDoc]) -> Vec<String> {
        if docs.iter().any(|d| d.full_build) {
            return vec!["//...".into()];
        }
        let set: BTreeSet<String> = docs.iter().flat_map(|d| d.test_targets.iter().cloned()).collect();
        if set.is_empty() {
            vec!["//...".into()]
        } else {
            set.into_iter().collect()
        }
    }

    /// One try of a build: the tree made with git, then the build steps in it.
    async fn build(self: &Arc<Self>, spec: &BuildSpec) -> Attempt {
        let Ok(permit) = self.runner_slots.clone().acquire_owned().await else { return Attempt::Stopping };
        // A permit always finds a runner, except once `shutdown` has taken them all.
        let Some(runner) = self.runners.lock().expect("not poisoned").pop() else { return Attempt::Stopping };
        let lease = Lease { service: self.clone(), runner: Some(runner), _permit: permit };
        let base = {
            let mut rx = self.versions.subscribe();
            let Ok(v) = rx.wait_for(|v| v.len() as u64 > spec.base_version).await else { return Attempt::Stopping };
            v[spec.base_version as usize].clone()
        };
        let id = spec.id.0;
        let done =
            move |outcome, commit, targets, message| Attempt::Done(Finished { id, outcome, commit, targets, message });
        let docs = match self.patches(spec).await {
            Ok(d) => d,
            Err(message) => return done(BuildOutcome::Failed, String::new(), vec![], message),
        };
        let targets = Self::targets_of(&docs);
        let (repo, t) = (self.repo.clone(), targets.clone());
        // The lease travels with the git work: if this task is cancelled meanwhile, the
        // runner only returns to the pool once git is done with its worktree.
        let joined = tokio::task::spawn_blocking(move || {
            let made = (|| {
                let mut commit = base;
                for d in &docs {
                    // A patch that does not apply is the change's doing: a failure,
                    // and a conclusive one (the same tree never applies on a retry).
                    commit = repo
                        .apply(&d.patch(), &commit)
                        .map_err(|message| done(BuildOutcome::FailedConclusively, String::new(), t.clone(), message))?;
                }
                let tree = gantry_builds::workspace::checkout(&repo.path, &commit, lease.runner().dir())
                    .map_err(|e| Attempt::Infra(format!("checking out {}: {e}", short(&commit))))?;
                Ok((commit, tree))
            })();
            (lease, made)
        })
        .await;
        let (lease, made) = match joined {
            Ok(x) => x,
            Err(e) => return Attempt::Infra(format!("git task: {e}")),
        };
        let (commit, tree) = match made {
            Ok(x) => x,
            Err(ended) => return ended,
        };
        match self.run_steps(lease.runner(), &tree, &targets).await {
            Verdict::Passed => done(BuildOutcome::Passed, commit, targets, String::new()),
            Verdict::Failed(message) => done(BuildOutcome::Failed, commit, targets, message),
            Verdict::Infra(why) => Attempt::Infra(why),
        }
    }

    /// The build steps in a checked-out tree: `[queue] build_command`, or `bazel test`
    /// of the targets.
    async fn run_steps(&self, runner: &Runner, tree: &std::path::Path, targets: &[String]) -> Verdict {
        if !self.settings.build_command.is_empty() {
            return run_build_command(&self.settings.build_command, tree, self.settings.runner.deadline).await;
        }
        let spec = RunSpec {
            workspace: tree.to_path_buf(),
            command: "test".into(),
            flags: vec![],
            targets: targets.to_vec(),
            invocation_id: uuid::Uuid::new_v4().to_string(),
        };
        Verdict::of_bazel(&runner.run(&spec).await)
    }

    async fn event_loop(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<Finished>) {
        while let Some(f) = rx.recv().await {
            if let Err(e) = self.on_finished(f).await {
                tracing::error!(error = %e, "recording a queue build result");
            }
        }
    }

    async fn on_finished(self: &Arc<Self>, f: Finished) -> Result<()> {
        let mut inner = self.inner.lock().await;
        inner.tasks.remove(&f.id);
        let now = inner.tick() as i64;
        let Some(doc) = inner.builds.get_mut(&f.id) else { return Ok(()) };
        if doc.state != "RUNNING" {
            return Ok(()); // cancelled while it finished
        }
        doc.state = if f.outcome == BuildOutcome::Passed { "PASSED" } else { "FAILED" }.into();
        doc.commit = f.commit;
        doc.targets = f.targets;
        doc.message = f.message;
        doc.finished_ms = Some(now);
        self.store.put_build(&doc_row(&f.id.to_string(), f.id as i64, &doc.state, doc)?).await?;
        let build = gantry_queue::BuildId(f.id);
        self.apply(&mut inner, Event::BuildFinished { build, outcome: f.outcome }, Some(format!("finished:{}", f.id)))
            .await
    }

    // ---- landing ------------------------------------------------------------------

    async fn lander(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<(ChangeId, LandProof)>) {
        while let Some((change, proof)) = rx.recv().await {
            if let Err(e) = self.land(&change, &proof).await {
                tracing::error!(change = %change, error = %e, "landing failed");
            }
            self.updates.send_modify(|n| *n += 1);
        }
    }

    async fn land(self: &Arc<Self>, change: &ChangeId, proof: &LandProof) -> Result<()> {
        let version = proof.new_version;
        let (existing, doc, build) = {
            let inner = self.inner.lock().await;
            let doc = inner.changes.get(&change.0).cloned().ok_or_else(|| SubmitError::NotFound(change.0.clone()))?;
            let build = inner.builds.get(&proof.build.id.0).cloned();
            (inner.landings.get(&version).cloned(), doc, build)
        };
        let repo = self.repo.clone();
        let row = match existing {
            Some(r) if r.state == "DONE" || r.state == "FAILED" => return Ok(()),
            Some(intent) => {
                // Crashed between recording the intent and recording the result.
                let (old, new) = (intent.old_commit.clone(), intent.new_commit.clone());
                let head = blocking(move || repo.head()).await.map_err(SubmitError::Git)?;
                if head == old {
                    let repo = self.repo.clone();
                    let (o, n) = (old.clone(), new.clone());
                    blocking(move || repo.move_mainline(&o, &n)).await.map_err(SubmitError::Git)?;
                } else if head != new {
                    return self
                        .finish_landing(
                            intent,
                            "FAILED",
                            format!("the mainline moved outside the queue (to {})", short(&head)),
                            &doc,
                        )
                        .await;
                }
                intent
            }
            None => {
                let old = self.versions.borrow().get(version as usize - 1).cloned().ok_or_else(|| {
                    SubmitError::FailedPrecondition(format!("landing version {version} before version {}", version - 1))
                })?;
                let mut landing_doc =
                    LandingDoc { build_id: proof.build.id.0, landed_ms: unix_ms(), ..Default::default() };
                let mut row = LandingRow {
                    version: version as i64,
                    change_id: change.0.clone(),
                    old_commit: old.clone(),
                    new_commit: old.clone(),
                    state: "INTENT".into(),
                    document: String::new(),
                };
                let tested = build.map(|b| b.commit).unwrap_or_default();
                match self.landing_commit(&doc, &old, &tested).await {
                    Move::To { commit, how } => {
                        row.new_commit = commit;
                        landing_doc.how = how;
                    }
                    Move::Refuse(why) => {
                        row.document = serde_json::to_string(&landing_doc)?;
                        return self.finish_landing(row, "FAILED", why, &doc).await;
                    }
                    // Nothing is recorded yet; the journal's replay emits this Land again.
                    Move::Stopping => return Ok(()),
                }
                row.document = serde_json::to_string(&landing_doc)?;
                self.store.put_landing(&row).await?;
                let (o, n) = (old.clone(), row.new_commit.clone());
                if let Err(e) = blocking(move || repo.move_mainline(&o, &n)).await {
                    return self
                        .finish_landing(row, "FAILED", format!("moving {}: {e}", self.settings.mainline), &doc)
                        .await;
                }
                row
            }
        };
        self.finish_landing(row, "DONE", String::new(), &doc).await
    }

    /// The commit the mainline moves to when `doc` lands on `old`, given the commit its
    /// deciding build tested: that very commit when its parent is `old`; a commit with
    /// its tree when its parent has `old`'s tree; otherwise (independent changes landed
    /// since the build's base) the change applied on `old`, which must pass the build
    /// steps first: the combined-tree check. An infrastructure error in that check is
    /// not a verdict on the change; it is tried again after a backoff.
    async fn landing_commit(self: &Arc<Self>, doc: &ChangeDoc, old: &str, tested: &str) -> Move {
        if tested.is_empty() {
            return Move::Refuse("the deciding build left no commit".into());
        }
        let (repo, o, t, like) = (self.repo.clone(), old.to_string(), tested.to_string(), doc.commit.clone());
        let quick = blocking(move || {
            let parent = repo.parent(&t)?;
            if parent == o {
                return Ok(Some((t, "fast-forward".to_string())));
            }
            if repo.tree(&parent)? == repo.tree(&o)? {
                let c = repo.commit_like(&like, &repo.tree(&t)?, &o)?;
                return Ok(Some((c, "same-tree".to_string())));
            }
            Ok(None)
        })
        .await;
        match quick {
            Ok(Some((commit, how))) => return Move::To { commit, how },
            Ok(None) => {}
            Err(why) => return Move::Refuse(why),
        }
        let (repo, o, patch) = (self.repo.clone(), old.to_string(), doc.patch());
        let candidate = match blocking(move || repo.apply(&patch, &o)).await {
            Ok(c) => c,
            Err(why) => return Move::Refuse(why),
        };
        let targets = Self::targets_of(std::slice::from_ref(doc));
        let mut retry = 0;
        loop {
            let verdict = {
                // Held for one try only: the analyzer shares this runner.
                let aux = self.aux.lock().await;
                let (repo, c, dir) = (self.repo.clone(), candidate.clone(), aux.dir().to_path_buf());
                match blocking(move || gantry_builds::workspace::checkout(&repo.path, &c, &dir)).await {
                    Ok(tree) => self.run_steps(&aux, &tree, &targets).await,
                    Err(e) => Verdict::Infra(format!("checking out {}: {e}", short(&candidate))),
                }
            };
            match verdict {
                Verdict::Passed => return Move::To { commit: candidate, how: "verified".into() },
                Verdict::Failed(message) => {
                    return Move::Refuse(format!(
                        "the combined-tree check failed: {} on the mainline with the independent changes landed since its build ({}) failed the build steps: {message}",
                        doc.id,
                        short(&candidate)
                    ))
                }
                Verdict::Infra(_) if self.stopping() => return Move::Stopping,
                Verdict::Infra(why) => {
                    let wait = self.infra_retry(&format!("combined-tree check of {}", doc.id), retry, &why);
                    retry += 1;
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    async fn finish_landing(
        self: &Arc<Self>,
        mut row: LandingRow,
        state: &str,
        why: String,
        doc: &ChangeDoc,
    ) -> Result<()> {
        row.state = state.into();
        if state == "FAILED" {
            row.new_commit = row.old_commit.clone();
            let mut d: LandingDoc = serde_json::from_str(&row.document).unwrap_or_default();
            d.message = why.clone();
            row.document = serde_json::to_string(&d)?;
            tracing::warn!(change = %doc.id, reason = %why, "mainline not moved");
        }
        self.store.put_landing(&row).await?;
        let mut inner = self.inner.lock().await;
        inner.landings.insert(row.version as u64, row.clone());
        self.versions.send_replace(versions_of(&inner.landings));
        self.record_landing_in_change(&mut inner, &row, &why).await?;
        tracing::info!(change = %doc.id, version = row.version, commit = short(&row.new_commit), state, "landing recorded");
        if state == "FAILED" {
            // The planner counted the change as landed when it said Land; it must now
            // re-plan the changes behind it. A crash before this point is caught up at
            // the next start (`reconcile_landings`).
            self.planner_landing_failed(&mut inner, &row).await?;
        }
        Ok(())
    }

    /// The change document of a finished landing: LANDED with its commit, or REJECTED
    /// with why the mainline did not move. Idempotent.
    async fn record_landing_in_change(&self, inner: &mut Inner, row: &LandingRow, why: &str) -> Result<()> {
        let now = inner.tick() as i64;
        let Some(c) = inner.changes.get_mut(&row.change_id) else { return Ok(()) };
        match row.state.as_str() {
            "DONE" if c.state != ChangeState::Landed => {
                c.state = ChangeState::Landed;
                c.landed_commit = row.new_commit.clone();
                c.landed_version = row.version as u64;
            }
            "FAILED" if c.state != ChangeState::Rejected => {
                c.state = ChangeState::Rejected;
                c.reason = format!("passed its build but the mainline did not move: {why}");
            }
            _ => return Ok(()),
        }
        c.decided_ms.get_or_insert(now);
        self.store.put_change(&doc_row(&c.id, c.seq, c.state.name(), c)?).await?;
        Ok(())
    }

    /// Tells the planner that a landing failed, once (journaled under the version).
    async fn planner_landing_failed(self: &Arc<Self>, inner: &mut Inner, row: &LandingRow) -> Result<()> {
        let change = ChangeId(row.change_id.clone());
        // Only a change the planner still counts as landed: the journal may already
        // hold the event (then the replay applied it), and the planner refuses it twice.
        if !inner.planner.is_landed(&change) {
            return Ok(());
        }
        tracing::info!(change = %change, version = row.version, "landing failed: the planner drops the change and re-plans");
        self.apply(inner, Event::LandingFailed { change }, Some(format!("landing-failed:{}", row.version))).await
    }

    /// After the replay: landings recorded as finished whose effects a crash cut short.
    /// The landing row is written first, then the change document, then (for FAILED) the
    /// planner event, and the lander skips finished versions, so this is the only place
    /// left to complete them.
    async fn reconcile_landings(self: &Arc<Self>, inner: &mut Inner) -> Result<()> {
        let finished: Vec<LandingRow> = inner
            .landings
            .values()
            .filter(|r| r.version > 0 && (r.state == "DONE" || r.state == "FAILED"))
            .cloned()
            .collect();
        for row in finished {
            let why = serde_json::from_str::<LandingDoc>(&row.document).map(|d| d.message).unwrap_or_default();
            self.record_landing_in_change(inner, &row, &why).await?;
            if row.state == "FAILED" {
                self.planner_landing_failed(inner, &row).await?;
            }
        }
        Ok(())
    }

    // ---- analysis -----------------------------------------------------------------

    async fn analyzer_loop(self: Arc<Self>) {
        loop {
            let next = {
                let inner = self.inner.lock().await;
                inner
                    .changes
                    .values()
                    .filter(|c| c.state == ChangeState::Submitted)
                    .min_by_key(|c| (-c.priority, c.seq))
                    .cloned()
            };
            match next {
                None => self.wake_analyzer.notified().await,
                Some(doc) => {
                    if let Err(e) = self.analyze_and_enqueue(doc).await {
                        tracing::error!(error = %e, "enqueueing a change");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        }
    }

    async fn analyze_and_enqueue(self: &Arc<Self>, mut doc: ChangeDoc) -> Result<()> {
        let head = self.versions.borrow().last().cloned().expect("version 0 exists");
        let (repo, patch, h) = (self.repo.clone(), doc.patch(), head.clone());
        let applied = blocking(move || {
            let (files, lines) = repo.diff_size(&patch)?;
            let paths = repo.changed_paths(&patch)?;
            let author = repo.author(&patch.head)?;
            Ok((repo.apply(&patch, &h), files, lines, paths, author))
        })
        .await
        .map_err(SubmitError::Git)?;
        let (applied, files, lines, paths, author) = applied;
        let inner_doc_update = |inner: &mut Inner, doc: &ChangeDoc| {
            if let Some(c) = inner.changes.get_mut(&doc.id) {
                *c = doc.clone();
            }
        };
        let speculative = match applied {
            Ok(c) => c,
            Err(why) => {
                let mut inner = self.inner.lock().await;
                if inner.changes.get(&doc.id).is_some_and(|c| c.state != ChangeState::Submitted) {
                    return Ok(());
                }
                doc.state = ChangeState::Rejected;
                doc.reason = format!("patch does not apply: {why}");
                doc.decided_ms = Some(inner.tick() as i64);
                self.store.put_change(&doc_row(&doc.id, doc.seq, doc.state.name(), &doc)?).await?;
                inner_doc_update(&mut inner, &doc);
                self.updates.send_modify(|n| *n += 1);
                return Ok(());
            }
        };
        let analysis = match self.analyze(&head, &speculative).await {
            Ok(mut a) => {
                a.alters_graph |= analyzer::touches_build_definitions(&paths);
                Some(a)
            }
            Err(e) => {
                tracing::warn!(change = %doc.id, error = %e, "conflict analysis failed; the change is treated as dependent on all others");
                doc.reason = format!("conflict analysis failed: {e}");
                None
            }
        };
        let change_graph = self.graph_of(&speculative);
        doc.author = author.clone();
        match &analysis {
            Some(a) => {
                doc.affected = a.affected.iter().cloned().collect();
                doc.alters_graph = a.alters_graph;
                doc.full_build = a.alters_graph;
                doc.test_targets = a
                    .affected
                    .iter()
                    .filter(|l| change_graph.as_ref().and_then(|g| g.targets.get(*l)).is_some_and(analyzer::is_rule))
                    .cloned()
                    .collect();
            }
            None => doc.full_build = true,
        }
        let features = ChangeFeatures {
            files_changed: files,
            lines_changed: lines,
            affected_targets: doc.affected.len() as u32,
            author,
            presubmit_passed: true,
        };
        let mut inner = self.inner.lock().await;
        if inner.changes.get(&doc.id).is_some_and(|c| c.state != ChangeState::Submitted) {
            return Ok(()); // cancelled while being analysed
        }
        doc.state = ChangeState::Pending;
        let event = Event::Enqueue { change: ChangeId(doc.id.clone()), features, analysis };
        self.apply(&mut inner, event, Some(format!("enqueue:{}", doc.id))).await?;
        self.store.put_change(&doc_row(&doc.id, doc.seq, doc.state.name(), &doc)?).await?;
        inner_doc_update(&mut inner, &doc);
        tracing::info!(change = %doc.id, affected = doc.affected.len(), alters_graph = doc.alters_graph, "change enqueued");
        Ok(())
    }

    fn graph_of(&self, commit: &str) -> Option<TargetGraph> {
        self.graphs.lock().expect("not poisoned").graph(commit).map(|g| (*g).clone())
    }

    /// Affected targets of `change` against `base`, from graphs cached per commit.
    async fn analyze(&self, base: &str, change: &str) -> Result<ChangeAnalysis, String> {
        let aux = self.aux.lock().await;
        for commit in [base, change] {
            if self.graphs.lock().expect("not poisoned").graph(commit).is_some() {
                continue;
            }
            let graph = match self.store.get_graph(commit).await.map_err(|e| e.to_string())? {
                Some(text) => serde_json::from_str(&text).map_err(|e| format!("cached graph of {commit}: {e}"))?,
                None => {
                    let g = self.query_graph(&aux, commit).await?;
                    let text = serde_json::to_string(&g).map_err(|e| e.to_string())?;
                    self.store.put_graph(commit, &text).await.map_err(|e| e.to_string())?;
                    g
                }
            };
            self.graphs.lock().expect("not poisoned").add(commit, graph);
        }
        let a = self.graphs.lock().expect("not poisoned").analyzer.analyze(base, change).map_err(|e| e.to_string())?;
        Ok((*a).clone())
    }

    /// `bazel query 'deps(//...)'` at a commit, in the aux runner's worktree.
    async fn query_graph(&self, aux: &Runner, commit: &str) -> Result<TargetGraph, String> {
        let (repo, c, dir) = (self.repo.clone(), commit.to_string(), aux.dir().to_path_buf());
        let (tree, files) = blocking(move || {
            let tree = gantry_builds::workspace::checkout(&repo.path, &c, &dir)?;
            Ok((tree, repo.file_digests(&c)?))
        })
        .await?;
        let s = &self.settings.runner;
        let mut cmd = tokio::process::Command::new(&s.bazel);
        cmd.args(aux.startup_args())
            .args(["query", "--output=xml", "--noimplicit_deps"])
            .args(analyzer::query_flags(&s.extra_flags))
            .args(["--", "deps(//...)"])
            .current_dir(&tree)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        let out = tokio::time::timeout(s.deadline, cmd.output())
            .await
            .map_err(|_| format!("bazel query at {} passed the deadline", short(commit)))?
            .map_err(|e| format!("starting {}: {e}", s.bazel.display()))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let line = stderr.lines().rev().find(|l| l.starts_with("ERROR")).unwrap_or("no ERROR line");
            return Err(format!("bazel query at {} exited with {}: {line}", short(commit), out.status));
        }
        analyzer::parse_query_xml(&String::from_utf8_lossy(&out.stdout), &files)
    }

    // ---- API ----------------------------------------------------------------------

    pub async fn submit(self: &Arc<Self>, change_ref: &str, priority: i32) -> Result<pb::Change> {
        let (repo, r) = (self.repo.clone(), change_ref.to_string());
        let (commit, merge_base) = blocking(move || repo.resolve(&r)).await.map_err(SubmitError::InvalidArgument)?;
        let mut inner = self.inner.lock().await;
        let seq = inner.changes.values().map(|c| c.seq).max().unwrap_or(0) + 1;
        let doc = ChangeDoc {
            id: format!("c{seq}"),
            seq,
            change_ref: change_ref.to_string(),
            commit,
            merge_base,
            priority,
            author: String::new(),
            state: ChangeState::Submitted,
            reason: String::new(),
            submitted_ms: inner.tick() as i64,
            decided_ms: None,
            landed_commit: String::new(),
            landed_version: 0,
            affected: vec![],
            test_targets: vec![],
            alters_graph: false,
            full_build: false,
        };
        // Durable before the caller hears of it: a submitted change is never lost.
        self.store.put_change(&doc_row(&doc.id, seq, doc.state.name(), &doc)?).await?;
        inner.changes.insert(doc.id.clone(), doc.clone());
        drop(inner);
        self.wake_analyzer.notify_one();
        self.updates.send_modify(|n| *n += 1);
        tracing::info!(change = %doc.id, change_ref, "change submitted");
        self.change(&doc.id).await
    }

    pub async fn cancel(self: &Arc<Self>, id: &str) -> Result<pb::Change> {
        let mut inner = self.inner.lock().await;
        let doc = inner
            .changes
            .get(id)
            .cloned()
            .ok_or_else(|| SubmitError::NotFound(format!("change_id {id}: no such change")))?;
        match doc.state {
            ChangeState::Submitted => {}
            ChangeState::Pending => {
                let change = ChangeId(id.to_string());
                // The planner decided to land it and the lander is moving the mainline:
                // the change is no longer the developer's to withdraw.
                if !inner.planner.is_pending(&change) {
                    return Err(SubmitError::FailedPrecondition(format!("change_id {id}: already being landed")));
                }
                self.apply(&mut inner, Event::Cancel { change }, Some(format!("cancel:{id}"))).await?;
            }
            s => return Err(SubmitError::FailedPrecondition(format!("change_id {id}: already {}", s.name()))),
        }
        let now = inner.tick() as i64;
        let c = inner.changes.get_mut(id).expect("checked above");
        c.state = ChangeState::Cancelled;
        c.reason = "cancelled by request".into();
        c.decided_ms = Some(now);
        self.store.put_change(&doc_row(id, c.seq, c.state.name(), c)?).await?;
        drop(inner);
        self.updates.send_modify(|n| *n += 1);
        self.change(id).await
    }

    /// One change as the API shows it.
    pub async fn change(&self, id: &str) -> Result<pb::Change> {
        let inner = self.inner.lock().await;
        let doc =
            inner.changes.get(id).ok_or_else(|| SubmitError::NotFound(format!("change_id {id}: no such change")))?;
        let snapshot = if doc.state == ChangeState::Pending { inner.planner.snapshot() } else { vec![] };
        Ok(self.change_proto(&inner, doc, &snapshot))
    }

    fn change_proto(&self, inner: &Inner, doc: &ChangeDoc, snapshot: &[gantry_queue::PendingView]) -> pb::Change {
        let mut c = pb::Change {
            change_id: doc.id.clone(),
            change_ref: doc.change_ref.clone(),
            commit: doc.commit.clone(),
            merge_base: doc.merge_base.clone(),
            priority: doc.priority,
            author: doc.author.clone(),
            state: doc.state.name().into(),
            reason: doc.reason.clone(),
            affected_targets: doc.affected.clone(),
            alters_graph: doc.alters_graph,
            submitted_unix_ms: doc.submitted_ms,
            decided_unix_ms: doc.decided_ms.unwrap_or(0),
            landed_commit: doc.landed_commit.clone(),
            landed_version: doc.landed_version,
            ..Default::default()
        };
        if let Some((pos, view)) = snapshot.iter().enumerate().find(|(_, v)| v.change.0 == doc.id) {
            c.position = pos as u32 + 1;
            c.predicted_success = view.landing_probability;
            c.waits_for = view.waits_for.iter().map(|w| w.0.clone()).collect();
        }
        c.builds = inner.builds.values().filter(|b| b.spec.change.0 == doc.id).map(build_proto).collect();
        c
    }

    pub async fn status(&self) -> Result<pb::QueueStatus> {
        let inner = self.inner.lock().await;
        let snapshot = inner.planner.snapshot();
        let mut changes: Vec<pb::Change> = snapshot
            .iter()
            .filter_map(|v| inner.changes.get(&v.change.0))
            .map(|d| self.change_proto(&inner, d, &snapshot))
            .collect();
        changes.extend(
            inner
                .changes
                .values()
                .filter(|d| d.state == ChangeState::Submitted)
                .map(|d| self.change_proto(&inner, d, &snapshot)),
        );
        Ok(pb::QueueStatus {
            mainline: self.settings.mainline.clone(),
            mainline_commit: self.versions.borrow().last().cloned().unwrap_or_default(),
            capacity: self.settings.capacity as u32,
            changes,
        })
    }

    pub async fn history(&self, limit: usize) -> Result<pb::HistoryResponse> {
        let inner = self.inner.lock().await;
        let mut changes: Vec<pb::Change> =
            inner.changes.values().rev().map(|d| self.change_proto(&inner, d, &[])).collect();
        if limit > 0 {
            changes.truncate(limit);
        }
        let mainline = inner
            .landings
            .values()
            .map(|r| {
                let d: LandingDoc = serde_json::from_str(&r.document).unwrap_or_default();
                pb::MainlineMove {
                    version: r.version as u64,
                    change_id: r.change_id.clone(),
                    old_commit: r.old_commit.clone(),
                    new_commit: r.new_commit.clone(),
                    state: r.state.clone(),
                    build_id: if r.version == 0 { String::new() } else { format!("b{}", d.build_id) },
                    landed_unix_ms: d.landed_ms,
                    how: d.how,
                }
            })
            .collect();
        Ok(pb::HistoryResponse { changes, mainline })
    }

    /// The change now and after each update, until it is decided.
    pub async fn watch(
        self: &Arc<Self>,
        id: &str,
    ) -> Result<GuardedStream<tokio_stream::wrappers::ReceiverStream<Result<pb::Change, tonic::Status>>>> {
        self.change(id).await?;
        let (tx, rx) = mpsc::channel(16);
        let (this, id) = (self.clone(), id.to_string());
        let mut updates = self.updates.subscribe();
        let guard = spawn_named("queue-watch", async move {
            let mut last: Option<pb::Change> = None;
            loop {
                updates.mark_unchanged();
                if this.stopping() {
                    // An open watch would otherwise hold the server's drain until the
                    // change is decided, which may be after the restart.
                    let _ = tx
                        .send(Err(tonic::Status::unavailable("gantry is shutting down: watch again once it is back")))
                        .await;
                    return;
                }
                let c = match this.change(&id).await {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = tx.send(Err(e.into())).await;
                        return;
                    }
                };
                let decided = matches!(c.state.as_str(), "LANDED" | "REJECTED" | "CANCELLED");
                if last.as_ref() != Some(&c) {
                    if tx.send(Ok(c.clone())).await.is_err() {
                        return;
                    }
                    last = Some(c);
                }
                if decided || updates.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(GuardedStream::new(tokio_stream::wrappers::ReceiverStream::new(rx), guard))
    }
}

fn build_proto(b: &BuildDoc) -> pb::Build {
    pb::Build {
        build_id: b.spec.id.to_string(),
        change_id: b.spec.change.0.clone(),
        base_version: b.spec.base_version,
        assumed: b.spec.assumed.iter().map(|c| c.0.clone()).collect(),
        attempt: b.spec.attempt,
        state: b.state.clone(),
        commit: b.commit.clone(),
        started_unix_ms: b.started_ms,
        finished_unix_ms: b.finished_ms.unwrap_or(0),
        message: b.message.clone(),
        targets: b.targets.clone(),
    }
}

/// Commit of each mainline version, up to the first landing still in progress. A
/// landing that failed leaves the mainline where it was, so its version is that commit.
fn versions_of(landings: &BTreeMap<u64, LandingRow>) -> Vec<String> {
    let mut v = Vec::new();
    for (&version, r) in landings {
        if version != v.len() as u64 {
            break;
        }
        match r.state.as_str() {
            "DONE" => v.push(r.new_commit.clone()),
            "FAILED" => v.push(r.old_commit.clone()),
            _ => break,
        }
    }
    v
}

/// Target graphs by commit, and gantry-queue's analyzer memoising hashes and analyses
/// over them. Commits are never forgotten while gantry runs: a graph is small next to
/// the Bazel server that produced it, and the store keeps them across restarts.
#[derive(Default)]
struct Graphs {
    analyzer: ConflictAnalyzer,
    known: HashMap<String, Arc<TargetGraph>>,
}

impl Graphs {
    fn graph(&self, commit: &str) -> Option<Arc<TargetGraph>> {
        self.known.get(commit).cloned()
    }

    fn add(&mut self, commit: &str, graph: TargetGraph) {
        self.known.insert(commit.to_string(), Arc::new(graph.clone()));
        self.analyzer.add_graph(commit, graph);
    }
}

/// A runner taken from the pool; it goes back when the lease is dropped.
struct Lease {
    service: Arc<QueueService>,
    runner: Option<Runner>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Lease {
    fn runner(&self) -> &Runner {
        self.runner.as_ref().expect("held until drop")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(r) = self.runner.take() {
            self.service.runners.lock().expect("not poisoned").push(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Vec<String> {
        vec!["sh".into(), "-c".into(), script.into()]
    }

    #[test]
    fn infra_backoff_starts_quick_then_settles_at_thirty_seconds() {
        let secs: Vec<u64> = (0..6).map(|r| infra_backoff(r).as_secs()).collect();
        assert_eq!(secs, [2, 5, 15, 30, 30, 30]);
    }

    #[tokio::test]
    async fn build_command_that_cannot_start_is_infra_and_its_failures_are_the_trees() {
        let d = tempfile::tempdir().unwrap();
        let deadline = Duration::from_secs(20);
        let missing = vec![d.path().join("not-yet-there.sh").display().to_string()];
        match run_build_command(&missing, d.path(), deadline).await {
            Verdict::Infra(why) => assert!(why.contains("starting") && why.contains("not-yet-there.sh"), "{why}"),
            v => panic!("{v:?}"),
        }
        assert_eq!(run_build_command(&sh("test -d ."), d.path(), deadline).await, Verdict::Passed);
        match run_build_command(&sh("echo first >&2; echo 'the real reason' >&2; exit 3"), d.path(), deadline).await {
            Verdict::Failed(why) => assert!(why.contains("exit status: 3") && why.contains("the real reason"), "{why}"),
            v => panic!("{v:?}"),
        }
        // Running past the deadline is the tree's doing (a test that hangs), not infra.
        match run_build_command(&sh("sleep 5"), d.path(), Duration::from_millis(200)).await {
            Verdict::Failed(why) => assert!(why.contains("deadline"), "{why}"),
            v => panic!("{v:?}"),
        }
        // The command runs in the tree.
        std::fs::write(d.path().join("marker"), "").unwrap();
        assert_eq!(run_build_command(&sh("test -f marker"), d.path(), deadline).await, Verdict::Passed);
    }

    #[tokio::test]
    async fn bazel_that_cannot_run_is_infra_and_failed_tests_are_a_failure() {
        let d = tempfile::tempdir().unwrap();
        let settings = RunnerSettings {
            bazel: d.path().join("no-bazel-here"),
            startup_flags: vec![],
            extra_flags: vec![],
            heap_bytes: 256 << 20,
            deadline: Duration::from_secs(20),
            kill_grace: Duration::from_secs(1),
            gc_spiral_window: Duration::from_secs(30),
            remote_executor: "grpc://127.0.0.1:1".into(),
            credentials: Default::default(),
        };
        let runner = Runner::new(0, d.path(), Arc::new(settings)).unwrap();
        let spec = RunSpec {
            workspace: d.path().to_path_buf(),
            command: "test".into(),
            flags: vec![],
            targets: vec!["//...".into()],
            invocation_id: uuid::Uuid::new_v4().to_string(),
        };
        match Verdict::of_bazel(&runner.run(&spec).await) {
            Verdict::Infra(why) => assert!(why.starts_with("INFRA_ERROR") && why.contains("no-bazel-here"), "{why}"),
            v => panic!("{v:?}"),
        }
        let failed = RunReport {
            outcome: gantry_builds::BuildOutcome::TestsFailed,
            oom_signal: None,
            exit_code: Some(3),
            bep: Default::default(),
            server_vm_hwm: None,
            wall_seconds: 1.0,
            message: "//p:t failed".into(),
        };
        assert_eq!(Verdict::of_bazel(&failed), Verdict::Failed("TESTS_FAILED: //p:t failed".into()));
        let passed = RunReport { outcome: gantry_builds::BuildOutcome::Success, message: String::new(), ..failed };
        assert_eq!(Verdict::of_bazel(&passed), Verdict::Passed);
    }
}
