//! The live page: workers with what they run, the queues, and queue depth over the last
//! hour. The page is whole without JavaScript; a few lines of script replace its live
//! part every [`POLL_MS`] with `/workers/live`, the same fragment rendered again.
//! Depth over time comes from [`QueueHistory`], sampled by a named task while the server
//! runs, because the scheduler itself keeps only the present.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use gantry_core::task::{spawn_named, TaskGuard};
use gantry_core::{Fleet, FleetSnapshot};
use maud::{html, Markup, PreEscaped};

use crate::pages::{action_link, layout, shorten};
use crate::svg;
use crate::Web;

/// How often the page refreshes its live part, and the sampler records depth.
pub const POLL_MS: u64 = 2000;
/// Samples kept: an hour at one per [`POLL_MS`].
pub const HISTORY: usize = 1800;

/// One sample: when, the queued actions by size class (None: any class), and runs.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub at_unix_ms: i64,
    pub queued: BTreeMap<Option<u32>, usize>,
    pub running: usize,
}

impl Sample {
    pub fn of(snapshot: &FleetSnapshot, at_unix_ms: i64) -> Self {
        let mut queued = BTreeMap::new();
        for q in &snapshot.queues {
            *queued.entry(q.size_class).or_insert(0) += q.depth;
        }
        Sample { at_unix_ms, queued, running: snapshot.running }
    }
}

/// The last [`HISTORY`] samples, oldest first.
#[derive(Debug, Default)]
pub struct QueueHistory {
    samples: Mutex<VecDeque<Sample>>,
}

impl QueueHistory {
    pub fn push(&self, s: Sample) {
        let mut q = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() == HISTORY {
            q.pop_front();
        }
        q.push_back(s);
    }

    pub fn samples(&self) -> Vec<Sample> {
        self.samples.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect()
    }
}

/// Records the fleet's queue depth every [`POLL_MS`] until the guard is dropped.
pub fn start_sampler(fleet: Arc<dyn Fleet>, history: Arc<QueueHistory>) -> TaskGuard {
    spawn_named("queue-depth-sampler", async move {
        let mut tick = tokio::time::interval(Duration::from_millis(POLL_MS));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tick.tick().await;
            let snap = fleet.snapshot();
            history.push(Sample::of(&snap, now_ms()));
        }
    })
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn class_name(c: Option<u32>) -> String {
    c.map_or_else(|| "any class".to_string(), |c| format!("class {c}"))
}

fn platform(p: &[(String, String)]) -> String {
    if p.is_empty() {
        "(any)".into()
    } else {
        p.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ")
    }
}

fn ago(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms} ms")
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

