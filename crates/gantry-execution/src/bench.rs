//! The scheduler benchmark behind `gantry bench scheduler`: the real [`Scheduler`],
//! driven in process by simulated workers (no processes, no network).
//!
//! What it measures, and why that way:
//! - **Assignments per second at a steady backlog.** Every slot is busy and `queued`
//!   actions wait. Each step, one running action finishes (its slot is refilled from the
//!   queue) and one new action arrives, so the backlog stays put while it is measured.
//!   The same steps run unmeasured first, until finished operations start to leave their
//!   retention: before that, the scheduler's maps grow every step, as a server's do only
//!   in its first minutes.
//! - **Arrival-to-assignment latency with a free slot.** One extra worker on a platform
//!   of its own stays idle; an action for it arrives, is assigned and finishes, many
//!   times, with the whole backlog still waiting for the other platforms. The latency is
//!   from the call to `submit` to the assignment arriving on the worker's channel.
//! - **Memory**: resident set growth while the backlog is queued, per queued action.
//!
//! The action cache, execution log and size-class statistics the scheduler writes to
//! are in-memory here, so the figures are the scheduler's own cost, not a database's.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use gantry_core::reapi::{self, ActionResult};
use gantry_core::{ActionCache, ActionRecord, Digest, DigestFunction, ExecutionLog, Result, SizeClassStore};
use gantry_proto::worker::v1 as wpb;
use prost::Message;

use crate::dispatcher::{Dispatcher, Properties};
use crate::platform::Property;
use crate::scheduler::{JobSpec, Requester, Scheduler, SchedulerConfig, ToWorker, WorkerLink};
use crate::sizing::Sizing;

/// One benchmark run's shape.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Worker slots in all, over `platforms` × `classes` pools.
    pub slots: usize,
    /// Slots per worker.
    pub slots_per_worker: usize,
    pub platforms: usize,
    pub classes: u32,
    /// Actions waiting while the measurement runs.
    pub queued: usize,
    /// Share of actions for the last platform, which has only `rare_slots` slots.
    pub rare_fraction: f64,
    pub rare_slots: usize,
    /// Assignments measured at the steady backlog.
    pub steps: usize,
    /// Arrivals measured for latency.
    pub latency_samples: usize,
    /// Let the size-class learner choose classes (else any class runs any action).
    pub learning: bool,
    /// Distinct action shapes (commands), for the learner's statistics.
    pub shapes: usize,
    pub seed: u64,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            slots: 5000,
            slots_per_worker: 1,
            platforms: 4,
            classes: 4,
            queued: 200_000,
            rare_fraction: 0.1,
            rare_slots: 50,
            steps: 200_000,
            latency_samples: 20_000,
            learning: false,
            shapes: 200,
            seed: 1,
        }
    }
}

#[derive(Debug, Clone)]
pub struct BenchReport {
    pub options: BenchOptions,
    pub workers: usize,
    /// Time to queue the backlog, per action.
    pub fill_us_per_action: f64,
    pub assignments_per_second: f64,
    /// Wall time per step (one completion and one arrival).
    pub us_per_event: f64,
    pub latency_p50_us: f64,
    pub latency_p99_us: f64,
    /// Resident memory added by the backlog, per queued action.
    pub bytes_per_queued: Option<f64>,
    pub rss_mib: Option<f64>,
    /// The same steady backlog on the matching core alone ([`Dispatcher`]), without
    /// operations, watchers, records or worker channels.
    pub core_assignments_per_second: f64,
    pub core_ns_per_event: f64,
}

#[derive(Default)]
struct MemoryStores {
    results: Mutex<u64>,
    records: Mutex<u64>,
    stats: Mutex<HashMap<String, String>>,
}

/// The scheduler only writes results, and nothing here reads them: counted, not kept. A
/// map of every result grew for the whole run, and its rehashing (page faults of fresh
/// memory included) was a sixth of the measured time, which no real store would cost
/// the scheduler.
#[async_trait]
impl ActionCache for MemoryStores {
    async fn get(&self, _instance: &str, _action: &Digest) -> Result<Option<ActionResult>> {
        Ok(None)
    }
    async fn put(&self, _instance: &str, _action: &Digest, _result: &ActionResult) -> Result<()> {
        *self.results.lock().expect("bench lock") += 1;
        Ok(())
    }
}

