//! The submit queue end to end: a generated git repository holding a Bazel workspace,
//! twelve change branches submitted in quick succession with `gantry queue submit`, real
//! Bazel 4.2.3 builds through gantry's executor, and a restart of `gantry serve` while
//! the queue is busy. The expected outcome is computed from the changes themselves (land
//! each, in queue order, iff it applies and the tests pass on top of those landed before)
//! and compared with what the queue did; then every commit the mainline pointed to is
//! checked out, with nothing else in its worktree, and `bazel test //...` must pass on it.
//!
//! A second case runs the queue with batching on and one slot: eight changes, one broken,
//! decided in fewer builds than changes, the mainline moving only to trees that passed.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{fixture_flags, gantry, git, metric_value, toml_list, wait_metrics, GantryServer};
use serde_json::Value;

const PACKAGES: [&str; 5] = ["p1", "p2", "p3", "p4", "p5"];
const LINES: usize = 20;

/// The repository's state as the test models it: file -> lines.
type Files = BTreeMap<String, Vec<String>>;

fn initial_files() -> Files {
    let mut f = Files::new();
    for p in PACKAGES {
        f.insert(format!("{p}/value.txt"), (1..=LINES).map(|i| format!("{p} line {i}")).collect());
    }
    f.insert("pair/a.txt".into(), vec!["a off".into()]);
    f.insert("pair/b.txt".into(), vec!["b off".into()]);
    f
}

/// What the tests in the workspace check, as a predicate on the model: no package
/// value contains BROKEN, and the pair files are not both ON.
fn tests_pass(f: &Files) -> bool {
    let broken = PACKAGES.iter().any(|p| f[&format!("{p}/value.txt")].iter().any(|l| l.contains("BROKEN")));
    let both = f["pair/a.txt"][0].contains("ON") && f["pair/b.txt"][0].contains("ON");
    !broken && !both
}

/// One change: replace line `line` of `file`.
struct Spec {
    branch: &'static str,
    file: &'static str,
    line: usize,
    text: &'static str,
}

fn changes() -> Vec<Spec> {
    let s = |branch, file, line, text| Spec { branch, file, line, text };
    vec![
        s("p1-first", "p1/value.txt", 0, "p1 first edit"),
        s("p2-broken", "p2/value.txt", 0, "p2 BROKEN"),
        s("pair-a", "pair/a.txt", 0, "a ON"),
        s("p3-edit", "p3/value.txt", 0, "p3 edit"),
        s("pair-b", "pair/b.txt", 0, "b ON"),
        s("p4-edit", "p4/value.txt", 0, "p4 edit"),
        s("p5-broken", "p5/value.txt", 6, "p5 BROKEN at the end"),
        s("p1-second", "p1/value.txt", 6, "p1 second edit"),
        s("p3-broken", "p3/value.txt", 6, "p3 BROKEN too"),
        s("p2-fixed", "p2/value.txt", 6, "p2 edit at the end"),
        s("p4-clash", "p4/value.txt", 0, "p4 other edit of the same line"),
        s("p5-edit", "p5/value.txt", 3, "p5 middle edit"),
    ]
}

/// The reference outcome: in queue order, a change lands iff its line is untouched by the
/// changes landed before it (git applies it) and the tests pass with it.
fn reference(specs: &[Spec]) -> (BTreeSet<&'static str>, Files) {
    let base = initial_files();
    let mut state = base.clone();
    let mut landed = BTreeSet::new();
    for c in specs {
        if state[c.file][c.line] != base[c.file][c.line] {
            continue; // the same line changed on the mainline: the patch does not apply
        }
        let mut next = state.clone();
        next.get_mut(c.file).unwrap()[c.line] = c.text.to_string();
        if tests_pass(&next) {
            state = next;
            landed.insert(c.branch);
        }
    }
    (landed, state)
}

fn write_files(dir: &Path, files: &Files) {
    for (path, lines) in files {
        let p = dir.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, lines.join("\n") + "\n").unwrap();
    }
}

