//! An action's output files are kept in the worker's input cache by link (materialize.rs,
//! `InputCache::adopt`): a later action that takes one as an input gets the very file the
//! first one wrote, not a fetched copy, but only when every process of the action is known
//! to have ended (cgroups), so that nothing can write to the file after it was hashed.
//!
//! Needs cgroups (v2 delegated, or v1 as root): without them it is skipped with the
//! reason, and under CI=true it fails.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gantry_core::reapi;
use gantry_core::{BlobStore, Digest, Finished};
use gantry_worker::cgroup::Cgroups;
use gantry_worker::Executor;

mod common;
use common::{cgroups, put_dir, F};

async fn executor(d: &Path, cas: Arc<dyn BlobStore>, cgroups: Option<Arc<Cgroups>>) -> Executor {
    Executor {
        worker_id: "w".into(),
        cas,
        cache: Arc::new(gantry_worker::materialize::InputCache::open(d, 1 << 30).await.unwrap()),
        work_root: d.join("actions"),
        dirs: Default::default(),
        spawner: None,
        limits: Default::default(),
        cgroups,
    }
}

/// A temporary directory, a CAS with an empty directory in it (its digest), and an
/// executor working in the first with `cgroups`.
async fn setup(cgroups: Option<Arc<Cgroups>>) -> (tempfile::TempDir, Arc<dyn BlobStore>, Executor, Digest) {
    let d = tempfile::tempdir().unwrap();
    let cas: Arc<dyn BlobStore> = Arc::new(gantry_store::MemoryStore::new(1 << 30));
    let ex = executor(d.path(), cas.clone(), cgroups).await;
    let empty = put_dir(&cas, reapi::Directory::default()).await;
    (d, cas, ex, empty)
}

/// Runs `script` in `input_root`, declaring `outputs`; it must succeed.
async fn run(ex: &Executor, script: &str, input_root: Digest, outputs: &[&str]) -> Finished {
    let f = common::execute(ex, script, outputs, input_root).await;
    assert_eq!(f.status_code, 0, "{}", f.status_message);
    f
}

async fn stdout(cas: &Arc<dyn BlobStore>, f: &Finished) -> String {
    let result = f.action_result.as_ref().unwrap();
    let d = Digest::from_proto(F, result.stdout_digest.as_ref(), "stdout").unwrap();
    String::from_utf8(cas.get(&d).await.unwrap().to_vec()).unwrap()
}

/// Where the executable cache keeps `d`'s file.
fn cached(root: &Path, d: &Digest) -> std::path::PathBuf {
    let hex = d.hash_hex();
    root.join("cache-x").join("sha256").join(&hex[..2]).join(format!("{hex}-{}", d.size))
}

/// Writes an output (printing its inode), then returns its digest and that inode.
async fn first_action(ex: &Executor, cas: &Arc<dyn BlobStore>, empty: Digest) -> (Digest, String) {
    let f = run(ex, "seq 1 1000 > out.txt; stat -c %i out.txt", empty, &["out.txt"]).await;
    let out = &f.action_result.as_ref().unwrap().output_files[0];
    (Digest::from_proto(F, out.digest.as_ref(), "output").unwrap(), stdout(cas, &f).await)
}

#[tokio::test]
async fn an_output_becomes_the_next_actions_input_with_no_copy() {
    let Some(cgroups) = cgroups() else { return };
    let (d, cas, ex, empty) = setup(Some(cgroups)).await;

    let (out, inode) = first_action(&ex, &cas, empty).await;
    // Its journal record and name come in the background.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cached(d.path(), &out).exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(cached(d.path(), &out).exists(), "the output is in the executable cache");

    // A later action takes it as an executable input, as Bazel marks generated files.
    let root = put_dir(&cas, common::file_of("in.txt", out, true)).await;
    let f = run(&ex, "stat -c '%i %a' in.txt; tail -n 1 in.txt", root, &[]).await;
    assert_eq!(
        stdout(&cas, &f).await,
        format!("{} 555\n1000\n", inode.trim()),
        "the first action's own file, read-only"
    );
}

#[tokio::test]
async fn without_cgroups_an_output_is_not_kept() {
    // No cgroup: a process of the action that left its process group could still write
    // to the output after it was hashed.
    let (d, cas, ex, empty) = setup(None).await;
    let (out, _) = first_action(&ex, &cas, empty).await;
    // An adoption links its file before the report: none was begun.
    let temp: Vec<_> = std::fs::read_dir(d.path().join("cache-x/tmp")).unwrap().collect();
    assert!(temp.is_empty(), "{temp:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!cached(d.path(), &out).exists());
}

#[tokio::test]
async fn two_outputs_of_the_same_bytes_leave_one_file_and_no_links_behind() {
    let Some(cgroups) = cgroups() else { return };
    let (d, cas, ex, empty) = setup(Some(cgroups)).await;
    let f = run(&ex, "seq 1 50 > a.txt; seq 1 50 > b.txt; stat -c %i a.txt b.txt", empty, &["a.txt", "b.txt"]).await;
    let files = &f.action_result.as_ref().unwrap().output_files;
    assert_eq!(files.len(), 2);
    assert_eq!(files[0].digest, files[1].digest);
    let out = Digest::from_proto(F, files[0].digest.as_ref(), "output").unwrap();
    let inodes: Vec<String> = stdout(&cas, &f).await.lines().map(str::to_string).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let temp_links = || std::fs::read_dir(d.path().join("cache-x/tmp")).unwrap().count();
    while (!cached(d.path(), &out).exists() || temp_links() > 0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(temp_links(), 0, "the link that lost is taken back");
    use std::os::unix::fs::MetadataExt;
    let kept = std::fs::metadata(cached(d.path(), &out)).unwrap().ino().to_string();
    assert!(inodes.contains(&kept), "one of the two files is the cache's: {kept} in {inodes:?}");
}
