//! `gantry invocation <id>`: one Bazel invocation as the Build Event Service received it
//! (command, patterns, exit code, targets and tests) and what it cost on gantry's
//! executors, from the execution log (total executor service time, action count,
//! per-action metering).

use anyhow::Context;

#[derive(clap::Args)]
pub struct InvocationArgs {
    /// Bazel's --invocation_id (tool_invocation_id in RequestMetadata).
    id: String,
    #[command(flatten)]
    serve: crate::serve::ServeArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: InvocationArgs) -> anyhow::Result<()> {
    let config = crate::serve::load_config(&args.serve)?;
    let db = gantry_store::open_metadata(&config).await.context("opening the execution log")?;
    let log = gantry_store::SqlExecutionLog::new(db.clone());
    use gantry_core::{ExecutionLog as _, InvocationStore as _};
    let summary = log.invocation(&args.id).await?;
    let actions = log.actions(&args.id).await?;
    let bes = gantry_store::SqlInvocationStore::new(db).get(&args.id).await?;
    if args.json {
        let build = bes.as_ref().map(|i| {
            serde_json::json!({
                "build_id": i.build_id, "owner": i.owner, "command": i.command, "patterns": i.patterns,
                "options": i.options, "metadata": i.metadata, "started_unix_ms": i.started_unix_ms,
                "finished_unix_ms": i.finished_unix_ms, "exit_code": i.exit_code, "exit_name": i.exit_name,
                "instance": i.instance, "cache_lookups": i.cache_lookups, "cache_hits": i.cache_hits,
                "critical_path": i.critical_path,
                "targets": i.targets.iter().map(|t| serde_json::json!({
                    "label": t.label, "kind": t.kind, "success": t.success,
                })).collect::<Vec<_>>(),
                "tests": i.tests.iter().map(|t| serde_json::json!({
                    "label": t.label, "run": t.run, "shard": t.shard, "attempt": t.attempt, "status": t.status,
                    "duration_ms": t.duration_ms, "cached_locally": t.cached_locally,
                    "logs": t.logs.iter().map(|(n, u)| serde_json::json!({"name": n, "uri": u})).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            })
        });
        let v = serde_json::json!({
            "build": build,
            "tool_invocation_id": summary.tool_invocation_id,
            "actions": summary.actions,
            "executor_service_seconds": summary.executor_service_seconds,
            "cpu_seconds": summary.cpu_seconds,
            "max_peak_memory_bytes": summary.max_peak_memory_bytes,
            "failed_actions": summary.failed_actions,
            "executions": actions.iter().map(|a| serde_json::json!({
                "operation": a.operation, "mnemonic": a.action_mnemonic, "target": a.target_id,
                "worker": a.worker, "exit_code": a.exit_code, "status_code": a.status_code,
                "peak_memory_bytes": a.peak_memory_bytes, "user_cpu_seconds": a.user_cpu_seconds,
                "system_cpu_seconds": a.system_cpu_seconds, "wall_seconds": a.wall_seconds,
                "queued_seconds": a.queued_seconds, "metering": a.metering, "size_class": a.size_class,
                "instance": a.instance, "action_digest": a.action_digest, "shape_key": a.shape_key,
            })).collect::<Vec<_>>(),
        });
        println!("{v}");
        return Ok(());
    }
    if let Some(i) = &bes {
        println!(
            "bazel {} {}: {} ({}), {:.1} s, {} targets ({} failed), {} test results",
            i.command,
            i.patterns.join(" "),
            if i.exit_name.is_empty() { "no exit code" } else { &i.exit_name },
            i.exit_code,
            (i.finished_unix_ms - i.started_unix_ms).max(0) as f64 / 1000.0,
            i.target_count,
            i.failed_targets,
            i.tests.len()
        );
        if i.cache_lookups > 0 {
            println!("  remote cache hits: {} of {} lookups", i.cache_hits, i.cache_lookups);
        }
        for t in &i.tests {
            println!("  {:<10} {} ({} ms)", t.status, t.label, t.duration_ms);
        }
    }
    if summary.actions == 0 {
        if bes.is_some() {
            return Ok(());
        }
        anyhow::bail!("no build events or executed actions recorded for invocation {}", args.id);
    }
    println!(
        "invocation {}: {} actions executed, {:.2} s executor service time, {:.2} s CPU, peak {:.1} MiB, {} failed",
        summary.tool_invocation_id,
        summary.actions,
        summary.executor_service_seconds,
        summary.cpu_seconds,
        summary.max_peak_memory_bytes as f64 / (1 << 20) as f64,
        summary.failed_actions
    );
    println!(
        "{:<14} {:<40} {:>6} {:>10} {:>8} {:>8} {:>8}  metering",
        "mnemonic", "target", "exit", "peak MiB", "user s", "sys s", "wall s"
    );
    for a in &actions {
        println!(
            "{:<14} {:<40} {:>6} {:>10.1} {:>8.3} {:>8.3} {:>8.3}  {}",
            a.action_mnemonic,
            a.target_id,
            a.exit_code,
            a.peak_memory_bytes as f64 / (1 << 20) as f64,
            a.user_cpu_seconds,
            a.system_cpu_seconds,
            a.wall_seconds,
            a.metering
        );
    }
    Ok(())
}
