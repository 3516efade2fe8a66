//! Queue builds: a build's tree made with git, the build steps run in it, and what came of
//! them turned into a result for the planner.
//!
//! The judgement this module exists for is whose doing a failure is. A failure of the tree
//! rejects the change; an infrastructure error (Bazel or the executor unreachable, a build
//! command that cannot start, a checkout that fails) must never do so, so it is tried again
//! after a backoff instead. Results reach the planner through the event loop, so a build
//! task never has to outlive its own cancellation.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use gantry_builds::runner::{RunReport, RunSpec, Runner};
use gantry_queue::{BuildOutcome, BuildSpec, Event};
use tokio::sync::mpsc;

use super::journal::{doc_row, BuildState};
use super::{ChangeDoc, QueueService, Result};
use crate::git::short;

/// A build's result for the planner, sent to the event loop.
pub(super) struct Finished {
    id: u64,
    outcome: BuildOutcome,
    commit: String,
    targets: Vec<String>,
    message: String,
    /// For a failed `bazel test` of named targets: those that did not pass.
    failed_targets: Option<Vec<String>>,
    /// Tests Bazel reported FLAKY (failed, then passed on a retry in the build).
    flaky_targets: Vec<String>,
}

/// What the build steps made of a tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
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
    Done(Box<Finished>),
    /// Not the tree's doing: try the same build again later.
    Infra(String),
    /// The queue is stopping: report nothing.
    Stopping,
}

impl QueueService {
    /// Counts and logs an infrastructure error, and says how long to wait before the
    /// next try.
    pub(super) fn infra_retry(&self, what: &str, retry: u32, why: &str) -> Duration {
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
    pub(super) async fn run_build(self: Arc<Self>, spec: BuildSpec) {
        let id = spec.id.0;
        let mut retry = 0;
        let finished = loop {
            match self.build(&spec).await {
                Attempt::Done(f) => break *f,
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
        if doc.state != BuildState::Running {
            return Ok(());
        }
        doc.message = message;
        self.store.put_build(&doc_row(&id.to_string(), id as i64, doc.state.as_str(), doc)?).await?;
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
    pub(super) fn targets_of(docs: &[ChangeDoc]) -> Vec<String> {
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
        let id = spec.id.0;
        let done = move |outcome, commit, targets, message| {
            Attempt::Done(Box::new(Finished {
                id,
                outcome,
                commit,
                targets,
                message,
                failed_targets: None,
                flaky_targets: vec![],
            }))
        };
        let base = {
            let mut rx = self.versions.subscribe();
            let Ok(v) = rx.wait_for(|v| v.count() > spec.base_version).await else { return Attempt::Stopping };
            // Retention keeps every version a build the planner keeps starts from.
            match v.get(spec.base_version) {
                Some(c) => c.clone(),
                None => {
                    let why = format!("mainline version {} is no longer remembered", spec.base_version);
                    return done(BuildOutcome::FailedConclusively, String::new(), vec![], why);
                }
            }
        };
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
                        .map_err(|e| done(BuildOutcome::FailedConclusively, String::new(), t.clone(), e.to_string()))?;
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
        let (verdict, failed_targets, flaky_targets) = self.run_steps_reporting(lease.runner(), &tree, &targets).await;
        let (outcome, message) = match verdict {
            Verdict::Passed => (BuildOutcome::Passed, String::new()),
            Verdict::Failed(message) => (BuildOutcome::Failed, message),
            Verdict::Infra(why) => return Attempt::Infra(why),
        };
        Attempt::Done(Box::new(Finished { id, outcome, commit, targets, message, failed_targets, flaky_targets }))
    }

    /// The build steps in a checked-out tree: `[queue] build_command`, or `bazel test`
    /// of the targets.
    pub(super) async fn run_steps(&self, runner: &Runner, tree: &std::path::Path, targets: &[String]) -> Verdict {
        self.run_steps_reporting(runner, tree, targets).await.0
    }

    /// The build steps; for a failed `bazel test` of named targets the ones that did not
    /// pass (failed, or never reported: complete, as the planner's attribution needs),
    /// `None` where that is unknown (a `build_command`, `//...`, or no build events);
    /// and the tests Bazel reported FLAKY.
    async fn run_steps_reporting(
        &self,
        runner: &Runner,
        tree: &std::path::Path,
        targets: &[String],
    ) -> (Verdict, Option<Vec<String>>, Vec<String>) {
        if !self.settings.build_command.is_empty() {
            let verdict = run_build_command(&self.settings.build_command, tree, self.settings.runner.deadline).await;
            return (verdict, None, Vec::new());
        }
        let spec = RunSpec {
            workspace: tree.to_path_buf(),
            command: "test".into(),
            flags: vec![],
            targets: targets.to_vec(),
            invocation_id: uuid::Uuid::new_v4().to_string(),
        };
        let report = runner.run(&spec).await;
        let verdict = Verdict::of_bazel(&report);
        let named = !targets.iter().any(|t| t.contains("..."));
        let failed = match verdict {
            Verdict::Failed(_) if named && report.bep.events > 0 => Some(report.bep.not_passed(targets)),
            _ => None,
        }
        .filter(|t| !t.is_empty());
        (verdict, failed, report.bep.flaky)
    }

    pub(super) async fn event_loop(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<Finished>) {
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
        if doc.state != BuildState::Running {
            return Ok(()); // cancelled while it finished
        }
        doc.state = if f.outcome == BuildOutcome::Passed { BuildState::Passed } else { BuildState::Failed };
        doc.commit = f.commit;
        doc.targets = f.targets;
        doc.message = f.message;
        doc.failed_targets = f.failed_targets.clone().unwrap_or_default();
        doc.finished_ms = Some(now);
        self.store.put_build(&doc_row(&f.id.to_string(), f.id as i64, doc.state.as_str(), doc)?).await?;
        let build = gantry_queue::BuildId(f.id);
        if !f.flaky_targets.is_empty() {
            // Before the result, so the records are current when the planner weighs it.
            let event = Event::FlakyTargets { targets: f.flaky_targets.clone() };
            self.apply(&mut inner, event, Some(format!("flaky:{}", f.id))).await?;
        }
        self.apply(
            &mut inner,
            Event::BuildFinished { build, outcome: f.outcome, failed_targets: f.failed_targets },
            Some(format!("finished:{}", f.id)),
        )
        .await
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
    use gantry_builds::runner::RunnerSettings;

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
