//! Bazel label validation and zero-copy decomposition.
//!
//! Owns the rules for what an absolute label looks like (`//pkg/path:name`,
//! the `//pkg` shorthand, `@repo//pkg:name`) and the views the rest of the
//! crate needs from a label: its package and its prefix splits. Every view
//! is a *prefix slice* of the label string, so feature extraction for ten
//! million targets does not allocate.

use crate::error::{BatchError, Result};
use std::borrow::Cow;

/// A validated, absolute Bazel label, borrowing the original string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Label<'a> {
    raw: &'a str,
    /// Byte index where `//` starts (0 when there is no `@repo`).
    slashes: usize,
    /// Byte index one past the package path (== `raw.len()` for shorthand).
    package_end: usize,
    /// The target name (for shorthand: the last package segment).
    name: &'a str,
    shorthand: bool,
}

fn invalid(label: &str, reason: impl Into<String>) -> BatchError {
    BatchError::InvalidLabel { label: label.to_string(), reason: reason.into() }
}

/// Characters Bazel accepts in package path segments (a conservative subset:
/// no whitespace, no `:` or `\`, which would make the label ambiguous).
/// A byte table: validation runs on every one of millions of labels.
const PACKAGE_CHARS: [bool; 256] = {
    let mut t = [false; 256];
    let mut c = 0;
    while c < 256 {
        let b = c as u8;
        t[c] = b.is_ascii_alphanumeric();
        c += 1;
    }
    let extra = b"-._+=,@~$#%^&()[]{}!";
    let mut i = 0;
    while i < extra.len() {
        t[extra[i] as usize] = true;
        i += 1;
    }
    t
};

fn is_package_char(c: char) -> bool {
    c.is_ascii() && PACKAGE_CHARS[c as usize]
}

fn check_segments(label: &str, what: &str, path: &str, allow_slash: bool) -> Result<()> {
    let _ = allow_slash;
    // Fast path: every byte allowed and no `.`-only or empty segment.
    let bytes = path.as_bytes();
    if !bytes.is_empty()
        && bytes.iter().all(|&b| b == b'/' || PACKAGE_CHARS[b as usize])
        && !path.contains("//")
        && !path.contains('.')
        && bytes[0] != b'/'
        && bytes[bytes.len() - 1] != b'/'
    {
        return Ok(());
    }
    for (i, seg) in path.split('/').enumerate() {
        if seg.is_empty() {
            return Err(invalid(label, format!("{what} has an empty path segment (segment {})", i + 1)));
        }
        if seg == "..." {
            return Err(invalid(label, "`...` is a target pattern, not a label; expand patterns before batching"));
        }
        if seg == "." || seg == ".." {
            return Err(invalid(label, format!("{what} contains a relative segment `{seg}`")));
        }
        if let Some(c) = seg.chars().find(|&c| !is_package_char(c)) {
            return Err(invalid(label, format!("{what} contains forbidden character {c:?}")));
        }
    }
    Ok(())
}

