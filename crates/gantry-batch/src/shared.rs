//! The shared-cost learner: the planner's default model of a build's memory and
//! executor occupancy (`shared` in `gantry bench batch --compare`).
//!
//! A model with the structure the batching paper gives Bazel's memory, instead of
//! a linear score over hashed features:
//!
//! `memory = exp(Σ θ_f) × (Σ β_f + S^a)`, with `S = Σ_t w_t + Σ_p u_p + Σ_d v_d`
//!
//! and occupancy the same way, with its own parameters and without directories or
//! a power (executors are busy per action, and actions belong to targets and packages):
//!
//! * `w_t`: each target's own cost; `u_p`: each package's, charged once however many
//!   of its targets the build holds; `v_d`: each ancestor directory's, also once.
//!   All are non-negative, and `S^a` grows with `S`, so adding a target never lowers
//!   an estimate.
//! * `f` runs over the build's context: its command, flags, tool, user and whether it
//!   ran in the last day (a Bazel or toolchain regression shows there first). `θ`
//!   multiplies (coverage instruments every action); `β ≥ 0` adds a base (a user's
//!   own bazelrc and aspects).
//! * A target the history never built costs the mean of its package's targets; a
//!   package it never saw, the means under its nearest seen ancestor directory (costs
//!   scale with their subtree); a directory it never saw, the mean of those as deep.
//!   A mean over few members leans on its parent's (`prior_count`): one build of one
//!   costly target does not price a whole directory.
//!
//! Each part is fitted by full-batch Adam on `ln(label / estimate)` with a one-sided
//! Huber loss on the side labels can be wrong on: a peak taken without a full GC
//! reads high, an occupancy served from the action cache reads low. Residuals on that
//! side beyond `huber_delta` pull only linearly, and an OOM build's label (a lower
//! bound) pulls only when the estimate is below it. Builds count in proportion to
//! their size (`size_weight`): the planner cuts batches far larger than most of the
//! history's builds, and it is the large ones that pin down how cost grows with size.
//! Each log-parameter is shrunk towards its group's mean (a target towards its
//! package's targets), and targets start small, so that a cost all of a package's
//! targets share is the package's until the data says otherwise. On a history of
//! thousands of builds, the default shrinkage is far stronger than the data's pull on
//! any one cost, so packages and directories keep one common cost each and a package's
//! targets one cost between them (README, "What the fit learns"); weaker shrinkage
//! frees them but, measured, met the batching goals no better. Occupancy is the
//! exception (`occupancy_shrink`, a hundredth as strong): executors are busy per
//! action, a heavy test is heavy alone, and priced at its package's mean it under-reads
//! every batch that holds it, which the occupancy margin then pays for on every batch
//! (README, "Occupancy's targets free"). A package's common target cost is
//! itself held, weakly, near its top directory's (`package_prior`): a package the
//! history built once, in a build whose peak read high, would otherwise take that
//! build's whole excess, and every later batch holding it would be over-read. Large
//! held-out builds give each part its centre and its error model for the margins.

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::error::{BatchError, Result};
use crate::history::{BuildRecord, Outcome, Timestamp};
use crate::label::{parse_label, Label};
use crate::margin::{ErrorModel, TrustedSide};
use crate::planner::{Estimator, GroupEstimator};
use crate::types::BuildContext;

const GB: f64 = crate::types::GB as f64;

