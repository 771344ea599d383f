//! Routing and classification (SPEC §2, §3): which upstream a request goes to, and whether it is a
//! read, a write or denied. Pure functions over the resolved config, table-tested.
//!
//! Paths are normalized first (RFC 3986 §6.2.2: percent-encoded unreserved characters decoded,
//! dot segments removed), and the normalized path is what is routed, classified, fingerprinted
//! and forwarded: an upstream that normalizes would otherwise run `/pay/v1/../admin` as
//! `/admin` while a deny rule saw `/v1/../admin`.

use std::borrow::Cow;
use std::sync::Arc;

use http::{HeaderMap, Method};

use crate::config::{Config, Policy, Upstream};

/// How a request is handled (SPEC §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Read,
    Write,
    Deny,
}

impl Class {
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Read => "read",
            Class::Write => "write",
            Class::Deny => "deny",
        }
    }

    /// The class of a request that no route matched.
    pub fn by_method(m: &Method) -> Class {
        match *m {
            Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE => Class::Read,
            _ => Class::Write,
        }
    }
}

/// A path pattern: `*` matches one segment, `**` any number of segments (zero included), anything
/// else matches literally.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob {
    pattern: String,
    segments: Vec<String>,
}

impl Glob {
    pub fn new(pattern: &str) -> Glob {
        Glob {
            pattern: pattern.to_string(),
            segments: split(pattern).map(str::to_string).collect(),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.pattern
    }

    pub fn matches(&self, path: &str) -> bool {
        let path: Vec<&str> = split(path).collect();
        match_segments(&self.segments, &path)
    }
}

fn split(p: &str) -> impl Iterator<Item = &str> {
    p.split('/').filter(|s| !s.is_empty())
}

fn match_segments(pat: &[String], path: &[&str]) -> bool {
    match pat.split_first() {
        None => path.is_empty(),
        Some((first, rest)) if first == "**" => {
            (0..=path.len()).any(|skip| match_segments(rest, &path[skip..]))
        }
        Some((first, rest)) => match path.split_first() {
            Some((seg, path_rest)) if first == "*" || first == seg => {
                match_segments(rest, path_rest)
            }
            _ => false,
        },
    }
}

/// Where a request goes and how it is treated.
#[derive(Debug, Clone)]
pub struct Target<'a> {
    pub upstream: &'a Arc<Upstream>,
    /// The normalized path after the prefix (`{rest}` in the spec), without the query.
    pub rest: Cow<'a, str>,
    pub class: Class,
    pub policy: &'a Arc<Policy>,
}

/// Why a request cannot be routed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteError {
    /// No upstream prefix matches.
    NoRoute,
    /// The path cannot be normalized safely (400 `bad-request`).
    BadPath(String),
}

/// Headers with which some frameworks tunnel another method through a `GET` or `POST`.
const METHOD_OVERRIDES: [&str; 3] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

/// Whether the path needs any normalizing work: no `%`, `\`, or `.` segment is the common case.
/// One pass over the bytes (every read is routed).
fn is_plain(path: &str) -> bool {
    let dots = |seg: &[u8]| seg == b"." || seg == b"..";
    let b = path.as_bytes();
    let mut start = 0;
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'%' | b'\\' => return false,
            b'/' if dots(&b[start..i]) => return false,
            b'/' => start = i + 1,
            _ => {}
        }
    }
    !dots(&b[start..])
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Decodes percent-encoded unreserved characters (the rest stay encoded, hex upper-cased), and
/// refuses `%00`, `\` and `%5C` anywhere.
fn decode_unreserved(path: &str) -> Result<String, RouteError> {
    let bad = |why: &str| RouteError::BadPath(format!("the path {why}"));
    let b = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => return Err(bad("holds a backslash")),
            b'%' => {
                let hex = |c: Option<&u8>| c.and_then(|c| (*c as char).to_digit(16));
                let (Some(h), Some(l)) = (hex(b.get(i + 1)), hex(b.get(i + 2))) else {
                    return Err(bad("holds a malformed percent-encoding"));
                };
                let byte = (h * 16 + l) as u8;
                match byte {
                    0 => return Err(bad("holds %00")),
                    b'\\' => return Err(bad("holds an encoded backslash (%5C)")),
                    c if unreserved(c) => out.push(c as char),
                    c => out.push_str(&format!("%{c:02X}")),
                }
                i += 3;
            }
            c => {
                // Non-ASCII bytes cannot be here: hyper takes only visible ASCII in a path.
                out.push(c as char);
                i += 1;
            }
        }
    }
    Ok(out)
}

