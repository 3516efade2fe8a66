//! The behavioural test suite every blob backend must pass, public so that each backend,
//! in this crate or another, runs the same checks: `blob_store_suite!(name, make)` expands
//! to a module of `#[tokio::test]`s over the store `make(max_bytes)` builds (the caller
//! depends on tokio and tempfile). The store is checked exactly as the server stacks it,
//! behind `IntegrityStore`.

use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use gantry_core::{BlobStore, Digest, DigestFunction, Error};

/// A deterministic blob of `len` bytes and its SHA-256 digest.
pub fn blob(seed: u8, len: usize) -> (Bytes, Digest) {
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    let d = DigestFunction::Sha256.digest_of(&data);
    (Bytes::from(data), d)
}

/// Distinct blobs by number, for tests that need many.
pub fn blob_n(n: u32, len: usize) -> (Bytes, Digest) {
    let mut data = vec![0u8; len];
    data[..4].copy_from_slice(&n.to_le_bytes());
    let d = DigestFunction::Sha256.digest_of(&data);
    (Bytes::from(data), d)
}

pub async fn round_trip(s: Arc<dyn BlobStore>) {
    let (data, d) = blob(1, 1000);
    assert!(!s.has(&d).await.unwrap());
    s.put(&d, data.clone()).await.unwrap();
    assert!(s.has(&d).await.unwrap());
    assert_eq!(s.get(&d).await.unwrap(), data);
    // blake3 blobs live beside sha256 ones
    let b3 = DigestFunction::Blake3.digest_of(&data);
    assert!(!s.has(&b3).await.unwrap());
    s.put(&b3, data.clone()).await.unwrap();
    assert_eq!(s.get(&b3).await.unwrap(), data);
    let (_, missing) = blob(2, 10);
    assert_eq!(s.find_present(&[d, missing, b3]).await.unwrap(), vec![true, false, true]);
}

pub async fn ranges(s: Arc<dyn BlobStore>) {
    // Past two of FsStore's 4 MiB read chunks, so the read-ahead runs.
    let (data, d) = blob(3, 9 * 1024 * 1024 + 17);
    s.put(&d, data.clone()).await.unwrap();
    let mut stream = s.read(&d, 0, None).await.unwrap();
    let mut chunks = 0;
    let mut got = Vec::new();
    while let Some(c) = stream.next().await {
        got.extend_from_slice(&c.unwrap());
        chunks += 1;
    }
    assert_eq!(got, data);
    assert!(chunks > 1, "large blobs are streamed in chunks");
    let part = collect(s.read(&d, 1_000_000, Some(2_000_000)).await.unwrap()).await;
    assert_eq!(&part[..], &data[1_000_000..3_000_000]);
    let across = collect(s.read(&d, (4 << 20) - 10, Some((4 << 20) + 20)).await.unwrap()).await;
    assert_eq!(&across[..], &data[(4 << 20) - 10..(8 << 20) + 10]);
    let tail = collect(s.read(&d, data.len() as u64 - 5, Some(100)).await.unwrap()).await;
    assert_eq!(&tail[..], &data[data.len() - 5..]);
    assert!(collect(s.read(&d, data.len() as u64, None).await.unwrap()).await.is_empty());
    let e = s.read(&d, data.len() as u64 + 1, None).await.err().unwrap();
    assert!(matches!(e, Error::OutOfRange(_)), "{e}");
    let (_, missing) = blob(4, 10);
    assert!(s.read(&missing, 0, None).await.err().unwrap().is_not_found());
}

pub async fn collect(mut st: gantry_core::BlobStream) -> Vec<u8> {
    let mut v = Vec::new();
    while let Some(c) = st.next().await {
        v.extend_from_slice(&c.unwrap());
    }
    v
}

pub async fn integrity(s: Arc<dyn BlobStore>) {
    let (data, d) = blob(5, 5000);
    // wrong content, right size
    let mut bad = data.to_vec();
    bad[10] ^= 1;
    let e = s.put(&d, Bytes::from(bad)).await.err().unwrap();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("hashes to"), "{e}");
    assert!(!s.has(&d).await.unwrap(), "a mismatched write stores nothing");
    // too short
    let e = s.put(&d, data.slice(..4000)).await.err().unwrap();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("4000"), "{e}");
    assert!(!s.has(&d).await.unwrap());
    // too long: refused at the write that overflows
    let mut w = s.begin_write(&d).await.unwrap();
    w.write(data.clone()).await.unwrap();
    let e = w.write(Bytes::from_static(b"x")).await.err().unwrap();
    assert!(e.to_string().contains("more than"), "{e}");
    drop(w);
    assert!(!s.has(&d).await.unwrap());
    // chunked write with committed offsets
    let mut w = s.begin_write(&d).await.unwrap();
    for chunk in data.chunks(700) {
        w.write(Bytes::copy_from_slice(chunk)).await.unwrap();
    }
    assert_eq!(w.committed(), 5000);
    w.commit().await.unwrap();
    assert_eq!(s.get(&d).await.unwrap(), data);
}

