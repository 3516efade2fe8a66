//! gantry-loadgen owns `reapi-load`, a Remote Execution API v2 load generator for
//! comparing servers.
//!
//! It shares no code with gantry and depends on no gantry crate: the protocol comes from
//! `bazel-remote-apis`, the transport from tonic with its defaults. So the same binary
//! measures gantry, an older gantry and a peer the same way, and a figure it gives is a
//! client's view, not gantry's view of itself.
//!
//! * [`read_round`]: ByteStream reads of large blobs. The client counts the bytes of each
//!   response without decoding or hashing them, so that on a small machine it takes as
//!   little of the CPU as a gRPC client can and the server sets the pace.
//! * [`exec`]: no-op actions (each with its own salt, so none is a cache hit) through
//!   FindMissingBlobs, BatchUpdateBlobs and Execute, as Bazel sends them.
//!
//! Both report the client's CPU and, given the server's pid, the server's, per unit of
//! work, and the whole machine's (from /proc/stat), so a run shows who took the CPU.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bazel_remote_apis::build::bazel::remote::execution::v2 as re;
use bazel_remote_apis::google::bytestream::{byte_stream_client::ByteStreamClient, ReadRequest, WriteRequest};
use bazel_remote_apis::google::longrunning::operation;
use bytes::Buf;
use prost::Message;
use re::content_addressable_storage_client::ContentAddressableStorageClient;
use re::execution_client::ExecutionClient;
use sha2::{Digest as _, Sha256};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connecting to {target}: {source}")]
    Connect { target: String, source: tonic::transport::Error },
    #[error("{call}: {status}")]
    Call { call: String, status: tonic::Status },
    #[error("{0}")]
    Check(String),
}

pub type Result<T> = std::result::Result<T, Error>;

fn call(what: impl Into<String>) -> impl FnOnce(tonic::Status) -> Error {
    let call = what.into();
    move |status| Error::Call { call, status }
}

/// How to reach the server: TLS (an `https://` target) and a bearer token are optional.
#[derive(Debug, Clone, Default)]
pub struct ConnectOptions {
    /// PEM of the CA that signed the server's certificate; without it, the system's roots.
    pub ca_pem: Option<String>,
    /// Sent as `authorization: Bearer TOKEN` on every call.
    pub token: Option<String>,
}

/// A connection to the server; [`Conn::service`] is what the clients are built on.
#[derive(Clone)]
pub struct Conn {
    channel: Channel,
    bearer: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

/// The channel with the bearer token added to every request.
pub type Service = tonic::service::interceptor::InterceptedService<Channel, Bearer>;

/// Adds `authorization: Bearer TOKEN`, when there is one.
#[derive(Clone)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

impl Conn {
    pub fn service(&self) -> Service {
        tonic::service::interceptor::InterceptedService::new(self.channel.clone(), Bearer(self.bearer.clone()))
    }
}

/// Connects to `target` ("http://HOST:PORT", or "https://HOST:PORT" for TLS), with tonic's
/// default settings.
pub async fn connect(target: &str, options: &ConnectOptions) -> Result<Conn> {
    let mut endpoint =
        Endpoint::from_shared(target.to_string()).map_err(|e| Error::Check(format!("target {target:?}: {e}")))?;
    if target.starts_with("https://") {
        let tls = tonic::transport::ClientTlsConfig::new();
        let tls = match &options.ca_pem {
            Some(pem) => tls.ca_certificate(tonic::transport::Certificate::from_pem(pem)),
            None => tls.with_native_roots(),
        };
        endpoint = endpoint.tls_config(tls).map_err(|source| Error::Connect { target: target.to_string(), source })?;
    } else if options.ca_pem.is_some() {
        return Err(Error::Check(format!("a CA was given for {target:?}, which is not https://")));
    }
    let bearer = match &options.token {
        Some(t) => Some(
            format!("Bearer {t}").parse().map_err(|_| Error::Check("the token is not a valid header value".into()))?,
        ),
        None => None,
    };
    let channel = endpoint.connect().await.map_err(|source| Error::Connect { target: target.to_string(), source })?;
    Ok(Conn { channel, bearer })
}

/// CPU used per unit of work: this process, the server (when its pid is known) and the
/// whole machine.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    pub client: f64,
    pub server: Option<f64>,
    pub machine: f64,
}

impl Usage {
    /// "client X, server Y, machine Z UNIT".
    pub fn describe(&self, unit: &str) -> String {
        let server = self.server.map(|s| format!(", server {s:.3} {unit}")).unwrap_or_default();
        format!("client {:.3} {unit}{server}, machine {:.3} {unit}", self.client, self.machine)
    }
}

