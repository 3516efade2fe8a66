//! The batching CLI end to end: train models from a history, evaluate them, plan
//! offline, and stream targets to a real `gantry serve` that loaded the models.

mod common;

use std::collections::HashMap;
use std::io::Write;
use std::process::{Command, Stdio};

use common::GantryServer;

fn gantry() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gantry"))
}

fn run_with_stdin(mut cmd: Command, stdin: &str) -> std::process::Output {
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    eprintln!("stderr: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// A small simulated monorepo history, written as the JSONL `gantry model train` reads.
fn history(dir: &std::path::Path) -> (std::path::PathBuf, gantry_batch::BuildContext, Vec<String>) {
    let cfg = gantry_batch::sim::SimConfig::small();
    let (_truth, history, streams) = gantry_batch::sim::generate(&cfg);
    let path = dir.join("history.jsonl");
    gantry_batch::history::write_history(std::fs::File::create(&path).unwrap(), &history).unwrap();
    // the targets of the largest fresh stream, to plan
    let (ctx, targets) = streams.iter().max_by_key(|s| s.1.len()).unwrap();
    (path, ctx.clone(), targets.iter().map(|t| t.label.clone()).collect())
}

#[test]
fn train_eval_plan_and_enqueue() {
    let dir = tempfile::tempdir().unwrap();
    let (hist, context, labels) = history(dir.path());
    assert!(labels.len() > 200, "a stream large enough to need several builds");
    let data = dir.path().join("data");
    let models = data.join("models");

    let out = gantry().args(["model", "train", "--history"]).arg(&hist).arg("--out").arg(&models).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(models.join("manifest.json").exists() && models.join("memory_long.json").exists());
    // The shared-cost model plans by default; `--learner linear` leaves it out, and a
    // directory written that way loses a stale one.
    assert!(models.join("shared.json").exists(), "the default learner's model");
    let linear = dir.path().join("linear");
    std::fs::create_dir_all(&linear).unwrap();
    std::fs::write(linear.join("shared.json"), "stale").unwrap();
    let out = gantry()
        .args(["model", "train", "--learner", "linear", "--history"])
        .arg(&hist)
        .arg("--out")
        .arg(&linear)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("planning with the linear models"));
    assert!(linear.join("memory_long.json").exists() && !linear.join("shared.json").exists());

    let out = gantry().args(["model", "eval", "--model"]).arg(&models).arg("--history").arg(&hist).output().unwrap();
    assert!(out.status.success());
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains("memory model") && report.contains("rmse_over") && report.contains("evaluated"),
        "{report}"
    );

    // Offline plan: every target exactly once, estimates present, JSONL as documented.
    let ctx = dir.path().join("ctx.json");
    std::fs::write(&ctx, serde_json::to_string(&context).unwrap()).unwrap();
    let targets_txt = labels.join("\n") + "\n";
    let mut cmd = gantry();
    cmd.args(["batch", "plan", "--model"]).arg(&models).arg("--context").arg(&ctx);
    let out = run_with_stdin(cmd, &targets_txt);
    assert!(out.status.success());
    let mut count: HashMap<String, usize> = HashMap::new();
    let mut plan_builds = 0;
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(v["memory_estimate_bytes"].as_u64().is_some(), "{line}");
        assert!(v["occupancy_estimate_esu"].as_f64().is_some(), "{line}");
        assert!(v["reason"].as_str().is_some());
        for t in v["targets"].as_array().unwrap() {
            *count.entry(t.as_str().unwrap().to_string()).or_default() += 1;
        }
        plan_builds += 1;
    }
    let unique: std::collections::HashSet<_> = labels.iter().collect();
    assert_eq!(count.len(), unique.len());
    assert!(count.values().all(|&n| n == 1));

    // The same through a server that loaded the models from {data_dir}/models.
    let server = GantryServer::start(&data, &[]);
    let mut cmd = gantry();
    cmd.args(["batch", "--server", &format!("grpc://{}", server.grpc), "--json"])
        .args(["--command", context.command.as_str(), "--priority", context.priority.as_str()])
        .args(context.flags.iter().map(|f| format!("--flag={f}")))
        .args(["--workspace", context.workspace.as_deref().unwrap_or("/ws")])
        .args(["--user", &context.user, "--product-area", &context.product_area, "--tool-tag", &context.tool_tag]);
    let out = run_with_stdin(cmd, &targets_txt);
    assert!(out.status.success());
    let lines: Vec<serde_json::Value> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), plan_builds, "server and offline planning agree on the number of builds");
    let served: usize = lines.iter().map(|v| v["targets"].as_array().unwrap().len()).sum();
    assert_eq!(served, unique.len());
    assert!(lines.iter().all(|v| v["reason"] != "MEMORY_ESTIMATE_ERROR"), "the server used the trained models");
    assert!(lines.iter().all(|v| v["build_id"].as_str().unwrap().starts_with(v["stream_id"].as_str().unwrap())));

    // A malformed target line is refused with its line number, and nothing is planned.
    let mut cmd = gantry();
    cmd.args(["batch", "--server", &format!("grpc://{}", server.grpc)]);
    let out = run_with_stdin(cmd, "//ok:a\n//bad:b:c\n");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"), "{}", String::from_utf8_lossy(&out.stderr));
    server.stop();
}
