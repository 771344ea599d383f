//! The filter the writer asks, made anew while the store runs. Ids that went (expired) stay set
//! in a filter, so at a steady rate of new actions every filter reaches its design load: a
//! sidecar past a million writes since its open would otherwise ask sled about every new claim
//! until its next start (a third more of the writer's CPU, issue 59).
//!
//! When the filter reaches its design load (half way to where it stops answering "certainly
//! not": 524,288 ids in the smallest filter, minutes of writes), the writer (between two batches) notes
//! the last batch it wrote and starts a helper thread. The helper waits until that batch is
//! applied to sled, then reads every pointer in sled into a new filter, sized for twice the
//! actions the store holds ([`Ids::of`]). Meanwhile the writer puts every id it gives a pointer
//! into its current filter as before, and keeps a copy of each. Once the helper is done, the writer
//! puts those ids into the new filter and takes it instead.
//!
//! The new filter holds every id the store holds then: an id given its pointer by that batch or
//! an earlier one is in sled when the helper reads it (unless it went since: then it is not held),
//! and one given its pointer after it is among the ids the writer kept. An id that went while the
//! helper read may still be in it: a lookup, never a wrong "certainly not".

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Ids, Snapshot};
use crate::store::sled::shared::{Counts, Shared};

/// Pointer buckets the helper reads between two yields of its core.
const YIELD_EVERY: usize = 64;

/// How long after a failed renewal the next one is tried.
const RETRY: Duration = Duration::from_secs(60);

/// The writer's filter of held ids, and the next one while a helper makes it.
pub(in crate::store::sled) struct Held {
    ids: Ids,
    renewing: Option<Renewal>,
    /// The smallest filter this store makes ([`super::MIN_BITS`] but in tests).
    min_bits: usize,
    /// No renewal before this (one failed).
    not_before: Option<Instant>,
}

/// A new filter on its way.
struct Renewal {
    /// The ids given a pointer since the batch the helper waits for (in its new filter they go,
    /// hashed with its seed).
    since: Vec<Box<[u8]>>,
    done: mpsc::Receiver<Result<Ids, String>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    started: Instant,
}

impl Held {
    pub(in crate::store::sled) fn new(ids: Ids, min_bits: usize) -> Held {
        Held {
            ids,
            renewing: None,
            min_bits,
            not_before: None,
        }
    }

    /// Adds an id given a pointer (to the next filter too, while it is made).
    pub(in crate::store::sled) fn insert(&mut self, id: &[u8]) {
        self.ids.insert(id);
        if let Some(r) = &mut self.renewing {
            r.since.push(id.into());
        }
    }

    /// Whether the store may hold `id`; `false` only when it certainly does not.
    pub(in crate::store::sled) fn may_hold(&self, id: &[u8]) -> bool {
        self.ids.may_hold(id)
    }

    pub(in crate::store::sled) fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The filter now, for the checkpointer to save.
    pub(in crate::store::sled) fn snapshot(&self) -> Snapshot {
        self.ids.snapshot()
    }

    pub(in crate::store::sled) fn save(
        &self,
        dir: &std::path::Path,
        binding: &super::Binding,
    ) -> Result<(), String> {
        self.ids.save(dir, binding)
    }

