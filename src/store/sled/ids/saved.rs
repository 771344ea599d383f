//! The filter of held ids saved in the store's folder (`ids.filter`), and when an open may load
//! it. Reading every pointer at open touches every leaf of the `a/` keys, and sled keeps state
//! for every page it has touched: 33 MiB of the 136 MiB a proxy held right after opening a
//! million actions, and 1.4 s (docs/decisions.md). So the filter is saved wherever the
//! write-ahead log lets files go: at each checkpoint (by the checkpointer, from the filter as the
//! writer left it when it started the new log file), at a clean close, and at an open that
//! replayed frames or read the ids from sled.
//!
//! The file is bound to the write log's head when the filter was taken. Every id the store gives
//! a pointer comes with a claim, whose write-log entry is in the same batch: so the ids the file
//! may lack are those whose claims are in entries after its head, and an open loads it only when
//! every such entry was in a frame it replayed (whose pointers it adds), or when there is no such
//! entry at all.

use std::hash::BuildHasher;
use std::io::{self, Read as _, Write as _};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use foldhash::quality::FixedState;
use sha2::{Digest, Sha256};

use super::{Ids, Snapshot, LOAD_BITS_PER_ID, MIN_BITS};
use crate::store::files;
use crate::store::sled::codec::{log_lines, log_seq};
use crate::store::sled::pointers;
use crate::store::sled::Counts;
use crate::store::wal::Change;

/// The file the filter is saved in, in the store's folder.
pub(in crate::store::sled) const FILE: &str = "ids.filter";
const MAGIC: &[u8] = b"oncegate ids filter 1\n";
/// Ids whose hashes a saved filter carries: a build that hashes them otherwise (another version
/// of the hasher or of std's `Hash` for byte strings) would probe other bits, and does not load it.
const CHECK_IDS: [&[u8]; 3] = [b"", b"0123456789abcdef", b"a/oncegate"];

/// What a saved filter is bound to: the store, and its write log's head when the filter was
/// taken (every id with a claim up to that entry is in it), with the counts by state then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::store::sled) struct Binding {
    /// The store's id (`history::ID_KEY`).
    pub(in crate::store::sled) store: Vec<u8>,
    /// The write log's head: its newest entry's sequence number and hash.
    pub(in crate::store::sled) head: (u64, String),
    pub(in crate::store::sled) counts: Counts,
}

impl Binding {
    /// The binding of the store in `db` whose write log ends at `head`, with these counts.
    pub(in crate::store::sled) fn of(
        db: &sled::Db,
        head: (u64, String),
        counts: Counts,
    ) -> Result<Binding, String> {
        let store = db
            .get(crate::store::history::ID_KEY)
            .map_err(|e| format!("read the store id: {e}"))?
            .map(|v| v.to_vec())
            .unwrap_or_default();
        Ok(Binding {
            store,
            head,
            counts,
        })
    }
}

/// A saved filter as an open reads it before the write-ahead log's replay: the ids of the
/// pointers in the frames replayed are added to it ([`Saved::replayed`]), and what the frames'
/// write-log entries show past its head decides whether it is loaded ([`at_open`]).
pub(in crate::store::sled) struct Saved {
    ids: Ids,
    binding: Binding,
    reach: Reach,
}

