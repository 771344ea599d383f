//! The policy keys of SPEC §12, layered `[defaults]` → upstream → route, and the status lookup.

use std::time::Duration;

use http::{HeaderName, HeaderValue, Method, StatusCode};
use serde::Deserialize;

use super::{invalid, ConfigError, Dur};

/// The status lookup of SPEC §9.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LookupConfig {
    #[serde(default = "default_lookup_method")]
    pub method: String,
    pub path: String,
    /// A JSON pointer to the created object's id in the answer.
    pub found: String,
    /// A JSON pointer to the created object itself (default: the whole answer): what a replay
    /// of a write settled by this lookup answers, so that a typed SDK gets the object the write
    /// would have returned (Stripe's search: `/data/0`).
    #[serde(default)]
    pub object: String,
    /// The status of that replay (default 200).
    #[serde(default = "default_lookup_status")]
    pub status: u16,
    /// How long after the last send an answer that finds nothing means "not applied"; before
    /// that the action stays unknown (search indexes lag, the upstream may still be working).
    #[serde(default = "default_absent_after")]
    pub absent_after: Dur,
    /// Headers every lookup sends, each read at start from the environment variable named here
    /// (`{ authorization = "PAY_LOOKUP_AUTH" }`): background and admin lookups have no caller
    /// whose credentials they could carry.
    #[serde(default)]
    pub headers_env: std::collections::BTreeMap<String, String>,
    /// `headers_env`, resolved.
    #[serde(skip)]
    pub headers: LookupHeaders,
}

/// A lookup's own headers: credentials, so never printed.
#[derive(Clone, Default, PartialEq)]
pub struct LookupHeaders(pub Vec<(HeaderName, HeaderValue)>);

impl std::fmt::Debug for LookupHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(n, _)| (n.as_str(), "[redacted]")))
            .finish()
    }
}

fn default_lookup_method() -> String {
    "GET".into()
}

fn default_lookup_status() -> u16 {
    200
}

fn default_absent_after() -> Dur {
    Dur(Duration::from_secs(600))
}

/// Declares a struct holding the overridable policy keys of SPEC §12 (all optional), plus the
/// struct's own fields. One list, so `[defaults]`, upstreams and routes cannot drift apart.
macro_rules! with_policy_keys {
    ($(#[$meta:meta])* pub struct $name:ident { $($field:ident : $ty:ty,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Default, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            $(pub $field: $ty,)*
            pub retention: Option<Dur>,
            pub timeout: Option<Dur>,
            pub connect_timeout: Option<Dur>,
            pub retries: Option<u32>,
            pub retry_statuses: Option<Vec<u16>>,
            pub unknown_statuses: Option<Vec<u16>>,
            pub max_retry_wait: Option<Dur>,
            pub max_attempts: Option<u32>,
            pub in_flight_wait: Option<Dur>,
            pub lookup_interval: Option<Dur>,
            pub principal_headers: Option<Vec<String>>,
            pub key_header: Option<String>,
            pub require_key: Option<bool>,
            pub external_id: Option<String>,
            pub fingerprint_ignore: Option<Vec<String>>,
            pub client_keys: Option<$crate::config::ClientKeys>,
            pub fingerprint_window: Option<Dur>,
            pub twin_guard: Option<bool>,
        }

        impl $name {
            /// The policy keys of this level, to layer over the level above.
            pub(super) fn overrides(&self) -> PolicyOverrides {
                PolicyOverrides {
                    retention: self.retention,
                    timeout: self.timeout,
                    connect_timeout: self.connect_timeout,
                    retries: self.retries,
                    retry_statuses: self.retry_statuses.clone(),
                    unknown_statuses: self.unknown_statuses.clone(),
                    max_retry_wait: self.max_retry_wait,
                    max_attempts: self.max_attempts,
                    in_flight_wait: self.in_flight_wait,
                    lookup_interval: self.lookup_interval,
                    principal_headers: self.principal_headers.clone(),
                    key_header: self.key_header.clone(),
                    require_key: self.require_key,
                    external_id: self.external_id.clone(),
                    fingerprint_ignore: self.fingerprint_ignore.clone(),
                    client_keys: self.client_keys,
                    fingerprint_window: self.fingerprint_window,
                    twin_guard: self.twin_guard,
                }
            }
        }
    };
}

pub(super) use with_policy_keys;

with_policy_keys! {
    /// `[defaults]`.
    pub struct PolicyOverrides {}
}

