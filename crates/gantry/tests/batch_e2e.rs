//! The batching service end to end with real Bazel: a generated workspace whose full
//! build runs out of Bazel's (deliberately small) heap, a bootstrap of small batches to
//! collect history, training on the live history, and one more pass over all targets
//! planned by the learned models.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use common::batch::{gantry, stream_builds};
use common::batch_workspace::{generate, Shape};
use common::{fixture_flags, toml_list, GantryServer};
use serde_json::Value;

/// Bazel's heap for every build: with it, ~1,000 trivial genrules build and ~2,000 run
/// out of memory on Bazel 4.2.3 (measured), so the ~2,200 of the workspace cannot be
/// one build.
const HEAP: &str = "32MiB";

/// `gantry batch --wait --json`: enqueue, follow to the end; returns the stream id.
fn enqueue_and_wait(server: &str, ws: &std::path::Path, targets: &std::path::Path) -> (String, bool) {
    let out = gantry()
        .args(["batch", "--server", server, "--command", "test", "--json", "--wait", "--workspace"])
        .arg(ws)
        .arg("--targets")
        .arg(targets)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stream = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find_map(|v| v["stream_id"].as_str().map(str::to_string))
        .unwrap_or_else(|| panic!("no stream id in {stdout}"));
    (stream, out.status.success())
}

fn labels(b: &Value) -> Vec<String> {
    b["targets"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect()
}

struct Numbers {
    builds: usize,
    planned: usize,
    ooms: usize,
    retries: usize,
    mean_targets: f64,
    wall_s: f64,
}

/// The invariants every stream must satisfy, and its numbers.
fn check_stream(
    builds: &BTreeMap<String, Value>,
    all: &HashSet<String>,
    gpu: &HashSet<String>,
    wall_s: f64,
) -> Numbers {
    assert!(builds.values().all(|b| b["state"] == "DONE"), "watch ended before every build was done");
    // Every target exactly once across successful builds.
    let mut built: HashMap<String, usize> = HashMap::new();
    for b in builds.values().filter(|b| b["outcome"] == "SUCCESS") {
        for l in labels(b) {
            *built.entry(l).or_default() += 1;
        }
    }
    let missing: Vec<_> = all.iter().filter(|l| !built.contains_key(*l)).collect();
    assert!(missing.is_empty(), "targets never built successfully: {missing:?}");
    let twice: Vec<_> = built.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "targets built more than once: {twice:?}");
    assert_eq!(built.len(), all.len());
    for b in builds.values() {
        let ls = labels(b);
        let g = ls.iter().filter(|l| gpu.contains(*l)).count();
        assert!(g == 0 || g == ls.len(), "build {} mixes requires-gpu and untagged targets: {ls:?}", b["build_id"]);
        if g > 0 {
            assert!(b["executor_types"].as_array().unwrap().iter().any(|t| t == "gpu"), "{b}");
        }
        match b["outcome"].as_str().unwrap() {
            "OOM" if ls.len() > 1 => {
                // Split in half, each half planned again, and every piece accounted for.
                let kids: Vec<&Value> =
                    b["retry_build_ids"].as_array().unwrap().iter().map(|id| &builds[id.as_str().unwrap()]).collect();
                assert!(kids.len() >= 2, "OOM build {} was not split: {b}", b["build_id"]);
                let mut got: Vec<String> = kids.iter().flat_map(|k| labels(k)).collect();
                got.sort();
                let mut want = ls.clone();
                want.sort();
                assert_eq!(got, want, "the halves of {} hold exactly its targets", b["build_id"]);
                assert!(kids.iter().all(|k| k["retry_kind"] == "OOM_SPLIT" && k["parent_build_id"] == b["build_id"]));
            }
            "SUCCESS" => {
                assert!(b["used_heap_post_build_bytes"].as_u64().is_some(), "success without a heap label: {b}");
                assert!(b["server_vm_hwm_bytes"].as_u64().is_some(), "success without the server's peak RSS: {b}");
            }
            "OOM" => {}
            "DEADLINE_EXCEEDED" => {
                // A server that hung outside GC (quiet: no full GC in the watch's last
                // window) is not what these tests are about, and Bazel 4.2.3 under these
                // heaps did it once in CI (2026-11-29); the batcher must still run the
                // build once more as it was. One stuck in GC at its deadline is a miss.
                let m = b["message"].as_str().unwrap();
                assert!(m.contains(" did 0 full GCs"), "build {} reached its deadline in GC: {m}", b["build_id"]);
                let kids = b["retry_build_ids"].as_array().unwrap();
                assert_eq!(kids.len(), 1, "deadline build {} is rerun once: {b}", b["build_id"]);
                let kid = &builds[kids[0].as_str().unwrap()];
                assert_eq!(kid["retry_kind"], "DEADLINE_RERUN", "{kid}");
                assert_eq!(labels(kid), ls, "the rerun of {} is the same build", b["build_id"]);
                eprintln!("RESULT build {} hung outside GC, rerun as {}: {m}", b["build_id"], kid["build_id"]);
            }
            other => panic!("build {} ended {other}: {}", b["build_id"], b["message"]),
        }
    }
    let planned = builds.values().filter(|b| b["parent_build_id"] == "").count();
    Numbers {
        builds: builds.len(),
        planned,
        ooms: builds.values().filter(|b| b["outcome"] == "OOM").count(),
        retries: builds.len() - planned,
        mean_targets: all.len() as f64 / builds.values().filter(|b| b["outcome"] == "SUCCESS").count() as f64,
        wall_s,
    }
}

