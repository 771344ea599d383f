//! Encryption at rest (SPEC §13, `store.encrypt_key_env`): the request and response heads and
//! bodies a store keeps are sealed with AES-256-GCM (`ring`), so that a stolen copy of the store
//! reveals no body, cookie or header. Ids, states, times and the write log stay readable: an
//! operator can still find and settle actions, and an auditor verify the log, without the key.
//!
//! A sealed value is [`MAGIC`], a 12-byte random nonce, then the ciphertext with its tag. A record
//! keeps its secrets (request headers, response headers, the evidence's body excerpts) as one
//! sealed blob in `sealed`, and has them emptied in its readable part.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};

use crate::action::Record;

/// The first bytes of every sealed value: a NUL, which no JSON or text body starts with.
pub const MAGIC: &[u8; 4] = b"\0og1";

/// What the store writes under the key check, sealed: a wrong key fails to open it.
const CHECK: &[u8] = b"oncegate store key check";

/// Seals and opens values with the store's key. Never printed.
pub struct Sealer {
    key: LessSafeKey,
    rng: SystemRandom,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer([key])")
    }
}

/// The secrets of a record, sealed together.
#[derive(Serialize, Deserialize, Default)]
struct Secrets {
    request_headers: Vec<(String, String)>,
    /// The request's kept body (sealed since it was kept; absent in older blobs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    request_body: Option<String>,
    response_headers: Vec<(String, String)>,
    /// Each try's body excerpt, attempt by attempt.
    try_bodies: Vec<Vec<Option<String>>>,
}

impl Sealer {
    /// From 64 hex characters (32 bytes). The error never shows the key.
    pub fn from_hex(hex_key: &str) -> Result<Sealer, String> {
        let bytes = hex::decode(hex_key.trim())
            .ok()
            .filter(|b| b.len() == 32)
            .ok_or("the key must be 32 bytes written as 64 hex characters")?;
        let key = UnboundKey::new(&AES_256_GCM, &bytes).map_err(|_| "the key was refused")?;
        Ok(Sealer {
            key: LessSafeKey::new(key),
            rng: SystemRandom::new(),
        })
    }

    pub fn seal(&self, plain: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng
            .fill(&mut nonce)
            .expect("the system's random source works");
        let mut out = Vec::with_capacity(MAGIC.len() + NONCE_LEN + plain.len() + 16);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&nonce);
        let mut body = plain.to_vec();
        self.key
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut body)
            .expect("AES-GCM seals any length the store keeps");
        out.extend_from_slice(&body);
        out
    }

    /// Opens a sealed value; a value without [`MAGIC`] is returned as it is (written before
    /// encryption was turned on).
    pub fn open(&self, value: &[u8]) -> Result<Vec<u8>, String> {
        let Some(rest) = value.strip_prefix(MAGIC.as_slice()) else {
            return Ok(value.to_vec());
        };
        if rest.len() < NONCE_LEN {
            return Err("a sealed value is cut short".into());
        }
        let (nonce, sealed) = rest.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| "bad nonce")?;
        let mut buf = sealed.to_vec();
        let plain = self
            .key
            .open_in_place(nonce, Aad::empty(), &mut buf)
            .map_err(|_| "a sealed value does not open with this key (wrong key, or tampered)")?;
        Ok(plain.to_vec())
    }

    /// The key check a store keeps: a value only this key opens.
    pub fn check_value(&self) -> Vec<u8> {
        self.seal(CHECK)
    }

    /// Whether `value` (a store's key check) was sealed with this key.
    pub fn matches(&self, value: &[u8]) -> bool {
        value.starts_with(MAGIC) && self.open(value).is_ok_and(|p| p == CHECK)
    }

    /// Moves a record's secrets into its sealed blob (on its way to storage).
    pub fn seal_record(&self, r: &mut Record) {
        let mut secrets = Secrets {
            request_headers: std::mem::take(&mut r.request.headers),
            request_body: r.request.body.take(),
            ..Secrets::default()
        };
        if let Some(resp) = r.response.as_mut() {
            secrets.response_headers = std::mem::take(&mut resp.headers);
        }
        secrets.try_bodies = r
            .evidence
            .iter_mut()
            .map(|a| a.tries.iter_mut().map(|t| t.body.take()).collect())
            .collect();
        let plain = serde_json::to_vec(&secrets).expect("secrets serialize");
        r.sealed = Some(crate::identity::hex(&self.seal(&plain)));
    }

    /// Restores a record's secrets from its sealed blob (on its way from storage).
    pub fn open_record(&self, r: &mut Record) -> Result<(), String> {
        let Some(blob) = r.sealed.take() else {
            return Ok(());
        };
        let bytes = hex::decode(&blob).map_err(|_| "a sealed record is not hex")?;
        let secrets: Secrets = serde_json::from_slice(&self.open(&bytes)?)
            .map_err(|e| format!("a sealed record's secrets do not parse: {e}"))?;
        r.request.headers = secrets.request_headers;
        r.request.body = secrets.request_body;
        if let Some(resp) = r.response.as_mut() {
            resp.headers = secrets.response_headers;
        }
        for (a, bodies) in r.evidence.iter_mut().zip(secrets.try_bodies) {
            for (t, b) in a.tries.iter_mut().zip(bodies) {
                t.body = b;
            }
        }
        Ok(())
    }
}

