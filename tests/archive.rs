//! `oncegate log archive` (issue 59): the write log shipped off the proxy's volume in files that
//! chain as one, so that `log.retention` can prune the store's copy while an auditor still
//! verifies the whole history; a gap (entries pruned before they were archived) is reported.
#![allow(clippy::unwrap_used)]

mod support;

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;
use support::{config, Behavior, FakeUpstream, TestClient, TestProxy, ADMIN_TOKEN};

fn cli(args: &[&str]) -> (bool, Value) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oncegate"))
        .args(args)
        .env("ONCEGATE_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .unwrap();
    let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.success(), v)
}

async fn archive(proxy: &TestProxy, dir: &Path) -> (bool, Value) {
    let (admin, dir) = (proxy.admin_url(""), dir.to_str().unwrap().to_string());
    tokio::task::spawn_blocking(move || cli(&["log", "--admin", &admin, "archive", "--dir", &dir]))
        .await
        .unwrap()
}

fn verify(dir: &Path) -> (bool, Value) {
    cli(&["log", "verify", "--file", dir.to_str().unwrap()])
}

/// Writes `n` actions (3 entries each), then waits until the store's log files hold them: each
/// round is a log file of its own (the store's files are 2 KiB at most).
async fn writes(proxy: &TestProxy, from: usize, n: usize) {
    let c = TestClient::default();
    for i in from..from + n {
        let r = c
            .post(
                &proxy.url("/pay/v1/charges"),
                &[("idempotency-key", &format!("k{i}"))],
                "amount=1",
            )
            .await;
        assert_eq!(r.status, 201);
    }
    // A recovery reads the store whole, so it waits until the log files hold every entry.
    let now = oncegate::action::now_millis();
    proxy
        .store
        .recover(Some("nobody".into()), now)
        .await
        .unwrap();
}

#[tokio::test]
async fn an_archive_chains_across_its_files_while_the_store_prunes() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(201, r#"{"id":"ch_1"}"#));
    let tmp = tempfile::tempdir().unwrap();
    let options = oncegate::store::StoreOptions {
        log_retention: Some(std::time::Duration::from_secs(3600)),
        log_segment_bytes: Some(2048),
        ..Default::default()
    };
    let store =
        Arc::new(oncegate::store::sled::SledStore::open(&tmp.path().join("s"), options).unwrap());
    let proxy = TestProxy::start_with_store(&config(&up.url(), ""), store, tmp.path()).await;
    // `often` is archived after every round; `once` only at the start.
    let (often, once) = (tmp.path().join("often"), tmp.path().join("once"));
    writes(&proxy, 0, 4).await;
    for dir in [&often, &once] {
        let (whole, v) = archive(&proxy, dir).await;
        assert!(whole, "{v}");
        assert_eq!(
            (v["first"].as_u64(), v["last"].as_u64()),
            (Some(1), Some(12)),
            "{v}"
        );
    }
    writes(&proxy, 4, 4).await;
    let (whole, v) = archive(&proxy, &often).await;
    assert!(whole && v["first"] == 13 && v["last"] == 24, "{v}");
    writes(&proxy, 8, 4).await;
    let (whole, v) = archive(&proxy, &often).await;
    assert!(whole && v["first"] == 25 && v["last"] == 36, "{v}");
    // Nothing new: nothing archived, no empty file.
    let (whole, v) = archive(&proxy, &often).await;
    assert!(whole && v["archived"] == 0, "{v}");
    assert_eq!(std::fs::read_dir(&often).unwrap().count(), 3);

    // log.retention prunes the store's closed log files, archived or not.
    let later = oncegate::action::now_millis() + 2 * 3_600_000;
    proxy.store.expire(later).await.unwrap();
    let kept = proxy.store.log(0, 1000).await.unwrap();
    assert!(
        kept[0].seq > 13,
        "pruned: the store keeps from {}",
        kept[0].seq
    );
    writes(&proxy, 12, 2).await;

    let (whole, v) = archive(&proxy, &often).await;
    assert!(whole && v["first"] == 37 && v["last"] == 42, "{v}");
    let (ok, v) = verify(&often);
    assert!(ok && v["entries"] == 42 && v["head_seq"] == 42, "{v}");

    // The archive that fell behind the retention says what it lacks, and does not verify.
    let (whole, v) = archive(&proxy, &once).await;
    assert!(!whole, "{v}");
    assert!(
        v["notes"][0]
            .as_str()
            .unwrap()
            .contains("no longer in the store"),
        "{v}"
    );
    let (ok, v) = verify(&once);
    assert!(!ok, "{v}");
    assert_eq!(v["first_bad_seq"], 13, "{v}");
    proxy.stop().await;
}

/// The store's closed log files are gzipped (issue 59: the log was most of a write's bytes on
/// disk); the log still verifies, exports and archives whole, in order, and after a restart
/// a write is still replayed and the chain goes on.
#[tokio::test]
async fn closed_log_files_are_compressed_and_the_log_stays_whole() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(201, r#"{"id":"ch_1"}"#));
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("s");
    let options = || oncegate::store::StoreOptions {
        log_segment_bytes: Some(2048),
        ..Default::default()
    };
    let store = Arc::new(oncegate::store::sled::SledStore::open(&path, options()).unwrap());
    let proxy = TestProxy::start_with_store(&config(&up.url(), ""), store, tmp.path()).await;
    for round in 0..4 {
        writes(&proxy, round * 3, 3).await;
    }
    let listed = |ext: &str| -> Vec<u64> {
        let mut v: Vec<u64> = std::fs::read_dir(path.join("log"))
            .unwrap()
            .filter_map(|e| {
                let n = e.unwrap().file_name().to_string_lossy().into_owned();
                n.strip_suffix(ext)?.parse().ok()
            })
            .collect();
        v.sort();
        v
    };
    let plain_before = listed(".ndjson").len();
    let size = |p: &Path| -> u64 {
        std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum()
    };
    let bytes_before = size(&path.join("log"));
    let n = proxy.store.compact_log().await.unwrap();
    assert_eq!(n, plain_before - 1, "every closed file, not the newest");
    assert_eq!(listed(".ndjson.gz").len(), n);
    assert_eq!(listed(".ndjson").len(), 1);
    assert!(size(&path.join("log")) < bytes_before, "no smaller");
    let v = proxy.store.verify_log().await.unwrap();
    assert!(v.ok && v.entries == 36 && v.head_seq == 36, "{v:?}");
    let log = proxy.store.log(0, 1000).await.unwrap();
    assert_eq!(
        log.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (1..=36).collect::<Vec<_>>()
    );
    let dir = tmp.path().join("archive");
    let (whole, v) = archive(&proxy, &dir).await;
    assert!(whole && v["first"] == 1 && v["last"] == 36, "{v}");
    let (ok, v) = verify(&dir);
    assert!(ok && v["entries"] == 36, "{v}");
    proxy.stop().await;

    let store = Arc::new(oncegate::store::sled::SledStore::open(&path, options()).unwrap());
    let proxy = TestProxy::start_with_store(&config(&up.url(), ""), store, tmp.path()).await;
    let r = TestClient::default()
        .post(
            &proxy.url("/pay/v1/charges"),
            &[("idempotency-key", "k0")],
            "amount=1",
        )
        .await;
    assert_eq!(r.header("oncegate-outcome"), Some("replayed"));
    writes(&proxy, 100, 1).await;
    let v = proxy.store.verify_log().await.unwrap();
    assert!(v.ok && v.head_seq >= 40, "{v:?}");
    assert_eq!(up.count(), 13);
    proxy.stop().await;
}
