//! Test fixtures: a fake upstream with fault knobs and counters, the proxy in-process or as a
//! child process, and a small HTTP client. Everything binds `127.0.0.1:0`.
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Notify};

use oncegate::config::Config;
use oncegate::upstream::BoxError;

pub mod mcp;
pub mod pg_server;

type Body = http_body_util::combinators::BoxBody<Bytes, BoxError>;

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|n| match n {}).boxed()
}

/// What the fake upstream does with one request. Every request is recorded (counted as applied)
/// once its body has been read, before the behaviour runs.
#[derive(Clone)]
pub enum Behavior {
    Respond {
        status: u16,
        headers: Vec<(String, String)>,
        body: Bytes,
    },
    /// Waits, then behaves.
    Delay(Duration, Box<Behavior>),
    /// Waits until the gate is opened, then behaves.
    Gate(Arc<Notify>, Box<Behavior>),
    /// Applies the write, then never answers.
    Hang,
    /// Applies the write, then closes the connection without answering.
    Drop,
    /// Sends `first`, waits for the gate, then sends `rest` and ends.
    Stream {
        first: Bytes,
        gate: Arc<Notify>,
        rest: Bytes,
    },
    /// A body of `n` bytes, streamed in 64 KiB chunks.
    Large(u64),
    /// An event stream: each chunk sent `every` after the one before (the first at once).
    Paced { every: Duration, chunks: Vec<Bytes> },
}

/// A `text/event-stream` response whose body is what `rx` receives.
fn event_stream(rx: tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, BoxError>>) -> Response<Body> {
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    let mut r = Response::new(StreamBody::new(stream).boxed());
    r.headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    r
}

impl Behavior {
    pub fn status(status: u16) -> Behavior {
        Behavior::Respond {
            status,
            headers: vec![],
            body: Bytes::new(),
        }
    }

    pub fn json(status: u16, body: &str) -> Behavior {
        Behavior::Respond {
            status,
            headers: vec![("content-type".into(), "application/json".into())],
            body: Bytes::copy_from_slice(body.as_bytes()),
        }
    }

    /// A JSON-RPC response (HTTP 200, JSON) whose `id` is the request's: `result` is its
    /// result member.
    pub fn json_rpc(result: &str) -> Behavior {
        Behavior::json(
            200,
            &format!(r#"{{"jsonrpc":"2.0","id":"$ID","result":{result}}}"#),
        )
    }

    /// `"$ID"` in a response body becomes the JSON-RPC id of `request` (its JSON).
    fn answering(self, request: &[u8]) -> Behavior {
        match self {
            Behavior::Respond {
                status,
                headers,
                body,
            } if body.windows(5).any(|w| w == b"\"$ID\"") => {
                let id = serde_json::from_slice::<serde_json::Value>(request)
                    .ok()
                    .and_then(|v| v.get("id").cloned())
                    .unwrap_or(serde_json::Value::Null);
                let text = String::from_utf8_lossy(&body).replace("\"$ID\"", &id.to_string());
                Behavior::Respond {
                    status,
                    headers,
                    body: Bytes::from(text),
                }
            }
            Behavior::Gate(g, b) => Behavior::Gate(g, Box::new(b.answering(request))),
            Behavior::Delay(d, b) => Behavior::Delay(d, Box::new(b.answering(request))),
            other => other,
        }
    }

    pub fn with_header(self, name: &str, value: &str) -> Behavior {
        match self {
            Behavior::Respond {
                status,
                mut headers,
                body,
            } => {
                headers.push((name.into(), value.into()));
                Behavior::Respond {
                    status,
                    headers,
                    body,
                }
            }
            other => other,
        }
    }
}

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    /// Path and query, byte for byte.
    pub target: String,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

struct UpstreamState {
    received: Mutex<Vec<Received>>,
    /// Behaviours by path prefix, checked before the script (e.g. a status-lookup endpoint).
    routes: Mutex<Vec<(String, Behavior)>>,
    script: Mutex<VecDeque<Behavior>>,
    default: Mutex<Behavior>,
    arrived: Notify,
}

/// A counting fake upstream.
pub struct FakeUpstream {
    pub addr: SocketAddr,
    state: Arc<UpstreamState>,
    scheme: &'static str,
    _stop: oneshot::Sender<()>,
}

impl FakeUpstream {
    pub async fn start() -> FakeUpstream {
        Self::start_with(None).await
    }

