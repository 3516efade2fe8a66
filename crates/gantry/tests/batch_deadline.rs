//! The batching service's failure paths with real Bazel (issue #6): a build still
//! running at its deadline is stopped (Bazel server included), rerun once as a child
//! build, and not a third time; a build whose workspace is not a Bazel workspace ends
//! INFRA_ERROR with the reason and is not retried.
//!
//! The deadline test's server has TLS and `[auth]`: the runner's Bazel reaches it with
//! `[batch] token_file` and `tls_certificate`, as README's "Securing gantry" says.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::batch::{gantry, stream_builds, stream_builds_env};
use common::tls::Ca;
use common::write_file as write;
use common::{fixture_flags, toml_list, GantryServer};
use serde_json::Value;

/// A server with one runner and the given deadline and kill grace. Remote actions are
/// bounded by `[execution] default_timeout` so a sleeping genrule does not outlive the
/// test by long.
fn start_server(dir: &Path, deadline: &str, kill_grace: &str) -> (GantryServer, String) {
    start_server_with(dir, deadline, kill_grace, None)
}

const CLIENT_TOKEN: &str = "client-token-0123456789";
const RUNNER_TOKEN: &str = "runner-token-0123456789";

/// `secure`: the CA's PEM path; the server then has TLS and `[auth]` with one token for
/// `gantry batch`/`builds` and one, from `[batch] token_file`, for the runner's Bazel.
fn start_server_with(
    dir: &Path,
    deadline: &str,
    kill_grace: &str,
    secure: Option<(&str, &str, &str)>,
) -> (GantryServer, String) {
    let config = dir.join("gantry.toml");
    let mut startup = vec!["--nohome_rc".to_string(), "--noworkspace_rc".into(), "--max_idle_secs=60".into()];
    let mut extra = String::new();
    if let Some((ca, cert, key)) = secure {
        startup.push(common::bazel_tls_startup_flag(dir));
        let token_file = dir.join("runner.token");
        std::fs::write(&token_file, format!("{RUNNER_TOKEN}\n")).unwrap();
        let sha = gantry_services::auth::token_sha256;
        extra = format!(
            "token_file = {:?}\ntls_certificate = {ca:?}\n\
             [server.tls]\ncert = {cert:?}\nkey = {key:?}\n\
             [auth]\n[[auth.tokens]]\nname = \"client\"\nsha256 = \"{}\"\ngrants = [\"client\"]\n\
             [[auth.tokens]]\nname = \"runners\"\nsha256 = \"{}\"\ngrants = [\"runners\"]\n\
             [auth.grants.client]\ninstances = [\"*\"]\npermissions = [\"read\", \"batch\"]\n\
             [auth.grants.runners]\ninstances = [\"*\"]\npermissions = [\"read\", \"write_cas\", \"execute\"]\n",
            token_file.display(),
            sha(CLIENT_TOKEN),
            sha(RUNNER_TOKEN)
        );
    }
    std::fs::write(
        &config,
        format!(
            "[execution]\nworkers = 1\ndefault_timeout = \"40s\"\n\
             [batch]\nrunners = 1\nbazel_memory = \"512MiB\"\nmemory_cutoff_high = \"400MiB\"\nmemory_cutoff_medium = \"400MiB\"\nmemory_cutoff_low = \"400MiB\"\nretrain_interval = \"0s\"\ndeadline = \"{deadline}\"\nkill_grace = \"{kill_grace}\"\n\
             startup_flags = {}\nextra_flags = {}\n{extra}",
            toml_list(&startup),
            toml_list(&fixture_flags())
        ),
    )
    .unwrap();
    let server = GantryServer::start(&dir.join("data"), &["--config", config.to_str().unwrap()]);
    let scheme = if secure.is_some() { "grpcs" } else { "grpc" };
    let url = format!("{scheme}://{}", server.grpc);
    (server, url)
}

