//! The PostgreSQL store: any number of proxies, one truth (SPEC §13).
//!
//! Claims, settlements and resolutions go to one writer per proxy ([`batch`]), which commits
//! those of concurrent requests together: each action's row locked, its change decided with the
//! same pure transitions as the embedded store, and the batch's write-log entries appended to
//! the one chain in the same transaction. So two proxies can never both claim an action, the log
//! has one chain across instances, and a state change and its log entry commit together.
//! Commits are durable (`synchronous_commit = on` on every connection). An `in_flight` claim
//! carries its owner, its attempt's number (`generation`) and a lease that the owner renews
//! while the attempt runs; any instance that finds the lease expired records the action
//! `unknown`, and every try is fenced ([`Store::fence`]): it leaves only while the action is
//! still its attempt's.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::{GenericClient, Transaction};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::types::ToSql;

mod batch;
mod clock;
mod commit;
mod fast;
mod history;
mod op;
mod sets;

use super::seal::{seal_opt, Sealer};
use super::{recover_event, BoxFuture, Filter, SettleRequest, Store, StoreError, StoreOptions};
use crate::action::{
    now_millis, recover_in_flight, BodyRef, Claim, ClaimRequest, Millis, Record, Resolve, State,
};
use crate::log::{self, Actor, Chain, Entry, Event, LogEvent, Verification};

/// Serialises schema migrations across proxies starting at once.
const MIGRATION_LOCK: i64 = 0x6f6e_6365_6761_7465; // "oncegate"

const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE oncegate_actions (
    id          text PRIMARY KEY,
    state       text NOT NULL,
    upstream    text NOT NULL,
    principal   text NOT NULL,
    task        text,
    owner       text,
    lease_until bigint,
    created_at  bigint NOT NULL,
    expires_at  bigint NOT NULL,
    record      text NOT NULL,
    body        bytea
);
CREATE INDEX oncegate_actions_state ON oncegate_actions (state);
CREATE INDEX oncegate_actions_task ON oncegate_actions (task);
CREATE INDEX oncegate_actions_expires ON oncegate_actions (expires_at);
CREATE TABLE oncegate_log (
    seq   bigint PRIMARY KEY,
    ts    text NOT NULL,
    entry text NOT NULL
);
CREATE TABLE oncegate_log_head (
    id   int PRIMARY KEY CHECK (id = 1),
    seq  bigint NOT NULL,
    hash text NOT NULL,
    anchor_seq bigint,
    anchor_prev text
);
INSERT INTO oncegate_log_head (id, seq, hash) VALUES (1, 0, '0000000000000000000000000000000000000000000000000000000000000000');
"#,
    r#"
CREATE INDEX oncegate_actions_created ON oncegate_actions (created_at, id);
"#,
    // SPEC §5: only settled actions expire; an in-flight or unknown one has no expiry.
    r#"
ALTER TABLE oncegate_actions ALTER COLUMN expires_at DROP NOT NULL;
UPDATE oncegate_actions SET expires_at = NULL WHERE state IN ('in_flight', 'unknown');
"#,
    // Encryption at rest: the key check (SPEC §13).
    r#"
CREATE TABLE oncegate_meta (key text PRIMARY KEY, value bytea NOT NULL);
"#,
    // The unsettled-twin guard (SPEC §4.1): the twin key of each guarded action while it is
    // unsettled, unique, so that two proxies claiming twins at once cannot both send.
    r#"
ALTER TABLE oncegate_actions ADD COLUMN twin text;
CREATE UNIQUE INDEX oncegate_actions_twin ON oncegate_actions (twin) WHERE twin IS NOT NULL;
"#,
    // Fencing (SPEC §13): the attempt an in-flight claim belongs to, which a try's `sending`
    // statement must still find before it leaves.
    r#"
ALTER TABLE oncegate_actions ADD COLUMN generation bigint;
UPDATE oncegate_actions SET generation = (record::jsonb ->> 'attempts')::bigint;
ALTER TABLE oncegate_actions ADD COLUMN sending_at bigint;
"#,
    // Counts kept, not counted (SPEC §13): each proxy instance adds the moves its own
    // transactions make to rows of its own (no row shared across proxies), seeded once from the
    // table; the count of a state is their sum.
    r#"
CREATE TABLE oncegate_counts (
    instance text NOT NULL,
    state    text NOT NULL,
    n        bigint NOT NULL,
    PRIMARY KEY (instance, state)
);
INSERT INTO oncegate_counts (instance, state, n)
    SELECT '', state, count(*) FROM oncegate_actions GROUP BY state;
"#,
    // Partial indexes: a row is in an index only while the index has a use for it (the
    // recovery's and the operator's unsettled actions, tasks, settled rows' expiry), so a
    // claim and a settlement update fewer index entries.
    r#"
