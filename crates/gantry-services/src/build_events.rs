//! The Build Event Service (`google.devtools.build.v1.PublishBuildEvent`): Bazel's
//! `--bes_backend` streams its build events here. Each stream's Bazel events
//! (`build_event_stream.BuildEvent` in `bazel_event`) are folded into one [`Invocation`]:
//! command, patterns, options, metadata, start and end, exit code, targets and tests. It
//! is stored whole when the stream's last event (`component_stream_finished`) arrives,
//! before that event is acknowledged, so an acknowledged stream is a stored invocation.
//!
//! Events are acknowledged in order. A stream that breaks keeps what it has, in memory,
//! for a retry: Bazel resends the events not yet acknowledged, and those already applied
//! are acknowledged again without being applied twice. An event out of order, or one
//! that cannot be decoded, ends the stream with INVALID_ARGUMENT and drops its events,
//! so no half invocation is ever stored.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::Stream;
use gantry_core::auth::{caller, require_somewhere, Caller, Permission};
use gantry_core::{Invocation, InvocationStore, TargetOutcome, TestOutcome};
use gantry_proto::build_event_stream as bep;
use gantry_proto::devtools_build::v1 as bes;
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::cache_hits::CacheHits;

/// Targets plus tests one invocation may have; past it the stream is refused, as a bound
/// on what one client can make the server hold.
pub const MAX_ENTRIES: usize = 1_000_000;
/// Broken streams kept for a retry, and how long.
const MAX_PENDING: usize = 1024;
const PENDING_FOR: Duration = Duration::from_secs(600);
const BAZEL_EVENT_TYPE: &str = "type.googleapis.com/build_event_stream.BuildEvent";
/// The build tool log Bazel (4.x and later) fills with its critical path, inline.
const CRITICAL_PATH_LOG: &str = "critical path";
/// Most of Bazel's critical path text kept: it lists the path's actions, a few KiB.
const MAX_CRITICAL_PATH: usize = 64 << 10;

/// Which stream: (build id, invocation id, component).
type StreamKey = (String, String, i32);

/// An invocation being received, and the sequence number its next event must have.
#[derive(Debug, Default)]
struct Pending {
    acc: Accumulator,
    next_sequence: i64,
    since: Option<Instant>,
}

/// Cheap to clone: each stream's task holds a clone.
#[derive(Clone)]
pub struct BuildEventService {
    store: Arc<dyn InvocationStore>,
    pending: Arc<Mutex<HashMap<StreamKey, Pending>>>,
    /// Where the ActionCache service counted the invocations' cache lookups.
    cache_hits: Option<Arc<CacheHits>>,
}

impl BuildEventService {
    pub fn new(store: Arc<dyn InvocationStore>) -> Self {
        BuildEventService { store, pending: Arc::default(), cache_hits: None }
    }

    /// Records the cache lookups and hits `hits` counted in the invocation store: as each
    /// build's stream ends, and every [`crate::cache_hits::FLUSH_EVERY`] once
    /// [`Self::start_cache_hits_flusher`] runs.
    pub fn with_cache_hits(mut self, hits: Arc<CacheHits>) -> Self {
        self.cache_hits = Some(hits);
        self
    }

    /// Flushes the counts into the store periodically while the guard lives.
    pub fn start_cache_hits_flusher(&self) -> Option<gantry_core::TaskGuard> {
        self.cache_hits.as_ref().map(|h| h.start_flusher(self.store.clone()))
    }
}

/// What one stream's Bazel events say so far.
#[derive(Debug, Default)]
pub struct Accumulator {
    pub invocation: Invocation,
    targets: BTreeMap<String, TargetOutcome>,
    entries: usize,
}

fn invalid(what: impl Into<String>) -> Status {
    Status::invalid_argument(what.into())
}

