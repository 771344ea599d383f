//! The floor under the embedded store: sled 0.34.7, configured as the store configures it, making
//! only the sled operations one durable write ends in, on one thread: the insert of the record
//! with its small body after it (under its creation key), then the read and write of the bucket
//! its pointer goes in, with the keys the store derives (`action_keys`, `Buckets::key`) and a
//! value of the store's own form (`record_value`: the packed record of a write like the
//! side-by-side bench's, about 450 bytes, and its body), and an expiry index entry for every
//! [`EXPIRIES_A_BATCH`] writes (`expiry_entry`). No write-ahead log, fsync, encoding, write log
//! or HTTP. Its CPU per write is what no store on sled can go below, and its RSS what sled alone
//! holds.
//!
//! Run it in a process of its own (the benches start themselves again with `BENCH_SLED_ALONE`), so
//! the RSS is sled's and the allocator's only.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oncegate::action::{now_millis, Attempt, BodyRef, Record, Source, State, StoredResponse, Try};
use oncegate::store::sled::{action_keys, bucket_with, Buckets};

use super::proc;

/// What one run measured.
#[derive(Debug, Default, Clone, Copy)]
pub struct Floor {
    pub writes: u64,
    pub writes_per_sec: f64,
    pub cpu_us_per_write: f64,
    /// RSS when the 100,000th write was made (0 if it was not reached).
    pub rss_mib_at_100k: f64,
    pub peak_rss_mib: f64,
}

impl Floor {
    /// The child's one line of output.
    pub fn encode(&self) -> String {
        format!(
            "floor {} {} {} {} {}",
            self.writes,
            self.writes_per_sec,
            self.cpu_us_per_write,
            self.rss_mib_at_100k,
            self.peak_rss_mib
        )
    }

    pub fn decode(line: &str) -> Option<Floor> {
        let v: Vec<&str> = line.strip_prefix("floor ")?.split(' ').collect();
        Some(Floor {
            writes: v.first()?.parse().ok()?,
            writes_per_sec: v.get(1)?.parse().ok()?,
            cpu_us_per_write: v.get(2)?.parse().ok()?,
            rss_mib_at_100k: v.get(3)?.parse().ok()?,
            peak_rss_mib: v.get(4)?.parse().ok()?,
        })
    }

    pub fn describe(&self) -> String {
        format!(
            "{:.0} writes/s, {:.0} µs CPU per write, RSS {}, peak RSS {:.1} MiB ({} writes)",
            self.writes_per_sec,
            self.cpu_us_per_write,
            if self.rss_mib_at_100k > 0.0 {
                format!("{:.1} MiB at 100,000 writes", self.rss_mib_at_100k)
            } else {
                "- at 100,000 writes (not reached)".into()
            },
            self.peak_rss_mib,
            self.writes
        )
    }
}

/// The writes whose expiries share one index entry: the settlements of one batch of the store's
/// (at 64 connections, a durable flush covers about seven writes: bench/results-peer.md).
pub const EXPIRIES_A_BATCH: usize = 4;

/// `BENCH_SLED_ALONE` is `{seconds}` (as fast as one thread goes) or `{seconds}@{writes per s}`.
pub const ENV: &str = "BENCH_SLED_ALONE";

/// In the child: runs as `spec` says and prints the encoded result.
pub fn child(spec: &str) {
    let (secs, rate) = match spec.split_once('@') {
        Some((s, r)) => (s.parse().unwrap(), Some(r.parse().unwrap())),
        None => (spec.parse().unwrap(), None),
    };
    println!("{}", run(Duration::from_secs_f64(secs), rate).encode());
}

/// In the parent: runs the floor in a process of its own.
pub fn measure(secs: f64, rate: Option<u64>) -> Floor {
    let spec = match rate {
        Some(r) => format!("{secs}@{r}"),
        None => secs.to_string(),
    };
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .env(ENV, spec)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(Floor::decode)
        .unwrap_or_else(|| panic!("sled alone printed no result: {text}"))
}

