//! JSON text written byte for byte as serde_json writes it, without its serializer: for the forms
//! that are hashed (the write log's canonical entries, a JSON body's fingerprint), whose bytes
//! must never change, and which run several times for every write. serde_json's serializer
//! spends about 170 instructions on each string it writes (a write log entry has about 32: every
//! key and most values), nearly all of it per call rather than per byte (measured in
//! docs/decisions.md, "Canonical JSON without the serializer").

/// Whether serde_json writes `b` escaped inside a string: a control character, `"` or `\`.
/// (It writes everything else as it is, DEL and all of UTF-8 included.)
fn escaped(b: u8) -> bool {
    b < 0x20 || b == b'"' || b == b'\\'
}

/// Where the first byte [`escaped`] is, eight bytes at a time: a string that needs no escape
/// (nearly every one written) is scanned in about a word's instructions per eight bytes. Each
/// test says exactly whether some byte of the word matches (it may not say which), so a word
/// that has one is looked at byte by byte.
fn first_escaped(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // Whether some byte of `w` is below `n` (for `n` up to 128).
    let below = |w: u64, n: u8| w.wrapping_sub(ONES * u64::from(n)) & !w & HIGH != 0;
    let mut at = 0;
    while let Some(chunk) = bytes.get(at..at + 8) {
        let w = u64::from_le_bytes(chunk.try_into().expect("eight bytes"));
        if below(w, 0x20)
            || below(w ^ (ONES * u64::from(b'"')), 1)
            || below(w ^ (ONES * u64::from(b'\\')), 1)
        {
            break;
        }
        at += 8;
    }
    bytes[at..].iter().position(|&b| escaped(b)).map(|p| at + p)
}

/// Appends `s` as a JSON string: quoted, with serde_json's escapes (`\"`, `\\`, `\b`, `\f`,
/// `\n`, `\r`, `\t`, and `\u00xx` in lowercase hex for the other control characters). Runs
/// that need no escape are copied whole.
pub fn write_str(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    out.reserve(bytes.len() + 2);
    out.push(b'"');
    let mut start = 0;
    while let Some(p) = first_escaped(&bytes[start..]) {
        let at = start + p;
        out.extend_from_slice(&bytes[start..at]);
        start = at + 1;
        match bytes[at] {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            b => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 0xf)]);
            }
        }
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// An object's members written in the order given (the caller's order is the object's: a
/// canonical form declares them sorted). Keys are the caller's own names, written as they are.
pub struct Object<'o> {
    out: &'o mut Vec<u8>,
    members: usize,
}