    pub async fn start_tls(cfg: rustls::ServerConfig) -> FakeUpstream {
        Self::start_with(Some(tokio_rustls::TlsAcceptor::from(Arc::new(cfg)))).await
    }

    async fn start_with(tls: Option<tokio_rustls::TlsAcceptor>) -> FakeUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(UpstreamState {
            received: Mutex::new(Vec::new()),
            routes: Mutex::new(Vec::new()),
            script: Mutex::new(VecDeque::new()),
            default: Mutex::new(Behavior::json(200, r#"{"ok":true}"#)),
            arrived: Notify::new(),
        });
        let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
        let st = state.clone();
        let scheme = if tls.is_some() { "https" } else { "http" };
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    r = listener.accept() => match r { Ok(c) => c, Err(_) => continue },
                    _ = &mut stop_rx => return,
                };
                let st = st.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(st.clone(), req));
                    let builder = auto::Builder::new(TokioExecutor::new());
                    match tls {
                        None => {
                            let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                        }
                        Some(acc) => {
                            if let Ok(s) = acc.accept(stream).await {
                                let _ = builder.serve_connection(TokioIo::new(s), svc).await;
                            }
                        }
                    }
                });
            }
        });
        FakeUpstream {
            addr,
            state,
            scheme,
            _stop: stop_tx,
        }
    }

    pub fn url(&self) -> String {
        format!("{}://{}", self.scheme, self.addr)
    }

    /// Queues behaviours for the next requests, in order.
    pub fn push(&self, b: Behavior) {
        self.state.script.lock().unwrap().push_back(b);
    }

    /// Requests whose path starts with `prefix` always get `b` (replacing an earlier rule).
    pub fn on(&self, prefix: &str, b: Behavior) {
        let mut r = self.state.routes.lock().unwrap();
        r.retain(|(p, _)| p != prefix);
        r.push((prefix.to_string(), b));
    }

    /// How many requests with this method arrived.
    pub fn count_method(&self, method: &str) -> usize {
        self.received()
            .iter()
            .filter(|r| r.method == method)
            .count()
    }

    /// What requests get once the queue is empty.
    pub fn set_default(&self, b: Behavior) {
        *self.state.default.lock().unwrap() = b;
    }

    pub fn received(&self) -> Vec<Received> {
        self.state.received.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.state.received.lock().unwrap().len()
    }

    /// How many requests carried `key` in `header`.
    pub fn count_key(&self, header: &str, key: &str) -> usize {
        self.received()
            .iter()
            .filter(|r| r.header(header) == Some(key))
            .count()
    }

    /// Waits until at least `n` requests arrived.
    pub async fn wait_for(&self, n: usize) {
        loop {
            let notified = self.state.arrived.notified();
            if self.count() >= n {
                return;
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
        }
    }
}

async fn handle(
    st: Arc<UpstreamState>,
    req: Request<Incoming>,
) -> Result<Response<Body>, BoxError> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await?.to_bytes();
    let target = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    let request = body.clone();
    st.received.lock().unwrap().push(Received {
        method: parts.method.to_string(),
        target: target.clone(),
        version: parts.version,
        headers: parts.headers,
        body,
    });
    st.arrived.notify_waiters();
    let routed = st
        .routes
        .lock()
        .unwrap()
        .iter()
        .find(|(prefix, _)| target.starts_with(prefix.as_str()))
        .map(|(_, b)| b.clone());
    if let Some(b) = routed {
        return run_behavior(b.answering(&request)).await;
    }
    let behavior = {
        let next = st.script.lock().unwrap().pop_front();
        next.unwrap_or_else(|| st.default.lock().unwrap().clone())
    };
    run_behavior(behavior.answering(&request)).await
}

