//! The pages as functions of their data. maud escapes every value inserted, so a target
//! name or a log line holding markup is shown, never run; only the constant style sheet
//! goes in unescaped.

use gantry_core::reapi;
use gantry_core::{ActionRecord, Digest, Invocation, InvocationSummary};
use http::StatusCode;
use maud::{html, Markup, PreEscaped, DOCTYPE};

use crate::critical::CriticalPath;
use crate::svg;

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}\
table{border-collapse:collapse;margin:.5em 0 1.5em}\
th,td{padding:.25em .7em;border-bottom:1px solid #ddd;text-align:left;vertical-align:top}\
th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}\
.ok{color:#176f2c}.bad{color:#b00020;font-weight:600}.dim{color:#777}\
tr.critical td{background:#fff3cd}\
nav a{margin-right:1em}code{font-size:.95em}";

/// The pages every page links to, in the order of the menu.
const NAV: &[(&str, &str)] = &[
    ("/invocations", "Invocations"),
    ("/workers", "Workers"),
    ("/sizeclasses", "Size classes"),
    ("/batching", "Batching"),
    ("/queue", "Submit queue"),
    ("/cas", "CAS"),
    ("/metrics", "Metrics"),
];

/// A page: the menu, then `body`.
pub fn layout(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { (title) " · gantry" }
                style { (PreEscaped(STYLE)) }
            }
            body {
                nav { @for (href, name) in NAV { a href=(href) { (name) } } }
                (body)
            }
        }
    }
}

/// An error page.
pub fn error(status: StatusCode, message: &str) -> Markup {
    layout(
        status.canonical_reason().unwrap_or("Error"),
        html! { h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("")) } p { (message) } },
    )
}

