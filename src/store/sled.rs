//! The embedded store: sled 0.34.7 behind one writer thread with group commit.
//!
//! Every change goes through a single writer thread. It takes a batch of operations off its queue,
//! decides each against the current records (plus the changes earlier in the same batch), applies
//! the batch atomically, then makes it durable once: sled's `flush()` followed by `fdatasync` on
//! sled's log file (sled's flush alone ends in `sync_file_range`, which does not survive a power
//! loss; SPEC §13). Only then does it answer the callers. So:
//! - a claim is durable before its request leaves, an outcome before its client is answered;
//! - claims are atomic without locks (one thread decides);
//! - many concurrent writes share one flush, and a claim that finds an existing record never
//!   waits for a flush it does not need.
//!
//! Keys (one tree): `a/{id}` record (JSON), `b/{id}` small stored body, `s/{state}/{id}` state index,
//! `t/{task}\0{id}` task index. Bodies over 64 KiB live in `bodies/{sha256}` beside the database.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;

use super::{BoxFuture, Filter, SettleRequest, Store, StoreError};
use crate::action::{
    apply_settle, decide_claim, recover_in_flight, BodyRef, Claim, ClaimRequest, Millis, Record,
    State,
};

/// Bodies larger than this are kept as files, not in sled.
pub const INLINE_BODY_MAX: usize = 64 * 1024;
/// Most operations one flush covers.
const MAX_BATCH: usize = 1024;
/// sled keeps values over segment_size / 4 as separate blob files, which its flush does not
/// fsync. Large segments keep every value we store (records, bodies ≤ 64 KiB, and pages of 16 of
/// them) inside the log that we fdatasync.
const SEGMENT_SIZE: usize = 8 << 20;

enum Op {
    Claim(
        Box<ClaimRequest>,
        oneshot::Sender<Result<Claim, StoreError>>,
    ),
    Settle(SettleRequest, oneshot::Sender<Result<Record, StoreError>>),
    Recover(Millis, oneshot::Sender<Result<usize, StoreError>>),
    Expire(Millis, oneshot::Sender<Result<usize, StoreError>>),
    Sync(oneshot::Sender<Result<(), StoreError>>),
}

/// An answer decided in a batch, sent once the batch is durable.
enum Reply {
    Claim(oneshot::Sender<Result<Claim, StoreError>>, Claim),
    Settle(oneshot::Sender<Result<Record, StoreError>>, Record),
    Count(oneshot::Sender<Result<usize, StoreError>>, usize),
    Unit(oneshot::Sender<Result<(), StoreError>>),
    /// The operation failed on its own; the closure sends its error.
    Failed(Box<dyn FnOnce() + Send>),
}

impl Reply {
    fn send(self, commit: &Result<(), String>) {
        match (self, commit) {
            (Reply::Failed(f), _) => f(),
            (Reply::Claim(tx, c), Ok(())) => drop(tx.send(Ok(c))),
            (Reply::Settle(tx, r), Ok(())) => drop(tx.send(Ok(r))),
            (Reply::Count(tx, n), Ok(())) => drop(tx.send(Ok(n))),
            (Reply::Unit(tx), Ok(())) => drop(tx.send(Ok(()))),
            (Reply::Claim(tx, _), Err(e)) => drop(tx.send(Err(StoreError::Unavailable(e.clone())))),
            (Reply::Settle(tx, _), Err(e)) => {
                drop(tx.send(Err(StoreError::Unavailable(e.clone()))))
            }
            (Reply::Count(tx, _), Err(e)) => drop(tx.send(Err(StoreError::Unavailable(e.clone())))),
            (Reply::Unit(tx), Err(e)) => drop(tx.send(Err(StoreError::Unavailable(e.clone())))),
        }
    }
}

