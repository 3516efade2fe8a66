//! Every SQL store's behaviour, run on both metadata backends: SQLite (a file, and in
//! memory) and a real PostgreSQL started by the test. Then what only a shared server
//! database can show: concurrent journal appends from two processes' worth of stores,
//! leases, and schema migrations (an unversioned database upgraded in place, a newer one
//! refused).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use gantry_core::reapi::ActionResult;
use gantry_core::{
    ActionCache, ActionRecord, BuildQuery, BuildRow, BuildStore, CacheCounts, DigestFunction, Error, ExecutionLog,
    Invocation, InvocationStore, LandingRow, QueueDocRow, QueueStore, RunsOf, SizeClassStore, TargetOutcome,
    TestOutcome,
};
use gantry_store::{
    Dialect, MetadataDb, RoleLease, SqlActionCache, SqlBuildStore, SqlExecutionLog, SqlInvocationStore, SqlQueueStore,
    SqlSizeClassStore,
};
use gantry_testkit::PgServer;
use sqlx::{Executor, Row};

/// The backends under test: (name, url). PostgreSQL's server lives as long as the guard.
fn backends(dir: &std::path::Path) -> (Option<PgServer>, Vec<(&'static str, String)>) {
    let mut v = vec![
        ("sqlite-file", format!("sqlite://{}/meta.db", dir.display())),
        ("sqlite-memory", "sqlite::memory:".into()),
    ];
    let pg = PgServer::start();
    if let Some(pg) = &pg {
        v.push(("postgres", pg.create_database("suite")));
    }
    (pg, v)
}

#[tokio::test]
async fn store_suites_pass_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    let (_pg, backends) = backends(dir.path());
    for (name, url) in backends {
        eprintln!("--- {name}");
        let db = MetadataDb::open(&url).await.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(db.schema_version().await.unwrap(), MetadataDb::latest_version(), "{name}");
        action_cache(&db).await;
        execution_log(&db).await;
        size_class_store(&db).await;
        build_store(&db).await;
        invocation_store(&db).await;
        queue_store(&db).await;
        leases(&db).await;
        // Reopening an up-to-date database changes nothing and keeps every row.
        if name != "sqlite-memory" {
            drop(db);
            let db = MetadataDb::open(&url).await.unwrap();
            let ac = SqlActionCache::new(db.clone());
            let a = DigestFunction::Sha256.digest_of(b"action");
            assert_eq!(ac.get("", &a).await.unwrap(), Some(result(3)), "{name}: persisted across reopen");
        }
    }
}

fn result(code: i32) -> ActionResult {
    ActionResult { exit_code: code, stdout_raw: vec![0, 159, 146, 150, 255], ..Default::default() }
}

async fn action_cache(db: &MetadataDb) {
    let ac = SqlActionCache::new(db.clone());
    ac.check().await.unwrap();
    let a = DigestFunction::Sha256.digest_of(b"action");
    let mut b3 = DigestFunction::Blake3.digest_of(b"action");
    b3.hash = a.hash; // the same hex under another function must not alias
    assert_eq!(ac.get("", &a).await.unwrap(), None);
    ac.put("", &a, &result(1)).await.unwrap();
    ac.put("other", &a, &result(2)).await.unwrap();
    assert_eq!(ac.get("", &a).await.unwrap(), Some(result(1)));
    assert_eq!(ac.get("other", &a).await.unwrap(), Some(result(2)));
    assert_eq!(ac.get("", &b3).await.unwrap(), None);
    ac.put("", &a, &result(3)).await.unwrap();
    assert_eq!(ac.get("", &a).await.unwrap(), Some(result(3)), "an update replaces the entry");
    // A row that does not decode is an error, never a miss.
    sqlx::query("UPDATE action_cache SET result = $1 WHERE instance_name = 'other'")
        .bind(vec![0xffu8, 0xff, 0xff])
        .execute(db.pool())
        .await
        .unwrap();
    let e = ac.get("other", &a).await.unwrap_err();
    assert!(matches!(e, Error::Internal(_)) && e.to_string().contains("corrupt"), "{e}");
}

async fn execution_log(db: &MetadataDb) {
    let log = SqlExecutionLog::new(db.clone());
    let rec = |op: &str, inv: &str, wall: f64, mem: u64, exit: i32| ActionRecord {
        operation: op.into(),
        instance: "i".into(),
        action_digest: format!("{op}/1"),
        tool_invocation_id: inv.into(),
        action_mnemonic: "Genrule".into(),
        target_id: "//:t".into(),
        worker: "w1".into(),
        size_class: 2,
        wall_seconds: wall,
        user_cpu_seconds: wall / 2.0,
        system_cpu_seconds: 0.25,
        queued_seconds: 0.5,
        peak_memory_bytes: mem,
        exit_code: exit,
        status_code: 0,
        metering: "rusage".into(),
        completed_unix_ms: 1000 + op.len() as i64,
        shape_key: format!("shape-{op}"),
    };
    log.record(&rec("a", "inv1", 1.5, 10 << 20, 0)).await.unwrap();
    log.record(&rec("bb", "inv1", 2.5, 30 << 20, 1)).await.unwrap();
    log.record(&rec("c", "inv2", 9.0, 1, 0)).await.unwrap();
    let s = log.invocation("inv1").await.unwrap();
    assert_eq!(s.actions, 2);
    assert!((s.executor_service_seconds - 4.0).abs() < 1e-9);
    assert!((s.cpu_seconds - 2.5).abs() < 1e-9, "{s:?}");
    assert_eq!(s.max_peak_memory_bytes, 30 << 20);
    assert_eq!(s.failed_actions, 1);
    let acts = log.actions("inv1").await.unwrap();
    assert_eq!(
        acts,
        [rec("a", "inv1", 1.5, 10 << 20, 0), rec("bb", "inv1", 2.5, 30 << 20, 1)],
        "every field round-trips, in order"
    );
    assert_eq!(log.invocation("none").await.unwrap().actions, 0);
    // The SQL aggregate agrees with the records summed here, ESU weights included: a
    // class-0 record counts as one ESU, a big-memory one by its memory.
    let mut big = rec("dd", "inv1", 2.0, 5_000_000_000, 0);
    big.size_class = 1;
    let mut none = rec("e", "inv1", 3.0, 0, 0);
    none.size_class = 0;
    none.status_code = 4;
    log.record(&big).await.unwrap();
    log.record(&none).await.unwrap();
    let s = log.invocation("inv1").await.unwrap();
    let all = log.actions("inv1").await.unwrap();
    assert_eq!(all.len(), 4);
    let esu: f64 = all.iter().map(ActionRecord::esu_seconds).sum();
    assert!((esu - (1.5 * 2.0 + 2.5 * 2.0 + 2.0 * 2.0 + 3.0)).abs() < 1e-9, "{esu}");
    assert!((s.executor_esu_seconds - esu).abs() < 1e-9, "{s:?} vs {esu}");
    assert!((s.executor_service_seconds - 9.0).abs() < 1e-9, "{s:?}");
    assert_eq!((s.actions, s.failed_actions, s.max_peak_memory_bytes), (4, 2, 5_000_000_000));
    // An action's runs, newest first and bounded.
    let mut again = rec("a", "inv3", 4.0, 1, 0);
    again.completed_unix_ms = 5000;
    log.record(&again).await.unwrap();
    let runs = log.runs(RunsOf::Action("a/1"), 10).await.unwrap();
    assert_eq!(runs.iter().map(|r| r.tool_invocation_id.as_str()).collect::<Vec<_>>(), ["inv3", "inv1"]);
    assert_eq!(log.runs(RunsOf::Action("a/1"), 1).await.unwrap().len(), 1);
    assert!(log.runs(RunsOf::Action("zz/1"), 10).await.unwrap().is_empty());
    let shape = log.runs(RunsOf::Shape("shape-a"), 10).await.unwrap();
    assert_eq!(shape.len(), 2, "both runs of a have its shape");
    assert_eq!(log.runs(RunsOf::Shape("shape-bb"), 10).await.unwrap()[0].operation, "bb");
    action_pages_and_class_runs(&log).await;
}

