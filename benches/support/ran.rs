//! What ran while the soak bench's load did: the proxy's threads' CPU, the bench's own, the
//! machine's (the rest of it, I/O wait, time stolen by the hypervisor, idle), and the store's
//! counts from the proxy's `/metrics`, window by window.

use std::net::SocketAddr;

use super::{load, proc, scrape};

/// What the machine did in a window: each of the proxy's threads' CPU, the bench's own (load
/// generator and upstream), the machine's time ([`proc::machine_ticks`]), and the store's own
/// counts from `/metrics`.
#[derive(Clone, Default)]
pub struct Ran {
    threads: std::collections::BTreeMap<String, u64>,
    bench: u64,
    machine: [u64; 4],
    disk: [u64; 2],
    metrics: Scraped,
}

/// A flush slower than this (seconds) is counted apart: the bound of one of the
/// `oncegate_store_flush_seconds` histogram's buckets (src/metrics.rs: 50 µs × 2⁹).
const SLOW_FLUSH: f64 = 0.0256;

/// The phases of a write the proxy times (`oncegate_write_phase_seconds`): the store's claim,
/// the upstream's answer, the store's settlement.
const PHASES: [&str; 3] = ["claim", "send", "settle"];

/// The store's counts, from the proxy's `/metrics`.
#[derive(Clone, Default)]
struct Scraped {
    /// Syncs that waited for sled: a batch's worth, a whole drain.
    eased: f64,
    whole_drain: f64,
    flushes: f64,
    flush_secs: f64,
    /// Flushes that took at most [`SLOW_FLUSH`] seconds (a bucket of the histogram): the rest
    /// are the slow ones. `None` if the proxy's histogram has no such bucket.
    flushes_fast: Option<f64>,
    /// Stored actions, every state.
    actions: f64,
    /// The write phases' histograms ([`scrape::phase_buckets`]).
    phases: scrape::Buckets,
}

