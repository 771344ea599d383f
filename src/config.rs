//! Configuration: TOML on disk → validated, fully resolved [`Config`].
//!
//! Parsing is strict (`deny_unknown_fields` everywhere) and fails fast: every error names the key
//! that is wrong, and `main` exits 64 on it. Policy settings cascade `[defaults]` → upstream →
//! route and are merged once here, so the request path never merges anything.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Method, StatusCode, Uri};
use serde::Deserialize;

use crate::route::{Class, Glob};

/// A configuration error. The message always names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Parse(String),
    #[error("invalid `{key}`: {reason}")]
    Invalid { key: String, reason: String },
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

/// A duration written as a string: `"250ms"`, `"30s"`, `"5m"`, `"24h"`, `"7d"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Dur;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a duration as a string with a unit, such as \"3s\"")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Dur, E> {
                parse_duration(s).map(Dur).map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Dur, E> {
                Err(E::custom(format!(
                    "durations are strings with a unit: write \"{n}s\" (or \"{n}ms\"), not {n}"
                )))
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Dur, E> {
                self.visit_i64(n as i64)
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<Dur, E> {
                Err(E::custom(format!(
                    "durations are strings with a unit: write \"{n}s\", not {n}"
                )))
            }
        }
        d.deserialize_any(V)
    }
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("duration {s:?} needs a unit (ms, s, m, h, d)"))?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("duration {s:?} must start with a whole number"))?;
    let ms = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "duration {s:?}: unknown unit {unit:?} (ms, s, m, h, d)"
            ))
        }
    };
    n.checked_mul(ms)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("duration {s:?} is too large"))
}

/// A size written as a string: `"512B"`, `"64KiB"`, `"10MiB"`, `"1GiB"` (KB/MB/GB are decimal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_size(&s).map(Size).map_err(serde::de::Error::custom)
    }
}

pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("size {s:?} must start with a whole number"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "size {s:?}: unknown unit {other:?} (B, KiB, MiB, GiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

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
        #[derive(Debug, Clone, Default, Deserialize)]
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
        }

        impl $name {
            /// The policy keys of this level, to layer over the level above.
            fn overrides(&self) -> PolicyOverrides {
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
                }
            }
        }
    };
}

with_policy_keys! {
    /// `[defaults]`.
    pub struct PolicyOverrides {}
}

with_policy_keys! {
    /// One `[[upstreams.routes]]` entry.
    pub struct RawRoute {
        methods: Option<Vec<String>>,
        path: Option<String>,
        class: Option<String>,
        lookup: Option<LookupConfig>,
        stamp: Option<String>,
    }
}

