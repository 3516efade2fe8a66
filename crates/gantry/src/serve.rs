//! `gantry serve`: load the config, let flags and environment override it, build the
//! stores (checking each backend), and serve until SIGINT or SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use gantry_config::Config;
use std::sync::Arc;

use gantry_batch::Models;
use gantry_core::task::TaskGuard;
use gantry_execution::sizing::Sizing;
use gantry_execution::{Scheduler, SchedulerConfig};
use gantry_proto::worker::v1 as wpb;
use gantry_services::batcher::BatcherService;
use gantry_services::{Limits, RunningServer, Services};
use gantry_store::{MetadataDb, RoleLease, SqlBuildStore, SqlExecutionLog, SqlQueueStore, SqlSizeClassStore};
use gantry_worker::Executor;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Config file. Without it, ./gantry.toml is read if present, else embedded defaults.
    #[arg(long, env = "GANTRY_CONFIG")]
    config: Option<PathBuf>,
    /// gRPC listen address [default: 127.0.0.1:8980]
    #[arg(long, env = "GANTRY_LISTEN")]
    listen: Option<SocketAddr>,
    /// HTTP listen address for /metrics [default: 127.0.0.1:9090]
    #[arg(long, env = "GANTRY_HTTP_LISTEN")]
    http_listen: Option<SocketAddr>,
    /// Data directory for the embedded stores [default: ./gantry-data]
    #[arg(long, env = "GANTRY_DATA_DIR")]
    data_dir: Option<PathBuf>,
}

pub fn load_config(args: &ServeArgs) -> anyhow::Result<Config> {
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None if std::path::Path::new("gantry.toml").exists() => Config::load("gantry.toml".as_ref())?,
        None => Config::default(),
    };
    if let Some(l) = args.listen {
        config.server.listen = l;
    }
    if let Some(l) = args.http_listen {
        config.server.http_listen = l;
    }
    if let Some(d) = &args.data_dir {
        config.server.data_dir = d.clone();
    }
    config.validate()?;
    Ok(config)
}

pub fn limits(config: &Config) -> Limits {
    Limits::from(&config.server)
}

pub async fn build_services(config: &Config, db: &MetadataDb) -> anyhow::Result<Services> {
    let cas = gantry_store::build_cas(config).await.context("setting up the CAS")?;
    let ac = gantry_store::build_action_cache(config, db, cas.clone()).await.context("setting up the action cache")?;
    let log = Arc::new(SqlExecutionLog::new(db.clone()));
    let mut batcher =
        BatcherService::new(gantry_batch::PlannerConfig::from_config(&config.batch), load_models(config)?)
            .context("[batch]")?;
    if runs_batch_builds(config) {
        batcher = batcher.expect_builds();
    }
    let invocations = Arc::new(gantry_store::SqlInvocationStore::new(db.clone()));
    let mut services = Services::with_batcher(cas, ac.clone(), limits(config), batcher)
        .with_build_events(invocations.clone())
        .with_web(gantry_services::WebStores {
            invocations,
            log: log.clone(),
            builds: Arc::new(gantry_store::SqlBuildStore::new(db.clone())),
            queue: Arc::new(gantry_store::SqlQueueStore::new(db.clone())),
            sizes: Arc::new(SqlSizeClassStore::new(db.clone())),
            selection: gantry_sizeclass::SelectionConfig::from_config(&config.execution.size_classes),
        });
    match &config.auth {
        Some(auth) => {
            tracing::info!(tokens = auth.tokens.len(), worker_tokens = auth.workers.tokens.len(), anonymous = ?auth.anonymous, "[auth]: every call needs credentials");
            services = services.with_auth(gantry_services::auth::Authenticator::load(auth).context("[auth]")?);
        }
        None if !config.server.listen.ip().is_loopback() => tracing::warn!(
            listen = %config.server.listen,
            "NO AUTHENTICATION on a non-loopback address: anyone who reaches this port can write the action cache, \
             run commands on the workers and register workers; configure [auth] (see README, Securing gantry)"
        ),
        None => {}
    }
    let e = &config.execution;
    if let Some(target) = &e.scheduler {
        // A frontend: the scheduler is another process, reached lazily so this server
        // starts (and serves the caches) even while the scheduler is down.
        let channel = gantry_core::client::connect_lazy(target).context("execution.scheduler")?;
        let max_msg = config.server.max_batch_size.as_u64() as usize + (1 << 20);
        tracing::info!(scheduler = %target, "frontend: Execute and Operations calls go to the scheduler");
        return Ok(services.with_forwarder(gantry_execution::forward::Forwarder::new(
            channel,
            target.clone(),
            max_msg,
        )));
    }
    let sc = &e.size_classes;
    let sizing = Sizing::new(
        gantry_sizeclass::SelectionConfig::from_config(sc),
        Arc::new(SqlSizeClassStore::new(db.clone())),
        sc.seed,
        sc.cached_shapes,
        services.metrics.registry(),
    )?;
    let scheduler = Scheduler::new(SchedulerConfig::from(e), ac, log, services.metrics.registry(), Some(sizing));
    Ok(services.with_scheduler(scheduler))
}

