//! What the writer, syncer, drainer and readers share: durable changes not yet in sled
//! ([`Mem`]), counts by state, and the store's health.

use std::sync::atomic::AtomicBool;

use super::*;

/// What the writer and the syncer share.
pub(super) struct Shared {
    /// Which bucket each action's pointer is in.
    pub(super) buckets: Buckets,
    /// Set when a change could not be made durable or applied: from then on every change fails
    /// (the write-ahead log may end in a torn frame, and sled may lack a durable batch) until the
    /// proxy restarts and replays the log.
    pub(super) broken: Mutex<Option<String>>,
    /// The last batch applied to sled (batches are numbered by the writer).
    pub(super) applied: Mutex<u64>,
    pub(super) progress: std::sync::Condvar,
    /// Durable changes not yet applied to sled.
    pub(super) mem: RwLock<Mem>,
    /// The write log's files: the drainer appends, checkpoints fsync, the writer prunes, readers
    /// take snapshots.
    pub(super) logfiles: Mutex<LogFiles>,
    /// Actions per state (by [`slot`]) as of the last batch readers can see: counted once at
    /// open, then kept by the syncer from what the writer staged ([`Writer::counts`]), so that
    /// they never show a change a claim cannot yet find.
    pub(super) counts: Mutex<Counts>,
    /// The write log's head as of the last batch readers can see (kept by the syncer): what
    /// `/readyz` and `/metrics` read, without asking the writer for anything.
    pub(super) head: Mutex<(u64, String)>,
    /// How often the writer waited for the drainer to apply everything to sled (checkpoints,
    /// recovery, expiry). Readers never make it wait.
    pub(super) forced_drains: AtomicU64,
    /// How often a sync waited for the whole running drain because the bytes gathering for the
    /// next one were past [`BACKLOG_BYTES`] (the drainer set the pace).
    pub(super) paced: prometheus_client::metrics::counter::Counter,
    /// How often a sync waited for the running drain to bring the changes not in sled below
    /// [`BACKLOG_KEYS`] (the drainer set the pace a batch at a time; `Syncer::ease`).
    pub(super) eased: prometheus_client::metrics::counter::Counter,
    /// Changes the running drain has applied to sled so far (0 as each drain starts).
    pub(super) drained: AtomicUsize,
    /// Microseconds the drainer sleeps every time it yields its core: a slow sled, for tests.
    #[cfg(test)]
    pub(super) drain_pause: AtomicU64,
    /// A sync waits on [`Shared::drained`]: the drainer wakes it as it moves on.
    pub(super) easing: AtomicBool,
    /// Batches the writer made, on its thread or a caller's.
    pub(super) batches: AtomicU64,
    /// fdatasyncs of the write-ahead log that no caller waited for (notes and lease renewals
    /// made durable within [`LAZY_FLUSH`]).
    pub(super) idle_syncs: AtomicU64,
    /// The filter of held ids was loaded at open from what the last clean close saved (not read
    /// from sled).
    pub(super) ids_loaded: bool,
    /// How often the writer's filter of held ids was made anew since the open (`ids/renew.rs`).
    pub(super) ids_renewed: AtomicU64,
    /// How often the writer looked an id up in sled and found nothing there: what the filter
    /// of held ids is for sparing (its false "perhaps").
    pub(super) needless_lookups: AtomicU64,
}

/// Actions per state, indexed by [`slot`].
pub(super) type Counts = [u64; State::ALL.len()];

pub(super) fn slot(st: State) -> usize {
    st as usize
}

/// Where the counts by state are kept, with every batch that changes them (one frame with the
/// records they count): opening a store reads them instead of walking every index key, which
/// would leave sled holding state for every page of a large store.
pub(super) const COUNTS_KEY: &[u8] = b"m/counts";

pub(super) fn encode_counts(c: &Counts) -> Vec<u8> {
    c.iter().flat_map(|n| n.to_be_bytes()).collect()
}

