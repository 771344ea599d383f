//! Keys and indexes: what sled must find by key, and scans over the indexes.

use super::*;

/// `a/{id}`: where versions before found an action by id (its record's creation time, 8
/// bytes, big-endian; before that the whole creation key, or the record itself). Pointers are
/// kept in buckets now ([`super::pointers`]); opening a store moves these ([`migrate_indexes`]).
pub(super) fn rec_key(id: &str) -> Vec<u8> {
    joined(&[b"a/", id.as_bytes()])
}

/// A key of its parts, allocated once at its size: keys are made for every write, and
/// `format!` grows its string piece by piece through the formatter (measured in
/// docs/decisions.md, "Keys made without the formatter").
fn joined(parts: &[&[u8]]) -> Vec<u8> {
    let mut k = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
    for p in parts {
        k.extend_from_slice(p);
    }
    k
}

/// Where a record lives: its creation index key.
pub(super) fn record_key(r: &Record) -> Vec<u8> {
    created_key(r.created_at, &r.id)
}

/// The value of a record's `a/{id}` entry as versions before kept it: its creation time.
pub(super) fn pointer(r: &Record) -> [u8; 8] {
    r.created_at.to_be_bytes()
}

/// Whether an `a/{id}` value points at the record rather than being the record itself (JSON, as
/// versions before kept it). A pointer is [`pointer`], or, as written for a while, the whole
/// creation key.
pub(super) fn is_pointer(v: &[u8]) -> bool {
    v.len() == 8 || v.starts_with(CREATED_PREFIX)
}

/// Where an `a/{id}` value says the record of `id` is: `Some(key)` for a pointer.
fn pointed_at(id: &str, v: &[u8]) -> Option<Vec<u8>> {
    match <[u8; 8]>::try_from(v) {
        Ok(created) => Some(created_key(Millis::from_be_bytes(created), id)),
        Err(_) => is_pointer(v).then(|| v.to_vec()),
    }
}

/// Reads the record of `id`: its pointer through `pointer` (which reads it in the bucket it is
/// given), then the record the pointer names through `get`. `Some((key, value))`: the key the
/// value was read at. A pointer whose record is gone was read across a change (a reader is not
/// atomic over two keys): read again, once.
pub(super) fn read_record<V: AsRef<[u8]>>(
    id: &str,
    buckets: &Buckets,
    mut pointer: impl FnMut(&[u8], &str) -> Result<Option<Millis>, StoreError>,
    mut get: impl FnMut(&[u8]) -> Result<Option<V>, StoreError>,
) -> Result<Option<(Vec<u8>, V)>, StoreError> {
    let bucket = buckets.key(id);
    for _ in 0..2 {
        let Some(created) = pointer(&bucket, id)? else {
            return Ok(None);
        };
        let at = created_key(created, id);
        if let Some(r) = get(&at)?.filter(|r| !r.as_ref().is_empty()) {
            return Ok(Some((at, r)));
        }
    }
    Err(missing(id))
}

fn missing(id: &str) -> StoreError {
    StoreError::Corrupt {
        id: id.to_string(),
        reason: "its entry points at a record that is not there".into(),
    }
}

/// [`read_record`] in a store whose pointers versions before kept under `a/{id}` (while its
/// indexes are built at open, before they move into buckets): the `a/` entry, then, when that is
/// a pointer, the record it points at.
fn read_old_record(
    db: &sled::Db,
    buckets: &Buckets,
    id: &str,
) -> Result<Option<(Vec<u8>, sled::IVec)>, StoreError> {
    let get = |k: &[u8]| db.get(k).map_err(unavailable);
    let key = rec_key(id);
    for _ in 0..2 {
        let Some(v) = get(&key)? else {
            return read_record(id, buckets, |k, id| pointers::in_sled(db, k, id), get);
        };
        let Some(at) = pointed_at(id, v.as_ref()) else {
            return Ok(Some((key, v)));
        };
        if let Some(r) = get(&at)?.filter(|r| !r.is_empty()) {
            return Ok(Some((at, r)));
        }
    }
    Err(missing(id))
}

