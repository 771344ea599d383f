//! Pointers: where the record of an action is found by its id.
//!
//! `p/{bucket:be16}`: the pointers of the actions whose ids fall in one of 65,536 buckets
//! ([`Buckets`]), each an id with its record's creation time, which with the id names the key
//! the record lives under (`c/{created_at:be64}{id}`). One key an action (`a/{id}`, as versions
//! before kept them) put every new action into a random leaf of a tree as large as the store,
//! and sled keeps state for every page it has held (about 240 bytes a page, a leaf of some 12
//! pointers): with the store's size that tree came to most of the proxy's growth in memory and
//! a fifth of a write's CPU (docs/decisions.md, "Pointers in buckets"). Buckets are a fixed
//! number of keys whatever the store's size (about 5,500 leaves); the price is that a new action
//! rewrites its bucket (about 250 bytes with 380,000 actions stored, growing with the store).
//! The writer does not read it to do so: a batch logs a change of each bucket it touches
//! ([`change_value`], a `Change::Merge` in its frame). The changes wait for sled with the
//! batch's other durable changes, a bucket's joined into one ([`join`]), where readers ask them
//! first ([`change_of`]); the drainer makes the bucket of them and sled's copy ([`changed`]),
//! once a drain, off the request's path. A replay makes it the same way, a change at a time.
//! Opening a store moves the pointers of versions before into buckets ([`move_to_buckets`]).

use super::*;

pub(super) const POINTERS_PREFIX: &[u8] = b"p/";
/// The first byte of a bucket's value: its form's version.
const BUCKET_FORM: u8 = 1;

/// Where the store keeps the secret its buckets are drawn with ([`Buckets`]).
pub const BUCKETS_KEY: &[u8] = b"m/buckets";
/// The first byte of [`BUCKETS_KEY`]'s value: its form's version.
const SALT_FORM: u8 = 1;

/// Which bucket an id's pointer goes in: the first two bytes of SHA-256 over a secret the store
/// draws once (kept under [`BUCKETS_KEY`]) and the id. Not the id's own first digits: a client
/// chooses its idempotency keys, and at 65,536 SHA-256s a hit it could grind ids that all fall in
/// one bucket, which every new action then rewrites whole (a million of the benches' ids, made
/// from counters, fell in one bucket that way). The secret is on disk and in backups with the
/// buckets it placed; it never leaves the store.
#[derive(Clone, Copy)]
pub struct Buckets {
    salt: [u8; 16],
}

impl std::fmt::Debug for Buckets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Buckets(..)")
    }
}

impl Buckets {
    /// Buckets drawn with `salt` (for the benches' `sled alone` floor and tests).
    pub fn new(salt: [u8; 16]) -> Buckets {
        Buckets { salt }
    }

    /// The buckets of the store whose database is `db`, as it saved them; `None` in a store that
    /// has not placed a pointer in a bucket yet (for tools and tests that read a closed store).
    pub fn of(db: &sled::Db) -> Result<Option<Buckets>, String> {
        let Some(v) = db.get(BUCKETS_KEY).map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        match v.split_first() {
            Some((&SALT_FORM, salt)) => salt
                .try_into()
                .map(|salt| Some(Buckets { salt }))
                .map_err(|_| "m/buckets: cut short".to_string()),
            _ => Err("m/buckets: of a form this version does not know".into()),
        }
    }

    /// The store's buckets, drawn and made durable at its first open under this version (before
    /// any pointer goes in one: a pointer placed with a secret a crash then lost would not be
    /// found again).
    pub(super) fn open(db: &sled::Db) -> Result<Buckets, String> {
        if let Some(b) = Buckets::of(db)? {
            return Ok(b);
        }
        let b = Buckets::new(rand::random());
        db.insert(BUCKETS_KEY, [&[SALT_FORM][..], &b.salt].concat())
            .map_err(|e| e.to_string())?;
        db.flush().map_err(|e| e.to_string())?;
        Ok(b)
    }

    /// The bucket of `id`.
    pub(super) fn of_id(&self, id: &[u8]) -> u16 {
        use sha2::Digest;
        let d = sha2::Sha256::new()
            .chain_update(self.salt)
            .chain_update(id)
            .finalize();
        u16::from_be_bytes([d[0], d[1]])
    }

    /// The key of the bucket `id` falls in.
    pub fn key(&self, id: &str) -> Vec<u8> {
        bucket_key_of(self.of_id(id.as_bytes()))
    }
}

pub(super) fn bucket_key_of(bucket: u16) -> Vec<u8> {
    [POINTERS_PREFIX, &bucket.to_be_bytes()].concat()
}

