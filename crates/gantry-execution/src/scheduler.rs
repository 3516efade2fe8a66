//! The scheduler: operations, their watchers and owners, the worker registry, and what
//! happens around an execution. Which queued action runs on which worker slot is the
//! [`Dispatcher`]'s (queues per platform and size class, O(log n) per event). Identical
//! in-flight actions (same instance and action digest) share one execution. A worker that
//! disconnects or misses heartbeats loses its actions back to the queue, up to a limit.
//! So does a worker that keeps heartbeating but sends no result for an action past its
//! timeout plus a grace period: the scheduler cancels the action there and re-queues it
//! elsewhere, counted as a worker loss ([`overdue`]).
//!
//! An action placed on a smaller size class and still running at its hedge time (the
//! selection's, counted from submission) gets a second copy on the largest class while
//! the first keeps running; one still queued then is moved to the largest class instead.
//! The first copy to succeed wins, and the other is cancelled on its worker, which kills
//! its process group. A run on the largest class decides whatever its outcome; a first
//! run that fails leaves the decision to its copy, which takes the operation over.
//!
//! All state sits behind one mutex that is never held across an await, and a panic
//! while it is held does not stop the scheduler (see `Scheduler::lock`). Each event is
//! one locked state transition; a finished action's durable writes (size-class stats,
//! action cache, execution log) happen after it, outside the lock, before its result is
//! published. Workers get the scheduler's own [`ToWorker`] messages: the worker protocol
//! is encoded at the session's wire, not under the lock.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gantry_core::google::rpc::Status as RpcStatus;
use gantry_core::reapi::{self, ExecuteResponse};
use gantry_core::task::{spawn_named, TaskGuard};
use gantry_core::{ActionCache, ActionRecord, Digest, DigestFunction, Error, ExecutionLog, Result};
use gantry_proto::worker::v1 as wpb;
use prost::Message;
use tokio::sync::{mpsc, watch};

use crate::dispatcher::{Assign, Dispatcher, IdMap, JobId, Properties, WorkerId, CALLER_IDS};
use crate::op_watch;
use crate::platform::{self, Property};
use crate::sizing::{Learned, RunEnd, Trial};

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// How many times an action may lose its worker before it fails with UNAVAILABLE.
    pub max_worker_losses: u32,
    /// A remote worker silent for this long is considered lost.
    pub heartbeat_timeout: Duration,
    /// Finished operations stay queryable (GetOperation, WaitExecution) this long.
    pub completed_retention: Duration,
    /// Timeout for actions that ask for none.
    pub default_timeout: Duration,
    /// Upper bound on any action's timeout.
    pub max_timeout: Duration,
    /// How long past an action's timeout the scheduler waits for its worker's report
    /// before it takes the action back (see [`overdue`]).
    pub timeout_grace: Duration,
}

impl From<&gantry_config::ExecutionConfig> for SchedulerConfig {
    fn from(e: &gantry_config::ExecutionConfig) -> Self {
        SchedulerConfig {
            max_worker_losses: e.max_worker_losses,
            heartbeat_timeout: e.heartbeat_timeout,
            completed_retention: e.completed_retention,
            default_timeout: e.default_timeout,
            max_timeout: e.max_timeout,
            timeout_grace: e.timeout_grace,
        }
    }
}

/// The defaults are `[execution]`'s, kept in one place: gantry-config.
impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig::from(&gantry_config::ExecutionConfig::default())
    }
}

/// The timeout an action runs with: its own, or `default` when it asks for none (0).
/// REAPI: a negative timeout, or one above the server's maximum, is INVALID_ARGUMENT
/// (clamping it would run the action under a limit the client did not ask for).
pub fn resolve_timeout(
    requested: Option<&gantry_core::google::protobuf::Duration>,
    default: Duration,
    max: Duration,
) -> Result<Duration> {
    let Some(d) = requested else { return Ok(default) };
    if d.seconds < 0 || d.nanos < 0 || d.nanos >= 1_000_000_000 {
        return Err(Error::invalid(format!(
            "action.timeout: {}s {}ns is not a valid non-negative duration",
            d.seconds, d.nanos
        )));
    }
    let t = Duration::new(d.seconds as u64, d.nanos as u32);
    if t.is_zero() {
        return Ok(default);
    }
    if t > max {
        return Err(Error::invalid(format!("action.timeout {t:?} exceeds this server's max_timeout {max:?}")));
    }
    Ok(t)
}

/// An operation name as quoted in messages: a client may send megabytes of it, and an
/// error must not echo them back.
/// Whether `by` (None: an administrator) may see and act on `job`. Someone else's
/// operation looks exactly like a missing one.
fn may_touch(job: &Job, by: Option<&str>) -> bool {
    by.is_none_or(|who| job.owners.iter().any(|o| o == who))
}

fn not_found(name: &str) -> Error {
    Error::not_found(format!("no operation {}", shown_name(name)))
}

pub fn shown_name(name: &str) -> std::borrow::Cow<'_, str> {
    const MAX: usize = 200;
    if name.len() <= MAX {
        return name.into();
    }
    let mut end = MAX;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &name[..end], name.len()).into()
}

/// Whether an action handed to a worker at `dispatched_at` with `timeout` should have
/// been reported by `now`. The worker kills the action at its timeout and reports at
/// once; `grace` covers fetching the inputs (the clock starts at dispatch), the kill, the
/// output upload and the report's trip. Past that the
/// worker is stuck (or lying), and the action is taken back.
pub fn overdue(dispatched_at: Instant, timeout: Duration, grace: Duration, now: Instant) -> bool {
    now.saturating_duration_since(dispatched_at) > timeout.saturating_add(grace)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Queued,
    Executing,
    Completed,
}

/// What watchers of an operation see; every change is published.
///
/// Kept small: every operation's watch channel holds one for its whole retention, and a
/// response inline would be two thirds of a kilobyte on each, mostly while still queued.
#[derive(Debug, Clone)]
pub struct OpState {
    /// Shared with the scheduler's own maps (a clone is a count, not a copy).
    pub name: Arc<str>,
    pub stage: Stage,
    pub action_digest: Digest,
    pub response: Option<Box<ExecuteResponse>>,
}

/// Who asked for an action, from Bazel's RequestMetadata header.
#[derive(Debug, Clone, Default)]
pub struct Requester {
    pub tool_invocation_id: String,
    pub action_mnemonic: String,
    pub target_id: String,
    pub configuration_id: String,
}

#[derive(Debug)]
pub struct JobSpec {
    pub instance: String,
    pub action_digest: Digest,
    /// Shared with the workers' orders (an in-process worker reads them without a copy).
    pub action: Arc<reapi::Action>,
    pub command: Arc<reapi::Command>,
    pub priority: i32,
    pub requester: Requester,
    /// The identity that asked (`[auth]`); None on a server without authentication.
    pub owner: Option<String>,
}

/// What a retired operation keeps of its action: only `do_not_cache`, so that its spec
/// still says how it was asked for (nothing decides on it after retirement). Shared, so
/// that retiring allocates nothing.
fn stripped_action(do_not_cache: bool) -> Arc<reapi::Action> {
    static KEPT: std::sync::LazyLock<[Arc<reapi::Action>; 2]> = std::sync::LazyLock::new(|| {
        [false, true].map(|do_not_cache| Arc::new(reapi::Action { do_not_cache, ..Default::default() }))
    });
    KEPT[usize::from(do_not_cache)].clone()
}

/// The empty Command every retired operation keeps, shared for the same reason.
fn stripped_command() -> Arc<reapi::Command> {
    static EMPTY: std::sync::LazyLock<Arc<reapi::Command>> = std::sync::LazyLock::new(Default::default);
    EMPTY.clone()
}

impl JobSpec {
    /// The same request without its action and command: who asked for which digest.
    fn without_action(&self) -> JobSpec {
        JobSpec {
            instance: self.instance.clone(),
            action_digest: self.action_digest,
            action: stripped_action(self.action.do_not_cache),
            command: stripped_command(),
            priority: self.priority,
            requester: self.requester.clone(),
            owner: self.owner.clone(),
        }
    }

    /// Drops the action and command of a shared spec: in place when nothing else holds
    /// it (the usual case: a worker's copy is gone by the time it reports), else by
    /// replacing it with a copy of the rest.
    fn strip(spec: &mut Arc<JobSpec>) {
        match Arc::get_mut(spec) {
            Some(s) => {
                s.action = stripped_action(s.action.do_not_cache);
                s.command = stripped_command();
            }
            None => *spec = Arc::new(spec.without_action()),
        }
    }
}

/// An operation's name, shared by the maps that refer to it (a clone is a count, not a
/// copy).
type Name = Arc<str>;

/// Maps keyed by what no client chooses (workers by their registered name, size classes
/// by number): SipHash's flooding protection is not worth its cost there. Actions in
/// flight stay on SipHash: their instance names are the client's choice.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// An operation's number: the low 64 bits of the UUID in its name ([`op_of_name`]), whose
/// top bit (the first bit of the UUID's variant) is always set. Everything inside the
/// scheduler refers to an operation by it, not by its name: a numeric key sits in the
/// map's own slots, while a name is a pointer to chase and a string to hash and compare. Since the number is read from the name, finding an
/// operation by name (a worker's report, a client's wait or cancel) needs no map of names.
/// It is also the dispatcher's id of the operation's first run (its top bit keeps it apart
/// from the ids the dispatcher makes, see [`CALLER_IDS`]); a hedge copy that takes over
/// runs under another id, kept in `State::promoted`.
type OpId = u64;

const NAME_PREFIX: &str = "operations/";

/// The operation number and the rest of the UUID (its high 64 bits) of a name this
/// scheduler could have made: "operations/" and a lowercase hyphenated UUID with the
/// RFC 4122 variant's first bit set, the only form it makes. Every bit of the name is
/// kept, so one number and high half have one name. None for anything else.
fn op_of_name(name: &str) -> Option<(OpId, u64)> {
    let text = name.strip_prefix(NAME_PREFIX)?;
    if text.len() != 36 || text.bytes().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    let (op, high) = uuid_parts(uuid::Uuid::try_parse(text).ok()?);
    (op >= CALLER_IDS).then_some((op, high))
}

/// A name's UUID as the operation number (its low half) and the rest (its high half).
fn uuid_parts(uuid: uuid::Uuid) -> (OpId, u64) {
    let uid = uuid.as_u128();
    (uid as u64, (uid >> 64) as u64)
}

struct Job {
    id: JobId,
    op: OpId,
    name: Name,
    /// The high half of the name's UUID: with `op`, the whole name (see [`op_of_name`]).
    name_high: u64,
    /// Its place in submission order (operation numbers are random), for listings.
    submitted: u64,
    key: (String, Digest),
    spec: Arc<JobSpec>,
    /// Identities whose Execute calls share this operation (requests for the same action
    /// are merged); only they, or an administrator, may list, cancel or delete it.
    owners: Vec<String>,
    timeout: Duration,
    queued_at: SystemTime,
    worker: Option<Name>,
    /// When the current worker was handed the action.
    dispatched_at: Option<Instant>,
    losses: u32,
    cancel_requested: bool,
    /// Size class the action must run on (None: any worker).
    size_class: Option<u32>,
    /// The size-class learner's bookkeeping for this action (see `sizing::Trial`).
    trial: Trial,
    /// The platform properties it needs (a hedge copy needs them too).
    required: Properties,
    /// That copy, while both run. The first to finish wins and the other is cancelled.
    hedge: Option<HedgeRun>,
    /// The copy took over from the first run (which failed, was lost or lost the race):
    /// the action's run is the copy, known to workers by its [`wire_id`].
    promoted: bool,
    tx: op_watch::Sender<OpState>,
    /// Set when the scheduler is done with the action. Its final state may still be on its
    /// way (the action cache and execution log are written first, outside the lock):
    /// until it is published, identical requests join it.
    completed_at: Option<Instant>,
}

impl Job {
    fn published(&self) -> bool {
        self.tx.borrow().stage == Stage::Completed
    }

    /// The job id workers know the action's run (or its hedge copy) by.
    fn wire(&self, hedge: bool) -> String {
        wire_id(&self.name, hedge || self.promoted)
    }
}

/// A hedge copy of a running action, on the largest size class.
struct HedgeRun {
    id: JobId,
    worker: Option<Name>,
    dispatched_at: Option<Instant>,
}

/// Appended to an operation's name to make its hedge copy's job id: both runs may be
/// on the same worker, which tells them apart (and cancels one) by job id.
const HEDGE_SUFFIX: &str = "#hedge";

/// The job id of an operation's run (`hedge`: of its copy on the largest class).
pub fn wire_id(name: &str, hedge: bool) -> String {
    if hedge {
        format!("{name}{HEDGE_SUFFIX}")
    } else {
        name.to_string()
    }
}

/// The operation a job id belongs to, and whether it names a hedge copy.
pub fn split_wire_id(job_id: &str) -> (&str, bool) {
    match job_id.strip_suffix(HEDGE_SUFFIX) {
        Some(name) => (name, true),
        None => (job_id, false),
    }
}

/// What the scheduler sends a worker. Assignments carry the scheduler's own types;
/// encoding to the worker protocol happens at the wire, outside the scheduler's lock.
#[derive(Debug, Clone)]
pub enum ToWorker {
    Assign(Arc<Assignment>),
    Cancel(String),
}

#[derive(Debug)]
pub struct Assignment {
    pub job_id: String,
    pub spec: Arc<JobSpec>,
    pub timeout: Duration,
    pub queued_at: SystemTime,
}

impl ToWorker {
    /// The worker protocol's form of this message.
    pub fn to_wire(&self) -> wpb::SchedulerMessage {
        let kind = match self {
            ToWorker::Assign(a) => wpb::scheduler_message::Kind::Assignment(wpb::Assignment {
                job_id: a.job_id.clone(),
                instance_name: a.spec.instance.clone(),
                digest_function: a.spec.action_digest.function.to_proto(),
                action: a.spec.action.encode_to_vec(),
                command: a.spec.command.encode_to_vec(),
                action_digest: a.spec.action_digest.to_proto().encode_to_vec(),
                timeout_ms: a.timeout.as_millis() as u64,
                queued_unix_ms: now_ms(a.queued_at),
            }),
            ToWorker::Cancel(job_id) => wpb::scheduler_message::Kind::Cancel(wpb::Cancel { job_id: job_id.clone() }),
        };
        wpb::SchedulerMessage { kind: Some(kind) }
    }

