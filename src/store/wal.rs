//! The sled store's write-ahead log: what makes a group-commit batch durable.
//!
//! Each batch of changes (sled puts and removes) is appended to the current log file as one
//! frame and made durable with one `fdatasync`, before the batch is applied to sled. sled itself
//! is flushed (and its files fsynced) only at a checkpoint, when the log has grown past
//! [`CHECKPOINT_BYTES`]; the log then starts a new file and the old one is deleted. On open,
//! every remaining file is replayed in order into sled. Replaying is idempotent: a frame holds
//! whole values, so applying a frame sled already has changes nothing, and replaying every frame
//! after the last checkpoint in order rebuilds the state as of the last durable frame.
//!
//! Frame: `len: u32 LE | crc32(payload): u32 LE | payload`, payload a sequence of changes:
//! `1 | klen: u32 | key | vlen: u32 | value` (put) or `2 | klen: u32 | key` (remove). A frame
//! that is cut short or fails its checksum ends the last file (a write torn by a crash, never
//! acknowledged); in an earlier file it is corruption and the store does not open.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::files;

/// The log starts a new file (after sled is flushed and fsynced) once it is this large.
pub const CHECKPOINT_BYTES: u64 = 64 << 20;
/// The log file is extended with zeros this much at a time.
pub const EXTEND_BYTES: u64 = 1 << 20;
/// The zeros are written from a buffer of this size, written to once so that its pages are
/// resident: from a fresh allocation (pages not yet touched) the kernel's copy faults on every
/// page, falls short and zeroes the file's new blocks before trying again (measured: 3% of the
/// proxy's CPU at 64 connections, under `Wal::append`).
const ZEROS: usize = 64 << 10;

const PUT: u8 = 1;
const DEL: u8 = 2;
const HEADER: usize = 8;

/// One change of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Put(Vec<u8>, Vec<u8>),
    Del(Vec<u8>),
}

impl Change {
    /// `(key, Some(value))` for a put, `(key, None)` for a removal.
    pub fn as_pair(&self) -> (&[u8], Option<&[u8]>) {
        match self {
            Change::Put(k, v) => (k, Some(v)),
            Change::Del(k) => (k, None),
        }
    }
}

/// Encodes a batch as one frame (header included).
pub fn encode(changes: &[Change], out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&[0; HEADER]);
    for c in changes {
        match c {
            Change::Put(k, v) => {
                out.push(PUT);
                out.extend_from_slice(&(k.len() as u32).to_le_bytes());
                out.extend_from_slice(k);
                out.extend_from_slice(&(v.len() as u32).to_le_bytes());
                out.extend_from_slice(v);
            }
            Change::Del(k) => {
                out.push(DEL);
                out.extend_from_slice(&(k.len() as u32).to_le_bytes());
                out.extend_from_slice(k);
            }
        }
    }
    let len = (out.len() - HEADER) as u32;
    let crc = crc32fast::hash(&out[HEADER..]);
    out[..4].copy_from_slice(&len.to_le_bytes());
    out[4..HEADER].copy_from_slice(&crc.to_le_bytes());
}

fn take<'a>(p: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if p.len() < n {
        return None;
    }
    let (a, b) = p.split_at(n);
    *p = b;
    Some(a)
}

