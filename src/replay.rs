//! Replays (SPEC §7): a stored response answered again, byte for byte, without the upstream.

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{Response, StatusCode};

use crate::action::{Record, Source};
use crate::redact::from_latin1;
use crate::upstream::{full, is_hop_by_hop, is_ours, ProxyBody};

/// Headers of a stored response that are not replayed: they describe the original connection
/// or moment (`Date` is regenerated; `Content-Length` follows the body), or are the proxy's own
/// (a record stored before answers were stripped of them may hold an upstream's).
fn replayable(name: &str) -> bool {
    !(is_hop_by_hop(name) || is_ours(name) || matches!(name, "date" | "content-length"))
}

/// The replay of a succeeded record with its stored body.
pub fn replay(record: &Record, body: Bytes) -> Response<ProxyBody> {
    let stored = record
        .response
        .as_ref()
        .expect("replay is only called for records with a stored response");
    let mut resp = Response::new(full(body));
    *resp.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let h = resp.headers_mut();
    for (name, value) in &stored.headers {
        if !replayable(name) {
            continue;
        }
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&from_latin1(value)),
        ) {
            h.append(n, v);
        }
    }
    h.insert("idempotent-replayed", HeaderValue::from_static("true"));
    h.insert("oncegate-outcome", HeaderValue::from_static("replayed"));
    if stored.source == Source::Lookup {
        h.insert("oncegate-replay-source", HeaderValue::from_static("lookup"));
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::{BodyRef, StoredResponse};

    /// A record stored before upstream answers were stripped of `Oncegate-*` headers: its
    /// replay still speaks only for the proxy.
    #[test]
    fn a_replay_drops_the_oncegate_headers_an_upstream_sent() {
        let header = |n: &str, v: &str| (n.to_string(), v.to_string());
        let record = Record {
            response: Some(StoredResponse {
                status: 201,
                headers: vec![
                    header("oncegate-replay-source", "lookup"),
                    header("oncegate-outcome", "sent"),
                    header("x-kept", "1"),
                ],
                size: 2,
                body: BodyRef::Inline,
                source: Source::Upstream,
            }),
            ..Record::new("act_1", "fp")
        };
        let resp = replay(&record, Bytes::from_static(b"{}"));
        let h = resp.headers();
        assert_eq!(resp.status(), 201);
        assert_eq!(h.get("oncegate-replay-source"), None);
        assert_eq!(h.get_all("oncegate-outcome").iter().count(), 1);
        assert_eq!(h["oncegate-outcome"], "replayed");
        assert_eq!(h["x-kept"], "1");
    }
}