/// How far the replayed frames carry the write log past a saved filter's head, entry after
/// entry.
#[derive(Debug, PartialEq, Eq)]
enum Reach {
    /// Every entry after the head up to `seq` was in a replayed frame, the first of them
    /// chained to the head; `last`, the line of the entry `seq` (empty while `seq` is the head).
    Through { seq: u64, last: Vec<u8> },
    /// A frame's entries started after an entry no frame had, or did not chain to the head.
    Broken(&'static str),
}

/// The filter an open gives the writer: loaded from the saved file or made from sled, and
/// whether the file as it is holds it (nothing to save before the replayed log files go).
pub(in crate::store::sled) struct Opened {
    pub(in crate::store::sled) ids: Ids,
    pub(in crate::store::sled) loaded: bool,
    pub(in crate::store::sled) saved: bool,
}

impl Saved {
    /// The filter saved in `dir`, if there is one this build can read (it is left in place: it
    /// stays true of the store until the log files after its head go, and a new one is saved
    /// before they do). What a save that stopped midway left is removed.
    pub(in crate::store::sled) fn read(dir: &Path) -> Option<Saved> {
        let _ = std::fs::remove_file(dir.join(format!("{FILE}.tmp")));
        let path = dir.join(FILE);
        let (len, file) = match std::fs::File::open(&path)
            .and_then(|f| Ok((f.metadata()?.len(), f)))
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "store: cannot read the saved ids filter; reading the ids from sled");
                return None;
            }
        };
        match Saved::parse(file, len) {
            Ok(saved) => Some(saved),
            Err(why) => {
                tracing::info!(
                    reason = why,
                    "store: the saved ids filter is not used; reading the ids from sled"
                );
                None
            }
        }
    }

    fn parse(r: impl io::Read, len: u64) -> Result<Saved, &'static str> {
        let (ids, binding) = parse(r, len)?;
        Ok(Saved {
            reach: Reach::Through {
                seq: binding.head.0,
                last: Vec::new(),
            },
            ids,
            binding,
        })
    }

    /// One replayed frame: its pointers' ids go into the filter, its write-log blocks extend
    /// (or break) the reach past the filter's head.
    pub(in crate::store::sled) fn replayed(&mut self, changes: &[Change]) {
        let mut blocks = Vec::new();
        for c in changes {
            if let Change::Merge(k, change) = c {
                // A bucket change: the ids it gives a pointer.
                for id in pointers::changed_ids(k, change)
                    .into_iter()
                    .flatten()
                    .flatten()
                {
                    self.ids.insert(id);
                }
            } else if let Change::Put(k, v) = c {
                if let Some(id) = k.strip_prefix(b"a/") {
                    // A frame of a version before buckets.
                    self.ids.insert(id);
                } else if let Some(first) = log_seq(k) {
                    blocks.push((first, v.as_slice()));
                }
            }
        }
        blocks.sort_unstable_by_key(|(first, _)| *first);
        for (first, block) in blocks {
            self.reach.extend(first, block, &self.binding.head);
        }
    }

    /// Whether this filter, with the replayed frames' ids, holds every id of the store bound
    /// to `now` (after the replay): the same store, and either the same head and counts, or
    /// every entry from the saved head to `now`'s in the replayed frames.
    fn holds_all(&self, now: &Binding) -> Result<(), &'static str> {
        let saved = &self.binding;
        if saved.store != now.store {
            return Err("it is another store's");
        }
        match now.head.0.cmp(&saved.head.0) {
            std::cmp::Ordering::Less => Err("the write log has changed since it was saved"),
            std::cmp::Ordering::Equal if now.head.1 != saved.head.1 => {
                Err("the write log has changed since it was saved")
            }
            std::cmp::Ordering::Equal if now.counts != saved.counts => {
                Err("the actions by state have changed since it was saved")
            }
            std::cmp::Ordering::Equal => Ok(()),
            std::cmp::Ordering::Greater => match &self.reach {
                Reach::Broken(why) => Err(why),
                Reach::Through { seq, last } if *seq == now.head.0 => {
                    match serde_json::from_slice::<crate::log::Entry>(last) {
                        Ok(e) if e.hash == now.head.1 => Ok(()),
                        _ => Err("the write log's head is not the replayed frames' last entry"),
                    }
                }
                Reach::Through { .. } => Err(
                    "the write log has changed since it was saved, and not only by the frames replayed",
                ),
            },
        }
    }
}

impl Reach {
    /// A replayed block of entries, `first` and on.
    fn extend(&mut self, first: u64, block: &[u8], head: &(u64, String)) {
        let Reach::Through { seq, last } = self else {
            return;
        };
        let lines = || log_lines(block);
        let n = memchr::memchr_iter(b'\n', block).count() as u64;
        let Some(end) = (first + n).checked_sub(1).filter(|&e| n > 0 && e > *seq) else {
            // Entries the reach already has (a frame from before the head, replayed again).
            return;
        };
        if first > *seq + 1 {
            *self = Reach::Broken("a write-log entry after it is in no frame replayed");
            return;
        }
        if *seq == head.0 {
            // The first entry after the head: it must follow from it.
            let next = lines().nth((head.0 + 1 - first) as usize);
            match next.map(serde_json::from_slice::<crate::log::Entry>) {
                Some(Ok(e)) if e.seq == head.0 + 1 && e.prev == head.1 => {}
                _ => {
                    *self = Reach::Broken("the write log after it does not follow from it");
                    return;
                }
            }
        }
        *seq = end;
        last.clear();
        last.extend_from_slice(lines().next_back().unwrap_or_default());
    }
}

