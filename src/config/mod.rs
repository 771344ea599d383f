//! Configuration: TOML on disk → validated, fully resolved [`Config`].
//!
//! Parsing is strict (`deny_unknown_fields` everywhere) and fails fast: every error names the key
//! that is wrong, and `main` exits 64 on it. Policy settings cascade `[defaults]` → upstream →
//! route and are merged once here, so the request path never merges anything.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use serde::Deserialize;

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

mod policy;
mod units;
mod upstream;

use policy::header_name;
pub use policy::{ClientKeys, KeyScope, LookupConfig, LookupHeaders, Policy, PolicyOverrides};
pub use units::{parse_duration, parse_size, Dur, Size};
use upstream::{resolve_upstream, RawUpstream};
pub use upstream::{McpRules, NameGlob, Protocol, Route, ToolRule, Upstream};

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
    max_buffered: Option<Size>,
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
    wal_size: Option<Size>,
    reserve: Option<Size>,
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
    compress: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTelemetry {
    otlp_endpoint: Option<String>,
    service_name: Option<String>,
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
    telemetry: RawTelemetry,
    #[serde(default)]
    defaults: PolicyOverrides,
    #[serde(default)]
    upstreams: Vec<RawUpstream>,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub max_body: u64,
    pub max_stored_response: u64,
    /// The bytes of request bodies held in memory at once, all requests together; past it, a
    /// write gets 503 `busy` and nothing is sent.
    pub max_buffered: u64,
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
    /// `wal_size`: how large a write-ahead log file grows before a checkpoint lets it go
    /// (`None`: the store's default, [`crate::store::wal::CHECKPOINT_BYTES`]).
    Sled {
        path: PathBuf,
        wal_size: Option<u64>,
        /// `reserve`: the free space on the store's volume below which writes are refused
        /// (`store-full`) before they are recorded, so that the settlements of writes already
        /// sent still fit.
        reserve: u64,
    },
    /// `path`: this proxy's own state, the last write-log head it saw (SPEC §13 history).
    Postgres { url_env: String, path: PathBuf },
}

#[derive(Debug, Clone)]
pub struct LogConfig {
    pub redact_query: Vec<String>,
    pub redact_headers: Vec<HeaderName>,
    pub hmac_key_env: Option<String>,
    pub retention: Option<Duration>,
    /// `log.compress`: gzip the embedded store's closed write-log files.
    pub compress: bool,
}

/// `[telemetry]`: where spans go (OTLP over HTTP, protobuf), when anywhere.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    /// The collector's base URL (`http://collector:4318`); spans are posted to `/v1/traces`
    /// under it. `None`: no spans are made.
    pub otlp_endpoint: Option<String>,
    pub service_name: String,
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
    pub telemetry: TelemetryConfig,
    pub upstreams: Vec<Arc<Upstream>>,
}

/// The default of `store.reserve`: free space kept on the store's volume for settlements.
pub const DEFAULT_RESERVE: u64 = 1 << 30;

