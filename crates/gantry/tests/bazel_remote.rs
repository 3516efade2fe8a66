//! Real Bazel 4.2.3 with --remote_executor against a real `gantry serve` with in-process
//! workers: builds and tests run remotely, failures are reported as Bazel reports them,
//! a clean rebuild comes from the cache, and `gantry invocation` shows the metering.

mod common;

use common::output_text as text;

use common::{process_summary, BazelWorkspace, GantryServer};

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

    // 1. Everything builds and the test passes, executed remotely.
    let out = ws.bazel_with_strategy("test", &remote(&[&format!("--invocation_id={invocation}"), "//..."]), "remote");
    let all = text(&out);
    assert!(out.status.success(), "remote build failed");
    let summary = process_summary(&String::from_utf8_lossy(&out.stderr));
    let remote_n = summary.iter().find(|(k, _)| k == "remote").map_or(0, |(_, n)| *n);
    assert!(remote_n >= 7, "expected the genrules and the test to run remotely: {summary:?}");
    assert!(summary.iter().all(|(k, _)| k == "remote" || k == "internal"), "nothing ran locally: {summary:?}");
    assert!(all.contains("//:outputs_test") && all.contains("PASSED"), "{all}");
    let big = std::fs::metadata(ws.bin().join("big.txt")).unwrap();
    assert!(big.len() > 4 << 20);

    // 2. A failing sh_test is FAILED, with its log downloaded.
    let out = ws.bazel_with_strategy("test", &remote(&["//fail:failing_test"]), "remote");
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
    let human = std::process::Command::new(env!("CARGO_BIN_EXE_gantry"))
        .args(["invocation", &invocation, "--data-dir"])
        .arg(data.path())
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&human.stdout));
    server.stop();
}
