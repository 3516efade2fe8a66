//! The size-class pages: the shapes the scheduler learned, each with its outcomes per
//! class, acceptable times and success estimates as selection sees them now, and its runs
//! over time (each run on its class; failures, the runs that were retried, stand out).

use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::RawQuery;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use gantry_core::{ActionRecord, ClassRuns, RunsOf};
use gantry_sizeclass::{ActionStats, KeyStatsView, Outcome, SizeClasses, Timestamp};
use http::StatusCode;
use maud::{html, Markup};

use crate::pages::{action_link, layout, shorten, utc};
use crate::{failure, server_error, svg, Web};

/// Shapes listed on the page (most recently updated first).
pub const SHAPES_LISTED: usize = 100;
/// Runs of one shape plotted and listed.
pub const RUNS_SHOWN: usize = 500;

fn secs(d: Option<std::time::Duration>) -> String {
    d.map_or_else(|| "—".into(), |d| format!("{:.2} s", d.as_secs_f64()))
}

/// One shape's learned view: a row per class.
pub fn shape_table(v: &KeyStatsView) -> Markup {
    html! {
        p {
            @if let Some(m) = v.largest_median { "Median on the largest class: " (secs(Some(m))) ". " }
            @if v.boosted { span class="bad" { "Failed on the largest class recently: it goes straight there." } }
        }
        table {
            tr { th { "Class" } th { "Workers" } th { "Succeeded" } th { "Timed out" } th { "Failed" } th { "Median" }
                 th { "Expected run" } th { "Acceptable" } th { "P(memory fits)" } th { "Latest outcomes" } }
            @for c in &v.classes {
                tr {
                    td class="n" { (c.size_class) }
                    td { @if c.available { "yes" } @else { span class="dim" { "none now" } } }
                    td class="n" { (c.successes) }
                    td class="n" { (c.timeouts) }
                    td class="n" { @if c.failures > 0 { span class="bad" { (c.failures) } } @else { "0" } }
                    td class="n" { (secs(c.median_success)) }
                    td class="n" { (secs(c.expected_run)) }
                    td class="n" { (secs(c.acceptable_time)) }
                    td class="n" { (c.fit_probability.map_or("—".into(), |p| format!("{p:.2}"))) }
                    td class="dim" { (c.history.iter().rev().take(8).map(|o| match o {
                        Outcome::Succeeded(d) => format!("{:.2}s", d.as_secs_f64()),
                        Outcome::TimedOut(d) => format!("timeout {:.2}s", d.as_secs_f64()),
                        Outcome::Failed => "failed".into(),
                    }).collect::<Vec<_>>().join(", ")) }
                }
            }
        }
    }
}

/// The runs of a shape over time: wall time against when it finished, a colour per
/// class, failures (the runs retried on a larger class) in their own series.
pub fn runs_plot(runs: &[ActionRecord]) -> Markup {
    let classes: std::collections::BTreeSet<u32> = runs.iter().map(|r| r.size_class).collect();
    let index = |c: u32| classes.iter().position(|x| *x == c).unwrap_or(0);
    let t0 = runs.iter().map(|r| r.completed_unix_ms).min().unwrap_or(0);
    let failed = |r: &ActionRecord| r.status_code != 0 || r.exit_code != 0;
    let points: Vec<svg::Point> = runs
        .iter()
        .map(|r| svg::Point {
            x: (r.completed_unix_ms - t0) as f64 / 1000.0,
            y: r.wall_seconds,
            title: format!(
                "class {} on {}: {:.2} s{}",
                r.size_class,
                r.worker,
                r.wall_seconds,
                if failed(r) {
                    format!(", failed (status {}, exit {})", r.status_code, r.exit_code)
                } else {
                    String::new()
                }
            ),
            series: if failed(r) { 0 } else { index(r.size_class) + 1 },
        })
        .collect();
    let mut names = vec!["failed: retried larger".to_string()];
    names.extend(classes.iter().map(|c| format!("class {c}")));
    html! {
        (svg::scatter(&points, "seconds since the first run shown", "run time (s)", false))
        (svg::legend(names.iter().map(String::as_str)))
    }
}

/// The spans the fleet-wide history can show: (name in `?window=`, span, bucket), in ms.
pub const WINDOWS: &[(&str, i64, i64)] =
    &[("1h", 3_600_000, 60_000), ("24h", 86_400_000, 1_800_000), ("7d", 7 * 86_400_000, 4 * 3_600_000)];

