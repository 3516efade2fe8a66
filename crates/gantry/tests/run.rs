//! `gantry run` against a real `gantry serve` on loopback: cache hits replay outputs and
//! streams, the losing branch is really stopped (its process group gone, or its
//! operation cancelled on the server), tree outputs land whole, and a hundred races
//! with alternating winners leave neither temporary files nor torn outputs.
//!
//! The commands tell which side runs them by their working directory: the local branch
//! runs inside the project directory, the remote one in the worker's data directory.

mod common;

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use common::GantryServer;
use gantry_core::google::longrunning::operations_client::OperationsClient;
use gantry_core::google::longrunning::{operation, GetOperationRequest};
use prost::Message;

struct Project {
    dir: tempfile::TempDir,
    cache: tempfile::TempDir,
    remote: String,
}

impl Project {
    fn new(server: &GantryServer) -> Project {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("in.txt"), "input\n").unwrap();
        Project { dir, cache: tempfile::tempdir().unwrap(), remote: format!("grpc://{}", server.grpc) }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Runs `gantry run <flags> -- sh -c <script> <args>`; returns the output and the report.
    fn run(&self, flags: &[&str], script: &str, args: &[&str]) -> (Output, serde_json::Value) {
        let report = self.cache.path().join("report.json");
        let _ = std::fs::remove_file(&report);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gantry"))
            .arg("run")
            .args(["--remote", &self.remote, "--cache-dir"])
            .arg(self.cache.path())
            .arg("--report")
            .arg(&report)
            .args(flags)
            .args(["--", "sh", "-c", script, "sh"])
            .args(args)
            .current_dir(self.path())
            .output()
            .unwrap();
        let v = match std::fs::read(&report) {
            Ok(b) => serde_json::from_slice(&b).unwrap(),
            Err(_) => serde_json::Value::Null,
        };
        (out, v)
    }

