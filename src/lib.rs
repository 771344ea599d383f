//! oncegate: a transparent HTTP proxy that makes AI agents' outbound writes happen at most once.
//!
//! Agents point their base URL at the proxy. Reads are forwarded as they are; each write gets one
//! stable key across retries, is recorded durably before it leaves, and its outcome is recorded
//! before the client hears it. Duplicates get the stored response; a write whose outcome is not
//! known is answered `unknown` and never sent again until it is settled. The behaviour contract
//! is the project's docs (docs/concepts.md, docs/configuration.md, docs/operations.md); a
//! `SPEC §N` in a comment names the section of the design brief the code was first written
//! against, which is not part of this repository: the docs say the same in their own words.
//!
//! # Layout
//! - `main.rs`: CLI → tracing → config (exit 64 on error) → bind → [`run`].
//! - [`config`]: TOML structs, defaults, validation, the policy cascade.
//! - [`route`]: prefixes, route globs, read/write/deny classification (pure).
//! - [`identity`]: key, fingerprint, principal, action id (pure).
//! - [`canonical`]: canonical JSON, form and multipart bodies for fingerprints (pure).
//! - [`action`]: the record, its states and the transitions every store applies.
//! - [`store`]: the `Store` trait; [`store::sled`] the embedded store with group commit;
//!   [`store::postgres`] the fleet's shared store (group commit in the proxy, fenced tries).
//! - [`upstream`]: the client, TLS, transparency, timeouts and tries.
//! - [`proxy`]: the request path as named phases (`proxy/{write,attempt,own}.rs`).
//! - [`replay`]: stored response → response.
//! - [`log`]: the hash-chained write log: entries, hashing, verification.
//! - [`redact`]: the one place secrets are removed.
//! - [`lookup`]: status lookups that settle unknown actions, in the foreground and background.
//! - [`admin`]: the admin API; [`metrics`] the one registry it serves; [`minutes`] the last
//!   hour by minute, for the console.
//! - [`cli`]: the operator commands; [`archive`] ships the write log off the volume; [`demo`]
//!   the narrated scenario of `oncegate demo`.
//! - [`error`]: the one error type and its mapping to problem responses.
//! - [`framing`]: the request-smuggling guard under HTTP/1 connections.
//! - [`server`]: accept loop, HTTP/1 + HTTP/2, TLS, header timeout, graceful drain.
//! - [`inplace`]: a connection's own wakes polled again in place, not through the runtime.

pub mod action;
pub mod admin;
pub mod archive;
pub mod canonical;
pub mod cli;
pub mod config;
pub mod demo;
pub mod error;
pub mod framing;
pub mod identity;
pub mod idle;
pub mod inplace;
pub mod jsontext;
pub mod log;
pub mod lookup;
pub mod mcp;
pub mod metrics;
pub mod minutes;
pub mod proxy;
pub mod redact;
pub mod replay;
pub mod route;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod upstream;

use std::future::Future;
use std::sync::Arc;

/// Maps and sets looked up on every write, hashed with foldhash instead of std's SipHash
/// (measured in docs/decisions.md: "The sled store's maps hash with foldhash", "The redactor's
/// sets hash with foldhash", "Two lookups of a write"). Seeded per process, as std's are, so a
/// client that chooses keys (ids, task names) cannot choose their collisions.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
pub(crate) type FastSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;

use tokio::net::TcpListener;

use crate::action::Clock;
use crate::config::{Config, StoreConfig};
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::store::{Store, StoreError, StoreOptions};

/// Why the proxy could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A setting that cannot work (exit 64).
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Setup(String),
}

/// The listeners `run` serves on, bound by the caller (tests bind `127.0.0.1:0`).
pub struct Listeners {
    pub proxy: TcpListener,
    /// The admin API; `None` runs without one.
    pub admin: Option<TcpListener>,
}

/// What `run` uses besides the config: made by the caller, so that `run` reads no environment.
pub struct Services {
    pub store: Arc<dyn Store>,
    pub metrics: Arc<Metrics>,
    /// The admin bearer token (from `admin.token_env`), if any.
    pub admin_token: Option<String>,
    /// The time for records and expiry (the wall clock, but for tests).
    pub clock: Clock,
}

impl Services {
    /// Services on the wall clock.
    pub fn new(store: Arc<dyn Store>, metrics: Arc<Metrics>, admin_token: Option<String>) -> Self {
        Services {
            store,
            metrics,
            admin_token,
            clock: action::system_clock(),
        }
    }
}