/// The counts at open: as kept (`true`), or (a store from before they were kept) counted once.
pub(super) fn open_counts(db: &sled::Db) -> (Counts, bool) {
    let kept = db.get(COUNTS_KEY).ok().flatten().and_then(|v| {
        let mut c = Counts::default();
        if v.len() != c.len() * 8 {
            return None;
        }
        for (n, b) in c.iter_mut().zip(v.chunks_exact(8)) {
            *n = u64::from_be_bytes(b.try_into().ok()?);
        }
        Some(c)
    });
    match kept {
        Some(c) => (c, true),
        None => (count_states(db), false),
    }
}

/// Actions per state (once, at open, for a store from before the counts were kept): from the
/// state index, and `succeeded` as the rest of the creation index.
pub(super) fn count_states(db: &sled::Db) -> Counts {
    let mut c = Counts::default();
    for st in State::ALL.into_iter().filter(|s| state_indexed(*s)) {
        let prefix = format!("s/{}/", st.as_str());
        c[slot(st)] = db.scan_prefix(prefix.as_bytes()).keys().count() as u64;
    }
    let all = db.scan_prefix(CREATED_PREFIX).keys().count() as u64;
    c[slot(State::Succeeded)] = all.saturating_sub(c.iter().sum());
    c
}

pub(super) type Changes = HashMap<Vec<u8>, Option<Vec<u8>>>;

/// Durable changes on their way into sled, newest value per key (`None`: removed), and under a
/// bucket's key the bucket's changes, joined in order ([`Mem::merge`]), which the drainer makes
/// into the bucket. Point reads look here before sled; sled gets them in bulk, so that an
/// action's claim and its outcome, made durable moments apart, cost sled one write of the record
/// instead of two, and a bucket many batches changed one rewrite.
#[derive(Default)]
pub(super) struct Mem {
    /// Changes since the last drain started.
    pub(super) active: Changes,
    /// Keys put in `active` that neither `frozen` nor sled holds: removing one again drops the
    /// change instead of sending sled a delete of a key it never had (a new action's
    /// `s/in_flight/` entry, put by its claim and removed by its outcome moments later).
    pub(super) absent: HashSet<Vec<u8>>,
    /// The changes a drain is applying to sled now.
    pub(super) frozen: Arc<Changes>,
    pub(super) draining: bool,
    /// When the oldest change in `active` arrived.
    pub(super) since: Option<Instant>,
    /// The bytes of the keys and values put in `active` (a value put again counts again).
    pub(super) bytes: usize,
}

impl Mem {
    /// The newest value of `key` waiting for sled (`Some(None)`: removed). Not for a bucket's
    /// key, whose changes wait here ([`Mem::pointer`]).
    pub(super) fn get(&self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        self.active
            .get(key)
            .or_else(|| self.frozen.get(key))
            .cloned()
    }

    /// What the changes of the bucket `key` waiting for sled say of the pointer of `id`
    /// ([`pointers::change_of`]): the newest first.
    pub(super) fn pointer(
        &self,
        key: &[u8],
        id: &str,
    ) -> Result<Option<Option<Millis>>, StoreError> {
        for changes in [&self.active, &*self.frozen] {
            if let Some(said) = pending_pointer(changes, key, id)? {
                return Ok(Some(said));
            }
        }
        Ok(None)
    }

    /// Keeps a change of the bucket `key` (made durable) after those waiting already.
    pub(super) fn merge(&mut self, key: Vec<u8>, change: Vec<u8>) {
        self.bytes += key.len() + change.len();
        merge_change(&mut self.active, key, change);
    }
}

/// Keeps the change `change` of the bucket `key` in `changes`, after the one it holds for that
/// bucket already ([`pointers::join`]).
fn merge_change(changes: &mut Changes, key: Vec<u8>, change: Vec<u8>) {
    match changes.get_mut(&key) {
        Some(Some(earlier)) => pointers::join(earlier, &change),
        _ => drop(changes.insert(key, Some(change))),
    }
}

/// What the change `changes` holds for the bucket `key` says of the pointer of `id`
/// ([`pointers::change_of`]); `None`: no change of the bucket, or none naming `id`.
fn pending_pointer(
    changes: &Changes,
    key: &[u8],
    id: &str,
) -> Result<Option<Option<Millis>>, StoreError> {
    match changes.get(key) {
        Some(Some(change)) => pointers::change_of(key, change, id),
        _ => Ok(None),
    }
}

