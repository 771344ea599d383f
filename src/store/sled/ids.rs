//! Which action ids the store may hold: a Bloom filter the writer asks before it looks an action
//! up in sled. A claim of a new action (nearly every write) otherwise walks sled to the random
//! leaf its pointer `a/{id}` would be in, only to find nothing there: about 6% of the proxy's
//! CPU per write.
//!
//! The filter answers "certainly not held" or "perhaps held"; only the first skips sled, and it
//! is never wrong: the filter is made at open, before the writer starts, from every pointer in
//! sled (after the write-ahead log's replay and the migrations) or, after a clean close, loaded
//! from the file the close saved it in (see [`at_open`]); and the writer adds every id it gives a
//! pointer before it could ask about it again. Ids that go (expired) stay set: they cost a sled
//! lookup, never a wrong answer. Past its design load the filter answers "perhaps" to everything
//! (sled is asked, as before it) until an open sizes it anew for the store.
//!
//! Why a file: reading every pointer at open touches every leaf of the `a/` keys, and sled keeps
//! state for every page it has touched: 33 MiB of the 136 MiB a proxy held right after opening a
//! million actions (docs/decisions.md).

use std::hash::BuildHasher;
use std::path::Path;

use foldhash::quality::FixedState;
use sha2::{Digest, Sha256};

use super::Counts;
use crate::store::files;

/// Probes per id.
const PROBES: usize = 4;
/// Bits per id at the design load: one false "perhaps" in about 400.
const BITS_PER_ID: usize = 16;
/// The smallest filter: 1 MiB, room for about half a million ids at its design load.
const MIN_BITS: usize = 1 << 23;
/// Bits per id below which the filter stops answering "certainly not" (one in about 40 false).
const MAX_LOAD: usize = 8;
/// Bits per id a saved filter must still have to be loaded (one false "perhaps" in about 150):
/// a fuller one is made anew from sled, sized for the store (and rid of the ids that expired).
const LOAD_BITS_PER_ID: usize = 12;

/// The file a clean close leaves the filter in, in the store's folder.
pub(super) const FILE: &str = "ids.filter";
const MAGIC: &[u8] = b"oncegate ids filter 1\n";
/// Ids whose hashes a saved filter carries: a build that hashes them otherwise (another version
/// of the hasher or of std's `Hash` for byte strings) would probe other bits, and does not load it.
const CHECK_IDS: [&[u8]; 3] = [b"", b"0123456789abcdef", b"a/oncegate"];

pub(super) struct Ids {
    bits: Vec<u64>,
    mask: u64,
    set: usize,
    /// Drawn for each filter made from sled and saved with it: ids derive from what clients
    /// send, and a fixed hash would let them be chosen to collide (which would only cost
    /// lookups, but still).
    seed: u64,
    hasher: FixedState,
}

/// What a saved filter is bound to: the store exactly as its clean close left it. Every id the
/// store gives a pointer comes with a claim, whose write-log entry moves the head; so a store
/// changed since the filter was saved (by this version or any other, or put back from an older
/// copy) does not match, and its filter is made from sled instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Binding {
    /// The store's id (`history::ID_KEY`).
    pub(super) store: Vec<u8>,
    /// The write log's head: its newest entry's sequence number and hash.
    pub(super) head: (u64, String),
    pub(super) counts: Counts,
}

impl Binding {
    /// The binding of the store in `db` whose write log ends at `head`, with these counts.
    pub(super) fn of(
        db: &sled::Db,
        head: (u64, String),
        counts: Counts,
    ) -> Result<Binding, String> {
        let store = db
            .get(super::history::ID_KEY)
            .map_err(|e| format!("read the store id: {e}"))?
            .map(|v| v.to_vec())
            .unwrap_or_default();
        Ok(Binding {
            store,
            head,
            counts,
        })
    }
}