/// The store options the config asks for, reading the secrets it names from the environment.
/// Errors name the config key.
/// An admin listener that is not on loopback needs a token of [`admin::TOKEN_MIN_REMOTE`]
/// characters or more (SPEC §10.2).
fn admin_token_rule(addr: std::net::SocketAddr, token: &str, env: &str) -> Result<(), String> {
    if addr.ip().is_loopback() || token.len() >= admin::TOKEN_MIN_REMOTE {
        return Ok(());
    }
    Err(format!(
        "invalid `admin.listen`: {addr} is not a loopback address, so the admin API needs a \
         token of at least {} characters in the environment variable named by `admin.token_env` \
         ({env})",
        admin::TOKEN_MIN_REMOTE
    ))
}

/// The rules `run` applies to a parsed config in its environment before it opens anything (the
/// admin token a listener needs, the keys the store and the log are to use): what `check`
/// checks too, so that a config `check` passes is one `run` does not refuse for them (exit 64).
pub fn check_environment(config: &Config) -> Result<(), String> {
    let token = std::env::var(&config.admin.token_env).unwrap_or_default();
    admin_token_rule(config.admin.listen, &token, &config.admin.token_env)?;
    store_options(config, &Metrics::new()).map(drop)
}

pub fn store_options(config: &Config, metrics: &Metrics) -> Result<StoreOptions, String> {
    let key = match &config.log.hmac_key_env {
        None => None,
        Some(var) => match std::env::var(var) {
            Ok(v) if !v.is_empty() => Some(v.into_bytes()),
            _ => {
                return Err(format!(
                    "invalid `log.hmac_key_env`: the environment variable {var} is not set"
                ))
            }
        },
    };
    let sealer = match &config.encrypt_key_env {
        None => None,
        Some(var) => {
            let value = std::env::var(var).ok().filter(|v| !v.is_empty()).ok_or_else(|| {
                format!("invalid `store.encrypt_key_env`: the environment variable {var} is not set")
            })?;
            // The key itself is never part of the message.
            let sealer = store::seal::Sealer::from_hex(&value)
                .map_err(|e| format!("invalid `store.encrypt_key_env`: {var}: {e}"))?;
            Some(Arc::new(sealer))
        }
    };
    Ok(StoreOptions {
        sealer,
        chain: log::Chain::new(key),
        log_retention: config.log.retention,
        flush_latency: Some(metrics.flush_latency.clone()),
        batches: metrics.batches.clone(),
        drainer_waits: metrics.drainer_waits.clone(),
        wal_checkpoint_bytes: match &config.store {
            StoreConfig::Sled { wal_size, .. } => *wal_size,
            StoreConfig::Postgres { .. } => None,
        },
        log_segment_bytes: None,
        ids_min_bits: None,
        reserve: match &config.store {
            StoreConfig::Sled { reserve, .. } => *reserve,
            StoreConfig::Postgres { .. } => 0,
        },
        caller_clock: false,
        seen_dir: match &config.store {
            StoreConfig::Postgres { path, .. } => Some(path.clone()),
            StoreConfig::Sled { .. } => None,
        },
    })
}

/// Opens the store the config names.
pub async fn open_store(
    config: &Config,
    options: StoreOptions,
) -> Result<Arc<dyn Store>, StoreError> {
    match &config.store {
        StoreConfig::Sled { path, .. } => {
            let path = path.clone();
            let store =
                tokio::task::spawn_blocking(move || store::sled::SledStore::open(&path, options))
                    .await
                    .map_err(|e| StoreError::Unavailable(e.to_string()))??;
            Ok(Arc::new(store))
        }
        StoreConfig::Postgres { url_env, .. } => {
            let url = std::env::var(url_env).map_err(|_| {
                StoreError::Unavailable(format!(
                    "store.url_env: the environment variable {url_env} (the PostgreSQL URL) is not set"
                ))
            })?;
            let store = store::postgres::PostgresStore::open(&url, options).await?;
            Ok(Arc::new(store))
        }
    }
}

/// How far ahead tokio's timer driver always has a timer to fire ([`keep_timers_near`]).
const TIMER_HORIZON: std::time::Duration = std::time::Duration::from_secs(1);

