//! gantry-proto owns gantry's own gRPC APIs, defined in `proto/` and generated at build
//! time, and gantry's own copies of the other protos it serves without a crate for them:
//! the Build Event Service and Bazel's build events, with only the fields gantry reads
//! (field numbers are the wire contract). REAPI types come from `bazel-remote-apis`
//! instead (re-exported by gantry-core).

pub mod batch {
    pub mod v1 {
        tonic::include_proto!("gantry.batch.v1");
    }
}

pub mod queue {
    pub mod v1 {
        tonic::include_proto!("gantry.queue.v1");
    }
}

pub mod worker {
    pub mod v1 {
        tonic::include_proto!("gantry.worker.v1");
    }
}

/// `google.rpc.PreconditionFailure`, for MISSING blob reports.
pub mod rpc {
    tonic::include_proto!("google.rpc");
}

/// The Build Event Service (`google.devtools.build.v1`), which Bazel streams build events to.
pub mod devtools_build {
    pub mod v1 {
        tonic::include_proto!("google.devtools.build.v1");
    }
}

/// Bazel's Build Event Protocol, carried in `devtools_build::v1` `bazel_event` Anys.
pub mod build_event_stream {
    tonic::include_proto!("build_event_stream");
}

#[cfg(test)]
mod tests {
    use super::build_event_stream as bep;
    use super::devtools_build::v1 as bes;
    use prost::Message;

    #[test]
    fn bazel_event_round_trips_through_bes_any() {
        let target = bep::build_event_id::TargetCompletedId {
            label: "//foo:bar".into(),
            configuration: Some(bep::build_event_id::ConfigurationId { id: "k8-fastbuild".into() }),
            aspect: String::new(),
        };
        let inner = bep::BuildEvent {
            id: Some(bep::BuildEventId { id: Some(bep::build_event_id::Id::Started(Default::default())) }),
            children: vec![bep::BuildEventId { id: Some(bep::build_event_id::Id::TargetCompleted(target.clone())) }],
            payload: Some(bep::build_event::Payload::Started(bep::BuildStarted {
                uuid: "inv-1".into(),
                command: "build".into(),
                build_tool_version: "4.2.3".into(),
                server_pid: 42,
                ..Default::default()
            })),
            ..Default::default()
        };
        let outer = bes::BuildEvent {
            event_time: None,
            event: Some(bes::build_event::Event::BazelEvent(prost_types::Any {
                type_url: "type.googleapis.com/build_event_stream.BuildEvent".into(),
                value: inner.encode_to_vec(),
            })),
        };

        let decoded = bes::BuildEvent::decode(outer.encode_to_vec().as_slice()).unwrap();
        let Some(bes::build_event::Event::BazelEvent(any)) = decoded.event else {
            panic!("expected bazel_event, got {:?}", decoded.event);
        };
        assert_eq!(any.type_url, "type.googleapis.com/build_event_stream.BuildEvent");
        let got = bep::BuildEvent::decode(any.value.as_slice()).unwrap();
        assert_eq!(got, inner);
        let Some(bep::build_event::Payload::Started(started)) = got.payload else {
            panic!("expected started payload");
        };
        assert_eq!((started.uuid.as_str(), started.server_pid), ("inv-1", 42));
        assert_eq!(got.children[0].id, Some(bep::build_event_id::Id::TargetCompleted(target)));
    }
}
