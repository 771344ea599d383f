//! A record's stored form: bounded in size, sealed when encryption is on.

use super::*;

/// What a record's encoding usually fits in, with a small body after it (a write's record is
/// about 450 bytes packed).
const ENCODED_HINT: usize = 1024;

/// Encodes a record within [`RECORD_MAX`]. A record over it sheds evidence until it fits: the
/// request's kept body (its size and hash stay); then the tries' bodies, oldest first, except
/// the last try's; then the request's headers, last first; then whole tries, oldest first (each
/// attempt keeps its last); then the last try's body. Each dropped piece is marked in the
/// record (the body's absence is its mark).
/// Returns the record as stored and its encoding. The record is shared: it is copied only when
/// it must shed evidence.
pub(super) fn encode_bounded(r: Arc<Record>, sealer: Option<&Sealer>) -> (Arc<Record>, Vec<u8>) {
    let v = encode(&r, sealer);
    if v.len() <= RECORD_MAX {
        return (r, v);
    }
    let (r, v) = shed(Arc::unwrap_or_clone(r), v, sealer);
    (Arc::new(r), v)
}

/// A record packed ([`packed`]); with a sealer, its secrets sealed (the bound applies to the
/// sealed form, which is what sled holds).
fn encode(r: &Record, sealer: Option<&Sealer>) -> Vec<u8> {
    // Into a buffer sized for a usual record: grown from empty it was copied several times.
    let mut v = Vec::with_capacity(ENCODED_HINT);
    match sealer {
        None => packed::pack(r, &mut v),
        Some(s) => {
            let mut sealed = r.clone();
            s.seal_record(&mut sealed);
            packed::pack(&sealed, &mut v)
        }
    }
    v
}

/// Sheds evidence from `r`, whose encoding `v` is over [`RECORD_MAX`], until it fits.
fn shed(mut r: Record, mut v: Vec<u8>, sealer: Option<&Sealer>) -> (Record, Vec<u8>) {
    let size = v.len();
    let tries: Vec<(usize, usize)> = r
        .evidence
        .iter()
        .enumerate()
        .flat_map(|(a, at)| (0..at.tries.len()).map(move |t| (a, t)))
        .collect();
    let last = tries.last().copied();
    // A try's strings, and about what its other fields take packed.
    fn try_size(t: &crate::action::Try) -> usize {
        [&t.error, &t.body, &t.request_id]
            .iter()
            .map(|s| s.as_ref().map_or(1, |s| s.len() + 2))
            .sum::<usize>()
            + 8
    }
    pub(super) fn drop_body(t: &mut crate::action::Try) -> usize {
        t.body.take().map_or(0, |b| {
            t.body_dropped = true;
            b.len()
        })
    }
    // Each step sheds about `excess` bytes (counted from the pieces' raw sizes) and says whether
    // it shed anything; it runs again until the encoding fits or it has nothing left.
    type Step<'a> = &'a dyn Fn(&mut Record, usize) -> bool;
    let steps: [Step; 5] = [
        &|r, _| r.request.body.take().is_some(),
        &|r, mut excess| {
            let mut shed = false;
            for &(a, t) in tries.iter().filter(|&&at| Some(at) != last) {
                if excess == 0 {
                    break;
                }
                let n = drop_body(&mut r.evidence[a].tries[t]);
                excess = excess.saturating_sub(n);
                shed |= n > 0;
            }
            shed
        },
        &|r, mut excess| {
            let mut shed = false;
            while excess > 0 {
                let Some((k, val)) = r.request.headers.pop() else {
                    break;
                };
                excess = excess.saturating_sub(k.len() + val.len());
                r.request.headers_dropped += 1;
                shed = true;
            }
            shed
        },
        &|r, mut excess| {
            let mut shed = false;
            for a in r.evidence.iter_mut() {
                while excess > 0 && a.tries.len() > 1 {
                    let t = a.tries.remove(0);
                    excess = excess.saturating_sub(try_size(&t));
                    a.tries_dropped += 1;
                    shed = true;
                }
            }
            shed
        },
        // Whole tries may have gone: the last try is still its attempt's last.
        &|r, _| {
            r.evidence
                .iter_mut()
                .rev()
                .find_map(|a| a.tries.last_mut())
                .is_some_and(|t| drop_body(t) > 0)
        },
    ];
    for step in steps {
        while step(&mut r, v.len() - RECORD_MAX) {
            v = encode(&r, sealer);
            if v.len() <= RECORD_MAX {
                tracing::debug!(id = %r.id, size, "record shed evidence to fit the store's bound");
                return (r, v);
            }
        }
    }
    // Only a very long path and response head with very many attempts get here.
    tracing::warn!(
        id = %r.id,
        size = v.len(),
        "record exceeds the store's bound even without its tries' evidence"
    );
    (r, v)
}