/// `r/{created_at:be64}{id}`: a record's stored response body (a small one, kept in sled) when
/// it does not fit in the record's own value ([`split_value`]), and every body of stores from
/// before; keyed like the record so that it too lands in the newest leaves; a reader of a body
/// holds its record, and so its key.
pub(super) fn body_key(r: &Record) -> Vec<u8> {
    timed_key(BODY_PREFIX, r.created_at, &r.id)
}
pub(super) const BODY_PREFIX: &[u8] = b"r/";
/// Where versions before bodies were keyed by creation kept them: `b/{id}` (moved at open).
const OLD_BODY_PREFIX: &[u8] = b"b/";
/// Whether the state index lists actions in `state`: every state but `succeeded`, the bulk of a
/// store, whose count is the rest of the creation index and which no scan looks up by state.
pub(super) fn state_indexed(state: State) -> bool {
    state != State::Succeeded
}

pub(super) fn state_key(state: State, id: &str) -> Vec<u8> {
    joined(&[b"s/", state.as_str().as_bytes(), b"/", id.as_bytes()])
}
pub(super) fn task_key(task: &str, id: &str) -> Vec<u8> {
    joined(&[b"t/", task.as_bytes(), b"\0", id.as_bytes()])
}

/// The expiry index: settled actions by when they expire. Each batch that gives records a new
/// expiry puts one entry for all of them, `e/{earliest:be64}{generation:be64}{offset:be64}` (the
/// earliest expiry among them, then where the batch's frame goes in the write-ahead log, which
/// no other batch shares), whose value lists them ([`encode_expiring`]): one sled
/// key a batch instead of one an action (measured in docs/decisions.md, "The expiry index, one
/// key a batch"). An entry is never taken out when its record changes: the sweeper reads the
/// record of each due action, and an action gone, or whose record now expires at another time,
/// is left out (its record, if any, is listed again where it now expires). Versions before
/// kept one entry an action, `e/{expires_at:be64}{id}` with an empty value (by minute before
/// that, rekeyed at open); the sweeper reads those too. Keyed by time, nearly every new entry
/// goes at the end, where sled's newest leaves are.
pub(super) const EXPIRY_PREFIX: &[u8] = b"e/";
/// Actions one step of expiry reads at most: the writer's pause between batches, so that a
/// write that arrives during a sweep waits for one step, not the sweep. A step of 256 took about
/// 3 ms of the writer's time (bench/results-soak.md), and with expiry in steady state the p99 of
/// a write's claim and settlement went from ≤ 3.2 to ≤ 6.4 ms; with 64 they stayed ≤ 3.2 ms
/// (bench/results-soak-expire-step.md). The sweep keeps its pace: each step is followed by a
/// pause of a few times what it took.
pub(super) const EXPIRE_STEP: usize = 64;

/// An action an expiry index entry lists: when it expires, and when its record was created,
/// which with its id names the key the record lives under ([`created_key`]), so that the sweeper
/// reads the record directly instead of through its pointer's bucket, a page of its own that is
/// rarely in sled's cache (bench/results-soak.md). `created` is `None` in entries of versions
/// before (forms without it), whose records are found through their pointers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Due {
    pub at: Millis,
    pub created: Option<Millis>,
    pub id: String,
}

/// Actions and when each expires, as an expiry index entry lists them.
pub(super) type Expiring = Vec<Due>;

/// The first byte of a batch's expiry entry ([`encode_expiring`]): its form's version. Form 1
/// listed each action's expiry and id; form 2 adds its record's creation time.
const EXPIRING_FORM: u8 = 2;
const EXPIRING_FORM_1: u8 = 1;

/// The key of a batch's expiry entry: by the earliest expiry it lists, then `tag` (where the
/// batch's frame goes in the write-ahead log: [`crate::store::wal::Wal::position`]).
fn expiring_key(earliest: Millis, tag: [u8; 16]) -> Vec<u8> {
    joined(&[EXPIRY_PREFIX, &earliest.to_be_bytes(), &tag])
}