DROP INDEX oncegate_actions_state;
CREATE INDEX oncegate_actions_unsettled ON oncegate_actions (state) WHERE state IN ('in_flight', 'unknown');
DROP INDEX oncegate_actions_task;
CREATE INDEX oncegate_actions_task ON oncegate_actions (task) WHERE task IS NOT NULL;
DROP INDEX oncegate_actions_expires;
CREATE INDEX oncegate_actions_expires ON oncegate_actions (expires_at) WHERE expires_at IS NOT NULL;
"#,
];

/// How the count of each state moves in one transaction.
#[derive(Debug, Default)]
pub(super) struct Moves([i64; 4]);

impl Moves {
    /// A record went from `from` (none: it is new) to `to` (none: it is gone).
    pub(super) fn moved(&mut self, from: Option<State>, to: Option<State>) {
        if from == to {
            return;
        }
        if let Some(f) = from {
            self.0[f as usize] -= 1;
        }
        if let Some(t) = to {
            self.0[t as usize] += 1;
        }
    }

    /// Adds `other`'s moves to these.
    pub(super) fn add(&mut self, other: &Moves) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a += b;
        }
    }

    /// Adds them to this instance's counts, in `tx`.
    /// The states whose counts moved, and by how much.
    pub(super) fn columns(&self) -> (Vec<&'static str>, Vec<i64>) {
        State::ALL
            .into_iter()
            .zip(self.0)
            .filter(|(_, d)| *d != 0)
            .map(|(s, d)| (s.as_str(), d))
            .unzip()
    }

    pub(super) async fn save(
        &self,
        tx: &impl GenericClient,
        instance: &str,
    ) -> Result<(), StoreError> {
        let (states, deltas): (Vec<&str>, Vec<i64>) = State::ALL
            .into_iter()
            .zip(self.0)
            .filter(|(_, d)| *d != 0)
            .map(|(s, d)| (s.as_str(), d))
            .unzip();
        if states.is_empty() {
            return Ok(());
        }
        let sql = "INSERT INTO oncegate_counts (instance, state, n)
             SELECT $1, s, d FROM UNNEST($2::text[], $3::bigint[]) AS u(s, d)
             ON CONFLICT (instance, state) DO UPDATE SET n = oncegate_counts.n + EXCLUDED.n";
        tx.execute(&prepared(tx, sql).await?, &[&instance, &states, &deltas])
            .await
            .map_err(db)?;
        Ok(())
    }
}

/// The database's clock, in milliseconds since the epoch. Every time a decision compares (lease
/// ends, send times, expiry) is the database's, never a proxy's (SPEC §13): a proxy whose clock
/// is wrong cannot judge another's attempt over.
const DB_NOW: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

/// `sql`, prepared once per connection and kept in its statement cache: run again, a statement
/// costs one round trip instead of two, and PostgreSQL neither parses nor plans it again.
async fn prepared(
    tx: &impl GenericClient,
    sql: &str,
) -> Result<tokio_postgres::Statement, StoreError> {
    tx.prepare_cached(sql).await.map_err(db)
}

/// The time a decision is judged by: the database's, or the caller's `given` time when the
/// store was opened with [`StoreOptions::caller_clock`].
async fn judge_time(tx: &impl GenericClient, given: Option<Millis>) -> Result<Millis, StoreError> {
    if let Some(t) = given {
        return Ok(t);
    }
    let row = tx
        .query_one(&prepared(tx, &format!("SELECT {DB_NOW}")).await?, &[])
        .await
        .map_err(db)?;
    Ok(row.get::<_, i64>(0).max(0) as Millis)
}

pub struct PostgresStore {
    pool: Pool,
    /// Claims, settlements and resolutions, to the writer that commits them in batches.
    ops: tokio::sync::mpsc::Sender<batch::Op>,
    /// This instance's name in `oncegate_counts` (random, per process).
    instance: Arc<str>,
    /// Seals stored heads and bodies (`store.encrypt_key_env`).
    sealer: Option<Arc<Sealer>>,
    /// Judge times by the `now` each call passes instead of the database's clock (tests).
    caller_clock: bool,
    chain: Chain,
    log_retention: Option<Duration>,
    flush_latency: Option<prometheus_client::metrics::histogram::Histogram>,
    /// The newest log head this proxy committed (its writer's).
    head: Arc<std::sync::Mutex<Option<Head>>>,
    /// Where this proxy records the last head it saw ([`history`]).
    seen: Option<Arc<Seen>>,
    /// The store's secret (SPEC §13), shared by every proxy of the database.
    keyer: crate::identity::Keyer,
}

/// This proxy's record of the last write-log head it saw of the database.
struct Seen {
    file: std::path::PathBuf,
    /// The store's id.
    id: String,
    /// The `seq` of the head last written to `file`.
    saved: std::sync::Mutex<i64>,
}