/// The filter of the store at open, before the writer starts: the one its last clean close saved
/// when that is bound to this very state of the store ([`Binding`]), else made from every pointer
/// in sled ([`Ids::of`]); `true` when loaded. The saved file is removed before anything else:
/// from here on the store changes, and no later open may find the file (one that cannot be
/// removed is not used).
pub(super) fn at_open(
    db: &sled::Db,
    dir: &Path,
    binding: &Binding,
    stored: usize,
) -> Result<(Ids, bool), String> {
    let path = dir.join(FILE);
    // What a close that stopped while saving left: never a filter, only in the way.
    let _ = std::fs::remove_file(dir.join(format!("{FILE}.tmp")));
    let saved = match std::fs::read(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        read => match read.and_then(|bytes| {
            std::fs::remove_file(&path)
                .and_then(|()| files::fsync_dir(dir))
                .map(|()| bytes)
        }) {
            Ok(bytes) => Some(bytes),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "store: cannot read and remove the saved ids filter; reading the ids from sled");
                None
            }
        },
    };
    if let Some(bytes) = saved {
        match Ids::parse(&bytes, binding) {
            Ok(ids) => return Ok((ids, true)),
            Err(why) => tracing::info!(
                reason = why,
                "store: the saved ids filter is not of this store as it is; reading the ids from sled"
            ),
        }
    }
    let started = std::time::Instant::now();
    let ids = Ids::of(db, stored)?;
    if ids.set > 0 {
        tracing::info!(
            ids = ids.set,
            seconds = started.elapsed().as_secs_f64(),
            "store: read the action ids from sled (a clean stop saves them for the next start)"
        );
    }
    Ok((ids, false))
}

impl Ids {
    /// A filter sized for `expected` ids (at least [`MIN_BITS`]), empty.
    pub(super) fn with_capacity(expected: usize) -> Ids {
        let bits = expected
            .saturating_mul(BITS_PER_ID)
            .max(MIN_BITS)
            .next_power_of_two();
        let seed = rand::random();
        Ids {
            bits: vec![0; bits / 64],
            mask: bits as u64 - 1,
            set: 0,
            seed,
            hasher: FixedState::with_seed(seed),
        }
    }

    /// The filter of the ids of every pointer (`a/{id}`) in `db` (about `expected` of them),
    /// sized for twice as many: saved at each clean close, it is loaded at the next open until
    /// it holds more than about 2.7 times as many ([`LOAD_BITS_PER_ID`]).
    pub(super) fn of(db: &sled::Db, expected: usize) -> Result<Ids, String> {
        let mut ids = Ids::with_capacity(expected.saturating_mul(2));
        for k in db.scan_prefix(b"a/").keys() {
            let k = k.map_err(|e| e.to_string())?;
            ids.insert(&k[2..]);
        }
        Ok(ids)
    }

    /// Saves the filter in `dir` for the next open, bound to the store as it is now (call it
    /// when nothing changes the store any more: at a clean close, once every batch is in sled).
    /// Written aside, made durable, then renamed: the file is whole or absent.
    pub(super) fn save(&self, dir: &Path, binding: &Binding) -> Result<(), String> {
        let mut out = Vec::with_capacity(self.bits.len() * 8 + 256);
        out.extend_from_slice(MAGIC);
        put_bytes(&mut out, &binding.store);
        out.extend_from_slice(&binding.head.0.to_le_bytes());
        put_bytes(&mut out, binding.head.1.as_bytes());
        out.extend_from_slice(&(binding.counts.len() as u64).to_le_bytes());
        for c in binding.counts {
            out.extend_from_slice(&c.to_le_bytes());
        }
        for n in [self.seed, self.set as u64, self.bits.len() as u64] {
            out.extend_from_slice(&n.to_le_bytes());
        }
        for id in CHECK_IDS {
            out.extend_from_slice(&self.hasher.hash_one(id).to_le_bytes());
        }
        for w in &self.bits {
            out.extend_from_slice(&w.to_le_bytes());
        }
        let sum = Sha256::digest(&out);
        out.extend_from_slice(&sum);
        let path = dir.join(FILE);
        files::write_whole(&dir.join(format!("{FILE}.tmp")), &path, &out)
            .map_err(|e| format!("write {}: {e}", path.display()))
    }

