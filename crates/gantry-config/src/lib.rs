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
    /// Authentication and authorization. Absent: every caller may do everything (keep
    /// such a server on loopback or a trusted network).
    pub auth: Option<AuthConfig>,
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
    /// Invocations received by the Build Event Service, aged from their start.
    /// Default 90 days, 1,000,000 invocations.
    pub invocations: RetentionBound,
    /// The submit queue's history: decided changes (aged from their decision), with
    /// their landings, and finished queue builds (aged from their end), `max_rows` each.
    /// Pending changes, and whatever the queue's planner still refers to, are never
    /// deleted. Applied by the queue itself, every `interval`. Default 180 days,
    /// 1,000,000 changes and 1,000,000 builds.
    pub queue: RetentionBound,
    /// Journal entries after which the submit queue saves its planner and deletes the
    /// entries before that snapshot, so a restart replays at most about this many.
    /// Default 1000; 0 keeps the whole journal.
    pub queue_journal: u64,
    /// Target graphs the submit queue keeps cached (one per commit it analysed), the
    /// ones stored last; an older one is queried again if a change needs it. Default
    /// 1000; 0: no bound.
    pub queue_graphs: u64,
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
            invocations: RetentionBound { max_age: Duration::from_secs(90 * DAY), max_rows: 1_000_000 },
            queue: RetentionBound { max_age: Duration::from_secs(180 * DAY), max_rows: 1_000_000 },
            queue_journal: 1000,
            queue_graphs: 1000,
        }
    }
}

/// `[auth]`: who may call gantry and what each may do. Credentials are bearer tokens
/// (`authorization: Bearer TOKEN`, Bazel's `--remote_header=Authorization=Bearer TOKEN`)
/// configured by their SHA-256, so this file holds no secret (`gantry auth token` mints
/// one and prints its line).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Permissions of calls that carry no credentials, on every instance, e.g.
    /// `["read"]`. Default none: such calls are UNAUTHENTICATED.
    pub anonymous: Vec<String>,
    /// Client credentials: `[[auth.tokens]] name = "ci", sha256 = "…", grants = ["ci"]`.
    pub tokens: Vec<TokenConfig>,
    /// Client identities from verified client certificates (`[server.tls] client_ca`):
    /// `[[auth.certificates]] name = "ci", dns_name = "ci.build.internal", grants = ["ci"]`
    /// matches a certificate with that DNS subject alternative name. A bearer token, when
    /// sent, takes precedence.
    pub certificates: Vec<CertificateConfig>,
    /// Named grants: `[auth.grants.dev] instances = ["main", "dev/*"],
    /// permissions = ["read", "write_cas", "execute"]`. Permissions: read, write_cas,
    /// write_ac, execute, batch, queue, admin.
    pub grants: std::collections::BTreeMap<String, GrantConfig>,
    /// Credentials of `gantry worker` processes. Only these may register a worker, and
    /// they may call nothing else.
    pub workers: WorkerAuthConfig,
    /// JSON Web Tokens as bearer credentials, verified against a JWKS file.
    pub jwt: Option<JwtConfig>,
}

/// `[auth.jwt]`: a bearer credential that is a JWT is verified against the keys of
/// `jwks` (a JWKS file, read at startup), with its issuer, audience and expiry checked;
/// its `grants_claim` names the grants it has.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    pub jwks: PathBuf,
    /// Required `iss`.
    pub issuer: String,
    /// Required in `aud`.
    pub audience: String,
    /// The claim listing grant names (a string array). Default "gantry_grants".
    #[serde(default = "default_grants_claim")]
    pub grants_claim: String,
    /// The claim naming the caller in logs and refusals. Default "sub".
    #[serde(default = "default_name_claim")]
    pub name_claim: String,
}

fn default_grants_claim() -> String {
    "gantry_grants".into()
}

