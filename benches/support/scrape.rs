//! oncegate's timing histograms as the benches read them from its `/metrics` text: a snapshot
//! of their cumulative buckets, and the quantiles of what was counted between two snapshots (the
//! side-by-side bench's phase table, the soak's p99 of each write phase by window).

use std::collections::HashMap;

/// Cumulative bucket counts by (phase, upper bound as `/metrics` writes it).
pub type Buckets = HashMap<(String, String), f64>;

/// The buckets of oncegate's write-phase histograms (`oncegate_write_phase_seconds`, by its
/// `phase` label) and its fdatasync histogram (`oncegate_store_flush_seconds`, as the phase
/// `fdatasync`) in the `/metrics` text `body`: a snapshot to subtract from a later one.
pub fn phase_buckets(body: &str) -> Buckets {
    let mut out = HashMap::new();
    let label = |l: &str, name: &str| {
        let at = l.find(&format!("{name}=\""))? + name.len() + 2;
        Some(l[at..at + l[at..].find('"')?].to_string())
    };
    for l in body.lines() {
        let phase = if l.starts_with("oncegate_write_phase_seconds_bucket") {
            label(l, "phase")
        } else if l.starts_with("oncegate_store_flush_seconds_bucket") {
            Some("fdatasync".to_string())
        } else {
            None
        };
        if let (Some(phase), Some(le), Some(n)) = (
            phase,
            label(l, "le"),
            l.rsplit(' ').next().and_then(|n| n.parse::<f64>().ok()),
        ) {
            out.insert((phase, le), n);
        }
    }
    out
}

/// Per phase, from the bucket counts gained between two snapshots: the count and the upper
/// bounds (in µs; infinite past the largest finite bucket) of the buckets holding the p50 and
/// the p99. Phases that counted nothing are left out.
pub fn phase_quantiles(before: &Buckets, after: &Buckets) -> Vec<(String, f64, f64, f64)> {
    let mut phases: Vec<String> = after.keys().map(|(p, _)| p.clone()).collect();
    phases.sort();
    phases.dedup();
    let mut out = Vec::new();
    for phase in phases {
        let mut buckets: Vec<(f64, f64)> = after
            .iter()
            .filter(|((p, _), _)| *p == phase)
            .map(|((_, le), n)| {
                let bound = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::INFINITY)
                };
                (
                    bound,
                    n - before
                        .get(&(phase.clone(), le.clone()))
                        .copied()
                        .unwrap_or(0.0),
                )
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let total = buckets.last().map_or(0.0, |b| b.1);
        if total <= 0.0 {
            continue;
        }
        let at = |q: f64| {
            buckets
                .iter()
                .find(|(_, n)| *n >= q * total)
                .map_or(f64::INFINITY, |(b, _)| b * 1e6)
        };
        out.push((phase, total, at(0.5), at(0.99)));
    }
    out
}
