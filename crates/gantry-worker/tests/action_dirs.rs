//! Action directories are kept from one action to the next (executor.rs, `ActionDirs`):
//! an action starts in an empty input root with empty logs whatever the one before it
//! left there, and a directory that cannot be emptied is removed, not reused.

use std::path::Path;
use std::sync::Arc;

use gantry_core::reapi;
use gantry_core::{BlobStore, Digest};
use gantry_worker::Executor;
use prost::Message;

mod common;
use common::F;

async fn executor(d: &Path, cas: Arc<dyn BlobStore>) -> Executor {
    executor_with_cache(d, cas, 1 << 30).await
}

async fn executor_with_cache(d: &Path, cas: Arc<dyn BlobStore>, cache_bytes: u64) -> Executor {
    let empty = reapi::Directory::default().encode_to_vec();
    cas.put(&F.digest_of(&empty), empty.into()).await.unwrap();
    Executor {
        worker_id: "w".into(),
        cas,
        cache: Arc::new(gantry_worker::materialize::InputCache::open(d, cache_bytes).await.unwrap()),
        work_root: d.join("actions"),
        dirs: Default::default(),
        spawner: None,
        limits: Default::default(),
        cgroups: None,
    }
}

/// Runs `script` under `/bin/sh -c` in an empty input root; returns its exit code and
/// its stdout.
async fn run(ex: &Executor, cas: &Arc<dyn BlobStore>, script: &str) -> (i32, String) {
    run_in(ex, cas, script, F.digest_of(&reapi::Directory::default().encode_to_vec())).await
}

/// `run` with the input root `input_root` (in the executor's CAS).
async fn run_in(ex: &Executor, cas: &Arc<dyn BlobStore>, script: &str, input_root: Digest) -> (i32, String) {
    let finished = finish_in(ex, script, &[], input_root).await;
    assert_eq!(finished.status_code, 0, "{}", finished.status_message);
    let result = finished.action_result.unwrap();
    let stdout = Digest::from_proto(F, result.stdout_digest.as_ref(), "stdout").unwrap();
    let bytes = cas.get(&stdout).await.expect("stdout uploaded");
    (result.exit_code, String::from_utf8(bytes.to_vec()).unwrap())
}

/// Runs `script` as `run` does, declaring `outputs`, and returns the worker's report.
async fn finish(ex: &Executor, script: &str, outputs: &[&str]) -> gantry_core::Finished {
    finish_in(ex, script, outputs, F.digest_of(&reapi::Directory::default().encode_to_vec())).await
}

/// `finish` with the input root `input_root` (in the executor's CAS).
async fn finish_in(ex: &Executor, script: &str, outputs: &[&str], input_root: Digest) -> gantry_core::Finished {
    common::execute(ex, script, outputs, input_root).await
}

