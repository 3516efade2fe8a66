//! `gantry bench web`: how fast the web pages answer over real HTTP from a real
//! `gantry serve` stack, with a large history in the metadata database (SQLite by
//! default, or `--metadata-url`): the invocation list's first and a later page over
//! 100,000 invocations whose newest ones ran hundreds of remote actions each, one such
//! invocation's page (its timeline and actions), one invocation of 100,000 actions that
//! finished in the last hour (its first and last table page, its timeline, its critical
//! path), the size-class page counting those runs, and the live workers page.

use std::time::{Duration, Instant};

use anyhow::Context;

#[derive(clap::Args)]
pub struct WebBenchArgs {
    /// Invocations stored.
    #[arg(long, default_value_t = 100_000)]
    invocations: usize,
    /// Remote actions of each of the newest `--busy` invocations.
    #[arg(long, default_value_t = 200)]
    actions: usize,
    /// How many of the newest invocations ran `--actions` actions (a full first page).
    #[arg(long, default_value_t = 50)]
    busy: usize,
    /// Remote actions of one more invocation, all finished within the last hour.
    #[arg(long, default_value_t = 100_000)]
    huge: usize,
    /// Requests timed per page.
    #[arg(long, default_value_t = 50)]
    requests: usize,
    /// A PostgreSQL metadata database instead of SQLite in a temporary directory.
    #[arg(long)]
    metadata_url: Option<String>,
}

const T0: i64 = 1_700_000_000_000;

/// One GET over a fresh connection, as a browser's first request: the status line and
/// the body's length.
async fn get(addr: &str, path: &str) -> anyhow::Result<(String, usize)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await?;
    let text = String::from_utf8_lossy(&out);
    let status = text.lines().next().unwrap_or_default().to_string();
    Ok((status, out.len()))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

