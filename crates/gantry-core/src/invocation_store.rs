//! Invocations as the Build Event Service received them: what Bazel ran (command,
//! patterns, options, build metadata), when and how it ended, and every target and test
//! with its outcome. The web pages and `gantry invocation` read them; the execution log
//! (keyed by the same invocation id) holds the invocation's remote actions.

use std::collections::BTreeMap;

use async_trait::async_trait;

use crate::Result;

/// One Bazel invocation, whole.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Invocation {
    /// Bazel's invocation id (also the `tool_invocation_id` of its remote actions).
    pub id: String,
    pub build_id: String,
    /// The identity that published it (`[auth]`), empty without authentication.
    pub owner: String,
    /// Who ran it, for people: the owner, else the workspace status's BUILD_USER (set in
    /// every row, see [`Invocation::user_of`]).
    pub user: String,
    /// `build`, `test`, ...
    pub command: String,
    pub patterns: Vec<String>,
    /// The options given on the command line (explicit ones, as Bazel reports them).
    pub options: Vec<String>,
    /// `--build_metadata` and the workspace status (BUILD_USER, BUILD_HOST, ...).
    pub metadata: BTreeMap<String, String>,
    pub started_unix_ms: i64,
    pub finished_unix_ms: i64,
    /// Bazel's exit code and its name (`SUCCESS`, `BUILD_FAILURE`, ...); -1 and empty
    /// when the build never reported one (it was aborted).
    pub exit_code: i32,
    pub exit_name: String,
    /// Empty in [`InvocationStore::list`]'s rows.
    pub targets: Vec<TargetOutcome>,
    /// Empty in [`InvocationStore::list`]'s rows.
    pub tests: Vec<TestOutcome>,
    /// Number of targets and of failed ones (set in every row).
    pub target_count: u64,
    pub failed_targets: u64,
    /// The remote instance its build used (`--remote_instance_name`, else the default
    /// ""): what decides who may see it. Stores derive it from `options`.
    pub instance: String,
    /// Remote cache lookups (GetActionResult) made for the invocation and how many found a
    /// result, summed over every gantry process that served them (each records its counts
    /// with [`InvocationStore::record_cache_counts`]); set in every row read, and not
    /// written by [`InvocationStore::put`] (which keeps what an older gantry stored).
    pub cache_lookups: u64,
    pub cache_hits: u64,
    /// Bazel's own critical path, the text of its "critical path" build tool log; empty
    /// when Bazel did not send one.
    pub critical_path: String,
}

impl Invocation {
    /// The `--remote_instance_name` among Bazel's options (the last one wins, as in Bazel).
    pub fn instance_of(options: &[String]) -> String {
        let mut found = String::new();
        let mut it = options.iter();
        while let Some(o) = it.next() {
            if let Some(v) = o.strip_prefix("--remote_instance_name=") {
                found = v.to_string();
            } else if o == "--remote_instance_name" {
                found = it.next().cloned().unwrap_or_default();
            }
        }
        found
    }

    /// Who ran it: the identity that published it, else Bazel's workspace status user.
    pub fn user_of(owner: &str, metadata: &BTreeMap<String, String>) -> String {
        if !owner.is_empty() {
            return owner.to_string();
        }
        metadata.get("BUILD_USER").or_else(|| metadata.get("USER")).cloned().unwrap_or_default()
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct TargetOutcome {
    pub label: String,
    /// The rule kind (`cc_binary rule`, `genrule rule`); empty if never configured.
    pub kind: String,
    /// None when the target was configured but never completed (the build stopped).
    pub success: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct TestOutcome {
    pub label: String,
    pub run: i32,
    pub shard: i32,
    pub attempt: i32,
    /// `PASSED`, `FAILED`, `FLAKY`, `TIMEOUT`, ...
    pub status: String,
    pub duration_ms: i64,
    pub cached_locally: bool,
    /// Its outputs (`test.log`, `test.xml`) by name, as the URIs Bazel gave: with remote
    /// execution or caching, `bytestream://host/blobs/HASH/SIZE` references into the CAS.
    pub logs: Vec<(String, String)>,
}

/// One process's running totals of an invocation's remote cache lookups and hits.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CacheCounts {
    pub invocation: String,
    pub lookups: u64,
    pub hits: u64,
}

#[async_trait]
pub trait InvocationStore: Send + Sync + 'static {
    /// Stores a finished invocation with its targets and tests, all or nothing, in place of
    /// any earlier one with its id.
    async fn put(&self, invocation: &Invocation) -> Result<()>;
    async fn get(&self, id: &str) -> Result<Option<Invocation>>;
    /// The newest invocations first, started before `before_unix_ms` when given, without
    /// their targets and tests.
    async fn list(&self, limit: usize, before_unix_ms: Option<i64>) -> Result<Vec<Invocation>>;
    /// Records `process`'s totals so far for each invocation, in place of that process's
    /// earlier totals (so a repeated call counts nothing twice), all or nothing. A build's
    /// lookups may go to several frontends: an invocation's counts are the sum over the
    /// processes, whether or not its build events have arrived yet.
    async fn record_cache_counts(&self, process: &str, counts: &[CacheCounts]) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_instance_comes_from_the_last_remote_instance_name() {
        let o = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(Invocation::instance_of(&o(&["--remote_executor=grpc://x"])), "");
        assert_eq!(Invocation::instance_of(&o(&["--remote_instance_name=a", "--remote_instance_name=b/c"])), "b/c");
        assert_eq!(Invocation::instance_of(&o(&["--remote_instance_name", "sep"])), "sep");
    }
}
