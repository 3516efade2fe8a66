//! The submit queue's less travelled paths, against a real `gantry serve`, real git and
//! Bazel's own `bazel query` for the conflict analysis, with `[queue] build_command` as
//! the build steps: a small shell script that fails a tree holding two markers together
//! and otherwise waits for a gate file per marker, so the test decides when each build
//! finishes and the order of events is deterministic.
//!
//! In order, on one server:
//! 1. the build command does not exist yet: the build is an infrastructure error, retried
//!    with the reason shown in `gantry queue status`, and the change lands once the script
//!    appears (it is never rejected for it);
//! 2. cancelling a pending change: CANCELLED, its build cancelled, never lands; an
//!    unknown id is NOT_FOUND, a decided change FAILED_PRECONDITION;
//! 3. two changes proven independent (disjoint packages) that break the build together,
//!    decided by concurrent builds on the same mainline version: the second to land fails
//!    the lander's combined-tree check and is rejected naming it; the mainline never has
//!    the failing tree; the change behind it, whose build assumed it, is re-planned by
//!    the planner on the real mainline and lands. On the way, a crash between recording
//!    the failed landing and journaling the planner's event is simulated (stop, remove
//!    the event, start): the startup applies it again.
//!
//! A second server runs with `[queue] batching` and one slot: a batch whose one move of
//! the mainline fails (the branch moved outside the queue) rejects every member. Others,
//! also batching on one slot, crash at each moment of a batch's landing
//! (`GANTRY_CRASH_AT`) and start again: the batch lands exactly once.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{fixture_flags, gantry, git, metric_value, toml_list, wait_metrics, GantryServer};
use gantry_proto::queue::v1 as pb;
use serde_json::Value;

