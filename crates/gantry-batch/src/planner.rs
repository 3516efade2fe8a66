//! The batch planner (design sections III-B..III-D, Algorithm 1).
//!
//! Owns grouping + sorting + cutting, the estimator abstraction the cutter
//! queries, the model-backed incremental estimator, and both entry points:
//! [`plan`] (whole request in memory) and [`StreamingPlanner`] (bounded
//! memory for million-target streams).
//!
//! # Incremental estimates
//! The binary search asks for estimates of many prefixes of one window. The
//! models are linear over hashed, set-valued features, so each target gets,
//! once, two numbers per model: `full` (all its target-level feature
//! weights) and `new` (only the features the previous target in sorted
//! order did not have). For a window starting at `s`, the estimate of the
//! prefix of length `k` is
//! `bias + build + full[s] + Σ_{s<i<s+k} new[i] + buckets(k, packages(s,k))`,
//! an O(1) lookup into running sums. In sorted order every package's labels
//! are contiguous (they share the prefix `//pkg:`), so this counts packages,
//! and therefore package-count buckets, exactly. A directory prefix can
//! reappear after an interruption (`//a/b/..`, `//a/b1:..`, `//a/b:..`); it is
//! then counted once per run, which can only *over*-estimate because
//! target-related weights are non-negative. So the planner's estimate is
//! never below the model's set-semantics prediction and equals it in the
//! common case (tested).

use crate::error::{BatchError, Result};
use crate::executor::Grouper;
use crate::features::{Family, TargetValues};
use crate::label::{parse_label, parse_label_trusted, Label};
use crate::margin::{ErrorModel, OomRecord};
use crate::model::{LinearModel, Models};
use crate::shared::SharedGroup;
use crate::types::{Batch, BatchSizeReason, BuildContext, ExecutorSet, PlannerConfig, Target};
use std::collections::VecDeque;

/// Something that can estimate the memory and occupancy of prefixes of a
/// sorted group of targets. The planner creates one [`GroupEstimator`] per
/// executor group.
pub trait Estimator {
    type Group<'a>: GroupEstimator
    where
        Self: 'a;
    /// Start a group for a build context. Must not fail: a model that cannot
    /// answer reports errors from the estimate calls, which the planner turns
    /// into `*_ESTIMATE_ERROR` batches.
    fn group<'a>(&'a self, ctx: &BuildContext) -> Self::Group<'a>;
}

/// Per-group estimator state: a queue of targets in sorted order.
/// Estimates are for the first `len` queued targets (`len >= 1`) and must be
/// non-decreasing in `len`.
pub trait GroupEstimator {
    /// Append the next target in sorted order.
    fn push(&mut self, label: &Label<'_>);
    /// Drop the first `n` targets (they became a batch).
    fn pop_front(&mut self, n: usize);
    fn memory_bytes(&mut self, len: usize) -> Result<f64>;
    fn occupancy_esu(&mut self, len: usize) -> Result<f64>;
    /// The held-out error of the memory and occupancy estimates, if known:
    /// the planner keeps the chance of exceeding the hard limits under the
    /// configured rates with them (see [`crate::margin`]).
    fn errors(&self) -> (Option<ErrorModel>, Option<ErrorModel>) {
        (None, None)
    }
    /// The `i`-th queued target's history group: an id shared by targets that every
    /// training build held all of or none of. The model knows such a group's summed
    /// cost but not how it splits among the targets, so a batch holding part of one
    /// may hold its heaviest target at an even share's price. `None`: not known.
    fn cost_group(&self, _i: usize) -> Option<u64> {
        None
    }
    /// The builds observed since the models were trained and their OOMs, if anyone
    /// counted: more OOMs than the target rate allows tighten the memory margin.
    fn oom_record(&self) -> Option<OomRecord> {
        None
    }
}

/// One build of `labels` as the planner reads a batch: a group holding the labels sorted
/// and de-duplicated (groups charge a package at its first target, so its targets must
/// be adjacent), and how many it holds.
pub(crate) fn build_group<'a, E: Estimator>(
    estimator: &'a E,
    ctx: &BuildContext,
    labels: &[&str],
) -> Result<(E::Group<'a>, usize)> {
    let mut parsed = labels.iter().map(|l| parse_label(l)).collect::<Result<Vec<_>>>()?;
    parsed.sort_by(|a, b| a.canonical().cmp(&b.canonical()));
    parsed.dedup_by(|a, b| a.canonical() == b.canonical());
    let mut g = estimator.group(ctx);
    for l in &parsed {
        g.push(l);
    }
    Ok((g, parsed.len()))
}

/// The uncorrected occupancy estimate (ESU) of one build of `labels`.
pub fn occupancy_of<E: Estimator>(estimator: &E, ctx: &BuildContext, labels: &[&str]) -> Result<f64> {
    let (mut g, n) = build_group(estimator, ctx, labels)?;
    g.occupancy_esu(n)
}

// ---------------------------------------------------------------------------
// Model-backed estimator
// ---------------------------------------------------------------------------

/// Per-context precomputation for one linear model.
struct Scorer<'m> {
    model: &'m LinearModel,
    /// bias + all build-only slots.
    build_raw: f64,
    /// Per target family: whether its base feature is on.
    base: [bool; 3],
    /// Per target family: slot hashes of its crosses, to mix with a value,
    /// and each one's cross index (for its unseen prior).
    prefixes: [Vec<(u64, usize)>; 3],
    tc_cum: Vec<f64>,
    pc_cum: Vec<f64>,
    /// The context's centring.
    centre: crate::model::Centre,
}

