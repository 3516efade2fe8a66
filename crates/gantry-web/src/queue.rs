//! The submit queue page: the pending changes in queue order with the planner's
//! predicted chance that each lands and the speculative builds under way for it (a table
//! and their lanes over time), the changes still being analysed, then the landed,
//! rejected and cancelled history, newest first and paged, with reasons and turnaround.
//!
//! The predicted success is not stored: the queue service computes it from its planner.
//! The planner is deterministic and its journal is stored, so the page rebuilds it by
//! replaying the journal, as the service does when it starts. That reads the whole
//! journal, so it is done only while some change is pending, and its cost grows with the
//! queue's history (the history table itself reads one page).

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use gantry_core::Error;
use gantry_queue::{BuildSpec, Event, Millis, PendingView, Planner, PlannerConfig};
use gantry_submit::service::{BuildDoc, BuildState, ChangeDoc, ChangeState};
use http::StatusCode;
use maud::{html, Markup};
use serde::Deserialize;

use crate::pages::{layout, shorten, utc};
use crate::svg::{self, Bar};
use crate::{failure, server_error, Web, PAGE_SIZE};

/// A speculative build of a pending change: what the planner asked for and, once the
/// service recorded it, its stored document.
#[derive(Debug, Clone)]
pub struct SpeculativeBuild {
    pub spec: BuildSpec,
    pub doc: Option<BuildDoc>,
}

/// A change waiting in the queue.
#[derive(Debug, Clone)]
pub struct PendingChange {
    pub id: String,
    /// None for a change the journal has and the documents lack (written in between).
    pub doc: Option<ChangeDoc>,
    /// The planner's P(lands); None while the change is still being analysed.
    pub predicted_success: Option<f64>,
    pub waits_for: Vec<String>,
    pub builds: Vec<SpeculativeBuild>,
}

/// The part of the queue's version-0 landing document that the page needs: the planner
/// settings the journal was written with, so the replay decides as the service did.
#[derive(Deserialize)]
struct FirstVersion {
    #[serde(default)]
    planner_config: Option<PlannerConfig>,
}

fn decode<T: serde::de::DeserializeOwned>(what: &str, id: &str, text: &str) -> Result<T, Error> {
    serde_json::from_str(text).map_err(|e| Error::internal(format!("queue {what} {id}: undecodable record: {e}")))
}

/// `before=SEQ`: the history page of changes submitted before that one.
pub fn history_cursor(query: Option<&str>) -> Result<Option<i64>, String> {
    match crate::query_param(query, "before")? {
        None => Ok(None),
        Some(v) => {
            v.parse().map(Some).map_err(|_| format!("before: {:?} is not a change sequence number", shorten(&v, 80)))
        }
    }
}

/// A duration as people read it: `12.3 s`, `4 min 10 s`, `2 h 05 min`.
pub fn duration(ms: i64) -> String {
    if ms < 0 {
        return "—".into();
    }
    let s = ms / 1000;
    if s < 60 {
        format!("{:.1} s", ms as f64 / 1000.0)
    } else if s < 3600 {
        format!("{} min {:02} s", s / 60, s % 60)
    } else {
        format!("{} h {:02} min", s / 3600, s % 3600 / 60)
    }
}

fn build_state(b: &SpeculativeBuild) -> (&'static str, usize) {
    // Colours follow the palette: blue running, green passed, red failed, grey cancelled.
    match b.doc.as_ref().map(|d| d.state) {
        None | Some(BuildState::Running) => ("RUNNING", 0),
        Some(BuildState::Passed) => ("PASSED", 2),
        Some(BuildState::Failed) => ("FAILED", 1),
        Some(BuildState::Cancelled) => ("CANCELLED", 7),
    }
}

fn tree_of(spec: &BuildSpec) -> String {
    let mut s = format!("mainline v{}", spec.base_version);
    for c in &spec.assumed {
        s += " + ";
        s += &c.0;
    }
    s
}

fn lanes(pending: &[PendingChange], now_ms: i64) -> Option<Markup> {
    let all: Vec<(&PendingChange, &SpeculativeBuild, &BuildDoc)> =
        pending.iter().flat_map(|p| p.builds.iter().filter_map(move |b| b.doc.as_ref().map(|d| (p, b, d)))).collect();
    let start = all.iter().map(|(_, _, d)| d.started_ms).min()?;
    let bars: Vec<Bar> = all
        .iter()
        .map(|(p, b, d)| {
            let (state, series) = build_state(b);
            let end = d.finished_ms.unwrap_or(now_ms).max(d.started_ms);
            Bar {
                lane: p.id.clone(),
                start: (d.started_ms - start) as f64 / 1000.0,
                end: (end - start) as f64 / 1000.0,
                title: format!("build {} of {} on {}: {state}", b.spec.id.0, p.id, tree_of(&b.spec)),
                marked: false,
                link: None,
                series,
            }
        })
        .collect();
    Some(html! {
        h3 { "Speculative builds over time" }
        (svg::lanes(&bars, &format!("seconds since {}", utc(start))))
        p class="legend" {
            @for (name, i) in [("running", 0), ("passed", 2), ("failed", 1), ("cancelled", 7)] {
                span style=(format!("color:{}", svg::PALETTE[i])) { "■ " } (name) " "
            }
        }
    })
}