    /// The form an in-process worker takes: the same values, copied, never encoded.
    pub fn to_order(&self) -> gantry_core::Order {
        match self {
            ToWorker::Assign(a) => gantry_core::Order::Run(Box::new(gantry_core::Work {
                job_id: a.job_id.clone(),
                function: a.spec.action_digest.function,
                action: a.spec.action.clone(),
                command: a.spec.command.clone(),
                timeout: a.timeout,
            })),
            ToWorker::Cancel(job_id) => gantry_core::Order::Cancel { job_id: job_id.clone() },
        }
    }
}

struct WorkerEntry {
    id: WorkerId,
    /// Operations taken back from this worker because it never reported them; each still
    /// holds a slot in the dispatcher until the worker reports it (its report is dropped).
    overdue: HashMap<String, JobId>,
    tx: mpsc::UnboundedSender<ToWorker>,
    last_seen: Instant,
    /// In-process workers cannot be lost to a network, so they are not timed out.
    local: bool,
    size_class: u32,
    metering: String,
}

#[derive(Default)]
struct State {
    /// Which queued action runs on which worker slot.
    d: Dispatcher,
    /// Every operation by number, until its retention ends. Boxed: a map of large
    /// entries moves them all whenever it rehashes.
    jobs: IdMap<Box<Job>>,
    /// Operations whose hedge copy took over, by the copy's dispatcher id; the first run
    /// of every other operation has the operation's own number as its id ([`OpId`]).
    promoted: IdMap<OpId>,
    submissions: u64,
    /// Hedge copies the dispatcher holds, by their id: the operation each belongs to.
    hedges: IdMap<OpId>,
    /// Operations whose hedge time is still to come: (that time, their dispatcher id).
    hedge_due: BTreeSet<(Instant, JobId)>,
    in_flight: HashMap<(String, Digest), OpId>,
    workers: FastMap<String, WorkerEntry>,
    /// Worker names by dispatcher id, shared with the jobs that run on them.
    worker_names: IdMap<Name>,
    /// Completed operations, oldest first, for retention.
    completed: VecDeque<(Instant, OpId)>,
    names: NameSource,
    /// Moving average of execution seconds per size class, for expected queue waits.
    class_avg_seconds: FastMap<u32, f64>,
    /// Platform property sets operations required, shared by every operation that
    /// requires the same set instead of a copy each (a fleet has a handful), with what the
    /// fleet offers each ([`State::fit`]). Clients choose them, so the map is bounded
    /// ([`INTERNED_PLATFORMS_MAX`]).
    platforms: FastMap<Properties, Fit>,
}

/// What the fleet offers one interned property set, as of a fleet generation
/// ([`Dispatcher::generation`]): every arrival asks, and the answer changes only when a
/// worker joins or leaves.
struct Fit {
    generation: u64,
    /// Size classes with a worker that can run it, ascending.
    classes: Arc<[u32]>,
}

/// Distinct property sets [`State::fit`] keeps before it starts over: sharing saves
/// memory, nothing depends on it, and clients choose the sets.
const INTERNED_PLATFORMS_MAX: usize = 1024;

struct Gauges {
    queued: prometheus::IntGauge,
    running: prometheus::IntGauge,
    workers: prometheus::IntGauge,
    /// `gantry_executions_total` per outcome, looked up once: a labelled lookup hashes
    /// the label and takes the vector's lock on every finished action.
    completed: [(&'static str, prometheus::IntCounter); OUTCOMES.len()],
}

/// The outcomes `gantry_executions_total` counts.
const OUTCOMES: [&str; 6] = ["success", "nonzero_exit", "out_of_memory", "timeout", "cancelled", "error"];

impl Gauges {
    fn completed(&self, outcome: &str) -> &prometheus::IntCounter {
        let i = self.completed.iter().position(|(o, _)| *o == outcome).unwrap_or(OUTCOMES.len() - 1);
        &self.completed[i].1
    }
}

pub struct Scheduler {
    state: Mutex<State>,
    config: SchedulerConfig,
    ac: Arc<dyn ActionCache>,
    log: Arc<dyn ExecutionLog>,
    gauges: Gauges,
    monitor: Mutex<Option<TaskGuard>>,
    sizing: Option<crate::sizing::Sizing>,
    /// Set when the server shuts down: open worker sessions and operation streams end
    /// with UNAVAILABLE, so their clients reconnect (to this server restarted, or a
    /// successor) instead of holding the shutdown until its drain times out.
    stopping: watch::Sender<bool>,
}

/// A registered worker's end of the scheduler: assignments and cancellations arrive here.
pub struct WorkerLink {
    pub id: String,
    pub messages: mpsc::UnboundedReceiver<ToWorker>,
}

fn now_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

pub fn timestamp(t: SystemTime) -> gantry_core::google::protobuf::Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    gantry_core::google::protobuf::Timestamp { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 }
}

fn status(code: tonic::Code, message: impl Into<String>) -> RpcStatus {
    RpcStatus { code: code as i32, message: message.into(), details: vec![] }
}

/// What a finished report leads to, decided under the lock and carried out after it.
enum After {
    /// Nothing more: a stale or late report.
    Nothing,
    /// Re-queued on the largest size class; the failed try is logged.
    Retried { record: Box<ActionRecord>, from_class: u32 },
    /// A run that is not the action's result (a first run whose hedge copy now decides,
    /// a hedge copy that could not run): logged only.
    Logged(Box<ActionRecord>),
    /// The final result: write it durably, then publish it.
    Final(Box<Finale>),
}

struct Finale {
    record: ActionRecord,
    instance: String,
    digest: Digest,
    do_not_cache: bool,
    queued_at: SystemTime,
    learn: Option<Learned>,
    tx: op_watch::Sender<OpState>,
}

/// Operations past their retention that each finished run forgets on its way (see
/// [`State::expire`]): more than one, so that the completions keep up with themselves
/// (a run may be retried or hedged), few enough that none waits long. Not on submit:
/// that is the arrival-to-assignment path.
const EXPIRE_PER_FINISH: usize = 4;

/// Operation names: random version-4 UUIDs, unguessable as before, drawn from a ChaCha
/// stream seeded once from the OS instead of one `getrandom` call per operation (a
/// fortieth of an event).
struct NameSource(rand_chacha::ChaCha12Rng);

impl Default for NameSource {
    fn default() -> Self {
        use rand::SeedableRng;
        let (a, b) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        let mut seed = [0u8; 32];
        seed[..16].copy_from_slice(a.as_bytes());
        seed[16..].copy_from_slice(b.as_bytes());
        NameSource(rand_chacha::ChaCha12Rng::from_seed(seed))
    }
}

impl NameSource {
    /// A fresh name, and its reading by [`op_of_name`].
    fn next(&mut self) -> (String, OpId, u64) {
        use rand::RngCore;
        let mut bytes = [0u8; 16];
        self.0.fill_bytes(&mut bytes);
        // The builder sets the RFC 4122 variant, whose first bit is the number's top bit.
        let uuid = uuid::Builder::from_random_bytes(bytes).into_uuid();
        let (op, high) = uuid_parts(uuid);
        debug_assert!(op >= CALLER_IDS);
        (format!("{NAME_PREFIX}{uuid}"), op, high)
    }
}

impl State {
    /// The shared copy of a property set (see `platforms`), and the size classes with a
    /// worker that can run an action requiring it. Refused (and not kept) when a property
    /// is offered by no worker, or no one worker offers them all, so that the sets kept
    /// are ones the operators' fleet offers.
    fn fit(&mut self, required: Vec<Property>) -> Result<(Properties, Arc<[u32]>)> {
        let generation = self.d.generation();
        // Known and current: the answer. Known from an older fleet: its shared copy, asked again.
        let interned = match self.platforms.get_key_value(&required[..]) {
            Some((p, fit)) if fit.generation == generation => return Ok((p.clone(), fit.classes.clone())),
            Some((p, _)) => Some(p.clone()),
            None => None,
        };
        if self.d.has_workers()
            && let Some(p) = self.d.first_unoffered(&required)
        {
            return Err(Error::FailedPrecondition(format!(
                "platform property {}={} is offered by no worker",
                p.name, p.value
            )));
        }
        let classes: Arc<[u32]> = self.d.classes_for(&required).into();
        if self.d.has_workers() && classes.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "no worker offers all of the platform properties {}",
                required.iter().map(|p| format!("{}={}", p.name, p.value)).collect::<Vec<_>>().join(", ")
            )));
        }
        let p: Properties = match interned {
            Some(p) => p,
            None => {
                if self.platforms.len() >= INTERNED_PLATFORMS_MAX {
                    self.platforms.clear();
                }
                required.into()
            }
        };
        self.platforms.insert(p.clone(), Fit { generation, classes: classes.clone() });
        Ok((p, classes))
    }

    /// Forgets up to `max` completed operations whose retention has ended, oldest first.
    /// Finished runs do a few each, so that a busy scheduler frees its old operations on the
    /// threads that made them, a few at a time, instead of the monitor dropping tens of
    /// thousands at once under the lock (which stalled every request meanwhile, and
    /// handed the allocator cross-thread frees); the monitor sweeps what is left.
    fn expire(&mut self, now: Instant, keep: Duration, max: usize) {
        for _ in 0..max {
            match self.completed.front() {
                Some((at, _)) if now.saturating_duration_since(*at) >= keep => {}
                _ => return,
            }
            let (at, op) = self.completed.pop_front().expect("front exists");
            // Only the operation this entry was made for: a deleted operation's number can
            // come back (see `submit`), and its entry must not end the newcomer's retention.
            // Removed, then put back in that (rare) case: one probe of a large map, not two.
            match self.jobs.remove(&op) {
                Some(job) if job.completed_at == Some(at) => self.forget_removed(op, &job),
                Some(job) => {
                    self.jobs.insert(op, job);
                }
                None => {}
            }
        }
    }

    /// Removes an operation from every map that knows it.
    fn forget(&mut self, op: OpId) {
        if let Some(job) = self.jobs.remove(&op) {
            self.forget_removed(op, &job);
        }
    }

    /// The rest of [`State::forget`], for an operation already out of `jobs`.
    fn forget_removed(&mut self, op: OpId, job: &Job) {
        // One probe, not a look then a removal: the entry is nearly always this
        // operation's, and a later one's (rare) is put back.
        if let Some((key, other)) = self.in_flight.remove_entry(&job.key)
            && other != op
        {
            self.in_flight.insert(key, other);
        }
    }

    /// The operation called `name`.
    fn op_named(&self, name: &str) -> Option<OpId> {
        let (op, high) = op_of_name(name)?;
        self.jobs.get(&op).filter(|j| j.name_high == high).map(|_| op)
    }

    /// The operation whose current run the dispatcher holds as `id` (queued or running):
    /// its first run, or the hedge copy that took over from it. Not a hedge copy still
    /// racing its first run (see `hedges`).
    fn live_op(&self, id: JobId) -> Option<OpId> {
        let op = if id >= CALLER_IDS { id } else { *self.promoted.get(&id)? };
        self.jobs.get(&op).filter(|j| j.id == id && j.completed_at.is_none()).map(|_| op)
    }

    fn job_named(&self, name: &str) -> Option<&Job> {
        self.jobs.get(&self.op_named(name)?).map(|j| &**j)
    }

    /// Carries out the dispatcher's assignments: the operation moves to EXECUTING and its
    /// worker is sent the action. A worker whose channel is closed is gone: it is removed
    /// and its actions placed again.
    fn apply(&mut self, config: &SchedulerConfig, assigns: Vec<Assign>) {
        let mut todo: VecDeque<Assign> = assigns.into();
        while let Some(a) = todo.pop_front() {
            let Some(wname) = self.worker_names.get(&a.worker) else { continue };
            let (op, hedge) = match (self.live_op(a.job), self.hedges.get(&a.job)) {
                (Some(op), _) => (op, false),
                (None, Some(&op)) => (op, true),
                (None, None) => continue,
            };
            let job = self.jobs.get_mut(&op).expect("live jobs exist");
            if self.d.worker_of(a.job) != Some(a.worker) {
                continue; // superseded by a later event in this same batch
            }
            let msg = ToWorker::Assign(Arc::new(Assignment {
                job_id: job.wire(hedge),
                spec: job.spec.clone(),
                // A hedge copy runs on the largest class, with the client's timeout.
                timeout: if hedge { job.trial.requested_timeout } else { job.timeout },
                queued_at: job.queued_at,
            }));
            let w = self.workers.get(&**wname).expect("named workers exist");
            if w.tx.send(msg).is_ok() {
                match job.hedge.as_mut().filter(|_| hedge) {
                    Some(h) => {
                        h.worker = Some(wname.clone());
                        h.dispatched_at = Some(Instant::now());
                    }
                    None => {
                        job.worker = Some(wname.clone());
                        job.dispatched_at = Some(Instant::now());
                        job.tx.send_modify(|s| s.stage = Stage::Executing);
                    }
                }
            } else {
                let wname = wname.clone();
                todo.extend(self.remove_worker(config, &wname, "its channel is closed"));
            }
        }
    }

    /// Removes a worker; its actions are re-queued or failed. Returns the assignments
    /// that follow (the caller applies them).
    fn remove_worker(&mut self, config: &SchedulerConfig, worker: &str, why: &str) -> Vec<Assign> {
        let Some(w) = self.workers.remove(worker) else { return Vec::new() };
        self.worker_names.remove(&w.id);
        let running = self.d.remove_worker(w.id);
        tracing::warn!(worker, why, running = running.len(), "worker lost");
        let mut out = Vec::new();
        for j in running {
            if let Some(&op) = self.hedges.get(&j) {
                // A lost copy: the first run goes on alone.
                out.extend(self.drop_hedge(op, false));
            } else {
                out.extend(self.lose_job(config, j, worker, why, None));
            }
        }
        out
    }

    /// Ends an operation's hedge copy: it is cancelled on its worker when `cancel` and it
    /// runs there (the slot stays taken until the worker reports it, as for an overdue
    /// run), else it just leaves the dispatcher. The first run goes on.
    fn drop_hedge(&mut self, op: OpId, cancel: bool) -> Vec<Assign> {
        let Some(job) = self.jobs.get_mut(&op) else { return Vec::new() };
        let Some(h) = job.hedge.take() else { return Vec::new() };
        self.hedges.remove(&h.id);
        let wire = job.wire(true);
        self.end_run(h.id, h.worker.as_deref(), wire, cancel)
    }

    /// The hedge copy takes over the operation: its first run failed, was lost, or lost
    /// the race (`cancel`: it is still running, and is cancelled).
    fn promote_hedge(&mut self, op: OpId, cancel: bool) -> Vec<Assign> {
        let Some(job) = self.jobs.get_mut(&op) else { return Vec::new() };
        let Some(h) = job.hedge.take() else { return Vec::new() };
        let (old, old_wire, old_worker) = (job.id, job.wire(false), job.worker.take());
        job.id = h.id;
        job.worker = h.worker;
        job.dispatched_at = h.dispatched_at;
        job.promoted = true;
        job.size_class = Some(job.trial.largest_class);
        job.timeout = job.trial.requested_timeout;
        if job.worker.is_none() {
            job.tx.send_modify(|s| s.stage = Stage::Queued);
        }
        self.hedges.remove(&h.id);
        // The first run had the operation's number; a hedge copy never has one.
        debug_assert!(old == op && h.id < CALLER_IDS);
        self.promoted.insert(h.id, op);
        self.end_run(old, old_worker.as_deref(), old_wire, cancel)
    }

    /// Takes a run out of the dispatcher; a running one is cancelled on its worker first
    /// when `cancel` (its slot is freed by the worker's report: see `late_report`).
    fn end_run(&mut self, id: JobId, worker: Option<&str>, wire: String, cancel: bool) -> Vec<Assign> {
        if cancel
            && let Some(wname) = worker
            && self.d.worker_of(id).is_some()
            && let Some(w) = self.workers.get_mut(wname)
        {
            self.d.take_back(id);
            let _ = w.tx.send(ToWorker::Cancel(wire.clone()));
            w.overdue.insert(wire, id);
        }
        self.d.finish(id)
    }

    /// A detached action's worker is gone (or stuck): re-queue the action, or fail it with
    /// UNAVAILABLE once it has lost workers more than `max_worker_losses` times.
    fn lose_job(
        &mut self,
        config: &SchedulerConfig,
        id: JobId,
        worker: &str,
        why: &str,
        avoid: Option<WorkerId>,
    ) -> Vec<Assign> {
        let Some(op) = self.live_op(id) else { return Vec::new() };
        let job = self.jobs.get_mut(&op).expect("live jobs exist");
        if job.hedge.is_some() {
            // Its copy on the largest class carries on: nothing is lost.
            return self.promote_hedge(op, false);
        }
        // An action placed on the worker but never delivered to it (its channel closed
        // first) did not lose a worker: it never had one.
        if job.worker.is_some() {
            job.losses += 1;
        }
        job.worker = None;
        job.dispatched_at = None;
        if job.cancel_requested {
            self.complete(op, cancelled_response())
        } else if job.losses > config.max_worker_losses {
            let losses = job.losses;
            let resp = ExecuteResponse {
                status: Some(status(
                    tonic::Code::Unavailable,
                    format!("the action lost its worker {losses} times (last: {worker}, {why})"),
                )),
                ..Default::default()
            };
            self.complete(op, resp)
        } else {
            job.tx.send_modify(|s| s.stage = Stage::Queued);
            self.d.requeue(id, avoid)
        }
    }

    /// Ends an operation and publishes its response at once (cancelled, failed by the
    /// scheduler). Returns the assignments that follow from the freed slot.
    fn complete(&mut self, op: OpId, response: ExecuteResponse) -> Vec<Assign> {
        let out = self.retire(op);
        if let Some(job) = self.jobs.get(&op) {
            job.tx.send_modify(|s| {
                s.stage = Stage::Completed;
                s.response = Some(Box::new(response));
            });
            if self.in_flight.get(&job.key) == Some(&op) {
                self.in_flight.remove(&job.key);
            }
        }
        out
    }

    /// Takes an operation out of the dispatcher and starts its retention; publishing its
    /// response is up to the caller.
    fn retire(&mut self, op: OpId) -> Vec<Assign> {
        let Some(job) = self.jobs.get_mut(&op) else { return Vec::new() };
        if job.completed_at.is_some() {
            return Vec::new();
        }
        let now = Instant::now();
        job.completed_at = Some(now);
        // Kept only to answer WaitExecution and identical requests for the retention
        // (10 minutes by default, hundreds of thousands of operations on a busy server):
        // the action and command, the bulk of an operation, are not needed for that.
        JobSpec::strip(&mut job.spec);
        let (id, hedged) = (job.id, job.hedge.is_some());
        if id < CALLER_IDS {
            self.promoted.remove(&id);
        }
        self.completed.push_back((now, op));
        let mut out = if hedged { self.drop_hedge(op, true) } else { Vec::new() };
        out.extend(self.d.finish(id));
        out
    }
}

