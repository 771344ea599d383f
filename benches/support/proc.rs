//! Process figures from /proc, shared by the benches.

/// The fields of `/proc/{pid}/stat` after the command name: state, ppid, … (utime and stime,
/// fields 14 and 15 of the file, are 11 and 12 here).
pub fn stat_fields(stat: &str) -> Vec<&str> {
    stat.rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect()
}

/// CPU time (user + system, in clock ticks of 10 ms) used so far by `pid` (a number or `self`).
pub fn cpu_ticks(pid: &str) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let f = stat_fields(&stat);
    let t = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    t(11) + t(12)
}

/// Resident memory (VmRSS, KiB) of `pid` (a number or `self`); 0 once it is gone.
pub fn rss_kib(pid: &str) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// The most resident memory `pid` has had since it started (VmHWM, KiB): what a memory limit
/// must leave room for, its startup included.
#[allow(
    dead_code,
    reason = "the side-by-side bench reads it; the store bench does not"
)]
pub fn peak_rss_kib(pid: &str) -> u64 {
    status_kib(pid, "VmHWM:")
}

fn status_kib(pid: &str, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}
