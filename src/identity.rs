//! Identity of an action (SPEC §4): key, fingerprint, principal and action id. Pure, no I/O.

use http::HeaderMap;
use ring::hmac;
use sha2::{Digest, Sha256};

use crate::canonical;
use crate::config::{ClientKeys, Policy};

pub const ANONYMOUS: &str = "anonymous";

/// Why a key could not be derived (mapped to `key-invalid` / `key-required`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    Invalid(String),
    Required,
}

pub use crate::action::KeySource;

/// The identity of one write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub key: String,
    pub source: KeySource,
    pub task: Option<String>,
    pub step: Option<String>,
    /// Full hex SHA-256 of the principal's credentials, or `anonymous`.
    pub principal: String,
    /// Hex SHA-256 of the request in canonical form.
    pub fingerprint: String,
    /// 32 hex characters (SPEC §4.4).
    pub action_id: String,
    /// The client's own `Idempotency-Key` when it is not the action's key (task and step
    /// outrank it, or the upstream's `client_keys` is `per-call`): kept as evidence.
    pub client_key: Option<String>,
    /// `Oncegate-Allow-Twin`: the id of the unsettled action this write knowingly repeats.
    pub allow_twin: Option<String>,
}

impl Identity {
    /// The key of the unsettled-twin guard (SPEC §4.1): the same caller's identical write to
    /// the same upstream, whatever its key.
    pub fn twin_key(&self, upstream: &str) -> String {
        twin_key(upstream, &self.principal, &self.fingerprint)
    }
}

/// `tw-` and 32 hex characters of SHA-256(upstream, principal, fingerprint): what two twins
/// share (SPEC §4.1, the unsettled-twin guard).
pub fn twin_key(upstream: &str, principal: &str, fingerprint: &str) -> String {
    let d = sha256_parts(&[
        b"twin",
        upstream.as_bytes(),
        principal.as_bytes(),
        fingerprint.as_bytes(),
    ]);
    format!("tw-{}", hex32(&d))
}

/// `Oncegate-Allow-Twin`: an action id (32 hex characters), or none.
pub(crate) fn allow_twin(headers: &HeaderMap) -> Result<Option<String>, KeyError> {
    match headers.get("oncegate-allow-twin") {
        None => Ok(None),
        Some(v) => match v.to_str().map(str::trim) {
            Ok(s) if s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit()) => {
                Ok(Some(s.to_ascii_lowercase()))
            }
            _ => Err(KeyError::Invalid(
                "Oncegate-Allow-Twin must name the action it repeats: its id, 32 hex characters (the possible-duplicate answer's action.id)".into(),
            )),
        },
    }
}

/// The store's secret, which keys what the identity of a write leaves in records and the write
/// log (SPEC §13): its principal, its fingerprint and its body's digest are HMAC-SHA-256 under it,
/// so that a reader of the log cannot test a guessed body or credential against them. Every
/// value derived from those two (a derived key, the twin key, the action id) is keyed through
/// them. A store made before stores had a secret is [`Keyer::unkeyed`]: its values stay plain
/// SHA-256, as its records were written (decision 0046). Never printed.
#[derive(Clone, Default)]
pub struct Keyer(Option<hmac::Key>);

impl std::fmt::Debug for Keyer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Keyer(keyed)"
        } else {
            "Keyer(unkeyed)"
        })
    }
}

impl Keyer {
    /// Keyed with a store's secret.
    pub fn new(secret: &[u8]) -> Keyer {
        Keyer(Some(hmac::Key::new(hmac::HMAC_SHA256, secret)))
    }

    /// Plain SHA-256: a store from before stores had a secret.
    pub fn unkeyed() -> Keyer {
        Keyer(None)
    }

    pub fn is_keyed(&self) -> bool {
        self.0.is_some()
    }

