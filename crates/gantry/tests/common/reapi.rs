//! A small REAPI client for tests: uploads blobs and input trees, runs Execute and reads
//! results, over a real tonic channel.

use std::collections::BTreeMap;

use gantry_core::google::longrunning::operations_client::OperationsClient;
use gantry_core::reapi::content_addressable_storage_client::ContentAddressableStorageClient;
use gantry_core::reapi::execution_client::ExecutionClient;
use gantry_core::reapi::{self, batch_update_blobs_request, ExecuteResponse};
use gantry_core::{Digest, DigestFunction};
use prost::Message;
use tonic::transport::Channel;

pub struct Client {
    pub channel: Channel,
}

/// A file in an input tree: contents and executable bit.
pub enum Node {
    File(Vec<u8>, bool),
    Dir(BTreeMap<String, Node>),
}

impl Client {
    pub async fn connect(addr: &str) -> Client {
        let channel = Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
        Client { channel }
    }

    pub async fn put(&self, data: &[u8]) -> Digest {
        let d = DigestFunction::Sha256.digest_of(data);
        let r = ContentAddressableStorageClient::new(self.channel.clone())
            .batch_update_blobs(reapi::BatchUpdateBlobsRequest {
                requests: vec![batch_update_blobs_request::Request {
                    digest: Some(d.to_proto()),
                    data: data.to_vec(),
                    compressor: 0,
                }],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.responses[0].status.as_ref().unwrap().code, 0);
        d
    }

    pub async fn get(&self, d: &reapi::Digest) -> Vec<u8> {
        let r = ContentAddressableStorageClient::new(self.channel.clone())
            .batch_read_blobs(reapi::BatchReadBlobsRequest { digests: vec![d.clone()], ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.responses[0].status.as_ref().unwrap().code, 0, "blob {d:?}");
        r.responses[0].data.clone()
    }

    pub fn tree<'a>(&'a self, nodes: &'a BTreeMap<String, Node>) -> futures::future::BoxFuture<'a, Digest> {
        Box::pin(async move {
            let mut dir = reapi::Directory::default();
            for (name, node) in nodes {
                match node {
                    Node::File(data, exec) => {
                        let d = self.put(data).await;
                        dir.files.push(reapi::FileNode {
                            name: name.clone(),
                            digest: Some(d.to_proto()),
                            is_executable: *exec,
                            ..Default::default()
                        });
                    }
                    Node::Dir(sub) => {
                        let d = self.tree(sub).await;
                        dir.directories.push(reapi::DirectoryNode { name: name.clone(), digest: Some(d.to_proto()) });
                    }
                }
            }
            self.put(&dir.encode_to_vec()).await
        })
    }

    /// Uploads the command and action; returns the action digest.
    pub async fn action(
        &self,
        command: reapi::Command,
        input_root: Digest,
        timeout_s: i64,
        do_not_cache: bool,
    ) -> Digest {
        let cd = self.put(&command.encode_to_vec()).await;
        let action = reapi::Action {
            command_digest: Some(cd.to_proto()),
            input_root_digest: Some(input_root.to_proto()),
            timeout: (timeout_s > 0)
                .then_some(gantry_core::google::protobuf::Duration { seconds: timeout_s, nanos: 0 }),
            do_not_cache,
            ..Default::default()
        };
        self.put(&action.encode_to_vec()).await
    }

    /// Runs Execute to completion; returns the operation name, the stages seen and the response.
    pub async fn execute(&self, action: Digest, skip_cache_lookup: bool) -> (String, Vec<i32>, ExecuteResponse) {
        let mut stream = ExecutionClient::new(self.channel.clone())
            .execute(reapi::ExecuteRequest {
                action_digest: Some(action.to_proto()),
                skip_cache_lookup,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut stages = Vec::new();
        let mut name = String::new();
        while let Some(op) = stream.message().await.unwrap() {
            name = op.name.clone();
            let md = reapi::ExecuteOperationMetadata::decode(op.metadata.unwrap().value.as_slice()).unwrap();
            stages.push(md.stage);
            if op.done {
                gantry_core::client::finish_stream(&mut stream, std::time::Duration::from_secs(5)).await;
                let Some(gantry_core::google::longrunning::operation::Result::Response(any)) = op.result else {
                    panic!("done operation without a response")
                };
                return (name, stages, ExecuteResponse::decode(any.value.as_slice()).unwrap());
            }
        }
        panic!("Execute stream of {name} ended before the operation was done");
    }

    pub fn operations(&self) -> OperationsClient<Channel> {
        OperationsClient::new(self.channel.clone())
    }
}

pub fn command(args: &[&str], outputs: &[&str], output_dirs: &[&str]) -> reapi::Command {
    #[allow(deprecated)]
    reapi::Command {
        arguments: args.iter().map(|s| s.to_string()).collect(),
        environment_variables: vec![reapi::command::EnvironmentVariable {
            name: "PATH".into(),
            value: "/bin:/usr/bin".into(),
        }],
        output_files: outputs.iter().map(|s| s.to_string()).collect(),
        output_directories: output_dirs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}