/// The database orders and cuts an invocation's pages exactly as `order_actions` says
/// (ties in cost, run time and completion included), and counts runs per class and bucket
/// as the records do.
async fn action_pages_and_class_runs(log: &SqlExecutionLog) {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut mine = Vec::new();
    for i in 0..300 {
        let r = ActionRecord {
            operation: format!("op-{:03}", next(1000)),
            instance: ["", "team"][next(2) as usize].into(),
            action_digest: format!("p{i}/1"),
            tool_invocation_id: ["paged", "other"][(i % 7 == 0) as usize].into(),
            size_class: next(4) as u32 + 1,
            // Quarter seconds and few distinct values: many ties, exactly representable.
            wall_seconds: next(8) as f64 * 0.25,
            queued_seconds: next(4) as f64 * 0.25,
            peak_memory_bytes: next(3) * 2_000_000_000,
            exit_code: (next(10) == 0) as i32,
            completed_unix_ms: 7_000_000 + next(40) as i64 * 250,
            ..Default::default()
        };
        log.record(&r).await.unwrap();
        if r.tool_invocation_id == "paged" {
            mine.push(r);
        }
    }
    let orders = [
        gantry_core::ActionOrder::Dearest,
        gantry_core::ActionOrder::Cheapest,
        gantry_core::ActionOrder::Longest,
        gantry_core::ActionOrder::FinishedBy(7_005_000),
        gantry_core::ActionOrder::FinishedBy(i64::MAX),
        gantry_core::ActionOrder::FinishedBy(0),
    ];
    for order in orders {
        let mut want = mine.clone();
        gantry_core::order_actions(&mut want, order);
        for (offset, limit) in [(0, 1000), (0, 25), (25, 25), (250, 25)] {
            let got = log.actions_page("paged", order, offset, limit).await.unwrap();
            let want: Vec<_> = want.iter().skip(offset).take(limit).cloned().collect();
            let key = |v: &[ActionRecord]| v.iter().map(|r| r.action_digest.clone()).collect::<Vec<_>>();
            assert_eq!(key(&got), key(&want), "{order:?} offset {offset} limit {limit}");
        }
    }
    assert!(log.actions_page("none", gantry_core::ActionOrder::Dearest, 0, 10).await.unwrap().is_empty());
    // The store's critical-path walk (one recursive query) is the definition's, step by
    // step, on this backend too.
    for limit in [0, 1, 5, 1000] {
        let walked = log.path_back("paged", limit).await.unwrap();
        assert_eq!(walked, gantry_core::path_back_by_pages(log, "paged", limit).await.unwrap(), "limit {limit}");
        assert!(limit < 2 || walked.len() > 1, "a path of more than one step to compare");
    }
    assert!(log.path_back("none", 10).await.unwrap().is_empty());

    // Per 1 s bucket: everything recorded above (the earlier records are older).
    let counts = log.class_runs(7_000_000, 1000).await.unwrap();
    let mut want = std::collections::BTreeMap::<(i64, String, u32), (u64, u64)>::new();
    let all: Vec<ActionRecord> = [log.actions("paged").await.unwrap(), log.actions("other").await.unwrap()].concat();
    for r in all.iter().filter(|r| r.completed_unix_ms >= 7_000_000) {
        let e = want.entry((r.completed_unix_ms / 1000 * 1000, r.instance.clone(), r.size_class)).or_default();
        e.0 += 1;
        e.1 += (r.exit_code != 0 || r.status_code != 0) as u64;
    }
    let got: Vec<_> =
        counts.iter().map(|c| ((c.bucket_unix_ms, c.instance.clone(), c.size_class), (c.runs, c.failed))).collect();
    assert_eq!(got, want.into_iter().collect::<Vec<_>>(), "oldest bucket first");
    assert!(log.class_runs(i64::MAX, 1000).await.unwrap().is_empty());
    assert_eq!(log.class_runs(0, 0).await.unwrap_err().code(), tonic::Code::InvalidArgument);
}