impl Seen {
    /// Writes `head` to the file if it is newer than what it holds.
    async fn save(self: &Arc<Self>, head: Option<Head>) {
        let Some(head) = head else { return };
        if head.0 <= *self.saved.lock().unwrap_or_else(|p| p.into_inner()) {
            return;
        }
        let me = self.clone();
        let saved = tokio::task::spawn_blocking(move || {
            history::save_seen(&me.file, &me.id, &head).map(|()| head.0)
        })
        .await;
        match saved {
            Ok(Ok(seq)) => {
                let mut s = self.saved.lock().unwrap_or_else(|p| p.into_inner());
                *s = (*s).max(seq);
            }
            Ok(Err(e)) => {
                tracing::warn!(file = %self.file.display(), error = %e, "could not record the write-log head this proxy saw")
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not record the write-log head this proxy saw")
            }
        }
    }
}

/// Records, once a second, the newest head this proxy committed, while its store is open.
async fn keep_seen(seen: Arc<Seen>, head: std::sync::Weak<std::sync::Mutex<Option<Head>>>) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Some(head) = head.upgrade() else { return };
        let newest = head.lock().unwrap_or_else(|p| p.into_inner()).clone();
        seen.save(newest).await;
    }
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

/// What a transaction PostgreSQL ended to break a cycle of lock waits is answered
/// ([`db`]); the writer makes such a batch again ([`commit::Ending::LockCycle`]).
const LOCK_CYCLE: &str =
    "database: deadlock detected (a cycle of lock waits with another transaction)";

/// A database error, with its cause (tokio-postgres' own message is only "db error").
fn db(e: tokio_postgres::Error) -> StoreError {
    match e.as_db_error() {
        Some(d) if *d.code() == tokio_postgres::error::SqlState::T_R_DEADLOCK_DETECTED => {
            StoreError::Unavailable(LOCK_CYCLE.into())
        }
        Some(d) => StoreError::Unavailable(format!("database: {}", d.message())),
        None => StoreError::Unavailable(format!("database: {e}")),
    }
}

fn pool_err(e: deadpool_postgres::PoolError) -> StoreError {
    StoreError::Unavailable(format!("database: {e}"))
}

fn decode(
    id: &str,
    text: &str,
    lease: Option<i64>,
    sealer: Option<&Sealer>,
) -> Result<Record, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        id: id.to_string(),
        reason,
    };
    let mut r: Record = serde_json::from_str(text).map_err(|e| corrupt(e.to_string()))?;
    if let Some(s) = sealer {
        s.open_record(&mut r).map_err(corrupt)?;
    }
    // The lease column is authoritative: renewals update only it.
    r.lease_until = lease.map(|l| l as Millis);
    Ok(r)
}

fn encode(r: &Record, sealer: Option<&Sealer>) -> String {
    match sealer {
        None => serde_json::to_string(r).expect("records always serialize"),
        Some(s) => {
            let mut sealed = r.clone();
            s.seal_record(&mut sealed);
            serde_json::to_string(&sealed).expect("records always serialize")
        }
    }
}

impl PostgresStore {
    /// Connects (TLS through rustls when the URL asks for it) and migrates the schema.
    pub async fn open(url: &str, options: StoreOptions) -> Result<PostgresStore, StoreError> {
        let mut cfg = tokio_postgres::Config::from_str(url)
            .map_err(|e| unavailable(format!("store.url_env: the URL does not parse: {e}")))?;
        // Durable commits, whatever the server's default.
        cfg.options("-c synchronous_commit=on");
        cfg.connect_timeout(Duration::from_secs(5));
        let seen_file = options
            .seen_dir
            .as_deref()
            .map(|d| history::seen_file(d, &cfg));
        let mgr_cfg = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        // TLS when the URL asks for it (`sslmode=require`), verified against the web PKI roots.
        // `prefer` (libpq's default) would accept any certificate, so it means plain here.
        let mgr = match cfg.get_ssl_mode() {
            tokio_postgres::config::SslMode::Require => {
                let mut roots = rustls::RootCertStore::empty();
                roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
                let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .map_err(unavailable)?
                .with_root_certificates(roots)
                .with_no_client_auth();
                Manager::from_config(
                    cfg,
                    tokio_postgres_rustls::MakeRustlsConnect::new(tls),
                    mgr_cfg,
                )
            }
            _ => Manager::from_config(cfg, tokio_postgres::NoTls, mgr_cfg),
        };
        let pool = Pool::builder(mgr)
            .max_size(16)
            .wait_timeout(Some(Duration::from_secs(5)))
            .create_timeout(Some(Duration::from_secs(5)))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(unavailable)?;
        let (ops, rx) = tokio::sync::mpsc::channel(4096);
        let instance: Arc<str> = Arc::from(format!(
            "{:016x}",
            std::hash::BuildHasher::hash_one(
                &std::collections::hash_map::RandomState::new(),
                now_millis()
            )
        ));
        let head: Arc<std::sync::Mutex<Option<Head>>> = Arc::default();
        let writer = batch::Writer {
            instance: instance.clone(),
            pool: pool.clone(),
            sealer: options.sealer.clone(),
            caller_clock: options.caller_clock,
            chain: options.chain.clone(),
            flush_latency: options.flush_latency.clone(),
            batches: options.batches.clone(),
            head: head.clone(),
            clock: Default::default(),
            contended: Default::default(),
            memory: Default::default(),
        };
        writer.spawn(rx);
        let mut store = PostgresStore {
            pool,
            ops,
            instance,
            sealer: options.sealer,
            caller_clock: options.caller_clock,
            chain: options.chain,
            log_retention: options.log_retention,
            flush_latency: options.flush_latency,
            head: Arc::default(),
            seen: None,
            keyer: crate::identity::Keyer::unkeyed(),
        };
        store.migrate().await?;
        store.check_key().await?;
        // What this proxy saw, read before the database's head ([`history::read_seen`]).
        let seen = match &seen_file {
            Some(file) => history::read_seen(file)?,
            None => None,
        };
        let now = store.check_history().await?;
        store.keyer = store.secret().await?;
        let id = store.store_id().await?;
        if let Some(file) = seen_file {
            store.check_seen(&file, seen, &id, &now).await?;
            let seen = Seen {
                file,
                id,
                saved: std::sync::Mutex::new(now.0),
            };
            let seen = Arc::new(seen);
            tokio::spawn(keep_seen(seen.clone(), Arc::downgrade(&head)));
            store.seen = Some(seen);
        }
        store.head = head;
        Ok(store)
    }

