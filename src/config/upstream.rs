//! `[[upstreams]]`: an upstream, its routes, resolved from the raw TOML.

use std::path::PathBuf;
use std::sync::Arc;

use http::{Method, Uri};

use super::policy::{lookup, with_policy_keys, KeyScope, LookupConfig, Policy, PolicyOverrides};
use super::{invalid, ConfigError, Dur};

use crate::route::{Class, Glob};

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
        protocol: Option<String>,
        trust_annotations: Option<bool>,
        tools: Option<Vec<RawTool>>,
        allowed_origins: Option<Vec<String>>,
    }
}

with_policy_keys! {
    /// One `[[upstreams.tools]]` entry of an MCP upstream (SPEC §14.1).
    pub struct RawTool {
        name: String,
        class: Option<String>,
        lookup: Option<LookupConfig>,
        key_scope: Option<String>,
    }
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
    /// For a plain-HTTP upstream (always HTTP/1), the `Host` header its requests carry, made
    /// once: its host, and its port unless 80. `None` for HTTPS: the connection's protocol is
    /// known only after ALPN, and HTTP/2 carries the authority as `:authority`, not `Host`; the
    /// client sets `Host` on an HTTP/1 one.
    pub host: Option<http::HeaderValue>,
    pub ca_file: Option<PathBuf>,
    /// Paths may carry `%2F` inside a segment (APIs such as GitLab's); refused otherwise.
    pub allow_encoded_slash: bool,
    /// The upstream-level policy, used when no route matches.
    pub policy: Arc<Policy>,
    pub routes: Vec<Route>,
    /// What the upstream speaks: plain HTTP, classified by routes, or MCP, by its messages.
    pub protocol: Protocol,
}

/// The protocol an upstream speaks (`protocol`).
#[derive(Debug, Clone)]
pub enum Protocol {
    Http,
    Mcp(McpRules),
}

/// How an MCP upstream's tool calls are classified (SPEC §14.1).
#[derive(Debug, Clone)]
pub struct McpRules {
    /// `[[upstreams.tools]]`, in order: the first whose name glob matches decides.
    pub tools: Vec<ToolRule>,
    /// Tools the server's own `tools/list` marks `readOnlyHint: true` are reads.
    pub trust_annotations: bool,
    /// Web origins whose pages may reach the server (SPEC §14.6); others are refused.
    pub allowed_origins: Vec<String>,
}

/// One tool rule, resolved.
#[derive(Debug, Clone)]
pub struct ToolRule {
    pub name: NameGlob,
    pub class: Class,
    pub policy: Arc<Policy>,
}

/// A glob over a tool name: `*` stands for any run of characters, everything else for itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameGlob(String);

