//! The analyzer task: a submitted change applied on the mainline, its affected targets found
//! with `bazel query`, and the change enqueued with them.
//!
//! The planner can only run changes in parallel when it knows which of them may conflict,
//! so no change enters the queue unanalysed; one that cannot be analysed enters as
//! depending on all others (a full build). The query output's parsing is in
//! [`crate::analyzer`]; this is the part that needs the service: the aux runner, the
//! store's graph cache and the planner. Graphs are kept by commit because the mainline's
//! graph serves every change analysed against it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use gantry_builds::runner::Runner;
use gantry_queue::{ChangeAnalysis, ChangeFeatures, ChangeId, ConflictAnalyzer, Event, TargetGraph};

use super::journal::doc_row;
use super::{blocking, ChangeDoc, ChangeState, Inner, QueueService, Result};
use crate::analyzer;
use crate::git::{short, GitError};

impl QueueService {
    pub(super) async fn analyzer_loop(self: Arc<Self>) {
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
            Ok::<_, GitError>((repo.apply(&patch, &h), files, lines, paths, author))
        })
        .await?;
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
                self.store.put_change(&doc_row(&doc.id, doc.seq, doc.state.as_str(), &doc)?).await?;
                inner_doc_update(&mut inner, &doc);
                self.updates.send_modify(|n| *n += 1);
                return Ok(());
            }
        };
        let analysis = match self.analyze(&head, &speculative).await {
            Ok(a) => Some(analyzer::with_changed_paths(a, &paths)),
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
        let event = Event::Enqueue { change: ChangeId(doc.id.clone()), features, analysis, priority: doc.priority };
        self.apply(&mut inner, event, Some(format!("enqueue:{}", doc.id))).await?;
        self.store.put_change(&doc_row(&doc.id, doc.seq, doc.state.as_str(), &doc)?).await?;
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
            Ok::<_, String>((tree, repo.file_digests(&c).map_err(|e| e.to_string())?))
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
}

/// Target graphs by commit, and gantry-queue's analyzer memoising hashes and analyses
/// over them. Commits are never forgotten while gantry runs: a graph is small next to
/// the Bazel server that produced it, and the store keeps them across restarts.
#[derive(Default)]
pub(super) struct Graphs {
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
