//! PostgreSQL batches made as one statement (SPEC §13; `src/store/postgres/fast.rs`): a proxy
//! decides a fresh claim and a settlement of its own claim without reading, and the statement
//! writes them only where what it assumed still holds. Two stores on one database play two
//! proxies; times are the callers' (`caller_clock`).
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;

use oncegate::action::*;
use oncegate::store::{SettleRequest, Store, StoreError};
use support::{config, Behavior, ChildProxy, FakeUpstream, TestClient};

type S = Arc<dyn Store>;

const T0: Millis = 1_800_000_000_000;

/// A store on the database at `url`, as one proxy opens it, with its batches counted by the
/// way they were made.
async fn counted(url: &str) -> (S, oncegate::store::BatchCounts) {
    let batches = oncegate::store::BatchCounts::default();
    let options = oncegate::store::StoreOptions {
        caller_clock: true,
        batches: batches.clone(),
        ..Default::default()
    };
    let s = oncegate::store::postgres::PostgresStore::open(url, options)
        .await
        .unwrap();
    (Arc::new(s), batches)
}

async fn two_proxies() -> (S, S) {
    let url = support::fresh_database(&support::postgres_url()).await;
    (counted(&url).await.0, counted(&url).await.0)
}

/// A connection of the test's own to the database at `url`.
async fn connect(url: &str) -> tokio_postgres::Client {
    let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    db
}

/// Sets the `tool` of action `id`'s stored record by hand: a change no log entry records.
async fn change_by_hand(url: &str, id: &str) {
    let db = connect(url).await;
    let n = db
        .execute(
            "UPDATE oncegate_actions SET record = jsonb_set(record::jsonb, '{tool}', '\"by-hand\"')::text WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(n, 1);
}

/// A claim of `id`; under the twin guard when `twin` names the fingerprint it shares with its
/// twins.
fn claim(id: &str, owner: &str, now: Millis, twin: Option<&str>) -> ClaimRequest {
    let fingerprint = twin.map_or_else(|| format!("fp-{id}"), str::to_string);
    ClaimRequest {
        fresh: Record {
            upstream: "pay".into(),
            principal: "p1".into(),
            key: format!("key-{id}"),
            method: "POST".into(),
            path: "/v1/charges".into(),
            retention_ms: 3_600_000,
            ..Record::new(id, &fingerprint)
        },
        key_source: KeySource::Header,
        max_attempts: 2,
        owner: owner.into(),
        lease: 1_000,
        now,
        twin: twin.map(|fp| TwinGuard {
            key: oncegate::identity::twin_key("pay", "p1", fp),
            allow: None,
        }),
        window: None,
    }
}

fn succeeded(id: &str, attempt: u32, now: Millis) -> SettleRequest {
    SettleRequest {
        id: id.into(),
        attempt,
        settlement: Settlement {
            state: State::Succeeded,
            tries: vec![Try {
                at: now,
                status: Some(201),
                ..Default::default()
            }],
            response: Some(StoredResponse {
                status: 201,
                headers: vec![],
                size: 2,
                body: BodyRef::Inline,
                source: Source::Upstream,
            }),
            external_id: None,
            needs_decision: false,
            now,
        },
        body: Some(bytes::Bytes::from_static(b"{}")),
    }
}

/// Proxy A claims, is paused past its lease, and proxy B finds the action and records it
/// unknown. A's late answer is still the action's outcome, but decided on the row as B left it:
/// B's evidence (A's lease ran out) stays, which a settlement written from A's own copy of the
/// record would have lost.
#[tokio::test]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_settlement_is_decided_on_the_row_another_proxy_changed() {
    let (a, b) = two_proxies().await;
    let c = a.claim(claim("x1", "proxy-a", T0, None)).await.unwrap();
    assert!(matches!(c, Claim::Claimed(_)), "{c:?}");
    let c = b
        .claim(claim("x1", "proxy-b", T0 + 5_000, None))
        .await
        .unwrap();
    assert!(
        matches!(&c, Claim::Existing(r) if r.state == State::Unknown),
        "{c:?}"
    );
    let r = a.settle(succeeded("x1", 1, T0 + 5_001)).await.unwrap();
    assert_eq!(r.state, State::Succeeded);
    let tries = &r.evidence[0].tries;
    assert!(
        tries
            .iter()
            .any(|t| t.error.as_deref().is_some_and(|e| e.contains("proxy-a"))),
        "B's evidence is kept: {tries:?}"
    );
    // What is stored is what A was answered, and its body is there to replay.
    let stored = b.get("x1").await.unwrap().unwrap();
    assert_eq!(stored.evidence, r.evidence);
    assert_eq!(b.body(&stored).await.unwrap().unwrap().as_ref(), b"{}");
    assert!(a.verify_log().await.unwrap().ok);
}

