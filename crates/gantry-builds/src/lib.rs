//! `gantry-builds` owns running the batching service's builds: a pool of Bazel runners
//! (one warm output base each) that run planned builds against gantry's executor with a
//! deadline, stopping early a build whose server is stuck out of memory (a GC death
//! spiral), the classification of how each build ended and what said OOM, its labels
//! (Bazel's heap, the server's peak RSS, executor occupancy from gantry's invocation
//! records), the build record in the metadata store, the retries (split an OOM build in
//! half and plan each half again, rerun a deadline-exceeded build once), the learning
//! loop that retrains the planner's models from that record and swaps them in, and the
//! feedback of the builds the current models planned, which new plans start with.
//!
//! The decisions are pure and tested directly ([`classify`], [`bep`], the stuck-server
//! rules in [`stuck`]); [`runner`] and [`service`] do the I/O.

pub mod bep;
pub mod classify;
pub mod error;
pub mod procfs;
pub mod runner;
pub mod service;
pub mod stuck;
pub mod workspace;

pub use classify::{classify, oom_signal, BuildOutcome, OomSignal};
pub use error::BuildsError;
pub use service::{
    learner_of, read_history, BuildDoc, BuildService, BuildState, MemoryLabel, RetryKind, ServiceSettings,
    SharedModels, TrainSummary,
};
