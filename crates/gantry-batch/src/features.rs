//! Feature extraction and hashing (design section IV-B).
//!
//! Owns the feature families, the hashing into a bounded slot space, count
//! buckets and feature crosses, in two shapes:
//! * set semantics for a whole build ([`FeatureSpec::build_slots`]), used for
//!   training, evaluation and direct prediction;
//! * per-context pieces ([`ContextPieces`]) that let the planner add targets
//!   one at a time and keep prefix sums.
//!
//! Monotonicity hinges on one layout rule: every *target-related* feature
//! (labels, packages, prefixes, count buckets and any cross touching them)
//! hashes into the upper half of the slot space, build-only features into
//! the lower half. Training clamps the whole upper half to be non-negative,
//! so even a never-seen target cannot collide into a negative weight.

use crate::label::Label;
use crate::types::BuildContext;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// FNV-1a 64 over bytes: stable across platforms and Rust versions, which
/// persisted models need (std's hasher makes no such promise).
pub const fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        h ^= bytes[i] as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    h
}

/// Combine two hashes (splitmix64 finaliser over a rotated xor) so that
/// `mix(a, b) != mix(b, a)` and low bits are well distributed.
pub fn mix(a: u64, b: u64) -> u64 {
    let mut z = a.rotate_left(29) ^ b.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Each of `targets` targets' set of builds as one id, so targets held by exactly the
/// same builds share it (a history group: the builds tell only its sum). 0: no build
/// held it. A target listed twice in one build counts once.
pub fn build_set_ids<B: IntoIterator<Item = usize>>(targets: usize, builds: impl IntoIterator<Item = B>) -> Vec<u64> {
    let mut id = vec![0u64; targets];
    let mut last = vec![0u64; targets];
    for (b, build) in (1u64..).zip(builds) {
        for t in build {
            if last[t] != b {
                last[t] = b;
                id[t] = mix(id[t], b).max(1);
            }
        }
    }
    id
}

/// Categorical feature families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    Priority,
    Command,
    User,
    ProductArea,
    ToolTag,
    /// Each flag with its value, e.g. `--jobs=100`.
    Flag,
    /// The target's canonical label.
    Label,
    /// The target's package, e.g. `//a/b/c`.
    Package,
    /// Ancestor directories of the package (`//a/b`, `//a`). The label and
    /// package prefix splits are the two families above, so they are not
    /// repeated here (identical columns only split the L1 budget).
    Prefix,
    /// Cumulative quantile buckets of the number of distinct targets.
    TargetCount,
    /// Cumulative quantile buckets of the number of distinct packages.
    PackageCount,
}

impl Family {
    pub const BUILD: [Family; 6] =
        [Family::Priority, Family::Command, Family::User, Family::ProductArea, Family::ToolTag, Family::Flag];
    pub const TARGET: [Family; 3] = [Family::Label, Family::Package, Family::Prefix];
    pub const COUNT: [Family; 2] = [Family::TargetCount, Family::PackageCount];
    pub const ALL: [Family; 11] = [
        Family::Priority,
        Family::Command,
        Family::User,
        Family::ProductArea,
        Family::ToolTag,
        Family::Flag,
        Family::Label,
        Family::Package,
        Family::Prefix,
        Family::TargetCount,
        Family::PackageCount,
    ];

    pub fn is_build_level(self) -> bool {
        Family::BUILD.contains(&self)
    }

    /// Target-related families get non-negative weights.
    pub fn is_target_related(self) -> bool {
        !self.is_build_level()
    }

    /// Stable hash tag of the family (compile-time constants: this is on
    /// the per-feature hot path).
    pub(crate) const fn tag(self) -> u64 {
        match self {
            Family::Priority => fnv1a(b"family:Priority"),
            Family::Command => fnv1a(b"family:Command"),
            Family::User => fnv1a(b"family:User"),
            Family::ProductArea => fnv1a(b"family:ProductArea"),
            Family::ToolTag => fnv1a(b"family:ToolTag"),
            Family::Flag => fnv1a(b"family:Flag"),
            Family::Label => fnv1a(b"family:Label"),
            Family::Package => fnv1a(b"family:Package"),
            Family::Prefix => fnv1a(b"family:Prefix"),
            Family::TargetCount => fnv1a(b"family:TargetCount"),
            Family::PackageCount => fnv1a(b"family:PackageCount"),
        }
    }

