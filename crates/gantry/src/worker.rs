//! `gantry worker`: a worker in its own process, connected to a scheduler over gRPC.
//! It reconnects with backoff when the session breaks, and stops on SIGINT/SIGTERM.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytesize::ByteSize;
use gantry_proto::worker::v1 as wpb;
use gantry_store::GrpcStore;
use gantry_worker::Executor;

#[derive(clap::Args)]
pub struct WorkerArgs {
    /// Scheduler to connect to (a `gantry serve`), e.g. grpc://127.0.0.1:8980.
    #[arg(long, env = "GANTRY_SCHEDULER")]
    scheduler: String,
    /// Worker id [default: {hostname}-{pid}].
    #[arg(long)]
    id: Option<String>,
    /// Actions run at once.
    #[arg(long, default_value_t = 1)]
    slots: u32,
    /// Extra platform property NAME=VALUE (repeatable).
    #[arg(long = "property", value_parser = parse_property)]
    properties: Vec<(String, String)>,
    /// Where actions run and inputs are cached.
    #[arg(long, default_value = "./gantry-worker")]
    work_dir: PathBuf,
    /// Size of the local input cache, and half as much again for executable inputs.
    #[arg(long, default_value = "10GiB")]
    cache_size: ByteSize,
    /// Size class of this worker.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    size_class: u32,
    /// Memory per action, e.g. 4GiB, enforced as --limits says. Default: none (meter only).
    #[arg(long)]
    memory_limit: Option<ByteSize>,
    /// CPUs per action: pinned to that many, and with cgroups held to that much CPU time.
    /// Default: neither.
    #[arg(long)]
    cpus: Option<usize>,
    /// How limits are enforced: auto (a cgroup per action where the machine allows, else
    /// RLIMIT_AS with a warning), cgroup (cgroups or no start), or rlimit.
    #[arg(long, env = "GANTRY_LIMITS", default_value = "auto")]
    limits: gantry_config::LimitEnforcement,
}

fn parse_property(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| format!("'{s}' is not NAME=VALUE"))?;
    if k.is_empty() {
        return Err(format!("'{s}' has an empty name"));
    }
    Ok((k.to_string(), v.to_string()))
}

pub async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    let channel = gantry_core::client::connect_lazy(&args.scheduler).context("--scheduler")?;
    let id = args.id.clone().unwrap_or_else(|| format!("{}-{}", crate::serve::hostname(), std::process::id()));
    std::fs::create_dir_all(&args.work_dir).with_context(|| format!("creating {}", args.work_dir.display()))?;
    // Absolute, because actions are started by the spawner, another process.
    let work_dir =
        std::fs::canonicalize(&args.work_dir).with_context(|| format!("resolving {}", args.work_dir.display()))?;
    let cache = Arc::new(gantry_worker::materialize::InputCache::open(&work_dir, args.cache_size.as_u64()).await?);
    let work_root = work_dir.join("actions");
    gantry_worker::executor::remove_tree(&work_root);
    std::fs::create_dir_all(&work_root).with_context(|| format!("creating {}", work_root.display()))?;
    let cgroups = gantry_worker::cgroup::setup(args.limits, args.memory_limit.is_some() || args.cpus.is_some())
        .context("--limits")?;
    let metering = gantry_worker::cgroup::metering(cgroups.as_deref());
    let executor = Arc::new(Executor {
        worker_id: id.clone(),
        cas: Arc::new(GrpcStore::new(channel.clone(), "")),
        cache,
        work_root,
        dirs: Default::default(),
        spawner: std::env::current_exe().ok().map(|p| Arc::new(gantry_worker::spawner::Spawner::new(p))),
        limits: gantry_worker::process::Limits { memory_bytes: args.memory_limit.map(|m| m.as_u64()), cpus: args.cpus },
        cgroups,
    });
    let properties: Vec<wpb::Property> = gantry_worker::base_properties()
        .into_iter()
        .chain(args.properties.clone())
        .map(|(name, value)| wpb::Property { name, value })
        .collect();
    tracing::info!(worker = %id, scheduler = %args.scheduler, metering, "worker starting");
    let mut backoff = Duration::from_millis(200);
    let work = async {
        loop {
            let reg = wpb::Register {
                worker_id: id.clone(),
                properties: properties.clone(),
                slots: args.slots,
                size_class: args.size_class,
                metering: metering.into(),
            };
            let started = std::time::Instant::now();
            match gantry_worker::remote::session(channel.clone(), reg, executor.clone()).await {
                Ok(()) => return,
                Err(e) => tracing::warn!(error = %e, "worker session ended; reconnecting"),
            }
            if started.elapsed() > Duration::from_secs(30) {
                backoff = Duration::from_millis(200);
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(10));
        }
    };
    tokio::select! {
        _ = work => {}
        _ = crate::serve::shutdown_signal() => tracing::info!("worker stopping"),
    }
    gantry_worker::cgroup::release_idle();
    Ok(())
}
