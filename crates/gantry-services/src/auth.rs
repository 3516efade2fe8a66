//! Authentication of every gRPC call: the `authorization` header becomes a
//! [`Caller`](gantry_core::auth::Caller) in the request's extensions, or the call is
//! refused with UNAUTHENTICATED before any service sees it. Services then authorize with
//! `gantry_core::auth::require`, knowing the instance name the call is about.
//!
//! Tokens are kept by their SHA-256 only, as `gantry.toml` lists them: the server never
//! holds a client's secret, and a refusal says nothing about which tokens exist.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use gantry_config::AuthConfig;
use gantry_core::auth::{Caller, Grant, Identity, Permission, Principal};
use sha2::{Digest as _, Sha256};

/// The credentials `[auth]` accepts, ready to look up.
#[derive(Debug)]
pub struct Authenticator {
    /// By the token's SHA-256, raw: a lookup per call hashes and compares 32 bytes.
    by_sha256: HashMap<[u8; 32], Arc<Identity>>,
    jwt: Option<Jwt>,
    /// Identities of verified client certificates, by a DNS subject alternative name.
    by_dns_name: HashMap<String, Arc<Identity>>,
    anonymous: Option<Arc<Identity>>,
}

impl Authenticator {
    /// Builds the lookup from a validated `[auth]` section, reading the JWKS file if
    /// `[auth.jwt]` is set.
    pub fn load(cfg: &AuthConfig) -> gantry_core::Result<Authenticator> {
        let mut a = Self::new(cfg);
        if let Some(j) = &cfg.jwt {
            a.jwt = Some(Jwt::load(j, grants_of(cfg))?);
        }
        Ok(a)
    }

    /// Whether any identity comes from a client certificate, so requests without a token
    /// need their peer certificate read at all.
    fn knows_certificates(&self) -> bool {
        !self.by_dns_name.is_empty()
    }

    /// Builds the lookup from a validated `[auth]` section, without JWTs.
    pub fn new(cfg: &AuthConfig) -> Authenticator {
        let all = grants_of(cfg);
        // Validation guarantees every named grant is defined.
        let grant = |name: &str| all[name].clone();
        let mut by_sha256 = HashMap::new();
        for t in &cfg.tokens {
            let grants = t.grants.iter().map(|g| grant(g)).collect();
            let id = Identity { name: t.name.clone(), principal: Principal::Client, grants: Arc::new(grants) };
            by_sha256.insert(digest_key(&t.sha256), Arc::new(id));
        }
        for t in &cfg.workers.tokens {
            let id = Identity { name: t.name.clone(), principal: Principal::Worker, grants: Arc::new(vec![]) };
            by_sha256.insert(digest_key(&t.sha256), Arc::new(id));
        }
        let mut by_dns_name = HashMap::new();
        for c in &cfg.certificates {
            let grants = c.grants.iter().map(|g| grant(g)).collect();
            let id = Identity { name: c.name.clone(), principal: Principal::Client, grants: Arc::new(grants) };
            by_dns_name.insert(c.dns_name.to_ascii_lowercase(), Arc::new(id));
        }
        for c in &cfg.workers.certificates {
            let id = Identity { name: c.name.clone(), principal: Principal::Worker, grants: Arc::new(vec![]) };
            by_dns_name.insert(c.dns_name.to_ascii_lowercase(), Arc::new(id));
        }
        let anonymous = (!cfg.anonymous.is_empty()).then(|| {
            let permissions: BTreeSet<Permission> = cfg.anonymous.iter().filter_map(|p| Permission::parse(p)).collect();
            let grant = Grant { name: "anonymous".into(), instances: vec!["*".into()], permissions };
            Arc::new(Identity { name: "anonymous".into(), principal: Principal::Client, grants: Arc::new(vec![grant]) })
        });
        Authenticator { by_sha256, jwt: None, by_dns_name, anonymous }
    }

