//! What one `fdatasync` costs on the disk under the store, measured in the same run as the
//! workloads: the 1-connection write latency is held against it (two of them are in every
//! durable write).
//!
//! The probe does what the write-ahead log does at one connection: it overwrites, one frame at a
//! time, a file that was written out (and synced) beforehand, and makes each frame durable with
//! `fdatasync`. Overwriting allocated blocks leaves no metadata to flush, as in the log, which
//! keeps its files written ahead of its frames; appending to a growing file would cost more.
//!
//! It also counts the CPU its thread spends per durable frame (the `pwrite` and the
//! `fdatasync`, in the kernel): what making a write durable costs in CPU before any store's
//! work, which the CPU floor at 64 connections adds per flush.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::time::Instant;

/// The size of one probe write: about one claim's frame at one connection.
const FRAME: usize = 2048;

/// `fdatasync` latencies in µs, sorted, and the thread's CPU per frame made durable.
pub struct Probe(Vec<f64>, Option<f64>);

impl Probe {
    /// CPU µs the probe's thread spent per frame written and made durable (`None` where the
    /// kernel does not say: no `/proc/thread-self/schedstat`).
    pub fn cpu_us_per_sync(&self) -> Option<f64> {
        self.1
    }

    pub fn q(&self, q: f64) -> f64 {
        let i = ((self.0.len() as f64 * q) as usize).min(self.0.len().saturating_sub(1));
        self.0.get(i).copied().unwrap_or(0.0)
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

/// `n` frames written and made durable one by one in a file of its own in `dir`, written ahead:
/// each `fdatasync` timed.
pub fn measure(dir: &Path, n: usize) -> Probe {
    run(dir, n, Layout::WrittenAhead, false)
}

/// How the write-ahead log's file holds the frames it is given.
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    /// Blocks written before (a recycled log file; the probe writes them ahead).
    WrittenAhead,
    /// A new file, extended with zeros a megabyte at a time as frames reach its end (a new log
    /// file, `wal::EXTEND_BYTES`).
    Growing,
}

/// A durable append (the `pwrite` and its `fdatasync`, timed together) in a file written ahead,
/// as a recycled log file takes frames, and in a new file extended with zeros as it fills, as a
/// new log file does: the same `n` frames each, one after the other.
pub fn compare_layouts(dir: &Path, n: usize) -> (Probe, Probe) {
    (
        run(dir, n, Layout::WrittenAhead, true),
        run(dir, n, Layout::Growing, true),
    )
}

/// The probe's one loop: `n` frames of [`FRAME`] bytes, each made durable before the next;
/// `whole` times the write with its `fdatasync`, else the `fdatasync` alone.
fn run(dir: &Path, n: usize, layout: Layout, whole: bool) -> Probe {
    let path = dir.join("fsync-probe");
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)
        .expect("open the fsync probe's file");
    if layout == Layout::WrittenAhead {
        f.write_all(&vec![0u8; FRAME * n])
            .expect("write the probe's file ahead");
    }
    f.sync_all().expect("sync the probe's file");
    let frame = vec![0x5au8; FRAME];
    let zeros = vec![0u8; 64 << 10];
    let (mut len, mut allocated) = (0u64, 0u64);
    let mut lat = Vec::with_capacity(n);
    let cpu_before = thread_cpu_ns();
    for _ in 0..n {
        let t = Instant::now();
        if layout == Layout::Growing && len + FRAME as u64 > allocated {
            let stop = allocated + oncegate::store::wal::EXTEND_BYTES;
            while allocated < stop {
                f.write_all_at(&zeros, allocated).unwrap();
                allocated += zeros.len() as u64;
            }
        }
        f.write_all_at(&frame, len).unwrap();
        len += FRAME as u64;
        let t = if whole { t } else { Instant::now() };
        f.sync_data().expect("fdatasync the probe's file");
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let cpu = cpu_before
        .zip(thread_cpu_ns())
        .map(|(a, b)| b.saturating_sub(a) as f64 / 1e3 / n.max(1) as f64);
    drop(f);
    let _ = std::fs::remove_file(&path);
    lat.sort_by(|a, b| a.total_cmp(b));
    Probe(lat, cpu)
}

/// The calling thread's time on a CPU so far, in ns (the first field of its schedstat, which
/// counts the kernel's time in its system calls too, at ns resolution; its `stat` counts ticks).
fn thread_cpu_ns() -> Option<u64> {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}
