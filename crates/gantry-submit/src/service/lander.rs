//! The lander: the mainline moved for each `Land`, one landing at a time, in version order.
//!
//! One task, so the mainline moves in the queue's order. Each move is recorded as an intent
//! before the compare-and-swap and as done or failed after it, and a finished landing's
//! effects (the change document, the planner told of a failure) are completed at the next
//! start, so a crash at any point neither repeats a move nor loses one. The commit it moves
//! to must be a tree that passed the build steps, hence the combined-tree check when
//! independent changes landed after the build's base.

use std::sync::Arc;

use gantry_core::LandingRow;
use gantry_queue::{ChangeId, Event, LandProof};
use tokio::sync::mpsc;

use super::builds::Verdict;
use super::journal::{doc_row, versions_of, LandingDoc, LandingState};
use super::{blocking, unix_ms, ChangeDoc, ChangeState, Inner, QueueService, Result};
use crate::error::SubmitError;
use crate::git::{short, GitError};

/// What the lander may do for one landing.
enum Move {
    /// Move the mainline to this commit; `how` says why that commit is the tested tree.
    To { commit: String, how: String },
    /// Do not move it, and reject the change for this reason.
    Refuse(String),
    /// The queue is stopping: record nothing; the replay emits the Land again.
    Stopping,
}

impl QueueService {
    pub(super) async fn lander(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<(ChangeId, LandProof)>) {
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
            Some(r) if LandingState::of(&r).is_some_and(LandingState::finished) => return Ok(()),
            Some(intent) => {
                // Crashed between recording the intent and recording the result.
                let (old, new) = (intent.old_commit.clone(), intent.new_commit.clone());
                let head = blocking(move || repo.head()).await?;
                if head == old {
                    let repo = self.repo.clone();
                    let (o, n) = (old.clone(), new.clone());
                    blocking(move || repo.move_mainline(&o, &n)).await?;
                } else if head != new {
                    return self
                        .finish_landing(
                            intent,
                            LandingState::Failed,
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
                    state: LandingState::Intent.as_str().into(),
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
                        return self.finish_landing(row, LandingState::Failed, why, &doc).await;
                    }
                    // Nothing is recorded yet; the journal's replay emits this Land again.
                    Move::Stopping => return Ok(()),
                }
                row.document = serde_json::to_string(&landing_doc)?;
                self.store.put_landing(&row).await?;
                let (o, n) = (old.clone(), row.new_commit.clone());
                if let Err(e) = blocking(move || repo.move_mainline(&o, &n)).await {
                    return self
                        .finish_landing(
                            row,
                            LandingState::Failed,
                            format!("moving {}: {e}", self.settings.mainline),
                            &doc,
                        )
                        .await;
                }
                row
            }
        };
        self.finish_landing(row, LandingState::Done, String::new(), &doc).await
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
        let quick: Result<_, GitError> = blocking(move || {
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
            Err(why) => return Move::Refuse(why.to_string()),
        }
        let (repo, o, patch) = (self.repo.clone(), old.to_string(), doc.patch());
        let candidate = match blocking(move || repo.apply(&patch, &o)).await {
            Ok(c) => c,
            Err(why) => return Move::Refuse(why.to_string()),
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
        state: LandingState,
        why: String,
        doc: &ChangeDoc,
    ) -> Result<()> {
        row.state = state.as_str().into();
        if state == LandingState::Failed {
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
        tracing::info!(change = %doc.id, version = row.version, commit = short(&row.new_commit), state = state.as_str(), "landing recorded");
        if state == LandingState::Failed {
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
        match LandingState::of(row) {
            Some(LandingState::Done) if c.state != ChangeState::Landed => {
                c.state = ChangeState::Landed;
                c.landed_commit = row.new_commit.clone();
                c.landed_version = row.version as u64;
            }
            Some(LandingState::Failed) if c.state != ChangeState::Rejected => {
                c.state = ChangeState::Rejected;
                c.reason = format!("passed its build but the mainline did not move: {why}");
            }
            _ => return Ok(()),
        }
        c.decided_ms.get_or_insert(now);
        self.store.put_change(&doc_row(&c.id, c.seq, c.state.as_str(), c)?).await?;
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
    pub(super) async fn reconcile_landings(self: &Arc<Self>, inner: &mut Inner) -> Result<()> {
        let finished: Vec<LandingRow> = inner
            .landings
            .values()
            .filter(|r| r.version > 0 && LandingState::of(r).is_some_and(LandingState::finished))
            .cloned()
            .collect();
        for row in finished {
            let why = serde_json::from_str::<LandingDoc>(&row.document).map(|d| d.message).unwrap_or_default();
            self.record_landing_in_change(inner, &row, &why).await?;
            if LandingState::of(&row) == Some(LandingState::Failed) {
                self.planner_landing_failed(inner, &row).await?;
            }
        }
        Ok(())
    }
}
