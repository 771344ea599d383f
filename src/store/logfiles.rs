//! The sled store's write log, in files of its own: append-only NDJSON segments
//! `log/{first seq:020}.ndjson`, one sealed entry per line, and `log/anchor` (`[seq, prev]`)
//! where a pruned log starts. Closed segments are gzipped later, off the writer
//! ([`super::logzip`]): `log/{first seq:020}.ndjson.gz`.
//!
//! The log is not kept in sled: it only grows (retention keeps it by default), and sled 0.34 holds
//! per-page state in memory for all it stores, so a log inside sled made the proxy's memory grow
//! with its history. Here it costs a file append.
//!
//! Durability comes from the write-ahead log ([`super::wal`]): a batch's entries are in its
//! frame, made durable before anyone is answered. The drainer appends them here later; a
//! checkpoint fsyncs these files before it deletes the frames. After a crash the frames are
//! replayed: [`LogFiles::append`] skips the entries the files already hold, and
//! [`LogFiles::open`] cuts a torn last line first, so every entry lands exactly once, in order.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, IoSlice, Write};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

use super::{files, logzip};
use crate::log::Entry;

/// A new segment once the current one holds this much (by default).
pub const SEGMENT_BYTES: u64 = 64 << 20;
const ANCHOR: &str = "anchor";

pub struct LogFiles {
    dir: PathBuf,
    /// The first sequence number of each segment, ascending.
    segments: Vec<u64>,
    /// The segments that are compressed (closed ones only).
    zipped: std::collections::BTreeSet<u64>,
    /// The newest segment, open for appending, and its length.
    current: Option<(File, u64)>,
    /// `(seq, hash)` of the last entry in the files.
    last: Option<(u64, String)>,
    segment_bytes: u64,
    /// How many writes appended entries since the open (each a `writev`).
    writes: u64,
}

fn segment_name(first: u64) -> String {
    format!("{first:020}.ndjson")
}

fn parse(line: &[u8]) -> Option<Entry> {
    serde_json::from_slice(line).ok()
}

/// Where the chain stands after a block: its last line's `seq` and `hash`, read where they are
/// without parsing the line ([`head_at`]) or, for a line of another shape, by parsing it
/// ([`head_of`]). Measured in docs/decisions.md, "The drainer's appends".
fn last_head(block: &[u8]) -> Option<(u64, String)> {
    let line = last_line(block);
    head_at(line).or_else(|| head_of(line))
}

/// The last line of `bytes`, a final newline left out; empty for nothing. Found with `memrchr`:
/// a line is one to two KiB, and the drainer asks once a block.
fn last_line(bytes: &[u8]) -> &[u8] {
    let body = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    &body[memchr::memrchr(b'\n', body).map_or(0, |i| i + 1)..]
}

/// How much of a segment's end [`tail`] reads at a time: a line is one to two KiB.
const TAIL_BLOCK: u64 = 16 << 10;

/// The end of a segment: the length of its whole lines (a torn last line, which a crash mid-append
/// leaves, not counted), the file's length, and its last whole line without the newline (`None`
/// when it has none). Only the end is read, backwards from the file's end a block at a time
/// (each twice the last), until it holds the last whole line: reading the whole newest segment
/// (up to 64 MiB) to find that line made the proxy's memory at startup peak that much higher
/// (docs/decisions.md, "The store's open holds a frame, not a file").
fn tail(path: &Path, mut block: u64) -> std::io::Result<(u64, u64, Option<Vec<u8>>)> {
    let f = File::open(path)?;
    let len = f.metadata()?.len();
    // The file from `from` on.
    let (mut from, mut end) = (len, Vec::new());
    let whole = loop {
        let start = from.saturating_sub(block);
        let mut read = vec![0; (from - start) as usize];
        f.read_exact_at(&mut read, start)?;
        read.extend_from_slice(&end);
        (from, end, block) = (start, read, block.saturating_mul(2));
        let whole = memchr::memrchr(b'\n', &end).map_or(0, |i| i + 1);
        // The last whole line is all here once a newline comes before its own, or the file's
        // start does.
        if from == 0 || (whole > 0 && memchr::memrchr(b'\n', &end[..whole - 1]).is_some()) {
            break whole;
        }
    };
    let line = Some(last_line(&end[..whole]))
        .filter(|l| !l.is_empty())
        .map(<[u8]>::to_vec);
    Ok((from + whole as u64, len, line))
}

