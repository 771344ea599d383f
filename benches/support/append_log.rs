//! The durable half of the 1-connection floor: a log that a bare proxy appends a frame to, and
//! makes durable with `fdatasync`, before it forwards a write and again before it answers, on the
//! request's own thread, as oncegate's lone call does (`store/sled/slot.rs`). No encoding,
//! decision, cache or drain: only the two durable appends that every durable write makes.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

/// Frames the size of oncegate's claim and settlement frames in this bench (the write-ahead
/// log's `pwrite`s, seen with `perf trace`: about 1.5 and 1.9 KiB).
pub const CLAIM_FRAME: usize = 1536;
pub const SETTLE_FRAME: usize = 1920;
/// Written ahead with zeros, as the write-ahead log is, and reused from the start when full.
const SIZE: u64 = 64 << 20;

pub struct AppendLog {
    file: File,
    at: Mutex<u64>,
    frame: Vec<u8>,
}

impl AppendLog {
    pub fn create(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(path)?;
        let zeros = vec![0u8; 1 << 20];
        for i in 0..SIZE / zeros.len() as u64 {
            file.write_all_at(&zeros, i * zeros.len() as u64)?;
        }
        file.sync_all()?;
        Ok(AppendLog {
            file,
            at: Mutex::new(0),
            frame: vec![0x5a; SETTLE_FRAME.max(CLAIM_FRAME)],
        })
    }

    /// Appends `len` bytes and makes them durable before returning (one append at a time).
    pub fn append(&self, len: usize) -> std::io::Result<()> {
        let mut at = self.at.lock().unwrap();
        if *at + len as u64 > SIZE {
            *at = 0;
        }
        self.file.write_all_at(&self.frame[..len], *at)?;
        self.file.sync_data()?;
        *at += len as u64;
        Ok(())
    }
}