/// Seals `value` when there is a sealer.
pub fn seal_opt(sealer: Option<&Sealer>, value: &[u8]) -> Vec<u8> {
    match sealer {
        Some(s) => s.seal(value),
        None => value.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::{Attempt, BodyRef, Source, StoredResponse, Try};

    fn key() -> Sealer {
        Sealer::from_hex(&"ab".repeat(32)).expect("a key")
    }

    #[test]
    fn values_round_trip_and_only_with_their_key() {
        let s = key();
        let sealed = s.seal(b"set-cookie: session=s3cret");
        assert!(sealed.starts_with(MAGIC));
        assert!(!sealed.windows(6).any(|w| w == b"s3cret"));
        assert_eq!(
            s.open(&sealed).expect("opens"),
            b"set-cookie: session=s3cret"
        );
        assert_ne!(s.seal(b"x"), s.seal(b"x"), "a fresh nonce each time");
        let other = Sealer::from_hex(&"cd".repeat(32)).expect("a key");
        assert!(other.open(&sealed).is_err());
        assert!(s.matches(&s.check_value()) && !other.matches(&s.check_value()));
        // Written before encryption: passed through.
        assert_eq!(s.open(b"{\"plain\":1}").expect("plain"), b"{\"plain\":1}");
        let mut torn = sealed.clone();
        torn.truncate(10);
        assert!(s.open(&torn).is_err());
        assert!(Sealer::from_hex("abcd").is_err());
        assert!(Sealer::from_hex(&"zz".repeat(32)).is_err());
    }

    #[test]
    fn a_record_keeps_its_secrets_sealed_and_the_rest_readable() {
        let s = key();
        let mut r = Record::new("id1", "fp");
        r.request.headers = vec![("x-note".into(), "private".into())];
        r.response = Some(StoredResponse {
            status: 201,
            headers: vec![("set-cookie".into(), "session=s3cret".into())],
            size: 2,
            body: BodyRef::Inline,
            source: Source::Upstream,
        });
        r.evidence.push(Attempt {
            n: 1,
            started_at: 1,
            ended_at: None,
            state: None,
            tries: vec![Try {
                body: Some("card declined for alice".into()),
                ..Try::default()
            }],
            tries_dropped: 0,
        });
        let original = r.clone();
        s.seal_record(&mut r);
        let stored = serde_json::to_string(&r).expect("serializes");
        for secret in ["private", "s3cret", "alice"] {
            assert!(!stored.contains(secret), "{secret} in {stored}");
        }
        assert!(stored.contains("\"id\":\"id1\"") && stored.contains("\"state\""));
        let mut back: Record = serde_json::from_str(&stored).expect("parses");
        s.open_record(&mut back).expect("opens");
        assert_eq!(back, original);
    }
}
