//! `[auth]` on a real `gantry serve`: tokens by SHA-256, grants by instance and
//! permission, workers that must present a worker credential, and real Bazel 4.2.3 over
//! TLS passing its token with `--remote_header`.

mod common;

use common::output_text as text;

use common::tls::Ca;
use common::write_file as write;
use common::{BazelWorkspace, GantryServer, WorkerProcess};
use gantry_core::google::longrunning::operations_client::OperationsClient;
use gantry_core::google::longrunning::{CancelOperationRequest, ListOperationsRequest};
use gantry_core::reapi::action_cache_client::ActionCacheClient;
use gantry_core::reapi::capabilities_client::CapabilitiesClient;
use gantry_core::reapi::content_addressable_storage_client::ContentAddressableStorageClient;
use gantry_core::reapi::execution_client::ExecutionClient;
use gantry_core::reapi::{self, ActionResult};
use gantry_core::DigestFunction;
use gantry_proto::worker::v1 as wpb;
use prost::Message;
use tonic::transport::Channel;
use tonic::Code;

const CI: &str = "ci-token-0123456789";
const DEV: &str = "dev-token-0123456789";
const ALICE: &str = "alice-token-0123456789";
const WORKER: &str = "worker-token-0123456789";

fn sha(t: &str) -> String {
    gantry_services::auth::token_sha256(t)
}

fn config() -> String {
    format!(
        r#"
[execution]
workers = 0

[auth]
[[auth.tokens]]
name = "ci"
sha256 = "{}"
grants = ["ci"]
[[auth.tokens]]
name = "dev"
sha256 = "{}"
grants = ["dev"]
[[auth.tokens]]
name = "alice"
sha256 = "{}"
grants = ["alice"]
[[auth.workers.tokens]]
name = "pool"
sha256 = "{}"

[auth.grants.ci]
instances = ["*"]
permissions = ["read", "write_cas", "write_ac", "execute"]
[auth.grants.dev]
instances = ["", "main", "dev/*"]
permissions = ["read", "write_cas", "execute"]
[auth.grants.alice]
instances = ["dev/*"]
permissions = ["read", "write_cas", "write_ac", "execute"]
"#,
        sha(CI),
        sha(DEV),
        sha(ALICE),
        sha(WORKER)
    )
}

fn with_token<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut().insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

fn update(instance: &str, code: i32) -> reapi::UpdateActionResultRequest {
    reapi::UpdateActionResultRequest {
        instance_name: instance.into(),
        action_digest: Some(DigestFunction::Sha256.digest_of(b"the action").to_proto()),
        action_result: Some(ActionResult { exit_code: code, ..Default::default() }),
        ..Default::default()
    }
}

