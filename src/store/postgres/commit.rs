//! A batch's last statement and its commit, sent together (SPEC §13).
//!
//! What a batch decided but has not yet written (its settlements' and resolutions' rows), its
//! count moves and its log entries go in one statement, chained after the log head this proxy
//! last committed; `COMMIT` is sent right behind it without waiting for its answer. The
//! statement moves the head only if it is still that one, and fails (aborting the transaction,
//! so that the `COMMIT` behind it rolls back) when another transaction moved it: the batch is
//! then made again with the head read under lock. A proxy that finds the head moved keeps
//! reading it under lock for a while (another proxy shares the database), which costs one round
//! trip more a batch but never a wasted transaction.
//!
//! So a batch whose head is its own costs one round trip and PostgreSQL's commit after its row
//! work, where it cost three.

use std::pin::pin;
use std::task::Poll;

use deadpool_postgres::GenericClient;
use tokio_postgres::error::SqlState;

use super::sets::{Rows, UNNEST};
use super::{db, prepared, Head, Moves};
use crate::action::now_millis;
use crate::log::{Chain, LogEvent};
use crate::store::StoreError;

/// Why a batch's commit did not happen.
pub(super) enum Ending {
    /// Another transaction moved the log's head since this proxy last committed: nothing of the
    /// batch was committed, and it can be made again.
    HeadMoved,
    Failed(StoreError),
}

impl From<StoreError> for Ending {
    fn from(e: StoreError) -> Self {
        Ending::Failed(e)
    }
}

/// The deferred rows, the counts and the log, in one statement. The head is moved only when
/// it is still `$22`/`$23`; the last line divides by zero when it was not (a run-time error,
/// since the divisor is a subquery's), which aborts the statement and the transaction.
fn statement() -> String {
    format!(
        "WITH w AS (
             INSERT INTO oncegate_actions (id, state, upstream, principal, task, owner, lease_until, created_at, expires_at, record, body, twin, generation)
             SELECT * FROM {UNNEST}
             ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state, task = EXCLUDED.task,
                 owner = EXCLUDED.owner, lease_until = EXCLUDED.lease_until,
                 created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at,
                 record = EXCLUDED.record, body = COALESCE(EXCLUDED.body, oncegate_actions.body),
                 twin = EXCLUDED.twin, generation = EXCLUDED.generation
         ), c AS (
             INSERT INTO oncegate_counts (instance, state, n)
             SELECT $14, s, d FROM UNNEST($15::text[], $16::bigint[]) AS u(s, d)
             ON CONFLICT (instance, state) DO UPDATE SET n = oncegate_counts.n + EXCLUDED.n
         ), h AS (
             UPDATE oncegate_log_head SET seq = $20, hash = $21
             WHERE id = 1 AND seq = $22 AND hash = $23 AND cardinality($17::bigint[]) > 0
             RETURNING 1
         ), e AS (
             INSERT INTO oncegate_log (seq, ts, entry)
             SELECT u.* FROM UNNEST($17::bigint[], $18::text[], $19::text[]) AS u
             WHERE EXISTS (SELECT 1 FROM h)
         )
         SELECT CASE WHEN cardinality($17::bigint[]) = 0 THEN 1
                     ELSE 1 / (SELECT count(*)::int FROM h) END"
    )
}

/// `events` sealed into the chain after `head`: their columns, and the head after them.
pub(super) fn seal(
    chain: &Chain,
    events: impl IntoIterator<Item = LogEvent>,
    (mut seq, mut hash): Head,
) -> (Vec<i64>, Vec<String>, Vec<String>, Head) {
    let (mut seqs, mut tss, mut lines) = (Vec::new(), Vec::new(), Vec::new());
    for ev in events {
        let (e, line) = chain.seal_line(ev, (seq as u64, &hash), now_millis());
        seqs.push(e.seq as i64);
        tss.push(e.ts);
        lines.push(String::from_utf8(line).expect("JSON is UTF-8"));
        seq = e.seq as i64;
        hash = e.hash;
    }
    (seqs, tss, lines, (seq, hash))
}

/// Writes `rows`, `moves` and `events` after `head` (read here, under lock, when `None`) and
/// commits. Returns the new head (`None`: the batch appended nothing).
pub(super) async fn write_and_commit(
    tx: &deadpool_postgres::Client,
    chain: &Chain,
    instance: &str,
    rows: &Rows,
    moves: &Moves,
    events: Vec<LogEvent>,
    head: Option<Head>,
) -> Result<Option<Head>, Ending> {
    let appends = !events.is_empty();
    let head = match head {
        Some(h) => h,
        None if appends => {
            let sql = "SELECT seq, hash FROM oncegate_log_head WHERE id = 1 FOR UPDATE";
            let row = tx
                .query_one(&prepared(tx, sql).await?, &[])
                .await
                .map_err(db)?;
            (row.get(0), row.get(1))
        }
        None => (0, String::new()),
    };
    let (seqs, tss, lines, new) = seal(chain, events, head.clone());
    let (states, deltas) = moves.columns();
    // Prepared before anything is sent: the statement must reach the server before `COMMIT`,
    // and a statement not yet in the cache would first cost a round trip of its own.
    let stmt = prepared(tx, &statement()).await?;
    let [p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13] = rows.params();
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 23] = [
        p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, &instance, &states, &deltas, &seqs,
        &tss, &lines, &new.0, &new.1, &head.0, &head.1,
    ];
    let mut written = pin!(tx.query_one(&stmt, &params));
    // Its first poll sends the statement (tokio-postgres queues a request to its connection
    // when first polled); only then is `COMMIT` queued behind it.
    let first = futures_util::poll!(written.as_mut());
    let (written, committed) = match first {
        // Answered at once: it failed before it was sent (the transaction is still open and
        // whole: the caller rolls it back), or, improbably, succeeded.
        Poll::Ready(Err(e)) => return Err(db(e).into()),
        Poll::Ready(w) => (w, tx.batch_execute("COMMIT").await),
        Poll::Pending => tokio::join!(written, tx.batch_execute("COMMIT")),
    };
    match written {
        Ok(_) => {}
        Err(e) if e.code() == Some(&SqlState::DIVISION_BY_ZERO) => return Err(Ending::HeadMoved),
        // The transaction was aborted; the `COMMIT` behind it rolled it back.
        Err(e) => return Err(db(e).into()),
    }
    committed.map_err(db)?;
    Ok(appends.then(|| new.clone()))
}
