//! The embedded store knows its history (SPEC §13): with the proxy stopped, a database deleted,
//! truncated or replaced, an id file removed or a write log cut ends the next start (exit 74,
//! naming the part) instead of opening an empty store that sends a succeeded charge again. A
//! store folder removed under a running proxy turns `/readyz` to 503 and refuses writes.
#![allow(clippy::unwrap_used)]

mod support;

use std::path::Path;
use std::time::Duration;

use support::{child_config, Behavior, ChildProxy, FakeUpstream, TestClient};

const KEY: &str = "idempotency-key";

/// Runs the proxy on `conf` with one charge made durable, stops it, and returns the store folder.
async fn a_store_with_a_charge(up: &FakeUpstream, dir: &Path) -> std::path::PathBuf {
    let conf = child_config(dir, &up.url(), "");
    up.set_default(Behavior::json(201, r#"{"id":"ch_1"}"#));
    let proxy = ChildProxy::spawn(&conf);
    let r = TestClient::default()
        .post(
            &proxy.url("/pay/v1/charges"),
            &[(KEY, "charge-1")],
            "amount=5",
        )
        .await;
    assert_eq!(r.status, 201);
    assert!(proxy.terminate().success());
    dir.join("store")
}

/// Starts the proxy and expects it to refuse: exit 74 and a message naming `part`.
fn refuses_to_start(dir: &Path, part: &str) {
    refuses_to_start_with(dir, part, &[])
}

/// [`refuses_to_start`], with `env` added to the proxy's environment.
fn refuses_to_start_with(dir: &Path, part: &str, env: &[(&str, &str)]) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_oncegate"))
        .args(["run", "--config"])
        .arg(dir.join("oncegate.toml"))
        .env_remove("ONCEGATE_ADMIN_TOKEN")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("the proxy started on a store that is not whole");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    println!("{part}: {err}");
    assert_eq!(out.status.code(), Some(74), "{err}");
    assert!(err.contains(part), "the message names {part}: {err}");
    assert!(
        err.contains("not whole") || err.contains("cannot open") || err.contains("restore"),
        "{err}"
    );
}

/// Retrying the charge after a restart: the answer stored before, never a second send.
async fn the_charge_replays(up: &FakeUpstream, dir: &Path) {
    let proxy = ChildProxy::spawn(&dir.join("oncegate.toml"));
    retry_replays(&proxy, up).await;
}

/// Retrying the charge through `proxy`: the answer stored before, never a second send.
async fn retry_replays(proxy: &ChildProxy, up: &FakeUpstream) {
    let r = TestClient::default()
        .post(
            &proxy.url("/pay/v1/charges"),
            &[(KEY, "charge-1")],
            "amount=5",
        )
        .await;
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn a_deleted_database_does_not_open_as_an_empty_store() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let store = a_store_with_a_charge(&up, tmp.path()).await;
    let db = store.join("db");
    let kept = std::fs::read(&db).unwrap();
    std::fs::remove_file(&db).unwrap();
    refuses_to_start(tmp.path(), "database (db)");
    assert_eq!(up.count(), 1);
    // Put back, the store opens and knows the charge.
    std::fs::write(&db, kept).unwrap();
    the_charge_replays(&up, tmp.path()).await;
}

#[tokio::test]
async fn a_truncated_or_overwritten_database_does_not_open() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let store = a_store_with_a_charge(&up, tmp.path()).await;
    let db = store.join("db");
    let kept = std::fs::read(&db).unwrap();
    std::fs::write(&db, b"").unwrap();
    refuses_to_start(tmp.path(), "store");
    std::fs::write(&db, vec![0u8; kept.len()]).unwrap();
    refuses_to_start(tmp.path(), "store");
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn another_stores_database_does_not_open_in_its_place() {
    let up = FakeUpstream::start().await;
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let store_a = a_store_with_a_charge(&up, a.path()).await;
    let other = FakeUpstream::start().await;
    let store_b = a_store_with_a_charge(&other, b.path()).await;
    // A's charge retried (each replay a write-log entry), so that A's sled log, and so its last
    // snapshot's name, goes well past B's (as it did by chance on CI, stop 52).
    let proxy = ChildProxy::spawn(&a.path().join("oncegate.toml"));
    for _ in 0..50 {
        retry_replays(&proxy, &up).await;
    }
    assert!(proxy.terminate().success());
    // B's database (and its snapshots) in A's folder: A's write log and id stay. A's own
    // snapshots go first: their names carry a log position, and sled reads the latest; one of
    // A's left beside B's database describes a log B's does not hold, and sled refuses that as
    // corrupt before the store can read whose database it is.
    support::place_sled_files(&store_b, &store_a, true);
    refuses_to_start(a.path(), "another store");
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn a_missing_id_file_or_a_cut_write_log_does_not_open() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let store = a_store_with_a_charge(&up, tmp.path()).await;
    let id = store.join("store.id");
    let kept = std::fs::read(&id).unwrap();
    std::fs::remove_file(&id).unwrap();
    refuses_to_start(tmp.path(), "store.id is missing");
    std::fs::write(&id, kept).unwrap();
    // The write log loses its last entries.
    let log = std::fs::read_dir(store.join("log"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "ndjson"))
        .max()
        .unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    let cut: Vec<&str> = text.lines().collect();
    let kept = cut[..cut.len() - 1].join("\n") + "\n";
    std::fs::write(&log, &kept).unwrap();
    refuses_to_start(tmp.path(), "write log ends at entry");
    // Deleted altogether.
    std::fs::remove_file(&log).unwrap();
    refuses_to_start(tmp.path(), "write log");
    assert_eq!(up.count(), 1);
}

/// A proxy on `conf` that has charged `n` times (keys `k0`, `k1`, ...).
async fn charged(conf: &Path, n: usize) -> ChildProxy {
    let proxy = ChildProxy::spawn(conf);
    charge_keys(&proxy, 0..n).await;
    proxy
}

/// Charges through `proxy` under the keys `k{i}` for each `i` of `keys`, each answered 201.
async fn charge_keys(proxy: &ChildProxy, keys: std::ops::Range<usize>) {
    let c = TestClient::default();
    for i in keys {
        let r = c
            .post(
                &proxy.url("/pay/v1/charges"),
                &[(KEY, &format!("k{i}"))],
                "amount=5",
            )
            .await;
        assert_eq!(r.status, 201);
    }
}

/// A config on a store whose write-ahead log files are small (a checkpoint every few dozen
/// writes), its upstream answering 201.
fn small_wal_config(dir: &Path, up: &FakeUpstream) -> std::path::PathBuf {
    up.set_default(Behavior::json(201, r#"{"id":"ch"}"#));
    let conf = child_config(dir, &up.url(), "");
    let text = std::fs::read_to_string(&conf).unwrap();
    let text = text.replacen("[store]\n", "[store]\nwal_size = \"64KiB\"\n", 1);
    std::fs::write(&conf, text).unwrap();
    conf
}

/// The write-ahead log files in `store`.
fn wal_files(store: &Path) -> usize {
    std::fs::read_dir(store.join("wal"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension().unwrap() == "wal")
        .count()
}

/// Waits (up to 10 s) until the checkpoints have let go of every write-ahead log file but the
/// current one.
async fn checkpoints_caught_up(store: &Path) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while wal_files(store) > 1 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A write log rewritten to the same length and chained again (each hash recomputed) ends at
/// the same entry number as the database recorded, but not at the same entry: the store keeps
/// the head's hash, and does not open (issue 58 item 7).
#[tokio::test]
async fn a_write_log_rewritten_to_the_same_length_does_not_open() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let store = a_store_with_a_charge(&up, tmp.path()).await;
    let log = std::fs::read_dir(store.join("log"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "ndjson"))
        .max()
        .unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    // The last entry says another status; its hash is recomputed, as a forger would.
    let last = lines.pop().unwrap();
    let mut e: oncegate::log::Entry = serde_json::from_str(&last).unwrap();
    e.ts = "2020-01-01T00:00:00.000Z".into();
    e.hash = oncegate::log::Chain::new(None).hash(&e);
    lines.push(serde_json::to_string(&e).unwrap());
    std::fs::write(&log, lines.join("\n") + "\n").unwrap();
    refuses_to_start(tmp.path(), "was rewritten");
    assert_eq!(up.count(), 1);
}

/// The review's sequence for a deleted write log (issue 58 item 10): writes until the
/// write-ahead log has been checkpointed, a SIGKILL, `log/` deleted, a start: refused (exit 74),
/// never a log that starts again after the hole.
#[tokio::test]
async fn a_write_log_deleted_after_a_checkpoint_and_a_sigkill_does_not_open() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let conf = small_wal_config(tmp.path(), &up);
    let store = tmp.path().join("store");
    let proxy = charged(&conf, 150).await;
    checkpoints_caught_up(&store).await;
    proxy.kill();
    std::fs::remove_dir_all(store.join("log")).unwrap();
    refuses_to_start(tmp.path(), "write log");
    assert_eq!(up.count(), 150);
}

/// The review's sequence for an older copy of the database (issue 58 item 8): a copy of sled's
/// files taken at a clean stop, many more charges (several checkpoints), a SIGKILL, the copy put
/// back, a start. The write-ahead log's frames since the last checkpoint would have moved the old
/// copy's head up to the log's, and every charge between the copy and that checkpoint would have
/// been sent again; the start is refused (exit 74), before any frame is replayed into it.
#[tokio::test]
async fn an_older_copy_of_the_database_put_back_after_a_sigkill_does_not_open() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let conf = small_wal_config(tmp.path(), &up);
    let store = tmp.path().join("store");
    let proxy = charged(&conf, 20).await;
    assert!(proxy.terminate().success());
    let old = tmp.path().join("old-db");
    support::place_sled_files(&store, &old, true);
    let proxy = ChildProxy::spawn(&conf);
    charge_keys(&proxy, 20..200).await;
    // The checkpoints let go of every write-ahead log file but the current one: the frames
    // between the copy and the last checkpoint are gone (a copy the remaining log still reaches
    // back to is whole, and opens).
    checkpoints_caught_up(&store).await;
    charge_keys(&proxy, 200..201).await;
    proxy.kill();
    support::place_sled_files(&old, &store, true);
    refuses_to_start(tmp.path(), "older than its write-ahead log");
    // Nothing was replayed into it: a second start is refused the same way.
    refuses_to_start(tmp.path(), "older than its write-ahead log");
    assert_eq!(up.count(), 201);
}

/// A folder that lost `store.id`, `wal/` and `log/` after a SIGKILL holds only a stale
/// database (issue 58 item 9): it does not open.
#[tokio::test]
async fn a_folder_left_with_only_its_database_after_a_sigkill_does_not_open() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(201, r#"{"id":"ch"}"#));
    let tmp = tempfile::tempdir().unwrap();
    let conf = child_config(tmp.path(), &up.url(), "");
    let store = tmp.path().join("store");
    let proxy = charged(&conf, 40).await;
    proxy.kill();
    std::fs::remove_file(store.join("store.id")).unwrap();
    std::fs::remove_dir_all(store.join("wal")).unwrap();
    std::fs::remove_dir_all(store.join("log")).unwrap();
    refuses_to_start(tmp.path(), "store");
    assert_eq!(up.count(), 40);
}

#[tokio::test]
async fn a_store_folder_removed_while_running_refuses_writes_and_is_not_ready() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let conf = child_config(tmp.path(), &up.url(), "");
    up.set_default(Behavior::json(201, r#"{"id":"ch_1"}"#));
    let proxy = ChildProxy::spawn(&conf);
    let c = TestClient::default();
    let ready = format!("http://{}/readyz", proxy.admin);
    assert_eq!(c.get(&ready).await.status, 200);
    assert_eq!(
        c.post(&proxy.url("/pay/v1/charges"), &[(KEY, "before")], "a")
            .await
            .status,
        201
    );
    std::fs::remove_dir_all(tmp.path().join("store")).unwrap();
    let r = c
        .post(&proxy.url("/pay/v1/charges"), &[(KEY, "after")], "a")
        .await;
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.problem(), "store-unavailable");
    assert_eq!(r.json()["duplicate_risk"], false);
    assert_eq!(up.count(), 1, "the write was not forwarded");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let s = c.get(&ready).await.status;
        if s == 503 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "/readyz still {s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Reads do not need the store.
    assert_eq!(c.get(&proxy.url("/pay/v1/charges")).await.status, 201);
}

/// A SIGKILL leaves the filter of held ids the last checkpoint saved (the writer's filter as it
/// started a new write-ahead log file), and the start after it loads that filter with the ids of
/// the frames it replays, instead of reading every pointer in the database. One saved before
/// write-log entries whose frames are gone (checkpointed since) is never loaded: the ids of their
/// claims may be missing from it, and a retry of one would be sent as new. Either way every retry
/// replays: the upstream sees each charge once.
#[tokio::test]
async fn after_a_sigkill_the_filter_a_checkpoint_saved_is_loaded_and_never_one_the_log_outran() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let conf = small_wal_config(tmp.path(), &up);
    let store = tmp.path().join("store");
    let filter = store.join("ids.filter");
    let c = TestClient::default();
    let charge = |proxy: &ChildProxy, key: String| {
        let (url, c) = (proxy.url("/pay/v1/charges"), c.clone());
        async move { c.post(&url, &[(KEY, &key)], "amount=5").await }
    };
    // Charges `keys`, then waits until the checkpoints have let go of every log file but the
    // current one (saving the filter as the last of them ended).
    let write = |proxy: &ChildProxy, keys: Vec<String>| {
        let proxy_url = proxy.url("/pay/v1/charges");
        let (c, store) = (c.clone(), store.clone());
        async move {
            for key in keys {
                let r = c.post(&proxy_url, &[(KEY, &key)], "amount=5").await;
                assert_eq!(r.status, 201, "{key}: {r:?}");
            }
            checkpoints_caught_up(&store).await;
            assert_eq!(wal_files(&store), 1, "the checkpoints caught up");
        }
    };
    let named = |p: &str, n: usize| (0..n).map(|i| format!("{p}{i}")).collect::<Vec<_>>();
    let replays = |proxy: &ChildProxy, keys: Vec<String>| {
        let fut = keys
            .into_iter()
            .map(|k| charge(proxy, k))
            .collect::<Vec<_>>();
        async move {
            for f in fut {
                let r = f.await;
                assert_eq!(r.header("oncegate-outcome"), Some("replayed"), "{r:?}");
            }
        }
    };
    let read_from_sled = "read the action ids from sled";

    let proxy = ChildProxy::spawn(&conf);
    write(&proxy, named("a", 150)).await;
    assert!(filter.exists(), "a checkpoint saved the filter");
    // More charges after the last checkpoint, in the log file it left: then SIGKILL.
    for key in named("b", 10) {
        assert_eq!(charge(&proxy, key).await.status, 201);
    }
    proxy.kill();
    let proxy = ChildProxy::spawn(&conf);
    let log = proxy.stderr.lock().unwrap().clone();
    assert!(
        log.contains("loaded the saved filter of held ids") && !log.contains(read_from_sled),
        "the checkpoint's filter is loaded with the frames replayed: {log}"
    );
    replays(&proxy, [named("a", 150), named("b", 10)].concat()).await;
    assert_eq!(up.count(), 160);

    // The filter as this start left it, then charges whose log files the checkpoints let go,
    // and SIGKILL: put back, that filter lacks them.
    let stale = tmp.path().join("stale.filter");
    std::fs::copy(&filter, &stale).unwrap();
    write(&proxy, named("c", 150)).await;
    proxy.kill();
    std::fs::copy(&stale, &filter).unwrap();
    let proxy = ChildProxy::spawn(&conf);
    replays(
        &proxy,
        [named("a", 150), named("b", 10), named("c", 150)].concat(),
    )
    .await;
    assert_eq!(up.count(), 310, "no charge sent twice");
    let log = proxy.stderr.lock().unwrap().clone();
    assert!(
        log.contains("saved ids filter is not used") && log.contains(read_from_sled),
        "a filter from before entries no frame replayed holds is not loaded: {log}"
    );
    // That start saved the filter it read: the next start after a SIGKILL loads it.
    proxy.kill();
    let proxy = ChildProxy::spawn(&conf);
    let log = proxy.stderr.lock().unwrap().clone();
    assert!(!log.contains(read_from_sled), "{log}");
    replays(&proxy, named("c", 150)).await;
    assert_eq!(up.count(), 310);
    assert!(proxy.terminate().success());
}

