//! Canonical forms of request bodies, for fingerprints (SPEC §4.2). Two bodies that mean the same
//! write share a form; two that differ in meaning never do. Pure, no I/O.
//!
//! - JSON: keys sorted, no white space, strings compared after unescaping, numbers kept as their
//!   exact text (a float would round `12345678901234567890` and `0.1000000000000000001`). A body
//!   with a duplicate key in any object is ambiguous (parsers disagree on which one wins), so it
//!   has no canonical form and is hashed as bytes.
//! - Forms: decoded, stably sorted by name.
//! - `multipart/form-data`: the parts in order, each as name, filename, content type and bytes;
//!   not the boundary, which SDKs draw anew on every retry.

use std::collections::BTreeMap;

// serde_json's escaping: the same form the fingerprint has always used for strings.
use crate::jsontext::write_str;

/// Deeper JSON is hashed as bytes rather than parsed (no stack is at risk).
const MAX_DEPTH: usize = 128;

/// A JSON value as the fingerprint sees it: numbers as written.
#[derive(Debug, Clone, PartialEq)]
enum Json<'a> {
    Null,
    Bool(bool),
    Num(&'a str),
    Str(String),
    Arr(Vec<Json<'a>>),
    Obj(BTreeMap<String, Json<'a>>),
}

struct Parser<'a> {
    src: &'a str,
    at: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.src.as_bytes().get(self.at).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn eat(&mut self, lit: &str) -> Option<()> {
        self.src[self.at..].starts_with(lit).then(|| {
            self.at += lit.len();
        })
    }

    fn value(&mut self, depth: usize) -> Option<Json<'a>> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.ws();
        match self.peek()? {
            b'n' => self.eat("null").map(|()| Json::Null),
            b't' => self.eat("true").map(|()| Json::Bool(true)),
            b'f' => self.eat("false").map(|()| Json::Bool(false)),
            b'"' => self.string().map(Json::Str),
            b'[' => {
                self.at += 1;
                let mut items = Vec::new();
                self.ws();
                if self.peek() == Some(b']') {
                    self.at += 1;
                    return Some(Json::Arr(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    self.ws();
                    match self.peek()? {
                        b',' => self.at += 1,
                        b']' => {
                            self.at += 1;
                            return Some(Json::Arr(items));
                        }
                        _ => return None,
                    }
                }
            }
            b'{' => {
                self.at += 1;
                let mut map = BTreeMap::new();
                self.ws();
                if self.peek() == Some(b'}') {
                    self.at += 1;
                    return Some(Json::Obj(map));
                }
                loop {
                    self.ws();
                    let key = self.string()?;
                    self.ws();
                    self.eat(":")?;
                    let v = self.value(depth + 1)?;
                    if map.insert(key, v).is_some() {
                        // A duplicate key: which one counts depends on the parser.
                        return None;
                    }
                    self.ws();
                    match self.peek()? {
                        b',' => self.at += 1,
                        b'}' => {
                            self.at += 1;
                            return Some(Json::Obj(map));
                        }
                        _ => return None,
                    }
                }
            }
            b'-' | b'0'..=b'9' => self.number().map(Json::Num),
            _ => None,
        }
    }

    /// A string, unescaped (serde_json checks escapes and surrogates).
    fn string(&mut self) -> Option<String> {
        let b = self.src.as_bytes();
        if b.get(self.at) != Some(&b'"') {
            return None;
        }
        let start = self.at;
        let mut i = start + 1;
        loop {
            match *b.get(i)? {
                b'"' => break,
                b'\\' => i += 2,
                c if c < 0x20 => return None,
                _ => i += 1,
            }
        }
        self.at = i + 1;
        serde_json::from_str(&self.src[start..self.at]).ok()
    }

    /// A number, as written: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
    fn number(&mut self) -> Option<&'a str> {
        let b = self.src.as_bytes();
        let start = self.at;
        let digits = |i: &mut usize| {
            let from = *i;
            while b.get(*i).is_some_and(u8::is_ascii_digit) {
                *i += 1;
            }
            *i > from
        };
        let mut i = start;
        if b.get(i) == Some(&b'-') {
            i += 1;
        }
        if b.get(i) == Some(&b'0') {
            i += 1;
        } else if !digits(&mut i) {
            return None;
        }
        if b.get(i) == Some(&b'.') {
            i += 1;
            if !digits(&mut i) {
                return None;
            }
        }
        if matches!(b.get(i), Some(b'e' | b'E')) {
            i += 1;
            if matches!(b.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            if !digits(&mut i) {
                return None;
            }
        }
        self.at = i;
        Some(&self.src[start..i])
    }
}

fn parse(body: &[u8]) -> Option<Json<'_>> {
    let src = std::str::from_utf8(body).ok()?;
    let mut p = Parser { src, at: 0 };
    let v = p.value(0)?;
    p.ws();
    (p.at == src.len()).then_some(v)
}

/// Removes the value at a JSON pointer (RFC 6901), if there is one.
fn remove(v: &mut Json<'_>, pointer: &str) {
    let Some(path) = pointer.strip_prefix('/') else {
        return;
    };
    let tokens: Vec<String> = path
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect();
    let Some((last, parents)) = tokens.split_last() else {
        return;
    };
    let mut cur = v;
    for t in parents {
        cur = match cur {
            Json::Obj(m) => match m.get_mut(t) {
                Some(next) => next,
                None => return,
            },
            Json::Arr(a) => match t.parse::<usize>().ok().and_then(|i| a.get_mut(i)) {
                Some(next) => next,
                None => return,
            },
            _ => return,
        };
    }
    match cur {
        Json::Obj(m) => {
            m.remove(last);
        }
        Json::Arr(a) => {
            if let Some(i) = last.parse::<usize>().ok().filter(|i| *i < a.len()) {
                a.remove(i);
            }
        }
        _ => {}
    }
}

fn write(v: &Json<'_>, out: &mut Vec<u8>) {
    match v {
        Json::Null => out.extend_from_slice(b"null"),
        Json::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Json::Num(n) => out.extend_from_slice(n.as_bytes()),
        Json::Str(s) => write_str(out, s),
        Json::Arr(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out);
            }
            out.push(b']');
        }
        Json::Obj(map) => {
            out.push(b'{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_str(out, k);
                out.push(b':');
                write(item, out);
            }
            out.push(b'}');
        }
    }
}

