//! `gantry bench ...`: throughput measurements against a gantry server over loopback.
//! With `--target` it measures a running server; without, it starts one in-process on a
//! temporary data directory with the same store stack `gantry serve` builds.

use std::time::Instant;

use anyhow::{bail, Context};
use bytesize::ByteSize;
use futures::{StreamExt, TryStreamExt};
use gantry_core::client::GrpcChannel as Channel;
use gantry_core::google::bytestream::byte_stream_client::ByteStreamClient;
use gantry_core::google::bytestream::{ReadRequest, WriteRequest};
use gantry_core::reapi::content_addressable_storage_client::ContentAddressableStorageClient;
use gantry_core::reapi::{self, batch_update_blobs_request};
use gantry_core::{Digest, DigestFunction};
use serde::Serialize;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// CAS throughput: ByteStream write/read, BatchUpdateBlobs, FindMissingBlobs, and the
    /// single-core SHA-256 ceiling.
    Cas(CasArgs),
    /// Batch planning: speed on millions of synthetic targets with trained models, or
    /// with --simulate, plan quality (OOM, DE, density) against a hidden ground truth.
    Batch(BatchBenchArgs),
    /// Remote execution: no-op action throughput and Execute latency on cache hits.
    Exec(ExecBenchArgs),
    /// Action cache: UpdateActionResult and GetActionResult calls per second over gRPC,
    /// on the embedded SQLite and on each --metadata-url.
    Ac(AcBenchArgs),
    /// What security costs: cache-hit GetActionResult and FindMissingBlobs calls per
    /// second, plaintext without [auth] against TLS with a bearer token, side by side,
    /// and the same calls on a bare tonic server (plaintext and TLS): the stack's floor.
    Auth(AuthBenchArgs),
    /// Worker size classes: replay a trace through learned selection and two baselines.
    Sizeclass(SizeclassBenchArgs),
    /// Bazel on a generated genrule workspace: local, remote execution, and cached.
    Bazel(BazelBenchArgs),
    /// `gantry run` on a mixed workload: local only, remote only, dynamic with a fixed
    /// 1 s delay, and dynamic with the learned delay.
    Run(crate::bench_run::RunBenchArgs),
    /// Submit queue: simulate every policy (sq, sq-batch, single, optimistic,
    /// speculate-all, oracle, oracle-retry, oracle-batch, oracle-batch-retry, batch-only) on a trace or on generated streams, normalised to the oracle.
    Queue(crate::bench_queue::QueueBenchArgs),
    /// The scheduler alone, in process with simulated workers: assignments per second at
    /// a steady backlog, arrival-to-assignment latency with a free slot, and memory.
    Scheduler(crate::bench_scheduler::SchedulerBenchArgs),
    /// The web pages over HTTP from a real server with 100,000 invocations stored: p50,
    /// p95 and max per page.
    Web(crate::bench_web::WebBenchArgs),
    /// Malformed requests against a server started in process: random and mutated
    /// messages, and broken gRPC framing, to every method; fails on any panic, hang or
    /// server-fault code.
    Fuzz(crate::bench_fuzz::FuzzBenchArgs),
    /// `bench auth`'s floor: a bare tonic server answering its calls (started by it).
    #[command(hide = true)]
    AuthFloorServer(crate::bench_floor::FloorServerArgs),
}

#[derive(clap::Args)]
pub struct ExecBenchArgs {
    /// Server to measure. Default: start one in-process with `--workers` local workers.
    #[arg(long)]
    target: Option<String>,
    /// In-process workers when no --target is given [default: cores].
    #[arg(long)]
    workers: Option<usize>,
    /// Distinct no-op actions to execute.
    #[arg(long, default_value_t = 2000)]
    actions: usize,
    /// Execute calls in flight.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Sequential Execute calls answered from the action cache.
    #[arg(long, default_value_t = 2000)]
    cache_hits: usize,
    /// Also run the in-process server on this metadata database (repeatable), beside the
    /// embedded SQLite default, and report each against SQLite.
    #[arg(long = "metadata-url", conflicts_with = "target")]
    metadata_urls: Vec<String>,
}

#[derive(clap::Args)]
pub struct AuthBenchArgs {
    /// Server certificate (PEM) for the TLS configuration; its names must include localhost.
    #[arg(long)]
    tls_cert: std::path::PathBuf,
    /// Its private key (PEM).
    #[arg(long)]
    tls_key: std::path::PathBuf,
    /// The CA that signed it (PEM), for the client.
    #[arg(long)]
    tls_ca: std::path::PathBuf,
    /// Clients calling at once, each on its own connection.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Calls per client per round.
    #[arg(long, default_value_t = 2000)]
    calls: usize,
    /// Rounds; the configurations alternate and each reports its median round.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// CPUs the servers run on, e.g. "1" or "2,3" (all three servers share them). With
    /// --client-cpus, keeps the load generator off the server's cores, as a client on
    /// another machine would be. Default: any CPU.
    #[arg(long, value_delimiter = ',')]
    server_cpus: Vec<usize>,
    /// CPUs the clients (this process) run on, e.g. "0". Default: any CPU.
    #[arg(long, value_delimiter = ',')]
    client_cpus: Vec<usize>,
}

#[derive(clap::Args)]
pub struct AcBenchArgs {
    /// Metadata databases to measure (repeatable), each beside the embedded SQLite
    /// default, e.g. postgres://gantry@127.0.0.1:5432/bench. The tables are written to.
    #[arg(long = "metadata-url")]
    metadata_urls: Vec<String>,
    /// Clients calling at once, each on its own connection.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// UpdateActionResult calls, then as many GetActionResult calls, per client.
    #[arg(long, default_value_t = 500)]
    calls: usize,
}

#[derive(clap::Args)]
pub struct SizeclassBenchArgs {
    /// Trace of actions, one JSON object per line (see README). Default: a synthetic
    /// trace of 100,000 actions from build-like families of shapes.
    #[arg(long, conflicts_with_all = ["seeds", "workload"])]
    trace: Option<std::path::PathBuf>,
    /// Fleet as class:count pairs (repeatable). Default: 1:48,2:24,4:16,8:64, and with
    /// --seeds also 1:8,2:16,4:16,8:8,16:16.
    #[arg(long)]
    fleet: Vec<String>,
    /// Seed of the synthetic trace and of the selection draws.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Run the goals suite over these seeds ("1-5" or "1,3,7"): every workload x fleet x
    /// seed, then the goals table.
    #[arg(long)]
    seeds: Option<String>,
    /// Synthetic workload (repeatable): default, shifted (test-heavy, more new shapes
    /// and drift, busier) or noisy (the default with 30% run-to-run noise). Default:
    /// default, and with --seeds default and shifted.
    #[arg(long, value_parser = ["default", "shifted", "noisy"])]
    workload: Vec<String>,
    /// Acceptable-time exponent x of the learned policy [default: the production default].
    #[arg(long)]
    exponent: Option<f64>,
    /// Hedge multiplier of the learned policy [default: the production default].
    #[arg(long)]
    hedge_multiplier: Option<f64>,
    /// The learned policy ignores the queues (expected waits and idle slots), to measure
    /// what counting them buys.
    #[arg(long)]
    queue_blind: bool,
    /// Print the reports as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct BazelBenchArgs {
    /// Genrule targets in the generated workspace, one action each (600 is the issue's
    /// build of 600 trivial actions).
    #[arg(long, default_value_t = 600)]
    targets: usize,
    /// Directory holding bazel_repos/ (the offline overrides) and bazel_flags.txt.
    #[arg(long, default_value = "crates/gantry/tests/fixtures")]
    fixtures: std::path::PathBuf,
    /// Measure on a warm Bazel server, as developers run it, instead of `--batch`: each
    /// mode first builds every action once with another `--action_env` salt (so its JVM
    /// has compiled the code it runs), then the measured build's actions are all new to
    /// the cache and to Bazel.
    #[arg(long)]
    warm: bool,
    /// With `--warm`: measured builds per mode, local and remote alternating, each with
    /// actions new to both (so a drift of the machine's speed falls on both alike, and a
    /// JIT still compiling shows as a trend). The ratio reported is the median round's
    /// (of an even number, the higher of the middle two).
    #[arg(long, default_value_t = 3, requires = "warm")]
    rounds: usize,
}