/// A charge through a proxy on `conf`, with `env`: answered 201.
async fn charge(conf: &Path, env: &[(&str, &str)], key: &str) {
    let proxy = ChildProxy::spawn_with(conf, env);
    let r = TestClient::default()
        .post(&proxy.url("/pay/v1/charges"), &[(KEY, key)], "amount=5")
        .await;
    assert_eq!(r.status, 201, "{r:?}");
    assert!(proxy.terminate().success());
}

/// The PostgreSQL store's past, as each proxy saw it (SPEC §13 history): a database restored from
/// a backup older than what a proxy saw (a charge acknowledged since would be sent again), or
/// dropped and made again, ends the proxy's start (exit 74) naming what it saw; an untouched one
/// opens, and so does a new database for a proxy told to forget the old one.
#[tokio::test]
#[ignore = "needs PostgreSQL: ONCEGATE_TEST_POSTGRES (.ci/run sets it); run with `cargo test -- --ignored`"]
async fn postgres_refuses_a_database_older_than_or_other_than_what_the_proxy_saw() {
    let base = support::postgres_url();
    let url = support::fresh_database(&base).await;
    let name = url.rsplit('/').next().unwrap().to_string();
    let (admin, conn) = tokio_postgres::connect(&base, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(201, r#"{"id":"ch_1"}"#));
    let dir = tempfile::tempdir().unwrap();
    let conf = child_config(dir.path(), &up.url(), "").to_owned();
    let text = std::fs::read_to_string(&conf).unwrap().replace(
        "[store]\n",
        "[store]\nbackend = \"postgres\"\nurl_env = \"ONCEGATE_HISTORY_DB\"\n",
    );
    std::fs::write(&conf, text).unwrap();
    let env = [("ONCEGATE_HISTORY_DB", url.as_str())];

    charge(&conf, &env, "charge-1").await;
    // A backup, as a copy of the database taken now.
    // (The stopped proxy's sessions may take a moment to end; a template must have none.)
    let backup = format!("CREATE DATABASE {name}_backup TEMPLATE {name}");
    let mut tries = 0;
    while let Err(e) = admin.batch_execute(&backup).await {
        tries += 1;
        assert!(tries < 50, "{backup}: {e}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    charge(&conf, &env, "charge-2").await;
    charge(&conf, &env, "charge-3").await;
    assert_eq!(up.count(), 3);

    // Restored from the backup: charges 2 and 3 are gone from it, and their retries would be
    // sent again.
    for sql in [
        format!("DROP DATABASE {name} WITH (FORCE)"),
        format!("ALTER DATABASE {name}_backup RENAME TO {name}"),
    ] {
        admin.batch_execute(&sql).await.unwrap();
    }
    refuses_to_start_with(dir.path(), "older than what this proxy saw", &env);

    // Dropped and made again: a new, empty store.
    admin
        .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await
        .unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    refuses_to_start_with(dir.path(), "not the store this proxy used", &env);

    // Moved to it on purpose: the proxy's record of the old one deleted, it opens as a new store.
    std::fs::remove_dir_all(dir.path().join("store")).unwrap();
    charge(&conf, &env, "charge-1").await;
    assert_eq!(up.count(), 4);
}
