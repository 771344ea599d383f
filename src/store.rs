//! The store: where actions live durably (SPEC §13). One trait, implemented by the embedded sled
//! store ([`sled::SledStore`]); every method returns only after its change is durable.

pub(crate) mod files;
pub mod history;
pub mod logfiles;
pub mod logzip;
pub mod postgres;
pub mod seal;
pub mod secret;
pub mod sled;
pub mod space;
pub mod wal;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;

use crate::action::{
    Claim, ClaimRequest, Millis, Record, Resolve, ResolveError, SettleError, Settlement, State,
};
use crate::log::{Actor, Chain, Entry, Event, LogEvent, RecordEvent, Verification};

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store cannot record anything now (a database down or restarting); it may again soon.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store failed and takes no change until the proxy restarts (a write error or failed
    /// fdatasync of the embedded store: what is on disk can no longer be trusted to follow).
    #[error("the store takes no changes until restarted: {0}")]
    Broken(String),
    #[error(transparent)]
    Settle(#[from] SettleError),
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// A stored record could not be decoded.
    #[error("corrupt record {id}: {reason}")]
    Corrupt { id: String, reason: String },
}

/// A settlement plus the response body to keep for replays (absent when not stored).
#[derive(Debug, Clone)]
pub struct SettleRequest {
    pub id: String,
    pub attempt: u32,
    pub settlement: Settlement,
    pub body: Option<Bytes>,
}

/// The log entries of a claim that changed a record: `intent` (a new action) and `sent` (its
/// attempt goes out), or `unknown` (an in-flight attempt whose owner's lease expired).
pub fn claim_events<'a>(claim: &Claim, written: &'a Record) -> Vec<RecordEvent<'a>> {
    match claim {
        Claim::Claimed(_) => {
            let mut v = Vec::with_capacity(2);
            if written.attempts == 1 {
                v.push(RecordEvent::new(Event::Intent, written, Actor::Proxy));
            }
            v.push(RecordEvent::new(Event::Sent, written, Actor::Proxy));
            v
        }
        _ => vec![recover_event(
            written,
            written
                .evidence
                .last()
                .and_then(|a| a.tries.last())
                .and_then(|t| t.error.as_deref())
                .unwrap_or("lease expired"),
        )],
    }
}

/// The log entry of an attempt's end.
pub fn settle_event(r: &Record) -> RecordEvent<'_> {
    let last = r.evidence.last().and_then(|a| a.tries.last());
    let status = last.and_then(|t| t.status);
    let (event, outcome) = match r.state {
        State::Succeeded => (Event::Outcome, "applied"),
        State::Failed => (Event::Outcome, "not-applied"),
        _ => (Event::Unknown, "unknown"),
    };
    let ev = RecordEvent::new(event, r, Actor::Proxy)
        .status(status)
        .outcome(outcome);
    match last.and_then(|t| t.error.clone()) {
        Some(e) => ev.detail(e),
        None => ev,
    }
}

/// The log entry of a settled unknown action.
pub fn resolve_event(event: Event, r: &Record, actor: Actor, reason: String) -> RecordEvent<'_> {
    let outcome = if r.state == State::Succeeded {
        "applied"
    } else {
        "not-applied"
    };
    RecordEvent::new(event, r, actor)
        .status(r.response.as_ref().map(|s| s.status))
        .outcome(outcome)
        .detail(reason)
}

/// The log entry of an in-flight attempt turned unknown (restart, drain deadline, lease).
pub fn recover_event<'a>(r: &'a Record, reason: &str) -> RecordEvent<'a> {
    RecordEvent::new(Event::Unknown, r, Actor::Proxy)
        .outcome("unknown")
        .detail(reason)
}

/// How a store's batches were made (`oncegate_store_batches_total`; PostgreSQL's writer counts
/// them, [`postgres`]).
#[derive(Debug, Clone, Default)]
pub struct BatchCounts {
    /// Committed as one statement, decided without reading.
    pub one_statement: prometheus_client::metrics::counter::Counter,
    /// Decided without reading its rows, committed after reading the log's head under lock
    /// (another proxy had moved it).
    pub head_locked: prometheus_client::metrics::counter::Counter,
    /// Committed as a transaction that read and locked what it decided on.
    pub under_lock: prometheus_client::metrics::counter::Counter,
    /// Not committed and made again: what it was decided on had changed (another proxy's
    /// commit moved the log's head, a row or a new action's slot was taken), or PostgreSQL
    /// ended it to break a cycle of lock waits with another proxy's batch.
    pub again: prometheus_client::metrics::counter::Counter,
}

