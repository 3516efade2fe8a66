//! `gantry builds`: the batching service's builds (id, state, targets, reason, estimates
//! against actuals, outcome, retries); `gantry builds watch STREAM` follows one
//! EnqueueTargets stream to its end with a progress bar.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};

use gantry_proto::batch::v1 as pb;

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BuildsArgs {
    #[command(subcommand)]
    sub: Option<BuildsSub>,
    #[command(flatten)]
    list: ListArgs,
}

#[derive(clap::Subcommand)]
enum BuildsSub {
    /// Follow one EnqueueTargets stream until every build (retries included) has ended.
    Watch(WatchArgs),
}

#[derive(clap::Args)]
struct ListArgs {
    /// Server running the builds.
    #[arg(long, default_value = "grpc://127.0.0.1:8980", env = "GANTRY_SERVER")]
    server: String,
    /// Only this stream's builds, oldest first.
    #[arg(long)]
    stream: Option<String>,
    /// At most this many builds.
    #[arg(long, default_value_t = 50)]
    limit: u32,
    /// One JSON object per build.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct WatchArgs {
    /// The stream id EnqueueTargets answered with (printed by `gantry batch`).
    stream: String,
    #[arg(long, default_value = "grpc://127.0.0.1:8980", env = "GANTRY_SERVER")]
    server: String,
    /// One JSON object per build status change instead of the table and progress bar.
    #[arg(long)]
    json: bool,
}

impl WatchArgs {
    pub fn new(stream: String, server: String, json: bool) -> WatchArgs {
        WatchArgs { stream, server, json }
    }
}

pub async fn client(
    server: &str,
) -> anyhow::Result<pb::batcher_client::BatcherClient<gantry_core::client::GrpcChannel>> {
    Ok(pb::batcher_client::BatcherClient::new(gantry_core::client::connect(server).await?))
}

pub async fn run(args: BuildsArgs) -> anyhow::Result<()> {
    match args.sub {
        Some(BuildsSub::Watch(w)) => watch(w).await,
        None => list(args.list).await,
    }
}

macro_rules! enum_name {
    ($fn:ident, $ty:ty, $prefix:literal) => {
        fn $fn(v: i32) -> String {
            <$ty>::try_from(v)
                .map_or_else(|_| v.to_string(), |e| e.as_str_name().trim_start_matches($prefix).to_string())
        }
    };
}
enum_name!(state_name, pb::BuildState, "BUILD_STATE_");
enum_name!(outcome_enum_name, pb::BuildOutcome, "BUILD_OUTCOME_");
enum_name!(retry_name, pb::RetryKind, "RETRY_KIND_");
enum_name!(reason_name, pb::BatchSizeReason, "BATCH_SIZE_REASON_");

pub fn outcome_name(b: &pb::BuildStatus) -> String {
    if b.state != pb::BuildState::Done as i32 {
        return state_name(b.state);
    }
    outcome_enum_name(b.outcome)
}

/// The outcome column: for an OOM build, with what said so ("OOM:gc_spiral").
fn outcome_cell(b: &pb::BuildStatus) -> String {
    let name = outcome_name(b);
    if b.oom_signal.is_empty() || b.state != pb::BuildState::Done as i32 {
        name
    } else {
        format!("{name}:{}", b.oom_signal)
    }
}

fn mib(v: Option<u64>) -> String {
    v.map_or("-".into(), |b| format!("{:.1}M", b as f64 / (1 << 20) as f64))
}

pub fn status_json(b: &pb::BuildStatus) -> serde_json::Value {
    serde_json::json!({
        "build_id": b.build_id,
        "stream_id": b.stream_id,
        "parent_build_id": b.parent_build_id,
        "retry_kind": retry_name(b.retry_kind),
        "state": state_name(b.state),
        "outcome": outcome_enum_name(b.outcome),
        "targets": b.targets,
        "reason": reason_name(b.reason),
        "reason_note": b.reason_note,
        "memory_estimate_bytes": b.memory_estimate_bytes,
        "occupancy_estimate_esu": b.occupancy_estimate_esu,
        "oom_probability": b.oom_probability,
        "executor_types": b.executor_types,
        "used_heap_post_build_bytes": b.used_heap_post_build_bytes,
        "peak_post_gc_heap_bytes": b.peak_post_gc_heap_bytes,
        "server_vm_hwm_bytes": b.server_vm_hwm_bytes,
        "occupancy_esu": b.occupancy_esu,
        "actions_executed": b.actions_executed,
        "wall_seconds": b.wall_seconds,
        "exit_code": b.exit_code,
        "oom_signal": b.oom_signal,
        "message": b.message,
        "invocation_id": b.invocation_id,
        "retry_build_ids": b.retry_build_ids,
    })
}