/// The canonical form of a JSON body, or `None` when it has none (it does not parse, is nested
/// deeper than `MAX_DEPTH`, or has a duplicate key): the caller hashes the bytes.
pub fn json(body: &[u8], ignore: &[String]) -> Option<Vec<u8>> {
    let mut v = parse(body)?;
    for p in ignore {
        remove(&mut v, p);
    }
    let mut out = Vec::with_capacity(body.len());
    write(&v, &mut out);
    Some(out)
}

/// The canonical forms of members of one JSON body, each named by a JSON pointer and without its
/// `ignore` pointers (relative to that member), from one parse. `null` for a member the body does
/// not have; `None` when the body has no canonical form.
pub fn json_members(body: &[u8], members: &[(&str, &[String])]) -> Option<Vec<Vec<u8>>> {
    let root = parse(body)?;
    let out = members
        .iter()
        .map(|(at, ignore)| {
            let mut cur = &root;
            for t in at.split('/').skip(1) {
                cur = match cur {
                    Json::Obj(m) => m.get(t).unwrap_or(&Json::Null),
                    _ => &Json::Null,
                };
            }
            let mut v = cur.clone();
            for p in ignore.iter() {
                remove(&mut v, p);
            }
            let mut bytes = Vec::new();
            write(&v, &mut bytes);
            bytes
        })
        .collect();
    Some(out)
}

/// Whether a JSON body has a canonical form: it parses, within `MAX_DEPTH`, with no duplicate
/// key in any object (a body parsers would read differently).
pub fn is_unambiguous_json(body: &[u8]) -> bool {
    parse(body).is_some()
}

/// The canonical form of a form body: decoded pairs stably sorted by name, without `ignore`.
pub fn form(body: &[u8], ignore: &[String]) -> Vec<u8> {
    let mut pairs: Vec<(String, String)> = form_urlencoded::parse(body)
        .into_owned()
        .filter(|(k, _)| !ignore.iter().any(|i| i == k))
        .collect();
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish()
        .into_bytes()
}

/// The `boundary` parameter of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Option<&str> {
    content_type.split(';').skip(1).find_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim().eq_ignore_ascii_case("boundary").then(|| {
            let v = v.trim();
            v.strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(v)
        })
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// One header parameter (`name="x"`) of a part's `Content-Disposition`.
fn param<'a>(disposition: &'a str, name: &str) -> Option<&'a str> {
    disposition.split(';').skip(1).find_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim().eq_ignore_ascii_case(name).then(|| {
            let v = v.trim();
            v.strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(v)
        })
    })
}

