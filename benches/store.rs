//! The store alone: durable writes (claim + settle, as the proxy makes them) per second at 1 and
//! 64 concurrent writers, flushes per write, and flush latency. `cargo bench --bench store`.
//!
//! Then the cost of encryption at rest (`store.encrypt_key_env`): CPU per write with and without
//! a key, 64 writers, interleaved rounds in one run.
//!
//! Then a restart's first writes against a new store's, one writer (`BENCH_ONLY=restart`: only
//! those).
//!
//! Then the floor under it, `sled alone` (see `support/sled_alone.rs`): only the sled operations
//! of one durable write, in a process of its own.
//!
//! `BENCH_ONLY=postgres`: the same writes on the PostgreSQL store instead (a fresh database on
//! the server `ONCEGATE_BENCH_POSTGRES` names, default `postgres://postgres@127.0.0.1:5432/test`,
//! dropped after), at 1 and 64 writers: what one proxy of a fleet can commit.
#![allow(clippy::unwrap_used)]

#[path = "support/proc.rs"]
mod proc;
#[path = "support/sled_alone.rs"]
mod sled_alone;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use oncegate::action::*;
use oncegate::store::{SettleRequest, Store, StoreOptions};
use prometheus_client::metrics::histogram::Histogram;

/// The proxy's allocator, so RSS compares with the proxy's.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

static N: AtomicU64 = AtomicU64::new(0);

fn fresh() -> Record {
    let i = N.fetch_add(1, Ordering::Relaxed);
    Record {
        upstream: "pay".into(),
        principal: "anonymous".into(),
        key: format!("k-{i}"),
        method: "POST".into(),
        path: "/v1/charges".into(),
        // What the proxy keeps of an SDK's request: a handful of redacted headers.
        request: oncegate::action::RequestInfo {
            headers: vec![
                (
                    "content-type".into(),
                    "application/x-www-form-urlencoded".into(),
                ),
                (
                    "user-agent".into(),
                    "Stripe/v1 PythonBindings/16.1.0".into(),
                ),
                ("stripe-version".into(), "2025-03-31.basil".into()),
                ("authorization".into(), "REDACTED".into()),
            ],
            headers_dropped: 0,
            body_size: 42,
            body_sha256: "e".repeat(64),
            body: Some("amount=4200&currency=usd&customer=cus_123&source=tok_x".into()),
        },
        ..Record::new(
            format!("{:032x}", u128::from(i) * 0x9E37_79B9_7F4A_7C15),
            "f".repeat(64),
        )
    }
}

async fn one_write(s: &dyn Store) {
    let r = fresh();
    let id = r.id.clone();
    let now = now_millis();
    s.claim(ClaimRequest {
        fresh: r,
        key_source: KeySource::Header,
        max_attempts: 5,
        owner: "b".into(),
        lease: 60_000,
        now,
        twin: None,
        window: None,
    })
    .await
    .unwrap();
    s.settle(SettleRequest {
        id,
        attempt: 1,
        settlement: Settlement::succeeded(
            now,
            StoredResponse {
                status: 201,
                headers: vec![("content-type".into(), "application/json".into())],
                size: 60,
                body: BodyRef::Inline,
                source: Source::Upstream,
            },
        ),
        body: Some(Bytes::from_static(
            br#"{"id":"obj_123","object":"charge","amount":500,"ok":true}"#,
        )),
    })
    .await
    .unwrap();
}

