//! The scheduler's matching core: which queued action runs on which worker slot.
//!
//! It is pure bookkeeping (no clock, no channels, no I/O), so every behaviour and
//! invariant is tested directly, and the scheduler wraps it in one lock.
//!
//! Why it is shaped this way: a fleet has few distinct platforms but many actions and
//! slots. Actions wait in one queue per (required properties, size class), each ordered
//! by (priority, arrival). Workers are grouped into pools per (offered properties, size
//! class), and each pool keeps its workers with a free slot ordered by load. Queues and
//! pools are linked once, when a new key first appears. So an arriving action looks only
//! at the free workers of the pools that can run it, and a freed slot only at the heads
//! of the queues its pool can serve: O(log n) plus the number of distinct platforms,
//! whatever the length of the queues.
//!
//! The invariant that makes this enough: no queued action could run on a free slot of a
//! worker it does not avoid (an action taken back from a stuck worker avoids that
//! worker). An event can only break it locally, so each event repairs it locally.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use crate::platform::{self, Property};

/// A job as the dispatcher knows it; the scheduler maps it to its operation.
pub type JobId = u64;

/// Ids the dispatcher makes for itself ([`Dispatcher::submit`]) stay below this; ids a
/// caller chooses ([`Dispatcher::submit_as`]) are at or above it, so the two never meet.
pub const CALLER_IDS: JobId = 1 << 63;
/// A registered worker, numbered in registration order.
pub type WorkerId = u64;

/// The platform properties an action requires or a worker offers: sorted, deduplicated.
pub type Properties = Arc<[Property]>;

/// Hashes the dispatcher's own numeric ids. They come from a counter, not from clients,
/// so they need no flooding protection, and SipHash was a tenth of an event's cost.
#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        // Spread sequential ids over all bits (the multiplier is 2^64 / golden ratio):
        // hashbrown takes its tag from the top bits.
        self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }
}

/// A map keyed by dispatcher ids.
pub type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;
type IdSet = HashSet<u64, BuildHasherDefault<IdHasher>>;

/// An action handed to a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assign {
    pub job: JobId,
    pub worker: WorkerId,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Queued(u64),
    Running(WorkerId),
    /// Neither queued nor on a worker: its worker was lost or it was taken back, and the
    /// caller decides whether to re-queue or remove it.
    Detached,
}

struct Job {
    priority: i32,
    seq: u64,
    required: Properties,
    class: Option<u32>,
    place: Place,
    /// Workers this job must not run on again (it was taken back from them unreported).
    avoid: Vec<WorkerId>,
}

struct Queue {
    required: Properties,
    class: Option<u32>,
    waiting: BTreeSet<(i32, u64, JobId)>,
    pools: Vec<u64>,
}

struct Pool {
    offered: Properties,
    class: u32,
    queues: Vec<u64>,
    /// Workers with a free slot, least loaded first (load in thousandths of its slots).
    free: BTreeSet<(u32, WorkerId)>,
    workers: usize,
    slots: usize,
    busy: usize,
}

struct Worker {
    pool: u64,
    slots: usize,
    running: IdSet,
    /// Jobs taken back from this worker that it never reported: each still holds a slot
    /// until it does, so a stuck worker gets no more work than it has slots.
    overdue: IdSet,
}

impl Worker {
    fn busy(&self) -> usize {
        self.running.len() + self.overdue.len()
    }

    fn load(&self) -> u32 {
        (self.busy() * 1000 / self.slots.max(1)) as u32
    }
}

/// Slots, free slots and queued jobs of one size class, for queue-aware class choice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassLoad {
    pub slots: usize,
    pub idle: usize,
    pub queued: usize,
}

#[derive(Default)]
pub struct Dispatcher {
    jobs: IdMap<Job>,
    queues: IdMap<Queue>,
    /// foldhash (seeded per process), not SipHash, whose hashing of the property strings
    /// was an arrival's largest hashing cost: once workers are registered, an action asking
    /// for a property no worker offers is refused before it gets here, so the operators'
    /// fleet, not clients, bounds the keys.
    queue_ix: HashMap<(Properties, Option<u32>), u64, foldhash::fast::RandomState>,
    pools: IdMap<Pool>,
    pool_ix: HashMap<(Properties, u32), u64, foldhash::fast::RandomState>,
    workers: IdMap<Worker>,
    next_id: u64,
    /// Bumped whenever a worker joins or leaves (see [`Dispatcher::generation`]).
    generation: u64,
    seq: u64,
    queued: usize,
    running: usize,
}

