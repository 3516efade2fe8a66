//! Learning from the builds the planner cut, between two trainings.
//!
//! The models are trained on history and centred on held-out history builds. The
//! batches the planner cuts are not like those builds: they are as large as the cutoff
//! allows, and a stream covers code the history rarely built together. Measured on the
//! simulated workloads, the models under-read such batches by 4–16% (median, per
//! stream and tool) and their spread is about twice the held-out one, so a margin
//! taken from history alone promises far fewer OOMs than happen.
//!
//! [`Feedback`] keeps, per tool, the log error `ln(actual / estimate)` of the last
//! finished builds against the models that are loaded, and [`Corrected`] is the
//! estimator decorator that uses it: once a tool has [`MIN_OBSERVATIONS`] builds, its
//! memory estimates are scaled by the median error, and the margin takes the wider of
//! the model's held-out error and the spread of the recent builds around that median
//! (read from the side label noise cannot reach, as for the held-out one) once it has
//! the 30 builds an error model needs. An OOM build's label is the heap it died in, a
//! lower bound, counted when it is above the estimate. Executor occupancy is corrected
//! the same way, from its own window per tool: a stream's new packages can hold a few
//! heavy tests the models price at their directory's mean, and every batch of that tool
//! then misses its deadline alike. A build stopped early had at least what it measured,
//! a lower bound likewise. A retraining replaces the models, and with them what the
//! errors were measured against: feedback starts over.
//!
//! A per-tool factor cannot help when one target costs far more than the models
//! think: history that always built it with the same neighbours cannot say which of
//! them carries the cost, and every later batch that holds it runs out of memory.
//! So an OOM build the models under-read also makes its targets *suspects*: each may
//! carry the whole deficit (the heap minus the estimate and minus what its suspects were
//! already charged), and a batch holding suspects of that OOM is charged the deficit
//! once, on top of the models' estimate. A build that built all its targets bounds what
//! each of its suspects can carry by what it used beyond its estimate, so the split
//! halves of an OOM build (and any later build) clear the innocent and leave the
//! deficit on the culprit. A build that stopped early bounds nothing. Unlike the
//! corrections, suspects are shared by every tool: a culprit is costly in every context,
//! though a build in a lighter one may clear a little more of it than it should.
//!
//! One culprit is the simplest account of an OOM, and the charge assumes it while some
//! suspect may still carry the whole deficit. Once none may, several carry it together:
//! a batch holding the largest of them is charged their shares (all but the last of the
//! fewest that add up to the deficit) on top of the other suspects' largest, up to the
//! deficit. Charged the largest share alone, two heavy targets that the history only
//! ever built together ran out of memory together, stream after stream (README, "Two
//! culprits of one OOM"). However many OOMs a suspect is in, a batch is charged no more
//! than what complete builds holding it left it.
//!
//! It also counts the memory builds it observed and the under-read OOMs among them
//! ([`OomRecord`]): while those exceed what the target rate allows, the planner widens
//! its margin ([`crate::margin::tightened`]).

use std::collections::{BTreeMap, HashMap, VecDeque};

use crate::label::Label;
use crate::margin::{ErrorModel, OomRecord, TrustedSide};
use crate::planner::{Estimator, GroupEstimator};
use crate::types::BuildContext;
use crate::Result;

/// Builds a tool needs before its estimates are corrected: fewer would let one odd
/// build move every later estimate.
pub const MIN_OBSERVATIONS: usize = 10;
/// Builds per tool kept: recent enough to follow a shift, enough for a median.
pub const WINDOW: usize = 200;
/// The correction is kept within these log bounds (×0.74 to ×4). Down, because a
/// smaller estimate is the risky direction; up, only against absurd labels, since an
/// upward correction that stopped short would leave a bias the margin does not know of.
const MAX_DOWN: f64 = -0.3;
const MAX_UP: f64 = std::f64::consts::LN_2 * 2.0;

/// OOM builds whose suspects are kept: when full, an OOM whose suspects were
/// all cleared makes room first, then the oldest.
pub const MAX_OOM_EVENTS: usize = 64;

/// How a build the feedback observes ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// It built every target (its tests may have failed): what it used bounds what its
    /// targets cost.
    Complete,
    /// It ran out of memory: what it used is the heap, a lower bound.
    Oom,
    /// It stopped before building everything (a build error, a deadline): what it used
    /// bounds nothing.
    Partial,
}

/// Recent memory errors per tool tag, and the suspects of recent OOM builds.
#[derive(Debug, Clone, Default)]
pub struct Feedback {
    by_tool: BTreeMap<String, VecDeque<f64>>,
    /// Per tool: the same for executor occupancy, each marked when its build missed its
    /// deadline (stopped early, above its estimate).
    occupancy_by_tool: BTreeMap<String, VecDeque<(f64, bool)>>,
    /// Shared by every tool: a target that costs far more than the models think usually
    /// does in every context, and each tool would otherwise run out of memory on it once.
    suspects: Suspects,
    /// Every memory build observed, and the OOMs among them that the models under-read:
    /// the planner tightens its margin while they exceed the target rate.
    record: OomRecord,
}

