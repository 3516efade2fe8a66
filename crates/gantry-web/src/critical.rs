//! An invocation's critical path, inferred from the timing of its remote actions.
//!
//! gantry never sees Bazel's action graph: an Execute call names one action, not what it
//! waited for. So the path here is a heuristic chain. It starts from the action that
//! finished last; the action before it is the one that finished latest at or before the
//! moment the later one became ready (its run start less its queue time), on the guess
//! that the later action waited for it. That repeats until no action finished before.
//! An unrelated action that happened to finish just before can stand in for the real
//! dependency, and work Bazel did locally or took from the cache leaves gaps; when Bazel
//! sends its own critical path (its "critical path" build tool log) the page shows that
//! too.

use gantry_core::ActionRecord;

/// How far an action may seem to end after the next one became ready and still count
/// as what it waited for: the times come from different clocks (the worker's wall time,
/// the scheduler's queue time, the server's completion time) and are rounded to ms.
pub const TOLERANCE_SECONDS: f64 = 0.05;

/// One action's place in time, in seconds since the epoch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// When it was queued: it was ready to run (its inputs existed) by then.
    pub ready: f64,
    /// When it started running on a worker.
    pub start: f64,
    pub end: f64,
}

/// Where `a` ran in time; None for a record without a completion time.
pub fn span(a: &ActionRecord) -> Option<Span> {
    if a.completed_unix_ms <= 0 {
        return None;
    }
    let end = a.completed_unix_ms as f64 / 1000.0;
    let start = end - a.wall_seconds.max(0.0);
    Some(Span { ready: start - a.queued_seconds.max(0.0), start, end })
}

/// The chain found by [`critical_path`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CriticalPath {
    /// Indices into the actions, first to run first.
    pub actions: Vec<usize>,
    /// From the first action's queueing to the last one's end.
    pub seconds: f64,
    /// Of which the path's actions were running, and were queued.
    pub running_seconds: f64,
    pub queued_seconds: f64,
}

