//! gantry-worker owns running actions: `Executor` turns an assignment into an
//! ActionResult (inputs materialized from a local CAS cache with hard links, the command
//! run in its own process group, started and reaped by the worker's small spawner process, and its own cgroup where the machine allows, with its
//! timeout and size class's limits enforced and its resources metered, outputs uploaded), and `run_worker` serves assignments from a scheduler, in-process or
//! over gRPC (`remote`).

pub mod cgroup;
pub mod executor;
mod launch;
pub mod materialize;
pub mod outputs;
pub mod process;
pub mod remote;
pub mod session;
pub mod spawner;

pub use executor::Executor;
pub use session::run_worker;

/// Properties every gantry worker offers.
pub fn base_properties() -> Vec<(String, String)> {
    vec![("OSFamily".into(), "linux".into()), ("ISA".into(), "x86-64".into())]
}
