//! The unsettled-twin index (SPEC §4.1): which unsettled, guarded action holds each twin key.
//!
//! A claim under a new key asks it whether an identical write of the same caller is in flight
//! or unknown, without a scan. It lives in memory, kept by the writer as it stages each change
//! (so it is exactly as atomic as the claim), and is rebuilt at open from the unsettled
//! records, which are few (an action is unsettled for the length of its attempt, or until an
//! unknown outcome is settled) and never expire. Each holder's key is kept beside it, so that a
//! settlement frees the slot without hashing the record again, and a claim brings the key its
//! request already hashed.

use super::*;

#[derive(Default)]
pub(super) struct Twins {
    /// Twin key → the action holding it.
    holders: crate::FastMap<String, String>,
    /// Action → the twin key it holds.
    held: crate::FastMap<String, String>,
}

impl Twins {
    /// The index of the store as it opens: every `in_flight` or `unknown` action that holds its
    /// twin slot.
    pub(super) fn at_open(
        db: &sled::Db,
        shared: &Shared,
        sealer: Option<&Sealer>,
    ) -> Result<Twins, StoreError> {
        let mut twins = Twins::default();
        let overlay = Overlay::take(shared, |_| false)?;
        for state in [State::InFlight, State::Unknown] {
            let filter = Filter {
                state: Some(state),
                ..Filter::default()
            };
            for r in scan(db, &shared.buckets, &overlay, &filter, usize::MAX, sealer)? {
                twins.staged(None, &r, None);
            }
        }
        Ok(twins)
    }

    /// The action holding `key`'s slot, if any.
    pub(super) fn holder(&self, key: &str) -> Option<&str> {
        self.holders.get(key).map(String::as_str)
    }

    /// Follows a record's change from `old` to `new`; `key`, when the caller has it, is `new`'s
    /// twin key (else it is hashed from the record when needed).
    pub(super) fn staged(&mut self, old: Option<&Record>, new: &Record, key: Option<String>) {
        let held = old.is_some_and(Record::holds_twin);
        match (held, new.holds_twin()) {
            (true, false) => self.removed(new),
            (false, true) => {
                let key = key.unwrap_or_else(|| new.twin_key());
                self.holders.insert(key.clone(), new.id.clone());
                self.held.insert(new.id.clone(), key);
            }
            _ => {}
        }
    }

    /// Frees `r`'s slot, if it holds one.
    pub(super) fn removed(&mut self, r: &Record) {
        if let Some(key) = self.held.remove(&r.id) {
            if self.holders.get(&key) == Some(&r.id) {
                self.holders.remove(&key);
            }
        }
    }
}