/// The heuristic chain of actions that determined when the invocation's remote work
/// ended (see the module's comment). Ties in end time go to the action that became ready
/// earliest (it explains more of the time), then to the earlier record.
pub fn critical_path(actions: &[ActionRecord]) -> CriticalPath {
    let spans: Vec<Option<Span>> = actions.iter().map(span).collect();
    // The timed actions ordered so that, of any prefix, the last is the one the walk
    // prefers: latest end, then earliest ready, then earliest record. Each step is then a
    // binary search, so a long serial build costs n log n, not n².
    let mut order: Vec<(usize, Span)> = spans.iter().enumerate().filter_map(|(i, s)| Some((i, (*s)?))).collect();
    order.sort_by(|(i, a), (j, b)| a.end.total_cmp(&b.end).then(b.ready.total_cmp(&a.ready)).then(j.cmp(i)));
    let Some(&(last, _)) = order.last() else { return CriticalPath::default() };
    let mut path = vec![last];
    let mut current = spans[last].expect("timed");
    loop {
        // Ending strictly before the current one keeps the walk finite whatever the
        // tolerance, and keeps an action from waiting on itself.
        let bound = current.ready + TOLERANCE_SECONDS;
        let n = order.partition_point(|(_, s)| s.end <= bound && s.end < current.end);
        let Some(&(prev, s)) = order[..n].last() else { break };
        path.push(prev);
        current = s;
    }
    path.reverse();
    let first = spans[path[0]].expect("timed");
    let last = spans[*path.last().expect("not empty")].expect("timed");
    CriticalPath {
        seconds: last.end - first.ready,
        running_seconds: path.iter().map(|&i| actions[i].wall_seconds.max(0.0)).sum(),
        queued_seconds: path.iter().map(|&i| actions[i].queued_seconds.max(0.0)).sum(),
        actions: path,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An action queued at `ready` s for `queued` s, then running for `wall` s.
    fn act(name: &str, ready: f64, queued: f64, wall: f64) -> ActionRecord {
        ActionRecord {
            action_mnemonic: name.into(),
            queued_seconds: queued,
            wall_seconds: wall,
            completed_unix_ms: ((1_000.0 + ready + queued + wall) * 1000.0).round() as i64,
            ..Default::default()
        }
    }

    fn names(actions: &[ActionRecord], p: &CriticalPath) -> Vec<String> {
        p.actions.iter().map(|&i| actions[i].action_mnemonic.clone()).collect()
    }

    #[test]
    fn a_chain_is_found_past_parallel_actions() {
        // a runs 0–2; b is queued at 2.3 and runs 2.5–5; c is ready at 5.1 and runs to 9.
        // d runs 0–6 beside them and e 0–0.5: d ended after c was ready and e before a
        // even began, so neither is on the path.
        let actions = vec![
            act("d", 0.0, 0.0, 6.0),
            act("c", 5.1, 0.0, 3.9),
            act("a", 0.0, 0.0, 2.0),
            act("b", 2.3, 0.2, 2.5),
            act("e", 0.0, 0.0, 0.5),
        ];
        let p = critical_path(&actions);
        assert_eq!(names(&actions, &p), ["a", "b", "c"]);
        assert!((p.seconds - 9.0).abs() < 1e-9, "{p:?}");
        assert!((p.running_seconds - 8.4).abs() < 1e-9 && (p.queued_seconds - 0.2).abs() < 1e-9, "{p:?}");
    }

    #[test]
    fn queue_time_counts_and_the_latest_finisher_before_readiness_is_taken() {
        // c was queued at 4 and ran 6–8. x ended at 5, after c was queued, so c did not
        // wait for it (though it ended before c started running); y ended at 3.98 and is
        // taken over z, which ended at 2.
        let actions =
            vec![act("c", 4.0, 2.0, 2.0), act("x", 1.0, 0.0, 4.0), act("y", 0.0, 0.0, 3.98), act("z", 0.0, 0.0, 2.0)];
        assert_eq!(names(&actions, &critical_path(&actions)), ["y", "c"]);
        // Within the clocks' tolerance an action ending just after readiness still counts.
        let actions = vec![act("c", 4.0, 0.0, 1.0), act("w", 0.0, 0.0, 4.03)];
        assert_eq!(names(&actions, &critical_path(&actions)), ["w", "c"]);
        let actions = vec![act("c", 4.0, 0.0, 1.0), act("w", 0.0, 0.0, 4.2)];
        assert_eq!(names(&actions, &critical_path(&actions)), ["c"]);
    }

    #[test]
    fn ties_go_to_the_earlier_ready_then_the_earlier_record() {
        // Two actions end together last: the one ready earlier explains more.
        let actions = vec![act("short", 3.0, 0.0, 2.0), act("long", 1.0, 0.0, 4.0), act("first", 0.0, 0.0, 1.0)];
        assert_eq!(names(&actions, &critical_path(&actions)), ["first", "long"]);
        // Identical records: the first listed.
        let actions = vec![act("p", 0.0, 0.0, 1.0), act("q", 0.0, 0.0, 1.0)];
        assert_eq!(names(&actions, &critical_path(&actions)), ["p"]);
    }

    #[test]
    fn no_timed_actions_no_path() {
        assert_eq!(critical_path(&[]), CriticalPath::default());
        let untimed = ActionRecord { wall_seconds: 3.0, ..Default::default() };
        assert_eq!(critical_path(std::slice::from_ref(&untimed)), CriticalPath::default());
        // An untimed record beside a timed one is ignored, not placed at the epoch.
        let actions = vec![untimed, act("t", 0.0, 0.0, 1.0)];
        assert_eq!(critical_path(&actions).actions, [1]);
        // Zero-length actions at one instant do not chain to each other.
        let actions = vec![act("z1", 1.0, 0.0, 0.0), act("z2", 1.0, 0.0, 0.0)];
        assert_eq!(critical_path(&actions).actions.len(), 1);
    }

    /// The walk as the module describes it, by scanning every action at each step.
    fn by_scanning(actions: &[ActionRecord]) -> Vec<usize> {
        let spans: Vec<Option<Span>> = actions.iter().map(span).collect();
        let best = |ok: &dyn Fn(&Span) -> bool| {
            let mut best: Option<(usize, Span)> = None;
            for (i, s) in spans.iter().enumerate() {
                let Some(s) = s.filter(|s| ok(s)) else { continue };
                if best.is_none_or(|(_, b)| s.end > b.end || (s.end == b.end && s.ready < b.ready)) {
                    best = Some((i, s));
                }
            }
            best
        };
        let mut path = Vec::new();
        let mut at = best(&|_| true);
        while let Some((i, cur)) = at {
            path.push(i);
            at = best(&|s| s.end <= cur.ready + TOLERANCE_SECONDS && s.end < cur.end);
        }
        path.reverse();
        path
    }

    #[test]
    fn the_sorted_walk_matches_a_scan_of_every_action() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..300 {
            let n = next(40) as usize;
            // Coarse times, so ties and near-ties within the tolerance are common.
            let actions: Vec<ActionRecord> =
                (0..n).map(|_| act("x", next(20) as f64 / 4.0, next(3) as f64 / 10.0, next(12) as f64 / 4.0)).collect();
            assert_eq!(critical_path(&actions).actions, by_scanning(&actions), "{actions:?}");
        }
    }
}