/// The names in `dir`, but for the worker's spare directories (spare_dirs.rs).
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "spare")
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn each_action_starts_empty_in_a_kept_directory() {
    let d = tempfile::tempdir().unwrap();
    let cas: Arc<dyn BlobStore> = Arc::new(gantry_store::MemoryStore::new(1 << 30));
    let ex = executor(d.path(), cas.clone()).await;

    // Leaves files, a nested directory it made read-only, and a long log.
    let (code, out) = run(
        &ex,
        &cas,
        "mkdir -p d/e && echo hi > d/e/f && touch top && chmod 0500 d/e d && seq 1 2000 && echo err >&2",
    )
    .await;
    assert_eq!(code, 0);
    assert!(out.ends_with("1999\n2000\n"), "{out}");
    assert_eq!(entries(&d.path().join("actions")), ["a0"], "one directory for one action at a time");
    // Emptied after the action but for its directories, kept in place, empty and writable
    // again for the next action that declares them.
    let root = d.path().join("actions/a0/root");
    assert_eq!(entries(&root), ["d"]);
    assert_eq!(entries(&root.join("d")), ["e"]);
    assert_eq!(entries(&root.join("d/e")), Vec::<String>::new());
    assert_eq!(std::fs::metadata(d.path().join("actions/a0/stdout")).unwrap().len(), 0, "its log truncated");

    // The next one, which declares no directory, sees none of it, and its log holds only
    // its own output.
    let (code, out) = run(&ex, &cas, "ls -A; echo done").await;
    assert_eq!((code, out.as_str()), (0, "done\n"));
    assert_eq!(entries(&d.path().join("actions")), ["a0"], "the same directory, kept");

    // Output parents made from the directories the first action left (kept as spares):
    // empty, and with the mode a new directory gets, though it left them read-only.
    let f = finish(&ex, "ls -A o/p; mkdir fresh; stat -c %a fresh o o/p | uniq | wc -l", &["o/p/out"]).await;
    assert_eq!(f.status_code, 0, "{}", f.status_message);
    let stdout = Digest::from_proto(F, f.action_result.unwrap().stdout_digest.as_ref(), "stdout").unwrap();
    assert_eq!(cas.get(&stdout).await.unwrap(), "1\n", "one mode for all three, and nothing in o/p");

    // The directories an action leaves are the ones the worker makes for the next (the
    // same inodes), writable ones included.
    let (_, made) = run(&ex, &cas, "mkdir -p q/r && stat -c %i q q/r | sort").await;
    let f = finish(&ex, "stat -c %i s s/t | sort", &["s/t/out"]).await;
    let stdout = Digest::from_proto(F, f.action_result.unwrap().stdout_digest.as_ref(), "stdout").unwrap();
    assert_eq!(cas.get(&stdout).await.unwrap(), made, "output parents from the spares");

    // An action that breaks its directory (its input root replaced by a file) gets it
    // removed; the next action runs in a new one.
    let (code, _) = run(&ex, &cas, "cd .. && rm -rf root && echo x > root").await;
    assert_eq!(code, 0);
    assert_eq!(entries(&d.path().join("actions")), Vec::<String>::new(), "a broken directory is not kept");
    let (code, out) = run(&ex, &cas, "ls -A; echo fine").await;
    assert_eq!((code, out.as_str()), (0, "fine\n"));
    assert_eq!(entries(&d.path().join("actions")), ["a1"]);
}

#[tokio::test]
async fn concurrent_actions_get_directories_of_their_own() {
    let d = tempfile::tempdir().unwrap();
    let cas: Arc<dyn BlobStore> = Arc::new(gantry_store::MemoryStore::new(1 << 30));
    let ex = executor(d.path(), cas.clone()).await;
    // Each writes a file, waits (up to 30 s) until all four are running, and lists its
    // root: it must see only its own.
    let ready = d.path().join("ready");
    std::fs::create_dir(&ready).unwrap();
    let script = |i: usize| {
        format!(
            "echo {i} > mine; touch {r}/{i}; n=0; \
             while [ $(ls {r} | wc -l) -lt 4 ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n+1)); done; \
             ls -A; cat mine",
            r = ready.display()
        )
    };
    let runs = (0..4).map(|i| {
        let (ex, cas, s) = (&ex, &cas, script(i));
        async move { run(ex, cas, &s).await }
    });
    let outs = futures::future::join_all(runs).await;
    for (i, (code, out)) in outs.iter().enumerate() {
        assert_eq!((*code, out.as_str()), (0, format!("mine\n{i}\n").as_str()));
    }
    assert_eq!(entries(&d.path().join("actions")), ["a0", "a1", "a2", "a3"]);
    for a in ["a0", "a1", "a2", "a3"] {
        assert_eq!(entries(&d.path().join("actions").join(a).join("root")), Vec::<String>::new());
    }
}

