//! `gantry-batch`: the planning half of gantry's build target batching
//! service.
//!
//! Given a build context and a stream of targets, the planner groups targets
//! by the executor types they need, sorts each group by label, and cuts it
//! into builds (Algorithm 1) whose predicted Bazel peak heap stays under a
//! per-priority cutoff and whose predicted executor occupancy stays under an
//! occupancy cutoff. The predictions come from the shared-cost model
//! ([`shared`]): non-negative costs per target, package and directory, each
//! charged once per build, scaled and based by the build's context, so that
//! adding a target never lowers an estimate. The linear models over hashed
//! build and target features ([`model`]) are the earlier learner, kept beside
//! it.
//!
//! Module map:
//! * [`label`]: Bazel label validation and decomposition.
//! * [`types`]: context, targets, batches, reasons, planner config.
//! * [`executor`]: executor-type derivation and grouping.
//! * [`planner`]: Algorithm 1, [`plan`] and [`StreamingPlanner`].
//! * [`features`]: feature families, hashing, crosses, count buckets.
//! * [`model`]: training, [`Models`] save/load, [`MemoryEstimator`].
//! * [`eval`]: error report of models against history.
//! * [`shared`]: the shared-cost learner, the planner's default.
//! * [`margin`]: a model's held-out error distribution and the safety margin it implies.
//! * [`feedback`]: the recent builds' error per tool, and the estimator that corrects by it.
//! * [`history`]: history JSONL and RFC 3339 timestamps.
//! * [`formats`]: `targets.txt`, context JSON, batch JSONL.
//! * [`sim`]: synthetic monorepo workload, ground truth, scoring, bench.

pub mod error;
pub mod eval;
pub mod executor;
pub mod features;
pub mod feedback;
pub mod formats;
pub mod history;
pub mod label;
pub mod margin;
pub mod model;
pub mod planner;
pub mod shared;
pub mod sim;
pub mod types;

pub use error::{BatchError, Result};
pub use eval::{eval, EvalReport};
pub use executor::{executor_types, group_targets};
pub use feedback::{Corrected, Ended, Feedback};
pub use formats::{parse_context, parse_targets, read_targets, write_batches};
pub use history::{parse_history, read_history, BuildRecord, Outcome, Timestamp};
pub use label::{parse_label, validate_label, Label};
pub use model::{train, LinearModel, MemoryEstimator, ModelKind, Models, TrainConfig};
pub use planner::{plan, Estimator, GroupEstimator, StreamingPlanner};
pub use types::{
    Batch, BatchSizeReason, BuildContext, Command, ExecutorConfig, ExecutorSet, MemoryCutoffs, PlannerConfig, Priority,
    Target, GB,
};
