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

    // Needs ~200 MB: over class 1's 150 MiB, under class 2's 300 MiB.
    let hungry = c
        .action(
            command(&["/usr/bin/python3", "-c", "b = bytearray(200_000_000); print(len(b))"], &[], &[]),
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

    // Single-threaded and small: class 1 is as fast, so it settles there.
    let small = c.action(command(&["/bin/sh", "-c", "sleep 0.2"], &[], &[]), input, 120, true).await;
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
    // stopped at the hedge time and retried on class 2; it settles on 2.
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