    /// The caller's time, when the store judges by it; `None`: the database's clock.
    fn given(&self, now: Millis) -> Option<Millis> {
        self.caller_clock.then_some(now)
    }

    /// Versioned migrations under an advisory lock, so that proxies starting together agree.
    async fn migrate(&self) -> Result<(), StoreError> {
        let mut c = self.pool.get().await.map_err(pool_err)?;
        c.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(db)?;
        let result = async {
            c.batch_execute(
                "CREATE TABLE IF NOT EXISTS oncegate_migrations (version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())",
            )
            .await
            .map_err(db)?;
            let done: i32 = c
                .query_one("SELECT COALESCE(MAX(version), 0) FROM oncegate_migrations", &[])
                .await
                .map_err(db)?
                .get(0);
            for (i, m) in MIGRATIONS.iter().enumerate().skip(done as usize) {
                let tx = c.transaction().await.map_err(db)?;
                tx.batch_execute(m).await.map_err(db)?;
                tx.execute("INSERT INTO oncegate_migrations (version) VALUES ($1)", &[&(i as i32 + 1)])
                    .await
                    .map_err(db)?;
                tx.commit().await.map_err(db)?;
            }
            Ok::<_, StoreError>(())
        }
        .await;
        let _ = c
            .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
            .await;
        result
    }

