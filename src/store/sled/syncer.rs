//! The syncer thread: one fdatasync per group of batches, then the batch made visible and its
//! callers answered.

use super::*;

/// A batch written to the write-ahead log, on its way to being durable and applied.
pub(super) struct Sealed {
    pub(super) seq: u64,
    /// The log file it was written to (fdatasynced by the syncer).
    pub(super) file: Arc<File>,
    pub(super) changes: Vec<Change>,
    /// Someone waits for it to be durable (else: within [`LAZY_FLUSH`]).
    pub(super) durable: bool,
    pub(super) answers: Vec<Answer>,
    pub(super) records: HashMap<String, Option<Arc<Record>>>,
    pub(super) bodies: HashMap<String, Bytes>,
    /// Writing it to the log failed.
    pub(super) failed: Option<String>,
    /// Apply everything so far to sled before going on (scans and checkpoints need it).
    pub(super) drain: bool,
    /// The write log's head once this batch is written (`None`: a marker, which appends none).
    pub(super) head: Option<(u64, String)>,
    /// The counts by state once this batch is written (`None`: a marker, which moves none).
    pub(super) counts: Option<Counts>,
    /// Keys this batch puts that no earlier batch ever did (see [`Mem::absent`]).
    pub(super) new_keys: HashSet<Vec<u8>>,
}

/// The answers of a group of batches made durable (or not), for whoever synced it to send once
/// it lets go of its locks: a writer that synced its own batch sends them after releasing the
/// writer, so the caller it wakes finds the writer free for its next call.
#[must_use = "the callers wait for these answers"]
pub(super) struct Delivery {
    answers: Vec<Answer>,
    result: Result<(), String>,
}

impl Delivery {
    pub(super) fn send(self) {
        for a in self.answers {
            a.send(&self.result);
        }
    }
}

/// What makes batches durable, so that the writer decides the next batch while this one's
/// fdatasync runs. In order, per group of batches waiting: one fdatasync for all of them, then
/// their changes join [`Mem`] (where point reads see them), the cache is updated and the callers
/// answered. So reads and the cache only ever see durable batches, and nobody is answered before.
/// A drainer thread applies [`Mem`] to sled in bulk.
///
/// Mostly on a thread of its own; but a writer with nothing else to do, and nothing on its way
/// here, syncs its batch itself ([`Syncer::inline`]): at low load the hand-off to this thread (a
/// wake-up and a context switch on each side) cost as much as the fdatasync.
pub(super) struct Syncer {
    pub(super) shared: Arc<Shared>,
    pub(super) cache: Arc<Mutex<Cache>>,
    pub(super) flushes: Arc<AtomicU64>,
    pub(super) flush_latency: Option<prometheus_client::metrics::histogram::Histogram>,
    /// One group at a time, in order, whoever syncs it.
    pub(super) state: Mutex<SyncState>,
    /// Batches handed to the syncer thread that it has not finished with: while any are, the
    /// writer does not sync inline (it would overtake them).
    pub(super) queued: AtomicU64,
}

pub(super) struct SyncState {
    /// Written but not yet fdatasynced: audit-only entries (notes) and lease renewals, which no
    /// caller waits for. The next durable batch, or the syncer thread's timer, makes them
    /// durable.
    lazy: Option<Arc<File>>,
    /// The last batch whose changes are in `Mem`.
    visible: u64,
    /// To the drainer thread; `None` once the syncer is done.
    drain: Option<mpsc::Sender<(Arc<Changes>, u64)>>,
}

impl SyncState {
    pub(super) fn new(drain: mpsc::Sender<(Arc<Changes>, u64)>) -> Self {
        SyncState {
            lazy: None,
            visible: 0,
            drain: Some(drain),
        }
    }
}

impl Syncer {
    /// The syncer thread: groups of batches as the writer hands them over, and the lazy
    /// fdatasync when nothing comes. Ends, and lets the drainer end, when the writer is gone.
    pub(super) fn run(self: Arc<Self>, rx: mpsc::Receiver<Sealed>) {
        loop {
            let first = match rx.recv_timeout(LAZY_FLUSH) {
                Ok(b) => b,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(mut st) = self.state.lock() {
                        if let Some(f) = st.lazy.take() {
                            self.shared.idle_syncs.fetch_add(1, Ordering::Relaxed);
                            if let Err(e) = f.sync_data() {
                                self.shared.fail(&format!("write-ahead log fdatasync: {e}"));
                            }
                        }
                        self.maybe_drain(&st, false);
                    }
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            };
            let mut group = vec![first];
            while let Ok(b) = rx.try_recv() {
                group.push(b);
            }
            let n = group.len() as u64;
            if let Ok(mut st) = self.state.lock() {
                let (delivery, force) = self.process(&mut st, group);
                delivery.send();
                self.maybe_drain(&st, force);
            }
            self.queued.fetch_sub(n, Ordering::SeqCst);
        }
        if let Ok(mut st) = self.state.lock() {
            if let Some(f) = st.lazy.take() {
                let _ = f.sync_data();
            }
            // The drainer ends once its queue is empty.
            st.drain = None;
        }
    }