/// At most `max` characters of `s`, marked when cut.
pub fn shorten(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// A unix-milliseconds time as `YYYY-MM-DD HH:MM:SS UTC`.
pub fn utc(ms: i64) -> String {
    if ms <= 0 {
        return "—".into();
    }
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC", rem / 3600, rem % 3600 / 60, rem % 60)
}

fn seconds(ms: i64) -> String {
    if ms <= 0 {
        "—".into()
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

fn outcome(inv: &Invocation) -> Markup {
    let ok = inv.exit_code == 0 && !inv.exit_name.is_empty();
    let name = if inv.exit_name.is_empty() { "no exit code" } else { inv.exit_name.as_str() };
    html! { span class=(if ok { "ok" } else { "bad" }) { (name) } }
}

/// Who ran it (a list row has no metadata, but has `user`).
fn who(inv: &Invocation) -> String {
    if inv.user.is_empty() {
        Invocation::user_of(&inv.owner, &inv.metadata)
    } else {
        inv.user.clone()
    }
}

/// "N of M (x%)" remote cache lookups that hit; a dash when this server counted none.
fn cache_hit_rate(inv: &Invocation) -> Markup {
    if inv.cache_lookups == 0 {
        return html! { span class="dim" title="no remote cache lookups counted for it" { "—" } };
    }
    let percent = 100.0 * inv.cache_hits as f64 / inv.cache_lookups as f64;
    html! { (inv.cache_hits) " of " (inv.cache_lookups) " (" (format!("{percent:.1}")) "%)" }
}

/// The list of invocations, newest first; `next` is the cursor of the following page.
pub fn invocations(rows: &[(Invocation, InvocationSummary)], next: Option<i64>) -> Markup {
    layout(
        "Invocations",
        html! {
            h1 { "Invocations" }
            @if rows.is_empty() {
                p { "No invocations yet. Run Bazel with " code { "--bes_backend=grpc://HOST:PORT" } " pointing here." }
            } @else {
                table {
                    tr { th { "Started" } th { "Who" } th { "Command" } th { "Outcome" } th { "Targets" }
                         th { "Duration" } th { "Cache hits" } th { "Remote actions" } th { "Executor ESU·s" } }
                    @for (inv, s) in rows {
                        tr {
                            td { a href={ "/invocations/" (inv.id) } { (utc(inv.started_unix_ms)) } }
                            td { (who(inv)) }
                            td { code { (inv.command) " " (shorten(&inv.patterns.join(" "), 80)) } }
                            td { (outcome(inv)) }
                            td class="n" { (inv.target_count)
                                @if inv.failed_targets > 0 { " " span class="bad" { "(" (inv.failed_targets) " failed)" } } }
                            td class="n" { (seconds(inv.finished_unix_ms - inv.started_unix_ms)) }
                            td class="n" { (cache_hit_rate(inv)) }
                            td class="n" { (s.actions) }
                            td class="n" { (format!("{:.1}", s.executor_esu_seconds)) }
                        }
                    }
                }
                @if let Some(before) = next {
                    p { a href={ "/invocations?before=" (before) } { "Older →" } }
                }
            }
        },
    )
}

/// A `/blobs/HASH/SIZE` link for a `bytestream://…/blobs/HASH/SIZE` URI.
pub fn blob_link(uri: &str) -> Option<String> {
    let rest = uri.strip_prefix("bytestream://")?;
    let (_, tail) = rest.split_once("/blobs/")?;
    let (hash, size) = tail.split_once('/')?;
    let ok = hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()) && size.parse::<u64>().is_ok();
    ok.then(|| format!("/blobs/{hash}/{size}"))
}

/// `s` for a URL path segment or query value: unreserved characters (letters, digits,
/// `-._~`) kept, every other byte as `%XX`.
pub fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The page of an executed action, from its record (`hash/size` and instance).
pub fn action_link(instance: &str, action_digest: &str) -> Option<String> {
    let (hash, size) = action_digest.split_once('/')?;
    let ok = hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()) && size.parse::<u64>().is_ok();
    ok.then(|| format!("/actions/{hash}/{size}?instance={}", percent_encode(instance)))
}

fn digest_link(d: Option<&reapi::Digest>) -> Option<(String, i64)> {
    let d = d?;
    let ok = d.hash.len() == 64 && d.hash.bytes().all(|b| b.is_ascii_hexdigit()) && d.size_bytes >= 0;
    ok.then(|| (format!("/blobs/{}/{}", d.hash, d.size_bytes), d.size_bytes))
}

/// An ActionResult: exit code and worker, stdout and stderr, output files and
/// directories, each blob linked.
pub fn result_section(r: &reapi::ActionResult) -> Markup {
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    html! {
        p { "Exit code " span class=(if r.exit_code == 0 { "ok" } else { "bad" }) { (r.exit_code) }
            @if let Some(md) = &r.execution_metadata { " on " (md.worker) } }
        @for (name, raw, d) in [("stdout", &r.stdout_raw, r.stdout_digest.as_ref()), ("stderr", &r.stderr_raw, r.stderr_digest.as_ref())] {
            h3 { (name) }
            @if !raw.is_empty() {
                pre { (text(raw)) }
            } @else {
                @match digest_link(d) {
                    Some((link, 0)) => p class="dim" { "empty" a href=(link) {} },
                    Some((link, size)) => p { a href=(link) { (name) " (" (size) " bytes)" } },
                    None => p class="dim" { "none" },
                }
            }
        }
        @if !r.output_files.is_empty() {
            h2 { "Output files" }
            table {
                tr { th { "Path" } th { "Size" } }
                @for f in &r.output_files {
                    tr {
                        td { @match &f.digest {
                            Some(d) => a href=(crate::cas::download(d, f.path.rsplit('/').next().unwrap_or(&f.path))) { code { (f.path) } },
                            None => code { (f.path) },
                        } }
                        td class="n" { (f.digest.as_ref().map_or(0, |d| d.size_bytes)) }
                    }
                }
            }
        }
        @if !r.output_directories.is_empty() {
            h2 { "Output directories" }
            ul { @for d in &r.output_directories {
                li { @match &d.tree_digest {
                    Some(t) => a href=(crate::cas::link(crate::cas::Kind::Tree, t)) { code { (d.path) } },
                    None => code { (d.path) },
                } }
            } }
        }
    }
}

/// Every run of an action the execution log holds: metering, worker and class, retries.
pub fn runs_table(runs: &[ActionRecord]) -> Markup {
    html! {
        table {
            tr { th { "Finished" } th { "Invocation" } th { "Worker" } th { "Class" } th { "Queued s" } th { "Ran s" }
                 th { "CPU s" } th { "Peak MiB" } th { "Metering" } th { "Result" } }
            @for r in runs {
                tr {
                    td { (utc(r.completed_unix_ms)) }
                    td { @if r.tool_invocation_id.is_empty() { span class="dim" { "—" } } @else {
                        a href={ "/invocations/" (r.tool_invocation_id) } { code { (shorten(&r.tool_invocation_id, 13)) } } } }
                    td { (r.worker) }
                    td class="n" { (r.size_class) }
                    td class="n" { (format!("{:.2}", r.queued_seconds)) }
                    td class="n" { (format!("{:.2}", r.wall_seconds)) }
                    td class="n" { (format!("{:.2}", r.user_cpu_seconds + r.system_cpu_seconds)) }
                    td class="n" { (format!("{:.1}", r.peak_memory_bytes as f64 / (1u64 << 20) as f64)) }
                    td { (r.metering) }
                    td { @if r.status_code != 0 || r.exit_code != 0 {
                        span class="bad" { "status " (r.status_code) ", exit " (r.exit_code) }
                    } @else { span class="ok" { "ok" } } }
                }
            }
        }
    }
}

/// One action: its command (argv, environment, platform), its input tree, its cached
/// result (exit code, stdout and stderr, outputs), every run the execution log holds, and
/// the size-class history of its shape.
pub fn action(
    instance: &str,
    digest: &Digest,
    action: Option<&reapi::Action>,
    command: Option<&reapi::Command>,
    result: Option<&reapi::ActionResult>,
    runs: &[ActionRecord],
    shape: Option<(&str, Option<&gantry_sizeclass::KeyStatsView>)>,
) -> Markup {
    layout(
        &format!("Action {}", shorten(&digest.hash_hex(), 12)),
        html! {
            h1 { "Action " code { (digest.hash_hex()) "/" (digest.size) } }
            p { "Instance: " code { (if instance.is_empty() { "(default)" } else { instance }) } }
            @match command {
                None => p class="dim" { "Its Action or Command is not in the CAS (any more)." },
                Some(c) => {
                    h2 { "Command" }
                    pre { code { (c.arguments.iter().map(|a| shorten(a, 2000)).collect::<Vec<_>>().join(" ")) } }
                    @if !c.working_directory.is_empty() { p { "Working directory: " code { (c.working_directory) } } }
                    @if !c.environment_variables.is_empty() {
                        h2 { "Environment" }
                        table { @for v in &c.environment_variables { tr { td { code { (v.name) } } td { code { (v.value) } } } } }
                    }
                }
            }
            @if let Some(a) = action {
                @let props = a.platform.as_ref().map(|p| p.properties.as_slice()).unwrap_or_default();
                @if !props.is_empty() {
                    h2 { "Platform" }
                    table { @for p in props { tr { td { code { (p.name) } } td { (p.value) } } } }
                }
                p { "Timeout: " (a.timeout.as_ref().map_or("server default".to_string(), |t| format!("{} s", t.seconds)))
                    @if a.do_not_cache { " · not cached" } }
                p {
                    @if let Some(root) = &a.input_root_digest { a href=(crate::cas::link(crate::cas::Kind::Directory, root)) { "Input tree" } " · " }
                    @if let Some(c) = &a.command_digest { a href=(crate::cas::link(crate::cas::Kind::Command, c)) { "Command (decoded)" } }
                }
            }
            h2 { "Result" }
            @match result {
                None => p class="dim" { "No result in the action cache (it failed, was not cached, or expired)." },
                Some(r) => (result_section(r)),
            }
            h2 { "Runs (" (runs.len()) ")" }
            @if runs.is_empty() {
                p class="dim" { "No run on gantry's executors is logged (it was a cache hit, or ran elsewhere)." }
            } @else {
                (runs_table(runs))
            }
            @if let Some((key, view)) = shape {
                h2 { "Size classes of its shape" }
                p { a href={ "/sizeclasses/" (key) } { "Shape " code { (shorten(key, 16)) } } " — every action with this command and platform." }
                @if let Some(v) = view { (crate::sizes::shape_table(v)) }
            }
        },
    )
}

/// Most bars the timeline draws: past it, the longest runs and the critical path. The
/// plot is about 1,000 pixels wide, so more bars are slivers, and each costs the page
/// reading and drawing it.
pub const MAX_TIMELINE_BARS: usize = 2_000;

/// Rows of an invocation's action table per page.
pub const ACTIONS_PER_PAGE: usize = 100;

/// The invocation's remote actions on a timeline, a lane per worker (rows for its
/// concurrent slots), coloured by size class, the critical path outlined. `runs` are the
/// runs to draw (the longest, when the invocation has more than [`MAX_TIMELINE_BARS`]) of
/// `total`; the path's runs are drawn whether listed or not. x is seconds since the first
/// drawn run started.
pub fn timeline(runs: &[ActionRecord], total: u64, critical: &CriticalPath) -> Markup {
    use crate::critical::run_key;
    let on_path = critical.keys();
    let listed: std::collections::HashSet<_> = runs.iter().map(run_key).collect();
    let mut drawn: Vec<(&ActionRecord, bool)> = runs.iter().map(|a| (a, on_path.contains(&run_key(a)))).collect();
    drawn.extend(critical.actions.iter().filter(|a| !listed.contains(&run_key(a))).map(|a| (a, true)));
    let timed: Vec<(&ActionRecord, bool, crate::critical::Span)> =
        drawn.into_iter().filter_map(|(a, marked)| Some((a, marked, crate::critical::span(a)?))).collect();
    let Some(t0) = timed.iter().map(|(_, _, s)| s.start).min_by(f64::total_cmp) else {
        return html! { p class="dim" { "No action has a completion time to place it." } };
    };
    let classes: std::collections::BTreeSet<u32> = timed.iter().map(|(a, _, _)| a.size_class).collect();
    let bars: Vec<svg::Bar> = timed
        .iter()
        .map(|&(a, marked, s)| {
            let mnemonic = if a.action_mnemonic.is_empty() { "action" } else { a.action_mnemonic.as_str() };
            svg::Bar {
                lane: if a.worker.is_empty() { "(unknown worker)".into() } else { a.worker.clone() },
                start: s.start - t0,
                end: s.end - t0,
                title: format!(
                    "{mnemonic} {}\n{} · class {}\nqueued {:.2} s, ran {:.2} s: {:.2}–{:.2} s{}",
                    a.target_id,
                    a.worker,
                    a.size_class,
                    a.queued_seconds,
                    a.wall_seconds,
                    s.start - t0,
                    s.end - t0,
                    if marked { "\n★ on the critical path" } else { "" }
                ),
                marked,
                link: action_link(&a.instance, &a.action_digest),
                series: classes.iter().position(|c| *c == a.size_class).unwrap_or(0),
            }
        })
        .collect();
    let names: Vec<String> = classes.iter().map(|c| format!("size class {c}")).collect();
    html! {
        @if (bars.len() as u64) < total {
            p class="dim" { "The " (bars.len()) " longest runs of " (total) ", with the critical path." }
        }
        (svg::lanes(&bars, "seconds since the first action started"))
        (svg::legend(names.iter().map(String::as_str)))
        p class="dim" { "Outlined: the critical path. Each bar is a run on a worker (queue time is not drawn); click one for its action." }
    }
}

/// What the invocation page shows of the execution log: the totals, one page of the
/// action table (dearest first), the runs the timeline draws and the critical path.
pub struct InvocationActions<'a> {
    pub summary: &'a InvocationSummary,
    /// Page `page` (from 0) of the table, [`ACTIONS_PER_PAGE`] rows.
    pub page: usize,
    pub rows: &'a [ActionRecord],
    pub longest: &'a [ActionRecord],
    pub critical: &'a CriticalPath,
}

