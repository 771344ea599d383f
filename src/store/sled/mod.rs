//! The embedded store: sled 0.34.7 behind one writer with group commit.
//!
//! Every change goes through a single writer. Its thread takes a batch of operations off its queue
//! (a caller with nothing else in flight runs its own batch of one instead: no hand-off),
//! decides each against the current records (plus the changes of batches not yet in sled), stages
//! the records and their write-log entries and appends the batch as one frame to the write-ahead
//! log ([`super::wal`]). A syncer thread makes waiting frames durable with one `fdatasync`, then
//! makes their changes visible to readers ([`Mem`]) and answers (a writer with nothing else to
//! do and nothing on its way to the syncer does this itself: one hand-off less); a drainer thread applies the
//! durable changes to sled in bulk. sled's own `flush()` (which ends in `sync_file_range`, not
//! enough for a power loss; SPEC §13) runs only at checkpoints, on a thread of their own, followed
//! by an fsync of sled's files; only then are the log files it covers let go (deleted, the newest
//! kept as the spare a later log file starts in; a clean close lets the current one go too,
//! keeping up to two spares, and the next open starts in one). So:
//! - a claim is durable before its request leaves, an outcome before its client is answered;
//! - a state change and its log entry are in one atomic batch: neither exists without the other;
//! - claims are atomic (one writer decides at a time), and the log has one chain;
//! - many concurrent writes share one flush, and a claim that finds an existing record never
//!   waits for a flush it does not need;
//! - claims of settled or running records (replays, conflicts) are answered off the writer, from a
//!   cache of their last durable versions.
//!
//! The code follows the threads: `writer.rs` seals batches and `decide.rs` decides their
//! operations (on the writer's thread, or on a caller's when nothing else is in flight:
//! `slot.rs`), `syncer.rs` makes them
//! durable and visible, `drainer.rs` applies them to sled, `checkpoint.rs` lets log files go
//! (and at a clean close leaves sled a snapshot of the run, so the next open reads none of its log);
//! `shared.rs` is what they share (the durable changes not yet in sled, counts, health); `ops.rs`
//! what callers send; `cache.rs`, `codec.rs` (with `packed.rs`, a record's binary form),
//! `index.rs`, `ids/` (which ids the store may hold: a filter made anew from sled while the store
//! runs once it has taken half the ids it can, saved in `ids.filter` at each
//! checkpoint, clean close and open, bound to the write log's head, which the next open loads,
//! after a crash too, when the frames it replays hold every entry since), `bodies.rs`
//! and `open.rs` the rest; `stats.rs` counts what the store has done, for tests and the bench.
//!
//! Keys (one tree): `c/{created_at:be64}{id}` the record (packed: [`packed`]; then its small
//! stored body), which is also the creation index
//! (lists page newest first; new records land in the newest leaves, which sled holds), `p/{bucket:be16}`
//! the pointers of the actions in one of 65,536 buckets (which one: SHA-256 over a secret the
//! store draws once, `m/buckets`, and the id), each an id and its record's creation time
//! (an action's entry written with its record's first version: [`pointers`]; stores from before
//! kept one `a/{id}` an action, holding the creation time, the whole `c/` key, or the record
//! itself with an empty `c/` entry: moved at open), `r/{created_at:be64}{id}`
//! a small stored body too large to share its record's value (most are kept after the record in
//! that value: [`codec::split_value`]; `b/{id}` before, moved at open), `s/{state}/{id}` state index (all states
//! but `succeeded`), `t/{task}\0{id}` task index, `e/{earliest:be64}{wal position}` expiry index, one
//! entry a batch listing the actions it settled (the sweeper reads only what is due; one entry an
//! action, `e/{expires_at:be64}{id}`, before, and by minute before that, rekeyed at open), `f/{sha256}/{id}` the
//! actions whose response is a body file. Bodies over 64 KiB live in `bodies/{sha256}` beside the database;
//! sled's own blob files are fsynced at each checkpoint. The write log lives in files of its own
//! ([`super::logfiles`]): in a batch's frame its entries are a change to the key
//! `l/{first seq:be64}` (the NDJSON lines the batch appended), which the drainer appends to the
//! log files instead of sled. Stores from before kept those keys (and `m/log_anchor`) in sled;
//! opening one moves them to the files.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::oneshot;

