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

use super::sets::{Kind, Rows};
use super::{db, prepared, Head, Moves};
use crate::action::now_millis;
use crate::log::{Chain, LogEvent};
use crate::store::StoreError;
use tokio_postgres::types::Type;

/// Why a batch's commit did not happen.
pub(super) enum Ending {
    /// Another transaction moved the log's head since this proxy last committed: nothing of the
    /// batch was committed, and it can be made again.
    HeadMoved,
    /// A row decided on what this proxy last wrote no longer holds it, or a new action's id or
    /// twin slot is taken: nothing of the batch was written, and it can be made again under
    /// lock.
    Stale,
    /// PostgreSQL ended the transaction to break a cycle of lock waits with another proxy's
    /// batch (one made as one statement takes its locks in another order than one made under
    /// lock): nothing was committed, and it can be made again under lock.
    LockCycle,
    Failed(StoreError),
}

impl From<StoreError> for Ending {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(m) if m == super::LOCK_CYCLE => Ending::LockCycle,
            e => Ending::Failed(e),
        }
    }
}

/// Which parts a batch's last statement has: each part a batch has nothing for is left out of
/// it (an empty part still costs its table's opening and its indexes', about 10 µs each).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Debug)]
pub(super) struct Parts {
    locked: bool,
    fresh: bool,
    checked: bool,
    counts: bool,
    log: bool,
}

impl Parts {
    /// The statement's text, made once per process for each combination of parts (it is the
    /// key a connection finds its prepared statement by, looked up for every batch).
    fn text(self) -> &'static str {
        static TEXTS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
        let texts = TEXTS.get_or_init(|| {
            (0..32)
                .map(|bits| statement(Parts::from_bits(bits)))
                .collect()
        });
        &texts[usize::from(self.bits())]
    }

    fn bits(self) -> u8 {
        [self.locked, self.fresh, self.checked, self.counts, self.log]
            .iter()
            .enumerate()
            .map(|(i, &on)| u8::from(on) << i)
            .sum()
    }

    fn from_bits(bits: u8) -> Parts {
        Parts {
            locked: bits & 1 != 0,
            fresh: bits & 2 != 0,
            checked: bits & 4 != 0,
            counts: bits & 8 != 0,
            log: bits & 16 != 0,
        }
    }

    fn of(rows: &Rows, rest: &Rest<'_>) -> Parts {
        Parts {
            locked: rows.has(Kind::Locked),
            fresh: rows.has(Kind::Fresh),
            checked: rows.has(Kind::Checked),
            counts: !rest.states.is_empty(),
            log: !rest.seqs.is_empty(),
        }
    }
}

