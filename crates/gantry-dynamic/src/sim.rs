//! A seeded, simulated-time benchmark of the strategies, driving the real
//! [`Coordinator`] and the real [`choose_delay`].
//!
//! The workload is a sequence of `gantry run` invocations (one at a time, as a
//! user or script would issue them) drawn from command shapes of three kinds:
//! - `cached`: usually an action-cache hit; a miss executes remotely somewhat
//!   slower than locally.
//! - `slow-remote`: rarely cached; remote execution is slow (queueing,
//!   big inputs), local is fast.
//! - `fast-remote`: rarely cached; remote execution on big workers is much
//!   faster than the local machine.
//!
//! Each invocation's latencies (cache lookup, hit download, remote execution,
//! local execution) are drawn once and replayed identically under every
//! configuration (common random numbers), so differences come from the policy
//! alone. The "oracle" is, per invocation, the better of the local-only and
//! remote-only runs. Local CPU seconds are reported too: racing immediately is
//! always fastest in this sequential model, and the delay exists to save them.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::coordinator::{Branch, Command, Coordinator, Event, RaceConfig, Strategy};
use crate::delay::{DelayConfig, DelayPlan, DelayStore, Observation};
use crate::race_stats::RaceStats;

/// Workload kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Cached,
    SlowRemote,
    FastRemote,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Cached, Kind::SlowRemote, Kind::FastRemote];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Cached => "cached",
            Kind::SlowRemote => "slow-remote",
            Kind::FastRemote => "fast-remote",
        }
    }

    fn idx(self) -> usize {
        match self {
            Kind::Cached => 0,
            Kind::SlowRemote => 1,
            Kind::FastRemote => 2,
        }
    }
}

/// Simulation parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    pub seed: u64,
    /// Number of `gantry run` invocations.
    pub commands: usize,
    /// Distinct command shapes per kind.
    pub shapes_per_kind: usize,
    /// Policy parameters for the learned configuration.
    pub delay: DelayConfig,
}

impl Default for SimConfig {
    fn default() -> SimConfig {
        SimConfig { seed: 7, commands: 3000, shapes_per_kind: 10, delay: DelayConfig::default() }
    }
}

/// Median latencies (ms) and hit probability of one command shape.
#[derive(Debug, Clone)]
struct ShapeModel {
    key: String,
    kind: Kind,
    p_hit: f64,
    lookup: f64,
    hit_download: f64,
    remote_exec: f64,
    local: f64,
}

/// One invocation's pre-drawn latencies (ms).
#[derive(Debug, Clone)]
struct Invocation {
    shape: usize,
    hit: bool,
    lookup: f64,
    hit_download: f64,
    remote_exec: f64,
    local: f64,
}

// Driver overheads (ms): renames into place, killing a process group,
// CancelOperation plus dropping downloads.
const WRITE_MS: f64 = 5.0;
const LOCAL_CANCEL_MS: f64 = 10.0;
const REMOTE_CANCEL_MS: f64 = 30.0;
/// Per-invocation log-normal spread around a shape's medians.
const SIGMA: f64 = 0.3;

