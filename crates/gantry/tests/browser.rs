//! The web pages in a real browser (headless Chromium through chromedriver), after a real
//! Bazel 4.2.3 build with remote execution and --bes_backend against a real gantry: a
//! person opens the invocation, sees its targets and an action's peak memory, follows the
//! action and then its stdout. Screenshots of each page are saved as test artifacts.

mod common;

use common::browser::{session, shoot, text};
use common::{BazelWorkspace, GantryServer};
use fantoccini::Locator;
use gantry_testkit::ChromeDriver;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_person_follows_an_invocation_to_an_action_and_its_stdout() {
    let Some(driver) = ChromeDriver::start() else { return };
    let data = tempfile::tempdir().unwrap();
    // Two size classes of in-process workers, so the scheduler learns shapes to show.
    let config = data.path().join("gantry.toml");
    std::fs::write(&config, "[execution]\nworkers = [{size_class = 1, count = 1}, {size_class = 2, count = 1}]\n")
        .unwrap();
    let server = GantryServer::start(data.path(), &["--config", config.to_str().unwrap()]);
    let ws = BazelWorkspace::new();
    // A target whose action prints something: its stdout is what the person looks for.
    let mut build = std::fs::read_to_string(ws.ws().join("BUILD")).unwrap();
    build.push_str(
        "\ngenrule(\n    name = \"noisy\",\n    outs = [\"noisy.txt\"],\n    cmd = \"echo GANTRY_STDOUT_MARKER_42; echo done > $@\",\n)\n",
    );
    std::fs::write(ws.ws().join("BUILD"), build).unwrap();
    let invocation = uuid::Uuid::new_v4().to_string();
    let flags = vec![
        format!("--remote_executor=grpc://{}", server.grpc),
        "--remote_timeout=120".to_string(),
        format!("--invocation_id={invocation}"),
        format!("--bes_backend=grpc://{}", server.grpc),
        format!("--bes_results_url=http://{}/invocations/", server.http),
        "//:noisy".to_string(),
        "//:chain_c".to_string(),
    ];
    let built = tokio::task::spawn_blocking(move || ws.bazel_with_strategy("build", &flags, "remote").status.success())
        .await
        .unwrap();
    assert!(built, "the Bazel build failed");

    let c = session(&driver).await;

    // The list links to the invocation.
    c.goto(&format!("http://{}/invocations", server.http)).await.unwrap();
    shoot(&c, "invocations").await;
    c.find(Locator::Css(&format!("a[href='/invocations/{invocation}']"))).await.unwrap().click().await.unwrap();
    let body = text(&c).await;
    shoot(&c, "invocation").await;
    assert!(body.contains("//:noisy") && body.contains("//:chain_c"), "the target list: {body}");
    assert!(body.contains("Peak MiB"), "{body}");
    // An action's peak memory: the Peak MiB cell of the first action row is a number.
    let peak = c.find(Locator::XPath("//tr[td/a[starts-with(@href,'/actions/')]][1]/td[5]")).await.unwrap();
    let peak: f64 = peak.text().await.unwrap().trim().parse().expect("a peak memory in MiB");
    assert!(peak > 0.0, "{peak}");

    // Follow the noisy genrule's action, then its stdout.
    let row =
        c.find(Locator::XPath("//tr[td/code[text()='//:noisy']][td/a[starts-with(@href,'/actions/')]]")).await.unwrap();
    row.find(Locator::Css("a[href^='/actions/']")).await.unwrap().click().await.unwrap();
    let body = text(&c).await;
    shoot(&c, "action").await;
    assert!(body.contains("GANTRY_STDOUT_MARKER_42") && body.contains("Exit code 0"), "the action page: {body}");
    c.find(Locator::XPath("//a[starts-with(text(),'stdout')]")).await.unwrap().click().await.unwrap();
    let stdout = text(&c).await;
    shoot(&c, "stdout").await;
    assert_eq!(stdout.trim(), "GANTRY_STDOUT_MARKER_42", "what the person reads");

    // Back on the action: its input tree, browsed in the CAS.
    c.back().await.unwrap();
    c.find(Locator::LinkText("Input tree")).await.unwrap().click().await.unwrap();
    let body = text(&c).await;
    shoot(&c, "cas-directory").await;
    assert!(body.starts_with("Invocations") && body.contains("Directory /"), "{body}");
    // The action's shape, learned on two classes.
    c.back().await.unwrap();
    c.find(Locator::Css("a[href^='/sizeclasses/']")).await.unwrap().click().await.unwrap();
    let body = text(&c).await;
    shoot(&c, "sizeclass-shape").await;
    assert!(body.contains("Runs over time"), "{body}");
    c.goto(&format!("http://{}/sizeclasses", server.http)).await.unwrap();
    let body = text(&c).await;
    shoot(&c, "sizeclasses").await;
    // The build's runs, counted per class over the last 24 hours.
    assert!(body.contains("Selections and retries over time") && body.contains("runs in the last 24h"), "{body}");

    // The live page: both workers, and its script keeps it current without errors.
    c.goto(&format!("http://{}/workers", server.http)).await.unwrap();
    let body = c.find(Locator::Css("#live")).await.unwrap().text().await.unwrap();
    assert!(body.contains("2 workers") && body.contains("-local-0") && body.contains("-local-1"), "{body}");
    // Two of the page's 2 s polls.
    tokio::time::sleep(std::time::Duration::from_millis(4500)).await;
    let stale = c.find(Locator::Css("#stale")).await.unwrap().text().await.unwrap();
    assert_eq!(stale, "", "the poll failed");
    assert!(c.find(Locator::Css("#live svg")).await.is_ok(), "queue depth is plotted");
    shoot(&c, "workers").await;
    // Empty here: tests/batch_e2e.rs and tests/queue_e2e.rs look at them with data.
    for page in ["batching", "queue", "cas"] {
        c.goto(&format!("http://{}/{page}", server.http)).await.unwrap();
        let h1 = c.find(Locator::Css("h1")).await.unwrap().text().await.unwrap();
        assert!(!h1.starts_with('4') && !h1.starts_with('5'), "{page}: {h1}");
        shoot(&c, &format!("{page}-empty")).await;
    }
    c.close().await.unwrap();
    server.stop();
}
