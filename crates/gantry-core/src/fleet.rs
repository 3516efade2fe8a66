//! A live view of the executor fleet: the workers with what they run, and the queues.
//! The scheduler owns the state and answers [`Fleet::snapshot`]; the web pages read it
//! through this trait, so they never depend on the scheduler.

/// One platform property, `name=value`.
pub type PropertyPair = (String, String);

/// The fleet at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FleetSnapshot {
    pub workers: Vec<WorkerView>,
    /// Every queue with something waiting: by required platform and size class.
    pub queues: Vec<QueueView>,
    /// Actions waiting for a slot, in all queues.
    pub queued: usize,
    /// Runs on workers (a hedged action counts twice while both its runs go on).
    pub running: usize,
}

/// A registered worker.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerView {
    pub name: String,
    pub size_class: u32,
    pub slots: usize,
    /// Slots taken: running actions, and runs taken back that it has not reported yet.
    pub busy: usize,
    /// What it offers.
    pub platform: Vec<PropertyPair>,
    /// Milliseconds since its last heartbeat or report.
    pub last_seen_ms: u64,
    /// Runs inside the server's process (it cannot be lost to the network).
    pub local: bool,
    /// How it measures memory ("cgroup-v2", "cgroup-v1" or "rusage").
    pub metering: String,
    pub running: Vec<RunningView>,
}

/// An action running on a worker.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunningView {
    pub operation: String,
    pub instance: String,
    /// `{hash}/{size}` of the action.
    pub action_digest: String,
    pub mnemonic: String,
    pub target: String,
    pub tool_invocation_id: String,
    /// Milliseconds since it was handed to the worker.
    pub running_ms: u64,
    /// This run is a hedge copy on the largest class.
    pub hedge: bool,
}

/// Actions waiting for one (platform, size class).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueueView {
    pub platform: Vec<PropertyPair>,
    /// None: any size class will do.
    pub size_class: Option<u32>,
    pub depth: usize,
}

/// Whatever can say what the fleet is doing now.
pub trait Fleet: Send + Sync + 'static {
    /// A consistent snapshot, taken at once (it costs one pass over workers and queues).
    fn snapshot(&self) -> FleetSnapshot;
}
