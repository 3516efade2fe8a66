//! Core data types shared by the planner, the models and the file formats:
//! the build context, targets, batches, batch size reasons and the planner
//! configuration with the design's default cutoffs.

use crate::error::{BatchError, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// One gigabyte as used by every cutoff in this crate (10^9 bytes, the unit
/// the design quotes its 7/9/10/13 GB figures in).
pub const GB: u64 = 1_000_000_000;

/// Build priority; selects the memory cutoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Priority {
    #[serde(alias = "high", alias = "High")]
    High,
    #[serde(alias = "medium", alias = "Medium")]
    Medium,
    #[serde(alias = "low", alias = "Low")]
    Low,
}

impl Priority {
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "HIGH",
            Priority::Medium => "MEDIUM",
            Priority::Low => "LOW",
        }
    }
}

/// Bazel command of the build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Command {
    Build,
    Test,
}

impl Command {
    pub fn as_str(self) -> &'static str {
        match self {
            Command::Build => "build",
            Command::Test => "test",
        }
    }
}

/// Everything about a build except its targets; shared by every batch cut
/// from one request stream. Exactly one of `workspace` or
/// (`git_repo`, `revision`) identifies the source tree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BuildContext {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git_repo: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    pub command: Command,
    #[serde(default)]
    pub flags: Vec<String>,
    pub priority: Priority,
    #[serde(default)]
    pub user: String,
    #[serde(default)]
    pub product_area: String,
    #[serde(default)]
    pub tool_tag: String,
}

impl BuildContext {
    /// A context on a workspace with no flags and empty attribution fields;
    /// handy for tests and the simulator.
    pub fn new_workspace(workspace: &str, command: Command, priority: Priority) -> Self {
        BuildContext {
            workspace: Some(workspace.to_string()),
            git_repo: None,
            revision: None,
            command,
            flags: Vec::new(),
            priority,
            user: String::new(),
            product_area: String::new(),
            tool_tag: String::new(),
        }
    }

    /// Check the source-tree invariant and flag syntax.
    pub fn validate(&self) -> Result<()> {
        let has_ws = self.workspace.as_deref().is_some_and(|w| !w.is_empty());
        let has_repo = self.git_repo.as_deref().is_some_and(|r| !r.is_empty());
        let has_rev = self.revision.as_deref().is_some_and(|r| !r.is_empty());
        match (has_ws, has_repo, has_rev) {
            (true, false, false) | (false, true, true) => {}
            (true, _, _) => {
                return Err(BatchError::InvalidContext(
                    "give either `workspace` or `git_repo`+`revision`, not both".into(),
                ))
            }
            (false, true, false) => {
                return Err(BatchError::InvalidContext("`git_repo` given without `revision`".into()))
            }
            (false, false, true) => {
                return Err(BatchError::InvalidContext("`revision` given without `git_repo`".into()))
            }
            (false, false, false) => {
                return Err(BatchError::InvalidContext(
                    "one of `workspace` or `git_repo`+`revision` is required".into(),
                ))
            }
        }
        if let Some(f) = self.flags.iter().find(|f| !f.starts_with("--")) {
            return Err(BatchError::InvalidContext(format!("flag `{f}` does not start with `--`")));
        }
        Ok(())
    }
}

/// A target to batch: its label plus what decides its executor types.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Target {
    pub label: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule_kind: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
}

impl Target {
    /// A target with only a label (executor types default to `{x86}`).
    pub fn new(label: impl Into<String>) -> Self {
        Target { label: label.into(), rule_kind: None, tags: Vec::new() }
    }
}

/// The set of executor types a build needs (e.g. `{"gpu", "x86"}`). Sets,
/// not lists: `{x86}` and `{x86, gpu}` are different groups.
pub type ExecutorSet = BTreeSet<String>;

/// Why a batch has the size it has (design table II).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum BatchSizeReason {
    /// Only one target was left.
    OnlyOneTarget,
    /// The full `max_targets_per_batch` window was valid.
    MaxTargets,
    /// Everything that was left fit.
    AllRemainingTargets,
    /// Cut by the memory binary search.
    MaxMemory,
    /// Cut by the occupancy binary search.
    MaxOccupancy,
    /// Memory model could not answer; fallback size used.
    MemoryEstimateError,
    /// Occupancy model could not answer; fallback size used.
    OccupancyEstimateError,
}

