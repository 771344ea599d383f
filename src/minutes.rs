//! The last hour, minute by minute: writes by outcome and the unknown actions waiting, kept by
//! the proxy itself for the console's overview chart (no time-series database needed to look).
//!
//! Sixty slots, one per minute of the wall clock, reused in a ring: a slot whose minute is not
//! the one being counted is cleared first. One short lock per write answered (the write itself
//! costs a durable flush), none per read.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::action::State;
use crate::error::Outcome;

/// What the chart stacks, in its order: sent, replayed, unknown, not applied, refused (every
/// other answer to a write: nothing was sent for it).
pub const KINDS: [&str; 5] = ["sent", "replayed", "unknown", "not_applied", "refused"];

/// How many minutes are kept.
pub const SPAN: usize = 60;

#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct Minute {
    /// Unix time of the minute's start, in seconds.
    pub at: u64,
    /// Writes answered in the minute, by [`KINDS`].
    pub writes: [u64; 5],
    /// The most unknown actions seen waiting in the minute (`None`: not sampled then).
    pub unknown_waiting: Option<u64>,
}

pub struct Minutes {
    slots: Mutex<[Minute; SPAN]>,
}

impl Default for Minutes {
    fn default() -> Self {
        Minutes {
            slots: Mutex::new([Minute::default(); SPAN]),
        }
    }
}

/// The chart's kind of a write's `Oncegate-Outcome` (as the metrics label it): anything but
/// the first four was not sent for this request.
fn kind(outcome: &str) -> usize {
    match Outcome::from_header(outcome.as_bytes()) {
        Some(Outcome::Sent) => 0,
        Some(Outcome::Replayed) => 1,
        Some(Outcome::Unknown) => 2,
        Some(Outcome::NotApplied) => 3,
        _ => 4,
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Minutes {
    /// The slot of the minute holding `secs`, cleared if it held an older minute.
    fn with_slot(&self, secs: u64, f: impl FnOnce(&mut Minute)) {
        let at = secs - secs % 60;
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let slot = &mut slots[(at / 60) as usize % SPAN];
        if slot.at != at {
            *slot = Minute {
                at,
                ..Minute::default()
            };
        }
        f(slot);
    }

    /// A write was answered with `outcome`.
    pub fn write(&self, outcome: &str) {
        self.write_at(now_secs(), outcome);
    }

    pub fn write_at(&self, secs: u64, outcome: &str) {
        let k = kind(outcome);
        self.with_slot(secs, |m| m.writes[k] += 1);
    }

    /// The unknown actions waiting now, from the store's counts by state.
    pub fn waiting(&self, counts: &[(State, u64)]) {
        let unknown = counts.iter().find(|(s, _)| *s == State::Unknown);
        self.waiting_at(now_secs(), unknown.map_or(0, |(_, n)| *n));
    }

    pub fn waiting_at(&self, secs: u64, n: u64) {
        self.with_slot(secs, |m| {
            m.unknown_waiting = Some(m.unknown_waiting.map_or(n, |w| w.max(n)))
        });
    }

    /// The last [`SPAN`] minutes up to the one holding now, oldest first; minutes with nothing
    /// counted are there, empty.
    pub fn last_hour(&self) -> Vec<Minute> {
        self.last_hour_at(now_secs())
    }

    pub fn last_hour_at(&self, secs: u64) -> Vec<Minute> {
        let now = secs - secs % 60;
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        (0..SPAN as u64)
            .rev()
            .filter_map(|back| now.checked_sub(back * 60))
            .map(|at| {
                let s = slots[(at / 60) as usize % SPAN];
                if s.at == at {
                    s
                } else {
                    Minute {
                        at,
                        ..Minute::default()
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_hour_old_minute_is_not_counted_again() {
        let m = Minutes::default();
        let t: u64 = 1_800_000_060 - 60; // a minute's start
        m.write_at(t, "sent");
        m.write_at(t + 59, "sent");
        m.write_at(t + 60, "replayed");
        m.write_at(t + 61, "rejected");
        m.waiting_at(t + 60, 3);
        m.waiting_at(t + 70, 2);
        let hour = m.last_hour_at(t + 60);
        assert_eq!(hour.len(), SPAN);
        assert_eq!(hour[SPAN - 2].at, t);
        assert_eq!(hour[SPAN - 2].writes, [2, 0, 0, 0, 0]);
        assert_eq!(hour[SPAN - 1].writes, [0, 1, 0, 0, 1]);
        assert_eq!(hour[SPAN - 1].unknown_waiting, Some(3));
        assert_eq!(hour[SPAN - 2].unknown_waiting, None);
        // An hour on, the first minute's slot holds the new minute only.
        m.write_at(t + 3600, "unknown");
        let later = m.last_hour_at(t + 3600);
        assert_eq!(later[SPAN - 1].writes, [0, 0, 1, 0, 0]);
        assert_eq!(later[0].at, t + 60);
        assert_eq!(later[0].writes, [0, 1, 0, 0, 1]);
        assert!(later.iter().all(|x| x.at != t));
    }
}
