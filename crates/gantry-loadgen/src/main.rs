//! `reapi-load`: the command line of [`gantry_loadgen`].

use anyhow::{ensure, Context, Result};
use clap::{Parser, Subcommand};
use gantry_loadgen::Meter;

#[derive(Parser)]
#[command(name = "reapi-load", about = "REAPI load generator: ByteStream reads and no-op Execute, against any server")]
struct Cli {
    /// Server address: http://HOST:PORT, or https://HOST:PORT for TLS.
    #[arg(long, global = true, default_value = "http://127.0.0.1:8980")]
    target: String,
    /// PEM file of the CA that signed the server's certificate (https:// only; default:
    /// the system's roots).
    #[arg(long, global = true)]
    tls_ca: Option<std::path::PathBuf>,
    /// Bearer token for a server with [auth], read from this environment variable so
    /// that it appears in no process list.
    #[arg(long, global = true, default_value = "GANTRY_TOKEN")]
    token_env: String,
    /// Instance name.
    #[arg(long, global = true, default_value = "")]
    instance: String,
    /// Also report this process's CPU (the server's) per unit of work.
    #[arg(long, global = true)]
    server_pid: Option<u32>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Upload COUNT random blobs of SIZE bytes, wait for the machine to go idle, then read
    /// them all back ROUNDS times.
    Read {
        #[arg(long, default_value_t = 16)]
        count: usize,
        /// Blob size in bytes, or with a KiB/MiB/GiB suffix.
        #[arg(long, default_value = "64MiB", value_parser = parse_size)]
        size: usize,
        #[arg(long, default_value_t = 4)]
        concurrency: usize,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// Run ACTIONS no-op actions, CONCURRENCY at a time.
    Exec {
        #[arg(long, default_value_t = 2000)]
        actions: usize,
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// The command each action runs.
        #[arg(long, default_value = "/bin/true", num_args = 1.., allow_hyphen_values = true)]
        command: Vec<String>,
    },
}

fn parse_size(s: &str) -> Result<usize, String> {
    let (num, mult) = [("GiB", 1usize << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]
        .iter()
        .find_map(|(u, m)| s.strip_suffix(u).map(|n| (n, *m)))
        .unwrap_or((s, 1));
    num.trim().parse::<usize>().map(|n| n * mult).map_err(|e| format!("size {s:?}: {e}"))
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let ca_pem = match &cli.tls_ca {
        Some(p) => Some(std::fs::read_to_string(p).with_context(|| format!("reading --tls-ca {}", p.display()))?),
        None => None,
    };
    let options = gantry_loadgen::ConnectOptions { ca_pem, token: std::env::var(&cli.token_env).ok() };
    let conn = gantry_loadgen::connect(&cli.target, &options).await?;
    let meter = Meter { server_pid: cli.server_pid };
    match cli.cmd {
        Cmd::Read { count, size, concurrency, rounds } => {
            let names = gantry_loadgen::upload_blobs(&conn, &cli.instance, count, size).await?;
            if !gantry_loadgen::settle().await {
                eprintln!("the machine did not go idle within 60 s; measuring anyway");
            }
            for round in 0..rounds {
                let r = gantry_loadgen::read_round(&conn, &names, size, concurrency, meter).await?;
                println!(
                    "round {round}: {:.0} MiB/s, {} ({count} x {} MiB, concurrency {concurrency})",
                    r.mib_per_second(),
                    r.usage.describe("s/GiB"),
                    size >> 20
                );
            }
        }
        Cmd::Exec { actions, concurrency, command } => {
            let r = gantry_loadgen::exec(&conn, &cli.instance, actions, concurrency, &command, meter)
                .await
                .context("running actions")?;
            println!(
                "{} actions in {:.2} s: {:.0} actions/s, p50 {:.1} ms, p99 {:.1} ms, {} (concurrency {concurrency})",
                r.actions,
                r.seconds,
                r.per_second(),
                r.p50.as_secs_f64() * 1e3,
                r.p99.as_secs_f64() * 1e3,
                r.usage.describe("ms/action"),
            );
            ensure!(r.failed == 0, "{} of {} actions did not succeed with exit code 0", r.failed, r.actions);
        }
    }
    Ok(())
}
