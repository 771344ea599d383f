//! The drainer thread: durable changes applied to sled in bulk.

use super::*;

/// Changes the drainer applies between two yields of its core (about 0.2 ms of sled's work):
/// see [`drain_loop`].
const YIELD_EVERY: usize = 16;

/// A change the write-ahead log replays, as [`apply_changes`] takes it: a bucket's key with a
/// change of the bucket, any other key with its value (`None`: removed). Any other change is of
/// a form this version does not know.
pub(super) fn replayed(c: &Change) -> Result<(&[u8], Option<&[u8]>), String> {
    match c {
        Change::Put(k, v) if !pointers::is_bucket(k) => Ok((k, Some(v))),
        Change::Del(k) if !pointers::is_bucket(k) => Ok((k, None)),
        Change::Merge(k, change) if pointers::is_bucket(k) => Ok((k, Some(change))),
        Change::Put(k, _) | Change::Del(k) | Change::Merge(k, _) => Err(format!(
            "{}: a change of a form this version does not know",
            String::from_utf8_lossy(k)
        )),
    }
}

/// Applies durable changes one by one to sled, then appends their log blocks (in order) to the
/// log files, all in one call ([`LogFiles::append_blocks`]: one write for a drain's blocks, not
/// one per batch). (Removing a log block is what a store from before the log files did to prune;
/// the anchor says where the log starts, so it is nothing to do here.) A bucket's key comes with
/// a change of the bucket ([`pointers::change_value`]), made of the bucket sled holds here: off
/// the request's path, and once a drain for the changes of many batches. In order, so a replayed
/// frame's change of a bucket finds the change before it in the frame made.
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
            (None, Some(change)) if pointers::is_bucket(k) => {
                let old = db
                    .get(k)
                    .map_err(|e| format!("read a pointer bucket: {e}"))?;
                let bucket = pointers::changed(k, old.as_deref(), change)
                    .map_err(|e| format!("change a pointer bucket: {e}"))?;
                match bucket {
                    Some(b) => drop(db.insert(k, b).map_err(|e| format!("sled insert: {e}"))?),
                    None => drop(db.remove(k).map_err(|e| format!("sled remove: {e}"))?),
                }
            }
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
                    shared.drained.store(n, Ordering::SeqCst);
                    if shared.easing.load(Ordering::SeqCst) {
                        // Under the lock the waiter checks under, so that it misses nothing.
                        if let Ok(_applied) = shared.applied.lock() {
                            shared.progress.notify_all();
                        }
                    }
                    #[cfg(test)]
                    std::thread::sleep(std::time::Duration::from_micros(
                        shared.drain_pause.load(Ordering::Relaxed),
                    ));
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::action::{KeySource, Settlement, Source, StoredResponse};

    /// Claims and settles `n` new actions named `{prefix}{i}`.
    async fn writes(store: Arc<SledStore>, prefix: String, n: usize) {
        for i in 0..n {
            write(&store, format!("{prefix}{i}")).await;
        }
    }

    /// Each of `tasks` writers' last write (of `each`, by [`writes`]) reads back settled.
    async fn last_writes_read_back(store: &SledStore, tasks: usize, each: usize) {
        for t in 0..tasks {
            let r = store
                .get(&format!("w{t}-{}", each - 1))
                .await
                .expect("test step")
                .expect("test step");
            assert_eq!(r.state, State::Succeeded);
        }
    }

    /// Claims the action `id` (new or not) at `now`, kept for an hour once settled (no test
    /// here waits for it to expire).
    pub(in crate::store::sled) async fn claim(store: &SledStore, id: &str, now: Millis) -> Claim {
        let fresh = Record {
            id: id.to_string(),
            key: format!("key-{id}"),
            retention_ms: 3_600_000,
            ..crate::action::tests::fresh("f")
        };
        store
            .claim(ClaimRequest {
                fresh,
                key_source: KeySource::Header,
                max_attempts: 2,
                owner: "test".into(),
                lease: 10_000,
                now,
                twin: None,
                window: None,
            })
            .await
            .expect("test step")
    }

    /// Claims and settles the new action `id`.
    pub(in crate::store::sled) async fn write(store: &SledStore, id: String) {
        let now = now_millis();
        let claimed = claim(store, &id, now).await;
        assert!(matches!(claimed, Claim::Claimed(_)), "{id}: {claimed:?}");
        let response = StoredResponse {
            status: 201,
            headers: vec![],
            size: 2,
            body: BodyRef::Inline,
            source: Source::Upstream,
        };
        store
            .settle(SettleRequest {
                id,
                attempt: 1,
                settlement: Settlement::succeeded(now, response),
                body: Some(Bytes::from_static(b"{}")),
            })
            .await
            .expect("test step");
    }

    /// A drainer behind the writer sets the pace: with the drainer held in a drain (the log
    /// files locked, where it appends the drain's entries after its sled inserts), writers that
    /// would make about four times the backlog's keys are held once the changes gathering for
    /// the next drain pass it, instead of the changes piling up; let go, every write completes
    /// and reads back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_wait_for_a_drainer_that_is_behind() {
        let tmp = tempfile::tempdir().expect("test step");
        let store = Arc::new(
            SledStore::open(&tmp.path().join("s"), Default::default()).expect("test step"),
        );
        let (tasks, each) = (32, 300);
        // The log files held on a thread of their own until `release` is dropped.
        let (release, until) = std::sync::mpsc::channel::<()>();
        let (locked, is_locked) = std::sync::mpsc::channel::<()>();
        let holder = {
            let store = store.clone();
            std::thread::spawn(move || {
                let _held = store.shared.logfiles.lock().expect("test step");
                locked.send(()).expect("test step");
                let _ = until.recv();
            })
        };
        is_locked.recv().expect("test step");
        let writers: Vec<_> = (0..tasks)
            .map(|t| tokio::spawn(writes(store.clone(), format!("w{t}-"), each)))
            .collect();
        // Until the writes are held (a sync waited, and nothing moves since) or all done (not
        // held); a minute at most.
        let mut last = (usize::MAX, 0);
        for _ in 0..200 {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            let waiting = store
                .shared
                .mem
                .read()
                .map_or(0, |m| m.active.len() + m.frozen.len());
            let now = (waiting, store.batch_count() as usize);
            let waited = store.paced_count() + store.eased_count();
            let held_still = now == last && waited > 0;
            if held_still || writers.iter().all(|w| w.is_finished()) {
                break;
            }
            last = now;
        }
        let gathering = store.shared.mem.read().expect("test step").active.len();
        assert!(
            gathering <= BACKLOG_KEYS + 32 * 8,
            "{gathering} keys gathered behind a held drain"
        );
        assert!(store.paced_count() + store.eased_count() > 0);
        assert!(!writers.iter().all(|w| w.is_finished()), "writers held");
        drop(release);
        holder.join().expect("test step");
        for w in writers {
            w.await.expect("test step");
        }
        last_writes_read_back(&store, tasks, each).await;
        store.close().await.expect("test step");
    }

    /// A slow drainer sets the writer's pace a batch at a time: with sled slowed (the drainer
    /// sleeping as it yields), the changes not yet in sled stay within their bound (give or take
    /// a group of batches), no sync waits out a whole drain, and every write completes and reads
    /// back. Before, the writer ran ahead until the bound gathered behind the running drain, and
    /// then waited for all of it (100–500 ms under expiry's load, issue 59).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_drainer_paces_writes_a_batch_at_a_time() {
        let tmp = tempfile::tempdir().expect("test step");
        let store = Arc::new(
            SledStore::open(&tmp.path().join("s"), Default::default()).expect("test step"),
        );
        // About 600 µs of sled's time per change: 1,600 changes a second.
        store.shared.drain_pause.store(10_000, Ordering::Relaxed);
        let (tasks, each) = (64, 120);
        let writers: Vec<_> = (0..tasks)
            .map(|t| tokio::spawn(writes(store.clone(), format!("w{t}-"), each)))
            .collect();
        let mut most = 0;
        while !writers.iter().all(|w| w.is_finished()) {
            let waiting = store
                .shared
                .not_in_sled(&store.shared.mem.read().expect("test step"));
            most = most.max(waiting);
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        for w in writers {
            w.await.expect("test step");
        }
        assert!(store.eased_count() > 0, "the drainer never set the pace");
        assert_eq!(store.paced_count(), 0, "a sync waited out a whole drain");
        assert!(
            most <= BACKLOG_KEYS + 1024,
            "{most} changes waited for sled, over {BACKLOG_KEYS} and a group's"
        );
        last_writes_read_back(&store, tasks, each).await;
        store.shared.drain_pause.store(0, Ordering::Relaxed);
        store.close().await.expect("test step");
    }

    /// A batch's pointers go into their buckets as changes that read nothing, which the drainer
    /// makes into buckets: actions whose ids share a bucket, each in a batch of its own, are
    /// each found while only the durable changes waiting for sled have them, and never claimed
    /// again after the store is dropped without a close and opened again. (A replay of bucket
    /// changes: `a_replay_makes_each_bucket_of_its_changes_in_order`, and the SIGKILL tests.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn actions_sharing_a_bucket_are_found_before_sled_has_them_and_after_a_crash() {
        let tmp = tempfile::tempdir().expect("test step");
        let dir = tmp.path().join("s");
        let store = SledStore::open(&dir, Default::default()).expect("test step");
        let buckets = store.shared.buckets;
        let bucket = buckets.of_id(b"same-0");
        let ids: Vec<String> = (0..)
            .map(|i| format!("same-{i}"))
            .filter(|id| buckets.of_id(id.as_bytes()) == bucket)
            .take(5)
            .collect();
        for id in &ids {
            write(&store, id.clone()).await;
        }
        let waiting = |store: &SledStore| {
            let m = store.shared.mem.read().expect("test step");
            m.get(&buckets.key(&ids[0])).is_some()
        };
        assert!(waiting(&store), "the bucket waits for a drain");
        for id in &ids {
            let r = store.get(id).await.expect("test step").expect("found");
            assert_eq!(r.state, State::Succeeded, "{id}");
        }
        // A crash: nothing but the write-ahead log has the last of them.
        drop(store);
        let store = SledStore::open(&dir, Default::default()).expect("test step");
        for id in &ids {
            let again = claim(&store, id, now_millis()).await;
            assert!(matches!(again, Claim::Existing(_)), "{id}: {again:?}");
        }
        store.close().await.expect("test step");
    }

    /// A replayed frame's bucket changes are made of the bucket as sled holds it, or as a change
    /// before them in the same frame left it: none is lost, an id taken away is gone, and a
    /// bucket left empty is removed.
    #[test]
    fn a_replay_makes_each_bucket_of_its_changes_in_order() {
        let tmp = tempfile::tempdir().expect("test step");
        let db = sled_config(tmp.path()).open().expect("test step");
        let files = Mutex::new(
            LogFiles::open(
                &tmp.path().join("log"),
                crate::store::logfiles::SEGMENT_BYTES,
            )
            .expect("test step"),
        );
        let (k, emptied) = (b"p/\x00\x01".to_vec(), b"p/\x00\x02".to_vec());
        db.insert(&k, pointers::bucket_with(None, "held", 1))
            .expect("test step");
        db.insert(&emptied, pointers::bucket_with(None, "last", 2))
            .expect("test step");
        let change = |id: &str, at: Option<Millis>| {
            Change::Merge(k.clone(), pointers::change_value([(id, at)]))
        };
        let frame = [
            change("a", Some(3)),
            Change::Put(b"c/x".to_vec(), b"record".to_vec()),
            change("b", Some(4)),
            change("a", None),
            Change::Merge(emptied.clone(), pointers::change_value([("last", None)])),
        ];
        let applied: Vec<_> = frame
            .iter()
            .map(replayed)
            .collect::<Result<_, _>>()
            .expect("test step");
        apply_changes(&db, &files, applied.into_iter()).expect("test step");
        let find = |id: &str| pointers::in_sled(&db, &k, id).expect("test step");
        assert_eq!(
            [find("held"), find("a"), find("b")],
            [Some(1), None, Some(4)]
        );
        assert_eq!(db.get(&emptied).expect("test step"), None);
        assert_eq!(
            db.get(b"c/x").expect("test step").as_deref(),
            Some(&b"record"[..])
        );
        // A bucket's key with a put (or another key with a change) is of no form this version
        // writes: the replay stops instead of taking it for what it is not.
        let put = Change::Put(k.clone(), pointers::bucket_with(None, "x", 5));
        assert!(replayed(&put).is_err());
        assert!(replayed(&Change::Merge(b"c/x".to_vec(), vec![2])).is_err());
    }
}
