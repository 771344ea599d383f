//! The disk guard (SPEC §13, issue 59): free space kept on the embedded store's volume.
//!
//! A write is recorded before it leaves and its outcome after, so a volume that fills between
//! the two leaves a sent write that cannot be settled (it is answered `unknown`). The guard
//! refuses new writes while the volume has less than `store.reserve` free (503 `store-full`,
//! nothing recorded, nothing sent) and `/readyz` says so; settlements, resolutions and reads go
//! on, in the reserve. The free space is read (`statvfs`) at most every [`EVERY`], not once a
//! write.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a reading of the free space stands.
const EVERY: Duration = Duration::from_millis(250);

pub struct Space {
    dir: PathBuf,
    reserve: u64,
    full: AtomicBool,
    /// Bytes free at the last reading.
    free: AtomicU64,
    /// When the free space is next read, in milliseconds since `born` (0: at once). A write
    /// checks it with one atomic load; the one that finds it due reads.
    next_read: AtomicU64,
    born: Instant,
}

impl Space {
    pub fn new(dir: PathBuf, reserve: u64) -> Space {
        Space {
            dir,
            reserve,
            full: AtomicBool::new(false),
            free: AtomicU64::new(u64::MAX),
            next_read: AtomicU64::new(0),
            born: Instant::now(),
        }
    }

    /// Whether the volume has less than the reserve free (read again when the last reading is
    /// older than [`EVERY`]). A volume whose free space cannot be read is taken as not full:
    /// the store's own writes fail, and say why, if it is.
    pub fn full(&self) -> bool {
        if self.reserve == 0 {
            return false;
        }
        let now = self.born.elapsed().as_millis() as u64;
        let due = self.next_read.load(Ordering::Relaxed);
        let reader = now >= due
            && self
                .next_read
                .compare_exchange(
                    due,
                    now + EVERY.as_millis() as u64,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok();
        if reader {
            if let Ok(s) = rustix::fs::statvfs(&self.dir) {
                let free = s.f_bavail.saturating_mul(s.f_frsize);
                self.free.store(free, Ordering::Relaxed);
                let full = free < self.reserve;
                if self.full.swap(full, Ordering::Relaxed) != full {
                    match full {
                        true => tracing::warn!("{}", self.why()),
                        false => tracing::info!(
                            free_mib = free >> 20,
                            "the store's volume has store.reserve free again: writes are taken"
                        ),
                    }
                }
            }
        }
        self.full.load(Ordering::Relaxed)
    }

    /// What `/readyz` and a refused write say.
    pub fn why(&self) -> String {
        format!(
            "the store's volume ({}) has {} MiB free, less than store.reserve ({} MiB): new \
             writes are refused until space is freed",
            self.dir.display(),
            self.free.load(Ordering::Relaxed) >> 20,
            self.reserve >> 20
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_reserve_above_the_volume_is_full_and_none_never_is() {
        let dir = tempfile::tempdir().unwrap();
        assert!(Space::new(dir.path().into(), u64::MAX).full());
        assert!(!Space::new(dir.path().into(), 0).full());
        assert!(!Space::new(dir.path().into(), 1).full());
        let s = Space::new(dir.path().into(), u64::MAX);
        s.full();
        assert!(s.why().contains("store.reserve"), "{}", s.why());
    }
}