/// `gantry batch --command build --json --wait`; returns the stream id and the output.
fn batch_wait(server: &str, ws: &Path, targets: &Path, env: &[(&str, &str)]) -> (String, Output) {
    let child = gantry()
        .envs(env.iter().copied())
        .args(["batch", "--server", server, "--command", "build", "--json", "--wait", "--workspace"])
        .arg(ws)
        .arg("--targets")
        .arg(targets)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A build that is retried without end must fail the test, not hang it.
    let pid = child.id();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let killer = std::thread::spawn(move || {
        if done_rx.recv_timeout(Duration::from_secs(120)).is_err() {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
    });
    let out = child.wait_with_output().unwrap();
    let _ = done_tx.send(());
    killer.join().unwrap();
    assert!(out.status.code().is_some(), "gantry batch --wait still waiting after 120 s");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let stream = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find_map(|v| v["stream_id"].as_str().map(str::to_string))
        .unwrap_or_else(|| panic!("no stream id in {stdout}"));
    (stream, out)
}

fn sorted_targets(b: &Value) -> Vec<String> {
    let mut t: Vec<String> = b["targets"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
    t.sort();
    t
}

/// Whether `pid` is still a running process (a zombie nobody reaped has ended).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()) != Some("Z"),
        Err(_) => false,
    }
}

