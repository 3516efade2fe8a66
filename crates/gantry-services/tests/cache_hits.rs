//! An invocation's remote cache hits, end to end on a real server: Bazel's
//! GetActionResult calls name the invocation in RequestMetadata, the ActionCache service
//! counts them, and when the invocation's build event stream ends the Build Event Service
//! stores the counts (and Bazel's critical path log) with it.

use std::sync::Arc;

use gantry_core::reapi::action_cache_client::ActionCacheClient;
use gantry_core::reapi::{self, ActionResult};
use gantry_core::request_metadata::METADATA_HEADER;
use gantry_core::{ActionCache, BlobStore, DigestFunction, InvocationStore};
use gantry_proto::build_event_stream as bep;
use gantry_proto::devtools_build::v1 as bes;
use gantry_services::{Limits, RunningServer, Services};
use gantry_store::{MemoryStore, MetadataDb, SqlActionCache, SqlInvocationStore};
use prost::Message;
use tonic::transport::Channel;

fn lookup(invocation: &str, digest: &gantry_core::Digest) -> tonic::Request<reapi::GetActionResultRequest> {
    let mut req = tonic::Request::new(reapi::GetActionResultRequest {
        action_digest: Some(digest.to_proto()),
        ..Default::default()
    });
    let md = reapi::RequestMetadata {
        tool_invocation_id: invocation.into(),
        action_mnemonic: "Genrule".into(),
        ..Default::default()
    };
    req.metadata_mut().insert_bin(METADATA_HEADER, tonic::metadata::MetadataValue::from_bytes(&md.encode_to_vec()));
    req
}

fn event(invocation: &str, seq: i64, event: bes::build_event::Event) -> bes::PublishBuildToolEventStreamRequest {
    bes::PublishBuildToolEventStreamRequest {
        ordered_build_event: Some(bes::OrderedBuildEvent {
            stream_id: Some(bes::StreamId { build_id: "b".into(), invocation_id: invocation.into(), component: 3 }),
            sequence_number: seq,
            event: Some(bes::BuildEvent { event_time: None, event: Some(event) }),
        }),
        ..Default::default()
    }
}

fn bazel(invocation: &str, seq: i64, payload: bep::build_event::Payload) -> bes::PublishBuildToolEventStreamRequest {
    let e = bep::BuildEvent { payload: Some(payload), ..Default::default() };
    let any = prost_types::Any {
        type_url: "type.googleapis.com/build_event_stream.BuildEvent".into(),
        value: e.encode_to_vec(),
    };
    event(invocation, seq, bes::build_event::Event::BazelEvent(any))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invocations_cache_hits_are_stored_with_it_from_every_frontend() {
    let db = MetadataDb::open("sqlite::memory:").await.unwrap();
    let cas: Arc<dyn BlobStore> = Arc::new(MemoryStore::new(1 << 30));
    let ac = Arc::new(SqlActionCache::new(db.clone()));
    let invocations = Arc::new(SqlInvocationStore::new(db.clone()));
    let services = Services::new(cas, ac.clone(), Limits::default()).with_build_events(invocations.clone());
    let server =
        RunningServer::start(&services, "127.0.0.1:0".parse().unwrap(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let channel = Channel::from_shared(format!("http://{}", server.grpc_addr)).unwrap().connect().await.unwrap();

    let cached = DigestFunction::Sha256.digest_of(b"cached action");
    let absent = DigestFunction::Sha256.digest_of(b"absent action");
    ac.put("", &cached, &ActionResult::default()).await.unwrap();
    let mut client = ActionCacheClient::new(channel.clone());
    client.get_action_result(lookup("inv-1", &cached)).await.expect("a hit");
    client.get_action_result(lookup("inv-1", &cached)).await.expect("a hit");
    let miss = client.get_action_result(lookup("inv-1", &absent)).await.unwrap_err();
    assert_eq!(miss.code(), tonic::Code::NotFound);
    // Another invocation's lookups, and one naming none, are not inv-1's.
    client.get_action_result(lookup("inv-2", &cached)).await.unwrap();
    client
        .get_action_result(reapi::GetActionResultRequest {
            action_digest: Some(cached.to_proto()),
            ..Default::default()
        })
        .await
        .unwrap();

    let critical = "Critical Path: 3.20s, Remote (81.00% of the time)\n  Action 'Linking x'";
    let stream = vec![
        bazel(
            "inv-1",
            1,
            bep::build_event::Payload::Started(bep::BuildStarted {
                command: "build".into(),
                start_time_millis: 1_700_000_000_000,
                ..Default::default()
            }),
        ),
        bazel(
            "inv-1",
            2,
            bep::build_event::Payload::BuildToolLogs(bep::BuildToolLogs {
                log: vec![
                    bep::File {
                        name: "elapsed time".into(),
                        file: Some(bep::file::File::Contents(b"3.5".to_vec())),
                        ..Default::default()
                    },
                    bep::File {
                        name: "critical path".into(),
                        file: Some(bep::file::File::Contents(critical.as_bytes().to_vec())),
                        ..Default::default()
                    },
                ],
            }),
        ),
        event(
            "inv-1",
            3,
            bes::build_event::Event::ComponentStreamFinished(bes::build_event::BuildComponentStreamFinished {
                r#type: 1,
            }),
        ),
    ];
    let mut bes_client = bes::publish_build_event_client::PublishBuildEventClient::new(channel);
    let mut acks =
        bes_client.publish_build_tool_event_stream(futures::stream::iter(stream)).await.unwrap().into_inner();
    let mut last = 0;
    while let Some(a) = acks.message().await.unwrap() {
        last = a.sequence_number;
    }
    assert_eq!(last, 3, "every event acknowledged, so the invocation is stored");

    let stored = invocations.get("inv-1").await.unwrap().expect("stored");
    assert_eq!((stored.cache_lookups, stored.cache_hits), (3, 2));
    assert_eq!(stored.critical_path, critical);
    let row = invocations.list(10, None).await.unwrap();
    assert_eq!((row[0].cache_lookups, row[0].cache_hits), (3, 2), "the list shows them too");
    assert_eq!(services.cache_hits.get("inv-2").lookups, 1);

    // A second frontend on the same metadata database serves more of inv-1's lookups
    // after its events were stored: its periodic flush adds them to the invocation.
    let second = Services::new(Arc::new(MemoryStore::new(1 << 30)), ac.clone(), Limits::default())
        .with_build_events(invocations.clone());
    let other =
        RunningServer::start(&second, "127.0.0.1:0".parse().unwrap(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let channel = Channel::from_shared(format!("http://{}", other.grpc_addr)).unwrap().connect().await.unwrap();
    let mut client = ActionCacheClient::new(channel);
    client.get_action_result(lookup("inv-1", &cached)).await.expect("a hit");
    client.get_action_result(lookup("inv-1", &absent)).await.unwrap_err();
    let start = std::time::Instant::now();
    loop {
        let stored = invocations.get("inv-1").await.unwrap().expect("stored");
        if (stored.cache_lookups, stored.cache_hits) == (5, 3) {
            break;
        }
        // The first frontend's 3, and the second's as far as its flushes have gone.
        assert!((3..=5).contains(&stored.cache_lookups), "{stored:?}");
        assert!(start.elapsed() < gantry_services::cache_hits::FLUSH_EVERY * 5, "never flushed: {stored:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    other.shutdown().await.unwrap();
    server.shutdown().await.unwrap();
}
