//! Log files let go and taken again: the checkpointer (and the open) keeps the newest file it is
//! done with as a spare, a clean close up to two, and the next file starts in one ([`recycle`]).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::Path;

use super::frame::HEADER;
use super::{file_name, files, generations, PAGE};

/// A kept spare's name ends so; log files end `.wal`.
const SPARE: &str = "spare";

/// Lets every log file up to and including `generation` go (sled holds their frames durably):
/// the newest of them stays as the spare the next file starts in, if there is none yet
/// ([`recycle`]); the rest are deleted.
pub fn recycle_through(dir: &Path, generation: u64) -> Result<(), String> {
    let_go(dir, generation, 1)
}

/// [`recycle_through`], keeping the newest files let go as spares until there are `spares`.
pub(super) fn let_go(dir: &Path, generation: u64, spares: usize) -> Result<(), String> {
    let gens: Vec<u64> = generations(dir)?
        .into_iter()
        .filter(|g| *g <= generation)
        .collect();
    let room = spares.saturating_sub(files::numbered(dir, SPARE)?.len());
    let kept = &gens[gens.len().saturating_sub(room)..];
    let mut changed = false;
    for &g in &gens {
        let path = dir.join(file_name(g));
        let done = if kept.contains(&g) {
            std::fs::rename(&path, dir.join(spare_name(g)))
        } else {
            std::fs::remove_file(&path)
        };
        match done {
            Ok(()) => changed = true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("retire {}: {e}", path.display())),
        }
    }
    if changed {
        files::fsync_dir(dir).map_err(|e| format!("fsync {}: {e}", dir.display()))?;
    }
    Ok(())
}

/// The generation of the newest spare in `dir`, if any.
pub(super) fn newest(dir: &Path) -> Result<Option<u64>, String> {
    Ok(files::numbered(dir, SPARE)?.pop())
}

fn spare_name(generation: u64) -> String {
    format!("{generation:020}.{SPARE}")
}

/// The largest spare in `dir` (the newest of equals), made the log file of `generation`, and how
/// much of it frames overwrite (its length in whole pages), or `None` if there is none to take.
/// (After a clean close there may be two: the checkpointer's, and the file the close let go,
/// which may hold a few frames only.)
///
/// Its first frame's header is zeroed and made durable before the rename, so the file holds no
/// frame of its new generation until one is appended: a crash right after the rename leaves an
/// empty newest file, and leftovers past the new frames never check under the new generation
/// ([`super::read_frames`]). Only this takes spares (on the writer's thread, or at open before the writer
/// starts) and nothing deletes them, so the one listed is there to open.
pub(super) fn recycle(dir: &Path, generation: u64) -> Result<Option<(File, u64)>, String> {
    let mut largest = None;
    for g in files::numbered(dir, SPARE)? {
        let path = dir.join(spare_name(g));
        let len = std::fs::metadata(&path)
            .map_err(|e| format!("stat {}: {e}", path.display()))?
            .len();
        if largest.is_none_or(|(_, l)| len >= l) {
            largest = Some((g, len));
        }
    }
    let Some((g, len)) = largest else {
        return Ok(None);
    };
    let from = dir.join(spare_name(g));
    let file = files::private()
        .read(true)
        .write(true)
        .open(&from)
        .map_err(|e| format!("open {}: {e}", from.display()))?;
    let to = dir.join(file_name(generation));
    file.write_all_at(&[0; HEADER], 0)
        .and_then(|()| file.sync_data())
        .map_err(|e| format!("recycle {}: {e}", from.display()))?;
    std::fs::rename(&from, &to)
        .map_err(|e| format!("rename {} to {}: {e}", from.display(), to.display()))?;
    files::fsync_dir(dir).map_err(|e| format!("fsync {}: {e}", dir.display()))?;
    Ok(Some((file, len / PAGE * PAGE)))
}

#[cfg(test)]
mod tests {
    use super::super::tests::{frame, put, replay};
    use super::super::{encode, Change, Wal, EXTEND_BYTES};
    use super::*;

