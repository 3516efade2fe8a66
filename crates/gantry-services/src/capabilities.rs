//! Capabilities: what this server offers, so clients pick digest functions, batch sizes
//! and compression that will work.

use gantry_core::auth::{require, Permission};
use gantry_core::reapi::capabilities_server::Capabilities;
use gantry_core::reapi::{self, compressor, digest_function, symlink_absolute_path_strategy};
use gantry_core::DigestFunction;
use tonic::{Request, Response, Status};

pub struct CapabilitiesService {
    max_batch_size: u64,
    /// Largest blob the CAS can hold at all (its capacity).
    max_blob_size: u64,
    /// Execution capabilities, set once an execution service is mounted.
    execution: Option<reapi::ExecutionCapabilities>,
}

impl CapabilitiesService {
    pub fn new(max_batch_size: u64, max_blob_size: u64, execution: Option<reapi::ExecutionCapabilities>) -> Self {
        CapabilitiesService { max_batch_size, max_blob_size, execution }
    }
}

#[tonic::async_trait]
impl Capabilities for CapabilitiesService {
    async fn get_capabilities(
        &self,
        request: Request<reapi::GetCapabilitiesRequest>,
    ) -> Result<Response<reapi::ServerCapabilities>, Status> {
        require(&request, Permission::Read, &request.get_ref().instance_name)?;
        let zstd = vec![compressor::Value::Zstd as i32];
        let cache = reapi::CacheCapabilities {
            digest_functions: DigestFunction::ALL.iter().map(|f| f.to_proto()).collect(),
            action_cache_update_capabilities: Some(reapi::ActionCacheUpdateCapabilities { update_enabled: true }),
            cache_priority_capabilities: None,
            max_batch_total_size_bytes: self.max_batch_size as i64,
            symlink_absolute_path_strategy: symlink_absolute_path_strategy::Value::Allowed as i32,
            supported_compressors: zstd.clone(),
            supported_batch_update_compressors: zstd,
            max_cas_blob_size_bytes: self.max_blob_size as i64,
            split_blob_support: false,
            splice_blob_support: false,
            ..Default::default()
        };
        let version = |minor| gantry_core::semver::SemVer { major: 2, minor, patch: 0, prerelease: String::new() };
        Ok(Response::new(reapi::ServerCapabilities {
            cache_capabilities: Some(cache),
            execution_capabilities: self.execution.clone().or(Some(reapi::ExecutionCapabilities {
                digest_function: digest_function::Value::Sha256 as i32,
                exec_enabled: false,
                ..Default::default()
            })),
            deprecated_api_version: None,
            low_api_version: Some(version(0)),
            high_api_version: Some(version(3)),
        }))
    }
}
