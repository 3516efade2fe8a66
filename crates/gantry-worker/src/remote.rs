//! A worker in its own process, connected to a scheduler over gRPC: one Session stream,
//! heartbeats every few seconds, and reconnection with backoff if the stream breaks.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gantry_core::client::GrpcChannel as Channel;
use gantry_core::reapi;
use gantry_core::{DigestFunction, Error, Order, Report, Result, Work};
use gantry_proto::worker::v1 as wpb;
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::{run_worker, Executor};

pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(3);

/// A scheduler's message as the worker's values: the Action and Command decoded here,
/// once. An assignment that does not decode is refused (reported failed), not dropped,
/// so the scheduler is not left waiting for it. None: a message of a kind this worker
/// does not know.
pub fn order_from_wire(m: wpb::SchedulerMessage) -> Option<Order> {
    Some(match m.kind? {
        wpb::scheduler_message::Kind::Assignment(a) => {
            let decoded = (|| -> Result<Work> {
                Ok(Work {
                    function: DigestFunction::from_proto(a.digest_function)?,
                    action: reapi::Action::decode(a.action.as_slice())
                        .map_err(|e| Error::invalid(format!("action: {e}")))?
                        .into(),
                    command: reapi::Command::decode(a.command.as_slice())
                        .map_err(|e| Error::invalid(format!("command: {e}")))?
                        .into(),
                    // A scheduler always sends its resolved timeout; 0 is an old one's "none".
                    timeout: match a.timeout_ms {
                        0 => gantry_config::ExecutionConfig::default().default_timeout,
                        ms => Duration::from_millis(ms),
                    },
                    job_id: a.job_id.clone(),
                })
            })();
            match decoded {
                Ok(w) => Order::Run(Box::new(w)),
                Err(error) => Order::Refuse { job_id: a.job_id, error },
            }
        }
        wpb::scheduler_message::Kind::Cancel(c) => Order::Cancel { job_id: c.job_id },
    })
}

/// Runs one session until it ends; returns why.
pub async fn session(channel: Channel, register: wpb::Register, executor: Arc<Executor>) -> Result<()> {
    let (report_tx, report_rx) = mpsc::unbounded_channel::<Report>();
    // Register first; then every report, encoded here, at the wire.
    let register = wpb::WorkerMessage { kind: Some(wpb::worker_message::Kind::Register(register)) };
    let outbound =
        futures::stream::once(async { register }).chain(UnboundedReceiverStream::new(report_rx).map(Report::into_wire));
    // Assignments carry the whole Command: one with many outputs can pass 4 MiB.
    let mut client = wpb::worker_service_client::WorkerServiceClient::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    let mut inbound = client
        .session(outbound)
        .await
        .map_err(|s| Error::Unavailable(format!("opening the worker session: {}", s.message())))?
        .into_inner();
    let hb = report_tx.clone();
    let heartbeats = tokio::spawn(async move {
        let mut tick = tokio::time::interval(HEARTBEAT_INTERVAL);
        loop {
            tick.tick().await;
            if hb.send(Report::Heartbeat).is_err() {
                return;
            }
        }
    });
    let (msg_tx, msg_rx) = mpsc::unbounded_channel();
    let worker = tokio::spawn(run_worker(msg_rx, report_tx, executor));
    let res = loop {
        match inbound.message().await {
            Ok(Some(m)) => {
                let Some(order) = order_from_wire(m) else { continue };
                if msg_tx.send(order).is_err() {
                    break Ok(());
                }
            }
            Ok(None) => break Err(Error::Unavailable("the scheduler closed the session".into())),
            Err(s) => break Err(Error::Unavailable(format!("session broke: {}", s.message()))),
        }
    };
    drop(msg_tx);
    heartbeats.abort();
    worker.abort();
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assignment(action: Vec<u8>, timeout_ms: u64) -> wpb::SchedulerMessage {
        wpb::SchedulerMessage {
            kind: Some(wpb::scheduler_message::Kind::Assignment(wpb::Assignment {
                job_id: "operations/a".into(),
                digest_function: DigestFunction::Sha256.to_proto(),
                action,
                command: reapi::Command { arguments: vec!["true".into()], ..Default::default() }.encode_to_vec(),
                timeout_ms,
                ..Default::default()
            })),
        }
    }

    #[test]
    fn assignments_are_decoded_once_at_the_wire_and_bad_ones_refused() {
        let action = reapi::Action { do_not_cache: true, ..Default::default() };
        match order_from_wire(assignment(action.encode_to_vec(), 0)) {
            Some(Order::Run(w)) => {
                assert_eq!((w.job_id.as_str(), w.action.do_not_cache), ("operations/a", true));
                assert_eq!(w.command.arguments, ["true"]);
                assert_eq!(w.timeout, Duration::from_secs(3600), "0 is no timeout given");
            }
            other => panic!("{other:?}"),
        }
        match order_from_wire(assignment(vec![0xff; 8], 5000)) {
            Some(Order::Refuse { job_id, error }) => {
                assert_eq!(job_id, "operations/a");
                assert_eq!(error.code(), tonic::Code::InvalidArgument);
                assert!(error.to_string().contains("action"), "{error}");
            }
            other => panic!("{other:?}"),
        }
        let cancel = wpb::SchedulerMessage {
            kind: Some(wpb::scheduler_message::Kind::Cancel(wpb::Cancel { job_id: "x".into() })),
        };
        assert!(matches!(order_from_wire(cancel), Some(Order::Cancel { job_id }) if job_id == "x"));
        assert!(order_from_wire(wpb::SchedulerMessage { kind: None }).is_none());
    }
}