/// Drains run at least this often, and when this many keys, or this many bytes, wait. The bytes
/// bound what readers' overlay holds when few keys carry much: the write-log blocks of replays'
/// notes (tens of MiB a second at full speed), which waited for the clock.
pub(super) const DRAIN_EVERY: std::time::Duration = std::time::Duration::from_millis(250);
pub(super) const DRAIN_KEYS: usize = 2_048;
pub(super) const DRAIN_BYTES: usize = 2 << 20;
/// The drainer is behind the writer past this many changes not in sled while a drain runs
/// ([`Shared::not_in_sled`]: those gathering for the next drain, and those the running one has
/// yet to apply): the next sync waits until the drain has caught up below it
/// (`Syncer::ease`), so the writer goes at sled's pace in steps of a batch (a few ms). Without
/// a bound, writes faster than sled takes them (one thread of inserts) grew the overlay, and the
/// write-ahead log the checkpoints cannot let go, without bound: 2.8 GB and 1.3 GB after 40 s at
/// 26,000 writes a second through the store API (decision 0027); with one on the keys
/// gathering alone, a sync past it waited out a whole drain (100–500 ms with expiry's cold
/// pages, decision 0054). Four drains' worth, so that drains stay large (a key changed twice
/// within one costs sled one write).
pub(super) const BACKLOG_KEYS: usize = 4 * DRAIN_KEYS;
/// Past this many bytes gathering while a drain runs (a few keys carrying much), the next sync
/// waits for the whole running drain (see `Syncer::maybe_drain`).
pub(super) const BACKLOG_BYTES: usize = 4 * DRAIN_BYTES;

/// Reads one key: the durable changes not yet in sled first, then sled.
pub(super) fn read_key(
    shared: &Shared,
    db: &sled::Db,
    key: &[u8],
) -> Result<Option<sled::IVec>, StoreError> {
    let pending = shared
        .mem
        .read()
        .map_err(|_| unavailable("store lock poisoned"))?
        .get(key);
    match pending {
        Some(v) => Ok(v.map(sled::IVec::from)),
        None => db.get(key).map_err(unavailable),
    }
}

/// When the record of `id` was created, as its pointer in the bucket `key` says: the durable
/// changes of the bucket not yet in sled first, then sled's copy.
pub(super) fn read_pointer(
    shared: &Shared,
    db: &sled::Db,
    key: &[u8],
    id: &str,
) -> Result<Option<Millis>, StoreError> {
    let pending = shared
        .mem
        .read()
        .map_err(|_| unavailable("store lock poisoned"))?
        .pointer(key, id)?;
    match pending {
        Some(said) => Ok(said),
        None => pointers::in_sled(db, key, id),
    }
}

impl Shared {
    pub(super) fn new(
        logfiles: LogFiles,
        counts: Counts,
        head: (u64, String),
        ids_loaded: bool,
        buckets: Buckets,
        waits: crate::store::DrainerWaits,
    ) -> Shared {
        Shared {
            buckets,
            head: Mutex::new(head),
            forced_drains: AtomicU64::new(0),
            paced: waits.whole_drain,
            eased: waits.eased,
            drained: AtomicUsize::new(0),
            #[cfg(test)]
            drain_pause: AtomicU64::new(0),
            easing: AtomicBool::new(false),
            batches: AtomicU64::new(0),
            idle_syncs: AtomicU64::new(0),
            counts: Mutex::new(counts),
            broken: Mutex::new(None),
            applied: Mutex::new(0),
            progress: std::sync::Condvar::new(),
            mem: RwLock::new(Mem::default()),
            logfiles: Mutex::new(logfiles),
            ids_loaded,
            ids_renewed: AtomicU64::new(0),
            needless_lookups: AtomicU64::new(0),
        }
    }

