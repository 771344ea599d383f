//! The fleet side by side (SPEC §13, `postgres`): unique durable writes through one proxy on
//! the embedded store, and through one, two and four proxies sharing one PostgreSQL database,
//! with the database's own floor measured in the same run: `pgbench` running a two-statement
//! transaction (INSERT + INSERT, the least a durable write with an outcome can cost).
//!
//! `cargo bench --bench fleet -- --out bench/results-fleet.md`. The server is
//! `ONCEGATE_BENCH_POSTGRES` (default `postgres://postgres@127.0.0.1:5432/test`); each target
//! gets a fresh database, dropped after. `BENCH_SECS` (default 5) is each run's length and
//! `BENCH_ROUNDS` (default 3) the rounds, interleaved (sled, PG×1, PG×2, PG×4, pgbench, and again)
//! so that drift hits all alike. Each run starts its target's proxies, warms them for a second,
//! drives 64 connections (spread evenly over the proxies), then 1 connection to the first, and
//! stops them; the stores keep growing across rounds. CPU per write counts the proxies and every
//! process of the PostgreSQL server (its backends, WAL writer and checkpointer), not the load
//! generator.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/load.rs"]
mod load;
#[path = "support/proc.rs"]
mod proc;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use load::{drive_all, Result_, Workload};

/// The targets, in the order every round runs them.
const SLED: &str = "oncegate, sled";
const PG: [(&str, usize); 3] = [
    ("oncegate ×1, PostgreSQL", 1),
    ("oncegate ×2, one PostgreSQL", 2),
    ("oncegate ×4, one PostgreSQL", 4),
];
const PGBENCH: &str = "pgbench, INSERT + INSERT";

/// The PostgreSQL targets' names when run by the baseline build (`BENCH_BASELINE`), by the
/// number of proxies' power of two.
const BASELINE_NAMES: [&str; 3] = [
    "baseline ×1, PostgreSQL",
    "baseline ×2, one PostgreSQL",
    "baseline ×4, one PostgreSQL",
];

/// Where the fresh databases are made.
struct Server {
    base: String,
    admin: tokio_postgres::Client,
    /// The postmaster: its children are every process of the server.
    postmaster: u32,
}

impl Server {
    async fn connect() -> Server {
        let base = std::env::var("ONCEGATE_BENCH_POSTGRES")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let (admin, conn) = tokio_postgres::connect(&base, tokio_postgres::NoTls)
            .await
            .expect("the PostgreSQL server of ONCEGATE_BENCH_POSTGRES");
        tokio::spawn(conn);
        let backend: i32 = admin
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        let stat = std::fs::read_to_string(format!("/proc/{backend}/stat"))
            .expect("the PostgreSQL server runs on this machine");
        let postmaster = proc::stat_fields(&stat)[1].parse().unwrap();
        Server {
            base,
            admin,
            postmaster,
        }
    }

    /// A fresh database: its name and URL.
    async fn database(&self, what: &str) -> (String, String) {
        let name = format!("oncegate_bench_{what}_{}", std::process::id());
        self.drop_database(&name).await;
        self.admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        let url = match self.base.rsplit_once('/') {
            Some((server, _)) => format!("{server}/{name}"),
            None => unreachable!("a URL with a database"),
        };
        (name, url)
    }

    async fn drop_database(&self, name: &str) {
        let _ = self
            .admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await;
    }
}

/// One target: how to start its proxies.
struct Target {
    name: &'static str,
    proxies: usize,
    /// The config every proxy of the target runs.
    conf: PathBuf,
    /// `ONCEGATE_BENCH_DB` for the PostgreSQL targets.
    env: Vec<(String, String)>,
    /// Whether the PostgreSQL server's CPU counts.
    postgres: bool,
    /// The binary its proxies run: this build's, or the baseline's (`BENCH_BASELINE`).
    bin: Option<String>,
}

