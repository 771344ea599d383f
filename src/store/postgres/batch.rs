//! Group commit on PostgreSQL (SPEC §13): one writer per proxy gathers the claims,
//! settlements and resolutions of concurrent requests into one transaction, extends the write
//! log's chain once for all of them, commits, and then answers each.
//!
//! Before, every change was a transaction of its own that took the chain's head row at its
//! start... and held it through its remaining round trips and its commit: a fleet's writes ran
//! one at a time. Now the head row is taken once a batch, after every change of the batch is
//! made, for one statement and the commit.
//!
//! A batch takes its locks in one order, so that two proxies' batches do not wait on each
//! other in a circle: the advisory locks of its twin keys (sorted), then its actions' rows (its
//! operations sorted by action id; a stable sort, so that two operations on one action keep
//! their order), then the head row. A batch decided without reading ([`super::fast`]) takes
//! each new action's twin-key lock just before inserting its row, in the same twin-key order,
//! and its new rows before the rows it settles: against a batch made under lock it can still
//! wait in a circle, which PostgreSQL breaks by ending one of the two after `deadlock_timeout`.
//! Nothing of that one was committed, and it is made again under lock ([`Ending::LockCycle`]).
//! The statements of different actions are pipelined on the connection (sent together,
//! answered in order); those of one action run one after another. The decisions are the pure
//! transitions every store applies ([`crate::action::machine`]).

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use deadpool_postgres::GenericClient;
use tokio::sync::mpsc;

use super::commit::{Ending, Last, Sending};
pub(super) use super::op::{Changes, Done, Op};
use super::sets::{Outcome, Rows};
use super::{
    db, encode, judge_time, lock, pool_err, prepared, twin_holder, unavailable, write, Head, Moves,
    Sealer,
};
use crate::action::{
    apply_resolve, apply_settle, decide_claim, BodyRef, ClaimRequest, Millis, Record, Resolve,
};
use crate::log::{Actor, Chain, Event, LogEvent};
use crate::store::{claim_events, resolve_event, settle_event, SettleRequest, StoreError};

/// At most this many operations a transaction.
const BATCH_MAX: usize = 128;

/// How long a proxy that found the log's head moved by another reads it under lock.
const CONTENDED_FOR: std::time::Duration = std::time::Duration::from_secs(1);

/// The writer's own part of the store.
pub(super) struct Writer {
    /// This instance's rows in `oncegate_counts`.
    pub(super) instance: Arc<str>,
    pub(super) pool: deadpool_postgres::Pool,
    pub(super) sealer: Option<Arc<Sealer>>,
    pub(super) caller_clock: bool,
    pub(super) chain: Chain,
    pub(super) flush_latency: Option<prometheus_client::metrics::histogram::Histogram>,
    pub(super) batches: crate::store::BatchCounts,
    /// The newest log head this proxy committed: the next batch chains after it without
    /// reading the head first, unless another transaction moved it meanwhile.
    pub(super) head: Arc<std::sync::Mutex<Option<Head>>>,
    /// The database's clock, read once a second.
    pub(super) clock: super::clock::DbClock,
    /// Until when the head is read under lock (another proxy moved it lately).
    pub(super) contended: std::sync::Mutex<Option<std::time::Instant>>,
    /// What batches made as one statement decide on ([`super::fast`]).
    pub(super) memory: std::sync::Mutex<super::fast::Memory>,
}

impl Writer {
    /// Starts the writer: it commits what arrives, a batch at a time, until every sender is
    /// gone. One writer a proxy: a second, committing while the first gathers, was measured
    /// (bench/results-fleet.md) to make smaller batches and cost more CPU a write than it saved.
    pub(super) fn spawn(self, mut rx: mpsc::Receiver<Op>) {
        tokio::spawn(async move {
            let mut ops = Vec::with_capacity(BATCH_MAX);
            while rx.recv_many(&mut ops, BATCH_MAX).await > 0 {
                let batch = std::mem::take(&mut ops);
                self.commit(batch).await;
            }
        });
    }

