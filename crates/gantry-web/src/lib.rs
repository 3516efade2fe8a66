//! gantry-web owns the web UI on the HTTP port: server-rendered HTML (maud, so every value
//! is escaped and templates are checked at compile time), plots drawn as inline SVG on the
//! server, nothing fetched from elsewhere, and no JavaScript needed except to keep the
//! workers page current. The pages: invocations and one invocation with its actions; one
//! action with its input tree, result, runs and shape; the CAS browser; workers and queues
//! live; size classes; batching builds; the submit queue; and sign-in under `[auth]`.
//! Handlers read the core traits only and ask the same authorization the gRPC services
//! ask; the rendering is plain functions of their data, in each page's module.

pub mod batching;
pub mod cas;
pub mod critical;
pub mod live;
pub mod login;
pub mod pages;
pub mod queue;
pub mod sizes;
pub mod svg;

use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;
use gantry_core::auth::{self, Caller, Permission};
use gantry_core::{
    ActionCache, ActionOrder, ActionRecord, BlobStore, BuildStore, Digest, DigestFunction, Error, ExecutionLog, Fleet,
    InvocationStore, QueueStore, SizeClassStore,
};
use http::{header, StatusCode};
use prost::Message;

/// Invocations per list page.
pub const PAGE_SIZE: usize = 50;
/// Runs of one action listed on its page.
pub const RUNS_SHOWN: usize = 100;
/// Largest blob shown in a page; larger ones are refused with their size.
pub const MAX_BLOB_VIEW: u64 = 16 << 20;

/// What the pages read (cheap to clone: every part is shared). Every store is a core trait, so the pages never depend on a backend;
/// the metadata stores are the deployment's shared database, so any `gantry serve` shows
/// the builds and the queue whichever process runs them.
#[derive(Clone)]
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
    /// How the scheduler chooses classes (`[execution.size_classes]`), so the pages show
    /// the acceptable times and estimates it uses.
    pub selection: gantry_sizeclass::SelectionConfig,
    /// The scheduler's live view, on the server that runs one.
    pub fleet: Option<Arc<dyn Fleet>>,
    /// Queue depth over the last hour, filled by [`Web::start_sampler`].
    pub history: Arc<live::QueueHistory>,
    /// `[auth]`: pages need a signed-in identity and show what its grants allow.
    pub login: Option<Arc<login::Login>>,
    /// The submit queue's planner as its journal left it, for the queue page.
    pub replay: Arc<queue::Replay>,
}

impl Web {
    /// Samples the fleet's queues for the depth plot while the guard lives; None without
    /// a scheduler.
    pub fn start_sampler(&self) -> Option<gantry_core::TaskGuard> {
        Some(live::start_sampler(self.fleet.clone()?, self.history.clone()))
    }
}

/// The pages, to be merged into the HTTP router. With a login every page but the
/// sign-in form needs an identity ([`login::require`]), and each handler asks the same
/// `auth::check` the gRPC services do.
pub fn router(web: Arc<Web>) -> Router {
    let login = web.login.clone();
    let pages = Router::new()
        .route("/", get(|| async { Redirect::to("/invocations") }))
        .route("/invocations", get(list))
        .route("/invocations/", get(|| async { Redirect::to("/invocations") }))
        .route("/invocations/{id}", get(one))
        .route("/actions/{hash}/{size}", get(action))
        .route("/blobs/{hash}/{size}", get(blob))
        .route("/cas", get(cas::search))
        .route("/cas/{kind}/{hash}/{size}", get(cas::view))
        .route("/sizeclasses", get(sizes::list))
        .route("/sizeclasses/{key}", get(sizes::shape))
        .route("/workers", get(live::workers))
        .route("/workers/live", get(live::workers_live))
        .route("/batching", get(batching::list))
        .route("/batching/builds/{id}", get(batching::one))
        .route("/queue", get(queue::page))
        .with_state(web)
        .layer(axum::middleware::from_fn_with_state(login.clone(), login::require));
    Router::new()
        .route("/login", get(login::form).post(login::submit))
        .route("/logout", axum::routing::post(login::logout))
        .with_state(login)
        .merge(pages)
}