fn run_behavior(
    b: Behavior,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Response<Body>, BoxError>> + Send>> {
    Box::pin(async move {
        match b {
            Behavior::Respond {
                status,
                headers,
                body,
            } => {
                let mut r = Response::new(full(body));
                *r.status_mut() = StatusCode::from_u16(status).unwrap();
                for (k, v) in headers {
                    r.headers_mut().append(
                        http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                        v.parse().unwrap(),
                    );
                }
                Ok(r)
            }
            Behavior::Delay(d, next) => {
                tokio::time::sleep(d).await;
                run_behavior(*next).await
            }
            Behavior::Gate(gate, next) => {
                gate.notified().await;
                run_behavior(*next).await
            }
            Behavior::Hang => {
                std::future::pending::<()>().await;
                unreachable!()
            }
            Behavior::Drop => Err("dropping the connection on purpose".into()),
            Behavior::Stream { first, gate, rest } => {
                let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
                tokio::spawn(async move {
                    let _ = tx.send(Ok(Frame::data(first))).await;
                    gate.notified().await;
                    let _ = tx.send(Ok(Frame::data(rest))).await;
                });
                Ok(event_stream(rx))
            }
            Behavior::Paced { every, chunks } => {
                let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
                tokio::spawn(async move {
                    for (i, chunk) in chunks.into_iter().enumerate() {
                        if i > 0 {
                            tokio::time::sleep(every).await;
                        }
                        if tx.send(Ok(Frame::data(chunk))).await.is_err() {
                            return;
                        }
                    }
                });
                Ok(event_stream(rx))
            }
            Behavior::Large(n) => {
                let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(2);
                tokio::spawn(async move {
                    let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
                    let mut left = n;
                    while left > 0 {
                        let take = left.min(chunk.len() as u64) as usize;
                        if tx.send(Ok(Frame::data(chunk.slice(..take)))).await.is_err() {
                            return;
                        }
                        left -= take as u64;
                    }
                });
                Ok(Response::new(
                    StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed(),
                ))
            }
        }
    })
}

/// The admin token of every in-process test proxy.
pub const ADMIN_TOKEN: &str = "test-admin-token-7f3a";

/// The proxy, running in-process on a temporary sled store.
pub struct TestProxy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub dir: PathBuf,
    pub store: Arc<dyn oncegate::store::Store>,
    _tmp: Option<tempfile::TempDir>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), oncegate::RunError>>>,
}

impl TestProxy {
    /// Starts the proxy with `toml` on a fresh temporary store.
    pub async fn start(toml: &str) -> TestProxy {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("store");
        let mut p = Self::start_in(toml, &dir).await;
        p._tmp = Some(tmp);
        p
    }

    /// Starts the proxy with `toml` on the store at `dir`.
    pub async fn start_in(toml: &str, dir: &Path) -> TestProxy {
        let store: Arc<dyn oncegate::store::Store> =
            Arc::new(oncegate::store::sled::SledStore::open(dir, Default::default()).unwrap());
        Self::start_with_store(toml, store, dir).await
    }

    pub async fn start_with_store(
        toml: &str,
        store: Arc<dyn oncegate::store::Store>,
        dir: &Path,
    ) -> TestProxy {
        Self::start_with_clock(toml, store, dir, oncegate::action::system_clock()).await
    }

    /// Starts the proxy on `store`, reading time from `clock`.
    pub async fn start_with_clock(
        toml: &str,
        store: Arc<dyn oncegate::store::Store>,
        dir: &Path,
        clock: oncegate::action::Clock,
    ) -> TestProxy {
        let config = Config::parse(toml).unwrap();
        Self::start_with_services(config, store, dir, Some(ADMIN_TOKEN.to_string()), clock).await
    }

    /// Starts the proxy with `config` on a fresh temporary sled store (removed with the proxy),
    /// with `admin_token` (or none) and `clock`.
    pub async fn start_fresh(
        config: Config,
        admin_token: Option<String>,
        clock: oncegate::action::Clock,
    ) -> TestProxy {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("store");
        let store =
            Arc::new(oncegate::store::sled::SledStore::open(&dir, Default::default()).unwrap());
        let mut p = Self::start_with_services(config, store, &dir, admin_token, clock).await;
        p._tmp = Some(tmp);
        p
    }