/// The deferred rows, the counts and the log, in one statement, of the `parts` a batch has.
/// The head is moved only when it is still `$22`/`$23`; the last line divides by zero when it
/// was not (a run-time error, since the divisor is a subquery's), which aborts the statement
/// and the transaction.
///
/// Rows come in three kinds ([`Kind`]): decided under their lock (`l`, upserted), new actions
/// (`f`, inserted only where their id and twin slot are free, the twin key's lock taken first
/// as a claim under lock takes it), and rows decided on the record this proxy last wrote (`c`,
/// updated only where the row still holds it, `$25`). When fewer than the `$26` conditional
/// rows were written, the statement takes the logarithm of zero (another run-time error): what
/// they were decided on no longer holds, and nothing is written.
///
/// Every statement takes all 26 parameters, typed when prepared ([`TYPES`]), whether or not it
/// names them.
fn statement(parts: Parts) -> String {
    let mut ctes: Vec<String> = Vec::new();
    if parts.locked || parts.fresh || parts.checked {
        ctes.push(
            "u AS MATERIALIZED (
             SELECT * FROM UNNEST($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $24, $25)
                 AS u(id, state, upstream, principal, task, owner, lease_until, created_at, expires_at, record, body, twin, generation, kind, old)
         )"
            .into(),
        );
    }
    if parts.locked {
        ctes.push(format!(
            "w AS (
             INSERT INTO oncegate_actions ({COLUMNS})
             SELECT {COLUMNS} FROM u WHERE kind = 'l'
             ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state, task = EXCLUDED.task,
                 owner = EXCLUDED.owner, lease_until = EXCLUDED.lease_until,
                 created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at,
                 record = EXCLUDED.record, body = COALESCE(EXCLUDED.body, oncegate_actions.body),
                 twin = EXCLUDED.twin, generation = EXCLUDED.generation
         )"
        ));
    }
    if parts.fresh {
        ctes.push(format!(
            "f AS (
             INSERT INTO oncegate_actions ({COLUMNS}, sending_at)
             SELECT {COLUMNS}, created_at FROM u
             WHERE kind = 'f' AND (twin IS NULL OR (SELECT true FROM pg_advisory_xact_lock(hashtextextended(twin, 0))))
             ON CONFLICT DO NOTHING
             RETURNING 1
         )"
        ));
    }
    if parts.checked {
        ctes.push(
            "k AS (
             UPDATE oncegate_actions a SET state = u.state, task = u.task, owner = u.owner,
                 lease_until = u.lease_until, created_at = u.created_at, expires_at = u.expires_at,
                 record = u.record, body = COALESCE(u.body, a.body), twin = u.twin,
                 generation = u.generation
             FROM u WHERE u.kind = 'c' AND a.id = u.id AND a.record = u.old
             RETURNING 1
         )"
            .into(),
        );
    }
    if parts.counts {
        ctes.push(
            "c AS (
             INSERT INTO oncegate_counts (instance, state, n)
             SELECT $14, s, d FROM UNNEST($15, $16) AS u(s, d)
             ON CONFLICT (instance, state) DO UPDATE SET n = oncegate_counts.n + EXCLUDED.n
         )"
            .into(),
        );
    }
    if parts.log {
        ctes.push(
            "h AS (
             UPDATE oncegate_log_head SET seq = $20, hash = $21
             WHERE id = 1 AND seq = $22 AND hash = $23
             RETURNING 1
         ), e AS (
             INSERT INTO oncegate_log (seq, ts, entry)
             SELECT u.* FROM UNNEST($17, $18, $19) AS u
             WHERE EXISTS (SELECT 1 FROM h)
         )"
            .into(),
        );
    }
    // What the conditional rows wrote, against how many there were.
    let written: Vec<&str> = [
        (parts.fresh, "(SELECT count(*) FROM f)"),
        (parts.checked, "(SELECT count(*) FROM k)"),
    ]
    .into_iter()
    .filter_map(|(has, count)| has.then_some(count))
    .collect();
    let then = if parts.log {
        "1 / (SELECT count(*)::int FROM h)"
    } else {
        "1"
    };
    let select = match written.first() {
        Some(first) => format!(
            "SELECT CASE WHEN {} <> $26 THEN ln({first}::float8 * 0)::int ELSE {then} END",
            written.join(" + ")
        ),
        None => format!("SELECT {then}"),
    };
    if ctes.is_empty() {
        return select;
    }
    format!("WITH {} {select}", ctes.join(", "))
}

/// The types of the last statement's 26 parameters.
const TYPES: [Type; 26] = [
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::TEXT_ARRAY,
    Type::BYTEA_ARRAY,
    Type::TEXT_ARRAY,
    Type::INT8_ARRAY,
    Type::TEXT,
    Type::TEXT_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::INT8,
    Type::TEXT,
    Type::INT8,
    Type::TEXT,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::INT8,
];

/// The columns a row statement writes.
const COLUMNS: &str = "id, state, upstream, principal, task, owner, lease_until, created_at, expires_at, record, body, twin, generation";

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

