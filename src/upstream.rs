//! Talking to upstreams: the hyper-util client with rustls, transparency (hop-by-hop handling,
//! `Host`, `Via`), timeouts, and proxy-side tries of failures that certainly did not reach the
//! upstream (SPEC §2, §6).

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

use crate::action::{now_millis, Phase, Try, EVIDENCE_BODY_MAX};
use crate::config::{Config, Policy, Upstream};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body type of everything the proxy sends or answers.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

type HttpClient = Client<HttpsConnector<HttpConnector>, ProxyBody>;

pub fn full(b: impl Into<Bytes>) -> ProxyBody {
    http_body_util::Full::new(b.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// An empty body. `Empty` has no size, so boxing it allocates nothing.
pub fn empty() -> ProxyBody {
    http_body_util::Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1).
pub fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// Whether a header is the proxy's own (`Oncegate-*`), which it takes from neither side: a
/// client's would steer what the proxy sends upstream; an upstream's would speak for the proxy
/// to its client (an `Oncegate-Outcome: replayed` on a read) and be counted in its metrics.
pub fn is_ours(name: &str) -> bool {
    name.starts_with("oncegate-")
}

/// Removes what the proxy does not pass on, in either direction: hop-by-hop headers, every
/// header named in `Connection`, and the proxy's own `Oncegate-*` headers.
pub fn strip_not_forwarded(headers: &mut HeaderMap) {
    let dropped = |k: &HeaderName| is_hop_by_hop(k.as_str()) || is_ours(k.as_str());
    // Most messages carry none: one pass over the names (no hashing) settles it.
    if !headers.keys().any(dropped) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
    let gone: Vec<HeaderName> = headers.keys().filter(|k| dropped(k)).cloned().collect();
    for h in gone {
        headers.remove(h);
    }
}

/// The upstream clients, one per upstream and connect timeout; looked up for every request
/// ([`crate::FastMap`]).
pub struct Upstreams {
    /// By upstream name, then connect timeout (an upstream has one or a few): looked up by
    /// `&str`, so that a request allocates nothing to find its client.
    clients: crate::FastMap<String, Vec<(Duration, HttpClient)>>,
}

fn tls_config(up: &Upstream) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(ca) = &up.ca_file {
        let certs = CertificateDer::pem_file_iter(ca)
            .map_err(|e| format!("upstream {}: ca_file {}: {e}", up.name, ca.display()))?;
        let mut n = 0;
        for c in certs {
            let c =
                c.map_err(|e| format!("upstream {}: ca_file {}: {e}", up.name, ca.display()))?;
            roots
                .add(c)
                .map_err(|e| format!("upstream {}: ca_file {}: {e}", up.name, ca.display()))?;
            n += 1;
        }
        if n == 0 {
            return Err(format!(
                "upstream {}: ca_file {} holds no certificate",
                up.name,
                ca.display()
            ));
        }
    }
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())
        .map(|b| b.with_root_certificates(roots).with_no_client_auth())
}

impl Upstreams {
    pub fn new(config: &Config) -> Result<Upstreams, String> {
        let mut clients = crate::FastMap::default();
        for up in &config.upstreams {
            let tls = tls_config(up)?;
            let timeouts = std::iter::once(up.policy.connect_timeout)
                .chain(up.routes.iter().map(|r| r.policy.connect_timeout));
            for ct in timeouts {
                let those: &mut Vec<(Duration, HttpClient)> =
                    clients.entry(up.name.clone()).or_default();
                if those.iter().any(|(t, _)| *t == ct) {
                    continue;
                }
                let mut http = HttpConnector::new();
                http.enforce_http(false);
                http.set_connect_timeout(Some(ct));
                http.set_nodelay(true);
                let https = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_tls_config(tls.clone())
                    .https_or_http()
                    .enable_http1()
                    .enable_http2()
                    .wrap_connector(http);
                let client = Client::builder(TokioExecutor::new())
                    .timer(TokioTimer::new())
                    .pool_timer(TokioTimer::new())
                    .pool_idle_timeout(Duration::from_secs(60))
                    .build(https);
                those.push((ct, client));
            }
        }
        Ok(Upstreams { clients })
    }

    fn client(&self, up: &Upstream, policy: &Policy) -> &HttpClient {
        self.clients
            .get(up.name.as_str())
            .and_then(|those| {
                those
                    .iter()
                    .find(|(t, _)| *t == policy.connect_timeout)
                    .map(|(_, c)| c)
            })
            .expect("a client exists for every upstream and route connect_timeout")
    }
}