use super::files::{self, fsync_dir};
use super::history;
use super::logfiles::LogFiles;
use super::seal::{seal_opt, Sealer};
use super::wal::{self, Change, Wal};
use super::{
    claim_events, recover_event, resolve_event, settle_event, BoxFuture, Filter, SettleRequest,
    Store, StoreError, StoreOptions,
};
use crate::action::{
    apply_resolve, apply_settle, decide_claim_owned, now_millis, recover_in_flight, BodyRef, Claim,
    ClaimRequest, Millis, Record, Resolve, State,
};
use crate::log::{self, Actor, Chain, Entry, Event, LogEvent, RecordEvent, Verification, GENESIS};

mod bodies;
mod cache;
mod checkpoint;
mod codec;
mod decide;
mod drainer;
mod ids;
mod index;
mod open;
mod ops;
mod packed;
mod pointers;
mod shared;
mod slot;
mod stats;
mod syncer;
mod twins;
mod writer;

use cache::*;
use checkpoint::*;
use codec::*;
pub use codec::{read_value, record_value};
use drainer::*;

pub use index::{action_keys, expiry_entry, Due};
pub use pointers::{bucket_with, Buckets, BUCKETS_KEY};
use pointers::{push_timed, timed};

use index::*;

use ops::*;
use shared::*;
use slot::*;
use syncer::*;
use writer::*;

/// The store's maps and sets (a batch's records and keys, the changes on their way into sled,
/// the cache): a write hashed an id or a key about 120 times, and SipHash was 7% of the
/// instructions a write took ([`crate::FastMap`]).
type HashMap<K, V> = crate::FastMap<K, V>;
type HashSet<K> = crate::FastSet<K>;

/// Bodies larger than this are kept as files, not in sled.
pub const INLINE_BODY_MAX: usize = 64 * 1024;
/// Most operations one flush covers.
const MAX_BATCH: usize = 1024;
/// sled writes a value (or a consolidated page) larger than a quarter of a segment as a separate
/// blob file, and blob files do not survive a SIGKILL reliably in sled 0.34 (seen in the torture
/// harness with 2 MiB segments: the store no longer opened). With 8 MiB segments every page we
/// store stays in the log: records ≤ `RECORD_MAX`, bodies ≤ 64 KiB and log blocks ≤ 64 KiB,
/// at most 17 to a leaf.
const SEGMENT_SIZE: usize = 8 << 20;
/// The largest record value given to sled. A leaf splits only once it holds more than 16
/// entries, so 17 records of this size (1,904 KiB, plus keys) stay under a quarter segment
/// (2 MiB, less headers), past which sled writes a page as a blob file; so do stored bodies
/// (`INLINE_BODY_MAX`) and log blocks (`LOG_BLOCK_MAX`). Past it, a record sheds evidence: see
/// [`encode_bounded`].
pub const RECORD_MAX: usize = 112 * 1024;
/// A log block is closed at this size and the next entries start a new one.
const LOG_BLOCK_MAX: usize = 64 * 1024;
/// sled's page cache (its default is 1 GiB). 8 MiB: with 16 the proxy's peak RSS under load was
/// 10–50 MiB higher at the same throughput (docs/decisions.md, "sled's page cache, halved").
const SLED_CACHE: u64 = 8 << 20;
const ANCHOR_KEY: &[u8] = b"m/log_anchor";
/// A sweep's pause after each step, in multiples of what the step took.
const EXPIRE_PACE: u32 = 3;
/// The longest pause between a sweep's steps.
const EXPIRE_PAUSE_MAX: std::time::Duration = std::time::Duration::from_millis(100);
/// How long a sweep's step waits at most for the drainer to have room
/// ([`Shared::drainer_has_room`]), checked every [`EXPIRE_ROOM_POLL`]: past it the step goes
/// anyway, so that expiry keeps some pace under a load sled never has room for.
const EXPIRE_ROOM_WAIT: std::time::Duration = std::time::Duration::from_millis(500);
const EXPIRE_ROOM_POLL: std::time::Duration = std::time::Duration::from_millis(5);
/// Audit-only log entries and lease renewals are made durable within this.
const LAZY_FLUSH: std::time::Duration = std::time::Duration::from_millis(100);
/// Audit-only log entries (notes: `replayed`, `conflict`, …) wait at most this long, or until
/// this many are buffered, for a batch to join: fewer, larger log blocks.
const NOTES_WAIT: std::time::Duration = std::time::Duration::from_millis(20);
const NOTES_BATCH: usize = 256;