with_policy_keys! {
    /// One `[[upstreams]]` entry.
    pub struct RawUpstream {
        name: String,
        prefix: String,
        url: String,
        ca_file: Option<PathBuf>,
        allow_encoded_slash: Option<bool>,
        lookup: Option<LookupConfig>,
        routes: Option<Vec<RawRoute>>,
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<String>,
    max_body: Option<Size>,
    max_stored_response: Option<Size>,
    drain_timeout: Option<Dur>,
    header_timeout: Option<Dur>,
    body_timeout: Option<Dur>,
    max_connections: Option<usize>,
    tls: Option<TlsConfig>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    listen: Option<String>,
    token_env: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    backend: Option<String>,
    path: Option<PathBuf>,
    url_env: Option<String>,
    encrypt_key_env: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLog {
    redact_query: Option<Vec<String>>,
    redact_headers: Option<Vec<String>>,
    hmac_key_env: Option<String>,
    retention: Option<Dur>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    server: RawServer,
    #[serde(default)]
    admin: RawAdmin,
    #[serde(default)]
    store: RawStore,
    #[serde(default)]
    log: RawLog,
    #[serde(default)]
    defaults: PolicyOverrides,
    #[serde(default)]
    upstreams: Vec<RawUpstream>,
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
    pub lookup: Option<LookupConfig>,
    pub stamp: Option<String>,
}

impl Policy {
    fn builtin() -> Policy {
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
            principal_headers: ["authorization", "x-api-key", "api-key"]
                .into_iter()
                .map(HeaderName::from_static)
                .collect(),
            key_header: Some(HeaderName::from_static("idempotency-key")),
            require_key: false,
            external_id: None,
            fingerprint_ignore: Vec::new(),
            lookup: None,
            stamp: None,
        }
    }

    /// Layers `o` (found at config key `at`) over `self`.
    fn layer(&self, o: &PolicyOverrides, at: &str) -> Result<Policy, ConfigError> {
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
        if p.timeout.is_zero() {
            return Err(invalid(format!("{at}timeout"), "must be positive"));
        }
        if p.connect_timeout.is_zero() {
            return Err(invalid(format!("{at}connect_timeout"), "must be positive"));
        }
        if p.retention.is_zero() {
            return Err(invalid(format!("{at}retention"), "must be positive"));
        }
        Ok(p)
    }
}

fn statuses(v: &[u16], key: &str) -> Result<Vec<StatusCode>, ConfigError> {
    v.iter()
        .map(|c| match StatusCode::from_u16(*c) {
            Ok(s) if (100..600).contains(c) => Ok(s),
            _ => Err(invalid(key, format!("{c} is not an HTTP status code"))),
        })
        .collect()
}

fn header_name(h: &str, key: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(h.trim().to_ascii_lowercase().as_bytes())
        .map_err(|_| invalid(key, format!("{h:?} is not a valid header name")))
}

fn lookup(l: &LookupConfig, key: &str) -> Result<LookupConfig, ConfigError> {
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

/// One classification rule, resolved.
#[derive(Debug, Clone)]
pub struct Route {
    /// Empty: any method.
    pub methods: Vec<Method>,
    pub path: Glob,
    pub class: Option<Class>,
    pub policy: Arc<Policy>,
}

/// One upstream, resolved.
#[derive(Debug, Clone)]
pub struct Upstream {
    pub name: String,
    /// The name as a metric label (interned once, so that counting allocates nothing).
    pub label: &'static str,
    pub prefix: String,
    /// The upstream base URL as written (scheme, authority and an optional base path).
    pub url: Uri,
    pub ca_file: Option<PathBuf>,
    /// Paths may carry `%2F` inside a segment (APIs such as GitLab's); refused otherwise.
    pub allow_encoded_slash: bool,
    /// The upstream-level policy, used when no route matches.
    pub policy: Arc<Policy>,
    pub routes: Vec<Route>,
}

impl Upstream {
    /// The base path of the upstream URL without a trailing slash (`""` for none).
    pub fn base_path(&self) -> &str {
        self.url.path().trim_end_matches('/')
    }
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub max_body: u64,
    pub max_stored_response: u64,
    pub drain_timeout: Duration,
    pub header_timeout: Duration,
    /// A write body must arrive whole within this (408 `body-timeout`, nothing sent).
    pub body_timeout: Duration,
    /// Client connections open at once; more wait in the listen backlog.
    pub max_connections: usize,
    pub tls: Option<TlsConfig>,
}

#[derive(Debug, Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    pub token_env: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum StoreConfig {
    Sled { path: PathBuf },
    Postgres { url_env: String },
}

#[derive(Debug, Clone)]
pub struct LogConfig {
    pub redact_query: Vec<String>,
    pub redact_headers: Vec<HeaderName>,
    pub hmac_key_env: Option<String>,
    pub retention: Option<Duration>,
}

/// The whole, validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub admin: AdminConfig,
    pub store: StoreConfig,
    /// `store.encrypt_key_env`: the variable holding the key that seals stored heads and bodies.
    pub encrypt_key_env: Option<String>,
    pub log: LogConfig,
    pub upstreams: Vec<Arc<Upstream>>,
}

pub const DEFAULT_REDACT_QUERY: &[&str] = &[
    "api_key",
    "apikey",
    "key",
    "token",
    "access_token",
    "secret",
    "password",
    "signature",
    "sig",
];

impl Config {
    /// Reads and validates a config file. Relative paths in it (store path, TLS files, CA files)
    /// are taken relative to the current directory, like every other CLI tool.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Config::parse(&text)
    }

    /// Parses and validates config text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        raw.validate()
    }

    /// Valid settings that are risky, for `check` to print and `run` to log. On the embedded
    /// store, a policy allowing more than [`SLED_SAFE_ATTEMPTS`] attempts per action: a record
    /// sheds evidence to stay within its bound, but keeps every attempt with its last try, so a
    /// record with that many attempts can outgrow it and reach sled's blob files
    /// (docs/decisions.md, "Records are bounded").
    pub fn cautions(&self) -> Vec<String> {
        if !matches!(self.store, StoreConfig::Sled { .. }) {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut check = |at: String, attempts: u32| {
            if attempts > SLED_SAFE_ATTEMPTS {
                out.push(format!(
                    "{at}: max_attempts allows {attempts} attempts per action; on the embedded \
                     store a record keeps every attempt, and with more than \
                     {SLED_SAFE_ATTEMPTS} it can outgrow the store's bound and reach sled's blob \
                     files (docs/decisions.md, \"Records are bounded\")"
                ));
            }
        };
        for u in &self.upstreams {
            let own = u.policy.max_attempts;
            check(format!("upstreams.{}", u.name), own);
            // A route that inherits its upstream's count is covered by the upstream's caution.
            for (i, r) in u.routes.iter().enumerate() {
                if r.policy.max_attempts != own {
                    check(
                        format!("upstreams.{}.routes[{i}]", u.name),
                        r.policy.max_attempts,
                    );
                }
            }
        }
        out
    }
}

