//! Chaos: `gantry serve` SIGKILLed at random moments under mixed write load
//! (BatchUpdateBlobs, ByteStream writes, UpdateActionResult), restarted on the same data
//! directory, 20 times. After every restart each write the server acknowledged, in any
//! cycle so far, must read back byte-identical.
//!
//! Also: the disk under a server's CAS and metadata fills up (a tmpfs in a namespace of
//! the server's own), and the server refuses, recovers and corrupts nothing.
//!
//! Reproducible from the seed printed at the start: set `GANTRY_CHAOS_SEED` to replay a
//! run's schedule (kill moments, sizes, contents; the interleaving of the writers with the
//! kill still depends on timing). Bounded: about two minutes.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::GantryServer;
use futures::StreamExt;
use gantry_core::google::bytestream::byte_stream_client::ByteStreamClient;
use gantry_core::google::bytestream::{ReadRequest, WriteRequest};
use gantry_core::reapi::action_cache_client::ActionCacheClient;
use gantry_core::reapi::content_addressable_storage_client::ContentAddressableStorageClient;
use gantry_core::reapi::{self, batch_update_blobs_request};
use gantry_core::{Digest, DigestFunction};
use tonic::transport::Channel;

const CYCLES: usize = 20;
const WRITERS: u64 = 4;
/// Read-backs in flight after a restart.
const READS: usize = 16;

/// splitmix64: a tiny deterministic generator, so the schedule follows from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }
}

/// What the server acknowledged: blobs, and action cache entries (action digest, result).
#[derive(Default, Clone)]
struct Acked {
    blobs: Vec<(Digest, Vec<u8>)>,
    ac: Vec<(Digest, reapi::ActionResult)>,
}

fn batch_request(blobs: &[Vec<u8>]) -> reapi::BatchUpdateBlobsRequest {
    reapi::BatchUpdateBlobsRequest {
        requests: blobs
            .iter()
            .map(|b| batch_update_blobs_request::Request {
                digest: Some(DigestFunction::Sha256.digest_of(b).to_proto()),
                data: b.clone(),
                compressor: 0,
            })
            .collect(),
        ..Default::default()
    }
}

/// A ByteStream upload of `data` to `name` in chunks of `chunk` bytes.
fn write_requests(name: &str, data: &[u8], chunk: usize) -> Vec<WriteRequest> {
    (0..data.len())
        .step_by(chunk)
        .map(|off| WriteRequest {
            resource_name: if off == 0 { name.to_string() } else { String::new() },
            write_offset: off as i64,
            finish_write: off + chunk >= data.len(),
            data: data[off..(off + chunk).min(data.len())].to_vec(),
        })
        .collect()
}

async fn writer(channel: Channel, mut rng: Rng, acked: Arc<Mutex<Acked>>) {
    let mut cas = ContentAddressableStorageClient::new(channel.clone());
    let mut bs = ByteStreamClient::new(channel.clone());
    let mut ac = ActionCacheClient::new(channel);
    loop {
        match rng.below(3) {
            0 => {
                let blobs: Vec<Vec<u8>> = (0..1 + rng.below(16))
                    .map(|_| {
                        let n = 1 + rng.below(16 << 10) as usize;
                        rng.bytes(n)
                    })
                    .collect();
                let Ok(resp) = cas.batch_update_blobs(batch_request(&blobs)).await else { return };
                let mut a = acked.lock().unwrap();
                for (b, r) in blobs.into_iter().zip(resp.into_inner().responses) {
                    if r.status.is_some_and(|s| s.code == 0) {
                        a.blobs.push((DigestFunction::Sha256.digest_of(&b), b));
                    }
                }
            }
            1 => {
                let n = (64 << 10) + rng.below(1 << 20) as usize;
                let data = rng.bytes(n);
                let d = DigestFunction::Sha256.digest_of(&data);
                let name = format!("uploads/{:016x}/blobs/{}/{}", rng.next(), d.hash_hex(), d.size);
                let Ok(resp) = bs.write(futures::stream::iter(write_requests(&name, &data, 64 << 10))).await else {
                    return;
                };
                if resp.into_inner().committed_size == d.size as i64 {
                    acked.lock().unwrap().blobs.push((d, data));
                }
            }
            _ => {
                // An entry whose stdout is a blob acknowledged earlier, so the completeness
                // check has something to verify after the restart.
                let stdout = acked.lock().unwrap().blobs.last().map(|(d, _)| *d);
                let Some(stdout) = stdout else { continue };
                let action = DigestFunction::Sha256.digest_of(&rng.bytes(32));
                let result = reapi::ActionResult {
                    exit_code: rng.below(100) as i32,
                    stdout_digest: Some(stdout.to_proto()),
                    ..Default::default()
                };
                let req = reapi::UpdateActionResultRequest {
                    action_digest: Some(action.to_proto()),
                    action_result: Some(result.clone()),
                    ..Default::default()
                };
                if ac.update_action_result(req).await.is_ok() {
                    acked.lock().unwrap().ac.push((action, result));
                }
            }
        }
    }
}

