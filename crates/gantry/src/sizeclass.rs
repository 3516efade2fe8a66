//! `gantry sizeclass stats [--key KEY]`: what the size-class learner knows, from the
//! metadata database: the most recently updated action shapes, or one shape's history
//! per class with its acceptable times and success estimates.

use anyhow::Context;
use gantry_sizeclass::{ActionStats, KeyStatsView, SizeClasses};

#[derive(clap::Subcommand)]
pub enum SizeclassCommand {
    /// Learned statistics: recent action shapes, or one with --key.
    Stats(StatsArgs),
}

#[derive(clap::Args)]
pub struct StatsArgs {
    /// An action shape key (as listed without --key).
    #[arg(long)]
    key: Option<String>,
    /// How many shapes to list.
    #[arg(long, default_value_t = 20)]
    limit: usize,
    #[command(flatten)]
    serve: crate::serve::ServeArgs,
}

pub async fn run(cmd: SizeclassCommand) -> anyhow::Result<()> {
    let SizeclassCommand::Stats(args) = cmd;
    let config = crate::serve::load_config(&args.serve)?;
    let db = gantry_store::open_metadata(&config).await.context("opening the size class store")?;
    let store = gantry_store::SqlSizeClassStore::new(db);
    use gantry_core::SizeClassStore as _;
    let selection = gantry_sizeclass::SelectionConfig::from_config(&config.execution.size_classes);
    let keys = match &args.key {
        Some(k) => vec![k.clone()],
        // Group priors share the store; only shapes are listed.
        None => store
            .keys(args.limit)
            .await?
            .into_iter()
            .filter(|k| !k.starts_with(gantry_sizeclass::GROUP_KEY_PREFIX))
            .collect(),
    };
    if keys.is_empty() {
        println!("no size class statistics yet");
        return Ok(());
    }
    for key in keys {
        let json = store.get(&key).await?.with_context(|| format!("no statistics for key {key}"))?;
        let stats = ActionStats::from_json(&json).with_context(|| format!("statistics of {key}"))?;
        let classes: Vec<u32> = stats.classes().collect();
        if classes.is_empty() {
            continue;
        }
        let set = SizeClasses::new(classes)?;
        if args.key.is_some() {
            print!("{}", KeyStatsView::new(key.clone(), &stats, &set, &selection, gantry_execution::sizing::now()));
        } else {
            let samples: Vec<String> = set.iter().map(|c| format!("{c}:{}", stats.sample_count(c))).collect();
            println!("{key}  samples per class {}", samples.join(" "));
        }
    }
    Ok(())
}