/// What a target did in all rounds: unique writes at 64 connections, and at 1.
#[derive(Default)]
struct Runs {
    wide: Result_,
    one: Result_,
    /// The PostgreSQL server's CPU seconds during the 64-connection runs.
    server_secs: f64,
    /// Its proxies' `oncegate_store_batches_total`, by way made (a build without it: none).
    batches: std::collections::BTreeMap<String, u64>,
}

/// The ways a batch is made, as `oncegate_store_batches_total{made}` names them, in the
/// report's order.
const MADE: [&str; 4] = ["one_statement", "head_locked", "under_lock", "again"];

/// Proxy `admin`'s `oncegate_store_batches_total` series, added into `into`.
fn scrape_batches(admin: SocketAddr, into: &mut std::collections::BTreeMap<String, u64>) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(admin) else {
        return;
    };
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\nhost: bench\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    for made in MADE {
        let series = format!("oncegate_store_batches_total{{made=\"{made}\"}} ");
        if let Some(n) = text.lines().find_map(|l| l.strip_prefix(&series)) {
            *into.entry(made.to_string()).or_default() += n.trim().parse::<u64>().unwrap_or(0);
        }
    }
}

/// Starts the target's proxies, warms them, drives 64 connections then 1, and stops them.
async fn run_target(t: &Target, server: &Server, secs: f64, into: &mut Runs) {
    let mut children = Vec::new();
    for _ in 0..t.proxies {
        let (conf, env, bin) = (t.conf.clone(), t.env.clone(), t.bin.clone());
        let started = tokio::task::spawn_blocking(move || match bin {
            Some(bin) => load::launch_bin(&bin, &conf, &env, &[]),
            None => load::launch(&conf, &env, &[]),
        })
        .await
        .unwrap();
        children.push(started);
    }
    let addrs: Vec<SocketAddr> = children.iter().map(|c| c.1).collect();
    let pids: Vec<u32> = children.iter().map(|c| c.0.id()).collect();
    let dur = Duration::from_secs_f64(secs);
    drive_all(
        &addrs,
        Workload::Write,
        64,
        Duration::from_secs(1),
        &[],
        false,
    )
    .await;
    let before = server_ticks(server.postmaster);
    into.wide
        .merge(drive_all(&addrs, Workload::Write, 64, dur, &pids, false).await);
    if t.postgres {
        into.server_secs += server_ticks(server.postmaster).saturating_sub(before) as f64 / 100.0;
    }
    into.one
        .merge(drive_all(&addrs[..1], Workload::Write, 1, dur, &pids, false).await);
    if t.postgres {
        let admins: Vec<SocketAddr> = children.iter().map(|c| c.2).collect();
        let mut seen = std::mem::take(&mut into.batches);
        seen = tokio::task::spawn_blocking(move || {
            for a in admins {
                scrape_batches(a, &mut seen);
            }
            seen
        })
        .await
        .unwrap();
        into.batches = seen;
    }
    for (mut c, ..) in children {
        load::stop(&mut c).await;
    }
}

/// What pgbench measured in all rounds.
#[derive(Default)]
struct Floor {
    /// Transactions per second at 64 clients, per round.
    wide_tps: Vec<f64>,
    /// Latencies at 1 client, µs.
    one_us: Vec<u64>,
    /// Transactions, and the server's CPU seconds for them, at 64 clients.
    wide_tx: u64,
    wide_cpu: f64,
}

const PGBENCH_SCRIPT: &str = r"\set k random(1, 1000000000)
BEGIN;
INSERT INTO intent VALUES (:k, 'POST /v1/charges');
INSERT INTO outcome VALUES (:k, '200');
END;
";

