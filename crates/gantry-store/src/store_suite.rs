//! The public suite (`crate::testing`) on every backend of this crate, and the tests that
//! only make sense on the bucket.

use std::sync::Arc;

use bytes::Bytes;
use gantry_core::{BlobStore, Digest, Error};

use crate::testing::{blob, blob_n, collect};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use gantry_testkit::{S3Server, S3_KEY_ID, S3_SECRET_KEY};

use crate::s3_store::PART_SIZE;
use crate::{FsStore, IntegrityStore, MemoryStore, S3Credentials, S3Options, S3Store, TieredStore};

crate::blob_store_suite!(memory, |max: u64| async move {
    Some((Arc::new(IntegrityStore::new(Arc::new(MemoryStore::new(max)))) as Arc<dyn BlobStore>, None))
});

crate::blob_store_suite!(fs, |max: u64| async move {
    let dir = tempfile::tempdir().unwrap();
    let store = FsStore::open(dir.path(), max).await.unwrap();
    // keep the directory alive for the test by leaking it into the returned tuple
    Some((Arc::new(IntegrityStore::new(Arc::new(store))) as Arc<dyn BlobStore>, Some(dir)))
});

crate::blob_store_suite!(
    s3,
    |_max: u64| async move {
        let server = S3Server::shared()?;
        Some((Arc::new(IntegrityStore::new(Arc::new(s3_store(server, |_| {})))) as Arc<dyn BlobStore>, None))
    },
    unbounded
);

// The tier is bounded but the bucket behind it is not: an evicted blob is still present,
// so the eviction test does not apply (tiered_evicts_locally_but_loses_nothing does).
crate::blob_store_suite!(
    s3_tiered,
    |max: u64| async move {
        let server = S3Server::shared()?;
        let dir = tempfile::tempdir().unwrap();
        let tier = FsStore::open(dir.path(), max).await.unwrap();
        let store = TieredStore::new(Arc::new(tier), Arc::new(s3_store(server, |_| {})));
        Some((Arc::new(IntegrityStore::new(Arc::new(store))) as Arc<dyn BlobStore>, Some(dir)))
    },
    unbounded
);

// Tests that only make sense on the bucket, with and without the tier.

/// A fresh bucket on `server`, so tests sharing the server never see each other's blobs.
fn fresh_bucket(server: &S3Server) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let name = format!("gantry-t{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
    server.create_bucket(&name);
    name
}

fn s3_options(server: &S3Server, bucket: &str) -> S3Options {
    S3Options {
        endpoint: Some(server.endpoint()),
        prefix: "cas/".into(),
        credentials: S3Credentials::Static { key_id: S3_KEY_ID.into(), secret_key: S3_SECRET_KEY.into() },
        // A stopped server must fail the request quickly in tests.
        max_retries: 1,
        retry_timeout: Duration::from_secs(2),
        ..S3Options::new(bucket)
    }
}

fn s3_store(server: &S3Server, tweak: impl FnOnce(&mut S3Options)) -> S3Store {
    let mut opts = s3_options(server, &fresh_bucket(server));
    tweak(&mut opts);
    S3Store::open(opts).unwrap()
}

