//! A Bazel server stuck out of memory: found while the build runs, so the runner stops it
//! and records OOM (split) instead of waiting for the deadline (DEADLINE_EXCEEDED, rerun).
//! The decisions are pure functions of what was read, the heap limit, build progress and
//! a clock passed in; [`watch`] does the reading.
//!
//! Under a heap it cannot fit in, Bazel 4.2.3's server (G1, JDK 17 here) does not always
//! exit 33. Two ways it hangs instead were seen on this project's workspaces:
//!
//! - a GC death spiral: the live set settles just under
//!   `--experimental_oom_more_eagerly_threshold` (21 of 24 MiB, 25 of 28 MiB: 87-89%),
//!   every allocation fails, a full GC frees a few hundred KiB, and that repeats for as
//!   long as anyone waits, with 95-99% of the time in pauses (G1 has no GC-overhead
//!   limit);
//! - stuck after an OutOfMemoryError: it was thrown where Bazel's crash handler could not
//!   run ("thrown from the UncaughtExceptionHandler" in the server's `jvm.out`), the
//!   threads that would finish the command are gone, and the server idles.
//!
//! Bazel's own `java.log` is no signal: its `PostGCMemoryUseRecorder` lines come from a
//! Java thread that stops running in the spiral, and they count non-heap pools too. The
//! JVM's unified GC log, written by the VM itself, keeps a line per pause; the runner
//! starts the server with [`jvm_args`] and tails it, and tails `jvm.out`.

use std::path::Path;
use std::time::Duration;

use crate::classify::OomSignal;

/// One pause from the JVM's unified GC log (`-Xlog:gc`), e.g.
/// `[12.3s] GC(260) Pause Full (G1 Compaction Pause) 21M->20M(24M) 86.833ms`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GcPause {
    pub full: bool,
    pub before_bytes: u64,
    pub after_bytes: u64,
    /// The heap's committed size at the time (at most `-Xmx`).
    pub capacity_bytes: u64,
    pub pause: Duration,
}

/// A pause and when the runner read it, counted from the start of the build.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GcEvent {
    pub at: Duration,
    pub pause: GcPause,
}

/// The startup options that make the server write its GC log to `path`: pauses only
/// (`gc` at info, one line each), uptime decoration, and rotation so a warm server's log
/// stays bounded (a rotated file is a new inode, which the tail notices). The path is
/// quoted: `-Xlog` splits on colons. Needs JDK 9 or newer, which every Bazel since 1.0
/// runs on (its embedded JDK 11, or Debian's 17).
pub fn jvm_args(path: &Path) -> Vec<String> {
    vec![format!("--host_jvm_args=-Xlog:gc:file=\"{}\":uptime:filecount=1,filesize=16m", path.display())]
}

/// Parses one line of the log; None for anything that is not a pause with heap sizes
/// (concurrent phases, other tags, a line cut short).
pub fn parse_line(line: &str) -> Option<GcPause> {
    let rest = &line[line.find("Pause ")? + "Pause ".len()..];
    let full = rest.starts_with("Full");
    // "21M->20M(24M)": the first token with an arrow.
    let sizes = rest.split_whitespace().find(|t| t.contains("->"))?;
    let (before, rest_sizes) = sizes.split_once("->")?;
    let (after, capacity) = rest_sizes.strip_suffix(')')?.split_once('(')?;
    let pause = rest.split_whitespace().last()?.strip_suffix("ms")?.parse::<f64>().ok()?;
    if !pause.is_finite() || pause < 0.0 {
        return None;
    }
    Some(GcPause {
        full,
        before_bytes: size(before)?,
        after_bytes: size(after)?,
        capacity_bytes: size(capacity)?,
        pause: Duration::from_secs_f64(pause / 1000.0),
    })
}

/// "21M" in bytes. HotSpot prints heap sizes in B, K, M or G.
fn size(s: &str) -> Option<u64> {
    let unit = match s.chars().last()? {
        'B' => 1,
        'K' => 1 << 10,
        'M' => 1 << 20,
        'G' => 1 << 30,
        _ => return None,
    };
    s[..s.len() - 1].parse::<u64>().ok()?.checked_mul(unit)
}

/// When a build counts as stuck in GC. Every condition must hold over the last `window`:
///
/// - at least `min_full_gcs` full GCs, and every one of them left at least
///   `min_heap_fraction` of `-Xmx` in use (nothing to reclaim: the live set is the heap);
/// - pauses took at least `min_gc_time_fraction` of the window (GC, not the build, runs);
/// - no build progress (no BEP event but `progress`, see [`is_build_progress`]) during
///   the window.
///
/// A heap that fills up and recovers fails the first (a full GC frees it) or the third
/// (the build moves on); one full GC near the limit fails the count.
///
/// A slower server fails the pause-time condition yet is just as stuck: full GCs that
/// are quick, but every one leaves the heap full, and the build never moves again. So a
/// build also counts as stuck (see [`detect_starved`]) once it has made no progress for
/// `starved_after`, with at least `min_full_gcs_starved` full GCs since its last progress
/// and every one of them at `min_heap_fraction` or more.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpiralRule {
    pub window: Duration,
    pub min_full_gcs: usize,
    pub min_heap_fraction: f64,
    pub min_gc_time_fraction: f64,
    pub starved_after: Duration,
    pub min_full_gcs_starved: usize,
}

