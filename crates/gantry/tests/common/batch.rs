//! Helpers of the batching service's tests: the `gantry` CLI and a stream's builds
//! (`fixture_flags`/`toml_list` for the `[batch]` settings are in `common`).

use std::collections::BTreeMap;
use std::process::Command;

use serde_json::Value;

pub fn gantry() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gantry"))
}

/// Every build of a stream, retries included, by id (`gantry builds --json`).
pub fn stream_builds(server: &str, stream: &str) -> BTreeMap<String, Value> {
    stream_builds_env(server, stream, &[])
}

/// Like `stream_builds`, with the client's environment (`GANTRY_TOKEN`, `GANTRY_TLS_CA`).
pub fn stream_builds_env(server: &str, stream: &str, env: &[(&str, &str)]) -> BTreeMap<String, Value> {
    let out = gantry()
        .envs(env.iter().copied())
        .args(["builds", "--server", server, "--json", "--limit", "10000", "--stream", stream])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|v| (v["build_id"].as_str().unwrap().to_string(), v))
        .collect()
}
