//! `gantry-queue`: the pure planning core of gantry's submit queue.
//!
//! Keeps the mainline green by building every change on the exact tree it will
//! land on, speculating on the outcomes of the changes ahead of it (after
//! Uber's SubmitQueue, "Keeping Master Green at Scale", EuroSys 2019).
//!
//! * [`planner`]: the event-driven state machine ([`Planner::handle`]).
//! * [`conflict`]: affected targets and independence from target graphs.
//! * [`model`]: logistic-regression P(success) model with serde persistence.
//! * [`sim`]: discrete-event simulator running the real planner against
//!   baselines and an oracle.
//!
//! Nothing here performs I/O, talks to git, Bazel or a database, or reads a
//! clock: the integrator feeds events with timestamps and executes actions.

pub mod conflict;
pub mod error;
pub mod model;
pub mod planner;
pub mod sim;
pub mod types;

pub use conflict::{ChangeAnalysis, ConflictAnalyzer, TargetGraph, TargetNode};
pub use error::QueueError;
pub use model::{ChangeFeatures, FeatureVector, LogisticModel, TrainParams, TrainingExample};
pub use planner::{FlakyTarget, PendingView, Planner, PlannerConfig, PlannerStats, Strategy};
pub use types::{Action, BuildId, BuildOutcome, BuildSpec, ChangeId, Event, LandProof, Millis, RejectReason};
