//! Checkpoints: sled made durable on its own, so that write-ahead log files can go.

use super::*;

/// sled's flush, then what its flush leaves out: its blob files and an fdatasync of its log file
/// (sled's flush ends in `sync_file_range`, which does not survive a power loss; SPEC §13).
///
/// sled writes a value too large for its log into a separate blob file, and its flush does not
/// fsync those. Every blob file not seen before is fsynced (with the folder) before the log's
/// fdatasync, so the log never points at a blob a power loss could take. Normally there are
/// none: this is one `readdir`.
pub(super) fn sled_durable(
    db: &sled::Db,
    dir: &Path,
    seen: &mut HashSet<std::ffi::OsString>,
    log: &File,
) -> Result<(), String> {
    db.flush().map_err(|e| format!("sled flush: {e}"))?;
    release_sealed_buffers();
    let blobs = dir.join("blobs");
    if let Ok(entries) = std::fs::read_dir(&blobs) {
        let mut present = HashSet::default();
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

/// Lets go of the I/O buffer a flush sealed.
///
/// sled 0.34's flush seals its current I/O buffer (a whole segment, 8 MiB) and hands the old one
/// to crossbeam-epoch's deferred destruction, in the flushing thread's local bag, which goes to
/// be freed only once it holds 64 items. A thread that does little else but flush (the
/// checkpointer) kept one segment buffer per checkpoint alive that way: the proxy's memory grew
/// with the number of checkpoints (336 MiB with 4 MiB checkpoints, 110 MiB with the default).
/// Flushing the bag hands them to the global queue at once, from which any thread frees them.
/// sled re-exports crossbeam-epoch's `pin` (the same instance it defers into).
fn release_sealed_buffers() {
    sled::crossbeam_pin().flush();
}

/// The checkpoint thread's queue and handle.
pub(super) type Checkpointer = (mpsc::Sender<Rotated>, std::thread::JoinHandle<()>);

/// A log file the writer is done with, as it started the next.
pub(super) struct Rotated {
    /// The file's generation, and the last batch in it.
    pub(super) generation: u64,
    pub(super) seq: u64,
    /// The filter of held ids as the writer left it then, and the write log's head and the
    /// counts by state it is bound to.
    pub(super) ids: ids::Snapshot,
    pub(super) head: (u64, String),
    pub(super) counts: Counts,
}

/// Lets log files go once sled holds their frames durably: waits until the drainer has applied
/// the file's last batch, then flushes and fsyncs sled (the checkpoint), saves the filter of
/// held ids as the writer left it at the file's end (an open after a crash then loads it and
/// adds the ids of the frames it replays, instead of reading every pointer in sled: `ids/saved.rs`),
/// and deletes the files, keeping the newest as the spare a later file starts in
/// ([`wal::recycle_through`]). A filter that cannot be saved costs the next open after a crash
/// its time, never an id: the file left from before no longer holds every id once these files
/// go, and that open reads the ids from sled.
pub(super) fn checkpoint_loop(
    db: &sled::Db,
    dir: &Path,
    shared: &Shared,
    rx: mpsc::Receiver<Rotated>,
) -> Result<(), String> {
    let log = File::open(dir.join("db")).map_err(|e| format!("open sled log file: {e}"))?;
    let mut blobs = HashSet::default();
    while let Ok(r) = rx.recv() {
        shared.wait_applied(r.seq)?;
        sled_durable(db, dir, &mut blobs, &log)?;
        shared.logfiles().map_err(|e| e.to_string())?.sync()?;
        if !r.ids.is_empty() {
            let saved = ids::Binding::of(db, r.head, r.counts).and_then(|b| r.ids.save(dir, &b));
            if let Err(e) = saved {
                tracing::warn!(error = %e, "store: could not save the filter of action ids; a start after a crash reads them from sled");
            }
        }
        wal::recycle_through(&dir.join("wal"), r.generation)?;
    }
    Ok(())
}

/// Leaves sled a snapshot of everything it logged, once nothing else holds it (a clean close).
///
/// sled 0.34 writes its snapshot (where each page's newest fragments are in its log) only as it
/// opens: from the snapshot before, by reading everything it logged since (its
/// `snapshot_after_ops` does nothing). So each open read all that sled logged since the open
/// before it: 1.3 s after a million writes, 0.2 s with the snapshot this leaves
/// (docs/decisions.md, "sled's snapshot left at a clean close"). Opening sled once more here
/// moves that reading to the close, where no client waits for readiness; sled writes the
/// snapshot aside, fsyncs it and renames it over the old one, as at any open. sled creates it
/// with the process's umask, so the folder's modes are narrowed after, as the open narrows them
/// (SPEC §13: the owner's alone), and the folder fsynced. A crash leaves it to the next open, as
/// before.
pub(super) fn leave_snapshot(dir: &Path) -> Result<(), String> {
    drop(
        sled_config(dir)
            .open()
            .map_err(|e| format!("reopen sled: {e}"))?,
    );
    files::restrict(dir).map_err(|e| format!("narrow {}: {e}", dir.display()))?;
    fsync_dir(dir).map_err(|e| format!("fsync {}: {e}", dir.display()))
}