pub struct SledStore {
    /// `None` once closed: closing releases sled's file lock, so the folder can be reopened.
    db: RwLock<Option<sled::Db>>,
    /// The disk guard: free space kept on the volume (`store.reserve`).
    space: super::space::Space,
    dir: PathBuf,
    chain: Chain,
    tx: Mutex<Option<mpsc::Sender<Op>>>,
    /// The writer, which its thread and (when nothing else is in flight) a caller run.
    slot: Arc<Slot>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Flushes performed, for metrics and the "flushes per write" figure.
    flushes: Arc<AtomicU64>,
    /// Audit-only log events waiting for the writer.
    notes: Arc<Mutex<Vec<LogEvent>>>,
    /// The last durable version of recently settled records, with small bodies.
    cache: Arc<Mutex<Cache>>,
    /// Body files being placed by settlements not yet committed, by hash.
    placing: Arc<Mutex<HashMap<String, i64>>>,
    /// Durable changes on their way into sled, among others.
    shared: Arc<Shared>,
    /// Seals stored heads and bodies (`store.encrypt_key_env`).
    sealer: Option<Arc<Sealer>>,
    /// The store's secret: names body files, and keys what the proxy writes (SPEC §13).
    keyer: crate::identity::Keyer,
    /// `log.retention`: write-log files older than this are pruned after each sweep.
    log_retention: Option<std::time::Duration>,
}

/// sled as the store configures it at `dir` (public for the benches' `sled alone` floor).
pub fn sled_config(dir: &Path) -> sled::Config {
    sled::Config::new()
        .path(dir)
        .segment_size(SEGMENT_SIZE)
        .cache_capacity(SLED_CACHE)
        .flush_every_ms(None)
}