/// Keeps a timer due within [`TIMER_HORIZON`], forever. tokio's timer driver wakes (an eventfd
/// write, and a parked worker up and back down) whenever a timer is set to fire before the
/// earliest one the driver parked with. Every request sets timers seconds out (hyper's header
/// read timeout, the body and upstream timeouts, a lease renewal), and at low load each was the
/// earliest: about two wake-ups per write at one connection, for nothing. With a timer always
/// due within the horizon, a timer set further out never wakes the driver; the cost is one
/// wake-up a second.
async fn keep_timers_near() {
    loop {
        tokio::time::sleep(TIMER_HORIZON).await;
    }
}

/// How often the sweeper deletes expired records: a sixtieth of the shortest retention (so that a
/// sweep has a few seconds of due actions, not a burst of many: decision 0052), between
/// one second and one minute.
fn sweep_interval(config: &Config) -> std::time::Duration {
    config
        .upstreams
        .iter()
        .flat_map(|u| std::iter::once(&u.policy).chain(u.routes.iter().map(|r| &r.policy)))
        .map(|p| p.retention / 60)
        .min()
        .unwrap_or(std::time::Duration::from_secs(60))
        .clamp(
            std::time::Duration::from_secs(1),
            std::time::Duration::from_secs(60),
        )
}

/// How long before the end of the drain running attempts are cut, to record them and answer
/// their clients: a tenth of `drain_timeout`, at most one second.
fn cut_margin(drain: std::time::Duration) -> std::time::Duration {
    (drain / 10).min(std::time::Duration::from_secs(1))
}

