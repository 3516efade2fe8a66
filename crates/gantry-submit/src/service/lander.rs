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

/// The crash points of a landing, for the tests that prove the recovery above:
/// `queue.batch-landing.<moment>` for a batch, `queue.landing.<moment>` for one change.
fn crash_point(items: &[(ChangeId, LandProof)], moment: &str) {
    if cfg!(debug_assertions) {
        let kind = if items.len() > 1 { "batch-landing" } else { "landing" };
        gantry_core::crash::point(&format!("queue.{kind}.{moment}"));
    }
}

/// What the lander may do for a landing (one change, or a batch).
enum Move {
    /// Move the mainline to the last of these commits, one per change in order; `how`
    /// says why they hold the tested trees.
    To { commits: Vec<String>, how: String },
    /// Do not move it, and reject the changes for this reason.
    Refuse(String),
    /// The queue is stopping: record nothing; the replay emits the Land again.
    Stopping,
}

impl QueueService {
    pub(super) async fn lander(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<(ChangeId, LandProof)>) {
        // The members of a batch arrive as one Land each, in version order, the build's
        // own change last; they land together, in one move, when the last one arrives.
        let mut batch: Vec<(ChangeId, LandProof)> = Vec::new();
        while let Some((change, proof)) = rx.recv().await {
            if batch.first().is_some_and(|(_, p)| p.batch != proof.batch) {
                tracing::error!(change = %change, "a batch landing interleaved with another; the earlier one is dropped");
                batch.clear();
            }
            // A change decided alone (no batch) is a batch of one.
            let last = proof.batch.len() <= 1 || proof.batch.last() == Some(&change);
            batch.push((change.clone(), proof));
            if !last {
                continue;
            }
            if let Err(e) = self.land(&std::mem::take(&mut batch)).await {
                tracing::error!(change = %change, error = %e, "landing failed");
            }
            self.updates.send_modify(|n| *n += 1);
        }
    }

