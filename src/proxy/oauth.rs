//! Authorization through the proxy (SPEC §14.6): an MCP server's protected-resource metadata is
//! served at the proxy's own well-known path for the upstream, naming the proxy's URL; its
//! `WWW-Authenticate` challenges point there; and a 2025-03-26 client's fallback paths at the
//! proxy's root reach the server's origin. Tokens pass through as any header does.

use super::*;
use crate::mcp::oauth::{Mount, FALLBACK, PROTECTED_RESOURCE};

/// How long the server's metadata is waited for.
const METADATA_TIMEOUT: Duration = Duration::from_secs(10);

/// What an OAuth path of the proxy names.
pub(super) enum OAuthPath {
    /// The protected-resource metadata of an MCP upstream; the path after its prefix.
    Metadata(Arc<Upstream>, String),
    /// A fallback path at the server's origin (the only or first MCP upstream).
    Fallback(Arc<Upstream>),
}

impl Proxy {
    /// The MCP upstreams, in config order.
    fn mcp_upstreams(&self) -> impl Iterator<Item = &Arc<Upstream>> {
        (self.config.upstreams.iter()).filter(|u| matches!(u.protocol, Protocol::Mcp(_)))
    }

    /// Whether `path` is one of the OAuth paths the proxy answers for an MCP upstream: the
    /// well-known metadata under an MCP upstream's prefix (or at the root, with one MCP
    /// upstream), or a fallback path no upstream's prefix takes.
    pub(super) fn oauth_path(&self, method: &Method, path: &str) -> Option<OAuthPath> {
        if let Some(rest) = path.strip_prefix(PROTECTED_RESOURCE) {
            if rest.is_empty() || rest == "/" {
                let mut mcp = self.mcp_upstreams();
                let (one, more) = (mcp.next()?, mcp.next());
                return more
                    .is_none()
                    .then(|| OAuthPath::Metadata(one.clone(), String::new()));
            }
            return self
                .mcp_upstreams()
                .filter_map(|u| {
                    let prefix = u.prefix.trim_end_matches('/');
                    let after = rest.strip_prefix(prefix)?;
                    (after.is_empty() || after.starts_with('/')).then_some((u, after))
                })
                .max_by_key(|(u, _)| u.prefix.len())
                .map(|(u, after)| OAuthPath::Metadata(u.clone(), after.to_string()));
        }
        if FALLBACK.contains(&path)
            && route(&self.config, method, path, None, &HeaderMap::new()).is_err()
        {
            return self
                .mcp_upstreams()
                .next()
                .map(|u| OAuthPath::Fallback(u.clone()));
        }
        None
    }

