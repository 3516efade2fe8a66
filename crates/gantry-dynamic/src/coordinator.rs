//! The race coordinator: a deterministic state machine that decides, for one
//! `gantry run`, which branch (local or remote) produces the outputs.
//!
//! The driver feeds [`Event`]s (with the current time) into
//! [`Coordinator::handle`] and executes the returned [`Command`]s **in order**.
//! The coordinator never blocks, never does I/O and never reads a clock.
//!
//! Rules (the first two follow Bazel's dynamic strategy):
//! - The first branch to *finish* decides the run. Finishing means reporting a
//!   result staged in its own temporary directory ("ready to write", including
//!   a cache hit) or failing. A failure of the first finisher fails the run.
//! - Outputs are moved into the output tree only after the winner is ready and
//!   only while holding the output lock, so a remote branch downloading its
//!   outputs never blocks the local branch (the legacy Bazel problem).
//! - Every branch that was started is stopped (cancelled unless it already
//!   stopped by itself) and has its temporary directory cleaned, and `Finish` is
//!   the last command, so no temporary files survive any outcome.
//! - Events that no longer matter (late cancellation confirmations, a loser
//!   reporting after it was told to cancel, stale timers, anything after
//!   `Finish`) change nothing except the ignored-event counter.
//!
//! Driver contract (what makes the above sound):
//! - A branch's terminal events (`*ReadyToWrite`, `RemoteCacheHit`, `*Failed`,
//!   `CancelConfirmed`) are sent only when that branch's task no longer touches
//!   its temporary directory. `CancelConfirmed` must always eventually follow a
//!   `Cancel*` command; the driver confirms when its *own* side is quiescent
//!   (process group reaped, download streams dropped), so it is bounded even if
//!   the server never acknowledges `CancelOperation`.
//! - `StartLocalAfter(d)` arms a timer that sends `DelayElapsed` at `now + d`.
//!   A later `StartLocalAfter` supersedes earlier ones; the driver need not
//!   disarm old timers because a stale `DelayElapsed` is recognised by its time.
//! - `ReleaseOutputLock` releases the lock, or withdraws a pending acquisition;
//!   after it the driver does not deliver `OutputLockAcquired`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::delay::DelayPlan;

/// One of the two racing branches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Branch {
    Local,
    Remote,
}

impl Branch {
    /// Both branches, in a fixed order (used wherever we iterate).
    pub const BOTH: [Branch; 2] = [Branch::Local, Branch::Remote];

    fn idx(self) -> usize {
        match self {
            Branch::Local => 0,
            Branch::Remote => 1,
        }
    }

    /// The opposing branch.
    pub fn other(self) -> Branch {
        match self {
            Branch::Local => Branch::Remote,
            Branch::Remote => Branch::Local,
        }
    }
}

/// `gantry run --strategy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Strategy {
    /// Run locally only; no cache lookup (the local result may still be uploaded).
    Local,
    /// Remote branch only (cache lookup, then execution on a miss).
    Remote,
    /// Race the remote branch against a delayed local branch.
    Dynamic,
    /// Cache lookup only: a miss fails the run.
    CacheOnly,
}

/// Static configuration of one race.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RaceConfig {
    pub strategy: Strategy,
    /// When to start the local branch in `Dynamic` mode (from `choose_delay`).
    pub delay: DelayPlan,
    /// Whether a successful local result may be uploaded to the action cache.
    pub upload_local_results: bool,
}

impl RaceConfig {
    /// Convenience constructor for a dynamic race with the given delay plan.
    pub fn dynamic(delay: DelayPlan) -> RaceConfig {
        RaceConfig { strategy: Strategy::Dynamic, delay, upload_local_results: true }
    }
}

