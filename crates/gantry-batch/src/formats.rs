//! File-format helpers for the CLI: `targets.txt`, the build-context JSON
//! and the batch JSONL output. Parsing errors always name where they are.

use crate::error::{BatchError, Result};
use crate::label::parse_label;
use crate::types::{Batch, BuildContext, Target};
use std::io::{BufRead, Write};

/// Parse one `targets.txt` line: `LABEL [RULE_KIND [TAG,TAG,...]]`.
/// Returns `Ok(None)` for blank lines and `#` comments.
pub fn parse_target_line(line: &str, line_no: usize) -> Result<Option<Target>> {
    let err = |reason: String| BatchError::TargetsLine { line: line_no, reason };
    let trimmed = line.trim();
    if trimmed.is_empty() || trimmed.starts_with('#') {
        return Ok(None);
    }
    let mut fields = trimmed.split_whitespace();
    let label = fields.next().expect("non-empty line has a field");
    parse_label(label).map_err(|e| err(e.to_string()))?;
    let rule_kind = fields.next().map(str::to_string);
    if let Some(k) = &rule_kind
        && !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Err(err(format!("rule kind `{k}` must be [A-Za-z0-9_]+")));
    }
    let tags = match fields.next() {
        None => Vec::new(),
        Some(list) => {
            let tags: Vec<String> = list.split(',').map(str::to_string).collect();
            if let Some(pos) = tags.iter().position(String::is_empty) {
                return Err(err(format!("empty tag at position {} in `{list}`", pos + 1)));
            }
            tags
        }
    };
    if let Some(extra) = fields.next() {
        return Err(err(format!("unexpected fourth field `{extra}`; tags are one comma-separated field")));
    }
    Ok(Some(Target { label: label.to_string(), rule_kind, tags }))
}

/// Read a whole `targets.txt`.
pub fn read_targets(reader: impl BufRead) -> Result<Vec<Target>> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| BatchError::TargetsLine { line: i + 1, reason: e.to_string() })?;
        if let Some(t) = parse_target_line(&line, i + 1)? {
            out.push(t);
        }
    }
    Ok(out)
}

/// Parse `targets.txt` content from a string.
pub fn parse_targets(text: &str) -> Result<Vec<Target>> {
    read_targets(text.as_bytes())
}

/// Parse and validate a build-context JSON document.
pub fn parse_context(json: &str) -> Result<BuildContext> {
    let ctx: BuildContext = serde_json::from_str(json).map_err(|e| BatchError::InvalidContext(e.to_string()))?;
    ctx.validate()?;
    Ok(ctx)
}

/// One batch as a JSON line (no trailing newline).
pub fn batch_to_json_line(batch: &Batch) -> Result<String> {
    Ok(serde_json::to_string(batch)?)
}

/// Write batches as JSONL, one batch per line.
pub fn write_batches(mut w: impl Write, batches: &[Batch]) -> Result<()> {
    for b in batches {
        serde_json::to_writer(&mut w, b)?;
        w.write_all(b"\n").map_err(|e| BatchError::io("<batch writer>", e))?;
    }
    Ok(())
}

/// Read batch JSONL back (used by tests and for replaying plans).
pub fn read_batches(reader: impl BufRead) -> Result<Vec<Batch>> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| BatchError::io("<batch reader>", e))?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(
            serde_json::from_str(&line).map_err(|e| BatchError::InvalidConfig(format!("batch line {}: {e}", i + 1)))?,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{BatchSizeReason, Command, Priority};

    #[test]
    fn parses_targets_file() {
        let text = "# comment\n//a:b\n\n//a:c cc_test\n//a/x ios_ui_test requires-mac,manual\n";
        let ts = parse_targets(text).unwrap();
        assert_eq!(ts.len(), 3);
        assert_eq!(ts[0], Target::new("//a:b"));
        assert_eq!(ts[1].rule_kind.as_deref(), Some("cc_test"));
        assert_eq!(ts[2].tags, vec!["requires-mac", "manual"]);
    }

    fn line_of(text: &str) -> (usize, String) {
        match parse_targets(text) {
            Err(BatchError::TargetsLine { line, reason }) => (line, reason),
            other => panic!("expected TargetsLine error, got {other:?}"),
        }
    }

    #[test]
    fn targets_errors_name_line_and_cause() {
        let (l, r) = line_of("//a:b\n\n//a:\n");
        assert_eq!(l, 3);
        assert!(r.contains("target name after `:` is empty"), "{r}");
        let (l, r) = line_of("//a:b cc_test a,,b\n");
        assert_eq!(l, 1);
        assert!(r.contains("empty tag at position 2"), "{r}");
        let (l, r) = line_of("# x\n//a:b cc_test t extra\n");
        assert_eq!(l, 2);
        assert!(r.contains("fourth field"), "{r}");
        let (_, r) = line_of("//a:b cc-test\n");
        assert!(r.contains("rule kind"), "{r}");
    }

    #[test]
    fn context_json() {
        let ctx = parse_context(
            r#"{"workspace":"ws1","command":"test","flags":["--jobs=100"],"priority":"HIGH","user":"alice","product_area":"ads","tool_tag":"presubmit"}"#,
        )
        .unwrap();
        assert_eq!(ctx.command, Command::Test);
        assert_eq!(ctx.priority, Priority::High);
        assert_eq!(ctx.flags, vec!["--jobs=100"]);
        let lower = parse_context(r#"{"git_repo":"r","revision":"abc","command":"build","priority":"low"}"#).unwrap();
        assert_eq!(lower.priority, Priority::Low);
        let e = parse_context(r#"{"command":"build","priority":"LOW"}"#).unwrap_err();
        assert!(e.to_string().contains("required"), "{e}");
        let e = parse_context(r#"{"workspace":"w","command":"run","priority":"LOW"}"#).unwrap_err();
        assert!(e.to_string().contains("run"), "{e}");
        let e = parse_context(r#"{"workspace":"w","command":"build","priority":"LOW","bogus":1}"#).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
    }

    #[test]
    fn batch_jsonl_roundtrip() {
        let b = Batch {
            targets: vec!["//a:b".into(), "//a:c".into()],
            reason: BatchSizeReason::MaxMemory,
            memory_estimate_bytes: Some(123),
            occupancy_estimate_esu: Some(4.5),
            oom_probability: None,
            executor_types: ["x86".to_string()].into_iter().collect(),
        };
        let line = batch_to_json_line(&b).unwrap();
        assert!(line.starts_with(r#"{"targets":["//a:b","//a:c"],"reason":"MAX_MEMORY","memory_estimate_bytes":123,"occupancy_estimate_esu":4.5"#), "{line}");
        let mut buf = Vec::new();
        write_batches(&mut buf, &[b.clone(), b.clone()]).unwrap();
        let back = read_batches(buf.as_slice()).unwrap();
        assert_eq!(back, vec![b.clone(), b]);
    }
}
