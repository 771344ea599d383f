//! A record's packed form: the bytes the write-ahead log and sled hold for it (JSON is for the
//! edges: the admin API, exports, the PostgreSQL store).
//!
//! A value starts with a tag byte, never `{` (so a record stored as JSON by versions before reads
//! as it did): [`PACKED`], or [`PACKED_BODY`] when the record's stored body follows it in the
//! same value ([`super::codec::split_value`]). Then the packed record's length (u32, little
//! endian) and the record: its fields in declaration order, integers as LEB128, strings and lists
//! as their length then their items, an `Option` as 0 or 1 then the value, an enum as one byte.
//! No field names: a write's record is about half its JSON size, and packing it takes a fraction
//! of serializing it.
//!
//! The encoder takes every struct apart without `..`, so a field added to a record does not
//! compile until it is packed here too. Fields added later follow the first form's, after an
//! [`EXTENSION`] byte: a record packed before them ends without it (or before the later ones) and reads them as their
//! defaults, and an older version refuses the bytes after its last field instead of misreading
//! them.

use crate::action::{
    Attempt, BodyRef, Millis, Phase, Record, RequestInfo, Resolution, Source, State,
    StoredResponse, Try,
};

/// A packed record, nothing after it.
pub(super) const PACKED: u8 = 0xB1;
/// A packed record, then its stored body.
pub(super) const PACKED_BODY: u8 = 0xB2;
/// Tag and length.
const HEAD: usize = 5;
/// Marks the fields added after the first packed form (`client_key`, `twin`).
const EXTENSION: u8 = 1;
/// Marks the fields added after those (the request's kept `body`).
const EXTENSION_2: u8 = 2;

/// Whether a stored value is a packed record.
pub(super) fn is_packed(v: &[u8]) -> bool {
    matches!(v.first(), Some(&PACKED | &PACKED_BODY))
}

/// Packs `r` into `out` (which it clears): tag, length, record.
pub(super) fn pack(r: &Record, out: &mut Vec<u8>) {
    out.clear();
    out.push(PACKED);
    out.extend_from_slice(&[0; 4]);
    let mut w = W(out);
    w.record(r);
    let len = u32::try_from(out.len() - HEAD).expect("a record is far below 4 GiB");
    out[1..HEAD].copy_from_slice(&len.to_le_bytes());
}

/// Splits a packed value into the packed record (tag and length included) and the body after
/// it, if any; `None` if its length runs past the value.
pub(super) fn split(v: &[u8]) -> Option<(&[u8], Option<&[u8]>)> {
    let len = u32::from_le_bytes(v.get(1..HEAD)?.try_into().ok()?) as usize;
    let end = HEAD.checked_add(len).filter(|&e| e <= v.len())?;
    let (rec, rest) = v.split_at(end);
    match v[0] {
        PACKED if rest.is_empty() => Some((rec, None)),
        PACKED_BODY => Some((rec, Some(rest))),
        _ => None,
    }
}

/// Marks a packed value as carrying a body, to be appended after it.
pub(super) fn mark_body(v: &mut [u8]) {
    v[0] = PACKED_BODY;
}

/// Unpacks a packed record (as [`split`] returns it).
pub(super) fn unpack(v: &[u8]) -> Result<Record, String> {
    let (rec, _) = split(v).ok_or("a packed record's length does not match its value")?;
    let mut r = R(&rec[HEAD..]);
    let record = r.record()?;
    if !r.0.is_empty() {
        return Err(format!("{} bytes after a packed record", r.0.len()));
    }
    Ok(record)
}

struct W<'a>(&'a mut Vec<u8>);

