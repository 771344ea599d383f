//! The chain: how an entry is hashed ([`Canon`], its canonical JSON) and sealed after the
//! current head, from a [`LogEvent`] or straight from a record ([`RecordEvent`]).

use hmac::{Hmac, Mac};
#[cfg(test)]
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::{Actor, Entry, Event, LogEvent, RecordEvent};
use crate::action::{rfc3339, Millis};
use crate::identity::principal_short;
use crate::jsontext::Object;

pub const ALG_SHA256: &str = "sha256";
pub const ALG_HMAC: &str = "hmac-sha256";

/// Computes entry hashes: SHA-256, or HMAC-SHA256 when a key is set.
#[derive(Clone, Default)]
pub struct Chain {
    key: Option<Vec<u8>>,
}

impl std::fmt::Debug for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("Chain")
            .field("hmac", &self.key.is_some())
            .finish()
    }
}

/// An entry without its hash, as the chain hashes it: keys sorted, no white space, the fields it
/// has (serde_json's compact form of this struct with `None` members left out). Entries written
/// before issue 59 wrote every field, `null` for those they lacked, and were hashed so
/// (`compact: false`); a verifier takes an entry in either form ([`Chain::matches`]).
/// Written by [`Canon::line`] member by member, in this declared order, without the serializer:
/// this runs three times for every write and for every entry verified. Tests hold it to
/// serde_json's bytes.
#[cfg_attr(test, derive(Serialize))]
struct Canon<'a> {
    #[cfg_attr(test, serde(skip))]
    compact: bool,
    action: Option<&'a str>,
    actor: Actor,
    #[cfg_attr(test, serde(skip_serializing_if = "Option::is_none"))]
    alg: Option<&'a str>,
    attempt: Option<u32>,
    detail: Option<&'a str>,
    event: Event,
    external_id: Option<&'a str>,
    fingerprint: Option<&'a str>,
    key: Option<&'a str>,
    method: Option<&'a str>,
    outcome: Option<&'a str>,
    path: Option<&'a str>,
    prev: &'a str,
    principal: Option<&'a str>,
    seq: u64,
    status: Option<u16>,
    step: Option<&'a str>,
    task: Option<&'a str>,
    #[cfg_attr(test, serde(skip_serializing_if = "Option::is_none"))]
    tool: Option<&'a str>,
    ts: &'a str,
    upstream: Option<&'a str>,
}

impl Canon<'_> {
    fn line(&self) -> Vec<u8> {
        // Sized for an entry with its hash appended (about 600 bytes), so that neither grows it.
        let mut line = Vec::with_capacity(1024);
        let mut o = Object::new(&mut line);
        let c = self.compact;
        o.maybe_str("action", self.action, c)
            .str("actor", self.actor.as_str());
        if let Some(alg) = self.alg {
            o.str("alg", alg);
        }
        o.maybe_num("attempt", self.attempt.map(u64::from), c)
            .maybe_str("detail", self.detail, c)
            .str("event", self.event.as_str())
            .maybe_str("external_id", self.external_id, c)
            .maybe_str("fingerprint", self.fingerprint, c)
            .maybe_str("key", self.key, c)
            .maybe_str("method", self.method, c)
            .maybe_str("outcome", self.outcome, c)
            .maybe_str("path", self.path, c)
            .str("prev", self.prev)
            .maybe_str("principal", self.principal, c)
            .num("seq", self.seq)
            .maybe_num("status", self.status.map(u64::from), c)
            .maybe_str("step", self.step, c)
            .maybe_str("task", self.task, c);
        if let Some(tool) = self.tool {
            o.str("tool", tool);
        }
        o.str("ts", self.ts).maybe_str("upstream", self.upstream, c);
        o.end();
        line
    }
}

impl Chain {
    pub fn new(hmac_key: Option<Vec<u8>>) -> Chain {
        Chain {
            key: hmac_key.filter(|k| !k.is_empty()),
        }
    }

    /// Whether lines are sealed with a key (HMAC) rather than a bare hash.
    pub(super) fn keyed(&self) -> bool {
        self.key.is_some()
    }