/// How often the embedded store's syncs waited for sled to catch up
/// (`oncegate_store_drainer_waits_total`): the writer then goes at sled's pace.
#[derive(Debug, Clone, Default)]
pub struct DrainerWaits {
    /// Until the running drain brought the changes not yet in sled below their bound: a
    /// batch's worth of sled's work.
    pub eased: prometheus_client::metrics::counter::Counter,
    /// For the whole running drain: the bytes gathering behind it passed their bound (a few
    /// keys carrying much, such as the write log's blocks).
    pub whole_drain: prometheus_client::metrics::counter::Counter,
}

/// What every store needs besides its location.
#[derive(Debug, Clone, Default)]
pub struct StoreOptions {
    /// Hashes the write log (plain SHA-256, or HMAC with `log.hmac_key_env`).
    pub chain: Chain,
    /// `log.retention`: log entries older than this are pruned by the sweeper (default: keep).
    pub log_retention: Option<std::time::Duration>,
    /// Where to record how long each durable flush takes.
    pub flush_latency: Option<prometheus_client::metrics::histogram::Histogram>,
    /// Where PostgreSQL's writer counts how it made its batches.
    pub batches: BatchCounts,
    /// Where the embedded store counts its syncs' waits for sled.
    pub drainer_waits: DrainerWaits,
    /// sled: start a new write-ahead log file (and checkpoint sled) after this many bytes
    /// (default [`wal::CHECKPOINT_BYTES`]; smaller in tests).
    pub wal_checkpoint_bytes: Option<u64>,
    /// PostgreSQL: judge leases, send times and expiry by the `now` each call passes instead of
    /// the database's clock. Only for tests that move time forward; a fleet must share one clock
    /// (SPEC §13).
    pub caller_clock: bool,
    /// `store.encrypt_key_env`: seals stored heads and bodies (SPEC §13).
    pub sealer: Option<std::sync::Arc<seal::Sealer>>,
    /// PostgreSQL: the folder where this proxy records the last write-log head it saw of each
    /// database (`store.path`), checked at every start (SPEC §13 history). `None`: not kept.
    pub seen_dir: Option<std::path::PathBuf>,
    /// sled: start a new write log file after this many bytes (default
    /// [`logfiles::SEGMENT_BYTES`]; smaller in tests). Pruning removes whole files.
    pub log_segment_bytes: Option<u64>,
    /// sled: `store.reserve`, the free space kept on the store's volume ([`space`]); 0: none.
    pub reserve: u64,
    /// sled: the smallest filter of action ids the store makes, in bits (default 2^23, room for
    /// half a million ids; smaller in tests, to see it fill and be made anew).
    pub ids_min_bits: Option<usize>,
}

/// Which records a scan returns.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub state: Option<State>,
    pub upstream: Option<String>,
    pub principal: Option<String>,
    pub task: Option<String>,
    /// The MCP tool of a `tools/call`.
    pub tool: Option<String>,
    /// Newest first (by `created_at`, then id) instead of oldest first.
    pub newest_first: bool,
    /// Newest first only: the records strictly older than this `(created_at, id)`: a page's cursor.
    pub before: Option<(Millis, String)>,
}

impl Filter {
    pub fn matches(&self, r: &Record) -> bool {
        self.state.is_none_or(|s| r.state == s)
            && self.upstream.as_ref().is_none_or(|u| &r.upstream == u)
            && self.principal.as_ref().is_none_or(|p| &r.principal == p)
            && self
                .task
                .as_ref()
                .is_none_or(|t| r.task.as_ref() == Some(t))
            && self
                .tool
                .as_ref()
                .is_none_or(|t| r.tool.as_ref() == Some(t))
    }
}

