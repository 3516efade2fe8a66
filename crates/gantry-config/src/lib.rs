//! gantry-config owns `gantry.toml`: the serde structs below *are* the configuration
//! reference (their doc comments are what users read), with human units for sizes
//! ("10GiB") and durations ("30s"). Unknown keys are rejected so a typo never silently
//! falls back to a default.
//!
//! Names stay in step with the code: `[cas] kind = "fs"` builds `FsStore` (fs_store.rs),
//! `kind = "memory"` builds `MemoryStore`, `[action_cache] kind = "sql"` builds
//! `SqlActionCache`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytesize::ByteSize;
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// The whole of `gantry.toml`. Every section is optional; an empty file (or no file)
/// runs on embedded defaults under `./gantry-data`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    /// The content-addressable store for blobs.
    pub cas: CasConfig,
    /// The metadata database every SQL store shares.
    pub metadata: MetadataConfig,
    /// Where ActionResults are kept.
    pub action_cache: ActionCacheConfig,
    /// The target batching service (`gantry.batch.v1.Batcher`).
    pub batch: BatchConfig,
    /// Remote execution: the scheduler and the in-process workers.
    pub execution: ExecutionConfig,
    /// The submit queue (`gantry.queue.v1.SubmitQueue`); off unless `repository` is set.
    pub queue: QueueConfig,
    /// How long metadata rows are kept, and how many.
    pub retention: RetentionConfig,
}

/// `[retention]`: bounds on the metadata database's history tables, applied by a
/// background task (`metadata-retention`) that deletes the oldest rows past a bound in
/// batches of `batch_size`, so no request waits behind one long delete. In a deployment
/// of several `gantry serve` on one PostgreSQL, every scheduler (not frontends) applies
/// them; deleting what another just deleted is harmless.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// How often the bounds are applied. Default "1m".
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Rows deleted per statement. Default 1000.
    pub batch_size: u32,
    /// Action cache entries, aged from their last write. An entry older than `max_age`
    /// is a cache miss even before it is deleted; its blobs are then evictable from the
    /// CAS as usual. Default 30 days, 5,000,000 entries.
    pub action_cache: RetentionBound,
    /// The execution log (metering per executed action), aged from completion.
    /// Default 30 days, 10,000,000 records.
    pub execution_log: RetentionBound,
    /// Finished builds of the batching service (its training history), aged from their
    /// end. Builds still queued or running are never deleted. Default 180 days, 1,000,000 builds.
    pub builds: RetentionBound,
}

/// One table's bounds; 0 turns a bound off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionBound {
    /// Rows older than this are deleted, e.g. "30days". "0s": no age bound.
    #[serde(with = "humantime_serde")]
    pub max_age: Duration,
    /// Past this many rows the oldest are deleted. 0: no count bound.
    pub max_rows: u64,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        const DAY: u64 = 24 * 3600;
        RetentionConfig {
            interval: Duration::from_secs(60),
            batch_size: 1000,
            action_cache: RetentionBound { max_age: Duration::from_secs(30 * DAY), max_rows: 5_000_000 },
            execution_log: RetentionBound { max_age: Duration::from_secs(30 * DAY), max_rows: 10_000_000 },
            builds: RetentionBound { max_age: Duration::from_secs(180 * DAY), max_rows: 1_000_000 },
        }
    }
}

