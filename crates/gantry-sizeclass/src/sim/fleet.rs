//! Fleet specifications: how many workers of each size class, parsed from
//! strings like `1:48,2:24,4:16,8:64` with errors that point at the entry.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::{Error, SizeClass, SizeClasses};

/// Workers per size class; at least one class, every count positive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fleet {
    workers: BTreeMap<SizeClass, u32>,
}

/// The default benchmark fleet.
pub const DEFAULT_FLEET: &str = "1:48,2:24,4:16,8:64";

impl Fleet {
    /// The classes present.
    pub fn classes(&self) -> SizeClasses {
        SizeClasses::new(self.workers.keys().copied()).expect("fleet is non-empty without zero")
    }

    /// Workers of `class` (0 if absent).
    pub fn workers(&self, class: SizeClass) -> u32 {
        self.workers.get(&class).copied().unwrap_or(0)
    }

    /// `(class, workers)` ascending by class.
    pub fn iter(&self) -> impl Iterator<Item = (SizeClass, u32)> + '_ {
        self.workers.iter().map(|(c, n)| (*c, *n))
    }

    /// Total provisioned capacity in class units (Σ class × workers).
    pub fn capacity_units(&self) -> u64 {
        self.iter().map(|(c, n)| u64::from(c) * u64::from(n)).sum()
    }
}

impl Default for Fleet {
    fn default() -> Self {
        parse_fleet(DEFAULT_FLEET).expect("default fleet spec is valid")
    }
}

impl fmt::Display for Fleet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.iter().map(|(c, n)| format!("{c}:{n}")).collect();
        f.write_str(&parts.join(","))
    }
}

impl FromStr for Fleet {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        parse_fleet(s)
    }
}

/// Parses `CLASS:COUNT[,CLASS:COUNT...]`. Whitespace around entries and
/// numbers is ignored; classes may come in any order but not twice.
pub fn parse_fleet(spec: &str) -> Result<Fleet, Error> {
    let err = |entry: usize, text: &str, reason: String| Error::FleetSpec { entry, text: text.to_string(), reason };
    if spec.trim().is_empty() {
        return Err(err(1, spec, "empty fleet spec; expected e.g. `1:48,2:24`".into()));
    }
    let mut workers = BTreeMap::new();
    let mut seen_at: BTreeMap<SizeClass, usize> = BTreeMap::new();
    for (i, raw) in spec.split(',').enumerate() {
        let entry = i + 1;
        let text = raw.trim();
        let Some((class_s, count_s)) = text.split_once(':') else {
            return Err(err(entry, text, "expected CLASS:COUNT".into()));
        };
        let (class_s, count_s) = (class_s.trim(), count_s.trim());
        let class: SizeClass = class_s
            .parse()
            .ok()
            .filter(|c| *c > 0)
            .ok_or_else(|| err(entry, text, format!("size class `{class_s}` is not a positive integer")))?;
        let count: u32 = count_s
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| err(entry, text, format!("worker count `{count_s}` is not a positive integer")))?;
        if let Some(first) = seen_at.insert(class, entry) {
            return Err(err(entry, text, format!("size class {class} already given in entry {first}")));
        }
        workers.insert(class, count);
    }
    Ok(Fleet { workers })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_default_fleet() {
        let f = parse_fleet("1:48,2:24,4:16,8:64").unwrap();
        assert_eq!(f.iter().collect::<Vec<_>>(), vec![(1, 48), (2, 24), (4, 16), (8, 64)]);
        assert_eq!(f.classes().as_slice(), &[1, 2, 4, 8]);
        assert_eq!(f.capacity_units(), 48 + 48 + 64 + 512);
        assert_eq!(f.to_string(), "1:48,2:24,4:16,8:64");
        assert_eq!(f, Fleet::default());
        assert_eq!(" 8 : 2 , 1:3".parse::<Fleet>().unwrap().to_string(), "1:3,8:2");
    }

    #[test]
    fn errors_point_at_the_entry() {
        let cases = [
            ("", 1, "empty"),
            ("1:48,,2:3", 2, "CLASS:COUNT"),
            ("1:48,2", 2, "CLASS:COUNT"),
            ("0:4", 1, "size class `0`"),
            ("x:4", 1, "size class `x`"),
            ("1:4,2:-1", 2, "worker count `-1`"),
            ("1:0", 1, "worker count `0`"),
            ("1:4,2:2,1:9", 3, "already given in entry 1"),
        ];
        for (spec, want_entry, want_reason) in cases {
            match parse_fleet(spec) {
                Err(Error::FleetSpec { entry, reason, .. }) => {
                    assert_eq!(entry, want_entry, "{spec}");
                    assert!(reason.contains(want_reason), "{spec}: {reason}");
                }
                other => panic!("{spec}: expected FleetSpec error, got {other:?}"),
            }
        }
    }
}