#[derive(clap::Args)]
pub struct BatchBenchArgs {
    /// Number of synthetic targets to plan (speed mode).
    #[arg(long, default_value_t = 10_000_000)]
    targets: usize,
    /// Plan one in-memory vector instead of streaming (speed mode).
    #[arg(long)]
    in_memory: bool,
    /// Run the workload simulation instead: 17 days of history, train, plan fresh
    /// streams, score against the ground truth and an oracle.
    #[arg(long)]
    simulate: bool,
    /// Seed of the synthetic workload.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// A small simulation (seconds instead of tens of seconds).
    #[arg(long)]
    small: bool,
    /// Compare every learner, fixed batch sizes, the oracle and the bounds of what the
    /// history tells (oracle-seen, oracle-identified) on large held-out streams (new
    /// packages, a last-day memory regression), one workload per seed.
    #[arg(long)]
    compare: bool,
    /// Seeds of --compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4,5")]
    seeds: Vec<u64>,
    /// Fixed batch sizes of --compare.
    #[arg(long, value_delimiter = ',', default_value = "300,200")]
    fixed: Vec<usize>,
    /// --compare: also print each stream's predicted and observed OOM rate for
    /// this learner (e.g. v2).
    #[arg(long)]
    per_stream: Option<String>,
    /// --compare: multiply every target's memory (a heavier repository), on top of
    /// the workload's own scale.
    #[arg(long, default_value_t = 1.0)]
    target_memory_scale: f64,
    /// --compare: the workload, the default or a shift of it: default, heavy, light,
    /// additive, compact, noisy, new-code, regression.
    #[arg(long, default_value = "default")]
    workload: String,
    /// --compare: score only these planners (comma-separated, e.g.
    /// shared,shared+feedback,fixed-300); the oracle is always scored.
    #[arg(long, value_delimiter = ',')]
    planners: Vec<String>,
    /// --compare: plan with this `[batch] group_backoff_share` instead of the default
    /// (0.3 keeps history groups whole at memory cuts; see README).
    #[arg(long)]
    group_backoff_share: Option<f64>,
    /// --compare: plan with this `[batch] excess_oom_tightening` instead of the default
    /// (0.05; 0 plans as before it; see README).
    #[arg(long)]
    excess_oom_tightening: Option<f64>,
}

#[derive(clap::Args)]
pub struct CasArgs {
    /// Server to measure, e.g. grpc://127.0.0.1:8980. Default: start one in-process.
    #[arg(long)]
    target: Option<String>,
    /// Instance name to use.
    #[arg(long, default_value = "")]
    instance: String,
    /// Total bytes for the ByteStream phase.
    #[arg(long, default_value = "1GiB")]
    stream_total: ByteSize,
    /// Size of each ByteStream blob.
    #[arg(long, default_value = "64MiB")]
    stream_blob: ByteSize,
    /// ByteStream chunk size per WriteRequest.
    #[arg(long, default_value = "1MiB")]
    chunk: ByteSize,
    /// Number of small blobs for BatchUpdateBlobs and FindMissingBlobs.
    #[arg(long, default_value_t = 100_000)]
    small_count: usize,
    /// Size of each small blob.
    #[arg(long, default_value = "4KiB")]
    small_size: ByteSize,
    /// Concurrent requests in flight.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// A second server on the same shared CAS (another frontend on the same bucket, with
    /// its own local tier) that has not seen the blobs: FindMissingBlobs over them is
    /// measured there too, once cold (nothing known locally: one HEAD per digest on S3)
    /// and once more warm.
    #[arg(long)]
    cold_target: Option<String>,
}

#[derive(Serialize, Default)]
struct CasReport {
    target: String,
    sha256_single_core_mib_s: f64,
    blake3_single_core_mib_s: f64,
    bytestream_write_mib_s: f64,
    bytestream_read_mib_s: f64,
    batch_update_blobs_per_s: f64,
    /// The same blobs on an in-process server that fsyncs each one (no --target only).
    #[serde(skip_serializing_if = "Option::is_none")]
    batch_update_blobs_fsync_each_per_s: Option<f64>,
    find_missing_digests_per_s: f64,
    find_missing_again_digests_per_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    find_missing_cold_digests_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    find_missing_cold_then_warm_digests_per_s: Option<f64>,
}

/// Starts a server on embedded defaults in a temp dir, its CAS with or without the
/// small-blob journal. Dropping the guard stops it.
async fn local_cas_server(journal: bool) -> anyhow::Result<(String, impl Sized)> {
    let dir = tempfile::tempdir().context("creating a temporary data dir")?;
    let mut config = gantry_config::Config::default();
    config.server.data_dir = dir.path().to_owned();
    config.cas = gantry_config::CasConfig::Fs(gantry_config::FsStoreConfig {
        max_size: ByteSize::gib(8),
        journal,
        ..Default::default()
    });
    let db = gantry_store::open_metadata(&config).await?;
    let services = crate::serve::build_services(&config, &db).await?;
    let server =
        gantry_services::RunningServer::start(&services, "127.0.0.1:0".parse()?, "127.0.0.1:0".parse()?).await?;
    Ok((format!("grpc://{}", server.grpc_addr), (server, services, dir)))
}

