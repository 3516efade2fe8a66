//! An independent checker of the race invariants over a recorded trace.
//!
//! It re-derives, from the events and commands alone (not from the
//! coordinator's internals), what must be true of any correct race, so tests
//! that enumerate interleavings can check each one, and the real driver can
//! audit its traces in debug builds. Invariants checked:
//!
//! 1. `Finish` is emitted at most once and nothing is emitted after it.
//! 2. At most one branch ever writes outputs: at most one `AcquireOutputLock`
//!    and one `WriteOutputs`, for the same branch.
//! 3. `WriteOutputs(b)` happens only while holding the lock: after
//!    `OutputLockAcquired(b)` and before `ReleaseOutputLock`.
//! 4. `CleanupTemp(b)` happens once per started branch, only after `b` is
//!    quiescent (terminal event seen) and after its write (if any) completed;
//!    no write follows it. At `Finish`, every started branch was cleaned and
//!    the lock was released: no temporary files and no held lock survive.
//! 5. A branch is cancelled at most once, only if started, and never after
//!    it finished first; so every started loser ends quiescent (4).
//! 6. The first branch to finish (before any abort) decides the outcome,
//!    including when it failed; an abort before that yields Cancelled/TimedOut.
//! 7. `UploadLocalResult` happens exactly when the local branch won with exit
//!    code 0, outputs were written, uploads are allowed and no abort happened.
//! 8. The strategy is respected (e.g. `Remote` never starts local).

use std::time::Duration;

use crate::coordinator::{Branch, Command, Event, Outcome, RaceConfig, RunResult, Strategy};
use crate::Error;

/// One `handle` call: the event delivered and the commands it produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub at: Duration,
    pub event: Event,
    pub commands: Vec<Command>,
}

/// What the audit learned about a trace that passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditSummary {
    pub finished: bool,
    pub outcome: Option<Outcome>,
    pub writes: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum First {
    Success { branch: Branch, exit_code: i32, from_cache: bool },
    Failure { branch: Branch, reason: String },
    CacheMiss,
}

#[derive(Default)]
struct Model {
    began: bool,
    started: [bool; 2],
    cancelled: [bool; 2],
    quiescent: [bool; 2],
    cleaned: [bool; 2],
    first: Option<First>,
    aborted: Option<RunResult>,
    lock_requested: Option<Branch>,
    lock_granted: bool,
    lock_released: bool,
    write: Option<Branch>,
    write_result: Option<Result<(), String>>,
    uploads: usize,
    finished: Option<Outcome>,
}

fn idx(b: Branch) -> usize {
    match b {
        Branch::Local => 0,
        Branch::Remote => 1,
    }
}

/// Check every invariant listed in the module docs over `steps`.
pub fn check_trace(config: &RaceConfig, steps: &[Step]) -> Result<AuditSummary, Error> {
    let mut m = Model::default();
    for (i, step) in steps.iter().enumerate() {
        let fail = |message: String| Error::InvariantViolated { step: i, message };
        if m.finished.is_some() {
            if !step.commands.is_empty() {
                return Err(fail(format!("commands after Finish: {:?}", step.commands)));
            }
            continue;
        }
        m.observe(config, &step.event);
        for cmd in &step.commands {
            if m.finished.is_some() {
                return Err(fail(format!("command {cmd:?} after Finish")));
            }
            m.apply(config, cmd).map_err(fail)?;
        }
    }
    Ok(AuditSummary {
        finished: m.finished.is_some(),
        outcome: m.finished.clone(),
        writes: usize::from(m.write.is_some()),
    })
}

impl Model {
    fn live(&self, b: Branch) -> bool {
        self.started[idx(b)] && !self.quiescent[idx(b)]
    }

