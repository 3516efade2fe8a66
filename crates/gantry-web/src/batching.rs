//! The batching pages: the builds the batching service planned, newest first and paged,
//! with each build's reason, its memory and occupancy estimates beside what it measured,
//! its outcome and retries; the estimate error over the recent builds, as numbers and as
//! scatters; and one build with its document, targets and retry tree (OOM splits and
//! deadline reruns, up to the build the stream planned and down to the last retry).
//!
//! The models' versions are not recorded anywhere the web can read (they live in the
//! batching service's model directory, and a build does not say which models planned it),
//! so the error is shown per build rather than per model version.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use gantry_builds::{BuildDoc, BuildOutcome, RetryKind};
use gantry_core::{BuildQuery, BuildRow, Error};
use http::StatusCode;
use maud::{html, Markup};
use serde::Deserialize;

use crate::pages::{layout, shorten, utc};
use crate::svg::{self, Point};
use crate::{failure, server_error, Web, PAGE_SIZE};

/// How many of the newest builds the error summary and the scatters cover: enough for a
/// shape, few enough that a page decodes them quickly (a build may hold 900 targets).
pub const ERROR_WINDOW: usize = 200;
/// Most builds of one retry family read for a build's page; a family is a handful of
/// builds (halves of halves), so this only stops a corrupt parent/retry loop.
const MAX_FAMILY: usize = 256;

/// The `before=MS:ID` cursor: the creation time and id of the last build of the
/// previous page (both, since split halves share a millisecond).
pub fn cursor(query: Option<&str>) -> Result<Option<(i64, String)>, String> {
    let Some(v) = crate::query_param(query, "before")? else { return Ok(None) };
    let bad = || format!("before: {:?} is not CREATED_UNIX_MS:BUILD_ID", shorten(&v, 80));
    let (ms, id) = v.split_once(':').ok_or_else(bad)?;
    let ms = ms.parse::<i64>().map_err(|_| bad())?;
    if id.is_empty() {
        return Err(bad());
    }
    Ok(Some((ms, id.to_string())))
}

fn decode(row: &BuildRow) -> Result<BuildDoc, Error> {
    BuildDoc::from_row(row).map_err(|e| Error::internal(e.to_string()))
}

/// The fields of a build's document the error summary needs. Decoding only these skips
/// the targets without allocating them, which is most of a large build's document.
#[derive(Debug, Clone, Deserialize)]
pub struct Estimates {
    pub id: String,
    pub outcome: Option<BuildOutcome>,
    pub memory_estimate_bytes: Option<u64>,
    pub used_heap_post_build: Option<u64>,
    pub occupancy_estimate_esu: Option<f64>,
    pub occupancy_esu: Option<f64>,
    #[serde(default)]
    pub models_trained_at: Option<i64>,
}

impl From<&BuildDoc> for Estimates {
    fn from(d: &BuildDoc) -> Self {
        Estimates {
            id: d.id.clone(),
            outcome: d.outcome,
            memory_estimate_bytes: d.memory_estimate_bytes,
            used_heap_post_build: d.used_heap_post_build,
            occupancy_estimate_esu: d.occupancy_estimate_esu,
            occupancy_esu: d.occupancy_esu,
            models_trained_at: d.models_trained_at,
        }
    }
}

/// One model version's row: when the models were trained (None: planned without models),
/// its builds, and their memory and occupancy error.
pub type ModelError = (Option<i64>, usize, Option<ErrorSummary>, Option<ErrorSummary>);

/// The error of each model version's builds in `window`, newest version first; builds
/// planned without models come last.
pub fn error_by_model(window: &[Estimates]) -> Vec<ModelError> {
    let mut versions: Vec<Option<i64>> = window.iter().map(|e| e.models_trained_at).collect();
    versions.sort_by(|a, b| b.cmp(a));
    versions.dedup();
    versions
        .into_iter()
        .map(|v| {
            let of: Vec<&Estimates> = window.iter().filter(|e| e.models_trained_at == v).collect();
            let memory: Vec<(f64, f64)> = of.iter().filter_map(|e| e.memory()).collect();
            let occupancy: Vec<(f64, f64)> = of.iter().filter_map(|e| e.occupancy()).collect();
            (v, of.len(), error_summary(&memory), error_summary(&occupancy))
        })
        .collect()
}