/// Removes dot segments (RFC 3986 §5.2.4) from an absolute path; `None` when a `..` would climb
/// above its start.
fn remove_dots(path: &str) -> Option<String> {
    let mut out: Vec<&str> = Vec::new();
    let segs: Vec<&str> = path.split('/').skip(1).collect();
    for (i, seg) in segs.iter().enumerate() {
        let last = i + 1 == segs.len();
        match *seg {
            "." => {
                if last {
                    out.push("");
                }
            }
            ".." => {
                out.pop()?;
                if last {
                    out.push("");
                }
            }
            s => out.push(s),
        }
    }
    let mut p = String::with_capacity(path.len());
    for s in out {
        p.push('/');
        p.push_str(s);
    }
    if p.is_empty() && path.starts_with('/') {
        p.push('/');
    }
    Some(p)
}

/// The class a request takes from its method and any method-override header: the strictest.
fn strictest(
    upstream: &Upstream,
    method: &Method,
    rest: &str,
    headers: &HeaderMap,
    query: Option<&str>,
) -> (Class, Arc<Policy>) {
    let (mut class, mut policy) = classify(upstream, method, rest);
    let mut named: Vec<Method> = Vec::new();
    for name in METHOD_OVERRIDES {
        for v in headers.get_all(name) {
            // A list (`GET, DELETE`) names each of its methods: the strictest decides.
            let Ok(text) = v.to_str() else {
                named.push(Method::POST);
                continue;
            };
            named.extend(text.split(',').map(method_named));
        }
    }
    named.extend(query_methods(query));
    for m in named {
        let (c, p) = classify(upstream, &m, rest);
        if rank(c) > rank(class) {
            (class, policy) = (c, p);
        }
    }
    (class, policy.clone())
}

/// The method a string names, as the strictest servers read it: trimmed and upper-cased. One
/// that is no method is at least a write.
pub fn method_named(s: &str) -> Method {
    Method::from_bytes(s.trim().to_ascii_uppercase().as_bytes()).unwrap_or(Method::POST)
}

/// Methods a query's `_method` parameters name (Rails, Laravel and others tunnel a method so).
fn query_methods(query: Option<&str>) -> impl Iterator<Item = Method> + '_ {
    query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            k.eq_ignore_ascii_case("_method").then(|| method_named(v))
        })
}

/// Whether a form body tunnels a method (`_method=DELETE`) that a rule denies on this path: a
/// write's body is read after routing, so this is asked then (SPEC §2).
pub fn form_tunnels_denied(upstream: &Upstream, rest: &str, body: &[u8]) -> Option<Method> {
    if !body.windows(7).any(|w| w.eq_ignore_ascii_case(b"_method")) {
        return None;
    }
    let bare = without_params(rest);
    let bare = if bare.is_empty() { "/" } else { &bare };
    form_urlencoded::parse(body)
        .filter(|(k, _)| k.eq_ignore_ascii_case("_method"))
        .map(|(_, v)| method_named(&v))
        .find(|m| classify(upstream, m, bare).0 == Class::Deny)
}

/// Whether a query tunnels a method (`_method=`).
fn tunnels_method(query: Option<&str>) -> bool {
    query_methods(query).next().is_some()
}

/// `rest` with each segment's path parameters (`;x=1`) left out: what a rule's path is matched
/// against, since servers route `admin;x=1` as `admin`.
fn without_params(rest: &str) -> Cow<'_, str> {
    if !rest.contains(';') {
        return Cow::Borrowed(rest);
    }
    Cow::Owned(
        rest.split('/')
            .map(|seg| seg.split(';').next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("/"),
    )
}

fn rank(c: Class) -> u8 {
    match c {
        Class::Read => 0,
        Class::Write => 1,
        Class::Deny => 2,
    }
}

/// Finds the upstream by longest prefix (on a segment boundary: `/pay` matches `/pay` and
/// `/pay/x`, not `/payments`).
pub fn find_upstream<'c, 'p>(
    config: &'c Config,
    path: &'p str,
) -> Option<(&'c Arc<Upstream>, &'p str)> {
    config
        .upstreams
        .iter()
        .filter_map(|u| {
            let rest = path.strip_prefix(u.prefix.as_str())?;
            (rest.is_empty() || rest.starts_with('/') || u.prefix.is_empty()).then_some((u, rest))
        })
        .max_by_key(|(u, _)| u.prefix.len())
}

