//! The Build Event Service against a real `gantry serve`, driven by a gRPC client the way
//! Bazel drives it: events out of order or undecodable end the stream with
//! INVALID_ARGUMENT and store nothing; a stream that breaks is resumed by a retry that
//! resends the events not acknowledged, and the invocation is stored once, whole.
//! (Real Bazel's streams are in bazel_remote.rs.)

mod common;

use common::GantryServer;
use gantry_proto::build_event_stream as bep;
use gantry_proto::devtools_build::v1 as bes;
use prost::Message;

fn stream_id(invocation: &str) -> bes::StreamId {
    bes::StreamId { build_id: "build-1".into(), invocation_id: invocation.into(), component: 3 }
}

fn request(invocation: &str, seq: i64, event: bes::build_event::Event) -> bes::PublishBuildToolEventStreamRequest {
    bes::PublishBuildToolEventStreamRequest {
        ordered_build_event: Some(bes::OrderedBuildEvent {
            stream_id: Some(stream_id(invocation)),
            sequence_number: seq,
            event: Some(bes::BuildEvent { event_time: None, event: Some(event) }),
        }),
        ..Default::default()
    }
}

fn bazel(invocation: &str, seq: i64, e: bep::BuildEvent) -> bes::PublishBuildToolEventStreamRequest {
    let any = prost_types::Any {
        type_url: "type.googleapis.com/build_event_stream.BuildEvent".into(),
        value: e.encode_to_vec(),
    };
    request(invocation, seq, bes::build_event::Event::BazelEvent(any))
}

fn started(invocation: &str, seq: i64) -> bes::PublishBuildToolEventStreamRequest {
    let e = bep::BuildEvent {
        payload: Some(bep::build_event::Payload::Started(bep::BuildStarted {
            uuid: invocation.into(),
            start_time_millis: 1_700_000_000_000,
            command: "build".into(),
            ..Default::default()
        })),
        ..Default::default()
    };
    bazel(invocation, seq, e)
}

fn completed(invocation: &str, seq: i64, label: &str, success: bool) -> bes::PublishBuildToolEventStreamRequest {
    let e = bep::BuildEvent {
        id: Some(bep::BuildEventId {
            id: Some(bep::build_event_id::Id::TargetCompleted(bep::build_event_id::TargetCompletedId {
                label: label.into(),
                ..Default::default()
            })),
        }),
        payload: Some(bep::build_event::Payload::Completed(bep::TargetComplete { success, ..Default::default() })),
        ..Default::default()
    };
    bazel(invocation, seq, e)
}

fn finished(invocation: &str, seq: i64) -> bes::PublishBuildToolEventStreamRequest {
    let e = bep::BuildEvent {
        payload: Some(bep::build_event::Payload::Finished(bep::BuildFinished {
            exit_code: Some(bep::build_finished::ExitCode { name: "SUCCESS".into(), code: 0 }),
            finish_time_millis: 1_700_000_001_000,
            ..Default::default()
        })),
        ..Default::default()
    };
    bazel(invocation, seq, e)
}

fn last(invocation: &str, seq: i64) -> bes::PublishBuildToolEventStreamRequest {
    request(
        invocation,
        seq,
        bes::build_event::Event::ComponentStreamFinished(bes::build_event::BuildComponentStreamFinished { r#type: 1 }),
    )
}

type Client = bes::publish_build_event_client::PublishBuildEventClient<gantry_core::client::GrpcChannel>;

/// Sends `requests` on one stream; returns the acknowledged sequence numbers and the
/// status the stream ended with, if not OK.
async fn send(
    c: &mut Client,
    requests: Vec<bes::PublishBuildToolEventStreamRequest>,
) -> (Vec<i64>, Option<tonic::Status>) {
    let resp = c.publish_build_tool_event_stream(futures::stream::iter(requests)).await;
    let mut acks = Vec::new();
    let mut stream = match resp {
        Ok(r) => r.into_inner(),
        Err(s) => return (acks, Some(s)),
    };
    loop {
        match stream.message().await {
            Ok(Some(a)) => acks.push(a.sequence_number),
            Ok(None) => return (acks, None),
            Err(s) => return (acks, Some(s)),
        }
    }
}

fn stored(data: &std::path::Path, invocation: &str) -> Option<serde_json::Value> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gantry"))
        .args(["invocation", invocation, "--json", "--data-dir"])
        .arg(data)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (!v["build"].is_null()).then(|| v["build"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_streams_store_nothing_and_a_broken_stream_resumes() {
    let data = tempfile::tempdir().unwrap();
    let server = GantryServer::start(data.path(), &[]);
    let mut c = Client::new(gantry_core::client::connect(&format!("grpc://{}", server.grpc)).await.unwrap());

    // Out of order: 1 is acknowledged, 3 ends the stream.
    let (acks, err) = send(&mut c, vec![started("bad", 1), completed("bad", 3, "//a:a", true), last("bad", 4)]).await;
    let err = err.expect("refused");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("sequence_number: 3 out of order, expected 2"), "{}", err.message());
    assert_eq!(acks, [1]);
    // Undecodable Bazel event.
    let mut junk = started("bad2", 1);
    if let Some(bes::build_event::Event::BazelEvent(any)) =
        junk.ordered_build_event.as_mut().unwrap().event.as_mut().unwrap().event.as_mut()
    {
        any.value = vec![0xff, 0xff, 0xff];
    }
    let (_, err) = send(&mut c, vec![junk, last("bad2", 2)]).await;
    assert_eq!(err.expect("refused").code(), tonic::Code::InvalidArgument);
    // A missing stream id.
    let mut anonymous = started("bad3", 1);
    anonymous.ordered_build_event.as_mut().unwrap().stream_id = None;
    let (_, err) = send(&mut c, vec![anonymous]).await;
    assert!(err.expect("refused").message().contains("stream_id: required"));
    for id in ["bad", "bad2", "bad3"] {
        assert!(stored(data.path(), id).is_none(), "nothing stored for {id}");
    }

    // A stream that breaks after two events, then a retry that resends from the second
    // (its acknowledgement was lost): stored once, with the first stream's events too.
    let (acks, err) = send(&mut c, vec![started("ok", 1), completed("ok", 2, "//a:a", true)]).await;
    assert_eq!((acks, err.map(|s| s.code())), (vec![1, 2], None));
    assert!(stored(data.path(), "ok").is_none(), "not stored before its last event");
    let retry =
        vec![completed("ok", 2, "//a:a", true), completed("ok", 3, "//a:b", false), finished("ok", 4), last("ok", 5)];
    let (acks, err) = send(&mut c, retry).await;
    assert_eq!((acks, err.map(|s| s.code())), (vec![2, 3, 4, 5], None));
    let b = stored(data.path(), "ok").expect("stored");
    assert_eq!((b["command"].as_str(), b["exit_name"].as_str()), (Some("build"), Some("SUCCESS")), "{b}");
    let targets: Vec<(String, bool)> = b["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["label"].as_str().unwrap().to_string(), t["success"].as_bool().unwrap()))
        .collect();
    assert_eq!(targets, [("//a:a".to_string(), true), ("//a:b".to_string(), false)], "each target once: {b}");
    server.stop();
}
