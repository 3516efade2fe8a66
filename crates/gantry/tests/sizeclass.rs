//! Size classes end to end: two classes of in-process workers with enforced limits, real
//! actions through a tonic client, learning persisted across a restart.

mod common;

use common::reapi::{command, Client};
use common::GantryServer;

const CONFIG: &str = r#"
[execution]
workers = [{size_class = 1, count = 1}, {size_class = 2, count = 1}]
memory_per_size_class = "150MiB"
cpus_per_size_class = 1
[execution.size_classes]
seed = 1
# No random retries of the class below the learned one: the settled classes are exact.
exploration_factor = 0.0
"#;

/// Runs the action (never cached) and returns (size class it finished on, message).
async fn run(c: &Client, action: gantry_core::Digest) -> (u32, String, i32) {
    let (_, _, resp) = c.execute(action, true).await;
    assert_eq!(resp.status.as_ref().map_or(0, |s| s.code), 0, "{:?}", resp.status);
    let r = resp.result.unwrap();
    let worker = r.execution_metadata.unwrap().worker;
    // Workers are numbered in config order: -local-0 is class 1, -local-1 is class 2.
    let class = if worker.ends_with("-local-0") { 1 } else { 2 };
    (class, resp.message, r.exit_code)
}

fn metric(http: &str, needle: &str) -> f64 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(http).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.lines().filter(|l| l.starts_with(needle)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_hungry_goes_large_small_settles_small_and_learning_persists() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("gantry.toml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let data = tmp.path().join("data");
    let server = GantryServer::start(&data, &["--config", cfg.to_str().unwrap()]);
    let c = Client::connect(&server.grpc).await;
    let input = c.tree(&Default::default()).await;

    // Needs ~200 MB: over class 1's 150 MiB, under class 2's 300 MiB. It then sleeps 1 s,
    // so its hedge time on class 1 (its class-2 time x 1.07 x 1.2) comes long after the
    // allocation fails there: without the sleep, a loaded machine once started python
    // slowly enough that the hedge on class 2 came first and nothing was "retried".
    let hungry = c
        .action(
            command(
                &["/usr/bin/python3", "-c", "import time; b = bytearray(200_000_000); time.sleep(1); print(len(b))"],
                &[],
                &[],
            ),
            input,
            120,
            true,
        )
        .await;
    let (class, message, exit) = run(&c, hungry).await;
    assert_eq!((class, exit), (2, 0), "a new shape measures its baseline on the largest class");
    assert!(!message.contains("retried"), "{message}");
    let (class, message, exit) = run(&c, hungry).await;
    assert_eq!((class, exit), (2, 0), "the second run tries class 1, fails there and is retried on class 2");
    assert!(message.contains("retried on size class 2"), "the retry is reported: {message}");
    // With cgroups the kernel OOM-kills it on class 1, and the worker says so; under
    // RLIMIT_AS its allocation fails, an ordinary failure.
    if gantry_worker::cgroup::detect().is_ok() {
        assert!(message.contains("ran out of memory on size class 1"), "a resource failure: {message}");
    }
    for _ in 0..3 {
        let (class, message, _) = run(&c, hungry).await;
        assert_eq!(class, 2, "then it goes to class 2 directly");
        assert!(!message.contains("retried"), "{message}");
    }
    assert!(metric(&server.http, "gantry_sizeclass_retries_total{from_class=\"1\"}") >= 1.0);

    // Single-threaded and small: class 1 is as fast, so it settles there. Class 1 may take
    // 2^0.1 = 1.072x class 2's time: 0.5 s leaves 36 ms for the start-up noise of a loaded
    // machine (0.2 s left 14 ms, and it failed once on this machine).
    let small = c.action(command(&["/bin/sh", "-c", "sleep 0.5"], &[], &[]), input, 120, true).await;
    let mut classes = Vec::new();
    for _ in 0..10 {
        classes.push(run(&c, small).await.0);
    }
    eprintln!("small action ran on classes {classes:?}");
    let last: Vec<u32> = classes[5..].to_vec();
    assert!(last.iter().filter(|&&c| c == 1).count() >= 4, "settled on class 1: {classes:?}");
    assert!(metric(&server.http, "gantry_sizeclass_selections_total{class=\"1\"") >= 4.0);

    // Parallel: it sleeps 0.8 s divided by the CPUs it is pinned to, so class 1 (one CPU)
    // is twice as slow as class 2, beyond the acceptable 0.4 s x 2^0.1. Its run there is
    // hedged on class 2 at the hedge time; it settles on 2.
    let parallel = c
        .action(
            command(
                &["/usr/bin/python3", "-c", "import os, time; time.sleep(0.8 / len(os.sched_getaffinity(0)))"],
                &[],
                &[],
            ),
            input,
            120,
            true,
        )
        .await;
    let mut classes = Vec::new();
    for _ in 0..10 {
        classes.push(run(&c, parallel).await.0);
    }
    eprintln!("parallel action ran on classes {classes:?}");
    assert!(classes[5..].iter().filter(|&&c| c == 2).count() >= 4, "settled on class 2: {classes:?}");
    server.stop();

    // After a restart the learned statistics are still there.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gantry"))
        .args(["sizeclass", "stats", "--config", cfg.to_str().unwrap(), "--data-dir"])
        .arg(&data)
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success() && listing.lines().count() >= 2, "{listing}");
    let server = GantryServer::start(&data, &["--config", cfg.to_str().unwrap()]);
    let c = Client::connect(&server.grpc).await;
    let (class, message, _) = run(&c, hungry).await;
    assert_eq!(class, 2, "the memory-hungry action goes straight to class 2 after the restart");
    assert!(!message.contains("retried"), "{message}");
    server.stop();
}