/// The operations the life of a write needs. Implementations make each change durable before
/// returning, and make `claim` atomic across every proxy that shares the store.
pub trait Store: Send + Sync + 'static {
    /// Claims an action for a new attempt, or reports what is there (SPEC §5 step 2-3).
    fn claim(&self, req: ClaimRequest) -> BoxFuture<'_, Result<Claim, StoreError>>;

    /// Records the outcome of an attempt (SPEC §5 step 5).
    fn settle(&self, req: SettleRequest) -> BoxFuture<'_, Result<Arc<Record>, StoreError>>;

    /// Reads one record.
    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Record>, StoreError>>;

    /// Reads the stored response body of a succeeded record.
    fn body<'a>(&'a self, record: &'a Record) -> BoxFuture<'a, Result<Option<Bytes>, StoreError>>;

    /// Records matching `filter`, oldest first, at most `limit`.
    fn scan(&self, filter: Filter, limit: usize) -> BoxFuture<'_, Result<Vec<Record>, StoreError>>;

    /// Settles an `unknown` action (SPEC §9), logged as `event` (`lookup` or `resolved`).
    fn resolve(
        &self,
        id: String,
        res: Resolve,
        event: Event,
    ) -> BoxFuture<'_, Result<Record, StoreError>>;

    /// Extends the lease of an in-flight attempt this owner is running to `lease` from now (the
    /// store's now: a shared store reads its own clock, never the proxy's `now`). Returns whether
    /// the attempt was still this owner's. Stores used by one process need no leases.
    fn renew(
        &self,
        _id: &str,
        _owner: &str,
        _lease: Millis,
        _now: Millis,
    ) -> BoxFuture<'_, Result<bool, StoreError>> {
        Box::pin(async { Ok(true) })
    }

    /// Whether tries must pass [`Store::fence`] before they leave: a store shared by proxies,
    /// where another may move the action on while this one is paused (SPEC §13, fencing).
    fn fences(&self) -> bool {
        false
    }

    /// Records that a try of attempt `attempt` (this owner's) is about to leave, and extends its
    /// lease to `lease` from now; `false` when the action is no longer this attempt's (its lease
    /// ran out, another proxy, a lookup or an operator moved it on): the try must not be sent.
    fn fence(
        &self,
        _id: &str,
        _owner: &str,
        _attempt: u32,
        _lease: Millis,
        _now: Millis,
    ) -> BoxFuture<'_, Result<bool, StoreError>> {
        Box::pin(async { Ok(true) })
    }

    /// A `succeeded` record this store holds in memory as last made durable, with its stored
    /// body when held too: lets a replay skip the claim. `None` whenever it is not held; the
    /// claim then decides. Stores without such a cache keep the default.
    fn cached(&self, _id: &str) -> Option<(std::sync::Arc<Record>, Option<Bytes>)> {
        None
    }

    /// Appends a log entry for an event that changes no record (a replay, a conflict, a refused
    /// request, a lookup that settled nothing). The caller does not wait for it: it is written
    /// with the next durable change, or within moments (the sled store waits up to 20 ms to
    /// gather more), and is lost only if the process dies in that window.
    fn note(&self, event: LogEvent);

    /// Write-log entries with `seq > after`, in order, at most `limit`.
    fn log(&self, after: u64, limit: usize) -> BoxFuture<'_, Result<Vec<Entry>, StoreError>>;

    /// Walks the whole write-log chain.
    fn verify_log(&self) -> BoxFuture<'_, Result<Verification, StoreError>>;

    /// `(seq, hash)` of the newest write-log entry.
    fn log_head(&self) -> BoxFuture<'_, Result<(u64, String), StoreError>>;

    /// Why the store takes no new writes now (its volume has less than `store.reserve` free),
    /// or `None`. Settlements and resolutions still go on.
    fn full(&self) -> Option<String> {
        None
    }

    /// Whether the store can take changes now (`/readyz`): by default, whether it answers.
    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move { self.log_head().await.map(|_| ()) })
    }

    /// The store's secret (SPEC §13), which keys the principals, fingerprints and body digests
    /// the proxy writes into it: unkeyed for a store made before stores had one.
    fn keyer(&self) -> crate::identity::Keyer {
        crate::identity::Keyer::unkeyed()
    }

    /// How many actions are in each state.
    fn counts(&self) -> BoxFuture<'_, Result<Vec<(State, u64)>, StoreError>>;

    /// Turns the `in_flight` records left by a previous run into `unknown` (SPEC §5 step 6).
    /// Returns how many changed.
    /// With `owner`, only that owner's in-flight records (a draining proxy's own attempts).
    fn recover(
        &self,
        owner: Option<String>,
        now: Millis,
    ) -> BoxFuture<'_, Result<usize, StoreError>>;

    /// Deletes records that expired before `now` (and prunes the log past `log.retention`).
    /// Returns how many records.
    fn expire(&self, now: Millis) -> BoxFuture<'_, Result<usize, StoreError>>;

    /// Compresses the write log's closed files, where the store keeps them in files (sled).
    /// Returns how many. Called every few seconds, off the request path.
    fn compact_log(&self) -> BoxFuture<'_, Result<usize, StoreError>> {
        Box::pin(async { Ok(0) })
    }

    /// Makes everything durable and releases the store (graceful shutdown).
    fn close(&self) -> BoxFuture<'_, Result<(), StoreError>>;
}
