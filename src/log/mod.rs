//! The write log (SPEC §11): one append-only, hash-chained entry per event, written by the store
//! in the same durable step as the state change it describes.
//!
//! `hash` = hex SHA-256 (or HMAC-SHA256 with `log.hmac_key_env`) over `prev` followed by the
//! entry's canonical JSON without `hash` (sorted keys, no white space, every field present). The
//! first entry's `prev` is 64 zeros; after pruning (`log.retention`), verification starts from the
//! first kept entry's `prev`, which the store keeps as the chain's anchor.

use serde::{Deserialize, Serialize};

use crate::action::Record;
use crate::identity::principal_short;

mod chain;

pub use chain::{Chain, ALG_HMAC, ALG_SHA256};

pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// What happened (SPEC §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    Intent,
    Sent,
    Outcome,
    Replayed,
    Conflict,
    Rejected,
    Unknown,
    Lookup,
    Resolved,
    Expired,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Actor {
    Proxy,
    Lookup,
    Admin,
}

impl Event {
    /// Whether an entry of this event describes its request (upstream, method, path, key, task,
    /// step, fingerprint, tool): an `intent`, and the entries of requests that are not the
    /// action's (`conflict`, `rejected`). The action's later entries name it and its principal
    /// only; the chain binds them to its intent (issue 59: a write's entries took 1.7 KB).
    pub fn describes(self) -> bool {
        matches!(self, Event::Intent | Event::Conflict | Event::Rejected)
    }

    /// The name an entry carries (its serde name).
    pub fn as_str(self) -> &'static str {
        match self {
            Event::Intent => "intent",
            Event::Sent => "sent",
            Event::Outcome => "outcome",
            Event::Replayed => "replayed",
            Event::Conflict => "conflict",
            Event::Rejected => "rejected",
            Event::Unknown => "unknown",
            Event::Lookup => "lookup",
            Event::Resolved => "resolved",
            Event::Expired => "expired",
        }
    }
}

impl Actor {
    /// The name an entry carries (its serde name).
    pub fn as_str(self) -> &'static str {
        match self {
            Actor::Proxy => "proxy",
            Actor::Lookup => "lookup",
            Actor::Admin => "admin",
        }
    }
}

/// An event before it is chained: everything but `seq`, `ts`, `prev` and `hash`.
#[derive(Debug, Clone, PartialEq)]
pub struct LogEvent {
    pub event: Event,
    pub action: Option<String>,
    pub upstream: Option<String>,
    pub method: Option<String>,
    pub path: Option<String>,
    pub principal: Option<String>,
    pub key: Option<String>,
    pub task: Option<String>,
    pub step: Option<String>,
    pub attempt: Option<u32>,
    pub status: Option<u16>,
    pub outcome: Option<String>,
    pub external_id: Option<String>,
    pub fingerprint: Option<String>,
    pub actor: Actor,
    pub detail: Option<String>,
    /// The MCP tool, for a `tools/call`.
    pub tool: Option<String>,
}

impl LogEvent {
    /// An event about an action, with the record's identifying fields.
    pub fn for_record(event: Event, r: &Record, actor: Actor) -> LogEvent {
        LogEvent {
            event,
            action: Some(r.id.clone()),
            upstream: Some(r.upstream.clone()),
            method: Some(r.method.clone()),
            path: Some(r.path.clone()),
            principal: Some(principal_short(&r.principal).to_string()),
            key: Some(r.key.clone()),
            task: r.task.clone(),
            step: r.step.clone(),
            attempt: Some(r.attempts),
            status: None,
            outcome: None,
            external_id: r.external_id.clone(),
            fingerprint: Some(r.fingerprint.clone()),
            actor,
            detail: None,
            tool: r.tool.clone(),
        }
    }

    /// An event about a request that never became an action (a refused write).
    pub fn bare(event: Event, actor: Actor) -> LogEvent {
        LogEvent {
            event,
            action: None,
            upstream: None,
            method: None,
            path: None,
            principal: None,
            key: None,
            task: None,
            step: None,
            attempt: None,
            status: None,
            outcome: None,
            external_id: None,
            fingerprint: None,
            actor,
            detail: None,
            tool: None,
        }
    }

    pub fn status(mut self, s: Option<u16>) -> Self {
        self.status = s;
        self
    }

    pub fn outcome(mut self, o: &str) -> Self {
        self.outcome = Some(o.to_string());
        self
    }

    pub fn detail(mut self, d: impl Into<String>) -> Self {
        self.detail = Some(d.into());
        self
    }
}

/// An event about an action that borrows the record instead of copying its fields into a
/// [`LogEvent`]: what a store seals as it changes a record ([`Chain::seal_record_line`]), or
/// turns into a `LogEvent` ([`From`]) where it keeps events for later.
#[derive(Debug, Clone)]
pub struct RecordEvent<'a> {
    pub event: Event,
    pub record: &'a Record,
    pub actor: Actor,
    pub status: Option<u16>,
    pub outcome: Option<&'static str>,
    pub detail: Option<String>,
}