/// Training settings of the shared-cost learner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SharedConfig {
    /// Full-batch Adam iterations. A package the history built a few times, with one
    /// costly target, is still under-read by a third after 400; with `package_prior`
    /// holding the packages that high labels would inflate, more iterations fit it.
    pub iterations: usize,
    /// Adam step on the log-parameters.
    pub learning_rate: f64,
    /// Residuals on the noisy side beyond this (in log) pull linearly.
    pub huber_delta: f64,
    /// Weight of the pull of each log-parameter towards its group's mean. At the
    /// default it holds package and directory costs at one value on large histories
    /// (see the module docs).
    pub shrink: f64,
    /// The same for the occupancy part. A hundredth of `shrink` lets a target's own
    /// occupancy follow its builds (a heavy test is heavy alone) while still holding the
    /// costs no build tells apart; with none at all, such costs drift without bound.
    pub occupancy_shrink: f64,
    /// A build counts `1 + size_weight × targets` times.
    pub size_weight: f64,
    /// Share of the builds held out for the error models.
    pub validation_fraction: f64,
    /// The error models read held-out builds estimated at least this large (GB of
    /// memory, ESU of occupancy), and at least the largest 60: the planner's batches are
    /// large, and a small build's error is one odd target's.
    pub calibration_min: [f64; 2],
    /// Builds this recent (days before `now`) carry the `recent` feature; estimates
    /// always do.
    pub recent_days: f64,
    /// Weight of the pull of each package's mean target log-cost towards the mean of
    /// its top directory's packages, per unit of the history's total weight: about a
    /// prior spread of 1 in log against residuals of 0.1. Nothing else holds a package's
    /// targets' common cost, so without it a package the history built once, in a build
    /// whose peak read high, takes that build's whole excess.
    pub package_prior: f64,
    /// What code training never saw is charged a mean: a package's new target its
    /// targets', a new package its directory's. Each such mean counts this many more
    /// members at its parent's mean (the directory's, or the whole repository's), so a
    /// mean over the one target a single build held is not taken as the directory's.
    pub prior_count: f64,
}

impl Default for SharedConfig {
    fn default() -> Self {
        SharedConfig {
            iterations: 1200,
            learning_rate: 0.05,
            huber_delta: 0.1,
            shrink: 0.05,
            occupancy_shrink: 0.0005,
            size_weight: 0.02,
            validation_fraction: 0.1,
            calibration_min: [2.0, 50.0],
            recent_days: 1.0,
            prior_count: 2.0,
            package_prior: 0.01,
        }
    }
}

/// What training learns about the repository: the index of every piece.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
struct Index {
    targets: HashMap<String, u32>,
    /// Per target: its package.
    target_pkg: Vec<u32>,
    pkgs: HashMap<String, u32>,
    /// Per package: its ancestor directories.
    pkg_dirs: Vec<Vec<u32>>,
    dirs: HashMap<String, u32>,
    feats: HashMap<String, u32>,
    /// Per target: its history group (see [`GroupEstimator::cost_group`]), 0 for a
    /// target no training build held. Models saved before it load with none.
    #[serde(default)]
    target_group: Vec<u64>,
}

/// How one part is shaped.
#[derive(Clone, Copy)]
struct PartSpec {
    /// The side of the residuals free of label noise.
    side: TrustedSide,
    /// Directories carry costs of their own.
    dirs: bool,
    /// The exponent `a` is learned (else 1).
    power: bool,
}

/// One fitted quantity (GB of memory, or ESU): `exp(Σ θ_f) × (Σ β_f + S^a)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Part {
    w: Vec<f64>,
    u: Vec<f64>,
    v: Vec<f64>,
    theta: Vec<f64>,
    beta: Vec<f64>,
    power: f64,
    /// Per package: the cost of one of its targets that training never saw.
    pkg_unseen_target: Vec<f64>,
    /// Per directory: the mean cost of the seen targets and packages under it, which a
    /// package training never saw is charged (its nearest seen ancestor's).
    dir_target_mean: Vec<f64>,
    dir_pkg_mean: Vec<f64>,
    /// Per directory depth: the mean cost of the seen directories that deep.
    depth_dir_mean: Vec<f64>,
    unseen_target: f64,
    unseen_pkg: f64,
    unseen_dir: f64,
    /// `exp(median held-out log error)`: centres the estimate for the margin.
    centre: f64,
    error: Option<ErrorModel>,
}

/// A trained shared-cost model of memory and occupancy (`shared.json` in a model
/// directory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedModel {
    index: Index,
    memory: Part,
    occupancy: Part,
}

/// One training build, as indices.
struct Row {
    t: Vec<u32>,
    p: Vec<u32>,
    d: Vec<u32>,
    f: Vec<u32>,
    /// `ln(peak memory in GB)`.
    memory: f64,
    /// An OOM build: its memory only bounds the truth from below.
    censored: bool,
    /// `ln(occupancy in ESU)`, when known and positive.
    occupancy: Option<f64>,
    valid: bool,
}