/// The suspects of recent OOM builds.
#[derive(Debug, Clone, Default)]
struct Suspects {
    /// Per suspect target: what it may carry.
    by_target: HashMap<String, Suspicion>,
    /// The kept OOM builds, oldest first.
    events: VecDeque<Event>,
    next_event: u32,
}

/// An OOM build whose suspects are kept.
#[derive(Debug, Clone)]
struct Event {
    id: u32,
    /// Its targets, sorted.
    labels: Vec<String>,
}

/// What one suspect may carry beyond the models' estimate.
#[derive(Debug, Clone)]
struct Suspicion {
    /// Over every OOM: the least that a complete build holding it used beyond its
    /// estimate (infinite until one did).
    bound: f64,
    /// Per OOM it is a suspect of, oldest first.
    shares: Vec<Share>,
}

impl Suspicion {
    /// The most it may carry in all.
    fn most(&self) -> f64 {
        self.bound.min(self.shares.iter().map(|sh| sh.bytes).sum())
    }
}

/// A suspect's share of one OOM's deficit.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Share {
    event: u32,
    /// The most of the deficit it may carry: the deficit, or less once bounded.
    bytes: f64,
    /// The OOM's deficit.
    deficit: f64,
    /// No suspect left may carry the deficit alone, so several carry it together, and
    /// this is one of the largest that do: a build holding it is charged it on top of
    /// the OOM's other suspects' largest share.
    needed: bool,
}

/// One OOM's part of a build's charge (see [`Suspects::charge`]).
#[derive(Debug, Clone, Copy)]
struct Need {
    event: u32,
    deficit: f64,
    needed: f64,
    other: f64,
}

/// What the recent builds of one tool say about the memory estimates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Correction {
    /// Median `ln(actual / estimate)`: the estimate is multiplied by its exponential.
    pub log_bias: f64,
    /// The spread around that median, once there are enough builds for it.
    pub error: Option<ErrorModel>,
    pub observations: usize,
}

impl Feedback {
    pub fn new() -> Feedback {
        Feedback::default()
    }

    /// A finished build of `tool`: the models' memory estimate for exactly its targets
    /// and what it used; for an OOM build, the heap it ran out of. That is a lower bound,
    /// which says the models under-read only when it is above their estimate: an OOM of
    /// a build estimated over the heap anyway (one target over the cutoff) says nothing
    /// about them and is not counted. Ignored when either number is not positive.
    ///
    /// `targets` are the build's: an OOM build's become suspects of what it used beyond
    /// its estimate and the suspects it was already charged, and a complete build bounds
    /// what its suspects may carry (see the module's doc).
    pub fn observe(&mut self, tool: &str, targets: &[&str], estimate: f64, actual: f64, ended: Ended) {
        if !(estimate > 0.0 && actual > 0.0 && estimate.is_finite() && actual.is_finite()) {
            return;
        }
        let oom = ended == Ended::Oom;
        self.record.builds += 1;
        if oom && actual <= estimate {
            return;
        }
        self.record.ooms += u64::from(oom);
        match ended {
            Ended::Oom => {
                let s = &mut self.suspects;
                let mut held: Vec<&str> = targets.to_vec();
                held.sort_unstable();
                held.dedup();
                let deficit = actual - estimate - s.charge(held.iter().filter_map(|t| s.of(t)), &mut Vec::new());
                if deficit > 0.0 {
                    s.add(targets, deficit);
                }
            }
            Ended::Complete => self.suspects.clear(targets, (actual - estimate).max(0.0)),
            Ended::Partial => {}
        }
        push_error(&mut self.by_tool, tool, (actual / estimate).ln());
    }

    /// A finished build of `tool`: the models' occupancy estimate (ESU) for exactly its
    /// targets and the occupancy it had. A build that stopped early (a missed deadline, an
    /// OOM, a build error) had at least that much, a lower bound, counted only when it is
    /// above the estimate; such a build is a miss. Ignored when either number is not
    /// positive.
    pub fn observe_occupancy(&mut self, tool: &str, estimate: f64, actual: f64, ended: Ended) {
        if !(estimate > 0.0 && actual > 0.0 && estimate.is_finite() && actual.is_finite()) {
            return;
        }
        if ended != Ended::Complete && actual <= estimate {
            return;
        }
        push_error(&mut self.occupancy_by_tool, tool, ((actual / estimate).ln(), ended != Ended::Complete));
    }

