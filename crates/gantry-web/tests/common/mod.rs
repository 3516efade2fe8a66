//! What every page test needs: the pages over SQLite stores and an in-memory CAS, and a
//! GET through the router as a browser would send it.
#![allow(dead_code)]

use std::sync::Arc;

use axum::body::Body;
use gantry_store::{
    MemoryStore, MetadataDb, SqlActionCache, SqlBuildStore, SqlExecutionLog, SqlInvocationStore, SqlQueueStore,
    SqlSizeClassStore,
};
use gantry_web::Web;
use http::{Request, StatusCode};
use tower::ServiceExt;

/// The stores behind a test's pages, to fill.
pub struct Stores {
    pub invocations: Arc<SqlInvocationStore>,
    pub log: Arc<SqlExecutionLog>,
    pub cas: Arc<MemoryStore>,
    pub ac: Arc<SqlActionCache>,
    pub builds: Arc<SqlBuildStore>,
    pub queue: Arc<SqlQueueStore>,
    pub sizes: Arc<SqlSizeClassStore>,
}

/// The pages' router over stores in `db` (no scheduler: no live fleet).
pub fn app(db: &MetadataDb) -> (axum::Router, Stores) {
    app_with(db, None)
}

/// [`app`], signing people in with `login` when given.
pub fn app_with(db: &MetadataDb, login: Option<gantry_web::login::Login>) -> (axum::Router, Stores) {
    let s = Stores {
        invocations: Arc::new(SqlInvocationStore::new(db.clone())),
        log: Arc::new(SqlExecutionLog::new(db.clone())),
        cas: Arc::new(MemoryStore::new(1 << 30)),
        ac: Arc::new(SqlActionCache::new(db.clone())),
        builds: Arc::new(SqlBuildStore::new(db.clone())),
        queue: Arc::new(SqlQueueStore::new(db.clone())),
        sizes: Arc::new(SqlSizeClassStore::new(db.clone())),
    };
    let web = Web {
        invocations: s.invocations.clone(),
        log: s.log.clone(),
        cas: s.cas.clone(),
        ac: s.ac.clone(),
        builds: s.builds.clone(),
        queue: s.queue.clone(),
        sizes: s.sizes.clone(),
        selection: Default::default(),
        fleet: None,
        history: Default::default(),
        login: login.map(Arc::new),
        replay: Default::default(),
    };
    (gantry_web::router(Arc::new(web)), s)
}

/// GET `uri`: the status, headers and body.
pub async fn get_full(app: &axum::Router, uri: &str) -> (StatusCode, http::HeaderMap, String) {
    send(app, Request::get(uri).body(Body::empty()).unwrap()).await
}

/// Any request: the status, headers and body.
pub async fn send(app: &axum::Router, req: Request<Body>) -> (StatusCode, http::HeaderMap, String) {
    let resp = app.clone().oneshot(req).await.unwrap();
    let (status, headers) = (resp.status(), resp.headers().clone());
    let bytes = axum::body::to_bytes(resp.into_body(), 64 << 20).await.unwrap();
    (status, headers, String::from_utf8_lossy(&bytes).into_owned())
}

/// GET `uri`: the status and body.
pub async fn get(app: &axum::Router, uri: &str) -> (StatusCode, String) {
    let (status, _, body) = get_full(app, uri).await;
    (status, body)
}
