//! The embedded store: sled 0.34.7 behind one writer thread with group commit.
//!
//! Every change goes through a single writer thread. It takes a batch of operations off its queue,
//! decides each against the current records (plus the changes of batches not yet in sled), stages
//! the records and their write-log entries and appends the batch as one frame to the write-ahead
//! log ([`super::wal`]). A syncer thread makes waiting frames durable with one `fdatasync`, then
//! makes their changes visible to readers ([`Mem`]) and answers; a drainer thread applies the
//! durable changes to sled in bulk. sled's own `flush()` (which ends in `sync_file_range`, not
//! enough for a power loss; SPEC §13) runs only at checkpoints, on a thread of their own, followed
//! by an fsync of sled's files; only then are the log files it covers deleted. So:
//! - a claim is durable before its request leaves, an outcome before its client is answered;
//! - a state change and its log entry are in one atomic batch: neither exists without the other;
//! - claims are atomic without locks (one thread decides), and the log has one chain;
//! - many concurrent writes share one flush, and a claim that finds an existing record never
//!   waits for a flush it does not need;
//! - claims of settled or running records (replays, conflicts) are answered off the writer, from a
//!   cache of their last durable versions.
//!
//! Keys (one tree): `a/{id}` record (JSON), `b/{id}` small stored body, `s/{state}/{id}` state index
//! (all states but `succeeded`),
//! `t/{task}\0{id}` task index, `e/{minute:be64}{id}` expiry index (the sweeper reads only what is
//! due), `c/{created_at:be64}{id}` creation index (lists page newest first), `f/{sha256}/{id}` the
//! actions whose response is a body file. Bodies over 64 KiB live in `bodies/{sha256}` beside the database;
//! sled's own blob files are fsynced at each checkpoint. The write log lives in files of its own
//! ([`super::logfiles`]): in a batch's frame its entries are a change to the key
//! `l/{first seq:be64}` (the NDJSON lines the batch appended), which the drainer appends to the
//! log files instead of sled. Stores from before kept those keys (and `m/log_anchor`) in sled;
//! opening one moves them to the files.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use bytes::Bytes;
use sha2::{Digest, Sha256};
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
    apply_resolve, apply_settle, decide_claim, now_millis, recover_in_flight, BodyRef, Claim,
    ClaimRequest, Millis, Record, Resolve, State,
};
use crate::log::{self, Actor, Chain, Entry, Event, LogEvent, Verification, GENESIS};

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
/// sled's page cache (its default is 1 GiB): the proxy's memory is mostly this.
const SLED_CACHE: u64 = 16 << 20;
const ANCHOR_KEY: &[u8] = b"m/log_anchor";
/// Audit-only log entries and lease renewals are made durable within this.
const LAZY_FLUSH: std::time::Duration = std::time::Duration::from_millis(100);
/// Audit-only log entries (notes: `replayed`, `conflict`, …) wait at most this long, or until
/// this many are buffered, for a batch to join: fewer, larger log blocks.
const NOTES_WAIT: std::time::Duration = std::time::Duration::from_millis(20);
const NOTES_BATCH: usize = 256;

type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

enum Op {
    Claim(Box<ClaimRequest>, Reply<Claim>),
    Settle(Box<SettleRequest>, Reply<Record>),
    Resolve(String, Box<Resolve>, Event, Reply<Record>),
    /// Notes are waiting in the shared buffer.
    Notes,
    Recover(Option<String>, Millis, Reply<usize>),
    /// Expires what is due from the expiry index, at most [`EXPIRE_STEP`] entries after the
    /// cursor (`None`: the start); answers the count and where the next step starts.
    Expire(Millis, Option<Vec<u8>>, Reply<(usize, Option<Vec<u8>>)>),
    Sync(Reply<()>),
    /// Everything applied to sled (before a scan).
    Drain(Reply<()>),
    Renew(String, String, Millis, Reply<bool>),
}

impl Op {
    /// Whether its batch needs an fdatasync before answering: everything but notes and lease
    /// renewals, which become durable within [`LAZY_FLUSH`].
    fn needs_flush(&self) -> bool {
        !matches!(self, Op::Notes | Op::Renew(..))
    }
}

/// An answer decided in a batch, sent once the batch is durable.
enum Answer {
    Claim(Reply<Claim>, Box<Claim>),
    /// The record as the batch holds it, copied for the caller only once it is durable.
    Record(Reply<Record>, Arc<Record>),
    Count(Reply<usize>, usize),
    Step(Reply<(usize, Option<Vec<u8>>)>, usize, Option<Vec<u8>>),
    Unit(Reply<()>),
    Bool(Reply<bool>, bool),
    /// The operation failed on its own; the closure sends its error.
    Failed(Box<dyn FnOnce() + Send>),
    None,
}

impl Answer {
    fn failed<T: Send + 'static>(tx: Reply<T>, e: StoreError) -> Answer {
        Answer::Failed(Box::new(move || drop(tx.send(Err(e)))))
    }

    fn send(self, commit: &Result<(), String>) {
        // A batch that could not be made durable broke the store (`Shared::fail`) until restart.
        let err = |e: &String| StoreError::Broken(e.clone());
        match (self, commit) {
            (Answer::Failed(f), _) => f(),
            (Answer::None, _) => {}
            (Answer::Claim(tx, c), Ok(())) => drop(tx.send(Ok(*c))),
            (Answer::Record(tx, r), Ok(())) => drop(tx.send(Ok(Arc::unwrap_or_clone(r)))),
            (Answer::Count(tx, n), Ok(())) => drop(tx.send(Ok(n))),
            (Answer::Step(tx, n, next), Ok(())) => drop(tx.send(Ok((n, next)))),
            (Answer::Unit(tx), Ok(())) => drop(tx.send(Ok(()))),
            (Answer::Bool(tx, b), Ok(())) => drop(tx.send(Ok(b))),
            (Answer::Bool(tx, _), Err(e)) => drop(tx.send(Err(err(e)))),
            (Answer::Claim(tx, _), Err(e)) => drop(tx.send(Err(err(e)))),
            (Answer::Record(tx, _), Err(e)) => drop(tx.send(Err(err(e)))),
            (Answer::Count(tx, _), Err(e)) => drop(tx.send(Err(err(e)))),
            (Answer::Step(tx, ..), Err(e)) => drop(tx.send(Err(err(e)))),
            (Answer::Unit(tx), Err(e)) => drop(tx.send(Err(err(e)))),
        }
    }
}

pub struct SledStore {
    /// `None` once closed: closing releases sled's file lock, so the folder can be reopened.
    db: RwLock<Option<sled::Db>>,
    dir: PathBuf,
    chain: Chain,
    tx: Mutex<Option<mpsc::Sender<Op>>>,
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
}

/// Where the store keeps its key check: a value only its key opens (`store::seal`).
const KEY_CHECK: &[u8] = b"m/key_check";

/// A store that was written with a key opens only with that key; a store without one takes a
/// key from now on (what it holds already stays readable).
fn check_key(db: &sled::Db, sealer: Option<&Sealer>) -> Result<(), String> {
    let stored = db
        .get(KEY_CHECK)
        .map_err(|e| format!("read the key check: {e}"))?;
    match (stored, sealer) {
        (None, None) => Ok(()),
        (Some(_), None) => Err(
            "the store is encrypted, but no key is configured: set store.encrypt_key_env and the variable it names to the store's key".into(),
        ),
        (Some(v), Some(s)) if s.matches(&v) => Ok(()),
        (Some(_), Some(_)) => Err(
            "the key in store.encrypt_key_env is not the key this store was encrypted with".into(),
        ),
        (None, Some(s)) => {
            db.insert(KEY_CHECK, s.check_value())
                .map_err(|e| format!("write the key check: {e}"))?;
            db.flush().map_err(|e| format!("flush the key check: {e}"))?;
            Ok(())
        }
    }
}

/// Recent records (`succeeded`, `unknown`, in flight) as last made durable, for replays and
/// conflicts that need no sled read. Bounded; the oldest entries go first.
///
/// The syncer puts every durable change in. The writer and body readers fill it from what they
/// read in sled (read-through), guarded by a generation per shard of ids: a reader notes its shard's
/// generation before reading, and its fill is dropped if any change to that shard was made
/// durable meanwhile, so an older read never replaces a newer outcome. The syncer makes a change
/// readable (in [`Mem`]) before it bumps the generation, which is what makes the guard hold.
#[derive(Default)]
struct Cache {
    map: HashMap<String, (Arc<Record>, Option<Bytes>)>,
    order: std::collections::VecDeque<String>,
    gens: Gens,
}

const CACHE_ENTRIES: usize = 2_048;
const CACHE_SHARDS: usize = 64;

struct Gens([u64; CACHE_SHARDS]);

impl Default for Gens {
    fn default() -> Gens {
        Gens([0; CACHE_SHARDS])
    }
}

fn shard(id: &str) -> usize {
    // Action ids are hex digests: their last bytes are as good as a hash.
    id.bytes()
        .rev()
        .take(4)
        .fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize))
        % CACHE_SHARDS
}

impl Cache {
    /// Takes the durable outcome of a batch: settled records in, anything else out.
    fn update(&mut self, id: String, r: Option<Arc<Record>>, body: Option<&Bytes>) {
        self.gens.0[shard(&id)] += 1;
        match r {
            Some(r) if cacheable(&r) => {
                let keep = body
                    .filter(|b| b.len() <= CACHED_BODY_MAX)
                    .cloned()
                    .or_else(|| self.map.get(&id).and_then(|(_, b)| b.clone()));
                self.put(id, r, keep);
            }
            _ => {
                self.map.remove(&id);
            }
        }
    }

    /// The generation a reader notes before reading `id` outside the cache.
    fn generation(&self, id: &str) -> u64 {
        self.gens.0[shard(id)]
    }

