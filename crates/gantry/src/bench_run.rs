//! `gantry bench run`: wall time of `gantry run` over a mixed workload, for four
//! configurations side by side against one real server on loopback.
//!
//! Remote speed is made to differ honestly per command: each command is a small
//! script that sleeps for a different time depending on where it runs (it knows it
//! runs locally when its working directory is inside the project, since the local
//! branch runs in a staged exec root there, and remotely otherwise), standing in for a
//! remote farm that is faster for some tools and slower for others. Three shapes:
//! - `hit-cc`: the same command every round, so after the warm-up it is a cache hit;
//! - `slow-remote-cc`: unique each run (never cached), slower remotely;
//! - `fast-remote-cc`: unique each run, faster remotely.
//!
//! Every configuration gets its own history database; the unique commands carry the
//! configuration's name so one configuration never hits another's results.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use gantry_client::{CommandLine, DelayChoice, RemoteTarget, RunSpec};
use gantry_dynamic::coordinator::{RunResult, Strategy};

#[derive(clap::Args)]
pub struct RunBenchArgs {
    /// Measured rounds; each runs every command shape once per configuration.
    #[arg(long, default_value_t = 6)]
    rounds: usize,
    /// Rounds run first and left out of the table (the learned delay learns here).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Server to use (grpc://host:port); default: one started in-process.
    #[arg(long)]
    pub target: Option<String>,
}

/// (name, local seconds, remote seconds, unique per run)
const SHAPES: [(&str, f64, f64, bool); 3] =
    [("hit-cc", 1.0, 1.0, false), ("slow-remote-cc", 0.6, 1.8, true), ("fast-remote-cc", 1.8, 0.5, true)];

const CONFIGS: [&str; 4] = ["local only", "remote only", "dynamic, fixed 1 s", "dynamic, learned"];

fn write_tools(project: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for (name, local, remote, _) in SHAPES {
        let p = project.join(name);
        std::fs::write(
            &p,
            format!(
                "#!/bin/sh\ncase \"$PWD\" in {}/*) sleep {local} ;; *) sleep {remote} ;; esac\necho \"$@\" > out.o\n",
                project.display()
            ),
        )?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))?;
    }
    std::fs::write(project.join("src.c"), "int main(void) { return 0; }\n")?;
    Ok(())
}

async fn one(
    project: &Path,
    history: &Path,
    target: &str,
    config: usize,
    shape: usize,
    nonce: &str,
) -> anyhow::Result<Duration> {
    let (name, _, _, unique) = SHAPES[shape];
    let mut argv = vec![format!("./{name}"), "-c".into(), "src.c".into(), "-o".into(), "out.o".into()];
    if unique {
        argv.push(format!("-DNONCE={nonce}"));
    }
    let (strategy, delay) = match config {
        0 => (Strategy::Local, DelayChoice::Learned),
        1 => (Strategy::Remote, DelayChoice::Learned),
        2 => (Strategy::Dynamic, DelayChoice::Fixed(Duration::from_secs(1))),
        _ => (Strategy::Dynamic, DelayChoice::Learned),
    };
    let spec = RunSpec {
        command: CommandLine {
            argv,
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
            root: project.to_owned(),
            cwd: project.to_owned(),
            inputs: vec![name.into(), "src.c".into()],
            outputs: vec!["out.o".into()],
        },
        strategy,
        remote: Some(RemoteTarget { url: target.to_string(), instance: "bench-run".into() }),
        delay,
        upload_local_results: true,
        history_dir: Some(history.to_owned()),
        timeout: Some(Duration::from_secs(60)),
    };
    let start = Instant::now();
    let report = gantry_client::run(spec, std::future::pending()).await?;
    let took = start.elapsed();
    if !matches!(report.outcome.result, RunResult::Completed { exit_code: 0, .. }) {
        bail!("{} ({}) ended with {:?}", name, CONFIGS[config], report.outcome.result);
    }
    Ok(took)
}

pub async fn run(args: RunBenchArgs, target: String) -> anyhow::Result<()> {
    let project = tempfile::tempdir().context("creating the project directory")?;
    let histories: Vec<tempfile::TempDir> =
        (0..CONFIGS.len()).map(|_| tempfile::tempdir()).collect::<Result<_, _>>()?;
    write_tools(project.path())?;
    // times[config][shape] over measured rounds; best[shape] = sum of per-run min(local, remote).
    let mut times = vec![vec![Duration::ZERO; SHAPES.len()]; CONFIGS.len()];
    let mut best = vec![Duration::ZERO; SHAPES.len()];
    for round in 0..args.warmup + args.rounds {
        let measured = round >= args.warmup;
        for shape in 0..SHAPES.len() {
            let mut t = [Duration::ZERO; CONFIGS.len()];
            for (config, slot) in t.iter_mut().enumerate() {
                *slot = one(
                    project.path(),
                    histories[config].path(),
                    &target,
                    config,
                    shape,
                    &format!("c{config}r{round}"),
                )
                .await?;
            }
            eprintln!(
                "round {round}{} {:<15} {}",
                if measured { "" } else { " (warm-up)" },
                SHAPES[shape].0,
                t.iter().map(|d| format!("{:>6.2}s", d.as_secs_f64())).collect::<Vec<_>>().join(" ")
            );
            if measured {
                for c in 0..CONFIGS.len() {
                    times[c][shape] += t[c];
                }
                best[shape] += t[0].min(t[1]);
            }
        }
    }
    let best_total: Duration = best.iter().sum();
    println!(
        "{} measured rounds after {} warm-up rounds; wall seconds per configuration (ratio to the per-command best of local and remote)",
        args.rounds, args.warmup
    );
    print!("{:<20}", "configuration");
    for (name, ..) in SHAPES {
        print!(" {name:>22}");
    }
    println!(" {:>22}", "total");
    let cell =
        |d: Duration, b: Duration| format!("{:>8.2} ({:>5.3}x)", d.as_secs_f64(), d.as_secs_f64() / b.as_secs_f64());
    for (c, name) in CONFIGS.iter().enumerate() {
        print!("{name:<20}");
        for s in 0..SHAPES.len() {
            print!(" {:>22}", cell(times[c][s], best[s]));
        }
        println!(" {:>22}", cell(times[c].iter().sum(), best_total));
    }
    print!("{:<20}", "per-command best");
    for b in &best {
        print!(" {:>22}", format!("{:>8.2}", b.as_secs_f64()));
    }
    println!(" {:>22}", format!("{:>8.2}", best_total.as_secs_f64()));
    Ok(())
}