async fn size_class_store(db: &MetadataDb) {
    let s = SqlSizeClassStore::new(db.clone());
    assert_eq!(s.get("k").await.unwrap(), None);
    s.put("k", "{\"v\":1}").await.unwrap();
    s.put("k", "{\"v\":2}").await.unwrap();
    s.put("j", "{}").await.unwrap();
    assert_eq!(s.get("k").await.unwrap().as_deref(), Some("{\"v\":2}"));
    let keys = s.keys(10).await.unwrap();
    assert_eq!(keys.iter().collect::<BTreeSet<_>>(), ["j".to_string(), "k".to_string()].iter().collect());
    assert_eq!(s.keys(1).await.unwrap().len(), 1);
}

async fn build_store(db: &MetadataDb) {
    let s = SqlBuildStore::new(db.clone());
    let row = |id: &str, stream: &str, state: &str, created: i64, finished: Option<i64>| BuildRow {
        id: id.into(),
        stream_id: stream.into(),
        parent_id: (id == "b").then(|| "a".to_string()),
        state: state.into(),
        created_unix_ms: created,
        finished_unix_ms: finished,
        document: format!("{{\"id\":\"{id}\"}}"),
    };
    assert_eq!(s.get("a").await.unwrap(), None);
    s.put(&row("a", "s1", "QUEUED", 10, None)).await.unwrap();
    s.put(&row("b", "s1", "RUNNING", 20, None)).await.unwrap();
    s.put(&row("c", "s2", "DONE", 30, Some(40))).await.unwrap();
    s.put(&row("a", "s1", "DONE", 10, Some(50))).await.unwrap();
    assert_eq!(s.get("a").await.unwrap(), Some(row("a", "s1", "DONE", 10, Some(50))));
    assert_eq!(s.get("b").await.unwrap().unwrap().parent_id.as_deref(), Some("a"));
    let ids = |rows: Vec<BuildRow>| rows.into_iter().map(|r| r.id).collect::<Vec<_>>();
    assert_eq!(ids(s.list(&BuildQuery::default()).await.unwrap()), ["c", "b", "a"]);
    let q = BuildQuery { stream_id: Some("s1".into()), oldest_first: true, ..Default::default() };
    assert_eq!(ids(s.list(&q).await.unwrap()), ["a", "b"]);
    let q = BuildQuery { unfinished_only: true, ..Default::default() };
    assert_eq!(ids(s.list(&q).await.unwrap()), ["b"]);
    let q = BuildQuery { finished_since_unix_ms: Some(45), ..Default::default() };
    assert_eq!(ids(s.list(&q).await.unwrap()), ["a"]);
    let q =
        BuildQuery { limit: 1, stream_id: Some("s1".into()), finished_since_unix_ms: Some(0), ..Default::default() };
    assert_eq!(ids(s.list(&q).await.unwrap()), ["a"]);

    // Paging: split halves share a creation time, so the cursor carries the id too.
    s.put(&row("c.1", "s2", "DONE", 30, Some(60))).await.unwrap();
    s.put(&row("c.2", "s2", "QUEUED", 30, None)).await.unwrap();
    let page = |after: Option<(i64, &str)>, oldest_first| BuildQuery {
        limit: 2,
        oldest_first,
        after: after.map(|(t, id)| (t, id.to_string())),
        ..Default::default()
    };
    assert_eq!(ids(s.list(&page(None, false)).await.unwrap()), ["c.2", "c.1"]);
    assert_eq!(ids(s.list(&page(Some((30, "c.1")), false)).await.unwrap()), ["c", "b"]);
    assert_eq!(ids(s.list(&page(Some((20, "b")), false)).await.unwrap()), ["a"]);
    assert_eq!(ids(s.list(&page(Some((10, "a")), true)).await.unwrap()), ["b", "c"]);
    assert_eq!(ids(s.list(&page(Some((30, "c")), true)).await.unwrap()), ["c.1", "c.2"]);
}

fn invocation(id: &str, started: i64) -> Invocation {
    Invocation {
        id: id.into(),
        build_id: "b".into(),
        owner: "alice".into(),
        user: "alice".into(),
        command: "test".into(),
        patterns: vec!["//...".into()],
        options: vec!["--config=ci".into(), "--remote_instance_name=team/a".into()],
        metadata: std::collections::BTreeMap::from([("BUILD_USER".into(), "alice".into())]),
        started_unix_ms: started,
        finished_unix_ms: started + 5,
        exit_code: 3,
        exit_name: "TESTS_FAILED".into(),
        targets: vec![
            TargetOutcome { label: "//a:a".into(), kind: "genrule rule".into(), success: Some(true) },
            TargetOutcome { label: "//a:t".into(), kind: "sh_test rule".into(), success: Some(false) },
        ],
        tests: vec![TestOutcome {
            label: "//a:t".into(),
            run: 1,
            shard: 0,
            attempt: 1,
            status: "FAILED".into(),
            duration_ms: 12,
            cached_locally: false,
            logs: vec![("test.log".into(), "bytestream://h/blobs/ab/3".into())],
        }],
        target_count: 2,
        failed_targets: 1,
        instance: "team/a".into(),
        // Read back from the cache counts recorded beside it (put() does not write them).
        cache_lookups: 0,
        cache_hits: 0,
        critical_path: "Critical Path: 1.00s".into(),
    }
}