    /// Who sent `authorization` (the header's value, if any), over a connection whose
    /// verified client certificate carries `cert_dns_names`. A token decides when one is
    /// sent; else a configured certificate name; else the anonymous identity. The error
    /// is the message for UNAUTHENTICATED; it never repeats what the client sent.
    pub fn authenticate(
        &self,
        authorization: Option<&[u8]>,
        cert_dns_names: &[String],
    ) -> Result<Arc<Identity>, &'static str> {
        let Some(value) = authorization else {
            if let Some(id) = cert_dns_names.iter().find_map(|n| self.by_dns_name.get(&n.to_ascii_lowercase())) {
                return Ok(id.clone());
            }
            return self
                .anonymous
                .clone()
                .ok_or("credentials required: send authorization: Bearer TOKEN, or a client certificate gantry knows");
        };
        let value = std::str::from_utf8(value).map_err(|_| "malformed authorization header")?;
        let (scheme, token) =
            value.trim().split_once(' ').ok_or("malformed authorization header: expected Bearer TOKEN")?;
        let token = token.trim();
        if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() || token.len() > 4096 {
            return Err("malformed authorization header: expected Bearer TOKEN");
        }
        if let Some(jwt) = &self.jwt
            && token.starts_with("eyJ")
            && token.matches('.').count() == 2
        {
            return jwt.verify(token).ok_or("invalid credentials");
        }
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.by_sha256.get(&hash).cloned().ok_or("invalid credentials")
    }
}

/// JWT verification: the keys of the JWKS file by key id, and what a token must say.
struct Jwt {
    keys: HashMap<String, (jsonwebtoken::DecodingKey, jsonwebtoken::Algorithm)>,
    issuer: String,
    audience: String,
    grants_claim: String,
    name_claim: String,
    grants: HashMap<String, Grant>,
}

impl std::fmt::Debug for Jwt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jwt").field("keys", &self.keys.len()).field("issuer", &self.issuer).finish()
    }
}

impl Jwt {
    fn load(cfg: &gantry_config::JwtConfig, grants: HashMap<String, Grant>) -> gantry_core::Result<Jwt> {
        use gantry_core::Error;
        let text = std::fs::read_to_string(&cfg.jwks)
            .map_err(|e| Error::io(format!("auth.jwt.jwks {}", cfg.jwks.display()), e))?;
        let set: jsonwebtoken::jwk::JwkSet = serde_json::from_str(&text)
            .map_err(|e| Error::invalid(format!("auth.jwt.jwks {}: not a JWKS: {e}", cfg.jwks.display())))?;
        let mut keys = HashMap::new();
        for (i, k) in set.keys.iter().enumerate() {
            let kid = k
                .common
                .key_id
                .clone()
                .ok_or_else(|| Error::invalid(format!("auth.jwt.jwks: keys[{i}] has no kid")))?;
            let alg = match &k.algorithm {
                jsonwebtoken::jwk::AlgorithmParameters::EllipticCurve(p) => match p.curve {
                    jsonwebtoken::jwk::EllipticCurve::P256 => jsonwebtoken::Algorithm::ES256,
                    jsonwebtoken::jwk::EllipticCurve::P384 => jsonwebtoken::Algorithm::ES384,
                    _ => return Err(Error::invalid(format!("auth.jwt.jwks: key {kid}: unsupported curve"))),
                },
                jsonwebtoken::jwk::AlgorithmParameters::RSA(_) => jsonwebtoken::Algorithm::RS256,
                jsonwebtoken::jwk::AlgorithmParameters::OctetKeyPair(_) => jsonwebtoken::Algorithm::EdDSA,
                // Shared secrets would put a secret in a file every server reads.
                jsonwebtoken::jwk::AlgorithmParameters::OctetKey(_) => {
                    return Err(Error::invalid(format!("auth.jwt.jwks: key {kid}: symmetric keys are not accepted")));
                }
            };
            let key = jsonwebtoken::DecodingKey::from_jwk(k)
                .map_err(|e| Error::invalid(format!("auth.jwt.jwks: key {kid}: {e}")))?;
            keys.insert(kid, (key, alg));
        }
        if keys.is_empty() {
            return Err(Error::invalid(format!("auth.jwt.jwks {}: no keys", cfg.jwks.display())));
        }
        Ok(Jwt {
            keys,
            issuer: cfg.issuer.clone(),
            audience: cfg.audience.clone(),
            grants_claim: cfg.grants_claim.clone(),
            name_claim: cfg.name_claim.clone(),
            grants,
        })
    }