impl W<'_> {
    fn u64(&mut self, mut n: u64) {
        while n >= 0x80 {
            self.0.push((n as u8) | 0x80);
            n >>= 7;
        }
        self.0.push(n as u8);
    }
    fn u32(&mut self, n: u32) {
        self.u64(n.into())
    }
    fn u16(&mut self, n: u16) {
        self.u64(n.into())
    }
    fn bool(&mut self, b: bool) {
        self.0.push(b.into())
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn opt<T>(&mut self, o: &Option<T>, f: impl FnOnce(&mut Self, &T)) {
        match o {
            None => self.0.push(0),
            Some(v) => {
                self.0.push(1);
                f(self, v)
            }
        }
    }
    fn list<T>(&mut self, items: &[T], mut f: impl FnMut(&mut Self, &T)) {
        self.u64(items.len() as u64);
        for i in items {
            f(self, i)
        }
    }
    fn opt_str(&mut self, s: &Option<String>) {
        self.opt(s, |w, s| w.str(s))
    }
    fn headers(&mut self, h: &[(String, String)]) {
        self.list(h, |w, (k, v)| {
            w.str(k);
            w.str(v)
        })
    }
    fn state(&mut self, s: State) {
        self.0.push(s as u8)
    }

    fn record(&mut self, r: &Record) {
        let Record {
            v,
            id,
            upstream,
            principal,
            key,
            fingerprint,
            method,
            path,
            task,
            step,
            tool,
            state,
            attempts,
            owner,
            lease_until,
            created_at,
            updated_at,
            retention_ms,
            expires_at,
            external_id,
            needs_decision,
            request,
            evidence,
            response,
            resolution,
            sealed,
            client_key,
            twin,
        } = r;
        self.u32(*v);
        for s in [id, upstream, principal, key, fingerprint, method, path] {
            self.str(s);
        }
        for s in [task, step, tool] {
            self.opt_str(s);
        }
        self.state(*state);
        self.u32(*attempts);
        self.opt_str(owner);
        self.opt(lease_until, |w, t| w.u64(*t));
        for t in [created_at, updated_at, retention_ms] {
            self.u64(*t);
        }
        self.opt(expires_at, |w, t| w.u64(*t));
        self.opt_str(external_id);
        self.bool(*needs_decision);
        let RequestInfo {
            headers,
            headers_dropped,
            body_size,
            body_sha256,
            body: request_body,
        } = request;
        self.headers(headers);
        self.u32(*headers_dropped);
        self.u64(*body_size);
        self.str(body_sha256);
        self.list(evidence, |w, a| w.attempt(a));
        self.opt(response, |w, s| w.response(s));
        self.opt(resolution, |w, res| {
            let Resolution {
                at,
                actor,
                applied,
                reason,
            } = res;
            w.u64(*at);
            w.str(actor);
            w.bool(*applied);
            w.str(reason);
        });
        self.opt_str(sealed);
        // Fields added since the first packed form, after it and its number: a record packed
        // before them ends here and reads them as their defaults (an older version refuses the
        // bytes after it).
        self.0.push(EXTENSION);
        self.opt_str(client_key);
        self.bool(*twin);
        // Since the request's body is kept (a record packed before ends after `twin`).
        self.0.push(EXTENSION_2);
        self.opt_str(request_body);
    }

    fn attempt(&mut self, a: &Attempt) {
        let Attempt {
            n,
            started_at,
            ended_at,
            state,
            tries,
            tries_dropped,
        } = a;
        self.u32(*n);
        self.u64(*started_at);
        self.opt(ended_at, |w, t| w.u64(*t));
        self.opt(state, |w, s| w.state(*s));
        self.list(tries, |w, t| w.try_(t));
        self.u32(*tries_dropped);
    }

    fn try_(&mut self, t: &Try) {
        let Try {
            at,
            phase,
            error,
            status,
            body,
            request_id,
            body_dropped,
        } = t;
        self.u64(*at);
        self.opt(phase, |w, p| w.0.push(*p as u8));
        self.opt_str(error);
        self.opt(status, |w, s| w.u16(*s));
        self.opt_str(body);
        self.opt_str(request_id);
        self.bool(*body_dropped);
    }

    fn response(&mut self, s: &StoredResponse) {
        let StoredResponse {
            status,
            headers,
            size,
            body,
            source,
        } = s;
        self.u16(*status);
        self.headers(headers);
        self.u64(*size);
        match body {
            BodyRef::Inline => self.0.push(0),
            BodyRef::File { sha256 } => {
                self.0.push(1);
                self.str(sha256)
            }
            BodyRef::Absent => self.0.push(2),
        }
        self.0.push(*source as u8);
    }
}

