//! Redaction at one choke point (SPEC §11): every header list and path that leaves the request
//! path for a record, a problem, the admin API or a log goes through [`Redactor`].

use http::header::{HeaderMap, HeaderName};

use crate::config::Config;

/// The sets are fixed by the config: what a request sends is only looked up in them, never
/// added, so no choice of names can crowd a bucket, and a fast hasher does (SipHash of every
/// header name of every write: about 0.8k instructions a write, counted with callgrind).
type HashSet<T> = crate::FastSet<T>;

pub const REDACTED: &str = "REDACTED";

/// The largest request body a record keeps to show (larger ones: their size and hash only).
pub const BODY_KEPT_MAX: usize = 16 * 1024;

/// Fields whose values are card secrets, redacted whatever `log.redact_query` says: a card's
/// verification code is never to be kept (PCI DSS 3.3.1.2), and its number is also found by
/// its value ([`has_card_number`]).
const CARD_FIELDS: [&str; 8] = [
    "cvc",
    "cvv",
    "cvc2",
    "cvv2",
    "csc",
    "security_code",
    "card_number",
    "cardnumber",
];

/// Whether `text` holds a payment card number: 14 to 19 digits, written whole or in groups
/// split by single spaces or dashes, the first of them 2 to 6 (the card networks' numbers; an
/// epoch in milliseconds starts with 1), that pass the Luhn check. A longer run of digits is
/// not one.
fn has_card_number(text: &str) -> bool {
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if !b[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let (mut digits, mut n, mut j) = ([0u8; 19], 0, i);
        loop {
            match b.get(j) {
                Some(d) if d.is_ascii_digit() => {
                    if n < digits.len() {
                        digits[n] = d - b'0';
                    }
                    n += 1;
                    j += 1;
                }
                Some(b' ' | b'-') if b.get(j + 1).is_some_and(u8::is_ascii_digit) => j += 1,
                _ => break,
            }
        }
        if (14..=19).contains(&n) && (2..=6).contains(&digits[0]) && luhn(&digits[..n]) {
            return true;
        }
        i = j;
    }
    false
}

/// The Luhn check of a card number's digits.
fn luhn(digits: &[u8]) -> bool {
    let sum: u32 = digits
        .iter()
        .rev()
        .enumerate()
        .map(|(k, &d)| {
            let d = u32::from(d);
            if k % 2 == 1 {
                if d > 4 {
                    2 * d - 9
                } else {
                    2 * d
                }
            } else {
                d
            }
        })
        .sum();
    sum % 10 == 0
}

/// The bodies whose fields redaction can find.
enum BodyKind {
    Json,
    Form,
}

impl BodyKind {
    fn of(content_type: &[u8]) -> Option<BodyKind> {
        let ct = std::str::from_utf8(content_type).ok()?;
        let essence = ct.split(';').next()?.trim().to_ascii_lowercase();
        if essence == "application/json" || essence.ends_with("+json") {
            Some(BodyKind::Json)
        } else if essence == "application/x-www-form-urlencoded" {
            Some(BodyKind::Form)
        } else {
            None
        }
    }
}

/// Header values as strings, byte for byte: each byte is one char (Latin-1), so any header value
/// survives a round trip through JSON.
pub fn latin1(bytes: &[u8]) -> String {
    // Nearly every value is ASCII, which is the same in Latin-1 and UTF-8: copied whole, not a
    // char at a time (every request's and every response's headers pass through here).
    match std::str::from_utf8(bytes) {
        Ok(s) if s.is_ascii() => s.to_owned(),
        _ => bytes.iter().map(|&b| b as char).collect(),
    }
}

/// The inverse of [`latin1`]. Chars above U+00FF (never produced by it) become `?`.
pub fn from_latin1(s: &str) -> Vec<u8> {
    if s.is_ascii() {
        return s.as_bytes().to_vec();
    }
    s.chars()
        .map(|c| u8::try_from(u32::from(c)).unwrap_or(b'?'))
        .collect()
}

/// Knows which headers and query parameters are secret.
#[derive(Debug, Clone)]
pub struct Redactor {
    headers: HashSet<HeaderName>,
    query: HashSet<String>,
}

impl Redactor {
    pub fn new(config: &Config) -> Redactor {
        // Every credential header, and the cookies a server sets.
        let mut headers: HashSet<HeaderName> = (crate::identity::CREDENTIAL_HEADERS.iter())
            .chain(&["set-cookie"])
            .map(|h| HeaderName::from_static(h))
            .collect();
        headers.extend(config.log.redact_headers.iter().cloned());
        // Every principal header anywhere is a credential.
        for u in &config.upstreams {
            headers.extend(u.policy.principal_headers.iter().cloned());
            for r in &u.routes {
                headers.extend(r.policy.principal_headers.iter().cloned());
            }
        }
        Redactor {
            headers,
            query: (config.log.redact_query.iter())
                .map(|q| q.to_ascii_lowercase())
                .chain(CARD_FIELDS.iter().map(|f| f.to_string()))
                .collect(),
        }
    }

