//! The scheduler: actions wait in a queue ordered by (priority, arrival); a dispatch pass
//! hands each to the first idle worker whose platform properties satisfy it. Identical
//! in-flight actions (same instance and action digest) share one execution. A worker that
//! disconnects or misses heartbeats loses its actions back to the queue, up to a limit.
//! So does a worker that keeps heartbeating but sends no result for an action past its
//! timeout plus a grace period: the scheduler cancels the action there and re-queues it,
//! counted as a worker loss ([`overdue`]).
//!
//! All state sits behind one mutex, held only for in-memory bookkeeping; the awaits of a
//! completion (action cache write, execution log) happen outside it.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gantry_core::google::rpc::Status as RpcStatus;
use gantry_core::reapi::{self, ActionResult, ExecuteResponse};
use gantry_core::task::{spawn_named, TaskGuard};
use gantry_core::{ActionCache, ActionRecord, Digest, DigestFunction, Error, ExecutionLog, Result};
use gantry_proto::worker::v1 as wpb;
use prost::Message;
use tokio::sync::{mpsc, watch};

use crate::platform::{self, Property};

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
#[derive(Debug, Clone)]
pub struct OpState {
    pub name: String,
    pub stage: Stage,
    pub action_digest: Digest,
    pub response: Option<ExecuteResponse>,
}

/// Who asked for an action, from Bazel's RequestMetadata header.
#[derive(Debug, Clone, Default)]
pub struct Requester {
    pub tool_invocation_id: String,
    pub action_mnemonic: String,
    pub target_id: String,
    pub configuration_id: String,
}

pub struct JobSpec {
    pub instance: String,
    pub action_digest: Digest,
    pub action: reapi::Action,
    pub command: reapi::Command,
    pub priority: i32,
    pub requester: Requester,
    /// The identity that asked (`[auth]`); None on a server without authentication.
    pub owner: Option<String>,
}

struct Job {
    name: String,
    key: (String, Digest),
    spec: JobSpec,
    /// Identities whose Execute calls share this operation (requests for the same action
    /// are merged); only they, or an administrator, may list, cancel or delete it.
    owners: Vec<String>,
    platform: Vec<Property>,
    timeout: Duration,
    seq: u64,
    queued_at: SystemTime,
    worker: Option<String>,
    /// When the current worker was handed the action.
    dispatched_at: Option<Instant>,
    losses: u32,
    cancel_requested: bool,
    /// Size class the action must run on (None: any worker).
    size_class: Option<u32>,
    /// Whether the class was chosen by the learner (more than one class could run it),
    /// so its outcome should be recorded.
    learning: bool,
    /// Largest class with workers when the action was submitted.
    largest_class: u32,
    requested_timeout: Duration,
    shape_key: String,
    /// A failed or timed-out run on a smaller class, waiting for the largest class's result.
    first_try: Option<(u32, gantry_sizeclass::Outcome)>,
    notes: Vec<String>,
    tx: watch::Sender<OpState>,
    completed_at: Option<Instant>,
}

impl WorkerEntry {
    /// Slots in use: running actions and overdue ones not yet reported.
    fn busy(&self) -> usize {
        self.running.len() + self.overdue.len()
    }
}

struct WorkerEntry {
    properties: Vec<Property>,
    slots: usize,
    running: HashSet<String>,
    /// Actions taken back from this worker because it never reported them; each still
    /// holds a slot until the worker reports it (its report is then dropped), so a stuck
    /// worker is not handed more work than it has slots.
    overdue: HashSet<String>,
    tx: mpsc::UnboundedSender<wpb::SchedulerMessage>,
    last_seen: Instant,
    /// In-process workers cannot be lost to a network, so they are not timed out.
    local: bool,
    size_class: u32,
    metering: String,
}

#[derive(Default)]
struct State {
    jobs: HashMap<String, Job>,
    /// (priority, seq, job name): lower priority values run first, FIFO within one.
    queue: BTreeSet<(i32, u64, String)>,
    in_flight: HashMap<(String, Digest), String>,
    workers: HashMap<String, WorkerEntry>,
    seq: u64,
    /// Moving average of execution seconds per size class, for expected queue waits.
    class_avg_seconds: HashMap<u32, f64>,
}

