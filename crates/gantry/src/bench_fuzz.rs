//! `gantry bench fuzz`: malformed requests, many of them, against a real server started
//! in this process, over HTTP/2 on loopback.
//!
//! Each request goes to one of the server's methods. Its message is random bytes, or a
//! valid message of that method mutated (bits flipped, cut short, bytes inserted, two
//! spliced, a length-delimited field claiming more than is there); one in ten is also
//! framed wrongly for gRPC (a length prefix longer or shorter than the message, the
//! compressed flag without an encoding, a prefix cut short, two messages to a unary
//! method). The requests are sent with the `h2` crate directly, because a gRPC client
//! cannot send a malformed frame.
//!
//! What counts as a failure: a panic anywhere in the process (the server runs here, so a
//! panic hook counts them), a request not answered within `--hang-after` (a hang), a
//! stream reset or a response without a `grpc-status`, and the codes that say the server
//! is at fault rather than the request (INTERNAL, UNKNOWN, DATA_LOSS). Methods that by
//! design wait for events (WatchBuilds, the queue's Watch, EnqueueTargets' stream) and
//! the ones that start work (TrainModels, Submit) are left out.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use gantry_core::google::bytestream::{QueryWriteStatusRequest, ReadRequest, WriteRequest};
use gantry_core::reapi;
use gantry_core::{Digest, DigestFunction};
use prost::Message;

#[derive(clap::Args)]
pub struct FuzzBenchArgs {
    /// Requests to send in all.
    #[arg(long, default_value_t = 100_000)]
    iterations: u64,
    /// Seed of the generator; a run with the same seed sends the same requests.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Requests in flight at once (over four connections).
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// A request not answered in this many seconds counts as a hang.
    #[arg(long, default_value_t = 10)]
    hang_after_secs: u64,
}

/// Panics anywhere in this process since the hook was installed.
static PANICS: AtomicU64 = AtomicU64::new(0);

/// How a method takes its messages: unary methods must refuse a second message.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    Unary,
    /// The client sends a stream (ByteStream Write, the BES stream).
    ClientStream,
}

struct Method {
    path: &'static str,
    shape: Shape,
    /// Valid messages of this method, the material mutations start from.
    samples: Vec<Vec<u8>>,
}

/// What one response said.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Answer {
    Code(i32),
    /// The server reset the stream or the connection.
    Reset(String),
    /// An HTTP response without a grpc-status (or not HTTP 200).
    NoStatus(u16),
    Hang,
}

impl Answer {
    fn is_failure(&self) -> bool {
        match self {
            // INTERNAL, UNKNOWN, DATA_LOSS: the server's fault, not the request's.
            Answer::Code(c) => matches!(*c, 2 | 13 | 15),
            _ => true,
        }
    }

    fn label(&self) -> String {
        match self {
            Answer::Code(c) => format!("{:?}", tonic::Code::from_i32(*c)),
            Answer::Reset(why) => format!("reset ({why})"),
            Answer::NoStatus(http) => format!("no grpc-status (HTTP {http})"),
            Answer::Hang => "hang".into(),
        }
    }
}

/// xorshift64*: small, fast and reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn digest(tag: &str) -> Digest {
    DigestFunction::Sha256.digest_of(tag.as_bytes())
}

