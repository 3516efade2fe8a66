//! Real Bazel 4.2.3 against a real `gantry serve` on loopback: a clean rebuild must come
//! entirely from the remote cache, with byte-identical outputs.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;

use common::{http_get, process_summary, BazelWorkspace, GantryServer};

fn snapshot(bin: &std::path::Path) -> BTreeMap<String, (Vec<u8>, bool)> {
    ["big.txt", "empty.txt", "hello.sh", "chain_a.txt", "chain_b.txt", "chain_c.txt"]
        .iter()
        .map(|name| {
            let p = bin.join(name);
            let data = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            let exec = std::fs::metadata(&p).unwrap().permissions().mode() & 0o111 != 0;
            (name.to_string(), (data, exec))
        })
        .collect()
}

#[test]
fn clean_rebuild_is_served_entirely_from_remote_cache() {
    let data = tempfile::tempdir().unwrap();
    let server = GantryServer::start(data.path(), &[]);
    let ws = BazelWorkspace::new();
    let remote = vec![format!("--remote_cache=grpc://{}", server.grpc), "--remote_instance_name=fixture".to_string()];

    let first = ws.bazel("test", &[remote.clone(), vec!["//...".into()]].concat());
    assert!(first.status.success(), "first build failed");
    let before = snapshot(&ws.bin());
    assert!(before["big.txt"].0.len() > 4 << 20, "fixture writes a file over 4 MiB");
    assert!(before["empty.txt"].0.is_empty());
    assert!(before["hello.sh"].1, "script is executable");

    // The server holds the outputs now.
    let metrics = http_get(&server.http, "/metrics");
    assert!(metric(&metrics, "gantry_cas_blobs") >= 6.0, "{metrics}");

    assert!(ws.bazel("clean", &[]).status.success());
    assert!(!ws.dir.path().join("base/execroot/gantry_fixture/bazel-out").join("k8-fastbuild/bin/big.txt").exists());

    let second = ws.bazel("test", &[remote.clone(), vec!["//...".into()]].concat());
    assert!(second.status.success(), "rebuild failed");
    let stderr = String::from_utf8_lossy(&second.stderr);
    let summary = process_summary(&stderr);
    let hits = summary.iter().find(|(k, _)| k == "remote cache hit").map(|(_, n)| *n).unwrap_or(0);
    // Everything except Bazel's "internal" bookkeeping must be a remote cache hit.
    let executed: Vec<_> = summary.iter().filter(|(k, _)| k != "remote cache hit" && k != "internal").collect();
    assert!(executed.is_empty(), "actions ran instead of coming from the cache: {summary:?}");
    // 6 genrules + the test + its test.xml generation
    assert!(hits >= 8, "expected at least 8 remote cache hits, got {summary:?}");
    let stdout = String::from_utf8_lossy(&second.stdout);
    assert!(
        stdout.contains("(cached) PASSED") || stderr.contains("(cached) PASSED"),
        "test result was not served from the cache:\n{stdout}"
    );

    let after = snapshot(&ws.bin());
    assert_eq!(before.keys().collect::<Vec<_>>(), after.keys().collect::<Vec<_>>());
    for (name, (data, exec)) in &before {
        assert!(after[name].0 == *data, "{name} differs after the cached rebuild");
        assert_eq!(after[name].1, *exec, "{name} executable bit differs");
    }

    let metrics = http_get(&server.http, "/metrics");
    assert!(metric(&metrics, "gantry_action_cache_hits_total") >= 8.0, "{metrics}");
    assert!(metrics.contains("method=\"ByteStream/Read\""), "the 5 MB output came through ByteStream");
    server.stop();
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} not found"))
}
