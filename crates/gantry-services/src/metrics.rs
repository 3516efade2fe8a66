//! Prometheus metrics: per-RPC request counts and latencies (a tower layer around the
//! gRPC server), payload bytes in and out, action cache hits and misses, and the CAS size
//! (read from the store at scrape time, so it is never stale).
//!
//! The same layer puts the two statuses the transport makes before a service runs in the
//! client's terms (`client_fault_status`): undecodable requests are INVALID_ARGUMENT, and
//! oversized ones RESOURCE_EXHAUSTED.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use gantry_core::BlobStore;
use prometheus::{Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    latency: HistogramVec,
    pub bytes_received: IntCounter,
    pub bytes_sent: IntCounter,
    pub ac_hits: IntCounter,
    pub ac_misses: IntCounter,
    cas_used: IntGauge,
    cas_max: IntGauge,
    cas_blobs: IntGauge,
    cas: Arc<dyn BlobStore>,
}

impl Metrics {
    pub fn new(cas: Arc<dyn BlobStore>) -> Arc<Self> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("gantry_grpc_requests_total", "gRPC requests by method and status code"),
            &["method", "code"],
        )
        .expect("valid metric");
        let latency = HistogramVec::new(
            HistogramOpts::new("gantry_grpc_request_duration_seconds", "gRPC time to response headers by method")
                .buckets(vec![0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
            &["method"],
        )
        .expect("valid metric");
        let c = |name: &str, help: &str| IntCounter::new(name, help).expect("valid metric");
        let g = |name: &str, help: &str| IntGauge::new(name, help).expect("valid metric");
        let m = Metrics {
            requests,
            latency,
            bytes_received: c("gantry_cas_bytes_received_total", "Blob bytes received by CAS and ByteStream writes"),
            bytes_sent: c("gantry_cas_bytes_sent_total", "Blob bytes sent by CAS and ByteStream reads"),
            ac_hits: c("gantry_action_cache_hits_total", "GetActionResult calls that returned a result"),
            ac_misses: c("gantry_action_cache_misses_total", "GetActionResult calls that returned NOT_FOUND"),
            cas_used: g("gantry_cas_used_bytes", "Bytes held by the CAS"),
            cas_max: g("gantry_cas_max_bytes", "CAS capacity before eviction"),
            cas_blobs: g("gantry_cas_blobs", "Blobs held by the CAS"),
            registry,
            cas,
        };
        for col in [
            Box::new(m.requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.latency.clone()),
            Box::new(m.bytes_received.clone()),
            Box::new(m.bytes_sent.clone()),
            Box::new(m.ac_hits.clone()),
            Box::new(m.ac_misses.clone()),
            Box::new(m.cas_used.clone()),
            Box::new(m.cas_max.clone()),
            Box::new(m.cas_blobs.clone()),
        ] {
            m.registry.register(col).expect("metric names are unique");
        }
        Arc::new(m)
    }

    /// Renders every metric in the Prometheus text format.
    pub fn render(&self) -> String {
        let u = self.cas.usage();
        self.cas_used.set(u.used_bytes as i64);
        self.cas_max.set(u.max_bytes as i64);
        self.cas_blobs.set(u.blobs as i64);
        let mut buf = Vec::new();
        prometheus::TextEncoder::new().encode(&self.registry.gather(), &mut buf).expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }

    /// The registry, so other services (the scheduler, later) can add their metrics.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }
}

/// Tower layer that records each gRPC call's method, status code and latency.
const KNOWN_SERVICE_PREFIXES: [&str; 3] = ["/build.bazel.remote.execution.v2.", "/google.bytestream.", "/gantry."];

#[derive(Clone)]
pub struct MetricsLayer(pub Arc<Metrics>);

impl<S> tower::Layer<S> for MetricsLayer {
    type Service = MetricsService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        MetricsService { inner, metrics: self.0.clone() }
    }
}

#[derive(Clone)]
pub struct MetricsService<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S, B> tower::Service<http::Request<B>> for MetricsService<S>
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

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        // "/build.bazel.remote.execution.v2.ContentAddressableStorage/FindMissingBlobs" -> short
        // form. Only our own services get a label of their own: the path comes from the
        // client, and arbitrary paths must not create unbounded metric series.
        let path = req.uri().path();
        let known = KNOWN_SERVICE_PREFIXES.iter().any(|p| path.starts_with(p));
        let method = match path.rsplit('/').take(2).collect::<Vec<_>>().as_slice() {
            [m, svc] if known && m.len() <= 64 => format!("{}/{}", svc.rsplit('.').next().unwrap_or(svc), m),
            _ => "unknown".to_string(),
        };
        let metrics = self.metrics.clone();
        let start = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let mut res = fut.await;
            if let Ok(r) = &mut res {
                client_fault_status(r.headers_mut());
            }
            // The status may also come in the trailers, after the response headers.
            let res = res.map(|r| r.map(|b| tonic::body::Body::new(FixTrailers(b))));
            // Errors before the body are sent "trailers-only", with grpc-status in the
            // headers; a successful call carries its status in the trailers.
            let code = match &res {
                Ok(r) => r
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|s| s.parse::<i32>().ok())
                    .map_or("OK", |c| code_name(c)),
                Err(_) => "TRANSPORT_ERROR",
            };
            metrics.latency.with_label_values(&[&method]).observe(start.elapsed().as_secs_f64());
            metrics.requests.with_label_values(&[&method, code]).inc();
            res
        })
    }
}

