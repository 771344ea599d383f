//! The load the benches drive: the upstream, the requests of each workload, and a driver that
//! keeps a number of connections busy for a while and measures what the targets spent on them.
#![allow(dead_code, reason = "each bench uses the part it needs")]

use std::io::BufRead;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

use super::proc;

/// `--out PATH` on the bench's command line: where its report goes.
pub fn out_arg(args: &[String]) -> Option<std::path::PathBuf> {
    args.iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1))
        .map(std::path::PathBuf::from)
}

/// What the upstream answers.
pub const BODY: &str = r#"{"id":"obj_123","object":"charge","amount":500,"ok":true}"#;

/// The upstream every target forwards to: `BODY` for every request (after 50 ms for a path
/// ending `/slow`), and an MCP server's answer under `/tools/`.
pub async fn upstream() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let svc = service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                    let slow = req.uri().path().ends_with("/slow");
                    if req.uri().path().starts_with("/tools/") {
                        return Ok(mcp_answer(req).await.map(|b| b.boxed_unsync()));
                    }
                    if req.uri().path().ends_with("/stream") {
                        return Ok(stream_answer());
                    }
                    let _ = req.into_body().collect().await;
                    if slow {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    let mut r = http::Response::new(
                        Full::new(Bytes::from_static(BODY.as_bytes())).boxed_unsync(),
                    );
                    r.headers_mut()
                        .insert("content-type", "application/json".parse().unwrap());
                    Ok::<_, hyper::Error>(r)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

/// How long a streamed answer waits between its first event and its second.
pub const STREAM_GAP: Duration = Duration::from_millis(5);

/// A streamed (SSE) answer, as a completion API streams tokens: the first event at once, the
/// second and last `STREAM_GAP` later. A proxy that held the stream back would show the gap in
/// the time to the first event. `X-Accel-Buffering: no` tells nginx not to buffer it.
fn stream_answer() -> http::Response<UnsyncBoxBody<Bytes, std::convert::Infallible>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(2);
    tokio::spawn(async move {
        let _ = tx
            .send(Bytes::from_static(
                b"event: token\ndata: {\"text\":\"Hello\"}\n\n",
            ))
            .await;
        tokio::time::sleep(STREAM_GAP).await;
        let _ = tx
            .send(Bytes::from_static(b"event: done\ndata: {}\n\n"))
            .await;
    });
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        let b = rx.recv().await?;
        Some((
            Ok::<_, std::convert::Infallible>(http_body::Frame::data(b)),
            rx,
        ))
    });
    let mut r = http::Response::new(http_body_util::StreamBody::new(frames).boxed_unsync());
    r.headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    r.headers_mut()
        .insert("x-accel-buffering", "no".parse().unwrap());
    r
}

/// An MCP server's answer to a `tools/call`: its JSON-RPC result, as one JSON body
/// (`/tools/json`) or as an SSE stream of one event (`/tools/sse`).
async fn mcp_answer(req: http::Request<hyper::body::Incoming>) -> http::Response<Full<Bytes>> {
    let sse = req.uri().path().ends_with("/sse");
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let id = serde_json::from_slice::<serde_json::Value>(&body)
        .map(|v| v["id"].clone())
        .unwrap_or_default();
    let msg = serde_json::json!({"jsonrpc": "2.0", "id": id,
        "result": {"content": [{"type": "text", "text": "charged"}], "isError": false}})
    .to_string();
    let (ct, body) = if sse {
        (
            "text/event-stream",
            format!("event: message\ndata: {msg}\n\n"),
        )
    } else {
        ("application/json", msg)
    };
    let mut r = http::Response::new(Full::new(Bytes::from(body)));
    r.headers_mut().insert("content-type", ct.parse().unwrap());
    r
}

#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Workload {
    Read,
    /// A streamed (SSE) read: its latency is the time to the first event, not to the end.
    StreamRead,
    Write,
    Replay,
    Mixed,
    Storm,
    /// Unique MCP `tools/call`s, answered as JSON.
    ToolJson,
    /// Unique MCP `tools/call`s, answered as an SSE stream.
    ToolSse,
}

#[derive(Default)]
pub struct Result_ {
    pub requests: u64,
    pub errors: u64,
    pub seconds: f64,
    pub hist: Option<Histogram<u64>>,
    pub peak_rss_kib: u64,
    /// CPU seconds the proxy used during the run.
    pub cpu_secs: f64,
    /// CPU seconds this process (load generator and upstream) used during the run.
    pub driver_cpu_secs: f64,
    /// Requests per second of each round, in order.
    pub rounds_rps: Vec<f64>,
}