/// Reads CPU seconds at the start and end of a measured phase.
#[derive(Debug, Clone, Copy)]
pub struct Meter {
    pub server_pid: Option<u32>,
}

#[derive(Clone, Copy)]
struct Sample {
    at: Instant,
    client: f64,
    server: Option<f64>,
    machine: f64,
}

impl Meter {
    fn sample(&self) -> Sample {
        Sample {
            at: Instant::now(),
            client: proc_cpu("self").unwrap_or(0.0),
            server: self.server_pid.and_then(|p| proc_cpu(&p.to_string())),
            machine: machine_cpu().unwrap_or(0.0),
        }
    }

    /// CPU since `start` per `units` of work, times `scale`.
    fn usage(&self, start: Sample, units: f64, scale: f64) -> Usage {
        let end = self.sample();
        let per = |a: f64, b: f64| (b - a) / units.max(1e-9) * scale;
        Usage {
            client: per(start.client, end.client),
            server: start.server.zip(end.server).map(|(a, b)| per(a, b)),
            machine: per(start.machine, end.machine),
        }
    }
}

/// utime + stime of a process, in seconds.
fn proc_cpu(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / USER_HZ)
}

/// Busy CPU seconds of the whole machine (everything but idle and iowait).
fn machine_cpu() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu: Vec<f64> = stat.lines().next()?.split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    let busy: f64 = cpu.iter().take(8).sum::<f64>() - cpu.get(3)? - cpu.get(4)?;
    Some(busy / USER_HZ)
}

/// USER_HZ, the unit of /proc's CPU times: 100 on every Linux architecture.
const USER_HZ: f64 = 100.0;

/// Waits (up to 60 s) until the machine is idle: a server may still be writing what was
/// just uploaded back to disk, and reads measured during that measure the disk. False:
/// it did not go idle.
pub async fn settle() -> bool {
    let deadline = Instant::now() + std::time::Duration::from_secs(60);
    while Instant::now() < deadline {
        let before = machine_cpu().unwrap_or(0.0);
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        // Under a tenth of one core busy for a second.
        if machine_cpu().unwrap_or(0.0) - before < 0.1 {
            return true;
        }
    }
    false
}

/// A ByteStream Read response counted, not decoded: the length of its `data` field.
struct CountCodec;

struct CountDecoder;

struct BytesEncoder;

impl Codec for CountCodec {
    type Encode = Vec<u8>;
    type Decode = usize;
    type Encoder = BytesEncoder;
    type Decoder = CountDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        BytesEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        CountDecoder
    }
}

impl Encoder for BytesEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> std::result::Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl Decoder for CountDecoder {
    type Item = usize;
    type Error = tonic::Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> std::result::Result<Option<usize>, tonic::Status> {
        let total = src.remaining();
        // ReadResponse { bytes data = 10; }: tag 0x52, a varint length, the bytes.
        let head = src.chunk();
        let len = if total == 0 {
            0
        } else if head.first() == Some(&0x52) {
            let mut n = 0usize;
            for (i, b) in head.iter().skip(1).take(10).enumerate() {
                n |= ((b & 0x7f) as usize) << (7 * i);
                if b & 0x80 == 0 {
                    break;
                }
            }
            n
        } else {
            return Err(tonic::Status::internal("ReadResponse without a data field first"));
        };
        src.advance(total);
        Ok(Some(len))
    }
}

fn digest_of(data: &[u8]) -> re::Digest {
    re::Digest { hash: hex::encode(Sha256::digest(data)), size_bytes: data.len() as i64 }
}

fn resource(instance: &str, rest: &str) -> String {
    if instance.is_empty() {
        rest.to_string()
    } else {
        format!("{instance}/{rest}")
    }
}