    fn target_index(self) -> Option<usize> {
        Family::TARGET.iter().position(|&f| f == self)
    }
}

/// A feature cross of two families. At most one side may be target-level
/// or count-level: crosses of two target-level families would make a
/// target's contribution depend on other targets (breaking the additive
/// prefix sums the planner relies on) and label x package is redundant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Cross(pub Family, pub Family);

impl Cross {
    /// Normalise so that the build-level family comes first.
    pub fn new(a: Family, b: Family) -> Option<Cross> {
        if a == b {
            return None;
        }
        match (a.is_build_level(), b.is_build_level()) {
            (true, true) => Some(if a < b { Cross(a, b) } else { Cross(b, a) }),
            (true, false) => Some(Cross(a, b)),
            (false, true) => Some(Cross(b, a)),
            (false, false) => None,
        }
    }

    pub fn is_target_related(self) -> bool {
        self.1.is_target_related()
    }

    fn tag(self) -> u64 {
        mix(mix(fnv1a(b"cross"), self.0.tag()), self.1.tag())
    }

    /// Every cross the search may consider: build x build, build x
    /// {package, prefix}, build x count. (build x label is too sparse to
    /// generalise.)
    pub fn candidates() -> Vec<Cross> {
        let mut out = Vec::new();
        for (i, &a) in Family::BUILD.iter().enumerate() {
            for &b in &Family::BUILD[i + 1..] {
                out.push(Cross(a, b));
            }
            for b in [Family::Package, Family::Prefix, Family::TargetCount, Family::PackageCount] {
                out.push(Cross(a, b));
            }
        }
        out
    }
}

impl std::fmt::Display for Cross {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} x {:?}", self.0, self.1)
    }
}

/// Which features a model uses and how they are hashed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FeatureSpec {
    /// Slot space is `2^hash_bits`; upper half holds target-related features.
    pub hash_bits: u32,
    /// Enabled base families.
    pub families: Vec<Family>,
    pub crosses: Vec<Cross>,
    /// Ascending boundaries; bucket j is on when `target_count >= b[j]`.
    pub target_count_boundaries: Vec<u32>,
    pub package_count_boundaries: Vec<u32>,
}

impl FeatureSpec {
    /// All families, no crosses, no count buckets yet.
    pub fn new(hash_bits: u32) -> Self {
        FeatureSpec {
            hash_bits,
            families: Family::ALL.to_vec(),
            crosses: Vec::new(),
            target_count_boundaries: Vec::new(),
            package_count_boundaries: Vec::new(),
        }
    }

    pub fn slots(&self) -> usize {
        1usize << self.hash_bits
    }

    /// First slot of the target-related (non-negative) half.
    pub fn nonneg_start(&self) -> usize {
        self.slots() / 2
    }

    pub fn has(&self, f: Family) -> bool {
        self.families.contains(&f)
    }

    /// Slot of a feature hash.
    #[inline]
    pub fn slot(&self, hash: u64, target_related: bool) -> u32 {
        // Slot space is a power of two: mask instead of dividing.
        let half = 1u64 << (self.hash_bits - 1);
        let base = if target_related { half } else { 0 };
        (base | (hash & (half - 1))) as u32
    }

    /// Learn cumulative count-bucket boundaries as quantiles of the given
    /// counts (deduplicated, all > 1 because a count of 1 is the bias).
    pub fn learn_boundaries(counts: &mut [u32], buckets: usize) -> Vec<u32> {
        if counts.is_empty() || buckets == 0 {
            return Vec::new();
        }
        counts.sort_unstable();
        let mut out: Vec<u32> =
            (1..=buckets).map(|k| counts[(k * (counts.len() - 1)) / (buckets + 1)]).filter(|&b| b > 1).collect();
        out.dedup();
        out
    }