/// The resolved policy that governs one route (SPEC §12 `[defaults]` keys).
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub retention: Duration,
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub retries: u32,
    pub retry_statuses: Vec<StatusCode>,
    pub unknown_statuses: Vec<StatusCode>,
    pub max_retry_wait: Duration,
    pub max_attempts: u32,
    pub in_flight_wait: Duration,
    pub lookup_interval: Duration,
    /// Lower-case header names whose values identify the caller.
    pub principal_headers: Vec<HeaderName>,
    /// `None` when the key is not sent upstream (`key_header = ""`).
    pub key_header: Option<HeaderName>,
    pub require_key: bool,
    pub external_id: Option<String>,
    pub fingerprint_ignore: Vec<String>,
    /// What a client's `Idempotency-Key` is (SPEC §4.1).
    pub client_keys: ClientKeys,
    /// How long after it settled a keyless identical write is still the same action (SPEC
    /// §4.1 rule 3). `None`: the retention.
    pub fingerprint_window: Option<Duration>,
    /// The unsettled-twin guard (SPEC §4.1).
    pub twin_guard: bool,
    pub lookup: Option<LookupConfig>,
    pub stamp: Option<String>,
    /// What an MCP tool call's fingerprint key covers (SPEC §14.2); set by tool rules only.
    pub key_scope: KeyScope,
}

/// What a tool call's fingerprint key covers (SPEC §14.2 `key_scope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyScope {
    /// The tool and its arguments: a resend in any session is the same call.
    #[default]
    Arguments,
    /// Also the `Mcp-Session-Id`: for tools whose effect belongs to a session.
    Session,
    /// Nothing: each call is its own action unless the client sends a key (a toggle).
    Call,
}

impl KeyScope {
    pub fn parse(s: &str) -> Option<KeyScope> {
        match s {
            "arguments" => Some(KeyScope::Arguments),
            "session" => Some(KeyScope::Session),
            "call" => Some(KeyScope::Call),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            KeyScope::Arguments => "arguments",
            KeyScope::Session => "session",
            KeyScope::Call => "call",
        }
    }
}

/// What a client's `Idempotency-Key` names (SPEC §4.1 rule 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClientKeys {
    /// The key is the action's: the client keeps it across its retries of one write.
    #[default]
    Stable,
    /// The client draws a new key on every call (stripe-python does): the key is kept as
    /// evidence, and the action's key comes from task and step or the fingerprint.
    PerCall,
}

impl ClientKeys {
    pub fn as_str(self) -> &'static str {
        match self {
            ClientKeys::Stable => "stable",
            ClientKeys::PerCall => "per-call",
        }
    }
}

impl Policy {
    /// How long after it settled a keyless identical write is still the same action.
    pub fn window(&self) -> Duration {
        self.fingerprint_window.unwrap_or(self.retention)
    }
}

impl Policy {
    pub(super) fn builtin() -> Policy {
        let codes = |c: &[u16]| {
            c.iter()
                .map(|c| StatusCode::from_u16(*c).expect("built-in status codes are valid"))
                .collect()
        };
        Policy {
            retention: Duration::from_secs(24 * 3600),
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            retries: 2,
            retry_statuses: codes(&[429, 503]),
            unknown_statuses: codes(&[408, 500, 502, 504]),
            max_retry_wait: Duration::from_secs(10),
            max_attempts: 5,
            in_flight_wait: Duration::ZERO,
            lookup_interval: Duration::from_secs(60),
            principal_headers: crate::identity::CREDENTIAL_HEADERS
                .iter()
                .map(|h| HeaderName::from_static(h))
                .collect(),
            key_header: Some(HeaderName::from_static("idempotency-key")),
            require_key: false,
            external_id: None,
            fingerprint_ignore: Vec::new(),
            client_keys: ClientKeys::Stable,
            fingerprint_window: None,
            twin_guard: true,
            lookup: None,
            stamp: None,
            key_scope: KeyScope::Arguments,
        }
    }

