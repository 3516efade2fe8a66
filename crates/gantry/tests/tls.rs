//! `[server.tls]` with mutual TLS on a real `gantry serve`, certificates made by the test
//! (rcgen): a REAPI client over TLS running an action on a `gantry worker` that itself
//! connects over grpcs:// with its client certificate, /metrics over HTTPS, client
//! certificates from another CA refused at the handshake, and a certificate replaced on
//! SIGHUP without a restart.
//!
//! Real Bazel over TLS, with tokens, is in auth.rs.

mod common;

use common::output_text as text;

use std::process::Command;

use common::reapi::{command, Client, Node};
use common::tls::Ca;
use common::write_file as write;
use common::{GantryServer, WorkerProcess};
use gantry_core::reapi::capabilities_client::CapabilitiesClient;
use gantry_core::reapi::GetCapabilitiesRequest;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

async fn tls_channel(port: u16, ca: &str, client: Option<(&str, &str)>) -> Result<Channel, String> {
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)).domain_name("localhost");
    if let Some((cert, key)) = client {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    Channel::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))
}

async fn capabilities(port: u16, ca: &str, client: Option<(&str, &str)>) -> Result<(), String> {
    let channel = tls_channel(port, ca, client).await?;
    CapabilitiesClient::new(channel)
        .get_capabilities(GetCapabilitiesRequest::default())
        .await
        .map(|_| ())
        .map_err(|e| format!("{e:?}"))
}