/// Classifies a request to `upstream`: the first route whose methods and path match decides.
pub fn classify<'a>(
    upstream: &'a Upstream,
    method: &Method,
    rest: &str,
) -> (Class, &'a Arc<Policy>) {
    let rest_for_match = if rest.is_empty() { "/" } else { rest };
    for r in &upstream.routes {
        let method_ok = r.methods.is_empty() || r.methods.contains(method);
        if method_ok && r.path.matches(rest_for_match) {
            return (
                r.class.unwrap_or_else(|| Class::by_method(method)),
                &r.policy,
            );
        }
    }
    (Class::by_method(method), &upstream.policy)
}

/// Normalizes the path, routes and classifies (SPEC §2, §3). A path that climbs above its
/// upstream's prefix, holds `%00`, `\\` or `%5C`, or an encoded slash where the upstream does not
/// allow one, is a [`RouteError::BadPath`]: nothing of it is sent.
pub fn route<'a>(
    config: &'a Config,
    method: &Method,
    path: &'a str,
    query: Option<&str>,
    headers: &HeaderMap,
) -> Result<Target<'a>, RouteError> {
    let (upstream, rest): (&Arc<Upstream>, Cow<'a, str>) = if is_plain(path) {
        let (u, rest) = find_upstream(config, path).ok_or(RouteError::NoRoute)?;
        (u, Cow::Borrowed(rest))
    } else {
        let decoded = decode_unreserved(path)?;
        // The upstream whose prefix the path names; dot segments after it may not leave it.
        let (u, rest) = match find_upstream(config, &decoded) {
            Some((u, rest)) => (u, rest.to_string()),
            None => {
                let whole = remove_dots(&decoded)
                    .ok_or_else(|| RouteError::BadPath("the path climbs above the root".into()))?;
                let (u, rest) = find_upstream(config, &whole).ok_or(RouteError::NoRoute)?;
                (u, rest.to_string())
            }
        };
        let rest = if rest.is_empty() {
            rest
        } else {
            remove_dots(&rest).ok_or_else(|| {
                RouteError::BadPath(format!(
                    "the path climbs above the prefix {} of upstream {}",
                    u.prefix, u.name
                ))
            })?
        };
        if !u.allow_encoded_slash && rest.to_ascii_uppercase().contains("%2F") {
            return Err(RouteError::BadPath(format!(
                "the path holds an encoded slash (%2F), which upstream {} does not allow (allow_encoded_slash)",
                u.name
            )));
        }
        (u, Cow::Owned(rest))
    };
    // Path parameters: a dot segment with one (`..;`) climbs on some servers; the rest are
    // left out of matching (SPEC §2).
    if rest.contains(';')
        && rest.split('/').any(|seg| {
            let bare = seg.split(';').next().unwrap_or("");
            seg.contains(';') && (bare == "." || bare == "..")
        })
    {
        return Err(RouteError::BadPath(
            "the path holds a dot segment with parameters (`..;`), which some servers read as `..`"
                .into(),
        ));
    }
    let bare = without_params(&rest);
    // Methods are matched as the strictest servers read them: without regard to case.
    let upper;
    let method = if method.as_str().bytes().any(|b| b.is_ascii_lowercase()) {
        upper = method_named(method.as_str());
        &upper
    } else {
        method
    };
    // One pass over the names, no hashing: most requests carry no override.
    let has_override = headers
        .keys()
        .any(|k| METHOD_OVERRIDES.contains(&k.as_str()))
        || tunnels_method(query);
    let (class, policy) = if has_override {
        let (c, p) = strictest(upstream, method, &bare, headers, query);
        // The policy of the route that decided; borrowed from the config.
        let p = std::iter::once(&upstream.policy)
            .chain(upstream.routes.iter().map(|r| &r.policy))
            .find(|q| Arc::ptr_eq(q, &p))
            .unwrap_or(&upstream.policy);
        (c, p)
    } else {
        classify(upstream, method, &bare)
    };
    Ok(Target {
        upstream,
        rest,
        class,
        policy,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-pass check says what the plain definition says, for every path made of the
    /// characters that matter, up to five of them.
    #[test]
    fn a_path_is_plain_as_defined() {
        let defined = |p: &str| {
            !p.contains(['%', '\\']) && !p.split('/').any(|seg| seg == "." || seg == "..")
        };
        let alphabet = ['/', '.', 'a', '%', '\\'];
        let mut paths = vec![String::new()];
        for _ in 0..5 {
            let longer: Vec<String> = paths
                .iter()
                .flat_map(|p| alphabet.iter().map(move |c| format!("{p}{c}")))
                .collect();
            paths.extend(longer);
        }
        paths.sort();
        paths.dedup();
        for p in &paths {
            assert_eq!(is_plain(p), defined(p), "{p:?}");
        }
        assert!(is_plain("/v1/charges/ch_1.json"));
        assert!(!is_plain("/v1/../admin"));
    }

    #[test]
    fn globs() {
        let cases = [
            ("/v1/charges", "/v1/charges", true),
            ("/v1/charges", "/v1/charges/", true),
            ("/v1/charges", "/v1/charge", false),
            ("/v1/*", "/v1/charges", true),
            ("/v1/*", "/v1/charges/ch_1", false),
            ("/v1/*", "/v1", false),
            ("/v1/**", "/v1", true),
            ("/v1/**", "/v1/a/b/c", true),
            ("/**/refunds", "/v1/charges/ch_1/refunds", true),
            ("/**/refunds", "/refunds", true),
            ("/**/refunds", "/v1/refund", false),
            ("/v1/*/capture", "/v1/ch_1/capture", true),
            ("/v1/*/capture", "/v1/ch_1/x/capture", false),
            ("/**", "/", true),
        ];
        for (pat, path, want) in cases {
            assert_eq!(Glob::new(pat).matches(path), want, "{pat} vs {path}");
        }
    }

    const TABLE_CONFIG: &str = r#"
        [server]
        [[upstreams]]
        name = "pay"
        prefix = "/pay"
        url = "http://127.0.0.1:1"
        [[upstreams.routes]]
        methods = ["POST"]
        path = "/v1/search/**"
        class = "read"
        [[upstreams.routes]]
        methods = ["DELETE"]
        path = "/v1/customers/*"
        class = "deny"
        [[upstreams.routes]]
        path = "/v1/reports/*"
        class = "write"
        [[upstreams]]
        name = "llm"
        prefix = "/llm"
        url = "http://127.0.0.1:2"
        [[upstreams.routes]]
        methods = ["POST"]
        path = "/v1/chat/completions"
        class = "read"
        [[upstreams]]
        name = "llm-admin"
        prefix = "/llm/admin"
        url = "http://127.0.0.1:3"
    "#;

    #[test]
    fn classification_table() {
        let c = Config::parse(TABLE_CONFIG).expect("table config is valid");
        type Case<'a> = (&'a str, &'a str, Option<(&'a str, Class)>);
        let cases: &[Case] = &[
            ("GET", "/pay/v1/charges", Some(("pay", Class::Read))),
            ("HEAD", "/pay/v1/charges", Some(("pay", Class::Read))),
            ("OPTIONS", "/pay", Some(("pay", Class::Read))),
            ("POST", "/pay/v1/charges", Some(("pay", Class::Write))),
            ("PUT", "/pay/v1/charges/ch_1", Some(("pay", Class::Write))),
            ("PATCH", "/pay/v1/charges/ch_1", Some(("pay", Class::Write))),
            ("POST", "/pay/v1/search/charges", Some(("pay", Class::Read))),
            ("POST", "/pay/v1/search", Some(("pay", Class::Read))),
            ("GET", "/pay/v1/search/x", Some(("pay", Class::Read))),
            (
                "DELETE",
                "/pay/v1/customers/cus_1",
                Some(("pay", Class::Deny)),
            ),
            (
                "DELETE",
                "/pay/v1/customers/cus_1/x",
                Some(("pay", Class::Write)),
            ),
            ("GET", "/pay/v1/reports/r1", Some(("pay", Class::Write))),
            (
                "POST",
                "/llm/v1/chat/completions",
                Some(("llm", Class::Read)),
            ),
            ("POST", "/llm/v1/files", Some(("llm", Class::Write))),
            ("POST", "/llm/admin/keys", Some(("llm-admin", Class::Write))),
            ("GET", "/llmadmin", None),
            ("GET", "/payments", None),
            ("POST", "/other", None),
        ];
        for (m, path, want) in cases {
            let method = Method::from_bytes(m.as_bytes()).expect("method");
            let got = route(&c, &method, path, None, &HeaderMap::new())
                .ok()
                .map(|t| (t.upstream.name.as_str(), t.class));
            assert_eq!(got, *want, "{m} {path}");
        }
    }

    const PATHS_CONFIG: &str = r#"
        [server]
        [[upstreams]]
        name = "pay"
        prefix = "/pay"
        url = "http://127.0.0.1:1"
        [[upstreams.routes]]
        path = "/admin/**"
        class = "deny"
        [[upstreams]]
        name = "openai"
        prefix = "/openai"
        url = "http://127.0.0.1:2/v1"
        [[upstreams]]
        name = "gitlab"
        prefix = "/gitlab"
        url = "http://127.0.0.1:3"
        allow_encoded_slash = true
    "#;

    #[test]
    fn paths_are_normalized_before_routing() {
        let c = Config::parse(PATHS_CONFIG).expect("valid");
        // (path, upstream, normalized rest, class) or the refusal.
        type Want<'a> = Result<(&'a str, &'a str, Class), &'a str>;
        let cases: &[(&str, Want)] = &[
            ("/pay/v1/charges", Ok(("pay", "/v1/charges", Class::Write))),
            ("/pay/%61dmin/x", Ok(("pay", "/admin/x", Class::Deny))),
            ("/pay/v1/../admin/x", Ok(("pay", "/admin/x", Class::Deny))),
            ("/pay/./admin/x", Ok(("pay", "/admin/x", Class::Deny))),
            (
                "/pay/ADMIN/../admin/x",
                Ok(("pay", "/admin/x", Class::Deny)),
            ),
            ("/pay/v1/%2e%2E/admin", Ok(("pay", "/admin", Class::Deny))),
            ("/%70ay/admin/x", Ok(("pay", "/admin/x", Class::Deny))),
            ("/./pay/v1/c", Ok(("pay", "/v1/c", Class::Write))),
            ("/pay/v1/c/.", Ok(("pay", "/v1/c/", Class::Write))),
            ("/pay/v1/a%20b", Ok(("pay", "/v1/a%20b", Class::Write))),
            ("/pay/v1/a%3fb", Ok(("pay", "/v1/a%3Fb", Class::Write))),
            ("/openai/../secret", Err("climbs above the prefix /openai")),
            ("/pay/..", Err("climbs above the prefix /pay")),
            ("/pay/v1/../../x", Err("climbs above the prefix")),
            ("/../pay/x", Err("climbs above the root")),
            ("/pay/v1/a%00b", Err("%00")),
            ("/pay/v1\\a", Err("backslash")),
            ("/pay/v1/a%5cb", Err("encoded backslash")),
            ("/pay/v1/a%2Fb", Err("encoded slash")),
            ("/pay/v1/a%zz", Err("malformed")),
            (
                "/gitlab/projects/a%2Fb/issues",
                Ok(("gitlab", "/projects/a%2Fb/issues", Class::Write)),
            ),
        ];
        for (path, want) in cases {
            let got = route(&c, &Method::POST, path, None, &HeaderMap::new());
            match (got, want) {
                (Ok(t), Ok((u, rest, class))) => {
                    assert_eq!(
                        (t.upstream.name.as_str(), &*t.rest, t.class),
                        (*u, *rest, *class),
                        "{path}"
                    )
                }
                (Err(RouteError::BadPath(why)), Err(part)) => {
                    assert!(why.contains(part), "{path}: {why}")
                }
                (got, want) => panic!("{path}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn a_method_override_classifies_by_the_strictest() {
        let c = Config::parse(PATHS_CONFIG).expect("valid");
        let with = |name: &'static str, v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(name, http::HeaderValue::from_static(v));
            h
        };
        let class = |m: Method, path: &str, h: &HeaderMap| {
            route(&c, &m, path, None, h).expect("routes").class
        };
        assert_eq!(
            class(Method::GET, "/pay/v1/c", &HeaderMap::new()),
            Class::Read
        );
        for name in METHOD_OVERRIDES {
            assert_eq!(
                class(Method::GET, "/pay/v1/c", &with(name, "DELETE")),
                Class::Write,
                "{name}"
            );
        }
        assert_eq!(
            class(
                Method::GET,
                "/pay/v1/c",
                &with("x-http-method-override", "get")
            ),
            Class::Read
        );
        assert_eq!(
            class(
                Method::GET,
                "/pay/v1/c",
                &with("x-http-method", "bogus method")
            ),
            Class::Write
        );
        // An override never makes a write a read.
        assert_eq!(
            class(
                Method::POST,
                "/pay/v1/c",
                &with("x-http-method-override", "GET")
            ),
            Class::Write
        );
        assert_eq!(
            class(
                Method::GET,
                "/pay/admin/x",
                &with("x-method-override", "GET")
            ),
            Class::Deny
        );
    }
}