    /// Starts the proxy with `config` on `store`, with `admin_token` (or none) and `clock`.
    pub async fn start_with_services(
        config: Config,
        store: Arc<dyn oncegate::store::Store>,
        dir: &Path,
        admin_token: Option<String>,
        clock: oncegate::action::Clock,
    ) -> TestProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let admin_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = admin_listener.local_addr().unwrap();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let task = tokio::spawn(oncegate::run(
            config,
            oncegate::Listeners {
                proxy: listener,
                admin: Some(admin_listener),
            },
            oncegate::Services {
                clock,
                ..oncegate::Services::new(
                    store.clone(),
                    Arc::new(oncegate::metrics::Metrics::new()),
                    admin_token,
                )
            },
            async move {
                let _ = stop_rx.await;
            },
        ));
        TestProxy {
            addr,
            admin,
            dir: dir.to_owned(),
            store,
            _tmp: None,
            stop: Some(stop_tx),
            task: Some(task),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// Calls the admin API with the token.
    pub async fn admin(&self, method: &str, path: &str, body: &str) -> Resp {
        admin_call(self.admin, method, path, body).await
    }

    /// Graceful stop; returns once the store is closed.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap().unwrap();
        }
    }
}

/// A clock the test moves by hand: milliseconds since the epoch, from 1_800_000_000_000.
pub fn controlled_clock() -> (Arc<std::sync::atomic::AtomicU64>, oncegate::action::Clock) {
    let now = Arc::new(std::sync::atomic::AtomicU64::new(1_800_000_000_000));
    let read = now.clone();
    let clock: oncegate::action::Clock =
        Arc::new(move || read.load(std::sync::atomic::Ordering::SeqCst));
    (now, clock)
}

/// Calls the admin API at `addr` as an operator does: with the token, and a JSON body.
pub async fn admin_call(addr: SocketAddr, method: &str, path: &str, body: &str) -> Resp {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let mut headers = vec![("authorization", auth.as_str())];
    if method == "POST" {
        headers.push(("content-type", "application/json"));
    }
    TestClient::default()
        .send(method, &format!("http://{addr}{path}"), &headers, body)
        .await
}

/// A config with one upstream `pay` at `/pay`, short timeouts, and `extra` appended to the
/// upstream table (routes, policy keys).
pub fn config(upstream_url: &str, extra: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
header_timeout = "2s"
drain_timeout = "5s"

[admin]
listen = "127.0.0.1:0"

[defaults]
timeout = "1s"
connect_timeout = "1s"
max_retry_wait = "200ms"

[[upstreams]]
name = "pay"
prefix = "/pay"
url = "{upstream_url}"
{extra}
"#
    )
}

/// Writes [`config`] with the embedded store in `dir/store` to `dir/oncegate.toml`, for a proxy
/// run as a child process ([`ChildProxy`]); returns the file's path.
pub fn child_config(dir: &Path, upstream_url: &str, extra: &str) -> PathBuf {
    let text = config(upstream_url, extra).replace(
        "[defaults]",
        &format!(
            "[store]\npath = {:?}\n\n[defaults]",
            dir.join("store").display().to_string()
        ),
    );
    let path = dir.join("oncegate.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// A response as a test reads it.
#[derive(Debug)]
pub struct Resp {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }

    /// The problem type name (`urn:oncegate:problem:NAME` → `NAME`).
    pub fn problem(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "not a problem: {self:?}"
        );
        self.json()["type"]
            .as_str()
            .unwrap()
            .trim_start_matches("urn:oncegate:problem:")
            .to_string()
    }
}

/// A plain HTTP/1.1 client.
#[derive(Clone)]
pub struct TestClient(Client<HttpConnector, Full<Bytes>>);

impl Default for TestClient {
    fn default() -> Self {
        TestClient(Client::builder(TokioExecutor::new()).build_http())
    }
}

impl TestClient {
    pub fn http2() -> TestClient {
        TestClient(
            Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build_http(),
        )
    }