fn context_features(ctx: &BuildContext, recent: bool) -> Vec<String> {
    let mut f = vec![
        "bias".to_string(),
        format!("command:{:?}", ctx.command),
        format!("tool:{}", ctx.tool_tag),
        format!("user:{}", ctx.user),
    ];
    f.extend(ctx.flags.iter().map(|x| format!("flag:{x}")));
    if recent {
        f.push("recent".to_string());
    }
    f.sort();
    f.dedup();
    f
}

fn intern(map: &mut HashMap<String, u32>, key: &str) -> u32 {
    let n = map.len() as u32;
    *map.entry(key.to_string()).or_insert(n)
}

/// Adam on one parameter vector.
struct Adam {
    m: Vec<f64>,
    v: Vec<f64>,
}

impl Adam {
    fn new(n: usize) -> Adam {
        Adam { m: vec![0.0; n], v: vec![0.0; n] }
    }

    fn step(&mut self, x: &mut [f64], g: &[f64], lr: f64, t: i32) {
        const B1: f64 = 0.9;
        const B2: f64 = 0.999;
        let (c1, c2) = (1.0 - B1.powi(t), 1.0 - B2.powi(t));
        for i in 0..x.len() {
            self.m[i] = B1 * self.m[i] + (1.0 - B1) * g[i];
            self.v[i] = B2 * self.v[i] + (1.0 - B2) * g[i] * g[i];
            x[i] -= lr * (self.m[i] / c1) / ((self.v[i] / c2).sqrt() + 1e-12);
        }
    }
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// Pull of `x` (log-parameters) towards `means[group(i)]`, added to `g`.
fn shrink_to(x: &[f64], group: impl Fn(usize) -> usize, means: &[f64], lambda: f64, g: &mut [f64]) {
    for i in 0..x.len() {
        g[i] += 2.0 * lambda * (x[i] - means[group(i)]);
    }
}

/// Pull of each package's mean target log-cost (`pkg_mean`, over `pkg_n` targets)
/// towards the mean of its top directory's packages (the repository's for a package at
/// the root), added to the gradient `g` of each of its targets. Costs scale with their
/// subtree, so a top directory's packages are the nearest peers a prior can pool.
fn package_prior(index: &Index, pkg_mean: &[f64], pkg_n: &[usize], lambda: f64, g: &mut [f64]) {
    if lambda == 0.0 {
        return;
    }
    let top = |p: usize| index.pkg_dirs[p].last().map(|&d| d as usize);
    let mut sums = vec![(0.0, 0usize); index.dirs.len()];
    for (p, &m) in pkg_mean.iter().enumerate() {
        if let Some(d) = top(p) {
            sums[d].0 += m;
            sums[d].1 += 1;
        }
    }
    let root = mean(pkg_mean.iter().copied());
    for (t, &p) in index.target_pkg.iter().enumerate() {
        let p = p as usize;
        let centre = top(p).map_or(root, |d| sums[d].0 / sums[d].1 as f64);
        g[t] += 2.0 * lambda * (pkg_mean[p] - centre) / pkg_n[p].max(1) as f64;
    }
}

/// `(S, base, Σθ)` of a row under the given parameters.
fn row_terms(r: &Row, w: &[f64], u: &[f64], v: &[f64], b: &[f64], theta: &[f64]) -> (f64, f64, f64) {
    let s = r.t.iter().map(|&i| w[i as usize]).sum::<f64>()
        + r.p.iter().map(|&i| u[i as usize]).sum::<f64>()
        + if v.is_empty() { 0.0 } else { r.d.iter().map(|&i| v[i as usize]).sum::<f64>() };
    let base = r.f.iter().map(|&i| b[i as usize]).sum();
    let th = r.f.iter().map(|&i| theta[i as usize]).sum();
    (s.max(1e-12), base, th)
}

impl Part {
    /// Fits one part on `rows` with labels `y` (`(ln label, censored)`, `None` to skip).
    fn fit(
        index: &Index,
        rows: &[&Row],
        y: &dyn Fn(&Row) -> Option<(f64, bool)>,
        spec: PartSpec,
        shrink: f64,
        cfg: &SharedConfig,
    ) -> Part {
        let (nt, np, nf) = (index.targets.len(), index.pkgs.len(), index.feats.len());
        let nd = if spec.dirs { index.dirs.len() } else { 0 };
        let rows: Vec<(&Row, f64, bool)> = rows.iter().filter_map(|r| y(r).map(|(l, c)| (*r, l, c))).collect();
        // Start from an even split of the mean build over its pieces.
        let mean_y = mean(rows.iter().map(|r| r.1.exp()));
        let mean_n =
            mean(rows.iter().map(|(r, _, _)| (r.t.len() + r.p.len() + if spec.dirs { r.d.len() } else { 0 }) as f64));
        let start = (0.5 * mean_y / mean_n.max(1.0)).max(1e-9).ln();
        // Targets start a tenth as costly as the shared pieces: a cost that every target
        // of a package shares is the package's until the data says otherwise, since a
        // history that mostly builds whole packages barely tells the two apart.
        let mut lw = vec![start - 10f64.ln(); nt];
        let mut lu = vec![start; np];
        let mut lv = vec![start; nd];
        let mut lb = vec![(1e-3 * mean_y).max(1e-9).ln(); nf];
        if let Some(&b) = index.feats.get("bias") {
            lb[b as usize] = (0.3 * mean_y).max(1e-9).ln();
        }
        let mut theta = vec![0.0; nf];
        let mut power = 1.0f64;
        let (mut aw, mut au, mut av, mut ab, mut at, mut ap) =
            (Adam::new(nt), Adam::new(np), Adam::new(nd), Adam::new(nf), Adam::new(nf), Adam::new(1));
        let total_weight: f64 = rows.iter().map(|(r, _, _)| 1.0 + cfg.size_weight * r.t.len() as f64).sum();
        let delta = cfg.huber_delta;
        let lambda = shrink * 100.0 / rows.len().max(1) as f64;
        for it in 1..=cfg.iterations {
            let exp = |x: &Vec<f64>| -> Vec<f64> { x.iter().map(|x| x.exp()).collect() };
            let (w, u, v, b) = (exp(&lw), exp(&lu), exp(&lv), exp(&lb));
            let (mut gw, mut gu, mut gv, mut gb, mut gt) =
                (vec![0.0; nt], vec![0.0; np], vec![0.0; nd], vec![0.0; nf], vec![0.0; nf]);
            let mut gp = 0.0;
            for &(r, label, censored) in &rows {
                let (s, base, th) = row_terms(r, &w, &u, &v, &b, &theta);
                let sa = s.powf(power);
                let inner = base + sa;
                let res = label - th - inner.ln();
                // On the noisy side, beyond delta, a residual pulls linearly.
                let noisy = match spec.side {
                    TrustedSide::Lower => res > delta,
                    TrustedSide::Upper => res < -delta,
                };
                let dres = if censored {
                    2.0 * res.max(0.0)
                } else if noisy {
                    2.0 * delta * res.signum()
                } else {
                    2.0 * res
                };
                if dres == 0.0 {
                    continue;
                }
                // d loss / d ln(estimate) = -d loss / d residual.
                let g = -dres * (1.0 + cfg.size_weight * r.t.len() as f64) / total_weight;
                let ds = g * power * sa / s / inner;
                for &i in &r.t {
                    gw[i as usize] += ds * w[i as usize];
                }
                for &i in &r.p {
                    gu[i as usize] += ds * u[i as usize];
                }
                if spec.dirs {
                    for &i in &r.d {
                        gv[i as usize] += ds * v[i as usize];
                    }
                }
                for &i in &r.f {
                    gb[i as usize] += g * b[i as usize] / inner;
                    gt[i as usize] += g;
                }
                gp += g * sa * s.ln() / inner;
            }
            // Shrinkage: a target towards its package's targets, the rest towards their kind.
            let mut pkg_mean = vec![0.0; np];
            let mut pkg_n = vec![0usize; np];
            for (t, &p) in index.target_pkg.iter().enumerate() {
                pkg_mean[p as usize] += lw[t];
                pkg_n[p as usize] += 1;
            }
            for p in 0..np {
                pkg_mean[p] /= pkg_n[p].max(1) as f64;
            }
            shrink_to(&lw, |t| index.target_pkg[t] as usize, &pkg_mean, lambda, &mut gw);
            package_prior(index, &pkg_mean, &pkg_n, cfg.package_prior / total_weight, &mut gw);
            shrink_to(&lu, |_| 0, &[mean(lu.iter().copied())], lambda, &mut gu);
            shrink_to(&lv, |_| 0, &[mean(lv.iter().copied())], lambda, &mut gv);
            let (lr, t) = (cfg.learning_rate, it as i32);
            aw.step(&mut lw, &gw, lr, t);
            au.step(&mut lu, &gu, lr, t);
            av.step(&mut lv, &gv, lr, t);
            ab.step(&mut lb, &gb, lr, t);
            at.step(&mut theta, &gt, lr * 0.2, t);
            if spec.power {
                let mut pw = [power];
                ap.step(&mut pw, &[gp], lr * 0.05, t);
                power = pw[0].clamp(0.7, 1.3);
            }
        }
        let mut part = Part {
            w: lw.iter().map(|x| x.exp()).collect(),
            u: lu.iter().map(|x| x.exp()).collect(),
            v: lv.iter().map(|x| x.exp()).collect(),
            theta,
            beta: lb.iter().map(|x| x.exp()).collect(),
            power,
            pkg_unseen_target: Vec::new(),
            dir_target_mean: Vec::new(),
            dir_pkg_mean: Vec::new(),
            depth_dir_mean: Vec::new(),
            unseen_target: 0.0,
            unseen_pkg: 0.0,
            unseen_dir: 0.0,
            centre: 1.0,
            error: None,
        };
        part.unseen_means(index, cfg.prior_count);
        part
    }

