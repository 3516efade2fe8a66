//! `reapi-load`, the neutral load generator (crate gantry-loadgen), against a real
//! `gantry serve` with in-process workers: its reads count every byte, its no-op actions
//! run, and a failing command is reported as failed, not as run.

mod common;

use common::GantryServer;
use gantry_loadgen::Meter;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_load_generator_reads_every_byte_and_runs_actions_against_gantry() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gantry.toml");
    std::fs::write(&config, "[execution]\nworkers = 2\n").unwrap();
    let server = GantryServer::start(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let pid = server.child.id();
    let channel = gantry_loadgen::connect(&format!("http://{}", server.grpc)).await.unwrap();
    let meter = Meter { server_pid: Some(pid) };

    // Blobs over ByteStream's 1 MiB read chunk, and one of an odd size.
    for size in [3 << 20, (1 << 20) + 17] {
        let names = gantry_loadgen::upload_blobs(&channel, "", 3, size).await.unwrap();
        let round = gantry_loadgen::read_round(&channel, &names, size, 2, meter).await.unwrap();
        assert_eq!(round.bytes, 3 * size as u64);
        assert!(round.usage.server.is_some());
        // A blob that is not there is an error, not zero bytes.
        let absent = vec![format!("blobs/{}/{size}", "0".repeat(64))];
        let err = gantry_loadgen::read_round(&channel, &absent, size, 1, meter).await.unwrap_err();
        assert!(err.to_string().contains("not found") || err.to_string().contains("NotFound"), "{err}");
    }

    let ok = gantry_loadgen::exec(&channel, "", 40, 8, &["/bin/true".to_string()], meter).await.unwrap();
    assert_eq!((ok.actions, ok.failed), (40, 0));
    assert!(ok.p50 <= ok.p99);
    let failing = gantry_loadgen::exec(&channel, "", 5, 2, &["/bin/false".to_string()], meter).await.unwrap();
    assert_eq!((failing.actions, failing.failed), (5, 5));
    server.stop();
}