impl<'a> RecordEvent<'a> {
    pub fn new(event: Event, record: &'a Record, actor: Actor) -> Self {
        RecordEvent {
            event,
            record,
            actor,
            status: None,
            outcome: None,
            detail: None,
        }
    }

    pub fn status(mut self, s: Option<u16>) -> Self {
        self.status = s;
        self
    }

    pub fn outcome(mut self, o: &'static str) -> Self {
        self.outcome = Some(o);
        self
    }

    pub fn detail(mut self, d: impl Into<String>) -> Self {
        self.detail = Some(d.into());
        self
    }
}

impl From<RecordEvent<'_>> for LogEvent {
    fn from(ev: RecordEvent<'_>) -> LogEvent {
        LogEvent {
            status: ev.status,
            outcome: ev.outcome.map(str::to_string),
            detail: ev.detail,
            ..LogEvent::for_record(ev.event, ev.record, ev.actor)
        }
    }
}

/// One chained entry, as stored and exported (one JSON object per line). A field outside this
/// list is an edit: such a line is not an entry (SPEC §11).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub seq: u64,
    pub ts: String,
    pub event: Event,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    pub actor: Actor,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The MCP tool a `tools/call` named (SPEC §14.5); absent for HTTP writes, and in entries
    /// written before it existed (which hash as they always did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// The chain's algorithm (`sha256`, `hmac-sha256`), so that a verifier without the key says
    /// it needs one. Entries written before it have none (and hash as they always did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alg: Option<String>,
    pub prev: String,
    pub hash: String,
}

/// The result of walking a chain (`GET /v1/log/verify`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verification {
    pub ok: bool,
    pub entries: u64,
    /// Sequence number of the last entry checked (0 for an empty log).
    pub head_seq: u64,
    pub head: String,
    pub first_bad_seq: Option<u64>,
    /// Why it does not verify, when the entry says more than "the hash differs".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Walks entries in order. `anchor` is the `(seq, prev)` the first entry must carry: `(1,
/// GENESIS)` for a log that was never pruned.
pub fn verify<I>(chain: &Chain, entries: I, anchor: Option<(u64, String)>) -> Verification
where
    I: IntoIterator<Item = Result<Entry, u64>>,
{
    let (mut want_seq, mut prev) = anchor.unwrap_or((1, GENESIS.to_string()));
    let mut n = 0;
    let mut head_seq = want_seq.saturating_sub(1);
    let mut first_bad = None;
    let mut reason = None;
    for e in entries {
        let e = match e {
            Ok(e) => e,
            // An entry that does not even parse (or holds a field outside the list).
            Err(seq) => {
                first_bad = Some(seq);
                reason = Some(format!(
                    "entry {seq} is not a write-log entry (malformed, or a field was added)"
                ));
                break;
            }
        };
        n += 1;
        if e.seq != want_seq || e.prev != prev || !chain.matches(&e) {
            first_bad = Some(want_seq.min(e.seq));
            reason = match e.alg.as_deref() {
                Some(ALG_HMAC) if !chain.keyed() => Some(format!(
                    "entry {} is chained with HMAC-SHA256: verify it with the key (log.hmac_key_env, or --hmac-key-env)",
                    e.seq
                )),
                Some(ALG_SHA256) if chain.keyed() => Some(format!(
                    "entry {} is chained with plain SHA-256, not with the key given",
                    e.seq
                )),
                _ => None,
            };
            break;
        }
        head_seq = e.seq;
        want_seq += 1;
        prev = e.hash;
    }
    Verification {
        ok: first_bad.is_none(),
        entries: n,
        head_seq,
        head: prev,
        first_bad_seq: first_bad,
        reason,
    }
}

