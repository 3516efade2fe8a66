//! Size-class learning in the scheduler: the action shape key, the per-key statistics
//! (cached in memory, persisted through `SizeClassStore`), the choice made at submit
//! time, and the recording of outcomes once an action's final result is known.
//!
//! The decisions themselves are the pure functions of gantry-sizeclass; this module only
//! feeds them inputs (stats, classes with workers, queue state, a random draw, the clock).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use gantry_core::reapi;
use gantry_core::{DigestFunction, SizeClassStore};
use gantry_sizeclass::{
    record, select, ActionStats, Decision, Execution, Outcome, QueueState, SelectionConfig, SelectionInput,
    SizeClasses, Timestamp,
};
use prost::Message;
use rand::{Rng, SeedableRng};

pub struct Sizing {
    pub config: SelectionConfig,
    store: Arc<dyn SizeClassStore>,
    cache: Mutex<HashMap<String, ActionStats>>,
    rng: Mutex<rand_chacha::ChaCha8Rng>,
    pub selections: prometheus::IntCounterVec,
    pub retries: prometheus::IntCounterVec,
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

pub fn now() -> Timestamp {
    Timestamp::from_system_time(SystemTime::now())
}

impl Sizing {
    pub fn new(
        config: SelectionConfig,
        store: Arc<dyn SizeClassStore>,
        seed: Option<u64>,
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
        Ok(Sizing { config, store, cache: Mutex::default(), rng: Mutex::new(rng), selections, retries })
    }

    /// Loads a key's statistics into the cache (from the store on first use).
    pub async fn load(&self, key: &str) -> gantry_core::Result<()> {
        if self.cache.lock().expect("poisoned").contains_key(key) {
            return Ok(());
        }
        let stats = match self.store.get(key).await? {
            Some(json) => ActionStats::from_json(&json).unwrap_or_else(|e| {
                tracing::warn!(key, error = %e, "discarding unreadable size class stats");
                ActionStats::new()
            }),
            None => ActionStats::new(),
        };
        self.cache.lock().expect("poisoned").entry(key.to_string()).or_insert(stats);
        Ok(())
    }

    /// Chooses a class for `key` among `classes` (stats must be loaded).
    pub fn choose(
        &self,
        key: &str,
        classes: &SizeClasses,
        requested: Duration,
        queues: Option<&QueueState>,
    ) -> Option<Decision> {
        let stats = self.cache.lock().expect("poisoned").get(key).cloned().unwrap_or_default();
        let draw: f64 = self.rng.lock().expect("poisoned").random();
        let input = SelectionInput { stats: &stats, classes, requested_timeout: requested, queues, draw, now: now() };
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

    /// Records a finished execution and persists the key's statistics.
    pub async fn record(&self, key: &str, largest: u32, execution: Execution) {
        let json = {
            let mut cache = self.cache.lock().expect("poisoned");
            let stats = cache.entry(key.to_string()).or_default();
            if let Err(e) = record(stats, &self.config, largest, &execution, now()) {
                tracing::warn!(key, error = %e, "could not record a size class outcome");
                return;
            }
            stats.to_json()
        };
        if let Err(e) = self.store.put(key, &json).await {
            tracing::error!(key, error = %e, "could not persist size class stats");
        }
    }
}

/// The learner's view of how an execution ended.
pub fn outcome(status_code: i32, exit_code: Option<i32>, wall: Duration) -> Outcome {
    if status_code == tonic::Code::DeadlineExceeded as i32 {
        Outcome::TimedOut(wall)
    } else if status_code == 0 && exit_code == Some(0) {
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

    #[test]
    fn outcomes() {
        let w = Duration::from_secs(2);
        assert_eq!(outcome(0, Some(0), w), Outcome::Succeeded(w));
        assert_eq!(outcome(0, Some(1), w), Outcome::Failed);
        assert_eq!(outcome(tonic::Code::DeadlineExceeded as i32, Some(-1), w), Outcome::TimedOut(w));
        assert_eq!(outcome(tonic::Code::Internal as i32, None, w), Outcome::Failed);
    }
}