impl Scheduler {
    pub fn new(
        config: SchedulerConfig,
        ac: Arc<dyn ActionCache>,
        log: Arc<dyn ExecutionLog>,
        registry: &prometheus::Registry,
        sizing: Option<crate::sizing::Sizing>,
    ) -> Arc<Self> {
        let g = |n: &str, h: &str| {
            let g = prometheus::IntGauge::new(n, h).expect("valid metric");
            let _ = registry.register(Box::new(g.clone()));
            g
        };
        let completed = prometheus::IntCounterVec::new(
            prometheus::Opts::new("gantry_executions_total", "Executions finished, by outcome"),
            &["outcome"],
        )
        .expect("valid metric");
        let _ = registry.register(Box::new(completed.clone()));
        let gauges = Gauges {
            queued: g("gantry_execution_queue_depth", "Actions waiting for a worker"),
            running: g("gantry_execution_running", "Actions running on workers"),
            workers: g("gantry_execution_workers", "Registered workers"),
            completed: OUTCOMES.map(|o| (o, completed.with_label_values(&[o]))),
        };
        let s = Arc::new(Scheduler {
            stopping: watch::channel(false).0,
            state: Mutex::default(),
            config,
            ac,
            log,
            gauges,
            monitor: Mutex::new(None),
            sizing,
        });
        let weak: Weak<Scheduler> = Arc::downgrade(&s);
        let guard = spawn_named("scheduler-monitor", async move {
            // Hedge times are kept to a tenth of a second; the rest is checked every half.
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            for n in 0u64.. {
                tick.tick().await;
                let Some(s) = weak.upgrade() else { return };
                s.start_hedges(Instant::now());
                if n % 5 == 0 {
                    s.check_workers_and_gc();
                }
            }
        });
        *s.monitor.lock().unwrap_or_else(PoisonError::into_inner) = Some(guard);
        s
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The state, even after a panic while it was held: a panic in one request must not
    /// stop the scheduler for good. Every state change is completed before anything that
    /// can panic, and the invariants stay checkable ([`Scheduler::check_invariants`]); a
    /// recovered lock is logged with what that check finds.
    fn lock(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(poisoned) => {
                let g = poisoned.into_inner();
                self.state.clear_poison();
                let check = check_state(&g);
                tracing::error!(?check, "the scheduler's lock was poisoned by a panic; continuing");
                g
            }
        }
    }

