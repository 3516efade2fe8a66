//! Builds the storage stack described by `gantry.toml`, and checks each backend before
//! the server accepts traffic, so a misconfigured store fails at startup with a reason.

use std::sync::Arc;

use gantry_config::{ActionCacheConfig, CasConfig, Config};
use gantry_core::{ActionCache, BlobStore, Result, ResultExt};

use crate::{
    CompletenessCheckingActionCache, FsStore, IntegrityStore, MemoryStore, MetadataDb, MetadataOptions, S3Options,
    S3Store, SqlActionCache, TieredStore,
};

/// The CAS as services see it: the configured backend behind `IntegrityStore`.
pub async fn build_cas(config: &Config) -> Result<Arc<dyn BlobStore>> {
    let backend: Arc<dyn BlobStore> = match &config.cas {
        CasConfig::Fs(fs) => {
            let path = config.fs_cas_path(fs);
            Arc::new(
                FsStore::open_with_journal(&path, fs.max_size.as_u64(), fs.journal)
                    .await
                    .context(format_args!("[cas] kind = \"fs\" at {}", path.display()))?,
            )
        }
        CasConfig::Memory(m) => Arc::new(MemoryStore::new(m.max_size.as_u64())),
        CasConfig::S3(s3) => {
            let remote = S3Store::open(S3Options::from_config(s3)).context("[cas] kind = \"s3\"")?;
            match &s3.local {
                None => Arc::new(remote),
                Some(local) => {
                    let path = config.local_tier_path(local);
                    let tier = FsStore::open(&path, local.max_size.as_u64())
                        .await
                        .context(format_args!("[cas.local] at {}", path.display()))?;
                    let tiered = TieredStore::new(Arc::new(tier), Arc::new(remote));
                    // A bucket that expires objects decides what is present; the tier
                    // may hold what the bucket no longer does.
                    Arc::new(if s3.expire_after.is_some() { tiered.with_remote_presence() } else { tiered })
                }
            }
        }
    };
    backend.check().await.context("[cas] startup check")?;
    Ok(Arc::new(IntegrityStore::new(backend)))
}

/// The metadata database of `[metadata]`, migrated to this binary's schema. Open it
/// once per process and hand it to every SQL store.
pub async fn open_metadata(config: &Config) -> Result<MetadataDb> {
    let url = config.metadata_url();
    let opts = MetadataOptions {
        max_connections: config.metadata.max_connections,
        connect_timeout: config.metadata.connect_timeout,
    };
    MetadataDb::open_with(&url, &opts).await.context("[metadata] url")
}

/// The action cache in the metadata database, with the completeness check in front when
/// configured.
pub async fn build_action_cache(
    config: &Config,
    db: &MetadataDb,
    cas: Arc<dyn BlobStore>,
) -> Result<Arc<dyn ActionCache>> {
    match &config.action_cache {
        ActionCacheConfig::Sql(sql) => {
            let ac: Arc<dyn ActionCache> =
                Arc::new(SqlActionCache::new(db.clone()).with_max_age(config.retention.action_cache.max_age));
            ac.check().await.context("[action_cache] startup check")?;
            Ok(if sql.completeness_check { Arc::new(CompletenessCheckingActionCache::new(ac, cas)) } else { ac })
        }
    }
}
