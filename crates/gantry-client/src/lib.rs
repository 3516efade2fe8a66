//! `gantry-client` owns the client side of `gantry run`: turning a command line with
//! declared inputs and outputs into a REAPI Action (`action`), remembering file digests
//! and per-command-shape race history in a small local database (`history`), staging and
//! moving outputs (`stage`), and driving one race between local and remote execution
//! (`driver`).
//!
//! What to do next in a race is decided by `gantry_dynamic::coordinator`; this crate only
//! carries its commands out and reports what happened back to it.

pub mod action;
pub mod driver;
pub mod history;
pub mod stage;

mod error;

pub use action::CommandLine;
pub use driver::{run, stats, DelayChoice, RemoteTarget, RunReport, RunSpec};
pub use error::{Error, Result};
