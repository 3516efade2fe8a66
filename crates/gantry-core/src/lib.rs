//! gantry-core owns the vocabulary shared by every gantry crate: content digests and the
//! hash functions behind them, the error type (which maps to gRPC codes and keeps its
//! details), ByteStream resource names, every storage trait (`BlobStore` with its
//! `BlobWriter`, `ActionCache`, `ExecutionLog`, `SizeClassStore`, `BuildStore`,
//! `QueueStore`, `InvocationStore`), the live `Fleet` view the scheduler gives, the
//! `Work` and `Order`s it hands workers, `client::connect`, the one way to open a
//! channel to a gantry, and `crash::point`, the crash points tests fire.
//!
//! Backends live in `gantry-store` and services in `gantry-services`; services only ever see
//! the traits defined here, so they never compile against a particular backend.

pub mod action_cache;
pub mod auth;
pub mod blob_store;
pub mod build_store;
pub mod client;
pub mod crash;
pub mod digest;
pub mod error;
pub mod execution_log;
pub mod fleet;
pub mod invocation_store;
pub mod queue_store;
pub mod request_metadata;
pub mod resource;
pub mod task;
pub mod work;

pub use action_cache::ActionCache;
pub use blob_store::{BlobStore, BlobStream, BlobWriter, StoreUsage};
pub use build_store::{BuildQuery, BuildRow, BuildStore};
pub use digest::{Digest, DigestFunction, Hasher};
pub use error::{Error, Result, ResultExt};
pub use execution_log::{
    order_actions, path_back_by_pages, predecessor_bound, ActionOrder, ActionRecord, ClassRuns, ExecutionLog,
    InvocationSummary, RunsOf, SizeClassStore, ESU_MEMORY_BYTES, PATH_TOLERANCE_MS,
};
pub use fleet::{Fleet, FleetSnapshot, QueueView, RunningView, WorkerView};
pub use invocation_store::{CacheCounts, Invocation, InvocationStore, TargetOutcome, TestOutcome};
pub use queue_store::{LandingRow, QueueDocRow, QueueEventRow, QueueForget, QueueSnapshotRow, QueueStore};
pub use task::TaskGuard;
pub use work::{Finished, Metering, Order, Report, Work};

/// Re-export of the generated REAPI types so downstream crates name one path.
pub use bazel_remote_apis::build::bazel::remote::execution::v2 as reapi;
pub use bazel_remote_apis::build::bazel::semver;
pub use bazel_remote_apis::google;
