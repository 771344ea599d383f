//! Opening the store: the folder's lock, sled, the key check, migrations and recovery.

use super::*;

/// Where the store keeps its key check: a value only its key opens (`store::seal`).
pub(super) const KEY_CHECK: &[u8] = b"m/key_check";

/// A store that was written with a key opens only with that key; a store without one takes a
/// key from now on (what it holds already stays readable).
pub(super) fn check_key(db: &sled::Db, sealer: Option<&Sealer>) -> Result<(), String> {
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

/// Where the store keeps its secret ([`crate::store::secret`]).
pub(super) const SECRET: &[u8] = b"m/secret";

/// The store's secret: read, or made for a store with no history (no write-log entry, nothing
/// replayed). A store with history and no secret was made before stores had one: unkeyed.
fn open_secret(
    db: &sled::Db,
    seen: &history::Seen,
    sealer: Option<&Sealer>,
) -> Result<crate::identity::Keyer, String> {
    let mut value = db
        .get(SECRET)
        .map_err(|e| format!("read the store's secret: {e}"))?;
    if value.is_none() && seen.log_seq == 0 && seen.replayed == 0 {
        let made = crate::store::secret::stored(&crate::store::secret::draw(), sealer);
        db.insert(SECRET, made.as_slice())
            .map_err(|e| format!("write the store's secret: {e}"))?;
        db.flush()
            .map_err(|e| format!("flush the store's secret: {e}"))?;
        value = Some(made.into());
    }
    crate::store::secret::keyer(value.as_deref(), sealer)
}

/// How long an open waits for sled's file lock before it reports the folder as in use.
pub(super) const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Opens sled in `dir`. sled 0.34 lets go of its file lock only when the last of its IO threads
/// drops its handle, which can be a moment after the store was closed: an open right after a
/// close in the same process (a test, an embedder) waits for it, up to [`LOCK_WAIT`]. A folder
/// another process holds still fails, after that wait.
pub(super) fn open_sled(dir: &Path) -> sled::Result<sled::Db> {
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

/// Moves the write log of a store from before [`crate::store::logfiles`] out of sled: its blocks are
/// appended to the log files (and its anchor carried over), made durable there, then removed
/// from sled.
pub(super) fn migrate_log(db: &sled::Db, files: &mut LogFiles) -> Result<(), String> {
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

/// Deletes sled snapshot files a crash left half written (`snap.*.generating`).
///
/// sled 0.34 writes a snapshot as `snap.{lsn}.generating` and renames it when complete, but when
/// it opens it reads the newest `snap.*` file *including* an unfinished one, finds it corrupt,
/// falls back to reading its log from the start, and fails with "Read corrupted data" (sled
/// issues #1527, #1533). A SIGKILL while sled opens (it writes a snapshot then) was enough, in
/// the torture harness. An unfinished snapshot is never needed: the previous complete one is
/// only deleted after the rename.
///
/// Returns whether a complete snapshot is left (see [`history::check_database_file`]).
pub(super) fn remove_unfinished_snapshots(dir: &Path) -> std::io::Result<bool> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(false);
    };
    let (mut removed, mut complete) = (false, false);
    for e in entries {
        let e = e?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with("snap.") {
            continue;
        }
        if name.ends_with(".generating") {
            tracing::warn!(file = %name, "store: removing an unfinished sled snapshot");
            std::fs::remove_file(e.path())?;
            removed = true;
        } else {
            complete = true;
        }
    }
    if removed {
        fsync_dir(dir)?;
    }
    Ok(complete)
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
        let snapshot = remove_unfinished_snapshots(dir)
            .map_err(|e| fail("remove unfinished sled snapshots", &e))?;
        history::check_database_file(dir, snapshot).map_err(StoreError::Unavailable)?;
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
            .unwrap_or(crate::store::logfiles::SEGMENT_BYTES);
        let logfiles = Mutex::new(
            LogFiles::open(&dir.join("log"), segment_bytes)
                .map_err(|e| fail("open the write log", &e))?,
        );
        // The filter of held ids a checkpoint or a clean close saved, which the replayed frames
        // complete (`ids/saved.rs`).
        let mut saved_ids = ids::Saved::read(dir);
        // The write-ahead log must take up where the database left off: its first frame that
        // appends to the write log appends right after (or before: a frame already checkpointed)
        // the head the database holds. A database older than that (a copy of itself from before
        // the last checkpoint, put back after a crash) would open with every change between the
        // two missing, and the replay would move its head up to the log's as if nothing were.
        let db_head = history::kept_head(&db).map_err(|e| fail("read the database", &e))?;
        let mut follows: Option<Result<(), String>> = None;
        let (wal, replayed) = Wal::open(&dir.join("wal"), |changes| {
            if follows.is_none() {
                let first = changes.iter().filter_map(|c| match c {
                    Change::Put(k, _) => log_seq(k),
                    _ => None,
                });
                if let Some(first) = first.min() {
                    let ok = history::wal_follows(dir, db_head, first);
                    let stale = ok.is_err();
                    follows = Some(ok);
                    if stale {
                        return Err("the database is older than the write-ahead log".into());
                    }
                }
            }
            if let Some(s) = saved_ids.as_mut() {
                s.replayed(&changes);
            }
            let changes = changes
                .iter()
                .map(replayed)
                .collect::<Result<Vec<_>, _>>()?;
            apply_changes(&db, &logfiles, changes.into_iter())
        })
        .map_err(|e| match follows {
            Some(Err(refused)) => StoreError::Unavailable(refused),
            _ => fail("replay the write-ahead log", &e),
        })?;
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
        let keyer = check_key(&db, options.sealer.as_deref())
            .and_then(|()| open_secret(&db, &seen, options.sealer.as_deref()))
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot open the store at {}: {e}", dir.display()))
            })?;
        let buckets =
            Buckets::open(&db).map_err(|e| fail("read the pointer buckets' secret", &e))?;
        migrate_indexes(&db, &buckets).map_err(|e| fail("build the expiry index", &e))?;
        let head = log_head(&logfiles).map_err(|e| fail("read write log", &e))?;
        let (counts, kept) = open_counts(&db);
        // Every pointer sled holds, now that the log is replayed and older layouts moved: the
        // saved filter with the replayed frames' ids when it provably holds them all, or read
        // from sled. Saved (bound to this head) before the replayed log files go, unless the
        // file already is.
        let stored = counts.iter().sum::<u64>() as usize;
        let binding = ids::Binding::of(&db, head.clone(), counts)
            .map_err(|e| fail("read the action ids", &e))?;
        let min_bits = options.ids_min_bits.unwrap_or(ids::MIN_BITS);
        let ids::Opened { ids, loaded, saved } =
            ids::at_open(&db, saved_ids, &binding, stored, min_bits)
                .map_err(|e| fail("read the action ids", &e))?;
        if !saved && !ids.is_empty() {
            if let Err(e) = ids.save(dir, &binding) {
                tracing::warn!(error = %e, "store: could not save the filter of action ids; a start after a crash reads them from sled");
            }
        }
        let mut blobs = HashSet::default();
        sled_durable(&db, dir, &mut blobs, &log)
            .and_then(|()| logfiles.sync())
            .and_then(|()| wal.retire_older())
            .map_err(|e| fail("checkpoint", &e))?;
        if replayed > 0 {
            tracing::info!(frames = replayed, "store: replayed the write-ahead log");
        }
        let (tx, rx) = mpsc::channel();
        let flushes = Arc::new(AtomicU64::new(0));
        let notes = Arc::new(Mutex::new(Vec::new()));
        let cache = Arc::new(Mutex::new(Cache::default()));
        let placing = Arc::new(Mutex::new(HashMap::default()));
        let shared = Arc::new(Shared::new(
            logfiles,
            counts,
            head.clone(),
            loaded,
            buckets,
            options.drainer_waits.clone(),
        ));
        let twins = super::twins::Twins::at_open(&db, &shared, options.sealer.as_deref())
            .map_err(|e| fail("read the unsettled actions", &e))?;
        let reader_view = shared.clone();
        let (drain_tx, drain_rx) = mpsc::channel::<(Arc<Changes>, u64)>();
        let drainer = {
            let (db, shared) = (db.clone(), shared.clone());
            std::thread::Builder::new()
                .name("oncegate-drain".into())
                .spawn(move || drain_loop(&db, &shared, drain_rx))
                .map_err(|e| fail("start drainer thread", &e))?
        };
        let sync = Arc::new(Syncer {
            shared: shared.clone(),
            cache: cache.clone(),
            flushes: flushes.clone(),
            flush_latency: options.flush_latency.clone(),
            state: Mutex::new(SyncState::new(drain_tx)),
            queued: AtomicU64::new(0),
        });
        let (sealed_tx, sealed_rx) = mpsc::channel();
        let syncer = {
            let sync = sync.clone();
            std::thread::Builder::new()
                .name("oncegate-sync".into())
                .spawn(move || sync.run(sealed_rx))
                .map_err(|e| fail("start syncer thread", &e))?
        };
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
            block: Vec::new(),
            shared,
            seq: 0,
            unapplied: HashMap::default(),
            pruned: 0,
            ids: ids::Held::new(ids, min_bits),
            sync: sealed_tx,
            syncer: sync,
            checkpointer: Some((checkpoint_tx, checkpointer)),
            checkpoint_bytes: options
                .wal_checkpoint_bytes
                .unwrap_or(wal::CHECKPOINT_BYTES),
            chain: options.chain.clone(),
            head,
            notes_due: None,
            counts,
            saved_counts: kept.then_some(counts),
            twins,
            claim_twin_key: None,
        };
        let slot = Arc::new(Slot::new(writer));
        let handle = std::thread::Builder::new()
            .name("oncegate-store".into())
            .spawn({
                let slot = slot.clone();
                move || {
                    // The writer drops its sender when it ends: the syncer ends once its queue is
                    // empty.
                    slot.run(rx);
                    let _ = syncer.join();
                    // The syncer let go of the drainer's queue as it ended.
                    let _ = drainer.join();
                }
            })
            .map_err(|e| fail("start writer thread", &e))?;
        Ok(SledStore {
            db: RwLock::new(Some(db)),
            dir: dir.to_owned(),
            chain: options.chain,
            tx: Mutex::new(Some(tx)),
            slot,
            writer: Mutex::new(Some(handle)),
            shared: reader_view,
            flushes,
            notes,
            cache,
            placing,
            sealer: options.sealer,
            keyer,
            log_retention: options.log_retention,
            space: super::super::space::Space::new(dir.to_owned(), options.reserve),
        })
    }
}