    /// A reader's fill: `r` as read after [`Cache::generation`] returned `gen`.
    fn fill(&mut self, gen: u64, r: &Arc<Record>) {
        if self.generation(&r.id) == gen && cacheable(r) && !self.map.contains_key(&r.id) {
            self.put(r.id.clone(), Arc::clone(r), None);
        }
    }

    /// A reader's fill of a cached record's stored body.
    fn fill_body(&mut self, gen: u64, id: &str, body: &Bytes) {
        if self.generation(id) == gen && body.len() <= CACHED_BODY_MAX {
            if let Some((_, b)) = self.map.get_mut(id) {
                b.get_or_insert_with(|| body.clone());
            }
        }
    }

    fn put(&mut self, id: String, r: Arc<Record>, body: Option<Bytes>) {
        if self.map.insert(id.clone(), (r, body)).is_none() {
            self.order.push_back(id);
        }
        while self.map.len() > CACHE_ENTRIES {
            match self.order.pop_front() {
                Some(old) => {
                    self.map.remove(&old);
                }
                None => break,
            }
        }
    }
}

const CACHED_BODY_MAX: usize = 16 * 1024;

/// Records the claim fast path can answer from: everything but `failed` (which a claim may
/// attempt again, on the writer).
fn cacheable(r: &Record) -> bool {
    matches!(r.state, State::Succeeded | State::Unknown | State::InFlight)
}

/// sled as the store configures it at `dir` (public for the benches' `sled alone` floor).
pub fn sled_config(dir: &Path) -> sled::Config {
    sled::Config::new()
        .path(dir)
        .segment_size(SEGMENT_SIZE)
        .cache_capacity(SLED_CACHE)
        .flush_every_ms(None)
}

/// How long an open waits for sled's file lock before it reports the folder as in use.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Opens sled in `dir`. sled 0.34 lets go of its file lock only when the last of its IO threads
/// drops its handle, which can be a moment after the store was closed: an open right after a
/// close in the same process (a test, an embedder) waits for it, up to [`LOCK_WAIT`]. A folder
/// another process holds still fails, after that wait.
fn open_sled(dir: &Path) -> sled::Result<sled::Db> {
    let start = std::time::Instant::now();
    loop {
        match sled_config(dir).open() {
            // sled 0.34.7 (pinned) reports it as this text, with kind `Other`.
            Err(sled::Error::Io(e))
                if e.to_string().starts_with("could not acquire lock")
                    && start.elapsed() < LOCK_WAIT =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            r => return r,
        }
    }
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

fn rec_key(id: &str) -> Vec<u8> {
    format!("a/{id}").into_bytes()
}
fn body_key(id: &str) -> Vec<u8> {
    format!("b/{id}").into_bytes()
}
/// Whether the state index lists actions in `state`: every state but `succeeded`, the bulk of a
/// store, whose count is the rest of the creation index and which no scan looks up by state.
fn state_indexed(state: State) -> bool {
    state != State::Succeeded
}

fn state_key(state: State, id: &str) -> Vec<u8> {
    format!("s/{}/{id}", state.as_str()).into_bytes()
}
fn task_key(task: &str, id: &str) -> Vec<u8> {
    format!("t/{task}\0{id}").into_bytes()
}

/// The expiry index groups settled actions by the minute they expire in (an action in flight or
/// unknown has no entry: it never expires).
const EXPIRY_BUCKET: Millis = 60_000;
/// The expiry index's prefix; an entry is `e/{bucket:be64}{id}`.
const EXPIRY_PREFIX: &[u8] = b"e/";
/// Expiry index entries one step reads at most: the writer's pause between batches.
const EXPIRE_STEP: usize = 2_048;

fn expiry_key(expires_at: Millis, id: &str) -> Vec<u8> {
    let mut k = EXPIRY_PREFIX.to_vec();
    k.extend_from_slice(&(expires_at / EXPIRY_BUCKET).to_be_bytes());
    k.extend_from_slice(id.as_bytes());
    k
}

/// The action id of an expiry or creation index key (`{prefix}{be64}{id}`).
fn index_id(key: &[u8], prefix: &[u8]) -> Result<String, StoreError> {
    match key.get(prefix.len() + 8..) {
        Some(id) if !id.is_empty() => Ok(String::from_utf8_lossy(id).into_owned()),
        _ => Err(StoreError::Corrupt {
            id: String::from_utf8_lossy(key).into_owned(),
            reason: "an index key too short to name an action".into(),
        }),
    }
}

/// The expiry index's keys up to and including the bucket of `now`.
fn expiry_end(now: Millis) -> Vec<u8> {
    let mut k = EXPIRY_PREFIX.to_vec();
    k.extend_from_slice(&(now / EXPIRY_BUCKET + 1).to_be_bytes());
    k
}

/// The creation index: `c/{created_at:be64}{id}`, for listing newest first in pages.
const CREATED_PREFIX: &[u8] = b"c/";
/// The first key after every creation index key.
const CREATED_END: &[u8] = b"c0";

fn created_key(created_at: Millis, id: &str) -> Vec<u8> {
    let mut k = CREATED_PREFIX.to_vec();
    k.extend_from_slice(&created_at.to_be_bytes());
    k.extend_from_slice(id.as_bytes());
    k
}

/// `f/{sha256}/{id}`: the actions whose stored response is the body file `bodies/{sha256}`.
fn file_key(sha: &str, id: &str) -> Vec<u8> {
    format!("f/{sha}/{id}").into_bytes()
}

/// The body file a record's response is kept in, if any.
fn body_file(r: &Record) -> Option<&str> {
    match r.response.as_ref().map(|s| &s.body) {
        Some(BodyRef::File { sha256 }) => Some(sha256),
        _ => None,
    }
}

/// A record's index entries: every key besides its record and body that names it.
fn index_keys(r: &Record) -> impl Iterator<Item = Vec<u8>> + '_ {
    [
        state_indexed(r.state).then(|| state_key(r.state, &r.id)),
        r.task.as_ref().map(|t| task_key(t, &r.id)),
        r.expires_at.map(|e| expiry_key(e, &r.id)),
        Some(created_key(r.created_at, &r.id)),
        body_file(r).map(|sha| file_key(sha, &r.id)),
    ]
    .into_iter()
    .flatten()
}

/// Every key the store writes for `r` with a small stored body: the record, the body and the
/// index entries (public for the benches' `sled alone` floor, which writes the same keys).
pub fn action_keys(r: &Record) -> Vec<Vec<u8>> {
    let mut keys = vec![rec_key(&r.id), body_key(&r.id)];
    keys.extend(index_keys(r));
    keys
}

/// The indexes a store opened by an earlier version may lack are built once; this key records it.
const INDEXES_KEY: &[u8] = b"m/indexes";
const INDEXES_VERSION: &[u8] = b"4";

/// Builds the expiry, creation and body-file indexes of a store from before them, from its
/// records (writing every index entry again is harmless).
fn migrate_indexes(db: &sled::Db) -> Result<(), String> {
    if db.get(INDEXES_KEY).map_err(|e| e.to_string())?.as_deref() == Some(INDEXES_VERSION) {
        return Ok(());
    }
    // Plain inserts, not a sled batch: one batch would put every later read in this process
    // behind sled's global lock. The marker goes last, so an interrupted build starts again.
    let mut n = 0;
    for kv in db.scan_prefix(b"a/") {
        let (k, v) = kv.map_err(|e| e.to_string())?;
        let r = decode(&k, &v, None).map_err(|e| e.to_string())?;
        for key in index_keys(&r) {
            db.insert(key, &[]).map_err(|e| e.to_string())?;
        }
        n += 1;
    }
    // The state index no longer lists `succeeded` actions.
    let prefix = format!("s/{}/", State::Succeeded.as_str());
    for k in db.scan_prefix(prefix.as_bytes()).keys() {
        db.remove(k.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    db.insert(INDEXES_KEY, INDEXES_VERSION)
        .map_err(|e| e.to_string())?;
    if n > 0 {
        tracing::info!(actions = n, "store: built the expiry index");
    }
    Ok(())
}

fn log_key(seq: u64) -> Vec<u8> {
    let mut k = b"l/".to_vec();
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

/// Encodes a record within [`RECORD_MAX`]. A record over it sheds evidence until it fits: the
/// tries' bodies, oldest first, except the last try's; then the request's headers, last first;
/// then whole tries, oldest first (each attempt keeps its last); then the last try's body. Each
/// dropped piece is marked in the record.
/// Returns the record as stored and its encoding.
fn encode_bounded(mut r: Record, sealer: Option<&Sealer>) -> (Record, Vec<u8>) {
    // With a sealer the bound applies to the sealed form, which is what sled holds.
    let encode = |r: &Record| match sealer {
        None => serde_json::to_vec(r).expect("records always serialize"),
        Some(s) => {
            let mut sealed = r.clone();
            s.seal_record(&mut sealed);
            serde_json::to_vec(&sealed).expect("records always serialize")
        }
    };
    let mut v = encode(&r);
    if v.len() <= RECORD_MAX {
        return (r, v);
    }
    let size = v.len();
    let tries: Vec<(usize, usize)> = r
        .evidence
        .iter()
        .enumerate()
        .flat_map(|(a, at)| (0..at.tries.len()).map(move |t| (a, t)))
        .collect();
    let last = tries.last().copied();
    fn drop_body(t: &mut crate::action::Try) -> usize {
        t.body.take().map_or(0, |b| {
            t.body_dropped = true;
            b.len()
        })
    }
    // Each step sheds about `excess` bytes (counted from the pieces' raw sizes) and says whether
    // it shed anything; it runs again until the encoding fits or it has nothing left.
    type Step<'a> = &'a dyn Fn(&mut Record, usize) -> bool;
    let steps: [Step; 4] = [
        &|r, mut excess| {
            let mut shed = false;
            for &(a, t) in tries.iter().filter(|&&at| Some(at) != last) {
                if excess == 0 {
                    break;
                }
                let n = drop_body(&mut r.evidence[a].tries[t]);
                excess = excess.saturating_sub(n);
                shed |= n > 0;
            }
            shed
        },
        &|r, mut excess| {
            let mut shed = false;
            while excess > 0 {
                let Some((k, val)) = r.request.headers.pop() else {
                    break;
                };
                excess = excess.saturating_sub(k.len() + val.len());
                r.request.headers_dropped += 1;
                shed = true;
            }
            shed
        },
        &|r, mut excess| {
            let mut shed = false;
            for a in r.evidence.iter_mut() {
                while excess > 0 && a.tries.len() > 1 {
                    let t = a.tries.remove(0);
                    excess = excess.saturating_sub(serde_json::to_vec(&t).map_or(0, |v| v.len()));
                    a.tries_dropped += 1;
                    shed = true;
                }
            }
            shed
        },
        // Whole tries may have gone: the last try is still its attempt's last.
        &|r, _| {
            r.evidence
                .iter_mut()
                .rev()
                .find_map(|a| a.tries.last_mut())
                .is_some_and(|t| drop_body(t) > 0)
        },
    ];
    for step in steps {
        while step(&mut r, v.len() - RECORD_MAX) {
            v = encode(&r);
            if v.len() <= RECORD_MAX {
                tracing::debug!(id = %r.id, size, "record shed evidence to fit the store's bound");
                return (r, v);
            }
        }
    }
    // Only a very long path and response head with very many attempts get here.
    tracing::warn!(
        id = %r.id,
        size = v.len(),
        "record exceeds the store's bound even without its tries' evidence"
    );
    (r, v)
}

/// Parses a stored record and, with a sealer, opens its secrets. Without one a sealed record
/// keeps them sealed (index maintenance needs none of them).
fn decode(key: &[u8], v: &[u8], sealer: Option<&Sealer>) -> Result<Record, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        id: String::from_utf8_lossy(key).into_owned(),
        reason,
    };
    let mut r: Record = serde_json::from_slice(v).map_err(|e| corrupt(e.to_string()))?;
    if let Some(s) = sealer {
        s.open_record(&mut r).map_err(corrupt)?;
    }
    Ok(r)
}

/// The first sequence number of a log block, from its key.
fn log_seq(key: &[u8]) -> Option<u64> {
    key.strip_prefix(b"l/")
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_be_bytes)
}

