//! `[[upstreams]]`: an upstream, its routes, resolved from the raw TOML.

use std::path::PathBuf;
use std::sync::Arc;

use http::{Method, Uri};

use super::policy::{lookup, with_policy_keys, LookupConfig, Policy, PolicyOverrides};
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

pub(super) fn resolve_upstream(
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
