//! The pages under `[auth]`: a person signs in with a token, the cookie carries it, and
//! each page shows only what the identity's grants allow; what it may not see answers as
//! if it did not exist, or 403 naming only the permission.

mod common;

use std::sync::Arc;

use axum::body::Body;
use common::{get, get_full, send};
use gantry_core::auth::{Grant, Identity, Permission, Principal};
use gantry_core::{ActionRecord, ExecutionLog, Invocation, InvocationStore};
use gantry_store::MetadataDb;
use gantry_web::login::Login;
use http::{header, Request, StatusCode};

fn identity(name: &str, instances: &[&str], permissions: &[Permission]) -> Arc<Identity> {
    Arc::new(Identity {
        name: name.into(),
        principal: Principal::Client,
        grants: Arc::new(vec![Grant {
            name: "g".into(),
            instances: instances.iter().map(|s| s.to_string()).collect(),
            permissions: permissions.iter().copied().collect(),
        }]),
    })
}

fn login() -> Login {
    let alice = identity("alice", &["team-a"], &[Permission::Read]);
    let ops = identity("ops", &["*"], &[Permission::Read, Permission::Batch]);
    Login {
        authenticate: Arc::new(move |token: &str| match token {
            "alice-token" => Ok(alice.clone()),
            "ops-token" => Ok(ops.clone()),
            _ => Err("invalid credentials"),
        }),
        secure: false,
        anonymous: None,
    }
}

async fn sign_in(app: &axum::Router, token: &str, next: &str) -> (StatusCode, http::HeaderMap, String) {
    let body = format!("token={token}&next={}", gantry_web::pages::percent_encode(next));
    let req = Request::post("/login")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from(body))
        .unwrap();
    send(app, req).await
}

async fn get_as(app: &axum::Router, cookie: &str, uri: &str) -> (StatusCode, String) {
    let req = Request::get(uri).header(header::COOKIE, cookie).body(Body::empty()).unwrap();
    let (status, _, body) = send(app, req).await;
    (status, body)
}

#[tokio::test]
async fn a_signed_in_person_sees_only_the_instances_granted() {
    let db = MetadataDb::open("sqlite::memory:").await.unwrap();
    let (app, stores) = common::app_with(&db, Some(login()));
    for (id, instance) in [("inv-a", "team-a"), ("inv-b", "team-b")] {
        let inv = Invocation {
            id: id.into(),
            command: "build".into(),
            options: vec![format!("--remote_instance_name={instance}")],
            started_unix_ms: 1_700_000_000_000,
            finished_unix_ms: 1_700_000_001_000,
            exit_name: "SUCCESS".into(),
            ..Default::default()
        };
        stores.invocations.put(&inv).await.unwrap();
        stores
            .log
            .record(&ActionRecord {
                instance: instance.into(),
                action_digest: format!("{}/1", "c".repeat(64)),
                tool_invocation_id: id.into(),
                action_mnemonic: format!("Mnemonic-{instance}"),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    // No cookie: every page sends the browser to the form, remembering where it was.
    let (status, headers, _) = get_full(&app, "/invocations/inv-a").await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(headers[header::LOCATION], "/login?next=%2Finvocations%2Finv-a");
    let (status, form) = get(&app, "/login?next=%2Finvocations%2Finv-a").await;
    assert_eq!(status, StatusCode::OK);
    assert!(form.contains("type=\"password\"") && form.contains("value=\"/invocations/inv-a\""), "{form}");

    // A wrong token: 401, the form again, no cookie, and the token not echoed.
    let (status, headers, body) = sign_in(&app, "guess-123", "/").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(headers.get(header::SET_COOKIE).is_none());
    assert!(!body.contains("guess-123") && body.contains("not accepted"));

    // The right one: a cookie that scripts cannot read, and back to where it was going.
    let (status, headers, _) = sign_in(&app, "alice-token", "/invocations/inv-a").await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(headers[header::LOCATION], "/invocations/inv-a");
    let set = headers[header::SET_COOKIE].to_str().unwrap();
    assert!(set.contains("HttpOnly") && set.contains("SameSite=Strict"), "{set}");
    let cookie = set.split(';').next().unwrap().to_string();

    let (status, list) = get_as(&app, &cookie, "/invocations").await;
    assert_eq!(status, StatusCode::OK);
    assert!(list.contains("/invocations/inv-a") && !list.contains("inv-b"), "alice sees team-a only: {list}");
    assert_eq!(get_as(&app, &cookie, "/invocations/inv-a").await.0, StatusCode::OK);
    let (status, other) = get_as(&app, &cookie, "/invocations/inv-b").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "as if it did not exist");
    assert!(!other.contains("Mnemonic-team-b"));
    let action = format!("/actions/{}/1?instance=team-b", "c".repeat(64));
    let (status, refused) = get_as(&app, &cookie, &action).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(refused.contains("read") && refused.contains("team-b"), "{refused}");
    // Batching needs the batch permission alice lacks; the CAS needs read somewhere.
    assert_eq!(get_as(&app, &cookie, "/batching").await.0, StatusCode::FORBIDDEN);
    assert_eq!(get_as(&app, &cookie, "/cas").await.0, StatusCode::OK);

    // ops reads every instance and the batching page.
    let (_, headers, _) = sign_in(&app, "ops-token", "/").await;
    let ops = headers[header::SET_COOKIE].to_str().unwrap().split(';').next().unwrap().to_string();
    let (_, list) = get_as(&app, &ops, "/invocations").await;
    assert!(list.contains("inv-a") && list.contains("inv-b"));
    assert_eq!(get_as(&app, &ops, "/batching").await.0, StatusCode::OK);

    // A revoked or forged cookie is sent back to the form and cleared.
    let req = Request::get("/invocations").header(header::COOKIE, "gantry_token=forged").body(Body::empty()).unwrap();
    let (status, headers, _) = send(&app, req).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert!(headers[header::SET_COOKIE].to_str().unwrap().contains("Max-Age=0"));
    // Signing out clears the cookie.
    let (status, headers, _) = send(&app, Request::post("/logout").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert!(headers[header::SET_COOKIE].to_str().unwrap().contains("Max-Age=0"));
}