    /// The head to chain the next batch after.
    fn known_head(&self) -> Option<Head> {
        self.head.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Keeps the head a committed batch moved to (`None`: it appended nothing, the head kept
    /// is still its own), or forgets it when a batch failed.
    pub(super) fn keep_head(&self, new: Option<Head>, failed: bool) {
        let mut h = self.head.lock().unwrap_or_else(|p| p.into_inner());
        if failed {
            *h = None;
            self.clock.forget();
        } else if new.is_some() {
            *h = new;
        }
    }

    async fn commit(&self, mut ops: Vec<Op>) {
        // The guarded claims first, by twin key; then by action id (stable, keeping the order
        // of two operations on one action).
        ops.sort_by(|a, b| {
            (a.twin_key().is_none(), a.twin_key(), a.id()).cmp(&(
                b.twin_key().is_none(),
                b.twin_key(),
                b.id(),
            ))
        });
        let started = std::time::Instant::now();
        match self.transaction(&ops).await {
            Ok(done) => {
                if let Some(h) = &self.flush_latency {
                    h.observe(started.elapsed().as_secs_f64());
                }
                for (op, d) in ops.into_iter().zip(done) {
                    op.answer(d);
                }
            }
            Err(e) => {
                // Nothing of the batch was committed: each hears why.
                let why = e.to_string();
                tracing::warn!(operations = ops.len(), error = %why, "store: a batch was not committed; its requests are answered 503");
                for op in ops {
                    op.answer(Err(StoreError::Unavailable(why.clone())));
                }
            }
        }
    }

    /// The batch's transaction: every operation's change, then the log's, then the commit.
    /// `Err` when the transaction failed (nothing is committed); an operation refused by its
    /// transition (a stale settlement, a resolution of a settled action) fails alone.
    async fn transaction(&self, ops: &[Op]) -> Result<Vec<Result<Done, StoreError>>, StoreError> {
        let c = self.pool.get().await.map_err(pool_err)?;
        // Decided without reading when it can be: as one statement, or, once the head proved
        // moved by another proxy, with the head read under lock.
        let done = match self.alone(&c, ops).await {
            Some(Err(Ending::HeadMoved)) => {
                self.batches.again.inc();
                self.contended();
                self.alone(&c, ops).await
            }
            first => first,
        };
        let mut done = match done {
            Some(Ok(done)) => return Ok(done),
            Some(Err(Ending::Stale | Ending::LockCycle)) => {
                self.batches.again.inc();
                self.in_transaction(&c, ops, self.chain_after()).await
            }
            Some(Err(e)) => Err(e),
            None => self.in_transaction(&c, ops, self.chain_after()).await,
        };
        if let Err(Ending::HeadMoved) = done {
            self.batches.again.inc();
            // Another proxy shares the log: nothing of the batch was committed; it is made
            // again with the head read under lock, as the next batches are for a while.
            self.contended();
            done = self.in_transaction(&c, ops, None).await;
        }
        if let Err(Ending::LockCycle) = done {
            // Ended against a batch made as one statement, which takes its locks in another
            // order; made again under lock, it waits for that batch to end. Nothing of it was
            // committed: whatever it had sent ends with the `ROLLBACK`.
            self.batches.again.inc();
            if c.batch_execute("ROLLBACK").await.is_ok() {
                done = self.in_transaction(&c, ops, None).await;
            }
        }
        match done {
            Ok(done) => {
                self.batches.under_lock.inc();
                Ok(done)
            }
            Err(e) => {
                // Nothing was committed: the transaction ends here, or with its connection.
                if c.batch_execute("ROLLBACK").await.is_err() {
                    drop(deadpool_postgres::Object::take(c));
                }
                Err(match e {
                    Ending::Failed(e) => e,
                    Ending::HeadMoved => unavailable("the write log's head moved under its lock"),
                    Ending::Stale => unavailable("a row changed under its lock"),
                    Ending::LockCycle => unavailable(super::LOCK_CYCLE),
                })
            }
        }
    }

    /// What the batch writes last, into this proxy's chain and counts.
    pub(super) fn last<'a>(
        &'a self,
        rows: &'a Rows,
        moves: &'a Moves,
        events: Vec<LogEvent>,
    ) -> Last<'a> {
        Last {
            chain: &self.chain,
            instance: &self.instance,
            rows,
            moves,
            events,
        }
    }

    /// Another proxy moved the log's head: the head kept is forgotten, and read under lock by
    /// the batches of the next [`CONTENDED_FOR`].
    fn contended(&self) {
        self.keep_head(None, false);
        *self.contended.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(std::time::Instant::now() + CONTENDED_FOR);
    }