/// The filter of the store at open, before the writer starts, once the write-ahead log is
/// replayed (through [`Saved::replayed`]) and the migrations done: the saved one when it holds
/// every id of the store bound to `now` and is not too full for `stored` ids, else made from
/// every pointer in sled ([`Ids::of`], at least `min_bits` large).
pub(in crate::store::sled) fn at_open(
    db: &sled::Db,
    saved: Option<Saved>,
    now: &Binding,
    stored: usize,
    min_bits: usize,
) -> Result<Opened, String> {
    if let Some(s) = saved {
        let fits = s.holds_all(now).and_then(|()| {
            if stored.max(s.ids.set).saturating_mul(LOAD_BITS_PER_ID) > s.ids.bits.len() * 64 {
                return Err("it is fuller than one made anew");
            }
            Ok(())
        });
        match fits {
            Ok(()) => {
                let saved = s.binding.head == now.head;
                tracing::info!(
                    ids = s.ids.set,
                    since_saved = now.head.0 - s.binding.head.0,
                    "store: loaded the saved filter of held ids (with the ids of the frames replayed)"
                );
                return Ok(Opened {
                    ids: s.ids,
                    loaded: true,
                    saved,
                });
            }
            Err(why) => tracing::info!(
                reason = why,
                "store: the saved ids filter is not used; reading the ids from sled"
            ),
        }
    }
    let started = std::time::Instant::now();
    let ids = Ids::of(db, stored, min_bits, || false)?;
    if ids.set > 0 {
        tracing::info!(
            ids = ids.set,
            seconds = started.elapsed().as_secs_f64(),
            "store: read the action ids from sled (a saved filter spares the next start this)"
        );
    }
    Ok(Opened {
        ids,
        loaded: false,
        saved: false,
    })
}

impl Snapshot {
    /// Saves the filter in `dir` for a later open, bound to `binding`: the store and the write
    /// log's head when this was taken. Written aside through a buffer (its words read as they
    /// are now: every bit set when it was taken, perhaps more), made durable, then renamed: the
    /// file is whole or absent.
    pub(in crate::store::sled) fn save(&self, dir: &Path, binding: &Binding) -> Result<(), String> {
        let path = dir.join(FILE);
        let hasher = FixedState::with_seed(self.seed);
        files::write_whole_with(&dir.join(format!("{FILE}.tmp")), &path, |out| {
            let mut out = Summed(out, Sha256::new());
            out.write_all(MAGIC)?;
            put_bytes(&mut out, &binding.store)?;
            out.write_all(&binding.head.0.to_le_bytes())?;
            put_bytes(&mut out, binding.head.1.as_bytes())?;
            out.write_all(&(binding.counts.len() as u64).to_le_bytes())?;
            for c in binding.counts {
                out.write_all(&c.to_le_bytes())?;
            }
            for n in [self.seed, self.set as u64, self.bits.len() as u64] {
                out.write_all(&n.to_le_bytes())?;
            }
            for id in CHECK_IDS {
                out.write_all(&hasher.hash_one(id).to_le_bytes())?;
            }
            // The words a buffer at a time: one write and one sum each, not one a word.
            let mut buf = Vec::with_capacity(64 << 10);
            for words in self.bits.chunks(8 << 10) {
                buf.clear();
                for w in words {
                    buf.extend_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
                }
                out.write_all(&buf)?;
            }
            let Summed(out, sum) = out;
            out.write_all(&sum.finalize())
        })
        .map_err(|e| format!("write {}: {e}", path.display()))
    }
}

/// A writer that sums what goes through it.
struct Summed<'a>(&'a mut dyn io::Write, Sha256);

impl io::Write for Summed<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.0.write(buf)?;
        self.1.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

