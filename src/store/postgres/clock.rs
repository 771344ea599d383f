//! The database's clock, read once a second rather than once a batch (SPEC §13).
//!
//! Every time a decision compares (lease ends, send times, expiry) is the database's, so that a
//! proxy whose own wall clock is wrong cannot judge another's attempt over. Reading it costs a
//! statement; sent in every batch, it kept the batch's first row statement waiting a round trip.
//! So the writer reads it now and then and counts forward on the local monotonic clock, which
//! drifts from the database's by parts per million over the second a sample is kept. A sample
//! is read again when it is a second old, or when the local wall clock and the monotonic clock
//! disagree about how long it has been (the process or its machine was suspended, the wall
//! clock was stepped): then the next batch asks the database again.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use crate::action::Millis;

/// How long a sample is counted forward before the database is asked again.
const KEEP: Duration = Duration::from_secs(1);

/// How far the local wall clock and monotonic clock may disagree before a sample is dropped.
const SLACK: Duration = Duration::from_millis(20);

#[derive(Clone, Copy)]
struct Sample {
    /// The database's time when it was read (the statement's middle, as well as one can tell).
    db: Millis,
    at: Instant,
    wall: SystemTime,
}

#[derive(Default)]
pub(super) struct DbClock(Mutex<Option<Sample>>);

impl DbClock {
    /// The database's time now, from the sample kept; `None` when the database must be asked.
    pub(super) fn now(&self) -> Option<Millis> {
        let s = (*self.0.lock().unwrap_or_else(|p| p.into_inner()))?;
        let mono = s.at.elapsed();
        let wall = SystemTime::now().duration_since(s.wall).ok()?;
        if mono > KEEP || mono.abs_diff(wall) > SLACK {
            return None;
        }
        Some(s.db + mono.as_millis() as Millis)
    }

    /// Keeps `db`, the database's time read by a statement sent at `sent`.
    pub(super) fn sampled(&self, db: Millis, sent: Instant) {
        let now = Instant::now();
        // The statement ran somewhere between its sending and its answer: the middle is the
        // closest guess, and the round trip a few hundred microseconds.
        let at = sent + now.duration_since(sent) / 2;
        let wall = SystemTime::now() - now.duration_since(at);
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(Sample { db, at, wall });
    }

    /// Drops the sample: the next batch asks the database (after a failed batch, whose
    /// connection may have been another server's).
    pub(super) fn forget(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_counts_forward_and_expires() {
        let c = DbClock::default();
        assert_eq!(c.now(), None);
        c.sampled(1_000_000, Instant::now());
        let t = c.now().unwrap();
        assert!((1_000_000..1_000_050).contains(&t), "{t}");
        std::thread::sleep(Duration::from_millis(30));
        assert!(c.now().unwrap() >= t + 30);
        c.forget();
        assert_eq!(c.now(), None);
    }

    #[test]
    fn a_sample_older_than_a_second_is_not_used() {
        let c = DbClock::default();
        let old = Instant::now() - Duration::from_millis(1500);
        *c.0.lock().unwrap() = Some(Sample {
            db: 5,
            at: old,
            wall: SystemTime::now() - Duration::from_millis(1500),
        });
        assert_eq!(c.now(), None);
    }

    #[test]
    fn a_stepped_or_suspended_clock_drops_the_sample() {
        let c = DbClock::default();
        // The wall clock says 10 s passed, the monotonic clock 0.1 s: the machine slept, or
        // the wall clock was stepped; either way the count is not trusted.
        *c.0.lock().unwrap() = Some(Sample {
            db: 5,
            at: Instant::now() - Duration::from_millis(100),
            wall: SystemTime::now() - Duration::from_secs(10),
        });
        assert_eq!(c.now(), None);
    }
}