pub struct SledStore {
    /// `None` once closed: closing releases sled's file lock, so the folder can be reopened.
    db: std::sync::RwLock<Option<sled::Db>>,
    dir: PathBuf,
    tx: std::sync::Mutex<Option<mpsc::Sender<Op>>>,
    writer: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Flushes performed, for metrics and the "flushes per write" figure.
    flushes: Arc<std::sync::atomic::AtomicU64>,
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
fn state_key(state: State, id: &str) -> Vec<u8> {
    format!("s/{}/{id}", state.as_str()).into_bytes()
}
fn task_key(task: &str, id: &str) -> Vec<u8> {
    format!("t/{task}\0{id}").into_bytes()
}

fn decode(key: &[u8], v: &[u8]) -> Result<Record, StoreError> {
    serde_json::from_slice(v).map_err(|e| StoreError::Corrupt {
        id: String::from_utf8_lossy(key).into_owned(),
        reason: e.to_string(),
    })
}

fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

impl SledStore {
    /// Opens (or creates) the store at `dir`. Errors name the path and what to do.
    pub fn open(dir: &Path) -> Result<SledStore, StoreError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            StoreError::Unavailable(format!(
                "cannot open the store at {}: {what}: {e}. If the disk is full or read-only, fix \
                 that and start again. If the store is corrupt, stop every proxy using it, move the \
                 folder aside (keep it for the write log), and start with an empty folder: actions \
                 that were unknown must then be settled at the upstream by hand.",
                dir.display()
            ))
        };
        let existed = dir.exists();
        std::fs::create_dir_all(dir.join("bodies")).map_err(|e| fail("create folder", &e))?;
        if !existed {
            // The new folder's entry must survive a power loss too.
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                fsync_dir(parent).map_err(|e| fail("fsync parent folder", &e))?;
            }
            fsync_dir(dir).map_err(|e| fail("fsync folder", &e))?;
        }
        let db = sled::Config::new()
            .path(dir)
            .segment_size(SEGMENT_SIZE)
            .flush_every_ms(None)
            .open()
            .map_err(|e| fail("sled", &e))?;
        let log = File::open(dir.join("db")).map_err(|e| fail("open sled log file", &e))?;
        let (tx, rx) = mpsc::channel();
        let flushes = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let writer = Writer {
            db: db.clone(),
            log,
            flushes: flushes.clone(),
        };
        let handle = std::thread::Builder::new()
            .name("oncegate-store".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| fail("start writer thread", &e))?;
        Ok(SledStore {
            db: std::sync::RwLock::new(Some(db)),
            dir: dir.to_owned(),
            tx: std::sync::Mutex::new(Some(tx)),
            writer: std::sync::Mutex::new(Some(handle)),
            flushes,
        })
    }

    /// How many flush+fdatasync rounds the store has made.
    pub fn flush_count(&self) -> u64 {
        self.flushes.load(std::sync::atomic::Ordering::Relaxed)
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Op,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        {
            let guard = self
                .tx
                .lock()
                .map_err(|_| unavailable("store lock poisoned"))?;
            let sender = guard
                .as_ref()
                .ok_or_else(|| unavailable("store is closed"))?;
            sender
                .send(make(tx))
                .map_err(|_| unavailable("store writer stopped"))?;
        }
        rx.await.map_err(|_| unavailable("store writer stopped"))?
    }

    fn db(&self) -> Result<sled::Db, StoreError> {
        self.db
            .read()
            .map_err(|_| unavailable("store lock poisoned"))?
            .clone()
            .ok_or_else(|| unavailable("store is closed"))
    }

    fn body_path(&self, sha: &str) -> PathBuf {
        self.dir.join("bodies").join(sha)
    }

    /// Writes a large body as a content-addressed file: write, fsync, rename, fsync the folder.
    fn write_body_file(dir: PathBuf, body: Bytes) -> std::io::Result<String> {
        let sha = hex::encode(Sha256::digest(&body));
        let bodies = dir.join("bodies");
        let path = bodies.join(&sha);
        if path.exists() {
            return Ok(sha);
        }
        let tmp = bodies.join(format!(".{sha}.{}.tmp", std::process::id()));
        let mut f = File::create(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        fsync_dir(&bodies)?;
        Ok(sha)
    }
}