fn get(instance: &str) -> reapi::GetActionResultRequest {
    reapi::GetActionResultRequest {
        instance_name: instance.into(),
        action_digest: Some(DigestFunction::Sha256.digest_of(b"the action").to_proto()),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn tokens_grants_and_worker_credentials() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("g.toml"), config()).unwrap();
    let server = GantryServer::start(&tmp.path().join("d"), &["--config", tmp.path().join("g.toml").to_str().unwrap()]);
    let ch = Channel::from_shared(format!("http://{}", server.grpc)).unwrap().connect().await.unwrap();
    let mut caps = CapabilitiesClient::new(ch.clone());
    let mut ac = ActionCacheClient::new(ch.clone());

    // No credentials, a wrong token, a malformed header: UNAUTHENTICATED, saying nothing more.
    let e = caps.get_capabilities(with_token(reapi::GetCapabilitiesRequest::default(), None)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let e = ac.get_action_result(with_token(get("main"), Some("guess"))).await.unwrap_err();
    assert_eq!((e.code(), e.message()), (Code::Unauthenticated, "invalid credentials"));
    let mut bad = tonic::Request::new(get("main"));
    bad.metadata_mut().insert("authorization", "Basic Zm9vOmJhcg==".parse().unwrap());
    assert_eq!(ac.get_action_result(bad).await.unwrap_err().code(), Code::Unauthenticated);

    // CI writes the action cache; a developer reads it but cannot write it.
    ac.update_action_result(with_token(update("main", 3), Some(CI))).await.unwrap();
    assert_eq!(ac.get_action_result(with_token(get("main"), Some(DEV))).await.unwrap().into_inner().exit_code, 3);
    let e = ac.update_action_result(with_token(update("main", 4), Some(DEV))).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    assert!(e.message().contains("write_ac") && e.message().contains("'main'"), "{}", e.message());
    assert_eq!(
        ac.get_action_result(with_token(get("main"), Some(CI))).await.unwrap().into_inner().exit_code,
        3,
        "unchanged"
    );

    // Instance isolation: a dev/* grant cannot read main, and the refusal is the same
    // whether or not the entry exists.
    let e1 = ac.get_action_result(with_token(get("main"), Some(ALICE))).await.unwrap_err();
    let e2 = ac.get_action_result(with_token(get("main/nothing-here"), Some(ALICE))).await.unwrap_err();
    assert_eq!((e1.code(), e2.code()), (Code::PermissionDenied, Code::PermissionDenied));
    ac.update_action_result(with_token(update("dev/alice", 5), Some(ALICE))).await.unwrap();
    assert_eq!(ac.get_action_result(with_token(get("dev/alice"), Some(DEV))).await.unwrap().into_inner().exit_code, 5);

    // A worker token calls no client API.
    let e = ExecutionClient::new(ch.clone())
        .execute(with_token(reapi::ExecuteRequest { instance_name: "main".into(), ..Default::default() }, Some(WORKER)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // A client token registers no worker.
    let reg = wpb::WorkerMessage {
        kind: Some(wpb::worker_message::Kind::Register(wpb::Register {
            worker_id: "evil".into(),
            slots: 64,
            size_class: 1,
            ..Default::default()
        })),
    };
    let mut w = wpb::worker_service_client::WorkerServiceClient::new(ch.clone());
    let e = w.session(with_token(futures::stream::iter(vec![reg.clone()]), Some(CI))).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = w.session(with_token(futures::stream::iter(vec![reg]), None)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");

    // Operations belong to the identity that started them. No worker is registered, so
    // CI's action stays queued.
    let cmd = reapi::Command { arguments: vec!["true".into()], ..Default::default() };
    let cd = put(&ch, cmd.encode_to_vec(), CI).await;
    let root = put(&ch, reapi::Directory::default().encode_to_vec(), CI).await;
    let action = reapi::Action { command_digest: Some(cd), input_root_digest: Some(root), ..Default::default() };
    let ad = put(&ch, action.encode_to_vec(), CI).await;
    let exec = reapi::ExecuteRequest { instance_name: "main".into(), action_digest: Some(ad), ..Default::default() };
    let mut stream = ExecutionClient::new(ch.clone()).execute(with_token(exec, Some(CI))).await.unwrap().into_inner();
    let op = stream.message().await.unwrap().unwrap().name;
    let mut ops = OperationsClient::new(ch.clone());
    let list = |t: &'static str| {
        let mut ops = ops.clone();
        async move {
            ops.list_operations(with_token(ListOperationsRequest::default(), Some(t)))
                .await
                .unwrap()
                .into_inner()
                .operations
        }
    };
    assert_eq!(list(CI).await.iter().map(|o| o.name.clone()).collect::<Vec<_>>(), vec![op.clone()]);
    assert!(list(DEV).await.is_empty(), "a developer does not see CI's operations");
    let e = ops.cancel_operation(with_token(CancelOperationRequest { name: op.clone() }, Some(DEV))).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "someone else's operation looks missing: {e:?}");
    ops.cancel_operation(with_token(CancelOperationRequest { name: op.clone() }, Some(CI))).await.unwrap();
    let last = stream.message().await.unwrap().unwrap();
    assert!(last.done, "cancelled by its owner");

    // Refusals are counted by method and code.
    let metrics = common::http_get(&server.http, "/metrics");
    let count = |code: &str, method: &str| {
        common::metric_value(&metrics, &format!("gantry_grpc_requests_total{{code=\"{code}\",method=\"{method}\"}}"))
    };
    assert_eq!(count("UNAUTHENTICATED", "ActionCache/GetActionResult"), Some(2.0), "{metrics}");
    assert_eq!(count("PERMISSION_DENIED", "ActionCache/UpdateActionResult"), Some(1.0));
    assert_eq!(count("PERMISSION_DENIED", "WorkerService/Session"), Some(1.0));

    // The web pages need a sign-in with an [auth] token; a worker's credential is refused.
    let page = common::http_get(&server.http, "/invocations");
    assert!(page.starts_with("HTTP/1.1 303") && page.contains("location: /login?next=%2Finvocations"), "{page}");
    let sign_in = |token: &str| {
        use std::io::{Read, Write};
        let body = format!("token={token}&next=%2Fcas");
        let mut s = std::net::TcpStream::connect(&server.http).unwrap();
        write!(
            s,
            "POST /login HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    let refused = sign_in(WORKER);
    assert!(refused.starts_with("HTTP/1.1 401") && !refused.contains(WORKER), "{refused}");
    let signed = sign_in(DEV);
    assert!(signed.starts_with("HTTP/1.1 303") && signed.contains("location: /cas"), "{signed}");
    let cookie = signed.lines().find_map(|l| l.strip_prefix("set-cookie: ")).unwrap().split(';').next().unwrap();
    let cas = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&server.http).unwrap();
        write!(s, "GET /cas HTTP/1.1\r\nHost: x\r\nConnection: close\r\nCookie: {cookie}\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    assert!(cas.starts_with("HTTP/1.1 200") && cas.contains("Content-addressable storage"), "{cas}");
    server.stop();
}

async fn put(ch: &Channel, data: Vec<u8>, token: &str) -> reapi::Digest {
    let d = DigestFunction::Sha256.digest_of(&data).to_proto();
    let req = reapi::BatchUpdateBlobsRequest {
        requests: vec![reapi::batch_update_blobs_request::Request { digest: Some(d.clone()), data, compressor: 0 }],
        ..Default::default()
    };
    let r = ContentAddressableStorageClient::new(ch.clone())
        .batch_update_blobs(with_token(req, Some(token)))
        .await
        .unwrap();
    assert_eq!(r.into_inner().responses[0].status.as_ref().unwrap().code, 0);
    d
}

#[test]
fn bazel_over_tls_with_tokens_and_a_worker_with_its_credential() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let ca = Ca::new("gantry test CA");
    let (cert, key) = ca.issue(&["localhost", "127.0.0.1"]);
    let (wcert, wkey) = ca.issue(&["workers.test"]);
    let ca_pem = write(d, "ca.pem", &ca.pem());
    // The team setup of README's "Securing gantry": people and CI by token (no client
    // certificate), workers by certificate.
    let tls = format!(
        "[server.tls]\ncert = {:?}\nkey = {:?}\nclient_ca = {ca_pem:?}\nclient_certificates = \"optional\"\n",
        write(d, "server.pem", &cert),
        write(d, "server.key", &key)
    );
    let workers = "[[auth.workers.certificates]]\nname = \"pool-tls\"\ndns_name = \"workers.test\"\n";
    std::fs::write(d.join("g.toml"), format!("{tls}{}{workers}", config())).unwrap();
    let server = GantryServer::start(&d.join("d"), &["--config", d.join("g.toml").to_str().unwrap()]);
    let url = format!("grpcs://{}", server.grpc);
    let (wcert, wkey) = (write(d, "worker.pem", &wcert), write(d, "worker.key", &wkey));
    let worker = WorkerProcess::start_url(
        &url,
        &d.join("w"),
        2,
        &[("GANTRY_TLS_CA", &ca_pem), ("GANTRY_TLS_CERT", &wcert), ("GANTRY_TLS_KEY", &wkey)],
    );
    let ws = BazelWorkspace::new().with_tls();
    let header = |t: &str| format!("--remote_header=Authorization=Bearer {t}");
    let exec = |extra: &[String]| {
        let mut v = vec![
            format!("--remote_executor={url}"),
            format!("--tls_certificate={ca_pem}"),
            "--remote_timeout=60".to_string(),
        ];
        v.extend(extra.iter().cloned());
        v.push("//:chain_c".into());
        v
    };

    // No token: the build fails and Bazel says why.
    let out = ws.bazel_with_strategy("build", &exec(&[]), "remote");
    assert!(!out.status.success());
    assert!(text(&out).contains("UNAUTHENTICATED"), "{}", text(&out));

    // CI's token: remote execution on the authenticated worker.
    let out = ws.bazel_with_strategy("build", &exec(&[header(CI)]), "remote");
    assert!(out.status.success(), "{}", text(&out));
    let summary = common::process_summary(&String::from_utf8_lossy(&out.stderr));
    assert!(summary.iter().any(|(k, n)| k == "remote" && *n >= 1), "{summary:?}");

    // A developer with only a remote cache: local results are not uploaded (no write_ac),
    // and Bazel reports the refusal; CI's uploads go through.
    let cache = |t: &str| {
        vec![format!("--remote_cache={url}"), format!("--tls_certificate={ca_pem}"), header(t), "//:empty".to_string()]
    };
    assert!(ws.bazel("clean", &[]).status.success());
    let out = ws.bazel("build", &cache(DEV));
    assert!(out.status.success(), "the build itself succeeds: {}", text(&out));
    assert!(text(&out).contains("PERMISSION_DENIED"), "Bazel names the refused upload: {}", text(&out));
    assert!(ws.bazel("clean", &[]).status.success());
    let out = ws.bazel("build", &cache(CI));
    assert!(out.status.success() && !text(&out).contains("PERMISSION_DENIED"), "{}", text(&out));
    assert!(ws.bazel("clean", &[]).status.success());
    let out = ws.bazel("build", &cache(DEV));
    let summary = common::process_summary(&String::from_utf8_lossy(&out.stderr));
    assert!(summary.iter().any(|(k, _)| k == "remote cache hit"), "the developer reads CI's upload: {summary:?}");
    drop(worker);
    server.stop();
}