/// BatchUpdateBlobs of `smalls`, `per_batch` to a request, `concurrency` requests in
/// flight: blobs per second.
async fn batch_update_rate(
    channel: &Channel,
    inst: &str,
    smalls: &[(Digest, Vec<u8>)],
    per_batch: usize,
    concurrency: usize,
) -> anyhow::Result<f64> {
    let start = Instant::now();
    futures::stream::iter(smalls.chunks(per_batch))
        .map(|batch| {
            let mut cas = ContentAddressableStorageClient::new(channel.clone());
            let req = reapi::BatchUpdateBlobsRequest {
                instance_name: inst.to_owned(),
                requests: batch
                    .iter()
                    .map(|(d, b)| batch_update_blobs_request::Request {
                        digest: Some(d.to_proto()),
                        data: b.clone(),
                        compressor: 0,
                    })
                    .collect(),
                ..Default::default()
            };
            async move {
                let resp = cas.batch_update_blobs(req).await?.into_inner();
                if let Some(bad) = resp.responses.iter().find(|r| r.status.as_ref().is_some_and(|s| s.code != 0)) {
                    bail!("BatchUpdateBlobs item failed: {:?}", bad.status);
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(smalls.len() as f64 / start.elapsed().as_secs_f64())
}

/// FindMissingBlobs over `digests` in requests of 10,000: (digests/s, missing count).
async fn find_missing_rate(
    channel: &Channel,
    inst: &str,
    digests: &[reapi::Digest],
    concurrency: usize,
) -> anyhow::Result<(f64, usize)> {
    let start = Instant::now();
    let missing: usize = futures::stream::iter(digests.chunks(10_000))
        .map(|chunk| {
            let mut cas = ContentAddressableStorageClient::new(channel.clone());
            let req = reapi::FindMissingBlobsRequest {
                instance_name: inst.to_string(),
                blob_digests: chunk.to_vec(),
                ..Default::default()
            };
            async move { anyhow::Ok(cas.find_missing_blobs(req).await?.into_inner().missing_blob_digests.len()) }
        })
        .buffer_unordered(concurrency)
        .try_fold(0, |a, n| async move { Ok(a + n) })
        .await?;
    Ok((digests.len() as f64 / start.elapsed().as_secs_f64(), missing))
}

pub async fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    let result = bench(cmd).await;
    // The groups in-process workers kept for reuse (exec, bazel and run start such
    // workers), removed as `gantry serve` does when it stops: else each run of a bench
    // left its groups behind until the next worker process started.
    gantry_worker::cgroup::release_idle();
    result
}

async fn bench(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Cas(args) => cas(args).await,
        BenchCommand::Batch(args) => tokio::task::spawn_blocking(move || batch(args)).await?,
        BenchCommand::Exec(args) => exec(args).await,
        BenchCommand::Ac(args) => ac(args).await,
        BenchCommand::Auth(args) => auth_bench(args).await,
        BenchCommand::Sizeclass(args) => tokio::task::spawn_blocking(move || sizeclass(args)).await?,
        BenchCommand::Queue(args) => tokio::task::spawn_blocking(move || crate::bench_queue::run(args)).await?,
        BenchCommand::Bazel(args) => bazel(args).await,
        BenchCommand::Scheduler(args) => crate::bench_scheduler::run(args).await,
        BenchCommand::Web(args) => crate::bench_web::run(args).await,
        BenchCommand::AuthFloorServer(args) => crate::bench_floor::serve(args).await,
        BenchCommand::Fuzz(args) => crate::bench_fuzz::run(args).await,
        BenchCommand::Run(args) => {
            let (target, _server) = bench_server(&args.target.clone(), Some(4), &None).await?;
            crate::bench_run::run(args, target).await
        }
    }
}

/// Deterministic pseudo-random bytes (xorshift), fast enough not to dominate setup.
fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

fn progress(json: bool, msg: &str) {
    if !json {
        eprintln!("  {msg}");
    }
}

fn hash_speed(f: DigestFunction) -> f64 {
    let mut buf = vec![0u8; 256 << 20];
    fill(&mut buf, 99);
    let start = Instant::now();
    let d = f.digest_of(&buf);
    let secs = start.elapsed().as_secs_f64();
    std::hint::black_box(d);
    256.0 / secs
}

async fn cas(args: CasArgs) -> anyhow::Result<()> {
    if args.stream_blob.as_u64() == 0 || args.small_size.as_u64() == 0 || args.chunk.as_u64() == 0 {
        bail!("--stream-blob, --small-size and --chunk must be greater than zero");
    }
    let mut _local = None;
    let target = match &args.target {
        Some(t) => t.clone(),
        None => {
            let (t, guard) = local_cas_server(true).await?;
            _local = Some(guard);
            t
        }
    };
    let channel = gantry_core::client::connect(&target).await.context("--target")?;
    let mut report = CasReport { target: target.clone(), ..Default::default() };
    if !args.json {
        eprintln!("gantry bench cas against {target}");
    }

    progress(args.json, "hashing 256 MiB on one core (SHA-256, BLAKE3)...");
    report.sha256_single_core_mib_s = tokio::task::spawn_blocking(|| hash_speed(DigestFunction::Sha256)).await?;
    report.blake3_single_core_mib_s = tokio::task::spawn_blocking(|| hash_speed(DigestFunction::Blake3)).await?;

    // ByteStream: distinct blobs so nothing short-circuits as "already present".
    let blob = args.stream_blob.as_u64() as usize;
    let count = (args.stream_total.as_u64() as usize).div_ceil(blob).max(1);
    let run_id: u64 = uuid::Uuid::new_v4().as_u64_pair().0;
    progress(args.json, &format!("preparing {count} blobs of {}...", args.stream_blob));
    let blobs: Vec<(Digest, bytes::Bytes)> = (0..count)
        .map(|i| {
            let mut b = vec![0u8; blob];
            fill(&mut b, run_id ^ (i as u64 + 1));
            (DigestFunction::Sha256.digest_of(&b), bytes::Bytes::from(b))
        })
        .collect();
    let total_mib = (blob * count) as f64 / (1 << 20) as f64;
    let chunk = args.chunk.as_u64() as usize;
    let inst = args.instance.clone();
    progress(args.json, &format!("ByteStream write of {total_mib:.0} MiB..."));
    let start = Instant::now();
    futures::stream::iter(blobs.iter().cloned())
        .map(|(d, data)| {
            let mut bs = ByteStreamClient::new(channel.clone());
            let name = gantry_core::resource::upload_name(&inst, &uuid::Uuid::new_v4().to_string(), &d);
            async move {
                let reqs: Vec<WriteRequest> = (0..data.len())
                    .step_by(chunk)
                    .map(|off| WriteRequest {
                        resource_name: if off == 0 { name.clone() } else { String::new() },
                        write_offset: off as i64,
                        finish_write: off + chunk >= data.len(),
                        data: data.slice(off..(off + chunk).min(data.len())).to_vec(),
                    })
                    .collect();
                let resp = bs.write(futures::stream::iter(reqs)).await?.into_inner();
                anyhow::ensure!(resp.committed_size == d.size as i64, "short write of {d}");
                anyhow::Ok(())
            }
        })
        .buffer_unordered(args.concurrency)
        .try_collect::<Vec<_>>()
        .await?;
    report.bytestream_write_mib_s = total_mib / start.elapsed().as_secs_f64();

    progress(args.json, &format!("ByteStream read of {total_mib:.0} MiB..."));
    let start = Instant::now();
    futures::stream::iter(blobs.iter().map(|(d, _)| *d))
        .map(|d| {
            let mut bs = ByteStreamClient::new(channel.clone()).max_decoding_message_size(64 << 20);
            let name = gantry_core::resource::read_name(&inst, &d);
            async move {
                let mut s =
                    bs.read(ReadRequest { resource_name: name, read_offset: 0, read_limit: 0 }).await?.into_inner();
                let mut n = 0u64;
                while let Some(m) = s.message().await? {
                    n += m.data.len() as u64;
                }
                anyhow::ensure!(n == d.size, "short read of {d}: {n} bytes");
                anyhow::Ok(())
            }
        })
        .buffer_unordered(args.concurrency)
        .try_collect::<Vec<_>>()
        .await?;
    report.bytestream_read_mib_s = total_mib / start.elapsed().as_secs_f64();
    drop(blobs);

    // BatchUpdateBlobs of many small blobs, in batches under the 4 MiB limit.
    let small = args.small_size.as_u64() as usize;
    progress(args.json, &format!("preparing {} blobs of {}...", args.small_count, args.small_size));
    let smalls: Vec<(Digest, Vec<u8>)> = (0..args.small_count)
        .map(|i| {
            let mut b = vec![0u8; small];
            fill(&mut b, run_id.rotate_left(17) ^ (i as u64 + 1));
            (DigestFunction::Sha256.digest_of(&b), b)
        })
        .collect();
    let per_batch = ((4usize << 20) - (64 << 10)) / (small + 100);
    let per_batch = per_batch.max(1);
    // Kept until the measurement below is over: removing its files meanwhile would load
    // the disk.
    let mut _baseline_server = None;
    if args.target.is_none() {
        // The baseline, in the same run on the same disk: a server whose CAS fsyncs every
        // blob's file and directory (`[cas] journal = false`). First, so that neither
        // measurement shares the disk with the other's leftover work: this one leaves
        // none, while the journal's placer may still be writing files after its last
        // acknowledgement.
        progress(args.json, "BatchUpdateBlobs on a server that fsyncs each blob ([cas] journal = false)...");
        let (t, guard) = local_cas_server(false).await?;
        let baseline = gantry_core::client::connect(&t).await?;
        let rate = batch_update_rate(&baseline, &inst, &smalls, per_batch, args.concurrency).await?;
        report.batch_update_blobs_fsync_each_per_s = Some(rate);
        _baseline_server = Some(guard);
        // Let the disk settle: what the baseline left for writeback (its directories'
        // metadata) is not the next measurement's work.
        tokio::task::spawn_blocking(|| {
            // SAFETY: sync(2) takes no arguments and cannot fail.
            unsafe { libc::sync() };
        })
        .await?;
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    }
    progress(args.json, &format!("BatchUpdateBlobs of {} blobs ({per_batch} per request)...", smalls.len()));
    report.batch_update_blobs_per_s = batch_update_rate(&channel, &inst, &smalls, per_batch, args.concurrency).await?;
    drop(_baseline_server);

    // FindMissingBlobs over the same digests and as many never uploaded (half present,
    // as a build's lookups are), in requests of 10,000.
    let mut digests: Vec<reapi::Digest> = smalls.iter().map(|(d, _)| d.to_proto()).collect();
    let absent = digests.len();
    let absent_size = args.small_size.as_u64() as usize;
    digests.extend((0..absent).map(|i| {
        let mut d = gantry_core::DigestFunction::Sha256.digest_of(format!("gantry bench absent blob {i}").as_bytes());
        d.size = absent_size as u64;
        d.to_proto()
    }));
    drop(smalls);
    progress(args.json, &format!("FindMissingBlobs over {} digests (half present)...", digests.len()));
    let (rate, missing) = find_missing_rate(&channel, &inst, &digests, args.concurrency).await?;
    report.find_missing_digests_per_s = rate;
    anyhow::ensure!(missing == absent, "{missing} digests reported missing, {absent} expected");
    // Once more: what a warm server answers from what it knows (its tier, its records).
    let (rate, missing) = find_missing_rate(&channel, &inst, &digests, args.concurrency).await?;
    anyhow::ensure!(missing == absent, "{missing} digests reported missing on the second pass, {absent} expected");
    report.find_missing_again_digests_per_s = rate;
    if let Some(cold) = &args.cold_target {
        let cold_channel = gantry_core::client::connect(cold).await.context("--cold-target")?;
        progress(args.json, &format!("FindMissingBlobs over {} digests on {cold}, cold then warm...", digests.len()));
        for slot in [&mut report.find_missing_cold_digests_per_s, &mut report.find_missing_cold_then_warm_digests_per_s]
        {
            let (rate, missing) = find_missing_rate(&cold_channel, &inst, &digests, args.concurrency).await?;
            anyhow::ensure!(missing == absent, "{cold} reported {missing} digests missing, {absent} expected");
            *slot = Some(rate);
        }
    }

    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("| measurement | result |");
        println!("|---|---|");
        println!("| SHA-256, one core (ceiling) | {:.0} MiB/s |", report.sha256_single_core_mib_s);
        println!("| BLAKE3, one core | {:.0} MiB/s |", report.blake3_single_core_mib_s);
        println!(
            "| ByteStream write, {total_mib:.0} MiB as {} blobs | {:.0} MiB/s |",
            args.stream_blob, report.bytestream_write_mib_s
        );
        println!(
            "| ByteStream read, {total_mib:.0} MiB as {} blobs | {:.0} MiB/s |",
            args.stream_blob, report.bytestream_read_mib_s
        );
        println!(
            "| BatchUpdateBlobs, {} x {} | {:.0} blobs/s |",
            args.small_count, args.small_size, report.batch_update_blobs_per_s
        );
        if let Some(each) = report.batch_update_blobs_fsync_each_per_s {
            println!(
                "| BatchUpdateBlobs, the same with an fsync per blob | {each:.0} blobs/s (journal: {:.1}x) |",
                report.batch_update_blobs_per_s / each
            );
        }
        println!(
            "| FindMissingBlobs, {} digests (half present) | {:.0} digests/s |",
            2 * args.small_count,
            report.find_missing_digests_per_s
        );
        println!("| FindMissingBlobs, the same again | {:.0} digests/s |", report.find_missing_again_digests_per_s);
        if let (Some(cold), Some(warm)) =
            (report.find_missing_cold_digests_per_s, report.find_missing_cold_then_warm_digests_per_s)
        {
            println!("| FindMissingBlobs on --cold-target, cold | {cold:.0} digests/s |");
            println!("| FindMissingBlobs on --cold-target, again | {warm:.0} digests/s |");
        }
    }
    Ok(())
}

/// Peak resident memory of this process so far, from /proc (VmHWM).
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn batch(args: BatchBenchArgs) -> anyhow::Result<()> {
    use gantry_batch::sim::{bench, simulate, BenchConfig, SimConfig};
    let mut sim = if args.small { SimConfig::small() } else { SimConfig::default() };
    sim.seed = args.seed;
    if args.compare {
        let Some(mut base) = SimConfig::workload(&args.workload) else {
            anyhow::bail!("--workload {:?} is not one of {}", args.workload, gantry_batch::sim::WORKLOADS.join(", "));
        };
        base.target_memory_scale *= args.target_memory_scale;
        if let Some(share) = args.group_backoff_share {
            base.planner.group_backoff_share = share;
        }
        if let Some(k) = args.excess_oom_tightening {
            base.planner.excess_oom_tightening = k;
        }
        base.planner.validate()?;
        anyhow::ensure!(!args.seeds.is_empty(), "--seeds needs at least one seed");
        let rows = gantry_batch::sim::compare(&base, &args.seeds, &args.fixed, &args.planners, |r| {
            eprintln!(
                "  seed {}: {:<14} {:>5} builds, OOM {:.3}%, DE {:.3}%, density {:.3} of the oracle",
                r.seed,
                r.planner,
                r.score.builds,
                100.0 * r.score.oom_rate(),
                100.0 * r.score.de_rate(),
                r.density_vs_oracle
            );
        })?;
        print!("{}", gantry_batch::sim::compare_table(&rows));
        if let Some(p) = &args.per_stream {
            print!("\n{}", gantry_batch::sim::per_stream_table(&rows, p));
        }
        return Ok(());
    }
    if args.simulate {
        eprintln!("simulating 17 days of history, training, planning fresh streams (seed {})...", args.seed);
        let start = Instant::now();
        let run = simulate(&sim)?;
        print!("{}", run.report);
        println!(
            "simulation wall time {:.1}s, peak RSS {:.0} MiB",
            start.elapsed().as_secs_f64(),
            peak_rss_mib().unwrap_or(0.0)
        );
        return Ok(());
    }
    let cfg = BenchConfig {
        targets: args.targets,
        streaming: !args.in_memory,
        sim: SimConfig { eval_small_streams: 0, eval_large_streams: 0, ..sim },
        ..BenchConfig::default()
    };
    eprintln!("training models on a simulated history, then planning {} targets...", args.targets);
    let rss_before = peak_rss_mib();
    let report = bench(&cfg)?;
    print!("{report}");
    println!(
        "peak RSS {:.0} MiB (of which {:.0} MiB before the run: the binary and runtime)",
        peak_rss_mib().unwrap_or(0.0),
        rss_before.unwrap_or(0.0)
    );
    Ok(())
}

/// A server for a benchmark: `--target`, or one started in-process with local workers.
pub(crate) async fn bench_server(
    target: &Option<String>,
    workers: Option<usize>,
    metadata_url: &Option<String>,
) -> anyhow::Result<(
    String,
    Option<(gantry_services::RunningServer, gantry_services::Services, Vec<gantry_core::TaskGuard>, tempfile::TempDir)>,
)> {
    if let Some(t) = target {
        return Ok((t.clone(), None));
    }
    let dir = tempfile::tempdir().context("creating a temporary data dir")?;
    let mut config = gantry_config::Config::default();
    config.server.data_dir = dir.path().to_owned();
    config.execution.workers = workers.map(gantry_config::Workers::Count);
    config.metadata.url = metadata_url.clone();
    let db = gantry_store::open_metadata(&config).await?;
    let services = crate::serve::build_services(&config, &db).await?;
    let guards = crate::serve::start_local_workers(&config, &services).await?;
    let server =
        gantry_services::RunningServer::start(&services, "127.0.0.1:0".parse()?, "127.0.0.1:0".parse()?).await?;
    let t = format!("grpc://{}", server.grpc_addr);
    Ok((t, Some((server, services, guards, dir))))
}

pub(crate) async fn put_blob(channel: &Channel, data: Vec<u8>) -> anyhow::Result<Digest> {
    let d = DigestFunction::Sha256.digest_of(&data);
    let r = ContentAddressableStorageClient::new(channel.clone())
        .batch_update_blobs(reapi::BatchUpdateBlobsRequest {
            requests: vec![batch_update_blobs_request::Request { digest: Some(d.to_proto()), data, compressor: 0 }],
            ..Default::default()
        })
        .await?
        .into_inner();
    if let Some(s) = r.responses.first().and_then(|r| r.status.as_ref()).filter(|s| s.code != 0) {
        bail!("upload failed: {}", s.message);
    }
    Ok(d)
}

/// Runs Execute to completion and returns the final ExecuteResponse.
async fn run_execute(
    channel: &Channel,
    action: Digest,
    skip_cache_lookup: bool,
) -> anyhow::Result<reapi::ExecuteResponse> {
    use prost::Message;
    let mut s = reapi::execution_client::ExecutionClient::new(channel.clone())
        .execute(reapi::ExecuteRequest {
            action_digest: Some(action.to_proto()),
            skip_cache_lookup,
            ..Default::default()
        })
        .await?
        .into_inner();
    while let Some(op) = s.message().await? {
        if op.done {
            gantry_core::client::finish_stream(&mut s, std::time::Duration::from_secs(5)).await;
            if let Some(gantry_core::google::longrunning::operation::Result::Response(any)) = op.result {
                return Ok(reapi::ExecuteResponse::decode(any.value.as_slice())?);
            }
            bail!("operation {} finished without a response", op.name);
        }
    }
    bail!("Execute stream ended early")
}

/// CPU time the whole machine has spent busy since boot (all CPUs, from /proc/stat), or
/// None where there is no /proc.
fn machine_busy() -> Option<std::time::Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat.lines().next()?.split_whitespace().skip(1).map_while(|t| t.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal ...; idle and iowait are not busy.
    let busy: u64 = ticks.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, t)| t).sum();
    Some(std::time::Duration::from_secs_f64(busy as f64 / clock_ticks_per_second()))
}