async fn invocation_store(db: &MetadataDb) {
    let s = SqlInvocationStore::new(db.clone());
    assert!(s.get("x").await.unwrap().is_none());
    let a = invocation("a", 100);
    s.put(&a).await.unwrap();
    s.put(&invocation("b", 200)).await.unwrap();
    assert_eq!(s.get("a").await.unwrap().unwrap(), a);
    let rows = s.list(10, None).await.unwrap();
    assert_eq!(rows.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["b", "a"]);
    assert!(rows[0].targets.is_empty() && rows[0].target_count == 2 && rows[0].failed_targets == 1);
    assert_eq!(rows[0].patterns, ["//..."]);
    assert_eq!(rows[0].instance, "team/a", "the list's rows carry the instance that decides who sees them");
    // Two frontends served b's lookups, before and after its build events arrived; each
    // flush replaces the process's own totals, and a failed batch changes nothing.
    let counts = |inv: &str, lookups, hits| CacheCounts { invocation: inv.into(), lookups, hits };
    s.record_cache_counts("frontend-1", &[counts("b", 3, 2), counts("a", 1, 1)]).await.unwrap();
    s.record_cache_counts("frontend-2", &[counts("b", 2, 1)]).await.unwrap();
    s.record_cache_counts("frontend-1", &[counts("b", 5, 4)]).await.unwrap();
    s.record_cache_counts("frontend-1", &[]).await.unwrap();
    let rows = s.list(10, None).await.unwrap();
    assert_eq!((rows[0].cache_lookups, rows[0].cache_hits), (7, 5), "the list's rows carry the summed cache counts");
    assert_eq!((rows[1].cache_lookups, rows[1].cache_hits), (1, 1));
    let got = s.get("b").await.unwrap().unwrap();
    assert_eq!((got.cache_lookups, got.cache_hits), (7, 5));
    // Counts of a build whose events never came are kept, and shown once they do.
    s.record_cache_counts("frontend-2", &[counts("later", 4, 4)]).await.unwrap();
    s.put(&invocation("later", 300)).await.unwrap();
    assert_eq!(s.get("later").await.unwrap().unwrap().cache_hits, 4);
    // Another process's totals for a add to frontend-1's.
    s.record_cache_counts("frontend-3", &[counts("a", 1, 0)]).await.unwrap();
    let a_now = s.get("a").await.unwrap().unwrap();
    assert_eq!((a_now.cache_lookups, a_now.cache_hits), (2, 1));
    assert_eq!(s.list(10, Some(200)).await.unwrap().len(), 1, "paged by start time");
    let mut again = invocation("a", 100);
    again.targets.truncate(1);
    s.put(&again).await.unwrap();
    let got = s.get("a").await.unwrap().unwrap();
    assert_eq!((got.targets.len(), got.target_count, got.failed_targets), (1, 1, 0));
    // A row an older gantry wrote: no cache columns set, no critical path in the document.
    sqlx::query(
        "INSERT INTO invocations (invocation_id, build_id, owner, command, started_unix_ms, finished_unix_ms,
            exit_code, exit_name, target_count, failed_targets, patterns, document, user_name)
         VALUES ('old', 'b', '', 'build', 50, 60, 0, 'SUCCESS', 0, 0, '[]',
            '{\"v\":1,\"options\":[],\"metadata\":{},\"targets\":[],\"tests\":[]}', '')",
    )
    .execute(db.pool())
    .await
    .unwrap();
    let old = s.get("old").await.unwrap().expect("an older row still reads");
    assert_eq!((old.cache_lookups, old.cache_hits, old.critical_path.as_str()), (0, 0, ""));
    // A row a gantry of schema 7 wrote, with its one process's counts in the row: they
    // still count, beside what processes record now.
    sqlx::query("UPDATE invocations SET cache_lookups = 10, cache_hits = 9 WHERE invocation_id = 'old'")
        .execute(db.pool())
        .await
        .unwrap();
    s.record_cache_counts("frontend-1", &[counts("old", 2, 1)]).await.unwrap();
    let old = s.get("old").await.unwrap().unwrap();
    assert_eq!((old.cache_lookups, old.cache_hits), (12, 10));
}