impl SpiralRule {
    /// Whether a full GC that left `after_bytes` of a `heap_bytes` heap in use freed
    /// nothing worth having: the live set is the heap.
    fn leaves_heap_full(&self, after_bytes: u64, heap_bytes: u64) -> bool {
        after_bytes as f64 >= self.min_heap_fraction * heap_bytes as f64
    }

    /// The rule with `[batch] gc_spiral_window`. The fractions come from Bazel 4.2.3
    /// (G1) under 20-32 MiB heaps: stuck servers sat at 87-89% of the heap after every
    /// full GC and spent 90-99% of each 30 s in pauses, while builds that succeeded near
    /// their limit (up to 63 full GCs) spent at most 24% of any 30 s in pauses. 80% sits
    /// under the stuck servers; Bazel's eager OOM (90%) catches what is above.
    ///
    /// The starved form: in CI (2026-11-29) a server under a 24 MiB heap made no progress
    /// from 51.8 s to its 300 s deadline while doing 107 full GCs, each leaving 21.0 MiB
    /// in use, yet under 50% of any 30 s in pauses. Four windows without progress and ten
    /// full GCs, all with the heap full, leave no doubt and still stop it well before a
    /// deadline.
    pub fn with_window(window: Duration) -> SpiralRule {
        SpiralRule {
            window,
            min_full_gcs: 3,
            min_heap_fraction: 0.8,
            min_gc_time_fraction: 0.5,
            starved_after: window * 4,
            min_full_gcs_starved: 10,
        }
    }
}

/// Whether a line of the server's `jvm.out` reports an OutOfMemoryError.
pub fn is_oom_error(line: &str) -> bool {
    line.contains("java.lang.OutOfMemoryError")
}

/// Whether a server that reported an OutOfMemoryError at `oom_error_at` and still runs
/// is stuck at `now`: a whole `window` has passed since both the error and the build's
/// last progress. (Bazel that survives its OOM exits 33 within seconds.) Returns when
/// it got stuck.
pub fn detect_after_oom_error(
    window: Duration,
    oom_error_at: Option<Duration>,
    last_progress: Duration,
    now: Duration,
) -> Option<Duration> {
    let since = oom_error_at?.max(last_progress);
    (!window.is_zero() && now.checked_sub(since)? >= window).then_some(since)
}

/// Whether a build is stuck with a full heap at `now` by the rule's starved form: no
/// progress since `last_progress` for `starved_after`, and `full_gcs` full GCs since
/// then (at least `min_full_gcs_starved`) of which the emptiest left `min_after_bytes`
/// in use (at least `min_heap_fraction` of the heap). Returns when it got stuck: its
/// last progress.
pub fn detect_starved(
    rule: &SpiralRule,
    full_gcs: usize,
    min_after_bytes: u64,
    heap_bytes: u64,
    last_progress: Duration,
    now: Duration,
) -> Option<Duration> {
    let quiet = now.checked_sub(last_progress)?;
    (!rule.window.is_zero()
        && heap_bytes > 0
        && quiet >= rule.starved_after
        && full_gcs >= rule.min_full_gcs_starved.max(1)
        && rule.leaves_heap_full(min_after_bytes, heap_bytes))
    .then_some(last_progress)
}

/// Why the watcher says a build is stuck.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Stuck {
    GcSpiral(Spiral),
    /// [`detect_starved`]: `full_gcs` since `stuck_since`, the emptiest leaving
    /// `min_after_bytes`.
    Starved {
        full_gcs: usize,
        min_after_bytes: u64,
        stuck_since: Duration,
        detected_at: Duration,
    },
    AfterOomError {
        stuck_since: Duration,
        detected_at: Duration,
    },
}

impl Stuck {
    pub fn signal(&self) -> OomSignal {
        match self {
            Stuck::GcSpiral(_) | Stuck::Starved { .. } => OomSignal::GcSpiral,
            Stuck::AfterOomError { .. } => OomSignal::OomErrorInLog,
        }
    }

