//! Every cache RPC through a real tonic client against a real server on loopback, with
//! the same store stack `gantry serve` builds (filesystem CAS, SQLite action cache).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gantry_core::google::bytestream::byte_stream_client::ByteStreamClient;
use gantry_core::google::bytestream::{QueryWriteStatusRequest, ReadRequest, WriteRequest};
use gantry_core::reapi::action_cache_client::ActionCacheClient;
use gantry_core::reapi::capabilities_client::CapabilitiesClient;
use gantry_core::reapi::content_addressable_storage_client::ContentAddressableStorageClient;
use gantry_core::reapi::{self, compressor, ActionResult, Directory, DirectoryNode, FileNode, OutputFile};
use gantry_core::{BlobStore, Digest, DigestFunction};
use gantry_services::{Limits, RunningServer, Services};
use gantry_store::{CompletenessCheckingActionCache, FsStore, IntegrityStore, SqlActionCache};
use prost::Message;
use tonic::transport::Channel;
use tonic::Code;

struct Harness {
    server: Option<RunningServer>,
    channel: Channel,
    cas: Arc<dyn BlobStore>,
}

/// A directory for a test's stores, removed when the test binary exits: the server's
/// task holds the store until the test's runtime shuts down, after the test's own
/// locals are gone, and its journal then puts its last blobs in place, which would
/// recreate a directory removed with them and leave it behind.
fn store_dir() -> std::path::PathBuf {
    let dir = tempfile::tempdir().unwrap().keep();
    gantry_testkit::remove_at_exit(dir.clone());
    dir
}

