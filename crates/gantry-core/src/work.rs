//! What the scheduler tells a worker, as values: an action to run (its Action and
//! Command decoded) or a cancellation. A remote worker gets these from the worker
//! protocol, decoded once at its end of the wire; an in-process worker gets them straight
//! from the scheduler, never encoded at all.

use std::sync::Arc;
use std::time::Duration;

use crate::reapi;
use crate::{DigestFunction, Error};

/// One action for a worker to run.
#[derive(Debug, Clone)]
pub struct Work {
    /// What the worker reports the run under (an operation's name, or its hedge copy's).
    pub job_id: String,
    pub function: DigestFunction,
    /// Shared with the scheduler's copy: an in-process worker gets them without a copy.
    pub action: Arc<reapi::Action>,
    pub command: Arc<reapi::Command>,
    /// The run's limit; the worker kills it past this.
    pub timeout: Duration,
}

/// A message from the scheduler to a worker.
#[derive(Debug)]
pub enum Order {
    Run(Box<Work>),
    /// An assignment that could not be read (a remote worker's undecodable message): the
    /// worker reports it failed with this error, so the scheduler is not left waiting.
    Refuse {
        job_id: String,
        error: Error,
    },
    Cancel {
        job_id: String,
    },
}
