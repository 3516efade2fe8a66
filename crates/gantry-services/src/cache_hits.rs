//! Remote cache hits per Bazel invocation. Bazel names its invocation in the
//! RequestMetadata header of every GetActionResult, so the ActionCache service counts
//! lookups and hits by that id in memory, and this process's running totals are recorded
//! in the invocation store (under a process id of its own) every
//! [`FLUSH_EVERY`] and when a build's event stream ends here. The store sums every
//! process's totals, so with several frontends behind a balancer an invocation's counts
//! cover all of them, whichever stored its build events. A crash loses at most the last
//! interval's lookups.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use gantry_core::{CacheCounts, InvocationStore, TaskGuard};

#[cfg(test)]
use gantry_core::request_metadata::METADATA_HEADER;
use tonic::Request;
/// Invocations counted at once; the one first seen longest ago is forgotten first. A
/// build's event stream ends soon after its last lookup, so only the recent ones matter.
pub const MAX_INVOCATIONS: usize = 10_000;
/// How often the counts that changed are recorded in the invocation store.
pub const FLUSH_EVERY: Duration = Duration::from_secs(2);
/// Longer ids (no Bazel sends them) are not counted, so one client cannot make the map
/// hold large keys.
const MAX_ID_LEN: usize = 256;

/// Lookups and hits of one invocation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub lookups: u64,
    pub hits: u64,
}

#[derive(Debug, Default)]
struct Inner {
    counts: HashMap<String, Counts>,
    /// Ids in the order first seen, for eviction (each id once: entries only leave by it).
    order: VecDeque<String>,
    /// Ids counted since their last flush.
    dirty: HashSet<String>,
}

/// Shared by the ActionCache service (which counts) and the Build Event Service (which
/// reads). The lock is only held to update or copy one entry, never across an await.
#[derive(Debug)]
pub struct CacheHits {
    inner: Mutex<Inner>,
    capacity: usize,
    /// This process's name in the store's counts: fresh at each start, so a restarted
    /// process adds its new totals instead of replacing the ones it recorded before.
    process: String,
}

impl Default for CacheHits {
    fn default() -> Self {
        CacheHits::with_capacity(MAX_INVOCATIONS)
    }
}

impl CacheHits {
    pub fn with_capacity(capacity: usize) -> Self {
        CacheHits { inner: Mutex::default(), capacity: capacity.max(1), process: uuid::Uuid::new_v4().to_string() }
    }