/// The expiry index entry, key and value, of a batch that gives `actions` a new expiry (`None`
/// for none); `tag` says where its frame goes in the write-ahead log (public for the benches'
/// `sled alone` floor, which writes one for its writes too).
pub fn expiry_entry(actions: &[Due], tag: [u8; 16]) -> Option<(Vec<u8>, Vec<u8>)> {
    let earliest = actions.iter().map(|d| d.at).min()?;
    Some((expiring_key(earliest, tag), encode_expiring(actions)))
}

/// The value of a batch's expiry entry: the form's version, then each action's expiry (be64),
/// its record's creation time (be64; 0 for one not known, which no record has), id length (u16,
/// be) and id.
fn encode_expiring(actions: &[Due]) -> Vec<u8> {
    let size: usize = actions.iter().map(|d| 18 + d.id.len()).sum();
    let mut v = Vec::with_capacity(1 + size);
    v.push(EXPIRING_FORM);
    for d in actions {
        v.extend_from_slice(&d.at.to_be_bytes());
        push_timed(&mut v, d.created.unwrap_or(0), d.id.as_bytes());
    }
    v
}

/// What an expiry index entry lists: a batch's entry ([`expiry_entry`]) gives its tag and its
/// actions, each with when it expires; one action's entry as versions before kept it (an empty
/// value) gives no tag and that action.
pub(super) fn expiring(
    key: &[u8],
    value: &[u8],
) -> Result<(Option<[u8; 16]>, Expiring), StoreError> {
    let corrupt = |reason: &str| StoreError::Corrupt {
        id: String::from_utf8_lossy(key).into_owned(),
        reason: format!("expiry index entry: {reason}"),
    };
    let at = EXPIRY_PREFIX.len() + 8;
    if value.is_empty() {
        let when = key
            .get(EXPIRY_PREFIX.len()..at)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(Millis::from_be_bytes)
            .ok_or_else(|| corrupt("too short to say when"))?;
        let id = index_id(key, EXPIRY_PREFIX)?;
        return Ok((
            None,
            vec![Due {
                at: when,
                created: None,
                id,
            }],
        ));
    }
    let tag = key
        .get(at..)
        .and_then(|b| <[u8; 16]>::try_from(b).ok())
        .ok_or_else(|| corrupt("a batch's key without its tag"))?;
    let id = |id: &[u8]| String::from_utf8_lossy(id).into_owned();
    let out = match value.split_first() {
        Some((&EXPIRING_FORM_1, rest)) => timed(rest)
            .map(|e| {
                let (at, i, _) = e.map_err(corrupt)?;
                Ok(Due {
                    at,
                    created: None,
                    id: id(i),
                })
            })
            .collect::<Result<_, StoreError>>()?,
        Some((&EXPIRING_FORM, mut rest)) => {
            let mut out = Vec::new();
            while !rest.is_empty() {
                let (when, tail) = rest
                    .split_first_chunk::<8>()
                    .ok_or_else(|| corrupt("cut short"))?;
                let (created, i, range) = timed(tail)
                    .next()
                    .unwrap_or(Err("cut short"))
                    .map_err(corrupt)?;
                out.push(Due {
                    at: Millis::from_be_bytes(*when),
                    created: (created != 0).then_some(created),
                    id: id(i),
                });
                rest = &tail[range.end..];
            }
            out
        }
        _ => return Err(corrupt("of a form this version does not know")),
    };
    Ok((Some(tag), out))
}

pub(super) fn expiry_key(expires_at: Millis, id: &str) -> Vec<u8> {
    timed_key(EXPIRY_PREFIX, expires_at, id)
}

/// `{prefix}{at:be64}{id}`: the shape of the keys ordered by a time (records and their bodies by
/// creation, the expiry index by expiry), so that new ones go where the newest leaves are.
fn timed_key(prefix: &[u8], at: Millis, id: &str) -> Vec<u8> {
    joined(&[prefix, &at.to_be_bytes(), id.as_bytes()])
}