    fn hasher(&self) -> Hasher {
        match &self.0 {
            None => Hasher::Plain(Sha256::new()),
            Some(k) => Hasher::Keyed(hmac::Context::with_key(k)),
        }
    }

    /// Length-prefixed parts, as [`sha256_parts`], under the key.
    pub(crate) fn parts(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut h = self.hasher();
        for p in parts {
            h.part(p);
        }
        h.finish()
    }

    /// The digest of a body, as its record shows it and as a stored body's file is named: 64 hex
    /// characters.
    pub fn body(&self, body: &[u8]) -> String {
        match &self.0 {
            None => hex(&Sha256::digest(body)),
            Some(k) => hex(hmac::sign(k, body).as_ref()),
        }
    }
}

/// SHA-256, or HMAC-SHA-256 under a store's secret.
enum Hasher {
    Plain(Sha256),
    Keyed(hmac::Context),
}

impl Hasher {
    /// One part, length-prefixed, so that no two different part lists hash alike.
    fn part(&mut self, p: &[u8]) {
        let len = (p.len() as u64).to_be_bytes();
        match self {
            Hasher::Plain(h) => {
                h.update(len);
                h.update(p);
            }
            Hasher::Keyed(c) => {
                c.update(&len);
                c.update(p);
            }
        }
    }

    fn finish(self) -> [u8; 32] {
        match self {
            Hasher::Plain(h) => h.finalize().into(),
            Hasher::Keyed(c) => c
                .sign()
                .as_ref()
                .try_into()
                .expect("HMAC-SHA-256 is 32 bytes"),
        }
    }
}

/// SHA-256 over length-prefixed parts (so that no two different part lists hash alike): what
/// is derived from values already keyed (a derived key, the twin key, the action id).
pub(crate) fn sha256_parts(parts: &[&[u8]]) -> [u8; 32] {
    Keyer::unkeyed().parts(parts)
}

pub(crate) fn hex32(d: &[u8; 32]) -> String {
    hex(&d[..16])
}

/// Lower-case hex, two digits a byte from a table: every hex the proxy writes goes through here,
/// seven a write (its id, fingerprint, principal, body digest and its log entries' hashes).
/// `hex::encode` pushes a char at a time and `hex::encode_to_slice` walks the input and output
/// in step with checks on both: 696 instructions for a 32-byte digest (callgrind), this 365.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = vec![0; bytes.len() * 2];
    for (pair, &b) in out.chunks_exact_mut(2).zip(bytes) {
        pair.copy_from_slice(&HEX_PAIRS[usize::from(b)]);
    }
    String::from_utf8(out).expect("hex digits are ASCII")
}

/// The two lower-case hex digits of every byte value.
const HEX_PAIRS: [[u8; 2]; 256] = {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut t = [[0u8; 2]; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = [DIGITS[i >> 4], DIGITS[i & 15]];
        i += 1;
    }
    t
};

/// 1 to `max` visible ASCII characters.
pub(crate) fn visible(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() <= max && s.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

/// Parses an `Idempotency-Key` value: bare, or a Structured Field string.
pub fn parse_key(raw: &[u8]) -> Result<String, KeyError> {
    let s = std::str::from_utf8(raw)
        .map_err(|_| KeyError::Invalid("Idempotency-Key must be ASCII".into()))?
        .trim();
    let key = if s.len() >= 2 && s.starts_with('"') && s.ends_with('"') {
        let inner = &s[1..s.len() - 1];
        let mut out = String::with_capacity(inner.len());
        let mut chars = inner.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some(e @ ('"' | '\\')) => out.push(e),
                    _ => {
                        return Err(KeyError::Invalid(
                            "Idempotency-Key is a malformed structured-field string".into(),
                        ))
                    }
                },
                '"' => {
                    return Err(KeyError::Invalid(
                        "Idempotency-Key is a malformed structured-field string".into(),
                    ))
                }
                c => out.push(c),
            }
        }
        out
    } else {
        s.to_string()
    };
    if !visible(&key, 255) {
        return Err(KeyError::Invalid(
            "Idempotency-Key must be 1 to 255 visible ASCII characters".into(),
        ));
    }
    Ok(key)
}