/// A record's value may carry its stored response body: the packed record, then the body as
/// stored (sealed when encryption is on), the record's tag saying so ([`packed::split`]). One
/// value, one sled insert for both; the body is kept under its own key ([`body_key`]) only when
/// the two together would exceed [`RECORD_MAX`] (and by stores from before). Returns the record
/// and the body. Versions before stored the record as JSON, then a newline and the body (compact
/// JSON holds no newline: a string's control characters are escaped); those values read as they
/// did. A packed value whose length runs past it is returned whole, for [`decode`] to refuse.
pub(super) fn split_value(v: &[u8]) -> (&[u8], Option<&[u8]>) {
    if packed::is_packed(v) {
        return packed::split(v).unwrap_or((v, None));
    }
    match v.iter().position(|&b| b == b'\n') {
        Some(at) => (&v[..at], Some(&v[at + 1..])),
        None => (v, None),
    }
}

/// Appends a stored body to an encoded record ([`split_value`]) if both fit within
/// [`RECORD_MAX`]; says whether it did.
pub(super) fn frame_body(value: &mut Vec<u8>, body: &[u8]) -> bool {
    if value.len() + body.len() > RECORD_MAX {
        return false;
    }
    packed::mark_body(value);
    value.extend_from_slice(body);
    true
}

/// Parses a stored record (a body after it is left out) and, with a sealer, opens its secrets.
/// Without one a sealed record keeps them sealed (index maintenance needs none of them).
pub(super) fn decode(key: &[u8], v: &[u8], sealer: Option<&Sealer>) -> Result<Record, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        id: String::from_utf8_lossy(key).into_owned(),
        reason,
    };
    let mut r = if packed::is_packed(v) {
        packed::unpack(v).map_err(corrupt)?
    } else {
        serde_json::from_slice(split_value(v).0).map_err(|e| corrupt(e.to_string()))?
    };
    if let Some(s) = sealer {
        s.open_record(&mut r).map_err(corrupt)?;
    }
    Ok(r)
}

/// A record's stored value read without the store (for tests' fixtures of older layouts and
/// tools that read sled directly): the record, secrets still sealed, and the stored body the
/// value carries. Reads both forms, packed and JSON.
pub fn read_value<'v>(key: &[u8], v: &'v [u8]) -> Result<(Record, Option<&'v [u8]>), StoreError> {
    Ok((decode(key, v, None)?, split_value(v).1))
}

/// The value the store writes for `r` (unsealed) with a small stored `body` after it: for the
/// benches' floor, which writes values of the store's own form and size. A body that would take
/// the value past [`RECORD_MAX`] is left out, as the store keeps such a body under its own key.
pub fn record_value(r: &Record, body: &[u8]) -> Vec<u8> {
    let mut v = encode(r, None);
    frame_body(&mut v, body);
    v
}

/// The first sequence number of a log block, from its key.
pub(super) fn log_seq(key: &[u8]) -> Option<u64> {
    key.strip_prefix(b"l/")
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_be_bytes)
}