    /// The head the batch chains after without reading it: the one this proxy last committed,
    /// unless another proxy moved it lately.
    pub(super) fn chain_after(&self) -> Option<Head> {
        let mut contended = self.contended.lock().unwrap_or_else(|p| p.into_inner());
        match *contended {
            Some(until) if std::time::Instant::now() < until => None,
            _ => {
                *contended = None;
                self.known_head()
            }
        }
    }

    /// [`Writer::transaction`] on `tx`: its `BEGIN` goes out together with the batch's first
    /// statements (the twin keys' locks, the reads and inserts of its rows), which the server
    /// runs in order after it, so that opening the transaction costs no round trip of its own;
    /// its last statement goes with the `COMMIT` ([`super::commit`]).
    async fn in_transaction(
        &self,
        tx: &deadpool_postgres::Client,
        ops: &[Op],
        head: Option<Head>,
    ) -> Result<Vec<Result<Done, StoreError>>, Ending> {
        self.memory().forget(ops);
        let begin = tx.batch_execute("BEGIN");
        let work = self.changes(tx, ops);
        let (began, worked) = tokio::join!(begin, work);
        began.map_err(db)?;
        let (done, events, moves, rows) = worked?;
        let last = self.last(&rows, &moves, events);
        let committed = last.commit(tx, head, Sending::WithCommit).await;
        match committed {
            Ok(head) => {
                self.keep_head(head, false);
                self.memory().committed();
            }
            Err(e) => {
                self.keep_head(None, true);
                self.memory().forget(ops);
                return Err(e);
            }
        }
        Ok(done)
    }

    /// The database's time to judge by (`None`: each operation's own, `caller_clock`), read
    /// when the last reading is too old.
    pub(super) async fn db_now(
        &self,
        tx: &deadpool_postgres::Client,
    ) -> Result<Option<Millis>, StoreError> {
        if self.caller_clock {
            return Ok(None);
        }
        if let Some(t) = self.clock.now() {
            return Ok(Some(t));
        }
        let sent = std::time::Instant::now();
        let t = judge_time(tx, None).await?;
        self.clock.sampled(t, sent);
        Ok(Some(t))
    }