    /// Costs of pieces training never saw: the mean (not the median) of their kind,
    /// heavy tails and all, and for a package the means under its nearest seen
    /// ancestor, since costs scale with their subtree (a heavy directory's packages are
    /// heavy).
    fn unseen_means(&mut self, index: &Index, prior_count: f64) {
        let (np, nd) = (index.pkgs.len(), index.dirs.len());
        self.unseen_target = mean(self.w.iter().copied());
        self.unseen_pkg = mean(self.u.iter().copied());
        self.unseen_dir = mean(self.v.iter().copied());
        let (mut sum, mut cnt) = (vec![0.0; np], vec![0usize; np]);
        let (mut ts, mut tc, mut ps, mut pc) = (vec![0.0; nd], vec![0usize; nd], vec![0.0; nd], vec![0usize; nd]);
        for (t, &p) in index.target_pkg.iter().enumerate() {
            sum[p as usize] += self.w[t];
            cnt[p as usize] += 1;
            for &d in &index.pkg_dirs[p as usize] {
                ts[d as usize] += self.w[t];
                tc[d as usize] += 1;
            }
        }
        for (p, dirs) in index.pkg_dirs.iter().enumerate() {
            for &d in dirs {
                ps[d as usize] += self.u[p];
                pc[d as usize] += 1;
            }
        }
        // A mean over few members leans on its parent's: `prior_count` members at the
        // parent's mean are added to each. A directory's parent is the whole
        // repository, a package's its nearest directory.
        let avg = |s: &[f64], c: &[usize], i: usize, parent: f64| {
            let n = c[i] as f64 + prior_count;
            if n > 0.0 {
                (s[i] + prior_count * parent) / n
            } else {
                parent
            }
        };
        self.dir_target_mean = (0..nd).map(|d| avg(&ts, &tc, d, self.unseen_target)).collect();
        self.dir_pkg_mean = (0..nd).map(|d| avg(&ps, &pc, d, self.unseen_pkg)).collect();
        let parent =
            |p: usize| index.pkg_dirs[p].first().map_or(self.unseen_target, |&d| self.dir_target_mean[d as usize]);
        self.pkg_unseen_target = (0..np).map(|p| avg(&sum, &cnt, p, parent(p))).collect();
        let mut depth: Vec<(f64, usize)> = Vec::new();
        if !self.v.is_empty() {
            // In index order, not the map's: the same history sums the same way.
            let mut dirs: Vec<(&String, &u32)> = index.dirs.iter().collect();
            dirs.sort_by_key(|(_, d)| **d);
            for (name, &d) in dirs {
                let k = name.matches('/').count();
                if depth.len() <= k {
                    depth.resize(k + 1, (0.0, 0));
                }
                depth[k].0 += self.v[d as usize];
                depth[k].1 += 1;
            }
        }
        self.depth_dir_mean = depth.iter().map(|&(s, n)| if n > 0 { s / n as f64 } else { self.unseen_dir }).collect();
    }