/// The head of a request to send upstream, reusable across tries.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub method: Method,
    pub uri: Uri,
    pub headers: HeaderMap,
}

impl Outgoing {
    /// Builds the upstream request head from the client's (SPEC §2): hop-by-hop headers and
    /// `Oncegate-*` removed, `Host` the upstream's, `Via` added, the key header set last.
    pub fn new(
        up: &Upstream,
        method: &Method,
        client_headers: &HeaderMap,
        rest: &str,
        query: Option<&str>,
        key: Option<(&HeaderName, &str)>,
    ) -> Result<Outgoing, http::Error> {
        Self::from_owned(up, method, client_headers.clone(), rest, query, key)
    }

    /// Like [`Outgoing::new`], taking the client's headers (a read has no further use for them).
    pub fn from_owned(
        up: &Upstream,
        method: &Method,
        mut headers: HeaderMap,
        rest: &str,
        query: Option<&str>,
        key: Option<(&HeaderName, &str)>,
    ) -> Result<Outgoing, http::Error> {
        strip_not_forwarded(&mut headers);
        // `Host` is the upstream's: made once with the config for a plain-HTTP one (the client
        // would format it for every request), set by the client on an HTTPS one's HTTP/1
        // connections.
        match &up.host {
            Some(host) => headers.insert(header::HOST, host.clone()),
            None => headers.remove(header::HOST),
        };
        headers.append(header::VIA, HeaderValue::from_static("1.1 oncegate"));
        if let Some((name, value)) = key {
            headers.insert(name.clone(), HeaderValue::from_str(value)?);
        }
        let base = up.base_path();
        let mut path =
            String::with_capacity(base.len() + rest.len() + query.map_or(0, |q| q.len() + 1) + 1);
        path.push_str(base);
        path.push_str(rest);
        if path.is_empty() {
            path.push('/');
        }
        if let Some(q) = query {
            path.push('?');
            path.push_str(q);
        }
        // The upstream's scheme and authority were parsed with the config: shared, not parsed
        // again for every request.
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(up.url.scheme().cloned().unwrap_or(http::uri::Scheme::HTTP));
        parts.authority = up.url.authority().cloned();
        parts.path_and_query = Some(http::uri::PathAndQuery::from_maybe_shared(Bytes::from(
            path,
        ))?);
        let uri = Uri::from_parts(parts)?;
        Ok(Outgoing {
            method: method.clone(),
            uri,
            headers,
        })
    }

    /// A request to `path_and_query` at the upstream's origin, outside its base path (an MCP
    /// server's OAuth metadata, SPEC §14.6), with the client's headers as a read sends them.
    pub fn at_origin(
        up: &Upstream,
        method: &Method,
        headers: HeaderMap,
        path_and_query: &str,
    ) -> Result<Outgoing, http::Error> {
        let mut out = Self::from_owned(up, method, headers, "", None, None)?;
        let uri = out.uri.clone().into_parts();
        let mut parts = http::uri::Parts::default();
        parts.scheme = uri.scheme;
        parts.authority = uri.authority;
        parts.path_and_query = Some(path_and_query.parse()?);
        out.uri = Uri::from_parts(parts)?;
        Ok(out)
    }

    fn request(&self, body: ProxyBody) -> Request<ProxyBody> {
        self.clone().into_request(body)
    }

    /// The request of the last try: the head moves instead of being copied.
    fn into_request(self, body: ProxyBody) -> Request<ProxyBody> {
        let mut req = Request::new(body);
        *req.method_mut() = self.method;
        *req.uri_mut() = self.uri;
        *req.headers_mut() = self.headers;
        req
    }
}

/// A request body that can be handed to several tries but read by at most one: a try that fails
/// to connect never polls it, so the next try can still stream it. Reads stay unbuffered.
struct TakeOnce<B> {
    slot: Arc<Mutex<Option<B>>>,
    taken: Option<B>,
    hint: SizeHint,
}

impl<B> Body for TakeOnce<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.taken.is_none() {
            let body = self.slot.lock().ok().and_then(|mut s| s.take());
            match body {
                Some(b) => self.taken = Some(b),
                None => return Poll::Ready(Some(Err("request body already consumed".into()))),
            }
        }
        let body = self.taken.as_mut().expect("set above");
        Pin::new(body).poll_frame(cx).map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.hint.exact() == Some(0)
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

