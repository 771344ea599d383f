//! The writer: the one place every change to the store is decided, one batch at a time (on its
//! thread, or on a caller's: `slot.rs`).

use super::*;

/// What decides every change to the store, one batch at a time.
pub(super) struct Writer {
    pub(super) sealer: Option<Arc<Sealer>>,
    pub(super) placing: Arc<Mutex<HashMap<String, i64>>>,
    /// The cache of durable records, which the writer fills from what it reads in sled.
    pub(super) cache: Arc<Mutex<Cache>>,
    /// The store's folder, and the sled blob files already fsynced.
    pub(super) dir: PathBuf,
    pub(super) blobs: HashSet<std::ffi::OsString>,
    pub(super) notes: Arc<Mutex<Vec<LogEvent>>>,
    pub(super) db: sled::Db,
    /// sled's own log file, fsynced at checkpoints.
    pub(super) log: File,
    pub(super) wal: Wal,
    /// The frame being written (reused).
    pub(super) frame: Vec<u8>,
    /// The log block being filled (NDJSON, reused): a closed block leaves it as a copy of its
    /// size, so that it is not grown from empty, reallocation by reallocation, in every batch.
    pub(super) block: Vec<u8>,
    pub(super) shared: Arc<Shared>,
    /// Batches written, numbered; and records changed by batches not yet applied to sled (with
    /// the batch that last changed them), which the writer reads instead of sled.
    pub(super) seq: u64,
    pub(super) unapplied: HashMap<String, Unapplied>,
    /// The last batch sled had applied when `unapplied` was last pruned.
    pub(super) pruned: u64,
    /// Every id the store holds, and some it does not: a claim of a new action asks it instead
    /// of sled (made anew now and then: `ids/renew.rs`).
    pub(super) ids: ids::Held,
    /// Sealed batches go to the syncer thread, or are synced here when nothing else waits.
    pub(super) sync: mpsc::Sender<Sealed>,
    pub(super) syncer: Arc<Syncer>,
    /// Log files to remove once sled is durable past a batch: `(batch, generation)`.
    pub(super) checkpointer: Option<Checkpointer>,
    /// A new log file after this many bytes.
    pub(super) checkpoint_bytes: u64,
    pub(super) chain: Chain,
    /// `(seq, hash)` of the last log entry staged.
    pub(super) head: (u64, String),
    /// When buffered notes are written at the latest.
    pub(super) notes_due: Option<Instant>,
    /// Actions per state as the batches staged so far leave them; readers see them once the
    /// batch is durable ([`Shared::counts`], kept by the syncer).
    pub(super) counts: Counts,
    /// The counts by state as last written to [`COUNTS_KEY`] (`None`: not yet, this run).
    pub(super) saved_counts: Option<Counts>,
    /// Which unsettled action holds each twin key (SPEC §4.1), as the staged batches leave it.
    pub(super) twins: super::twins::Twins,
    /// The twin key of the claim being staged, hashed by its request: spares the writer a hash.
    pub(super) claim_twin_key: Option<String>,
}

/// The syncer thread has stopped: so has the writer (dropping it lets the drainer end).
#[derive(Debug)]
pub(super) struct SyncerGone;

/// A record as the last batch sled lacks left it: that batch, the record (`None`: removed) and
/// the stored body its value carries (see [`Pending::framed`]).
pub(super) type Unapplied = (u64, Option<Arc<Record>>, Option<Bytes>);

