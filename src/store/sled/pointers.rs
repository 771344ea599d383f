//! Pointers: where the record of an action is found by its id.
//!
//! `p/{bucket:be16}`: the pointers of the actions whose ids fall in one of 65,536 buckets
//! ([`bucket_of`]), each an id with its record's creation time, which with the id names the key
//! the record lives under (`c/{created_at:be64}{id}`). One key an action (`a/{id}`, as versions
//! before kept them) put every new action into a random leaf of a tree as large as the store,
//! and sled keeps state for every page it has held (about 240 bytes a page, a leaf of some 12
//! pointers): with the store's size that tree came to most of the proxy's growth in memory and
//! a fifth of a write's CPU (docs/decisions.md, "Pointers in buckets"). Buckets are a fixed
//! number of keys whatever the store's size (about 5,500 leaves); the price is that a new action
//! rewrites its bucket (about 250 bytes with 380,000 actions stored, growing with the store). Opening a store moves the pointers of versions before into buckets
//! ([`move_to_buckets`]).

use super::*;

pub(super) const POINTERS_PREFIX: &[u8] = b"p/";
/// The first byte of a bucket's value: its form's version.
const BUCKET_FORM: u8 = 1;

/// The bucket of `id`: its first four hex digits (action ids are SHA-256 digests in hex, so these
/// are uniform, and the pointers of a/ keys read in order fall in buckets in order), or, for an
/// id that does not start so, a hash of it (FNV-1a, fixed here for good: a bucket is on disk).
pub(super) fn bucket_of(id: &[u8]) -> u16 {
    let hex = id.get(..4).and_then(|d| {
        d.iter().try_fold(0u16, |n, &c| {
            let v = (c as char).to_digit(16)?;
            Some(n << 4 | v as u16)
        })
    });
    hex.unwrap_or_else(|| {
        let h = id.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        (h ^ h >> 16 ^ h >> 32 ^ h >> 48) as u16
    })
}

/// The key of the bucket `id` falls in (public for the benches' `sled alone` floor).
pub fn bucket_key(id: &str) -> Vec<u8> {
    bucket_key_of(bucket_of(id.as_bytes()))
}

pub(super) fn bucket_key_of(bucket: u16) -> Vec<u8> {
    [POINTERS_PREFIX, &bucket.to_be_bytes()].concat()
}

/// A value listing actions, each with a time: a bucket's (when each record was created) and an
/// expiry index entry's (when each expires). After the form's byte, each action's time (be64),
/// id length (u16, be) and id.
pub(super) fn push_timed(v: &mut Vec<u8>, at: Millis, id: &str) {
    v.extend_from_slice(&at.to_be_bytes());
    // Ids are a few dozen bytes (action ids 32); one too long for the length is cut, and never
    // matches its action.
    let id = &id.as_bytes()[..id.len().min(usize::from(u16::MAX))];
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

/// `value` (a bucket's, `None`: none yet) with `id` pointing at a record created at `created`
/// (its entry replaced if it has one) or, `created` `None`, without `id`; `None` when nothing is
/// left in it (its key goes).
pub(super) fn with(
    key: &[u8],
    value: Option<&[u8]>,
    id: &str,
    created: Option<Millis>,
) -> Result<Option<Vec<u8>>, StoreError> {
    let value = value.unwrap_or(&[BUCKET_FORM]);
    let mut out = Vec::with_capacity(value.len() + 10 + id.len());
    out.push(BUCKET_FORM);
    for e in entries(key, value)? {
        let (_, listed, r) = e?;
        if listed != id.as_bytes() {
            out.extend_from_slice(&value[r]);
        }
    }
    if let Some(at) = created {
        push_timed(&mut out, at, id);
    }
    Ok((out.len() > 1).then_some(out))
}

/// The ids a bucket lists (for the filter of held ids).
pub(super) fn ids<'a>(
    key: &'a [u8],
    value: &'a [u8],
) -> Result<impl Iterator<Item = Result<&'a [u8], StoreError>>, StoreError> {
    Ok(entries(key, value)?.map(|e| e.map(|(_, id, _)| id)))
}

/// Where a bucket write goes: `value` for `bucket_key(id)`, for the benches' `sled alone`
/// floor, which makes the store's own read and write of a new action's bucket.
pub fn bucket_with(value: Option<&[u8]>, id: &str, created: Millis) -> Vec<u8> {
    with(b"", value, id, Some(created))
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Moves every pointer kept under `a/{id}` (8 bytes: its record's creation time, the form every
/// older one is brought to first) into its bucket: the buckets first, then the old keys go, so
/// an interrupted move starts again with nothing lost (an id already in its bucket is listed
/// once). At most [`MOVE_STEP`] pointers are held at a time.
pub(super) fn move_to_buckets(db: &sled::Db) -> Result<usize, String> {
    let mut moved = 0;
    loop {
        let mut step: Vec<(sled::IVec, Millis)> = Vec::new();
        for kv in db.scan_prefix(b"a/").take(MOVE_STEP) {
            let (k, v) = kv.map_err(|e| e.to_string())?;
            let created = <[u8; 8]>::try_from(&v[..]).map_err(|_| {
                format!(
                    "{}: a pointer of a form not moved",
                    String::from_utf8_lossy(&k)
                )
            })?;
            step.push((k, Millis::from_be_bytes(created)));
        }
        if step.is_empty() {
            return Ok(moved);
        }
        let mut by_bucket: std::collections::BTreeMap<u16, Vec<(String, Millis)>> =
            Default::default();
        for (k, created) in &step {
            let id = String::from_utf8_lossy(&k[2..]).into_owned();
            by_bucket
                .entry(bucket_of(id.as_bytes()))
                .or_default()
                .push((id, *created));
        }
        for (bucket, listed) in by_bucket {
            let key = bucket_key_of(bucket);
            let mut value = db.get(&key).map_err(|e| e.to_string())?.map(|v| v.to_vec());
            for (id, created) in listed {
                value =
                    with(&key, value.as_deref(), &id, Some(created)).map_err(|e| e.to_string())?;
            }
            if let Some(v) = value {
                db.insert(key, v).map_err(|e| e.to_string())?;
            }
        }
        for (k, _) in step {
            db.remove(k).map_err(|e| e.to_string())?;
            moved += 1;
        }
    }
}

/// Pointers one step of [`move_to_buckets`] holds.
const MOVE_STEP: usize = 100_000;

#[cfg(test)]
mod tests {
    use super::*;

    /// Buckets are on disk: an id's bucket never changes.
    #[test]
    fn buckets_keep_their_layout() {
        assert_eq!(bucket_of(b"ab12cdef"), 0xab12);
        assert_eq!(bucket_of(b"0000"), 0);
        assert_eq!(bucket_of(b"ffff0123"), 0xffff);
        assert_eq!(bucket_of(b"x"), bucket_of(b"x"));
        assert_ne!(bucket_of(b"x"), bucket_of(b"y"));
        assert_eq!(bucket_key("ab12cdef"), b"p/\xab\x12");
        let v = bucket_with(None, "ab", 258);
        assert_eq!(v, b"\x01\0\0\0\0\0\0\x01\x02\0\x02ab");
    }

    #[test]
    fn a_bucket_finds_replaces_and_drops_its_ids() {
        let key = b"p/xx".as_slice();
        let put = |v: Option<&[u8]>, id: &str, at: Option<Millis>| {
            with(key, v, id, at).expect("a bucket this version wrote")
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
}