/// A value listing actions, each with a time: a bucket's (when each record was created) and an
/// expiry index entry's (when each expires). After the form's byte, each action's time (be64),
/// id length (u16, be) and id.
pub(super) fn push_timed(v: &mut Vec<u8>, at: Millis, id: &[u8]) {
    v.extend_from_slice(&at.to_be_bytes());
    // Ids are a few dozen bytes (action ids 32); one too long for the length is cut, and never
    // matches its action.
    let id = &id[..id.len().min(usize::from(u16::MAX))];
    v.extend_from_slice(&(id.len() as u16).to_be_bytes());
    v.extend_from_slice(id);
}

/// The actions a value of [`push_timed`]'s entries lists (after its form's byte), each with its
/// time and where its entry ends in `rest`'s bytes; an entry cut short ends it with an error.
pub(super) fn timed(
    rest: &[u8],
) -> impl Iterator<Item = Result<(Millis, &[u8], std::ops::Range<usize>), &'static str>> {
    let mut at = 0;
    std::iter::from_fn(move || {
        let tail = rest.get(at..).filter(|t| !t.is_empty())?;
        let Some((head, tail)) = tail.split_at_checked(10) else {
            at = rest.len();
            return Some(Err("cut short"));
        };
        let when = Millis::from_be_bytes(head[..8].try_into().unwrap_or_default());
        let len = usize::from(u16::from_be_bytes([head[8], head[9]]));
        let Some(id) = tail.get(..len) else {
            at = rest.len();
            return Some(Err("cut short"));
        };
        let start = at;
        at += 10 + len;
        Some(Ok((when, id, start..at)))
    })
}

fn corrupt(key: &[u8], reason: &str) -> StoreError {
    StoreError::Corrupt {
        id: String::from_utf8_lossy(key).into_owned(),
        reason: format!("pointer bucket: {reason}"),
    }
}

/// An entry of a bucket: its record's creation time, its id and where it is in the value.
type Entry<'a> = Result<(Millis, &'a [u8], std::ops::Range<usize>), StoreError>;

/// The entries of a bucket's value (read under `key`, named in an error).
fn entries<'a>(
    key: &'a [u8],
    value: &'a [u8],
) -> Result<impl Iterator<Item = Entry<'a>>, StoreError> {
    let Some((&BUCKET_FORM, rest)) = value.split_first() else {
        return Err(corrupt(key, "of a form this version does not know"));
    };
    Ok(timed(rest).map(move |e| {
        e.map(|(at, id, r)| (at, id, r.start + 1..r.end + 1))
            .map_err(|why| corrupt(key, why))
    }))
}

/// When the record of `id` was created, as its bucket (`value`, read under `key`) says.
pub(super) fn find(key: &[u8], value: &[u8], id: &str) -> Result<Option<Millis>, StoreError> {
    for e in entries(key, value)? {
        let (at, listed, _) = e?;
        if listed == id.as_bytes() {
            return Ok(Some(at));
        }
    }
    Ok(None)
}

/// The first byte of a bucket change's value (the value of a [`Change::Merge`] of a bucket):
/// its form's version.
const CHANGES_FORM: u8 = 2;
/// The time of a change's entry that takes its id's pointer away.
const GONE: Millis = Millis::MAX;

/// The value of a change to one bucket: the pointers a batch gives (an id with its record's
/// creation time) or takes away (`None`), in order. The writer sends it instead of the bucket
/// it would have to read first; the bucket is made of it where the change is kept until sled
/// has it ([`changed`]).
pub(super) fn change_value<'a>(
    changes: impl IntoIterator<Item = (&'a str, Option<Millis>)>,
) -> Vec<u8> {
    let mut v = vec![CHANGES_FORM];
    for (id, created) in changes {
        push_timed(&mut v, created.unwrap_or(GONE), id.as_bytes());
    }
    v
}

/// An entry of a bucket change: an id and its record's creation time (`None`: taken away).
type ChangeEntry<'a> = Result<(&'a [u8], Option<Millis>), StoreError>;

/// The entries of a bucket change's value, the last entry of an id the one that counts.
fn change_entries<'a>(
    key: &'a [u8],
    value: &'a [u8],
) -> Result<impl Iterator<Item = ChangeEntry<'a>>, StoreError> {
    let Some((&CHANGES_FORM, rest)) = value.split_first() else {
        return Err(corrupt(
            key,
            "a change of a form this version does not know",
        ));
    };
    Ok(timed(rest).map(move |e| {
        e.map(|(at, id, _)| (id, (at != GONE).then_some(at)))
            .map_err(|why| corrupt(key, why))
    }))
}

