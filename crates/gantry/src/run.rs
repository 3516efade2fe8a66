//! `gantry run`: wrap one command (a compiler, a test) with remote caching and
//! execution. Flag parsing and output only; the race lives in `gantry-client`.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use gantry_client::{CommandLine, DelayChoice, RemoteTarget, RunSpec};
use gantry_dynamic::coordinator::{Branch, RunResult, Strategy};

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum StrategyArg {
    Local,
    Remote,
    Dynamic,
    CacheOnly,
}

#[derive(clap::Args)]
pub struct RunArgs {
    /// The gantry (or any REAPI) server, e.g. grpc://127.0.0.1:8980.
    #[arg(long, env = "GANTRY_REMOTE")]
    remote: Option<String>,
    /// REAPI instance name.
    #[arg(long, default_value = "", env = "GANTRY_INSTANCE")]
    instance: String,
    /// Files and directories the command reads (relative to the working directory).
    #[arg(long, num_args = 1..)]
    inputs: Vec<String>,
    /// Files and directories the command writes (relative to the working directory).
    #[arg(long, num_args = 1..)]
    outputs: Vec<String>,
    #[arg(long, value_enum, default_value = "dynamic")]
    strategy: StrategyArg,
    /// The input root: inputs must lie under it. Defaults to the working directory.
    #[arg(long)]
    root: Option<PathBuf>,
    /// Pass an environment variable to the command: NAME (its current value) or
    /// NAME=VALUE. PATH is always passed. The environment is part of the cache key.
    #[arg(long = "env", value_name = "NAME[=VALUE]")]
    env: Vec<String>,
    /// Start the local branch after this fixed delay (e.g. 1s, 250ms) instead of the
    /// delay learned for the command's shape.
    #[arg(long, value_parser = parse_duration)]
    local_delay: Option<Duration>,
    /// Do not upload a successful local result to the remote cache.
    #[arg(long)]
    no_upload_local_results: bool,
    /// Directory of the history database (digest cache, learned delays, statistics).
    /// Default: $XDG_CACHE_HOME/gantry or ~/.cache/gantry.
    #[arg(long, env = "GANTRY_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
    /// Give up (cleanly) after this long, e.g. 10m.
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// Write a JSON summary of the race (winner, operation, delay...) to this file.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Print local wins, remote wins, cache hits and time saved per command shape.
    #[arg(long)]
    stats: bool,
    /// The command and its arguments, after `--`.
    #[arg(last = true)]
    command: Vec<String>,
}

/// "250ms", "1s", "1.5s", "2m".
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s.trim().split_at(s.trim().find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.trim().len()));
    let v: f64 = num.parse().map_err(|_| format!("'{s}' is not a duration like 250ms, 1s or 2m"))?;
    let secs = match unit {
        "ms" => v / 1000.0,
        "s" => v,
        "m" => v * 60.0,
        "h" => v * 3600.0,
        _ => return Err(format!("'{s}': unit must be ms, s, m or h")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("'{s}': {e}"))
}

fn cache_dir(arg: &Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match arg {
        Some(d) => Ok(d.clone()),
        None => gantry_client::history::default_dir()
            .context("no --cache-dir, GANTRY_CACHE_DIR, XDG_CACHE_HOME or HOME to keep the history in"),
    }
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let dir = cache_dir(&args.cache_dir)?;
    if args.stats {
        if !args.command.is_empty() {
            bail!("--stats prints statistics; it does not take a command");
        }
        print!("{}", gantry_client::stats(&dir).await?);
        return Ok(());
    }
    if args.command.is_empty() {
        bail!("no command: give it after --, e.g. gantry run --outputs a.o -- cc -c a.c -o a.o");
    }
    let cwd = std::env::current_dir().context("reading the working directory")?;
    let root = match &args.root {
        Some(r) => std::path::absolute(r).context("resolving --root")?,
        None => cwd.clone(),
    };
    let mut env = vec![("PATH".to_string(), std::env::var("PATH").unwrap_or_default())];
    for e in &args.env {
        match e.split_once('=') {
            Some((k, v)) => env.push((k.to_string(), v.to_string())),
            None => env.push((e.clone(), std::env::var(e).with_context(|| format!("--env {e}: not set"))?)),
        }
    }
    // A later --env overrides PATH and earlier ones.
    env.reverse();
    let mut seen = std::collections::HashSet::new();
    env.retain(|(k, _)| seen.insert(k.clone()));
    let spec = RunSpec {
        command: CommandLine { argv: args.command, env, root, cwd, inputs: args.inputs, outputs: args.outputs },
        strategy: match args.strategy {
            StrategyArg::Local => Strategy::Local,
            StrategyArg::Remote => Strategy::Remote,
            StrategyArg::Dynamic => Strategy::Dynamic,
            StrategyArg::CacheOnly => Strategy::CacheOnly,
        },
        remote: args.remote.map(|url| RemoteTarget { url, instance: args.instance }),
        delay: args.local_delay.map_or(DelayChoice::Learned, DelayChoice::Fixed),
        upload_local_results: !args.no_upload_local_results,
        history_dir: Some(dir),
        timeout: args.timeout,
    };
    let report = gantry_client::run(spec, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    if let Some(path) = &args.report {
        let winner = report.outcome.winner.map(|w| match w {
            Branch::Local => "local",
            Branch::Remote => "remote",
        });
        let j = serde_json::json!({
            "winner": winner,
            "result": format!("{:?}", report.outcome.result),
            "from_cache": matches!(report.outcome.result, RunResult::Completed { from_cache: true, .. }),
            "operation": report.operation,
            "shape": report.shape,
            "delay_initial_ms": report.delay.initial.as_millis() as u64,
            "delay_after_miss_ms": report.delay.after_miss.as_millis() as u64,
            "hashed": report.hashed,
            "remembered": report.remembered,
            "uploaded": report.uploaded,
            "action_digest": report.action_digest.to_string(),
        });
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(&tmp, serde_json::to_vec_pretty(&j)?).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    }
    std::io::stdout().write_all(&report.stdout)?;
    std::io::stderr().write_all(&report.stderr)?;
    std::io::stdout().flush()?;
    match report.outcome.result {
        RunResult::Completed { exit_code: 0, .. } => Ok(()),
        RunResult::Completed { exit_code, .. } => std::process::exit(exit_code),
        RunResult::BranchFailed { reason } => bail!("the first branch to finish failed: {reason}"),
        RunResult::OutputsWriteFailed { reason } => bail!("could not move the outputs into place: {reason}"),
        RunResult::CacheMiss => bail!("cache-only: the action cache has no result for this command"),
        RunResult::Cancelled => bail!("cancelled"),
        RunResult::TimedOut => bail!("timed out"),
    }
}