/// Starts the in-process workers; they run until the returned guards are dropped.
pub async fn start_local_workers(config: &Config, services: &Services) -> anyhow::Result<Vec<TaskGuard>> {
    let Some(scheduler) = services.scheduler.clone() else {
        // A frontend: workers connect to the scheduler, not here.
        return Ok(vec![]);
    };
    let classes = match &config.execution.workers {
        Some(w) => w.classes(),
        None => vec![(1, std::thread::available_parallelism().map_or(1, |n| n.get()))],
    };
    let n: usize = classes.iter().map(|(_, c)| c).sum();
    if n == 0 {
        return Ok(vec![]);
    }
    let dir = config.worker_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // Absolute, because actions are started by the spawner, another process.
    let dir = std::fs::canonicalize(&dir).with_context(|| format!("resolving {}", dir.display()))?;
    let cache = Arc::new(
        gantry_worker::materialize::InputCache::open(&dir, config.execution.cache_max_size.as_u64())
            .await
            .with_context(|| format!("opening the worker cache in {}", dir.display()))?,
    );
    let e = &config.execution;
    let cgroups =
        gantry_worker::cgroup::setup(e.limits, e.memory_per_size_class.is_some() || e.cpus_per_size_class.is_some())
            .context("[execution] limits")?;
    if e.memory_per_size_class.is_none() && e.cpus_per_size_class.is_none() {
        tracing::info!(
            "no memory_per_size_class or cpus_per_size_class set: size classes are metered only, not enforced"
        );
    }
    let metering = gantry_worker::cgroup::metering(cgroups.as_deref());
    let mut properties: Vec<wpb::Property> = gantry_worker::base_properties()
        .into_iter()
        .chain(config.execution.properties.clone())
        .map(|(name, value)| wpb::Property { name, value })
        .collect();
    properties.dedup();
    let host = hostname();
    let mut guards = Vec::new();
    let per_worker = classes.iter().flat_map(|&(class, count)| std::iter::repeat_n(class, count));
    for (i, class) in per_worker.enumerate() {
        let id = format!("{host}-local-{i}");
        let limits = gantry_worker::process::Limits {
            memory_bytes: config.execution.memory_per_size_class.map(|m| m.as_u64() * class as u64),
            cpus: config.execution.cpus_per_size_class.map(|c| c * class as usize),
        };
        let work_root = dir.join(format!("w{i}"));
        // Leftovers of a previous run (a crash mid-action) are removed before starting.
        gantry_worker::executor::remove_tree(&work_root);
        std::fs::create_dir_all(&work_root).with_context(|| format!("creating {}", work_root.display()))?;
        let executor = Arc::new(Executor {
            worker_id: id.clone(),
            cas: services.cas.clone(),
            cache: cache.clone(),
            work_root,
            dirs: Default::default(),
            spawner: std::env::current_exe().ok().map(|p| Arc::new(gantry_worker::spawner::Spawner::new(p))),
            limits,
            cgroups: cgroups.clone(),
        });
        let reg = wpb::Register {
            worker_id: id,
            properties: properties.clone(),
            slots: 1,
            size_class: class,
            metering: metering.into(),
        };
        let (messages, reports, bridge) = scheduler.attach_local(reg)?;
        guards.push(bridge);
        guards.push(gantry_core::task::spawn_named(
            "local-worker",
            gantry_worker::run_worker(messages, reports, executor),
        ));
    }
    tracing::info!(workers = n, classes = ?classes, "in-process workers started");
    Ok(guards)
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "gantry".into())
}