fn take_u32(p: &mut &[u8]) -> Option<usize> {
    take(p, 4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(|b| u32::from_le_bytes(b) as usize)
}

fn decode_payload(mut p: &[u8]) -> Option<Vec<Change>> {
    let mut out = Vec::new();
    while !p.is_empty() {
        let kind = take(&mut p, 1)?[0];
        let klen = take_u32(&mut p)?;
        let key = take(&mut p, klen)?.to_vec();
        match kind {
            PUT => {
                let vlen = take_u32(&mut p)?;
                out.push(Change::Put(key, take(&mut p, vlen)?.to_vec()));
            }
            DEL => out.push(Change::Del(key)),
            _ => return None,
        }
    }
    Some(out)
}

/// The frames of one file's bytes, how many bytes they take, and whether the rest is only the
/// zeros the file was extended with (else the end is torn or corrupt).
pub fn frames(bytes: &[u8]) -> (Vec<Vec<Change>>, usize, bool) {
    let mut out = Vec::new();
    let mut p = bytes;
    let mut good = 0;
    // A zero length never starts a frame (empty batches are not written): it is where the
    // written part of a preallocated file ends.
    while p.len() >= 4 && p[..4] != [0; 4] {
        let frame = take_u32(&mut p)
            .zip(take_u32(&mut p))
            .and_then(|(len, crc)| {
                let payload = take(&mut p, len)?;
                if crc32fast::hash(payload) as usize != crc {
                    return None;
                }
                decode_payload(payload).map(|c| (c, HEADER + len))
            });
        match frame {
            Some((changes, size)) => {
                out.push(changes);
                good += size;
            }
            None => break,
        }
    }
    let clean = bytes[good..].iter().all(|b| *b == 0);
    (out, good, clean)
}

/// [`ZEROS`] bytes of zeros, each page written: `vec![0; n]` may leave them untouched, and so may
/// zeros written over an allocation (the compiler may make that a zeroed allocation), so the
/// pages get ones first, which `black_box` keeps.
fn resident_zeros() -> Vec<u8> {
    let mut z = vec![1u8; ZEROS];
    std::hint::black_box(&mut z);
    z.fill(0);
    z
}

fn file_name(generation: u64) -> String {
    format!("{generation:020}.wal")
}

/// The log files in `dir`, oldest first, by generation.
fn generations(dir: &Path) -> Result<Vec<u64>, String> {
    files::numbered(dir, "wal")
}

/// The log of one store folder.
pub struct Wal {
    dir: PathBuf,
    generation: u64,
    file: Arc<File>,
    /// Where the next frame goes, and how far the file is already extended with zeros.
    len: u64,
    allocated: u64,
    /// [`ZEROS`] bytes of zeros, resident.
    zeros: Vec<u8>,
}

impl Wal {
    /// Replays every log file in `dir` (created if missing) through `apply`, oldest first, and
    /// opens a new file after them. The replayed files stay until [`Wal::remove_older`]: the
    /// caller makes sled durable first.
    pub fn open(
        dir: &Path,
        mut apply: impl FnMut(Vec<Change>) -> Result<(), String>,
    ) -> Result<(Wal, usize), String> {
        files::create_dir(dir)?;
        let gens = generations(dir)?;
        let mut replayed = 0;
        for (i, g) in gens.iter().enumerate() {
            let path = dir.join(file_name(*g));
            let bytes = files::read(&path)?;
            let (fs, good, clean) = frames(&bytes);
            if good < bytes.len() {
                if !clean && i + 1 < gens.len() {
                    return Err(format!(
                        "{} is corrupt after {} frames (only the newest file may end torn)",
                        path.display(),
                        fs.len()
                    ));
                }
                // A write torn by a crash, never acknowledged (or zeros not yet written over):
                // cut it off, so that this file ends cleanly once it is no longer the newest.
                files::cut(&path, good as u64)?;
            }
            for changes in fs {
                apply(changes)?;
                replayed += 1;
            }
        }
        let generation = gens.last().map_or(1, |g| g + 1);
        let file = Self::create(dir, generation)?;
        Ok((
            Wal {
                dir: dir.to_owned(),
                generation,
                file: Arc::new(file),
                len: 0,
                allocated: 0,
                zeros: resident_zeros(),
            },
            replayed,
        ))
    }

    fn create(dir: &Path, generation: u64) -> Result<File, String> {
        let path = dir.join(file_name(generation));
        let file = files::private()
            .create_new(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("create {}: {e}", path.display()))?;
        files::fsync_dir(dir).map_err(|e| format!("fsync {}: {e}", dir.display()))?;
        Ok(file)
    }

    /// Appends one encoded frame (not yet durable).
    ///
    /// The file is extended ahead with zeros, [`EXTEND_BYTES`] at a time, so that most frames
    /// overwrite blocks that already exist: their fdatasync then writes the data alone, not also
    /// a journal commit for the file's new size (measured here: ~135 µs against ~215 µs).
    pub fn append(&mut self, frame: &[u8]) -> io::Result<()> {
        let end = self.len + frame.len() as u64;
        if end > self.allocated {
            let grow = EXTEND_BYTES.max(end - self.allocated);
            let stop = self.allocated + grow;
            while self.allocated < stop {
                let n = (stop - self.allocated).min(ZEROS as u64) as usize;
                self.file.write_all_at(&self.zeros[..n], self.allocated)?;
                self.allocated += n as u64;
            }
        }
        self.file.write_all_at(frame, self.len)?;
        self.len = end;
        Ok(())
    }

    /// The current file, for another thread to fdatasync.
    pub fn file(&self) -> Arc<File> {
        self.file.clone()
    }

    /// The log has grown past `limit` bytes: sled should be made durable and the log started
    /// afresh.
    pub fn wants_checkpoint(&self, limit: u64) -> bool {
        self.len >= limit
    }

    /// Starts a new file and returns the previous one's generation, which stays until someone
    /// has made sled durable past its last frame and calls [`remove_through`].
    pub fn start_next(&mut self) -> Result<u64, String> {
        // Frames the syncer has not made durable (notes and lease renewals wait for a later
        // batch's fdatasync, which now goes to the new file) are made durable here: a power cut
        // must not tear an older file, which an open would take for corruption.
        self.file
            .sync_data()
            .map_err(|e| format!("fdatasync the write-ahead log before rotating: {e}"))?;
        let next = self.generation + 1;
        self.file = Arc::new(Self::create(&self.dir, next)?);
        let previous = self.generation;
        self.generation = next;
        self.len = 0;
        self.allocated = 0;
        Ok(previous)
    }

    /// Deletes every file before the current one: called once sled holds their frames durably
    /// (after sled's flush and fsync).
    pub fn remove_older(&self) -> Result<(), String> {
        remove_through(&self.dir, self.generation.saturating_sub(1))
    }
}

/// Deletes every log file up to and including `generation` (sled holds their frames durably).
pub fn remove_through(dir: &Path, generation: u64) -> Result<(), String> {
    let gens = generations(dir)?;
    let mut removed = false;
    for g in gens.into_iter().filter(|g| *g <= generation) {
        let path = dir.join(file_name(g));
        match std::fs::remove_file(&path) {
            Ok(()) => removed = true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("remove {}: {e}", path.display())),
        }
    }
    if removed {
        files::fsync_dir(dir).map_err(|e| format!("fsync {}: {e}", dir.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(k: &str, v: &str) -> Change {
        Change::Put(k.as_bytes().to_vec(), v.as_bytes().to_vec())
    }

    fn frame(changes: &[Change]) -> Vec<u8> {
        let mut out = Vec::new();
        encode(changes, &mut out);
        out
    }

    #[test]
    fn frames_round_trip() {
        let a = vec![put("a/1", "one"), Change::Del(b"s/x".to_vec())];
        let b = vec![put("a/2", ""), put("", "empty key")];
        let mut bytes = frame(&a);
        bytes.extend(frame(&b));
        let n = bytes.len();
        assert_eq!(frames(&bytes), (vec![a.clone(), b.clone()], n, true));
        // Zeros after the frames (a preallocated file) end it cleanly.
        bytes.extend([0; 100]);
        assert_eq!(frames(&bytes), (vec![a, b], n, true));
    }

    #[test]
    fn a_torn_or_corrupt_tail_ends_the_frames() {
        let a = vec![put("a/1", "one")];
        let mut bytes = frame(&a);
        let n = bytes.len();
        let b = frame(&[put("a/2", "two")]);
        for cut in 1..b.len() {
            let mut torn = bytes.clone();
            torn.extend_from_slice(&b[..cut]);
            assert_eq!(frames(&torn).0, vec![a.clone()], "cut at {cut}");
            assert_eq!(frames(&torn).1, n, "cut at {cut}");
        }
        let mut flipped = b.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        bytes.extend(flipped);
        assert_eq!(frames(&bytes), (vec![a], n, false));
    }

    fn replay(dir: &Path) -> Result<(Wal, Vec<Vec<Change>>), String> {
        let mut seen = Vec::new();
        let (wal, n) = Wal::open(dir, |c| {
            seen.push(c);
            Ok(())
        })?;
        assert_eq!(n, seen.len());
        Ok((wal, seen))
    }

    #[test]
    fn files_replay_in_order_until_checkpointed() {
        let tmp = tempfile::tempdir().expect("test step");
        let dir = tmp.path().join("wal");
        let (mut wal, seen) = replay(&dir).expect("test step");
        assert!(seen.is_empty());
        wal.append(&frame(&[put("k", "1")])).expect("test step");
        wal.start_next().expect("test step");
        wal.remove_older().expect("test step");
        wal.append(&frame(&[put("k", "2")])).expect("test step");
        wal.file().sync_data().expect("test step");
        drop(wal);
        // Reopened: only the file after the last rotation is replayed.
        let (mut wal, seen) = replay(&dir).expect("test step");
        assert_eq!(seen, vec![vec![put("k", "2")]]);
        // Not yet checkpointed: a second crash replays it again, then the new file.
        wal.append(&frame(&[put("k", "3")])).expect("test step");
        drop(wal);
        let (wal, seen) = replay(&dir).expect("test step");
        assert_eq!(seen, vec![vec![put("k", "2")], vec![put("k", "3")]]);
        wal.remove_older().expect("test step");
        drop(wal);
        assert!(replay(&dir).expect("test step").1.is_empty());
    }

    #[test]
    fn frames_past_the_zeros_written_ahead_replay_whole() {
        let tmp = tempfile::tempdir().expect("test step");
        let dir = tmp.path().join("wal");
        let (mut wal, _) = replay(&dir).expect("test step");
        // A small frame, one larger than a whole extension, and one after it.
        let big = "x".repeat(EXTEND_BYTES as usize + ZEROS / 2);
        let written = [put("k", "1"), put("big", &big), put("k", "2")];
        for c in &written {
            wal.append(&frame(std::slice::from_ref(c)))
                .expect("test step");
        }
        let (len, allocated) = (wal.len, wal.allocated);
        assert!(allocated >= len);
        drop(wal);
        let on_disk = std::fs::metadata(dir.join(file_name(1))).expect("test step");
        assert_eq!(
            on_disk.len(),
            allocated,
            "the file is extended with zeros ahead"
        );
        let (_, seen) = replay(&dir).expect("test step");
        assert_eq!(seen, written.map(|c| vec![c]));
    }

    #[test]
    fn a_torn_newest_file_is_cut_and_older_corruption_refuses_to_open() {
        let tmp = tempfile::tempdir().expect("test step");
        let dir = tmp.path().join("wal");
        let (mut wal, _) = replay(&dir).expect("test step");
        wal.append(&frame(&[put("k", "1")])).expect("test step");
        wal.append(&[7, 0, 0, 0, 1, 2, 3, 4, 5]).expect("test step");
        drop(wal);
        // The torn frame ends the newest file: accepted, and cut off.
        let (wal, seen) = replay(&dir).expect("test step");
        assert_eq!(seen.len(), 1);
        drop(wal);
        // A crash before the checkpoint: the cut file is now an older one, and still opens.
        let (wal, seen) = replay(&dir).expect("test step");
        assert_eq!(seen.len(), 1);
        drop(wal);
        // A bit flipped in an older file is corruption: refused, naming the file.
        let first = dir.join(file_name(1));
        let mut bytes = std::fs::read(&first).expect("test step");
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&first, bytes).expect("test step");
        let err = replay(&dir).err().expect("refused");
        assert!(err.contains("corrupt after 0 frames"), "{err}");
        assert!(err.contains(&file_name(1)), "{err}");
    }
}