/// The live part: totals, queues, depth over time and the workers.
pub fn live_part(snap: &FleetSnapshot, history: &[Sample]) -> Markup {
    let slots: usize = snap.workers.iter().map(|w| w.slots).sum();
    let busy: usize = snap.workers.iter().map(|w| w.busy).sum();
    // One line per size class seen in the window, and one for the runs.
    let classes: std::collections::BTreeSet<Option<u32>> =
        history.iter().flat_map(|s| s.queued.keys().copied()).collect();
    let t0 = history.first().map_or(0, |s| s.at_unix_ms);
    let at = |s: &Sample| (s.at_unix_ms - t0) as f64 / 1000.0;
    let mut series: Vec<svg::Series> = classes
        .iter()
        .map(|c| svg::Series {
            name: format!("queued, {}", class_name(*c)),
            points: history.iter().map(|s| (at(s), s.queued.get(c).copied().unwrap_or(0) as f64)).collect(),
        })
        .collect();
    series.push(svg::Series {
        name: "running".into(),
        points: history.iter().map(|s| (at(s), s.running as f64)).collect(),
    });
    html! {
        p id="totals" {
            b { (snap.workers.len()) } " workers, " b { (busy) } " of " b { (slots) } " slots busy; "
            b { (snap.queued) } " actions queued, " b { (snap.running) } " running."
        }
        h2 { "Queues" }
        @if snap.queues.is_empty() {
            p class="dim" { "Nothing is waiting." }
        } @else {
            table {
                tr { th { "Platform" } th { "Size class" } th { "Waiting" } }
                @for q in &snap.queues {
                    tr { td { code { (platform(&q.platform)) } } td { (class_name(q.size_class)) } td class="n" { (q.depth) } }
                }
            }
        }
        h2 { "Queue depth" }
        @if history.len() < 2 {
            p class="dim" { "Sampled every " (POLL_MS / 1000) " s; the plot appears after two samples." }
        } @else {
            (svg::lines(&series, "seconds ago", "actions", &|x| {
                let back = (history.last().map_or(0, |s| s.at_unix_ms) - t0) as f64 / 1000.0 - x;
                svg::tick_label(back.max(0.0).round())
            }))
        }
        h2 { "Workers" }
        @if snap.workers.is_empty() {
            p class="dim" { "No worker is registered. Start one with " code { "gantry worker --scheduler grpc://HOST:PORT" } "." }
        } @else {
            table {
                tr { th { "Worker" } th { "Size class" } th { "Slots busy" } th { "Platform" } th { "Metering" }
                     th { "Last seen" } th { "Running" } }
                @for w in &snap.workers {
                    tr {
                        td { code { (w.name) } }
                        td class="n" { (w.size_class) }
                        td class="n" { (w.busy) " / " (w.slots) }
                        td { (platform(&w.platform)) }
                        td { (w.metering) }
                        td { @if w.local { span class="dim" { "in process" } } @else { (ago(w.last_seen_ms)) " ago" } }
                        td {
                            @for r in &w.running {
                                div {
                                    @match action_link(&r.instance, &r.action_digest) {
                                        Some(l) => a href=(l) { (if r.mnemonic.is_empty() { "action" } else { &r.mnemonic }) },
                                        None => (r.mnemonic),
                                    }
                                    " " code { (shorten(&r.target, 60)) } " "
                                    span class="dim" { (ago(r.running_ms)) }
                                    @if r.hedge { " " span class="bad" title="a copy on the largest class racing a slow run" { "hedge" } }
                                    @if !r.tool_invocation_id.is_empty() {
                                        " " a href={ "/invocations/" (r.tool_invocation_id) } { "invocation" }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The snapshot with the runs of instances the caller may not read left out (the
/// workers and queue depths say nothing about any instance's actions).
fn visible(mut snap: FleetSnapshot, caller: &gantry_core::auth::Caller) -> FleetSnapshot {
    for w in &mut snap.workers {
        w.running.retain(|r| crate::may_read(caller, &r.instance));
    }
    snap
}

/// Replaces the live part with a fresh copy every [`POLL_MS`]; a failed fetch leaves
/// the last one and says so.
const SCRIPT: &str = r#"(function(){var live=document.getElementById('live'),note=document.getElementById('stale');
setInterval(function(){fetch('/workers/live',{credentials:'same-origin'}).then(function(r){if(!r.ok)throw r.status;return r.text();})
.then(function(h){live.innerHTML=h;note.textContent='';}).catch(function(e){note.textContent='(not updating: '+e+')';});},POLL);})();"#;

/// The whole workers page.
pub fn page(snap: Option<&FleetSnapshot>, history: &[Sample]) -> Markup {
    layout(
        "Workers and queue",
        html! {
            h1 { "Workers and queue " span id="stale" class="dim" {} }
            @match snap {
                None => p { "This server runs no scheduler (it is a frontend, or serves caches only), so it has no workers or queue to show." },
                Some(snap) => {
                    div id="live" { (live_part(snap, history)) }
                    script { (PreEscaped(SCRIPT.replace("POLL", &POLL_MS.to_string()))) }
                }
            }
        },
    )
}

pub(crate) async fn workers(
    State(web): State<Arc<Web>>,
    axum::Extension(caller): axum::Extension<gantry_core::auth::Caller>,
) -> Response {
    if let Some(refused) = crate::refuse_unless(&caller, gantry_core::auth::Permission::Read) {
        return refused;
    }
    let snap = web.fleet.as_ref().map(|f| visible(f.snapshot(), &caller));
    page(snap.as_ref(), &web.history.samples()).into_response()
}

pub(crate) async fn workers_live(
    State(web): State<Arc<Web>>,
    axum::Extension(caller): axum::Extension<gantry_core::auth::Caller>,
) -> Response {
    if let Some(refused) = crate::refuse_unless(&caller, gantry_core::auth::Permission::Read) {
        return refused;
    }
    match &web.fleet {
        Some(f) => live_part(&visible(f.snapshot(), &caller), &web.history.samples()).into_response(),
        None => crate::failure(http::StatusCode::NOT_FOUND, "this server runs no scheduler"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_core::{QueueView, RunningView, WorkerView};

    fn snapshot() -> FleetSnapshot {
        let evil = "<script>alert(1)</script>";
        FleetSnapshot {
            workers: vec![WorkerView {
                name: evil.into(),
                size_class: 4,
                slots: 2,
                busy: 1,
                platform: vec![("OSFamily".into(), evil.into())],
                last_seen_ms: 1500,
                local: false,
                metering: "cgroup-v1".into(),
                running: vec![RunningView {
                    operation: "op".into(),
                    instance: "main".into(),
                    action_digest: format!("{}/12", "a".repeat(64)),
                    mnemonic: "CppCompile".into(),
                    target: evil.into(),
                    tool_invocation_id: "inv-1".into(),
                    running_ms: 2500,
                    hedge: true,
                }],
            }],
            queues: vec![
                QueueView { platform: vec![], size_class: Some(1), depth: 3 },
                QueueView { platform: vec![], size_class: None, depth: 2 },
            ],
            queued: 5,
            running: 1,
        }
    }

    #[test]
    fn the_live_part_shows_workers_runs_and_queues_escaped() {
        let snap = snapshot();
        let history: Vec<Sample> = (0..3).map(|i| Sample::of(&snap, 1_000 + i * 2000)).collect();
        assert_eq!(history[0].queued, [(None, 2), (Some(1), 3)].into());
        let html = page(Some(&snap), &history).into_string();
        assert!(!html.contains("<script>alert"), "markup must be escaped");
        assert!(html.contains("&lt;script&gt;alert(1)"));
        assert!(
            html.contains(&format!("/actions/{}/12?instance=main", "a".repeat(64))),
            "the running action is linked"
        );
        assert!(html.contains("/invocations/inv-1"));
        assert!(html.contains(">hedge<"));
        assert!(html.contains("1 of <b>2</b>") || html.contains("<b>1</b> of <b>2</b>"), "{html}");
        assert!(html.contains("1.5 s ago"));
        assert!(html.contains("<svg"), "depth over time is plotted");
        assert!(html.contains("queued, class 1") && html.contains("queued, any class"));
        // The poller asks for the same fragment.
        assert!(html.contains("fetch('/workers/live'"));
        assert!(page(None, &[]).into_string().contains("runs no scheduler"));
    }

    #[test]
    fn history_keeps_the_last_hour() {
        let h = QueueHistory::default();
        for i in 0..HISTORY + 10 {
            h.push(Sample { at_unix_ms: i as i64, queued: BTreeMap::new(), running: i });
        }
        let s = h.samples();
        assert_eq!(s.len(), HISTORY);
        assert_eq!(s[0].running, 10);
        assert_eq!(s.last().unwrap().running, HISTORY + 9);
    }
}