/// `[queue]`: the submit queue. Builds run Bazel with the `[batch]` settings `bazel`,
/// `startup_flags`, `extra_flags`, `bazel_memory`, `kill_grace` and `remote_executor`
/// (by default this server's executor), in output bases of their own.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    /// The local git repository whose mainline the queue owns. Unset: no queue.
    pub repository: Option<PathBuf>,
    /// The mainline branch. Only the queue should move it. Default "main".
    pub mainline: String,
    /// Builds run at once (each in its own Bazel output base). Default 2.
    pub capacity: usize,
    /// A failing build is tried this many more times on the same tree before the failure
    /// is believed (flaky tests). Default 1.
    pub max_retries: u32,
    /// The build steps: empty runs `bazel test` of the affected targets (all of `//...`
    /// when a change alters the build graph) through gantry's executor; otherwise this
    /// command runs in the checked-out tree (`["sh", "-c", "make check"]`) and exit 0 passes.
    pub build_command: Vec<String>,
    /// A build still running this long is stopped and counts as failed. Default "30m".
    #[serde(with = "humantime_serde")]
    pub deadline: Duration,
    /// P(a change succeeds) before the queue has history to learn from. Default 0.9.
    pub prior_success: f64,
    /// P(two dependent changes conflict) before history exists. Default 0.05.
    pub prior_conflict: f64,
    /// Output bases and worktrees of the queue's builds. Default `{data_dir}/queue`.
    pub work_dir: Option<PathBuf>,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            repository: None,
            mainline: "main".into(),
            capacity: 2,
            max_retries: 1,
            build_command: Vec::new(),
            deadline: Duration::from_secs(30 * 60),
            prior_success: 0.9,
            prior_conflict: 0.05,
            work_dir: None,
        }
    }
}

/// `[execution]`: remote execution. `gantry serve` runs the scheduler (separate
/// `gantry worker` processes can connect to it) and starts in-process workers, unless
/// `scheduler` names another gantry: then it is a frontend.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExecutionConfig {
    /// Make this server a frontend of the scheduler at this address
    /// (`grpc://HOST:PORT`, another `gantry serve`): it serves the CAS, action cache and
    /// ByteStream itself, forwards Execute, WaitExecution and the Operations calls there,
    /// and runs no scheduler and no workers. Share `[metadata]` and the CAS with it.
    /// Unset: this server is a scheduler.
    pub scheduler: Option<String>,
    /// In-process workers (one action each at a time): a count (all size class 1), or a
    /// list of size classes, e.g. `[{size_class = 1, count = 2}, {size_class = 4, count = 1}]`.
    /// Default: the number of cores. 0 runs no local workers, only `gantry worker` processes.
    pub workers: Option<Workers>,
    /// Memory an action may use per unit of size class, enforced on in-process workers as
    /// an address-space limit (RLIMIT_AS) when no cgroup v2 hierarchy is delegated. Unset:
    /// actions are metered only.
    pub memory_per_size_class: Option<ByteSize>,
    /// CPUs an action is pinned to per unit of size class (sched_setaffinity). Unset: no
    /// pinning.
    pub cpus_per_size_class: Option<usize>,
    /// How the scheduler learns each action shape's size class.
    pub size_classes: SizeClassConfig,
    /// Platform properties of the in-process workers, on top of OSFamily=linux and
    /// ISA=x86-64 which every worker offers.
    pub properties: std::collections::BTreeMap<String, String>,
    /// Where workers run actions and keep their input cache. Default `{data_dir}/workers`.
    pub work_dir: Option<PathBuf>,
    /// Size of the workers' local input cache. Default "10GiB".
    pub cache_max_size: ByteSize,
    /// Times an action may lose its worker (crash, network) before it fails with
    /// UNAVAILABLE. Default 3.
    pub max_worker_losses: u32,
    /// A separate worker silent this long is considered lost. Default "15s".
    #[serde(with = "humantime_serde")]
    pub heartbeat_timeout: Duration,
    /// Timeout of actions that ask for none. Default "1h".
    #[serde(with = "humantime_serde")]
    pub default_timeout: Duration,
    /// Upper bound on any action's timeout. Default "3h".
    #[serde(with = "humantime_serde")]
    pub max_timeout: Duration,
    /// A worker that still heartbeats but has sent no result this long past an action's
    /// timeout (counted from when the action was handed to it) is told to cancel it, and
    /// the action is re-queued (counted as a worker loss). It must cover fetching the
    /// inputs, the kill, uploading the outputs and the report, so keep it generous for
    /// large inputs or outputs. Default "10m".
    #[serde(with = "humantime_serde")]
    pub timeout_grace: Duration,
    /// Finished operations stay visible to GetOperation/WaitExecution this long. Default "10m".
    #[serde(with = "humantime_serde")]
    pub completed_retention: Duration,
}

/// `workers = 4` or `workers = [{size_class = 1, count = 2}, ...]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Workers {
    Count(usize),
    Classes(Vec<WorkerClass>),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerClass {
    pub size_class: u32,
    pub count: usize,
}

