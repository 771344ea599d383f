//! The unsettled-twin index (SPEC §4.1): which unsettled, guarded action holds each twin key.
//!
//! A claim under a new key asks it whether an identical write of the same caller is in flight
//! or unknown, without a scan. It lives in memory, kept by the writer as it stages each change
//! (so it is exactly as atomic as the claim), and is rebuilt at open from the unsettled
//! records, which are few (an action is unsettled for the length of its attempt, or until an
//! unknown outcome is settled) and never expire.

use super::*;

#[derive(Default)]
pub(super) struct Twins(crate::FastMap<String, String>);

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
                twins.staged(None, &r);
            }
        }
        Ok(twins)
    }

    /// The action holding `key`'s slot, if any.
    pub(super) fn holder(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// Follows a record's change from `old` to `new`.
    pub(super) fn staged(&mut self, old: Option<&Record>, new: &Record) {
        let held = old.is_some_and(Record::holds_twin);
        match (held, new.holds_twin()) {
            (true, false) => self.removed(new),
            (false, true) => {
                self.0.insert(new.twin_key(), new.id.clone());
            }
            _ => {}
        }
    }

    /// Forgets `r`'s slot, if it holds one.
    pub(super) fn removed(&mut self, r: &Record) {
        let key = r.twin_key();
        if self.0.get(&key) == Some(&r.id) {
            self.0.remove(&key);
        }
    }
}