    /// Per-context pieces for incremental scoring.
    pub fn context_pieces(&self, ctx: &BuildContext) -> ContextPieces {
        let vals = build_values(ctx);
        let values_of = |f: Family| -> Vec<u64> { vals.iter().filter(|(g, _)| *g == f).map(|&(_, v)| v).collect() };
        let mut build = Vec::new();
        for &(f, v) in &vals {
            if self.has(f) {
                build.push(self.slot(mix(f.tag(), v), false));
            }
        }
        let mut target_prefixes: [Vec<u64>; 3] = Default::default();
        let mut target_prefix_cross: [Vec<usize>; 3] = Default::default();
        let mut tc: Vec<Vec<u32>> = vec![Vec::new(); self.target_count_boundaries.len()];
        let mut pc: Vec<Vec<u32>> = vec![Vec::new(); self.package_count_boundaries.len()];
        for (j, feats) in tc.iter_mut().enumerate() {
            if self.has(Family::TargetCount) {
                feats.push(self.slot(mix(Family::TargetCount.tag(), j as u64), true));
            }
        }
        for (j, feats) in pc.iter_mut().enumerate() {
            if self.has(Family::PackageCount) {
                feats.push(self.slot(mix(Family::PackageCount.tag(), j as u64), true));
            }
        }
        for (ci, &c) in self.crosses.iter().enumerate() {
            let avals = values_of(c.0);
            if c.1.is_build_level() {
                for &a in &avals {
                    for &b in &values_of(c.1) {
                        build.push(self.slot(mix(mix(c.tag(), a), b), false));
                    }
                }
            } else if let Some(ti) = c.1.target_index() {
                for &a in &avals {
                    target_prefixes[ti].push(mix(c.tag(), a));
                    target_prefix_cross[ti].push(ci);
                }
            } else {
                let buckets = if c.1 == Family::TargetCount { &mut tc } else { &mut pc };
                for &a in &avals {
                    for (j, feats) in buckets.iter_mut().enumerate() {
                        feats.push(self.slot(mix(mix(c.tag(), a), j as u64), true));
                    }
                }
            }
        }
        ContextPieces { build, target_prefixes, target_prefix_cross, target_count: tc, package_count: pc }
    }

    /// All slots of a build under set semantics: distinct labels, packages
    /// and prefixes each count once; counts use distinct targets/packages.
    /// Slots may repeat (hash collisions), which acts as feature value 2.
    pub fn build_slots(&self, pieces: &ContextPieces, tv: &BuildTargetValues) -> Vec<u32> {
        let mut out = pieces.build.clone();
        for (ti, fam) in Family::TARGET.iter().enumerate() {
            let vals = &tv.values[ti];
            if vals.is_empty() {
                continue;
            }
            let on = self.has(*fam);
            for &v in vals {
                if on {
                    out.push(self.slot(mix(fam.tag(), v), true));
                }
                for &p in &pieces.target_prefixes[ti] {
                    out.push(self.slot(mix(p, v), true));
                }
            }
        }
        out.extend(pieces.count_slots(self, tv.target_count, tv.package_count));
        out
    }
}

/// Hashed raw values of the build-level families of a context.
pub fn build_values(ctx: &BuildContext) -> Vec<(Family, u64)> {
    let mut v = vec![
        (Family::Priority, fnv1a(ctx.priority.as_str().as_bytes())),
        (Family::Command, fnv1a(ctx.command.as_str().as_bytes())),
        (Family::User, fnv1a(ctx.user.as_bytes())),
        (Family::ProductArea, fnv1a(ctx.product_area.as_bytes())),
        (Family::ToolTag, fnv1a(ctx.tool_tag.as_bytes())),
    ];
    let mut flags: Vec<&String> = ctx.flags.iter().collect();
    flags.sort();
    flags.dedup();
    v.extend(flags.into_iter().map(|f| (Family::Flag, fnv1a(f.as_bytes()))));
    v
}

/// Hashed target-level values of one target: label, package, ancestors.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TargetValues {
    pub label: u64,
    pub package: u64,
    pub ancestors: Vec<u64>,
}