pub async fn run(args: WebBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.requests > 0, "--requests must be at least 1");
    anyhow::ensure!(args.busy <= args.invocations, "--busy must not exceed --invocations");
    let dir = tempfile::tempdir().context("creating a temporary data dir")?;
    let mut config = gantry_config::Config::default();
    config.server.data_dir = dir.path().to_owned();
    config.execution.workers = Some(gantry_config::Workers::Count(2));
    config.metadata.url = args.metadata_url.clone();
    let db = gantry_store::open_metadata(&config).await?;
    let services = crate::serve::build_services(&config, &db).await?;
    let _workers = crate::serve::start_local_workers(&config, &services).await?;
    let server =
        gantry_services::RunningServer::start(&services, "127.0.0.1:0".parse()?, "127.0.0.1:0".parse()?).await?;
    let addr = server.http_addr.to_string();

    let started = Instant::now();
    let mut tx = db.writer().begin().await?;
    for i in 0..args.invocations as i64 {
        sqlx::query(
            "INSERT INTO invocations (invocation_id, build_id, owner, command, started_unix_ms, finished_unix_ms,
                exit_code, exit_name, target_count, failed_targets, patterns, document, user_name, instance_name)
             VALUES ($1, 'b', 'ci', 'build', $2, $3, 0, 'SUCCESS', 120, 0, '[\"//...\"]',
                '{\"v\":1,\"options\":[],\"metadata\":{},\"targets\":[],\"tests\":[]}', 'ci', '')",
        )
        .bind(format!("inv-{i}"))
        .bind(T0 + i * 1000)
        .bind(T0 + i * 1000 + 900)
        .execute(&mut *tx)
        .await?;
    }
    let newest = args.invocations as i64 - 1;
    for i in newest + 1 - args.busy as i64..=newest {
        for a in 0..args.actions as i64 {
            sqlx::query(
                "INSERT INTO action_executions (operation, instance_name, action_digest, tool_invocation_id,
                    action_mnemonic, target_id, worker, size_class, exit_code, status_code, peak_memory_bytes,
                    user_cpu_seconds, system_cpu_seconds, wall_seconds, queued_seconds, metering,
                    completed_unix_ms, shape_key)
                 VALUES ($1, '', $2, $3, 'CppCompile', $4, $5, $6, 0, 0, $7, 0.5, 0.1, 0.8, 0.05, 'cgroup-v2', $8, '')",
            )
            .bind(format!("op-{i}-{a}"))
            .bind(format!("{:064x}/{}", i * 10_000 + a, 140 + a))
            .bind(format!("inv-{i}"))
            .bind(format!("//pkg{}:lib{a}", a % 17))
            .bind(format!("worker-{}", a % 8))
            .bind(1 + a % 4)
            .bind((64 + a) << 20)
            .bind(T0 + i * 1000 + a * 3)
            .execute(&mut *tx)
            .await?;
        }
    }
    // The huge invocation: 32 workers' runs over the last hour, heavy-tailed run times,
    // and every 50th action waiting on the one before (a chain for the critical path).
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis() as i64;
    let start = now - 3_600_000;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for a in 0..args.huge as i64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let wall = 0.05 + 20.0 * ((x >> 11) as f64 / (1u64 << 53) as f64).powi(6);
        let completed = start + a * 3_600_000 / args.huge.max(1) as i64;
        sqlx::query(
            "INSERT INTO action_executions (operation, instance_name, action_digest, tool_invocation_id,
                action_mnemonic, target_id, worker, size_class, exit_code, status_code, peak_memory_bytes,
                user_cpu_seconds, system_cpu_seconds, wall_seconds, queued_seconds, metering,
                completed_unix_ms, shape_key)
             VALUES ($1, '', $2, 'inv-huge', 'CppCompile', $3, $4, $5, 0, 0, $6, $7, 0.1, $8, $9, 'cgroup-v2', $10, '')",
        )
        .bind(format!("op-huge-{a}"))
        .bind(format!("{:064x}/{}", 1u64 << 40 | a as u64, 140 + a))
        .bind(format!("//pkg{}:lib{a}", a % 97))
        .bind(format!("worker-{}", a % 32))
        .bind(1 + a % 4)
        .bind((64 + a % 1000) << 20)
        .bind(wall * 0.8)
        .bind(wall)
        .bind(if a % 50 == 0 { 0.01 } else { 0.5 })
        .bind(completed)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    // What autovacuum (PostgreSQL) would soon do after such a load: without statistics the
    // planner takes a 100,000-action invocation for a few hundred rows.
    sqlx::query("ANALYZE").execute(db.writer()).await?;
    eprintln!(
        "stored {} invocations, {} with {} actions each, and one with {}, in {:.1}s",
        args.invocations,
        args.busy,
        args.actions,
        args.huge,
        started.elapsed().as_secs_f64()
    );

    let backend = if args.metadata_url.is_some() { "postgres" } else { "sqlite" };
    let second_page = T0 + (newest - 500) * 1000;
    let pages = [
        ("invocation list, first page", "/invocations".to_string()),
        ("invocation list, 10th page", format!("/invocations?before={second_page}")),
        ("one invocation", format!("/invocations/inv-{newest}")),
        ("huge invocation, first page", "/invocations/inv-huge".to_string()),
        // 100 actions a table page.
        ("huge invocation, last page", format!("/invocations/inv-huge?page={}", args.huge.saturating_sub(1) / 100)),
        ("workers (live)", "/workers".to_string()),
        ("size classes (24 h of runs)", "/sizeclasses".to_string()),
    ];
    println!("web pages over HTTP ({backend}, {} invocations, {} requests each):", args.invocations, args.requests);
    println!("{:<30} {:>9} {:>9} {:>9} {:>10}", "page", "p50 ms", "p95 ms", "max ms", "bytes");
    for (name, path) in pages {
        let (status, _) = get(&addr, &path).await?; // warm the pool and the caches
        anyhow::ensure!(status.contains(" 200 "), "{path}: {status}");
        let mut times = Vec::with_capacity(args.requests);
        let mut bytes = 0;
        for _ in 0..args.requests {
            let t = Instant::now();
            let (status, n) = get(&addr, &path).await?;
            times.push(t.elapsed());
            anyhow::ensure!(status.contains(" 200 "), "{path}: {status}");
            bytes = n;
        }
        times.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!(
            "{name:<30} {:>9.1} {:>9.1} {:>9.1} {bytes:>10}",
            ms(percentile(&times, 0.5)),
            ms(percentile(&times, 0.95)),
            ms(*times.last().expect("at least one request"))
        );
    }
    println!("goal: under 200 ms for a page over 100,000 invocations or actions");
    drop(server);
    Ok(())
}
