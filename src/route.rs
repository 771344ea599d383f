//! Routing and classification (SPEC §2, §3): which upstream a request goes to, and whether it is a
//! read, a write or denied. Pure functions over the resolved config, table-tested.

use std::sync::Arc;

use http::Method;

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
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub upstream: &'a Arc<Upstream>,
    /// The path after the prefix (`{rest}` in the spec), without the query.
    pub rest: &'a str,
    pub class: Class,
    pub policy: &'a Arc<Policy>,
}

/// Finds the upstream by longest prefix (on a segment boundary: `/pay` matches `/pay` and
/// `/pay/x`, not `/payments`).
pub fn find_upstream<'a>(
    config: &'a Config,
    path: &'a str,
) -> Option<(&'a Arc<Upstream>, &'a str)> {
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

/// Routes and classifies in one step. `None`: no upstream prefix matches.
pub fn route<'a>(config: &'a Config, method: &Method, path: &'a str) -> Option<Target<'a>> {
    let (upstream, rest) = find_upstream(config, path)?;
    let (class, policy) = classify(upstream, method, rest);
    Some(Target {
        upstream,
        rest,
        class,
        policy,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
            let got = route(&c, &method, path).map(|t| (t.upstream.name.as_str(), t.class));
            assert_eq!(got, *want, "{m} {path}");
        }
    }
}
