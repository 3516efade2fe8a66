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

use gantry_core::{ActionRecord, ExecutionLog, Result};

pub use gantry_core::{predecessor_bound, PATH_TOLERANCE_MS};

/// Most steps the walk takes: each is an indexed lookup in the database, and a serial chain
/// of 100,000 actions would otherwise cost a page 100,000 of them; past it the page says
/// the path is cut. A longer path is past reading anyway.
pub const MAX_STEPS: usize = 1_000;

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
    /// The path's runs, the first to run first.
    pub actions: Vec<ActionRecord>,
    /// From the first action's queueing to the last one's end.
    pub seconds: f64,
    /// Of which the path's actions were running, and were queued.
    pub running_seconds: f64,
    pub queued_seconds: f64,
    /// The walk stopped at [`MAX_STEPS`]: the path starts earlier than shown.
    pub cut: bool,
}

impl CriticalPath {
    /// Whether `a` is one of the path's runs.
    pub fn contains(&self, a: &ActionRecord) -> bool {
        self.actions.iter().any(|p| run_key(p) == run_key(a))
    }

    /// The path's runs by [`run_key`], for marking many records at one lookup each (a
    /// timeline of 2,000 runs against a path of 1,000 steps).
    pub fn keys(&self) -> std::collections::HashSet<RunKey<'_>> {
        self.actions.iter().map(run_key).collect()
    }
}

/// What tells one record of a run from another: an operation's retries and hedge copies
/// are records of their own, told apart by when and where they ended.
pub type RunKey<'a> = (&'a str, i64, &'a str, &'a str);

pub fn run_key(a: &ActionRecord) -> RunKey<'_> {
    (&a.operation, a.completed_unix_ms, &a.worker, &a.action_digest)
}