/// A saved filter of `len` bytes and what it is bound to, if it is whole and hashes as this
/// build does. Read as a stream, its checksum summed as it goes: the filter's words are the
/// only copy of it in memory (a million actions' filter is 4 MiB).
fn parse(r: impl io::Read, len: u64) -> Result<(Ids, Binding), &'static str> {
    let mut r = Reader {
        r: io::BufReader::with_capacity(64 << 10, r),
        sum: Sha256::new(),
        left: len.checked_sub(32).ok_or("it is cut short")?,
    };
    if r.take(MAGIC.len())? != MAGIC {
        return Err("it is not a filter this version saves");
    }
    let store = r.take_bytes()?;
    let seq = r.u64()?;
    let hash = String::from_utf8(r.take_bytes()?).map_err(|_| "its head is not a hash")?;
    let mut counts = Counts::default();
    if r.u64()? != counts.len() as u64 {
        return Err("it counts other states");
    }
    for c in counts.iter_mut() {
        *c = r.u64()?;
    }
    let (seed, set, words) = (r.u64()?, r.u64()? as usize, r.u64()? as usize);
    let hasher = FixedState::with_seed(seed);
    for id in CHECK_IDS {
        if r.u64()? != hasher.hash_one(id) {
            return Err("this build hashes ids otherwise");
        }
    }
    let bits = words.checked_mul(64).ok_or("its size is not a filter's")?;
    if !bits.is_power_of_two() || bits < MIN_BITS || r.left != words as u64 * 8 {
        return Err("its size is not a filter's");
    }
    if set.saturating_mul(LOAD_BITS_PER_ID) > bits {
        return Err("it is fuller than one made anew");
    }
    let mut bits = Vec::with_capacity(words);
    let mut chunk = vec![0; 64 << 10];
    while bits.len() < words {
        let n = ((words - bits.len()) * 8).min(chunk.len());
        r.fill(&mut chunk[..n])?;
        bits.extend(
            chunk[..n]
                .chunks_exact(8)
                .map(|w| AtomicU64::new(u64::from_le_bytes(w.try_into().unwrap_or_default()))),
        );
    }
    let mut sum = [0; 32];
    r.r.read_exact(&mut sum).map_err(|_| "it is cut short")?;
    if r.sum.finalize().as_slice() != sum {
        return Err("its checksum does not match");
    }
    let binding = Binding {
        store,
        head: (seq, hash),
        counts,
    };
    Ok((Ids::from_words(bits.into(), set, seed), binding))
}

fn put_bytes(out: &mut impl io::Write, b: &[u8]) -> io::Result<()> {
    out.write_all(&(b.len() as u64).to_le_bytes())?;
    out.write_all(b)
}

/// Reads a saved filter front to back, summing what it reads, up to its checksum (`left` bytes
/// from here).
struct Reader<R> {
    r: io::BufReader<R>,
    sum: Sha256,
    left: u64,
}