/// Something that happened, reported by the driver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// Begin the run. Must be the first event; everything before it is ignored.
    Start,
    /// The local timer armed by `StartLocalAfter` fired.
    DelayElapsed,
    /// The local process actually started (after `StartLocalNow`; it may have
    /// waited for local resources). Refines the local duration measurement.
    LocalStarted,
    /// The local process exited and its outputs are staged in its temp dir.
    LocalReadyToWrite { exit_code: i32 },
    /// The local branch could not produce a result (spawn error, sandbox error...).
    LocalFailed { reason: String },
    /// The action cache has no entry; the remote branch goes on to execute
    /// (or, with `CacheOnly`, stops).
    RemoteCacheMiss,
    /// The action cache had the result and its outputs are downloaded to temp.
    RemoteCacheHit { exit_code: i32 },
    /// Remote execution finished and its outputs are downloaded to temp.
    RemoteReadyToWrite { exit_code: i32 },
    /// The remote branch failed (RPC error, download error...).
    RemoteFailed { reason: String },
    /// A branch we told to cancel has stopped and no longer touches its temp dir.
    CancelConfirmed(Branch),
    /// The output lock requested by `AcquireOutputLock(branch)` is held.
    OutputLockAcquired(Branch),
    /// All outputs were moved into place.
    OutputsWritten,
    /// Moving outputs into place failed.
    OutputsWriteFailed { reason: String },
    /// The user interrupted the run (Ctrl-C).
    UserCancelled,
    /// The driver's overall deadline passed.
    TimedOut,
}

/// Something the driver must do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Start the remote branch: look the action up in the cache and, unless
    /// `cache_only`, execute it on a miss. Outputs go to a unique temp dir.
    StartRemote { cache_only: bool },
    /// Arm the local timer: send `DelayElapsed` after this delay.
    StartLocalAfter(Duration),
    /// Start the local branch now (outputs go to its own temp dir).
    StartLocalNow,
    /// Kill the local process group; then send `CancelConfirmed(Local)`.
    CancelLocal,
    /// Send CancelOperation, drop downloads; then send `CancelConfirmed(Remote)`.
    CancelRemote,
    /// Acquire the output lock on behalf of this branch.
    AcquireOutputLock(Branch),
    /// Move this branch's staged outputs into place (rename). Lock is held.
    WriteOutputs(Branch),
    /// Release (or withdraw the pending request for) the output lock.
    ReleaseOutputLock,
    /// Remove this branch's temp dir and everything left in it.
    CleanupTemp(Branch),
    /// Upload the local result (now in the output tree) to the action cache.
    UploadLocalResult,
    /// The run is over; this is always the last command.
    Finish(Outcome),
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    /// The branch that finished first (and so decided the run), if any did.
    pub winner: Option<Branch>,
    pub result: RunResult,
}

/// The result `gantry run` reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunResult {
    /// The winner's outputs are in place; replay this exit code.
    Completed { exit_code: i32, from_cache: bool },
    /// The first branch to finish failed, which fails the run (as in Bazel).
    BranchFailed { reason: String },
    /// The winner's outputs could not be moved into place.
    OutputsWriteFailed { reason: String },
    /// `CacheOnly` and the action cache had no entry.
    CacheMiss,
    /// The user cancelled before outputs reached the output tree.
    Cancelled,
    /// The driver's deadline passed before outputs reached the output tree.
    TimedOut,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BranchState {
    /// Not started and not scheduled.
    Idle,
    /// Local only: waiting for the delay, due at `deadline`.
    Delayed { deadline: Duration },
    /// Started and working.
    Running,
    /// Told to cancel, not yet stopped.
    Cancelling,
    /// Stopped with a staged result (the task is quiescent).
    Ready,
    /// Stopped with a failure or, for `CacheOnly`, a miss.
    Failed,
    /// Stopped after a cancellation.
    Stopped,
    /// Never started and never will be (the race ended first).
    Skipped,
}

