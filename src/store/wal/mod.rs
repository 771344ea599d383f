//! The sled store's write-ahead log: what makes a group-commit batch durable.
//!
//! Each batch of changes (sled puts and removes) is appended to the current log file as one
//! frame and made durable with one `fdatasync`, before the batch is applied to sled. sled itself
//! is flushed (and its files fsynced) only at a checkpoint, when the log has grown past
//! [`CHECKPOINT_BYTES`]; the log then starts a new file and the old one goes (deleted, or kept
//! as the spare a later file starts in: below). On open,
//! every remaining file is replayed in order into sled. Replaying is idempotent: a frame holds
//! whole values, so applying a frame sled already has changes nothing, and replaying every frame
//! after the last checkpoint in order rebuilds the state as of the last durable frame.
//!
//! Frame: `len: u32 LE | crc32(generation: u64 LE, payload): u32 LE | payload`, payload a
//! sequence of changes: `1 | klen: u32 | key | vlen: u32 | value` (put) or `2 | klen: u32 | key`
//! (remove). A frame that is cut short or fails its checksum ends the last file (a write torn by
//! a crash, never acknowledged); in an earlier file it is corruption and the store does not open.
//!
//! Files are recycled: a file the checkpointer is done with is kept as a spare (`{g}.spare`;
//! a clean close keeps up to two, [`Wal::retire`]), and the next file, or the next open's,
//! starts in one instead of in a new file, overwriting its blocks, so that its frames need no
//! zeros written ahead (see [`Wal::append`]). The generation in each frame's checksum is what
//! tells this file's frames from those left over from the spare's earlier life: they never
//! check under the new generation, which is above every file's and spare's. Files written
//! before recycling checksummed the payload alone; a file is read the way its first frame checks
//! ([`read_frames`]).
//!
//! `frame.rs` is a frame's bytes, `spare.rs` the files let go and taken again; this file is the
//! log of one store folder.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::files;

mod frame;
mod spare;

use frame::seal;
pub use frame::{encode, read_frames, Change};
use spare::recycle;
pub use spare::recycle_through;

/// One file's frames, read a frame at a time ([`read_frames`]): how many, the bytes they take,
/// whether the rest is only zeros, and the file's length.
fn read_file(
    path: &Path,
    generation: u64,
    each: impl FnMut(Vec<Change>) -> Result<(), String>,
) -> Result<(usize, u64, bool, u64), String> {
    let at = |e: String| format!("{}: {e}", path.display());
    let f = File::open(path).map_err(|e| at(e.to_string()))?;
    let len = f.metadata().map_err(|e| at(e.to_string()))?.len();
    let reader = io::BufReader::with_capacity(READ_BUFFER, f);
    let (frames, good, clean) = read_frames(reader, len, generation, each).map_err(at)?;
    Ok((frames, good, clean, len))
}

/// How much of a log file a replay reads at a time.
const READ_BUFFER: usize = 256 << 10;