#[async_trait]
impl ExecutionLog for MemoryStores {
    /// Counted, not kept: a long run would otherwise measure its own memory growth.
    async fn record(&self, _record: &ActionRecord) -> Result<()> {
        *self.records.lock().expect("bench lock") += 1;
        Ok(())
    }
    async fn actions(&self, _tool_invocation_id: &str) -> Result<Vec<ActionRecord>> {
        Ok(Vec::new())
    }
    async fn runs(&self, _of: gantry_core::RunsOf<'_>, _limit: usize) -> Result<Vec<ActionRecord>> {
        Ok(Vec::new())
    }
    async fn class_runs(&self, _since: i64, _bucket_ms: i64) -> Result<Vec<gantry_core::ClassRuns>> {
        Ok(Vec::new())
    }
}

#[async_trait]
impl SizeClassStore for MemoryStores {
    async fn get(&self, key: &str) -> Result<Option<String>> {
        Ok(self.stats.lock().expect("bench lock").get(key).cloned())
    }
    async fn put(&self, key: &str, stats_json: &str) -> Result<()> {
        self.stats.lock().expect("bench lock").insert(key.to_string(), stats_json.to_string());
        Ok(())
    }
    async fn keys(&self, limit: usize) -> Result<Vec<String>> {
        Ok(self.stats.lock().expect("bench lock").keys().take(limit).cloned().collect())
    }
}

/// A small deterministic generator, so that runs with one seed are alike.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn platform_of(p: usize) -> reapi::Platform {
    reapi::Platform { properties: vec![reapi::platform::Property { name: "pool".into(), value: format!("p{p}") }] }
}

struct Driver {
    rng: Rng,
    opts: BenchOptions,
    counter: u64,
    commands: Vec<Digest>,
}

impl Driver {
    fn spec(&mut self, platform: usize) -> JobSpec {
        self.counter += 1;
        let shape = (self.rng.next() % self.commands.len() as u64) as usize;
        let action = reapi::Action {
            command_digest: Some(self.commands[shape].to_proto()),
            input_root_digest: Some(DigestFunction::Sha256.digest_of(&self.counter.to_le_bytes()).to_proto()),
            platform: Some(platform_of(platform)),
            ..Default::default()
        };
        JobSpec {
            instance: String::new(),
            action_digest: DigestFunction::Sha256.digest_of(&action.encode_to_vec()),
            action: action.into(),
            command: reapi::Command { arguments: vec!["true".into()], ..Default::default() }.into(),
            priority: 0,
            requester: Requester::default(),
            owner: None,
        }
    }

    /// A platform for a new backlog action: the rare one with `rare_fraction`.
    fn backlog_platform(&mut self) -> usize {
        let rare = self.opts.platforms - 1;
        if self.opts.platforms == 1 || self.rng.unit() < self.opts.rare_fraction {
            rare
        } else {
            (self.rng.next() % rare as u64) as usize
        }
    }
}

/// An in-process worker's report of a run that passed: values, as such a worker sends.
fn finished_ok(job_id: &str) -> gantry_core::Finished {
    gantry_core::Finished {
        job_id: job_id.to_string(),
        action_result: Some(ActionResult { exit_code: 0, ..Default::default() }),
        metering: Some(gantry_core::Metering { wall_seconds: 1.0, method: "bench".into(), ..Default::default() }),
        ..Default::default()
    }
}

fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// How long finished operations are kept. A server's default (10 minutes) would keep every
/// operation of the run; what is measured is the cost of keeping and expiring them, which a
/// few seconds' worth already shows (a few hundred thousand at these rates).
const RETENTION: Duration = Duration::from_secs(2);

