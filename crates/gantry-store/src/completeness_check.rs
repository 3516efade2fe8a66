//! `CompletenessCheckingActionCache`: a decorator that serves an ActionResult only while
//! every blob it references is still in the CAS: output files, output directory trees
//! and every file inside them, stdout and stderr. A result with a missing blob would make
//! the client fail to download its outputs, so it is reported as a miss instead.
//!
//! The check goes through `BlobStore::find_present`, which touches each blob: the blobs of
//! an entry just served become the most recently used, so they are not evicted before the
//! blobs of entries served longer ago.

use std::sync::Arc;

use async_trait::async_trait;
use gantry_core::action_cache::{referenced_blobs, ReferencedBlobs};
use gantry_core::reapi::{ActionResult, Tree};
use gantry_core::{ActionCache, BlobStore, Digest, Result};

use prost::Message;

pub struct CompletenessCheckingActionCache {
    inner: Arc<dyn ActionCache>,
    cas: Arc<dyn BlobStore>,
}

impl CompletenessCheckingActionCache {
    pub fn new(inner: Arc<dyn ActionCache>, cas: Arc<dyn BlobStore>) -> Self {
        CompletenessCheckingActionCache { inner, cas }
    }

    /// Whether every blob `result` references is present (touching them as it goes).
    pub async fn is_complete(&self, action: &Digest, result: &ActionResult) -> Result<bool> {
        let f = action.function;
        let parse = |d: Option<&gantry_core::reapi::Digest>, field: &str| Digest::from_proto(f, d, field);
        let ReferencedBlobs { mut direct, trees } = referenced_blobs(f, result)?;
        direct.extend(trees.iter().copied());
        if !self.cas.find_present(&direct).await?.into_iter().all(|p| p) {
            return Ok(false);
        }
        for t in trees {
            let bytes = match self.cas.get(&t).await {
                Ok(b) => b,
                Err(e) if e.is_not_found() => return Ok(false),
                Err(e) => return Err(e.context(format_args!("reading output tree {t}"))),
            };
            // A tree the client stored that cannot be decoded can never be served; say so
            // in the log and answer a miss so the client rebuilds and overwrites it.
            let tree = match Tree::decode(bytes) {
                Ok(tree) => tree,
                Err(e) => {
                    tracing::warn!(%action, tree = %t, error = %e, "output tree is not a Tree; treating entry as a miss");
                    return Ok(false);
                }
            };
            let mut files = Vec::new();
            for dir in tree.root.iter().chain(tree.children.iter()) {
                for file in &dir.files {
                    match parse(file.digest.as_ref(), "tree file digest") {
                        Ok(d) => files.push(d),
                        Err(e) => {
                            tracing::warn!(%action, tree = %t, error = %e, "output tree has a bad digest; treating entry as a miss");
                            return Ok(false);
                        }
                    }
                }
            }
            if !self.cas.find_present(&files).await?.into_iter().all(|p| p) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

#[async_trait]
impl ActionCache for CompletenessCheckingActionCache {
    async fn get(&self, instance: &str, action: &Digest) -> Result<Option<ActionResult>> {
        let Some(result) = self.inner.get(instance, action).await? else { return Ok(None) };
        if self.is_complete(action, &result).await? {
            Ok(Some(result))
        } else {
            tracing::debug!(%action, instance, "action cache entry references missing blobs; reporting a miss");
            Ok(None)
        }
    }

    async fn put(&self, instance: &str, action: &Digest, result: &ActionResult) -> Result<()> {
        self.inner.put(instance, action, result).await
    }

    async fn check(&self) -> Result<()> {
        self.inner.check().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IntegrityStore, MemoryStore, SqlActionCache};
    use bytes::Bytes;
    use gantry_core::reapi::{Directory, FileNode, OutputDirectory, OutputFile};
    use gantry_core::DigestFunction;

    async fn put(cas: &Arc<dyn BlobStore>, data: &[u8]) -> Digest {
        let d = DigestFunction::Sha256.digest_of(data);
        cas.put(&d, Bytes::copy_from_slice(data)).await.unwrap();
        d
    }

    #[tokio::test]
    async fn entry_with_missing_blob_is_a_miss() {
        let cas: Arc<dyn BlobStore> = Arc::new(IntegrityStore::new(Arc::new(MemoryStore::new(1 << 20))));
        let ac = CompletenessCheckingActionCache::new(
            Arc::new(SqlActionCache::new(crate::MetadataDb::open("sqlite::memory:").await.unwrap())),
            cas.clone(),
        );
        let action = DigestFunction::Sha256.digest_of(b"action");
        let out = put(&cas, b"output").await;
        let stdout = put(&cas, b"stdout").await;
        let in_tree = DigestFunction::Sha256.digest_of(b"file inside tree");
        let tree = Tree {
            root: Some(Directory {
                files: vec![FileNode { name: "f".into(), digest: Some(in_tree.to_proto()), ..Default::default() }],
                ..Default::default()
            }),
            children: vec![],
        };
        let tree_d = put(&cas, &tree.encode_to_vec()).await;
        let result = ActionResult {
            output_files: vec![OutputFile { path: "o".into(), digest: Some(out.to_proto()), ..Default::default() }],
            output_directories: vec![OutputDirectory {
                path: "d".into(),
                tree_digest: Some(tree_d.to_proto()),
                ..Default::default()
            }],
            stdout_digest: Some(stdout.to_proto()),
            ..Default::default()
        };
        ac.put("i", &action, &result).await.unwrap();
        // the file inside the tree is missing
        assert_eq!(ac.get("i", &action).await.unwrap(), None);
        put(&cas, b"file inside tree").await;
        assert_eq!(ac.get("i", &action).await.unwrap(), Some(result.clone()));
        // a result whose stdout is gone is a miss again
        let mut r2 = result.clone();
        r2.stdout_digest = Some(DigestFunction::Sha256.digest_of(b"gone").to_proto());
        ac.put("i", &action, &r2).await.unwrap();
        assert_eq!(ac.get("i", &action).await.unwrap(), None);
        // other instance never sees it
        assert_eq!(ac.get("j", &action).await.unwrap(), None);
    }

    #[tokio::test]
    async fn serving_an_entry_protects_its_blobs_from_eviction() {
        // Room for exactly four 1000-byte blobs.
        let cas: Arc<dyn BlobStore> = Arc::new(IntegrityStore::new(Arc::new(MemoryStore::new(4000))));
        let ac = CompletenessCheckingActionCache::new(
            Arc::new(SqlActionCache::new(crate::MetadataDb::open("sqlite::memory:").await.unwrap())),
            cas.clone(),
        );
        let entry = |d: Digest| ActionResult {
            output_files: vec![OutputFile { path: "o".into(), digest: Some(d.to_proto()), ..Default::default() }],
            ..Default::default()
        };
        // Old entry first, then a younger one.
        let old_out = put(&cas, &[1u8; 1000]).await;
        let young_out = put(&cas, &[2u8; 1000]).await;
        let (old_a, young_a) = (DigestFunction::Sha256.digest_of(b"old"), DigestFunction::Sha256.digest_of(b"young"));
        ac.put("", &old_a, &entry(old_out)).await.unwrap();
        ac.put("", &young_a, &entry(young_out)).await.unwrap();
        // A client is served the old entry: its output becomes most recently used.
        assert!(ac.get("", &old_a).await.unwrap().is_some());
        // New uploads push the store over capacity twice.
        put(&cas, &[3u8; 1000]).await;
        put(&cas, &[4u8; 1000]).await;
        put(&cas, &[5u8; 1000]).await;
        assert!(ac.get("", &old_a).await.unwrap().is_some(), "just-served entry survives");
        assert!(ac.get("", &young_a).await.unwrap().is_none(), "the unserved younger entry's blob went first");
    }
}
