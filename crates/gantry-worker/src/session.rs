//! The worker loop: orders arrive (as values: decoded at the wire by a remote session,
//! never encoded for an in-process worker), each run goes in its own task, and
//! started/finished reports go back, as values too; a cancellation kills the matching
//! process group.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use gantry_core::{Order, Report};
use tokio::sync::{mpsc, oneshot};

use crate::Executor;

/// Serves assignments until the scheduler side closes `messages`.
pub async fn run_worker(
    mut messages: mpsc::UnboundedReceiver<Order>,
    reports: mpsc::UnboundedSender<Report>,
    executor: Arc<Executor>,
) {
    let cancels: Arc<Mutex<HashMap<String, oneshot::Sender<()>>>> = Arc::default();
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(m) = messages.recv().await {
        match m {
            Order::Run(a) => {
                let (ctx, crx) = oneshot::channel();
                cancels.lock().expect("poisoned").insert(a.job_id.clone(), ctx);
                let (exec, reports, cancels) = (executor.clone(), reports.clone(), cancels.clone());
                tasks.spawn(async move {
                    let job = a.job_id.clone();
                    let _ = reports.send(Report::Started { job_id: job.clone() });
                    let cancel = async move {
                        // A dropped sender (job finished) must not count as a cancel.
                        if crx.await.is_err() {
                            std::future::pending::<()>().await;
                        }
                    };
                    let finished = exec.execute(*a, cancel).await;
                    cancels.lock().expect("poisoned").remove(&job);
                    let _ = reports.send(Report::Finished(Box::new(finished)));
                });
            }
            Order::Refuse { job_id, error } => {
                let finished = executor.refused(job_id, &error);
                let _ = reports.send(Report::Finished(Box::new(finished)));
            }
            Order::Cancel { job_id } => {
                if let Some(tx) = cancels.lock().expect("poisoned").remove(&job_id) {
                    let _ = tx.send(());
                }
            }
        }
        while tasks.try_join_next().is_some() {}
    }
    // The scheduler is gone: running actions are abandoned (the JoinSet aborts them,
    // and with them their process groups' waits; the scheduler re-queues the actions).
    tasks.shutdown().await;
}
