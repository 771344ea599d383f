//! The embedded store knows its history (SPEC §13): its database, write-ahead log and write log
//! are one store's and agree on the last durable batch, or the store does not open.
//!
//! A new store draws an id, kept in the file [`ID_FILE`] and in the database ([`ID_KEY`]). Every
//! batch that appends to the write log also records the log's head in the database
//! ([`HEAD_KEY`]), in the same write-ahead-log frame. At open, after the write-ahead log is
//! replayed, the database must carry the folder's id and the write log must end exactly at the
//! database's head. So a database deleted, emptied or replaced by another store's (or by an
//! older copy), a write log cut short or deleted, or a missing id file, ends the process with a
//! message naming the part, instead of opening as an empty store that would send again every
//! write it had already sent.

use std::path::Path;

/// The store's id, beside its database.
pub const ID_FILE: &str = "store.id";
/// The store's id, in the database.
pub const ID_KEY: &[u8] = b"m/store_id";
/// The write log's head (`seq` as 8 bytes big-endian, then the entry's hash), in the database.
pub const HEAD_KEY: &[u8] = b"m/head";

/// The value of [`HEAD_KEY`] for a log whose newest entry is `seq`.
pub fn head_value(seq: u64, hash: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + hash.len());
    v.extend_from_slice(&seq.to_be_bytes());
    v.extend_from_slice(hash.as_bytes());
    v
}

fn head_seq(v: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(v.get(..8)?.try_into().ok()?))
}

/// What the open saw of the store's parts before its checks.
pub struct Seen {
    /// The database held no key before the write-ahead log was replayed into it.
    pub db_was_empty: bool,
    /// Frames the write-ahead log replayed.
    pub replayed: usize,
    /// The write log's newest entry (0: none ever, or none kept and no anchor).
    pub log_seq: u64,
    pub log_hash: String,
}

/// Why a store with history does not open: the part, and what to do.
fn refuse(dir: &Path, what: String) -> String {
    format!(
        "the store at {} is not whole: {what}. oncegate will not open it, since a store that \
         forgot its history would send again writes it has already sent. Stop every proxy using \
         it; restore the whole folder from a backup if you have one. Otherwise move the folder \
         aside (keep it: its write log is the record of what was sent), start with an empty \
         folder, and settle at the upstream by hand every write the old store held unsettled.",
        dir.display()
    )
}

/// Before sled opens: the database file gone while sled's snapshot (`snapshot`: a complete one
/// is in `dir`; a clean close leaves one) is still beside it. sled would only call the snapshot
/// corrupt; this names the part that is missing. (With no snapshot, sled opens an empty
/// database, which [`check`] refuses for a store with history.)
pub fn check_database_file(dir: &Path, snapshot: bool) -> Result<(), String> {
    if snapshot && !dir.join("db").exists() {
        return Err(refuse(
            dir,
            "the database (db) is missing, though sled's snapshot beside it says it held pages"
                .into(),
        ));
    }
    Ok(())
}

