//! The open-file limit end to end, in a test binary of its own (it changes the limit of
//! its whole process): started under a low soft limit, a server raises its own, and the
//! action it starts gets the low one back.

use std::time::Duration;

use gantry_worker::open_files;
use gantry_worker::process::{self, Ending, Limits, Spec};

fn soft_and_hard() -> (u64, u64) {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit with a valid struct.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) }, 0);
    (rl.rlim_cur, rl.rlim_max)
}

#[tokio::test]
async fn a_server_raises_its_limit_and_its_action_gets_the_original() {
    let (_, hard) = soft_and_hard();
    // Below the hard limit, as systemd's default 1,024 usually is.
    let low = (hard / 2).min(1000);
    let rl = libc::rlimit { rlim_cur: low, rlim_max: hard };
    // SAFETY: setrlimit with a valid struct; lowering the soft limit needs no privilege.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &rl) }, 0);
    assert_eq!(open_files::for_actions(), None, "nothing raised yet");

    let (before, after) = open_files::raise().unwrap();
    assert_eq!((before, after), (low, hard.min(1 << 20)));
    assert_eq!(soft_and_hard().0, after, "this process now has the raised limit");
    assert_eq!(open_files::for_actions(), Some(low));

    let d = tempfile::tempdir().unwrap();
    let args: Vec<String> = ["/bin/sh", "-c", "ulimit -Sn"].iter().map(|s| s.to_string()).collect();
    let env = vec![("PATH".to_string(), "/usr/bin:/bin".to_string())];
    let (stdout, stderr) = (d.path().join("stdout"), d.path().join("stderr"));
    let spec = Spec {
        limits: Limits::default(),
        cgroups: None,
        spawner: None,
        args: &args,
        env: &env,
        cwd: d.path(),
        stdout: &stdout,
        stderr: &stderr,
        timeout: Duration::from_secs(30),
    };
    let out = process::run(spec, std::future::pending()).await.unwrap();
    assert_eq!(out.ending, Ending::Exited(0));
    assert_eq!(std::fs::read_to_string(&stdout).unwrap().trim(), low.to_string(), "the action got the original");
}