/// How the batch's last statement is sent.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Sending {
    /// In the batch's open transaction, with its `COMMIT` right behind it.
    WithCommit,
    /// As the whole transaction: the batch made no other statement.
    Alone,
}

/// The statement's parameters besides the rows' columns.
struct Rest<'a> {
    instance: &'a str,
    states: Vec<&'static str>,
    deltas: Vec<i64>,
    seqs: Vec<i64>,
    tss: Vec<String>,
    lines: Vec<String>,
    new: Head,
    head: Head,
    conditional: i64,
}

impl<'a> Rest<'a> {
    /// `events` sealed after `head`, with `moves` and `rows`' count of conditional rows.
    fn new(
        chain: &Chain,
        instance: &'a str,
        rows: &Rows,
        moves: &Moves,
        events: Vec<LogEvent>,
        head: Head,
    ) -> Rest<'a> {
        let (seqs, tss, lines, new) = seal(chain, events, head.clone());
        let (states, deltas) = moves.columns();
        Rest {
            instance,
            states,
            deltas,
            seqs,
            tss,
            lines,
            new,
            head,
            conditional: rows.conditional(),
        }
    }

    fn params<'b>(&'b self, rows: &'b Rows) -> [&'b (dyn tokio_postgres::types::ToSql + Sync); 26] {
        let [p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p24, p25] = rows.all_params();
        [
            p1,
            p2,
            p3,
            p4,
            p5,
            p6,
            p7,
            p8,
            p9,
            p10,
            p11,
            p12,
            p13,
            &self.instance,
            &self.states,
            &self.deltas,
            &self.seqs,
            &self.tss,
            &self.lines,
            &self.new.0,
            &self.new.1,
            &self.head.0,
            &self.head.1,
            p24,
            p25,
            &self.conditional,
        ]
    }
}

/// The statement's failure as why the batch ended.
fn ending(e: tokio_postgres::Error) -> Ending {
    match e.code() {
        Some(&SqlState::DIVISION_BY_ZERO) => Ending::HeadMoved,
        Some(&SqlState::INVALID_ARGUMENT_FOR_LOG) => Ending::Stale,
        _ => db(e).into(),
    }
}

/// The last statement of `parts`, prepared once per connection.
async fn last_statement(
    tx: &deadpool_postgres::Client,
    parts: Parts,
) -> Result<tokio_postgres::Statement, StoreError> {
    tx.prepare_typed_cached(parts.text(), &TYPES)
        .await
        .map_err(db)
}

const HEAD_FOR_UPDATE: &str = "SELECT seq, hash FROM oncegate_log_head WHERE id = 1 FOR UPDATE";

/// What a batch writes last: its rows (those not written yet), its count moves and its log
/// entries.
pub(super) struct Last<'a> {
    pub(super) chain: &'a Chain,
    pub(super) instance: &'a str,
    pub(super) rows: &'a Rows,
    pub(super) moves: &'a Moves,
    pub(super) events: Vec<LogEvent>,
}