    /// Checks the scheduler's invariants (see [`Dispatcher::check`]); O(everything).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        check_state(&self.lock())
    }

    /// Queues an action (or joins an identical one in flight) and returns the operation
    /// name and a receiver of its state changes.
    pub async fn submit(&self, spec: JobSpec) -> Result<(String, op_watch::Receiver<OpState>)> {
        // With one size class, or no learner, there is nothing to choose or learn: skip
        // the shape key (a SHA-256) and the stats read.
        let mut shape_key = String::new();
        let mut groups = Vec::new();
        if let Some(sizing) = self.sizing.as_ref().filter(|_| self.lock().d.class_count() > 1) {
            shape_key = crate::sizing::shape_key(&spec.action, &spec.requester.configuration_id);
            groups = crate::sizing::shape_groups(
                &spec.requester.action_mnemonic,
                spec.command.arguments.first().map_or("", String::as_str),
                &spec.requester.configuration_id,
            );
            sizing.load(&shape_key).await?;
            sizing.load_priors(&shape_key, &groups).await?;
        }
        // Bazel puts platform properties in both Action.platform and the (deprecated)
        // Command.platform; older clients only in the latter, so both are honoured.
        #[allow(deprecated)]
        let command_platform = spec.command.platform.as_ref();
        let mut required = platform::from_platform(spec.action.platform.as_ref());
        // Bazel sends the same properties in both: read them once.
        if command_platform.is_some_and(|p| Some(p) != spec.action.platform.as_ref()) {
            required.extend(platform::from_platform(command_platform));
            required.sort();
            required.dedup();
        }
        let timeout =
            resolve_timeout(spec.action.timeout.as_ref(), self.config.default_timeout, self.config.max_timeout)?;
        let key = (spec.instance.clone(), spec.action_digest);
        // REAPI: in-flight requests for a do_not_cache action may not be merged.
        let mergeable = !spec.action.do_not_cache;
        let mut st = self.lock();
        if let Some(op) = st.in_flight.get(&key).filter(|_| mergeable).copied() {
            // Joined until its result is published; after that (or once it is deleted)
            // the entry is stale and a new execution starts.
            if let Some(job) = st.jobs.get_mut(&op).filter(|j| !j.published()) {
                if let Some(o) = spec.owner
                    && !job.owners.contains(&o)
                {
                    job.owners.push(o);
                }
                return Ok((String::from(&*job.name), job.tx.subscribe()));
            }
            st.in_flight.remove(&key);
        }
        // The size classes with a worker that can run this action.
        let (required, classes) = st.fit(required)?;
        let largest_class = classes.last().copied().unwrap_or(1);
        let requested_timeout = timeout;
        // The classes may have changed since the key was (not) made.
        if self.sizing.is_some() && classes.len() > 1 && shape_key.is_empty() {
            shape_key = crate::sizing::shape_key(&spec.action, &spec.requester.configuration_id);
        }
        let learning = self.sizing.is_some() && classes.len() > 1;
        let (size_class, timeout, hedge_after) = match (&self.sizing, classes.len()) {
            (Some(sizing), n) if n > 1 => {
                let set = gantry_sizeclass::SizeClasses::new(classes.iter().copied()).expect("non-empty, non-zero");
                let queues = queue_state(&st, &classes);
                match sizing.choose(&shape_key, &groups, &set, timeout, Some(&queues)) {
                    Some(d) => (Some(d.size_class), d.timeout, d.hedge_after),
                    None => (Some(largest_class), timeout, None),
                }
            }
            (_, 1) => (classes.first().copied(), timeout, None),
            _ => (None, timeout, None),
        };
        // A run on a smaller class still going at this time gets a copy on the largest.
        let hedge_at = hedge_after.filter(|_| size_class < Some(largest_class)).map(|h| Instant::now() + h);
        // A fresh number: two names whose UUIDs share their low half (one in 2^62) would share
        // it, so the later one is drawn again. A forgotten operation's number may come back
        // at those odds: retention checks that an entry is the operation's own, and a stale
        // hedge time at worst hedges the newcomer early.
        let (name, op, name_high) = loop {
            let (name, op, high) = st.names.next();
            if !st.jobs.contains_key(&op) {
                break (Name::from(name), op, high);
            }
        };
        let state =
            OpState { name: name.clone(), stage: Stage::Queued, action_digest: spec.action_digest, response: None };
        let (tx, rx) = op_watch::channel(state);
        let id = op;
        st.submissions += 1;
        let submitted = st.submissions;
        let assigns = st.d.submit_as(id, spec.priority, required.clone(), size_class);
        if let Some(at) = hedge_at {
            st.hedge_due.insert((at, id));
        }
        if mergeable {
            st.in_flight.insert(key.clone(), op);
        }
        st.jobs.insert(
            op,
            Box::new(Job {
                id,
                op,
                name: name.clone(),
                name_high,
                submitted,
                key,
                owners: spec.owner.iter().cloned().collect(),
                spec: Arc::new(spec),
                timeout,
                queued_at: SystemTime::now(),
                worker: None,
                dispatched_at: None,
                losses: 0,
                cancel_requested: false,
                size_class,
                trial: Trial {
                    groups,
                    // Only a learned class updates its groups' priors.
                    classes: if learning { classes.to_vec() } else { Vec::new() },
                    ..Trial::new(learning, largest_class, requested_timeout, shape_key)
                },
                required,
                hedge: None,
                promoted: false,
                tx,
                completed_at: None,
            }),
        );
        st.apply(&self.config, assigns);
        self.update_gauges(&st);
        Ok((String::from(&*name), rx))
    }

    fn update_gauges(&self, st: &State) {
        self.gauges.queued.set(st.d.queued() as i64);
        self.gauges.running.set(st.d.running() as i64);
        self.gauges.workers.set(st.workers.len() as i64);
    }

    /// Registers a worker; `local` workers (in-process) are never timed out.
    pub fn register(&self, reg: wpb::Register, local: bool) -> Result<WorkerLink> {
        if reg.worker_id.is_empty() {
            return Err(Error::invalid("register.worker_id: required"));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let mut props: Vec<Property> =
            reg.properties.iter().map(|p| Property { name: p.name.clone(), value: p.value.clone() }).collect();
        props.sort();
        props.dedup();
        let size_class = reg.size_class.max(1);
        let mut st = self.lock();
        if st.workers.contains_key(&reg.worker_id) {
            return Err(Error::FailedPrecondition(format!("worker id {} is already registered", reg.worker_id)));
        }
        let (id, assigns) = st.d.add_worker(props.into(), size_class, reg.slots.max(1) as usize);
        st.worker_names.insert(id, reg.worker_id.as_str().into());
        st.workers.insert(
            reg.worker_id.clone(),
            WorkerEntry {
                id,
                overdue: HashMap::new(),
                tx,
                last_seen: Instant::now(),
                local,
                size_class,
                metering: reg.metering.clone(),
            },
        );
        tracing::info!(worker = %reg.worker_id, slots = reg.slots, local, "worker registered");
        st.apply(&self.config, assigns);
        self.update_gauges(&st);
        Ok(WorkerLink { id: reg.worker_id, messages: rx })
    }

    /// Registers an in-process worker and bridges it to the scheduler. The worker reads
    /// its orders from the returned receiver (the scheduler's values, not the wire form)
    /// and reports on the sender; the bridge task lives as long as the guard.
    pub fn attach_local(
        self: &Arc<Self>,
        reg: wpb::Register,
    ) -> Result<(mpsc::UnboundedReceiver<gantry_core::Order>, mpsc::UnboundedSender<gantry_core::Report>, TaskGuard)>
    {
        let mut link = self.register(reg, true)?;
        let (report_tx, mut reports) = mpsc::unbounded_channel::<gantry_core::Report>();
        let (to_worker, worker_rx) = mpsc::unbounded_channel::<gantry_core::Order>();
        let s = self.clone();
        let id = link.id.clone();
        let guard = spawn_named("local-worker-bridge", async move {
            loop {
                tokio::select! {
                    m = link.messages.recv() => match m {
                        Some(m) if to_worker.send(m.to_order()).is_ok() => {}
                        _ => break,
                    },
                    r = reports.recv() => match r {
                        Some(gantry_core::Report::Started { job_id }) => s.started(&id, &job_id),
                        Some(gantry_core::Report::Finished(f)) => {
                            // Detached, like remote sessions: a result is always saved.
                            let (s, id) = (s.clone(), id.clone());
                            tokio::spawn(async move { s.finished(&id, *f).await });
                        }
                        Some(gantry_core::Report::Heartbeat) => s.heartbeat(&id),
                        None => break,
                    },
                }
            }
            s.worker_lost(&id, "in-process worker stopped");
        });
        Ok((worker_rx, report_tx, guard))
    }

    pub fn heartbeat(&self, worker: &str) {
        if let Some(w) = self.lock().workers.get_mut(worker) {
            w.last_seen = Instant::now();
        }
    }

    pub fn started(&self, worker: &str, job_id: &str) {
        let mut st = self.lock();
        if let Some(w) = st.workers.get_mut(worker) {
            w.last_seen = Instant::now();
        }
        if let Some(job) = st.job_named(split_wire_id(job_id).0).filter(|j| j.worker.as_deref() == Some(worker)) {
            job.tx.send_modify(|s| s.stage = Stage::Executing);
        }
    }

    /// A worker reports a finished (or failed, timed-out, cancelled) execution. The
    /// scheduler's part is one locked state transition; the durable writes (size-class
    /// stats, action cache, execution log) follow outside the lock, together, and only
    /// once all three are done is the result published.
    pub async fn finished(&self, worker: &str, mut f: gantry_core::Finished) {
        // Taken, not copied: the locked transition reads none of them.
        let mut result = f.action_result.take();
        let mut code = f.status_code;
        let mut message = std::mem::take(&mut f.status_message);
        if code == 0 && result.is_none() {
            code = tonic::Code::Internal as i32;
            message = "worker returned no result".into();
        }
        let no_metering = gantry_core::Metering::default();
        let m = f.metering.as_ref().unwrap_or(&no_metering);
        let wall = Duration::from_secs_f64(m.wall_seconds.max(0.0));
        let this_outcome = crate::sizing::outcome(code, result.as_ref().map(|r| r.exit_code), wall, f.out_of_memory);
        let after = self.transition(worker, &f, code, m, this_outcome, result.as_ref().map(|r| r.exit_code));
        let fin = match after {
            After::Nothing => return,
            After::Retried { record, from_class } => {
                if let Some(s) = &self.sizing {
                    s.retries.with_label_values(&[&from_class.to_string()]).inc();
                }
                if let Err(e) = self.log.record(&record).await {
                    tracing::error!(action = %record.action_digest, error = %e, "could not record the execution");
                }
                return;
            }
            After::Logged(record) => {
                if let Err(e) = self.log.record(&record).await {
                    tracing::error!(action = %record.action_digest, error = %e, "could not record the execution");
                }
                return;
            }
            After::Final(fin) => fin,
        };
        let Finale { mut record, instance, digest, do_not_cache, queued_at, learn, tx } = *fin;
        if let Some(r) = result.as_mut() {
            let md = r.execution_metadata.get_or_insert_with(Default::default);
            md.worker = worker.to_string();
            md.queued_timestamp = Some(timestamp(queued_at));
        }
        record.exit_code = result.as_ref().map_or(-1, |r| r.exit_code);
        if let Some(md) = result.as_ref().and_then(|r| r.execution_metadata.as_ref())
            && let (Some(q), Some(s)) = (&md.queued_timestamp, &md.worker_start_timestamp)
        {
            record.queued_seconds = ((s.seconds - q.seconds) as f64 + (s.nanos - q.nanos) as f64 / 1e9).max(0.0);
        }
        // Only successful runs are cached: a failure may be flaky or environmental.
        let cacheable = code == 0 && result.as_ref().is_some_and(|r| r.exit_code == 0) && !do_not_cache;
        // The three durable writes are independent of each other, and all are done before
        // the result is published. Issued together, they share one commit of a SQLite
        // database's group commit instead of waiting for three fsyncs in a row.
        let notes = learn.as_ref().map(|l| l.notes.clone()).unwrap_or_default();
        let learned = async {
            if let (Some(sizing), Some(l)) = (&self.sizing, &learn) {
                sizing.record(&l.shape_key, l.largest_class, l.execution, &l.groups, &l.classes).await;
            }
        };
        let cached = async {
            match cacheable {
                true => self.ac.put(&instance, &digest, result.as_ref().expect("cacheable")).await,
                false => Ok(()),
            }
        };
        let (_, cached, logged) = tokio::join!(learned, cached, self.log.record(&record));
        if let Err(e) = cached {
            tracing::error!(action = %digest, error = %e, "could not store the action result");
            message = format!("{message}{}result not cached: {e}", if message.is_empty() { "" } else { "; " });
        }
        if let Err(e) = logged {
            tracing::error!(action = %digest, error = %e, "could not record the execution");
        }
        let outcome = match (code, result.as_ref().map(|r| r.exit_code)) {
            (0, _) if f.out_of_memory => "out_of_memory",
            (0, Some(0)) => "success",
            (0, _) => "nonzero_exit",
            (c, _) if c == tonic::Code::DeadlineExceeded as i32 => "timeout",
            (c, _) if c == tonic::Code::Cancelled as i32 => "cancelled",
            _ => "error",
        };
        self.gauges.completed(outcome).inc();
        let mut human = if f.message.is_empty() { message.clone() } else { std::mem::take(&mut f.message) };
        if !notes.is_empty() {
            human = if human.is_empty() { notes } else { format!("{human}; {notes}") };
        }
        let details = if f.missing_blobs.is_empty() {
            vec![]
        } else {
            vec![gantry_core::error::missing_details(std::mem::take(&mut f.missing_blobs).into_iter())]
        };
        let response = ExecuteResponse {
            result,
            cached_result: false,
            status: Some(RpcStatus { code, message, details }),
            server_logs: Default::default(),
            message: human,
        };
        tx.send_modify(|s| {
            s.stage = Stage::Completed;
            s.response = Some(Box::new(response));
        });
    }

    /// The locked part of [`Scheduler::finished`].
    fn transition(
        &self,
        worker: &str,
        f: &gantry_core::Finished,
        code: i32,
        m: &gantry_core::Metering,
        this_outcome: gantry_sizeclass::Outcome,
        exit_code: Option<i32>,
    ) -> After {
        let job_id = f.job_id.as_str();
        let mut st = self.lock();
        let st = &mut *st;
        let now = Instant::now();
        st.expire(now, self.config.completed_retention, EXPIRE_PER_FINISH);
        let Some(w) = st.workers.get_mut(worker) else { return After::Nothing };
        w.last_seen = now;
        let (wid, size_class) = (w.id, w.size_class);
        // Nearly always empty; a removal would hash the job id all the same.
        if !w.overdue.is_empty()
            && let Some(id) = w.overdue.remove(job_id)
        {
            // The late report of an action taken back: its slot is free again, the action
            // itself is queued or running elsewhere.
            let assigns = st.d.late_report(wid, id).unwrap_or_default();
            st.apply(&self.config, assigns);
            self.update_gauges(st);
            // Its cost was spent all the same (a hedge's loser, an overdue run): logged.
            return match st.job_named(split_wire_id(job_id).0) {
                Some(job) => After::Logged(Box::new(run_record(job, worker, size_class, code, exit_code, m))),
                None => After::Nothing,
            };
        }
        let (name, is_hedge) = split_wire_id(job_id);
        let Some(op) = st.op_named(name) else { return After::Nothing };
        let job = st.jobs.get_mut(&op).expect("named operations exist");
        let primary =
            is_hedge == job.promoted && job.worker.as_deref() == Some(worker) && st.d.worker_of(job.id) == Some(wid);
        let hedge = is_hedge
            && !job.promoted
            && job
                .hedge
                .as_ref()
                .is_some_and(|h| h.worker.as_deref() == Some(worker) && st.d.worker_of(h.id) == Some(wid));
        if job.completed_at.is_some() || !(primary || hedge) {
            // A stale report from a worker the action was taken away from.
            return After::Nothing;
        }
        let avg = st.class_avg_seconds.entry(size_class).or_insert(m.wall_seconds.max(0.001));
        *avg = 0.8 * *avg + 0.2 * m.wall_seconds;
        let record = run_record(job, worker, size_class, code, exit_code, m);
        let run = RunEnd {
            class: size_class,
            code,
            outcome: this_outcome,
            wall_seconds: m.wall_seconds,
            out_of_memory: f.out_of_memory,
        };
        let ran = code == 0 || code == tonic::Code::DeadlineExceeded as i32;
        if hedge && !ran {
            // The copy could not run (an input went missing, its worker failed): the first
            // run goes on alone.
            let assigns = st.drop_hedge(op, false);
            st.apply(&self.config, assigns);
            self.update_gauges(st);
            return After::Logged(Box::new(record));
        }
        if hedge {
            // The copy on the largest class decides, whatever its outcome: the first run is
            // cancelled, and has taken at least as long as it ran.
            let first_class = job.size_class.unwrap_or(size_class);
            let ran_for = job.dispatched_at.map(|t| t.elapsed()).unwrap_or_default();
            job.trial.hedge_won(first_class, ran_for);
            let assigns = st.promote_hedge(op, true);
            st.apply(&self.config, assigns);
        } else if job.hedge.is_some() {
            if this_outcome.is_success() {
                job.trial.first_won(size_class);
                let assigns = st.drop_hedge(op, true);
                st.apply(&self.config, assigns);
            } else {
                // The first run failed (or could not run): the copy decides.
                job.trial.retry_after(job.size_class, &run, job.cancel_requested);
                let assigns = st.promote_hedge(op, false);
                st.apply(&self.config, assigns);
                self.update_gauges(st);
                return After::Logged(Box::new(record));
            }
        }
        let job = st.jobs.get_mut(&op).expect("checked above");
        if let Some(class) = job.trial.retry_after(job.size_class, &run, job.cancel_requested) {
            job.size_class = Some(class);
            job.timeout = job.trial.requested_timeout;
            job.worker = None;
            job.dispatched_at = None;
            job.tx.send_modify(|s| s.stage = Stage::Queued);
            let mut assigns = st.d.detach(job.id);
            assigns.extend(st.d.set_class(job.id, job.size_class));
            st.apply(&self.config, assigns);
            self.update_gauges(st);
            return After::Retried { record: Box::new(record), from_class: size_class };
        }
        let learn = job.trial.learned(&run);
        let fin = Finale {
            record,
            instance: job.spec.instance.clone(),
            digest: job.spec.action_digest,
            do_not_cache: job.spec.action.do_not_cache,
            queued_at: job.queued_at,
            learn,
            tx: job.tx.clone(),
        };
        let assigns = st.retire(op);
        st.apply(&self.config, assigns);
        self.update_gauges(st);
        After::Final(Box::new(fin))
    }

    /// Every action on a smaller class still going at its hedge time gets a copy on the
    /// largest class; one still queued there is moved to the largest class instead.
    fn start_hedges(&self, now: Instant) {
        let mut st = self.lock();
        let st = &mut *st;
        let Some(&(first, _)) = st.hedge_due.first() else { return };
        if first > now {
            return;
        }
        let later = st.hedge_due.split_off(&(now, JobId::MAX));
        let due = std::mem::replace(&mut st.hedge_due, later);
        let mut assigns = Vec::new();
        for (_, id) in due {
            let Some(op) = st.live_op(id) else { continue };
            let job = st.jobs.get_mut(&op).expect("live jobs exist");
            let largest = job.trial.largest_class;
            let Some(class) = job.size_class.filter(|&c| c < largest) else { continue };
            if job.hedge.is_some() || job.promoted || job.cancel_requested || job.completed_at.is_some() {
                continue;
            }
            let after = job.queued_at.elapsed().unwrap_or_default();
            let queued = st.d.is_queued(id);
            if queued {
                job.size_class = Some(largest);
                assigns.extend(st.d.set_class(id, Some(largest)));
            } else if st.d.worker_of(id).is_some() {
                let (hid, placed) = st.d.submit(job.spec.priority, job.required.clone(), Some(largest));
                job.hedge = Some(HedgeRun { id: hid, worker: None, dispatched_at: None });
                st.hedges.insert(hid, op);
                assigns.extend(placed);
            } else {
                continue;
            }
            job.trial.hedge(class, after, queued);
            if let Some(s) = &self.sizing {
                s.hedges.with_label_values(&[class.to_string().as_str(), if queued { "move" } else { "copy" }]).inc();
            }
        }
        st.apply(&self.config, assigns);
        self.update_gauges(st);
    }

    /// Removes a worker and re-queues what it was running.
    pub fn worker_lost(&self, worker: &str, why: &str) {
        let mut st = self.lock();
        let assigns = st.remove_worker(&self.config, worker, why);
        st.apply(&self.config, assigns);
        self.update_gauges(&st);
    }

    /// Takes back every action whose worker is still connected but has not reported it
    /// past its timeout plus the grace: the worker is told to cancel it, and the action is
    /// re-queued as if the worker had been lost (but never to that worker again).
    fn reclaim_overdue(&self, now: Instant) {
        let mut st = self.lock();
        let grace = self.config.timeout_grace;
        let late: Vec<(JobId, OpId, String, Duration, bool)> = st
            .workers
            .iter()
            .flat_map(|(wname, w)| st.d.running_on(w.id).map(move |j| (j, wname)))
            .filter_map(|(id, wname)| {
                let (hedge, op) = match st.live_op(id) {
                    Some(op) => (false, op),
                    None => (true, *st.hedges.get(&id)?),
                };
                let job = &st.jobs[&op];
                let (at, timeout) = match &job.hedge {
                    Some(h) if hedge => (h.dispatched_at?, job.trial.requested_timeout),
                    _ => (job.dispatched_at?, job.timeout),
                };
                overdue(at, timeout, grace, now).then(|| (id, op, wname.clone(), timeout, hedge))
            })
            .collect();
        if late.is_empty() {
            return;
        }
        let mut assigns = Vec::new();
        for (id, op, worker, timeout, hedge) in late {
            let why = format!("no result {:.0?} after its {timeout:.0?} timeout", grace);
            tracing::warn!(worker = %worker, operation = %st.jobs[&op].name, hedge, "{why}; taking the action back");
            if hedge {
                assigns.extend(st.drop_hedge(op, true));
                continue;
            }
            let wire = st.jobs[&op].wire(false);
            let avoid = st.d.take_back(id);
            if let Some(w) = st.workers.get_mut(&worker) {
                w.overdue.insert(wire.clone(), id);
                let _ = w.tx.send(ToWorker::Cancel(wire));
            }
            assigns.extend(st.lose_job(&self.config, id, &worker, &why, avoid));
        }
        st.apply(&self.config, assigns);
        self.update_gauges(&st);
    }

    /// Cancels an operation: a queued one completes as CANCELLED at once, a running one
    /// when its worker has killed the process. `by` is the caller when it may touch only
    /// its own operations (None: an administrator). An operation another identity shares
    /// keeps running for that identity; the caller only lets go of it.
    pub fn cancel(&self, name: &str, by: Option<&str>) -> Result<()> {
        let mut st = self.lock();
        let op = st.op_named(name).ok_or_else(|| not_found(name))?;
        let job = st.jobs.get_mut(&op).filter(|j| may_touch(j, by)).ok_or_else(|| not_found(name))?;
        if job.completed_at.is_some() {
            return Ok(());
        }
        if let Some(who) = by
            && job.owners.len() > 1
        {
            job.owners.retain(|o| o != who);
            return Ok(());
        }
        job.cancel_requested = true;
        let key = job.key.clone();
        let (id, worker, wire) = (job.id, job.worker.clone(), job.wire(false));
        let mut assigns = st.drop_hedge(op, true);
        // New requests for the same action start afresh instead of joining a cancelled one.
        if st.in_flight.get(&key) == Some(&op) {
            st.in_flight.remove(&key);
        }
        match worker.filter(|_| st.d.worker_of(id).is_some()) {
            None => assigns.extend(st.complete(op, cancelled_response())),
            Some(w) => {
                if let Some(w) = st.workers.get(&*w) {
                    let _ = w.tx.send(ToWorker::Cancel(wire));
                }
            }
        }
        st.apply(&self.config, assigns);
        self.update_gauges(&st);
        Ok(())
    }

    /// Ends every worker session and operation stream with UNAVAILABLE (see `stopping`).
    pub fn shutdown(&self) {
        self.stopping.send_replace(true);
    }

    /// Resolves once `shutdown` has been called.
    pub fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.stopping.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }

    pub fn watch(&self, name: &str) -> Option<op_watch::Receiver<OpState>> {
        let st = self.lock();
        st.job_named(name).map(|j| j.tx.subscribe())
    }

    /// Operations in submission order: all of them, or those `owner` shares.
    pub fn list(&self, owner: Option<&str>) -> Vec<OpState> {
        let st = self.lock();
        let mut v: Vec<_> =
            st.jobs.values().filter(|j| may_touch(j, owner)).map(|j| (j.submitted, j.tx.borrow().clone())).collect();
        v.sort_by_key(|(s, _)| *s);
        v.into_iter().map(|(_, s)| s).collect()
    }

    /// Forgets a finished operation. Running ones cannot be deleted (cancel them first).
    /// `by` as for [`Scheduler::cancel`].
    pub fn delete(&self, name: &str, by: Option<&str>) -> Result<()> {
        let mut st = self.lock();
        match st.job_named(name).filter(|j| may_touch(j, by)) {
            None => Err(not_found(name)),
            Some(j) if !j.published() => Err(Error::FailedPrecondition(format!(
                "operation {} is still running; cancel it first",
                shown_name(name)
            ))),
            Some(j) => {
                let op = j.op;
                st.forget(op);
                Ok(())
            }
        }
    }

    /// The worker an operation's action is on, if it is running.
    pub fn worker_of(&self, name: &str) -> Option<String> {
        let st = self.lock();
        st.job_named(name).and_then(|j| j.worker.as_deref().map(str::to_string))
    }

    pub fn worker_count(&self) -> usize {
        self.lock().workers.len()
    }

    /// Metering method of each registered worker (for status and logs).
    pub fn worker_metering(&self) -> Vec<(String, String)> {
        let st = self.lock();
        st.workers.iter().map(|(id, w)| (id.clone(), w.metering.clone())).collect()
    }

    fn check_workers_and_gc(&self) {
        let lost: Vec<String> = {
            let st = self.lock();
            st.workers
                .iter()
                .filter(|(_, w)| !w.local && w.last_seen.elapsed() > self.config.heartbeat_timeout)
                .map(|(id, _)| id.clone())
                .collect()
        };
        for w in lost {
            self.worker_lost(&w, "missed heartbeats");
        }
        self.reclaim_overdue(Instant::now());
        let mut st = self.lock();
        st.expire(Instant::now(), self.config.completed_retention, usize::MAX);
        st.d.compact();
    }
}