/// How well one memory measurement separates OOM builds from the rest: the share of
/// (OOM, non-OOM) pairs where the OOM build measured higher (ROC AUC; ties count half),
/// and the share of builds that have the measurement at all.
fn separation(builds: &[&Value], field: &str) -> (f64, f64) {
    let val = |b: &Value| b[field].as_u64();
    let present = builds.iter().filter(|b| val(b).is_some()).count() as f64 / builds.len() as f64;
    let oom: Vec<u64> = builds.iter().filter(|b| b["outcome"] == "OOM").filter_map(|b| val(b)).collect();
    let ok: Vec<u64> = builds.iter().filter(|b| b["outcome"] != "OOM").filter_map(|b| val(b)).collect();
    let ooms = builds.iter().filter(|b| b["outcome"] == "OOM").count();
    let mut wins = 0.0;
    for &o in &oom {
        for &k in &ok {
            wins += if o > k {
                1.0
            } else if o == k {
                0.5
            } else {
                0.0
            };
        }
    }
    // An OOM build without the measurement cannot be told apart: it counts as a coin toss.
    let missing = (ooms - oom.len()) as f64 * ok.len() as f64 * 0.5;
    let pairs = ooms as f64 * ok.len() as f64;
    (if pairs > 0.0 { (wins + missing) / pairs } else { f64::NAN }, present)
}

/// Pearson correlation between a measurement and the build's genrule count (what makes
/// Bazel's heap grow here), over the builds that have the measurement.
fn correlation(builds: &[&Value], field: &str, genrules: &HashMap<String, usize>) -> f64 {
    let pts: Vec<(f64, f64)> = builds
        .iter()
        .filter_map(|b| Some((labels(b).iter().map(|l| genrules[l] as f64).sum::<f64>(), b[field].as_u64()? as f64)))
        .collect();
    let n = pts.len() as f64;
    let (mx, my) = (pts.iter().map(|p| p.0).sum::<f64>() / n, pts.iter().map(|p| p.1).sum::<f64>() / n);
    let cov: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let (vx, vy): (f64, f64) =
        (pts.iter().map(|p| (p.0 - mx).powi(2)).sum(), pts.iter().map(|p| (p.1 - my).powi(2)).sum());
    cov / (vx * vy).sqrt()
}

