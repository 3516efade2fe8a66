//! Simulation: a seeded synthetic monorepo workload with a hidden ground
//! truth, used to tune and score the planner end to end (and, later, by
//! `gantry bench batch --simulate`), plus the 10M-target speed benchmark.
//!
//! The world:
//! * a directory tree of packages; sibling directory names like `core` and
//!   `core2` exist on purpose, so sorted order interleaves subtrees;
//! * per-target memory and executor costs with heavy tails, per-package and
//!   per-directory shared costs (the dependencies neighbours share), so a
//!   build's memory is sub-additive in its targets, and a per-top-directory
//!   weight so some subtrees are much heavier than others;
//! * tools and users sending very different target sets (tiny presubmits,
//!   900-target postsubmit slices, coverage with a memory-hungry flag, flaky
//!   detection with `--runs_per_test`, optimised release builds);
//! * a Bazel memory regression during the last day before `now`, which the
//!   short-window memory model is there to catch.
//!
//! [`GroundTruth::truth`] is the hidden function giving a build's real peak
//! heap and occupancy. History records add measurement noise to it (builds
//! that never ran a full GC report up to 1.8x more, cache hits report
//! almost no occupancy, OOM builds report about the allocation). Models are
//! trained on that history only; scoring uses the truth.

use crate::error::Result;
use crate::feedback::{Corrected, Ended, Feedback};
use crate::history::{BuildRecord, Outcome, Timestamp, SECONDS_PER_DAY};
use crate::label::Label;
use crate::model::{train, Models, TrainConfig};
use crate::planner::{plan, Estimator, GroupEstimator, StreamingPlanner};
use crate::types::{Batch, BatchSizeReason, BuildContext, Command, PlannerConfig, Priority, Target, GB};
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::time::Instant;

/// Size and shape of a simulation run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SimConfig {
    pub seed: u64,
    pub top_dirs: usize,
    /// Expected number of packages.
    pub packages: usize,
    /// Mean targets per package.
    pub mean_targets_per_package: f64,
    pub history_days: usize,
    pub builds_per_day: usize,
    /// Memory multiplier of the Bazel regression in the last day.
    pub regression: f64,
    /// Multiplier of every target's own memory: a heavier repository (bigger
    /// targets, fewer per build) with the same structure.
    pub target_memory_scale: f64,
    /// The power of a build's summed analysis cost in its memory: below 1, large
    /// analysis graphs compact better (sub-additive beyond the shared costs).
    pub analysis_power: f64,
    /// Fraction of packages that are new: none of their targets appear in the
    /// history, all of them may appear in the evaluation streams (the shift
    /// between training and scoring data).
    pub new_package_fraction: f64,
    /// One-sided label noise: this fraction of successful builds never ran a
    /// full GC and report a peak up to `label_noise_max` times the real one.
    pub label_noise_fraction: f64,
    pub label_noise_max: f64,
    /// Size range of the large evaluation streams (postsubmit, coverage,
    /// release): unions of subtrees until the drawn size is reached.
    pub large_stream_targets: (usize, usize),
    /// Evaluation: number of small request streams (presubmit/human/flaky).
    pub eval_small_streams: usize,
    /// Evaluation: number of large streams (postsubmit/coverage/release).
    pub eval_large_streams: usize,
    pub now: Timestamp,
    pub train: TrainConfig,
    pub planner: PlannerConfig,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            seed: 7,
            top_dirs: 12,
            packages: 3000,
            mean_targets_per_package: 7.0,
            history_days: 17,
            builds_per_day: 700,
            regression: 1.12,
            target_memory_scale: 1.0,
            analysis_power: 0.93,
            new_package_fraction: 0.05,
            label_noise_fraction: 0.03,
            label_noise_max: 1.8,
            large_stream_targets: (4000, 15000),
            eval_small_streams: 3000,
            eval_large_streams: 150,
            // 2020-02-19T00:00:00Z, the end of the design's experiment.
            now: Timestamp(1_582_070_400),
            train: TrainConfig::default(),
            planner: PlannerConfig::default(),
        }
    }
}

/// The workloads of [`SimConfig::workload`]: the default; target memory ×1.5 and
/// ×0.6; memory additive in the analysis cost and more sub-additive than the
/// default; a tenth of the labels reading up to 2.5× high; three times as many
/// packages new to the streams; a last-day regression of 1.3 instead of 1.12.
pub const WORKLOADS: [&str; 8] =
    ["default", "heavy", "light", "additive", "compact", "noisy", "new-code", "regression"];

impl SimConfig {
    /// The workload of [`compare`]: 17 days of history, then 36 held-out
    /// postsubmit, coverage and release streams of 4,000 to 15,000 targets
    /// from a repository of about 42,000 targets.
    pub fn large_streams() -> Self {
        SimConfig { packages: 6000, eval_small_streams: 0, eval_large_streams: 36, ..SimConfig::default() }
    }

    /// A named workload of [`compare`]: [`SimConfig::large_streams`] (`default`), or a
    /// shift of it that no learner was shaped on (see [`WORKLOADS`]). `None` for an
    /// unknown name.
    pub fn workload(name: &str) -> Option<Self> {
        let base = SimConfig::large_streams();
        Some(match name {
            "default" => base,
            "heavy" => SimConfig { target_memory_scale: 1.5, ..base },
            "light" => SimConfig { target_memory_scale: 0.6, ..base },
            "additive" => SimConfig { analysis_power: 1.0, ..base },
            "compact" => SimConfig { analysis_power: 0.85, ..base },
            "noisy" => SimConfig { label_noise_fraction: 0.10, label_noise_max: 2.5, ..base },
            "new-code" => SimConfig { new_package_fraction: 0.15, ..base },
            "regression" => SimConfig { regression: 1.3, ..base },
            _ => return None,
        })
    }

    /// A configuration small enough for unit tests (a few seconds).
    pub fn small() -> Self {
        SimConfig {
            packages: 600,
            builds_per_day: 250,
            eval_small_streams: 300,
            eval_large_streams: 25,
            train: TrainConfig {
                hash_bits: 16,
                cross_search_max_examples: 800,
                max_crosses: 2,
                epochs: 6,
                ..TrainConfig::default()
            },
            ..SimConfig::default()
        }
    }
}

fn normal(rng: &mut ChaCha8Rng) -> f64 {
    // Box-Muller; rand_distr is not among the allowed dependencies.
    let u1: f64 = rng.random::<f64>().max(1e-12);
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

fn lognormal(rng: &mut ChaCha8Rng, median: f64, sigma: f64) -> f64 {
    median * (sigma * normal(rng)).exp()
}

/// A measured occupancy: noisy, and a share of builds are served from the action cache
/// and read far low.
fn occupancy_label(rng: &mut ChaCha8Rng, truth: f64) -> f64 {
    let occ = truth * lognormal(rng, 1.0, 0.1);
    if rng.random::<f64>() < 0.05 {
        occ * 0.05
    } else {
        occ
    }
}

/// Pareto tail sample with scale `xm` and shape `alpha`, capped.
fn pareto(rng: &mut ChaCha8Rng, xm: f64, alpha: f64, cap: f64) -> f64 {
    let u: f64 = rng.random::<f64>().max(1e-12);
    (xm / u.powf(1.0 / alpha)).min(cap)
}

const WORDS: [&str; 16] = [
    "core", "util", "net", "storage", "ui", "ads", "search", "maps", "infra", "ml", "base", "api", "proto", "server",
    "client", "tools",
];

/// The synthetic monorepo and its hidden costs.
#[derive(Debug, Clone)]
pub struct GroundTruth {
    /// All labels, sorted.
    pub labels: Vec<String>,
    index: HashMap<String, u32>,
    target_pkg: Vec<u32>,
    target_mem: Vec<f64>,
    target_esu: Vec<f64>,
    pkg_mem: Vec<f64>,
    pkg_esu: Vec<f64>,
    /// Directory ids of each package's ancestors (excluding the package).
    pkg_dirs: Vec<Vec<u32>>,
    dir_mem: Vec<f64>,
    /// Target ids under each directory (including sub-packages), sorted.
    dir_targets: Vec<Vec<u32>>,
    /// Depth (1 = top level) of each directory.
    dir_depth: Vec<u32>,
    /// The top-level directory each directory is under (itself at depth 1).
    dir_top: Vec<u32>,
    /// Packages that the history never saw (see `SimConfig::new_package_fraction`).
    pkg_new: Vec<bool>,
    /// Each package's subtree weight (every cost under a top directory scales with it).
    pkg_weight: Vec<f64>,
    regression: f64,
    analysis_power: f64,
}

/// The resource usage of one build according to the ground truth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    pub memory_bytes: f64,
    pub occupancy_esu: f64,
}