async fn queue_store(db: &MetadataDb) {
    let s = SqlQueueStore::new(db.clone());
    assert!(s.append_event(5, Some("enqueue:c1"), "{\"a\":1}").await.unwrap());
    assert!(s.append_event(6, None, "{\"b\":2}").await.unwrap());
    assert!(!s.append_event(7, Some("enqueue:c1"), "{\"a\":1}").await.unwrap(), "same key twice");
    assert!(s.append_event(8, None, "{\"c\":3}").await.unwrap());
    let ev = s.list_events().await.unwrap();
    assert_eq!(ev.iter().map(|e| (e.seq, e.at_ms)).collect::<Vec<_>>(), [(1, 5), (2, 6), (3, 8)]);
    assert_eq!(ev[0].dedup_key.as_deref(), Some("enqueue:c1"));
    assert_eq!(ev[1].dedup_key, None);
    let after = s.list_events_after(1).await.unwrap();
    assert_eq!(after.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 3], "only what follows");
    assert!(s.list_events_after(3).await.unwrap().is_empty());

    let doc = |id: &str, seq, state: &str| QueueDocRow {
        id: id.into(),
        seq,
        state: state.into(),
        document: format!("{{\"{id}\":0}}"),
    };
    s.put_change(&doc("c2", 2, "PENDING")).await.unwrap();
    s.put_change(&doc("c1", 1, "PENDING")).await.unwrap();
    s.put_change(&doc("c1", 1, "LANDED")).await.unwrap();
    let ids: Vec<_> = s.list_changes().await.unwrap().into_iter().map(|r| (r.id, r.state)).collect();
    assert_eq!(ids, [("c1".to_string(), "LANDED".to_string()), ("c2".into(), "PENDING".into())]);
    assert_eq!(s.get_change("c2").await.unwrap(), Some(doc("c2", 2, "PENDING")));
    assert_eq!(s.get_change("nope").await.unwrap(), None);
    s.put_build(&doc("b0", 0, "RUNNING")).await.unwrap();
    s.put_build(&doc("b0", 0, "DONE")).await.unwrap();
    assert_eq!(s.list_builds().await.unwrap(), [doc("b0", 0, "DONE")]);
    let land = |state: &str| LandingRow {
        version: 1,
        change_id: "c1".into(),
        old_commit: "a".into(),
        new_commit: "b".into(),
        state: state.into(),
        document: "{}".into(),
    };
    s.put_landing(&land("INTENT")).await.unwrap();
    s.put_landing(&land("DONE")).await.unwrap();
    assert_eq!(s.list_landings().await.unwrap(), [land("DONE")]);
    // Retention: a snapshot at entry 2 covers entry 1; entry 2 stays, so the journal
    // numbers on from it even once every entry before the snapshot is gone.
    assert_eq!(s.last_event_seq().await.unwrap(), 3);
    assert_eq!(s.latest_snapshot().await.unwrap(), None);
    let snap = |seq, state: &str| gantry_core::QueueSnapshotRow { seq, at_ms: 6, state: state.into() };
    s.put_snapshot(&snap(1, "old")).await.unwrap();
    s.put_snapshot(&snap(2, "{}")).await.unwrap();
    assert_eq!(s.latest_snapshot().await.unwrap(), Some(snap(2, "{}")));
    let forgot = s.forget(gantry_core::QueueForget::EventsBefore { seq: 2, limit: 100 }).await.unwrap();
    assert_eq!(forgot, 2, "entry 1 and the older snapshot");
    assert_eq!(s.list_events().await.unwrap().iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 3]);
    assert_eq!(s.latest_snapshot().await.unwrap(), Some(snap(2, "{}")));
    assert!(s.append_event(9, None, "{\"d\":4}").await.unwrap());
    assert_eq!(s.last_event_seq().await.unwrap(), 4);
    s.put_change(&doc("gone", 9, "LANDED")).await.unwrap();
    s.put_build(&doc("b9", 9, "PASSED")).await.unwrap();
    s.put_landing(&LandingRow { version: 9, ..land("DONE") }).await.unwrap();
    let ids = ["gone".to_string(), "never-there".to_string()];
    assert_eq!(s.forget(gantry_core::QueueForget::Changes(&ids)).await.unwrap(), 1);
    assert_eq!(s.forget(gantry_core::QueueForget::Builds(&["b9".to_string()])).await.unwrap(), 1);
    assert_eq!(s.forget(gantry_core::QueueForget::Landings(&[9, 10])).await.unwrap(), 1);
    assert_eq!(s.get_change("gone").await.unwrap(), None);
    assert_eq!(s.list_builds().await.unwrap(), [doc("b0", 0, "DONE")]);
    assert_eq!(s.list_landings().await.unwrap(), [land("DONE")]);
    s.put_graph("abc", "{\"targets\":{}}").await.unwrap();
    s.put_graph("abc", "ignored: a commit's graph never changes").await.unwrap();
    assert_eq!(s.get_graph("abc").await.unwrap().as_deref(), Some("{\"targets\":{}}"));
    assert_eq!(s.get_graph("def").await.unwrap(), None);
    // The graph cache keeps the ones stored last.
    assert_eq!(s.forget(gantry_core::QueueForget::GraphsBeyond { keep: 2 }).await.unwrap(), 0, "only one");
    for c in ["g1", "g2", "g3"] {
        tokio::time::sleep(Duration::from_millis(3)).await;
        s.put_graph(c, "{}").await.unwrap();
    }
    assert_eq!(s.forget(gantry_core::QueueForget::GraphsBeyond { keep: 2 }).await.unwrap(), 2);
    for (c, kept) in [("abc", false), ("g1", false), ("g2", true), ("g3", true)] {
        assert_eq!(s.get_graph(c).await.unwrap().is_some(), kept, "{c}");
    }

    // The pages of changes and the recent builds: the store's own SQL and the trait's
    // defaults (over the full lists) answer alike.
    for (i, state) in ["LANDED", "REJECTED", "LANDED", "PENDING", "SUBMITTED"].into_iter().enumerate() {
        s.put_change(&doc(&format!("c{}", i + 3), i as i64 + 3, state)).await.unwrap();
    }
    for b in 1..=4 {
        s.put_build(&doc(&b.to_string(), b, "RUNNING")).await.unwrap();
    }
    let defaults = Defaults(SqlQueueStore::new(db.clone()));
    for store in [&s as &dyn QueueStore, &defaults] {
        let page = |rows: Vec<QueueDocRow>| rows.into_iter().map(|r| r.id).collect::<Vec<_>>();
        assert_eq!(page(store.list_changes_page(&[], None, 3).await.unwrap()), ["c7", "c6", "c5"]);
        assert_eq!(page(store.list_changes_page(&[], Some(5), 0).await.unwrap()), ["c4", "c3", "c2", "c1"]);
        let decided = ["LANDED", "REJECTED"];
        assert_eq!(page(store.list_changes_page(&decided, None, 2).await.unwrap()), ["c5", "c4"]);
        assert_eq!(page(store.list_changes_page(&decided, Some(4), 2).await.unwrap()), ["c3", "c1"]);
        assert_eq!(
            page(store.list_changes_page(&["PENDING", "SUBMITTED"], None, 0).await.unwrap()),
            ["c7", "c6", "c2"]
        );
        assert_eq!(page(store.list_builds_from(3).await.unwrap()), ["3", "4"]);
        assert!(store.list_builds_from(5).await.unwrap().is_empty());
    }
}

/// A queue store that leaves the trait's provided methods to their defaults.
struct Defaults(SqlQueueStore);

#[async_trait::async_trait]
impl QueueStore for Defaults {
    async fn put_change(&self, row: &QueueDocRow) -> gantry_core::Result<()> {
        self.0.put_change(row).await
    }
    async fn get_change(&self, id: &str) -> gantry_core::Result<Option<QueueDocRow>> {
        self.0.get_change(id).await
    }
    async fn list_changes(&self) -> gantry_core::Result<Vec<QueueDocRow>> {
        self.0.list_changes().await
    }
    async fn append_event(&self, at_ms: i64, dedup_key: Option<&str>, event: &str) -> gantry_core::Result<bool> {
        self.0.append_event(at_ms, dedup_key, event).await
    }
    async fn list_events(&self) -> gantry_core::Result<Vec<gantry_core::QueueEventRow>> {
        self.0.list_events().await
    }
    async fn put_landing(&self, row: &LandingRow) -> gantry_core::Result<()> {
        self.0.put_landing(row).await
    }
    async fn list_landings(&self) -> gantry_core::Result<Vec<LandingRow>> {
        self.0.list_landings().await
    }
    async fn put_build(&self, row: &QueueDocRow) -> gantry_core::Result<()> {
        self.0.put_build(row).await
    }
    async fn list_builds(&self) -> gantry_core::Result<Vec<QueueDocRow>> {
        self.0.list_builds().await
    }
    async fn last_event_seq(&self) -> gantry_core::Result<i64> {
        self.0.last_event_seq().await
    }
    async fn put_snapshot(&self, row: &gantry_core::QueueSnapshotRow) -> gantry_core::Result<()> {
        self.0.put_snapshot(row).await
    }
    async fn latest_snapshot(&self) -> gantry_core::Result<Option<gantry_core::QueueSnapshotRow>> {
        self.0.latest_snapshot().await
    }
    async fn forget(&self, what: gantry_core::QueueForget<'_>) -> gantry_core::Result<u64> {
        self.0.forget(what).await
    }
    async fn put_graph(&self, commit: &str, graph: &str) -> gantry_core::Result<()> {
        self.0.put_graph(commit, graph).await
    }
    async fn get_graph(&self, commit: &str) -> gantry_core::Result<Option<String>> {
        self.0.get_graph(commit).await
    }
}