impl Accumulator {
    /// Folds in one Bazel event. Events gantry does not read are skipped.
    pub fn apply(&mut self, event: &bep::BuildEvent) -> Result<(), Status> {
        use bep::build_event::Payload;
        use bep::build_event_id::Id;
        let id = event.id.as_ref().and_then(|i| i.id.as_ref());
        let inv = &mut self.invocation;
        match (&event.payload, id) {
            (Some(Payload::Started(s)), _) => {
                inv.command = s.command.clone();
                inv.started_unix_ms = s.start_time_millis;
            }
            (Some(Payload::Expanded(_)), Some(Id::Pattern(p))) => inv.patterns.extend(p.pattern.iter().cloned()),
            (Some(Payload::OptionsParsed(o)), _) => inv.options = o.explicit_cmd_line.clone(),
            (Some(Payload::BuildMetadata(m)), _) => inv.metadata.extend(m.metadata.clone()),
            (Some(Payload::WorkspaceStatus(w)), _) => {
                inv.metadata.extend(w.item.iter().map(|i| (i.key.clone(), i.value.clone())));
            }
            (Some(Payload::Configured(c)), Some(Id::TargetConfigured(t))) if t.aspect.is_empty() => {
                self.target(&t.label)?.kind = c.target_kind.clone();
            }
            (Some(Payload::Completed(c)), Some(Id::TargetCompleted(t))) if t.aspect.is_empty() => {
                let target = self.target(&t.label)?;
                target.success = Some(c.success);
                if target.kind.is_empty() {
                    target.kind = c.target_kind.clone();
                }
            }
            (Some(Payload::Aborted(_)), Some(Id::TargetCompleted(t))) if t.aspect.is_empty() => {
                self.target(&t.label)?.success = Some(false);
            }
            (Some(Payload::TestResult(r)), Some(Id::TestResult(t))) => {
                self.count()?;
                let status = bep::TestStatus::try_from(r.status).map_or("NO_STATUS", |s| s.as_str_name());
                self.invocation.tests.push(TestOutcome {
                    label: t.label.clone(),
                    run: t.run,
                    shard: t.shard,
                    attempt: t.attempt,
                    status: status.to_string(),
                    duration_ms: r.test_attempt_duration_millis,
                    cached_locally: r.cached_locally,
                    logs: r
                        .test_action_output
                        .iter()
                        .filter_map(|f| match &f.file {
                            Some(bep::file::File::Uri(uri)) => Some((f.name.clone(), uri.clone())),
                            _ => None,
                        })
                        .collect(),
                });
            }
            (Some(Payload::BuildToolLogs(logs)), _) => {
                let critical = logs.log.iter().find(|f| f.name == CRITICAL_PATH_LOG);
                if let Some(bep::file::File::Contents(text)) = critical.and_then(|f| f.file.as_ref()) {
                    let text = String::from_utf8_lossy(text);
                    inv.critical_path = cut(&text, MAX_CRITICAL_PATH);
                }
            }
            (Some(Payload::Finished(f)), _) => {
                inv.finished_unix_ms = f.finish_time_millis;
                match &f.exit_code {
                    Some(c) => (inv.exit_code, inv.exit_name) = (c.code, c.name.clone()),
                    None => (inv.exit_code, inv.exit_name) = (-1, String::new()),
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn count(&mut self) -> Result<(), Status> {
        self.entries += 1;
        if self.entries > MAX_ENTRIES {
            return Err(Status::resource_exhausted(format!(
                "an invocation may have at most {MAX_ENTRIES} targets and tests"
            )));
        }
        Ok(())
    }

    fn target(&mut self, label: &str) -> Result<&mut TargetOutcome, Status> {
        if !self.targets.contains_key(label) {
            self.count()?;
        }
        Ok(self
            .targets
            .entry(label.to_string())
            .or_insert_with(|| TargetOutcome { label: label.to_string(), ..Default::default() }))
    }

    /// The invocation so far, with its targets in label order. A copy: if storing it
    /// fails, the stream's state stays whole for Bazel's retry.
    pub fn snapshot(&self) -> Invocation {
        let mut inv = self.invocation.clone();
        inv.targets = self.targets.values().cloned().collect();
        inv.user = Invocation::user_of(&inv.owner, &inv.metadata);
        inv.target_count = inv.targets.len() as u64;
        inv.failed_targets = inv.targets.iter().filter(|t| t.success == Some(false)).count() as u64;
        inv
    }
}

/// At most `max` bytes of `s`, cut at a character boundary.
fn cut(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// The stream an ordered event belongs to, checked.
fn stream_key(o: &bes::OrderedBuildEvent) -> Result<StreamKey, Status> {
    let id = o.stream_id.as_ref().ok_or_else(|| invalid("ordered_build_event.stream_id: required"))?;
    if id.invocation_id.is_empty() {
        return Err(invalid("ordered_build_event.stream_id.invocation_id: required"));
    }
    if id.invocation_id.len() > 256 || id.build_id.len() > 256 {
        return Err(invalid("ordered_build_event.stream_id: ids longer than 256 bytes"));
    }
    Ok((id.build_id.clone(), id.invocation_id.clone(), id.component))
}

/// What one request of a stream leads to.
enum Step {
    /// Acknowledge it.
    Ack(bes::PublishBuildToolEventStreamResponse),
    /// The stream's last event: store the invocation, then acknowledge.
    Finish(Box<Invocation>, bes::PublishBuildToolEventStreamResponse),
}

impl BuildEventService {
    /// Applies one request to the stream's state (taken from the broken streams on its
    /// first request, when it resumes one).
    fn step(
        &self,
        state: &mut Option<(StreamKey, Pending)>,
        req: bes::PublishBuildToolEventStreamRequest,
        owner: &str,
    ) -> Result<Step, Status> {
        let o = req.ordered_build_event.ok_or_else(|| invalid("ordered_build_event: required"))?;
        let key = stream_key(&o)?;
        if state.as_ref().is_some_and(|(k, _)| *k != key) {
            return Err(invalid("ordered_build_event.stream_id: differs from the stream's first event"));
        }
        if state.is_none() {
            let resumed = self.pending.lock().unwrap_or_else(PoisonError::into_inner).remove(&key);
            *state = Some((key.clone(), resumed.unwrap_or_else(|| Pending { next_sequence: 1, ..Default::default() })));
        }
        let (_, p) = state.as_mut().expect("set above");
        let ack = bes::PublishBuildToolEventStreamResponse {
            stream_id: o.stream_id.clone(),
            sequence_number: o.sequence_number,
        };
        if o.sequence_number < p.next_sequence && o.sequence_number >= 1 {
            return Ok(Step::Ack(ack)); // applied before the stream broke: acknowledged again
        }
        if o.sequence_number != p.next_sequence {
            return Err(invalid(format!(
                "ordered_build_event.sequence_number: {} out of order, expected {}",
                o.sequence_number, p.next_sequence
            )));
        }
        let event = o.event.ok_or_else(|| invalid("ordered_build_event.event: required"))?;
        p.since = Some(Instant::now());
        p.acc.invocation.id = key.1.clone();
        p.acc.invocation.build_id = key.0.clone();
        p.acc.invocation.owner = owner.to_string();
        match event.event {
            Some(bes::build_event::Event::BazelEvent(any)) => {
                if any.type_url != BAZEL_EVENT_TYPE {
                    return Err(invalid(format!("bazel_event: type {} is not {BAZEL_EVENT_TYPE}", any.type_url)));
                }
                let e = bep::BuildEvent::decode(any.value.as_slice())
                    .map_err(|e| invalid(format!("bazel_event: undecodable build_event_stream.BuildEvent: {e}")))?;
                p.acc.apply(&e)?;
                p.next_sequence += 1;
                Ok(Step::Ack(ack))
            }
            // Counted as applied only once stored (by the caller, which then drops the
            // state): a failed store leaves it to be sent again.
            Some(bes::build_event::Event::ComponentStreamFinished(_)) => {
                Ok(Step::Finish(Box::new(p.acc.snapshot()), ack))
            }
            _ => {
                p.next_sequence += 1;
                Ok(Step::Ack(ack))
            }
        }
    }

    /// Keeps a broken stream's state for a retry, within bounds.
    fn keep(&self, key: StreamKey, p: Pending) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        pending.retain(|_, p| p.since.is_some_and(|t| t.elapsed() < PENDING_FOR));
        if pending.len() >= MAX_PENDING
            && let Some(oldest) = pending.iter().min_by_key(|(_, p)| p.since).map(|(k, _)| k.clone())
        {
            pending.remove(&oldest);
        }
        pending.insert(key, p);
    }
}

type AckStream = Pin<Box<dyn Stream<Item = Result<bes::PublishBuildToolEventStreamResponse, Status>> + Send>>;

#[tonic::async_trait]
impl bes::publish_build_event_server::PublishBuildEvent for BuildEventService {
    async fn publish_lifecycle_event(
        &self,
        request: Request<bes::PublishLifecycleEventRequest>,
    ) -> Result<Response<()>, Status> {
        require_somewhere(&request, Permission::WriteCas)?;
        // Build-level events (enqueued, finished) carry only the build id; invocation-level
        // ones the invocation id too. gantry keeps neither: the invocation's stream says it all.
        let o = request.get_ref().build_event.as_ref().ok_or_else(|| invalid("build_event: required"))?;
        let id = o.stream_id.as_ref().ok_or_else(|| invalid("build_event.stream_id: required"))?;
        if id.build_id.is_empty() {
            return Err(invalid("build_event.stream_id.build_id: required"));
        }
        Ok(Response::new(()))
    }

    type PublishBuildToolEventStreamStream = AckStream;

    async fn publish_build_tool_event_stream(
        &self,
        request: Request<Streaming<bes::PublishBuildToolEventStreamRequest>>,
    ) -> Result<Response<AckStream>, Status> {
        require_somewhere(&request, Permission::WriteCas)?;
        let owner = match caller(&request) {
            Caller::Identity(id) => id.name.clone(),
            Caller::Unrestricted => String::new(),
        };
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(256);
        let service = self.clone();
        // Not aborted with the response: when the client's connection breaks, the task
        // still has to keep the stream's state for the retry. It ends with the inbound
        // stream, which a broken connection ends too.
        let span = tracing::info_span!("task", name = "bes-stream");
        tokio::spawn(tracing::Instrument::instrument(
            async move {
                let mut state: Option<(StreamKey, Pending)> = None;
                loop {
                    let req = match inbound.message().await {
                        Ok(Some(r)) => r,
                        Ok(None) | Err(_) => break,
                    };
                    let reply = match service.step(&mut state, req, &owner) {
                        Ok(Step::Ack(ack)) => Ok(ack),
                        Ok(Step::Finish(invocation, ack)) => {
                            // Bazel's lookups all precede its stream's last event: recorded
                            // now, the page shows them as soon as the build ends (lookups
                            // other frontends served arrive with their next flush).
                            if let Some(hits) = &service.cache_hits
                                && let Err(e) = hits.flush(service.store.as_ref()).await
                            {
                                tracing::warn!(error = %e, "could not record remote cache counts; retrying later");
                            }
                            match service.store.put(&invocation).await {
                                Ok(()) => {
                                    state = None;
                                    Ok(ack)
                                }
                                // The state is kept, last event unapplied, for the retry.
                                Err(e) => {
                                    tracing::error!(invocation = %invocation.id, error = %e, "could not store an invocation");
                                    Err(Status::from(e))
                                }
                            }
                        }
                        Err(status) => {
                            state = None; // an invalid stream leaves nothing behind
                            Err(status)
                        }
                    };
                    let failed = reply.is_err();
                    if tx.send(reply).await.is_err() || failed {
                        break;
                    }
                }
                if let Some((key, p)) = state {
                    service.keep(key, p);
                }
            },
            span,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct NoStore;
    #[tonic::async_trait]
    impl InvocationStore for NoStore {
        async fn put(&self, _: &Invocation) -> gantry_core::Result<()> {
            Err(gantry_core::Error::Unavailable("down".into()))
        }
        async fn get(&self, _: &str) -> gantry_core::Result<Option<Invocation>> {
            Ok(None)
        }
        async fn list(&self, _: usize, _: Option<i64>) -> gantry_core::Result<Vec<Invocation>> {
            Ok(Vec::new())
        }
        async fn record_cache_counts(&self, _: &str, _: &[gantry_core::CacheCounts]) -> gantry_core::Result<()> {
            Err(gantry_core::Error::Unavailable("down".into()))
        }
    }

    fn req(seq: i64, event: bes::build_event::Event) -> bes::PublishBuildToolEventStreamRequest {
        bes::PublishBuildToolEventStreamRequest {
            ordered_build_event: Some(bes::OrderedBuildEvent {
                stream_id: Some(bes::StreamId { build_id: "b".into(), invocation_id: "i".into(), component: 3 }),
                sequence_number: seq,
                event: Some(bes::BuildEvent { event_time: None, event: Some(event) }),
            }),
            ..Default::default()
        }
    }

    fn started(seq: i64) -> bes::PublishBuildToolEventStreamRequest {
        let e = bep::BuildEvent {
            payload: Some(bep::build_event::Payload::Started(bep::BuildStarted {
                command: "build".into(),
                ..Default::default()
            })),
            ..Default::default()
        };
        let any = prost_types::Any { type_url: BAZEL_EVENT_TYPE.into(), value: e.encode_to_vec() };
        req(seq, bes::build_event::Event::BazelEvent(any))
    }

    fn last(seq: i64) -> bes::PublishBuildToolEventStreamRequest {
        req(
            seq,
            bes::build_event::Event::ComponentStreamFinished(bes::build_event::BuildComponentStreamFinished {
                r#type: 1,
            }),
        )
    }

    #[test]
    fn events_apply_once_in_order_and_the_last_one_waits_for_its_store() {
        let s = BuildEventService::new(Arc::new(NoStore));
        let mut state = None;
        assert!(matches!(s.step(&mut state, started(1), ""), Ok(Step::Ack(a)) if a.sequence_number == 1));
        // Sent again (its ack was lost): acknowledged, not applied twice.
        assert!(matches!(s.step(&mut state, started(1), ""), Ok(Step::Ack(_))));
        let err = s.step(&mut state, started(5), "").err().expect("out of order");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("5 out of order, expected 2"), "{}", err.message());
        // The last event: the invocation to store, the state still there.
        let Ok(Step::Finish(inv, ack)) = s.step(&mut state, last(2), "alice") else { panic!("finish") };
        assert_eq!((inv.command.as_str(), inv.owner.as_str(), ack.sequence_number), ("build", "alice", 2));
        // Its store failed, so the caller kept the state: the retry's last event finishes again.
        assert!(matches!(s.step(&mut state, last(2), "alice"), Ok(Step::Finish(..))));
        // A stream for another invocation on the same connection is refused.
        let mut other = started(3);
        other.ordered_build_event.as_mut().unwrap().stream_id.as_mut().unwrap().invocation_id = "j".into();
        assert_eq!(s.step(&mut state, other, "").err().unwrap().code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn a_broken_stream_is_resumed_from_what_was_kept() {
        let s = BuildEventService::new(Arc::new(NoStore));
        let mut state = None;
        assert!(s.step(&mut state, started(1), "").is_ok());
        let (key, p) = state.take().unwrap();
        s.keep(key, p);
        // A new stream resumes at 2; starting again at 1 is a duplicate, acknowledged.
        let mut resumed = None;
        assert!(matches!(s.step(&mut resumed, started(1), ""), Ok(Step::Ack(_))));
        assert!(matches!(s.step(&mut resumed, last(2), ""), Ok(Step::Finish(inv, _)) if inv.command == "build"));
        // A stream that never began cannot start in the middle.
        let mut fresh = None;
        let mut other = last(4);
        other.ordered_build_event.as_mut().unwrap().stream_id.as_mut().unwrap().invocation_id = "new".into();
        assert_eq!(s.step(&mut fresh, other, "").err().unwrap().code(), tonic::Code::InvalidArgument);
    }
}
