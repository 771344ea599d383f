//! Closed write-log segments, gzipped when `log.compress` is set (issue 59): the log is much of
//! what a write leaves on disk, its lines are JSON with the same keys over and over, and a closed
//! segment is never written again. The newest segment, which appends go to, stays plain.
//!
//! A segment `{first:020}.ndjson` becomes `{first:020}.ndjson.gz` (gzip, one member, readable
//! with `zcat`): compressed to `….gz.tmp`, fsynced, renamed, the folder fsynced; only then is the
//! plain file removed. A crash leaves at worst both (the plain one is removed at the next open)
//! or a `.tmp` (removed). Readers that opened the plain file before keep reading it.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;

use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;

use super::files;

/// A compressed segment's name.
pub fn name(first: u64) -> String {
    format!("{first:020}.ndjson.gz")
}

/// The lines of a segment, plain or compressed (by its name).
pub fn open(path: &Path) -> Result<Box<dyn BufRead + Send>, String> {
    let f = File::open(path).map_err(|e| format!("open {}: {e}", path.display()))?;
    Ok(if is_gz(path) {
        Box::new(BufReader::new(MultiGzDecoder::new(BufReader::new(f))))
    } else {
        Box::new(BufReader::new(f))
    })
}

pub fn is_gz(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "gz")
}

/// Compresses the closed segment `plain` into `gz` durably (the plain file is left for the
/// caller to remove once no one reads it as the segment). Returns the two sizes.
///
/// Gently: a quarter of a core at most, in slices of [`SLICE`] with a pause of three times what
/// each took, and the output synced a MiB at a time. Compressing a 64 MiB segment at once took
/// a core for about a second and its fsync a burst of the disk: the soak's p99 before expiry
/// went from 7–17 ms to 64–205 ms; paced, to 10–54 ms (bench/results-soak-compression.md), which
/// is why `log.compress` is off by default.
pub fn compress(plain: &Path, gz: &Path) -> Result<(u64, u64), String> {
    let tmp = gz.with_extension("gz.tmp");
    let write = || -> std::io::Result<(u64, u64)> {
        let mut src = File::open(plain)?;
        let out = files::private()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&tmp)?;
        // Level 1: the lines shrink about 4.5-fold (level 6: 5-fold at three times the CPU).
        let mut enc = GzEncoder::new(out, Compression::fast());
        let mut buf = vec![0u8; SLICE];
        let (mut read, mut synced) = (0u64, 0u64);
        loop {
            let started = std::time::Instant::now();
            let n = src.read(&mut buf)?;
            if n == 0 {
                break;
            }
            enc.write_all(&buf[..n])?;
            read += n as u64;
            let out_len = enc.get_ref().metadata()?.len();
            if out_len - synced >= 1 << 20 {
                enc.get_ref().sync_data()?;
                synced = out_len;
            }
            std::thread::sleep(started.elapsed().saturating_mul(3));
        }
        let out = enc.finish()?;
        out.sync_all()?;
        let written = out.metadata()?.len();
        std::fs::rename(&tmp, gz)?;
        Ok((read, written))
    };
    let sizes = write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("compress {}: {e}", plain.display())
    })?;
    let dir = gz.parent().unwrap_or(Path::new("."));
    files::fsync_dir(dir).map_err(|e| format!("fsync {}: {e}", dir.display()))?;
    Ok(sizes)
}

/// How much of a segment is compressed between pauses.
const SLICE: usize = 256 << 10;

/// Tidies a log folder at open: a `.tmp` a crash left mid-compression goes, and so does a plain
/// segment whose compressed copy was finished (renamed) before the crash.
pub fn tidy(dir: &Path, plain: &mut Vec<u64>, gz: &[u64]) -> Result<(), String> {
    for e in std::fs::read_dir(dir).map_err(|e| format!("list {}: {e}", dir.display()))? {
        let Ok(e) = e else { continue };
        if e.file_name().to_string_lossy().ends_with(".gz.tmp") {
            let _ = std::fs::remove_file(e.path());
        }
    }
    let twice: Vec<u64> = plain.iter().copied().filter(|p| gz.contains(p)).collect();
    for first in twice {
        let path = dir.join(format!("{first:020}.ndjson"));
        std::fs::remove_file(&path).map_err(|e| format!("remove {}: {e}", path.display()))?;
        plain.retain(|p| *p != first);
    }
    files::fsync_dir(dir).map_err(|e| format!("fsync {}: {e}", dir.display()))
}

