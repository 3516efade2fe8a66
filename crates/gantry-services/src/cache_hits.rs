//! Remote cache hits per Bazel invocation. Bazel names its invocation in the
//! RequestMetadata header of every GetActionResult, so the ActionCache service counts
//! lookups and hits by that id, and the Build Event Service copies the counts into the
//! invocation it stores when the invocation's event stream ends.
//!
//! The counts live in this process's memory: with several frontends behind a balancer,
//! an invocation's count covers only the lookups the process that stored it served. A
//! restart between a build's lookups and the end of its event stream loses them too.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, PoisonError};

#[cfg(test)]
use gantry_core::request_metadata::METADATA_HEADER;
use tonic::Request;
/// Invocations counted at once; the one first seen longest ago is forgotten first. A
/// build's event stream ends soon after its last lookup, so only the recent ones matter.
pub const MAX_INVOCATIONS: usize = 10_000;
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
}

/// Shared by the ActionCache service (which counts) and the Build Event Service (which
/// reads). The lock is only held to update or copy one entry, never across an await.
#[derive(Debug)]
pub struct CacheHits {
    inner: Mutex<Inner>,
    capacity: usize,
}

impl Default for CacheHits {
    fn default() -> Self {
        CacheHits::with_capacity(MAX_INVOCATIONS)
    }
}

impl CacheHits {
    pub fn with_capacity(capacity: usize) -> Self {
        CacheHits { inner: Mutex::default(), capacity: capacity.max(1) }
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
            return;
        }
        while inner.order.len() >= self.capacity {
            let Some(oldest) = inner.order.pop_front() else { break };
            inner.counts.remove(&oldest);
        }
        inner.order.push_back(invocation.to_string());
        inner.counts.insert(invocation.to_string(), Counts { lookups: 1, hits: u64::from(hit) });
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
