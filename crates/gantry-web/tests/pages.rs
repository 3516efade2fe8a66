//! The pages over real stores (SQLite metadata, an in-memory CAS), requested through the
//! router as a browser would: the list links to an invocation, which shows its targets,
//! tests and actions and links each log to the CAS; and the list's first page stays fast
//! with 100,000 invocations stored.

mod common;

use std::sync::Arc;

use common::{get, get_full};

use gantry_core::{reapi, ActionCache};
use gantry_core::{
    ActionRecord, BlobStore, DigestFunction, ExecutionLog, Invocation, InvocationStore, TargetOutcome, TestOutcome,
};
use gantry_store::{MemoryStore, MetadataDb, SqlActionCache, SqlExecutionLog, SqlInvocationStore};
use http::StatusCode;
use prost::Message;

type Stores = (Arc<SqlInvocationStore>, Arc<SqlExecutionLog>, Arc<MemoryStore>, Arc<SqlActionCache>);

async fn web(db: &MetadataDb) -> (axum::Router, Stores) {
    let (app, s) = common::app(db);
    (app, (s.invocations, s.log, s.cas, s.ac))
}

/// Puts `message` in the CAS and returns its digest.
async fn put_proto(cas: &MemoryStore, message: &impl Message) -> gantry_core::Digest {
    let bytes = bytes::Bytes::from(message.encode_to_vec());
    let d = DigestFunction::Sha256.digest_of(&bytes);
    cas.put(&d, bytes).await.unwrap();
    d
}

