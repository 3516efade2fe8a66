//! Outcome classification: a pure function of what the runner observed.

use serde::{Deserialize, Serialize};

use crate::bep::BepSummary;

/// How a build ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum BuildOutcome {
    Success,
    /// The build itself failed (compile error, bad target, failed action).
    BuildFailed,
    /// Everything built; some tests failed.
    TestsFailed,
    /// Bazel ran out of heap: exit 33, the JVM died of OutOfMemoryError, or the runner
    /// stopped a server stuck out of memory ([`OomSignal`] says which).
    Oom,
    /// Still running at its deadline; stopped by the runner.
    DeadlineExceeded,
    /// Not the targets' fault: Bazel could not start, crashed, lost the remote executor,
    /// rejected its command line, or was killed by something else.
    InfraError,
}

impl BuildOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildOutcome::Success => "SUCCESS",
            BuildOutcome::BuildFailed => "BUILD_FAILED",
            BuildOutcome::TestsFailed => "TESTS_FAILED",
            BuildOutcome::Oom => "OOM",
            BuildOutcome::DeadlineExceeded => "DEADLINE_EXCEEDED",
            BuildOutcome::InfraError => "INFRA_ERROR",
        }
    }

    /// The history's coarser outcome, as the models' training data records it.
    pub fn to_history(self) -> gantry_batch::Outcome {
        match self {
            BuildOutcome::Success => gantry_batch::Outcome::Success,
            BuildOutcome::BuildFailed => gantry_batch::Outcome::BuildFailed,
            BuildOutcome::TestsFailed => gantry_batch::Outcome::TestsFailed,
            BuildOutcome::Oom => gantry_batch::Outcome::Oom,
            BuildOutcome::DeadlineExceeded => gantry_batch::Outcome::DeadlineExceeded,
            BuildOutcome::InfraError => gantry_batch::Outcome::InfraError,
        }
    }
}

/// What told the runner a build ran out of memory (the record's `oom_signal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OomSignal {
    /// Bazel exited 33 (its own OOM exit, e.g. from the eager OOM threshold), or its
    /// BEP said OOM_ERROR.
    #[serde(rename = "exit_33")]
    Exit33,
    /// java.lang.OutOfMemoryError in the server's `jvm.out` or Bazel's output: Bazel
    /// exited otherwise (its server died and the client said 37), or the runner stopped
    /// a server that went on running, without progress, after the error.
    #[serde(rename = "oom_error_in_log")]
    OomErrorInLog,
    /// The runner found the server in a GC death spiral and stopped it (see [`crate::stuck`]).
    #[serde(rename = "gc_spiral")]
    GcSpiral,
}

impl OomSignal {
    pub fn as_str(self) -> &'static str {
        match self {
            OomSignal::Exit33 => "exit_33",
            OomSignal::OomErrorInLog => "oom_error_in_log",
            OomSignal::GcSpiral => "gc_spiral",
        }
    }
}

/// What the runner saw of one Bazel run.
#[derive(Debug, Clone, Default)]
pub struct RunFacts {
    /// The client's exit code; None when it was killed by a signal or never started.
    pub exit_code: Option<i32>,
    /// The runner stopped the build at its deadline.
    pub deadline_hit: bool,
    /// The runner stopped the build because its server was stuck out of memory, and
    /// what told it so ([`OomSignal::GcSpiral`] or [`OomSignal::OomErrorInLog`]).
    pub stopped_stuck: Option<OomSignal>,
    /// Bazel could not be started at all (binary missing, workspace unusable).
    pub start_error: bool,
    /// The JVM reported java.lang.OutOfMemoryError (in its log or Bazel's output).
    pub oom_in_log: bool,
    pub bep: BepSummary,
}

/// Bazel's documented exit codes (Bazel 4.2.3).
const EXIT_BUILD_FAILURE: i32 = 1;
const EXIT_TESTS_FAILED: i32 = 3;
const EXIT_NO_TESTS_FOUND: i32 = 4;
const EXIT_OOM: i32 = 33;

/// Why the build counts as out of memory, if it does: the build is OOM exactly when
/// this is Some.
pub fn oom_signal(f: &RunFacts) -> Option<OomSignal> {
    // A stop decides first: whatever Bazel said while being stopped is an effect of the
    // stop. The runner stops a build for one reason, so a stuck server and the deadline
    // never meet; if they did, the server (found stuck before the deadline) would be it.
    if let Some(signal) = f.stopped_stuck {
        return Some(signal);
    }
    if f.deadline_hit || f.start_error {
        return None;
    }
    let code = f.exit_code.or(f.bep.exit_code);
    if code == Some(EXIT_OOM) || f.bep.exit_code_name.as_deref() == Some("OOM_ERROR") {
        Some(OomSignal::Exit33)
    } else if f.oom_in_log {
        Some(OomSignal::OomErrorInLog)
    } else {
        None
    }
}

