//! Malformed input from the network: fuzzed gRPC requests (`gantry bench fuzz`, a bounded
//! run), and raw HTTP/2 frames that break the protocol, each on a connection of its own,
//! against a real `gantry serve`. The server must close only the offending connection,
//! with a GOAWAY where HTTP/2 asks for one, never hang on it, and go on serving.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{output_text, GantryServer};

/// A bounded run of the fuzzer in CI: every method, random and mutated messages, broken
/// gRPC framing; no panic, no hang, no server-fault code. `gantry bench fuzz
/// --iterations 10000000` is the long run.
#[test]
fn fuzzed_requests_get_client_codes_and_no_panic() {
    let out = common::gantry()
        .args(["bench", "fuzz", "--iterations", "30000", "--seed", "11"])
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let text = output_text(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("0 panics, 0 hangs, 0 failures in all"), "{text}");
    // Every method was reached, and most requests were refused as the client's fault.
    for method in
        ["FindMissingBlobs", "UpdateActionResult", "Execute", "Write", "GetOperation", "PublishLifecycleEvent"]
    {
        assert!(text.contains(&format!("| {method} |")), "{method} was not fuzzed: {text}");
    }
    assert!(text.contains("InvalidArgument"), "{text}");
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A frame: 24-bit length, type, flags, 31-bit stream id, payload (the length may lie).
fn frame(len: u32, kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = len.to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

fn honest(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    frame(payload.len() as u32, kind, flags, stream, payload)
}

const DATA: u8 = 0;
const HEADERS: u8 = 1;
const SETTINGS: u8 = 4;
const GOAWAY: u8 = 7;
const WINDOW_UPDATE: u8 = 8;
const CONTINUATION: u8 = 9;
const END_HEADERS: u8 = 4;

/// Sends `bytes` on a new connection and ends it, then reads until the server closes
/// its side. Returns the types of the frames the server sent, or None if it kept the
/// connection open for 10 s after the client's end (a hang).
fn exchange(addr: &str, bytes: &[u8]) -> Option<Vec<u8>> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // The server may close before everything is written: that is an answer too. Then
    // end our side, so that a server waiting for the rest of a frame sees the end.
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return None;
            }
            Err(e) => panic!("reading from the server: {e}"),
        }
    }
    let mut kinds = Vec::new();
    let mut at = 0;
    while at + 9 <= got.len() {
        let len = u32::from_be_bytes([0, got[at], got[at + 1], got[at + 2]]) as usize;
        kinds.push(got[at + 3]);
        at += 9 + len;
    }
    Some(kinds)
}

#[test]
fn malformed_http2_frames_close_only_their_connection() {
    let dir = tempfile::tempdir().unwrap();
    let server = GantryServer::start(dir.path(), &[]);
    let addr = server.grpc.clone();
    let settings = honest(SETTINGS, 0, 0, &[]);
    let with_preface = |frames: &[Vec<u8>]| {
        let mut b = PREFACE.to_vec();
        b.extend_from_slice(&settings);
        for f in frames {
            b.extend_from_slice(f);
        }
        b
    };
    // (what, bytes, whether HTTP/2 requires a GOAWAY for it)
    let mut cases: Vec<(String, Vec<u8>, bool)> = vec![
        (
            "a DATA frame longer than the 16 KiB maximum frame size".into(),
            with_preface(&[frame(0xFF_FFFF, DATA, 0, 1, &[0; 64])]),
            true,
        ),
        ("DATA on stream 0".into(), with_preface(&[honest(DATA, 0, 0, b"hello")]), true),
        (
            "a header block that is not HPACK".into(),
            with_preface(&[honest(HEADERS, END_HEADERS, 1, &[0xff; 40])]),
            true,
        ),
        ("a WINDOW_UPDATE of 0 on the connection".into(), with_preface(&[honest(WINDOW_UPDATE, 0, 0, &[0; 4])]), true),
        ("a SETTINGS frame of 5 bytes".into(), with_preface(&[honest(SETTINGS, 0, 0, &[0; 5])]), true),
        (
            "HEADERS on an even (server-initiated) stream".into(),
            with_preface(&[honest(HEADERS, END_HEADERS, 2, &[0x83, 0x86])]),
            true,
        ),
        ("a CONTINUATION without HEADERS".into(), with_preface(&[honest(CONTINUATION, END_HEADERS, 1, &[0x83])]), true),
        ("no preface: an HTTP/1 request".into(), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), false),
        ("a preface cut short".into(), PREFACE[..10].to_vec(), false),
    ];
    // A header block that never ends: 2,000 CONTINUATION frames of 16 KiB (32 MiB).
    let mut flood = vec![honest(HEADERS, 0, 1, &[0x83, 0x86])];
    flood.extend((0..2000).map(|_| honest(CONTINUATION, 0, 1, &[0x40; 16384])));
    cases.push(("a header block of 32 MiB in CONTINUATION frames".into(), with_preface(&flood), true));
    // Random frames after a valid preface, and random bytes instead of one.
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut random = |n: usize| {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect::<Vec<u8>>()
    };
    for i in 0..20 {
        let junk = random(64 + i * 97);
        cases.push((format!("random bytes #{i} after the preface"), with_preface(std::slice::from_ref(&junk)), false));
        cases.push((format!("random bytes #{i} without a preface"), junk, false));
    }
    let mut hangs = Vec::new();
    for (what, bytes, goaway) in &cases {
        match exchange(&addr, bytes) {
            None => hangs.push(what.clone()),
            Some(kinds) => {
                if *goaway {
                    assert!(kinds.contains(&GOAWAY), "{what}: no GOAWAY, frames {kinds:?}");
                }
            }
        }
    }
    assert!(hangs.is_empty(), "the server kept these connections open: {hangs:?}");
    // The server is still up and serves a well-formed client.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = common::reapi::Client::connect(&addr).await;
        let d = c.put(b"after the malformed frames").await;
        assert_eq!(c.get(&d.to_proto()).await, b"after the malformed frames");
    });
    server.stop();
}