/// The p99 of each write phase ([`PHASES`]) counted between two snapshots, as the bound of the
/// bucket holding it ("≤ x ms"); a dash for a phase without writes.
fn phase_p99s(was: &scrape::Buckets, now: &scrape::Buckets) -> String {
    let q = scrape::phase_quantiles(was, now);
    PHASES
        .iter()
        .map(|phase| match q.iter().find(|(p, ..)| p == phase) {
            Some((.., p99)) if p99.is_finite() => format!("≤ {:.2} ms", p99 / 1e3),
            Some(_) => "over the largest bucket".into(),
            None => "-".into(),
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

impl Scraped {
    fn parse(text: &str) -> Scraped {
        let mut m = Scraped::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((name, v)) = line.rsplit_once(' ') else {
                continue;
            };
            let v: f64 = v.parse().unwrap_or(0.0);
            match name {
                n if n.starts_with("oncegate_store_drainer_waits_total") && n.contains("eased") => {
                    m.eased = v
                }
                n if n.starts_with("oncegate_store_drainer_waits_total") => m.whole_drain = v,
                "oncegate_store_flush_seconds_count" => m.flushes = v,
                "oncegate_store_flush_seconds_sum" => m.flush_secs = v,
                n if n
                    .strip_prefix("oncegate_store_flush_seconds_bucket{le=\"")
                    .and_then(|le| le.strip_suffix("\"}"))
                    .and_then(|le| le.parse::<f64>().ok())
                    .is_some_and(|le| (le - SLOW_FLUSH).abs() < 1e-9) =>
                {
                    m.flushes_fast = Some(v)
                }
                n if n.starts_with("oncegate_actions{") => m.actions += v,
                _ => {}
            }
        }
        m.phases = scrape::phase_buckets(text);
        m
    }
}

/// What ran so far.
pub async fn ran(pid: u32, admin: SocketAddr) -> Ran {
    Ran {
        threads: proc::thread_ticks(&pid.to_string()),
        bench: proc::cpu_ticks("self"),
        machine: proc::machine_ticks(),
        disk: proc::disk_counts(),
        metrics: Scraped::parse(&load::metrics(admin).await),
    }
}

/// The table of what ran, window by window: CPU as % of one core (clock ticks of 10 ms).
pub fn what_ran<'a>(windows: impl Iterator<Item = &'a Ran>, first: &'a Ran, secs: f64) -> String {
    const NAMED: [(&str, &str); 6] = [
        ("tokio-rt-worker", "tokio"),
        ("oncegate-drain", "drainer"),
        ("oncegate-store", "writer"),
        ("oncegate-sync", "syncer"),
        // Linux keeps 15 bytes of a thread's name.
        ("oncegate-checkp", "checkpoint"),
        ("sled-io", "sled-io"),
    ];
    let mut md = String::from(
        "\n## What ran, window by window\n\nCPU as % of one core (200 % is two cores busy), from `/proc`: the proxy's threads by name, \
         the rest of its threads, and this bench's process (the load generator and the upstream); the rest of the machine \
         (other processes and the kernel's own threads: busy time neither the proxy's nor the bench's), its time waiting for I/O, \
         stolen by the hypervisor, and idle; what the machine's disks wrote (MB a second) and how many \
         cache flushes they completed a second (each `fdatasync` ends in one); \
         from the proxy's `/metrics`, the syncs that waited for sled (a batch's worth eased, or a whole drain), the store's \
         flushes (durable group commits) a second, their mean time and how many took over 25.6 ms, the actions stored, \
         and the p99 of each phase of a unique write (`oncegate_write_phase_seconds`: the store's claim, the upstream's \
         answer, the store's settlement; the bound of the histogram's bucket, so within a factor of two).\n\n\
         | window | tokio | drainer | writer | syncer | checkpoint | sled-io | other | bench | rest of the machine | I/O wait | stolen | idle | disk writes | disk flushes/s | waits eased / whole drain | flushes/s | mean flush | flushes over 25.6 ms | actions stored | claim p99 | send p99 | settle p99 |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut before = first;
    for (i, w) in windows.enumerate() {
        let (now, was) = (w, before);
        if now.threads.is_empty() {
            break;
        }
        let pct = |ticks: u64| ticks as f64 / secs;
        let d = |name: &str| {
            pct(now
                .threads
                .get(name)
                .copied()
                .unwrap_or(0)
                .saturating_sub(was.threads.get(name).copied().unwrap_or(0)))
        };
        let all: f64 = now.threads.keys().map(|n| d(n)).sum();
        let named: Vec<f64> = NAMED.iter().map(|(n, _)| d(n)).collect();
        let machine: Vec<f64> = (0..4)
            .map(|k| pct(now.machine[k].saturating_sub(was.machine[k])))
            .collect();
        let bench = pct(now.bench.saturating_sub(was.bench));
        let (m, p) = (&now.metrics, &was.metrics);
        let flushes = m.flushes - p.flushes;
        md += &format!(
            "| {}–{} s | {} | {:.0} % | {:.0} % | {:.0} % | {:.0} % | {:.0} % | {:.1} MB/s | {:.0} | {:.0} / {:.0} | {:.0} | {:.2} ms | {} | {:.0} | {} |\n",
            (i as f64 * secs) as u64,
            ((i + 1) as f64 * secs) as u64,
            named
                .iter()
                .map(|v| format!("{v:.0} %"))
                .collect::<Vec<_>>()
                .join(" | ")
                + &format!(" | {:.0} %", (all - named.iter().sum::<f64>()).max(0.0)),
            bench,
            (machine[0] - all - bench).max(0.0),
            machine[2],
            machine[3],
            machine[1],
            now.disk[0].saturating_sub(was.disk[0]) as f64 / secs / 1e6,
            now.disk[1].saturating_sub(was.disk[1]) as f64 / secs,
            m.eased - p.eased,
            m.whole_drain - p.whole_drain,
            flushes / secs,
            if flushes > 0.0 {
                (m.flush_secs - p.flush_secs) / flushes * 1e3
            } else {
                0.0
            },
            match (m.flushes_fast, p.flushes_fast) {
                (Some(now), Some(was)) => format!("{:.0}", flushes - (now - was)),
                _ => "-".into(),
            },
            m.actions,
            phase_p99s(&p.phases, &m.phases),
        );
        before = now;
    }
    md
}