impl<'m> Scorer<'m> {
    fn new(model: &'m LinearModel, ctx: &BuildContext) -> Self {
        let spec = &model.spec;
        let pieces = spec.context_pieces(ctx);
        let mut prefixes: [Vec<(u64, usize)>; 3] = Default::default();
        let mut base = [false; 3];
        for (ti, fam) in Family::TARGET.iter().enumerate() {
            base[ti] = spec.has(*fam);
            prefixes[ti]
                .extend(pieces.target_prefixes[ti].iter().copied().zip(pieces.target_prefix_cross[ti].iter().copied()));
        }
        let cum = |buckets: &[Vec<u32>]| -> Vec<f64> {
            let mut out = Vec::with_capacity(buckets.len() + 1);
            let mut acc = 0.0;
            out.push(acc);
            for b in buckets {
                acc += model.sum_slots(b);
                out.push(acc);
            }
            out
        };
        Scorer {
            model,
            build_raw: model.bias + model.sum_slots(&pieces.build),
            base,
            prefixes,
            tc_cum: cum(&pieces.target_count),
            pc_cum: cum(&pieces.package_count),
            centre: model.calibration_for(ctx),
        }
    }

    /// Weight of one target-level value (its base feature plus crosses).
    #[inline]
    fn value_weight(&self, ti: usize, v: u64) -> f64 {
        let spec = &self.model.spec;
        // Base features are hashed as mix(family_tag, v), crosses as
        // mix(mix(cross_tag, a), v). An unseen base value gets its family's
        // prior (`LinearModel::target_weight`).
        let base = if self.base[ti] {
            self.model.target_weight(ti, spec.slot(crate::features::mix(Family::TARGET[ti].tag(), v), true))
        } else {
            0.0
        };
        base + self.prefixes[ti]
            .iter()
            .map(|&(p, ci)| self.model.cross_weight(ci, spec.slot(crate::features::mix(p, v), true)))
            .sum::<f64>()
    }

    /// (full, new) contributions of a target given its predecessor.
    fn terms(&self, tv: &TargetValues, prev: Option<&TargetValues>) -> (f64, f64) {
        let lw = self.value_weight(0, tv.label);
        let pw = self.value_weight(1, tv.package);
        let mut full = lw + pw;
        let mut new = 0.0;
        match prev {
            None => new = full,
            Some(p) => {
                if p.label != tv.label {
                    new += lw;
                }
                if p.package != tv.package {
                    new += pw;
                }
            }
        }
        for &a in &tv.ancestors {
            let aw = self.value_weight(2, a);
            full += aw;
            if prev.is_none_or(|p| !p.ancestors.contains(&a)) {
                new += aw;
            }
        }
        (full, new)
    }

    fn finish(&self, target_sum: f64, targets: usize, packages: usize) -> Result<f64> {
        let spec = &self.model.spec;
        let nt = spec.target_count_boundaries.partition_point(|&b| (b as usize) <= targets);
        let np = spec.package_count_boundaries.partition_point(|&b| (b as usize) <= packages);
        self.model.output(self.build_raw + target_sum + self.tc_cum[nt] + self.pc_cum[np], self.centre)
    }
}

#[derive(Clone, Copy)]
struct Terms {
    full: [f64; 3],
    /// Running sums of `new` since the group started (absolute, so popping
    /// the front never invalidates them).
    cum_new: [f64; 3],
    cum_packages: u64,
}

/// [`GroupEstimator`] backed by [`Models`]: the shared-cost model's group when
/// the models have one, else the linear models' scorers (slot 0 long memory, 1
/// short memory, 2 occupancy).
pub struct ModelGroup<'m> {
    shared: Option<SharedGroup<'m>>,
    scorers: [Option<Scorer<'m>>; 3],
    terms: VecDeque<Terms>,
    prev: Option<TargetValues>,
    cur: TargetValues,
    cum_new: [f64; 3],
    cum_packages: u64,
}

impl Estimator for Models {
    type Group<'a> = ModelGroup<'a>;
    fn group<'a>(&'a self, ctx: &BuildContext) -> ModelGroup<'a> {
        let shared = self.shared.as_ref().map(|s| s.group(ctx));
        // With the shared-cost model, the linear ones are not scored at all.
        let mem = self.memory.as_ref().filter(|_| shared.is_none());
        let occupancy = self.occupancy.as_ref().filter(|_| shared.is_none());
        ModelGroup {
            shared,
            scorers: [
                mem.map(|m| Scorer::new(&m.long, ctx)),
                mem.and_then(|m| m.short.as_ref()).map(|s| Scorer::new(s, ctx)),
                occupancy.map(|o| Scorer::new(o, ctx)),
            ],
            terms: VecDeque::new(),
            prev: None,
            cur: TargetValues::default(),
            cum_new: [0.0; 3],
            cum_packages: 0,
        }
    }
}

impl ModelGroup<'_> {
    fn window(&self, m: usize, len: usize) -> Result<f64> {
        let scorer = self.scorers[m].as_ref().ok_or_else(|| BatchError::Estimate("model not loaded".into()))?;
        if len == 0 || len > self.terms.len() {
            return Err(BatchError::Estimate(format!("prefix length {len} outside queue of {}", self.terms.len())));
        }
        let first = &self.terms[0];
        let last = &self.terms[len - 1];
        let sum = first.full[m] + last.cum_new[m] - first.cum_new[m];
        let packages = 1 + (last.cum_packages - first.cum_packages) as usize;
        scorer.finish(sum, len, packages)
    }
}

impl GroupEstimator for ModelGroup<'_> {
    fn push(&mut self, label: &Label<'_>) {
        if let Some(s) = &mut self.shared {
            return s.push(label);
        }
        self.cur.fill(label);
        let mut full = [0.0; 3];
        for (m, s) in self.scorers.iter().enumerate() {
            if let Some(s) = s {
                let (f, n) = s.terms(&self.cur, self.prev.as_ref());
                full[m] = f;
                self.cum_new[m] += n;
            }
        }
        if self.prev.as_ref().is_none_or(|p| p.package != self.cur.package) {
            self.cum_packages += 1;
        }
        self.terms.push_back(Terms { full, cum_new: self.cum_new, cum_packages: self.cum_packages });
        // Swap buffers instead of cloning the ancestor vector.
        match &mut self.prev {
            Some(p) => std::mem::swap(p, &mut self.cur),
            None => self.prev = Some(std::mem::take(&mut self.cur)),
        }
    }

    fn pop_front(&mut self, n: usize) {
        if let Some(s) = &mut self.shared {
            return s.pop_front(n);
        }
        self.terms.drain(..n.min(self.terms.len()));
    }

    fn memory_bytes(&mut self, len: usize) -> Result<f64> {
        if let Some(s) = &mut self.shared {
            return s.memory_bytes(len);
        }
        let long = self.window(0, len)?;
        if self.scorers[1].is_some() {
            Ok(long.max(self.window(1, len)?))
        } else {
            Ok(long)
        }
    }

    fn occupancy_esu(&mut self, len: usize) -> Result<f64> {
        if let Some(s) = &mut self.shared {
            return s.occupancy_esu(len);
        }
        self.window(2, len)
    }

    fn errors(&self) -> (Option<ErrorModel>, Option<ErrorModel>) {
        if let Some(s) = &self.shared {
            return s.errors();
        }
        // The memory estimate is the larger of the two windows' models.
        let err = |i: usize| self.scorers[i].as_ref().and_then(|s| s.model.error);
        (ErrorModel::wider(err(0), err(1)), err(2))
    }

    fn cost_group(&self, i: usize) -> Option<u64> {
        self.shared.as_ref().and_then(|s| s.cost_group(i))
    }
}