    /// A saved filter, if it is whole, bound to `binding` and hashes as this build does.
    fn parse(bytes: &[u8], binding: &Binding) -> Result<Ids, &'static str> {
        let body = bytes
            .len()
            .checked_sub(32)
            .map(|n| &bytes[..n])
            .ok_or("it is cut short")?;
        if Sha256::digest(body).as_slice() != &bytes[body.len()..] {
            return Err("its checksum does not match");
        }
        let mut r = Reader(body);
        if r.take(MAGIC.len())? != MAGIC {
            return Err("it is not a filter this version saves");
        }
        let store = r.take_bytes()?;
        let head = (r.u64()?, r.take_bytes()?);
        if store != binding.store.as_slice() {
            return Err("it is another store's");
        }
        if head.0 != binding.head.0 || head.1 != binding.head.1.as_bytes() {
            return Err("the write log has changed since it was saved");
        }
        if r.u64()? != binding.counts.len() as u64 {
            return Err("it counts other states");
        }
        for c in binding.counts {
            if r.u64()? != c {
                return Err("the actions by state have changed since it was saved");
            }
        }
        let (seed, set, words) = (r.u64()?, r.u64()? as usize, r.u64()? as usize);
        let hasher = FixedState::with_seed(seed);
        for id in CHECK_IDS {
            if r.u64()? != hasher.hash_one(id) {
                return Err("this build hashes ids otherwise");
            }
        }
        let bits = words.checked_mul(64).ok_or("its size is not a filter's")?;
        if !bits.is_power_of_two() || bits < MIN_BITS || r.0.len() != words * 8 {
            return Err("its size is not a filter's");
        }
        if set.saturating_mul(LOAD_BITS_PER_ID) > bits {
            return Err("it is fuller than one made anew");
        }
        let bits: Vec<u64> =
            r.0.chunks_exact(8)
                .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
                .collect();
        Ok(Ids {
            mask: (bits.len() * 64) as u64 - 1,
            bits,
            set,
            seed,
            hasher,
        })
    }

    fn probes(&self, id: &[u8]) -> [u64; PROBES] {
        let h = self.hasher.hash_one(id);
        let (h1, h2) = (h, h.rotate_left(32) | 1);
        std::array::from_fn(|i| h1.wrapping_add((i as u64).wrapping_mul(h2)) & self.mask)
    }

    pub(super) fn insert(&mut self, id: &[u8]) {
        for bit in self.probes(id) {
            self.bits[(bit / 64) as usize] |= 1 << (bit % 64);
        }
        self.set += 1;
    }

    /// Whether no id was ever put in.
    pub(super) fn is_empty(&self) -> bool {
        self.set == 0
    }

    /// Whether the store may hold `id`; `false` only when it certainly does not.
    pub(super) fn may_hold(&self, id: &[u8]) -> bool {
        if self.set.saturating_mul(MAX_LOAD) > self.bits.len() * 64 {
            return true;
        }
        self.probes(id)
            .into_iter()
            .all(|bit| self.bits[(bit / 64) as usize] & (1 << (bit % 64)) != 0)
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

/// Reads a saved filter front to back.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if self.0.len() < n {
            return Err("it is cut short");
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u64(&mut self) -> Result<u64, &'static str> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(
            b.try_into().map_err(|_| "it is cut short")?,
        ))
    }
    fn take_bytes(&mut self) -> Result<&'a [u8], &'static str> {
        let n = usize::try_from(self.u64()?).map_err(|_| "it is cut short")?;
        self.take(n)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    use sha2::Digest;

    fn id(n: usize) -> Vec<u8> {
        crate::identity::hex(&sha2::Sha256::digest(n.to_be_bytes())).into_bytes()
    }

    #[test]
    fn every_id_put_in_is_perhaps_held_and_few_others_are() {
        let mut ids = Ids::with_capacity(0);
        let n = (ids.bits.len() * 64) / BITS_PER_ID;
        for i in 0..n {
            ids.insert(&id(i));
        }
        assert!(
            (0..n).all(|i| ids.may_hold(&id(i))),
            "a false 'certainly not'"
        );
        let false_hits = (n..n + 100_000).filter(|&i| ids.may_hold(&id(i))).count();
        // One in about 400 at this load: 250 of 100,000 expected.
        assert!(
            false_hits < 1_000,
            "{false_hits} false 'perhaps' of 100,000"
        );
    }

    fn binding() -> Binding {
        Binding {
            store: b"store-1".to_vec(),
            head: (42, "ab".repeat(32)),
            counts: std::array::from_fn(|i| i as u64 * 3),
        }
    }

    /// Saves `ids` bound to `binding()` and returns the file's bytes.
    fn saved(ids: &Ids) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        ids.save(dir.path(), &binding()).unwrap();
        assert!(!dir.path().join(format!("{FILE}.tmp")).exists());
        std::fs::read(dir.path().join(FILE)).unwrap()
    }

    #[test]
    fn a_saved_filter_loads_as_it_was_into_the_store_it_is_bound_to() {
        let mut ids = Ids::with_capacity(0);
        for i in 0..10_000 {
            ids.insert(&id(i));
        }
        let loaded = Ids::parse(&saved(&ids), &binding()).unwrap();
        assert_eq!((loaded.bits == ids.bits, loaded.set), (true, 10_000));
        assert!((0..10_000).all(|i| loaded.may_hold(&id(i))));
        let answers = |f: &Ids| (10_000..20_000).filter(|&i| f.may_hold(&id(i))).count();
        assert_eq!(
            answers(&loaded),
            answers(&ids),
            "the same hash, the same probes"
        );
    }

    #[test]
    fn a_saved_filter_is_not_loaded_into_another_state_of_the_store() {
        let mut ids = Ids::with_capacity(0);
        ids.insert(&id(1));
        let bytes = saved(&ids);
        let mut other = binding();
        other.store = b"store-2".to_vec();
        assert_eq!(
            Ids::parse(&bytes, &other).err(),
            Some("it is another store's")
        );
        for head in [(43, binding().head.1), (42, "cd".repeat(32))] {
            let other = Binding { head, ..binding() };
            assert_eq!(
                Ids::parse(&bytes, &other).err(),
                Some("the write log has changed since it was saved")
            );
        }
        let mut other = binding();
        other.counts[1] += 1;
        assert_eq!(
            Ids::parse(&bytes, &other).err(),
            Some("the actions by state have changed since it was saved")
        );
        for n in [0, 31, 32, bytes.len() - 1] {
            assert!(Ids::parse(&bytes[..n], &binding()).is_err(), "cut at {n}");
        }
    }

    #[test]
    fn a_filter_hashed_otherwise_or_too_full_is_not_loaded() {
        let ids = Ids::with_capacity(0);
        let bytes = saved(&ids);
        // The same file with other hashes of the check ids, under a checksum that matches.
        let resealed = |edit: &dyn Fn(&mut Vec<u8>)| {
            let mut b = bytes[..bytes.len() - 32].to_vec();
            edit(&mut b);
            let sum = Sha256::digest(&b);
            b.extend_from_slice(&sum);
            b
        };
        let checks = bytes.len() - 32 - ids.bits.len() * 8 - 8 * CHECK_IDS.len();
        let other_hash = resealed(&|b| b[checks] ^= 1);
        assert_eq!(
            Ids::parse(&other_hash, &binding()).err(),
            Some("this build hashes ids otherwise")
        );
        // `set` is the second of the three numbers before the checks.
        let set_at = checks - 16;
        let full = ids.bits.len() * 64 / LOAD_BITS_PER_ID + 1;
        let too_full =
            resealed(&|b| b[set_at..set_at + 8].copy_from_slice(&(full as u64).to_le_bytes()));
        assert_eq!(
            Ids::parse(&too_full, &binding()).err(),
            Some("it is fuller than one made anew")
        );
    }

    #[test]
    fn past_its_design_load_the_filter_says_perhaps_to_everything() {
        let mut ids = Ids::with_capacity(0);
        let over = (ids.bits.len() * 64) / MAX_LOAD + 1;
        for i in 0..over {
            ids.insert(&id(i));
        }
        assert!((over..over + 1_000).all(|i| ids.may_hold(&id(i))));
    }
}