/// Waits (up to 30 s) until the machine is nearly idle: the CAS puts uploaded blobs
/// in place as files in the background (see `fs_journal`), and that work belongs to the
/// uploads, not to the executions measured next.
async fn settle() {
    let deadline = Instant::now() + std::time::Duration::from_secs(30);
    let window = std::time::Duration::from_millis(200);
    while Instant::now() < deadline {
        let Some(before) = machine_busy() else { return };
        tokio::time::sleep(window).await;
        let Some(after) = machine_busy() else { return };
        // A tenth of one CPU: the server's timers and this process, not a backlog.
        if (after - before).as_secs_f64() < window.as_secs_f64() / 10.0 {
            return;
        }
    }
    eprintln!("  (the machine did not go idle within 30 s after the uploads; measuring anyway)");
}

/// What one `bench exec` run measured.
/// The mean time of each stage of the actions' ExecutedActionMetadata, for finding
/// where the time of a no-op action goes.
fn stage_means(results: &[reapi::ExecuteResponse]) -> String {
    let ms = |a: &Option<gantry_core::google::protobuf::Timestamp>,
              b: &Option<gantry_core::google::protobuf::Timestamp>| {
        match (a, b) {
            (Some(a), Some(b)) => Some((b.seconds - a.seconds) as f64 * 1e3 + (b.nanos - a.nanos) as f64 / 1e6),
            _ => None,
        }
    };
    let mut sums = [0.0f64; 5];
    let mut n = 0usize;
    for r in results {
        let Some(m) = r.result.as_ref().and_then(|r| r.execution_metadata.as_ref()) else { continue };
        let stages = [
            ms(&m.queued_timestamp, &m.worker_start_timestamp),
            ms(&m.input_fetch_start_timestamp, &m.input_fetch_completed_timestamp),
            ms(&m.execution_start_timestamp, &m.execution_completed_timestamp),
            ms(&m.output_upload_start_timestamp, &m.output_upload_completed_timestamp),
            ms(&m.worker_start_timestamp, &m.worker_completed_timestamp),
        ];
        if let [Some(a), Some(b), Some(c), Some(d), Some(e)] = stages {
            for (s, v) in sums.iter_mut().zip([a, b, c, d, e]) {
                *s += v;
            }
            n += 1;
        }
    }
    let n = n.max(1) as f64;
    format!(
        "queued {:.2}, inputs {:.2}, run {:.2}, outputs {:.2}, on the worker {:.2}",
        sums[0] / n,
        sums[1] / n,
        sums[2] / n,
        sums[3] / n,
        sums[4] / n
    )
}