/// A settlement for an attempt another proxy has since replaced changes nothing, whatever
/// proxy A still holds of the action.
#[tokio::test]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_settlement_of_a_replaced_attempt_changes_nothing() {
    let (a, b) = two_proxies().await;
    a.claim(claim("x2", "proxy-a", T0, None)).await.unwrap();
    // B records it unknown, an operator says it did not happen, and B claims it again.
    b.claim(claim("x2", "proxy-b", T0 + 5_000, None))
        .await
        .unwrap();
    let res = Resolve {
        applied: false,
        external_id: None,
        response: None,
        body: None,
        actor: "admin".into(),
        reason: "checked at the provider".into(),
        now: T0 + 6_000,
        absent_after: None,
    };
    b.resolve("x2".into(), res, oncegate::log::Event::Resolved)
        .await
        .unwrap();
    let c = b
        .claim(claim("x2", "proxy-b", T0 + 7_000, None))
        .await
        .unwrap();
    assert!(matches!(&c, Claim::Claimed(r) if r.attempts == 2), "{c:?}");
    let late = a.settle(succeeded("x2", 1, T0 + 7_001)).await;
    assert!(matches!(late, Err(StoreError::Settle(_))), "{late:?}");
    let r = b.get("x2").await.unwrap().unwrap();
    assert_eq!((r.state, r.attempts), (State::InFlight, 2));
    assert_eq!(r.owner.as_deref(), Some("proxy-b"));
}

/// A claim decided on nothing stored finds its id or its twin slot taken (a replay, a twin on
/// another proxy): it is decided again on what is there, and the next fresh claims go through.
#[tokio::test]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_claim_that_finds_its_id_or_twin_taken_is_decided_on_what_is_there() {
    let (a, b) = two_proxies().await;
    a.claim(claim("x3", "proxy-a", T0, Some("twin-3")))
        .await
        .unwrap();
    a.settle(succeeded("x3", 1, T0 + 1)).await.unwrap();
    // The same key again, on the other proxy: the stored action, not a new one.
    let c = b
        .claim(claim("x3", "proxy-b", T0 + 2, Some("twin-3")))
        .await
        .unwrap();
    assert!(
        matches!(&c, Claim::Existing(r) if r.state == State::Succeeded),
        "{c:?}"
    );
    // An unsettled twin on A stops B's claim of the same write under another key.
    a.claim(claim("x4", "proxy-a", T0 + 3, Some("twin-4")))
        .await
        .unwrap();
    let c = b
        .claim(claim("x5", "proxy-b", T0 + 4, Some("twin-4")))
        .await
        .unwrap();
    assert!(
        !matches!(c, Claim::Claimed(_)),
        "a twin in flight elsewhere stops it: {c:?}"
    );
    assert!(b.get("x5").await.unwrap().is_none());
    // Fresh claims go on, on both.
    for (s, id) in [(&a, "x6"), (&b, "x7")] {
        let c = s.claim(claim(id, "p", T0 + 5, Some(id))).await.unwrap();
        assert!(matches!(c, Claim::Claimed(_)), "{c:?}");
    }
    assert!(b.verify_log().await.unwrap().ok);
}