#[tokio::test]
async fn a_log_or_output_the_command_made_a_link_or_fifo_is_refused_and_nothing_outside_is_touched() {
    let d = tempfile::tempdir().unwrap();
    let cas: Arc<dyn BlobStore> = Arc::new(gantry_store::MemoryStore::new(1 << 30));
    let ex = executor(d.path(), cas.clone()).await;
    let victim = d.path().join("victim");
    std::fs::write(&victim, "keep me").unwrap();

    // Its stdout replaced by a link to a file outside the action directory: the log is
    // not followed (so not reported, and not truncated when the directory is emptied).
    let f = finish(&ex, &format!("echo out; ln -sf {} ../stdout", victim.display()), &[]).await;
    assert_eq!(f.status_code, tonic::Code::FailedPrecondition as i32, "{f:?}");
    assert!(f.status_message.contains("stdout is a symbolic link"), "{}", f.status_message);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");
    assert_eq!(entries(&d.path().join("actions")), ["a0"], "the directory is kept: the link is removed");
    let (code, out) = run(&ex, &cas, "echo next").await;
    assert_eq!((code, out.as_str()), (0, "next\n"), "the next action has a log of its own");
    assert!(std::fs::symlink_metadata(d.path().join("actions/a0/stdout")).unwrap().is_file());
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");

    // Its stderr replaced by a hard link to that file, and its input root made
    // read-only: the link is removed, not truncated, and the next action can write.
    let (code, _) = run(&ex, &cas, &format!("ln -f {} ../stderr && chmod 0555 .", victim.display())).await;
    assert_eq!(code, 0);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");
    let (code, out) = run(&ex, &cas, "touch mine && echo wrote").await;
    assert_eq!((code, out.as_str()), (0, "wrote\n"));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");

    // A declared output left as a FIFO is refused at once (opening it plainly would wait
    // for a writer that never comes). Should it wait, this thread comes as the writer
    // after 20 s, so that the test fails on the report rather than hanging.
    let fifo = d.path().join("actions/a0/root/out");
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(20));
        if fifo.exists() {
            let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
        }
    });
    let f = finish(&ex, "mkfifo out", &["out"]).await;
    assert_eq!(f.status_code, tonic::Code::FailedPrecondition as i32, "{f:?}");
    assert!(f.status_message.contains("not a regular file"), "{}", f.status_message);
    let (code, out) = run(&ex, &cas, "ls -A; echo after").await;
    assert_eq!((code, out.as_str()), (0, "after\n"));
}

/// The inode of the one file in `dir`'s tree named after `digest` (an FsStore's layout).
fn cached_inode(dir: &Path, digest: &Digest) -> Option<(u64, u32)> {
    use std::os::unix::fs::MetadataExt;
    let name = format!("{}-{}", digest.hash_hex(), digest.size);
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).ok()?.flatten() {
            let meta = e.metadata().ok()?;
            if meta.is_dir() {
                todo.push(e.path());
            } else if e.file_name().to_string_lossy() == name {
                return Some((meta.ino(), meta.mode() & 0o777));
            }
        }
    }
    None
}

const TOOL: &[u8] = b"#!/bin/sh\necho tool ran\n";

/// Puts an input root holding `TOOL` twice in `cas`, as the executable `tool` and the
/// plain file `plain`; returns its digest.
async fn tool_and_plain(cas: &Arc<dyn BlobStore>) -> Digest {
    let blob = F.digest_of(TOOL);
    cas.put(&blob, TOOL.to_vec().into()).await.unwrap();
    let file = |name: &str, is_executable: bool| reapi::FileNode {
        name: name.into(),
        digest: Some(blob.to_proto()),
        is_executable,
        ..Default::default()
    };
    let root = reapi::Directory { files: vec![file("plain", false), file("tool", true)], ..Default::default() };
    let root_bytes = root.encode_to_vec();
    let root_digest = F.digest_of(&root_bytes);
    cas.put(&root_digest, root_bytes.into()).await.unwrap();
    root_digest
}

/// An executable input is a hard link to an executable file of the worker's cache, as a
/// plain input is to a read-only one: before, every action got a copy of each executable
/// input (a whole compiler per action, for a toolchain). The same bytes given as a plain
/// input are another file, which is not executable.
#[tokio::test]
async fn executable_inputs_are_linked_from_the_cache_not_copied() {
    let d = tempfile::tempdir().unwrap();
    let cas: Arc<dyn BlobStore> = Arc::new(gantry_store::MemoryStore::new(1 << 30));
    let ex = executor(d.path(), cas.clone()).await;
    let root_digest = tool_and_plain(&cas).await;
    let blob = F.digest_of(TOOL);

    let mut seen = Vec::new();
    for _ in 0..2 {
        seen.push(run_in(&ex, &cas, "./tool && stat -c '%a %i' tool plain", root_digest).await.1);
    }
    let (x_inode, x_mode) = cached_inode(&d.path().join("cache-x"), &blob).expect("the executable is in the cache");
    let (r_inode, r_mode) = cached_inode(&d.path().join("cache"), &blob).expect("the plain file is in the cache");
    assert_eq!((x_mode, r_mode), (0o555, 0o444));
    let expected = format!("tool ran\n555 {x_inode}\n444 {r_inode}\n");
    assert_eq!(seen, [expected.clone(), expected], "both actions ran the cache's own files");
}