/// `seq` and `hash` of a stored line, read in place: the line ends in its hash (the chain appends
/// it as the last member, 64 hex digits for either algorithm), and `"seq":` is followed by the
/// number. Outside a string those bytes can only be the `seq` member (a key that ends in `seq`);
/// inside one they cannot occur at all, since a string's `"` is always escaped. `None` for a
/// line of another shape.
fn head_at(line: &[u8]) -> Option<(u64, String)> {
    let (before, hash) = line
        .strip_suffix(b"\"}")
        .and_then(|b| b.len().checked_sub(64).map(|at| b.split_at(at)))?;
    if !before.ends_with(b",\"hash\":\"") || !hash.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    // The last `:` that ends `"seq":`, looking back from the hash.
    let mut end = before.len();
    let at = loop {
        let colon = before[..end].iter().rposition(|&b| b == b':')?;
        if before[..=colon].ends_with(b"\"seq\":") {
            break colon;
        }
        end = colon;
    };
    let digits = &before[at + 1..];
    let len = digits.iter().take_while(|b| b.is_ascii_digit()).count();
    if len == 0 || !matches!(digits.get(len), Some(b',' | b'}')) {
        return None;
    }
    let seq = std::str::from_utf8(&digits[..len]).ok()?.parse().ok()?;
    Some((seq, std::str::from_utf8(hash).ok()?.to_string()))
}

/// Where the chain stands after `line`: its `seq` and `hash`, all an append needs (parsing the
/// whole entry allocated every member of it, for every block the drainer appends).
fn head_of(line: &[u8]) -> Option<(u64, String)> {
    #[derive(serde::Deserialize)]
    struct Head<'a> {
        seq: u64,
        #[serde(borrow)]
        hash: std::borrow::Cow<'a, str>,
    }
    let h: Head = serde_json::from_slice(line).ok()?;
    Some((h.seq, h.hash.into_owned()))
}

/// The anchor of a pruned log: the first kept entry's `(seq, prev)`.
pub fn anchor(dir: &Path) -> Result<Option<(u64, String)>, String> {
    match std::fs::read(dir.join(ANCHOR)) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| format!("write log anchor does not parse: {e}")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("read write log anchor: {e}")),
    }
}

/// Writes the anchor atomically (temporary file, fsync, rename, fsync folder).
fn write_anchor(dir: &Path, seq: u64, prev: &str) -> std::io::Result<()> {
    let anchor = serde_json::to_vec(&(seq, prev)).expect("tuples serialize");
    files::write_whole(&dir.join("anchor.tmp"), &dir.join(ANCHOR), &anchor)
}

impl LogFiles {
    /// Opens (or creates) the folder, cutting a torn last line left by a crash.
    pub fn open(dir: &Path, segment_bytes: u64) -> Result<LogFiles, String> {
        files::create_dir(dir)?;
        let mut plain = files::numbered(dir, "ndjson")?;
        let gz = files::numbered(dir, "ndjson.gz")?;
        logzip::tidy(dir, &mut plain, &gz)?;
        let mut segments: Vec<u64> = plain.into_iter().chain(gz.iter().copied()).collect();
        segments.sort_unstable();
        let mut files = LogFiles {
            dir: dir.to_path_buf(),
            segments,
            zipped: gz.into_iter().collect(),
            current: None,
            last: None,
            segment_bytes,
            writes: 0,
        };
        // The newest segment holding a whole entry gives the last one; a segment created just
        // before a crash may hold none.
        for &first in files.segments.iter().rev() {
            let path = files.path(first);
            let line = if files.zipped.contains(&first) {
                // Closed and whole: its last line is the last entry.
                logzip::last_line(&path)?
            } else {
                let (whole, len, line) = tail(&path, TAIL_BLOCK)
                    .map_err(|e| format!("read the end of {}: {e}", path.display()))?;
                if whole < len {
                    tracing::warn!(file = %path.display(), "cutting a torn write log line");
                    files::cut(&path, whole)?;
                }
                line
            };
            if let Some(line) = line {
                let e = parse(&line).ok_or_else(|| {
                    format!(
                        "the last write log entry in {} does not parse",
                        path.display()
                    )
                })?;
                files.last = Some((e.seq, e.hash));
                break;
            }
        }
        if let Some(&first) = files.segments.last() {
            if files.zipped.contains(&first) {
                // Never the case as written (the newest is never compressed); a folder edited
                // by hand: a new segment starts at the next append.
                return Ok(files);
            }
            let path = dir.join(segment_name(first));
            let f = OpenOptions::new()
                .append(true)
                .open(&path)
                .map_err(|e| format!("open {}: {e}", path.display()))?;
            let len = f.metadata().map_err(|e| format!("stat log: {e}"))?.len();
            files.current = Some((f, len));
        }
        Ok(files)
    }