/// The canonical form of a `multipart/form-data` body (RFC 7578): each part's name, filename,
/// content type and bytes, length-prefixed, in order, without the parts named in `ignore`. `None`
/// when it does not parse (the caller hashes the bytes).
pub fn multipart(body: &[u8], boundary: &str, ignore: &[String]) -> Option<Vec<u8>> {
    if boundary.is_empty() || boundary.len() > 70 {
        return None;
    }
    let delimiter = format!("--{boundary}");
    let next = format!("\r\n--{boundary}");
    // A preamble before the first delimiter is allowed and means nothing.
    let start = if body.starts_with(delimiter.as_bytes()) {
        delimiter.len()
    } else {
        find(body, next.as_bytes())? + next.len()
    };
    let mut rest = &body[start..];
    let mut out = b"multipart/form-data\0".to_vec();
    loop {
        if rest.starts_with(b"--") {
            // The close delimiter; an epilogue after it means nothing.
            return Some(out);
        }
        rest = rest.strip_prefix(b"\r\n")?;
        let head_end = find(rest, b"\r\n\r\n")?;
        let head = std::str::from_utf8(&rest[..head_end]).ok()?;
        let after = &rest[head_end + 4..];
        let end = find(after, next.as_bytes())?;
        let content = &after[..end];
        rest = &after[end + next.len()..];
        let (mut disposition, mut content_type) = (None, "");
        // What else the part says that changes what its bytes mean (its
        // `Content-Transfer-Encoding`, an RFC 8187 `filename*`, any other header).
        let mut more: Vec<(String, &str)> = Vec::new();
        for line in head.split("\r\n") {
            let (k, v) = line.split_once(':')?;
            match k.trim().to_ascii_lowercase().as_str() {
                "content-disposition" => disposition = Some(v.trim()),
                "content-type" => content_type = v.trim(),
                other => more.push((other.to_string(), v.trim())),
            }
        }
        let disposition = disposition?;
        let name = param(disposition, "name")?;
        if ignore.iter().any(|i| i == name) {
            continue;
        }
        if let Some(f) = param(disposition, "filename*") {
            more.push(("filename*".into(), f));
        }
        put(&mut out, name.as_bytes());
        put(
            &mut out,
            param(disposition, "filename").unwrap_or("").as_bytes(),
        );
        put(&mut out, content_type.as_bytes());
        put(&mut out, content);
        if !more.is_empty() {
            // Only a part that has them adds them, so the form of every other part is what it
            // was. Behind a byte no length starts with (lengths are below 2^56), so that they
            // never read as the next part: how many, then each name and value.
            more.sort_unstable();
            out.push(MORE);
            out.extend_from_slice(&(more.len() as u64).to_be_bytes());
            for (k, v) in &more {
                put(&mut out, k.as_bytes());
                put(&mut out, v.as_bytes());
            }
        }
    }
}

/// `bytes`, length-prefixed.
fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
    out.extend_from_slice(bytes);
}