impl Estimates {
    /// Estimated and measured memory in bytes. An OOM build has no measurement (it
    /// needed more than the heap), so it has no pair.
    pub fn memory(&self) -> Option<(f64, f64)> {
        if self.outcome == Some(BuildOutcome::Oom) {
            return None;
        }
        Some((self.memory_estimate_bytes? as f64, self.used_heap_post_build? as f64))
    }

    /// Estimated and measured executor occupancy in ESU. A build that never reached the
    /// executors (infrastructure error) measured nothing meaningful.
    pub fn occupancy(&self) -> Option<(f64, f64)> {
        if matches!(self.outcome, None | Some(BuildOutcome::InfraError)) {
            return None;
        }
        Some((self.occupancy_estimate_esu?, self.occupancy_esu?))
    }
}

/// Error of a set of estimate/actual pairs.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorSummary {
    pub n: usize,
    /// Median of |estimate − actual| / actual, in percent.
    pub median_abs_pct: f64,
    /// Median of (estimate − actual) / actual, in percent: negative means underestimates.
    pub median_pct: f64,
    /// Pairs whose actual was above the estimate.
    pub under: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// The error of `pairs` (estimate, actual); pairs with no actual (0) are left out, as a
/// relative error of them means nothing.
pub fn error_summary(pairs: &[(f64, f64)]) -> Option<ErrorSummary> {
    let rel: Vec<f64> = pairs.iter().filter(|(_, a)| *a > 0.0).map(|(e, a)| (e - a) / a * 100.0).collect();
    if rel.is_empty() {
        return None;
    }
    let under = pairs.iter().filter(|(e, a)| *a > 0.0 && a > e).count();
    Some(ErrorSummary {
        n: rel.len(),
        median_abs_pct: median(rel.iter().map(|r| r.abs()).collect()),
        median_pct: median(rel),
        under,
    })
}

const GIB: f64 = (1u64 << 30) as f64;

fn gib(bytes: Option<u64>) -> String {
    bytes.map_or("—".into(), |b| format!("{:.2} GiB", b as f64 / GIB))
}

fn esu(v: Option<f64>) -> String {
    v.map_or("—".into(), |v| format!("{v:.1}"))
}

fn kind(k: Option<RetryKind>) -> &'static str {
    match k {
        None => "planned",
        Some(RetryKind::OomSplit) => "OOM split",
        Some(RetryKind::DeadlineRerun) => "deadline rerun",
    }
}

fn reason_name(d: &BuildDoc) -> String {
    // The stored name, so the page says what `gantry batch` and the API say.
    serde_json::to_value(d.reason).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
}

fn outcome(d: &BuildDoc) -> Markup {
    match d.outcome {
        Some(BuildOutcome::Success) => html! { span class="ok" { "SUCCESS" } },
        Some(o) => html! { span class="bad" { (o.as_str()) } },
        None => html! { span class="dim" { (d.state.as_str()) } },
    }
}

fn build_link(id: &str) -> String {
    format!("/batching/builds/{}", crate::pages::percent_encode(id))
}

/// The link to the page after one ending with `last`.
pub fn next_link(last: &(i64, String)) -> String {
    format!("/batching?before={}:{}", last.0, crate::pages::percent_encode(&last.1))
}