/// `conc` writers doing durable writes for 3 s: how many, and the CPU seconds they took.
async fn run_writers<S: Store>(store: &Arc<S>, conc: usize) -> (u64, f64) {
    let deadline = Instant::now() + Duration::from_secs(3);
    let done = Arc::new(AtomicU64::new(0));
    let cpu_before = cpu_secs();
    let tasks: Vec<_> = (0..conc)
        .map(|_| {
            let (s, done) = (store.clone(), done.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    one_write(s.as_ref()).await;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    (done.load(Ordering::Relaxed), cpu_secs() - cpu_before)
}

/// CPU seconds (user + system) this process has used.
fn cpu_secs() -> f64 {
    proc::cpu_ticks("self") as f64 / 100.0
}

/// `n` durable writes one after another: each one's time (claim and settle), in µs.
async fn timed_writes(store: &dyn Store, n: usize) -> Vec<f64> {
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        one_write(store).await;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    lat
}

/// A restart's first writes against a fresh store's: one writer, 8,000 writes on a new store,
/// then 8,000 more after a clean close and open, in each of three rounds. A new store's log file
/// is extended with zeros as it fills; after a clean restart the log starts in the spares the
/// close kept (docs/decisions.md, "Restarts start in the spare").
async fn restart_rounds() {
    const N: usize = 8_000;
    let (mut fresh, mut restarted) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("s");
        let open = || {
            Arc::new(oncegate::store::sled::SledStore::open(&dir, StoreOptions::default()).unwrap())
        };
        let store = open();
        fresh.extend(timed_writes(store.as_ref(), N).await);
        store.close().await.unwrap();
        drop(store);
        let store = open();
        restarted.extend(timed_writes(store.as_ref(), N).await);
        store.close().await.unwrap();
    }
    for (name, lat) in [
        ("a new store", &mut fresh),
        ("after a clean restart", &mut restarted),
    ] {
        lat.sort_by(f64::total_cmp);
        let q = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
        println!(
            "store: 1 writer, {name}: p50 {:.0} µs, p99 {:.0} µs, p99.9 {:.0} µs, max {:.0} µs ({} writes)",
            q(0.5),
            q(0.99),
            q(0.999),
            lat[lat.len() - 1],
            lat.len()
        );
    }
}

/// The PostgreSQL store: durable writes per second at 1 and 64 writers, and one writer's
/// latency, on a fresh database.
async fn postgres_rounds() {
    let base = std::env::var("ONCEGATE_BENCH_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let name = format!("oncegate_bench_{}", std::process::id());
    let (admin, conn) = tokio_postgres::connect(&base, tokio_postgres::NoTls)
        .await
        .expect("the PostgreSQL server of ONCEGATE_BENCH_POSTGRES");
    tokio::spawn(conn);
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let url = match base.rsplit_once('/') {
        Some((server, _)) => format!("{server}/{name}"),
        None => unreachable!("a URL with a database"),
    };
    let store = Arc::new(
        oncegate::store::postgres::PostgresStore::open(&url, StoreOptions::default())
            .await
            .unwrap(),
    );
    let lat = {
        let mut l = timed_writes(store.as_ref(), 2_000).await;
        l.sort_by(f64::total_cmp);
        l
    };
    let q = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    println!(
        "postgres: 1 writer, one after another: p50 {:.0} µs, p99 {:.0} µs",
        q(0.5),
        q(0.99)
    );
    for conc in [1usize, 64] {
        let (n, cpu) = run_writers(&store, conc).await;
        println!(
            "postgres: {conc} writers: {:.0} durable writes/s, {:.0} µs of this process's CPU a write (PostgreSQL's own not counted)",
            n as f64 / 3.0,
            cpu * 1e6 / n.max(1) as f64
        );
    }
    store.close().await.unwrap();
    drop(store);
    let _ = admin
        .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await;
}

fn main() {
    if let Ok(spec) = std::env::var(sled_alone::ENV) {
        return sled_alone::child(&spec);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // `BENCH_ONLY=restart` runs only the restart rounds.
    if std::env::var("BENCH_ONLY").is_ok_and(|v| v.contains("restart")) {
        return rt.block_on(restart_rounds());
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|v| v.contains("postgres")) {
        return rt.block_on(postgres_rounds());
    }
    rt.block_on(async {
        for conc in [1usize, 8, 64] {
            let tmp = tempfile::tempdir().unwrap();
            let hist = Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(0.00005, 2.0, 16));
            let store = Arc::new(
                oncegate::store::sled::SledStore::open(
                    &tmp.path().join("s"),
                    StoreOptions { flush_latency: Some(hist.clone()), ..Default::default() },
                )
                .unwrap(),
            );
            let started = Instant::now();
            let (writes, cpu) = run_writers(&store, conc).await;
            let secs = started.elapsed().as_secs_f64();
            let flushes = store.flush_count();
            let mut text = String::new();
            let mut reg = prometheus_client::registry::Registry::default();
            reg.register("flush", "", hist);
            prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
            let sum: f64 = text.lines().find(|l| l.starts_with("flush_sum")).and_then(|l| l.split(' ').nth(1)).unwrap().parse().unwrap();
            println!(
                "store: {conc:>2} writers: {:.0} durable writes/s, {:.0} µs CPU per write, {:.2} flushes per write, mean flush {:.0} µs",
                writes as f64 / secs,
                cpu * 1e6 / writes.max(1) as f64,
                flushes as f64 / writes.max(1) as f64,
                sum / flushes.max(1) as f64 * 1e6
            );
            store.close().await.unwrap();
        }
    });
    rt.block_on(async {
        // Encryption's cost: the same writes with and without a key, interleaved.
        let key = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";
        let (mut plain, mut sealed) = (Vec::new(), Vec::new());
        for round in 0..3 {
            for with_key in [false, true] {
                let tmp = tempfile::tempdir().unwrap();
                let sealer = with_key
                    .then(|| Arc::new(oncegate::store::seal::Sealer::from_hex(key).unwrap()));
                let store = Arc::new(
                    oncegate::store::sled::SledStore::open(
                        &tmp.path().join("s"),
                        StoreOptions {
                            sealer,
                            ..Default::default()
                        },
                    )
                    .unwrap(),
                );
                let (writes, cpu) = run_writers(&store, 64).await;
                let us = cpu * 1e6 / writes.max(1) as f64;
                println!(
                    "encryption round {round}: {} {us:.0} µs CPU per write",
                    if with_key { "sealed" } else { "plain " }
                );
                if with_key {
                    sealed.push(us)
                } else {
                    plain.push(us)
                }
                store.close().await.unwrap();
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (p, s) = (median(&mut plain), median(&mut sealed));
        println!(
            "encryption at rest: {s:.0} µs against {p:.0} µs CPU per write (median of 3): {:.2}×",
            s / p
        );
    });
    rt.block_on(restart_rounds());
    println!("sled alone: {}", sled_alone::measure(6.0, None).describe());
}
