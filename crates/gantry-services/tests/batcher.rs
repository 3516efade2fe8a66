//! The Batcher over a real tonic client on loopback: a large stream is cut into builds
//! that cover every target exactly once, and malformed streams are refused precisely.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use gantry_proto::batch::v1 as pb;
use gantry_proto::batch::v1::batcher_client::BatcherClient;
use gantry_services::{Limits, RunningServer, Services};
use gantry_store::{IntegrityStore, MemoryStore, SqlActionCache};
use tonic::Code;

async fn server() -> (RunningServer, BatcherClient<tonic::transport::Channel>) {
    let cas = Arc::new(IntegrityStore::new(Arc::new(MemoryStore::new(1 << 20))));
    let ac = Arc::new(SqlActionCache::new(gantry_store::MetadataDb::open("sqlite::memory:").await.unwrap()));
    let services = Services::new(cas, ac, Limits::default());
    let s =
        RunningServer::start(&services, "127.0.0.1:0".parse().unwrap(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let c = BatcherClient::connect(format!("http://{}", s.grpc_addr)).await.unwrap();
    (s, c)
}

fn context() -> pb::BuildContext {
    pb::BuildContext {
        execution: Some(pb::ExecutionContext { source: Some(pb::execution_context::Source::Workspace("/ws".into())) }),
        command: pb::BazelCommand::Test as i32,
        flags: vec!["--keep_going".into()],
        priority: pb::Priority::Low as i32,
        user: "alice".into(),
        product_area: "infra".into(),
        tool_tag: "postsubmit".into(),
    }
}

fn target(i: usize) -> pb::Target {
    pb::Target {
        label: format!("//dir{}/pkg{}:t{i}", i % 37, i / 50),
        rule_kind: if i.is_multiple_of(10) { "sh_test".into() } else { String::new() },
        tags: if i.is_multiple_of(97) { vec!["requires-gpu".into()] } else { vec![] },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_thousand_targets_each_land_in_exactly_one_build() {
    let (_s, mut client) = server().await;
    const N: usize = 100_000;
    let requests: Vec<pb::EnqueueTargetsRequest> = (0..N)
        .collect::<Vec<_>>()
        .chunks(5000)
        .enumerate()
        .map(|(i, chunk)| pb::EnqueueTargetsRequest {
            context: (i == 0).then(context),
            targets: chunk.iter().map(|&j| target(j)).collect(),
        })
        .collect();
    let mut responses = client.enqueue_targets(futures::stream::iter(requests)).await.unwrap().into_inner();
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut build_ids = HashSet::new();
    let mut stream_ids = HashSet::new();
    let mut builds = 0;
    while let Some(r) = responses.message().await.unwrap() {
        stream_ids.insert(r.stream_id.clone());
        let b = r.build.unwrap();
        assert!(build_ids.insert(b.build_id.clone()), "duplicate build id {}", b.build_id);
        assert!(!b.targets.is_empty() && b.targets.len() <= 300, "no models: fallback size 300");
        assert_eq!(b.reason, pb::BatchSizeReason::MemoryEstimateError as i32);
        assert!(b.memory_estimate_bytes.is_none());
        let gpu = b.executor_types.contains(&"gpu".to_string());
        for t in b.targets {
            let i: usize = t.rsplit(":t").next().unwrap().parse().unwrap();
            assert_eq!(i.is_multiple_of(97), gpu, "{t} is in a build with executor types {:?}", b.executor_types);
            *seen.entry(t).or_default() += 1;
        }
        builds += 1;
    }
    assert_eq!(stream_ids.len(), 1);
    assert_eq!(seen.len(), N, "every target is in some build");
    assert!(seen.values().all(|&n| n == 1), "no target is in two builds");
    assert!(builds >= N / 300, "{builds} builds");
}

async fn expect_invalid(
    client: &mut BatcherClient<tonic::transport::Channel>,
    reqs: Vec<pb::EnqueueTargetsRequest>,
    want: &str,
) {
    let res = client.enqueue_targets(futures::stream::iter(reqs)).await;
    let status = match res {
        Err(s) => s,
        Ok(resp) => {
            let mut s = resp.into_inner();
            loop {
                match s.message().await {
                    Err(st) => break st,
                    Ok(Some(_)) => continue,
                    Ok(None) => panic!("stream ended without the expected error '{want}'"),
                }
            }
        }
    };
    assert_eq!(status.code(), Code::InvalidArgument, "{status}");
    assert!(status.message().contains(want), "got '{}', want '{want}'", status.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_streams_are_invalid_argument() {
    let (_s, mut client) = server().await;
    let with_ctx = |targets: Vec<pb::Target>| pb::EnqueueTargetsRequest { context: Some(context()), targets };
    // no context first
    expect_invalid(
        &mut client,
        vec![pb::EnqueueTargetsRequest { context: None, targets: vec![target(1)] }],
        "first request must carry",
    )
    .await;
    // context again later
    expect_invalid(
        &mut client,
        vec![with_ctx(vec![target(1)]), with_ctx(vec![target(2)])],
        "only be sent in the first request",
    )
    .await;
    // malformed label, named with its position
    let bad = pb::Target { label: "//a/b:c:d".into(), ..Default::default() };
    expect_invalid(
        &mut client,
        vec![with_ctx(vec![target(1)]), pb::EnqueueTargetsRequest { context: None, targets: vec![target(2), bad] }],
        "targets[1]",
    )
    .await;
    let bad = pb::Target { label: "no-slashes".into(), ..Default::default() };
    expect_invalid(&mut client, vec![with_ctx(vec![bad])], "no-slashes").await;
    // context fields
    let mut c = context();
    c.priority = 0;
    expect_invalid(
        &mut client,
        vec![pb::EnqueueTargetsRequest { context: Some(c), targets: vec![] }],
        "context.priority",
    )
    .await;
    let mut c = context();
    c.execution = None;
    expect_invalid(
        &mut client,
        vec![pb::EnqueueTargetsRequest { context: Some(c), targets: vec![] }],
        "context.execution",
    )
    .await;
    let mut c = context();
    c.command = 7;
    expect_invalid(
        &mut client,
        vec![pb::EnqueueTargetsRequest { context: Some(c), targets: vec![] }],
        "context.command",
    )
    .await;
}