/// The changes of one batch, readable before they are applied.
#[derive(Default)]
pub(super) struct Pending {
    pub(super) changes: Vec<Change>,
    /// The records this batch changed (shared, not copied, with the answers, the syncer's cache
    /// and the writer's unapplied map).
    pub(super) records: HashMap<String, Option<Arc<Record>>>,
    /// Response bodies stored in this batch, by action id.
    pub(super) bodies: HashMap<String, Bytes>,
    /// For each record this batch changed, the stored body (sealed when encryption is on) its
    /// value carries after the record ([`split_value`]), which a later version that brings no
    /// body of its own carries on ([`Writer::kept_body`]).
    pub(super) framed: HashMap<String, Option<Bytes>>,
    /// The first sequence number of the log block this batch is filling (its entries are in
    /// [`Writer::block`]).
    pub(super) log_first: Option<u64>,
    pub(super) writes: usize,
    /// Someone waits for this batch to be durable.
    pub(super) durable: bool,
    /// Keys put by this batch that no batch before it ever put (see [`Mem::absent`]).
    pub(super) new_keys: HashSet<Vec<u8>>,
    /// The actions this batch gives a new expiry, with it: listed in one expiry index entry
    /// ([`expiring_key`]).
    pub(super) expiring: Expiring,
    /// The pointers this batch gives (an action's id, its record's creation time) or takes
    /// away (`None`), in order: written to their buckets once a batch ([`Writer::put_pointers`]).
    pub(super) pointers: Vec<(String, Option<Millis>)>,
}

impl Pending {
    pub(super) fn put(&mut self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) {
        self.changes.push(Change::Put(key.into(), value.into()));
    }
    pub(super) fn del(&mut self, key: impl Into<Vec<u8>>) {
        self.changes.push(Change::Del(key.into()));
    }
    pub(super) fn merge(&mut self, key: impl Into<Vec<u8>>, change: impl Into<Vec<u8>>) {
        self.changes.push(Change::Merge(key.into(), change.into()));
    }
}

impl Writer {
    /// Closing: the notes still buffered are written, everything applied, the checkpointer
    /// done, and sled checkpointed so the next start replays nothing. Dropping the writer then
    /// lets the syncer end.
    pub(super) fn close(mut self) {
        match self.batch(Vec::new(), true, false) {
            Ok(delivery) => delivery.into_iter().for_each(Delivery::send),
            Err(SyncerGone) => return,
        }
        if self.settle_down().is_ok() {
            if let Some((tx, handle)) = self.checkpointer.take() {
                drop(tx);
                let _ = handle.join();
            }
            if let Err(e) = self.checkpoint() {
                tracing::error!(error = %e, "store checkpoint at close failed");
            }
        }
    }

    /// Leaves the filter of held ids for the next open, bound to the store as this close leaves
    /// it (everything in sled): saved before the log files go, which the filter saved at the
    /// last checkpoint needs for the frames after it. Without it, the next open reads every
    /// pointer in sled.
    fn save_ids(&self) {
        if self.ids.is_empty() {
            // A store that never held an action has nothing to read at the next open.
            return;
        }
        let saved = ids::Binding::of(&self.db, self.head.clone(), self.counts)
            .and_then(|b| self.ids.save(&self.dir, &b));
        if let Err(e) = saved {
            tracing::warn!(error = %e, "store: could not save the filter of action ids; the next start reads them from sled");
        }
    }

