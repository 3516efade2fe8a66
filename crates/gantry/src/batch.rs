//! `gantry batch`: stream targets to a server's Batcher and print the builds it cuts;
//! `gantry batch plan`: the same planning offline, from a model directory.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use gantry_batch::formats::{batch_to_json_line, parse_context, parse_target_line};
use gantry_batch::{Models, StreamingPlanner};
use gantry_proto::batch::v1 as pb;

/// Targets per EnqueueTargets request message.
const TARGETS_PER_REQUEST: usize = 10_000;

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BatchArgs {
    #[command(subcommand)]
    plan: Option<BatchSub>,
    #[command(flatten)]
    enqueue: EnqueueArgs,
}

#[derive(clap::Subcommand)]
enum BatchSub {
    /// Plan batches offline with a model directory, no server: one JSON line per batch.
    Plan(PlanArgs),
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum CommandArg {
    Build,
    Test,
}

#[derive(Clone, Copy, clap::ValueEnum)]
#[value(rename_all = "UPPERCASE")]
enum PriorityArg {
    High,
    Medium,
    Low,
}

#[derive(clap::Args)]
struct EnqueueArgs {
    /// Server to send the targets to.
    #[arg(long, default_value = "grpc://127.0.0.1:8980", env = "GANTRY_SERVER")]
    server: String,
    /// Bazel command of the builds.
    #[arg(long, value_enum, default_value = "build")]
    command: CommandArg,
    /// Priority: selects the memory cutoff.
    #[arg(long, value_enum, ignore_case = true, default_value = "MEDIUM")]
    priority: PriorityArg,
    /// A Bazel flag for every build, e.g. --flag=--keep_going (repeatable).
    #[arg(long = "flag", allow_hyphen_values = true)]
    flags: Vec<String>,
    /// Workspace the builds run in [default: the current directory].
    #[arg(long, conflicts_with = "git_repo")]
    workspace: Option<PathBuf>,
    /// Git repository the builds check out (with --revision).
    #[arg(long, requires = "revision")]
    git_repo: Option<String>,
    /// Revision of --git-repo.
    #[arg(long, requires = "git_repo")]
    revision: Option<String>,
    /// Originating user [default: $USER].
    #[arg(long)]
    user: Option<String>,
    #[arg(long, default_value = "")]
    product_area: String,
    #[arg(long, default_value = "cli")]
    tool_tag: String,
    /// Targets file (`LABEL [RULE_KIND [TAG,...]]` per line) [default: stdin].
    #[arg(long)]
    targets: Option<PathBuf>,
    /// Print one JSON object per build.
    #[arg(long)]
    json: bool,
    /// After planning, follow the builds until each has run (as `gantry builds watch`).
    #[arg(long)]
    wait: bool,
}

#[derive(clap::Args)]
struct PlanArgs {
    /// Model directory written by `gantry model train`.
    #[arg(long)]
    model: PathBuf,
    /// Build context JSON: {"workspace":..., "command":..., "flags":[...], "priority":..., ...}
    #[arg(long)]
    context: PathBuf,
    /// Targets file [default: stdin].
    #[arg(long)]
    targets: Option<PathBuf>,
    /// gantry.toml whose [batch] section sets the cutoffs [default: built-in defaults].
    #[arg(long)]
    config: Option<PathBuf>,
}

fn open_targets(path: &Option<PathBuf>) -> anyhow::Result<Box<dyn BufRead + Send>> {
    Ok(match path {
        Some(p) => Box::new(std::io::BufReader::new(
            std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?,
        )),
        None => Box::new(std::io::BufReader::new(std::io::stdin())),
    })
}

pub async fn run(args: BatchArgs) -> anyhow::Result<()> {
    match args.plan {
        Some(BatchSub::Plan(p)) => tokio::task::spawn_blocking(move || plan(p)).await?,
        None => enqueue(args.enqueue).await,
    }
}

fn plan(args: PlanArgs) -> anyhow::Result<()> {
    let models = Models::load(&args.model)?;
    let ctx_text =
        std::fs::read_to_string(&args.context).with_context(|| format!("reading {}", args.context.display()))?;
    let ctx = parse_context(&ctx_text).with_context(|| format!("context file {}", args.context.display()))?;
    let batch_cfg = match &args.config {
        Some(p) => gantry_config::Config::load(p)?.batch,
        None => gantry_config::BatchConfig::default(),
    };
    let mut planner = StreamingPlanner::new(ctx, gantry_batch::PlannerConfig::from_config(&batch_cfg), &models)?;
    let out = std::io::stdout();
    let mut out = std::io::BufWriter::new(out.lock());
    let mut emit = |batches: Vec<gantry_batch::Batch>| -> anyhow::Result<()> {
        for b in batches {
            writeln!(out, "{}", batch_to_json_line(&b)?)?;
        }
        Ok(())
    };
    for (i, line) in open_targets(&args.targets)?.lines().enumerate() {
        let line = line.context("reading targets")?;
        if let Some(t) = parse_target_line(&line, i + 1)? {
            planner.push(t).with_context(|| format!("targets line {}", i + 1))?;
            emit(planner.take_ready())?;
        }
    }
    emit(planner.finish())?;
    out.flush()?;
    Ok(())
}

fn context(args: &EnqueueArgs) -> anyhow::Result<pb::BuildContext> {
    let source = match (&args.git_repo, &args.revision) {
        (Some(repo), Some(rev)) => {
            pb::execution_context::Source::Git(pb::GitRevision { repository: repo.clone(), revision: rev.clone() })
        }
        _ => {
            let ws = match &args.workspace {
                Some(w) => w.clone(),
                None => std::env::current_dir()?,
            };
            pb::execution_context::Source::Workspace(ws.display().to_string())
        }
    };
    Ok(pb::BuildContext {
        execution: Some(pb::ExecutionContext { source: Some(source) }),
        command: match args.command {
            CommandArg::Build => pb::BazelCommand::Build,
            CommandArg::Test => pb::BazelCommand::Test,
        } as i32,
        flags: args.flags.clone(),
        priority: match args.priority {
            PriorityArg::High => pb::Priority::High,
            PriorityArg::Medium => pb::Priority::Medium,
            PriorityArg::Low => pb::Priority::Low,
        } as i32,
        user: args.user.clone().unwrap_or_else(|| std::env::var("USER").unwrap_or_default()),
        product_area: args.product_area.clone(),
        tool_tag: args.tool_tag.clone(),
    })
}

async fn enqueue(args: EnqueueArgs) -> anyhow::Result<()> {
    let ctx = context(&args)?;
    let mut client = crate::builds::client(&args.server).await?;

    // Read and parse targets on a blocking thread; a bad line stops everything with its
    // line number. The bounded channel keeps at most a few requests in memory.
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::EnqueueTargetsRequest>(4);
    let reader = open_targets(&args.targets)?;
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sent_r = sent.clone();
    let reader_task = tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let mut first = Some(ctx);
        let mut batch = Vec::with_capacity(TARGETS_PER_REQUEST);
        let flush = |first: &mut Option<pb::BuildContext>, batch: &mut Vec<pb::Target>| {
            let req = pb::EnqueueTargetsRequest { context: first.take(), targets: std::mem::take(batch) };
            sent_r.fetch_add(req.targets.len() as u64, std::sync::atomic::Ordering::Relaxed);
            tx.blocking_send(req).is_ok()
        };
        for (i, line) in reader.lines().enumerate() {
            let line = line.context("reading targets")?;
            if let Some(t) = parse_target_line(&line, i + 1)? {
                batch.push(pb::Target { label: t.label, rule_kind: t.rule_kind.unwrap_or_default(), tags: t.tags });
                if batch.len() == TARGETS_PER_REQUEST && !flush(&mut first, &mut batch) {
                    return Ok(()); // the server ended the stream; its status says why
                }
            }
        }
        if !batch.is_empty() || first.is_some() {
            flush(&mut first, &mut batch);
        }
        Ok(())
    });

    let start = Instant::now();
    let mut responses = match client.enqueue_targets(tokio_stream::wrappers::ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            // A bad first line ends the request stream early; its error explains the refusal.
            reader_error(reader_task).await?;
            bail!("server refused the stream: {}: {}", status.code(), status.message());
        }
    };
    let progress = std::io::stderr().is_terminal();
    let mut last_progress = Instant::now();
    let (mut builds, mut targets) = (0u64, 0u64);
    let mut stream_id = String::new();
    let stdout = std::io::stdout();
    loop {
        let msg = match responses.message().await {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(status) => {
                // Prefer the reader's error (a bad targets line) over the stream's.
                reader_error(reader_task).await?;
                bail!("server refused the stream: {}: {}", status.code(), status.message());
            }
        };
        let b = msg.build.context("response without a build")?;
        stream_id = msg.stream_id.clone();
        builds += 1;
        targets += b.targets.len() as u64;
        let reason = pb::BatchSizeReason::try_from(b.reason)
            .map(|r| r.as_str_name().trim_start_matches("BATCH_SIZE_REASON_").to_string())
            .unwrap_or_else(|_| b.reason.to_string());
        let mut out = stdout.lock();
        if args.json {
            let v = serde_json::json!({
                "stream_id": msg.stream_id,
                "build_id": b.build_id,
                "targets": b.targets,
                "reason": reason,
                "memory_estimate_bytes": b.memory_estimate_bytes,
                "occupancy_estimate_esu": b.occupancy_estimate_esu,
                "executor_types": b.executor_types,
            });
            writeln!(out, "{v}")?;
        } else {
            let mem = b.memory_estimate_bytes.map_or("-".into(), |m| format!("{:.2}GB", m as f64 / 1e9));
            let occ = b.occupancy_estimate_esu.map_or("-".into(), |o| format!("{o:.1}ESU"));
            writeln!(
                out,
                "{}  {:<24} {:>5} targets  mem {:>8}  occ {:>9}  [{}]",
                b.build_id,
                reason,
                b.targets.len(),
                mem,
                occ,
                b.executor_types.join(",")
            )?;
        }
        if progress && last_progress.elapsed() > Duration::from_millis(500) {
            eprint!("\r  sent {} targets, {builds} builds back", sent.load(std::sync::atomic::Ordering::Relaxed));
            last_progress = Instant::now();
        }
    }
    reader_task.await??;
    if progress {
        eprint!("\r");
    }
    eprintln!("stream {stream_id}: {targets} targets in {builds} builds ({:.1}s)", start.elapsed().as_secs_f64());
    if args.wait && !stream_id.is_empty() {
        return crate::builds::watch(crate::builds::WatchArgs::new(stream_id, args.server.clone(), args.json)).await;
    }
    Ok(())
}

/// The target reader's error, if it has one. Bounded: once the call has failed, the
/// reader's next send fails too, but never wait long on it.
async fn reader_error(task: tokio::task::JoinHandle<anyhow::Result<()>>) -> anyhow::Result<()> {
    match tokio::time::timeout(Duration::from_secs(5), task).await {
        Ok(joined) => joined?,
        Err(_) => Ok(()),
    }
}
