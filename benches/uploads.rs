//! Memory under slow uploads (SPEC §12 `server.max_buffered`, issue 58): 1,000 clients each
//! send a 10 MiB write body slowly, over HTTP/1.1 (one connection each) and over HTTP/2 (h2c,
//! many streams on a few connections). A write's body is held whole before it is recorded and
//! sent, so without a bound the proxy would hold them all (10 GB); with one, a body that would
//! take the held total past `max_buffered` is refused (503 `busy`, nothing sent) and its memory
//! let go. The report gives the proxy's peak RSS against `max_buffered` + 64 MiB.
//!
//! `cargo bench --bench uploads -- --out bench/results-uploads.md`. `BENCH_CLIENTS` (default
//! 1000), `BENCH_MIB` (default 10) and `BENCH_CHUNK_MS` (default 50: a 64 KiB chunk that often,
//! 1.3 MB/s a client) shape the load.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/load.rs"]
mod load;
#[path = "support/proc.rs"]
mod proc;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};

const MAX_BUFFERED_MIB: u64 = 256;
const CHUNK: usize = 64 << 10;

type Body =
    StreamBody<tokio_stream::wrappers::ReceiverStream<Result<Frame<Bytes>, std::io::Error>>>;

/// A body of `mib` MiB sent a chunk every `every`; it stops when the request is answered.
fn slow_body(i: usize, mib: usize, every: Duration) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        // Each upload its own first bytes: identical bodies under different keys are twins.
        let mut head = vec![b'a'; CHUNK];
        head[..8].copy_from_slice(&(i as u64).to_be_bytes());
        if tx.send(Ok(Frame::data(Bytes::from(head)))).await.is_err() {
            return;
        }
        let chunk = Bytes::from(vec![b'a'; CHUNK]);
        for _ in 1..(mib << 20) / CHUNK {
            tokio::time::sleep(every).await;
            if tx.send(Ok(Frame::data(chunk.clone()))).await.is_err() {
                return;
            }
        }
    });
    StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx))
}

fn request(i: usize, mib: usize, every: Duration) -> http::Request<Body> {
    http::Request::post("/pay/v1/files")
        .header("host", "oncegate")
        .header("content-type", "application/octet-stream")
        .header("content-length", (mib << 20).to_string())
        .header("idempotency-key", format!("upload-{i}-{}", rand_suffix()))
        .body(slow_body(i, mib, every))
        .unwrap()
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// What the uploads came to: answers by status (0: no answer, the connection ended), and the
/// proxy's peak RSS.
#[derive(Default)]
struct Outcome {
    statuses: BTreeMap<u16, usize>,
    peak_rss_mib: f64,
    secs: f64,
}

async fn sample_peak(pid: u32, done: tokio::sync::watch::Receiver<bool>) -> u64 {
    let mut peak = 0;
    while !*done.borrow() {
        peak = peak.max(proc::rss_kib(&pid.to_string()));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    peak
}

/// The status an upload was answered with, its answer read whole (0: no answer).
async fn status_of(
    sent: impl std::future::Future<Output = Result<http::Response<hyper::body::Incoming>, hyper::Error>>,
) -> u16 {
    match sent.await {
        Ok(r) => {
            let status = r.status().as_u16();
            let _ = r.into_body().collect().await;
            status
        }
        Err(_) => 0,
    }
}

/// Every task's result, in order (0 for one that panicked).
async fn gather(tasks: Vec<tokio::task::JoinHandle<u16>>) -> Vec<u16> {
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap_or(0));
    }
    out
}

async fn http1(addr: SocketAddr, clients: usize, mib: usize, every: Duration) -> Vec<u16> {
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            tokio::spawn(async move {
                let Ok(s) = tokio::net::TcpStream::connect(addr).await else {
                    return 0;
                };
                let Ok((mut send, conn)) =
                    hyper::client::conn::http1::handshake(TokioIo::new(s)).await
                else {
                    return 0;
                };
                tokio::spawn(conn);
                status_of(send.send_request(request(i, mib, every))).await
            })
        })
        .collect();
    gather(tasks).await
}

async fn http2(addr: SocketAddr, clients: usize, mib: usize, every: Duration) -> Vec<u16> {
    // Ten connections, each with a tenth of the uploads as streams.
    let conns = 10.min(clients.max(1));
    let mut senders = Vec::new();
    for _ in 0..conns {
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(s))
                .await
                .unwrap();
        tokio::spawn(conn);
        senders.push(send);
    }
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let mut send = senders[i % conns].clone();
            tokio::spawn(async move {
                if send.ready().await.is_err() {
                    return 0;
                }
                status_of(send.send_request(request(i, mib, every))).await
            })
        })
        .collect();
    gather(tasks).await
}