    /// A change, made by the writer in its next batch; returns once that batch committed.
    async fn batched<T>(
        &self,
        make: impl FnOnce(tokio::sync::oneshot::Sender<Result<T, StoreError>>) -> batch::Op,
    ) -> Result<T, StoreError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let gone = || unavailable("the store's writer stopped");
        self.ops.send(make(tx)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Runs `f` in a transaction and commits; the commit is durable.
    async fn tx<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        F: for<'a> FnOnce(&'a Transaction<'a>) -> BoxFuture<'a, Result<T, StoreError>>,
    {
        let started = std::time::Instant::now();
        let mut c = self.pool.get().await.map_err(pool_err)?;
        let tx = c.transaction().await.map_err(db)?;
        let out = f(&tx).await?;
        tx.commit().await.map_err(db)?;
        if let Some(h) = &self.flush_latency {
            h.observe(started.elapsed().as_secs_f64());
        }
        Ok(out)
    }
}

/// The unsettled action holding twin slot `key` (SPEC §4.1), other than `own`. The batch
/// holds the key's advisory lock (taken for all its keys, in order, before any change): claims
/// of twins, on any proxy, decide one at a time, so two can never both find the slot free. The
/// unique index on `twin` backs this up: a second holder could not commit. The holder's row is
/// read, not locked: a settlement committing meanwhile only makes the answer conservative.
async fn twin_holder(
    tx: &impl GenericClient,
    key: &str,
    own: &str,
    sealer: Option<&Sealer>,
) -> Result<Option<Arc<Record>>, StoreError> {
    let row = tx
        .query_opt(
            &prepared(
                tx,
                "SELECT id, record, lease_until FROM oncegate_actions WHERE twin = $1",
            )
            .await?,
            &[&key],
        )
        .await
        .map_err(db)?;
    match row {
        Some(r) if r.get::<_, &str>(0) != own => {
            let id: String = r.get(0);
            Ok(Some(Arc::new(decode(&id, r.get(1), r.get(2), sealer)?)))
        }
        _ => Ok(None),
    }
}

/// Reads and locks one record.
async fn lock(
    tx: &impl GenericClient,
    id: &str,
    sealer: Option<&Sealer>,
) -> Result<Option<Record>, StoreError> {
    let row = tx
        .query_opt(
            &prepared(
                tx,
                "SELECT record, lease_until FROM oncegate_actions WHERE id = $1 FOR UPDATE",
            )
            .await?,
            &[&id],
        )
        .await
        .map_err(db)?;
    row.map(|r| decode(id, r.get(0), r.get(1), sealer))
        .transpose()
}

async fn write(
    tx: &impl GenericClient,
    r: &Record,
    body: Option<&Bytes>,
    sealer: Option<&Sealer>,
) -> Result<(), StoreError> {
    let body = body.map(|b| seal_opt(sealer, b));
    let lease = r.lease_until.map(|l| l as i64);
    let body: Option<&[u8]> = body.as_deref();
    let twin = r.holds_twin().then(|| r.twin_key());
    let generation = i64::from(r.attempts);
    let params: [&(dyn ToSql + Sync); 13] = [
        &r.id,
        &r.state.as_str(),
        &r.upstream,
        &r.principal,
        &r.task,
        &r.owner,
        &lease,
        &(r.created_at as i64),
        &r.expires_at.map(|e| e as i64),
        &encode(r, sealer),
        &body,
        &twin,
        &generation,
    ];
    let sql = "INSERT INTO oncegate_actions (id, state, upstream, principal, task, owner, lease_until, created_at, expires_at, record, body, twin, generation)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
         ON CONFLICT (id) DO UPDATE SET state = $2, task = $5, owner = $6, lease_until = $7,
             created_at = $8, expires_at = $9, record = $10,
             body = CASE WHEN $11::bytea IS NULL THEN oncegate_actions.body ELSE $11 END,
             twin = $12, generation = $13";
    tx.execute(&prepared(tx, sql).await?, &params)
        .await
        .map_err(db)?;
    Ok(())
}

/// The write log's head: its newest entry's `seq` and hash.
pub(super) type Head = (i64, String);

/// Appends events to the one chain: the head row is locked last, so appends serialise.
async fn append(
    tx: &impl GenericClient,
    chain: &Chain,
    events: Vec<LogEvent>,
) -> Result<(), StoreError> {
    append_after(tx, chain, events, None).await.map(drop)
}

/// [`append`], chained after `known`, the head this proxy last committed, when given: moving
/// the head on and inserting the entries are then one statement, which does nothing unless the
/// head is still `known` (another transaction, here or on another proxy, may have moved it);
/// then the head is read, locked, and the entries chained again after it. Returns the new head
/// (`None` when there was nothing to append).
async fn append_after(
    tx: &impl GenericClient,
    chain: &Chain,
    events: Vec<LogEvent>,
    known: Option<Head>,
) -> Result<Option<Head>, StoreError> {
    if events.is_empty() {
        return Ok(None);
    }
    let seal = |head: Head| commit::seal(chain, events.iter().cloned(), head);
    if let Some(known) = known {
        let (seqs, tss, lines, new) = seal(known.clone());
        let sql = "WITH h AS (
                 UPDATE oncegate_log_head SET seq = $4, hash = $5
                 WHERE id = 1 AND seq = $6 AND hash = $7 RETURNING 1
             ), entries AS (
                 INSERT INTO oncegate_log (seq, ts, entry)
                 SELECT u.* FROM UNNEST($1::bigint[], $2::text[], $3::text[]) AS u
                 WHERE EXISTS (SELECT 1 FROM h)
             )
             SELECT count(*) FROM h";
        let moved: i64 = tx
            .query_one(
                &prepared(tx, sql).await?,
                &[&seqs, &tss, &lines, &new.0, &new.1, &known.0, &known.1],
            )
            .await
            .map_err(db)?
            .get(0);
        if moved == 1 {
            return Ok(Some(new));
        }
    }
    let head = tx
        .query_one(
            &prepared(
                tx,
                "SELECT seq, hash FROM oncegate_log_head WHERE id = 1 FOR UPDATE",
            )
            .await?,
            &[],
        )
        .await
        .map_err(db)?;
    let (seqs, tss, lines, (seq, hash)) = seal((head.get(0), head.get(1)));
    // Every entry in one statement, and the head moved in the same one: a batch's log costs
    // two round trips however many entries it has.
    let sql = "WITH entries AS (
             INSERT INTO oncegate_log (seq, ts, entry)
             SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::text[])
         )
         UPDATE oncegate_log_head SET seq = $4, hash = $5 WHERE id = 1";
    tx.execute(
        &prepared(tx, sql).await?,
        &[&seqs, &tss, &lines, &seq, &hash],
    )
    .await
    .map_err(db)?;
    Ok(Some((seq, hash)))
}