    /// Applies, writes and hands to the syncer one batch of operations; [`SyncerGone`] once the
    /// syncer is gone. Buffered notes ride along when the batch is durable anyway, when they
    /// have waited [`NOTES_WAIT`] or number [`NOTES_BATCH`], or when `all_notes`. `idle`:
    /// nothing else waits for the writer, which may then sync the batch itself
    /// ([`Syncer::inline`]) and gives back its answers, to send once the writer is released.
    pub(super) fn batch(
        &mut self,
        ops: Vec<Op>,
        all_notes: bool,
        idle: bool,
    ) -> Result<Option<Delivery>, SyncerGone> {
        self.shared.batches.fetch_add(1, Ordering::Relaxed);
        self.ids
            .between_batches(&self.db, &self.shared, self.seq, &self.counts);
        let mut pending = Pending::default();
        // About four keys an operation (a claim: its record, pointer and index entries), and
        // the batch's log block, head and counts: reserved once instead of grown.
        pending.changes.reserve(4 * ops.len() + 3);
        // Notes first: they happened before these operations, and an operation that reads
        // the log (`Op::Sync` before a log read) must find them.
        let durable = ops.iter().any(Op::needs_flush);
        let due = self.notes_due.is_some_and(|d| d <= Instant::now());
        if all_notes || durable || due || self.notes_waiting() >= NOTES_BATCH {
            self.notes_due = None;
            let notes = self
                .notes
                .lock()
                .map(|mut n| std::mem::take(&mut *n))
                .unwrap_or_default();
            for ev in notes {
                self.append(&mut pending, ev);
            }
        }
        let mut answers = Vec::with_capacity(ops.len());
        let mut force_sync = false;
        for op in ops {
            if matches!(op, Op::Sync(_)) {
                force_sync = true;
            }
            answers.push(self.apply(op, &mut pending));
        }
        self.put_pointers(&mut pending);
        if let Some(first) = pending.log_first.take() {
            self.close_block(&mut pending, first);
            // The database learns the log's head with the entries (`history`): at open, a log
            // that ends before it was cut.
            pending.put(
                history::HEAD_KEY,
                history::head_value(self.head.0, &self.head.1),
            );
        }
        // The expiries this batch gives, in one entry tagged with where its frame goes.
        if !pending.expiring.is_empty() {
            let (generation, offset) = self.wal.position();
            let mut tag = [0; 16];
            tag[..8].copy_from_slice(&generation.to_be_bytes());
            tag[8..].copy_from_slice(&offset.to_be_bytes());
            if let Some((key, value)) = expiry_entry(&pending.expiring, tag) {
                pending.put(key, value);
            }
        }
        // The counts by state travel with the changes that move them.
        if self.saved_counts != Some(self.counts) {
            pending.put(COUNTS_KEY, encode_counts(&self.counts));
            self.saved_counts = Some(self.counts);
        }
        // Every batch goes through the syncer, even one that only read: what it read may be
        // a batch still on its way to being durable, and its answers wait for that.
        let durable = (pending.durable && pending.writes > 0) || force_sync;
        let changes = std::mem::take(&mut pending.changes);
        self.seq += 1;
        let mut failed = self.shared.check().err();
        if failed.is_none() && !history::present(&self.dir) {
            // The folder was removed under the running proxy: what it writes next would be
            // lost with it (SPEC §10.2).
            let e = format!(
                "the store folder {} is gone (its {} is missing)",
                self.dir.display(),
                history::ID_FILE
            );
            self.shared.fail(&e);
            failed = Some(e);
        }
        if failed.is_none() && !changes.is_empty() {
            wal::encode(&changes, &mut self.frame);
            if let Err(e) = self.wal.append(&mut self.frame) {
                let e = format!("write-ahead log write: {e}");
                self.shared.fail(&e);
                failed = Some(e);
            }
        }
        if failed.is_none() {
            for (id, r) in &pending.records {
                let framed = pending.framed.get(id).cloned().flatten();
                self.unapplied
                    .insert(id.clone(), (self.seq, r.clone(), framed));
            }
        }
        let sealed = Sealed {
            seq: self.seq,
            file: self.wal.file(),
            changes,
            durable,
            answers,
            records: pending.records,
            bodies: pending.bodies,
            failed,
            drain: false,
            head: Some(self.head.clone()),
            counts: Some(self.counts),
            new_keys: pending.new_keys,
        };
        let mut delivery = None;
        if idle && self.syncer.free() {
            delivery = Some(self.syncer.inline(sealed));
        } else {
            self.syncer.handing_over();
            if self.sync.send(sealed).is_err() {
                return Err(SyncerGone);
            }
        }
        // Records sled holds now leave the map once a drain has applied more batches since the
        // last look: once a drain, not once a batch (at 64 connections the map holds a drain's
        // worth of records, thousands, and a batch a few of them).
        let applied = self.shared.applied();
        if applied > self.pruned {
            self.unapplied.retain(|_, (seq, ..)| *seq > applied);
            self.pruned = applied;
        }
        if self.wal.wants_checkpoint(self.checkpoint_bytes) {
            // A new log file at once; the old one goes once sled holds its frames durably,
            // which the checkpointer thread sees to without holding up writes.
            match self.wal.start_next() {
                Ok(generation) => {
                    if let Some((tx, _)) = &self.checkpointer {
                        let _ = tx.send(Rotated {
                            generation,
                            seq: self.seq,
                            ids: self.ids.snapshot(),
                            head: self.head.clone(),
                            counts: self.counts,
                        });
                    }
                }
                Err(e) => self
                    .shared
                    .fail(&format!("start a write-ahead log file: {e}")),
            }
        }
        Ok(delivery)
    }