    /// `ln(estimate)` of a training row, uncentred.
    fn log_predict(&self, r: &Row) -> f64 {
        let (s, base, th) = row_terms(r, &self.w, &self.u, &self.v, &self.beta, &self.theta);
        th + (base + s.powf(self.power)).ln()
    }

    /// Centres the part on large held-out builds and reads their spread for the margin.
    fn calibrate(&mut self, rows: &[&Row], y: &dyn Fn(&Row) -> Option<(f64, bool)>, side: TrustedSide, min: f64) {
        // (log estimate, residual), largest first.
        let mut pairs: Vec<(f64, f64)> = rows
            .iter()
            .filter_map(|r| {
                let est = self.log_predict(r);
                y(r).filter(|(_, censored)| !censored).map(|(l, _)| (est, l - est))
            })
            .collect();
        pairs.sort_by(|a, b| b.0.total_cmp(&a.0));
        let keep = pairs.iter().take_while(|p| p.0 >= min.ln()).count().max(60);
        let mut res: Vec<f64> = pairs.into_iter().take(keep).map(|p| p.1).collect();
        res.sort_by(f64::total_cmp);
        if let Some(&mid) = res.get(res.len() / 2) {
            self.centre = mid.exp();
            let centred: Vec<f64> = res.iter().map(|x| x - mid).collect();
            self.error = ErrorModel::fit(&centred, side);
        }
    }