    /// One line for the build's message. Times are seconds into the build.
    pub fn describe(&self, heap_bytes: u64, window: Duration) -> String {
        match self {
            Stuck::GcSpiral(s) => s.describe(heap_bytes, window),
            Stuck::Starved { full_gcs, min_after_bytes, stuck_since, detected_at } => format!(
                "stopped: Bazel's server was stuck with a full heap since {:.1}s into the build (no build progress since, and {full_gcs} full GCs each left at least {:.1} of its {:.0} MiB heap in use, at {:.1}s)",
                stuck_since.as_secs_f64(),
                *min_after_bytes as f64 / (1 << 20) as f64,
                heap_bytes as f64 / (1 << 20) as f64,
                detected_at.as_secs_f64()
            ),
            Stuck::AfterOomError { stuck_since, detected_at } => format!(
                "stopped: Bazel's server was stuck since {:.1}s into the build (java.lang.OutOfMemoryError in its jvm.out, still running and no build progress at {:.1}s)",
                stuck_since.as_secs_f64(),
                detected_at.as_secs_f64()
            ),
        }
    }
}

/// What the detector saw when it decided, for the build's message.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spiral {
    /// Full GCs in the window.
    pub full_gcs: usize,
    /// The least heap any full GC of the window left in use.
    pub min_after_bytes: u64,
    pub gc_time_fraction: f64,
    /// When the build got stuck: the later of its last progress and the first of the
    /// unbroken run of full GCs that left the heap full (as far back as `events` go).
    pub stuck_since: Duration,
    /// When the rule held (the `now` it was given).
    pub detected_at: Duration,
}

impl Spiral {
    fn describe(&self, heap_bytes: u64, window: Duration) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        format!(
            "stopped: Bazel's server was stuck in garbage collection since {:.1}s into the build ({} full GCs in the {}s before {:.1}s each left at least {:.0} of its {:.0} MiB heap in use, {:.0}% of the time in GC, no build progress)",
            self.stuck_since.as_secs_f64(),
            self.full_gcs,
            window.as_secs(),
            self.detected_at.as_secs_f64(),
            mib(self.min_after_bytes),
            mib(heap_bytes),
            self.gc_time_fraction * 100.0,
        )
    }
}

/// The pauses of the `window` before `now`, summed up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GcWindow {
    pub full_gcs: usize,
    /// The least heap any full GC of the window left in use (u64::MAX without one).
    pub min_after_bytes: u64,
    /// Time in pauses over the window's length (may pass 1 when pauses were read late).
    pub gc_time_fraction: f64,
}

impl GcWindow {
    pub fn of(events: &[GcEvent], window: Duration, now: Duration) -> GcWindow {
        let since = now.saturating_sub(window);
        let (mut full_gcs, mut min_after_bytes, mut gc_time) = (0usize, u64::MAX, Duration::ZERO);
        for e in events.iter().filter(|e| e.at > since && e.at <= now) {
            gc_time += e.pause.pause;
            if e.pause.full {
                full_gcs += 1;
                min_after_bytes = min_after_bytes.min(e.pause.after_bytes);
            }
        }
        let gc_time_fraction = if window.is_zero() { 0.0 } else { gc_time.as_secs_f64() / window.as_secs_f64() };
        GcWindow { full_gcs, min_after_bytes, gc_time_fraction }
    }
}

/// What the watcher last saw of a build, for the message of one that ran into its
/// deadline anyway: whatever held the server then, this says whether it was GC.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Seen {
    /// When the watcher looked, from the build's start.
    pub at: Duration,
    pub gc: GcWindow,
    /// When the build last made progress (see [`is_build_progress`]).
    pub last_progress: Duration,
    pub oom_error_at: Option<Duration>,
    /// Full GCs read since the last progress, and the latest full GC of the build: a
    /// server that went quiet long before the window above may have gone quiet full.
    pub full_gcs_since_progress: usize,
    pub last_full_gc: Option<GcEvent>,
}

impl Seen {
    /// One clause for the build's message. Times are seconds into the build.
    pub fn describe(&self, heap_bytes: u64, window: Duration) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let heap = if self.gc.full_gcs == 0 {
            String::new()
        } else {
            format!(" (the least any left in use: {:.1} of {:.0} MiB)", mib(self.gc.min_after_bytes), mib(heap_bytes))
        };
        let oom = self.oom_error_at.map_or(String::new(), |t| {
            format!("; java.lang.OutOfMemoryError in its jvm.out at {:.1}s", t.as_secs_f64())
        });
        let last = self.last_full_gc.map_or("no full GC in the build".to_string(), |e| {
            format!(
                "its last full GC, at {:.1}s, left {:.1} of {:.0} MiB in use",
                e.at.as_secs_f64(),
                mib(e.pause.after_bytes),
                mib(heap_bytes)
            )
        });
        format!(
            "in the {}s before {:.1}s Bazel's server did {} full GCs{heap} and spent {:.0}% of the time in GC; its last build progress was at {:.1}s, {} full GCs since; {last}{oom}",
            window.as_secs(),
            self.at.as_secs_f64(),
            self.gc.full_gcs,
            self.gc.gc_time_fraction * 100.0,
            self.last_progress.as_secs_f64(),
            self.full_gcs_since_progress,
        )
    }
}