/// The bucket `old` (`None`: none yet) with the change `change` ([`change_value`]) made: each
/// id it names points where its last entry there says, or nowhere; `None` when nothing is left
/// in it (its key goes).
pub(super) fn changed(
    key: &[u8],
    old: Option<&[u8]>,
    change: &[u8],
) -> Result<Option<Vec<u8>>, StoreError> {
    let mut last: HashMap<&[u8], Option<Millis>> = HashMap::default();
    let mut order = Vec::new();
    for e in change_entries(key, change)? {
        let (id, at) = e?;
        if last.insert(id, at).is_none() {
            order.push(id);
        }
    }
    let old = old.unwrap_or(&[BUCKET_FORM]);
    let mut out = Vec::with_capacity(old.len() + change.len());
    out.push(BUCKET_FORM);
    for e in entries(key, old)? {
        let (_, id, r) = e?;
        if !last.contains_key(id) {
            out.extend_from_slice(&old[r]);
        }
    }
    for id in order {
        if let Some(at) = last[id] {
            push_timed(&mut out, at, id);
        }
    }
    Ok((out.len() > 1).then_some(out))
}

/// `change` with the change `later` after it (their entries in order: an id's last entry
/// counts). Both are the writer's own ([`change_value`]); a change of another form is refused
/// when it is made into a bucket ([`changed`]).
pub(super) fn join(change: &mut Vec<u8>, later: &[u8]) {
    change.extend_from_slice(later.get(1..).unwrap_or_default());
}

/// What the change `change` (of the bucket `key`) says of the pointer of `id`: given (the
/// creation time of its record), taken away (`Some(None)`), or nothing (`None`).
pub(super) fn change_of(
    key: &[u8],
    change: &[u8],
    id: &str,
) -> Result<Option<Option<Millis>>, StoreError> {
    let mut said = None;
    for e in change_entries(key, change)? {
        let (listed, at) = e?;
        if listed == id.as_bytes() {
            said = Some(at);
        }
    }
    Ok(said)
}

/// Whether `key` is a bucket's: the durable changes waiting for sled keep a change of it, not
/// the bucket ([`change_value`]), which the drainer makes into the bucket ([`changed`]).
pub(super) fn is_bucket(key: &[u8]) -> bool {
    key.starts_with(POINTERS_PREFIX)
}

/// When the record of `id` was created, as sled's copy of its bucket `key` says.
pub(super) fn in_sled(db: &sled::Db, key: &[u8], id: &str) -> Result<Option<Millis>, StoreError> {
    match db.get(key).map_err(unavailable)? {
        Some(v) => find(key, &v, id),
        None => Ok(None),
    }
}

/// The ids a bucket change gives a pointer (for the filter of held ids, as the write-ahead log
/// replays).
pub(super) fn changed_ids<'a>(
    key: &'a [u8],
    change: &'a [u8],
) -> Result<impl Iterator<Item = Result<&'a [u8], StoreError>>, StoreError> {
    Ok(change_entries(key, change)?.filter_map(|e| match e {
        Ok((id, Some(_))) => Some(Ok(id)),
        Ok((_, None)) => None,
        Err(e) => Some(Err(e)),
    }))
}

/// The ids a bucket lists (for the filter of held ids).
pub(super) fn ids<'a>(
    key: &'a [u8],
    value: &'a [u8],
) -> Result<impl Iterator<Item = Result<&'a [u8], StoreError>>, StoreError> {
    Ok(entries(key, value)?.map(|e| e.map(|(_, id, _)| id)))
}