/// Whether the caller may read `instance`'s actions, results and invocations.
pub(crate) fn may_read(caller: &Caller, instance: &str) -> bool {
    auth::check(caller, Permission::Read, instance).is_ok()
}

/// A 403 page unless the caller has `permission` on some instance (for pages over data
/// that is not one instance's: the CAS, the fleet, batching, the queue). Admins pass.
pub(crate) fn refuse_unless(caller: &Caller, permission: Permission) -> Option<Response> {
    let refused = auth::check_somewhere(caller, permission).err()?;
    auth::check_somewhere(caller, Permission::Admin)
        .is_err()
        .then(|| failure(StatusCode::FORBIDDEN, &refused.to_string()))
}

pub(crate) fn failure(status: StatusCode, message: &str) -> Response {
    (status, pages::error(status, message)).into_response()
}

pub(crate) fn server_error(e: Error) -> Response {
    tracing::error!(error = %e, "web page failed");
    failure(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())
}

/// `before=<unix ms>` from the query string: the page of invocations started before it.
fn before(query: Option<&str>) -> Result<Option<i64>, String> {
    query_param(query, "before")?
        .map(|v| v.parse().map_err(|_| format!("before: {v:?} is not a time in unix milliseconds")))
        .transpose()
}

async fn list(
    State(web): State<Arc<Web>>,
    axum::Extension(caller): axum::Extension<Caller>,
    RawQuery(query): RawQuery,
) -> Response {
    let before = match before(query.as_deref()) {
        Ok(b) => b,
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e),
    };
    let rows = match web.invocations.list(PAGE_SIZE, before).await {
        Ok(r) => r,
        Err(e) => return server_error(e),
    };
    // The cursor follows the rows read, so a page of others' invocations still leads on.
    let next = (rows.len() == PAGE_SIZE).then(|| rows.last().map(|i| i.started_unix_ms)).flatten();
    let mut listed = Vec::with_capacity(rows.len());
    for inv in rows.into_iter().filter(|i| may_read(&caller, &i.instance)) {
        match web.log.invocation(&inv.id).await {
            Ok(s) => listed.push((inv, s)),
            Err(e) => return server_error(e),
        }
    }
    pages::invocations(&listed, next).into_response()
}

async fn one(
    State(web): State<Arc<Web>>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let page = match query_param(query.as_deref(), "page") {
        Ok(None) => 0,
        Ok(Some(p)) => match p.parse::<usize>() {
            Ok(p) if p <= MAX_ACTION_PAGE => p,
            _ => {
                return failure(
                    StatusCode::BAD_REQUEST,
                    &format!("page: {p:?} is not a page number up to {MAX_ACTION_PAGE}"),
                )
            }
        },
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e),
    };
    let inv = match web.invocations.get(&id).await {
        Ok(i) => i,
        Err(e) => return server_error(e),
    };
    // The invocation's instance (its build events', else its latest action's) decides
    // who may see it; what the caller may not read is treated as absent, so the answer
    // does not say whether it exists.
    let instance = match &inv {
        Some(i) => Some(i.instance.clone()),
        None => match web.log.actions_page(&id, ActionOrder::FinishedBy(i64::MAX), 0, 1).await {
            Ok(mut a) => a.pop().map(|a| a.instance),
            Err(e) => return server_error(e),
        },
    };
    let Some(instance) = instance else {
        return failure(StatusCode::NOT_FOUND, &format!("no invocation {}", pages::shorten(&id, 100)));
    };
    if !may_read(&caller, &instance) {
        return failure(StatusCode::NOT_FOUND, &format!("no invocation {}", pages::shorten(&id, 100)));
    }
    let log = web.log.as_ref();
    // The table's page waits for the action count (to know which end is nearer); the
    // timeline and the critical path go meanwhile.
    let table = async {
        let summary = log.invocation(&id).await?;
        let (order, offset, limit) = table_page(page, summary.actions as usize);
        let mut rows = log.actions_page(&id, order, offset, limit).await?;
        if order == ActionOrder::Cheapest {
            rows.reverse();
        }
        Ok::<_, Error>((summary, rows))
    };
    let ((summary, rows), longest, critical) = match tokio::try_join!(
        table,
        log.actions_page(&id, ActionOrder::Longest, 0, pages::MAX_TIMELINE_BARS),
        critical::critical_path(log, &id),
    ) {
        Ok(v) => v,
        Err(e) => return server_error(e),
    };
    // A build's actions share its instance; a record from another one (a client reusing
    // the id) is not shown to a caller who may not read it.
    let readable = |v: Vec<ActionRecord>| v.into_iter().filter(|a| may_read(&caller, &a.instance)).collect::<Vec<_>>();
    let (rows, longest) = (readable(rows), readable(longest));
    let critical = critical::CriticalPath { actions: readable(critical.actions), ..critical };
    let acts =
        pages::InvocationActions { summary: &summary, page, rows: &rows, longest: &longest, critical: &critical };
    pages::invocation(&id, inv.as_ref(), &acts).into_response()
}

