//! The store at rest (SPEC §13): what it keeps on disk (response bodies, their headers) is its
//! owner's alone. Every file is `0600` and every folder `0700`, sled's own files included, and an
//! older store's looser modes are narrowed when it opens.
#![allow(clippy::unwrap_used)]

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use support::{config, Behavior, FakeUpstream, TestClient, TestProxy};

/// Every path under `dir` (itself included) with its permission bits.
fn modes(dir: &Path) -> Vec<(String, bool, u32)> {
    let mut out = vec![(
        dir.display().to_string(),
        true,
        std::fs::metadata(dir).unwrap().permissions().mode() & 0o777,
    )];
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let meta = e.metadata().unwrap();
        if meta.is_dir() {
            out.extend(modes(&e.path()));
        } else {
            out.push((
                e.path().display().to_string(),
                false,
                meta.permissions().mode() & 0o777,
            ));
        }
    }
    out
}

fn assert_private(dir: &Path) {
    let all = modes(dir);
    assert!(all.len() > 5, "{all:?}");
    for (path, is_dir, mode) in all {
        let want = if is_dir { 0o700 } else { 0o600 };
        assert_eq!(mode, want, "{path} is {mode:o}");
    }
}

#[tokio::test]
async fn every_file_of_the_store_is_its_owners_alone() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let proxy = TestProxy::start_in(&config(&up.url(), ""), &dir).await;
    let c = TestClient::default();
    // A small body (in sled) and a large one (a body file beside it), and a secret-looking header.
    up.push(Behavior::json(201, r#"{"id":"small"}"#).with_header("set-cookie", "session=s3cret"));
    up.push(Behavior::json(201, &"b".repeat(100_000)));
    c.post(&proxy.url("/pay/v1/a"), &[("idempotency-key", "a")], "x")
        .await;
    c.post(&proxy.url("/pay/v1/b"), &[("idempotency-key", "b")], "x")
        .await;
    proxy.stop().await;
    assert!(std::fs::read_dir(dir.join("bodies")).unwrap().count() > 0);
    assert_private(&dir);
}

#[tokio::test]
async fn an_older_stores_looser_modes_are_narrowed_when_it_opens() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let proxy = TestProxy::start_in(&config(&up.url(), ""), &dir).await;
    TestClient::default()
        .post(&proxy.url("/pay/v1/a"), &[("idempotency-key", "a")], "x")
        .await;
    proxy.stop().await;
    // As an older version (or a umask of 022) left them.
    for (path, is_dir, _) in modes(&dir) {
        let mode = if is_dir { 0o755 } else { 0o644 };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let proxy = TestProxy::start_in(&config(&up.url(), ""), &dir).await;
    proxy.stop().await;
    assert_private(&dir);
}