/// The write log's head: its last entry, or where a pruned log starts, or the genesis.
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

/// Moves the write log of a store from before [`super::logfiles`] out of sled: its blocks are
/// appended to the log files (and its anchor carried over), made durable there, then removed
/// from sled.
fn migrate_log(db: &sled::Db, files: &mut LogFiles) -> Result<(), String> {
    let mut keys = Vec::new();
    for kv in db.scan_prefix(b"l/") {
        let (k, v) = kv.map_err(|e| e.to_string())?;
        let first = log_seq(&k).ok_or("a write log key in sled is malformed")?;
        if keys.is_empty() && first > 1 && files.last().is_none() {
            if let Some(a) = db.get(ANCHOR_KEY).map_err(|e| e.to_string())? {
                let (seq, prev): (u64, String) =
                    serde_json::from_slice(&a).map_err(|e| format!("write log anchor: {e}"))?;
                files.set_anchor(seq, &prev)?;
            }
        }
        files.append(first, &v)?;
        keys.push(k);
    }
    if keys.is_empty() {
        return Ok(());
    }
    files.sync()?;
    for k in &keys {
        db.remove(k).map_err(|e| e.to_string())?;
    }
    db.remove(ANCHOR_KEY).map_err(|e| e.to_string())?;
    tracing::info!(
        blocks = keys.len(),
        "store: moved the write log out of sled"
    );
    Ok(())
}