/// Marks a multipart part's further headers in its canonical form.
const MORE: u8 = 0xff;

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> Option<String> {
        json(s.as_bytes(), &[]).map(|v| String::from_utf8(v).expect("UTF-8"))
    }

    #[test]
    fn json_sorts_keys_drops_space_and_keeps_the_serde_form_of_strings() {
        assert_eq!(
            canon(r#" {"b": 1, "a": {"y": "é\u00e9\n", "x": [1, 2, {}]}} "#).as_deref(),
            Some(r#"{"a":{"x":[1,2,{}],"y":"éé\n"},"b":1}"#)
        );
        assert_eq!(canon(r#""a\/b""#).as_deref(), Some(r#""a/b""#));
        assert_eq!(canon("[]").as_deref(), Some("[]"));
    }

    #[test]
    fn json_numbers_keep_their_exact_text() {
        // Each pair collided when numbers went through a float.
        for (a, b) in [
            ("18446744073709551616", "18446744073709551617"),
            (
                "123456789012345678901234567890",
                "123456789012345678901234567891",
            ),
            ("0.1000000000000000001", "0.1000000000000000002"),
            ("1e400", "2e400"),
        ] {
            let (x, y) = (
                canon(&format!("{{\"n\":{a}}}")),
                canon(&format!("{{\"n\":{b}}}")),
            );
            assert!(x.is_some() && x != y, "{a} and {b}");
            assert_eq!(x.expect("parses"), format!("{{\"n\":{a}}}"));
        }
    }

    #[test]
    fn json_with_a_duplicate_key_or_bad_syntax_has_no_canonical_form() {
        for bad in [
            r#"{"a":1,"a":2}"#,
            r#"{"x":{"a":1,"a":1}}"#,
            r#"{"a":01}"#,
            r#"{"a":1.}"#,
            r#"{"a":-}"#,
            r#"{"a":1,}"#,
            r#"[1 2]"#,
            r#"{"a":"\x"}"#,
            "{\"a\":\"\u{1}\"}",
            r#"{"a":1} x"#,
            "nul",
            "",
        ] {
            assert_eq!(canon(bad), None, "{bad}");
        }
        let deep = "[".repeat(MAX_DEPTH + 2) + &"]".repeat(MAX_DEPTH + 2);
        assert_eq!(canon(&deep), None);
    }

    #[test]
    fn json_ignores_pointers_in_objects_and_arrays() {
        let ignore = vec!["/meta/trace".to_string(), "/items/0".into(), "/a~1b".into()];
        assert_eq!(
            json(
                br#"{"meta":{"trace":"x","k":1},"items":[9,8],"a/b":1}"#,
                &ignore
            )
            .map(String::from_utf8),
            Some(Ok(r#"{"items":[8],"meta":{"k":1}}"#.to_string()))
        );
    }

    fn part(
        boundary: &str,
        name: &str,
        file: Option<&str>,
        ct: Option<&str>,
        body: &str,
    ) -> String {
        let mut s = format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"");
        if let Some(f) = file {
            s += &format!("; filename=\"{f}\"");
        }
        s += "\r\n";
        if let Some(ct) = ct {
            s += &format!("Content-Type: {ct}\r\n");
        }
        s + "\r\n" + body + "\r\n"
    }

    fn form_data(boundary: &str, purpose: &str, file: &str) -> String {
        part(boundary, "purpose", None, None, purpose)
            + &part(
                boundary,
                "file",
                Some("data.jsonl"),
                Some("application/octet-stream"),
                file,
            )
            + &format!("--{boundary}--\r\n")
    }

    #[test]
    fn multipart_does_not_depend_on_the_boundary() {
        let a = form_data("a1b2c3", "batch", "{\"x\":1}\n");
        let b = form_data("zz-other-boundary", "batch", "{\"x\":1}\n");
        let ca = multipart(a.as_bytes(), "a1b2c3", &[]).expect("parses");
        assert_eq!(
            Some(ca.clone()),
            multipart(b.as_bytes(), "zz-other-boundary", &[])
        );
        // Any part that differs: a different form.
        let c = form_data("q", "batch", "{\"x\":2}\n");
        assert_ne!(Some(ca.clone()), multipart(c.as_bytes(), "q", &[]));
        let d = form_data("q", "fine-tune", "{\"x\":1}\n");
        assert_ne!(Some(ca.clone()), multipart(d.as_bytes(), "q", &[]));
        // Ignored parts are left out; a preamble and an epilogue mean nothing.
        let e = format!(
            "preamble\r\n{}epilogue",
            form_data("q", "other", "{\"x\":1}\n")
        );
        assert_eq!(
            multipart(a.as_bytes(), "a1b2c3", &["purpose".into()]),
            multipart(e.as_bytes(), "q", &["purpose".into()])
        );
    }

    /// Issue 58 item 14: a part's transfer encoding and its RFC 8187 `filename*` change what
    /// the upstream makes of it, so they change the form; a part without them keeps the form it
    /// had (name, filename, type, bytes), so fingerprints made before stay the same.
    #[test]
    fn multipart_tells_parts_apart_by_transfer_encoding_and_extended_filename() {
        let with = |disposition: &str, more: &str| {
            let body = format!(
                "--b\r\nContent-Disposition: form-data; name=\"file\"{disposition}\r\n{more}\r\nAAAA\r\n--b--\r\n"
            );
            multipart(body.as_bytes(), "b", &[]).expect("parses")
        };
        let plain = with("", "");
        let mut expected = b"multipart/form-data\0".to_vec();
        for field in [&b"file"[..], b"", b"", b"AAAA"] {
            put(&mut expected, field);
        }
        assert_eq!(plain, expected);
        let forms = [
            plain,
            with("", "Content-Transfer-Encoding: base64\r\n"),
            with("", "Content-Transfer-Encoding: 7bit\r\n"),
            with("; filename*=UTF-8''%E2%82%AC.txt", ""),
            with("; filename*=UTF-8''%C2%A3.txt", ""),
        ];
        for (i, a) in forms.iter().enumerate() {
            for b in &forms[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // Header names' case and order do not matter.
        assert_eq!(
            with("", "content-transfer-encoding: base64\r\nX-A: 1\r\n"),
            with("", "X-A: 1\r\nContent-Transfer-Encoding: base64\r\n")
        );
    }

    #[test]
    fn multipart_that_does_not_parse_has_no_canonical_form() {
        let ok = form_data("b", "batch", "x");
        assert!(multipart(ok.as_bytes(), "b", &[]).is_some());
        assert_eq!(multipart(ok.as_bytes(), "other", &[]), None);
        assert_eq!(multipart(b"--b\r\nno head end", "b", &[]), None);
        let unnamed = "--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--";
        assert_eq!(multipart(unnamed.as_bytes(), "b", &[]), None);
        let unclosed = "--b\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nx";
        assert_eq!(multipart(unclosed.as_bytes(), "b", &[]), None);
        assert_eq!(
            boundary("multipart/form-data; boundary=\"x y\""),
            Some("x y")
        );
        assert_eq!(boundary("multipart/form-data;Boundary=abc"), Some("abc"));
        assert_eq!(boundary("multipart/form-data"), None);
    }
}