/// Validate `raw` as an absolute Bazel label and decompose it.
///
/// Accepted: `//pkg/path:name`, `//pkg/path` (shorthand for
/// `//pkg/path:path`), `//:name` (root package), `@repo//pkg:name`,
/// `@@canonical_repo//pkg:name`. The error names the offending part.
pub fn parse_label(raw: &str) -> Result<Label<'_>> {
    if raw.is_empty() {
        return Err(invalid(raw, "label is empty"));
    }
    if raw.bytes().any(|b| b.is_ascii_whitespace() || b >= 0x80)
        && let Some(c) = raw.chars().find(|c| c.is_whitespace())
    {
        return Err(invalid(raw, format!("label contains whitespace {c:?}")));
    }
    let slashes = if let Some(rest) = raw.strip_prefix('@') {
        let repo_len = rest.find("//").ok_or_else(|| invalid(raw, "missing `//` after the repository name"))?;
        let repo = &rest[..repo_len];
        let bare = repo.strip_prefix('@').unwrap_or(repo);
        if bare.is_empty() {
            return Err(invalid(raw, "repository name after `@` is empty"));
        }
        if !bare.starts_with(|c: char| c.is_ascii_alphabetic()) {
            return Err(invalid(raw, "repository name must start with a letter"));
        }
        if let Some(c) = bare.chars().find(|&c| !(c.is_ascii_alphanumeric() || "-_.+~".contains(c))) {
            return Err(invalid(raw, format!("repository name contains forbidden character {c:?}")));
        }
        1 + repo_len
    } else if raw.starts_with("//") {
        0
    } else if raw.starts_with(':') {
        return Err(invalid(raw, "relative label (`:name`); batching needs absolute labels starting with `//`"));
    } else {
        return Err(invalid(raw, "label must start with `//` or `@repo//`"));
    };
    let after = &raw[slashes + 2..];
    let (path, name, shorthand) = match after.find(':') {
        Some(colon) => {
            let name = &after[colon + 1..];
            if name.is_empty() {
                return Err(invalid(raw, "target name after `:` is empty"));
            }
            (&after[..colon], name, false)
        }
        None => {
            if after.is_empty() {
                return Err(invalid(raw, "root package shorthand `//` has no target name; write `//:name`"));
            }
            let name = after.rsplit('/').next().unwrap_or(after);
            (after, name, true)
        }
    };
    if path.starts_with('/') {
        return Err(invalid(raw, "package path starts with an extra `/`"));
    }
    if path.ends_with('/') {
        return Err(invalid(raw, "package path ends with `/`"));
    }
    if !path.is_empty() {
        check_segments(raw, "package path", path, false)?;
    }
    if !shorthand {
        if name.contains(':') {
            return Err(invalid(raw, "target name contains a second `:`"));
        }
        if name.starts_with('/') || name.ends_with('/') {
            return Err(invalid(raw, "target name starts or ends with `/`"));
        }
        check_segments(raw, "target name", name, true)?;
    }
    Ok(Label { raw, slashes, package_end: slashes + 2 + path.len(), name, shorthand })
}

/// Decompose a label already accepted by [`parse_label`] without
/// re-validating it (the planner parses every label twice otherwise).
pub(crate) fn parse_label_trusted(raw: &str) -> Label<'_> {
    let slashes = if raw.starts_with('@') { raw.find("//").unwrap_or(0) } else { 0 };
    let after = &raw[slashes + 2..];
    match after.find(':') {
        Some(colon) => {
            Label { raw, slashes, package_end: slashes + 2 + colon, name: &after[colon + 1..], shorthand: false }
        }
        None => Label {
            raw,
            slashes,
            package_end: raw.len(),
            name: after.rsplit('/').next().unwrap_or(after),
            shorthand: true,
        },
    }
}

/// Validate a label, returning only the error (convenience for callers that
/// do not need the decomposition).
pub fn validate_label(raw: &str) -> Result<()> {
    parse_label(raw).map(|_| ())
}

