//! `reapi-load`, the neutral load generator (crate gantry-loadgen), against a real
//! `gantry serve` with in-process workers: its reads count every byte, its no-op actions
//! run, and a failing command is reported as failed, not as run.

mod common;

use common::tls::Ca;
use common::GantryServer;
use gantry_loadgen::{ConnectOptions, Meter};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_load_generator_reads_every_byte_and_runs_actions_against_gantry() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gantry.toml");
    std::fs::write(&config, "[execution]\nworkers = 2\n").unwrap();
    let server = GantryServer::start(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let pid = server.child.id();
    let channel =
        gantry_loadgen::connect(&format!("http://{}", server.grpc), &ConnectOptions::default()).await.unwrap();
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

/// The same over TLS to a server with [auth]: with its token it reads and runs; without
/// one it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_load_generator_speaks_tls_with_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("loadgen test CA");
    let (cert, key) = ca.issue(&["localhost", "127.0.0.1"]);
    std::fs::write(d.join("server.pem"), cert).unwrap();
    std::fs::write(d.join("server.key"), key).unwrap();
    let token = "loadgen-token-0123456789";
    let config = format!(
        "[server.tls]\ncert = {:?}\nkey = {:?}\n\n[execution]\nworkers = 1\n\n[auth]\n[[auth.tokens]]\nname = \"load\"\n\
         sha256 = \"{}\"\ngrants = [\"load\"]\n[auth.grants.load]\ninstances = [\"*\"]\n\
         permissions = [\"read\", \"write_cas\", \"write_ac\", \"execute\"]\n",
        d.join("server.pem"),
        d.join("server.key"),
        gantry_services::auth::token_sha256(token)
    );
    std::fs::write(d.join("gantry.toml"), config).unwrap();
    let server = GantryServer::start(&d.join("data"), &["--config", d.join("gantry.toml").to_str().unwrap()]);
    let target = format!("https://localhost:{}", server.grpc.rsplit(':').next().unwrap());
    let meter = Meter { server_pid: None };
    let with = ConnectOptions { ca_pem: Some(ca.pem()), token: Some(token.into()) };
    let conn = gantry_loadgen::connect(&target, &with).await.unwrap();
    let names = gantry_loadgen::upload_blobs(&conn, "", 2, 2 << 20).await.unwrap();
    let round = gantry_loadgen::read_round(&conn, &names, 2 << 20, 2, meter).await.unwrap();
    assert_eq!(round.bytes, 4 << 20);
    let ran = gantry_loadgen::exec(&conn, "", 10, 4, &["/bin/true".to_string()], meter).await.unwrap();
    assert_eq!((ran.actions, ran.failed), (10, 0));

    let without = ConnectOptions { ca_pem: Some(ca.pem()), token: None };
    let conn = gantry_loadgen::connect(&target, &without).await.unwrap();
    let err = gantry_loadgen::read_round(&conn, &names, 2 << 20, 1, meter).await.unwrap_err();
    match err {
        gantry_loadgen::Error::Call { status, .. } => assert_eq!(status.code(), tonic::Code::Unauthenticated),
        other => panic!("{other}"),
    }
    server.stop();
}
