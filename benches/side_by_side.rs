//! oncegate side by side with what a user would otherwise run: the upstream directly, and nginx as
//! a plain reverse proxy with upstream keepalive; and with its own HTTP stack alone (`bare hyper`,
//! hyper-util's server and client forwarding everything), the floor of what oncegate can cost;
//! at one connection, also with the two durable appends of a write (`bare hyper, two
//! fdatasyncs`, `support/append_log.rs`), the floor of a durable write's latency.
//! Every workload runs against the targets in turn, interleaved (A B C D A B C D …), so
//! machine drift hits all alike. Then `sled alone`, the floor under the embedded store: only the
//! sled operations of one durable write (`support/sled_alone.rs`), as fast as one thread goes and
//! paced at the mixed workload's rate of new writes.
//!
//! `cargo bench --bench side_by_side -- --out bench/results.md` (add `--quick` for a short run).
//! nginx is installed with apt-get when missing; without it the nginx column says so.
//! For profiling: `BENCH_ONLY='writes, 64|replays'` runs the workloads whose names contain one of
//! the alternatives (the preloads only when it names `stored`, the floor only when it names
//! `floor`, the paced run of 100,000 writes only when it names `paced`, the restart after a
//! SIGKILL only when it names `restart`), `BENCH_SECS=20`
//! lengthens each run, `BENCH_ROUNDS=7` interleaves more rounds (5 by default), `BENCH_HOLD=60`
//! keeps the proxy up, idle, after the workloads (for gdb or /proc). `BENCH_WRAP` is prepended
//! to the proxy's command line (`BENCH_WRAP='perf record -o F'`); a script there can run another
//! build instead (`shift; exec /tmp/og-base "$@"`: same-run pairs of two builds) or one under
//! `valgrind --tool=callgrind`, whose instruction counts per call do not move with the machine's
//! load (docs/decisions.md, "Small changes are measured in instructions").
//! `BENCH_BARE_WRAP` does the same for the `bare hyper` processes. `BENCH_TWIN_OFF=1` adds
//! `oncegate, twin guard off` (the same build, `twin_guard = false`, a store of its own warmed
//! alike) to every workload, and a section pricing the unsettled-twin guard
//! (bench/results-twin.md). `BENCH_BASELINE=path` adds `oncegate, baseline build`: the oncegate
//! binary at that path (another build) on a store of its own warmed alike, for same-run pairs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/append_log.rs"]
mod append_log;
#[path = "support/fsync_probe.rs"]
mod fsync_probe;
#[path = "support/load.rs"]
mod load;
#[path = "support/proc.rs"]
mod proc;
#[path = "support/reads.rs"]
mod reads;
#[path = "support/scrape.rs"]
mod scrape;
#[path = "support/sled_alone.rs"]
mod sled_alone;

/// oncegate's allocator, for the `bare hyper` and `sled alone` processes (both this binary run
/// again), so their RSS and CPU compare with oncegate's.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::collections::HashMap;
use std::io::BufRead;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use load::{build, drive_all, rss_kib, stop, upstream, Result_, Workload, BODY};

/// The peer's targets, by how its Redis keeps what it is given.
const PEER_VOLATILE: &str = "peer, Redis without persistence";
const PEER_DURABLE: &str = "peer, Redis appendfsync always";

/// With `BENCH_TWIN_OFF=1`: oncegate again, on a store of its own warmed the same way, with the
/// unsettled-twin guard off: the same-run pair that prices the guard (SPEC §4.1).
const OG_NO_GUARD: &str = "oncegate, twin guard off";

/// With `BENCH_BASELINE=path`: the oncegate binary at that path (another build), on a store of
/// its own warmed the same way.
const OG_BASELINE: &str = "oncegate, baseline build";

// ---------------------------------------------------------------- the bare hyper proxy

