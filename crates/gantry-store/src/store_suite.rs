//! One behavioural test suite, run against every blob backend behind `IntegrityStore`
//! exactly as the server stacks them.

use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use gantry_core::{BlobStore, Digest, DigestFunction, Error};

use crate::{FsStore, IntegrityStore, MemoryStore};

fn blob(seed: u8, len: usize) -> (Bytes, Digest) {
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    let d = DigestFunction::Sha256.digest_of(&data);
    (Bytes::from(data), d)
}

async fn round_trip(s: Arc<dyn BlobStore>) {
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

async fn ranges(s: Arc<dyn BlobStore>) {
    let (data, d) = blob(3, 3 * 1024 * 1024 + 17);
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
    let tail = collect(s.read(&d, data.len() as u64 - 5, Some(100)).await.unwrap()).await;
    assert_eq!(&tail[..], &data[data.len() - 5..]);
    assert!(collect(s.read(&d, data.len() as u64, None).await.unwrap()).await.is_empty());
    let e = s.read(&d, data.len() as u64 + 1, None).await.err().unwrap();
    assert!(matches!(e, Error::OutOfRange(_)), "{e}");
    let (_, missing) = blob(4, 10);
    assert!(s.read(&missing, 0, None).await.err().unwrap().is_not_found());
}

async fn collect(mut st: gantry_core::BlobStream) -> Vec<u8> {
    let mut v = Vec::new();
    while let Some(c) = st.next().await {
        v.extend_from_slice(&c.unwrap());
    }
    v
}

async fn integrity(s: Arc<dyn BlobStore>) {
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

async fn empty_blob(s: Arc<dyn BlobStore>) {
    for f in DigestFunction::ALL {
        let e = f.empty();
        assert!(s.has(&e).await.unwrap());
        assert!(s.get(&e).await.unwrap().is_empty());
        s.put(&e, Bytes::new()).await.unwrap();
        let e2 = s.put(&e, Bytes::from_static(b"x")).await.err().unwrap();
        assert!(matches!(e2, Error::InvalidArgument(_)), "{e2}");
    }
}

async fn eviction_order(s: Arc<dyn BlobStore>) {
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

async fn concurrent_writers_same_digest(s: Arc<dyn BlobStore>) {
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
    assert_eq!(s.usage().blobs, 1);
}

macro_rules! suite {
    ($module:ident, $make:expr) => {
        mod $module {
            use super::*;
            #[allow(unused)]
            async fn make(max: u64) -> (Arc<dyn BlobStore>, Option<tempfile::TempDir>) {
                let f = $make;
                f(max).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn round_trip() { super::round_trip(make(1 << 30).await.0).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ranges() { super::ranges(make(1 << 30).await.0).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn integrity() { super::integrity(make(1 << 30).await.0).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn empty_blob() { super::empty_blob(make(1 << 30).await.0).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn eviction_order() { super::eviction_order(make(4000).await.0).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_writers_same_digest() {
                super::concurrent_writers_same_digest(make(1 << 30).await.0).await
            }
        }
    };
}

suite!(memory, |max: u64| async move {
    (Arc::new(IntegrityStore::new(Arc::new(MemoryStore::new(max)))) as Arc<dyn BlobStore>, None)
});

suite!(fs, |max: u64| async move {
    let dir = tempfile::tempdir().unwrap();
    let store = FsStore::open(dir.path(), max).await.unwrap();
    // keep the directory alive for the test by leaking it into the returned tuple
    (Arc::new(IntegrityStore::new(Arc::new(store))) as Arc<dyn BlobStore>, Some(dir))
});