struct Gauges {
    queued: prometheus::IntGauge,
    running: prometheus::IntGauge,
    workers: prometheus::IntGauge,
    completed: prometheus::IntCounterVec,
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
    pub messages: mpsc::UnboundedReceiver<wpb::SchedulerMessage>,
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
            completed,
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
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tick.tick().await;
                let Some(s) = weak.upgrade() else { return };
                s.check_workers_and_gc();
            }
        });
        *s.monitor.lock().expect("poisoned") = Some(guard);
        s
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues an action (or joins an identical one in flight) and returns the operation
    /// name and a receiver of its state changes.
    pub async fn submit(&self, spec: JobSpec) -> Result<(String, watch::Receiver<OpState>)> {
        let shape_key = crate::sizing::shape_key(&spec.action, &spec.requester.configuration_id);
        // With one size class there is nothing to choose or learn: skip the stats read.
        if let Some(sizing) = self.sizing.as_ref().filter(|_| self.class_count() > 1) {
            sizing.load(&shape_key).await?;
        }
        // Bazel puts platform properties in both Action.platform and the (deprecated)
        // Command.platform; older clients only in the latter, so both are honoured.
        #[allow(deprecated)]
        let mut required = platform::from_platform(spec.command.platform.as_ref());
        required.extend(platform::from_platform(spec.action.platform.as_ref()));
        required.sort();
        required.dedup();
        let timeout =
            resolve_timeout(spec.action.timeout.as_ref(), self.config.default_timeout, self.config.max_timeout)?;
        let key = (spec.instance.clone(), spec.action_digest);
        // REAPI: in-flight requests for a do_not_cache action may not be merged.
        let mergeable = !spec.action.do_not_cache;
        let mut st = self.state.lock().expect("poisoned");
        if let Some(name) = st.in_flight.get(&key).filter(|_| mergeable).cloned() {
            let job = st.jobs.get_mut(&name).expect("in-flight jobs exist");
            if let Some(o) = spec.owner
                && !job.owners.contains(&o)
            {
                job.owners.push(o);
            }
            return Ok((name, job.tx.subscribe()));
        }
        if !st.workers.is_empty() {
            let offers = st.workers.values().map(|w| w.properties.as_slice());
            if let Some(p) = platform::first_unoffered(offers.clone(), &required) {
                return Err(Error::FailedPrecondition(format!(
                    "platform property {}={} is offered by no worker",
                    p.name, p.value
                )));
            }
            if !st.workers.values().any(|w| platform::satisfies(&w.properties, &required)) {
                return Err(Error::FailedPrecondition(format!(
                    "no worker offers all of the platform properties {}",
                    required.iter().map(|p| format!("{}={}", p.name, p.value)).collect::<Vec<_>>().join(", ")
                )));
            }
        }
        // Size classes with a worker that can run this action.
        let classes: BTreeSet<u32> = st
            .workers
            .values()
            .filter(|w| platform::satisfies(&w.properties, &required))
            .map(|w| w.size_class)
            .collect();
        let largest_class = classes.iter().next_back().copied().unwrap_or(1);
        let requested_timeout = timeout;
        let learning = self.sizing.is_some() && classes.len() > 1;
        let (size_class, timeout) = match (&self.sizing, classes.len()) {
            (Some(sizing), n) if n > 1 => {
                let set = gantry_sizeclass::SizeClasses::new(classes.iter().copied()).expect("non-empty, non-zero");
                let queues = self.queue_state(&st, &classes);
                match sizing.choose(&shape_key, &set, timeout, Some(&queues)) {
                    Some(d) => (Some(d.size_class), d.timeout),
                    None => (Some(largest_class), timeout),
                }
            }
            (_, 1) => (classes.iter().next().copied(), timeout),
            _ => (None, timeout),
        };
        let name = format!("operations/{}", uuid::Uuid::new_v4());
        st.seq += 1;
        let seq = st.seq;
        let state =
            OpState { name: name.clone(), stage: Stage::Queued, action_digest: spec.action_digest, response: None };
        let (tx, rx) = watch::channel(state);
        st.queue.insert((spec.priority, seq, name.clone()));
        if mergeable {
            st.in_flight.insert(key.clone(), name.clone());
        }
        st.jobs.insert(
            name.clone(),
            Job {
                name: name.clone(),
                key,
                owners: spec.owner.iter().cloned().collect(),
                spec,
                platform: required,
                timeout,
                seq,
                queued_at: SystemTime::now(),
                worker: None,
                dispatched_at: None,
                losses: 0,
                cancel_requested: false,
                size_class,
                learning,
                largest_class,
                requested_timeout,
                shape_key,
                first_try: None,
                notes: Vec::new(),
                tx,
                completed_at: None,
            },
        );
        self.dispatch(&mut st);
        Ok((name, rx))
    }

    /// Hands queued actions to idle workers that can run them.
    fn dispatch(&self, st: &mut State) {
        let mut assigned = Vec::new();
        for (prio, seq, name) in st.queue.iter() {
            if !st.workers.values().any(|w| w.busy() < w.slots) {
                break;
            }
            let job = &st.jobs[name];
            // Among the idle workers that can run it, prefer the least loaded.
            let pick = st
                .workers
                .iter()
                .filter(|(_, w)| {
                    w.busy() < w.slots
                        && !w.overdue.contains(name)
                        && platform::satisfies(&w.properties, &job.platform)
                        && job.size_class.is_none_or(|c| w.size_class == c)
                })
                .min_by_key(|(id, w)| (w.busy() * 1000 / w.slots.max(1), (*id).clone()))
                .map(|(id, _)| id.clone());
            if let Some(wid) = pick {
                let msg = wpb::SchedulerMessage {
                    kind: Some(wpb::scheduler_message::Kind::Assignment(wpb::Assignment {
                        job_id: name.clone(),
                        instance_name: job.spec.instance.clone(),
                        digest_function: job.spec.action_digest.function.to_proto(),
                        action: job.spec.action.encode_to_vec(),
                        command: job.spec.command.encode_to_vec(),
                        action_digest: job.spec.action_digest.to_proto().encode_to_vec(),
                        timeout_ms: job.timeout.as_millis() as u64,
                        queued_unix_ms: now_ms(job.queued_at),
                    })),
                };
                let w = st.workers.get_mut(&wid).expect("picked");
                if w.tx.send(msg).is_ok() {
                    w.running.insert(name.clone());
                    assigned.push(((*prio, *seq, name.clone()), wid));
                }
            }
        }
        for (k, wid) in assigned {
            st.queue.remove(&k);
            let job = st.jobs.get_mut(&k.2).expect("queued job exists");
            job.worker = Some(wid);
            job.dispatched_at = Some(Instant::now());
            job.tx.send_modify(|s| s.stage = Stage::Executing);
        }
        self.update_gauges(st);
    }

    /// Distinct size classes among registered workers.
    fn class_count(&self) -> usize {
        let st = self.state.lock().expect("poisoned");
        st.workers.values().map(|w| w.size_class).collect::<BTreeSet<_>>().len()
    }

    /// Expected wait and idle workers per size class, for queue-aware selection.
    fn queue_state(&self, st: &State, classes: &BTreeSet<u32>) -> gantry_sizeclass::QueueState {
        let mut q = gantry_sizeclass::QueueState::new();
        for &c in classes {
            let workers: Vec<&WorkerEntry> = st.workers.values().filter(|w| w.size_class == c).collect();
            let slots: usize = workers.iter().map(|w| w.slots).sum();
            let idle: usize = workers.iter().map(|w| w.slots.saturating_sub(w.busy())).sum();
            let queued = st.queue.iter().filter(|(_, _, n)| st.jobs[n].size_class == Some(c)).count();
            let avg = st.class_avg_seconds.get(&c).copied().unwrap_or(1.0);
            let wait = if idle > 0 { 0.0 } else { (queued + 1) as f64 * avg / slots.max(1) as f64 };
            q.set(
                c,
                gantry_sizeclass::ClassQueue {
                    expected_wait: Duration::from_secs_f64(wait),
                    idle_workers: idle as u32,
                },
            );
        }
        q
    }

    fn update_gauges(&self, st: &State) {
        self.gauges.queued.set(st.queue.len() as i64);
        self.gauges.running.set(st.workers.values().map(|w| w.running.len() as i64).sum());
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
        let mut st = self.state.lock().expect("poisoned");
        if st.workers.contains_key(&reg.worker_id) {
            return Err(Error::FailedPrecondition(format!("worker id {} is already registered", reg.worker_id)));
        }
        st.workers.insert(
            reg.worker_id.clone(),
            WorkerEntry {
                properties: props,
                slots: reg.slots.max(1) as usize,
                running: HashSet::new(),
                overdue: HashSet::new(),
                tx,
                last_seen: Instant::now(),
                local,
                size_class: reg.size_class.max(1),
                metering: reg.metering.clone(),
            },
        );
        tracing::info!(worker = %reg.worker_id, slots = reg.slots, local, "worker registered");
        self.dispatch(&mut st);
        Ok(WorkerLink { id: reg.worker_id, messages: rx })
    }

    /// Registers an in-process worker and bridges its reports into the scheduler. The
    /// worker reads assignments from the returned receiver and reports on the sender; the
    /// bridge task lives as long as the guard.
    pub fn attach_local(
        self: &Arc<Self>,
        reg: wpb::Register,
    ) -> Result<(mpsc::UnboundedReceiver<wpb::SchedulerMessage>, mpsc::UnboundedSender<wpb::WorkerMessage>, TaskGuard)>
    {
        let link = self.register(reg, true)?;
        let (tx, mut rx) = mpsc::unbounded_channel::<wpb::WorkerMessage>();
        let s = self.clone();
        let id = link.id.clone();
        let guard = spawn_named("local-worker-bridge", async move {
            while let Some(m) = rx.recv().await {
                match m.kind {
                    Some(wpb::worker_message::Kind::Started(x)) => s.started(&id, &x.job_id),
                    Some(wpb::worker_message::Kind::Finished(f)) => {
                        // Detached, like remote sessions: a result is always saved.
                        let (s, id) = (s.clone(), id.clone());
                        tokio::spawn(async move { s.finished(&id, f).await });
                    }
                    _ => s.heartbeat(&id),
                }
            }
            s.worker_lost(&id, "in-process worker stopped");
        });
        Ok((link.messages, tx, guard))
    }

    pub fn heartbeat(&self, worker: &str) {
        if let Some(w) = self.state.lock().expect("poisoned").workers.get_mut(worker) {
            w.last_seen = Instant::now();
        }
    }

    pub fn started(&self, worker: &str, job_id: &str) {
        let mut st = self.state.lock().expect("poisoned");
        if let Some(w) = st.workers.get_mut(worker) {
            w.last_seen = Instant::now();
        }
        if let Some(job) = st.jobs.get(job_id).filter(|j| j.worker.as_deref() == Some(worker)) {
            job.tx.send_modify(|s| s.stage = Stage::Executing);
        }
    }

    /// A worker reports a finished (or failed, timed-out, cancelled) execution.
    pub async fn finished(&self, worker: &str, f: wpb::ExecutionFinished) {
        let (spec_instance, digest, do_not_cache, record, queued_at) = {
            let mut st = self.state.lock().expect("poisoned");
            let size_class = st.workers.get(worker).map_or(1, |w| w.size_class);
            if let Some(w) = st.workers.get_mut(worker) {
                w.last_seen = Instant::now();
                if w.overdue.remove(&f.job_id) {
                    // The late report of an action taken back: its slot is free again,
                    // the action itself is queued or running elsewhere.
                    self.dispatch(&mut st);
                    return;
                }
                w.running.remove(&f.job_id);
            }
            let current =
                st.jobs.get(&f.job_id).is_some_and(|j| j.worker.as_deref() == Some(worker) && j.completed_at.is_none());
            if !current {
                // A stale report from a worker the action was taken away from.
                return;
            }
            let m = f.metering.clone().unwrap_or_default();
            let avg = st.class_avg_seconds.entry(size_class).or_insert(m.wall_seconds.max(0.001));
            *avg = 0.8 * *avg + 0.2 * m.wall_seconds;
            let job = &st.jobs[&f.job_id];
            let record = ActionRecord {
                operation: job.name.clone(),
                instance: job.spec.instance.clone(),
                action_digest: job.spec.action_digest.to_string(),
                tool_invocation_id: job.spec.requester.tool_invocation_id.clone(),
                action_mnemonic: job.spec.requester.action_mnemonic.clone(),
                target_id: job.spec.requester.target_id.clone(),
                worker: worker.to_string(),
                size_class,
                exit_code: 0,
                status_code: f.status_code,
                peak_memory_bytes: m.peak_memory_bytes,
                user_cpu_seconds: m.user_cpu_seconds,
                system_cpu_seconds: m.system_cpu_seconds,
                wall_seconds: m.wall_seconds,
                queued_seconds: 0.0,
                metering: m.method,
                completed_unix_ms: now_ms(SystemTime::now()),
            };
            (job.spec.instance.clone(), job.spec.action_digest, job.spec.action.do_not_cache, record, job.queued_at)
        };
        let mut result = match f.action_result.as_deref() {
            None => None,
            Some(bytes) => match ActionResult::decode(bytes) {
                Ok(r) => Some(r),
                Err(e) => {
                    tracing::error!(job = %f.job_id, error = %e, "worker sent an undecodable ActionResult");
                    None
                }
            },
        };
        let mut code = f.status_code;
        let mut message = f.status_message.clone();
        if code == 0 && result.is_none() {
            code = tonic::Code::Internal as i32;
            message = "worker returned no result".into();
        }
        if let Some(r) = result.as_mut() {
            let md = r.execution_metadata.get_or_insert_with(Default::default);
            md.worker = worker.to_string();
            md.queued_timestamp = Some(timestamp(queued_at));
        }
        let mut record = record;
        record.exit_code = result.as_ref().map_or(-1, |r| r.exit_code);
        let wall = Duration::from_secs_f64(f.metering.as_ref().map_or(0.0, |m| m.wall_seconds).max(0.0));
        let ran_on = record.size_class;
        let this_outcome = crate::sizing::outcome(code, result.as_ref().map(|r| r.exit_code), wall);
        // A failure or timeout on a smaller class is retried on the largest class with the
        // original timeout; the client sees one execution.
        let retry = {
            let mut st = self.state.lock().expect("poisoned");
            let Some(job) = st.jobs.get_mut(&f.job_id) else { return };
            let smaller = job.learning && job.size_class.is_some_and(|c| c < job.largest_class);
            // Only a run that happened says something about the class: not a missing input
            // or another infrastructure error.
            let ran = code == 0 || code == tonic::Code::DeadlineExceeded as i32;
            if smaller && ran && !this_outcome.is_success() && !job.cancel_requested {
                job.first_try = Some((ran_on, this_outcome));
                job.notes.push(format!(
                    "{} on size class {ran_on} after {:.1}s; retried on size class {}",
                    match this_outcome {
                        gantry_sizeclass::Outcome::TimedOut(_) => "timed out",
                        _ => "failed",
                    },
                    wall.as_secs_f64(),
                    job.largest_class
                ));
                job.size_class = Some(job.largest_class);
                job.timeout = job.requested_timeout;
                job.worker = None;
                job.tx.send_modify(|s| s.stage = Stage::Queued);
                let key = (job.spec.priority, job.seq, job.name.clone());
                st.queue.insert(key);
                true
            } else {
                false
            }
        };
        if retry {
            if let Some(s) = &self.sizing {
                s.retries.with_label_values(&[&ran_on.to_string()]).inc();
            }
            if let Err(e) = self.log.record(&record).await {
                tracing::error!(action = %digest, error = %e, "could not record the execution");
            }
            let mut st = self.state.lock().expect("poisoned");
            self.dispatch(&mut st);
            return;
        }
        let learn = {
            let st = self.state.lock().expect("poisoned");
            st.jobs.get(&f.job_id).and_then(|job| {
                let learn = job.learning && code != tonic::Code::Cancelled as i32;
                learn.then(|| {
                    let execution = match job.first_try {
                        Some((c0, o0)) => gantry_sizeclass::Execution {
                            size_class: c0,
                            outcome: o0,
                            largest_outcome: Some(this_outcome),
                        },
                        None => gantry_sizeclass::Execution {
                            size_class: ran_on,
                            outcome: this_outcome,
                            largest_outcome: None,
                        },
                    };
                    (job.shape_key.clone(), job.largest_class, execution, job.notes.join("; "))
                })
            })
        };
        let mut notes = String::new();
        if let (Some(sizing), Some((key, largest, execution, n))) = (&self.sizing, learn) {
            sizing.record(&key, largest, execution).await;
            notes = n;
        }
        if let Some(md) = result.as_ref().and_then(|r| r.execution_metadata.as_ref())
            && let (Some(q), Some(s)) = (&md.queued_timestamp, &md.worker_start_timestamp)
        {
            record.queued_seconds = ((s.seconds - q.seconds) as f64 + (s.nanos - q.nanos) as f64 / 1e9).max(0.0);
        }
        // Only successful runs are cached: a failure may be flaky or environmental.
        let cacheable = code == 0 && result.as_ref().is_some_and(|r| r.exit_code == 0) && !do_not_cache;
        if cacheable && let Err(e) = self.ac.put(&spec_instance, &digest, result.as_ref().expect("cacheable")).await {
            tracing::error!(action = %digest, error = %e, "could not store the action result");
            message = format!("{message}{}result not cached: {e}", if message.is_empty() { "" } else { "; " });
        }
        if let Err(e) = self.log.record(&record).await {
            tracing::error!(action = %digest, error = %e, "could not record the execution");
        }
        let outcome = match (code, result.as_ref().map(|r| r.exit_code)) {
            (0, Some(0)) => "success",
            (0, _) => "nonzero_exit",
            (c, _) if c == tonic::Code::DeadlineExceeded as i32 => "timeout",
            (c, _) if c == tonic::Code::Cancelled as i32 => "cancelled",
            _ => "error",
        };
        self.gauges.completed.with_label_values(&[outcome]).inc();
        let mut human = if f.message.is_empty() { message.clone() } else { f.message.clone() };
        if !notes.is_empty() {
            human = if human.is_empty() { notes } else { format!("{human}; {notes}") };
        }
        let details = if f.missing_blobs.is_empty() {
            vec![]
        } else {
            vec![gantry_core::error::missing_details(f.missing_blobs.iter().cloned())]
        };
        let response = ExecuteResponse {
            result,
            cached_result: false,
            status: Some(RpcStatus { code, message: message.clone(), details }),
            server_logs: Default::default(),
            message: human,
        };
        let mut st = self.state.lock().expect("poisoned");
        self.complete(&mut st, &f.job_id, response);
        self.dispatch(&mut st);
    }

    fn complete(&self, st: &mut State, name: &str, response: ExecuteResponse) {
        let Some(job) = st.jobs.get_mut(name) else { return };
        if job.completed_at.is_some() {
            return;
        }
        job.completed_at = Some(Instant::now());
        let key = job.key.clone();
        job.tx.send_modify(|s| {
            s.stage = Stage::Completed;
            s.response = Some(response);
        });
        st.queue.remove(&(job.spec.priority, job.seq, job.name.clone()));
        if st.in_flight.get(&key).map(String::as_str) == Some(name) {
            st.in_flight.remove(&key);
        }
    }

    /// Removes a worker and re-queues what it was running.
    pub fn worker_lost(&self, worker: &str, why: &str) {
        let mut st = self.state.lock().expect("poisoned");
        let Some(w) = st.workers.remove(worker) else { return };
        tracing::warn!(worker, why, running = w.running.len(), "worker lost");
        for name in w.running {
            self.lose_job(&mut st, &name, worker, why);
        }
        self.dispatch(&mut st);
    }

    /// An action's worker is gone (or stuck): re-queue the action, or fail it with
    /// UNAVAILABLE once it has lost workers more than `max_worker_losses` times.
    fn lose_job(&self, st: &mut State, name: &str, worker: &str, why: &str) {
        let Some(job) = st.jobs.get_mut(name) else { return };
        if job.completed_at.is_some() {
            return;
        }
        job.losses += 1;
        job.worker = None;
        job.dispatched_at = None;
        if job.cancel_requested {
            self.complete(st, name, cancelled_response());
        } else if job.losses > self.config.max_worker_losses {
            let losses = job.losses;
            let resp = ExecuteResponse {
                status: Some(status(
                    tonic::Code::Unavailable,
                    format!("the action lost its worker {losses} times (last: {worker}, {why})"),
                )),
                ..Default::default()
            };
            self.complete(st, name, resp);
        } else {
            job.tx.send_modify(|s| s.stage = Stage::Queued);
            let key = (job.spec.priority, job.seq, name.to_string());
            st.queue.insert(key);
        }
    }

    /// Takes back every action whose worker is still connected but has not reported it
    /// past its timeout plus the grace: the worker is told to cancel it, and the action is
    /// re-queued as if the worker had been lost.
    fn reclaim_overdue(&self, now: Instant) {
        let mut st = self.state.lock().expect("poisoned");
        let grace = self.config.timeout_grace;
        let late: Vec<(String, String, Duration)> = st
            .jobs
            .values()
            .filter(|j| j.completed_at.is_none())
            .filter_map(|j| match (&j.worker, j.dispatched_at) {
                (Some(w), Some(at)) if overdue(at, j.timeout, grace, now) => {
                    Some((j.name.clone(), w.clone(), j.timeout))
                }
                _ => None,
            })
            .collect();
        if late.is_empty() {
            return;
        }
        for (name, worker, timeout) in late {
            if let Some(w) = st.workers.get_mut(&worker) {
                if w.running.remove(&name) {
                    w.overdue.insert(name.clone());
                }
                let _ = w.tx.send(wpb::SchedulerMessage {
                    kind: Some(wpb::scheduler_message::Kind::Cancel(wpb::Cancel { job_id: name.clone() })),
                });
            }
            let why = format!("no result {:.0?} after its {timeout:.0?} timeout", grace);
            tracing::warn!(worker = %worker, operation = %name, "{why}; taking the action back");
            self.lose_job(&mut st, &name, &worker, &why);
        }
        self.dispatch(&mut st);
    }

    /// Cancels an operation: a queued one completes as CANCELLED at once, a running one
    /// when its worker has killed the process. `by` is the caller when it may touch only
    /// its own operations (None: an administrator). An operation another identity shares
    /// keeps running for that identity; the caller only lets go of it.
    pub fn cancel(&self, name: &str, by: Option<&str>) -> Result<()> {
        let mut st = self.state.lock().expect("poisoned");
        let job = st.jobs.get_mut(name).filter(|j| may_touch(j, by)).ok_or_else(|| not_found(name))?;
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
        // New requests for the same action start afresh instead of joining a cancelled one.
        if st.in_flight.get(&key).map(String::as_str) == Some(name) {
            st.in_flight.remove(&key);
        }
        let job = st.jobs.get_mut(name).expect("checked above");
        match job.worker.clone() {
            None => {
                self.complete(&mut st, name, cancelled_response());
                self.update_gauges(&st);
            }
            Some(w) => {
                if let Some(w) = st.workers.get(&w) {
                    let _ = w.tx.send(wpb::SchedulerMessage {
                        kind: Some(wpb::scheduler_message::Kind::Cancel(wpb::Cancel { job_id: name.to_string() })),
                    });
                }
            }
        }
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

    pub fn watch(&self, name: &str) -> Option<watch::Receiver<OpState>> {
        self.state.lock().expect("poisoned").jobs.get(name).map(|j| j.tx.subscribe())
    }

    /// Operations in submission order: all of them, or those `owner` shares.
    pub fn list(&self, owner: Option<&str>) -> Vec<OpState> {
        let st = self.state.lock().expect("poisoned");
        let mut v: Vec<_> =
            st.jobs.values().filter(|j| may_touch(j, owner)).map(|j| (j.seq, j.tx.borrow().clone())).collect();
        v.sort_by_key(|(s, _)| *s);
        v.into_iter().map(|(_, s)| s).collect()
    }

    /// Forgets a finished operation. Running ones cannot be deleted (cancel them first).
    /// `by` as for [`Scheduler::cancel`].
    pub fn delete(&self, name: &str, by: Option<&str>) -> Result<()> {
        let mut st = self.state.lock().expect("poisoned");
        match st.jobs.get(name).filter(|j| may_touch(j, by)) {
            None => Err(not_found(name)),
            Some(j) if j.completed_at.is_none() => Err(Error::FailedPrecondition(format!(
                "operation {} is still running; cancel it first",
                shown_name(name)
            ))),
            Some(_) => {
                st.jobs.remove(name);
                Ok(())
            }
        }
    }

    pub fn worker_count(&self) -> usize {
        self.state.lock().expect("poisoned").workers.len()
    }

    /// Metering method of each registered worker (for status and logs).
    pub fn worker_metering(&self) -> Vec<(String, String)> {
        let st = self.state.lock().expect("poisoned");
        st.workers.iter().map(|(id, w)| (id.clone(), w.metering.clone())).collect()
    }

    fn check_workers_and_gc(&self) {
        let lost: Vec<String> = {
            let st = self.state.lock().expect("poisoned");
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
        let mut st = self.state.lock().expect("poisoned");
        let keep = self.config.completed_retention;
        st.jobs.retain(|_, j| j.completed_at.is_none_or(|t| t.elapsed() < keep));
    }
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
            action,
            command: reapi::Command { arguments: vec!["true".into()], ..Default::default() },
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
            if let Some(wpb::scheduler_message::Kind::Assignment(a)) = m.kind {
                v.push(a.job_id);
            }
        }
        v
    }

    fn finished_ok(job: &str) -> wpb::ExecutionFinished {
        wpb::ExecutionFinished {
            job_id: job.into(),
            action_result: Some(ActionResult { exit_code: 0, ..Default::default() }.encode_to_vec()),
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
        a.action.do_not_cache = true;
        let mut b = spec("nc", 0, &[]);
        b.action.do_not_cache = true;
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
        assert!(matches!(m.kind, Some(wpb::scheduler_message::Kind::Cancel(c)) if c.job_id == r));
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
        let names = |v: Vec<OpState>| v.into_iter().map(|o| o.name).collect::<Vec<_>>();
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
        job.action.timeout = Some(gantry_core::google::protobuf::Duration { seconds: 1, nanos: 0 });
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
        assert!(matches!(m.kind, Some(wpb::scheduler_message::Kind::Cancel(c)) if c.job_id == n));
        assert_eq!(assigned(&mut other), vec![n.clone()], "re-queued and run elsewhere");
        assert_eq!(s.worker_count(), 2, "a heartbeating worker is not dropped");
        // The stuck worker's late report is ignored; the new worker's result completes it.
        let mut late = finished_ok(&n);
        late.action_result = Some(ActionResult { exit_code: 9, ..Default::default() }.encode_to_vec());
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
        job.action.timeout = Some(gantry_core::google::protobuf::Duration { seconds: 0, nanos: 200_000_000 });
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
}