/// The floor of oncegate's stack: hyper-util's server (HTTP/1 and 2, as oncegate serves) and its
/// pooled client, forwarding every request as it comes, with no routing, records or logs. Run in a
/// process of its own (this bench, started again with `BENCH_BARE_PROXY=upstream`), with a runtime
/// like oncegate's, so its CPU and RSS are measured alike.
///
/// With `BENCH_BARE_LOG=file` it is the floor of a durable proxy at one connection (`bare hyper,
/// two fdatasyncs`): each POST appends a claim-sized frame to that file and makes it durable
/// before it is forwarded, and a settlement-sized one before it is answered
/// (`support/append_log.rs`).
fn bare_proxy(upstream: SocketAddr, log: Option<PathBuf>) {
    let log = log.map(|p| Arc::new(append_log::AppendLog::create(&p).unwrap()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("addr={}", l.local_addr().unwrap());
        let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
        connector.set_nodelay(true);
        let client: hyper_util::client::legacy::Client<_, hyper::body::Incoming> =
            hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector);
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let _ = s.set_nodelay(true);
            let client = client.clone();
            let log = log.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
                    let client = client.clone();
                    let log = log.clone().filter(|_| req.method() == http::Method::POST);
                    async move {
                        let pq = req
                            .uri()
                            .path_and_query()
                            .map(|p| p.as_str())
                            .unwrap_or("/");
                        *req.uri_mut() = format!("http://{upstream}{pq}").parse().unwrap();
                        if let Some(log) = &log {
                            log.append(append_log::CLAIM_FRAME).unwrap();
                        }
                        let resp = client.request(req).await;
                        if let Some(log) = &log {
                            log.append(append_log::SETTLE_FRAME).unwrap();
                        }
                        resp
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
}

fn start_bare_proxy(upstream: SocketAddr, log: Option<&Path>) -> (std::process::Child, SocketAddr) {
    // `BENCH_BARE_WRAP` is prepended to its command line, as `BENCH_WRAP` to oncegate's.
    let exe = std::env::current_exe().unwrap();
    let mut cmd = load::wrapped("BENCH_BARE_WRAP", exe.to_str().unwrap());
    cmd.env("BENCH_BARE_PROXY", upstream.to_string());
    if let Some(log) = log {
        cmd.env("BENCH_BARE_LOG", log);
    }
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().strip_prefix("addr=").unwrap().parse().unwrap();
    (child, addr)
}

// ---------------------------------------------------------------- targets

struct Target {
    name: &'static str,
    addr: SocketAddr,
    pid: Option<u32>,
    /// `idempotent-proxy-server`: writes go to its `/URL_CHARGES` route; it takes only the
    /// write and replay workloads (it needs a key on every request).
    peer: bool,
    /// The peer's Redis: its CPU and memory count with the peer's.
    redis: Option<u32>,
    /// A floor for the unique writes at 1 connection only (`bare hyper, two fdatasyncs`).
    one_writer_only: bool,
}

/// The durable floor at one connection: bare hyper with two durable appends per write.
const BARE_DURABLE: &str = "bare hyper, two fdatasyncs";

// ---------------------------------------------------------------- the peer

/// The peer's version, installed from crates.io into the bench's own folder.
const PEER_VERSION: &str = "1.2.2";

/// `idempotent-proxy-server`, installed with `cargo install --locked` under `target/peer` when
/// missing (a few minutes, once).
fn ensure_peer() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/peer");
    let bin = root.join("bin/idempotent-proxy-server");
    // `cargo install` lists what it installed there, with the version.
    let listed = std::fs::read_to_string(root.join(".crates.toml")).unwrap_or_default();
    if bin.exists() && listed.contains(&format!("idempotent-proxy-server {PEER_VERSION}")) {
        return Some(bin);
    }
    eprintln!("idempotent-proxy-server not found: installing {PEER_VERSION} from crates.io");
    let ok = std::process::Command::new("cargo")
        .args(["install", "--locked", "--root"])
        .arg(&root)
        .arg(format!("idempotent-proxy-server@{PEER_VERSION}"))
        .status()
        .is_ok_and(|s| s.success());
    (ok && bin.exists()).then_some(bin)
}

/// A private `redis-server` on a free port: without persistence (the peer's usual setup), or
/// with `appendfsync always` (every write fsynced, as oncegate's are).
fn start_redis(dir: &Path, always: bool) -> Option<(std::process::Child, u16)> {
    let port = free_port();
    let data = dir.join(format!("redis-{port}"));
    std::fs::create_dir_all(&data).unwrap();
    let mut cmd = std::process::Command::new("redis-server");
    cmd.args([
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
    ])
    .arg("--dir")
    .arg(&data)
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null());
    if always {
        cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
    } else {
        cmd.args(["--appendonly", "no"]);
    }
    let child = cmd.spawn().ok()?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    for _ in 0..100 {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Some((child, port));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// The peer on a free port, proxying `/URL_CHARGES` to the upstream's charges endpoint, its
/// records kept in Redis for 10 s (its `REQUEST_TIMEOUT`, which is also its cache TTL).
fn start_peer(
    bin: &Path,
    dir: &Path,
    redis: u16,
    upstream: SocketAddr,
) -> Option<(std::process::Child, SocketAddr)> {
    let port = free_port();
    let cwd = dir.join(format!("peer-{port}"));
    std::fs::create_dir_all(&cwd).unwrap();
    // It refuses to start without a `.env` file in its folder.
    std::fs::write(cwd.join(".env"), "").unwrap();
    let child = std::process::Command::new(bin)
        .current_dir(&cwd)
        .env("SERVER_ADDR", format!("127.0.0.1:{port}"))
        .env("REDIS_URL", format!("redis://127.0.0.1:{redis}"))
        .env("URL_CHARGES", format!("http://{upstream}/pay/v1/charges"))
        .env("REQUEST_TIMEOUT", "10000")
        .env("LOG_LEVEL", "error")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    for _ in 0..200 {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Some((child, addr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn ensure_nginx() -> Option<PathBuf> {
    let find = || {
        ["/usr/sbin/nginx", "/usr/bin/nginx"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
    };
    if let Some(p) = find() {
        return Some(p);
    }
    eprintln!("nginx not found: installing nginx-light with apt-get");
    let _ = std::process::Command::new("apt-get")
        .args(["update", "-qq"])
        .status();
    let _ = std::process::Command::new("apt-get")
        .args(["install", "-y", "-qq", "nginx-light"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status();
    find()
}

fn start_nginx(dir: &Path, upstream: SocketAddr) -> Option<(std::process::Child, SocketAddr)> {
    let bin = ensure_nginx()?;
    let port = free_port();
    let conf = dir.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            r#"worker_processes auto;
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {d}/cb; proxy_temp_path {d}/pt; fastcgi_temp_path {d}/ft;
  uwsgi_temp_path {d}/ut; scgi_temp_path {d}/st;
  upstream up {{ server {upstream}; keepalive 256; keepalive_requests 1000000; }}
  server {{
    listen 127.0.0.1:{port};
    keepalive_requests 1000000;
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
}}
"#,
            d = dir.display()
        ),
    )
    .unwrap();
    let child = std::process::Command::new(bin)
        .args(["-c", conf.to_str().unwrap(), "-p", dir.to_str().unwrap()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    for _ in 0..100 {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Some((child, addr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// Starts the oncegate binary; returns it with its proxy and admin addresses.
fn start_oncegate(
    dir: &Path,
    upstream: SocketAddr,
) -> (std::process::Child, SocketAddr, SocketAddr) {
    let (c, a, admin, _) = start_oncegate_telling(dir, upstream, "");
    (c, a, admin)
}

/// How an open came by the filter of held ids, as its log says: `loaded` (a saved one),
/// `read` (every pointer read from sled) or `none` (an empty store).
type IdsAtOpen = &'static str;

/// [`start_oncegate`], with how the open came by its filter of held ids.
fn start_oncegate_telling(
    dir: &Path,
    upstream: SocketAddr,
    defaults: &str,
) -> (std::process::Child, SocketAddr, SocketAddr, IdsAtOpen) {
    let store = format!("path = {:?}", dir.join("store").display().to_string());
    let conf = load::config(dir, upstream, &store, defaults);
    load::launch(
        &conf,
        &[],
        &[
            ("loaded", "loaded the saved filter of held ids"),
            ("read", "read the action ids from sled"),
        ],
    )
}

/// What a start of oncegate cost: seconds to ready, the most it held while opening its store
/// (VmHWM once ready: what a memory limit must leave room for), and its RSS a second later.
#[derive(Clone, Copy)]
struct Opened {
    ready: f64,
    peak_kib: u64,
    after_kib: u64,
    ids: IdsAtOpen,
}

impl Opened {
    /// How the open came by the filter of held ids, for the report.
    fn ids_said(&self) -> &'static str {
        match self.ids {
            "loaded" => "loaded as saved",
            "read" => "read from sled",
            _ => "empty",
        }
    }
}

/// [`start_oncegate`], measured ([`Opened`]); returns a second after it is ready.
async fn start_measured(
    dir: &Path,
    upstream: SocketAddr,
) -> (std::process::Child, SocketAddr, SocketAddr, Opened) {
    start_measured_with(dir, upstream, "").await
}

/// [`start_measured`], with `defaults` added to the config's `[defaults]`.
async fn start_measured_with(
    dir: &Path,
    upstream: SocketAddr,
    defaults: &str,
) -> (std::process::Child, SocketAddr, SocketAddr, Opened) {
    let t = Instant::now();
    let (c, a, admin, ids) = start_oncegate_telling(dir, upstream, defaults);
    let ready = t.elapsed().as_secs_f64();
    let peak_kib = proc::peak_rss_kib(&c.id().to_string());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after_kib = rss_kib(c.id());
    (
        c,
        a,
        admin,
        Opened {
            ready,
            peak_kib,
            after_kib,
            ids,
        },
    )
}

// ---------------------------------------------------------------- load

struct Spec {
    name: &'static str,
    workload: Workload,
    conns: usize,
}

async fn drive(
    addr: SocketAddr,
    w: Workload,
    conns: usize,
    dur: Duration,
    pid: Option<u32>,
) -> Result_ {
    drive_all(&[addr], w, conns, dur, &Vec::from_iter(pid), false).await
}

/// What a paced run of unique writes left.
struct Paced {
    writes: u64,
    errors: u64,
    secs: f64,
    peak_rss_kib: u64,
    /// RSS once the last write was answered, and after a further idle second.
    end_rss_kib: u64,
    idle_rss_kib: u64,
}

impl Paced {
    fn describe(&self) -> String {
        format!(
            "{} unique writes at {FLOOR_RATE} writes/s (16 connections, a fresh store; {:.1} s, {} errors): RSS {:.0} MiB when the last was answered, {:.0} MiB a second later, peak {:.0} MiB",
            self.writes,
            self.secs,
            self.errors,
            self.end_rss_kib as f64 / 1024.0,
            self.idle_rss_kib as f64 / 1024.0,
            self.peak_rss_kib as f64 / 1024.0
        )
    }
}

/// `total` unique writes at `rate` per second in all, over 16 connections each on a fixed
/// schedule (a write late on it goes at once), as an agent fleet would send them rather than as
/// fast as they go: the memory a long steady run leaves, not a burst's.
async fn paced(addr: SocketAddr, total: u64, rate: u64, pid: u32) -> Paced {
    const CONNS: u64 = 16;
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let started = tokio::time::Instant::now();
    let every = Duration::from_secs_f64(CONNS as f64 / rate as f64);
    let mut tasks = Vec::new();
    for c in 0..CONNS {
        tasks.push(tokio::spawn(async move {
            let s = tokio::net::TcpStream::connect(addr).await.unwrap();
            let _ = s.set_nodelay(true);
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
                .await
                .unwrap();
            tokio::spawn(conn);
            let (mut n, mut errors, mut recent) = (0u64, 0u64, Vec::new());
            let mine = total / CONNS + u64::from(c < total % CONNS);
            for i in 0..mine {
                // Spread over the interval: connection c starts c/16 of it late.
                let at = started + every.mul_f64(i as f64 + c as f64 / CONNS as f64);
                tokio::time::sleep_until(at).await;
                let req = build(Workload::Write, c as usize, i, &mut recent);
                match send.send_request(req).await {
                    Ok(resp) => {
                        let ok = resp.status().is_success();
                        let _ = resp.into_body().collect().await;
                        n += 1;
                        errors += u64::from(!ok);
                    }
                    Err(_) => {
                        errors += 1;
                        break;
                    }
                }
            }
            (n, errors)
        }));
    }
    let (mut writes, mut errors) = (0, 0);
    for t in tasks {
        let (n, e) = t.await.unwrap();
        writes += n;
        errors += e;
    }
    let secs = started.elapsed().as_secs_f64();
    let end_rss_kib = rss_kib(pid);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle_rss_kib = rss_kib(pid);
    sampler.abort();
    Paced {
        writes,
        errors,
        secs,
        peak_rss_kib: peak.load(Ordering::Relaxed).max(end_rss_kib),
        end_rss_kib,
        idle_rss_kib,
    }
}

async fn warm_replays(addr: SocketAddr, peer: bool) {
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let mut recent = Vec::new();
    let path = if peer {
        "/URL_CHARGES"
    } else {
        "/pay/v1/charges"
    };
    for k in 0..512u64 {
        let mut req = build(Workload::Replay, 0, k, &mut recent);
        *req.uri_mut() = format!("http://{addr}{path}").parse().unwrap();
        let resp = client.request(req).await.unwrap();
        let _ = resp.into_body().collect().await;
    }
}

async fn metric(admin: SocketAddr, name: &str) -> f64 {
    load::metrics(admin)
        .await
        .lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A snapshot of oncegate's write-phase and fdatasync histograms ([`scrape::phase_buckets`]).
async fn phase_buckets(admin: SocketAddr) -> scrape::Buckets {
    scrape::phase_buckets(&load::metrics(admin).await)
}

fn dir_bytes(p: &Path) -> u64 {
    let mut n = 0;
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            let m = e.metadata().unwrap();
            n += if m.is_dir() {
                dir_bytes(&e.path())
            } else {
                m.len()
            };
        }
    }
    n
}

/// Actions written to oncegate's store before the run ([`warm`]).
const WARM: usize = 30_000;

/// Readies oncegate's store as a sidecar's is once it has run a while: [`WARM`] actions written
/// and the store closed cleanly, so that its write-ahead log starts in files whose blocks are
/// written (spares). A new store's first two log files are extended with zeros as they fill,
/// which costs one write in ~300 an fdatasync that carries a megabyte (`cargo bench --bench
/// store` compares a new store with a restarted one). Returns the spares' sizes in bytes.
async fn warm(dir: &Path) -> Vec<u64> {
    preload(dir, WARM).await;
    let mut spares: Vec<u64> = std::fs::read_dir(dir.join("wal"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "spare"))
        .map(|p| std::fs::metadata(p).unwrap().len())
        .collect();
    spares.sort_unstable();
    spares
}

/// Fills a store with `n` succeeded actions through the store API (as the proxy would).
async fn preload(dir: &Path, n: usize) {
    use oncegate::action::*;
    use oncegate::store::Store;
    let store = Arc::new(oncegate::store::sled::SledStore::open(dir, Default::default()).unwrap());
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..64 {
        let (store, done) = (store.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = t;
            while i < n {
                let id = format!("{:032x}", i as u128 * 0x9E3779B97F4A7C15);
                let fresh = Record {
                    upstream: "pay".into(),
                    principal: "anonymous".into(),
                    key: format!("preload-{i}"),
                    method: "POST".into(),
                    path: "/v1/charges".into(),
                    ..Record::new(id.clone(), "f".repeat(64))
                };
                let now = now_millis();
                store
                    .claim(ClaimRequest {
                        fresh,
                        key_source: oncegate::action::KeySource::Header,
                        max_attempts: 5,
                        owner: "preload".into(),
                        lease: 1000,
                        now,
                        twin: None,
                        window: None,
                    })
                    .await
                    .unwrap();
                store
                    .settle(oncegate::store::SettleRequest {
                        id,
                        attempt: 1,
                        settlement: Settlement {
                            external_id: Some("obj_123".into()),
                            ..Settlement::succeeded(
                                now,
                                StoredResponse {
                                    status: 201,
                                    headers: vec![(
                                        "content-type".into(),
                                        "application/json".into(),
                                    )],
                                    size: BODY.len() as u64,
                                    body: BodyRef::Inline,
                                    source: Source::Upstream,
                                },
                            )
                        },
                        body: Some(Bytes::from_static(BODY.as_bytes())),
                    })
                    .await
                    .unwrap();
                done.fetch_add(1, Ordering::Relaxed);
                i += 64;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    store.close().await.unwrap();
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("unknown")
        .trim()
        .to_string();
    let cores = cores();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .next()
        .unwrap_or("")
        .to_string();
    format!(
        "{cores} cores, {cpu}, {}",
        mem.replace("MemTotal:", "memory")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    )
}

/// The write rate of the paced `sled alone` run: about the mixed workload's rate of new writes.
const FLOOR_RATE: u64 = 4_000;
/// Writes in the paced run (at [`FLOOR_RATE`]): the 100,000 actions the memory target is set at.
const PACED_WRITES: u64 = 100_000;

/// The machine's cores, which load generator, upstream and proxy share.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The unique-writes target: this share of nginx's throughput.
const WRITE_TARGET: f64 = 0.5;

/// The targets that set a throughput against nginx's, with the factor each needs.
const THROUGHPUT_TARGETS: [(&str, f64); 3] = [
    ("read GET, 64 connections", 1.0),
    ("unique durable writes, 64 connections", WRITE_TARGET),
    ("duplicate replays, 64 connections", 1.0),
];

/// The price of the unsettled-twin guard (with `BENCH_TWIN_OFF=1`): oncegate against itself with
/// the guard off, in the same rounds.
fn twin_guard_report(md: &mut String, results: &[(&Spec, HashMap<&str, Result_>)]) {
    let mut rows = String::new();
    for (spec, per) in results {
        let (Some(on), Some(off)) = (per.get("oncegate"), per.get(OG_NO_GUARD)) else {
            continue;
        };
        let (Some(cpu_on), Some(cpu_off)) = (on.cpu_us(), off.cpu_us()) else {
            continue;
        };
        rows.push_str(&format!(
            "| {} | {cpu_on:.1} | {cpu_off:.1} | {:+.1}% | {:.0} | {:.0} | {:.2}× |\n",
            spec.name,
            (cpu_on / cpu_off - 1.0) * 100.0,
            on.rps(),
            off.rps(),
            on.rps() / off.rps(),
        ));
    }
    if rows.is_empty() {
        return;
    }
    md.push_str("\n## The unsettled-twin guard's cost (same run)\n\n`oncegate` has the guard on (the default); `oncegate, twin guard off` is the same build on a store of its own, warmed alike, with `twin_guard = false`, interleaved in the same rounds. The target: at most 5% more CPU per write with the guard.\n\n| workload | CPU per request, guard on (µs) | guard off (µs) | guard's cost | req/s, on | req/s, off | on / off |\n|---|---:|---:|---:|---:|---:|---:|\n");
    md.push_str(&rows);
}

/// The proxy CPU per request (µs) that a throughput of `factor` × nginx's leaves on this machine:
/// its cores, less what the load generator and upstream (this process) use per request, measured
/// in the nginx run. A proxy that needs more cannot reach the target here, however it schedules.
fn budget(per: &HashMap<&str, Result_>, factor: f64) -> Option<f64> {
    let n = per.get("nginx")?;
    let target = n.rps() * factor;
    Some((cores() as f64 * 1e6 - target * n.driver_us()?) / target)
}

/// The report's section on what each throughput target leaves the proxy, against what nginx,
/// bare hyper and oncegate used per request in the same run.
fn budgets(md: &mut String, results: &[(&Spec, HashMap<&str, Result_>)]) {
    let mut rows = String::new();
    for (name, factor) in THROUGHPUT_TARGETS {
        let Some((_, per)) = results.iter().find(|(w, _)| w.name == name) else {
            continue;
        };
        let (Some(b), Some(n)) = (budget(per, factor), per.get("nginx")) else {
            continue;
        };
        let cpu = |t: &str| {
            (per.get(t).and_then(Result_::cpu_us)).map_or("-".into(), |us| format!("{us:.0}"))
        };
        rows.push_str(&format!(
            "| {name} | {factor}× nginx = {:.0} req/s | {:.0} | {b:.0} | {} | {} | {} |\n",
            n.rps() * factor,
            n.driver_us().unwrap_or(0.0),
            cpu("nginx"),
            cpu("bare hyper"),
            cpu("oncegate"),
        ));
    }
    if rows.is_empty() {
        return;
    }
    md.push_str(&format!(
        "\n## What each throughput target leaves the proxy\n\nAt the target's rate, {} cores less what the load generator and upstream use per request (measured in the nginx run) leave the proxy at most the budget below, in µs of CPU per request, with every core busy all the time. A proxy whose CPU per request is over it cannot reach the target on this machine; bare hyper's is what any proxy on hyper's server and pooled client pays before doing anything of its own.\n\n| workload | target | load generator and upstream | budget for the proxy | nginx | bare hyper | oncegate |\n|---|---|---:|---:|---:|---:|---:|\n",
        cores()
    ));
    md.push_str(&rows);
}

fn main() {
    if let Ok(up) = std::env::var("BENCH_BARE_PROXY") {
        let log = std::env::var_os("BENCH_BARE_LOG").map(PathBuf::from);
        return bare_proxy(up.parse().unwrap(), log);
    }
    if let Ok(spec) = std::env::var(sled_alone::ENV) {
        return sled_alone::child(&spec);
    }
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let out = load::out_arg(&args);
    // `BENCH_SECS` lengthens each run (for profiling memory growth).
    let secs = std::env::var("BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 1.0 } else { 3.0 });
    // `BENCH_ROUNDS` interleaves more rounds (for comparing small changes on a noisy machine).
    let rounds = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 1 } else { 5 });
    let preloads: Vec<usize> = if quick {
        vec![1_000, 10_000]
    } else {
        vec![10_000, 1_000_000]
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(secs, rounds, preloads, out));
}

async fn run(secs: f64, rounds: usize, preloads: Vec<usize>, out: Option<PathBuf>) {
    let dur = Duration::from_secs_f64(secs);
    let tmp = tempfile::tempdir().unwrap();
    let up = upstream().await;
    let nginx = start_nginx(tmp.path(), up);
    let og_dir = tmp.path().join("og");
    std::fs::create_dir_all(&og_dir).unwrap();
    let warmed = warm(&og_dir.join("store")).await;
    let (mut og, og_addr, og_admin, og_opened) = start_measured(&og_dir, up).await;
    let plain = |name, addr, pid| Target {
        name,
        addr,
        pid,
        peer: false,
        redis: None,
        one_writer_only: false,
    };
    let mut targets = vec![plain("direct", up, None)];
    if let Some((c, a)) = &nginx {
        targets.push(plain("nginx", *a, Some(c.id())));
    }
    let (mut bare, bare_addr) = start_bare_proxy(up, None);
    targets.push(plain("bare hyper", bare_addr, Some(bare.id())));
    // Its log lives beside oncegate's store, on the same disk.
    let (mut bare_durable, bare_durable_addr) =
        start_bare_proxy(up, Some(&tmp.path().join("bare-durable.log")));
    targets.push(Target {
        one_writer_only: true,
        ..plain(BARE_DURABLE, bare_durable_addr, Some(bare_durable.id()))
    });
    targets.push(plain("oncegate", og_addr, Some(og.id())));
    let mut no_guard = None;
    let mut baseline = None;
    if std::env::var("BENCH_TWIN_OFF").is_ok_and(|v| v == "1") {
        let dir = tmp.path().join("og-no-guard");
        std::fs::create_dir_all(&dir).unwrap();
        warm(&dir.join("store")).await;
        let (c, addr, _, _) = start_measured_with(&dir, up, "twin_guard = false").await;
        targets.push(plain(OG_NO_GUARD, addr, Some(c.id())));
        no_guard = Some(c);
    }
    // `BENCH_BASELINE=path`: another build of oncegate (today's main, say), on a store of its
    // own warmed alike: a same-run pair of two builds.
    if let Ok(bin) = std::env::var("BENCH_BASELINE") {
        let dir = tmp.path().join("og-baseline");
        std::fs::create_dir_all(&dir).unwrap();
        warm(&dir.join("store")).await;
        let store = format!("path = {:?}", dir.join("store").display().to_string());
        let conf = load::config(&dir, up, &store, "");
        let (c, addr, _, _) = load::launch_bin(&bin, &conf, &[], &[]);
        targets.push(plain(OG_BASELINE, addr, Some(c.id())));
        baseline = Some(c);
    }
    // The closest public peer, on Redis without persistence and with every write fsynced
    // (`BENCH_PEER=0` leaves it out).
    let mut peers: Vec<std::process::Child> = Vec::new();
    let peer_bin = (std::env::var("BENCH_PEER").as_deref() != Ok("0"))
        .then(ensure_peer)
        .flatten();
    if let Some(bin) = &peer_bin {
        for (name, always) in [(PEER_VOLATILE, false), (PEER_DURABLE, true)] {
            let Some((redis, port)) = start_redis(tmp.path(), always) else {
                eprintln!("{name}: redis-server did not start");
                continue;
            };
            let Some((peer, addr)) = start_peer(bin, tmp.path(), port, up) else {
                eprintln!("{name}: the peer did not start");
                continue;
            };
            targets.push(Target {
                name,
                addr,
                pid: Some(peer.id()),
                peer: true,
                redis: Some(redis.id()),
                one_writer_only: false,
            });
            peers.push(peer);
            peers.push(redis);
        }
    }

    let specs = [
        Spec {
            name: "read GET, 1 connection",
            workload: Workload::Read,
            conns: 1,
        },
        Spec {
            name: "read GET, 64 connections",
            workload: Workload::Read,
            conns: 64,
        },
        Spec {
            name: "streamed read (SSE), time to first event, 1 connection",
            workload: Workload::StreamRead,
            conns: 1,
        },
        Spec {
            name: "unique durable writes, 1 connection",
            workload: Workload::Write,
            conns: 1,
        },
        Spec {
            name: "unique durable writes, 64 connections",
            workload: Workload::Write,
            conns: 64,
        },
        Spec {
            name: "duplicate replays, 64 connections",
            workload: Workload::Replay,
            conns: 64,
        },
        Spec {
            name: "mixed agent workload, 64 connections",
            workload: Workload::Mixed,
            conns: 64,
        },
        Spec {
            name: "duplicate storm on one key, slow upstream, 64 connections",
            workload: Workload::Storm,
            conns: 64,
        },
        Spec {
            name: "MCP tools/call, JSON answer, 1 connection",
            workload: Workload::ToolJson,
            conns: 1,
        },
        Spec {
            name: "MCP tools/call, SSE answer, 1 connection",
            workload: Workload::ToolSse,
            conns: 1,
        },
    ];
    // `BENCH_ONLY=replays` runs only the workloads whose name contains it, `|` separating
    // alternatives (for profiling: `BENCH_ONLY='writes, 64|replays'`).
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let specs: Vec<&Spec> = specs
        .iter()
        .filter(|s| only.split('|').any(|o| s.name.contains(o)))
        .collect();
    // The replay workload's keys exist before it runs: each of the 512 keys sent once (the
    // peer keeps them 10 s: its keys are sent again before each of its rounds). Only when a
    // workload replays, so that a profile of reads holds no writes.
    if specs
        .iter()
        .any(|s| matches!(s.workload, Workload::Replay | Workload::Mixed))
    {
        for t in targets.iter().filter(|t| !t.peer && !t.one_writer_only) {
            warm_replays(t.addr, false).await;
        }
    }
    let mut results: Vec<(&Spec, HashMap<&str, Result_>)> = Vec::new();
    let mut flushes_per_write = HashMap::new();
    // Where a write's time goes at 1 connection: oncegate's phase histograms over those rounds.
    let mut phases: Option<Vec<(String, f64, f64, f64)>> = None;
    let mut fsync: Option<fsync_probe::Probe> = None;
    let mut layouts: Option<(fsync_probe::Probe, fsync_probe::Probe)> = None;
    for spec in specs {
        let mut per: HashMap<&str, Result_> = HashMap::new();
        let one_writer = spec.workload == Workload::Write && spec.conns == 1;
        let phases_before = if one_writer {
            Some(phase_buckets(og_admin).await)
        } else {
            None
        };
        for _ in 0..rounds {
            for t in &targets {
                let before = if t.name == "oncegate" {
                    Some((
                        metric(og_admin, "oncegate_store_flush_seconds_count").await,
                        metric(og_admin, "oncegate_requests_total{").await,
                    ))
                } else {
                    None
                };
                if t.peer && !matches!(spec.workload, Workload::Write | Workload::Replay) {
                    continue;
                }
                if t.one_writer_only && !one_writer {
                    continue;
                }
                if t.peer && spec.workload == Workload::Replay {
                    warm_replays(t.addr, true).await;
                }
                let pids: Vec<u32> = t.pid.into_iter().chain(t.redis).collect();
                let r = drive_all(&[t.addr], spec.workload, spec.conns, dur, &pids, t.peer).await;
                if let Some((f0, _)) = before {
                    let f1 = metric(og_admin, "oncegate_store_flush_seconds_count").await;
                    if spec.workload == Workload::Write {
                        let e = flushes_per_write.entry(spec.conns).or_insert((0.0, 0u64));
                        e.0 += f1 - f0;
                        e.1 += r.requests;
                    }
                }
                per.entry(t.name).or_default().merge(r);
            }
        }
        let line: Vec<String> = targets
            .iter()
            .filter(|t| per.contains_key(t.name))
            .map(|t| {
                let r = &per[t.name];
                match r.cpu_us().filter(|_| t.pid.is_some()) {
                    Some(us) => format!("{} {:.0} req/s ({us:.0} µs CPU/req)", t.name, r.rps()),
                    None => format!("{} {:.0} req/s", t.name, r.rps()),
                }
            })
            .collect();
        println!("{}: {}", spec.name, line.join(", "));
        if let Some(before) = phases_before {
            // The other targets' rounds run in between, but only oncegate's writes are counted.
            phases = Some(scrape::phase_quantiles(
                &before,
                &phase_buckets(og_admin).await,
            ));
            // What an fdatasync costs on the store's disk, right after: the 1-connection
            // targets are set against it.
            let probe = fsync_probe::measure(&og_dir, 2000);
            println!(
                "fdatasync on the store's disk: median {:.0} µs, p99 {:.0} µs, {} µs of CPU per frame made durable",
                probe.q(0.5),
                probe.q(0.99),
                probe.cpu_us_per_sync().map_or("-".into(), |c| format!("{c:.0}"))
            );
            fsync = Some(probe);
            // What recycling the log's files buys: frames over written blocks against a new
            // file extended with zeros as it fills.
            let (ahead, growing) = fsync_probe::compare_layouts(&og_dir, 3000);
            println!(
                "a durable append: written ahead p99.9 {:.0} µs, in a growing file p99.9 {:.0} µs",
                ahead.q(0.999),
                growing.q(0.999)
            );
            layouts = Some((ahead, growing));
        }
        results.push((spec, per));
    }
    // Preloads run with the full report, or when `BENCH_ONLY` names them (`stored`).
    let preloads: Vec<usize> = if only.is_empty() || only.contains("stored") {
        preloads
    } else {
        Vec::new()
    };
    if let Ok(secs) = std::env::var("BENCH_HOLD").map(|s| s.parse::<u64>().unwrap_or(60)) {
        // For profiling memory: the proxy stays up, idle, this long after the workloads.
        println!("oncegate pid {} held for {secs}s", og.id());
        tokio::time::sleep(Duration::from_secs(secs)).await;
    }
    let actions = metric(og_admin, "oncegate_actions{").await;
    let store_bytes = dir_bytes(&og_dir.join("store"));
    // Stopped as an operator would (SIGTERM), so that what it prints at exit (with `BENCH_ECHO=1`
    // and `_RJEM_MALLOC_CONF=stats_print:true`, the allocator's statistics) is seen.
    stop(&mut og).await;
    // The baseline build too: a profiler it runs under (`BENCH_WRAP`) then writes its counts.
    if let Some(mut c) = baseline {
        stop(&mut c).await;
    }
    if let Some(mut c) = no_guard {
        stop(&mut c).await;
    }
    // SIGTERM too: a profiler it runs under (`BENCH_BARE_WRAP`) then writes what it counted.
    for b in [&mut bare, &mut bare_durable] {
        stop(b).await;
    }
    for mut p in peers {
        let _ = p.kill();
        let _ = p.wait();
    }

    // A restart after a crash (with the full report, or `restart` in `BENCH_ONLY`): a round of
    // 64-connection writes on the workloads' store, SIGKILL as it ends, and the open that replays
    // the write-ahead log it left.
    let crash_restart = if only.is_empty() || only.contains("restart") {
        let (mut c, a, _) = start_oncegate(&og_dir, up);
        let r = drive(a, Workload::Write, 64, dur, None).await;
        let _ = c.kill();
        let _ = c.wait();
        let wal_bytes = dir_bytes(&og_dir.join("store").join("wal"));
        let (mut c, _, _, o) = start_measured(&og_dir, up).await;
        let _ = c.kill();
        let _ = c.wait();
        let line = format!(
            "a restart after SIGKILL at the end of {} unique writes at 64 connections (write-ahead log folder {:.0} MiB, its spare included; the filter of held ids {}): {:.2} s to ready, RSS peaked at {:.0} MiB while opening and was {:.0} MiB a second later",
            r.requests,
            wal_bytes as f64 / 1048576.0,
            o.ids_said(),
            o.ready,
            o.peak_kib as f64 / 1024.0,
            o.after_kib as f64 / 1024.0
        );
        println!("{line}");
        Some(line)
    } else {
        None
    };

    // Write throughput with many actions already stored.
    let mut preload_rows = Vec::new();
    for n in &preloads {
        let d = tmp.path().join(format!("pre-{n}"));
        std::fs::create_dir_all(&d).unwrap();
        let t = Instant::now();
        preload(&d.join("store"), *n).await;
        let load_secs = t.elapsed().as_secs_f64();
        // Memory and time to ready right after a restart on this many actions, before any
        // request: first an open that reads every pointer (the filter of held ids the
        // preload's close saved is removed, as for a store without one), then, after a clean
        // stop, one that loads the filter that stop saved.
        std::fs::remove_file(d.join("store").join("ids.filter")).unwrap();
        let mut opens = Vec::new();
        let (mut c, a) = loop {
            let (mut c, a, _, opened) = start_measured(&d, up).await;
            opens.push(opened);
            if opens.len() == 2 {
                break (c, a);
            }
            stop(&mut c).await;
        };
        let mut r = Result_::default();
        for _ in 0..rounds {
            r.merge(drive(a, Workload::Write, 64, dur, Some(c.id())).await);
        }
        let _ = c.kill();
        let _ = c.wait();
        // And after that SIGKILL: the open replays the write-ahead log the writes left, with
        // the filter the last checkpoint saved.
        let (mut c, _, _, opened) = start_measured(&d, up).await;
        opens.push(opened);
        let _ = c.kill();
        let _ = c.wait();
        println!(
            "unique writes, 64 connections, {n} stored: {:.0} req/s (preload {load_secs:.1}s)",
            r.rps()
        );
        preload_rows.push((*n, r, load_secs, dir_bytes(&d.join("store")), opens));
    }
    // A paced run of 100,000 unique writes on a fresh store (`paced` in `BENCH_ONLY`).
    let paced_run = if only.is_empty() || only.contains("paced") {
        let d = tmp.path().join("paced");
        std::fs::create_dir_all(&d).unwrap();
        let (mut c, a, _) = start_oncegate(&d, up);
        // A quick run (`--quick`) paces a tenth.
        let total = if secs < 2.0 {
            PACED_WRITES / 10
        } else {
            PACED_WRITES
        };
        let p = paced(a, total, FLOOR_RATE, c.id()).await;
        let _ = c.kill();
        let _ = c.wait();
        println!("paced: {}", p.describe());
        Some(p)
    } else {
        None
    };
    if let Some((mut c, _)) = nginx {
        // SIGTERM: the master stops its workers too (SIGKILL would orphan them).
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        let _ = c.wait();
    }

    // The floor under the sled store, with nothing else running (`floor` in `BENCH_ONLY`).
    let floors = (only.is_empty() || only.contains("floor")).then(|| {
        let fast = sled_alone::measure((secs * 2.0).max(2.0), None);
        println!(
            "sled alone, one thread as fast as it goes: {}",
            fast.describe()
        );
        let rated = sled_alone::measure(if secs < 2.0 { 5.0 } else { 25.0 }, Some(FLOOR_RATE));
        println!("sled alone, {FLOOR_RATE} writes/s: {}", rated.describe());
        (fast, rated)
    });

    // The report.
    let mut md = String::new();
    md.push_str("# oncegate side by side\n\n");
    md.push_str(&format!(
        "Generated by `{}`. Machine: {}. \
         Each workload ran {rounds} round(s) of {secs:.0} s per target, interleaved; load \
         generator, upstream and proxy share the machine. Latencies in µs. oncegate's store \
         was warmed first, as a sidecar's is once it has run a while: {WARM} actions written \
         and the store stopped cleanly, leaving its write-ahead log spares of {} MiB to start \
         in (a new store's first two log files are extended with zeros as they fill; `cargo \
         bench --bench store` compares a new store's first writes with a restarted one's). \
         Opening it, oncegate's RSS peaked at {:.0} MiB (VmHWM once ready).\n\n",
        invocation(),
        machine(),
        warmed
            .iter()
            .map(|b| format!("{:.0}", *b as f64 / (1 << 20) as f64))
            .collect::<Vec<_>>()
            .join(" and "),
        og_opened.peak_kib as f64 / 1024.0
    ));
    md.push_str("| workload | target | req/s | p50 | p99 | p99.9 | errors | peak RSS (MiB) | proxy CPU per request (µs) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (spec, per) in &results {
        for t in &targets {
            let Some(r) = per.get(t.name) else { continue };
            md.push_str(&format!(
                "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {} |\n",
                spec.name,
                t.name,
                r.rps(),
                r.q(0.5),
                r.q(0.99),
                r.q(0.999),
                r.errors,
                if t.pid.is_some() {
                    format!("{:.1}", r.peak_rss_kib as f64 / 1024.0)
                } else {
                    "-".into()
                },
                r.cpu_us()
                    .filter(|_| t.pid.is_some())
                    .map_or("-".into(), |us| format!("{us:.0}")),
            ));
        }
    }
    md.push_str("\n## Ratios (same run)\n\n`bare hyper` is oncegate's HTTP stack alone (hyper-util's server and pooled client, forwarding everything, nothing stored): the floor of what oncegate can cost.\n\n| workload | oncegate / nginx (req/s) | the same, round by round | oncegate / direct (req/s) | oncegate / bare hyper (req/s) | bare hyper / nginx (req/s) | p50 oncegate − nginx (µs) |\n|---|---:|---:|---:|---:|---:|---:|\n");
    for (spec, per) in &results {
        let og = &per["oncegate"];
        let direct = &per["direct"];
        let (vs_nginx, by_round, dp50) = match per.get("nginx") {
            Some(n) => (
                format!("{:.2}×", og.rps() / n.rps()),
                og.rounds_rps
                    .iter()
                    .zip(&n.rounds_rps)
                    .map(|(o, n)| format!("{:.2}×", o / n))
                    .collect::<Vec<_>>()
                    .join(", "),
                format!("{:+.0}", og.q(0.5) - n.q(0.5)),
            ),
            None => ("no nginx".into(), "-".into(), "-".into()),
        };
        let bare = &per["bare hyper"];
        let bare_vs_nginx = match per.get("nginx") {
            Some(n) => format!("{:.2}×", bare.rps() / n.rps()),
            None => "no nginx".into(),
        };
        md.push_str(&format!(
            "| {} | {} | {} | {:.2}× | {:.2}× | {} | {} |\n",
            spec.name,
            vs_nginx,
            by_round,
            og.rps() / direct.rps(),
            og.rps() / bare.rps(),
            bare_vs_nginx,
            dp50
        ));
    }
    twin_guard_report(&mut md, &results);
    budgets(&mut md, &results);
    peer_report(&mut md, &results);
    if let Some(phases) = &phases {
        md.push_str("\n## Where a write's time goes (1 connection)\n\nFrom oncegate's own histograms (`oncegate_write_phase_seconds`, `oncegate_store_flush_seconds`) over the rounds of unique durable writes at 1 connection: each value is the upper bound of the bucket (×2 apart) that holds the quantile. `claim` and `settle` each include one durable flush (`fdatasync`); `send` is the upstream's answer.\n\n| phase | count | p50 ≤ (µs) | p99 ≤ (µs) |\n|---|---:|---:|---:|\n");
        for (phase, n, p50, p99) in phases {
            md.push_str(&format!("| {phase} | {n:.0} | {p50:.0} | {p99:.0} |\n"));
        }
    }
    if let Some(probe) = &fsync {
        fsync_targets(&mut md, probe, &results);
    }
    if let Some((ahead, growing)) = &layouts {
        md.push_str(&format!("\nA durable append (a `pwrite` of 2 KiB and its `fdatasync`, timed together; {} each) in a file whose blocks are written already, as a recycled log file takes its frames, and in a new file extended with zeros a megabyte at a time as it fills, as a new log file does (`fsync_probe::compare_layouts`):\n\n| file | p50 (µs) | p99 (µs) | p99.9 (µs) | max (µs) | CPU per append (µs) |\n|---|---:|---:|---:|---:|---:|\n", ahead.len()));
        for (name, p) in [
            ("written already (recycled)", ahead),
            ("growing (new)", growing),
        ] {
            md.push_str(&format!(
                "| {name} | {:.0} | {:.0} | {:.0} | {:.0} | {} |\n",
                p.q(0.5),
                p.q(0.99),
                p.q(0.999),
                p.q(1.0),
                p.cpu_us_per_sync()
                    .map_or("-".into(), |c| format!("{c:.0}"))
            ));
        }
    }
    md.push_str("\n## Durability and storage\n\n");
    for (conns, (flushes, writes)) in &flushes_per_write {
        md.push_str(&format!(
            "- unique writes at {conns} connection(s): {:.3} durable flushes (fdatasync of the write-ahead log) per write ({} flushes for {} writes)\n",
            flushes / (*writes).max(1) as f64,
            *flushes as u64,
            writes
        ));
    }
    md.push_str(&format!(
        "- bytes on disk per stored action (records, stored bodies and write-log entries, sled's own overhead included): {:.0} ({} bytes for {} actions)\n",
        store_bytes as f64 / actions.max(1.0),
        store_bytes,
        actions
    ));
    for (n, r, load, bytes, opens) in &preload_rows {
        let (scanned, loaded, crashed) = (opens[0], opens[1], opens[2]);
        let mib = |kib: u64| kib as f64 / 1024.0;
        md.push_str(&format!(
            "- unique writes at 64 connections with {n} actions already stored: {:.0} req/s (p99 {:.0} µs, peak RSS {:.0} MiB); a second after a restart on them, RSS {:.0} MiB (peak while opening {:.0}) and {:.2} s to ready when the open loads the filter of held ids a clean stop saved (here: {}); {:.0} MiB (peak {:.0}) and {:.2} s after a SIGKILL at the end of those writes, with the filter the last checkpoint saved (here: {}) and the write-ahead log replayed; {:.0} MiB (peak {:.0}) and {:.2} s when it reads every pointer instead (here: {}) (no saved filter, or once the store holds about 2.7 times the ids the last such reading found); preload took {load:.1} s; store {:.0} MiB\n",
            r.rps(),
            r.q(0.99),
            r.peak_rss_kib as f64 / 1024.0,
            mib(loaded.after_kib),
            mib(loaded.peak_kib),
            loaded.ready,
            loaded.ids_said(),
            mib(crashed.after_kib),
            mib(crashed.peak_kib),
            crashed.ready,
            crashed.ids_said(),
            mib(scanned.after_kib),
            mib(scanned.peak_kib),
            scanned.ready,
            scanned.ids_said(),
            *bytes as f64 / 1048576.0
        ));
    }
    if let Some(p) = &paced_run {
        md.push_str(&format!("- a paced run of {}\n", p.describe()));
    }
    if let Some(line) = &crash_restart {
        md.push_str(&format!("- {line}\n"));
    }
    if preload_rows.len() == 2 {
        md.push_str(&format!(
            "- write throughput at {} stored / at {} stored: {:.2}×\n",
            preload_rows[1].0,
            preload_rows[0].0,
            preload_rows[1].1.rps() / preload_rows[0].1.rps()
        ));
    }
    if let Some((fast, rated)) = &floors {
        md.push_str(&format!("\n## The floor under the sled store\n\n`sled alone` makes only the sled operations one durable write ends in (the insert of the record with its small body after it under its creation key, the read and write of the bucket its pointer goes in, and an expiry index entry for every {} writes, as a batch of the store's shares one; keys and a value of the store's own form, a packed write record of about 450 bytes and its body), on one thread, with sled configured as the store configures it, in a process of its own with oncegate's allocator, after the workloads above. No write-ahead log, fsync, encoding, write log or HTTP (`benches/support/sled_alone.rs`).\n\n", sled_alone::EXPIRIES_A_BATCH));
        md.push_str(&format!(
            "- as fast as one thread goes: {}\n",
            fast.describe()
        ));
        md.push_str(&format!(
            "- at {FLOOR_RATE} writes/s: {}\n",
            rated.describe()
        ));
        let find = |name: &str| results.iter().find(|(s, _)| s.name == name).map(|(_, p)| p);
        if let Some(per) = find("unique durable writes, 64 connections") {
            let cpu = |t: &str| per.get(t).and_then(Result_::cpu_us);
            if let (Some(og), Some(bare)) = (cpu("oncegate"), cpu("bare hyper")) {
                md.push_str(&format!(
                    "- CPU per unique write at 64 connections: oncegate {og:.0} µs; the floor, bare hyper's forwarding plus sled alone, {bare:.0} + {:.0} = {:.0} µs\n",
                    fast.cpu_us_per_write,
                    bare + fast.cpu_us_per_write
                ));
            }
            if let Some(b) = budget(per, WRITE_TARGET) {
                md.push_str(&format!(
                    "- the budget at the target (above): at most {b:.0} µs of proxy CPU per write\n"
                ));
            }
        }
        if let Some(per) = find("mixed agent workload, 64 connections") {
            md.push_str(&format!(
                "- the mixed workload made about {:.0} new writes/s through oncegate (15% of its requests)\n",
                per["oncegate"].rps() * 0.15
            ));
        }
    }
    targets_report(
        &mut md,
        &results,
        fsync.as_ref(),
        floors.as_ref().map(|f| &f.0),
        flushes_per_write
            .get(&64)
            .map(|(flushes, writes)| flushes / (*writes).max(1) as f64),
        actions,
    );
    reads::report(&mut md, |w, conns| {
        results
            .iter()
            .find(|(s, _)| s.workload == w && s.conns == conns)
            .map(|(_, p)| p)
    });
    print!("{md}");
    if let Some(p) = out {
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(&p, md).unwrap();
        eprintln!("wrote {}", p.display());
    }
}

/// oncegate against `idempotent-proxy-server` (same load generator, upstream and rounds).
fn peer_report(md: &mut String, results: &[(&Spec, HashMap<&str, Result_>)]) {
    let rows: Vec<_> = results
        .iter()
        .filter(|(_, per)| per.contains_key(PEER_VOLATILE) || per.contains_key(PEER_DURABLE))
        .collect();
    if rows.is_empty() {
        return;
    }
    md.push_str(&format!(
        "\n## Against the closest peer: idempotent-proxy-server {PEER_VERSION}\n\n\
         What each side keeps. **oncegate**: every write's record is made durable (fdatasync of \
         its write-ahead log) before the request leaves and again with its outcome before the \
         client hears it, with its write-log entries; kept for `retention` (24 h); a key works \
         without the client sending one. **The peer** (crates.io, Redis-backed): needs an \
         `Idempotency-Key` on every request; its record lives in Redis for 10 s (its \
         `REQUEST_TIMEOUT`, also its TTL), is deleted when the upstream does not answer (so a \
         retry re-sends), and is as durable as its Redis: without persistence (its usual setup) \
         nothing reaches the disk; with `appendfsync always` Redis fsyncs every command. The \
         peer's CPU and RSS include its Redis.\n\n\
         | workload | oncegate / peer without persistence (req/s) | oncegate / peer fsync always (req/s) | p50 / p99 oncegate (µs) | p50 / p99 peer without persistence | p50 / p99 peer fsync always | CPU per request: oncegate / peer without / peer always (µs) | peak RSS: oncegate / peer without / peer always (MiB) |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n"
    ));
    for (spec, per) in rows {
        let og = &per["oncegate"];
        let ratio = |name: &str| {
            per.get(name)
                .map_or("-".to_string(), |p| format!("{:.2}×", og.rps() / p.rps()))
        };
        let lat = |r: Option<&Result_>| {
            r.map_or("-".to_string(), |r| {
                format!("{:.0} / {:.0}", r.q(0.5), r.q(0.99))
            })
        };
        let cpu = |r: Option<&Result_>| {
            r.and_then(Result_::cpu_us)
                .map_or("-".to_string(), |c| format!("{c:.0}"))
        };
        let rss = |r: Option<&Result_>| {
            r.map_or("-".to_string(), |r| {
                format!("{:.0}", r.peak_rss_kib as f64 / 1024.0)
            })
        };
        let (v, d) = (per.get(PEER_VOLATILE), per.get(PEER_DURABLE));
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} / {} / {} | {} / {} / {} |\n",
            spec.name,
            ratio(PEER_VOLATILE),
            ratio(PEER_DURABLE),
            lat(Some(og)),
            lat(v),
            lat(d),
            cpu(Some(og)),
            cpu(v),
            cpu(d),
            rss(Some(og)),
            rss(v),
            rss(d),
        ));
    }
}

/// The write path's targets in one table: each with its bound, what this run measured, and, where
/// one applies, the floor measured in the same run that no proxy on this stack can go below.
fn targets_report(
    md: &mut String,
    results: &[(&Spec, HashMap<&str, Result_>)],
    probe: Option<&fsync_probe::Probe>,
    floor: Option<&sled_alone::Floor>,
    flushes_64: Option<f64>,
    actions: f64,
) {
    let find = |w: Workload, conns: usize| {
        results
            .iter()
            .find(|(s, _)| s.workload == w && s.conns == conns)
            .map(|(_, p)| p)
    };
    let verdict = |ok: bool| (if ok { "met" } else { "not met" }).to_string();
    let mut rows: Vec<[String; 4]> = Vec::new();
    // oncegate's throughput against the peer without persistence, in a workload at 64
    // connections, as a row with its bound.
    let against_peer = |rows: &mut Vec<[String; 4]>, w: Workload, target: &str, bound: f64| {
        let per = find(w, 64);
        if let Some((og, peer)) =
            per.and_then(|p| Some((p.get("oncegate")?, p.get(PEER_VOLATILE)?)))
        {
            let r = og.rps() / peer.rps();
            rows.push([
                target.into(),
                format!("{r:.2}×"),
                verdict(r >= bound),
                "-".into(),
            ]);
        }
    };
    against_peer(
        &mut rows,
        Workload::Write,
        "unique writes, 64 connections ≥ 1.0× the peer without persistence",
        1.0,
    );
    let w64 = find(Workload::Write, 64);
    if let Some(cpu) = w64.and_then(|p| p.get("oncegate")?.cpu_us()) {
        // What durability itself costs the kernel: oncegate's flushes per write in this run,
        // each at what the probe's thread spent to make one frame durable.
        let durable = probe
            .and_then(|p| p.cpu_us_per_sync())
            .zip(flushes_64)
            .map(|(each, per_write)| (per_write * each, per_write, each));
        let floor = match (w64.and_then(|p| p.get("bare hyper")?.cpu_us()), floor) {
            (Some(bare), Some(f)) => {
                let total = bare + f.cpu_us_per_write + durable.map_or(0.0, |d| d.0);
                let flushes = durable.map_or(String::new(), |(us, per_write, each)| {
                    format!(
                        " + durable flushes {us:.0}: {per_write:.3} a write × {each:.0} µs of CPU each, from the fdatasync probe"
                    )
                });
                format!(
                    "{total:.0} µs (bare hyper {bare:.0} + sled alone {:.0}{flushes}); oncegate {:.1}× it",
                    f.cpu_us_per_write,
                    cpu / total
                )
            }
            _ => "-".into(),
        };
        rows.push([
            "CPU per unique write ≤ 100 µs".into(),
            format!("{cpu:.0} µs"),
            verdict(cpu <= 100.0),
            floor,
        ]);
    }
    let w1 = find(Workload::Write, 1);
    if let (Some(per), Some(probe)) = (w1, probe) {
        if let Some(og) = per.get("oncegate") {
            let (median, p99) = (probe.q(0.5), probe.q(0.99));
            let bare = per.get("bare hyper");
            // Measured where it ran: bare hyper with the two durable appends of a write.
            let durable = per.get(BARE_DURABLE);
            let measured = |q: f64| {
                durable.map_or(String::new(), |d| {
                    format!("; {BARE_DURABLE}, measured: {:.0} µs", d.q(q))
                })
            };
            let bound = p50_bound(probe);
            // A bound below what bare hyper with the two durable appends measured, in the same
            // run, is out of reach of any proxy on this stack: that floor does no work of its own.
            let p50 = og.q(0.5);
            let p50_verdict = match durable.map(|d| d.q(0.5)) {
                Some(f) if p50 > bound && f > bound => format!(
                    "not met; out of reach in this run: `{BARE_DURABLE}` measured {:.0} µs over the bound",
                    f - bound
                ),
                _ => verdict(p50 <= bound),
            };
            let over = durable.map_or(String::new(), |d| {
                format!("; oncegate {:+.0} µs over it", p50 - d.q(0.5))
            });
            rows.push([
                format!("1 connection: p50 ≤ 2 × fdatasync median + 100 µs = {bound:.0} µs"),
                format!("{p50:.0} µs"),
                p50_verdict,
                bare.map_or("-".into(), |b| {
                    format!(
                        "{:.0} µs (two fdatasync medians and bare hyper's p50){}{over}",
                        2.0 * median + b.q(0.5),
                        measured(0.5)
                    )
                }),
            ]);
            rows.push([
                "1 connection: p99 ≤ 1.5 ms".into(),
                format!("{:.0} µs", og.q(0.99)),
                verdict(og.q(0.99) <= 1500.0),
                bare.map_or("-".into(), |b| {
                    format!(
                        "bare hyper's own p99 {:.0} µs; fdatasync p99 {p99:.0} µs, two per write{}",
                        b.q(0.99),
                        measured(0.99)
                    )
                }),
            ]);
        }
    }
    let peaks: Vec<f64> = [Workload::Write, Workload::Replay, Workload::Mixed]
        .iter()
        .filter_map(|&w| find(w, 64)?.get("oncegate"))
        .map(|r| r.peak_rss_kib as f64 / 1024.0)
        .collect();
    if let Some(peak) = peaks.iter().copied().reduce(f64::max) {
        rows.push([
            format!("peak RSS ≤ 96 MiB in writes, replays and mixed at 64 connections ({actions:.0} actions stored at the end)"),
            format!("{peak:.0} MiB"),
            verdict(peak <= 96.0),
            floor.map_or("-".into(), |f| format!("sled alone: {:.0} MiB peak", f.peak_rss_mib)),
        ]);
    }
    against_peer(&mut rows, Workload::Replay, "replays ≥ 3× the peer", 3.0);
    if rows.is_empty() {
        return;
    }
    md.push_str("\n## The write path's targets, in this run\n\nEach target with what this run measured; where one is not met, the floor beside it was measured in the same run: what a proxy on this stack (hyper's server and client, sled as the store configures it, this disk) pays before any work of its own.\n\n| target | measured | | floor (same run) |\n|---|---:|---|---|\n");
    for [t, m, v, f] in rows {
        md.push_str(&format!("| {t} | {m} | {v} | {f} |\n"));
    }
}

/// The command that made this report, with the settings that shaped it (`BENCH_ONLY`,
/// `BENCH_ROUNDS`, `BENCH_SECS`, `BENCH_PEER`, `BENCH_TWIN_OFF`) and its arguments.
fn invocation() -> String {
    let mut cmd: Vec<String> = [
        "BENCH_ONLY",
        "BENCH_ROUNDS",
        "BENCH_SECS",
        "BENCH_PEER",
        "BENCH_TWIN_OFF",
        "BENCH_BASELINE",
    ]
    .iter()
    .filter_map(|k| {
        let v = std::env::var(k).ok()?;
        Some(if v.contains(|c: char| !c.is_ascii_alphanumeric()) {
            format!("{k}='{v}'")
        } else {
            format!("{k}={v}")
        })
    })
    .collect();
    cmd.push("cargo bench --bench side_by_side --".into());
    cmd.extend(std::env::args().skip(1).filter(|a| a != "--bench"));
    cmd.join(" ")
}

/// The 1-connection p50 bound, set against what one fdatasync costs on the store's disk in this
/// run: a durable write makes two (its claim before it is sent, its outcome before it is
/// answered).
fn p50_bound(probe: &fsync_probe::Probe) -> f64 {
    2.0 * probe.q(0.5) + 100.0
}

/// What one fdatasync costs on the store's disk in this run, and the 1-connection floors set
/// against it (the verdicts are in the targets' table, [`targets_report`]).
fn fsync_targets(
    md: &mut String,
    probe: &fsync_probe::Probe,
    results: &[(&Spec, HashMap<&str, Result_>)],
) {
    let median = probe.q(0.5);
    md.push_str(&format!(
        "\n## Against the disk (1 connection)\n\nfdatasync alone on the store's disk, right after the 1-connection rounds: median {median:.0} µs, p99 {:.0} µs ({} overwrites of 2 KiB in a file written ahead, each made durable, as the write-ahead log does; `benches/support/fsync_probe.rs`){}.\n\n",
        probe.q(0.99),
        probe.len(),
        probe.cpu_us_per_sync().map_or(String::new(), |c| format!(
            "; the probe's thread spent {c:.0} µs of CPU per frame made durable (its `pwrite` and `fdatasync`, in the kernel)"
        ))
    ));
    let Some(per) = results
        .iter()
        .find(|(s, _)| s.workload == Workload::Write && s.conns == 1)
        .map(|(_, per)| per)
    else {
        return;
    };
    let Some(r) = per.get("oncegate") else {
        return;
    };
    md.push_str(&format!(
        "| | p50 (µs) | p99 (µs) |\n|---|---:|---:|\n| oncegate | {:.0} | {:.0} |\n| the bound: 2 × fdatasync median + 100 µs; 1.5 ms | {:.0} | 1500 |\n",
        r.q(0.5),
        r.q(0.99),
        p50_bound(probe),
    ));
    if let Some(bare) = per.get("bare hyper") {
        md.push_str(&format!(
            "| the floor added up: two fdatasync medians and bare hyper's p50 | {:.0} | |\n",
            2.0 * median + bare.q(0.5)
        ));
    }
    if let Some(d) = per.get(BARE_DURABLE) {
        md.push_str(&format!(
            "| the floor measured: `{BARE_DURABLE}` (bare hyper appending a claim-sized and a settlement-sized frame to a log and fdatasyncing each on the request's thread, before forwarding and before answering; `benches/support/append_log.rs`) | {:.0} | {:.0} |\n",
            d.q(0.5),
            d.q(0.99)
        ));
    }
}