    /// How many writes appended entries since the open.
    pub fn writes(&self) -> u64 {
        self.writes
    }

    /// `(seq, hash)` of the last entry written.
    pub fn last(&self) -> Option<(u64, String)> {
        self.last.clone()
    }

    /// Appends a block of entries (NDJSON lines, each ending in `\n`, numbered from `first`),
    /// skipping those the files hold already (a replayed frame).
    pub fn append(&mut self, first: u64, block: &[u8]) -> Result<(), String> {
        self.append_blocks(&[(first, block)])
    }

    /// Appends blocks in order as [`LogFiles::append`] would one by one, in one `writev` per
    /// segment they land in: a drain carries the blocks of every batch since the last one, and a
    /// write each cost a system call, the inode's time update and a check for dirty pages
    /// (docs/decisions.md, "The drainer's appends in one write"). A gap ends the call with an
    /// error after writing the blocks before it, as one by one.
    pub fn append_blocks(&mut self, blocks: &[(u64, &[u8])]) -> Result<(), String> {
        let mut pending: Vec<IoSlice<'_>> = Vec::new();
        let mut pending_bytes = 0u64;
        // Where the chain stands once the pending slices are written.
        let mut head = self.last.clone();
        let mut result = Ok(());
        'blocks: for &(first, block) in blocks {
            let have = head.as_ref().map_or(0, |(s, _)| *s);
            let mut lines = block.split_inclusive(|b| *b == b'\n');
            let mut seq = first;
            let mut start = 0;
            while seq <= have {
                match lines.next() {
                    Some(l) => start += l.len(),
                    // The files hold the whole block already.
                    None => continue 'blocks,
                }
                seq += 1;
            }
            if head.is_some() && seq != have + 1 {
                result = Err(format!(
                    "write log gap: entry {seq} would follow entry {have}"
                ));
                break;
            }
            if head.is_none() {
                // An empty log starts at its anchor, or at 1: entries that would start it later
                // follow a hole (the log was deleted, and a crash's replay brings only its tail).
                let starts = self.anchor()?.map_or(1, |(s, _)| s);
                if seq != starts {
                    result = Err(format!(
                        "write log gap: the write log is empty or missing, and entry {seq} would start it where it starts at {starts}: its earlier entries are gone"
                    ));
                    break;
                }
            }
            let rest = &block[start..];
            if rest.is_empty() {
                continue;
            }
            let Some(last_line) = last_head(rest) else {
                result = Err("a write log block does not end in an entry".to_string());
                break;
            };
            let full = self
                .current
                .as_ref()
                .is_none_or(|(_, len)| *len + pending_bytes >= self.segment_bytes);
            if full {
                self.write_pending(&mut pending, &mut pending_bytes)?;
                self.last.clone_from(&head);
                self.start_segment(seq)?;
            }
            pending.push(IoSlice::new(rest));
            pending_bytes += rest.len() as u64;
            head = Some(last_line);
        }
        self.write_pending(&mut pending, &mut pending_bytes)?;
        self.last = head;
        result
    }

    /// Writes the slices gathered for the current segment, all of them.
    fn write_pending(
        &mut self,
        pending: &mut Vec<IoSlice<'_>>,
        bytes: &mut u64,
    ) -> Result<(), String> {
        if pending.is_empty() {
            return Ok(());
        }
        let (f, len) = self.current.as_mut().expect("a segment is open");
        let mut slices = &mut pending[..];
        while !slices.is_empty() {
            match f.write_vectored(slices) {
                Ok(0) => return Err("append to the write log: wrote nothing".to_string()),
                Ok(n) => IoSlice::advance_slices(&mut slices, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("append to the write log: {e}")),
            }
        }
        *len += *bytes;
        self.writes += 1;
        pending.clear();
        *bytes = 0;
        Ok(())
    }

    fn start_segment(&mut self, first: u64) -> Result<(), String> {
        // The finished segment is made durable now; only the newest waits for `sync`.
        if let Some((f, _)) = &self.current {
            f.sync_data()
                .map_err(|e| format!("fsync a write log file: {e}"))?;
        }
        let path = self.dir.join(segment_name(first));
        let f = files::private()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| format!("create {}: {e}", path.display()))?;
        files::fsync_dir(&self.dir).map_err(|e| format!("fsync the write log folder: {e}"))?;
        self.segments.push(first);
        self.current = Some((f, 0));
        Ok(())
    }

    /// Makes everything appended durable.
    pub fn sync(&self) -> Result<(), String> {
        match &self.current {
            Some((f, _)) => f
                .sync_data()
                .map_err(|e| format!("fsync the write log: {e}")),
            None => Ok(()),
        }
    }

    /// Opens the segments from the one holding entry `from` on, with the anchor: a snapshot a
    /// reader can walk while appends and pruning go on (a pruned file stays readable while open).
    pub fn reader(&self, from: u64) -> Result<Reader, String> {
        let start = self
            .segments
            .iter()
            .rposition(|&first| first <= from)
            .unwrap_or(0);
        let mut files = Vec::new();
        for &first in &self.segments[start..] {
            files.push((first, logzip::open(&self.path(first))?));
        }
        Ok(Reader {
            anchor: anchor(&self.dir)?,
            files,
        })
    }

    /// Prunes whole segments whose every entry is older than `cutoff` (RFC 3339), never the
    /// newest: records where the log now starts (the anchor, durably, first, so the log always
    /// verifies from its first kept entry) and takes the files out of those this log reads, and
    /// returns them for the caller to remove with [`remove`] once it no longer holds the log
    /// (unlinking 64 MiB files would hold up every append meanwhile). A crash before they go
    /// leaves them behind the anchor, as a crash between the anchor and the unlinks always could.
    pub fn cut(&mut self, cutoff: &str) -> Result<Vec<PathBuf>, String> {
        let mut drop = 0;
        // A segment's entries are no newer than the next segment's first one.
        for (i, next) in self.segments.iter().enumerate().skip(1) {
            match first_entry(&self.path(*next))? {
                Some(e) if e.ts.as_str() < cutoff => drop = i,
                _ => break,
            }
        }
        if drop == 0 {
            return Ok(Vec::new());
        }
        let kept = self.path(self.segments[drop]);
        let e = first_entry(&kept)?.ok_or("the first kept write log file is empty")?;
        self.set_anchor(e.seq, &e.prev)?;
        let gone: Vec<PathBuf> = self.segments[..drop]
            .iter()
            .map(|f| self.path(*f))
            .collect();
        for first in self.segments.drain(..drop) {
            self.zipped.remove(&first);
        }
        Ok(gone)
    }

    /// A segment's file: plain, or compressed once it was.
    fn path(&self, first: u64) -> PathBuf {
        if self.zipped.contains(&first) {
            self.dir.join(logzip::name(first))
        } else {
            self.dir.join(segment_name(first))
        }
    }

    /// The closed segments not yet compressed, plain file and compressed name: every segment
    /// but the newest, once the newest holds an entry (so that the last entry stays in a plain
    /// file an open reads from its end).
    pub fn to_compress(&self) -> Vec<(u64, PathBuf, PathBuf)> {
        let (Some(&newest), Some((last, _))) = (self.segments.last(), &self.last) else {
            return Vec::new();
        };
        if *last < newest {
            return Vec::new();
        }
        self.segments[..self.segments.len() - 1]
            .iter()
            .filter(|f| !self.zipped.contains(f))
            .map(|&f| {
                (
                    f,
                    self.dir.join(segment_name(f)),
                    self.dir.join(logzip::name(f)),
                )
            })
            .collect()
    }

    /// `first`'s compressed file is in place: readers open it from now on. Returns whether the
    /// segment is still this log's (pruning may have taken it meanwhile).
    pub fn compressed(&mut self, first: u64) -> bool {
        let ours = self.segments.contains(&first);
        if ours {
            self.zipped.insert(first);
        }
        ours
    }

    /// Where a pruned log starts: the first kept entry's `(seq, prev)`.
    pub fn anchor(&self) -> Result<Option<(u64, String)>, String> {
        anchor(&self.dir)
    }

    /// Sets the anchor (a log carried over from an older store).
    pub fn set_anchor(&self, seq: u64, prev: &str) -> Result<(), String> {
        write_anchor(&self.dir, seq, prev).map_err(|e| format!("write the write log anchor: {e}"))
    }
}

