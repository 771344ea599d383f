//! Which action ids the store may hold: a Bloom filter the writer asks before it looks an action
//! up in sled. A claim of a new action (nearly every write) otherwise walks sled to the random
//! bucket its pointer would be in (a random page of sled), only to find nothing there: about 6% of the proxy's
//! CPU per write.
//!
//! The filter answers "certainly not held" or "perhaps held"; only the first skips sled, and it
//! is never wrong: the filter is made at open, before the writer starts, and the writer adds
//! every id it gives a pointer before it could ask about it again. Ids that go (expired) stay
//! set: they cost a sled lookup, never a wrong answer. Past its design load the filter would
//! answer "perhaps" to everything (sled asked, as before it); before that, while the store runs,
//! a new one is made from sled's pointers and takes its place, rid of the ids that went
//! (`renew.rs`).
//!
//! At open it is made from every pointer in sled (after the write-ahead log's replay and the
//! migrations), or loaded from the file a checkpoint, a clean close or an open saved, when that
//! provably holds every id the store holds (`saved.rs`).

use std::hash::BuildHasher;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use foldhash::quality::FixedState;

use super::pointers;

mod renew;
mod saved;

pub(super) use renew::Held;

pub(super) use saved::{at_open, Binding, Opened, Saved};

/// Probes per id.
const PROBES: usize = 4;
/// Bits per id at the design load: one false "perhaps" in about 400.
const BITS_PER_ID: usize = 16;
/// The smallest filter: 1 MiB, room for about half a million ids at its design load (a store
/// may be given a smaller one to test with: `StoreOptions::ids_min_bits`).
pub(super) const MIN_BITS: usize = 1 << 23;
/// Bits per id below which the filter stops answering "certainly not" (one in about 40 false).
const MAX_LOAD: usize = 8;
/// Bits per id a saved filter must still have to be loaded (one false "perhaps" in about 150):
/// a fuller one is made anew from sled, sized for the store (and rid of the ids that expired).
const LOAD_BITS_PER_ID: usize = 12;

/// The filter's words are shared with the thread that saves it. One thread sets bits (the
/// open's, then the writer's), storing each word it changes (no read-modify-write needed with
/// one writer); the checkpointer reads them after the writer's message, and so sees every bit
/// set before it and perhaps some set since (bits are only ever set: a superset, never a wrong
/// "certainly not").
type Words = Arc<[AtomicU64]>;

pub(super) struct Ids {
    bits: Words,
    mask: u64,
    set: usize,
    /// Drawn for each filter made from sled and saved with it: ids derive from what clients
    /// send, and a fixed hash would let them be chosen to collide (which would only cost
    /// lookups, but still).
    seed: u64,
    hasher: FixedState,
}

/// The filter as it is at one moment, for another thread to save: it shares the words, so it
/// holds every id put in before it was taken.
pub(super) struct Snapshot {
    bits: Words,
    set: usize,
    seed: u64,
}

impl Ids {
    /// A filter sized for `expected` ids (at least `min_bits`, [`MIN_BITS`] but in tests), empty.
    pub(super) fn with_capacity(expected: usize, min_bits: usize) -> Ids {
        let bits = expected
            .saturating_mul(BITS_PER_ID)
            .max(min_bits)
            .max(64)
            .next_power_of_two();
        let seed = rand::random();
        Ids::from_words((0..bits / 64).map(|_| AtomicU64::new(0)).collect(), 0, seed)
    }

    fn from_words(bits: Words, set: usize, seed: u64) -> Ids {
        Ids {
            mask: (bits.len() * 64) as u64 - 1,
            bits,
            set,
            seed,
            hasher: FixedState::with_seed(seed),
        }
    }

