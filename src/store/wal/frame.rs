//! A write-ahead log frame's bytes: a batch's changes, its length and its checksum.

use std::io::{self, Read};

const PUT: u8 = 1;
const DEL: u8 = 2;
const MERGE: u8 = 3;
pub(super) const HEADER: usize = 8;

/// One change of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Put(Vec<u8>, Vec<u8>),
    Del(Vec<u8>),
    /// A change to the value a key holds, which the store makes of that value and this
    /// (a pointer bucket's entries added or taken away), so that writing it reads nothing.
    Merge(Vec<u8>, Vec<u8>),
}

/// Encodes a batch as one frame, its header left for [`super::Wal::append`] to fill in (the checksum
/// names the file's generation).
pub fn encode(changes: &[Change], out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&[0; HEADER]);
    for c in changes {
        let (tag, k, v) = match c {
            Change::Put(k, v) => (PUT, k, Some(v)),
            Change::Del(k) => (DEL, k, None),
            Change::Merge(k, v) => (MERGE, k, Some(v)),
        };
        out.push(tag);
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(k);
        if let Some(v) = v {
            out.extend_from_slice(&(v.len() as u32).to_le_bytes());
            out.extend_from_slice(v);
        }
    }
}

/// Fills in an encoded frame's header: its length and its checksum under `generation`.
pub(super) fn seal(frame: &mut [u8], generation: u64) {
    let len = (frame.len() - HEADER) as u32;
    let crc = checksum(Some(generation), &frame[HEADER..]);
    frame[..4].copy_from_slice(&len.to_le_bytes());
    frame[4..HEADER].copy_from_slice(&crc.to_le_bytes());
}

/// A frame's checksum: CRC-32 of its file's generation and its payload, or of its payload alone
/// (`None`: files written before files were recycled).
fn checksum(generation: Option<u64>, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    if let Some(g) = generation {
        h.update(&g.to_le_bytes());
    }
    h.update(payload);
    h.finalize()
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
            MERGE => {
                let vlen = take_u32(&mut p)?;
                out.push(Change::Merge(key, take(&mut p, vlen)?.to_vec()));
            }
            _ => return None,
        }
    }
    Some(out)
}

/// Reads one file's frames (of generation `generation`, `len` bytes long) one at a time from `r`,
/// handing each batch's changes to `each`; returns how many frames there were, how many bytes
/// they take, and whether the rest is only the zeros the file was extended with (else the end is
/// torn, corrupt, or what a recycled file held before). Only one frame is in memory at a time:
/// a log file grows to [`super::CHECKPOINT_BYTES`] and more, and reading it whole, its changes
/// decoded beside it, made a recovery need about twice that much memory on top of the proxy's.
///
/// The first frame decides how the file's checksums read: under its generation, or (a file
/// written before recycling) over the payload alone; every later frame must check the same way,
/// so a frame left over from a recycled file's earlier life ends the file's frames whichever
/// way it was written.
pub fn read_frames(
    mut r: impl Read,
    len: u64,
    generation: u64,
    mut each: impl FnMut(Vec<Change>) -> Result<(), String>,
) -> Result<(usize, u64, bool), String> {
    let io = |e: io::Error| format!("read a write-ahead log frame: {e}");
    let (mut frames, mut good) = (0, 0u64);
    let mut checked: Option<Option<u64>> = None;
    let (mut header, mut payload) = (Vec::with_capacity(HEADER), Vec::new());
    // The bytes read past the last frame: they, and all after them, must be zeros.
    let rest_clean = loop {
        read_up_to(&mut r, HEADER, &mut header).map_err(io)?;
        // A zero length never starts a frame (empty batches are not written): it is where the
        // written part of a preallocated file ends.
        if header.len() < 4 || header[..4] == [0; 4] {
            break all_zero(&header);
        }
        let word = |at: usize| {
            u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
        };
        // A length past the file's end is a torn or corrupt header, not a frame to read.
        if header.len() < HEADER || u64::from(word(0)) > len.saturating_sub(good + HEADER as u64) {
            break false;
        }
        let (n, crc) = (word(0) as usize, word(4) as usize);
        if read_up_to(&mut r, n, &mut payload).map_err(io)? < n {
            break false;
        }
        let matches = |g: Option<u64>| checksum(g, &payload) as usize == crc;
        let way = match checked {
            Some(way) => matches(way).then_some(way),
            None => [Some(generation), None].into_iter().find(|g| matches(*g)),
        };
        let Some(changes) = way.and_then(|_| decode_payload(&payload)) else {
            break false;
        };
        checked = way;
        each(changes)?;
        frames += 1;
        good += (HEADER + n) as u64;
    };
    let mut clean = rest_clean;
    let mut rest = Vec::new();
    while clean && read_up_to(&mut r, 64 << 10, &mut rest).map_err(io)? > 0 {
        clean = all_zero(&rest);
    }
    Ok((frames, good, clean))
}

fn all_zero(b: &[u8]) -> bool {
    b.iter().all(|b| *b == 0)
}

/// The next `n` bytes of `r` into `buf` (replacing what it held), fewer only at the end of `r`.
fn read_up_to(r: &mut impl Read, n: usize, buf: &mut Vec<u8>) -> io::Result<usize> {
    buf.clear();
    r.take(n as u64).read_to_end(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::wal::tests::{frame, put};

    /// The frames of `bytes`, collected: what the open hands on, and where they end.
    fn frames(bytes: &[u8], generation: u64) -> (Vec<Vec<Change>>, usize, bool) {
        let mut out = Vec::new();
        let (n, good, clean) = read_frames(bytes, bytes.len() as u64, generation, |c| {
            out.push(c);
            Ok(())
        })
        .expect("reading bytes cannot fail");
        assert_eq!(n, out.len());
        (out, good as usize, clean)
    }

    #[test]
    fn frames_round_trip() {
        let a = vec![put("a/1", "one"), Change::Del(b"s/x".to_vec())];
        let b = vec![
            put("a/2", ""),
            put("", "empty key"),
            Change::Merge(b"p/\x01\x02".to_vec(), b"\x02entries".to_vec()),
        ];
        let mut bytes = frame(&a);
        bytes.extend(frame(&b));
        let n = bytes.len();
        assert_eq!(frames(&bytes, 1), (vec![a.clone(), b.clone()], n, true));
        // Zeros after the frames (a preallocated file) end it cleanly.
        bytes.extend([0; 100]);
        assert_eq!(frames(&bytes, 1), (vec![a, b], n, true));
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
            assert_eq!(frames(&torn, 1).0, vec![a.clone()], "cut at {cut}");
            assert_eq!(frames(&torn, 1).1, n, "cut at {cut}");
        }
        let mut flipped = b.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        bytes.extend(flipped);
        assert_eq!(frames(&bytes, 1), (vec![a.clone()], n, false));
        // A header whose length runs past the file's end (torn, or garbage) ends them too,
        // without reading (or making room for) what it promises.
        let mut huge = frame(&a);
        huge.extend([0xff, 0xff, 0xff, 0xff, 1, 2, 3, 4, 5]);
        assert_eq!(frames(&huge, 1), (vec![a], n, false));
    }
}
