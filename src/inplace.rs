//! A connection that wakes itself while it is being polled is polled again in place, instead of
//! going back through the runtime's queue.
//!
//! hyper's HTTP/1 connection and our handler run in one task. When the handler takes the request
//! body, hyper's body channel wakes the channel's sender, which is that same task (hyper 1.12
//! wakes it even after the sender is gone, once a `Content-Length` body is read whole). tokio
//! reschedules a task woken during its own poll as a yield, and a yield always wakes a parked
//! worker so that it may steal: at one connection, every write woke the other worker for nothing
//! (a `futex` call and a context switch on each side; measured in docs/decisions.md, "A
//! connection's own wake, polled in place"). [`in_place`] notes such a wake and polls the
//! connection once more before returning, which is what the runtime would have done next; the
//! runtime only hears of wakes that come while the connection is not being polled (its socket,
//! its timers, other tasks), and of a second wake in the same poll, so that a connection that
//! keeps waking itself (hyper yields after 16 rounds of its loop) still gives way to others.

use std::future::Future;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

/// Not being polled: a wake goes to the runtime.
const IDLE: u8 = 0;
/// Being polled, not woken yet.
const POLLING: u8 = 1;
/// Woken while being polled: poll again before returning.
const WOKEN: u8 = 2;

/// The waker the connection sees.
struct InPlace {
    phase: AtomicU8,
    /// The runtime's waker of the task, as of its last poll.
    outer: Mutex<Option<Waker>>,
}

impl Wake for InPlace {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        match self
            .phase
            .compare_exchange(POLLING, WOKEN, Ordering::AcqRel, Ordering::Acquire)
        {
            // Noted: the poll under way polls again before it returns.
            Ok(_) | Err(WOKEN) => {}
            Err(_) => {
                if let Some(w) = self.outer.lock().ok().as_ref().and_then(|g| g.as_ref()) {
                    w.wake_by_ref();
                }
            }
        }
    }
}

/// Runs `fut`, polling it again in place when it wakes itself during a poll (at most once a
/// poll; a second such wake goes to the runtime).
pub async fn in_place<F: Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let state = Arc::new(InPlace {
        phase: AtomicU8::new(IDLE),
        outer: Mutex::new(None),
    });
    let waker = Waker::from(state.clone());
    std::future::poll_fn(move |cx| {
        if let Ok(mut outer) = state.outer.lock() {
            if !outer.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *outer = Some(cx.waker().clone());
            }
        }
        let mut inner = Context::from_waker(&waker);
        for _ in 0..2 {
            state.phase.store(POLLING, Ordering::Release);
            if let Poll::Ready(out) = fut.as_mut().poll(&mut inner) {
                state.phase.store(IDLE, Ordering::Release);
                return Poll::Ready(out);
            }
            if state.phase.swap(IDLE, Ordering::AcqRel) != WOKEN {
                return Poll::Pending;
            }
        }
        // Woken during the second poll too: the runtime decides when it runs next.
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A waker that counts its wakes: the runtime's, in these tests.
    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn runtime_waker() -> (Arc<Count>, Waker) {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        (c.clone(), Waker::from(c))
    }

    /// A future that wakes itself in each of its first `self_wakes` polls, then stays pending
    /// and keeps the last waker it saw (for wakes from elsewhere), counting its polls.
    struct Wakes {
        self_wakes: usize,
        polls: Arc<AtomicUsize>,
        seen: Arc<Mutex<Option<Waker>>>,
    }
    impl Future for Wakes {
        type Output = ();
        fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, Ordering::SeqCst);
            *self.seen.lock().unwrap() = Some(cx.waker().clone());
            if self.self_wakes > 0 {
                self.self_wakes -= 1;
                cx.waker().wake_by_ref();
            }
            Poll::Pending
        }
    }

    /// `in_place` around a [`Wakes`], polled by hand with a counting waker as the runtime's.
    struct Fixture {
        fut: std::pin::Pin<Box<dyn Future<Output = ()>>>,
        polls: Arc<AtomicUsize>,
        seen: Arc<Mutex<Option<Waker>>>,
        runtime: Arc<Count>,
        waker: Waker,
    }

    impl Fixture {
        fn new(self_wakes: usize) -> Fixture {
            let polls = Arc::new(AtomicUsize::new(0));
            let seen = Arc::new(Mutex::new(None));
            let inner = Wakes {
                self_wakes,
                polls: polls.clone(),
                seen: seen.clone(),
            };
            let (runtime, waker) = runtime_waker();
            Fixture {
                fut: Box::pin(in_place(inner)),
                polls,
                seen,
                runtime,
                waker,
            }
        }

        /// Polls once: whether it is still pending.
        fn poll(&mut self) -> bool {
            self.fut
                .as_mut()
                .poll(&mut Context::from_waker(&self.waker))
                .is_pending()
        }

        /// The task moved: the runtime's waker is a new one from now on.
        fn new_runtime_waker(&mut self) {
            (self.runtime, self.waker) = runtime_waker();
        }

        fn polls(&self) -> usize {
            self.polls.load(Ordering::SeqCst)
        }

        fn runtime_wakes(&self) -> usize {
            self.runtime.0.load(Ordering::SeqCst)
        }

        /// The waker the inner future saw last.
        fn inner_waker(&self) -> Waker {
            self.seen.lock().unwrap().clone().unwrap()
        }
    }

    #[test]
    fn a_wake_during_the_poll_is_polled_again_without_the_runtime() {
        let mut f = Fixture::new(1);
        assert!(f.poll());
        assert_eq!(f.polls(), 2, "polled again in place");
        assert_eq!(f.runtime_wakes(), 0, "the runtime was not woken");
    }

    #[test]
    fn a_future_that_keeps_waking_itself_goes_back_to_the_runtime() {
        let mut f = Fixture::new(usize::MAX);
        for round in 1..=3 {
            assert!(f.poll());
            assert_eq!(f.polls(), 2 * round, "two polls at most");
            assert_eq!(f.runtime_wakes(), round, "then the runtime's turn");
        }
    }

    #[test]
    fn a_wake_between_polls_reaches_the_runtime_from_any_thread() {
        let mut f = Fixture::new(0);
        assert!(f.poll());
        assert_eq!(f.polls(), 1);
        let inner = f.inner_waker();
        std::thread::spawn(move || inner.wake()).join().unwrap();
        assert_eq!(f.runtime_wakes(), 1);

        // The task moved to a new waker: later wakes go to it, not the old one.
        let old = f.runtime.clone();
        f.new_runtime_waker();
        assert!(f.poll());
        f.inner_waker().wake_by_ref();
        assert_eq!(f.runtime_wakes(), 1);
        assert_eq!(old.0.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wakes_from_other_tasks_during_polls_are_never_lost() {
        // A channel read in place while another task sends: every message arrives, whether its
        // wake came during a poll (polled again) or between polls (through the runtime).
        let (tx, mut rx) = tokio::sync::mpsc::channel::<u32>(1);
        let sender = tokio::spawn(async move {
            for i in 0..20_000 {
                tx.send(i).await.unwrap();
            }
        });
        let got = in_place(async move {
            let mut n = 0u32;
            while let Some(i) = rx.recv().await {
                assert_eq!(i, n);
                n += 1;
            }
            n
        })
        .await;
        sender.await.unwrap();
        assert_eq!(got, 20_000);
    }

    #[tokio::test]
    async fn the_output_is_the_futures() {
        assert_eq!(in_place(async { 7 }).await, 7);
    }
}