/// The action id of a key made by [`timed_key`] (`{prefix}{be64}{id}`).
pub(super) fn index_id(key: &[u8], prefix: &[u8]) -> Result<String, StoreError> {
    match key.get(prefix.len() + 8..) {
        Some(id) if !id.is_empty() => Ok(String::from_utf8_lossy(id).into_owned()),
        _ => Err(StoreError::Corrupt {
            id: String::from_utf8_lossy(key).into_owned(),
            reason: "an index key too short to name an action".into(),
        }),
    }
}

/// The expiry index's keys of actions due at `now`: up to and including it.
pub(super) fn expiry_end(now: Millis) -> Vec<u8> {
    timed_key(EXPIRY_PREFIX, now + 1, "")
}

/// The creation index: `c/{created_at:be64}{id}`, for listing newest first in pages.
pub(super) const CREATED_PREFIX: &[u8] = b"c/";
/// The first key after every creation index key.
pub(super) const CREATED_END: &[u8] = b"c0";

pub(super) fn created_key(created_at: Millis, id: &str) -> Vec<u8> {
    timed_key(CREATED_PREFIX, created_at, id)
}

/// `f/{sha256}/{id}`: the actions whose stored response is the body file `bodies/{sha256}`.
pub(super) fn file_key(sha: &str, id: &str) -> Vec<u8> {
    joined(&[b"f/", sha.as_bytes(), b"/", id.as_bytes()])
}

/// The body file a record's response is kept in, if any.
pub(super) fn body_file(r: &Record) -> Option<&str> {
    match r.response.as_ref().map(|s| &s.body) {
        Some(BodyRef::File { sha256 }) => Some(sha256),
        _ => None,
    }
}

/// A record's index entries with empty values: every key besides its record (under its creation
/// key), its pointer and its body that names it, but for its expiry, which its batch lists
/// ([`expiring_key`]).
pub(super) fn index_keys(r: &Record) -> impl Iterator<Item = Vec<u8>> + '_ {
    [
        state_indexed(r.state).then(|| state_key(r.state, &r.id)),
        r.task.as_ref().map(|t| task_key(t, &r.id)),
        body_file(r).map(|sha| file_key(sha, &r.id)),
    ]
    .into_iter()
    .flatten()
}

/// Every key the store writes for `r` with a small stored body: the record (its creation key,
/// whose value holds the body after the record) and the index entries, but for its pointer's
/// bucket ([`Buckets::key`]) and the expiry entry its batch shares (public for the benches' `sled
/// alone` floor, which writes the same keys).
pub fn action_keys(r: &Record) -> Vec<Vec<u8>> {
    let mut keys = vec![record_key(r)];
    keys.extend(index_keys(r));
    keys
}

/// The indexes a store opened by an earlier version may lack are built once; this key records it.
pub(super) const INDEXES_KEY: &[u8] = b"m/indexes";
pub(super) const INDEXES_VERSION: &[u8] = b"8";
/// The version before pointers moved into buckets: what is left to do is that move.
const BEFORE_BUCKETS: &[u8] = b"7";

/// Builds the expiry, creation and body-file indexes of a store from before them, from its
/// records (writing every index entry again is harmless), moves records kept under `a/{id}`
/// itself under their creation keys (and pointers kept as the whole creation key to the short
/// form), moves the bodies it keeps under `b/{id}` to their creation keys and keys its expiry
/// index by time instead of by minute; then moves the pointers under `a/{id}` into buckets
/// ([`pointers::move_to_buckets`]).
pub(super) fn migrate_indexes(db: &sled::Db, buckets: &Buckets) -> Result<(), String> {
    let marker = db.get(INDEXES_KEY).map_err(|e| e.to_string())?;
    let marker = marker.as_deref();
    if marker != Some(INDEXES_VERSION) && marker != Some(BEFORE_BUCKETS) {
        build_indexes(db, marker, buckets)?;
        db.insert(INDEXES_KEY, BEFORE_BUCKETS)
            .map_err(|e| e.to_string())?;
    }
    // Every open (a scan that finds nothing once they moved): an open that moved them and
    // crashed before its checkpoint replays the older frames again, `a/` keys included.
    let pointers = pointers::move_to_buckets(db, buckets)?;
    if marker != Some(INDEXES_VERSION) {
        db.insert(INDEXES_KEY, INDEXES_VERSION)
            .map_err(|e| e.to_string())?;
    }
    if pointers > 0 {
        tracing::info!(pointers, "store: moved pointers into buckets");
    }
    Ok(())
}