fn outcome(state: ChangeState) -> Markup {
    match state {
        ChangeState::Landed => html! { span class="ok" { "LANDED" } },
        ChangeState::Rejected => html! { span class="bad" { "REJECTED" } },
        s => html! { span class="dim" { (s.as_str()) } },
    }
}

/// The queue page: `pending` in queue order, then the decided `history` (newest first);
/// `next` is the cursor of the next history page.
pub fn queue_page(
    pending: &[PendingChange],
    history: &[ChangeDoc],
    next: Option<i64>,
    first: bool,
    now_ms: i64,
) -> Markup {
    layout(
        "Submit queue",
        html! {
            h1 { "Submit queue" }
            @if first && pending.is_empty() && history.is_empty() {
                p { "No changes yet: " code { "gantry queue submit --change BRANCH" } " enqueues one." }
            }
            @if first && !pending.is_empty() {
                h2 { "Pending (" (pending.len()) ")" }
                table {
                    tr { th { "#" } th { "Change" } th { "Author" } th { "Submitted" } th { "Predicted success" }
                         th { "Waits for" } th { "Speculative builds" } }
                    @for (i, p) in pending.iter().enumerate() {
                        tr {
                            td class="n" { (i + 1) }
                            td { code { (p.id) } @if let Some(d) = &p.doc { " " (shorten(&d.change_ref, 60)) } }
                            td { @if let Some(d) = &p.doc { (d.author) } }
                            td { @if let Some(d) = &p.doc { (utc(d.submitted_ms)) } }
                            td class="n" { @match p.predicted_success {
                                Some(s) => (format!("{:.0}%", s * 100.0)),
                                None => span class="dim" { "analysing" },
                            } }
                            td { (p.waits_for.join(", ")) }
                            td { @for b in &p.builds {
                                @let (state, _) = build_state(b);
                                div { "build " (b.spec.id.0) " on " (tree_of(&b.spec))
                                      @if b.spec.attempt > 1 { " (attempt " (b.spec.attempt) ")" }
                                      ": " span class=(match state { "PASSED" => "ok", "FAILED" => "bad", _ => "dim" }) { (state) }
                                      @if let Some(d) = &b.doc { @if !d.message.is_empty() { " " span class="dim" { (shorten(&d.message, 120)) } } } }
                            } }
                        }
                    }
                }
                @if let Some(plot) = lanes(pending, now_ms) { (plot) }
            }
            h2 { "History" }
            @if history.is_empty() {
                p class="dim" { @if first { "Nothing landed or rejected yet." } @else { "No older changes." } }
            } @else {
                table {
                    tr { th { "Change" } th { "Author" } th { "Outcome" } th { "Submitted" } th { "Turnaround" } th { "Landed as / reason" } }
                    @for c in history {
                        tr {
                            td { code { (c.id) } " " (shorten(&c.change_ref, 60)) }
                            td { (c.author) }
                            td { (outcome(c.state)) }
                            td { (utc(c.submitted_ms)) }
                            td class="n" { (c.decided_ms.map_or("—".into(), |d| duration(d - c.submitted_ms))) }
                            td { @if c.state == ChangeState::Landed {
                                    "mainline v" (c.landed_version) " " code { (shorten(&c.landed_commit, 12)) }
                                 } @else { (c.reason) } }
                        }
                    }
                }
                @if let Some(before) = next { p { a href={ "/queue?before=" (before) } { "Older →" } } }
            }
        },
    )
}

/// The planner as the journal left it, kept between page views: each view applies only
/// the events appended since the last one, so the page's cost follows the queue's recent
/// activity, not its whole history. The journal has one writer (the queue's lease
/// holder), which appends in order, so a reader never sees a later entry before an
/// earlier one.
#[derive(Default)]
pub struct Replay {
    /// The last journal entry applied, and the planner after it.
    state: std::sync::Mutex<Option<(i64, Planner)>>,
}