/// The bounds of `store.wal_size`: below, checkpoints (a flush and fsync of the database each)
/// would come every few writes; above, a crash's replay grows long.
const MIN_WAL_SIZE: u64 = 64 << 10;
const MAX_WAL_SIZE: u64 = 1 << 30;

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
            max_buffered: s.max_buffered.map_or(256 << 20, |v| v.0),
            drain_timeout: s.drain_timeout.map_or(Duration::from_secs(30), |v| v.0),
            header_timeout: s.header_timeout.map_or(Duration::from_secs(10), |v| v.0),
            body_timeout: s.body_timeout.map_or(Duration::from_secs(30), |v| v.0),
            max_connections: s.max_connections.unwrap_or(10_000),
            tls: s.tls.clone(),
        };
        if server.max_buffered < server.max_body {
            return Err(invalid(
                "server.max_buffered",
                format!(
                    "must be at least server.max_body ({} bytes): one body must fit",
                    server.max_body
                ),
            ));
        }
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
                let wal_size = self.store.wal_size.map(|s| s.0);
                if let Some(size) = wal_size.filter(|s| !(MIN_WAL_SIZE..=MAX_WAL_SIZE).contains(s))
                {
                    return Err(invalid(
                        "store.wal_size",
                        format!("{size} bytes: expected 64KiB to 1GiB"),
                    ));
                }
                StoreConfig::Sled {
                    path: self
                        .store
                        .path
                        .clone()
                        .unwrap_or_else(|| PathBuf::from("oncegate-data")),
                    wal_size,
                    reserve: self.store.reserve.map_or(DEFAULT_RESERVE, |r| r.0),
                }
            }
            "postgres" => {
                if self.store.wal_size.is_some() {
                    return Err(invalid(
                        "store.wal_size",
                        "only applies to backend = \"sled\"",
                    ));
                }
                if self.store.reserve.is_some() {
                    return Err(invalid(
                        "store.reserve",
                        "only applies to backend = \"sled\"",
                    ));
                }
                StoreConfig::Postgres {
                    path: self
                        .store
                        .path
                        .clone()
                        .unwrap_or_else(|| PathBuf::from("oncegate-data")),
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
                compress: self.log.compress.unwrap_or(false),
            };

        // Every header that carries a credential names the caller (SPEC §4.3): those the
        // proxy knows, and those the operator told it to redact.
        let mut builtin = Policy::builtin();
        for h in &log.redact_headers {
            if !builtin.principal_headers.contains(h) {
                builtin.principal_headers.push(h.clone());
            }
        }
        let defaults = builtin.layer(&self.defaults.overrides(), "defaults.")?;
        let mut upstreams: Vec<Arc<Upstream>> = Vec::new();
        for (i, u) in self.upstreams.iter().enumerate() {
            let wait_set = self.defaults.in_flight_wait.is_some();
            upstreams.push(Arc::new(resolve_upstream(
                u, i, &defaults, wait_set, &upstreams,
            )?));
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
        let telemetry = TelemetryConfig {
            otlp_endpoint: match &self.telemetry.otlp_endpoint {
                None => None,
                Some(url) => {
                    let uri: http::Uri = url
                        .parse()
                        .map_err(|e| invalid("telemetry.otlp_endpoint", format!("{url:?}: {e}")))?;
                    if !matches!(uri.scheme_str(), Some("http") | Some("https"))
                        || uri.host().is_none()
                    {
                        return Err(invalid(
                            "telemetry.otlp_endpoint",
                            format!("{url:?}: expected http://host:port or https://host:port"),
                        ));
                    }
                    Some(url.trim_end_matches('/').to_string())
                }
            },
            service_name: match self.telemetry.service_name.as_deref() {
                Some("") => return Err(invalid("telemetry.service_name", "must not be empty")),
                Some(n) => n.to_string(),
                None => "oncegate".into(),
            },
        };
        Ok(Config {
            server,
            admin,
            store,
            encrypt_key_env: self.store.encrypt_key_env.clone(),
            log,
            telemetry,
            upstreams,
        })
    }
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

    /// SPEC §12: a duplicate of a running MCP tool call waits 10 s for its result by default;
    /// an HTTP route does not wait; a value set in `[defaults]` or on the upstream is kept.
    #[test]
    fn mcp_upstreams_wait_for_a_running_call_by_default() {
        let text = |defaults: &str, upstream: &str| {
            format!(
                "[server]\n[defaults]\n{defaults}\n[[upstreams]]\nname = \"h\"\nprefix = \"/h\"\nurl = \"http://127.0.0.1:1\"\n\
                 [[upstreams]]\nname = \"m\"\nprefix = \"/m\"\nurl = \"http://127.0.0.1:1\"\nprotocol = \"mcp\"\n{upstream}\n"
            )
        };
        let waits = |t: String| -> Vec<u64> {
            Config::parse(&t)
                .expect("valid")
                .upstreams
                .iter()
                .map(|u| u.policy.in_flight_wait.as_secs())
                .collect()
        };
        assert_eq!(waits(text("", "")), [0, 10]);
        assert_eq!(waits(text("in_flight_wait = \"2s\"", "")), [2, 2]);
        assert_eq!(waits(text("", "in_flight_wait = \"0s\"")), [0, 0]);
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
