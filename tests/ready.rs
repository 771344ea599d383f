//! `/readyz` says what a load balancer needs at once (issue 58 item 11): not ready as soon as the
//! store folder is gone (before any write fails on it), and not ready while a drain runs.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::{child_config, Behavior, ChildProxy, FakeUpstream, TestClient};

#[tokio::test]
async fn readyz_is_503_as_soon_as_the_store_folder_is_gone() {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let proxy = ChildProxy::spawn(&child_config(tmp.path(), &up.url(), ""));
    let c = TestClient::default();
    let ready = format!("http://{}/readyz", proxy.admin);
    assert_eq!(c.get(&ready).await.status, 200);
    std::fs::remove_dir_all(tmp.path().join("store")).unwrap();
    // No write has failed yet: the probe alone sees it.
    let r = c.get(&ready).await;
    assert_eq!(r.status, 503, "{r:?}");
}

#[tokio::test]
async fn readyz_is_503_while_a_drain_runs() {
    let up = FakeUpstream::start().await;
    let gate = Arc::new(tokio::sync::Notify::new());
    up.push(Behavior::Gate(
        gate.clone(),
        Box::new(Behavior::json(201, "{}")),
    ));
    let tmp = tempfile::tempdir().unwrap();
    let mut proxy = ChildProxy::spawn(&child_config(tmp.path(), &up.url(), "timeout = \"10s\""));
    let c = TestClient::default();
    let ready = format!("http://{}/readyz", proxy.admin);
    let url = proxy.url("/pay/v1/charges");
    let write = tokio::spawn(async move {
        TestClient::default()
            .post(&url, &[("idempotency-key", "draining")], "a")
            .await
    });
    up.wait_for(1).await;
    let pid = proxy.child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    // The write in flight holds the drain open; the probe says not ready meanwhile.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    loop {
        let s = c.get(&ready).await.status;
        if s == 503 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz still {s} while draining"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    gate.notify_one();
    assert_eq!(write.await.unwrap().status, 201);
    let status = tokio::task::spawn_blocking(move || proxy.terminate_ref())
        .await
        .unwrap();
    assert!(status.success(), "{status:?}");
}
