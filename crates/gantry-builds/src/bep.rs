//! Reading Bazel's Build Event Protocol JSON file (`--build_event_json_file`): the few
//! facts the runner needs, tolerant of a file cut short by a killed Bazel.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

/// What one build's BEP says about its end, memory and tests.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BepSummary {
    /// `buildFinished.exitCode.name`, e.g. "SUCCESS", "BUILD_FAILURE", "OOM_ERROR".
    pub exit_code_name: Option<String>,
    pub exit_code: Option<i32>,
    /// `buildMetrics.memoryMetrics.usedHeapSizePostBuild` (needs
    /// `--bep_publish_used_heap_size_post_build`).
    pub used_heap_post_build: Option<u64>,
    /// `buildMetrics.memoryMetrics.peakPostGcHeapSize` (only when a major GC ran).
    pub peak_post_gc_heap: Option<u64>,
    pub tests_passed: u64,
    pub tests_failed: u64,
    pub targets_failed: u64,
    /// Events read; 0 means Bazel never got as far as writing one.
    pub events: u64,
    /// Per target label: whether it passed. A test passes on its `testSummary` (PASSED
    /// or FLAKY), any other target on its `targetCompleted`; a test whose summary was
    /// not written counts by its build alone, so readers must not take a missing label
    /// for a pass.
    pub targets: BTreeMap<String, bool>,
    /// Tests whose summary is FLAKY: they failed, then passed on a retry in the build.
    pub flaky: Vec<String>,
}

impl BepSummary {
    /// The labels of `requested` that did not pass: failed, or never reported (Bazel
    /// stopped before them). Complete by construction, since only a reported pass counts.
    pub fn not_passed(&self, requested: &[String]) -> Vec<String> {
        requested.iter().filter(|l| self.targets.get(*l) != Some(&true)).cloned().collect()
    }
}

/// BEP encodes int64 as JSON strings; accept numbers too.
fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

/// Parses the JSON lines; an undecodable line (a write cut short) ends the reading.
pub fn parse(text: &str) -> BepSummary {
    let mut s = BepSummary::default();
    for line in text.lines() {
        let Ok(ev) = serde_json::from_str::<Value>(line) else { break };
        s.events += 1;
        if let Some(f) = ev.get("finished")
            && let Some(code) = f.get("exitCode")
        {
            s.exit_code_name = code.get("name").and_then(Value::as_str).map(str::to_string);
            s.exit_code = Some(code.get("code").and_then(Value::as_i64).unwrap_or(0) as i32);
        }
        if let Some(mem) = ev.get("buildMetrics").and_then(|m| m.get("memoryMetrics")) {
            s.used_heap_post_build = mem.get("usedHeapSizePostBuild").and_then(as_u64).filter(|&v| v > 0);
            s.peak_post_gc_heap = mem.get("peakPostGcHeapSize").and_then(as_u64).filter(|&v| v > 0);
        }
        let label = |kind: &str| {
            ev.get("id")
                .and_then(|i| i.get(kind))
                .and_then(|k| k.get("label"))
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        if let Some(ts) = ev.get("testSummary") {
            let status = ts.get("overallStatus").and_then(Value::as_str);
            if let (Some("FLAKY"), Some(l)) = (status, label("testSummary")) {
                s.flaky.push(l);
            }
            let passed = match status {
                Some("PASSED") | Some("FLAKY") => {
                    s.tests_passed += 1;
                    true
                }
                Some(_) => {
                    s.tests_failed += 1;
                    false
                }
                None => false,
            };
            if let Some(l) = label("testSummary") {
                s.targets.insert(l, passed);
            }
        }
        if ev.get("id").and_then(|i| i.get("targetCompleted")).is_some() {
            let ok = ev.get("completed").and_then(|c| c.get("success")).and_then(Value::as_bool).unwrap_or(false);
            if !ok {
                s.targets_failed += 1;
            }
            if let Some(l) = label("targetCompleted") {
                // A test's summary, which comes after, has the last word.
                let e = s.targets.entry(l).or_insert(ok);
                *e &= ok;
            }
        }
    }
    s
}

/// Reads and parses the file; a missing file is an empty summary (Bazel died early).
pub fn read(path: &Path) -> BepSummary {
    std::fs::read_to_string(path).map(|t| parse(&t)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_exit_memory_and_tests_and_stops_at_a_torn_line() {
        let text = concat!(
            r#"{"id":{"started":{}},"started":{"uuid":"x"}}"#,
            "\n",
            r#"{"id":{"targetCompleted":{"label":"//a:b"}},"completed":{"success":true}}"#,
            "\n",
            r#"{"id":{"targetCompleted":{"label":"//a:c"}},"completed":{}}"#,
            "\n",
            r#"{"id":{"testSummary":{"label":"//a:t"}},"testSummary":{"overallStatus":"FAILED"}}"#,
            "\n",
            r#"{"id":{"testSummary":{"label":"//a:u"}},"testSummary":{"overallStatus":"PASSED"}}"#,
            "\n",
            r#"{"id":{"testSummary":{"label":"//a:f"}},"testSummary":{"overallStatus":"FLAKY"}}"#,
            "\n",
            r#"{"id":{"buildFinished":{}},"finished":{"overallSuccess":false,"exitCode":{"name":"TESTS_FAILED","code":3}}}"#,
            "\n",
            r#"{"id":{"buildMetrics":{}},"buildMetrics":{"memoryMetrics":{"usedHeapSizePostBuild":"31690800","peakPostGcHeapSize":"0"}}}"#,
            "\n",
            r#"{"id":{"buildToolLogs":{}},"buildTo"#,
        );
        let s = parse(text);
        assert_eq!(s.exit_code_name.as_deref(), Some("TESTS_FAILED"));
        assert_eq!(s.exit_code, Some(3));
        assert_eq!(s.used_heap_post_build, Some(31_690_800));
        assert_eq!(s.peak_post_gc_heap, None, "a zero peak means no major GC ran: absent, not 0");
        assert_eq!((s.tests_passed, s.tests_failed, s.targets_failed), (2, 1, 1));
        assert_eq!(s.events, 8);
        assert_eq!(s.flaky, ["//a:f"]);
        let requested: Vec<String> =
            ["//a:b", "//a:c", "//a:t", "//a:u", "//a:f", "//a:never"].map(String::from).to_vec();
        assert_eq!(s.not_passed(&requested), ["//a:c", "//a:t", "//a:never"], "failed, or never reported");
    }

    #[test]
    fn success_has_code_zero_without_a_code_field() {
        // proto3 JSON omits zero values: SUCCESS carries no "code".
        let s =
            parse(r#"{"id":{"buildFinished":{}},"finished":{"overallSuccess":true,"exitCode":{"name":"SUCCESS"}}}"#);
        assert_eq!(s.exit_code, Some(0));
        assert_eq!(read(Path::new("/nonexistent/bep.json")), BepSummary::default());
    }
}