impl BranchState {
    fn quiescent(self) -> bool {
        matches!(self, BranchState::Ready | BranchState::Failed | BranchState::Stopped)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum DecisionKind {
    Success { exit_code: i32, from_cache: bool },
    Failure { reason: String },
    CacheMiss,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Decision {
    winner: Branch,
    kind: DecisionKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Commit {
    None,
    LockPending(Branch),
    Writing(Branch),
    Written,
    WriteFailed(String),
    /// The lock request was withdrawn because the run was aborted.
    Abandoned,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Abort {
    User,
    Timeout,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Created,
    Running,
    Finished,
}

/// Timestamps of one branch, for learning and statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BranchTimes {
    /// When the branch started working (`LocalStarted` refines this for local).
    pub started_at: Option<Duration>,
    /// When it reported a staged result.
    pub ready_at: Option<Duration>,
    /// When it reported a failure.
    pub failed_at: Option<Duration>,
    /// When the coordinator told it to cancel.
    pub cancel_requested_at: Option<Duration>,
}

/// What happened during a race, with times, for `delay::Observation` and
/// `race_stats`. Times are whatever clock the driver passes in.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RaceReport {
    pub started_at: Option<Duration>,
    pub local: BranchTimes,
    pub remote: BranchTimes,
    /// When the remote branch learned that the cache had no entry.
    pub cache_miss_at: Option<Duration>,
    /// Whether the remote result came from the cache.
    pub remote_from_cache: bool,
    /// When the first branch finished.
    pub decided_at: Option<Duration>,
    pub finished_at: Option<Duration>,
    pub outcome: Option<Outcome>,
    /// Events that arrived when they no longer mattered (late, stale, invalid).
    pub ignored_events: u32,
}

/// The race state machine for one `gantry run`. Cheap to clone (for tests).
#[derive(Debug, Clone)]
pub struct Coordinator {
    config: RaceConfig,
    phase: Phase,
    state: [BranchState; 2],
    started: [bool; 2],
    cleaned: [bool; 2],
    decision: Option<Decision>,
    commit: Commit,
    abort: Option<Abort>,
    now: Duration,
    report: RaceReport,
}

impl Coordinator {
    pub fn new(config: RaceConfig) -> Coordinator {
        Coordinator {
            config,
            phase: Phase::Created,
            state: [BranchState::Idle; 2],
            started: [false; 2],
            cleaned: [false; 2],
            decision: None,
            commit: Commit::None,
            abort: None,
            now: Duration::ZERO,
            report: RaceReport::default(),
        }
    }

    pub fn config(&self) -> &RaceConfig {
        &self.config
    }

    /// True once `Finish` has been emitted.
    pub fn is_finished(&self) -> bool {
        self.phase == Phase::Finished
    }

    /// The outcome, once finished.
    pub fn outcome(&self) -> Option<&Outcome> {
        self.report.outcome.as_ref()
    }

    /// Timestamps and outcome gathered so far.
    pub fn report(&self) -> &RaceReport {
        &self.report
    }

    /// Feed one event at time `now`; returns the commands to execute in order.
    ///
    /// `now` is clamped to be monotonic, so a driver clock that steps back
    /// cannot make a stale timer look fresh.
    pub fn handle(&mut self, now: Duration, event: Event) -> Vec<Command> {
        self.now = self.now.max(now);
        let now = self.now;
        let mut cmds = Vec::new();
        let relevant = match self.phase {
            Phase::Finished => false,
            Phase::Created => matches!(event, Event::Start) && self.on_start(now, &mut cmds),
            Phase::Running => self.on_event(now, event, &mut cmds),
        };
        if !relevant {
            self.report.ignored_events += 1;
        }
        self.advance(now, &mut cmds);
        cmds
    }

    fn on_start(&mut self, now: Duration, cmds: &mut Vec<Command>) -> bool {
        self.phase = Phase::Running;
        self.report.started_at = Some(now);
        let (remote, local) = match self.config.strategy {
            Strategy::Local => (None, true),
            Strategy::Remote => (Some(false), false),
            Strategy::CacheOnly => (Some(true), false),
            Strategy::Dynamic => (Some(false), true),
        };
        if let Some(cache_only) = remote {
            cmds.push(Command::StartRemote { cache_only });
            self.mark_started(Branch::Remote, now);
        }
        if local {
            // Local-only runs have nothing to wait for.
            let delay = match self.config.strategy {
                Strategy::Dynamic => self.config.delay.initial,
                _ => Duration::ZERO,
            };
            self.schedule_local(now, delay, cmds);
        }
        true
    }

    fn schedule_local(&mut self, now: Duration, delay: Duration, cmds: &mut Vec<Command>) {
        if delay.is_zero() {
            cmds.push(Command::StartLocalNow);
            self.mark_started(Branch::Local, now);
        } else {
            cmds.push(Command::StartLocalAfter(delay));
            self.state[Branch::Local.idx()] = BranchState::Delayed { deadline: now + delay };
        }
    }

    fn mark_started(&mut self, b: Branch, now: Duration) {
        self.state[b.idx()] = BranchState::Running;
        self.started[b.idx()] = true;
        self.times_mut(b).started_at = Some(now);
    }

    fn times_mut(&mut self, b: Branch) -> &mut BranchTimes {
        match b {
            Branch::Local => &mut self.report.local,
            Branch::Remote => &mut self.report.remote,
        }
    }

    fn settled(&self) -> bool {
        self.decision.is_some() || self.abort.is_some()
    }

    /// Returns whether the event was relevant (else it is counted as ignored).
    fn on_event(&mut self, now: Duration, event: Event, cmds: &mut Vec<Command>) -> bool {
        match event {
            Event::Start => false,
            Event::DelayElapsed => match self.state[0] {
                // A timer superseded by a later StartLocalAfter fires early: ignore it.
                BranchState::Delayed { deadline } if now >= deadline && !self.settled() => {
                    cmds.push(Command::StartLocalNow);
                    self.mark_started(Branch::Local, now);
                    true
                }
                _ => false,
            },
            Event::LocalStarted => {
                if self.state[0] == BranchState::Running {
                    self.report.local.started_at = Some(now);
                    true
                } else {
                    false
                }
            }
            Event::LocalReadyToWrite { exit_code } => {
                self.on_terminal(now, Branch::Local, DecisionKind::Success { exit_code, from_cache: false })
            }
            Event::LocalFailed { reason } => self.on_terminal(now, Branch::Local, DecisionKind::Failure { reason }),
            Event::RemoteCacheHit { exit_code } => {
                self.on_terminal(now, Branch::Remote, DecisionKind::Success { exit_code, from_cache: true })
            }
            Event::RemoteReadyToWrite { exit_code } => {
                self.on_terminal(now, Branch::Remote, DecisionKind::Success { exit_code, from_cache: false })
            }
            Event::RemoteFailed { reason } => self.on_terminal(now, Branch::Remote, DecisionKind::Failure { reason }),
            Event::RemoteCacheMiss => self.on_cache_miss(now, cmds),
            Event::CancelConfirmed(b) => {
                if self.state[b.idx()] == BranchState::Cancelling {
                    self.state[b.idx()] = BranchState::Stopped;
                    true
                } else {
                    false
                }
            }
            Event::OutputLockAcquired(b) => {
                if self.commit == Commit::LockPending(b) {
                    cmds.push(Command::WriteOutputs(b));
                    self.commit = Commit::Writing(b);
                    true
                } else {
                    false
                }
            }
            Event::OutputsWritten => {
                if matches!(self.commit, Commit::Writing(_)) {
                    cmds.push(Command::ReleaseOutputLock);
                    self.commit = Commit::Written;
                    true
                } else {
                    false
                }
            }
            Event::OutputsWriteFailed { reason } => {
                if matches!(self.commit, Commit::Writing(_)) {
                    cmds.push(Command::ReleaseOutputLock);
                    self.commit = Commit::WriteFailed(reason);
                    true
                } else {
                    false
                }
            }
            Event::UserCancelled => self.on_abort(Abort::User),
            Event::TimedOut => self.on_abort(Abort::Timeout),
        }
    }

    fn on_abort(&mut self, abort: Abort) -> bool {
        if self.abort.is_some() {
            return false;
        }
        self.abort = Some(abort);
        true
    }

    fn on_cache_miss(&mut self, now: Duration, cmds: &mut Vec<Command>) -> bool {
        if self.state[1] != BranchState::Running || self.report.cache_miss_at.is_some() {
            return false;
        }
        self.report.cache_miss_at = Some(now);
        if self.config.strategy == Strategy::CacheOnly {
            // A lookup-only remote branch is done once it knows it missed.
            return self.on_terminal(now, Branch::Remote, DecisionKind::CacheMiss);
        }
        // Now P(hit) is 0, so the local delay is re-planned for "remote must
        // execute". Replacing (not just shortening) the deadline is deliberate:
        // for shapes whose remote execution is reliably fast, waiting longer
        // saves local work at no cost in time.
        if let BranchState::Delayed { .. } = self.state[0]
            && !self.settled()
        {
            self.schedule_local(now, self.config.delay.after_miss, cmds);
        }
        true
    }

    fn on_terminal(&mut self, now: Duration, b: Branch, kind: DecisionKind) -> bool {
        match self.state[b.idx()] {
            BranchState::Running => {
                let failed = !matches!(kind, DecisionKind::Success { .. });
                self.state[b.idx()] = if failed { BranchState::Failed } else { BranchState::Ready };
                if let DecisionKind::Success { from_cache: true, .. } = kind {
                    self.report.remote_from_cache = true;
                }
                let times = self.times_mut(b);
                if failed {
                    times.failed_at = Some(now);
                } else {
                    times.ready_at = Some(now);
                }
                // A running branch implies nothing is settled (settling cancels
                // every running branch), so this branch is the first finisher.
                if !self.settled() {
                    self.decision = Some(Decision { winner: b, kind });
                    self.report.decided_at = Some(now);
                }
                true
            }
            BranchState::Cancelling => {
                // It finished while our cancel was in flight. Its task is
                // quiescent, so its temp dir can be cleaned; the result is moot.
                self.state[b.idx()] = BranchState::Stopped;
                true
            }
            _ => false,
        }
    }

    /// Drive the settled race towards `Finish`: cancel what still runs, commit
    /// the winner, clean quiescent temp dirs, and finish when nothing is left.
    fn advance(&mut self, now: Duration, cmds: &mut Vec<Command>) {
        if self.phase != Phase::Running || !self.settled() {
            return;
        }
        for b in Branch::BOTH {
            match self.state[b.idx()] {
                BranchState::Idle | BranchState::Delayed { .. } => {
                    self.state[b.idx()] = BranchState::Skipped;
                }
                BranchState::Running => {
                    cmds.push(match b {
                        Branch::Local => Command::CancelLocal,
                        Branch::Remote => Command::CancelRemote,
                    });
                    self.state[b.idx()] = BranchState::Cancelling;
                    self.times_mut(b).cancel_requested_at = Some(now);
                }
                _ => {}
            }
        }

        let success_winner = match &self.decision {
            Some(Decision { winner, kind: DecisionKind::Success { .. } }) => Some(*winner),
            _ => None,
        };
        match (&self.commit, success_winner, self.abort) {
            (Commit::None, Some(w), None) => {
                cmds.push(Command::AcquireOutputLock(w));
                self.commit = Commit::LockPending(w);
            }
            // Aborting while waiting for the lock: withdraw. While *writing* we
            // wait instead: renames are short and stopping half-way would leave
            // a half-updated output tree.
            (Commit::LockPending(_), _, Some(_)) => {
                cmds.push(Command::ReleaseOutputLock);
                self.commit = Commit::Abandoned;
            }
            _ => {}
        }

        let committing = match self.commit {
            Commit::LockPending(b) | Commit::Writing(b) => Some(b),
            _ => None,
        };
        for b in Branch::BOTH {
            let i = b.idx();
            if self.started[i] && !self.cleaned[i] && self.state[i].quiescent() && committing != Some(b) {
                cmds.push(Command::CleanupTemp(b));
                self.cleaned[i] = true;
            }
        }

        let all_clean = (0..2).all(|i| !self.started[i] || self.cleaned[i]);
        if all_clean && committing.is_none() {
            let outcome = self.final_outcome();
            let upload = self.config.upload_local_results
                && self.abort.is_none()
                && outcome.winner == Some(Branch::Local)
                && outcome.result == RunResult::Completed { exit_code: 0, from_cache: false };
            if upload {
                cmds.push(Command::UploadLocalResult);
            }
            cmds.push(Command::Finish(outcome.clone()));
            self.report.outcome = Some(outcome);
            self.report.finished_at = Some(now);
            self.phase = Phase::Finished;
        }
    }

    fn final_outcome(&self) -> Outcome {
        let winner = self.decision.as_ref().map(|d| d.winner);
        let result = match (self.decision.as_ref().map(|d| &d.kind), &self.commit) {
            (Some(DecisionKind::Failure { reason }), _) => RunResult::BranchFailed { reason: reason.clone() },
            (Some(DecisionKind::CacheMiss), _) => RunResult::CacheMiss,
            (Some(DecisionKind::Success { exit_code, from_cache }), Commit::Written) => {
                RunResult::Completed { exit_code: *exit_code, from_cache: *from_cache }
            }
            (Some(DecisionKind::Success { .. }), Commit::WriteFailed(reason)) => {
                RunResult::OutputsWriteFailed { reason: reason.clone() }
            }
            // Settled without a decision or without committing: an abort did it.
            _ => match self.abort {
                Some(Abort::Timeout) => RunResult::TimedOut,
                _ => RunResult::Cancelled,
            },
        };
        Outcome { winner, result }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn plan(initial: u64, after_miss: u64) -> DelayPlan {
        DelayPlan { initial: ms(initial), after_miss: ms(after_miss) }
    }

    #[test]
    fn remote_cache_hit_beats_delayed_local() {
        let mut c = Coordinator::new(RaceConfig::dynamic(plan(500, 0)));
        assert_eq!(
            c.handle(ms(0), Event::Start),
            vec![Command::StartRemote { cache_only: false }, Command::StartLocalAfter(ms(500))]
        );
        assert_eq!(
            c.handle(ms(200), Event::RemoteCacheHit { exit_code: 0 }),
            vec![Command::AcquireOutputLock(Branch::Remote)]
        );
        // The timer fires after the race was decided: local never starts.
        assert_eq!(c.handle(ms(500), Event::DelayElapsed), vec![]);
        assert_eq!(
            c.handle(ms(500), Event::OutputLockAcquired(Branch::Remote)),
            vec![Command::WriteOutputs(Branch::Remote)]
        );
        let done =
            Outcome { winner: Some(Branch::Remote), result: RunResult::Completed { exit_code: 0, from_cache: true } };
        assert_eq!(
            c.handle(ms(510), Event::OutputsWritten),
            vec![Command::ReleaseOutputLock, Command::CleanupTemp(Branch::Remote), Command::Finish(done)]
        );
        assert_eq!(c.report().ignored_events, 1);
    }

    #[test]
    fn local_wins_then_remote_late_result_is_ignored() {
        let mut c = Coordinator::new(RaceConfig::dynamic(plan(0, 0)));
        assert_eq!(
            c.handle(ms(0), Event::Start),
            vec![Command::StartRemote { cache_only: false }, Command::StartLocalNow]
        );
        assert_eq!(c.handle(ms(30), Event::RemoteCacheMiss), vec![]);
        assert_eq!(
            c.handle(ms(900), Event::LocalReadyToWrite { exit_code: 0 }),
            vec![Command::CancelRemote, Command::AcquireOutputLock(Branch::Local)]
        );
        assert_eq!(
            c.handle(ms(901), Event::OutputLockAcquired(Branch::Local)),
            vec![Command::WriteOutputs(Branch::Local)]
        );
        // Remote finished while its cancel was in flight: it is now quiescent.
        assert_eq!(
            c.handle(ms(902), Event::RemoteReadyToWrite { exit_code: 0 }),
            vec![Command::CleanupTemp(Branch::Remote)]
        );
        let done =
            Outcome { winner: Some(Branch::Local), result: RunResult::Completed { exit_code: 0, from_cache: false } };
        assert_eq!(
            c.handle(ms(903), Event::OutputsWritten),
            vec![
                Command::ReleaseOutputLock,
                Command::CleanupTemp(Branch::Local),
                Command::UploadLocalResult,
                Command::Finish(done)
            ]
        );
        // The cancellation confirmation arrives after the finish.
        assert_eq!(c.handle(ms(950), Event::CancelConfirmed(Branch::Remote)), vec![]);
        assert!(c.is_finished());
    }

    #[test]
    fn first_finisher_failure_fails_the_run() {
        let mut c = Coordinator::new(RaceConfig::dynamic(plan(0, 0)));
        c.handle(ms(0), Event::Start);
        assert_eq!(
            c.handle(ms(10), Event::RemoteFailed { reason: "unavailable".into() }),
            vec![Command::CancelLocal, Command::CleanupTemp(Branch::Remote)]
        );
        // The local success after that does not rescue the run (Bazel semantics).
        assert_eq!(
            c.handle(ms(20), Event::LocalReadyToWrite { exit_code: 0 }),
            vec![
                Command::CleanupTemp(Branch::Local),
                Command::Finish(Outcome {
                    winner: Some(Branch::Remote),
                    result: RunResult::BranchFailed { reason: "unavailable".into() }
                })
            ]
        );
    }

    #[test]
    fn cache_miss_replans_local_start_and_stale_timer_is_ignored() {
        let mut c = Coordinator::new(RaceConfig::dynamic(plan(1000, 300)));
        c.handle(ms(0), Event::Start);
        assert_eq!(c.handle(ms(40), Event::RemoteCacheMiss), vec![Command::StartLocalAfter(ms(300))]);
        // New deadline is 340 ms: the original 1000 ms timer is stale when it fires
        // after the new one already started local, and an early fire is refused.
        assert_eq!(c.handle(ms(100), Event::DelayElapsed), vec![]);
        assert_eq!(c.handle(ms(340), Event::DelayElapsed), vec![Command::StartLocalNow]);
        assert_eq!(c.handle(ms(1000), Event::DelayElapsed), vec![]);
        assert_eq!(c.report().local.started_at, Some(ms(340)));
    }

    #[test]
    fn user_cancel_stops_both_and_cleans_up() {
        let mut c = Coordinator::new(RaceConfig::dynamic(plan(0, 0)));
        c.handle(ms(0), Event::Start);
        assert_eq!(c.handle(ms(5), Event::UserCancelled), vec![Command::CancelLocal, Command::CancelRemote]);
        assert_eq!(c.handle(ms(6), Event::CancelConfirmed(Branch::Remote)), vec![Command::CleanupTemp(Branch::Remote)]);
        assert_eq!(
            c.handle(ms(7), Event::CancelConfirmed(Branch::Local)),
            vec![
                Command::CleanupTemp(Branch::Local),
                Command::Finish(Outcome { winner: None, result: RunResult::Cancelled })
            ]
        );
    }

    #[test]
    fn cancel_while_waiting_for_lock_withdraws_it() {
        let mut c = Coordinator::new(RaceConfig::dynamic(plan(0, 0)));
        c.handle(ms(0), Event::Start);
        c.handle(ms(5), Event::RemoteCacheHit { exit_code: 3 });
        assert_eq!(
            c.handle(ms(6), Event::TimedOut),
            vec![Command::ReleaseOutputLock, Command::CleanupTemp(Branch::Remote)]
        );
        assert_eq!(c.handle(ms(7), Event::OutputLockAcquired(Branch::Remote)), vec![]);
        assert_eq!(
            c.handle(ms(8), Event::CancelConfirmed(Branch::Local)),
            vec![
                Command::CleanupTemp(Branch::Local),
                Command::Finish(Outcome { winner: Some(Branch::Remote), result: RunResult::TimedOut })
            ]
        );
    }

    #[test]
    fn cache_only_miss_fails_without_local() {
        let cfg = RaceConfig { strategy: Strategy::CacheOnly, delay: plan(0, 0), upload_local_results: true };
        let mut c = Coordinator::new(cfg);
        assert_eq!(c.handle(ms(0), Event::Start), vec![Command::StartRemote { cache_only: true }]);
        assert_eq!(
            c.handle(ms(9), Event::RemoteCacheMiss),
            vec![
                Command::CleanupTemp(Branch::Remote),
                Command::Finish(Outcome { winner: Some(Branch::Remote), result: RunResult::CacheMiss })
            ]
        );
    }

    #[test]
    fn nonzero_local_exit_is_replayed_but_not_uploaded() {
        let cfg = RaceConfig { strategy: Strategy::Local, delay: plan(9999, 9999), upload_local_results: true };
        let mut c = Coordinator::new(cfg);
        assert_eq!(c.handle(ms(0), Event::Start), vec![Command::StartLocalNow]);
        c.handle(ms(1), Event::LocalReadyToWrite { exit_code: 2 });
        c.handle(ms(2), Event::OutputLockAcquired(Branch::Local));
        let cmds = c.handle(ms(3), Event::OutputsWritten);
        assert!(!cmds.contains(&Command::UploadLocalResult));
        assert_eq!(
            c.outcome().map(|o| o.result.clone()),
            Some(RunResult::Completed { exit_code: 2, from_cache: false })
        );
    }
}
