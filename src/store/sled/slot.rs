//! Who runs the writer: its thread, for whatever the queue holds, or a caller with nothing else
//! in flight, for its own claim or settlement.

use super::*;

/// The writer, shared between its thread and the callers: its thread takes batches off the
/// queue; a caller with nothing else in flight decides and syncs its own operation while the
/// writer is idle ([`Slot::inline`]). `None` once the writer is done.
pub(super) struct Slot {
    pub(super) writer: Mutex<Option<Writer>>,
    /// Calls of the store waiting for the writer (queued, in a batch or being synced).
    pub(super) calls: AtomicUsize,
    /// Batches decided on a caller's thread.
    pub(super) inline: AtomicU64,
}

/// One call of the store, counted in [`Slot::calls`] until its answer arrives (or it is dropped).
pub(super) struct Call<'a> {
    calls: &'a AtomicUsize,
    /// No other call was waiting for the writer when this one began.
    pub(super) alone: bool,
}

impl<'a> Call<'a> {
    pub(super) fn begin(slot: &'a Slot) -> Self {
        let before = slot.calls.fetch_add(1, Ordering::SeqCst);
        Call {
            calls: &slot.calls,
            alone: before == 0,
        }
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        self.calls.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Slot {
    pub(super) fn new(writer: Writer) -> Self {
        Slot {
            writer: Mutex::new(Some(writer)),
            calls: AtomicUsize::new(0),
            inline: AtomicU64::new(0),
        }
    }

    /// Decides and syncs a claim or settlement on the caller's thread, when nothing else waits
    /// for the writer and its thread is not in a batch: the caller's answer is then ready when
    /// this returns. At one connection the hand-off to the writer thread and back (a wake-up
    /// and a context switch each way, twice per write) cost about as much as the work itself.
    /// This blocks the calling thread for one fdatasync, which only a call with nothing else
    /// in flight does, on a runtime with another worker to serve the rest meanwhile (the caller
    /// checks both); under load every call goes through the queue and shares a group commit.
    /// Anything else (or a busy writer) is given back, to be queued.
    pub(super) fn inline(&self, op: Op) -> Option<Op> {
        if !matches!(op, Op::Claim(..) | Op::Settle(..)) {
            return Some(op);
        }
        let Ok(mut guard) = self.writer.try_lock() else {
            return Some(op);
        };
        let Some(writer) = guard.as_mut() else {
            return Some(op);
        };
        // Idle: nothing queued could share the batch (a call queued meanwhile waits for the
        // lock in the writer thread, and goes in the next batch).
        self.inline.fetch_add(1, Ordering::Relaxed);
        match writer.batch(vec![op], false, true) {
            Ok(delivery) => {
                drop(guard);
                delivery.into_iter().for_each(Delivery::send);
            }
            // The syncer is gone, and with it the answer: the caller hears the writer stopped.
            Err(SyncerGone) => tracing::error!("store syncer stopped"),
        }
        None
    }

    /// The writer thread: batches of what the queue holds, until every sender is gone; then
    /// the store closes (see [`Writer::close`]).
    ///
    /// The thread holds the writer only while it makes a batch, and answers the batch's callers
    /// after letting go of it: a caller it wakes finds the writer free, and its next call, with
    /// nothing else in flight, runs on its own thread ([`Slot::inline`]). (When the thread
    /// answered first, a woken caller often called again before the thread let go, was queued,
    /// and woke to the same race: one queued call made the next ones queue too.)
    pub(super) fn run(&self, rx: mpsc::Receiver<Op>) {
        // When buffered notes are due, as of this thread's last batch: only its batches arm
        // the timer (a caller's batch may only write the notes earlier, and the timer then
        // finds nothing due).
        let mut due: Option<Instant> = None;
        loop {
            let first = match due {
                Some(due) => match rx.recv_timeout(due.saturating_duration_since(Instant::now())) {
                    Ok(op) => op,
                    Err(mpsc::RecvTimeoutError::Timeout) => Op::Notes,
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                },
                None => match rx.recv() {
                    Ok(op) => op,
                    Err(_) => break,
                },
            };
            let Ok(mut guard) = self.writer.lock() else {
                return;
            };
            let Some(writer) = guard.as_mut() else {
                return;
            };
            let mut ops = vec![first];
            // Whether the queue ran dry: no operation waits for this batch's sync to end.
            let mut idle = false;
            while ops.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(op) => ops.push(op),
                    Err(_) => {
                        idle = true;
                        break;
                    }
                }
            }
            match writer.batch(ops, false, idle) {
                Ok(delivery) => {
                    due = writer.notes_due;
                    drop(guard);
                    delivery.into_iter().for_each(Delivery::send);
                }
                Err(SyncerGone) => {
                    // The syncer is gone: so is the writer (dropping it lets the drainer end).
                    guard.take();
                    return;
                }
            }
        }
        let writer = self.writer.lock().ok().and_then(|mut g| g.take());
        if let Some(writer) = writer {
            writer.close();
        }
    }
}
