//! Size-class learning in the scheduler: the action shape key, the per-key statistics
//! (cached in memory, persisted through `SizeClassStore`), the priors of groups of similar
//! shapes (persisted beside them under `group:` keys), the choice made at submit time,
//! and the recording of outcomes once an action's final result is known.
//!
//! The decisions themselves are the pure functions of gantry-sizeclass; this module only
//! feeds them inputs (stats, classes with workers, queue state, a random draw, the clock).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use gantry_core::reapi;
use gantry_core::{DigestFunction, SizeClassStore};
use gantry_sizeclass::{
    best_class, record, select, ActionStats, Decision, Execution, Outcome, Prior, QueueState, SelectionConfig,
    SelectionInput, SizeClasses, Timestamp,
};
use prost::Message;
use rand::{Rng, SeedableRng};

pub struct Sizing {
    pub config: SelectionConfig,
    store: Arc<dyn SizeClassStore>,
    /// Statistics of recently used shapes. Bounded: a shape evicted from here is read
    /// from the store again on its next use.
    cache: Mutex<HashMap<String, ActionStats>>,
    /// Priors of groups of similar shapes, by group key (see [`shape_groups`]); bounded
    /// like `cache`, and read from the store again when evicted.
    priors: Mutex<HashMap<String, Prior>>,
    cache_capacity: usize,
    rng: Mutex<rand_chacha::ChaCha8Rng>,
    pub selections: prometheus::IntCounterVec,
    pub retries: prometheus::IntCounterVec,
    pub hedges: prometheus::IntCounterVec,
}

/// The action shape: the Action with only its command and platform kept (so changed
/// inputs share statistics), plus the invocation's configuration when Bazel sends it (so
/// a flag change gives a new key).
pub fn shape_key(action: &reapi::Action, configuration_id: &str) -> String {
    let reduced = reapi::Action {
        command_digest: action.command_digest.clone(),
        platform: action.platform.clone(),
        ..Default::default()
    };
    let mut bytes = reduced.encode_to_vec();
    bytes.extend_from_slice(configuration_id.as_bytes());
    DigestFunction::Sha256.digest_of(&bytes).hash_hex()
}

/// The groups of similar shapes an action belongs to, most specific first, as store keys:
/// its mnemonic (from Bazel's RequestMetadata), its command's basename and the
/// configuration; then mnemonic and command; then the mnemonic alone. None when neither a
/// mnemonic nor a command is known: such actions have nothing in common.
pub fn shape_groups(mnemonic: &str, argv0: &str, configuration_id: &str) -> Vec<String> {
    let tool = argv0.rsplit('/').next().unwrap_or_default();
    if mnemonic.is_empty() && tool.is_empty() {
        return Vec::new();
    }
    let key = |parts: &[&str]| {
        let digest = DigestFunction::Sha256.digest_of(parts.join("\0").as_bytes());
        format!("{}{}", gantry_sizeclass::GROUP_KEY_PREFIX, digest.hash_hex())
    };
    let mut groups = vec![key(&["mnemonic+tool+configuration", mnemonic, tool, configuration_id])];
    groups.push(key(&["mnemonic+tool", mnemonic, tool]));
    if !mnemonic.is_empty() {
        groups.push(key(&["mnemonic", mnemonic]));
    }
    groups
}

/// Inserts into a cache of at most `capacity` entries, evicting arbitrary others to make
/// room; an entry already there is kept (it may be newer than `value`).
fn insert_bounded<V>(cache: &mut HashMap<String, V>, capacity: usize, key: &str, value: V) {
    while cache.len() >= capacity && !cache.contains_key(key) {
        let Some(victim) = cache.keys().next().cloned() else { break };
        cache.remove(&victim);
    }
    cache.entry(key.to_string()).or_insert(value);
}

/// A group's prior as stored.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PriorWire {
    v: u64,
    prior: Prior,
}

const PRIOR_FORMAT_VERSION: u64 = 1;

pub fn now() -> Timestamp {
    Timestamp::from_system_time(SystemTime::now())
}