fn serves(pool: &Pool, queue: &Queue) -> bool {
    queue.class.is_none_or(|c| c == pool.class) && platform::satisfies(&pool.offered, &queue.required)
}

impl Dispatcher {
    pub fn new() -> Self {
        Self::default()
    }

    fn fresh_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    pub fn queued(&self) -> usize {
        self.queued
    }

    pub fn running(&self) -> usize {
        self.running
    }

    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    /// The worker a job runs on, if it is running.
    pub fn worker_of(&self, job: JobId) -> Option<WorkerId> {
        match self.jobs.get(&job)?.place {
            Place::Running(w) => Some(w),
            _ => None,
        }
    }

    pub fn is_queued(&self, job: JobId) -> bool {
        self.jobs.get(&job).is_some_and(|j| matches!(j.place, Place::Queued(_)))
    }

    /// What a worker offers.
    pub fn offered_by(&self, worker: WorkerId) -> Option<&Properties> {
        self.workers.get(&worker).map(|w| &self.pools[&w.pool].offered)
    }

    /// Jobs running on a worker.
    pub fn running_on(&self, worker: WorkerId) -> impl Iterator<Item = JobId> + '_ {
        self.workers.get(&worker).into_iter().flat_map(|w| w.running.iter().copied())
    }

    /// A worker's slots and how many are taken (running, or taken back and unreported).
    pub fn slots_of(&self, worker: WorkerId) -> Option<(usize, usize)> {
        self.workers.get(&worker).map(|w| (w.slots, w.busy()))
    }

    /// Every queue with something waiting: (required properties, size class, depth).
    pub fn queue_depths(&self) -> impl Iterator<Item = (&Properties, Option<u32>, usize)> + '_ {
        self.queues.values().filter(|q| !q.waiting.is_empty()).map(|q| (&q.required, q.class, q.waiting.len()))
    }

    /// Distinct (offered properties, size class) among registered workers.
    fn live_pools(&self) -> impl Iterator<Item = &Pool> + Clone {
        self.pools.values().filter(|p| p.workers > 0)
    }

    /// Size classes with a worker that can run an action requiring `required`.
    /// Ascending, without repeats. A vector, not a set: it is made on every submit, for a
    /// handful of classes.
    pub fn classes_for(&self, required: &[Property]) -> Vec<u32> {
        let mut classes: Vec<u32> =
            self.live_pools().filter(|p| platform::satisfies(&p.offered, required)).map(|p| p.class).collect();
        classes.sort_unstable();
        classes.dedup();
        classes
    }

    /// Distinct size classes among registered workers.
    pub fn class_count(&self) -> usize {
        self.live_pools().map(|p| p.class).collect::<BTreeSet<_>>().len()
    }

    /// The first required property no registered worker offers (None when there are no
    /// workers, or every property is offered by some worker).
    pub fn first_unoffered<'a>(&self, required: &'a [Property]) -> Option<&'a Property> {
        required.iter().find(|r| !self.live_pools().any(|p| p.offered.contains(r)))
    }

    /// Changes whenever the fleet does (a worker joins or leaves): answers of
    /// [`Dispatcher::classes_for`] and [`Dispatcher::first_unoffered`] hold while it stays.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn has_workers(&self) -> bool {
        !self.workers.is_empty()
    }

    /// Capacity and backlog of each size class.
    pub fn class_loads(&self) -> BTreeMap<u32, ClassLoad> {
        let mut m: BTreeMap<u32, ClassLoad> = BTreeMap::new();
        for p in self.live_pools() {
            let c = m.entry(p.class).or_default();
            c.slots += p.slots;
            c.idle += p.slots - p.busy;
        }
        for q in self.queues.values() {
            if let Some(c) = q.class {
                m.entry(c).or_default().queued += q.waiting.len();
            }
        }
        m
    }

    fn queue_for(&mut self, required: &Properties, class: Option<u32>) -> u64 {
        if let Some(&q) = self.queue_ix.get(&(required.clone(), class)) {
            return q;
        }
        let id = self.fresh_id();
        let mut q = Queue { required: required.clone(), class, waiting: BTreeSet::new(), pools: Vec::new() };
        for (&pid, p) in self.pools.iter_mut() {
            if serves(p, &q) {
                q.pools.push(pid);
                p.queues.push(id);
            }
        }
        self.queues.insert(id, q);
        self.queue_ix.insert((required.clone(), class), id);
        id
    }

    fn pool_for(&mut self, offered: &Properties, class: u32) -> u64 {
        if let Some(&p) = self.pool_ix.get(&(offered.clone(), class)) {
            return p;
        }
        let id = self.fresh_id();
        let mut p = Pool {
            offered: offered.clone(),
            class,
            queues: Vec::new(),
            free: BTreeSet::new(),
            workers: 0,
            slots: 0,
            busy: 0,
        };
        for (&qid, q) in self.queues.iter_mut() {
            if serves(&p, q) {
                p.queues.push(qid);
                q.pools.push(id);
            }
        }
        self.pools.insert(id, p);
        self.pool_ix.insert((offered.clone(), class), id);
        id
    }

    /// Drops queues with nothing waiting and pools with no workers, so that keys seen
    /// once do not cost every later event.
    pub fn compact(&mut self) {
        let empty_queues: Vec<u64> =
            self.queues.iter().filter(|(_, q)| q.waiting.is_empty()).map(|(&i, _)| i).collect();
        for qid in empty_queues {
            let q = self.queues.remove(&qid).expect("listed");
            self.queue_ix.remove(&(q.required.clone(), q.class));
            for pid in q.pools {
                if let Some(p) = self.pools.get_mut(&pid) {
                    p.queues.retain(|&x| x != qid);
                }
            }
        }
        let empty_pools: Vec<u64> = self.pools.iter().filter(|(_, p)| p.workers == 0).map(|(&i, _)| i).collect();
        for pid in empty_pools {
            let p = self.pools.remove(&pid).expect("listed");
            self.pool_ix.remove(&(p.offered.clone(), p.class));
            for qid in p.queues {
                if let Some(q) = self.queues.get_mut(&qid) {
                    q.pools.retain(|&x| x != pid);
                }
            }
        }
    }

    /// Adds a worker and fills its slots from the queues.
    pub fn add_worker(&mut self, offered: Properties, class: u32, slots: usize) -> (WorkerId, Vec<Assign>) {
        self.generation += 1;
        let pid = self.pool_for(&offered, class);
        let id = self.fresh_id();
        let slots = slots.max(1);
        let w = Worker { pool: pid, slots, running: IdSet::default(), overdue: IdSet::default() };
        let p = self.pools.get_mut(&pid).expect("just made");
        p.workers += 1;
        p.slots += slots;
        p.free.insert((w.load(), id));
        self.workers.insert(id, w);
        let mut out = Vec::new();
        self.fill(id, &mut out);
        (id, out)
    }

    /// Removes a worker. Its running jobs are returned detached: the caller re-queues or
    /// removes each one.
    pub fn remove_worker(&mut self, worker: WorkerId) -> Vec<JobId> {
        let Some(w) = self.workers.remove(&worker) else { return Vec::new() };
        self.generation += 1;
        let p = self.pools.get_mut(&w.pool).expect("a worker's pool exists");
        p.free.remove(&(w.load(), worker));
        p.workers -= 1;
        p.slots -= w.slots;
        p.busy -= w.busy();
        let running: Vec<JobId> = w.running.into_iter().collect();
        for j in &running {
            self.jobs.get_mut(j).expect("running jobs exist").place = Place::Detached;
        }
        self.running -= running.len();
        running
    }

    /// Queues a new job, or hands it at once to the least loaded free worker that can run it.
    pub fn submit(&mut self, priority: i32, required: Properties, class: Option<u32>) -> (JobId, Vec<Assign>) {
        let id = self.fresh_id();
        let out = self.enter(id, priority, required, class);
        (id, out)
    }

    /// [`Dispatcher::submit`] under an id the caller chose: at least [`CALLER_IDS`], and
    /// not held by any job the dispatcher holds. The scheduler gives an operation's first
    /// run its operation's number, so that it needs no map from one to the other.
    pub fn submit_as(&mut self, id: JobId, priority: i32, required: Properties, class: Option<u32>) -> Vec<Assign> {
        debug_assert!(id >= CALLER_IDS && !self.jobs.contains_key(&id), "caller id {id} out of range or taken");
        self.enter(id, priority, required, class)
    }

    fn enter(&mut self, id: JobId, priority: i32, required: Properties, class: Option<u32>) -> Vec<Assign> {
        self.seq += 1;
        let job = Job { priority, seq: self.seq, required, class, place: Place::Detached, avoid: Vec::new() };
        self.jobs.insert(id, job);
        let mut out = Vec::new();
        self.place(id, &mut out);
        out
    }

    /// Puts a detached job back: it keeps its place in line (its original arrival), and
    /// will not run on `avoid` again.
    pub fn requeue(&mut self, job: JobId, avoid: Option<WorkerId>) -> Vec<Assign> {
        let mut out = Vec::new();
        let Some(j) = self.jobs.get_mut(&job) else { return out };
        if j.place != Place::Detached {
            return out;
        }
        if let Some(w) = avoid
            && !j.avoid.contains(&w)
        {
            j.avoid.push(w);
        }
        self.place(job, &mut out);
        out
    }

    /// Changes the size class a queued or detached job needs (a retry on a larger class).
    pub fn set_class(&mut self, job: JobId, class: Option<u32>) -> Vec<Assign> {
        let mut out = Vec::new();
        let Some(j) = self.jobs.get(&job) else { return out };
        match j.place {
            Place::Running(_) => return out,
            Place::Queued(_) => self.unqueue(job),
            Place::Detached => {}
        }
        self.jobs.get_mut(&job).expect("checked").class = class;
        self.place(job, &mut out);
        out
    }

    /// A running job's worker reported it: the job leaves, and the slot is refilled.
    /// A queued or detached job just leaves.
    pub fn finish(&mut self, job: JobId) -> Vec<Assign> {
        let mut out = Vec::new();
        let Some(j) = self.jobs.get(&job) else { return out };
        match j.place {
            Place::Queued(_) => self.unqueue(job),
            Place::Detached => {}
            Place::Running(w) => {
                self.change_busy(w, |wk| {
                    wk.running.remove(&job);
                });
                self.running -= 1;
                self.jobs.remove(&job);
                self.fill(w, &mut out);
                return out;
            }
        }
        self.jobs.remove(&job);
        out
    }

    /// Takes a running job off its worker, which reported it, keeping the job (to be
    /// placed again, say on a larger size class); the freed slot is refilled.
    pub fn detach(&mut self, job: JobId) -> Vec<Assign> {
        let mut out = Vec::new();
        let Some(w) = self.worker_of(job) else { return out };
        self.change_busy(w, |wk| {
            wk.running.remove(&job);
        });
        self.jobs.get_mut(&job).expect("running").place = Place::Detached;
        self.running -= 1;
        self.fill(w, &mut out);
        out
    }

    /// Takes a running job back from a worker that never reported it: the job is
    /// detached, and the worker's slot stays taken until [`Dispatcher::late_report`].
    pub fn take_back(&mut self, job: JobId) -> Option<WorkerId> {
        let w = self.worker_of(job)?;
        let wk = self.workers.get_mut(&w).expect("running on a registered worker");
        wk.running.remove(&job);
        wk.overdue.insert(job);
        self.jobs.get_mut(&job).expect("running").place = Place::Detached;
        self.running -= 1;
        Some(w)
    }

    /// The late report of a job taken back from `worker`: its slot is free again.
    /// Returns None when the job was not overdue there.
    pub fn late_report(&mut self, worker: WorkerId, job: JobId) -> Option<Vec<Assign>> {
        if !self.workers.get(&worker)?.overdue.contains(&job) {
            return None;
        }
        self.change_busy(worker, |w| {
            w.overdue.remove(&job);
        });
        // The worker has let go of it: it may run the job again (it may be the only
        // worker that can).
        if let Some(j) = self.jobs.get_mut(&job) {
            j.avoid.retain(|&w| w != worker);
        }
        let mut out = Vec::new();
        self.fill(worker, &mut out);
        Some(out)
    }

    fn unqueue(&mut self, job: JobId) {
        let j = self.jobs.get_mut(&job).expect("exists");
        let Place::Queued(qid) = j.place else { return };
        j.place = Place::Detached;
        let key = (j.priority, j.seq, job);
        self.queues.get_mut(&qid).expect("a queued job's queue exists").waiting.remove(&key);
        self.queued -= 1;
    }

    /// Applies a change to a worker's running/overdue sets, keeping its pool's free set
    /// and counts in step.
    fn change_busy(&mut self, worker: WorkerId, f: impl FnOnce(&mut Worker)) {
        let w = self.workers.get_mut(&worker).expect("registered");
        let (before_load, before_busy) = (w.load(), w.busy());
        f(w);
        let (after_load, after_busy, free) = (w.load(), w.busy(), w.busy() < w.slots);
        let p = self.pools.get_mut(&w.pool).expect("a worker's pool exists");
        p.free.remove(&(before_load, worker));
        if free {
            p.free.insert((after_load, worker));
        }
        p.busy = p.busy + after_busy - before_busy;
    }

    fn start(&mut self, job: JobId, worker: WorkerId, out: &mut Vec<Assign>) {
        self.change_busy(worker, |w| {
            w.running.insert(job);
        });
        self.jobs.get_mut(&job).expect("exists").place = Place::Running(worker);
        self.running += 1;
        out.push(Assign { job, worker });
    }

    /// Runs a detached job on the least loaded free worker that can run it and does not
    /// avoid it, or queues it.
    fn place(&mut self, job: JobId, out: &mut Vec<Assign>) {
        let (required, class) = {
            let j = &self.jobs[&job];
            (j.required.clone(), j.class)
        };
        let qid = self.queue_for(&required, class);
        let j = &self.jobs[&job];
        let q = &self.queues[&qid];
        let best = q
            .pools
            .iter()
            .filter_map(|pid| self.pools[pid].free.iter().find(|(_, w)| !j.avoid.contains(w)).copied())
            .min();
        match best {
            Some((_, w)) => self.start(job, w, out),
            None => {
                let key = (j.priority, j.seq, job);
                self.queues.get_mut(&qid).expect("made above").waiting.insert(key);
                self.jobs.get_mut(&job).expect("exists").place = Place::Queued(qid);
                self.queued += 1;
            }
        }
    }

    /// Gives a worker's free slots the first waiting jobs (by priority, then arrival)
    /// among the queues its pool serves.
    fn fill(&mut self, worker: WorkerId, out: &mut Vec<Assign>) {
        loop {
            let w = &self.workers[&worker];
            if w.busy() >= w.slots {
                return;
            }
            let pool = &self.pools[&w.pool];
            let best = pool
                .queues
                .iter()
                .filter_map(|qid| {
                    self.queues[qid].waiting.iter().find(|(_, _, j)| !self.jobs[j].avoid.contains(&worker)).copied()
                })
                .min();
            let Some((_, _, job)) = best else { return };
            self.unqueue(job);
            self.start(job, worker, out);
        }
    }

    /// Checks every invariant; for tests and debugging. Cost: O(everything).
    pub fn check(&self) -> Result<(), String> {
        let mut on_workers: HashMap<JobId, WorkerId> = HashMap::new();
        for (&wid, w) in &self.workers {
            for &j in &w.running {
                if on_workers.insert(j, wid).is_some() {
                    return Err(format!("job {j} runs on two workers"));
                }
                if self.jobs.get(&j).map(|x| x.place) != Some(Place::Running(wid)) {
                    return Err(format!("worker {wid} runs job {j}, which does not say so"));
                }
            }
            if w.busy() > w.slots {
                return Err(format!("worker {wid} has {} busy of {} slots", w.busy(), w.slots));
            }
            let in_free = self.pools[&w.pool].free.contains(&(w.load(), wid));
            if in_free != (w.busy() < w.slots) {
                return Err(format!("worker {wid}: free-set membership {in_free} but busy {}/{}", w.busy(), w.slots));
            }
        }
        let (mut queued, mut running) = (0, 0);
        for (&jid, j) in &self.jobs {
            match j.place {
                Place::Queued(qid) => {
                    queued += 1;
                    let q = self.queues.get(&qid).ok_or(format!("job {jid} is in a missing queue"))?;
                    if !q.waiting.contains(&(j.priority, j.seq, jid)) || q.required != j.required || q.class != j.class
                    {
                        return Err(format!("job {jid} is not where it says it is queued"));
                    }
                    // The links and free sets are checked on their own below and above,
                    // so the free workers of the queue's pools are all that could run it.
                    for pid in &q.pools {
                        if let Some((_, wid)) = self.pools[pid].free.iter().find(|(_, w)| !j.avoid.contains(w)) {
                            return Err(format!("queued job {jid} could run on free worker {wid}"));
                        }
                    }
                }
                Place::Running(w) => {
                    running += 1;
                    if on_workers.get(&jid) != Some(&w) {
                        return Err(format!("job {jid} says it runs on {w}, which does not run it"));
                    }
                    let p = &self.pools[&self.workers[&w].pool];
                    let fits = j.class.is_none_or(|c| c == p.class) && platform::satisfies(&p.offered, &j.required);
                    if !fits || j.avoid.contains(&w) {
                        return Err(format!("job {jid} runs on worker {w}, which cannot or may not run it"));
                    }
                }
                Place::Detached => {}
            }
        }
        let waiting: usize = self.queues.values().map(|q| q.waiting.len()).sum();
        if queued != self.queued || waiting != queued || running != self.running {
            return Err(format!(
                "counts: {queued} queued jobs, {waiting} waiting entries, {} counted; {running} running, {} counted",
                self.queued, self.running
            ));
        }
        for (&pid, p) in &self.pools {
            for &(load, wid) in &p.free {
                let w = self.workers.get(&wid).ok_or(format!("pool {pid} lists removed worker {wid} as free"))?;
                if w.pool != pid || w.load() != load {
                    return Err(format!("pool {pid} lists worker {wid} with a stale load"));
                }
            }
            let ws: Vec<&Worker> = self.workers.values().filter(|w| w.pool == pid).collect();
            let busy: usize = ws.iter().map(|w| w.busy()).sum();
            let slots: usize = ws.iter().map(|w| w.slots).sum();
            if ws.len() != p.workers || busy != p.busy || slots != p.slots {
                return Err(format!("pool {pid} counts are out of step"));
            }
            for (&qid, q) in &self.queues {
                if serves(p, q) != p.queues.contains(&qid) || serves(p, q) != q.pools.contains(&pid) {
                    return Err(format!("pool {pid} and queue {qid} are linked wrongly"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn props(v: &[(&str, &str)]) -> Properties {
        let mut p: Vec<Property> =
            v.iter().map(|(n, v)| Property { name: n.to_string(), value: v.to_string() }).collect();
        p.sort();
        p.dedup();
        p.into()
    }

    #[test]
    fn priority_then_arrival_and_least_loaded_worker() {
        let mut d = Dispatcher::new();
        let (a, _) = d.submit(5, props(&[]), None);
        let (b, _) = d.submit(1, props(&[]), None);
        let (c, _) = d.submit(5, props(&[]), None);
        let (w, got) = d.add_worker(props(&[]), 1, 2);
        assert_eq!(got, vec![Assign { job: b, worker: w }, Assign { job: a, worker: w }]);
        assert_eq!(d.finish(b), vec![Assign { job: c, worker: w }]);
        let (w2, none) = d.add_worker(props(&[]), 1, 2);
        assert!(none.is_empty());
        let (e, got) = d.submit(0, props(&[]), None);
        assert_eq!(got, vec![Assign { job: e, worker: w2 }], "the idle worker, not the busy one");
        d.check().unwrap();
    }

    #[test]
    fn platforms_and_size_classes_match() {
        let mut d = Dispatcher::new();
        let (cpu, _) = d.add_worker(props(&[("os", "linux")]), 1, 1);
        let (gpu, _) = d.add_worker(props(&[("os", "linux"), ("pool", "gpu")]), 4, 1);
        let (g, got) = d.submit(0, props(&[("pool", "gpu")]), None);
        assert_eq!(got, vec![Assign { job: g, worker: gpu }]);
        let (big, got) = d.submit(0, props(&[]), Some(4));
        assert!(got.is_empty(), "class 4's only worker is busy");
        let (any, got) = d.submit(0, props(&[]), None);
        assert_eq!(got, vec![Assign { job: any, worker: cpu }]);
        assert_eq!(d.finish(g), vec![Assign { job: big, worker: gpu }]);
        assert_eq!(d.classes_for(&props(&[("pool", "gpu")])), vec![4]);
        assert_eq!(d.first_unoffered(&props(&[("pool", "tpu")])).map(|p| p.value.as_str()), Some("tpu"));
        d.check().unwrap();
    }

    #[test]
    fn taken_back_jobs_avoid_the_stuck_worker_which_keeps_the_slot() {
        let mut d = Dispatcher::new();
        let (stuck, _) = d.add_worker(props(&[]), 1, 1);
        let (j, _) = d.submit(0, props(&[]), None);
        assert_eq!(d.take_back(j), Some(stuck));
        assert!(d.requeue(j, Some(stuck)).is_empty(), "the stuck worker's slot is still held");
        let (j2, _) = d.submit(0, props(&[]), None);
        let (other, got) = d.add_worker(props(&[]), 1, 1);
        assert_eq!(got, vec![Assign { job: j, worker: other }], "it runs elsewhere first");
        d.check().unwrap();
        // Taken back from `other` too: it may not go back to `other` while `other` holds
        // it, and once the stuck worker reports, the stuck worker may run it again.
        assert_eq!(d.take_back(j), Some(other));
        assert!(d.requeue(j, Some(other)).is_empty());
        assert_eq!(d.late_report(stuck, j).unwrap(), vec![Assign { job: j, worker: stuck }], "before the later j2");
        assert!(d.is_queued(j2));
        assert_eq!(d.late_report(other, j).unwrap(), vec![Assign { job: j2, worker: other }]);
        d.check().unwrap();
    }

    #[test]
    fn lost_worker_jobs_come_back_in_their_old_place() {
        let mut d = Dispatcher::new();
        let (w, _) = d.add_worker(props(&[]), 1, 1);
        let (first, _) = d.submit(0, props(&[]), None);
        let (second, _) = d.submit(0, props(&[]), None);
        assert_eq!(d.remove_worker(w), vec![first]);
        assert!(d.requeue(first, None).is_empty());
        let (w2, got) = d.add_worker(props(&[]), 1, 1);
        assert_eq!(got, vec![Assign { job: first, worker: w2 }], "its original arrival still counts");
        assert!(d.is_queued(second));
        d.compact();
        d.check().unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Submit {
            prio: i32,
            plat: usize,
            class: Option<u32>,
        },
        Join {
            plat: usize,
            class: u32,
            slots: usize,
        },
        Leave(usize),
        Finish(usize),
        Cancel(usize),
        TakeBack(usize),
        LateReport(usize),
        Retry(usize),
        /// A run on a smaller class failed: off its worker, onto a larger class.
        Detach(usize),
        Compact,
    }

    const PLATFORMS: [&[(&str, &str)]; 4] =
        [&[], &[("os", "linux")], &[("os", "linux"), ("pool", "gpu")], &[("os", "mac")]];

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (-2i32..3, 0..4usize, prop::option::of(1u32..4)).prop_map(|(prio, plat, class)| Op::Submit { prio, plat, class }),
            2 => (0..4usize, 1u32..4, 1usize..4).prop_map(|(plat, class, slots)| Op::Join { plat, class, slots }),
            1 => any::<usize>().prop_map(Op::Leave),
            3 => any::<usize>().prop_map(Op::Finish),
            1 => any::<usize>().prop_map(Op::Cancel),
            1 => any::<usize>().prop_map(Op::TakeBack),
            1 => any::<usize>().prop_map(Op::LateReport),
            1 => any::<usize>().prop_map(Op::Retry),
            1 => any::<usize>().prop_map(Op::Detach),
            1 => Just(Op::Compact),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        /// For random arrivals, joins, leaves, completions, cancels and take-backs, every
        /// invariant holds after every step, and no job is lost: each submitted job is
        /// queued, running, detached in the test's hands, or was finished by the test.
        #[test]
        fn invariants_hold_after_every_step(ops in prop::collection::vec(op(), 1..120)) {
            let mut d = Dispatcher::new();
            let mut live: Vec<JobId> = Vec::new();
            let mut workers: Vec<WorkerId> = Vec::new();
            let mut overdue: Vec<(WorkerId, JobId)> = Vec::new();
            let pick = |v: &[u64], i: usize| (!v.is_empty()).then(|| v[i % v.len()]);
            for op in ops {
                let before: HashMap<JobId, WorkerId> =
                    live.iter().filter_map(|&j| d.worker_of(j).map(|w| (j, w))).collect();
                let out = match op {
                    Op::Submit { prio, plat, class } => {
                        let (j, out) = d.submit(prio, props(PLATFORMS[plat]), class);
                        live.push(j);
                        out
                    }
                    Op::Join { plat, class, slots } => {
                        let (w, out) = d.add_worker(props(PLATFORMS[plat]), class, slots);
                        workers.push(w);
                        out
                    }
                    Op::Leave(i) => {
                        let Some(w) = pick(&workers, i) else { continue };
                        workers.retain(|&x| x != w);
                        overdue.retain(|&(x, _)| x != w);
                        let mut out = Vec::new();
                        for j in d.remove_worker(w) {
                            out.extend(d.requeue(j, None));
                        }
                        out
                    }
                    Op::Finish(i) | Op::Cancel(i) => {
                        let running: Vec<JobId> = live.iter().copied().filter(|&j| {
                            matches!(op, Op::Cancel(_)) || d.worker_of(j).is_some()
                        }).collect();
                        let Some(j) = pick(&running, i) else { continue };
                        live.retain(|&x| x != j);
                        d.finish(j)
                    }
                    Op::TakeBack(i) => {
                        let running: Vec<JobId> = live.iter().copied().filter(|&j| d.worker_of(j).is_some()).collect();
                        let Some(j) = pick(&running, i) else { continue };
                        let w = d.take_back(j).expect("running");
                        overdue.push((w, j));
                        d.requeue(j, Some(w))
                    }
                    Op::LateReport(i) => {
                        if overdue.is_empty() { continue }
                        let (w, j) = overdue.remove(i % overdue.len());
                        d.late_report(w, j).expect("overdue there")
                    }
                    Op::Retry(i) => {
                        let queued: Vec<JobId> = live.iter().copied().filter(|&j| d.is_queued(j)).collect();
                        let Some(j) = pick(&queued, i) else { continue };
                        d.set_class(j, Some(3))
                    }
                    Op::Detach(i) => {
                        let running: Vec<JobId> = live.iter().copied().filter(|&j| d.worker_of(j).is_some()).collect();
                        let Some(j) = pick(&running, i) else { continue };
                        let mut out = d.detach(j);
                        out.extend(d.set_class(j, Some(3)));
                        out
                    }
                    Op::Compact => { d.compact(); Vec::new() }
                };
                // Every job that started running in this step was reported in `out`.
                for &j in &live {
                    if let Some(w) = d.worker_of(j)
                        && before.get(&j) != Some(&w)
                    {
                        prop_assert!(out.contains(&Assign { job: j, worker: w }), "job {} started unreported", j);
                    }
                }
                for a in &out {
                    prop_assert_eq!(d.worker_of(a.job), Some(a.worker));
                }
                if let Err(e) = d.check() {
                    return Err(TestCaseError::fail(e));
                }
                // Nothing lost: every live job is queued or running (none is left detached).
                for &j in &live {
                    prop_assert!(d.is_queued(j) || d.worker_of(j).is_some(), "job {} was lost", j);
                }
                prop_assert_eq!(d.queued() + d.running(), live.len());
            }
        }
    }
}