/// Whether a lone call may block its thread for one fdatasync ([`Slot::inline`]): only where
/// another worker serves everything else meanwhile, a multi-threaded runtime with two workers
/// or more. With one (a sidecar limited to one core, an operator command) a lone write would
/// stall every read, replay and health probe for its fdatasync, and for as long as a failing
/// disk holds it: there the writer thread makes it durable, as under load.
fn may_block_here() -> bool {
    tokio::runtime::Handle::try_current().is_ok_and(|h| {
        h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
            && h.metrics().num_workers() >= 2
    })
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

/// The write log's head: its last entry, or where a pruned log starts, or the genesis.
fn corrupt_entry(seq: u64) -> StoreError {
    StoreError::Corrupt {
        id: format!("write log entry {seq}"),
        reason: "does not parse".into(),
    }
}

fn log_head(files: &LogFiles) -> Result<(u64, String), StoreError> {
    if let Some(last) = files.last() {
        return Ok(last);
    }
    Ok(files
        .anchor()
        .map_err(unavailable)?
        .map(|(seq, prev)| (seq - 1, prev))
        .unwrap_or((0, GENESIS.to_string())))
}

impl SledStore {
    /// Writes the audit entries still buffered (a reader of the log sees every event so far): a
    /// batch like any other, not a wait for the drainer.
    async fn write_notes(&self) -> Result<(), StoreError> {
        if self.notes.lock().map_or(0, |n| n.len()) > 0 {
            self.call(Op::Sync).await?;
        }
        Ok(())
    }

    /// The fast path of a claim: a record that exists, is durable, and cannot be claimed
    /// (`succeeded`, `unknown`, in flight under a live lease, or a reused key) is answered from
    /// the cache of durable records, off the writer thread, so that replays and conflicts scale
    /// with cores. Anything else goes to the writer.
    fn settled(&self, req: &ClaimRequest) -> Option<Claim> {
        // From the cache only. A miss goes to the writer, which reads the record anyway (and
        // fills the cache from what it reads in sled): most misses are new keys, and a read of
        // sled here found nothing for them at the cost of a tree walk.
        // The shared record under the lock, and shared with the answer.
        let r = Arc::clone(&self.cache.lock().ok()?.map.get(&req.fresh.id)?.0);
        if req.replaces(&r) {
            return None;
        }
        // What the cache holds is durable: the syncer puts a change in only after its
        // write-ahead log frame is (lease renewals aside, which only ever extend a lease).
        if req.reuses_key(&r) {
            return Some(Claim::KeyReused(r));
        }
        match r.state {
            State::Succeeded | State::Unknown => Some(Claim::Existing(r)),
            State::InFlight if r.lease_until.is_some_and(|l| l >= req.now) => {
                Some(Claim::Existing(r))
            }
            _ => None,
        }
    }

    /// Counts settlements writing (`+1`) or done with (`-1`) a body file.
    fn placing(&self, sha: &str, delta: i64) {
        if let Ok(mut p) = self.placing.lock() {
            let n = p.entry(sha.to_string()).or_insert(0);
            *n += delta;
            if *n <= 0 {
                p.remove(sha);
            }
        }
    }

    fn db(&self) -> Result<sled::Db, StoreError> {
        self.db
            .read()
            .map_err(|_| unavailable("store lock poisoned"))?
            .clone()
            .ok_or_else(|| unavailable("store is closed"))
    }

    fn send(&self, op: Op) -> Result<(), StoreError> {
        let guard = self
            .tx
            .lock()
            .map_err(|_| unavailable("store lock poisoned"))?;
        let sender = guard
            .as_ref()
            .ok_or_else(|| unavailable("store is closed"))?;
        sender
            .send(op)
            .map_err(|_| unavailable("store writer stopped"))
    }

    /// One operation of the writer, answered once durable: queued for the writer thread, or,
    /// when no other call is in flight, run on this thread ([`Slot::inline`]).
    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Op) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        let call = Call::begin(&self.slot);
        let op = make(tx);
        // A closed store's slot holds no writer: the call is then queued, and refused.
        let queued = if call.alone && may_block_here() {
            self.slot.inline(op)
        } else {
            Some(op)
        };
        if let Some(op) = queued {
            self.send(op)?;
        }
        // `call` counts until the answer is in.
        rx.await.map_err(|_| unavailable("store writer stopped"))?
    }
}

impl SledStore {
    /// Gzips the write log's closed files, on a blocking thread: each is compressed without
    /// the log's lock (a closed file is never written again), then swapped in under it, then
    /// its plain file removed (a reader that opened it keeps it).
    async fn compress_log(&self) -> Result<usize, StoreError> {
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || {
            let todo = shared.logfiles()?.to_compress();
            let mut done = 0;
            for (first, plain, gz) in todo {
                let (from, to) =
                    crate::store::logzip::compress(&plain, &gz).map_err(unavailable)?;
                if shared.logfiles()?.compressed(first) {
                    let _ = std::fs::remove_file(&plain);
                    done += 1;
                    tracing::debug!(first, from, to, "write log: a closed file compressed");
                } else {
                    // Pruned meanwhile.
                    let _ = std::fs::remove_file(&gz);
                }
            }
            Ok(done)
        })
        .await
        .map_err(unavailable)?
    }

    /// Prunes the write log's files past `log.retention` (after a sweep), on a blocking thread:
    /// the anchor is written and the files taken out under the log's lock, and removed after it,
    /// so that neither the writer nor the drainer's appends wait for the unlinks.
    async fn prune_log(&self, now: Millis) -> Result<(), StoreError> {
        let Some(keep) = self.log_retention else {
            return Ok(());
        };
        let cutoff = crate::action::rfc3339(now.saturating_sub(keep.as_millis() as u64));
        let shared = self.shared.clone();
        let dropped = tokio::task::spawn_blocking(move || {
            let files = shared.logfiles()?.cut(&cutoff).map_err(unavailable)?;
            crate::store::logfiles::remove(&files);
            Ok::<_, StoreError>(files.len())
        })
        .await
        .map_err(unavailable)??;
        if dropped > 0 {
            tracing::info!(
                files = dropped,
                "write log: pruned files past the retention"
            );
        }
        Ok(())
    }
}