/// Whether a line of the BEP JSON file is build progress: any event but `progress`.
/// Bazel writes `progress` events (its buffered stdout and stderr, e.g. "[1,200 / 1,920]
/// 2 actions running") on a timer even while its server crawls from one full GC to the
/// next, so a growing file is no sign the build moves; a configured, completed or failed
/// target or action is. A line that is not an event as expected counts as progress: the
/// watcher must never stop a build on a misreading.
pub fn is_build_progress(line: &str) -> bool {
    let Some(rest) = line.strip_prefix("{\"id\":{\"") else { return !line.trim().is_empty() };
    !rest.starts_with("progress\"")
}

/// Whether the build is in a GC death spiral at `now`. `events` are the pauses read so
/// far in the order read (those after `now` are ignored), `last_progress` is when the
/// build last made progress (see [`is_build_progress`]; or when it started), all counted
/// from the build's start.
pub fn detect(
    rule: &SpiralRule,
    events: &[GcEvent],
    heap_bytes: u64,
    last_progress: Duration,
    now: Duration,
) -> Option<Spiral> {
    detect_in(rule, GcWindow::of(events, rule.window, now), events, heap_bytes, last_progress, now)
}

/// [`detect`] with the window's pauses already summed up (the watcher sums them once per
/// look, for its report too).
fn detect_in(
    rule: &SpiralRule,
    gc: GcWindow,
    events: &[GcEvent],
    heap_bytes: u64,
    last_progress: Duration,
    now: Duration,
) -> Option<Spiral> {
    if rule.window.is_zero() || heap_bytes == 0 {
        return None;
    }
    // Only a window the watcher saw whole: before it, "no progress" would be vacuous.
    let since = now.checked_sub(rule.window)?;
    if last_progress > since {
        return None;
    }
    let full_enough = |after_bytes: u64| rule.leaves_heap_full(after_bytes, heap_bytes);
    let GcWindow { full_gcs, min_after_bytes: min_after, gc_time_fraction } = gc;
    if full_gcs < rule.min_full_gcs.max(1) || !full_enough(min_after) || gc_time_fraction < rule.min_gc_time_fraction {
        return None;
    }
    let run_start = events
        .iter()
        .rev()
        .filter(|e| e.pause.full && e.at <= now)
        .take_while(|e| full_enough(e.pause.after_bytes))
        .last()
        .map_or(since, |e| e.at);
    Some(Spiral {
        full_gcs,
        min_after_bytes: min_after,
        gc_time_fraction: gc_time_fraction.min(1.0),
        stuck_since: run_start.max(last_progress),
        detected_at: now,
    })
}

/// Watches one build from `started` until its server is stuck, and says how; runs until
/// then (the runner aborts it when the build ends). Reads the GC log, the server's
/// `jvm.out` and the BEP file four times a second; keeps the pauses of the last few
/// windows, enough to date the start of a spiral, and publishes what it saw to `seen`.
pub async fn watch(
    mut gc_log: Tail,
    mut jvm_out: Tail,
    mut bep: Tail,
    heap_bytes: u64,
    rule: SpiralRule,
    started: std::time::Instant,
    seen: tokio::sync::watch::Sender<Option<Seen>>,
) -> Stuck {
    let keep = rule.window * 4;
    let mut events: std::collections::VecDeque<GcEvent> = std::collections::VecDeque::new();
    let (mut last_progress, mut oom_error_at) = (Duration::ZERO, None);
    let (mut full_gcs_since_progress, mut last_full_gc, mut min_after_since_progress) = (0, None, u64::MAX);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        let now = started.elapsed();
        let fresh = events.len();
        events.extend(gc_log.read_lines().iter().filter_map(|l| parse_line(l)).map(|pause| GcEvent { at: now, pause }));
        for e in events.range(fresh..).filter(|e| e.pause.full) {
            full_gcs_since_progress += 1;
            min_after_since_progress = min_after_since_progress.min(e.pause.after_bytes);
            last_full_gc = Some(*e);
        }
        while events.front().is_some_and(|e| now.saturating_sub(e.at) > keep) {
            events.pop_front();
        }
        if oom_error_at.is_none() && jvm_out.read_lines().iter().any(|l| is_oom_error(l)) {
            oom_error_at = Some(now);
        }
        if bep.read_lines().iter().any(|l| is_build_progress(l)) {
            last_progress = now;
            full_gcs_since_progress = 0;
            min_after_since_progress = u64::MAX;
        }
        let events = events.make_contiguous();
        let gc = GcWindow::of(events, rule.window, now);
        seen.send_replace(Some(Seen {
            at: now,
            gc,
            last_progress,
            oom_error_at,
            full_gcs_since_progress,
            last_full_gc,
        }));
        if let Some(spiral) = detect_in(&rule, gc, events, heap_bytes, last_progress, now) {
            return Stuck::GcSpiral(spiral);
        }
        if let Some(stuck_since) =
            detect_starved(&rule, full_gcs_since_progress, min_after_since_progress, heap_bytes, last_progress, now)
        {
            return Stuck::Starved {
                full_gcs: full_gcs_since_progress,
                min_after_bytes: min_after_since_progress,
                stuck_since,
                detected_at: now,
            };
        }
        if let Some(stuck_since) = detect_after_oom_error(rule.window, oom_error_at, last_progress, now) {
            return Stuck::AfterOomError { stuck_since, detected_at: now };
        }
    }
}

