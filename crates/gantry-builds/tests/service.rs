//! The build service's bookkeeping (queueing, records, OOM splits, the deadline rerun,
//! history and training) with a stand-in `bazel`: a shell script that behaves like Bazel
//! in the ways the service observes (exit code, BEP file, server pid file). Real Bazel
//! runs in the binary's end-to-end tests; this pins the retry tree exactly.

use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use gantry_batch::{Batch, BatchSizeReason, BuildContext, Command, Models, PlannerConfig, Priority, Target};
use gantry_builds::runner::RunnerSettings;
use gantry_builds::{BuildOutcome, BuildService, BuildState, MemoryLabel, RetryKind, ServiceSettings};
use gantry_core::BuildQuery;

/// Exits 33 (OOM) with more than two targets or a target named *oom*, sleeps on a target
/// named *slow*, else succeeds; writes a BEP with a heap of 1000 bytes per target.
const FAKE_BAZEL: &str = r#"#!/bin/sh
bep=""; targets=0; seen=0; slow=0; oom=0
for a in "$@"; do
  case "$a" in
    --build_event_json_file=*) bep="${a#--build_event_json_file=}" ;;
    shutdown) exit 0 ;;
  esac
  if [ "$seen" = 1 ]; then
    targets=$((targets + 1))
    case "$a" in *slow*) slow=1 ;; *oom*) oom=1 ;; esac
  fi
  [ "$a" = "--" ] && seen=1
done
if [ "$slow" = 1 ]; then sleep 30; fi
if [ "$targets" -gt 2 ] || [ "$oom" = 1 ]; then
  printf '{"id":{"buildFinished":{}},"finished":{"exitCode":{"name":"OOM_ERROR","code":33}}}\n' > "$bep"
  exit 33
fi
printf '{"id":{"buildFinished":{}},"finished":{"exitCode":{"name":"SUCCESS"}}}\n{"id":{"buildMetrics":{}},"buildMetrics":{"memoryMetrics":{"usedHeapSizePostBuild":"%d"}}}\n' $((targets * 1000)) > "$bep"
exit 0
"#;

fn ctx(ws: &Path) -> BuildContext {
    BuildContext {
        workspace: Some(ws.display().to_string()),
        git_repo: None,
        revision: None,
        command: Command::Build,
        flags: vec![],
        priority: Priority::Medium,
        user: "u".into(),
        product_area: String::new(),
        tool_tag: String::new(),
    }
}

/// An empty Bazel workspace under `dir`.
fn workspace(dir: &Path) -> std::path::PathBuf {
    let ws = dir.join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("WORKSPACE"), "").unwrap();
    ws
}

fn target(l: &str) -> Target {
    Target { label: l.into(), rule_kind: None, tags: vec![] }
}

async fn service(dir: &Path, deadline: Duration, min_history: usize) -> Arc<BuildService> {
    service_with(dir, deadline, min_history, Models::default()).await
}

async fn service_with(dir: &Path, deadline: Duration, min_history: usize, models: Models) -> Arc<BuildService> {
    use std::os::unix::fs::PermissionsExt;
    let bazel = dir.join("fake-bazel");
    std::fs::write(&bazel, FAKE_BAZEL).unwrap();
    std::fs::set_permissions(&bazel, std::fs::Permissions::from_mode(0o755)).unwrap();
    let settings = ServiceSettings {
        runners: 2,
        runner_dir: dir.join("runners"),
        runner: RunnerSettings {
            bazel,
            startup_flags: vec![],
            extra_flags: vec![],
            heap_bytes: 64 << 20,
            deadline,
            kill_grace: Duration::from_millis(500),
            gc_spiral_window: Duration::from_secs(30),
            remote_executor: "grpc://127.0.0.1:1".into(),
            credentials: Default::default(),
        },
        memory_label: MemoryLabel::UsedHeapPostBuild,
        model_dir: dir.join("models"),
        retrain_interval: Duration::ZERO,
        min_history_builds: min_history,
        feedback: true,
        long_window: Duration::from_secs(86_400),
        short_window: Duration::from_secs(3_600),
        learner: gantry_config::Learner::default(),
    };
    let url = format!("sqlite://{}", dir.join("meta.db").display());
    let db = gantry_store::MetadataDb::open(&url).await.unwrap();
    let store = Arc::new(gantry_store::SqlBuildStore::new(db.clone()));
    let log = Arc::new(gantry_store::SqlExecutionLog::new(db));
    let planner = PlannerConfig { fallback_batch_size: 4, ..Default::default() };
    BuildService::start(settings, store, log, planner, Arc::new(RwLock::new(Arc::new(models)))).await.unwrap()
}