/// Records every pid that appears in a runner's `server/server.pid.txt` until stopped.
struct PidWatcher {
    pids: Arc<Mutex<BTreeSet<i32>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PidWatcher {
    fn start(output_base: PathBuf) -> PidWatcher {
        let pids = Arc::new(Mutex::new(BTreeSet::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (pids.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let file = output_base.join("server/server.pid.txt");
            while !s.load(Ordering::Relaxed) {
                if let Some(pid) = std::fs::read_to_string(&file).ok().and_then(|t| t.trim().parse::<i32>().ok())
                    && alive(pid)
                {
                    p.lock().unwrap().insert(pid);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        PidWatcher { pids, stop, thread: Some(thread) }
    }

    fn finish(mut self) -> BTreeSet<i32> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
        self.pids.lock().unwrap().clone()
    }
}

#[test]
fn deadline_stops_bazel_and_reruns_once() {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("WORKSPACE"), "workspace(name = \"deadline\")\n").unwrap();
    // `slow` leaves a mark when its action starts, so the test knows the deadline
    // stopped a build that was running an action, not one still starting Bazel.
    let started = dir.path().join("slow-started");
    std::fs::write(
        ws.join("BUILD"),
        format!(
            "genrule(name = \"slow\", outs = [\"slow.txt\"], cmd = \"echo x >> {} && sleep 60 && touch $@\")\n\
             genrule(name = \"quick\", outs = [\"quick.txt\"], cmd = \"touch $@\")\n",
            started.display()
        ),
    )
    .unwrap();
    let targets = dir.path().join("targets.txt");
    std::fs::write(&targets, "//:slow genrule\n//:quick genrule\n").unwrap();

    // Long enough for a cold Bazel server to start the slow action on a loaded 2-core
    // machine: at 8 s, a clean-clone run beside a compile stopped both attempts before
    // the action began (last build progress at 7.5 and 8.3 s).
    let deadline = Duration::from_secs(15);
    let grace = Duration::from_secs(2);
    let ca = Ca::new("deadline test CA");
    let (cert, key) = ca.issue(&["localhost", "127.0.0.1"]);
    let d = dir.path();
    let ca_pem = write(d, "ca.pem", &ca.pem());
    let (cert, key) = (write(d, "server.pem", &cert), write(d, "server.key", &key));
    let (server, url) = start_server_with(d, "15s", "2s", Some((&ca_pem, &cert, &key)));
    let env = [("GANTRY_TOKEN", CLIENT_TOKEN), ("GANTRY_TLS_CA", ca_pem.as_str())];
    let watcher = PidWatcher::start(dir.path().join("data/runners/r0/output_base"));
    let t = Instant::now();
    let (stream, out) = batch_wait(&url, &ws, &targets, &env);
    let waited = t.elapsed();
    let pids = watcher.finish();

    assert!(!out.status.success(), "gantry batch --wait succeeded though //:slow was never built");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("did not end in a successful build"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        started.exists(),
        "the slow action never started: the runner's Bazel did not reach the executor over TLS with its token, or the deadline hit first"
    );

    let builds = stream_builds_env(&url, &stream, &env);
    eprintln!("{builds:#?}");
    assert_eq!(builds.len(), 2, "the build and exactly one rerun: {:?}", builds.keys().collect::<Vec<_>>());
    let parent = builds.values().find(|b| b["parent_build_id"] == "").expect("the planned build");
    let id = parent["build_id"].as_str().unwrap();
    let rerun = &builds[&format!("{id}.r")];
    let limit = (deadline + grace).as_secs_f64() + 5.0;
    for b in [parent, rerun] {
        assert_eq!(b["state"], "DONE", "{b}");
        assert_eq!(b["outcome"], "DEADLINE_EXCEEDED", "{b}");
        let wall = b["wall_seconds"].as_f64().unwrap();
        assert!(
            wall >= deadline.as_secs_f64() - 0.5 && wall < limit,
            "build {} ran {wall:.1}s; deadline {deadline:?} + grace {grace:?}",
            b["build_id"]
        );
        assert!(b["message"].as_str().unwrap().contains("deadline"), "{b}");
    }
    assert_eq!(parent["retry_build_ids"], serde_json::json!([format!("{id}.r")]), "{parent}");
    assert_eq!(rerun["parent_build_id"], id, "{rerun}");
    assert_eq!(rerun["retry_kind"], "DEADLINE_RERUN", "{rerun}");
    assert_eq!(sorted_targets(rerun), sorted_targets(parent));
    assert_eq!(sorted_targets(parent), ["//:quick", "//:slow"]);
    assert_eq!(
        rerun["retry_build_ids"],
        serde_json::json!([]),
        "a rerun that missed its deadline is not run a third time: {rerun}"
    );
    // Both attempts together, less than the 60 s the action alone would take.
    assert!(waited < 2 * deadline + Duration::from_secs(20), "batch --wait took {waited:?}");

    // Each attempt started a Bazel server (the first attempt's was stopped), and none
    // outlives its deadline.
    assert!(!pids.is_empty(), "never saw the runner's Bazel server");
    let living: Vec<i32> = pids.iter().copied().filter(|p| alive(*p)).collect();
    assert!(living.is_empty(), "Bazel servers {living:?} of {pids:?} still run after their builds' deadlines");
    eprintln!(
        "RESULT deadline: batch --wait {:.1}s, walls {} / {} s, Bazel servers seen {pids:?}",
        waited.as_secs_f64(),
        parent["wall_seconds"],
        rerun["wall_seconds"]
    );
    server.stop();
}

#[test]
fn a_directory_that_is_not_a_workspace_is_an_infra_error_and_not_retried() {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("not-a-workspace");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("BUILD"), "genrule(name = \"g\", outs = [\"g.txt\"], cmd = \"touch $@\")\n").unwrap();
    let targets = dir.path().join("targets.txt");
    std::fs::write(&targets, "//:g genrule\n").unwrap();
    let (server, url) = start_server(dir.path(), "1m", "2s");

    let (stream, out) = batch_wait(&url, &ws, &targets, &[]);
    assert!(!out.status.success(), "gantry batch --wait succeeded without a workspace");
    let builds = stream_builds(&url, &stream);
    assert_eq!(builds.len(), 1, "an infra error is not retried: {builds:#?}");
    let b = builds.values().next().unwrap();
    assert_eq!(b["state"], "DONE", "{b}");
    assert_eq!(b["outcome"], "INFRA_ERROR", "{b}");
    let msg = b["message"].as_str().unwrap();
    assert!(msg.contains(&ws.display().to_string()) && msg.contains("no WORKSPACE"), "{msg}");
    assert_eq!(b["retry_build_ids"], serde_json::json!([]), "{b}");
    assert_eq!(b["retry_kind"], "UNSPECIFIED", "{b}");
    // Bazel never started for it.
    assert!(!dir.path().join("data/runners/r0/output_base/server").exists());
    server.stop();
}
