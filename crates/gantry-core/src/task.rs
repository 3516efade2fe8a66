//! Background tasks that carry a name (as a tracing span, so their logs say who they are)
//! and are aborted when their owner drops the guard, so no task outlives its component.

use std::future::Future;

use tracing::Instrument;

#[must_use = "dropping the guard aborts the task"]
pub struct TaskGuard {
    name: &'static str,
    handle: tokio::task::JoinHandle<()>,
}

/// Spawns `fut` on the current runtime under the span `task{name=...}`.
pub fn spawn_named<F>(name: &'static str, fut: F) -> TaskGuard
where
    F: Future<Output = ()> + Send + 'static,
{
    let handle = tokio::spawn(fut.instrument(tracing::info_span!("task", name)));
    TaskGuard { name, handle }
}

impl TaskGuard {
    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Stops the task now, before the guard is dropped.
    pub fn abort(&self) {
        self.handle.abort();
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

/// A stream that owns the task producing it: when the consumer drops the stream (a gRPC
/// client went away, or the response finished), the producer task is aborted with it.
pub struct GuardedStream<S> {
    inner: S,
    _guard: TaskGuard,
}

impl<S> GuardedStream<S> {
    pub fn new(inner: S, guard: TaskGuard) -> Self {
        GuardedStream { inner, _guard: guard }
    }
}

impl<S: futures::Stream + Unpin> futures::Stream for GuardedStream<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.inner).poll_next(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn dropping_the_guard_aborts_the_task() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
        let guard = spawn_named("test", async move {
            let _tx = tx; // dropped when the task ends
            std::future::pending::<()>().await;
        });
        assert_eq!(guard.name(), "test");
        drop(guard);
        assert!(rx.recv().await.is_none(), "task was aborted and dropped its sender");
    }
}