impl Store for SledStore {
    fn claim(&self, req: ClaimRequest) -> BoxFuture<'_, Result<Claim, StoreError>> {
        Box::pin(self.call(|tx| Op::Claim(Box::new(req), tx)))
    }

    fn settle(&self, mut req: SettleRequest) -> BoxFuture<'_, Result<Record, StoreError>> {
        Box::pin(async move {
            if let (Some(body), Some(resp)) = (&req.body, req.settlement.response.as_mut()) {
                if body.len() > INLINE_BODY_MAX {
                    let (dir, body) = (self.dir.clone(), body.clone());
                    let sha = tokio::task::spawn_blocking(move || Self::write_body_file(dir, body))
                        .await
                        .map_err(unavailable)?
                        .map_err(unavailable)?;
                    resp.body = BodyRef::File { sha256: sha };
                    req.body = None;
                } else {
                    resp.body = BodyRef::Inline;
                }
            }
            self.call(|tx| Op::Settle(req, tx)).await
        })
    }

    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(async move {
            let key = rec_key(id);
            match self.db()?.get(&key).map_err(unavailable)? {
                Some(v) => decode(&key, &v).map(Some),
                None => Ok(None),
            }
        })
    }

    fn body<'a>(&'a self, record: &'a Record) -> BoxFuture<'a, Result<Option<Bytes>, StoreError>> {
        Box::pin(async move {
            match record.response.as_ref().map(|r| &r.body) {
                Some(BodyRef::Inline) => Ok(self
                    .db()?
                    .get(body_key(&record.id))
                    .map_err(unavailable)?
                    .map(|v| Bytes::copy_from_slice(&v))),
                Some(BodyRef::File { sha256 }) => {
                    let bytes = tokio::fs::read(self.body_path(sha256))
                        .await
                        .map_err(unavailable)?;
                    Ok(Some(Bytes::from(bytes)))
                }
                Some(BodyRef::Absent) | None => Ok(None),
            }
        })
    }

    fn scan(&self, filter: Filter, limit: usize) -> BoxFuture<'_, Result<Vec<Record>, StoreError>> {
        Box::pin(async move {
            let db = self.db()?;
            tokio::task::spawn_blocking(move || scan(&db, &filter, limit))
                .await
                .map_err(unavailable)?
        })
    }

    fn recover(&self, now: Millis) -> BoxFuture<'_, Result<usize, StoreError>> {
        Box::pin(self.call(move |tx| Op::Recover(now, tx)))
    }

    fn expire(&self, now: Millis) -> BoxFuture<'_, Result<usize, StoreError>> {
        Box::pin(self.call(move |tx| Op::Expire(now, tx)))
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

fn scan(db: &sled::Db, filter: &Filter, limit: usize) -> Result<Vec<Record>, StoreError> {
    let mut out = Vec::new();
    let ids: Box<dyn Iterator<Item = Result<String, StoreError>>> =
        match (&filter.task, filter.state) {
            (Some(task), _) => {
                let prefix = format!("t/{task}\0");
                Box::new(db.scan_prefix(prefix.as_bytes()).map(move |kv| {
                    let (k, _) = kv.map_err(unavailable)?;
                    Ok(String::from_utf8_lossy(&k[prefix.len()..]).into_owned())
                }))
            }
            (None, Some(state)) => {
                let prefix = format!("s/{}/", state.as_str());
                Box::new(db.scan_prefix(prefix.as_bytes()).map(move |kv| {
                    let (k, _) = kv.map_err(unavailable)?;
                    Ok(String::from_utf8_lossy(&k[prefix.len()..]).into_owned())
                }))
            }
            (None, None) => Box::new(db.scan_prefix(b"a/").map(|kv| {
                let (k, _) = kv.map_err(unavailable)?;
                Ok(String::from_utf8_lossy(&k[2..]).into_owned())
            })),
        };
    for id in ids {
        let key = rec_key(&id?);
        if let Some(v) = db.get(&key).map_err(unavailable)? {
            let r = decode(&key, &v)?;
            if filter.matches(&r) {
                out.push(r);
            }
        }
    }
    out.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
    out.truncate(limit);
    Ok(out)
}

/// The single thread that changes the store.
struct Writer {
    db: sled::Db,
    log: File,
    flushes: Arc<std::sync::atomic::AtomicU64>,
}

/// The changes of one batch, readable before they are applied.
#[derive(Default)]
struct Pending {
    batch: sled::Batch,
    records: HashMap<String, Option<Record>>,
    writes: usize,
}

