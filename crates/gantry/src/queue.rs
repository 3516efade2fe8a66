//! `gantry queue`: submit a change to a running server's submit queue, and follow it
//! (`status`, `watch ID`, `cancel ID`, `history`). Thin: every decision is the server's.

use gantry_proto::queue::v1 as pb;
use serde_json::{json, Value};

#[derive(clap::Subcommand)]
pub enum QueueCommand {
    /// Enqueue a branch or commit (based on some mainline commit) to land on the mainline.
    Submit {
        /// A branch, tag or commit of the queue's repository.
        #[arg(long = "change")]
        change: String,
        /// Higher enters the queue first among changes submitted at the same time.
        #[arg(long, default_value_t = 0)]
        priority: i32,
        #[command(flatten)]
        common: Common,
    },
    /// Pending changes in queue order: position, predicted success, builds under way.
    Status {
        #[command(flatten)]
        common: Common,
    },
    /// Follow one change until it lands, is rejected or is cancelled.
    Watch {
        id: String,
        #[command(flatten)]
        common: Common,
    },
    /// Withdraw a change that has not been decided yet.
    Cancel {
        id: String,
        #[command(flatten)]
        common: Common,
    },
    /// Every change, newest first, and every move of the mainline.
    History {
        /// At most this many changes (0: all).
        #[arg(long, default_value_t = 0)]
        limit: u32,
        #[command(flatten)]
        common: Common,
    },
}

#[derive(clap::Args)]
pub struct Common {
    /// Server running the queue.
    #[arg(long, default_value = "grpc://127.0.0.1:8980", env = "GANTRY_SERVER")]
    server: String,
    /// JSON (one object per line) instead of text.
    #[arg(long)]
    json: bool,
}

async fn client(
    server: &str,
) -> anyhow::Result<pb::submit_queue_client::SubmitQueueClient<gantry_core::client::GrpcChannel>> {
    Ok(pb::submit_queue_client::SubmitQueueClient::new(gantry_core::client::connect(server).await?))
}

fn build_json(b: &pb::Build) -> Value {
    json!({
        "build_id": b.build_id, "change_id": b.change_id, "base_version": b.base_version, "assumed": b.assumed,
        "attempt": b.attempt, "state": b.state, "commit": b.commit, "started_unix_ms": b.started_unix_ms,
        "finished_unix_ms": b.finished_unix_ms, "message": b.message, "targets": b.targets, "failed_targets": b.failed_targets,
    })
}

fn change_json(c: &pb::Change) -> Value {
    json!({
        "change_id": c.change_id, "change_ref": c.change_ref, "commit": c.commit, "merge_base": c.merge_base,
        "priority": c.priority, "author": c.author, "state": c.state, "reason": c.reason, "position": c.position,
        "predicted_success": c.predicted_success, "waits_for": c.waits_for,
        "builds": c.builds.iter().map(build_json).collect::<Vec<_>>(), "affected_targets": c.affected_targets,
        "alters_graph": c.alters_graph, "submitted_unix_ms": c.submitted_unix_ms, "decided_unix_ms": c.decided_unix_ms,
        "landed_commit": c.landed_commit, "landed_version": c.landed_version,
    })
}

fn short(s: &str) -> &str {
    &s[..s.len().min(10)]
}

fn change_line(c: &pb::Change) -> String {
    let mut line = format!("{:<6} {:<10} {:<24}", c.change_id, c.state, c.change_ref);
    match c.state.as_str() {
        "PENDING" => {
            line += &format!(" #{} P(lands)={:.2}", c.position, c.predicted_success);
            if !c.waits_for.is_empty() {
                line += &format!(" waits for {}", c.waits_for.join(","));
            }
        }
        "LANDED" => line += &format!(" as {} (version {})", short(&c.landed_commit), c.landed_version),
        _ if !c.reason.is_empty() => line += &format!(" {}", c.reason),
        _ => {}
    }
    line
}