#[tokio::test]
async fn an_invocation_page_links_targets_tests_logs_and_actions() {
    let db = MetadataDb::open("sqlite::memory:").await.unwrap();
    let (app, (invocations, log, cas, ac)) = web(&db).await;
    assert!(get(&app, "/invocations").await.1.contains("No invocations yet"));

    let test_log = bytes::Bytes::from_static(b"GANTRY_TEST_LOG <b>not bold</b>\n");
    let digest = DigestFunction::Sha256.digest_of(&test_log);
    cas.put(&digest, test_log.clone()).await.unwrap();
    let inv = Invocation {
        id: "inv-1".into(),
        command: "test".into(),
        patterns: vec!["//...".into()],
        started_unix_ms: 1_700_000_000_000,
        finished_unix_ms: 1_700_000_004_500,
        exit_name: "SUCCESS".into(),
        metadata: [("BUILD_USER".to_string(), "alice".to_string())].into(),
        targets: vec![TargetOutcome { label: "//pkg:lib".into(), kind: "genrule rule".into(), success: Some(true) }],
        tests: vec![TestOutcome {
            label: "//pkg:lib_test".into(),
            status: "PASSED".into(),
            duration_ms: 120,
            logs: vec![("test.log".into(), format!("bytestream://h:1/blobs/{}/{}", digest.hash_hex(), digest.size))],
            ..Default::default()
        }],
        ..Default::default()
    };
    invocations.put(&inv).await.unwrap();
    // The action it ran: its Command and Action in the CAS, its result in the action cache.
    let command = reapi::Command {
        arguments: vec!["/bin/sh".into(), "-c".into(), "echo <hello>".into()],
        environment_variables: vec![reapi::command::EnvironmentVariable { name: "PATH".into(), value: "/bin".into() }],
        ..Default::default()
    };
    let command_digest = put_proto(&cas, &command).await;
    let action_proto = reapi::Action { command_digest: Some(command_digest.to_proto()), ..Default::default() };
    let action_digest = put_proto(&cas, &action_proto).await;
    let stdout = bytes::Bytes::from_static(b"hello from the action\n");
    let stdout_digest = DigestFunction::Sha256.digest_of(&stdout);
    cas.put(&stdout_digest, stdout).await.unwrap();
    let result =
        reapi::ActionResult { exit_code: 0, stdout_digest: Some(stdout_digest.to_proto()), ..Default::default() };
    ac.put("my/instance", &action_digest, &result).await.unwrap();
    let action = ActionRecord {
        instance: "my/instance".into(),
        action_digest: action_digest.to_string(),
        tool_invocation_id: "inv-1".into(),
        action_mnemonic: "Genrule".into(),
        target_id: "//pkg:lib".into(),
        worker: "w-1".into(),
        size_class: 2,
        peak_memory_bytes: 300 << 20,
        wall_seconds: 2.0,
        ..Default::default()
    };
    log.record(&action).await.unwrap();

    let (status, list) = get(&app, "/invocations").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        list.contains("href=\"/invocations/inv-1\"") && list.contains("alice") && list.contains("SUCCESS"),
        "{list}"
    );
    assert!(list.contains("4.0"), "2 s on size class 2 is 4.0 ESU·s: {list}");
    let (status, page) = get(&app, "/invocations/inv-1").await;
    assert_eq!(status, StatusCode::OK);
    for want in ["//pkg:lib", "genrule rule", "//pkg:lib_test", "PASSED", "Genrule", "w-1", "300.0"] {
        assert!(page.contains(want), "{want} missing: {page}");
    }
    let link = format!("/blobs/{}/{}", digest.hash_hex(), digest.size);
    assert!(page.contains(&format!("href=\"{link}\"")), "{page}");
    let (status, text) = get(&app, &link).await;
    assert_eq!((status, text.as_str()), (StatusCode::OK, "GANTRY_TEST_LOG <b>not bold</b>\n"));

    // From the invocation to its action, then to the action's stdout.
    let action_link = format!("/actions/{}/{}?instance=my%2Finstance", action_digest.hash_hex(), action_digest.size);
    assert!(page.contains(&format!("href=\"{}\"", action_link.replace('&', "&amp;"))), "{page}");
    let (status, action_page) = get(&app, &action_link).await;
    assert_eq!(status, StatusCode::OK, "{action_page}");
    assert!(action_page.contains("/bin/sh -c echo &lt;hello&gt;") && action_page.contains("PATH"), "{action_page}");
    let stdout_link = format!("/blobs/{}/{}", stdout_digest.hash_hex(), stdout_digest.size);
    assert!(action_page.contains(&stdout_link), "{action_page}");
    assert_eq!(get(&app, &stdout_link).await.1, "hello from the action\n");
    assert_eq!(get(&app, &format!("/actions/{}/9", "0".repeat(64))).await.0, StatusCode::NOT_FOUND);

    assert_eq!(get(&app, "/invocations/nope").await.0, StatusCode::NOT_FOUND);
    assert_eq!(get(&app, &format!("/blobs/{}/5", "0".repeat(64))).await.0, StatusCode::NOT_FOUND);
    assert_eq!(get(&app, "/blobs/xyz/5").await.0, StatusCode::BAD_REQUEST);
    assert_eq!(get(&app, &format!("/blobs/{}/{}", "0".repeat(64), 1u64 << 40)).await.0, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(get(&app, "/invocations?before=x").await.0, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn the_first_page_of_100000_invocations_renders_fast() {
    let dir = tempfile::tempdir().unwrap();
    let db = MetadataDb::open(&format!("sqlite://{}", dir.path().join("m.db").display())).await.unwrap();
    let (app, _) = web(&db).await;
    // Written in one transaction: the test is about reading.
    let mut tx = db.pool().begin().await.unwrap();
    for i in 0..100_000i64 {
        sqlx::query(
            "INSERT INTO invocations (invocation_id, build_id, owner, command, started_unix_ms, finished_unix_ms,
                exit_code, exit_name, target_count, failed_targets, patterns, document, user_name)
             VALUES ($1, 'b', 'ci', 'build', $2, $3, 0, 'SUCCESS', 10, 0, '[\"//...\"]', '{}', 'ci')",
        )
        .bind(format!("inv-{i}"))
        .bind(1_700_000_000_000 + i * 1000)
        .bind(1_700_000_000_500 + i * 1000)
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    get(&app, "/invocations").await; // warm the pool
    let started = std::time::Instant::now();
    let (status, page) = get(&app, "/invocations").await;
    let took = started.elapsed();
    eprintln!("first page of 100,000 invocations: {took:?}");
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains("inv-99999") && !page.contains("inv-99949\""), "the newest 50");
    assert!(page.contains("?before=1700099950000"), "a link to the next page");
    // The goal is 200 ms (measured in gantry bench); this bound only catches a scan.
    assert!(took < std::time::Duration::from_secs(2), "{took:?}");
    let (_, second) = get(&app, "/invocations?before=1700099950000").await;
    assert!(second.contains("inv-99949") && !second.contains("inv-99950\""));
}

/// A person browsing an action's inputs: the action page links its input tree, whose
/// subdirectory opens and whose file downloads under its name; its runs link their
/// invocation and the shape's size-class page; the CAS form finds any digest.
#[tokio::test]
async fn the_cas_browser_walks_an_input_tree_to_a_file() {
    let db = MetadataDb::open("sqlite::memory:").await.unwrap();
    let (app, (_, log, cas, _)) = web(&db).await;
    let file = bytes::Bytes::from_static(b"int main() { return 0; }\n");
    let file_digest = DigestFunction::Sha256.digest_of(&file);
    cas.put(&file_digest, file.clone()).await.unwrap();
    let sub = reapi::Directory {
        files: vec![reapi::FileNode {
            name: "main.cc".into(),
            digest: Some(file_digest.to_proto()),
            is_executable: false,
            ..Default::default()
        }],
        ..Default::default()
    };
    let sub_digest = put_proto(&cas, &sub).await;
    let root = reapi::Directory {
        directories: vec![reapi::DirectoryNode { name: "src".into(), digest: Some(sub_digest.to_proto()) }],
        ..Default::default()
    };
    let root_digest = put_proto(&cas, &root).await;
    let command = reapi::Command { arguments: vec!["cc".into(), "src/main.cc".into()], ..Default::default() };
    let command_digest = put_proto(&cas, &command).await;
    let action = reapi::Action {
        command_digest: Some(command_digest.to_proto()),
        input_root_digest: Some(root_digest.to_proto()),
        ..Default::default()
    };
    let action_digest = put_proto(&cas, &action).await;
    for (i, (class, status)) in [(1u32, 8i32), (4, 0)].into_iter().enumerate() {
        log.record(&ActionRecord {
            operation: "op".into(),
            action_digest: action_digest.to_string(),
            tool_invocation_id: "inv-9".into(),
            action_mnemonic: "CppCompile".into(),
            worker: format!("w{class}"),
            size_class: class,
            status_code: status,
            wall_seconds: 1.5,
            metering: "cgroup-v1".into(),
            completed_unix_ms: 1_700_000_000_000 + i as i64,
            shape_key: "shape-1".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    }

    let action_uri = format!("/actions/{}/{}", action_digest.hash_hex(), action_digest.size);
    let (status, page) = get(&app, &action_uri).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains("Runs (2)") && page.contains("status 8") && page.contains("cgroup-v1"), "{page}");
    assert!(page.contains("href=\"/invocations/inv-9\"") && page.contains("href=\"/sizeclasses/shape-1\""), "{page}");
    let tree_link = format!("/cas/directory/{}/{}", root_digest.hash_hex(), root_digest.size);
    assert!(page.contains(&format!("href=\"{tree_link}\"")), "{page}");

    let (status, root_page) = get(&app, &tree_link).await;
    assert_eq!(status, StatusCode::OK);
    let sub_link = format!("/cas/directory/{}/{}?path=src", sub_digest.hash_hex(), sub_digest.size);
    assert!(root_page.contains(&format!("href=\"{sub_link}\"")), "{root_page}");
    let (_, sub_page) = get(&app, &sub_link).await;
    assert!(sub_page.contains("Directory <code>src</code>"), "{sub_page}");
    let download = format!("/blobs/{}/{}?download=main.cc", file_digest.hash_hex(), file_digest.size);
    assert!(sub_page.contains(&format!("href=\"{download}\"")), "{sub_page}");
    let (status, headers, body) = get_full(&app, &download).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "int main() { return 0; }\n"));
    assert_eq!(headers["content-disposition"], "attachment; filename=\"main.cc\"");

    let command_link = format!("/cas/command/{}/{}", command_digest.hash_hex(), command_digest.size);
    let (status, cmd) = get(&app, &command_link).await;
    assert_eq!(status, StatusCode::OK);
    assert!(cmd.contains("<code>src/main.cc</code>"), "{cmd}");

    // The lookup form sends a digest and a kind; a bad one names its field.
    let (status, headers, _) =
        get_full(&app, &format!("/cas?digest={}%2F{}&kind=directory", root_digest.hash_hex(), root_digest.size)).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(headers["location"], tree_link.as_str());
    let (status, body) = get(&app, "/cas?digest=nothex%2F1&kind=tree").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body.contains("digest:"), "{body}");
    let (status, body) = get(&app, &format!("/cas?digest={}/1&kind=elephant", "a".repeat(64))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body.contains("kind:"), "{body}");
    assert_eq!(get(&app, &format!("/cas/tree/{}/3", "0".repeat(64))).await.0, StatusCode::NOT_FOUND);
    // A blob that is not a Directory says so instead of showing garbage.
    let (status, body) = get(&app, &format!("/cas/directory/{}/{}", file_digest.hash_hex(), file_digest.size)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");

    // The shape page plots both runs; the first (failed) one is marked as retried.
    let (status, shape) = get(&app, "/sizeclasses/shape-1").await;
    assert_eq!(status, StatusCode::OK, "{shape}");
    assert_eq!(shape.matches("<circle").count(), 2, "{shape}");
    assert!(shape.contains("failed: retried larger"));
}