    /// A frame as versions before recycling wrote it: the checksum over the payload alone.
    fn legacy_frame(changes: &[Change]) -> Vec<u8> {
        let mut out = Vec::new();
        encode(changes, &mut out);
        let len = (out.len() - HEADER) as u32;
        let crc = crc32fast::hash(&out[HEADER..]);
        out[..4].copy_from_slice(&len.to_le_bytes());
        out[4..HEADER].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// A change whose frame takes exactly one page: `k` set to `v` run on with dots. A frame
    /// ending at a page's end is followed by no zeros ([`Wal::append`]), so what the file held
    /// before starts right after it, where a replay looks for the next frame.
    fn page(v: &str) -> Change {
        let change = put("k", &format!("{v:.<4078}"));
        assert_eq!(frame(std::slice::from_ref(&change)).len() as u64, PAGE);
        change
    }

    /// What a replay of `dir` finds (the log it opens is closed again).
    fn replayed(dir: &Path) -> Vec<Vec<Change>> {
        replay(dir).expect("test step").1
    }

    fn spares(dir: &Path) -> Vec<u64> {
        files::numbered(dir, SPARE).expect("test step")
    }

    /// A log of generation 1 full of page-sized frames `old{n}` is let go with a spare kept,
    /// generation 2 gets `two`, and generation 3 starts in the spare.
    fn recycled(dir: &Path) -> Wal {
        let (mut wal, _) = replay(dir).expect("test step");
        for n in 0..50 {
            wal.append(&mut frame(&[page(&format!("old{n}"))]))
                .expect("test step");
        }
        assert_eq!(wal.start_next().expect("test step"), 1);
        let old_len = std::fs::metadata(dir.join(file_name(1)))
            .expect("test step")
            .len();
        recycle_through(dir, 1).expect("test step");
        assert_eq!(spares(dir), vec![1], "the file let go is kept as a spare");
        assert_eq!(generations(dir).expect("test step"), vec![2]);
        wal.append(&mut frame(&[put("k", "two")]))
            .expect("test step");
        wal.start_next().expect("test step");
        assert!(spares(dir).is_empty(), "the spare was taken");
        assert_eq!(generations(dir).expect("test step"), vec![2, 3]);
        assert_eq!(
            wal.allocated,
            old_len / PAGE * PAGE,
            "its blocks are written already"
        );
        wal
    }

    /// [`recycled`], with a page-sized frame `three` in generation 3.
    fn recycled_with_three(dir: &Path) -> Wal {
        let mut wal = recycled(dir);
        wal.append(&mut frame(&[page("three")])).expect("test step");
        wal
    }

    /// What a replay of [`recycled_with_three`] finds.
    fn two_and_three() -> Vec<Vec<Change>> {
        vec![vec![put("k", "two")], vec![page("three")]]
    }

    #[test]
    fn a_recycled_file_replays_its_own_frames_never_what_it_held_before() {
        let tmp = tempfile::tempdir().expect("test step");
        let dir = tmp.path().join("wal");
        let wal = recycled_with_three(&dir);
        let (len, allocated) = (wal.len, wal.allocated);
        drop(wal);
        let on_disk = std::fs::metadata(dir.join(file_name(3))).expect("test step");
        assert_eq!(on_disk.len(), allocated, "no zeros were written ahead");
        assert!(len < allocated);
        let (wal, seen) = replay(&dir).expect("test step");
        assert_eq!(seen, two_and_three());
        drop(wal);
        // The leftovers were cut off with the open: as an older file it ends cleanly.
        assert_eq!(replayed(&dir), two_and_three());
    }

    #[test]
    fn a_recycled_file_rotated_away_ends_at_its_last_frame() {
        let tmp = tempfile::tempdir().expect("test step");
        let dir = tmp.path().join("wal");
        let mut wal = recycled_with_three(&dir);
        let len = wal.len;
        wal.start_next().expect("test step");
        drop(wal);
        let on_disk = std::fs::metadata(dir.join(file_name(3))).expect("test step");
        assert_eq!(on_disk.len(), len, "what it held before is cut off");
        // An older file with anything but zeros after its frames would be refused as corrupt.
        assert_eq!(replayed(&dir), two_and_three());
    }

    /// A log file as versions before recycling wrote it (generation 1: a page-sized `k=1…`, then
    /// `k=2`), replayed, kept as the spare generation 3 starts in (after `k=two` in generation 2).
    fn recycled_from_before(dir: &Path) -> Wal {
        files::create_dir(dir).expect("test step");
        let mut bytes = legacy_frame(&[page("1")]);
        bytes.extend(legacy_frame(&[put("k", "2")]));
        std::fs::write(dir.join(file_name(1)), &bytes).expect("test step");
        // Written before recycling: replayed as it is.
        let (mut wal, seen) = replay(dir).expect("test step");
        assert_eq!(seen, vec![vec![page("1")], vec![put("k", "2")]]);
        recycle_through(dir, 1).expect("test step");
        wal.append(&mut frame(&[put("k", "two")]))
            .expect("test step");
        wal.start_next().expect("test step");
        assert_eq!(
            (wal.generation, wal.allocated),
            (3, bytes.len() as u64 / PAGE * PAGE)
        );
        wal
    }

    /// A crash right after a spare became generation 3, before it has a frame: the newest file
    /// is empty, whether the spare's frames were written by this version or (checking as they
    /// were written) by one from before.
    #[test]
    fn a_crash_right_after_recycling_leaves_an_empty_newest_file() {
        for spare in [recycled, recycled_from_before] {
            let tmp = tempfile::tempdir().expect("test step");
            let dir = tmp.path().join("wal");
            drop(spare(&dir));
            assert_eq!(replayed(&dir), vec![vec![put("k", "two")]]);
        }
    }

    #[test]
    fn files_from_before_recycling_replay_and_their_leftovers_never_do() {
        let tmp = tempfile::tempdir().expect("test step");
        let dir = tmp.path().join("wal");
        let mut wal = recycled_from_before(&dir);
        let a = page("1");
        // Generation 3 gets one frame the size of the first old one: the second old frame,
        // intact and checking as it was written, follows it.
        let nine = page("9");
        wal.append(&mut frame(std::slice::from_ref(&nine)))
            .expect("test step");
        assert_eq!(wal.len as usize, legacy_frame(&[a]).len());
        drop(wal);
        assert_eq!(replayed(&dir), vec![vec![put("k", "two")], vec![nine]]);
    }

    #[test]
    fn the_checkpointer_keeps_one_spare_and_deletes_the_rest() {
        let tmp = tempfile::tempdir().expect("test step");
        let dir = tmp.path().join("wal");
        let (mut wal, _) = replay(&dir).expect("test step");
        for _ in 0..3 {
            wal.append(&mut frame(&[put("k", "v")])).expect("test step");
            wal.start_next().expect("test step");
        }
        recycle_through(&dir, 3).expect("test step");
        assert_eq!(spares(&dir), vec![3], "the newest let go is kept");
        assert_eq!(generations(&dir).expect("test step"), vec![4]);
        wal.append(&mut frame(&[put("k", "v")])).expect("test step");
        wal.start_next().expect("test step");
        assert_eq!(generations(&dir).expect("test step"), vec![4, 5]);
        // One spare at most: with one kept, the next file let go is deleted.
        std::fs::rename(dir.join(file_name(5)), dir.join(spare_name(5))).expect("test step");
        recycle_through(&dir, 4).expect("test step");
        assert_eq!(spares(&dir), vec![5]);
        assert!(generations(&dir).expect("test step").is_empty());
    }

    /// A log whose generation 1, `pages` page-sized frames `old{n}`, was let go as the spare;
    /// generation 2 is current and empty.
    fn behind_a_spare(dir: &Path, pages: u64) -> Wal {
        let (mut wal, _) = replay(dir).expect("test step");
        for n in 0..pages {
            wal.append(&mut frame(&[page(&format!("old{n}"))]))
                .expect("test step");
        }
        wal.start_next().expect("test step");
        recycle_through(dir, 1).expect("test step");
        wal
    }

    #[test]
    fn a_clean_close_leaves_its_file_as_the_spare_the_next_open_starts_in() {
        let tmp = tempfile::tempdir().expect("test step");
        let dir = tmp.path().join("wal");
        let (mut wal, _) = replay(&dir).expect("test step");
        for n in 0..5 {
            wal.append(&mut frame(&[page(&format!("old{n}"))]))
                .expect("test step");
        }
        let allocated = wal.allocated;
        wal.retire().expect("test step");
        drop(wal);
        assert!(generations(&dir).expect("test step").is_empty());
        assert_eq!(
            spares(&dir),
            vec![1],
            "the closed file is kept as the spare"
        );
        // Reopened: a generation above the spare's, in the spare, its blocks written already.
        let (mut wal, seen) = replay(&dir).expect("test step");
        assert!(seen.is_empty(), "a spare is never replayed");
        assert_eq!(wal.generation, 2, "above the spare's generation");
        assert_eq!(wal.allocated, allocated, "its blocks are written already");
        assert!(spares(&dir).is_empty(), "the spare was taken");
        // A page-sized frame, so that what the file held before starts right after it.
        wal.append(&mut frame(&[page("new")])).expect("test step");
        drop(wal);
        // A crash now: the new frame replays, and nothing the file held before (under a
        // generation the spare's own, its frames would check again).
        assert_eq!(replayed(&dir), vec![vec![page("new")]]);
    }

    #[test]
    fn an_open_after_a_crash_starts_in_the_spare_and_keeps_the_last_file_replayed() {
        let tmp = tempfile::tempdir().expect("test step");
        let dir = tmp.path().join("wal");
        let mut wal = behind_a_spare(&dir, 5);
        let spare_len = std::fs::metadata(dir.join(spare_name(1)))
            .expect("test step")
            .len();
        wal.append(&mut frame(&[put("k", "two")]))
            .expect("test step");
        drop(wal);
        // The crash: generation 2 is replayed, and the new file starts in the spare.
        let (wal, seen) = replay(&dir).expect("test step");
        assert_eq!(seen, vec![vec![put("k", "two")]]);
        assert_eq!(wal.generation, 3);
        assert_eq!(wal.allocated, spare_len / PAGE * PAGE);
        // Once sled holds what was replayed, its file is the next spare.
        wal.retire_older().expect("test step");
        assert_eq!(spares(&dir), vec![2]);
        assert_eq!(generations(&dir).expect("test step"), vec![3]);
        drop(wal);
        assert!(replayed(&dir).is_empty());
    }

    #[test]
    fn a_clean_close_beside_a_kept_spare_leaves_one_for_the_open_and_one_for_its_rotation() {
        let tmp = tempfile::tempdir().expect("test step");
        let dir = tmp.path().join("wal");
        let mut wal = behind_a_spare(&dir, 5);
        wal.append(&mut frame(&[page("two")])).expect("test step");
        let allocated = wal.allocated;
        wal.retire().expect("test step");
        drop(wal);
        assert_eq!(
            spares(&dir),
            vec![1, 2],
            "the closed file is kept beside the spare"
        );
        let (mut wal, seen) = replay(&dir).expect("test step");
        assert!(seen.is_empty());
        assert_eq!(wal.generation, 3);
        assert_eq!(
            wal.allocated, allocated,
            "the open started in the newest spare"
        );
        assert_eq!(spares(&dir), vec![1]);
        wal.append(&mut frame(&[page("three")])).expect("test step");
        wal.start_next().expect("test step");
        assert!(spares(&dir).is_empty(), "the first rotation took the other");
        assert_eq!(wal.allocated, 5 * PAGE, "its blocks are written already");
        wal.append(&mut frame(&[page("four")])).expect("test step");
        drop(wal);
        assert_eq!(
            replayed(&dir),
            vec![vec![page("three")], vec![page("four")]]
        );
    }

    #[test]
    fn the_open_starts_in_the_largest_spare() {
        let tmp = tempfile::tempdir().expect("test step");
        let dir = tmp.path().join("wal");
        // Generation 1 holds more than the 1 MiB a new file is first extended by.
        let pages = EXTEND_BYTES / PAGE + 44;
        let mut wal = behind_a_spare(&dir, pages);
        wal.append(&mut frame(&[page("two")])).expect("test step");
        let two = wal.allocated;
        wal.retire().expect("test step");
        drop(wal);
        assert_eq!(spares(&dir), vec![1, 2]);
        let (mut wal, _) = replay(&dir).expect("test step");
        assert_eq!(wal.allocated, pages * PAGE, "the larger, older spare first");
        assert_eq!(spares(&dir), vec![2]);
        wal.start_next().expect("test step");
        assert_eq!(wal.allocated, two, "then the one the close let go");
        assert_eq!(wal.generation, 4);
    }
}