impl Sizing {
    pub fn new(
        config: SelectionConfig,
        store: Arc<dyn SizeClassStore>,
        seed: Option<u64>,
        cache_capacity: usize,
        registry: &prometheus::Registry,
    ) -> gantry_core::Result<Self> {
        config.validate().map_err(|e| gantry_core::Error::invalid(format!("[execution.size_classes]: {e}")))?;
        let selections = prometheus::IntCounterVec::new(
            prometheus::Opts::new("gantry_sizeclass_selections_total", "Size class choices by class and reason"),
            &["class", "reason"],
        )
        .expect("valid metric");
        let retries = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "gantry_sizeclass_retries_total",
                "Retries on the largest class, by the class that failed",
            ),
            &["from_class"],
        )
        .expect("valid metric");
        let hedges = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "gantry_sizeclass_hedges_total",
                "Runs past their hedge time: copied to the largest class, or moved there while queued",
            ),
            &["from_class", "kind"],
        )
        .expect("valid metric");
        let _ = registry.register(Box::new(hedges.clone()));
        let _ = registry.register(Box::new(selections.clone()));
        let _ = registry.register(Box::new(retries.clone()));
        let rng = match seed {
            Some(s) => rand_chacha::ChaCha8Rng::seed_from_u64(s),
            // Draws only need to differ between runs, not to be secret.
            None => rand_chacha::ChaCha8Rng::seed_from_u64(
                SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
                    ^ ((std::process::id() as u64) << 32),
            ),
        };
        Ok(Sizing {
            config,
            store,
            cache: Mutex::default(),
            priors: Mutex::default(),
            cache_capacity: cache_capacity.max(1),
            rng: Mutex::new(rng),
            selections,
            retries,
            hedges,
        })
    }

    /// Loads a key's statistics into the cache (from the store on first use).
    pub async fn load(&self, key: &str) -> gantry_core::Result<()> {
        if self.cache.lock().unwrap_or_else(PoisonError::into_inner).contains_key(key) {
            return Ok(());
        }
        let stats = match self.store.get(key).await? {
            Some(json) => ActionStats::from_json(&json).unwrap_or_else(|e| {
                tracing::warn!(key, error = %e, "discarding unreadable size class stats");
                ActionStats::new()
            }),
            None => ActionStats::new(),
        };
        insert_bounded(&mut self.cache.lock().unwrap_or_else(PoisonError::into_inner), self.cache_capacity, key, stats);
        Ok(())
    }

    /// Loads the priors of `groups` into the cache, for a shape `key` without history
    /// (call after [`Sizing::load`]; a shape with history does not use them).
    pub async fn load_priors(&self, key: &str, groups: &[String]) -> gantry_core::Result<()> {
        let known = self.cache.lock().unwrap_or_else(PoisonError::into_inner).get(key).is_some_and(|s| !s.is_empty());
        if known {
            return Ok(());
        }
        for g in groups {
            self.load_prior(g).await?;
        }
        Ok(())
    }

    async fn load_prior(&self, group: &str) -> gantry_core::Result<()> {
        if self.priors.lock().unwrap_or_else(PoisonError::into_inner).contains_key(group) {
            return Ok(());
        }
        let prior = match self.store.get(group).await? {
            Some(json) => match serde_json::from_str::<PriorWire>(&json) {
                Ok(w) if w.v == PRIOR_FORMAT_VERSION => w.prior,
                Ok(w) => {
                    tracing::warn!(group, version = w.v, "discarding a group prior of an unknown format version");
                    Prior::new()
                }
                Err(e) => {
                    tracing::warn!(group, error = %e, "discarding an unreadable group prior");
                    Prior::new()
                }
            },
            None => Prior::new(),
        };
        insert_bounded(
            &mut self.priors.lock().unwrap_or_else(PoisonError::into_inner),
            self.cache_capacity,
            group,
            prior,
        );
        Ok(())
    }

    /// Chooses a class for `key` among `classes` (stats must be loaded, and for a shape
    /// without history its groups' priors: the most specific group that knows enough
    /// shapes is used).
    pub fn choose(
        &self,
        key: &str,
        groups: &[String],
        classes: &SizeClasses,
        requested: Duration,
        queues: Option<&QueueState>,
    ) -> Option<Decision> {
        let stats = self.cache.lock().unwrap_or_else(PoisonError::into_inner).get(key).cloned().unwrap_or_default();
        let prior = if stats.is_empty() {
            let priors = self.priors.lock().unwrap_or_else(PoisonError::into_inner);
            groups
                .iter()
                .filter_map(|g| priors.get(g))
                .find(|p| p.shapes() >= gantry_sizeclass::PRIOR_MIN_SHAPES)
                .cloned()
        } else {
            None
        };
        let draw: f64 = self.rng.lock().unwrap_or_else(PoisonError::into_inner).random();
        let input = SelectionInput {
            stats: &stats,
            prior: prior.as_ref(),
            classes,
            requested_timeout: requested,
            queues,
            draw,
            now: now(),
        };
        match select(&self.config, &input) {
            Ok(d) => {
                self.selections.with_label_values(&[&d.size_class.to_string(), d.reason.as_str()]).inc();
                Some(d)
            }
            Err(e) => {
                tracing::warn!(key, error = %e, "size class selection failed; using the largest class");
                None
            }
        }
    }

    /// Records a finished execution and persists the key's statistics. When the shape's
    /// best class (among `classes`) changes, so do the priors of its `groups`.
    pub async fn record(&self, key: &str, largest: u32, execution: Execution, groups: &[String], classes: &[u32]) {
        // The key may have been evicted since its action was submitted: start from the
        // stored statistics, not from nothing, or the store would lose its history.
        if let Err(e) = self.load(key).await {
            tracing::error!(key, error = %e, "could not read size class stats; outcome not recorded");
            return;
        }
        // Without groups no prior moves, so the best classes are not worth computing.
        let classes = SizeClasses::new(classes.iter().copied()).ok().filter(|_| !groups.is_empty());
        let (json, best) = {
            let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
            let stats = cache.entry(key.to_string()).or_default();
            // A group counts each shape on its best class; that count moves with it. The
            // best class is a function of the stats, so no per-shape record is kept.
            let best = |s: &ActionStats| classes.as_ref().and_then(|c| best_class(&self.config, s, c));
            let before = best(stats);
            if let Err(e) = record(stats, &self.config, largest, &execution, now()) {
                tracing::warn!(key, error = %e, "could not record a size class outcome");
                return;
            }
            (stats.to_json(), (before, best(stats)))
        };
        if let Err(e) = self.store.put(key, &json).await {
            tracing::error!(key, error = %e, "could not persist size class stats");
        }
        let (before, after) = best;
        if before == after {
            return;
        }
        for g in groups {
            if let Err(e) = self.load_prior(g).await {
                tracing::error!(group = %g, error = %e, "could not read a group prior; not updated");
                continue;
            }
            let json = {
                let mut priors = self.priors.lock().unwrap_or_else(PoisonError::into_inner);
                let p = priors.entry(g.clone()).or_default();
                if let Some(b) = before {
                    p.remove(b);
                }
                if let Some(a) = after {
                    p.add(a);
                }
                let wire = PriorWire { v: PRIOR_FORMAT_VERSION, prior: p.clone() };
                serde_json::to_string(&wire).expect("a prior always serializes")
            };
            if let Err(e) = self.store.put(g, &json).await {
                tracing::error!(group = %g, error = %e, "could not persist a group prior");
            }
        }
    }
}

