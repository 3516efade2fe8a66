//! The one way a gantry process opens a gRPC channel to another gantry (or any REAPI
//! server): workers to their scheduler, frontends to the scheduler they forward to, and
//! every CLI command and benchmark. Addresses are written as Bazel writes them
//! (`grpc://host:port`); the transport settings live here, once.

use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::{Error, Result};

/// The endpoint for `target` (`grpc://HOST:PORT`, or `http://` as tonic spells it).
pub fn endpoint(target: &str) -> Result<Endpoint> {
    let (url, tls) = if let Some(rest) = target.strip_prefix("grpc://") {
        (format!("http://{rest}"), false)
    } else if let Some(rest) = target.strip_prefix("grpcs://") {
        (format!("https://{rest}"), true)
    } else if target.starts_with("https://") {
        (target.to_string(), true)
    } else if target.starts_with("http://") {
        (target.to_string(), false)
    } else {
        return Err(Error::invalid(format!("{target}: expected grpc://HOST:PORT or grpcs://HOST:PORT")));
    };
    let mut ep = Endpoint::from_shared(url).map_err(|e| Error::invalid(format!("{target}: {e}")))?;
    if tls {
        ep = ep.tls_config(client_tls()?).map_err(|e| Error::invalid(format!("{target}: TLS: {e}")))?;
    }
    Ok(ep
        .connect_timeout(Duration::from_secs(10))
        // Notice a peer that vanished (crashed host, cut network) within seconds, so a
        // stream to it ends with UNAVAILABLE instead of hanging.
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        .tcp_nodelay(true)
        // h2's default 64 KiB windows cap a large blob at one window per round trip.
        .initial_stream_window_size(Some(16 << 20))
        .initial_connection_window_size(Some(64 << 20)))
}

/// The credentials a gantry client presents: a bearer token from `GANTRY_TOKEN`, or from
/// the file named by `GANTRY_TOKEN_FILE` (first line), or none.
#[derive(Clone, Default)]
pub struct Credentials {
    authorization: Option<MetadataValue<Ascii>>,
}

impl std::fmt::Debug for Credentials {
    // Never print the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.authorization.is_some() { "Credentials(bearer token)" } else { "Credentials(none)" })
    }
}

impl Credentials {
    /// A bearer token.
    pub fn token(token: &str) -> Result<Credentials> {
        let token = token.trim();
        if token.is_empty() {
            return Err(Error::invalid("the token is empty"));
        }
        let mut v: MetadataValue<Ascii> = format!("Bearer {token}")
            .parse()
            .map_err(|_| Error::invalid("the token has characters a header cannot carry"))?;
        v.set_sensitive(true);
        Ok(Credentials { authorization: Some(v) })
    }

    /// From the environment (see the type's doc).
    pub fn from_env() -> Result<Credentials> {
        if let Ok(t) = std::env::var("GANTRY_TOKEN") {
            return Self::token(&t).map_err(|e| e.context("GANTRY_TOKEN"));
        }
        if let Ok(path) = std::env::var("GANTRY_TOKEN_FILE") {
            let text = std::fs::read_to_string(&path).map_err(|e| Error::io(format!("GANTRY_TOKEN_FILE {path}"), e))?;
            return Self::token(text.lines().next().unwrap_or(""))
                .map_err(|e| e.context(format_args!("GANTRY_TOKEN_FILE {path}")));
        }
        Ok(Credentials::default())
    }
}

