//! The `gantry` binary. It stays thin: parse flags and config, build the parts from the
//! library crates, run. Every role of gantry is a subcommand of this one binary.

mod auth;
mod batch;
mod bench;
mod bench_floor;
mod bench_fuzz;
mod bench_queue;
mod bench_run;
mod bench_scheduler;
mod bench_web;
mod builds;
mod invocation;
mod model;
mod queue;
mod run;
mod serve;
mod sizeclass;
mod worker;

/// mimalloc instead of glibc's malloc: the server allocates and frees many small,
/// short-lived values per request from many threads, where glibc's arenas spend their
/// time consolidating and unlinking free chunks (a quarter of the scheduler bench's
/// samples). Measured in `gantry bench scheduler` and `gantry bench exec`.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "gantry", version, about = "Remote cache and execution for Bazel and other REAPI clients")]
struct Cli {
    /// How log lines (on stderr) look: "text" (coloured only on a terminal) or "json"
    /// (one object per line, for log collectors).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "GANTRY_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the Remote Execution API (cache, execution with in-process workers) and /metrics.
    Serve(serve::ServeArgs),
    /// Run a worker process that takes actions from a `gantry serve` scheduler.
    Worker(worker::WorkerArgs),
    /// Show what one Bazel invocation cost on gantry's executors.
    Invocation(invocation::InvocationArgs),
    /// Inspect what the scheduler learned about worker size classes.
    #[command(subcommand)]
    Sizeclass(sizeclass::SizeclassCommand),
    /// Cut a stream of targets into builds (`gantry batch plan` plans offline).
    Batch(batch::BatchArgs),
    /// The batching service's builds: list them, or follow one stream (`watch`).
    Builds(builds::BuildsArgs),
    /// The submit queue: submit a change, status, watch, cancel, history.
    #[command(subcommand)]
    Queue(queue::QueueCommand),
    /// Train and evaluate the batching service's models.
    #[command(subcommand)]
    Model(model::ModelCommand),
    /// Run one command (a compiler, a test) with remote caching, racing local and
    /// remote execution.
    Run(run::RunArgs),
    /// Credentials for `[auth]`: `gantry auth token` mints one.
    #[command(subcommand)]
    Auth(auth::AuthCommand),
    /// Measure gantry: CAS throughput, batch planning speed and quality.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> anyhow::Result<()> {
    // The action spawner must stay small (its memory is every action's starting
    // point): dispatch it before any runtime starts.
    if std::env::args_os().nth(1).is_some_and(|a| a == gantry_worker::spawner::SUBCOMMAND) {
        gantry_worker::spawner::spawner_main();
    }
    let cli = Cli::parse();
    // A bench's output is its report: the servers and workers it starts in process
    // would bury it under their INFO lines (one per simulated worker), so benches
    // log warnings only unless RUST_LOG asks for more.
    let default_filter = match cli.command {
        Command::Bench(_) => "warn",
        _ => "info,sqlx=warn,h2=warn",
    };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr);
    match cli.log_format {
        // Escape codes only where a terminal renders them, not in `gantry serve 2> log`.
        LogFormat::Text => logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init(),
        LogFormat::Json => logs.json().init(),
    }
    // Servers and workers hold a socket per connection and files per reusable cgroup;
    // their actions get the original limit back (gantry_worker::open_files).
    if matches!(cli.command, Command::Serve(_) | Command::Worker(_) | Command::Bench(_)) {
        match gantry_worker::open_files::raise() {
            Ok((before, after)) if after > before => tracing::debug!(before, after, "raised the open-file limit"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not raise the open-file limit"),
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("gantry").build()?;
    let result = rt.block_on(async {
        match cli.command {
            Command::Serve(args) => serve::run(args).await,
            Command::Worker(args) => worker::run(args).await,
            Command::Invocation(args) => invocation::run(args).await,
            Command::Sizeclass(cmd) => sizeclass::run(cmd).await,
            Command::Batch(args) => batch::run(args).await,
            Command::Builds(args) => builds::run(args).await,
            Command::Model(cmd) => model::run(cmd).await,
            Command::Queue(cmd) => queue::run(cmd).await,
            Command::Bench(cmd) => bench::run(cmd).await,
            Command::Run(args) => run::run(args).await,
            Command::Auth(cmd) => auth::run(cmd),
        }
    });
    // Blocking tasks (an action's wait) must not hold the process up after shutdown:
    // their process groups are killed by their guards when the tasks are dropped.
    rt.shutdown_timeout(std::time::Duration::from_secs(5));
    result
}