// ---------------------------------------------------------------------------
// Algorithm 1
// ---------------------------------------------------------------------------

/// Largest `k` in `1..hi` with `f(k) < cutoff`, given `f(hi) >= cutoff` and
/// `f` non-decreasing; 1 if even `f(1)` is over. On an estimate error,
/// returns the smallest length known to be over the cutoff so far.
fn longest_under(hi: usize, cutoff: f64, mut f: impl FnMut(usize) -> Result<f64>) -> std::result::Result<usize, usize> {
    let (mut lo, mut hi) = (0usize, hi);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match f(mid) {
            Ok(v) if v < cutoff => lo = mid,
            Ok(_) => hi = mid,
            Err(_) => return Err(hi),
        }
    }
    Ok(lo.max(1))
}

/// Cuts batches from the front of one executor group's sorted queue.
struct GroupCutter<G> {
    labels: VecDeque<String>,
    est: G,
    executor_types: ExecutorSet,
    memory_cutoff: f64,
    occupancy_cutoff: f64,
    max_targets: usize,
    fallback: usize,
    /// The Bazel heap and the memory model's error, for each batch's OOM chance.
    memory_limit: f64,
    memory_error: Option<ErrorModel>,
    /// `[batch] group_backoff_share`.
    group_backoff_share: f64,
}

impl<G: GroupEstimator> GroupCutter<G> {
    fn new(est: G, executor_types: ExecutorSet, ctx: &BuildContext, cfg: &PlannerConfig) -> Self {
        // The calibrated margin: a batch stops at the cutoff, or earlier where
        // the model's own error makes exceeding the hard limit likelier than
        // the target rate. A model's margin is never below the floor: its error is
        // measured on whole builds, and a hidden heavy target is a jump it never saw.
        // Both tighten while the builds since training ran out of memory more often
        // than the rate allows: the stream is not the history they were measured on.
        let (mem_err, occ_err) = est.errors();
        let memory_limit = cfg.bazel_memory_bytes as f64;
        let (oom_rate, floor) = est.oom_record().map_or((cfg.target_oom_rate, cfg.min_memory_margin), |r| {
            crate::margin::tightened(cfg.target_oom_rate, cfg.min_memory_margin, r, cfg.excess_oom_tightening)
        });
        let memory_cutoff = (cfg.memory_cutoff_bytes.for_priority(ctx.priority) as f64)
            .min(mem_err.map_or(f64::INFINITY, |e| memory_limit / e.margin(oom_rate).max(floor)));
        let occupancy_cutoff = cfg
            .occupancy_cutoff_esu
            .min(occ_err.map_or(f64::INFINITY, |e| cfg.occupancy_limit_esu / e.margin(cfg.target_de_rate)));
        GroupCutter {
            labels: VecDeque::new(),
            est,
            executor_types,
            memory_cutoff,
            occupancy_cutoff,
            max_targets: cfg.max_targets_per_batch,
            fallback: cfg.fallback_batch_size,
            memory_limit,
            memory_error: mem_err,
            group_backoff_share: cfg.group_backoff_share,
        }
    }

    /// Where a memory-limited batch of `len` ends instead: at the start of the history
    /// group its cut falls inside, if that drops at most `group_backoff_share` of it.
    /// The group's sum is known, its split is not: part of it may hold the heaviest
    /// target priced at an even share. Whole, it is priced right, and so is the rest.
    fn back_off_to_group(&self, len: usize) -> usize {
        let g = match self.est.cost_group(len - 1) {
            Some(g) if self.est.cost_group(len) == Some(g) => g,
            _ => return len,
        };
        let most = (self.group_backoff_share * len as f64).floor() as usize;
        let mut start = len - 1;
        while start > 0 && self.est.cost_group(start - 1) == Some(g) {
            start -= 1;
        }
        // The group starting the batch has no start to go back to.
        if start > 0 && len - start <= most {
            start
        } else {
            len
        }
    }

    /// Append a label that is already validated and canonical.
    fn push(&mut self, label: String) {
        {
            let parsed = parse_label_trusted(&label);
            self.est.push(&parsed);
        }
        self.labels.push_back(label);
    }

    fn len(&self) -> usize {
        self.labels.len()
    }

    /// A full window plus at least one more target is queued, so cutting now
    /// gives the same batch as cutting with the whole stream in view.
    fn ready(&self) -> bool {
        self.labels.len() > self.max_targets
    }

    fn emit(&mut self, len: usize, reason: BatchSizeReason, mem: Option<f64>, occ: Option<f64>) -> Batch {
        let targets: Vec<String> = self.labels.drain(..len).collect();
        self.est.pop_front(len);
        let oom_probability = match (mem, self.memory_error) {
            (Some(m), Some(e)) if m > 0.0 => Some(e.exceed_probability((self.memory_limit / m).ln())),
            _ => None,
        };
        Batch {
            targets,
            reason,
            memory_estimate_bytes: mem.map(|m| m.round() as u64),
            occupancy_estimate_esu: occ,
            oom_probability,
            executor_types: self.executor_types.clone(),
        }
    }

