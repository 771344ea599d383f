//! The PostgreSQL store knows its past (SPEC §13, history). The database holds the store's id,
//! its write log's head and the count of its actions (kept by every transaction); each proxy
//! keeps, in a file of its own, the last head it saw of each database it used. At start, a log
//! cut at its tail, an actions table that does not add up to its counts, a database that is not
//! the store this proxy saw (dropped and made again) or whose log is behind what this proxy saw
//! (restored from an older backup), ends the process (exit 74) naming the part, rather than
//! letting the proxy answer from a past that was cut away: a write that succeeded, sent again.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::Digest;

use super::{db, pool_err, unavailable, Head, PostgresStore, StoreError};

/// What to do about a store that does not add up.
const RESTORE: &str = "restore the database from a backup (or, to start over on purpose, drop the oncegate_* tables and delete this proxy's seen-head files), then start again";

/// The last head a proxy saw of one database.
#[derive(Serialize, Deserialize, PartialEq, Debug)]
pub(super) struct Seen {
    store: String,
    seq: i64,
    hash: String,
}

/// This proxy's file for the database `cfg` names, in `dir`: one per database, named by a hash
/// of its hosts, port, name and user (never its password), so that a proxy moved to another
/// database keeps what it saw of each.
pub(super) fn seen_file(dir: &Path, cfg: &tokio_postgres::Config) -> PathBuf {
    let hosts: Vec<String> = cfg
        .get_hosts()
        .iter()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
        })
        .collect();
    let which = format!(
        "{}|{:?}|{}|{}",
        hosts.join(","),
        cfg.get_ports(),
        cfg.get_dbname().unwrap_or(""),
        cfg.get_user().unwrap_or("")
    );
    let h = sha2::Sha256::digest(which.as_bytes());
    dir.join(format!("postgres-seen-{}.json", &hex::encode(h)[..16]))
}

/// Writes `head` of store `store` as what this proxy saw, durably (a new file, synced, renamed
/// over the old one).
pub(super) fn save_seen(file: &Path, store: &str, head: &Head) -> std::io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let seen = Seen {
        store: store.to_string(),
        seq: head.0,
        hash: head.1.clone(),
    };
    // Named for this write alone: proxies sharing the folder, or this one's periodic record
    // and its close, may write at the same moment.
    let tmp = file.with_extension(format!("{:x}.tmp", rand_id()));
    let bytes = serde_json::to_vec(&seen).expect("serializes");
    crate::store::files::write_whole(&tmp, file, &bytes)
}