struct Marks {
    stamp: u32,
    pkg: Vec<u32>,
    dir: Vec<u32>,
}

impl GroundTruth {
    /// Generate a repository.
    pub fn generate(cfg: &SimConfig, rng: &mut ChaCha8Rng) -> GroundTruth {
        // Directory tree: top dirs, then children until packages are placed.
        let mut dir_names: Vec<String> = Vec::new();
        let mut dir_depth = Vec::new();
        let mut dir_parent: Vec<Option<u32>> = Vec::new();
        let mut dir_weight = Vec::new();
        for i in 0..cfg.top_dirs {
            let w = WORDS[i % WORDS.len()];
            let name = if i < WORDS.len() { w.to_string() } else { format!("{w}{}", i / WORDS.len()) };
            dir_names.push(format!("//{name}"));
            dir_depth.push(1);
            dir_parent.push(None);
            // Some subtrees are much heavier than others.
            dir_weight.push(lognormal(rng, 0.8, 0.45).min(2.5));
        }
        // Packages are directories at depth 2..=4.
        struct Pkg {
            path: String,
            dir: u32,
        }
        let mut pkgs: Vec<Pkg> = Vec::new();
        let mut frontier: Vec<u32> = (0..cfg.top_dirs as u32).collect();
        while pkgs.len() < cfg.packages {
            let parent = *frontier.choose(rng).expect("top dirs > 0");
            let pdepth = dir_depth[parent as usize];
            let word = WORDS[rng.random_range(0..WORDS.len())];
            let suffix: u32 = rng.random_range(0..30);
            // `core` and `core2` style siblings interleave in sort order.
            let name = if suffix < 10 { word.to_string() } else { format!("{word}{}", suffix % 12) };
            let path = format!("{}/{}", dir_names[parent as usize], name);
            if dir_names.contains(&path) {
                continue;
            }
            let id = dir_names.len() as u32;
            dir_names.push(path.clone());
            dir_depth.push(pdepth + 1);
            dir_parent.push(Some(parent));
            dir_weight.push(dir_weight[parent as usize]);
            if pdepth + 1 >= 2 {
                pkgs.push(Pkg { path, dir: id });
            }
            if pdepth + 1 < 4 {
                frontier.push(id);
            }
        }
        let ndirs = dir_names.len();
        let dir_top: Vec<u32> = (0..ndirs as u32)
            .map(|mut d| {
                while let Some(p) = dir_parent[d as usize] {
                    d = p;
                }
                d
            })
            .collect();
        let pkg_new: Vec<bool> = pkgs.iter().map(|_| rng.random::<f64>() < cfg.new_package_fraction).collect();
        let dir_mem: Vec<f64> = (0..ndirs)
            .map(|d| {
                let depth = dir_depth[d] as f64;
                dir_weight[d] * lognormal(rng, 90e6 / depth, 0.6)
            })
            .collect();
        // Targets.
        let mut raw: Vec<(String, u32, f64, f64)> = Vec::new();
        let mut pkg_mem = Vec::new();
        let mut pkg_esu = Vec::new();
        let mut pkg_dirs = Vec::new();
        let pkg_weight: Vec<f64> = pkgs.iter().map(|p| dir_weight[p.dir as usize]).collect();
        for (pi, p) in pkgs.iter().enumerate() {
            let w = pkg_weight[pi];
            pkg_mem.push(w * lognormal(rng, 22e6, 0.7));
            pkg_esu.push(lognormal(rng, 0.15, 0.8));
            let mut anc = Vec::new();
            let mut cur = dir_parent[p.dir as usize];
            while let Some(c) = cur {
                anc.push(c);
                cur = dir_parent[c as usize];
            }
            pkg_dirs.push(anc);
            let geo_p = 1.0 / cfg.mean_targets_per_package;
            let mut n = 1;
            while rng.random::<f64>() > geo_p && n < 80 {
                n += 1;
            }
            for t in 0..n {
                let kind = ["lib", "test", "bin", "proto"][rng.random_range(0..4)];
                let label = format!("{}:{}_{}", p.path, kind, t);
                let mem = if rng.random::<f64>() < 0.012 {
                    pareto(rng, 120e6, 1.3, 1.5e9)
                } else {
                    lognormal(rng, 3.5e6, 0.9)
                } * w
                    * cfg.target_memory_scale;
                let esu =
                    if rng.random::<f64>() < 0.02 { pareto(rng, 4.0, 1.2, 80.0) } else { lognormal(rng, 0.12, 1.1) };
                raw.push((label, pi as u32, mem, esu));
            }
        }
        raw.sort_by(|a, b| a.0.cmp(&b.0));
        raw.dedup_by(|a, b| a.0 == b.0);
        let mut dir_targets = vec![Vec::new(); ndirs];
        let mut index = HashMap::with_capacity(raw.len());
        for (i, r) in raw.iter().enumerate() {
            index.insert(r.0.clone(), i as u32);
            let p = r.1 as usize;
            dir_targets[pkgs[p].dir as usize].push(i as u32);
            for &d in &pkg_dirs[p] {
                dir_targets[d as usize].push(i as u32);
            }
        }
        GroundTruth {
            index,
            target_pkg: raw.iter().map(|r| r.1).collect(),
            target_mem: raw.iter().map(|r| r.2).collect(),
            target_esu: raw.iter().map(|r| r.3).collect(),
            labels: raw.into_iter().map(|r| r.0).collect(),
            pkg_mem,
            pkg_esu,
            pkg_dirs,
            dir_mem,
            dir_targets,
            dir_depth,
            dir_top,
            pkg_new,
            pkg_weight,
            regression: cfg.regression,
            analysis_power: cfg.analysis_power,
        }
    }