    /// Every operation's change, decided and made: each one's answer, and the log entries and
    /// count moves of them all.
    async fn changes(
        &self,
        tx: &deadpool_postgres::Client,
        ops: &[Op],
    ) -> Result<(Vec<Result<Done, StoreError>>, Vec<LogEvent>, Moves, Rows), StoreError> {
        let mut keys: Vec<&str> = ops.iter().filter_map(Op::twin_key).collect();
        keys.sort_unstable();
        keys.dedup();
        // The clock and the twin keys' locks, sent together.
        let clock = self.db_now(tx);
        let locks = async {
            if !keys.is_empty() {
                let sql = "SELECT pg_advisory_xact_lock(hashtextextended(k, 0)) FROM (SELECT unnest($1::text[]) AS k ORDER BY 1) s";
                tx.execute(&prepared(tx, sql).await?, &[&keys])
                    .await
                    .map_err(db)?;
            }
            Ok::<_, StoreError>(())
        };
        let (db_now, locked) = tokio::join!(clock, locks);
        let db_now = db_now?;
        locked?;
        let now = |op: &Op| db_now.unwrap_or_else(|| op.given());
        // An operation alone in the batch on its action (and on its twin key) goes with the
        // others of its kind in set-based statements, claims and changes pipelined together.
        let mut on_id: HashMap<&str, usize> = HashMap::new();
        let mut on_twin: HashMap<&str, usize> = HashMap::new();
        for op in ops {
            *on_id.entry(op.id()).or_default() += 1;
            if let Some(k) = op.twin_key() {
                *on_twin.entry(k).or_default() += 1;
            }
        }
        let alone = |op: &Op| on_id[op.id()] == 1 && op.twin_key().is_none_or(|k| on_twin[k] == 1);
        let mut outcomes: Vec<Option<Outcome>> = (0..ops.len()).map(|_| None).collect();
        let (mut claims, mut changes) = (Vec::new(), Vec::new());
        for (i, op) in ops.iter().enumerate() {
            match op {
                Op::Note(ev) => {
                    let ch = (vec![(**ev).clone()], Moves::default());
                    outcomes[i] = Some((Ok(Done::Note), ch));
                }
                Op::Claim(..) if alone(op) => claims.push(i),
                _ if alone(op) => changes.push(i),
                _ => {}
            }
        }
        let (claimed, changed) = tokio::join!(
            self.claim_set(tx, ops, &claims, &now),
            self.change_set(tx, ops, &changes, &now)
        );
        for (i, o) in claimed?.into_iter() {
            outcomes[i] = o;
        }
        let (changed, rows) = changed?;
        for (i, o) in changed {
            outcomes[i] = Some(o);
        }
        // The rest one at a time: the operations on one action in order; those on different
        // actions pipelined on the connection. Claims under the twin guard decide on what the
        // claims of the same twin key before them wrote: those run one after another.
        let rest: Vec<usize> = (0..ops.len()).filter(|&i| outcomes[i].is_none()).collect();
        let (guarded, unguarded) =
            rest.split_at(rest.partition_point(|&i| ops[i].twin_key().is_some()));
        let groups = guarded
            .chunk_by(|&a, &b| ops[a].twin_key() == ops[b].twin_key())
            .chain(unguarded.chunk_by(|&a, &b| ops[a].id() == ops[b].id()))
            .map(|group| {
                let (tx, now) = (tx, &now);
                async move {
                    let mut out = Vec::with_capacity(group.len());
                    for &i in group {
                        let (op, now) = (&ops[i], now(&ops[i]));
                        let mut ch: Changes = (Vec::new(), Moves::default());
                        let d = match op {
                            Op::Claim(req, _) => self.claim(tx, req, now, &mut ch).await,
                            Op::Settle(req, _) => self.settle(tx, req, now, &mut ch).await,
                            Op::Resolve(id, res, event, _) => {
                                self.resolve(tx, id, res, *event, now, &mut ch).await
                            }
                            Op::Note(..) => Ok(Done::Note),
                        };
                        out.push((i, (d, ch)));
                    }
                    out
                }
            });
        for (i, o) in futures_util::future::join_all(groups)
            .await
            .into_iter()
            .flatten()
        {
            outcomes[i] = Some(o);
        }
        let mut events = Vec::new();
        let mut moves = Moves::default();
        let mut done = Vec::with_capacity(ops.len());
        for outcome in outcomes {
            let Some((d, (evs, mv))) = outcome else {
                return Err(unavailable(
                    "internal error: an operation of the batch was not made",
                ));
            };
            // A failed statement aborts the whole transaction.
            if let Err(e @ StoreError::Unavailable(_)) = d {
                return Err(e);
            }
            events.extend(evs);
            moves.add(&mv);
            done.push(d);
        }
        Ok((done, events, moves, rows))
    }

    async fn claim(
        &self,
        tx: &impl GenericClient,
        req: &ClaimRequest,
        now: Millis,
        (events, moves): &mut Changes,
    ) -> Result<Done, StoreError> {
        let sealer = self.sealer.as_deref();
        let mut req = req.clone();
        req.now = now;
        let twin = match req.twin_key() {
            Some(key) => twin_holder(tx, key, &req.fresh.id, sealer).await?,
            None => None,
        };
        // A new action is inserted atomically; a race loses to the row that exists.
        let (fresh_claim, fresh_write) = decide_claim(None, twin.clone(), &req);
        let Some(fresh) = fresh_write else {
            // Stopped by an unsettled twin.
            return Ok(Done::Claim(fresh_claim));
        };
        let lease = fresh.lease_until.map(|l| l as i64);
        let sql = "INSERT INTO oncegate_actions (id, state, upstream, principal, task, owner, lease_until, created_at, expires_at, record, twin, generation, sending_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $8) ON CONFLICT (id) DO NOTHING";
        let inserted = tx
            .execute(
                &prepared(tx, sql).await?,
                &[
                    &fresh.id,
                    &fresh.state.as_str(),
                    &fresh.upstream,
                    &fresh.principal,
                    &fresh.task,
                    &fresh.owner,
                    &lease,
                    &(fresh.created_at as i64),
                    &fresh.expires_at.map(|e| e as i64),
                    &encode(&fresh, sealer),
                    &fresh.holds_twin().then(|| fresh.twin_key()),
                    &i64::from(fresh.attempts),
                ],
            )
            .await
            .map_err(db)?;
        if inserted == 1 {
            moves.moved(None, Some(fresh.state));
            events.extend(
                claim_events(&fresh_claim, &fresh)
                    .into_iter()
                    .map(LogEvent::from),
            );
            return Ok(Done::Claim(fresh_claim));
        }
        let current = lock(tx, &req.fresh.id, sealer).await?;
        let was = current.as_ref().map(|c| c.state);
        let expired = current.as_ref().filter(|c| req.replaces(c)).cloned();
        let (claim, w) = decide_claim(current, twin, &req);
        if let Some(w) = &w {
            moves.moved(was, Some(w.state));
            if let Some(o) = expired {
                // The expired record and its stored body give way to the new action.
                tx.execute(
                    "UPDATE oncegate_actions SET body = NULL WHERE id = $1",
                    &[&o.id],
                )
                .await
                .map_err(db)?;
                events.push(LogEvent::for_record(Event::Expired, &o, Actor::Proxy));
            }
            write(tx, w, None, sealer).await?;
            events.extend(claim_events(&claim, w).into_iter().map(LogEvent::from));
        }
        Ok(Done::Claim(claim))
    }