pub(crate) fn header_str<'a>(
    headers: &'a HeaderMap,
    name: &str,
) -> Result<Option<&'a str>, KeyError> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => match v.to_str() {
            Ok(s) if visible(s, 128) => Ok(Some(s)),
            _ => Err(KeyError::Invalid(format!(
                "{name} must be 1 to 128 visible ASCII characters"
            ))),
        },
    }
}

/// The principal: SHA-256 over the configured credential headers present, sorted by name.
/// The headers that carry a credential (SPEC §4.3): the default `principal_headers`, and
/// always redacted.
pub const CREDENTIAL_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "x-api-key",
    "api-key",
    "x-goog-api-key",
    "x-auth-token",
];

pub fn principal(headers: &HeaderMap, policy: &Policy, keyer: &Keyer) -> String {
    let mut names: Vec<&str> = policy
        .principal_headers
        .iter()
        .map(|h| h.as_str())
        .filter(|h| headers.contains_key(*h))
        .collect();
    if names.is_empty() {
        return ANONYMOUS.to_string();
    }
    names.sort_unstable();
    names.dedup();
    let mut h = keyer.hasher();
    for n in names {
        for v in headers.get_all(n) {
            h.part(n.as_bytes());
            h.part(v.as_bytes());
        }
    }
    hex(&h.finish())
}

/// The principal as shown to people: its first 16 hex characters.
pub fn principal_short(p: &str) -> &str {
    if p == ANONYMOUS {
        p
    } else {
        &p[..16.min(p.len())]
    }
}

/// Body kinds the fingerprint canonicalises.
fn media_type(headers: &HeaderMap) -> String {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|v| v.trim().to_ascii_lowercase())
        .unwrap_or_default()
}

pub fn is_json(headers: &HeaderMap) -> bool {
    let m = media_type(headers);
    m == "application/json" || m.ends_with("+json")
}

pub fn is_form(headers: &HeaderMap) -> bool {
    media_type(headers) == "application/x-www-form-urlencoded"
}

pub fn is_multipart(headers: &HeaderMap) -> bool {
    media_type(headers) == "multipart/form-data"
}

/// The body in canonical form (SPEC §4.2); a body with none is its own bytes.
pub fn canonical_body(headers: &HeaderMap, body: &[u8], ignore: &[String]) -> Vec<u8> {
    let canonical = if is_json(headers) {
        canonical::json(body, ignore)
    } else if is_form(headers) {
        Some(canonical::form(body, ignore))
    } else if is_multipart(headers) {
        headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(canonical::boundary)
            .and_then(|b| canonical::multipart(body, b, ignore))
    } else {
        None
    };
    canonical.unwrap_or_else(|| body.to_vec())
}

/// Hex SHA-256 over method, `{rest}`, query and canonical body, keyed with the store's secret.
pub fn fingerprint(
    method: &str,
    rest: &str,
    query: &str,
    headers: &HeaderMap,
    body: &[u8],
    ignore: &[String],
    keyer: &Keyer,
) -> String {
    let canon = canonical_body(headers, body, ignore);
    hex(&keyer.parts(&[method.as_bytes(), rest.as_bytes(), query.as_bytes(), &canon]))
}

/// 32 hex characters naming the action (SPEC §4.4).
pub fn action_id(upstream: &str, principal: &str, key: &str) -> String {
    hex32(&sha256_parts(&[
        upstream.as_bytes(),
        principal.as_bytes(),
        key.as_bytes(),
    ]))
}

/// Everything a write needs to know about who it is.
pub struct WriteRequest<'a> {
    pub upstream: &'a str,
    pub method: &'a str,
    pub rest: &'a str,
    pub query: &'a str,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
    /// The caller, as [`principal`] computed it for this route.
    pub principal: &'a str,
    /// The store's secret.
    pub keyer: &'a Keyer,
}