/// Pseudo-random bytes (splitmix64): incompressible enough for a CAS, and cheap.
fn random_blob(size: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    let mut out = Vec::with_capacity(size + 8);
    while out.len() < size {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(size);
    out
}

/// Uploads `count` random blobs of `size` bytes through ByteStream and returns their
/// resource names for reading.
pub async fn upload_blobs(conn: &Conn, instance: &str, count: usize, size: usize) -> Result<Vec<String>> {
    if count == 0 || size == 0 {
        return Err(Error::Check("count and size must be positive".into()));
    }
    let seed = uuid::Uuid::new_v4().as_u64_pair().0;
    let mut names = Vec::with_capacity(count);
    let mut bs = ByteStreamClient::new(conn.service());
    for i in 0..count {
        let data = random_blob(size, seed ^ i as u64);
        let d = digest_of(&data);
        let upload = resource(instance, &format!("uploads/{}/blobs/{}/{}", uuid::Uuid::new_v4(), d.hash, d.size_bytes));
        let step = 1 << 20;
        let reqs: Vec<WriteRequest> = (0..size)
            .step_by(step)
            .map(|off| WriteRequest {
                resource_name: if off == 0 { upload.clone() } else { String::new() },
                write_offset: off as i64,
                finish_write: off + step >= size,
                data: data[off..(off + step).min(size)].to_vec(),
            })
            .collect();
        let resp = bs.write(futures::stream::iter(reqs)).await.map_err(call("ByteStream.Write"))?.into_inner();
        if resp.committed_size != size as i64 {
            return Err(Error::Check(format!("Write committed {} of {size} bytes", resp.committed_size)));
        }
        names.push(resource(instance, &format!("blobs/{}/{}", d.hash, d.size_bytes)));
    }
    Ok(names)
}

/// One round of reads: every blob in `names` (each `size` bytes) once, `concurrency`
/// at a time.
#[derive(Debug, Clone, Copy)]
pub struct ReadRound {
    pub bytes: u64,
    pub seconds: f64,
    /// CPU seconds per GiB read.
    pub usage: Usage,
}

impl ReadRound {
    pub fn mib_per_second(&self) -> f64 {
        self.bytes as f64 / (1 << 20) as f64 / self.seconds
    }
}

pub async fn read_round(
    conn: &Conn,
    names: &[String],
    size: usize,
    concurrency: usize,
    meter: Meter,
) -> Result<ReadRound> {
    let names = Arc::new(names.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let start = meter.sample();
    let counts = in_parallel(concurrency, || {
        let (service, names, next) = (conn.service(), names.clone(), next.clone());
        async move {
            let mut grpc = tonic::client::Grpc::new(service);
            let mut n = 0u64;
            while let Some(name) = names.get(next.fetch_add(1, Ordering::Relaxed)) {
                grpc.ready().await.map_err(|e| Error::Check(format!("channel: {e}")))?;
                let path = http::uri::PathAndQuery::from_static("/google.bytestream.ByteStream/Read");
                let req = ReadRequest { resource_name: name.clone(), read_offset: 0, read_limit: 0 }.encode_to_vec();
                let mut stream = grpc
                    .server_streaming(tonic::Request::new(req), path, CountCodec)
                    .await
                    .map_err(call(format!("Read {name}")))?
                    .into_inner();
                let mut got = 0;
                while let Some(len) = stream.message().await.map_err(call(format!("Read {name}")))? {
                    got += len;
                }
                if got != size {
                    return Err(Error::Check(format!("Read {name}: {got} of {size} bytes")));
                }
                n += got as u64;
            }
            Ok(n)
        }
    })
    .await?;
    let bytes: u64 = counts.iter().sum();
    let seconds = start.at.elapsed().as_secs_f64();
    let usage = meter.usage(start, bytes as f64 / (1u64 << 30) as f64, 1.0);
    Ok(ReadRound { bytes, seconds, usage })
}

/// Runs `concurrency` (at least one) tasks made by `task`, and their results in order.
async fn in_parallel<T, F, Fut>(concurrency: usize, task: F) -> Result<Vec<T>>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T>> + Send + 'static,
    T: Send + 'static,
{
    let tasks: Vec<_> = (0..concurrency.max(1)).map(|_| tokio::spawn(task())).collect();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.map_err(|e| Error::Check(format!("client task: {e}")))??);
    }
    Ok(out)
}

/// A run of no-op actions.
#[derive(Debug, Clone)]
pub struct ExecReport {
    pub actions: usize,
    /// Actions whose result was not a success with exit code 0.
    pub failed: usize,
    pub seconds: f64,
    pub p50: Duration,
    pub p99: Duration,
    /// CPU milliseconds per action.
    pub usage: Usage,
}

impl ExecReport {
    pub fn per_second(&self) -> f64 {
        self.actions as f64 / self.seconds
    }
}