/// A job's size-class bookkeeping, from submission to its final result: whether the
/// learner chose its class, the class and timeout a retry gets, and its first try.
#[derive(Debug, Clone)]
pub struct Trial {
    /// The class was chosen by the learner (more than one class could run it), so its
    /// outcome is recorded.
    pub learning: bool,
    /// Largest class with workers when the action was submitted.
    pub largest_class: u32,
    /// The timeout the client asked for (a smaller class may run with a shorter one).
    pub requested_timeout: Duration,
    pub shape_key: String,
    /// A failed or timed-out run on a smaller class, waiting for the largest class's result.
    pub first_try: Option<(u32, Outcome)>,
    /// What happened, for the client's ExecuteResponse.message.
    pub notes: Vec<String>,
    /// A copy runs (or ran) on the largest class beside the first run: a failure of
    /// the first run waits for it instead of being retried.
    pub hedged: bool,
    /// Its shape's groups of similar shapes (see [`shape_groups`]).
    pub groups: Vec<String>,
    /// The classes it could run on when submitted.
    pub classes: Vec<u32>,
}

/// What to record once an action's final result is known.
#[derive(Debug, Clone)]
pub struct Learned {
    pub shape_key: String,
    pub groups: Vec<String>,
    pub classes: Vec<u32>,
    pub largest_class: u32,
    pub execution: Execution,
    pub notes: String,
}