/// The key of a write that brought none of its own: `ts-` from its task and step, else (unless
/// the route requires a key) `fp-` from its fingerprint (SPEC §4.1).
pub(crate) fn derived_key(
    upstream: &str,
    principal: &str,
    fingerprint: &str,
    task_step: Option<(&str, &str)>,
    require_key: bool,
) -> Result<(String, KeySource), KeyError> {
    if let Some((t, s)) = task_step {
        let d = sha256_parts(&[t.as_bytes(), s.as_bytes()]);
        Ok((format!("ts-{}", hex32(&d)), KeySource::TaskStep))
    } else if require_key {
        Err(KeyError::Required)
    } else {
        let d = sha256_parts(&[
            principal.as_bytes(),
            upstream.as_bytes(),
            fingerprint.as_bytes(),
        ]);
        Ok((format!("fp-{}", hex32(&d)), KeySource::Fingerprint))
    }
}

/// The client's own `Idempotency-Key`, if it sent one (once, with one key).
pub(crate) fn header_key(headers: &HeaderMap) -> Result<Option<String>, KeyError> {
    let mut keys = headers.get_all("idempotency-key").iter();
    let first = keys.next();
    if keys.next().is_some() {
        // Two header lines are one list (RFC 9110 §5.3), as `a, b` on one line: not one key.
        return Err(KeyError::Invalid(
            "Idempotency-Key must be sent once, with one key".into(),
        ));
    }
    first.map(|v| parse_key(v.as_bytes())).transpose()
}

/// The key of a write and where it came from (SPEC §4.1), in order: task and step; the
/// client's key (unless `per-call`); the fingerprint. Returns the client's key too when it is
/// not the action's key, as evidence.
pub(crate) fn choose_key(
    upstream: &str,
    principal: &str,
    fingerprint: &str,
    task_step: Option<(&str, &str)>,
    client_key: Option<String>,
    client_keys: ClientKeys,
    require_key: bool,
) -> Result<(String, KeySource, Option<String>), KeyError> {
    match client_key {
        Some(k) if task_step.is_none() && client_keys == ClientKeys::Stable => {
            Ok((k, KeySource::Header, None))
        }
        // A client's key that is not the action's still satisfies `require_key`: the client
        // sent one, and the proxy sends its own stable key in its place.
        Some(k) => {
            let (key, source) = derived_key(upstream, principal, fingerprint, task_step, false)?;
            Ok((key, source, Some(k)))
        }
        None => {
            let (key, source) =
                derived_key(upstream, principal, fingerprint, task_step, require_key)?;
            Ok((key, source, None))
        }
    }
}

