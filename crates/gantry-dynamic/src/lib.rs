//! `gantry-dynamic`: the pure decision logic behind `gantry run --strategy dynamic`.
//!
//! This crate owns *what to do*, never *doing it*: there is no I/O, no process
//! handling, no gRPC and no clock in here. Every function takes the current
//! time as an argument, so the same code runs in the real driver, in tests that
//! enumerate every event interleaving, and in the simulator.
//!
//! Modules:
//! - [`coordinator`]: the race state machine (events in, driver commands out).
//! - [`audit`]: an independent checker of the race invariants over a trace of
//!   events and commands; used by the tests and usable by the driver in debug builds.
//! - [`delay`]: per-command-shape history and the learned local delay.
//! - [`race_stats`]: win/hit/time-saved counters for `gantry run --stats`.
//! - [`sim`]: a seeded, simulated-time benchmark of the strategies.

pub mod audit;
pub mod coordinator;
pub mod delay;
pub mod race_stats;
pub mod sim;

mod error;

pub use error::Error;