fn generate_repo(dir: &Path, specs: &[Spec]) {
    std::fs::create_dir_all(dir).unwrap();
    git(dir, &["init", "--quiet", "-b", "main"]);
    git(dir, &["config", "user.email", "dev@example.com"]);
    git(dir, &["config", "user.name", "dev"]);
    std::fs::write(dir.join("WORKSPACE"), "").unwrap();
    let check =
        "#!/bin/sh\nfor f in \"$@\"; do\n  if grep -q SLOW \"$f\"; then sleep 20; fi\n  if grep -q BROKEN \"$f\"; then echo \"$f is BROKEN\"; exit 1; fi\ndone\n";
    let pair = "#!/bin/sh\nif grep -q ON \"$1\" && grep -q ON \"$2\"; then echo 'a and b are both ON'; exit 1; fi\n";
    for p in PACKAGES {
        std::fs::create_dir_all(dir.join(p)).unwrap();
        std::fs::write(
            dir.join(p).join("BUILD"),
            "sh_test(\n    name = \"value_test\",\n    srcs = [\"check.sh\"],\n    args = [\"$(location value.txt)\"],\n    data = [\"value.txt\"],\n)\n",
        )
        .unwrap();
        std::fs::write(dir.join(p).join("check.sh"), check).unwrap();
    }
    std::fs::create_dir_all(dir.join("pair")).unwrap();
    std::fs::write(
        dir.join("pair/BUILD"),
        "sh_test(\n    name = \"pair_test\",\n    srcs = [\"check.sh\"],\n    args = [\"$(location a.txt)\", \"$(location b.txt)\"],\n    data = [\"a.txt\", \"b.txt\"],\n)\n",
    )
    .unwrap();
    std::fs::write(dir.join("pair/check.sh"), pair).unwrap();
    for entry in walk(dir) {
        if entry.ends_with("check.sh") {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    }
    write_files(dir, &initial_files());
    git(dir, &["add", "."]);
    git(dir, &["commit", "--quiet", "-m", "initial workspace"]);
    for c in specs {
        git(dir, &["checkout", "--quiet", "-b", c.branch, "main"]);
        let mut files = initial_files();
        files.get_mut(c.file).unwrap()[c.line] = c.text.to_string();
        write_files(dir, &files);
        git(dir, &["commit", "--quiet", "-am", &format!("{}: edit {}", c.branch, c.file)]);
    }
    git(dir, &["checkout", "--quiet", "main"]);
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() && !p.ends_with(".git") {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A gantry.toml in `dir` for a queue over `repo`, with `queue` (TOML lines) added to
/// its `[queue]` table.
fn write_config(dir: &Path, repo: &Path, queue: &str) -> PathBuf {
    let config = dir.join("gantry.toml");
    std::fs::write(
        &config,
        format!(
            "[batch]\nrunners = 0\n\
             startup_flags = [\"--nohome_rc\", \"--noworkspace_rc\", \"--max_idle_secs=120\"]\nextra_flags = {}\n\
             [execution]\nworkers = 2\n\
             [queue]\nrepository = {:?}\nmainline = \"main\"\ndeadline = \"5m\"\n{queue}",
            toml_list(&fixture_flags()),
            repo.display().to_string(),
        ),
    )
    .unwrap();
    config
}

/// `bazel test //...` must pass at each of these mainline versions, each checked out in
/// one worktree under `dir` (forced, and cleaned of anything untracked, so that it holds
/// exactly that commit's files), with gantry at `url` as the remote cache. One worktree,
/// not one per version: Bazel's server belongs to a workspace, and a new workspace
/// restarted it and re-analysed everything for every version.
fn recheck(repo: &Path, dir: &Path, url: &str, versions: &[&Value]) {
    let recheck_base = dir.join("recheck-output-base");
    let wt = dir.join("recheck");
    for (i, m) in versions.iter().enumerate() {
        let commit = m["new_commit"].as_str().unwrap();
        if i == 0 {
            git(repo, &["worktree", "add", "--quiet", "--detach", wt.to_str().unwrap(), commit]);
        } else {
            git(&wt, &["checkout", "--quiet", "--force", "--detach", commit]);
            git(&wt, &["clean", "-q", "-f", "-d", "-x"]);
        }
        assert_eq!(git(&wt, &["rev-parse", "HEAD"]), commit, "the recheck worktree is at version {}", m["version"]);
        assert_eq!(
            git(&wt, &["status", "--porcelain"]),
            "",
            "the recheck worktree holds only version {}",
            m["version"]
        );
        let out = Command::new("bazel")
            .args(["--nohome_rc", "--noworkspace_rc", "--max_idle_secs=60"])
            .arg(format!("--output_base={}", recheck_base.display()))
            .args(["test", "//...", &format!("--remote_cache={url}"), "--spawn_strategy=local"])
            .args(fixture_flags())
            .current_dir(&wt)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "bazel test //... at version {} ({commit}): {}",
            m["version"],
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let _ = Command::new("bazel")
        .args(["--nohome_rc", "--noworkspace_rc"])
        .arg(format!("--output_base={}", recheck_base.display()))
        .arg("shutdown")
        .current_dir(repo)
        .output();
}

/// `gantry queue submit --json` of a branch, which must succeed: the change as JSON.
fn submit(url: &str, branch: &str) -> Value {
    let out = gantry().args(["queue", "submit", "--json", "--change", branch, "--server", url]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn history(url: &str) -> Value {
    let out = gantry().args(["queue", "history", "--json", "--server", url]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn decided(h: &Value) -> usize {
    h["changes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| ["LANDED", "REJECTED", "CANCELLED"].contains(&c["state"].as_str().unwrap()))
        .count()
}

fn wait_decided(url: &str, n: usize, limit: Duration) -> Value {
    let start = Instant::now();
    loop {
        let h = history(url);
        if decided(&h) >= n {
            return h;
        }
        assert!(start.elapsed() < limit, "only {} of {n} changes decided after {limit:?}: {h:#}", decided(&h));
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn submit_queue_lands_exactly_the_right_changes_with_real_bazel() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let specs = changes();
    generate_repo(&repo, &specs);
    let (expected, final_files) = reference(&specs);
    let initial = git(&repo, &["rev-parse", "main"]);

    let config = write_config(dir.path(), &repo, "capacity = 4\nmax_retries = 1\n");
    let data = dir.path().join("data");
    let server = GantryServer::start(&data, &["--config", config.to_str().unwrap()]);
    let url = format!("grpc://{}", server.grpc);

    // Bad input is refused with the field named, and nothing is enqueued.
    let out = gantry().args(["queue", "submit", "--change", "no-such-branch", "--server", &url]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("change_ref"), "{}", String::from_utf8_lossy(&out.stderr));

    // Twelve submissions in quick succession.
    let mut ids: BTreeMap<String, &'static str> = BTreeMap::new();
    for c in &specs {
        let v = submit(&url, c.branch);
        assert_eq!(v["state"], "SUBMITTED");
        ids.insert(v["change_id"].as_str().unwrap().to_string(), c.branch);
    }
    let branch_of = |id: &str| ids[id];
    let watcher = {
        let url = url.clone();
        std::thread::spawn(move || {
            gantry().args(["queue", "watch", "c1", "--json", "--server", &url]).output().unwrap()
        })
    };

    // Status shows position, predicted success and the builds under way.
    let start = Instant::now();
    let status = loop {
        let out = gantry().args(["queue", "status", "--json", "--server", &url]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let s: Value = serde_json::from_slice(&out.stdout).unwrap();
        let pending: Vec<&Value> =
            s["changes"].as_array().unwrap().iter().filter(|c| c["state"] == "PENDING").collect();
        if pending.len() >= 2
            && pending.iter().any(|c| c["builds"].as_array().unwrap().iter().any(|b| b["state"] == "RUNNING"))
        {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(180), "no pending change with a running build: {s:#}");
        std::thread::sleep(Duration::from_millis(300));
    };
    let first = status["changes"].as_array().unwrap().iter().find(|c| c["state"] == "PENDING").unwrap();
    // The queue page while builds run: pending changes, their predicted success and
    // speculative builds (they may have moved on by the time the browser looks).
    common::browser::look_at(&server.http, &[("/queue", "queue-running", &["Submit queue"][..])]);
    assert_eq!(first["position"], 1);
    let p = first["predicted_success"].as_f64().unwrap();
    assert!(p > 0.0 && p <= 1.0, "{first:#}");

    // Restart the server once changes have started landing: the queue must resume.
    wait_decided(&url, 2, Duration::from_secs(300));
    let before = history(&url);
    server.stop();
    let server = GantryServer::start(&data, &["--config", config.to_str().unwrap()]);
    let url = format!("grpc://{}", server.grpc);
    let after = history(&url);
    for c in before["changes"].as_array().unwrap() {
        let same = after["changes"].as_array().unwrap().iter().find(|a| a["change_id"] == c["change_id"]).unwrap();
        if ["LANDED", "REJECTED"].contains(&c["state"].as_str().unwrap()) {
            assert_eq!(same["state"], c["state"], "decisions survive a restart");
        }
    }

    let h = wait_decided(&url, specs.len(), Duration::from_secs(420));
    let changes: Vec<&Value> = h["changes"].as_array().unwrap().iter().collect();
    let watch_out = watcher.join().unwrap();
    let last_watch =
        String::from_utf8_lossy(&watch_out.stdout).lines().last().map(|l| serde_json::from_str::<Value>(l).unwrap());
    let c1_state = changes.iter().find(|c| c["change_id"] == "c1").unwrap()["state"].clone();
    // The watch stream ended with the server's restart or with c1's decision.
    if let Some(w) = last_watch.filter(|w| w["state"] != "PENDING" && w["state"] != "SUBMITTED") {
        assert_eq!(w["state"], c1_state);
    }

    println!("change  branch      state     time to decision  reason");
    for c in changes.iter().rev() {
        let secs = (c["decided_unix_ms"].as_i64().unwrap() - c["submitted_unix_ms"].as_i64().unwrap()) as f64 / 1000.0;
        println!(
            "{:<7} {:<11} {:<9} {:>8.1} s        {}",
            c["change_id"].as_str().unwrap(),
            branch_of(c["change_id"].as_str().unwrap()),
            c["state"].as_str().unwrap(),
            secs,
            c["reason"].as_str().unwrap().chars().take(110).collect::<String>()
        );
    }

    // The queue's metrics agree with its history.
    let m = wait_metrics(&server.http, Duration::from_secs(10), |m| {
        metric_value(m, "gantry_queue_changes{state=\"LANDED\"}") == Some(expected.len() as f64)
    });
    assert_eq!(
        metric_value(&m, "gantry_queue_changes{state=\"REJECTED\"}"),
        Some((specs.len() - expected.len()) as f64),
        "{m}"
    );
    assert_eq!(metric_value(&m, "gantry_queue_changes{state=\"PENDING\"}"), Some(0.0), "{m}");
    assert_eq!(metric_value(&m, "gantry_queue_running_builds"), Some(0.0), "{m}");
    let builds_started = metric_value(&m, "gantry_queue_builds_started_total").unwrap();
    assert!(builds_started >= specs.len() as f64, "{m}");
    let decided_count: f64 = ["LANDED", "REJECTED"]
        .iter()
        .filter_map(|s| metric_value(&m, &format!("gantry_queue_turnaround_seconds_count{{state=\"{s}\"}}")))
        .sum();
    assert_eq!(decided_count, specs.len() as f64, "{m}");

    // Exactly the right changes landed.
    let landed: BTreeSet<&str> = changes
        .iter()
        .filter(|c| c["state"] == "LANDED")
        .map(|c| branch_of(c["change_id"].as_str().unwrap()))
        .collect();
    assert_eq!(landed, expected, "landed set differs from the reference");
    assert!(!(landed.contains("pair-a") && landed.contains("pair-b")), "the conflicting pair both landed");
    let clash = changes.iter().find(|c| branch_of(c["change_id"].as_str().unwrap()) == "p4-clash").unwrap();
    let why = clash["reason"].as_str().unwrap();
    assert!(why.contains("does not apply"), "{clash:#}");
    // Decided at analysis, or by one build: a patch conflict is never retried.
    assert!(!why.contains("time(s)") || why.contains("failed 1 time(s)"), "{clash:#}");
    let broken = changes.iter().find(|c| branch_of(c["change_id"].as_str().unwrap()) == "p2-broken").unwrap();
    assert!(broken["reason"].as_str().unwrap().contains("TESTS_FAILED"), "{broken:#}");

    // The mainline log: a chain of compare-and-swap moves, each to a tested commit, ending
    // at the branch, whose files are the accepted changes applied in queue order.
    let moves: Vec<&Value> = h["mainline"].as_array().unwrap().iter().filter(|m| m["state"] == "DONE").collect();
    assert_eq!(moves.len(), expected.len() + 1, "version 0 plus one move per landed change: {h:#}");
    assert_eq!(moves[0]["new_commit"], initial.as_str());
    for w in moves.windows(2) {
        assert_eq!(w[1]["old_commit"], w[0]["new_commit"]);
        let parent = git(&repo, &["rev-parse", &format!("{}^", w[1]["new_commit"].as_str().unwrap())]);
        assert_eq!(
            parent,
            w[1]["old_commit"].as_str().unwrap(),
            "each landing adds one commit on the previous mainline"
        );
    }
    let head = git(&repo, &["rev-parse", "main"]);
    assert_eq!(head, moves.last().unwrap()["new_commit"].as_str().unwrap());
    for (path, lines) in &final_files {
        assert_eq!(git(&repo, &["show", &format!("main:{path}")]), lines.join("\n"), "{path} at the final mainline");
    }

    // Every landed commit is the exact tree of a passing build: the deciding build's, or,
    // when independent changes landed meanwhile, the verification build's.
    let builds: BTreeMap<String, &Value> = changes
        .iter()
        .flat_map(|c| c["builds"].as_array().unwrap().iter())
        .map(|b| (b["build_id"].as_str().unwrap().to_string(), b))
        .collect();
    for m in &moves[1..] {
        let b = builds[m["build_id"].as_str().unwrap()];
        assert_eq!(b["state"], "PASSED", "{b:#}");
        println!("version {} = {} by {} ({})", m["version"], m["change_id"], m["build_id"], m["how"]);
        if m["how"] == "verified" {
            continue;
        }
        let tested_tree = git(&repo, &["rev-parse", &format!("{}^{{tree}}", b["commit"].as_str().unwrap())]);
        let landed_tree = git(&repo, &["rev-parse", &format!("{}^{{tree}}", m["new_commit"].as_str().unwrap())]);
        assert_eq!(tested_tree, landed_tree, "version {} is the tree build {} tested", m["version"], m["build_id"]);
    }

    // Parallel lanes: two landed changes proven independent (disjoint affected targets)
    // whose deciding builds ran at the same time, neither assuming the other.
    let affected = |c: &Value| -> BTreeSet<String> {
        c["affected_targets"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect()
    };
    let deciding: Vec<(&Value, &Value)> = moves[1..]
        .iter()
        .map(|m| {
            (
                *changes.iter().find(|c| c["change_id"] == m["change_id"]).unwrap(),
                builds[m["build_id"].as_str().unwrap()],
            )
        })
        .collect();
    let mut parallel = vec![];
    for (i, (a, ba)) in deciding.iter().enumerate() {
        for (b, bb) in &deciding[i + 1..] {
            let overlap = ba["started_unix_ms"].as_i64() < bb["finished_unix_ms"].as_i64()
                && bb["started_unix_ms"].as_i64() < ba["finished_unix_ms"].as_i64();
            let assumes = |x: &Value, id: &Value| x["assumed"].as_array().unwrap().contains(id);
            if overlap
                && affected(a).is_disjoint(&affected(b))
                && !a["alters_graph"].as_bool().unwrap()
                && !b["alters_graph"].as_bool().unwrap()
                && !assumes(ba, &b["change_id"])
                && !assumes(bb, &a["change_id"])
            {
                parallel.push((a["change_id"].as_str().unwrap(), b["change_id"].as_str().unwrap()));
            }
        }
    }
    println!("independent changes decided by concurrent builds: {parallel:?}");
    assert!(!parallel.is_empty(), "no two independent changes were decided in parallel");

    // Every commit the mainline pointed to passes `bazel test //...`.
    recheck(&repo, dir.path(), &url, &moves);
    // The queue's history as a person sees it: every change decided, with its outcome.
    let change_ids: Vec<&str> = changes.iter().map(|c| c["change_id"].as_str().unwrap()).collect();
    let mut expect = vec!["History", "LANDED", "REJECTED"];
    expect.extend(&change_ids);
    common::browser::look_at(&server.http, &[("/queue", "queue", &expect[..])]);
    server.stop();
    println!("queue_e2e took {:.1} s", t0.elapsed().as_secs_f64());
}

/// Batching on, capacity 1: nine changes, one of them broken. The first change (another
/// package, with a test that takes 20 s) holds the only slot while the other eight are
/// analysed and queue behind it: seven on one package's test, and p3, independent of
/// them, third in line. They are then built as trees; the first fails, in p1's test
/// only, so p3, whose own test passed there, lands by attribution, and the rest is
/// bisected.
#[test]
fn batching_lands_eight_changes_in_fewer_builds_with_real_bazel() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let s = |branch, file, line, text| Spec { branch, file, line, text };
    // Lines two apart: git merges edits of adjacent lines as a conflict.
    let specs = vec![
        s("slow", "p2/value.txt", 0, "p2 SLOW edit"),
        s("e1", "p1/value.txt", 0, "p1 edit 1"),
        s("e2", "p1/value.txt", 3, "p1 edit 2"),
        s("p3", "p3/value.txt", 0, "p3 edit"),
        s("e3", "p1/value.txt", 6, "p1 edit 3"),
        s("e4-broken", "p1/value.txt", 9, "p1 BROKEN 4"),
        s("e5", "p1/value.txt", 12, "p1 edit 5"),
        s("e6", "p1/value.txt", 15, "p1 edit 6"),
        s("e7", "p1/value.txt", 18, "p1 edit 7"),
    ];
    generate_repo(&repo, &specs);
    let (expected, final_files) = reference(&specs);
    assert_eq!(expected.len(), 8);

    let config = write_config(dir.path(), &repo, "capacity = 1\nmax_retries = 0\nbatching = true\n");
    let server = GantryServer::start(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let url = format!("grpc://{}", server.grpc);
    let mut ids: BTreeMap<String, &'static str> = BTreeMap::new();
    for c in &specs {
        let v = submit(&url, c.branch);
        ids.insert(v["change_id"].as_str().unwrap().to_string(), c.branch);
    }
    let h = wait_decided(&url, specs.len(), Duration::from_secs(600));
    let changes: Vec<&Value> = h["changes"].as_array().unwrap().iter().collect();
    let branch_of = |c: &Value| ids[c["change_id"].as_str().unwrap()];
    for c in changes.iter().rev() {
        println!("{:<10} {:<9} {}", branch_of(c), c["state"].as_str().unwrap(), c["reason"].as_str().unwrap());
    }
    let landed: BTreeSet<&str> = changes.iter().filter(|c| c["state"] == "LANDED").map(|c| branch_of(c)).collect();
    assert_eq!(landed, expected, "every passing change lands");
    let broken = changes.iter().find(|c| branch_of(c) == "e4-broken").unwrap();
    assert_eq!(broken["state"], "REJECTED");
    assert!(broken["reason"].as_str().unwrap().contains("TESTS_FAILED"), "{broken:#}");

    // Fewer builds than changes.
    let m = wait_metrics(&server.http, Duration::from_secs(10), |m| {
        metric_value(m, "gantry_queue_changes{state=\"LANDED\"}") == Some(expected.len() as f64)
    });
    let builds = metric_value(&m, "gantry_queue_builds_started_total").unwrap();
    let all: Vec<&Value> = changes.iter().flat_map(|c| c["builds"].as_array().unwrap().iter()).collect();
    for b in &all {
        println!(
            "build {} of {} assuming {} : {} {}",
            b["build_id"], b["change_id"], b["assumed"], b["state"], b["failed_targets"]
        );
    }
    // Every failed build names the one target that failed, from Bazel's build events.
    for b in all.iter().filter(|b| b["state"] == "FAILED") {
        assert_eq!(b["failed_targets"], serde_json::json!(["//p1:value_test"]), "{b:#}");
    }
    assert!(builds < specs.len() as f64, "{builds} builds for {} changes", specs.len());
    // Status and metrics count the batches; nothing failed and then passed on the same
    // tree, so no target is recorded as flaky.
    let out = gantry().args(["queue", "status", "--json", "--server", &url]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let status: Value = serde_json::from_slice(&out.stdout).unwrap();
    let batches = status["batches"].as_u64().unwrap();
    assert!(batches >= 1 && status["batch_landed"].as_u64().unwrap() >= 2 * batches, "{status:#}");
    assert_eq!(status["flaky_targets"], serde_json::json!([]), "{status:#}");
    assert_eq!(metric_value(&m, "gantry_queue_batches_total"), Some(batches as f64), "{m}");
    let bisections = status["bisection_builds"].as_u64().unwrap();
    assert_eq!(metric_value(&m, "gantry_queue_bisection_builds_total"), Some(bisections as f64), "{m}");

    // One version per landed change, each its own commit on the one before; the mainline
    // itself moved only to the last commit of each batch, a tree that passed.
    let moves: Vec<&Value> = h["mainline"].as_array().unwrap().iter().filter(|m| m["state"] == "DONE").collect();
    assert_eq!(moves.len(), expected.len() + 1, "{h:#}");
    for w in moves.windows(2) {
        assert_eq!(w[1]["old_commit"], w[0]["new_commit"]);
        let parent = git(&repo, &["rev-parse", &format!("{}^", w[1]["new_commit"].as_str().unwrap())]);
        assert_eq!(parent, w[1]["old_commit"].as_str().unwrap(), "each change keeps its own commit");
    }
    // p3 was decided by the failed tree it was in (attribution), checked on the mainline.
    let p3 = changes.iter().find(|c| branch_of(c) == "p3").unwrap();
    let p3_move = moves.iter().find(|m| m["change_id"] == p3["change_id"]).unwrap();
    let by = all.iter().find(|b| b["build_id"] == p3_move["build_id"]).unwrap();
    assert_eq!((by["state"].as_str(), p3_move["how"].as_str()), (Some("FAILED"), Some("verified")), "{h:#}");
    let in_batch = |m: &Value| m["how"].as_str().unwrap().starts_with("batch with");
    assert!(moves.iter().any(|m| in_batch(m)), "no batch landed: {h:#}");
    let pointed: Vec<&Value> = moves.iter().copied().filter(|m| !in_batch(m)).collect();
    let head = git(&repo, &["rev-parse", "main"]);
    assert_eq!(head, moves.last().unwrap()["new_commit"].as_str().unwrap());
    for (path, lines) in &final_files {
        assert_eq!(git(&repo, &["show", &format!("main:{path}")]), lines.join("\n"), "{path} at the final mainline");
    }
    let builds_by_id: BTreeMap<String, &Value> =
        all.iter().map(|b| (b["build_id"].as_str().unwrap().to_string(), *b)).collect();
    for m in &pointed[1..] {
        let b = builds_by_id[m["build_id"].as_str().unwrap()];
        if m["how"] == "verified" {
            continue; // its own build steps ran on the landed commit before the move
        }
        assert_eq!(b["state"], "PASSED", "{b:#}");
        if m["how"] == "fast-forward" {
            assert_eq!(b["commit"], m["new_commit"], "the mainline points at the tree that passed");
        }
    }

    // Every commit the mainline pointed to passes `bazel test //...`.
    recheck(&repo, dir.path(), &url, &pointed);
    server.stop();
    println!(
        "{builds} builds; the mainline pointed at {} commits; took {:.1} s",
        pointed.len(),
        t0.elapsed().as_secs_f64()
    );
}
