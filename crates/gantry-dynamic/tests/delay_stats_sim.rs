//! Hand-computed cases for the learned delay, the race statistics and the
//! simulator's headline claims.

use std::time::Duration;

use gantry_dynamic::coordinator::{Branch, Coordinator, Event, RaceConfig};
use gantry_dynamic::delay::{
    choose_delay, shape_key, update, DelayConfig, DelayPlan, DelayStore, Dist, Observation, Sample, ShapeStats,
    STORE_VERSION,
};
use gantry_dynamic::race_stats::{estimate_standalone, RaceStats};
use gantry_dynamic::sim::{self, SimConfig};
use gantry_dynamic::Error;

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

fn done(v: u64) -> Sample {
    Sample { ms: v, censored: false }
}

fn cut(v: u64) -> Sample {
    Sample { ms: v, censored: true }
}

fn stats(lookups: &[bool], hits: &[u64], miss_known: &[u64], after_miss: &[Sample], local: &[Sample]) -> ShapeStats {
    ShapeStats {
        runs: lookups.len() as u64,
        lookups: lookups.iter().copied().collect(),
        hit_ms: hits.iter().copied().collect(),
        miss_known_ms: miss_known.iter().copied().collect(),
        remote_after_miss: after_miss.iter().copied().collect(),
        local: local.iter().copied().collect(),
    }
}

#[test]
fn kaplan_meier_by_hand() {
    // 100 done, 200 cut, 300 done: S drops 1/3 at 100; at 300 one at risk
    // carries the remaining 2/3.
    let d = Dist::kaplan_meier([done(100), cut(200), done(300)], Some(1e6)).unwrap();
    assert_eq!(d.points.len(), 2);
    assert!((d.points[0].0 - 100.0).abs() < 1e-9 && (d.points[0].1 - 1.0 / 3.0).abs() < 1e-9);
    assert!((d.points[1].0 - 300.0).abs() < 1e-9 && (d.points[1].1 - 2.0 / 3.0).abs() < 1e-9);
    // Only censored samples: all mass at the horizon.
    assert_eq!(Dist::kaplan_meier([cut(500)], Some(9.0)).unwrap().points, vec![(9.0, 1.0)]);
    assert!(Dist::kaplan_meier([], Some(9.0)).is_none());
    // Optimistic tail: at the longest censored run.
    assert_eq!(Dist::kaplan_meier([done(100), cut(500)], None).unwrap().points, vec![(100.0, 0.5), (500.0, 0.5)]);
}

#[test]
fn no_history_uses_cold_start() {
    let cfg = DelayConfig::default();
    assert_eq!(choose_delay(&ShapeStats::default(), &cfg), cfg.cold_start);
}

#[test]
fn always_hit_waits_for_the_hit() {
    // p = 1, hit 300 ms, local 2000 ms, cost 0.25:
    // J(0) = 300 + 0.25 * 300 = 375; J(300) = 300 -> wait 300 ms.
    // After a miss (never seen: remote may never come) start local at once.
    let s = stats(&[true; 10], &[300; 10], &[], &[], &[done(2000); 10]);
    let plan = choose_delay(&s, &DelayConfig::default());
    assert_eq!(plan, DelayPlan { initial: ms(300), after_miss: ms(0) });
}

#[test]
fn never_hit_and_local_faster_starts_at_once() {
    // After miss: J(0) = 800 + 0.25 * 800 = 1000 < J(4200) = 5000.
    let s = stats(&[false; 10], &[], &[30; 10], &[done(5000); 10], &[done(800); 10]);
    assert_eq!(choose_delay(&s, &DelayConfig::default()), DelayPlan { initial: ms(0), after_miss: ms(0) });
}

#[test]
fn never_hit_and_remote_faster_waits_until_remote_is_due() {
    // After miss: J(0) = 1500 + 0.25 * 1500 = 1875, J(1500) = 1500.
    // Initially: J(0) = 1530 + 0.25 * 1530 = 1912.5, J(30) = 1905, and any
    // d > 30 defers to the miss re-plan: start 1530, J = 1530.
    let s = stats(&[false; 10], &[], &[30; 10], &[done(1500); 10], &[done(6000); 10]);
    assert_eq!(choose_delay(&s, &DelayConfig::default()), DelayPlan { initial: ms(1530), after_miss: ms(1500) });
}

#[test]
fn censored_remote_is_not_mistaken_for_fast() {
    // Local always won at 900 ms, so remote was cut at ~900 ms every time.
    // Taken at face value remote would look as fast as local and the delay
    // would grow; with Kaplan-Meier its mass sits at the horizon.
    let s = stats(&[false; 10], &[], &[30; 10], &[cut(870); 10], &[done(900); 10]);
    assert_eq!(choose_delay(&s, &DelayConfig::default()).after_miss, ms(0));
    let naive = stats(&[false; 10], &[], &[30; 10], &[done(870); 10], &[done(900); 10]);
    assert!(choose_delay(&naive, &DelayConfig::default()).after_miss > ms(0));
}

#[test]
fn local_cut_short_by_hits_is_still_tried_after_a_miss() {
    // Local only ever ran until a quick hit (cut at 300 ms). After a miss,
    // remote needs ~3 s, and local's tail sits at 300 ms: start at once.
    let s = stats(&[true, true, true, false], &[300; 3], &[30], &[done(3000)], &[cut(300); 3]);
    assert_eq!(choose_delay(&s, &DelayConfig::default()).after_miss, ms(0));
    // Local cut at remote's 1500 ms every time: at least as slow, so wait.
    let s = stats(&[false; 4], &[], &[30; 4], &[done(1500); 4], &[cut(1500); 4]);
    assert_eq!(choose_delay(&s, &DelayConfig::default()).after_miss, ms(1500));
}