impl tonic::service::Interceptor for Credentials {
    fn call(&mut self, mut req: tonic::Request<()>) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        // A call that carries its own credentials (a frontend forwarding its caller's)
        // keeps them.
        if let Some(v) = &self.authorization
            && !req.metadata().contains_key("authorization")
        {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A channel with the process's credentials on every call.
pub type GrpcChannel = InterceptedService<Channel, Credentials>;

/// TLS for `grpcs://`: the system's roots, plus the CA in `GANTRY_TLS_CA` (a PEM file), and
/// a client certificate from `GANTRY_TLS_CERT` and `GANTRY_TLS_KEY` for servers that
/// require one (mTLS).
fn client_tls() -> Result<tonic::transport::ClientTlsConfig> {
    let read = |var: &str| -> Result<Option<Vec<u8>>> {
        match std::env::var(var) {
            Ok(path) => std::fs::read(&path).map(Some).map_err(|e| Error::io(format!("{var} {path}"), e)),
            Err(_) => Ok(None),
        }
    };
    let mut tls = tonic::transport::ClientTlsConfig::new().with_native_roots();
    if let Some(ca) = read("GANTRY_TLS_CA")? {
        tls = tls.ca_certificate(tonic::transport::Certificate::from_pem(ca));
    }
    match (read("GANTRY_TLS_CERT")?, read("GANTRY_TLS_KEY")?) {
        (Some(cert), Some(key)) => tls = tls.identity(tonic::transport::Identity::from_pem(cert, key)),
        (None, None) => {}
        _ => return Err(Error::invalid("GANTRY_TLS_CERT and GANTRY_TLS_KEY go together")),
    }
    Ok(tls)
}

/// A channel to `target` that connects on first use and reconnects by itself after the
/// peer restarts, presenting the credentials of the environment.
pub fn connect_lazy(target: &str) -> Result<GrpcChannel> {
    Ok(InterceptedService::new(endpoint(target)?.connect_lazy(), Credentials::from_env()?))
}

/// A channel to `target`, connected now: an unreachable server is an error here.
pub async fn connect(target: &str) -> Result<GrpcChannel> {
    let channel =
        endpoint(target)?.connect().await.map_err(|e| Error::Unavailable(format!("connecting to {target}: {e}")))?;
    Ok(InterceptedService::new(channel, Credentials::from_env()?))
}

/// Reads a server stream to its end (its trailers) after the message the caller wanted,
/// within `grace`. Why: a stream dropped before its trailers arrive is reset, and if the
/// trailers come after h2 has forgotten the reset (it remembers only a few), it resets
/// the stream again as a protocol error; after 1,024 of those on one connection h2 closes
/// the whole connection (GOAWAY ENHANCE_YOUR_CALM), failing every call on it. A client
/// that runs thousands of Executes on one channel met that.
pub async fn finish_stream<T>(stream: &mut tonic::Streaming<T>, grace: std::time::Duration) {
    let _ = tokio::time::timeout(grace, async { while let Ok(Some(_)) = stream.message().await {} }).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert!(endpoint("grpc://127.0.0.1:8980").is_ok());
        assert!(endpoint("http://127.0.0.1:8980").is_ok());
        assert!(endpoint("127.0.0.1:8980").unwrap_err().to_string().contains("grpc://"));
        assert!(endpoint("grpcs://h:1").is_ok());
    }

    #[test]
    fn credentials_never_print_and_keep_a_forwarded_header() {
        use tonic::service::Interceptor;
        let mut c = Credentials::token(" abc123 ").unwrap();
        assert_eq!(format!("{c:?}"), "Credentials(bearer token)");
        let req = c.call(tonic::Request::new(())).unwrap();
        assert_eq!(req.metadata().get("authorization").unwrap(), "Bearer abc123");
        let mut forwarded = tonic::Request::new(());
        forwarded.metadata_mut().insert("authorization", "Bearer caller".parse().unwrap());
        assert_eq!(c.call(forwarded).unwrap().metadata().get("authorization").unwrap(), "Bearer caller");
        assert!(Credentials::token("  ").is_err());
        assert!(Credentials::token("a\nb").is_err());
    }

    #[tokio::test]
    async fn unreachable_is_unavailable() {
        let e = connect("grpc://127.0.0.1:1").await.unwrap_err();
        assert!(matches!(e, Error::Unavailable(_)), "{e}");
    }
}