    /// The truth as a perfect learner of the history could know it, a bound for any
    /// learner: every cost of the packages the history built is exact (and so are the
    /// users', the flags' and the regression's), while a package it never saw, and
    /// each of its targets, is charged the mean of the seen ones scaled by its
    /// subtree's weight. Planned with it, the held-out streams show how much of a
    /// learner's gap to the oracle the history's information leaves (`oracle-seen` in
    /// [`compare`]).
    pub fn seen_view(&self) -> GroundTruth {
        let mut v = self.clone();
        let mean = |xs: Vec<f64>| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
        let n = self.target_mem.len();
        let (tm, te) = self.target_prior(|i| !self.pkg_new[self.target_pkg[i] as usize]);
        let np = self.pkg_mem.len();
        let pm = mean((0..np).filter(|&p| !self.pkg_new[p]).map(|p| self.pkg_mem[p] / self.pkg_weight[p]).collect());
        let pe = mean((0..np).filter(|&p| !self.pkg_new[p]).map(|p| self.pkg_esu[p]).collect());
        for i in 0..n {
            let p = self.target_pkg[i] as usize;
            if self.pkg_new[p] {
                v.target_mem[i] = tm * self.pkg_weight[p];
                v.target_esu[i] = te;
            }
        }
        for p in 0..np {
            if self.pkg_new[p] {
                v.pkg_mem[p] = pm * self.pkg_weight[p];
                v.pkg_esu[p] = pe;
            }
        }
        v
    }

    /// The truth as far as `history` tells targets apart, a tighter bound than
    /// [`GroundTruth::seen_view`]: a learner sees a target only through the builds that
    /// held it, so targets held by exactly the same builds can be told apart by none,
    /// and only their sum is known. Each of them is charged their mean; a target no build
    /// held is charged the mean of the built ones (scaled by its subtree's weight), and a
    /// package the history never saw is charged as in the seen view. Everything else is
    /// exact. Planned with it (`oracle-identified` in [`compare`]), the streams show
    /// what is left at the oracle's cutoffs to a planner that knows more than this: the
    /// history's builds are overlapping sums, so a group's own sum need not follow from
    /// them, and the view is an optimistic bound, not what a learner can reach.
    pub fn identified_view(&self, history: &[BuildRecord]) -> GroundTruth {
        let mut v = self.seen_view();
        let n = self.target_mem.len();
        let builds_of = crate::features::build_set_ids(
            n,
            history.iter().map(|rec| rec.targets.iter().filter_map(|l| self.id_of(l)).map(|id| id as usize)),
        );
        let held = |i: usize| builds_of[i] != 0;
        let mut groups: HashMap<u64, Vec<usize>> = HashMap::new();
        for i in (0..n).filter(|&i| held(i)) {
            groups.entry(builds_of[i]).or_default().push(i);
        }
        let (tm, te) = self.target_prior(held);
        for i in (0..n).filter(|&i| !held(i) && !self.pkg_new[self.target_pkg[i] as usize]) {
            v.target_mem[i] = tm * self.pkg_weight[self.target_pkg[i] as usize];
            v.target_esu[i] = te;
        }
        for g in groups.values().filter(|g| g.len() > 1) {
            let k = g.len() as f64;
            let mem = g.iter().map(|&i| self.target_mem[i]).sum::<f64>() / k;
            let esu = g.iter().map(|&i| self.target_esu[i]).sum::<f64>() / k;
            for &i in g {
                v.target_mem[i] = mem;
                v.target_esu[i] = esu;
            }
        }
        v
    }

    /// The prior a view charges a target it cannot price: the mean memory per subtree
    /// weight and the mean occupancy of the targets `from` accepts.
    fn target_prior(&self, from: impl Fn(usize) -> bool) -> (f64, f64) {
        let (mut mem, mut esu, mut k) = (0.0, 0.0, 0usize);
        for i in (0..self.target_mem.len()).filter(|&i| from(i)) {
            mem += self.target_mem[i] / self.pkg_weight[self.target_pkg[i] as usize];
            esu += self.target_esu[i];
            k += 1;
        }
        let k = k.max(1) as f64;
        (mem / k, esu / k)
    }

    pub fn target_count(&self) -> usize {
        self.labels.len()
    }

    pub fn id_of(&self, label: &str) -> Option<u32> {
        self.index.get(label).copied()
    }

    fn marks(&self) -> Marks {
        Marks { stamp: 0, pkg: vec![0; self.pkg_mem.len()], dir: vec![0; self.dir_mem.len()] }
    }

    /// The hidden truth for a build of `ids` (duplicates allowed) under
    /// `ctx`; `regressed` applies the last-day Bazel memory regression.
    pub fn truth(&self, ctx: &BuildContext, ids: &[u32], regressed: bool) -> Usage {
        let mut marks = self.marks();
        self.truth_marked(ctx, ids.iter().copied(), regressed, &mut marks)
    }

    fn truth_marked(
        &self,
        ctx: &BuildContext,
        ids: impl Iterator<Item = u32>,
        regressed: bool,
        m: &mut Marks,
    ) -> Usage {
        m.stamp += 1;
        let stamp = m.stamp;
        let (mut s, mut e) = (0.0, 0.0);
        for id in ids {
            let id = id as usize;
            let p = self.target_pkg[id] as usize;
            s += self.target_mem[id];
            e += self.target_esu[id];
            if m.pkg[p] != stamp {
                m.pkg[p] = stamp;
                s += self.pkg_mem[p];
                e += self.pkg_esu[p];
                for &d in &self.pkg_dirs[p] {
                    if m.dir[d as usize] != stamp {
                        m.dir[d as usize] = stamp;
                        s += self.dir_mem[d as usize];
                    }
                }
            }
        }
        let (mem_mult, esu_mult, flag_base) = context_effects(ctx);
        let base = if ctx.command == Command::Test { 0.75e9 } else { 0.5e9 } + flag_base + user_base(&ctx.user);
        // Sub-additive beyond sharing: large analysis graphs compact better.
        let analysed = GB as f64 * (s / GB as f64).powf(self.analysis_power);
        let reg = if regressed { self.regression } else { 1.0 };
        Usage { memory_bytes: mem_mult * reg * (base + analysed), occupancy_esu: esu_mult * e }
    }
}

/// A user's own fixed memory (their bazelrc, their IDE's aspects): up to
/// 0.4 GB, a hidden function of the name that only the User feature can learn.
fn user_base(user: &str) -> f64 {
    if user.ends_with("-bot") {
        0.0
    } else {
        0.4e9 * (crate::features::fnv1a(user.as_bytes()) % 1000) as f64 / 1000.0
    }
}

