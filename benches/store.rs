//! The store alone: durable writes (claim + settle, as the proxy makes them) per second at 1 and
//! 64 concurrent writers, flushes per write, and flush latency. `cargo bench --bench store`.
//!
//! Then the floor under it, `sled alone`: in a process of its own (this bench again, with
//! `STORE_BENCH_SLED_ALONE=1`), one thread makes in sled 0.34.7, configured as the store configures
//! it, only the sled operations one durable write ends in: a lookup of the record (a claim looks
//! before it decides) and the inserts of the record, its small body and its creation and expiry
//! index entries, with the same keys and value sizes. No write-ahead log, fsync, JSON, write log
//! or HTTP. Its CPU per write is what no store on sled can go below; its peak RSS, what sled holds
//! at that rate.
#![allow(clippy::unwrap_used)]

#[path = "support/proc.rs"]
mod proc;

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
        max_attempts: 5,
        owner: "b".into(),
        lease: 60_000,
        now,
    })
    .await
    .unwrap();
    s.settle(SettleRequest {
        id,
        attempt: 1,
        settlement: Settlement {
            state: State::Succeeded,
            tries: vec![Try {
                at: now,
                status: Some(201),
                ..Default::default()
            }],
            response: Some(StoredResponse {
                status: 201,
                headers: vec![("content-type".into(), "application/json".into())],
                size: 60,
                body: BodyRef::Inline,
                source: Source::Upstream,
            }),
            external_id: None,
            needs_decision: false,
            now,
        },
        body: Some(Bytes::from_static(
            br#"{"id":"obj_123","object":"charge","amount":500,"ok":true}"#,
        )),
    })
    .await
    .unwrap();
}

/// CPU seconds (user + system) this process has used.
fn cpu_secs() -> f64 {
    proc::cpu_ticks("self") as f64 / 100.0
}

/// The sled operations of one durable write, as the store's writer and drainer make them.
fn sled_alone() {
    let tmp = tempfile::tempdir().unwrap();
    // As `SledStore::open` configures it.
    let db = sled::Config::new()
        .path(tmp.path().join("s"))
        .segment_size(8 << 20)
        .cache_capacity(16 << 20)
        .flush_every_ms(None)
        .open()
        .unwrap();
    let mut record = fresh();
    record.state = State::Succeeded;
    // A record as the store bench makes it, grown to the size of the side-by-side bench's records
    // (with request headers and evidence, about 1 KiB of JSON).
    let mut value = serde_json::to_vec(&record).unwrap();
    value.resize(value.len().max(1024), b' ');
    let body = br#"{"id":"obj_123","object":"charge","amount":500,"ok":true}"#;
    let peak = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (peak, stop) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(proc::rss_kib("self"), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let cpu_before = cpu_secs();
    let started = Instant::now();
    let mut writes = 0u64;
    let mut at_100k = 0;
    while started.elapsed() < Duration::from_secs(6) {
        if writes == 100_000 {
            at_100k = proc::rss_kib("self");
        }
        let id = format!("{:032x}", u128::from(writes) * 0x9E37_79B9_7F4A_7C15);
        let now = now_millis();
        assert!(db.get(format!("a/{id}")).unwrap().is_none());
        db.insert(format!("a/{id}"), value.as_slice()).unwrap();
        db.insert(format!("b/{id}"), &body[..]).unwrap();
        let index = |prefix: &[u8], n: u64| [prefix, &n.to_be_bytes()[..], id.as_bytes()].concat();
        db.insert(index(b"c/", now), &[]).unwrap();
        db.insert(index(b"e/", now / 60_000 + 1440), &[]).unwrap();
        writes += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    let cpu = cpu_secs() - cpu_before;
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    println!(
        "sled alone: {:.0} writes/s, {:.0} µs CPU per write, RSS {:.1} MiB at 100k writes, peak {:.1} MiB ({} writes, {} B record value)",
        writes as f64 / secs,
        cpu * 1e6 / writes.max(1) as f64,
        at_100k as f64 / 1024.0,
        peak.load(Ordering::Relaxed) as f64 / 1024.0,
        writes,
        value.len()
    );
}

fn main() {
    if std::env::var_os("STORE_BENCH_SLED_ALONE").is_some() {
        return sled_alone();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
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
            let deadline = Instant::now() + Duration::from_secs(3);
            let done = Arc::new(AtomicU64::new(0));
            let cpu_before = cpu_secs();
            let started = Instant::now();
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
            let secs = started.elapsed().as_secs_f64();
            let cpu = cpu_secs() - cpu_before;
            let writes = done.load(Ordering::Relaxed);
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
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .env("STORE_BENCH_SLED_ALONE", "1")
        .output()
        .unwrap();
    print!("{}", String::from_utf8_lossy(&out.stdout));
}