impl NameGlob {
    pub fn new(pattern: &str) -> NameGlob {
        NameGlob(pattern.to_string())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `loose` (a name trimmed and lower-cased) matches the pattern lower-cased.
    pub fn matches_loosely(&self, loose: &str) -> bool {
        NameGlob(self.0.trim().to_lowercase()).matches(loose)
    }

    pub fn matches(&self, name: &str) -> bool {
        let mut parts = self.0.split('*');
        let first = parts.next().unwrap_or("");
        let Some(mut rest) = name.strip_prefix(first) else {
            return false;
        };
        let parts: Vec<&str> = parts.collect();
        let Some((last, middle)) = parts.split_last() else {
            return rest.is_empty();
        };
        for p in middle {
            match rest.find(p) {
                Some(i) => rest = &rest[i + p.len()..],
                None => return false,
            }
        }
        rest.len() >= last.len() && rest.ends_with(last)
    }
}

impl McpRules {
    /// The rule for a tool, if one matches: the first in order. A `deny` or `write` rule also
    /// matches a name that differs only by case or surrounding white space (`Delete_all`,
    /// ` delete_all`), so that such a name cannot slip past it; a `read` rule matches exactly
    /// (SPEC §14.1).
    pub fn rule(&self, tool: &str) -> Option<&ToolRule> {
        let loose = tool.trim().to_lowercase();
        self.tools.iter().find(|r| {
            r.name.matches(tool) || (r.class != Class::Read && r.name.matches_loosely(&loose))
        })
    }
}

fn class(v: Option<&str>, key: String) -> Result<Option<Class>, ConfigError> {
    match v {
        None => Ok(None),
        Some("read") => Ok(Some(Class::Read)),
        Some("write") => Ok(Some(Class::Write)),
        Some("deny") => Ok(Some(Class::Deny)),
        Some(other) => Err(invalid(
            key,
            format!("{other:?}: expected \"read\", \"write\" or \"deny\""),
        )),
    }
}

fn resolve_tools(u: &RawUpstream, at: &str, policy: &Policy) -> Result<Protocol, ConfigError> {
    match u.protocol.as_deref() {
        None | Some("http") => {
            let mcp_only = [
                ("tools", u.tools.is_some()),
                ("trust_annotations", u.trust_annotations.is_some()),
                ("allowed_origins", u.allowed_origins.is_some()),
            ];
            if let Some((key, _)) = mcp_only.iter().find(|(_, set)| *set) {
                return Err(invalid(
                    format!("{at}{key}"),
                    "applies to MCP upstreams only: set protocol = \"mcp\"",
                ));
            }
            Ok(Protocol::Http)
        }
        Some("mcp") => {
            if u.routes.is_some() {
                return Err(invalid(
                    format!("{at}routes"),
                    "an MCP upstream is classified by its messages: write [[upstreams.tools]] rules instead",
                ));
            }
            let mut tools = Vec::new();
            for (j, t) in u.tools.iter().flatten().enumerate() {
                let tat = format!("{at}tools[{j}].");
                if t.name.is_empty() || t.name.contains(['?', '[', ']', '{', '}']) {
                    return Err(invalid(
                        format!("{tat}name"),
                        format!(
                            "{:?}: a tool name glob is the name, with `*` for any run of characters",
                            t.name
                        ),
                    ));
                }
                let class = class(t.class.as_deref(), format!("{tat}class"))?.ok_or_else(|| {
                    invalid(
                        format!("{tat}class"),
                        "is required: \"read\", \"write\" or \"deny\"",
                    )
                })?;
                let mut tp = policy.layer(&t.overrides(), &tat)?;
                if let Some(l) = &t.lookup {
                    tp.lookup = Some(lookup(l, &format!("{tat}lookup"))?);
                }
                if let Some(scope) = &t.key_scope {
                    tp.key_scope = KeyScope::parse(scope).ok_or_else(|| {
                        invalid(
                            format!("{tat}key_scope"),
                            format!("{scope:?}: expected \"arguments\", \"session\" or \"call\""),
                        )
                    })?;
                }
                tools.push(ToolRule {
                    name: NameGlob::new(&t.name),
                    class,
                    policy: Arc::new(tp),
                });
            }
            let allowed_origins = u.allowed_origins.clone().unwrap_or_default();
            if let Some(bad) = allowed_origins
                .iter()
                .find(|o| !crate::mcp::origin::is_origin(o))
            {
                return Err(invalid(
                    format!("{at}allowed_origins"),
                    format!("{bad:?}: an origin is `http://` or `https://`, a lowercase host and an optional port, nothing after"),
                ));
            }
            Ok(Protocol::Mcp(McpRules {
                tools,
                trust_annotations: u.trust_annotations.unwrap_or(false),
                allowed_origins,
            }))
        }
        Some(other) => Err(invalid(
            format!("{at}protocol"),
            format!("{other:?}: expected \"http\" or \"mcp\""),
        )),
    }
}

impl Upstream {
    /// The base path of the upstream URL without a trailing slash (`""` for none).
    pub fn base_path(&self) -> &str {
        self.url.path().trim_end_matches('/')
    }
}

/// How long a duplicate of a running MCP tool call waits for its result by default (SPEC §12):
/// two identical calls at once (a client's resend while the first runs) both get the result,
/// rather than the second a `409 in-flight` error a model would read as a failure.
pub const MCP_IN_FLIGHT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// `defaults_wait`: whether `[defaults]` set `in_flight_wait` (else MCP upstreams wait
/// [`MCP_IN_FLIGHT_WAIT`]).
pub(super) fn resolve_upstream(
    u: &RawUpstream,
    i: usize,
    defaults: &Policy,
    defaults_wait: bool,
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
    let mut policy = match (u.protocol.as_deref(), defaults_wait) {
        (Some("mcp"), false) => Policy {
            in_flight_wait: MCP_IN_FLIGHT_WAIT,
            ..defaults.clone()
        }
        .layer(&u.overrides(), &at)?,
        _ => defaults.layer(&u.overrides(), &at)?,
    };
    if let Some(l) = &u.lookup {
        policy.lookup = Some(lookup(l, &format!("{at}lookup"))?);
    }
    let protocol = resolve_tools(u, &at, &policy)?;
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
        let class = class(r.class.as_deref(), format!("{rat}class"))?;
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
    let host = match url.scheme_str() {
        Some("http") => {
            Some(host_header(&url).ok_or_else(|| invalid(format!("{at}url"), "has no host"))?)
        }
        _ => None,
    };
    Ok(Upstream {
        name: u.name.clone(),
        label: crate::metrics::intern(&u.name),
        prefix: prefix.to_string(),
        host,
        url,
        ca_file: u.ca_file.clone(),
        allow_encoded_slash: u.allow_encoded_slash.unwrap_or(false),
        policy: Arc::new(policy),
        routes,
        protocol,
    })
}

/// The `Host` header for `url`, as an HTTP client derives it: the host, with the port only
/// where it is not the scheme's default.
fn host_header(url: &Uri) -> Option<http::HeaderValue> {
    let host = url.host()?;
    let default = match url.scheme_str() {
        Some("https") => 443,
        _ => 80,
    };
    let text = match url.port_u16() {
        Some(p) if p != default => format!("{host}:{p}"),
        _ => host.to_string(),
    };
    http::HeaderValue::from_str(&text).ok()
}

#[cfg(test)]
mod tests {
    use super::NameGlob;

    #[test]
    fn host_headers() {
        let cases = [
            ("http://127.0.0.1:8080/v1", "127.0.0.1:8080"),
            ("http://api.example.com", "api.example.com"),
            ("http://api.example.com:80", "api.example.com"),
            ("https://api.example.com:443/x", "api.example.com"),
            ("https://api.example.com:8443", "api.example.com:8443"),
            ("http://[::1]:9000", "[::1]:9000"),
        ];
        for (url, want) in cases {
            let got = super::host_header(&url.parse().expect("a URL"));
            assert_eq!(
                got.as_ref().map(|v| v.to_str().ok()),
                Some(Some(want)),
                "{url}"
            );
        }
    }

    #[test]
    fn name_globs() {
        let g = |p: &str, n: &str| NameGlob::new(p).matches(n);
        assert!(g("send_email", "send_email"));
        assert!(!g("send_email", "send_emails"));
        assert!(g("*", "anything"));
        assert!(g("get_*", "get_weather"));
        assert!(!g("get_*", "forget_it"));
        assert!(g("*_delete", "user_delete"));
        assert!(g("a*b*c", "aXbYc"));
        assert!(g("a*b*c", "abc"));
        assert!(!g("a*b*c", "acb"));
        assert!(!g("ab*ba", "aba"));
        assert!(g("stripe.*", "stripe.charge"));
    }
}