/// Where a bucket write goes: `value` for [`Buckets::key`], for the benches' `sled alone`
/// floor, which makes the store's own read and write of a new action's bucket.
pub fn bucket_with(value: Option<&[u8]>, id: &str, created: Millis) -> Vec<u8> {
    changed(b"", value, &change_value([(id, Some(created))]))
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Moves every pointer kept under `a/{id}` (8 bytes: its record's creation time, the form every
/// older one is brought to first) into its bucket: the buckets first, then the old keys go, so
/// an interrupted move starts again with nothing lost (an id already in its bucket is listed
/// once). Each bucket is written once: the pointers are read in as many passes as it takes to
/// hold at most [`MOVE_STEP`] of them at a time, each pass building one range of buckets whole,
/// in key order.
pub(super) fn move_to_buckets(db: &sled::Db, buckets: &Buckets) -> Result<usize, String> {
    move_to_buckets_in(db, buckets, MOVE_STEP)
}

/// [`move_to_buckets`] holding at most `step` pointers at a time.
fn move_to_buckets_in(db: &sled::Db, buckets: &Buckets, step: usize) -> Result<usize, String> {
    let old = || {
        db.scan_prefix(b"a/").map(|kv| {
            let (k, v) = kv.map_err(|e| e.to_string())?;
            let created = <[u8; 8]>::try_from(&v[..]).map_err(|_| {
                format!(
                    "{}: a pointer of a form not moved",
                    String::from_utf8_lossy(&k)
                )
            })?;
            Ok::<_, String>((k, Millis::from_be_bytes(created)))
        })
    };
    let count = old().try_fold(0usize, |n, kv| kv.map(|_| n + 1))?;
    if count == 0 {
        return Ok(0);
    }
    tracing::info!(
        pointers = count,
        "store: moving pointers into buckets (once, after an upgrade: about 10 s a million)"
    );
    let passes = count.div_ceil(step);
    let span = (1usize << 16).div_ceil(passes);
    for pass in 0..passes {
        let range = pass * span..((pass + 1) * span).min(1 << 16);
        // Each bucket of the range as the change that puts its pointers in it.
        let mut building: std::collections::BTreeMap<u16, Vec<u8>> = Default::default();
        for kv in old() {
            let (k, created) = kv?;
            let id = &k[2..];
            let b = buckets.of_id(id);
            if range.contains(&usize::from(b)) {
                let v = building.entry(b).or_insert_with(|| vec![CHANGES_FORM]);
                push_timed(v, created, id);
            }
        }
        for (b, listed) in building {
            let key = bucket_key_of(b);
            let old = db.get(&key).map_err(|e| e.to_string())?;
            if let Some(v) = changed(&key, old.as_deref(), &listed).map_err(|e| e.to_string())? {
                db.insert(key, v).map_err(|e| e.to_string())?;
            }
        }
    }
    let mut moved = 0;
    for kv in db.scan_prefix(b"a/").keys() {
        db.remove(kv.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        moved += 1;
    }
    Ok(moved)
}

/// Pointers one pass of [`move_to_buckets`] holds (some 45 bytes each).
const MOVE_STEP: usize = 250_000;

#[cfg(test)]
mod tests {
    use super::*;

    /// Buckets are on disk: an id's bucket never changes for a store's secret, and differs
    /// across secrets (ids a client ground to share a prefix do not share a bucket).
    #[test]
    fn buckets_keep_their_layout() {
        let b = Buckets::new(*b"0123456789abcdef");
        assert_eq!(b.of_id(b"ab12cdef"), GOLDEN);
        assert_eq!(b.key("ab12cdef"), bucket_key_of(GOLDEN));
        assert_eq!(bucket_key_of(0xab12), b"p/\xab\x12");
        let other = Buckets::new(*b"fedcba9876543210");
        let ids = ["ab120000", "ab120001", "ab120002", "ab120003"];
        assert!(ids
            .iter()
            .any(|id| other.of_id(id.as_bytes()) != b.of_id(id.as_bytes())));
        let spread: HashSet<u16> = ids.iter().map(|id| b.of_id(id.as_bytes())).collect();
        assert!(spread.len() > 1, "ids with one prefix spread over buckets");
        let v = bucket_with(None, "ab", 258);
        assert_eq!(v, b"\x01\0\0\0\0\0\0\x01\x02\0\x02ab");
    }

    /// The bucket of `ab12cdef` under the secret `0123456789abcdef`: the first two bytes of
    /// SHA-256 over the two, computed apart from this code (Python's `hashlib`).
    const GOLDEN: u16 = 0xc50d;

    #[test]
    fn a_store_keeps_its_secret() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = sled_config(dir.path()).open().expect("open");
        assert!(Buckets::of(&db).expect("read").is_none());
        let drawn = Buckets::open(&db).expect("draw");
        let again = Buckets::open(&db).expect("read");
        assert_eq!(drawn.salt, again.salt);
        let saved = Buckets::of(&db).expect("read").expect("saved");
        assert_eq!(saved.salt, drawn.salt);
        db.insert(BUCKETS_KEY, b"\x02abc".as_slice())
            .expect("insert");
        assert!(
            Buckets::open(&db).is_err(),
            "a form this version does not know"
        );
        db.insert(BUCKETS_KEY, b"\x01abc".as_slice())
            .expect("insert");
        assert!(Buckets::open(&db).is_err(), "cut short");
    }

    /// The move builds every bucket once and leaves no old key, keeping an entry a move cut
    /// short already put in its bucket listed once.
    #[test]
    fn the_move_puts_every_pointer_in_its_bucket() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = sled_config(dir.path()).open().expect("open");
        let b = Buckets::open(&db).expect("draw");
        let all: Vec<String> = (0..3_000).map(|i| format!("{i:032x}")).collect();
        for (i, id) in all.iter().enumerate() {
            db.insert(rec_key(id), &(i as u64 + 1).to_be_bytes())
                .expect("insert");
        }
        let key = b.key(&all[7]);
        db.insert(&key, bucket_with(None, &all[7], 8))
            .expect("insert");
        assert_eq!(move_to_buckets_in(&db, &b, 1_000).expect("move"), 3_000);
        assert_eq!(db.scan_prefix(b"a/").count(), 0);
        let mut listed = 0;
        for kv in db.scan_prefix(POINTERS_PREFIX) {
            let (k, v) = kv.expect("read");
            listed += ids(&k, &v).expect("read").count();
        }
        assert_eq!(listed, 3_000);
        for (i, id) in all.iter().enumerate() {
            let v = db.get(b.key(id)).expect("read").expect("its bucket");
            assert_eq!(find(&b.key(id), &v, id).expect("read"), Some(i as u64 + 1));
        }
        assert_eq!(move_to_buckets(&db, &b).expect("move"), 0);
    }

    #[test]
    fn a_bucket_finds_replaces_and_drops_its_ids() {
        let key = b"p/xx".as_slice();
        let put = |v: Option<&[u8]>, id: &str, at: Option<Millis>| {
            changed(key, v, &change_value([(id, at)])).expect("a bucket this version wrote")
        };
        let look = |v: &[u8], id: &str| find(key, v, id).expect("a bucket this version wrote");
        let long = "b".repeat(40);
        let v = put(None, "a1", Some(5)).expect("not empty");
        let v = put(Some(&v), &long, Some(7)).expect("not empty");
        assert_eq!(look(&v, "a1"), Some(5));
        assert_eq!(look(&v, &long), Some(7));
        assert_eq!(look(&v, "a"), None);
        // A new version of an action's pointer replaces its entry, not adds one.
        let v = put(Some(&v), "a1", Some(9)).expect("not empty");
        assert_eq!(look(&v, "a1"), Some(9));
        assert_eq!(ids(key, &v).expect("read").count(), 2);
        let v = put(Some(&v), "a1", None).expect("not empty");
        assert_eq!(look(&v, "a1"), None);
        let listed: Vec<&[u8]> = ids(key, &v)
            .expect("read")
            .collect::<Result<_, _>>()
            .expect("read");
        assert_eq!(listed, vec![long.as_bytes()]);
        assert_eq!(put(Some(&v), &long, None), None);
        // A value cut short or of another form is refused, not read as something else.
        assert!(find(key, &v[..v.len() - 1], "zz").is_err());
        assert!(find(key, b"\x02", "a1").is_err());
        assert!(find(key, b"", "a1").is_err());
    }

    /// One change carries a batch's pointers for a bucket, in order: an id's last entry is the
    /// one that counts, and making it again (a write-ahead log replayed over what sled already
    /// has) changes nothing.
    #[test]
    fn a_change_makes_a_bucket_once_and_again() {
        let key = b"p/xx".as_slice();
        let old = bucket_with(None, "kept", 1);
        let old = bucket_with(Some(&old), "gone", 2);
        let change = change_value([
            ("new", Some(3)),
            ("gone", None),
            ("again", Some(4)),
            ("again", None),
            ("again", Some(5)),
        ]);
        let once = changed(key, Some(&old), &change)
            .expect("read")
            .expect("not empty");
        let twice = changed(key, Some(&once), &change)
            .expect("read")
            .expect("not empty");
        assert_eq!(once, twice);
        let look = |id: &str| find(key, &once, id).expect("read");
        assert_eq!(
            [look("kept"), look("new"), look("gone"), look("again")],
            [Some(1), Some(3), None, Some(5)]
        );
        let given: Vec<&[u8]> = changed_ids(key, &change)
            .expect("read")
            .collect::<Result<_, _>>()
            .expect("read");
        assert_eq!(given, [&b"new"[..], b"again", b"again"]);
        // Taking every pointer away takes the bucket away; a change of another form is refused.
        let all_gone = change_value([("kept", None), ("new", None), ("again", None)]);
        assert_eq!(changed(key, Some(&once), &all_gone).expect("read"), None);
        assert!(changed(key, Some(&once), &old).is_err());
        assert!(changed(key, Some(&change), &change).is_err());
    }
}