    pub async fn send(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Resp {
        let mut req = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
            .unwrap();
        let resp = self.0.request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        Resp {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    }

    pub async fn post(&self, url: &str, headers: &[(&str, &str)], body: &str) -> Resp {
        self.send("POST", url, headers, body).await
    }

    pub async fn get(&self, url: &str) -> Resp {
        self.send("GET", url, &[], "").await
    }

    /// Sends and returns the streaming response.
    pub async fn stream(&self, url: &str) -> Response<Incoming> {
        let req = Request::get(url).body(Full::new(Bytes::new())).unwrap();
        self.0.request(req).await.unwrap()
    }
}

/// Writes raw bytes to `addr` and reads until the server closes or `limit` passes.
pub async fn raw(addr: SocketAddr, request: &[u8], limit: Duration) -> (String, bool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = loop {
        match tokio::time::timeout(limit, s.read(&mut buf)).await {
            Ok(Ok(0)) => break true,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Ok(Err(_)) => break true,
            Err(_) => break false,
        }
    };
    (String::from_utf8_lossy(&out).into_owned(), closed)
}

/// The proxy binary as a child process (for SIGKILL tests).
pub struct ChildProxy {
    pub child: std::process::Child,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub stderr: Arc<Mutex<String>>,
}

impl ChildProxy {
    /// Starts `oncegate run --config <config>` and waits until it listens. The config must use
    /// `listen = "127.0.0.1:0"`; the address is read from the proxy's log.
    pub fn spawn(config: &Path) -> ChildProxy {
        Self::spawn_with(config, &[])
    }

    /// Like `spawn`, with extra environment variables.
    pub fn spawn_with(config: &Path, envs: &[(&str, &str)]) -> ChildProxy {
        let mut cmd = Self::command(env!("CARGO_BIN_EXE_oncegate"));
        cmd.args(["run", "--config"]).arg(config);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        Self::start(cmd)
    }

    /// Like `spawn`, but no file the proxy writes may grow past `kib` KiB: a write past it fails
    /// with EFBIG, as on a full disk (`ulimit -f`, with SIGXFSZ ignored so the write fails
    /// instead of killing the process).
    pub fn spawn_with_file_limit(config: &Path, kib: u64) -> ChildProxy {
        let mut cmd = Self::command("sh");
        cmd.arg("-c")
            .arg(format!(
                "trap '' XFSZ; ulimit -f {kib} && exec \"$0\" run --config \"$1\""
            ))
            .arg(env!("CARGO_BIN_EXE_oncegate"))
            .arg(config);
        Self::start(cmd)
    }

    fn command(program: &str) -> std::process::Command {
        let mut cmd = std::process::Command::new(program);
        cmd.env("RUST_LOG", "info")
            .env("ONCEGATE_ADMIN_TOKEN", ADMIN_TOKEN);
        cmd
    }

    fn start(mut cmd: std::process::Command) -> ChildProxy {
        use std::io::BufRead;
        let mut child = cmd
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                for field in ["addr=", "admin="] {
                    if let Some(i) = line.find(field) {
                        let v: String = line[i + field.len()..]
                            .chars()
                            .take_while(|c| !c.is_whitespace())
                            .collect();
                        let _ = tx.send((field, v));
                    }
                }
                let mut l = log2.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let (mut addr, mut admin) = (None, None);
        while addr.is_none() || admin.is_none() {
            let (field, v) = rx
                .recv_timeout(Duration::from_secs(20))
                .unwrap_or_else(|_| panic!("proxy did not start: {}", log.lock().unwrap()));
            let v: SocketAddr = v.parse().unwrap();
            if field == "addr=" {
                addr = Some(v);
            } else {
                admin = Some(v);
            }
        }
        ChildProxy {
            child,
            addr: addr.unwrap(),
            admin: admin.unwrap(),
            stderr: log,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Calls its admin API with the token (children start with [`ADMIN_TOKEN`]).
    pub async fn admin(&self, method: &str, path: &str, body: &str) -> Resp {
        admin_call(self.admin, method, path, body).await
    }

    /// SIGKILL: no drain, no flush.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGTERM, then waits for the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        self.terminate_ref()
    }

    /// SIGTERM, then waits for the exit status (and the end of its log).
    pub fn terminate_ref(&mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        let status = self.child.wait().unwrap();
        // Let the reader thread take the last lines.
        std::thread::sleep(Duration::from_millis(50));
        status
    }
}

impl Drop for ChildProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A store that fails on demand, as a full disk or a lost database would.
pub struct FaultyStore {
    inner: Arc<dyn oncegate::store::Store>,
    /// Claims fail as on a full disk.
    pub fail_claims: std::sync::atomic::AtomicBool,
    /// Settlements fail for good, as on a full disk (the embedded store breaks).
    pub fail_settles: std::sync::atomic::AtomicBool,
    /// Settlements fail for now, as while a database restarts.
    pub away_settles: std::sync::atomic::AtomicBool,
    /// The next settlement panics (a bug in the proxy's attempt task).
    pub panic_settles: std::sync::atomic::AtomicBool,
    /// Stored bodies cannot be read for now.
    pub away_bodies: std::sync::atomic::AtomicBool,
    /// When not 0: just before each stored body is read, the sweeper expires every record due
    /// at this time (it wins the race at the retention boundary).
    pub sweep_before_bodies: std::sync::atomic::AtomicU64,
}

impl FaultyStore {
    pub fn new(inner: Arc<dyn oncegate::store::Store>) -> FaultyStore {
        FaultyStore {
            inner,
            fail_claims: Default::default(),
            fail_settles: Default::default(),
            away_settles: Default::default(),
            panic_settles: Default::default(),
            away_bodies: Default::default(),
            sweep_before_bodies: Default::default(),
        }
    }
}

mod faulty {
    use super::FaultyStore;
    use oncegate::action::{Claim, ClaimRequest, Millis, Record, Resolve, State};
    use oncegate::log::{Entry, Event, LogEvent, Verification};
    use oncegate::store::{BoxFuture, Filter, SettleRequest, Store, StoreError};
    use std::sync::atomic::Ordering;

    fn full() -> StoreError {
        StoreError::Unavailable("No space left on device (os error 28)".into())
    }

    fn broken() -> StoreError {
        StoreError::Broken("write-ahead log write: No space left on device (os error 28)".into())
    }

    fn away() -> StoreError {
        StoreError::Unavailable("database: connection refused".into())
    }

    impl Store for FaultyStore {
        fn claim(&self, r: ClaimRequest) -> BoxFuture<'_, Result<Claim, StoreError>> {
            if self.fail_claims.load(Ordering::SeqCst) {
                return Box::pin(async { Err(full()) });
            }
            self.inner.claim(r)
        }
        fn settle(
            &self,
            r: SettleRequest,
        ) -> BoxFuture<'_, Result<std::sync::Arc<Record>, StoreError>> {
            if self.fail_settles.load(Ordering::SeqCst) {
                return Box::pin(async { Err(broken()) });
            }
            if self.away_settles.load(Ordering::SeqCst) {
                return Box::pin(async { Err(away()) });
            }
            if self.panic_settles.swap(false, Ordering::SeqCst) {
                panic!("a bug while settling (FaultyStore::panic_settles)");
            }
            self.inner.settle(r)
        }
        fn resolve(
            &self,
            id: String,
            r: Resolve,
            e: Event,
        ) -> BoxFuture<'_, Result<Record, StoreError>> {
            self.inner.resolve(id, r, e)
        }
        fn keyer(&self) -> oncegate::identity::Keyer {
            self.inner.keyer()
        }
        fn note(&self, e: LogEvent) {
            self.inner.note(e)
        }
        fn renew(
            &self,
            id: &str,
            owner: &str,
            lease: Millis,
            now: Millis,
        ) -> BoxFuture<'_, Result<bool, StoreError>> {
            self.inner.renew(id, owner, lease, now)
        }
        fn log(&self, after: u64, limit: usize) -> BoxFuture<'_, Result<Vec<Entry>, StoreError>> {
            self.inner.log(after, limit)
        }
        fn verify_log(&self) -> BoxFuture<'_, Result<Verification, StoreError>> {
            self.inner.verify_log()
        }
        fn log_head(&self) -> BoxFuture<'_, Result<(u64, String), StoreError>> {
            self.inner.log_head()
        }
        fn counts(&self) -> BoxFuture<'_, Result<Vec<(State, u64)>, StoreError>> {
            self.inner.counts()
        }
        fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
            self.inner.get(id)
        }
        fn body<'a>(
            &'a self,
            r: &'a Record,
        ) -> BoxFuture<'a, Result<Option<bytes::Bytes>, StoreError>> {
            if self.away_bodies.load(Ordering::SeqCst) {
                return Box::pin(async { Err(away()) });
            }
            let sweep = self.sweep_before_bodies.load(Ordering::SeqCst);
            Box::pin(async move {
                if sweep != 0 {
                    self.inner.expire(sweep).await?;
                }
                self.inner.body(r).await
            })
        }
        fn scan(&self, f: Filter, l: usize) -> BoxFuture<'_, Result<Vec<Record>, StoreError>> {
            self.inner.scan(f, l)
        }
        fn recover(
            &self,
            o: Option<String>,
            n: Millis,
        ) -> BoxFuture<'_, Result<usize, StoreError>> {
            self.inner.recover(o, n)
        }
        fn expire(&self, n: Millis) -> BoxFuture<'_, Result<usize, StoreError>> {
            self.inner.expire(n)
        }
        fn close(&self) -> BoxFuture<'_, Result<(), StoreError>> {
            self.inner.close()
        }
    }
}