impl gantry_core::Fleet for Scheduler {
    /// One pass over the workers, their runs and the non-empty queues, under the lock
    /// (no await inside), for the live pages.
    fn snapshot(&self) -> gantry_core::FleetSnapshot {
        use gantry_core::{FleetSnapshot, QueueView, RunningView, WorkerView};
        let pairs = |p: &[crate::platform::Property]| p.iter().map(|p| (p.name.clone(), p.value.clone())).collect();
        let st = self.lock();
        let now = Instant::now();
        let mut workers: Vec<WorkerView> = st
            .workers
            .iter()
            .map(|(name, w)| {
                let (slots, busy) = st.d.slots_of(w.id).unwrap_or_default();
                let running = st
                    .d
                    .running_on(w.id)
                    .filter_map(|id| {
                        let (op, hedge) = match (st.live_op(id), st.hedges.get(&id)) {
                            (Some(op), _) => (op, false),
                            (None, Some(&op)) => (op, true),
                            (None, None) => return None,
                        };
                        let job = st.jobs.get(&op)?;
                        let since =
                            if hedge { job.hedge.as_ref().and_then(|h| h.dispatched_at) } else { job.dispatched_at };
                        Some(RunningView {
                            operation: job.name.to_string(),
                            instance: job.spec.instance.clone(),
                            action_digest: job.spec.action_digest.to_string(),
                            mnemonic: job.spec.requester.action_mnemonic.clone(),
                            target: job.spec.requester.target_id.clone(),
                            tool_invocation_id: job.spec.requester.tool_invocation_id.clone(),
                            running_ms: since.map_or(0, |t| now.saturating_duration_since(t).as_millis() as u64),
                            hedge,
                        })
                    })
                    .collect();
                WorkerView {
                    name: name.clone(),
                    size_class: w.size_class,
                    slots,
                    busy,
                    platform: st.d.offered_by(w.id).map(|p| pairs(p)).unwrap_or_default(),
                    last_seen_ms: now.saturating_duration_since(w.last_seen).as_millis() as u64,
                    local: w.local,
                    metering: w.metering.clone(),
                    running,
                }
            })
            .collect();
        workers.sort_by(|a, b| (a.size_class, &a.name).cmp(&(b.size_class, &b.name)));
        let mut queues: Vec<QueueView> =
            st.d.queue_depths()
                .map(|(p, size_class, depth)| QueueView { platform: pairs(p), size_class, depth })
                .collect();
        queues.sort_by(|a, b| (&a.platform, a.size_class).cmp(&(&b.platform, b.size_class)));
        FleetSnapshot { workers, queues, queued: st.d.queued(), running: st.d.running() }
    }
}

/// The execution log's record of one run of `job` on `worker`.
fn run_record(
    job: &Job,
    worker: &str,
    size_class: u32,
    code: i32,
    exit_code: Option<i32>,
    m: &gantry_core::Metering,
) -> ActionRecord {
    ActionRecord {
        // `String::from`, not `to_string`: an `Arc<str>` formats through `Display`.
        operation: String::from(&*job.name),
        instance: job.spec.instance.clone(),
        action_digest: job.spec.action_digest.to_string(),
        tool_invocation_id: job.spec.requester.tool_invocation_id.clone(),
        action_mnemonic: job.spec.requester.action_mnemonic.clone(),
        target_id: job.spec.requester.target_id.clone(),
        worker: worker.to_string(),
        size_class,
        exit_code: exit_code.unwrap_or(-1),
        status_code: code,
        peak_memory_bytes: m.peak_memory_bytes,
        user_cpu_seconds: m.user_cpu_seconds,
        system_cpu_seconds: m.system_cpu_seconds,
        wall_seconds: m.wall_seconds,
        queued_seconds: 0.0,
        metering: m.method.clone(),
        completed_unix_ms: now_ms(SystemTime::now()),
        shape_key: job.trial.shape_key.clone(),
    }
}

/// Expected wait and idle slots per size class, for queue-aware class choice.
fn queue_state(st: &State, classes: &[u32]) -> gantry_sizeclass::QueueState {
    let loads = st.d.class_loads();
    let mut q = gantry_sizeclass::QueueState::new();
    for &c in classes {
        let l = loads.get(&c).copied().unwrap_or_default();
        let avg = st.class_avg_seconds.get(&c).copied().unwrap_or(1.0);
        let wait = if l.idle > 0 { 0.0 } else { (l.queued + 1) as f64 * avg / l.slots.max(1) as f64 };
        q.set(
            c,
            gantry_sizeclass::ClassQueue { expected_wait: Duration::from_secs_f64(wait), idle_workers: l.idle as u32 },
        );
    }
    q
}

/// The dispatcher's invariants, and that the scheduler's maps agree with it.
fn check_state(st: &State) -> std::result::Result<(), String> {
    st.d.check()?;
    for (op, job) in &st.jobs {
        if job.op != *op || op_of_name(&job.name) != Some((*op, job.name_high)) {
            return Err(format!("operation {} is out of step with its name", job.name));
        }
    }
    // An action in flight names an operation still kept, for that action.
    for (key, op) in &st.in_flight {
        if st.jobs.get(op).is_none_or(|j| &j.key != key) {
            return Err(format!("the action {} in flight names operation #{op}, which is not its", key.1));
        }
    }
    for (id, op) in &st.promoted {
        let job = st.jobs.get(op).ok_or(format!("promoted operation #{op} is missing"))?;
        if job.id != *id || !job.promoted || job.completed_at.is_some() || *id >= CALLER_IDS {
            return Err(format!("the hedge copy that took over {} is out of step", job.name));
        }
    }
    let mut live = 0;
    for (op, job) in st.jobs.iter().filter(|(_, j)| j.completed_at.is_none()) {
        live += 1;
        let name = &job.name;
        if (job.id >= CALLER_IDS) != (job.id == *op)
            || job.promoted != (job.id < CALLER_IDS)
            || (job.id < CALLER_IDS && st.promoted.get(&job.id) != Some(op))
        {
            return Err(format!("live operation {name} runs under an id that is not its own"));
        }
        if !st.d.is_queued(job.id) && st.d.worker_of(job.id).is_none() {
            return Err(format!("operation {name} is neither queued nor running"));
        }
    }
    for (id, op) in &st.hedges {
        let job = st.jobs.get(op).ok_or(format!("hedged operation #{op} is missing"))?;
        let name = &job.name;
        if job.hedge.as_ref().map(|h| h.id) != Some(*id) || job.completed_at.is_some() || job.promoted {
            return Err(format!("hedge copy of {name} is out of step"));
        }
        if !st.d.is_queued(*id) && st.d.worker_of(*id).is_none() {
            return Err(format!("hedge copy of {name} is neither queued nor running"));
        }
    }
    let held = live + st.hedges.len();
    if st.d.queued() + st.d.running() != held {
        return Err(format!("{held} live runs, dispatcher holds {}", st.d.queued() + st.d.running()));
    }
    Ok(())
}

fn cancelled_response() -> ExecuteResponse {
    ExecuteResponse { status: Some(status(tonic::Code::Cancelled, "cancelled")), ..Default::default() }
}