/// The fleet's runs over the window, per size class, from the execution log's counts per
/// bucket (`counts`, already cut to what the caller may read): each class's runs per
/// bucket and the failed runs (those retried on a larger class when one was free), with a
/// table of the window's totals. `since` is the window's first bucket; `bucket` its length.
pub fn fleet_history(counts: &[ClassRuns], window: &str, since: i64, bucket: i64, now_ms: i64) -> Markup {
    use std::collections::BTreeMap;
    let mut per_class: BTreeMap<u32, BTreeMap<i64, u64>> = BTreeMap::new();
    let mut failed: BTreeMap<i64, u64> = BTreeMap::new();
    let mut totals: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for c in counts {
        *per_class.entry(c.size_class).or_default().entry(c.bucket_unix_ms).or_default() += c.runs;
        *failed.entry(c.bucket_unix_ms).or_default() += c.failed;
        let t = totals.entry(c.size_class).or_default();
        t.0 += c.runs;
        t.1 += c.failed;
    }
    let all: u64 = totals.values().map(|t| t.0).sum();
    // Every bucket of the window, empty ones as 0, so a quiet hour shows as one.
    let buckets: Vec<i64> = (0..).map(|i| since + i * bucket).take_while(|b| *b <= now_ms).collect();
    let hours = |b: i64| (b - now_ms) as f64 / 3_600_000.0;
    let line = |counts: &BTreeMap<i64, u64>| -> Vec<(f64, f64)> {
        buckets.iter().map(|b| (hours(*b), counts.get(b).copied().unwrap_or(0) as f64)).collect()
    };
    let mut series: Vec<svg::Series> = per_class
        .iter()
        .map(|(class, counts)| svg::Series { name: format!("class {class}"), points: line(counts) })
        .collect();
    series.push(svg::Series { name: "failed (retried larger)".into(), points: line(&failed) });
    let per = svg::tick_label(bucket as f64 / 60_000.0);
    html! {
        h2 { "Selections and retries over time" }
        p { @for (name, _, _) in WINDOWS {
            @if *name == window { strong { (name) } " " } @else { a href={ "/sizeclasses?window=" (name) } { (name) } " " }
        } }
        @if all == 0 {
            p class="dim" { "No action ran in the last " (window) "." }
        } @else {
            p { (all) " runs in the last " (window) ", counted per " (per) " min as they finished." }
            (svg::lines(&series, "hours ago", "runs", &|x| svg::tick_label((-x * 10.0).round() / 10.0)))
            table {
                tr { th { "Class" } th { "Runs" } th { "Share" } th { "Failed" } }
                @for (class, (runs, bad)) in &totals {
                    tr {
                        td class="n" { (class) }
                        td class="n" { (runs) }
                        td class="n" { (format!("{:.0}%", 100.0 * *runs as f64 / all as f64)) }
                        td class="n" { @if *bad > 0 { span class="bad" { (bad) } } @else { "0" } }
                    }
                }
            }
        }
    }
}

fn now() -> Timestamp {
    Timestamp::from_system_time(SystemTime::now())
}

/// The size classes of the workers registered now (none without a scheduler). Taken once
/// per page: a snapshot passes over the whole fleet under the scheduler's lock.
pub(crate) fn fleet_classes(web: &Web) -> Vec<u32> {
    web.fleet.as_ref().map(|f| f.snapshot().workers.iter().map(|w| w.size_class).collect()).unwrap_or_default()
}

/// The classes a view shows: those with workers now, else those with history.
fn classes_of(fleet: &[u32], stats: &ActionStats) -> Option<SizeClasses> {
    if fleet.is_empty() {
        SizeClasses::new(stats.classes()).ok()
    } else {
        SizeClasses::new(fleet.iter().copied()).ok()
    }
}

/// A shape's view, when its statistics are stored; `fleet` from [`fleet_classes`].
pub(crate) async fn shape_view(web: &Web, key: &str, fleet: &[u32]) -> Result<Option<KeyStatsView>, Response> {
    let json = match web.sizes.get(key).await {
        Ok(Some(j)) => j,
        Ok(None) => return Ok(None),
        Err(e) => return Err(server_error(e)),
    };
    let stats = ActionStats::from_json(&json).map_err(|e| {
        failure(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("the statistics of {} do not decode: {e}", shorten(key, 80)),
        )
    })?;
    Ok(classes_of(fleet, &stats).map(|set| KeyStatsView::new(key, &stats, &set, &web.selection, now())))
}

/// One listed shape: its key, its learned view, and its latest run (what it is: a
/// mnemonic and a target, which a hash alone does not say).
pub type ShapeRow = (String, Option<KeyStatsView>, Option<ActionRecord>);