    /// The identity a valid token names; None for any fault (signature, key, issuer,
    /// audience, expiry, shape), which the caller reports without detail.
    fn verify(&self, token: &str) -> Option<Arc<Identity>> {
        let header = jsonwebtoken::decode_header(token).ok()?;
        let (key, alg) = self.keys.get(header.kid.as_deref()?)?;
        if header.alg != *alg {
            return None;
        }
        let mut v = jsonwebtoken::Validation::new(*alg);
        v.set_issuer(&[&self.issuer]);
        v.set_audience(&[&self.audience]);
        v.set_required_spec_claims(&["exp", "iss", "aud"]);
        v.leeway = 30;
        let data = jsonwebtoken::decode::<serde_json::Value>(token, key, &v).ok()?;
        let name = data.claims.get(&self.name_claim).and_then(|n| n.as_str()).unwrap_or("jwt").to_string();
        let grants = data
            .claims
            .get(&self.grants_claim)
            .and_then(|g| g.as_array())
            .map(|names| names.iter().filter_map(|n| self.grants.get(n.as_str()?).cloned()).collect())
            .unwrap_or_default();
        Some(Arc::new(Identity { name, principal: Principal::Client, grants: Arc::new(grants) }))
    }
}

/// The grants of `[auth.grants.*]` by name.
fn grants_of(cfg: &AuthConfig) -> HashMap<String, Grant> {
    cfg.grants
        .iter()
        .map(|(name, g)| {
            let permissions = g.permissions.iter().filter_map(|p| Permission::parse(p)).collect();
            (name.clone(), Grant { name: name.clone(), instances: g.instances.clone(), permissions })
        })
        .collect()
}

/// The SHA-256 line `[[auth.tokens]]` wants for `token`.
/// A configured `sha256` (64 hex digits, checked by config validation) as raw bytes.
fn digest_key(hex_digits: &str) -> [u8; 32] {
    let mut key = [0u8; 32];
    hex::decode_to_slice(hex_digits, &mut key).expect("[auth] validation checks sha256 is 64 hex digits");
    key
}

pub fn token_sha256(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// The DNS names of the client certificate the TLS layer verified for this connection.
fn peer_dns_names<B>(req: &http::Request<B>) -> Vec<String> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let Some(certs) = req.extensions().get::<TlsConnectInfo<TcpConnectInfo>>().and_then(|i| i.peer_certs()) else {
        return vec![];
    };
    let Some(leaf) = certs.first() else { return vec![] };
    match webpki::EndEntityCert::try_from(leaf) {
        Ok(cert) => cert.valid_dns_names().map(str::to_string).collect(),
        Err(_) => vec![],
    }
}

/// Marks every request with its caller (`Unrestricted` without `[auth]`), or answers
/// UNAUTHENTICATED.
#[derive(Clone)]
pub struct AuthLayer(pub Option<Arc<Authenticator>>);

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AuthService { inner, auth: self.0.clone() }
    }
}

#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    auth: Option<Arc<Authenticator>>,
}

