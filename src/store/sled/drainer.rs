//! The drainer thread: durable changes applied to sled in bulk.

use super::*;

/// Changes the drainer applies between two yields of its core (about 0.2 ms of sled's work):
/// see [`drain_loop`].
const YIELD_EVERY: usize = 16;

/// Applies durable changes one by one to sled, then appends their log blocks (in order) to the
/// log files, all in one call ([`LogFiles::append_blocks`]: one write for a drain's blocks, not
/// one per batch). (Removing a log block is what a store from before the log files did to prune;
/// the anchor says where the log starts, so it is nothing to do here.)
///
/// Not as a `sled::Batch`: the write-ahead log already makes the batch atomic (a crash replays it
/// whole), and sled 0.34 pays for batch atomicity twice: it seals and writes its I/O buffer after
/// every batch (a `pwrite` on one of its threads), and once a batch has been used it puts every
/// read behind one global lock. Readers may see a batch half applied for a moment; each key they
/// read is a durable value.
///
/// The log files are locked for their append alone, not across the sled inserts: readers of the
/// log and the checkpoint's fsync of the files do not wait for a drain.
pub(super) fn apply_changes<'a>(
    db: &sled::Db,
    files: &Mutex<LogFiles>,
    changes: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
) -> Result<(), String> {
    let mut blocks: Vec<(u64, &[u8])> = Vec::new();
    for (k, v) in changes {
        match (log_seq(k), v) {
            (Some(first), Some(block)) => blocks.push((first, block)),
            (Some(_), None) => {}
            (None, Some(v)) => drop(db.insert(k, v).map_err(|e| format!("sled insert: {e}"))?),
            (None, None) => drop(db.remove(k).map_err(|e| format!("sled remove: {e}"))?),
        }
    }
    if blocks.is_empty() {
        return Ok(());
    }
    blocks.sort_unstable_by_key(|(first, _)| *first);
    files
        .lock()
        .map_err(|_| "store lock poisoned".to_string())?
        .append_blocks(&blocks)
}

/// Applies frozen changes to sled, then lets readers forget them.
///
/// A drain is milliseconds of one core's work (about 350 writes' keys every 250 ms at one
/// connection), and a request's thread woken meanwhile on that core waits for the drainer's
/// slice to run out (the kernel's scheduler lets a running thread keep its core up to about
/// 1.5 ms here). The drainer yields its core every [`YIELD_EVERY`] changes, so a woken request
/// waits for at most that much of sled's work. (Replaying the write-ahead log at open, the other
/// caller of [`apply_changes`], has no request to give way to.)
pub(super) fn drain_loop(db: &sled::Db, shared: &Shared, rx: mpsc::Receiver<(Arc<Changes>, u64)>) {
    while let Ok((changes, seq)) = rx.recv() {
        // Records and indexes in any order (the map has none); `apply_changes` puts the log
        // blocks in theirs.
        let yielding = changes
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_deref()))
            .enumerate()
            .map(|(n, pair)| {
                if n > 0 && n % YIELD_EVERY == 0 {
                    std::thread::yield_now();
                }
                pair
            });
        let applied = match apply_changes(db, &shared.logfiles, yielding) {
            Ok(()) => true,
            Err(e) => {
                shared.fail(&format!("apply durable changes: {e}"));
                false
            }
        };
        if let Ok(mut m) = shared.mem.write() {
            // What sled could not take stays readable here (the store takes no more changes).
            if applied {
                m.frozen = Arc::new(Changes::default());
            }
            m.draining = false;
        }
        // Under the lock the waiters check under, so that none misses the notification.
        if let Ok(mut a) = shared.applied.lock() {
            if applied {
                *a = (*a).max(seq);
            }
            shared.progress.notify_all();
        }
    }
}
