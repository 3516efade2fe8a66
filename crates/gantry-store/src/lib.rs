//! gantry-store owns the storage backends and the decorators stacked on them:
//!
//! - `FsStore` (`[cas] kind = "fs"`): blobs as files, atomic writes, LRU eviction.
//! - `MemoryStore` (`[cas] kind = "memory"`): blobs in RAM, LRU eviction.
//! - `S3Store` (`[cas] kind = "s3"`): blobs in an S3-compatible bucket, with a bounded,
//!   expiring record of blobs recently confirmed there.
//! - `TieredStore` (`[cas.local]`): a per-machine filesystem tier in front of `S3Store`;
//!   reads fill it, writes reach the bucket first.
//! - `GrpcStore`: blobs on a remote REAPI server (used by separate worker processes).
//! - `IntegrityStore`: verifies every write against its digest; serves the empty blob.
//! - `MetadataDb` (`[metadata] url`): the one SQL database (SQLite or PostgreSQL, one
//!   pool, versioned migrations) that every store below shares.
//! - `SqlActionCache` (`[action_cache] kind = "sql"`): ActionResults in the metadata
//!   database, in portable SQL.
//! - `CompletenessCheckingActionCache`: serves an entry only while its blobs exist.
//! - `SqlExecutionLog`: per-action metering records, in the same database.
//! - `SqlBuildStore`: the batching service's builds and their outcomes (its training history).
//! - `SqlQueueStore`: the submit queue's changes, journal, landings, builds and graph cache.
//! - `Retention`: bounds the history tables by age and row count in the background.
//!
//! `factory` builds the stack from `gantry.toml`; services see only the gantry-core traits.

pub mod completeness_check;
pub mod factory;
mod fs_journal;
pub mod fs_store;
pub mod grpc_store;
pub mod integrity_store;
pub mod lru_index;
pub mod memory_store;
pub mod metadata_db;
pub mod retention;
pub mod s3_store;
pub mod sql_action_cache;
pub mod sql_build_store;
pub mod sql_execution_log;
pub mod sql_invocation_store;
pub mod sql_queue_store;
pub mod tiered_store;

pub use completeness_check::CompletenessCheckingActionCache;
pub use factory::{build_action_cache, build_cas, open_metadata};
pub use fs_store::{Adoption, FsStore};
pub use grpc_store::GrpcStore;
pub use integrity_store::IntegrityStore;
pub use memory_store::MemoryStore;
pub use metadata_db::{Dialect, MetadataDb, MetadataOptions, RoleLease};
pub use retention::Retention;
pub use s3_store::{S3Credentials, S3Options, S3Store};
pub use sql_action_cache::SqlActionCache;
pub use sql_build_store::SqlBuildStore;
pub use sql_execution_log::{SqlExecutionLog, SqlSizeClassStore};
pub use sql_invocation_store::SqlInvocationStore;
pub use sql_queue_store::SqlQueueStore;
pub use tiered_store::TieredStore;

#[cfg(test)]
mod store_suite;

/// Runs the ignored unit test `name` of this test binary again inside a user and mount
/// namespace (`unshare -Urm`), where it is root and may mount a tmpfs on the directory in
/// `GANTRY_TEST_TMPFS`: how the full-disk tests fill a real disk without privileges.
/// Under CI=true a machine without user namespaces fails, not skips.
#[cfg(test)]
fn run_in_a_namespace(name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", name, "--ignored", "--nocapture"])
        .env("GANTRY_TEST_TMPFS", dir.path())
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() && text.contains("unshare failed") && std::env::var("CI").as_deref() != Ok("true") {
        eprintln!("skipped: no user namespaces here ({text})");
        return;
    }
    assert!(out.status.success() && text.contains("1 passed"), "{text}");
}
pub mod testing;

/// For `blob_store_suite!` expanded in other crates.
#[doc(hidden)]
pub use gantry_core as gantry_core_reexport;