    /// The filter of the ids of every pointer in `db`'s buckets (about `expected` of them),
    /// sized for twice as many: saved, it is loaded at later opens until it holds more than
    /// about 2.7 times as many ([`LOAD_BITS_PER_ID`]).
    /// `stop`: checked between buckets; once it says so, the scan ends with an error.
    pub(super) fn of(
        db: &sled::Db,
        expected: usize,
        min_bits: usize,
        mut stop: impl FnMut() -> bool,
    ) -> Result<Ids, String> {
        let mut ids = Ids::with_capacity(expected.saturating_mul(2), min_bits);
        for kv in db.scan_prefix(pointers::POINTERS_PREFIX) {
            if stop() {
                return Err("stopped".into());
            }
            let (k, v) = kv.map_err(|e| e.to_string())?;
            for id in pointers::ids(&k, &v).map_err(|e| e.to_string())? {
                ids.insert(id.map_err(|e| e.to_string())?);
            }
        }
        Ok(ids)
    }

    /// The filter as it is now, to be saved by another thread ([`Snapshot::save`]).
    pub(super) fn snapshot(&self) -> Snapshot {
        Snapshot {
            bits: self.bits.clone(),
            set: self.set,
            seed: self.seed,
        }
    }

    /// Saves the filter in `dir`, bound to `binding` ([`Snapshot::save`]).
    pub(super) fn save(&self, dir: &Path, binding: &Binding) -> Result<(), String> {
        self.snapshot().save(dir, binding)
    }

    fn probes(&self, id: &[u8]) -> [u64; PROBES] {
        let h = self.hasher.hash_one(id);
        let (h1, h2) = (h, h.rotate_left(32) | 1);
        std::array::from_fn(|i| h1.wrapping_add((i as u64).wrapping_mul(h2)) & self.mask)
    }

    /// Puts `id` in. Counted only when it sets a bit: an id put in again (or one whose bits
    /// were all set already, which the filter could not tell from it) leaves it as it was.
    pub(super) fn insert(&mut self, id: &[u8]) {
        let mut new = false;
        for bit in self.probes(id) {
            let w = &self.bits[(bit / 64) as usize];
            // The one thread that sets bits: a load and a store, no read-modify-write.
            let (was, mask) = (w.load(Ordering::Relaxed), 1 << (bit % 64));
            if was & mask == 0 {
                w.store(was | mask, Ordering::Relaxed);
                new = true;
            }
        }
        self.set += usize::from(new);
    }

    /// Whether no id was ever put in.
    pub(super) fn is_empty(&self) -> bool {
        self.set == 0
    }

    /// Whether the filter has reached its design load (half the ids it answers for at most):
    /// time to make the next one ([`Held`]), which has the other half to take its place in.
    fn due(&self) -> bool {
        self.set.saturating_mul(BITS_PER_ID) >= self.bits.len() * 64
    }

    /// Whether the store may hold `id`; `false` only when it certainly does not.
    pub(super) fn may_hold(&self, id: &[u8]) -> bool {
        if self.set.saturating_mul(MAX_LOAD) > self.bits.len() * 64 {
            return true;
        }
        self.probes(id).into_iter().all(|bit| {
            self.bits[(bit / 64) as usize].load(Ordering::Relaxed) & (1 << (bit % 64)) != 0
        })
    }
}

impl Snapshot {
    /// Whether no id was ever put in.
    pub(super) fn is_empty(&self) -> bool {
        self.set == 0
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    use sha2::Digest;

    pub(super) fn id(n: usize) -> Vec<u8> {
        crate::identity::hex(&sha2::Sha256::digest(n.to_be_bytes())).into_bytes()
    }

    #[test]
    fn every_id_put_in_is_perhaps_held_and_few_others_are() {
        let mut ids = Ids::with_capacity(0, MIN_BITS);
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

    #[test]
    fn past_its_most_the_filter_says_perhaps_to_everything() {
        let mut ids = Ids::with_capacity(0, MIN_BITS);
        // Ids counted: those that set a bit (an id whose bits were all set counts for nothing).
        let mut n = 0;
        while ids.set * MAX_LOAD <= ids.bits.len() * 64 {
            ids.insert(&id(n));
            n += 1;
        }
        assert!((n..n + 1_000).all(|i| ids.may_hold(&id(i))));
    }

    #[test]
    fn an_id_put_in_again_is_counted_once() {
        let mut ids = Ids::with_capacity(0, MIN_BITS);
        for _ in 0..3 {
            ids.insert(&id(7));
        }
        assert_eq!(ids.set, 1);
    }
}
