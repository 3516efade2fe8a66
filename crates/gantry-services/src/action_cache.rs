//! ActionCache: GetActionResult and UpdateActionResult over the `ActionCache` trait.
//! Instance names partition the cache.

use gantry_core::auth::{require, Permission};
use std::sync::Arc;

use gantry_core::action_cache::referenced_blobs;
use gantry_core::reapi::action_cache_server::ActionCache as ActionCacheRpc;
use gantry_core::reapi::{self, ActionResult};
use gantry_core::{ActionCache, BlobStore, Digest, DigestFunction, Error, Result};
use tonic::{Request, Response, Status};

use crate::cache_hits::{tool_invocation_id, CacheHits};
use crate::metrics::Metrics;

/// stdout/stderr/file contents are inlined on request only up to this size in total,
/// so a response never approaches the gRPC message limit.
const MAX_INLINE_BYTES: u64 = 1 << 20;

pub struct ActionCacheService {
    ac: Arc<dyn ActionCache>,
    cas: Arc<dyn BlobStore>,
    metrics: Arc<Metrics>,
    /// Hits per Bazel invocation, for the Build Event Service to store with it.
    hits: Option<Arc<CacheHits>>,
}

impl ActionCacheService {
    pub fn new(ac: Arc<dyn ActionCache>, cas: Arc<dyn BlobStore>, metrics: Arc<Metrics>) -> Self {
        ActionCacheService { ac, cas, metrics, hits: None }
    }

    /// Counts each answered GetActionResult in `hits` under the RequestMetadata's invocation.
    pub fn with_cache_hits(mut self, hits: Arc<CacheHits>) -> Self {
        self.hits = Some(hits);
        self
    }

    async fn inline(&self, f: DigestFunction, req: &reapi::GetActionResultRequest, r: &mut ActionResult) -> Result<()> {
        let mut budget = MAX_INLINE_BYTES;
        let mut fetch = async |d: &Option<reapi::Digest>, field: &str| -> Result<Option<Vec<u8>>> {
            let Some(pd) = d else { return Ok(None) };
            let d = Digest::from_proto(f, Some(pd), field)?;
            if d.size > budget {
                return Ok(None);
            }
            budget -= d.size;
            Ok(Some(self.cas.get(&d).await?.to_vec()))
        };
        if req.inline_stdout
            && r.stdout_raw.is_empty()
            && let Some(b) = fetch(&r.stdout_digest, "stdout_digest").await?
        {
            r.stdout_raw = b;
        }
        if req.inline_stderr
            && r.stderr_raw.is_empty()
            && let Some(b) = fetch(&r.stderr_digest, "stderr_digest").await?
        {
            r.stderr_raw = b;
        }
        for o in r.output_files.iter_mut() {
            if req.inline_output_files.contains(&o.path)
                && let Some(b) = fetch(&o.digest, "output file").await?
            {
                o.contents = b;
            }
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl ActionCacheRpc for ActionCacheService {
    async fn get_action_result(
        &self,
        request: Request<reapi::GetActionResultRequest>,
    ) -> Result<Response<ActionResult>, Status> {
        require(&request, Permission::Read, &request.get_ref().instance_name)?;
        let invocation = if self.hits.is_some() { tool_invocation_id(&request) } else { String::new() };
        let req = request.into_inner();
        let f = DigestFunction::from_proto(req.digest_function)?;
        let d = Digest::from_proto(f, req.action_digest.as_ref(), "action_digest")?;
        let found = self.ac.get(&req.instance_name, &d).await?;
        // Only answered lookups count: a store error is no statement about the cache.
        if let Some(h) = &self.hits {
            h.record(&invocation, found.is_some());
        }
        match found {
            Some(mut r) => {
                self.metrics.ac_hits.inc();
                self.inline(f, &req, &mut r).await?;
                Ok(Response::new(r))
            }
            None => {
                self.metrics.ac_misses.inc();
                Err(Status::not_found(format!("no action result for {d} in instance '{}'", req.instance_name)))
            }
        }
    }

    async fn update_action_result(
        &self,
        request: Request<reapi::UpdateActionResultRequest>,
    ) -> Result<Response<ActionResult>, Status> {
        require(&request, Permission::WriteAc, &request.get_ref().instance_name)?;
        let req = request.into_inner();
        let f = DigestFunction::from_proto(req.digest_function)?;
        let d = Digest::from_proto(f, req.action_digest.as_ref(), "action_digest")?;
        let result = req.action_result.ok_or_else(|| Error::invalid("action_result: missing"))?;
        // Reject malformed digests now: a stored entry that can never be served helps nobody.
        referenced_blobs(f, &result).map_err(|e| e.context("action_result"))?;
        self.ac.put(&req.instance_name, &d, &result).await?;
        Ok(Response::new(result))
    }
}