fn header() -> String {
    format!(
        "{:<40} {:<20} {:>7} {:<24} {:>17} {:>13} {:>7}  {}",
        "build", "outcome", "targets", "reason", "mem est/actual", "occ est/act", "wall", "retries / message"
    )
}

fn row(b: &pb::BuildStatus) -> String {
    let reason = reason_name(b.reason).replace("MEMORY_ESTIMATE_ERROR", "MEM_ESTIMATE_ERROR");
    let occ = |v: Option<f64>| v.map_or("-".into(), |o| format!("{o:.2}"));
    let tail = if !b.retry_build_ids.is_empty() {
        format!("-> {}", b.retry_build_ids.join(" "))
    } else if !b.message.is_empty() {
        b.message.clone()
    } else {
        b.reason_note.clone()
    };
    format!(
        "{:<40} {:<20} {:>7} {:<24} {:>8}/{:<8} {:>6}/{:<6} {:>6.1}s  {}",
        b.build_id,
        outcome_cell(b),
        b.targets.len(),
        reason,
        mib(b.memory_estimate_bytes),
        mib(b.used_heap_post_build_bytes),
        occ(b.occupancy_estimate_esu),
        occ(b.occupancy_esu),
        b.wall_seconds.unwrap_or(0.0),
        tail
    )
}

async fn list(args: ListArgs) -> anyhow::Result<()> {
    let mut c = client(&args.server).await?;
    let one_stream = args.stream.is_some();
    let r = c
        .list_builds(pb::ListBuildsRequest { stream_id: args.stream.unwrap_or_default(), limit: args.limit })
        .await
        .map_err(|s| anyhow::anyhow!("{}: {}", s.code(), s.message()))?
        .into_inner();
    let mut out = std::io::stdout().lock();
    if args.json {
        for b in &r.builds {
            writeln!(out, "{}", status_json(b))?;
        }
        return Ok(());
    }
    writeln!(out, "{}", header())?;
    for b in &r.builds {
        writeln!(out, "{}", row(b))?;
    }
    if one_stream {
        let builds = r.builds.into_iter().map(|b| (b.build_id.clone(), b)).collect();
        if let Some(rates) = tally(&builds).oom_rates() {
            writeln!(out, "{rates}")?;
        }
    }
    Ok(())
}

/// Totals over a stream's builds; a target is done well when the last build that holds
/// it (a build with no retries) succeeded.
#[derive(Default)]
pub struct Tally {
    pub builds: usize,
    pub done: usize,
    pub running: usize,
    pub success: usize,
    pub oom: usize,
    pub deadline: usize,
    pub failed: usize,
    pub retries: usize,
    pub targets_ok: usize,
    pub targets_bad: usize,
    /// Finished builds the planner gave an OOM probability, the sum of those
    /// probabilities (the OOM builds it expected) and how many of them ran out of memory.
    pub with_probability: usize,
    pub expected_oom: f64,
    pub observed_oom: usize,
}

impl Tally {
    /// "predicted OOM rate 0.08%, observed 0.00% over 120 builds", or None when no finished
    /// build had a probability (no models).
    pub fn oom_rates(&self) -> Option<String> {
        (self.with_probability > 0).then(|| {
            let n = self.with_probability as f64;
            format!(
                "predicted OOM rate {:.2}%, observed {:.2}% over {} builds",
                100.0 * self.expected_oom / n,
                100.0 * self.observed_oom as f64 / n,
                self.with_probability
            )
        })
    }
}

pub fn tally(builds: &BTreeMap<String, pb::BuildStatus>) -> Tally {
    let mut t = Tally { builds: builds.len(), ..Default::default() };
    for b in builds.values() {
        if !b.parent_build_id.is_empty() {
            t.retries += 1;
        }
        if b.state == pb::BuildState::Running as i32 {
            t.running += 1;
        }
        if b.state != pb::BuildState::Done as i32 {
            continue;
        }
        t.done += 1;
        if let Some(p) = b.oom_probability {
            t.with_probability += 1;
            t.expected_oom += p;
            t.observed_oom += usize::from(b.outcome == pb::BuildOutcome::Oom as i32);
        }
        match pb::BuildOutcome::try_from(b.outcome) {
            Ok(pb::BuildOutcome::Success) => t.success += 1,
            Ok(pb::BuildOutcome::Oom) => t.oom += 1,
            Ok(pb::BuildOutcome::DeadlineExceeded) => t.deadline += 1,
            _ => t.failed += 1,
        }
        if b.retry_build_ids.is_empty() {
            if b.outcome == pb::BuildOutcome::Success as i32 {
                t.targets_ok += b.targets.len();
            } else {
                t.targets_bad += b.targets.len();
            }
        }
    }
    t
}