/// Puts in REAPI's terms the statuses the transport makes before a service sees the
/// request (sent "trailers-only", in the headers): a body that is not the method's message
/// is the client's INVALID_ARGUMENT, not the INTERNAL tonic reports, and a message over
/// the size limit is RESOURCE_EXHAUSTED, as the gRPC status table says, naming what to do,
/// not a bare OUT_OF_RANGE.
fn client_fault_status(headers: &mut http::HeaderMap) {
    // Every response passes here: only a status the transport makes is looked at further.
    let code = match headers.get("grpc-status").map(|v| v.as_bytes()) {
        Some(b"13") => tonic::Code::Internal,
        Some(b"11") => tonic::Code::OutOfRange,
        _ => return,
    };
    let message = percent_decode(headers.get("grpc-message").map(|v| v.as_bytes()).unwrap_or(b""));
    let (code, message) = match code {
        tonic::Code::Internal if message.starts_with("failed to decode Protobuf message") => {
            (tonic::Code::InvalidArgument, format!("the request is not a valid message of this method ({message})"))
        }
        // Broken gRPC framing is the client's too: a stream that ends inside a message
        // (its length prefix claims more than was sent), a unary call without its
        // message, or the compressed flag on a message of a request that named no
        // grpc-encoding.
        tonic::Code::Internal if message.starts_with("Unexpected EOF decoding stream") => (
            tonic::Code::InvalidArgument,
            "the request stream ended inside a message: its gRPC length prefix claims more bytes than were sent"
                .to_string(),
        ),
        tonic::Code::Internal if message.starts_with("Missing request message") => (
            tonic::Code::InvalidArgument,
            "the request has no message: a unary method takes exactly one".to_string(),
        ),
        tonic::Code::Internal if message.contains("compressed-flag but no grpc-encoding") => (
            tonic::Code::InvalidArgument,
            "a message has the gRPC compressed flag set, but the request names no grpc-encoding".to_string(),
        ),
        tonic::Code::OutOfRange if message.contains("decoded message length too large") => (
            tonic::Code::ResourceExhausted,
            format!(
                "{message}: keep batches under the max_batch_total_size_bytes that GetCapabilities reports, and send larger blobs with ByteStream"
            ),
        ),
        _ => return,
    };
    headers.insert("grpc-status", http::HeaderValue::from(code as i32));
    if let Ok(v) = http::HeaderValue::from_str(&percent_encode(&message)) {
        headers.insert("grpc-message", v);
    }
}

/// grpc-message is percent-encoded (gRPC's HTTP/2 mapping).
fn percent_decode(raw: &[u8]) -> String {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (raw[i], raw.get(i + 1).copied().and_then(hex), raw.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Encodes what gRPC requires: bytes outside printable ASCII, and '%'.
fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A response body whose trailers pass through `client_fault_status`.
struct FixTrailers(tonic::body::Body);

impl http_body::Body for FixTrailers {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        match Pin::new(&mut self.0).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_trailers() {
                Ok(mut trailers) => {
                    client_fault_status(&mut trailers);
                    Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers))))
                }
                Err(frame) => Poll::Ready(Some(Ok(frame))),
            },
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.0.size_hint()
    }
}

fn code_name(c: i32) -> &'static str {
    match tonic::Code::from_i32(c) {
        tonic::Code::Ok => "OK",
        tonic::Code::Cancelled => "CANCELLED",
        tonic::Code::Unknown => "UNKNOWN",
        tonic::Code::InvalidArgument => "INVALID_ARGUMENT",
        tonic::Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        tonic::Code::NotFound => "NOT_FOUND",
        tonic::Code::AlreadyExists => "ALREADY_EXISTS",
        tonic::Code::PermissionDenied => "PERMISSION_DENIED",
        tonic::Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        tonic::Code::FailedPrecondition => "FAILED_PRECONDITION",
        tonic::Code::Aborted => "ABORTED",
        tonic::Code::OutOfRange => "OUT_OF_RANGE",
        tonic::Code::Unimplemented => "UNIMPLEMENTED",
        tonic::Code::Internal => "INTERNAL",
        tonic::Code::Unavailable => "UNAVAILABLE",
        tonic::Code::DataLoss => "DATA_LOSS",
        tonic::Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_message_percent_coding_round_trips() {
        let raw = "failed to decode: 100% über";
        assert_eq!(percent_encode(raw), "failed to decode: 100%25 %C3%BCber");
        assert_eq!(percent_decode(percent_encode(raw).as_bytes()), raw);
        assert_eq!(percent_decode(b"a%20b%zz%4"), "a b%zz%4", "malformed escapes pass through");
    }

    #[test]
    fn only_transport_faults_are_rewritten() {
        let mut h = http::HeaderMap::new();
        h.insert("grpc-status", http::HeaderValue::from(13));
        h.insert("grpc-message", http::HeaderValue::from_static("disk%20on%20fire"));
        client_fault_status(&mut h);
        assert_eq!(h["grpc-status"], "13", "a real internal error stays one");
        h.insert("grpc-message", http::HeaderValue::from_static("failed%20to%20decode%20Protobuf%20message:%20x"));
        client_fault_status(&mut h);
        assert_eq!(h["grpc-status"], "3");
        for framing in [
            "Unexpected%20EOF%20decoding%20stream.",
            "Missing%20request%20message.",
            "protocol%20error:%20received%20message%20with%20compressed-flag%20but%20no%20grpc-encoding%20was%20specified",
        ] {
            h.insert("grpc-status", http::HeaderValue::from(13));
            h.insert("grpc-message", http::HeaderValue::from_static(framing));
            client_fault_status(&mut h);
            assert_eq!(h["grpc-status"], "3", "{framing}");
        }
    }
}