    /// A landing: one change, or a batch whose members land in one move of the mainline,
    /// to the tree that passed. Each member gets its own version and its own commit in
    /// history, but the mainline only ever points at the last one. Every member's landing
    /// is recorded as an intent before the compare-and-swap and as done (or, for all of
    /// them, failed) after it, so a crash at any point neither moves the mainline twice
    /// nor records a member landed without the move.
    async fn land(self: &Arc<Self>, items: &[(ChangeId, LandProof)]) -> Result<()> {
        let (last_change, last) = items.last().expect("a batch has members");
        let first = items[0].1.new_version;
        for (i, (c, p)) in items.iter().enumerate() {
            if p.new_version != first + i as u64 {
                return Err(SubmitError::FailedPrecondition(format!(
                    "batch landing of {c} at version {}: expected version {}",
                    p.new_version,
                    first + i as u64
                )));
            }
        }
        let (existing, docs, build) = {
            let inner = self.inner.lock().await;
            let existing: Vec<Option<LandingRow>> =
                items.iter().map(|(_, p)| inner.landings.get(&p.new_version).cloned()).collect();
            let docs = items
                .iter()
                .map(|(c, _)| inner.changes.get(&c.0).cloned().ok_or_else(|| SubmitError::NotFound(c.0.clone())))
                .collect::<Result<Vec<ChangeDoc>>>()?;
            (existing, docs, inner.builds.get(&last.build.id.0).cloned())
        };
        if existing.iter().all(|r| r.as_ref().and_then(LandingState::of).is_some_and(LandingState::finished)) {
            return Ok(());
        }
        let old = self.versions.borrow().get(first - 1).cloned().ok_or_else(|| {
            SubmitError::FailedPrecondition(format!("landing version {first} before version {}", first - 1))
        })?;
        // A member's landing before anything is known of it: the mainline stays at `old`.
        let intent = |(c, p): &(ChangeId, LandProof)| LandingRow {
            version: p.new_version as i64,
            change_id: c.0.clone(),
            old_commit: old.clone(),
            new_commit: old.clone(),
            state: LandingState::Intent.as_str().into(),
            document: String::new(),
        };
        if let Some(failed) = existing.iter().flatten().find(|r| LandingState::of(r) == Some(LandingState::Failed)) {
            // Crashed while recording the batch's failure: record it for the rest.
            let why = serde_json::from_str::<LandingDoc>(&failed.document).map(|d| d.message).unwrap_or_default();
            let rows = existing.iter().zip(items).map(|(r, item)| r.clone().unwrap_or_else(|| intent(item)));
            return self.fail_batch(rows.collect(), &old, why, &docs).await;
        }
        let repo = self.repo.clone();
        let rows: Vec<LandingRow> = if let Some(Some(last_row)) =
            existing.last().filter(|_| existing.iter().all(Option::is_some))
        {
            // Crashed after recording every intent: the move happened iff the mainline
            // is at the last member's commit, or past it (pushed onto after the move and
            // before this restart), or a member was already recorded landed.
            let rows: Vec<LandingRow> = existing.iter().flatten().cloned().collect();
            let new = last_row.new_commit.clone();
            let head = blocking(move || repo.head()).await?;
            let recorded = rows.iter().any(|r| LandingState::of(r) == Some(LandingState::Done));
            if !recorded && head != new {
                if head == old {
                    let (o, n, repo) = (old.clone(), new.clone(), self.repo.clone());
                    blocking(move || repo.move_mainline(&o, &n)).await?;
                } else {
                    let (n, h, repo) = (new.clone(), head.clone(), self.repo.clone());
                    if !blocking(move || repo.is_ancestor(&n, &h)).await? {
                        let why = format!("the mainline moved outside the queue (to {})", short(&head));
                        return self.fail_batch(rows, &old, why, &docs).await;
                    }
                }
            }
            rows
        } else {
            let landing_doc =
                |how: String| LandingDoc { build_id: last.build.id.0, landed_ms: unix_ms(), how, ..Default::default() };
            let mut rows: Vec<LandingRow> = items.iter().map(intent).collect();
            let tested = build.map(|b| b.commit).unwrap_or_default();
            let commits = match self.landing_commits(&docs, &old, &tested, last).await {
                Move::To { commits, how } => {
                    let mut prev = old.clone();
                    for (i, (row, commit)) in rows.iter_mut().zip(commits).enumerate() {
                        row.old_commit = std::mem::replace(&mut prev, commit.clone());
                        row.new_commit = commit;
                        let h = if i + 1 == items.len() {
                            how.clone()
                        } else {
                            format!("batch with {last_change} ({how}): not built alone")
                        };
                        row.document = serde_json::to_string(&landing_doc(h))?;
                    }
                    rows
                }
                Move::Refuse(why) => {
                    for row in &mut rows {
                        row.document = serde_json::to_string(&landing_doc(String::new()))?;
                    }
                    return self.fail_batch(rows, &old, why, &docs).await;
                }
                Move::Stopping => return Ok(()),
            };
            for row in &commits {
                self.store.put_landing(row).await?;
                crash_point(items, "first-intent");
            }
            crash_point(items, "before-move");
            let (o, n) = (old.clone(), commits.last().expect("not empty").new_commit.clone());
            if let Err(e) = blocking(move || repo.move_mainline(&o, &n)).await {
                let why = format!("moving {}: {e}", self.settings.mainline);
                return self.fail_batch(commits, &old, why, &docs).await;
            }
            crash_point(items, "after-move");
            commits
        };
        for (row, doc) in rows.into_iter().zip(&docs) {
            self.finish_landing(row, LandingState::Done, String::new(), doc).await?;
            crash_point(items, "first-done");
        }
        Ok(())
    }

    /// Every member of a batch rejected: the mainline stays at `old`.
    async fn fail_batch(
        self: &Arc<Self>,
        rows: Vec<LandingRow>,
        old: &str,
        why: String,
        docs: &[ChangeDoc],
    ) -> Result<()> {
        for (mut row, doc) in rows.into_iter().zip(docs) {
            row.old_commit = old.to_string();
            self.finish_landing(row, LandingState::Failed, why.clone(), doc).await?;
        }
        Ok(())
    }