/// A response body fed by the task that reads the upstream (a relayed SSE stream): the client's
/// going away drops the receiver, never the upstream exchange.
pub struct ChannelBody(pub tokio::sync::mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

/// How forwarding a read ended badly.
#[derive(Debug)]
pub enum ReadFailure {
    /// Nothing reached the upstream, after all tries.
    Unreachable(String),
    /// No response head in time.
    Timeout(Duration),
    /// The exchange failed after the request may have been sent.
    Failed(String),
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

/// Delay before try `n + 1`: exponential from 100 ms with full jitter, at most `cap`.
fn backoff(n: u32, cap: Duration) -> Duration {
    let exp = Duration::from_millis(100u64.saturating_mul(1 << n.min(16))).min(cap);
    exp.mul_f64(rand::random::<f64>())
}

/// A `Retry-After` in seconds (the HTTP-date form is rarely sent by APIs; it counts as absent).
fn retry_after(h: &HeaderMap) -> Option<Duration> {
    let v = h.get(header::RETRY_AFTER)?.to_str().ok()?;
    v.trim().parse::<u64>().ok().map(Duration::from_secs)
}

fn request_id(h: &HeaderMap) -> Option<String> {
    ["request-id", "x-request-id"]
        .iter()
        .find_map(|n| h.get(*n))
        .and_then(|v| v.to_str().ok())
        .map(|s| s.chars().take(200).collect())
}

fn excerpt(b: &[u8]) -> Option<String> {
    (!b.is_empty())
        .then(|| String::from_utf8_lossy(&b[..b.len().min(EVIDENCE_BODY_MAX)]).into_owned())
}

/// The upstream's answer to one attempt, with its body read up to a limit.
pub struct Answer {
    pub head: http::response::Parts,
    /// The body, or its first `limit` bytes when `rest` is set.
    pub body: Bytes,
    /// The unread remainder of a body larger than the limit.
    pub rest: Option<Incoming>,
}

/// How one attempt of a write ended.
pub enum AttemptResult {
    /// The upstream answered.
    Answered(Answer),
    /// Nothing reached the upstream, after all tries.
    Unreachable(String),
    /// A try was not sent: the action is no longer this attempt's (a lost lease, a takeover;
    /// SPEC §13 fencing). Nothing this attempt sent was applied: its earlier tries, if any, did
    /// not connect or were answered with a `retry_statuses` status.
    Abandoned(String),
    /// The request was, or may have been, sent and no complete answer came back.
    Lost { phase: Phase, error: String },
    /// No response head within the timeout to a request whose answer is relayed (MCP): the
    /// exchange is handed over still open, since closing it could cancel a call already running.
    Quiet {
        error: String,
        pending: hyper_util::client::legacy::ResponseFuture,
    },
    /// An SSE answer, left unread for the caller to relay event by event (MCP, SPEC §14.3).
    Streaming {
        head: http::response::Parts,
        body: Incoming,
    },
}

/// Why a try may not leave (SPEC §13, fencing).
#[derive(Debug)]
pub enum Unfenced {
    /// The action is no longer this attempt's: nothing more of it is sent, nothing recorded.
    Lost(String),
    /// The store could not record the try as sending: it is not sent, and the attempt ends as
    /// one that reached nothing.
    Unrecorded(String),
}

/// Whether a response head announces an SSE stream.
pub fn is_event_stream(h: &HeaderMap) -> bool {
    h.get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("text/event-stream"))
}

impl Upstreams {
    /// Forwards a read, streaming both ways. Tries again when a try certainly did not reach the
    /// upstream and the body was not consumed, or on a `retry_statuses` answer to a bodiless read.
    pub async fn forward_read<B>(
        &self,
        up: &Upstream,
        policy: &Policy,
        out: Outgoing,
        body: B,
    ) -> Result<Response<Incoming>, ReadFailure>
    where
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<BoxError>,
    {
        let client = self.client(up, policy);
        let hint = body.size_hint();
        let bodiless = hint.exact() == Some(0);
        // A body is handed to each try through a slot that the try reading it empties; a
        // bodiless read (most are) needs none: each try gets an empty body, which allocates
        // nothing.
        let slot = (!bodiless).then(|| Arc::new(Mutex::new(Some(body))));
        let mut out = Some(out);
        let mut n = 0;
        loop {
            let b = match &slot {
                None => empty(),
                Some(slot) => TakeOnce {
                    slot: slot.clone(),
                    taken: None,
                    hint,
                }
                .boxed_unsync(),
            };
            let last = n >= policy.retries;
            let req = if last {
                out.take()
                    .expect("the head is kept until the last try")
                    .into_request(b)
            } else {
                out.as_ref()
                    .expect("the head is kept until the last try")
                    .request(b)
            };
            match tokio::time::timeout(policy.timeout, client.request(req)).await {
                Err(_) => return Err(ReadFailure::Timeout(policy.timeout)),
                Ok(Err(e)) if e.is_connect() => {
                    let unread = slot
                        .as_ref()
                        .is_none_or(|s| s.lock().map(|s| s.is_some()).unwrap_or(false));
                    if last || !unread {
                        return Err(ReadFailure::Unreachable(error_chain(&e)));
                    }
                    tracing::debug!(error = %error_chain(&e), try_n = n, "read: connect failed, trying again");
                }
                Ok(Err(e)) => return Err(ReadFailure::Failed(error_chain(&e))),
                Ok(Ok(resp)) => {
                    if last || !bodiless || !policy.retry_statuses.contains(&resp.status()) {
                        return Ok(resp);
                    }
                    match retry_after(resp.headers()) {
                        Some(d) if d > policy.max_retry_wait => return Ok(resp),
                        Some(d) => tokio::time::sleep(d).await,
                        None => tokio::time::sleep(backoff(n, policy.max_retry_wait)).await,
                    }
                    n += 1;
                    continue;
                }
            }
            tokio::time::sleep(backoff(n, policy.max_retry_wait)).await;
            n += 1;
        }
    }

    /// Sends one attempt of a write. Only tries that certainly did not reach the upstream
    /// (connect failures) and `retry_statuses` answers are tried again; every try is returned as
    /// evidence. The body of the answer is read up to `limit` bytes within the timeout, unless
    /// `relay` is set and the answer is a successful SSE stream: that is left to the caller.
    #[allow(clippy::too_many_arguments)]
    #[allow(clippy::too_many_arguments)]
    pub async fn send_write<F, Fut>(
        &self,
        up: &Upstream,
        policy: &Policy,
        out: &Outgoing,
        body: Bytes,
        limit: u64,
        relay: bool,
        tries: &mut Vec<Try>,
        mut fence: F,
    ) -> AttemptResult
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<(), Unfenced>>,
    {
        let client = self.client(up, policy);
        let mut n = 0;
        loop {
            // Each try is the attempt's own only while the store says so (SPEC §13).
            match fence().await {
                Ok(()) => {}
                Err(Unfenced::Lost(why)) => return AttemptResult::Abandoned(why),
                Err(Unfenced::Unrecorded(why)) => {
                    tries.push(Try {
                        at: now_millis(),
                        error: Some(why.clone()),
                        ..Try::default()
                    });
                    return AttemptResult::Unreachable(why);
                }
            }
            let last = n >= policy.retries;
            let started = tokio::time::Instant::now();
            let deadline = started + policy.timeout;
            let at = now_millis();
            let req = out.request(full(body.clone()));
            let mut pending = client.request(req);
            let resp = match tokio::time::timeout_at(deadline, &mut pending).await {
                Err(_) => {
                    let error = format!("no response within {:?}", policy.timeout);
                    tries.push(Try {
                        at,
                        phase: Some(Phase::Response),
                        error: Some(error.clone()),
                        ..Try::default()
                    });
                    if relay {
                        return AttemptResult::Quiet { error, pending };
                    }
                    return AttemptResult::Lost {
                        phase: Phase::Response,
                        error,
                    };
                }
                Ok(Err(e)) if e.is_connect() => {
                    let error = error_chain(&e);
                    tries.push(Try {
                        at,
                        phase: Some(Phase::Connect),
                        error: Some(error.clone()),
                        ..Try::default()
                    });
                    if last {
                        return AttemptResult::Unreachable(error);
                    }
                    tokio::time::sleep(backoff(n, policy.max_retry_wait)).await;
                    n += 1;
                    continue;
                }
                Ok(Err(e)) => {
                    let error = error_chain(&e);
                    tries.push(Try {
                        at,
                        phase: Some(Phase::Send),
                        error: Some(error.clone()),
                        ..Try::default()
                    });
                    return AttemptResult::Lost {
                        phase: Phase::Send,
                        error,
                    };
                }
                Ok(Ok(resp)) => resp,
            };
            let status = resp.status();
            let (mut head, body_in) = resp.into_parts();
            strip_not_forwarded(&mut head.headers);
            let rid = request_id(&head.headers);
            if !last && policy.retry_statuses.contains(&status) {
                let wait = match retry_after(&head.headers) {
                    Some(d) if d > policy.max_retry_wait => None,
                    Some(d) => Some(d),
                    None => Some(backoff(n, policy.max_retry_wait)),
                };
                if let Some(wait) = wait {
                    let b = read_limited(body_in, EVIDENCE_BODY_MAX as u64, deadline).await;
                    tries.push(Try {
                        at,
                        status: Some(status.as_u16()),
                        body: b.ok().and_then(|a| excerpt(&a.0)),
                        request_id: rid,
                        ..Try::default()
                    });
                    tokio::time::sleep(wait).await;
                    n += 1;
                    continue;
                }
            }
            if relay && status.is_success() && is_event_stream(&head.headers) {
                tries.push(Try {
                    at,
                    status: Some(status.as_u16()),
                    request_id: rid,
                    ..Try::default()
                });
                return AttemptResult::Streaming {
                    head,
                    body: body_in,
                };
            }
            let read = read_limited(body_in, limit, deadline).await;
            return match read {
                Ok((body, rest)) => {
                    tries.push(Try {
                        at,
                        status: Some(status.as_u16()),
                        body: excerpt(&body),
                        request_id: rid,
                        ..Try::default()
                    });
                    AttemptResult::Answered(Answer { head, body, rest })
                }
                Err(error) => {
                    tries.push(Try {
                        at,
                        phase: Some(Phase::Body),
                        status: Some(status.as_u16()),
                        error: Some(error.clone()),
                        request_id: rid,
                        ..Try::default()
                    });
                    AttemptResult::Lost {
                        phase: Phase::Body,
                        error,
                    }
                }
            };
        }
    }
}

/// Reads a body up to `limit` bytes before `deadline`. Returns the bytes read and, when the body
/// is longer, the unread remainder.
async fn read_limited(
    mut body: Incoming,
    limit: u64,
    deadline: tokio::time::Instant,
) -> Result<(Bytes, Option<Incoming>), String> {
    let mut buf = BytesMut::new();
    loop {
        if buf.len() as u64 > limit {
            return Ok((buf.freeze(), Some(body)));
        }
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err("timed out reading the response body".into()),
            Ok(None) => return Ok((buf.freeze(), None)),
            Ok(Some(Err(e))) => return Err(error_chain(&e)),
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                }
            }
        }
    }
}