/// The digest function and digest of an assignment, decoded.
pub fn assignment_digest(a: &wpb::Assignment) -> Result<Digest> {
    let f = DigestFunction::from_proto(a.digest_function)?;
    let d =
        reapi::Digest::decode(a.action_digest.as_slice()).map_err(|e| Error::invalid(format!("action_digest: {e}")))?;
    Digest::from_proto(f, Some(&d), "action_digest")
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_core::reapi::platform::Property as PProp;

    #[test]
    fn a_retired_spec_drops_its_action_in_place_unless_a_worker_still_holds_it() {
        let mut alone = spec("alone", 0, &[("os", "linux")]);
        Arc::make_mut(&mut alone.action).do_not_cache = true;
        let mut alone = Arc::new(alone);
        let before = Arc::as_ptr(&alone);
        JobSpec::strip(&mut alone);
        assert_eq!(Arc::as_ptr(&alone), before, "nothing else held it: stripped in place");
        assert!(alone.action.platform.is_none() && alone.command.arguments.is_empty());
        assert!(alone.action.do_not_cache, "do_not_cache is kept");

        let mut shared = Arc::new(spec("shared", 0, &[("os", "linux")]));
        let worker_copy = shared.clone();
        JobSpec::strip(&mut shared);
        assert!(!Arc::ptr_eq(&shared, &worker_copy));
        assert!(shared.action.platform.is_none() && shared.command.arguments.is_empty());
        assert_eq!(worker_copy.command.arguments, ["true"], "the worker's copy is untouched");
        assert!(worker_copy.action.platform.is_some());
        assert_eq!(shared.action_digest, worker_copy.action_digest);
        assert!(Arc::ptr_eq(&alone.command, &shared.command), "retiring allocates no command");
    }

    #[tokio::test]
    async fn operations_share_one_copy_of_their_platform() {
        let s = scheduler(3).await;
        let _w = s.register(reg("w", 1, &[("os", "linux"), ("pool", "x")]), true).unwrap();
        let (a, _) = s.submit(spec("a", 0, &[("pool", "x"), ("os", "linux")])).await.unwrap();
        let (b, _) = s.submit(spec("b", 0, &[("os", "linux"), ("pool", "x")])).await.unwrap();
        let (c, _) = s.submit(spec("c", 0, &[("os", "linux")])).await.unwrap();
        let st = s.lock();
        let required = |n: &str| st.job_named(n).unwrap().required.clone();
        assert!(Arc::ptr_eq(&required(&a), &required(&b)), "one copy, whatever the order");
        assert!(!Arc::ptr_eq(&required(&a), &required(&c)));
        assert_eq!(st.platforms.len(), 2);
    }

    #[tokio::test]
    async fn an_operation_is_found_by_the_exact_name_it_was_given_and_no_other() {
        let s = scheduler(3).await;
        let _w = s.register(reg("w", 1, &[("os", "linux")]), true).unwrap();
        let (name, _) = s.submit(spec("a", 0, &[("os", "linux")])).await.unwrap();
        let (op, high) = op_of_name(&name).expect("a name it made reads back");
        assert!(op >= CALLER_IDS, "never an id the dispatcher makes itself");
        let uuid = &name[NAME_PREFIX.len()..];
        let other_forms = [
            format!("{NAME_PREFIX}{}", uuid.to_uppercase()),
            format!("{NAME_PREFIX}{}", uuid.replace('-', "")),
            format!("{NAME_PREFIX}{{{uuid}}}"),
            format!("operations/urn:uuid:{uuid}"),
            uuid.to_string(),
        ];
        for forged in &other_forms {
            assert_eq!(op_of_name(forged), None, "{forged}");
        }
        // The same low half (the operation's number) under another high half: a name it
        // never gave, which must not reach the operation.
        let sibling = uuid::Uuid::from_u128((u128::from(!high) << 64) | u128::from(op));
        let sibling = format!("{NAME_PREFIX}{sibling}");
        assert_eq!(op_of_name(&sibling).map(|(o, _)| o), Some(op));
        // The variant's first bit cleared (the fourth group's first digit 8-b made 0-3):
        // the same number if that bit were ignored.
        let cleared = uuid::Uuid::from_u128((u128::from(high) << 64) | u128::from(op & !CALLER_IDS));
        let cleared = format!("{NAME_PREFIX}{cleared}");
        assert_ne!(cleared, name);
        assert_eq!(op_of_name(&cleared), None, "{cleared}");
        for forged in other_forms.iter().chain([&sibling, &cleared]) {
            assert!(matches!(s.cancel(forged, None), Err(Error::NotFound(_))), "{forged}");
        }
        assert!(s.lock().job_named(&name).is_some_and(|j| !j.cancel_requested));
        s.cancel(&name, None).unwrap();
        assert!(s.lock().job_named(&name).unwrap().cancel_requested);
        s.check_invariants().unwrap();
    }

    async fn scheduler(max_losses: u32) -> Arc<Scheduler> {
        let db = gantry_store::MetadataDb::open("sqlite::memory:").await.unwrap();
        let ac = Arc::new(gantry_store::SqlActionCache::new(db.clone()));
        let log = Arc::new(gantry_store::SqlExecutionLog::new(db));
        let cfg = SchedulerConfig { max_worker_losses: max_losses, ..Default::default() };
        Scheduler::new(cfg, ac, log, &prometheus::Registry::new(), None)
    }

    fn spec(tag: &str, priority: i32, props: &[(&str, &str)]) -> JobSpec {
        let action = reapi::Action {
            platform: Some(reapi::Platform {
                properties: props.iter().map(|(n, v)| PProp { name: n.to_string(), value: v.to_string() }).collect(),
            }),
            ..Default::default()
        };
        JobSpec {
            instance: String::new(),
            action_digest: DigestFunction::Sha256.digest_of(tag.as_bytes()),
            action: action.into(),
            command: reapi::Command { arguments: vec!["true".into()], ..Default::default() }.into(),
            priority,
            requester: Requester::default(),
            owner: None,
        }
    }

    fn reg(id: &str, slots: u32, props: &[(&str, &str)]) -> wpb::Register {
        wpb::Register {
            worker_id: id.into(),
            properties: props
                .iter()
                .map(|(n, v)| wpb::Property { name: n.to_string(), value: v.to_string() })
                .collect(),
            slots,
            size_class: 1,
            metering: "rusage".into(),
        }
    }

    fn assigned(link: &mut WorkerLink) -> Vec<String> {
        let mut v = Vec::new();
        while let Ok(m) = link.messages.try_recv() {
            if let ToWorker::Assign(a) = m {
                v.push(a.job_id.clone());
            }
        }
        v
    }

    fn finished_ok(job: &str) -> gantry_core::Finished {
        gantry_core::Finished {
            job_id: job.into(),
            action_result: Some(reapi::ActionResult { exit_code: 0, ..Default::default() }),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn priority_then_fifo_order() {
        let s = scheduler(3).await;
        let (a, _) = s.submit(spec("a", 5, &[])).await.unwrap();
        let (b, _) = s.submit(spec("b", 1, &[])).await.unwrap();
        let (c, _) = s.submit(spec("c", 5, &[])).await.unwrap();
        let (d, _) = s.submit(spec("d", -1, &[])).await.unwrap();
        let mut w = s.register(reg("w", 1, &[]), true).unwrap();
        let mut order = Vec::new();
        for _ in 0..4 {
            let got = assigned(&mut w);
            assert_eq!(got.len(), 1, "one slot: one assignment at a time");
            order.push(got[0].clone());
            s.finished("w", finished_ok(&got[0])).await;
        }
        assert_eq!(order, vec![d, b, a, c], "lower priority value first, FIFO within a priority");
    }

    #[tokio::test]
    async fn executions_are_counted_by_outcome_and_completed_operations_expire() {
        let db = gantry_store::MetadataDb::open("sqlite::memory:").await.unwrap();
        let ac = Arc::new(gantry_store::SqlActionCache::new(db.clone()));
        let log = Arc::new(gantry_store::SqlExecutionLog::new(db));
        let registry = prometheus::Registry::new();
        let cfg = SchedulerConfig { completed_retention: Duration::ZERO, ..Default::default() };
        let s = Scheduler::new(cfg, ac, log, &registry, None);
        let mut w = s.register(reg("w", 1, &[]), true).unwrap();
        let (a, _) = s.submit(spec("a", 0, &[])).await.unwrap();
        let (b, _) = s.submit(spec("b", 0, &[])).await.unwrap();
        assert_eq!(assigned(&mut w), std::slice::from_ref(&a));
        s.finished("w", finished_ok(&a)).await;
        assert_eq!(assigned(&mut w), std::slice::from_ref(&b));
        let failed = gantry_core::Finished {
            action_result: Some(reapi::ActionResult { exit_code: 1, ..Default::default() }),
            ..finished_ok(&b)
        };
        s.finished("w", failed).await;
        let counts: HashMap<String, f64> = registry
            .gather()
            .iter()
            .filter(|f| f.name() == "gantry_executions_total")
            .flat_map(|f| f.get_metric().iter())
            .map(|m| (m.get_label()[0].value().to_string(), m.get_counter().get_value()))
            .collect();
        assert_eq!(counts.len(), OUTCOMES.len(), "every outcome is exported from the start: {counts:?}");
        assert_eq!((counts["success"], counts["nonzero_exit"], counts["timeout"]), (1.0, 1.0, 0.0));
        // With no retention, a is gone once b has finished (b's finish expires it, unless
        // the monitor's sweep, which runs at the awaits, got there first), and the sweep
        // forgets b.
        assert!(s.watch(&a).is_none());
        s.check_workers_and_gc();
        assert!(s.watch(&b).is_none());
        s.check_invariants().unwrap();
    }

    #[tokio::test]
    async fn the_fleet_snapshot_shows_each_workers_runs_and_the_waiting_queues() {
        use gantry_core::Fleet;
        let s = scheduler(3).await;
        let mut w = s.register(reg("w", 1, &[("OSFamily", "linux")]), false).unwrap();
        let mut with = spec("a", 0, &[("OSFamily", "linux")]);
        with.requester = Requester {
            tool_invocation_id: "inv".into(),
            action_mnemonic: "Genrule".into(),
            target_id: "//:a".into(),
            ..Default::default()
        };
        let (a, _) = s.submit(with).await.unwrap();
        let (_b, _) = s.submit(spec("b", 0, &[("OSFamily", "linux")])).await.unwrap();
        let (_c, _) = s.submit(spec("c", 0, &[])).await.unwrap();
        assert_eq!(assigned(&mut w), vec![a.clone()]);
        let snap = s.snapshot();
        assert_eq!((snap.queued, snap.running), (2, 1));
        assert_eq!(snap.workers.len(), 1);
        let wv = &snap.workers[0];
        assert_eq!((wv.name.as_str(), wv.slots, wv.busy, wv.size_class), ("w", 1, 1, 1));
        assert_eq!(wv.platform, vec![("OSFamily".to_string(), "linux".to_string())]);
        assert_eq!(wv.running.len(), 1);
        let r = &wv.running[0];
        assert_eq!((r.operation.as_str(), r.mnemonic.as_str(), r.target.as_str()), (a.as_str(), "Genrule", "//:a"));
        assert_eq!(r.action_digest, DigestFunction::Sha256.digest_of(b"a").to_string());
        assert!(!r.hedge);
        // Two queues wait: one needs linux, one anything.
        let depths: Vec<(usize, usize)> = snap.queues.iter().map(|q| (q.platform.len(), q.depth)).collect();
        assert_eq!(depths, vec![(0, 1), (1, 1)]);
        s.finished("w", finished_ok(&a)).await;
        let snap = s.snapshot();
        assert_eq!((snap.queued, snap.running), (1, 1), "the next action took the slot");
    }

    #[tokio::test]
    async fn platform_matching_and_unoffered_property() {
        let s = scheduler(3).await;
        let mut plain = s.register(reg("plain", 1, &[("OSFamily", "linux")]), true).unwrap();
        let mut gpu = s.register(reg("gpu", 1, &[("OSFamily", "linux"), ("pool", "gpu")]), true).unwrap();
        let e = s.submit(spec("x", 0, &[("pool", "tpu")])).await.unwrap_err();
        assert!(matches!(e, Error::FailedPrecondition(_)) && e.to_string().contains("pool=tpu"), "{e}");
        let (g, _) = s.submit(spec("g", 0, &[("pool", "gpu")])).await.unwrap();
        assert_eq!(assigned(&mut gpu), vec![g]);
        assert!(assigned(&mut plain).is_empty());
        let (any, _) = s.submit(spec("any", 0, &[])).await.unwrap();
        assert_eq!(assigned(&mut plain), vec![any], "an empty platform runs anywhere");
    }

    #[tokio::test]
    async fn what_the_fleet_offers_a_platform_follows_workers_joining_and_leaving() {
        // The answer is kept per platform between arrivals: it must not outlive the fleet
        // it was read from, either way.
        let s = scheduler(3).await;
        let _plain = s.register(reg("plain", 1, &[("pool", "cpu")]), true).unwrap();
        let gpu_spec = |tag: &str| spec(tag, 0, &[("pool", "gpu")]);
        let e = s.submit(gpu_spec("before")).await.unwrap_err();
        assert!(e.to_string().contains("pool=gpu"), "{e}");
        let mut gpu = s.register(reg("gpu", 1, &[("pool", "gpu")]), true).unwrap();
        let (g, _) = s.submit(gpu_spec("joined")).await.unwrap();
        assert_eq!(assigned(&mut gpu), vec![g], "a worker that joins is seen at once");
        s.worker_lost("gpu", "test");
        let e = s.submit(gpu_spec("left")).await.unwrap_err();
        assert!(matches!(e, Error::FailedPrecondition(_)) && e.to_string().contains("pool=gpu"), "{e}");
        // A platform no worker offers is not kept.
        assert!(s.lock().platforms.keys().all(|p| p.iter().all(|q| q.value != "tpu")));
        let _ = s.submit(spec("tpu", 0, &[("pool", "tpu")])).await.unwrap_err();
        assert!(s.lock().platforms.keys().all(|p| p.iter().all(|q| q.value != "tpu")));
    }

    #[tokio::test]
    async fn identical_actions_in_flight_share_one_execution() {
        let s = scheduler(3).await;
        let (n1, mut r1) = s.submit(spec("same", 0, &[])).await.unwrap();
        let (n2, mut r2) = s.submit(spec("same", 0, &[])).await.unwrap();
        assert_eq!(n1, n2);
        let mut w = s.register(reg("w", 4, &[]), true).unwrap();
        assert_eq!(assigned(&mut w).len(), 1, "executed once");
        s.finished("w", finished_ok(&n1)).await;
        for r in [&mut r1, &mut r2] {
            let st = r.wait_for(|s| s.stage == Stage::Completed).await.unwrap().clone();
            assert_eq!(st.response.unwrap().result.unwrap().exit_code, 0);
        }
        // once finished, the same action is a new execution
        let (n3, _) = s.submit(spec("same", 0, &[])).await.unwrap();
        assert_ne!(n3, n1);
    }

    #[tokio::test]
    async fn do_not_cache_actions_are_not_merged_and_cancel_detaches() {
        let s = scheduler(3).await;
        let mut a = spec("nc", 0, &[]);
        Arc::make_mut(&mut a.action).do_not_cache = true;
        let mut b = spec("nc", 0, &[]);
        Arc::make_mut(&mut b.action).do_not_cache = true;
        let (n1, _) = s.submit(a).await.unwrap();
        let (n2, _) = s.submit(b).await.unwrap();
        assert_ne!(n1, n2, "do_not_cache actions run separately");
        let (c1, _) = s.submit(spec("c", 0, &[])).await.unwrap();
        s.cancel(&c1, None).unwrap();
        let (c2, _) = s.submit(spec("c", 0, &[])).await.unwrap();
        assert_ne!(c1, c2, "a new request does not join a cancelled operation");
    }

    #[tokio::test]
    async fn worker_loss_requeues_then_fails_unavailable() {
        let s = scheduler(1).await;
        let (n, mut rx) = s.submit(spec("lossy", 0, &[])).await.unwrap();
        let mut w1 = s.register(reg("w1", 1, &[]), false).unwrap();
        assert_eq!(assigned(&mut w1), vec![n.clone()]);
        s.worker_lost("w1", "test");
        assert_eq!(rx.borrow_and_update().stage, Stage::Queued, "re-queued after the first loss");
        let mut w2 = s.register(reg("w2", 1, &[]), false).unwrap();
        assert_eq!(assigned(&mut w2), vec![n.clone()], "picked up by another worker");
        s.worker_lost("w2", "test");
        let st = rx.wait_for(|s| s.stage == Stage::Completed).await.unwrap().clone();
        let status = st.response.unwrap().status.unwrap();
        assert_eq!(status.code, tonic::Code::Unavailable as i32);
        assert!(status.message.contains("2 times"), "{}", status.message);
    }

    #[tokio::test]
    async fn silent_remote_worker_is_lost_and_its_action_moves() {
        let db = gantry_store::MetadataDb::open("sqlite::memory:").await.unwrap();
        let ac = Arc::new(gantry_store::SqlActionCache::new(db.clone()));
        let log = Arc::new(gantry_store::SqlExecutionLog::new(db));
        let cfg = SchedulerConfig { heartbeat_timeout: Duration::from_millis(600), ..Default::default() };
        let s = Scheduler::new(cfg, ac, log, &prometheus::Registry::new(), None);
        let mut remote = s.register(reg("remote", 1, &[]), false).unwrap();
        let (n, _) = s.submit(spec("hb", 0, &[])).await.unwrap();
        assert_eq!(assigned(&mut remote), vec![n.clone()]);
        let mut local = s.register(reg("local", 1, &[]), true).unwrap();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(assigned(&mut local), vec![n], "moved after missed heartbeats");
        assert_eq!(s.worker_count(), 1);
    }

    /// A finished operation that was deleted is not joined by a new request for the same
    /// action: that request starts afresh (it used to find a dangling in-flight entry).
    #[tokio::test]
    async fn a_deleted_operation_is_not_joined() {
        let s = scheduler(3).await;
        let mut w = s.register(reg("w", 1, &[]), true).unwrap();
        let (n1, mut rx) = s.submit(spec("again", 0, &[])).await.unwrap();
        assert_eq!(assigned(&mut w), vec![n1.clone()]);
        let mut failed = finished_ok(&n1);
        failed.action_result = Some(reapi::ActionResult { exit_code: 1, ..Default::default() });
        s.finished("w", failed).await;
        rx.wait_for(|st| st.stage == Stage::Completed).await.unwrap();
        s.delete(&n1, None).unwrap();
        let (n2, _) = s.submit(spec("again", 0, &[])).await.unwrap();
        assert_ne!(n2, n1);
        assert_eq!(assigned(&mut w), vec![n2]);
        s.check_invariants().unwrap();
    }

    /// An action placed on a worker whose channel had already closed never reached it:
    /// it goes to another worker without counting a loss.
    #[tokio::test]
    async fn an_undelivered_assignment_is_not_a_worker_loss() {
        let s = scheduler(0).await;
        let gone = s.register(reg("gone", 1, &[]), false).unwrap();
        drop(gone);
        let (n, mut rx) = s.submit(spec("x", 0, &[])).await.unwrap();
        assert_eq!(rx.borrow_and_update().stage, Stage::Queued, "not failed with max_worker_losses = 0");
        assert_eq!(s.worker_count(), 0, "the closed worker is removed");
        let mut w = s.register(reg("w", 1, &[]), true).unwrap();
        assert_eq!(assigned(&mut w), vec![n]);
        s.check_invariants().unwrap();
    }

    #[tokio::test]
    async fn cancel_queued_and_running() {
        let s = scheduler(3).await;
        let (q, mut qrx) = s.submit(spec("queued", 0, &[])).await.unwrap();
        s.cancel(&q, None).unwrap();
        let st = qrx.wait_for(|s| s.stage == Stage::Completed).await.unwrap().clone();
        assert_eq!(st.response.unwrap().status.unwrap().code, tonic::Code::Cancelled as i32);
        let mut w = s.register(reg("w", 1, &[]), true).unwrap();
        assert!(assigned(&mut w).is_empty(), "a cancelled action is not dispatched");
        let (r, _) = s.submit(spec("running", 0, &[])).await.unwrap();
        assert_eq!(assigned(&mut w), vec![r.clone()]);
        s.cancel(&r, None).unwrap();
        let m = w.messages.try_recv().unwrap();
        assert!(matches!(m, ToWorker::Cancel(c) if c == r));
        assert!(s.delete(&r, None).is_err(), "running operations cannot be deleted");
        assert!(s.delete(&q, None).is_ok());
        assert!(s.watch(&q).is_none());
    }

    #[tokio::test]
    async fn operations_belong_to_the_identities_that_asked() {
        let s = scheduler(3).await;
        let owned = |tag: &str, who: &str| JobSpec { owner: Some(who.to_string()), ..spec(tag, 0, &[]) };
        let (a, mut arx) = s.submit(owned("alice-only", "alice")).await.unwrap();
        let (shared, mut srx) = s.submit(owned("both", "alice")).await.unwrap();
        let (merged, _) = s.submit(owned("both", "bob")).await.unwrap();
        assert_eq!(merged, shared, "the same action is one operation");
        let names = |v: Vec<OpState>| v.into_iter().map(|o| o.name.to_string()).collect::<Vec<_>>();
        assert_eq!(names(s.list(Some("bob"))), vec![shared.clone()], "bob sees only what he asked for");
        assert_eq!(names(s.list(Some("alice"))), vec![a.clone(), shared.clone()]);
        assert_eq!(names(s.list(None)).len(), 2, "an administrator sees everything");
        // Bob cannot cancel or delete Alice's operation, and cannot tell it exists.
        let e = s.cancel(&a, Some("bob")).unwrap_err();
        let missing = s.cancel("operations/does-not-exist", Some("bob")).unwrap_err();
        assert_eq!(
            (e.code(), e.to_string().replace(&a, "X")),
            (missing.code(), missing.to_string().replace("operations/does-not-exist", "X"))
        );
        assert!(s.delete(&a, Some("bob")).is_err());
        assert!(arx.borrow().stage != Stage::Completed);
        // Alice lets go of the shared one: it keeps running for Bob.
        s.cancel(&shared, Some("alice")).unwrap();
        assert!(srx.borrow_and_update().stage != Stage::Completed);
        assert!(names(s.list(Some("alice"))) == vec![a.clone()]);
        // The last owner's cancel ends it.
        s.cancel(&shared, Some("bob")).unwrap();
        let st = srx.wait_for(|s| s.stage == Stage::Completed).await.unwrap().clone();
        assert_eq!(st.response.unwrap().status.unwrap().code, tonic::Code::Cancelled as i32);
        s.cancel(&a, Some("alice")).unwrap();
        arx.wait_for(|s| s.stage == Stage::Completed).await.unwrap();
        assert!(s.delete(&a, Some("alice")).is_ok());
    }

    #[test]
    fn overdue_only_past_timeout_plus_grace() {
        let t0 = Instant::now();
        let (timeout, grace) = (Duration::from_secs(10), Duration::from_secs(5));
        assert!(!overdue(t0, timeout, grace, t0));
        assert!(!overdue(t0, timeout, grace, t0 + Duration::from_secs(15)), "exactly at the limit is not late");
        assert!(overdue(t0, timeout, grace, t0 + Duration::from_millis(15_001)));
        // A clock that went backwards (now before dispatch) is never late.
        assert!(!overdue(t0 + Duration::from_secs(100), timeout, grace, t0));
        assert!(!overdue(t0, Duration::MAX, grace, t0 + Duration::from_secs(1 << 30)), "no overflow");
    }

    /// A worker that keeps heartbeating but never reports: the action is cancelled there,
    /// moves to another worker, and the stuck worker's late report changes nothing.
    #[tokio::test]
    async fn heartbeating_worker_that_never_reports_loses_its_action() {
        let db = gantry_store::MetadataDb::open("sqlite::memory:").await.unwrap();
        let ac = Arc::new(gantry_store::SqlActionCache::new(db.clone()));
        let log = Arc::new(gantry_store::SqlExecutionLog::new(db));
        let cfg =
            SchedulerConfig { timeout_grace: Duration::from_millis(300), max_worker_losses: 1, ..Default::default() };
        let s = Scheduler::new(cfg, ac, log, &prometheus::Registry::new(), None);
        let mut stuck = s.register(reg("stuck", 1, &[]), false).unwrap();
        let mut job = spec("stuck", 0, &[]);
        Arc::make_mut(&mut job.action).timeout = Some(gantry_core::google::protobuf::Duration { seconds: 1, nanos: 0 });
        let (n, mut rx) = s.submit(job).await.unwrap();
        assert_eq!(assigned(&mut stuck), vec![n.clone()]);
        let mut other = s.register(reg("other", 1, &[]), false).unwrap();
        let beat = {
            let s = s.clone();
            spawn_named("test-heartbeats", async move {
                loop {
                    s.heartbeat("stuck");
                    s.heartbeat("other");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert!(assigned(&mut other).is_empty(), "not taken back before timeout + grace");
        assert_eq!(rx.borrow().stage, Stage::Executing);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let m = stuck.messages.try_recv().expect("the stuck worker is told to cancel");
        assert!(matches!(m, ToWorker::Cancel(c) if c == n));
        assert_eq!(assigned(&mut other), vec![n.clone()], "re-queued and run elsewhere");
        assert_eq!(s.worker_count(), 2, "a heartbeating worker is not dropped");
        // The stuck worker's late report is ignored; the new worker's result completes it.
        let mut late = finished_ok(&n);
        late.action_result = Some(reapi::ActionResult { exit_code: 9, ..Default::default() });
        s.finished("stuck", late).await;
        assert_eq!(rx.borrow().stage, Stage::Executing);
        s.finished("other", finished_ok(&n)).await;
        let st = rx.wait_for(|s| s.stage == Stage::Completed).await.unwrap().clone();
        assert_eq!(st.response.unwrap().result.unwrap().exit_code, 0);
        drop(beat);
    }

    #[tokio::test]
    async fn an_action_overdue_too_often_fails_unavailable() {
        let db = gantry_store::MetadataDb::open("sqlite::memory:").await.unwrap();
        let ac = Arc::new(gantry_store::SqlActionCache::new(db.clone()));
        let log = Arc::new(gantry_store::SqlExecutionLog::new(db));
        let cfg =
            SchedulerConfig { timeout_grace: Duration::from_millis(100), max_worker_losses: 0, ..Default::default() };
        let s = Scheduler::new(cfg, ac, log, &prometheus::Registry::new(), None);
        let _w = s.register(reg("w", 2, &[]), true).unwrap();
        let mut job = spec("late", 0, &[]);
        Arc::make_mut(&mut job.action).timeout =
            Some(gantry_core::google::protobuf::Duration { seconds: 0, nanos: 200_000_000 });
        let (_, mut rx) = s.submit(job).await.unwrap();
        let st = tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|s| s.stage == Stage::Completed))
            .await
            .expect("failed by the backstop")
            .unwrap()
            .clone();
        let status = st.response.unwrap().status.unwrap();
        assert_eq!(status.code, tonic::Code::Unavailable as i32);
        assert!(status.message.contains("no result"), "{}", status.message);
    }

    #[test]
    fn timeouts_are_checked_not_clamped() {
        use gantry_core::google::protobuf::Duration as PDuration;
        let (def, max) = (Duration::from_secs(3600), Duration::from_secs(3 * 3600));
        let d = |seconds, nanos| PDuration { seconds, nanos };
        assert_eq!(resolve_timeout(None, def, max).unwrap(), def);
        assert_eq!(resolve_timeout(Some(&d(0, 0)), def, max).unwrap(), def, "0 asks for the default");
        assert_eq!(resolve_timeout(Some(&d(300, 5)), def, max).unwrap(), Duration::new(300, 5));
        assert_eq!(resolve_timeout(Some(&d(3 * 3600, 0)), def, max).unwrap(), max, "the maximum itself is allowed");
        for bad in [d(3 * 3600, 1), d(-1, 0), d(5, -1), d(1, 1_000_000_000), d(i64::MAX, 0)] {
            let e = resolve_timeout(Some(&bad), def, max).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("action.timeout"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn huge_operation_names_are_not_echoed() {
        assert_eq!(shown_name("op-1"), "op-1");
        let huge = "é".repeat(1 << 19);
        let shown = shown_name(&huge);
        assert!(shown.len() < 300 && shown.contains(&format!("{} bytes", 1 << 20)), "{shown}");
    }

    /// A scheduler that learns, with one class-1 and one class-2 worker, whose shape
    /// (every `spec`'s) has a 1 s baseline on class 2: the next action explores class 1
    /// with a hedge. Returns the operation running on class 1.
    async fn hedging() -> (Arc<Scheduler>, WorkerLink, WorkerLink, String, op_watch::Receiver<OpState>) {
        let db = gantry_store::MetadataDb::open("sqlite::memory:").await.unwrap();
        let ac = Arc::new(gantry_store::SqlActionCache::new(db.clone()));
        let log = Arc::new(gantry_store::SqlExecutionLog::new(db.clone()));
        let store = Arc::new(gantry_store::SqlSizeClassStore::new(db));
        let config = gantry_sizeclass::SelectionConfig { exploration_factor: 0.0, ..Default::default() };
        let reg_ = prometheus::Registry::new();
        let sizing = crate::sizing::Sizing::new(config, store, Some(1), 16, &reg_).unwrap();
        let key = crate::sizing::shape_key(&spec("x", 0, &[]).action, "");
        let baseline = gantry_sizeclass::Execution {
            size_class: 2,
            outcome: gantry_sizeclass::Outcome::Succeeded(Duration::from_secs(1)),
            largest_outcome: None,
        };
        sizing.record(&key, 2, baseline, &[], &[1, 2]).await;
        let s = Scheduler::new(SchedulerConfig::default(), ac, log, &reg_, Some(sizing));
        let mut small = s.register(wpb::Register { size_class: 1, ..reg("small", 1, &[]) }, false).unwrap();
        let big = s.register(wpb::Register { size_class: 2, ..reg("big", 1, &[]) }, false).unwrap();
        let (name, rx) = s.submit(spec("x", 0, &[])).await.unwrap();
        assert_eq!(assigned(&mut small), vec![name.clone()], "explores class 1");
        (s, small, big, name, rx)
    }

    fn cancels(link: &mut WorkerLink) -> Vec<String> {
        let mut v = Vec::new();
        while let Ok(m) = link.messages.try_recv() {
            if let ToWorker::Cancel(c) = m {
                v.push(c);
            }
        }
        v
    }

    fn finished_with(job: &str, code: tonic::Code, exit: i32) -> gantry_core::Finished {
        gantry_core::Finished {
            status_code: code as i32,
            action_result: (code == tonic::Code::Ok)
                .then(|| reapi::ActionResult { exit_code: exit, ..Default::default() }),
            ..Default::default()
        }
        .with_job(job)
    }

    trait WithJob {
        fn with_job(self, job: &str) -> Self;
    }
    impl WithJob for gantry_core::Finished {
        fn with_job(mut self, job: &str) -> Self {
            self.job_id = job.into();
            self
        }
    }

    fn idle(s: &Scheduler) -> bool {
        let st = s.lock();
        st.d.running() == 0
            && st.d.queued() == 0
            && st.hedges.is_empty()
            && st.workers.values().all(|w| w.overdue.is_empty())
    }

    async fn completed(rx: &mut op_watch::Receiver<OpState>) -> ExecuteResponse {
        let st = tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|s| s.stage == Stage::Completed))
            .await
            .expect("completes")
            .unwrap()
            .clone();
        *st.response.unwrap()
    }

    #[tokio::test]
    async fn a_hedge_starts_at_its_time_and_the_copy_that_finishes_first_wins() {
        // The copy wins: the first run is cancelled, and its late report frees its slot.
        let (s, mut small, mut big, name, mut rx) = hedging().await;
        s.start_hedges(Instant::now());
        assert!(assigned(&mut big).is_empty(), "not before the hedge time");
        s.start_hedges(Instant::now() + Duration::from_secs(60));
        let copy = wire_id(&name, true);
        assert_eq!(assigned(&mut big), vec![copy.clone()], "a copy on class 2; the first run goes on");
        s.check_invariants().unwrap();
        s.finished("big", finished_ok(&copy)).await;
        assert_eq!(cancels(&mut small), vec![name.clone()], "the loser is cancelled");
        let resp = completed(&mut rx).await;
        assert!(resp.message.contains("hedged on size class 2"), "{}", resp.message);
        assert!(resp.message.contains("the copy on size class 2 finished first"), "{}", resp.message);
        s.check_invariants().unwrap();
        assert!(!idle(&s), "the cancelled run holds its slot until its worker reports it");
        s.finished("small", finished_with(&name, tonic::Code::Cancelled, -1)).await;
        assert!(idle(&s));
        s.check_invariants().unwrap();

        // The first run wins: the copy is cancelled.
        let (s, mut small, mut big, name, mut rx) = hedging().await;
        s.start_hedges(Instant::now() + Duration::from_secs(60));
        let copy = wire_id(&name, true);
        assert_eq!(assigned(&mut big), vec![copy.clone()]);
        s.finished("small", finished_ok(&name)).await;
        assert_eq!(cancels(&mut big), vec![copy.clone()]);
        assert!(cancels(&mut small).is_empty());
        let resp = completed(&mut rx).await;
        assert!(resp.message.contains("the run on size class 1 finished first"), "{}", resp.message);
        s.finished("big", finished_with(&copy, tonic::Code::Cancelled, -1)).await;
        assert!(idle(&s));
        s.check_invariants().unwrap();
    }

    #[tokio::test]
    async fn a_failed_or_lost_first_run_leaves_the_result_to_its_copy() {
        // The first run fails: no retry, no cancel; the copy's result is the action's.
        let (s, mut small, mut big, name, mut rx) = hedging().await;
        s.start_hedges(Instant::now() + Duration::from_secs(60));
        let copy = wire_id(&name, true);
        assert_eq!(assigned(&mut big), vec![copy.clone()]);
        s.finished("small", finished_with(&name, tonic::Code::Ok, 1)).await;
        s.check_invariants().unwrap();
        assert!(rx.borrow().response.is_none(), "the copy decides");
        assert!(cancels(&mut big).is_empty() && assigned(&mut big).is_empty(), "no second copy");
        s.finished("big", finished_ok(&copy)).await;
        let resp = completed(&mut rx).await;
        assert_eq!(resp.result.unwrap().exit_code, 0);
        assert!(resp.message.contains("failed on size class 1"), "{}", resp.message);
        assert!(idle(&s));
        s.check_invariants().unwrap();
        assert!(cancels(&mut small).is_empty());

        // The first run's worker is lost: the copy carries on, and no loss is counted.
        let (s, _small, mut big, name, mut rx) = hedging().await;
        s.start_hedges(Instant::now() + Duration::from_secs(60));
        let copy = wire_id(&name, true);
        assert_eq!(assigned(&mut big), vec![copy.clone()]);
        s.worker_lost("small", "test");
        s.check_invariants().unwrap();
        assert!(assigned(&mut big).is_empty(), "not placed again");
        s.finished("big", finished_ok(&copy)).await;
        assert_eq!(completed(&mut rx).await.result.unwrap().exit_code, 0);
        assert!(idle(&s));

        // The copy's worker is lost: the first run goes on alone.
        let (s, _small, mut big, name, mut rx) = hedging().await;
        s.start_hedges(Instant::now() + Duration::from_secs(60));
        assert_eq!(assigned(&mut big), vec![wire_id(&name, true)]);
        s.worker_lost("big", "test");
        s.check_invariants().unwrap();
        s.finished("small", finished_ok(&name)).await;
        assert_eq!(completed(&mut rx).await.result.unwrap().exit_code, 0);
        assert!(idle(&s));
    }

    #[tokio::test]
    async fn cancelling_a_hedged_action_cancels_both_runs() {
        let (s, mut small, mut big, name, mut rx) = hedging().await;
        s.start_hedges(Instant::now() + Duration::from_secs(60));
        let copy = wire_id(&name, true);
        assert_eq!(assigned(&mut big), vec![copy.clone()]);
        s.cancel(&name, None).unwrap();
        assert_eq!(cancels(&mut big), vec![copy.clone()]);
        assert_eq!(cancels(&mut small), vec![name.clone()]);
        s.check_invariants().unwrap();
        s.finished("big", finished_with(&copy, tonic::Code::Cancelled, -1)).await;
        s.finished("small", finished_with(&name, tonic::Code::Cancelled, -1)).await;
        let resp = completed(&mut rx).await;
        assert_eq!(resp.status.unwrap().code, tonic::Code::Cancelled as i32);
        assert!(idle(&s));
        s.check_invariants().unwrap();
    }
}

/// The scheduler's own maps (operations by number and by name, live runs, hedge copies,
/// actions in flight, retention) against random sequences of what its callers do.
#[cfg(test)]
mod random_sequences {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        /// An action with one of a few digests (so identical ones join), maybe do_not_cache.
        Submit {
            tag: u8,
            do_not_cache: bool,
        },
        Register {
            worker: u8,
            slots: u32,
        },
        Lose {
            worker: u8,
        },
        /// The worker reports the k-th run it holds, succeeded or failed.
        Finish {
            worker: u8,
            k: u8,
            ok: bool,
        },
        Cancel {
            k: u8,
        },
        Delete {
            k: u8,
        },
        /// The monitor's sweep (retention is zero here).
        Sweep,
        /// Every hedge time comes: a run still going on a smaller class gets a copy on the
        /// largest, one still queued moves there (with the learner only).
        Hedge,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0u8..6, any::<bool>()).prop_map(|(tag, do_not_cache)| Step::Submit { tag, do_not_cache }),
            1 => (0u8..3, 1u32..3).prop_map(|(worker, slots)| Step::Register { worker, slots }),
            1 => (0u8..3).prop_map(|worker| Step::Lose { worker }),
            4 => (0u8..3, 0u8..3, any::<bool>()).prop_map(|(worker, k, ok)| Step::Finish { worker, k, ok }),
            1 => any::<u8>().prop_map(|k| Step::Cancel { k }),
            1 => any::<u8>().prop_map(|k| Step::Delete { k }),
            1 => Just(Step::Sweep),
            1 => Just(Step::Hedge),
        ]
    }

    /// Runs `steps`. With `learning`, workers alternate between size classes 1 and 2 and
    /// the learner knows every action's shape from a run on class 2, so that actions
    /// explore class 1 with a hedge: copies start, win, lose, take over and are lost.
    async fn run(steps: Vec<Step>, learning: bool) -> std::result::Result<(), String> {
        let db = gantry_store::MetadataDb::open("sqlite::memory:").await.unwrap();
        let ac = Arc::new(gantry_store::SqlActionCache::new(db.clone()));
        let log = Arc::new(gantry_store::SqlExecutionLog::new(db.clone()));
        let cfg = SchedulerConfig { completed_retention: Duration::ZERO, ..Default::default() };
        let registry = prometheus::Registry::new();
        let sizing = if learning {
            let store = Arc::new(gantry_store::SqlSizeClassStore::new(db));
            let config = gantry_sizeclass::SelectionConfig { exploration_factor: 0.0, ..Default::default() };
            let sizing = crate::sizing::Sizing::new(config, store, Some(1), 16, &registry).unwrap();
            for do_not_cache in [false, true] {
                let action = reapi::Action { do_not_cache, ..Default::default() };
                let baseline = gantry_sizeclass::Execution {
                    size_class: 2,
                    outcome: gantry_sizeclass::Outcome::Succeeded(Duration::from_secs(1)),
                    largest_outcome: None,
                };
                sizing.record(&crate::sizing::shape_key(&action, ""), 2, baseline, &[], &[1, 2]).await;
            }
            Some(sizing)
        } else {
            None
        };
        let s = Scheduler::new(cfg, ac, log, &registry, sizing);
        let mut links: HashMap<String, WorkerLink> = HashMap::new();
        let mut held: HashMap<String, Vec<String>> = HashMap::new();
        let mut names: Vec<String> = Vec::new();
        for (i, st) in steps.into_iter().enumerate() {
            match st {
                Step::Submit { tag, do_not_cache } => {
                    let spec = JobSpec {
                        instance: String::new(),
                        action_digest: DigestFunction::Sha256.digest_of(&[tag]),
                        action: reapi::Action { do_not_cache, ..Default::default() }.into(),
                        command: reapi::Command { arguments: vec!["true".into()], ..Default::default() }.into(),
                        priority: i32::from(tag % 2),
                        requester: Requester::default(),
                        owner: None,
                    };
                    let (name, _) = s.submit(spec).await.map_err(|e| e.to_string())?;
                    names.push(name);
                }
                Step::Register { worker, slots } => {
                    let id = format!("w{worker}");
                    let size_class = if learning { 1 + u32::from(worker % 2) } else { 1 };
                    let reg = wpb::Register { worker_id: id.clone(), slots, size_class, ..Default::default() };
                    if let Ok(link) = s.register(reg, true) {
                        links.insert(id, link);
                    }
                }
                Step::Lose { worker } => {
                    let id = format!("w{worker}");
                    s.worker_lost(&id, "test");
                    links.remove(&id);
                    held.remove(&id);
                }
                Step::Finish { worker, k, ok } => {
                    let id = format!("w{worker}");
                    let runs = held.entry(id.clone()).or_default();
                    if !runs.is_empty() {
                        let job = runs.remove(k as usize % runs.len());
                        let f = gantry_core::Finished {
                            job_id: job,
                            action_result: Some(reapi::ActionResult {
                                exit_code: if ok { 0 } else { 1 },
                                ..Default::default()
                            }),
                            ..Default::default()
                        };
                        s.finished(&id, f).await;
                    }
                }
                Step::Cancel { k } if !names.is_empty() => {
                    let _ = s.cancel(&names[k as usize % names.len()], None);
                }
                Step::Delete { k } if !names.is_empty() => {
                    let _ = s.delete(&names[k as usize % names.len()], None);
                }
                Step::Cancel { .. } | Step::Delete { .. } => {}
                Step::Sweep => s.check_workers_and_gc(),
                Step::Hedge => s.start_hedges(Instant::now() + Duration::from_secs(3600)),
            }
            // What each worker was sent: a run it holds until it reports it (a cancelled
            // run too: the worker reports it when its process is gone).
            for (id, link) in links.iter_mut() {
                while let Ok(m) = link.messages.try_recv() {
                    if let ToWorker::Assign(a) = m {
                        held.entry(id.clone()).or_default().push(a.job_id.clone());
                    }
                }
            }
            s.check_invariants().map_err(|e| format!("after step {i}: {e}"))?;
            // Every name handed out is known until it is swept or deleted, and each known
            // one answers to its own name.
            for n in &names {
                if let Some(rx) = s.watch(n) {
                    let shown = rx.borrow().name.clone();
                    if *shown != **n {
                        return Err(format!("after step {i}: {n} answers as {shown}"));
                    }
                }
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn the_scheduler_maps_stay_in_step(steps in proptest::collection::vec(step(), 1..80)) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let result = rt.block_on(run(steps, false));
            prop_assert!(result.is_ok(), "{}", result.unwrap_err());
        }

        #[test]
        fn the_maps_stay_in_step_through_hedges_and_retries(steps in proptest::collection::vec(step(), 1..80)) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let result = rt.block_on(run(steps, true));
            prop_assert!(result.is_ok(), "{}", result.unwrap_err());
        }
    }
}