impl Workers {
    /// (size class, count) pairs.
    pub fn classes(&self) -> Vec<(u32, usize)> {
        match self {
            Workers::Count(n) => vec![(1, *n)],
            Workers::Classes(v) => v.iter().map(|c| (c.size_class, c.count)).collect(),
        }
    }
}

/// `[execution.size_classes]`: learning the cheapest acceptable size class per action
/// shape (see README, "Size classes").
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SizeClassConfig {
    /// Outcomes kept per action shape and size class. Default 32.
    pub history_size: usize,
    /// After a failure on the largest class, run the shape there for this long. Default "24h".
    #[serde(with = "humantime_serde")]
    pub failure_cache_duration: Duration,
    /// Timeout of probes and floor of smaller-class timeouts. Default "10s".
    #[serde(with = "humantime_serde")]
    pub minimum_execution_timeout: Duration,
    /// x in acceptable time = median on largest x (largest/S)^x. Default 0.5.
    pub acceptable_time_exponent: f64,
    /// Smaller-class timeout = acceptable time x this. Default 1.5.
    pub timeout_multiplier: f64,
    /// Seed of the selection draws; unset draws from the OS. Set it for reproducible runs.
    pub seed: Option<u64>,
}

impl Default for SizeClassConfig {
    fn default() -> Self {
        SizeClassConfig {
            history_size: 32,
            failure_cache_duration: Duration::from_secs(24 * 3600),
            minimum_execution_timeout: Duration::from_secs(10),
            acceptable_time_exponent: 0.5,
            timeout_multiplier: 1.5,
            seed: None,
        }
    }
}

impl Default for ExecutionConfig {
    fn default() -> Self {
        ExecutionConfig {
            scheduler: None,
            workers: None,
            memory_per_size_class: None,
            cpus_per_size_class: None,
            size_classes: SizeClassConfig::default(),
            properties: Default::default(),
            work_dir: None,
            cache_max_size: ByteSize::gib(10),
            max_worker_losses: 3,
            heartbeat_timeout: Duration::from_secs(15),
            default_timeout: Duration::from_secs(3600),
            max_timeout: Duration::from_secs(3 * 3600),
            timeout_grace: Duration::from_secs(600),
            completed_retention: Duration::from_secs(600),
        }
    }
}

/// `[server]`: listeners, data directory and protocol limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// gRPC address for every REAPI service. Default `127.0.0.1:8980`.
    pub listen: SocketAddr,
    /// HTTP address for `/metrics` (Prometheus text) and `/healthz`. Default `127.0.0.1:9090`.
    pub http_listen: SocketAddr,
    /// Directory for the embedded stores (filesystem CAS, SQLite). Default `./gantry-data`.
    pub data_dir: PathBuf,
    /// Largest total size of a BatchUpdateBlobs/BatchReadBlobs request, advertised to
    /// clients in GetCapabilities. Larger blobs go through ByteStream. Default "4MiB".
    pub max_batch_size: ByteSize,
    /// Size of the chunks ByteStream.Read sends. Default "1MiB".
    pub read_chunk_size: ByteSize,
    /// How long a resumable upload that receives no data is kept before it is dropped.
    /// Default "10m".
    #[serde(with = "humantime_serde")]
    pub upload_idle_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:8980".parse().expect("valid default"),
            http_listen: "127.0.0.1:9090".parse().expect("valid default"),
            data_dir: PathBuf::from("./gantry-data"),
            max_batch_size: ByteSize::mib(4),
            read_chunk_size: ByteSize::mib(1),
            upload_idle_timeout: Duration::from_secs(600),
        }
    }
}

/// `[cas]`: the blob store. Every write is hashed and checked against its digest
/// whatever the backend.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum CasConfig {
    /// `kind = "fs"`: blobs as files under sharded directories, written atomically
    /// (temp file, verify, fsync, rename), evicted least-recently-used past `max_size`.
    Fs(FsStoreConfig),
    /// `kind = "memory"`: blobs in RAM, evicted least-recently-used past `max_size`.
    /// Lost on restart; for tests and small fast tiers.
    Memory(MemoryStoreConfig),
}

