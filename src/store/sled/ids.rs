//! Which action ids the store may hold: a Bloom filter the writer asks before it looks an action
//! up in sled. A claim of a new action (nearly every write) otherwise walks sled to the random
//! leaf its pointer `a/{id}` would be in, only to find nothing there: about 6% of the proxy's
//! CPU per write.
//!
//! The filter answers "certainly not held" or "perhaps held"; only the first skips sled, and it
//! is never wrong: the filter is built at open from every pointer in sled (after the write-ahead
//! log's replay and the migrations, before the writer starts), and the writer adds every id it
//! gives a pointer before it could ask about it again. Ids that go (expired) stay set: they cost
//! a sled lookup, never a wrong answer. Past its design load the filter answers "perhaps" to
//! everything (sled is asked, as before it) until the next open sizes it for the store.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

/// Probes per id.
const PROBES: usize = 4;
/// Bits per id at open: one false "perhaps" in about 400 at that load.
const BITS_PER_ID: usize = 16;
/// The smallest filter: 1 MiB, room for about a million new ids at its design load.
const MIN_BITS: usize = 1 << 23;
/// Ids per bit past which the filter stops answering "certainly not" (one in about 40 false).
const MAX_LOAD: usize = 8;

pub(super) struct Ids {
    bits: Vec<u64>,
    mask: u64,
    set: usize,
    /// Keyed: ids derive from what clients send, and a fixed hash would let them be chosen to
    /// collide (which would only cost lookups, but still).
    hasher: RandomState,
}

impl Ids {
    /// A filter sized for `expected` ids (at least [`MIN_BITS`]), empty.
    pub(super) fn with_capacity(expected: usize) -> Ids {
        let bits = expected
            .saturating_mul(BITS_PER_ID)
            .max(MIN_BITS)
            .next_power_of_two();
        Ids {
            bits: vec![0; bits / 64],
            mask: bits as u64 - 1,
            set: 0,
            hasher: RandomState::new(),
        }
    }

    /// The filter of the ids of every pointer (`a/{id}`) in `db`.
    pub(super) fn of(db: &sled::Db, expected: usize) -> Result<Ids, String> {
        let mut ids = Ids::with_capacity(expected);
        for k in db.scan_prefix(b"a/").keys() {
            let k = k.map_err(|e| e.to_string())?;
            ids.insert(&k[2..]);
        }
        Ok(ids)
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

#[cfg(test)]
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
