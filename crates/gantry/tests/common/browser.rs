//! Pages looked at as a person would, in headless Chromium through chromedriver, with a
//! screenshot of each kept as a test artifact (`screenshots/` in the tests' target temp
//! dir; README's `docs/ui-*.png` are copies of them).

use fantoccini::{Client, ClientBuilder, Locator};
use gantry_testkit::ChromeDriver;

/// A Chromium session on `driver`.
pub async fn session(driver: &ChromeDriver) -> Client {
    // chromedriver listens on loopback in plain HTTP: no TLS on this client.
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(ChromeDriver::headless_chromium())
        .connect(&driver.url())
        .await
        .expect("a Chromium session")
}

/// Saves what `c` shows as `screenshots/{name}.png`.
pub async fn shoot(c: &Client, name: &str) {
    let shots = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let png = c.screenshot().await.unwrap();
    let path = shots.join(format!("{name}.png"));
    std::fs::write(&path, png).unwrap();
    eprintln!("screenshot: {}", path.display());
}

/// The visible text of the page `c` shows.
pub async fn text(c: &Client) -> String {
    c.find(Locator::Css("body")).await.unwrap().text().await.unwrap()
}

/// Opens each `(path, screenshot name, texts)` on `http://{http}` in a fresh browser,
/// asserts that the page shows every one of its texts, and screenshots it; returns the
/// pages' texts. None when Chromium is unavailable outside CI (in CI that fails). For the
/// tests that are not async themselves.
pub fn look_at(http: &str, pages: &[(&str, &str, &[&str])]) -> Option<Vec<String>> {
    let driver = ChromeDriver::start()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    Some(rt.block_on(async {
        let c = session(&driver).await;
        let mut texts = Vec::new();
        for (path, name, expect) in pages {
            c.goto(&format!("http://{http}{path}")).await.unwrap();
            let body = text(&c).await;
            for e in *expect {
                assert!(body.contains(e), "{path} does not show {e:?}: {body}");
            }
            shoot(&c, name).await;
            texts.push(body);
        }
        c.close().await.unwrap();
        texts
    }))
}