fn batch(labels: &[&str]) -> Batch {
    Batch {
        targets: labels.iter().map(|l| l.to_string()).collect(),
        reason: BatchSizeReason::MemoryEstimateError,
        memory_estimate_bytes: None,
        occupancy_estimate_esu: None,
        oom_probability: None,
        executor_types: Default::default(),
    }
}

async fn wait_stream(s: &BuildService, stream: &str) -> Vec<gantry_builds::BuildDoc> {
    let mut changes = s.changes();
    loop {
        let (done, builds) = s.stream_complete(stream).await.unwrap();
        if done {
            return builds;
        }
        tokio::time::timeout(Duration::from_secs(60), changes.changed()).await.expect("stream did not finish").unwrap();
    }
}

#[tokio::test]
async fn oom_builds_split_until_the_halves_fit_and_one_target_ooms_stay_failed() {
    let dir = tempfile::tempdir().unwrap();
    let ws = workspace(dir.path());
    let s = service(dir.path(), Duration::from_secs(30), 3).await;
    s.stream_started("s");
    let labels = ["//a:1", "//a:2", "//a:3", "//a:4", "//a:5"];
    let planned = Batch { oom_probability: Some(0.25), ..batch(&labels) };
    s.submit("s-0".into(), "s", &ctx(&ws), labels.iter().map(|l| target(l)).collect(), &planned, String::new(), None)
        .await
        .unwrap();
    s.submit("s-1".into(), "s", &ctx(&ws), vec![target("//b:oom")], &batch(&["//b:oom"]), String::new(), None)
        .await
        .unwrap();
    s.stream_finished("s");
    let builds = wait_stream(&s, "s").await;
    let by_id = |id: &str| builds.iter().find(|b| b.id == id).unwrap_or_else(|| panic!("no build {id}"));

    // 5 targets: OOM -> halves of 2 and 3; the 3 OOM again -> 1 and 2; all fit then.
    let root = by_id("s-0");
    assert_eq!(root.outcome, Some(BuildOutcome::Oom));
    // The planner's probability is recorded with the build (and read back from the
    // store); a half is planned again and carries its own.
    assert_eq!(root.oom_probability, Some(0.25));
    assert_eq!(by_id("s-1").oom_probability, None);
    assert_eq!(root.retries, ["s-0.1", "s-0.2"]);
    assert_eq!(by_id("s-0.1").labels(), ["//a:1", "//a:2"]);
    assert_eq!(by_id("s-0.1").outcome, Some(BuildOutcome::Success));
    assert_eq!(by_id("s-0.1").used_heap_post_build, Some(2000));
    let second = by_id("s-0.2");
    assert_eq!(
        (second.outcome, second.retry_kind, second.parent_id.as_deref()),
        (Some(BuildOutcome::Oom), Some(RetryKind::OomSplit), Some("s-0"))
    );
    assert_eq!(second.retries, ["s-0.2.1", "s-0.2.2"]);
    assert_eq!(by_id("s-0.2.1").labels(), ["//a:3"]);
    assert_eq!(by_id("s-0.2.2").labels(), ["//a:4", "//a:5"]);
    // One target that runs out of memory is not retried.
    assert_eq!(by_id("s-1").outcome, Some(BuildOutcome::Oom));
    assert!(by_id("s-1").retries.is_empty());
    assert_eq!(builds.len(), 6);
    assert!(builds.iter().all(|b| b.state == BuildState::Done && b.invocation_id.is_some()));

    // The history: every build, OOM ones labelled with the heap they ran out of.
    let history = s.history().await.unwrap();
    assert_eq!(history.len(), 6);
    let oom = history.iter().find(|r| r.id == "s-0").unwrap();
    assert_eq!((oom.outcome, oom.peak_memory_bytes), (gantry_batch::Outcome::Oom, 64 << 20));
    let summary = s.train_now().await.unwrap();
    assert_eq!((summary.builds, summary.oom_builds), (6, 3));
    assert!(summary.memory_model);
    assert!(dir.path().join("models/manifest.json").exists());
    s.shutdown().await;
}

