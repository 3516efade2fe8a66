//! `gantry bench scheduler`: the scheduler alone, in process, with simulated workers
//! (see gantry-execution's `bench` module for what is measured and how). Without
//! `--queued`/`--slots` it also prints how the cost grows with the backlog and the fleet.

use gantry_execution::bench::{self, BenchOptions, BenchReport};

#[derive(clap::Args)]
pub struct SchedulerBenchArgs {
    /// Worker slots in all [default: 5000; with --scaling, each of 500 and 5000].
    #[arg(long)]
    slots: Option<usize>,
    /// Actions queued while measuring [default: 200000; with --scaling, each of 10k, 50k and 200k].
    #[arg(long)]
    queued: Option<usize>,
    /// Slots per worker.
    #[arg(long, default_value_t = 1)]
    slots_per_worker: usize,
    /// Platforms; the last is the rare one.
    #[arg(long, default_value_t = 4)]
    platforms: usize,
    /// Size classes per platform.
    #[arg(long, default_value_t = 4)]
    classes: u32,
    /// Share of actions for the rare platform.
    #[arg(long, default_value_t = 0.1)]
    rare_fraction: f64,
    /// Slots of the rare platform.
    #[arg(long, default_value_t = 50)]
    rare_slots: usize,
    /// Assignments measured at the steady backlog.
    #[arg(long, default_value_t = 200_000)]
    steps: usize,
    /// Arrivals measured for latency with a free slot.
    #[arg(long, default_value_t = 20_000)]
    latency_samples: usize,
    /// Let the size-class learner choose each action's class (default: any class runs any
    /// action). The learner moves shapes between classes as it learns, so one class's
    /// backlog drains while another's grows, and fewer completions lead to an assignment.
    #[arg(long)]
    learning: bool,
    /// Run the scaling table: queued 10k/50k/200k × slots 500/5000, each in a fresh
    /// process so that its memory figure is its own.
    #[arg(long)]
    scaling: bool,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print one JSON object per run.
    #[arg(long)]
    json: bool,
}

fn row(r: &BenchReport) -> String {
    format!(
        "{:>8} {:>6} {:>8} {:>12.0} {:>9.2} {:>9.1} {:>9.1} {:>10} {:>9.1} {:>12.0} {:>9.0}",
        r.options.queued,
        r.options.slots,
        r.workers,
        r.assignments_per_second,
        r.us_per_event,
        r.latency_p50_us,
        r.latency_p99_us,
        r.bytes_per_queued.map_or("-".to_string(), |b| format!("{b:.0}")),
        r.fill_us_per_action,
        r.core_assignments_per_second,
        r.core_ns_per_event,
    )
}

fn json(r: &BenchReport) -> serde_json::Value {
    serde_json::json!({
        "queued": r.options.queued, "slots": r.options.slots, "workers": r.workers,
        "learning": r.options.learning, "assignments_per_second": r.assignments_per_second,
        "us_per_event": r.us_per_event, "latency_p50_us": r.latency_p50_us, "latency_p99_us": r.latency_p99_us,
        "bytes_per_queued": r.bytes_per_queued, "fill_us_per_action": r.fill_us_per_action, "rss_mib": r.rss_mib,
        "core_assignments_per_second": r.core_assignments_per_second, "core_ns_per_event": r.core_ns_per_event,
    })
}

pub async fn run(args: SchedulerBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!((0.0..=1.0).contains(&args.rare_fraction), "--rare-fraction must be in [0, 1]");
    let base = BenchOptions {
        slots_per_worker: args.slots_per_worker,
        platforms: args.platforms,
        classes: args.classes,
        rare_fraction: args.rare_fraction,
        rare_slots: args.rare_slots,
        steps: args.steps,
        latency_samples: args.latency_samples,
        learning: args.learning,
        seed: args.seed,
        ..BenchOptions::default()
    };
    let shapes: Vec<(usize, usize)> = if args.scaling {
        let slots = args.slots.map_or(vec![500, 5000], |s| vec![s]);
        let queued = args.queued.map_or(vec![10_000, 50_000, 200_000], |q| vec![q]);
        slots.iter().flat_map(|&s| queued.iter().map(move |&q| (s, q))).collect()
    } else {
        vec![(args.slots.unwrap_or(base.slots), args.queued.unwrap_or(base.queued))]
    };
    if !args.json {
        println!(
            "scheduler, in process: {} platforms × {} size classes, {:.0}% of actions for a platform with {} slots, \
             {} slot(s) per worker, learning {}",
            base.platforms,
            base.classes,
            base.rare_fraction * 100.0,
            base.rare_slots,
            base.slots_per_worker,
            if base.learning { "on" } else { "off" }
        );
        println!(
            "{:>8} {:>6} {:>8} {:>12} {:>9} {:>9} {:>9} {:>10} {:>9} {:>12} {:>9}",
            "queued",
            "slots",
            "workers",
            "assign/s",
            "µs/event",
            "p50 µs",
            "p99 µs",
            "B/queued",
            "fill µs",
            "core asg/s",
            "core ns"
        );
    }
    if args.scaling {
        // Each configuration in a process of its own: memory freed by one run would be
        // reused by the next and hide its growth.
        let exe = std::env::current_exe()?;
        for (slots, queued) in shapes {
            let mut cmd = std::process::Command::new(&exe);
            cmd.args(["bench", "scheduler", "--json", "--seed", &args.seed.to_string()])
                .args(["--slots", &slots.to_string(), "--queued", &queued.to_string()])
                .args(["--slots-per-worker", &args.slots_per_worker.to_string()])
                .args(["--platforms", &args.platforms.to_string(), "--classes", &args.classes.to_string()])
                .args(["--rare-fraction", &args.rare_fraction.to_string()])
                .args(["--rare-slots", &args.rare_slots.to_string(), "--steps", &args.steps.to_string()])
                .args(["--latency-samples", &args.latency_samples.to_string()]);
            if args.learning {
                cmd.arg("--learning");
            }
            if !args.json {
                eprintln!("  {queued} queued on {slots} slots...");
            }
            let out = cmd.stderr(std::process::Stdio::inherit()).output()?;
            anyhow::ensure!(out.status.success(), "the run with {queued} queued on {slots} slots failed");
            let line = String::from_utf8(out.stdout)?;
            if args.json {
                print!("{line}");
            } else {
                let v: serde_json::Value = serde_json::from_str(line.trim())?;
                let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
                println!(
                    "{:>8} {:>6} {:>8} {:>12.0} {:>9.2} {:>9.1} {:>9.1} {:>10.0} {:>9.1} {:>12.0} {:>9.0}",
                    queued,
                    slots,
                    f("workers"),
                    f("assignments_per_second"),
                    f("us_per_event"),
                    f("latency_p50_us"),
                    f("latency_p99_us"),
                    f("bytes_per_queued"),
                    f("fill_us_per_action"),
                    f("core_assignments_per_second"),
                    f("core_ns_per_event"),
                );
            }
        }
        return Ok(());
    }
    for (slots, queued) in shapes {
        let opts = BenchOptions { slots, queued, ..base.clone() };
        let quiet = args.json;
        let r = bench::run(opts, &|msg| {
            if !quiet {
                eprintln!("  {msg}");
            }
        })
        .await?;
        if args.json {
            println!("{}", json(&r));
        } else {
            println!("{}", row(&r));
        }
    }
    Ok(())
}