    /// The memory correction for `tool`, once it has [`MIN_OBSERVATIONS`] builds.
    pub fn correction(&self, tool: &str) -> Option<Correction> {
        let q = self.by_tool.get(tool)?;
        correction_of(q.iter().copied(), q.len(), TrustedSide::Lower)
    }

    /// The occupancy correction for `tool`, once it has [`MIN_OBSERVATIONS`] builds and
    /// while one of them is a miss. Until a deadline is missed, the held-out margin has
    /// held, and a correction would only cut smaller batches: measured on the simulated
    /// workloads, an always-on one cost 1 to 4 points of density for deadlines that were
    /// not being missed. Its spread is read above the median: an occupancy served from the
    /// action cache reads low, as in the history.
    pub fn occupancy_correction(&self, tool: &str) -> Option<Correction> {
        let q = self.occupancy_by_tool.get(tool).filter(|q| q.iter().any(|(_, missed)| *missed))?;
        correction_of(q.iter().map(|(e, _)| *e), q.len(), TrustedSide::Upper)
    }

    /// Every memory build observed, and the OOMs the models under-read among them.
    pub fn oom_record(&self) -> OomRecord {
        self.record
    }

    /// Builds observed for `tool`.
    pub fn observations(&self, tool: &str) -> usize {
        self.by_tool.get(tool).map_or(0, VecDeque::len)
    }

    /// The most `target` may carry beyond the models' estimate, over every OOM build it
    /// was in (0 when it is no suspect).
    pub fn suspicion(&self, target: &str) -> f64 {
        self.suspects.of(target).map_or(0.0, Suspicion::most)
    }
}

/// Appends one build's log error (and whatever is kept with it) to `tool`'s window.
fn push_error<T>(by_tool: &mut BTreeMap<String, VecDeque<T>>, tool: &str, log_error: T) {
    let q = by_tool.entry(tool.to_string()).or_default();
    if q.len() == WINDOW {
        q.pop_front();
    }
    q.push_back(log_error);
}

/// The median of a window of log errors, and the spread around it read on `side`.
fn correction_of(errors: impl Iterator<Item = f64>, len: usize, side: TrustedSide) -> Option<Correction> {
    if len < MIN_OBSERVATIONS {
        return None;
    }
    let mut v: Vec<f64> = errors.collect();
    v.sort_by(f64::total_cmp);
    let median = v[(v.len() - 1) / 2];
    let centred: Vec<f64> = v.iter().map(|x| x - median).collect();
    Some(Correction {
        log_bias: median.clamp(MAX_DOWN, MAX_UP),
        error: ErrorModel::fit(&centred, side),
        observations: v.len(),
    })
}

impl Suspects {
    fn of(&self, target: &str) -> Option<&Suspicion> {
        // Most of the time there is none: skip hashing the label.
        if self.by_target.is_empty() {
            return None;
        }
        self.by_target.get(target)
    }