    /// Between two batches: takes the next filter if the helper has made it, or starts a helper
    /// when the filter reaches its design load. `written`: the last batch written (every id put in so
    /// far came with it or an earlier one); `counts`: the actions the store holds, by state.
    pub(in crate::store::sled) fn between_batches(
        &mut self,
        db: &sled::Db,
        shared: &Arc<Shared>,
        written: u64,
        counts: &Counts,
    ) {
        if let Some(r) = &mut self.renewing {
            let made = match r.done.try_recv() {
                Ok(made) => made,
                Err(mpsc::TryRecvError::Empty) => return,
                Err(mpsc::TryRecvError::Disconnected) => Err("its thread ended".into()),
            };
            let mut r = self.renewing.take().expect("a renewal is on");
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
            match made {
                Ok(mut ids) => {
                    for id in &r.since {
                        ids.insert(id);
                    }
                    tracing::info!(
                        ids = ids.set,
                        went = self.ids.set.saturating_sub(ids.set),
                        bits = ids.bits.len() * 64,
                        seconds = r.started.elapsed().as_secs_f64(),
                        "store: made the filter of held ids anew (rid of the ids that went)"
                    );
                    self.ids = ids;
                    shared.ids_renewed.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "store: could not make the filter of held ids anew; new claims may ask sled until it is");
                    self.not_before = Some(Instant::now() + RETRY);
                }
            }
            return;
        }
        if !self.ids.due() || self.not_before.is_some_and(|t| Instant::now() < t) {
            return;
        }
        let held = counts.iter().sum::<u64>() as usize;
        let (tx, done) = mpsc::sync_channel(1);
        let stop = Arc::new(AtomicBool::new(false));
        let (db, shared, min_bits, halt) =
            (db.clone(), shared.clone(), self.min_bits, stop.clone());
        let spawned = std::thread::Builder::new()
            .name("oncegate-ids".into())
            .spawn(move || {
                let made = match shared.wait_applied_unless(written, &halt) {
                    Ok(true) => {
                        // Requests come first: the core is given up every few buckets (about
                        // 0.1 ms of reading), as the drainer does, so that a request woken on
                        // this core waits for no more than that.
                        let mut read = 0usize;
                        Ids::of(&db, held, min_bits, || {
                            read += 1;
                            if read % YIELD_EVERY == 0 {
                                std::thread::yield_now();
                            }
                            halt.load(Ordering::Relaxed)
                        })
                    }
                    Ok(false) => Err("stopped".into()),
                    Err(e) => Err(e),
                };
                let _ = tx.send(made);
            });
        match spawned {
            Ok(thread) => {
                self.renewing = Some(Renewal {
                    since: Vec::new(),
                    done,
                    stop,
                    thread: Some(thread),
                    started: Instant::now(),
                })
            }
            Err(e) => {
                tracing::warn!(error = %e, "store: could not start a thread to make the filter of held ids anew");
                self.not_before = Some(Instant::now() + RETRY);
            }
        }
    }
}

impl Drop for Held {
    /// A helper still at work stops (within a bucket of pointers, or 50 ms of waiting) and is
    /// waited for: it holds the database, which a later open of the folder needs let go.
    fn drop(&mut self) {
        if let Some(mut r) = self.renewing.take() {
            r.stop.store(true, Ordering::Relaxed);
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::action::{now_millis, Claim};
    use crate::store::sled::drainer::tests::{claim, write};
    use crate::store::sled::SledStore;
    use crate::store::{Store, StoreOptions};

    /// A store whose filter of held ids fills up keeps answering claims of new actions without
    /// asking sled, and never forgets a held id. Its filter is small (16,384 bits: at its design
    /// load with 1,024 ids, past its most with 2,048) and 8 writers claim and settle 8,000 new
    /// actions; new ids come in while the helper waits for sled (drains go every 250 ms) and
    /// reads it. Then each action, claimed again (most of them out of the cache of settled
    /// records, so the writer asks the filter), is found, never claimed anew. Before the filter
    /// was made anew, every new claim past 2,048 ids asked sled.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_filter_is_made_anew_and_forgets_no_held_id() {
        let tmp = tempfile::tempdir().expect("test step");
        let options = StoreOptions {
            ids_min_bits: Some(1 << 14),
            ..Default::default()
        };
        let store = Arc::new(SledStore::open(&tmp.path().join("s"), options).expect("test step"));
        let (tasks, each) = (8, 1_000);
        let writers: Vec<_> = (0..tasks)
            .map(|t| {
                let store = store.clone();
                tokio::spawn(async move {
                    for i in 0..each {
                        write(&store, format!("w{t}-{i}")).await;
                    }
                })
            })
            .collect();
        for w in writers {
            w.await.expect("test step");
        }
        let written = (tasks * each) as u64;
        let needless = store.needless_lookup_count();
        assert!(
            needless < written / 10,
            "{needless} of {written} claims of new actions asked sled"
        );
        assert!(
            store.ids_renewal_count() >= 2,
            "the filter was made anew {} times",
            store.ids_renewal_count()
        );
        for t in 0..tasks {
            for i in 0..each {
                let id = format!("w{t}-{i}");
                let again = claim(&store, &id, now_millis()).await;
                assert!(
                    matches!(again, Claim::Existing(_)),
                    "{id}, claimed again: {again:?}"
                );
            }
        }
        store.close().await.expect("test step");
    }
}
