//! Helpers of the batching service's tests: the `gantry` CLI, the `[batch]` settings
//! that let Bazel run offline against gantry's executor, and a stream's builds.

use std::collections::BTreeMap;
use std::process::Command;

use serde_json::Value;

use super::fixtures;

pub fn gantry() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gantry"))
}

/// The fixture flags (offline repositories), minus the local spawn strategy: builds run
/// on gantry's executor.
pub fn fixture_flags() -> Vec<String> {
    let text = std::fs::read_to_string(fixtures().join("bazel_flags.txt")).unwrap();
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with("--spawn_strategy"))
        .map(|l| l.replace("@FIXTURES@", &fixtures().display().to_string()))
        .collect()
}

pub fn toml_list(v: &[String]) -> String {
    format!("[{}]", v.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", "))
}

/// Every build of a stream, retries included, by id (`gantry builds --json`).
pub fn stream_builds(server: &str, stream: &str) -> BTreeMap<String, Value> {
    let out = gantry().args(["builds", "--server", server, "--json", "--limit", "10000", "--stream", stream]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|v| (v["build_id"].as_str().unwrap().to_string(), v))
        .collect()
}
