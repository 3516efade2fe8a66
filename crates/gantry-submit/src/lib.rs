//! `gantry-submit` owns gantry's submit queue as a running service: the queue's durable
//! state (through the `QueueStore` core trait), the git side (speculative commits, the
//! compare-and-swap that moves the mainline), the conflict analyzer's Bazel queries, the
//! builds (on `gantry-builds` runners, against gantry's executor), and the event loop
//! that feeds `gantry-queue`'s pure planner and carries out what it decides. It also
//! serves `gantry.queue.v1.SubmitQueue`.
//!
//! * [`git`]: deterministic speculative commits and landing by compare-and-swap.
//! * [`analyzer`]: `bazel query` output into the planner's target graphs.
//! * [`service`]: the queue itself (journal, replay, builds, lander, analyzer loop,
//!   retention of its journal and history).
//! * [`grpc`]: the gRPC endpoint, attachable after the server has started.
//! * [`metrics`]: the queue's Prometheus metrics.

pub mod analyzer;
pub mod error;
pub mod git;
pub mod grpc;
pub mod metrics;
pub mod service;

pub use error::SubmitError;
pub use grpc::QueueEndpoint;
pub use service::{QueueRetention, QueueService, QueueSettings, Retained};