/// Derives the identity of a write (SPEC §4.1).
pub fn identify(req: &WriteRequest<'_>, policy: &Policy) -> Result<Identity, KeyError> {
    let principal = req.principal.to_string();
    let fingerprint = fingerprint(
        req.method,
        req.rest,
        req.query,
        req.headers,
        req.body,
        &policy.fingerprint_ignore,
        req.keyer,
    );
    let task = header_str(req.headers, "oncegate-task")?.map(str::to_string);
    let step = header_str(req.headers, "oncegate-step")?.map(str::to_string);
    let (key, source, client_key) = choose_key(
        req.upstream,
        &principal,
        &fingerprint,
        task.as_deref().zip(step.as_deref()),
        header_key(req.headers)?,
        policy.client_keys,
        policy.require_key,
    )?;
    let action_id = action_id(req.upstream, &principal, &key);
    Ok(Identity {
        key,
        source,
        task,
        step,
        principal,
        fingerprint,
        action_id,
        client_key,
        allow_twin: allow_twin(req.headers)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    /// The values of a store from before stores had a secret: the known vectors below.
    const U: Keyer = Keyer(None);

    fn policy() -> Policy {
        crate::config::Config::parse(
            "[server]\n[[upstreams]]\nname='a'\nprefix='/a'\nurl='http://127.0.0.1:1'\n",
        )
        .expect("valid")
        .upstreams[0]
            .policy
            .as_ref()
            .clone()
    }

    #[test]
    fn hex_is_the_hex_crates_lower_case_form_for_every_byte_and_length() {
        let all: Vec<u8> = (0..=255).collect();
        for n in [0, 1, 2, 16, 32, 255, 256] {
            let bytes = &all[all.len() - n..];
            assert_eq!(hex(bytes), hex::encode(bytes), "{n} bytes");
        }
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn keys_bare_and_structured() {
        assert_eq!(parse_key(b"abc-123"), Ok("abc-123".into()));
        assert_eq!(parse_key(b"\"abc-123\""), Ok("abc-123".into()));
        assert_eq!(parse_key(b"\"a\\\"b\""), Ok("a\"b".into()));
        assert!(parse_key(b"").is_err());
        assert!(parse_key(b"\"\"").is_err());
        assert!(parse_key(b"has space").is_err());
        assert!(parse_key("ключ".as_bytes()).is_err());
        assert!(parse_key("k".repeat(256).as_bytes()).is_err());
        assert!(parse_key("k".repeat(255).as_bytes()).is_ok());
    }

    #[test]
    fn json_fingerprint_ignores_order_space_and_ignored_pointers() {
        let h = headers(&[("content-type", "application/json; charset=utf-8")]);
        let a = canonical_body(&h, br#"{"b": 1, "a": {"y": 2, "x": [1, 2]}}"#, &[]);
        assert_eq!(a, br#"{"a":{"x":[1,2],"y":2},"b":1}"#);
        let ign = vec!["/metadata/trace".to_string()];
        let x = fingerprint(
            "POST",
            "/c",
            "",
            &h,
            br#"{"amount":5,"metadata":{"trace":"1"}}"#,
            &ign,
            &U,
        );
        let y = fingerprint(
            "POST",
            "/c",
            "",
            &h,
            br#"{"metadata":{"trace":"2"},"amount":5}"#,
            &ign,
            &U,
        );
        assert_eq!(x, y);
        let z = fingerprint("POST", "/c", "", &h, br#"{"amount":6}"#, &ign, &U);
        assert_ne!(x, z);
        // Claims JSON but does not parse: hashed as bytes.
        assert_eq!(canonical_body(&h, b"{nope", &[]), b"{nope");
    }

    #[test]
    fn form_fingerprint_sorts_stably_and_ignores_names() {
        let h = headers(&[("content-type", "application/x-www-form-urlencoded")]);
        let a = canonical_body(&h, b"b=2&a=1&a=0&nonce=9", &["nonce".into()]);
        assert_eq!(a, b"a=1&a=0&b=2");
    }

    #[test]
    fn fingerprint_covers_method_path_query() {
        let h = HeaderMap::new();
        let base = fingerprint("POST", "/c", "a=1", &h, b"x", &[], &U);
        assert_ne!(base, fingerprint("PUT", "/c", "a=1", &h, b"x", &[], &U));
        assert_ne!(base, fingerprint("POST", "/d", "a=1", &h, b"x", &[], &U));
        assert_ne!(base, fingerprint("POST", "/c", "a=2", &h, b"x", &[], &U));
        assert_eq!(base.len(), 64);
        // Known vector (computed independently: SHA-256 over u64-BE length-prefixed parts); keeps
        // the fingerprint stable across releases, since stored keys depend on it.
        assert_eq!(
            fingerprint("POST", "/v1/charges", "", &h, b"amount=5", &[], &U),
            "1fd17a5e47a8bd7f56181b3d117b777521c2aaf5bec6345f86791fb100b55f6e"
        );
    }

    #[test]
    fn principal_is_hashed_sorted_and_scoped_to_configured_headers() {
        let p = policy();
        assert_eq!(principal(&HeaderMap::new(), &p, &U), ANONYMOUS);
        let a = principal(
            &headers(&[("authorization", "Bearer s1"), ("x-api-key", "k")]),
            &p,
            &U,
        );
        let b = principal(
            &headers(&[("x-api-key", "k"), ("authorization", "Bearer s1")]),
            &p,
            &U,
        );
        assert_eq!(a, b);
        assert!(!a.contains("s1"));
        assert_ne!(
            a,
            principal(&headers(&[("authorization", "Bearer s2")]), &p, &U)
        );
        // A header that is not a principal header does not change it.
        assert_eq!(
            principal(
                &headers(&[("authorization", "Bearer s1"), ("x-other", "1")]),
                &p,
                &U,
            ),
            principal(&headers(&[("authorization", "Bearer s1")]), &p, &U)
        );
    }

    /// A store's secret keys the principal, the fingerprint and the body digest: a reader who
    /// guesses a body or a credential cannot test the guess against them (SPEC §13), and two
    /// stores' values differ. The same secret gives the same values (a retry is the same action).
    #[test]
    fn a_stores_secret_keys_what_a_guess_could_test() {
        let p = policy();
        let h = headers(&[("authorization", "Bearer s1")]);
        let (k1, k2) = (Keyer::new(&[1; 32]), Keyer::new(&[2; 32]));
        let fp = |k: &Keyer| fingerprint("POST", "/v1/charges", "", &h, b"amount=5", &[], k);
        assert_eq!(fp(&k1), fp(&Keyer::new(&[1; 32])));
        assert_ne!(fp(&k1), fp(&U));
        assert_ne!(fp(&k1), fp(&k2));
        assert_eq!(fp(&k1).len(), 64);
        assert_ne!(principal(&h, &p, &k1), principal(&h, &p, &U));
        assert_ne!(principal(&h, &p, &k1), principal(&h, &p, &k2));
        assert_eq!(principal(&HeaderMap::new(), &p, &k1), ANONYMOUS);
        assert_ne!(k1.body(b"amount=5"), U.body(b"amount=5"));
        assert_eq!(
            U.body(b"amount=5"),
            hex(&Sha256::digest(b"amount=5")),
            "an unkeyed store names bodies as before"
        );
        // What is derived from them follows: an anonymous caller's derived key and action id.
        let id = |k: &Keyer| {
            identify(
                &WriteRequest {
                    keyer: k,
                    ..post(&HeaderMap::new(), b"amount=5", ANONYMOUS)
                },
                &p,
            )
            .expect("ok")
        };
        assert_ne!(id(&k1).key, id(&U).key);
        assert_ne!(id(&k1).action_id, id(&U).action_id);
        assert_eq!(id(&k1).action_id, id(&Keyer::new(&[1; 32])).action_id);
        assert_eq!(format!("{k1:?}"), "Keyer(keyed)");
    }

    /// A `POST /c` to upstream `a`.
    fn post<'a>(headers: &'a HeaderMap, body: &'a [u8], principal: &'a str) -> WriteRequest<'a> {
        WriteRequest {
            upstream: "a",
            method: "POST",
            rest: "/c",
            query: "",
            headers,
            body,
            principal,
            keyer: &U,
        }
    }

    #[test]
    fn key_order_task_step_then_header_then_fingerprint() {
        let p = policy();
        let req = |h: &HeaderMap| identify(&post(h, b"{}", &principal(h, &p, &U)), &p);
        let h = headers(&[
            ("idempotency-key", "k1"),
            ("oncegate-task", "t"),
            ("oncegate-step", "s"),
        ]);
        let id = req(&h).expect("ok");
        // Task and step name the agent's intent: they outrank the SDK's key, kept as evidence.
        assert!(
            id.key.starts_with("ts-") && id.key.len() == 35,
            "{}",
            id.key
        );
        assert_eq!(id.source, KeySource::TaskStep);
        assert_eq!(id.client_key.as_deref(), Some("k1"));
        assert_eq!(id.task.as_deref(), Some("t"));
        let h2 = headers(&[("oncegate-task", "t"), ("oncegate-step", "s")]);
        let id2 = req(&h2).expect("ok");
        assert_eq!((id2.key.as_str(), id2.client_key), (id.key.as_str(), None));
        let h = headers(&[("idempotency-key", "k1")]);
        let id = req(&h).expect("ok");
        assert_eq!((id.key.as_str(), id.source), ("k1", KeySource::Header));
        let h = headers(&[("oncegate-task", "t")]);
        let id = req(&h).expect("ok");
        assert!(id.key.starts_with("fp-") && id.key.len() == 35);
        assert_eq!(id.task.as_deref(), Some("t"));
        assert_eq!(id.action_id.len(), 32);
        let h = headers(&[("oncegate-task", "t"), ("oncegate-step", "has space")]);
        assert!(matches!(req(&h), Err(KeyError::Invalid(_))));
        let h = headers(&[("idempotency-key", "a"), ("idempotency-key", "b")]);
        assert!(
            matches!(req(&h), Err(KeyError::Invalid(_))),
            "two key lines"
        );
        let h = headers(&[("idempotency-key", "a, b")]);
        assert!(
            matches!(req(&h), Err(KeyError::Invalid(_))),
            "a list on one line"
        );
        let mut strict = p.clone();
        strict.require_key = true;
        let id = identify(
            &WriteRequest {
                upstream: "a",
                method: "POST",
                rest: "/c",
                query: "",
                headers: &HeaderMap::new(),
                body: b"",
                principal: ANONYMOUS,
                keyer: &U,
            },
            &strict,
        );
        assert_eq!(id, Err(KeyError::Required));
    }

    #[test]
    fn per_call_keys_are_evidence_and_the_fingerprint_is_the_key() {
        let mut p = policy();
        assert_eq!(p.client_keys, ClientKeys::Stable);
        p.client_keys = ClientKeys::PerCall;
        let req_with =
            |h: &HeaderMap, p: &Policy| identify(&post(h, b"amount=5", ANONYMOUS), p).expect("ok");
        let req = |h: &HeaderMap| req_with(h, &p);
        // stripe-python draws a new key for every call: two calls, one action.
        let a = req(&headers(&[("idempotency-key", "sdk-1")]));
        let b = req(&headers(&[("idempotency-key", "sdk-2")]));
        assert!(a.key.starts_with("fp-"), "{}", a.key);
        assert_eq!(
            (a.key.as_str(), a.source),
            (b.key.as_str(), KeySource::Fingerprint)
        );
        assert_eq!(a.client_key.as_deref(), Some("sdk-1"));
        assert_eq!(b.client_key.as_deref(), Some("sdk-2"));
        // `require_key` is met by the client's key, even when it is only evidence.
        let mut strict = p.clone();
        strict.require_key = true;
        assert!(req_with(&headers(&[("idempotency-key", "sdk-3")]), &strict)
            .key
            .starts_with("fp-"));
        // The twin key is the caller's identical write to this upstream, whatever the key.
        let mut stable = p.clone();
        stable.client_keys = ClientKeys::Stable;
        let c = req_with(&headers(&[("idempotency-key", "sdk-4")]), &stable);
        assert_eq!(c.key, "sdk-4");
        assert_eq!(c.twin_key("a"), a.twin_key("a"));
        assert_ne!(c.twin_key("a"), a.twin_key("b"));
        let allow = headers(&[("oncegate-allow-twin", "0123456789ABCDEF0123456789abcdef")]);
        assert_eq!(
            req(&allow).allow_twin.as_deref(),
            Some("0123456789abcdef0123456789abcdef")
        );
    }
}