fn heads(s: &S3Store) -> u64 {
    s.requests().head.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_check_names_the_bucket_and_endpoint_never_the_secret() {
    let Some(server) = S3Server::shared() else { return };
    let store = s3_store(server, |_| {});
    store.check().await.unwrap();
    assert!(server.list(&store.bucket()).is_empty(), "the probe object is deleted");
    let missing = S3Store::open(s3_options(server, "no-such-bucket")).unwrap();
    let e = missing.check().await.err().unwrap();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    let msg = e.to_string();
    assert!(msg.contains("no-such-bucket") && msg.contains(&server.endpoint()), "{msg}");
    assert!(!msg.contains(S3_SECRET_KEY), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_multipart_blob_round_trips_and_abandoned_uploads_leave_nothing() {
    let Some(server) = S3Server::shared() else { return };
    let raw = Arc::new(s3_store(server, |_| {}));
    let s: Arc<dyn BlobStore> = Arc::new(IntegrityStore::new(raw.clone()));
    let len = 2 * PART_SIZE + 12345;
    let (data, d) = blob(40, len);
    let mut w = s.begin_write(&d).await.unwrap();
    for chunk in data.chunks(1 << 20) {
        w.write(Bytes::copy_from_slice(chunk)).await.unwrap();
    }
    w.commit().await.unwrap();
    // create + 3 parts + complete, not one PUT
    assert_eq!(raw.requests().put.load(Ordering::Relaxed), 5);
    assert_eq!(server.list(&raw.bucket()), vec![raw.key(&d)]);
    assert_eq!(s.get(&d).await.unwrap(), data);
    // a range across the first part boundary
    let from = PART_SIZE as u64 - 100;
    let part = collect(s.read(&d, from, Some(300)).await.unwrap()).await;
    assert_eq!(&part[..], &data[from as usize..from as usize + 300]);
    // A multipart upload dropped half way (a client gone) leaves no object.
    let (data2, d2) = blob(41, PART_SIZE + PART_SIZE / 2);
    let mut w = s.begin_write(&d2).await.unwrap();
    w.write(data2.slice(..PART_SIZE + 10)).await.unwrap();
    drop(w);
    // so does one whose bytes do not match the digest
    let mut bad = data2.to_vec();
    bad[PART_SIZE + 5] ^= 1;
    let e = s.put(&d2, Bytes::from(bad)).await.err().unwrap();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(!s.has(&d2).await.unwrap());
    assert_eq!(server.list(&raw.bucket()), vec![raw.key(&d)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_ranged_reads_fetch_only_the_range() {
    let Some(server) = S3Server::shared() else { return };
    let s = s3_store(server, |_| {});
    let (data, d) = blob(42, 1 << 20);
    s.put(&d, data.clone()).await.unwrap();
    let st = s.read(&d, 1000, Some(10)).await.unwrap();
    let got = collect(st).await;
    assert_eq!(&got[..], &data[1000..1010]);
    assert_eq!(collect(s.read(&d, (1 << 20) - 3, None).await.unwrap()).await, &data[(1 << 20) - 3..]);
    assert!(collect(s.read(&d, 1 << 20, None).await.unwrap()).await.is_empty());
    let (_, missing) = blob(43, 10);
    assert!(s.read(&missing, 0, Some(0)).await.err().unwrap().is_not_found());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_lost_local_tier_loses_nothing() {
    let Some(server) = S3Server::shared() else { return };
    let dir = tempfile::tempdir().unwrap();
    let tier_path = dir.path().join("tier");
    let tier = Arc::new(FsStore::open(&tier_path, 1 << 30).await.unwrap());
    let s: Arc<dyn BlobStore> =
        Arc::new(IntegrityStore::new(Arc::new(TieredStore::new(tier.clone(), Arc::new(s3_store(server, |_| {}))))));
    let blobs: Vec<_> = (50..60u8).map(|i| blob(i, 3000 + i as usize)).collect();
    for (data, d) in &blobs {
        s.put(d, data.clone()).await.unwrap();
    }
    assert_eq!(tier.usage().blobs, 10, "uploads are cached in the tier");
    tier.wait_placed();
    std::fs::remove_dir_all(&tier_path).unwrap();
    let ds: Vec<_> = blobs.iter().map(|b| b.1).collect();
    assert_eq!(s.find_present(&ds).await.unwrap(), vec![true; 10]);
    for (data, d) in &blobs {
        assert_eq!(&s.get(d).await.unwrap(), data);
    }
    // The reads filled the tier again.
    assert!(tier.path_of(&ds[0]).unwrap().is_some_and(|p| p.is_file()));
    let (data, d) = blob(61, 5000);
    s.put(&d, data.clone()).await.unwrap();
    assert_eq!(s.get(&d).await.unwrap(), data, "writes work into the vanished directory");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_reads_fill_the_tier_of_another_machine() {
    let Some(server) = S3Server::shared() else { return };
    let bucket = fresh_bucket(server);
    let machine = |dir: &std::path::Path| {
        let (dir, opts) = (dir.to_owned(), s3_options(server, &bucket));
        async move {
            let tier = Arc::new(FsStore::open(&dir, 1 << 30).await.unwrap());
            let s3 = Arc::new(S3Store::open(opts).unwrap());
            let s: Arc<dyn BlobStore> =
                Arc::new(IntegrityStore::new(Arc::new(TieredStore::new(tier.clone(), s3.clone()))));
            (s, tier, s3)
        }
    };
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, _, _) = machine(da.path()).await;
    let (b, b_tier, b_s3) = machine(db.path()).await;
    let (data, d) = blob(62, 200_000);
    a.put(&d, data.clone()).await.unwrap();
    assert_eq!(b_tier.usage().blobs, 0, "tiers are per machine");
    // a ranged read does not fill
    assert_eq!(collect(b.read(&d, 10, Some(10)).await.unwrap()).await, &data[10..20]);
    assert_eq!(b_tier.usage().blobs, 0);
    assert_eq!(b.get(&d).await.unwrap(), data);
    assert_eq!(b_tier.usage().blobs, 1, "a whole read fills this machine's tier");
    let gets = b_s3.requests().get.load(Ordering::Relaxed);
    assert_eq!(b.get(&d).await.unwrap(), data);
    assert_eq!(b_s3.requests().get.load(Ordering::Relaxed), gets, "the second read is served by the tier");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_evicts_locally_but_loses_nothing() {
    let Some(server) = S3Server::shared() else { return };
    let dir = tempfile::tempdir().unwrap();
    let tier = Arc::new(FsStore::open(dir.path(), 4000).await.unwrap());
    let s: Arc<dyn BlobStore> =
        Arc::new(IntegrityStore::new(Arc::new(TieredStore::new(tier.clone(), Arc::new(s3_store(server, |_| {}))))));
    let blobs: Vec<_> = (70..76u8).map(|i| blob(i, 1000)).collect();
    for (data, d) in &blobs {
        s.put(d, data.clone()).await.unwrap();
    }
    assert_eq!(tier.usage().blobs, 4, "the tier keeps its size");
    for (data, d) in &blobs {
        assert_eq!(&s.get(d).await.unwrap(), data);
    }
    // larger than the whole tier: stored in the bucket all the same
    let (big, bd) = blob(77, 10_000);
    s.put(&bd, big.clone()).await.unwrap();
    assert_eq!(s.get(&bd).await.unwrap(), big);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn find_missing_asks_s3_only_about_blobs_not_known_present() {
    let Some(server) = S3Server::shared() else { return };
    let bucket = fresh_bucket(server);
    let dir = tempfile::tempdir().unwrap();
    // A tier too small for the uploads: the record of confirmations answers for them.
    let tier = Arc::new(FsStore::open(dir.path(), 50_000).await.unwrap());
    let s3 = Arc::new(S3Store::open(s3_options(server, &bucket)).unwrap());
    let a: Arc<dyn BlobStore> = Arc::new(IntegrityStore::new(Arc::new(TieredStore::new(tier, s3.clone()))));
    let blobs: Vec<_> = (0..300u32).map(|i| blob_n(i, 1000)).collect();
    for (data, d) in &blobs {
        a.put(d, data.clone()).await.unwrap();
    }
    let mut ds: Vec<Digest> = blobs.iter().map(|b| b.1).collect();
    let missing: Vec<Digest> = (1000..1050u32).map(|i| blob_n(i, 10).1).collect();
    ds.extend(&missing);
    let before = heads(&s3);
    let present = a.find_present(&ds).await.unwrap();
    assert_eq!(present.iter().filter(|p| **p).count(), 300);
    assert!(present[300..].iter().all(|p| !p));
    assert_eq!(heads(&s3) - before, 50, "only the 50 unknown digests were asked about");
    // Asked again soon, the missing ones cost no HEAD either (absence_ttl), and one
    // uploaded meanwhile through this store is present at once.
    let (m0, md0) = blob_n(1000, 10);
    assert_eq!(md0, missing[0]);
    a.put(&md0, m0).await.unwrap();
    let again = a.find_present(&ds).await.unwrap();
    assert_eq!(again.iter().filter(|p| **p).count(), 301);
    assert!(again[300], "the blob just uploaded");
    assert_eq!(heads(&s3) - before, 50, "no HEAD for blobs found missing moments ago");

    // Another machine (cold tier, empty record): one HEAD per digest, all in flight at
    // once; then the record answers.
    let other = Arc::new(S3Store::open(s3_options(server, &bucket)).unwrap());
    let dir_b = tempfile::tempdir().unwrap();
    let b: Arc<dyn BlobStore> = Arc::new(IntegrityStore::new(Arc::new(TieredStore::new(
        Arc::new(FsStore::open(dir_b.path(), 1 << 30).await.unwrap()),
        other.clone(),
    ))));
    assert_eq!(b.find_present(&ds[..300]).await.unwrap(), vec![true; 300]);
    assert_eq!(heads(&other), 300);
    assert_eq!(b.find_present(&ds[..300]).await.unwrap(), vec![true; 300]);
    assert_eq!(heads(&other), 300, "confirmed blobs are not asked about again");

    // Without the record (presence_ttl = 0) every lookup is a HEAD: the record is what
    // saves them, not something else.
    let no_record = S3Store::open(S3Options {
        presence_ttl: Duration::ZERO,
        absence_ttl: Duration::ZERO,
        ..s3_options(server, &bucket)
    })
    .unwrap();
    no_record.find_present(&ds[..100]).await.unwrap();
    no_record.find_present(&ds[..100]).await.unwrap();
    assert_eq!(heads(&no_record), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_down_is_unavailable_never_a_miss() {
    let Some(server) = S3Server::start() else { return };
    let bucket = fresh_bucket(&server);
    let dir = tempfile::tempdir().unwrap();
    let s3 = Arc::new(S3Store::open(s3_options(&server, &bucket)).unwrap());
    let s: Arc<dyn BlobStore> = Arc::new(IntegrityStore::new(Arc::new(TieredStore::new(
        Arc::new(FsStore::open(dir.path(), 1 << 30).await.unwrap()),
        s3.clone(),
    ))));
    let plain: Arc<dyn BlobStore> = Arc::new(IntegrityStore::new(s3.clone()));
    let (data, d) = blob(80, 4000);
    s.put(&d, data.clone()).await.unwrap();
    let endpoint = server.endpoint();
    drop(server);
    let (data2, d2) = blob(81, 4000);
    for store in [&s, &plain] {
        let e = store.find_present(&[d2]).await.expect_err("an unreachable bucket is not a miss");
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
        assert!(e.to_string().contains(&bucket) && e.to_string().contains(&endpoint), "{e}");
        let e = store.read(&d2, 0, None).await.err().unwrap();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
        let e = store.put(&d2, data2.clone()).await.expect_err("a write S3 did not take is not acknowledged");
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
        // a multipart upload fails too, at the latest on commit
        let (big, bd) = blob(82, PART_SIZE + 1);
        let e = store.put(&bd, big).await.err().unwrap();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    }
    // What the tier holds is still served: the bucket had it when it was written.
    assert_eq!(s.get(&d).await.unwrap(), data);
    assert_eq!(s.find_present(&[d]).await.unwrap(), [true]);
}

/// S3 dies in the middle of a multipart upload: the writer's client gets UNAVAILABLE
/// (at the latest on commit), nothing is acknowledged, and the same store works again
/// once S3 is back on its address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_killed_mid_upload_acknowledges_nothing_and_recovers() {
    let Some(server) = S3Server::start() else { return };
    let port = server.port();
    let bucket = fresh_bucket(&server);
    let s3 = Arc::new(S3Store::open(s3_options(&server, &bucket)).unwrap());
    let s: Arc<dyn BlobStore> = Arc::new(IntegrityStore::new(s3.clone()));
    let (big, bd) = blob(90, 3 * PART_SIZE + 5);
    let mut w = s.begin_write(&bd).await.unwrap();
    // Two parts' worth: the multipart upload is started and its parts are in flight.
    w.write(big.slice(..2 * PART_SIZE + 1)).await.unwrap();
    assert!(s3.requests().put.load(Ordering::Relaxed) >= 2, "the upload reached S3 before it died");
    drop(server);
    let result = match w.write(big.slice(2 * PART_SIZE + 1..)).await {
        Ok(()) => w.commit().await,
        Err(e) => Err(e),
    };
    let e = result.expect_err("an upload S3 did not complete is not acknowledged");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    assert!(e.to_string().contains(&bucket), "the error names the bucket: {e}");

    // S3 comes back where it was (moto keeps nothing: the bucket is made again).
    let server = S3Server::start_on(port).expect("S3 back on its port");
    server.create_bucket(&bucket);
    assert!(!s.has(&bd).await.unwrap(), "no blob was acknowledged");
    s.put(&bd, big.clone()).await.unwrap();
    assert_eq!(s.get(&bd).await.unwrap(), big, "the same store works again");
}

/// What a bucket lifecycle rule "expire `after` past Last-Modified" would remove now: the
/// test applies it itself, since the S3 test server runs no lifecycle rules.
async fn apply_lifecycle(server: &S3Server, bucket: &str, after: Duration) -> usize {
    use object_store::{ObjectStore, ObjectStoreExt};
    crate::s3_store::install_crypto_provider();
    let store = object_store::aws::AmazonS3Builder::new()
        .with_bucket_name(bucket)
        .with_endpoint(server.endpoint())
        .with_allow_http(true)
        .with_region("us-east-1")
        .with_access_key_id(S3_KEY_ID)
        .with_secret_access_key(S3_SECRET_KEY)
        .build()
        .unwrap();
    let objects: Vec<object_store::ObjectMeta> = futures::TryStreamExt::try_collect(store.list(None)).await.unwrap();
    let now = std::time::SystemTime::now();
    let mut removed = 0;
    for o in objects {
        if std::time::SystemTime::from(o.last_modified) + after <= now {
            store.delete(&o.location).await.unwrap();
            removed += 1;
        }
    }
    removed
}

/// The lifetime promise on a bucket with a lifecycle rule: an action-cache hit's blobs
/// stay downloadable for `min_blob_lifetime` after the hit (gantry refreshes objects
/// too old to promise it), and an entry whose blobs the rule removed is a miss, never a
/// hit Bazel cannot download.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_lifecycle_rule_never_breaks_a_hit() {
    use gantry_core::reapi::{ActionResult, OutputFile};
    use gantry_core::ActionCache;
    let Some(server) = S3Server::shared() else { return };
    let bucket = fresh_bucket(server);
    let (expire, lifetime) = (Duration::from_secs(5), Duration::from_secs(3));
    let s3 = Arc::new(
        S3Store::open(S3Options {
            expire_after: Some(expire),
            min_blob_lifetime: lifetime,
            ..s3_options(server, &bucket)
        })
        .unwrap(),
    );
    let dir = tempfile::tempdir().unwrap();
    let tier = Arc::new(FsStore::open(dir.path(), 1 << 30).await.unwrap());
    let cas: Arc<dyn BlobStore> =
        Arc::new(IntegrityStore::new(Arc::new(TieredStore::new(tier, s3.clone()).with_remote_presence())));
    let db = crate::MetadataDb::open("sqlite::memory:").await.unwrap();
    let ac = crate::CompletenessCheckingActionCache::new(Arc::new(crate::SqlActionCache::new(db)), cas.clone());
    // Two entries, each with its own outputs; both fully present.
    let mut entries = Vec::new();
    for e in 0..2u32 {
        let outputs: Vec<_> = (0..3u32).map(|i| blob_n(100 * e + i, 2000)).collect();
        for (data, d) in &outputs {
            cas.put(d, data.clone()).await.unwrap();
        }
        let result = ActionResult {
            output_files: outputs
                .iter()
                .enumerate()
                .map(|(i, (_, d))| OutputFile {
                    path: format!("out{i}"),
                    digest: Some(d.to_proto()),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let action = blob_n(900 + e, 10).1;
        ac.put("", &action, &result).await.unwrap();
        entries.push((action, outputs));
    }
    let written = std::time::Instant::now();
    assert!(ac.get("", &entries[0].0).await.unwrap().is_some());

    // Past expire - lifetime, a hit must refresh its blobs: the rule would otherwise
    // remove them sooner than promised.
    tokio::time::sleep((expire - lifetime) + Duration::from_millis(1500)).await;
    let copies = s3.requests().copy.load(Ordering::Relaxed);
    assert!(ac.get("", &entries[0].0).await.unwrap().is_some());
    assert_eq!(
        s3.requests().copy.load(Ordering::Relaxed) - copies,
        6,
        "each of the hit's 3 objects refreshed (2 copies each)"
    );

    // The rule runs once the first writes are past `expire`: it removes entry 1's
    // objects and leaves entry 0's refreshed ones.
    tokio::time::sleep((expire + Duration::from_millis(1200)).saturating_sub(written.elapsed())).await;
    assert_eq!(apply_lifecycle(server, &bucket, expire).await, 3, "entry 1's three objects expired");
    assert!(ac.get("", &entries[1].0).await.unwrap().is_none(), "blobs the rule removed make the entry a miss");
    assert!(ac.get("", &entries[0].0).await.unwrap().is_some());
    for (data, d) in &entries[0].1 {
        assert_eq!(&cas.get(d).await.unwrap(), data, "the hit's blobs are still downloadable");
    }
    // Without the rule configured, gantry would have trusted its record of the removed
    // blobs: the promise comes from knowing the rule.
    assert!(!cas.find_present(&[entries[1].1[0].1]).await.unwrap()[0]);
}