impl Result_ {
    pub fn rps(&self) -> f64 {
        self.requests as f64 / self.seconds.max(1e-9)
    }
    /// Proxy CPU per request, in µs (none before a request).
    pub fn cpu_us(&self) -> Option<f64> {
        (self.requests > 0).then(|| self.cpu_secs * 1e6 / self.requests as f64)
    }
    /// CPU per request of this process (load generator and upstream), in µs.
    pub fn driver_us(&self) -> Option<f64> {
        (self.requests > 0).then(|| self.driver_cpu_secs * 1e6 / self.requests as f64)
    }
    pub fn q(&self, q: f64) -> f64 {
        self.hist
            .as_ref()
            .map_or(0.0, |h| h.value_at_quantile(q) as f64)
    }
    pub fn merge(&mut self, other: Result_) {
        self.requests += other.requests;
        self.errors += other.errors;
        self.seconds += other.seconds;
        self.peak_rss_kib = self.peak_rss_kib.max(other.peak_rss_kib);
        self.cpu_secs += other.cpu_secs;
        self.driver_cpu_secs += other.driver_cpu_secs;
        self.rounds_rps.extend(other.rounds_rps);
        match (&mut self.hist, other.hist) {
            (Some(h), Some(o)) => h.add(o).unwrap(),
            (h @ None, o) => *h = o,
            _ => {}
        }
    }
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

pub fn build(
    w: Workload,
    conn: usize,
    i: u64,
    recent: &mut Vec<String>,
) -> http::Request<Full<Bytes>> {
    let get = || {
        http::Request::get("/pay/v1/items?limit=10")
            .header("host", "bench")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let post = |path: &str, key: &str| {
        // Replays come from one agent, so that every replayed key is one stored action.
        let agent = if w == Workload::Replay { 0 } else { conn % 8 };
        http::Request::post(path)
            .header("host", "bench")
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer agent-{agent}"))
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from(format!(
                r#"{{"amount":500,"key":"{key}"}}"#
            ))))
            .unwrap()
    };
    let fresh = || {
        format!(
            "w-{}-{}",
            std::process::id(),
            UNIQUE.fetch_add(1, Ordering::Relaxed)
        )
    };
    match w {
        Workload::Read => get(),
        Workload::StreamRead => http::Request::get("/pay/v1/stream")
            .header("host", "bench")
            .header("accept", "text/event-stream")
            .body(Full::new(Bytes::new()))
            .unwrap(),
        Workload::Write => post("/pay/v1/charges", &fresh()),
        Workload::Replay => post(
            "/pay/v1/charges",
            &format!("replay-{}", (conn as u64 * 7919 + i) % 512),
        ),
        Workload::Storm => post("/pay/v1/slow", "storm-key"),
        Workload::ToolJson | Workload::ToolSse => {
            let path = if w == Workload::ToolSse {
                "/tools/sse"
            } else {
                "/tools/json"
            };
            // A new call each time: new arguments, so that each is a new action.
            let body = format!(
                r#"{{"jsonrpc":"2.0","id":{i},"method":"tools/call","params":{{"name":"charge","arguments":{{"amount":500,"order":"{}"}}}}}}"#,
                fresh()
            );
            http::Request::post(path)
                .header("host", "bench")
                .header("content-type", "application/json")
                .header("accept", "application/json, text/event-stream")
                .header("authorization", format!("Bearer agent-{}", conn % 8))
                .body(Full::new(Bytes::from(body)))
                .unwrap()
        }
        Workload::Mixed => {
            let roll = (i * 2654435761 + conn as u64 * 40503) % 100;
            if roll < 80 {
                get()
            } else if roll < 95 || recent.is_empty() {
                let k = fresh();
                recent.push(k.clone());
                if recent.len() > 32 {
                    recent.remove(0);
                }
                post("/pay/v1/charges", &k)
            } else {
                let k = recent[(i as usize) % recent.len()].clone();
                post("/pay/v1/charges", &k)
            }
        }
    }
}

/// The process and its children (nginx workers).
pub fn family(pid: u32) -> Vec<u32> {
    let mut pids = vec![pid];
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) {
                if proc::stat_fields(&stat).get(1) == Some(&pid.to_string().as_str()) {
                    pids.push(p);
                }
            }
        }
    }
    pids
}