#[test]
fn bootstrap_train_and_batch_with_real_bazel() {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    let shape = Shape {
        heavy_packages: 4,
        heavy_per_package: 4,
        fan_out: 120,
        light_packages: 10,
        light_per_package: 25,
        tests: 9,
        gpu_tests: 3,
    };
    let targets = generate(&ws, &shape);
    let genrules: usize = targets.iter().map(|t| t.genrules).sum();
    eprintln!("workspace: {} targets, {genrules} genrules", targets.len());
    let all: HashSet<String> = targets.iter().map(|t| t.label.clone()).collect();
    let gpu: HashSet<String> = targets.iter().filter(|t| t.gpu).map(|t| t.label.clone()).collect();
    let targets_file = dir.path().join("targets.txt");
    std::fs::write(&targets_file, targets.iter().map(|t| t.line() + "\n").collect::<String>()).unwrap();

    let bootstrap_batch = 8;
    let config = dir.path().join("gantry.toml");
    std::fs::write(
        &config,
        format!(
            "[batch]\nrunners = 2\nbazel_memory = \"{HEAP}\"\nmemory_cutoff_high = \"26MiB\"\nmemory_cutoff_medium = \"26MiB\"\nmemory_cutoff_low = \"26MiB\"\n\
             fallback_batch_size = {bootstrap_batch}\nmin_history_builds = 10\nretrain_interval = \"0s\"\ndeadline = \"5m\"\n\
             startup_flags = [\"--nohome_rc\", \"--noworkspace_rc\", \"--max_idle_secs=120\"]\nextra_flags = {}\n\
             [execution]\nworkers = 2\n",
            toml_list(&fixture_flags())
        ),
    )
    .unwrap();
    let data = dir.path().join("data");
    let server = GantryServer::start(&data, &["--config", config.to_str().unwrap()]);
    let url = format!("grpc://{}", server.grpc);

    // Training before there is any history is refused, with the reason.
    let out = gantry().args(["model", "train", "--server", &url]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("min_history_builds"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // 1. Bootstrap: no models, every build has the fallback size.
    let t = Instant::now();
    let (boot_stream, ok) = enqueue_and_wait(&url, &ws, &targets_file);
    assert!(ok, "bootstrap stream did not build every target");
    let boot = stream_builds(&url, &boot_stream);
    let b = check_stream(&boot, &all, &gpu, t.elapsed().as_secs_f64());
    for v in boot.values().filter(|v| v["parent_build_id"] == "") {
        assert_eq!(v["reason"], "MEMORY_ESTIMATE_ERROR", "{v}");
        assert!(v["reason_note"].as_str().unwrap().contains("no models yet"), "{v}");
        assert!(labels(v).len() <= bootstrap_batch);
    }

    // 2. Train on the live history; the planner swaps to the models.
    let out = gantry().args(["model", "train", "--server", &url]).output().unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success());
    let hist = gantry()
        .args(["model", "export-history", "--config", config.to_str().unwrap(), "--data-dir"])
        .arg(&data)
        .output()
        .unwrap();
    assert!(hist.status.success(), "{}", String::from_utf8_lossy(&hist.stderr));
    let records: Vec<Value> =
        String::from_utf8_lossy(&hist.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(records.len(), boot.len(), "every bootstrap build is in the history");
    assert!(records.iter().all(|r| r["peak_memory_bytes"].as_u64().unwrap() > 0));

    // 3. All targets once more, planned by the models.
    let t = Instant::now();
    let (stream, ok) = enqueue_and_wait(&url, &ws, &targets_file);
    assert!(ok, "second stream did not build every target");
    let second = stream_builds(&url, &stream);
    let m = check_stream(&second, &all, &gpu, t.elapsed().as_secs_f64());
    assert!(
        second
            .values()
            .any(|v| v["reason"] != "MEMORY_ESTIMATE_ERROR" && v["memory_estimate_bytes"].as_u64().is_some()),
        "the second stream was planned by the models"
    );
    assert!(m.builds < b.builds, "models made {} builds, the bootstrap size {}", m.builds, b.builds);
    // The planner's OOM probability needs a model with a held-out error (30 held-out
    // builds, more than this history has); without models there is none.
    for v in second.values().filter(|v| !v["oom_probability"].is_null()) {
        assert!((0.0..=1.0).contains(&v["oom_probability"].as_f64().unwrap()), "{v}");
    }
    assert!(boot.values().all(|v| v["oom_probability"].is_null()), "no models, no probability");

    for (name, n) in [("bootstrap", &b), ("models", &m)] {
        eprintln!(
            "RESULT {name}: {} builds ({} planned, {} retries), {} OOM, {:.1} targets per successful build, {:.1}s",
            n.builds, n.planned, n.retries, n.ooms, n.mean_targets, n.wall_s
        );
    }
    let every: Vec<&Value> = boot.values().chain(second.values()).collect();
    let weight: HashMap<String, usize> = targets.iter().map(|t| (t.label.clone(), t.genrules)).collect();
    let finished_ok: Vec<&Value> = every.iter().copied().filter(|b| b["outcome"] == "SUCCESS").collect();
    for field in ["used_heap_post_build_bytes", "peak_post_gc_heap_bytes", "server_vm_hwm_bytes"] {
        let (auc, present) = separation(&every, field);
        let r = correlation(&finished_ok, field, &weight);
        eprintln!(
            "RESULT label {field}: present in {:.0}% of builds; OOM separation AUC {auc:.3}; correlation with genrules per successful build r={r:.3}",
            present * 100.0
        );
    }
    let listing = gantry().args(["builds", "--server", &url, "--stream", &stream]).output().unwrap();
    eprintln!("{}", String::from_utf8_lossy(&listing.stdout));

    // The batching pages, as a person sees them: the builds with their estimates and the
    // models' error, and one build: a retried one (its retry tree) when there is one.
    let shown = every
        .iter()
        .copied()
        .find(|v| v["retry_build_ids"].as_array().is_some_and(|r| !r.is_empty()))
        .or_else(|| second.values().find(|v| v["memory_estimate_bytes"].as_u64().is_some()))
        .expect("a build to look at");
    let id = shown["build_id"].as_str().unwrap();
    let newest = &stream[..stream.len().min(40)];
    common::browser::look_at(
        &server.http,
        &[
            (
                "/batching",
                "batching",
                &["Batched builds", newest, "Estimate error", "Memory: estimate against actual"][..],
            ),
            (format!("/batching/builds/{id}").as_str(), "batching-build", &[id, "Retry tree", "Targets ("][..]),
        ],
    );
    server.stop();
}

/// A Bazel stuck in GC: the 16 targets of fan-out 120 (1,920 genrules) as one build under
/// a 24 MiB heap. Calibrated on this project's 2-core machine (Debian's Bazel 4.2.3 on
/// OpenJDK 17, G1, `RUNNER_FLAGS` with `--experimental_oom_more_eagerly_threshold=90`,
/// two in-process executor workers). Of 14 streams run alone, the whole-set build hung
/// in back-to-back full GCs at 21 of 24 MiB (87%, under Bazel's 90%) in 9, exited 33
/// after 21-22 s in 2, died of OutOfMemoryError (exit 37) in 2 and idled after one in 1
/// (stopped as oom_error_in_log); a half of 8 targets hung in GC in 1 more: 10 of 14
/// streams had a GC hang, and 4 of 8 run alongside the other test of this file. Each
/// hung build was classified OOM 30-41 s after it stopped progressing (the 30 s window,
/// the 10 s kill grace), 48-64 s after it started (58-93 s alongside). Fan-out 110 hung
/// 3 times in 4; 130 never (4 of 4 servers died of OutOfMemoryError within 30 s).
/// Without the eager threshold (=100) 3 of 4 streams hung in GC too. With the threshold
/// the test hung in only 1 of 4 attempts on 2026-11-24, so it now turns the eager exit
/// off (`stuck_flags`): then 4 of 4 streams hung in GC on their first attempt, each
/// classified OOM 39.3-40.0 s after it got stuck (7 stuck builds, 5 in GC). A stream
/// without a GC hang proves nothing here, so the test tries again on a fresh server:
/// even at 1 in 2 per stream, 8 attempts fail about once in 250 runs.
///
/// Since 2026-11-29 the runner starts every server with `-XX:+ExitOnOutOfMemoryError`
/// (one server sat quiet, no GC, from 78 s to its deadline in CI). With it, 2 of 2 streams
/// had no GC hang: the whole-set build's JVM ended at an OutOfMemoryError 36-113 s in
/// (oom_error_in_log). So the test turns that off as well (`STUCK_STARTUP`), as on a JVM
/// that spirals without throwing; the watch is for that case.
const STUCK_HEAP: &str = "24MiB";
const STUCK_FAN_OUT: usize = 120;
const STUCK_ATTEMPTS: usize = 8;
/// The runner's exit at the first OutOfMemoryError turned off (the JVM takes the last).
const STUCK_STARTUP: &str = "--host_jvm_args=-XX:-ExitOnOutOfMemoryError";

/// The fixture's flags, and Bazel's eager OOM exit turned off (this comes after the
/// runner's own `=90`, so it wins): a server that would exit 33 at 90% then hangs in GC
/// too, as it does on a Bazel or JVM where the eager exit does not catch.
fn stuck_flags() -> Vec<String> {
    let mut flags = fixture_flags();
    flags.push("--experimental_oom_more_eagerly_threshold=100".into());
    flags
}

/// Seconds into the build at which the runner found it stuck, from its message ("...
/// stuck in garbage collection since 41.3s into the build ...").
fn stuck_since(message: &str) -> f64 {
    let rest = message.split_once(" since ").unwrap_or_else(|| panic!("no onset in {message:?}")).1;
    rest.split_once("s into the build")
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("no onset in {message:?}"))
}

/// One stream of the whole target set on a fresh server (a cold Bazel, as calibrated);
/// every target ends built once, through OOM splits; returns the stream's builds and
/// the `gantry builds` table.
fn stuck_stream() -> (BTreeMap<String, Value>, String) {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    let shape = Shape {
        heavy_packages: 4,
        heavy_per_package: 4,
        fan_out: STUCK_FAN_OUT,
        light_packages: 0,
        light_per_package: 0,
        tests: 0,
        gpu_tests: 0,
    };
    let targets = generate(&ws, &shape);
    let all: HashSet<String> = targets.iter().map(|t| t.label.clone()).collect();
    let targets_file = dir.path().join("targets.txt");
    std::fs::write(&targets_file, targets.iter().map(|t| t.line() + "\n").collect::<String>()).unwrap();
    // No models: the fallback size puts every target in the first build. The deadline is
    // far beyond any real build here (140 s at most); only the GC watch can stop a build
    // stuck in GC early.
    let config = dir.path().join("gantry.toml");
    std::fs::write(
        &config,
        format!(
            "[batch]\nrunners = 1\nbazel_memory = \"{STUCK_HEAP}\"\nmemory_cutoff_high = \"{STUCK_HEAP}\"\nmemory_cutoff_medium = \"{STUCK_HEAP}\"\nmemory_cutoff_low = \"{STUCK_HEAP}\"\n\
             fallback_batch_size = {}\nretrain_interval = \"0s\"\ndeadline = \"5m\"\n\
             startup_flags = [\"--nohome_rc\", \"--noworkspace_rc\", \"--max_idle_secs=120\", \"{STUCK_STARTUP}\"]\nextra_flags = {}\n\
             [execution]\nworkers = 2\n",
            targets.len(),
            toml_list(&stuck_flags())
        ),
    )
    .unwrap();
    let server = GantryServer::start(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let url = format!("grpc://{}", server.grpc);
    let t = Instant::now();
    let (stream, ok) = enqueue_and_wait(&url, &ws, &targets_file);
    let builds = stream_builds(&url, &stream);
    let listing = gantry().args(["builds", "--server", &url, "--stream", &stream]).output().unwrap();
    let table = String::from_utf8_lossy(&listing.stdout).into_owned();
    eprintln!("{table}");
    assert!(ok, "the stream did not build every target");
    check_stream(&builds, &all, &HashSet::new(), t.elapsed().as_secs_f64());
    server.stop();
    (builds, table)
}

#[test]
fn a_bazel_stuck_in_gc_is_split_as_oom_long_before_its_deadline() {
    for attempt in 1..=STUCK_ATTEMPTS {
        let (builds, table) = stuck_stream();
        for b in builds.values() {
            let signal = b["oom_signal"].as_str().unwrap();
            // The signal is recorded exactly for OOM builds.
            assert_eq!(b["outcome"] == "OOM", !signal.is_empty(), "{b}");
            if b["outcome"] == "OOM" {
                assert!(["exit_33", "oom_error_in_log", "gc_spiral"].contains(&signal), "{b}");
            }
        }
        // Every build the runner stopped as stuck (in GC, or idle after an
        // OutOfMemoryError) was classified within a minute of getting stuck.
        for b in
            builds.values().filter(|b| b["message"].as_str().unwrap().starts_with("stopped: Bazel's server was stuck"))
        {
            let wall = b["wall_seconds"].as_f64().unwrap();
            let since = stuck_since(b["message"].as_str().unwrap());
            eprintln!(
                "RESULT attempt {attempt}: build {} stuck ({}) from {since:.1}s, classified OOM at {wall:.1}s",
                b["build_id"], b["oom_signal"]
            );
            // A spiral is caught within a minute of its start. A server stuck with a full
            // heap but quick full GCs (the starved form of the rule, seen in CI on
            // 2026-11-29) is caught once it has gone 4 windows (2 min) without progress.
            let limit = if b["message"].as_str().unwrap().contains("stuck with a full heap") { 150.0 } else { 60.0 };
            assert!(wall - since <= limit, "classified {:.1}s after it got stuck: {b}", wall - since);
            // Builds are slower when the other test of this file runs alongside (up to
            // 93 s then, against 48-64 s alone).
            assert!(wall < 300.0, "a 10 minute deadline, yet stopped only after {wall:.1}s: {b}");
            assert!(b["retry_build_ids"].as_array().unwrap().len() >= 2, "split: {b}");
        }
        if builds.values().any(|b| b["oom_signal"] == "gc_spiral") {
            assert!(table.contains("OOM:gc_spiral"), "the listing shows the signal:\n{table}");
            return;
        }
        let first = builds.values().find(|b| b["parent_build_id"] == "").unwrap();
        eprintln!(
            "RESULT attempt {attempt}: no build hung in GC (the whole set ended {} {}); trying a fresh server",
            first["outcome"], first["oom_signal"]
        );
    }
    panic!("no build hung in GC in {STUCK_ATTEMPTS} attempts: recalibrate STUCK_HEAP and STUCK_FAN_OUT");
}