/// Executables more than the cache's part for them (half its size) are copied into the
/// action with their own mode, as before, and still run.
#[tokio::test]
async fn an_executable_too_large_for_the_cache_is_copied() {
    let d = tempfile::tempdir().unwrap();
    let cas: Arc<dyn BlobStore> = Arc::new(gantry_store::MemoryStore::new(1 << 30));
    // 40 bytes for plain files, 20 for executables: fewer than the tool's 24.
    let ex = executor_with_cache(d.path(), cas.clone(), 40).await;
    let root_digest = tool_and_plain(&cas).await;
    let (_, seen) = run_in(&ex, &cas, "./tool && stat -c '%a %i' tool plain", root_digest).await;
    let blob = F.digest_of(TOOL);
    assert_eq!(cached_inode(&d.path().join("cache-x"), &blob), None, "not kept with the executables");
    let (r_inode, _) = cached_inode(&d.path().join("cache"), &blob).expect("kept with the plain files");
    let lines: Vec<&str> = seen.lines().collect();
    assert_eq!(lines[0], "tool ran");
    assert!(lines[1].starts_with("555 ") && lines[1] != format!("555 {r_inode}"), "a copy of its own: {seen}");
    assert_eq!(lines[2], format!("444 {r_inode}"));
}

/// The stdout of a finished action.
async fn out_of(cas: &Arc<dyn BlobStore>, f: gantry_core::Finished) -> String {
    assert_eq!(f.status_code, 0, "{}", f.status_message);
    let d = Digest::from_proto(F, f.action_result.unwrap().stdout_digest.as_ref(), "stdout").unwrap();
    String::from_utf8(cas.get(&d).await.unwrap().to_vec()).unwrap()
}

#[tokio::test]
async fn directories_stay_in_place_only_where_the_next_action_declares_them() {
    let d = tempfile::tempdir().unwrap();
    let cas: Arc<dyn BlobStore> = Arc::new(gantry_store::MemoryStore::new(1 << 30));
    let ex = executor(d.path(), cas.clone()).await;
    let list = "find . -type d | sort | tr '\\n' ' '; stat -c %i x";

    // Leaves x/y (an output's parent, made read-only) and x/w (its own).
    let first =
        out_of(&cas, finish(&ex, &format!("mkdir x/w; touch x/y/out; chmod 0500 x/y; {list}"), &["x/y/out"]).await)
            .await;
    let x_inode = first.split_whitespace().last().unwrap().to_string();
    assert!(first.starts_with(". ./x ./x/w ./x/y "), "{first}");

    // The next declares x/z: x is the same directory, x/y and x/w are gone.
    let second = out_of(&cas, finish(&ex, &format!("touch x/z/out; {list}"), &["x/z/out"]).await).await;
    assert_eq!(second, format!(". ./x ./x/z {x_inode}\n"));

    // One whose input tree has a file where x was: the directory goes, the file is there.
    let file = bytes::Bytes::from_static(b"a file named x\n");
    let fd = F.digest_of(&file);
    cas.put(&fd, file).await.unwrap();
    let rd = common::put_dir(&cas, common::file_of("x", fd, false)).await;
    let (code, out) = run_in(&ex, &cas, "find . | sort | tr '\\n' ' '; cat x", rd).await;
    assert_eq!((code, out.as_str()), (0, ". ./x a file named x\n"));

    // An input tree that holds x/y/z as a directory: x and x/y are made again (as
    // spares), empty but for the input, and writable.
    let mut rd = common::put_dir(&cas, common::file_of("f", fd, false)).await;
    for name in ["z", "y", "x"] {
        rd = common::put_dir(&cas, common::dir_of(name, rd)).await;
    }
    let (code, out) = run_in(&ex, &cas, "find . | sort | tr '\\n' ' '; touch x/y/new && echo writable", rd).await;
    assert_eq!((code, out.as_str()), (0, ". ./x ./x/y ./x/y/z ./x/y/z/f writable\n"));
}