/// The entries of a log block (one line each, in order: the block's first sequence number and
/// on).
pub(super) fn log_lines(block: &[u8]) -> impl DoubleEndedIterator<Item = &[u8]> {
    block.split(|b| *b == b'\n').filter(|l| !l.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::tests::fresh;

    fn with_tries(attempts: usize, tries: usize, body: usize) -> Record {
        let mut r = fresh("fp");
        for n in 0..attempts {
            r.evidence.push(crate::action::Attempt {
                n: n as u32 + 1,
                started_at: 1,
                ended_at: Some(2),
                state: Some(State::Failed),
                tries: (0..tries)
                    .map(|t| crate::action::Try {
                        at: 2,
                        status: Some(503),
                        error: Some(format!("attempt {n} try {t}")),
                        body: Some("b".repeat(body)),
                        ..Default::default()
                    })
                    .collect(),
                tries_dropped: 0,
            });
        }
        r
    }

    #[test]
    fn a_small_record_is_stored_as_it_is() {
        let r = with_tries(5, 3, 4096);
        let (stored, v) = encode_bounded(Arc::new(r.clone()), None);
        assert_eq!(*stored, r);
        assert_eq!(decode(b"k", &v, None).expect("decodes"), r);
    }

    #[test]
    fn a_record_sheds_headers_then_whole_tries_then_the_last_body() {
        // Request headers over the bound: every try body goes, then headers, last first.
        let mut r = with_tries(2, 2, 4096);
        r.request.headers = (0..40)
            .map(|i| (format!("x-h{i:02}"), "v".repeat(4096)))
            .collect();
        let (stored, v) = encode_bounded(Arc::new(r), None);
        assert!(v.len() <= RECORD_MAX);
        let tries: Vec<_> = stored.evidence.iter().flat_map(|a| &a.tries).collect();
        assert!(tries[..3]
            .iter()
            .all(|t| t.body_dropped && t.body.is_none()));
        assert!(tries[3].body.is_some(), "the last try's body goes last");
        let kept = stored.request.headers.len();
        assert_eq!(kept as u32 + stored.request.headers_dropped, 40);
        assert!(kept > 0 && stored.request.headers[kept - 1].0 == format!("x-h{:02}", kept - 1));

        // Tries beyond what bodiless evidence fits: whole tries go, oldest first, each attempt
        // keeping its last.
        let r = with_tries(20, 400, 10);
        let (stored, v) = encode_bounded(Arc::new(r), None);
        assert!(v.len() <= RECORD_MAX);
        let first = &stored.evidence[0];
        assert!(first.tries_dropped > 0);
        assert_eq!(first.tries.len() + first.tries_dropped as usize, 400);
        assert_eq!(
            first.tries.last().expect("kept").error.as_deref(),
            Some("attempt 0 try 399")
        );
        assert!(stored.evidence.iter().all(|a| !a.tries.is_empty()));
        assert_eq!(stored.evidence.last().expect("kept").tries_dropped, 0);
    }

    #[test]
    fn the_largest_record_a_safe_policy_makes_fits_the_bound() {
        // The worst a request can bring: a head at the server's limit, all path. The worst a
        // succeeded response leaves: a head at the stored limit. Every attempt a policy within
        // `SLED_SAFE_ATTEMPTS` allows, each with long errors, request ids and 4 KiB bodies.
        let attempts = crate::config::SLED_SAFE_ATTEMPTS as usize;
        let mut r = with_tries(attempts, 3, 4096);
        r.path = "p".repeat(crate::server::HEAD_MAX);
        for t in r.evidence.iter_mut().flat_map(|a| a.tries.iter_mut()) {
            t.error = Some("e".repeat(200));
            t.request_id = Some("r".repeat(64));
        }
        r.response = Some(crate::action::StoredResponse {
            status: 201,
            headers: vec![("x".into(), "h".repeat(crate::proxy::STORED_HEAD_MAX - 1))],
            size: 2,
            body: BodyRef::Inline,
            source: crate::action::Source::Upstream,
        });
        let (stored, v) = encode_bounded(Arc::new(r), None);
        assert!(v.len() <= RECORD_MAX, "{} bytes", v.len());
        assert_eq!(stored.evidence.len(), attempts);
    }
}
