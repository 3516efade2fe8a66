//! An operation's published state and the watchers that follow it: the subset of
//! `tokio::sync::watch` the scheduler uses, made for a channel per operation.
//!
//! Why not `tokio::sync::watch` itself: the scheduler makes a channel for every operation
//! and keeps it for the operation's retention (hundreds of thousands on a busy server),
//! and most are never watched after `Execute` returns. tokio's channel carries eight wake
//! lists so that thousands of receivers of one value do not contend; each is created with
//! the channel, and every send and the sender's drop lock all eight, watched or not. On
//! `gantry bench scheduler` that was a tenth of an assignment's cost. Here a channel is
//! one small allocation with one wake list ([`tokio::sync::Notify`]), whose wake-up with
//! nobody waiting is one uncontended lock.
//!
//! Semantics, as tokio's: a receiver sees the latest value; [`Receiver::changed`] waits
//! for a version it has not seen, and fails once every sender is gone and it has seen
//! the last version.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};

use tokio::sync::Notify;

/// `Shared::state`'s lowest bit: the last sender is gone.
const CLOSED: u64 = 1;
/// What a send adds to `Shared::state`: the version lives above the closed bit, so that
/// a receiver reads both in one load, and never sees "closed" without the last version
/// sent before it closed.
const VERSION_STEP: u64 = 2;

struct Shared<T> {
    value: RwLock<T>,
    /// The version (bumped under `value`'s write lock on every send) and [`CLOSED`].
    state: AtomicU64,
    senders: AtomicUsize,
    changed: Notify,
}

impl<T> Shared<T> {
    /// The value to read, even after a panic while it was written: it is plain data that
    /// each send changes field by field, and a scheduler whose watchers cannot read is
    /// worse. Readers do not wait for each other.
    fn read(&self) -> RwLockReadGuard<'_, T> {
        self.value.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn version(&self) -> u64 {
        self.state.load(Ordering::SeqCst) & !CLOSED
    }
}

/// The channel's senders are gone: nothing will change any more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

/// The publishing side; clones share one channel, which closes when the last is dropped.
pub struct Sender<T> {
    shared: Arc<Shared<T>>,
}

/// A watcher: the latest value, and a wait for the next.
pub struct Receiver<T> {
    shared: Arc<Shared<T>>,
    /// The version it has seen (without the closed bit).
    seen: u64,
}

/// A channel holding `init`, with one receiver that has seen it.
pub fn channel<T>(init: T) -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared {
        value: RwLock::new(init),
        state: AtomicU64::new(0),
        senders: AtomicUsize::new(1),
        changed: Notify::new(),
    });
    (Sender { shared: shared.clone() }, Receiver { shared, seen: 0 })
}

impl<T> Sender<T> {
    /// The current value. Not to be held across an await (the guard is not `Send`).
    pub fn borrow(&self) -> RwLockReadGuard<'_, T> {
        self.shared.read()
    }

    /// Changes the value in place and wakes every receiver waiting in `changed`.
    pub fn send_modify(&self, modify: impl FnOnce(&mut T)) {
        {
            let mut value = self.shared.value.write().unwrap_or_else(PoisonError::into_inner);
            modify(&mut value);
            self.shared.state.fetch_add(VERSION_STEP, Ordering::SeqCst);
        }
        self.shared.changed.notify_waiters();
    }

    /// A new receiver, which has seen the current value.
    pub fn subscribe(&self) -> Receiver<T> {
        let _value = self.shared.read();
        Receiver { shared: self.shared.clone(), seen: self.shared.version() }
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        self.shared.senders.fetch_add(1, Ordering::Relaxed);
        Sender { shared: self.shared.clone() }
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        if self.shared.senders.fetch_sub(1, Ordering::SeqCst) == 1 {
            // After every send of every sender: a receiver that reads the bit reads the
            // last version with it.
            self.shared.state.fetch_or(CLOSED, Ordering::SeqCst);
            self.shared.changed.notify_waiters();
        }
    }
}

impl<T> Receiver<T> {
    /// The current value, without marking it seen.
    pub fn borrow(&self) -> RwLockReadGuard<'_, T> {
        self.shared.read()
    }

    /// The current value, marked seen: `changed` then waits for a later one.
    pub fn borrow_and_update(&mut self) -> RwLockReadGuard<'_, T> {
        let value = self.shared.read();
        // Read under the lock, which every send bumps the version under: the value is
        // exactly that version's.
        self.seen = self.shared.version();
        value
    }

    /// Waits for a value this receiver has not seen, and marks it seen. Fails once the
    /// senders are gone and nothing new is left to see.
    pub async fn changed(&mut self) -> Result<(), Closed> {
        let shared = &*self.shared;
        loop {
            if let Some(r) = poll_state(shared, &mut self.seen) {
                return r;
            }
            // Registered before the second look, so that a send between the look and the
            // wait still wakes it.
            let mut notified = std::pin::pin!(shared.changed.notified());
            notified.as_mut().enable();
            if let Some(r) = poll_state(shared, &mut self.seen) {
                return r;
            }
            notified.await;
        }
    }

    /// Waits until the value satisfies `done` (the current one included), marks it seen
    /// and returns a copy of it. Fails if the senders are gone first.
    pub async fn wait_for(&mut self, mut done: impl FnMut(&T) -> bool) -> Result<T, Closed>
    where
        T: Clone,
    {
        loop {
            {
                let value = self.borrow_and_update();
                if done(&value) {
                    return Ok(value.clone());
                }
            }
            self.changed().await?;
        }
    }
}