    /// Cut one batch from the front (queue must be non-empty).
    fn cut(&mut self) -> Batch {
        use BatchSizeReason::*;
        let remaining = self.labels.len();
        debug_assert!(remaining > 0);
        if remaining == 1 {
            // The design's ONLY_ONE_TARGET consults neither model.
            return self.emit(1, OnlyOneTarget, None, None);
        }
        let n = remaining.min(self.max_targets);

        // Memory: whole window, else binary search.
        let (len, mem_limited) = match self.est.memory_bytes(n) {
            Err(_) => return self.emit(self.fallback.min(n), MemoryEstimateError, None, None),
            Ok(m) if m < self.memory_cutoff => (n, false),
            Ok(_) => {
                let cutoff = self.memory_cutoff;
                let est = &mut self.est;
                match longest_under(n, cutoff, |k| est.memory_bytes(k)) {
                    Ok(k) => (k, true),
                    Err(hi) => return self.emit(self.fallback.min(hi), MemoryEstimateError, None, None),
                }
            }
        };

        // Occupancy: search within the memory-limited prefix.
        let (len, occ_limited) = match self.est.occupancy_esu(len) {
            Err(_) => {
                let l = self.fallback.min(len);
                let mem = self.est.memory_bytes(l).ok();
                return self.emit(l, OccupancyEstimateError, mem, None);
            }
            Ok(o) if o < self.occupancy_cutoff => (len, false),
            Ok(_) => {
                let cutoff = self.occupancy_cutoff;
                let est = &mut self.est;
                match longest_under(len, cutoff, |k| est.occupancy_esu(k)) {
                    Ok(k) => (k, true),
                    Err(hi) => {
                        let l = self.fallback.min(hi);
                        let mem = self.est.memory_bytes(l).ok();
                        return self.emit(l, OccupancyEstimateError, mem, None);
                    }
                }
            }
        };

        // Only a memory-limited cut: an OOM costs a split and a rerun of both halves,
        // while occupancy's cut is already short of a limit that only slows a build.
        let len = if mem_limited && !occ_limited { self.back_off_to_group(len) } else { len };
        let reason = if occ_limited {
            MaxOccupancy
        } else if mem_limited {
            MaxMemory
        } else if n == remaining {
            // Everything left fit (also when exactly max_targets were left:
            // the window was not cut by the limit but by the end of input).
            AllRemainingTargets
        } else {
            MaxTargets
        };
        let mem = self.est.memory_bytes(len).ok();
        let occ = self.est.occupancy_esu(len).ok();
        self.emit(len, reason, mem, occ)
    }
}

/// Sort labels in byte order. Sorting ten million heap strings through
/// pointers is dominated by cache misses, so sort compact records holding
/// 24 bytes of each label (after the `//` every main-repo label starts
/// with) and an index, touching the strings only to break ties. Labels
/// starting with `//` sort before `@repo//` ones (`/` < `@`), so the two
/// classes are sorted separately and concatenated.
pub(crate) fn sort_labels(labels: Vec<String>) -> Vec<String> {
    if labels.len() < 64 || labels.len() > u32::MAX as usize {
        let mut l = labels;
        l.sort_unstable();
        return l;
    }
    let key = |s: &str| -> (u128, u64) {
        let bytes = s.as_bytes();
        let off = if s.starts_with("//") { 2 } else { 0 };
        let mut b = [0u8; 24];
        let n = (bytes.len() - off).min(24);
        b[..n].copy_from_slice(&bytes[off..off + n]);
        let (hi, lo) = b.split_at(16);
        (u128::from_be_bytes(hi.try_into().expect("16 bytes")), u64::from_be_bytes(lo.try_into().expect("8 bytes")))
    };
    let mut main: Vec<(u128, u64, u32)> = Vec::with_capacity(labels.len());
    let mut other: Vec<(u128, u64, u32)> = Vec::new();
    for (i, l) in labels.iter().enumerate() {
        let (a, b) = key(l);
        if l.starts_with("//") {
            main.push((a, b, i as u32));
        } else {
            other.push((a, b, i as u32));
        }
    }
    let cmp = |x: &(u128, u64, u32), y: &(u128, u64, u32)| {
        (x.0, x.1).cmp(&(y.0, y.1)).then_with(|| labels[x.2 as usize].cmp(&labels[y.2 as usize]))
    };
    main.sort_unstable_by(cmp);
    other.sort_unstable_by(cmp);
    let mut labels = labels;
    main.into_iter().chain(other).map(|(_, _, i)| std::mem::take(&mut labels[i as usize])).collect()
}

/// Validate a label and return its canonical spelling (`//a/b` -> `//a/b:b`),
/// reusing the string when it is already canonical.
fn canonical_label(label: String) -> Result<String> {
    let parsed = parse_label(&label)?;
    if parsed.is_shorthand() {
        Ok(parsed.canonical().into_owned())
    } else {
        Ok(label)
    }
}

/// Plan a whole request in memory.
///
/// Targets are grouped by executor set (groups appear in the output in
/// first-seen order), each group is sorted by label (byte order of the
/// canonical label) and de-duplicated, then cut with Algorithm 1. Output
/// labels are canonical (`//a/b` is returned as `//a/b:b`).
pub fn plan<E: Estimator>(
    ctx: &BuildContext,
    targets: Vec<Target>,
    config: &PlannerConfig,
    estimator: &E,
) -> Result<Vec<Batch>> {
    config.validate()?;
    ctx.validate()?;
    let mut grouper = Grouper::new(&config.executors);
    let mut groups: Vec<Vec<String>> = vec![Vec::new()];
    let mut order: Vec<usize> = Vec::new();
    for t in targets {
        let id = grouper.group_of(&t);
        if id >= groups.len() {
            groups.resize_with(id + 1, Vec::new);
        }
        if groups[id].is_empty() && !order.contains(&id) {
            order.push(id);
        }
        groups[id].push(canonical_label(t.label)?);
    }
    let mut out = Vec::new();
    for id in order {
        let mut labels = sort_labels(std::mem::take(&mut groups[id]));
        labels.dedup();
        let mut cutter = GroupCutter::new(estimator.group(ctx), grouper.set(id).clone(), ctx, config);
        for l in labels {
            cutter.push(l);
            while cutter.ready() {
                out.push(cutter.cut());
            }
        }
        while cutter.len() > 0 {
            out.push(cutter.cut());
        }
    }
    Ok(out)
}

