//! Build history records (the training data) and the minimal RFC 3339
//! timestamp type they carry.
//!
//! Owns the JSONL history format, one build per line, and the time-window
//! selection used by training. RFC 3339 is parsed by hand (no `time`/`chrono`
//! dependency): the format is small and fixed, and keeping the dependency
//! list short matters on a 2-core builder.

use crate::error::{BatchError, Result};
use crate::types::{BuildContext, Command, Priority};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::io::{BufRead, Write};

/// Seconds since the Unix epoch, UTC. (De)serialises as RFC 3339.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub i64);

pub const SECONDS_PER_DAY: i64 = 86_400;

// Days since 1970-01-01 for a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

impl Timestamp {
    /// Parse `YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`. Fractions are dropped
    /// (windows are days long). `t`/`z`/space separators are accepted as
    /// RFC 3339 allows.
    pub fn parse_rfc3339(s: &str) -> Result<Timestamp> {
        let err = |reason: &str| BatchError::InvalidTimestamp { value: s.to_string(), reason: reason.to_string() };
        let b = s.as_bytes();
        if b.len() < 20 {
            return Err(err("too short; expected YYYY-MM-DDTHH:MM:SSZ"));
        }
        let num = |range: std::ops::Range<usize>, what: &str| -> Result<i64> {
            let part = &s[range];
            if !part.bytes().all(|c| c.is_ascii_digit()) {
                return Err(err(&format!("{what} `{part}` is not numeric")));
            }
            Ok(part.parse::<i64>().expect("digits"))
        };
        if b[4] != b'-' || b[7] != b'-' {
            return Err(err("date must be YYYY-MM-DD"));
        }
        if !matches!(b[10], b'T' | b't' | b' ') {
            return Err(err("missing `T` between date and time"));
        }
        if b[13] != b':' || b[16] != b':' {
            return Err(err("time must be HH:MM:SS"));
        }
        let (y, mo, d) = (num(0..4, "year")?, num(5..7, "month")?, num(8..10, "day")?);
        let (h, mi, se) = (num(11..13, "hour")?, num(14..16, "minute")?, num(17..19, "second")?);
        if !(1..=12).contains(&mo) {
            return Err(err("month out of range"));
        }
        let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
        let mdays = [31, if leap { 29 } else { 28 }, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
        if d < 1 || d > mdays[(mo - 1) as usize] {
            return Err(err("day out of range for month"));
        }
        if h > 23 || mi > 59 || se > 60 {
            return Err(err("time of day out of range"));
        }
        let mut i = 19;
        if i < b.len() && b[i] == b'.' {
            i += 1;
            let start = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            if i == start {
                return Err(err("empty fractional seconds"));
            }
        }
        let offset = match &s[i..] {
            "Z" | "z" => 0,
            tz if tz.len() == 6 && (tz.starts_with('+') || tz.starts_with('-')) && &tz[3..4] == ":" => {
                let oh = num(i + 1..i + 3, "offset hour")?;
                let om = num(i + 4..i + 6, "offset minute")?;
                if oh > 23 || om > 59 {
                    return Err(err("offset out of range"));
                }
                let sign = if tz.starts_with('-') { -1 } else { 1 };
                sign * (oh * 3600 + om * 60)
            }
            "" => return Err(err("missing time zone (`Z` or `±HH:MM`)")),
            _ => return Err(err("malformed time zone")),
        };
        let secs = days_from_civil(y, mo, d) * SECONDS_PER_DAY + h * 3600 + mi * 60 + se.min(59);
        Ok(Timestamp(secs - offset))
    }

    /// Format as `YYYY-MM-DDTHH:MM:SSZ`.
    pub fn to_rfc3339(self) -> String {
        let days = self.0.div_euclid(SECONDS_PER_DAY);
        let rem = self.0.rem_euclid(SECONDS_PER_DAY);
        let (y, m, d) = civil_from_days(days);
        format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, (rem / 60) % 60, rem % 60)
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_rfc3339())
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Timestamp::parse_rfc3339(&s).map_err(serde::de::Error::custom)
    }
}

/// How a historical build ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Outcome {
    Success,
    Oom,
    DeadlineExceeded,
    /// Failed, cause not recorded (older histories and the simulator).
    Failed,
    BuildFailed,
    TestsFailed,
    /// Not the targets' doing (Bazel crashed, lost its executor...): its labels are not
    /// trusted, so training skips it.
    InfraError,
}

/// One executed build: features (context + targets) and both labels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BuildRecord {
    pub id: String,
    pub time: Timestamp,
    pub priority: Priority,
    pub command: Command,
    #[serde(default)]
    pub user: String,
    #[serde(default)]
    pub product_area: String,
    #[serde(default)]
    pub tool_tag: String,
    #[serde(default)]
    pub flags: Vec<String>,
    pub targets: Vec<String>,
    /// Peak post-full-GC heap (or peak heap if no full GC ran), bytes.
    pub peak_memory_bytes: u64,
    /// Sum over actions of executors (ESU) x seconds.
    pub executor_service_seconds: f64,
    /// Command wall time excluding Bazel startup.
    pub wall_seconds: f64,
    pub outcome: Outcome,
}

impl BuildRecord {
    /// Average executor occupancy in ESU, or `None` when wall time is not
    /// positive (such records cannot teach the occupancy model anything).
    pub fn occupancy_esu(&self) -> Option<f64> {
        (self.wall_seconds > 0.0 && self.executor_service_seconds.is_finite())
            .then(|| self.executor_service_seconds.max(0.0) / self.wall_seconds)
    }

