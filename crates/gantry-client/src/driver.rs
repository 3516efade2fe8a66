//! The race driver: carries out `gantry_dynamic::coordinator` commands with real
//! processes, gRPC calls and renames, and feeds back what happened.
//!
//! Each branch is a named task that owns nothing but its temporary directory's
//! contents and reports exactly one terminal event: its result (staged), a failure,
//! or, once it saw the cancel signal and stopped touching its directory,
//! `CancelConfirmed`. The remote branch learns its operation name before it listens
//! for cancellation, so a cancel always reaches the server as CancelOperation; the
//! local branch's process group is killed and reaped by `gantry_worker::process`.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use gantry_core::client::GrpcChannel as Channel;
use gantry_core::google::longrunning::operations_client::OperationsClient;
use gantry_core::google::longrunning::{operation, CancelOperationRequest};
use gantry_core::reapi::action_cache_client::ActionCacheClient;
use gantry_core::reapi::execution_client::ExecutionClient;
use gantry_core::reapi::{
    ActionResult, ExecuteRequest, ExecuteResponse, GetActionResultRequest, UpdateActionResultRequest,
};
use gantry_core::task::{spawn_named, TaskGuard};
use gantry_core::{BlobStore, Digest, DigestFunction};
use gantry_dynamic::coordinator::{Branch, Command, Coordinator, Event, Outcome, RaceConfig, RaceReport, Strategy};
use gantry_dynamic::delay::{shape_key, DelayConfig, DelayPlan};
use gantry_store::GrpcStore;
use gantry_worker::outputs::{Declared, Uploader};
use gantry_worker::process;
use prost::Message;
use tokio::sync::{mpsc, watch};

use crate::action::{self, BlobSource, BuiltAction, CommandLine};
use crate::history::History;
use crate::stage::{move_into_place, Downloader, OutputLock, Staged, TempDir};
use crate::{Error, Result};

/// How long a local command may run (the remote side has the server's own limit).
const LOCAL_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// How long CancelOperation and the first Execute response may take before we give up
/// on them; a cancel must stay bounded even if the server does not answer.
const RPC_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct RemoteTarget {
    /// `grpc://host:port` or `http://host:port`.
    pub url: String,
    pub instance: String,
}

/// Where the local branch's delay comes from in dynamic mode.
#[derive(Debug, Clone, Copy)]
pub enum DelayChoice {
    /// From the shape's history (the cold-start plan for a new shape).
    Learned,
    /// The same delay whatever happened before (Bazel's fixed delay).
    Fixed(Duration),
}

#[derive(Debug, Clone)]
pub struct RunSpec {
    pub command: CommandLine,
    pub strategy: Strategy,
    pub remote: Option<RemoteTarget>,
    pub delay: DelayChoice,
    /// Upload a successful local result to the action cache (needs `remote`).
    pub upload_local_results: bool,
    /// Directory of the history database; `None` runs without history.
    pub history_dir: Option<PathBuf>,
    pub timeout: Option<Duration>,
}

#[derive(Debug, Clone)]
pub struct RunReport {
    pub outcome: Outcome,
    pub stdout: Bytes,
    pub stderr: Bytes,
    pub race: RaceReport,
    pub shape: String,
    pub delay: DelayPlan,
    pub action_digest: Digest,
    /// Input files hashed in this run, and ones whose digest was remembered.
    pub hashed: usize,
    pub remembered: usize,
    /// The remote operation, if the remote branch got as far as executing.
    pub operation: Option<String>,
    /// Whether a local result was uploaded to the action cache.
    pub uploaded: bool,
}

/// What a branch hands over with its terminal event.
#[derive(Debug, Default)]
struct BranchData {
    staged: Vec<Staged>,
    stdout: Bytes,
    stderr: Bytes,
}

#[derive(Default)]
struct Msg {
    event: Option<Event>,
    data: Option<(Branch, BranchData)>,
    lock: Option<OutputLock>,
    operation: Option<String>,
}

fn ev(e: Event) -> Msg {
    Msg { event: Some(e), ..Default::default() }
}

/// Runs `fut` unless the cancel flag is (or becomes) set first.
async fn or_cancel<T>(cancel: &watch::Receiver<bool>, fut: impl Future<Output = T>) -> Option<T> {
    let mut c = cancel.clone();
    tokio::select! {
        biased;
        _ = c.wait_for(|v| *v) => None,
        r = fut => Some(r),
    }
}