    pub(super) fn notes_waiting(&self) -> usize {
        self.notes.lock().map_or(0, |n| n.len())
    }

    /// Waits until every batch written is applied to sled: before reading sled beyond one key
    /// (scans) and before a checkpoint.
    pub(super) fn settle_down(&mut self) -> Result<(), String> {
        self.shared.forced_drains.fetch_add(1, Ordering::Relaxed);
        self.seq += 1;
        let marker = Sealed {
            seq: self.seq,
            file: self.wal.file(),
            changes: Vec::new(),
            durable: false,
            answers: Vec::new(),
            records: HashMap::default(),
            bodies: HashMap::default(),
            failed: None,
            drain: true,
            head: None,
            counts: None,
            new_keys: HashSet::default(),
        };
        self.syncer.handing_over();
        self.sync
            .send(marker)
            .map_err(|_| "the syncer thread stopped".to_string())?;
        self.shared.wait_applied(self.seq)?;
        self.unapplied.clear();
        Ok(())
    }

    /// Makes sled durable on its own (flush, fsync its blob files, fdatasync its log file), so
    /// that the write-ahead log holds nothing the next open must replay, and lets every log file
    /// go: the current one stays as a spare beside the checkpointer's ([`Wal::retire`]), so that
    /// the next open's first file and its first rotation need no zeros written ahead.
    fn checkpoint(&mut self) -> Result<(), String> {
        self.settle_down()?;
        sled_durable(&self.db, &self.dir, &mut self.blobs, &self.log)?;
        self.shared.logfiles().map_err(|e| e.to_string())?.sync()?;
        self.save_ids();
        self.wal.retire()
    }

    pub(super) fn read(
        &self,
        pending: &Pending,
        id: &str,
    ) -> Result<Option<Arc<Record>>, StoreError> {
        if let Some(r) = self.batched(pending, id) {
            return Ok(r);
        }
        if !self.ids.may_hold(id.as_bytes()) {
            // Never given a pointer: sled has nothing under it.
            return Ok(None);
        }
        // Not changed by any batch sled lacks: what sled holds is the durable latest, and the
        // claim fast path may answer from it next time (the generation guards the fill all the
        // same).
        let gen = self.cache.lock().map(|c| c.generation(id)).ok();
        match read_record(
            id,
            &self.shared.buckets,
            |k, id| pointers::in_sled(&self.db, k, id),
            |k| self.db.get(k).map_err(unavailable),
        )? {
            Some((key, v)) => {
                let r = Arc::new(decode(&key, &v, self.sealer.as_deref())?);
                if let (Some(gen), Ok(mut c)) = (gen, self.cache.lock()) {
                    c.fill(gen, &r);
                }
                Ok(Some(r))
            }
            None => {
                self.shared.needless_lookups.fetch_add(1, Ordering::Relaxed);
                Ok(None)
            }
        }
    }

    /// The record of `id` as this batch or a batch sled lacks left it (`Some(None)`: removed);
    /// `None` when no such batch changed it, and sled holds its latest.
    fn batched(&self, pending: &Pending, id: &str) -> Option<Option<Arc<Record>>> {
        pending
            .records
            .get(id)
            .or_else(|| self.unapplied.get(id).map(|(_, r, _)| r))
            .cloned()
    }