impl BatchSizeReason {
    pub const ALL: [BatchSizeReason; 7] = [
        BatchSizeReason::OnlyOneTarget,
        BatchSizeReason::MaxTargets,
        BatchSizeReason::AllRemainingTargets,
        BatchSizeReason::MaxMemory,
        BatchSizeReason::MaxOccupancy,
        BatchSizeReason::MemoryEstimateError,
        BatchSizeReason::OccupancyEstimateError,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            BatchSizeReason::OnlyOneTarget => "ONLY_ONE_TARGET",
            BatchSizeReason::MaxTargets => "MAX_TARGETS",
            BatchSizeReason::AllRemainingTargets => "ALL_REMAINING_TARGETS",
            BatchSizeReason::MaxMemory => "MAX_MEMORY",
            BatchSizeReason::MaxOccupancy => "MAX_OCCUPANCY",
            BatchSizeReason::MemoryEstimateError => "MEMORY_ESTIMATE_ERROR",
            BatchSizeReason::OccupancyEstimateError => "OCCUPANCY_ESTIMATE_ERROR",
        }
    }
}

impl std::fmt::Display for BatchSizeReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One planned build: a run of sorted labels sharing an executor set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Batch {
    pub targets: Vec<String>,
    pub reason: BatchSizeReason,
    /// Estimate for exactly these targets; `None` when no estimate was made
    /// (single target, or the memory model failed).
    pub memory_estimate_bytes: Option<u64>,
    /// Occupancy estimate in ESU; `None` when not estimated.
    pub occupancy_estimate_esu: Option<f64>,
    /// The memory model's chance that this build exceeds the Bazel heap,
    /// from its held-out error; `None` without an error model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_probability: Option<f64>,
    pub executor_types: ExecutorSet,
}

/// How executor types are derived from tags and rule kinds.
///
/// Decision: every target also needs the `implicit` types (default `{x86}`),
/// because Bazel's analysis and most actions of any build run on x86
/// executors; so `requires-gpu` yields `{gpu, x86}`, never `{gpu}`. Set
/// `implicit` to empty to make the sets exactly what the tags say.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ExecutorConfig {
    /// Types every target needs.
    pub implicit: ExecutorSet,
    /// Tag -> executor type. Defaults: `requires-gpu` -> gpu, `requires-mac` -> mac.
    pub tag_types: BTreeMap<String, String>,
    /// Rule kind -> executor types, consulted only when no tag matched.
    pub rule_kind_types: BTreeMap<String, Vec<String>>,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        let mut tag_types = BTreeMap::new();
        tag_types.insert("requires-gpu".to_string(), "gpu".to_string());
        tag_types.insert("requires-mac".to_string(), "mac".to_string());
        let mut rule_kind_types = BTreeMap::new();
        rule_kind_types.insert("ios_ui_test".to_string(), vec!["mac".to_string()]);
        rule_kind_types.insert("ios_unit_test".to_string(), vec!["mac".to_string()]);
        rule_kind_types.insert("macos_unit_test".to_string(), vec!["mac".to_string()]);
        ExecutorConfig { implicit: ["x86".to_string()].into_iter().collect(), tag_types, rule_kind_types }
    }
}

/// Memory cutoffs per priority, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MemoryCutoffs {
    pub high: u64,
    pub medium: u64,
    pub low: u64,
}

impl MemoryCutoffs {
    pub fn for_priority(&self, p: Priority) -> u64 {
        match p {
            Priority::High => self.high,
            Priority::Medium => self.medium,
            Priority::Low => self.low,
        }
    }
}

impl Default for MemoryCutoffs {
    fn default() -> Self {
        PlannerConfig::default().memory_cutoff_bytes
    }
}

/// Knobs of the planner. Defaults are the design's production values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlannerConfig {
    pub max_targets_per_batch: usize,
    /// Batch size used when a model cannot answer.
    pub fallback_batch_size: usize,
    /// Heap allocated to each Bazel process; exceeding it is an OOM.
    /// Not used for cutting (the cutoffs are), but by evaluation/simulation.
    pub bazel_memory_bytes: u64,
    pub memory_cutoff_bytes: MemoryCutoffs,
    /// Occupancy a batch must stay under.
    pub occupancy_cutoff_esu: f64,
    /// Concurrent-executor limit; exceeding it risks a Type I deadline.
    pub occupancy_limit_esu: f64,
    pub executors: ExecutorConfig,
    /// Cut so that the memory model's chance of exceeding
    /// `bazel_memory_bytes` stays under this, as well as under the cutoff.
    pub target_oom_rate: f64,
    /// The least margin under `bazel_memory` a memory model's estimate keeps when the
    /// model has an error (`[batch] min_memory_margin`): jumps its spread cannot see.
    pub min_memory_margin: f64,
    /// The most of a memory-limited batch dropped to end it at the start of the history
    /// group its cut falls inside (`[batch] group_backoff_share`); 0 never does.
    pub group_backoff_share: f64,
    /// How far the memory margin tightens per OOM beyond what `target_oom_rate` allows
    /// among the builds observed since the models loaded (`[batch]
    /// excess_oom_tightening`; see [`crate::margin::tightened`]). 0: never.
    pub excess_oom_tightening: f64,
    /// Same for occupancy against `occupancy_limit_esu` (a deadline risk).
    pub target_de_rate: f64,
    /// Streaming planner: targets buffered per executor group before the
    /// buffer is sorted and cut (see `planner::StreamingPlanner`).
    pub stream_sort_window: usize,
}