async fn leases(db: &MetadataDb) {
    let ttl = Duration::from_secs(30);
    assert!(db.acquire_lease("queue", "host-a", 1_000, ttl).await.unwrap());
    assert!(!db.acquire_lease("queue", "host-b", 2_000, ttl).await.unwrap(), "held by a until 31,000");
    assert!(db.acquire_lease("queue", "host-a", 20_000, ttl).await.unwrap(), "a renews");
    assert_eq!(db.lease_holder("queue").await.unwrap(), Some(("host-a".to_string(), 50_000)));
    assert!(!db.acquire_lease("queue", "host-b", 49_999, ttl).await.unwrap());
    assert!(db.acquire_lease("queue", "host-b", 50_001, ttl).await.unwrap(), "an expired lease is taken over");
    db.release_lease("queue", "host-a").await.unwrap();
    assert_eq!(db.lease_holder("queue").await.unwrap().unwrap().0, "host-b", "only the holder releases");
    db.release_lease("queue", "host-b").await.unwrap();
    assert_eq!(db.lease_holder("queue").await.unwrap(), None);

    // A role: one process has it; another is refused, told who; the same holder
    // restarted takes it back; a release frees it for anyone.
    let role = RoleLease::take(db, "batch-runners", "host-a:/runners".into(), ttl).await.unwrap();
    let e = RoleLease::take(db, "batch-runners", "host-b:/runners".into(), ttl).await.err().unwrap();
    assert!(matches!(e, Error::FailedPrecondition(_)) && e.to_string().contains("host-a:/runners"), "{e}");
    drop(role); // a crash: the lease stays until it expires...
    let again = RoleLease::take(db, "batch-runners", "host-a:/runners".into(), ttl).await.unwrap(); // ...but not for its holder
    again.release().await.unwrap();
    RoleLease::take(db, "batch-runners", "host-b:/runners".into(), ttl).await.unwrap().release().await.unwrap();
}

/// Two stores, as two `gantry serve` processes would have (each its own pool), append
/// 1,000 journal events each from several tasks; half the events of each carry a dedup
/// key that the other store also appends. Nothing is lost, nothing is duplicated, and
/// the sequence numbers are exactly 1..=n.
#[tokio::test]
async fn concurrent_journal_appends_lose_and_duplicate_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (_pg, backends) = backends(dir.path());
    for (name, url) in backends.into_iter().filter(|(n, _)| *n != "sqlite-memory") {
        eprintln!("--- {name}");
        let stores: Vec<Arc<SqlQueueStore>> = vec![
            Arc::new(SqlQueueStore::new(MetadataDb::open(&url).await.unwrap())),
            Arc::new(SqlQueueStore::new(MetadataDb::open(&url).await.unwrap())),
        ];
        const TASKS: usize = 8;
        const PER_STORE: usize = 1000;
        let mut handles = Vec::new();
        for (s, store) in stores.iter().enumerate() {
            for t in 0..TASKS {
                let store = store.clone();
                handles.push(tokio::spawn(async move {
                    let mut appended = 0;
                    for i in (t..PER_STORE).step_by(TASKS) {
                        // Even events are shared: both stores append them under one key.
                        let (key, body) = if i % 2 == 0 {
                            (Some(format!("shared:{i}")), format!("shared {i}"))
                        } else {
                            (None, format!("store {s} event {i}"))
                        };
                        if store.append_event(i as i64, key.as_deref(), &body).await.unwrap() {
                            appended += 1;
                        }
                    }
                    appended
                }));
            }
        }
        let mut appended = 0;
        for h in handles {
            appended += h.await.unwrap();
        }
        let events = stores[0].list_events().await.unwrap();
        let expected = 2 * PER_STORE / 2 + PER_STORE / 2; // each store's odd events, the shared ones once
        assert_eq!(appended, expected, "{name}: appends reported as new");
        assert_eq!(events.len(), expected, "{name}: events in the journal");
        assert_eq!(
            events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            (1..=expected as i64).collect::<Vec<_>>(),
            "{name}"
        );
        let bodies: BTreeSet<&str> = events.iter().map(|e| e.event.as_str()).collect();
        assert_eq!(bodies.len(), expected, "{name}: no event twice");
        for i in 0..PER_STORE {
            if i % 2 == 0 {
                assert!(bodies.contains(format!("shared {i}").as_str()), "{name}: shared {i} lost");
            } else {
                for s in 0..2 {
                    assert!(
                        bodies.contains(format!("store {s} event {i}").as_str()),
                        "{name}: store {s} event {i} lost"
                    );
                }
            }
        }
    }
}

