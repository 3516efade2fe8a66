//! Exhaustive interleaving tests of the race coordinator.
//!
//! A model driver reacts to the coordinator's commands the way a real one may:
//! every command opens an independent "stream" of events (the remote branch,
//! the local branch, a timer, the lock, the write, a cancellation confirmation,
//! a user cancel or timeout), and a depth-first search delivers the heads of
//! the streams in *every* possible order. When a branch is cancelled, its
//! unsent results stay deliverable (a branch finishing after it was told to
//! cancel, before or after the confirmation). After `Finish`, all remaining
//! events are delivered late. Every complete sequence is audited with
//! `audit::check_trace` and must finish (liveness) and stay silent afterwards.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use gantry_dynamic::audit::{check_trace, Step};
use gantry_dynamic::coordinator::{Branch, Command, Coordinator, Event, RaceConfig, Strategy};
use gantry_dynamic::delay::DelayPlan;

#[derive(Clone, Copy, Debug)]
enum LocalScript {
    Exit0,
    Exit1,
    Fail,
}

#[derive(Clone, Copy, Debug)]
enum RemoteScript {
    Hit,
    MissThenReady,
    MissThenFail,
    Fail,
}

#[derive(Clone, Debug)]
struct Script {
    local: LocalScript,
    remote: RemoteScript,
    write_ok: bool,
    abort: Option<Event>,
}

#[derive(Clone, Debug)]
struct Stream {
    owner: Option<Branch>,
    lock: bool,
    not_before: Duration,
    events: VecDeque<Event>,
}

#[derive(Clone)]
struct World {
    config: RaceConfig,
    coord: Coordinator,
    now: Duration,
    streams: Vec<Stream>,
    trace: Vec<Step>,
}

#[derive(Default)]
struct Tally {
    sequences: u64,
    outcomes: BTreeMap<String, u64>,
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

impl World {
    fn deliver(&mut self, script: &Script, event: Event) {
        let cmds = self.coord.handle(self.now, event.clone());
        self.trace.push(Step { at: self.now, event, commands: cmds.clone() });
        for cmd in cmds {
            self.react(script, &cmd);
        }
    }

    fn open(&mut self, owner: Option<Branch>, delay: Duration, events: Vec<Event>) {
        self.streams.push(Stream { owner, lock: false, not_before: self.now + delay, events: events.into() });
    }

    fn react(&mut self, script: &Script, cmd: &Command) {
        match cmd {
            Command::StartRemote { cache_only } => {
                let events = match (script.remote, cache_only) {
                    (RemoteScript::Hit, _) => vec![Event::RemoteCacheHit { exit_code: 0 }],
                    (RemoteScript::MissThenReady | RemoteScript::MissThenFail, true) => {
                        vec![Event::RemoteCacheMiss]
                    }
                    (RemoteScript::MissThenReady, false) => {
                        vec![Event::RemoteCacheMiss, Event::RemoteReadyToWrite { exit_code: 0 }]
                    }
                    (RemoteScript::MissThenFail, false) => {
                        vec![Event::RemoteCacheMiss, Event::RemoteFailed { reason: "exec".into() }]
                    }
                    (RemoteScript::Fail, _) => vec![Event::RemoteFailed { reason: "rpc".into() }],
                };
                self.open(Some(Branch::Remote), Duration::ZERO, events);
            }
            Command::StartLocalAfter(delay) => self.open(None, *delay, vec![Event::DelayElapsed]),
            Command::StartLocalNow => {
                let result = match script.local {
                    LocalScript::Exit0 => Event::LocalReadyToWrite { exit_code: 0 },
                    LocalScript::Exit1 => Event::LocalReadyToWrite { exit_code: 1 },
                    LocalScript::Fail => Event::LocalFailed { reason: "spawn".into() },
                };
                self.open(Some(Branch::Local), Duration::ZERO, vec![Event::LocalStarted, result]);
            }
            Command::CancelLocal | Command::CancelRemote => {
                let b = if *cmd == Command::CancelLocal { Branch::Local } else { Branch::Remote };
                // Unsent results stay deliverable, as a separate stream, so they
                // may cross the cancel before or after the confirmation.
                for s in self.streams.iter_mut().filter(|s| s.owner == Some(b)) {
                    s.owner = None;
                }
                self.open(None, Duration::ZERO, vec![Event::CancelConfirmed(b)]);
            }
            Command::AcquireOutputLock(b) => {
                self.open(None, Duration::ZERO, vec![Event::OutputLockAcquired(*b)]);
                if let Some(s) = self.streams.last_mut() {
                    s.lock = true;
                }
            }
            Command::ReleaseOutputLock => self.streams.retain(|s| !s.lock),
            Command::WriteOutputs(_) => {
                let e = if script.write_ok {
                    Event::OutputsWritten
                } else {
                    Event::OutputsWriteFailed { reason: "EXDEV".into() }
                };
                self.open(None, Duration::ZERO, vec![e]);
            }
            Command::CleanupTemp(_) | Command::UploadLocalResult | Command::Finish(_) => {}
        }
    }