/// The invocation page's timeline over two workers: the chain a → b → c on w-1 and w-2
/// is the critical path (outlined bars, ★ rows), the parallel action beside it is not,
/// names with markup stay text inside the bars' titles, and the list and the page show
/// the cache hit rate the Build Event Service stored.
#[tokio::test]
async fn the_timeline_marks_the_critical_path_across_workers() {
    let db = MetadataDb::open("sqlite::memory:").await.unwrap();
    let (app, (invocations, log, _, _)) = web(&db).await;
    invocations
        .put(&Invocation {
            id: "inv-t".into(),
            command: "build".into(),
            started_unix_ms: 1_700_000_000_000,
            finished_unix_ms: 1_700_000_010_000,
            exit_name: "SUCCESS".into(),
            critical_path: "Critical Path: 9.00s <i>from Bazel</i>".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    // Two frontends counted its lookups.
    for (process, lookups, hits) in [("fe-1", 5, 4), ("fe-2", 3, 2)] {
        let c = gantry_core::CacheCounts { invocation: "inv-t".into(), lookups, hits };
        invocations.record_cache_counts(process, &[c]).await.unwrap();
    }
    let evil = "<script>alert(1)</script>";
    // (mnemonic, worker, class, queued s, ran s, end s after the base); digests make each
    // bar a link.
    let runs = [
        ("Compile-a", "w-1", 1u32, 0.0, 2.0, 2.0),
        ("Compile-b", "w-2", 2, 0.2, 2.5, 5.0),
        ("Link-c", "w-1", 2, 0.0, 3.9, 9.0),
        ("Parallel-d", "w-2", 1, 0.0, 6.0, 6.0),
        (evil, "w-2", 1, 0.0, 0.5, 0.5),
    ];
    for (i, (mnemonic, worker, class, queued, wall, end)) in runs.into_iter().enumerate() {
        log.record(&ActionRecord {
            operation: format!("op-{i}"),
            action_digest: format!("{}/{i}", format!("{i}").repeat(64)),
            tool_invocation_id: "inv-t".into(),
            action_mnemonic: mnemonic.into(),
            target_id: format!("//t:{mnemonic}"),
            worker: worker.into(),
            size_class: class,
            queued_seconds: queued,
            wall_seconds: wall,
            completed_unix_ms: 1_700_000_000_000 + (end * 1000.0) as i64,
            ..Default::default()
        })
        .await
        .unwrap();
    }

    let (status, page) = get(&app, "/invocations/inv-t").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    let svg = &page[page.find("<svg").expect("a timeline")..page.find("</svg>").unwrap()];
    // Every action is a bar, each linked to its action page; two worker lanes.
    assert_eq!(svg.matches("<rect x=\"").count() - 2, 5, "two lane backgrounds and five bars: {svg}");
    assert!(svg.contains(">w-1<") && svg.contains(">w-2<"), "{svg}");
    assert_eq!(svg.matches("href=\"/actions/").count(), 5, "{svg}");
    // The three bars of the chain are outlined, with the star in their titles.
    assert_eq!(svg.matches("class=\"critical\"").count(), 3, "{svg}");
    for name in ["Compile-a", "Compile-b", "Link-c"] {
        let title = svg.find(&format!("<title>{name} ")).unwrap_or_else(|| panic!("{name}'s bar: {svg}"));
        let rect = svg[..title].rfind("<rect").unwrap();
        assert!(svg[rect..title].contains("class=\"critical\""), "{name} marked: {svg}");
        assert!(svg[title..].split("</title>").next().unwrap().contains("★ on the critical path"));
    }
    let d = svg.find("<title>Parallel-d ").unwrap();
    assert!(svg[svg[..d].rfind("<rect").unwrap()..d].contains("class=\"bar\""), "d is not on the path");
    // Escaped inside the SVG's titles and everywhere else.
    assert!(!page.contains(evil) && svg.contains("<title>&lt;script&gt;alert(1)&lt;/script&gt; //t:&lt;script&gt;"));
    // The rows of the chain stand out in the table too; x starts at the first run.
    assert_eq!(page.matches("<tr class=\"critical\">").count(), 3, "{page}");
    assert_eq!(page.matches("★ </span>").count(), 3, "{page}");
    assert!(page.contains("★ 3 actions, 9.00 s from the first one"), "{page}");
    assert!(page.contains("size class 1") && page.contains("size class 2"), "a legend: {page}");
    assert!(page.contains("Critical Path: 9.00s &lt;i&gt;from Bazel&lt;/i&gt;"), "Bazel's own, escaped: {page}");
    assert!(page.contains("6 of 8 (75.0%)"), "{page}");

    let (_, list) = get(&app, "/invocations").await;
    assert!(list.contains("<th>Cache hits</th>") && list.contains("6 of 8 (75.0%)"), "{list}");
}

/// An invocation with more actions than a page: the table shows one page of the dearest
/// (linked to the others), the totals count every action, and a bad page is refused.
/// The size-class list counts the same runs per class over the last hour.
#[tokio::test]
async fn a_large_invocation_is_paged_and_its_runs_counted_per_class() {
    let db = MetadataDb::open("sqlite::memory:").await.unwrap();
    let (app, (_, log, _, _)) = web(&db).await;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    for i in 0..250 {
        log.record(&ActionRecord {
            operation: format!("op-{i:03}"),
            action_digest: format!("{}/{i}", "a".repeat(64)),
            tool_invocation_id: "big".into(),
            action_mnemonic: format!("M{i}"),
            worker: "w".into(),
            size_class: 1 + (i % 2) as u32,
            exit_code: (i % 50 == 0) as i32,
            // Action i costs i (class 1) or 2i (class 2) ESU·s: the dearest is M249.
            wall_seconds: i as f64,
            completed_unix_ms: now - 60_000 + i as i64,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let rows = |page: &str| page.matches("<tr").count() - 1;
    let (status, first) = get(&app, "/invocations/big").await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert!(first.contains("Remote actions (250)") && first.contains("Page 1 of 3"), "{first}");
    assert_eq!(rows(&first), 100, "one page of rows");
    let order: Vec<usize> = first.match_indices(">M").map(|(i, _)| i).take(3).collect();
    let at = |m: &str| first.find(&format!(">{m}<")).unwrap_or_else(|| panic!("{m} on page 1"));
    assert!(at("M249") < at("M247") && at("M247") < at("M245"), "dearest first: {order:?}");
    assert!(!first.contains(">M0<"), "the cheapest is on a later page");
    let (_, last) = get(&app, "/invocations/big?page=2").await;
    assert_eq!(rows(&last), 50);
    assert!(last.contains(">M0<") && last.contains("Page 3 of 3"), "{last}");
    let (status, past) = get(&app, "/invocations/big?page=7").await;
    assert_eq!(status, StatusCode::OK);
    assert!(past.contains("No actions on this page"), "{past}");
    for bad in ["page=x", "page=-1", "page=99999999"] {
        let (status, body) = get(&app, &format!("/invocations/big?{bad}")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
        assert!(body.contains("page:"), "{body}");
    }

    let (status, sizes) = get(&app, "/sizeclasses?window=1h").await;
    assert_eq!(status, StatusCode::OK, "{sizes}");
    assert!(sizes.contains("250 runs in the last 1h"), "{sizes}");
    assert!(sizes.contains("<td class=\"n\">1</td><td class=\"n\">125</td><td class=\"n\">50%</td>"), "{sizes}");
    assert!(sizes.contains("<span class=\"bad\">5</span>"), "5 failed: {sizes}");
    let (status, body) = get(&app, "/sizeclasses?window=1y").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body.contains("window:"), "{body}");
}