    /// Whether the writer may sync a batch itself ([`Syncer::inline`]): nothing is on its way
    /// to the syncer thread (which it would overtake). Only the writer hands batches over, so
    /// what this says holds until the writer hands over another.
    pub(super) fn free(&self) -> bool {
        self.queued.load(Ordering::SeqCst) == 0
    }

    /// Syncs `batch` on the caller's thread (the writer's, when [`Syncer::free`]) and gives back
    /// its answers to send. The syncer thread is at most in its timer branch, which the lock
    /// waits out.
    pub(super) fn inline(&self, mut batch: Sealed) -> Delivery {
        match self.state.lock() {
            Ok(mut st) => {
                let (delivery, force) = self.process(&mut st, vec![batch]);
                self.maybe_drain(&st, force);
                delivery
            }
            // A sync panicked: nothing more is made durable (the syncer thread skips its
            // groups the same way).
            Err(_) => Delivery {
                answers: std::mem::take(&mut batch.answers),
                result: Err("store syncer lock poisoned".to_string()),
            },
        }
    }

    /// Counts a batch on its way to the syncer thread (before it is sent).
    pub(super) fn handing_over(&self) {
        self.queued.fetch_add(1, Ordering::SeqCst);
    }

    /// One group of batches: one fdatasync, then visible and cached, in order; its answers
    /// to send, and whether it asks for a drain ([`Sealed::drain`]).
    fn process(&self, st: &mut SyncState, mut group: Vec<Sealed>) -> (Delivery, bool) {
        let mut result = self.shared.check();
        if let Some(e) = group.iter().find_map(|b| b.failed.clone()) {
            result = Err(e);
        }
        if result.is_ok() && group.iter().any(|b| b.durable) {
            let started = Instant::now();
            let mut files: Vec<Arc<File>> = st.lazy.take().into_iter().collect();
            for b in &group {
                if !files.iter().any(|f| Arc::ptr_eq(f, &b.file)) {
                    files.push(b.file.clone());
                }
            }
            for f in files {
                if let Err(e) = f.sync_data() {
                    result = Err(format!("write-ahead log fdatasync: {e}"));
                    break;
                }
            }
            if result.is_ok() {
                self.flushes.fetch_add(1, Ordering::Relaxed);
                if let Some(h) = &self.flush_latency {
                    h.observe(started.elapsed().as_secs_f64());
                }
            }
        } else if result.is_ok() {
            // What the group wrote, if anything: a batch that changed nothing (an expiry step
            // with nothing due) leaves nothing to sync.
            if let Some(b) = group.iter().rev().find(|b| !b.changes.is_empty()) {
                st.lazy = Some(b.file.clone());
            }
        }
        if let Err(e) = &result {
            self.shared.fail(e);
        }
        let force = group.iter().any(|b| b.drain);
        let mut answers = Vec::new();
        if result.is_ok() {
            if let Ok(mut m) = self.shared.mem.write() {
                for b in &mut group {
                    if !b.changes.is_empty() {
                        m.since.get_or_insert_with(Instant::now);
                    }
                    for c in b.changes.drain(..) {
                        match c {
                            Change::Put(k, v) => {
                                if b.new_keys.contains(&k)
                                    && !m.active.contains_key(&k)
                                    && !m.frozen.contains_key(&k)
                                {
                                    m.absent.insert(k.clone());
                                }
                                m.bytes += k.len() + v.len();
                                m.active.insert(k, Some(v));
                            }
                            Change::Del(k) => {
                                if m.absent.remove(&k) {
                                    m.active.remove(&k);
                                } else {
                                    m.active.insert(k, None);
                                }
                            }
                            Change::Merge(k, change) => m.merge(k, change),
                        }
                    }
                }
            }
            if let Ok(mut c) = self.cache.lock() {
                for b in &mut group {
                    for (id, r) in b.records.drain() {
                        let body = b.bodies.get(&id);
                        c.update(id, r, body);
                    }
                }
            }
            st.visible = group.last().map_or(st.visible, |b| b.seq);
            if let Some(head) = group.iter().rev().find_map(|b| b.head.clone()) {
                if let Ok(mut h) = self.shared.head.lock() {
                    *h = head;
                }
            }
            if let Some(counts) = group.iter().rev().find_map(|b| b.counts) {
                if let Ok(mut c) = self.shared.counts.lock() {
                    *c = counts;
                }
            }
        }
        for b in group {
            answers.extend(b.answers);
        }
        (Delivery { answers, result }, force)
    }