/// The heuristic chain of actions that determined when the invocation's remote work
/// ended (see the module's comment). Each step takes the latest run completed by
/// [`predecessor_bound`] (of runs completed together, the one ready earliest, as it
/// explains more of the time): [`ExecutionLog::path_back`], which the SQL log walks in one
/// recursive query, reading the runs on the path, not the whole invocation.
pub async fn critical_path(log: &dyn ExecutionLog, invocation: &str) -> Result<CriticalPath> {
    let mut path = log.path_back(invocation, MAX_STEPS + 1).await?;
    let cut = path.len() > MAX_STEPS;
    path.truncate(MAX_STEPS);
    path.reverse();
    let (Some(first), Some(last)) = (path.first().and_then(span), path.last().and_then(span)) else {
        return Ok(CriticalPath::default());
    };
    Ok(CriticalPath {
        seconds: last.end - first.ready,
        running_seconds: path.iter().map(|a| a.wall_seconds.max(0.0)).sum(),
        queued_seconds: path.iter().map(|a| a.queued_seconds.max(0.0)).sum(),
        actions: path,
        cut,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_store::{MetadataDb, SqlExecutionLog};

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

    /// The path through `actions`, recorded as one invocation in a real (SQLite) log; each
    /// record's operation is its position, so ties that fall to the operation go to the
    /// earlier record.
    async fn walk(actions: &[ActionRecord]) -> (Vec<String>, CriticalPath) {
        let log = SqlExecutionLog::new(MetadataDb::open("sqlite::memory:").await.unwrap());
        walk_in(&log, "inv", actions).await
    }

    async fn walk_in(log: &SqlExecutionLog, id: &str, actions: &[ActionRecord]) -> (Vec<String>, CriticalPath) {
        for (i, a) in actions.iter().enumerate() {
            let a = ActionRecord { operation: format!("{i:04}"), tool_invocation_id: id.into(), ..a.clone() };
            log.record(&a).await.unwrap();
        }
        let p = critical_path(log, id).await.unwrap();
        // The store's own walk is the definition's, one page per step.
        for limit in [0, 1, 2, MAX_STEPS + 1] {
            assert_eq!(
                log.path_back(id, limit).await.unwrap(),
                gantry_core::path_back_by_pages(log, id, limit).await.unwrap(),
                "limit {limit}"
            );
        }
        (p.actions.iter().map(|a| a.action_mnemonic.clone()).collect(), p)
    }

    #[tokio::test]
    async fn a_chain_is_found_past_parallel_actions() {
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
        let (names, p) = walk(&actions).await;
        assert_eq!(names, ["a", "b", "c"]);
        assert!((p.seconds - 9.0).abs() < 1e-9, "{p:?}");
        assert!((p.running_seconds - 8.4).abs() < 1e-9 && (p.queued_seconds - 0.2).abs() < 1e-9, "{p:?}");
        assert!(!p.cut && p.contains(&p.actions[1]));
    }

    #[tokio::test]
    async fn queue_time_counts_and_the_latest_finisher_before_readiness_is_taken() {
        // c was queued at 4 and ran 6–8. x ended at 5, after c was queued, so c did not
        // wait for it (though it ended before c started running); y ended at 3.98 and is
        // taken over z, which ended at 2.
        let actions =
            vec![act("c", 4.0, 2.0, 2.0), act("x", 1.0, 0.0, 4.0), act("y", 0.0, 0.0, 3.98), act("z", 0.0, 0.0, 2.0)];
        assert_eq!(walk(&actions).await.0, ["y", "c"]);
        // Within the clocks' tolerance an action ending just after readiness still counts.
        let actions = vec![act("c", 4.0, 0.0, 1.0), act("w", 0.0, 0.0, 4.03)];
        assert_eq!(walk(&actions).await.0, ["w", "c"]);
        let actions = vec![act("c", 4.0, 0.0, 1.0), act("w", 0.0, 0.0, 4.2)];
        assert_eq!(walk(&actions).await.0, ["c"]);
    }

    #[tokio::test]
    async fn ties_go_to_the_earlier_ready_then_the_earlier_record() {
        // Two actions end together last: the one ready earlier explains more.
        let actions = vec![act("short", 3.0, 0.0, 2.0), act("long", 1.0, 0.0, 4.0), act("first", 0.0, 0.0, 1.0)];
        assert_eq!(walk(&actions).await.0, ["first", "long"]);
        // Identical records: the first recorded (by operation).
        let actions = vec![act("p", 0.0, 0.0, 1.0), act("q", 0.0, 0.0, 1.0)];
        assert_eq!(walk(&actions).await.0, ["p"]);
    }

    #[tokio::test]
    async fn no_timed_actions_no_path() {
        assert_eq!(walk(&[]).await.1, CriticalPath::default());
        let untimed = ActionRecord { action_mnemonic: "u".into(), wall_seconds: 3.0, ..Default::default() };
        assert_eq!(walk(std::slice::from_ref(&untimed)).await.1, CriticalPath::default());
        // An untimed record beside a timed one is ignored, not placed at the epoch.
        assert_eq!(walk(&[untimed, act("t", 0.0, 0.0, 1.0)]).await.0, ["t"]);
        // Zero-length actions at one instant do not chain to each other.
        let actions = vec![act("z1", 1.0, 0.0, 0.0), act("z2", 1.0, 0.0, 0.0)];
        assert_eq!(walk(&actions).await.0.len(), 1);
    }

    #[tokio::test]
    async fn a_long_serial_chain_is_cut_at_the_step_limit() {
        let actions: Vec<ActionRecord> =
            (0..MAX_STEPS + 5).map(|i| act(&format!("s{i}"), i as f64, 0.0, 1.0)).collect();
        let (names, p) = walk(&actions).await;
        assert!(p.cut);
        assert_eq!(names.len(), MAX_STEPS);
        assert_eq!(names.last().map(String::as_str), Some(format!("s{}", MAX_STEPS + 4).as_str()), "ends at the last");
    }

    /// The walk as the module describes it, by scanning every action at each step (with
    /// the step's bound and the tie order the store is asked for).
    fn by_scanning(actions: &[ActionRecord]) -> Vec<String> {
        let ready = |a: &ActionRecord| a.completed_unix_ms as f64 - 1000.0 * (a.wall_seconds + a.queued_seconds);
        let best = |by: i64| {
            let mut best: Option<(usize, &ActionRecord)> = None;
            for (i, a) in actions.iter().enumerate().filter(|(_, a)| a.completed_unix_ms > 0) {
                if a.completed_unix_ms > by {
                    continue;
                }
                if best.is_none_or(|(_, b)| {
                    a.completed_unix_ms > b.completed_unix_ms
                        || (a.completed_unix_ms == b.completed_unix_ms && ready(a) < ready(b))
                }) {
                    best = Some((i, a));
                }
            }
            best
        };
        let mut path = Vec::new();
        let mut at = best(i64::MAX);
        while let Some((i, cur)) = at {
            path.push(actions[i].action_mnemonic.clone());
            at = best(predecessor_bound(cur));
        }
        path.reverse();
        path
    }

    #[tokio::test]
    async fn the_indexed_walk_matches_a_scan_of_every_action() {
        let log = SqlExecutionLog::new(MetadataDb::open("sqlite::memory:").await.unwrap());
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for round in 0..200 {
            let n = next(40) as usize;
            // Coarse times, so ties and near-ties within the tolerance are common.
            let actions: Vec<ActionRecord> = (0..n)
                .map(|i| act(&format!("a{i}"), next(20) as f64 / 4.0, next(3) as f64 / 10.0, next(12) as f64 / 4.0))
                .collect();
            let (names, _) = walk_in(&log, &format!("inv-{round}"), &actions).await;
            assert_eq!(names, by_scanning(&actions), "{actions:?}");
        }
    }
}
