//! Unit tests of the pure planner through its public API: speculation values
//! on hand-computed trees, pruning, parallel lanes, retries, error handling,
//! and a property test of serializability under random outcomes.

use std::collections::{BTreeSet, HashMap, HashSet};

use gantry_queue::{
    Action, BuildId, BuildOutcome, BuildSpec, ChangeAnalysis, ChangeFeatures, ChangeId, Event, Millis, Planner,
    PlannerConfig, QueueError,
};
use proptest::prelude::*;

fn id(s: &str) -> ChangeId {
    ChangeId(s.to_string())
}

fn analysis(targets: &[&str]) -> Option<ChangeAnalysis> {
    Some(ChangeAnalysis {
        affected: targets.iter().map(|t| t.to_string()).collect(),
        alters_graph: false,
        graph_reach: None,
    })
}

fn enqueue(p: &mut Planner, t: u64, name: &str, a: Option<ChangeAnalysis>) -> Vec<Action> {
    p.handle(
        Millis(t),
        Event::Enqueue { change: id(name), features: ChangeFeatures::default(), analysis: a, priority: 0 },
    )
    .unwrap()
}

fn finish(p: &mut Planner, t: u64, b: BuildId, ok: bool) -> Vec<Action> {
    let outcome = if ok { BuildOutcome::Passed } else { BuildOutcome::Failed };
    p.handle(Millis(t), Event::BuildFinished { build: b, outcome, failed_targets: None }).unwrap()
}

fn started(actions: &[Action]) -> Vec<BuildSpec> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::StartBuild { build } => Some(build.clone()),
            _ => None,
        })
        .collect()
}

fn cancelled(actions: &[Action]) -> BTreeSet<BuildId> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::CancelBuild { id } => Some(*id),
            _ => None,
        })
        .collect()
}

/// (change, assumed) pairs, a readable handle on a build.
fn shape(b: &BuildSpec) -> (String, Vec<String>) {
    (b.change.0.clone(), b.assumed.iter().map(|c| c.0.clone()).collect())
}

