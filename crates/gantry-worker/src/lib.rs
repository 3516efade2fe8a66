//! gantry-worker owns running actions: `Executor` turns an assignment into an
//! ActionResult (inputs materialized from a local CAS cache with hard links, the command
//! run in its own process group, started and reaped by the worker's small spawner process, and its own cgroup where the machine allows, with its
//! timeout and size class's limits enforced and its resources metered, outputs uploaded
//! and kept in the input cache by link), and `run_worker` serves assignments from a scheduler, in-process or
//! over gRPC (`remote`).

pub mod cgroup;
pub mod executor;
mod launch;
pub mod materialize;
pub mod open_files;
pub mod outputs;
pub mod process;
pub mod remote;
pub mod session;
pub mod spare_dirs;
pub mod spawner;

pub use executor::Executor;
pub use session::run_worker;

/// Files at most this large are read, hashed or copied on the runtime's own thread: a
/// handoff to the blocking pool and back costs more than that work, and a no-op action
/// made several of them.
pub(crate) const INLINE_FILE_BYTES: u64 = 64 << 10;

/// Runs `f` on this thread when `small` says it cannot wait long (a few metadata calls,
/// a file of at most [`INLINE_FILE_BYTES`]), else on the blocking pool.
pub(crate) async fn blocking_unless_small<T: Send + 'static>(
    small: bool,
    f: impl FnOnce() -> gantry_core::Result<T> + Send + 'static,
) -> gantry_core::Result<T> {
    if small {
        // A tree of many small outputs is many such calls in a row: the task still yields
        // to others when its budget is spent.
        tokio::task::coop::consume_budget().await;
        return f();
    }
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| gantry_core::Error::internal(format!("blocking task failed: {e}")))?
}

/// Properties every gantry worker offers.
pub fn base_properties() -> Vec<(String, String)> {
    vec![("OSFamily".into(), "linux".into()), ("ISA".into(), "x86-64".into())]
}