/// Removes log files [`LogFiles::cut`] took out.
pub fn remove(files: &[PathBuf]) {
    for f in files {
        let _ = std::fs::remove_file(f);
    }
}

/// The first whole entry of a segment.
fn first_entry(path: &Path) -> Result<Option<Entry>, String> {
    let mut line = Vec::new();
    logzip::open(path)?
        .read_until(b'\n', &mut line)
        .map_err(|e| format!("read {}: {e}", path.display()))?;
    if line.last() != Some(&b'\n') {
        return Ok(None);
    }
    line.pop();
    parse(&line)
        .map(Some)
        .ok_or_else(|| format!("the first entry of {} does not parse", path.display()))
}

/// Open segments and the anchor, read without holding up the writer.
pub struct Reader {
    pub anchor: Option<(u64, String)>,
    files: Vec<(u64, Box<dyn BufRead + Send>)>,
}

impl Reader {
    /// Every whole entry, in order; an entry that does not parse is reported by its number.
    pub fn entries(self) -> impl Iterator<Item = Result<Entry, u64>> {
        self.files.into_iter().flat_map(|(first, mut r)| {
            let mut seq = first;
            let mut done = false;
            std::iter::from_fn(move || {
                if done {
                    return None;
                }
                let mut line = Vec::new();
                match r.read_until(b'\n', &mut line) {
                    // The end, or a line still being appended.
                    Ok(_) if line.last() != Some(&b'\n') => None,
                    Ok(_) => {
                        line.pop();
                        let e = parse(&line).ok_or(seq);
                        seq = e.as_ref().map_or(seq, |e| e.seq) + 1;
                        Some(e)
                    }
                    Err(_) => {
                        done = true;
                        Some(Err(seq))
                    }
                }
            })
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::log::{Actor, Chain, Event, LogEvent};

    fn block(chain: &Chain, from: u64, n: u64, prev: &mut String, ts: u64) -> Vec<u8> {
        block_of(chain, from, n, prev, ts, || {
            LogEvent::bare(Event::Replayed, Actor::Proxy)
        })
    }

    /// `n` entries chained after `prev` from `from` on, each of `event()`.
    fn block_of(
        chain: &Chain,
        from: u64,
        n: u64,
        prev: &mut String,
        ts: u64,
        event: impl Fn() -> LogEvent,
    ) -> Vec<u8> {
        let mut out = Vec::new();
        for seq in from..from + n {
            let (e, line) = chain.seal_line(event(), (seq - 1, prev), ts);
            *prev = e.hash;
            out.extend_from_slice(&line);
            out.push(b'\n');
        }
        out
    }

    /// A block's head read in place is the one its last line states, with and without a key,
    /// for blocks of one and of several entries, with strings that hold `"seq":` and a last
    /// entry whose number has one digit or twenty; a line of another shape is parsed.
    #[test]
    fn a_blocks_head_is_read_in_place() {
        for key in [None, Some(b"k".to_vec())] {
            let chain = Chain::new(key);
            let mut prev = crate::log::GENESIS.to_string();
            for (from, n) in [(1, 1), (2, 2), (4, 5), (u64::MAX - 3, 3)] {
                let b = block_of(&chain, from, n, &mut prev, 7, || {
                    let mut ev = LogEvent::bare(Event::Replayed, Actor::Proxy)
                        .detail("\"seq\":7, \\\"seq\\\":8}");
                    ev.path = Some("/\"seq\":9".into());
                    ev
                });
                let last = b[..b.len() - 1].rsplit(|c| *c == b'\n').next().unwrap();
                let stated = head_of(last).unwrap();
                assert_eq!(stated, (from + n - 1, prev.clone()));
                assert_eq!(head_at(last), Some(stated.clone()));
                assert_eq!(last_head(&b), Some(stated.clone()));
                assert_eq!(last_head(&b[..b.len() - 1]), Some(stated));
            }
        }
        // Hash not last (another shape): the line says.
        let odd = b"{\"seq\":3}\n{\"hash\":\"ab\",\"seq\":9}\n";
        assert_eq!(head_at(b"{\"hash\":\"ab\",\"seq\":9}"), None);
        assert_eq!(last_head(odd), Some((9, "ab".to_string())));
        assert_eq!(last_head(b"not json\n"), None);
    }

    /// Blocks appended in one call land as they would one by one: a block the files hold
    /// (replayed) and the held part of another skipped, a new segment started where the
    /// current one is full, a gap refused after the blocks before it are written; each segment
    /// takes one write.
    #[test]
    fn blocks_appended_together_land_as_one_by_one() {
        let tmp = tempfile::tempdir().unwrap();
        let chain = Chain::new(None);
        let mut prev = crate::log::GENESIS.to_string();
        let blocks: Vec<(u64, Vec<u8>)> = (0..8)
            .map(|i| (1 + 3 * i, block(&chain, 1 + 3 * i, 3, &mut prev, 1_000 + i)))
            .collect();
        let one_by_one = tmp.path().join("a");
        let together = tmp.path().join("b");
        // A segment holds two or three blocks.
        let segment = blocks[0].1.len() as u64 * 5 / 2;
        let mut a = LogFiles::open(&one_by_one, segment).unwrap();
        let mut b = LogFiles::open(&together, segment).unwrap();
        for f in [&mut a, &mut b] {
            f.append(1, &blocks[0].1).unwrap();
        }
        // Held: the first block whole, the second's first line (a block that overlaps).
        let overlap = {
            let last_line = blocks[0]
                .1
                .split_inclusive(|c| *c == b'\n')
                .next_back()
                .unwrap();
            [last_line, &blocks[1].1].concat()
        };
        let mut all: Vec<(u64, &[u8])> = vec![(1, &blocks[0].1), (3, &overlap)];
        all.extend(blocks[2..].iter().map(|(f, b)| (*f, b.as_slice())));
        for (first, blk) in &all {
            a.append(*first, blk).unwrap();
        }
        let names = |d: &Path| files::numbered(d, "ndjson").unwrap();
        let (writes, segments) = (b.writes(), names(&together).len());
        b.append_blocks(&all).unwrap();
        assert_eq!(a.last(), b.last());
        assert_eq!(b.last().unwrap().0, 24);
        assert_eq!(names(&one_by_one), names(&together));
        let started = names(&together).len() - segments;
        assert!(started >= 2, "small segments roll over");
        // One write per segment the call wrote to: the one it began in, and each it started.
        assert_eq!(b.writes() - writes, started as u64 + 1);
        assert!(a.writes() > b.writes());
        for first in names(&together) {
            let name = segment_name(first);
            assert_eq!(
                std::fs::read(one_by_one.join(&name)).unwrap(),
                std::fs::read(together.join(&name)).unwrap(),
                "{name}"
            );
        }
        let v = crate::log::verify(&chain, b.reader(1).unwrap().entries(), None);
        assert!(v.ok && v.entries == 24, "{v:?}");
        // A gap: the block before it is written, the call fails, nothing after it lands.
        let next = block(&chain, 25, 2, &mut prev, 9_000);
        let gap = block(&chain, 40, 1, &mut prev, 9_001);
        let err = b
            .append_blocks(&[(25, &next), (40, &gap), (25, &next)])
            .unwrap_err();
        assert!(err.contains("gap"), "{err}");
        assert_eq!(b.last().unwrap().0, 26);
    }

    /// More blocks than one `writev` takes (the kernel's limit is 1,024 slices; a drain at one
    /// connection on a fast disk carries thousands): all land, in order, in a few writes.
    #[test]
    fn more_blocks_than_one_writev_takes_all_land() {
        let tmp = tempfile::tempdir().unwrap();
        let chain = Chain::new(None);
        let mut prev = crate::log::GENESIS.to_string();
        let blocks: Vec<Vec<u8>> = (1..=3_000)
            .map(|seq| block(&chain, seq, 1, &mut prev, seq))
            .collect();
        let all: Vec<(u64, &[u8])> = (1..).zip(blocks.iter().map(Vec::as_slice)).collect();
        let mut f = LogFiles::open(&tmp.path().join("log"), SEGMENT_BYTES).unwrap();
        f.append_blocks(&all).unwrap();
        assert_eq!(f.writes(), 1, "one call, however many system calls it took");
        assert_eq!(f.last(), Some((3_000, prev)));
        let v = crate::log::verify(&chain, f.reader(1).unwrap().entries(), None);
        assert!(v.ok && v.entries == 3_000, "{v:?}");
    }

    /// The end of a segment read backwards in blocks is what reading all of it finds: the
    /// length of its whole lines and the last of them, whatever the blocks cut (a line longer
    /// than a block, a torn tail longer than one, no newline at all, an empty file).
    #[test]
    fn a_segments_end_read_in_blocks_is_what_reading_it_whole_finds() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("seg");
        let long = "x".repeat(40);
        let cases: Vec<Vec<u8>> = [
            "",
            "\n",
            "torn, no newline",
            "{\"seq\":1}\n",
            "{\"seq\":1}\n{\"seq\":2}\n",
            "{\"seq\":1}\n{\"seq\":2}\n{\"seq\":3,\"torn",
            "a\n\n",
            &format!("{long}\n{long}{long}\n"),
            &format!("a\n{long}{long}{long}"),
            &format!("{long}\nb\n{long}"),
        ]
        .iter()
        .map(|c| c.as_bytes().to_vec())
        .collect();
        for bytes in &cases {
            std::fs::write(&path, bytes).unwrap();
            let whole = memchr::memrchr(b'\n', bytes).map_or(0, |i| i + 1);
            let line = Some(last_line(&bytes[..whole]))
                .filter(|l| !l.is_empty())
                .map(<[u8]>::to_vec);
            for block in [1, 3, 7, 16, 4096] {
                assert_eq!(
                    tail(&path, block).unwrap(),
                    (whole as u64, bytes.len() as u64, line.clone()),
                    "{:?} in blocks of {block}",
                    String::from_utf8_lossy(bytes)
                );
            }
        }
    }

    #[test]
    fn appends_once_cuts_a_torn_line_and_reads_back_in_order() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("log");
        let chain = Chain::new(None);
        let mut prev = crate::log::GENESIS.to_string();
        let b1 = block(&chain, 1, 3, &mut prev, 1_000);
        let b2 = block(&chain, 4, 2, &mut prev, 2_000);
        let mut f = LogFiles::open(&dir, SEGMENT_BYTES).unwrap();
        f.append(1, &b1).unwrap();
        f.append(1, &b1).unwrap(); // replayed: skipped
        f.append(4, &b2).unwrap();
        assert_eq!(f.last().unwrap().0, 5);
        assert!(f.append(9, &b2).is_err(), "a gap is refused");
        f.sync().unwrap();
        drop(f);
        // A crash mid-append leaves half a line.
        let seg = dir.join(segment_name(1));
        let mut h = OpenOptions::new().append(true).open(&seg).unwrap();
        h.write_all(b"{\"seq\":6,\"ts").unwrap();
        drop(h);
        let f = LogFiles::open(&dir, SEGMENT_BYTES).unwrap();
        assert_eq!(f.last().unwrap().0, 5);
        let seqs: Vec<u64> = f
            .reader(1)
            .unwrap()
            .entries()
            .map(|e| e.unwrap().seq)
            .collect();
        assert_eq!(seqs, [1, 2, 3, 4, 5]);
        let v = crate::log::verify(&chain, f.reader(1).unwrap().entries(), None);
        assert!(v.ok && v.entries == 5, "{v:?}");
    }
}