/// The methods fuzzed, each with a few valid messages: digests of blobs that exist and
/// of ones that do not, names of the forms the server parses.
fn methods(present: &[Digest]) -> Vec<Method> {
    use gantry_proto::devtools_build::v1 as bes;
    let absent = digest("fuzz: absent");
    let some = |d: &Digest| Some(d.to_proto());
    let p = present[0];
    let m = |path: &'static str, shape: Shape, samples: Vec<Vec<u8>>| Method { path, shape, samples };
    let read_name = gantry_core::resource::read_name("", &p);
    let upload = gantry_core::resource::upload_name("main", "5b0e9b0e-5f2a-4d1c-9a57-5c8a1e0f7c11", &absent);
    let mut all = vec![
        m(
            "/build.bazel.remote.execution.v2.ContentAddressableStorage/FindMissingBlobs",
            Shape::Unary,
            vec![reapi::FindMissingBlobsRequest {
                blob_digests: vec![p.to_proto(), absent.to_proto()],
                ..Default::default()
            }
            .encode_to_vec()],
        ),
        m(
            "/build.bazel.remote.execution.v2.ContentAddressableStorage/BatchUpdateBlobs",
            Shape::Unary,
            vec![reapi::BatchUpdateBlobsRequest {
                requests: vec![reapi::batch_update_blobs_request::Request {
                    digest: some(&digest("x")),
                    data: b"x".to_vec(),
                    compressor: 0,
                }],
                ..Default::default()
            }
            .encode_to_vec()],
        ),
        m(
            "/build.bazel.remote.execution.v2.ContentAddressableStorage/BatchReadBlobs",
            Shape::Unary,
            vec![reapi::BatchReadBlobsRequest { digests: vec![p.to_proto(), absent.to_proto()], ..Default::default() }
                .encode_to_vec()],
        ),
        m(
            "/build.bazel.remote.execution.v2.ContentAddressableStorage/GetTree",
            Shape::Unary,
            vec![reapi::GetTreeRequest { root_digest: some(&p), page_size: 3, ..Default::default() }.encode_to_vec()],
        ),
        m(
            "/build.bazel.remote.execution.v2.ActionCache/GetActionResult",
            Shape::Unary,
            vec![reapi::GetActionResultRequest {
                action_digest: some(&p),
                inline_stdout: true,
                inline_output_files: vec!["a/b".into()],
                ..Default::default()
            }
            .encode_to_vec()],
        ),
        m(
            "/build.bazel.remote.execution.v2.ActionCache/UpdateActionResult",
            Shape::Unary,
            vec![reapi::UpdateActionResultRequest {
                action_digest: some(&absent),
                action_result: Some(reapi::ActionResult {
                    output_files: vec![reapi::OutputFile {
                        path: "out".into(),
                        digest: some(&p),
                        ..Default::default()
                    }],
                    stdout_digest: some(&p),
                    ..Default::default()
                }),
                ..Default::default()
            }
            .encode_to_vec()],
        ),
        m(
            "/build.bazel.remote.execution.v2.Capabilities/GetCapabilities",
            Shape::Unary,
            vec![reapi::GetCapabilitiesRequest { instance_name: "main".into() }.encode_to_vec()],
        ),
        m(
            "/build.bazel.remote.execution.v2.Execution/Execute",
            Shape::Unary,
            vec![reapi::ExecuteRequest { action_digest: some(&absent), ..Default::default() }.encode_to_vec()],
        ),
        m(
            "/build.bazel.remote.execution.v2.Execution/WaitExecution",
            Shape::Unary,
            vec![reapi::WaitExecutionRequest { name: "operations/5b0e9b0e-5f2a-4d1c-9a57-5c8a1e0f7c11".into() }
                .encode_to_vec()],
        ),
        m(
            "/google.longrunning.Operations/GetOperation",
            Shape::Unary,
            vec![gantry_core::google::longrunning::GetOperationRequest { name: "operations/x".into() }.encode_to_vec()],
        ),
        m(
            "/google.longrunning.Operations/ListOperations",
            Shape::Unary,
            vec![gantry_core::google::longrunning::ListOperationsRequest {
                page_size: 2,
                page_token: "7".into(),
                ..Default::default()
            }
            .encode_to_vec()],
        ),
        m(
            "/google.longrunning.Operations/CancelOperation",
            Shape::Unary,
            vec![gantry_core::google::longrunning::CancelOperationRequest { name: "operations/x".into() }
                .encode_to_vec()],
        ),
        m(
            "/google.longrunning.Operations/DeleteOperation",
            Shape::Unary,
            vec![gantry_core::google::longrunning::DeleteOperationRequest { name: "operations/x".into() }
                .encode_to_vec()],
        ),
        m(
            "/google.bytestream.ByteStream/Read",
            Shape::Unary,
            vec![ReadRequest { resource_name: read_name.clone(), read_offset: 1, read_limit: 2 }.encode_to_vec()],
        ),
        m(
            "/google.bytestream.ByteStream/Write",
            Shape::ClientStream,
            vec![
                WriteRequest {
                    resource_name: upload.clone(),
                    write_offset: 0,
                    finish_write: true,
                    data: b"x".to_vec(),
                }
                .encode_to_vec(),
                WriteRequest { resource_name: upload.clone(), write_offset: 0, finish_write: false, data: vec![7; 40] }
                    .encode_to_vec(),
            ],
        ),
        m(
            "/google.bytestream.ByteStream/QueryWriteStatus",
            Shape::Unary,
            vec![QueryWriteStatusRequest { resource_name: upload }.encode_to_vec()],
        ),
        m(
            "/google.devtools.build.v1.PublishBuildEvent/PublishBuildToolEventStream",
            Shape::ClientStream,
            vec![bes::PublishBuildToolEventStreamRequest::default().encode_to_vec()],
        ),
    ];
    // Methods fuzzed from the empty message (every field default) alone.
    for path in [
        "/google.devtools.build.v1.PublishBuildEvent/PublishLifecycleEvent",
        "/gantry.batch.v1.Batcher/GetBuild",
        "/gantry.batch.v1.Batcher/ListBuilds",
        "/gantry.queue.v1.SubmitQueue/GetStatus",
        "/gantry.queue.v1.SubmitQueue/Cancel",
        "/gantry.queue.v1.SubmitQueue/History",
    ] {
        all.push(m(path, Shape::Unary, vec![Vec::new()]));
    }
    all
}