fn scatters(window: &[Estimates]) -> Markup {
    let oom = window.iter().filter(|e| e.outcome == Some(BuildOutcome::Oom)).count();
    let point = |e: &Estimates, (est, act): (f64, f64), unit: &str, scale: f64| Point {
        x: est / scale,
        y: act / scale,
        title: format!("{}: estimate {:.2} {unit}, actual {:.2} {unit}", e.id, est / scale, act / scale),
        series: usize::from(e.outcome != Some(BuildOutcome::Success)),
    };
    let memory: Vec<(f64, f64)> = window.iter().filter_map(Estimates::memory).collect();
    let occupancy: Vec<(f64, f64)> = window.iter().filter_map(Estimates::occupancy).collect();
    let mem_points: Vec<Point> = window.iter().filter_map(|e| e.memory().map(|p| point(e, p, "GiB", GIB))).collect();
    let occ_points: Vec<Point> = window.iter().filter_map(|e| e.occupancy().map(|p| point(e, p, "ESU", 1.0))).collect();
    let summary = |name: &str, s: Option<ErrorSummary>| match s {
        None => html! { li { (name) ": no finished build has both an estimate and a measurement yet." } },
        Some(s) => html! {
            li { (name) ": median error " strong { (format!("{:.1}%", s.median_abs_pct)) }
                 " (median bias " (format!("{:+.1}%", s.median_pct)) "), "
                 (s.under) " of " (s.n) " builds needed more than estimated." }
        },
    };
    html! {
        h2 { "Estimate error" }
        p class="dim" { "Over the newest " (window.len()) " builds; memory is the used heap after the build." }
        ul {
            (summary("Memory", error_summary(&memory)))
            (summary("Occupancy", error_summary(&occupancy)))
            @if oom > 0 { li { (oom) " ran out of memory: they needed more than the heap and are not plotted." } }
        }
        h3 { "By model version" }
        table {
            tr { th { "Models trained" } th { "Builds" } th { "Memory median error" } th { "Occupancy median error" } }
            @for (version, n, mem, occ) in error_by_model(window) {
                tr {
                    td { @match version {
                        Some(t) => (crate::pages::utc(t.saturating_mul(1000))),
                        None => span class="dim" { "no models (fallback size)" },
                    } }
                    td class="n" { (n) }
                    @for s in [mem, occ] {
                        td class="n" { @match s {
                            Some(s) => { (format!("{:.1}%", s.median_abs_pct)) " " span class="dim" { "(" (s.n) ")" } },
                            None => span class="dim" { "—" },
                        } }
                    }
                }
            }
        }
        h3 { "Memory: estimate against actual" }
        (svg::scatter(&mem_points, "estimated GiB", "used heap after the build, GiB", true))
        h3 { "Occupancy: estimate against actual" }
        (svg::scatter(&occ_points, "estimated ESU", "measured ESU", true))
        (svg::legend(["succeeded", "failed or retried"].into_iter()))
        p class="dim" { "Points above the dashed line needed more than estimated." }
    }
}

