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
    stat_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default())
}

/// utime + stime of a `stat` file's text (a process's or a thread's).
fn stat_ticks(stat: &str) -> u64 {
    let f = stat_fields(stat);
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

/// CPU time (clock ticks) used so far by each of `pid`'s threads, summed by thread name with
/// any trailing number taken off (`sled-io-4` and `sled-io-0` count as `sled-io`).
#[allow(dead_code, reason = "the soak bench reads it; the others do not")]
pub fn thread_ticks(pid: &str) -> std::collections::BTreeMap<String, u64> {
    let mut by_name = std::collections::BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return by_name;
    };
    for t in tasks.filter_map(Result::ok) {
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        let name = stat
            .split_once('(')
            .and_then(|(_, rest)| rest.rsplit_once(')'))
            .map_or("", |(name, _)| name)
            .trim_end_matches(|c: char| c.is_ascii_digit())
            .trim_end_matches('-')
            .to_string();
        *by_name.entry(name).or_insert(0) += stat_ticks(&stat);
    }
    by_name
}

/// The whole machine's CPU time so far (clock ticks, all cores), from `/proc/stat`: busy
/// (user, nice, system, irq, softirq), idle, waiting for I/O, and stolen by the hypervisor.
#[allow(dead_code, reason = "the soak bench reads it; the others do not")]
pub fn machine_ticks() -> [u64; 4] {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let cpu: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let at = |i: usize| cpu.get(i).copied().unwrap_or(0);
    [at(0) + at(1) + at(2) + at(5) + at(6), at(3), at(4), at(7)]
}

/// What the machine's disks have done so far, from `/proc/diskstats` (whole disks only, those
/// under `/sys/block`, so that a partition is not counted twice, and not the device-mapper or md
/// devices stacked on them, whose writes the disks under them count again): bytes written, and
/// cache flushes the devices completed (what each `fdatasync` ends in).
#[allow(dead_code, reason = "the soak bench reads it; the others do not")]
pub fn disk_counts() -> [u64; 2] {
    let stats = std::fs::read_to_string("/proc/diskstats").unwrap_or_default();
    let mut sum = [0u64; 2];
    for line in stats.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let Some(name) = f.get(2) else { continue };
        let virtual_device = ["loop", "zram", "ram", "dm-", "md"]
            .iter()
            .any(|p| name.starts_with(p));
        if virtual_device || !std::path::Path::new("/sys/block").join(name).exists() {
            continue;
        }
        let at = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        // Sectors written (of 512 bytes) are the file's 10th field, flushes completed its 19th.
        sum[0] += at(9) * 512;
        sum[1] += at(18);
    }
    sum
}
