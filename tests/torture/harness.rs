//! The torture harness itself (see `tests/torture.rs` for what it checks and how to run it):
//! the counting upstream with its faults, the clients and their book of what each write saw,
//! the proxies it kills, stops and pauses, and the final reckoning against the upstream's own
//! record.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rand::Rng;
use serde_json::Value;

use crate::support::ChildProxy;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One logical time for the whole harness: upstream receipts and client observations are
/// ordered on it.
static TICK: AtomicU64 = AtomicU64::new(1);
fn tick() -> u64 {
    TICK.fetch_add(1, Ordering::SeqCst)
}

#[derive(Clone, Copy)]
pub(crate) struct Faults {
    pub(crate) stall: f64,
    pub(crate) drop: f64,
    pub(crate) unavailable: f64,
    /// Applied only after the proxy's timeout (then answered, too late).
    pub(crate) late: f64,
}

impl Faults {
    /// The crash runs' upstream: 5% of requests stall, 5% are dropped, 5% answer 503.
    pub(crate) const MIX: Faults = Faults {
        stall: 0.05,
        drop: 0.05,
        unavailable: 0.05,
        late: 0.0,
    };
}

/// How long a client of the lookup mode keeps coming back to an unknown write: well within the
/// mode's 3 s retention, which counts from the settlement (a client that came back after it
/// would rightly meet a new action).
const RETURN_FOR: Duration = Duration::from_millis(1_200);

/// How long a late write takes to apply: past the proxy's `timeout` (150 ms), well within the
/// lookup's `absent_after` (the lookup mode's 5 s). With 2 s, three of these runs at once on two
/// loaded cores sometimes applied a late write after it: its lookup had said absent by then, and
/// the retry went out as the contract of `absent_after` says it may (about one run in four had
/// a write applied twice, before and after log recycling alike; none in fifteen with 5 s or 10
/// s).
const LATE: Duration = Duration::from_millis(400);

/// What the upstream did with one request of a logical write.
#[derive(Clone, Debug)]
struct Receipt {
    at: u64,
    applied: bool,
    /// The key the proxy sent with it.
    key: String,
}

/// A quarter of the keys cannot be looked up (the lookup answers 503): those writes stay
/// unknown for good, across many retentions.
fn unsearchable(key: &str) -> bool {
    key.bytes().map(u32::from).sum::<u32>() % 4 == 0
}

/// The counting upstream: its record is the truth the checker compares against.
#[derive(Default)]
struct Ledger {
    receipts: Mutex<HashMap<String, Vec<Receipt>>>,
    executions: AtomicU64,
    /// What each applied write answered, by the key it carried: the status lookup's view.
    by_key: Mutex<HashMap<String, String>>,
}