/// A database written by gantry before its schema was versioned is upgraded in place,
/// keeping its rows; one whose schema is newer than this binary is refused, naming both
/// versions, and left as it was.
#[tokio::test]
async fn migrations_upgrade_old_databases_and_refuse_newer_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (_pg, backends) = backends(dir.path());
    // Migration 1 is, by construction, the schema the unversioned gantry created (its
    // statements were copied from that code, and an applied migration never changes).
    let legacy = include_str!("../migrations/0001_initial.sql");
    for (name, url) in backends.into_iter().filter(|(n, _)| *n != "sqlite-memory") {
        eprintln!("--- {name}");
        let dialect = Dialect::of(&url).unwrap();
        // What the previous gantry created and wrote, through its own plain connection.
        sqlx::any::install_default_drivers();
        {
            let pool = sqlx::any::AnyPoolOptions::new()
                .max_connections(1)
                .connect(&format!("{url}{}", if dialect == Dialect::Sqlite { "?mode=rwc" } else { "" }))
                .await
                .unwrap();
            let sql = legacy.replace("{blob}", if dialect == Dialect::Postgres { "BYTEA" } else { "BLOB" });
            pool.execute(sql.as_str()).await.unwrap();
            sqlx::query(
                "INSERT INTO action_cache (instance_name, digest_function, action_hash, action_size, result, updated_at)
                 VALUES ('', 'sha256', $1, 6, $2, 1)",
            )
            .bind(DigestFunction::Sha256.digest_of(b"action").hash_hex())
            .bind(prost::Message::encode_to_vec(&result(7)))
            .execute(&pool)
            .await
            .unwrap();
            sqlx::query("INSERT INTO queue_events (seq, at_ms, dedup_key, event) VALUES (1, 5, 'k', 'old')")
                .execute(&pool)
                .await
                .unwrap();
            pool.close().await;
        }
        let db = MetadataDb::open(&url).await.unwrap();
        assert_eq!(db.schema_version().await.unwrap(), MetadataDb::latest_version(), "{name}: upgraded");
        let ac = SqlActionCache::new(db.clone());
        assert_eq!(ac.get("", &DigestFunction::Sha256.digest_of(b"action")).await.unwrap(), Some(result(7)), "{name}");
        let q = SqlQueueStore::new(db.clone());
        assert!(q.append_event(6, None, "new").await.unwrap());
        assert_eq!(q.list_events().await.unwrap().iter().map(|e| e.event.as_str()).collect::<Vec<_>>(), ["old", "new"]);
        // The version added after the unversioned schema exists.
        assert!(db.acquire_lease("x", "me", 0, Duration::from_secs(1)).await.unwrap(), "{name}");

        // A newer gantry migrated this database further.
        let future = MetadataDb::latest_version() + 40;
        record_version(&db, future).await;
        drop((ac, q, db));
        let e = MetadataDb::open(&url).await.unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, Error::FailedPrecondition(_)), "{name}: {text}");
        assert!(text.contains(&format!("version {future}")), "{name}: names the database's version: {text}");
        assert!(text.contains(&format!("version {}", MetadataDb::latest_version())), "{name}: names ours: {text}");
        assert!(!text.contains(gantry_testkit::PG_PASSWORD), "{name}: no password in {text}");
    }
}

/// Records `version` as applied, as a newer gantry's migrator would have.
/// The first column of every row `sql` returns.
async fn column_set(db: &MetadataDb, sql: &str) -> BTreeSet<String> {
    sqlx::query(sql).fetch_all(db.pool()).await.unwrap().iter().map(|r| r.get(0)).collect()
}

async fn record_version(db: &MetadataDb, version: i64) {
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES ($1, 'from a newer gantry', true, $2, 0)",
    )
    .bind(version)
    .bind(vec![0u8; 48])
    .execute(db.pool())
    .await
    .unwrap();
}

/// The refusal changes nothing: the newer database still reads at its own version.
#[tokio::test]
async fn refusing_a_newer_database_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/meta.db", dir.path().display());
    let db = MetadataDb::open(&url).await.unwrap();
    let future = MetadataDb::latest_version() + 1;
    record_version(&db, future).await;
    let tables = |pool: sqlx::AnyPool| async move {
        sqlx::query("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .fetch_all(&pool)
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<String, _>(0))
            .collect::<Vec<_>>()
    };
    let before = tables(db.pool().clone()).await;
    drop(db);
    assert!(MetadataDb::open(&url).await.is_err());
    sqlx::any::install_default_drivers();
    let pool = sqlx::AnyPool::connect(&url).await.unwrap();
    assert_eq!(tables(pool.clone()).await, before);
    let v: i64 = sqlx::query("SELECT MAX(version) FROM _sqlx_migrations").fetch_one(&pool).await.unwrap().get(0);
    assert_eq!(v, future);
}

fn record_at(op: &str, completed_unix_ms: i64) -> ActionRecord {
    ActionRecord {
        operation: op.into(),
        instance: String::new(),
        action_digest: format!("{op}/1"),
        tool_invocation_id: "inv".into(),
        action_mnemonic: "Genrule".into(),
        target_id: "//:t".into(),
        worker: "w".into(),
        size_class: 1,
        exit_code: 0,
        status_code: 0,
        peak_memory_bytes: 1,
        user_cpu_seconds: 0.0,
        system_cpu_seconds: 0.0,
        wall_seconds: 1.0,
        queued_seconds: 0.0,
        metering: "rusage".into(),
        completed_unix_ms,
        shape_key: String::new(),
    }
}

async fn count(db: &MetadataDb, table: &str) -> i64 {
    sqlx::query(&format!("SELECT COUNT(*) FROM {table}")).fetch_one(db.pool()).await.unwrap().try_get(0).unwrap()
}