    /// Whether a parameter or field named `name` is secret: the name, or a form field's
    /// innermost bracketed name (`card[cvc]`), is one of the secret names.
    fn is_secret_name(&self, name: &str) -> bool {
        let name = name.to_ascii_lowercase();
        let inner = name
            .strip_suffix(']')
            .and_then(|n| n.rsplit_once('['))
            .map(|(_, inner)| inner);
        self.query.contains(&name) || inner.is_some_and(|n| self.query.contains(n))
    }

    pub fn is_secret_header(&self, name: &HeaderName) -> bool {
        self.headers.contains(name)
    }

    /// Headers as (name, value) pairs, secrets replaced by `REDACTED`.
    pub fn headers(&self, h: &HeaderMap) -> Vec<(String, String)> {
        h.iter()
            .map(|(k, v)| {
                let value = if self.is_secret_header(k) {
                    REDACTED.to_string()
                } else {
                    latin1(v.as_bytes())
                };
                (k.as_str().to_string(), value)
            })
            .collect()
    }

    /// A query string (or a form body) with the values of secret parameters, and those that
    /// hold a card number, replaced by `REDACTED`.
    pub fn query(&self, q: &str) -> String {
        q.split('&')
            .map(|part| {
                let name = part.split('=').next().unwrap_or_default();
                let (name_decoded, value) = form_urlencoded::parse(part.as_bytes())
                    .next()
                    .unwrap_or_default();
                if self.is_secret_name(&name_decoded) || has_card_number(&value) {
                    format!("{name}={REDACTED}")
                } else {
                    part.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("&")
    }

    /// A request body as the record keeps it to show an operator (what to look for at the
    /// service): a JSON or form body of at most [`BODY_KEPT_MAX`] bytes, the values of fields
    /// named like a secret query parameter (`log.redact_query` and [`CARD_FIELDS`], at any
    /// depth) and those that hold a card number replaced by `REDACTED`. Any other body is not
    /// kept (`None`): its structure does not say where a secret is. Most bodies name no such
    /// field and hold no card number, and are kept as they came, unparsed.
    pub fn body(&self, content_type: Option<&[u8]>, body: &[u8]) -> Option<String> {
        if body.is_empty() || body.len() > BODY_KEPT_MAX {
            return None;
        }
        let kind = BodyKind::of(content_type?)?;
        let text = std::str::from_utf8(body).ok()?;
        let lower = text.to_ascii_lowercase();
        if !self.query.iter().any(|name| lower.contains(name.as_str())) && !has_card_number(text) {
            return Some(text.to_string());
        }
        match kind {
            BodyKind::Json => {
                let mut v: serde_json::Value = serde_json::from_str(text).ok()?;
                self.redact_json(&mut v);
                Some(v.to_string())
            }
            BodyKind::Form => Some(self.query(text)),
        }
    }

    fn redact_json(&self, v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map.iter_mut() {
                    if self.is_secret_name(k) {
                        *v = serde_json::Value::String(REDACTED.into());
                    } else {
                        self.redact_json(v);
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(|v| self.redact_json(v)),
            serde_json::Value::String(text) if has_card_number(text) => {
                *v = serde_json::Value::String(REDACTED.into());
            }
            serde_json::Value::Number(n) if has_card_number(&n.to_string()) => {
                *v = serde_json::Value::String(REDACTED.into());
            }
            _ => {}
        }
    }

    /// `{rest}` plus the redacted query, as stored and shown.
    pub fn path(&self, rest: &str, query: Option<&str>) -> String {
        let rest = if rest.is_empty() { "/" } else { rest };
        match query {
            Some(q) => format!("{rest}?{}", self.query(q)),
            None => rest.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The redactor of a config that names no secrets of its own.
    fn redactor() -> Redactor {
        let c = Config::parse(
            "[server]\n[[upstreams]]\nname='a'\nprefix='/a'\nurl='http://127.0.0.1:1'\n",
        )
        .expect("valid");
        Redactor::new(&c)
    }

    #[test]
    fn redacts_secret_query_values_and_headers() {
        let c = Config::parse(
            "[server]\n[log]\nredact_headers=['x-session']\n[[upstreams]]\nname='a'\nprefix='/a'\nurl='http://127.0.0.1:1'\nprincipal_headers=['x-agent-id']\n",
        )
        .expect("valid");
        let r = Redactor::new(&c);
        assert_eq!(
            r.path("/v1/x", Some("a=1&api_key=s3cr3t&Token=t&b")),
            "/v1/x?a=1&api_key=REDACTED&Token=REDACTED&b"
        );
        let mut h = HeaderMap::new();
        h.insert("authorization", "Bearer s3cr3t".parse().expect("value"));
        h.insert("x-session", "s3cr3t".parse().expect("value"));
        h.insert("x-agent-id", "agent-7".parse().expect("value"));
        h.insert("accept", "text/plain".parse().expect("value"));
        let out = format!("{:?}", r.headers(&h));
        assert!(!out.contains("s3cr3t") && !out.contains("agent-7"), "{out}");
        assert!(out.contains("text/plain"));
    }

    #[test]
    fn a_kept_body_has_its_secret_fields_redacted_and_other_bodies_are_not_kept() {
        let r = redactor();
        let json = Some(b"application/json; charset=utf-8".as_slice());
        let body =
            br#"{"amount":5,"card":{"Token":"tok_s3cr3t"},"items":[{"password":"hunter2"}]}"#;
        let kept = r.body(json, body).expect("kept");
        assert!(
            !kept.contains("s3cr3t") && !kept.contains("hunter2"),
            "{kept}"
        );
        assert!(
            kept.contains(r#""amount":5"#) && kept.contains(REDACTED),
            "{kept}"
        );
        // Nothing secret: kept as it came.
        let plain = br#"{"amount": 5, "currency": "usd"}"#;
        assert_eq!(
            r.body(json, plain).as_deref(),
            Some(std::str::from_utf8(plain).expect("ASCII"))
        );
        let form = Some(b"application/x-www-form-urlencoded".as_slice());
        assert_eq!(
            r.body(form, b"amount=5&api_key=s3cr3t").as_deref(),
            Some("amount=5&api_key=REDACTED")
        );
        // Not JSON after all (and naming a secret), another type, too large, empty: not kept.
        assert_eq!(r.body(json, br#"{"token":"s3cr3t""#), None);
        assert_eq!(r.body(Some(b"text/plain"), b"secret=1"), None);
        assert_eq!(r.body(None, b"{}"), None);
        let big = format!(r#"{{"a":"{}"}}"#, "x".repeat(BODY_KEPT_MAX));
        assert_eq!(r.body(json, big.as_bytes()), None);
        assert_eq!(r.body(json, b""), None);
    }

    /// Card numbers are found by their value, in a query, a form or JSON body, whatever their
    /// field is named; a verification code by its name, also inside a form's brackets.
    #[test]
    fn card_numbers_and_codes_are_never_kept() {
        let r = redactor();
        for pan in [
            "4242424242424242",
            "4242 4242 4242 4242",
            "5555-5555-5555-4444",
            "378282246310005",
            "6011111111111117",
            "2223003122003222",
        ] {
            assert!(has_card_number(pan), "{pan}");
            assert!(has_card_number(&format!("card {pan} on file")), "{pan}");
        }
        for not in [
            "4242424242424241",     // fails the Luhn check
            "1765100000000003",     // an epoch in ms and more, starting with 1
            "42424242424242424242", // 20 digits: an id, not a card
            "4242  4242 4242 4242", // two spaces split two numbers
            "order 12345",
            "",
        ] {
            assert!(!has_card_number(not), "{not}");
        }
        let form = Some(b"application/x-www-form-urlencoded".as_slice());
        let kept = r
            .body(
                form,
                b"amount=2000&card[number]=4242+4242+4242+4242&card[exp_month]=12&card[cvc]=314",
            )
            .expect("kept");
        assert_eq!(
            kept,
            "amount=2000&card[number]=REDACTED&card[exp_month]=12&card[cvc]=REDACTED"
        );
        let json = Some(b"application/json".as_slice());
        let kept = r
            .body(
                json,
                br#"{"amount":2000,"source":{"pan":4242424242424242,"CVV":"314","note":"4242-4242-4242-4242"}}"#,
            )
            .expect("kept");
        let v: serde_json::Value = serde_json::from_str(&kept).expect("JSON");
        assert_eq!(
            v,
            serde_json::json!({"amount": 2000, "source": {"pan": "REDACTED", "CVV": "REDACTED", "note": "REDACTED"}})
        );
        assert_eq!(
            r.path("/v1/pay", Some("n=4242424242424242&x[cvc]=1&order=17")),
            "/v1/pay?n=REDACTED&x[cvc]=REDACTED&order=17"
        );
    }

    #[test]
    fn latin1_round_trips_every_byte() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(from_latin1(&latin1(&all)), all);
        // ASCII (the copied-whole case) and a UTF-8 value, which is bytes to Latin-1, not text.
        assert_eq!(latin1(b"application/json"), "application/json");
        assert_eq!(from_latin1("application/json"), b"application/json");
        let utf8 = "caf\u{e9}".as_bytes();
        assert_eq!(latin1(utf8), "caf\u{c3}\u{a9}");
        assert_eq!(from_latin1(&latin1(utf8)), utf8);
    }
}
