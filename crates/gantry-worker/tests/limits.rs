//! Size-class limits on real processes: a JVM that RLIMIT_AS breaks runs under a cgroup
//! of the same size, an action past its memory is OOM-killed and reported as a resource
//! failure, the peak of a whole process tree is counted, a one-CPU class gets one CPU,
//! and no action leaves its cgroup behind.
//!
//! They need cgroups (v2 delegated, or v1 as root): without them they are skipped with
//! the reason, and under CI=true they fail.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gantry_worker::cgroup::{self, Cgroups};
use gantry_worker::process::{self, Ending, Limits, RunOutcome, Spec};

const MIB: u64 = 1 << 20;

mod common;
use common::cgroups;

/// The first `name` on this process's PATH.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(name)).find(|p| p.is_file())
}

fn env() -> Vec<(String, String)> {
    vec![("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into())]
}

async fn run(
    dir: &Path,
    cgroups: Option<&Cgroups>,
    limits: Limits,
    args: &[&str],
    timeout: Duration,
    cancel: impl std::future::Future<Output = ()>,
) -> RunOutcome {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let env = env();
    let (stdout, stderr) = (dir.join("stdout"), dir.join("stderr"));
    let spec = Spec {
        limits,
        cgroups,
        spawner: None,
        args: &args,
        env: &env,
        cwd: dir,
        stdout: &stdout,
        stderr: &stderr,
        timeout,
    };
    process::run(spec, cancel).await.unwrap()
}

fn read(p: impl AsRef<Path>) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// Gone from /proc, or a zombie waiting for init to reap it.
fn dead(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
    }
}

const ALLOC_JAVA: &str = r#"
import java.util.ArrayList;

public class Alloc {
    public static void main(String[] args) {
        // ~100 MB held at once, every page written.
        ArrayList<byte[]> held = new ArrayList<>();
        for (int i = 0; i < 100; i++) {
            byte[] b = new byte[1 << 20];
            for (int j = 0; j < b.length; j += 4096) {
                b[j] = (byte) i;
            }
            held.add(b);
        }
        System.out.println("OK " + held.size());
    }
}
"#;

/// The point of cgroups: a JVM reserves address space far beyond what it touches (1 GiB
/// of compressed class space, a heap of up to half the limit, its threads' stacks), so
/// under RLIMIT_AS it cannot even start: on a 24 GiB machine this class fails at 1, 2 and
/// 3 GiB and starts at 4 GiB, though it touches ~150 MB. The test uses 1 GiB because the
/// class space reservation alone fills it, so the RLIMIT_AS failure does not depend on the
/// machine (at 2-3 GiB it depends on the heap the JVM sizes from its RAM). Under a cgroup
/// of the same 1 GiB it runs, with its heap sized from the group's limit.
#[tokio::test]
async fn a_jvm_that_rlimit_as_breaks_runs_under_a_cgroup_of_the_same_size() {
    let Some(cgroups) = cgroups() else { return };
    let (Some(javac), Some(java)) = (on_path("javac"), on_path("java")) else {
        gantry_testkit::unavailable::<()>("a JDK (javac and java on PATH)", "not found");
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let classes = d.path().join("classes");
    std::fs::write(d.path().join("Alloc.java"), ALLOC_JAVA).unwrap();
    let out =
        std::process::Command::new(&javac).arg("-d").arg(&classes).arg(d.path().join("Alloc.java")).output().unwrap();
    assert!(out.status.success(), "javac: {}", String::from_utf8_lossy(&out.stderr));

    let limits = Limits { memory_bytes: Some(1 << 30), cpus: None };
    let args = [java.to_str().unwrap(), "-cp", classes.to_str().unwrap(), "Alloc"];
    let long = Duration::from_secs(120);
    let ok = run(d.path(), Some(&cgroups), limits, &args, long, std::future::pending()).await;
    let (stdout, stderr) = (read(d.path().join("stdout")), read(d.path().join("stderr")));
    eprintln!(
        "JVM under a 1 GiB cgroup: {:?}, peak {} MiB, {:.2}s",
        ok.ending,
        ok.peak_memory_bytes / MIB,
        ok.wall_seconds
    );
    assert_eq!(ok.ending, Ending::Exited(0), "stdout: {stdout}\nstderr: {stderr}");
    assert_eq!(stdout.trim(), "OK 100");
    assert!(!ok.out_of_memory);
    assert!(ok.peak_memory_bytes > 100 * MIB, "the group saw the 100 MB: {}", ok.peak_memory_bytes);
    assert!(ok.peak_memory_bytes < 1 << 30, "and stayed under the limit: {}", ok.peak_memory_bytes);

    let broken = run(d.path(), None, limits, &args, long, std::future::pending()).await;
    // The VM prints why to stdout (which reservation failed depends on the heap it sizes
    // from the machine's RAM: class space, or a GC thread's stack), the launcher to stderr.
    let output = read(d.path().join("stdout")) + &read(d.path().join("stderr"));
    eprintln!("JVM under a 1 GiB RLIMIT_AS: {:?}:\n{}", broken.ending, output.trim());
    assert_ne!(broken.ending, Ending::Exited(0), "RLIMIT_AS at 1 GiB fails the JVM");
    assert!(output.contains("Error occurred during initialization of VM"), "{output}");
}

/// Past its class's memory, an action is OOM-killed by the kernel and reported as a
/// resource failure, with the group's peak at the limit.
#[tokio::test]
async fn past_its_limit_an_action_is_oom_killed_and_reported_as_out_of_memory() {
    let Some(cgroups) = cgroups() else { return };
    let d = tempfile::tempdir().unwrap();
    let limit = 64 * MIB;
    let limits = Limits { memory_bytes: Some(limit), cpus: None };
    let args = ["/bin/sh", "-c", "exec python3 -c 'b = bytearray(300_000_000); print(len(b))'"];
    let out = run(d.path(), Some(&cgroups), limits, &args, Duration::from_secs(60), std::future::pending()).await;
    eprintln!("{:?}, peak {} MiB, out_of_memory {}", out.ending, out.peak_memory_bytes / MIB, out.out_of_memory);
    assert_eq!(out.ending, Ending::Signaled(libc::SIGKILL), "stderr: {}", read(d.path().join("stderr")));
    assert!(out.out_of_memory, "an OOM kill is a resource failure");
    assert!(out.peak_memory_bytes >= limit * 9 / 10, "peak {} of a {limit} limit", out.peak_memory_bytes);
    assert!(out.peak_memory_bytes <= limit, "never past the limit: {}", out.peak_memory_bytes);

    // An ordinary failure under the same limit is not one.
    let args = ["/bin/sh", "-c", "exit 3"];
    let out = run(d.path(), Some(&cgroups), limits, &args, Duration::from_secs(60), std::future::pending()).await;
    assert_eq!((out.ending, out.out_of_memory), (Ending::Exited(3), false));
}

/// The same through the worker's executor: the OOM kill reaches the scheduler as
/// ExecutionFinished.out_of_memory, with status OK and the exit code it died with.
#[tokio::test]
async fn the_executor_reports_an_oom_kill_to_the_scheduler() {
    use gantry_core::reapi;
    use gantry_core::{BlobStore, DigestFunction};
    use prost::Message;

    let Some(cgroups) = cgroups() else { return };
    let d = tempfile::tempdir().unwrap();
    let cas: Arc<dyn BlobStore> = Arc::new(gantry_store::MemoryStore::new(1 << 30));
    let f = DigestFunction::Sha256;
    let empty = reapi::Directory::default().encode_to_vec();
    let input_root = f.digest_of(&empty);
    cas.put(&input_root, empty.into()).await.unwrap();
    let command = reapi::Command {
        arguments: vec!["/bin/sh".into(), "-c".into(), "python3 -c 'b = bytearray(300_000_000)'".into()],
        environment_variables: vec![reapi::command::EnvironmentVariable {
            name: "PATH".into(),
            value: "/usr/bin:/bin".into(),
        }],
        ..Default::default()
    };
    let action = reapi::Action {
        command_digest: Some(f.digest_of(&command.encode_to_vec()).to_proto()),
        input_root_digest: Some(input_root.to_proto()),
        ..Default::default()
    };
    let executor = gantry_worker::Executor {
        worker_id: "w".into(),
        cas,
        cache: Arc::new(gantry_worker::materialize::InputCache::open(d.path(), 1 << 30).await.unwrap()),
        work_root: d.path().join("actions"),
        dirs: Default::default(),
        spawner: None,
        limits: Limits { memory_bytes: Some(64 * MIB), cpus: None },
        cgroups: Some(cgroups),
    };
    let assignment = gantry_core::Work {
        job_id: "j".into(),
        function: f,
        action: action.into(),
        command: command.into(),
        timeout: std::time::Duration::from_secs(60),
    };
    let finished = executor.execute(assignment, std::future::pending()).await;
    assert_eq!(finished.status_code, 0, "a completed run: {}", finished.status_message);
    assert!(finished.out_of_memory, "{finished:?}");
    assert!(finished.message.starts_with("out of memory"), "{}", finished.message);
    let result = finished.action_result.unwrap();
    assert_eq!(result.exit_code, 128 + libc::SIGKILL, "the shell reports its child's SIGKILL");
    let m = finished.metering.unwrap();
    assert!(m.method.starts_with("cgroup-v"), "{}", m.method);
    assert!(m.peak_memory_bytes >= 57 * MIB, "peak {}", m.peak_memory_bytes);
}

const ESCAPEE_PY: &str = r#"
import os, sys, time
os.setsid()  # leaves the action's process group: only its cgroup still holds it
b = b"x" * 100_000_000
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"#;

/// A parent that starts a child which allocates 100 MB, leaves the process group and is
/// never reaped: rusage and the process-group samples miss it, the cgroup does not, and
/// the child is killed with the group when the action ends.
#[tokio::test]
async fn the_peak_of_a_process_tree_counts_children_that_escaped_and_were_killed() {
    let Some(cgroups) = cgroups() else { return };
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("escapee.py"), ESCAPEE_PY).unwrap();
    let script = "python3 escapee.py pid & while [ ! -s pid ]; do sleep 0.05; done; exit 0";
    let limits = Limits { memory_bytes: Some(512 * MIB), cpus: None };
    let args = ["/bin/sh", "-c", script];
    let out = run(d.path(), Some(&cgroups), limits, &args, Duration::from_secs(60), std::future::pending()).await;
    assert_eq!(out.ending, Ending::Exited(0), "stderr: {}", read(d.path().join("stderr")));
    eprintln!("process tree peak: {} MiB", out.peak_memory_bytes / MIB);
    assert!(out.peak_memory_bytes >= 100_000_000, "the child's 100 MB is counted: {}", out.peak_memory_bytes);
    let pid: u32 = read(d.path().join("pid")).trim().parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !dead(pid) {
        assert!(Instant::now() < deadline, "the escaped child {pid} outlived its action");
        std::thread::sleep(Duration::from_millis(20));
    }
}

const BUSY_PY: &str = r#"
import os, time
with open("groups", "w") as f:
    f.write(open("/proc/self/cgroup").read())
# Undo any pinning: only the cgroup's CPU quota may hold this to one CPU.
os.sched_setaffinity(0, range(os.cpu_count()))
end = time.time() + 1.5
pids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        while time.time() < end:
            pass
        os._exit(0)
    pids.append(pid)
for pid in pids:
    os.waitpid(pid, 0)
"#;

/// A class with one CPU running two busy processes for 1.5 s gets one CPU of time, even
/// after the action widens its own CPU affinity, which pinning alone cannot prevent. On a
/// loaded machine the pinned-only run may get no more than one CPU either, so the group's
/// quota is also read while the action runs.
#[tokio::test]
async fn a_one_cpu_class_gets_one_cpu_of_time() {
    let Some(cgroups) = cgroups() else { return };
    if !cgroups.limits_cpu_time() {
        gantry_testkit::unavailable::<()>("a cgroup cpu controller for actions", "not usable");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("busy.py"), BUSY_PY).unwrap();
    let limits = Limits { memory_bytes: None, cpus: Some(1) };
    let args = ["/bin/sh", "-c", "exec python3 busy.py"];
    let ratio = |o: &RunOutcome| (o.user_cpu_seconds + o.system_cpu_seconds) / o.wall_seconds;
    let pinned = run(d.path(), None, limits, &args, Duration::from_secs(30), std::future::pending()).await;
    assert_eq!(pinned.ending, Ending::Exited(0), "stderr: {}", read(d.path().join("stderr")));
    std::fs::remove_file(d.path().join("groups")).unwrap();

    // The cpu group is the last parent's (v1: the cpu hierarchy; v2: the one directory).
    let (cpu_parent, quota_file) = match cgroups.version() {
        cgroup::Version::V1 => (cgroups.parents()[1].to_path_buf(), "cpu.cfs_quota_us"),
        cgroup::Version::V2 => (cgroups.parents()[0].to_path_buf(), "cpu.max"),
    };
    let groups = d.path().join("groups");
    let quota = async {
        while read(&groups).is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let names = groups_named_in(&read(&groups));
        assert!(!names.is_empty(), "the action ran in a gantry group: {}", read(&groups));
        read(cpu_parent.join(&names[0]).join(quota_file))
    };
    let (limited, quota) = tokio::join!(
        run(d.path(), Some(&cgroups), limits, &args, Duration::from_secs(30), std::future::pending()),
        quota
    );
    assert_eq!(limited.ending, Ending::Exited(0), "stderr: {}", read(d.path().join("stderr")));
    eprintln!(
        "CPU/wall of 2 busy processes in a 1-CPU class: {:.2} pinned only (on {} CPUs), {:.2} with the cgroup's {} = {}",
        ratio(&pinned),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        ratio(&limited),
        quota_file,
        quota.trim()
    );
    let want = match cgroups.version() {
        cgroup::Version::V1 => "100000",
        cgroup::Version::V2 => "100000 100000",
    };
    assert_eq!(quota.trim(), want, "one CPU per period");
    assert!(limited.user_cpu_seconds + limited.system_cpu_seconds > 0.5, "it was busy: {limited:?}");
    assert!(ratio(&limited) <= 1.3, "held to ~1 CPU: {limited:?}");
}

/// The action's own view of its groups: the names in /proc/self/cgroup.
fn groups_named_in(proc_self_cgroup: &str) -> Vec<String> {
    let mut names: Vec<String> = proc_self_cgroup
        .lines()
        .filter_map(|l| l.rsplit('/').next())
        .filter(|n| n.starts_with(&format!("gantry-{}-", std::process::id())))
        .map(str::to_string)
        .collect();
    names.dedup();
    names
}

/// Leaves a child in the action's cgroup but outside its process group and session, and
/// ends: `sleep`, which leaves less charged to the group than reuse allows. (The pause
/// lets it leave the process group, which the shell's end kills, before the shell ends.)
const LEAVES_A_CHILD: &str = "cat /proc/self/cgroup > groups; setsid sleep 60 & echo $! > child; sleep 0.3; exit 0";

/// A group kept for reuse must be empty: a process that the action left outside its
/// process group is found in it and killed, also when the group was checked moments
/// before, after another action. (cgroup v1 keeps the list of pids an open `cgroup.procs`
/// file read for about a second, so a file held open would still read empty.)
#[tokio::test]
async fn a_process_left_in_a_group_just_reused_is_killed() {
    let Some(cgroups) = cgroups() else { return };
    // This test's own limits: the pool of idle groups is keyed by them.
    let limits = Limits { memory_bytes: Some(384 * MIB + 8192), cpus: None };
    let d = tempfile::tempdir().unwrap();
    let sh = |script: &'static str| {
        let (d, cgroups) = (d.path().to_path_buf(), cgroups.clone());
        async move {
            let args = ["/bin/sh", "-c", script];
            run(&d, Some(&cgroups), limits, &args, Duration::from_secs(60), std::future::pending()).await
        }
    };
    assert_eq!(sh("cat /proc/self/cgroup > groups").await.ending, Ending::Exited(0));
    let first = group_of(d.path());
    let out = sh(LEAVES_A_CHILD).await;
    assert_eq!(out.ending, Ending::Exited(0), "stderr: {}", read(d.path().join("stderr")));
    if cgroups.version() == cgroup::Version::V1 {
        assert_eq!(group_of(d.path()), first, "the second action reused the first one's group");
    }
    let pid: u32 = read(d.path().join("child")).trim().parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !dead(pid) {
        assert!(Instant::now() < deadline, "the child {pid} outlived its action");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether any of `cgroups`' parents still holds a group called `name`.
fn exists(cgroups: &Cgroups, name: &str) -> bool {
    cgroups.parents().iter().any(|p| p.join(name).exists())
}

/// An action's group is gone after it times out, is cancelled, or its run is dropped,
/// including a group that still had a process which had left the process group.
#[tokio::test]
async fn no_cgroup_outlives_its_action() {
    let Some(cgroups) = cgroups() else { return };
    let limits = Limits { memory_bytes: Some(256 * MIB), cpus: Some(1) };
    // Records its groups, starts a child outside its process group, and waits. The child
    // writes its pid only once it has left the process group: a run stopped before that
    // would kill it with the shell, leave the group empty and keep it for reuse, which is
    // right, but not what this test is about (it failed that way once under CI load, when
    // the shell wrote `$!` before the child's `setsid`).
    let script = "cat /proc/self/cgroup > groups; setsid sh -c 'echo $$ > child; exec sleep 60' & sleep 60";
    let args = ["/bin/sh", "-c", script];
    let check = |d: &Path, how: &str| {
        let names = groups_named_in(&read(d.join("groups")));
        assert!(!names.is_empty(), "{how}: the action ran in a gantry group: {}", read(d.join("groups")));
        for name in &names {
            assert!(!exists(&cgroups, name), "{how}: cgroup {name} is left behind");
        }
        let pid: u32 = read(d.join("child")).trim().parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !dead(pid) {
            assert!(Instant::now() < deadline, "{how}: the child {pid} outlived its action");
            std::thread::sleep(Duration::from_millis(20));
        }
        names
    };
    let started = |d: &Path| {
        let (child, groups) = (d.join("child"), d.join("groups"));
        async move {
            while read(&child).trim().is_empty() || read(&groups).is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };

    let d = tempfile::tempdir().unwrap();
    let out = run(d.path(), Some(&cgroups), limits, &args, Duration::from_secs(2), std::future::pending()).await;
    assert_eq!(out.ending, Ending::TimedOut);
    let names = check(d.path(), "timed out");
    if cgroups.version() == cgroup::Version::V1 {
        assert_eq!(names.len(), 1, "one name, in the memory and the cpu hierarchy: {names:?}");
    }

    let d = tempfile::tempdir().unwrap();
    let out = run(d.path(), Some(&cgroups), limits, &args, Duration::from_secs(60), started(d.path())).await;
    assert_eq!(out.ending, Ending::Cancelled);
    check(d.path(), "cancelled");

    let d = tempfile::tempdir().unwrap();
    let fut = run(d.path(), Some(&cgroups), limits, &args, Duration::from_secs(60), std::future::pending());
    tokio::select! {
        _ = fut => panic!("the action finished early"),
        _ = started(d.path()) => {}
    }
    check(d.path(), "dropped");
}

/// The group an action ran in, from its own /proc/self/cgroup (written to `groups`).
fn group_of(dir: &Path) -> String {
    let names = groups_named_in(&read(dir.join("groups")));
    assert_eq!(names.len(), 1, "one gantry group: {}", read(dir.join("groups")));
    names[0].clone()
}

/// On cgroup v1 a finished action's group is kept for the next action with the same
/// limits. The next one's peak is its own, not what the group's earlier action held, and
/// an earlier OOM kill does not make its ordinary failure an OOM. Every run here is one
/// shell process with no children, so each group is left empty and reusable. (The limits
/// are this test's own: the pool is per process and keyed by them.)
#[tokio::test]
async fn a_reused_group_reports_each_actions_own_peak_and_oom() {
    let Some(cgroups) = cgroups() else { return };
    let record = "cat /proc/self/cgroup > groups";
    let run_sh = |d: &Path, limits: Limits, script: String| {
        let d = d.to_path_buf();
        let cgroups = cgroups.clone();
        async move {
            let args = ["/bin/sh", "-c", &script];
            run(&d, Some(&cgroups), limits, &args, Duration::from_secs(60), std::future::pending()).await
        }
    };
    let d = tempfile::tempdir().unwrap();
    let reused = cgroups.version() == cgroup::Version::V1;

    // A 64 MiB string in the shell, then a run that holds nothing.
    let limits = Limits { memory_bytes: Some(512 * MIB + 4096), cpus: None };
    let grow = |n: u32| format!("{record}; x=a; i=0; while [ $i -lt {n} ]; do x=$x$x; i=$((i+1)); done; echo ${{#x}}");
    let big = run_sh(d.path(), limits, grow(26)).await;
    assert_eq!(big.ending, Ending::Exited(0), "stderr: {}", read(d.path().join("stderr")));
    assert!(big.peak_memory_bytes >= 64 * MIB, "the shell held 64 MiB: peak {}", big.peak_memory_bytes);
    let first = group_of(d.path());
    let small = run_sh(d.path(), limits, record.to_string()).await;
    assert_eq!(small.ending, Ending::Exited(0));
    assert_eq!(group_of(d.path()) == first, reused, "v1 reuses the group, v2 makes another");
    assert!(
        small.peak_memory_bytes < 8 * MIB,
        "the second action's peak is its own, not the first's 64 MiB: {}",
        small.peak_memory_bytes
    );

    // An OOM kill (the string doubles past 32 MiB), then an ordinary failure.
    let limits = Limits { memory_bytes: Some(32 * MIB + 4096), cpus: None };
    let oom = run_sh(d.path(), limits, format!("{record}; x=a; while :; do x=$x$x; done")).await;
    assert_eq!((oom.ending, oom.out_of_memory), (Ending::Signaled(libc::SIGKILL), true));
    let killed_in = group_of(d.path());
    let failed = run_sh(d.path(), limits, format!("{record}; exit 3")).await;
    assert_eq!(group_of(d.path()) == killed_in, reused, "v1 reuses the group, v2 makes another");
    assert_eq!((failed.ending, failed.out_of_memory), (Ending::Exited(3), false), "not the earlier action's OOM");
    // And the group still tells a new OOM kill from the old one.
    let again = run_sh(d.path(), limits, format!("{record}; x=a; while :; do x=$x$x; done")).await;
    assert_eq!(group_of(d.path()) == killed_in, reused);
    assert_eq!((again.ending, again.out_of_memory), (Ending::Signaled(libc::SIGKILL), true));
}
