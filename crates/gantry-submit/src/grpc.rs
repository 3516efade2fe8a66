//! `gantry.queue.v1.SubmitQueue`. The endpoint is part of the server from the start; the
//! queue attaches once it has started (it needs the server's own address for Bazel's
//! `--remote_executor`). Until then, or without `[queue] repository`, calls answer
//! UNAVAILABLE.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};

use futures::Stream;
use gantry_proto::queue::v1 as pb;
use tonic::{Request, Response, Status};

use crate::service::QueueService;

#[derive(Default)]
pub struct QueueEndpoint {
    queue: OnceLock<Arc<QueueService>>,
}

impl QueueEndpoint {
    pub fn attach(&self, queue: Arc<QueueService>) {
        let _ = self.queue.set(queue);
    }

    pub fn queue(&self) -> Option<&Arc<QueueService>> {
        self.queue.get()
    }

    fn get(&self) -> Result<&Arc<QueueService>, Status> {
        self.queue.get().ok_or_else(|| {
            Status::unavailable("the submit queue is not enabled on this server ([queue] repository is unset)")
        })
    }
}

#[tonic::async_trait]
impl pb::submit_queue_server::SubmitQueue for QueueEndpoint {
    async fn submit(&self, req: Request<pb::SubmitRequest>) -> Result<Response<pb::Change>, Status> {
        gantry_core::auth::require_somewhere(&req, gantry_core::auth::Permission::Queue)?;
        let r = req.into_inner();
        Ok(Response::new(self.get()?.submit(&r.change_ref, r.priority).await?))
    }

    async fn get_status(&self, req: Request<pb::GetStatusRequest>) -> Result<Response<pb::QueueStatus>, Status> {
        gantry_core::auth::require_somewhere(&req, gantry_core::auth::Permission::Queue)?;
        Ok(Response::new(self.get()?.status().await?))
    }

    type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::Change, Status>> + Send>>;

    async fn watch(&self, req: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        gantry_core::auth::require_somewhere(&req, gantry_core::auth::Permission::Queue)?;
        let id = req.into_inner().change_id;
        Ok(Response::new(Box::pin(self.get()?.watch(&id).await?)))
    }

    async fn cancel(&self, req: Request<pb::CancelRequest>) -> Result<Response<pb::Change>, Status> {
        gantry_core::auth::require_somewhere(&req, gantry_core::auth::Permission::Queue)?;
        Ok(Response::new(self.get()?.cancel(&req.into_inner().change_id).await?))
    }

    async fn history(&self, req: Request<pb::HistoryRequest>) -> Result<Response<pb::HistoryResponse>, Status> {
        gantry_core::auth::require_somewhere(&req, gantry_core::auth::Permission::Queue)?;
        Ok(Response::new(self.get()?.history(req.into_inner().limit as usize).await?))
    }
}