    /// Counts one answered lookup of `invocation` (a hit or not). Empty or overlong ids
    /// are not counted.
    pub fn record(&self, invocation: &str, hit: bool) {
        if invocation.is_empty() || invocation.len() > MAX_ID_LEN {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        // Every lookup of a build lands here: a known id is counted without allocating.
        if let Some(c) = inner.counts.get_mut(invocation) {
            c.lookups += 1;
            c.hits += u64::from(hit);
            if !inner.dirty.contains(invocation) {
                inner.dirty.insert(invocation.to_string());
            }
            return;
        }
        while inner.order.len() >= self.capacity {
            let Some(oldest) = inner.order.pop_front() else { break };
            // Its last totals are lost if they were never flushed: the interval is short
            // and the capacity large, so that takes 10,000 builds in 2 s.
            inner.dirty.remove(&oldest);
            inner.counts.remove(&oldest);
        }
        inner.order.push_back(invocation.to_string());
        inner.dirty.insert(invocation.to_string());
        inner.counts.insert(invocation.to_string(), Counts { lookups: 1, hits: u64::from(hit) });
    }

    /// Records the totals counted since the last flush in `store`. On failure they stay
    /// to be recorded by the next flush, and the error is returned.
    pub async fn flush(&self, store: &dyn InvocationStore) -> gantry_core::Result<usize> {
        let batch: Vec<CacheCounts> = {
            let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
            let dirty = std::mem::take(&mut inner.dirty);
            dirty
                .into_iter()
                .filter_map(|id| {
                    let c = inner.counts.get(&id)?;
                    Some(CacheCounts { lookups: c.lookups, hits: c.hits, invocation: id })
                })
                .collect()
        };
        if let Err(e) = store.record_cache_counts(&self.process, &batch).await {
            let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
            for c in batch {
                if inner.counts.contains_key(&c.invocation) {
                    inner.dirty.insert(c.invocation);
                }
            }
            return Err(e);
        }
        Ok(batch.len())
    }

    /// Flushes into `store` every [`FLUSH_EVERY`] until dropped (and once more then is not
    /// needed: the Build Event Service flushes as each build's stream ends).
    pub fn start_flusher(self: &Arc<Self>, store: Arc<dyn InvocationStore>) -> TaskGuard {
        let hits = self.clone();
        gantry_core::task::spawn_named("cache-hits-flusher", async move {
            let mut tick = tokio::time::interval(FLUSH_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = hits.flush(store.as_ref()).await {
                    tracing::warn!(error = %e, "could not record remote cache counts; retrying");
                }
            }
        })
    }

    /// The counts of `invocation` so far (zero when none were seen). Not removed: a BES
    /// stream whose store fails is retried and reads them again.
    pub fn get(&self, invocation: &str) -> Counts {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.counts.get(invocation).copied().unwrap_or_default()
    }
}

/// The `tool_invocation_id` of the request's RequestMetadata; empty when absent or
/// undecodable (such a lookup is not attributed to any invocation).
pub fn tool_invocation_id<T>(req: &Request<T>) -> String {
    gantry_core::request_metadata::request_metadata(req).map(|m| m.tool_invocation_id).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_core::reapi;
    use prost::Message;

    #[test]
    fn counts_lookups_and_hits_per_invocation_and_forgets_the_oldest() {
        let c = CacheHits::with_capacity(2);
        c.record("a", true);
        c.record("a", false);
        c.record("a", true);
        c.record("b", false);
        c.record("", true);
        c.record(&"x".repeat(300), true);
        assert_eq!(c.get("a"), Counts { lookups: 3, hits: 2 });
        assert_eq!(c.get("b"), Counts { lookups: 1, hits: 0 });
        assert_eq!(c.get(""), Counts::default(), "unattributed lookups are not counted");
        // A third invocation evicts the first seen, though it was counted since.
        c.record("c", true);
        assert_eq!(c.get("a"), Counts::default());
        assert_eq!((c.get("b").lookups, c.get("c").hits), (1, 1));
        assert_eq!(c.inner.lock().unwrap().order.len(), 2);
    }

    /// Records what it is given, or fails while `down`.
    #[derive(Default)]
    struct Recorder {
        down: std::sync::atomic::AtomicBool,
        got: Mutex<Vec<(String, CacheCounts)>>,
    }

    #[tonic::async_trait]
    impl InvocationStore for Recorder {
        async fn put(&self, _: &gantry_core::Invocation) -> gantry_core::Result<()> {
            Ok(())
        }
        async fn get(&self, _: &str) -> gantry_core::Result<Option<gantry_core::Invocation>> {
            Ok(None)
        }
        async fn list(&self, _: usize, _: Option<i64>) -> gantry_core::Result<Vec<gantry_core::Invocation>> {
            Ok(Vec::new())
        }
        async fn record_cache_counts(&self, process: &str, counts: &[CacheCounts]) -> gantry_core::Result<()> {
            if self.down.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(gantry_core::Error::Unavailable("down".into()));
            }
            self.got.lock().unwrap().extend(counts.iter().map(|c| (process.to_string(), c.clone())));
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_flush_records_what_changed_once_and_keeps_it_when_the_store_fails() {
        let (c, store) = (CacheHits::with_capacity(10), Recorder::default());
        let taken = |s: &Recorder| {
            let mut v: Vec<(String, u64, u64)> =
                s.got.lock().unwrap().drain(..).map(|(_, c)| (c.invocation, c.lookups, c.hits)).collect();
            v.sort();
            v
        };
        c.record("a", true);
        c.record("b", false);
        c.record("a", false);
        assert_eq!(c.flush(&store).await.unwrap(), 2);
        assert_eq!(taken(&store), [("a".into(), 2, 1), ("b".into(), 1, 0)]);
        assert_eq!(c.flush(&store).await.unwrap(), 0, "nothing changed since");
        // Totals, not increments: a flush after more lookups replaces the earlier totals.
        c.record("a", true);
        store.down.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(c.flush(&store).await.is_err());
        c.record("b", true);
        store.down.store(false, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(c.flush(&store).await.unwrap(), 2, "the failed flush's counts are retried");
        assert_eq!(taken(&store), [("a".into(), 3, 2), ("b".into(), 2, 1)]);
        // Every flush names this process, and another CacheHits is another process.
        c.record("a", true);
        c.flush(&store).await.unwrap();
        let other = CacheHits::with_capacity(10);
        other.record("a", true);
        other.flush(&store).await.unwrap();
        let names: HashSet<String> = store.got.lock().unwrap().iter().map(|(p, _)| p.clone()).collect();
        assert_eq!(names.len(), 2);
    }

    #[test]
    fn the_invocation_id_comes_from_the_binary_header() {
        let mut req = Request::new(());
        assert_eq!(tool_invocation_id(&req), "");
        let md = reapi::RequestMetadata { tool_invocation_id: "inv-7".into(), ..Default::default() };
        req.metadata_mut().insert_bin(METADATA_HEADER, tonic::metadata::MetadataValue::from_bytes(&md.encode_to_vec()));
        assert_eq!(tool_invocation_id(&req), "inv-7");
        let mut garbage = Request::new(());
        garbage.metadata_mut().insert_bin(METADATA_HEADER, tonic::metadata::MetadataValue::from_bytes(&[0xff, 0xff]));
        assert_eq!(tool_invocation_id(&garbage), "");
    }
}