    /// [`Writer::read`] for the sweeper, which knows when the record it looks for was created:
    /// read at its key directly, not through its pointer's bucket, and not kept in the cache (it
    /// is about to go). `None` when no record of `id` lives there now: gone, or made again
    /// since under a new creation key (whose own expiry lists it).
    pub(super) fn read_at(
        &self,
        pending: &Pending,
        id: &str,
        created: Millis,
    ) -> Result<Option<Arc<Record>>, StoreError> {
        if let Some(r) = self.batched(pending, id) {
            return Ok(r);
        }
        let key = created_key(created, id);
        match self.db.get(&key).map_err(unavailable)? {
            Some(v) if !v.is_empty() => {
                Ok(Some(Arc::new(decode(&key, &v, self.sealer.as_deref())?)))
            }
            _ => Ok(None),
        }
    }

    /// Chains an event into the batch.
    pub(super) fn append(&mut self, pending: &mut Pending, ev: LogEvent) {
        let (e, line) = self
            .chain
            .seal_line(ev, (self.head.0, &self.head.1), now_millis());
        self.add_line(pending, e.seq, e.hash, &line);
    }

    /// [`Writer::append`] for an event about a record, sealed from the record itself.
    pub(super) fn append_record(&mut self, pending: &mut Pending, ev: &RecordEvent<'_>) {
        let (seq, hash, line) =
            self.chain
                .seal_record_line(ev, (self.head.0, &self.head.1), now_millis());
        self.add_line(pending, seq, hash, &line);
    }

    fn add_line(&mut self, pending: &mut Pending, seq: u64, hash: String, line: &[u8]) {
        // The batch's entries go into blocks (one sled value each, at most LOG_BLOCK_MAX): one
        // insert per block, not per entry.
        if self.block.len() + line.len() > LOG_BLOCK_MAX {
            if let Some(first) = pending.log_first.take() {
                self.close_block(pending, first);
            }
        }
        pending.log_first.get_or_insert(seq);
        self.block.extend_from_slice(line);
        self.block.push(b'\n');
        self.head = (seq, hash);
        pending.writes += 1;
    }

    /// Puts the log block being filled, whose first entry is `first`, in the batch, and empties
    /// the buffer for the next.
    fn close_block(&mut self, pending: &mut Pending, first: u64) {
        pending.put(log_key(first), self.block.as_slice());
        self.block.clear();
    }

    /// The stored body `old`'s value carries, which `new` (a later version of the same record
    /// that brings no body of its own) keeps: from this batch, a batch sled lacks, or sled.
    /// `None` when `new` keeps no body of the store's (none, or a body file), or when the body
    /// is under its own key ([`body_key`]), where it stays.
    pub(super) fn kept_body(
        &self,
        pending: &Pending,
        old: Option<&Record>,
        new: &Record,
    ) -> Result<Option<Bytes>, StoreError> {
        let inline =
            |r: &Record| matches!(r.response.as_ref().map(|s| &s.body), Some(BodyRef::Inline));
        let Some(old) = old.filter(|o| inline(o) && inline(new)) else {
            return Ok(None);
        };
        if let Some(b) = pending.framed.get(&old.id) {
            return Ok(b.clone());
        }
        if let Some((_, _, b)) = self.unapplied.get(&old.id) {
            return Ok(b.clone());
        }
        let value = self.db.get(record_key(old)).map_err(unavailable)?;
        Ok(value.and_then(|v| split_value(&v).1.map(Bytes::copy_from_slice)))
    }