#[test]
fn mutual_tls_for_clients_workers_and_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let ca = Ca::new("gantry test CA");
    let other = Ca::new("some other CA");
    let (srv_cert, srv_key) = ca.issue(&["localhost", "127.0.0.1"]);
    let (cli_cert, cli_key) = ca.issue(&["client.test"]);
    let (wrk_cert, wrk_key) = ca.issue(&["worker.test"]);
    let (stranger_cert, stranger_key) = ca.issue(&["stranger.test"]);
    let (bad_cert, bad_key) = other.issue(&["intruder.test"]);
    let ca_pem = write(d, "ca.pem", &ca.pem());
    let cert_path = write(d, "server.pem", &srv_cert);
    let key_path = write(d, "server.key", &srv_key);
    let cli_cert_path = write(d, "client.pem", &cli_cert);
    let cli_key_path = write(d, "client.key", &cli_key);
    let wrk_cert_path = write(d, "worker.pem", &wrk_cert);
    let wrk_key_path = write(d, "worker.key", &wrk_key);
    // Identities come from the certificates' DNS names: no tokens anywhere.
    let cfg = format!(
        "[server.tls]\ncert = {cert_path:?}\nkey = {key_path:?}\nclient_ca = {ca_pem:?}\n\n[execution]\nworkers = 0\n\n\
         [auth]\n[[auth.certificates]]\nname = \"ci\"\ndns_name = \"client.test\"\ngrants = [\"ci\"]\n\
         [[auth.workers.certificates]]\nname = \"pool\"\ndns_name = \"worker.test\"\n\
         [auth.grants.ci]\ninstances = [\"*\"]\npermissions = [\"read\", \"write_cas\", \"execute\"]\n"
    );
    let cfg_path = write(d, "gantry.toml", &cfg);
    let server = GantryServer::start(&d.join("data"), &["--config", &cfg_path]);
    let port: u16 = server.grpc.rsplit(':').next().unwrap().parse().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();

    // gantry's client with the CA and a client certificate: served, as "ci".
    rt.block_on(capabilities(port, &ca.pem(), Some((&cli_cert, &cli_key)))).unwrap();
    // A certificate of the right CA whose name [auth] does not know: UNAUTHENTICATED.
    let e = rt.block_on(capabilities(port, &ca.pem(), Some((&stranger_cert, &stranger_key)))).unwrap_err();
    assert!(e.contains("Unauthenticated"), "{e}");
    // No client certificate, or one from another CA: refused at the handshake.
    let e = rt.block_on(capabilities(port, &ca.pem(), None)).unwrap_err();
    assert!(e.contains("connect") || e.contains("Unavailable") || e.contains("Unknown"), "{e}");
    let e = rt.block_on(capabilities(port, &ca.pem(), Some((&bad_cert, &bad_key)))).unwrap_err();
    assert!(e.contains("connect") || e.contains("Unavailable") || e.contains("Unknown"), "{e}");
    // Plaintext on the TLS port gets nowhere.
    let plain = rt.block_on(async {
        let ch = Channel::from_shared(format!("http://127.0.0.1:{port}")).unwrap().connect().await;
        match ch {
            Err(_) => Err(()),
            Ok(ch) => CapabilitiesClient::new(ch)
                .get_capabilities(GetCapabilitiesRequest::default())
                .await
                .map(|_| ())
                .map_err(|_| ()),
        }
    });
    assert!(plain.is_err(), "plaintext must not be served on the TLS port");

    // /metrics over HTTPS, with the client certificate.
    let http_port = server.http.rsplit(':').next().unwrap();
    let curl = |cert: &str, key: &str| {
        Command::new("curl")
            .args(["-sS", "--max-time", "10", "--cacert", &ca_pem, "--cert", cert, "--key", key])
            .arg(format!("https://localhost:{http_port}/healthz"))
            .output()
            .expect("running curl")
    };
    let out = curl(&cli_cert_path, &cli_key_path);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"), "{}", text(&out));

    // A worker over grpcs://, known by its certificate alone, runs an action that a client
    // submitted over TLS.
    let worker = WorkerProcess::start_url(
        &format!("grpcs://localhost:{port}"),
        &d.join("worker"),
        2,
        &[("GANTRY_TLS_CA", &ca_pem), ("GANTRY_TLS_CERT", &wrk_cert_path), ("GANTRY_TLS_KEY", &wrk_key_path)],
    );
    rt.block_on(async {
        let c = Client { channel: tls_channel(port, &ca.pem(), Some((&cli_cert, &cli_key))).await.unwrap() };
        let mut files = std::collections::BTreeMap::new();
        files.insert("in.txt".to_string(), Node::File(b"over TLS\n".to_vec(), false));
        let input = c.tree(&files).await;
        let action =
            c.action(command(&["/bin/sh", "-c", "cat in.txt > out.txt"], &["out.txt"], &[]), input, 60, false).await;
        let (_, _, resp) = c.execute(action, true).await;
        assert_eq!(resp.status.as_ref().map_or(0, |s| s.code), 0, "{:?}", resp.status);
        let r = resp.result.unwrap();
        assert_eq!(r.exit_code, 0);
        assert_eq!(c.get(r.output_files[0].digest.as_ref().unwrap()).await, b"over TLS\n");
    });

    // A new certificate from another CA, loaded on SIGHUP without a restart: clients that
    // trust only the old CA are refused, clients that trust the new one are served.
    let (new_cert, new_key) = other.issue(&["localhost", "127.0.0.1"]);
    write(d, "server.pem", &new_cert);
    write(d, "server.key", &new_key);
    Command::new("kill").args(["-HUP", &server.child.id().to_string()]).status().unwrap();
    let start = std::time::Instant::now();
    loop {
        if rt.block_on(capabilities(port, &other.pem(), Some((&cli_cert, &cli_key)))).is_ok() {
            break;
        }
        assert!(start.elapsed() < std::time::Duration::from_secs(10), "the new certificate never took effect");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(
        rt.block_on(capabilities(port, &ca.pem(), Some((&cli_cert, &cli_key)))).is_err(),
        "the old certificate is gone"
    );
    // A broken file on SIGHUP keeps the working certificate.
    write(d, "server.key", "not a key");
    Command::new("kill").args(["-HUP", &server.child.id().to_string()]).status().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    rt.block_on(capabilities(port, &other.pem(), Some((&cli_cert, &cli_key)))).unwrap();

    drop(worker);
    server.stop();
}

/// `gantry bench auth`, briefly: every configuration comes up and answers, gantry's
/// three and the bare tonic floor's three (plaintext, tonic's TLS, gantry's TLS
/// listener), and the report compares what TLS adds on each.
#[test]
fn bench_auth_measures_gantry_beside_the_bare_stack() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("bench CA");
    let (cert, key) = ca.issue(&["localhost", "127.0.0.1"]);
    let out = common::gantry()
        .args(["bench", "auth", "--clients", "2", "--calls", "20", "--rounds", "1", "--tls-cert"])
        .arg(write(d, "server.pem", &cert))
        .arg("--tls-key")
        .arg(write(d, "server.key", &key))
        .arg("--tls-ca")
        .arg(write(d, "ca.pem", &ca.pem()))
        .output()
        .unwrap();
    let report = text(&out);
    assert!(out.status.success(), "{report}");
    for row in [
        "| plaintext, no [auth] |",
        "| plaintext + bearer token |",
        "| TLS + bearer token |",
        "| floor: bare tonic, plaintext |",
        "| floor: bare tonic, TLS |",
        "| floor: bare tonic, gantry's TLS listener |",
    ] {
        assert!(report.contains(row), "no row {row}: {report}");
    }
    for call in ["GetActionResult", "FindMissingBlobs"] {
        assert!(report.contains(&format!("{call}: TLS adds ")) && report.contains("behind gantry's"), "{report}");
    }
}

