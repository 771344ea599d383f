//! What the sled store has done since its open, counted: for tests that check how the store
//! works (a batch's fdatasync, a drain's writes, a lone call on its caller's thread) and for the
//! bench, never for its answers.

use std::sync::atomic::Ordering;

use super::SledStore;

impl SledStore {
    /// How often the writer waited for the drainer to apply everything to sled (checkpoints,
    /// recovery, expiry): never for a reader.
    pub fn forced_drain_count(&self) -> u64 {
        self.shared.forced_drains.load(Ordering::Relaxed)
    }

    /// How often a sync waited for the drainer because the changes not yet in sled were past
    /// their bound while a drain ran: writes then go at sled's pace.
    pub fn paced_count(&self) -> u64 {
        self.shared.paced.get()
    }

    /// How often a sync waited for the drainer to catch up a little (more changes than its
    /// bound not in sled while a drain ran): writes then go at sled's pace, a batch at a time.
    pub fn eased_count(&self) -> u64 {
        self.shared.eased.get()
    }

    /// How many batches the writer has made (on its thread or a caller's).
    pub fn batch_count(&self) -> u64 {
        self.shared.batches.load(Ordering::Relaxed)
    }

    /// How many writes appended to the write log's files since the open: the drainer makes one
    /// for all the entries of a drain.
    pub fn log_writes(&self) -> u64 {
        self.shared.logfiles.lock().map_or(0, |f| f.writes())
    }

    /// Whether this open loaded the filter of held ids its last clean close saved, rather than
    /// reading every pointer in sled.
    pub fn ids_loaded(&self) -> bool {
        self.shared.ids_loaded
    }

    /// How often the filter of held ids was made anew while the store ran (`ids/renew.rs`).
    pub fn ids_renewal_count(&self) -> u64 {
        self.shared.ids_renewed.load(Ordering::Relaxed)
    }

    /// How often the writer looked an action up in sled and found nothing: a claim of a new
    /// action the filter of held ids did not answer ("perhaps held", falsely).
    pub fn needless_lookup_count(&self) -> u64 {
        self.shared.needless_lookups.load(Ordering::Relaxed)
    }

    /// How many fdatasyncs of the write-ahead log no caller waited for: what notes and lease
    /// renewals written on their own cost (each made durable within 100 ms).
    pub fn idle_sync_count(&self) -> u64 {
        self.shared.idle_syncs.load(Ordering::Relaxed)
    }

    /// How many batches a caller decided and made durable on its own thread, with nothing else
    /// in flight (`Slot::inline`); the writer thread made the rest.
    pub fn caller_batches(&self) -> u64 {
        self.slot.inline.load(Ordering::Relaxed)
    }

    /// How many times the store has made batches durable for their callers (one fdatasync of the
    /// write-ahead log each).
    pub fn flush_count(&self) -> u64 {
        self.flushes.load(Ordering::Relaxed)
    }
}