/// A row changed without a log entry (by hand, or by a writer that logs nothing) is not what
/// this proxy holds: the settlement is decided on the row as it is, whatever the log's head
/// says.
#[tokio::test]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_row_changed_behind_the_logs_back_is_read_before_it_is_settled() {
    let url = support::fresh_database(&support::postgres_url()).await;
    let (a, _) = counted(&url).await;
    // Two claims: the first commits the log's head this proxy then knows as its own.
    for id in ["y0", "y1"] {
        let c = a.claim(claim(id, "proxy-a", T0, None)).await.unwrap();
        assert!(matches!(c, Claim::Claimed(_)), "{c:?}");
    }
    change_by_hand(&url, "y1").await;
    let r = a.settle(succeeded("y1", 1, T0 + 1)).await.unwrap();
    assert_eq!(r.tool.as_deref(), Some("by-hand"), "decided on the row");
    let stored = a.get("y1").await.unwrap().unwrap();
    assert_eq!(
        (stored.state, stored.tool.as_deref()),
        (State::Succeeded, Some("by-hand"))
    );
}

/// Another proxy keeps moving the log's head: batches decided without reading read the head
/// under lock after their rows, and still write a row only where it holds what they were
/// decided on.
#[tokio::test]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn with_the_head_moved_by_another_proxy_rows_are_still_checked() {
    let url = support::fresh_database(&support::postgres_url()).await;
    let (a, made) = counted(&url).await;
    let (b, _) = counted(&url).await;
    for id in ["y0", "y1"] {
        a.claim(claim(id, "proxy-a", T0, None)).await.unwrap();
    }
    // B moves the head: A's next batch finds it moved and is made again under lock; A then
    // reads the head under lock for a while.
    b.claim(claim("z0", "proxy-b", T0, None)).await.unwrap();
    a.claim(claim("y2", "proxy-a", T0, None)).await.unwrap();
    assert_eq!(made.again.get(), 1);
    let head_locked = made.head_locked.get();
    let r = a.settle(succeeded("y2", 1, T0 + 1)).await.unwrap();
    assert_eq!(r.state, State::Succeeded);
    assert_eq!(
        made.head_locked.get(),
        head_locked + 1,
        "decided without reading"
    );
    // y1 changed behind the log's back: its settlement is decided on the row as it is.
    change_by_hand(&url, "y1").await;
    let under_lock = made.under_lock.get();
    let r = a.settle(succeeded("y1", 1, T0 + 2)).await.unwrap();
    assert_eq!(r.tool.as_deref(), Some("by-hand"), "decided on the row");
    assert_eq!(
        (made.again.get(), made.under_lock.get()),
        (2, under_lock + 1)
    );
    // The connection is whole after the batch rolled back: B and A go on, one chain.
    b.settle(succeeded("z0", 1, T0 + 3)).await.unwrap();
    a.settle(succeeded("y0", 1, T0 + 4)).await.unwrap();
    assert_eq!(a.get("y0").await.unwrap().unwrap().state, State::Succeeded);
    assert!(b.verify_log().await.unwrap().ok);
}

/// Waits until a session of the database at `url` waits for a lock.
async fn someone_waits_for_a_lock(url: &str) {
    let db = connect(url).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let row = db
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()",
                &[],
            )
            .await
            .unwrap();
        if row.get::<_, i64>(0) > 0 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "nobody waited");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Runs `batch` while a transaction of the test's own plays another proxy's batch in a circle