/// One round of pgbench on the database at `url`: 64 clients, then 1 with every latency logged.
fn pgbench_round(url: &str, dir: &Path, secs: f64, postmaster: u32, floor: &mut Floor) {
    let script = dir.join("write.sql");
    std::fs::write(&script, PGBENCH_SCRIPT).unwrap();
    let run = |clients: usize, log: bool| {
        let _ = std::fs::remove_dir_all(dir.join("log"));
        std::fs::create_dir_all(dir.join("log")).unwrap();
        let mut cmd = std::process::Command::new("pgbench");
        cmd.args(["-n", "-M", "prepared", "-f"])
            .arg(&script)
            .args(["-c", &clients.to_string(), "-j", "2", "-T"])
            .arg(format!("{}", secs.ceil() as u64));
        if log {
            cmd.arg("-l")
                .arg(format!("--log-prefix={}", dir.join("log/pgb").display()));
        }
        let out = cmd.arg(url).output().expect("pgbench runs");
        assert!(
            out.status.success(),
            "pgbench: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let field = |name: &str| -> f64 {
            text.lines()
                .find_map(|l| l.trim().strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(0.0)
        };
        (
            field("tps = "),
            field("number of transactions actually processed: "),
        )
    };
    let cpu = || server_ticks(postmaster);
    let before = cpu();
    let (tps, tx) = run(64, false);
    floor.wide_cpu += cpu().saturating_sub(before) as f64 / 100.0;
    floor.wide_tx += tx as u64;
    floor.wide_tps.push(tps);
    run(1, true);
    for e in std::fs::read_dir(dir.join("log")).unwrap().flatten() {
        for line in std::fs::read_to_string(e.path()).unwrap().lines() {
            // client_id transaction_no latency_us script_no time_epoch time_us
            if let Some(us) = line.split_whitespace().nth(2).and_then(|v| v.parse().ok()) {
                floor.one_us.push(us);
            }
        }
    }
}

/// CPU ticks the PostgreSQL server has used: every living process of it, and the backends that
/// have exited (the postmaster reaped them, so they count in its children's time).
fn server_ticks(postmaster: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{postmaster}/stat")).unwrap_or_default();
    let f = proc::stat_fields(&stat);
    let t = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    load::cpu_ticks(postmaster) + t(13) + t(14)
}

fn quantile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize] as f64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let out = load::out_arg(&args);
    let env_f = |k: &str, d: f64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (secs, rounds) = (
        env_f("BENCH_SECS", 5.0),
        env_f("BENCH_ROUNDS", 3.0) as usize,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(secs, rounds, out));
}