/// The log starts a new file (after sled is flushed and fsynced) once it is this large.
pub const CHECKPOINT_BYTES: u64 = 64 << 20;
/// The log file is extended with zeros this much at a time.
pub const EXTEND_BYTES: u64 = 1 << 20;
/// A page of the page cache (x86-64, most arm64 kernels): writes end at a page's end
/// ([`Wal::append`]), and a file is extended a whole number of them at a time.
const PAGE: u64 = 4096;
/// The zeros are written from a buffer of this size, written to once so that its pages are
/// resident: from a fresh allocation (pages not yet touched) the kernel's copy faults on every
/// page, falls short and zeroes the file's new blocks before trying again (measured: 3% of the
/// proxy's CPU at 64 connections, under `Wal::append`).
const ZEROS: usize = 64 << 10;

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
    /// opens a new file after them, in the spare if there is one (a clean close leaves the last
    /// file as one: [`Wal::retire`]). The replayed files stay until [`Wal::retire_older`]: the
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
            let newest = i + 1 == gens.len();
            // An older file must end cleanly, or the open stops before any of its frames is
            // applied: it is read through once to check that, then again to apply them. The
            // newest may end torn, so it is applied as it is read. A frame at a time either way.
            if !newest {
                let (frames, _, clean, _) = read_file(&path, *g, |_| Ok(()))?;
                if !clean {
                    return Err(format!(
                        "{} is corrupt after {frames} frames (only the newest file may end torn)",
                        path.display(),
                    ));
                }
            }
            let (frames, good, _, len) = read_file(&path, *g, &mut apply)?;
            replayed += frames;
            // A write torn by a crash, never acknowledged (or zeros not yet written over): cut
            // it off, so that this file ends cleanly once it is no longer the newest.
            if good < len {
                files::cut(&path, good)?;
            }
        }
        // Above every file's generation, a spare's included: what a spare held must never check
        // under the generation it is taken for, and after a clean close a spare is all there is.
        let newest = gens.last().copied().max(spare::newest(dir)?);
        let generation = newest.map_or(1, |g| g + 1);
        let (file, allocated) = match recycle(dir, generation)? {
            Some(spare) => spare,
            None => (Self::create(dir, generation)?, 0),
        };
        Ok((
            Wal {
                dir: dir.to_owned(),
                generation,
                file: Arc::new(file),
                len: 0,
                allocated,
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

    /// Appends one frame from [`encode`] (not yet durable), its header filled in here.
    ///
    /// Frames overwrite blocks that already exist: their fdatasync then writes the data alone,
    /// not also a journal commit for the file's new size (measured here: ~135 µs against ~215
    /// µs). A recycled file has them already; a new one, or a recycled one past its old end, is
    /// extended ahead with zeros, [`EXTEND_BYTES`] at a time (whose fdatasync, one in several
    /// hundred at one connection, carries the megabyte: 2–3 ms).
    ///
    /// The write runs on with zeros to the end of the frame's last page ([`PAGE`]), so that no
    /// write covers only part of a page the kernel does not hold: it would read the block from
    /// the disk first, which a recycled file's pages, out of the page cache since their last
    /// use, would otherwise cost. The zeros are what a file's end is anyway; the next frame
    /// writes over them.
    pub fn append(&mut self, frame: &mut Vec<u8>) -> io::Result<()> {
        seal(frame, self.generation);
        let n = frame.len();
        let end = self.len + n as u64;
        let padded = end.next_multiple_of(PAGE);
        if padded > self.allocated {
            let stop = (self.allocated + EXTEND_BYTES).max(padded);
            while self.allocated < stop {
                let n = (stop - self.allocated).min(ZEROS as u64) as usize;
                self.file.write_all_at(&self.zeros[..n], self.allocated)?;
                self.allocated += n as u64;
            }
        }
        frame.resize(n + (padded - end) as usize, 0);
        let written = self.file.write_all_at(frame, self.len);
        frame.truncate(n);
        written?;
        self.len = end;
        Ok(())
    }

    /// Where the next frame goes: its file's generation and its offset in it. No two frames
    /// share it in a store's life (generations only grow, across runs too).
    pub fn position(&self) -> (u64, u64) {
        (self.generation, self.len)
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

    /// Starts a new file (in the spare, if there is one) and returns the previous one's
    /// generation, which stays until someone has made sled durable past its last frame and
    /// calls [`recycle_through`].
    pub fn start_next(&mut self) -> Result<u64, String> {
        // The file ends at its last frame (no zeros ahead, nor a recycled file's leftovers: an
        // older file must end cleanly), and frames the syncer has not made durable (notes and
        // lease renewals wait for a later batch's fdatasync, which now goes to the new file) are
        // made durable here: a power cut must not tear an older file, which an open would take
        // for corruption.
        self.file
            .set_len(self.len)
            .and_then(|()| self.file.sync_data())
            .map_err(|e| format!("fdatasync the write-ahead log before rotating: {e}"))?;
        let next = self.generation + 1;
        let (file, allocated) = match recycle(&self.dir, next)? {
            Some(spare) => spare,
            None => (Self::create(&self.dir, next)?, 0),
        };
        self.file = Arc::new(file);
        let previous = self.generation;
        self.generation = next;
        self.len = 0;
        self.allocated = allocated;
        Ok(previous)
    }

    /// Lets every file before the current one go: called once sled holds their frames durably
    /// (after sled's flush and fsync). The newest of them stays as the spare a later file starts
    /// in, if there is none ([`recycle_through`]).
    pub fn retire_older(&self) -> Result<(), String> {
        recycle_through(&self.dir, self.generation.saturating_sub(1))
    }

    /// Lets every file go, the current one too: called at a clean close, once sled holds every
    /// frame durably. Up to two stay as spares (the current file, its blocks written as far as
    /// its zeros reached, beside the one the checkpointer kept): the next open's file starts in
    /// one and its first rotation in the other, so a restart writes no zeros ahead until the
    /// checkpointer keeps spares again. No frame may be appended after this.
    pub fn retire(&self) -> Result<(), String> {
        spare::let_go(&self.dir, self.generation, 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn put(k: &str, v: &str) -> Change {
        Change::Put(k.as_bytes().to_vec(), v.as_bytes().to_vec())
    }

    /// A frame as [`Wal::append`] writes it in a file of generation 1.
    pub(super) fn frame(changes: &[Change]) -> Vec<u8> {
        let mut out = Vec::new();
        encode(changes, &mut out);
        seal(&mut out, 1);
        out
    }

    pub(super) fn replay(dir: &Path) -> Result<(Wal, Vec<Vec<Change>>), String> {
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
        wal.append(&mut frame(&[put("k", "1")])).expect("test step");
        wal.start_next().expect("test step");
        wal.retire_older().expect("test step");
        wal.append(&mut frame(&[put("k", "2")])).expect("test step");
        wal.file().sync_data().expect("test step");
        drop(wal);
        // Reopened: only the file after the last rotation is replayed.
        let (mut wal, seen) = replay(&dir).expect("test step");
        assert_eq!(seen, vec![vec![put("k", "2")]]);
        // Not yet checkpointed: a second crash replays it again, then the new file.
        wal.append(&mut frame(&[put("k", "3")])).expect("test step");
        drop(wal);
        let (wal, seen) = replay(&dir).expect("test step");
        assert_eq!(seen, vec![vec![put("k", "2")], vec![put("k", "3")]]);
        wal.retire_older().expect("test step");
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
            wal.append(&mut frame(std::slice::from_ref(c)))
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
        wal.append(&mut frame(&[put("k", "1")])).expect("test step");
        // A torn frame: its header promises 7 bytes, 5 made it.
        wal.file()
            .write_all_at(&[7, 0, 0, 0, 1, 2, 3, 4, 5], wal.len)
            .expect("test step");
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
        flip_last_bit(&dir.join(file_name(1)));
        let err = replay(&dir).err().expect("refused");
        assert!(err.contains("corrupt after 0 frames"), "{err}");
        assert!(err.contains(&file_name(1)), "{err}");
    }

    /// Corrupts a log file's last frame.
    fn flip_last_bit(path: &Path) {
        let mut bytes = std::fs::read(path).expect("test step");
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(path, bytes).expect("test step");
    }

    /// A file is read a frame at a time, but an older file's corruption is still found before
    /// any of its frames is applied: the open hands on nothing of a file it then refuses.
    #[test]
    fn an_older_files_corruption_is_found_before_its_frames_are_applied() {
        let tmp = tempfile::tempdir().expect("test step");
        let dir = tmp.path().join("wal");
        let (mut wal, _) = replay(&dir).expect("test step");
        for v in ["1", "2", "3"] {
            wal.append(&mut frame(&[put("k", v)])).expect("test step");
        }
        wal.start_next().expect("test step");
        wal.append(&mut frame(&[put("k", "4")])).expect("test step");
        drop(wal);
        flip_last_bit(&dir.join(file_name(1)));
        let mut applied = Vec::new();
        let err = Wal::open(&dir, |c| {
            applied.push(c);
            Ok(())
        })
        .err()
        .expect("refused");
        assert!(err.contains("corrupt after 2 frames"), "{err}");
        assert!(applied.is_empty(), "applied before refusing: {applied:?}");
    }
}