/// Multipliers of memory and occupancy implied by the context, and the
/// memory its flags add to the base.
fn context_effects(ctx: &BuildContext) -> (f64, f64, f64) {
    let mut base = 0.0;
    let mut mem = 1.0;
    let mut esu = if ctx.command == Command::Test { 1.0 } else { 0.3 };
    for f in &ctx.flags {
        match f.as_str() {
            "--collect_code_coverage" => {
                base += 0.4e9;
                mem *= 1.3;
                esu *= 1.4;
            }
            "--keep_going" => {
                base += 0.1e9;
                mem *= 1.05;
            }
            "--compilation_mode=opt" => {
                mem *= 1.1;
                esu *= 1.5;
            }
            "--config=asan" => {
                mem *= 1.15;
                esu *= 1.6;
            }
            _ => {
                if let Some(n) = f.strip_prefix("--runs_per_test=").and_then(|n| n.parse::<f64>().ok()) {
                    esu *= n.max(1.0).powf(0.9);
                }
            }
        }
    }
    (mem, esu, base)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tool {
    Presubmit,
    Human,
    Postsubmit,
    Coverage,
    Flaky,
    Release,
}

struct World {
    truth: GroundTruth,
    /// (user, home top dir) of human users.
    humans: Vec<(String, u32)>,
    large_stream_targets: (usize, usize),
}

impl World {
    fn context(&self, tool: Tool, rng: &mut ChaCha8Rng) -> (BuildContext, u32) {
        let (user, home) = self.humans.choose(rng).expect("humans").clone();
        let (cmd, prio, user, tag, flags): (Command, Priority, String, &str, Vec<&str>) = match tool {
            Tool::Presubmit => (Command::Test, Priority::High, user, "presubmit", vec!["--keep_going"]),
            Tool::Human => {
                let cmd = if rng.random_bool(0.5) { Command::Build } else { Command::Test };
                let mut flags = vec!["--jobs=200"];
                // A few users always build with sanitizers.
                if home % 4 == 0 && user.ends_with('1') {
                    flags.push("--config=asan");
                }
                (cmd, Priority::High, user, "human", flags)
            }
            Tool::Postsubmit => {
                (Command::Test, Priority::Medium, "tap-bot".into(), "postsubmit", vec!["--keep_going", "--jobs=600"])
            }
            Tool::Coverage => (
                Command::Test,
                Priority::Low,
                "coverage-bot".into(),
                "coverage",
                vec!["--collect_code_coverage", "--keep_going"],
            ),
            Tool::Flaky => {
                (Command::Test, Priority::Low, "flake-bot".into(), "flaky_detector", vec!["--runs_per_test=5"])
            }
            Tool::Release => {
                (Command::Build, Priority::Medium, "release-bot".into(), "release", vec!["--compilation_mode=opt"])
            }
        };
        let top = match tool {
            Tool::Presubmit | Tool::Human => home,
            _ => rng.random_range(0..self.top_count() as u32),
        };
        let mut ctx = BuildContext::new_workspace("sim", cmd, prio);
        ctx.user = user;
        ctx.tool_tag = tag.to_string();
        ctx.product_area = self.truth.labels_dir_name(top);
        ctx.flags = flags.into_iter().map(str::to_string).collect();
        (ctx, top)
    }

    fn top_count(&self) -> usize {
        self.truth.dir_depth.iter().filter(|&&d| d == 1).count()
    }

    /// A random directory under top dir `top` with at least one target,
    /// preferring the given depth range.
    fn pick_dir(&self, rng: &mut ChaCha8Rng, top: u32, min_depth: u32, max_depth: u32) -> u32 {
        let t = &self.truth;
        let cands: Vec<u32> = (0..t.dir_depth.len() as u32)
            .filter(|&d| {
                let dd = t.dir_depth[d as usize];
                dd >= min_depth
                    && dd <= max_depth
                    && !t.dir_targets[d as usize].is_empty()
                    && t.dir_top[d as usize] == top
            })
            .collect();
        *cands.choose(rng).unwrap_or(&top)
    }

    /// A target set as a tool would send it.
    fn targets_for(&self, tool: Tool, top: u32, rng: &mut ChaCha8Rng, stream: bool) -> Vec<u32> {
        let t = &self.truth;
        let geometric = |rng: &mut ChaCha8Rng, mean: f64, cap: usize| {
            let mut n = 1;
            while rng.random::<f64>() > 1.0 / mean && n < cap {
                n += 1;
            }
            n
        };
        match tool {
            Tool::Presubmit | Tool::Flaky | Tool::Human => {
                let dir = self.pick_dir(rng, top, 2, 4);
                let pool = &t.dir_targets[dir as usize];
                let (mean, cap) = match tool {
                    Tool::Presubmit => (6.0, 60),
                    Tool::Flaky => (40.0, 400),
                    _ => (25.0, 300),
                };
                let n = geometric(rng, mean, cap).min(pool.len());
                let mut v: Vec<u32> = pool.choose_multiple(rng, n).copied().collect();
                v.sort_unstable();
                v
            }
            Tool::Postsubmit | Tool::Coverage | Tool::Release => {
                if stream {
                    // What a day of changes affects: whole subtrees, starting in `top`,
                    // until the drawn size is reached; in arbitrary order.
                    let (lo, hi) = self.large_stream_targets;
                    let cap = (t.target_count() * 3 / 5).max(1);
                    let n = rng.random_range(lo.min(hi)..=hi.max(lo)).clamp(1, cap);
                    let mut taken = vec![false; t.target_count()];
                    let mut v = Vec::with_capacity(n);
                    let mut from = top;
                    while v.len() < n {
                        let dir = self.pick_dir(rng, from, 1, 3);
                        for &id in &t.dir_targets[dir as usize] {
                            if !std::mem::replace(&mut taken[id as usize], true) {
                                v.push(id);
                            }
                        }
                        from = rng.random_range(0..self.top_count() as u32);
                    }
                    v.truncate(n);
                    v.shuffle(rng);
                    v
                } else {
                    // History: a slice cut by the old fixed-size batcher.
                    let dir = self.pick_dir(rng, top, 1, 3);
                    let pool = &t.dir_targets[dir as usize];
                    let n = rng.random_range(20..=900).min(pool.len());
                    let start = rng.random_range(0..=pool.len() - n);
                    pool[start..start + n].to_vec()
                }
            }
        }
    }
}

impl GroundTruth {
    fn dir_name(&self, d: u32) -> String {
        // Recover the directory path from any target under it.
        let id = self.dir_targets[d as usize][0] as usize;
        let p = self.target_pkg[id] as usize;
        let label = &self.labels[id];
        let pkg_path = &label[..label.find(':').expect("explicit labels")];
        let depth_here = self.dir_depth[d as usize] as usize;
        let pkg_depth = self.pkg_dirs[p].len() + 1;
        let mut path = pkg_path;
        for _ in depth_here..pkg_depth {
            path = &path[..path.rfind('/').expect("nested")];
        }
        path.to_string()
    }

    fn labels_dir_name(&self, top: u32) -> String {
        if self.dir_targets[top as usize].is_empty() {
            return format!("top{top}");
        }
        self.dir_name(top).trim_start_matches("//").to_string()
    }
}

fn pick_tool(rng: &mut ChaCha8Rng, small: bool) -> Tool {
    let x: f64 = rng.random();
    if small {
        if x < 0.6 {
            Tool::Presubmit
        } else if x < 0.85 {
            Tool::Human
        } else {
            Tool::Flaky
        }
    } else if x < 0.5 {
        Tool::Postsubmit
    } else if x < 0.8 {
        Tool::Coverage
    } else {
        Tool::Release
    }
}

fn build_world(cfg: &SimConfig, rng: &mut ChaCha8Rng) -> World {
    let truth = GroundTruth::generate(cfg, rng);
    let tops = cfg.top_dirs as u32;
    let humans = (0..60).map(|i| (format!("user{i}"), rng.random_range(0..tops))).collect();
    World { truth, humans, large_stream_targets: cfg.large_stream_targets }
}

/// Generate `history_days` of history ending at `cfg.now`.
fn generate_history(world: &World, cfg: &SimConfig, rng: &mut ChaCha8Rng) -> Vec<BuildRecord> {
    let t = &world.truth;
    let mut marks = t.marks();
    let total = cfg.history_days * cfg.builds_per_day;
    let span = cfg.history_days as i64 * SECONDS_PER_DAY;
    let mut out = Vec::with_capacity(total);
    for i in 0..total {
        let time = Timestamp(cfg.now.0 - 1 - rng.random_range(0..span));
        let regressed = time.0 >= cfg.now.0 - SECONDS_PER_DAY;
        let x: f64 = rng.random();
        let tool = if x < 0.4 {
            Tool::Presubmit
        } else if x < 0.6 {
            Tool::Human
        } else if x < 0.8 {
            Tool::Postsubmit
        } else if x < 0.88 {
            Tool::Coverage
        } else if x < 0.95 {
            Tool::Flaky
        } else {
            Tool::Release
        };
        let (ctx, top) = world.context(tool, rng);
        let mut ids = world.targets_for(tool, top, rng, false);
        ids.retain(|&id| !t.pkg_new[t.target_pkg[id as usize] as usize]);
        let u = t.truth_marked(&ctx, ids.iter().copied(), regressed, &mut marks);
        let alloc = cfg.planner.bazel_memory_bytes as f64;
        // Measurement: post-GC peak is noisy; builds that never ran a full
        // GC report the (larger) raw peak heap.
        let mut mem = u.memory_bytes * lognormal(rng, 1.0, 0.05);
        if rng.random::<f64>() < cfg.label_noise_fraction {
            mem *= rng.random_range(1.0..cfg.label_noise_max.max(1.0 + 1e-9));
        }
        let oom = u.memory_bytes > alloc;
        if oom || mem > alloc {
            mem = alloc * rng.random_range(1.0..1.02);
        }
        let occ = occupancy_label(rng, u.occupancy_esu);
        let wall = 60.0 + 40.0 * (1.0 + ids.len() as f64).ln() * lognormal(rng, 1.0, 0.3);
        let outcome = if oom {
            Outcome::Oom
        } else if u.occupancy_esu > cfg.planner.occupancy_limit_esu {
            Outcome::DeadlineExceeded
        } else if rng.random::<f64>() < 0.02 {
            Outcome::Failed
        } else {
            Outcome::Success
        };
        out.push(BuildRecord {
            id: format!("b{i}"),
            time,
            priority: ctx.priority,
            command: ctx.command,
            user: ctx.user,
            product_area: ctx.product_area,
            tool_tag: ctx.tool_tag,
            flags: ctx.flags,
            targets: ids.iter().map(|&id| t.labels[id as usize].clone()).collect(),
            peak_memory_bytes: mem.round() as u64,
            executor_service_seconds: occ * wall,
            wall_seconds: wall,
            outcome,
        });
    }
    // A directory with no targets yields an empty build, which is no build at all (and
    // which the history reader rightly rejects). Dropped after generation so the random
    // stream, and hence the rest of the workload, stays the same.
    out.retain(|r| !r.targets.is_empty());
    out.sort_by_key(|r| r.time);
    out
}

/// [`Estimator`] that knows the truth: the oracle of the density score.
pub struct Oracle<'a> {
    pub truth: &'a GroundTruth,
    pub regressed: bool,
}