/// [`migrate_indexes`] up to the version before buckets, from the version `marker` names.
fn build_indexes(db: &sled::Db, marker: Option<&[u8]>, buckets: &Buckets) -> Result<(), String> {
    // A store of version 6 lacks only the move of records and pointers below: its open skips the
    // scans of the state, body and expiry indexes (the last reads every settled record).
    let only_records = marker == Some(b"6".as_slice());
    // Plain inserts, not a sled batch: one batch would put every later read in this process
    // behind sled's global lock. The marker goes last, so an interrupted build starts again.
    let mut n = 0;
    for kv in db.scan_prefix(b"a/") {
        let (k, v) = kv.map_err(|e| e.to_string())?;
        if v.len() == 8 {
            // A pointer as the version before buckets wrote it: its record has its indexes.
            continue;
        }
        if v.starts_with(CREATED_PREFIX) {
            // A pointer written as the whole creation key: the creation time alone.
            let created = v.get(CREATED_PREFIX.len()..CREATED_PREFIX.len() + 8);
            let created = created
                .ok_or_else(|| format!("{}: a pointer too short", String::from_utf8_lossy(&k)))?;
            db.insert(k, created).map_err(|e| e.to_string())?;
            continue;
        }
        // The record itself: its indexes, then the record under its creation key, then the
        // pointer (the writer writes a pointer only with a record's first version). Interrupted,
        // the build starts again from a record still readable under either key.
        let r = decode(&k, &v, None).map_err(|e| e.to_string())?;
        // Its expiry as one action's entry, the form the sweeper reads beside a batch's.
        for key in index_keys(&r).chain(r.expires_at.map(|e| expiry_key(e, &r.id))) {
            db.insert(key, &[]).map_err(|e| e.to_string())?;
        }
        db.insert(record_key(&r), v).map_err(|e| e.to_string())?;
        db.insert(k, &pointer(&r)).map_err(|e| e.to_string())?;
        n += 1;
    }
    let mut moved = 0;
    if !only_records {
        // The state index no longer lists `succeeded` actions.
        let prefix = format!("s/{}/", State::Succeeded.as_str());
        for k in db.scan_prefix(prefix.as_bytes()).keys() {
            db.remove(k.map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
        }
        moved = move_bodies(db, buckets)?;
        rekey_expiry(db, buckets)?;
    }
    if n > 0 {
        tracing::info!(actions = n, "store: built the expiry index");
    }
    if moved > 0 {
        tracing::info!(
            bodies = moved,
            "store: moved stored bodies under creation keys"
        );
    }
    Ok(())
}

/// The record of `id` as sled holds it, for the index builds at open (which read the plain
/// fields only, so no sealer).
fn stored_record(db: &sled::Db, buckets: &Buckets, id: &str) -> Result<Option<Record>, String> {
    match read_old_record(db, buckets, id) {
        Ok(Some((at, v))) => decode(&at, &v, None).map(Some).map_err(|e| e.to_string()),
        Ok(None) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// Puts each expiry index entry under the key its record's expiry now gives ([`expiry_key`]), from
/// the record rather than the old key, so an entry already moved (by a run interrupted before the
/// marker) stays as it is: the new key first, then the old one goes. An entry whose record is gone
/// or no longer expires goes.
fn rekey_expiry(db: &sled::Db, buckets: &Buckets) -> Result<(), String> {
    for kv in db.scan_prefix(EXPIRY_PREFIX) {
        let (k, v) = kv.map_err(|e| e.to_string())?;
        if !v.is_empty() {
            // A batch's entry: this version's form, already keyed by time.
            continue;
        }
        let id = index_id(&k, EXPIRY_PREFIX).map_err(|e| e.to_string())?;
        let due = stored_record(db, buckets, &id)?.and_then(|r| r.expires_at);
        let key = due.map(|e| expiry_key(e, &id));
        if key.as_deref() == Some(&k[..]) {
            continue;
        }
        if let Some(key) = key {
            db.insert(key, &[]).map_err(|e| e.to_string())?;
        }
        db.remove(k).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Moves each body under `b/{id}` to [`body_key`] of its record: the new key first, then the old
/// one goes, so an interrupted move starts again with nothing lost. A body whose record is gone
/// goes with nothing to move to.
fn move_bodies(db: &sled::Db, buckets: &Buckets) -> Result<usize, String> {
    let mut n = 0;
    for kv in db.scan_prefix(OLD_BODY_PREFIX) {
        let (k, body) = kv.map_err(|e| e.to_string())?;
        let id = String::from_utf8_lossy(&k[OLD_BODY_PREFIX.len()..]).into_owned();
        if let Some(r) = stored_record(db, buckets, &id)? {
            db.insert(body_key(&r), body).map_err(|e| e.to_string())?;
            n += 1;
        }
        db.remove(k).map_err(|e| e.to_string())?;
    }
    Ok(n)
}

pub(super) fn log_key(seq: u64) -> Vec<u8> {
    joined(&[b"l/", &seq.to_be_bytes()])
}

/// Records matching `filter`, from sled merged with `overlay` (the durable changes not yet in
/// sled, as a reader sees them): a reader never waits for the drainer. Index entries only
/// propose records: each record is read (overlay first) and matched again, so an index entry on
/// its way out or in never shows a record in a state it is not in.
pub(super) fn scan(
    db: &sled::Db,
    buckets: &Buckets,
    overlay: &Overlay,
    filter: &Filter,
    limit: usize,
    sealer: Option<&Sealer>,
) -> Result<Vec<Record>, StoreError> {
    let mut out = Vec::new();
    let record = |id: &str| -> Result<Option<Record>, StoreError> {
        read_record(
            id,
            buckets,
            |k, id| overlay.pointer(db, k, id),
            |k| overlay.get(db, k),
        )?
        .map(|(key, v)| decode(&key, &v, sealer))
        .transpose()
    };
    if filter.newest_first {
        // Streamed from the creation index, newest first, until the page is full: a page costs
        // what it shows (plus what the filter skips), not the whole store.
        let end = match &filter.before {
            Some((at, id)) => created_key(*at, id),
            None => CREATED_END.to_vec(),
        };
        let mut from_sled = db
            .range(CREATED_PREFIX.to_vec()..end.clone())
            .keys()
            .rev()
            .peekable();
        let mut from_mem = overlay
            .puts
            .range(CREATED_PREFIX.to_vec()..end)
            .map(|(k, _)| k.clone())
            .rev()
            .peekable();
        let mut last: Option<Vec<u8>> = None;
        while out.len() < limit {
            // The larger of the two heads, once (a key drained meanwhile is in both).
            let take_mem = match (from_sled.peek(), from_mem.peek()) {
                (None, None) => break,
                (Some(Err(_)), _) => false,
                (Some(Ok(a)), Some(b)) => b.as_slice() >= a.as_ref(),
                (None, Some(_)) => true,
                (Some(_), None) => false,
            };
            let k = if take_mem {
                from_mem.next().expect("peeked")
            } else {
                from_sled
                    .next()
                    .expect("peeked")
                    .map_err(unavailable)?
                    .to_vec()
            };
            if last.as_ref() == Some(&k) || overlay.dels.contains(&k) {
                continue;
            }
            last = Some(k.clone());
            let id = index_id(&k, CREATED_PREFIX)?;
            if let Some(r) = record(&id)? {
                if filter.matches(&r) {
                    out.push(r);
                }
            }
        }
        return Ok(out);
    }
    // `by_creation`: the keys name their action after a creation time.
    let (prefix, by_creation) = match (&filter.task, filter.state) {
        (Some(task), _) => (format!("t/{task}\0"), false),
        (None, Some(state)) if state_indexed(state) => (format!("s/{}/", state.as_str()), false),
        // Every action: the creation index.
        (None, _) => (String::from_utf8_lossy(CREATED_PREFIX).into_owned(), true),
    };
    let mut keys: std::collections::BTreeSet<Vec<u8>> = overlay
        .puts
        .range(prefix.as_bytes().to_vec()..)
        .take_while(|(k, _)| k.starts_with(prefix.as_bytes()))
        .map(|(k, _)| k.clone())
        .collect();
    for k in db.scan_prefix(prefix.as_bytes()).keys() {
        let k = k.map_err(unavailable)?.to_vec();
        if !overlay.dels.contains(&k) {
            keys.insert(k);
        }
    }
    for k in keys {
        let id = match by_creation {
            true => index_id(&k, CREATED_PREFIX)?,
            false => String::from_utf8_lossy(&k[prefix.len()..]).into_owned(),
        };
        if let Some(r) = record(&id)? {
            if filter.matches(&r) {
                out.push(r);
            }
        }
    }
    out.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
    out.truncate(limit);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys are the store's layout on disk: stores written by earlier versions are read by
    /// these same functions, so their bytes never change.
    #[test]
    fn keys_keep_their_layout() {
        assert_eq!(rec_key("ab12"), b"a/ab12");
        assert_eq!(state_key(State::Unknown, "ab12"), b"s/unknown/ab12");
        assert_eq!(task_key("t-1", "ab12"), b"t/t-1\0ab12");
        assert_eq!(file_key("ffee", "ab12"), b"f/ffee/ab12");
        assert_eq!(created_key(258, "ab12"), b"c/\0\0\0\0\0\0\x01\x02ab12");
        assert_eq!(expiry_key(1, "x"), b"e/\0\0\0\0\0\0\0\x01x");
        assert_eq!(
            expiring_key(1, [2; 16]),
            [&b"e/\0\0\0\0\0\0\0\x01"[..], &[2; 16]].concat()
        );
        assert_eq!(
            encode_expiring(&[Due {
                at: 1,
                created: Some(3),
                id: "ab".into()
            }]),
            b"\x02\0\0\0\0\0\0\0\x01\0\0\0\0\0\0\0\x03\0\x02ab"
        );
    }

    /// A batch's entry lists its actions back as written, with where each record lives (one
    /// not known reads as not known: the sweeper then finds it through its pointer); entries of
    /// the form before (no creation times) and one action's entry as versions before kept it
    /// read too; anything else is refused, not read as something else.
    #[test]
    fn expiry_entries_read_back_in_every_form() {
        let due = |at, created, id: &str| Due {
            at,
            created,
            id: id.to_string(),
        };
        let actions = vec![
            due(7, Some(2), "a1"),
            due(3, None, &"b".repeat(40)),
            due(9, Some(1), ""),
        ];
        let key = expiring_key(3, [5; 16]);
        let value = encode_expiring(&actions);
        let (tag, listed) = expiring(&key, &value).expect("a batch's entry reads");
        assert_eq!(listed, actions);
        assert_eq!(tag, Some([5; 16]));
        let form_1 = b"\x01\0\0\0\0\0\0\0\x07\0\x02a1";
        let (_, listed) = expiring(&key, form_1).expect("the form before reads");
        assert_eq!(listed, vec![due(7, None, "a1")]);
        let old = expiry_key(11, "c1");
        let (tag, listed) = expiring(&old, &[]).expect("an older entry reads");
        assert_eq!(listed, vec![due(11, None, "c1")]);
        assert_eq!(tag, None);
        assert!(expiring(&key, &value[..value.len() - 1]).is_err());
        assert!(expiring(&key, &value[..5]).is_err());
        assert!(expiring(&key, &form_1[..form_1.len() - 1]).is_err());
        assert!(expiring(&key, b"\x03").is_err());
        assert!(expiring(b"e/\0", &[]).is_err());
        assert!(expiring(&key[..key.len() - 1], &value).is_err());
    }
}