async fn run(secs: f64, rounds: usize, out: Option<PathBuf>) {
    let server = Server::connect().await;
    let upstream = load::upstream().await;
    let tmp = tempfile::tempdir().unwrap();
    let mut targets = Vec::new();
    let sled_dir = tmp.path().join("sled");
    std::fs::create_dir_all(&sled_dir).unwrap();
    targets.push(Target {
        name: SLED,
        proxies: 1,
        conf: load::config(
            &sled_dir,
            upstream,
            &format!("path = {:?}", sled_dir.join("store").display().to_string()),
            "",
        ),
        env: Vec::new(),
        postgres: false,
        bin: None,
    });
    let mut databases = Vec::new();
    // `BENCH_BASELINE=path/to/oncegate`: the same PostgreSQL targets run by another build too,
    // in the same rounds, for a before-and-after pair measured under the same conditions.
    let baseline = std::env::var("BENCH_BASELINE")
        .ok()
        .filter(|b| !b.is_empty());
    let builds = std::iter::once(None).chain(baseline.map(Some));
    let pg_targets: Vec<(&str, usize, Option<String>)> = builds
        .flat_map(|bin| {
            PG.into_iter().map(move |(name, n)| match &bin {
                None => (name, n, None),
                Some(b) => (
                    BASELINE_NAMES[n.trailing_zeros() as usize],
                    n,
                    Some(b.clone()),
                ),
            })
        })
        .collect();
    for (name, proxies, bin) in pg_targets {
        let tag = if bin.is_some() { "b" } else { "p" };
        let (db, url) = server.database(&format!("{tag}{proxies}")).await;
        databases.push(db);
        let dir = tmp.path().join(format!("pg{tag}{proxies}"));
        std::fs::create_dir_all(&dir).unwrap();
        targets.push(Target {
            name,
            proxies,
            conf: load::config(
                &dir,
                upstream,
                &format!(
                    "backend = \"postgres\"\nurl_env = \"ONCEGATE_BENCH_DB\"\npath = {:?}",
                    dir.join("state").display().to_string()
                ),
                "",
            ),
            env: vec![("ONCEGATE_BENCH_DB".into(), url)],
            postgres: true,
            bin,
        });
    }
    let (floor_db, floor_url) = server.database("floor").await;
    databases.push(floor_db);
    {
        let (c, conn) = tokio_postgres::connect(&floor_url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        c.batch_execute(
            "CREATE TABLE intent (k bigint, what text); CREATE TABLE outcome (k bigint, what text)",
        )
        .await
        .unwrap();
    }

    let mut runs: Vec<Runs> = targets.iter().map(|_| Runs::default()).collect();
    let mut floor = Floor::default();
    for round in 0..rounds {
        for (t, r) in targets.iter().zip(runs.iter_mut()) {
            eprintln!("fleet: round {} of {rounds}: {}", round + 1, t.name);
            run_target(t, &server, secs, r).await;
        }
        eprintln!("fleet: round {} of {rounds}: {PGBENCH}", round + 1);
        let (url, dir, pm) = (
            floor_url.clone(),
            tmp.path().to_path_buf(),
            server.postmaster,
        );
        floor = tokio::task::spawn_blocking(move || {
            pgbench_round(&url, &dir, secs, pm, &mut floor);
            floor
        })
        .await
        .unwrap();
    }
    for db in &databases {
        server.drop_database(db).await;
    }

    let md = report(&targets, &runs, &mut floor, secs, rounds);
    print!("{md}");
    if let Some(p) = out {
        std::fs::write(&p, &md).unwrap();
        eprintln!("fleet: wrote {}", p.display());
    }
}

fn report(
    targets: &[Target],
    runs: &[Runs],
    floor: &mut Floor,
    secs: f64,
    rounds: usize,
) -> String {
    use std::fmt::Write;
    floor.one_us.sort_unstable();
    let mut md = String::new();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let pg_version = std::process::Command::new("pgbench")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    writeln!(
        md,
        "# The fleet side by side\n\n`cargo bench --bench fleet -- --out bench/results-fleet.md` \
         ({rounds} interleaved rounds of {secs:.0} s per run; {cores} cores; {pg_version}, its \
         server on this machine, `synchronous_commit = on`). Unique durable writes (a new \
         `Idempotency-Key` each), a local upstream. 64 connections are spread evenly over a \
         target's proxies; 1 connection goes to its first proxy. CPU per write counts the \
         proxies and every PostgreSQL server process; the load generator is not counted.\n"
    )
    .unwrap();
    writeln!(
        md,
        "| target | writes/s, 64 connections | × sled | × one PG proxy | errors | p50, 1 connection | p99, 1 connection | CPU per write, 64 connections: proxies + PostgreSQL |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    .unwrap();
    let sled_rps = runs[0].wide.rps();
    let pg1_rps = runs[1].wide.rps();
    for (t, r) in targets.iter().zip(runs) {
        writeln!(
            md,
            "| {} | {:.0} | {:.2}× | {} | {} | {:.2} ms | {:.2} ms | {:.0} + {:.0} = {:.0} µs |",
            t.name,
            r.wide.rps(),
            r.wide.rps() / sled_rps,
            if t.postgres {
                format!("{:.2}×", r.wide.rps() / pg1_rps)
            } else {
                "—".into()
            },
            r.wide.errors + r.one.errors,
            r.one.q(0.5) / 1000.0,
            r.one.q(0.99) / 1000.0,
            r.wide.cpu_us().unwrap_or(0.0),
            r.server_secs * 1e6 / r.wide.requests.max(1) as f64,
            r.wide.cpu_us().unwrap_or(0.0) + r.server_secs * 1e6 / r.wide.requests.max(1) as f64,
        )
        .unwrap();
    }
    let floor_tps = floor.wide_tps.iter().sum::<f64>() / floor.wide_tps.len().max(1) as f64;
    let (fp50, fp99) = (
        quantile(&floor.one_us, 0.5) / 1000.0,
        quantile(&floor.one_us, 0.99) / 1000.0,
    );
    writeln!(
        md,
        "| {PGBENCH} (the floor: transactions/s) | {floor_tps:.0} | — | — | — | {fp50:.2} ms | {fp99:.2} ms | 0 + {:.0} µs (a transaction) |\n",
        floor.wide_cpu * 1e6 / floor.wide_tx.max(1) as f64
    )
    .unwrap();

    let pg = |i: usize| &runs[i];
    let checks = [
        (
            "one proxy on PostgreSQL ≥ 0.5× the same proxy on sled (64 connections)",
            pg1_rps / sled_rps,
            0.5,
        ),
        (
            "two proxies on one database ≥ 0.9× one proxy",
            pg(2).wide.rps() / pg1_rps,
            0.9,
        ),
        (
            "four proxies on one database ≥ 0.8× one proxy",
            pg(3).wide.rps() / pg1_rps,
            0.8,
        ),
    ];
    writeln!(md, "| target | measured | goal | |\n|---|---:|---:|---|").unwrap();
    for (what, got, goal) in checks {
        writeln!(
            md,
            "| {what} | {got:.2}× | {goal}× | {} |",
            if got >= goal { "met" } else { "**missed**" }
        )
        .unwrap();
    }
    let p50_goal = 2.0 * fp50 + 0.3;
    let p50 = pg(1).one.q(0.5) / 1000.0;
    let p99 = pg(1).one.q(0.99) / 1000.0;
    writeln!(
        md,
        "| one proxy on PostgreSQL, 1 connection: p50 ≤ 2 × pgbench's + 0.3 ms | {p50:.2} ms | {p50_goal:.2} ms | {} |",
        if p50 <= p50_goal { "met" } else { "**missed**" }
    )
    .unwrap();
    writeln!(
        md,
        "| one proxy on PostgreSQL, 1 connection: p99 ≤ 5 ms | {p99:.2} ms | 5 ms | {} |\n",
        if p99 <= 5.0 { "met" } else { "**missed**" }
    )
    .unwrap();
    // How each target's batches were made, all runs together.
    writeln!(
        md,
        "How the proxies made their batches (`oncegate_store_batches_total{{made}}`, all runs):\n\n\
         | target | one statement | head read under lock | rows read under lock | made again |\n\
         |---|---:|---:|---:|---:|"
    )
    .unwrap();
    for (t, r) in targets.iter().zip(runs).filter(|(t, _)| t.postgres) {
        let all: u64 = MADE
            .iter()
            .map(|m| r.batches.get(*m).copied().unwrap_or(0))
            .sum();
        if all == 0 {
            writeln!(md, "| {} | — | — | — | — |", t.name).unwrap();
            continue;
        }
        let cell = |m: &str| {
            let n = r.batches.get(m).copied().unwrap_or(0);
            format!("{n} ({:.0} %)", n as f64 * 100.0 / all as f64)
        };
        writeln!(
            md,
            "| {} | {} | {} | {} | {} |",
            t.name,
            cell(MADE[0]),
            cell(MADE[1]),
            cell(MADE[2]),
            cell(MADE[3])
        )
        .unwrap();
    }
    writeln!(md).unwrap();
    if let Some(b) = std::env::var("BENCH_BASELINE")
        .ok()
        .filter(|b| !b.is_empty())
    {
        let label = std::env::var("BENCH_BASELINE_LABEL").unwrap_or(b);
        writeln!(
            md,
            "The baseline rows run another build, {label} (`BENCH_BASELINE`), in the same rounds.\n"
        )
        .unwrap();
    }
    writeln!(
        md,
        "On {cores} cores the proxies, the database and the load generator share the same CPUs, \
         so more proxies cannot add throughput here: the two- and four-proxy rows show that \
         proxies sharing one database do not contend (no lock held across a fleet's writes), \
         not how a fleet scales on more machines. Each proxy commits its requests' claims and \
         settlements in batches, one transaction a batch, so PostgreSQL's \
         transactions per write fall as load rises."
    )
    .unwrap();
    md
}
