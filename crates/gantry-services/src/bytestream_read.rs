//! The zero-copy route for ByteStream Read: the store's buffers go to the socket as
//! they are.
//!
//! The generated service answers a Read with `ReadResponse { data: Vec<u8> }`, so each
//! chunk was copied out of the store's buffer into the message, and tonic's encoder then
//! copied the message into its frame buffer. Those two copies, with the zeroing of the
//! read buffer, were 30% of the server's CPU on 64 MiB reads (`perf`, 16 × 64 MiB read
//! by a grpcio client). Here each message goes out as two HTTP/2 data frames: a few
//! bytes of gRPC length prefix and protobuf field header, then the chunk itself, which
//! h2 hands to `writev` without copying it.
//!
//! [`ByteStreamRoutes`] is the `google.bytestream.ByteStream` service the server mounts.
//! It takes Read itself and passes Write and QueryWriteStatus to the generated server;
//! authentication and metrics layers wrap it like any other service.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::StreamExt;
use gantry_core::google::bytestream::byte_stream_server::ByteStreamServer;
use gantry_core::google::bytestream::ReadRequest;
use http_body::{Body as _, Frame};
use prost::Message;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::Status;

use crate::bytestream::{ByteStreamService, ReadChunks};

const READ_PATH: &str = "/google.bytestream.ByteStream/Read";

/// A ReadRequest holds a resource name and two integers; anything near this is not one.
const MAX_READ_REQUEST: usize = 64 << 10;

/// ByteStream protobuf: `ReadResponse.data` is field 10, length-delimited.
const READ_RESPONSE_DATA_TAG: u8 = (10 << 3) | 2;

/// The ByteStream service as mounted: Read on the zero-copy route, the other methods
/// through the generated server.
#[derive(Clone)]
pub struct ByteStreamRoutes {
    service: Arc<ByteStreamService>,
    generated: ByteStreamServer<ByteStreamService>,
}

impl ByteStreamRoutes {
    /// `configure` sets the generated server's limits (message sizes) for the methods
    /// it keeps.
    pub fn new(
        service: ByteStreamService,
        configure: impl FnOnce(ByteStreamServer<ByteStreamService>) -> ByteStreamServer<ByteStreamService>,
    ) -> Self {
        let service = Arc::new(service);
        let generated = configure(ByteStreamServer::from_arc(service.clone()));
        ByteStreamRoutes { service, generated }
    }
}

impl NamedService for ByteStreamRoutes {
    const NAME: &'static str = "google.bytestream.ByteStream";
}

impl tower::Service<http::Request<Body>> for ByteStreamRoutes {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if req.uri().path() != READ_PATH {
            return Box::pin(self.generated.call(req));
        }
        let service = self.service.clone();
        Box::pin(async move { Ok(read(&service, req).await.unwrap_or_else(Status::into_http)) })
    }
}

async fn read(service: &ByteStreamService, req: http::Request<Body>) -> Result<http::Response<Body>, Status> {
    let (parts, body) = req.into_parts();
    let message = read_request(body).await?;
    let chunks = service.open_read(tonic::Request::from_http(http::Request::from_parts(parts, message))).await?;
    let mut response = http::Response::new(Body::new(ReadBody { chunks, payload: None, done: false }));
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
    Ok(response)
}

/// The one ReadRequest of the call: the whole request body, bounded, as tonic's
/// generated servers take it (they too wait for the client to close its side).
async fn read_request(mut body: Body) -> Result<ReadRequest, Status> {
    let mut buf = BytesMut::new();
    while let Some(frame) = futures::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        let Ok(data) = frame?.into_data() else { continue };
        if buf.len() + data.len() > MAX_READ_REQUEST {
            return Err(Status::resource_exhausted(format!(
                "ReadRequest: more than {MAX_READ_REQUEST} bytes; a ReadRequest is a resource name and two integers"
            )));
        }
        buf.extend_from_slice(&data);
    }
    if buf.len() < 5 {
        return Err(Status::invalid_argument("ReadRequest: the request holds no complete gRPC message"));
    }
    if buf[0] != 0 {
        return Err(Status::unimplemented("ReadRequest: compressed request messages are not accepted"));
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if buf.len() < 5 + len {
        return Err(Status::invalid_argument(format!(
            "ReadRequest: the message is cut short ({} of its {len} bytes sent)",
            buf.len() - 5
        )));
    }
    if buf.len() > 5 + len {
        return Err(Status::invalid_argument(format!(
            "ReadRequest: a server-streaming call takes exactly one message ({} bytes sent after a {len}-byte message)",
            buf.len() - 5 - len
        )));
    }
    ReadRequest::decode(&buf[5..]).map_err(|e| Status::invalid_argument(format!("ReadRequest: {e}")))
}

/// The gRPC length prefix and the protobuf field header of a ReadResponse whose `data`
/// is `len` bytes; the data itself follows in its own frame.
fn message_head(len: usize) -> Bytes {
    let mut field = BytesMut::with_capacity(11);
    if len > 0 {
        // proto3 leaves an empty `data` out: an empty chunk is an empty message.
        field.put_u8(READ_RESPONSE_DATA_TAG);
        prost::encoding::encode_varint(len as u64, &mut field);
    }
    let mut head = BytesMut::with_capacity(5 + field.len());
    head.put_u8(0);
    head.put_u32((field.len() + len) as u32);
    head.put_slice(&field);
    head.freeze()
}

fn trailers(status: &Status) -> http::HeaderMap {
    let mut map = http::HeaderMap::new();
    if let Err(e) = status.add_header(&mut map) {
        // A message that cannot be a header value: send the code alone.
        map.clear();
        let _ = Status::new(status.code(), "").add_header(&mut map);
        tracing::warn!("ByteStream Read: status not sendable as trailers: {e}");
    }
    map
}

/// The response body: per chunk a head frame, then the chunk; then the status.
struct ReadBody {
    chunks: ReadChunks,
    /// The chunk whose head went out last, to go next.
    payload: Option<Bytes>,
    done: bool,
}

impl http_body::Body for ReadBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if let Some(payload) = this.payload.take() {
            return Poll::Ready(Some(Ok(Frame::data(payload))));
        }
        if this.done {
            return Poll::Ready(None);
        }
        match this.chunks.poll_next_unpin(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(chunk))) => {
                let head = message_head(chunk.len());
                if !chunk.is_empty() {
                    this.payload = Some(chunk);
                }
                Poll::Ready(Some(Ok(Frame::data(head))))
            }
            Poll::Ready(Some(Err(status))) => {
                this.done = true;
                Poll::Ready(Some(Ok(Frame::trailers(trailers(&status)))))
            }
            Poll::Ready(None) => {
                this.done = true;
                Poll::Ready(Some(Ok(Frame::trailers(trailers(&Status::ok(""))))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.payload.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_core::google::bytestream::ReadResponse;

    /// The head and the data together decode as the ReadResponse the generated service
    /// would have sent, for empty, one-byte-varint and multi-byte-varint lengths.
    #[test]
    fn a_head_and_its_chunk_are_one_read_response_on_the_wire() {
        for len in [0usize, 1, 127, 128, 300, 1 << 20] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            let mut wire = message_head(len).to_vec();
            wire.extend_from_slice(&data);
            let expected = ReadResponse { data: data.clone() }.encode_to_vec();
            assert_eq!(wire[0], 0, "uncompressed");
            assert_eq!(u32::from_be_bytes([wire[1], wire[2], wire[3], wire[4]]) as usize, expected.len(), "len {len}");
            assert_eq!(&wire[5..], &expected[..], "len {len}");
        }
    }
}