fn bar(t: &Tally) -> String {
    const WIDTH: usize = 30;
    let filled = (t.done * WIDTH).checked_div(t.builds).unwrap_or(0);
    format!(
        "[{}{}] {}/{} builds done, {} running, {} OOM, {} deadline, {} failed, {} retries",
        "#".repeat(filled),
        ".".repeat(WIDTH - filled),
        t.done,
        t.builds,
        t.running,
        t.oom,
        t.deadline,
        t.failed,
        t.retries
    )
}

/// Follows the stream to its end; prints each build as it finishes. Fails when some
/// target did not end in a successful build.
pub async fn watch(args: WatchArgs) -> anyhow::Result<()> {
    let mut c = client(&args.server).await?;
    let mut stream = c
        .watch_builds(pb::WatchBuildsRequest { stream_id: args.stream.clone() })
        .await
        .map_err(|s| anyhow::anyhow!("watching stream {}: {}: {}", args.stream, s.code(), s.message()))?
        .into_inner();
    let tty = std::io::stderr().is_terminal();
    let started = std::time::Instant::now();
    let mut builds: BTreeMap<String, pb::BuildStatus> = BTreeMap::new();
    if !args.json {
        println!("{}", header());
    }
    loop {
        let b = match stream.message().await {
            Ok(Some(b)) => b,
            Ok(None) => break,
            Err(s) => anyhow::bail!("watching stream {}: {}: {}", args.stream, s.code(), s.message()),
        };
        if args.json {
            println!("{}", status_json(&b));
        } else if b.state == pb::BuildState::Done as i32 {
            if tty {
                eprint!("\r\x1b[K");
            }
            println!("{}", row(&b));
        }
        builds.insert(b.build_id.clone(), b);
        if !args.json {
            let line = bar(&tally(&builds));
            if tty {
                eprint!("\r\x1b[K{line}");
            }
        }
    }
    let t = tally(&builds);
    if tty && !args.json {
        eprint!("\r\x1b[K");
    }
    eprintln!(
        "stream {}: {} builds ({} succeeded, {} OOM, {} deadline exceeded, {} failed, {} retries) in {:.1}s; {} targets built, {} not",
        args.stream,
        t.builds,
        t.success,
        t.oom,
        t.deadline,
        t.failed,
        t.retries,
        started.elapsed().as_secs_f64(),
        t.targets_ok,
        t.targets_bad
    );
    if let Some(rates) = t.oom_rates() {
        eprintln!("  {rates}");
    }
    std::io::stdout().flush()?;
    if t.targets_bad > 0 {
        anyhow::bail!("{} targets did not end in a successful build", t.targets_bad);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(id: &str, outcome: pb::BuildOutcome, p: Option<f64>) -> (String, pb::BuildStatus) {
        let b = pb::BuildStatus {
            build_id: id.into(),
            state: pb::BuildState::Done as i32,
            outcome: outcome as i32,
            oom_probability: p,
            ..Default::default()
        };
        (id.to_string(), b)
    }

    #[test]
    fn the_stream_reports_the_oom_rate_its_planner_expected_beside_the_observed_one() {
        let mut builds: BTreeMap<String, pb::BuildStatus> = [
            done("a", pb::BuildOutcome::Success, Some(0.01)),
            done("b", pb::BuildOutcome::Oom, Some(0.03)),
            done("c", pb::BuildOutcome::Success, None),
        ]
        .into();
        // Running builds and builds without a probability (no model, retries of old
        // records) count in neither rate.
        let running = pb::BuildStatus {
            build_id: "d".into(),
            state: pb::BuildState::Running as i32,
            oom_probability: Some(0.5),
            ..Default::default()
        };
        builds.insert("d".into(), running);
        let t = tally(&builds);
        assert_eq!((t.with_probability, t.observed_oom), (2, 1));
        assert_eq!(t.oom_rates().unwrap(), "predicted OOM rate 2.00%, observed 50.00% over 2 builds");
        builds.retain(|k, _| k == "c");
        assert_eq!(tally(&builds).oom_rates(), None);
    }
}