/// The batching models, if a model directory exists; a directory that exists but does
/// not load is an error at startup, not a silent fallback.
fn load_models(config: &Config) -> anyhow::Result<Models> {
    let dir = config.batch_model_dir();
    if !dir.join(gantry_batch::model::MANIFEST_FILE).exists() {
        tracing::info!(dir = %dir.display(), "no batching models yet; batches use the fallback size");
        return Ok(Models::default());
    }
    let models = Models::load(&dir).with_context(|| format!("loading batching models from {}", dir.display()))?;
    tracing::info!(dir = %dir.display(), "loaded batching models");
    Ok(models)
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = load_config(&args)?;
    let db = gantry_store::open_metadata(&config).await.context("setting up the metadata database")?;
    tracing::info!(database = %db.name(), schema_version = MetadataDb::latest_version(), "metadata database ready");
    let services = build_services(&config, &db).await?;
    let _workers = start_local_workers(&config, &services).await?;
    let tls = match &config.server.tls {
        Some(t) => Some(
            gantry_services::tls::Tls::load(gantry_services::tls::TlsFiles {
                cert: t.cert.clone(),
                key: t.key.clone(),
                client_ca: t.client_ca.clone(),
                client_certificates_optional: t.client_certificates == gantry_config::ClientCertificates::Optional,
            })
            .context("[server.tls]")?,
        ),
        None => None,
    };
    let server =
        RunningServer::start_tls(&services, config.server.listen, config.server.http_listen, tls.as_ref()).await?;
    let builds = start_build_runners(&config, &db, &services, server.grpc_addr).await?;
    let queue = start_queue(&config, &db, &services, server.grpc_addr).await?;
    // A role whose lease another process took over is stopped here at once.
    let _role_watch: Vec<TaskGuard> = [
        builds.as_ref().map(|(b, lease)| {
            let (b, lost) = (b.clone(), lease.lost());
            gantry_core::task::spawn_named("batch-lease-watch", async move {
                lost.await;
                b.shutdown().await;
            })
        }),
        queue.as_ref().map(|(q, lease)| {
            let (q, lost) = (q.clone(), lease.lost());
            gantry_core::task::spawn_named("queue-lease-watch", async move {
                lost.await;
                q.shutdown().await;
            })
        }),
    ]
    .into_iter()
    .flatten()
    .collect();
    // History bounds, applied by the scheduler (frontends share its database).
    let _retention =
        config.execution.scheduler.is_none().then(|| {
            gantry_store::Retention::new(db.clone(), config.retention.clone()).spawn(services.metrics.registry())
        });
    // Handlers first: a SIGTERM right after the line below must drain, not kill.
    let stop = shutdown_signal();
    // One machine-readable line on stdout, so scripts and tests using port 0 learn the ports.
    println!("gantry serving grpc={} http={}", server.grpc_addr, server.http_addr);
    server
        .run_until(async {
            stop.await;
            // Worker sessions and operation streams would hold the drain open: end them
            // with UNAVAILABLE so workers and Bazel reconnect (to this server restarted).
            if let Some(s) = &services.scheduler {
                s.shutdown();
            }
            if let Some(f) = &services.forwarder {
                f.shutdown();
            }
            // The queue and the batch runners run builds on this server's executor: stop
            // them before it stops accepting requests, or their last builds fail with
            // "connection refused" and are judged on it. Stopped builds are taken up again
            // at the next start.
            if let Some((q, _)) = &queue {
                q.shutdown().await;
            }
            if let Some((b, _)) = &builds {
                b.shutdown().await;
            }
        })
        .await?;
    for lease in queue.map(|(_, l)| l).into_iter().chain(builds.map(|(_, l)| l)) {
        if let Err(e) = lease.release().await {
            tracing::warn!(error = %e, "releasing a role's lease");
        }
    }
    gantry_worker::cgroup::release_idle();
    tracing::info!("stopped");
    Ok(())
}