impl SledStore {
    /// Opens (or creates) the store at `dir`. Errors name the path and what to do.
    pub fn open(dir: &Path, options: StoreOptions) -> Result<SledStore, StoreError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            StoreError::Unavailable(format!(
                "cannot open the store at {}: {what}: {e}. If another oncegate uses this folder, \
                 stop it or give this one its own store.path. If the disk is full or read-only, \
                 fix that and start again. If the store is corrupt, stop every proxy using it, \
                 move the folder aside (keep it for its write log), and start with an empty \
                 folder: actions that were unknown must then be settled at the upstream by hand.",
                dir.display()
            ))
        };
        let existed = dir.exists();
        files::create_private_dir_all(&dir.join("bodies"))
            .map_err(|e| fail("create folder", &e))?;
        if !existed {
            // The new folder's entry must survive a power loss too.
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                fsync_dir(parent).map_err(|e| fail("fsync parent folder", &e))?;
            }
            fsync_dir(dir).map_err(|e| fail("fsync folder", &e))?;
        }
        remove_unfinished_snapshots(dir)
            .map_err(|e| fail("remove unfinished sled snapshots", &e))?;
        let db = open_sled(dir).map_err(|e| fail("sled", &e))?;
        // Response bodies and headers are in there: the owner's alone (SPEC §13). What we create
        // is created so; narrowing what exists (sled's files, an older store's) is best effort:
        // a folder on a volume this user does not own must not keep the proxy from starting.
        if let Err(e) = files::restrict(dir) {
            tracing::warn!(
                path = %dir.display(),
                error = %e,
                "could not narrow the store's file modes to 0600/0700; check the folder's owner"
            );
        }
        let db_was_empty = db
            .first()
            .map_err(|e| fail("read the database", &e))?
            .is_none();
        let log = File::open(dir.join("db")).map_err(|e| fail("open sled log file", &e))?;
        // Batches acknowledged since sled's last checkpoint are in the write-ahead log: replayed
        // into sled, made durable there, and the log starts afresh.
        let segment_bytes = options
            .log_segment_bytes
            .unwrap_or(super::logfiles::SEGMENT_BYTES);
        let logfiles = Mutex::new(
            LogFiles::open(&dir.join("log"), segment_bytes)
                .map_err(|e| fail("open the write log", &e))?,
        );
        let (wal, replayed) = Wal::open(&dir.join("wal"), |changes| {
            apply_changes(&db, &logfiles, changes.iter().map(Change::as_pair))
        })
        .map_err(|e| fail("replay the write-ahead log", &e))?;
        let mut logfiles = logfiles
            .into_inner()
            .map_err(|_| fail("replay the write-ahead log", &"lock poisoned"))?;
        migrate_log(&db, &mut logfiles).map_err(|e| fail("move the write log", &e))?;
        let (log_seq, log_hash) = log_head(&logfiles).map_err(|e| fail("read write log", &e))?;
        let seen = history::Seen {
            db_was_empty,
            replayed,
            log_seq,
            log_hash,
        };
        history::check(dir, &db, &seen).map_err(StoreError::Unavailable)?;
        check_key(&db, options.sealer.as_deref()).map_err(|e| {
            StoreError::Unavailable(format!("cannot open the store at {}: {e}", dir.display()))
        })?;
        migrate_indexes(&db).map_err(|e| fail("build the expiry index", &e))?;
        let mut blobs = HashSet::new();
        sled_durable(&db, dir, &mut blobs, &log)
            .and_then(|()| logfiles.sync())
            .and_then(|()| wal.remove_older())
            .map_err(|e| fail("checkpoint", &e))?;
        if replayed > 0 {
            tracing::info!(frames = replayed, "store: replayed the write-ahead log");
        }
        let head = log_head(&logfiles).map_err(|e| fail("read write log", &e))?;
        let (tx, rx) = mpsc::channel();
        let flushes = Arc::new(AtomicU64::new(0));
        let notes = Arc::new(Mutex::new(Vec::new()));
        let cache = Arc::new(Mutex::new(Cache::default()));
        let placing = Arc::new(Mutex::new(HashMap::new()));
        let shared = Arc::new(Shared::new(logfiles, count_states(&db)));
        let reader_view = shared.clone();
        let syncer = Syncer {
            db: db.clone(),
            shared: shared.clone(),
            cache: cache.clone(),
            flushes: flushes.clone(),
            flush_latency: options.flush_latency.clone(),
        };
        let (sealed_tx, sealed_rx) = mpsc::channel();
        let syncer = std::thread::Builder::new()
            .name("oncegate-sync".into())
            .spawn(move || syncer.run(sealed_rx))
            .map_err(|e| fail("start syncer thread", &e))?;
        let (checkpoint_tx, checkpoint_rx) = mpsc::channel();
        let checkpointer = {
            let (db, dir, shared) = (db.clone(), dir.to_owned(), shared.clone());
            std::thread::Builder::new()
                .name("oncegate-checkpoint".into())
                .spawn(move || {
                    if let Err(e) = checkpoint_loop(&db, &dir, &shared, checkpoint_rx) {
                        shared.fail(&format!("checkpoint: {e}"));
                    }
                })
                .map_err(|e| fail("start checkpoint thread", &e))?
        };
        let writer = Writer {
            sealer: options.sealer.clone(),
            placing: placing.clone(),
            cache: cache.clone(),
            dir: dir.to_owned(),
            blobs,
            notes: notes.clone(),
            db: db.clone(),
            log,
            wal,
            frame: Vec::new(),
            shared,
            seq: 0,
            unapplied: HashMap::new(),
            sync: sealed_tx,
            checkpointer: Some((checkpoint_tx, checkpointer)),
            checkpoint_bytes: options
                .wal_checkpoint_bytes
                .unwrap_or(wal::CHECKPOINT_BYTES),
            chain: options.chain.clone(),
            head,
            log_retention: options.log_retention,
            notes_due: None,
        };
        let handle = std::thread::Builder::new()
            .name("oncegate-store".into())
            .spawn(move || {
                // The writer drops its sender when it ends: the syncer ends once its queue is
                // empty.
                writer.run(rx);
                let _ = syncer.join();
            })
            .map_err(|e| fail("start writer thread", &e))?;
        Ok(SledStore {
            db: RwLock::new(Some(db)),
            dir: dir.to_owned(),
            chain: options.chain,
            tx: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(handle)),
            shared: reader_view,
            flushes,
            notes,
            cache,
            placing,
            sealer: options.sealer,
        })
    }

    /// How many times the store has made batches durable (one fdatasync of the write-ahead log each).
    pub fn flush_count(&self) -> u64 {
        self.flushes.load(Ordering::Relaxed)
    }

    /// The fast path of a claim: a record that exists, is durable, and cannot be claimed
    /// (`succeeded`, `unknown`, in flight under a live lease, or a reused key) is answered from
    /// the cache of durable records, off the writer thread, so that replays and conflicts scale
    /// with cores. Anything else goes to the writer.
    fn settled(&self, req: &ClaimRequest) -> Option<Claim> {
        // From the cache only. A miss goes to the writer, which reads the record anyway (and
        // fills the cache from what it reads in sled): most misses are new keys, and a read of
        // sled here found nothing for them at the cost of a tree walk.
        // The shared record under the lock; a copy only for an answer, outside it.
        let r = Arc::clone(&self.cache.lock().ok()?.map.get(&req.fresh.id)?.0);
        if r.is_expired(req.now) {
            return None;
        }
        // What the cache holds is durable: the syncer puts a change in only after its
        // write-ahead log frame is (lease renewals aside, which only ever extend a lease).
        if req.reuses_key(&r) {
            return Some(Claim::KeyReused(Record::clone(&r)));
        }
        match r.state {
            State::Succeeded | State::Unknown => Some(Claim::Existing(Record::clone(&r))),
            State::InFlight if r.lease_until.is_some_and(|l| l >= req.now) => {
                Some(Claim::Existing(Record::clone(&r)))
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

    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Op) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx))?;
        rx.await.map_err(|_| unavailable("store writer stopped"))?
    }

    /// A stored body as the client gets it: opened when sealed.
    fn open_body(&self, stored: &[u8]) -> Result<Bytes, StoreError> {
        match &self.sealer {
            None => Ok(Bytes::copy_from_slice(stored)),
            Some(s) => s
                .open(stored)
                .map(Bytes::from)
                .map_err(|reason| StoreError::Corrupt {
                    id: "a stored body".into(),
                    reason,
                }),
        }
    }

    fn body_path(&self, sha: &str) -> PathBuf {
        self.dir.join("bodies").join(sha)
    }

    /// Writes a large body as a content-addressed file: write, fsync, rename, fsync the folder.
    /// Named by the plain body's SHA-256; with a sealer the file holds the sealed body.
    fn write_body_file(
        dir: PathBuf,
        body: Bytes,
        sealer: Option<Arc<Sealer>>,
    ) -> std::io::Result<String> {
        let sha = hex::encode(Sha256::digest(&body));
        let body = seal_opt(sealer.as_deref(), &body);
        let bodies = dir.join("bodies");
        let path = bodies.join(&sha);
        if path.exists() {
            return Ok(sha);
        }
        let tmp = bodies.join(format!(".{sha}.{}.tmp", std::process::id()));
        let mut f = files::create_private(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        fsync_dir(&bodies)?;
        Ok(sha)
    }

    /// Places a body to keep: inline for small ones, a durable file for large ones.
    async fn place_body(
        &self,
        body: &mut Option<Bytes>,
        r: &mut BodyRef,
    ) -> Result<(), StoreError> {
        let Some(b) = body.as_ref() else {
            return Ok(());
        };
        if b.len() > INLINE_BODY_MAX {
            // Announced before the file is written and until its record is committed, so that
            // the sweeper never removes a body file a settlement is about to point at.
            let sha = hex::encode(Sha256::digest(b));
            self.placing(&sha, 1);
            let (dir, bytes, sealer) = (self.dir.clone(), b.clone(), self.sealer.clone());
            let written =
                tokio::task::spawn_blocking(move || Self::write_body_file(dir, bytes, sealer))
                    .await
                    .map_err(unavailable)
                    .and_then(|r| r.map_err(unavailable));
            if let Err(e) = written {
                self.placing(&sha, -1);
                return Err(e);
            }
            *r = BodyRef::File { sha256: sha };
            *body = None;
        } else {
            *r = BodyRef::Inline;
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

    fn settle(&self, mut req: SettleRequest) -> BoxFuture<'_, Result<Record, StoreError>> {
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
            self.call(Op::Drain).await?;
            let start = after.saturating_add(1);
            let reader = self.shared.logfiles()?.reader(start).map_err(unavailable)?;
            tokio::task::spawn_blocking(move || {
                let mut out = Vec::new();
                for e in reader.entries() {
                    let e = e.map_err(|seq| StoreError::Corrupt {
                        id: format!("write log entry {seq}"),
                        reason: "does not parse".into(),
                    })?;
                    if e.seq >= start {
                        out.push(e);
                    }
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
            self.call(Op::Drain).await?;
            let reader = self.shared.logfiles()?.reader(0).map_err(unavailable)?;
            let chain = self.chain.clone();
            tokio::task::spawn_blocking(move || {
                let anchor = reader.anchor.clone();
                // Entries of a store from before the log files, pruned there but kept in a frame
                // replayed since, come before the anchor.
                let from = anchor.as_ref().map_or(0, |(seq, _)| *seq);
                let entries = reader
                    .entries()
                    .filter(move |e| !matches!(e, Ok(e) if e.seq < from));
                Ok(log::verify(&chain, entries, anchor))
            })
            .await
            .map_err(unavailable)?
        })
    }

    fn log_head(&self) -> BoxFuture<'_, Result<(u64, String), StoreError>> {
        Box::pin(async move {
            self.call(Op::Drain).await?;
            log_head(&*self.shared.logfiles()?)
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
            let key = rec_key(id);
            match read_key(&self.shared, &self.db()?, &key)? {
                Some(v) => decode(&key, &v, self.sealer.as_deref()).map(Some),
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
                    let body = read_key(&self.shared, &self.db()?, &body_key(&record.id))?
                        .map(|v| self.open_body(&v))
                        .transpose()?;
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
            self.call(Op::Drain).await?;
            let db = self.db()?;
            let sealer = self.sealer.clone();
            tokio::task::spawn_blocking(move || scan(&db, &filter, limit, sealer.as_deref()))
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
            // In steps, each a batch of its own, so that writes go on between them.
            let (mut total, mut from) = (0, None);
            loop {
                let (n, next) = self.call(move |tx| Op::Expire(now, from, tx)).await?;
                total += n;
                match next {
                    Some(k) => from = Some(k),
                    None => return Ok(total),
                }
            }
        })
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
            Ok(())
        })
    }
}

fn scan(
    db: &sled::Db,
    filter: &Filter,
    limit: usize,
    sealer: Option<&Sealer>,
) -> Result<Vec<Record>, StoreError> {
    let mut out = Vec::new();
    if filter.newest_first {
        // Streamed from the creation index, newest first, until the page is full: a page costs
        // what it shows (plus what the filter skips), not the whole store.
        let end = match &filter.before {
            Some((at, id)) => created_key(*at, id),
            None => CREATED_END.to_vec(),
        };
        for k in db.range(CREATED_PREFIX.to_vec()..end).keys().rev() {
            if out.len() >= limit {
                break;
            }
            let k = k.map_err(unavailable)?;
            let id = index_id(&k, CREATED_PREFIX)?;
            let key = rec_key(&id);
            let Some(v) = db.get(&key).map_err(unavailable)? else {
                continue;
            };
            let r = decode(&key, &v, sealer)?;
            if filter.matches(&r) {
                out.push(r);
            }
        }
        return Ok(out);
    }
    let (prefix, skip) = match (&filter.task, filter.state) {
        (Some(task), _) => (format!("t/{task}\0"), None),
        (None, Some(state)) if state_indexed(state) => (format!("s/{}/", state.as_str()), None),
        (None, _) => ("a/".to_string(), Some(())),
    };
    for kv in db.scan_prefix(prefix.as_bytes()) {
        let (k, v) = kv.map_err(unavailable)?;
        let id = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
        let r = if skip.is_some() {
            decode(&k, &v, sealer)?
        } else {
            let key = rec_key(&id);
            match db.get(&key).map_err(unavailable)? {
                Some(v) => decode(&key, &v, sealer)?,
                None => continue,
            }
        };
        if filter.matches(&r) {
            out.push(r);
        }
    }
    out.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
    out.truncate(limit);
    Ok(out)
}

/// Deletes sled snapshot files a crash left half written (`snap.*.generating`).
///
/// sled 0.34 writes a snapshot as `snap.{lsn}.generating` and renames it when complete, but when
/// it opens it reads the newest `snap.*` file *including* an unfinished one, finds it corrupt,
/// falls back to reading its log from the start, and fails with "Read corrupted data" (sled
/// issues #1527, #1533). A SIGKILL while sled opens (it writes a snapshot then) was enough, in
/// the torture harness. An unfinished snapshot is never needed: the previous complete one is
/// only deleted after the rename.
fn remove_unfinished_snapshots(dir: &Path) -> std::io::Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    let mut removed = false;
    for e in entries {
        let e = e?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("snap.") && name.ends_with(".generating") {
            tracing::warn!(file = %name, "store: removing an unfinished sled snapshot");
            std::fs::remove_file(e.path())?;
            removed = true;
        }
    }
    if removed {
        fsync_dir(dir)?;
    }
    Ok(())
}

