//! `gantry model train|eval`: fit the batching service's memory and occupancy models
//! from a build history, and report how well a model predicts one.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use gantry_batch::{eval, read_history, train, Models, Timestamp, TrainConfig};

#[derive(clap::Subcommand)]
pub enum ModelCommand {
    /// Train models from a history JSONL file and write them to a directory.
    Train(TrainArgs),
    /// Print RMSE of a model against a history, overall and by bins of actual usage.
    Eval(EvalArgs),
}

#[derive(clap::Args)]
pub struct TrainArgs {
    /// History of builds, one JSON object per line.
    #[arg(long)]
    history: PathBuf,
    /// Model directory to write (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// End of the training windows (RFC 3339) [default: the newest build in the history].
    #[arg(long)]
    now: Option<String>,
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
    Ok(read_history(std::io::BufReader::new(f)).with_context(|| format!("history {}", path.display()))?)
}

pub fn run(cmd: ModelCommand) -> anyhow::Result<()> {
    match cmd {
        ModelCommand::Train(a) => {
            let history = load_history(&a.history)?;
            anyhow::ensure!(!history.is_empty(), "history {} has no builds", a.history.display());
            // Windows are relative to a clock passed in; by default the history's own end,
            // so replaying an old history trains on it rather than on an empty window.
            let now = match &a.now {
                Some(s) => Timestamp::parse_rfc3339(s).context("--now")?,
                None => history.iter().map(|r| r.time).max().expect("non-empty"),
            };
            let start = Instant::now();
            let models = train(&history, &TrainConfig::default(), now)?;
            models.save(&a.out)?;
            let m = &models.manifest;
            eprintln!(
                "trained on {} builds up to {} in {:.1}s ({} skipped); memory crosses {}, occupancy crosses {}; wrote {}",
                history.len(),
                now.to_rfc3339(),
                start.elapsed().as_secs_f64(),
                m.skipped_records,
                m.memory_crosses.len(),
                m.occupancy_crosses.len(),
                a.out.display()
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