/// For a receiver that has seen `seen`: the new version if there is one; `Closed` if
/// there is none and can be none. One load reads both, so a last send followed at once
/// by the last sender's drop is seen as the send, then (next time) as closed.
fn poll_state<T>(shared: &Shared<T>, seen: &mut u64) -> Option<Result<(), Closed>> {
    let state = shared.state.load(Ordering::SeqCst);
    let version = state & !CLOSED;
    if version != *seen {
        *seen = version;
        return Some(Ok(()));
    }
    if state & CLOSED != 0 {
        return Some(Err(Closed));
    }
    None
}

impl<T> std::fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver").field("seen", &self.seen).finish_non_exhaustive()
    }
}

impl<T> Clone for Receiver<T> {
    fn clone(&self) -> Self {
        Receiver { shared: self.shared.clone(), seen: self.seen }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_receiver_sees_every_latest_value_and_waits_for_the_next() {
        let (tx, mut rx) = channel(0);
        assert_eq!(*rx.borrow(), 0);
        // Nothing new yet: `changed` waits.
        assert!(tokio::time::timeout(Duration::from_millis(20), rx.changed()).await.is_err());
        tx.send_modify(|v| *v = 1);
        tx.send_modify(|v| *v = 2);
        // Two sends, one change seen, and the latest value.
        rx.changed().await.unwrap();
        assert_eq!(*rx.borrow_and_update(), 2);
        assert!(tokio::time::timeout(Duration::from_millis(20), rx.changed()).await.is_err());
    }

    #[tokio::test]
    async fn a_waiting_receiver_is_woken_by_a_send_from_another_task() {
        let (tx, mut rx) = channel(0);
        let waiter = tokio::spawn(async move {
            rx.changed().await.unwrap();
            *rx.borrow_and_update()
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        tx.send_modify(|v| *v = 7);
        assert_eq!(tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap(), 7);
    }

    #[tokio::test]
    async fn wait_for_returns_at_once_on_a_matching_value_and_fails_when_closed() {
        let (tx, mut rx) = channel(5);
        assert_eq!(rx.wait_for(|v| *v == 5).await, Ok(5));
        let waiter = tokio::spawn(async move { rx.wait_for(|v| *v == 9).await });
        tx.send_modify(|v| *v = 6);
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(tx);
        assert_eq!(tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap(), Err(Closed));
    }

    #[tokio::test]
    async fn a_subscriber_has_seen_the_value_it_subscribed_at() {
        let (tx, rx) = channel("queued");
        drop(rx);
        tx.send_modify(|v| *v = "executing");
        let mut late = tx.subscribe();
        assert_eq!(*late.borrow(), "executing");
        assert!(tokio::time::timeout(Duration::from_millis(20), late.changed()).await.is_err());
        tx.send_modify(|v| *v = "completed");
        late.changed().await.unwrap();
        assert_eq!(*late.borrow_and_update(), "completed");
    }

    #[tokio::test]
    async fn a_last_send_then_the_close_are_seen_in_that_order() {
        // The case of a finished operation: its result is published by the last sender,
        // which is dropped at once. A watcher must see the result before the close.
        let (tx, mut rx) = channel("executing");
        tx.send_modify(|v| *v = "completed");
        drop(tx);
        assert_eq!(rx.changed().await, Ok(()));
        assert_eq!(*rx.borrow_and_update(), "completed");
        assert_eq!(rx.changed().await, Err(Closed));
    }

    #[tokio::test]
    async fn the_last_senders_drop_closes_the_channel_after_the_last_value() {
        let (tx, mut rx) = channel(0);
        let tx2 = tx.clone();
        let waiter = tokio::spawn(async move {
            let mut seen = Vec::new();
            while rx.changed().await.is_ok() {
                seen.push(*rx.borrow_and_update());
            }
            seen
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(tx);
        tx2.send_modify(|v| *v = 3);
        // A clone still open: the first drop closed nothing.
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(tx2);
        let seen = tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap();
        assert_eq!(seen.last(), Some(&3));
    }

    #[test]
    fn many_senders_and_waiters_on_threads_miss_no_change() {
        // Each round: a waiter that has seen version n waits while a sender on another
        // thread publishes n + 1. A lost wake-up hangs the round (and fails the timeout).
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let (tx, rx) = channel(0u64);
            for n in 1..=2000u64 {
                let mut rx = rx.clone();
                drop(rx.borrow_and_update());
                let waiter = tokio::spawn(async move {
                    rx.changed().await.unwrap();
                    *rx.borrow_and_update()
                });
                let tx = tx.clone();
                tokio::spawn(async move { tx.send_modify(|v| *v = n) });
                let got = tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("woken").unwrap();
                assert_eq!(got, n);
            }
        });
    }
}