    fn take(&mut self, i: usize) -> Event {
        let s = &mut self.streams[i];
        let event = s.events.pop_front().unwrap_or(Event::Start);
        self.now = (self.now + ms(1)).max(s.not_before);
        if s.events.is_empty() {
            self.streams.remove(i);
        }
        event
    }
}

fn explore(world: World, script: &Script, tally: &mut Tally) {
    if world.coord.is_finished() {
        // Deliver everything still outstanding, late, in one order.
        let mut w = world;
        while !w.streams.is_empty() {
            let e = w.take(0);
            w.deliver(script, e);
        }
        let summary =
            check_trace(&w.config, &w.trace).unwrap_or_else(|e| panic!("{e}\nscript {script:?}\ntrace {:#?}", w.trace));
        assert!(summary.finished);
        let outcome = summary.outcome.map(|o| format!("{:?} {:?}", o.winner, o.result)).unwrap_or_default();
        *tally.outcomes.entry(outcome).or_default() += 1;
        tally.sequences += 1;
        return;
    }
    assert!(
        !world.streams.is_empty(),
        "coordinator stuck without pending events\nscript {script:?}\ntrace {:#?}",
        world.trace
    );
    for i in 0..world.streams.len() {
        let mut w = world.clone();
        let e = w.take(i);
        w.deliver(script, e);
        // Safety is checked on every prefix, so a violation is reported at the
        // shortest sequence that shows it.
        if let Err(e) = check_trace(&w.config, &w.trace) {
            panic!("{e}\nscript {script:?}\ntrace {:#?}", w.trace);
        }
        explore(w, script, tally);
    }
}

fn run_all(strategy: Strategy, plans: &[DelayPlan]) -> Tally {
    let mut tally = Tally::default();
    let locals = [LocalScript::Exit0, LocalScript::Exit1, LocalScript::Fail];
    let remotes = [RemoteScript::Hit, RemoteScript::MissThenReady, RemoteScript::MissThenFail, RemoteScript::Fail];
    let aborts = [None, Some(Event::UserCancelled), Some(Event::TimedOut)];
    for &plan in plans {
        for local in locals {
            for remote in remotes {
                for write_ok in [true, false] {
                    for abort in &aborts {
                        let script = Script { local, remote, write_ok, abort: abort.clone() };
                        let config = RaceConfig { strategy, delay: plan, upload_local_results: true };
                        let mut world = World {
                            config: config.clone(),
                            coord: Coordinator::new(config),
                            now: Duration::ZERO,
                            streams: Vec::new(),
                            trace: Vec::new(),
                        };
                        world.deliver(&script, Event::Start);
                        if let Some(a) = script.abort.clone() {
                            world.open(None, Duration::ZERO, vec![a]);
                        }
                        explore(world, &script, &mut tally);
                    }
                }
            }
        }
    }
    tally
}

fn has(t: &Tally, needle: &str) -> bool {
    t.outcomes.keys().any(|k| k.contains(needle))
}

#[test]
fn dynamic_every_interleaving_keeps_the_invariants() {
    let plans = [
        DelayPlan::fixed(Duration::ZERO),
        DelayPlan { initial: ms(100), after_miss: Duration::ZERO },
        DelayPlan { initial: ms(100), after_miss: ms(50) },
    ];
    let t = run_all(Strategy::Dynamic, &plans);
    eprintln!("dynamic: {} sequences; outcomes {:#?}", t.sequences, t.outcomes);
    assert!(t.sequences > 100_000, "only {} sequences", t.sequences);
    // The enumeration really reaches every kind of ending.
    for needle in [
        "Some(Local) Completed { exit_code: 0",
        "Some(Local) Completed { exit_code: 1",
        "Some(Remote) Completed { exit_code: 0, from_cache: true",
        "Some(Remote) Completed { exit_code: 0, from_cache: false",
        "Some(Local) BranchFailed",
        "Some(Remote) BranchFailed",
        "OutputsWriteFailed",
        "None Cancelled",
        "Some(Remote) Cancelled",
        "Some(Local) TimedOut",
    ] {
        assert!(has(&t, needle), "no sequence ended with {needle}");
    }
}

#[test]
fn single_branch_strategies_every_interleaving() {
    let plan = [DelayPlan::fixed(ms(100))];
    for strategy in [Strategy::Local, Strategy::Remote, Strategy::CacheOnly] {
        let t = run_all(strategy, &plan);
        eprintln!("{strategy:?}: {} sequences", t.sequences);
        assert!(t.sequences > 100);
        match strategy {
            Strategy::Local => assert!(!has(&t, "Some(Remote)")),
            Strategy::Remote => assert!(!has(&t, "Some(Local)")),
            _ => assert!(has(&t, "CacheMiss") && !has(&t, "Some(Local)")),
        }
    }
}

/// Blind permutations: every order of a fixed event set, including orders no
/// correct driver would produce (answers before questions). The coordinator
/// must stay safe and silent after `Finish`; it need not finish.
#[test]
fn all_permutations_of_event_sets_are_safe() {
    fn permute(items: &mut Vec<Event>, k: usize, visit: &mut dyn FnMut(&[Event])) {
        if k == items.len() {
            visit(items);
            return;
        }
        for i in k..items.len() {
            items.swap(k, i);
            permute(items, k + 1, visit);
            items.swap(k, i);
        }
    }
    let sets: Vec<Vec<Event>> = vec![
        // Local done vs remote done, both writes and confirmations.
        vec![
            Event::LocalReadyToWrite { exit_code: 0 },
            Event::RemoteReadyToWrite { exit_code: 0 },
            Event::CancelConfirmed(Branch::Local),
            Event::CancelConfirmed(Branch::Remote),
            Event::OutputLockAcquired(Branch::Local),
            Event::OutputLockAcquired(Branch::Remote),
            Event::OutputsWritten,
            Event::LocalStarted,
        ],
        // Failures racing successes, with a late user cancel.
        vec![
            Event::LocalFailed { reason: "l".into() },
            Event::RemoteCacheHit { exit_code: 0 },
            Event::RemoteFailed { reason: "r".into() },
            Event::CancelConfirmed(Branch::Local),
            Event::CancelConfirmed(Branch::Remote),
            Event::OutputLockAcquired(Branch::Remote),
            Event::OutputsWriteFailed { reason: "w".into() },
            Event::UserCancelled,
        ],
        // Timer, miss re-plan, timeout and duplicates.
        vec![
            Event::DelayElapsed,
            Event::RemoteCacheMiss,
            Event::DelayElapsed,
            Event::LocalReadyToWrite { exit_code: 0 },
            Event::TimedOut,
            Event::CancelConfirmed(Branch::Remote),
            Event::OutputLockAcquired(Branch::Local),
            Event::OutputsWritten,
        ],
    ];
    let mut total = 0u64;
    for plan in [DelayPlan::fixed(Duration::ZERO), DelayPlan { initial: ms(3), after_miss: ms(1) }] {
        let config = RaceConfig { strategy: Strategy::Dynamic, delay: plan, upload_local_results: true };
        for set in &sets {
            let mut items = set.clone();
            permute(&mut items, 0, &mut |order| {
                let mut c = Coordinator::new(config.clone());
                let mut trace = vec![Step { at: ms(0), event: Event::Start, commands: c.handle(ms(0), Event::Start) }];
                for (i, e) in order.iter().enumerate() {
                    let at = ms(i as u64 + 1);
                    trace.push(Step { at, event: e.clone(), commands: c.handle(at, e.clone()) });
                }
                if let Err(e) = check_trace(&config, &trace) {
                    panic!("{e}\n{trace:#?}");
                }
                total += 1;
            });
        }
    }
    eprintln!("blind permutations: {total}");
    assert_eq!(total, 2 * 3 * 40_320);
}
