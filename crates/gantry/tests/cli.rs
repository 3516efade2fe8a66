//! The `gantry` command line: bad configuration fails at startup with a precise message,
//! and flags override the config file.

mod common;

use std::process::Command;

fn gantry(args: &[&str], cwd: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gantry")).args(args).current_dir(cwd).output().unwrap()
}

#[test]
fn unknown_config_key_fails_with_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bad.toml"), "[cas]\nkind = \"fs\"\nmax_sise = \"1GiB\"\n").unwrap();
    let out = gantry(&["serve", "--config", "bad.toml"], dir.path());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.toml") && err.contains("max_sise"), "{err}");
}

#[test]
fn unusable_data_dir_fails_at_startup_with_reason() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("file"), "not a directory").unwrap();
    let out = gantry(
        &["serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--data-dir", "file/data"],
        dir.path(),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // The metadata database is opened first; either store may be the one to say so.
    assert!((err.contains("CAS") || err.contains("metadata")) && err.contains("file/data"), "{err}");
}

#[test]
fn flags_override_config_and_gantry_toml_is_picked_up() {
    let dir = tempfile::tempdir().unwrap();
    // gantry.toml in the working directory asks for a memory CAS and a fixed port...
    std::fs::write(
        dir.path().join("gantry.toml"),
        "[server]\nlisten = \"127.0.0.1:1\"\n[cas]\nkind = \"memory\"\nmax_size = \"64MiB\"\n",
    )
    .unwrap();
    let data = dir.path().join("d");
    // ...and the flag moves the listener to a free port.
    let mut child = Command::new(env!("CARGO_BIN_EXE_gantry"))
        .args(["serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .current_dir(dir.path())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    assert!(line.starts_with("gantry serving grpc=127.0.0.1:") && !line.contains("grpc=127.0.0.1:1 "), "{line}");
    assert!(data.join("metadata.db").exists(), "--data-dir applied");
    assert!(!data.join("cas").exists(), "memory CAS from gantry.toml: no cas directory");
    let _ = child.kill();
    let _ = child.wait();
}

/// Starts `gantry serve` with stderr piped (not a terminal), stops it, returns stderr.
fn serve_logs(extra: &[&str]) -> String {
    use std::io::{BufRead, BufReader, Read};
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_gantry"))
        .args(["serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("d"))
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(line.starts_with("gantry serving"), "{line}");
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(child.wait().unwrap().success(), "{err}");
    err
}

/// Logs an operator can ship: no colour codes when stderr is not a terminal, and one
/// JSON object per line with `--log-format json`.
#[test]
fn logs_are_plain_off_a_terminal_and_json_on_request() {
    let text = serve_logs(&[]);
    assert!(text.contains("metadata database ready"), "{text}");
    assert!(!text.contains('\u{1b}'), "escape codes in piped logs: {text:?}");
    let json = serve_logs(&["--log-format", "json"]);
    let lines: Vec<&str> = json.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 2, "{json}");
    for l in &lines {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v["level"].is_string() && v["fields"].is_object(), "{l}");
    }
    assert!(lines.iter().any(|l| l.contains("metadata database ready")));
}