struct ExecResult {
    throughput: f64,
    hit_p50_ms: f64,
    hit_p99_ms: f64,
}

async fn exec(args: ExecBenchArgs) -> anyhow::Result<()> {
    let mut runs: Vec<(String, ExecResult)> = Vec::new();
    let mut urls: Vec<Option<String>> = vec![None];
    urls.extend(args.metadata_urls.iter().cloned().map(Some));
    for url in &urls {
        let (target, _local) = bench_server(&args.target, args.workers, url).await?;
        let name = match (url, &args.target) {
            (Some(u), _) => gantry_store::metadata_db::redact_url(u),
            (None, Some(_)) => "the target's own".to_string(),
            (None, None) => "embedded SQLite".to_string(),
        };
        eprintln!("gantry bench exec against {target} (metadata: {name})");
        runs.push((name, exec_once(&args, &target).await?));
    }
    let base = runs[0].1.throughput;
    println!(
        "| metadata | no-op actions/s ({} actions, {} in flight) | vs SQLite | cache-hit Execute p50 | p99 |",
        args.actions, args.concurrency
    );
    println!("|---|---|---|---|---|");
    for (name, r) in &runs {
        println!(
            "| {name} | {:.0} | {:.2}x | {:.3} ms | {:.3} ms |",
            r.throughput,
            r.throughput / base,
            r.hit_p50_ms,
            r.hit_p99_ms
        );
    }
    Ok(())
}

async fn exec_once(args: &ExecBenchArgs, target: &str) -> anyhow::Result<ExecResult> {
    use prost::Message;
    let channel = gantry_core::client::connect(target).await?;
    let empty_dir = put_blob(&channel, reapi::Directory::default().encode_to_vec()).await?;
    let run_id = uuid::Uuid::new_v4().to_string();
    eprintln!("  uploading {} distinct no-op actions...", args.actions);
    let mut actions = Vec::with_capacity(args.actions);
    for i in 0..args.actions {
        #[allow(deprecated)]
        let cmd = reapi::Command { arguments: vec!["/bin/true".into(), format!("{run_id}-{i}")], ..Default::default() };
        let cd = put_blob(&channel, cmd.encode_to_vec()).await?;
        let a = reapi::Action {
            command_digest: Some(cd.to_proto()),
            input_root_digest: Some(empty_dir.to_proto()),
            ..Default::default()
        };
        actions.push(put_blob(&channel, a.encode_to_vec()).await?);
    }
    settle().await;
    eprintln!("  executing them, {} in flight...", args.concurrency);
    let busy_before = machine_busy();
    let start = Instant::now();
    let results: Vec<reapi::ExecuteResponse> = futures::stream::iter(actions.iter().copied())
        .map(|a| {
            let ch = channel.clone();
            async move { run_execute(&ch, a, true).await }
        })
        .buffer_unordered(args.concurrency)
        .try_collect()
        .await?;
    let throughput = args.actions as f64 / start.elapsed().as_secs_f64();
    eprintln!("  where an action's time went (mean ms): {}", stage_means(&results));
    if let (Some(a), Some(b)) = (busy_before, machine_busy()) {
        // The whole machine's, so it holds the client, the server, the spawners and the
        // commands: what an action costs when nothing else runs.
        eprintln!("  CPU per action, whole machine: {:.3} ms", (b - a).as_secs_f64() * 1e3 / args.actions as f64);
    }
    anyhow::ensure!(
        results
            .iter()
            .all(|r| r.status.as_ref().is_none_or(|s| s.code == 0)
                && r.result.as_ref().is_some_and(|x| x.exit_code == 0)),
        "some no-op actions failed"
    );
    eprintln!("  {} sequential cache hits...", args.cache_hits);
    let hit = actions[0];
    let mut lat = Vec::with_capacity(args.cache_hits);
    for _ in 0..args.cache_hits {
        let t = Instant::now();
        let r = run_execute(&channel, hit, false).await?;
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
        anyhow::ensure!(r.cached_result, "expected a cache hit");
    }
    lat.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    let pct = |p: f64| lat[((lat.len() as f64 - 1.0) * p).round() as usize];
    Ok(ExecResult { throughput, hit_p50_ms: pct(0.5), hit_p99_ms: pct(0.99) })
}

/// One configuration of `bench auth`: a `gantry serve` process of its own (so its CPU time
/// is its own), and channels that reach it.
struct AuthTarget {
    name: &'static str,
    server: tokio::process::Child,
    _dir: tempfile::TempDir,
    channels: Vec<tonic::transport::Channel>,
    token: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

/// A loopback port nobody listens on right now (the server binds it a moment later).
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The affinity mask of `cpus`, refusing CPUs this machine does not have.
fn cpu_set(cpus: &[usize], flag: &str) -> anyhow::Result<libc::cpu_set_t> {
    let online = num_cpus_configured();
    // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        anyhow::ensure!(
            c < online && c < libc::CPU_SETSIZE as usize,
            "{flag} {c}: this machine has CPUs 0..{}",
            online - 1
        );
        // SAFETY: c is below CPU_SETSIZE.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    Ok(set)
}

/// CPUs configured on this machine (available_parallelism counts only those this
/// process may use).
fn num_cpus_configured() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) }.max(1) as usize
}

/// Moves every thread of this process onto `set` (threads made later inherit it from
/// the thread that makes them).
fn pin_this_process(set: &libc::cpu_set_t) -> anyhow::Result<()> {
    for task in std::fs::read_dir("/proc/self/task")? {
        let tid: libc::pid_t = task?.file_name().to_string_lossy().parse()?;
        // SAFETY: set is a valid cpu_set_t of the size given.
        if unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), set) } != 0 {
            return Err(std::io::Error::last_os_error()).context("sched_setaffinity (--client-cpus)");
        }
    }
    Ok(())
}

/// User plus system CPU time of process `pid` so far, from /proc.
fn process_cpu(pid: u32) -> anyhow::Result<std::time::Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let rest = stat.rsplit_once(')').context("/proc stat without a command name")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 =
        fields.get(11).context("no utime")?.parse::<u64>()? + fields.get(12).context("no stime")?.parse::<u64>()?;
    Ok(std::time::Duration::from_secs_f64(ticks as f64 / clock_ticks_per_second()))
}

/// The unit of /proc's CPU times.
fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64
}

/// What one `bench auth` configuration runs.
#[derive(Clone, Copy)]
enum AuthServer {
    /// `gantry serve`, with `[server.tls]` when `secure`, `[auth]` with one token when
    /// `with_token`.
    Gantry { secure: bool, with_token: bool },
    /// The floor: a bare tonic server (`bench_floor`), with TLS when `secure`: tonic's own,
    /// or gantry's listener when `gantry_listener`.
    Floor { secure: bool, gantry_listener: bool },
}