impl Default for CasConfig {
    fn default() -> Self {
        CasConfig::Fs(FsStoreConfig::default())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FsStoreConfig {
    /// Directory of the store. Default `{data_dir}/cas`.
    pub path: Option<PathBuf>,
    /// Size past which the least recently used blobs are evicted. Default "10GiB".
    pub max_size: ByteSize,
}

impl Default for FsStoreConfig {
    fn default() -> Self {
        FsStoreConfig { path: None, max_size: ByteSize::gib(10) }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemoryStoreConfig {
    /// Size past which the least recently used blobs are evicted. Default "1GiB".
    pub max_size: ByteSize,
}

impl Default for MemoryStoreConfig {
    fn default() -> Self {
        MemoryStoreConfig { max_size: ByteSize::gib(1) }
    }
}

/// `[metadata]`: the SQL database holding everything that is not a blob: the action
/// cache, the execution log, size-class statistics, batch builds and the submit queue.
/// Several `gantry serve` processes may share one PostgreSQL database.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetadataConfig {
    /// `sqlite://PATH` (embedded, one host) or `postgres://USER:PASSWORD@HOST:5432/DB`.
    /// Default `sqlite://{data_dir}/metadata.db` (created if missing). The password never
    /// appears in gantry's messages; it may also come from the `PGPASSWORD` environment
    /// variable instead of the URL.
    pub url: Option<String>,
    /// Connections in the pool shared by every store. Default 8.
    pub max_connections: u32,
    /// How long to wait for a connection (at startup, and from a busy pool) before the
    /// request fails with UNAVAILABLE. Default "10s".
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
}

impl Default for MetadataConfig {
    fn default() -> Self {
        MetadataConfig { url: None, max_connections: 8, connect_timeout: Duration::from_secs(10) }
    }
}

/// `[action_cache]`: ActionResults, keyed by instance name and action digest.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ActionCacheConfig {
    /// `kind = "sql"`: a table in an SQL database through sqlx.
    Sql(SqlActionCacheConfig),
}

impl Default for ActionCacheConfig {
    fn default() -> Self {
        ActionCacheConfig::Sql(SqlActionCacheConfig::default())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SqlActionCacheConfig {
    /// No longer read: the database is `[metadata] url`. Kept only to say so clearly.
    #[doc(hidden)]
    pub url: Option<String>,
    /// Serve an entry only while every blob it references is still in the CAS
    /// (outputs, output trees and their files, stdout, stderr). Default true.
    pub completeness_check: bool,
}

impl Default for SqlActionCacheConfig {
    fn default() -> Self {
        SqlActionCacheConfig { url: None, completeness_check: true }
    }
}

/// `[batch]`: how the batching service cuts a stream of targets into builds. Sizes in
/// decimal units ("7GB" is 7,000,000,000 bytes), as the cutoffs are usually quoted.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BatchConfig {
    /// Trained models (`gantry model train --out DIR`). Default `{data_dir}/models`.
    /// Without models every batch has `fallback_batch_size` targets and reason
    /// MEMORY_ESTIMATE_ERROR.
    pub model_dir: Option<PathBuf>,
    /// Most targets in one build. Default 900.
    pub max_targets_per_batch: usize,
    /// Targets per build when a model cannot answer. Default 300.
    pub fallback_batch_size: usize,
    /// Heap given to each Bazel process; above it a build runs out of memory. Default "13GB".
    pub bazel_memory: ByteSize,
    /// Predicted-memory cutoff for HIGH priority builds. Default "7GB".
    pub memory_cutoff_high: ByteSize,
    /// Predicted-memory cutoff for MEDIUM priority builds. Default "9GB".
    pub memory_cutoff_medium: ByteSize,
    /// Predicted-memory cutoff for LOW priority builds. Default "10GB".
    pub memory_cutoff_low: ByteSize,
    /// Predicted executor occupancy (ESU) a build must stay under. Default 500.
    pub occupancy_cutoff_esu: f64,
    /// Executor occupancy (ESU) past which a build misses its deadline. Default 600.
    pub occupancy_limit_esu: f64,
    /// Extra tag -> executor type mappings, added to `requires-gpu` -> gpu and
    /// `requires-mac` -> mac.
    pub tag_executor_types: std::collections::BTreeMap<String, String>,
    /// Extra rule kind -> executor types mappings, used when no tag says otherwise;
    /// added to the built-in ones (`ios_ui_test` -> mac, ...).
    pub rule_kind_executor_types: std::collections::BTreeMap<String, Vec<String>>,
    /// Targets buffered, sorted and cut together per executor group of a stream.
    /// Bounds memory per request. Default 100000.
    pub stream_sort_window: usize,
    /// Bazel builds `gantry serve` runs at once, each in its own output base. 0: plan
    /// only (EnqueueTargets answers with builds and nobody runs them). Default 2.
    pub runners: usize,
    /// The Bazel binary. Default "bazel" (found on PATH).
    pub bazel: PathBuf,
    /// Bazel startup options put before the command, e.g. ["--nohome_rc"]. gantry adds
    /// `--output_base` (one per runner, reused between builds) and
    /// `--host_jvm_args=-Xmx{bazel_memory}` itself.
    pub startup_flags: Vec<String>,
    /// Flags put after every build's own flags, e.g. `--override_repository=...`.
    pub extra_flags: Vec<String>,
    /// A build still running this long after it started is stopped and recorded as
    /// DEADLINE_EXCEEDED. Default "30m".
    #[serde(with = "humantime_serde")]
    pub deadline: Duration,
    /// After the deadline, Bazel's server gets SIGTERM and this long to exit before
    /// SIGKILL (a JVM thrashing in GC ignores SIGTERM). Default "10s".
    #[serde(with = "humantime_serde")]
    pub kill_grace: Duration,
    /// Runners' output bases and git worktrees. Default `{data_dir}/runners`.
    pub runner_dir: Option<PathBuf>,
    /// `--remote_executor` given to Bazel. Default: this server's gRPC address.
    pub remote_executor: Option<String>,
    /// Which measurement is the memory label the models learn: "used_heap_post_build"
    /// (BEP usedHeapSizePostBuild, the default; see README for why), "peak_post_gc_heap"
    /// (BEP peakPostGcHeapSize) or "server_vm_hwm" (the Bazel server's peak RSS).
    pub memory_label: MemoryLabel,
    /// How often the models retrain from the build history; "0s" only on request
    /// (`gantry model train --server`). Default "10m".
    #[serde(with = "humantime_serde")]
    pub retrain_interval: Duration,
    /// Finished builds the history must hold before the first training; until then
    /// every build has `fallback_batch_size` targets. Default 20.
    pub min_history_builds: usize,
    /// Training windows: the long one feeds the main model, the short one tracks recent
    /// change. Defaults "17days" and "1day".
    #[serde(with = "humantime_serde")]
    pub long_window: Duration,
    #[serde(with = "humantime_serde")]
    pub short_window: Duration,
}

/// The measurement the memory model learns (`[batch] memory_label`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum MemoryLabel {
    #[default]
    UsedHeapPostBuild,
    PeakPostGcHeap,
    ServerVmHwm,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            model_dir: None,
            max_targets_per_batch: 900,
            fallback_batch_size: 300,
            bazel_memory: ByteSize::gb(13),
            memory_cutoff_high: ByteSize::gb(7),
            memory_cutoff_medium: ByteSize::gb(9),
            memory_cutoff_low: ByteSize::gb(10),
            occupancy_cutoff_esu: 500.0,
            occupancy_limit_esu: 600.0,
            tag_executor_types: Default::default(),
            rule_kind_executor_types: Default::default(),
            stream_sort_window: 100_000,
            runners: 2,
            bazel: PathBuf::from("bazel"),
            startup_flags: Vec::new(),
            extra_flags: Vec::new(),
            deadline: Duration::from_secs(30 * 60),
            kill_grace: Duration::from_secs(10),
            runner_dir: None,
            remote_executor: None,
            memory_label: MemoryLabel::UsedHeapPostBuild,
            retrain_interval: Duration::from_secs(600),
            min_history_builds: 20,
            long_window: Duration::from_secs(17 * 86_400),
            short_window: Duration::from_secs(86_400),
        }
    }
}