    /// Every entry of the project directory, recursively, relative to it.
    fn listing(&self) -> Vec<String> {
        fn walk(root: &Path, d: &Path, out: &mut Vec<String>) {
            for e in std::fs::read_dir(d).unwrap() {
                let p = e.unwrap().path();
                out.push(p.strip_prefix(root).unwrap().display().to_string());
                if p.is_dir() && !p.is_symlink() {
                    walk(root, &p, out);
                }
            }
        }
        let mut v = Vec::new();
        walk(self.path(), self.path(), &mut v);
        v.sort();
        v
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// True once `pid` is no process or only a zombie (killed, waiting to be reaped by init).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

fn wait_gone(pid: u32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if gone(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    gone(pid)
}

fn read_pid(p: &Path) -> u32 {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())).trim().parse().unwrap()
}

/// A script running `local` in the local branch and `remote` in the remote one.
fn sided(project: &Path, local: &str, remote: &str) -> String {
    format!("case \"$PWD\" in {}/*) side=local; {local} ;; *) side=remote; {remote} ;; esac", project.display())
}

#[test]
fn cache_hit_replays_outputs_stdout_and_trees() {
    let data = tempfile::tempdir().unwrap();
    let server = GantryServer::start(data.path(), &[]);
    let p = Project::new(&server);
    let script = sided(
        p.path(),
        "sleep 3",
        "mkdir -p tree/sub; echo leaf > tree/sub/leaf; echo top > tree/top; cat in.txt > out.txt; echo replay-me; echo on-stderr >&2",
    );
    let flags = ["--inputs", "in.txt", "--outputs", "out.txt", "tree"];

    // 1. Remote execution fills the cache.
    let (o, r) = p.run(&[&flags[..], &["--strategy", "remote"]].concat(), &script, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(r["winner"], "remote");
    assert_eq!(r["from_cache"], false);

    // 2. Outputs gone, a stale tree in the way: cache-only restores everything.
    std::fs::remove_file(p.path().join("out.txt")).unwrap();
    std::fs::remove_dir_all(p.path().join("tree")).unwrap();
    std::fs::create_dir_all(p.path().join("tree/stale")).unwrap();
    let (o, r) = p.run(&[&flags[..], &["--strategy", "cache-only"]].concat(), &script, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(r["from_cache"], true, "{r}");
    assert_eq!(stdout(&o), "replay-me\n");
    assert!(stderr(&o).contains("on-stderr"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(p.path().join("out.txt")).unwrap(), "input\n");
    assert_eq!(
        p.listing(),
        ["in.txt", "out.txt", "tree", "tree/sub", "tree/sub/leaf", "tree/top"],
        "the stale tree is replaced whole, nothing temporary is left"
    );
    assert_eq!(std::fs::read_to_string(p.path().join("tree/sub/leaf")).unwrap(), "leaf\n");

    // 3. Dynamic: the cache hit beats a local branch that would take 3 s.
    let started = Instant::now();
    let (o, r) = p.run(&[&flags[..], &["--local-delay", "0s"]].concat(), &script, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!((r["winner"].as_str(), r["from_cache"].as_bool()), (Some("remote"), Some(true)), "{r}");
    assert!(started.elapsed() < Duration::from_secs(3), "the local sleep was cancelled, not waited for");

    // 4. The exit code is replayed, and a command that fails is not cached.
    let (o, _) = p.run(&["--strategy", "remote"], "echo failing; exit 7", &[]);
    assert_eq!(o.status.code(), Some(7));
    assert_eq!(stdout(&o), "failing\n");
    let (o, r) = p.run(&["--strategy", "cache-only"], "echo failing; exit 7", &[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("cache-only"), "{}", stderr(&o));
    assert_eq!(r["result"], "CacheMiss", "{r}");
    server.stop();
}

#[test]
fn remote_win_kills_the_local_process_group() {
    let data = tempfile::tempdir().unwrap();
    let server = GantryServer::start(data.path(), &[]);
    let p = Project::new(&server);
    let pids = tempfile::tempdir().unwrap();
    let (lp, lc) = (pids.path().join("local.pid"), pids.path().join("local.child"));
    let script = sided(
        p.path(),
        &format!("echo $$ > {}; sleep 60 & echo $! > {}; wait; echo local > out.txt", lp.display(), lc.display()),
        // Slow enough that the local shell has surely written its pids.
        "sleep 1.5; echo remote > out.txt",
    );
    let (o, r) = p.run(&["--outputs", "out.txt", "--local-delay", "0s"], &script, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(r["winner"], "remote", "{r}");
    assert_eq!(std::fs::read_to_string(p.path().join("out.txt")).unwrap(), "remote\n");
    let (shell, child) = (read_pid(&lp), read_pid(&lc));
    // gantry run has exited: the group was killed and reaped before it did.
    assert!(gone(shell), "local shell {shell} still runs");
    assert!(wait_gone(child, Duration::from_secs(2)), "local child {child} (same process group) still runs");
    assert_eq!(p.listing(), ["in.txt", "out.txt"]);
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_win_cancels_the_remote_operation() {
    let data = tempfile::tempdir().unwrap();
    let server = GantryServer::start(data.path(), &[]);
    let p = Project::new(&server);
    let pids = tempfile::tempdir().unwrap();
    let rp = pids.path().join("remote.pid");
    let script = sided(
        p.path(),
        // Win only once the remote command is really running on a worker.
        &format!("while [ ! -s {} ]; do sleep 0.05; done; echo local > out.txt", rp.display()),
        &format!("echo $$ > {}; sleep 60; echo remote > out.txt", rp.display()),
    );
    let (o, r) = tokio::task::block_in_place(|| p.run(&["--outputs", "out.txt", "--local-delay", "0s"], &script, &[]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(r["winner"], "local", "{r}");
    assert_eq!(std::fs::read_to_string(p.path().join("out.txt")).unwrap(), "local\n");
    let name = r["operation"].as_str().expect("the remote branch reached Execute").to_string();

    // The server reports the operation done and CANCELLED, and the worker killed the command.
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", server.grpc)).unwrap().connect().await.unwrap();
    let mut ops = OperationsClient::new(channel);
    let deadline = Instant::now() + Duration::from_secs(10);
    let op = loop {
        let op = ops.get_operation(GetOperationRequest { name: name.clone() }).await.unwrap().into_inner();
        if op.done || Instant::now() > deadline {
            break op;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(op.done, "operation {name} still running after the local win");
    let code = match op.result {
        Some(operation::Result::Response(any)) => {
            gantry_core::reapi::ExecuteResponse::decode(any.value.as_slice()).unwrap().status.map_or(0, |s| s.code)
        }
        Some(operation::Result::Error(s)) => s.code,
        None => panic!("no result"),
    };
    assert_eq!(tonic::Code::from(code), tonic::Code::Cancelled);
    let remote_pid = read_pid(&rp);
    assert!(wait_gone(remote_pid, Duration::from_secs(10)), "remote command {remote_pid} still runs on the worker");
    assert_eq!(p.listing(), ["in.txt", "out.txt"]);
    server.stop();
}

#[test]
fn a_hundred_races_with_flipping_winners_leave_no_temp_files_and_no_torn_outputs() {
    let data = tempfile::tempdir().unwrap();
    let server = GantryServer::start(data.path(), &[]);
    let p = Project::new(&server);
    // Run i: the even side is slow locally, the odd side is slow remotely. Every output
    // names its side and run, so a mix of two branches' outputs is detected.
    let write =
        "mkdir -p tree/a; echo \"$side $1\" > out.txt; echo \"$side $1\" > tree/a/one; echo \"$side $1\" > tree/two";
    let script = sided(
        p.path(),
        &format!("if [ $(($1 % 2)) -eq 0 ]; then sleep 0.6; fi; {write}"),
        &format!("if [ $(($1 % 2)) -eq 1 ]; then sleep 0.6; fi; {write}"),
    );
    let mut wins = std::collections::BTreeMap::<String, u32>::new();
    for i in 0..100 {
        let n = i.to_string();
        let (o, r) =
            p.run(&["--inputs", "in.txt", "--outputs", "out.txt", "tree", "--local-delay", "0s"], &script, &[&n]);
        assert!(o.status.success(), "run {i}: {}", stderr(&o));
        let side = r["winner"].as_str().unwrap().to_string();
        let want = format!("{side} {i}\n");
        for f in ["out.txt", "tree/a/one", "tree/two"] {
            assert_eq!(std::fs::read_to_string(p.path().join(f)).unwrap(), want, "run {i}: {f} is torn");
        }
        assert_eq!(
            p.listing(),
            ["in.txt", "out.txt", "tree", "tree/a", "tree/a/one", "tree/two"],
            "run {i}: stray files"
        );
        *wins.entry(side).or_default() += 1;
    }
    eprintln!("winners over 100 runs: {wins:?}");
    assert!(wins.get("local").copied().unwrap_or(0) >= 30, "{wins:?}");
    assert!(wins.get("remote").copied().unwrap_or(0) >= 30, "{wins:?}");
    server.stop();
}

#[test]
fn bad_input_is_refused_precisely() {
    let data = tempfile::tempdir().unwrap();
    let server = GantryServer::start(data.path(), &[]);
    let p = Project::new(&server);
    let (o, _) = p.run(&["--inputs", "../elsewhere"], "true", &[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("input '../elsewhere' is outside"), "{}", stderr(&o));
    let (o, _) = p.run(&["--inputs", "missing.c"], "true", &[]);
    assert!(stderr(&o).contains("missing.c does not exist"), "{}", stderr(&o));
    let (o, _) = p.run(&["--inputs", "in.txt", "--outputs", "in.txt"], "true", &[]);
    assert!(stderr(&o).contains("cannot also be its inputs"), "{}", stderr(&o));
    assert_eq!(p.listing(), ["in.txt"]);
    server.stop();
}
