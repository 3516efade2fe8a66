//! Login for the pages when the server has `[auth]`: a person signs in with the same
//! token a client sends as `authorization: Bearer …`, and each page shows only what that
//! identity's grants allow (the same decision the gRPC services make, `auth::check`).
//!
//! The token travels in an HttpOnly, SameSite=Strict cookie and is authenticated again on
//! every request, so revoking it in `[auth]` ends the session at once, and every frontend
//! of a deployment accepts it with no shared session state. It is never logged or shown.
//! Without `[auth]` every request is `Caller::Unrestricted`, as the gRPC services treat it.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use gantry_core::auth::{Caller, Identity};
use http::{header, StatusCode};
use maud::{html, Markup};

use crate::pages::{layout, percent_encode};
use crate::query_param;

/// The cookie that carries the token.
pub const COOKIE: &str = "gantry_token";
/// How long a browser keeps it: a working day.
pub const COOKIE_MAX_AGE_S: u64 = 12 * 3600;
/// Largest login form accepted (a token is at most 4 KiB).
const MAX_FORM: usize = 16 << 10;

/// Turns a token into who holds it, or the reason it is refused (never echoing it).
pub type Authenticate = Arc<dyn Fn(&str) -> Result<Arc<Identity>, &'static str> + Send + Sync>;

/// How the pages sign people in.
#[derive(Clone)]
pub struct Login {
    pub authenticate: Authenticate,
    /// Mark the cookie `Secure` (the HTTP port serves TLS).
    pub secure: bool,
    /// `[auth] anonymous`: who a browser without a token is (None: it must sign in).
    pub anonymous: Option<Arc<Identity>>,
}

/// The sign-in form; `message` says why it is shown again.
pub fn page(next: &str, message: Option<&str>) -> Markup {
    layout(
        "Sign in",
        html! {
            h1 { "Sign in" }
            @if let Some(m) = message { p class="bad" { (m) } }
            p { "This gantry requires credentials. Paste a token from " code { "[auth]" }
                " (the one your Bazel sends as " code { "--remote_header=authorization=Bearer …" } ")." }
            form method="post" action="/login" {
                input type="hidden" name="next" value=(next);
                label { "Token " input type="password" name="token" size="60" autocomplete="current-password" autofocus; }
                " " button type="submit" { "Sign in" }
            }
        },
    )
}

/// Where to go after signing in: a path on this server, never another site.
pub fn safe_next(next: Option<String>) -> String {
    match next {
        Some(n) if n.starts_with('/') && !n.starts_with("//") && !n.contains('\\') && !n.starts_with("/login") => n,
        _ => "/".into(),
    }
}

fn cookie_of(req: &Request) -> Option<String> {
    req.headers().get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(';')).find_map(
        |pair| {
            let (k, v) = pair.trim().split_once('=')?;
            (k == COOKIE).then(|| crate::percent_decode(v).ok()).flatten()
        },
    )
}

/// Who is asking: the cookie's identity, or a redirect to the sign-in form.
pub(crate) async fn require(State(login): State<Option<Arc<Login>>>, mut req: Request, next: Next) -> Response {
    let Some(login) = login else {
        req.extensions_mut().insert(Caller::Unrestricted);
        return next.run(req).await;
    };
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str()).to_string();
    match cookie_of(&req).map(|t| (login.authenticate)(&t)) {
        Some(Ok(id)) => {
            req.extensions_mut().insert(Caller::Identity(id));
            next.run(req).await
        }
        Some(Err(_)) => {
            // A token revoked since it was stored: sign in again, and drop the stale cookie.
            let mut resp = Redirect::to(&format!("/login?next={}", percent_encode(&path))).into_response();
            if let Ok(v) = clear_cookie(login.secure).parse() {
                resp.headers_mut().insert(header::SET_COOKIE, v);
            }
            resp
        }
        None => match &login.anonymous {
            Some(anon) => {
                req.extensions_mut().insert(Caller::Identity(anon.clone()));
                next.run(req).await
            }
            None => Redirect::to(&format!("/login?next={}", percent_encode(&path))).into_response(),
        },
    }
}