/// One step at the steady backlog: `job` finishes on `worker` (its slot is refilled from the
/// queue) and `spec` arrives. Returns the assignments it led to; each is pushed on
/// `running`, to finish in its turn.
async fn step(
    s: &Scheduler,
    links: &mut HashMap<String, WorkerLink>,
    running: &mut VecDeque<(String, String)>,
    worker: String,
    job: String,
    spec: JobSpec,
) -> Result<usize> {
    let mut assigned = 0;
    s.finished(&worker, finished_ok(&job)).await;
    let link = links.get_mut(&worker).expect("known worker");
    while let Ok(m) = link.messages.try_recv() {
        // The bench's workers are in-process: their bridge copies each message into the
        // worker's values (a remote session would encode it for the wire), so that is part
        // of an assignment's cost.
        std::hint::black_box(m.to_order());
        if let ToWorker::Assign(a) = m {
            running.push_back((worker.clone(), a.job_id.clone()));
            assigned += 1;
        }
    }
    let (name, _) = s.submit(spec).await?;
    // Assigned at once to an idle worker (with learning, a class can have idle slots while
    // others queue): take it from that worker, so that it finishes in its turn.
    if let Some(id) = s.worker_of(&name)
        && let Some(link) = links.get_mut(&id)
    {
        while let Ok(m) = link.messages.try_recv() {
            std::hint::black_box(m.to_order());
            if let ToWorker::Assign(a) = m {
                running.push_back((id.clone(), a.job_id.clone()));
                assigned += 1;
            }
        }
    }
    Ok(assigned)
}

