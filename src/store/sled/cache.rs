//! The cache of durable records that answers duplicates off the writer.

use super::*;

/// Recent records (`succeeded`, `unknown`, in flight) as last made durable, for replays and
/// conflicts that need no sled read. Bounded; the oldest entries go first.
///
/// The syncer puts every durable change in. The writer and body readers fill it from what they
/// read in sled (read-through), guarded by a generation per shard of ids: a reader notes its shard's
/// generation before reading, and its fill is dropped if any change to that shard was made
/// durable meanwhile, so an older read never replaces a newer outcome. The syncer makes a change
/// readable (in [`Mem`]) before it bumps the generation, which is what makes the guard hold.
#[derive(Default)]
pub(super) struct Cache {
    pub(super) map: HashMap<String, (Arc<Record>, Option<Bytes>)>,
    pub(super) order: std::collections::VecDeque<String>,
    pub(super) gens: Gens,
}

pub(super) const CACHE_ENTRIES: usize = 2_048;

pub(super) const CACHE_SHARDS: usize = 64;

pub(super) struct Gens([u64; CACHE_SHARDS]);

impl Default for Gens {
    fn default() -> Gens {
        Gens([0; CACHE_SHARDS])
    }
}

pub(super) fn shard(id: &str) -> usize {
    // Action ids are hex digests: their last bytes are as good as a hash.
    id.bytes()
        .rev()
        .take(4)
        .fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize))
        % CACHE_SHARDS
}

impl Cache {
    /// Takes the durable outcome of a batch: settled records in, anything else out.
    pub(super) fn update(&mut self, id: String, r: Option<Arc<Record>>, body: Option<&Bytes>) {
        self.gens.0[shard(&id)] += 1;
        match r {
            Some(r) if cacheable(&r) => {
                let keep = body
                    .filter(|b| b.len() <= CACHED_BODY_MAX)
                    .cloned()
                    .or_else(|| self.map.get(&id).and_then(|(_, b)| b.clone()));
                self.put(id, r, keep);
            }
            _ => {
                self.map.remove(&id);
            }
        }
    }

    /// The generation a reader notes before reading `id` outside the cache.
    pub(super) fn generation(&self, id: &str) -> u64 {
        self.gens.0[shard(id)]
    }

    /// A reader's fill: `r` as read after [`Cache::generation`] returned `gen`.
    pub(super) fn fill(&mut self, gen: u64, r: &Arc<Record>) {
        if self.generation(&r.id) == gen && cacheable(r) && !self.map.contains_key(&r.id) {
            self.put(r.id.clone(), Arc::clone(r), None);
        }
    }

    /// A reader's fill of a cached record's stored body.
    pub(super) fn fill_body(&mut self, gen: u64, id: &str, body: &Bytes) {
        if self.generation(id) == gen && body.len() <= CACHED_BODY_MAX {
            if let Some((_, b)) = self.map.get_mut(id) {
                b.get_or_insert_with(|| body.clone());
            }
        }
    }

    pub(super) fn put(&mut self, id: String, r: Arc<Record>, body: Option<Bytes>) {
        if self.map.insert(id.clone(), (r, body)).is_none() {
            self.order.push_back(id);
        }
        while self.map.len() > CACHE_ENTRIES {
            match self.order.pop_front() {
                Some(old) => {
                    self.map.remove(&old);
                }
                None => break,
            }
        }
    }
}

pub(super) const CACHED_BODY_MAX: usize = 16 * 1024;

/// Records the claim fast path can answer from: everything but `failed` (which a claim may
/// attempt again, on the writer).
pub(super) fn cacheable(r: &Record) -> bool {
    matches!(r.state, State::Succeeded | State::Unknown | State::InFlight)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::tests::fresh;

    fn settled(id: &str, state: State) -> Arc<Record> {
        let mut r = fresh("fp");
        r.id = id.to_string();
        r.state = state;
        Arc::new(r)
    }

    #[test]
    fn a_fill_read_before_a_newer_outcome_is_dropped() {
        let mut c = Cache::default();
        let id = "ab12";
        // A reader notes the generation, then reads `unknown` from sled...
        let gen = c.generation(id);
        // ...while the syncer makes `succeeded` durable and puts it in.
        c.update(id.into(), Some(settled(id, State::Succeeded)), None);
        c.map.clear();
        c.fill(gen, &settled(id, State::Unknown));
        assert!(!c.map.contains_key(id), "a stale read must not be cached");

        // A read with no change in between is cached, and its body with it.
        let gen = c.generation(id);
        c.fill(gen, &settled(id, State::Succeeded));
        c.fill_body(gen, id, &Bytes::from_static(b"{}"));
        let (r, b) = c.map.get(id).expect("cached");
        assert_eq!(r.state, State::Succeeded);
        assert_eq!(b.as_deref(), Some(&b"{}"[..]));

        // Removal (expiry, a new claim) bumps the generation too.
        let gen = c.generation(id);
        c.update(id.into(), None, None);
        c.fill(gen, &settled(id, State::Succeeded));
        assert!(!c.map.contains_key(id));
    }

    #[test]
    fn failed_records_are_not_filled_and_the_cache_is_bounded() {
        let mut c = Cache::default();
        let gen = c.generation("x");
        c.fill(gen, &settled("x", State::Failed));
        assert!(c.map.is_empty());
        for i in 0..CACHE_ENTRIES + 10 {
            let id = format!("{i:08x}");
            let gen = c.generation(&id);
            c.fill(gen, &settled(&id, State::Succeeded));
        }
        assert_eq!(c.map.len(), CACHE_ENTRIES);
        assert!(!c.map.contains_key("00000000"), "the oldest goes first");
    }
}
