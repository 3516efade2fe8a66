//! gantry-web owns the web UI on the HTTP port: server-rendered HTML (maud, so every value
//! is escaped and templates are checked at compile time), no JavaScript needed, nothing
//! fetched from elsewhere. Today's pages: the invocations the Build Event Service stored
//! (a paged list, newest first); one invocation with its targets, tests (logs linked
//! into the CAS) and remote actions by cost; one action (its command line, environment,
//! platform, result, outputs, stdout and stderr); and a CAS blob shown as text. Handlers read
//! the core traits only; the rendering is in [`pages`], plain functions of their data.

pub mod batching;
pub mod pages;
pub mod queue;
pub mod svg;

use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;
use gantry_core::{
    ActionCache, BlobStore, BuildStore, Digest, DigestFunction, Error, ExecutionLog, InvocationStore, QueueStore,
    SizeClassStore,
};
use http::{header, StatusCode};
use prost::Message;

/// Invocations per list page.
pub const PAGE_SIZE: usize = 50;
/// Largest blob shown in a page; larger ones are refused with their size.
pub const MAX_BLOB_VIEW: u64 = 16 << 20;

/// What the pages read. Every store is a core trait, so the pages never depend on a backend;
/// the metadata stores are the deployment's shared database, so any `gantry serve` shows
/// the builds and the queue whichever process runs them.
pub struct Web {
    pub invocations: Arc<dyn InvocationStore>,
    pub log: Arc<dyn ExecutionLog>,
    pub cas: Arc<dyn BlobStore>,
    pub ac: Arc<dyn ActionCache>,
    /// The batching service's builds.
    pub builds: Arc<dyn BuildStore>,
    /// The submit queue's changes, builds and landings.
    pub queue: Arc<dyn QueueStore>,
    /// The size-class learner's per-shape statistics.
    pub sizes: Arc<dyn SizeClassStore>,
}

/// The pages, to be merged into the HTTP router.
pub fn router(web: Arc<Web>) -> Router {
    Router::new()
        .route("/", get(|| async { Redirect::to("/invocations") }))
        .route("/invocations", get(list))
        .route("/invocations/", get(|| async { Redirect::to("/invocations") }))
        .route("/invocations/{id}", get(one))
        .route("/actions/{hash}/{size}", get(action))
        .route("/blobs/{hash}/{size}", get(blob))
        .route("/batching", get(batching::list))
        .route("/batching/builds/{id}", get(batching::one))
        .route("/queue", get(queue::page))
        .with_state(web)
}

/// In place of the pages: every page answers 403 with `why`.
pub fn disabled(why: &'static str) -> Router {
    let refuse = move || async move { failure(StatusCode::FORBIDDEN, why) };
    Router::new()
        .route("/", get(refuse))
        .route("/invocations", get(refuse))
        .route("/invocations/{*rest}", get(refuse))
        .route("/actions/{*rest}", get(refuse))
        .route("/blobs/{*rest}", get(refuse))
        .route("/batching", get(refuse))
        .route("/batching/{*rest}", get(refuse))
        .route("/queue", get(refuse))
}

fn failure(status: StatusCode, message: &str) -> Response {
    (status, pages::error(status, message)).into_response()
}

fn server_error(e: Error) -> Response {
    tracing::error!(error = %e, "web page failed");
    failure(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())
}

/// `before=<unix ms>` from the query string: the page of invocations started before it.
fn before(query: Option<&str>) -> Result<Option<i64>, String> {
    let Some(q) = query else { return Ok(None) };
    for pair in q.split('&') {
        if let Some(v) = pair.strip_prefix("before=") {
            return v.parse().map(Some).map_err(|_| format!("before: {v:?} is not a time in unix milliseconds"));
        }
    }
    Ok(None)
}

async fn list(State(web): State<Arc<Web>>, RawQuery(query): RawQuery) -> Response {
    let before = match before(query.as_deref()) {
        Ok(b) => b,
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e),
    };
    let rows = match web.invocations.list(PAGE_SIZE, before).await {
        Ok(r) => r,
        Err(e) => return server_error(e),
    };
    let mut listed = Vec::with_capacity(rows.len());
    for inv in rows {
        match web.log.invocation(&inv.id).await {
            Ok(s) => listed.push((inv, s)),
            Err(e) => return server_error(e),
        }
    }
    let next = (listed.len() == PAGE_SIZE).then(|| listed.last().map(|(i, _)| i.started_unix_ms)).flatten();
    pages::invocations(&listed, next).into_response()
}

async fn one(State(web): State<Arc<Web>>, Path(id): Path<String>) -> Response {
    let inv = match web.invocations.get(&id).await {
        Ok(i) => i,
        Err(e) => return server_error(e),
    };
    let actions = match web.log.actions(&id).await {
        Ok(a) => a,
        Err(e) => return server_error(e),
    };
    if inv.is_none() && actions.is_empty() {
        return failure(StatusCode::NOT_FOUND, &format!("no invocation {}", pages::shorten(&id, 100)));
    }
    pages::invocation(&id, inv.as_ref(), &actions).into_response()
}