/// Runs one benchmark. `progress` is told of each phase.
pub async fn run(opts: BenchOptions, progress: &dyn Fn(&str)) -> Result<BenchReport> {
    if opts.platforms == 0 || opts.classes == 0 || opts.slots_per_worker == 0 || opts.shapes == 0 {
        return Err(gantry_core::Error::invalid("platforms, classes, slots per worker and shapes must be at least 1"));
    }
    if opts.rare_slots >= opts.slots || opts.slots < (opts.platforms * opts.classes as usize) {
        return Err(gantry_core::Error::invalid(
            "slots must exceed the rare platform's slots and give every platform and class at least one",
        ));
    }
    let stores = Arc::new(MemoryStores::default());
    let registry = prometheus::Registry::new();
    let sizing = if opts.learning {
        let cached = gantry_config::SizeClassConfig::default().cached_shapes;
        Some(Sizing::new(
            gantry_sizeclass::SelectionConfig::default(),
            stores.clone(),
            Some(opts.seed),
            cached,
            &registry,
        )?)
    } else {
        None
    };
    let cfg = SchedulerConfig { completed_retention: RETENTION, ..Default::default() };
    let s = Scheduler::new(cfg, stores.clone(), stores.clone(), &registry, sizing);

    // Workers: see `worker_layout`.
    let mut links: HashMap<String, WorkerLink> = HashMap::new();
    let rare = opts.platforms - 1;
    for w in worker_layout(&opts) {
        let id = format!("w-p{}-c{}-{}", w.platform, w.class, w.index);
        let reg = wpb::Register {
            worker_id: id.clone(),
            properties: vec![wpb::Property { name: "pool".into(), value: format!("p{}", w.platform) }],
            slots: w.slots as u32,
            size_class: w.class,
            metering: "bench".into(),
        };
        links.insert(id, s.register(reg, true)?);
    }
    let workers = links.len();
    let commands =
        (0..opts.shapes).map(|i| DigestFunction::Sha256.digest_of(format!("command {i}").as_bytes())).collect();
    let mut d = Driver { rng: Rng(opts.seed.max(1)), opts: opts.clone(), counter: 0, commands };

    // Every slot busy, then the backlog.
    progress(&format!("queueing {} actions on {} slots ({workers} workers)", opts.queued + opts.slots, opts.slots));
    let rss0 = rss_bytes();
    let fill_start = Instant::now();
    for i in 0..opts.queued + opts.slots {
        // The first actions fill each platform's slots, so that the backlog is the
        // queue and not idle workers.
        let p = if i >= opts.slots {
            d.backlog_platform()
        } else if i >= opts.slots - opts.rare_slots {
            rare
        } else {
            i % (opts.platforms - 1).max(1)
        };
        let spec = d.spec(p);
        s.submit(spec).await?;
    }
    let fill = fill_start.elapsed();
    let rss1 = rss_bytes();
    let mut running: VecDeque<(String, String)> = VecDeque::new();
    for (id, link) in links.iter_mut() {
        while let Ok(m) = link.messages.try_recv() {
            if let ToWorker::Assign(a) = m {
                running.push_back((id.clone(), a.job_id.clone()));
            }
        }
    }

    // Steady backlog: one completion and one arrival per step, for the platform of the
    // action that finished, so that every platform's backlog stays as it was.
    let platform_of_worker = |w: &str| -> usize {
        w.strip_prefix("w-p").and_then(|r| r.split('-').next()).and_then(|p| p.parse().ok()).unwrap_or(0)
    };
    // Warm-up, not measured: until the first finished operations pass their retention, the
    // scheduler keeps every one it finishes, and its maps and memory grow each step. A
    // server in service has a full retention, so that is the state measured.
    progress(&format!("warming up for the {:?} retention", RETENTION));
    let warm_until = Instant::now() + RETENTION + RETENTION / 4;
    while Instant::now() < warm_until {
        for _ in 0..1000 {
            let Some((worker, job)) = running.pop_front() else { break };
            let p = platform_of_worker(&worker);
            let spec = d.spec(p);
            step(&s, &mut links, &mut running, worker, job, spec).await?;
        }
    }
    progress(&format!("{} running, measuring {} assignments", running.len(), opts.steps));
    // Arrivals are made beforehand (in proportion to each platform's slots), so that
    // making them is not measured.
    let mut share = vec![0usize; opts.platforms];
    for (w, _) in &running {
        share[platform_of_worker(w)] += 1;
    }
    let total = running.len().max(1);
    let mut arrivals: Vec<VecDeque<JobSpec>> = share
        .iter()
        .enumerate()
        .map(|(p, &n)| (0..opts.steps * n / total + opts.steps / 20 + 1).map(|_| d.spec(p)).collect())
        .collect();
    let mut assigned = 0usize;
    let mut steps = 0usize;
    let start = Instant::now();
    for _ in 0..opts.steps {
        let Some((worker, job)) = running.pop_front() else { break };
        steps += 1;
        let p = platform_of_worker(&worker);
        let spec = match arrivals[p].pop_front() {
            Some(spec) => spec,
            None => d.spec(p),
        };
        assigned += step(&s, &mut links, &mut running, worker, job, spec).await?;
    }
    let elapsed = start.elapsed();
    if assigned < steps * 9 / 10 {
        // With learning, the learner may move a shape between classes while it runs, so
        // one class's backlog can drain while another's grows; the rate counts only real
        // assignments either way.
        progress(&format!(
            "note: {assigned} of {steps} steps led to an assignment (the learner moved actions between classes)"
        ));
    }

    // Latency with a free slot, under the same backlog.
    progress(&format!("measuring {} arrivals with a free slot", opts.latency_samples));
    let probe = wpb::Register {
        worker_id: "probe".into(),
        properties: vec![wpb::Property { name: "pool".into(), value: "probe".into() }],
        slots: 1,
        size_class: 1,
        metering: "bench".into(),
    };
    let mut probe_link = s.register(probe, true)?;
    let mut lat = Vec::with_capacity(opts.latency_samples);
    for _ in 0..opts.latency_samples {
        d.counter += 1;
        let mut spec = d.spec(0);
        Arc::make_mut(&mut spec.action).platform = Some(reapi::Platform {
            properties: vec![reapi::platform::Property { name: "pool".into(), value: "probe".into() }],
        });
        spec.action_digest = DigestFunction::Sha256.digest_of(&spec.action.encode_to_vec());
        let t0 = Instant::now();
        s.submit(spec).await?;
        let job = match probe_link.messages.try_recv() {
            Ok(ToWorker::Assign(a)) => a.job_id.clone(),
            other => {
                return Err(gantry_core::Error::Internal(format!(
                    "the probe worker's action was not assigned at once: {other:?}"
                )));
            }
        };
        lat.push(t0.elapsed().as_secs_f64() * 1e6);
        s.finished("probe", finished_ok(&job)).await;
    }
    lat.sort_by(f64::total_cmp);
    if let Err(e) = s.check_invariants() {
        return Err(gantry_core::Error::Internal(format!("scheduler invariants broken after the run: {e}")));
    }
    drop(links);
    drop(s);
    progress("the same backlog on the matching core alone");
    let (core_rate, core_ns) = core_only(&opts)?;
    Ok(BenchReport {
        workers,
        fill_us_per_action: fill.as_secs_f64() * 1e6 / (opts.queued + opts.slots) as f64,
        assignments_per_second: assigned as f64 / elapsed.as_secs_f64(),
        us_per_event: elapsed.as_secs_f64() * 1e6 / steps.max(1) as f64,
        latency_p50_us: percentile(&lat, 0.5),
        latency_p99_us: percentile(&lat, 0.99),
        bytes_per_queued: match (rss0, rss1) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / (opts.queued + opts.slots) as f64),
            _ => None,
        },
        rss_mib: rss_bytes().map(|b| b as f64 / (1 << 20) as f64),
        core_assignments_per_second: core_rate,
        core_ns_per_event: core_ns,
        options: opts,
    })
}