/// Applies durable changes one by one: log blocks (in order) to the log files, the rest to sled.
/// (Removing a log block is what a store from before the log files did to prune; the anchor says
/// where the log starts, so it is nothing to do here.)
///
/// Not as a `sled::Batch`: the write-ahead log already makes the batch atomic (a crash replays it
/// whole), and sled 0.34 pays for batch atomicity twice: it seals and writes its I/O buffer after
/// every batch (a `pwrite` on one of its threads), and once a batch has been used it puts every
/// read behind one global lock. Readers may see a batch half applied for a moment; each key they
/// read is a durable value.
///
/// The log files are locked per block, not across the sled inserts: readers of the log and the
/// checkpoint's fsync of the files do not wait for a drain.
fn apply_changes<'a>(
    db: &sled::Db,
    files: &Mutex<LogFiles>,
    changes: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
) -> Result<(), String> {
    for (k, v) in changes {
        match (log_seq(k), v) {
            (Some(first), Some(block)) => files
                .lock()
                .map_err(|_| "store lock poisoned".to_string())?
                .append(first, block)?,
            (Some(_), None) => {}
            (None, Some(v)) => drop(db.insert(k, v).map_err(|e| format!("sled insert: {e}"))?),
            (None, None) => drop(db.remove(k).map_err(|e| format!("sled remove: {e}"))?),
        }
    }
    Ok(())
}

/// sled's flush, then what its flush leaves out: its blob files and an fdatasync of its log file
/// (sled's flush ends in `sync_file_range`, which does not survive a power loss; SPEC §13).
///
/// sled writes a value too large for its log into a separate blob file, and its flush does not
/// fsync those. Every blob file not seen before is fsynced (with the folder) before the log's
/// fdatasync, so the log never points at a blob a power loss could take. Normally there are
/// none: this is one `readdir`.
fn sled_durable(
    db: &sled::Db,
    dir: &Path,
    seen: &mut HashSet<std::ffi::OsString>,
    log: &File,
) -> Result<(), String> {
    db.flush().map_err(|e| format!("sled flush: {e}"))?;
    let blobs = dir.join("blobs");
    if let Ok(entries) = std::fs::read_dir(&blobs) {
        let mut present = HashSet::new();
        let mut new = false;
        for e in entries {
            let e = e.map_err(|e| format!("list sled blobs: {e}"))?;
            let name = e.file_name();
            if !seen.contains(&name) {
                File::open(e.path())
                    .and_then(|f| f.sync_all())
                    .map_err(|e| format!("fsync sled blob: {e}"))?;
                new = true;
            }
            present.insert(name);
        }
        *seen = present;
        if new {
            fsync_dir(&blobs).map_err(|e| format!("fsync sled blobs folder: {e}"))?;
        }
    }
    log.sync_data()
        .map_err(|e| format!("fdatasync sled log: {e}"))
}

/// What the writer and the syncer share.
struct Shared {
    /// Set when a change could not be made durable or applied: from then on every change fails
    /// (the write-ahead log may end in a torn frame, and sled may lack a durable batch) until the
    /// proxy restarts and replays the log.
    broken: Mutex<Option<String>>,
    /// The last batch applied to sled (batches are numbered by the writer).
    applied: Mutex<u64>,
    progress: std::sync::Condvar,
    /// Durable changes not yet applied to sled.
    mem: RwLock<Mem>,
    /// The write log's files: the drainer appends, checkpoints fsync, the writer prunes, readers
    /// take snapshots.
    logfiles: Mutex<LogFiles>,
    /// Actions per state (by [`slot`]): counted once at open, then kept by the writer.
    counts: Mutex<Counts>,
}

/// Actions per state, indexed by [`slot`].
type Counts = [u64; State::ALL.len()];

fn slot(st: State) -> usize {
    st as usize
}

/// Actions per state (once, at open): from the state index, and `succeeded` as the rest of the
/// creation index.
fn count_states(db: &sled::Db) -> Counts {
    let mut c = Counts::default();
    for st in State::ALL.into_iter().filter(|s| state_indexed(*s)) {
        let prefix = format!("s/{}/", st.as_str());
        c[slot(st)] = db.scan_prefix(prefix.as_bytes()).keys().count() as u64;
    }
    let all = db.scan_prefix(CREATED_PREFIX).keys().count() as u64;
    c[slot(State::Succeeded)] = all.saturating_sub(c.iter().sum());
    c
}

type Changes = HashMap<Vec<u8>, Option<Vec<u8>>>;

/// Durable changes on their way into sled, newest value per key (`None`: removed). Point reads
/// look here before sled; sled gets them in bulk, so that an action's claim and its outcome,
/// made durable moments apart, cost sled one write of the record instead of two.
#[derive(Default)]
struct Mem {
    /// Changes since the last drain started.
    active: Changes,
    /// Keys put in `active` that neither `frozen` nor sled holds: removing one again drops the
    /// change instead of sending sled a delete of a key it never had (a new action's
    /// `s/in_flight/` entry, put by its claim and removed by its outcome moments later).
    absent: HashSet<Vec<u8>>,
    /// The changes a drain is applying to sled now.
    frozen: Arc<Changes>,
    draining: bool,
    /// When the oldest change in `active` arrived.
    since: Option<Instant>,
}

impl Mem {
    fn get(&self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        self.active
            .get(key)
            .or_else(|| self.frozen.get(key))
            .cloned()
    }
}

/// Drains run at least this often, and when this many keys wait.
const DRAIN_EVERY: std::time::Duration = std::time::Duration::from_millis(250);
const DRAIN_KEYS: usize = 2_048;

/// Reads one key: the durable changes not yet in sled first, then sled.
fn read_key(shared: &Shared, db: &sled::Db, key: &[u8]) -> Result<Option<sled::IVec>, StoreError> {
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

impl Shared {
    fn new(logfiles: LogFiles, counts: Counts) -> Shared {
        Shared {
            counts: Mutex::new(counts),
            broken: Mutex::new(None),
            applied: Mutex::new(0),
            progress: std::sync::Condvar::new(),
            mem: RwLock::new(Mem::default()),
            logfiles: Mutex::new(logfiles),
        }
    }

    fn logfiles(&self) -> Result<std::sync::MutexGuard<'_, LogFiles>, StoreError> {
        self.logfiles
            .lock()
            .map_err(|_| unavailable("store lock poisoned"))
    }

    fn check(&self) -> Result<(), String> {
        match self.broken.lock().map(|b| b.clone()) {
            Ok(None) => Ok(()),
            Ok(Some(e)) => Err(format!(
                "the store stopped taking changes after an earlier failure ({e}); restart the proxy"
            )),
            Err(_) => Err("store lock poisoned".into()),
        }
    }

    /// Stops the store taking changes; the first failure is logged, once.
    fn fail(&self, e: &str) {
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

    fn applied(&self) -> u64 {
        self.applied.lock().map(|a| *a).unwrap_or(0)
    }

    /// Waits until batch `seq` is applied to sled (or the store broke).
    fn wait_applied(&self, seq: u64) -> Result<(), String> {
        let guard = self.applied.lock().map_err(|_| "store lock poisoned")?;
        let _guard = self
            .progress
            .wait_while(guard, |a| {
                *a < seq && self.broken.lock().map(|b| b.is_none()).unwrap_or(false)
            })
            .map_err(|_| "store lock poisoned")?;
        self.check()
    }
}

/// A batch written to the write-ahead log, on its way to being durable and applied.
struct Sealed {
    seq: u64,
    /// The log file it was written to (fdatasynced by the syncer).
    file: Arc<File>,
    changes: Vec<Change>,
    /// Someone waits for it to be durable (else: within [`LAZY_FLUSH`]).
    durable: bool,
    answers: Vec<Answer>,
    records: HashMap<String, Option<Arc<Record>>>,
    bodies: HashMap<String, Bytes>,
    /// Writing it to the log failed.
    failed: Option<String>,
    /// Apply everything so far to sled before going on (scans and checkpoints need it).
    drain: bool,
    /// Keys this batch puts that no earlier batch ever did (see [`Mem::absent`]).
    new_keys: HashSet<Vec<u8>>,
}

/// The thread that makes batches durable, so that the writer decides the next batch while this
/// one's fdatasync runs. In order, per group of batches waiting: one fdatasync for all of them,
/// then their changes join [`Mem`] (where point reads see them), the cache is updated and the
/// callers answered. So reads and the cache only ever see durable batches, and nobody is
/// answered before. A drainer thread applies [`Mem`] to sled in bulk.
struct Syncer {
    db: sled::Db,
    shared: Arc<Shared>,
    cache: Arc<Mutex<Cache>>,
    flushes: Arc<AtomicU64>,
    flush_latency: Option<prometheus_client::metrics::histogram::Histogram>,
}

impl Syncer {
    fn run(self, rx: mpsc::Receiver<Sealed>) {
        let (drain_tx, drain_rx) = mpsc::channel::<(Arc<Changes>, u64)>();
        let drainer = {
            let (db, shared) = (self.db.clone(), self.shared.clone());
            std::thread::Builder::new()
                .name("oncegate-drain".into())
                .spawn(move || drain_loop(&db, &shared, drain_rx))
        };
        let drainer = match drainer {
            Ok(d) => d,
            Err(e) => {
                self.shared.fail(&format!("start drainer thread: {e}"));
                return;
            }
        };
        // Written but not yet fdatasynced: audit-only entries (notes) and lease renewals, which
        // no caller waits for. The next durable batch, or this timer, makes them durable.
        let mut lazy: Option<Arc<File>> = None;
        // The last batch whose changes are in `Mem`.
        let mut visible = 0;
        loop {
            let first = match rx.recv_timeout(LAZY_FLUSH) {
                Ok(b) => b,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Some(f) = lazy.take() {
                        if let Err(e) = f.sync_data() {
                            self.shared.fail(&format!("write-ahead log fdatasync: {e}"));
                        }
                    }
                    self.maybe_drain(&drain_tx, visible, false);
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    if let Some(f) = lazy.take() {
                        let _ = f.sync_data();
                    }
                    break;
                }
            };
            let mut group = vec![first];
            while let Ok(b) = rx.try_recv() {
                group.push(b);
            }
            let mut result = self.shared.check();
            if let Some(e) = group.iter().find_map(|b| b.failed.clone()) {
                result = Err(e);
            }
            if result.is_ok() && group.iter().any(|b| b.durable) {
                let started = Instant::now();
                let mut files: Vec<Arc<File>> = lazy.take().into_iter().collect();
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
                lazy = group.last().map(|b| b.file.clone());
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
                                    m.active.insert(k, Some(v));
                                }
                                Change::Del(k) => {
                                    if m.absent.remove(&k) {
                                        m.active.remove(&k);
                                    } else {
                                        m.active.insert(k, None);
                                    }
                                }
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
                visible = group.last().map_or(visible, |b| b.seq);
            }
            for b in group {
                answers.extend(b.answers);
            }
            for a in answers {
                a.send(&result);
            }
            if result.is_ok() {
                self.maybe_drain(&drain_tx, visible, force);
            }
        }
        drop(drain_tx);
        let _ = drainer.join();
    }

    /// Hands the changes waiting in [`Mem`] to the drainer when they are old or many enough, or
    /// when asked (`force`: the writer waits for everything up to `visible` to be in sled).
    fn maybe_drain(&self, tx: &mpsc::Sender<(Arc<Changes>, u64)>, visible: u64, force: bool) {
        if self.shared.check().is_err() {
            return;
        }
        let Ok(mut m) = self.shared.mem.write() else {
            return;
        };
        let due =
            m.since.is_some_and(|t| t.elapsed() >= DRAIN_EVERY) || m.active.len() >= DRAIN_KEYS;
        if !force && (!due || m.draining) {
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
        let frozen = Arc::new(std::mem::take(&mut m.active));
        // Once drained, sled holds them.
        m.absent.clear();
        m.frozen = frozen.clone();
        m.draining = true;
        m.since = None;
        drop(m);
        if tx.send((frozen, visible)).is_err() {
            self.shared.fail("the drainer thread stopped");
        }
    }
}