struct StreamGroup<G> {
    pending: Vec<String>,
    cutter: GroupCutter<G>,
}

/// Incremental planner for streams too large to hold: push targets as they
/// arrive, collect batches with [`StreamingPlanner::take_ready`], and call
/// [`StreamingPlanner::finish`] at the end of the stream.
///
/// # Sorting trade-off
/// Sorting needs the whole group, which a stream of millions cannot afford
/// to hold (and holding it would delay every build until the stream ends).
/// This planner sorts *bounded windows*: each executor group buffers up to
/// `stream_sort_window` targets (default 100,000), sorts and de-duplicates
/// them, and cuts batches while more than `max_targets_per_batch` targets
/// are queued (the one-target lookahead makes MAX_TARGETS vs
/// ALL_REMAINING_TARGETS exact). The unconsumed tail (< one batch) stays
/// queued and the next window is appended after it. Memory per group is
/// O(window + max_targets_per_batch). Cost: targets of one package that
/// arrive more than a window apart land in different batches, which loses
/// some sharing, and duplicates are only removed within a window. We chose
/// this over an external merge sort because that would need disk, and would
/// emit nothing until the stream ended; streams that fit in one window (the
/// vast majority) are planned exactly like [`plan`] does.
pub struct StreamingPlanner<'e, E: Estimator + 'e> {
    ctx: BuildContext,
    config: PlannerConfig,
    estimator: &'e E,
    grouper: Grouper,
    groups: Vec<Option<StreamGroup<E::Group<'e>>>>,
    /// Group ids in first-seen order (so `finish` flushes deterministically).
    order: Vec<usize>,
    ready: Vec<Batch>,
    pushed: u64,
}