/// The PostgreSQL server the PostgreSQL tests use: `ONCEGATE_TEST_POSTGRES`, a URL to a database
/// the tests may create databases from. Those tests are `#[ignore = "needs PostgreSQL …"]`, so
/// they run only when asked for (`cargo test -- --ignored`): then a missing server is a failure,
/// not a skip.
pub fn postgres_url() -> String {
    postgres_url_if_set().unwrap_or_else(|| {
        panic!("this test needs PostgreSQL: set ONCEGATE_TEST_POSTGRES (as .ci/run does)")
    })
}

/// `ONCEGATE_TEST_POSTGRES` when set: for tests that run on the embedded store always and on
/// PostgreSQL too where there is one.
pub fn postgres_url_if_set() -> Option<String> {
    std::env::var("ONCEGATE_TEST_POSTGRES")
        .ok()
        .filter(|u| !u.is_empty())
}

/// A fresh, empty database for one test; returns its URL.
pub async fn fresh_database(base: &str) -> String {
    let (client, conn) = tokio_postgres::connect(base, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let name = format!("oncegate_t_{:016x}", rand::random::<u64>());
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let mut cfg: tokio_postgres::Config = base.parse().unwrap();
    cfg.dbname(&name);
    let user = cfg.get_user().unwrap_or("postgres").to_string();
    let host = match cfg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".into(),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    format!("postgres://{user}@{host}:{port}/{name}")
}

/// Ends every connection to the database of `url` (as a database restart would).
pub async fn terminate_connections(base: &str, url: &str) -> u64 {
    let db = url.rsplit('/').next().unwrap().to_string();
    let (client, conn) = tokio_postgres::connect(base, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let rows = client
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            &[&db],
        )
        .await
        .unwrap();
    rows.len() as u64
}

/// An address that refuses connections and stays reserved while the socket lives: bound, never
/// listening. (A port bound then closed can be taken by another test's server meanwhile.)
pub fn refusing_port() -> (tokio::net::TcpSocket, SocketAddr) {
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = s.local_addr().unwrap();
    (s, addr)
}

/// The Python code block that follows `<!-- recipe:NAME -->` in docs/recipes.md.
pub fn recipe(name: &str) -> String {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/recipes.md")).unwrap();
    let marker = format!("<!-- recipe:{name} -->");
    let after = &doc[doc.find(&marker).unwrap_or_else(|| panic!("no {marker}")) + marker.len()..];
    let start = after.find("```python\n").unwrap() + "```python\n".len();
    let end = after[start..].find("```").unwrap();
    after[start..start + end].to_string()
}

/// sled's own files in `store` (its database, config and snapshots; the rest is oncegate's).
pub fn sled_files(store: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(store)
        .map(|d| {
            d.map(|e| e.unwrap().path())
                .filter(|p| {
                    let n = p.file_name().unwrap().to_string_lossy();
                    n == "db" || n == "conf" || n.starts_with("snap.")
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Moves (or copies) sled's files from `from` into `to`, replacing what `to` holds of them.
pub fn place_sled_files(from: &Path, to: &Path, copy: bool) {
    std::fs::create_dir_all(to).unwrap();
    for p in sled_files(to) {
        std::fs::remove_file(p).unwrap();
    }
    for p in sled_files(from) {
        let dest = to.join(p.file_name().unwrap());
        match copy {
            true => drop(std::fs::copy(&p, dest).unwrap()),
            false => std::fs::rename(&p, dest).unwrap(),
        }
    }
}