/// How to read page `page` (from 0) of an invocation's `total` actions, dearest first: as
/// (order, offset, limit). A page in the list's second half is read from its cheap end in
/// [`ActionOrder::Cheapest`] (to be reversed), so no page skips more than half the list.
fn table_page(page: usize, total: usize) -> (ActionOrder, usize, usize) {
    let (offset, limit) = (page.saturating_mul(pages::ACTIONS_PER_PAGE), pages::ACTIONS_PER_PAGE);
    if offset >= total || offset <= total / 2 {
        return (ActionOrder::Dearest, offset, limit);
    }
    let shown = limit.min(total - offset);
    (ActionOrder::Cheapest, total - offset - shown, shown)
}

/// The last page number an invocation's action table accepts (a million actions).
const MAX_ACTION_PAGE: usize = 10_000;

/// The value of `name` in a query string, percent-decoded (`+` is a space, as forms send
/// it); None when absent.
pub(crate) fn query_param(query: Option<&str>, name: &str) -> Result<Option<String>, String> {
    let Some(v) = query.into_iter().flat_map(|q| q.split('&')).find_map(|p| {
        let (k, v) = p.split_once('=').unwrap_or((p, ""));
        (k == name).then_some(v)
    }) else {
        return Ok(None);
    };
    percent_decode(v).map(Some).map_err(|e| format!("{name}: {e}"))
}

/// `%XX` escapes decoded (and `+` as a space, as forms send it), checked to be UTF-8.
pub(crate) fn percent_decode(v: &str) -> Result<String, &'static str> {
    let mut out = Vec::with_capacity(v.len());
    let mut bytes = v.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let hex = [bytes.next(), bytes.next()];
                let pair = match hex {
                    [Some(a), Some(b)] => {
                        std::str::from_utf8(&[a, b]).ok().and_then(|h| u8::from_str_radix(h, 16).ok())
                    }
                    _ => None,
                };
                out.push(pair.ok_or("malformed percent-encoding")?);
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
    }
    String::from_utf8(out).map_err(|_| "not UTF-8")
}

/// `instance=` from the query string (the pages write it with `pages::percent_encode`).
fn instance(query: Option<&str>) -> Result<String, String> {
    query_param(query, "instance").map(Option::unwrap_or_default)
}