async fn harness_with(limits: Limits, max_cas: u64) -> Harness {
    let dir = store_dir();
    let cas: Arc<dyn BlobStore> =
        Arc::new(IntegrityStore::new(Arc::new(FsStore::open(dir.join("cas"), max_cas).await.unwrap())));
    let sql = SqlActionCache::new(
        gantry_store::MetadataDb::open(&format!("sqlite://{}/ac.db", dir.display())).await.unwrap(),
    );
    let ac = Arc::new(CompletenessCheckingActionCache::new(Arc::new(sql), cas.clone()));
    let services = Services::new(cas.clone(), ac, limits);
    let server =
        RunningServer::start(&services, "127.0.0.1:0".parse().unwrap(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let channel = Channel::from_shared(format!("http://{}", server.grpc_addr)).unwrap().connect().await.unwrap();
    Harness { server: Some(server), channel, cas }
}

async fn harness() -> Harness {
    harness_with(Limits::default(), 1 << 30).await
}

impl Harness {
    fn cas_client(&self) -> ContentAddressableStorageClient<Channel> {
        ContentAddressableStorageClient::new(self.channel.clone()).max_decoding_message_size(64 << 20)
    }
    fn bs(&self) -> ByteStreamClient<Channel> {
        ByteStreamClient::new(self.channel.clone()).max_decoding_message_size(64 << 20)
    }
    fn ac(&self) -> ActionCacheClient<Channel> {
        ActionCacheClient::new(self.channel.clone())
    }
    async fn upload(&self, data: &[u8]) -> Digest {
        let d = DigestFunction::Sha256.digest_of(data);
        let resp = self
            .cas_client()
            .batch_update_blobs(reapi::BatchUpdateBlobsRequest {
                requests: vec![reapi::batch_update_blobs_request::Request {
                    digest: Some(d.to_proto()),
                    data: data.to_vec(),
                    compressor: 0,
                }],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(resp.responses[0].status.as_ref().unwrap().code, 0, "{:?}", resp.responses[0].status);
        d
    }
    async fn read_all(&self, name: String, offset: i64, limit: i64) -> Result<Vec<u8>, tonic::Status> {
        let mut stream = self
            .bs()
            .read(ReadRequest { resource_name: name, read_offset: offset, read_limit: limit })
            .await?
            .into_inner();
        let mut out = Vec::new();
        while let Some(m) = stream.message().await? {
            out.extend_from_slice(&m.data);
        }
        Ok(out)
    }
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    // Mildly compressible, deterministic content.
    (0..len as u32).map(|i| ((i / 64).wrapping_mul(2654435761).wrapping_add(seed) >> 13) as u8).collect()
}

fn write_reqs(name: &str, data: &[u8], start: usize, chunk: usize, finish: bool) -> Vec<WriteRequest> {
    let mut reqs = Vec::new();
    let mut off = start;
    while off < data.len() || reqs.is_empty() {
        let end = (off + chunk).min(data.len());
        reqs.push(WriteRequest {
            resource_name: if reqs.is_empty() { name.to_string() } else { String::new() },
            write_offset: off as i64,
            finish_write: finish && end == data.len(),
            data: data[off..end].to_vec(),
        });
        off = end;
        if off == data.len() {
            break;
        }
    }
    reqs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_advertise_digests_compression_and_limits() {
    let h = harness().await;
    let caps = CapabilitiesClient::new(h.channel.clone())
        .get_capabilities(reapi::GetCapabilitiesRequest { instance_name: "x".into() })
        .await
        .unwrap()
        .into_inner();
    let cache = caps.cache_capabilities.unwrap();
    assert!(cache.digest_functions.contains(&(reapi::digest_function::Value::Sha256 as i32)));
    assert!(cache.digest_functions.contains(&(reapi::digest_function::Value::Blake3 as i32)));
    assert_eq!(cache.max_batch_total_size_bytes, 4 << 20);
    assert_eq!(cache.supported_compressors, vec![compressor::Value::Zstd as i32]);
    assert_eq!(cache.supported_batch_update_compressors, vec![compressor::Value::Zstd as i32]);
    assert!(cache.action_cache_update_capabilities.unwrap().update_enabled);
    assert_eq!(cache.symlink_absolute_path_strategy, reapi::symlink_absolute_path_strategy::Value::Allowed as i32);
    assert_eq!(caps.high_api_version.unwrap().major, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn find_missing_batch_update_and_read() {
    let h = harness().await;
    let mut cas = h.cas_client();
    let a = pattern(1000, 1);
    let b = pattern(70_000, 2);
    let da = DigestFunction::Sha256.digest_of(&a);
    let db = DigestFunction::Sha256.digest_of(&b);
    let missing = cas
        .find_missing_blobs(reapi::FindMissingBlobsRequest {
            blob_digests: vec![da.to_proto(), db.to_proto(), DigestFunction::Sha256.empty().to_proto()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .missing_blob_digests;
    assert_eq!(missing, vec![da.to_proto(), db.to_proto()], "the empty blob is always present");
    // b is sent zstd-compressed
    let resp = cas
        .batch_update_blobs(reapi::BatchUpdateBlobsRequest {
            requests: vec![
                reapi::batch_update_blobs_request::Request {
                    digest: Some(da.to_proto()),
                    data: a.clone(),
                    compressor: 0,
                },
                reapi::batch_update_blobs_request::Request {
                    digest: Some(db.to_proto()),
                    data: zstd::bulk::compress(&b, 3).unwrap(),
                    compressor: compressor::Value::Zstd as i32,
                },
            ],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(resp.responses.iter().all(|r| r.status.as_ref().unwrap().code == 0), "{resp:?}");
    let unknown = DigestFunction::Sha256.digest_of(b"never uploaded");
    let read = cas
        .batch_read_blobs(reapi::BatchReadBlobsRequest {
            digests: vec![da.to_proto(), db.to_proto(), unknown.to_proto()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(read.responses[0].data, a);
    assert_eq!(read.responses[1].data, b);
    assert_eq!(read.responses[2].status.as_ref().unwrap().code, Code::NotFound as i32);
    // zstd on the way out when acceptable
    let read = cas
        .batch_read_blobs(reapi::BatchReadBlobsRequest {
            digests: vec![db.to_proto()],
            acceptable_compressors: vec![compressor::Value::Zstd as i32],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(read.responses[0].compressor, compressor::Value::Zstd as i32);
    assert_eq!(zstd::bulk::decompress(&read.responses[0].data, b.len()).unwrap(), b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digest_mismatch_is_rejected_and_nothing_is_stored() {
    let h = harness().await;
    let data = pattern(5000, 3);
    let d = DigestFunction::Sha256.digest_of(&data);
    let mut wrong = data.clone();
    wrong[0] ^= 0xff;
    let resp = h
        .cas_client()
        .batch_update_blobs(reapi::BatchUpdateBlobsRequest {
            requests: vec![reapi::batch_update_blobs_request::Request {
                digest: Some(d.to_proto()),
                data: wrong.clone(),
                compressor: 0,
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let st = resp.responses[0].status.clone().unwrap();
    assert_eq!(st.code, Code::InvalidArgument as i32);
    assert!(st.message.contains("requests[0]") && st.message.contains("hashes to"), "{}", st.message);
    assert!(!h.cas.has(&d).await.unwrap());
    // the same through ByteStream
    let name = format!("uploads/{}/blobs/{}/{}", uuid::Uuid::new_v4(), d.hash_hex(), d.size);
    let err = h.bs().write(futures::stream::iter(write_reqs(&name, &wrong, 0, 1000, true))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(!h.cas.has(&d).await.unwrap());
    // a malformed digest in a request names the field
    let err = h
        .cas_client()
        .find_missing_blobs(reapi::FindMissingBlobsRequest {
            blob_digests: vec![d.to_proto(), reapi::Digest { hash: "abc".into(), size_bytes: 1 }],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("blob_digests[1]"), "{}", err.message());
    // and a bad resource name too
    let err = h.read_all("blobs/nothex/12".into(), 0, 0).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("resource_name"), "{}", err.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blob_larger_than_batch_limit_goes_through_bytestream() {
    let h = harness().await;
    let data = pattern(9 << 20, 4); // over the 4 MiB batch limit
    let d = DigestFunction::Sha256.digest_of(&data);
    let err = h
        .cas_client()
        .batch_update_blobs(reapi::BatchUpdateBlobsRequest {
            requests: vec![reapi::batch_update_blobs_request::Request {
                digest: Some(d.to_proto()),
                data: data.clone(),
                compressor: 0,
            }],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(matches!(err.code(), Code::InvalidArgument | Code::ResourceExhausted | Code::OutOfRange), "{err}");
    let name = format!("main/uploads/{}/blobs/{}/{}", uuid::Uuid::new_v4(), d.hash_hex(), d.size);
    let resp =
        h.bs().write(futures::stream::iter(write_reqs(&name, &data, 0, 64 << 10, true))).await.unwrap().into_inner();
    assert_eq!(resp.committed_size, data.len() as i64);
    let read_name = format!("main/blobs/{}/{}", d.hash_hex(), d.size);
    assert!(h.read_all(read_name.clone(), 0, 0).await.unwrap() == data);
    // offset and limit
    assert!(h.read_all(read_name.clone(), 5_000_000, 1234).await.unwrap() == data[5_000_000..5_001_234]);
    assert!(h.read_all(read_name.clone(), 9 << 20, 0).await.unwrap().is_empty());
    let err = h.read_all(read_name.clone(), (9 << 20) + 1, 0).await.unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange);
    let err = h.read_all(read_name.clone(), -1, 0).await.unwrap_err();
    assert!(err.code() == Code::InvalidArgument && err.message().contains("read_offset"), "{err}");
    let err = h
        .read_all(format!("main/blobs/{}/{}", DigestFunction::Sha256.digest_of(b"x").hash_hex(), 1), 0, 0)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    // writing it again finishes at once
    let resp = h
        .bs()
        .write(futures::stream::iter(write_reqs(
            &name.replace("main/uploads/", "main/uploads/x"),
            &data,
            0,
            1 << 20,
            true,
        )))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.committed_size, data.len() as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumable_write() {
    let h = harness().await;
    let data = pattern(3 << 20, 5);
    let d = DigestFunction::Sha256.digest_of(&data);
    let name = format!("uploads/{}/blobs/{}/{}", uuid::Uuid::new_v4(), d.hash_hex(), d.size);
    // Unknown upload: committed_size 0 (Bazel restarts from 0 on that; an error is fatal to it)
    let st =
        h.bs().query_write_status(QueryWriteStatusRequest { resource_name: name.clone() }).await.unwrap().into_inner();
    assert_eq!((st.committed_size, st.complete), (0, false));
    // Send the first 1 MiB + a bit, then end the stream without finish_write.
    let first_part = 1_200_000;
    let reqs = write_reqs(&name, &data[..first_part], 0, 100_000, false);
    let err = h.bs().write(futures::stream::iter(reqs)).await.unwrap_err();
    assert!(err.message().contains("resume"), "{err}");
    let st =
        h.bs().query_write_status(QueryWriteStatusRequest { resource_name: name.clone() }).await.unwrap().into_inner();
    assert_eq!(st.committed_size, first_part as i64);
    assert!(!st.complete);
    assert!(!h.cas.has(&d).await.unwrap(), "not visible before finish_write");
    // Resuming at a wrong offset is refused and names both numbers.
    let bad = vec![WriteRequest { resource_name: name.clone(), write_offset: 5, finish_write: false, data: vec![1] }];
    let err = h.bs().write(futures::stream::iter(bad)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("write_offset 5") && err.message().contains(&first_part.to_string()), "{err}");
    // A refused resume discards the upload: the client is told to start over from 0.
    let st =
        h.bs().query_write_status(QueryWriteStatusRequest { resource_name: name.clone() }).await.unwrap().into_inner();
    assert_eq!(st.committed_size, 0);
    let reqs = write_reqs(&name, &data[..first_part], 0, 100_000, false);
    let _ = h.bs().write(futures::stream::iter(reqs)).await.unwrap_err();
    // Resume from committed_size and finish.
    let reqs = write_reqs(&name, &data, first_part, 256_000, true);
    let resp = h.bs().write(futures::stream::iter(reqs)).await.unwrap().into_inner();
    assert_eq!(resp.committed_size, data.len() as i64);
    let st =
        h.bs().query_write_status(QueryWriteStatusRequest { resource_name: name.clone() }).await.unwrap().into_inner();
    assert!(st.complete);
    assert!(h.read_all(format!("blobs/{}/{}", d.hash_hex(), d.size), 0, 0).await.unwrap() == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_uploads_are_dropped() {
    let limits = Limits { upload_idle_timeout: Duration::from_millis(300), ..Limits::default() };
    let h = harness_with(limits, 1 << 30).await;
    let data = pattern(10_000, 6);
    let d = DigestFunction::Sha256.digest_of(&data);
    let name = format!("uploads/{}/blobs/{}/{}", uuid::Uuid::new_v4(), d.hash_hex(), d.size);
    let _ = h.bs().write(futures::stream::iter(write_reqs(&name, &data[..5000], 0, 1000, false))).await;
    let st = h.bs().query_write_status(QueryWriteStatusRequest { resource_name: name.clone() }).await.unwrap();
    assert_eq!(st.into_inner().committed_size, 5000);
    tokio::time::sleep(Duration::from_millis(900)).await;
    let st = h.bs().query_write_status(QueryWriteStatusRequest { resource_name: name.clone() }).await.unwrap();
    assert_eq!(st.into_inner().committed_size, 0, "the idle upload was dropped");
    // and resuming it is refused with a hint
    let resume = vec![WriteRequest {
        resource_name: name.clone(),
        write_offset: 5000,
        finish_write: true,
        data: data[5000..].to_vec(),
    }];
    let err = h.bs().write(futures::stream::iter(resume)).await.unwrap_err();
    assert!(err.code() == Code::InvalidArgument && err.message().contains("start at offset 0"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zstd_bytestream_round_trip() {
    let h = harness().await;
    let data = pattern(6 << 20, 7);
    let d = DigestFunction::Sha256.digest_of(&data);
    let compressed = zstd::bulk::compress(&data, 3).unwrap();
    assert!(compressed.len() < data.len());
    let name = format!("inst/uploads/{}/compressed-blobs/zstd/{}/{}", uuid::Uuid::new_v4(), d.hash_hex(), d.size);
    let resp = h
        .bs()
        .write(futures::stream::iter(write_reqs(&name, &compressed, 0, 50_000, true)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.committed_size, compressed.len() as i64);
    // readable uncompressed...
    assert!(h.read_all(format!("inst/blobs/{}/{}", d.hash_hex(), d.size), 0, 0).await.unwrap() == data);
    // ...and compressed, whole and windowed
    let whole = h.read_all(format!("inst/compressed-blobs/zstd/{}/{}", d.hash_hex(), d.size), 0, 0).await.unwrap();
    assert!(zstd::bulk::decompress(&whole, data.len()).unwrap() == data);
    let part = h.read_all(format!("inst/compressed-blobs/zstd/{}/{}", d.hash_hex(), d.size), 100, 1000).await.unwrap();
    assert_eq!(part, whole[100..1100]);
    // an existing blob through a compressed write: committed_size -1
    let name2 = format!("uploads/{}/compressed-blobs/zstd/{}/{}", uuid::Uuid::new_v4(), d.hash_hex(), d.size);
    let resp = h
        .bs()
        .write(futures::stream::iter(write_reqs(&name2, &compressed, 0, 1 << 20, true)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.committed_size, -1);
    // corrupt compressed data is INVALID_ARGUMENT
    let other = pattern(1000, 8);
    let od = DigestFunction::Sha256.digest_of(&other);
    let name3 = format!("uploads/{}/compressed-blobs/zstd/{}/{}", uuid::Uuid::new_v4(), od.hash_hex(), od.size);
    let err =
        h.bs().write(futures::stream::iter(write_reqs(&name3, b"not zstd at all", 0, 100, true))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(!h.cas.has(&od).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_tree_pages_through_a_nested_tree() {
    let h = harness().await;
    // root -> a, b; a -> c; b -> c (shared); c has one file. 4 distinct directories.
    let file = h.upload(b"leaf file").await;
    let c = Directory {
        files: vec![FileNode { name: "f".into(), digest: Some(file.to_proto()), ..Default::default() }],
        ..Default::default()
    };
    let dc = h.upload(&c.encode_to_vec()).await;
    let node = |n: &str, d: Digest| DirectoryNode { name: n.into(), digest: Some(d.to_proto()) };
    let a = Directory { directories: vec![node("c", dc)], ..Default::default() };
    let da = h.upload(&a.encode_to_vec()).await;
    // b shares c with a but differs from it by one file
    let b = Directory {
        directories: vec![node("c", dc)],
        files: vec![FileNode { name: "g".into(), digest: Some(file.to_proto()), ..Default::default() }],
        ..Default::default()
    };
    let db = h.upload(&b.encode_to_vec()).await;
    let root = Directory { directories: vec![node("a", da), node("b", db)], ..Default::default() };
    let droot = h.upload(&root.encode_to_vec()).await;

    let mut all = Vec::new();
    let mut token = String::new();
    let mut calls = 0;
    loop {
        let mut s = h
            .cas_client()
            .get_tree(reapi::GetTreeRequest {
                root_digest: Some(droot.to_proto()),
                page_size: 1,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        // Take only the first page of each call, as a paging client would.
        let page = s.message().await.unwrap().unwrap();
        assert!(page.directories.len() <= 1);
        all.extend(page.directories);
        calls += 1;
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(calls, 4);
    assert_eq!(all, vec![root.clone(), a.clone(), b.clone(), c.clone()]);
    // One call streams every page.
    let pages: Vec<_> = h
        .cas_client()
        .get_tree(reapi::GetTreeRequest { root_digest: Some(droot.to_proto()), page_size: 3, ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .map(|r| r.unwrap())
        .collect()
        .await;
    assert_eq!(pages.len(), 2);
    assert_eq!(pages[0].directories.len() + pages[1].directories.len(), 4);
    let err = h
        .cas_client()
        .get_tree(reapi::GetTreeRequest {
            root_digest: Some(file.to_proto()),
            page_token: "zz".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(err.code() == Code::InvalidArgument && err.message().contains("page_token"), "{err}");
    let err = h
        .cas_client()
        .get_tree(reapi::GetTreeRequest {
            root_digest: Some(DigestFunction::Sha256.digest_of(b"nope").to_proto()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn action_cache_instances_and_completeness() {
    let h = harness().await;
    let out = h.upload(b"output bytes").await;
    let stdout = h.upload(b"some stdout").await;
    let action = DigestFunction::Sha256.digest_of(b"an action");
    let result = ActionResult {
        output_files: vec![OutputFile {
            path: "out/x".into(),
            digest: Some(out.to_proto()),
            is_executable: true,
            ..Default::default()
        }],
        stdout_digest: Some(stdout.to_proto()),
        exit_code: 0,
        ..Default::default()
    };
    let mut ac = h.ac();
    let get = |inst: &str| reapi::GetActionResultRequest {
        instance_name: inst.into(),
        action_digest: Some(action.to_proto()),
        inline_stdout: true,
        ..Default::default()
    };
    assert_eq!(ac.get_action_result(get("a")).await.unwrap_err().code(), Code::NotFound);
    ac.update_action_result(reapi::UpdateActionResultRequest {
        instance_name: "a".into(),
        action_digest: Some(action.to_proto()),
        action_result: Some(result.clone()),
        ..Default::default()
    })
    .await
    .unwrap();
    let got = ac.get_action_result(get("a")).await.unwrap().into_inner();
    assert_eq!(got.output_files, result.output_files);
    assert_eq!(got.stdout_raw, b"some stdout", "stdout inlined on request");
    assert_eq!(ac.get_action_result(get("b")).await.unwrap_err().code(), Code::NotFound, "instances are separate");

    // An entry whose output blob is missing is a miss.
    let gone = DigestFunction::Sha256.digest_of(b"never uploaded output");
    let action2 = DigestFunction::Sha256.digest_of(b"another action");
    let mut r2 = result.clone();
    r2.output_files[0].digest = Some(gone.to_proto());
    ac.update_action_result(reapi::UpdateActionResultRequest {
        instance_name: "a".into(),
        action_digest: Some(action2.to_proto()),
        action_result: Some(r2),
        ..Default::default()
    })
    .await
    .unwrap();
    let req2 = reapi::GetActionResultRequest {
        instance_name: "a".into(),
        action_digest: Some(action2.to_proto()),
        ..Default::default()
    };
    assert_eq!(ac.get_action_result(req2.clone()).await.unwrap_err().code(), Code::NotFound);
    h.upload(b"never uploaded output").await;
    assert!(ac.get_action_result(req2).await.is_ok(), "complete once the blob arrives");

    // Malformed results are refused with the field named.
    let mut bad = result.clone();
    bad.output_files[0].digest = Some(reapi::Digest { hash: "xyz".into(), size_bytes: 3 });
    let err = ac
        .update_action_result(reapi::UpdateActionResultRequest {
            instance_name: "a".into(),
            action_digest: Some(action.to_proto()),
            action_result: Some(bad),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("output_files[0].digest"), "{}", err.message());
    // and the good entry is unchanged
    assert!(ac.get_action_result(get("a")).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_reports_rpcs_bytes_and_hits() {
    let h = harness().await;
    h.upload(b"metered").await;
    let _ = h
        .ac()
        .get_action_result(reapi::GetActionResultRequest {
            action_digest: Some(DigestFunction::Sha256.digest_of(b"a").to_proto()),
            ..Default::default()
        })
        .await;
    let addr = h.server.as_ref().unwrap().http_addr;
    let body = http_get(addr, "/metrics").await;
    for want in [
        "gantry_grpc_requests_total{code=\"OK\",method=\"ContentAddressableStorage/BatchUpdateBlobs\"} 1",
        "gantry_grpc_requests_total{code=\"NOT_FOUND\",method=\"ActionCache/GetActionResult\"} 1",
        "gantry_grpc_request_duration_seconds_count{method=\"ContentAddressableStorage/BatchUpdateBlobs\"} 1",
        "gantry_cas_bytes_received_total 7",
        "gantry_action_cache_misses_total 1",
        "gantry_cas_blobs 1",
        "gantry_cas_used_bytes 7",
    ] {
        assert!(body.contains(want), "missing '{want}' in:\n{body}");
    }
    assert!(http_get(addr, "/healthz").await.contains("ok"));
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes() {
    let mut h = harness().await;
    let server = h.server.take().unwrap();
    let addr = server.grpc_addr;
    tokio::time::timeout(Duration::from_secs(10), server.shutdown()).await.unwrap().unwrap();
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "listener closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zstd_frame_ending_on_a_buffer_boundary_and_empty_finish_message() {
    let h = harness().await;
    let data = vec![0u8; 1 << 20];
    let d = DigestFunction::Sha256.digest_of(&data);
    let compressed = zstd::bulk::compress(&data, 3).unwrap();
    let name = format!("uploads/{}/compressed-blobs/zstd/{}/{}", uuid::Uuid::new_v4(), d.hash_hex(), d.size);
    let mut reqs = write_reqs(&name, &compressed, 0, 1 << 20, false);
    reqs.push(WriteRequest {
        resource_name: String::new(),
        write_offset: compressed.len() as i64,
        finish_write: true,
        data: vec![],
    });
    let resp = h.bs().write(futures::stream::iter(reqs)).await.unwrap().into_inner();
    assert_eq!(resp.committed_size, compressed.len() as i64);
    assert!(h.cas.get(&d).await.unwrap() == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_sizes_are_refused_without_harm() {
    let h = harness().await;
    // A zstd bomb through ByteStream: 64 MiB of zeros claimed as a 1000-byte blob.
    let bomb = zstd::bulk::compress(&vec![0u8; 64 << 20], 3).unwrap();
    let fake = reapi::Digest { hash: DigestFunction::Sha256.digest_of(b"x").hash_hex(), size_bytes: 1000 };
    let name = format!("uploads/{}/compressed-blobs/zstd/{}/1000", uuid::Uuid::new_v4(), fake.hash);
    let err = h.bs().write(futures::stream::iter(write_reqs(&name, &bomb, 0, 1 << 20, true))).await.unwrap_err();
    assert!(err.code() == Code::InvalidArgument && err.message().contains("decompresses to more"), "{err}");
    // A compressed batch entry claiming an enormous size is refused before allocating.
    let resp = h
        .cas_client()
        .batch_update_blobs(reapi::BatchUpdateBlobsRequest {
            requests: vec![reapi::batch_update_blobs_request::Request {
                digest: Some(reapi::Digest { hash: fake.hash.clone(), size_bytes: 1 << 50 }),
                data: bomb[..100].to_vec(),
                compressor: compressor::Value::Zstd as i32,
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let st = resp.responses[0].status.clone().unwrap();
    assert_eq!(st.code, Code::InvalidArgument as i32, "{}", st.message);
    // BatchReadBlobs sizes that would wrap a u64 sum are refused, not wrapped.
    let err = h
        .cas_client()
        .batch_read_blobs(reapi::BatchReadBlobsRequest {
            digests: vec![
                reapi::Digest { hash: fake.hash.clone(), size_bytes: i64::MAX },
                reapi::Digest { hash: fake.hash.clone(), size_bytes: i64::MAX },
                reapi::Digest { hash: fake.hash.clone(), size_bytes: 10 },
            ],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    // the server still answers
    h.upload(b"still alive").await;
}

/// A store whose writes hang while `hang` is set, to drop a Write handler mid-write.
struct HangingStore {
    inner: Arc<dyn BlobStore>,
    hang: Arc<std::sync::atomic::AtomicBool>,
}

struct HangingWriter {
    inner: Box<dyn gantry_core::BlobWriter>,
    hang: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait::async_trait]
impl gantry_core::BlobWriter for HangingWriter {
    fn committed(&self) -> u64 {
        self.inner.committed()
    }
    async fn write(&mut self, chunk: bytes::Bytes) -> gantry_core::Result<()> {
        if self.hang.load(std::sync::atomic::Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.write(chunk).await
    }
    async fn commit(self: Box<Self>) -> gantry_core::Result<()> {
        self.inner.commit().await
    }
}

#[async_trait::async_trait]
impl BlobStore for HangingStore {
    async fn find_present(&self, d: &[Digest]) -> gantry_core::Result<Vec<bool>> {
        self.inner.find_present(d).await
    }
    async fn read(&self, d: &Digest, o: u64, l: Option<u64>) -> gantry_core::Result<gantry_core::BlobStream> {
        self.inner.read(d, o, l).await
    }
    async fn begin_write(&self, d: &Digest) -> gantry_core::Result<Box<dyn gantry_core::BlobWriter>> {
        Ok(Box::new(HangingWriter { inner: self.inner.begin_write(d).await?, hang: self.hang.clone() }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_cancelled_mid_chunk_restarts_cleanly() {
    let hang = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mem: Arc<dyn BlobStore> = Arc::new(gantry_store::MemoryStore::new(1 << 30));
    let cas: Arc<dyn BlobStore> =
        Arc::new(IntegrityStore::new(Arc::new(HangingStore { inner: mem, hang: hang.clone() })));
    let ac = Arc::new(SqlActionCache::new(gantry_store::MetadataDb::open("sqlite::memory:").await.unwrap()));
    let services = Services::new(cas.clone(), ac, Limits::default());
    let server =
        RunningServer::start(&services, "127.0.0.1:0".parse().unwrap(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let channel = Channel::from_shared(format!("http://{}", server.grpc_addr)).unwrap().connect().await.unwrap();
    let mut bs = ByteStreamClient::new(channel);

    let data = pattern(300_000, 9);
    let d = DigestFunction::Sha256.digest_of(&data);
    let name = format!("uploads/{}/blobs/{}/{}", uuid::Uuid::new_v4(), d.hash_hex(), d.size);
    // First 100 KB lands; the stream ends without finish_write.
    let _ = bs.write(futures::stream::iter(write_reqs(&name, &data[..100_000], 0, 50_000, false))).await.unwrap_err();
    // The next chunk hangs in the store until the client's deadline drops the handler.
    hang.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut req =
        tonic::Request::new(futures::stream::iter(write_reqs(&name, &data[..200_000], 100_000, 100_000, false)));
    req.set_timeout(Duration::from_millis(300));
    let err = bs.write(req).await.unwrap_err();
    assert!(matches!(err.code(), Code::DeadlineExceeded | Code::Cancelled), "{err}");
    hang.store(false, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The interrupted chunk left the writer in an unknown state: the client is told 0.
    let st = bs.query_write_status(QueryWriteStatusRequest { resource_name: name.clone() }).await.unwrap().into_inner();
    assert_eq!((st.committed_size, st.complete), (0, false));
    // Starting over at 0 works, and the stored blob is exactly the data.
    let resp = bs.write(futures::stream::iter(write_reqs(&name, &data, 0, 64_000, true))).await.unwrap().into_inner();
    assert_eq!(resp.committed_size, data.len() as i64);
    assert!(cas.get(&d).await.unwrap() == data);
}

/// One client cannot take every upload session: past `max_uploads_per_client` abandoned
/// uploads its next one is RESOURCE_EXHAUSTED, while another identity still uploads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_uploads_are_limited_per_client() {
    use gantry_services::auth::{token_sha256, Authenticator};
    let dir = store_dir();
    let cas: Arc<dyn BlobStore> =
        Arc::new(IntegrityStore::new(Arc::new(FsStore::open(dir.join("cas"), 1 << 30).await.unwrap())));
    let ac = Arc::new(SqlActionCache::new(gantry_store::MetadataDb::open("sqlite::memory:").await.unwrap()));
    let text = format!(
        "[auth]\n[[auth.tokens]]\nname = \"greedy\"\nsha256 = \"{}\"\ngrants = [\"w\"]\n[[auth.tokens]]\nname = \"polite\"\nsha256 = \"{}\"\ngrants = [\"w\"]\n\
         [auth.grants.w]\ninstances = [\"*\"]\npermissions = [\"read\", \"write_cas\"]\n",
        token_sha256("greedy-token"),
        token_sha256("polite-token")
    );
    let auth = gantry_config::Config::parse(&text, "t.toml".as_ref()).unwrap().auth.unwrap();
    let limits = Limits { max_uploads_per_client: 3, ..Limits::default() };
    let services = Services::new(cas, ac, limits).with_auth(Authenticator::new(&auth));
    let server =
        RunningServer::start(&services, "127.0.0.1:0".parse().unwrap(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let channel = Channel::from_shared(format!("http://{}", server.grpc_addr)).unwrap().connect().await.unwrap();
    let start_upload = |token: &'static str, seed: u32| {
        let channel = channel.clone();
        async move {
            let data = pattern(10_000, seed);
            let d = DigestFunction::Sha256.digest_of(&data);
            let name = format!("uploads/{}/blobs/{}/{}", uuid::Uuid::new_v4(), d.hash_hex(), d.size);
            let mut req = tonic::Request::new(futures::stream::iter(write_reqs(&name, &data[..5000], 0, 1000, false)));
            req.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
            ByteStreamClient::new(channel).write(req).await
        }
    };
    // Three uploads abandoned half way: each keeps its session for a resume.
    for seed in 0..3 {
        let _ = start_upload("greedy-token", seed).await;
    }
    let e = start_upload("greedy-token", 10).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("max_uploads_per_client"), "{}", e.message());
    // Another identity is not starved by the first.
    let r = start_upload("polite-token", 20).await;
    assert!(!matches!(&r, Err(e) if e.code() == Code::ResourceExhausted), "{r:?}");
    drop(server);
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {series} in metrics"))
}

/// Abandoned uploads cannot pin memory: past a client's quarter of `max_upload_memory`
/// its idle uploads are spilled to temp files, and each still resumes and completes with
/// exactly its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_uploads_spill_past_the_memory_ceiling_and_still_resume() {
    let dir = store_dir();
    let cas: Arc<dyn BlobStore> =
        Arc::new(IntegrityStore::new(Arc::new(FsStore::open(dir.join("cas"), 1 << 30).await.unwrap())));
    let ac = Arc::new(SqlActionCache::new(gantry_store::MetadataDb::open("sqlite::memory:").await.unwrap()));
    let limits = Limits { max_upload_memory: 4 << 20, ..Limits::default() };
    let services = Services::new(cas.clone(), ac, limits);
    let server =
        RunningServer::start(&services, "127.0.0.1:0".parse().unwrap(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let channel = Channel::from_shared(format!("http://{}", server.grpc_addr)).unwrap().connect().await.unwrap();
    let mut bs = ByteStreamClient::new(channel);
    // 40 uploads of 1 MiB blobs, each abandoned after 512 KiB (under the store's spill
    // threshold, so without the ceiling all 20 MiB would stay in memory).
    let mut uploads = Vec::new();
    for seed in 0..40u32 {
        let data = pattern(1 << 20, seed);
        let d = DigestFunction::Sha256.digest_of(&data);
        let name = format!("uploads/{}/blobs/{}/{}", uuid::Uuid::new_v4(), d.hash_hex(), d.size);
        let r = bs.write(futures::stream::iter(write_reqs(&name, &data[..512 << 10], 0, 64 << 10, false))).await;
        assert!(r.is_err(), "an unfinished write is not acknowledged");
        let m = services.metrics.render();
        assert!(
            metric(&m, "gantry_upload_buffered_bytes ") <= (1 << 20) as f64,
            "one anonymous client holds at most a quarter of 4 MiB after upload {seed}:\n{}",
            m.lines().filter(|l| l.contains("upload")).collect::<Vec<_>>().join("\n")
        );
        uploads.push((name, data, d));
    }
    let m = services.metrics.render();
    assert!(metric(&m, "gantry_upload_memory_relief_total{outcome=\"spilled\"} ") >= 30.0, "{m}");
    // Every upload resumes where it stopped and stores exactly its bytes.
    for (name, data, d) in &uploads {
        let st =
            bs.query_write_status(QueryWriteStatusRequest { resource_name: name.clone() }).await.unwrap().into_inner();
        assert_eq!(st.committed_size, 512 << 10);
        let resp = bs
            .write(futures::stream::iter(write_reqs(name, data, 512 << 10, 64 << 10, true)))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(resp.committed_size, data.len() as i64);
        assert!(cas.get(d).await.unwrap() == *data);
    }
    assert_eq!(metric(&services.metrics.render(), "gantry_upload_buffered_bytes "), 0.0);
    drop(server);
}

/// A batch of many absent digests is answered entry by entry, within the response
/// limit, instead of failing as a whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_read_of_fifty_thousand_absent_digests_answers_each() {
    let h = harness().await;
    let digests: Vec<reapi::Digest> =
        (0..50_000u32).map(|i| DigestFunction::Sha256.digest_of(format!("absent {i}").as_bytes()).to_proto()).collect();
    let resp = h
        .cas_client()
        .batch_read_blobs(reapi::BatchReadBlobsRequest { digests: digests.clone(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.responses.len(), 50_000);
    assert!(resp.responses.iter().all(|r| r.status.as_ref().unwrap().code == Code::NotFound as i32));
    assert_eq!(resp.responses[17].digest.as_ref(), Some(&digests[17]));
}

/// Sends raw bytes as the request message, whatever the method expects.
#[derive(Clone, Default)]
struct RawCodec;
struct RawEncoder;
struct RawDecoder;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        let v = bytes::Buf::chunk(src).to_vec();
        bytes::Buf::advance(src, v.len());
        Ok(Some(v))
    }
}

async fn raw_call(ch: Channel, path: &'static str, body: Vec<u8>) -> Result<Vec<u8>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await.unwrap();
    grpc.unary(tonic::Request::new(body), http::uri::PathAndQuery::from_static(path), RawCodec)
        .await
        .map(|r| r.into_inner())
}

/// A body that is not the method's message is the client's INVALID_ARGUMENT (tonic
/// says INTERNAL), and one over the size limit is RESOURCE_EXHAUSTED saying what to do
/// (tonic says OUT_OF_RANGE).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_requests_get_the_clients_codes() {
    let h = harness().await;
    for path in [
        "/build.bazel.remote.execution.v2.ContentAddressableStorage/FindMissingBlobs",
        "/build.bazel.remote.execution.v2.ActionCache/UpdateActionResult",
    ] {
        let e = raw_call(h.channel.clone(), path, vec![0xff; 16]).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{path}: {e:?}");
        assert!(e.message().contains("not a valid message"), "{e:?}");
    }
    let e = raw_call(
        h.channel.clone(),
        "/build.bazel.remote.execution.v2.ContentAddressableStorage/BatchUpdateBlobs",
        vec![0u8; 6 << 20],
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("max_batch_total_size_bytes"), "{e:?}");
    // A well-formed call still works on the same connection.
    h.upload(b"still fine").await;
}

/// Reads go out on the zero-copy route (`bytestream_read`): a large blob arrives as
/// messages of at most the read chunk size, the empty blob as no data with OK, and a
/// Read whose request is not a ReadRequest is the client's INVALID_ARGUMENT, with the
/// connection still usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_come_in_chunk_sized_messages_and_bad_read_requests_are_refused() {
    let h = harness().await;
    let data = pattern((9 << 20) + 17, 8);
    let d = DigestFunction::Sha256.digest_of(&data);
    let name = format!("uploads/{}/blobs/{}/{}", uuid::Uuid::new_v4(), d.hash_hex(), d.size);
    h.bs().write(futures::stream::iter(write_reqs(&name, &data, 0, 1 << 20, true))).await.unwrap();
    let read_name = format!("blobs/{}/{}", d.hash_hex(), d.size);
    let mut stream = h
        .bs()
        .read(ReadRequest { resource_name: read_name.clone(), read_offset: 0, read_limit: 0 })
        .await
        .unwrap()
        .into_inner();
    let (mut got, mut sizes) = (Vec::new(), Vec::new());
    while let Some(m) = stream.message().await.unwrap() {
        sizes.push(m.data.len());
        got.extend_from_slice(&m.data);
    }
    assert!(got == data, "the bytes read back differ");
    assert_eq!(sizes.len(), 10, "{sizes:?}");
    assert!(sizes.iter().all(|&s| s == 1 << 20 || s == 17), "{sizes:?}");
    // Across a boundary of the store's 4 MiB reads and of the 1 MiB messages.
    let (off, len) = ((4 << 20) - 3, (1 << 20) + 9);
    assert!(h.read_all(read_name.clone(), off as i64, len as i64).await.unwrap() == data[off..off + len]);

    let empty = DigestFunction::Sha256.empty();
    assert!(h.read_all(format!("blobs/{}/0", empty.hash_hex()), 0, 0).await.unwrap().is_empty());

    let path = "/google.bytestream.ByteStream/Read";
    let e = raw_call(h.channel.clone(), path, vec![0xff; 16]).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().starts_with("ReadRequest:"), "{e:?}");
    let e = raw_call(h.channel.clone(), path, vec![b'x'; 100 << 10]).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    let e = raw_call(
        h.channel.clone(),
        path,
        ReadRequest { resource_name: "nonsense".into(), ..Default::default() }.encode_to_vec(),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(h.read_all(read_name, 9 << 20, 0).await.unwrap() == data[9 << 20..]);
}