impl Trial {
    pub fn new(learning: bool, largest_class: u32, requested_timeout: Duration, shape_key: String) -> Self {
        Trial {
            learning,
            largest_class,
            requested_timeout,
            shape_key,
            first_try: None,
            notes: Vec::new(),
            hedged: false,
            groups: Vec::new(),
            classes: Vec::new(),
        }
    }

    /// After `run` (the job was placed on `placed`): the class to retry on, if any. A
    /// failure or timeout on a smaller class (an out-of-memory kill among the failures) is
    /// retried on the largest class with the original timeout, so the client sees one
    /// execution. Only a run that happened says something about the class: not a missing
    /// input or another infrastructure error, and not a cancellation.
    pub fn retry_after(&mut self, placed: Option<u32>, run: &RunEnd, cancel_requested: bool) -> Option<u32> {
        let smaller = self.learning && placed.is_some_and(|c| c < self.largest_class);
        let ran = run.code == 0 || run.code == tonic::Code::DeadlineExceeded as i32;
        if !smaller || !ran || run.outcome.is_success() || cancel_requested {
            return None;
        }
        self.first_try = Some((run.class, run.outcome));
        let what = match run.outcome {
            Outcome::TimedOut(_) => "timed out",
            _ if run.out_of_memory => "ran out of memory",
            _ => "failed",
        };
        let then = if self.hedged { "the copy on size class" } else { "retried on size class" };
        self.notes.push(format!(
            "{what} on size class {} after {:.1}s; {then} {}",
            run.class,
            run.wall_seconds.max(0.0),
            self.largest_class
        ));
        Some(self.largest_class)
    }

    /// The run on `class` was still going (or still queued) `after` its submission, at
    /// its hedge time: a copy starts on the largest class (or the queued run moves there).
    pub fn hedge(&mut self, class: u32, after: Duration, queued: bool) {
        self.hedged = !queued;
        let (what, then) = if queued { ("still queued", "moved to") } else { ("still running", "hedged on") };
        self.notes.push(format!(
            "{what} for size class {class} {:.1}s after submission; {then} size class {}",
            after.as_secs_f64(),
            self.largest_class
        ));
    }

    /// The copy on the largest class finished first, while the run on `class` had run for
    /// `ran`: that run is cancelled, and its time counts as at least `ran`.
    pub fn hedge_won(&mut self, class: u32, ran: Duration) {
        if self.first_try.is_none() {
            self.first_try = Some((class, Outcome::TimedOut(ran)));
            self.notes.push(format!(
                "the copy on size class {} finished first; the run on size class {class} was cancelled after {:.1}s",
                self.largest_class,
                ran.as_secs_f64()
            ));
        }
    }

    /// The run on `class` finished first; the copy on the largest class was cancelled.
    pub fn first_won(&mut self, class: u32) {
        self.notes.push(format!(
            "the run on size class {class} finished first; the copy on size class {} was cancelled",
            self.largest_class
        ));
    }