/// The list of builds, newest first, with the error of the newest `window`; `next` is the
/// cursor of the following page.
pub fn builds_page(rows: &[BuildDoc], window: &[Estimates], next: Option<&(i64, String)>, first: bool) -> Markup {
    layout(
        "Batching",
        html! {
            h1 { "Batched builds" }
            @if rows.is_empty() && first {
                p { "No batched builds yet: " code { "gantry batch < targets.txt" } " sends targets to the batching
                    service, which plans them into builds shown here." }
            } @else if rows.is_empty() {
                p class="dim" { "No older builds." }
            } @else {
                table {
                    tr { th { "Build" } th { "Stream" } th { "Targets" } th { "Reason" } th { "Memory est." } th { "Memory actual" }
                         th { "Occupancy est." } th { "Occupancy actual" } th { "Outcome" } th { "Retries" } th { "Invocation" } }
                    @for d in rows {
                        tr {
                            td { a href=(build_link(&d.id)) { code { (d.id) } }
                                 @if d.retry_kind.is_some() { " " span class="dim" { "(" (kind(d.retry_kind)) ")" } } }
                            td { code { (shorten(&d.stream_id, 40)) } }
                            td class="n" { (d.targets.len()) }
                            td { (reason_name(d)) }
                            td class="n" { (gib(d.memory_estimate_bytes)) }
                            td class="n" { @if d.outcome == Some(BuildOutcome::Oom) { span class="bad" { "OOM" } }
                                           @else { (gib(d.used_heap_post_build)) } }
                            td class="n" { (esu(d.occupancy_estimate_esu)) }
                            td class="n" { (esu(d.occupancy_esu)) }
                            td { (outcome(d)) }
                            td { @for r in &d.retries { a href=(build_link(r)) { (r) } " " } }
                            td { @if let Some(inv) = &d.invocation_id {
                                a href={ "/invocations/" (crate::pages::percent_encode(inv)) } { (shorten(inv, 13)) } } }
                        }
                    }
                }
                @if let Some(n) = next { p { a href=(next_link(n)) { "Older →" } } }
            }
            @if !window.is_empty() { (scatters(window)) }
        },
    )
}

fn tree(id: &str, current: &str, family: &HashMap<String, BuildDoc>, seen: &mut BTreeSet<String>) -> Markup {
    // A retry cannot be its own ancestor; `seen` keeps a corrupt record from looping.
    let fresh = seen.insert(id.to_string());
    html! {
        li {
            @match family.get(id).filter(|_| fresh) {
                None => { code { (id) } " " span class="dim" { "(not stored)" } },
                Some(d) => {
                    @if id == current { strong { code { (id) } } } @else { a href=(build_link(id)) { code { (id) } } }
                    " — " (kind(d.retry_kind)) ", " (d.targets.len()) " targets, " (outcome(d))
                    @if !d.retries.is_empty() {
                        ul { @for r in &d.retries { (tree(r, current, family, seen)) } }
                    }
                },
            }
        }
    }
}

/// One build: what it was planned as, what it measured, its retry family from `root`
/// (the build its stream planned) down, and its stored document.
pub fn build_page(d: &BuildDoc, document: &str, root: &str, family: &HashMap<String, BuildDoc>) -> Markup {
    let ctx = &d.context;
    layout(
        &format!("Build {}", shorten(&d.id, 40)),
        html! {
            h1 { "Build " code { (d.id) } }
            p { "Stream " code { (d.stream_id) } " · " (kind(d.retry_kind))
                @if let Some(p) = &d.parent_id { " of " a href=(build_link(p)) { code { (p) } } }
                " · " (outcome(d))
                @if let Some(s) = d.oom_signal { " (" (s.as_str()) ")" }
                @if let Some(code) = d.exit_code { " · exit code " (code) } }
            p { "Reason " strong { (reason_name(d)) } @if !d.reason_note.is_empty() { ": " (d.reason_note) } }
            table {
                tr { th {} th { "Estimate" } th { "Actual" } }
                tr { td { "Memory" } td class="n" { (gib(d.memory_estimate_bytes)) }
                     td class="n" { @if d.outcome == Some(BuildOutcome::Oom) { span class="bad" { "out of memory" } }
                                    @else { (gib(d.used_heap_post_build)) " used heap after the build" } } }
                tr { td { "Peak post-GC heap / server RSS" } td {} td class="n" { (gib(d.peak_post_gc_heap)) " / " (gib(d.server_vm_hwm)) } }
                tr { td { "Occupancy (ESU)" } td class="n" { (esu(d.occupancy_estimate_esu)) } td class="n" { (esu(d.occupancy_esu)) } }
                tr { td { "P(out of memory)" } td class="n" { (d.oom_probability.map_or("—".into(), |p| format!("{:.0}%", p * 100.0))) } td {} }
            }
            p { "Created " (utc(d.created_unix_ms)) ", started " (d.started_unix_ms.map_or("—".into(), utc))
                ", finished " (d.finished_unix_ms.map_or("—".into(), utc))
                @if let Some(w) = d.wall_seconds { " (" (format!("{w:.1}")) " s)" }
                "; attempt " (d.attempts) @if let Some(r) = d.runner { " on runner " (r) } "." }
            p { (d.actions_executed) " remote actions, " (esu(d.executor_esu_seconds)) " ESU·s"
                @if let Some(inv) = &d.invocation_id { " · invocation " a href={ "/invocations/" (crate::pages::percent_encode(inv)) } { code { (inv) } } } }
            p { "bazel " (format!("{:?}", ctx.command).to_lowercase()) " " code { (ctx.flags.join(" ")) } " · priority " (format!("{:?}", ctx.priority))
                @if !ctx.user.is_empty() { " · by " (ctx.user) }
                " · executors " (d.executor_types.join(", ")) }
            @if !d.message.is_empty() { pre { (d.message) } }
            h2 { "Retry tree" }
            ul { (tree(root, &d.id, family, &mut BTreeSet::new())) }
            h2 { "Targets (" (d.targets.len()) ")" }
            table {
                tr { th { "Label" } th { "Rule kind" } th { "Tags" } }
                @for t in &d.targets {
                    tr { td { code { (t.label) } } td { (t.rule_kind.as_deref().unwrap_or("")) } td { (t.tags.join(", ")) } }
                }
            }
            details { summary { "Stored document" } pre { (document) } }
        },
    )
}

pub(crate) async fn list(
    State(web): State<Arc<Web>>,
    axum::Extension(caller): axum::Extension<gantry_core::auth::Caller>,
    RawQuery(query): RawQuery,
) -> Response {
    if let Some(refused) = crate::refuse_unless(&caller, gantry_core::auth::Permission::Batch) {
        return refused;
    }
    let after = match cursor(query.as_deref()) {
        Ok(c) => c,
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e),
    };
    let first = after.is_none();
    let rows = match web.builds.list(&BuildQuery { limit: PAGE_SIZE, after, ..Default::default() }).await {
        Ok(r) => r,
        Err(e) => return server_error(e),
    };
    let docs = match rows.iter().map(decode).collect::<Result<Vec<_>, _>>() {
        Ok(d) => d,
        Err(e) => return server_error(e),
    };
    // The error covers the newest builds whichever page is shown, so it reads the same
    // rows on each: the first page's plus as many again, decoded lightly.
    let window = match web.builds.list(&BuildQuery { limit: ERROR_WINDOW, ..Default::default() }).await {
        Ok(w) => w,
        Err(e) => return server_error(e),
    };
    let window = match window
        .iter()
        .map(|r| serde_json::from_str::<Estimates>(&r.document).map_err(|e| format!("build {}: {e}", r.id)))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(w) => w,
        Err(e) => return server_error(Error::internal(format!("undecodable build record: {e}"))),
    };
    let next = (docs.len() == PAGE_SIZE).then(|| docs.last().map(|d| (d.created_unix_ms, d.id.clone()))).flatten();
    builds_page(&docs, &window, next.as_ref(), first).into_response()
}