/// The text of `GET /metrics` on the admin listener at `admin` (empty when it does not answer
/// within 5 s).
pub async fn metrics(admin: SocketAddr) -> String {
    let get = async {
        let s = tokio::net::TcpStream::connect(admin).await.ok()?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
            .await
            .ok()?;
        tokio::spawn(conn);
        let req = http::Request::get("/metrics")
            .header("host", "bench")
            .body(Full::new(Bytes::new()))
            .ok()?;
        let resp = send.send_request(req).await.ok()?;
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        Some(String::from_utf8_lossy(&body).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(5), get)
        .await
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// CPU time (user + system, in clock ticks of 10 ms) used so far by the process and its children.
pub fn cpu_ticks(pid: u32) -> u64 {
    family(pid)
        .iter()
        .map(|p| proc::cpu_ticks(&p.to_string()))
        .sum()
}

pub fn rss_kib(pid: u32) -> u64 {
    family(pid)
        .into_iter()
        .map(|p| proc::rss_kib(&p.to_string()))
        .sum()
}

/// A task that reads the RSS of `pids` and their children every `every` and raises `peak` (KiB)
/// to it: the highest since `peak` was last reset.
pub fn watch_rss(
    pids: Vec<u32>,
    every: Duration,
    peak: &Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    let peak = peak.clone();
    tokio::spawn(async move {
        loop {
            peak.fetch_max(pids.iter().map(|p| rss_kib(*p)).sum(), Ordering::Relaxed);
            tokio::time::sleep(every).await;
        }
    })
}

/// Drives `w` over `conns` connections for `dur`, connection `c` to `addrs[c % addrs.len()]`:
/// the CPU and memory of `pids` and their children count as the target's (the proxies, and the
/// servers behind them: the peer's Redis, PostgreSQL's backends). `peer` sends writes to the
/// peer's route.
pub async fn drive_all(
    addrs: &[SocketAddr],
    w: Workload,
    conns: usize,
    dur: Duration,
    pids: &[u32],
    peer: bool,
) -> Result_ {
    let deadline = Instant::now() + dur;
    let peak = Arc::new(AtomicU64::new(0));
    let sampler =
        (!pids.is_empty()).then(|| watch_rss(pids.to_vec(), Duration::from_millis(100), &peak));
    let cpu = || pids.iter().map(|p| cpu_ticks(*p)).sum::<u64>();
    let cpu_before = cpu();
    let driver_before = proc::cpu_ticks("self");
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..conns {
        let addr = addrs[c % addrs.len()];
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
            let (mut n, mut errors) = (0u64, 0u64);
            let mut recent = Vec::new();
            'conn: while Instant::now() < deadline {
                let Ok(s) = tokio::net::TcpStream::connect(addr).await else {
                    errors += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                };
                let _ = s.set_nodelay(true);
                let Ok((mut send, conn)) =
                    hyper::client::conn::http1::handshake(TokioIo::new(s)).await
                else {
                    errors += 1;
                    continue;
                };
                tokio::spawn(conn);
                let mut i = 0u64;
                while Instant::now() < deadline {
                    let mut req = build(w, c, i, &mut recent);
                    if peer {
                        *req.uri_mut() = http::Uri::from_static("/URL_CHARGES");
                    }
                    i += 1;
                    let t = Instant::now();
                    match send.send_request(req).await {
                        Ok(resp) => {
                            let status = resp.status();
                            let mut body = resp.into_body();
                            if w == Workload::StreamRead {
                                // The time to the first event; the rest is the upstream's pace.
                                let _ = body.frame().await;
                                let _ = hist.record(t.elapsed().as_micros() as u64);
                                let _ = body.collect().await;
                            } else {
                                let _ = body.collect().await;
                                let _ = hist.record(t.elapsed().as_micros() as u64);
                            }
                            n += 1;
                            // A storm's in-flight answers are expected; other failures are errors.
                            if status.is_server_error() {
                                errors += 1;
                            }
                        }
                        Err(_) => {
                            errors += 1;
                            continue 'conn;
                        }
                    }
                }
            }
            (n, errors, hist)
        }));
    }
    let mut r = Result_::default();
    for t in tasks {
        let (n, e, h) = t.await.unwrap();
        r.merge(Result_ {
            requests: n,
            errors: e,
            seconds: 0.0,
            hist: Some(h),
            peak_rss_kib: 0,
            cpu_secs: 0.0,
            driver_cpu_secs: 0.0,
            rounds_rps: Vec::new(),
        });
    }
    r.seconds = started.elapsed().as_secs_f64();
    r.driver_cpu_secs = proc::cpu_ticks("self").saturating_sub(driver_before) as f64 / 100.0;
    r.rounds_rps = vec![r.rps()];
    if let Some(s) = sampler {
        s.abort();
    }
    r.peak_rss_kib = peak.load(Ordering::Relaxed);
    r.cpu_secs = cpu().saturating_sub(cpu_before) as f64 / 100.0;
    r
}