/// `[cas] kind = "s3"` at an `https://` endpoint whose certificate a private CA signed
/// (moto serving HTTPS with a certificate the test made). Without `ca_file` the server
/// refuses to start, naming the bucket and the untrusted certificate; with it, blobs go
/// to the bucket and come back over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_bucket_over_https_behind_a_private_ca() {
    use gantry_testkit::{S3Server, S3Tls, S3_KEY_ID, S3_SECRET_KEY};
    use std::path::Path;

    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let ca = Ca::new("private S3 CA");
    let (cert, key) = ca.issue(&["127.0.0.1"]);
    let ca_pem = write(d, "s3-ca.pem", &ca.pem());
    let cert_path = write(d, "s3.pem", &cert);
    let key_path = write(d, "s3.key", &key);
    let tls = S3Tls { cert: Path::new(&cert_path), key: Path::new(&key_path), ca: Path::new(&ca_pem) };
    let Some(s3) = S3Server::start_tls(&tls) else { return };
    assert!(s3.endpoint().starts_with("https://"), "{}", s3.endpoint());
    s3.create_bucket("gantry-tls");
    let config = |ca_file: Option<&str>| {
        let ca_line = ca_file.map(|c| format!("ca_file = {c:?}\n")).unwrap_or_default();
        format!(
            "[cas]\nkind = \"s3\"\nbucket = \"gantry-tls\"\nendpoint = \"{}\"\nprefix = \"cas/\"\n{ca_line}\n\
             [execution]\nworkers = 0\n\n[batch]\nrunners = 0\n",
            s3.endpoint()
        )
    };
    let env = [("AWS_ACCESS_KEY_ID", S3_KEY_ID), ("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)];

    // `gantry serve` with `cfg`, which must refuse to start: its stderr.
    let refused = |name: &str, cfg: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_gantry"))
            .args(["serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--data-dir"])
            .arg(d.join(name))
            .args(["--config", cfg])
            .envs(env)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{name}: started when it should not have: {}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        eprintln!("{name}: refused as it should be:\n{stderr}");
        assert!(!stderr.contains(S3_SECRET_KEY), "never the secret: {stderr}");
        stderr
    };

    // The system's roots alone do not trust the private CA: refused at startup, with why.
    let stderr = refused("untrusting", &write(d, "untrusting.toml", &config(None)));
    assert!(stderr.contains("gantry-tls") && stderr.contains(&s3.endpoint()), "names the bucket: {stderr}");
    assert!(stderr.to_lowercase().contains("certificate"), "says the certificate is the problem: {stderr}");

    // A file that holds no certificate is named, not ignored.
    let not_pem = write(d, "not-a-ca.pem", "hello\n");
    let stderr = refused("bad-ca", &write(d, "bad-ca.toml", &config(Some(&not_pem))));
    assert!(stderr.contains("cas.ca_file") && stderr.contains(&not_pem), "names the file: {stderr}");

    // With the CA: the server starts, and a blob reaches the bucket and reads back.
    let trusting = write(d, "trusting.toml", &config(Some(&ca_pem)));
    let server = GantryServer::start_env(&d.join("data"), &["--config", &trusting], &env);
    let client = Client::connect(&server.grpc).await;
    let blob = b"kept in a bucket behind a private CA".repeat(1000);
    let digest = client.put(&blob).await;
    assert_eq!(client.get(&digest.to_proto()).await, blob);
    let objects = s3.list("gantry-tls");
    let hash = digest.hash_hex();
    assert!(objects.iter().any(|k| k.contains(&hash)), "the blob is in the bucket: {objects:?}");
    server.stop();
}