/// A message for `method`: random, or one of its samples mutated.
fn message(rng: &mut Rng, method: &Method) -> Vec<u8> {
    let sample = &method.samples[rng.below(method.samples.len())];
    let mut m = sample.clone();
    match rng.below(8) {
        0 => {
            let n = rng.below(300);
            return rng.bytes(n);
        }
        1 => {
            for _ in 0..=rng.below(8) {
                if !m.is_empty() {
                    let i = rng.below(m.len());
                    m[i] ^= 1 << rng.below(8);
                }
            }
        }
        2 => m.truncate(rng.below(m.len() + 1)),
        3 => {
            let at = rng.below(m.len() + 1);
            let n = 1 + rng.below(16);
            let extra = rng.bytes(n);
            m.splice(at..at, extra);
        }
        4 => {
            let other = &method.samples[rng.below(method.samples.len())];
            let cut = rng.below(m.len() + 1);
            m.truncate(cut);
            m.extend_from_slice(&other[rng.below(other.len() + 1)..]);
        }
        5 => {
            // A length-delimited field whose length claims far more than follows.
            let field = 1 + rng.below(20) as u64;
            prost::encoding::encode_varint((field << 3) | 2, &mut m);
            prost::encoding::encode_varint(rng.next() >> rng.below(64), &mut m);
            let n = rng.below(8);
            m.extend(rng.bytes(n));
        }
        6 => {
            // A random field of any wire type with a random value appended.
            prost::encoding::encode_varint(rng.next() % (1 << 20), &mut m);
            let n = rng.below(12);
            m.extend(rng.bytes(n));
        }
        _ => {
            // Deeply nested empty messages in field 1: a decoder's recursion limit.
            let depth = 1 + rng.below(200);
            let mut inner = Vec::new();
            for _ in 0..depth {
                let mut outer = vec![0x0a];
                prost::encoding::encode_varint(inner.len() as u64, &mut outer);
                outer.extend_from_slice(&inner);
                inner = outer;
            }
            m.extend(inner);
        }
    }
    m
}

/// The request body: the message in gRPC framing, or (one time in ten) framed wrongly.
fn body(rng: &mut Rng, method: &Method, msg: &[u8]) -> Vec<u8> {
    let frame = |flag: u8, len: u32, msg: &[u8]| {
        let mut b = vec![flag];
        b.extend_from_slice(&len.to_be_bytes());
        b.extend_from_slice(msg);
        b
    };
    let len = msg.len() as u32;
    if rng.below(10) != 0 {
        let mut b = frame(0, len, msg);
        if method.shape == Shape::ClientStream && rng.below(3) == 0 {
            // A stream of several messages.
            let other = message(rng, method);
            b.extend(frame(0, other.len() as u32, &other));
        }
        return b;
    }
    match rng.below(6) {
        0 => frame(0, len + 1 + rng.below(1000) as u32, msg),
        1 => frame(0, len.saturating_sub(1 + rng.below(4) as u32), msg),
        2 => frame(1, len, msg),
        3 => frame(0, u32::MAX - rng.below(16) as u32, msg),
        4 => frame(0, len, msg)[..rng.below(5)].to_vec(),
        _ => {
            let mut b = frame(0, len, msg);
            b.extend(frame(0, len, msg));
            b
        }
    }
}

