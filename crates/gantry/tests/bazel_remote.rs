//! Real Bazel 4.2.3 with --remote_executor against a real `gantry serve` with in-process
//! workers: builds and tests run remotely, failures are reported as Bazel reports them,
//! a clean rebuild comes from the cache, the Build Event Service stores each invocation
//! with its targets and tests, and `gantry invocation` shows them with the metering.

mod common;

use common::output_text as text;

use common::{http_get, process_summary, BazelWorkspace, GantryServer};

#[test]
fn bazel_remote_execution_end_to_end() {
    let data = tempfile::tempdir().unwrap();
    let server = GantryServer::start(data.path(), &[]);
    let ws = BazelWorkspace::new();
    let invocation = uuid::Uuid::new_v4().to_string();
    let remote = |extra: &[&str]| -> Vec<String> {
        let mut v = vec![
            format!("--remote_executor=grpc://{}", server.grpc),
            "--remote_instance_name=rx".to_string(),
            "--remote_timeout=120".to_string(),
        ];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };

    let bes_backend = format!("--bes_backend=grpc://{}", server.grpc);
    let bes_results = format!("--bes_results_url=http://{}/invocations/", server.http);

    // 1. Everything builds and the test passes, executed remotely.
    let out = ws.bazel_with_strategy(
        "test",
        &remote(&[
            &format!("--invocation_id={invocation}"),
            &bes_backend,
            &bes_results,
            "--build_metadata=TEAM=infra",
            "//...",
        ]),
        "remote",
    );
    let all = text(&out);
    assert!(all.contains(&format!("http://{}/invocations/{invocation}", server.http)), "the link is printed: {all}");
    assert!(out.status.success(), "remote build failed: {all}");
    let summary = process_summary(&String::from_utf8_lossy(&out.stderr));
    let remote_n = summary.iter().find(|(k, _)| k == "remote").map_or(0, |(_, n)| *n);
    assert!(remote_n >= 7, "expected the genrules and the test to run remotely: {summary:?}");
    assert!(summary.iter().all(|(k, _)| k == "remote" || k == "internal"), "nothing ran locally: {summary:?}");
    assert!(all.contains("//:outputs_test") && all.contains("PASSED"), "{all}");
    let big = std::fs::metadata(ws.bin().join("big.txt")).unwrap();
    assert!(big.len() > 4 << 20);

    // 2. A failing sh_test is FAILED, with its log downloaded.
    let failing = uuid::Uuid::new_v4().to_string();
    let out = ws.bazel_with_strategy(
        "test",
        &remote(&[&format!("--invocation_id={failing}"), &bes_backend, "//fail:failing_test"]),
        "remote",
    );
    assert_eq!(out.status.code(), Some(3), "a test failure is Bazel exit code 3");
    assert!(text(&out).contains("FAILED"), "{}", text(&out));
    let log = std::fs::read_to_string(ws.testlogs().join("fail/failing_test/test.log")).unwrap();
    assert!(log.contains("GANTRY_FIXTURE_FAIL_MARKER"), "test log: {log}");

    // 3. A genrule that exits 1 fails the build, with its stderr shown.
    let out = ws.bazel_with_strategy("build", &remote(&["//fail:genrule_exit1"]), "remote");
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("GANTRY_FIXTURE_FAIL_MARKER"), "{}", text(&out));

    // 3b. Platform properties from Bazel reach the scheduler: one every worker offers runs,
    // one no worker offers fails with the property named.
    let out = ws.bazel_with_strategy(
        "build",
        &remote(&["--remote_default_exec_properties=OSFamily=linux", "--remote_instance_name=props", "//:chain_c"]),
        "remote",
    );
    assert!(out.status.success(), "{}", text(&out));
    let out = ws.bazel_with_strategy(
        "build",
        &remote(&["--remote_default_exec_properties=pool=tpu", "--remote_instance_name=props2", "//:chain_a"]),
        "remote",
    );
    assert!(!out.status.success());
    assert!(text(&out).contains("pool=tpu"), "{}", text(&out));

    // 4. A clean rebuild comes from gantry's cache.
    assert!(ws.bazel("clean", &[]).status.success());
    let out = ws.bazel_with_strategy("test", &remote(&["//..."]), "remote");
    assert!(out.status.success());
    let summary = process_summary(&String::from_utf8_lossy(&out.stderr));
    assert!(summary.iter().all(|(k, _)| k == "remote cache hit" || k == "internal"), "{summary:?}");
    assert!(summary.iter().any(|(k, n)| k == "remote cache hit" && *n >= 7), "{summary:?}");

    // 5. The invocation's metering.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gantry"))
        .args(["invocation", &invocation, "--json", "--data-dir"])
        .arg(data.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["actions"].as_u64().unwrap() >= 7, "{v}");
    assert!(v["executor_service_seconds"].as_f64().unwrap() > 0.0);
    for e in v["executions"].as_array().unwrap() {
        assert!(e["peak_memory_bytes"].as_u64().unwrap() > 0, "{e}");
        assert!(e["wall_seconds"].as_f64().unwrap() > 0.0, "{e}");
        assert!(!e["mnemonic"].as_str().unwrap().is_empty(), "{e}");
        let how = e["metering"].as_str().unwrap();
        assert!(["cgroup-v2", "cgroup-v1", "rusage"].contains(&how), "{e}");
    }
    // What the Build Event Service stored: the command, every target with its kind and
    // outcome, the test result with its log in the CAS, the build metadata.
    let b = &v["build"];
    assert_eq!(
        (b["command"].as_str(), b["exit_name"].as_str(), b["exit_code"].as_i64()),
        (Some("test"), Some("SUCCESS"), Some(0)),
        "{b}"
    );
    assert_eq!(b["patterns"], serde_json::json!(["//..."]), "{b}");
    assert_eq!(b["metadata"]["TEAM"], "infra", "{b}");
    assert!(b["finished_unix_ms"].as_i64() >= b["started_unix_ms"].as_i64() && b["started_unix_ms"].as_i64() > Some(0));
    let targets = b["targets"].as_array().unwrap();
    assert!(targets.len() >= 7, "every target: {b}");
    assert!(targets.iter().all(|t| t["success"] == true), "{b}");
    let test_target = targets.iter().find(|t| t["label"] == "//:outputs_test").expect("the test target");
    assert!(test_target["kind"].as_str().unwrap().contains("sh_test"), "{test_target}");
    let tests = b["tests"].as_array().unwrap();
    let t = tests.iter().find(|t| t["label"] == "//:outputs_test").expect("its test result");
    assert_eq!(t["status"], "PASSED", "{t}");
    let log = t["logs"].as_array().unwrap().iter().find(|l| l["name"] == "test.log").expect("test.log");
    assert!(log["uri"].as_str().unwrap().starts_with("bytestream://"), "a CAS reference: {log}");
    // The page Bazel linked to shows the same: the targets, the test, its log in the CAS,
    // and the remote actions with their peak memory.
    let page = http_get(&server.http, &format!("/invocations/{invocation}"));
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    for want in ["//:outputs_test", "sh_test rule", "PASSED", "Remote actions", "Genrule", "Peak MiB"] {
        assert!(page.contains(want), "{want} missing from the invocation page: {page}");
    }
    let log_link = page.split("href=\"/blobs/").nth(1).and_then(|s| s.split('"').next()).expect("a test log link");
    let log = http_get(&server.http, &format!("/blobs/{log_link}"));
    assert!(log.starts_with("HTTP/1.1 200") && log.contains("text/plain"), "{log}");
    let list = http_get(&server.http, "/invocations");
    assert!(
        list.contains(&format!("/invocations/{invocation}")) && list.contains(&format!("/invocations/{failing}")),
        "{list}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gantry"))
        .args(["invocation", &failing, "--json", "--data-dir"])
        .arg(data.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let f: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let b = &f["build"];
    assert_eq!((b["exit_code"].as_i64(), b["exit_name"].as_str()), (Some(3), Some("TESTS_FAILED")), "{b}");
    let t = &b["tests"].as_array().unwrap()[0];
    assert_eq!((t["label"].as_str(), t["status"].as_str()), (Some("//fail:failing_test"), Some("FAILED")), "{t}");

    let human = std::process::Command::new(env!("CARGO_BIN_EXE_gantry"))
        .args(["invocation", &invocation, "--data-dir"])
        .arg(data.path())
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&human.stdout));
    server.stop();
}