    /// The canonical JSON of an entry without its hash ([`Canon`]), in the compact form new
    /// entries are hashed in, or the full form of entries written before it.
    fn canonical(e: &Entry, compact: bool) -> Vec<u8> {
        Canon {
            compact,
            action: e.action.as_deref(),
            actor: e.actor,
            alg: e.alg.as_deref(),
            attempt: e.attempt,
            detail: e.detail.as_deref(),
            event: e.event,
            external_id: e.external_id.as_deref(),
            fingerprint: e.fingerprint.as_deref(),
            key: e.key.as_deref(),
            method: e.method.as_deref(),
            outcome: e.outcome.as_deref(),
            path: e.path.as_deref(),
            prev: &e.prev,
            principal: e.principal.as_deref(),
            seq: e.seq,
            status: e.status,
            step: e.step.as_deref(),
            task: e.task.as_deref(),
            tool: e.tool.as_deref(),
            ts: &e.ts,
            upstream: e.upstream.as_deref(),
        }
        .line()
    }

    /// The algorithm entries chained here carry.
    pub fn alg(&self) -> &'static str {
        if self.keyed() {
            ALG_HMAC
        } else {
            ALG_SHA256
        }
    }

    /// The hash of `e` as a new entry is hashed (compact).
    pub fn hash(&self, e: &Entry) -> String {
        self.hash_canonical(&e.prev, &Self::canonical(e, true))
    }

    /// Whether `e.hash` is the hash of `e`, in the compact form new entries are hashed in or in
    /// the full form of entries written before it. Either is a function of the entry's fields
    /// alone, so no edit passes as the other form.
    pub fn matches(&self, e: &Entry) -> bool {
        self.hash(e) == e.hash || self.hash_canonical(&e.prev, &Self::canonical(e, false)) == e.hash
    }

    fn hash_canonical(&self, prev: &str, body: &[u8]) -> String {
        match &self.key {
            None => {
                let mut h = Sha256::new();
                h.update(prev.as_bytes());
                h.update(body);
                crate::identity::hex(&h.finalize())
            }
            Some(k) => {
                let mut m = Hmac::<Sha256>::new_from_slice(k).expect("HMAC takes keys of any size");
                m.update(prev.as_bytes());
                m.update(body);
                crate::identity::hex(&m.finalize().into_bytes())
            }
        }
    }

    /// Chains an event and returns it with its stored form: the canonical JSON with `hash`
    /// appended (one serialization for both hashing and storing).
    pub fn seal_line(&self, ev: LogEvent, head: (u64, &str), now: Millis) -> (Entry, Vec<u8>) {
        let mut e = self.unsealed(ev, head, now);
        let mut line = Self::canonical(&e, true);
        e.hash = self.hash_canonical(&e.prev, &line);
        append_hash(&mut line, &e.hash);
        (e, line)
    }

    /// [`Chain::seal_line`] for an event about a record, read from the record where it is
    /// (no [`LogEvent`] copied from it): the stores seal three of these a write. Returns the
    /// entry's sequence number and hash with its stored form, byte for byte what `seal_line`
    /// gives for the same event as a [`LogEvent`].
    pub fn seal_record_line(
        &self,
        ev: &RecordEvent<'_>,
        head: (u64, &str),
        now: Millis,
    ) -> (u64, String, Vec<u8>) {
        let r = ev.record;
        let seq = head.0 + 1;
        let ts = rfc3339(now);
        let described = ev.event.describes();
        fn says(described: bool, v: Option<&str>) -> Option<&str> {
            v.filter(|_| described)
        }
        let says = |v| says(described, v);
        let mut line = Canon {
            compact: true,
            action: Some(&r.id),
            actor: ev.actor,
            alg: Some(self.alg()),
            attempt: Some(r.attempts),
            detail: ev.detail.as_deref(),
            event: ev.event,
            external_id: r.external_id.as_deref(),
            fingerprint: says(Some(&r.fingerprint)),
            key: says(Some(&r.key)),
            method: says(Some(&r.method)),
            outcome: ev.outcome,
            path: says(Some(&r.path)),
            prev: head.1,
            principal: Some(principal_short(&r.principal)),
            seq,
            status: ev.status,
            step: says(r.step.as_deref()),
            task: says(r.task.as_deref()),
            tool: says(r.tool.as_deref()),
            ts: &ts,
            upstream: says(Some(&r.upstream)),
        }
        .line();
        let hash = self.hash_canonical(head.1, &line);
        append_hash(&mut line, &hash);
        (seq, hash, line)
    }

    /// Chains an event after `(seq, hash)` of the current head.
    pub fn seal(&self, ev: LogEvent, head: (u64, &str), now: Millis) -> Entry {
        let mut e = self.unsealed(ev, head, now);
        e.hash = self.hash(&e);
        e
    }

    fn unsealed(&self, ev: LogEvent, head: (u64, &str), now: Millis) -> Entry {
        let described = ev.event.describes();
        let says = |v: Option<String>| v.filter(|_| described);
        Entry {
            seq: head.0 + 1,
            ts: rfc3339(now),
            event: ev.event,
            action: ev.action,
            upstream: says(ev.upstream),
            method: says(ev.method),
            path: says(ev.path),
            principal: ev.principal,
            key: says(ev.key),
            task: says(ev.task),
            step: says(ev.step),
            attempt: ev.attempt,
            status: ev.status,
            outcome: ev.outcome,
            external_id: ev.external_id,
            fingerprint: says(ev.fingerprint),
            actor: ev.actor,
            detail: ev.detail,
            tool: says(ev.tool),
            alg: Some(self.alg().to_string()),
            prev: head.1.to_string(),
            hash: String::new(),
        }
    }
}