impl TargetValues {
    /// Fill from a parsed label, reusing the ancestor buffer. FNV is a
    /// streaming hash and every value is a prefix of the label, so one pass
    /// over the bytes yields the ancestor, package and label hashes.
    pub fn fill(&mut self, label: &Label<'_>) {
        let raw = label.as_str().as_bytes();
        let pkg_end = label.package().len();
        let path_start = pkg_end - label.package_path().len();
        self.ancestors.clear();
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for (i, &b) in raw.iter().enumerate() {
            if i == pkg_end {
                self.package = h;
            } else if b == b'/' && i > path_start && i < pkg_end {
                self.ancestors.push(h);
            }
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        if pkg_end == raw.len() {
            self.package = h;
        }
        if label.is_shorthand() {
            for &b in b":".iter().chain(label.name().as_bytes()) {
                h ^= b as u64;
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        self.label = h;
        self.ancestors.reverse();
    }

    pub fn of(label: &Label<'_>) -> Self {
        let mut t = TargetValues::default();
        t.fill(label);
        t
    }
}

/// Distinct target-level values of a whole build (set semantics).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BuildTargetValues {
    /// Indexed like [`Family::TARGET`]: labels, packages, prefixes.
    pub values: [Vec<u64>; 3],
    pub target_count: usize,
    pub package_count: usize,
}

impl BuildTargetValues {
    pub fn from_labels<'a>(labels: impl IntoIterator<Item = &'a Label<'a>>) -> Self {
        let mut seen: [HashSet<u64>; 3] = Default::default();
        let mut out = BuildTargetValues::default();
        for l in labels {
            let tv = TargetValues::of(l);
            if seen[0].insert(tv.label) {
                out.values[0].push(tv.label);
            }
            if seen[1].insert(tv.package) {
                out.values[1].push(tv.package);
            }
            for a in tv.ancestors {
                if seen[2].insert(a) {
                    out.values[2].push(a);
                }
            }
        }
        out.target_count = out.values[0].len();
        out.package_count = out.values[1].len();
        out
    }
}

/// A context's hashed pieces: build-only slots, the cross prefixes to apply
/// to every target-level value, and the slots of each count bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct ContextPieces {
    pub build: Vec<u32>,
    /// Per target family: hashes `mix(cross_tag, build_value)`; a target
    /// value `v` then contributes slot `mix(prefix, v)` for each prefix.
    pub target_prefixes: [Vec<u64>; 3],
    /// For each entry of `target_prefixes`, the index of its cross in the spec.
    pub target_prefix_cross: [Vec<usize>; 3],
    /// Per target-count bucket: slots switched on when the bucket is.
    pub target_count: Vec<Vec<u32>>,
    pub package_count: Vec<Vec<u32>>,
}