    async fn settle(
        &self,
        tx: &impl GenericClient,
        req: &SettleRequest,
        now: Millis,
        (events, moves): &mut Changes,
    ) -> Result<Done, StoreError> {
        let sealer = self.sealer.as_deref();
        let current = lock(tx, &req.id, sealer).await?;
        let new = settled(req, current, now, &mut (events, moves))?;
        write(tx, &new, req.body.as_ref(), sealer).await?;
        Ok(Done::Settle(Arc::new(new)))
    }

    async fn resolve(
        &self,
        tx: &impl GenericClient,
        id: &str,
        res: &Resolve,
        event: Event,
        now: Millis,
        (events, moves): &mut Changes,
    ) -> Result<Done, StoreError> {
        let sealer = self.sealer.as_deref();
        let current = lock(tx, id, sealer).await?;
        let (new, body) = resolved(id, res, event, current, now, &mut (events, moves))?;
        write(tx, &new, body.as_ref(), sealer).await?;
        Ok(Done::Resolve(Box::new(new)))
    }
}

/// A settlement decided on `current` (the locked record): its new record, with the moves and
/// the log entry it makes. `Err` when the transition refuses it (a stale settlement).
pub(super) fn settled(
    req: &SettleRequest,
    current: Option<Record>,
    now: Millis,
    (events, moves): &mut (&mut Vec<LogEvent>, &mut Moves),
) -> Result<Record, StoreError> {
    let mut settlement = req.settlement.clone();
    if let Some(resp) = settlement.response.as_mut() {
        if req.body.is_some() {
            resp.body = BodyRef::Inline;
        }
    }
    settlement.now = now;
    let was = current.as_ref().map(|c| c.state);
    let new = apply_settle(current, &req.id, req.attempt, settlement)?;
    moves.moved(was, Some(new.state));
    events.push(settle_event(&new).into());
    Ok(new)
}

/// A resolution decided on `current`: its new record and the body to store, with the moves and
/// the log entry it makes. `Err` when the transition refuses it.
pub(super) fn resolved(
    id: &str,
    res: &Resolve,
    event: Event,
    current: Option<Record>,
    now: Millis,
    (events, moves): &mut (&mut Vec<LogEvent>, &mut Moves),
) -> Result<(Record, Option<Bytes>), StoreError> {
    let mut res = res.clone();
    let body: Option<Bytes> = res.body.take();
    if let (Some(resp), true) = (res.response.as_mut(), body.is_some()) {
        resp.body = BodyRef::Inline;
    }
    let actor = if event == Event::Lookup {
        Actor::Lookup
    } else {
        Actor::Admin
    };
    let reason = res.reason.clone();
    res.now = now;
    let was = current.as_ref().map(|c| c.state);
    let new = apply_resolve(current, id, res)?;
    moves.moved(was, Some(new.state));
    events.push(resolve_event(event, &new, actor, reason).into());
    Ok((new, body))
}