/// The planner's view of the pending changes: the kept planner brought up to date with
/// the journal (or, the first time, rebuilt from the queue's newest snapshot and the
/// journal after it). When retention has deleted entries the kept planner has not seen,
/// it is rebuilt the same way.
async fn replay(web: &Web) -> Result<Vec<PendingView>, Error> {
    // Taken out for the update and put back after, so no lock is held across a read of
    // the store; a concurrent view meanwhile rebuilds its own.
    let kept = web.replay.state.lock().unwrap_or_else(|p| p.into_inner()).take();
    let (mut last, mut planner) = match kept {
        Some(k) => k,
        None => rebuilt(web).await?,
    };
    let mut rows = web.queue.list_events_after(last).await?;
    // The journal is gap-free from 1: a first entry past the next one means the ones
    // between were deleted after a snapshot (maybe a newer one than just read).
    let mut tries = 0;
    while rows.first().is_some_and(|r| r.seq != last + 1) {
        tries += 1;
        if tries > 3 {
            return Err(Error::internal("the queue's journal kept moving past its snapshots".to_string()));
        }
        (last, planner) = rebuilt(web).await?;
        rows = web.queue.list_events_after(last).await?;
    }
    for row in rows {
        let event: Event = decode("journal event", &row.seq.to_string(), &row.event)?;
        // The service refused the same events when it applied them, so skipping them
        // keeps the replay where the service is.
        let _ = planner.handle(Millis(row.at_ms.max(0) as u64), event);
        last = row.seq;
    }
    let views = planner.snapshot();
    let mut slot = web.replay.state.lock().unwrap_or_else(|p| p.into_inner());
    if slot.as_ref().is_none_or(|(seq, _)| *seq < last) {
        *slot = Some((last, planner));
    }
    Ok(views)
}

/// The planner as of the queue's newest snapshot, or a new one before the journal's
/// first entry when there is none.
async fn rebuilt(web: &Web) -> Result<(i64, Planner), Error> {
    if let Some(s) = web.queue.latest_snapshot().await? {
        let planner = Planner::restore_state(&s.state)
            .map_err(|e| Error::internal(format!("the queue's snapshot at journal entry {}: {e}", s.seq)))?;
        return Ok((s.seq, planner));
    }
    let landings = web.queue.list_landings().await?;
    let config = match landings.iter().find(|l| l.version == 0) {
        // A queue from before the settings were kept there planned with its own
        // settings, which the page cannot know: the defaults are the best guess.
        Some(r) => decode::<FirstVersion>("landing", "0", &r.document)?.planner_config.unwrap_or_default(),
        None => PlannerConfig::default(),
    };
    // Journal entries are numbered from 1.
    Ok((0, Planner::new(config)))
}