    /// Update the model with an event, mirroring what a correct driver means by it.
    fn observe(&mut self, config: &RaceConfig, event: &Event) {
        let result = |m: &mut Model, b: Branch, first: First| {
            if !m.live(b) {
                return;
            }
            m.quiescent[idx(b)] = true;
            if !m.cancelled[idx(b)] && m.aborted.is_none() && m.first.is_none() {
                m.first = Some(first);
            }
        };
        match event {
            Event::Start => self.began = true,
            _ if !self.began => {}
            Event::LocalReadyToWrite { exit_code } => result(
                self,
                Branch::Local,
                First::Success { branch: Branch::Local, exit_code: *exit_code, from_cache: false },
            ),
            Event::RemoteReadyToWrite { exit_code } => result(
                self,
                Branch::Remote,
                First::Success { branch: Branch::Remote, exit_code: *exit_code, from_cache: false },
            ),
            Event::RemoteCacheHit { exit_code } => result(
                self,
                Branch::Remote,
                First::Success { branch: Branch::Remote, exit_code: *exit_code, from_cache: true },
            ),
            Event::LocalFailed { reason } => {
                result(self, Branch::Local, First::Failure { branch: Branch::Local, reason: reason.clone() })
            }
            Event::RemoteFailed { reason } => {
                result(self, Branch::Remote, First::Failure { branch: Branch::Remote, reason: reason.clone() })
            }
            Event::RemoteCacheMiss if config.strategy == Strategy::CacheOnly => {
                result(self, Branch::Remote, First::CacheMiss)
            }
            Event::CancelConfirmed(b) => {
                if self.cancelled[idx(*b)] {
                    self.quiescent[idx(*b)] = true;
                }
            }
            Event::OutputLockAcquired(b) => {
                if self.lock_requested == Some(*b) && !self.lock_released {
                    self.lock_granted = true;
                }
            }
            Event::OutputsWritten => {
                if self.write.is_some() && self.write_result.is_none() {
                    self.write_result = Some(Ok(()));
                }
            }
            Event::OutputsWriteFailed { reason } => {
                if self.write.is_some() && self.write_result.is_none() {
                    self.write_result = Some(Err(reason.clone()));
                }
            }
            Event::UserCancelled => {
                self.aborted.get_or_insert(RunResult::Cancelled);
            }
            Event::TimedOut => {
                self.aborted.get_or_insert(RunResult::TimedOut);
            }
            Event::RemoteCacheMiss | Event::DelayElapsed | Event::LocalStarted => {}
        }
    }