/// of lock waits with it: it holds action `row`'s row, and once the batch waits for that row it
/// asks for the twin key of fingerprint `twin`, which the batch took first. It waits long
/// before it looks for a circle, so that the batch is the one PostgreSQL ends.
async fn in_a_lock_cycle<F: std::future::Future>(
    url: &str,
    row: &str,
    twin: &str,
    batch: F,
) -> F::Output {
    let other = connect(url).await;
    other
        .batch_execute(&format!(
            "BEGIN; SET LOCAL deadlock_timeout = '60s';
             SELECT 1 FROM oncegate_actions WHERE id = '{row}' FOR UPDATE"
        ))
        .await
        .unwrap();
    let twin = oncegate::identity::twin_key("pay", "p1", twin);
    let other_batch = async {
        someone_waits_for_a_lock(url).await;
        other
            .execute(
                "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                &[&twin],
            )
            .await
            .unwrap();
        other.batch_execute("ROLLBACK").await.unwrap();
    };
    tokio::join!(batch, other_batch).0
}

/// Two proxies' batches can wait for each other in a circle: a batch made as one statement
/// takes its new actions' twin-key locks and rows before the rows it settles, where a batch
/// made under lock takes every twin key first, then rows by id. PostgreSQL breaks the circle by
/// ending one of them; nothing of it was committed, and it is made again under lock, not
/// answered 503. Here the batch made as one statement is ended.
#[tokio::test]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_batch_ended_to_break_a_lock_cycle_is_made_again() {
    let url = support::fresh_database(&support::postgres_url()).await;
    let (a, made) = counted(&url).await;
    for id in ["y0", "y1"] {
        a.claim(claim(id, "proxy-a", T0, None)).await.unwrap();
    }
    let again = made.again.get();
    // One batch: a new claim under the twin guard, and a settlement of y1.
    let (claimed, settled) = in_a_lock_cycle(&url, "y1", "twin-x", async {
        tokio::join!(
            a.claim(claim("x1", "proxy-a", T0 + 1, Some("twin-x"))),
            a.settle(succeeded("y1", 1, T0 + 2)),
        )
    })
    .await;
    let claimed = claimed.expect("the claim is committed, not answered 503");
    assert!(matches!(claimed, Claim::Claimed(_)), "{claimed:?}");
    let settled = settled.expect("the settlement is committed, not answered 503");
    assert_eq!(settled.state, State::Succeeded);
    assert_eq!(made.again.get(), again + 1, "made again once");
    assert_eq!(a.get("y1").await.unwrap().unwrap().state, State::Succeeded);
    assert!(a.verify_log().await.unwrap().ok);
}

/// The same circle, with the batch made under lock ended (two claims of one write under two
/// keys cannot be decided without reading): it is made again, under lock again.
#[tokio::test]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_batch_made_under_lock_and_ended_to_break_a_lock_cycle_is_made_again() {
    let url = support::fresh_database(&support::postgres_url()).await;
    let (a, made) = counted(&url).await;
    for id in ["y0", "y1"] {
        a.claim(claim(id, "proxy-a", T0, None)).await.unwrap();
    }
    let (again, under_lock) = (made.again.get(), made.under_lock.get());
    let (x1, x2, settled) = in_a_lock_cycle(&url, "y1", "twin-x", async {
        tokio::join!(
            a.claim(claim("x1", "proxy-a", T0 + 1, Some("twin-x"))),
            a.claim(claim("x2", "proxy-a", T0 + 1, Some("twin-x"))),
            a.settle(succeeded("y1", 1, T0 + 2)),
        )
    })
    .await;
    let (x1, x2) = (x1.expect("not 503"), x2.expect("not 503"));
    assert!(matches!(x1, Claim::Claimed(_)), "{x1:?}");
    assert!(
        !matches!(x2, Claim::Claimed(_)),
        "its twin is in flight: {x2:?}"
    );
    let settled = settled.expect("the settlement is committed, not answered 503");
    assert_eq!(settled.state, State::Succeeded);
    assert_eq!(
        (made.again.get(), made.under_lock.get()),
        (again + 1, under_lock + 1),
        "made again once, under lock"
    );
    assert!(a.verify_log().await.unwrap().ok);
}