pub fn classify(f: &RunFacts) -> BuildOutcome {
    if oom_signal(f).is_some() {
        return BuildOutcome::Oom;
    }
    if f.deadline_hit {
        return BuildOutcome::DeadlineExceeded;
    }
    if f.start_error {
        return BuildOutcome::InfraError;
    }
    let code = f.exit_code.or(f.bep.exit_code);
    match code {
        Some(0) => BuildOutcome::Success,
        // `bazel test` over targets that are not tests built them all: a success.
        Some(EXIT_NO_TESTS_FOUND) => BuildOutcome::Success,
        Some(EXIT_TESTS_FAILED) => BuildOutcome::TestsFailed,
        Some(EXIT_BUILD_FAILURE) if f.bep.tests_failed > 0 && f.bep.targets_failed == 0 => BuildOutcome::TestsFailed,
        Some(EXIT_BUILD_FAILURE) => BuildOutcome::BuildFailed,
        // 2 command line, 8 interrupted, 32 other, 34 remote error, 36 local
        // environment, 37 internal, 38 BEP upload, signals: not the targets' doing.
        _ => BuildOutcome::InfraError,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(code: Option<i32>) -> RunFacts {
        RunFacts { exit_code: code, ..Default::default() }
    }

    #[test]
    fn exit_codes() {
        assert_eq!(classify(&facts(Some(0))), BuildOutcome::Success);
        assert_eq!(classify(&facts(Some(4))), BuildOutcome::Success);
        assert_eq!(classify(&facts(Some(1))), BuildOutcome::BuildFailed);
        assert_eq!(classify(&facts(Some(3))), BuildOutcome::TestsFailed);
        assert_eq!(classify(&facts(Some(33))), BuildOutcome::Oom);
        for c in [2, 8, 32, 34, 36, 37, 38] {
            assert_eq!(classify(&facts(Some(c))), BuildOutcome::InfraError, "exit {c}");
        }
        assert_eq!(classify(&facts(None)), BuildOutcome::InfraError, "killed by a signal");
    }

    #[test]
    fn deadline_wins_over_whatever_the_stop_caused() {
        for code in [None, Some(0), Some(8), Some(33), Some(1)] {
            let f = RunFacts { exit_code: code, deadline_hit: true, oom_in_log: true, ..Default::default() };
            assert_eq!(classify(&f), BuildOutcome::DeadlineExceeded);
            assert_eq!(oom_signal(&f), None);
        }
    }

    #[test]
    fn a_server_stopped_stuck_is_oom_whatever_the_stop_caused() {
        for code in [None, Some(0), Some(8), Some(33), Some(37)] {
            for signal in [OomSignal::GcSpiral, OomSignal::OomErrorInLog] {
                let f =
                    RunFacts { exit_code: code, stopped_stuck: Some(signal), deadline_hit: true, ..Default::default() };
                assert_eq!(classify(&f), BuildOutcome::Oom, "exit {code:?}");
                assert_eq!(oom_signal(&f), Some(signal));
            }
        }
    }

    #[test]
    fn the_signal_names_what_said_oom() {
        assert_eq!(oom_signal(&facts(Some(33))), Some(OomSignal::Exit33));
        let mut f = facts(Some(37));
        f.bep.exit_code_name = Some("OOM_ERROR".into());
        assert_eq!(oom_signal(&f), Some(OomSignal::Exit33));
        let f = RunFacts { exit_code: Some(37), oom_in_log: true, ..Default::default() };
        assert_eq!(oom_signal(&f), Some(OomSignal::OomErrorInLog));
        for code in [None, Some(0), Some(1), Some(3), Some(37)] {
            assert_eq!(oom_signal(&facts(code)), None, "exit {code:?}");
        }
        let names: Vec<String> = [OomSignal::Exit33, OomSignal::OomErrorInLog, OomSignal::GcSpiral]
            .iter()
            .map(|s| {
                let json = serde_json::to_string(s).unwrap();
                assert_eq!(json, format!("\"{}\"", s.as_str()), "stored as shown");
                json
            })
            .collect();
        assert_eq!(names, ["\"exit_33\"", "\"oom_error_in_log\"", "\"gc_spiral\""]);
    }

    #[test]
    fn oom_from_the_jvm_log_or_bep_even_when_the_client_lost_its_server() {
        // Without the eager threshold the server dies and the client reports 37.
        let f = RunFacts { exit_code: Some(37), oom_in_log: true, ..Default::default() };
        assert_eq!(classify(&f), BuildOutcome::Oom);
        let mut f = facts(Some(37));
        f.bep.exit_code_name = Some("OOM_ERROR".into());
        assert_eq!(classify(&f), BuildOutcome::Oom);
        assert_eq!(classify(&RunFacts { start_error: true, ..Default::default() }), BuildOutcome::InfraError);
    }

    #[test]
    fn failed_tests_reported_as_exit_1_are_test_failures_only_if_all_targets_built() {
        let mut f = facts(Some(1));
        f.bep.tests_failed = 2;
        assert_eq!(classify(&f), BuildOutcome::TestsFailed);
        f.bep.targets_failed = 1;
        assert_eq!(classify(&f), BuildOutcome::BuildFailed);
    }
}
