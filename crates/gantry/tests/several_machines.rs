//! gantry across machines, with real Bazel 4.2.3, real `gantry` processes and a real
//! PostgreSQL started by the test:
//!
//! - two frontends and one scheduler share one PostgreSQL metadata database and one CAS
//!   directory: a build through frontend A runs on the scheduler's workers, and after
//!   `bazel clean` the rebuild through frontend B is all remote cache hits;
//! - two servers share one S3 bucket (a real S3-compatible server) and one PostgreSQL
//!   database but not their local tiers: after `bazel clean`, the rebuild through the
//!   second is all remote cache hits with byte-identical outputs;
//! - the scheduler is SIGKILLed in the middle of a build and restarted on the same
//!   address: the same `bazel build` finishes with exit 0 and correct outputs, its
//!   worker having reconnected by itself.

mod common;

use common::output_text as text;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{free_addr, process_summary, BazelWorkspace, GantryServer, WorkerProcess};
use gantry_testkit::{PgServer, S3Server, S3_KEY_ID, S3_SECRET_KEY};

#[test]
fn two_frontends_and_a_scheduler_on_postgres_share_one_cache() {
    let Some(pg) = PgServer::start() else { return };
    let url = pg.create_database("gantry");
    let tmp = tempfile::tempdir().unwrap();
    let cas = tmp.path().join("shared-cas");
    let common = format!("[metadata]\nurl = \"{url}\"\n\n[cas]\nkind = \"fs\"\npath = \"{}\"\n", cas.display());

    let sched_cfg = common::write_file(tmp.path(), "scheduler.toml", &format!("{common}\n[execution]\nworkers = 2\n"));
    let scheduler = GantryServer::start(&tmp.path().join("s"), &["--config", &sched_cfg]);
    let front_cfg = common::write_file(
        tmp.path(),
        "frontend.toml",
        &format!("{common}\n[execution]\nscheduler = \"grpc://{}\"\n", scheduler.grpc),
    );
    let a = GantryServer::start(&tmp.path().join("a"), &["--config", &front_cfg]);
    let b = GantryServer::start(&tmp.path().join("b"), &["--config", &front_cfg]);

    let ws = BazelWorkspace::new();
    let via = |front: &GantryServer| {
        vec![
            format!("--remote_executor=grpc://{}", front.grpc),
            "--remote_timeout=120".to_string(),
            "//...".to_string(),
        ]
    };
    let out = ws.bazel_with_strategy("test", &via(&a), "remote");
    assert!(out.status.success(), "build through frontend A failed:\n{}", text(&out));
    let summary = process_summary(&String::from_utf8_lossy(&out.stderr));
    let remote = summary.iter().find(|(k, _)| k == "remote").map_or(0, |(_, n)| *n);
    assert!(remote >= 7, "the genrules and the test ran remotely: {summary:?}");
    assert!(summary.iter().all(|(k, _)| k == "remote" || k == "internal"), "nothing ran locally: {summary:?}");
    // They ran on the scheduler's workers: its execution log (in PostgreSQL) has them.
    let executed: i64 = pg.psql("gantry", "SELECT COUNT(*) FROM action_executions").parse().unwrap();
    assert!(executed >= remote as i64, "{executed} executions recorded for {remote} remote actions");
    let worker_ids = pg.psql("gantry", "SELECT DISTINCT worker FROM action_executions");
    assert!(
        worker_ids.lines().all(|w| w.contains("-local-")),
        "ran on the scheduler's in-process workers: {worker_ids}"
    );
    assert_eq!(
        pg.psql("gantry", "SELECT MAX(version) FROM _sqlx_migrations"),
        gantry_store::MetadataDb::latest_version().to_string()
    );

    assert!(ws.bazel("clean", &[]).status.success());
    // The rebuild's lookups go to B and its build events to A: A's invocation page counts
    // B's hits (each frontend records its counts in the shared metadata database).
    let invocation = uuid::Uuid::new_v4().to_string();
    let mut flags = via(&b);
    flags.push(format!("--bes_backend=grpc://{}", a.grpc));
    flags.push(format!("--invocation_id={invocation}"));
    let out = ws.bazel_with_strategy("test", &flags, "remote");
    assert!(out.status.success(), "rebuild through frontend B failed:\n{}", text(&out));
    assert_all_cache_hits(&out, remote);
    // "Remote cache hits: H of L (…%)" on A's page, once B's flush has arrived.
    let counted = |page: &str| -> Option<(u64, u64)> {
        let rest = page.split("Remote cache hits: ").nth(1)?;
        let mut words = rest.split_whitespace();
        let hits = words.next()?.parse().ok()?;
        (words.next()? == "of").then_some(())?;
        Some((hits, words.next()?.parse().ok()?))
    };
    let start = std::time::Instant::now();
    let (hits, lookups) = loop {
        let page = common::http_get(&a.http, &format!("/invocations/{invocation}"));
        match counted(&page) {
            Some((h, l)) if h >= remote => break (h, l),
            _ if start.elapsed() > std::time::Duration::from_secs(20) => panic!("A's page lacks B's hits: {page}"),
            _ => std::thread::sleep(std::time::Duration::from_millis(250)),
        }
    };
    assert_eq!(hits, lookups, "every lookup of the rebuild was a hit");
    let big = std::fs::metadata(ws.bin().join("big.txt")).unwrap();
    assert!(big.len() > 4 << 20, "outputs downloaded through B");

    b.stop();
    a.stop();
    scheduler.stop();
}

