//! gantry-execution owns remote execution on the server side: the `Scheduler` (operations,
//! dedup of identical in-flight actions, worker registry, re-queue of actions whose worker
//! was lost) over the `Dispatcher` (queues per platform and size class, matching them to
//! free worker slots), size-class learning in `sizing`, the REAPI Execution and
//! google.longrunning Operations services on top of it, and the `WorkerService` endpoint
//! that separate worker processes connect to. In-process workers talk to the same scheduler through channels. A frontend
//! runs no scheduler: `forward` passes its Execution and Operations calls to one. `bench`
//! drives the scheduler with simulated workers for `gantry bench scheduler`.
//! `op_watch` is the channel each operation publishes its state on to its watchers.

pub mod bench;
pub mod dispatcher;
pub mod forward;
pub mod op_watch;
pub mod operations;
pub mod platform;
pub mod scheduler;
pub mod sizing;
pub mod worker_service;

pub use scheduler::{Scheduler, SchedulerConfig, ToWorker, WorkerLink};