impl<R: io::Read> Reader<R> {
    fn fill(&mut self, buf: &mut [u8]) -> Result<(), &'static str> {
        if self.left < buf.len() as u64 {
            return Err("it is cut short");
        }
        self.r.read_exact(buf).map_err(|_| "it is cut short")?;
        self.sum.update(&*buf);
        self.left -= buf.len() as u64;
        Ok(())
    }
    fn take(&mut self, n: usize) -> Result<Vec<u8>, &'static str> {
        if self.left < n as u64 {
            return Err("it is cut short");
        }
        let mut b = vec![0; n];
        self.fill(&mut b)?;
        Ok(b)
    }
    fn u64(&mut self) -> Result<u64, &'static str> {
        let mut b = [0; 8];
        self.fill(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn take_bytes(&mut self) -> Result<Vec<u8>, &'static str> {
        let n = usize::try_from(self.u64()?).map_err(|_| "it is cut short")?;
        self.take(n)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    use super::super::tests::id;

    fn parsed(b: &[u8]) -> Result<(Ids, Binding), &'static str> {
        parse(b, b.len() as u64)
    }

    fn binding() -> Binding {
        Binding {
            store: b"store-1".to_vec(),
            head: (42, "ab".repeat(32)),
            counts: std::array::from_fn(|i| i as u64 * 3),
        }
    }

    /// Saves `ids` bound to `binding()` and returns the file's bytes.
    fn saved(ids: &Ids) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        ids.save(dir.path(), &binding()).unwrap();
        assert!(!dir.path().join(format!("{FILE}.tmp")).exists());
        std::fs::read(dir.path().join(FILE)).unwrap()
    }

    fn words(ids: &Ids) -> Vec<u64> {
        ids.bits.iter().map(|w| w.load(Ordering::Relaxed)).collect()
    }

    #[test]
    fn a_saved_filter_loads_as_it_was_with_what_it_is_bound_to() {
        let mut ids = Ids::with_capacity(0, MIN_BITS);
        for i in 0..10_000 {
            ids.insert(&id(i));
        }
        let (loaded, bound) = parsed(&saved(&ids)).unwrap();
        assert_eq!(bound, binding());
        assert_eq!((words(&loaded) == words(&ids), loaded.set), (true, 10_000));
        assert!((0..10_000).all(|i| loaded.may_hold(&id(i))));
        let answers = |f: &Ids| (10_000..20_000).filter(|&i| f.may_hold(&id(i))).count();
        assert_eq!(
            answers(&loaded),
            answers(&ids),
            "the same hash, the same probes"
        );
    }

    /// A snapshot shares the filter's words: saved after more ids went in, it holds them too
    /// (never fewer than when it was taken).
    #[test]
    fn a_snapshot_saves_every_id_put_in_before_it_was_taken() {
        let mut ids = Ids::with_capacity(0, MIN_BITS);
        ids.insert(&id(1));
        let snap = ids.snapshot();
        ids.insert(&id(2));
        let dir = tempfile::tempdir().unwrap();
        snap.save(dir.path(), &binding()).unwrap();
        let (loaded, _) = parsed(&std::fs::read(dir.path().join(FILE)).unwrap()).unwrap();
        assert!(loaded.may_hold(&id(1)) && loaded.may_hold(&id(2)));
        assert_eq!(loaded.set, 1, "as many ids as when it was taken");
    }

    #[test]
    fn a_saved_filter_is_not_loaded_into_another_state_of_the_store() {
        let mut ids = Ids::with_capacity(0, MIN_BITS);
        ids.insert(&id(1));
        let bytes = saved(&ids);
        let holds = |now: &Binding| {
            Saved::parse(&bytes[..], bytes.len() as u64)
                .unwrap()
                .holds_all(now)
        };
        assert_eq!(holds(&binding()), Ok(()));
        let mut other = binding();
        other.store = b"store-2".to_vec();
        assert_eq!(holds(&other), Err("it is another store's"));
        for head in [(41, binding().head.1), (42, "cd".repeat(32))] {
            let other = Binding { head, ..binding() };
            assert_eq!(
                holds(&other),
                Err("the write log has changed since it was saved")
            );
        }
        // Later entries, none of them replayed: the ids of their claims may be missing.
        let other = Binding {
            head: (43, "cd".repeat(32)),
            ..binding()
        };
        assert!(holds(&other).is_err());
        let mut other = binding();
        other.counts[1] += 1;
        assert_eq!(
            holds(&other),
            Err("the actions by state have changed since it was saved")
        );
        for n in [0, 31, 32, bytes.len() - 1] {
            assert!(parsed(&bytes[..n]).is_err(), "cut at {n}");
        }
        let mut flipped = bytes.clone();
        flipped[bytes.len() - 100] ^= 1;
        assert_eq!(parsed(&flipped).err(), Some("its checksum does not match"));
    }

    /// A write log of `n` entries as the writer chains them (at time `now`), and each entry's
    /// line.
    fn chain(n: u64, now: u64) -> Vec<(u64, String, Vec<u8>)> {
        let chain = crate::log::Chain::new(None);
        let mut head = (0, crate::log::GENESIS.to_string());
        (1..=n)
            .map(|_| {
                let ev = crate::log::LogEvent::bare(
                    crate::log::Event::Resolved,
                    crate::log::Actor::Admin,
                );
                let (e, line) = chain.seal_line(ev, (head.0, &head.1), now);
                head = (e.seq, e.hash.clone());
                (e.seq, e.hash, line)
            })
            .collect()
    }

    /// A frame's write-log block of entries `from..=to` of `log`, keyed as the writer keys it.
    fn block(log: &[(u64, String, Vec<u8>)], from: u64, to: u64) -> Change {
        let mut b = Vec::new();
        for (_, _, line) in &log[from as usize - 1..to as usize] {
            b.extend_from_slice(line);
            b.push(b'\n');
        }
        Change::Put(crate::store::sled::index::log_key(from), b)
    }

    /// The filter saved at entry 10 of `log` and what the frames replayed after it show: it is
    /// loaded only when they hold every entry from the 11th to the head, chained to it. The ids
    /// of the pointers in those frames are added to it.
    #[test]
    fn a_saved_filter_is_loaded_after_a_crash_only_when_the_frames_replayed_hold_every_entry_since()
    {
        let log = chain(30, 1_700_000_000_000);
        let at = |n: u64| (n, log[n as usize - 1].1.clone());
        let bound = |n: u64| Binding {
            head: at(n),
            ..binding()
        };
        let dir = tempfile::tempdir().unwrap();
        let mut ids = Ids::with_capacity(0, MIN_BITS);
        ids.insert(b"old");
        ids.save(dir.path(), &bound(10)).unwrap();
        let replay = |frames: &[Vec<Change>], now: u64| {
            let mut s = Saved::read(dir.path()).unwrap();
            for f in frames {
                s.replayed(f);
            }
            // Other counts than when it was saved: the entries since moved them.
            let mut now = bound(now);
            now.counts[0] += 20;
            let holds = s.holds_all(&now);
            (holds, s.ids.may_hold(b"new"), s.ids.may_hold(b"old"))
        };
        let pointer = Change::Merge(
            pointers::Buckets::new([7; 16]).key("new"),
            pointers::change_value([("gone", None), ("new", Some(1))]),
        );
        // Replayed again from before the checkpoint, then the frames after it, in two files.
        let whole = [
            vec![block(&log, 5, 10)],
            vec![block(&log, 11, 12), pointer.clone()],
            vec![block(&log, 13, 30)],
        ];
        assert_eq!(replay(&whole, 30), (Ok(()), true, true));
        // A frame of a version before buckets, replayed by this one, gives its pointer's id.
        let old_frame = [vec![
            block(&log, 11, 30),
            Change::Put(b"a/new".to_vec(), vec![0; 8]),
        ]];
        assert_eq!(replay(&old_frame, 30), (Ok(()), true, true));
        // Blocks that overlap what was replayed before them.
        let overlapping = [vec![block(&log, 8, 20)], vec![block(&log, 15, 30)]];
        assert_eq!(replay(&overlapping, 30).0, Ok(()));
        // A file in the middle gone (entries 13 to 20): not loaded.
        let gap = [
            vec![block(&log, 11, 12), pointer.clone()],
            vec![block(&log, 21, 30)],
        ];
        assert_eq!(
            replay(&gap, 30).0,
            Err("a write-log entry after it is in no frame replayed")
        );
        // The first file after it gone.
        assert_eq!(
            replay(&[vec![block(&log, 12, 30)]], 30).0,
            Err("a write-log entry after it is in no frame replayed")
        );
        // The write log went on past the frames replayed.
        assert_eq!(
            replay(&[vec![block(&log, 11, 25)]], 30).0,
            Err(
                "the write log has changed since it was saved, and not only by the frames replayed"
            )
        );
        // Frames of another history: entry 11 does not follow from the saved head.
        let other = chain(30, 1_700_000_000_001);
        assert_eq!(
            replay(&[vec![block(&other, 11, 30)]], 30).0,
            Err("the write log after it does not follow from it")
        );
        // A head the frames do not end at (another hash at entry 30).
        let mut s = Saved::read(dir.path()).unwrap();
        s.replayed(&[block(&log, 11, 30)]);
        let other_head = Binding {
            head: (30, "cd".repeat(32)),
            ..binding()
        };
        assert_eq!(
            s.holds_all(&other_head),
            Err("the write log's head is not the replayed frames' last entry")
        );
    }

    #[test]
    fn a_filter_hashed_otherwise_or_too_full_is_not_loaded() {
        let ids = Ids::with_capacity(0, MIN_BITS);
        let bytes = saved(&ids);
        // The same file with other hashes of the check ids, under a checksum that matches.
        let resealed = |edit: &dyn Fn(&mut Vec<u8>)| {
            let mut b = bytes[..bytes.len() - 32].to_vec();
            edit(&mut b);
            let sum = Sha256::digest(&b);
            b.extend_from_slice(&sum);
            b
        };
        let checks = bytes.len() - 32 - ids.bits.len() * 8 - 8 * CHECK_IDS.len();
        let other_hash = resealed(&|b| b[checks] ^= 1);
        assert_eq!(
            parsed(&other_hash).err(),
            Some("this build hashes ids otherwise")
        );
        // `set` is the second of the three numbers before the checks.
        let set_at = checks - 16;
        let full = ids.bits.len() * 64 / LOAD_BITS_PER_ID + 1;
        let too_full =
            resealed(&|b| b[set_at..set_at + 8].copy_from_slice(&(full as u64).to_le_bytes()));
        assert_eq!(
            parsed(&too_full).err(),
            Some("it is fuller than one made anew")
        );
    }
}