/// Per-group state of the [`Oracle`].
pub struct OracleGroup<'a> {
    truth: &'a GroundTruth,
    ctx: BuildContext,
    regressed: bool,
    ids: VecDeque<u32>,
    marks: Marks,
}

impl Estimator for Oracle<'_> {
    type Group<'b>
        = OracleGroup<'b>
    where
        Self: 'b;
    fn group<'b>(&'b self, ctx: &BuildContext) -> OracleGroup<'b> {
        OracleGroup {
            truth: self.truth,
            ctx: ctx.clone(),
            regressed: self.regressed,
            ids: VecDeque::new(),
            marks: self.truth.marks(),
        }
    }
}

impl OracleGroup<'_> {
    fn usage(&mut self, len: usize) -> Usage {
        let ids = self.ids.iter().take(len).copied();
        self.truth.truth_marked(&self.ctx, ids, self.regressed, &mut self.marks)
    }
}

impl GroupEstimator for OracleGroup<'_> {
    fn push(&mut self, label: &Label<'_>) {
        let id = self.truth.id_of(&label.canonical()).expect("oracle only plans labels of its own repository");
        self.ids.push_back(id);
    }
    fn pop_front(&mut self, n: usize) {
        self.ids.drain(..n.min(self.ids.len()));
    }
    fn memory_bytes(&mut self, len: usize) -> Result<f64> {
        Ok(self.usage(len).memory_bytes)
    }
    fn occupancy_esu(&mut self, len: usize) -> Result<f64> {
        Ok(self.usage(len).occupancy_esu)
    }
}

/// Outcome of planning the evaluation streams with one estimator.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanScore {
    pub name: String,
    pub builds: usize,
    pub targets: usize,
    pub oom: usize,
    pub de: usize,
    /// Sum of the planned builds' OOM probabilities: the OOMs the memory
    /// model expected (0 without an error model).
    pub predicted_oom: f64,
    /// Per stream, in order: (builds, OOM, predicted OOM).
    #[serde(default)]
    pub streams: Vec<(usize, usize, f64)>,
    /// Builds per reason: (reason, builds, OOM, DE).
    pub by_reason: Vec<(BatchSizeReason, usize, usize, usize)>,
}

impl PlanScore {
    fn named(name: &str) -> PlanScore {
        PlanScore {
            name: name.to_string(),
            by_reason: BatchSizeReason::ALL.iter().map(|&r| (r, 0, 0, 0)).collect(),
            ..PlanScore::default()
        }
    }

    /// One planned build of the current stream (`stream`: its builds, OOMs and
    /// predicted OOMs) and whether it ran out of memory or over the executor pool.
    fn count(&mut self, stream: &mut (usize, usize, f64), b: &Batch, oom: bool, de: bool) {
        let p = b.oom_probability.unwrap_or(0.0);
        *stream = (stream.0 + 1, stream.1 + oom as usize, stream.2 + p);
        self.builds += 1;
        self.predicted_oom += p;
        self.targets += b.targets.len();
        self.oom += oom as usize;
        self.de += de as usize;
        let r = self.by_reason.iter_mut().find(|x| x.0 == b.reason).expect("all reasons");
        r.1 += 1;
        r.2 += oom as usize;
        r.3 += de as usize;
    }

    pub fn oom_rate(&self) -> f64 {
        self.oom as f64 / self.builds.max(1) as f64
    }
    pub fn de_rate(&self) -> f64 {
        self.de as f64 / self.builds.max(1) as f64
    }
    pub fn builds_per_target(&self) -> f64 {
        self.builds as f64 / self.targets.max(1) as f64
    }
    /// Mean targets per build.
    pub fn density(&self) -> f64 {
        self.targets as f64 / self.builds.max(1) as f64
    }
}

/// Result of [`simulate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    pub repo_targets: usize,
    pub history_builds: usize,
    pub history_oom: usize,
    pub train_seconds: f64,
    /// Which model the planner used ("shared-cost, memory power 0.92" or "linear").
    #[serde(default)]
    pub planned_with: String,
    pub eval_streams: usize,
    pub eval_targets: usize,
    pub memory_calibration: f64,
    pub occupancy_calibration: f64,
    pub memory_crosses: Vec<String>,
    pub occupancy_crosses: Vec<String>,
    /// The planner as the service runs it: the models, corrected by the feedback of the
    /// builds of the streams before ([`score_with_feedback`]). The goal is judged on it.
    pub service: PlanScore,
    /// The models alone, without feedback.
    pub models: PlanScore,
    pub oracle: PlanScore,
    /// No models: every batch is the fallback size.
    pub fixed: PlanScore,
    /// The service's density / the oracle's (1.0 = as dense as the oracle).
    pub density_vs_oracle: f64,
    pub goal_met: bool,
}

/// Goal of the simulation (design's production numbers).
pub const GOAL_OOM_RATE: f64 = 0.0008;
pub const GOAL_DE_RATE: f64 = 0.0005;
pub const GOAL_DENSITY: f64 = 0.9;

/// Everything a simulation produces, for callers that want more than the
/// report (tests, the bench).
pub struct SimRun {
    pub truth: GroundTruth,
    pub history: Vec<BuildRecord>,
    pub models: Models,
    pub streams: Vec<Stream>,
    pub report: SimReport,
}