/// `oncegate_store_batches_total{made}` of proxy `p`.
async fn batches(p: &ChildProxy, made: &str) -> u64 {
    let text = TestClient::default()
        .get(&format!("http://{}/metrics", p.admin))
        .await
        .body;
    let text = String::from_utf8_lossy(&text).to_string();
    let series = format!("oncegate_store_batches_total{{made=\"{made}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .unwrap_or_else(|| panic!("no {series} in {text}"))
        .parse()
        .unwrap()
}

/// Through a whole proxy: one write at a time, each batch is one statement; a replayed key's
/// claim finds its action stored, and is made again under lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn a_proxy_commits_its_writes_one_statement_a_batch() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(201, r#"{"id":"ch"}"#));
    let url = support::fresh_database(&support::postgres_url()).await;
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("oncegate.toml");
    let text = config(&up.url(), "").replace(
        "[defaults]",
        "[store]\nbackend = \"postgres\"\nurl_env = \"ONCEGATE_TEST_DB\"\n\n[defaults]",
    );
    std::fs::write(&cfg, text).unwrap();
    let p = tokio::task::spawn_blocking(move || {
        ChildProxy::spawn_with(&cfg, &[("ONCEGATE_TEST_DB", &url)])
    })
    .await
    .unwrap();
    let c = TestClient::default();
    let write = |key: String| {
        let url = p.url("/pay/v1/charges");
        let c = c.clone();
        async move {
            c.post(&url, &[("idempotency-key", &key)], &format!("amount={key}"))
                .await
        }
    };
    for i in 0..30 {
        let r = write(format!("k{i}")).await;
        assert_eq!(r.status, 201, "{r:?}");
    }
    assert_eq!(up.count(), 30);
    // A claim and a settlement a write: the first batch may read the log's head.
    assert!(batches(&p, "one_statement").await >= 59);
    assert!(batches(&p, "under_lock").await <= 1);
    assert_eq!(batches(&p, "again").await, 0);
    let r = write("k7".into()).await;
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"), "{r:?}");
    assert_eq!(batches(&p, "again").await, 1);
    let r = write("k30".into()).await;
    assert_eq!((r.status.as_u16(), up.count()), (201, 31));
    let v = p.admin("GET", "/v1/log/verify", "").await.json();
    assert_eq!(v["ok"], true, "{v}");
}

/// Proxies on one host may share a data folder, and so the file where each records the last
/// write-log head it saw of the database (SPEC §13 history). One starting while the others
/// commit and record newer heads there is never refused as "older than what this proxy saw":
/// whatever the file says was committed before the start read the database's head. Here one
/// store commits claims without pause while four others open, again and again, in the same
/// folder (each open records the head it read).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn proxies_sharing_a_data_folder_start_beside_each_others_commits() {
    let url = support::fresh_database(&support::postgres_url()).await;
    let shared = tempfile::tempdir().unwrap();
    let options = || oncegate::store::StoreOptions {
        caller_clock: true,
        seen_dir: Some(shared.path().to_path_buf()),
        ..Default::default()
    };
    let open = |url: String, options: oncegate::store::StoreOptions| async move {
        oncegate::store::postgres::PostgresStore::open(&url, options).await
    };
    let writer = open(url.clone(), options()).await.unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writing = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let id = format!("w{n}");
                writer
                    .claim(claim(&id, "writer", T0 + n, None))
                    .await
                    .unwrap();
                n += 1;
            }
            n
        }
    });
    let starts: Vec<_> = (0..4)
        .map(|_| {
            let (url, options) = (url.clone(), options());
            tokio::spawn(async move {
                let mut refused = Vec::new();
                for _ in 0..100 {
                    match open(url.clone(), options.clone()).await {
                        Ok(s) => s.close().await.unwrap(),
                        Err(e) => refused.push(e.to_string()),
                    }
                }
                refused
            })
        })
        .collect();
    let mut refused = Vec::new();
    for s in starts {
        refused.extend(s.await.unwrap());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let written = writing.await.unwrap();
    assert!(written > 100, "{written} claims committed meanwhile");
    assert!(
        refused.is_empty(),
        "{} of 400 starts refused: {:?}",
        refused.len(),
        refused.first()
    );
}