impl ContextPieces {
    /// Slots of the active (cumulative) count buckets.
    pub fn count_slots(&self, spec: &FeatureSpec, targets: usize, packages: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let nt = spec.target_count_boundaries.partition_point(|&b| (b as usize) <= targets);
        for feats in &self.target_count[..nt] {
            out.extend_from_slice(feats);
        }
        let np = spec.package_count_boundaries.partition_point(|&b| (b as usize) <= packages);
        for feats in &self.package_count[..np] {
            out.extend_from_slice(feats);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::label::parse_label;
    use crate::types::{Command, Priority};

    fn ctx() -> BuildContext {
        let mut c = BuildContext::new_workspace("w", Command::Test, Priority::High);
        c.user = "alice".into();
        c.tool_tag = "presubmit".into();
        c.flags = vec!["--jobs=10".into(), "--keep_going".into()];
        c
    }

    #[test]
    fn build_values_cover_each_family_and_flag() {
        let v = build_values(&ctx());
        let fams: Vec<Family> = v.iter().map(|x| x.0).collect();
        assert_eq!(
            fams,
            vec![
                Family::Priority,
                Family::Command,
                Family::User,
                Family::ProductArea,
                Family::ToolTag,
                Family::Flag,
                Family::Flag
            ]
        );
        // Flag order does not matter.
        let mut c2 = ctx();
        c2.flags.reverse();
        assert_eq!(build_values(&c2), v);
    }

    #[test]
    fn target_values_and_set_semantics() {
        let a = parse_label("//a/b/c:t1").unwrap();
        let b = parse_label("//a/b/c:t2").unwrap();
        let c = parse_label("//a/d:t3").unwrap();
        let tv = TargetValues::of(&a);
        assert_eq!(tv.package, fnv1a(b"//a/b/c"));
        assert_eq!(tv.ancestors, vec![fnv1a(b"//a/b"), fnv1a(b"//a")]);
        let bt = BuildTargetValues::from_labels([&a, &b, &c, &a]);
        assert_eq!(bt.target_count, 3);
        assert_eq!(bt.package_count, 2);
        // Ancestors //a/b and //a, deduplicated (//a shared by all).
        assert_eq!(bt.values[2].len(), 2);
        // Shorthand and canonical spellings are the same target.
        let s = parse_label("//x/y").unwrap();
        let s2 = parse_label("//x/y:y").unwrap();
        assert_eq!(TargetValues::of(&s), TargetValues::of(&s2));
    }

    #[test]
    fn single_pass_hashes_match_naive() {
        for raw in ["//a/b/c:t", "//:x", "//a", "@r//p/q:n/m", "@@x+//a/bb/ccc", "//a:b/c/d"] {
            let l = parse_label(raw).unwrap();
            let tv = TargetValues::of(&l);
            assert_eq!(tv.label, fnv1a(l.canonical().as_bytes()), "{raw}");
            assert_eq!(tv.package, fnv1a(l.package().as_bytes()), "{raw}");
            let anc: Vec<u64> = l.ancestors().map(|a| fnv1a(a.as_bytes())).collect();
            assert_eq!(tv.ancestors, anc, "{raw}");
        }
    }

    #[test]
    fn count_buckets_are_cumulative_quantiles() {
        let mut counts: Vec<u32> = (1..=100).collect();
        let b = FeatureSpec::learn_boundaries(&mut counts, 3);
        assert_eq!(b, vec![25, 50, 75]);
        let mut spec = FeatureSpec::new(12);
        spec.target_count_boundaries = b;
        spec.package_count_boundaries = vec![2];
        let p = spec.context_pieces(&ctx());
        assert!(p.count_slots(&spec, 24, 1).is_empty());
        assert_eq!(p.count_slots(&spec, 25, 1).len(), 1);
        assert_eq!(p.count_slots(&spec, 74, 1).len(), 2);
        assert_eq!(p.count_slots(&spec, 1000, 2).len(), 4);
        // Monotone: more targets never switches a bucket off.
        for n in 1..200 {
            assert!(p.count_slots(&spec, n + 1, 3).len() >= p.count_slots(&spec, n, 3).len());
        }
    }

    #[test]
    fn slot_layout_separates_target_features() {
        let spec = FeatureSpec::new(10);
        for h in [0u64, 1, 12345, u64::MAX] {
            assert!((spec.slot(h, true) as usize) >= spec.nonneg_start());
            assert!((spec.slot(h, false) as usize) < spec.nonneg_start());
        }
        let mut spec = FeatureSpec::new(16);
        spec.crosses = vec![
            Cross(Family::ToolTag, Family::Package),
            Cross(Family::User, Family::ToolTag),
            Cross(Family::Priority, Family::TargetCount),
        ];
        spec.target_count_boundaries = vec![5];
        let p = spec.context_pieces(&ctx());
        assert!(p.build.iter().all(|&s| (s as usize) < spec.nonneg_start()));
        // 7 base build values + 1 user x tool cross.
        assert_eq!(p.build.len(), 8);
        assert_eq!(p.target_prefixes[1].len(), 1);
        assert_eq!(p.target_count[0].len(), 2);
        let a = parse_label("//a/b:t").unwrap();
        let slots = spec.build_slots(&p, &BuildTargetValues::from_labels([&a]));
        // 8 build + label + package + package x tool + ancestor //a.
        assert_eq!(slots.len(), 12);
    }

    #[test]
    fn crosses_are_normalised_and_restricted() {
        assert_eq!(Cross::new(Family::Package, Family::User), Some(Cross(Family::User, Family::Package)));
        assert_eq!(Cross::new(Family::Label, Family::Package), None);
        assert_eq!(Cross::new(Family::User, Family::User), None);
        let c = Cross::candidates();
        assert!(c.iter().all(|x| x.0.is_build_level()));
        assert_eq!(c.len(), 15 + 6 * 4);
    }

    #[test]
    fn hashing_is_stable() {
        // Persisted models depend on these exact values.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(mix(1, 2), mix(2, 1));
    }
}