    /// Answers an OAuth path ([`Proxy::oauth_path`]).
    pub(super) async fn oauth(
        &self,
        at: OAuthPath,
        req: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let origin = self.origin_of(&req);
        match at {
            OAuthPath::Fallback(up) => {
                let path = req
                    .uri()
                    .path_and_query()
                    .map_or("/", |p| p.as_str())
                    .to_string();
                let (parts, body) = req.into_parts();
                let out =
                    Outgoing::at_origin(&up, &parts.method, parts.headers, &path).map_err(|e| {
                        ProxyError::BadRequest(format!("cannot build the request: {e}"))
                    })?;
                let resp = self
                    .upstreams
                    .forward_read(&up, &up.policy, out, body)
                    .await
                    .map_err(|e| ProxyError::UpstreamFailed(format!("{e:?}")))?;
                Ok(resp.map(|b| b.map_err(Into::into).boxed_unsync()))
            }
            OAuthPath::Metadata(up, rest) => {
                let url = up.url.to_string();
                let m = Mount {
                    url: &url,
                    prefix: &up.prefix,
                };
                let headers = req.headers().clone();
                let mut got = None;
                // Where the server said its metadata is (its challenge), else where RFC 9728
                // puts it: under the resource's path, then at the root.
                let named = self
                    .metadata_paths
                    .lock()
                    .ok()
                    .and_then(|m| m.get(&up.name).cloned());
                let at_origin = |url: String| {
                    url.find("://")
                        .and_then(|i| url[i + 3..].find('/').map(|j| url[i + 3 + j..].to_string()))
                        .unwrap_or_else(|| "/".into())
                };
                let places = named.into_iter().chain([
                    at_origin(m.metadata_at(&rest)),
                    at_origin(m.root_metadata()),
                ]);
                for path in places {
                    let out = Outgoing::at_origin(&up, &Method::GET, headers.clone(), &path)
                        .map_err(|e| {
                            ProxyError::BadRequest(format!("cannot build the request: {e}"))
                        })?;
                    let (head, body) = self
                        .upstreams
                        .fetch(&up, &up.policy, &out, METADATA_TIMEOUT)
                        .await
                        .map_err(ProxyError::UpstreamFailed)?;
                    let found = head.status.is_success();
                    got = Some((head, body));
                    if found {
                        break;
                    }
                }
                let (head, body) = got.expect("at least two places");
                let body = match (&origin, head.status.is_success()) {
                    (Some(origin), true) => {
                        m.metadata(&body, origin).map(Bytes::from).unwrap_or(body)
                    }
                    _ => body,
                };
                let mut resp = Response::new(crate::upstream::full(body));
                *resp.status_mut() = head.status;
                for name in [http::header::CONTENT_TYPE, http::header::CACHE_CONTROL] {
                    if let Some(v) = head.headers.get(&name) {
                        resp.headers_mut().insert(name, v.clone());
                    }
                }
                Ok(resp)
            }
        }
    }

    /// The proxy's origin as the client called it (`http://127.0.0.1:8080`), from its `Host`.
    pub(super) fn origin_of<B>(&self, req: &Request<B>) -> Option<String> {
        self.origin(host_of(req).as_ref())
    }

    fn origin(&self, host: Option<&HeaderValue>) -> Option<String> {
        let host = host?.to_str().ok()?;
        let scheme = if self.config.server.tls.is_some() {
            "https"
        } else {
            "http"
        };
        Some(format!("{scheme}://{host}"))
    }

    /// An MCP upstream's answer with its `WWW-Authenticate` challenge pointing at the proxy's
    /// metadata for the upstream instead of the server's; where the server's is, is kept.
    pub(super) fn name_our_metadata(
        &self,
        up: &Upstream,
        host: Option<&HeaderValue>,
        resp: &mut Response<ProxyBody>,
    ) {
        // Almost every answer has no challenge: the origin is made only for one that has.
        if !resp.headers().contains_key(http::header::WWW_AUTHENTICATE) {
            return;
        }
        let Some(origin) = self.origin(host) else {
            return;
        };
        let origin = origin.as_str();
        let url = up.url.to_string();
        let m = Mount {
            url: &url,
            prefix: &up.prefix,
        };
        let values: Vec<HeaderValue> = resp
            .headers()
            .get_all(http::header::WWW_AUTHENTICATE)
            .iter()
            .map(|v| {
                let Some((ours, at)) = v.to_str().ok().and_then(|s| m.challenge(s, origin)) else {
                    return v.clone();
                };
                if let Ok(mut paths) = self.metadata_paths.lock() {
                    paths.insert(up.name.clone(), at);
                }
                HeaderValue::from_str(&ours).unwrap_or_else(|_| v.clone())
            })
            .collect();
        if values.is_empty() {
            return;
        }
        resp.headers_mut().remove(http::header::WWW_AUTHENTICATE);
        for v in values {
            resp.headers_mut().append(http::header::WWW_AUTHENTICATE, v);
        }
    }
}

/// The `Host` a request names (or its URI's authority, over HTTP/2): kept before the request is
/// taken apart, a cheap clone.
pub(super) fn host_of<B>(req: &Request<B>) -> Option<HeaderValue> {
    req.headers().get(http::header::HOST).cloned().or_else(|| {
        req.uri()
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    })
}
