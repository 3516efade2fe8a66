//! The one way a gantry process opens a gRPC channel to another gantry (or any REAPI
//! server): workers to their scheduler, frontends to the scheduler they forward to, and
//! every CLI command and benchmark. Addresses are written as Bazel writes them
//! (`grpc://host:port`); the transport settings live here, once.

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::{Error, Result};

/// The endpoint for `target` (`grpc://HOST:PORT`, or `http://` as tonic spells it).
pub fn endpoint(target: &str) -> Result<Endpoint> {
    let url = if let Some(rest) = target.strip_prefix("grpc://") {
        format!("http://{rest}")
    } else if target.starts_with("grpcs://") || target.starts_with("https://") {
        return Err(Error::invalid(format!(
            "{target}: TLS (grpcs://) is not supported by this gantry yet; use grpc:// on a trusted network"
        )));
    } else if target.starts_with("http://") {
        target.to_string()
    } else {
        return Err(Error::invalid(format!("{target}: expected grpc://HOST:PORT")));
    };
    let ep = Endpoint::from_shared(url).map_err(|e| Error::invalid(format!("{target}: {e}")))?;
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

/// A channel to `target` that connects on first use and reconnects by itself after the
/// peer restarts.
pub fn connect_lazy(target: &str) -> Result<Channel> {
    Ok(endpoint(target)?.connect_lazy())
}

/// A channel to `target`, connected now: an unreachable server is an error here.
pub async fn connect(target: &str) -> Result<Channel> {
    endpoint(target)?
        .connect()
        .await
        .map_err(|e| Error::Unavailable(format!("connecting to {target}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert!(endpoint("grpc://127.0.0.1:8980").is_ok());
        assert!(endpoint("http://127.0.0.1:8980").is_ok());
        assert!(endpoint("127.0.0.1:8980").unwrap_err().to_string().contains("grpc://"));
        assert!(endpoint("grpcs://h:1").unwrap_err().to_string().contains("TLS"));
    }

    #[tokio::test]
    async fn unreachable_is_unavailable() {
        let e = connect("grpc://127.0.0.1:1").await.unwrap_err();
        assert!(matches!(e, Error::Unavailable(_)), "{e}");
    }
}
