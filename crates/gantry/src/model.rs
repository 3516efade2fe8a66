//! `gantry model train|eval|export-history`: fit the batching service's memory and
//! occupancy models from a build history (a JSONL file, or a running server's live
//! history), report how well a model predicts one, and export the live history.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use gantry_batch::{eval, read_history, train, Models, Timestamp, TrainConfig};

#[derive(clap::Subcommand)]
pub enum ModelCommand {
    /// Train models from a history JSONL file into a directory, or (--server) make a
    /// running server retrain from its live build history and swap the new models in.
    Train(TrainArgs),
    /// Print RMSE of a model against a history, overall and by bins of actual usage.
    Eval(EvalArgs),
    /// Write the server's build history (the finished builds in the long window that can
    /// teach the models) as history JSONL, from the metadata store in its config.
    ExportHistory(ExportArgs),
}

#[derive(clap::Args)]
pub struct TrainArgs {
    /// History of builds, one JSON object per line.
    #[arg(long, required_unless_present = "server", conflicts_with = "server", requires = "out")]
    history: Option<PathBuf>,
    /// Model directory to write (created if missing).
    #[arg(long)]
    out: Option<PathBuf>,
    /// A running `gantry serve` to retrain from its live history, e.g. grpc://127.0.0.1:8980.
    #[arg(long)]
    server: Option<String>,
    /// End of the training windows (RFC 3339) [default: the newest build in the history].
    #[arg(long)]
    now: Option<String>,
    /// The model that plans: shared (costs per target, package and directory) or linear
    /// (the first versions' hashed linear models). With --server, the server's
    /// `[batch] learner` decides.
    #[arg(long, default_value = "shared", value_parser = ["shared", "linear"], conflicts_with = "server")]
    learner: String,
}

#[derive(clap::Args)]
pub struct ExportArgs {
    /// Output file [default: stdout].
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    serve: crate::serve::ServeArgs,
}

#[derive(clap::Args)]
pub struct EvalArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    history: PathBuf,
}

fn load_history(path: &PathBuf) -> anyhow::Result<Vec<gantry_batch::BuildRecord>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    read_history(std::io::BufReader::new(f)).with_context(|| format!("history {}", path.display()))
}

pub async fn run(cmd: ModelCommand) -> anyhow::Result<()> {
    match cmd {
        ModelCommand::Train(a) if a.server.is_some() => train_on_server(a.server.as_deref().expect("checked")).await,
        ModelCommand::ExportHistory(a) => export_history(a).await,
        cmd => tokio::task::spawn_blocking(move || run_offline(cmd)).await?,
    }
}

async fn train_on_server(server: &str) -> anyhow::Result<()> {
    let mut c = crate::builds::client(server).await?;
    let r = c
        .train_models(gantry_proto::batch::v1::TrainModelsRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("training on {server}: {}: {}", s.code(), s.message()))?
        .into_inner();
    eprintln!(
        "{server} retrained on {} builds ({} OOM) in {:.1}s: memory model {}, occupancy model {}; the planner uses them now",
        r.builds,
        r.oom_builds,
        r.seconds,
        if r.memory_model { "yes" } else { "no" },
        if r.occupancy_model { "yes" } else { "no" }
    );
    Ok(())
}

async fn export_history(a: ExportArgs) -> anyhow::Result<()> {
    let config = crate::serve::load_config(&a.serve)?;
    let db = gantry_store::open_metadata(&config).await.context("opening the build history")?;
    let store = gantry_store::SqlBuildStore::new(db);
    let b = &config.batch;
    let records = gantry_builds::read_history(&store, b.memory_label, b.bazel_memory.as_u64(), b.long_window).await?;
    let mut buf = Vec::new();
    gantry_batch::history::write_history(&mut buf, &records)?;
    match &a.out {
        Some(p) => {
            // Whole file or nothing: written beside, then renamed.
            let tmp = p.with_extension("tmp");
            std::fs::write(&tmp, &buf).with_context(|| format!("writing {}", tmp.display()))?;
            std::fs::rename(&tmp, p).with_context(|| format!("writing {}", p.display()))?;
        }
        None => std::io::Write::write_all(&mut std::io::stdout().lock(), &buf)?,
    }
    eprintln!("{} builds exported", records.len());
    Ok(())
}

fn run_offline(cmd: ModelCommand) -> anyhow::Result<()> {
    match cmd {
        ModelCommand::ExportHistory(_) => unreachable!("handled in run"),
        ModelCommand::Train(a) => {
            let (history_path, out) = (a.history.expect("clap requires it"), a.out.expect("clap requires it"));
            let history = load_history(&history_path)?;
            anyhow::ensure!(!history.is_empty(), "history {} has no builds", history_path.display());
            // Windows are relative to a clock passed in; by default the history's own end,
            // so replaying an old history trains on it rather than on an empty window.
            let now = match &a.now {
                Some(s) => Timestamp::parse_rfc3339(s).context("--now")?,
                None => history.iter().map(|r| r.time).max().expect("non-empty"),
            };
            let start = Instant::now();
            let learner = match a.learner.as_str() {
                "linear" => gantry_config::Learner::Linear,
                _ => gantry_config::Learner::Shared,
            };
            let config = TrainConfig { learner: gantry_builds::learner_of(learner), ..TrainConfig::default() };
            let models = train(&history, &config, now)?;
            models.save(&out)?;
            let m = &models.manifest;
            eprintln!(
                "trained on {} builds up to {} in {:.1}s ({} skipped); planning with {}; memory crosses {}, occupancy crosses {}; wrote {}",
                history.len(),
                now.to_rfc3339(),
                start.elapsed().as_secs_f64(),
                m.skipped_records,
                match &models.shared {
                    Some(s) => format!("the shared-cost model (memory power {:.3})", s.power()),
                    None => "the linear models".to_string(),
                },
                m.memory_crosses.len(),
                m.occupancy_crosses.len(),
                out.display()
            );
            Ok(())
        }
        ModelCommand::Eval(a) => {
            let models = Models::load(&a.model)?;
            let history = load_history(&a.history)?;
            print!("{}", eval(&models, &history)?);
            Ok(())
        }
    }
}