/// Retention by age and by count, in batches smaller than the work, on every backend:
/// old rows go, unfinished builds stay, an action cache entry past its age is a miss at
/// once, and the gauges' sources (row counts, size) answer.
#[tokio::test]
async fn retention_bounds_every_history_table_on_every_backend() {
    use gantry_config::{RetentionBound, RetentionConfig};
    use gantry_store::Retention;
    const DAY_MS: i64 = 86_400_000;
    let dir = tempfile::tempdir().unwrap();
    let (_pg, backends) = backends(dir.path());
    for (name, url) in backends {
        eprintln!("--- {name}");
        let db = MetadataDb::open(&url).await.unwrap();
        let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
        // Execution log: 10 records a day old and older, 5 fresh.
        let log = SqlExecutionLog::new(db.clone());
        for i in 0..10 {
            log.record(&record_at(&format!("old{i}"), now_ms - 2 * DAY_MS - i)).await.unwrap();
        }
        for i in 0..5 {
            log.record(&record_at(&format!("new{i}"), now_ms - i)).await.unwrap();
        }
        // Action cache: one entry written 3 days ago (as seconds), one now.
        let old_action = DigestFunction::Sha256.digest_of(b"old action");
        let new_action = DigestFunction::Sha256.digest_of(b"new action");
        let ac = SqlActionCache::new(db.clone());
        ac.put("", &old_action, &result(1)).await.unwrap();
        ac.put("", &new_action, &result(2)).await.unwrap();
        sqlx::query("UPDATE action_cache SET updated_at = $1 WHERE action_hash = $2")
            .bind((now_ms - 3 * DAY_MS) / 1000)
            .bind(old_action.hash_hex())
            .execute(db.pool())
            .await
            .unwrap();
        let aged = SqlActionCache::new(db.clone()).with_max_age(Duration::from_secs(86_400));
        assert_eq!(aged.get("", &old_action).await.unwrap(), None, "{name}: past its age, a miss before any sweep");
        assert_eq!(aged.get("", &new_action).await.unwrap(), Some(result(2)), "{name}");
        // Builds: 6 finished long ago, 1 running since long ago.
        let builds = SqlBuildStore::new(db.clone());
        for i in 0..6 {
            let finished = now_ms - 10 * DAY_MS + i;
            let row = BuildRow {
                id: format!("b{i}"),
                stream_id: "s".into(),
                parent_id: None,
                state: "DONE".into(),
                created_unix_ms: finished - 1,
                finished_unix_ms: Some(finished),
                document: "{}".into(),
            };
            builds.put(&row).await.unwrap();
        }
        let running = BuildRow {
            id: "running".into(),
            stream_id: "s".into(),
            parent_id: None,
            state: "RUNNING".into(),
            created_unix_ms: 0,
            finished_unix_ms: None,
            document: "{}".into(),
        };
        builds.put(&running).await.unwrap();
        // Invocations: 3 started 100 days ago, 1 now.
        let invocations = SqlInvocationStore::new(db.clone());
        for i in 0..3 {
            invocations.put(&invocation(&format!("old{i}"), now_ms - 100 * DAY_MS + i)).await.unwrap();
        }
        invocations.put(&invocation("new", now_ms)).await.unwrap();
        // Cache counts of both, old0's last recorded 100 days ago: they go with it.
        for id in ["old0", "new"] {
            let c = CacheCounts { invocation: id.into(), lookups: 2, hits: 1 };
            invocations.record_cache_counts("p", &[c]).await.unwrap();
        }
        sqlx::query("UPDATE invocation_cache_counts SET updated_unix_ms = $1 WHERE invocation_id = 'old0'")
            .bind(now_ms - 100 * DAY_MS)
            .execute(db.pool())
            .await
            .unwrap();

        let config = RetentionConfig {
            batch_size: 3,
            action_cache: RetentionBound { max_age: Duration::from_secs(86_400), max_rows: 0 },
            execution_log: RetentionBound { max_age: Duration::from_secs(86_400), max_rows: 4 },
            builds: RetentionBound { max_age: Duration::ZERO, max_rows: 2 },
            ..Default::default()
        };
        let r = Retention::new(db.clone(), config);
        let sweep = r.sweep(now_ms).await.unwrap();
        assert_eq!(
            sweep.deleted,
            [
                ("action_cache", 1),
                ("execution_log", 11),
                ("builds", 4),
                ("invocations", 3),
                ("invocation_cache_counts", 1)
            ],
            "{name}"
        );
        assert_eq!(invocations.get("new").await.unwrap().unwrap().cache_lookups, 2, "{name}");
        assert!(invocations.get("new").await.unwrap().is_some() && invocations.get("old0").await.unwrap().is_none());
        assert_eq!(ac.get("", &old_action).await.unwrap(), None, "{name}");
        assert_eq!(ac.get("", &new_action).await.unwrap(), Some(result(2)), "{name}");
        // The count bound kept the newest 4 of the 5 fresh records.
        let ops = column_set(&db, "SELECT operation FROM action_executions").await;
        assert_eq!(ops, ["new0", "new1", "new2", "new3"].into_iter().map(String::from).collect(), "{name}");
        let left = column_set(&db, "SELECT build_id FROM batch_builds").await;
        assert_eq!(
            left,
            ["b4", "b5", "running"].into_iter().map(String::from).collect(),
            "{name}: the newest finished and the running one"
        );
        assert_eq!(
            r.sweep(now_ms).await.unwrap().deleted,
            [
                ("action_cache", 0),
                ("execution_log", 0),
                ("builds", 0),
                ("invocations", 0),
                ("invocation_cache_counts", 0)
            ],
            "{name}: idempotent"
        );
        let rows = r.table_rows().await.unwrap();
        assert!(rows.contains(&("action_executions", 4)) && rows.contains(&("batch_builds", 3)), "{name}: {rows:?}");
        assert!(db.size_bytes().await.unwrap() > 0, "{name}");
    }
}

/// A day of load compressed in time: every simulated 10 minutes 50 executions are
/// logged and the sweep runs with the simulated clock. The log never holds more than its
/// bound after a sweep, and nothing older than its age survives.
#[tokio::test]
async fn a_simulated_day_stays_within_the_bounds() {
    use gantry_config::{RetentionBound, RetentionConfig};
    let dir = tempfile::tempdir().unwrap();
    let (_pg, backends) = backends(dir.path());
    for (name, url) in backends.into_iter().filter(|(n, _)| *n != "sqlite-memory") {
        let db = MetadataDb::open(&url).await.unwrap();
        let log = SqlExecutionLog::new(db.clone());
        let config = RetentionConfig {
            batch_size: 100,
            execution_log: RetentionBound { max_age: Duration::from_secs(6 * 3600), max_rows: 1_200 },
            ..Default::default()
        };
        let r = gantry_store::Retention::new(db.clone(), config);
        let start = 1_700_000_000_000i64;
        let step = 10 * 60 * 1000;
        let mut peak = 0;
        for tick in 0..(24 * 6) {
            let now = start + tick * step;
            for i in 0..50 {
                log.record(&record_at(&format!("t{tick}-{i}"), now - i)).await.unwrap();
            }
            r.sweep(now).await.unwrap();
            let n = count(&db, "action_executions").await;
            assert!(n <= 1_200, "{name}: {n} rows after the sweep at tick {tick}");
            let oldest: i64 = sqlx::query("SELECT MIN(completed_unix_ms) FROM action_executions")
                .fetch_one(db.pool())
                .await
                .unwrap()
                .get(0);
            assert!(oldest >= now - 6 * 3600 * 1000, "{name}: row older than the age bound at tick {tick}");
            peak = peak.max(n);
        }
        eprintln!("{name}: 7,200 executions over a simulated day, at most {peak} rows kept");
        assert_eq!(peak, 1_200, "{name}: the count bound was reached and held");
    }
}