/// The defaults are `[batch]`'s (gantry-config keeps every default in one place).
impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig::from_config(&gantry_config::BatchConfig::default())
    }
}

impl PlannerConfig {
    /// The planner settings of `[batch]` in gantry.toml.
    pub fn from_config(cfg: &gantry_config::BatchConfig) -> PlannerConfig {
        let mut executors = ExecutorConfig::default();
        executors.tag_types.extend(cfg.tag_executor_types.clone());
        executors.rule_kind_types.extend(cfg.rule_kind_executor_types.clone());
        PlannerConfig {
            max_targets_per_batch: cfg.max_targets_per_batch,
            fallback_batch_size: cfg.fallback_batch_size,
            bazel_memory_bytes: cfg.bazel_memory.as_u64(),
            memory_cutoff_bytes: MemoryCutoffs {
                high: cfg.memory_cutoff_high.as_u64(),
                medium: cfg.memory_cutoff_medium.as_u64(),
                low: cfg.memory_cutoff_low.as_u64(),
            },
            occupancy_cutoff_esu: cfg.occupancy_cutoff_esu,
            occupancy_limit_esu: cfg.occupancy_limit_esu,
            executors,
            target_oom_rate: cfg.target_oom_rate,
            min_memory_margin: cfg.min_memory_margin,
            group_backoff_share: cfg.group_backoff_share,
            excess_oom_tightening: cfg.excess_oom_tightening,
            target_de_rate: cfg.target_de_rate,
            stream_sort_window: cfg.stream_sort_window,
        }
    }