/// Applies frozen changes to sled, then lets readers forget them.
fn drain_loop(db: &sled::Db, shared: &Shared, rx: mpsc::Receiver<(Arc<Changes>, u64)>) {
    while let Ok((changes, seq)) = rx.recv() {
        // Log blocks in order (the map has none); records and indexes in any.
        let mut pairs: Vec<(&[u8], Option<&[u8]>)> = changes
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_deref()))
            .collect();
        pairs.sort_unstable_by_key(|(k, _)| log_seq(k));
        let applied = match apply_changes(db, &shared.logfiles, pairs.into_iter()) {
            Ok(()) => true,
            Err(e) => {
                shared.fail(&format!("apply durable changes: {e}"));
                false
            }
        };
        if let Ok(mut m) = shared.mem.write() {
            // What sled could not take stays readable here (the store takes no more changes).
            if applied {
                m.frozen = Arc::new(Changes::new());
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

/// The checkpoint thread's queue and handle.
type Checkpointer = (mpsc::Sender<(u64, u64)>, std::thread::JoinHandle<()>);

/// Removes log files once sled holds their frames durably: waits until the drainer has applied
/// the file's last batch, then flushes and fsyncs sled (the checkpoint) and deletes the files.
fn checkpoint_loop(
    db: &sled::Db,
    dir: &Path,
    shared: &Shared,
    rx: mpsc::Receiver<(u64, u64)>,
) -> Result<(), String> {
    let log = File::open(dir.join("db")).map_err(|e| format!("open sled log file: {e}"))?;
    let mut blobs = HashSet::new();
    while let Ok((seq, generation)) = rx.recv() {
        shared.wait_applied(seq)?;
        sled_durable(db, dir, &mut blobs, &log)?;
        shared.logfiles().map_err(|e| e.to_string())?.sync()?;
        wal::remove_through(&dir.join("wal"), generation)?;
    }
    Ok(())
}

/// The single thread that decides every change to the store.
struct Writer {
    sealer: Option<Arc<Sealer>>,
    placing: Arc<Mutex<HashMap<String, i64>>>,
    /// The cache of durable records, which the writer fills from what it reads in sled.
    cache: Arc<Mutex<Cache>>,
    /// The store's folder, and the sled blob files already fsynced.
    dir: PathBuf,
    blobs: HashSet<std::ffi::OsString>,
    notes: Arc<Mutex<Vec<LogEvent>>>,
    db: sled::Db,
    /// sled's own log file, fsynced at checkpoints.
    log: File,
    wal: Wal,
    /// The frame being written (reused).
    frame: Vec<u8>,
    shared: Arc<Shared>,
    /// Batches written, numbered; and records changed by batches not yet applied to sled (with
    /// the batch that last changed them), which the writer reads instead of sled.
    seq: u64,
    unapplied: HashMap<String, (u64, Option<Arc<Record>>)>,
    /// Sealed batches go to the syncer.
    sync: mpsc::Sender<Sealed>,
    /// Log files to remove once sled is durable past a batch: `(batch, generation)`.
    checkpointer: Option<Checkpointer>,
    /// A new log file after this many bytes.
    checkpoint_bytes: u64,
    chain: Chain,
    /// `(seq, hash)` of the last log entry staged.
    head: (u64, String),
    log_retention: Option<std::time::Duration>,
    /// When buffered notes are written at the latest.
    notes_due: Option<Instant>,
}

/// The changes of one batch, readable before they are applied.
#[derive(Default)]
struct Pending {
    changes: Vec<Change>,
    /// The records this batch changed (shared, not copied, with the answers, the syncer's cache
    /// and the writer's unapplied map).
    records: HashMap<String, Option<Arc<Record>>>,
    /// Response bodies stored in this batch, by action id.
    bodies: HashMap<String, Bytes>,
    /// The log entries of this batch (NDJSON) and the first one's sequence number.
    log_block: Vec<u8>,
    log_first: Option<u64>,
    writes: usize,
    /// Someone waits for this batch to be durable.
    durable: bool,
    /// Keys put by this batch that no batch before it ever put (see [`Mem::absent`]).
    new_keys: HashSet<Vec<u8>>,
}

impl Pending {
    fn put(&mut self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) {
        self.changes.push(Change::Put(key.into(), value.into()));
    }
    fn del(&mut self, key: impl Into<Vec<u8>>) {
        self.changes.push(Change::Del(key.into()));
    }
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Op>) {
        loop {
            let first = match self.notes_due {
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
            let mut ops = vec![first];
            while ops.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(op) => ops.push(op),
                    Err(_) => break,
                }
            }
            // A drain reads sled once everything before it is applied: what came before it,
            // buffered notes included, is sealed as a batch of its own first.
            let mut cur = Vec::with_capacity(ops.len());
            for op in ops {
                let before =
                    matches!(op, Op::Drain(_)) && (!cur.is_empty() || self.notes_waiting() > 0);
                if before && !self.batch(std::mem::take(&mut cur), true) {
                    return;
                }
                cur.push(op);
            }
            if !self.batch(cur, false) {
                return;
            }
        }
        // Closing: the notes still buffered are written, everything applied, the checkpointer
        // done, and sled checkpointed so the next start replays nothing.
        if !self.batch(Vec::new(), true) {
            return;
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

    /// Applies, writes and hands to the syncer one batch of operations; `false` once the syncer
    /// is gone. Buffered notes ride along when the batch is durable anyway, when they have
    /// waited [`NOTES_WAIT`] or number [`NOTES_BATCH`], or when `all_notes`.
    fn batch(&mut self, ops: Vec<Op>, all_notes: bool) -> bool {
        let mut pending = Pending::default();
        // Notes first: they happened before these operations, and an operation that reads
        // the log (a drain) must find them.
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
        if let Some(first) = pending.log_first {
            let block = std::mem::take(&mut pending.log_block);
            pending.put(log_key(first), block);
            // The database learns the log's head with the entries (`history`): at open, a log
            // that ends before it was cut.
            pending.put(
                history::HEAD_KEY,
                history::head_value(self.head.0, &self.head.1),
            );
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
            if let Err(e) = self.wal.append(&self.frame) {
                let e = format!("write-ahead log write: {e}");
                self.shared.fail(&e);
                failed = Some(e);
            }
        }
        if failed.is_none() {
            for (id, r) in &pending.records {
                self.unapplied.insert(id.clone(), (self.seq, r.clone()));
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
            new_keys: pending.new_keys,
        };
        if self.sync.send(sealed).is_err() {
            return false;
        }
        if self.unapplied.len() > MAX_BATCH {
            let applied = self.shared.applied();
            self.unapplied.retain(|_, (seq, _)| *seq > applied);
        }
        if self.wal.wants_checkpoint(self.checkpoint_bytes) {
            // A new log file at once; the old one goes once sled holds its frames durably,
            // which the checkpointer thread sees to without holding up writes.
            match self.wal.start_next() {
                Ok(old) => {
                    if let Some((tx, _)) = &self.checkpointer {
                        let _ = tx.send((self.seq, old));
                    }
                }
                Err(e) => self
                    .shared
                    .fail(&format!("start a write-ahead log file: {e}")),
            }
        }
        true
    }

    fn notes_waiting(&self) -> usize {
        self.notes.lock().map_or(0, |n| n.len())
    }

    /// Waits until every batch written is applied to sled: before reading sled beyond one key
    /// (scans) and before a checkpoint.
    fn settle_down(&mut self) -> Result<(), String> {
        self.seq += 1;
        let marker = Sealed {
            seq: self.seq,
            file: self.wal.file(),
            changes: Vec::new(),
            durable: false,
            answers: Vec::new(),
            records: HashMap::new(),
            bodies: HashMap::new(),
            failed: None,
            drain: true,
            new_keys: HashSet::new(),
        };
        self.sync
            .send(marker)
            .map_err(|_| "the syncer thread stopped".to_string())?;
        self.shared.wait_applied(self.seq)?;
        self.unapplied.clear();
        Ok(())
    }

    /// Makes sled durable on its own (flush, fsync its blob files, fdatasync its log file), so
    /// the write-ahead log can start afresh.
    fn checkpoint(&mut self) -> Result<(), String> {
        self.settle_down()?;
        sled_durable(&self.db, &self.dir, &mut self.blobs, &self.log)?;
        self.shared.logfiles().map_err(|e| e.to_string())?.sync()?;
        self.wal.start_next()?;
        // Every file before the new one, including any the checkpointer had not removed yet.
        self.wal.remove_older()
    }

    fn read(&self, pending: &Pending, id: &str) -> Result<Option<Arc<Record>>, StoreError> {
        if let Some(r) = pending.records.get(id) {
            return Ok(r.clone());
        }
        if let Some((_, r)) = self.unapplied.get(id) {
            return Ok(r.clone());
        }
        // Not changed by any batch sled lacks: what sled holds is the durable latest, and the
        // claim fast path may answer from it next time (the generation guards the fill all the
        // same).
        let gen = self.cache.lock().map(|c| c.generation(id)).ok();
        let key = rec_key(id);
        match self.db.get(&key).map_err(unavailable)? {
            Some(v) => {
                let r = Arc::new(decode(&key, &v, self.sealer.as_deref())?);
                if let (Some(gen), Ok(mut c)) = (gen, self.cache.lock()) {
                    c.fill(gen, &r);
                }
                Ok(Some(r))
            }
            None => Ok(None),
        }
    }

    /// Chains an event into the batch.
    fn append(&mut self, pending: &mut Pending, ev: LogEvent) {
        let (e, line) = self
            .chain
            .seal_line(ev, (self.head.0, &self.head.1), now_millis());
        // The batch's entries go into blocks (one sled value each, at most LOG_BLOCK_MAX): one
        // insert per block, not per entry.
        if pending.log_block.len() + line.len() > LOG_BLOCK_MAX {
            if let Some(first) = pending.log_first.take() {
                let block = std::mem::take(&mut pending.log_block);
                pending.put(log_key(first), block);
            }
        }
        pending.log_first.get_or_insert(e.seq);
        pending.log_block.extend_from_slice(&line);
        pending.log_block.push(b'\n');
        self.head = (e.seq, e.hash);
        pending.writes += 1;
    }

    /// Stages `new` (replacing `old`) with its index entries; only entries that change are
    /// written. Returns it as the batch now holds it.
    fn stage(&self, pending: &mut Pending, old: Option<&Record>, new: Record) -> Arc<Record> {
        if old.map(|o| o.state) != Some(new.state) {
            self.count(old.map(|o| o.state), Some(new.state));
        }
        let (new, value) = encode_bounded(new, self.sealer.as_deref());
        pending.put(rec_key(&new.id), value);
        let before: Vec<Vec<u8>> = old.map(|o| index_keys(o).collect()).unwrap_or_default();
        let after: Vec<Vec<u8>> = index_keys(&new).collect();
        for k in before.iter().filter(|k| !after.contains(k)) {
            pending.del(k.clone());
        }
        for k in after.into_iter().filter(|k| !before.contains(k)) {
            pending.put(k, []);
        }
        let new = Arc::new(new);
        pending
            .records
            .insert(new.id.clone(), Some(Arc::clone(&new)));
        pending.writes += 1;
        new
    }

    /// Moves one action between states in the counts (`None`: absent).
    fn count(&self, from: Option<State>, to: Option<State>) {
        if let Ok(mut c) = self.shared.counts.lock() {
            if let Some(f) = from {
                c[slot(f)] = c[slot(f)].saturating_sub(1);
            }
            if let Some(t) = to {
                c[slot(t)] += 1;
            }
        }
    }

    fn unstage(&self, pending: &mut Pending, old: &Record) {
        self.count(Some(old.state), None);
        pending.del(rec_key(&old.id));
        pending.del(body_key(&old.id));
        for k in index_keys(old) {
            pending.del(k);
        }
        pending.records.insert(old.id.clone(), None);
        pending.writes += 1;
    }

    /// One step of expiry: the due entries of the expiry index after `from`, at most
    /// [`EXPIRE_STEP`] of them. The index is read from sled: the first step waits until sled
    /// holds every change so far; an entry whose record moved on since (or went) is skipped.
    fn expire_step(
        &mut self,
        pending: &mut Pending,
        now: Millis,
        from: Option<Vec<u8>>,
    ) -> Result<(usize, Option<Vec<u8>>), StoreError> {
        let start = match from {
            Some(k) => k,
            None => {
                self.settle_down().map_err(unavailable)?;
                EXPIRY_PREFIX.to_vec()
            }
        };
        let mut keys = Vec::new();
        for k in self.db.range(start..expiry_end(now)).keys() {
            keys.push(k.map_err(unavailable)?);
            if keys.len() == EXPIRE_STEP {
                break;
            }
        }
        let mut n = 0;
        let mut freed = Vec::new();
        for k in &keys {
            let id = index_id(k, EXPIRY_PREFIX)?;
            let Some(r) = self.read(pending, &id)? else {
                continue;
            };
            // Only settled records expire (`is_expired`); skip entries of an older expiry.
            if !r.is_expired(now)
                || r.expires_at.map(|e| expiry_key(e, &id)).as_deref() != Some(&**k)
            {
                continue;
            }
            self.unstage(pending, &r);
            self.append(
                pending,
                LogEvent::for_record(Event::Expired, &r, Actor::Proxy),
            );
            freed.extend(body_file(&r).map(str::to_string));
            n += 1;
        }
        // Body files are shared by content: one goes when no record keeps it and no settlement
        // is placing it.
        for sha in freed {
            let placed = self.placing.lock().is_ok_and(|p| p.contains_key(&sha));
            if !placed && !self.file_kept(pending, &sha)? {
                let _ = std::fs::remove_file(self.dir.join("bodies").join(&sha));
            }
        }
        if keys.len() < EXPIRE_STEP {
            self.prune_log(now).map_err(unavailable)?;
            return Ok((n, None));
        }
        let mut next = keys.pop().map(|k| k.to_vec()).unwrap_or_default();
        next.push(0);
        Ok((n, Some(next)))
    }

    /// Whether any record keeps its response in body file `sha`: those sled's index names (as
    /// they are now), and those changed by batches not yet in sled.
    fn file_kept(&self, pending: &Pending, sha: &str) -> Result<bool, StoreError> {
        let keeps = |r: &Option<Arc<Record>>| r.as_deref().and_then(body_file) == Some(sha);
        let newer = self
            .unapplied
            .iter()
            .filter(|(id, _)| !pending.records.contains_key(*id))
            .map(|(_, (_, r))| r);
        if pending.records.values().chain(newer).any(keeps) {
            return Ok(true);
        }
        let prefix = file_key(sha, "");
        for k in self.db.scan_prefix(&prefix).keys() {
            let k = k.map_err(unavailable)?;
            let id = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
            if keeps(&self.read(pending, &id)?) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn apply(&mut self, op: Op, pending: &mut Pending) -> Answer {
        if op.needs_flush() {
            pending.durable = true;
        }
        match op {
            Op::Claim(req, tx) => match self.read(pending, &req.fresh.id) {
                Err(e) => Answer::failed(tx, e),
                Ok(current) => {
                    let old = current.clone();
                    let (claim, write) = decide_claim(current.map(Arc::unwrap_or_clone), &req);
                    if let Some(w) = write {
                        // An expired record being replaced loses its stored body and indexes.
                        let expired = old.as_deref().filter(|o| o.is_expired(req.now));
                        if let Some(o) = expired {
                            self.unstage(pending, o);
                            self.append(
                                pending,
                                LogEvent::for_record(Event::Expired, o, Actor::Proxy),
                            );
                        }
                        let live_old = if expired.is_some() {
                            None
                        } else {
                            old.as_deref()
                        };
                        let w = self.stage(pending, live_old, w);
                        if old.is_none() {
                            // A new action: no batch ever put its state entry.
                            pending.new_keys.insert(state_key(w.state, &w.id));
                        }
                        for ev in claim_events(&claim, &w) {
                            self.append(pending, ev);
                        }
                    }
                    Answer::Claim(tx, Box::new(claim))
                }
            },
            Op::Settle(req, tx) => {
                let SettleRequest {
                    id,
                    attempt,
                    settlement,
                    body,
                } = *req;
                let result = self.read(pending, &id).and_then(|current| {
                    let old = current.clone();
                    let new =
                        apply_settle(current.map(Arc::unwrap_or_clone), &id, attempt, settlement)?;
                    Ok((old, new))
                });
                match result {
                    Err(e) => Answer::failed(tx, e),
                    Ok((old, new)) => {
                        if let Some(body) = &body {
                            pending.put(body_key(&new.id), seal_opt(self.sealer.as_deref(), body));
                            pending.bodies.insert(new.id.clone(), body.clone());
                        }
                        let new = self.stage(pending, old.as_deref(), new);
                        self.append(pending, settle_event(&new));
                        Answer::Record(tx, new)
                    }
                }
            }
            Op::Resolve(id, mut res, event, tx) => {
                let (actor, reason) = match event {
                    Event::Lookup => (Actor::Lookup, res.reason.clone()),
                    _ => (Actor::Admin, res.reason.clone()),
                };
                let body = res.body.take();
                let result = self.read(pending, &id).and_then(|current| {
                    let old = current.clone();
                    let new = apply_resolve(current.map(Arc::unwrap_or_clone), &id, *res)?;
                    Ok((old, new))
                });
                match result {
                    Err(e) => Answer::failed(tx, e),
                    Ok((old, new)) => {
                        if let Some(body) = body {
                            pending.put(body_key(&new.id), seal_opt(self.sealer.as_deref(), &body));
                            pending.bodies.insert(new.id.clone(), body.clone());
                        }
                        let new = self.stage(pending, old.as_deref(), new);
                        self.append(pending, resolve_event(event, &new, actor, reason));
                        Answer::Record(tx, new)
                    }
                }
            }
            Op::Notes => {
                // Notes wait a little for company (see `batch`).
                self.notes_due
                    .get_or_insert_with(|| Instant::now() + NOTES_WAIT);
                Answer::None
            }
            Op::Recover(owner, now, tx) => {
                let filter = Filter {
                    state: Some(State::InFlight),
                    ..Filter::default()
                };
                let found = self
                    .settle_down()
                    .map_err(unavailable)
                    .and_then(|()| scan(&self.db, &filter, usize::MAX, self.sealer.as_deref()));
                match found {
                    Err(e) => Answer::failed(tx, e),
                    Ok(records) => {
                        let mut n = 0;
                        for r in records {
                            // An earlier operation of this batch may have changed it.
                            let Ok(Some(r)) = self.read(pending, &r.id) else {
                                continue;
                            };
                            if owner.as_ref().is_some_and(|o| r.owner.as_ref() != Some(o)) {
                                continue;
                            }
                            let old = r.clone();
                            let reason = if owner.is_some() {
                                "the proxy stopped (drain_timeout) during this attempt; the request may have reached the upstream"
                            } else {
                                "the proxy stopped during this attempt; the request may have reached the upstream"
                            };
                            if let Some(new) =
                                recover_in_flight(Arc::unwrap_or_clone(r), reason, now)
                            {
                                let new = self.stage(pending, Some(&old), new);
                                self.append(pending, recover_event(&new, reason));
                                n += 1;
                            }
                        }
                        Answer::Count(tx, n)
                    }
                }
            }
            Op::Expire(now, from, tx) => match self.expire_step(pending, now, from) {
                Ok((n, next)) => Answer::Step(tx, n, next),
                Err(e) => Answer::failed(tx, e),
            },
            Op::Sync(tx) => Answer::Unit(tx),
            Op::Drain(tx) => match self.settle_down() {
                Ok(()) => Answer::Unit(tx),
                Err(e) => Answer::failed(tx, unavailable(e)),
            },
            Op::Renew(id, owner, until, tx) => match self.read(pending, &id) {
                Err(e) => Answer::failed(tx, e),
                Ok(Some(r)) if r.state == State::InFlight && r.owner.as_ref() == Some(&owner) => {
                    let mut new = Record::clone(&r);
                    new.lease_until = Some(until);
                    self.stage(pending, Some(&r), new);
                    Answer::Bool(tx, true)
                }
                Ok(_) => Answer::Bool(tx, false),
            },
        }
    }

    /// Drops log entries older than `log.retention`, whole files at a time, keeping the chain
    /// verifiable from the first kept entry (the anchor). Entries still on their way to the
    /// files are newer than any file, which is never the newest.
    fn prune_log(&self, now: Millis) -> Result<(), StoreError> {
        let Some(keep) = self.log_retention else {
            return Ok(());
        };
        let cutoff = crate::action::rfc3339(now.saturating_sub(keep.as_millis() as u64));
        let dropped = self
            .shared
            .logfiles()?
            .prune(&cutoff)
            .map_err(unavailable)?;
        if dropped > 0 {
            tracing::info!(
                files = dropped,
                "write log: pruned files past the retention"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::tests::fresh;

    fn settled(id: &str, state: State) -> Arc<Record> {
        let mut r = fresh("fp");
        r.id = id.to_string();
        r.state = state;
        Arc::new(r)
    }

    #[test]
    fn a_fill_read_before_a_newer_outcome_is_dropped() {
        let mut c = Cache::default();
        let id = "ab12";
        // A reader notes the generation, then reads `unknown` from sled...
        let gen = c.generation(id);
        // ...while the syncer makes `succeeded` durable and puts it in.
        c.update(id.into(), Some(settled(id, State::Succeeded)), None);
        c.map.clear();
        c.fill(gen, &settled(id, State::Unknown));
        assert!(!c.map.contains_key(id), "a stale read must not be cached");

        // A read with no change in between is cached, and its body with it.
        let gen = c.generation(id);
        c.fill(gen, &settled(id, State::Succeeded));
        c.fill_body(gen, id, &Bytes::from_static(b"{}"));
        let (r, b) = c.map.get(id).expect("cached");
        assert_eq!(r.state, State::Succeeded);
        assert_eq!(b.as_deref(), Some(&b"{}"[..]));

        // Removal (expiry, a new claim) bumps the generation too.
        let gen = c.generation(id);
        c.update(id.into(), None, None);
        c.fill(gen, &settled(id, State::Succeeded));
        assert!(!c.map.contains_key(id));
    }

    #[test]
    fn failed_records_are_not_filled_and_the_cache_is_bounded() {
        let mut c = Cache::default();
        let gen = c.generation("x");
        c.fill(gen, &settled("x", State::Failed));
        assert!(c.map.is_empty());
        for i in 0..CACHE_ENTRIES + 10 {
            let id = format!("{i:08x}");
            let gen = c.generation(&id);
            c.fill(gen, &settled(&id, State::Succeeded));
        }
        assert_eq!(c.map.len(), CACHE_ENTRIES);
        assert!(!c.map.contains_key("00000000"), "the oldest goes first");
    }

    fn with_tries(attempts: usize, tries: usize, body: usize) -> Record {
        let mut r = fresh("fp");
        for n in 0..attempts {
            r.evidence.push(crate::action::Attempt {
                n: n as u32 + 1,
                started_at: 1,
                ended_at: Some(2),
                state: Some(State::Failed),
                tries: (0..tries)
                    .map(|t| crate::action::Try {
                        at: 2,
                        status: Some(503),
                        error: Some(format!("attempt {n} try {t}")),
                        body: Some("b".repeat(body)),
                        ..Default::default()
                    })
                    .collect(),
                tries_dropped: 0,
            });
        }
        r
    }

    #[test]
    fn a_small_record_is_stored_as_it_is() {
        let r = with_tries(5, 3, 4096);
        let (stored, v) = encode_bounded(r.clone(), None);
        assert_eq!(stored, r);
        assert_eq!(v, serde_json::to_vec(&r).expect("encodes"));
    }

    #[test]
    fn a_record_sheds_headers_then_whole_tries_then_the_last_body() {
        // Request headers over the bound: every try body goes, then headers, last first.
        let mut r = with_tries(2, 2, 4096);
        r.request.headers = (0..40)
            .map(|i| (format!("x-h{i:02}"), "v".repeat(4096)))
            .collect();
        let (stored, v) = encode_bounded(r, None);
        assert!(v.len() <= RECORD_MAX);
        let tries: Vec<_> = stored.evidence.iter().flat_map(|a| &a.tries).collect();
        assert!(tries[..3]
            .iter()
            .all(|t| t.body_dropped && t.body.is_none()));
        assert!(tries[3].body.is_some(), "the last try's body goes last");
        let kept = stored.request.headers.len();
        assert_eq!(kept as u32 + stored.request.headers_dropped, 40);
        assert!(kept > 0 && stored.request.headers[kept - 1].0 == format!("x-h{:02}", kept - 1));

        // Tries beyond what bodiless evidence fits: whole tries go, oldest first, each attempt
        // keeping its last.
        let r = with_tries(20, 200, 10);
        let (stored, v) = encode_bounded(r, None);
        assert!(v.len() <= RECORD_MAX);
        let first = &stored.evidence[0];
        assert!(first.tries_dropped > 0);
        assert_eq!(first.tries.len() + first.tries_dropped as usize, 200);
        assert_eq!(
            first.tries.last().expect("kept").error.as_deref(),
            Some("attempt 0 try 199")
        );
        assert!(stored.evidence.iter().all(|a| !a.tries.is_empty()));
        assert_eq!(stored.evidence.last().expect("kept").tries_dropped, 0);
    }

    #[test]
    fn the_largest_record_a_safe_policy_makes_fits_the_bound() {
        // The worst a request can bring: a head at the server's limit, all path. The worst a
        // succeeded response leaves: a head at the stored limit. Every attempt a policy within
        // `SLED_SAFE_ATTEMPTS` allows, each with long errors, request ids and 4 KiB bodies.
        let attempts = crate::config::SLED_SAFE_ATTEMPTS as usize;
        let mut r = with_tries(attempts, 3, 4096);
        r.path = "p".repeat(crate::server::HEAD_MAX);
        for t in r.evidence.iter_mut().flat_map(|a| a.tries.iter_mut()) {
            t.error = Some("e".repeat(200));
            t.request_id = Some("r".repeat(64));
        }
        r.response = Some(crate::action::StoredResponse {
            status: 201,
            headers: vec![("x".into(), "h".repeat(crate::proxy::STORED_HEAD_MAX - 1))],
            size: 2,
            body: BodyRef::Inline,
            source: crate::action::Source::Upstream,
        });
        let (stored, v) = encode_bounded(r, None);
        assert!(v.len() <= RECORD_MAX, "{} bytes", v.len());
        assert_eq!(stored.evidence.len(), attempts);
    }
}
