//! SSE events as they arrive, the final JSON-RPC response among them, and what it says about the
//! write (SPEC §14.3).

use bytes::Bytes;
use serde_json::Value;

/// One complete SSE event.
#[derive(Debug, Clone)]
pub struct Event {
    /// The event as it arrived, with its closing blank line: forwarded verbatim.
    pub raw: Bytes,
    /// Its `data` lines, joined by `\n`.
    pub data: String,
    /// Its `id` field, when it has one: where a client resumes the stream (`Last-Event-ID`).
    pub id: Option<String>,
}

/// Splits an SSE stream into events, whatever the chunking (lines end in `\n`, `\r\n` or `\r`).
#[derive(Debug, Default)]
pub struct Events {
    buf: Vec<u8>,
    /// Where the line being read starts, within `buf`.
    line_start: usize,
    /// How far `buf` has been scanned.
    scanned: usize,
    /// An event ended in a `\r` that was the last byte: a `\n` right after it belongs to it.
    after_cr: bool,
}

impl Events {
    /// Takes a chunk; returns the events it completed.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Event> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        let mut i = self.scanned;
        if std::mem::take(&mut self.after_cr) && self.buf.first() == Some(&b'\n') {
            // Forwarded with the next event; it ends no line of its own.
            self.line_start = 1;
            i = 1;
        }
        while i < self.buf.len() {
            let end = match self.buf[i] {
                b'\n' => i + 1,
                // `\r` or `\r\n`: wait for the next byte, unless it ends an event.
                b'\r' if i + 1 == self.buf.len() && i != self.line_start => break,
                b'\r' if i + 1 == self.buf.len() => {
                    self.after_cr = true;
                    i + 1
                }
                b'\r' if self.buf[i + 1] == b'\n' => i + 2,
                b'\r' => i + 1,
                _ => {
                    i += 1;
                    continue;
                }
            };
            if i == self.line_start {
                // A blank line: the event is complete.
                let raw: Vec<u8> = self.buf.drain(..end).collect();
                let (data, id) = fields_of(&raw[..i]);
                out.push(Event {
                    raw: Bytes::from(raw),
                    data,
                    id,
                });
                self.line_start = 0;
                i = 0;
            } else {
                self.line_start = end;
                i = end;
            }
        }
        self.scanned = i;
        out
    }

    /// Bytes of the event not yet complete.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The incomplete rest, when the stream ends.
    pub fn take_rest(&mut self) -> Bytes {
        self.line_start = 0;
        self.scanned = 0;
        self.after_cr = false;
        Bytes::from(std::mem::take(&mut self.buf))
    }
}

/// The `data` and `id` fields of an event's lines.
fn fields_of(lines: &[u8]) -> (String, Option<String>) {
    let text = String::from_utf8_lossy(lines);
    let mut data: Vec<&str> = Vec::new();
    let mut id = None;
    for line in text.split(['\n', '\r']).filter(|l| !l.is_empty()) {
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "data" => data.push(value),
            // An id with a NUL is ignored (the SSE standard).
            "id" if !value.contains('\0') => id = Some(value.to_string()),
            _ => {}
        }
    }
    (data.join("\n"), id)
}

/// The final response to request `id`, if this message is it.
pub fn final_response(data: &[u8], id: &Value) -> Option<Value> {
    let v: Value = serde_json::from_slice(data).ok()?;
    let o = v.as_object()?;
    (o.get("id") == Some(id) && (o.contains_key("result") || o.contains_key("error"))).then_some(v)
}

/// What a final response says about the tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// A result (an `InputRequiredResult` included).
    Succeeded,
    /// A result with `isError: true`, or an error saying the call never ran.
    Failed { needs_decision: bool },
    /// An error that does not say whether the tool ran.
    Unknown(String),
}

/// JSON-RPC errors that say the call was never run: parse error, invalid request, method not
/// found, invalid params.
const NEVER_RAN: &[i64] = &[-32700, -32600, -32601, -32602];

pub fn verdict(resp: &Value) -> Verdict {
    if let Some(result) = resp.get("result") {
        if result.get("isError") == Some(&Value::Bool(true)) {
            return Verdict::Failed {
                needs_decision: false,
            };
        }
        return Verdict::Succeeded;
    }
    let code = resp.pointer("/error/code").and_then(Value::as_i64);
    match code {
        Some(c) if NEVER_RAN.contains(&c) => Verdict::Failed {
            needs_decision: true,
        },
        _ => {
            let msg = resp
                .pointer("/error/message")
                .and_then(Value::as_str)
                .unwrap_or("no message");
            Verdict::Unknown(format!(
                "the server answered JSON-RPC error {}: {msg}",
                code.map_or("without a code".to_string(), |c| c.to_string())
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_whatever_the_chunks_and_line_ends() {
        let stream =
            b"event: message\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\nid: 2\ndata: x\n\ndata: y\r\r";
        for size in 1..stream.len() {
            let mut ev = Events::default();
            let mut got = Vec::new();
            for chunk in stream.chunks(size) {
                got.extend(ev.push(chunk));
            }
            let data: Vec<&str> = got.iter().map(|e| e.data.as_str()).collect();
            assert_eq!(data, ["{\"a\":\n1}", "x", "y"], "chunks of {size}");
            let raw: Vec<u8> = got.iter().flat_map(|e| e.raw.to_vec()).collect();
            assert_eq!(raw, stream, "chunks of {size}");
            assert_eq!(ev.pending(), 0);
        }
    }

    #[test]
    fn verdicts() {
        let v = |s: &str| verdict(&serde_json::from_str(s).expect("test input"));
        assert_eq!(v(r#"{"id":1,"result":{"content":[]}}"#), Verdict::Succeeded);
        assert_eq!(
            v(r#"{"id":1,"result":{"isError":true}}"#),
            Verdict::Failed {
                needs_decision: false
            }
        );
        assert_eq!(
            v(r#"{"id":1,"error":{"code":-32602,"message":"bad"}}"#),
            Verdict::Failed {
                needs_decision: true
            }
        );
        assert!(matches!(
            v(r#"{"id":1,"error":{"code":-32603,"message":"internal"}}"#),
            Verdict::Unknown(_)
        ));
        let id = Value::from(3);
        assert!(final_response(br#"{"jsonrpc":"2.0","id":3,"result":{}}"#, &id).is_some());
        assert!(final_response(br#"{"jsonrpc":"2.0","id":"3","result":{}}"#, &id).is_none());
        assert!(final_response(
            br#"{"jsonrpc":"2.0","method":"notifications/progress"}"#,
            &id
        )
        .is_none());
    }
}