fn find(builds: &[BuildSpec], change: &str, assumed: &[&str]) -> BuildId {
    let want = (change.to_string(), assumed.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    builds.iter().find(|b| shape(b) == want).unwrap_or_else(|| panic!("no build {want:?}")).id
}

/// Pure value ranking (no blocking weight, no hedged retries, no overload
/// mode), so values can be checked by hand; the extras have their own tests.
fn cfg(capacity: usize) -> PlannerConfig {
    PlannerConfig {
        capacity,
        prior_success: 0.9,
        prior_conflict: 0.0,
        blocking_weight: 0.0,
        hedge_retries: false,
        overload_pending_factor: None,
        ..PlannerConfig::default()
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn speculation_values_match_hand_computed_tree() {
    // C1 <- C2 <- C3, all dependent (no analysis), P(success)=0.9, no conflicts.
    let mut p = Planner::new(cfg(0));
    for c in ["c1", "c2", "c3"] {
        assert!(enqueue(&mut p, 0, c, None).is_empty(), "capacity 0 starts nothing");
    }
    let v =
        |p: &Planner, c: &str, a: &[&str]| p.value_of(&id(c), &a.iter().map(|s| id(s)).collect::<Vec<_>>()).unwrap();
    assert!(close(v(&p, "c1", &[]), 1.0));
    assert!(close(v(&p, "c2", &["c1"]), 0.9));
    assert!(close(v(&p, "c2", &[]), 0.1));
    assert!(close(v(&p, "c3", &["c1", "c2"]), 0.81));
    assert!(close(v(&p, "c3", &["c1"]), 0.09));
    assert!(close(v(&p, "c3", &["c2"]), 0.09));
    assert!(close(v(&p, "c3", &[]), 0.01));
    // The seven candidate values of a tree sum to the number of changes: each
    // change has exactly one decisive build.
    let total: f64 = [
        v(&p, "c1", &[]),
        v(&p, "c2", &["c1"]),
        v(&p, "c2", &[]),
        v(&p, "c3", &["c1", "c2"]),
        v(&p, "c3", &["c1"]),
        v(&p, "c3", &["c2"]),
        v(&p, "c3", &[]),
    ]
    .iter()
    .sum();
    assert!(close(total, 3.0));
    assert_eq!(p.value_of(&id("c1"), &[id("c2")]), None, "c2 is not earlier than c1");

    // With 4 slots the planner must pick the 4 most valuable: B1, B12, B123, B2.
    let acts = p.handle(Millis(1), Event::SetCapacity { capacity: 4 }).unwrap();
    let mut got: Vec<_> = started(&acts).iter().map(shape).collect();
    got.sort();
    let mut want = vec![
        ("c1".to_string(), vec![]),
        ("c2".to_string(), vec!["c1".to_string()]),
        ("c2".to_string(), vec![]),
        ("c3".to_string(), vec!["c1".to_string(), "c2".to_string()]),
    ];
    want.sort();
    assert_eq!(got, want);
}

#[test]
fn conflict_probabilities_shift_the_most_likely_path() {
    // c2 conflicts with c1 with probability 0.5: π2 = 0.9·(1 − 0.9·0.5) = 0.495,
    // so the most likely world for c3 is "c1 lands, c2 is rejected".
    let mut p = Planner::new(cfg(0));
    for c in ["c1", "c2", "c3"] {
        enqueue(&mut p, 0, c, None);
    }
    p.override_conflict(&id("c2"), &id("c1"), 0.5).unwrap();
    let probs: HashMap<_, _> = p.landing_probabilities().into_iter().collect();
    assert!(close(probs[&id("c2")], 0.495));
    let v13 = p.value_of(&id("c3"), &[id("c1")]).unwrap();
    assert!(close(v13, 0.9 * 0.505));
    let acts = p.handle(Millis(1), Event::SetCapacity { capacity: 3 }).unwrap();
    let got: Vec<_> = started(&acts).iter().map(shape).collect();
    assert!(got.contains(&("c3".to_string(), vec!["c1".to_string()])), "{got:?}");
    assert!(!got.contains(&("c3".to_string(), vec!["c1".to_string(), "c2".to_string()])));
}

#[test]
fn independent_changes_do_not_speculate_on_each_other() {
    let mut p = Planner::new(cfg(0));
    enqueue(&mut p, 0, "c1", analysis(&["//a"]));
    enqueue(&mut p, 0, "c2", analysis(&["//b"]));
    enqueue(&mut p, 0, "c3", analysis(&["//a", "//c"]));
    assert!(!p.dependent(&id("c1"), &id("c2")).unwrap());
    assert!(p.dependent(&id("c1"), &id("c3")).unwrap());
    assert!(close(p.value_of(&id("c2"), &[]).unwrap(), 1.0));
    assert_eq!(p.value_of(&id("c2"), &[id("c1")]), None, "c1 is irrelevant to c2");
    assert!(close(p.value_of(&id("c3"), &[id("c1")]).unwrap(), 0.9));
}

#[test]
fn outcome_prunes_impossible_builds() {
    // Without learning: a build on the mainline alone would be kept to learn from.
    let mut p = Planner::new(PlannerConfig { max_retries: 0, learn_alone: false, ..cfg(10) });
    let mut builds = Vec::new();
    for c in ["c1", "c2", "c3"] {
        builds.extend(started(&enqueue(&mut p, 0, c, None)));
    }
    assert_eq!(builds.len(), 7, "10 slots cover the whole tree: {:?}", builds.iter().map(shape).collect::<Vec<_>>());
    // c1 fails: it is rejected and every build assuming it lands is cancelled.
    let acts = finish(&mut p, 10, find(&builds, "c1", &[]), false);
    assert!(matches!(&acts[0], Action::Reject { change, .. } if *change == id("c1")));
    let want: BTreeSet<_> =
        [find(&builds, "c2", &["c1"]), find(&builds, "c3", &["c1", "c2"]), find(&builds, "c3", &["c1"])].into();
    assert_eq!(cancelled(&acts), want);
    // c2's build without c1 passes: c2 lands at once, and c3's build that
    // assumed c2 would be rejected is now impossible.
    let acts = finish(&mut p, 20, find(&builds, "c2", &[]), true);
    match &acts[0] {
        Action::Land { change, proof } => {
            assert_eq!(*change, id("c2"));
            assert_eq!(proof.build.id, find(&builds, "c2", &[]));
            assert!(proof.landed_since_base.is_empty(), "exact tree");
        }
        a => panic!("expected land, got {a:?}"),
    }
    assert_eq!(cancelled(&acts), [find(&builds, "c3", &[])].into());
    // c3's build on c2 decides it.
    let acts = finish(&mut p, 30, find(&builds, "c3", &["c2"]), true);
    assert!(
        matches!(&acts[0], Action::Land { change, proof } if *change == id("c3") && proof.build.assumed == vec![id("c2")])
    );
    assert_eq!(p.mainline(), vec![id("c2"), id("c3")]);
    assert!(p.running_builds().is_empty());
}

#[test]
fn independent_changes_land_in_parallel_lanes() {
    let mut p = Planner::new(cfg(10));
    let b1 = started(&enqueue(&mut p, 0, "c1", analysis(&["//a"])));
    let b2 = started(&enqueue(&mut p, 1, "c2", analysis(&["//b"])));
    let b3 = started(&enqueue(&mut p, 2, "c3", analysis(&["//b", "//c"])));
    assert_eq!(b2.len(), 1);
    assert!(b2[0].assumed.is_empty(), "decisive build is on the mainline");
    // c2 finishes first and lands while c1 is still building.
    let acts = finish(&mut p, 5, b2[0].id, true);
    assert!(matches!(&acts[0], Action::Land { change, .. } if *change == id("c2")));
    assert_eq!(p.pending(), vec![id("c1"), id("c3")]);
    // c3 depends on c2 only; its build assuming c2 now decides it.
    let b3_main = b3.iter().find(|b| b.assumed == vec![id("c2")]).expect("main-path build");
    let acts = finish(&mut p, 6, b3_main.id, true);
    assert!(matches!(&acts[0], Action::Land { change, .. } if *change == id("c3")));
    // c1 lands last, with a proof naming the independent changes that landed meanwhile.
    let acts = finish(&mut p, 7, b1[0].id, true);
    match &acts[0] {
        Action::Land { change, proof } => {
            assert_eq!(*change, id("c1"));
            assert_eq!(proof.landed_since_base, vec![id("c2"), id("c3")]);
            assert_eq!(proof.new_version, 3);
        }
        a => panic!("{a:?}"),
    }
}

#[test]
fn failed_landing_counts_as_rejected_and_prunes_builds_assuming_it() {
    // Without learning: c3's build on the mainline alone would be kept to learn from.
    let mut p = Planner::new(PlannerConfig { learn_alone: false, ..cfg(10) });
    let b1 = started(&enqueue(&mut p, 0, "c1", analysis(&["//a"])));
    let b2 = started(&enqueue(&mut p, 1, "c2", analysis(&["//b"])));
    let b3 = started(&enqueue(&mut p, 2, "c3", analysis(&["//b", "//c"])));
    // c1 lands on version 1; c2 (independent, based on version 0) lands as version 2.
    assert!(matches!(&finish(&mut p, 3, b1[0].id, true)[0], Action::Land { .. }));
    let acts = finish(&mut p, 4, b2[0].id, true);
    assert!(matches!(&acts[0], Action::Land { change, proof } if *change == id("c2") && proof.new_version == 2));
    // c3's build without c2 became impossible when c2 landed.
    let with_c2 = find(&b3, "c3", &["c2"]);
    assert_eq!(cancelled(&acts), [find(&b3, "c3", &[])].into());
    // The integrator's check of c2 on top of c1 fails: c2 is out, c3's build
    // that assumed c2 is cancelled, and c3 is built again on the mainline.
    let acts = p.handle(Millis(5), Event::LandingFailed { change: id("c2") }).unwrap();
    assert_eq!(cancelled(&acts), [with_c2].into());
    let again = started(&acts);
    assert_eq!(again.iter().map(shape).collect::<Vec<_>>(), vec![("c3".to_string(), vec![])]);
    assert_eq!(again[0].base_version, 2, "version 2 exists; it holds no change");
    assert_eq!(p.mainline(), vec![id("c1")]);
    assert_eq!(p.stats().landed, 1);
    assert_eq!(p.stats().rejected, 1);
    assert_eq!(p.pending(), vec![id("c3")]);
    let acts = finish(&mut p, 6, again[0].id, true);
    match &acts[0] {
        Action::Land { change, proof } => {
            assert_eq!(*change, id("c3"));
            assert_eq!(proof.new_version, 3);
            assert!(proof.landed_since_base.is_empty());
        }
        a => panic!("{a:?}"),
    }
    assert_eq!(p.mainline(), vec![id("c1"), id("c3")]);
    // Only landed changes can fail to land, and only once.
    assert!(matches!(p.handle(Millis(7), Event::LandingFailed { change: id("c2") }), Err(QueueError::NotLanded(_))));
    assert!(matches!(
        p.handle(Millis(7), Event::LandingFailed { change: id("zz") }),
        Err(QueueError::UnknownChange(_))
    ));
}

#[test]
fn graph_altering_change_blocks_parallel_lane() {
    let mut p = Planner::new(cfg(10));
    enqueue(
        &mut p,
        0,
        "c1",
        Some(ChangeAnalysis { affected: ["//a".to_string()].into(), alters_graph: true, graph_reach: None }),
    );
    enqueue(&mut p, 0, "c2", analysis(&["//b"]));
    assert!(p.dependent(&id("c1"), &id("c2")).unwrap());
}

#[test]
fn a_graph_change_blocks_only_the_lanes_inside_its_reach() {
    let mut p = Planner::new(cfg(10));
    let reach = |r: &[&str]| Some(r.iter().map(|t| t.to_string()).collect());
    let graph = ChangeAnalysis {
        affected: ["//a".to_string()].into(),
        alters_graph: true,
        graph_reach: reach(&["//a", "//lib"]),
    };
    enqueue(&mut p, 0, "c1", analysis(&["//lib"]));
    enqueue(&mut p, 0, "c2", analysis(&["//b"]));
    enqueue(&mut p, 0, "c3", Some(graph.clone()));
    enqueue(&mut p, 0, "c4", analysis(&["//lib", "//c"]));
    enqueue(&mut p, 0, "c5", analysis(&["//d"]));
    enqueue(&mut p, 0, "c6", Some(ChangeAnalysis { affected: ["//e".to_string()].into(), ..graph }));
    assert!(p.dependent(&id("c3"), &id("c1")).unwrap(), "c1 edits a target the new edges reach");
    assert!(!p.dependent(&id("c3"), &id("c2")).unwrap());
    assert!(p.dependent(&id("c4"), &id("c3")).unwrap());
    assert!(!p.dependent(&id("c5"), &id("c3")).unwrap());
    assert!(p.dependent(&id("c6"), &id("c3")).unwrap(), "two graph changes");
}

#[test]
fn flaky_failure_is_retried_before_rejecting() {
    let mut p = Planner::new(PlannerConfig { max_retries: 1, ..cfg(1) });
    let b = started(&enqueue(&mut p, 0, "c1", None));
    let acts = finish(&mut p, 1, b[0].id, false);
    let retry = started(&acts);
    assert_eq!(retry.len(), 1);
    assert_eq!(retry[0].attempt, 2);
    assert!(!acts.iter().any(|a| matches!(a, Action::Reject { .. })));
    let acts = finish(&mut p, 2, retry[0].id, true);
    assert!(matches!(&acts[0], Action::Land { .. }));

    let b = started(&enqueue(&mut p, 3, "c2", None));
    let r = started(&finish(&mut p, 4, b[0].id, false));
    let acts = finish(&mut p, 5, r[0].id, false);
    assert!(matches!(&acts[0], Action::Reject { change, reason } if *change == id("c2") && reason.attempts == 2));
}

#[test]
fn conclusive_failure_is_not_retried() {
    let mut p = Planner::new(PlannerConfig { max_retries: 2, ..cfg(4) });
    let b = started(&enqueue(&mut p, 0, "c1", None));
    let acts = p
        .handle(
            Millis(1),
            Event::BuildFinished { build: b[0].id, outcome: BuildOutcome::FailedConclusively, failed_targets: None },
        )
        .unwrap();
    assert!(started(&acts).is_empty(), "no retry of a tree that cannot pass: {acts:?}");
    assert!(matches!(&acts[0], Action::Reject { change, reason } if *change == id("c1") && reason.attempts == 1));
    // On a speculative tree it only rules out that tree: c3 is still built without c2.
    let b2 = started(&enqueue(&mut p, 2, "c2", None));
    let b3 = started(&enqueue(&mut p, 2, "c3", None));
    let on_c2 = find(&b3, "c3", &["c2"]);
    let acts = p
        .handle(
            Millis(3),
            Event::BuildFinished { build: on_c2, outcome: BuildOutcome::FailedConclusively, failed_targets: None },
        )
        .unwrap();
    assert!(!acts.iter().any(|a| matches!(a, Action::Reject { .. })), "c2 is undecided: {acts:?}");
    assert!(started(&acts).iter().all(|s| shape(s) != ("c3".to_string(), vec!["c2".to_string()])), "{acts:?}");
    // c2 lands: c3 is then decided by nothing but a build on a tree with c2,
    // which is conclusively failed, so c3 is rejected without another build.
    let acts = finish(&mut p, 4, b2[0].id, true);
    assert!(matches!(&acts[0], Action::Land { change, .. } if *change == id("c2")));
    assert!(
        acts.iter()
            .any(|a| matches!(a, Action::Reject { change, reason } if *change == id("c3") && reason.build.id == on_c2)),
        "{acts:?}"
    );
}

#[test]
fn cancelling_a_change_cancels_builds_that_assume_it() {
    let mut p = Planner::new(cfg(10));
    let mut builds = started(&enqueue(&mut p, 0, "c1", None));
    builds.extend(started(&enqueue(&mut p, 0, "c2", None)));
    let acts = p.handle(Millis(1), Event::Cancel { change: id("c1") }).unwrap();
    let want: BTreeSet<_> = [find(&builds, "c1", &[]), find(&builds, "c2", &["c1"])].into();
    assert_eq!(cancelled(&acts), want);
    // The surviving build of c2 (c1 absent) decides it.
    let acts = finish(&mut p, 2, find(&builds, "c2", &[]), true);
    assert!(matches!(&acts[0], Action::Land { change, .. } if *change == id("c2")));
    // A late result of a cancelled build is ignored, an invented one is an error.
    assert!(finish(&mut p, 3, find(&builds, "c1", &[]), true).is_empty());
    assert!(matches!(
        p.handle(
            Millis(3),
            Event::BuildFinished { build: BuildId(999), outcome: BuildOutcome::Passed, failed_targets: None }
        ),
        Err(QueueError::UnknownBuild(999))
    ));
}

#[test]
fn preemption_makes_room_for_a_more_valuable_build() {
    let mut p = Planner::new(cfg(0));
    enqueue(&mut p, 0, "c1", analysis(&["//a"]));
    enqueue(&mut p, 0, "c2", analysis(&["//a"]));
    p.override_success(&id("c1"), 0.2).unwrap();
    // Values: B1 = 1, B2 (c1 rejected) = 0.8, B12 = 0.2: two slots take B1 and B2.
    let acts = p.handle(Millis(1), Event::SetCapacity { capacity: 2 }).unwrap();
    let b = started(&acts);
    let mut got: Vec<_> = b.iter().map(shape).collect();
    got.sort();
    assert_eq!(got, vec![("c1".to_string(), vec![]), ("c2".to_string(), vec![])]);
    // c1 now looks very likely to land, so the running B2 is worth only 0.05,
    // and a new independent change (value 1) takes its slot. B12 (0.95) is not
    // worth twice the still-running B1 (1.0), so nothing else moves.
    p.override_success(&id("c1"), 0.95).unwrap();
    let acts = enqueue(&mut p, 2, "c9", analysis(&["//q"]));
    assert_eq!(cancelled(&acts), [find(&b, "c2", &[])].into());
    let got: Vec<_> = started(&acts).iter().map(shape).collect();
    assert_eq!(got, vec![("c9".to_string(), vec![])]);
    assert_eq!(p.stats().builds_preempted, 1);
    // Without preemption nothing is cancelled.
    let mut q = Planner::new(PlannerConfig { preempt_factor: None, ..cfg(0) });
    enqueue(&mut q, 0, "c1", analysis(&["//a"]));
    enqueue(&mut q, 0, "c2", analysis(&["//a"]));
    q.override_success(&id("c1"), 0.2).unwrap();
    q.handle(Millis(1), Event::SetCapacity { capacity: 2 }).unwrap();
    q.override_success(&id("c1"), 0.95).unwrap();
    assert!(enqueue(&mut q, 2, "c9", analysis(&["//q"])).is_empty());
}

#[test]
fn hedged_retry_runs_alongside_a_risky_build() {
    let mut p = Planner::new(PlannerConfig { hedge_retries: true, max_retries: 1, ..cfg(2) });
    enqueue(&mut p, 0, "solid", analysis(&["//a"]));
    // With one slot left, a risky change gets its first attempt; a second
    // slot then goes to a concurrent retry (value 1 × P(fail) = 0.7).
    let mut p2 = Planner::new(PlannerConfig { hedge_retries: true, max_retries: 1, ..cfg(0) });
    enqueue(&mut p2, 0, "risky", None);
    p2.override_success(&id("risky"), 0.3).unwrap();
    let acts = p2.handle(Millis(1), Event::SetCapacity { capacity: 2 }).unwrap();
    let b = started(&acts);
    assert_eq!(b.len(), 2);
    assert_eq!(b.iter().map(|x| x.attempt).collect::<Vec<_>>(), vec![1, 2]);
    assert!(b.iter().all(|x| x.assumed.is_empty()));
    // Both fail: the change is rejected as soon as the second result arrives.
    assert!(finish(&mut p2, 2, b[0].id, false).iter().all(|a| !matches!(a, Action::Reject { .. })));
    let acts = finish(&mut p2, 3, b[1].id, false);
    assert!(matches!(&acts[0], Action::Reject { reason, .. } if reason.attempts == 2));
    // A passing attempt wins and the redundant one is cancelled.
    let mut p3 = Planner::new(PlannerConfig { hedge_retries: true, max_retries: 1, ..cfg(0) });
    enqueue(&mut p3, 0, "risky", None);
    p3.override_success(&id("risky"), 0.3).unwrap();
    let b = started(&p3.handle(Millis(1), Event::SetCapacity { capacity: 2 }).unwrap());
    let acts = finish(&mut p3, 2, b[0].id, true);
    assert!(matches!(&acts[0], Action::Land { .. }));
    assert_eq!(cancelled(&acts), [b[1].id].into());
    // A likely-good change's hedge (worth 0.1) fills a spare slot but yields
    // it to a new change's first build.
    let acts = enqueue(&mut p, 1, "other", analysis(&["//b"]));
    assert_eq!(cancelled(&acts).len(), 1, "{acts:?}");
    assert_eq!(started(&acts).iter().map(shape).collect::<Vec<_>>(), vec![("other".to_string(), vec![])]);
}

#[test]
fn preset_applies_on_arrival_and_prices_the_first_plan() {
    // Known to fail: the arrival's own plan already hedges the retry.
    let mut p = Planner::new(PlannerConfig { hedge_retries: true, max_retries: 1, min_value: 0.5, ..cfg(4) });
    p.preset(id("bad"), 0.0, &[]).unwrap();
    let b = started(&enqueue(&mut p, 0, "bad", None));
    assert_eq!(b.iter().map(|x| x.attempt).collect::<Vec<_>>(), vec![1, 2]);
    // Known to pass: no hedge, where the pessimistic prior alone hedges.
    let mut q = Planner::new(PlannerConfig {
        hedge_retries: true,
        max_retries: 1,
        min_value: 0.5,
        prior_success: 0.2,
        ..cfg(6)
    });
    let without = started(&enqueue(&mut q, 0, "x", None));
    assert_eq!(without.iter().map(|x| x.attempt).collect::<Vec<_>>(), vec![1, 2], "the prior alone hedges");
    q.preset(id("good"), 1.0, &[(id("x"), 1.0)]).unwrap();
    let b = started(&enqueue(&mut q, 1, "good", None));
    assert!(!b.is_empty() && b.iter().all(|x| x.attempt == 1), "{b:?}");
    let snap = q.snapshot();
    let good = snap.iter().find(|v| v.change == id("good")).unwrap();
    // P(lands) = P(x fails) · 1 + P(x lands) · (1 − conflict) = 0.8 · 1 + 0.2 · 0.
    assert!(close(good.landing_probability, 0.8), "{}", good.landing_probability);
    // Bad input changes nothing.
    assert!(matches!(q.preset(id("good"), 1.0, &[]), Err(QueueError::DuplicateChange(_))));
    assert!(matches!(q.preset(id("new"), 1.0, &[(id("nope"), 1.0)]), Err(QueueError::UnknownChange(_))));
    enqueue(&mut q, 2, "new", None);
    let snap = q.snapshot();
    assert!(!close(snap.iter().find(|v| v.change == id("new")).unwrap().landing_probability, 1.0));
}

#[test]
fn blocking_weight_prefers_changes_others_wait_for() {
    // c1 is uncertain (value of its own build is 1, but think of c3's
    // alternatives): with weights, c1's hedge/alternatives outrank a lone
    // independent change's speculative builds.
    let mut p = Planner::new(PlannerConfig { blocking_weight: 1.0, ..cfg(0) });
    enqueue(&mut p, 0, "a", analysis(&["//a"]));
    enqueue(&mut p, 0, "b1", analysis(&["//a"]));
    enqueue(&mut p, 0, "b2", analysis(&["//a"]));
    enqueue(&mut p, 0, "x", analysis(&["//x"]));
    enqueue(&mut p, 0, "y", analysis(&["//x"]));
    p.override_success(&id("a"), 0.5).unwrap();
    p.override_success(&id("x"), 0.5).unwrap();
    // Pure values: a=1, x=1, b1|a=0.5, b1|¬a=0.5, y|x=0.5, y|¬x=0.5, b2 ...
    // With weights, a's dependents (b1, b2) lift b1's builds (b2 waits on b1)
    // above y's, which nobody waits for.
    let acts = p.handle(Millis(1), Event::SetCapacity { capacity: 4 }).unwrap();
    let got: Vec<_> = started(&acts).iter().map(shape).collect();
    assert!(got.contains(&("a".to_string(), vec![])));
    assert!(got.contains(&("x".to_string(), vec![])));
    assert!(got.iter().filter(|(c, _)| c == "b1").count() == 2, "{got:?}");
    assert!(!got.iter().any(|(c, _)| c == "y"), "{got:?}");
}

#[test]
fn errors_are_reported() {
    let mut p = Planner::new(cfg(1));
    enqueue(&mut p, 10, "c1", None);
    assert!(matches!(
        p.handle(
            Millis(10),
            Event::Enqueue { change: id("c1"), features: ChangeFeatures::default(), analysis: None, priority: 0 }
        ),
        Err(QueueError::DuplicateChange(_))
    ));
    assert!(matches!(
        p.handle(Millis(5), Event::Cancel { change: id("c1") }),
        Err(QueueError::ClockWentBackwards { .. })
    ));
    assert!(matches!(p.handle(Millis(11), Event::Cancel { change: id("nope") }), Err(QueueError::UnknownChange(_))));
}

#[test]
fn model_is_trained_from_decisions() {
    let mut p = Planner::new(PlannerConfig { retrain_every: 10, min_training_examples: 10, max_retries: 0, ..cfg(4) });
    let mut t = 0;
    for k in 0..40 {
        let name = format!("c{k}");
        let features =
            ChangeFeatures { presubmit_passed: k % 4 != 0, lines_changed: 10 + k, ..ChangeFeatures::default() };
        let mut acts = p
            .handle(
                Millis(t),
                Event::Enqueue { change: id(&name), features, analysis: analysis(&[&name]), priority: 0 },
            )
            .unwrap();
        // Independent changes: the one build decides; fail exactly the presubmit failures.
        while let Some(b) = started(&acts).first().cloned() {
            t += 1;
            acts = finish(&mut p, t, b.id, k % 4 != 0);
        }
    }
    assert_eq!(p.stats().landed, 30);
    assert_eq!(p.stats().rejected, 10);
    assert!(p.stats().retrains >= 3);
    let m = p.model().expect("trained");
    assert_eq!(m.trained_on, 40);
    let history: Vec<_> = p.training_history().cloned().collect();
    let again = gantry_queue::LogisticModel::train(&history, &p.config().train).unwrap();
    assert_eq!(&again, m, "training is a pure function of the history");
}

#[test]
fn overload_builds_only_the_most_likely_path() {
    // Three dependent changes, two slots: more pending changes than slots.
    let overload = PlannerConfig { overload_pending_factor: Some(1.0), hedge_retries: true, max_retries: 1, ..cfg(0) };
    let mut p = Planner::new(overload.clone());
    for c in ["c1", "c2", "c3"] {
        enqueue(&mut p, 0, c, None);
    }
    p.override_success(&id("c1"), 0.6).unwrap();
    let acts = p.handle(Millis(1), Event::SetCapacity { capacity: 2 }).unwrap();
    let mut got: Vec<_> = started(&acts).iter().map(shape).collect();
    got.sort();
    // Pure values would pick B1 (1.0) and B2|¬c1 (0.4) or B12 (0.6) and
    // hedge B1; under overload each change gets its most likely build only,
    // the earliest (most valuable) first, and no hedged second attempt.
    assert_eq!(got, vec![("c1".to_string(), vec![]), ("c2".to_string(), vec!["c1".to_string()])]);
    assert!(started(&acts).iter().all(|b| b.attempt == 1));
    // With room for everyone (pending <= capacity) the full tree is explored again.
    let acts = p.handle(Millis(2), Event::SetCapacity { capacity: 6 }).unwrap();
    let got: Vec<_> = started(&acts).iter().map(shape).collect();
    assert!(got.contains(&("c2".to_string(), vec![])), "{got:?}");
    assert!(got.iter().any(|(c, a)| c == "c3" && a.len() < 2), "{got:?}");
}

#[test]
fn conflict_hazard_is_bounded() {
    // Twenty dependent predecessors with a 10% pairwise conflict prior would
    // push P(lands) of the last change to 0.9·(1−0.09)^19 ≈ 0.15 and make
    // everyone behind it speculate on its rejection; the bound keeps it at
    // 0.9·(1 − 0.4) = 0.54.
    let config = PlannerConfig { prior_conflict: 0.1, max_conflict_probability: 0.4, ..cfg(0) };
    let mut p = Planner::new(config);
    for k in 0..20 {
        enqueue(&mut p, 0, &format!("c{k}"), None);
    }
    let probs: HashMap<_, _> = p.landing_probabilities().into_iter().collect();
    assert!(close(probs[&id("c0")], 0.9));
    assert!(close(probs[&id("c1")], 0.9 * (1.0 - 0.9 * 0.1)));
    assert!(close(probs[&id("c19")], 0.9 * 0.6), "{}", probs[&id("c19")]);
    // Explicit overrides (the oracle's exact knowledge) are never capped.
    p.override_conflict(&id("c19"), &id("c0"), 1.0).unwrap();
    let probs: HashMap<_, _> = p.landing_probabilities().into_iter().collect();
    assert!(close(probs[&id("c19")], 0.9 * 0.6 * 0.1), "{}", probs[&id("c19")]);
}

#[test]
fn trained_model_is_not_discounted_for_conflicts_twice() {
    // A model trained on landing outcomes already includes conflict losses.
    let n = gantry_queue::model::NUM_FEATURES;
    let model = gantry_queue::LogisticModel {
        feature_names: gantry_queue::model::FEATURE_NAMES.iter().map(|s| s.to_string()).collect(),
        means: vec![0.0; n],
        stds: vec![1.0; n],
        weights: vec![0.0; n],
        bias: (0.8f64 / 0.2).ln(),
        trained_on: 100,
    };
    for (includes, want) in [(true, 0.8), (false, 0.8 * (1.0 - 0.9 * 0.1))] {
        let mut p = Planner::new(PlannerConfig { prior_conflict: 0.1, model_includes_conflicts: includes, ..cfg(0) });
        p.set_model(Some(model.clone()));
        enqueue(&mut p, 0, "c1", None);
        enqueue(&mut p, 0, "c2", None);
        p.override_success(&id("c1"), 0.9).unwrap();
        let probs: HashMap<_, _> = p.landing_probabilities().into_iter().collect();
        assert!(close(probs[&id("c2")], want), "{includes}: {}", probs[&id("c2")]);
    }
}

/// Drives a batching planner with one slot through changes `c1..=cn` (c1
/// first, alone, then the rest as a backlog) where the changes in `broken`
/// fail every tree holding them. Returns (builds started, shape of each build
/// in order, landed, rejected, batch sizes).
#[allow(clippy::type_complexity)]
fn run_batched(
    n: usize,
    broken: &[usize],
) -> (usize, Vec<(String, Vec<String>)>, Vec<String>, Vec<String>, Vec<usize>) {
    run_batched_with(
        PlannerConfig { capacity: 1, max_retries: 0, batching: true, ..PlannerConfig::default() },
        n,
        broken,
    )
}

#[allow(clippy::type_complexity)]
fn run_batched_with(
    config: PlannerConfig,
    n: usize,
    broken: &[usize],
) -> (usize, Vec<(String, Vec<String>)>, Vec<String>, Vec<String>, Vec<usize>) {
    let mut p = Planner::new(config);
    let mut running: Vec<BuildSpec> = Vec::new();
    let (mut shapes, mut landed, mut rejected, mut batches) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut absorb = |acts: Vec<Action>, running: &mut Vec<BuildSpec>| {
        for a in acts {
            match a {
                Action::StartBuild { build } => {
                    shapes.push(shape(&build));
                    running.push(build);
                }
                Action::CancelBuild { id } => running.retain(|b| b.id != id),
                Action::Land { change, proof } => {
                    if proof.batch.last() == Some(&change) {
                        batches.push(proof.batch.len());
                    }
                    landed.push(change.0);
                }
                Action::Reject { change, .. } => rejected.push(change.0),
            }
        }
    };
    let mut t = 0;
    for i in 1..=n {
        t += 1;
        absorb(enqueue(&mut p, t, &format!("c{i}"), None), &mut running);
    }
    while let Some(b) = running.pop() {
        t += 1;
        let tree_ok = b.assumed.iter().chain([&b.change]).all(|c| !broken.contains(&c.0[1..].parse().unwrap()));
        absorb(finish(&mut p, t, b.id, tree_ok), &mut running);
    }
    if broken.is_empty() {
        assert_eq!(p.stats().bisection_builds, 0, "nothing failed, nothing was bisected");
    }
    (shapes.len(), shapes, landed, rejected, batches)
}

#[test]
fn a_passing_batch_lands_every_change_in_one_build() {
    let (builds, shapes, landed, rejected, batches) = run_batched(4, &[]);
    // c1 arrived to an idle queue and was built alone; c2..c4 queued behind it
    // (a backlog of 3 on 1 slot) and were built as one tree.
    assert_eq!(shapes[1], ("c4".to_string(), vec!["c2".to_string(), "c3".to_string()]));
    assert_eq!(builds, 2, "{shapes:?}");
    assert_eq!(landed, ["c1", "c2", "c3", "c4"]);
    assert!(rejected.is_empty());
    assert_eq!(batches, [3]);
}

#[test]
fn fixed_batches_cut_the_queue_in_batches_of_max_batch_and_bisect_a_failure() {
    // GitHub-style (the simulator's batch-only): the backlog of six behind c1 is cut
    // into batches of three whatever the load, where adaptive batching, on one slot,
    // grows its first batch until the predicted P(pass) would fall too low.
    let fixed = PlannerConfig {
        capacity: 1,
        max_retries: 0,
        batching: true,
        fixed_batches: true,
        max_batch: 3,
        strategy: gantry_queue::Strategy::Optimistic,
        use_analyzer: false,
        ..PlannerConfig::default()
    };
    let (builds, shapes, landed, rejected, batches) = run_batched_with(fixed.clone(), 7, &[]);
    assert_eq!(landed, ["c1", "c2", "c3", "c4", "c5", "c6", "c7"]);
    assert!(rejected.is_empty());
    assert_eq!((builds, batches), (3, vec![3, 3]), "{shapes:?}");
    let (_, shapes, ..) = run_batched(7, &[]);
    assert!(shapes[1].1.len() + 1 > 3, "{shapes:?}");
    // A broken member: its batch fails, is halved until the culprit is alone, and
    // everything else lands.
    let (_, shapes, landed, rejected, _) = run_batched_with(fixed, 7, &[3]);
    assert_eq!(rejected, ["c3"], "{shapes:?}");
    assert_eq!(landed, ["c1", "c2", "c4", "c5", "c6", "c7"], "{shapes:?}");
}

#[test]
fn a_failing_batch_is_bisected_to_its_culprit() {
    // Eight changes behind c1, c6 broken. The first batch holds c6 and fails;
    // halving it finds c6 in log2(batch size) more rounds, and one more build
    // lands what is left.
    let (builds, shapes, landed, rejected, batches) = run_batched(9, &[6]);
    assert_eq!(rejected, ["c6"]);
    assert_eq!(landed, ["c1", "c2", "c3", "c4", "c5", "c7", "c8", "c9"]);
    let first = shapes[1].1.len() + 1;
    assert!(first >= 5 && shapes[1].1[0] == "c2", "the backlog is batched: {shapes:?}");
    let rounds = first.next_power_of_two().trailing_zeros() as usize;
    assert!(builds <= 1 + 1 + rounds + 1, "{builds} builds: {shapes:?}");
    assert!(!batches.is_empty(), "the passing halves land as batches: {shapes:?}");
}

#[test]
fn with_batching_off_every_change_is_decided_by_its_own_build() {
    let mut p = Planner::new(PlannerConfig { capacity: 1, max_retries: 0, ..PlannerConfig::default() });
    assert!(!p.config().batching, "batching is opt-in");
    enqueue(&mut p, 1, "c1", None);
    let b = started(&enqueue(&mut p, 2, "c2", None));
    assert!(b.is_empty());
    let acts = finish(&mut p, 3, BuildId(0), true);
    assert!(matches!(&acts[0], Action::Land { proof, .. } if proof.batch.is_empty()));
}

#[test]
fn attribution_decides_the_members_a_failed_tree_clears() {
    // c1 alone on an idle queue; c2..c5 queue behind it and are built as one
    // tree. c3 is broken. The tree fails in //a only, c3's target (c2 shares
    // it): c4 and c5, whose targets passed, land at once, by attribution,
    // without c2 and c3; c2 and c3 are then decided by builds of their own.
    let mut p = Planner::new(PlannerConfig { capacity: 1, max_retries: 0, batching: true, ..PlannerConfig::default() });
    let b1 = started(&enqueue(&mut p, 1, "c1", analysis(&["//z"])));
    for (t, (c, target)) in [("c2", "//a"), ("c3", "//a"), ("c4", "//b"), ("c5", "//c")].into_iter().enumerate() {
        enqueue(&mut p, 2 + t as u64, c, analysis(&[target]));
    }
    let acts = finish(&mut p, 10, b1[0].id, true);
    let tree = started(&acts);
    assert_eq!(tree.iter().map(shape).collect::<Vec<_>>(), [shape(&tree[0])]);
    assert_eq!(shape(&tree[0]), ("c5".to_string(), vec!["c2".into(), "c3".into(), "c4".into()]));
    let acts = p
        .handle(
            Millis(11),
            Event::BuildFinished {
                build: tree[0].id,
                outcome: BuildOutcome::Failed,
                failed_targets: Some(vec!["//a".to_string()]),
            },
        )
        .unwrap();
    let landed: Vec<(String, bool, Vec<ChangeId>)> = acts
        .iter()
        .filter_map(|a| match a {
            Action::Land { change, proof } => Some((change.0.clone(), proof.by_attribution, proof.omitted.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        landed,
        [
            ("c4".to_string(), true, vec![id("c2"), id("c3"), id("c5")]),
            ("c5".to_string(), true, vec![id("c2"), id("c3")])
        ]
    );
    // The rest: c2 is the head of its lane; c3 follows on it and fails.
    let mut builds = 2;
    let mut running = started(&acts);
    let mut decided = Vec::new();
    while let Some(b) = running.pop() {
        builds += 1;
        let acts = finish(&mut p, 20 + builds, b.id, b.change != id("c3"));
        for a in &acts {
            match a {
                Action::Land { change, .. } => decided.push(format!("{change} landed")),
                Action::Reject { change, .. } => decided.push(format!("{change} rejected")),
                _ => {}
            }
        }
        running.extend(started(&acts));
    }
    assert_eq!(decided, ["c2 landed", "c3 rejected"]);
    assert_eq!(builds, 4, "c1, the tree, c2, c3");
}

/// Ground truth for the property test: each change fails alone or conflicts
/// with some earlier ones; a build passes iff the change is fine and no
/// conflicting change is in its tree.
#[derive(Debug, Clone)]
struct World {
    ok: Vec<bool>,
    conflicts: Vec<Vec<usize>>,
    targets: Vec<Option<Vec<u8>>>,
    /// Per change: `None`, it keeps the graph; `Some(None)`, it alters the graph
    /// in ways not known; `Some(Some(r))`, it alters the graph and its reach is
    /// its targets plus `r`.
    graph: Vec<Option<Option<Vec<u8>>>>,
}

fn world(max: usize) -> impl Strategy<Value = World> {
    (1..=max).prop_flat_map(|n| {
        (
            proptest::collection::vec(proptest::bool::weighted(0.8), n),
            proptest::collection::vec(proptest::collection::vec(any::<proptest::sample::Index>(), 0..2), n),
            proptest::collection::vec(proptest::option::weighted(0.8, proptest::collection::vec(0u8..4, 1..3)), n),
            proptest::collection::vec(
                proptest::option::weighted(
                    0.2,
                    proptest::option::weighted(0.7, proptest::collection::vec(0u8..6, 0..3)),
                ),
                n,
            ),
        )
            .prop_map(move |(ok, conf, targets, graph)| {
                let conflicts = conf
                    .iter()
                    .enumerate()
                    .map(|(i, xs)| {
                        let mut v: Vec<usize> = if i == 0 { vec![] } else { xs.iter().map(|x| x.index(i)).collect() };
                        v.sort_unstable();
                        v.dedup();
                        v
                    })
                    .collect();
                World { ok, conflicts, targets, graph }
            })
    })
}

/// What the analyzer says of change `i` (None: it could not analyse it).
fn world_analysis(w: &World, i: usize) -> Option<ChangeAnalysis> {
    let label = |t: &u8| format!("//t{t}");
    w.targets[i].as_ref().map(|ts| ChangeAnalysis {
        affected: ts.iter().map(label).collect(),
        alters_graph: w.graph[i].is_some(),
        graph_reach: w.graph[i].as_ref().and_then(|r| r.as_ref()).map(|r| ts.iter().chain(r).map(label).collect()),
    })
}

/// The analyzer's rule (its soundness is `tests/conflict.rs`'s business).
fn independent(w: &World, a: usize, b: usize) -> bool {
    match (world_analysis(w, a), world_analysis(w, b)) {
        (Some(x), Some(y)) => x.independent_of(&y),
        _ => false,
    }
}

fn at(serial: &[usize], x: usize) -> usize {
    serial.iter().position(|&y| y == x).expect("arrived")
}

/// Whether `c` lands in the serial order: it is fine on its own and no
/// conflict partner before it landed (`decided` holds them all).
fn serial_outcome(
    w: &World,
    partners: &[Vec<usize>],
    serial: &[usize],
    decided: &HashMap<usize, bool>,
    c: usize,
) -> bool {
    let before = &serial[..at(serial, c)];
    w.ok[c] && partners[c].iter().all(|j| !before.contains(j) || decided.get(j) == Some(&false))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn serializability_under_random_outcomes(
        mut w in world(7),
        capacity in 1usize..6,
        picks in proptest::collection::vec(any::<proptest::sample::Index>(), 200),
        arrival_gaps in proptest::collection::vec(0usize..3, 7),
        batching in any::<bool>(),
        attribution in any::<bool>(),
        priorities in proptest::collection::vec(prop_oneof![4 => Just(0i32), 1 => Just(1), 1 => Just(2)], 7),
        compactions in proptest::collection::vec(proptest::bool::weighted(0.3), 64),
        max_retries in 0u32..3,
        // Per change: 0-1 nothing told, 2 its own outcome told (success preset to 1
        // or 0, as the simulator's oracles are told), 3 the opposite told (a wrong
        // override must cost builds, never a wrong decision).
        told in proptest::collection::vec(0u8..4, 7),
        // A low prior makes every tree uncertain, so that builds on the mainline alone
        // (learning each change's own outcome) get slots.
        prior_success in prop_oneof![Just(0.9), Just(0.5)],
    ) {
        // Ground-truth conflicts only between changes the analyzer calls
        // dependent; otherwise the analyzer would be wrong, not the planner.
        let n = w.ok.len();
        for i in 0..n {
            let keep: Vec<usize> = w.conflicts[i].iter().copied().filter(|&j| !independent(&w, i, j)).collect();
            w.conflicts[i] = keep;
        }
        // Conflicts are between pairs: whichever of the two is later in the
        // serial order fails when the other is in its tree. Priorities can
        // put a later arrival first.
        let mut partners: Vec<Vec<usize>> = w.conflicts.clone();
        for i in 0..n {
            for &j in &w.conflicts[i] {
                partners[j].push(i);
            }
        }
        // The serial order: arrival order, except that an arrival goes ahead
        // of the undecided changes of lower priority that depend on it, and
        // of the ones behind those that depend on them.
        let mut serial: Vec<usize> = Vec::new();
        let mut p =
            Planner::new(PlannerConfig { capacity, max_retries, batching, prior_success, ..PlannerConfig::default() });
        // A twin that now and then forgets its decided changes and is restored from
        // its saved state (a queue's retention): it must answer every event alike.
        let mut twin = Planner::new(p.config().clone());
        let mut events = 0usize;
        let name = |i: usize| ChangeId(format!("c{i}"));
        let index = |c: &ChangeId| c.0[1..].parse::<usize>().unwrap();
        let mut running: Vec<BuildSpec> = Vec::new();
        let mut passed: HashSet<BuildId> = HashSet::new();
        // (build, member) whose own targets passed on the build's tree.
        let mut member_pass: HashSet<(BuildId, usize)> = HashSet::new();
        let mut mainline: Vec<usize> = Vec::new();
        let mut decided: HashMap<usize, bool> = HashMap::new();
        let mut next_arrival = 0;
        let mut gap = 0;
        let mut t = 0u64;
        let mut step = 0;
        loop {
            t += 1;
            // Interleave arrivals and build completions in a random order.
            let arrive = next_arrival < n && (running.is_empty() || gap >= arrival_gaps[next_arrival]);
            let event = if arrive {
                gap = 0;
                let i = next_arrival;
                next_arrival += 1;
                let mut moved: Vec<usize> = Vec::new();
                for &j in &serial {
                    if !decided.contains_key(&j) && priorities[j] < priorities[i]
                        && (!independent(&w, i, j) || moved.iter().any(|&k| !independent(&w, j, k)))
                    {
                        moved.push(j);
                    }
                }
                serial.retain(|j| !moved.contains(j));
                serial.push(i);
                serial.extend(moved);
                let analysis = world_analysis(&w, i);
                if told[i] >= 2 {
                    let success = if w.ok[i] == (told[i] == 2) { 1.0 } else { 0.0 };
                    p.preset(name(i), success, &[]).unwrap();
                    twin.preset(name(i), success, &[]).unwrap();
                }
                Event::Enqueue { change: name(i), features: ChangeFeatures::default(), analysis, priority: priorities[i] }
            } else if let Some(pick) = picks.get(step % picks.len()) {
                gap += 1;
                step += 1;
                if running.is_empty() { break; }
                let b = running.remove(pick.index(running.len()));
                let c = index(&b.change);
                let tree: HashSet<usize> = mainline[..b.base_version as usize].iter().copied()
                    .chain(b.assumed.iter().map(index)).chain([c]).collect();
                // The build steps run on the whole tree: every change in it must
                // be fine and meet none of its conflicts there.
                let member_ok =
                    |m: usize| w.ok[m] && partners[m].iter().all(|&j| !tree.contains(&j) || at(&serial, j) > at(&serial, m));
                let members: Vec<usize> = b.assumed.iter().map(index).chain([c]).collect();
                for &m in &members {
                    if member_ok(m) { member_pass.insert((b.id, m)); }
                }
                let failing: Vec<usize> = members.iter().copied().filter(|&m| !member_ok(m)).collect();
                let ok = failing.is_empty();
                if ok { passed.insert(b.id); }
                // Per-target results: a failing member fails all its targets.
                let failed_targets = if ok || !attribution {
                    None
                } else {
                    failing.iter().map(|&m| w.targets[m].clone()).collect::<Option<Vec<Vec<u8>>>>()
                        .map(|v| v.into_iter().flatten().map(|t| format!("//t{t}")).collect())
                };
                Event::BuildFinished {
                    build: b.id, outcome: if ok { BuildOutcome::Passed } else { BuildOutcome::Failed }, failed_targets,
                }
            } else { unreachable!() };
            if compactions[events % compactions.len()] {
                twin.forget_decided();
                twin = Planner::restore_state(&twin.save_state().unwrap()).unwrap();
            }
            events += 1;
            let acts = p.handle(Millis(t), event.clone()).unwrap();
            prop_assert_eq!(&twin.handle(Millis(t), event).unwrap(), &acts);
            for a in acts {
                match a {
                    Action::StartBuild { build } => {
                        prop_assert_eq!(build.base_version as usize, mainline.len());
                        // Never more attempts of one tree at once than the rule allows
                        // (a tree: its base, the changes assumed, the change).
                        let same = running
                            .iter()
                            .filter(|r| r.change == build.change && r.assumed == build.assumed && r.base_version == build.base_version)
                            .count();
                        prop_assert!(same < max_retries as usize + 1, "{} attempts of one tree at once: {:?} while {:?}; mr {} batching {}", same + 1, build, running, max_retries, batching);
                        running.push(build);
                    }
                    Action::CancelBuild { id } => {
                        let before = running.len();
                        running.retain(|b| b.id != id);
                        prop_assert_eq!(running.len() + 1, before, "cancelled a build that was not running");
                    }
                    Action::Land { change, proof } => {
                        let c = index(&change);
                        // Every landed tree was tested: a passed build of this
                        // change whose assumptions all landed, and anything else
                        // that landed since its base is independent.
                        if proof.by_attribution {
                            // Its own targets passed on a tree that failed.
                            prop_assert!(batching && attribution);
                            prop_assert!(member_pass.contains(&(proof.build.id, c)));
                        } else {
                            prop_assert!(passed.contains(&proof.build.id));
                        }
                        // A batch lands its members in queue order, the build's
                        // own change last; the members after this one follow.
                        let later: Vec<&ChangeId> = proof.batch.iter().skip_while(|x| **x != change).skip(1).collect();
                        if proof.batch.is_empty() {
                            prop_assert!(proof.build.change == change || proof.by_attribution);
                        } else {
                            prop_assert!(batching, "a batch landing with batching off");
                            prop_assert!(proof.batch.contains(&change));
                            prop_assert_eq!(proof.batch.last(), Some(&proof.build.change));
                        }
                        prop_assert!(proof.omitted.is_empty() || batching, "omitted changes with batching off");
                        for a in &proof.build.assumed {
                            // Left out of the landed tree (monotone failures): a
                            // rejected change, or one after this change.
                            let omitted = proof.omitted.contains(a)
                                && (at(&serial, index(a)) > at(&serial, c)
                                    || decided.get(&index(a)) == Some(&false)
                                    || independent(&w, c, index(a)));
                            prop_assert!(mainline.contains(&index(a)) || *a == change || later.contains(&a) || omitted,
                                "c{} landed assuming {} without it", c, a);
                        }
                        for &x in &mainline[proof.build.base_version as usize..] {
                            let assumed = proof.build.assumed.iter().any(|a| index(a) == x);
                            prop_assert!(assumed || independent(&w, c, x));
                        }
                        // In order: every earlier dependent change is decided.
                        for &e in &serial[..at(&serial, c)] {
                            prop_assert!(decided.contains_key(&e) || independent(&w, c, e), "c{} landed before c{}", c, e);
                        }
                        prop_assert!(serial_outcome(&w, &partners, &serial, &decided, c), "c{} landed but must be rejected", c);
                        mainline.push(c);
                        decided.insert(c, true);
                    }
                    Action::Reject { change, reason } => {
                        let c = index(&change);
                        // Nothing here fails conclusively: every rejection rests on
                        // 1 + max_retries failures of its tree.
                        prop_assert!(reason.attempts > max_retries, "c{} rejected after {} attempts", c, reason.attempts);
                        for &e in &serial[..at(&serial, c)] {
                            prop_assert!(decided.contains_key(&e) || independent(&w, c, e));
                        }
                        prop_assert!(!serial_outcome(&w, &partners, &serial, &decided, c), "c{} rejected but must land", c);
                        decided.insert(c, false);
                    }
                }
            }
            if next_arrival == n && running.is_empty() { break; }
        }
        // Everything decided, and the landed set is exactly the serial
        // reference: each change in the final serial order, tried on the
        // changes before it that landed.
        prop_assert_eq!(decided.len(), n);
        let mut reference: HashMap<usize, bool> = HashMap::new();
        for &c in &serial {
            let fine = serial_outcome(&w, &partners, &serial, &reference, c);
            reference.insert(c, fine);
        }
        prop_assert_eq!(&decided, &reference);
        // With no independence, the landed sequence is the serial order.
        if w.targets.iter().all(Option::is_none) {
            let in_order: Vec<usize> = serial.iter().copied().filter(|c| decided[c]).collect();
            prop_assert_eq!(in_order, mainline);
        }
    }
}

/// Runs every build to its end (the oldest first), each passing when `ok`
/// says so, and returns the decisions in order ("c1 landed", "c3 rejected")
/// and the shapes of the builds started on the way.
fn run_to_end(
    p: &mut Planner,
    mut t: u64,
    mut running: Vec<BuildSpec>,
    ok: impl Fn(&BuildSpec) -> bool,
) -> (Vec<String>, Vec<(String, Vec<String>)>) {
    let (mut decided, mut shapes) = (Vec::new(), Vec::new());
    while !running.is_empty() {
        let b = running.remove(0);
        t += 1;
        for a in finish(p, t, b.id, ok(&b)) {
            match a {
                Action::StartBuild { build } => {
                    shapes.push(shape(&build));
                    running.push(build);
                }
                Action::CancelBuild { id } => running.retain(|b| b.id != id),
                Action::Land { change, .. } => decided.push(format!("{change} landed")),
                Action::Reject { change, .. } => decided.push(format!("{change} rejected")),
            }
        }
    }
    (decided, shapes)
}

fn enqueue_urgent(p: &mut Planner, t: u64, name: &str, a: Option<ChangeAnalysis>, priority: i32) -> Vec<Action> {
    p.handle(Millis(t), Event::Enqueue { change: id(name), features: ChangeFeatures::default(), analysis: a, priority })
        .unwrap()
}

#[test]
fn a_higher_priority_change_goes_ahead_of_the_lower_ones_that_depend_on_it() {
    let mut p = Planner::new(PlannerConfig { max_retries: 0, ..cfg(1) });
    let b1 = started(&enqueue(&mut p, 1, "c1", analysis(&["//a"])));
    assert_eq!(b1.len(), 1);
    enqueue(&mut p, 2, "c2", analysis(&["//a"]));
    enqueue(&mut p, 3, "c3", analysis(&["//b"]));
    let acts = enqueue_urgent(&mut p, 4, "u", analysis(&["//a"]), 1);
    // u touches c1's and c2's target, so they go behind it; c3 is
    // independent of u and keeps its place.
    assert_eq!(p.pending(), [id("c3"), id("u"), id("c1"), id("c2")]);
    assert_eq!(p.stats().requeued, 2);
    assert!(cancelled(&acts).contains(&b1[0].id), "c1's build did not hold u: {acts:?}");
    // The one slot goes to the urgent change, ahead of the independent c3.
    let first = started(&acts);
    assert_eq!(first.iter().map(shape).collect::<Vec<_>>(), [("u".to_string(), vec![])]);
    // Equal or lower priority: enqueue order, nothing moves.
    enqueue(&mut p, 5, "c4", analysis(&["//a"]));
    enqueue_urgent(&mut p, 6, "c5", analysis(&["//a"]), -1);
    assert_eq!(p.pending(), [id("c3"), id("u"), id("c1"), id("c2"), id("c4"), id("c5")]);
    assert_eq!(p.stats().requeued, 2);
    let (decided, _) = run_to_end(&mut p, 10, first, |_| true);
    let lane: Vec<&str> = decided.iter().map(String::as_str).filter(|d| *d != "c3 landed").collect();
    assert_eq!(lane, ["u landed", "c1 landed", "c2 landed", "c4 landed", "c5 landed"], "{decided:?}");
    assert_eq!(p.mainline().len(), 6);
}

#[test]
fn a_change_certain_to_fail_runs_its_retries_at_once_on_its_likely_tree() {
    // Batching under a backlog, with the retry-once rule. c1 is known to pass and
    // c2 to be broken (success preset to 1 and 0). c2's two attempts start together,
    // on the tree it will land on once c1 lands, without waiting for c1's decision;
    // when c1 lands those two failures are on c2's final tree and reject it at once,
    // with no third build.
    let config = PlannerConfig {
        capacity: 4,
        max_retries: 1,
        batching: true,
        overload_pending_factor: Some(0.0),
        ..PlannerConfig::default()
    };
    // Only when its tree is certain too: with c1 merely likely to pass, a tree
    // without c1 may become c2's, and attempts on this one would be wasted.
    let mut p = Planner::new(config.clone());
    enqueue(&mut p, 1, "c1", None);
    p.preset(id("c2"), 0.0, &[]).unwrap();
    let one = started(&enqueue(&mut p, 2, "c2", None));
    assert_eq!(
        one.iter().map(|b| (shape(b), b.attempt)).collect::<Vec<_>>(),
        [(("c2".to_string(), vec!["c1".to_string()]), 1)]
    );

    let mut p = Planner::new(config);
    p.preset(id("c1"), 1.0, &[]).unwrap();
    let b1 = started(&enqueue(&mut p, 1, "c1", None));
    assert_eq!(b1.iter().map(shape).collect::<Vec<_>>(), [("c1".to_string(), vec![])]);
    p.preset(id("c2"), 0.0, &[]).unwrap();
    let b2 = started(&enqueue(&mut p, 2, "c2", None));
    assert_eq!(
        b2.iter().map(|b| (shape(b), b.attempt)).collect::<Vec<_>>(),
        [(("c2".to_string(), vec!["c1".to_string()]), 1), (("c2".to_string(), vec!["c1".to_string()]), 2)],
        "both attempts at once, assuming c1"
    );
    let b3 = started(&enqueue(&mut p, 3, "c3", None));
    assert_eq!(b3.iter().map(shape).collect::<Vec<_>>(), [("c3".to_string(), vec!["c1".to_string()])]);
    for (t, b) in b2.iter().enumerate() {
        let acts = finish(&mut p, 4 + t as u64, b.id, false);
        assert!(started(&acts).iter().all(|x| x.change != id("c2")), "no third attempt: {acts:?}");
    }
    let acts = finish(&mut p, 10, b1[0].id, true);
    let decided: Vec<String> = acts
        .iter()
        .filter_map(|a| match a {
            Action::Land { change, .. } => Some(format!("{change} landed")),
            Action::Reject { change, reason } => Some(format!("{change} rejected after {}", reason.attempts)),
            _ => None,
        })
        .collect();
    assert_eq!(decided, ["c1 landed", "c2 rejected after 2"]);
    assert!(started(&acts).iter().all(|x| x.change != id("c2")));
    let acts = finish(&mut p, 11, b3[0].id, true);
    assert!(acts.iter().any(|a| matches!(a, Action::Land { change, .. } if *change == id("c3"))), "{acts:?}");
}

#[test]
fn an_independent_change_is_not_held_behind_a_failing_batch() {
    // c1 alone on an idle queue; c2..c5 (all on //a, c3 broken) and x (//b,
    // independent of all of them) queue behind it and are built as one tree.
    // The tree fails with no per-target results. x cannot be the culprit, so
    // it is built alone next and lands while c2..c5 are bisected.
    let mut p = Planner::new(PlannerConfig { capacity: 1, max_retries: 0, batching: true, ..PlannerConfig::default() });
    let b1 = started(&enqueue(&mut p, 1, "c1", analysis(&["//z"])));
    for (t, (c, target)) in
        [("c2", "//a"), ("c3", "//a"), ("c4", "//a"), ("c5", "//a"), ("x", "//b")].into_iter().enumerate()
    {
        enqueue(&mut p, 2 + t as u64, c, analysis(&[target]));
    }
    let tree = started(&finish(&mut p, 10, b1[0].id, true));
    assert_eq!(
        tree.iter().map(shape).collect::<Vec<_>>(),
        [("x".to_string(), ["c2", "c3", "c4", "c5"].map(String::from).to_vec())]
    );
    let next = started(&finish(&mut p, 11, tree[0].id, false));
    assert_eq!(next.iter().map(shape).collect::<Vec<_>>(), [("x".to_string(), vec![])], "x goes first, alone");
    let broken = id("c3");
    let (decided, shapes) = run_to_end(&mut p, 12, next, |b| b.change != broken && !b.assumed.contains(&broken));
    assert_eq!(decided[0], "x landed", "{decided:?} after {shapes:?}");
    let mut rest = decided[1..].to_vec();
    rest.sort();
    assert_eq!(rest, ["c2 landed", "c3 rejected", "c4 landed", "c5 landed"]);
}

#[test]
fn a_flaky_batch_failure_rejects_no_one() {
    // The tree of c2..c5 fails once, a flake; every later build passes. The
    // failure costs builds (the tree is split), but every change lands.
    let mut p = Planner::new(PlannerConfig { capacity: 1, max_retries: 1, batching: true, ..PlannerConfig::default() });
    let b1 = started(&enqueue(&mut p, 1, "c1", None));
    for (t, c) in ["c2", "c3", "c4", "c5"].into_iter().enumerate() {
        enqueue(&mut p, 2 + t as u64, c, None);
    }
    let tree = started(&finish(&mut p, 10, b1[0].id, true));
    assert_eq!(tree.len(), 1);
    assert_eq!(tree[0].assumed.len(), 3, "{tree:?}");
    let acts = finish(&mut p, 11, tree[0].id, false);
    assert!(!acts.iter().any(|a| matches!(a, Action::Reject { .. })));
    let (decided, _) = run_to_end(&mut p, 12, started(&acts), |_| true);
    assert_eq!(decided, ["c2 landed", "c3 landed", "c4 landed", "c5 landed"]);
}

#[test]
fn an_enqueue_journalled_before_priorities_replays_at_the_default() {
    // Journals written before `priority` existed must replay unchanged.
    let old = r#"{"Enqueue":{"change":"c1","features":{"files_changed":1,"lines_changed":2,"affected_targets":0,"author":"a","presubmit_passed":true},"analysis":null}}"#;
    let ev: Event = serde_json::from_str(old).unwrap();
    assert!(matches!(&ev, Event::Enqueue { priority: 0, .. }), "{ev:?}");
    // The default is not written, so such journals also stay byte-identical.
    assert_eq!(serde_json::to_string(&ev).unwrap(), old);
    let urgent = Event::Enqueue { change: id("c2"), features: ChangeFeatures::default(), analysis: None, priority: 3 };
    let text = serde_json::to_string(&urgent).unwrap();
    assert!(text.contains(r#""priority":3"#), "{text}");
    assert_eq!(serde_json::from_str::<Event>(&text).unwrap(), urgent);
}

fn fail_with(p: &mut Planner, t: u64, b: BuildId, targets: &[&str]) -> Vec<Action> {
    let failed_targets = Some(targets.iter().map(|t| t.to_string()).collect());
    p.handle(Millis(t), Event::BuildFinished { build: b, outcome: BuildOutcome::Failed, failed_targets }).unwrap()
}

/// c1 fails in //t and passes on its retry of the same tree: //t is recorded as flaky.
/// Then c3..c5, all on //t, are built as one tree behind c2, and that tree fails in //t
/// only. Returns the planner and the actions of that failure.
fn flaky_then_batch(known_flaky_share: f64) -> (Planner, Vec<Action>, BuildSpec) {
    let mut p = Planner::new(PlannerConfig {
        capacity: 1,
        max_retries: 1,
        batching: true,
        known_flaky_share,
        ..PlannerConfig::default()
    });
    let b = started(&enqueue(&mut p, 1, "c1", analysis(&["//t"])));
    let retry = started(&fail_with(&mut p, 2, b[0].id, &["//t"]));
    assert_eq!(shape(&retry[0]), shape(&b[0]));
    assert_eq!(retry[0].attempt, 2);
    finish(&mut p, 3, retry[0].id, true);
    assert_eq!(p.mainline(), [id("c1")]);
    let b2 = started(&enqueue(&mut p, 4, "c2", analysis(&["//u"])));
    for (t, c) in ["c3", "c4", "c5"].into_iter().enumerate() {
        enqueue(&mut p, 5 + t as u64, c, analysis(&["//t"]));
    }
    let tree = started(&finish(&mut p, 10, b2[0].id, true));
    assert_eq!(shape(&tree[0]), ("c5".to_string(), vec!["c3".into(), "c4".into()]));
    let acts = fail_with(&mut p, 11, tree[0].id, &["//t"]);
    (p, acts, tree[0].clone())
}

#[test]
fn a_known_flaky_target_costs_a_retry_not_a_bisection() {
    let (mut p, acts, tree) = flaky_then_batch(0.3);
    let flaky = p.flaky_targets();
    assert_eq!(flaky.len(), 1);
    assert_eq!((flaky[0].target.as_str(), flaky[0].failures, flaky[0].flaky), ("//t", 2, 1));
    // Every failing target is known flaky: the same tree again, not a half of it.
    let next = started(&acts);
    assert_eq!(next.iter().map(shape).collect::<Vec<_>>(), [shape(&tree)]);
    assert_eq!(next[0].attempt, 2);
    assert_eq!(p.stats().flaky_retries, 1);
    let acts = finish(&mut p, 12, next[0].id, true);
    let landed: Vec<String> = acts
        .iter()
        .filter_map(|a| match a {
            Action::Land { change, .. } => Some(change.0.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(landed, ["c3", "c4", "c5"], "one batch");
    // The retry's pass proved that failure flaky too.
    assert_eq!(p.flaky_targets()[0].flaky, 2);
}

#[test]
fn without_flaky_records_the_same_failure_is_bisected() {
    let (p, acts, _) = flaky_then_batch(2.0);
    let next = started(&acts);
    assert_eq!(next.iter().map(shape).collect::<Vec<_>>(), [("c4".to_string(), vec!["c3".to_string()])]);
    assert_eq!(p.stats().flaky_retries, 0);
}

#[test]
fn a_target_bazel_reports_flaky_is_known_flaky() {
    // Bazel retried //t within a build and it passed: the first failure of //t in a
    // batch tree is then retried whole instead of bisected.
    let mut p = Planner::new(PlannerConfig { capacity: 1, max_retries: 1, batching: true, ..PlannerConfig::default() });
    p.handle(Millis(1), Event::FlakyTargets { targets: vec!["//t".into()] }).unwrap();
    let flaky = p.flaky_targets();
    assert_eq!((flaky[0].target.as_str(), flaky[0].failures, flaky[0].flaky), ("//t", 1, 1));
    let b1 = started(&enqueue(&mut p, 2, "c1", analysis(&["//u"])));
    for (t, c) in ["c2", "c3", "c4"].into_iter().enumerate() {
        enqueue(&mut p, 3 + t as u64, c, analysis(&["//t"]));
    }
    let tree = started(&finish(&mut p, 10, b1[0].id, true));
    assert_eq!(tree[0].assumed.len(), 2);
    let next = started(&fail_with(&mut p, 11, tree[0].id, &["//t"]));
    assert_eq!(next.iter().map(shape).collect::<Vec<_>>(), [shape(&tree[0])]);
    assert_eq!(p.stats().flaky_retries, 1);
}

#[test]
fn a_planner_that_forgets_decided_changes_stays_the_size_of_its_recent_work() {
    // 3,000 changes through one slot, each landing; the planner forgets what it
    // decided every 100 changes. Its saved state stops growing once its learned
    // history is full, while one that keeps everything grows with every change.
    let mut p = Planner::new(PlannerConfig { max_retries: 0, max_history: 500, ..cfg(1) });
    let mut keeps = Planner::new(p.config().clone());
    let mut sizes = Vec::new();
    let mut t = 0;
    for i in 0..3000 {
        let name = format!("c{i}");
        for q in [&mut p, &mut keeps] {
            t += 1;
            let b = started(&enqueue(q, t, &name, analysis(&["//a"])));
            let acts = finish(q, t, b[0].id, i % 7 != 3);
            assert!(acts.iter().any(|a| matches!(a, Action::Land { .. } | Action::Reject { .. })));
        }
        if i % 100 == 99 {
            let forgot = p.forget_decided();
            assert_eq!(forgot, 100, "every change decided before now is forgotten");
            sizes.push(p.save_state().unwrap().len());
        }
    }
    let (early, late) = (sizes[9], *sizes.last().unwrap());
    assert!(late <= early + early / 10, "saved state grew from {early} to {late} bytes");
    let kept = keeps.save_state().unwrap().len();
    assert!(kept > 10 * late, "keeping everything: {kept} bytes against {late}");
    // What it still knows answers as before; what it forgot is unknown.
    assert!(p.mainline().len() < 100 && keeps.mainline().len() > 2500);
    assert!(p.enqueued_at(&id("c5")).is_none() && keeps.enqueued_at(&id("c5")).is_some());
    let restored = Planner::restore_state(&p.save_state().unwrap()).unwrap();
    assert_eq!(restored.stats(), keeps.stats());
    assert_eq!((restored.mainline(), restored.pending()), (p.mainline(), p.pending()));
}

#[test]
fn a_saved_state_of_another_format_is_refused() {
    let p = Planner::new(cfg(1));
    let text = p.save_state().unwrap().replacen("\"format\":1", "\"format\":99", 1);
    let err = Planner::restore_state(&text).err().expect("refused").to_string();
    assert!(err.contains("format 99"), "{err}");
    assert!(Planner::restore_state("{\"format\":1}").is_err(), "no planner in it");
}

#[test]
fn a_change_behind_an_undecided_one_learns_its_own_outcome_on_the_mainline_alone() {
    // c1, c2, c3 all touch //a. c2's build on the mainline alone runs beside its
    // build on c1 (here as its second most likely tree). With learning it keeps running when c1 lands (it can no longer
    // decide c2, but it says whether c2 fails on its own), and its failure then
    // stands for c2 on every tree: c2 becomes unlikely to land, so c3's most likely
    // tree leaves it out. Without learning the same build is cancelled when c1 lands.
    let p_c2 = |p: &Planner| p.landing_probabilities().into_iter().find(|(c, _)| *c == id("c2")).unwrap().1;
    for learn_alone in [true, false] {
        let mut p = Planner::new(PlannerConfig { max_retries: 0, learn_alone, ..cfg(10) });
        let mut builds = Vec::new();
        for (t, c) in ["c1", "c2", "c3"].into_iter().enumerate() {
            builds.extend(started(&enqueue(&mut p, t as u64, c, analysis(&["//a"]))));
        }
        let alone = find(&builds, "c2", &[]);
        let acts = finish(&mut p, 10, find(&builds, "c1", &[]), true);
        assert!(matches!(&acts[0], Action::Land { change, .. } if *change == id("c1")), "{acts:?}");
        assert_eq!(cancelled(&acts).contains(&alone), !learn_alone, "learning {learn_alone}: {acts:?}");
        if !learn_alone {
            continue;
        }
        // c2's build alone was also its second most likely tree; c3's was started to learn.
        assert_eq!(p.stats().learn_builds, 1);
        assert!(p_c2(&p) > 0.7, "before: the model's guess, {}", p_c2(&p));
        assert!(p.value_of(&id("c3"), &[]).unwrap() < 0.5, "c3's tree without c2 is unlikely");
        let acts = finish(&mut p, 11, alone, false);
        assert!(acts.iter().all(|a| !matches!(a, Action::Land { .. } | Action::Reject { .. })), "decides nothing");
        assert!(p_c2(&p) < 0.2, "after: c2's own failure, unless a flake: {}", p_c2(&p));
        assert!(p.value_of(&id("c3"), &[]).unwrap() > 0.5, "c3's tree without c2 is now the likely one");
    }
}
