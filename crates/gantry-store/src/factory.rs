//! Builds the storage stack described by `gantry.toml`, and checks each backend before
//! the server accepts traffic, so a misconfigured store fails at startup with a reason.

use std::sync::Arc;

use gantry_config::{ActionCacheConfig, CasConfig, Config};
use gantry_core::{ActionCache, BlobStore, Result, ResultExt};

use crate::{CompletenessCheckingActionCache, FsStore, IntegrityStore, MemoryStore, SqlActionCache};

/// The CAS as services see it: the configured backend behind `IntegrityStore`.
pub async fn build_cas(config: &Config) -> Result<Arc<dyn BlobStore>> {
    let backend: Arc<dyn BlobStore> = match &config.cas {
        CasConfig::Fs(fs) => {
            let path = config.fs_cas_path(fs);
            Arc::new(
                FsStore::open(&path, fs.max_size.as_u64())
                    .await
                    .context(format_args!("[cas] kind = \"fs\" at {}", path.display()))?,
            )
        }
        CasConfig::Memory(m) => Arc::new(MemoryStore::new(m.max_size.as_u64())),
    };
    backend.check().await.context("[cas] startup check")?;
    Ok(Arc::new(IntegrityStore::new(backend)))
}

/// The action cache, with the completeness check in front when configured.
pub async fn build_action_cache(config: &Config, cas: Arc<dyn BlobStore>) -> Result<Arc<dyn ActionCache>> {
    match &config.action_cache {
        ActionCacheConfig::Sql(sql) => {
            let url = config.action_cache_url(sql);
            let ac: Arc<dyn ActionCache> =
                Arc::new(SqlActionCache::connect(&url).await.context(format_args!("[action_cache] url {url}"))?);
            ac.check().await.context("[action_cache] startup check")?;
            Ok(if sql.completeness_check { Arc::new(CompletenessCheckingActionCache::new(ac, cas)) } else { ac })
        }
    }
}

/// The metadata database (today always the SQL action cache's), shared by the stores below.
fn metadata_url(config: &Config) -> String {
    match &config.action_cache {
        ActionCacheConfig::Sql(sql) => config.action_cache_url(sql),
    }
}

/// The execution log, in the same database as the action cache.
pub async fn build_execution_log(config: &Config) -> Result<Arc<dyn gantry_core::ExecutionLog>> {
    let url = metadata_url(config);
    Ok(Arc::new(crate::SqlExecutionLog::connect(&url).await.context(format_args!("[action_cache] url {url}"))?))
}

/// The size-class learner's statistics, in the same database as the action cache.
pub async fn build_size_class_store(config: &Config) -> Result<Arc<dyn gantry_core::SizeClassStore>> {
    let url = metadata_url(config);
    Ok(Arc::new(crate::SqlSizeClassStore::connect(&url).await.context(format_args!("[action_cache] url {url}"))?))
}

/// The batching service's build records, in the metadata database.
pub async fn build_build_store(config: &Config) -> Result<Arc<dyn gantry_core::BuildStore>> {
    let url = metadata_url(config);
    Ok(Arc::new(crate::SqlBuildStore::connect(&url).await.context(format_args!("[action_cache] url {url}"))?))
}

/// The submit queue's state, in the metadata database.
pub async fn build_queue_store(config: &Config) -> Result<Arc<dyn gantry_core::QueueStore>> {
    let url = metadata_url(config);
    Ok(Arc::new(crate::SqlQueueStore::connect(&url).await.context(format_args!("[action_cache] url {url}"))?))
}
