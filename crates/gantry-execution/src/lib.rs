//! gantry-execution owns remote execution on the server side: the `Scheduler` (queue,
//! platform matching, dedup of identical in-flight actions, worker registry, re-queue of
//! actions whose worker was lost), the REAPI Execution and google.longrunning Operations
//! services on top of it, and the `WorkerService` endpoint that separate worker processes
//! connect to. In-process workers talk to the same scheduler through channels. A frontend
//! runs no scheduler: `forward` passes its Execution and Operations calls to one.

pub mod forward;
pub mod operations;
pub mod platform;
pub mod scheduler;
pub mod sizing;
pub mod worker_service;

pub use scheduler::{Scheduler, SchedulerConfig, WorkerLink};