pub async fn empty_blob(s: Arc<dyn BlobStore>) {
    for f in DigestFunction::ALL {
        let e = f.empty();
        assert!(s.has(&e).await.unwrap());
        assert!(s.get(&e).await.unwrap().is_empty());
        s.put(&e, Bytes::new()).await.unwrap();
        let e2 = s.put(&e, Bytes::from_static(b"x")).await.err().unwrap();
        assert!(matches!(e2, Error::InvalidArgument(_)), "{e2}");
    }
    // Among other digests, each answer stays in its place.
    let (data, stored) = blob(7, 100);
    let (_, absent) = blob(8, 100);
    s.put(&stored, data).await.unwrap();
    let e = stored.function.empty();
    let asked = [e, stored, absent, e, absent];
    assert_eq!(s.find_present(&asked).await.unwrap(), vec![true, true, false, true, false]);
}

pub async fn eviction_order(s: Arc<dyn BlobStore>) {
    // capacity is 4 blobs of 1000 bytes (see the constructors below)
    let blobs: Vec<_> = (10..15u8).map(|i| blob(i, 1000)).collect();
    for (data, d) in &blobs[..4] {
        s.put(d, data.clone()).await.unwrap();
    }
    // touch blob 0 by FindMissingBlobs-style lookup and blob 1 by a read
    assert_eq!(s.find_present(&[blobs[0].1]).await.unwrap(), vec![true]);
    s.get(&blobs[1].1).await.unwrap();
    // inserting a fifth evicts blob 2, the least recently used
    s.put(&blobs[4].1, blobs[4].0.clone()).await.unwrap();
    let ds: Vec<_> = blobs.iter().map(|b| b.1).collect();
    assert_eq!(s.find_present(&ds).await.unwrap(), vec![true, true, false, true, true]);
    assert_eq!(s.usage().used_bytes, 4000);
    assert_eq!(s.usage().blobs, 4);
    let big = blob(20, 5000);
    let e = s.put(&big.1, big.0).await.err().unwrap();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("larger than the whole store"), "{e}");
}

pub async fn concurrent_writers_same_digest(s: Arc<dyn BlobStore>) {
    let (data, d) = blob(30, 2 * 1024 * 1024);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (s, data) = (s.clone(), data.clone());
        tasks.push(tokio::spawn(async move { s.put(&d, data).await }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(s.get(&d).await.unwrap(), data);
    // Backends without a capacity (the bucket) report no usage.
    assert!(s.usage().blobs <= 1);
    assert_eq!(s.find_present(&[d]).await.unwrap(), [true]);
}

/// The suite for one backend, as a module of tests named `$module`. `make(max_bytes)` builds the store (and the temporary
/// directory it lives in), or returns None when a test server could not start (a skip
/// locally, a panic under CI=true). Backends without a capacity (the bucket) leave out
/// the eviction test with `unbounded`.
#[macro_export]
macro_rules! blob_store_suite {
    ($module:ident, $make:expr) => {
        $crate::blob_store_suite!(@tests $module, $make, {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn eviction_order() {
                let Some(s) = make(4000).await else { return };
                $crate::testing::eviction_order(s.0).await
            }
        });
    };
    ($module:ident, $make:expr, unbounded) => {
        $crate::blob_store_suite!(@tests $module, $make, {});
    };
    (@tests $module:ident, $make:expr, { $($extra:item)* }) => {
        mod $module {
            use super::*;
            use std::sync::Arc;
            use $crate::gantry_core_reexport::BlobStore;
            #[allow(unused)]
            async fn make(max: u64) -> Option<(Arc<dyn BlobStore>, Option<tempfile::TempDir>)> {
                let f = $make;
                f(max).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn round_trip() {
                let Some(s) = make(1 << 30).await else { return };
                $crate::testing::round_trip(s.0).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ranges() {
                let Some(s) = make(1 << 30).await else { return };
                $crate::testing::ranges(s.0).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn integrity() {
                let Some(s) = make(1 << 30).await else { return };
                $crate::testing::integrity(s.0).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn empty_blob() {
                let Some(s) = make(1 << 30).await else { return };
                $crate::testing::empty_blob(s.0).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_writers_same_digest() {
                let Some(s) = make(1 << 30).await else { return };
                $crate::testing::concurrent_writers_same_digest(s.0).await
            }
            $($extra)*
        }
    };
}