/// Links to the pages of an invocation's action table around `page`.
fn action_pages(id: &str, page: usize, total: u64) -> Markup {
    let pages = (total as usize).div_ceil(ACTIONS_PER_PAGE);
    let link = |p: usize| format!("/invocations/{}?page={p}#actions", percent_encode(id));
    html! {
        @if pages > 1 {
            p {
                "Page " (page + 1) " of " (pages) ". "
                @if page > 0 { a href=(link(0)) { "First" } " " a href=(link(page - 1)) { "Previous" } " " }
                @if page + 1 < pages { a href=(link(page + 1)) { "Next" } " " a href=(link(pages - 1)) { "Last" } }
            }
        }
    }
}

/// One invocation: what the Build Event Service stored (if it did) and the remote actions
/// the execution log holds for it, dearest first a page at a time, on a timeline with the
/// (inferred) critical path marked.
pub fn invocation(id: &str, inv: Option<&Invocation>, acts: &InvocationActions) -> Markup {
    let (summary, critical) = (acts.summary, acts.critical);
    let on_path = critical.keys();
    layout(
        &format!("Invocation {}", shorten(id, 40)),
        html! {
            h1 { "Invocation " code { (id) } }
            @match inv {
                None => p class="dim" { "No build events were received for it; only its remote actions are known." },
                Some(inv) => {
                    p { code { "bazel " (inv.command) " " (inv.patterns.join(" ")) } " — " (outcome(inv))
                        " (exit code " (inv.exit_code) ")" }
                    p { "Started " (utc(inv.started_unix_ms)) ", took " (seconds(inv.finished_unix_ms - inv.started_unix_ms))
                        @if !who(inv).is_empty() { ", by " (who(inv)) } "." }
                    p { "Remote cache hits: " @if inv.cache_lookups == 0 {
                            span class="dim" { "no lookups counted (none made, or not recorded yet)" }
                        } @else { (cache_hit_rate(inv)) " of its action cache lookups." } }
                    @if !inv.options.is_empty() { p { "Options: " code { (inv.options.join(" ")) } } }
                    @if !inv.metadata.is_empty() {
                        details { summary { "Build metadata (" (inv.metadata.len()) ")" }
                            table { @for (k, v) in &inv.metadata { tr { td { code { (k) } } td { (v) } } } } }
                    }
                    h2 { "Targets (" (inv.targets.len()) ")" }
                    table {
                        tr { th { "Target" } th { "Kind" } th { "Outcome" } }
                        @for t in &inv.targets {
                            tr {
                                td { code { (t.label) } }
                                td { (t.kind) }
                                td { @match t.success {
                                    Some(true) => span class="ok" { "built" },
                                    Some(false) => span class="bad" { "failed" },
                                    None => span class="dim" { "not completed" },
                                } }
                            }
                        }
                    }
                    @if !inv.tests.is_empty() {
                        h2 { "Tests (" (inv.tests.len()) ")" }
                        table {
                            tr { th { "Test" } th { "Status" } th { "Run / shard / attempt" } th { "Duration" } th { "Logs" } }
                            @for t in &inv.tests {
                                tr {
                                    td { code { (t.label) } }
                                    td { span class=(if t.status == "PASSED" { "ok" } else { "bad" }) { (t.status) }
                                         @if t.cached_locally { " " span class="dim" { "(cached)" } } }
                                    td class="n" { (t.run) " / " (t.shard) " / " (t.attempt) }
                                    td class="n" { (seconds(t.duration_ms)) }
                                    td { @for (name, uri) in &t.logs {
                                        @match blob_link(uri) {
                                            Some(link) => { a href=(link) { (name) } " " },
                                            None => { span class="dim" title=(uri) { (name) } " " },
                                        }
                                    } }
                                }
                            }
                        }
                    }
                }
            }
            h2 id="actions" { "Remote actions (" (summary.actions) ")" }
            @if summary.actions == 0 {
                p class="dim" { "None ran on gantry's executors (all cached, or run locally)." }
            } @else {
                p { (format!("{:.1}", summary.executor_esu_seconds)) " ESU·s of executor time, "
                    (format!("{:.1}", summary.cpu_seconds)) " s of CPU"
                    @if summary.failed_actions > 0 { ", " span class="bad" { (summary.failed_actions) " failed" } } "." }
                h3 { "Timeline" }
                (timeline(acts.longest, summary.actions, critical))
                h3 { "Critical path" }
                @if !critical.actions.is_empty() {
                    p { "★ " (critical.actions.len()) " actions, " (format!("{:.2}", critical.seconds))
                        " s from the first one's queueing to the last one's end (" (format!("{:.2}", critical.running_seconds))
                        " s running, " (format!("{:.2}", critical.queued_seconds)) " s queued)." }
                    @if critical.cut {
                        p class="bad" { "The path was followed back " (crate::critical::MAX_STEPS) " steps and stops there: it starts earlier." }
                    }
                    p class="dim" { "Inferred from timing: gantry does not see the action graph, so each action's predecessor is taken to be the one that finished last before it was queued. A parallel action can stand in for the real dependency, and local or cached work between them shows as gaps." }
                }
                @if let Some(text) = inv.map(|i| i.critical_path.as_str()).filter(|t| !t.is_empty()) {
                    details { summary { "Bazel's critical path" } pre { (text) } }
                }
                h3 { "Actions, dearest first" }
                (action_pages(id, acts.page, summary.actions))
                @if acts.rows.is_empty() {
                    p class="dim" { "No actions on this page." }
                } @else {
                    table {
                        tr { th { "Mnemonic" } th { "Target" } th { "Worker" } th { "Size class" } th { "Peak MiB" }
                             th { "CPU s" } th { "Queued s" } th { "Ran s" } th { "ESU·s" } th { "Exit" } }
                        @for a in acts.rows {
                            @let critical = on_path.contains(&crate::critical::run_key(a));
                            tr class=[critical.then_some("critical")] {
                                td { @if critical { span title="on the critical path" { "★ " } }
                                    @match action_link(&a.instance, &a.action_digest) {
                                    Some(link) => a href=(link) { (if a.action_mnemonic.is_empty() { "action" } else { &a.action_mnemonic }) },
                                    None => (a.action_mnemonic),
                                } }
                                td { code { (a.target_id) } }
                                td { (a.worker) }
                                td class="n" { (a.size_class) }
                                td class="n" { (format!("{:.1}", a.peak_memory_bytes as f64 / (1u64 << 20) as f64)) }
                                td class="n" { (format!("{:.2}", a.user_cpu_seconds + a.system_cpu_seconds)) }
                                td class="n" { (format!("{:.2}", a.queued_seconds)) }
                                td class="n" { (format!("{:.2}", a.wall_seconds)) }
                                td class="n" { (format!("{:.2}", a.esu_seconds())) }
                                td class="n" { span class=(if a.exit_code == 0 && a.status_code == 0 { "ok" } else { "bad" }) { (a.exit_code) } }
                            }
                        }
                    }
                    (action_pages(id, acts.page, summary.actions))
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_core::{TargetOutcome, TestOutcome};

    #[test]
    fn markup_in_names_and_logs_is_shown_not_run() {
        let evil = "<script>alert(1)</script>";
        let inv = Invocation {
            id: "i".into(),
            command: "test".into(),
            patterns: vec![evil.into()],
            targets: vec![TargetOutcome { label: evil.into(), kind: "genrule rule".into(), success: Some(true) }],
            tests: vec![TestOutcome {
                label: evil.into(),
                status: "FAILED".into(),
                logs: vec![(evil.into(), format!("bytestream://h/blobs/{}/3", "a".repeat(64)))],
                ..Default::default()
            }],
            metadata: [(evil.to_string(), evil.to_string())].into(),
            ..Default::default()
        };
        let action = ActionRecord {
            action_mnemonic: evil.into(),
            target_id: evil.into(),
            worker: evil.into(),
            completed_unix_ms: 5_000,
            wall_seconds: 1.0,
            ..Default::default()
        };
        let summary = InvocationSummary { actions: 1, ..Default::default() };
        let critical = CriticalPath { actions: vec![action.clone()], ..Default::default() };
        let rows = [action];
        let acts = InvocationActions { summary: &summary, page: 0, rows: &rows, longest: &rows, critical: &critical };
        let page = invocation(evil, Some(&inv), &acts).into_string();
        assert!(page.contains("★ on the critical path"), "the timeline is drawn: {page}");
        assert!(!page.contains(evil), "unescaped markup in the page");
        assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
        let list = invocations(&[(inv, InvocationSummary::default())], Some(5)).into_string();
        assert!(!list.contains(evil) && list.contains("&lt;script&gt;"));
        assert!(!error(StatusCode::NOT_FOUND, evil).into_string().contains(evil));
    }

    #[test]
    fn times_links_and_names() {
        assert_eq!(utc(0), "—");
        assert_eq!(utc(1_700_000_000_123), "2023-11-14 22:13:20 UTC");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
        let h = "0".repeat(64);
        assert_eq!(blob_link(&format!("bytestream://x:1/blobs/{h}/12")), Some(format!("/blobs/{h}/12")));
        assert_eq!(blob_link(&format!("bytestream://x:1/inst/blobs/{h}/12")), Some(format!("/blobs/{h}/12")));
        assert_eq!(blob_link("bytestream://x/blobs/zz/1"), None);
        assert_eq!(blob_link("file:///tmp/test.log"), None);
        assert_eq!(shorten("abcdef", 3), "abc…");
        assert_eq!(shorten("ab", 3), "ab");
    }

    #[test]
    fn the_action_table_links_its_pages() {
        let summary = InvocationSummary { actions: 250, ..Default::default() };
        let critical = CriticalPath::default();
        let acts = |page| InvocationActions { summary: &summary, page, rows: &[], longest: &[], critical: &critical };
        let first = invocation("a b", None, &acts(0)).into_string();
        assert!(first.contains("Page 1 of 3"), "{first}");
        assert!(first.contains("href=\"/invocations/a%20b?page=1#actions\">Next"), "{first}");
        assert!(!first.contains("Previous"));
        let last = invocation("a b", None, &acts(2)).into_string();
        assert!(last.contains("Page 3 of 3") && last.contains("?page=1#actions\">Previous") && !last.contains("Next"));
        let small = InvocationSummary { actions: 100, ..Default::default() };
        let one = InvocationActions { summary: &small, page: 0, rows: &[], longest: &[], critical: &critical };
        assert!(!invocation("x", None, &one).into_string().contains("Page 1"), "one page needs no links");
    }
}