/// A request stream of the evaluation: context and targets in arrival order.
pub type Stream = (BuildContext, Vec<Target>);

/// Generate a world, its history and the fresh evaluation streams (no training).
pub fn generate(cfg: &SimConfig) -> (GroundTruth, Vec<BuildRecord>, Vec<Stream>) {
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let world = build_world(cfg, &mut rng);
    let history = generate_history(&world, cfg, &mut rng);
    let mut streams = Vec::new();
    for i in 0..cfg.eval_small_streams + cfg.eval_large_streams {
        let small = i < cfg.eval_small_streams;
        let tool = pick_tool(&mut rng, small);
        let (ctx, top) = world.context(tool, &mut rng);
        let ids = world.targets_for(tool, top, &mut rng, true);
        let targets = ids.iter().map(|&id| Target::new(world.truth.labels[id as usize].clone())).collect();
        streams.push((ctx, targets));
    }
    (world.truth, history, streams)
}

/// Plan every stream with `estimator` and score the batches against truth.
pub fn score<E: Estimator>(
    name: &str,
    truth: &GroundTruth,
    streams: &[Stream],
    planner: &PlannerConfig,
    estimator: &E,
    regressed: bool,
) -> Result<PlanScore> {
    score_streams(
        name,
        truth,
        streams,
        planner,
        regressed,
        |ctx, targets| plan(ctx, targets, planner, estimator),
        |_| Ok(()),
    )
}

/// A build of [`score_streams`]: its context, plan, true usage and whether it ran out
/// of memory.
struct Scored<'a> {
    ctx: &'a BuildContext,
    batch: &'a Batch,
    usage: Usage,
    oom: bool,
}

/// Plans each stream in order with `plan_stream`, scores its builds against the truth,
/// and tells `built` of each.
fn score_streams(
    name: &str,
    truth: &GroundTruth,
    streams: &[Stream],
    planner: &PlannerConfig,
    regressed: bool,
    mut plan_stream: impl FnMut(&BuildContext, Vec<Target>) -> Result<Vec<Batch>>,
    mut built: impl FnMut(Scored<'_>) -> Result<()>,
) -> Result<PlanScore> {
    let mut s = PlanScore::named(name);
    let mut marks = truth.marks();
    for (ctx, targets) in streams {
        let batches = plan_stream(ctx, targets.clone())?;
        let mut this = (0, 0, 0.0);
        for b in &batches {
            let ids = b.targets.iter().map(|l| truth.id_of(l).expect("own label"));
            let usage = truth.truth_marked(ctx, ids, regressed, &mut marks);
            let oom = usage.memory_bytes > planner.bazel_memory_bytes as f64;
            let de = usage.occupancy_esu > planner.occupancy_limit_esu;
            s.count(&mut this, b, oom, de);
            built(Scored { ctx, batch: b, usage, oom })?;
        }
        s.streams.push(this);
    }
    s.by_reason.retain(|r| r.1 > 0);
    Ok(s)
}

/// Like [`score`] with [`Models`], but learning from every build as the service does:
/// the streams run in order, each planned with the [`Feedback`] of the builds before
/// it ([`Corrected`]), and each of its builds then observed: the models' estimate for
/// its targets against what it used, read as the history reads it (an OOM build
/// reports the heap it died in; a share of the others, `label_noise_fraction`, never
/// ran a full GC and reads up to `label_noise_max` times high).
pub fn score_with_feedback(
    name: &str,
    truth: &GroundTruth,
    streams: &[Stream],
    cfg: &SimConfig,
    models: &Models,
    regressed: bool,
) -> Result<PlanScore> {
    let predict = |ctx: &BuildContext, labels: &[&str]| models.predict_memory(ctx, labels).transpose();
    score_with_feedback_of(name, truth, streams, cfg, models, predict, regressed)
}

/// [`score_with_feedback`] for any estimator; `predict` gives its uncorrected memory
/// estimate of a build (`None`: it has no memory model, and nothing is observed).
pub fn score_with_feedback_of<E: Estimator>(
    name: &str,
    truth: &GroundTruth,
    streams: &[Stream],
    cfg: &SimConfig,
    estimator: &E,
    predict: impl Fn(&BuildContext, &[&str]) -> Result<Option<f64>>,
    regressed: bool,
) -> Result<PlanScore> {
    // The plans read it and the builds write it, one after the other.
    let feedback = std::cell::RefCell::new(Feedback::new());
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0xfeed_bac4);
    // Occupancy is measured apart from memory: its own draws leave memory's as they were.
    let mut occupancy_rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x0cc0_fee5);
    let heap = cfg.planner.bazel_memory_bytes as f64;
    score_streams(
        name,
        truth,
        streams,
        &cfg.planner,
        regressed,
        // A stream plans with the builds of the streams before it: its own have not
        // finished yet.
        |ctx, targets| {
            plan(ctx, targets, &cfg.planner, &Corrected { inner: estimator, feedback: feedback.borrow().clone() })
        },
        |b| {
            let label = if b.oom {
                heap
            } else if rng.random::<f64>() < cfg.label_noise_fraction {
                b.usage.memory_bytes * rng.random_range(1.0..cfg.label_noise_max.max(1.0 + 1e-9))
            } else {
                b.usage.memory_bytes
            };
            let labels: Vec<&str> = b.batch.targets.iter().map(String::as_str).collect();
            // A build past its deadline is stopped: it built only some of its targets, and
            // had at least the executors' limit.
            let de = b.usage.occupancy_esu > cfg.planner.occupancy_limit_esu;
            let ended = if b.oom {
                Ended::Oom
            } else if de {
                Ended::Partial
            } else {
                Ended::Complete
            };
            if let Some(estimate) = predict(b.ctx, &labels)? {
                feedback.borrow_mut().observe(&b.ctx.tool_tag, &labels, estimate, label, ended);
            }
            // Occupancy reads as the history's does (measurement noise, and a share of
            // builds served from the action cache); an OOM build's is not known.
            if !b.oom
                && let Ok(estimate) = crate::planner::occupancy_of(estimator, b.ctx, &labels)
            {
                let actual = if de {
                    cfg.planner.occupancy_limit_esu
                } else {
                    occupancy_label(&mut occupancy_rng, b.usage.occupancy_esu)
                };
                feedback.borrow_mut().observe_occupancy(&b.ctx.tool_tag, estimate, actual, ended);
            }
            Ok(())
        },
    )
}