impl Config {
    /// Directory of the workers, resolved against `data_dir`.
    pub fn worker_dir(&self) -> PathBuf {
        self.execution.work_dir.clone().unwrap_or_else(|| self.server.data_dir.join("workers"))
    }

    /// Directory of the batch runners, resolved against `data_dir`.
    pub fn batch_runner_dir(&self) -> PathBuf {
        self.batch.runner_dir.clone().unwrap_or_else(|| self.server.data_dir.join("runners"))
    }

    /// Directory of the submit queue's builds, resolved against `data_dir`.
    pub fn queue_work_dir(&self) -> PathBuf {
        self.queue.work_dir.clone().unwrap_or_else(|| self.server.data_dir.join("queue"))
    }

    /// Directory of the batching models, resolved against `data_dir`.
    pub fn batch_model_dir(&self) -> PathBuf {
        self.batch.model_dir.clone().unwrap_or_else(|| self.server.data_dir.join("models"))
    }

    /// Parses a config from TOML text; `path` only names the source in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let cfg: Config =
            toml::from_str(text).map_err(|e| ConfigError::Parse { path: path.to_owned(), message: e.to_string() })?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        Self::parse(&text, path)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let s = &self.server;
        if s.max_batch_size.as_u64() < 64 * 1024 {
            return Err(ConfigError::Invalid(format!(
                "server.max_batch_size {} is below the minimum of 64KiB",
                s.max_batch_size
            )));
        }
        if s.read_chunk_size.as_u64() == 0 || s.read_chunk_size.as_u64() > s.max_batch_size.as_u64() {
            // Read responses share the message size limit derived from max_batch_size.
            return Err(ConfigError::Invalid(format!(
                "server.read_chunk_size {} must be between 1B and server.max_batch_size ({})",
                s.read_chunk_size, s.max_batch_size
            )));
        }
        if let Some(Workers::Classes(v)) = &self.execution.workers {
            if let Some(c) = v.iter().find(|c| c.size_class == 0) {
                return Err(ConfigError::Invalid(format!(
                    "execution.workers: size_class must be at least 1 (found {} with count {})",
                    c.size_class, c.count
                )));
            }
        }
        if let Some(s) = &self.execution.scheduler {
            if !s.starts_with("grpc://") || s.len() <= "grpc://".len() {
                return Err(ConfigError::Invalid(format!("execution.scheduler {s:?}: expected grpc://HOST:PORT")));
            }
            if self.execution.workers.as_ref().is_some_and(|w| w.classes().iter().any(|(_, n)| *n > 0)) {
                return Err(ConfigError::Invalid(
                    "execution.workers: a frontend (execution.scheduler is set) runs no workers; start them beside the scheduler".into(),
                ));
            }
        }
        let b = &self.batch;
        if b.runners > 0 && b.deadline.is_zero() {
            return Err(ConfigError::Invalid("batch.deadline must be greater than zero".into()));
        }
        if b.long_window < b.short_window || b.short_window.is_zero() {
            return Err(ConfigError::Invalid(format!(
                "batch.short_window ({:?}) must be non-zero and not longer than batch.long_window ({:?})",
                b.short_window, b.long_window
            )));
        }
        if b.startup_flags.iter().any(|f| f.starts_with("--output_base") || f.starts_with("--output_user_root")) {
            return Err(ConfigError::Invalid(
                "batch.startup_flags: --output_base/--output_user_root are set by gantry per runner".into(),
            ));
        }
        let q = &self.queue;
        if q.repository.is_some() {
            if q.capacity == 0 {
                return Err(ConfigError::Invalid("queue.capacity must be at least 1".into()));
            }
            if q.mainline.trim().is_empty() || q.mainline.starts_with('-') || q.mainline.contains(char::is_whitespace) {
                return Err(ConfigError::Invalid(format!("queue.mainline {:?} is not a branch name", q.mainline)));
            }
            if q.deadline.is_zero() {
                return Err(ConfigError::Invalid("queue.deadline must be greater than zero".into()));
            }
        }
        for (name, p) in [("queue.prior_success", q.prior_success), ("queue.prior_conflict", q.prior_conflict)] {
            if !(0.0..=1.0).contains(&p) {
                return Err(ConfigError::Invalid(format!("{name} {p} must be a probability between 0 and 1")));
            }
        }
        let ActionCacheConfig::Sql(sql) = &self.action_cache;
        if sql.url.is_some() {
            return Err(ConfigError::Invalid(
                "action_cache.url has moved: set the database as [metadata] url (it holds every store, not only the action cache)"
                    .into(),
            ));
        }
        if self.metadata.max_connections == 0 {
            return Err(ConfigError::Invalid("metadata.max_connections must be at least 1".into()));
        }
        if let Some(url) = &self.metadata.url {
            if !["sqlite:", "postgres:", "postgresql:"].iter().any(|p| url.starts_with(p)) {
                let scheme = url.split(':').next().unwrap_or("");
                return Err(ConfigError::Invalid(format!(
                    "metadata.url: scheme '{scheme}' is not supported; use sqlite://PATH or postgres://USER@HOST:PORT/DB"
                )));
            }
        }
        let max = match &self.cas {
            CasConfig::Fs(f) => f.max_size,
            CasConfig::Memory(m) => m.max_size,
        };
        if max.as_u64() == 0 {
            return Err(ConfigError::Invalid("cas.max_size must be greater than zero".into()));
        }
        let r = &self.retention;
        if r.interval.is_zero() {
            return Err(ConfigError::Invalid("retention.interval must be greater than zero".into()));
        }
        if r.batch_size == 0 {
            return Err(ConfigError::Invalid("retention.batch_size must be at least 1".into()));
        }
        Ok(())
    }

    /// Directory of the filesystem CAS, resolved against `data_dir`.
    pub fn fs_cas_path(&self, fs: &FsStoreConfig) -> PathBuf {
        fs.path.clone().unwrap_or_else(|| self.server.data_dir.join("cas"))
    }

    /// URL of the metadata database, resolved against `data_dir`.
    pub fn metadata_url(&self) -> String {
        self.metadata.url.clone().unwrap_or_else(|| format!("sqlite://{}", self.server.data_dir.join("metadata.db").display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::parse(s, Path::new("test.toml"))
    }

    #[test]
    fn empty_config_is_embedded_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.server.listen.to_string(), "127.0.0.1:8980");
        assert_eq!(c.server.http_listen.to_string(), "127.0.0.1:9090");
        assert!(matches!(c.cas, CasConfig::Fs(ref f) if f.max_size == ByteSize::gib(10)));
        assert_eq!(c.metadata_url(), "sqlite://./gantry-data/metadata.db");
    }

    #[test]
    fn human_units() {
        let c = parse("[server]\nmax_batch_size = \"2MiB\"\nupload_idle_timeout = \"90s\"\n[cas]\nkind = \"memory\"\nmax_size = \"512MiB\"\n").unwrap();
        assert_eq!(c.server.max_batch_size.as_u64(), 2 << 20);
        assert_eq!(c.server.upload_idle_timeout, Duration::from_secs(90));
        assert!(matches!(c.cas, CasConfig::Memory(ref m) if m.max_size.as_u64() == 512 << 20));
    }

    #[test]
    fn unknown_keys_are_rejected_everywhere() {
        for bad in [
            "lisen = \"x\"",
            "[server]\nlisten_addr = \"127.0.0.1:1\"",
            "[cas]\nkind = \"fs\"\nmax_sise = \"1GiB\"",
            "[cas]\nkind = \"s3\"",
            "[action_cache]\nkind = \"sql\"\ncompleteness = false",
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("test.toml"), "{bad}: {e}");
            assert!(e.contains("unknown"), "{bad}: {e}");
        }
    }

    #[test]
    fn workers_as_count_or_size_classes() {
        let c = parse("[execution]\nworkers = 3").unwrap();
        assert_eq!(c.execution.workers.unwrap().classes(), vec![(1, 3)]);
        let c = parse("[execution]\nworkers = [{size_class = 1, count = 2}, {size_class = 4, count = 1}]\nmemory_per_size_class = \"512MiB\"").unwrap();
        assert_eq!(c.execution.workers.unwrap().classes(), vec![(1, 2), (4, 1)]);
        assert_eq!(c.execution.memory_per_size_class.unwrap().as_u64(), 512 << 20);
        assert!(parse("[execution]\nworkers = [{size_class = 0, count = 1}]").unwrap_err().to_string().contains("size_class"));
        assert!(parse("[execution.size_classes]\nexponent = 0.2").is_err());
    }

    #[test]
    fn invalid_values_are_rejected() {
        assert!(parse("[server]\nmax_batch_size = \"1KiB\"").unwrap_err().to_string().contains("max_batch_size"));
        assert!(parse("[cas]\nkind = \"memory\"\nmax_size = \"0B\"").unwrap_err().to_string().contains("max_size"));
        assert!(parse("[server]\nlisten = \"nope\"").is_err());
        let e = parse("[action_cache]\nkind = \"sql\"\nurl = \"sqlite://x.db\"").unwrap_err().to_string();
        assert!(e.contains("[metadata] url"), "{e}");
        let e = parse("[metadata]\nurl = \"mysql://u:pw@h/db\"").unwrap_err().to_string();
        assert!(e.contains("mysql") && !e.contains("pw@"), "{e}");
        assert!(parse("[metadata]\nmax_connections = 0").unwrap_err().to_string().contains("max_connections"));
    }

    #[test]
    fn frontend_of_a_scheduler() {
        let c = parse("[execution]\nscheduler = \"grpc://10.0.0.5:8980\"").unwrap();
        assert_eq!(c.execution.scheduler.as_deref(), Some("grpc://10.0.0.5:8980"));
        assert!(parse("[execution]\nscheduler = \"10.0.0.5:8980\"").unwrap_err().to_string().contains("grpc://"));
        let e = parse("[execution]\nscheduler = \"grpc://h:1\"\nworkers = 2").unwrap_err().to_string();
        assert!(e.contains("runs no workers"), "{e}");
        assert!(parse("[execution]\nscheduler = \"grpc://h:1\"\nworkers = 0").is_ok());
    }

    #[test]
    fn metadata_section() {
        let c = parse("[metadata]\nurl = \"postgres://gantry@db:5432/gantry\"\nmax_connections = 32\nconnect_timeout = \"3s\"").unwrap();
        assert_eq!(c.metadata_url(), "postgres://gantry@db:5432/gantry");
        assert_eq!(c.metadata.max_connections, 32);
        assert_eq!(c.metadata.connect_timeout, Duration::from_secs(3));
    }

    #[test]
    fn retention_section() {
        let c = parse("[retention]\ninterval = \"10s\"\n[retention.execution_log]\nmax_age = \"7days\"\nmax_rows = 0").unwrap();
        assert_eq!(c.retention.interval, Duration::from_secs(10));
        assert_eq!(c.retention.execution_log, RetentionBound { max_age: Duration::from_secs(7 * 86400), max_rows: 0 });
        assert_eq!(c.retention.action_cache, RetentionConfig::default().action_cache, "untouched tables keep their defaults");
        let err = |t: &str| parse(t).unwrap_err().to_string();
        assert!(err("[retention.builds]\nmax_age = \"1d\"").contains("max_rows"), "a bound names both limits");
        assert!(err("[retention.action_cache]\nmax_age = \"1d\"\nmax_rows = 1\nmax_bytes = 1").contains("unknown"));
        assert!(err("[retention]\nbatch_size = 0").contains("retention.batch_size"));
        assert!(err("[retention]\ninterval = \"0s\"").contains("retention.interval"));
    }

    #[test]
    fn queue_section() {
        assert!(Config::default().queue.repository.is_none(), "the queue is off by default");
        let c = parse("[queue]\nrepository = \"/r\"\nmainline = \"trunk\"\ncapacity = 4\ndeadline = \"5m\"").unwrap();
        assert_eq!((c.queue.mainline.as_str(), c.queue.capacity), ("trunk", 4));
        assert_eq!(c.queue.deadline, Duration::from_secs(300));
        let err = |t: &str| parse(t).unwrap_err().to_string();
        assert!(err("[queue]\nrepository = \"/r\"\ncapacity = 0").contains("queue.capacity"));
        assert!(err("[queue]\nrepository = \"/r\"\nmainline = \"a b\"").contains("queue.mainline"));
        assert!(err("[queue]\nprior_success = 1.5").contains("queue.prior_success"));
        assert!(err("[queue]\ncapcity = 2").contains("capcity"));
    }
}