/// Runs the proxy until `shutdown` resolves, then drains: stops accepting, lets open requests
/// and running attempts finish within `drain_timeout`, and makes the store durable.
pub async fn run(
    config: Config,
    listeners: Listeners,
    services: Services,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RunError> {
    let Services {
        store,
        metrics,
        admin_token,
        clock,
    } = services;
    let config = Arc::new(config);
    if let Some(admin) = &listeners.admin {
        let addr = admin
            .local_addr()
            .map_err(|e| RunError::Setup(format!("admin listener: {e}")))?;
        let token = admin_token.as_deref().unwrap_or("");
        admin_token_rule(addr, token, &config.admin.token_env).map_err(RunError::Config)?;
        if token.is_empty() {
            tracing::warn!(
                "no admin token: {} is not set, so the admin API answers only /healthz, /readyz \
                 and /metrics; set it to list, look up and settle actions",
                config.admin.token_env
            );
        }
    }
    for caution in config.cautions() {
        tracing::warn!("{caution}");
    }
    // SPEC §5 step 6: attempts a previous run left in flight may or may not have left.
    let recovered = store.recover(None, clock()).await?;
    if recovered > 0 {
        tracing::warn!(
            recovered,
            "in-flight actions from a previous run are now unknown"
        );
    }
    let tls = match &config.server.tls {
        Some(t) => Some(server::tls_acceptor(t).map_err(RunError::Setup)?),
        None => None,
    };
    let mut proxy = Proxy::new(
        config.clone(),
        store.clone(),
        metrics.clone(),
        clock.clone(),
    )
    .map_err(RunError::Setup)?;
    proxy.local = listeners.proxy.local_addr().ok();
    let proxy = Arc::new(proxy);
    let listen = server::Listen {
        header_timeout: config.server.header_timeout,
        drain_timeout: config.server.drain_timeout,
        max_connections: config.server.max_connections,
        tls,
    };
    if let Ok(addr) = listeners.proxy.local_addr() {
        tracing::info!(%addr, upstreams = config.upstreams.len(), "oncegate listening");
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    // Background work: lookups of unknown actions, and the retention sweeper.
    let background = tokio::spawn(lookup::background(
        proxy.upstreams.clone(),
        store.clone(),
        config.clone(),
        metrics.clone(),
        clock.clone(),
    ));
    let sweeper = {
        let store = store.clone();
        let clock = clock.clone();
        let every = sweep_interval(&config);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let started = std::time::Instant::now();
                match store.expire(clock()).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(
                        expired = n,
                        ms = started.elapsed().as_millis() as u64,
                        "expired actions deleted"
                    ),
                    Err(e) => tracing::warn!(error = %e, "sweeper"),
                }
            }
        })
    };
    // The unknown actions waiting, sampled for the console's chart (the counts are kept by
    // the store, not counted, so a sample costs a read of them).
    let sampler = {
        let (store, metrics) = (store.clone(), metrics.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(counts) = store.counts().await {
                    metrics.minutes.waiting(&counts);
                }
                tokio::time::sleep(std::time::Duration::from_secs(15)).await;
            }
        })
    };
    // `log.compress`: the write log's closed files, compressed soon after they close (sled:
    // 64 MiB each). Off by default: on two cores at half load it cost the p99 (decision 0050).
    let compactor = config.log.compress.then(|| {
        let store = store.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                if let Err(e) = store.compact_log().await {
                    tracing::warn!(error = %e, "write log compaction");
                }
            }
        })
    });
    let timers = tokio::spawn(keep_timers_near());
    let admin_task = listeners.admin.map(|l| {
        if let Ok(addr) = l.local_addr() {
            tracing::info!(admin = %addr, "admin API listening");
        }
        let admin = Arc::new(admin::Admin::new(
            proxy.clone(),
            admin_token,
            l.local_addr().ok(),
        ));
        let opts = server::Listen {
            header_timeout: config.server.header_timeout,
            drain_timeout: std::time::Duration::from_secs(1),
            // Operators and probes: a handful at a time.
            max_connections: 64,
            tls: None,
        };
        tokio::spawn(server::serve(
            l,
            opts,
            move |req| admin.clone().handle(req),
            stopped(stop_rx.clone()),
        ))
    });

    let handler = {
        let proxy = proxy.clone();
        move |req| proxy.clone().handle(req)
    };
    // The drain runs from the shutdown signal: at `drain_timeout` less a margin, attempts still
    // running are cut (recorded unknown, their clients answered 504), so that the answers are
    // out before the connections' own drain ends at `drain_timeout`.
    let drain = config.server.drain_timeout;
    let cut_at = drain.saturating_sub(cut_margin(drain));
    let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel();
    let shutdown = {
        let proxy = proxy.clone();
        async move {
            shutdown.await;
            let _ = signalled_tx.send(tokio::time::Instant::now());
            // Listening on for late answers ends now: those actions are recorded unknown
            // already, and stay so for a lookup or an operator.
            proxy.stop_listening();
            tokio::spawn(async move {
                tokio::time::sleep(cut_at).await;
                proxy.cut_attempts();
            });
        }
    };
    let drained = server::serve(listeners.proxy, listen, handler, shutdown).await;
    let signalled = signalled_rx
        .await
        .unwrap_or_else(|_| tokio::time::Instant::now());
    let _ = stop_tx.send(true);
    background.abort();
    sweeper.abort();
    sampler.abort();
    if let Some(c) = compactor {
        c.abort();
    }
    timers.abort();
    // Actions whose clients left still run in their own tasks: give them the rest of the drain.
    proxy.attempts().close();
    let attempts_done = tokio::time::timeout_at(signalled + drain, proxy.attempts().wait())
        .await
        .is_ok();
    if let Some(t) = admin_task {
        let _ = t.await;
    }
    if !attempts_done {
        // Attempts still running at the deadline: their outcome is not known, and this proxy is
        // about to stop. Say so durably now rather than at the next start.
        match store.recover(Some(proxy.owner.clone()), clock()).await {
            Ok(n) => tracing::warn!(
                unknown = n,
                "attempts still running at drain_timeout recorded unknown"
            ),
            Err(e) => tracing::error!(error = %e, "could not record running attempts as unknown"),
        }
    }
    store.close().await?;
    if drained && attempts_done {
        tracing::info!("drained; store flushed");
    } else {
        tracing::warn!(
            attempts_running = proxy.attempts().len(),
            "drain_timeout reached; attempts still running will show as unknown on next start"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sweep has a sixtieth of the shortest retention's due actions (decision 0052): 2 s for
    /// 2 minutes, 1 s at the least, a minute at the most; a route's retention counts too.
    #[test]
    fn sweeps_come_every_sixtieth_of_the_shortest_retention() {
        let every = |upstream: &str, route: &str| {
            let text = format!(
                "[server]\n[store]\npath = \"s\"\n[[upstreams]]\nname = \"h\"\nprefix = \"/h\"\n\
                 url = \"http://127.0.0.1:1\"\n{upstream}\n[[upstreams.routes]]\nmethods = [\"POST\"]\n\
                 path = \"/v1/x\"\n{route}\n"
            );
            sweep_interval(&Config::parse(&text).expect("valid")).as_millis()
        };
        assert_eq!(every("retention = \"2m\"", ""), 2_000);
        assert_eq!(every("retention = \"24h\"", ""), 60_000);
        assert_eq!(every("retention = \"10s\"", ""), 1_000);
        assert_eq!(every("retention = \"24h\"", "retention = \"3m\""), 3_000);
    }
}