/// The last whole line of a compressed segment (read whole: only an open whose newest plain
/// segment lost its lines to a crash gets here).
pub fn last_line(path: &Path) -> Result<Option<Vec<u8>>, String> {
    let mut all = Vec::new();
    open(path)?
        .read_to_end(&mut all)
        .map_err(|e| format!("read {}: {e}", path.display()))?;
    let body = match all.iter().rposition(|b| *b == b'\n') {
        Some(end) => &all[..end],
        None => return Ok(None),
    };
    let start = body.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    Ok(Some(body[start..].to_vec()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::log::{Actor, Chain, Event, LogEvent};
    use crate::store::logfiles::LogFiles;

    /// Appends `n` entries one block each to `log`, chained from its last; returns their lines.
    fn append(log: &mut LogFiles, chain: &Chain, n: u64) -> Vec<String> {
        let mut lines = Vec::new();
        for _ in 0..n {
            let (seq, prev) = log.last().unwrap_or((0, "0".repeat(64)));
            let ev = LogEvent::bare(Event::Replayed, Actor::Proxy);
            let (_, mut line) = chain.seal_line(ev, (seq, &prev), 1_800_000_000_000 + seq);
            lines.push(String::from_utf8(line.clone()).unwrap());
            line.push(b'\n');
            log.append(seq + 1, &line).unwrap();
        }
        lines
    }

    fn read_all(log: &LogFiles) -> Vec<String> {
        log.reader(0)
            .unwrap()
            .entries()
            .map(|e| serde_json::to_string(&e.unwrap()).unwrap())
            .collect()
    }

    fn compress_all(log: &mut LogFiles) -> usize {
        let todo = log.to_compress();
        for (first, plain, gz) in &todo {
            compress(plain, gz).unwrap();
            assert!(log.compressed(*first));
            std::fs::remove_file(plain).unwrap();
        }
        todo.len()
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".ndjson"))
            .collect();
        v.sort();
        v
    }

    /// Closed segments are compressed, the newest never; every entry reads back the same, in
    /// order, before and after a reopen; the folder takes a fraction of the bytes.
    #[test]
    fn closed_segments_compress_and_read_back_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("log");
        let chain = Chain::new(None);
        let mut log = LogFiles::open(&dir, 16 << 10).unwrap();
        append(&mut log, &chain, 300);
        let before = read_all(&log);
        let plain_bytes: u64 = names(&dir)
            .iter()
            .map(|n| std::fs::metadata(dir.join(n)).unwrap().len())
            .sum();
        let segments = names(&dir).len();
        assert!(segments > 3, "{segments}");
        assert_eq!(compress_all(&mut log), segments - 1);
        let after = names(&dir);
        assert!(
            after[..segments - 1]
                .iter()
                .all(|n| n.ends_with(".ndjson.gz")),
            "{after:?}"
        );
        assert!(after[segments - 1].ends_with(".ndjson"), "{after:?}");
        let bytes: u64 = after
            .iter()
            .map(|n| std::fs::metadata(dir.join(n)).unwrap().len())
            .sum();
        assert!(bytes * 2 < plain_bytes, "{bytes} of {plain_bytes}");
        assert_eq!(read_all(&log), before);
        // Nothing more to do; appends go on in the plain newest segment.
        assert_eq!(compress_all(&mut log), 0);
        append(&mut log, &chain, 5);
        let head = log.last();
        drop(log);
        let log = LogFiles::open(&dir, 16 << 10).unwrap();
        assert_eq!(log.last(), head);
        assert_eq!(read_all(&log).len(), 305);
        assert_eq!(read_all(&log)[..300], before[..]);
    }

    /// A crash mid-compression: a `.tmp` left, or both files of a segment. The open keeps one
    /// whole copy of each segment and reads every entry.
    #[test]
    fn a_crash_mid_compression_leaves_one_whole_copy() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("log");
        let chain = Chain::new(None);
        let mut log = LogFiles::open(&dir, 16 << 10).unwrap();
        append(&mut log, &chain, 200);
        let before = read_all(&log);
        let todo = log.to_compress();
        assert!(todo.len() >= 2);
        // The first: compressed and renamed, the plain file not yet removed.
        compress(&todo[0].1, &todo[0].2).unwrap();
        // The second: only a partial temporary file.
        std::fs::write(todo[1].2.with_extension("gz.tmp"), b"\x1f\x8b partial").unwrap();
        drop(log);
        let mut log = LogFiles::open(&dir, 16 << 10).unwrap();
        let files = names(&dir);
        assert!(!files.iter().any(|n| n.ends_with(".tmp")), "{files:?}");
        let first = format!("{:020}.ndjson", todo[0].0);
        assert!(!files.contains(&first), "{files:?}");
        assert!(files.contains(&format!("{first}.gz")), "{files:?}");
        assert_eq!(read_all(&log), before);
        // The rest compresses on the next pass; pruning reads the compressed first entries.
        assert!(compress_all(&mut log) >= 1);
        assert_eq!(read_all(&log), before);
        let removed = log.cut("2100-01-01T00:00:00Z").unwrap();
        assert!(removed.iter().all(|p| is_gz(p)), "{removed:?}");
        crate::store::logfiles::remove(&removed);
        let (anchor_seq, _) = log.anchor().unwrap().unwrap();
        let kept = read_all(&log);
        assert_eq!(kept[..], before[anchor_seq as usize - 1..]);
    }
}