#[test]
fn local_cost_zero_never_waits() {
    let cfg = DelayConfig { local_cost: 0.0, ..DelayConfig::default() };
    let s = stats(&[true; 10], &[300; 10], &[], &[], &[done(2000); 10]);
    assert_eq!(choose_delay(&s, &cfg).initial, ms(0));
}

#[test]
fn history_is_bounded_and_observations_come_from_reports() {
    let cfg = DelayConfig { history: 3, ..DelayConfig::default() };
    let mut s = ShapeStats::default();
    for i in 0..5 {
        update(&mut s, &Observation { local: Some(done(i)), cache_hit: Some(i % 2 == 0), ..Default::default() }, &cfg);
    }
    assert_eq!(s.runs, 5);
    assert_eq!(s.local.iter().map(|x| x.ms).collect::<Vec<_>>(), vec![2, 3, 4]);
    assert_eq!(s.lookups.len(), 3);

    // Local starts at 0, miss known at 40, local ready at 900: remote is cut
    // 860 ms after the miss, local is complete at 900 ms.
    let mut c = Coordinator::new(RaceConfig::dynamic(DelayPlan::fixed(Duration::ZERO)));
    c.handle(ms(0), Event::Start);
    c.handle(ms(40), Event::RemoteCacheMiss);
    c.handle(ms(900), Event::LocalReadyToWrite { exit_code: 0 });
    let o = Observation::from_report(c.report());
    assert_eq!(o.cache_hit, Some(false));
    assert_eq!(o.miss_known_ms, Some(40));
    assert_eq!(o.remote_after_miss, Some(cut(860)));
    assert_eq!(o.local, Some(done(900)));
}

#[test]
fn store_roundtrips_and_rejects_other_versions() {
    let cfg = DelayConfig::default();
    let mut store = DelayStore::default();
    store.record("cc -c *.c", &Observation { cache_hit: Some(true), hit_ms: Some(120), ..Default::default() }, &cfg);
    let text = store.to_json().unwrap();
    assert_eq!(DelayStore::from_json(&text).unwrap(), store);
    let bumped = text.replacen(&format!("\"version\": {STORE_VERSION}"), "\"version\": 99", 1);
    assert!(matches!(DelayStore::from_json(&bumped), Err(Error::UnsupportedVersion { found: 99, .. })));
    assert!(matches!(DelayStore::from_json("{"), Err(Error::Json(_))));
    assert!(DelayConfig { local_cost: -1.0, ..cfg }.validate().is_err());
}

#[test]
fn shape_key_drops_values_and_operands() {
    let argv: Vec<String> =
        ["/usr/bin/gcc", "-O2", "-Iinc", "--sysroot=/x", "-c", "src/foo.c", "-o", "out/foo.o", "Makefile"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    assert_eq!(shape_key(&argv), "gcc -O2 -Iinc --sysroot -c *.c -o *.o *");
}

#[test]
fn race_stats_count_wins_and_time_saved() {
    let cfg = DelayConfig::default();
    // History: local takes 2000 ms (median), remote hits at 300 ms half the time,
    // misses known at 50 ms and ready 1000 ms later.
    let hist = stats(
        &[true, false, true, false],
        &[300, 300],
        &[50, 50],
        &[done(1000), done(1000)],
        &[done(2000), done(2000), done(2000)],
    );
    assert_eq!(estimate_standalone(&hist, Branch::Local, &cfg), Some(ms(2000)));
    // 0.5 * 300 + 0.5 * (50 + 1000) = 675 ms.
    assert_eq!(estimate_standalone(&hist, Branch::Remote, &cfg), Some(ms(675)));

    let mut rs = RaceStats::default();
    let mut c = Coordinator::new(RaceConfig::dynamic(DelayPlan::fixed(ms(500))));
    c.handle(ms(0), Event::Start);
    c.handle(ms(300), Event::RemoteCacheHit { exit_code: 0 });
    c.handle(ms(301), Event::OutputLockAcquired(Branch::Remote));
    c.handle(ms(310), Event::OutputsWritten);
    assert!(c.is_finished());
    rs.record("cc", c.report(), Some(&hist), &cfg);
    // Remote won at 300 ms; local alone would take 2000 ms: 1700 ms saved.
    let t = rs.total();
    assert_eq!((t.runs, t.remote_wins, t.cache_hits, t.local_wins, t.saved_ms, t.wall_ms), (1, 1, 1, 0, 1700, 310));
    let table = rs.to_string();
    assert!(table.lines().next().unwrap().contains("saved s"));
    assert!(table.lines().any(|l| l.starts_with("cc ") && l.contains("1.7")));
    assert!(table.lines().last().unwrap().starts_with("total"));
}

#[test]
fn simulation_learned_delay_is_near_the_oracle() {
    let config = SimConfig { commands: 1500, ..SimConfig::default() };
    let report = sim::run(&config);
    let learned = report.over_oracle_pct(sim::DYNAMIC_LEARNED).unwrap();
    let fixed = report.over_oracle_pct(sim::DYNAMIC_FIXED).unwrap();
    eprintln!("{report}");
    assert!(learned < 5.0, "learned delay {learned:.1}% above the oracle");
    assert!(learned < fixed, "learned {learned:.1}% vs fixed {fixed:.1}%");
    // The delay's purpose: far less local work than racing at once.
    let cpu = |n| report.row(n).unwrap().local_cpu_s;
    assert!(cpu(sim::DYNAMIC_LEARNED) < 0.5 * cpu(sim::DYNAMIC_ZERO));
    // Seeded: the same configuration gives the same numbers.
    assert_eq!(sim::run(&config).rows, report.rows);
}
