//! The `gantry` binary. It stays thin: parse flags and config, build the parts from the
//! library crates, run. Every role of gantry is a subcommand of this one binary.

mod bench;
mod serve;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "gantry", version, about = "Remote cache and execution for Bazel and other REAPI clients")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the Remote Execution API (cache services) and /metrics.
    Serve(serve::ServeArgs),
    /// Measure gantry against a running server or one started in-process.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,sqlx=warn,h2=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("gantry").build()?;
    rt.block_on(async {
        match cli.command {
            Command::Serve(args) => serve::run(args).await,
            Command::Bench(cmd) => bench::run(cmd).await,
        }
    })
}