/// The stored form of an entry from its canonical JSON: `hash` appended as its last field.
fn append_hash(line: &mut Vec<u8>, hash: &str) {
    line.pop(); // the closing brace
    line.extend_from_slice(b",\"hash\":\"");
    line.extend_from_slice(hash.as_bytes());
    line.extend_from_slice(b"\"}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::GENESIS;

    #[test]
    fn the_canonical_form_is_sorted_keys_without_hash() {
        let c = Chain::default();
        let mut ev = LogEvent::bare(Event::Sent, Actor::Proxy).detail("d");
        ev.key = Some("k\"1".into());
        let e = c.seal(ev, (0, GENESIS), 5);
        // The same bytes as a generic sorted-keys serialization without `hash`.
        let mut v = serde_json::to_value(&e).expect("serializes");
        v.as_object_mut().expect("object").remove("hash");
        assert_eq!(
            Chain::canonical(&e, true),
            serde_json::to_vec(&v).expect("serializes")
        );
    }

    /// Entries written before issue 59 carried every field, `null` for those they lacked, and
    /// were hashed so: they still verify, and an edit of one fails in either form.
    #[test]
    fn an_entry_in_the_full_form_of_before_still_verifies() {
        let c = Chain::default();
        let ev = LogEvent::bare(Event::Outcome, Actor::Proxy).detail("d");
        let mut e = c.seal(ev, (0, GENESIS), 5);
        let full = Chain::canonical(&e, false);
        assert!(String::from_utf8_lossy(&full).contains("\"key\":null"));
        e.hash = c.hash_canonical(&e.prev, &full);
        assert!(c.matches(&e));
        e.detail = Some("edited".into());
        assert!(!c.matches(&e));
        e.detail = None;
        assert!(!c.matches(&e), "a field made null is an edit too");
    }

    /// A write's later entries name its action and principal; its intent describes the request.
    #[test]
    fn only_an_intent_describes_the_request() {
        let c = Chain::default();
        let mut ev = LogEvent::bare(Event::Intent, Actor::Proxy);
        ev.key = Some("k".into());
        ev.path = Some("/v1/charges".into());
        ev.principal = Some("p".into());
        let (intent, _) = c.seal_line(ev.clone(), (0, GENESIS), 1);
        assert_eq!(intent.key.as_deref(), Some("k"));
        ev.event = Event::Sent;
        let (sent, line) = c.seal_line(ev, (1, &intent.hash), 2);
        assert_eq!((sent.key, sent.path), (None, None));
        assert_eq!(sent.principal.as_deref(), Some("p"));
        assert!(!String::from_utf8_lossy(&line).contains("null"));
    }

    /// Every event and actor, each optional member absent and present, strings that need
    /// escaping: the hand-written form is serde_json's, byte for byte (the chain of every log
    /// written before depends on it).
    #[test]
    fn the_canonical_line_is_serde_jsons_form_of_the_entry() {
        let events = [
            Event::Intent,
            Event::Sent,
            Event::Outcome,
            Event::Replayed,
            Event::Conflict,
            Event::Rejected,
            Event::Unknown,
            Event::Lookup,
            Event::Resolved,
            Event::Expired,
        ];
        let actors = [Actor::Proxy, Actor::Lookup, Actor::Admin];
        let odd = "a\"b\\c\r\n\t\u{0}\u{1f}\u{7f} é€😀";
        for (i, event) in events.into_iter().enumerate() {
            assert_eq!(
                serde_json::to_string(&event).expect("serializes"),
                format!("\"{}\"", event.as_str())
            );
            let actor = actors[i % actors.len()];
            assert_eq!(
                serde_json::to_string(&actor).expect("serializes"),
                format!("\"{}\"", actor.as_str())
            );
            for full in [false, true] {
                let some = |v: &'static str| full.then_some(v);
                let c = Canon {
                    compact: false,
                    action: some("act-1"),
                    actor,
                    alg: some(ALG_HMAC),
                    attempt: full.then_some(u32::MAX),
                    detail: some(odd),
                    event,
                    external_id: some("cus_\"1"),
                    fingerprint: some("f0"),
                    key: some("k\\1"),
                    method: some("POST"),
                    outcome: some("succeeded"),
                    path: some("/v1/charges?x=\"1\"\n{"),
                    prev: if full { odd } else { "" },
                    principal: some("p"),
                    seq: if full { u64::MAX } else { 0 },
                    status: full.then_some(201),
                    step: some("s"),
                    task: some("t\u{0}"),
                    tool: some("create_customer"),
                    ts: "2026-12-03T00:00:00.000Z",
                    upstream: some("stripe"),
                };
                assert_eq!(
                    String::from_utf8(c.line()).expect("UTF-8"),
                    serde_json::to_string(&c).expect("serializes"),
                    "{event:?} full={full}"
                );
                // Compact: the same with the `null` members left out.
                let mut v = serde_json::to_value(&c).expect("serializes");
                v.as_object_mut()
                    .expect("object")
                    .retain(|_, m| !m.is_null());
                let compact = Canon { compact: true, ..c };
                assert_eq!(
                    String::from_utf8(compact.line()).expect("UTF-8"),
                    serde_json::to_string(&v).expect("serializes"),
                    "{event:?} full={full}, compact"
                );
            }
        }
    }

    #[test]
    fn a_sealed_line_is_the_entry() {
        let c = Chain::new(Some(b"k".to_vec()));
        let (e, line) = c.seal_line(LogEvent::bare(Event::Conflict, Actor::Proxy), (4, "ab"), 9);
        let back: Entry = serde_json::from_slice(&line).expect("one JSON object");
        assert_eq!(back, e);
        assert_eq!(c.hash(&back), e.hash);
    }

    #[test]
    fn control_characters_stay_on_one_line() {
        let c = Chain::default();
        let mut ev = LogEvent::bare(Event::Rejected, Actor::Proxy);
        ev.path = Some("/a\r\nX-Injected: 1\"}\n{".into());
        let e = c.seal(ev, (0, GENESIS), 0);
        let line = serde_json::to_string(&e).expect("serializes");
        assert!(!line.contains('\n') && !line.contains('\r'));
        let back: Entry = serde_json::from_str(&line).expect("one JSON object");
        assert_eq!(back, e);
    }
}
