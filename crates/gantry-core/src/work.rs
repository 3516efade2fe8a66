//! What the scheduler and its workers tell each other, as values. The scheduler sends an
//! action to run (its Action and Command decoded) or a cancellation; a worker reports
//! that a run started and how it finished (its ActionResult decoded). A remote worker's
//! messages are encoded and decoded once, at the two ends of the worker protocol (the
//! wire forms of a report are here); an in-process worker's are never encoded at all.

use std::sync::Arc;
use std::time::Duration;

use gantry_proto::worker::v1 as wpb;
use prost::Message;

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

/// How a run's resources were measured, and what they came to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metering {
    pub peak_memory_bytes: u64,
    pub user_cpu_seconds: f64,
    pub system_cpu_seconds: f64,
    pub wall_seconds: f64,
    /// "cgroup-v2", "cgroup-v1" or "rusage".
    pub method: String,
}

/// A worker's report of how a run ended.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Finished {
    /// The `Work::job_id` it ran under.
    pub job_id: String,
    /// Present unless the action could not be run at all.
    pub action_result: Option<reapi::ActionResult>,
    /// gRPC status code: 0 for a completed run (whatever its exit code),
    /// DEADLINE_EXCEEDED for a timeout, CANCELLED, or the infrastructure error's.
    pub status_code: i32,
    pub status_message: String,
    pub metering: Option<Metering>,
    /// Human-readable notes for the ExecuteResponse's message.
    pub message: String,
    /// With FAILED_PRECONDITION: inputs missing from the CAS, as "blobs/{hash}/{size}".
    pub missing_blobs: Vec<String>,
    /// The kernel killed the run out of memory at its size class's limit.
    pub out_of_memory: bool,
}

/// A message from a worker to the scheduler.
#[derive(Debug)]
pub enum Report {
    Started { job_id: String },
    Finished(Box<Finished>),
    Heartbeat,
}

impl Finished {
    /// The worker protocol's form, for a remote worker's end of the wire.
    pub fn into_wire(self) -> wpb::ExecutionFinished {
        wpb::ExecutionFinished {
            job_id: self.job_id,
            action_result: self.action_result.map(|r| r.encode_to_vec()),
            status_code: self.status_code,
            status_message: self.status_message,
            metering: self.metering.map(|m| wpb::Metering {
                peak_memory_bytes: m.peak_memory_bytes,
                user_cpu_seconds: m.user_cpu_seconds,
                system_cpu_seconds: m.system_cpu_seconds,
                wall_seconds: m.wall_seconds,
                method: m.method,
            }),
            message: self.message,
            missing_blobs: self.missing_blobs,
            out_of_memory: self.out_of_memory,
        }
    }

    /// The report a remote worker sent, read at the scheduler's end of the wire. An
    /// ActionResult that does not decode makes a completed run (status 0) an INTERNAL
    /// failure that says so; a run that already failed (a timeout, a cancellation) keeps
    /// its status, which decides what happens next (a timeout retries on a larger size
    /// class), and its message says the result was lost.
    pub fn from_wire(f: wpb::ExecutionFinished) -> Finished {
        let mut out = Finished {
            job_id: f.job_id,
            action_result: None,
            status_code: f.status_code,
            status_message: f.status_message,
            metering: f.metering.map(|m| Metering {
                peak_memory_bytes: m.peak_memory_bytes,
                user_cpu_seconds: m.user_cpu_seconds,
                system_cpu_seconds: m.system_cpu_seconds,
                wall_seconds: m.wall_seconds,
                method: m.method,
            }),
            message: f.message,
            missing_blobs: f.missing_blobs,
            out_of_memory: f.out_of_memory,
        };
        if let Some(bytes) = f.action_result {
            match reapi::ActionResult::decode(bytes.as_slice()) {
                Ok(r) => out.action_result = Some(r),
                Err(e) if out.status_code == 0 => {
                    out.status_code = tonic::Code::Internal as i32;
                    out.status_message = format!("the worker sent an undecodable ActionResult: {e}");
                }
                Err(e) => {
                    let sep = if out.status_message.is_empty() { "" } else { "; " };
                    out.status_message =
                        format!("{}{sep}the worker sent an undecodable ActionResult: {e}", out.status_message);
                }
            }
        }
        out
    }
}

impl Report {
    /// The worker protocol's form of this report.
    pub fn into_wire(self) -> wpb::WorkerMessage {
        let kind = match self {
            Report::Started { job_id } => wpb::worker_message::Kind::Started(wpb::ExecutionStarted { job_id }),
            Report::Finished(f) => wpb::worker_message::Kind::Finished(f.into_wire()),
            Report::Heartbeat => wpb::worker_message::Kind::Heartbeat(wpb::Heartbeat {}),
        };
        wpb::WorkerMessage { kind: Some(kind) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finished() -> Finished {
        Finished {
            job_id: "operations/x#hedge".into(),
            action_result: Some(reapi::ActionResult {
                exit_code: 3,
                stdout_raw: b"out".to_vec(),
                execution_metadata: Some(reapi::ExecutedActionMetadata { worker: "w1".into(), ..Default::default() }),
                ..Default::default()
            }),
            status_code: 4,
            status_message: "timed out".into(),
            metering: Some(Metering {
                peak_memory_bytes: 7,
                user_cpu_seconds: 0.5,
                system_cpu_seconds: 0.25,
                wall_seconds: 2.0,
                method: "cgroup-v2".into(),
            }),
            message: "note".into(),
            missing_blobs: vec!["blobs/ab/1".into()],
            out_of_memory: true,
        }
    }

    #[test]
    fn a_report_crosses_the_wire_unchanged() {
        let f = finished();
        assert_eq!(Finished::from_wire(f.clone().into_wire()), f);
        let none = Finished { action_result: None, metering: None, ..finished() };
        assert_eq!(Finished::from_wire(none.clone().into_wire()), none);
    }

    #[test]
    fn an_undecodable_action_result_fails_a_completed_run_and_keeps_a_failed_runs_status() {
        let mut wire = Finished { status_code: 0, status_message: String::new(), ..finished() }.into_wire();
        wire.action_result = Some(vec![0xff, 0xff, 0xff]);
        let f = Finished::from_wire(wire);
        assert_eq!(f.action_result, None);
        assert_eq!(f.status_code, tonic::Code::Internal as i32);
        assert!(f.status_message.contains("undecodable ActionResult"), "{}", f.status_message);

        let mut wire = finished().into_wire();
        wire.action_result = Some(vec![0xff, 0xff, 0xff]);
        let f = Finished::from_wire(wire);
        assert_eq!(f.status_code, tonic::Code::DeadlineExceeded as i32, "a timeout stays a timeout");
        assert!(f.status_message.starts_with("timed out; ") && f.status_message.contains("undecodable"));
    }
}