impl Last<'_> {
    /// Writes it all after `head` (read here, under lock, when `None`) and commits. Returns
    /// the new head (`None`: the batch appended nothing).
    pub(super) async fn commit(
        self,
        tx: &deadpool_postgres::Client,
        head: Option<Head>,
        sending: Sending,
    ) -> Result<Option<Head>, Ending> {
        let Last {
            chain,
            instance,
            rows,
            moves,
            events,
        } = self;
        let appends = !events.is_empty();
        let head = match head {
            Some(h) => h,
            None if appends => {
                let row = tx
                    .query_one(&prepared(tx, HEAD_FOR_UPDATE).await?, &[])
                    .await
                    .map_err(db)?;
                (row.get(0), row.get(1))
            }
            None => (0, String::new()),
        };
        let rest = Rest::new(chain, instance, rows, moves, events, head);
        // Prepared before anything is sent: the statement must reach the server before
        // `COMMIT`, and a statement not yet in the cache would first cost a round trip of its
        // own.
        let stmt = last_statement(tx, Parts::of(rows, &rest)).await?;
        let params = rest.params(rows);
        let mut written = pin!(tx.query_one(&stmt, &params));
        let (written, committed) = if sending == Sending::Alone {
            (written.await, Ok(()))
        } else {
            // Its first poll sends the statement (tokio-postgres queues a request to its
            // connection when first polled); only then is `COMMIT` queued behind it.
            match futures_util::poll!(written.as_mut()) {
                // Answered at once: it failed before it was sent (the transaction is still
                // open and whole: the caller rolls it back), or, improbably, succeeded.
                Poll::Ready(Err(e)) => return Err(db(e).into()),
                Poll::Ready(w) => (w, tx.batch_execute("COMMIT").await),
                Poll::Pending => tokio::join!(written, tx.batch_execute("COMMIT")),
            }
        };
        // On failure the transaction was aborted; the `COMMIT` behind it rolled it back.
        written.map_err(ending)?;
        committed.map_err(db)?;
        Ok(appends.then(|| rest.new.clone()))
    }

    /// [`Last::commit`] for a batch decided without reading, when another proxy moves the
    /// log's head: `BEGIN`, the rows (written only where what they were decided on holds, as
    /// the one statement would) and the head's read under lock go out together, so that the
    /// head is held only from after the rows' work to the commit; then the counts and the log,
    /// with the `COMMIT`. Two round trips. On [`Ending::Stale`] the transaction is still open
    /// (aborted): the caller rolls it back.
    pub(super) async fn rows_then_log(
        self,
        tx: &deadpool_postgres::Client,
    ) -> Result<Option<Head>, Ending> {
        let head_stmt = prepared(tx, HEAD_FOR_UPDATE).await?;
        // The rows alone: no log entries, so the head is neither checked nor moved.
        let (none, unmoved) = (Rows::default(), Moves::default());
        let rest = Rest::new(
            self.chain,
            self.instance,
            self.rows,
            &unmoved,
            Vec::new(),
            (0, String::new()),
        );
        let stmt = last_statement(tx, Parts::of(self.rows, &rest)).await?;
        let params = rest.params(self.rows);
        let (began, written, head) = tokio::join!(
            tx.batch_execute("BEGIN"),
            tx.query_one(&stmt, &params),
            tx.query_one(&head_stmt, &[]),
        );
        began.map_err(db)?;
        written.map_err(ending)?;
        let head = head.map_err(db)?;
        let log = Last {
            rows: &none,
            ..self
        };
        log.commit(tx, Some((head.get(0), head.get(1))), Sending::WithCommit)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every combination of parts makes a statement PostgreSQL prepares, with all 26
    /// parameters, on the schema a store migrates to.
    #[tokio::test]
    #[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
    async fn every_last_statement_prepares() {
        let base = std::env::var("ONCEGATE_TEST_POSTGRES")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let (admin, conn) = tokio_postgres::connect(&base, tokio_postgres::NoTls)
            .await
            .expect("the test server");
        tokio::spawn(conn);
        let name = format!("oncegate_t_parts_{:x}", rand::random::<u64>());
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("a fresh database");
        let url = match base.rsplit_once('/') {
            Some((server, _)) => format!("{server}/{name}"),
            None => panic!("no database in {base}"),
        };
        let store = crate::store::postgres::PostgresStore::open(&url, Default::default())
            .await
            .expect("migrated");
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connected");
        tokio::spawn(conn);
        for bits in 0..32u8 {
            let parts = Parts::from_bits(bits);
            assert_eq!(parts.bits(), bits);
            if let Err(e) = c.prepare_typed(parts.text(), &TYPES).await {
                panic!("{parts:?}: {e:?}\n{}", parts.text());
            }
        }
        drop(c);
        crate::store::Store::close(&store).await.expect("closed");
        drop(store);
        let _ = admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await;
    }
}
