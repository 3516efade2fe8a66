//! `gantry.worker.v1.WorkerService`: separate `gantry worker` processes connect here.
//! The first message registers the worker; after that, heartbeats and execution reports
//! flow up and assignments flow down. However the session ends (clean close, broken
//! connection, SIGKILLed worker), the worker is declared lost and its actions re-queued.

use std::sync::Arc;

use futures::StreamExt;
use gantry_core::task::{spawn_named, GuardedStream};
use gantry_proto::worker::v1 as wpb;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::scheduler::Scheduler;

pub struct WorkerService {
    scheduler: Arc<Scheduler>,
}

impl WorkerService {
    pub fn new(scheduler: Arc<Scheduler>) -> Self {
        WorkerService { scheduler }
    }
}

/// Declares the worker lost when the session's reader stops, however it stops.
struct LostOnDrop {
    scheduler: Arc<Scheduler>,
    worker: String,
    why: &'static str,
}

impl Drop for LostOnDrop {
    fn drop(&mut self) {
        self.scheduler.worker_lost(&self.worker, self.why);
    }
}

type Outbound = GuardedStream<futures::stream::BoxStream<'static, Result<wpb::SchedulerMessage, Status>>>;

#[tonic::async_trait]
impl wpb::worker_service_server::WorkerService for WorkerService {
    type SessionStream = Outbound;

    async fn session(&self, request: Request<Streaming<wpb::WorkerMessage>>) -> Result<Response<Outbound>, Status> {
        gantry_core::auth::require_worker(&request)?;
        let mut inbound = request.into_inner();
        let first = inbound.message().await?.ok_or_else(|| Status::invalid_argument("empty worker session"))?;
        let Some(wpb::worker_message::Kind::Register(reg)) = first.kind else {
            return Err(Status::invalid_argument("the first worker message must be register"));
        };
        let link = self.scheduler.register(reg, false)?;
        let scheduler = self.scheduler.clone();
        let worker = link.id.clone();
        let reader = spawn_named("worker-session", async move {
            let mut lost = LostOnDrop { scheduler: scheduler.clone(), worker: worker.clone(), why: "session dropped" };
            loop {
                match inbound.message().await {
                    Ok(Some(m)) => match m.kind {
                        Some(wpb::worker_message::Kind::Heartbeat(_)) => scheduler.heartbeat(&worker),
                        Some(wpb::worker_message::Kind::Started(s)) => scheduler.started(&worker, &s.job_id),
                        Some(wpb::worker_message::Kind::Finished(f)) => {
                            // Its own task: a result must be saved even if this session is
                            // aborted meanwhile, and heartbeats must not wait on the database.
                            // Decoded at this end of the wire (an in-process worker's report
                            // never is), in that task too, so heartbeats do not wait on it.
                            let (s, w) = (scheduler.clone(), worker.clone());
                            tokio::spawn(async move { s.finished(&w, gantry_core::Finished::from_wire(f)).await });
                        }
                        Some(wpb::worker_message::Kind::Register(_)) | None => {
                            tracing::warn!(%worker, "ignoring an unexpected worker message");
                        }
                    },
                    Ok(None) => {
                        lost.why = "session closed";
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(%worker, error = %e, "worker session broke");
                        lost.why = "connection lost";
                        return;
                    }
                }
            }
        });
        // At shutdown the session ends with UNAVAILABLE: the worker reconnects with backoff
        // (to this scheduler restarted) instead of stopping, and the server can drain.
        // Encoded here, in the session's stream, outside the scheduler's lock.
        let out = UnboundedReceiverStream::new(link.messages)
            .map(|m| Ok(m.to_wire()))
            .take_until(self.scheduler.stopped())
            .chain(futures::stream::once(async {
                Err(Status::unavailable("the scheduler is shutting down; reconnect"))
            }))
            .boxed();
        Ok(Response::new(GuardedStream::new(out, reader)))
    }
}
