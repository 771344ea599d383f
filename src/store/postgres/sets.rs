//! A batch's row work as set-based statements (SPEC §13): the fresh claims of a batch are
//! inserted by one statement (after one that reads every twin slot they need), and its
//! settlements and resolutions are read and locked by one statement and written by the batch's
//! last one. Each
//! decision is still the pure transition every store makes, per operation.
//!
//! Only operations alone in the batch on their action (and, for a guarded claim, on its twin
//! key) go this way; the rest, and a claim whose insert found the action already there, take
//! the one-at-a-time path after ([`super::batch`]).

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use deadpool_postgres::GenericClient;

use super::batch::{resolved, settled, Changes, Done, Op, Writer};
use super::{db, decode, encode, prepared, Moves, Sealer};
use crate::action::{decide_claim, Millis, Record};
use crate::log::LogEvent;
use crate::store::{claim_events, StoreError};

/// What one operation came to: its answer, and what it changes besides its record.
pub(super) type Outcome = (Result<Done, StoreError>, Changes);

/// How the batch's last statement writes a row ([`super::commit`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Kind {
    /// Decided on the row read under its lock: written whatever is there.
    Locked,
    /// A new action decided on nothing stored: inserted only if its id and its twin slot are
    /// free.
    Fresh,
    /// Decided on the record this proxy last wrote: written only if the row still holds it.
    Checked,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Locked => "l",
            Kind::Fresh => "f",
            Kind::Checked => "c",
        }
    }
}

/// The columns of rows to write, one array each (`UNNEST`).
#[derive(Default)]
pub(super) struct Rows {
    id: Vec<String>,
    state: Vec<&'static str>,
    upstream: Vec<String>,
    principal: Vec<String>,
    task: Vec<Option<String>>,
    owner: Vec<Option<String>>,
    lease: Vec<Option<i64>>,
    created: Vec<i64>,
    expires: Vec<Option<i64>>,
    record: Vec<String>,
    body: Vec<Option<Vec<u8>>>,
    twin: Vec<Option<String>>,
    generation: Vec<i64>,
    kind: Vec<&'static str>,
    /// What a checked row must still hold (its `record` column).
    old: Vec<Option<String>>,
}

impl Rows {
    /// A row decided under its lock. Returns the record as it will be stored.
    pub(super) fn push(
        &mut self,
        r: &Record,
        body: Option<&Bytes>,
        sealer: Option<&Sealer>,
    ) -> &str {
        self.push_as(Kind::Locked, r, body, sealer, None)
    }

    /// A row written as `kind` says (`old`: what a checked row must still hold). Returns the
    /// record as it will be stored.
    pub(super) fn push_as(
        &mut self,
        kind: Kind,
        r: &Record,
        body: Option<&Bytes>,
        sealer: Option<&Sealer>,
        old: Option<String>,
    ) -> &str {
        self.id.push(r.id.clone());
        self.state.push(r.state.as_str());
        self.upstream.push(r.upstream.clone());
        self.principal.push(r.principal.clone());
        self.task.push(r.task.clone());
        self.owner.push(r.owner.clone());
        self.lease.push(r.lease_until.map(|l| l as i64));
        self.created.push(r.created_at as i64);
        self.expires.push(r.expires_at.map(|e| e as i64));
        self.record.push(encode(r, sealer));
        self.body.push(body.map(|b| super::seal_opt(sealer, b)));
        self.twin.push(r.holds_twin().then(|| r.twin_key()));
        self.generation.push(i64::from(r.attempts));
        self.kind.push(kind.as_str());
        self.old.push(old);
        self.record.last().map_or("", String::as_str)
    }

    /// Whether any row is of `kind`.
    pub(super) fn has(&self, kind: Kind) -> bool {
        self.kind.contains(&kind.as_str())
    }

    /// How many rows are written only if what they were decided on still holds.
    pub(super) fn conditional(&self) -> i64 {
        self.kind.iter().filter(|k| **k != "l").count() as i64
    }

    /// [`Rows::params`], with each row's kind and what a checked row must still hold.
    pub(super) fn all_params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 15] {
        let [p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13] = self.params();
        [
            p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, &self.kind, &self.old,
        ]
    }

    pub(super) fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 13] {
        [
            &self.id,
            &self.state,
            &self.upstream,
            &self.principal,
            &self.task,
            &self.owner,
            &self.lease,
            &self.created,
            &self.expires,
            &self.record,
            &self.body,
            &self.twin,
            &self.generation,
        ]
    }
}

pub(super) const UNNEST: &str = "UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::bigint[], $8::bigint[], $9::bigint[], $10::text[], $11::bytea[], $12::text[], $13::bigint[])
    AS u(id, state, upstream, principal, task, owner, lease_until, created_at, expires_at, record, body, twin, generation)";