    /// Stages `new` (replacing `old`) with its index entries; only entries that change are
    /// written. `body`: the stored body (sealed when encryption is on) to keep with it, a new one
    /// or [`Writer::kept_body`]; in the record's own value when both fit [`RECORD_MAX`], else
    /// under [`body_key`]. Returns the record as the batch now holds it.
    pub(super) fn stage(
        &mut self,
        pending: &mut Pending,
        old: Option<&Record>,
        new: Arc<Record>,
        body: Option<Bytes>,
    ) -> Arc<Record> {
        if old.map(|o| o.state) != Some(new.state) {
            self.count(old.map(|o| o.state), Some(new.state));
        }
        if new.twin || old.is_some_and(|o| o.twin) {
            let key = self.claim_twin_key.take();
            self.twins.staged(old, &new, key);
        }
        let (new, mut value) = encode_bounded(new, self.sealer.as_deref());
        let at = record_key(&new);
        let moved = old.filter(|o| record_key(o) != at);
        if let Some(o) = moved {
            pending.del(record_key(o));
            pending.del(body_key(o));
        }
        // The pointer names the creation key, which a record keeps: written with a record's
        // first version only, not again with each change (stores whose records or pointers had
        // another form are brought to this one at open: `migrate_indexes`).
        if old.is_none() || moved.is_some() {
            pending
                .pointers
                .push((new.id.clone(), Some(new.created_at)));
            self.ids.insert(new.id.as_bytes());
        }
        let framed = match body {
            Some(b) if frame_body(&mut value, &b) => Some(b),
            Some(b) => {
                pending.put(body_key(&new), b.to_vec());
                None
            }
            None => None,
        };
        pending.put(at, value);
        pending.framed.insert(new.id.clone(), framed);
        let before: Vec<Vec<u8>> = old.map(|o| index_keys(o).collect()).unwrap_or_default();
        let after: Vec<Vec<u8>> = index_keys(&new).collect();
        for k in before.iter().filter(|k| !after.contains(k)) {
            pending.del(k.clone());
        }
        for k in after.into_iter().filter(|k| !before.contains(k)) {
            pending.put(k, []);
        }
        // The old expiry's entry stays: the sweeper leaves it out once it finds the record
        // expiring at another time (or gone).
        if let Some(at) = new
            .expires_at
            .filter(|&e| old.and_then(|o| o.expires_at) != Some(e))
        {
            pending.expiring.push(Due {
                at,
                created: Some(new.created_at),
                id: new.id.clone(),
            });
        }
        pending
            .records
            .insert(new.id.clone(), Some(Arc::clone(&new)));
        pending.writes += 1;
        new
    }

    /// Writes the batch's pointers into their buckets: one change a bucket, with every change
    /// the batch makes to it, in order ([`pointers::change_value`]). Nothing is read here: the
    /// drainer makes the bucket of the change when it applies it to sled (an id the batch gives
    /// a pointer is in [`Writer::unapplied`] until then, which the writer's own lookups ask
    /// first).
    fn put_pointers(&self, pending: &mut Pending) {
        let mut by_bucket: HashMap<u16, Vec<(String, Option<Millis>)>> = HashMap::default();
        for (id, created) in std::mem::take(&mut pending.pointers) {
            let b = self.shared.buckets.of_id(id.as_bytes());
            by_bucket.entry(b).or_default().push((id, created));
        }
        for (b, changes) in by_bucket {
            let change = pointers::change_value(changes.iter().map(|(id, at)| (id.as_str(), *at)));
            pending.merge(pointers::bucket_key_of(b), change);
        }
    }

    /// Moves one action between states in the counts (`None`: absent).
    pub(super) fn count(&mut self, from: Option<State>, to: Option<State>) {
        let c = &mut self.counts;
        if let Some(f) = from {
            c[slot(f)] = c[slot(f)].saturating_sub(1);
        }
        if let Some(t) = to {
            c[slot(t)] += 1;
        }
    }

    pub(super) fn unstage(&mut self, pending: &mut Pending, old: &Record) {
        self.count(Some(old.state), None);
        if old.holds_twin() {
            self.twins.removed(old);
        }
        pending.pointers.push((old.id.clone(), None));
        pending.del(record_key(old));
        pending.del(body_key(old));
        for k in index_keys(old) {
            pending.del(k);
        }
        pending.records.insert(old.id.clone(), None);
        pending.framed.insert(old.id.clone(), None);
        pending.writes += 1;
    }
}