impl Store for PostgresStore {
    fn claim(&self, req: ClaimRequest) -> BoxFuture<'_, Result<Claim, StoreError>> {
        Box::pin(self.batched(|tx| batch::Op::Claim(Box::new(req), tx)))
    }

    fn settle(&self, req: SettleRequest) -> BoxFuture<'_, Result<Arc<Record>, StoreError>> {
        Box::pin(self.batched(|tx| batch::Op::Settle(Box::new(req), tx)))
    }

    fn resolve(
        &self,
        id: String,
        res: Resolve,
        event: Event,
    ) -> BoxFuture<'_, Result<Record, StoreError>> {
        Box::pin(self.batched(move |tx| batch::Op::Resolve(id, Box::new(res), event, tx)))
    }

    fn renew(
        &self,
        id: &str,
        owner: &str,
        lease: Millis,
        now: Millis,
    ) -> BoxFuture<'_, Result<bool, StoreError>> {
        let (id, owner) = (id.to_string(), owner.to_string());
        let given = self.given(now).map(|t| t as i64);
        Box::pin(async move {
            let c = self.pool.get().await.map_err(pool_err)?;
            let sql = format!(
                "UPDATE oncegate_actions SET lease_until = COALESCE($4, {DB_NOW}) + $3 WHERE id = $1 AND owner = $2 AND state = 'in_flight'"
            );
            let stmt = c.prepare_cached(&sql).await.map_err(db)?;
            let n = c
                .execute(&stmt, &[&id, &owner, &(lease as i64), &given])
                .await
                .map_err(db)?;
            Ok(n == 1)
        })
    }

    fn fences(&self) -> bool {
        true
    }

    fn fence(
        &self,
        id: &str,
        owner: &str,
        attempt: u32,
        lease: Millis,
        now: Millis,
    ) -> BoxFuture<'_, Result<bool, StoreError>> {
        let (id, owner) = (id.to_string(), owner.to_string());
        let given = self.given(now).map(|t| t as i64);
        Box::pin(async move {
            let c = self.pool.get().await.map_err(pool_err)?;
            // One statement, judged by the database's clock: the try is this attempt's only
            // while the action is in flight under this owner and generation and its lease has
            // not run out; then it is recorded as sending, and its lease extended.
            let sql = format!(
                "UPDATE oncegate_actions SET lease_until = COALESCE($5, {DB_NOW}) + $4, sending_at = COALESCE($5, {DB_NOW})
                 WHERE id = $1 AND owner = $2 AND state = 'in_flight' AND generation = $3
                   AND lease_until >= COALESCE($5, {DB_NOW})"
            );
            let stmt = c.prepare_cached(&sql).await.map_err(db)?;
            let n = c
                .execute(
                    &stmt,
                    &[&id, &owner, &i64::from(attempt), &(lease as i64), &given],
                )
                .await
                .map_err(db)?;
            Ok(n == 1)
        })
    }

    fn note(&self, event: LogEvent) {
        // Audit entries for events that change no record go with the writer's next batch, off
        // the request path: the log's head stays the writer's own.
        let op = batch::Op::Note(Box::new(event));
        if let Err(tokio::sync::mpsc::error::TrySendError::Full(op)) = self.ops.try_send(op) {
            let ops = self.ops.clone();
            tokio::spawn(async move { ops.send(op).await });
        }
    }

    fn log(&self, after: u64, limit: usize) -> BoxFuture<'_, Result<Vec<Entry>, StoreError>> {
        Box::pin(async move {
            let c = self.pool.get().await.map_err(pool_err)?;
            let rows = c
                .query(
                    "SELECT entry FROM oncegate_log WHERE seq > $1 ORDER BY seq LIMIT $2",
                    &[&(after as i64), &(limit as i64)],
                )
                .await
                .map_err(db)?;
            rows.iter()
                .map(|r| {
                    serde_json::from_str(r.get(0)).map_err(|e| StoreError::Corrupt {
                        id: "write log entry".into(),
                        reason: e.to_string(),
                    })
                })
                .collect()
        })
    }

    fn verify_log(&self) -> BoxFuture<'_, Result<Verification, StoreError>> {
        Box::pin(async move {
            let c = self.pool.get().await.map_err(pool_err)?;
            let head = c
                .query_one(
                    "SELECT anchor_seq, anchor_prev FROM oncegate_log_head WHERE id = 1",
                    &[],
                )
                .await
                .map_err(db)?;
            let anchor = match (
                head.get::<_, Option<i64>>(0),
                head.get::<_, Option<String>>(1),
            ) {
                (Some(s), Some(p)) => Some((s as u64, p)),
                _ => None,
            };
            let rows = c
                .query("SELECT seq, entry FROM oncegate_log ORDER BY seq", &[])
                .await
                .map_err(db)?;
            let entries = rows.iter().map(|r| {
                let seq: i64 = r.get(0);
                serde_json::from_str::<Entry>(r.get(1)).map_err(|_| seq as u64)
            });
            Ok(log::verify(&self.chain, entries, anchor))
        })
    }

    fn log_head(&self) -> BoxFuture<'_, Result<(u64, String), StoreError>> {
        Box::pin(async move {
            let c = self.pool.get().await.map_err(pool_err)?;
            let r = c
                .query_one("SELECT seq, hash FROM oncegate_log_head WHERE id = 1", &[])
                .await
                .map_err(db)?;
            Ok((r.get::<_, i64>(0) as u64, r.get(1)))
        })
    }

    fn keyer(&self) -> crate::identity::Keyer {
        self.keyer.clone()
    }

    fn counts(&self) -> BoxFuture<'_, Result<Vec<(State, u64)>, StoreError>> {
        Box::pin(async move {
            let c = self.pool.get().await.map_err(pool_err)?;
            let rows = c
                .query(
                    "SELECT state, sum(n)::bigint FROM oncegate_counts GROUP BY state",
                    &[],
                )
                .await
                .map_err(db)?;
            let mut out: Vec<(State, u64)> = State::ALL.into_iter().map(|s| (s, 0)).collect();
            for r in rows {
                if let Some(s) = State::parse(r.get(0)) {
                    if let Some(slot) = out.iter_mut().find(|(st, _)| *st == s) {
                        slot.1 = r.get::<_, i64>(1) as u64;
                    }
                }
            }
            Ok(out)
        })
    }

    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(async move {
            let c = self.pool.get().await.map_err(pool_err)?;
            let row = c
                .query_opt(
                    "SELECT record, lease_until FROM oncegate_actions WHERE id = $1",
                    &[&id],
                )
                .await
                .map_err(db)?;
            row.map(|r| decode(id, r.get(0), r.get(1), self.sealer.as_deref()))
                .transpose()
        })
    }

    fn body<'a>(&'a self, record: &'a Record) -> BoxFuture<'a, Result<Option<Bytes>, StoreError>> {
        Box::pin(async move {
            if !matches!(
                record.response.as_ref().map(|r| &r.body),
                Some(BodyRef::Inline)
            ) {
                return Ok(None);
            }
            let c = self.pool.get().await.map_err(pool_err)?;
            let row = c
                .query_opt(
                    "SELECT body FROM oncegate_actions WHERE id = $1",
                    &[&record.id],
                )
                .await
                .map_err(db)?;
            let stored = row.and_then(|r| r.get::<_, Option<Vec<u8>>>(0));
            match (stored, self.sealer.as_deref()) {
                (None, _) => Ok(None),
                (Some(b), None) => Ok(Some(Bytes::from(b))),
                (Some(b), Some(s)) => {
                    s.open(&b)
                        .map(|p| Some(Bytes::from(p)))
                        .map_err(|reason| StoreError::Corrupt {
                            id: record.id.clone(),
                            reason,
                        })
                }
            }
        })
    }

    fn scan(&self, filter: Filter, limit: usize) -> BoxFuture<'_, Result<Vec<Record>, StoreError>> {
        Box::pin(async move {
            let c = self.pool.get().await.map_err(pool_err)?;
            let state = filter.state.map(|s| s.as_str().to_string());
            let (before_at, before_id) = match &filter.before {
                Some((at, id)) => (Some(*at as i64), Some(id.as_str())),
                None => (None, None),
            };
            let limit = limit.min(i64::MAX as usize) as i64;
            let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![
                &state,
                &filter.upstream,
                &filter.principal,
                &filter.task,
                &limit,
                &filter.tool,
            ];
            // The tool is read from the record (never sealed): an operator's filter, not a
            // path of the proxy's own.
            const SELECT: &str = "SELECT id, record, lease_until FROM oncegate_actions
                 WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR upstream = $2)
                   AND ($3::text IS NULL OR principal = $3) AND ($4::text IS NULL OR task = $4)
                   AND ($6::text IS NULL OR (record::jsonb ->> 'tool') = $6)";
            let sql = if filter.newest_first {
                params.push(&before_at);
                params.push(&before_id);
                format!(
                    "{SELECT} AND ($7::bigint IS NULL OR (created_at, id) < ($7, $8::text))
                     ORDER BY created_at DESC, id DESC LIMIT $5"
                )
            } else {
                format!("{SELECT} ORDER BY created_at, id LIMIT $5")
            };
            let rows = c.query(sql.as_str(), &params).await.map_err(db)?;
            rows.iter()
                .map(|r| decode(r.get(0), r.get(1), r.get(2), self.sealer.as_deref()))
                .collect()
        })
    }

    fn recover(
        &self,
        owner: Option<String>,
        now: Millis,
    ) -> BoxFuture<'_, Result<usize, StoreError>> {
        let given = self.given(now);
        Box::pin(async move {
            // Shared store: a proxy recovers its own attempts (at its drain deadline) or anyone's
            // whose lease expired (at start and from the sweeper); never a live proxy's.
            let c = self.pool.get().await.map_err(pool_err)?;
            let ids: Vec<String> = match &owner {
                Some(o) => c
                    .query("SELECT id FROM oncegate_actions WHERE state = 'in_flight' AND owner = $1", &[o])
                    .await,
                None => c
                    .query(
                        &format!("SELECT id FROM oncegate_actions WHERE state = 'in_flight' AND lease_until < COALESCE($1, {DB_NOW})"),
                        &[&given.map(|t| t as i64)],
                    )
                    .await,
            }
            .map_err(db)?
            .iter()
            .map(|r| r.get(0))
            .collect();
            drop(c);
            let mut n = 0;
            for id in ids {
                let chain = self.chain.clone();
                let sealer = self.sealer.clone();
                let owner = owner.clone();
                let instance = self.instance.clone();
                let changed = self
                    .tx(move |tx| {
                        Box::pin(async move {
                            let now = judge_time(tx, given).await?;
                            let Some(r) = lock(tx, &id, sealer.as_deref()).await? else { return Ok(false) };
                            let due = match &owner {
                                Some(o) => r.owner.as_ref() == Some(o),
                                None => r.lease_until.is_some_and(|l| l < now),
                            };
                            if !due {
                                return Ok(false);
                            }
                            let reason = if owner.is_some() {
                                "the proxy stopped (drain_timeout) during this attempt; the request may have reached the upstream".to_string()
                            } else {
                                format!(
                                    "the lease of proxy {} expired during this attempt; the request may have reached the upstream",
                                    r.owner.as_deref().unwrap_or("?")
                                )
                            };
                            let Some(u) = recover_in_flight(r, &reason, now) else { return Ok(false) };
                            write(tx, &u, None, sealer.as_deref()).await?;
                            let mut moves = Moves::default();
                            moves.moved(Some(State::InFlight), Some(u.state));
                            moves.save(tx, &instance).await?;
                            append(tx, &chain, vec![recover_event(&u, &reason).into()]).await?;
                            Ok(true)
                        })
                    })
                    .await?;
                n += usize::from(changed);
            }
            Ok(n)
        })
    }

    fn expire(&self, now: Millis) -> BoxFuture<'_, Result<usize, StoreError>> {
        let given = self.given(now);
        Box::pin(async move {
            // Leases are swept here too: any instance turns a dead proxy's attempts unknown.
            self.recover(None, now).await?;
            let chain = self.chain.clone();
            let sealer = self.sealer.clone();
            let retention = self.log_retention;
            let instance = self.instance.clone();
            self.tx(move |tx| {
                Box::pin(async move {
                    let now = judge_time(tx, given).await?;
                    // Only settled actions expire (SPEC §5), by the database's clock.
                    let rows = tx
                        .query(
                            "DELETE FROM oncegate_actions WHERE expires_at <= $1 AND state IN ('succeeded', 'failed') RETURNING id, record",
                            &[&(now as i64)],
                        )
                        .await
                        .map_err(db)?;
                    let mut events = Vec::new();
                    let mut moves = Moves::default();
                    for r in &rows {
                        let rec = decode(r.get(0), r.get(1), None, sealer.as_deref())?;
                        moves.moved(Some(rec.state), None);
                        events.push(LogEvent::for_record(Event::Expired, &rec, Actor::Proxy));
                    }
                    moves.save(tx, &instance).await?;
                    append(tx, &chain, events).await?;
                    if let Some(keep) = retention {
                        let cutoff = crate::action::rfc3339(now.saturating_sub(keep.as_millis() as u64));
                        let head: i64 = tx
                            .query_one("SELECT seq FROM oncegate_log_head WHERE id = 1 FOR UPDATE", &[])
                            .await
                            .map_err(db)?
                            .get(0);
                        let first_kept = tx
                            .query_opt(
                                "SELECT entry FROM oncegate_log WHERE ts >= $1 OR seq = $2 ORDER BY seq LIMIT 1",
                                &[&cutoff, &head],
                            )
                            .await
                            .map_err(db)?;
                        if let Some(row) = first_kept {
                            let e: Entry = serde_json::from_str(row.get(0)).map_err(|e| StoreError::Corrupt {
                                id: "write log entry".into(),
                                reason: e.to_string(),
                            })?;
                            let dropped = tx
                                .execute("DELETE FROM oncegate_log WHERE seq < $1", &[&(e.seq as i64)])
                                .await
                                .map_err(db)?;
                            if dropped > 0 {
                                tx.execute(
                                    "UPDATE oncegate_log_head SET anchor_seq = $1, anchor_prev = $2 WHERE id = 1",
                                    &[&(e.seq as i64), &e.prev],
                                )
                                .await
                                .map_err(db)?;
                            }
                        }
                    }
                    Ok(rows.len())
                })
            })
            .await
        })
    }

    fn close(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            // Every change was committed before it returned; nothing is buffered here but the
            // head this proxy saw last.
            if let Some(seen) = &self.seen {
                let newest = self.head.lock().unwrap_or_else(|p| p.into_inner()).clone();
                seen.save(newest).await;
            }
            self.pool.close();
            Ok(())
        })
    }
}