/// The list of shapes, each with its samples and median per class, after the fleet's
/// history (from [`fleet_history`]).
pub fn list_page(history: Markup, rows: &[ShapeRow]) -> Markup {
    layout(
        "Size classes",
        html! {
            h1 { "Size classes" }
            (history)
            h2 { "Learned shapes" }
            p { "The action shapes the scheduler learned (an action's command and platform, and Bazel's configuration), \
                 most recently updated first. Each chooses the cheapest class whose expected time is acceptable." }
            @if rows.is_empty() {
                p class="dim" { "Nothing learned yet: it starts once workers of more than one size class are registered." }
            } @else {
                table {
                    tr { th { "Shape" } th { "Latest run" } th { "Samples per class (median)" } th { "Failed on the largest recently" } }
                    @for (key, v, latest) in rows {
                        tr {
                            td { a href={ "/sizeclasses/" (key) } { code { (shorten(key, 16)) } } }
                            td { @if let Some(r) = latest {
                                (r.action_mnemonic) " " code { (shorten(&r.target_id, 60)) }
                                " " span class="dim" { "class " (r.size_class) ", " (format!("{:.2}", r.wall_seconds)) " s" }
                            } }
                            td { @if let Some(v) = v {
                                @for c in v.classes.iter().filter(|c| !c.history.is_empty()) {
                                    span { "class " (c.size_class) ": " (c.history.len()) " (" (secs(c.median_success)) ") " }
                                }
                            } }
                            td { @if v.as_ref().is_some_and(|v| v.boosted) { span class="bad" { "yes" } } }
                        }
                    }
                }
            }
        },
    )
}

/// One shape: its table, its runs over time, and the latest runs linked to their actions.
pub fn shape_page(key: &str, view: Option<&KeyStatsView>, runs: &[ActionRecord]) -> Markup {
    layout(
        "Size class shape",
        html! {
            h1 { "Shape " code { (shorten(key, 16)) } }
            p class="dim" { code { (key) } }
            @if let Some(r) = runs.first() {
                p { "Latest: " (r.action_mnemonic) " " code { (shorten(&r.target_id, 80)) } }
            }
            @match view {
                Some(v) => (shape_table(v)),
                None => p class="dim" { "No statistics are stored for it." },
            }
            h2 { "Runs over time (" (runs.len()) ")" }
            @if runs.is_empty() {
                p class="dim" { "The execution log has no run of this shape." }
            } @else {
                (runs_plot(runs))
                table {
                    tr { th { "Finished" } th { "Action" } th { "Class" } th { "Worker" } th { "Ran s" } th { "Peak MiB" } th { "Result" } }
                    @for r in runs.iter().take(50) {
                        tr {
                            td { (utc(r.completed_unix_ms)) }
                            td { @match action_link(&r.instance, &r.action_digest) {
                                Some(l) => a href=(l) { (if r.action_mnemonic.is_empty() { "action" } else { &r.action_mnemonic }) },
                                None => (r.action_mnemonic),
                            } " " code { (shorten(&r.target_id, 60)) } }
                            td class="n" { (r.size_class) }
                            td { (r.worker) }
                            td class="n" { (format!("{:.2}", r.wall_seconds)) }
                            td class="n" { (format!("{:.1}", r.peak_memory_bytes as f64 / (1u64 << 20) as f64)) }
                            td { @if r.status_code != 0 || r.exit_code != 0 {
                                span class="bad" { "status " (r.status_code) ", exit " (r.exit_code) }
                            } @else { span class="ok" { "ok" } } }
                        }
                    }
                }
            }
        },
    )
}

pub(crate) async fn list(
    State(web): State<Arc<Web>>,
    axum::Extension(caller): axum::Extension<gantry_core::auth::Caller>,
    RawQuery(query): RawQuery,
) -> Response {
    if let Some(refused) = crate::refuse_unless(&caller, gantry_core::auth::Permission::Read) {
        return refused;
    }
    let window = match crate::query_param(query.as_deref(), "window") {
        Ok(w) => w.unwrap_or_else(|| "24h".into()),
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e),
    };
    let Some(&(window, span, bucket)) = WINDOWS.iter().find(|(name, _, _)| *name == window) else {
        return failure(
            StatusCode::BAD_REQUEST,
            &format!("window: {} is not one of 1h, 24h, 7d", shorten(&window, 20)),
        );
    };
    let now_ms = SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    let since = (now_ms - span) / bucket * bucket;
    let history = match web.log.class_runs(since, bucket).await {
        // Counts of instances the caller may not read are left out.
        Ok(c) => c.into_iter().filter(|c| crate::may_read(&caller, &c.instance)).collect::<Vec<_>>(),
        Err(e) => return server_error(e),
    };
    let keys = match web.sizes.keys(SHAPES_LISTED * 4).await {
        Ok(k) => k,
        Err(e) => return server_error(e),
    };
    let fleet = fleet_classes(&web);
    let mut rows = Vec::new();
    for key in keys.into_iter().filter(|k| !k.starts_with(gantry_sizeclass::GROUP_KEY_PREFIX)).take(SHAPES_LISTED) {
        let view = match shape_view(&web, &key, &fleet).await {
            Ok(v) => v,
            Err(r) => return r,
        };
        let latest = match web.log.runs(RunsOf::Shape(&key), 1).await {
            Ok(r) => r.into_iter().find(|r| crate::may_read(&caller, &r.instance)),
            Err(e) => return server_error(e),
        };
        rows.push((key, view, latest));
    }
    list_page(fleet_history(&history, window, since, bucket, now_ms), &rows).into_response()
}

