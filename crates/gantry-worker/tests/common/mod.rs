//! Helpers shared by the worker's integration tests.
#![allow(dead_code)] // each test binary uses its own share of them

use std::sync::Arc;
use std::time::Duration;

use gantry_core::reapi;
use gantry_core::{BlobStore, Digest, DigestFunction, Finished, Work};
use gantry_worker::cgroup::{self, Cgroups};
use gantry_worker::Executor;
use prost::Message;

pub const F: DigestFunction = DigestFunction::Sha256;

/// This machine's cgroups for actions; without them the test is skipped with the reason,
/// and under CI=true it fails.
pub fn cgroups() -> Option<Arc<Cgroups>> {
    static RELEASE_AT_EXIT: std::sync::Once = std::sync::Once::new();
    match cgroup::detect() {
        Ok(c) => {
            // The groups this binary's runs kept for reuse go when it exits, as a stopping
            // worker's do. The next worker to start removes a dead one's groups only under
            // its own parent group, and in some sandboxes every shell has a parent of its
            // own, so they would stay.
            RELEASE_AT_EXIT.call_once(|| gantry_testkit::at_exit(cgroup::release_idle));
            Some(c)
        }
        Err(why) => gantry_testkit::unavailable("cgroups for actions", &why),
    }
}

/// Runs `script` under `/bin/sh -c` in `input_root` (in the executor's CAS), declaring
/// `outputs`, and returns the worker's report.
pub async fn execute(ex: &Executor, script: &str, outputs: &[&str], input_root: Digest) -> Finished {
    let command = reapi::Command {
        arguments: vec!["/bin/sh".into(), "-c".into(), script.into()],
        environment_variables: vec![reapi::command::EnvironmentVariable {
            name: "PATH".into(),
            value: "/usr/bin:/bin".into(),
        }],
        output_paths: outputs.iter().map(|o| o.to_string()).collect(),
        ..Default::default()
    };
    let action = reapi::Action {
        command_digest: Some(F.digest_of(&command.encode_to_vec()).to_proto()),
        input_root_digest: Some(input_root.to_proto()),
        ..Default::default()
    };
    let work = Work {
        job_id: format!("operations/{}", uuid::Uuid::new_v4()),
        function: F,
        action: action.into(),
        command: command.into(),
        timeout: Duration::from_secs(60),
    };
    // Bounded: an output the worker waited on forever (a FIFO) must fail the test.
    tokio::time::timeout(Duration::from_secs(60), ex.execute(work, std::future::pending()))
        .await
        .expect("the action's report came within a minute")
}

/// Stores `dir` in `cas` and returns its digest.
pub async fn put_dir(cas: &Arc<dyn BlobStore>, dir: reapi::Directory) -> Digest {
    let bytes = dir.encode_to_vec();
    let d = F.digest_of(&bytes);
    cas.put(&d, bytes.into()).await.unwrap();
    d
}

/// A directory holding only `name`, a directory.
pub fn dir_of(name: &str, child: Digest) -> reapi::Directory {
    reapi::Directory {
        directories: vec![reapi::DirectoryNode { name: name.into(), digest: Some(child.to_proto()) }],
        ..Default::default()
    }
}

/// A directory holding only `name`, a file.
pub fn file_of(name: &str, file: Digest, is_executable: bool) -> reapi::Directory {
    reapi::Directory {
        files: vec![reapi::FileNode {
            name: name.into(),
            digest: Some(file.to_proto()),
            is_executable,
            ..Default::default()
        }],
        ..Default::default()
    }
}