pub(crate) async fn page(
    State(web): State<Arc<Web>>,
    axum::Extension(caller): axum::Extension<gantry_core::auth::Caller>,
    RawQuery(query): RawQuery,
) -> Response {
    if let Some(refused) = crate::refuse_unless(&caller, gantry_core::auth::Permission::Queue) {
        return refused;
    }
    let before = match history_cursor(query.as_deref()) {
        Ok(b) => b,
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e),
    };
    let first = before.is_none();
    let mut pending = Vec::new();
    if first {
        let open = match web
            .queue
            .list_changes_page(&[ChangeState::Pending.as_str(), ChangeState::Submitted.as_str()], None, 0)
            .await
        {
            Ok(o) => o,
            Err(e) => return server_error(e),
        };
        let mut docs: HashMap<String, ChangeDoc> = HashMap::new();
        for row in &open {
            match decode::<ChangeDoc>("change", &row.id, &row.document) {
                Ok(d) => docs.insert(row.id.clone(), d),
                Err(e) => return server_error(e),
            };
        }
        let views = if open.iter().any(|r| r.state == ChangeState::Pending.as_str()) {
            match replay(&web).await {
                Ok(v) => v,
                Err(e) => return server_error(e),
            }
        } else {
            Vec::new()
        };
        // Build numbers only grow, so the builds of the pending changes are the recent ones.
        let oldest = views.iter().flat_map(|v| v.builds.iter().map(|(s, _)| s.id.0)).min();
        let mut builds: HashMap<u64, BuildDoc> = HashMap::new();
        if let Some(oldest) = oldest {
            let rows = match web.queue.list_builds_from(oldest as i64).await {
                Ok(r) => r,
                Err(e) => return server_error(e),
            };
            for row in &rows {
                match decode::<BuildDoc>("build", &row.id, &row.document) {
                    Ok(d) => builds.insert(row.seq as u64, d),
                    Err(e) => return server_error(e),
                };
            }
        }
        for v in views {
            pending.push(PendingChange {
                doc: docs.remove(&v.change.0),
                id: v.change.0,
                predicted_success: Some(v.landing_probability),
                waits_for: v.waits_for.into_iter().map(|c| c.0).collect(),
                builds: v
                    .builds
                    .into_iter()
                    .map(|(spec, _)| SpeculativeBuild { doc: builds.get(&spec.id.0).cloned(), spec })
                    .collect(),
            });
        }
        // Left: changes still being analysed (not yet in the planner), oldest first.
        let mut analysing: Vec<ChangeDoc> = docs.into_values().collect();
        analysing.sort_by_key(|d| d.seq);
        pending.extend(analysing.into_iter().map(|d| PendingChange {
            id: d.id.clone(),
            doc: Some(d),
            predicted_success: None,
            waits_for: vec![],
            builds: vec![],
        }));
    }
    let decided = [ChangeState::Landed.as_str(), ChangeState::Rejected.as_str(), ChangeState::Cancelled.as_str()];
    let rows = match web.queue.list_changes_page(&decided, before, PAGE_SIZE).await {
        Ok(r) => r,
        Err(e) => return server_error(e),
    };
    let mut history = Vec::with_capacity(rows.len());
    for row in &rows {
        match decode::<ChangeDoc>("change", &row.id, &row.document) {
            Ok(d) => history.push(d),
            Err(e) => return server_error(e),
        }
    }
    let next = (rows.len() == PAGE_SIZE).then(|| rows.last().map(|r| r.seq)).flatten();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    queue_page(&pending, &history, next, first, now).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_queue::{BuildId, ChangeId};

    fn change(id: &str, state: ChangeState) -> ChangeDoc {
        ChangeDoc {
            id: id.into(),
            seq: 1,
            change_ref: "feature".into(),
            commit: "c0ffee".into(),
            merge_base: "base".into(),
            priority: 0,
            author: "dev@example.com".into(),
            state,
            reason: String::new(),
            submitted_ms: 1_700_000_000_000,
            decided_ms: Some(1_700_000_250_000),
            landed_commit: "abcdef0123456789".into(),
            landed_version: 3,
            affected: vec![],
            test_targets: vec![],
            alters_graph: false,
            full_build: false,
        }
    }

    #[test]
    fn markup_in_changes_and_builds_is_escaped() {
        let evil = "<script>alert(1)</script>";
        let mut c = change(evil, ChangeState::Rejected);
        c.change_ref = evil.into();
        c.author = evil.into();
        c.reason = evil.into();
        let spec = BuildSpec {
            id: BuildId(4),
            change: ChangeId(evil.into()),
            base_version: 1,
            assumed: vec![ChangeId(evil.into())],
            attempt: 1,
        };
        let doc = BuildDoc {
            spec: spec.clone(),
            state: BuildState::Failed,
            commit: evil.into(),
            targets: vec![evil.into()],
            started_ms: 1_700_000_000_000,
            finished_ms: None,
            message: evil.into(),
            failed_targets: vec![evil.into()],
        };
        let pending = PendingChange {
            id: evil.into(),
            doc: Some(c.clone()),
            predicted_success: Some(0.5),
            waits_for: vec![evil.into()],
            builds: vec![SpeculativeBuild { spec, doc: Some(doc) }],
        };
        let page = queue_page(&[pending], &[c], Some(3), true, 1_700_000_010_000).into_string();
        assert!(!page.contains("<script>") && page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"), "{page}");
        assert!(page.contains("50%") && page.contains("<svg"), "the prediction and the lanes");
    }

    #[test]
    fn history_shows_turnaround_and_landing_or_reason() {
        let landed = change("c1", ChangeState::Landed);
        let mut rejected = change("c2", ChangeState::Rejected);
        rejected.reason = "build 7 on mainline version 2 failed 2 time(s): tests failed".into();
        rejected.decided_ms = Some(rejected.submitted_ms + 12_300);
        let page = queue_page(&[], &[landed, rejected], None, true, 0).into_string();
        assert!(page.contains("4 min 10 s") && page.contains("12.3 s"), "{page}");
        assert!(page.contains("mainline v3") && page.contains("abcdef012345…"), "{page}");
        assert!(page.contains("failed 2 time(s): tests failed"));
        assert!(!page.contains("Older"));
        let empty = queue_page(&[], &[], None, true, 0).into_string();
        assert!(empty.contains("No changes yet"), "{empty}");
    }

    #[test]
    fn durations_and_the_cursor() {
        assert_eq!(duration(999), "1.0 s");
        assert_eq!(duration(3_600_000 + 5 * 60_000), "1 h 05 min");
        assert_eq!(duration(-1), "—");
        assert_eq!(history_cursor(Some("before=40")), Ok(Some(40)));
        assert_eq!(history_cursor(None), Ok(None));
        assert!(history_cursor(Some("before=c4")).unwrap_err().starts_with("before"));
    }
}