fn default_name_claim() -> String {
    "sub".into()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// Shown in logs and refusals.
    pub name: String,
    /// Hex SHA-256 of the token.
    pub sha256: String,
    /// Names of `[auth.grants.*]` this token has.
    #[serde(default)]
    pub grants: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantConfig {
    /// Instance names: `*`, a name (`""` is the default instance), or `prefix/*`.
    pub instances: Vec<String>,
    pub permissions: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerAuthConfig {
    /// `[[auth.workers.tokens]] name = "pool-a", sha256 = "…"`.
    pub tokens: Vec<WorkerTokenConfig>,
    /// `[[auth.workers.certificates]] name = "pool-a", dns_name = "workers.build.internal"`.
    pub certificates: Vec<WorkerCertificateConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertificateConfig {
    pub name: String,
    /// A DNS name the client certificate carries in its subject alternative names.
    pub dns_name: String,
    #[serde(default)]
    pub grants: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerCertificateConfig {
    pub name: String,
    pub dns_name: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerTokenConfig {
    pub name: String,
    pub sha256: String,
}

/// The permission names `[auth]` accepts.
pub const PERMISSIONS: [&str; 7] = ["read", "write_cas", "write_ac", "execute", "batch", "queue", "admin"];

/// `[queue]`: the submit queue. Builds run Bazel with the `[batch]` settings `bazel`,
/// `startup_flags`, `extra_flags`, `bazel_memory`, `kill_grace`, `gc_spiral_window` and
/// `remote_executor` (by default this server's executor), in output bases of their own.
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
    /// Batching: under a backlog, build several queued changes as one tree, land them
    /// all in one mainline move when it passes, and bisect it when it fails. Each change
    /// keeps its own commit in history, but the commits inside a batch were not built on
    /// their own: keep this off (the default) where every commit must have been built.
    /// Fixed when the queue is created, like `max_retries` and the priors.
    pub batching: bool,
    /// Learning: a change queued behind undecided changes it may conflict with also gets
    /// a build on the mainline alone when slots are free (not under a backlog), so the
    /// queue learns whether it fails on its own before speculating on the changes behind
    /// it. Costs about one build per such change; decides nothing by itself. Default on.
    /// Fixed when the queue is created.
    pub learn_alone: bool,
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
            batching: false,
            learn_alone: true,
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
    /// `limits` says. Unset: actions are metered only.
    pub memory_per_size_class: Option<ByteSize>,
    /// CPUs an action may use per unit of size class: it is pinned to that many
    /// (sched_setaffinity, which tools read to size their thread pools) and, with cgroups,
    /// held to that much CPU time. Unset: neither.
    pub cpus_per_size_class: Option<usize>,
    /// How in-process workers enforce the limits above and meter actions. Default "auto".
    pub limits: LimitEnforcement,
    /// How the scheduler learns each action shape's size class.
    pub size_classes: SizeClassConfig,
    /// Platform properties of the in-process workers, on top of OSFamily=linux and
    /// ISA=x86-64 which every worker offers.
    pub properties: std::collections::BTreeMap<String, String>,
    /// Where workers run actions and keep their input cache. Default `{data_dir}/workers`.
    pub work_dir: Option<PathBuf>,
    /// Size of the workers' local input cache, and half as much again for executable
    /// inputs (kept apart, since hard links share a mode). Default "10GiB".
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

/// How a worker enforces its size class's memory and CPU limits (`[execution] limits`,
/// `gantry worker --limits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LimitEnforcement {
    /// A cgroup per action where this machine allows one (v2 where a hierarchy with the
    /// memory controller is delegated to gantry, else v1 `memory` and `cpu` under the
    /// worker's own cgroups), else RLIMIT_AS as the last resort, with a warning at startup.
    #[default]
    Auto,
    /// cgroups only: a worker that cannot use them does not start.
    Cgroup,
    /// An address-space limit (RLIMIT_AS) and CPU pinning, without cgroups. Breaks
    /// runtimes that reserve address space up front (the JVM, Go).
    Rlimit,
}

impl std::str::FromStr for LimitEnforcement {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(LimitEnforcement::Auto),
            "cgroup" => Ok(LimitEnforcement::Cgroup),
            "rlimit" => Ok(LimitEnforcement::Rlimit),
            _ => Err(format!("'{s}' is not one of auto, cgroup, rlimit")),
        }
    }
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
    /// When a new shape's first run, on a class taken from similar shapes, is hedged on
    /// the largest class. Default "10s".
    #[serde(with = "humantime_serde")]
    pub minimum_execution_timeout: Duration,
    /// The knob that trades cost for tail latency: class S is accepted when it completes
    /// within (largest-class completion) x (largest/S)^x. 0 accepts no slowdown. Default 0.1.
    pub acceptable_time_exponent: f64,
    /// A run on a smaller class still going at its acceptable time x this gets a second
    /// copy on the largest class; the first to finish wins. A shape whose run times vary
    /// more gets more: exp(2 x their robust standard deviation in log terms), at most 3.
    /// Default 1.2.
    pub hedge_multiplier: f64,
    /// Probability of running a shape on the fitting class just below its learned one,
    /// so that a shape whose behaviour changed is noticed; a fifth of it more re-measures
    /// the class just above. 0 turns both off; at most 0.5. Default 0.05.
    pub exploration_factor: f64,
    /// Seed of the selection draws; unset draws from the OS. Set it for reproducible runs.
    pub seed: Option<u64>,
    /// Action shapes whose statistics the scheduler keeps in memory; others are read from
    /// the metadata database when next used. Default 100000.
    pub cached_shapes: usize,
}

impl Default for SizeClassConfig {
    fn default() -> Self {
        SizeClassConfig {
            history_size: 32,
            failure_cache_duration: Duration::from_secs(24 * 3600),
            minimum_execution_timeout: Duration::from_secs(10),
            acceptable_time_exponent: 0.1,
            hedge_multiplier: 1.2,
            exploration_factor: 0.05,
            seed: None,
            cached_shapes: 100_000,
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
            limits: LimitEnforcement::Auto,
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
    /// Largest Action, Command or Directory blob the server reads on a client's behalf
    /// (Execute, GetTree): naming a huge blob must not make the server buffer it.
    /// Default "4MiB".
    pub max_proto_size: ByteSize,
    /// Uploads (ByteStream writes) one client may have in progress at once: an
    /// authenticated identity, or an address for anonymous callers. Default 1000.
    pub max_uploads_per_client: usize,
    /// Bytes that all uploads in progress may hold in memory, and one client a quarter
    /// of it. Past that, idle uploads are spilled to disk (or dropped, when the CAS
    /// cannot spill them; their clients start them over). Default "512MiB".
    pub max_upload_memory: ByteSize,
    /// TLS on both listeners. Absent: plaintext (keep such a server on a trusted network).
    pub tls: Option<TlsConfig>,
}

/// `[server.tls]`: PEM files, re-read on SIGHUP so a renewed certificate needs no restart.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// The server's certificate chain.
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// Verify client certificates against this CA (mTLS). Unset: no client certificates.
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: "required" (the default; a client without a certificate is
    /// refused at the handshake) or "optional" (a client may instead authenticate with
    /// a token, e.g. developers with tokens and workers with certificates; a certificate
    /// that is presented must still verify).
    #[serde(default)]
    pub client_certificates: ClientCertificates,
}

/// `[server.tls] client_certificates`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ClientCertificates {
    #[default]
    Required,
    Optional,
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
            max_proto_size: ByteSize::mib(4),
            max_uploads_per_client: 1000,
            max_upload_memory: ByteSize::mib(512),
            tls: None,
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
    /// `kind = "s3"`: blobs as objects in an S3-compatible bucket, shared by every
    /// `gantry serve` of a deployment, optionally behind a local filesystem tier
    /// (`[cas.local]`). Credentials come only from the standard AWS environment
    /// variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`),
    /// the shared credentials file (`~/.aws/credentials`, profile `AWS_PROFILE` or
    /// `default`), web identity, or the instance/container metadata service; never
    /// from gantry.toml.
    S3(S3StoreConfig),
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
    /// Whether small writes (up to 1 MiB) are made durable through the store's journal:
    /// one shared `fdatasync` for all writes in flight, their files written after the
    /// acknowledgement (served from memory until then), and a background `syncfs` of the
    /// CAS filesystem that retires it. `false` fsyncs each blob's file and directory
    /// instead: slower, but it never flushes other programs' writes on the same
    /// filesystem. Both acknowledge a write only once it is durable. Default true.
    pub journal: bool,
}

impl Default for FsStoreConfig {
    fn default() -> Self {
        FsStoreConfig { path: None, max_size: ByteSize::gib(10), journal: true }
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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3StoreConfig {
    /// Bucket name. Required. gantry never creates it; it must exist at startup.
    pub bucket: String,
    /// Endpoint URL of an S3-compatible service, e.g. "http://127.0.0.1:9000"
    /// (path-style requests). Omit for AWS itself.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// PEM file of certificate authorities to trust for an `https://` endpoint, besides
    /// the system's: an S3-compatible service behind a private CA. Unset: the system's
    /// roots only (enough for AWS). Read at startup; an unreadable file, or one with no
    /// certificate, stops the server with its path.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Region of the bucket. Default "us-east-1".
    #[serde(default = "default_region")]
    pub region: String,
    /// Key prefix of every object gantry writes, e.g. "cas/". Default "" (the bucket root).
    #[serde(default)]
    pub prefix: String,
    /// Most S3 requests in flight at once for one FindMissingBlobs or completeness
    /// check (HEADs of blobs not known to be present). Default 64.
    #[serde(default = "default_s3_concurrency")]
    pub max_concurrent_requests: usize,
    /// How long a blob confirmed present in the bucket (written, read or found by a HEAD)
    /// is answered as present without asking S3 again. Default "10m".
    #[serde(default = "default_presence_ttl", with = "humantime_serde")]
    pub presence_ttl: Duration,
    /// Most blobs in that record of recent confirmations (about 100 bytes each); the
    /// oldest are dropped first. Default 1000000.
    #[serde(default = "default_presence_entries")]
    pub presence_entries: usize,
    /// How long a blob found missing is answered missing without asking S3 again. A
    /// stale "missing" costs only an upload (never a wrong hit); a blob uploaded through
    /// this server is present at once. "0s": always ask. Default "30s".
    #[serde(default = "default_absence_ttl", with = "humantime_serde")]
    pub absence_ttl: Duration,
    /// The local filesystem tier in front of the bucket. Absent: every read goes to S3.
    #[serde(default)]
    pub local: Option<LocalTierConfig>,
    /// The bucket's lifecycle rule, if it has one: objects expire this long after their
    /// Last-Modified (an S3 rule of N days is "Ndays"). gantry then answers a blob present
    /// only while it has `min_blob_lifetime` left, and refreshes older ones that are asked
    /// about. Unset: objects are never expired behind gantry's back.
    #[serde(default, with = "humantime_serde")]
    pub expire_after: Option<Duration>,
    /// With `expire_after`: how long the blobs of an action-cache hit (and any blob
    /// answered present) stay downloadable at least. Default "6h".
    #[serde(default = "default_min_blob_lifetime", with = "humantime_serde")]
    pub min_blob_lifetime: Duration,
}

fn default_absence_ttl() -> Duration {
    Duration::from_secs(30)
}

fn default_min_blob_lifetime() -> Duration {
    Duration::from_secs(6 * 3600)
}

fn default_region() -> String {
    "us-east-1".into()
}
fn default_s3_concurrency() -> usize {
    64
}
fn default_presence_ttl() -> Duration {
    Duration::from_secs(600)
}
fn default_presence_entries() -> usize {
    1_000_000
}

/// `[cas.local]`: a per-machine cache of the bucket on local disk. Reads fill it, writes
/// reach the bucket before they are acknowledged, so losing the directory loses nothing.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LocalTierConfig {
    /// Directory of the tier. Default `{data_dir}/cas-local`.
    pub path: Option<PathBuf>,
    /// Size past which this machine's least recently used blobs leave the tier (they
    /// stay in the bucket). Default "20GiB".
    pub max_size: ByteSize,
}

impl Default for LocalTierConfig {
    fn default() -> Self {
        LocalTierConfig { path: None, max_size: ByteSize::gib(20) }
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
    /// The out-of-memory rate the planner aims for. A batch ends at its memory cutoff,
    /// or sooner where the memory model's calibrated error (measured on held-out
    /// history at training) puts its chance of passing `bazel_memory` at this rate.
    /// Lower: safer and smaller builds. In (0, 0.5). Default 0.001.
    pub target_oom_rate: f64,
    /// The least margin a memory model's estimate keeps under `bazel_memory`, however
    /// narrow the model's calibrated error: a batch whose model has an error ends where
    /// its estimate times this reaches `bazel_memory`, if that comes before its cutoff.
    /// A target whose cost the history never told apart from its package's adds
    /// gigabytes at once, a jump no error spread of whole builds foresees. At the
    /// default heap and cutoffs it binds only LOW builds (about 9.5GB instead of 10GB),
    /// whose cutoff leaves the least headroom. 1 turns it off. At least 1. Default 1.37.
    pub min_memory_margin: f64,
    /// A batch that ends at its memory limit inside a history group (targets that
    /// every training build held all of or none of) ends at the group's start instead,
    /// if that drops at most this share of the batch. The history tells a group's summed
    /// cost but not its split, so part of one may hold its heaviest target at an even
    /// share's price; whole, the group is priced right. It trades density for fewer
    /// OOMs: at 0.3 every README workload meets the goals pooled over 30 seeds, where
    /// without it the heaviest misses the OOM goal (README, "Whole history groups").
    /// 0 turns it off. In [0, 1). Default 0.3.
    pub group_backoff_share: f64,
    /// How far the memory margin tightens for each OOM beyond what `target_oom_rate`
    /// allows, counted over the builds finished since the loaded models were trained
    /// (with `feedback`). The margin comes from held-out history, which does not hold
    /// the stream's new targets: when the stream runs out of memory more often than
    /// promised, each excess OOM widens the margin and its floor by this share, in log
    /// (0.05: an OOM past the allowance turns a 1.37 floor into 1.39; six, into 1.51),
    /// until the builds that fit bring the count back within the rate. 0 turns it off.
    /// At least 0. Default 0.05.
    pub excess_oom_tightening: f64,
    /// The same for passing `occupancy_limit_esu` (a missed deadline), with the
    /// occupancy model's error. In (0, 0.5). Default 0.0005.
    pub target_de_rate: f64,
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
    /// only (EnqueueTargets answers with builds and nobody runs them). A frontend
    /// (`[execution] scheduler`) runs none: the scheduler runs them. Default 2.
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
    /// A build whose Bazel server spent this long stuck out of memory is stopped (as at
    /// the deadline) and recorded OOM, so it is split rather than rerun. Stuck in GC
    /// (`oom_signal` "gc_spiral"): at least 3 full GCs in the window, each leaving 80% of
    /// `bazel_memory` in use, half of the window spent in GC pauses, and no new build
    /// event; or no new build event for four windows with at least 10 full GCs since the
    /// last one, each leaving 80% in use, however short their pauses (also "gc_spiral");
    /// or still running a whole window after an OutOfMemoryError in its `jvm.out`
    /// with no new build event ("oom_error_in_log"). The server writes a GC log for this
    /// (`-Xlog:gc`, JDK 9+, `gc.log` in the runner's directory). Make it long enough to
    /// hold 3 full GCs of your heap. "0s": no GC log, no detection (a stuck build runs to
    /// its deadline). Default "30s".
    #[serde(with = "humantime_serde")]
    pub gc_spiral_window: Duration,
    /// Runners' output bases and git worktrees. Default `{data_dir}/runners`.
    pub runner_dir: Option<PathBuf>,
    /// `--remote_executor` given to Bazel. Default: this server's gRPC address,
    /// `grpcs://localhost:PORT` with `[server.tls]` (the certificate must name it; set
    /// this to a name it holds otherwise).
    pub remote_executor: Option<String>,
    /// A file holding the bearer token the runners' Bazel (and the submit queue's) sends
    /// when the executor has `[auth]`. Re-read before every build, so rotating it needs
    /// no restart; given to Bazel through a private bazelrc, never on a command line.
    pub token_file: Option<PathBuf>,
    /// Bazel's `--tls_certificate`: the CA that signed the executor's certificate.
    pub tls_certificate: Option<PathBuf>,
    /// Bazel's `--tls_client_certificate` and `--tls_client_key`, when the executor
    /// wants client certificates.
    pub tls_client_certificate: Option<PathBuf>,
    pub tls_client_key: Option<PathBuf>,
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
    /// Learn from the builds the current models planned, until the next training: once
    /// a tool has 10 finished builds, its memory estimates are scaled by their median
    /// error, and from 30 the margin is at least as wide as their spread (README,
    /// "Feedback").
    /// Default true; false plans with the models alone.
    pub feedback: bool,
    /// Training windows: the long one feeds the main model, the short one tracks recent
    /// change. Defaults "17days" and "1day".
    #[serde(with = "humantime_serde")]
    pub long_window: Duration,
    #[serde(with = "humantime_serde")]
    pub short_window: Duration,
    /// Which model plans: "shared" (default), the shared-cost model (costs per target,
    /// package and directory, each charged once per build); "linear", the hashed linear
    /// models of the first versions, which are trained beside it either way (README,
    /// "Target batching").
    pub learner: Learner,
}

/// The model the planner uses (`[batch] learner`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Learner {
    #[default]
    Shared,
    Linear,
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
            target_oom_rate: 0.001,
            min_memory_margin: 1.37,
            group_backoff_share: 0.3,
            excess_oom_tightening: 0.05,
            target_de_rate: 0.0005,
            tag_executor_types: Default::default(),
            rule_kind_executor_types: Default::default(),
            stream_sort_window: 100_000,
            runners: 2,
            bazel: PathBuf::from("bazel"),
            startup_flags: Vec::new(),
            extra_flags: Vec::new(),
            deadline: Duration::from_secs(30 * 60),
            kill_grace: Duration::from_secs(10),
            gc_spiral_window: Duration::from_secs(30),
            runner_dir: None,
            remote_executor: None,
            token_file: None,
            tls_certificate: None,
            tls_client_certificate: None,
            tls_client_key: None,
            memory_label: MemoryLabel::UsedHeapPostBuild,
            retrain_interval: Duration::from_secs(600),
            min_history_builds: 20,
            feedback: true,
            long_window: Duration::from_secs(17 * 86_400),
            short_window: Duration::from_secs(86_400),
            learner: Learner::default(),
        }
    }
}

impl AuthConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        let check_perms = |what: &str, perms: &[String]| -> Result<(), ConfigError> {
            match perms.iter().find(|p| !PERMISSIONS.contains(&p.as_str())) {
                Some(p) => Err(ConfigError::Invalid(format!(
                    "{what}: unknown permission {p:?}; known: {}",
                    PERMISSIONS.join(", ")
                ))),
                None => Ok(()),
            }
        };
        check_perms("auth.anonymous", &self.anonymous)?;
        for (name, g) in &self.grants {
            check_perms(&format!("auth.grants.{name}"), &g.permissions)?;
            let valid = |p: &str| {
                p == "*" || !p.contains('*') || p.strip_suffix("/*").is_some_and(|prefix| !prefix.contains('*'))
            };
            if let Some(p) = g.instances.iter().find(|p| !valid(p)) {
                return invalid(format!(
                    "auth.grants.{name}: instance pattern {p:?}: use \"*\", a name, or \"prefix/*\""
                ));
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        let all = self
            .tokens
            .iter()
            .map(|t| ("auth.tokens", &t.name, &t.sha256))
            .chain(self.workers.tokens.iter().map(|t| ("auth.workers.tokens", &t.name, &t.sha256)));
        for (section, name, sha) in all {
            if sha.len() != 64 || !sha.chars().all(|c| c.is_ascii_hexdigit()) {
                return invalid(format!(
                    "{section} {name:?}: sha256 must be 64 hex digits (gantry auth token prints one)"
                ));
            }
            if !seen.insert(sha.to_ascii_lowercase()) {
                return invalid(format!("{section} {name:?}: the same sha256 is configured twice"));
            }
        }
        let granted = self
            .tokens
            .iter()
            .map(|t| ("auth.tokens", &t.name, &t.grants))
            .chain(self.certificates.iter().map(|c| ("auth.certificates", &c.name, &c.grants)));
        for (section, name, grants) in granted {
            if let Some(g) = grants.iter().find(|g| !self.grants.contains_key(*g)) {
                return invalid(format!("{section} {name:?}: grant {g:?} is not defined under [auth.grants]"));
            }
        }
        let mut names = std::collections::BTreeSet::new();
        let dns =
            self.certificates.iter().map(|c| &c.dns_name).chain(self.workers.certificates.iter().map(|c| &c.dns_name));
        for d in dns {
            if d.trim().is_empty() || d.contains(char::is_whitespace) {
                return invalid(format!("auth certificates: dns_name {d:?} is not a DNS name"));
            }
            if !names.insert(d.to_ascii_lowercase()) {
                return invalid(format!("auth certificates: dns_name {d:?} is configured twice"));
            }
        }
        Ok(())
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
        if let Some(Workers::Classes(v)) = &self.execution.workers
            && let Some(c) = v.iter().find(|c| c.size_class == 0)
        {
            return Err(ConfigError::Invalid(format!(
                "execution.workers: size_class must be at least 1 (found {} with count {})",
                c.size_class, c.count
            )));
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
        if let Some(t) = &self.server.tls
            && t.client_certificates == ClientCertificates::Optional
            && t.client_ca.is_none()
        {
            return Err(ConfigError::Invalid(
                "server.tls.client_certificates = \"optional\" needs server.tls.client_ca".into(),
            ));
        }
        if b.tls_client_certificate.is_some() != b.tls_client_key.is_some() {
            return Err(ConfigError::Invalid(
                "batch.tls_client_certificate and batch.tls_client_key go together".into(),
            ));
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
        if let Some(auth) = &self.auth {
            auth.validate()?;
        }
        if s.max_upload_memory.as_u64() < 1 << 20 {
            return Err(ConfigError::Invalid("server.max_upload_memory must be at least 1MiB".into()));
        }
        if s.max_uploads_per_client == 0 {
            return Err(ConfigError::Invalid("server.max_uploads_per_client must be at least 1".into()));
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
        if let Some(url) = &self.metadata.url
            && !["sqlite:", "postgres:", "postgresql:"].iter().any(|p| url.starts_with(p))
        {
            let scheme = url.split(':').next().unwrap_or("");
            return Err(ConfigError::Invalid(format!(
                "metadata.url: scheme '{scheme}' is not supported; use sqlite://PATH or postgres://USER@HOST:PORT/DB"
            )));
        }
        let max = match &self.cas {
            CasConfig::Fs(f) => f.max_size,
            CasConfig::Memory(m) => m.max_size,
            CasConfig::S3(s3) => {
                s3.validate()?;
                s3.local.as_ref().map_or(ByteSize::b(1), |l| l.max_size)
            }
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

    /// Directory of the S3 store's local tier, resolved against `data_dir`.
    pub fn local_tier_path(&self, local: &LocalTierConfig) -> PathBuf {
        local.path.clone().unwrap_or_else(|| self.server.data_dir.join("cas-local"))
    }

    /// URL of the metadata database, resolved against `data_dir`.
    pub fn metadata_url(&self) -> String {
        self.metadata
            .url
            .clone()
            .unwrap_or_else(|| format!("sqlite://{}", self.server.data_dir.join("metadata.db").display()))
    }
}

impl S3StoreConfig {
    /// `bucket` with every other setting at its default: the one place those defaults
    /// are written for code that opens a bucket without a config file (tests, tools).
    pub fn with_bucket(bucket: impl Into<String>) -> Self {
        S3StoreConfig {
            bucket: bucket.into(),
            endpoint: None,
            ca_file: None,
            region: default_region(),
            prefix: String::new(),
            max_concurrent_requests: default_s3_concurrency(),
            presence_ttl: default_presence_ttl(),
            presence_entries: default_presence_entries(),
            absence_ttl: default_absence_ttl(),
            local: None,
            expire_after: None,
            min_blob_lifetime: default_min_blob_lifetime(),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        // Bucket naming rules of S3 itself, so a typo fails here and not at the first upload.
        let b = &self.bucket;
        if b.len() < 3
            || b.len() > 63
            || !b.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
            || !b.starts_with(|c: char| c.is_ascii_alphanumeric())
            || !b.ends_with(|c: char| c.is_ascii_alphanumeric())
        {
            return Err(ConfigError::Invalid(format!(
                "cas.bucket {b:?} is not an S3 bucket name (3 to 63 characters: lowercase letters, digits, '-' and '.')"
            )));
        }
        if let Some(e) = &self.endpoint {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(ConfigError::Invalid(format!("cas.endpoint {e:?} must start with http:// or https://")));
            }
            if e.contains('@') {
                // Credentials never live in gantry.toml, not even inside a URL.
                return Err(ConfigError::Invalid(
                    "cas.endpoint must not contain credentials; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY".into(),
                ));
            }
        }
        if self.ca_file.is_some() && !self.endpoint.as_deref().is_some_and(|e| e.starts_with("https://")) {
            // A CA nobody uses would hide the real problem: the endpoint is not TLS.
            return Err(ConfigError::Invalid(
                "cas.ca_file is only for an https:// cas.endpoint (AWS itself needs none)".into(),
            ));
        }
        if let Some(e) = self.expire_after
            && e <= self.min_blob_lifetime
        {
            return Err(ConfigError::Invalid(format!(
                    "cas.expire_after ({}) must be longer than cas.min_blob_lifetime ({}): no blob could be promised its lifetime",
                    humantime_serde::re::humantime::format_duration(e),
                    humantime_serde::re::humantime::format_duration(self.min_blob_lifetime)
                )));
        }
        if self.region.trim().is_empty() {
            return Err(ConfigError::Invalid("cas.region must not be empty".into()));
        }
        if self.prefix.starts_with('/') || self.prefix.contains("//") {
            return Err(ConfigError::Invalid(format!(
                "cas.prefix {:?} must not start with '/' or contain '//'",
                self.prefix
            )));
        }
        if self.max_concurrent_requests == 0 {
            return Err(ConfigError::Invalid("cas.max_concurrent_requests must be at least 1".into()));
        }
        if let Some(l) = &self.local
            && l.max_size.as_u64() == 0
        {
            return Err(ConfigError::Invalid("cas.local.max_size must be greater than zero".into()));
        }
        Ok(())
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
            "[cas]\nkind = \"gcs\"",
            "[cas]\nkind = \"s3\"\nbucket = \"b-1\"\naccess_key_id = \"AKIA\"",
            "[cas]\nkind = \"s3\"\nbucket = \"b-1\"\n[cas.local]\nmax_sise = \"1GiB\"",
            "[action_cache]\nkind = \"sql\"\ncompleteness = false",
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("test.toml"), "{bad}: {e}");
            assert!(e.contains("unknown"), "{bad}: {e}");
        }
    }

    #[test]
    fn s3_section() {
        let c = parse("[cas]\nkind = \"s3\"\nbucket = \"gantry-cas\"\n").unwrap();
        let CasConfig::S3(s3) = &c.cas else { panic!("{:?}", c.cas) };
        assert_eq!((s3.region.as_str(), s3.prefix.as_str(), s3.endpoint.as_deref()), ("us-east-1", "", None));
        assert_eq!(
            (s3.max_concurrent_requests, s3.presence_ttl, s3.presence_entries),
            (64, Duration::from_secs(600), 1_000_000)
        );
        assert!(s3.local.is_none());
        let c = parse(
            "[cas]\nkind = \"s3\"\nbucket = \"gantry-cas\"\nendpoint = \"http://127.0.0.1:9000\"\nregion = \"eu-west-1\"\nprefix = \"cas/\"\n[cas.local]\nmax_size = \"2GiB\"\n",
        )
        .unwrap();
        let CasConfig::S3(s3) = &c.cas else { panic!() };
        assert_eq!(s3.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!((s3.region.as_str(), s3.prefix.as_str()), ("eu-west-1", "cas/"));
        let local = s3.local.as_ref().unwrap();
        assert_eq!(local.max_size, ByteSize::gib(2));
        assert_eq!(c.local_tier_path(local), PathBuf::from("./gantry-data/cas-local"));
        let c = parse("[cas]\nkind = \"s3\"\nbucket = \"gantry-cas\"\n[cas.local]\n").unwrap();
        let CasConfig::S3(s3) = &c.cas else { panic!() };
        assert_eq!(s3.local.as_ref().unwrap().max_size, ByteSize::gib(20));
        assert_eq!((s3.expire_after, s3.min_blob_lifetime), (None, Duration::from_secs(6 * 3600)));
        let c = parse(
            "[cas]\nkind = \"s3\"\nbucket = \"gantry-cas\"\nexpire_after = \"30days\"\nmin_blob_lifetime = \"12h\"\n",
        )
        .unwrap();
        let CasConfig::S3(s3) = &c.cas else { panic!() };
        assert_eq!(
            (s3.expire_after, s3.min_blob_lifetime),
            (Some(Duration::from_secs(30 * 86_400)), Duration::from_secs(12 * 3600))
        );
        assert!(parse("[cas]\nkind = \"s3\"").unwrap_err().to_string().contains("bucket"));
        for (bad, what) in [
            ("bucket = \"Gantry_CAS\"", "bucket"),
            ("bucket = \"ok-bucket\"\nendpoint = \"127.0.0.1:9000\"", "http://"),
            ("bucket = \"ok-bucket\"\nendpoint = \"http://AKIA:secret@h:9000\"", "credentials"),
            ("bucket = \"ok-bucket\"\nprefix = \"/cas\"", "prefix"),
            ("bucket = \"ok-bucket\"\nmax_concurrent_requests = 0", "max_concurrent_requests"),
            ("bucket = \"ok-bucket\"\n[cas.local]\nmax_size = \"0B\"", "local.max_size"),
            ("bucket = \"ok-bucket\"\nexpire_after = \"6h\"", "min_blob_lifetime"),
            ("bucket = \"ok-bucket\"\nendpoint = \"http://h:9000\"\nca_file = \"/ca.pem\"", "ca_file"),
            ("bucket = \"ok-bucket\"\nca_file = \"/ca.pem\"", "ca_file"),
        ] {
            let e = parse(&format!("[cas]\nkind = \"s3\"\n{bad}")).unwrap_err().to_string();
            assert!(e.contains(what), "{bad}: {e}");
            assert!(!e.contains("secret"), "{e}");
        }
    }

    #[test]
    fn workers_as_count_or_size_classes() {
        let c = parse("[execution]\nworkers = 3").unwrap();
        assert_eq!(c.execution.workers.unwrap().classes(), vec![(1, 3)]);
        let c = parse("[execution]\nworkers = [{size_class = 1, count = 2}, {size_class = 4, count = 1}]\nmemory_per_size_class = \"512MiB\"").unwrap();
        assert_eq!(c.execution.workers.unwrap().classes(), vec![(1, 2), (4, 1)]);
        assert_eq!(c.execution.memory_per_size_class.unwrap().as_u64(), 512 << 20);
        assert!(parse("[execution]\nworkers = [{size_class = 0, count = 1}]")
            .unwrap_err()
            .to_string()
            .contains("size_class"));
        assert!(parse("[execution.size_classes]\nexponent = 0.2").is_err());
    }

    #[test]
    fn limit_enforcement_in_config_and_on_the_command_line() {
        assert_eq!(parse("").unwrap().execution.limits, LimitEnforcement::Auto);
        for (text, want) in [
            ("auto", LimitEnforcement::Auto),
            ("cgroup", LimitEnforcement::Cgroup),
            ("rlimit", LimitEnforcement::Rlimit),
        ] {
            assert_eq!(parse(&format!("[execution]\nlimits = \"{text}\"")).unwrap().execution.limits, want);
            assert_eq!(text.parse::<LimitEnforcement>(), Ok(want));
        }
        assert!(parse("[execution]\nlimits = \"cgroups\"").is_err());
        assert!("RLIMIT_AS".parse::<LimitEnforcement>().unwrap_err().contains("auto, cgroup, rlimit"));
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
    fn auth_section() {
        let sha = "ab".repeat(32);
        let text = format!(
            "[auth]\nanonymous = [\"read\"]\n[[auth.tokens]]\nname = \"ci\"\nsha256 = \"{sha}\"\ngrants = [\"ci\"]\n\
             [auth.grants.ci]\ninstances = [\"*\", \"dev/*\"]\npermissions = [\"read\", \"write_ac\"]\n\
             [[auth.workers.tokens]]\nname = \"w\"\nsha256 = \"{}\"\n",
            "cd".repeat(32)
        );
        let c = parse(&text).unwrap();
        let a = c.auth.unwrap();
        assert_eq!(a.tokens[0].grants, ["ci"]);
        assert_eq!(a.workers.tokens[0].name, "w");
        assert!(parse("").unwrap().auth.is_none(), "absent: no auth");
        for (bad, needle) in [
            (text.replace("\"write_ac\"", "\"root\""), "unknown permission"),
            (text.replace("grants = [\"ci\"]", "grants = [\"nope\"]"), "not defined"),
            (text.replace(&sha, "xyz"), "64 hex"),
            (text.replace(&"cd".repeat(32), &sha), "twice"),
            (text.replace("\"dev/*\"", "\"d*v\""), "instance pattern"),
            (text.replace("anonymous = [\"read\"]", "anonymous = [\"all\"]"), "auth.anonymous"),
            (
                format!("{text}[[auth.certificates]]\nname = \"a\"\ndns_name = \"x.test\"\n[[auth.workers.certificates]]\nname = \"b\"\ndns_name = \"X.test\"\n"),
                "configured twice",
            ),
            (format!("{text}[[auth.certificates]]\nname = \"a\"\ndns_name = \"x.test\"\ngrants = [\"nope\"]\n"), "not defined"),
        ] {
            let e = parse(&bad).unwrap_err().to_string();
            assert!(e.contains(needle), "{needle}: {e}");
        }
    }

    #[test]
    fn metadata_section() {
        let c = parse(
            "[metadata]\nurl = \"postgres://gantry@db:5432/gantry\"\nmax_connections = 32\nconnect_timeout = \"3s\"",
        )
        .unwrap();
        assert_eq!(c.metadata_url(), "postgres://gantry@db:5432/gantry");
        assert_eq!(c.metadata.max_connections, 32);
        assert_eq!(c.metadata.connect_timeout, Duration::from_secs(3));
    }

    #[test]
    fn retention_section() {
        let c = parse("[retention]\ninterval = \"10s\"\n[retention.execution_log]\nmax_age = \"7days\"\nmax_rows = 0")
            .unwrap();
        assert_eq!(c.retention.interval, Duration::from_secs(10));
        assert_eq!(c.retention.execution_log, RetentionBound { max_age: Duration::from_secs(7 * 86400), max_rows: 0 });
        assert_eq!(
            c.retention.action_cache,
            RetentionConfig::default().action_cache,
            "untouched tables keep their defaults"
        );
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