    /// A target's own cost and its package's: learned, or for one training never saw,
    /// its package's mean target, else its nearest seen ancestor's means.
    fn target_terms(&self, known: &Known) -> (f64, f64) {
        if let Some(p) = known.pkg {
            let w = known.target.map_or(self.pkg_unseen_target[p as usize], |t| self.w[t as usize]);
            return (w, self.u[p as usize]);
        }
        match known.nearest_dir {
            Some(d) => (self.dir_target_mean[d as usize], self.dir_pkg_mean[d as usize]),
            None => (self.unseen_target, self.unseen_pkg),
        }
    }

    /// A directory's cost: learned, or the mean of the seen ones as deep.
    fn dir_cost(&self, dir: &KnownDir) -> f64 {
        if self.v.is_empty() {
            return 0.0;
        }
        match dir.id {
            Some(d) => self.v[d as usize],
            None => self.depth_dir_mean.get(dir.depth).copied().unwrap_or(self.unseen_dir),
        }
    }

    /// `(multiplier, base)` of a context, as estimates use it (recent), centred.
    fn context_terms(&self, index: &Index, ctx: &BuildContext) -> (f64, f64) {
        let (mut th, mut b) = (0.0, 0.0);
        for k in context_features(ctx, true) {
            if let Some(&i) = index.feats.get(&k) {
                th += self.theta[i as usize];
                b += self.beta[i as usize];
            }
        }
        (th.exp() * self.centre, b)
    }
}

const MEMORY: PartSpec = PartSpec { side: TrustedSide::Lower, dirs: true, power: true };
const OCCUPANCY: PartSpec = PartSpec { side: TrustedSide::Upper, dirs: false, power: false };

impl SharedModel {
    /// Trains on `history`, with `now` for the `recent` feature.
    pub fn train<'r>(
        history: impl IntoIterator<Item = &'r BuildRecord>,
        cfg: &SharedConfig,
        now: Timestamp,
    ) -> Result<SharedModel> {
        let recent_since = now.0 - (cfg.recent_days * 86_400.0).round() as i64;
        let cut = (cfg.validation_fraction * 1_000_000.0) as u64;
        let mut index = Index::default();
        let mut rows = Vec::new();
        for r in history {
            // Only builds whose usage says something about their targets: one cut short
            // for another reason (a lost executor, a Bazel crash) says nothing.
            let censored = r.outcome == Outcome::Oom;
            if !(censored || r.outcome == Outcome::Success || r.outcome == Outcome::Failed) || r.peak_memory_bytes == 0
            {
                continue;
            }
            let mut row = Row {
                t: Vec::with_capacity(r.targets.len()),
                p: Vec::new(),
                d: Vec::new(),
                f: Vec::new(),
                memory: (r.peak_memory_bytes as f64 / GB).ln(),
                censored,
                occupancy: r.occupancy_esu().filter(|&o| o > 0.0 && !censored).map(f64::ln),
                valid: crate::features::fnv1a(r.id.as_bytes()) % 1_000_000 < cut,
            };
            for raw in &r.targets {
                let Ok(label) = parse_label(raw) else { continue };
                let p = intern(&mut index.pkgs, label.package());
                if p as usize == index.pkg_dirs.len() {
                    let dirs = label.ancestors().map(|a| intern(&mut index.dirs, a)).collect();
                    index.pkg_dirs.push(dirs);
                }
                let t = intern(&mut index.targets, &label.canonical());
                if t as usize == index.target_pkg.len() {
                    index.target_pkg.push(p);
                }
                row.t.push(t);
                row.p.push(p);
                row.d.extend_from_slice(&index.pkg_dirs[p as usize]);
            }
            if row.t.is_empty() {
                continue;
            }
            for x in [&mut row.t, &mut row.p, &mut row.d] {
                x.sort_unstable();
                x.dedup();
            }
            row.f = context_features(&r.context(), r.time.0 >= recent_since)
                .iter()
                .map(|k| intern(&mut index.feats, k))
                .collect();
            rows.push(row);
        }
        let (valid, train): (Vec<&Row>, Vec<&Row>) = rows.iter().partition(|r| r.valid);
        // The fit sees only a history group's sum; how it splits, shrinkage spreads.
        index.target_group =
            crate::features::build_set_ids(index.targets.len(), train.iter().map(|r| r.t.iter().map(|&t| t as usize)));
        if train.len() < 10 {
            return Err(BatchError::Training(format!("{} usable builds: too few to train on", train.len())));
        }
        let mem = |r: &Row| Some((r.memory, r.censored));
        let occ = |r: &Row| r.occupancy.map(|o| (o, false));
        let mut memory = Part::fit(&index, &train, &mem, MEMORY, cfg.shrink, cfg);
        memory.calibrate(&valid, &mem, MEMORY.side, cfg.calibration_min[0]);
        let mut occupancy = Part::fit(&index, &train, &occ, OCCUPANCY, cfg.occupancy_shrink, cfg);
        occupancy.calibrate(&valid, &occ, OCCUPANCY.side, cfg.calibration_min[1]);
        Ok(SharedModel { index, memory, occupancy })
    }

