//! Conflict analyzer, pure part: affected targets and build-graph changes.
//!
//! The integrator derives a [`TargetGraph`] per commit (for example from
//! `bazel query --output=proto`) and registers it with [`ConflictAnalyzer`].
//! A target's hash covers its attributes digest, its source-file digests and
//! the hashes of its dependencies, so a change to a library also changes the
//! hash of everything that depends on it. The *affected targets* of a change
//! are the targets whose hash differs between the base graph and the graph
//! with the change applied (including added and removed targets).
//!
//! Two changes are independent when their affected sets are disjoint and
//! neither alters the build graph (adds/removes targets or dependency edges).
//! The graph condition matters because two individually harmless edits can
//! combine into a new target hash that neither produced alone (the "union"
//! puzzle in the SubmitQueue paper): a change adding the edge `z -> x` and a
//! change editing `x` have disjoint affected sets (`{z}` and `{x}`), yet
//! together they change `z` in a way neither did alone.
//!
//! So a change that alters the graph also records its *reach*: its affected
//! targets and everything they depend on in its own graph. It is independent
//! of a change that does not alter the graph when that change's affected
//! targets lie outside the reach. Then no target either one changes depends,
//! in the combined graph, on a target the other changes: a target outside the
//! graph change's affected set has the same dependency subgraph with and
//! without it, and every target inside it reaches only the reach. Each target
//! of the combined tree therefore builds exactly as it does with one change
//! alone. This is the paper's hybrid approach (pairwise union only for the few
//! changes that alter the graph), decided from one graph per change instead of
//! one per pair. Two changes that both alter the graph, or one whose reach is
//! unknown (say, it edits Starlark that the query does not show), stay
//! dependent on every other change.
//!
//! Hashes are memoised per graph version (commit id), so analysing n changes
//! against one base costs one hash pass over the base plus one pass per
//! change, not a pass per pair.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::QueueError;

/// One build target as seen by the conflict analyzer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetNode {
    /// Digest of the rule's attributes (kind, flags, ...), as computed by the integrator.
    pub attrs_digest: String,
    /// Digests of the target's source files, in rule order.
    #[serde(default)]
    pub srcs: Vec<String>,
    /// Labels of direct dependencies. Labels absent from the graph are treated
    /// as opaque external inputs identified by their label alone.
    #[serde(default)]
    pub deps: Vec<String>,
}

/// The build graph of one commit: label -> target.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetGraph {
    /// All targets by label.
    pub targets: BTreeMap<String, TargetNode>,
}

/// 128-bit content hash of a target (FNV-1a; collision resistance against
/// adversaries is not needed here, stability across runs and platforms is).
pub type TargetHash = u128;

/// Result of analysing one change against its base.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeAnalysis {
    /// Labels whose hash changed, plus added and removed labels.
    pub affected: BTreeSet<String>,
    /// True when targets were added/removed or any dependency edge changed.
    pub alters_graph: bool,
    /// For a change that alters the graph: its affected targets and every
    /// target they depend on in the graph with the change applied. `None`
    /// when the change does not alter the graph, or when what it alters is not
    /// known (then it is dependent on every other change).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub graph_reach: Option<BTreeSet<String>>,
}

impl ChangeAnalysis {
    /// Whether two changes are provably independent (may land in either order).
    pub fn independent_of(&self, other: &ChangeAnalysis) -> bool {
        independent(
            (&self.affected, self.alters_graph, self.graph_reach.as_ref()),
            (&other.affected, other.alters_graph, other.graph_reach.as_ref()),
            |x, y| x.is_disjoint(y),
        )
    }
}

/// The independence rule, over any form of target set (the planner keeps them
/// interned): each side is (affected, alters the graph, graph reach).
pub(crate) fn independent<S: ?Sized>(
    a: (&S, bool, Option<&S>),
    b: (&S, bool, Option<&S>),
    disjoint: impl Fn(&S, &S) -> bool,
) -> bool {
    let outside_reach = |reach: Option<&S>, plain: &S| reach.is_some_and(|r| disjoint(r, plain));
    disjoint(a.0, b.0)
        && match (a.1, b.1) {
            (false, false) => true,
            (true, false) => outside_reach(a.2, b.0),
            (false, true) => outside_reach(b.2, a.0),
            (true, true) => false,
        }
}

const FNV_OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
const FNV_PRIME: u128 = 0x0000000001000000000000000000013B;

struct Fnv(u128);