/// Every action of a rebuild was a remote cache hit, at least `remote` of them.
fn assert_all_cache_hits(out: &std::process::Output, remote: u64) {
    let summary = process_summary(&String::from_utf8_lossy(&out.stderr));
    assert!(
        summary.iter().all(|(k, _)| k == "remote cache hit" || k == "internal"),
        "every action a cache hit: {summary:?}"
    );
    assert!(summary.iter().any(|(k, n)| k == "remote cache hit" && *n >= remote), "{summary:?}");
}

/// Every file under `dir` (relative path -> bytes).
fn tree(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.is_file() {
                out.insert(p.strip_prefix(dir).unwrap().display().to_string(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

#[test]
fn two_servers_share_an_s3_bucket_and_postgres_not_their_tiers() {
    let Some(pg) = PgServer::start() else { return };
    let Some(s3) = S3Server::start() else { return };
    let url = pg.create_database("gantry");
    s3.create_bucket("gantry-cas");
    let tmp = tempfile::tempdir().unwrap();
    // Each server's tier lives under its own data dir ({data_dir}/cas-local).
    let cfg = common::write_file(
        tmp.path(),
        "gantry.toml",
        &format!(
            "[metadata]\nurl = \"{url}\"\n\n[cas]\nkind = \"s3\"\nbucket = \"gantry-cas\"\nendpoint = \"{}\"\nprefix = \"cas/\"\n\
             [cas.local]\nmax_size = \"1GiB\"\n\n[execution]\nworkers = 2\n\n[batch]\nrunners = 0\n",
            s3.endpoint()
        ),
    );
    let env = [("AWS_ACCESS_KEY_ID", S3_KEY_ID), ("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)];
    let a = GantryServer::start_env(&tmp.path().join("a"), &["--config", &cfg], &env);
    let b = GantryServer::start_env(&tmp.path().join("b"), &["--config", &cfg], &env);

    let ws = BazelWorkspace::new();
    let via = |s: &GantryServer| {
        vec![format!("--remote_executor=grpc://{}", s.grpc), "--remote_timeout=120".to_string(), "//...".to_string()]
    };
    let out = ws.bazel_with_strategy("build", &via(&a), "remote");
    assert!(out.status.success(), "build through A failed:\n{}", text(&out));
    let summary = process_summary(&String::from_utf8_lossy(&out.stderr));
    let remote = summary.iter().find(|(k, _)| k == "remote").map_or(0, |(_, n)| *n);
    assert!(remote >= 6, "the genrules ran remotely: {summary:?}");
    let first = tree(&ws.bin());
    assert!(first.get("big.txt").is_some_and(|b| b.len() == 5_550_000), "{:?}", first.keys().collect::<Vec<_>>());
    let objects = s3.list("gantry-cas");
    assert!(
        objects.iter().filter(|k| k.starts_with("cas/sha256/")).count() >= remote as usize,
        "the outputs are in the bucket: {objects:?}"
    );
    // B's tier holds no blob yet: what it serves must come from the bucket.
    let tier_blobs = |s: &str| {
        let dir = tmp.path().join(s).join("cas-local/sha256");
        if dir.exists() {
            tree(&dir).len()
        } else {
            0
        }
    };
    // A tier's files are written once its writes have paused (the CAS journal's placer).
    let eventually = |ok: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        while !ok() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        ok()
    };
    assert!(eventually(&|| tier_blobs("a") >= remote as usize), "A kept its uploads in its own tier");
    assert_eq!(tier_blobs("b"), 0);

    assert!(ws.bazel("clean", &[]).status.success());
    let out = ws.bazel_with_strategy("build", &via(&b), "remote");
    assert!(out.status.success(), "rebuild through B failed:\n{}", text(&out));
    assert_all_cache_hits(&out, remote);
    assert!(tree(&ws.bin()) == first, "outputs through B are byte-identical to those built through A");
    assert!(eventually(&|| tier_blobs("b") > 0), "B filled its own tier from the bucket");
    b.stop();
    a.stop();
}

/// A chain of slow genrules; the first announces that it started by creating a file in
/// `marker_dir`, so the test knows the build is mid-action.
fn write_slow_package(ws: &Path, marker_dir: &Path) {
    let dir = ws.join("slow");
    std::fs::create_dir_all(&dir).unwrap();
    let mut build = String::new();
    for i in 0..4 {
        let (srcs, cat) = if i == 0 {
            (String::new(), String::new())
        } else {
            (format!("    srcs = [\":s{}\"],\n", i - 1), "cat $(SRCS) > $@; ".to_string())
        };
        let mark = format!("touch {}/started-{i}-$$$$; ", marker_dir.display());
        build.push_str(&format!(
            "genrule(\n    name = \"s{i}\",\n{srcs}    outs = [\"s{i}.txt\"],\n    cmd = \"{mark}sleep 2; {cat}echo step {i} >> $@\",\n)\n\n"
        ));
    }
    std::fs::write(dir.join("BUILD"), build).unwrap();
}

/// An output file of the workspace's last build, under bazel-out/*/bin.
fn output(ws: &BazelWorkspace, rel: &str) -> std::path::PathBuf {
    let out = ws.dir.path().join("base/execroot/gantry_fixture/bazel-out");
    std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path().join("bin").join(rel))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no {rel} under {}", out.display()))
}

#[test]
fn scheduler_sigkill_mid_build_is_invisible_to_bazel() {
    let tmp = tempfile::tempdir().unwrap();
    let markers = tmp.path().join("markers");
    std::fs::create_dir_all(&markers).unwrap();
    let data = tmp.path().join("scheduler");
    // No in-process workers: the one worker is a separate process that must reconnect.
    let cfg = common::write_file(tmp.path(), "scheduler.toml", "[execution]\nworkers = 0\n");
    let addr = free_addr();
    let scheduler = GantryServer::start_at(&addr, &data, &["--config", &cfg]);
    let _worker = WorkerProcess::start(&addr, &tmp.path().join("worker"), 2);

    let ws = BazelWorkspace::new();
    write_slow_package(&ws.ws(), &markers);
    let flags =
        vec![format!("--remote_executor=grpc://{addr}"), "--remote_timeout=120".to_string(), "//slow:s3".to_string()];
    let build = std::thread::scope(|s| {
        let h = s.spawn(|| ws.bazel_with_strategy("build", &flags, "remote"));
        // Wait until the first action is running on the worker, then crash the scheduler.
        let start = Instant::now();
        while std::fs::read_dir(&markers).unwrap().count() == 0 {
            assert!(start.elapsed() < Duration::from_secs(120), "the first action never started");
            assert!(!h.is_finished(), "bazel ended before the first action started");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(300));
        scheduler.kill9();
        eprintln!("---- scheduler SIGKILLed mid-action; restarting it on {addr}");
        // A supervisor restarts it at once (systemd's Restart=always). Bazel's default
        // five retries back off 0.1 s, 0.2 s, ... 1.6 s: about 3 s in all, the window the
        // scheduler has to be back in (README, Running on several machines).
        std::thread::sleep(Duration::from_millis(100));
        let restarted = GantryServer::start_at(&addr, &data, &["--config", &cfg]);
        let out = h.join().unwrap();
        (out, restarted)
    });
    let (out, restarted) = build;
    assert!(out.status.success(), "the same bazel invocation must finish after the restart:\n{}", text(&out));
    let result = std::fs::read_to_string(output(&ws, "slow/s3.txt")).unwrap();
    assert_eq!(result, "step 0\nstep 1\nstep 2\nstep 3\n", "outputs are correct");
    let first_runs = std::fs::read_dir(&markers)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("started-0-"))
        .count();
    assert!(first_runs >= 2, "the interrupted action ran again on the restarted scheduler ({first_runs} runs)");
    restarted.stop();
}