/// Whether a status means the write was applied (SPEC §6: 1xx-3xx).
pub fn is_applied(s: StatusCode) -> bool {
    s.as_u16() < 400
}

/// A body whose first bytes were already read: those, then the rest as it streams.
pub struct Prefixed {
    prefix: Option<Bytes>,
    rest: Incoming,
}

impl Prefixed {
    pub fn new(prefix: Bytes, rest: Incoming) -> Prefixed {
        Prefixed {
            prefix: Some(prefix).filter(|p| !p.is_empty()),
            rest,
        }
    }
}

impl Body for Prefixed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(p) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        Pin::new(&mut self.rest).poll_frame(cx).map_err(Into::into)
    }
}

impl Upstreams {
    /// A small bodiless exchange (status lookups): the whole answer within `timeout`, its body
    /// up to 1 MiB.
    pub async fn fetch(
        &self,
        up: &Upstream,
        policy: &Policy,
        out: &Outgoing,
        timeout: Duration,
    ) -> Result<(http::response::Parts, Bytes), String> {
        let client = self.client(up, policy);
        let deadline = tokio::time::Instant::now() + timeout;
        let resp = tokio::time::timeout_at(deadline, client.request(out.request(empty())))
            .await
            .map_err(|_| format!("no answer within {timeout:?}"))?
            .map_err(|e| error_chain(&e))?;
        let (mut head, body) = resp.into_parts();
        strip_not_forwarded(&mut head.headers);
        match read_limited(body, 1 << 20, deadline).await? {
            (body, None) => Ok((head, body)),
            (_, Some(_)) => Err("lookup answer larger than 1 MiB".into()),
        }
    }
}