    /// Reject configurations the planner cannot honour.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(BatchError::InvalidConfig(m));
        if self.max_targets_per_batch == 0 {
            return bad("max_targets_per_batch must be >= 1".into());
        }
        if self.fallback_batch_size == 0 {
            return bad("fallback_batch_size must be >= 1".into());
        }
        let c = self.memory_cutoff_bytes;
        for (name, v) in [("high", c.high), ("medium", c.medium), ("low", c.low)] {
            if v == 0 || v > self.bazel_memory_bytes {
                return bad(format!(
                    "memory cutoff for {name} ({v}) must be in 1..=bazel_memory_bytes ({})",
                    self.bazel_memory_bytes
                ));
            }
        }
        if !(self.occupancy_cutoff_esu > 0.0 && self.occupancy_cutoff_esu <= self.occupancy_limit_esu) {
            return bad(format!(
                "occupancy cutoff {} must be in (0, limit {}]",
                self.occupancy_cutoff_esu, self.occupancy_limit_esu
            ));
        }
        for (name, v) in [("target_oom_rate", self.target_oom_rate), ("target_de_rate", self.target_de_rate)] {
            if !(v > 0.0 && v < 0.5) {
                return bad(format!("{name} ({v}) must be in (0, 0.5)"));
            }
        }
        if !(self.min_memory_margin >= 1.0 && self.min_memory_margin.is_finite()) {
            return bad(format!("min_memory_margin ({}) must be a number >= 1", self.min_memory_margin));
        }
        if !(0.0..1.0).contains(&self.group_backoff_share) {
            return bad(format!("group_backoff_share ({}) must be in [0, 1)", self.group_backoff_share));
        }
        if !(self.excess_oom_tightening >= 0.0 && self.excess_oom_tightening.is_finite()) {
            return bad(format!("excess_oom_tightening ({}) must be a number >= 0", self.excess_oom_tightening));
        }
        if self.stream_sort_window < self.max_targets_per_batch {
            return bad(format!(
                "stream_sort_window ({}) must be >= max_targets_per_batch ({})",
                self.stream_sort_window, self.max_targets_per_batch
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_batch_setting_reaches_the_planner() {
        let text = "[batch]\nmax_targets_per_batch = 50\nfallback_batch_size = 7\nbazel_memory = \"2GB\"\n\
                    memory_cutoff_high = \"1GB\"\nmemory_cutoff_medium = \"1.5GB\"\nmemory_cutoff_low = \"1.8GB\"\n\
                    occupancy_cutoff_esu = 40.0\noccupancy_limit_esu = 45.0\ntarget_oom_rate = 0.01\ntarget_de_rate = 0.02\n\
                    min_memory_margin = 1.2\ngroup_backoff_share = 0.1\nexcess_oom_tightening = 0.2\nstream_sort_window = 60\ntag_executor_types = { requires-tpu = \"tpu\" }\n";
        let cfg = gantry_config::Config::parse(text, "t.toml".as_ref()).unwrap().batch;
        let c = PlannerConfig::from_config(&cfg);
        assert_eq!(
            (c.max_targets_per_batch, c.fallback_batch_size, c.bazel_memory_bytes, c.stream_sort_window),
            (50, 7, 2 * GB, 60)
        );
        assert_eq!(c.memory_cutoff_bytes, MemoryCutoffs { high: GB, medium: 1_500_000_000, low: 1_800_000_000 });
        assert_eq!(
            (c.occupancy_cutoff_esu, c.occupancy_limit_esu, c.target_oom_rate, c.target_de_rate),
            (40.0, 45.0, 0.01, 0.02)
        );
        assert_eq!((c.min_memory_margin, c.group_backoff_share, c.excess_oom_tightening), (1.2, 0.1, 0.2));
        // Added to the built-in mappings, not in place of them.
        assert_eq!(c.executors.tag_types.get("requires-tpu").map(String::as_str), Some("tpu"));
        assert_eq!(c.executors.tag_types.get("requires-gpu").map(String::as_str), Some("gpu"));
        c.validate().unwrap();
    }

    #[test]
    fn defaults_match_design() {
        let c = PlannerConfig::default();
        assert_eq!(c.max_targets_per_batch, 900);
        assert_eq!(c.fallback_batch_size, 300);
        assert_eq!(c.bazel_memory_bytes, 13 * GB);
        assert_eq!(c.memory_cutoff_bytes.for_priority(Priority::High), 7 * GB);
        assert_eq!(c.memory_cutoff_bytes.for_priority(Priority::Medium), 9 * GB);
        assert_eq!(c.memory_cutoff_bytes.for_priority(Priority::Low), 10 * GB);
        assert_eq!(c.occupancy_cutoff_esu, 500.0);
        assert_eq!(c.occupancy_limit_esu, 600.0);
        assert_eq!(c.min_memory_margin, 1.37);
        assert_eq!(c.group_backoff_share, 0.3);
        assert_eq!(c.excess_oom_tightening, 0.05);
        c.validate().unwrap();
    }

    #[test]
    fn config_validation_rejects_nonsense() {
        let mut c = PlannerConfig::default();
        c.memory_cutoff_bytes.low = 14 * GB;
        assert!(c.validate().unwrap_err().to_string().contains("low"));
        let c = PlannerConfig { occupancy_cutoff_esu: 700.0, ..PlannerConfig::default() };
        assert!(c.validate().unwrap_err().to_string().contains("occupancy cutoff"));
        let c = PlannerConfig { max_targets_per_batch: 0, ..PlannerConfig::default() };
        assert!(c.validate().unwrap_err().to_string().contains("max_targets_per_batch"));
        let c = PlannerConfig { stream_sort_window: 10, ..PlannerConfig::default() };
        assert!(c.validate().unwrap_err().to_string().contains("stream_sort_window"));
        for m in [0.9, f64::NAN, f64::INFINITY] {
            let c = PlannerConfig { min_memory_margin: m, ..PlannerConfig::default() };
            assert!(c.validate().unwrap_err().to_string().contains("min_memory_margin"), "{m}");
        }
        for s in [-0.1, 1.0, f64::NAN] {
            let c = PlannerConfig { group_backoff_share: s, ..PlannerConfig::default() };
            assert!(c.validate().unwrap_err().to_string().contains("group_backoff_share"), "{s}");
        }
        for k in [-0.01, f64::NAN, f64::INFINITY] {
            let c = PlannerConfig { excess_oom_tightening: k, ..PlannerConfig::default() };
            assert!(c.validate().unwrap_err().to_string().contains("excess_oom_tightening"), "{k}");
        }
    }

    #[test]
    fn context_source_rules() {
        let mut ctx = BuildContext::new_workspace("ws", Command::Build, Priority::Low);
        ctx.validate().unwrap();
        ctx.git_repo = Some("r".into());
        assert!(ctx.validate().unwrap_err().to_string().contains("not both"));
        ctx.workspace = None;
        assert!(ctx.validate().unwrap_err().to_string().contains("without `revision`"));
        ctx.revision = Some("abc".into());
        ctx.validate().unwrap();
        ctx.flags = vec!["jobs=3".into()];
        assert!(ctx.validate().unwrap_err().to_string().contains("jobs=3"));
    }

    #[test]
    fn reason_serde_names() {
        for r in BatchSizeReason::ALL {
            let s = serde_json::to_string(&r).unwrap();
            assert_eq!(s, format!("\"{}\"", r.as_str()));
            let back: BatchSizeReason = serde_json::from_str(&s).unwrap();
            assert_eq!(back, r);
        }
    }
}