    pub(super) fn logfiles(&self) -> Result<std::sync::MutexGuard<'_, LogFiles>, StoreError> {
        self.logfiles
            .lock()
            .map_err(|_| unavailable("store lock poisoned"))
    }

    pub(super) fn check(&self) -> Result<(), String> {
        match self.broken.lock().map(|b| b.clone()) {
            Ok(None) => Ok(()),
            Ok(Some(e)) => Err(format!(
                "the store stopped taking changes after an earlier failure ({e}); restart the proxy"
            )),
            Err(_) => Err("store lock poisoned".into()),
        }
    }

    /// Stops the store taking changes; the first failure is logged, once.
    pub(super) fn fail(&self, e: &str) {
        if let Ok(mut b) = self.broken.lock() {
            if b.is_none() {
                tracing::error!(error = %e, "store failed; no further changes until restart");
                *b = Some(e.to_string());
            }
        }
        // Under the lock the waiters check under, so that none misses the notification.
        if let Ok(_applied) = self.applied.lock() {
            self.progress.notify_all();
        }
    }

    pub(super) fn applied(&self) -> u64 {
        self.applied.lock().map(|a| *a).unwrap_or(0)
    }

    /// Whether sled is keeping up: no drain is running, or fewer changes wait for the next one
    /// than a drain's worth. A sweep steps only then (or after [`EXPIRE_ROOM_WAIT`]): an
    /// expired action costs the drainer about as much as a write (its bucket read and written,
    /// its record deleted, in pages mostly cold), and steps taken while the drainer was behind
    /// pushed the changes waiting past [`BACKLOG_KEYS`], where every write waits for the
    /// drainer (decisions 0052, 0054).
    pub(super) fn drainer_has_room(&self) -> bool {
        self.mem
            .read()
            .map(|m| !m.draining || m.active.len() < DRAIN_KEYS)
            .unwrap_or(true)
    }

    /// How many changes in `m` sled does not hold yet: those gathering for the next drain, and
    /// those the running drain has yet to apply.
    pub(super) fn not_in_sled(&self, m: &Mem) -> usize {
        if !m.draining {
            return m.active.len();
        }
        let left = m
            .frozen
            .len()
            .saturating_sub(self.drained.load(Ordering::SeqCst));
        m.active.len() + left
    }

    /// Waits until batch `seq` is applied to sled (or the store broke).
    pub(super) fn wait_applied(&self, seq: u64) -> Result<(), String> {
        static NEVER: AtomicBool = AtomicBool::new(false);
        self.wait_applied_unless(seq, &NEVER).map(drop)
    }

    /// [`Shared::wait_applied`], for a helper thread that must not outlive the store: `Ok(false)`
    /// once `stop` is set (looked at every 50 ms) before batch `seq` was applied.
    pub(super) fn wait_applied_unless(&self, seq: u64, stop: &AtomicBool) -> Result<bool, String> {
        let mut guard = self.applied.lock().map_err(|_| "store lock poisoned")?;
        while *guard < seq {
            if stop.load(Ordering::Relaxed) {
                return Ok(false);
            }
            self.check()?;
            guard = self
                .progress
                .wait_timeout(guard, std::time::Duration::from_millis(50))
                .map_err(|_| "store lock poisoned")?
                .0;
        }
        drop(guard);
        self.check().map(|()| true)
    }
}

/// What a reader sees of the durable changes not yet in sled, taken at one moment: the keys put
/// (newest value) and the keys removed, and the changes of buckets, among those `wanted` keeps.
/// Frozen changes first, then the active ones over them.
pub(super) struct Overlay {
    pub(super) puts: std::collections::BTreeMap<Vec<u8>, Vec<u8>>,
    pub(super) dels: HashSet<Vec<u8>>,
    /// Each bucket's changes, the frozen ones then the active ones ([`merge_change`]).
    pub(super) buckets: Changes,
}

impl Overlay {
    pub(super) fn take(
        shared: &Shared,
        wanted: impl Fn(&[u8]) -> bool,
    ) -> Result<Overlay, StoreError> {
        let m = shared
            .mem
            .read()
            .map_err(|_| unavailable("store lock poisoned"))?;
        let mut o = Overlay {
            puts: Default::default(),
            dels: HashSet::default(),
            buckets: HashMap::default(),
        };
        for changes in [&*m.frozen, &m.active] {
            for (k, v) in changes.iter().filter(|(k, _)| wanted(k)) {
                if pointers::is_bucket(k) {
                    if let Some(change) = v {
                        merge_change(&mut o.buckets, k.clone(), change.clone());
                    }
                    continue;
                }
                match v {
                    Some(v) => {
                        o.dels.remove(k);
                        o.puts.insert(k.clone(), v.clone());
                    }
                    None => {
                        o.puts.remove(k);
                        o.dels.insert(k.clone());
                    }
                }
            }
        }
        Ok(o)
    }