impl<'e, E: Estimator + 'e> StreamingPlanner<'e, E> {
    pub fn new(ctx: BuildContext, config: PlannerConfig, estimator: &'e E) -> Result<Self> {
        config.validate()?;
        ctx.validate()?;
        let grouper = Grouper::new(&config.executors);
        Ok(StreamingPlanner {
            ctx,
            config,
            estimator,
            grouper,
            groups: Vec::new(),
            order: Vec::new(),
            ready: Vec::new(),
            pushed: 0,
        })
    }

    /// Add one target. Invalid labels are rejected without changing state.
    pub fn push(&mut self, target: Target) -> Result<()> {
        let id = self.grouper.group_of(&target);
        let label = canonical_label(target.label)?;
        if id >= self.groups.len() {
            self.groups.resize_with(id + 1, || None);
        }
        if self.groups[id].is_none() {
            let est = self.estimator.group(&self.ctx);
            let set = self.grouper.set(id).clone();
            self.groups[id] =
                Some(StreamGroup { pending: Vec::new(), cutter: GroupCutter::new(est, set, &self.ctx, &self.config) });
            self.order.push(id);
        }
        self.pushed += 1;
        let g = self.groups[id].as_mut().expect("created above");
        g.pending.push(label);
        if g.pending.len() >= self.config.stream_sort_window {
            Self::flush(g, &mut self.ready, false);
        }
        Ok(())
    }

    fn flush(g: &mut StreamGroup<E::Group<'e>>, ready: &mut Vec<Batch>, finishing: bool) {
        let mut sorted = sort_labels(std::mem::take(&mut g.pending));
        sorted.dedup();
        for l in sorted {
            g.cutter.push(l);
            while g.cutter.ready() {
                ready.push(g.cutter.cut());
            }
        }
        if finishing {
            while g.cutter.len() > 0 {
                ready.push(g.cutter.cut());
            }
        }
    }

    /// Batches completed so far (each returned once).
    pub fn take_ready(&mut self) -> Vec<Batch> {
        std::mem::take(&mut self.ready)
    }

    /// Targets accepted so far.
    pub fn pushed(&self) -> u64 {
        self.pushed
    }

    /// Targets buffered and not yet in a batch (the memory bound).
    pub fn buffered(&self) -> usize {
        self.groups.iter().flatten().map(|g| g.pending.len() + g.cutter.len()).sum()
    }

    /// Flush every group and return all batches not yet taken.
    pub fn finish(mut self) -> Vec<Batch> {
        for &id in &self.order {
            if let Some(g) = self.groups[id].as_mut() {
                Self::flush(g, &mut self.ready, true);
            }
        }
        self.ready
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::features::{fnv1a, mix, Family, FeatureSpec};
    use crate::model::{LinearModel, MemoryEstimator, ModelKind};
    use crate::types::{Command, Priority, GB};
    use BatchSizeReason::*;

    /// A model where every distinct label adds exactly `per_label` units.
    fn per_label_model(kind: ModelKind, per_label: f64) -> LinearModel {
        let mut spec = FeatureSpec::new(10);
        spec.families = vec![Family::Label];
        let mut w = vec![0.0; spec.slots()];
        for x in &mut w[spec.nonneg_start()..] {
            *x = per_label;
        }
        LinearModel::from_parts(kind, spec, 0.0, w, 1.0, 1.0).unwrap()
    }

    fn models(mem_gb: Option<f64>, occ: Option<f64>) -> Models {
        Models {
            memory: mem_gb
                .map(|g| MemoryEstimator { long: per_label_model(ModelKind::MemoryBytes, g * GB as f64), short: None }),
            occupancy: occ.map(|o| per_label_model(ModelKind::OccupancyEsu, o)),
            ..Models::default()
        }
    }

    fn ctx(p: Priority) -> BuildContext {
        BuildContext::new_workspace("ws", Command::Test, p)
    }

    fn targets(n: usize) -> Vec<Target> {
        (0..n).map(|i| Target::new(format!("//p{}:t{:04}", i % 3, i))).collect()
    }

    fn reasons(b: &[Batch]) -> Vec<(usize, BatchSizeReason)> {
        b.iter().map(|b| (b.targets.len(), b.reason)).collect()
    }

    #[test]
    fn sort_labels_is_byte_order() {
        let raw = [
            "//a/b:x",
            "//a/b/c:y",
            "//a/b1:z",
            "//a/bbbbbbbbbbbbbbbbbbbbbbbbbbb:q",
            "//a/bbbbbbbbbbbbbbbbbbbbbbbbbbb:p",
            "@r//a:b",
            "//a",
            "//",
            "//a/b:x",
            "@@a//x:y",
            "//:r",
        ];
        // Enough copies with variations to take the keyed path (>= 64).
        let v: Vec<String> = (0..40).flat_map(|i| raw.iter().map(move |s| format!("{s}{}", i % 7))).collect();
        let mut expected = v.clone();
        expected.sort();
        assert_eq!(sort_labels(v), expected);
    }

    #[test]
    fn only_one_target() {
        let b =
            plan(&ctx(Priority::High), targets(1), &PlannerConfig::default(), &models(Some(100.0), Some(1e6))).unwrap();
        assert_eq!(reasons(&b), vec![(1, OnlyOneTarget)]);
        assert_eq!(b[0].memory_estimate_bytes, None);
    }

    #[test]
    fn all_remaining_then_estimates_recorded() {
        let b =
            plan(&ctx(Priority::High), targets(5), &PlannerConfig::default(), &models(Some(1.0), Some(10.0))).unwrap();
        assert_eq!(reasons(&b), vec![(5, AllRemainingTargets)]);
        assert_eq!(b[0].memory_estimate_bytes, Some(5 * GB));
        assert_eq!(b[0].occupancy_estimate_esu, Some(50.0));
    }

    #[test]
    fn max_memory_uses_priority_cutoff() {
        // 1 GB per target; HIGH cutoff 7 GB -> 6 per batch (7 is not under 7).
        let b =
            plan(&ctx(Priority::High), targets(20), &PlannerConfig::default(), &models(Some(1.0), Some(0.0))).unwrap();
        assert_eq!(reasons(&b), vec![(6, MaxMemory), (6, MaxMemory), (6, MaxMemory), (2, AllRemainingTargets)]);
        assert_eq!(b[0].memory_estimate_bytes, Some(6 * GB));
        let low =
            plan(&ctx(Priority::Low), targets(20), &PlannerConfig::default(), &models(Some(1.0), Some(0.0))).unwrap();
        assert_eq!(low[0].targets.len(), 9);
        // A single target over the cutoff still forms a batch.
        let huge =
            plan(&ctx(Priority::High), targets(3), &PlannerConfig::default(), &models(Some(50.0), Some(0.0))).unwrap();
        assert_eq!(reasons(&huge), vec![(1, MaxMemory), (1, MaxMemory), (1, OnlyOneTarget)]);
    }

    #[test]
    fn max_targets_vs_all_remaining() {
        let cfg = PlannerConfig { max_targets_per_batch: 4, ..PlannerConfig::default() };
        let b = plan(&ctx(Priority::Medium), targets(10), &cfg, &models(Some(0.001), Some(0.1))).unwrap();
        assert_eq!(reasons(&b), vec![(4, MaxTargets), (4, MaxTargets), (2, AllRemainingTargets)]);
        // Exactly max_targets left: the end of input, not the limit, stopped it.
        let b = plan(&ctx(Priority::Medium), targets(8), &cfg, &models(Some(0.001), Some(0.1))).unwrap();
        assert_eq!(reasons(&b), vec![(4, MaxTargets), (4, AllRemainingTargets)]);
    }

    #[test]
    fn max_occupancy_searches_within_memory_prefix() {
        // 100 ESU per target, cutoff 500 -> 4 per batch.
        let b = plan(&ctx(Priority::Low), targets(10), &PlannerConfig::default(), &models(Some(0.01), Some(100.0)))
            .unwrap();
        assert_eq!(reasons(&b), vec![(4, MaxOccupancy), (4, MaxOccupancy), (2, AllRemainingTargets)]);
        assert_eq!(b[0].occupancy_estimate_esu, Some(400.0));
        // Memory cuts to 6 first (HIGH), occupancy then cuts 6 -> 4.
        let b = plan(&ctx(Priority::High), targets(12), &PlannerConfig::default(), &models(Some(1.0), Some(100.0)))
            .unwrap();
        assert_eq!(b[0].reason, MaxOccupancy);
        assert_eq!(b[0].targets.len(), 4);
    }

    #[test]
    fn estimate_errors_fall_back() {
        let cfg = PlannerConfig { fallback_batch_size: 3, ..PlannerConfig::default() };
        let b = plan(&ctx(Priority::High), targets(7), &cfg, &models(None, Some(1.0))).unwrap();
        assert_eq!(reasons(&b), vec![(3, MemoryEstimateError), (3, MemoryEstimateError), (1, OnlyOneTarget)]);
        assert_eq!(b[0].memory_estimate_bytes, None);
        let b = plan(&ctx(Priority::High), targets(7), &cfg, &models(Some(0.1), None)).unwrap();
        assert_eq!(reasons(&b), vec![(3, OccupancyEstimateError), (3, OccupancyEstimateError), (1, OnlyOneTarget)]);
        // Memory was still estimated for the fallback batch.
        assert_eq!(b[0].memory_estimate_bytes, Some(300_000_000));
        assert_eq!(b[0].occupancy_estimate_esu, None);
    }

    #[test]
    fn error_midway_through_search_caps_fallback_at_known_bound() {
        // Target //p:t5 has a NaN weight: any prefix that includes it fails.
        let mut m = models(Some(1.0), Some(0.0));
        let long = &mut m.memory.as_mut().unwrap().long;
        let spec = long.spec.clone();
        let slot = spec.slot(mix(Family::Label.tag(), fnv1a(b"//p:t5")), true) as usize;
        let mut w = long.weights().to_vec();
        w[slot] = f64::NAN;
        *long = LinearModel::from_parts(ModelKind::MemoryBytes, spec, 0.0, w, 1.0, 1.0).unwrap();
        let ts: Vec<Target> = (0..10).map(|i| Target::new(format!("//p:t{i}"))).collect();
        let cfg = PlannerConfig { fallback_batch_size: 300, ..PlannerConfig::default() };
        let b = plan(&ctx(Priority::High), ts, &cfg, &m).unwrap();
        // Window of 10 fails outright -> fallback min(300, 10) = 10.
        assert_eq!(reasons(&b), vec![(10, MemoryEstimateError)]);
        // With 1 GB per target and 8 targets: est(8) fails (contains t5);
        // the search learns nothing below, so the bound is still 8.
        let ts: Vec<Target> = (0..8).map(|i| Target::new(format!("//p:t{i}"))).collect();
        let cfg = PlannerConfig { fallback_batch_size: 2, ..PlannerConfig::default() };
        let b = plan(&ctx(Priority::High), ts, &cfg, &m).unwrap();
        assert_eq!(b[0].reason, MemoryEstimateError);
        assert_eq!(b[0].targets.len(), 2);
    }

    #[test]
    fn groups_sorted_deduped_canonical() {
        let mut ts = vec![
            Target::new("//z:b"),
            Target::new("//a/b"),
            Target::new("//a/b:b"),
            Target::new("//m:x"),
            Target::new("//z:b"),
        ];
        ts.push(Target { label: "//g:gpu_test".into(), rule_kind: None, tags: vec!["requires-gpu".into()] });
        ts.push(Target { label: "//c:ios".into(), rule_kind: Some("ios_ui_test".into()), tags: vec![] });
        let b = plan(&ctx(Priority::High), ts, &PlannerConfig::default(), &models(Some(0.1), Some(1.0))).unwrap();
        assert_eq!(b.len(), 3);
        assert_eq!(b[0].targets, vec!["//a/b:b", "//m:x", "//z:b"]);
        assert_eq!(b[0].executor_types.iter().collect::<Vec<_>>(), vec!["x86"]);
        assert_eq!(b[1].targets, vec!["//g:gpu_test"]);
        assert_eq!(b[1].executor_types.iter().collect::<Vec<_>>(), vec!["gpu", "x86"]);
        assert_eq!(b[2].executor_types.iter().collect::<Vec<_>>(), vec!["mac", "x86"]);
        let e = plan(&ctx(Priority::High), vec![Target::new("//a:")], &PlannerConfig::default(), &models(None, None));
        assert!(matches!(e, Err(BatchError::InvalidLabel { .. })));
    }

    /// Random non-negative weights everywhere: the incremental prefix
    /// estimate equals the set-semantics prediction when every prefix split
    /// is contiguous in sorted order, and is never below it otherwise.
    #[test]
    fn incremental_matches_set_semantics() {
        let mut spec = FeatureSpec::new(14);
        spec.crosses = vec![
            crate::features::Cross(Family::ToolTag, Family::Package),
            crate::features::Cross(Family::User, Family::Prefix),
            crate::features::Cross(Family::Priority, Family::TargetCount),
        ];
        spec.target_count_boundaries = vec![2, 5, 9];
        spec.package_count_boundaries = vec![2, 3];
        let mut x: u64 = 1;
        let w: Vec<f64> = (0..spec.slots())
            .map(|_| {
                x = mix(x, 7);
                (x % 1000) as f64 / 1000.0
            })
            .collect();
        let model = LinearModel::from_parts(ModelKind::MemoryBytes, spec, 0.5, w, 1.0, 1.0).unwrap();
        let mut c = ctx(Priority::Medium);
        c.user = "u".into();
        c.tool_tag = "t".into();
        let check = |labels: &[&str], exact: bool| {
            let parsed: Vec<Label<'_>> = labels.iter().map(|l| parse_label(l).unwrap()).collect();
            let m = Models { memory: Some(MemoryEstimator { long: model.clone(), short: None }), ..Models::default() };
            let mut g = m.group(&c);
            for p in &parsed {
                g.push(p);
            }
            let mut last = 0.0;
            for len in 1..=labels.len() {
                let inc = g.memory_bytes(len).unwrap();
                let set = model.predict(&c, &labels[..len]).unwrap();
                if exact {
                    assert!((inc - set).abs() < 1e-9 * set.max(1.0), "len {len}: {inc} vs {set}");
                } else {
                    assert!(inc >= set - 1e-9, "len {len}: {inc} < {set}");
                }
                assert!(inc >= last);
                last = inc;
            }
        };
        check(&["//a/b/c:1", "//a/b/c:2", "//a/b/d:1", "//a/b:x", "//a/e:y", "//f:z"], true);
        // `//a/b` reappears after `//a/b1`: counted twice, never less.
        check(&["//a/b/c:1", "//a/b1:x", "//a/b:z", "//a/b:zz"], false);
    }

    #[test]
    fn streaming_matches_plan_within_window_and_bounds_memory() {
        let m = models(Some(0.5), Some(20.0));
        let mut ts = targets(2000);
        ts.reverse();
        let c = ctx(Priority::Medium);
        let cfg = PlannerConfig::default();
        let whole = plan(&c, ts.clone(), &cfg, &m).unwrap();
        let mut sp = StreamingPlanner::new(c.clone(), cfg.clone(), &m).unwrap();
        for t in ts.clone() {
            sp.push(t).unwrap();
        }
        assert_eq!(sp.pushed(), 2000);
        assert_eq!(sp.finish(), whole);

        // Small window: bounded buffer, every target exactly once.
        let cfg = PlannerConfig { max_targets_per_batch: 50, stream_sort_window: 300, ..PlannerConfig::default() };
        let mut sp = StreamingPlanner::new(c, cfg, &m).unwrap();
        let mut out = Vec::new();
        for t in ts {
            sp.push(t).unwrap();
            assert!(sp.buffered() <= 300 + 50);
            out.extend(sp.take_ready());
        }
        assert!(!out.is_empty(), "batches are emitted before the stream ends");
        out.extend(sp.finish());
        let mut all: Vec<String> = out.iter().flat_map(|b| b.targets.clone()).collect();
        assert_eq!(all.len(), 2000);
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 2000);
        for b in &out {
            assert!(b.targets.len() <= 50);
            // Sorted within a window; a batch may straddle one window
            // boundary (the documented trade-off), never more.
            let descents = b.targets.windows(2).filter(|w| w[0] >= w[1]).count();
            assert!(descents <= 1, "{descents} descents in {:?}", b.targets);
        }
    }

    /// Every target costs 1 GB and `esu` ESU; a target's history group is its package's
    /// name, except that packages starting with `n` have none.
    struct Grouped {
        esu: f64,
    }
    struct GroupedQueue {
        esu: f64,
        groups: VecDeque<Option<u64>>,
    }
    impl Estimator for Grouped {
        type Group<'a> = GroupedQueue;
        fn group(&self, _: &BuildContext) -> GroupedQueue {
            GroupedQueue { esu: self.esu, groups: VecDeque::new() }
        }
    }
    impl GroupEstimator for GroupedQueue {
        fn push(&mut self, label: &Label<'_>) {
            let p = label.package();
            self.groups.push_back((!p.starts_with("//n")).then(|| fnv1a(p.as_bytes())));
        }
        fn pop_front(&mut self, n: usize) {
            self.groups.drain(..n);
        }
        fn memory_bytes(&mut self, len: usize) -> Result<f64> {
            Ok(len as f64 * GB as f64)
        }
        fn occupancy_esu(&mut self, len: usize) -> Result<f64> {
            Ok(len as f64 * self.esu)
        }
        fn cost_group(&self, i: usize) -> Option<u64> {
            self.groups[i]
        }
    }

    /// The default share, spelled out so these tests keep their meaning if it moves.
    fn backoff() -> PlannerConfig {
        PlannerConfig { group_backoff_share: 0.3, ..PlannerConfig::default() }
    }

    /// `n` targets in each package, in order.
    fn packages(spec: &[(&str, usize)]) -> Vec<Target> {
        spec.iter().flat_map(|&(p, n)| (0..n).map(move |i| Target::new(format!("//{p}:t{i:02}")))).collect()
    }

    #[test]
    fn memory_cut_inside_a_history_group_backs_off_to_its_start() {
        // HIGH cuts at 6 GB, so 6 targets: ga's 5 and one of gb's 10. Dropping that one
        // (1 <= 0.3 * 6) keeps gb whole in the next batch; there gb starts the batch, so
        // there is no start to go back to and it is cut at 6 as before.
        let cfg = backoff();
        let t = packages(&[("ga", 5), ("gb", 10)]);
        let b = plan(&ctx(Priority::High), t.clone(), &cfg, &Grouped { esu: 0.0 }).unwrap();
        assert_eq!(reasons(&b), vec![(5, MaxMemory), (6, MaxMemory), (4, AllRemainingTargets)]);
        assert!(b[1].targets.iter().all(|l| l.starts_with("//gb:")));
        assert_eq!(b[0].memory_estimate_bytes, Some(5 * GB), "estimates are of the batch as cut");
        // Off: the plain cut.
        let off = PlannerConfig { group_backoff_share: 0.0, ..PlannerConfig::default() };
        let b = plan(&ctx(Priority::High), t, &off, &Grouped { esu: 0.0 }).unwrap();
        assert_eq!(reasons(&b), vec![(6, MaxMemory), (6, MaxMemory), (3, AllRemainingTargets)]);
    }

    #[test]
    fn group_backoff_is_bounded_and_needs_a_group_on_both_sides() {
        let cfg = backoff();
        let high = |t: Vec<Target>, cfg: &PlannerConfig| {
            reasons(&plan(&ctx(Priority::High), t, cfg, &Grouped { esu: 0.0 }).unwrap())[0]
        };
        // Going back to gb's start would drop 3 of 6, more than 0.3 of the batch.
        assert_eq!(high(packages(&[("ga", 3), ("gb", 10)]), &cfg), (6, MaxMemory));
        // A larger share allows it.
        let half = PlannerConfig { group_backoff_share: 0.5, ..cfg.clone() };
        assert_eq!(high(packages(&[("ga", 3), ("gb", 10)]), &half), (3, MaxMemory));
        // The cut already falls between two groups: nothing to do.
        assert_eq!(high(packages(&[("ga", 6), ("gb", 10)]), &cfg), (6, MaxMemory));
        // Targets of no known group (packages `n*`) are never a reason to move.
        assert_eq!(high(packages(&[("ga", 5), ("n", 10)]), &cfg), (6, MaxMemory));
        assert_eq!(high(packages(&[("n", 5), ("n2", 10)]), &cfg), (6, MaxMemory));
    }

    #[test]
    fn an_occupancy_limited_cut_keeps_its_length() {
        // 100 ESU each: occupancy cuts at 4 (under 500), inside gb; memory would allow 6.
        let b = plan(&ctx(Priority::High), packages(&[("ga", 3), ("gb", 10)]), &backoff(), &Grouped { esu: 100.0 })
            .unwrap();
        assert_eq!(reasons(&b)[0], (4, MaxOccupancy));
    }

    #[test]
    fn streaming_backs_off_like_plan() {
        let cfg = PlannerConfig { max_targets_per_batch: 50, stream_sort_window: 200, ..backoff() };
        let t = packages(&[("ga", 4), ("gb", 7), ("gc", 2), ("n", 9), ("p", 30)]);
        let whole = plan(&ctx(Priority::Medium), t.clone(), &cfg, &Grouped { esu: 0.0 }).unwrap();
        let mut sp = StreamingPlanner::new(ctx(Priority::Medium), cfg, &Grouped { esu: 0.0 }).unwrap();
        for x in t {
            sp.push(x).unwrap();
        }
        assert_eq!(sp.finish(), whole);
        // MEDIUM cuts at 8. ga + 4 of gb: gb's start would drop 4 of 8, too many. Then
        // gb, gc and 3 of n: n has no group. Then 6 of n and 2 of p: back to p's start.
        let lens: Vec<usize> = whole.iter().map(|b| b.targets.len()).collect();
        assert_eq!(lens, vec![8, 8, 6, 8, 8, 8, 6]);
    }
}
