//! The read path's targets (issue 61), against `bare hyper` measured in the same run: oncegate's
//! HTTP stack alone, forwarding everything, so that the distance is what oncegate's own work on
//! a read costs. nginx is shown beside them.

use std::collections::HashMap;

use super::load::{Result_, Workload};

/// The targets' table, for the workloads the run made (none, if it made no reads).
pub fn report<'a>(
    md: &mut String,
    find: impl Fn(Workload, usize) -> Option<&'a HashMap<&'a str, Result_>>,
) {
    let verdict = |ok: bool| if ok { "met" } else { "not met" };
    let mut rows: Vec<String> = Vec::new();
    let pair = |w: Workload, conns: usize| {
        let per = find(w, conns)?;
        Some((
            per.get("oncegate")?,
            per.get("bare hyper")?,
            per.get("nginx"),
        ))
    };
    let nginx = |n: Option<&Result_>, f: &dyn Fn(&Result_) -> String| n.map_or("-".into(), f);
    if let Some((og, bare, n)) = pair(Workload::Read, 64) {
        let ratio = og.rps() / bare.rps();
        rows.push(format!(
            "| reads at 64 connections ≥ 0.95× bare hyper | {:.0} req/s, {ratio:.2}× | {} | {:.0} req/s | {} |",
            og.rps(),
            verdict(ratio >= 0.95),
            bare.rps(),
            nginx(n, &|n| format!("{:.0} req/s", n.rps())),
        ));
        if let (Some(o), Some(b)) = (og.cpu_us(), bare.cpu_us()) {
            rows.push(format!(
                "| CPU per read at 64 connections ≤ bare hyper's + 2 µs | {o:.0} µs (+{:.0}) | {} | {b:.0} µs | {} |",
                o - b,
                verdict(o <= b + 2.0),
                nginx(n, &|n| n.cpu_us().map_or("-".into(), |c| format!("{c:.0} µs"))),
            ));
        }
    }
    // A p50 against bare hyper's, within `added` µs of it.
    let p50 = [
        (
            Workload::Read,
            "1 connection: read p50 ≤ bare hyper's + 10 µs",
            10.0,
        ),
        (
            Workload::StreamRead,
            "a streamed (SSE) read's time to its first event, p50: added ≤ 50 µs over bare hyper",
            50.0,
        ),
    ];
    for (w, target, added) in p50 {
        if let Some((og, bare, n)) = pair(w, 1) {
            let (o, b) = (og.q(0.5), bare.q(0.5));
            rows.push(format!(
                "| {target} | {o:.0} µs ({:+.0}) | {} | {b:.0} µs | {} |",
                o - b,
                verdict(o <= b + added),
                nginx(n, &|n| format!("{:.0} µs", n.q(0.5))),
            ));
        }
    }
    if rows.is_empty() {
        return;
    }
    md.push_str("\n## The read path's targets, in this run\n\nEach against `bare hyper` in the same run (oncegate's HTTP stack forwarding everything, nothing of its own), with nginx beside it. The streamed read's upstream sends its first event at once and its second 5 ms later: the time to the first event shows whether a proxy holds the stream back.\n\n| target | oncegate | | bare hyper | nginx |\n|---|---:|---|---:|---:|\n");
    for r in rows {
        md.push_str(&r);
        md.push('\n');
    }
}