    /// A key's value: the overlay's, else sled's.
    pub(super) fn get(&self, db: &sled::Db, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        if let Some(v) = self.puts.get(key) {
            return Ok(Some(v.clone()));
        }
        if self.dels.contains(key) {
            return Ok(None);
        }
        Ok(db.get(key).map_err(unavailable)?.map(|v| v.to_vec()))
    }

    /// When the record of `id` was created, as its pointer in the bucket `key` says: the
    /// overlay's changes of the bucket, else sled's copy.
    pub(super) fn pointer(
        &self,
        db: &sled::Db,
        key: &[u8],
        id: &str,
    ) -> Result<Option<Millis>, StoreError> {
        match pending_pointer(&self.buckets, key, id)? {
            Some(said) => Ok(said),
            None => pointers::in_sled(db, key, id),
        }
    }

    /// The write-log entries of the overlay's log blocks with `seq >= from`, in order.
    pub(super) fn log_entries(&self, from: u64) -> Vec<Result<Entry, u64>> {
        let mut out = Vec::new();
        for (k, block) in &self.puts {
            let Some(first) = log_seq(k) else { continue };
            for (i, line) in log_lines(block).enumerate() {
                match serde_json::from_slice::<Entry>(line) {
                    Ok(e) if e.seq >= from => out.push(Ok(e)),
                    Ok(_) => {}
                    Err(_) => out.push(Err(first + i as u64)),
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bucket's changes waiting for sled answer for the ids they name, the newest over the
    /// older (a change gathering for the next drain over the one a drain applies, a later
    /// change over an earlier one), and for no other id: that one is sled's to answer. A
    /// reader's overlay answers the same.
    #[test]
    fn a_buckets_waiting_changes_answer_for_the_ids_they_name_newest_first() {
        let key = b"p/\x00\x07".to_vec();
        let change = |entries: &[(&str, Option<Millis>)]| {
            pointers::change_value(entries.iter().map(|&(id, at)| (id, at)))
        };
        let mut m = Mem::default();
        m.merge(key.clone(), change(&[("a", Some(1)), ("b", Some(2))]));
        m.frozen = Arc::new(std::mem::take(&mut m.active));
        m.merge(key.clone(), change(&[("a", None)]));
        m.merge(key.clone(), change(&[("c", Some(3)), ("c", Some(4))]));
        let said = |id: &str| m.pointer(&key, id).expect("test step");
        assert_eq!(
            [said("a"), said("b"), said("c"), said("d")],
            [Some(None), Some(Some(2)), Some(Some(4)), None]
        );
        assert_eq!(m.pointer(b"p/\x00\x08", "a").expect("test step"), None);

        let tmp = tempfile::tempdir().expect("test step");
        let shared = Shared::new(
            LogFiles::open(
                &tmp.path().join("log"),
                crate::store::logfiles::SEGMENT_BYTES,
            )
            .expect("test step"),
            Counts::default(),
            (0, String::new()),
            false,
            Buckets::new([0; 16]),
            Default::default(),
        );
        *shared.mem.write().expect("test step") = m;
        let db = sled_config(&tmp.path().join("db"))
            .open()
            .expect("test step");
        db.insert(&key, pointers::bucket_with(None, "d", 5))
            .expect("test step");
        let overlay = Overlay::take(&shared, |_| true).expect("test step");
        let found = |id: &str| {
            (
                overlay.pointer(&db, &key, id).expect("test step"),
                read_pointer(&shared, &db, &key, id).expect("test step"),
            )
        };
        for (id, at) in [("a", None), ("b", Some(2)), ("c", Some(4)), ("d", Some(5))] {
            assert_eq!(found(id), (at, at), "{id}");
        }
    }
}