async fn auth_target(name: &'static str, args: &AuthBenchArgs, kind: AuthServer) -> anyhow::Result<AuthTarget> {
    use tonic::transport::{Certificate, ClientTlsConfig};
    let dir = tempfile::tempdir()?;
    let (port, http_port) = (free_port()?, free_port()?);
    let abs = |p: &std::path::Path| std::path::absolute(p).with_context(|| p.display().to_string());
    let (secure, with_token) = match kind {
        AuthServer::Gantry { secure, with_token } => (secure, with_token),
        AuthServer::Floor { secure, .. } => (secure, false),
    };
    let mut text = format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nhttp_listen = \"127.0.0.1:{http_port}\"\ndata_dir = {:?}\n",
        dir.path().join("data")
    );
    if secure {
        text += &format!("[server.tls]\ncert = {:?}\nkey = {:?}\n", abs(&args.tls_cert)?, abs(&args.tls_key)?);
    }
    text += "[execution]\nworkers = 0\n[batch]\nrunners = 0\n";
    let token = with_token.then(|| uuid::Uuid::new_v4().simple().to_string());
    if let Some(t) = &token {
        text += &format!(
            "[auth]\n[[auth.tokens]]\nname = \"bench\"\nsha256 = \"{}\"\ngrants = [\"all\"]\n[auth.grants.all]\ninstances = [\"*\"]\npermissions = [\"read\", \"write_cas\", \"write_ac\"]\n",
            gantry_services::auth::token_sha256(t)
        );
    }
    let config = dir.path().join("gantry.toml");
    std::fs::write(&config, text)?;
    let log = std::fs::File::create(dir.path().join("serve.log"))?;
    let mut command = tokio::process::Command::new(std::env::current_exe()?);
    match kind {
        AuthServer::Gantry { .. } => command.arg("serve").arg("--config").arg(&config),
        AuthServer::Floor { gantry_listener, .. } => {
            command.args(["bench", "auth-floor-server", "--listen"]).arg(format!("127.0.0.1:{port}"));
            if secure {
                command.arg("--tls-cert").arg(abs(&args.tls_cert)?).arg("--tls-key").arg(abs(&args.tls_key)?);
            }
            if gantry_listener {
                command.arg("--gantry-listener");
            }
            &mut command
        }
    };
    command.env("RUST_LOG", "warn").stdout(std::process::Stdio::null()).stderr(log).kill_on_drop(true);
    if !args.server_cpus.is_empty() {
        let set = cpu_set(&args.server_cpus, "--server-cpus")?;
        // SAFETY: between fork and exec only sched_setaffinity runs, which is a plain
        // system call (async-signal-safe), on a mask copied into the closure.
        unsafe {
            command.pre_exec(move || {
                if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let server = command.spawn().context("starting gantry serve")?;
    let endpoint = || -> anyhow::Result<tonic::transport::Endpoint> {
        Ok(if secure {
            let ca = std::fs::read(&args.tls_ca).with_context(|| format!("--tls-ca {}", args.tls_ca.display()))?;
            tonic::transport::Endpoint::from_shared(format!("https://localhost:{port}"))?
                .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)))?
        } else {
            tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))?
        }
        .tcp_nodelay(true))
    };
    let started = Instant::now();
    let first = loop {
        match endpoint()?.connect().await {
            Ok(c) => break c,
            Err(e) if started.elapsed() < std::time::Duration::from_secs(30) => {
                tracing::debug!(error = %e, "waiting for the bench server");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => {
                let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap_or_default();
                bail!("the {name} server did not come up on port {port} in 30 s: {e}\n{log}");
            }
        }
    };
    let mut channels = vec![first];
    while channels.len() < args.clients {
        channels.push(endpoint()?.connect().await?);
    }
    let token = token.map(|t| format!("Bearer {t}").parse().expect("a uuid is ascii"));
    Ok(AuthTarget { name, server, _dir: dir, channels, token })
}

/// `msg` with the bearer token, if the configuration has one. The header value is made
/// once per configuration, so the client's own cost stays out of the comparison.
fn authed<T>(msg: T, header: &Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(h) = header {
        r.metadata_mut().insert("authorization", h.clone());
    }
    r
}

/// One phase of a round: calls per second, and the server's CPU microseconds per call.
#[derive(Clone, Copy, Default)]
struct PhaseResult {
    per_second: f64,
    server_cpu_us: f64,
}

/// One round: every client runs `calls` cache-hit GetActionResult, then `calls`
/// FindMissingBlobs of 100 digests (all present).
async fn auth_round(
    t: &AuthTarget,
    calls: usize,
    action: &gantry_core::Digest,
    blobs: &[Digest],
) -> anyhow::Result<[PhaseResult; 2]> {
    use gantry_core::reapi::action_cache_client::ActionCacheClient;
    let pid = t.server.id().context("the bench server exited")?;
    let total = (t.channels.len() * calls) as f64;
    let measure = |start: Instant, cpu0: std::time::Duration| -> anyhow::Result<PhaseResult> {
        let elapsed = start.elapsed().as_secs_f64();
        let cpu = process_cpu(pid)?.saturating_sub(cpu0).as_secs_f64();
        Ok(PhaseResult { per_second: total / elapsed, server_cpu_us: cpu * 1e6 / total })
    };
    let (start, cpu0) = (Instant::now(), process_cpu(pid)?);
    futures::future::try_join_all(t.channels.iter().map(|ch| {
        let mut c = ActionCacheClient::new(ch.clone());
        async move {
            for _ in 0..calls {
                let req =
                    reapi::GetActionResultRequest { action_digest: Some(action.to_proto()), ..Default::default() };
                c.get_action_result(authed(req, &t.token)).await?;
            }
            anyhow::Ok(())
        }
    }))
    .await?;
    let gets = measure(start, cpu0)?;
    let digests: Vec<_> = blobs.iter().map(|d| d.to_proto()).collect();
    let (start, cpu0) = (Instant::now(), process_cpu(pid)?);
    futures::future::try_join_all(t.channels.iter().map(|ch| {
        let mut c = ContentAddressableStorageClient::new(ch.clone());
        let digests = digests.clone();
        async move {
            for _ in 0..calls {
                let req = reapi::FindMissingBlobsRequest { blob_digests: digests.clone(), ..Default::default() };
                let r = c.find_missing_blobs(authed(req, &t.token)).await?;
                anyhow::ensure!(r.into_inner().missing_blob_digests.is_empty(), "blobs went missing");
            }
            anyhow::Ok(())
        }
    }))
    .await?;
    Ok([gets, measure(start, cpu0)?])
}

