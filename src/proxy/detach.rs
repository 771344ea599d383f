//! A write's action, run in the request's own task and handed to a task of its own only if the
//! request goes away first (SPEC §5 step 4: from the claim on, the work belongs to the action,
//! not to the client's connection).
//!
//! Spawning the action's task for every write and waiting for it cost a hand-off between the
//! runtime's workers and back at one connection (tokio runs only a few woken tasks in a row
//! before it wakes another worker to take the next): about 1.2 of the 8.7 context switches of a
//! write (docs/decisions.md, "At one connection, the workers handed the write back and forth").
//! A dropped [`Detached`] moves the future, pinned in its box, to a new task; nothing the
//! future holds moves, and it goes on from the point it had reached.

use std::any::Any;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio_util::task::TaskTracker;

type Boxed<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A future polled where it is awaited until it ends, or, if dropped before that, finished in a
/// task of its own on `tracker` (which the shutdown waits for, as for every action's task).
pub(super) struct Detached<T: Send + 'static> {
    fut: Option<Boxed<T>>,
    tracker: TaskTracker,
}

impl<T: Send + 'static> Detached<T> {
    pub(super) fn new(fut: Boxed<T>, tracker: TaskTracker) -> Self {
        Detached {
            fut: Some(fut),
            tracker,
        }
    }
}

impl<T: Send + 'static> Future for Detached<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(fut) = self.fut.as_mut() else {
            panic!("a Detached future polled after it ended");
        };
        let out = std::task::ready!(fut.as_mut().poll(cx));
        self.fut = None;
        Poll::Ready(out)
    }
}

impl<T: Send + 'static> Drop for Detached<T> {
    fn drop(&mut self) {
        let Some(fut) = self.fut.take() else {
            return;
        };
        // Dropped by a runtime's task (a connection closed under its request): the action
        // finishes in a task of its own. Outside any runtime there is nothing to finish it on:
        // the runtime is gone, as at a crash, and the next start finds the action in flight.
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(self.tracker.spawn_on(fut, &rt)),
            Err(_) => tracing::error!("an action's future was dropped outside the runtime"),
        }
    }
}

/// The future's output, or the panic that ended it (the future is not polled again).
pub(super) struct CatchUnwind<F>(pub(super) Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Box<dyn Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let fut = &mut self.0;
        match catch_unwind(AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}

/// What ended an action's own task early (an action whose answer streams runs in one): its panic,
/// said as [`panic_message`] says it for an action run in the request's task, or its
/// cancellation.
pub(super) fn join_message(e: tokio::task::JoinError) -> String {
    match e.try_into_panic() {
        Ok(panic) => panic_message(&*panic),
        Err(e) => e.to_string(),
    }
}

/// What a panic said, for the log and the problem's detail.
pub(super) fn panic_message(panic: &(dyn Any + Send)) -> String {
    let msg = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic");
    format!("panicked: {msg}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// Awaited to its end, it runs where it is awaited; dropped half way, it finishes in a task
    /// of its own on the tracker, from where it was.
    #[tokio::test]
    async fn a_dropped_future_finishes_in_a_task_of_its_own() {
        let tracker = TaskTracker::new();
        let here = std::thread::current().id();
        let ran_on = Detached::new(
            Box::pin(async move { std::thread::current().id() }),
            tracker.clone(),
        )
        .await;
        assert_eq!(ran_on, here);
        assert!(tracker.is_empty());

        let gate = Arc::new(tokio::sync::Notify::new());
        let started = Arc::new(AtomicBool::new(false));
        let finished = Arc::new(AtomicBool::new(false));
        let fut = {
            let (gate, started, finished) = (gate.clone(), started.clone(), finished.clone());
            async move {
                started.store(true, Ordering::SeqCst);
                gate.notified().await;
                finished.store(true, Ordering::SeqCst);
            }
        };
        let mut d = Detached::new(Box::pin(fut), tracker.clone());
        // Polled once (it starts and waits), then dropped, as when a client goes away.
        assert!(futures_poll_once(&mut d).is_pending());
        assert!(started.load(Ordering::SeqCst));
        drop(d);
        assert_eq!(tracker.len(), 1, "handed to a task of its own");
        gate.notify_one();
        tracker.close();
        tracker.wait().await;
        assert!(finished.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn a_panic_is_caught_and_says_what_it_said() {
        let r = CatchUnwind(Box::pin(async {
            if std::hint::black_box(true) {
                panic!("boom");
            }
        }))
        .await;
        assert_eq!(
            panic_message(&*r.expect_err("it panicked")),
            "panicked: boom"
        );
        let r = CatchUnwind(Box::pin(async { 7 })).await;
        assert_eq!(r.ok(), Some(7));
    }

    /// A spawned task's panic is said as a caught one is.
    #[tokio::test]
    async fn a_tasks_panic_says_what_it_said_as_a_caught_one_does() {
        let e = tokio::spawn(async {
            if std::hint::black_box(true) {
                panic!("boom");
            }
        })
        .await
        .expect_err("it panicked");
        assert_eq!(join_message(e), "panicked: boom");
    }

    fn futures_poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
        let waker = std::task::Waker::noop();
        Pin::new(f).poll(&mut Context::from_waker(waker))
    }
}