    /// The commit of each change of a landing on `old` (one change, or a batch's
    /// members in order), given the commit their deciding build tested: that build's own
    /// chain of commits when it sits on `old` (a fast-forward), commits with the same
    /// trees when it sits on `old`'s tree; otherwise (independent changes landed since,
    /// a change of the tested tree was rejected, or a change decided by attribution)
    /// the changes applied on `old` in order, whose tree must pass their build steps
    /// first: the combined-tree check.
    async fn landing_commits(self: &Arc<Self>, docs: &[ChangeDoc], old: &str, tested: &str, proof: &LandProof) -> Move {
        if tested.is_empty() {
            return Move::Refuse("the deciding build left no commit".into());
        }
        // The tested chain is base, then the assumed changes, then the build's change,
        // one commit each: its tail is the batch when the batch is the tail of that list.
        let spec = &proof.build;
        let members: Vec<&ChangeId> = spec.assumed.iter().chain([&spec.change]).collect();
        let tail = members.len() >= docs.len()
            && members[members.len() - docs.len()..]
                .iter()
                .map(|c| c.0.as_str())
                .eq(docs.iter().map(|d| d.id.as_str()));
        if tail && proof.omitted.is_empty() && !proof.by_attribution {
            let (repo, o, t, likes) = (
                self.repo.clone(),
                old.to_string(),
                tested.to_string(),
                docs.iter().map(|d| d.commit.clone()).collect::<Vec<_>>(),
            );
            let quick: Result<_, GitError> = blocking(move || {
                let mut chain = vec![t];
                for _ in 1..likes.len() {
                    let p = repo.parent(chain.last().expect("not empty"))?;
                    chain.push(p);
                }
                chain.reverse();
                let below = repo.parent(&chain[0])?;
                if below == o {
                    return Ok(Some((chain, "fast-forward".to_string())));
                }
                if repo.tree(&below)? == repo.tree(&o)? {
                    let mut prev = o;
                    let mut out = Vec::new();
                    for (c, like) in chain.iter().zip(&likes) {
                        prev = repo.commit_like(like, &repo.tree(c)?, &prev)?;
                        out.push(prev.clone());
                    }
                    return Ok(Some((out, "same-tree".to_string())));
                }
                Ok(None)
            })
            .await;
            match quick {
                Ok(Some((commits, how))) => return Move::To { commits, how },
                Ok(None) => {}
                Err(why) => return Move::Refuse(why.to_string()),
            }
        }
        let (repo, o, patches) =
            (self.repo.clone(), old.to_string(), docs.iter().map(ChangeDoc::patch).collect::<Vec<_>>());
        let applied: Result<Vec<String>, GitError> = blocking(move || {
            let mut prev = o;
            let mut out = Vec::new();
            for p in &patches {
                prev = repo.apply(p, &prev)?;
                out.push(prev.clone());
            }
            Ok(out)
        })
        .await;
        let commits = match applied {
            Ok(c) => c,
            Err(why) => return Move::Refuse(why.to_string()),
        };
        let candidate = commits.last().expect("a batch has members").clone();
        let names: Vec<&str> = docs.iter().map(|d| d.id.as_str()).collect();
        match self.verify(&candidate, &Self::targets_of(docs), &names.join(", ")).await {
            Move::To { how, .. } => Move::To { commits, how },
            other => other,
        }
    }

    /// The combined-tree check: the build steps on `candidate`, the changes `what`
    /// applied on the mainline with the independent changes landed since their build.
    /// An infrastructure error in it is not a verdict; it is tried again after a backoff.
    async fn verify(self: &Arc<Self>, candidate: &str, targets: &[String], what: &str) -> Move {
        let mut retry = 0;
        loop {
            let verdict = {
                // Held for one try only: the analyzer shares this runner.
                let aux = self.aux.lock().await;
                let (repo, c, dir) = (self.repo.clone(), candidate.to_string(), aux.dir().to_path_buf());
                match blocking(move || gantry_builds::workspace::checkout(&repo.path, &c, &dir)).await {
                    Ok(tree) => self.run_steps(&aux, &tree, targets).await,
                    Err(e) => Verdict::Infra(format!("checking out {}: {e}", short(candidate))),
                }
            };
            match verdict {
                Verdict::Passed => return Move::To { commits: vec![candidate.to_string()], how: "verified".into() },
                Verdict::Failed(message) => {
                    return Move::Refuse(format!(
                        "the combined-tree check failed: {what} on the mainline with the independent changes landed since its build ({}) failed the build steps: {message}",
                        short(candidate)
                    ))
                }
                Verdict::Infra(_) if self.stopping() => return Move::Stopping,
                Verdict::Infra(why) => {
                    let wait = self.infra_retry(&format!("combined-tree check of {what}"), retry, &why);
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