fn queue_json(url: &str, args: &[&str]) -> Value {
    let out = gantry().arg("queue").args(args).args(["--json", "--server", url]).output().unwrap();
    assert!(out.status.success(), "gantry queue {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn change<'a>(h: &'a Value, id: &str) -> &'a Value {
    h["changes"].as_array().unwrap().iter().find(|c| c["change_id"] == id).unwrap_or_else(|| panic!("no {id} in {h:#}"))
}

fn builds(c: &Value) -> Vec<&Value> {
    c["builds"].as_array().unwrap().iter().collect()
}

fn assumed(b: &Value) -> Vec<&str> {
    b["assumed"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect()
}

/// Polls `gantry queue history` until `done` holds.
fn wait_history(url: &str, what: &str, limit: Duration, done: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        let h = queue_json(url, &["history"]);
        if done(&h) {
            return h;
        }
        assert!(start.elapsed() < limit, "{what}: not after {limit:?}: {h:#}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn state(h: &Value, id: &str) -> String {
    change(h, id)["state"].as_str().unwrap().to_string()
}

/// The build steps: a tree with a and b both ON fails; otherwise each marker it holds
/// waits for its gate, then it passes.
fn write_build_script(path: &Path, gates: &Path) {
    let g = gates.display();
    let script = format!(
        "#!/bin/sh\n\
         if grep -q ON a/value.txt && grep -q ON b/value.txt; then echo 'a and b are both ON' >&2; exit 1; fi\n\
         gate() {{ while [ ! -e '{g}'/\"$1\" ]; do sleep 0.1; done; }}\n\
         if grep -q ON a/value.txt; then gate go-a; fi\n\
         if grep -q ON b/value.txt; then gate go-b; fi\n\
         if grep -q edit b/other.txt; then gate go-z; fi\n\
         if grep -q edit d/value.txt; then gate go-d; fi\n\
         exit 0\n"
    );
    // Complete and executable before it appears under its name.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A workspace of four packages, each a filegroup of its files, and one branch per change.
fn generate_repo(dir: &Path, changes: &[(&str, &str, &str)]) {
    std::fs::create_dir_all(dir).unwrap();
    git(dir, &["init", "--quiet", "-b", "main"]);
    git(dir, &["config", "user.email", "dev@example.com"]);
    git(dir, &["config", "user.name", "dev"]);
    std::fs::write(dir.join("WORKSPACE"), "").unwrap();
    for p in ["a", "b", "c", "d"] {
        std::fs::create_dir_all(dir.join(p)).unwrap();
        std::fs::write(dir.join(p).join("value.txt"), format!("{p} off\n")).unwrap();
        std::fs::write(dir.join(p).join("other.txt"), format!("{p} other\n")).unwrap();
        std::fs::write(
            dir.join(p).join("BUILD"),
            format!("filegroup(\n    name = \"{p}\",\n    srcs = [\"value.txt\", \"other.txt\"],\n)\n"),
        )
        .unwrap();
    }
    git(dir, &["add", "."]);
    git(dir, &["commit", "--quiet", "-m", "initial workspace"]);
    for (branch, file, text) in changes {
        git(dir, &["checkout", "--quiet", "-b", branch, "main"]);
        std::fs::write(dir.join(file), format!("{text}\n")).unwrap();
        git(dir, &["commit", "--quiet", "-am", &format!("{branch}: {file}")]);
    }
    git(dir, &["checkout", "--quiet", "main"]);
}

/// A gantry.toml in `dir` for a queue over `repo` whose build steps are `script`, with
/// no retries and `queue` (TOML lines) added to its `[queue]` table.
fn write_config(dir: &Path, repo: &Path, script: &Path, queue: &str) -> std::path::PathBuf {
    let config = dir.join("gantry.toml");
    std::fs::write(
        &config,
        format!(
            "[batch]\nrunners = 0\n\
             startup_flags = [\"--nohome_rc\", \"--noworkspace_rc\", \"--max_idle_secs=60\"]\nextra_flags = {}\n\
             [execution]\nworkers = 1\n\
             [queue]\nrepository = {:?}\nmainline = \"main\"\nmax_retries = 0\ndeadline = \"5m\"\n\
             build_command = [{:?}]\n{queue}",
            toml_list(&fixture_flags()),
            repo.display().to_string(),
            script.display().to_string(),
        ),
    )
    .unwrap();
    config
}

/// A queue with batching on and one slot over a new repository with these change
/// branches, its build steps gated (`write_build_script`): (repository, gates, config).
fn one_slot_batching(dir: &Path, changes: &[(&str, &str, &str)]) -> (PathBuf, PathBuf, PathBuf) {
    let repo = dir.join("repo");
    generate_repo(&repo, changes);
    let gates = dir.join("gates");
    std::fs::create_dir_all(&gates).unwrap();
    let script = dir.join("check.sh");
    write_build_script(&script, &gates);
    let config = write_config(dir, &repo, &script, "capacity = 1\nbatching = true\n");
    (repo, gates, config)
}

/// Submits d-edit, then x and w, and waits until x and w are queued behind d's build
/// (which waits for its gate `go-d`): the ids of d, x and w.
fn queue_behind_d(url: &str, x: &str, w: &str) -> (String, String, String) {
    let (d, x, w) = (submit(url, "d-edit"), submit(url, x), submit(url, w));
    wait_history(url, "x and w queue behind d's build", Duration::from_secs(120), |h| {
        state(h, &x) == "PENDING"
            && state(h, &w) == "PENDING"
            && builds(change(h, &d)).iter().any(|b| b["state"] == "RUNNING")
    });
    (d, x, w)
}

fn submit(url: &str, branch: &str) -> String {
    let c = queue_json(url, &["submit", "--change", branch]);
    assert_eq!(c["state"], "SUBMITTED");
    c["change_id"].as_str().unwrap().to_string()
}

#[test]
fn queue_infra_retry_cancel_and_failed_combined_tree_check() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    generate_repo(
        &repo,
        &[
            ("w-edit", "c/value.txt", "c edit"),
            ("x-a-on", "a/value.txt", "a ON"),
            ("y-b-on", "b/value.txt", "b ON"),
            ("z-b-other", "b/other.txt", "b other edit"),
            ("d-edit", "d/value.txt", "d edit"),
        ],
    );
    let gates = dir.path().join("gates");
    std::fs::create_dir_all(&gates).unwrap();
    let script = dir.path().join("check.sh");
    // Without learning: this test follows z's builds one by one. With it, z's build on
    // the mainline alone would be kept when y lands (to learn z's own outcome), and
    // after y's failed landing it would decide z in place of the rebuild on version 3
    // checked below.
    let config = write_config(dir.path(), &repo, &script, "capacity = 6\nlearn_alone = false\n");
    let data = dir.path().join("data");
    let server = GantryServer::start(&data, &["--config", config.to_str().unwrap()]);
    let url = format!("grpc://{}", server.grpc);
    let initial = git(&repo, &["rev-parse", "main"]);

    // 1. The build command is missing: an infrastructure error, shown and retried.
    let w = submit(&url, "w-edit");
    let start = Instant::now();
    let note = loop {
        let s = queue_json(&url, &["status"]);
        let running = s["changes"].as_array().unwrap().iter().find(|c| c["change_id"] == w.as_str()).and_then(|c| {
            builds(c)
                .into_iter()
                .find(|b| b["state"] == "RUNNING" && b["message"].as_str().unwrap().contains("infrastructure error"))
                .cloned()
        });
        if let Some(b) = running {
            break b["message"].as_str().unwrap().to_string();
        }
        assert!(start.elapsed() < Duration::from_secs(120), "no infrastructure error shown for {w}: {s:#}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(note.contains("check.sh") && note.contains("No such file") && note.contains(", try "), "{note}");
    let appeared = Instant::now();
    write_build_script(&script, &gates);
    let h = wait_history(&url, "w lands once its build command exists", Duration::from_secs(60), |h| {
        state(h, &w) != "PENDING"
    });
    assert_eq!(state(&h, &w), "LANDED", "an infrastructure error is not the change's fault: {h:#}");
    println!("{w} landed {:.1} s after its build command appeared", appeared.elapsed().as_secs_f64());
    let wb = builds(change(&h, &w));
    assert_eq!(wb.len(), 1, "the same build was retried, no new one started: {h:#}");
    assert_eq!((wb[0]["state"].as_str(), wb[0]["message"].as_str()), (Some("PASSED"), Some("")));
    // Counted since this start only: checked before the restart below.
    wait_metrics(&server.http, Duration::from_secs(10), |m| {
        metric_value(m, "gantry_queue_infra_retries_total").is_some_and(|n| n >= 1.0)
            && metric_value(m, "gantry_queue_changes{state=\"LANDED\"}") == Some(1.0)
    });

    // 2. and 3.: four changes at once. x (package a) and y (package b) are independent;
    // z touches package b too, so it waits for y; d is cancelled.
    let x = submit(&url, "x-a-on");
    let y = submit(&url, "y-b-on");
    let z = submit(&url, "z-b-other");
    let d = submit(&url, "d-edit");
    let h = wait_history(&url, "every build under way", Duration::from_secs(120), |h| {
        let running = |id: &str, with: &[&str]| {
            builds(change(h, id)).iter().any(|b| b["state"] == "RUNNING" && assumed(b) == with)
        };
        running(&x, &[]) && running(&y, &[]) && running(&z, &[&y]) && running(&z, &[]) && running(&d, &[])
    });
    let independent = |a: &Value, b: &Value| {
        let set = |c: &Value| {
            c["affected_targets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_str().unwrap().to_string())
                .collect::<Vec<_>>()
        };
        set(a).iter().all(|t| !set(b).contains(t))
    };
    assert!(independent(change(&h, &x), change(&h, &y)), "x and y are proven independent: {h:#}");
    assert!(!independent(change(&h, &y), change(&h, &z)), "z depends on y: {h:#}");

    // 2. Cancel d while its build runs (its gate never opens).
    let c = queue_json(&url, &["cancel", &d]);
    assert_eq!(c["state"], "CANCELLED", "{c:#}");
    assert!(builds(&c).iter().all(|b| b["state"] == "CANCELLED"), "{c:#}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cancel = |id: &str| {
        rt.block_on(async {
            let mut client =
                pb::submit_queue_client::SubmitQueueClient::connect(format!("http://{}", server.grpc)).await.unwrap();
            client.cancel(pb::CancelRequest { change_id: id.to_string() }).await
        })
    };
    let e = cancel("c999").unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains("c999"), "{e:?}");
    for decided in [&w, &d] {
        let e = cancel(decided).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("already"), "{e:?}");
    }

    // 3. x passes first and lands; y's build, on the version before x, passes next.
    std::fs::write(gates.join("go-a"), "").unwrap();
    wait_history(&url, "x lands", Duration::from_secs(60), |h| state(h, &x) == "LANDED");
    std::fs::write(gates.join("go-b"), "").unwrap();
    let h = wait_history(&url, "y is decided", Duration::from_secs(60), |h| state(h, &y) != "PENDING");
    let yc = change(&h, &y);
    assert_eq!(yc["state"], "REJECTED", "{h:#}");
    let reason = yc["reason"].as_str().unwrap();
    assert!(reason.contains("combined-tree check failed") && reason.contains("a and b are both ON"), "{reason}");
    let yb = builds(yc);
    assert!(
        yb.iter().any(|b| b["state"] == "PASSED" && b["base_version"] == 1 && assumed(b).is_empty()),
        "y's own build passed on version 1: {h:#}"
    );
    // The planner dropped y: z's build that assumed y is cancelled, and z is built
    // again on the real mainline (version 3 exists and holds no change).
    let zc = change(&h, &z);
    assert_eq!(zc["state"], "PENDING", "{h:#}");
    assert!(builds(zc).iter().filter(|b| assumed(b) == [y.as_str()]).all(|b| b["state"] == "CANCELLED"), "{h:#}");
    assert!(
        builds(zc).iter().any(|b| b["state"] == "RUNNING" && assumed(b).is_empty() && b["base_version"] == 3),
        "z rebuilt on version 3: {h:#}"
    );

    // A watch of an undecided change must not hold the server's shutdown: the stream
    // ends with UNAVAILABLE (without that the drain waits 30 s and `stop` fails at 20 s).
    let mut watch = gantry()
        .args(["queue", "watch", &z, "--json", "--server", &url])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(watch.stdout.take().unwrap()), &mut first).unwrap();
    assert!(first.contains("PENDING"), "the watch is open on pending z: {first}");

    // A crash between recording y's FAILED landing and journaling the planner's event:
    // stop, take the event (the journal's last) out, start again. The startup must apply
    // it again, or the planner would count y as landed and restart z's build assuming y.
    server.stop();
    let out = watch.wait_with_output().unwrap();
    assert!(!out.status.success(), "the watch ends unfinished");
    assert!(String::from_utf8_lossy(&out.stderr).contains("shutting down"), "{}", String::from_utf8_lossy(&out.stderr));
    let db = format!("sqlite://{}", data.join("metadata.db").display());
    rt.block_on(async {
        let pool = sqlx::sqlite::SqlitePool::connect(&db).await.unwrap();
        let (seq, last): (i64, i64) = sqlx::query_as(
            "SELECT seq, (SELECT MAX(seq) FROM queue_events) FROM queue_events WHERE dedup_key = 'landing-failed:3'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(seq, last, "y's landing failure is the last event journaled");
        sqlx::query("DELETE FROM queue_events WHERE seq = $1").bind(seq).execute(&pool).await.unwrap();
        pool.close().await;
    });
    let server = GantryServer::start(&data, &["--config", config.to_str().unwrap()]);
    let url = format!("grpc://{}", server.grpc);
    let h = queue_json(&url, &["history"]);
    let zc = change(&h, &z);
    let running: Vec<(u64, Vec<&str>)> = builds(zc)
        .iter()
        .filter(|b| b["state"] == "RUNNING")
        .map(|b| (b["base_version"].as_u64().unwrap(), assumed(b)))
        .collect();
    assert_eq!(running, [(3, vec![])], "after the restart z is built on the real mainline only: {h:#}");
    rt.block_on(async {
        let pool = sqlx::sqlite::SqlitePool::connect(&db).await.unwrap();
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM queue_events WHERE dedup_key = 'landing-failed:3'")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(n, 1, "the startup journaled y's landing failure again");
        pool.close().await;
    });

    std::fs::write(gates.join("go-z"), "").unwrap();
    let h = wait_history(&url, "z is decided", Duration::from_secs(60), |h| state(h, &z) != "PENDING");
    let zc = change(&h, &z);
    assert_eq!(zc["state"], "LANDED", "{h:#}");
    assert_eq!(zc["landed_version"], 4, "{h:#}");
    let deciding = &h["mainline"][4]["build_id"];
    let zb = builds(zc).into_iter().find(|b| b["build_id"] == *deciding).unwrap();
    assert_eq!(
        (zb["base_version"].as_u64(), assumed(zb)),
        (Some(3), vec![]),
        "z was decided on the real mainline: {h:#}"
    );
    assert_eq!(h["mainline"][4]["how"], "fast-forward", "{h:#}");
    assert_ne!(state(&h, &d), "LANDED");

    // The mainline: versions 0 to 4, y's a FAILED move that left it where it was, and
    // no commit it ever pointed to (its reflog included) has a and b both ON.
    let moves: Vec<(u64, String, String)> = h["mainline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["version"].as_u64().unwrap(),
                m["change_id"].as_str().unwrap().to_string(),
                m["state"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let expect = |v: u64, c: &str, s: &str| (v, c.to_string(), s.to_string());
    assert_eq!(
        moves,
        [
            expect(0, "", "DONE"),
            expect(1, &w, "DONE"),
            expect(2, &x, "DONE"),
            expect(3, &y, "FAILED"),
            expect(4, &z, "DONE")
        ]
    );
    let y_move = &h["mainline"][3];
    assert_eq!(y_move["old_commit"], y_move["new_commit"], "{y_move:#}");
    let pointed: Vec<String> =
        git(&repo, &["log", "-g", "--format=%H", "refs/heads/main"]).lines().map(str::to_string).collect();
    assert_eq!(pointed.last(), Some(&initial));
    assert_eq!(pointed.len(), 4, "initial, w, x, z: {pointed:?}");
    for commit in &pointed {
        let on = |f: &str| git(&repo, &["show", &format!("{commit}:{f}")]).contains("ON");
        assert!(!(on("a/value.txt") && on("b/value.txt")), "the mainline pointed at {commit}, which fails");
    }
    assert_eq!(git(&repo, &["show", "main:b/other.txt"]), "b other edit");
    assert_eq!(git(&repo, &["show", "main:b/value.txt"]), "b off");
    assert_eq!(git(&repo, &["show", "main:d/value.txt"]), "d off");

    // The metrics, rebuilt at the restart from the journal and the documents.
    let n_builds = h["changes"].as_array().unwrap().iter().map(|c| builds(c).len()).sum::<usize>() as f64;
    let m = wait_metrics(&server.http, Duration::from_secs(10), |m| {
        metric_value(m, "gantry_queue_changes{state=\"LANDED\"}") == Some(3.0)
    });
    let value = |series: &str| metric_value(&m, series).unwrap_or_else(|| panic!("no {series} in\n{m}"));
    for (state, n) in [("SUBMITTED", 0.0), ("PENDING", 0.0), ("LANDED", 3.0), ("REJECTED", 1.0), ("CANCELLED", 1.0)] {
        assert_eq!(value(&format!("gantry_queue_changes{{state=\"{state}\"}}")), n, "{state}\n{m}");
    }
    assert_eq!(value("gantry_queue_running_builds"), 0.0);
    assert_eq!(value("gantry_queue_landing_failures_total"), 1.0);
    assert_eq!(value("gantry_queue_builds_started_total"), n_builds, "one per build in the history");
    // d's build, z's two builds assuming y or not, and z's rebuilt before the restart.
    assert!(value("gantry_queue_builds_cancelled_total") >= 3.0, "{m}");
    assert_eq!(value("gantry_queue_turnaround_seconds_count{state=\"LANDED\"}"), 3.0);
    assert_eq!(value("gantry_queue_turnaround_seconds_count{state=\"CANCELLED\"}"), 1.0);

    server.stop();
    println!("queue_paths took {:.1} s", t0.elapsed().as_secs_f64());
}

/// Batching on, one slot: d holds the slot while x and w (both package a) queue behind
/// it; they are then built as one tree. While that tree builds, the mainline is moved
/// outside the queue, so the batch's one compare-and-swap fails: both members are
/// rejected, no version is recorded as landed for either, and the mainline stays where
/// the outside move put it.
#[test]
fn a_batch_whose_mainline_move_fails_rejects_every_member() {
    let dir = tempfile::tempdir().unwrap();
    let (repo, gates, config) = one_slot_batching(
        dir.path(),
        &[
            ("d-edit", "d/value.txt", "d edit"),
            ("x-a-on", "a/value.txt", "a ON"),
            ("w-a-other", "a/other.txt", "a other edit"),
        ],
    );
    let server = GantryServer::start(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let url = format!("grpc://{}", server.grpc);

    let (d, x, w) = queue_behind_d(&url, "x-a-on", "w-a-other");
    std::fs::write(gates.join("go-d"), "").unwrap();
    // d's landing is recorded by the lander, which may come after the tree has started.
    let h = wait_history(&url, "d landed and x and w built as one tree", Duration::from_secs(60), |h| {
        state(h, &d) == "LANDED"
            && builds(change(h, &w)).iter().any(|b| b["state"] == "RUNNING" && assumed(b) == [x.as_str()])
    });
    assert!(builds(change(&h, &x)).is_empty(), "x is decided by w's tree alone: {h:#}");

    // Someone pushes to the mainline while the batch builds.
    git(&repo, &["checkout", "--quiet", "main"]);
    std::fs::write(repo.join("c/other.txt"), "c pushed outside the queue\n").unwrap();
    git(&repo, &["commit", "--quiet", "-am", "outside the queue"]);
    let outside = git(&repo, &["rev-parse", "main"]);
    std::fs::write(gates.join("go-a"), "").unwrap();

    let h = wait_history(&url, "the batch is decided", Duration::from_secs(60), |h| {
        state(h, &x) != "PENDING" && state(h, &w) != "PENDING"
    });
    for c in [&x, &w] {
        assert_eq!(state(&h, c), "REJECTED", "{h:#}");
        let why = change(&h, c)["reason"].as_str().unwrap();
        assert!(why.contains("mainline did not move"), "{why}");
    }
    let rows: Vec<&Value> =
        h["mainline"].as_array().unwrap().iter().filter(|m| m["version"].as_u64() >= Some(2)).collect();
    assert_eq!(rows.len(), 2, "one version per member: {h:#}");
    assert!(rows.iter().all(|m| m["state"] == "FAILED" && m["new_commit"] == m["old_commit"]), "{h:#}");
    assert_eq!(git(&repo, &["rev-parse", "main"]), outside, "the mainline is where the outside push left it");
    server.stop();
}

/// Batching on, one slot, and a crash at each moment of a batch's landing: after the
/// first member's intent is recorded, after every intent (before the compare-and-swap),
/// after the mainline moved, and after the first member was recorded landed. Each time
/// `gantry serve` dies there (`GANTRY_CRASH_AT`, a switch of debug builds) and is started
/// again on the same data: the batch lands exactly once, each member at its own version
/// with its own commit, the mainline moves once and never points at the commit inside
/// the batch, and the tree that passed is not built again. Twice more, someone pushes
/// onto the mainline between a crash after the move and the restart: the batch is still
/// landed, not rejected as if the mainline had moved instead of it.
#[test]
fn a_crash_at_any_moment_of_a_batch_landing_lands_it_once() {
    for moment in ["first-intent", "before-move", "after-move", "first-done"] {
        crash_in_batch_landing(moment, false);
    }
    for moment in ["after-move", "first-done"] {
        crash_in_batch_landing(moment, true);
    }
}

fn crash_in_batch_landing(moment: &str, push_before_restart: bool) {
    let dir = tempfile::tempdir().unwrap();
    let (repo, gates, config) = one_slot_batching(
        dir.path(),
        &[
            ("d-edit", "d/value.txt", "d edit"),
            ("x-c-value", "c/value.txt", "c edit"),
            ("w-c-other", "c/other.txt", "c other edit"),
        ],
    );
    let data = dir.path().join("data");
    let point = format!("queue.batch-landing.{moment}");
    let mut server =
        GantryServer::start_env(&data, &["--config", config.to_str().unwrap()], &[("GANTRY_CRASH_AT", &point)]);
    let url = format!("grpc://{}", server.grpc);

    let (d, x, w) = queue_behind_d(&url, "x-c-value", "w-c-other");
    let before = git(&repo, &["rev-parse", "main"]);
    std::fs::write(gates.join("go-d"), "").unwrap();

    // d lands alone (no crash point of a batch), then x and w pass as one tree and the
    // server dies in the middle of landing them.
    let start = Instant::now();
    let status = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "{point}: gantry serve did not reach the crash point");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(status.code(), Some(gantry_core::crash::CRASH_EXIT_CODE), "{point}: {status}");
    let at_crash = git(&repo, &["rev-parse", "main"]);
    assert_ne!(at_crash, before, "{point}: d landed before the batch");
    let pushed = push_before_restart.then(|| {
        // The queue moves the ref alone: bring the work tree to it before committing.
        git(&repo, &["checkout", "--quiet", "main"]);
        git(&repo, &["reset", "--quiet", "--hard", "main"]);
        std::fs::write(repo.join("b/other.txt"), "b pushed outside the queue\n").unwrap();
        git(&repo, &["commit", "--quiet", "-am", "outside the queue"]);
        git(&repo, &["rev-parse", "main"])
    });

    let server = GantryServer::start(&data, &["--config", config.to_str().unwrap()]);
    let url = format!("grpc://{}", server.grpc);
    let h = wait_history(&url, "the batch is landed after the restart", Duration::from_secs(60), |h| {
        state(h, &x) == "LANDED" && state(h, &w) == "LANDED"
    });
    let row = |v: u64| -> &Value {
        h["mainline"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["version"] == v)
            .unwrap_or_else(|| panic!("{point}: no version {v}: {h:#}"))
    };
    let (r1, r2, r3) = (row(1), row(2), row(3));
    assert_eq!(r1["change_id"], d.as_str(), "{point}: {h:#}");
    let d_commit = r1["new_commit"].as_str().unwrap().to_string();
    for (r, c) in [(r2, &x), (r3, &w)] {
        assert_eq!(r["change_id"], c.as_str(), "{point}: {h:#}");
        assert_eq!(r["state"], "DONE", "{point}: {h:#}");
        assert_eq!(change(&h, c)["landed_version"], r["version"], "{point}: {h:#}");
    }
    assert_eq!(r2["old_commit"], d_commit.as_str(), "{point}: {h:#}");
    assert_eq!(r3["old_commit"], r2["new_commit"], "{point}: {h:#}");
    let batch_head = r3["new_commit"].as_str().unwrap().to_string();
    let head = git(&repo, &["rev-parse", "main"]);
    assert_eq!(&head, pushed.as_ref().unwrap_or(&batch_head), "{point}: the mainline is at the batch's tree: {h:#}");
    // The crash came where it was meant to: before or after the compare-and-swap.
    let moved = matches!(moment, "after-move" | "first-done");
    assert_eq!(&at_crash, if moved { &batch_head } else { &d_commit }, "{point}: the mainline at the crash");

    // One move for the batch: the reflog holds the initial commit, d's landing and the
    // batch's landing (and the push), and never the commit inside the batch.
    let reflog: Vec<String> =
        git(&repo, &["reflog", "show", "--format=%H", "refs/heads/main"]).lines().map(str::to_string).collect();
    let expected: Vec<String> =
        pushed.iter().cloned().chain([batch_head.clone(), d_commit.clone(), before.clone()]).collect();
    assert_eq!(reflog, expected, "{point}: the mainline moved once per landing");
    assert!(!reflog.iter().any(|c| r2["new_commit"] == c.as_str()), "{point}");
    // Each member keeps its own commit, in queue order, and the tree holds both edits.
    let subjects = git(&repo, &["log", "--format=%s", "-3", &batch_head]);
    assert_eq!(subjects, "w-c-other: c/other.txt\nx-c-value: c/value.txt\nd-edit: d/value.txt", "{point}");
    assert_eq!(git(&repo, &["show", "main:c/value.txt"]), "c edit", "{point}");
    assert_eq!(git(&repo, &["show", "main:c/other.txt"]), "c other edit", "{point}");
    assert!(builds(change(&h, &x)).is_empty(), "{point}: x is decided by w's tree: {h:#}");
    assert_eq!(builds(change(&h, &w)).len(), 1, "{point}: the tree that passed is not built again: {h:#}");
    server.stop();
}

/// `[retention]` on a queue: with a snapshot every 4 journal entries and at most 3
/// changes kept, 8 changes land; the journal is cut at a snapshot, the decided history
/// stays within its bound (in the database and in `gantry queue history`), and a
/// restart resumes from the snapshot: 2 more changes land at the next versions, on a
/// mainline that holds all ten.
#[test]
fn retention_cuts_the_journal_at_a_snapshot_and_keeps_the_history_within_its_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let names: Vec<String> = (1..=10).map(|i| format!("r{i}")).collect();
    let files: Vec<String> = (1..=10).map(|i| format!("c/new{i}.txt")).collect();
    generate_repo(&repo, &[]);
    for (n, f) in names.iter().zip(&files) {
        git(&repo, &["checkout", "--quiet", "-b", n, "main"]);
        std::fs::write(repo.join(f), "new file\n").unwrap();
        git(&repo, &["add", f]);
        git(&repo, &["commit", "--quiet", "-m", &format!("{n}: {f}")]);
    }
    git(&repo, &["checkout", "--quiet", "main"]);
    let gates = dir.path().join("gates");
    std::fs::create_dir_all(&gates).unwrap();
    let script = dir.path().join("check.sh");
    write_build_script(&script, &gates);
    let config = write_config(
        dir.path(),
        &repo,
        &script,
        "capacity = 2\n\
         [retention]\ninterval = \"300ms\"\nqueue_journal = 4\nqueue_graphs = 2\n\
         [retention.queue]\nmax_age = \"0s\"\nmax_rows = 3\n",
    );
    let data = dir.path().join("data");
    let args = ["--config", config.to_str().unwrap()];
    let server = GantryServer::start(&data, &args);
    let url = format!("grpc://{}", server.grpc);
    let ids: Vec<String> = names[..8].iter().map(|n| submit(&url, n)).collect();
    let rows = |text: &str, table: &str| {
        metric_value(text, &format!("gantry_metadata_rows{{table=\"{table}\"}}")).unwrap_or(f64::NAN)
    };
    // Landed, and then forgotten down to the bound: the history shows what is left.
    let h = wait_history(&url, "8 changes landed and the history cut to 3", Duration::from_secs(180), |h| {
        let listed = h["changes"].as_array().unwrap();
        listed.len() == 3 && listed.iter().all(|c| c["state"] == "LANDED")
    });
    let kept: Vec<&str> = h["changes"].as_array().unwrap().iter().map(|c| c["change_id"].as_str().unwrap()).collect();
    for id in &ids[..5] {
        assert!(!kept.contains(&id.as_str()), "{id} is past the bound: {h:#}");
    }
    // 8 enqueues and at least 8 build results were journaled; what is left is the
    // snapshot's own entry and those after it. (The gauges are sampled a table at a
    // time, maybe between a snapshot and the deletes after it: wait for all at once.)
    wait_metrics(&server.http, Duration::from_secs(30), |m| {
        rows(m, "queue_changes") <= 3.0
            && rows(m, "queue_snapshots") == 1.0
            && rows(m, "queue_events") <= 5.0
            && rows(m, "queue_builds") <= 3.0 + 2.0
            && rows(m, "queue_landings") < 8.0
    });
    // Every change and the mainline at each landing were analysed: many more graphs.
    let text = wait_metrics(&server.http, Duration::from_secs(30), |m| rows(m, "queue_graphs") <= 2.0);
    assert!(rows(&text, "queue_graphs") >= 1.0, "{text}");
    server.stop();

    let server = GantryServer::start(&data, &args);
    let url = format!("grpc://{}", server.grpc);
    let more: Vec<String> = names[8..].iter().map(|n| submit(&url, n)).collect();
    assert!(more.iter().all(|id| !ids.contains(id)), "change ids go on from the newest kept: {more:?}");
    let h = wait_history(&url, "2 more land after the restart", Duration::from_secs(120), |h| {
        more.iter().all(|id| {
            h["changes"].as_array().unwrap().iter().any(|c| c["change_id"] == id.as_str() && c["state"] == "LANDED")
        })
    });
    let versions: Vec<u64> = more.iter().map(|id| change(&h, id)["landed_version"].as_u64().unwrap()).collect();
    let mut sorted = versions.clone();
    sorted.sort();
    assert_eq!(sorted, [9, 10], "versions go on from the snapshot: {h:#}");
    for f in &files {
        git(&repo, &["cat-file", "-e", &format!("main:{f}")]);
    }
    server.stop();
}