async fn auth_bench(args: AuthBenchArgs) -> anyhow::Result<()> {
    use gantry_core::reapi::action_cache_client::ActionCacheClient;
    anyhow::ensure!(
        args.clients > 0 && args.calls > 0 && args.rounds > 0,
        "--clients, --calls and --rounds must be at least 1"
    );
    if !args.client_cpus.is_empty() {
        pin_this_process(&cpu_set(&args.client_cpus, "--client-cpus")?)?;
    }
    // The first is what every row is compared with; the last three are the stack's floor.
    let targets = [
        auth_target("plaintext, no [auth]", &args, AuthServer::Gantry { secure: false, with_token: false }).await?,
        auth_target("plaintext + bearer token", &args, AuthServer::Gantry { secure: false, with_token: true }).await?,
        auth_target("TLS + bearer token", &args, AuthServer::Gantry { secure: true, with_token: true }).await?,
        auth_target("floor: bare tonic, plaintext", &args, AuthServer::Floor { secure: false, gantry_listener: false })
            .await?,
        auth_target("floor: bare tonic, TLS", &args, AuthServer::Floor { secure: true, gantry_listener: false })
            .await?,
        auth_target(
            "floor: bare tonic, gantry's TLS listener",
            &args,
            AuthServer::Floor { secure: true, gantry_listener: true },
        )
        .await?,
    ];
    // The same entry and blobs in both: an action result with no outputs, 100 small blobs.
    let action = DigestFunction::Sha256.digest_of(b"bench auth action");
    let blobs: Vec<Digest> =
        (0..100u32).map(|i| DigestFunction::Sha256.digest_of(format!("blob {i}").as_bytes())).collect();
    for t in &targets {
        let requests = blobs
            .iter()
            .enumerate()
            .map(|(i, d)| batch_update_blobs_request::Request {
                digest: Some(d.to_proto()),
                data: format!("blob {i}").into_bytes(),
                compressor: 0,
            })
            .collect();
        let r = ContentAddressableStorageClient::new(t.channels[0].clone())
            .batch_update_blobs(authed(reapi::BatchUpdateBlobsRequest { requests, ..Default::default() }, &t.token))
            .await?
            .into_inner();
        anyhow::ensure!(
            r.responses.iter().all(|x| x.status.as_ref().is_none_or(|s| s.code == 0)),
            "uploading the bench blobs failed"
        );
        ActionCacheClient::new(t.channels[0].clone())
            .update_action_result(authed(
                reapi::UpdateActionResultRequest {
                    action_digest: Some(action.to_proto()),
                    action_result: Some(reapi::ActionResult::default()),
                    ..Default::default()
                },
                &t.token,
            ))
            .await?;
    }
    // results[configuration][phase] over the rounds.
    let mut results: Vec<[Vec<PhaseResult>; 2]> = vec![[vec![], vec![]]; targets.len()];
    for round in 0..args.rounds {
        for (i, t) in targets.iter().enumerate() {
            eprintln!("  round {}/{}: {}", round + 1, args.rounds, t.name);
            for (phase, r) in auth_round(t, args.calls, &action, &blobs).await?.into_iter().enumerate() {
                results[i][phase].push(r);
            }
        }
    }
    let median = |v: &[PhaseResult], f: fn(&PhaseResult) -> f64| {
        let mut x: Vec<f64> = v.iter().map(f).collect();
        x.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
        x[x.len() / 2]
    };
    let rate = |c: usize, p: usize| median(&results[c][p], |r| r.per_second);
    let cpu = |c: usize, p: usize| median(&results[c][p], |r| r.server_cpu_us);
    println!("| configuration | GetActionResult (hit)/s | vs plaintext | server CPU µs/call | vs plaintext | FindMissingBlobs (100 digests)/s | vs plaintext | server CPU µs/call | vs plaintext |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (c, t) in targets.iter().enumerate() {
        let mut row = format!("| {} ", t.name);
        for p in 0..2 {
            row += &format!(
                "| {:.0} | {:.3}x | {:.1} | {:.3}x ",
                rate(c, p),
                rate(c, p) / rate(0, p),
                cpu(c, p),
                cpu(c, p) / cpu(0, p)
            );
        }
        println!("{row}|");
    }
    // What TLS adds per call, on gantry and on the floor, against what a 5% bound on the
    // whole of security (TLS and the token) allows on top of plaintext gantry.
    for (p, call) in ["GetActionResult", "FindMissingBlobs"].iter().enumerate() {
        println!(
            "{call}: TLS adds {:.1} µs of server CPU per call to gantry, and to the bare tonic server \
             ({:.1} µs plaintext there) {:.1} µs behind tonic's listener and {:.1} µs behind gantry's; \
             the token adds {:.1} µs; 5% of plaintext gantry is {:.1} µs",
            cpu(2, p) - cpu(1, p),
            cpu(3, p),
            cpu(4, p) - cpu(3, p),
            cpu(5, p) - cpu(3, p),
            cpu(1, p) - cpu(0, p),
            0.05 * cpu(0, p)
        );
    }
    let cpus = |v: &[usize]| if v.is_empty() { "any CPU".to_string() } else { format!("CPUs {v:?}") };
    println!(
        "({} clients on their own connections, {} calls each per round, median of {} alternating rounds; each server a `gantry serve` process of its own on {}, its CPU read from /proc; clients on {})",
        args.clients,
        args.calls,
        args.rounds,
        cpus(&args.server_cpus),
        cpus(&args.client_cpus)
    );
    Ok(())
}

/// UpdateActionResult then GetActionResult calls per second, per metadata database, each
/// behind the same in-process server stack `gantry serve` builds.
async fn ac(args: AcBenchArgs) -> anyhow::Result<()> {
    use gantry_core::reapi::action_cache_client::ActionCacheClient;
    anyhow::ensure!(args.clients > 0 && args.calls > 0, "--clients and --calls must be at least 1");
    let mut urls: Vec<Option<String>> = vec![None];
    urls.extend(args.metadata_urls.iter().cloned().map(Some));
    let mut rows = Vec::new();
    for url in &urls {
        let (target, _local) = bench_server(&None, Some(0), url).await?;
        let name = url.as_deref().map_or("embedded SQLite".to_string(), gantry_store::metadata_db::redact_url);
        eprintln!("gantry bench ac: {} clients x {} calls, metadata {name}", args.clients, args.calls);
        let run_id = uuid::Uuid::new_v4().to_string();
        // One connection per client, as separate Bazel processes would have.
        let mut clients = Vec::new();
        for _ in 0..args.clients {
            clients.push(ActionCacheClient::new(gantry_core::client::connect(&target).await?));
        }
        let digest = |c: usize, i: usize| DigestFunction::Sha256.digest_of(format!("{run_id}/{c}/{i}").as_bytes());
        let phase = |get: bool| {
            let clients = clients.clone();
            async move {
                let start = Instant::now();
                futures::future::try_join_all(clients.into_iter().enumerate().map(|(c, mut client)| async move {
                    for i in 0..args.calls {
                        let d = digest(c, i).to_proto();
                        if get {
                            let r = client
                                .get_action_result(reapi::GetActionResultRequest {
                                    action_digest: Some(d),
                                    ..Default::default()
                                })
                                .await?
                                .into_inner();
                            anyhow::ensure!(r.exit_code == (i % 7) as i32, "read back a different result");
                        } else {
                            let result = reapi::ActionResult {
                                exit_code: (i % 7) as i32,
                                stdout_raw: vec![b'x'; 64],
                                ..Default::default()
                            };
                            client
                                .update_action_result(reapi::UpdateActionResultRequest {
                                    action_digest: Some(d),
                                    action_result: Some(result),
                                    ..Default::default()
                                })
                                .await?;
                        }
                    }
                    Ok(())
                }))
                .await?;
                anyhow::Ok((args.clients * args.calls) as f64 / start.elapsed().as_secs_f64())
            }
        };
        let put = phase(false).await?;
        let get = phase(true).await?;
        rows.push((name, put, get));
    }
    let (base_put, base_get) = (rows[0].1, rows[0].2);
    println!("| metadata | UpdateActionResult/s | vs SQLite | GetActionResult/s | vs SQLite |");
    println!("|---|---|---|---|---|");
    for (name, put, get) in &rows {
        println!("| {name} | {put:.0} | {:.2}x | {get:.0} | {:.2}x |", put / base_put, get / base_get);
    }
    println!("({} clients on their own connections, {} calls each, loopback)", args.clients, args.calls);
    Ok(())
}

/// Writes a workspace of `n` genrules in 25 packages; each does a little real work and
/// some depend on others, like a small real build.
fn write_genrule_workspace(dir: &std::path::Path, n: usize) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("WORKSPACE"), "workspace(name = \"gantry_bench\")\n")?;
    std::fs::write(dir.join("BUILD"), "")?;
    let packages = 25;
    for p in 0..packages {
        let pkg = dir.join(format!("p{p}"));
        std::fs::create_dir_all(&pkg)?;
        let mut build = String::new();
        for i in (p..n).step_by(packages) {
            let dep = if i >= packages {
                format!("\"//p{}:g{}\"", (i - packages) % packages, i - packages)
            } else {
                String::new()
            };
            let srcs = if dep.is_empty() { String::new() } else { format!("    srcs = [{dep}],\n") };
            let cat = if dep.is_empty() { String::new() } else { "cat $(SRCS) > $@; ".to_string() };
            build.push_str(&format!(
                "genrule(\n    name = \"g{i}\",\n{srcs}    outs = [\"g{i}.txt\"],\n    cmd = \"{cat}seq 1 20000 | sha256sum >> $@; echo {i} >> $@\",\n)\n\n"
            ));
        }
        std::fs::write(pkg.join("BUILD"), build)?;
    }
    Ok(())
}