/// Full simulation: generate, train on history, plan fresh streams with the
/// models, the oracle and a fixed batch size, and compare.
pub fn simulate(cfg: &SimConfig) -> Result<SimRun> {
    let (truth, history, streams) = generate(cfg);
    let t0 = Instant::now();
    let models = train(&history, &cfg.train, cfg.now)?;
    let train_seconds = t0.elapsed().as_secs_f64();
    // Fresh streams run "now", i.e. with the last-day regression in effect.
    // The service plans with the models and the feedback of the builds it has run since
    // they were trained; that is the planner the goal is judged on. The models alone are
    // scored beside it, to show what the feedback adds.
    let served = score_with_feedback("service", &truth, &streams, cfg, &models, true)?;
    let m = score("models", &truth, &streams, &cfg.planner, &models, true)?;
    let oracle = Oracle { truth: &truth, regressed: true };
    let o = score("oracle", &truth, &streams, &cfg.planner, &oracle, true)?;
    let f = score("fixed", &truth, &streams, &cfg.planner, &Models::default(), true)?;
    let density_vs_oracle = served.density() / o.density();
    let goal_met =
        served.oom_rate() < GOAL_OOM_RATE && served.de_rate() < GOAL_DE_RATE && density_vs_oracle >= GOAL_DENSITY;
    let mem = models.memory.as_ref();
    let report = SimReport {
        repo_targets: truth.target_count(),
        history_builds: history.len(),
        history_oom: history.iter().filter(|r| r.outcome == Outcome::Oom).count(),
        train_seconds,
        eval_streams: streams.len(),
        eval_targets: streams.iter().map(|s| s.1.len()).sum(),
        planned_with: match &models.shared {
            Some(m) => format!("the shared-cost model (memory power {:.3})", m.power()),
            None => "the linear models".to_string(),
        },
        memory_calibration: mem.map(|m| m.long.calibration).unwrap_or(1.0),
        occupancy_calibration: models.occupancy.as_ref().map(|o| o.calibration).unwrap_or(1.0),
        memory_crosses: models.manifest.memory_crosses.iter().map(|c| c.to_string()).collect(),
        occupancy_crosses: models.manifest.occupancy_crosses.iter().map(|c| c.to_string()).collect(),
        service: served,
        models: m,
        oracle: o,
        fixed: f,
        density_vs_oracle,
        goal_met,
    };
    Ok(SimRun { truth, history, models, streams, report })
}

impl fmt::Display for SimReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "repo: {} targets; history: {} builds ({} OOM); training {:.1}s",
            self.repo_targets, self.history_builds, self.history_oom, self.train_seconds
        )?;
        writeln!(f, "planned with {}", self.planned_with)?;
        writeln!(
            f,
            "linear models: calibration memory x{:.3}, occupancy x{:.3}",
            self.memory_calibration, self.occupancy_calibration
        )?;
        writeln!(f, "linear memory crosses: [{}]", self.memory_crosses.join(", "))?;
        writeln!(f, "linear occupancy crosses: [{}]", self.occupancy_crosses.join(", "))?;
        writeln!(f, "evaluation: {} streams, {} targets\n", self.eval_streams, self.eval_targets)?;
        writeln!(
            f,
            "{:<8} {:>8} {:>6} {:>9} {:>5} {:>9} {:>12} {:>10}",
            "planner", "builds", "OOM", "OOM rate", "DE", "DE rate", "builds/tgt", "tgt/build"
        )?;
        for s in [&self.service, &self.models, &self.oracle, &self.fixed] {
            writeln!(
                f,
                "{:<8} {:>8} {:>6} {:>8.3}% {:>5} {:>8.3}% {:>12.5} {:>10.1}",
                s.name,
                s.builds,
                s.oom,
                100.0 * s.oom_rate(),
                s.de,
                100.0 * s.de_rate(),
                s.builds_per_target(),
                s.density()
            )?;
        }
        writeln!(
            f,
            "\nservice (the models with the feedback of earlier streams' builds, as `gantry serve` plans)\n\
             density vs oracle: {:.1}% (goal >= {:.0}%); goal OOM < {:.2}%, DE < {:.2}%: {}",
            100.0 * self.density_vs_oracle,
            100.0 * GOAL_DENSITY,
            100.0 * GOAL_OOM_RATE,
            100.0 * GOAL_DE_RATE,
            if self.goal_met { "MET" } else { "NOT MET" }
        )?;
        writeln!(f, "\nthe service's batches by reason:")?;
        writeln!(f, "{:<26} {:>8} {:>6} {:>6}", "reason", "builds", "OOM", "DE")?;
        for (r, b, o, d) in &self.service.by_reason {
            writeln!(f, "{:<26} {:>8} {:>6} {:>6}", r.as_str(), b, o, d)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Speed benchmark
// ---------------------------------------------------------------------------

/// Parameters of [`bench`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BenchConfig {
    pub targets: usize,
    /// `true`: [`StreamingPlanner`] fed target by target (bounded memory);
    /// `false`: one [`plan`] call over a pre-built vector.
    pub streaming: bool,
    /// Simulation used to train the models that are loaded for the run.
    pub sim: SimConfig,
    pub seed: u64,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            targets: 10_000_000,
            streaming: true,
            sim: SimConfig { eval_small_streams: 0, eval_large_streams: 0, ..SimConfig::default() },
            seed: 11,
        }
    }
}

/// Result of [`bench`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    pub targets: usize,
    pub batches: usize,
    pub streaming: bool,
    /// Training + target generation (not part of the measured time).
    pub setup_seconds: f64,
    /// Wall time of planning (for streaming, includes generating each
    /// label on the fly, which is cheap next to planning it).
    pub plan_seconds: f64,
    pub reasons: Vec<(BatchSizeReason, usize)>,
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} targets -> {} batches in {:.2}s ({}; setup {:.1}s)",
            self.targets,
            self.batches,
            self.plan_seconds,
            if self.streaming { "streaming" } else { "in-memory" },
            self.setup_seconds
        )?;
        for (r, n) in &self.reasons {
            writeln!(f, "  {:<26} {n}", r.as_str())?;
        }
        Ok(())
    }
}

/// Synthetic label `i` of the benchmark's large repository, in a scrambled
/// order (streams do not arrive sorted). Half the labels come from the
/// simulated repo's top directories so trained weights are exercised.
fn bench_label(i: u64, seed: u64, tops: &[String]) -> String {
    let h = crate::features::mix(seed, i);
    let pkg = h % 600_000;
    let top = &tops[(pkg % tops.len() as u64) as usize];
    format!("{top}/m{}/p{}:t{}", (pkg / 97) % 211, pkg, (h >> 32) % 40)
}

/// Time the planner on `cfg.targets` synthetic targets with freshly trained
/// models loaded. Peak memory is for the caller to measure.
pub fn bench(cfg: &BenchConfig) -> Result<BenchReport> {
    let t0 = Instant::now();
    let (truth, history, _) = generate(&cfg.sim);
    let models = train(&history, &cfg.sim.train, cfg.sim.now)?;
    let tops: Vec<String> = (0..truth.dir_depth.len() as u32)
        .filter(|&d| truth.dir_depth[d as usize] == 1 && !truth.dir_targets[d as usize].is_empty())
        .map(|d| truth.dir_name(d))
        .collect();
    let mut ctx = BuildContext::new_workspace("bench", Command::Test, Priority::Medium);
    ctx.tool_tag = "postsubmit".into();
    ctx.user = "tap-bot".into();
    ctx.flags = vec!["--keep_going".into(), "--jobs=600".into()];
    let mut counts: HashMap<BatchSizeReason, usize> = HashMap::new();
    let mut batches = 0usize;
    let mut tally = |bs: Vec<Batch>| {
        for b in bs {
            batches += 1;
            *counts.entry(b.reason).or_default() += 1;
        }
    };
    let (setup, plan_seconds) = if cfg.streaming {
        let setup = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut sp = StreamingPlanner::new(ctx, cfg.sim.planner.clone(), &models)?;
        for i in 0..cfg.targets as u64 {
            sp.push(Target::new(bench_label(i, cfg.seed, &tops)))?;
            if i % 65_536 == 0 {
                tally(sp.take_ready());
            }
        }
        tally(sp.finish());
        (setup, t1.elapsed().as_secs_f64())
    } else {
        let targets: Vec<Target> =
            (0..cfg.targets as u64).map(|i| Target::new(bench_label(i, cfg.seed, &tops))).collect();
        let setup = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let out = plan(&ctx, targets, &cfg.sim.planner, &models)?;
        let secs = t1.elapsed().as_secs_f64();
        tally(out);
        (setup, secs)
    };
    let mut reasons: Vec<(BatchSizeReason, usize)> = counts.into_iter().collect();
    reasons.sort();
    Ok(BenchReport {
        targets: cfg.targets,
        batches,
        streaming: cfg.streaming,
        setup_seconds: setup,
        plan_seconds,
        reasons,
    })
}