/// Starts the oncegate binary on the config at `conf`, with `env` added to its environment
/// (`BENCH_WRAP` prepended to its command line); returns it with its proxy and admin addresses
/// and the first of `flags` (a name, and what its log says) that its log said while starting.
pub fn launch(
    conf: &std::path::Path,
    env: &[(String, String)],
    flags: &'static [(&'static str, &'static str)],
) -> (std::process::Child, SocketAddr, SocketAddr, &'static str) {
    launch_bin(env!("CARGO_BIN_EXE_oncegate"), conf, env, flags)
}

/// A command running `bin`, with the words of the environment variable `var` before it (a
/// profiler, or a script that runs another build).
pub fn wrapped(var: &str, bin: &str) -> std::process::Command {
    let wrap = std::env::var(var).unwrap_or_default();
    let mut argv = wrap.split_whitespace().chain([bin]);
    let mut cmd = std::process::Command::new(argv.next().unwrap_or(bin));
    cmd.args(argv);
    cmd
}

/// [`launch`], of the oncegate binary at `bin` (a baseline build, for a same-run comparison).
pub fn launch_bin(
    bin: &str,
    conf: &std::path::Path,
    env: &[(String, String)],
    flags: &'static [(&'static str, &'static str)],
) -> (std::process::Child, SocketAddr, SocketAddr, &'static str) {
    // `BENCH_WRAP='heaptrack -o /tmp/og'` runs the proxy under a profiler.
    let mut child = wrapped("BENCH_WRAP", bin)
        .args(["run", "--config", conf.to_str().unwrap()])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("RUST_LOG", "warn,oncegate=info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    // `BENCH_ECHO=1` passes the proxy's own output on (allocator statistics, panics).
    let echo = std::env::var("BENCH_ECHO").is_ok_and(|v| v == "1");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if echo {
                eprintln!("oncegate: {line}");
            }
            for &(f, said) in flags {
                if line.contains(said) {
                    let _ = tx.send((f, String::new()));
                }
            }
            for f in ["addr=", "admin="] {
                if let Some(i) = line.find(f) {
                    let v: String = line[i + f.len()..]
                        .chars()
                        .take_while(|c| !c.is_whitespace())
                        .collect();
                    let _ = tx.send((f, v));
                }
            }
        }
    });
    let (mut proxy, mut admin, mut ids) = (None, None, "none");
    while proxy.is_none() || admin.is_none() {
        let (f, v) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("oncegate started");
        match f {
            "addr=" => proxy = v.parse().ok(),
            "admin=" => admin = v.parse().ok(),
            f => ids = f,
        }
    }
    (child, proxy.unwrap(), admin.unwrap(), ids)
}

/// Writes the proxy's config into `dir` (its `[store]` section's body `store`, lines added to its
/// `[defaults]`): the upstream at `/pay`, and its MCP server at `/tools`. Returns its path.
pub fn config(
    dir: &std::path::Path,
    upstream: SocketAddr,
    store: &str,
    defaults: &str,
) -> std::path::PathBuf {
    let conf = dir.join("oncegate.toml");
    std::fs::write(
        &conf,
        format!(
            r#"[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
{store}
[defaults]
timeout = "10s"
{defaults}
[[upstreams]]
name = "pay"
prefix = "/pay"
url = "http://{upstream}"
[[upstreams]]
name = "tools"
prefix = "/tools"
url = "http://{upstream}/tools"
protocol = "mcp"
"#
        ),
    )
    .unwrap();
    conf
}

/// Stops oncegate as an operator would (SIGTERM: it drains, flushes and closes its store), and
/// kills it if it has not exited within 10 s.
pub async fn stop(c: &mut std::process::Child) {
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &c.id().to_string()])
        .status();
    for _ in 0..100 {
        if c.try_wait().ok().flatten().is_some() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = c.kill();
    let _ = c.wait();
}
