//! The conflict analyzer's independence rule, checked against what it promises:
//! when two changes are called independent, every target of the tree holding
//! both hashes exactly as in the tree holding the one change that touches it,
//! so each change builds and tests the same with or without the other.

use std::collections::BTreeSet;

use gantry_queue::conflict::{analyze, target_hashes, TargetGraph, TargetNode};
use proptest::prelude::*;

/// A random DAG: target `t{k}` depends on some of `t0..t{k-1}`.
fn graph() -> impl Strategy<Value = TargetGraph> {
    (3usize..14).prop_flat_map(|n| {
        proptest::collection::vec(proptest::collection::vec(any::<prop::sample::Index>(), 0..3), n).prop_map(
            move |deps| {
                let mut g = TargetGraph::default();
                for (k, ds) in deps.iter().enumerate() {
                    let mut d: Vec<String> =
                        if k == 0 { vec![] } else { ds.iter().map(|i| format!("//t{}", i.index(k))).collect() };
                    d.sort();
                    d.dedup();
                    g.targets.insert(
                        format!("//t{k}"),
                        TargetNode { attrs_digest: "rule".into(), srcs: vec![format!("t{k}#0")], deps: d },
                    );
                }
                g
            },
        )
    })
}

/// A change that alters the graph: add an edge, drop one, add a target, or remove one.
#[derive(Clone, Debug)]
enum GraphEdit {
    AddEdge(prop::sample::Index, prop::sample::Index),
    DropEdge(prop::sample::Index),
    AddTarget(prop::sample::Index),
    RemoveTarget(prop::sample::Index),
}

fn graph_edit() -> impl Strategy<Value = GraphEdit> {
    prop_oneof![
        (any::<prop::sample::Index>(), any::<prop::sample::Index>()).prop_map(|(a, b)| GraphEdit::AddEdge(a, b)),
        any::<prop::sample::Index>().prop_map(GraphEdit::DropEdge),
        any::<prop::sample::Index>().prop_map(GraphEdit::AddTarget),
        any::<prop::sample::Index>().prop_map(GraphEdit::RemoveTarget),
    ]
}

fn apply_graph_edit(base: &TargetGraph, e: &GraphEdit) -> TargetGraph {
    let mut g = base.clone();
    let n = g.targets.len();
    let label = |k: usize| format!("//t{k}");
    match e {
        // From a later target to an earlier one, so the graph stays acyclic.
        GraphEdit::AddEdge(a, b) => {
            let (x, y) = (a.index(n), b.index(n));
            if x != y {
                let (hi, lo) = (x.max(y), x.min(y));
                g.targets.get_mut(&label(hi)).unwrap().deps.push(label(lo));
            }
        }
        GraphEdit::DropEdge(a) => {
            let with_deps: Vec<String> =
                g.targets.iter().filter(|(_, t)| !t.deps.is_empty()).map(|(l, _)| l.clone()).collect();
            if !with_deps.is_empty() {
                g.targets.get_mut(&with_deps[a.index(with_deps.len())]).unwrap().deps.pop();
            }
        }
        GraphEdit::AddTarget(a) => {
            let node =
                TargetNode { attrs_digest: "rule".into(), srcs: vec!["new#0".into()], deps: vec![label(a.index(n))] };
            g.targets.insert("//new".into(), node);
        }
        GraphEdit::RemoveTarget(a) => {
            g.targets.remove(&label(a.index(n)));
        }
    }
    g
}

/// A change that edits sources only, of targets among `//t0..//t{n-1}`.
fn apply_source_edit(g: &TargetGraph, n: usize, which: &[prop::sample::Index], tag: &str) -> TargetGraph {
    let mut g = g.clone();
    for w in which {
        let l = format!("//t{}", w.index(n));
        if let Some(t) = g.targets.get_mut(&l) {
            t.srcs[0] = format!("{l}#{tag}");
        }
    }
    g
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn independent_changes_build_alike_together_and_alone(
        base in graph(),
        edit in graph_edit(),
        sources in proptest::collection::vec(any::<prop::sample::Index>(), 1..3),
        other in proptest::collection::vec(any::<prop::sample::Index>(), 1..3),
    ) {
        let n = base.targets.len();
        let ga = apply_graph_edit(&base, &edit);
        let gb = apply_source_edit(&base, n, &sources, "b");
        let a = analyze(&base, &ga).unwrap();
        let b = analyze(&base, &gb).unwrap();
        prop_assert!(!b.alters_graph);
        // A second source edit: the plain rule between two ordinary changes.
        let gc = apply_source_edit(&base, n, &other, "c");
        let c = analyze(&base, &gc).unwrap();
        let mut checked = Vec::new();
        if a.alters_graph && a.independent_of(&b) {
            prop_assert!(b.independent_of(&a), "independence is symmetric");
            checked.push((&a, &ga, &b, gb.clone(), apply_source_edit(&ga, n, &sources, "b")));
        }
        if b.independent_of(&c) {
            checked.push((&b, &gb, &c, gc.clone(), apply_source_edit(&gb, n, &other, "c")));
        }
        let base_h = target_hashes(&base).unwrap();
        for (x, gx, y, gy, both) in checked {
            let (hx, hy, hboth) = (target_hashes(gx).unwrap(), target_hashes(&gy).unwrap(), target_hashes(&both).unwrap());
            let labels: BTreeSet<&String> = hboth.keys().chain(hx.keys()).chain(hy.keys()).collect();
            for l in &labels {
                let expect = if x.affected.contains(*l) {
                    hx.get(*l)
                } else if y.affected.contains(*l) {
                    hy.get(*l)
                } else {
                    base_h.get(*l)
                };
                prop_assert_eq!(hboth.get(*l), expect, "target {} in {:?} with {:?}", l, x, y);
            }
        }
    }
}