pub(crate) async fn shape(
    State(web): State<Arc<Web>>,
    axum::Extension(caller): axum::Extension<gantry_core::auth::Caller>,
    Path(key): Path<String>,
) -> Response {
    if let Some(refused) = crate::refuse_unless(&caller, gantry_core::auth::Permission::Read) {
        return refused;
    }
    if key.is_empty() || key.len() > 200 || key.starts_with(gantry_sizeclass::GROUP_KEY_PREFIX) {
        return failure(StatusCode::BAD_REQUEST, "shape: not a shape key");
    }
    let view = match shape_view(&web, &key, &fleet_classes(&web)).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let runs = match web.log.runs(RunsOf::Shape(&key), RUNS_SHOWN).await {
        // Runs in instances the caller may not read are left out.
        Ok(r) => r.into_iter().filter(|r| crate::may_read(&caller, &r.instance)).collect::<Vec<_>>(),
        Err(e) => return server_error(e),
    };
    if view.is_none() && runs.is_empty() {
        return failure(StatusCode::NOT_FOUND, "no such shape");
    }
    shape_page(&key, view.as_ref(), &runs).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_sizeclass::SelectionConfig;
    use std::time::Duration;

    #[test]
    fn a_shape_shows_each_class_and_its_runs() {
        let mut stats = ActionStats::new();
        for _ in 0..3 {
            stats.push(1, Outcome::Succeeded(Duration::from_secs(4)), 16);
            stats.push(4, Outcome::Succeeded(Duration::from_secs(2)), 16);
        }
        stats.push(1, Outcome::Failed, 16);
        let set = SizeClasses::new([1, 4]).unwrap();
        let view = KeyStatsView::new("k<script>", &stats, &set, &SelectionConfig::default(), now());
        let run = |class: u32, status: i32, at: i64| ActionRecord {
            size_class: class,
            status_code: status,
            completed_unix_ms: at,
            wall_seconds: 1.0,
            target_id: "<script>".into(),
            ..Default::default()
        };
        let page = shape_page("k<script>", Some(&view), &[run(1, 8, 1000), run(4, 0, 2000)]).into_string();
        assert!(!page.contains("<script>") && page.contains("&lt;script&gt;"));
        assert!(page.contains("4.00 s") && page.contains("2.00 s"), "medians: {page}");
        assert_eq!(page.matches("<circle").count(), 2);
        assert!(page.contains("failed: retried larger") && page.contains("status 8"));
        let latest =
            ActionRecord { action_mnemonic: "CppCompile".into(), target_id: "//a:b".into(), ..Default::default() };
        let list = list_page(html! {}, &[("k<script>".into(), Some(view), Some(latest))]).into_string();
        assert!(list.contains("CppCompile") && list.contains("//a:b"), "{list}");
        assert!(list.contains("class 1: 4") && list.contains("class 4: 3"), "{list}");
    }

    #[test]
    fn the_fleet_history_counts_each_class_and_failures_per_bucket() {
        let now = 10 * 3_600_000 + 1234;
        let since = (now - 3_600_000) / 60_000 * 60_000;
        let at = |i: i64| since + i * 60_000;
        let c = |b: i64, instance: &str, class: u32, runs: u64, failed: u64| ClassRuns {
            bucket_unix_ms: b,
            instance: instance.into(),
            size_class: class,
            runs,
            failed,
        };
        let counts = [c(at(1), "", 1, 5, 2), c(at(1), "x", 1, 3, 0), c(at(30), "", 4, 2, 0)];
        let page = fleet_history(&counts, "1h", since, 60_000, now).into_string();
        assert!(page.contains("10 runs in the last 1h"), "{page}");
        // One line per class and one of failures, each across all 61 buckets.
        assert_eq!(page.matches("<path").count(), 3, "{page}");
        assert!(page.contains("failed (retried larger)"));
        let row = |class: u32, runs: u64, share: &str| {
            format!("<td class=\"n\">{class}</td><td class=\"n\">{runs}</td><td class=\"n\">{share}</td>")
        };
        assert!(page.contains(&row(1, 8, "80%")) && page.contains(&row(4, 2, "20%")), "{page}");
        assert!(page.contains("<span class=\"bad\">2</span>"), "{page}");
        assert!(page.contains("<strong>1h</strong>") && page.contains("href=\"/sizeclasses?window=24h\""));
        let empty = fleet_history(&[], "24h", since, 1_800_000, now).into_string();
        assert!(empty.contains("No action ran in the last 24h") && !empty.contains("<svg"));
    }
}