async fn bazel(args: BazelBenchArgs) -> anyhow::Result<()> {
    let fixtures = std::fs::canonicalize(&args.fixtures)
        .with_context(|| format!("--fixtures {} (run from the repository root)", args.fixtures.display()))?;
    let flags_text = std::fs::read_to_string(fixtures.join("bazel_flags.txt"))?;
    let base: Vec<String> = flags_text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with("--spawn_strategy"))
        .map(|l| l.replace("@FIXTURES@", &fixtures.display().to_string()))
        .collect();
    let tmp = tempfile::tempdir()?;
    let ws = tmp.path().join("ws");
    write_genrule_workspace(&ws, args.targets)?;
    let (target, _local) = bench_server(&None, None, &None).await?;
    let warm = args.warm;
    let bazel = |name: &str, cmd: &str, more: &[String]| -> anyhow::Result<std::process::Output> {
        let mut c = std::process::Command::new("bazel");
        if !warm {
            c.arg("--batch");
        }
        c.arg(format!("--output_user_root={}", tmp.path().join("ur").display()))
            .arg(format!("--output_base={}", tmp.path().join(format!("base-{name}")).display()))
            .args(["--nohome_rc", "--noworkspace_rc", cmd]);
        if cmd != "clean" && cmd != "shutdown" {
            c.args(&base);
        }
        c.args(more).current_dir(&ws).stdin(std::process::Stdio::null());
        c.output().context("running bazel")
    };
    let build = |name: &str, extra: &[String], salt: &str| -> anyhow::Result<f64> {
        let t = Instant::now();
        let mut more = extra.to_vec();
        more.push(format!("--action_env=GANTRY_BENCH_SALT={salt}"));
        more.push("//...".into());
        let out = bazel(name, "build", &more)?;
        let secs = t.elapsed().as_secs_f64();
        let err = String::from_utf8_lossy(&out.stderr);
        anyhow::ensure!(out.status.success(), "bazel build ({name}) failed:\n{err}");
        let summary = err.lines().rev().find(|l| l.contains(" processes")).unwrap_or("").to_string();
        eprintln!("    {secs:.1} s; {summary}");
        Ok(secs)
    };
    let remote =
        vec![format!("--remote_executor={target}"), "--spawn_strategy=remote".to_string(), "--jobs=16".to_string()];
    let local = vec!["--spawn_strategy=local".to_string()];
    let modes = [("local", &local), ("remote", &remote)];
    if warm {
        for (name, extra) in modes {
            eprintln!("  bazel build //... ({name}, warming the server up)...");
            build(name, extra, "warmup")?;
        }
    }
    // (local, remote) seconds per round, and the CPU this process (the server and its
    // in-process workers, not their spawners or commands) spent on each remote build:
    // a figure less at the mercy of the machine's speed than wall time.
    let mut rounds: Vec<(f64, f64)> = Vec::new();
    let mut server_cpu: Vec<f64> = Vec::new();
    for r in 1..=if warm { args.rounds.max(1) } else { 1 } {
        let mut secs = [0.0; 2];
        for (i, (name, extra)) in modes.iter().enumerate() {
            eprintln!("  bazel build //... ({name}, round {r})...");
            let cpu = if *name == "remote" { Some(process_cpu(std::process::id())?) } else { None };
            secs[i] = build(name, extra, &format!("measured-{r}"))?;
            if let Some(cpu) = cpu {
                server_cpu.push((process_cpu(std::process::id())? - cpu).as_secs_f64());
            }
        }
        rounds.push((secs[0], secs[1]));
    }
    bazel("remote", "clean", &[])?;
    eprintln!("  bazel build //... (remote, after bazel clean)...");
    let cached = build("remote", &remote, &format!("measured-{}", rounds.len()))?;
    if warm {
        for (name, _) in modes {
            bazel(name, "shutdown", &[])?;
        }
    }
    let mut by_ratio = rounds.clone();
    by_ratio.sort_by(|a, b| (a.1 / a.0).total_cmp(&(b.1 / b.0)));
    let (local, rx) = by_ratio[by_ratio.len() / 2];
    let how = if warm { "warm server, every action new" } else { "batch mode, includes JVM start" };
    println!("| {} genrules, Bazel 4.2.3 `build //...` ({how}) | wall time |", args.targets);
    println!("|---|---|");
    println!("| local (`--spawn_strategy=local`) | {local:.1} s |");
    println!("| gantry remote execution (in-process workers) | {rx:.1} s |");
    println!("| gantry cache after `bazel clean` | {cached:.1} s |");
    println!("| remote / local | {:.2}x |", rx / local);
    if rounds.len() > 1 {
        let each: Vec<String> = rounds.iter().map(|(l, r)| format!("{l:.1}/{r:.1} s = {:.2}x", r / l)).collect();
        let which = if rounds.len().is_multiple_of(2) { "the higher of the middle two" } else { "the median" };
        println!("\nrounds (local/remote), the table shows {which}: {}", each.join(", "));
    }
    let per_action: Vec<String> =
        server_cpu.iter().map(|c| format!("{:.2}", c * 1000.0 / args.targets as f64)).collect();
    println!("gantry's own CPU per remote action, by round: {} ms", per_action.join(", "));
    Ok(())
}

fn sizeclass(args: SizeclassBenchArgs) -> anyhow::Result<()> {
    use gantry_sizeclass::sim::{
        goals_table, parse_fleet, parse_trace, run_bench, run_suite, BenchConfig, SyntheticConfig, DEFAULT_FLEET,
        SECOND_FLEET,
    };
    let mut selection = gantry_sizeclass::SelectionConfig::default();
    if let Some(x) = args.exponent {
        selection.acceptable_time_exponent = x;
    }
    if let Some(h) = args.hedge_multiplier {
        selection.hedge_multiplier = h;
    }
    let workload = |name: &str| match name {
        "shifted" => SyntheticConfig::shifted(),
        "noisy" => SyntheticConfig::noisy(),
        _ => SyntheticConfig::default(),
    };
    let start = Instant::now();
    if let Some(spec) = &args.seeds {
        let seeds = parse_seeds(spec).context("--seeds")?;
        let fleets = if args.fleet.is_empty() { vec![DEFAULT_FLEET.into(), SECOND_FLEET.into()] } else { args.fleet };
        let fleets = fleets.iter().map(|f| parse_fleet(f)).collect::<Result<Vec<_>, _>>().context("--fleet")?;
        let names = if args.workload.is_empty() { vec!["default".into(), "shifted".into()] } else { args.workload };
        let workloads: Vec<(String, SyntheticConfig)> = names.iter().map(|n| (n.clone(), workload(n))).collect();
        let total = workloads.len() * fleets.len() * seeds.len();
        let mut done = 0;
        let runs = run_suite(&workloads, &fleets, &seeds, &selection, !args.queue_blind, |r| {
            done += 1;
            eprintln!("[{done}/{total}] {} on {}, seed {}: {}", r.workload, r.fleet, r.seed, goal_line(&r.report));
        })?;
        if args.json {
            println!("{}", serde_json::to_string(&runs)?);
        } else {
            print!("{}", goals_table(&runs));
            println!(
                "(x = {}, hedge multiplier = {}, {:.1} s)",
                selection.acceptable_time_exponent,
                selection.hedge_multiplier,
                start.elapsed().as_secs_f64()
            );
        }
        return Ok(());
    }
    let fleet = args.fleet.first().map_or(DEFAULT_FLEET, String::as_str);
    let mut cfg = BenchConfig {
        fleet: parse_fleet(fleet).context("--fleet")?,
        synthetic: SyntheticConfig {
            seed: args.seed,
            ..workload(args.workload.first().map_or("default", String::as_str))
        },
        selection,
        seed: args.seed,
        queue_aware: !args.queue_blind,
        ..BenchConfig::default()
    };
    if let Some(path) = &args.trace {
        let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        cfg.trace = Some(parse_trace(std::io::BufReader::new(f)).with_context(|| format!("trace {}", path.display()))?);
    }
    let report = run_bench(&cfg)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{report}");
        println!("(x = {}, {:.1} s)", cfg.selection.acceptable_time_exponent, start.elapsed().as_secs_f64());
    }
    Ok(())
}

fn goal_line(r: &gantry_sizeclass::sim::BenchReport) -> String {
    use gantry_sizeclass::sim::Policy;
    let l = Policy::Learned;
    format!(
        "cost {:.3} (oracle {:.3}), p95 {:.3}, mean {:.3}, lost {}",
        r.cost_ratio(l),
        r.cost_ratio(Policy::Oracle),
        r.p95_ratio(l),
        r.mean_ratio(l),
        r.policies.learned.lost
    )
}

/// "1-5" or "1,3,7".
fn parse_seeds(spec: &str) -> anyhow::Result<Vec<u64>> {
    let seeds: Vec<u64> = match spec.split_once('-') {
        Some((a, b)) => (a.trim().parse()?..=b.trim().parse()?).collect(),
        None => spec.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>()?,
    };
    anyhow::ensure!(!seeds.is_empty(), "no seeds in {spec:?}");
    Ok(seeds)
}