impl Writer {
    /// The claims `which` of `ops` (each alone on its action and twin key): their twin slots
    /// read in one statement, the new actions inserted in one. A claim whose action already
    /// exists is left (`None`) for the one-at-a-time path.
    pub(super) async fn claim_set(
        &self,
        tx: &impl GenericClient,
        ops: &[Op],
        which: &[usize],
        now: &(dyn Fn(&Op) -> Millis + Sync),
    ) -> Result<Vec<(usize, Option<Outcome>)>, StoreError> {
        let sealer = self.sealer.as_deref();
        let keys: Vec<&str> = which.iter().filter_map(|&i| ops[i].twin_key()).collect();
        let mut holders: HashMap<String, Arc<Record>> = HashMap::new();
        if !keys.is_empty() {
            let sql =
                "SELECT twin, id, record, lease_until FROM oncegate_actions WHERE twin = ANY($1)";
            for row in tx
                .query(&prepared(tx, sql).await?, &[&keys])
                .await
                .map_err(db)?
            {
                let rec = decode(row.get(1), row.get(2), row.get(3), sealer)?;
                holders.insert(row.get(0), Arc::new(rec));
            }
        }
        let mut out = Vec::with_capacity(which.len());
        let mut rows = Rows::default();
        let mut fresh = Vec::new();
        for &i in which {
            let Op::Claim(req, _) = &ops[i] else {
                continue;
            };
            let mut req = (**req).clone();
            req.now = now(&ops[i]);
            // The holder of its twin slot, other than itself.
            let twin = req
                .twin_key()
                .and_then(|k| holders.get(k))
                .filter(|h| h.id != req.fresh.id)
                .cloned();
            let (claim, write) = decide_claim(None, twin, &req);
            match write {
                // Stopped by an unsettled twin.
                None => out.push((i, Some((Ok(Done::Claim(claim)), Changes::default())))),
                Some(w) => {
                    let text = rows.push(&w, None, sealer).to_string();
                    fresh.push((i, claim, w, text));
                }
            }
        }
        if fresh.is_empty() {
            return Ok(out);
        }
        let sql = format!(
            "INSERT INTO oncegate_actions (id, state, upstream, principal, task, owner, lease_until, created_at, expires_at, record, body, twin, generation, sending_at)
             SELECT u.*, u.created_at FROM {UNNEST}
             ON CONFLICT (id) DO NOTHING RETURNING id"
        );
        let inserted: std::collections::HashSet<String> = tx
            .query(&prepared(tx, &sql).await?, &rows.params())
            .await
            .map_err(db)?
            .into_iter()
            .map(|r| r.get(0))
            .collect();
        for (i, claim, w, text) in fresh {
            if !inserted.contains(&w.id) {
                out.push((i, None));
                continue;
            }
            // Its settlement can then be decided without reading ([`super::fast`]).
            self.memory().hold_after_commit(w.clone(), text);
            let mut moves = Moves::default();
            moves.moved(None, Some(w.state));
            let events: Vec<LogEvent> = claim_events(&claim, &w)
                .into_iter()
                .map(LogEvent::from)
                .collect();
            out.push((i, Some((Ok(Done::Claim(claim)), (events, moves)))));
        }
        Ok(out)
    }

    /// The settlements and resolutions `which` of `ops` (each alone on its action): their
    /// records read and locked in one statement, and decided each. Their new rows are returned
    /// to be written by the batch's last statement ([`super::commit`]).
    pub(super) async fn change_set(
        &self,
        tx: &impl GenericClient,
        ops: &[Op],
        which: &[usize],
        now: &(dyn Fn(&Op) -> Millis + Sync),
    ) -> Result<(Vec<(usize, Outcome)>, Rows), StoreError> {
        if which.is_empty() {
            return Ok((Vec::new(), Rows::default()));
        }
        let sealer = self.sealer.as_deref();
        let ids: Vec<&str> = which.iter().map(|&i| ops[i].id()).collect();
        let sql = "SELECT id, record, lease_until FROM oncegate_actions WHERE id = ANY($1) ORDER BY id FOR UPDATE";
        let mut current: HashMap<String, Record> = HashMap::new();
        for row in tx
            .query(&prepared(tx, sql).await?, &[&ids])
            .await
            .map_err(db)?
        {
            current.insert(
                row.get(0),
                decode(row.get(0), row.get(1), row.get(2), sealer)?,
            );
        }
        let mut out = Vec::with_capacity(which.len());
        let mut rows = Rows::default();
        for &i in which {
            let (mut events, mut moves) = (Vec::new(), Moves::default());
            let was = current.remove(ops[i].id());
            let ch = &mut (&mut events, &mut moves);
            let decided = match &ops[i] {
                Op::Settle(req, _) => {
                    settled(req, was, now(&ops[i]), ch).map(|r| (r, req.body.clone()))
                }
                Op::Resolve(id, res, event, _) => resolved(id, res, *event, was, now(&ops[i]), ch),
                Op::Claim(..) | Op::Note(..) => continue,
            };
            match decided {
                Ok((new, body)) => {
                    rows.push(&new, body.as_ref(), sealer);
                    let done = match &ops[i] {
                        Op::Settle(..) => Done::Settle(Arc::new(new)),
                        _ => Done::Resolve(Box::new(new)),
                    };
                    out.push((i, (Ok(done), (events, moves))));
                }
                // Refused by its transition: it fails alone, and changes nothing.
                Err(e) => out.push((i, (Err(e), Changes::default()))),
            }
        }
        Ok((out, rows))
    }
}