impl<S, B> tower::Service<http::Request<B>> for AuthService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>> + Send,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let caller = match &self.auth {
            None => Caller::Unrestricted,
            Some(auth) => {
                let header = req.headers().get(http::header::AUTHORIZATION).map(|v| v.as_bytes());
                // Parsing the peer certificate is only worth it when it may decide.
                let names = if header.is_none() && auth.knows_certificates() { peer_dns_names(&req) } else { vec![] };
                match auth.authenticate(header, &names) {
                    Ok(id) => Caller::Identity(id),
                    Err(why) => {
                        let res = tonic::Status::unauthenticated(why).into_http();
                        return Box::pin(async move { Ok(res) });
                    }
                }
            }
        };
        req.extensions_mut().insert(caller);
        Box::pin(self.inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_config::{GrantConfig, TokenConfig, WorkerAuthConfig, WorkerTokenConfig};
    use proptest::prelude::*;

    fn config() -> AuthConfig {
        let mut grants = std::collections::BTreeMap::new();
        grants.insert(
            "dev".to_string(),
            GrantConfig { instances: vec!["dev/*".into()], permissions: vec!["read".into()] },
        );
        AuthConfig {
            anonymous: vec![],
            tokens: vec![TokenConfig {
                name: "dev".into(),
                sha256: token_sha256("s3cret-dev").to_uppercase(),
                grants: vec!["dev".into()],
            }],
            grants,
            certificates: vec![],
            jwt: None,
            workers: WorkerAuthConfig {
                tokens: vec![WorkerTokenConfig { name: "pool".into(), sha256: token_sha256("s3cret-worker") }],
                certificates: vec![],
            },
        }
    }

    #[test]
    fn tokens_by_hash() {
        let a = Authenticator::new(&config());
        let id = a.authenticate_token(Some(b"Bearer s3cret-dev")).unwrap();
        assert_eq!((id.name.as_str(), id.principal), ("dev", Principal::Client));
        assert!(id.check(Permission::Read, "dev/x").is_ok() && id.check(Permission::Read, "main").is_err());
        assert_eq!(a.authenticate_token(Some(b"bearer   s3cret-worker ")).unwrap().principal, Principal::Worker);
        assert_eq!(a.authenticate_token(Some(b"Bearer wrong")).unwrap_err(), "invalid credentials");
        assert!(a.authenticate_token(None).unwrap_err().contains("credentials required"));
        assert!(a.authenticate_token(Some(b"Basic abc")).unwrap_err().contains("malformed"));
        let mut anon = config();
        anon.anonymous = vec!["read".into()];
        let a = Authenticator::new(&anon);
        let id = a.authenticate_token(None).unwrap();
        assert!(id.check(Permission::Read, "main").is_ok() && id.check(Permission::WriteCas, "main").is_err());
        assert!(a.authenticate_token(Some(b"Bearer wrong")).is_err(), "a bad token is not anonymous");
    }

    impl Authenticator {
        fn authenticate_token(&self, authorization: Option<&[u8]>) -> Result<Arc<Identity>, &'static str> {
            self.authenticate(authorization, &[])
        }
    }

    #[test]
    fn certificate_names() {
        let mut cfg = config();
        cfg.certificates = vec![gantry_config::CertificateConfig {
            name: "ci-runner".into(),
            dns_name: "CI.build.test".into(),
            grants: vec!["dev".into()],
        }];
        let a = Authenticator::new(&cfg);
        let names = vec!["other.test".to_string(), "ci.build.test".to_string()];
        assert_eq!(a.authenticate(None, &names).unwrap().name, "ci-runner");
        assert_eq!(a.authenticate(Some(b"Bearer s3cret-dev"), &names).unwrap().name, "dev", "a token takes precedence");
        assert!(a.authenticate(None, &["unknown.test".to_string()]).is_err());
    }

    /// A JWKS with one P-256 key, and a signer for tokens with chosen claims.
    fn jwt_setup(dir: &std::path::Path) -> (AuthConfig, impl Fn(serde_json::Value, &str) -> String) {
        use base64::Engine as _;
        let key = rcgen::KeyPair::generate().unwrap();
        let raw = key.public_key_raw();
        let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
        let jwks = serde_json::json!({"keys": [{"kty": "EC", "crv": "P-256", "kid": "k1", "alg": "ES256", "x": b64(&raw[1..33]), "y": b64(&raw[33..65])}]});
        std::fs::write(dir.join("jwks.json"), jwks.to_string()).unwrap();
        let mut cfg = config();
        cfg.jwt = Some(gantry_config::JwtConfig {
            jwks: dir.join("jwks.json"),
            issuer: "https://ci.test".into(),
            audience: "gantry".into(),
            grants_claim: "gantry_grants".into(),
            name_claim: "sub".into(),
        });
        let pem = key.serialize_pem();
        let sign = move |claims: serde_json::Value, kid: &str| {
            let mut h = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
            h.kid = Some(kid.to_string());
            jsonwebtoken::encode(&h, &claims, &jsonwebtoken::EncodingKey::from_ec_pem(pem.as_bytes()).unwrap()).unwrap()
        };
        (cfg, sign)
    }

    #[test]
    fn jwts_are_verified() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sign) = jwt_setup(dir.path());
        let a = Authenticator::load(&cfg).unwrap();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let claims = |iss: &str, aud: &str, exp: u64| serde_json::json!({"sub": "build-42", "iss": iss, "aud": aud, "exp": exp, "gantry_grants": ["dev", "unknown"]});
        let bearer = |t: String| format!("Bearer {t}").into_bytes();
        let id =
            a.authenticate_token(Some(&bearer(sign(claims("https://ci.test", "gantry", now + 300), "k1")))).unwrap();
        assert_eq!(id.name, "build-42");
        assert!(
            id.check(Permission::Read, "dev/x").is_ok() && id.check(Permission::Read, "main").is_err(),
            "grants from the claim"
        );
        for (why, token) in [
            ("expired", sign(claims("https://ci.test", "gantry", now - 300), "k1")),
            ("wrong issuer", sign(claims("https://evil.test", "gantry", now + 300), "k1")),
            ("wrong audience", sign(claims("https://ci.test", "other", now + 300), "k1")),
            ("unknown key", sign(claims("https://ci.test", "gantry", now + 300), "k2")),
        ] {
            assert_eq!(a.authenticate_token(Some(&bearer(token))).unwrap_err(), "invalid credentials", "{why}");
        }
        // A signature made by another key under the same kid.
        let dir2 = tempfile::tempdir().unwrap();
        let (_, other_sign) = jwt_setup(dir2.path());
        let forged = other_sign(claims("https://ci.test", "gantry", now + 300), "k1");
        assert_eq!(a.authenticate_token(Some(&bearer(forged))).unwrap_err(), "invalid credentials", "bad signature");
        // A tampered payload.
        let good = sign(claims("https://ci.test", "gantry", now + 300), "k1");
        let mut parts: Vec<String> = good.split('.').map(str::to_string).collect();
        parts[1] = parts[1].chars().rev().collect();
        assert!(a.authenticate_token(Some(&bearer(parts.join(".")))).is_err());
    }

    proptest! {
        /// Whatever bytes a client sends as its authorization header, the answer is a
        /// refusal (never a panic), unless they spell a configured token.
        #[test]
        fn malformed_headers_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let a = Authenticator::new(&config());
            let r = a.authenticate_token(Some(&bytes));
            let text = String::from_utf8_lossy(&bytes);
            prop_assert!(r.is_err() || text.contains("s3cret-"));
        }

        #[test]
        fn bearer_with_random_tokens_is_refused(token in "[ -~]{0,100}") {
            let a = Authenticator::new(&config());
            let header = format!("Bearer {token}");
            prop_assume!(!token.contains("s3cret-"));
            prop_assert!(a.authenticate_token(Some(header.as_bytes())).is_err());
        }
    }
}