/// A reader over a packed record: every read is checked against what is left.
struct R<'a>(&'a [u8]);

impl R<'_> {
    fn byte(&mut self) -> Result<u8, String> {
        let (&b, rest) = self.0.split_first().ok_or("a packed record ends early")?;
        self.0 = rest;
        Ok(b)
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut n = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            n |= u64::from(b & 0x7F)
                .checked_shl(shift)
                .filter(|v| v >> shift == u64::from(b & 0x7F))
                .ok_or("a packed integer overflows")?;
            if b < 0x80 {
                return Ok(n);
            }
        }
        Err("a packed integer overflows".into())
    }
    fn u32(&mut self) -> Result<u32, String> {
        u32::try_from(self.u64()?).map_err(|_| "a packed integer is out of range".into())
    }
    fn u16(&mut self) -> Result<u16, String> {
        u16::try_from(self.u64()?).map_err(|_| "a packed integer is out of range".into())
    }
    fn len(&mut self) -> Result<usize, String> {
        usize::try_from(self.u64()?)
            .ok()
            .filter(|&n| n <= self.0.len())
            .ok_or_else(|| "a packed length runs past the record".into())
    }
    fn bool(&mut self) -> Result<bool, String> {
        match self.byte()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(format!("{b} is not a packed bool")),
        }
    }
    fn str(&mut self) -> Result<String, String> {
        let n = self.len()?;
        let (s, rest) = self.0.split_at(n);
        self.0 = rest;
        String::from_utf8(s.to_vec()).map_err(|_| "a packed string is not UTF-8".into())
    }
    fn opt<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, String>,
    ) -> Result<Option<T>, String> {
        if self.bool()? {
            f(self).map(Some)
        } else {
            Ok(None)
        }
    }
    fn list<T>(
        &mut self,
        mut f: impl FnMut(&mut Self) -> Result<T, String>,
    ) -> Result<Vec<T>, String> {
        // Each item takes at least a byte: a count past what is left is corrupt, and never
        // allocates.
        let n = self.len()?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(f(self)?);
        }
        Ok(v)
    }
    fn opt_str(&mut self) -> Result<Option<String>, String> {
        self.opt(Self::str)
    }
    fn headers(&mut self) -> Result<Vec<(String, String)>, String> {
        self.list(|r| Ok((r.str()?, r.str()?)))
    }
    fn millis(&mut self) -> Result<Millis, String> {
        self.u64()
    }
    fn state(&mut self) -> Result<State, String> {
        let b = self.byte()?;
        State::ALL
            .get(usize::from(b))
            .copied()
            .ok_or_else(|| format!("{b} is not a packed state"))
    }

    fn record(&mut self) -> Result<Record, String> {
        let mut r = Record {
            v: self.u32()?,
            id: self.str()?,
            upstream: self.str()?,
            principal: self.str()?,
            key: self.str()?,
            fingerprint: self.str()?,
            method: self.str()?,
            path: self.str()?,
            task: self.opt_str()?,
            step: self.opt_str()?,
            tool: self.opt_str()?,
            state: self.state()?,
            attempts: self.u32()?,
            owner: self.opt_str()?,
            lease_until: self.opt(Self::millis)?,
            created_at: self.millis()?,
            updated_at: self.millis()?,
            retention_ms: self.u64()?,
            expires_at: self.opt(Self::millis)?,
            external_id: self.opt_str()?,
            needs_decision: self.bool()?,
            request: RequestInfo {
                headers: self.headers()?,
                headers_dropped: self.u32()?,
                body_size: self.u64()?,
                body_sha256: self.str()?,
                body: None,
            },
            evidence: self.list(Self::attempt)?,
            response: self.opt(Self::response)?,
            resolution: self.opt(|r| {
                Ok(Resolution {
                    at: r.millis()?,
                    actor: r.str()?,
                    applied: r.bool()?,
                    reason: r.str()?,
                })
            })?,
            sealed: self.opt_str()?,
            client_key: None,
            twin: false,
        };
        if !self.0.is_empty() {
            match self.byte()? {
                EXTENSION => {
                    r.client_key = self.opt_str()?;
                    r.twin = self.bool()?;
                    if !self.0.is_empty() {
                        match self.byte()? {
                            EXTENSION_2 => r.request.body = self.opt_str()?,
                            b => return Err(format!("{b} is not a packed record's extension")),
                        }
                    }
                }
                b => return Err(format!("{b} is not a packed record's extension")),
            }
        }
        Ok(r)
    }

    fn attempt(&mut self) -> Result<Attempt, String> {
        Ok(Attempt {
            n: self.u32()?,
            started_at: self.millis()?,
            ended_at: self.opt(Self::millis)?,
            state: self.opt(Self::state)?,
            tries: self.list(Self::try_)?,
            tries_dropped: self.u32()?,
        })
    }

    fn try_(&mut self) -> Result<Try, String> {
        Ok(Try {
            at: self.millis()?,
            phase: self.opt(|r| match r.byte()? {
                0 => Ok(Phase::Connect),
                1 => Ok(Phase::Send),
                2 => Ok(Phase::Response),
                3 => Ok(Phase::Body),
                b => Err(format!("{b} is not a packed phase")),
            })?,
            error: self.opt_str()?,
            status: self.opt(Self::u16)?,
            body: self.opt_str()?,
            request_id: self.opt_str()?,
            body_dropped: self.bool()?,
        })
    }

    fn response(&mut self) -> Result<StoredResponse, String> {
        Ok(StoredResponse {
            status: self.u16()?,
            headers: self.headers()?,
            size: self.u64()?,
            body: match self.byte()? {
                0 => BodyRef::Inline,
                1 => BodyRef::File {
                    sha256: self.str()?,
                },
                2 => BodyRef::Absent,
                b => return Err(format!("{b} is not a packed body reference")),
            },
            source: match self.byte()? {
                0 => Source::Upstream,
                1 => Source::Lookup,
                b => return Err(format!("{b} is not a packed response source")),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::machine::tests::fresh;
    use rand::Rng;

    /// A record with every field set, or each optional one left out at random.
    fn random(rng: &mut impl Rng) -> Record {
        let mut r = fresh("fp");
        let s = |rng: &mut dyn rand::RngCore, n: usize| -> String {
            (0..rng.random_range(0..n))
                .map(|_| rng.random_range('\0'..='\u{2FFF}'))
                .collect()
        };
        let opt = |rng: &mut dyn rand::RngCore, n: usize| rng.random_bool(0.5).then(|| s(rng, n));
        let millis = |rng: &mut dyn rand::RngCore| rng.random::<u64>() >> rng.random_range(0..64);
        r.v = rng.random();
        r.id = s(rng, 70);
        r.path = s(rng, 300);
        r.task = opt(rng, 20);
        r.step = opt(rng, 20);
        r.tool = opt(rng, 20);
        r.state = State::ALL[rng.random_range(0..4)];
        r.attempts = rng.random();
        r.owner = opt(rng, 40);
        r.lease_until = rng.random_bool(0.5).then(|| millis(rng));
        r.created_at = millis(rng);
        r.updated_at = u64::MAX;
        r.retention_ms = millis(rng);
        r.expires_at = rng.random_bool(0.5).then(|| millis(rng));
        r.external_id = opt(rng, 30);
        r.needs_decision = rng.random();
        r.request.headers = (0..rng.random_range(0..5))
            .map(|_| (s(rng, 20), s(rng, 60)))
            .collect();
        r.request.headers_dropped = rng.random();
        r.request.body_size = millis(rng);
        r.request.body = opt(rng, 200);
        r.evidence = (0..rng.random_range(0..4))
            .map(|n| Attempt {
                n,
                started_at: millis(rng),
                ended_at: rng.random_bool(0.5).then(|| millis(rng)),
                state: rng
                    .random_bool(0.5)
                    .then(|| State::ALL[rng.random_range(0..4)]),
                tries: (0..rng.random_range(0..4))
                    .map(|_| Try {
                        at: millis(rng),
                        phase: rng.random_bool(0.5).then(|| {
                            [Phase::Connect, Phase::Send, Phase::Response, Phase::Body]
                                [rng.random_range(0..4)]
                        }),
                        error: opt(rng, 80),
                        status: rng.random_bool(0.5).then(|| rng.random()),
                        body: opt(rng, 200),
                        request_id: opt(rng, 30),
                        body_dropped: rng.random(),
                    })
                    .collect(),
                tries_dropped: rng.random(),
            })
            .collect();
        r.response = rng.random_bool(0.7).then(|| StoredResponse {
            status: rng.random(),
            headers: vec![(s(rng, 10), s(rng, 10))],
            size: millis(rng),
            body: [
                BodyRef::Inline,
                BodyRef::Absent,
                BodyRef::File { sha256: s(rng, 64) },
            ][rng.random_range(0..3)]
            .clone(),
            source: [Source::Upstream, Source::Lookup][rng.random_range(0..2)],
        });
        r.resolution = rng.random_bool(0.3).then(|| Resolution {
            at: millis(rng),
            actor: s(rng, 10),
            applied: rng.random(),
            reason: s(rng, 50),
        });
        r.sealed = opt(rng, 100);
        r.client_key = opt(rng, 40);
        r.twin = rng.random();
        r
    }

    #[test]
    fn every_record_unpacks_as_it_was_packed() {
        let mut rng = rand::rng();
        let mut v = Vec::new();
        for _ in 0..2_000 {
            let r = random(&mut rng);
            pack(&r, &mut v);
            assert!(is_packed(&v) && v[0] != b'{');
            assert_eq!(unpack(&v).expect("unpacks"), r);
        }
    }

    #[test]
    fn a_write_packs_to_about_half_its_json() {
        let mut r = fresh("f".repeat(64).as_str());
        r.id = "a".repeat(64);
        r.principal = "p".repeat(64);
        r.request.body_sha256 = "b".repeat(64);
        r.request.headers = vec![("content-type".into(), "application/json".into())];
        let mut v = Vec::new();
        pack(&r, &mut v);
        let json = serde_json::to_vec(&r).expect("encodes");
        assert!(
            v.len() * 10 < json.len() * 7,
            "{} vs {}",
            v.len(),
            json.len()
        );
    }

    #[test]
    fn a_damaged_record_is_an_error_never_a_panic() {
        let mut rng = rand::rng();
        let mut v = Vec::new();
        let packed_len = |o: &Option<String>| {
            let mut t = Vec::new();
            W(&mut t).opt_str(o);
            t.len()
        };
        for _ in 0..300 {
            let r = random(&mut rng);
            pack(&r, &mut v);
            // Where a record packed before each extension ended (each extension's tag): cut
            // there, it is that older record, whole.
            let ext_2 = v.len() - packed_len(&r.request.body) - 1;
            let older = [ext_2, ext_2 - 1 - packed_len(&r.client_key) - 1];
            assert_eq!((v[older[0]], v[older[1]]), (EXTENSION_2, EXTENSION));
            // Cut short: the length no longer matches, and nothing reads past the end.
            for cut in [HEAD, v.len() / 2, v.len() - 1] {
                let cut = if older.contains(&cut) { cut - 1 } else { cut };
                assert!(unpack(&v[..cut]).is_err());
                let mut short = v[..cut].to_vec();
                let len = (cut - HEAD) as u32;
                short[1..HEAD].copy_from_slice(&len.to_le_bytes());
                assert!(unpack(&short).is_err(), "cut at {cut} of {}", v.len());
            }
            // A byte changed anywhere: an error or some record, never a panic or a huge
            // allocation.
            let mut bad = v.clone();
            let at = rng.random_range(HEAD..bad.len());
            bad[at] = rng.random();
            let _ = unpack(&bad);
            bad[at] = 0xFF;
            let _ = unpack(&bad);
        }
        // A body after a record that says it has none is refused.
        pack(&fresh("fp"), &mut v);
        v.push(b'x');
        assert!(split(&v).is_none());
    }
}