/// `instance=` from the query string, percent-decoded (the pages encode every byte but
/// letters and digits).
fn instance(query: Option<&str>) -> Result<String, String> {
    let Some(v) = query.into_iter().flat_map(|q| q.split('&')).find_map(|p| p.strip_prefix("instance=")) else {
        return Ok(String::new());
    };
    let mut out = Vec::new();
    let mut bytes = v.bytes();
    while let Some(b) = bytes.next() {
        if b == b'%' {
            let hex = [bytes.next(), bytes.next()];
            let pair = match hex {
                [Some(a), Some(b)] => std::str::from_utf8(&[a, b]).ok().and_then(|h| u8::from_str_radix(h, 16).ok()),
                _ => None,
            };
            out.push(pair.ok_or("instance: malformed percent-encoding")?);
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).map_err(|_| "instance: not UTF-8".to_string())
}

/// Reads a small proto from the CAS: None when it is not there.
async fn read_proto<T: Message + Default>(web: &Web, digest: &Digest, what: &str) -> Result<Option<T>, Response> {
    if digest.size > MAX_BLOB_VIEW {
        return Err(failure(StatusCode::PAYLOAD_TOO_LARGE, &format!("the {what} has {} bytes", digest.size)));
    }
    match web.cas.get(digest).await {
        Ok(bytes) => T::decode(bytes).map(Some).map_err(|e| {
            failure(StatusCode::UNPROCESSABLE_ENTITY, &format!("the {what} {digest} does not decode: {e}"))
        }),
        Err(Error::NotFound(_)) => Ok(None),
        Err(e) => Err(server_error(e)),
    }
}

async fn action(
    State(web): State<Arc<Web>>,
    Path((hash, size)): Path<(String, i64)>,
    RawQuery(query): RawQuery,
) -> Response {
    let digest = match Digest::parse(DigestFunction::Sha256, &hash, size) {
        Ok(d) => d,
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    let instance = match instance(query.as_deref()) {
        Ok(i) => i,
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e),
    };
    let action: Option<gantry_core::reapi::Action> = match read_proto(&web, &digest, "action").await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let command_digest = action
        .as_ref()
        .and_then(|a| Digest::from_proto(DigestFunction::Sha256, a.command_digest.as_ref(), "command_digest").ok());
    let command: Option<gantry_core::reapi::Command> = match &command_digest {
        Some(d) => match read_proto(&web, d, "command").await {
            Ok(c) => c,
            Err(r) => return r,
        },
        None => None,
    };
    let result = match web.ac.get(&instance, &digest).await {
        Ok(r) => r,
        Err(e) => return server_error(e),
    };
    if action.is_none() && result.is_none() {
        return failure(StatusCode::NOT_FOUND, "neither the action nor a result for it is stored");
    }
    pages::action(&instance, &digest, action.as_ref(), command.as_ref(), result.as_ref()).into_response()
}

async fn blob(State(web): State<Arc<Web>>, Path((hash, size)): Path<(String, i64)>) -> Response {
    let digest = match Digest::parse(DigestFunction::Sha256, &hash, size) {
        Ok(d) => d,
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    if digest.size > MAX_BLOB_VIEW {
        return failure(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("the blob has {} bytes; pages show at most {MAX_BLOB_VIEW}", digest.size),
        );
    }
    match web.cas.get(&digest).await {
        // Shown as text and never sniffed: a blob holding HTML must not run as a page.
        Ok(bytes) => {
            ([(header::CONTENT_TYPE, "text/plain; charset=utf-8"), (header::X_CONTENT_TYPE_OPTIONS, "nosniff")], bytes)
                .into_response()
        }
        Err(Error::NotFound(_)) => failure(StatusCode::NOT_FOUND, "no such blob in the CAS"),
        Err(e) => server_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_cursor_is_checked() {
        assert_eq!(before(None), Ok(None));
        assert_eq!(before(Some("before=123")), Ok(Some(123)));
        assert_eq!(before(Some("x=1&before=-5")), Ok(Some(-5)));
        assert!(before(Some("before=<script>")).unwrap_err().contains("not a time"));
    }

    #[test]
    fn the_instance_is_percent_decoded_and_checked() {
        assert_eq!(instance(None).unwrap(), "");
        assert_eq!(instance(Some("instance=my%2Finstance")).unwrap(), "my/instance");
        assert_eq!(instance(Some("a=1&instance=")).unwrap(), "");
        assert!(instance(Some("instance=%2")).is_err());
        assert!(instance(Some("instance=%ff%fe")).is_err(), "not UTF-8");
        assert_eq!(instance(Some(&format!("instance={}", pages::percent_encode("dev/x y")))).unwrap(), "dev/x y");
    }
}