/// The batching service's build runners (`[batch] runners`), pointed at this server.
async fn start_build_runners(
    config: &Config,
    db: &MetadataDb,
    services: &Services,
    grpc_addr: SocketAddr,
) -> anyhow::Result<Option<(Arc<gantry_builds::BuildService>, RoleLease)>> {
    let b = &config.batch;
    if !runs_batch_builds(config) {
        if b.runners > 0 {
            tracing::info!("frontend: the batch builds run on the scheduler's gantry serve, not here");
        }
        return Ok(None);
    }
    if which(&b.bazel).is_none() {
        // Not fatal: the cache and executor are still useful without Bazel here, but
        // every build will end INFRA_ERROR until it is installed.
        tracing::warn!(bazel = %b.bazel.display(), "batch.bazel not found: builds will fail with INFRA_ERROR (install Bazel, or set [batch] runners = 0)");
    }
    if config.auth.is_some() && b.remote_executor.is_none() && b.token_file.is_none() {
        tracing::warn!("[auth] is on and [batch] token_file is not set: the runners' Bazel reaches this server without a credential, which works only if [auth] anonymous may execute");
    }
    let settings = gantry_builds::ServiceSettings {
        runners: b.runners,
        runner_dir: std::path::absolute(config.batch_runner_dir()).context("batch.runner_dir")?,
        runner: runner_settings(config, b.deadline, grpc_addr),
        memory_label: b.memory_label,
        model_dir: config.batch_model_dir(),
        retrain_interval: b.retrain_interval,
        min_history_builds: b.min_history_builds,
        feedback: b.feedback,
        long_window: b.long_window,
        short_window: b.short_window,
        learner: b.learner,
    };
    // One process runs the batch builds of a database: each requeues the builds it finds
    // unfinished at startup, which would be the other's running ones.
    let holder = format!("{}:{}", hostname(), settings.runner_dir.display());
    let lease = RoleLease::take(db, "batch-runners", holder, ROLE_LEASE_TTL).await.context("[batch] runners")?;
    let store = Arc::new(SqlBuildStore::new(db.clone()));
    let log = Arc::new(SqlExecutionLog::new(db.clone()));
    let builds = gantry_builds::BuildService::start(
        settings,
        store,
        log,
        services.batcher.planner_config().clone(),
        services.batcher.models(),
    )
    .await
    .context("starting the build runners")?;
    services.batcher.attach_builds(builds.clone());
    tracing::info!(runners = b.runners, "batch build runners started");
    Ok(Some((builds, lease)))
}

/// How a runner invokes Bazel, from `[batch]`, with this server as the default executor.
fn runner_settings(
    config: &Config,
    deadline: std::time::Duration,
    grpc_addr: SocketAddr,
) -> gantry_builds::runner::RunnerSettings {
    let b = &config.batch;
    let remote_executor = b.remote_executor.clone().unwrap_or_else(|| {
        let ip = grpc_addr.ip();
        // With TLS the name must be one the certificate holds; "localhost" is the one a
        // server reached from its own host most often has.
        match (&config.server.tls, ip.is_unspecified() || ip.is_loopback()) {
            (Some(_), true) => format!("grpcs://localhost:{}", grpc_addr.port()),
            (Some(_), false) => format!("grpcs://{grpc_addr}"),
            (None, true) => format!("grpc://127.0.0.1:{}", grpc_addr.port()),
            (None, false) => format!("grpc://{grpc_addr}"),
        }
    });
    gantry_builds::runner::RunnerSettings {
        bazel: b.bazel.clone(),
        startup_flags: b.startup_flags.clone(),
        extra_flags: b.extra_flags.clone(),
        heap_bytes: b.bazel_memory.as_u64(),
        deadline,
        kill_grace: b.kill_grace,
        gc_spiral_window: b.gc_spiral_window,
        remote_executor,
        credentials: gantry_builds::runner::BazelCredentials {
            token_file: b.token_file.clone(),
            tls_certificate: b.tls_certificate.clone(),
            tls_client_certificate: b.tls_client_certificate.clone(),
            tls_client_key: b.tls_client_key.clone(),
        },
    }
}