async fn run_one(h2: bool, clients: usize, mib: usize, every: Duration) -> Outcome {
    let upstream = load::upstream().await;
    let tmp = tempfile::tempdir().unwrap();
    let conf = tmp.path().join("oncegate.toml");
    std::fs::write(
        &conf,
        format!(
            r#"[server]
listen = "127.0.0.1:0"
max_body = "{mib}MiB"
max_buffered = "{MAX_BUFFERED_MIB}MiB"
[admin]
listen = "127.0.0.1:0"
[store]
path = {:?}
[defaults]
timeout = "30s"
[[upstreams]]
name = "pay"
prefix = "/pay"
url = "http://{upstream}"
"#,
            tmp.path().join("store").display().to_string()
        ),
    )
    .unwrap();
    let (conf2, env) = (conf.clone(), Vec::new());
    let (mut child, addr, ..) =
        tokio::task::spawn_blocking(move || load::launch(&conf2, &env, &[]))
            .await
            .unwrap();
    let (done_tx, done_rx) = tokio::sync::watch::channel(false);
    let sampler = tokio::spawn(sample_peak(child.id(), done_rx));
    let started = Instant::now();
    let statuses = match h2 {
        false => http1(addr, clients, mib, every).await,
        true => http2(addr, clients, mib, every).await,
    };
    let secs = started.elapsed().as_secs_f64();
    let hwm = proc::peak_rss_kib(&child.id().to_string());
    done_tx.send(true).unwrap();
    let sampled = sampler.await.unwrap();
    load::stop(&mut child).await;
    let mut out = Outcome {
        secs,
        peak_rss_mib: hwm.max(sampled) as f64 / 1024.0,
        ..Outcome::default()
    };
    for s in statuses {
        *out.statuses.entry(s).or_default() += 1;
    }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let out_path = load::out_arg(&args);
    let env_n = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (clients, mib) = (env_n("BENCH_CLIENTS", 1000), env_n("BENCH_MIB", 10));
    let every = Duration::from_millis(env_n("BENCH_CHUNK_MS", 50) as u64);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut md = format!(
        "# Memory under slow uploads\n\n`cargo bench --bench uploads -- --out bench/results-uploads.md`: \
         {clients} clients each send a {mib} MiB write body, a {} KiB chunk every {} ms, all at \
         once, to one proxy on the embedded store (`max_body = \"{mib}MiB\"`, `max_buffered = \
         \"{MAX_BUFFERED_MIB}MiB\"`). Peak RSS is the proxy's (VmHWM, its start included). The \
         bound: `max_buffered` + 64 MiB = {} MiB.\n\n\
         | transport | answers | peak RSS | bound | | time |\n|---|---|---:|---:|---|---:|\n",
        CHUNK >> 10,
        every.as_millis(),
        MAX_BUFFERED_MIB + 64
    );
    for h2 in [false, true] {
        let o = rt.block_on(run_one(h2, clients, mib, every));
        let answers = o
            .statuses
            .iter()
            .map(|(s, n)| match s {
                0 => format!("{n} no answer"),
                s => format!("{n} × {s}"),
            })
            .collect::<Vec<_>>()
            .join(", ");
        let bound = (MAX_BUFFERED_MIB + 64) as f64;
        md += &format!(
            "| {} | {answers} | {:.0} MiB | {bound:.0} MiB | {} | {:.1} s |\n",
            if h2 {
                "HTTP/2 (h2c), 10 connections"
            } else {
                "HTTP/1.1, a connection each"
            },
            o.peak_rss_mib,
            if o.peak_rss_mib <= bound {
                "within"
            } else {
                "**over**"
            },
            o.secs
        );
        eprintln!(
            "uploads: h2={h2}: {answers}, peak {:.0} MiB",
            o.peak_rss_mib
        );
    }
    md += "\n200: held whole, recorded and sent (the upstream answers 200). 503: refused as `busy` (the held total would have \
           passed `max_buffered`), nothing sent.\n";
    print!("{md}");
    if let Some(p) = out_path {
        std::fs::write(&p, &md).unwrap();
        eprintln!("uploads: wrote {}", p.display());
    }
}