impl<'o> Object<'o> {
    pub fn new(out: &'o mut Vec<u8>) -> Object<'o> {
        out.push(b'{');
        Object { out, members: 0 }
    }

    fn key(&mut self, key: &'static str) -> &mut Vec<u8> {
        debug_assert!(!key.bytes().any(escaped), "a key written as it is");
        if self.members > 0 {
            self.out.push(b',');
        }
        self.members += 1;
        self.out.push(b'"');
        self.out.extend_from_slice(key.as_bytes());
        self.out.extend_from_slice(b"\":");
        self.out
    }

    pub fn str(&mut self, key: &'static str, value: &str) -> &mut Self {
        write_str(self.key(key), value);
        self
    }

    /// `null` for `None`.
    pub fn opt_str(&mut self, key: &'static str, value: Option<&str>) -> &mut Self {
        match value {
            Some(v) => self.str(key, v),
            None => self.null(key),
        }
    }

    /// `null` for `None`.
    pub fn opt_num(&mut self, key: &'static str, value: Option<u64>) -> &mut Self {
        match value {
            Some(v) => self.num(key, v),
            None => self.null(key),
        }
    }

    /// `null` for `None`, or nothing at all when `skip_none`.
    pub fn maybe_str(
        &mut self,
        key: &'static str,
        value: Option<&str>,
        skip_none: bool,
    ) -> &mut Self {
        match value {
            None if skip_none => self,
            v => self.opt_str(key, v),
        }
    }

    /// `null` for `None`, or nothing at all when `skip_none`.
    pub fn maybe_num(
        &mut self,
        key: &'static str,
        value: Option<u64>,
        skip_none: bool,
    ) -> &mut Self {
        match value {
            None if skip_none => self,
            v => self.opt_num(key, v),
        }
    }

    pub fn num(&mut self, key: &'static str, value: u64) -> &mut Self {
        let mut digits = itoa::Buffer::new();
        let text = digits.format(value).as_bytes();
        self.key(key).extend_from_slice(text);
        self
    }

    pub fn null(&mut self, key: &'static str) -> &mut Self {
        self.key(key).extend_from_slice(b"null");
        self
    }

    /// Closes the object.
    pub fn end(self) {
        self.out.push(b'}');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ours(s: &str) -> String {
        let mut out = Vec::new();
        write_str(&mut out, s);
        String::from_utf8(out).expect("UTF-8 in, UTF-8 out")
    }

    #[test]
    fn strings_are_written_as_serde_json_writes_them() {
        let mut cases: Vec<String> = (0u32..0x80)
            .map(|c| char::from_u32(c).expect("ASCII").to_string())
            .collect();
        cases.extend(
            [
                "",
                "plain",
                "a\"b\\c",
                "\"\"\\\\",
                "line\r\nX-Injected: 1\"}\n{",
                "\u{7f}\u{80}é€😀\u{2028}\u{2029}",
                "\u{0}\u{1}\u{1f} \u{1b}[31m",
                "ends with a quote\"",
                "\\",
            ]
            .map(String::from),
        );
        // Each byte that needs an escape, and its neighbours that do not, at every place in a
        // word of eight and across two.
        for b in [0u8, 0x1f, b'"', b'\\', b'!', b'#', b'[', b']', 0x20, 0x7f] {
            for at in 0..17 {
                let mut s = vec![b'a'; 17];
                s[at] = b;
                cases.push(String::from_utf8(s).expect("ASCII"));
            }
        }
        // Every control character, quote and backslash between and around runs of text.
        cases.push((0u8..0x80).map(char::from).collect());
        cases.push((0u8..0x80).rev().map(char::from).collect::<String>() + "tail");
        for s in &cases {
            assert_eq!(
                ours(s),
                serde_json::to_string(s).expect("serializes"),
                "{s:?}"
            );
        }
    }

    /// The word-at-a-time scan finds what a byte-by-byte one finds: every byte value at every
    /// place of two words and a tail, among neighbours of every kind.
    #[test]
    fn the_scan_finds_the_first_byte_to_escape() {
        for filler in [b'a', 0x20, b'!', b'#', b'[', b']', 0x7f, 0x80, 0xff] {
            for b in 0..=255u8 {
                for at in 0..19 {
                    let mut s = vec![filler; 19];
                    s[at] = b;
                    let slow = s.iter().position(|&c| escaped(c));
                    assert_eq!(first_escaped(&s), slow, "{b:#x} at {at} among {filler:#x}");
                    s[18] = b'"';
                    let slow = s.iter().position(|&c| escaped(c));
                    assert_eq!(first_escaped(&s), slow, "{b:#x} at {at}, quote last");
                }
            }
        }
    }

    #[test]
    fn an_object_is_written_as_serde_json_writes_a_struct() {
        #[derive(serde::Serialize)]
        struct Like<'a> {
            a: Option<&'a str>,
            b: u64,
            c: Option<u64>,
            d: Option<u64>,
            e: &'a str,
            f: Option<&'a str>,
        }
        let like = Like {
            a: None,
            b: u64::MAX,
            c: Some(0),
            d: None,
            e: "x\ny",
            f: Some("é"),
        };
        let mut out = Vec::new();
        let mut o = Object::new(&mut out);
        o.opt_str("a", like.a)
            .num("b", like.b)
            .opt_num("c", like.c)
            .opt_num("d", like.d)
            .str("e", like.e)
            .opt_str("f", like.f);
        o.end();
        assert_eq!(out, serde_json::to_vec(&like).expect("serializes"));
        let mut empty = Vec::new();
        Object::new(&mut empty).end();
        assert_eq!(empty, b"{}");
    }
}