impl Fnv {
    fn new() -> Self {
        Fnv(FNV_OFFSET)
    }
    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= u128::from(x);
            self.0 = self.0.wrapping_mul(FNV_PRIME);
        }
    }
    /// Length-prefixed so that ("ab","c") and ("a","bc") hash differently.
    fn field(&mut self, b: &[u8]) {
        self.bytes(&(b.len() as u64).to_le_bytes());
        self.bytes(b);
    }
}

fn sorted_deps(node: &TargetNode) -> Vec<&str> {
    let mut d: Vec<&str> = node.deps.iter().map(String::as_str).collect();
    d.sort_unstable();
    d.dedup();
    d
}

/// Computes every target's hash. Iterative post-order DFS, so deep graphs do
/// not overflow the stack; cycles are reported as errors.
pub fn target_hashes(graph: &TargetGraph) -> Result<HashMap<String, TargetHash>, QueueError> {
    let mut done: HashMap<&str, TargetHash> = HashMap::with_capacity(graph.targets.len());
    let mut on_stack: BTreeSet<&str> = BTreeSet::new();
    for root in graph.targets.keys() {
        if done.contains_key(root.as_str()) {
            continue;
        }
        // Stack of (label, deps, next dep index).
        let mut stack: Vec<(&str, Vec<&str>, usize)> = Vec::new();
        stack.push((root, sorted_deps(&graph.targets[root]), 0));
        on_stack.insert(root);
        while let Some((label, deps, idx)) = stack.last_mut() {
            if *idx < deps.len() {
                let dep = deps[*idx];
                *idx += 1;
                if done.contains_key(dep) || !graph.targets.contains_key(dep) {
                    continue;
                }
                if on_stack.contains(dep) {
                    return Err(QueueError::DependencyCycle(dep.to_string()));
                }
                on_stack.insert(dep);
                stack.push((dep, sorted_deps(&graph.targets[dep]), 0));
                continue;
            }
            let node = &graph.targets[*label];
            let mut h = Fnv::new();
            h.field(label.as_bytes());
            h.field(node.attrs_digest.as_bytes());
            h.bytes(&(node.srcs.len() as u64).to_le_bytes());
            for s in &node.srcs {
                h.field(s.as_bytes());
            }
            h.bytes(&(deps.len() as u64).to_le_bytes());
            for d in deps.iter() {
                h.field(d.as_bytes());
                match done.get(d) {
                    Some(dh) => h.bytes(&dh.to_le_bytes()),
                    // External label: its name is all we know about it.
                    None => h.field(b"external"),
                }
            }
            let label = *label;
            done.insert(label, h.0);
            on_stack.remove(label);
            stack.pop();
        }
    }
    Ok(done.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

fn graph_altered(base: &TargetGraph, change: &TargetGraph) -> bool {
    if base.targets.len() != change.targets.len() {
        return true;
    }
    base.targets.iter().any(|(label, node)| match change.targets.get(label) {
        None => true,
        Some(other) => sorted_deps(node) != sorted_deps(other),
    })
}

fn diff(
    base: &TargetGraph,
    base_h: &HashMap<String, TargetHash>,
    change: &TargetGraph,
    change_h: &HashMap<String, TargetHash>,
) -> ChangeAnalysis {
    let mut affected = BTreeSet::new();
    for (label, h) in change_h {
        if base_h.get(label) != Some(h) {
            affected.insert(label.clone());
        }
    }
    for label in base_h.keys() {
        if !change_h.contains_key(label) {
            affected.insert(label.clone());
        }
    }
    let alters_graph = graph_altered(base, change);
    let graph_reach = alters_graph.then(|| reach(change, &affected));
    ChangeAnalysis { affected, alters_graph, graph_reach }
}

/// `from` and every target of `graph` that one of them depends on, directly or
/// not. Labels outside the graph (external ones) are kept as they are named.
fn reach(graph: &TargetGraph, from: &BTreeSet<String>) -> BTreeSet<String> {
    let mut seen = from.clone();
    let mut stack: Vec<&str> = from.iter().map(String::as_str).collect();
    while let Some(label) = stack.pop() {
        for dep in graph.targets.get(label).map_or(&[][..], |n| &n.deps[..]) {
            if seen.insert(dep.clone()) {
                stack.push(dep);
            }
        }
    }
    seen
}

/// Uncached analysis of one change; see [`ConflictAnalyzer`] for the memoised form.
pub fn analyze(base: &TargetGraph, change: &TargetGraph) -> Result<ChangeAnalysis, QueueError> {
    Ok(diff(base, &target_hashes(base)?, change, &target_hashes(change)?))
}

/// Memoising analyzer keyed by commit id.
#[derive(Default)]
pub struct ConflictAnalyzer {
    graphs: HashMap<String, Arc<TargetGraph>>,
    hashes: HashMap<String, Arc<HashMap<String, TargetHash>>>,
    analyses: HashMap<(String, String), Arc<ChangeAnalysis>>,
    hash_passes: usize,
}

impl ConflictAnalyzer {
    /// An empty analyzer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the graph of a commit. Re-registering a commit replaces it and
    /// drops memoised results that depended on the old graph.
    pub fn add_graph(&mut self, commit: impl Into<String>, graph: TargetGraph) {
        let commit = commit.into();
        self.hashes.remove(&commit);
        self.analyses.retain(|(b, c), _| *b != commit && *c != commit);
        self.graphs.insert(commit, Arc::new(graph));
    }

    /// Drops a commit and everything memoised about it (e.g. once it is no
    /// longer a base or a pending change), bounding memory.
    pub fn forget(&mut self, commit: &str) {
        self.graphs.remove(commit);
        self.hashes.remove(commit);
        self.analyses.retain(|(b, c), _| b != commit && c != commit);
    }

    /// Memoised target hashes of a registered commit.
    pub fn hashes(&mut self, commit: &str) -> Result<Arc<HashMap<String, TargetHash>>, QueueError> {
        if let Some(h) = self.hashes.get(commit) {
            return Ok(h.clone());
        }
        let g = self.graphs.get(commit).ok_or_else(|| QueueError::UnknownGraph(commit.to_string()))?;
        let h = Arc::new(target_hashes(g)?);
        self.hash_passes += 1;
        self.hashes.insert(commit.to_string(), h.clone());
        Ok(h)
    }

    /// Affected targets and graph alteration of `change_commit` relative to `base_commit`.
    pub fn analyze(&mut self, base_commit: &str, change_commit: &str) -> Result<Arc<ChangeAnalysis>, QueueError> {
        let key = (base_commit.to_string(), change_commit.to_string());
        if let Some(a) = self.analyses.get(&key) {
            return Ok(a.clone());
        }
        let bh = self.hashes(base_commit)?;
        let ch = self.hashes(change_commit)?;
        let a = Arc::new(diff(&self.graphs[base_commit], &bh, &self.graphs[change_commit], &ch));
        self.analyses.insert(key, a.clone());
        Ok(a)
    }

    /// How many full hash passes have been computed (for cost tests and metrics).
    pub fn hash_passes(&self) -> usize {
        self.hash_passes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(attrs: &str, srcs: &[&str], deps: &[&str]) -> TargetNode {
        TargetNode {
            attrs_digest: attrs.into(),
            srcs: srcs.iter().map(|s| s.to_string()).collect(),
            deps: deps.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// //:util <- //:main <- //:app ; //:other stands alone.
    fn base() -> TargetGraph {
        let mut g = TargetGraph::default();
        g.targets.insert("//:util".into(), node("lib", &["util.c#1", "util.h#1"], &[]));
        g.targets.insert("//:main".into(), node("lib", &["main.c#1"], &["//:util"]));
        g.targets.insert("//:app".into(), node("bin", &[], &["//:main", "@ext//:zlib"]));
        g.targets.insert("//:other".into(), node("lib", &["other.c#1"], &[]));
        g
    }

    fn set(xs: &[&str]) -> BTreeSet<String> {
        xs.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn source_change_propagates_to_reverse_dependencies() {
        let mut c = base();
        c.targets.get_mut("//:util").unwrap().srcs[1] = "util.h#2".into();
        let a = analyze(&base(), &c).unwrap();
        assert_eq!(a.affected, set(&["//:util", "//:main", "//:app"]));
        assert!(!a.alters_graph);
    }

    #[test]
    fn leaf_change_affects_only_itself_and_attrs_count() {
        let mut c = base();
        c.targets.get_mut("//:app").unwrap().attrs_digest = "bin-opt".into();
        let a = analyze(&base(), &c).unwrap();
        assert_eq!(a.affected, set(&["//:app"]));
        let mut d = base();
        d.targets.get_mut("//:other").unwrap().srcs[0] = "other.c#2".into();
        let b = analyze(&base(), &d).unwrap();
        assert_eq!(b.affected, set(&["//:other"]));
        assert!(a.independent_of(&b));
        let mut e = base();
        e.targets.get_mut("//:main").unwrap().srcs[0] = "main.c#9".into();
        let e = analyze(&base(), &e).unwrap();
        assert!(!a.independent_of(&e), "both affect //:app");
    }

    #[test]
    fn graph_changes_are_detected_with_their_reach() {
        // New edge //:other -> //:util: no source changed, but the graph did.
        let mut c = base();
        c.targets.get_mut("//:other").unwrap().deps.push("//:util".into());
        let a = analyze(&base(), &c).unwrap();
        assert!(a.alters_graph);
        assert_eq!(a.affected, set(&["//:other"]));
        assert_eq!(a.graph_reach, Some(set(&["//:other", "//:util"])));
        // Added target.
        let mut d = base();
        d.targets.insert("//:new".into(), node("lib", &["n.c#1"], &[]));
        let b = analyze(&base(), &d).unwrap();
        assert!(b.alters_graph);
        assert_eq!(b.affected, set(&["//:new"]));
        // Removed target: it and its reverse deps are affected.
        let mut e = base();
        e.targets.remove("//:util");
        let r = analyze(&base(), &e).unwrap();
        assert!(r.alters_graph);
        assert!(r.affected.contains("//:util") && r.affected.contains("//:main"));
        // Reordering deps is not a graph change.
        let mut g = base();
        g.targets.get_mut("//:app").unwrap().deps.reverse();
        let same = analyze(&base(), &g).unwrap();
        assert!(!same.alters_graph && same.affected.is_empty() && same.graph_reach.is_none());
    }

    #[test]
    fn a_graph_change_is_dependent_only_on_changes_inside_its_reach() {
        let edit = |label: &str| {
            let mut g = base();
            g.targets.get_mut(label).unwrap().srcs[0] = "edited#2".into();
            analyze(&base(), &g).unwrap()
        };
        // The paper's puzzle: the new edge //:other -> //:util and an edit of
        // //:util touch disjoint targets, yet together change //:other.
        let mut c = base();
        c.targets.get_mut("//:other").unwrap().deps.push("//:util".into());
        let edge = analyze(&base(), &c).unwrap();
        let util = edit("//:util");
        assert!(edge.affected.is_disjoint(&util.affected));
        assert!(!edge.independent_of(&util) && !util.independent_of(&edge));
        // An edit of //:app is outside the new edge's reach.
        let mut f = base();
        f.targets.get_mut("//:app").unwrap().attrs_digest = "x".into();
        let leaf = analyze(&base(), &f).unwrap();
        assert!(edge.independent_of(&leaf) && leaf.independent_of(&edge));
        // Removing //:util is independent of an edit of //:other, not of //:main.
        let mut e = base();
        e.targets.remove("//:util");
        let removed = analyze(&base(), &e).unwrap();
        assert!(removed.independent_of(&edit("//:other")));
        assert!(!removed.independent_of(&edit("//:main")));
        // Two graph changes stay dependent, and so does one whose reach is unknown.
        let mut d = base();
        d.targets.insert("//:new".into(), node("lib", &["n.c#1"], &[]));
        let added = analyze(&base(), &d).unwrap();
        assert!(added.affected.is_disjoint(&edge.graph_reach.clone().unwrap()));
        assert!(!added.independent_of(&edge));
        let unknown = ChangeAnalysis { graph_reach: None, ..added.clone() };
        assert!(added.independent_of(&leaf) && !unknown.independent_of(&leaf));
    }

    #[test]
    fn cycles_are_errors() {
        let mut c = base();
        c.targets.get_mut("//:util").unwrap().deps.push("//:app".into());
        assert!(matches!(target_hashes(&c), Err(QueueError::DependencyCycle(_))));
    }

    #[test]
    fn memoisation_is_linear_in_changes() {
        let mut an = ConflictAnalyzer::new();
        an.add_graph("base", base());
        for i in 0..20 {
            let mut c = base();
            c.targets.get_mut("//:other").unwrap().srcs[0] = format!("other.c#{i}");
            an.add_graph(format!("c{i}"), c);
        }
        for _round in 0..3 {
            for i in 0..20 {
                an.analyze("base", &format!("c{i}")).unwrap();
            }
        }
        // One pass for the base, one per change, regardless of repeat queries.
        assert_eq!(an.hash_passes(), 21);
        assert!(matches!(an.analyze("base", "nope"), Err(QueueError::UnknownGraph(_))));
        an.forget("c3");
        assert!(an.analyze("base", "c3").is_err());
    }
}