    /// Layers `o` (found at config key `at`) over `self`.
    pub(super) fn layer(&self, o: &PolicyOverrides, at: &str) -> Result<Policy, ConfigError> {
        let mut p = self.clone();
        if let Some(v) = o.retention {
            p.retention = v.0;
        }
        if let Some(v) = o.timeout {
            p.timeout = v.0;
        }
        if let Some(v) = o.connect_timeout {
            p.connect_timeout = v.0;
        }
        if let Some(v) = o.retries {
            p.retries = v;
        }
        if let Some(v) = &o.retry_statuses {
            p.retry_statuses = statuses(v, &format!("{at}retry_statuses"))?;
        }
        if let Some(v) = &o.unknown_statuses {
            p.unknown_statuses = statuses(v, &format!("{at}unknown_statuses"))?;
        }
        if let Some(v) = o.max_retry_wait {
            p.max_retry_wait = v.0;
        }
        if let Some(v) = o.max_attempts {
            if v == 0 {
                return Err(invalid(format!("{at}max_attempts"), "must be at least 1"));
            }
            p.max_attempts = v;
        }
        if let Some(v) = o.in_flight_wait {
            p.in_flight_wait = v.0;
        }
        if let Some(v) = o.lookup_interval {
            if v.0.is_zero() {
                return Err(invalid(format!("{at}lookup_interval"), "must be positive"));
            }
            p.lookup_interval = v.0;
        }
        if let Some(v) = &o.principal_headers {
            p.principal_headers = v
                .iter()
                .map(|h| header_name(h, &format!("{at}principal_headers")))
                .collect::<Result<_, _>>()?;
        }
        if let Some(v) = &o.key_header {
            p.key_header = if v.is_empty() {
                None
            } else {
                Some(header_name(v, &format!("{at}key_header"))?)
            };
        }
        if let Some(v) = o.require_key {
            p.require_key = v;
        }
        if let Some(v) = &o.external_id {
            let ok = v.is_empty()
                || v.starts_with('/')
                || v.strip_prefix("header:")
                    .is_some_and(|h| HeaderName::from_bytes(h.as_bytes()).is_ok());
            if !ok {
                return Err(invalid(
                    format!("{at}external_id"),
                    "must be a JSON pointer (\"/id\") or \"header:NAME\"",
                ));
            }
            p.external_id = (!v.is_empty()).then(|| v.clone());
        }
        if let Some(v) = &o.fingerprint_ignore {
            // JSON pointers ("/metadata/trace") for JSON bodies, field names for form bodies.
            if v.iter().any(String::is_empty) {
                return Err(invalid(format!("{at}fingerprint_ignore"), "empty entry"));
            }
            p.fingerprint_ignore = v.clone();
        }
        if let Some(v) = o.client_keys {
            p.client_keys = v;
        }
        if let Some(v) = o.fingerprint_window {
            if v.0.is_zero() {
                return Err(invalid(
                    format!("{at}fingerprint_window"),
                    "must be positive (an identical keyless write is at least the same action while the first is unsettled)",
                ));
            }
            p.fingerprint_window = Some(v.0);
        }
        if let Some(v) = o.twin_guard {
            p.twin_guard = v;
        }
        if p.timeout.is_zero() {
            return Err(invalid(format!("{at}timeout"), "must be positive"));
        }
        if p.connect_timeout.is_zero() {
            return Err(invalid(format!("{at}connect_timeout"), "must be positive"));
        }
        if p.retention.is_zero() {
            return Err(invalid(format!("{at}retention"), "must be positive"));
        }
        if p.fingerprint_window.is_some_and(|w| w > p.retention) {
            return Err(invalid(
                format!("{at}fingerprint_window"),
                "must not be longer than retention: a settled action is forgotten after retention",
            ));
        }
        Ok(p)
    }
}

pub(super) fn statuses(v: &[u16], key: &str) -> Result<Vec<StatusCode>, ConfigError> {
    v.iter()
        .map(|c| match StatusCode::from_u16(*c) {
            Ok(s) if (100..600).contains(c) => Ok(s),
            _ => Err(invalid(key, format!("{c} is not an HTTP status code"))),
        })
        .collect()
}

pub(super) fn header_name(h: &str, key: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(h.trim().to_ascii_lowercase().as_bytes())
        .map_err(|_| invalid(key, format!("{h:?} is not a valid header name")))
}

pub(super) fn lookup(l: &LookupConfig, key: &str) -> Result<LookupConfig, ConfigError> {
    Method::from_bytes(l.method.as_bytes()).map_err(|_| {
        invalid(
            format!("{key}.method"),
            format!("{:?} is not a method", l.method),
        )
    })?;
    if !l.path.starts_with('/') {
        return Err(invalid(format!("{key}.path"), "must start with '/'"));
    }
    if !l.found.is_empty() && !l.found.starts_with('/') {
        return Err(invalid(
            format!("{key}.found"),
            "must be a JSON pointer (\"/id\")",
        ));
    }
    if !l.object.is_empty() && !l.object.starts_with('/') {
        return Err(invalid(
            format!("{key}.object"),
            "must be a JSON pointer (\"/data/0\"), or empty for the whole answer",
        ));
    }
    if !(200..=299).contains(&l.status) {
        return Err(invalid(
            format!("{key}.status"),
            "must be a 2xx status: the replay of an applied write",
        ));
    }
    let mut out = l.clone();
    for (h, var) in &l.headers_env {
        let at = format!("{key}.headers_env.{h}");
        let name = header_name(h, &at)?;
        let value = std::env::var(var)
            .ok()
            .filter(|v| !v.is_empty())
            .ok_or_else(|| invalid(&at, format!("the environment variable {var} is not set")))?;
        // The value is a secret: the error names the variable, never what it holds.
        let mut value = HeaderValue::from_str(&value).map_err(|_| {
            invalid(
                &at,
                format!("the environment variable {var} is not a valid header value"),
            )
        })?;
        value.set_sensitive(true);
        out.headers.0.push((name, value));
    }
    Ok(out)
}