    fn apply(&mut self, config: &RaceConfig, cmd: &Command) -> Result<(), String> {
        match cmd {
            Command::StartRemote { cache_only } => {
                let expected = match config.strategy {
                    Strategy::Remote | Strategy::Dynamic => false,
                    Strategy::CacheOnly => true,
                    Strategy::Local => return Err("local strategy started remote".into()),
                };
                if *cache_only != expected || self.started[1] {
                    return Err(format!("bad StartRemote {{ cache_only: {cache_only} }}"));
                }
                self.started[1] = true;
            }
            Command::StartLocalNow => {
                if !matches!(config.strategy, Strategy::Local | Strategy::Dynamic) {
                    return Err("non-local strategy started local".into());
                }
                if self.started[0] {
                    return Err("local started twice".into());
                }
                if self.first.is_some() || self.aborted.is_some() {
                    return Err("local started after the race was settled".into());
                }
                self.started[0] = true;
            }
            Command::StartLocalAfter(_) => {
                if config.strategy != Strategy::Dynamic || self.started[0] {
                    return Err("unexpected StartLocalAfter".into());
                }
            }
            Command::CancelLocal | Command::CancelRemote => {
                let b = if *cmd == Command::CancelLocal { Branch::Local } else { Branch::Remote };
                if !self.started[idx(b)] || self.cancelled[idx(b)] {
                    return Err(format!("cancel of {b:?} that was not started or already cancelled"));
                }
                if self.quiescent[idx(b)] {
                    return Err(format!("cancel of {b:?} after it finished"));
                }
                self.cancelled[idx(b)] = true;
            }
            Command::AcquireOutputLock(b) => {
                if self.lock_requested.is_some() {
                    return Err("output lock requested twice".into());
                }
                match &self.first {
                    Some(First::Success { branch, .. }) if branch == b => {}
                    _ => {
                        return Err(format!("lock requested for {b:?}, which did not finish first with success"));
                    }
                }
                self.lock_requested = Some(*b);
            }
            Command::WriteOutputs(b) => {
                if self.write.is_some() {
                    return Err("outputs written twice".into());
                }
                if self.lock_requested != Some(*b) || !self.lock_granted || self.lock_released {
                    return Err(format!("WriteOutputs({b:?}) without holding the lock"));
                }
                if self.cleaned[idx(*b)] {
                    return Err(format!("WriteOutputs({b:?}) after its temp dir was cleaned"));
                }
                self.write = Some(*b);
            }
            Command::ReleaseOutputLock => {
                if self.lock_requested.is_none() || self.lock_released {
                    return Err("release without a lock request".into());
                }
                if self.write.is_some() && self.write_result.is_none() {
                    return Err("lock released during the write".into());
                }
                self.lock_released = true;
            }
            Command::CleanupTemp(b) => {
                let i = idx(*b);
                if !self.started[i] || self.cleaned[i] {
                    return Err(format!("cleanup of {b:?}: not started or cleaned twice"));
                }
                if !self.quiescent[i] {
                    return Err(format!("cleanup of {b:?} while it may still write to its temp dir"));
                }
                if self.write == Some(*b) && self.write_result.is_none() {
                    return Err(format!("cleanup of {b:?} during its write"));
                }
                if self.lock_requested == Some(*b) && !self.lock_released {
                    return Err(format!("cleanup of {b:?} while its lock request is active"));
                }
                self.cleaned[i] = true;
            }
            Command::UploadLocalResult => self.uploads += 1,
            Command::Finish(outcome) => {
                for b in Branch::BOTH {
                    let i = idx(b);
                    if self.started[i] && !self.cleaned[i] {
                        return Err(format!("finish with {b:?} not cleaned"));
                    }
                }
                if self.lock_requested.is_some() && !self.lock_released {
                    return Err("finish while the output lock is held or requested".into());
                }
                let expected = self.expected_outcome()?;
                if *outcome != expected {
                    return Err(format!("outcome {outcome:?}, expected {expected:?}"));
                }
                let want_upload = config.upload_local_results
                    && self.aborted.is_none()
                    && expected.winner == Some(Branch::Local)
                    && expected.result == RunResult::Completed { exit_code: 0, from_cache: false };
                if self.uploads != usize::from(want_upload) {
                    return Err(format!("{} uploads, expected {}", self.uploads, usize::from(want_upload)));
                }
                self.finished = Some(outcome.clone());
            }
        }
        Ok(())
    }

    fn expected_outcome(&self) -> Result<Outcome, String> {
        let abort = || self.aborted.clone().ok_or_else(|| "finished without a decision or an abort".to_string());
        Ok(match &self.first {
            Some(First::Failure { branch, reason }) => {
                Outcome { winner: Some(*branch), result: RunResult::BranchFailed { reason: reason.clone() } }
            }
            Some(First::CacheMiss) => Outcome { winner: Some(Branch::Remote), result: RunResult::CacheMiss },
            Some(First::Success { branch, exit_code, from_cache }) => {
                let result = match (&self.write, &self.write_result) {
                    (Some(w), Some(Ok(()))) if w == branch => {
                        RunResult::Completed { exit_code: *exit_code, from_cache: *from_cache }
                    }
                    (Some(w), Some(Err(reason))) if w == branch => {
                        RunResult::OutputsWriteFailed { reason: reason.clone() }
                    }
                    (None, _) => abort()?,
                    other => return Err(format!("inconsistent write state {other:?}")),
                };
                Outcome { winner: Some(*branch), result }
            }
            None => Outcome { winner: None, result: abort()? },
        })
    }
}