    /// What the learner records of the final `run` (None: nothing, as the class was not
    /// learned or the action was cancelled).
    pub fn learned(&self, run: &RunEnd) -> Option<Learned> {
        if !self.learning || run.code == tonic::Code::Cancelled as i32 {
            return None;
        }
        let execution = match self.first_try {
            Some((c0, o0)) => Execution { size_class: c0, outcome: o0, largest_outcome: Some(run.outcome) },
            None => Execution { size_class: run.class, outcome: run.outcome, largest_outcome: None },
        };
        Some(Learned {
            shape_key: self.shape_key.clone(),
            groups: self.groups.clone(),
            classes: self.classes.clone(),
            largest_class: self.largest_class,
            execution,
            notes: self.notes.join("; "),
        })
    }
}

/// How one run on a worker ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunEnd {
    /// The size class it ran on.
    pub class: u32,
    /// Its status: 0 for a completed run whatever its exit code, DEADLINE_EXCEEDED for a
    /// timeout, else cancelled or an infrastructure error.
    pub code: i32,
    pub outcome: Outcome,
    pub wall_seconds: f64,
    /// The worker reported an out-of-memory kill (ExecutionFinished.out_of_memory).
    pub out_of_memory: bool,
}

/// The learner's view of how an execution ended. An out-of-memory kill is a failure
/// whatever the exit code it left: the class was too small to run it.
pub fn outcome(status_code: i32, exit_code: Option<i32>, wall: Duration, out_of_memory: bool) -> Outcome {
    if status_code == tonic::Code::DeadlineExceeded as i32 {
        Outcome::TimedOut(wall)
    } else if status_code == 0 && exit_code == Some(0) && !out_of_memory {
        Outcome::Succeeded(wall)
    } else {
        Outcome::Failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_key_ignores_inputs_but_not_command_platform_or_configuration() {
        let d = |s: &[u8]| Some(DigestFunction::Sha256.digest_of(s).to_proto());
        let a = reapi::Action { command_digest: d(b"cmd"), input_root_digest: d(b"in1"), ..Default::default() };
        let b = reapi::Action { input_root_digest: d(b"in2"), ..a.clone() };
        assert_eq!(shape_key(&a, ""), shape_key(&b, ""), "inputs do not change the shape");
        let c = reapi::Action { command_digest: d(b"other"), ..a.clone() };
        assert_ne!(shape_key(&a, ""), shape_key(&c, ""));
        assert_ne!(shape_key(&a, "k8-opt"), shape_key(&a, "k8-fastbuild"), "configuration changes the key");
        let p = reapi::Action {
            platform: Some(reapi::Platform {
                properties: vec![reapi::platform::Property { name: "a".into(), value: "b".into() }],
            }),
            ..a.clone()
        };
        assert_ne!(shape_key(&a, ""), shape_key(&p, ""));
    }

    fn ended(class: u32, code: i32, outcome: Outcome, wall_seconds: f64) -> RunEnd {
        RunEnd { class, code, outcome, wall_seconds, out_of_memory: false }
    }

    #[test]
    fn a_failure_on_a_smaller_class_is_retried_once_on_the_largest_and_learned_as_both() {
        let w = Duration::from_secs(3);
        let mut t = Trial::new(true, 8, Duration::from_secs(60), "k".into());
        let deadline = tonic::Code::DeadlineExceeded as i32;
        assert_eq!(t.retry_after(Some(2), &ended(2, deadline, Outcome::TimedOut(w), 3.0), false), Some(8));
        assert!(t.notes[0].contains("timed out on size class 2 after 3.0s; retried on size class 8"), "{:?}", t.notes);
        // On the largest class there is nothing larger: the result is final.
        let last = ended(8, 0, Outcome::Succeeded(w), 3.0);
        assert_eq!(t.retry_after(Some(8), &last, false), None);
        let l = t.learned(&last).unwrap();
        assert_eq!((l.execution.size_class, l.execution.outcome), (2, Outcome::TimedOut(w)));
        assert_eq!(l.execution.largest_outcome, Some(Outcome::Succeeded(w)));
        assert_eq!(l.notes, t.notes[0]);
    }

    #[test]
    fn an_out_of_memory_kill_on_a_smaller_class_is_a_failure_retried_on_the_largest() {
        let w = Duration::from_secs(2);
        // The worker's report: status OK, exit 137 (SIGKILL), out_of_memory.
        let o = outcome(0, Some(137), w, true);
        assert_eq!(o, Outcome::Failed);
        let mut t = Trial::new(true, 4, Duration::from_secs(60), "k".into());
        let oom = RunEnd { out_of_memory: true, ..ended(1, 0, o, 2.0) };
        assert_eq!(t.retry_after(Some(1), &oom, false), Some(4));
        assert!(
            t.notes[0].contains("ran out of memory on size class 1 after 2.0s; retried on size class 4"),
            "{:?}",
            t.notes
        );
        let l = t.learned(&ended(4, 0, Outcome::Succeeded(w), 1.0)).unwrap();
        assert_eq!((l.execution.size_class, l.execution.outcome), (1, Outcome::Failed), "class 1 is blamed");
        // Even a run that exited 0 after an OOM kill of one of its processes, if reported
        // so, does not count as a success.
        assert_eq!(outcome(0, Some(0), w, true), Outcome::Failed);
    }

    #[test]
    fn no_retry_for_infrastructure_errors_cancellations_or_unlearned_classes() {
        let w = Duration::from_secs(1);
        let mut t = Trial::new(true, 8, Duration::from_secs(60), "k".into());
        let internal = tonic::Code::Internal as i32;
        assert_eq!(t.retry_after(Some(2), &ended(2, internal, Outcome::Failed, 1.0), false), None, "did not run");
        assert_eq!(t.retry_after(Some(2), &ended(2, 0, Outcome::Failed, 1.0), true), None, "cancelled");
        assert_eq!(t.retry_after(Some(2), &ended(2, 0, Outcome::Succeeded(w), 1.0), false), None, "passed");
        assert!(t.learned(&ended(2, tonic::Code::Cancelled as i32, Outcome::Failed, 1.0)).is_none());
        let mut fixed = Trial::new(false, 8, Duration::from_secs(60), String::new());
        assert_eq!(fixed.retry_after(Some(2), &ended(2, 0, Outcome::Failed, 1.0), false), None);
        assert!(fixed.learned(&ended(2, 0, Outcome::Failed, 1.0)).is_none());
    }

    #[derive(Default)]
    struct Store(Mutex<HashMap<String, String>>);
    #[async_trait::async_trait]
    impl SizeClassStore for Store {
        async fn get(&self, key: &str) -> gantry_core::Result<Option<String>> {
            Ok(self.0.lock().unwrap().get(key).cloned())
        }
        async fn put(&self, key: &str, json: &str) -> gantry_core::Result<()> {
            self.0.lock().unwrap().insert(key.into(), json.into());
            Ok(())
        }
        async fn keys(&self, limit: usize) -> gantry_core::Result<Vec<String>> {
            Ok(self.0.lock().unwrap().keys().take(limit).cloned().collect())
        }
    }

    #[tokio::test]
    async fn a_new_shape_starts_where_similar_shapes_settled_even_after_a_restart() {
        let store = Arc::new(Store::default());
        let config = SelectionConfig { exploration_factor: 0.0, ..Default::default() };
        let sizing = || Sizing::new(config.clone(), store.clone(), Some(1), 100, &prometheus::Registry::new()).unwrap();
        let s = sizing();
        let classes = [1, 2, 4];
        let set = SizeClasses::new(classes).unwrap();
        let gcc = shape_groups("CppCompile", "/usr/bin/gcc", "k8-opt");
        let run = |c, secs| Execution {
            size_class: c,
            outcome: Outcome::Succeeded(Duration::from_secs(secs)),
            largest_outcome: None,
        };
        let choose = |s: &Sizing, key: &str, groups: &[String]| {
            s.choose(key, groups, &set, Duration::from_secs(600), None).expect("a decision")
        };
        // Three compiles settle on class 1: baseline on 4, then as fast on 1.
        for shape in ["c1", "c2", "c3"] {
            s.record(shape, 4, run(4, 10), &gcc, &classes).await;
            s.record(shape, 4, run(1, 10), &gcc, &classes).await;
        }
        // A fourth compile, never seen, starts on class 1, with a hedge.
        s.load("c4").await.unwrap();
        s.load_priors("c4", &gcc).await.unwrap();
        let d = choose(&s, "c4", &gcc);
        assert_eq!((d.size_class, d.reason), (1, gantry_sizeclass::Reason::Prior), "{d:?}");
        assert!(d.hedge_after.is_some());
        // Another tool with the same mnemonic falls back to the mnemonic's group.
        let clang = shape_groups("CppCompile", "external/llvm/bin/clang", "k8-opt");
        s.load_priors("c5", &clang).await.unwrap();
        assert_eq!(choose(&s, "c5", &clang).size_class, 1);
        // A different mnemonic knows nothing: baseline on the largest class.
        let javac = shape_groups("Javac", "external/jdk/bin/java", "k8-opt");
        s.load_priors("j1", &javac).await.unwrap();
        let d = choose(&s, "j1", &javac);
        assert_eq!((d.size_class, d.reason), (4, gantry_sizeclass::Reason::LargestBaseline));
        // Groups are persisted: a restarted scheduler starts new compiles on class 1 too.
        let s2 = sizing();
        s2.load("c6").await.unwrap();
        s2.load_priors("c6", &gcc).await.unwrap();
        assert_eq!(choose(&s2, "c6", &gcc).size_class, 1);
        // A shape whose best class moves up moves its group count with it: two of the
        // three now need class 4 (their class 1 runs fail), and the group's 75% quantile
        // with them.
        for shape in ["c1", "c2"] {
            for _ in 0..3 {
                let failed = Execution {
                    size_class: 1,
                    outcome: Outcome::Failed,
                    largest_outcome: Some(Outcome::Succeeded(Duration::from_secs(10))),
                };
                s2.record(shape, 4, failed, &gcc, &classes).await;
            }
        }
        let s3 = sizing();
        s3.load_priors("c7", &gcc).await.unwrap();
        assert_ne!(choose(&s3, "c7", &gcc).size_class, 1, "the group follows its shapes");
        assert!(shape_groups("", "", "x").is_empty(), "nothing in common");
    }

    #[tokio::test]
    async fn the_stats_cache_is_bounded_and_an_evicted_shape_keeps_its_history() {
        let store = Arc::new(Store::default());
        let s =
            Sizing::new(SelectionConfig::default(), store.clone(), Some(1), 2, &prometheus::Registry::new()).unwrap();
        let run =
            |c| Execution { size_class: c, outcome: Outcome::Succeeded(Duration::from_secs(1)), largest_outcome: None };
        s.record("a", 4, run(4), &[], &[4]).await;
        for k in ["b", "c", "d"] {
            s.load(k).await.unwrap();
        }
        assert!(s.cache.lock().unwrap().len() <= 2, "bounded");
        let before = ActionStats::from_json(&store.0.lock().unwrap()["a"]).unwrap();
        s.record("a", 4, run(4), &[], &[4]).await;
        let after = ActionStats::from_json(&store.0.lock().unwrap()["a"]).unwrap();
        assert_ne!(before.to_json(), after.to_json());
        assert!(after.to_json().len() > before.to_json().len(), "the second outcome joined the first, not replaced it");
    }

    #[test]
    fn outcomes() {
        let w = Duration::from_secs(2);
        assert_eq!(outcome(0, Some(0), w, false), Outcome::Succeeded(w));
        assert_eq!(outcome(0, Some(1), w, false), Outcome::Failed);
        assert_eq!(outcome(0, Some(137), w, true), Outcome::Failed);
        assert_eq!(outcome(tonic::Code::DeadlineExceeded as i32, Some(-1), w, false), Outcome::TimedOut(w));
        assert_eq!(outcome(tonic::Code::Internal as i32, None, w, false), Outcome::Failed);
    }
}
