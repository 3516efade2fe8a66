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
//!
//! A fourth, `retention`, keeps the journal short (a snapshot of the planner every
//! `[retention] queue_journal` entries, and the entries before it deleted) and the
//! history within `[retention.queue]`.
//!
//! Each of those has its own module (`journal` with the stored documents, `builds`,
//! `lander`, `analysis`, `retention`), as `impl QueueService` blocks over the state declared here,
//! so the invariants above can be read one at a time; this module keeps the state, start
//! and shutdown, and the API.

mod analysis;
mod builds;
mod journal;
mod lander;
mod retention;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use gantry_builds::runner::{Runner, RunnerSettings};
use gantry_core::task::{spawn_named, GuardedStream, TaskGuard};
use gantry_core::{LandingRow, QueueStore};
use gantry_proto::queue::v1 as pb;
use gantry_queue::{ChangeId, Event, LandProof, Planner, PlannerConfig};
use tokio::sync::{mpsc, watch, Mutex, Notify, Semaphore};

use self::analysis::Graphs;
use self::builds::Finished;
use self::journal::{doc_row, versions_of, LandingDoc, Versions};
use crate::error::SubmitError;
use crate::git::{GitError, Repo};
use crate::metrics::QueueMetrics;

pub use self::journal::{BuildDoc, BuildState, ChangeDoc, ChangeState, LandingState, UnknownState};
pub use self::retention::{QueueRetention, Retained};

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
    /// `[queue] batching`.
    pub batching: bool,
    /// `[queue] learn_alone`.
    pub learn_alone: bool,
    /// `[retention]` as the queue applies it.
    pub retention: QueueRetention,
}

struct Inner {
    planner: Planner,
    changes: BTreeMap<String, ChangeDoc>,
    builds: BTreeMap<u64, BuildDoc>,
    /// Running build tasks; dropping one stops its Bazel.
    tasks: HashMap<u64, TaskGuard>,
    landings: BTreeMap<u64, LandingRow>,
    last_ms: u64,
    /// The journal entry the newest snapshot of the planner covers (0: none).
    snapshot_seq: i64,
    /// Failed landings whose rows retention deleted, so the metric's count goes on.
    forgotten_landing_failures: u64,
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
    /// The commit of every mainline version remembered, by version.
    versions: watch::Sender<Versions>,
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

/// Runs blocking work (git) off the async threads. The task's own failure (a panic) comes
/// back as an error of the work's own type, so callers handle it like any other.
async fn blocking<T, E>(f: impl FnOnce() -> Result<T, E> + Send + 'static) -> Result<T, E>
where
    T: Send + 'static,
    E: TaskFailed + Send + 'static,
{
    tokio::task::spawn_blocking(f).await.map_err(E::task_failed)?
}

/// An error type that can report a blocking task that did not finish.
trait TaskFailed {
    fn task_failed(e: tokio::task::JoinError) -> Self;
}

impl TaskFailed for String {
    fn task_failed(e: tokio::task::JoinError) -> String {
        format!("git task: {e}")
    }
}

impl TaskFailed for GitError {
    fn task_failed(e: tokio::task::JoinError) -> GitError {
        GitError::Task(e.to_string())
    }
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
            batching: settings.batching,
            learn_alone: settings.learn_alone,
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
                    state: LandingState::Done.as_str().into(),
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
            || planner_config.batching != wanted.batching
        {
            tracing::warn!(
                "queue.max_retries, queue.batching and the priors are those the queue was created with; changed values are ignored"
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
        // The planner resumes from its newest snapshot, if retention took one; the
        // replay then applies only the journal after it.
        let snapshot = store.latest_snapshot().await?;
        let planner = match &snapshot {
            Some(s) => Planner::restore_state(&s.state).map_err(|e| {
                SubmitError::FailedPrecondition(format!("the queue's snapshot at journal entry {}: {e}", s.seq))
            })?,
            None => Planner::new(planner_config),
        };
        let (land_tx, land_rx) = mpsc::unbounded_channel();
        let (finished_tx, finished_rx) = mpsc::unbounded_channel();
        let capacity = settings.capacity;
        let this = Arc::new(QueueService {
            repo,
            store,
            inner: Mutex::new(Inner {
                planner,
                changes,
                builds,
                tasks: HashMap::new(),
                landings,
                last_ms: snapshot.as_ref().map_or(0, |s| s.at_ms.max(0) as u64),
                snapshot_seq: snapshot.as_ref().map_or(0, |s| s.seq),
                forgotten_landing_failures: 0,
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
            spawn_named("queue-retention", this.clone().retention_loop()),
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
                let failed = inner.landings.values().filter(|r| LandingState::of(r) == Some(LandingState::Failed));
                let running = inner.planner.running_count();
                self.metrics.refresh(
                    inner.planner.stats(),
                    &inner.planner.flaky_targets(),
                    running,
                    inner.forgotten_landing_failures + failed.count() as u64,
                    inner.changes.values(),
                );
            }
            if updates.changed().await.is_err() {
                return;
            }
        }
    }

    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    pub async fn submit(self: &Arc<Self>, change_ref: &str, priority: i32) -> Result<pb::Change> {
        let (repo, r) = (self.repo.clone(), change_ref.to_string());
        let (commit, merge_base) =
            blocking(move || repo.resolve(&r)).await.map_err(|e| SubmitError::InvalidArgument(e.to_string()))?;
        let mut inner = self.inner.lock().await;
        let seq = inner.changes.values().map(|c| c.seq).max().unwrap_or(0) + 1;
        let mut doc = ChangeDoc::submitted(seq, change_ref, inner.tick() as i64);
        (doc.commit, doc.merge_base, doc.priority) = (commit, merge_base, priority);
        // Durable before the caller hears of it: a submitted change is never lost.
        self.store.put_change(&doc_row(&doc.id, seq, doc.state.as_str(), &doc)?).await?;
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
            s => return Err(SubmitError::FailedPrecondition(format!("change_id {id}: already {}", s.as_str()))),
        }
        let now = inner.tick() as i64;
        let c = inner.changes.get_mut(id).expect("checked above");
        c.state = ChangeState::Cancelled;
        c.reason = "cancelled by request".into();
        c.decided_ms = Some(now);
        self.store.put_change(&doc_row(id, c.seq, c.state.as_str(), c)?).await?;
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
            state: doc.state.as_str().into(),
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
        let stats = inner.planner.stats();
        Ok(pb::QueueStatus {
            mainline: self.settings.mainline.clone(),
            mainline_commit: self.versions.borrow().last().cloned().unwrap_or_default(),
            capacity: self.settings.capacity as u32,
            changes,
            flaky_targets: inner
                .planner
                .flaky_targets()
                .into_iter()
                .map(|f| pb::FlakyTarget { target: f.target, failures: f.failures, flaky: f.flaky })
                .collect(),
            batches: stats.batches,
            batch_landed: stats.batch_landed,
            bisection_builds: stats.bisection_builds,
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
                let decided = c.state.parse().is_ok_and(ChangeState::decided);
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
        state: b.state.as_str().into(),
        commit: b.commit.clone(),
        started_unix_ms: b.started_ms,
        finished_unix_ms: b.finished_ms.unwrap_or(0),
        message: b.message.clone(),
        targets: b.targets.clone(),
        failed_targets: b.failed_targets.clone(),
    }
}