    /// What a build holding these suspects (each once) is charged: per OOM, the shares
    /// it needs that the build holds and the largest other share, up to the OOM's
    /// deficit; in all, no more than the suspects may carry. `scratch` is reused between
    /// calls.
    fn charge<'s>(&self, held: impl Iterator<Item = &'s Suspicion>, scratch: &mut Vec<Need>) -> f64 {
        scratch.clear();
        let mut most = 0.0;
        for s in held {
            most += s.most();
            for sh in &s.shares {
                let i = match scratch.iter().position(|n| n.event == sh.event) {
                    Some(i) => i,
                    None => {
                        scratch.push(Need { event: sh.event, deficit: sh.deficit, needed: 0.0, other: 0.0 });
                        scratch.len() - 1
                    }
                };
                let n = &mut scratch[i];
                if sh.needed {
                    n.needed += sh.bytes;
                } else {
                    n.other = n.other.max(sh.bytes);
                }
            }
        }
        let need: f64 = scratch.iter().map(|n| (n.needed + n.other).min(n.deficit)).sum();
        need.min(most)
    }

    fn add(&mut self, targets: &[&str], deficit: f64) {
        if self.events.len() >= MAX_OOM_EVENTS {
            // Make room: first the OOMs whose suspects were all cleared.
            let by_target = &self.by_target;
            self.events.retain(|e| {
                e.labels.iter().any(|l| by_target.get(l).is_some_and(|s| s.shares.iter().any(|sh| sh.event == e.id)))
            });
        }
        if self.events.len() >= MAX_OOM_EVENTS
            && let Some(old) = self.events.pop_front()
        {
            for l in &old.labels {
                self.keep(l, |sh| sh.event != old.id);
            }
        }
        let id = self.next_event;
        self.next_event = self.next_event.wrapping_add(1);
        let mut labels: Vec<String> = targets.iter().map(|t| t.to_string()).collect();
        labels.sort();
        labels.dedup();
        for l in &labels {
            let s = self.by_target.entry(l.clone()).or_insert(Suspicion { bound: f64::INFINITY, shares: Vec::new() });
            let bytes = deficit.min(s.bound);
            s.shares.push(Share { event: id, bytes, deficit, needed: false });
        }
        self.events.push_back(Event { id, labels });
        self.settle(id);
    }

    /// A complete build used `excess` bytes beyond its estimate: none of its targets
    /// carries more than that, of any one OOM or of all of them.
    fn clear(&mut self, targets: &[&str], excess: f64) {
        if self.by_target.is_empty() {
            return;
        }
        let mut touched = Vec::new();
        for t in targets {
            if let Some(s) = self.by_target.get_mut(*t) {
                s.bound = s.bound.min(excess);
                touched.extend(s.shares.iter().map(|sh| sh.event));
            }
            self.keep(t, |sh| {
                sh.bytes = sh.bytes.min(excess);
                sh.bytes > 0.0
            });
        }
        touched.sort_unstable();
        touched.dedup();
        for e in touched {
            self.settle(e);
        }
    }

    /// Marks the shares OOM `id` needs: none while one suspect left may carry its whole
    /// deficit (one culprit is the simplest account of it); else the largest, all but the
    /// last of the fewest whose shares add up to it (see [`Share::needed`]).
    fn settle(&mut self, id: u32) {
        let Some(i) = self.events.iter().position(|e| e.id == id) else { return };
        let labels = std::mem::take(&mut self.events[i].labels);
        let share = |s: &Suspicion| s.shares.iter().find(|sh| sh.event == id).copied();
        let mut held: Vec<(f64, f64, usize)> = labels
            .iter()
            .enumerate()
            .filter_map(|(j, l)| self.by_target.get(l).and_then(share).map(|sh| (sh.bytes, sh.deficit, j)))
            .collect();
        held.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.2.cmp(&b.2)));
        let mut needed = vec![false; labels.len()];
        let mut sum = 0.0;
        for &(bytes, deficit, j) in &held {
            if sum + bytes >= deficit {
                break;
            }
            sum += bytes;
            needed[j] = true;
        }
        for (j, l) in labels.iter().enumerate() {
            if let Some(s) = self.by_target.get_mut(l)
                && let Some(sh) = s.shares.iter_mut().find(|sh| sh.event == id)
            {
                sh.needed = needed[j];
            }
        }
        self.events[i].labels = labels;
    }

    /// Keeps the shares of `target` for which `f` (which may lower them) holds.
    fn keep(&mut self, target: &str, f: impl FnMut(&mut Share) -> bool) {
        if let Some(s) = self.by_target.get_mut(target) {
            s.shares.retain_mut(f);
            if s.shares.is_empty() {
                self.by_target.remove(target);
            }
        }
    }
}

/// An [`Estimator`] whose memory estimates and margin are corrected by [`Feedback`].
/// `inner` is any pointer to the models (`&Models`, `Arc<Models>`).
pub struct Corrected<M> {
    pub inner: M,
    pub feedback: Feedback,
}

/// The group of a [`Corrected`] estimator.
pub struct CorrectedGroup<'a, G> {
    inner: G,
    factor: f64,
    error: Option<ErrorModel>,
    /// The tool's occupancy correction, as `factor` and `error` are its memory's.
    occupancy_factor: f64,
    occupancy_error: Option<ErrorModel>,
    /// The suspects, if there are any.
    suspects: Option<&'a Suspects>,
    record: OomRecord,
    /// The queued suspects: (position since the group began, their suspicion).
    queued: VecDeque<(usize, &'a Suspicion)>,
    /// Targets pushed and popped since the group began.
    pushed: usize,
    popped: usize,
    scratch: Vec<Need>,
}

impl<M> Estimator for Corrected<M>
where
    M: std::ops::Deref,
    M::Target: Estimator,
{
    type Group<'a>
        = CorrectedGroup<'a, <M::Target as Estimator>::Group<'a>>
    where
        Self: 'a;

    fn group<'a>(&'a self, ctx: &BuildContext) -> Self::Group<'a> {
        let c = self.feedback.correction(&ctx.tool_tag);
        let o = self.feedback.occupancy_correction(&ctx.tool_tag);
        CorrectedGroup {
            inner: self.inner.group(ctx),
            factor: c.map_or(1.0, |c| c.log_bias.exp()),
            error: c.and_then(|c| c.error),
            occupancy_factor: o.map_or(1.0, |o| o.log_bias.exp()),
            occupancy_error: o.and_then(|o| o.error),
            suspects: Some(&self.feedback.suspects).filter(|s| !s.by_target.is_empty()),
            record: self.feedback.record,
            queued: VecDeque::new(),
            pushed: 0,
            popped: 0,
            scratch: Vec::new(),
        }
    }
}