impl Store for SledStore {
    fn claim(&self, req: ClaimRequest) -> BoxFuture<'_, Result<Claim, StoreError>> {
        if let Some(claim) = self.settled(&req) {
            return Box::pin(async move { Ok(claim) });
        }
        Box::pin(self.call(|tx| Op::Claim(Box::new(req), tx)))
    }

    fn settle(&self, mut req: SettleRequest) -> BoxFuture<'_, Result<Arc<Record>, StoreError>> {
        Box::pin(async move {
            if let Some(resp) = req.settlement.response.as_mut() {
                self.place_body(&mut req.body, &mut resp.body).await?;
            }
            let file = match req.settlement.response.as_ref().map(|r| &r.body) {
                Some(BodyRef::File { sha256 }) => Some(sha256.clone()),
                _ => None,
            };
            let result = self.call(|tx| Op::Settle(Box::new(req), tx)).await;
            if let Some(sha) = file {
                self.placing(&sha, -1);
            }
            result
        })
    }

    fn resolve(
        &self,
        id: String,
        mut res: Resolve,
        event: Event,
    ) -> BoxFuture<'_, Result<Record, StoreError>> {
        Box::pin(async move {
            // A lookup's answer is kept like any other stored response.
            if let Some(resp) = res.response.as_mut() {
                self.place_body(&mut res.body, &mut resp.body).await?;
            }
            self.call(|tx| Op::Resolve(id, Box::new(res), event, tx))
                .await
                .map(Arc::unwrap_or_clone)
        })
    }

    fn cached(&self, id: &str) -> Option<(Arc<Record>, Option<Bytes>)> {
        let c = self.cache.lock().ok()?;
        c.map
            .get(id)
            .filter(|(r, _)| r.state == State::Succeeded)
            .cloned()
    }

    fn note(&self, event: LogEvent) {
        // Buffered, and the writer told only of the first and of a full batch: under load many
        // notes share one wake-up, one batch and one log block.
        let wake = match self.notes.lock() {
            Ok(mut n) => {
                n.push(event);
                n.len() == 1 || n.len() == NOTES_BATCH
            }
            Err(_) => return,
        };
        if wake {
            if let Err(e) = self.send(Op::Notes) {
                tracing::warn!(error = %e, "could not append a write-log entry");
            }
        }
    }

    fn log(&self, after: u64, limit: usize) -> BoxFuture<'_, Result<Vec<Entry>, StoreError>> {
        Box::pin(async move {
            self.write_notes().await?;
            let start = after.saturating_add(1);
            // The durable entries not yet in the files, taken before the files are read: any
            // the drainer moves meanwhile are then in the files, and found there.
            let pending = Overlay::take(&self.shared, |k| log_seq(k).is_some())?;
            let reader = self.shared.logfiles()?.reader(start).map_err(unavailable)?;
            tokio::task::spawn_blocking(move || {
                let mut out: Vec<Entry> = Vec::new();
                for e in reader.entries() {
                    let e = e.map_err(corrupt_entry)?;
                    if e.seq >= start {
                        out.push(e);
                    }
                    if out.len() >= limit {
                        return Ok(out);
                    }
                }
                let after_files = out.last().map_or(start, |e| e.seq + 1);
                for e in pending.log_entries(after_files) {
                    out.push(e.map_err(corrupt_entry)?);
                    if out.len() >= limit {
                        break;
                    }
                }
                Ok(out)
            })
            .await
            .map_err(unavailable)?
        })
    }

    fn verify_log(&self) -> BoxFuture<'_, Result<Verification, StoreError>> {
        Box::pin(async move {
            self.write_notes().await?;
            let pending = Overlay::take(&self.shared, |k| log_seq(k).is_some())?;
            let reader = self.shared.logfiles()?.reader(0).map_err(unavailable)?;
            let chain = self.chain.clone();
            tokio::task::spawn_blocking(move || {
                let anchor = reader.anchor.clone();
                // Entries of a store from before the log files, pruned there but kept in a frame
                // replayed since, come before the anchor.
                let from = anchor.as_ref().map_or(0, |(seq, _)| *seq);
                let last = std::cell::Cell::new(0u64);
                let in_files = reader
                    .entries()
                    .filter(move |e| !matches!(e, Ok(e) if e.seq < from))
                    .inspect(|e| {
                        if let Ok(e) = e {
                            last.set(e.seq);
                        }
                    });
                // Then the durable entries the drainer has not appended yet.
                let rest = std::iter::once(()).flat_map(|()| pending.log_entries(last.get() + 1));
                Ok(log::verify(&chain, in_files.chain(rest), anchor))
            })
            .await
            .map_err(unavailable)?
        })
    }

    fn full(&self) -> Option<String> {
        self.space.full().then(|| self.space.why())
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        // Its folder, as well as its writer: a folder removed under a running store is seen
        // at once, not at the next write that fails.
        Box::pin(async move {
            self.shared.check().map_err(StoreError::Unavailable)?;
            if let Some(why) = self.full() {
                return Err(StoreError::Unavailable(why));
            }
            for part in [crate::store::history::ID_FILE, "wal"] {
                if std::fs::metadata(self.dir.join(part)).is_err() {
                    return Err(StoreError::Broken(format!(
                        "{} is gone from the store folder {}",
                        part,
                        self.dir.display()
                    )));
                }
            }
            Ok(())
        })
    }

    fn log_head(&self) -> BoxFuture<'_, Result<(u64, String), StoreError>> {
        // The head as of the last visible batch: a health probe or a scrape never waits on the
        // writer or the drainer.
        Box::pin(async move {
            self.shared.check().map_err(StoreError::Unavailable)?;
            self.shared
                .head
                .lock()
                .map(|h| h.clone())
                .map_err(|_| unavailable("store lock poisoned"))
        })
    }

    fn renew(
        &self,
        id: &str,
        owner: &str,
        lease: Millis,
        now: Millis,
    ) -> BoxFuture<'_, Result<bool, StoreError>> {
        let (id, owner) = (id.to_string(), owner.to_string());
        let until = now.saturating_add(lease);
        Box::pin(self.call(move |tx| Op::Renew(id, owner, until, tx)))
    }

    fn keyer(&self) -> crate::identity::Keyer {
        self.keyer.clone()
    }

    fn counts(&self) -> BoxFuture<'_, Result<Vec<(State, u64)>, StoreError>> {
        // Kept by the writer as it stages changes: a metrics scrape neither scans sled nor
        // holds up writes.
        Box::pin(async move {
            let c = self
                .shared
                .counts
                .lock()
                .map_err(|_| unavailable("store lock poisoned"))?;
            Ok(State::ALL.iter().map(|&st| (st, c[slot(st)])).collect())
        })
    }

    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(async move {
            let db = self.db()?;
            let shared = &self.shared;
            match read_record(
                id,
                &shared.buckets,
                |k, id| read_pointer(shared, &db, k, id),
                |k| read_key(shared, &db, k),
            )? {
                Some((key, v)) => decode(&key, &v, self.sealer.as_deref()).map(Some),
                None => Ok(None),
            }
        })
    }

    fn body<'a>(&'a self, record: &'a Record) -> BoxFuture<'a, Result<Option<Bytes>, StoreError>> {
        Box::pin(async move {
            let (cached, gen) = match self.cache.lock() {
                Ok(c) => (
                    c.map.get(&record.id).and_then(|(_, b)| b.clone()),
                    Some(c.generation(&record.id)),
                ),
                Err(_) => (None, None),
            };
            if cached.is_some() {
                return Ok(cached);
            }
            match record.response.as_ref().map(|r| &r.body) {
                Some(BodyRef::Inline) => {
                    // After the record in its own value, or (too large for both to fit, or
                    // kept by a store from before) under its own key.
                    let db = self.db()?;
                    let value = read_key(&self.shared, &db, &record_key(record))?;
                    let body = match value.as_deref().and_then(|v| split_value(v).1) {
                        Some(b) => Some(self.open_body(b)?),
                        None => read_key(&self.shared, &db, &body_key(record))?
                            .map(|v| self.open_body(&v))
                            .transpose()?,
                    };
                    if let (Some(b), Some(gen), Ok(mut c)) = (&body, gen, self.cache.lock()) {
                        c.fill_body(gen, &record.id, b);
                    }
                    Ok(body)
                }
                Some(BodyRef::File { sha256 }) => {
                    let bytes = tokio::fs::read(self.body_path(sha256))
                        .await
                        .map_err(unavailable)?;
                    self.open_body(&bytes).map(Some)
                }
                Some(BodyRef::Absent) | None => Ok(None),
            }
        })
    }

    fn scan(&self, filter: Filter, limit: usize) -> BoxFuture<'_, Result<Vec<Record>, StoreError>> {
        Box::pin(async move {
            let db = self.db()?;
            let sealer = self.sealer.clone();
            // Records, bodies and indexes durable but not yet in sled (not the log's blocks).
            let overlay = Overlay::take(&self.shared, |k| log_seq(k).is_none())?;
            let buckets = self.shared.buckets;
            tokio::task::spawn_blocking(move || {
                scan(&db, &buckets, &overlay, &filter, limit, sealer.as_deref())
            })
            .await
            .map_err(unavailable)?
        })
    }

    fn recover(
        &self,
        owner: Option<String>,
        now: Millis,
    ) -> BoxFuture<'_, Result<usize, StoreError>> {
        Box::pin(self.call(move |tx| Op::Recover(owner, now, tx)))
    }

    fn expire(&self, now: Millis) -> BoxFuture<'_, Result<usize, StoreError>> {
        Box::pin(async move {
            // In steps, each a batch of its own, so that writes go on between them; after each,
            // a pause of [`EXPIRE_PACE`] times what the step took, so that a sweep takes at most
            // a quarter of the writer's time while it runs, instead of all of it in a burst
            // (bench/results-soak.md: an expired action costs the writer about as much as a
            // write, its pages cold in sled's cache); and each step only once the drainer has
            // room for it, so that expiry does not push it behind, where every write waits for
            // it (decision 0052).
            let (mut total, mut from) = (0, None);
            loop {
                let waited = std::time::Instant::now();
                while !self.shared.drainer_has_room() && waited.elapsed() < EXPIRE_ROOM_WAIT {
                    tokio::time::sleep(EXPIRE_ROOM_POLL).await;
                }
                let started = std::time::Instant::now();
                let (n, next) = self.call(move |tx| Op::Expire(now, from, tx)).await?;
                total += n;
                match next {
                    Some(k) => from = Some(k),
                    None => {
                        self.prune_log(now).await?;
                        return Ok(total);
                    }
                }
                let pause = started.elapsed().saturating_mul(EXPIRE_PACE);
                tokio::time::sleep(pause.min(EXPIRE_PAUSE_MAX)).await;
            }
        })
    }

    fn compact_log(&self) -> BoxFuture<'_, Result<usize, StoreError>> {
        Box::pin(self.compress_log())
    }

    fn close(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            self.call(Op::Sync).await?;
            if let Ok(mut g) = self.tx.lock() {
                // Dropping the sender ends the writer thread once its queue is empty.
                g.take();
            }
            let writer = self.writer.lock().ok().and_then(|mut w| w.take());
            if let Some(w) = writer {
                tokio::task::spawn_blocking(move || w.join())
                    .await
                    .map_err(unavailable)?
                    .map_err(|_| unavailable("store writer panicked"))?;
            }
            if let Ok(mut db) = self.db.write() {
                db.take();
            }
            // The writer's thread joined its syncer and drainer, and the close took the last
            // handle on sled: what it logged this run can go into its snapshot now. Only after a
            // clean close: a store that stopped taking changes is left as it is.
            if self.shared.check().is_ok() {
                let dir = self.dir.clone();
                let left = tokio::task::spawn_blocking(move || checkpoint::leave_snapshot(&dir))
                    .await
                    .map_err(unavailable)?;
                if let Err(e) = left {
                    tracing::warn!(error = %e, "store: could not leave sled a snapshot; the next start reads its log instead");
                }
            }
            Ok(())
        })
    }
}