fn normal(rng: &mut ChaCha8Rng) -> f64 {
    // Box-Muller; rand_distr is not among the allowed crates.
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

fn lognormal(rng: &mut ChaCha8Rng, median: f64) -> f64 {
    median * (SIGMA * normal(rng)).exp()
}

fn shapes(config: &SimConfig, rng: &mut ChaCha8Rng) -> Vec<ShapeModel> {
    let mut out = Vec::new();
    for kind in Kind::ALL {
        for i in 0..config.shapes_per_kind {
            let mut jitter = || rng.random_range(0.6..1.6);
            // (p_hit, lookup, hit download, remote exec, local), medians in ms.
            let (p_hit, lookup, dl, exec, local) = match kind {
                Kind::Cached => (0.95, 30.0, 250.0 * jitter(), 3000.0 * jitter(), 2000.0 * jitter()),
                Kind::SlowRemote => (0.05, 30.0, 250.0 * jitter(), 6000.0 * jitter(), 800.0 * jitter()),
                Kind::FastRemote => (0.05, 30.0, 250.0 * jitter(), 1500.0 * jitter(), 6000.0 * jitter()),
            };
            out.push(ShapeModel {
                key: format!("{}-{i}", kind.name()),
                kind,
                p_hit,
                lookup,
                hit_download: dl,
                remote_exec: exec,
                local,
            });
        }
    }
    out
}

fn workload(config: &SimConfig, shapes: &[ShapeModel], rng: &mut ChaCha8Rng) -> Vec<Invocation> {
    (0..config.commands)
        .map(|_| {
            let shape = rng.random_range(0..shapes.len());
            let s = &shapes[shape];
            Invocation {
                shape,
                hit: rng.random::<f64>() < s.p_hit,
                lookup: lognormal(rng, s.lookup),
                hit_download: lognormal(rng, s.hit_download),
                remote_exec: lognormal(rng, s.remote_exec),
                local: lognormal(rng, s.local),
            }
        })
        .collect()
}

fn d(ms: f64) -> Duration {
    Duration::from_micros((ms * 1000.0).round().max(0.0) as u64)
}

/// Result of one simulated invocation.
struct RunResult {
    wall: Duration,
    local_cpu: Duration,
    coordinator: Coordinator,
}

#[derive(Clone)]
struct Pending {
    at: Duration,
    seq: u64,
    owner: Option<Branch>,
    event: Event,
}

/// Drive one coordinator through an invocation in simulated time.
fn run_one(inv: &Invocation, config: RaceConfig) -> RunResult {
    let mut coord = Coordinator::new(config);
    let mut pending: Vec<Pending> = Vec::new();
    let mut seq = 0;
    let mut push = |pending: &mut Vec<Pending>, at: Duration, owner: Option<Branch>, event: Event| {
        seq += 1;
        pending.push(Pending { at, seq, owner, event });
    };
    push(&mut pending, Duration::ZERO, None, Event::Start);
    let mut local_start = None;
    let mut local_cpu = Duration::ZERO;
    let mut wall = Duration::ZERO;
    while let Some(i) = (0..pending.len()).min_by_key(|&i| (pending[i].at, pending[i].seq)) {
        let p = pending.swap_remove(i);
        let now = p.at;
        // Local CPU is burnt from start until the process exits or is reaped.
        let local_ends = matches!(p.event, Event::LocalReadyToWrite { .. } | Event::CancelConfirmed(Branch::Local));
        if local_ends && let Some(s) = local_start.take() {
            local_cpu += now - s;
        }
        for cmd in coord.handle(now, p.event) {
            match cmd {
                Command::StartRemote { .. } => {
                    if inv.hit {
                        let ready = now + d(inv.lookup + inv.hit_download);
                        push(&mut pending, ready, Some(Branch::Remote), Event::RemoteCacheHit { exit_code: 0 });
                    } else {
                        push(&mut pending, now + d(inv.lookup), Some(Branch::Remote), Event::RemoteCacheMiss);
                        let ready = now + d(inv.lookup + inv.remote_exec);
                        push(&mut pending, ready, Some(Branch::Remote), Event::RemoteReadyToWrite { exit_code: 0 });
                    }
                }
                Command::StartLocalAfter(delay) => push(&mut pending, now + delay, None, Event::DelayElapsed),
                Command::StartLocalNow => {
                    local_start = Some(now);
                    push(&mut pending, now, Some(Branch::Local), Event::LocalStarted);
                    let ready = now + d(inv.local);
                    push(&mut pending, ready, Some(Branch::Local), Event::LocalReadyToWrite { exit_code: 0 });
                }
                Command::CancelLocal | Command::CancelRemote => {
                    let (b, cost) = if cmd == Command::CancelLocal {
                        (Branch::Local, LOCAL_CANCEL_MS)
                    } else {
                        (Branch::Remote, REMOTE_CANCEL_MS)
                    };
                    pending.retain(|p| p.owner != Some(b));
                    push(&mut pending, now + d(cost), None, Event::CancelConfirmed(b));
                }
                Command::AcquireOutputLock(b) => push(&mut pending, now, None, Event::OutputLockAcquired(b)),
                Command::WriteOutputs(_) => push(&mut pending, now + d(WRITE_MS), None, Event::OutputsWritten),
                Command::Finish(_) => wall = now,
                Command::ReleaseOutputLock | Command::CleanupTemp(_) | Command::UploadLocalResult => {}
            }
        }
        if coord.is_finished() {
            break;
        }
    }
    RunResult { wall, local_cpu, coordinator: coord }
}

/// One configuration's totals.
#[derive(Debug, Clone, PartialEq)]
pub struct SimRow {
    pub name: String,
    /// Sum of wall times over the workload, in seconds.
    pub total_s: f64,
    /// Per [`Kind`] (in `Kind::ALL` order), in seconds.
    pub per_kind_s: [f64; 3],
    /// Local CPU seconds spent (including work thrown away by cancellation).
    pub local_cpu_s: f64,
}

/// The benchmark result.
#[derive(Debug, Clone)]
pub struct SimReport {
    pub commands: usize,
    pub per_kind_commands: [usize; 3],
    pub rows: Vec<SimRow>,
    pub oracle: SimRow,
    /// Race statistics of the learned configuration, by kind.
    pub learned_stats: RaceStats,
}

impl SimReport {
    pub fn row(&self, name: &str) -> Option<&SimRow> {
        self.rows.iter().find(|r| r.name == name)
    }

    /// How far a configuration is above the oracle, in percent.
    pub fn over_oracle_pct(&self, name: &str) -> Option<f64> {
        self.row(name).map(|r| 100.0 * (r.total_s / self.oracle.total_s - 1.0))
    }
}

pub const LOCAL_ONLY: &str = "local only";
pub const REMOTE_ONLY: &str = "remote only";
pub const DYNAMIC_FIXED: &str = "dynamic, fixed 1 s";
pub const DYNAMIC_LEARNED: &str = "dynamic, learned";
pub const DYNAMIC_ZERO: &str = "dynamic, delay 0";

/// Run the benchmark.
pub fn run(config: &SimConfig) -> SimReport {
    let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
    let shapes = shapes(config, &mut rng);
    let invs = workload(config, &shapes, &mut rng);
    let mut per_kind_commands = [0; 3];
    for inv in &invs {
        per_kind_commands[shapes[inv.shape].kind.idx()] += 1;
    }

    let fixed = |strategy, plan| RaceConfig { strategy, delay: plan, upload_local_results: true };
    let zero = DelayPlan::fixed(Duration::ZERO);
    let configs: Vec<(&str, Option<RaceConfig>)> = vec![
        (LOCAL_ONLY, Some(fixed(Strategy::Local, zero))),
        (REMOTE_ONLY, Some(fixed(Strategy::Remote, zero))),
        (DYNAMIC_FIXED, Some(fixed(Strategy::Dynamic, DelayPlan::fixed(Duration::from_secs(1))))),
        (DYNAMIC_LEARNED, None),
        (DYNAMIC_ZERO, Some(fixed(Strategy::Dynamic, zero))),
    ];

    let mut rows = Vec::new();
    let mut walls: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut learned_stats = RaceStats::default();
    for (name, race) in configs {
        let mut store = DelayStore::default();
        let mut row = SimRow { name: name.to_string(), total_s: 0.0, per_kind_s: [0.0; 3], local_cpu_s: 0.0 };
        let mut w = Vec::with_capacity(invs.len());
        for inv in &invs {
            let shape = &shapes[inv.shape];
            let race = race.clone().unwrap_or_else(|| RaceConfig::dynamic(store.plan(&shape.key, &config.delay)));
            let r = run_one(inv, race);
            if name == DYNAMIC_LEARNED {
                // Learn online, exactly as the driver would after each run.
                let report = r.coordinator.report();
                learned_stats.record(shape.kind.name(), report, store.shapes.get(&shape.key), &config.delay);
                store.record(&shape.key, &Observation::from_report(report), &config.delay);
            }
            let s = r.wall.as_secs_f64();
            row.total_s += s;
            row.per_kind_s[shape.kind.idx()] += s;
            row.local_cpu_s += r.local_cpu.as_secs_f64();
            w.push(s);
        }
        walls.insert(name, w);
        rows.push(row);
    }

    let mut oracle =
        SimRow { name: "oracle (per-command best)".into(), total_s: 0.0, per_kind_s: [0.0; 3], local_cpu_s: 0.0 };
    let (local, remote) = (&walls[LOCAL_ONLY], &walls[REMOTE_ONLY]);
    for (i, inv) in invs.iter().enumerate() {
        let best = local[i].min(remote[i]);
        oracle.total_s += best;
        oracle.per_kind_s[shapes[inv.shape].kind.idx()] += best;
        if local[i] < remote[i] {
            oracle.local_cpu_s += local[i];
        }
    }
    SimReport { commands: invs.len(), per_kind_commands, rows, oracle, learned_stats }
}

impl fmt::Display for SimReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} invocations (", self.commands)?;
        for k in Kind::ALL {
            write!(f, "{}{} {}", if k == Kind::Cached { "" } else { ", " }, self.per_kind_commands[k.idx()], k.name())?;
        }
        writeln!(f, "); wall time in seconds, summed")?;
        write!(f, "{:<27} {:>9} {:>8}", "configuration", "total", "vs best")?;
        for k in Kind::ALL {
            write!(f, " {:>12}", k.name())?;
        }
        writeln!(f, " {:>10}", "local CPU")?;
        for r in self.rows.iter().chain(std::iter::once(&self.oracle)) {
            let pct = 100.0 * (r.total_s / self.oracle.total_s - 1.0);
            write!(f, "{:<27} {:>9.1} {:>+7.1}%", r.name, r.total_s, pct)?;
            for k in Kind::ALL {
                write!(f, " {:>12.1}", r.per_kind_s[k.idx()])?;
            }
            writeln!(f, " {:>10.1}", r.local_cpu_s)?;
        }
        writeln!(f)?;
        writeln!(f, "race statistics, {DYNAMIC_LEARNED} (by kind):")?;
        write!(f, "{}", self.learned_stats)
    }
}