impl Writer {
    fn run(self, rx: mpsc::Receiver<Op>) {
        while let Ok(first) = rx.recv() {
            let mut ops = vec![first];
            while ops.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(op) => ops.push(op),
                    Err(_) => break,
                }
            }
            let mut pending = Pending::default();
            let mut replies = Vec::with_capacity(ops.len());
            let mut force_sync = false;
            for op in ops {
                if matches!(op, Op::Sync(_)) {
                    force_sync = true;
                }
                replies.push(self.apply(op, &mut pending));
            }
            let commit = if pending.writes > 0 || force_sync {
                self.commit(pending.batch)
            } else {
                Ok(())
            };
            for r in replies {
                r.send(&commit);
            }
        }
    }

    fn commit(&self, batch: sled::Batch) -> Result<(), String> {
        self.db
            .apply_batch(batch)
            .map_err(|e| format!("apply: {e}"))?;
        self.db.flush().map_err(|e| format!("flush: {e}"))?;
        self.log
            .sync_data()
            .map_err(|e| format!("fdatasync: {e}"))?;
        self.flushes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn read(&self, pending: &Pending, id: &str) -> Result<Option<Record>, StoreError> {
        if let Some(r) = pending.records.get(id) {
            return Ok(r.clone());
        }
        let key = rec_key(id);
        match self.db.get(&key).map_err(unavailable)? {
            Some(v) => decode(&key, &v).map(Some),
            None => Ok(None),
        }
    }

    /// Stages `new` (replacing `old`) with its index entries.
    fn stage(&self, pending: &mut Pending, old: Option<&Record>, new: &Record) {
        if let Some(old) = old {
            if old.state != new.state {
                pending.batch.remove(state_key(old.state, &old.id));
            }
        }
        pending.batch.insert(
            rec_key(&new.id),
            serde_json::to_vec(new).expect("records always serialize"),
        );
        pending.batch.insert(state_key(new.state, &new.id), &[]);
        if let Some(task) = &new.task {
            pending.batch.insert(task_key(task, &new.id), &[]);
        }
        pending.records.insert(new.id.clone(), Some(new.clone()));
        pending.writes += 1;
    }

    fn unstage(&self, pending: &mut Pending, old: &Record) {
        pending.batch.remove(rec_key(&old.id));
        pending.batch.remove(body_key(&old.id));
        pending.batch.remove(state_key(old.state, &old.id));
        if let Some(task) = &old.task {
            pending.batch.remove(task_key(task, &old.id));
        }
        pending.records.insert(old.id.clone(), None);
        pending.writes += 1;
    }

    fn apply(&self, op: Op, pending: &mut Pending) -> Reply {
        match op {
            Op::Claim(req, tx) => match self.read(pending, &req.fresh.id) {
                Err(e) => Reply::Failed(Box::new(move || drop(tx.send(Err(e))))),
                Ok(current) => {
                    let old = current.clone();
                    let (claim, write) = decide_claim(current, &req);
                    if let Some(w) = &write {
                        // An expired record being replaced loses its stored body and indexes.
                        if let Some(o) = old.as_ref().filter(|o| o.is_expired(req.now)) {
                            self.unstage(pending, o);
                            self.stage(pending, None, w);
                        } else {
                            self.stage(pending, old.as_ref(), w);
                        }
                    }
                    Reply::Claim(tx, claim)
                }
            },
            Op::Settle(req, tx) => {
                let result = self.read(pending, &req.id).and_then(|current| {
                    let old = current.clone();
                    let new = apply_settle(current, &req.id, req.attempt, req.settlement)?;
                    Ok((old, new))
                });
                match result {
                    Err(e) => Reply::Failed(Box::new(move || drop(tx.send(Err(e))))),
                    Ok((old, new)) => {
                        if let Some(body) = &req.body {
                            pending.batch.insert(body_key(&new.id), body.as_ref());
                        }
                        self.stage(pending, old.as_ref(), &new);
                        Reply::Settle(tx, new)
                    }
                }
            }
            Op::Recover(now, tx) => {
                let result = scan(
                    &self.db,
                    &Filter {
                        state: Some(State::InFlight),
                        ..Filter::default()
                    },
                    usize::MAX,
                );
                match result {
                    Err(e) => Reply::Failed(Box::new(move || drop(tx.send(Err(e))))),
                    Ok(records) => {
                        let mut n = 0;
                        for r in records {
                            // An earlier operation of this batch may have changed it.
                            let Ok(Some(r)) = self.read(pending, &r.id) else {
                                continue;
                            };
                            let old = r.clone();
                            if let Some(new) = recover_in_flight(
                                r,
                                "the proxy stopped during this attempt; the request may have reached the upstream",
                                now,
                            ) {
                                self.stage(pending, Some(&old), &new);
                                n += 1;
                            }
                        }
                        Reply::Count(tx, n)
                    }
                }
            }
            Op::Expire(now, tx) => {
                let result = scan(&self.db, &Filter::default(), usize::MAX);
                match result {
                    Err(e) => Reply::Failed(Box::new(move || drop(tx.send(Err(e))))),
                    Ok(records) => {
                        let mut n = 0;
                        for r in records {
                            let Ok(Some(r)) = self.read(pending, &r.id) else {
                                continue;
                            };
                            // Never expire an attempt that is still running.
                            if r.is_expired(now) && r.state != State::InFlight {
                                self.unstage(pending, &r);
                                n += 1;
                            }
                        }
                        Reply::Count(tx, n)
                    }
                }
            }
            Op::Sync(tx) => Reply::Unit(tx),
        }
    }
}