async fn read_blob(channel: &Channel, d: &Digest) -> Vec<u8> {
    let mut bs = ByteStreamClient::new(channel.clone()).max_decoding_message_size(64 << 20);
    let name = format!("blobs/{}/{}", d.hash_hex(), d.size);
    let mut s = bs
        .read(ReadRequest { resource_name: name, read_offset: 0, read_limit: 0 })
        .await
        .unwrap_or_else(|e| panic!("acknowledged blob {d} is gone: {e}"))
        .into_inner();
    let mut out = Vec::with_capacity(d.size as usize);
    while let Some(m) = s.message().await.unwrap_or_else(|e| panic!("reading acknowledged blob {d}: {e}")) {
        out.extend_from_slice(&m.data);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_write_load_loses_no_acknowledged_write() {
    let seed: u64 = std::env::var("GANTRY_CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    eprintln!("chaos seed: {seed} (GANTRY_CHAOS_SEED={seed} replays the schedule)");
    let mut rng = Rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let listen = common::free_addr();
    // No workers: this is about the stores.
    let cfg = tmp.path().join("gantry.toml");
    std::fs::write(&cfg, "[execution]\nworkers = 0\n").unwrap();
    let args = ["--config", cfg.to_str().unwrap()];
    let acked = Arc::new(Mutex::new(Acked::default()));
    let mut verified = 0;
    // One start more than kills: the writes of the last cycle are verified too.
    for cycle in 0..=CYCLES {
        let restart = std::time::Instant::now();
        let server = GantryServer::start_at(&listen, &data, &args);
        let channel = Channel::from_shared(format!("http://{}", server.grpc)).unwrap().connect().await.unwrap();
        let startup = restart.elapsed();
        // Everything acknowledged so far, in every earlier cycle, reads back intact.
        // Read READS at a time: every cycle reads back all earlier cycles' writes too
        // (150,000 reads in all), which one at a time took most of the test's 3 minutes.
        let Acked { blobs, ac: entries } = acked.lock().unwrap().clone();
        let mut reads = futures::stream::iter(&blobs)
            .map(|(d, bytes)| {
                let channel = channel.clone();
                async move { (d, read_blob(&channel, d).await == *bytes) }
            })
            .buffer_unordered(READS);
        while let Some((d, same)) = reads.next().await {
            assert!(same, "cycle {cycle}: acknowledged blob {d} differs (seed {seed})");
        }
        let mut lookups = futures::stream::iter(&entries)
            .map(|(action, result)| {
                let mut ac = ActionCacheClient::new(channel.clone());
                async move {
                    let got = ac
                        .get_action_result(reapi::GetActionResultRequest {
                            action_digest: Some(action.to_proto()),
                            ..Default::default()
                        })
                        .await;
                    (action, result, got)
                }
            })
            .buffer_unordered(READS);
        while let Some((action, result, got)) = lookups.next().await {
            let got = got
                .unwrap_or_else(|e| panic!("cycle {cycle}: acknowledged AC entry {action} is gone: {e} (seed {seed})"))
                .into_inner();
            assert_eq!(got.exit_code, result.exit_code, "cycle {cycle}: AC entry {action} (seed {seed})");
            assert_eq!(got.stdout_digest, result.stdout_digest, "cycle {cycle}: AC entry {action} (seed {seed})");
        }
        verified = blobs.len();
        eprintln!(
            "cycle {cycle}: restarted in {:.2}s; {} blobs and {} AC entries verified",
            startup.as_secs_f64(),
            blobs.len(),
            entries.len()
        );
        if cycle == CYCLES {
            server.stop();
            break;
        }
        // Load, then a SIGKILL at a moment drawn from the seed.
        let tasks: Vec<_> = (0..WRITERS)
            .map(|w| tokio::spawn(writer(channel.clone(), Rng(seed ^ ((cycle as u64) << 32) ^ (w + 1)), acked.clone())))
            .collect();
        tokio::time::sleep(Duration::from_millis(200 + rng.below(1300))).await;
        server.kill9();
        for t in tasks {
            t.abort();
            let _ = t.await;
        }
    }
    let a = acked.lock().unwrap();
    eprintln!(
        "{CYCLES} SIGKILL cycles (seed {seed}): {} blobs and {} AC entries acknowledged, all read back intact after the last restart",
        a.blobs.len(),
        a.ac.len()
    );
    assert_eq!(verified, a.blobs.len(), "every acknowledged blob was checked after the last restart");
    assert!(a.blobs.len() > 100 && a.ac.len() > 10, "the load did write (seed {seed})");
}

/// The disk under the CAS and the metadata database fills up (a 24 MiB tmpfs, with the
/// CAS's `max_size` far above it), under streamed and batched uploads worth three disks
/// and action cache writes. Streamed uploads that find the disk full get
/// RESOURCE_EXHAUSTED naming the CAS and succeed when retried (the store made room by
/// evicting); batched small blobs are retried by the server itself; nothing else fails;
/// every acknowledged blob still stored reads back byte-identical; and the server answers
/// throughout and stops cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_under_the_server_is_resource_exhausted_and_recovers() {
    if !common::namespaces_usable() {
        eprintln!("skipped: no user and mount namespaces here");
        return;
    }
    let seed: u64 = std::env::var("GANTRY_CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(7);
    let mut rng = Rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let cfg = tmp.path().join("gantry.toml");
    std::fs::write(&cfg, "[execution]\nworkers = 0\n").unwrap();
    let server = GantryServer::start_on_tmpfs(&data, "24m", &["--config", cfg.to_str().unwrap()]);
    let channel = Channel::from_shared(format!("http://{}", server.grpc)).unwrap().connect().await.unwrap();
    let mut cas = ContentAddressableStorageClient::new(channel.clone());
    let mut bs = ByteStreamClient::new(channel.clone());
    let mut ac = ActionCacheClient::new(channel.clone());
    let mut acked: Vec<(Digest, Vec<u8>)> = Vec::new();
    let (mut exhausted, mut ac_ok, mut ac_full) = (0, 0, 0);
    for round in 0..24 {
        // A streamed 2 MiB upload; on RESOURCE_EXHAUSTED the client retries once.
        let data = rng.bytes(2 << 20);
        let d = DigestFunction::Sha256.digest_of(&data);
        for attempt in 0..2 {
            let name = format!("uploads/{round}-{attempt}/blobs/{}/{}", d.hash_hex(), d.size);
            match bs.write(futures::stream::iter(write_requests(&name, &data, 256 << 10))).await {
                Ok(r) => {
                    assert_eq!(r.into_inner().committed_size, d.size as i64);
                    acked.push((d, data.clone()));
                    break;
                }
                Err(e) => {
                    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "round {round}: {e}");
                    assert!(e.message().contains("the disk is full"), "{e}");
                    assert_eq!(attempt, 0, "round {round}: the retry after the store made room failed too: {e}");
                    exhausted += 1;
                }
            }
        }
        // A batch of small blobs: the server retries a full disk itself.
        let blobs: Vec<Vec<u8>> = (0..16).map(|_| rng.bytes(16 << 10)).collect();
        let resp = cas.batch_update_blobs(batch_request(&blobs)).await.expect("BatchUpdateBlobs answers").into_inner();
        for (b, r) in blobs.into_iter().zip(resp.responses) {
            let code = r.status.map_or(0, |s| s.code);
            assert_eq!(code, 0, "round {round}: a small blob was refused");
            acked.push((DigestFunction::Sha256.digest_of(&b), b));
        }
        // An action cache entry: stored, or refused for want of room, never anything else.
        let action = DigestFunction::Sha256.digest_of(&rng.bytes(32));
        let result = reapi::ActionResult { exit_code: round, ..Default::default() };
        let req = reapi::UpdateActionResultRequest {
            action_digest: Some(action.to_proto()),
            action_result: Some(result.clone()),
            ..Default::default()
        };
        match ac.update_action_result(req).await {
            Ok(_) => {
                ac_ok += 1;
                let got = ac
                    .get_action_result(reapi::GetActionResultRequest {
                        action_digest: Some(action.to_proto()),
                        ..Default::default()
                    })
                    .await
                    .expect("an acknowledged entry reads back")
                    .into_inner();
                assert_eq!(got.exit_code, round);
            }
            Err(e) => {
                assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
                ac_full += 1;
            }
        }
    }
    // 72 MiB went through a 24 MiB disk: older blobs were evicted, none is corrupt.
    let digests: Vec<_> = acked.iter().map(|(d, _)| d.to_proto()).collect();
    let missing = cas
        .find_missing_blobs(reapi::FindMissingBlobsRequest { blob_digests: digests, ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .missing_blob_digests;
    let mut intact = 0;
    for (d, bytes) in &acked {
        if missing.contains(&d.to_proto()) {
            continue;
        }
        assert!(read_blob(&channel, d).await == *bytes, "blob {d} differs from what was acknowledged");
        intact += 1;
    }
    eprintln!(
        "seed {seed}: {} uploads acknowledged, {exhausted} streamed uploads found the disk full and succeeded on retry, \
         {} evicted, {intact} read back intact; action cache: {ac_ok} stored, {ac_full} refused for want of room",
        acked.len(),
        missing.len()
    );
    assert!(exhausted > 0, "the disk never filled");
    assert!(!missing.is_empty() && intact > 0);
    assert!(ac_ok > 0);
    server.stop();
}