// ---------------------------------------------------------------------------
// Model comparison across seeds
// ---------------------------------------------------------------------------

/// A learner configuration compared by [`compare`].
pub fn model_variants() -> Vec<(&'static str, TrainConfig)> {
    use crate::model::{Calibration, Centring, Learner, Loss};
    // The linear learner, as it was the default before the shared-cost one.
    let v2 = TrainConfig { learner: Learner::Linear, ..TrainConfig::default() };
    vec![
        // The default: the shared-cost learner (`crate::shared`).
        ("shared", TrainConfig::default()),
        // The first version: least squares, a q95 safety factor, no priors.
        (
            "v1-q95",
            TrainConfig {
                hash_bits: 18,
                loss: Loss::Squared,
                calibration: Calibration::Quantile,
                unseen_prior: false,
                ..v2.clone()
            },
        ),
        ("v2", v2.clone()),
        ("v2-line", TrainConfig { centring: Centring::Line, ..v2.clone() }),
        ("v2-no-prior", TrainConfig { unseen_prior: false, ..v2.clone() }),
        ("v2-huber", TrainConfig { loss: Loss::Huber, ..v2.clone() }),
        ("v2-slow-cross", TrainConfig { cross_rate: 0.1, ..v2.clone() }),
        ("v2-no-cross", TrainConfig { max_crosses: 0, ..v2.clone() }),
        ("v2-no-short", TrainConfig { min_short_window_builds: usize::MAX, ..v2 }),
    ]
}

/// One row of [`compare`]: a planner on one seed's held-out streams.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompareRow {
    pub seed: u64,
    pub planner: String,
    pub score: PlanScore,
    pub density_vs_oracle: f64,
}

/// For each seed: generate a workload (history, then large streams with new
/// packages and a last-day regression), train every learner of
/// [`model_variants`] on the history, and score every learner, fixed batch
/// sizes, the oracle and the two bounds of what the history tells
/// ([`GroundTruth::seen_view`], [`GroundTruth::identified_view`]) on the streams;
/// the default learner and the linear one also with [`score_with_feedback`]
/// ("shared+feedback", "v2+feedback"). `progress` hears each row.
/// `only` names the planners to score (empty: all); the oracle is always scored, as
/// every density is read against it.
pub fn compare(
    base: &SimConfig,
    seeds: &[u64],
    fixed_sizes: &[usize],
    only: &[String],
    mut progress: impl FnMut(&CompareRow),
) -> Result<Vec<CompareRow>> {
    let wanted = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    let mut rows = Vec::new();
    for &seed in seeds {
        let cfg = SimConfig { seed, ..base.clone() };
        let (truth, history, streams) = generate(&cfg);
        let oracle = score("oracle", &truth, &streams, &cfg.planner, &Oracle { truth: &truth, regressed: true }, true)?;
        let mut push = |planner: &str, s: PlanScore| {
            let row = CompareRow {
                seed,
                planner: planner.to_string(),
                density_vs_oracle: s.density() / oracle.density(),
                score: s,
            };
            progress(&row);
            rows.push(row);
        };
        push("oracle", oracle.clone());
        if wanted("oracle-seen") {
            let seen = truth.seen_view();
            let o = Oracle { truth: &seen, regressed: true };
            push("oracle-seen", score("oracle-seen", &truth, &streams, &cfg.planner, &o, true)?);
        }
        if wanted("oracle-identified") {
            let ident = truth.identified_view(&history);
            let o = Oracle { truth: &ident, regressed: true };
            push("oracle-identified", score("oracle-identified", &truth, &streams, &cfg.planner, &o, true)?);
        }
        for (name, tc) in model_variants() {
            // As the service runs it: corrected by the builds it ran.
            let fb = format!("{name}+feedback");
            let with_feedback = (name == "shared" || name == "v2") && wanted(&fb);
            if !wanted(name) && !with_feedback {
                continue;
            }
            let models = train(&history, &tc, cfg.now)?;
            if wanted(name) {
                push(name, score(name, &truth, &streams, &cfg.planner, &models, true)?);
            }
            if with_feedback {
                push(&fb, score_with_feedback(&fb, &truth, &streams, &cfg, &models, true)?);
            }
        }
        for &size in fixed_sizes {
            let name = format!("fixed-{size}");
            if wanted(&name) {
                let p = PlannerConfig { fallback_batch_size: size, ..cfg.planner.clone() };
                push(&name, score(&name, &truth, &streams, &p, &Models::default(), true)?);
            }
        }
    }
    Ok(rows)
}

/// Per stream of each seed: `planner`'s builds, and its predicted and
/// observed OOM rates.
pub fn per_stream_table(rows: &[CompareRow], planner: &str) -> String {
    use std::fmt::Write;
    let mut out = format!(
        "| {planner}: seed | stream | builds | predicted OOM rate | observed OOM rate |\n|---|---|---|---|---|\n"
    );
    for r in rows.iter().filter(|r| r.planner == planner) {
        for (i, (b, o, p)) in r.score.streams.iter().enumerate() {
            let _ = writeln!(
                out,
                "| {} | {} | {b} | {:.3}% | {:.3}% |",
                r.seed,
                i + 1,
                100.0 * p / (*b).max(1) as f64,
                100.0 * *o as f64 / (*b).max(1) as f64
            );
        }
    }
    out
}

/// The table of [`compare`]'s rows: per planner, each seed, then the pooled
/// rates over all seeds.
pub fn compare_table(rows: &[CompareRow]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| planner | seed | builds | OOM | OOM rate | predicted OOM | DE | DE rate | targets/build | vs oracle |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|");
    let mut names: Vec<&str> = Vec::new();
    for r in rows {
        if !names.contains(&r.planner.as_str()) {
            names.push(&r.planner);
        }
    }
    for name in names {
        let mine: Vec<&CompareRow> = rows.iter().filter(|r| r.planner == name).collect();
        for r in &mine {
            let s = &r.score;
            let _ = writeln!(
                out,
                "| {name} | {} | {} | {} | {:.3}% | {:.1} | {} | {:.3}% | {:.1} | {:.3} |",
                r.seed,
                s.builds,
                s.oom,
                100.0 * s.oom_rate(),
                s.predicted_oom,
                s.de,
                100.0 * s.de_rate(),
                s.density(),
                r.density_vs_oracle
            );
        }
        let (b, o, d): (usize, usize, usize) =
            mine.iter().fold((0, 0, 0), |a, r| (a.0 + r.score.builds, a.1 + r.score.oom, a.2 + r.score.de));
        let mean_vs = mine.iter().map(|r| r.density_vs_oracle).sum::<f64>() / mine.len().max(1) as f64;
        let worst = mine.iter().map(|r| r.density_vs_oracle).fold(f64::INFINITY, f64::min);
        let _ = writeln!(
            out,
            "| **{name}** | all | {b} | {o} | **{:.3}%** | | {d} | **{:.3}%** | | **{mean_vs:.3}** (worst {worst:.3}) |",
            100.0 * o as f64 / b.max(1) as f64,
            100.0 * d as f64 / b.max(1) as f64
        );
    }
    out
}