#[tokio::test]
async fn deadline_exceeded_builds_are_rerun_once_and_training_waits_for_history() {
    let dir = tempfile::tempdir().unwrap();
    let ws = workspace(dir.path());
    let s = service(dir.path(), Duration::from_millis(700), 50).await;
    let started = std::time::Instant::now();
    // Planned by models trained at 1,700,000,000 s: its rerun says so too.
    s.submit(
        "d-0".into(),
        "d",
        &ctx(&ws),
        vec![target("//x:slow")],
        &batch(&["//x:slow"]),
        String::new(),
        Some(1_700_000_000),
    )
    .await
    .unwrap();
    // Not a workspace: an infrastructure error, not retried.
    let nows = dir.path().join("empty");
    std::fs::create_dir_all(&nows).unwrap();
    s.submit("d-1".into(), "d", &ctx(&nows), vec![target("//y:z")], &batch(&["//y:z"]), String::new(), None)
        .await
        .unwrap();
    let builds = wait_stream(&s, "d").await;
    assert!(started.elapsed() < Duration::from_secs(20), "the 30 s sleeps were cut at the deadline");
    let ids: Vec<&str> = builds.iter().map(|b| b.id.as_str()).collect();
    assert_eq!(ids, ["d-0", "d-1", "d-0.r"]);
    assert_eq!(builds[0].outcome, Some(BuildOutcome::DeadlineExceeded));
    assert_eq!(builds[0].retries, ["d-0.r"]);
    assert_eq!(builds[2].outcome, Some(BuildOutcome::DeadlineExceeded));
    assert_eq!(builds[2].retry_kind, Some(RetryKind::DeadlineRerun));
    assert!(builds[2].retries.is_empty(), "a rerun is not rerun again");
    assert_eq!(builds[2].models_trained_at, Some(1_700_000_000), "the rerun keeps its plan's model version");
    assert_eq!(builds[1].outcome, Some(BuildOutcome::InfraError));
    assert!(builds[1].message.contains("no WORKSPACE"), "{}", builds[1].message);
    assert!(builds[1].retries.is_empty());
    let err = s.train_now().await.unwrap_err().to_string();
    assert!(err.contains("min_history_builds"), "{err}");
    let rows = s.list(&BuildQuery { stream_id: Some("d".into()), ..Default::default() }).await.unwrap();
    assert_eq!(rows.len(), 3);
    s.shutdown().await;
}