    /// Hands the changes waiting in [`Mem`] to the drainer when they are old or many enough, or
    /// when asked (`force`: the writer waits for everything visible to be in sled). Nothing
    /// once the store is broken (a group that failed broke it).
    ///
    /// With more than [`BACKLOG_KEYS`] not in sled while a drain runs, this first waits for the
    /// drain to catch up ([`Syncer::ease`]); past [`BACKLOG_BYTES`] gathering, it waits for that
    /// whole drain and hands over the next at once. The thread that syncs (the syncer's, the
    /// writer's, or a lone caller's) holds the sync state meanwhile, so no batch is answered,
    /// and callers wait for sled's pace instead of the overlay growing.
    fn maybe_drain(&self, st: &SyncState, force: bool) {
        let Some(tx) = st.drain.as_ref() else {
            return;
        };
        if self.shared.check().is_err() {
            return;
        }
        if !force {
            self.ease();
        }
        let Ok(mut m) = self.shared.mem.write() else {
            return;
        };
        let due = m.since.is_some_and(|t| t.elapsed() >= DRAIN_EVERY)
            || m.active.len() >= DRAIN_KEYS
            || m.bytes >= DRAIN_BYTES;
        // The keys' bound was kept by `ease`.
        let behind = m.draining && m.bytes >= BACKLOG_BYTES;
        if behind {
            self.shared.paced.inc();
        }
        if !force && !behind && (!due || m.draining) {
            return;
        }
        if m.draining {
            // One drain at a time: wait for the running one.
            drop(m);
            let Ok(guard) = self.shared.applied.lock() else {
                return;
            };
            drop(self.shared.progress.wait_while(guard, |_| {
                self.shared.mem.read().map(|m| m.draining).unwrap_or(false)
                    && self.shared.check().is_ok()
            }));
            if self.shared.check().is_err() {
                return;
            }
            let Ok(again) = self.shared.mem.write() else {
                return;
            };
            m = again;
        }
        // The next changes start in a map sized for a drain's worth: grown from empty, it
        // rehashed about a dozen times per drain (0.5% of the CPU at 64 connections).
        let next = Changes::with_capacity_and_hasher(
            m.active.len().min(2 * DRAIN_KEYS),
            Default::default(),
        );
        let frozen = Arc::new(std::mem::replace(&mut m.active, next));
        // Once drained, sled holds them.
        m.absent.clear();
        m.frozen = frozen.clone();
        self.shared.drained.store(0, Ordering::SeqCst);
        m.draining = true;
        m.since = None;
        m.bytes = 0;
        drop(m);
        if tx.send((frozen, st.visible)).is_err() {
            self.shared.fail("the drainer thread stopped");
        }
    }

    /// Waits, holding the sync state (so no batch is answered meanwhile), while more than
    /// [`BACKLOG_KEYS`] changes are not in sled ([`Shared::not_in_sled`]) and the drain runs.
    /// The writer then goes at the drainer's pace a batch at a time, and the next drain takes
    /// about [`BACKLOG_KEYS`]. A drain that does not move (its log files held) is waited out.
    fn ease(&self) {
        let past = |m: &Mem| m.draining && self.shared.not_in_sled(m) > BACKLOG_KEYS;
        if !self.shared.mem.read().is_ok_and(|m| past(&m)) {
            return;
        }
        self.shared.eased.inc();
        let Ok(guard) = self.shared.applied.lock() else {
            return;
        };
        self.shared.easing.store(true, Ordering::SeqCst);
        drop(self.shared.progress.wait_while(guard, |_| {
            self.shared.mem.read().is_ok_and(|m| past(&m)) && self.shared.check().is_ok()
        }));
        self.shared.easing.store(false, Ordering::SeqCst);
    }
}