/// An HTTP/2 connection to the server; it lives as long as the guard.
async fn connect(addr: SocketAddr) -> anyhow::Result<(h2::client::SendRequest<Bytes>, gantry_core::TaskGuard)> {
    let tcp = tokio::net::TcpStream::connect(addr).await.context("connecting to the fuzzed server")?;
    tcp.set_nodelay(true)?;
    let (send, conn) = h2::client::handshake(tcp).await.context("HTTP/2 handshake")?;
    let guard = gantry_core::task::spawn_named("fuzz-connection", async move {
        let _ = conn.await;
    });
    Ok((send, guard))
}

/// Sends one request and reads its whole answer, with the status message.
async fn call(
    send: &mut h2::client::SendRequest<Bytes>,
    addr: SocketAddr,
    path: &str,
    body: Vec<u8>,
) -> (Answer, String) {
    let mut message = String::new();
    let answer = answer(send, addr, path, body, &mut message).await;
    (answer, message)
}

async fn answer(
    send: &mut h2::client::SendRequest<Bytes>,
    addr: SocketAddr,
    path: &str,
    body: Vec<u8>,
    message: &mut String,
) -> Answer {
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("a valid request");
    let (resp, mut stream) = match send.send_request(req, false) {
        Ok(x) => x,
        Err(e) => return Answer::Reset(format!("send: {}", reason(&e))),
    };
    stream.reserve_capacity(body.len());
    if let Err(e) = stream.send_data(Bytes::from(body), true) {
        return Answer::Reset(format!("send data: {}", reason(&e)));
    }
    let resp = match resp.await {
        Ok(r) => r,
        Err(e) => return Answer::Reset(reason(&e)),
    };
    let (parts, mut body) = resp.into_parts();
    let mut code = |h: &http::HeaderMap| {
        if let Some(m) = h.get("grpc-message") {
            *message = String::from_utf8_lossy(m.as_bytes()).into_owned();
        }
        h.get("grpc-status").and_then(|v| v.to_str().ok()?.parse::<i32>().ok())
    };
    if let Some(c) = code(&parts.headers) {
        return Answer::Code(c);
    }
    while let Some(chunk) = body.data().await {
        match chunk {
            Ok(c) => {
                let _ = body.flow_control().release_capacity(c.len());
            }
            Err(e) => return Answer::Reset(reason(&e)),
        }
    }
    match body.trailers().await {
        Ok(Some(t)) => code(&t).map_or(Answer::NoStatus(parts.status.as_u16()), Answer::Code),
        Ok(None) => Answer::NoStatus(parts.status.as_u16()),
        Err(e) => Answer::Reset(reason(&e)),
    }
}

fn reason(e: &h2::Error) -> String {
    match e.reason() {
        Some(r) => format!("{r:?}"),
        None => "connection".into(),
    }
}