/// Builds planned by the trained models teach the feedback the next plans start with:
/// not those planned before the training or by other models, and a restart keeps them.
#[tokio::test]
async fn builds_planned_by_the_current_models_feed_back_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let ws = workspace(dir.path());
    let mut c = ctx(&ws);
    c.tool_tag = "t".into();
    let s = service(dir.path(), Duration::from_secs(60), 6).await;
    let submit = |s: Arc<BuildService>, stream: &'static str, n: usize, trained_at: Option<i64>| {
        let c = c.clone();
        async move {
            for i in 0..n {
                let labels = [format!("//p{}:a", i % 5), format!("//p{}:b", i % 3)];
                let targets: Vec<Target> = labels.iter().map(|l| target(l)).collect();
                let refs: Vec<&str> = labels.iter().map(String::as_str).collect();
                s.submit(format!("{stream}-{i}"), stream, &c, targets, &batch(&refs), String::new(), trained_at)
                    .await
                    .unwrap();
            }
            wait_stream(&s, stream).await
        }
    };
    submit(s.clone(), "before", 8, None).await;
    s.train_now().await.unwrap();
    assert_eq!(s.feedback().observations("t"), 0, "the builds the models were trained on teach nothing more");
    let trained_at = s.models().read().unwrap().manifest.trained_at.map(|t| t.0);
    assert!(trained_at.is_some());
    submit(s.clone(), "other", 3, Some(1)).await;
    assert_eq!(s.feedback().observations("t"), 0, "planned by other models");
    let builds = submit(s.clone(), "after", 12, trained_at).await;
    assert!(builds.iter().all(|b| b.outcome == Some(BuildOutcome::Success)), "{builds:?}");
    let fb = s.feedback();
    assert_eq!(fb.observations("t"), 12);
    assert!(fb.correction("t").is_some(), "10 builds are enough to correct");
    assert_eq!(fb.observations(""), 0, "per tool");
    s.shutdown().await;

    let models = Models::load(&dir.path().join("models")).unwrap();
    let s = service_with(dir.path(), Duration::from_secs(60), 6, models).await;
    assert_eq!(s.feedback().observations("t"), 12, "seeded from the store at startup");
    s.shutdown().await;
}

/// An OOM build planned by the current models makes its targets suspects of the
/// deficit, and the split halves that fit clear theirs: the culprit keeps it.
#[tokio::test]
async fn an_oom_leaves_its_deficit_on_the_target_its_halves_do_not_clear() {
    let dir = tempfile::tempdir().unwrap();
    let ws = workspace(dir.path());
    let s = service(dir.path(), Duration::from_secs(60), 6).await;
    for i in 0..8 {
        let labels = [format!("//p{}:a", i % 5), format!("//p{}:b", i % 3)];
        let refs: Vec<&str> = labels.iter().map(String::as_str).collect();
        let targets = labels.iter().map(|l| target(l)).collect();
        s.submit(format!("h-{i}"), "h", &ctx(&ws), targets, &batch(&refs), String::new(), None).await.unwrap();
    }
    wait_stream(&s, "h").await;
    s.train_now().await.unwrap();
    let trained_at = s.models().read().unwrap().manifest.trained_at.map(|t| t.0);
    // Two targets fit, three run out of memory, and so does any named *oom*.
    let labels = ["//p1:a", "//p2:oom", "//p3:b"];
    let targets = labels.iter().map(|l| target(l)).collect();
    s.submit("x-0".into(), "x", &ctx(&ws), targets, &batch(&labels), String::new(), trained_at).await.unwrap();
    let builds = wait_stream(&s, "x").await;
    let ids: Vec<&str> = builds.iter().map(|b| b.id.as_str()).collect();
    // Split into //p1:a and the other two, which run out of memory and split again.
    assert_eq!(ids, ["x-0", "x-0.1", "x-0.2", "x-0.2.1", "x-0.2.2"]);
    let fb = s.feedback();
    // Three OOMs down the split tree: together they say the culprit costs up to the heap
    // less the models' estimate of it alone (each OOM adds only what the ones before it
    // did not already charge), and at least the first one's deficit.
    let heap = (64u64 << 20) as f64;
    let models = s.models().read().unwrap().clone();
    let alone = models.predict_memory(&ctx(&ws), &["//p2:oom"]).unwrap().unwrap();
    assert!(alone < 1e6, "the models read a few kilobytes: {alone}");
    let culprit = fb.suspicion("//p2:oom");
    assert!(culprit <= heap - alone + 1.0 && culprit > heap - 1e6, "{culprit}");
    // The halves that fit clear theirs.
    assert_eq!(fb.suspicion("//p1:a"), 0.0);
    assert_eq!(fb.suspicion("//p3:b"), 0.0);
    s.shutdown().await;
}