fn set_cookie(token: &str, secure: bool) -> String {
    format!(
        "{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict; Max-Age={COOKIE_MAX_AGE_S}{}",
        percent_encode(token),
        if secure { "; Secure" } else { "" }
    )
}

fn clear_cookie(secure: bool) -> String {
    format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0{}", if secure { "; Secure" } else { "" })
}

pub(crate) async fn form(
    State(login): State<Option<Arc<Login>>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    if login.is_none() {
        return Redirect::to("/").into_response();
    }
    page(&safe_next(query_param(query.as_deref(), "next").ok().flatten()), None).into_response()
}

/// The form's POST: a valid token sets the cookie and goes on; any other answer is 401
/// with the form again, saying only that the token was not accepted.
pub(crate) async fn submit(State(login): State<Option<Arc<Login>>>, body: axum::body::Bytes) -> Response {
    let Some(login) = login else { return Redirect::to("/").into_response() };
    if body.len() > MAX_FORM {
        return (StatusCode::PAYLOAD_TOO_LARGE, page("/", Some("The form is too large."))).into_response();
    }
    let body = String::from_utf8_lossy(&body);
    let next = safe_next(query_param(Some(&body), "next").ok().flatten());
    let token = query_param(Some(&body), "token").ok().flatten().unwrap_or_default();
    let token = token.trim();
    if token.is_empty() {
        return (StatusCode::UNAUTHORIZED, page(&next, Some("Enter a token."))).into_response();
    }
    match (login.authenticate)(token) {
        Ok(id) => {
            tracing::info!(identity = %id.name, "signed in to the web UI");
            let mut resp = Redirect::to(&next).into_response();
            if let Ok(v) = set_cookie(token, login.secure).parse() {
                resp.headers_mut().insert(header::SET_COOKIE, v);
            }
            resp
        }
        Err(_) => (StatusCode::UNAUTHORIZED, page(&next, Some("That token was not accepted."))).into_response(),
    }
}

pub(crate) async fn logout(State(login): State<Option<Arc<Login>>>) -> Response {
    let secure = login.as_ref().is_some_and(|l| l.secure);
    let mut resp = Redirect::to("/login").into_response();
    if let Ok(v) = clear_cookie(secure).parse() {
        resp.headers_mut().insert(header::SET_COOKIE, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_local_paths_are_followed_after_signing_in() {
        assert_eq!(safe_next(Some("/actions/x?instance=a".into())), "/actions/x?instance=a");
        for bad in ["https://evil.example/", "//evil.example/x", "/\\evil", "evil", "/login?next=/"] {
            assert_eq!(safe_next(Some(bad.into())), "/", "{bad}");
        }
        assert_eq!(safe_next(None), "/");
    }

    #[test]
    fn the_cookie_keeps_the_token_intact_and_is_http_only() {
        let c = set_cookie("a b;c=d", true);
        assert!(c.starts_with("gantry_token=a%20b%3Bc%3Dd;"), "{c}");
        assert!(c.contains("HttpOnly") && c.contains("SameSite=Strict") && c.ends_with("Secure"));
        assert!(!set_cookie("t", false).contains("Secure"));
        let req = Request::builder()
            .header(header::COOKIE, "other=1; gantry_token=a%20b%3Bc%3Dd")
            .body(axum::body::Body::empty())
            .unwrap();
        assert_eq!(cookie_of(&req).as_deref(), Some("a b;c=d"));
    }

    #[test]
    fn the_form_never_shows_a_token() {
        let html = page("/x\"><script>", Some("That token was not accepted.")).into_string();
        assert!(!html.contains("<script>") && html.contains("type=\"password\""));
    }
}