/// Attempts per action whose record the embedded store keeps within its bound
/// (`store::sled::RECORD_MAX`) in the worst case, shedding evidence as it must (a unit test in
/// `store::sled` builds that record). Past the bound sled may write a blob file.
pub const SLED_SAFE_ATTEMPTS: u32 = 50;

fn socket_addr(s: &str, key: &str) -> Result<SocketAddr, ConfigError> {
    s.parse()
        .map_err(|_| invalid(key, format!("{s:?} is not an address like 127.0.0.1:8080")))
}

impl RawConfig {
    fn validate(self) -> Result<Config, ConfigError> {
        let s = &self.server;
        let server = ServerConfig {
            listen: socket_addr(
                s.listen.as_deref().unwrap_or("127.0.0.1:8080"),
                "server.listen",
            )?,
            max_body: s.max_body.map_or(10 << 20, |v| v.0),
            max_stored_response: s.max_stored_response.map_or(10 << 20, |v| v.0),
            drain_timeout: s.drain_timeout.map_or(Duration::from_secs(30), |v| v.0),
            header_timeout: s.header_timeout.map_or(Duration::from_secs(10), |v| v.0),
            body_timeout: s.body_timeout.map_or(Duration::from_secs(30), |v| v.0),
            max_connections: s.max_connections.unwrap_or(10_000),
            tls: s.tls.clone(),
        };
        if server.header_timeout.is_zero() {
            return Err(invalid("server.header_timeout", "must be positive"));
        }
        if server.body_timeout.is_zero() {
            return Err(invalid("server.body_timeout", "must be positive"));
        }
        if server.max_connections == 0 {
            return Err(invalid("server.max_connections", "must be at least 1"));
        }
        let admin = AdminConfig {
            listen: socket_addr(
                self.admin.listen.as_deref().unwrap_or("127.0.0.1:8081"),
                "admin.listen",
            )?,
            token_env: self
                .admin
                .token_env
                .clone()
                .unwrap_or_else(|| "ONCEGATE_ADMIN_TOKEN".into()),
        };
        let store = match self.store.backend.as_deref().unwrap_or("sled") {
            "sled" => {
                if self.store.url_env.is_some() {
                    return Err(invalid(
                        "store.url_env",
                        "only applies to backend = \"postgres\"",
                    ));
                }
                StoreConfig::Sled {
                    path: self
                        .store
                        .path
                        .clone()
                        .unwrap_or_else(|| PathBuf::from("oncegate-data")),
                }
            }
            "postgres" => {
                if self.store.path.is_some() {
                    return Err(invalid("store.path", "only applies to backend = \"sled\""));
                }
                StoreConfig::Postgres {
                    url_env: self
                        .store
                        .url_env
                        .clone()
                        .unwrap_or_else(|| "ONCEGATE_POSTGRES_URL".into()),
                }
            }
            other => {
                return Err(invalid(
                    "store.backend",
                    format!("{other:?}: expected \"sled\" or \"postgres\""),
                ))
            }
        };
        let log =
            LogConfig {
                redact_query: self.log.redact_query.clone().unwrap_or_else(|| {
                    DEFAULT_REDACT_QUERY.iter().map(|s| s.to_string()).collect()
                }),
                redact_headers: self
                    .log
                    .redact_headers
                    .iter()
                    .flatten()
                    .map(|h| header_name(h, "log.redact_headers"))
                    .collect::<Result<_, _>>()?,
                hmac_key_env: self.log.hmac_key_env.clone(),
                retention: self.log.retention.map(|d| d.0),
            };

        let defaults = Policy::builtin().layer(&self.defaults.overrides(), "defaults.")?;
        let mut upstreams: Vec<Arc<Upstream>> = Vec::new();
        for (i, u) in self.upstreams.iter().enumerate() {
            upstreams.push(Arc::new(resolve_upstream(u, i, &defaults, &upstreams)?));
        }
        if upstreams.is_empty() {
            return Err(invalid("upstreams", "at least one [[upstreams]] is needed"));
        }
        if self.store.encrypt_key_env.as_deref() == Some("") {
            return Err(invalid(
                "store.encrypt_key_env",
                "names the environment variable holding the key; leave it out for no encryption",
            ));
        }
        Ok(Config {
            server,
            admin,
            store,
            encrypt_key_env: self.store.encrypt_key_env.clone(),
            log,
            upstreams,
        })
    }
}