/// The submit queue (`[queue]`, off unless `repository` is set), building on this server.
async fn start_queue(
    config: &Config,
    db: &MetadataDb,
    services: &Services,
    grpc_addr: SocketAddr,
) -> anyhow::Result<Option<(Arc<gantry_submit::QueueService>, RoleLease)>> {
    let q = &config.queue;
    let Some(repository) = &q.repository else { return Ok(None) };
    let settings = gantry_submit::QueueSettings {
        repository: std::path::absolute(repository).context("queue.repository")?,
        mainline: q.mainline.clone(),
        capacity: q.capacity,
        max_retries: q.max_retries,
        build_command: q.build_command.clone(),
        work_dir: std::path::absolute(config.queue_work_dir()).context("queue.work_dir")?,
        runner: runner_settings(config, q.deadline, grpc_addr),
        prior_success: q.prior_success,
        prior_conflict: q.prior_conflict,
        batching: q.batching,
        learn_alone: q.learn_alone,
        retention: gantry_submit::QueueRetention {
            interval: config.retention.interval,
            batch_size: config.retention.batch_size,
            max_age: config.retention.queue.max_age,
            max_rows: config.retention.queue.max_rows,
            journal: config.retention.queue_journal,
            graphs: config.retention.queue_graphs,
        },
    };
    // One queue per metadata database: two would both journal, build and land. The
    // holder names this host and repository, so the same server restarted after a crash
    // takes its role back at once instead of waiting for the lease to expire.
    let holder = format!("{}:{}", hostname(), settings.repository.display());
    let lease = RoleLease::take(db, "submit-queue", holder, ROLE_LEASE_TTL).await.context("[queue]")?;
    let store = Arc::new(SqlQueueStore::new(db.clone()));
    let queue = gantry_submit::QueueService::start(settings, store, services.metrics.registry())
        .await
        .context("starting the submit queue")?;
    services.queue.attach(queue.clone());
    tracing::info!(repository = %repository.display(), mainline = %q.mainline, capacity = q.capacity, "submit queue started");
    Ok(Some((queue, lease)))
}

/// Whether this server runs the batching service's builds: a scheduler with `[batch]
/// runners`. A frontend leaves them to the scheduler, the one process per metadata
/// database that may run them (a lease enforces it).
fn runs_batch_builds(config: &Config) -> bool {
    config.batch.runners > 0 && config.execution.scheduler.is_none()
}

/// How long a role's lease outlives a process that stopped renewing it.
const ROLE_LEASE_TTL: std::time::Duration = std::time::Duration::from_secs(30);

/// The path a program name resolves to on PATH (or itself, if it is a path).
fn which(program: &std::path::Path) -> Option<PathBuf> {
    if program.components().count() > 1 {
        return program.is_file().then(|| program.to_path_buf());
    }
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| std::path::Path::new(d).join(program)).find(|p| p.is_file())
}

/// Installs the SIGTERM and SIGINT handlers now, and resolves on the first signal. Now,
/// not when first polled: a signal that arrives between a caller's "serving" line and
/// its first await would otherwise meet the default handler, which kills the process
/// without draining (seen in CI under load).
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing SIGINT handler");
    async move {
        tokio::select! {
            _ = int.recv() => tracing::info!("SIGINT received"),
            _ = term.recv() => tracing::info!("SIGTERM received"),
        }
    }
}