/// Checks the store's parts against each other, creating the id of a new store and adopting a
/// store made before ids (writing its id and head). Call after the write-ahead log's replay.
pub fn check(dir: &Path, db: &sled::Db, seen: &Seen) -> Result<(), String> {
    let io = |what: &str, e: &dyn std::fmt::Display| format!("{what}: {e}");
    let id_path = dir.join(ID_FILE);
    let file_id = match std::fs::read_to_string(&id_path) {
        Ok(s) => Some(s.trim().to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io(&format!("read {}", id_path.display()), &e)),
    };
    let db_id = db
        .get(ID_KEY)
        .map_err(|e| io("read the store id", &e))?
        .map(|v| String::from_utf8_lossy(&v).into_owned());
    let has_log = seen.log_seq > 0;
    // No write ever reached this store: a creation cut short by a crash is finished.
    let unused = !has_log && seen.replayed == 0;
    match (&file_id, &db_id) {
        (Some(f), Some(d)) if f == d => {}
        (Some(f), None) if unused && seen.db_was_empty => {
            return adopt(dir, db, f, seen, false);
        }
        (Some(f), Some(d)) => {
            return Err(refuse(
                dir,
                format!(
                    "the database (db) belongs to another store ({d}, not {f}): it was replaced"
                ),
            ))
        }
        (Some(_), None) => {
            return Err(refuse(
                dir,
                format!(
                    "the database (db) is missing, emptied or replaced: it does not carry the \
                     store's id, though {ID_FILE} and the write log (at entry {}) say the store \
                     has history",
                    seen.log_seq
                ),
            ))
        }
        (None, Some(d)) => {
            return Err(refuse(
                dir,
                format!("{ID_FILE} is missing: the database carries the store id {d}"),
            ))
        }
        (None, None) if seen.db_was_empty && (has_log || seen.replayed > 0) => {
            return Err(refuse(
                dir,
                format!(
                    "the database (db) is missing or empty, and {ID_FILE} too, while the write \
                     log reaches entry {} and the write-ahead log held {} batches",
                    seen.log_seq, seen.replayed
                ),
            ))
        }
        (None, None) => {
            // A new store, or one made before store ids (its database holds its records).
            let id = crate::identity::hex(&rand::random::<[u8; 16]>());
            return adopt(dir, db, &id, seen, true);
        }
    }
    let kept = db.get(HEAD_KEY).map_err(|e| io("read the log head", &e))?;
    let head = kept.as_deref().and_then(head_seq);
    // The same length is not the same log: the newest entry must be the one recorded.
    let kept_hash = kept
        .as_deref()
        .and_then(|v| v.get(8..))
        .map(|h| String::from_utf8_lossy(h).into_owned());
    match head {
        Some(h) if seen.log_seq == h && kept_hash.as_deref() != Some(seen.log_hash.as_str()) => {
            Err(refuse(
                dir,
                format!(
                    "the write log's entry {h} is not the one the database recorded: the log was rewritten"
                ),
            ))
        }
        Some(h) if seen.log_seq < h => Err(refuse(
            dir,
            format!(
                "the write log ends at entry {} but the database recorded entries up to {h}: the \
                 log was cut, torn below an acknowledged entry, or deleted",
                seen.log_seq
            ),
        )),
        Some(h) if seen.log_seq > h => Err(refuse(
            dir,
            format!(
                "the database recorded the write log up to entry {h} but the log reaches {}: \
                 the database is older than its log (restored from an older copy?)",
                seen.log_seq
            ),
        )),
        Some(_) => Ok(()),
        None => Err(refuse(
            dir,
            "the database carries the store id but no write log head".into(),
        )),
    }
}

/// The write log's head the database holds (`None`: none, a new store or one from before ids).
pub fn kept_head(db: &sled::Db) -> Result<Option<u64>, sled::Error> {
    Ok(db.get(HEAD_KEY)?.as_deref().and_then(head_seq))
}

/// Whether the write-ahead log, whose first frame that appends to the write log starts at entry
/// `first`, takes up where a database holding `kept` left off. Checked before that frame is
/// replayed, so a database refused here is left as it was found.
pub fn wal_follows(dir: &Path, kept: Option<u64>, first: u64) -> Result<(), String> {
    match kept {
        Some(h) if first > h + 1 => Err(refuse(
            dir,
            format!(
                "the database (db) recorded the write log up to entry {h}, but the write-ahead log takes up at entry {first}: the database is older than its write-ahead log (an older copy put back?), and the changes between them are in neither"
            ),
        )),
        _ => Ok(()),
    }
}

/// Gives the store `id` (in the database, then, with `file`, in the id file) and records the
/// write log's head in the database.
fn adopt(dir: &Path, db: &sled::Db, id: &str, seen: &Seen, file: bool) -> Result<(), String> {
    let io = |what: &str, e: &dyn std::fmt::Display| format!("{what}: {e}");
    // The file first: a creation cut short by a crash then leaves a file and no id in the
    // database (finished at the next open), never the reverse, which is what a folder that lost
    // its id file looks like.
    if file {
        write_id(dir, id)?;
    }
    db.insert(ID_KEY, id.as_bytes())
        .map_err(|e| io("write the store id", &e))?;
    db.insert(HEAD_KEY, head_value(seen.log_seq, &seen.log_hash))
        .map_err(|e| io("write the log head", &e))?;
    db.flush().map_err(|e| io("flush the store id", &e))?;
    if !seen.db_was_empty {
        tracing::info!(store = %id, "store: gave a store from before store ids its id");
    }
    Ok(())
}

/// Writes the id file: write, fsync, rename, fsync the folder.
fn write_id(dir: &Path, id: &str) -> Result<(), String> {
    let tmp = dir.join(format!(".{ID_FILE}.tmp"));
    let path = dir.join(ID_FILE);
    super::files::write_whole(&tmp, &path, format!("{id}\n").as_bytes())
        .map_err(|e| format!("write {}: {e}", path.display()))
}

/// Whether the store's folder is still there (its id file): a folder removed under a running
/// proxy takes no further writes (SPEC §10.2).
pub fn present(dir: &Path) -> bool {
    dir.join(ID_FILE).exists()
}