fn resolve_upstream(
    u: &RawUpstream,
    i: usize,
    defaults: &Policy,
    earlier: &[Arc<Upstream>],
) -> Result<Upstream, ConfigError> {
    let at = format!("upstreams[{i}].");
    if u.name.is_empty()
        || !u
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(invalid(
            format!("{at}name"),
            "must be non-empty letters, digits, '-', '_' or '.'",
        ));
    }
    if earlier.iter().any(|e| e.name == u.name) {
        return Err(invalid(
            format!("{at}name"),
            format!("{:?} is used twice", u.name),
        ));
    }
    let prefix = u.prefix.trim_end_matches('/');
    if !u.prefix.starts_with('/') {
        return Err(invalid(format!("{at}prefix"), "must start with '/'"));
    }
    if prefix == "/_oncegate" || prefix.starts_with("/_oncegate/") {
        return Err(invalid(
            format!("{at}prefix"),
            "/_oncegate/ is reserved for the proxy",
        ));
    }
    if earlier.iter().any(|e| e.prefix == prefix) {
        return Err(invalid(
            format!("{at}prefix"),
            format!("{:?} is used twice", u.prefix),
        ));
    }
    let url: Uri = u
        .url
        .parse()
        .map_err(|e| invalid(format!("{at}url"), format!("{:?}: {e}", u.url)))?;
    match url.scheme_str() {
        Some("http") | Some("https") => {}
        _ => {
            return Err(invalid(
                format!("{at}url"),
                "must start with http:// or https://",
            ))
        }
    }
    if url.host().is_none_or(str::is_empty) {
        return Err(invalid(format!("{at}url"), "needs a host"));
    }
    if url.query().is_some() {
        return Err(invalid(format!("{at}url"), "must not have a query"));
    }
    if let Some(ca) = &u.ca_file {
        if !ca.is_file() {
            return Err(invalid(
                format!("{at}ca_file"),
                format!("{} is not a file", ca.display()),
            ));
        }
    }
    let mut policy = defaults.layer(&u.overrides(), &at)?;
    if let Some(l) = &u.lookup {
        policy.lookup = Some(lookup(l, &format!("{at}lookup"))?);
    }
    let mut routes = Vec::new();
    for (j, r) in u.routes.iter().flatten().enumerate() {
        let rat = format!("{at}routes[{j}].");
        let methods = r
            .methods
            .iter()
            .flatten()
            .map(|m| {
                Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                    .map_err(|_| invalid(format!("{rat}methods"), format!("{m:?} is not a method")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let path = r.path.as_deref().unwrap_or("/**");
        if !path.starts_with('/') {
            return Err(invalid(format!("{rat}path"), "must start with '/'"));
        }
        if let Some(bad) = path.split('/').find(|seg| {
            (seg.contains('*') && *seg != "*" && *seg != "**")
                || seg.contains(['[', ']', '{', '}', '?'])
        }) {
            // A segment such as `**x` or `v1*` would be matched literally: say so instead.
            return Err(invalid(
                format!("{rat}path"),
                format!(
                    "{bad:?} is not a glob segment: `*` (one segment) and `**` (any number) stand alone between slashes; `[`, `]`, `{{`, `}}` and `?` are not glob syntax here"
                ),
            ));
        }
        let class = match r.class.as_deref() {
            None => None,
            Some("read") => Some(Class::Read),
            Some("write") => Some(Class::Write),
            Some("deny") => Some(Class::Deny),
            Some(other) => {
                return Err(invalid(
                    format!("{rat}class"),
                    format!("{other:?}: expected \"read\", \"write\" or \"deny\""),
                ))
            }
        };
        let mut rp = policy.layer(&r.overrides(), &rat)?;
        if let Some(l) = &r.lookup {
            rp.lookup = Some(lookup(l, &format!("{rat}lookup"))?);
        }
        if let Some(s) = &r.stamp {
            if s.is_empty() {
                return Err(invalid(format!("{rat}stamp"), "must not be empty"));
            }
            rp.stamp = Some(s.clone());
        }
        routes.push(Route {
            methods,
            path: Glob::new(path),
            class,
            policy: Arc::new(rp),
        });
    }
    Ok(Upstream {
        name: u.name.clone(),
        label: crate::metrics::intern(&u.name),
        prefix: prefix.to_string(),
        url,
        ca_file: u.ca_file.clone(),
        allow_encoded_slash: u.allow_encoded_slash.unwrap_or(false),
        policy: Arc::new(policy),
        routes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cautions_name_policies_with_more_attempts_than_the_embedded_store_bounds() {
        let text = |route_attempts: u32| {
            format!(
                r#"
                [server]
                [store]
                path = "s"
                [[upstreams]]
                name = "pay"
                prefix = "/pay"
                url = "http://127.0.0.1:1"
                [[upstreams.routes]]
                path = "/v1/charges"
                max_attempts = {route_attempts}
                "#
            )
        };
        // The defaults (5 attempts) and the most the bound is proven for need no caution.
        let cautions = |t: &str| Config::parse(t).expect("valid").cautions();
        assert!(cautions(&text(5)).is_empty());
        assert!(cautions(&text(SLED_SAFE_ATTEMPTS)).is_empty());
        let c = cautions(&text(SLED_SAFE_ATTEMPTS + 10));
        assert_eq!(c.len(), 1, "{c:?}");
        assert!(c[0].starts_with("upstreams.pay.routes[0]: "), "{c:?}");
        assert!(c[0].contains("allows 60 attempts"), "{c:?}");
        // PostgreSQL keeps records whole, so nothing to say.
        let pg = text(60).replace("path = \"s\"", "backend = \"postgres\"\nurl_env = \"X\"");
        assert!(cautions(&pg).is_empty());
    }

    #[test]
    fn lookup_credentials_come_from_the_environment_and_are_never_printed() {
        let text = |var: &str| {
            format!(
                r#"
                [server]
                [[upstreams]]
                name = "pay"
                prefix = "/pay"
                url = "http://127.0.0.1:1"
                lookup = {{ path = "/v1/x/{{key}}", found = "/id", headers_env = {{ Authorization = "{var}" }} }}
                "#
            )
        };
        let err = Config::parse(&text("ONCEGATE_TEST_UNSET_LOOKUP_VAR"))
            .expect_err("an unset variable is a config error")
            .to_string();
        assert!(
            err.contains("upstreams[0].lookup.headers_env.Authorization"),
            "{err}"
        );
        assert!(err.contains("ONCEGATE_TEST_UNSET_LOOKUP_VAR"), "{err}");

        std::env::set_var("ONCEGATE_TEST_LOOKUP_VAR", "Bearer sk_config_9a2e");
        let c = Config::parse(&text("ONCEGATE_TEST_LOOKUP_VAR")).expect("valid");
        let l = c.upstreams[0].policy.lookup.as_ref().expect("a lookup");
        assert_eq!(l.headers.0.len(), 1);
        assert_eq!(l.headers.0[0].0, "authorization");
        assert_eq!(l.headers.0[0].1, "Bearer sk_config_9a2e");
        assert!(!format!("{c:?}").contains("sk_config_9a2e"));

        std::env::set_var("ONCEGATE_TEST_BAD_LOOKUP_VAR", "line\nbreak sk_bad");
        let err = Config::parse(&text("ONCEGATE_TEST_BAD_LOOKUP_VAR"))
            .expect_err("not a header value")
            .to_string();
        assert!(
            err.contains("not a valid header value") && !err.contains("sk_bad"),
            "{err}"
        );
    }

    #[test]
    fn durations_and_sizes_parse() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86400)));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert_eq!(parse_size("10MiB"), Ok(10 << 20));
        assert_eq!(parse_size("512"), Ok(512));
        assert!(parse_size("1TiB").is_err());
    }

    #[test]
    fn policy_cascades_defaults_upstream_route() {
        let c = Config::parse(
            r#"
            [server]
            [defaults]
            timeout = "10s"
            retries = 1
            [[upstreams]]
            name = "a"
            prefix = "/a"
            url = "http://127.0.0.1:1"
            retries = 3
            [[upstreams.routes]]
            path = "/x"
            max_attempts = 2
            "#,
        )
        .expect("valid");
        let u = &c.upstreams[0];
        assert_eq!(u.policy.timeout, Duration::from_secs(10));
        assert_eq!(u.policy.retries, 3);
        assert_eq!(u.routes[0].policy.retries, 3);
        assert_eq!(u.routes[0].policy.max_attempts, 2);
        assert_eq!(u.policy.max_attempts, 5);
    }
}