impl<G: GroupEstimator> GroupEstimator for CorrectedGroup<'_, G> {
    fn push(&mut self, label: &Label<'_>) {
        self.inner.push(label);
        if let Some(s) = self.suspects.and_then(|s| s.of(label.as_str())) {
            self.queued.push_back((self.pushed, s));
        }
        self.pushed += 1;
    }

    fn pop_front(&mut self, n: usize) {
        self.inner.pop_front(n);
        self.popped += n;
        while self.queued.front().is_some_and(|(pos, _)| *pos < self.popped) {
            self.queued.pop_front();
        }
    }

    fn memory_bytes(&mut self, len: usize) -> Result<f64> {
        let raw = self.inner.memory_bytes(len)?;
        let (Some(s), false) = (self.suspects, self.queued.is_empty()) else {
            // A positive constant factor keeps the estimate monotone in `len`.
            return Ok(raw * self.factor);
        };
        // Deficits were measured against the models' own estimates, so they add to
        // those; the tool's factor may already cover them. Both sides, and so their
        // maximum, grow with `len`.
        let end = self.popped + len;
        let lists = self.queued.iter().take_while(|(pos, _)| *pos < end).map(|(_, l)| *l);
        let charged = s.charge(lists, &mut self.scratch);
        Ok((raw * self.factor).max(raw + charged))
    }

    fn occupancy_esu(&mut self, len: usize) -> Result<f64> {
        Ok(self.inner.occupancy_esu(len)? * self.occupancy_factor)
    }

    fn cost_group(&self, i: usize) -> Option<u64> {
        self.inner.cost_group(i)
    }

    fn oom_record(&self) -> Option<OomRecord> {
        Some(self.record)
    }

    fn errors(&self) -> (Option<ErrorModel>, Option<ErrorModel>) {
        let (memory, occupancy) = self.inner.errors();
        (ErrorModel::wider(memory, self.error), ErrorModel::wider(occupancy, self.occupancy_error))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::label::parse_label;
    use crate::types::{Command, Priority};

    /// Every target costs 1 GB by the models.
    struct PerTarget;
    struct PerTargetGroup(usize);
    impl Estimator for PerTarget {
        type Group<'a> = PerTargetGroup;
        fn group(&self, _: &BuildContext) -> PerTargetGroup {
            PerTargetGroup(0)
        }
    }
    impl GroupEstimator for PerTargetGroup {
        fn push(&mut self, _: &Label<'_>) {
            self.0 += 1;
        }
        fn pop_front(&mut self, n: usize) {
            self.0 -= n;
        }
        fn memory_bytes(&mut self, len: usize) -> Result<f64> {
            assert!(len <= self.0);
            Ok(len as f64 * 1e9)
        }
        fn occupancy_esu(&mut self, _: usize) -> Result<f64> {
            Ok(1.0)
        }
    }

    fn ctx(tool: &str) -> BuildContext {
        let mut c = BuildContext::new_workspace("ws", Command::Build, Priority::Low);
        c.tool_tag = tool.into();
        c
    }

    /// Memory estimates of each prefix of `labels` in tool `t`'s builds, corrected by `f`.
    fn prefixes(f: &Feedback, labels: &[&str]) -> Vec<f64> {
        let c = Corrected { inner: &PerTarget, feedback: f.clone() };
        let mut g = c.group(&ctx("t"));
        for l in labels {
            g.push(&parse_label(l).unwrap());
        }
        (1..=labels.len()).map(|n| g.memory_bytes(n).unwrap() / 1e9).collect()
    }

    #[test]
    fn an_under_read_oom_charges_its_deficit_once_to_a_batch_of_its_targets() {
        let mut f = Feedback::new();
        // Estimated 9 GB, died in the 13 GB heap: 4 GB that one of a, b, c carries.
        f.observe("t", &["//p:a", "//p:b", "//p:c"], 9e9, 13e9, Ended::Oom);
        assert_eq!(f.suspicion("//p:a"), 4e9);
        assert_eq!(prefixes(&f, &["//p:x", "//p:a", "//p:b", "//q:y"]), [1.0, 6.0, 7.0, 8.0]);
        assert_eq!(prefixes(&f, &["//p:x", "//q:y"]), [1.0, 2.0], "no suspects, no charge");
        // An OOM of a batch estimated over the heap says nothing of its targets.
        f.observe("t", &["//p:x"], 20e9, 13e9, Ended::Oom);
        assert_eq!(f.suspicion("//p:x"), 0.0);
        // A second under-read OOM is a second deficit.
        f.observe("t", &["//q:y", "//q:z"], 12e9, 13e9, Ended::Oom);
        assert_eq!(prefixes(&f, &["//p:b", "//q:y"]), [1.0 + 4.0, 2.0 + 4.0 + 1.0]);
        // Popping the suspects off the front stops their charge.
        let c = Corrected { inner: &PerTarget, feedback: f.clone() };
        let mut g = c.group(&ctx("t"));
        for l in ["//p:a", "//r:z", "//r:w"] {
            g.push(&parse_label(l).unwrap());
        }
        assert_eq!(g.memory_bytes(2).unwrap(), 6e9);
        g.pop_front(1);
        assert_eq!(g.memory_bytes(2).unwrap(), 2e9);
        // Every tool's batches are charged: a culprit is costly in every context.
        let c = Corrected { inner: &PerTarget, feedback: f.clone() };
        let mut g = c.group(&ctx("coverage"));
        g.push(&parse_label("//p:a").unwrap());
        assert_eq!(g.memory_bytes(1).unwrap(), 5e9);
    }

    #[test]
    fn complete_builds_clear_their_suspects_down_to_what_they_used_beyond_the_estimate() {
        let mut f = Feedback::new();
        f.observe("t", &["//p:a", "//p:b", "//p:c", "//p:d"], 9e9, 13e9, Ended::Oom);
        // The halves of the split: a and b used 0.5 GB more than estimated, c and d 5 GB.
        f.observe("t", &["//p:a", "//p:b"], 4e9, 4.5e9, Ended::Complete);
        f.observe("t", &["//p:c", "//p:d"], 5e9, 10e9, Ended::Complete);
        assert_eq!(f.suspicion("//p:a"), 0.5e9);
        assert_eq!(f.suspicion("//p:c"), 4e9, "5 GB over bounds nothing below the 4 GB deficit");
        // A build that stopped early clears nothing.
        f.observe("t", &["//p:c"], 5e9, 1e9, Ended::Partial);
        assert_eq!(f.suspicion("//p:c"), 4e9);
        // A complete build under its estimate clears its suspects entirely.
        f.observe("t", &["//p:a", "//q:y"], 4e9, 3e9, Ended::Complete);
        assert_eq!(f.suspicion("//p:a"), 0.0);
        assert_eq!(
            prefixes(&f, &["//p:a", "//p:b", "//p:c"]),
            [1.0, 2.5, 7.0],
            "the largest suspicion of the OOM, once"
        );
    }

    #[test]
    fn repeated_ooms_of_one_culprit_add_up_to_the_heap_less_its_smallest_estimate() {
        let mut f = Feedback::new();
        // A split tree: 9 GB estimated, then the half holding the culprit at 6 GB, then
        // the culprit alone at 3 GB; every one died in the 13 GB heap.
        f.observe("t", &["//p:a", "//p:b", "//p:c", "//p:d"], 9e9, 13e9, Ended::Oom);
        f.observe("t", &["//p:a", "//p:b"], 4e9, 4e9, Ended::Complete);
        f.observe("t", &["//p:c", "//p:d"], 6e9, 13e9, Ended::Oom);
        f.observe("t", &["//p:d"], 2e9, 2e9, Ended::Complete);
        f.observe("t", &["//p:c"], 3e9, 13e9, Ended::Oom);
        assert_eq!(f.suspicion("//p:c"), 10e9);
        assert_eq!(prefixes(&f, &["//p:c"]), [1.0 + 10.0]);
        // A complete build bounds the sum of what it carries, not each part alone.
        f.observe("t", &["//p:c", "//q:y"], 3e9, 8e9, Ended::Complete);
        assert_eq!(f.suspicion("//p:c"), 5e9);
        assert_eq!(prefixes(&f, &["//p:c"]), [1.0 + 5.0]);
    }

    #[test]
    fn an_oom_no_one_suspect_can_carry_charges_those_that_carry_it_together() {
        let mut f = Feedback::new();
        // Estimated 3 GB, died in the 13 GB heap: 10 GB among a, b, c and d.
        f.observe("t", &["//p:a", "//p:b", "//p:c", "//p:d"], 3e9, 13e9, Ended::Oom);
        // Built alone, a used 6 GB beyond its estimate, b 4, c none and d half a GB.
        f.observe("t", &["//p:a"], 1e9, 7e9, Ended::Complete);
        f.observe("t", &["//p:b"], 1e9, 5e9, Ended::Complete);
        f.observe("t", &["//p:c"], 1e9, 1e9, Ended::Complete);
        f.observe("t", &["//p:d"], 1e9, 1.5e9, Ended::Complete);
        assert_eq!([f.suspicion("//p:a"), f.suspicion("//p:b"), f.suspicion("//p:d")], [6e9, 4e9, 0.5e9]);
        // No one of them carries 10 GB: a and b do together, and a batch of both pays both.
        assert_eq!(prefixes(&f, &["//p:a", "//p:b"]), [1.0 + 6.0, 2.0 + 10.0]);
        // Without a, the largest of the others, once: the one-culprit charge.
        assert_eq!(prefixes(&f, &["//p:b", "//p:d"]), [1.0 + 4.0, 2.0 + 4.0]);
        // A second OOM holding a: a is charged its 6 GB once, not once per OOM.
        f.observe("t", &["//p:a", "//q:x"], 2e9, 13e9, Ended::Oom);
        assert_eq!(f.suspicion("//q:x"), 5e9, "the heap less the estimate and a's charge");
        assert_eq!(prefixes(&f, &["//p:a"]), [1.0 + 6.0]);
        assert_eq!(prefixes(&f, &["//p:a", "//q:x"]), [1.0 + 6.0, 2.0 + 11.0]);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// Whatever OOMs and complete builds came before, adding a target never lowers a
        /// batch's estimate (the planner's search needs it), and a batch is charged no
        /// more than its suspects may carry.
        #[test]
        fn the_charge_grows_with_the_batch_and_stays_within_its_suspects(
            builds in proptest::collection::vec(
                (proptest::collection::vec(0usize..8, 1..6), 0.5f64..12.0, 0.0f64..8.0, proptest::bool::ANY),
                0..24,
            ),
            order in proptest::collection::vec(0usize..8, 1..12),
        ) {
            let name = |i: usize| format!("//p{}:t{i}", i % 3);
            let mut f = Feedback::new();
            for (targets, estimate, over, oom) in &builds {
                let labels: Vec<String> = targets.iter().map(|&i| name(i)).collect();
                let refs: Vec<&str> = labels.iter().map(String::as_str).collect();
                let (actual, ended) = if *oom { (13.0, Ended::Oom) } else { (estimate + over, Ended::Complete) };
                // Another tool's builds: suspects are shared, `t` gets no factor of its own.
                f.observe("u", &refs, estimate * 1e9, actual * 1e9, ended);
            }
            let mut labels: Vec<String> = order.iter().map(|&i| name(i)).collect();
            labels.sort();
            labels.dedup();
            let refs: Vec<&str> = labels.iter().map(String::as_str).collect();
            let p = prefixes(&f, &refs);
            let mut carried = 0.0;
            for (n, w) in p.iter().enumerate() {
                carried += f.suspicion(refs[n]) / 1e9;
                proptest::prop_assert!(n == 0 || *w >= p[n - 1], "{p:?}");
                proptest::prop_assert!(*w <= (n + 1) as f64 + carried + 1e-9, "{p:?} {carried}");
            }
        }
    }

    #[test]
    fn the_charge_adds_to_the_models_estimate_unless_the_tools_factor_is_larger() {
        let mut f = Feedback::new();
        for _ in 0..MIN_OBSERVATIONS {
            f.observe("t", &[], 10e9, 15e9, Ended::Complete);
        }
        f.observe("t", &["//p:a"], 12.5e9, 13e9, Ended::Oom);
        f.observe("t", &["//p:b"], 9e9, 13e9, Ended::Oom);
        // Factor 1.5: the 0.5 GB suspicion is within it, the 4 GB one is not.
        assert_eq!(prefixes(&f, &["//p:a"]), [1.5]);
        assert_eq!(prefixes(&f, &["//p:b"]), [5.0]);
    }

    #[test]
    fn only_the_newest_or_still_suspected_ooms_are_kept() {
        let mut f = Feedback::new();
        for i in 0..MAX_OOM_EVENTS + 1 {
            f.observe("t", &[&format!("//p:t{i}")], 9e9, 13e9, Ended::Oom);
        }
        assert_eq!(f.suspicion("//p:t0"), 0.0, "the oldest OOM is forgotten");
        assert_eq!(f.suspicion("//p:t1"), 4e9);
        // Once its suspects are cleared, an OOM makes room before any older one.
        f.observe("t", &["//p:t5"], 9e9, 9e9, Ended::Complete);
        f.observe("t", &["//p:new"], 9e9, 13e9, Ended::Oom);
        assert_eq!(f.suspicion("//p:t1"), 4e9, "still kept");
        assert_eq!(f.suspects.events.len(), MAX_OOM_EVENTS);
        assert!(!f.suspects.events.iter().any(|e| e.id == 5));
    }

    #[test]
    fn no_correction_before_enough_builds_then_the_median() {
        let mut f = Feedback::new();
        for _ in 0..MIN_OBSERVATIONS - 1 {
            f.observe("coverage", &[], 10.0, 13.0, Ended::Complete);
        }
        assert_eq!(f.correction("coverage"), None);
        f.observe("coverage", &[], 10.0, 13.0, Ended::Complete);
        let c = f.correction("coverage").unwrap();
        assert!((c.log_bias - 1.3f64.ln()).abs() < 1e-12, "{c:?}");
        assert_eq!(f.correction("postsubmit"), None, "per tool");
        // Nonsense is ignored, as is an OOM under its estimate; the window keeps the newest.
        f.observe("coverage", &[], 0.0, 5.0, Ended::Complete);
        f.observe("coverage", &[], f64::NAN, 5.0, Ended::Complete);
        f.observe("coverage", &[], 20.0, 13.0, Ended::Oom);
        assert_eq!(f.observations("coverage"), MIN_OBSERVATIONS);
        for _ in 0..WINDOW {
            f.observe("coverage", &[], 10.0, 9.0, Ended::Complete);
        }
        assert_eq!(f.observations("coverage"), WINDOW);
        assert!((f.correction("coverage").unwrap().log_bias - 0.9f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn the_correction_is_bounded_and_the_spread_read_below_the_median() {
        let mut up = Feedback::new();
        let mut down = Feedback::new();
        for _ in 0..20 {
            up.observe("t", &[], 1.0, 5.0, Ended::Complete);
            down.observe("t", &[], 1.0, 0.5, Ended::Complete);
        }
        assert_eq!(up.correction("t").unwrap().log_bias, MAX_UP);
        assert_eq!(down.correction("t").unwrap().log_bias, MAX_DOWN);
        // One build in ten reads 3x high (no full GC ran): the median barely moves and
        // the spread, read below it, not at all.
        let mut f = Feedback::new();
        for i in 0..100 {
            let noise = [-0.08, -0.04, 0.0, 0.04, 0.08][i % 5];
            let actual = if i % 10 == 9 { 30.0 } else { 10.0 * f64::exp(0.1 + noise) };
            f.observe("t", &[], 10.0, actual, Ended::Complete);
        }
        let c = f.correction("t").unwrap();
        assert!((c.log_bias - 0.1).abs() < 0.05, "{c:?}");
        let e = c.error.expect("100 builds give a spread");
        assert!(e.sigma < 0.1, "the high labels do not widen it: {e:?}");
    }

    #[test]
    fn occupancy_is_corrected_per_tool_once_a_deadline_is_missed() {
        let mut f = Feedback::new();
        // Builds whose executors were 1.5 times busier than estimated, all in time: the
        // margin held, and nothing is corrected.
        for _ in 0..WINDOW {
            f.observe_occupancy("coverage", 100.0, 150.0, Ended::Complete);
        }
        assert_eq!(f.occupancy_correction("coverage"), None, "no deadline missed");
        // A build stopped at its deadline below its estimate says nothing (and misses
        // nothing the models promised); above it, it counts, and it is a miss.
        f.observe_occupancy("coverage", 700.0, 600.0, Ended::Partial);
        assert_eq!(f.occupancy_correction("coverage"), None);
        let mut f = Feedback::new();
        for _ in 0..MIN_OBSERVATIONS - 2 {
            f.observe_occupancy("coverage", 100.0, 150.0, Ended::Complete);
        }
        f.observe_occupancy("coverage", 400.0, 600.0, Ended::Partial);
        assert_eq!(f.occupancy_correction("coverage"), None, "nine builds are too few");
        f.observe_occupancy("coverage", 100.0, 150.0, Ended::Complete);
        let c = f.occupancy_correction("coverage").expect("ten builds, one missed");
        assert!((c.log_bias - 1.5f64.ln()).abs() < 1e-9, "{c:?}");
        // A build served from the action cache reads low: it moves the median, not the spread.
        f.observe_occupancy("coverage", 100.0, 5.0, Ended::Complete);
        assert!((f.occupancy_correction("coverage").unwrap().log_bias - 1.5f64.ln()).abs() < 1e-9);
        // The tool's occupancy estimates are scaled; its memory and other tools' are not.
        let corrected = Corrected { inner: &PerTarget, feedback: f.clone() };
        let mut g = corrected.group(&ctx("coverage"));
        g.push(&parse_label("//p:a").unwrap());
        assert!((g.occupancy_esu(1).unwrap() - 1.5).abs() < 1e-9);
        assert_eq!(g.memory_bytes(1).unwrap(), 1e9);
        let mut other = corrected.group(&ctx("t"));
        other.push(&parse_label("//p:a").unwrap());
        assert_eq!(other.occupancy_esu(1).unwrap(), 1.0);
        assert_eq!(f.correction("coverage"), None, "occupancy says nothing of memory");
        // Once the miss has left the window, the correction stops.
        for _ in 0..WINDOW {
            f.observe_occupancy("coverage", 100.0, 150.0, Ended::Complete);
        }
        assert_eq!(f.occupancy_correction("coverage"), None);
    }
}
