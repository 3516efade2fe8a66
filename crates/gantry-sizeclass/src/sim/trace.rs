//! Replay traces: one action per JSONL line with its arrival time and its
//! execution time on every size class, parsed with line-precise errors.
//!
//! ```json
//! {"key":"k17","arrival_s":12.5,"duration_s":{"1":30.0,"2":16.0,"4":9.0,"8":6.0},"min_class":2,"requested_timeout_s":900}
//! ```
//!
//! On a class below `min_class` (default 1) the action fails, e.g. by
//! running out of memory, after the time given for that class.

use std::collections::BTreeMap;
use std::io::BufRead;

use serde::{Deserialize, Serialize};

use crate::{Error, SizeClass};

/// One action of a trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceAction {
    /// Action-shape key (what the scheduler would key statistics by).
    pub key: String,
    /// Arrival time in seconds from the start of the trace.
    pub arrival_s: f64,
    /// Execution time per size class (seconds); on classes below
    /// `min_class`, the time until the failure is seen.
    pub duration_s: BTreeMap<SizeClass, f64>,
    /// Smallest class on which the action can succeed.
    #[serde(default = "one")]
    pub min_class: SizeClass,
    /// The client's execution timeout in seconds.
    pub requested_timeout_s: f64,
    /// The action's mnemonic (`CppCompile`), which groups similar shapes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mnemonic: Option<String>,
    /// The basename of the action's program (`clang`), a finer group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
}

fn one() -> SizeClass {
    1
}

impl TraceAction {
    /// The action as one JSONL line (no trailing newline).
    pub fn to_json_line(&self) -> String {
        serde_json::to_string(self).expect("trace action always serializes")
    }

    fn validate(&self) -> Result<(), String> {
        if !(self.arrival_s.is_finite() && self.arrival_s >= 0.0) {
            return Err(format!("arrival_s must be finite and >= 0, got {}", self.arrival_s));
        }
        if !(self.requested_timeout_s.is_finite() && self.requested_timeout_s > 0.0) {
            return Err(format!("requested_timeout_s must be finite and > 0, got {}", self.requested_timeout_s));
        }
        if self.min_class == 0 {
            return Err("min_class must be a positive integer".into());
        }
        if self.duration_s.is_empty() {
            return Err("duration_s is empty".into());
        }
        for (c, d) in &self.duration_s {
            if *c == 0 {
                return Err("duration_s has size class 0".into());
            }
            if !(d.is_finite() && *d >= 0.0) {
                return Err(format!("duration_s[{c}] must be finite and >= 0, got {d}"));
            }
        }
        Ok(())
    }
}

/// Reads a JSONL trace. Blank lines are skipped; every other line must be
/// one [`TraceAction`]. Errors carry the 1-based line number.
pub fn parse_trace<R: BufRead>(reader: R) -> Result<Vec<TraceAction>, Error> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| Error::TraceIo { line: n, message: e.to_string() })?;
        if line.trim().is_empty() {
            continue;
        }
        let action: TraceAction =
            serde_json::from_str(&line).map_err(|e| Error::TraceLine { line: n, reason: e.to_string() })?;
        action.validate().map_err(|reason| Error::TraceLine { line: n, reason })?;
        out.push(action);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"{"key":"k17","arrival_s":12.5,"duration_s":{"1":30.0,"2":16.0,"4":9.0,"8":6.0},"min_class":2,"requested_timeout_s":900}"#;

    #[test]
    fn parses_the_documented_example_and_round_trips() {
        let input = format!(
            "{EXAMPLE}\n\n{{\"key\":\"k2\",\"arrival_s\":0,\"duration_s\":{{\"8\":1}},\"requested_timeout_s\":60}}\n"
        );
        let t = parse_trace(input.as_bytes()).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].key, "k17");
        assert_eq!(t[0].arrival_s, 12.5);
        assert_eq!(t[0].duration_s[&4], 9.0);
        assert_eq!(t[0].min_class, 2);
        assert_eq!(t[0].requested_timeout_s, 900.0);
        assert_eq!(t[1].min_class, 1, "min_class defaults to 1");
        let again = parse_trace(t[0].to_json_line().as_bytes()).unwrap();
        assert_eq!(again[0], t[0]);
    }

    #[test]
    fn errors_carry_line_numbers() {
        let cases = [
            ("not json", 1, "expected"),
            (r#"{"key":"a","arrival_s":-1,"duration_s":{"1":1},"requested_timeout_s":5}"#, 1, "arrival_s"),
            (r#"{"key":"a","arrival_s":1,"duration_s":{},"requested_timeout_s":5}"#, 1, "empty"),
            (r#"{"key":"a","arrival_s":1,"duration_s":{"0":1},"requested_timeout_s":5}"#, 1, "class 0"),
            (r#"{"key":"a","arrival_s":1,"duration_s":{"1":-2},"requested_timeout_s":5}"#, 1, "duration_s[1]"),
            (r#"{"key":"a","arrival_s":1,"duration_s":{"1":2},"requested_timeout_s":0}"#, 1, "requested_timeout_s"),
            (r#"{"key":"a","arrival_s":1,"duration_s":{"1":2},"min_class":0,"requested_timeout_s":3}"#, 1, "min_class"),
            (r#"{"key":"a","arrival_s":1,"duration_s":{"1":2},"requested_timeout_s":3,"extra":1}"#, 1, "unknown field"),
        ];
        for (line, _, want) in cases {
            let input = format!("{EXAMPLE}\n{line}\n");
            match parse_trace(input.as_bytes()) {
                Err(Error::TraceLine { line: n, reason }) => {
                    assert_eq!(n, 2, "{line}");
                    assert!(reason.contains(want), "{line}: {reason}");
                }
                other => panic!("{line}: expected TraceLine error, got {other:?}"),
            }
        }
    }
}
