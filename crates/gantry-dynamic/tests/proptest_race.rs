//! Property tests: random event sequences (valid or not, with random gaps and
//! duplicates) never break the race invariants, and a random but well-behaved
//! driver always reaches `Finish`.

use std::time::Duration;

use gantry_dynamic::audit::{check_trace, Step};
use gantry_dynamic::coordinator::{Branch, Command, Coordinator, Event, RaceConfig, Strategy as Mode};
use gantry_dynamic::delay::DelayPlan;
use proptest::prelude::*;

fn event() -> impl proptest::strategy::Strategy<Value = Event> {
    let branch = prop_oneof![Just(Branch::Local), Just(Branch::Remote)];
    prop_oneof![
        Just(Event::Start),
        Just(Event::DelayElapsed),
        Just(Event::LocalStarted),
        (0..3i32).prop_map(|exit_code| Event::LocalReadyToWrite { exit_code }),
        Just(Event::LocalFailed { reason: "l".into() }),
        Just(Event::RemoteCacheMiss),
        (0..3i32).prop_map(|exit_code| Event::RemoteCacheHit { exit_code }),
        (0..3i32).prop_map(|exit_code| Event::RemoteReadyToWrite { exit_code }),
        Just(Event::RemoteFailed { reason: "r".into() }),
        branch.clone().prop_map(Event::CancelConfirmed),
        branch.prop_map(Event::OutputLockAcquired),
        Just(Event::OutputsWritten),
        Just(Event::OutputsWriteFailed { reason: "w".into() }),
        Just(Event::UserCancelled),
        Just(Event::TimedOut),
    ]
}

fn strategy() -> impl proptest::strategy::Strategy<Value = Mode> {
    prop_oneof![Just(Mode::Dynamic), Just(Mode::Local), Just(Mode::Remote), Just(Mode::CacheOnly)]
}

fn config() -> impl proptest::strategy::Strategy<Value = RaceConfig> {
    (strategy(), 0..200u64, 0..200u64, any::<bool>()).prop_map(|(strategy, i, m, upload)| RaceConfig {
        strategy,
        delay: DelayPlan { initial: Duration::from_millis(i), after_miss: Duration::from_millis(m) },
        upload_local_results: upload,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_sequences_keep_invariants(
        config in config(),
        events in proptest::collection::vec((0..150u64, event()), 0..40),
    ) {
        let mut c = Coordinator::new(config.clone());
        let mut now = Duration::ZERO;
        let mut trace = vec![Step { at: now, event: Event::Start, commands: c.handle(now, Event::Start) }];
        for (gap, e) in events {
            now += Duration::from_millis(gap);
            trace.push(Step { at: now, event: e.clone(), commands: c.handle(now, e) });
        }
        let summary = check_trace(&config, &trace);
        prop_assert!(summary.is_ok(), "{:?}\n{:#?}", summary.err(), trace);
    }

    /// A driver that answers every command correctly, in a random order
    /// chosen by `picks`, always finishes and passes the audit.
    #[test]
    fn well_behaved_driver_always_finishes(
        config in config(),
        picks in proptest::collection::vec(any::<prop::sample::Index>(), 64),
        local_ok in any::<bool>(),
        remote_hit in any::<bool>(),
        abort in any::<bool>(),
    ) {
        let mut c = Coordinator::new(config.clone());
        let mut pending: Vec<Event> = if abort { vec![Event::UserCancelled] } else { vec![] };
        let mut trace = Vec::new();
        let mut now = Duration::ZERO;
        let mut next = Some(Event::Start);
        let mut picks = picks.into_iter().cycle();
        while let Some(e) = next.take() {
            let cmds = c.handle(now, e.clone());
            for cmd in &cmds {
                match cmd {
                    Command::StartRemote { .. } if remote_hit => pending.push(Event::RemoteCacheHit { exit_code: 0 }),
                    Command::StartRemote { .. } => pending.push(Event::RemoteCacheMiss),
                    Command::StartLocalAfter(_) => pending.push(Event::DelayElapsed),
                    Command::StartLocalNow if local_ok => pending.push(Event::LocalReadyToWrite { exit_code: 0 }),
                    Command::StartLocalNow => pending.push(Event::LocalFailed { reason: "x".into() }),
                    Command::CancelLocal => pending.push(Event::CancelConfirmed(Branch::Local)),
                    Command::CancelRemote => pending.push(Event::CancelConfirmed(Branch::Remote)),
                    Command::AcquireOutputLock(b) => pending.push(Event::OutputLockAcquired(*b)),
                    Command::ReleaseOutputLock => pending.retain(|e| !matches!(e, Event::OutputLockAcquired(_))),
                    Command::WriteOutputs(_) => pending.push(Event::OutputsWritten),
                    _ => {}
                }
            }
            // After a miss the remote branch goes on to execute.
            if e == Event::RemoteCacheMiss && config.strategy != Mode::CacheOnly && !c.is_finished() {
                pending.push(Event::RemoteReadyToWrite { exit_code: 0 });
            }
            trace.push(Step { at: now, event: e, commands: cmds });
            now += Duration::from_millis(50);
            if !pending.is_empty() {
                let i = picks.next().map_or(0, |p| p.index(pending.len()));
                next = Some(pending.swap_remove(i));
            }
        }
        let summary = check_trace(&config, &trace);
        prop_assert!(summary.is_ok(), "{:?}\n{:#?}", summary.err(), trace);
        prop_assert!(c.is_finished(), "stuck\n{:#?}", trace);
    }
}