/// Per method and answer: how many, and the first status message seen.
type Tally = BTreeMap<(&'static str, Answer), (u64, String)>;

pub async fn run(args: FuzzBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.iterations > 0 && args.concurrency > 0, "--iterations and --concurrency must be at least 1");
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::Relaxed);
        previous(info);
    }));
    let (target, _server) = crate::bench::bench_server(&None, Some(0), &None).await?;
    let addr: SocketAddr = target.trim_start_matches("grpc://").parse()?;
    let channel = gantry_core::client::connect(&target).await?;
    let mut present = Vec::new();
    for i in 0..4 {
        present.push(crate::bench::put_blob(&channel, format!("fuzz blob {i}").into_bytes()).await?);
    }
    let methods = Arc::new(methods(&present));
    let tally: Arc<Mutex<Tally>> = Arc::default();
    let next = Arc::new(AtomicU64::new(0));
    let lost = Arc::new(AtomicU64::new(0));
    let hang_after = Duration::from_secs(args.hang_after_secs);
    let started = Instant::now();
    eprintln!(
        "gantry bench fuzz: {} requests over {} methods, {} in flight, seed {}",
        args.iterations,
        methods.len(),
        args.concurrency,
        args.seed
    );
    let mut conns = Vec::new();
    for _ in 0..4 {
        conns.push(connect(addr).await?);
    }
    let progress = {
        let (next, iterations) = (next.clone(), args.iterations);
        gantry_core::task::spawn_named("fuzz-progress", async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                let done = next.load(Ordering::Relaxed).min(iterations);
                let rate = done as f64 / started.elapsed().as_secs_f64();
                eprintln!(
                    "  {done}/{iterations} ({:.0}%), {rate:.0}/s, about {:.0} s left, {} panics",
                    100.0 * done as f64 / iterations as f64,
                    (iterations - done) as f64 / rate.max(1.0),
                    PANICS.load(Ordering::Relaxed)
                );
            }
        })
    };
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..args.concurrency {
        let (methods, tally, next, lost) = (methods.clone(), tally.clone(), next.clone(), lost.clone());
        // Shares one of the four connections; one the server closes is replaced by a
        // connection of this task's own.
        let mut send = conns[w % 4].0.clone();
        let mut _own: Option<gantry_core::TaskGuard> = None;
        let (iterations, seed) = (args.iterations, args.seed);
        tasks.spawn(async move {
            let mut local: Tally = BTreeMap::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= iterations {
                    break;
                }
                // Each request's content depends only on the seed and its number.
                let mut rng = Rng::new(seed ^ i.wrapping_mul(0xA24B_AED4_963E_E407));
                let method = &methods[rng.below(methods.len())];
                let msg = message(&mut rng, method);
                let body = body(&mut rng, method, &msg);
                send = match send.clone().ready().await {
                    Ok(s) => s,
                    Err(_) => {
                        lost.fetch_add(1, Ordering::Relaxed);
                        let (s, guard) = connect(addr).await?;
                        _own = Some(guard);
                        s.ready().await?
                    }
                };
                let (answer, message) =
                    match tokio::time::timeout(hang_after, call(&mut send, addr, method.path, body)).await {
                        Ok(a) => a,
                        Err(_) => (Answer::Hang, String::new()),
                    };
                let e = local.entry((method.path, answer)).or_insert_with(|| (0, message));
                e.0 += 1;
            }
            let mut t = tally.lock().expect("tally");
            for (k, (n, message)) in local {
                t.entry(k).or_insert_with(|| (0, message)).0 += n;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.context("a fuzzing task panicked")??;
    }
    drop(progress);
    let elapsed = started.elapsed();
    let tally = std::mem::take(&mut *tally.lock().expect("tally"));
    let failures: u64 = tally.iter().filter(|((_, a), _)| a.is_failure()).map(|(_, (n, _))| n).sum();
    let panics = PANICS.load(Ordering::Relaxed);
    // The channel used for setup is not part of the measurement.
    drop(channel);
    println!("| method | requests | answers |");
    println!("|---|---|---|");
    let mut by_method: BTreeMap<&str, Vec<(String, u64)>> = BTreeMap::new();
    for ((path, answer), (n, _)) in &tally {
        by_method.entry(path).or_default().push((answer.label(), *n));
    }
    for (path, answers) in &by_method {
        let total: u64 = answers.iter().map(|(_, n)| n).sum();
        let list: Vec<String> = answers.iter().map(|(l, n)| format!("{l} {n}")).collect();
        println!("| {} | {total} | {} |", path.rsplit('/').next().unwrap_or(path), list.join(", "));
    }
    println!(
        "{} requests in {:.1} s ({:.0}/s), seed {}: {panics} panics, {} hangs, {failures} failures in all; \
         {} connections closed by the server",
        args.iterations,
        elapsed.as_secs_f64(),
        args.iterations as f64 / elapsed.as_secs_f64(),
        args.seed,
        tally.iter().filter(|((_, a), _)| *a == Answer::Hang).map(|(_, (n, _))| n).sum::<u64>(),
        lost.load(Ordering::Relaxed)
    );
    for ((path, answer), (n, message)) in tally.iter().filter(|((_, a), _)| a.is_failure()) {
        println!("failure: {path}: {} × {n}, the first saying {message:?}", answer.label());
    }
    anyhow::ensure!(panics == 0 && failures == 0, "the server failed {failures} requests and panicked {panics} times");
    Ok(())
}