/// Reads the lines a file gained since the last call: the GC log, `jvm.out` or the BEP
/// file while they are written. A file replaced (rotation, a new server) or cut shorter is
/// read again from its start; bytes that are not yet a whole line wait for the next call;
/// of a line longer than any GC line only its start is kept (enough to tell a BEP event's
/// kind), rather than buffering it without bound.
#[derive(Debug)]
pub struct Tail {
    path: std::path::PathBuf,
    inode: Option<u64>,
    offset: u64,
    partial: Vec<u8>,
}

/// Longer than any line `-Xlog:gc` writes; a line past it is not one.
const MAX_LINE: usize = 4096;
/// Read at most this much per call, so a huge log is caught up over several calls.
const MAX_READ: u64 = 1 << 20;

impl Tail {
    /// Starts at the file's current end: what it holds already belongs to earlier builds.
    pub fn at_end(path: &Path) -> Tail {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).ok();
        Tail {
            path: path.to_path_buf(),
            inode: meta.as_ref().map(|m| m.ino()),
            offset: meta.map_or(0, |m| m.len()),
            partial: Vec::new(),
        }
    }

    /// The whole lines added since the last call. Errors (no file yet) are no lines.
    pub fn read_lines(&mut self) -> Vec<String> {
        use std::io::{Read, Seek, SeekFrom};
        use std::os::unix::fs::MetadataExt;
        let Ok(mut f) = std::fs::File::open(&self.path) else { return Vec::new() };
        let Ok(meta) = f.metadata() else { return Vec::new() };
        if self.inode != Some(meta.ino()) || meta.len() < self.offset {
            self.inode = Some(meta.ino());
            self.offset = 0;
            self.partial.clear();
        }
        if meta.len() == self.offset || f.seek(SeekFrom::Start(self.offset)).is_err() {
            return Vec::new();
        }
        let mut buf = Vec::new();
        let Ok(n) = f.take(MAX_READ).read_to_end(&mut buf) else { return Vec::new() };
        self.offset += n as u64;
        let mut lines = Vec::new();
        for chunk in buf.split_inclusive(|&b| b == b'\n') {
            if chunk.last() == Some(&b'\n') {
                self.partial.extend_from_slice(&chunk[..chunk.len() - 1]);
                self.partial.truncate(MAX_LINE);
                lines.push(String::from_utf8_lossy(&self.partial).into_owned());
                self.partial.clear();
            } else {
                self.partial.extend_from_slice(chunk);
                self.partial.truncate(MAX_LINE);
            }
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn full(at_ms: u64, after_mib: u64, pause_ms: u64) -> GcEvent {
        GcEvent {
            at: Duration::from_millis(at_ms),
            pause: GcPause {
                full: true,
                before_bytes: (after_mib + 1) * MIB,
                after_bytes: after_mib * MIB,
                capacity_bytes: 24 * MIB,
                pause: Duration::from_millis(pause_ms),
            },
        }
    }

    fn young(at_ms: u64, after_mib: u64, pause_ms: u64) -> GcEvent {
        let mut e = full(at_ms, after_mib, pause_ms);
        e.pause.full = false;
        e
    }

    fn rule() -> SpiralRule {
        SpiralRule::with_window(Duration::from_secs(20))
    }

    /// A full GC every 60 ms leaving 21 of 24 MiB, 55 ms each, as a stuck server's log
    /// shows, from `from_s` to `to_s`.
    fn stuck(from_s: u64, to_s: u64) -> Vec<GcEvent> {
        (from_s * 1000..to_s * 1000).step_by(60).map(|t| full(t, 21, 55)).collect()
    }

    #[test]
    fn parses_the_pauses_hotspot_writes_and_nothing_else() {
        let p = parse_line(
            "[656.429s][info][gc             ] GC(16019) Pause Full (G1 Compaction Pause) 21M->20M(24M) 72.009ms",
        )
        .unwrap();
        assert_eq!(
            p,
            GcPause {
                full: true,
                before_bytes: 21 * MIB,
                after_bytes: 20 * MIB,
                capacity_bytes: 24 * MIB,
                pause: Duration::from_micros(72_009)
            }
        );
        let p = parse_line("[0.320s] GC(0) Pause Young (Normal) (G1 Evacuation Pause) 12M->5M(32M) 6.872ms").unwrap();
        assert!(!p.full && p.after_bytes == 5 * MIB && p.capacity_bytes == 32 * MIB);
        assert!(parse_line("[6.436s] GC(247) Pause Full (System.gc()) 20M->20M(24M) 27.101ms").unwrap().full);
        // Parallel GC, sizes in K and G.
        let p = parse_line("[1.0s] GC(3) Pause Full (Ergonomics) 900K->800K(2G) 1.5ms").unwrap();
        assert_eq!((p.before_bytes, p.after_bytes, p.capacity_bytes), (900 << 10, 800 << 10, 2 << 30));
        for junk in [
            "",
            "[0.006s] Using G1",
            "[5.1s] GC(12) Concurrent Mark Cycle 12.345ms",
            "[5.1s] GC(12) Pause Full (G1 Compaction Pause) 21M->2",
            "[5.1s] GC(12) Pause Full (G1 Compaction Pause) 21M->20M(24M) 7",
            "[5.1s] GC(12) Pause Full (G1 Compaction Pause) 21X->20M(24M) 7.0ms",
            "[5.1s] GC(12) Pause Full (G1 Compaction Pause) 99999999999999999999G->20M(24M) 7.0ms",
            "[5.1s] GC(12) Pause Full (G1 Compaction Pause) 21M->20M(24M) NaNms",
            "Pause ",
            "Pause Full ->( ms",
            "\u{fffd}\u{fffd} Pause Full 1M->1M(1M) -1ms",
        ] {
            assert_eq!(parse_line(junk), None, "{junk:?}");
        }
    }

    #[test]
    fn a_server_stuck_in_full_gcs_without_progress_is_a_spiral() {
        // BEP last grew at 25 s; the server has done nothing but full GCs since 15 s.
        let events = stuck(15, 60);
        let s = detect(&rule(), &events, 24 * MIB, Duration::from_secs(25), Duration::from_secs(45)).expect("a spiral");
        assert!(s.full_gcs > 300, "{s:?}");
        assert_eq!(s.min_after_bytes, 21 * MIB);
        assert!(s.gc_time_fraction > 0.9, "{s:?}");
        // Stuck from the later of the last progress and the start of the full GCs.
        assert_eq!((s.stuck_since, s.detected_at), (Duration::from_secs(25), Duration::from_secs(45)));
        let message = Stuck::GcSpiral(s).describe(24 * MIB, rule().window);
        assert!(
            message.contains("since 25.0s into the build") && message.contains("at least 21 of its 24 MiB"),
            "{message}"
        );
        // Progress stopped before the server filled up: stuck from its first full GC.
        let late = stuck(30, 60);
        let s = detect(&rule(), &late, 24 * MIB, Duration::from_secs(10), Duration::from_secs(55)).expect("a spiral");
        assert_eq!(s.stuck_since, Duration::from_secs(30));
        // One moment earlier the build had progressed within the window: not yet.
        assert_eq!(detect(&rule(), &events, 24 * MIB, Duration::from_secs(25), Duration::from_millis(44_999)), None);
    }

    #[test]
    fn no_spiral_before_a_whole_window_was_watched() {
        let events = stuck(0, 30);
        assert_eq!(detect(&rule(), &events, 24 * MIB, Duration::ZERO, Duration::from_secs(19)), None);
        assert!(detect(&rule(), &events, 24 * MIB, Duration::ZERO, Duration::from_secs(21)).is_some());
        // A window of zero turns the detection off.
        let off = SpiralRule::with_window(Duration::ZERO);
        assert_eq!(detect(&off, &events, 24 * MIB, Duration::ZERO, Duration::from_secs(29)), None);
    }

    #[test]
    fn a_high_heap_that_recovers_is_not_a_spiral() {
        // Full GCs back to back near the limit, but each frees the heap down to 50%.
        let events: Vec<GcEvent> = (0..60_000).step_by(60).map(|t| full(t, 12, 55)).collect();
        assert_eq!(detect(&rule(), &events, 24 * MIB, Duration::ZERO, Duration::from_secs(40)), None);
        // Young GCs all the time with the heap at 90%, few full GCs: a busy build.
        let mut events: Vec<GcEvent> = (0..40_000).step_by(50).map(|t| young(t, 22, 40)).collect();
        events.push(full(30_000, 22, 80));
        events.push(full(35_000, 22, 80));
        assert_eq!(detect(&rule(), &events, 24 * MIB, Duration::ZERO, Duration::from_secs(40)), None);
    }

    #[test]
    fn one_full_gc_near_the_limit_then_progress_is_not_a_spiral() {
        let mut events = vec![full(10_000, 22, 90)];
        events.extend((10_100..40_000).step_by(500).map(|t| young(t, 14, 3)));
        assert_eq!(detect(&rule(), &events, 24 * MIB, Duration::from_secs(11), Duration::from_secs(40)), None);
        // Even with no progress at all: one full GC is no spiral.
        assert_eq!(detect(&rule(), &events, 24 * MIB, Duration::ZERO, Duration::from_secs(25)), None);
    }

    #[test]
    fn progress_in_the_window_vetoes_even_a_stuck_looking_heap() {
        let events = stuck(0, 60);
        assert_eq!(detect(&rule(), &events, 24 * MIB, Duration::from_secs(50), Duration::from_secs(60)), None);
        // Thrashing that leaves most of the time to the build is not a spiral either.
        let events: Vec<GcEvent> = (0..60_000).step_by(1000).map(|t| full(t, 21, 100)).collect();
        assert_eq!(detect(&rule(), &events, 24 * MIB, Duration::ZERO, Duration::from_secs(60)), None);
    }

    #[test]
    fn only_bep_events_other_than_progress_are_build_progress() {
        // Lines as Bazel 4.2.3 writes them with --build_event_json_file.
        assert!(!is_build_progress(
            r#"{"id":{"progress":{"opaqueCount":7}},"children":[{"progress":{"opaqueCount":8}}],"progress":{"stderr":"[1,200 / 1,920] 2 actions running\n"}}"#
        ));
        for line in [
            r#"{"id":{"targetCompleted":{"label":"//p0:t0","configuration":{"id":"x"}}},"completed":{"success":true}}"#,
            r#"{"id":{"namedSet":{"id":"3"}},"namedSetOfFiles":{"files":[]}}"#,
            r#"{"id":{"progressive":{}}}"#,
            "something else",
        ] {
            assert!(is_build_progress(line), "{line}");
        }
        assert!(!is_build_progress(""));
    }

    #[test]
    fn what_was_seen_says_whether_the_server_was_in_gc() {
        let events = stuck(15, 60);
        let gc = GcWindow::of(&events, rule().window, Duration::from_secs(45));
        assert_eq!((gc.full_gcs, gc.min_after_bytes), (334, 21 * MIB), "a pause every 60 ms in (25 s, 45 s]");
        let seen = Seen {
            at: Duration::from_secs(45),
            gc,
            last_progress: Duration::from_secs(12),
            oom_error_at: None,
            full_gcs_since_progress: 500,
            last_full_gc: events.last().copied(),
        };
        let m = seen.describe(24 * MIB, rule().window);
        assert!(m.contains("334 full GCs (the least any left in use: 21.0 of 24 MiB)") && m.contains("92%"), "{m}");
        assert!(
            m.contains("last build progress was at 12.0s, 500 full GCs since") && !m.contains("OutOfMemoryError"),
            "{m}"
        );
        // Quiet in the window, but it went quiet full: the message keeps the last full GC.
        let idle = Seen {
            gc: GcWindow::of(&[], rule().window, Duration::from_secs(45)),
            oom_error_at: Some(Duration::from_secs(3)),
            last_full_gc: Some(full(14_000, 22, 90)),
            ..seen
        };
        let m = idle.describe(24 * MIB, rule().window);
        assert!(
            m.contains("did 0 full GCs and spent 0% ") && m.contains("OutOfMemoryError in its jvm.out at 3.0s"),
            "{m}"
        );
        assert!(m.contains("its last full GC, at 14.0s, left 22.0 of 24 MiB in use"), "{m}");
        let none = Seen { last_full_gc: None, full_gcs_since_progress: 0, ..idle };
        assert!(none.describe(24 * MIB, rule().window).contains("0 full GCs since; no full GC in the build"));
    }

    /// The CI case of 2026-11-29: quick full GCs (under 50% of any window in pauses), all
    /// leaving the heap full, and no progress: stuck once `starved_after` has passed, not
    /// before, and never with progress, too few full GCs, or one that freed the heap.
    #[test]
    fn a_server_with_a_full_heap_and_no_progress_for_four_windows_is_starved() {
        let r = rule();
        let s = Duration::from_secs;
        // Quick pauses: the spiral rule never holds on them.
        let quick: Vec<GcEvent> = (52..300).step_by(2).map(|t| full(t * 1000, 21, 30)).collect();
        assert_eq!(detect(&r, &quick, 24 * MIB, s(52), s(200)), None);
        let (gcs, heap) = (107, 21 * MIB);
        assert_eq!(r.starved_after, s(80));
        assert_eq!(detect_starved(&r, gcs, heap, 24 * MIB, s(52), s(131)), None, "not yet four windows");
        assert_eq!(detect_starved(&r, gcs, heap, 24 * MIB, s(52), s(132)), Some(s(52)));
        assert_eq!(detect_starved(&r, 9, heap, 24 * MIB, s(52), s(200)), None, "too few full GCs");
        assert_eq!(detect_starved(&r, gcs, 19 * MIB, 24 * MIB, s(52), s(200)), None, "one freed the heap (under 80%)");
        assert_eq!(detect_starved(&r, 0, u64::MAX, 24 * MIB, s(52), s(200)), None, "no full GC since progress");
        assert_eq!(detect_starved(&r, gcs, heap, 0, s(52), s(200)), None, "heap unknown");
        let stuck = Stuck::Starved { full_gcs: gcs, min_after_bytes: heap, stuck_since: s(52), detected_at: s(132) };
        assert_eq!(stuck.signal(), OomSignal::GcSpiral);
        let m = stuck.describe(24 * MIB, r.window);
        assert!(m.starts_with("stopped: Bazel's server was stuck with a full heap since 52.0s"), "{m}");
        assert!(m.contains("107 full GCs each left at least 21.0 of its 24 MiB"), "{m}");
    }

    #[test]
    fn a_server_still_running_a_window_after_an_oom_error_without_progress_is_stuck() {
        let w = Duration::from_secs(20);
        let s = |x: u64| Duration::from_secs(x);
        assert_eq!(detect_after_oom_error(w, Some(s(30)), s(25), s(50)), Some(s(30)));
        assert_eq!(detect_after_oom_error(w, Some(s(30)), s(25), s(49)), None, "Bazel may still exit 33 on its own");
        // Progress after the error (the error was not fatal) restarts the wait.
        assert_eq!(detect_after_oom_error(w, Some(s(30)), s(40), s(55)), None);
        assert_eq!(detect_after_oom_error(w, Some(s(30)), s(40), s(60)), Some(s(40)));
        assert_eq!(detect_after_oom_error(w, None, s(0), s(600)), None, "no error, no verdict");
        assert_eq!(detect_after_oom_error(Duration::ZERO, Some(s(1)), s(0), s(600)), None, "off");
        assert!(is_oom_error("Exception: java.lang.OutOfMemoryError thrown from the UncaughtExceptionHandler in thread \"skyframe-evaluator 1\""));
        assert!(!is_oom_error("Exception: java.lang.NoClassDefFoundError thrown from the UncaughtExceptionHandler"));
        let stuck = Stuck::AfterOomError { stuck_since: s(30), detected_at: s(50) };
        assert_eq!(stuck.signal(), OomSignal::OomErrorInLog);
        assert!(stuck.describe(24 * MIB, w).contains("since 30.0s into the build"), "{}", stuck.describe(24 * MIB, w));
    }

    #[test]
    fn tail_reads_whole_new_lines_across_partial_writes_rotation_and_overlong_lines() {
        use std::io::Write;
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("gc.log");
        std::fs::write(&path, "an earlier build's line\n").unwrap();
        let mut t = Tail::at_end(&path);
        assert!(t.read_lines().is_empty());
        let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        write!(f, "one\ntw").unwrap();
        assert_eq!(t.read_lines(), ["one"]);
        writeln!(f, "o").unwrap();
        assert_eq!(t.read_lines(), ["two"]);
        write!(f, "{}\nthree\n", "x".repeat(3 * MAX_LINE)).unwrap();
        assert_eq!(t.read_lines(), ["x".repeat(MAX_LINE).as_str(), "three"], "an overlong line's start");
        write!(f, "{}", "y".repeat(2 * MAX_LINE)).unwrap();
        assert!(t.read_lines().is_empty());
        writeln!(f, "{}", "y".repeat(MAX_LINE)).unwrap();
        assert_eq!(t.read_lines(), ["y".repeat(MAX_LINE)], "written over several calls");
        // Rotation: the JVM renames the file and starts a new one.
        std::fs::rename(&path, d.path().join("gc.log.0")).unwrap();
        assert!(t.read_lines().is_empty(), "no file for a moment");
        std::fs::write(&path, "four\n").unwrap();
        assert_eq!(t.read_lines(), ["four"]);
        // Truncated in place (filecount=0): read from the start again.
        std::fs::write(&path, "5\n").unwrap();
        assert_eq!(t.read_lines(), ["5"]);
        // Bytes that are not UTF-8 do not stop the reading.
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"\xff\xfe\nsix\n").unwrap();
        assert_eq!(t.read_lines(), ["\u{fffd}\u{fffd}", "six"]);
    }
}