fn run(duration: Duration, rate: Option<f64>) -> Floor {
    let tmp = tempfile::tempdir().unwrap();
    let db = oncegate::store::sled::sled_config(&tmp.path().join("s"))
        .open()
        .unwrap();
    // Buckets drawn with a secret, as a store draws its own.
    let buckets = Buckets::new(rand::random());
    // A record and its body: one value, as the store keeps them.
    let record = oncegate::store::sled::record_value(
        &a_write(),
        br#"{"id":"obj_123","object":"charge","amount":500,"ok":true}"#,
    );
    let peak = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, stop) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(proc::rss_kib("self"), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let cpu_before = proc::cpu_ticks("self");
    let started = Instant::now();
    let (mut writes, mut at_100k) = (0u64, 0u64);
    let mut expiring = Vec::with_capacity(EXPIRIES_A_BATCH);
    // A succeeded action, kept a day: its keys are the store's own (`action_keys`).
    let mut action = Record::new(String::new(), String::new());
    action.state = State::Succeeded;
    while started.elapsed() < duration {
        // Ids of the store's form (32 hex digits); their buckets are spread by the secret.
        action.id = format!(
            "{:032x}",
            u128::from(writes).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)
        );
        action.created_at = now_millis();
        action.expires_at = Some(action.created_at + 24 * 3_600_000);
        // The record and its body (under its creation key), the indexes (none for a succeeded
        // action without a task: its expiry is its batch's), and the pointer to it, in its
        // bucket: read, and written with the new pointer in it, as the store's writer does.
        let keys = action_keys(&action);
        let [rec, indexes @ ..] = &keys[..] else {
            unreachable!("action_keys names the record");
        };
        db.insert(rec, record.as_slice()).unwrap();
        let bucket = buckets.key(&action.id);
        let listed = db.get(&bucket).unwrap();
        let value = bucket_with(listed.as_deref(), &action.id, action.created_at);
        db.insert(bucket, value).unwrap();
        for k in indexes {
            db.insert(k, &[]).unwrap();
        }
        expiring.push(oncegate::store::sled::Due {
            at: action.expires_at.unwrap_or_default(),
            created: Some(action.created_at),
            id: action.id.clone(),
        });
        if expiring.len() == EXPIRIES_A_BATCH {
            let tag = u128::from(writes).to_be_bytes();
            let (k, v) = oncegate::store::sled::expiry_entry(&expiring, tag).unwrap();
            db.insert(k, v).unwrap();
            expiring.clear();
        }
        writes += 1;
        if writes == 100_000 {
            at_100k = proc::rss_kib("self");
        }
        if let Some(rate) = rate {
            let due = Duration::from_secs_f64(writes as f64 / rate);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let cpu_secs = (proc::cpu_ticks("self") - cpu_before) as f64 / 100.0;
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    Floor {
        writes,
        writes_per_sec: writes as f64 / secs,
        cpu_us_per_write: cpu_secs * 1e6 / writes.max(1) as f64,
        rss_mib_at_100k: at_100k as f64 / 1024.0,
        peak_rss_mib: peak.load(Ordering::Relaxed) as f64 / 1024.0,
    }
}

/// A succeeded write as the side-by-side bench's unique writes leave it: hashed id, fingerprint and
/// body digest, an SDK's few request headers, one attempt of one try, a JSON answer.
fn a_write() -> Record {
    let now = now_millis();
    let mut r = Record::new("a".repeat(64), "f".repeat(64));
    r.upstream = "pay".into();
    r.principal = "anonymous".into();
    r.key = "k-12345678".into();
    r.method = "POST".into();
    r.path = "/v1/charges".into();
    r.state = State::Succeeded;
    r.attempts = 1;
    (r.created_at, r.updated_at, r.expires_at) = (now, now + 3, Some(now + 86_400_000));
    r.retention_ms = 86_400_000;
    let json = || ("content-type".to_string(), "application/json".to_string());
    r.request.headers = vec![json(), ("content-length".into(), "58".into())];
    r.request.body_size = 58;
    r.request.body_sha256 = "b".repeat(64);
    r.evidence = vec![Attempt {
        n: 1,
        started_at: now,
        ended_at: Some(now + 2),
        state: Some(State::Succeeded),
        tries: vec![Try {
            at: now + 2,
            status: Some(200),
            ..Default::default()
        }],
        tries_dropped: 0,
    }];
    r.response = Some(StoredResponse {
        status: 200,
        headers: vec![json(), ("content-length".into(), "58".into())],
        size: 58,
        body: BodyRef::Inline,
        source: Source::Upstream,
    });
    r
}