/// Whether a process is gone (or a zombie waiting to be reaped, which runs nothing).
fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_run_on_class_1_is_hedged_on_class_2_and_the_loser_is_killed() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("gantry.toml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let server = GantryServer::start(&tmp.path().join("data"), &["--config", cfg.to_str().unwrap()]);
    let c = Client::connect(&server.grpc).await;
    let input = c.tree(&Default::default()).await;

    // Fast on two CPUs (class 2). On one CPU (class 1) it starts a child in its process
    // group, says where, and then takes a minute.
    let pid_file = tmp.path().join("child.pid");
    let script = r#"
import os, subprocess, sys, time
if len(os.sched_getaffinity(0)) == 1:
    child = subprocess.Popen(["sleep", "300"])
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(child.pid))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(60)
else:
    time.sleep(0.5)
"#;
    let slow = c
        .action(command(&["/usr/bin/python3", "-c", script, pid_file.to_str().unwrap()], &[], &[]), input, 120, true)
        .await;
    let (class, message, _) = run(&c, slow).await;
    assert_eq!(class, 2, "a new shape measures its baseline on the largest class: {message}");

    // Next it explores class 1 (untried, so guessed as fast), with a hedge after about
    // 0.5 s x 2^0.1 x 1.2. The copy on class 2 wins long before the minute is up.
    let started = std::time::Instant::now();
    let (_, _, resp) = c.execute(slow, true).await;
    let took = started.elapsed();
    assert_eq!(resp.status.as_ref().map_or(0, |s| s.code), 0, "{:?}", resp.status);
    let result = resp.result.expect("one result");
    assert_eq!(result.exit_code, 0);
    let worker = result.execution_metadata.unwrap().worker;
    assert!(worker.ends_with("-local-1"), "the copy on class 2 won: {worker}; {}", resp.message);
    assert!(resp.message.contains("still running for size class 1"), "{}", resp.message);
    assert!(resp.message.contains("hedged on size class 2"), "{}", resp.message);
    assert!(resp.message.contains("finished first; the run on size class 1 was cancelled"), "{}", resp.message);
    assert!(took < std::time::Duration::from_secs(30), "the client did not wait for the slow run: {took:?}");
    assert!(metric(&server.http, "gantry_sizeclass_hedges_total{from_class=\"1\",kind=\"copy\"}") >= 1.0);

    // The loser's whole process group is killed, its child included.
    let pid: i32 = std::fs::read_to_string(&pid_file).expect("the run on class 1 started").trim().parse().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !gone(pid) && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(gone(pid), "the cancelled run's child {pid} still runs");

    // Class 1 is free again: the loser's slot came back when its worker reported it.
    let quick = c.action(command(&["/bin/true"], &[], &[]), input, 120, true).await;
    for _ in 0..3 {
        run(&c, quick).await;
    }
    server.stop();
}