struct Remote {
    channel: Channel,
    instance: String,
    cas: Arc<dyn BlobStore>,
}

impl Remote {
    async fn connect(t: &RemoteTarget) -> Result<Remote> {
        let channel = gantry_core::client::connect_lazy(&t.url).map_err(|e| e.context("--remote"))?;
        let cas: Arc<dyn BlobStore> = Arc::new(GrpcStore::new(channel.clone(), t.instance.clone()));
        Ok(Remote { channel, instance: t.instance.clone(), cas })
    }

    fn downloader(&self) -> Downloader {
        Downloader { cas: self.cas.clone(), function: DigestFunction::Sha256 }
    }

    async fn upload_inputs(&self, built: &BuiltAction) -> Result<()> {
        let digests: Vec<Digest> = built.blobs.iter().map(|(d, _)| *d).collect();
        let present = self.cas.find_present(&digests).await?;
        let up = Uploader { cas: self.cas.clone(), function: DigestFunction::Sha256 };
        for ((d, src), here) in built.blobs.iter().zip(present) {
            if here {
                continue;
            }
            match src {
                BlobSource::Bytes(b) => self.cas.put(d, b.clone()).await?,
                BlobSource::File(p) => {
                    let got = up.upload_file(p).await?;
                    if got != *d {
                        return Err(Error::invalid(format!(
                            "input {} changed while gantry run was using it",
                            p.display()
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    async fn put_bytes(&self, data: &Bytes) -> Result<Digest> {
        let d = DigestFunction::Sha256.digest_of(data);
        if !self.cas.has(&d).await? {
            self.cas.put(&d, data.clone()).await?;
        }
        Ok(d)
    }
}

fn exit_code_of(ending: process::Ending) -> std::result::Result<i32, String> {
    match ending {
        process::Ending::Exited(c) => Ok(c),
        // As a shell reports it: the command's result, not a failure to run it.
        process::Ending::Signaled(s) => Ok(128 + s),
        process::Ending::TimedOut => Err(format!("local command timed out after {LOCAL_TIMEOUT:?}")),
        process::Ending::Cancelled => Err("cancelled".into()),
    }
}

/// Links the declared inputs into `exec` (hard links: the same filesystem, no copy;
/// executables too, since the branch must see the user's own bits).
fn stage_inputs(built: &BuiltAction, exec: &Path) -> Result<()> {
    std::fs::create_dir(exec).map_err(|e| Error::io(format!("creating {}", exec.display()), e))?;
    for d in &built.dirs {
        let p = exec.join(d);
        std::fs::create_dir_all(&p).map_err(|e| Error::io(format!("creating {}", p.display()), e))?;
    }
    for f in &built.files {
        let p = exec.join(&f.rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
        }
        if let Err(e) = std::fs::hard_link(&f.abs, &p) {
            if e.raw_os_error() == Some(libc::EXDEV) || e.raw_os_error() == Some(libc::EMLINK) {
                std::fs::copy(&f.abs, &p).map_err(|e| Error::io(format!("copying input {}", f.abs.display()), e))?;
            } else {
                return Err(Error::io(format!("linking input {}", f.abs.display()), e));
            }
        }
    }
    for (rel, target) in &built.symlinks {
        let p = exec.join(rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
        }
        std::os::unix::fs::symlink(target, &p)
            .map_err(|e| Error::io(format!("creating symlink {}", p.display()), e))?;
    }
    let cwd = exec.join(&built.workdir);
    for o in &built.command.output_paths {
        if let Some(parent) = cwd.join(o).parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
        }
    }
    Ok(())
}

async fn local_branch(
    built: Arc<BuiltAction>,
    stage: PathBuf,
    cancel: watch::Receiver<bool>,
    tx: mpsc::UnboundedSender<Msg>,
) {
    let exec = stage.join("exec");
    let b2 = built.clone();
    let e2 = exec.clone();
    let staged = or_cancel(&cancel, async move {
        tokio::task::spawn_blocking(move || stage_inputs(&b2, &e2))
            .await
            .map_err(|e| Error::Core(gantry_core::Error::internal(format!("staging task: {e}"))))?
    })
    .await;
    match staged {
        None => {
            let _ = tx.send(ev(Event::CancelConfirmed(Branch::Local)));
            return;
        }
        Some(Err(e)) => {
            let _ = tx.send(ev(Event::LocalFailed { reason: format!("staging inputs: {e}") }));
            return;
        }
        Some(Ok(())) => {}
    }
    let cwd = exec.join(&built.workdir);
    let env: Vec<(String, String)> =
        built.command.environment_variables.iter().map(|v| (v.name.clone(), v.value.clone())).collect();
    let (out, err) = (stage.join("stdout"), stage.join("stderr"));
    let spec = process::Spec {
        limits: Default::default(),
        cgroups: None,
        spawner: None,
        args: &built.command.arguments,
        env: &env,
        cwd: &cwd,
        stdout: &out,
        stderr: &err,
        timeout: LOCAL_TIMEOUT,
    };
    let _ = tx.send(ev(Event::LocalStarted));
    let mut c = cancel.clone();
    let ran = process::run(spec, async move {
        let _ = c.wait_for(|v| *v).await;
    })
    .await;
    let msg = match ran {
        Err(e) => ev(Event::LocalFailed { reason: e.to_string() }),
        Ok(o) if o.ending == process::Ending::Cancelled => ev(Event::CancelConfirmed(Branch::Local)),
        Ok(o) => match exit_code_of(o.ending) {
            Err(reason) => ev(Event::LocalFailed { reason }),
            Ok(exit_code) => {
                let read = |p: &Path| std::fs::read(p).map(Bytes::from).unwrap_or_default();
                let staged = built
                    .command
                    .output_paths
                    .iter()
                    .filter(|o| std::fs::symlink_metadata(cwd.join(o)).is_ok())
                    .map(|o| Staged { rel: o.clone(), path: cwd.join(o) })
                    .collect();
                let data = BranchData { staged, stdout: read(&out), stderr: read(&err) };
                Msg {
                    event: Some(Event::LocalReadyToWrite { exit_code }),
                    data: Some((Branch::Local, data)),
                    ..Default::default()
                }
            }
        },
    };
    let _ = tx.send(msg);
}

fn decode_response(op: &gantry_core::google::longrunning::Operation) -> std::result::Result<ExecuteResponse, String> {
    match &op.result {
        Some(operation::Result::Response(any)) => {
            ExecuteResponse::decode(any.value.as_slice()).map_err(|e| format!("undecodable ExecuteResponse: {e}"))
        }
        Some(operation::Result::Error(s)) => Err(format!("operation {} failed: {}", op.name, s.message)),
        None => Err(format!("operation {} finished without a result", op.name)),
    }
}

async fn remote_branch(
    remote: Arc<Remote>,
    built: Arc<BuiltAction>,
    stage: PathBuf,
    cache_only: bool,
    cancel: watch::Receiver<bool>,
    tx: mpsc::UnboundedSender<Msg>,
) {
    let msg = remote_work(&remote, &built, &stage, cache_only, &cancel, &tx).await;
    let _ = tx.send(msg);
}

async fn download(
    remote: &Remote,
    result: &ActionResult,
    stage: &Path,
    cancel: &watch::Receiver<bool>,
    hit: bool,
) -> Msg {
    let exit_code = result.exit_code;
    match or_cancel(cancel, remote.downloader().result(result, stage)).await {
        None => ev(Event::CancelConfirmed(Branch::Remote)),
        Some(Err(e)) => ev(Event::RemoteFailed { reason: format!("downloading outputs: {e}") }),
        Some(Ok((staged, stdout, stderr))) => Msg {
            event: Some(if hit {
                Event::RemoteCacheHit { exit_code }
            } else {
                Event::RemoteReadyToWrite { exit_code }
            }),
            data: Some((Branch::Remote, BranchData { staged, stdout, stderr })),
            ..Default::default()
        },
    }
}

async fn remote_work(
    remote: &Remote,
    built: &BuiltAction,
    stage: &Path,
    cache_only: bool,
    cancel: &watch::Receiver<bool>,
    tx: &mpsc::UnboundedSender<Msg>,
) -> Msg {
    let failed = |reason: String| ev(Event::RemoteFailed { reason });
    let cancelled = || ev(Event::CancelConfirmed(Branch::Remote));
    let lookup = GetActionResultRequest {
        instance_name: remote.instance.clone(),
        action_digest: Some(built.action_digest.to_proto()),
        inline_stdout: true,
        inline_stderr: true,
        ..Default::default()
    };
    let mut ac = ActionCacheClient::new(remote.channel.clone());
    match or_cancel(cancel, ac.get_action_result(lookup)).await {
        None => return cancelled(),
        Some(Ok(r)) => return download(remote, &r.into_inner(), stage, cancel, true).await,
        Some(Err(s)) if s.code() == tonic::Code::NotFound => {
            let _ = tx.send(ev(Event::RemoteCacheMiss));
            if cache_only {
                // The miss is this branch's terminal event.
                return Msg::default();
            }
        }
        Some(Err(s)) => return failed(Error::remote("GetActionResult", s).to_string()),
    }
    match or_cancel(cancel, remote.upload_inputs(built)).await {
        None => return cancelled(),
        Some(Err(e)) => return failed(format!("uploading inputs: {e}")),
        Some(Ok(())) => {}
    }
    let req = ExecuteRequest {
        instance_name: remote.instance.clone(),
        // We just looked; a second lookup on the server would only cost time.
        skip_cache_lookup: true,
        action_digest: Some(built.action_digest.to_proto()),
        ..Default::default()
    };
    // Not cancellable until the operation has a name: dropping the call earlier would
    // leave an execution running on the server that nobody can cancel.
    let started = tokio::time::timeout(RPC_GRACE, async {
        let mut stream = ExecutionClient::new(remote.channel.clone()).execute(req).await?.into_inner();
        let first = stream.message().await?;
        Ok::<_, tonic::Status>((stream, first))
    })
    .await;
    let (mut stream, first) = match started {
        Err(_) => return failed(format!("Execute did not answer within {RPC_GRACE:?}")),
        Ok(Err(s)) => return failed(Error::remote("Execute", s).to_string()),
        Ok(Ok((_, None))) => return failed("Execute stream ended before naming its operation".into()),
        Ok(Ok((s, Some(op)))) => (s, op),
    };
    let name = first.name.clone();
    let _ = tx.send(Msg { operation: Some(name.clone()), ..Default::default() });
    let mut last = first;
    while !last.done {
        match or_cancel(cancel, stream.message()).await {
            None => {
                drop(stream);
                let cancel_req = CancelOperationRequest { name: name.clone() };
                let mut ops = OperationsClient::new(remote.channel.clone());
                match tokio::time::timeout(RPC_GRACE, ops.cancel_operation(cancel_req)).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(s)) => tracing::warn!(operation = %name, error = %s, "CancelOperation failed"),
                    Err(_) => tracing::warn!(operation = %name, "CancelOperation timed out"),
                }
                return cancelled();
            }
            Some(Err(s)) => return failed(Error::remote("Execute stream", s).to_string()),
            Some(Ok(None)) => return failed(format!("Execute stream of {name} ended before the operation was done")),
            Some(Ok(Some(op))) => last = op,
        }
    }
    gantry_core::client::finish_stream(&mut stream, RPC_GRACE).await;
    let resp = match decode_response(&last) {
        Ok(r) => r,
        Err(reason) => return failed(reason),
    };
    if let Some(s) = resp.status.as_ref().filter(|s| s.code != 0) {
        return failed(format!("remote execution failed: {} ({})", s.message, tonic::Code::from(s.code)));
    }
    let Some(result) = resp.result else {
        return failed(format!("operation {name} finished without an ActionResult"));
    };
    download(remote, &result, stage, cancel, false).await
}

async fn upload_local_result(remote: &Remote, built: &BuiltAction, outdir: &Path, data: &BranchData) -> Result<()> {
    remote.upload_inputs(built).await?;
    let up = Uploader { cas: remote.cas.clone(), function: DigestFunction::Sha256 };
    let declared = Declared { files: &[], directories: &[], paths: &built.command.output_paths };
    let mut result = ActionResult { exit_code: 0, ..Default::default() };
    up.collect(outdir, &declared, &mut result).await?;
    result.stdout_digest = Some(remote.put_bytes(&data.stdout).await?.to_proto());
    result.stderr_digest = Some(remote.put_bytes(&data.stderr).await?.to_proto());
    ActionCacheClient::new(remote.channel.clone())
        .update_action_result(UpdateActionResultRequest {
            instance_name: remote.instance.clone(),
            action_digest: Some(built.action_digest.to_proto()),
            action_result: Some(result),
            ..Default::default()
        })
        .await
        .map_err(|s| Error::remote("UpdateActionResult", s))?;
    Ok(())
}

fn idx(b: Branch) -> usize {
    match b {
        Branch::Local => 0,
        Branch::Remote => 1,
    }
}

/// Runs one command to the end under `spec.strategy`. `interrupt` resolving (Ctrl-C)
/// cancels the run cleanly.
pub async fn run(spec: RunSpec, interrupt: impl Future<Output = ()>) -> Result<RunReport> {
    if spec.strategy != Strategy::Local && spec.remote.is_none() {
        return Err(Error::invalid("--strategy remote, dynamic and cache-only need --remote"));
    }
    let history = match &spec.history_dir {
        Some(d) => Some(History::open(d).await?),
        None => None,
    };
    let built = Arc::new(action::build(&spec.command, history.as_ref()).await?);
    let shape = shape_key(&spec.command.argv);
    let delay_config = DelayConfig::default();
    let delay = match (spec.delay, &history) {
        (DelayChoice::Fixed(d), _) => DelayPlan::fixed(d),
        (DelayChoice::Learned, Some(h)) => h.plan(&shape, &delay_config).await?,
        (DelayChoice::Learned, None) => delay_config.cold_start,
    };
    let remote = match &spec.remote {
        Some(t) => Some(Arc::new(Remote::connect(t).await?)),
        None => None,
    };
    let config = RaceConfig {
        strategy: spec.strategy,
        delay,
        upload_local_results: spec.upload_local_results && remote.is_some(),
    };
    let root = spec.command.root.clone();
    let outdir = spec.command.cwd.clone();

    let (tx, mut rx) = mpsc::unbounded_channel::<Msg>();
    let mut coord = Coordinator::new(config);
    let clock = Instant::now();
    let mut temps: [Option<TempDir>; 2] = [None, None];
    let mut tasks: [Option<TaskGuard>; 2] = [None, None];
    let mut cancels: [Option<watch::Sender<bool>>; 2] = [None, None];
    let mut data: [Option<BranchData>; 2] = [None, None];
    let mut timers: Vec<TaskGuard> = Vec::new();
    let mut lock_task: Option<TaskGuard> = None;
    let mut held_lock: Option<OutputLock> = None;
    let mut operation = None;
    let mut uploaded = false;
    let mut queue = std::collections::VecDeque::from([Event::Start]);
    let deadline = spec.timeout.map(|t| tokio::time::Instant::now() + t);
    let mut interrupted = false;
    tokio::pin!(interrupt);

    let outcome = 'race: loop {
        let event = match queue.pop_front() {
            Some(e) => e,
            None => {
                let msg = tokio::select! {
                    m = rx.recv() => m.expect("the driver holds a sender"),
                    _ = &mut interrupt, if !interrupted => { interrupted = true; ev(Event::UserCancelled) }
                    _ = async { tokio::time::sleep_until(deadline.unwrap()).await }, if deadline.is_some() => {
                        ev(Event::TimedOut)
                    }
                };
                if let Some(op) = msg.operation {
                    operation = Some(op);
                }
                if let Some((b, d)) = msg.data {
                    data[idx(b)] = Some(d);
                }
                if let Some(lock) = msg.lock {
                    // A lock acquired after it was withdrawn is released at once.
                    if lock_task.is_some() {
                        held_lock = Some(lock);
                    }
                }
                match msg.event {
                    Some(e) => e,
                    None => continue,
                }
            }
        };
        if matches!(event, Event::TimedOut) {
            // Fire once: later waits must not spin on a passed deadline.
            queue.clear();
        }
        let cmds = coord.handle(clock.elapsed(), event);
        for cmd in cmds {
            match cmd {
                Command::StartRemote { cache_only } => {
                    let t = TempDir::create(&root, "remote")?;
                    let (ctx, crx) = watch::channel(false);
                    let r = remote.clone().expect("checked: remote strategies have a remote");
                    tasks[1] = Some(spawn_named(
                        "run-remote-branch",
                        remote_branch(r, built.clone(), t.path().to_owned(), cache_only, crx, tx.clone()),
                    ));
                    temps[1] = Some(t);
                    cancels[1] = Some(ctx);
                }
                Command::StartLocalAfter(d) => {
                    let tx = tx.clone();
                    timers.push(spawn_named("run-local-delay", async move {
                        tokio::time::sleep(d).await;
                        let _ = tx.send(ev(Event::DelayElapsed));
                    }));
                }
                Command::StartLocalNow => {
                    let t = TempDir::create(&root, "local")?;
                    let (ctx, crx) = watch::channel(false);
                    tasks[0] = Some(spawn_named(
                        "run-local-branch",
                        local_branch(built.clone(), t.path().to_owned(), crx, tx.clone()),
                    ));
                    temps[0] = Some(t);
                    cancels[0] = Some(ctx);
                }
                Command::CancelLocal | Command::CancelRemote => {
                    let b = if cmd == Command::CancelLocal { 0 } else { 1 };
                    if let Some(c) = &cancels[b] {
                        let _ = c.send(true);
                    }
                }
                Command::AcquireOutputLock(b) => {
                    let tx = tx.clone();
                    let dir = outdir.clone();
                    lock_task = Some(spawn_named("run-output-lock", async move {
                        loop {
                            match OutputLock::try_acquire(&dir) {
                                Ok(Some(lock)) => {
                                    let _ = tx.send(Msg {
                                        event: Some(Event::OutputLockAcquired(b)),
                                        lock: Some(lock),
                                        ..Default::default()
                                    });
                                    return;
                                }
                                Ok(None) => tokio::time::sleep(Duration::from_millis(5)).await,
                                Err(e) => {
                                    // Without the lock nothing may be written: report it as a write failure.
                                    tracing::error!(error = %e, "cannot take the output lock");
                                    let _ = tx.send(Msg {
                                        lock: None,
                                        ..ev(Event::OutputsWriteFailed { reason: e.to_string() })
                                    });
                                    return;
                                }
                            }
                        }
                    }));
                }
                Command::WriteOutputs(b) => {
                    let staged = data[idx(b)].as_ref().map(|d| d.staged.clone()).unwrap_or_default();
                    let trash = temps[idx(b)].as_ref().expect("a started branch has a temp dir").path().to_owned();
                    let declared = built.command.output_paths.clone();
                    let dir = outdir.clone();
                    let moved = tokio::task::spawn_blocking(move || move_into_place(&dir, &staged, &declared, &trash))
                        .await
                        .map_err(|e| gantry_core::Error::internal(format!("output move task: {e}")))?;
                    queue.push_back(match moved {
                        Ok(()) => Event::OutputsWritten,
                        Err(e) => Event::OutputsWriteFailed { reason: e.to_string() },
                    });
                }
                Command::ReleaseOutputLock => {
                    lock_task = None;
                    held_lock = None;
                }
                Command::CleanupTemp(b) => {
                    tasks[idx(b)] = None;
                    if let Some(mut t) = temps[idx(b)].take() {
                        t.remove();
                    }
                }
                Command::UploadLocalResult => {
                    if let (Some(r), Some(d)) = (&remote, &data[0]) {
                        match upload_local_result(r, &built, &outdir, d).await {
                            Ok(()) => uploaded = true,
                            // The run succeeded; a cache that cannot take the result only costs a later miss.
                            Err(e) => tracing::warn!(error = %e, "could not upload the local result"),
                        }
                    }
                }
                Command::Finish(o) => break 'race o,
            }
        }
    };
    drop(held_lock);
    let race = coord.report().clone();
    if let Some(h) = &history {
        h.record(&shape, &race, &delay_config).await?;
    }
    let winner = outcome.winner.and_then(|w| data[idx(w)].take()).unwrap_or_default();
    Ok(RunReport {
        outcome,
        stdout: winner.stdout,
        stderr: winner.stderr,
        race,
        shape,
        delay,
        action_digest: built.action_digest,
        hashed: built.hashed,
        remembered: built.remembered,
        operation,
        uploaded,
    })
}

/// Race counters of every shape in the history database at `dir`.
pub async fn stats(dir: &Path) -> Result<gantry_dynamic::race_stats::RaceStats> {
    History::open(dir).await?.race_stats().await
}