    /// The build context this record ran with (workspace is a placeholder:
    /// the source tree does not influence the features).
    pub fn context(&self) -> BuildContext {
        BuildContext {
            workspace: Some("history".to_string()),
            git_repo: None,
            revision: None,
            command: self.command,
            flags: self.flags.clone(),
            priority: self.priority,
            user: self.user.clone(),
            product_area: self.product_area.clone(),
            tool_tag: self.tool_tag.clone(),
        }
    }
}

/// Parse history JSONL from a reader; blank lines are skipped, the error
/// names the 1-based line.
pub fn read_history(reader: impl BufRead) -> Result<Vec<BuildRecord>> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| BatchError::HistoryLine { line: i + 1, reason: e.to_string() })?;
        if line.trim().is_empty() {
            continue;
        }
        let rec: BuildRecord =
            serde_json::from_str(&line).map_err(|e| BatchError::HistoryLine { line: i + 1, reason: e.to_string() })?;
        if rec.targets.is_empty() {
            return Err(BatchError::HistoryLine { line: i + 1, reason: "build has no targets".into() });
        }
        out.push(rec);
    }
    Ok(out)
}

/// Parse history JSONL from a string.
pub fn parse_history(text: &str) -> Result<Vec<BuildRecord>> {
    read_history(text.as_bytes())
}

/// Write history as JSONL.
pub fn write_history(mut w: impl Write, records: &[BuildRecord]) -> Result<()> {
    for r in records {
        serde_json::to_writer(&mut w, r)?;
        w.write_all(b"\n").map_err(|e| BatchError::io("<history writer>", e))?;
    }
    Ok(())
}

/// Records with `now - days*86400 <= time < now`, i.e. the training window
/// ending at `now` (future-dated records are excluded: the clock is passed in
/// so that replaying history is reproducible).
pub fn window(records: &[BuildRecord], now: Timestamp, days: f64) -> Vec<&BuildRecord> {
    let start = now.0 - (days * SECONDS_PER_DAY as f64).round() as i64;
    records.iter().filter(|r| r.time.0 >= start && r.time.0 < now.0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_roundtrip_and_offsets() {
        let t = Timestamp::parse_rfc3339("2020-01-16T00:00:00Z").unwrap();
        assert_eq!(t.0, 1_579_132_800);
        assert_eq!(t.to_rfc3339(), "2020-01-16T00:00:00Z");
        let o = Timestamp::parse_rfc3339("2020-01-16T02:30:00.123+02:30").unwrap();
        assert_eq!(o, t);
        let leap = Timestamp::parse_rfc3339("2024-02-29T23:59:59-00:00").unwrap();
        assert_eq!(leap.to_rfc3339(), "2024-02-29T23:59:59Z");
        assert_eq!(Timestamp(-1).to_rfc3339(), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn rfc3339_errors() {
        for (s, needle) in [
            ("2020-01-16", "too short"),
            ("2020-13-16T00:00:00Z", "month"),
            ("2023-02-29T00:00:00Z", "day out of range"),
            ("2020-01-16T25:00:00Z", "time of day"),
            ("2020-01-16T00:00:00", "too short"),
            ("2020-01-16T00:00:00.Z", "fractional"),
            ("2020-01-16T00:00:00+0200", "malformed"),
            ("2020-01-16X00:00:00Z", "missing `T`"),
            ("20a0-01-16T00:00:00Z", "not numeric"),
        ] {
            let e = Timestamp::parse_rfc3339(s).unwrap_err().to_string();
            assert!(e.contains(needle), "{s}: {e}");
        }
    }

    fn rec(id: &str, time: &str) -> String {
        format!(
            r#"{{"id":"{id}","time":"{time}","priority":"HIGH","command":"test","user":"u","product_area":"p","tool_tag":"t","flags":["--jobs=10"],"targets":["//a:b"],"peak_memory_bytes":1000,"executor_service_seconds":50.0,"wall_seconds":10.0,"outcome":"SUCCESS"}}"#
        )
    }

    #[test]
    fn parses_jsonl_and_windows() {
        let text = [
            rec("1", "2020-01-01T00:00:00Z"),
            String::new(),
            rec("2", "2020-01-17T12:00:00Z"),
            rec("3", "2020-01-18T00:00:00Z"),
        ]
        .join("\n");
        let h = parse_history(&text).unwrap();
        assert_eq!(h.len(), 3);
        assert_eq!(h[0].occupancy_esu(), Some(5.0));
        let now = Timestamp::parse_rfc3339("2020-01-18T00:00:00Z").unwrap();
        let ids = |w: Vec<&BuildRecord>| w.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(window(&h, now, 1.0)), vec!["2"]);
        assert_eq!(ids(window(&h, now, 17.0)), vec!["1", "2"]);
        assert_eq!(ids(window(&h, now, 16.0)), vec!["2"]);
    }

    #[test]
    fn history_errors_name_line() {
        let text = format!("{}\n{{\"id\":3}}\n", rec("1", "2020-01-01T00:00:00Z"));
        match parse_history(&text) {
            Err(BatchError::HistoryLine { line, .. }) => assert_eq!(line, 2),
            other => panic!("{other:?}"),
        }
        let bad_time = rec("1", "2020-01-01 00:00:00");
        let e = parse_history(&bad_time).unwrap_err().to_string();
        assert!(e.contains("line 1"), "{e}");
    }
}