/// One simulated worker of the bench's fleet.
struct WorkerSpec {
    platform: usize,
    class: u32,
    /// 1-based within its platform and class.
    index: usize,
    slots: usize,
}

/// The bench's fleet: the rare platform gets `rare_slots`, the rest share the remainder;
/// each platform's slots are spread over the size classes, in workers of at most
/// `slots_per_worker`. The full scheduler run and [`core_only`] measure the same fleet.
fn worker_layout(opts: &BenchOptions) -> Vec<WorkerSpec> {
    let rare = opts.platforms - 1;
    let common_slots = opts.slots - opts.rare_slots;
    let mut workers = Vec::new();
    for platform in 0..opts.platforms {
        let slots = if opts.platforms == 1 {
            opts.slots
        } else if platform == rare {
            opts.rare_slots
        } else {
            common_slots / (opts.platforms - 1) + usize::from(platform < common_slots % (opts.platforms - 1))
        };
        for c in 0..opts.classes {
            let mut left = slots / opts.classes as usize + usize::from((c as usize) < slots % opts.classes as usize);
            let mut index = 0;
            while left > 0 {
                let take = left.min(opts.slots_per_worker);
                left -= take;
                index += 1;
                workers.push(WorkerSpec { platform, class: c + 1, index, slots: take });
            }
        }
    }
    workers
}

/// The steady-backlog measurement on the [`Dispatcher`] alone: any class runs any action,
/// one finish and one arrival per step. Returns assignments per second and ns per step.
fn core_only(opts: &BenchOptions) -> Result<(f64, f64)> {
    let mut d = Dispatcher::new();
    let mut rng = Rng(opts.seed.max(1));
    let plat = |p: usize| -> Properties { vec![Property { name: "pool".into(), value: format!("p{p}") }].into() };
    let plats: Vec<Properties> = (0..opts.platforms).map(plat).collect();
    let rare = opts.platforms - 1;
    for w in worker_layout(opts) {
        d.add_worker(plats[w.platform].clone(), w.class, w.slots);
    }
    let pick = |rng: &mut Rng| {
        if opts.platforms == 1 || rng.unit() < opts.rare_fraction {
            rare
        } else {
            (rng.next() % rare as u64) as usize
        }
    };
    let mut running: VecDeque<u64> = VecDeque::new();
    for i in 0..opts.queued + opts.slots {
        let p = if i >= opts.slots {
            pick(&mut rng)
        } else if i >= opts.slots - opts.rare_slots {
            rare
        } else {
            i % (opts.platforms - 1).max(1)
        };
        let (_, out) = d.submit(0, plats[p].clone(), None);
        running.extend(out.iter().map(|a| a.job));
    }
    // As in the scheduler's run: each arrival is for the platform whose action finished.
    let mut running: VecDeque<(u64, usize)> =
        running.into_iter().map(|j| (j, platform_running(&d, j, &plats))).collect();
    let (mut assigned, mut steps) = (0usize, 0usize);
    let start = Instant::now();
    for _ in 0..opts.steps {
        let Some((job, p)) = running.pop_front() else { break };
        steps += 1;
        let out = d.finish(job);
        assigned += out.len();
        running.extend(out.iter().map(|a| (a.job, p)));
        let (_, out) = d.submit(0, plats[p].clone(), None);
        assigned += out.len();
        running.extend(out.iter().map(|a| (a.job, p)));
    }
    let elapsed = start.elapsed().as_secs_f64();
    d.check().map_err(|e| gantry_core::Error::Internal(format!("dispatcher invariants broken after the run: {e}")))?;
    Ok((assigned as f64 / elapsed, elapsed * 1e9 / steps.max(1) as f64))
}

/// The platform a running job's worker offers (workers offer exactly one here).
fn platform_running(d: &Dispatcher, job: u64, plats: &[Properties]) -> usize {
    let offered = d.worker_of(job).and_then(|w| d.offered_by(w));
    plats.iter().position(|p| Some(p) == offered).unwrap_or(0)
}