    /// The held-out error models of memory and occupancy.
    pub fn errors(&self) -> (Option<ErrorModel>, Option<ErrorModel>) {
        (self.memory.error, self.occupancy.error)
    }

    /// The fitted memory exponent `a` (for reports).
    pub fn power(&self) -> f64 {
        self.memory.power
    }

    /// The share of `labels` whose target training saw (for reports).
    pub fn seen_share(&self, labels: &[&str]) -> f64 {
        let seen = labels
            .iter()
            .filter(|l| parse_label(l).is_ok_and(|l| self.index.targets.contains_key(l.canonical().as_ref())))
            .count();
        seen as f64 / labels.len().max(1) as f64
    }

    /// The (uncorrected) memory estimate of one build, in bytes.
    pub fn predict(&self, ctx: &BuildContext, labels: &[&str]) -> Result<f64> {
        self.estimate(ctx, labels).map(|(memory, _)| memory)
    }

    /// The (uncorrected) memory (bytes) and occupancy (ESU) estimates of one build.
    pub fn estimate(&self, ctx: &BuildContext, labels: &[&str]) -> Result<(f64, f64)> {
        let (mut g, n) = crate::planner::build_group(self, ctx, labels)?;
        Ok((g.memory_bytes(n)?, g.occupancy_esu(n)?))
    }
}

/// Per-target terms of a [`SharedGroup`]'s queue, per part (memory, occupancy).
struct Terms {
    /// Its history group (0: none).
    group: u64,
    /// Its cost with its package's and all its directories' (a window's first target).
    full: [f64; 2],
    /// Cumulative cost of the queue up to it, counting each package and directory at
    /// its first target (labels arrive sorted, so a package's targets are adjacent).
    cum: [f64; 2],
}

