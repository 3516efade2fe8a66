//! A worker in its own process, connected to a scheduler over gRPC: one Session stream,
//! heartbeats every few seconds, and reconnection with backoff if the stream breaks.

use std::sync::Arc;
use std::time::Duration;

use gantry_core::client::GrpcChannel as Channel;
use gantry_core::{Error, Result};
use gantry_proto::worker::v1 as wpb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::{run_worker, Executor};

pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(3);

/// Runs one session until it ends; returns why.
pub async fn session(channel: Channel, register: wpb::Register, executor: Arc<Executor>) -> Result<()> {
    let (report_tx, report_rx) = mpsc::unbounded_channel::<wpb::WorkerMessage>();
    report_tx
        .send(wpb::WorkerMessage { kind: Some(wpb::worker_message::Kind::Register(register)) })
        .expect("receiver alive");
    // Assignments carry the whole Command: one with many outputs can pass 4 MiB.
    let mut client = wpb::worker_service_client::WorkerServiceClient::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    let mut inbound = client
        .session(UnboundedReceiverStream::new(report_rx))
        .await
        .map_err(|s| Error::Unavailable(format!("opening the worker session: {}", s.message())))?
        .into_inner();
    let hb = report_tx.clone();
    let heartbeats = tokio::spawn(async move {
        let mut tick = tokio::time::interval(HEARTBEAT_INTERVAL);
        loop {
            tick.tick().await;
            if hb
                .send(wpb::WorkerMessage { kind: Some(wpb::worker_message::Kind::Heartbeat(wpb::Heartbeat {})) })
                .is_err()
            {
                return;
            }
        }
    });
    let (msg_tx, msg_rx) = mpsc::unbounded_channel();
    let worker = tokio::spawn(run_worker(msg_rx, report_tx, executor));
    let res = loop {
        match inbound.message().await {
            Ok(Some(m)) => {
                if msg_tx.send(m).is_err() {
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