/// Parses an NDJSON export; a line that is not an entry is reported by its line number.
pub fn parse_export(text: &str) -> Vec<Result<Entry, u64>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|_| i as u64 + 1))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record event sealed from the record is, byte for byte, the same event copied into a
    /// `LogEvent` and sealed: the two paths hash and store one form, so a log written by either
    /// verifies the same way.
    #[test]
    fn a_record_event_seals_as_its_log_event_would() {
        let mut r = Record::new("0123abcd", "fp\"1");
        r.upstream = "pay".into();
        r.principal = "token:secret-ish".into();
        r.key = "k-1".into();
        r.method = "POST".into();
        r.path = "/v1/charges?x=\u{e9}".into();
        r.attempts = 2;
        let bare = r.clone();
        r.task = Some("task 1".into());
        r.step = Some("step\n2".into());
        r.external_id = Some("ch_1".into());
        r.tool = Some("create".into());
        for chain in [Chain::new(None), Chain::new(Some(b"k".to_vec()))] {
            for rec in [&bare, &r] {
                let events = [
                    RecordEvent::new(Event::Sent, rec, Actor::Proxy),
                    RecordEvent::new(Event::Outcome, rec, Actor::Lookup)
                        .status(Some(201))
                        .outcome("applied")
                        .detail("upstream said \"created\""),
                ];
                for ev in events {
                    let head = (41, "ab".repeat(32));
                    let (seq, hash, line) =
                        chain.seal_record_line(&ev, (head.0, &head.1), 1_700_000_000_123);
                    let (e, want) =
                        chain.seal_line(ev.into(), (head.0, &head.1), 1_700_000_000_123);
                    assert_eq!(
                        String::from_utf8_lossy(&line),
                        String::from_utf8_lossy(&want)
                    );
                    assert_eq!((seq, hash), (e.seq, e.hash));
                }
            }
        }
    }

    fn chain_of(c: &Chain, n: u64) -> Vec<Entry> {
        let mut out: Vec<Entry> = Vec::new();
        for i in 0..n {
            let head = out
                .last()
                .map(|e| (e.seq, e.hash.clone()))
                .unwrap_or((0, GENESIS.to_string()));
            let ev = LogEvent::bare(Event::Rejected, Actor::Proxy).detail(format!("event {i}"));
            out.push(c.seal(ev, (head.0, &head.1), 1_700_000_000_000 + i));
        }
        out
    }

    fn check(c: &Chain, v: &[Entry]) -> Verification {
        verify(c, v.iter().cloned().map(Ok), None)
    }

    #[test]
    fn an_untouched_chain_verifies() {
        let c = Chain::default();
        let v = chain_of(&c, 5);
        let r = check(&c, &v);
        assert!(r.ok && r.entries == 5 && r.head == v[4].hash && r.head_seq == 5);
        assert_eq!(v[0].prev, GENESIS);
    }

    #[test]
    fn edits_drops_and_swaps_are_found_at_the_right_seq() {
        let c = Chain::default();
        let v = chain_of(&c, 6);
        let mut edited = v.clone();
        edited[2].detail = Some("event X".into());
        assert_eq!(check(&c, &edited).first_bad_seq, Some(3));
        let mut dropped = v.clone();
        dropped.remove(3);
        assert_eq!(check(&c, &dropped).first_bad_seq, Some(4));
        let mut swapped = v.clone();
        swapped.swap(1, 2);
        assert_eq!(check(&c, &swapped).first_bad_seq, Some(2));
    }

    #[test]
    fn with_hmac_recomputed_plain_hashes_are_caught() {
        let keyed = Chain::new(Some(b"k3y".to_vec()));
        let mut v = chain_of(&keyed, 3);
        // An attacker edits entry 2 and recomputes the plain SHA-256 chain from there.
        let plain = Chain::default();
        v[1].detail = Some("forged".into());
        v[1].hash = plain.hash(&v[1]);
        v[2].prev = v[1].hash.clone();
        v[2].hash = plain.hash(&v[2]);
        assert_eq!(check(&keyed, &v).first_bad_seq, Some(2));
        assert!(
            check(&plain, &v).first_bad_seq.is_some(),
            "entry 1 is keyed"
        );
    }

    #[test]
    fn an_added_field_is_an_edit_and_a_keyed_chain_asks_for_its_key() {
        let c = Chain::default();
        let v = chain_of(&c, 2);
        let mut line = serde_json::to_value(&v[1]).expect("serializes");
        line["reason"] = "approved by the CFO".into();
        let text = format!(
            "{}\n{}\n",
            serde_json::to_string(&v[0]).expect("serializes"),
            line
        );
        let r = verify(&c, parse_export(&text), None);
        assert_eq!((r.ok, r.first_bad_seq), (false, Some(2)), "{r:?}");
        assert!(r.reason.expect("a reason").contains("field"));
        // Written with a key, checked without: the verifier says a key is needed.
        let keyed = Chain::new(Some(b"k3y".to_vec()));
        let v = chain_of(&keyed, 2);
        assert_eq!(v[0].alg.as_deref(), Some(ALG_HMAC));
        let r = check(&c, &v);
        assert_eq!(r.first_bad_seq, Some(1));
        assert!(r.reason.expect("a reason").contains("key"));
        assert!(check(&keyed, &v).ok);
    }

    #[test]
    fn entries_written_before_alg_still_verify() {
        let c = Chain::default();
        let mut v = chain_of(&c, 3);
        // As an older version wrote them: no `alg`, hashed without it.
        let mut prev = GENESIS.to_string();
        for e in &mut v {
            e.alg = None;
            e.prev = prev.clone();
            e.hash = c.hash(e);
            prev = e.hash.clone();
        }
        let line = serde_json::to_string(&v[0]).expect("serializes");
        assert!(!line.contains("alg"));
        assert!(check(&c, &v).ok);
    }
}