async fn upstream_handle(
    ledger: Arc<Ledger>,
    faults: Faults,
    req: http::Request<hyper::body::Incoming>,
) -> Result<http::Response<Full<Bytes>>, BoxError> {
    if let Some(key) = req.uri().path().strip_prefix("/lookup/") {
        // The status lookup: the write as the upstream holds it, or 404 (not yet, or never).
        if unsearchable(key) {
            let mut r = http::Response::new(Full::new(Bytes::new()));
            *r.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
            return Ok(r);
        }
        let found = ledger.by_key.lock().unwrap().get(key).cloned();
        let mut r = http::Response::new(Full::new(Bytes::from(found.clone().unwrap_or_default())));
        if found.is_none() {
            *r.status_mut() = http::StatusCode::NOT_FOUND;
        }
        return Ok(r);
    }
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = req.into_body().collect().await?.to_bytes();
    let write = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["write"].as_str().map(str::to_string))
        .unwrap_or_default();
    let roll: f64 = rand::rng().random();
    let applied = roll >= faults.unavailable;
    let late = applied && roll - faults.unavailable >= 1.0 - faults.unavailable - faults.late;
    // A late write is recorded applied only once it takes effect: a service that loses the
    // connection first (the proxy killed meanwhile) never applies it.
    let receipt = {
        let mut receipts = ledger.receipts.lock().unwrap();
        let list = receipts.entry(write.clone()).or_default();
        list.push(Receipt {
            at: tick(),
            applied: applied && !late,
            key: key.clone(),
        });
        list.len() - 1
    };
    if !applied {
        let mut r = http::Response::new(Full::new(Bytes::from_static(b"{}")));
        *r.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
        return Ok(r);
    }
    let roll = roll - faults.unavailable;
    if late {
        // The service is slow: the write takes effect after the proxy gave up waiting.
        tokio::time::sleep(LATE).await;
        ledger.receipts.lock().unwrap().get_mut(&write).unwrap()[receipt].applied = true;
    }
    let exec = ledger.executions.fetch_add(1, Ordering::SeqCst);
    let answer = format!(r#"{{"exec":{exec},"write":"{write}"}}"#);
    ledger.by_key.lock().unwrap().insert(key, answer.clone());
    if late {
        let mut r = http::Response::new(Full::new(Bytes::from(answer)));
        *r.status_mut() = http::StatusCode::CREATED;
        return Ok(r);
    }
    if roll < faults.stall {
        // Applied, then the answer never comes.
        tokio::time::sleep(Duration::from_secs(3600)).await;
    } else if roll < faults.stall + faults.drop {
        // Applied, then the connection drops: a failing service makes hyper close it unanswered.
        return Err("drop".into());
    }
    let mut r = http::Response::new(Full::new(Bytes::from(answer)));
    *r.status_mut() = http::StatusCode::CREATED;
    Ok(r)
}

async fn start_upstream(ledger: Arc<Ledger>, faults: Faults) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let ledger = ledger.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| upstream_handle(ledger.clone(), faults, req));
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) enum Mode {
    Key,
    Keyless,
    TaskStep,
    /// A new key on every try of the same body, as stripe-python draws one for every call: on
    /// a route with `client_keys = "per-call"`.
    PerCall,
    /// The same client on a route that keeps `stable` keys: only the unsettled-twin guard
    /// stands between its tool loop's new calls and a second charge, so it stops at an unknown
    /// answer. Its transport retries keep their key, as an SDK's own retries of one call do.
    NewKey,
}

impl Mode {
    /// Whether this client draws a new key for every try.
    fn new_key_per_try(self) -> bool {
        matches!(self, Mode::PerCall | Mode::NewKey)
    }

    fn path(self) -> &'static str {
        match self {
            Mode::PerCall => "/pay/v1/percall/charges",
            _ => "/pay/v1/charges",
        }
    }
}

/// What a client learned about one logical write.
#[derive(Default, Debug)]
struct Seen {
    success: Option<(u16, Bytes)>,
    /// The key suffix of the request that succeeded (only a broken client changes it).
    suffix: u64,
    unknown_at: Option<u64>,
    /// When the first unknown answer came (a client comes back to it for a while).
    unknown_since: Option<Instant>,
    /// The key suffix of the action that was unknown (a client drawing keys per try learns it
    /// from the answer: its own, or the twin's that a `possible-duplicate` names).
    unknown_suffix: u64,
    exhausted: bool,
}

#[derive(Default)]
struct Book {
    writes: Mutex<HashMap<String, (Mode, usize, u64, Seen)>>,
    violations: Mutex<Vec<String>>,
}