/// Runs `actions` actions of `command`, `concurrency` at a time. Each action has its own
/// salt, so none is answered from the action cache.
pub async fn exec(
    conn: &Conn,
    instance: &str,
    actions: usize,
    concurrency: usize,
    command: &[String],
    meter: Meter,
) -> Result<ExecReport> {
    if command.is_empty() {
        return Err(Error::Check("the command is empty".into()));
    }
    let cmd = re::Command { arguments: command.to_vec(), ..Default::default() }.encode_to_vec();
    let root = re::Directory::default().encode_to_vec();
    let shared = Arc::new((digest_of(&cmd), cmd, digest_of(&root), root, uuid::Uuid::new_v4(), instance.to_string()));
    let next = Arc::new(AtomicUsize::new(0));
    let start = meter.sample();
    let runs = in_parallel(concurrency, || {
        let (conn, next, shared) = (conn.clone(), next.clone(), shared.clone());
        async move {
            let (cmd_digest, cmd, root_digest, root, run, instance) = &*shared;
            let mut cas = ContentAddressableStorageClient::new(conn.service());
            let mut execution = ExecutionClient::new(conn.service());
            let (mut latencies, mut failed) = (Vec::new(), 0);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= actions {
                    break;
                }
                let t0 = Instant::now();
                let action = re::Action {
                    command_digest: Some(cmd_digest.clone()),
                    input_root_digest: Some(root_digest.clone()),
                    timeout: Some(bazel_remote_apis::google::protobuf::Duration { seconds: 60, nanos: 0 }),
                    salt: format!("{run}-{i}").into_bytes(),
                    ..Default::default()
                }
                .encode_to_vec();
                let action_digest = digest_of(&action);
                let blobs = [(&action_digest, &action), (cmd_digest, cmd), (root_digest, root)];
                let missing = cas
                    .find_missing_blobs(re::FindMissingBlobsRequest {
                        instance_name: instance.clone(),
                        blob_digests: blobs.iter().map(|(d, _)| (*d).clone()).collect(),
                        digest_function: 0,
                    })
                    .await
                    .map_err(call("FindMissingBlobs"))?
                    .into_inner()
                    .missing_blob_digests;
                if !missing.is_empty() {
                    let requests = blobs
                        .iter()
                        .filter(|(d, _)| missing.contains(d))
                        .map(|(d, data)| re::batch_update_blobs_request::Request {
                            digest: Some((*d).clone()),
                            data: (*data).clone(),
                            compressor: 0,
                        })
                        .collect();
                    let resp = cas
                        .batch_update_blobs(re::BatchUpdateBlobsRequest {
                            instance_name: instance.clone(),
                            requests,
                            digest_function: 0,
                        })
                        .await
                        .map_err(call("BatchUpdateBlobs"))?
                        .into_inner();
                    if let Some(s) = resp.responses.iter().filter_map(|r| r.status.as_ref()).find(|s| s.code != 0) {
                        return Err(Error::Check(format!("BatchUpdateBlobs: code {} {}", s.code, s.message)));
                    }
                }
                let mut ops = execution
                    .execute(re::ExecuteRequest {
                        instance_name: instance.clone(),
                        action_digest: Some(action_digest),
                        ..Default::default()
                    })
                    .await
                    .map_err(call("Execute"))?
                    .into_inner();
                // Read the stream to its end (the trailers), as a client that keeps its
                // connection should: dropping it at the last Operation resets the stream,
                // and h2 closes a connection after 1,024 such resets.
                let mut ok = false;
                while let Some(op) = ops.message().await.map_err(call("Execute stream"))? {
                    if let Some(operation::Result::Response(any)) = op.result.filter(|_| op.done) {
                        let r = re::ExecuteResponse::decode(any.value.as_slice())
                            .map_err(|e| Error::Check(format!("ExecuteResponse: {e}")))?;
                        ok = r.status.as_ref().is_none_or(|s| s.code == 0)
                            && r.result.as_ref().is_some_and(|a| a.exit_code == 0);
                    }
                }
                failed += usize::from(!ok);
                latencies.push(t0.elapsed());
            }
            Ok((latencies, failed))
        }
    })
    .await?;
    let (mut latencies, mut failed) = (Vec::new(), 0);
    for (l, f) in runs {
        latencies.extend(l);
        failed += f;
    }
    let seconds = start.at.elapsed().as_secs_f64();
    let usage = meter.usage(start, latencies.len() as f64, 1e3);
    latencies.sort();
    let pct = |p: f64| latencies.get(((latencies.len() as f64 - 1.0) * p) as usize).copied().unwrap_or_default();
    Ok(ExecReport { actions: latencies.len(), failed, seconds, p50: pct(0.5), p99: pct(0.99), usage })
}