fn print_change(c: &pb::Change, json: bool, with_builds: bool) {
    if json {
        println!("{}", change_json(c));
        return;
    }
    println!("{}", change_line(c));
    for b in c.builds.iter().filter(|b| with_builds && (b.state == "RUNNING" || c.state != "PENDING")) {
        let on = if b.assumed.is_empty() { String::new() } else { format!(" + {}", b.assumed.join(" + ")) };
        let msg = if b.message.is_empty() { String::new() } else { format!(" ({})", b.message) };
        println!("    {:<5} {:<9} on version {}{on}, attempt {}{msg}", b.build_id, b.state, b.base_version, b.attempt);
    }
}

pub async fn run(cmd: QueueCommand) -> anyhow::Result<()> {
    match cmd {
        QueueCommand::Submit { change, priority, common } => {
            let c = client(&common.server)
                .await?
                .submit(pb::SubmitRequest { change_ref: change, priority })
                .await?
                .into_inner();
            print_change(&c, common.json, false);
        }
        QueueCommand::Status { common } => {
            let s = client(&common.server).await?.get_status(pb::GetStatusRequest {}).await?.into_inner();
            if common.json {
                let changes: Vec<Value> = s.changes.iter().map(change_json).collect();
                let flaky: Vec<Value> = s
                    .flaky_targets
                    .iter()
                    .map(|f| json!({"target": f.target, "failures": f.failures, "flaky": f.flaky}))
                    .collect();
                println!(
                    "{}",
                    json!({"mainline": s.mainline, "mainline_commit": s.mainline_commit, "capacity": s.capacity, "changes": changes,
                           "flaky_targets": flaky, "batches": s.batches, "batch_landed": s.batch_landed,
                           "bisection_builds": s.bisection_builds})
                );
                return Ok(());
            }
            println!("{} at {}, {} build slots", s.mainline, short(&s.mainline_commit), s.capacity);
            if s.batches > 0 || s.bisection_builds > 0 {
                println!(
                    "{} batches landed {} changes; {} builds bisected failed batches",
                    s.batches, s.batch_landed, s.bisection_builds
                );
            }
            for c in &s.changes {
                print_change(c, false, true);
            }
            if !s.flaky_targets.is_empty() {
                println!("flaky targets (failures that passed on the same tree / failures):");
                for f in &s.flaky_targets {
                    println!("  {} {}/{}", f.target, f.flaky, f.failures);
                }
            }
        }
        QueueCommand::Watch { id, common } => {
            let mut stream =
                client(&common.server).await?.watch(pb::WatchRequest { change_id: id }).await?.into_inner();
            let mut last = None;
            while let Some(c) = stream.message().await? {
                print_change(&c, common.json, !common.json);
                last = Some(c);
            }
            if last.is_some_and(|c| c.state != "LANDED") {
                std::process::exit(1);
            }
        }
        QueueCommand::Cancel { id, common } => {
            let c = client(&common.server).await?.cancel(pb::CancelRequest { change_id: id }).await?.into_inner();
            print_change(&c, common.json, false);
        }
        QueueCommand::History { limit, common } => {
            let h = client(&common.server).await?.history(pb::HistoryRequest { limit }).await?.into_inner();
            if common.json {
                let moves: Vec<Value> = h
                    .mainline
                    .iter()
                    .map(|m| json!({"version": m.version, "change_id": m.change_id, "old_commit": m.old_commit,
                        "new_commit": m.new_commit, "state": m.state, "build_id": m.build_id, "landed_unix_ms": m.landed_unix_ms, "how": m.how}))
                    .collect();
                let changes: Vec<Value> = h.changes.iter().map(change_json).collect();
                println!("{}", json!({"changes": changes, "mainline": moves}));
                return Ok(());
            }
            for c in &h.changes {
                print_change(c, false, false);
            }
            println!("mainline:");
            for m in &h.mainline {
                println!(
                    "  v{:<3} {:<6} {} -> {} {} {}",
                    m.version,
                    m.change_id,
                    short(&m.old_commit),
                    short(&m.new_commit),
                    m.state,
                    m.how
                );
            }
        }
    }
    Ok(())
}