/// The per-group state of a [`SharedModel`].
pub struct SharedGroup<'a> {
    model: &'a SharedModel,
    /// Per part: the context's multiplier and base.
    context: [(f64, f64); 2],
    terms: VecDeque<Terms>,
    /// The previous target's package ("" before the first).
    prev_pkg: String,
    cum: [f64; 2],
}

/// What the index knows of one label: looked up once, priced by each part.
struct Known {
    target: Option<u32>,
    pkg: Option<u32>,
    /// For a package training never saw: its nearest seen ancestor directory.
    nearest_dir: Option<u32>,
    /// Its ancestor directories, deepest first.
    dirs: Vec<KnownDir>,
}

struct KnownDir {
    id: Option<u32>,
    depth: usize,
    /// Not an ancestor of the previous target's package: first charged here.
    new: bool,
}

impl Known {
    fn of(index: &Index, label: &Label<'_>, prev_pkg: &str) -> Known {
        let pkg = index.pkgs.get(label.package()).copied();
        let dirs: Vec<KnownDir> = label
            .ancestors()
            .map(|a| KnownDir {
                id: index.dirs.get(a).copied(),
                depth: a.matches('/').count(),
                new: !(prev_pkg.len() > a.len() && prev_pkg.starts_with(a) && prev_pkg.as_bytes()[a.len()] == b'/'),
            })
            .collect();
        Known {
            target: index.targets.get(label.canonical().as_ref()).copied(),
            pkg,
            nearest_dir: if pkg.is_none() { dirs.iter().find_map(|d| d.id) } else { None },
            dirs,
        }
    }
}

impl Estimator for SharedModel {
    type Group<'a> = SharedGroup<'a>;

    fn group<'a>(&'a self, ctx: &BuildContext) -> SharedGroup<'a> {
        SharedGroup {
            model: self,
            context: [self.memory.context_terms(&self.index, ctx), self.occupancy.context_terms(&self.index, ctx)],
            terms: VecDeque::new(),
            prev_pkg: String::new(),
            cum: [0.0; 2],
        }
    }
}

impl SharedGroup<'_> {
    fn window(&self, part: usize, len: usize) -> Result<f64> {
        if len == 0 || len > self.terms.len() {
            return Err(BatchError::Estimate(format!("prefix length {len} outside queue of {}", self.terms.len())));
        }
        let (first, last) = (&self.terms[0], &self.terms[len - 1]);
        let s = (first.full[part] + last.cum[part] - first.cum[part]).max(1e-12);
        let power = [&self.model.memory, &self.model.occupancy][part].power;
        let (mult, base) = self.context[part];
        Ok(mult * (base + s.powf(power)))
    }
}

impl GroupEstimator for SharedGroup<'_> {
    fn push(&mut self, label: &Label<'_>) {
        let m = self.model;
        let known = Known::of(&m.index, label, &self.prev_pkg);
        let same_pkg = self.prev_pkg == label.package();
        let mut full = [0.0; 2];
        for (k, part) in [&m.memory, &m.occupancy].into_iter().enumerate() {
            let (w, u) = part.target_terms(&known);
            full[k] = w + u + known.dirs.iter().map(|d| part.dir_cost(d)).sum::<f64>();
            self.cum[k] += if same_pkg {
                w
            } else {
                w + u + known.dirs.iter().filter(|d| d.new).map(|d| part.dir_cost(d)).sum::<f64>()
            };
        }
        let group = known.target.and_then(|t| m.index.target_group.get(t as usize)).copied().unwrap_or(0);
        self.terms.push_back(Terms { group, full, cum: self.cum });
        self.prev_pkg.clear();
        self.prev_pkg.push_str(label.package());
    }

    fn pop_front(&mut self, n: usize) {
        self.terms.drain(..n.min(self.terms.len()));
    }

    fn memory_bytes(&mut self, len: usize) -> Result<f64> {
        Ok(GB * self.window(0, len)?)
    }

    fn occupancy_esu(&mut self, len: usize) -> Result<f64> {
        self.window(1, len)
    }

    fn errors(&self) -> (Option<ErrorModel>, Option<ErrorModel>) {
        self.model.errors()
    }

    fn cost_group(&self, i: usize) -> Option<u64> {
        self.terms.get(i).map(|t| t.group).filter(|&g| g != 0)
    }
}