/// What this proxy last saw of the database, from `file` (`None`: nothing yet). Read before the
/// database's head is: proxies sharing a folder share the file, and another may record a head
/// it committed at any moment; read first, whatever the file says was committed before the
/// database's head was read, so that a whole database is never behind it.
pub(super) fn read_seen(file: &Path) -> Result<Option<Seen>, StoreError> {
    let where_ = file.display();
    match std::fs::read(file) {
        Ok(b) => Ok(Some(serde_json::from_slice(&b).map_err(|e| {
            unavailable(format!(
                "store.path: {where_} (the last write-log head this proxy saw) does not parse: {e}"
            ))
        })?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(unavailable(format!("store.path: read {where_}: {e}"))),
    }
}

impl PostgresStore {
    /// The store's id: drawn by the first proxy that opens the database, kept in it.
    pub(super) async fn store_id(&self) -> Result<String, StoreError> {
        let c = self.pool.get().await.map_err(pool_err)?;
        let drawn = format!("{:032x}", rand_id());
        c.execute(
            "INSERT INTO oncegate_meta (key, value) VALUES ('store_id', $1) ON CONFLICT (key) DO NOTHING",
            &[&drawn.as_bytes()],
        )
        .await
        .map_err(db)?;
        let v: Vec<u8> = c
            .query_one(
                "SELECT value FROM oncegate_meta WHERE key = 'store_id'",
                &[],
            )
            .await
            .map_err(db)?
            .get(0);
        Ok(String::from_utf8_lossy(&v).into_owned())
    }

    /// The store's secret ([`crate::store::secret`]): read, or made by the first proxy that
    /// opens a database with no history (no write-log entry, no action). A database with history
    /// and no secret was made before stores had one: unkeyed.
    pub(super) async fn secret(&self) -> Result<crate::identity::Keyer, StoreError> {
        let c = self.pool.get().await.map_err(pool_err)?;
        let made =
            crate::store::secret::stored(&crate::store::secret::draw(), self.sealer.as_deref());
        c.execute(
            "INSERT INTO oncegate_meta (key, value)
             SELECT 'secret', $1
             WHERE (SELECT seq FROM oncegate_log_head WHERE id = 1) = 0
               AND NOT EXISTS (SELECT 1 FROM oncegate_actions)
             ON CONFLICT (key) DO NOTHING",
            &[&made],
        )
        .await
        .map_err(db)?;
        let v: Option<Vec<u8>> = c
            .query_opt("SELECT value FROM oncegate_meta WHERE key = 'secret'", &[])
            .await
            .map_err(db)?
            .map(|r| r.get(0));
        crate::store::secret::keyer(v.as_deref(), self.sealer.as_deref())
            .map_err(|e| unavailable(format!("the database's store secret: {e}")))
    }

    /// Compares the database (store `id`, at `head`) with `seen`, what this proxy last saw of it
    /// in `file` ([`read_seen`], read before `head` was), then records `head` there as seen.
    pub(super) async fn check_seen(
        &self,
        file: &Path,
        seen: Option<Seen>,
        id: &str,
        head: &Head,
    ) -> Result<(), StoreError> {
        let where_ = file.display();
        if let Some(seen) = seen {
            if seen.store != id {
                return Err(unavailable(format!(
                    "the database is not the store this proxy used: it saw store {} (write log at entry {}), the database now holds store {id}, made since (dropped and made again?). If this proxy was moved to another database on purpose, delete {where_}; otherwise {RESTORE}",
                    seen.store, seen.seq
                )));
            }
            if head.0 < seen.seq {
                return Err(unavailable(format!(
                    "the write log (table oncegate_log_head) is at entry {} but this proxy saw it at entry {} ({where_}): the database is older than what this proxy saw (restored from an older backup?); {RESTORE}",
                    head.0, seen.seq
                )));
            }
            let c = self.pool.get().await.map_err(pool_err)?;
            let then = c
                .query_opt(
                    "SELECT entry FROM oncegate_log WHERE seq = $1",
                    &[&seen.seq],
                )
                .await
                .map_err(db)?;
            // Pruned by log.retention: nothing to compare.
            if let Some(row) = then {
                let entry: crate::log::Entry =
                    serde_json::from_str(row.get(0)).map_err(|e| StoreError::Corrupt {
                        id: "write log entry".into(),
                        reason: e.to_string(),
                    })?;
                if entry.hash != seen.hash {
                    return Err(unavailable(format!(
                        "the write log's entry {} (table oncegate_log) is not the one this proxy saw ({where_}): its history was rewritten; {RESTORE}",
                        seen.seq
                    )));
                }
            }
        }
        save_seen(file, id, head)
            .map_err(|e| unavailable(format!("store.path: write {where_}: {e}")))
    }
}

/// A random 128-bit id.
fn rand_id() -> u128 {
    let mut b = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b)
        .expect("the system's random source");
    u128::from_be_bytes(b)
}

impl PostgresStore {
    /// The database knows its own past (SPEC §13 history): a write log that ends before its
    /// head (entries removed from its tail), or an actions table whose rows do not add up to the
    /// counts every transaction kept (rows removed or added outside oncegate: an emptied or
    /// truncated table), stops the proxy (exit 74) rather than letting it answer from a past
    /// that was cut away (a write that succeeded, sent again). Read in one snapshot, so that
    /// proxies committing meanwhile agree with it; the count is one scan of the table a start.
    pub(super) async fn check_history(&self) -> Result<Head, StoreError> {
        let c = self.pool.get().await.map_err(pool_err)?;
        let row = c
            .query_one(
                "SELECT h.seq, h.hash,
                        (SELECT max(seq) FROM oncegate_log),
                        (SELECT count(*) FROM oncegate_actions),
                        (SELECT COALESCE(sum(n), 0)::bigint FROM oncegate_counts)
                 FROM oncegate_log_head h WHERE h.id = 1",
                &[],
            )
            .await
            .map_err(db)?;
        let (head, hash, last, held, counted): (i64, String, Option<i64>, i64, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        let restore = RESTORE;
        if head > 0 && last.unwrap_or(0) < head {
            return Err(unavailable(format!(
                "the write log (table oncegate_log) ends at entry {} but its head is entry {head}: entries were removed from its tail; {restore}",
                last.unwrap_or(0)
            )));
        }
        if held != counted {
            return Err(unavailable(format!(
                "the actions table (oncegate_actions) holds {held} actions but the store's counts (oncegate_counts) say {counted}: rows were removed or added outside oncegate (an emptied or truncated table); {restore}"
            )));
        }
        Ok((head, hash))
    }

    /// A database written with a key opens only with that key (see the sled store's check).
    pub(super) async fn check_key(&self) -> Result<(), StoreError> {
        let c = self.pool.get().await.map_err(pool_err)?;
        let stored: Option<Vec<u8>> = c
            .query_opt(
                "SELECT value FROM oncegate_meta WHERE key = 'key_check'",
                &[],
            )
            .await
            .map_err(db)?
            .map(|r| r.get(0));
        match (stored, self.sealer.as_deref()) {
            (None, None) => Ok(()),
            (Some(_), None) => Err(unavailable(
                "the store is encrypted, but no key is configured: set store.encrypt_key_env and the variable it names to the store's key",
            )),
            (Some(v), Some(s)) if s.matches(&v) => Ok(()),
            (Some(_), Some(_)) => Err(unavailable(
                "the key in store.encrypt_key_env is not the key this store was encrypted with",
            )),
            (None, Some(s)) => {
                c.execute(
                    "INSERT INTO oncegate_meta (key, value) VALUES ('key_check', $1) ON CONFLICT (key) DO NOTHING",
                    &[&s.check_value()],
                )
                .await
                .map_err(db)?;
                // Another proxy may have written its own check first: it must be this key's.
                let v: Vec<u8> = c
                    .query_one("SELECT value FROM oncegate_meta WHERE key = 'key_check'", &[])
                    .await
                    .map_err(db)?
                    .get(0);
                if s.matches(&v) {
                    Ok(())
                } else {
                    Err(unavailable("the key in store.encrypt_key_env is not the key this store was encrypted with"))
                }
            }
        }
    }
}