pub(crate) async fn one(
    State(web): State<Arc<Web>>,
    axum::Extension(caller): axum::Extension<gantry_core::auth::Caller>,
    Path(id): Path<String>,
) -> Response {
    if let Some(refused) = crate::refuse_unless(&caller, gantry_core::auth::Permission::Batch) {
        return refused;
    }
    let row = match web.builds.get(&id).await {
        Ok(Some(r)) => r,
        Ok(None) => return failure(StatusCode::NOT_FOUND, &format!("no batched build {}", shorten(&id, 100))),
        Err(e) => return server_error(e),
    };
    let doc = match decode(&row) {
        Ok(d) => d,
        Err(e) => return server_error(e),
    };
    // Up the parent chain to the build the stream planned, then every retry below it.
    let mut family: HashMap<String, BuildDoc> = HashMap::from([(doc.id.clone(), doc.clone())]);
    let mut root = doc.id.clone();
    let mut parent = doc.parent_id.clone();
    while let Some(p) = parent.take().filter(|p| !family.contains_key(p) && family.len() < MAX_FAMILY) {
        match web.builds.get(&p).await {
            Ok(Some(r)) => {
                let d = match decode(&r) {
                    Ok(d) => d,
                    Err(e) => return server_error(e),
                };
                parent = d.parent_id.clone();
                root = d.id.clone();
                family.insert(d.id.clone(), d);
            }
            // A parent gone (retention) leaves the oldest one found as the root.
            Ok(None) => break,
            Err(e) => return server_error(e),
        }
    }
    let mut todo: Vec<String> = family.values().flat_map(|d| d.retries.clone()).collect();
    while let Some(r) = todo.pop() {
        if family.contains_key(&r) || family.len() >= MAX_FAMILY {
            continue;
        }
        match web.builds.get(&r).await {
            Ok(Some(row)) => {
                let d = match decode(&row) {
                    Ok(d) => d,
                    Err(e) => return server_error(e),
                };
                todo.extend(d.retries.iter().cloned());
                family.insert(d.id.clone(), d);
            }
            Ok(None) => {}
            Err(e) => return server_error(e),
        }
    }
    build_page(&doc, &row.document, &root, &family).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_batch::{BatchSizeReason, BuildContext, Target};

    pub(crate) fn doc(id: &str) -> BuildDoc {
        let ctx: BuildContext = serde_json::from_str(r#"{"command":"build","priority":"MEDIUM"}"#).unwrap();
        BuildDoc {
            id: id.into(),
            stream_id: "s".into(),
            parent_id: None,
            retry_kind: None,
            context: ctx,
            targets: vec![Target::new("//a:a")],
            reason: BatchSizeReason::MaxMemory,
            reason_note: String::new(),
            memory_estimate_bytes: Some(4 << 30),
            occupancy_estimate_esu: Some(10.0),
            oom_probability: Some(0.02),
            executor_types: vec!["x86".into()],
            state: gantry_builds::BuildState::Done,
            outcome: Some(BuildOutcome::Success),
            oom_signal: None,
            exit_code: Some(0),
            message: String::new(),
            invocation_id: Some("inv".into()),
            runner: Some(0),
            attempts: 1,
            created_unix_ms: 1_700_000_000_000,
            started_unix_ms: None,
            finished_unix_ms: None,
            wall_seconds: None,
            used_heap_post_build: Some(5 << 30),
            peak_post_gc_heap: None,
            server_vm_hwm: None,
            actions_executed: 0,
            executor_esu_seconds: None,
            execution_wall_seconds: None,
            occupancy_esu: Some(8.0),
            retries: vec![],
            models_trained_at: None,
        }
    }

    #[test]
    fn markup_in_build_fields_is_escaped() {
        let evil = "<script>alert(1)</script>";
        let mut d = doc(evil);
        d.stream_id = evil.into();
        d.targets = vec![Target { label: evil.into(), rule_kind: Some(evil.into()), tags: vec![evil.into()] }];
        d.message = evil.into();
        d.reason_note = evil.into();
        d.invocation_id = Some(evil.into());
        d.retries = vec![evil.into()];
        d.parent_id = Some(evil.into());
        d.context.user = evil.into();
        d.context.flags = vec![evil.into()];
        let window = [Estimates::from(&d)];
        let list = builds_page(std::slice::from_ref(&d), &window, Some(&(1, evil.into())), true).into_string();
        assert!(!list.contains("<script>") && list.contains("&lt;script&gt;"), "{list}");
        let family = HashMap::from([(d.id.clone(), d.clone())]);
        let page = build_page(&d, evil, evil, &family).into_string();
        assert!(!page.contains("<script>") && page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    }

    #[test]
    fn the_cursor_and_parameters_are_checked() {
        assert_eq!(cursor(None), Ok(None));
        assert_eq!(cursor(Some("before=17:b1.2")), Ok(Some((17, "b1.2".into()))));
        assert_eq!(cursor(Some("x=1&before=-3:a%3Ab")), Ok(Some((-3, "a:b".into()))));
        for bad in ["before=17", "before=x:b", "before=17:", "before=%zz", "before=%ff"] {
            assert!(cursor(Some(bad)).unwrap_err().starts_with("before"), "{bad}");
        }
        let last = (5, "s/1 x".to_string());
        let link = next_link(&last);
        assert_eq!(cursor(link.split_once('?').map(|(_, q)| q)), Ok(Some(last)));
    }

    #[test]
    fn error_is_grouped_by_the_models_that_planned_each_build() {
        let est = |v: Option<i64>, e: u64, a: u64| Estimates {
            id: "b".into(),
            outcome: Some(BuildOutcome::Success),
            memory_estimate_bytes: Some(e),
            used_heap_post_build: Some(a),
            occupancy_estimate_esu: None,
            occupancy_esu: None,
            models_trained_at: v,
        };
        let window = [est(Some(100), 90, 100), est(Some(200), 100, 100), est(None, 50, 100), est(Some(100), 80, 100)];
        let rows = error_by_model(&window);
        assert_eq!(rows.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>(), [(Some(200), 1), (Some(100), 2), (None, 1)]);
        assert!((rows[0].2.as_ref().unwrap().median_abs_pct - 0.0).abs() < 1e-9);
        assert!((rows[1].2.as_ref().unwrap().median_abs_pct - 15.0).abs() < 1e-9, "{:?}", rows[1]);
        assert!(rows[1].3.is_none(), "no occupancy pairs");
        let html = scatters(&window).into_string();
        assert!(html.contains("By model version") && html.contains("no models (fallback size)"));
    }

    #[test]
    fn error_is_relative_to_the_actual_and_skips_oom_builds() {
        let s = error_summary(&[(4.0, 5.0), (12.0, 10.0), (10.0, 10.0), (3.0, 0.0)]).unwrap();
        assert_eq!(s.n, 3);
        assert_eq!(s.under, 1);
        assert!((s.median_abs_pct - 20.0).abs() < 1e-9, "{s:?}");
        assert!((s.median_pct - 0.0).abs() < 1e-9, "{s:?}");
        assert_eq!(error_summary(&[]), None);
        let mut oom = doc("o");
        oom.outcome = Some(BuildOutcome::Oom);
        assert_eq!(Estimates::from(&oom).memory(), None);
        assert_eq!(Estimates::from(&oom).occupancy(), Some((10.0, 8.0)));
        assert_eq!(Estimates::from(&doc("d")).memory(), Some(((4u64 << 30) as f64, (5u64 << 30) as f64)));
    }

    #[test]
    fn the_light_decoding_reads_a_real_document() {
        let d = doc("b1");
        let light: Estimates = serde_json::from_str(&serde_json::to_string(&d).unwrap()).unwrap();
        assert_eq!(light.memory(), Estimates::from(&d).memory());
        assert_eq!(light.occupancy(), Some((10.0, 8.0)));
    }

    #[test]
    fn the_retry_tree_marks_the_build_and_survives_loops_and_gaps() {
        let mut root = doc("b");
        root.retries = vec!["b.1".into(), "b.2".into()];
        let mut half = doc("b.1");
        half.retry_kind = Some(RetryKind::OomSplit);
        half.retries = vec!["b".into()]; // a corrupt loop back to the root
        let family = HashMap::from([("b".to_string(), root), ("b.1".to_string(), half.clone())]);
        let page = build_page(&half, "{}", "b", &family).into_string();
        assert!(page.contains("<strong><code>b.1</code></strong>"), "{page}");
        assert!(page.contains("href=\"/batching/builds/b\""), "{page}");
        assert!(page.contains("OOM split"));
        assert!(page.contains("b.2</code> <span class=\"dim\">(not stored)"), "{page}");
    }
}