pub(crate) struct Options {
    pub(crate) kills: usize,
    pub(crate) clients: usize,
    pub(crate) faults: Faults,
    /// A deliberately broken client: a new key on every retry after an unknown answer.
    pub(crate) broken_client: bool,
    /// The unsettled-twin guard (off only to show the checker catching the broken client).
    pub(crate) twin_guard: bool,
    /// Without kills: how many writes each client makes.
    pub(crate) writes_per_client: usize,
    /// Proxies sharing the store (more than one needs PostgreSQL).
    pub(crate) proxies: usize,
    /// A PostgreSQL database URL: the fleet's store instead of sled.
    pub(crate) postgres: Option<String>,
    /// Milliseconds between kills, drawn from this range.
    pub(crate) kill_gap: (u64, u64),
    /// A status lookup, a 3 s retention, and clients that come back to an unknown write.
    pub(crate) lookup: bool,
    /// Every fourth event pauses a proxy (SIGSTOP, then SIGCONT) for this long instead of
    /// killing it: a GC pause, a frozen VM, `docker pause`.
    pub(crate) pause_for: Option<Duration>,
    /// The fleet's own PostgreSQL server, crashed (an immediate shutdown) and started again
    /// half-way through the events.
    pub(crate) db_crash: Option<Arc<Mutex<crate::support::pg_server::PgServer>>>,
    /// Between some kills and the next start, the sled store's folder is tampered with
    /// ([`crate::tamper`]): a start on it must be refused, or find the store whole.
    pub(crate) tamper: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Report {
    pub(crate) kills: usize,
    /// Pauses (SIGSTOP, SIGCONT) of a proxy, and crashes of the database.
    pub(crate) pauses: usize,
    pub(crate) db_crashes: usize,
    /// Restarts after a clean stop (SIGTERM) instead of a kill: the store saves its filter of
    /// held ids, which the next start loads.
    pub(crate) stops: usize,
    /// Starts after a clean stop that read the ids from sled instead of loading them.
    pub(crate) stop_rescans: usize,
    /// Starts after a kill that read the ids from sled instead of loading the filter the last
    /// checkpoint (or start) saved.
    pub(crate) kill_rescans: usize,
    pub(crate) writes: usize,
    pub(crate) completed: usize,
    pub(crate) unknown: usize,
    pub(crate) exhausted: usize,
    pub(crate) duplicates: usize,
    pub(crate) lost_completed: usize,
    pub(crate) resends: usize,
    pub(crate) log_checks: usize,
    pub(crate) log_failures: usize,
    pub(crate) violations: Vec<String>,
    pub(crate) seconds: f64,
    /// Starts on a tampered store: refused (exit 74), and opened because it was whole.
    pub(crate) tamper_refused: usize,
    pub(crate) tamper_opened: usize,
}

fn request(
    mode: Mode,
    client: usize,
    n: usize,
    write: &str,
    key_suffix: u64,
) -> (Vec<(String, String)>, String) {
    let mut h = vec![
        (
            "authorization".to_string(),
            format!("Bearer agent-{client}"),
        ),
        ("content-type".to_string(), "application/json".to_string()),
    ];
    match mode {
        Mode::Key | Mode::PerCall | Mode::NewKey => {
            h.push(("idempotency-key".into(), format!("{write}-{key_suffix}")))
        }
        Mode::Keyless => {}
        Mode::TaskStep => {
            h.push(("oncegate-task".into(), format!("task-{client}")));
            h.push(("oncegate-step".into(), format!("step-{n}")));
        }
    }
    (h, format!(r#"{{"write":"{write}","amount":{n}}}"#))
}

/// The answer to a write once no proxy holds it any more. A write whose outcome a proxy could
/// not record (a 503 while the database was down, with `duplicate_risk`) stays in flight under
/// that proxy's lease; another proxy answers 409 `in-flight`, which sends nothing, until the lease
/// lapses and the action becomes `unknown`. So the final check asks again while it is in flight,
/// for longer than any lease in these runs, and judges the answer it then gets.
/// The clients' and the final check's HTTP client.
type HttpClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
>;

async fn settled_answer(
    client: &HttpClient,
    addr: SocketAddr,
    mode: Mode,
    headers: &[(String, String)],
    body: &str,
) -> Result<(u16, Option<String>, Bytes), ()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = send(client, addr, mode, headers, body).await;
        let in_flight = matches!(&r, Ok((409, Some(o), _)) if o == "in-flight");
        if !in_flight || Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn send(
    client: &HttpClient,
    addr: SocketAddr,
    mode: Mode,
    headers: &[(String, String)],
    body: &str,
) -> Result<(u16, Option<String>, Bytes), ()> {
    let mut req = http::Request::post(format!("http://{addr}{}", mode.path()));
    for (k, v) in headers {
        req = req.header(k, v);
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .map_err(|_| ())?
        .map_err(|_| ())?;
    let status = resp.status().as_u16();
    let outcome = resp
        .headers()
        .get("oncegate-outcome")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = resp.into_body().collect().await.map_err(|_| ())?.to_bytes();
    Ok((status, outcome, body))
}

async fn run_client(
    id: usize,
    opts: Arc<Options>,
    book: Arc<Book>,
    proxy: Arc<RwLock<Vec<Option<SocketAddr>>>>,
    stop: Arc<AtomicBool>,
) {
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http::<Full<Bytes>>();
    let modes = [
        Mode::Key,
        Mode::Keyless,
        Mode::TaskStep,
        Mode::PerCall,
        Mode::NewKey,
    ];
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) && (opts.kills > 0 || n < opts.writes_per_client) {
        let mode = modes[(id + n) % modes.len()];
        let write = format!("c{id}-{n}");
        book.writes
            .lock()
            .unwrap()
            .insert(write.clone(), (mode, id, 0, Seen::default()));
        let mut key_suffix = 0;
        // One logical write, retried until a definite answer.
        loop {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            // With a lookup, a client comes back to an unknown write for a while, then gives
            // up, whatever it was answered meanwhile (a retry long after, past the 3 s
            // retention of a write the lookup settled, would rightly be a new write).
            let gave_up = book.writes.lock().unwrap()[&write]
                .3
                .unknown_since
                .is_some_and(|t| t.elapsed() >= RETURN_FOR);
            if opts.lookup && gave_up {
                break;
            }
            // This client's proxy, or any other that is up.
            let up = {
                let p = proxy.read().unwrap();
                p.get(id % p.len())
                    .copied()
                    .flatten()
                    .or_else(|| p.iter().flatten().next().copied())
            };
            let Some(addr) = up else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let (headers, body) = request(mode, id, n, &write, key_suffix);
            let Ok((status, outcome, resp)) = send(&client, addr, mode, &headers, &body).await
            else {
                // The proxy died under us: whatever happened, retry the same logical write. The
                // per-call client draws a new key even for this; the guard-only one retries as
                // an SDK's own retry of one call does, with the same key: with stable keys,
                // a new key after a success whose answer was lost is a new write by design.
                if mode == Mode::PerCall {
                    key_suffix += 1;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let answer = serde_json::from_slice::<Value>(&resp).unwrap_or_default();
            let problem = answer["type"].as_str().unwrap_or_default().to_string();
            // The suffix of the key of the action an answer is about.
            let about = answer["action"]["key"]
                .as_str()
                .and_then(|k| k.rsplit('-').next())
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(key_suffix);
            enum Next {
                Done,
                Retry,
                Later,
                NewKey,
            }
            let next = {
                let mut w = book.writes.lock().unwrap();
                let seen = &mut w.get_mut(&write).unwrap().3;
                match (
                    status,
                    outcome.as_deref(),
                    problem.trim_start_matches("urn:oncegate:problem:"),
                ) {
                    (201, Some("sent" | "replayed"), _) => {
                        seen.success = Some((status, resp));
                        seen.suffix = key_suffix;
                        Next::Done
                    }
                    (_, _, "outcome-unknown" | "possible-duplicate") if mode == Mode::NewKey => {
                        // The agent tells its user the charge may have happened, and stops:
                        // after the first settles, a new key would be a new charge.
                        seen.unknown_at.get_or_insert_with(tick);
                        seen.unknown_since.get_or_insert_with(Instant::now);
                        seen.unknown_suffix = about;
                        Next::Done
                    }
                    _ if mode == Mode::NewKey && answer["duplicate_risk"] == true => {
                        // Any answer that says the write may have happened (a 503 whose
                        // outcome could not be recorded, as when another proxy settled it
                        // meanwhile): the agent stops as at an unknown answer, since a new key
                        // now would be a new charge once the first settles.
                        seen.unknown_at.get_or_insert_with(tick);
                        seen.unknown_since.get_or_insert_with(Instant::now);
                        seen.unknown_suffix = about;
                        Next::Done
                    }
                    (_, _, "possible-duplicate") if opts.broken_client => {
                        // The guard stopped the naive agent's fresh key.
                        Next::Done
                    }
                    (_, _, "outcome-unknown") => {
                        seen.unknown_at.get_or_insert_with(tick);
                        let since = *seen.unknown_since.get_or_insert_with(Instant::now);
                        if mode != Mode::PerCall {
                            seen.unknown_suffix = key_suffix;
                        }
                        if opts.broken_client && mode == Mode::Key {
                            // The naive agent: a timeout means "try again", with a fresh key.
                            Next::NewKey
                        } else if opts.lookup && since.elapsed() < RETURN_FOR {
                            // Comes back later: the lookup may have settled it by then.
                            Next::Later
                        } else {
                            Next::Done
                        }
                    }
                    (_, _, "attempts-exhausted") => {
                        seen.exhausted = true;
                        Next::Done
                    }
                    (409, _, "in-flight") | (503, _, _) | (502, _, "upstream-unreachable") => {
                        Next::Retry
                    }
                    other => {
                        let msg = format!(
                            "{write}: unexpected answer {other:?}: {}",
                            String::from_utf8_lossy(&resp)
                        );
                        book.violations.lock().unwrap().push(msg);
                        Next::Done
                    }
                }
            };
            match next {
                Next::Done => break,
                Next::NewKey => key_suffix += 1,
                Next::Retry => {
                    if mode.new_key_per_try() {
                        key_suffix += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await
                }
                Next::Later => {
                    if mode.new_key_per_try() {
                        key_suffix += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(400)).await
                }
            }
        }
        n += 1;
    }
}

fn proxy_config(
    dir: &std::path::Path,
    upstream: SocketAddr,
    postgres: bool,
    // With a lookup: the retention.
    lookup: Option<&str>,
    twin_guard: bool,
) -> std::path::PathBuf {
    let path = dir.join("oncegate.toml");
    let store = if postgres {
        // One folder for the fleet's proxies, as on one host: where each records the last
        // write-log head it saw, in one shared file.
        format!(
            "backend = \"postgres\"\nurl_env = \"ONCEGATE_TEST_DB\"\npath = {:?}",
            dir.join("seen").display().to_string()
        )
    } else {
        // Small log files: many checkpoints, and files started in a recycled spare, all under
        // the kills.
        format!(
            "path = {:?}\nwal_size = \"256KiB\"",
            dir.join("store").display().to_string()
        )
    };
    std::fs::write(
        &path,
        format!(
            r#"
[server]
listen = "127.0.0.1:0"
drain_timeout = "1s"
[admin]
listen = "127.0.0.1:0"
[store]
{store}
[defaults]
timeout = "150ms"
connect_timeout = "500ms"
retries = 1
max_retry_wait = "20ms"
max_attempts = 20
[[upstreams]]
name = "pay"
prefix = "/pay"
url = "http://{upstream}"
twin_guard = {twin_guard}
{lookup}
[[upstreams.routes]]
methods = ["POST"]
path = "/v1/percall/*"
class = "write"
client_keys = "per-call"
"#,
            lookup = if let Some(retention) = lookup {
                format!("retention = \"{retention}\"\nlookup_interval = \"300ms\"\n\
                 lookup = {{ path = \"/lookup/{{key}}\", found = \"/exec\", status = 201, absent_after = \"5s\" }}")
            } else {
                String::new()
            }
        ),
    )
    .unwrap();
    path
}

/// The sled store tampered with between a stop and the next start ([`crate::tamper`]): after a
/// clean stop, a copy of sled's files is kept (once); after some kills, the copy is put back or
/// `store.id` taken away, and a start must be refused (exit 74) or, for a copy the write-ahead
/// log still reaches back to, find the store whole.
async fn tamper_between(
    cfg: &std::path::Path,
    dir: &std::path::Path,
    k: usize,
    stopped: bool,
    report: &mut Report,
) {
    let (cfg, store, copy) = (cfg.to_path_buf(), dir.join("store"), dir.join("stale-copy"));
    let have_copy = copy.exists();
    let fault = match (stopped, k % 3) {
        (true, _) if !have_copy => 0,
        (false, 0) if have_copy => 1,
        (false, 2) => 2,
        _ => return,
    };
    let started = tokio::task::spawn_blocking(move || match fault {
        0 => {
            crate::tamper::keep_copy(&store, &copy);
            None
        }
        1 => Some((
            "a stale copy",
            crate::tamper::stale_copy(&cfg, &store, &copy),
        )),
        _ => Some(("no store.id", crate::tamper::partial_folder(&cfg, &store))),
    })
    .await
    .unwrap();
    match started {
        None => {}
        Some((what, crate::tamper::Start::Refused(msg))) => {
            // The refusal names what is wrong.
            let names = if fault == 1 { "older than" } else { "store.id" };
            if !msg.contains(names) {
                let mut m = format!("{what}: refused without naming it: {msg}");
                m.truncate(400);
                report.violations.push(m);
            }
            report.tamper_refused += 1
        }
        Some(("a stale copy", crate::tamper::Start::Opened)) => report.tamper_opened += 1,
        Some((what, crate::tamper::Start::Opened)) => report
            .violations
            .push(format!("{what}: the proxy opened the store")),
        Some((what, crate::tamper::Start::Other(code, msg))) => {
            let mut m = format!("{what}: the start ended {code:?}: {msg}");
            m.truncate(400);
            report.violations.push(m);
        }
    }
}

async fn verify_log(child: &ChildProxy) -> bool {
    let r = child.admin("GET", "/v1/log/verify", "").await;
    r.json()["ok"] == true
}

pub(crate) async fn harness(opts: Options) -> Report {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let ledger = Arc::new(Ledger::default());
    let upstream = start_upstream(ledger.clone(), opts.faults).await;
    let cfg = proxy_config(
        tmp.path(),
        upstream,
        opts.postgres.is_some(),
        // Pauses make a client's retries come back long after: a retention longer than they
        // take keeps a write the lookup settled from expiring under a retry (which would then
        // rightly be a new write).
        opts.lookup.then_some(if opts.pause_for.is_some() {
            "60s"
        } else {
            "3s"
        }),
        opts.twin_guard,
    );
    let opts = Arc::new(opts);
    let book = Arc::new(Book::default());
    let proxy_addr = Arc::new(RwLock::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut report = Report::default();

    let envs: Vec<(String, String)> = opts
        .postgres
        .iter()
        .map(|u| ("ONCEGATE_TEST_DB".to_string(), u.clone()))
        .collect();
    let spawn = |cfg: std::path::PathBuf, envs: Vec<(String, String)>| async move {
        tokio::task::spawn_blocking(move || {
            let e: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            ChildProxy::spawn_with(&cfg, &e)
        })
        .await
        .unwrap()
    };
    let mut children = Vec::new();
    for _ in 0..opts.proxies {
        let c = spawn(cfg.clone(), envs.clone()).await;
        proxy_addr.write().unwrap().push(Some(c.addr));
        children.push(c);
    }
    let clients: Vec<_> = (0..opts.clients)
        .map(|i| {
            tokio::spawn(run_client(
                i,
                opts.clone(),
                book.clone(),
                proxy_addr.clone(),
                stop.clone(),
            ))
        })
        .collect();

    for k in 0..opts.kills {
        let wait = rand::rng().random_range(opts.kill_gap.0..opts.kill_gap.1);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let slot = rand::rng().random_range(0..children.len());
        if let Some(db) = opts.db_crash.clone().filter(|_| k == opts.kills / 2) {
            tokio::task::spawn_blocking(move || {
                let mut db = db.lock().unwrap();
                db.crash();
                std::thread::sleep(Duration::from_millis(500));
                db.up();
            })
            .await
            .unwrap();
            report.db_crashes += 1;
            continue;
        }
        if let Some(pause) = opts.pause_for.filter(|_| k % 4 == 2) {
            // Paused, its clients' requests hang; the other proxies take over its actions once
            // their leases run out, and a lookup may settle them meanwhile.
            let pid = children[slot].child.id().to_string();
            let signal = |s: &str| std::process::Command::new("kill").args([s, &pid]).status();
            signal("-STOP").unwrap();
            tokio::time::sleep(pause).await;
            signal("-CONT").unwrap();
            report.pauses += 1;
            continue;
        }
        proxy_addr.write().unwrap()[slot] = None;
        let child = children.remove(slot);
        let stopped = k % 4 == 1;
        if stopped {
            // A clean stop under load, now and then: what the next start loads must be exactly
            // what this one leaves.
            tokio::task::spawn_blocking(move || child.terminate())
                .await
                .unwrap();
            report.stops += 1;
        } else {
            child.kill();
            report.kills += 1;
        }
        if opts.tamper && opts.postgres.is_none() {
            tamper_between(&cfg, tmp.path(), k, stopped, &mut report).await;
        }
        if k % 4 == 3 {
            // Killed again while starting up and recovering.
            let (cfg, envs) = (cfg.clone(), envs.clone());
            let early = rand::rng().random_range(0..40);
            tokio::task::spawn_blocking(move || {
                let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_oncegate"))
                    .args(["run", "--config"])
                    .arg(&cfg)
                    .envs(envs)
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .unwrap();
                std::thread::sleep(Duration::from_millis(early));
                c.kill().unwrap();
                c.wait().unwrap();
            })
            .await
            .unwrap();
            report.kills += 1;
        }
        let child = spawn(cfg.clone(), envs.clone()).await;
        if child
            .stderr
            .lock()
            .unwrap()
            .contains("read the action ids from sled")
        {
            match stopped {
                true => report.stop_rescans += 1,
                false => report.kill_rescans += 1,
            }
        }
        report.log_checks += 1;
        if !verify_log(&child).await {
            report.log_failures += 1;
        }
        proxy_addr.write().unwrap()[slot] = Some(child.addr);
        children.insert(slot, child);
    }
    if opts.kills > 0 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        stop.store(true, Ordering::SeqCst);
    }
    for c in clients {
        c.await.unwrap();
    }

    // Final check: after all the restarts, every completed write replays identically and every
    // unknown write is still unknown, and none is sent again.
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let writes: Vec<(String, Mode, usize, Seen)> = book
        .writes
        .lock()
        .unwrap()
        .drain()
        .map(|(w, (m, c, _, s))| (w, m, c, s))
        .collect();
    let final_tick = tick();
    for (write, mode, client_id, seen) in &writes {
        let n: usize = write.rsplit('-').next().unwrap().parse().unwrap();
        if opts.lookup {
            // With a 3 s retention, a write settled (by its answer or a lookup) more than that
            // ago is rightly a new action now, so only the writes no lookup can settle are
            // checked here: still unknown, however long ago (SPEC §5). The ledger judges the
            // rest (duplicates, and sends after an unknown answer).
            report.completed += usize::from(seen.success.is_some());
            let applied_keys: Vec<String> = ledger
                .receipts
                .lock()
                .unwrap()
                .get(write)
                .map(|v| {
                    v.iter()
                        .filter(|r| r.applied)
                        .map(|r| r.key.clone())
                        .collect()
                })
                .unwrap_or_default();
            let never_found =
                !applied_keys.is_empty() && applied_keys.iter().all(|k| unsearchable(k));
            if seen.success.is_none() && seen.unknown_at.is_some() && never_found {
                let (h, b) = request(*mode, *client_id, n, write, seen.unknown_suffix);
                let r = settled_answer(&client, children[0].addr, *mode, &h, &b).await;
                if !matches!(&r, Ok((409, Some(o), _)) if o == "unknown") {
                    let mut msg = format!("{write}: was unknown for good, then {r:?}");
                    msg.truncate(300);
                    report.violations.push(msg);
                }
                report.unknown += 1;
            }
        } else if let Some((status, body)) = &seen.success {
            report.completed += 1;
            let (h, b) = request(*mode, *client_id, n, write, seen.suffix);
            match send(&client, children[0].addr, *mode, &h, &b).await {
                Ok((s, Some(o), again)) if s == *status && again == *body && o == "replayed" => {}
                other => {
                    report.lost_completed += 1;
                    let mut msg = format!("{write}: completed, then {other:?}");
                    msg.truncate(300);
                    report.violations.push(msg);
                }
            }
        } else if seen.unknown_at.is_some() && !(opts.broken_client && *mode == Mode::Key) {
            let (h, b) = request(*mode, *client_id, n, write, seen.unknown_suffix);
            let r = settled_answer(&client, children[0].addr, *mode, &h, &b).await;
            // Still unknown, or (with a lookup) found at the upstream and replayed from there.
            let settled = opts.lookup && matches!(&r, Ok((201, Some(o), _)) if o == "replayed");
            if !settled && !matches!(&r, Ok((409, Some(o), _)) if o == "unknown") {
                let mut msg = format!("{write}: was unknown, then {r:?}");
                msg.truncate(300);
                report.violations.push(msg);
            }
            report.unknown += 1;
        }
        if seen.exhausted {
            report.exhausted += 1;
        }
    }
    report.log_checks += 1;
    if !verify_log(&children[0]).await {
        report.log_failures += 1;
    }
    let receipts = ledger.receipts.lock().unwrap().clone();
    for (write, _, _, seen) in &writes {
        let got = receipts.get(write).map(Vec::as_slice).unwrap_or_default();
        let applied = got.iter().filter(|r| r.applied).count();
        report.duplicates += applied.saturating_sub(1);
        if applied > 1 && !opts.broken_client {
            // What a failure needs to be understood: every request of the write, and what its
            // client saw.
            eprintln!("torture: {write} applied {applied} times: {got:?}; seen {seen:?}");
            // And what the write log says of its actions.
            let keys: Vec<&str> = got.iter().map(|r| r.key.as_str()).collect();
            let mut after = 0u64;
            loop {
                let page = children[0]
                    .admin("GET", &format!("/v1/log?after={after}&limit=1000"), "")
                    .await;
                let text = String::from_utf8_lossy(&page.body).to_string();
                let mut n = 0;
                for line in text.lines() {
                    n += 1;
                    if let Some(seq) = serde_json::from_str::<Value>(line)
                        .ok()
                        .and_then(|v| v["seq"].as_u64())
                    {
                        after = seq;
                    }
                    if keys.iter().any(|k| line.contains(k)) {
                        eprintln!("  log: {line}");
                    }
                }
                if n < 1000 {
                    break;
                }
            }
        }
        if let Some(at) = seen.unknown_at {
            if !opts.broken_client {
                // A send after the client was told the write may have happened. With a lookup,
                // one that follows the lookup's finding that no earlier send took effect is
                // the design (SPEC §5): only a send after one that did counts.
                report.resends += got
                    .iter()
                    .enumerate()
                    .filter(|(i, r)| {
                        r.at > at && (!opts.lookup || got[..*i].iter().any(|e| e.applied))
                    })
                    .count();
            }
        }
        assert!(
            got.iter().all(|r| r.at < final_tick),
            "a receipt of {write} after the final check ({final_tick}): {got:?}, seen {seen:?}"
        );
    }
    report.writes = writes.len();
    report
        .violations
        .extend(book.violations.lock().unwrap().drain(..));
    report.seconds = started.elapsed().as_secs_f64();
    println!(
        "torture: kills={} pauses={} db_crashes={} stops={} rescans={}/{} writes={} completed={} unknown={} exhausted={} upstream_executions={} \
         duplicates={} lost_completed={} resends={} log_verified={}/{} violations={} duration={:.1}s",
        report.kills,
        report.pauses,
        report.db_crashes,
        report.stops,
        report.stop_rescans,
        report.kill_rescans,
        report.writes,
        report.completed,
        report.unknown,
        report.exhausted,
        ledger.executions.load(Ordering::SeqCst),
        report.duplicates,
        report.lost_completed,
        report.resends,
        report.log_checks - report.log_failures,
        report.log_checks,
        report.violations.len(),
        report.seconds,
    );
    for v in report.violations.iter().take(10) {
        println!("  violation: {v}");
    }
    report
}

pub(crate) fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