impl<'a> Label<'a> {
    /// The label exactly as given.
    pub fn as_str(&self) -> &'a str {
        self.raw
    }

    /// `@repo` / `@@repo` part, if any.
    pub fn repo(&self) -> Option<&'a str> {
        (self.slashes > 0).then(|| &self.raw[..self.slashes])
    }

    /// The package as a label prefix, e.g. `//a/b` for `//a/b:t`, `//` for
    /// `//:t`, `@r//a` for `@r//a:t`. Always a prefix slice of the label.
    pub fn package(&self) -> &'a str {
        &self.raw[..self.package_end]
    }

    /// The package path without repo and `//`, e.g. `a/b`.
    pub fn package_path(&self) -> &'a str {
        &self.raw[self.slashes + 2..self.package_end]
    }

    /// Target name (for the shorthand, the last package segment).
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// Whether the label used the `//pkg` shorthand.
    pub fn is_shorthand(&self) -> bool {
        self.shorthand
    }

    /// Canonical spelling: the shorthand `//a/b` becomes `//a/b:b`; other
    /// labels are returned unchanged without allocating.
    pub fn canonical(&self) -> Cow<'a, str> {
        if self.shorthand {
            Cow::Owned(format!("{}:{}", self.raw, self.name))
        } else {
            Cow::Borrowed(self.raw)
        }
    }

    /// Ancestor directories of the package, deepest first, as prefix slices:
    /// for `//a/b/c:t` that is `//a/b`, `//a`. The root package has none.
    pub fn ancestors(&self) -> impl Iterator<Item = &'a str> + 'a {
        let raw = self.raw;
        let start = self.slashes + 2;
        let path = &raw[start..self.package_end];
        path.match_indices('/').map(move |(i, _)| &raw[..start + i]).collect::<Vec<_>>().into_iter().rev()
    }

    /// The full prefix-split list from the design: the label, its package,
    /// then each ancestor directory (`//a/b/c:t` -> `//a/b/c:t`, `//a/b/c`,
    /// `//a/b`, `//a`). The shorthand contributes its canonical label first.
    pub fn prefix_splits(&self) -> Vec<Cow<'a, str>> {
        let mut out = vec![self.canonical(), Cow::Borrowed(self.package())];
        out.extend(self.ancestors().map(Cow::Borrowed));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(raw: &str) -> String {
        match parse_label(raw) {
            Err(BatchError::InvalidLabel { reason, label }) => {
                assert_eq!(label, raw);
                reason
            }
            other => panic!("expected InvalidLabel for {raw:?}, got {other:?}"),
        }
    }

    #[test]
    fn accepts_the_three_forms() {
        let l = parse_label("//a/b/c:t").unwrap();
        assert_eq!(l.package(), "//a/b/c");
        assert_eq!(l.package_path(), "a/b/c");
        assert_eq!(l.name(), "t");
        assert_eq!(l.repo(), None);
        assert!(!l.is_shorthand());

        let s = parse_label("//a/b").unwrap();
        assert!(s.is_shorthand());
        assert_eq!(s.name(), "b");
        assert_eq!(s.package(), "//a/b");
        assert_eq!(s.canonical(), "//a/b:b");

        let r = parse_label("@maven//com/google:guava").unwrap();
        assert_eq!(r.repo(), Some("@maven"));
        assert_eq!(r.package(), "@maven//com/google");
        assert_eq!(r.name(), "guava");

        let root = parse_label("//:all_tests").unwrap();
        assert_eq!(root.package(), "//");
        assert_eq!(root.ancestors().count(), 0);
        assert!(parse_label("@@rules_go+//go:def").is_ok());
        assert!(parse_label("//a:sub/dir/file.txt").is_ok());
    }

    #[test]
    fn trusted_parse_agrees() {
        for raw in ["//a/b/c:t", "//a/b", "@r//x:y", "//:root", "@@q+//a:b/c"] {
            assert_eq!(parse_label_trusted(raw), parse_label(raw).unwrap(), "{raw}");
        }
    }

    #[test]
    fn prefix_splits_match_design() {
        let l = parse_label("//a/b/c:t").unwrap();
        let splits: Vec<String> = l.prefix_splits().into_iter().map(|c| c.into_owned()).collect();
        assert_eq!(splits, vec!["//a/b/c:t", "//a/b/c", "//a/b", "//a"]);
        let anc: Vec<&str> = l.ancestors().collect();
        assert_eq!(anc, vec!["//a/b", "//a"]);
        let r = parse_label("@r//x/y:z").unwrap();
        assert_eq!(r.ancestors().collect::<Vec<_>>(), vec!["@r//x"]);
    }

    #[test]
    fn errors_name_the_problem() {
        assert!(reason("").contains("empty"));
        assert!(reason("a/b:c").contains("must start with `//`"));
        assert!(reason(":c").contains("relative label"));
        assert!(reason("//a/b:").contains("target name after `:` is empty"));
        assert!(reason("//a//b:c").contains("empty path segment"));
        assert!(reason("///a:c").contains("starts with an extra `/`"));
        assert!(reason("//a/:c").contains("ends with `/`"));
        assert!(reason("//a/...").contains("target pattern"));
        assert!(reason("//a/../b:c").contains("relative segment `..`"));
        assert!(reason("//a b:c").contains("whitespace"));
        assert!(reason("//a:b:c").contains("second `:`"));
        assert!(reason("//a\\b:c").contains("forbidden character"));
        assert!(reason("@repo").contains("missing `//`"));
        assert!(reason("@//a:b").contains("repository name after `@` is empty"));
        assert!(reason("@1x//a:b").contains("must start with a letter"));
        assert!(reason("@r!x//a:b").contains("repository name contains forbidden"));
        assert!(reason("//").contains("root package shorthand"));
        assert!(reason("//a:/x").contains("starts or ends with `/`"));
    }
}
