//! Remote execution through a real tonic client against a real `gantry serve` process
//! (and, for worker loss, separate `gantry worker` processes).

mod common;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::reapi::{command, Client, Node};
use common::GantryServer;
use gantry_core::google::longrunning::CancelOperationRequest;
use gantry_core::reapi::{self, execution_stage};
use prost::Message;

fn config(dir: &std::path::Path, workers: usize) -> std::path::PathBuf {
    let p = dir.join("gantry.toml");
    std::fs::write(&p, format!("[execution]\nworkers = {workers}\nheartbeat_timeout = \"3s\"\n")).unwrap();
    p
}

fn serve(dir: &std::path::Path, workers: usize) -> GantryServer {
    let cfg = config(dir, workers);
    GantryServer::start(&dir.join("data"), &["--config", cfg.to_str().unwrap()])
}

fn file(s: &str) -> Node {
    Node::File(s.as_bytes().to_vec(), false)
}

fn dir(entries: Vec<(&str, Node)>) -> Node {
    Node::Dir(entries.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

fn root(entries: Vec<(&str, Node)>) -> BTreeMap<String, Node> {
    entries.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_inputs_outputs_streams_and_exit_codes() {
    let tmp = tempfile::tempdir().unwrap();
    let server = serve(tmp.path(), 2);
    let c = Client::connect(&server.grpc).await;
    let script = "#!/bin/sh\nset -e\ncat data/deep/in.txt > out/a/b/file.txt\nmkdir -p outdir/x\necho y > outdir/x/y.txt\ncp tools/run.sh outdir/run-copy.sh\nln -s x outdir/link\necho to-stdout\necho to-stderr >&2\n";
    let input = c
        .tree(&root(vec![
            ("data", dir(vec![("deep", dir(vec![("in.txt", file("hello from a nested input\n"))]))])),
            ("tools", dir(vec![("run.sh", Node::File(script.as_bytes().to_vec(), true))])),
        ]))
        .await;
    let action = c.action(command(&["tools/run.sh"], &["out/a/b/file.txt"], &["outdir"]), input, 60, false).await;
    let (_, stages, resp) = c.execute(action, false).await;
    assert_eq!(resp.status.as_ref().unwrap().code, 0, "{:?}", resp.status);
    assert!(!resp.cached_result);
    assert_eq!(*stages.last().unwrap(), execution_stage::Value::Completed as i32);
    let r = resp.result.unwrap();
    assert_eq!(r.exit_code, 0);
    assert_eq!(r.output_files.len(), 1);
    assert_eq!(r.output_files[0].path, "out/a/b/file.txt");
    assert_eq!(c.get(r.output_files[0].digest.as_ref().unwrap()).await, b"hello from a nested input\n");
    assert_eq!(c.get(r.stdout_digest.as_ref().unwrap()).await, b"to-stdout\n");
    assert_eq!(c.get(r.stderr_digest.as_ref().unwrap()).await, b"to-stderr\n");
    // the output directory as a Tree
    assert_eq!(r.output_directories.len(), 1);
    let tree =
        reapi::Tree::decode(c.get(r.output_directories[0].tree_digest.as_ref().unwrap()).await.as_slice()).unwrap();
    let top = tree.root.unwrap();
    assert_eq!(top.directories.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), vec!["x"]);
    assert_eq!(top.symlinks[0].name, "link");
    assert_eq!(top.symlinks[0].target, "x");
    let copy = top.files.iter().find(|f| f.name == "run-copy.sh").unwrap();
    assert!(copy.is_executable, "the executable bit is kept");
    let x = &tree.children[0];
    assert_eq!(x.files[0].name, "y.txt");
    assert_eq!(c.get(x.files[0].digest.as_ref().unwrap()).await, b"y\n");
    // metering metadata
    let md = r.execution_metadata.unwrap();
    assert!(md.worker.contains("-local-"), "{}", md.worker);
    for t in [
        &md.queued_timestamp,
        &md.worker_start_timestamp,
        &md.input_fetch_start_timestamp,
        &md.execution_start_timestamp,
        &md.execution_completed_timestamp,
        &md.output_upload_completed_timestamp,
    ] {
        assert!(t.as_ref().is_some_and(|t| t.seconds > 0));
    }

    // A cached re-execute: served from the action cache, unless asked to skip it.
    let (_, _, again) = c.execute(action, false).await;
    assert!(again.cached_result);
    assert_eq!(again.result.unwrap().output_files, r.output_files);
    let (_, _, forced) = c.execute(action, true).await;
    assert!(!forced.cached_result);

    // A non-zero exit is returned, with its stderr, and not cached.
    let fail = c.action(command(&["/bin/sh", "-c", "echo broken >&2; exit 7"], &[], &[]), input, 60, false).await;
    let (_, _, resp) = c.execute(fail, false).await;
    let r = resp.result.unwrap();
    assert_eq!(r.exit_code, 7);
    assert_eq!(c.get(r.stderr_digest.as_ref().unwrap()).await, b"broken\n");
    let (_, _, again) = c.execute(fail, false).await;
    assert!(!again.cached_result, "failures are not cached");

    // do_not_cache is honoured.
    let nc = c.action(command(&["/bin/true"], &[], &[]), input, 60, true).await;
    c.execute(nc, false).await;
    let (_, _, again) = c.execute(nc, false).await;
    assert!(!again.cached_result);

    // A platform property no worker offers: FAILED_PRECONDITION naming it.
    let cd = c.put(&command(&["/bin/true"], &[], &[]).encode_to_vec()).await;
    let a = reapi::Action {
        command_digest: Some(cd.to_proto()),
        input_root_digest: Some(input.to_proto()),
        platform: Some(reapi::Platform {
            properties: vec![reapi::platform::Property { name: "gpu".into(), value: "a100".into() }],
        }),
        ..Default::default()
    };
    let ad = c.put(&a.encode_to_vec()).await;
    let err = gantry_core::reapi::execution_client::ExecutionClient::new(c.channel.clone())
        .execute(reapi::ExecuteRequest { action_digest: Some(ad.to_proto()), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(err.message().contains("gpu=a100"), "{}", err.message());
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_reports_deadline_exceeded_with_partial_output() {
    let tmp = tempfile::tempdir().unwrap();
    let server = serve(tmp.path(), 1);
    let c = Client::connect(&server.grpc).await;
    let input = c.tree(&root(vec![])).await;
    let action = c
        .action(
            command(&["/bin/sh", "-c", "echo partial > out.txt; echo before-sleep; sleep 30"], &["out.txt"], &[]),
            input,
            1,
            false,
        )
        .await;
    let start = Instant::now();
    let (_, _, resp) = c.execute(action, false).await;
    assert!(start.elapsed() < Duration::from_secs(15), "killed at the 1 s timeout");
    assert_eq!(resp.status.as_ref().unwrap().code, tonic::Code::DeadlineExceeded as i32);
    let r = resp.result.unwrap();
    assert_eq!(c.get(r.stdout_digest.as_ref().unwrap()).await, b"before-sleep\n");
    assert_eq!(c.get(r.output_files[0].digest.as_ref().unwrap()).await, b"partial\n");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_while_running_kills_the_process() {
    let tmp = tempfile::tempdir().unwrap();
    let server = serve(tmp.path(), 1);
    let c = Client::connect(&server.grpc).await;
    let pidfile = tmp.path().join("pid");
    let input = c.tree(&root(vec![])).await;
    let script = format!("echo $$ > {}; exec sleep 60", pidfile.display());
    let action = c.action(command(&["/bin/sh", "-c", &script], &[], &[]), input, 120, false).await;
    let c2 = Client { channel: c.channel.clone() };
    let run = tokio::spawn(async move { c2.execute(action, false).await });
    let deadline = Instant::now() + Duration::from_secs(20);
    while !pidfile.exists() || std::fs::read_to_string(&pidfile).unwrap().trim().is_empty() {
        assert!(Instant::now() < deadline, "the action never started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid: u32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    let ops = c
        .operations()
        .list_operations(gantry_core::google::longrunning::ListOperationsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let name = ops.operations.iter().find(|o| !o.done).expect("a running operation").name.clone();
    c.operations().cancel_operation(CancelOperationRequest { name: name.clone() }).await.unwrap();
    let (op, _, resp) = tokio::time::timeout(Duration::from_secs(15), run).await.unwrap().unwrap();
    assert_eq!(op, name);
    assert_eq!(resp.status.unwrap().code, tonic::Code::Cancelled as i32);
    // Killed with its group, then reaped by the spawner. Dead means gone from /proc or a
    // zombie awaiting that reaping.
    let dead = || match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit(')').next().unwrap().trim_start().starts_with('Z'),
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !dead() {
        assert!(Instant::now() < deadline, "process {pid} still running after the cancel");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // the finished operation is still visible, then can be deleted
    let got = c
        .operations()
        .get_operation(gantry_core::google::longrunning::GetOperationRequest { name: name.clone() })
        .await
        .unwrap()
        .into_inner();
    assert!(got.done);
    c.operations()
        .delete_operation(gantry_core::google::longrunning::DeleteOperationRequest { name: name.clone() })
        .await
        .unwrap();
    let err =
        c.operations().get_operation(gantry_core::google::longrunning::GetOperationRequest { name }).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    server.stop();
}

fn worker(server: &GantryServer, dir: &std::path::Path, id: &str) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_gantry"))
        .args(["worker", "--scheduler", &format!("grpc://{}", server.grpc), "--id", id, "--work-dir"])
        .arg(dir.join(id))
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_worker_process_loses_its_action_to_another_worker() {
    let tmp = tempfile::tempdir().unwrap();
    let server = serve(tmp.path(), 0);
    let c = Client::connect(&server.grpc).await;
    let mut a = worker(&server, tmp.path(), "worker-a");
    let started = tmp.path().join("started-on");
    // Each run appends its worker's id; the first run (on worker-a) is killed mid-sleep.
    let input = c.tree(&root(vec![])).await;
    let script = format!("echo running >> {}; sleep 3; echo done", started.display());
    let action = c.action(command(&["/bin/sh", "-c", &script], &[], &[]), input, 120, false).await;
    wait_until(|| metric(&server.http, "gantry_execution_workers") == 1.0).await;
    let c2 = Client { channel: c.channel.clone() };
    let run = tokio::spawn(async move { c2.execute(action, false).await });
    wait_until(|| started.exists()).await;
    a.kill().unwrap(); // SIGKILL
    a.wait().unwrap();
    let mut b = worker(&server, tmp.path(), "worker-b");
    let (_, _, resp) = tokio::time::timeout(Duration::from_secs(60), run).await.unwrap().unwrap();
    assert_eq!(resp.status.as_ref().unwrap().code, 0, "{:?}", resp.status);
    let r = resp.result.unwrap();
    assert_eq!(r.execution_metadata.unwrap().worker, "worker-b");
    assert_eq!(c.get(r.stdout_digest.as_ref().unwrap()).await, b"done\n");
    assert_eq!(std::fs::read_to_string(&started).unwrap().lines().count(), 2, "ran once per worker");
    b.kill().unwrap();
    b.wait().unwrap();
    server.stop();
}

/// A worker SIGSTOPped mid-action stops heartbeating: it is dropped, and the action
/// completes, correctly, on another worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstopped_worker_loses_its_action_to_another_worker() {
    let tmp = tempfile::tempdir().unwrap();
    let server = serve(tmp.path(), 0);
    let c = Client::connect(&server.grpc).await;
    let mut a = worker(&server, tmp.path(), "worker-a");
    let started = tmp.path().join("started");
    let input = c.tree(&root(vec![])).await;
    let script = format!("touch {}; sleep 2; echo finished", started.display());
    let action = c.action(command(&["/bin/sh", "-c", &script], &[], &[]), input, 120, false).await;
    wait_until(|| metric(&server.http, "gantry_execution_workers") == 1.0).await;
    let c2 = Client { channel: c.channel.clone() };
    let run = tokio::spawn(async move { c2.execute(action, false).await });
    wait_until(|| started.exists()).await;
    Command::new("kill").args(["-STOP", &a.id().to_string()]).status().unwrap();
    let mut b = worker(&server, tmp.path(), "worker-b");
    let (_, _, resp) = tokio::time::timeout(Duration::from_secs(60), run).await.unwrap().unwrap();
    assert_eq!(resp.status.as_ref().unwrap().code, 0, "{:?}", resp.status);
    let r = resp.result.unwrap();
    assert_eq!(r.execution_metadata.unwrap().worker, "worker-b");
    assert_eq!(c.get(r.stdout_digest.as_ref().unwrap()).await, b"finished\n");
    a.kill().unwrap();
    a.wait().unwrap();
    b.kill().unwrap();
    b.wait().unwrap();
    server.stop();
}

fn alive(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rsplit(')').next().unwrap_or("").trim_start().chars().next();
    !stat.is_empty() && state != Some('Z')
}

/// A worker SIGKILLed mid-action takes the action's processes with it (its spawner reads
/// end of file and kills every action's process group), not leaving them unsupervised.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_worker_leaves_no_action_processes_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let server = serve(tmp.path(), 0);
    let c = Client::connect(&server.grpc).await;
    let mut a = worker(&server, tmp.path(), "worker-a");
    let pids = tmp.path().join("pids");
    let script = format!("sleep 120 & echo $! > {p}.tmp; echo $$ >> {p}.tmp; mv {p}.tmp {p}; wait", p = pids.display());
    let input = c.tree(&root(vec![])).await;
    let action = c.action(command(&["/bin/sh", "-c", &script], &[], &[]), input, 300, false).await;
    wait_until(|| metric(&server.http, "gantry_execution_workers") == 1.0).await;
    let c2 = Client { channel: c.channel.clone() };
    let run = tokio::spawn(async move { c2.execute(action, false).await });
    wait_until(|| pids.exists()).await;
    let pids: Vec<i32> = std::fs::read_to_string(&pids).unwrap().lines().map(|l| l.trim().parse().unwrap()).collect();
    assert_eq!(pids.len(), 2);
    assert!(pids.iter().all(|&p| alive(p)));
    a.kill().unwrap(); // SIGKILL
    a.wait().unwrap();
    wait_until(|| pids.iter().all(|&p| !alive(p))).await;
    run.abort();
    server.stop();
}

/// The children of `parent` started as the action spawner.
fn spawners_of(parent: u32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok());
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            ppid == Some(parent) && cmdline.split(|b| *b == 0).any(|a| a == b"__spawner") && alive(*pid)
        })
        .collect()
}

/// The spawner that starts and reaps actions dies mid-action: the action's process dies
/// with it (nothing runs unsupervised), its run fails as UNAVAILABLE (a client retries
/// that), and the next action starts a new spawner and succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_spawner_takes_its_actions_and_is_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let server = serve(tmp.path(), 1);
    let c = Client::connect(&server.grpc).await;
    let pidfile = tmp.path().join("pid");
    let input = c.tree(&root(vec![])).await;
    let script = format!("echo $$ > {p}.tmp; mv {p}.tmp {p}; exec sleep 60", p = pidfile.display());
    let action = c.action(command(&["/bin/sh", "-c", &script], &[], &[]), input, 120, false).await;
    let c2 = Client { channel: c.channel.clone() };
    let run = tokio::spawn(async move { c2.execute(action, false).await });
    wait_until(|| pidfile.exists()).await;
    let pid: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    let spawners = spawners_of(server.child.id());
    assert_eq!(spawners.len(), 1, "one spawner for the one worker: {spawners:?}");
    Command::new("kill").args(["-KILL", &spawners[0].to_string()]).status().unwrap();
    wait_until(|| !alive(pid)).await;
    let (_, _, resp) = tokio::time::timeout(Duration::from_secs(30), run).await.unwrap().unwrap();
    let status = resp.status.unwrap();
    assert_eq!(status.code, tonic::Code::Unavailable as i32, "{status:?}");
    assert!(status.message.contains("spawner"), "{status:?}");
    let again = c.action(command(&["/bin/sh", "-c", "echo again"], &[], &[]), input, 60, false).await;
    let (_, _, resp) = c.execute(again, false).await;
    assert_eq!(resp.status.as_ref().unwrap().code, 0, "{:?}", resp.status);
    assert_eq!(c.get(resp.result.unwrap().stdout_digest.as_ref().unwrap()).await, b"again\n");
    let replaced = spawners_of(server.child.id());
    assert_eq!(replaced.len(), 1, "{replaced:?}");
    assert_ne!(replaced, spawners, "a new spawner");
    server.stop();
}

async fn wait_until(mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "condition not reached within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn metric(http: &str, name: &str) -> f64 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(http).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

fn vm_rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines().find(|l| l.starts_with("VmRSS:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metering_measures_the_action_not_the_server() {
    let tmp = tempfile::tempdir().unwrap();
    let server = serve(tmp.path(), 1);
    let c = Client::connect(&server.grpc).await;
    let input = c.tree(&root(vec![])).await;
    let small = c.action(command(&["/bin/sh", "-c", "true"], &[], &[]), input, 60, true).await;
    let big = c
        .action(
            command(
                &[
                    "/bin/sh",
                    "-c",
                    "head -c 60000000 /dev/zero | python3 -c 'import sys; d=sys.stdin.buffer.read(); print(len(d))'",
                ],
                &[],
                &[],
            ),
            input,
            60,
            true,
        )
        .await;
    let (_, _, _) = c.execute(small, false).await;
    let (_, _, _) = c.execute(big, false).await;
    let server_rss = vm_rss_kib(server.child.id()) * 1024;
    // Read the metering back from the execution log through the CLI.
    let out = Command::new(env!("CARGO_BIN_EXE_gantry"))
        .args(["invocation", "", "--json", "--data-dir"])
        .arg(tmp.path().join("data"))
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let peaks: Vec<u64> =
        v["executions"].as_array().unwrap().iter().map(|e| e["peak_memory_bytes"].as_u64().unwrap()).collect();
    assert_eq!(peaks.len(), 2, "{v}");
    eprintln!("server RSS {server_rss} B, action peaks {peaks:?}");
    assert!(peaks[0] < 16 << 20, "a shell running `true` is metered at {} B: the server's memory leaked in", peaks[0]);
    assert!(peaks[0] < server_rss, "smaller than the server ({server_rss} B)");
    assert!(peaks[1] > 55_000_000, "the 60 MB allocation is seen: {}", peaks[1]);
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relative_data_dir_and_relative_program_path() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("gantry.toml"), "[execution]\nworkers = 1\n").unwrap();
    // --data-dir relative to the server's working directory, as with the defaults.
    let server = GantryServer::start_in(Some(tmp.path()), std::path::Path::new("data"), &["--config", "gantry.toml"]);
    let c = Client::connect(&server.grpc).await;
    let script = "#!/bin/sh\necho from a relative tool\n";
    let input =
        c.tree(&root(vec![("bin", dir(vec![("tool.sh", Node::File(script.as_bytes().to_vec(), true))]))])).await;
    let mut cmd = command(&["bin/tool.sh"], &[], &[]);
    cmd.working_directory = String::new();
    let action = c.action(cmd, input, 60, false).await;
    let (_, _, resp) = c.execute(action, false).await;
    assert_eq!(resp.status.as_ref().unwrap().code, 0, "{:?}", resp.status);
    let r = resp.result.unwrap();
    assert_eq!(r.exit_code, 0, "{}", String::from_utf8_lossy(&c.get(r.stderr_digest.as_ref().unwrap()).await));
    assert_eq!(c.get(r.stdout_digest.as_ref().unwrap()).await, b"from a relative tool\n");
    assert!(tmp.path().join("data/workers/w0").is_dir());
    server.stop();
}

fn missing_subjects(details: &[gantry_core::google::protobuf::Any]) -> Vec<String> {
    details
        .iter()
        .filter(|a| a.type_url.ends_with("google.rpc.PreconditionFailure"))
        .flat_map(|a| gantry_proto::rpc::PreconditionFailure::decode(a.value.as_slice()).unwrap().violations)
        .map(|v| {
            assert_eq!(v.r#type, "MISSING");
            v.subject
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_blobs_are_failed_precondition_with_missing_violations() {
    let tmp = tempfile::tempdir().unwrap();
    let server = serve(tmp.path(), 1);
    let c = Client::connect(&server.grpc).await;
    // An input file whose blob was never uploaded (e.g. evicted after FindMissingBlobs).
    let ghost = gantry_core::DigestFunction::Sha256.digest_of(b"never uploaded input");
    let dir = reapi::Directory {
        files: vec![reapi::FileNode { name: "in.txt".into(), digest: Some(ghost.to_proto()), ..Default::default() }],
        ..Default::default()
    };
    let input = c.put(&dir.encode_to_vec()).await;
    let action = c.action(command(&["/bin/cat", "in.txt"], &[], &[]), input, 60, false).await;
    let (_, _, resp) = c.execute(action, false).await;
    let st = resp.status.unwrap();
    assert_eq!(st.code, tonic::Code::FailedPrecondition as i32, "{}", st.message);
    assert_eq!(missing_subjects(&st.details), vec![format!("blobs/{}/{}", ghost.hash_hex(), ghost.size)]);

    // A missing Action blob is refused by Execute itself, with the same details.
    let phantom = gantry_core::DigestFunction::Sha256.digest_of(b"no such action");
    let err = gantry_core::reapi::execution_client::ExecutionClient::new(c.channel.clone())
        .execute(reapi::ExecuteRequest { action_digest: Some(phantom.to_proto()), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    let rpc = gantry_core::google::rpc::Status::decode(err.details()).unwrap();
    assert_eq!(missing_subjects(&rpc.details), vec![format!("blobs/{}/{}", phantom.hash_hex(), phantom.size)]);
    server.stop();
}

/// A client naming a huge Action, Command or Directory cannot make the server buffer it:
/// the claimed size is refused before any read, naming the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_named_protos_are_read_with_a_size_cap() {
    let tmp = tempfile::tempdir().unwrap();
    let server = serve(tmp.path(), 0);
    let c = Client::connect(&server.grpc).await;
    let mut huge = gantry_core::DigestFunction::Sha256.digest_of(b"not really this big");
    huge.size = 5 << 30;
    let e = reapi::execution_client::ExecutionClient::new(c.channel.clone())
        .execute(reapi::ExecuteRequest { action_digest: Some(huge.to_proto()), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("max_proto_size"), "{}", e.message());
    let e = reapi::content_addressable_storage_client::ContentAddressableStorageClient::new(c.channel.clone())
        .get_tree(reapi::GetTreeRequest { root_digest: Some(huge.to_proto()), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("max_proto_size"), "{}", e.message());
    server.stop();
}