/// Reads a small proto from the CAS: None when it is not there.
pub(crate) async fn read_proto<T: Message + Default>(
    web: &Web,
    digest: &Digest,
    what: &str,
) -> Result<Option<T>, Response> {
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
    axum::Extension(caller): axum::Extension<Caller>,
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
    // Refused before anything is read: the answer says nothing about what exists.
    if let Err(e) = auth::check(&caller, Permission::Read, &instance) {
        return failure(StatusCode::FORBIDDEN, &e.to_string());
    }
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
    let runs = match web.log.runs(gantry_core::RunsOf::Action(&digest.to_string()), RUNS_SHOWN).await {
        Ok(r) => r.into_iter().filter(|r| may_read(&caller, &r.instance)).collect::<Vec<_>>(),
        Err(e) => return server_error(e),
    };
    if action.is_none() && result.is_none() && runs.is_empty() {
        return failure(StatusCode::NOT_FOUND, "neither the action nor a result or run of it is stored");
    }
    let key = runs.iter().map(|r| r.shape_key.as_str()).find(|k| !k.is_empty());
    let view = match key {
        Some(k) => match sizes::shape_view(&web, k, &sizes::fleet_classes(&web)).await {
            Ok(v) => v,
            Err(r) => return r,
        },
        None => None,
    };
    let shape = key.map(|k| (k, view.as_ref()));
    pages::action(&instance, &digest, action.as_ref(), command.as_ref(), result.as_ref(), &runs, shape).into_response()
}

async fn blob(
    State(web): State<Arc<Web>>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path((hash, size)): Path<(String, i64)>,
    RawQuery(query): RawQuery,
) -> Response {
    if let Some(refused) = refuse_unless(&caller, Permission::Read) {
        return refused;
    }
    let download = match query_param(query.as_deref(), "download") {
        Ok(d) => d,
        Err(e) => return failure(StatusCode::BAD_REQUEST, &e),
    };
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
        // A download keeps the file's name, reduced to characters safe in the header.
        Ok(bytes) if download.is_some() => {
            let name: String = download
                .unwrap_or_default()
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() || "._-+".contains(c) { c } else { '_' })
                .collect();
            let disposition = format!("attachment; filename=\"{}\"", if name.is_empty() { "blob" } else { &name });
            (
                [
                    (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                    (header::CONTENT_DISPOSITION, disposition),
                    (header::X_CONTENT_TYPE_OPTIONS, "nosniff".to_string()),
                ],
                bytes,
            )
                .into_response()
        }
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
        assert_eq!(query_param(Some("digest=a+b%2F1&kind=tree"), "digest").unwrap().as_deref(), Some("a b/1"));
        assert_eq!(query_param(Some("digestx=1"), "digest").unwrap(), None);
        assert_eq!(query_param(Some("flag"), "flag").unwrap().as_deref(), Some(""));
        assert!(instance(Some("instance=%ff%fe")).is_err(), "not UTF-8");
        assert_eq!(instance(Some(&format!("instance={}", pages::percent_encode("dev/x y")))).unwrap(), "dev/x y");
    }
}

#[cfg(test)]
mod table_tests {
    use super::*;

    /// Every page, read from whichever end is nearer, is the same slice of the dearest-first
    /// list as reading it from the top.
    #[test]
    fn pages_read_from_either_end_are_the_same_slices() {
        for total in [0usize, 1, 99, 100, 101, 150, 199, 200, 201, 250, 350, 1000] {
            let dearest: Vec<usize> = (0..total).collect();
            let cheapest: Vec<usize> = dearest.iter().rev().copied().collect();
            for page in 0..total.div_ceil(pages::ACTIONS_PER_PAGE) + 2 {
                let want: Vec<usize> = dearest
                    .iter()
                    .skip(page * pages::ACTIONS_PER_PAGE)
                    .take(pages::ACTIONS_PER_PAGE)
                    .copied()
                    .collect();
                let (order, offset, limit) = table_page(page, total);
                let mut got: Vec<usize> = match order {
                    ActionOrder::Dearest => dearest.iter().skip(offset).take(limit).copied().collect(),
                    ActionOrder::Cheapest => cheapest.iter().skip(offset).take(limit).copied().collect(),
                    other => panic!("{other:?}"),
                };
                if order == ActionOrder::Cheapest {
                    got.reverse();
                    assert!(offset <= total / 2, "read from the nearer end: page {page} of {total}");
                }
                assert_eq!(got, want, "page {page} of {total}");
            }
        }
    }
}
