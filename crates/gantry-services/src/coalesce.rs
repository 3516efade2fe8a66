//! Fewer, larger socket writes for the gRPC server's connections.
//!
//! The h2 crate writes one DATA frame per write call, and a frame is at most the size the
//! client allows: 16 KiB for tonic's and Netty's defaults (Bazel). A 64 MiB ByteStream
//! read then costs 4,096 writes, each a trip through the TCP stack and a wake-up of
//! the reader; on loopback they were three quarters of the server's CPU. This wrapper
//! gathers the frames of a bulk transfer in user space and writes up to 256 KiB at a
//! time.
//!
//! It relies on how h2's connection flushes: after each frame it buffers, and once more
//! at the end of every poll of the connection. A flush that follows a bulk write (one
//! of at least 8 KiB, a full DATA frame) is put off, and the task is woken so that the
//! connection is polled again; that next flush, with nothing written in between, writes
//! everything out. Small writes (headers, small messages, trailers) with nothing gathered
//! go straight to the socket as before, so a small call's latency does not change. The
//! buffer (256 KiB) lives only while a transfer does: the flush after its last, small
//! write lets it go.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A write at least this large is a DATA frame of a bulk transfer, with more to come.
const BULK_WRITE: usize = 8 * 1024;
/// At most this much is gathered before it is written.
const COALESCE: usize = 256 * 1024;

/// A connection whose bulk writes are gathered into larger ones (see the module doc).
pub struct CoalescedWrites<T> {
    inner: T,
    buf: Vec<u8>,
    /// Bytes of `buf` already written.
    written: usize,
    /// The last write was a bulk one: the next flush may wait for more.
    bulk: bool,
    /// A flush was put off (and the task woken) with no write since.
    deferred: bool,
}

impl<T> CoalescedWrites<T> {
    pub fn new(inner: T) -> Self {
        CoalescedWrites { inner, buf: Vec::new(), written: 0, bulk: false, deferred: false }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    fn pending(&self) -> usize {
        self.buf.len() - self.written
    }
}

impl<T: AsyncWrite + Unpin> CoalescedWrites<T> {
    /// Writes out everything gathered.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.buf.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.buf[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.buf.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for CoalescedWrites<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(data)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let len: usize = bufs.iter().map(|b| b.len()).sum();
        if this.pending() + len > COALESCE {
            ready!(this.poll_drain(cx))?;
        }
        this.deferred = false;
        if this.pending() == 0 && !(BULK_WRITE..COALESCE).contains(&len) {
            // A small write with nothing gathered goes out as it would without this
            // wrapper (no copy), and so does one already large.
            this.bulk = false;
            return Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        }
        if this.buf.capacity() == 0 && len >= BULK_WRITE {
            this.buf.reserve(COALESCE);
        }
        for b in bufs {
            this.buf.extend_from_slice(b);
        }
        this.bulk = len >= BULK_WRITE;
        Poll::Ready(Ok(len))
    }

    fn is_write_vectored(&self) -> bool {
        // Gathered writes take every slice; small ones go to the inner writer as they are.
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.pending() > 0 {
            if this.bulk && !this.deferred {
                // More frames may follow in this poll of the connection; the wake-up
                // brings the flush that writes them all.
                this.deferred = true;
                cx.waker().wake_by_ref();
                return Poll::Ready(Ok(()));
            }
            ready!(this.poll_drain(cx))?;
            if !this.bulk {
                // The transfer ended (its trailers were the last write): an idle
                // connection keeps no buffer.
                this.buf = Vec::new();
            }
        }
        this.deferred = false;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for CoalescedWrites<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for CoalescedWrites<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;

    /// A sink that counts its write calls.
    #[derive(Default)]
    struct Sink {
        data: Vec<u8>,
        writes: usize,
    }

    impl AsyncWrite for Sink {
        fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            let this = self.get_mut();
            this.data.extend_from_slice(buf);
            this.writes += 1;
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[derive(Default)]
    struct CountWakes(AtomicUsize);

    impl Wake for CountWakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }

        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A wrapper over a counting sink, and a waker that counts its wake-ups.
    fn setup() -> (CoalescedWrites<Sink>, Arc<CountWakes>, std::task::Waker) {
        let wakes = Arc::new(CountWakes::default());
        let waker = wakes.clone().into();
        (CoalescedWrites::new(Sink::default()), wakes, waker)
    }

    /// Writes `frame` then flushes, as h2 does for each frame it buffers.
    fn frame(io: &mut CoalescedWrites<Sink>, cx: &mut Context<'_>, frame: &[u8]) {
        assert!(matches!(Pin::new(&mut *io).poll_write(cx, frame), Poll::Ready(Ok(n)) if n == frame.len()));
        assert!(matches!(Pin::new(&mut *io).poll_flush(cx), Poll::Ready(Ok(()))));
    }

    #[test]
    fn the_frames_of_a_bulk_transfer_go_out_together_on_the_next_flush() {
        let (mut io, wakes, waker) = setup();
        let mut cx = Context::from_waker(&waker);
        let payload: Vec<u8> = (0..16 * 1024).map(|i| i as u8).collect();
        for _ in 0..10 {
            frame(&mut io, &mut cx, &payload);
        }
        // Nothing written yet, and the task was woken to come back for it.
        assert_eq!(io.get_ref().writes, 0);
        assert!(wakes.0.load(Ordering::SeqCst) > 0);
        // The connection's next poll flushes with nothing written in between.
        assert!(matches!(Pin::new(&mut io).poll_flush(&mut cx), Poll::Ready(Ok(()))));
        assert_eq!(io.get_ref().writes, 1);
        assert_eq!(io.get_ref().data.len(), 10 * payload.len());
        assert!(io.get_ref().data.chunks(payload.len()).all(|c| c == payload.as_slice()));
    }

    #[test]
    fn small_writes_are_written_at_the_first_flush() {
        let (mut io, wakes, waker) = setup();
        let mut cx = Context::from_waker(&waker);
        frame(&mut io, &mut cx, b"headers and a small message");
        assert_eq!(io.get_ref().writes, 1);
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0);
        // A bulk frame followed by a small one (the trailers): the small one ends it.
        frame(&mut io, &mut cx, &[7u8; 16 * 1024]);
        frame(&mut io, &mut cx, b"trailers");
        assert_eq!(io.get_ref().writes, 2);
        assert_eq!(io.get_ref().data.len(), 27 + 16 * 1024 + 8);
    }

    #[test]
    fn gathering_stops_at_its_limit_and_shutdown_writes_the_rest() {
        let (mut io, _, waker) = setup();
        let mut cx = Context::from_waker(&waker);
        for _ in 0..40 {
            frame(&mut io, &mut cx, &[1u8; 16 * 1024]);
        }
        // 640 KiB in writes of at most 256 KiB.
        assert_eq!(io.get_ref().writes, 2);
        assert!(matches!(Pin::new(&mut io).poll_shutdown(&mut cx), Poll::Ready(Ok(()))));
        assert_eq!(io.get_ref().writes, 3);
        assert_eq!(io.get_ref().data.len(), 40 * 16 * 1024);
        // A write larger than the limit goes straight through.
        frame(&mut io, &mut cx, &vec![2u8; COALESCE]);
        assert_eq!(io.get_ref().writes, 4);
    }
}
