//! Replays (SPEC §7): a stored response answered again, byte for byte, without the upstream.

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{Response, StatusCode};

use crate::action::{Record, Source};
use crate::redact::from_latin1;
use crate::upstream::{full, is_hop_by_hop, ProxyBody};

/// Headers of a stored response that are not replayed: they describe the original connection
/// or moment (`Date` is regenerated; `Content-Length` follows the body).
fn replayable(name: &str) -> bool {
    !(is_hop_by_hop(name) || matches!(name, "date" | "content-length"))
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
