//! The proxy's threads as an operator sees them (`ps -L -o comm,ni`): the embedded store's
//! housekeeping (the drainer, the checkpoint) runs at a lower CPU priority than the threads that
//! answer requests (tokio's workers, the store's writer and syncer), so that on a busy machine the
//! kernel runs the request path first (issue 59: expiry must not stand in the write path's way).
#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use support::{child_config, Behavior, ChildProxy, FakeUpstream, TestClient};

/// Each of `pid`'s threads: its name and its nice value (`/proc/PID/task/TID/stat`, field 19).
fn threads(pid: u32) -> Vec<(String, i32)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let (Ok(name), Ok(stat)) = (
            std::fs::read_to_string(task.join("comm")),
            std::fs::read_to_string(task.join("stat")),
        ) else {
            continue; // the thread ended meanwhile
        };
        out.push((name.trim().to_string(), nice_in(&stat)));
    }
    out
}

/// The nice value in a thread's `stat` text: after the name in parentheses (which may hold
/// spaces), the state is field 3 and the nice value field 19.
fn nice_in(stat: &str) -> i32 {
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    after.split(' ').nth(16).unwrap().parse().unwrap()
}

fn nice_of(threads: &[(String, i32)], name: &str) -> Vec<i32> {
    threads
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, nice)| *nice)
        .collect()
}

#[tokio::test]
async fn the_stores_housekeeping_threads_run_at_a_lower_priority_than_requests() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::json(201, r#"{"id":"ch"}"#));
    let tmp = tempfile::tempdir().unwrap();
    let mut proxy = ChildProxy::spawn(&child_config(tmp.path(), &up.url(), ""));
    // A write, so that every thread of the request path has run.
    let r = TestClient::default()
        .post(
            &proxy.url("/pay/v1/charges"),
            &[("idempotency-key", "k1")],
            "amount=5",
        )
        .await;
    assert_eq!(r.status, 201);
    let pid = proxy.child.id();
    // The main thread's id is the process's.
    let main = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/stat")).unwrap();
    let main = nice_in(&main);
    let lowered = (main + 10).min(19);
    // Each thread lowers its own priority as it starts: give them a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    let seen = loop {
        let seen = threads(pid);
        let done = ["oncegate-drain", "oncegate-checkp"]
            .iter()
            .all(|n| nice_of(&seen, n) == [lowered]);
        if done || Instant::now() > deadline {
            break seen;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for name in ["oncegate-drain", "oncegate-checkp"] {
        assert_eq!(nice_of(&seen, name), [lowered], "{name}: {seen:?}");
    }
    for name in ["oncegate-store", "oncegate-sync"] {
        assert_eq!(nice_of(&seen, name), [main], "{name}: {seen:?}");
    }
    let workers = nice_of(&seen, "tokio-rt-worker");
    assert!(
        !workers.is_empty() && workers.iter().all(|n| *n == main),
        "{seen:?}"
    );
    proxy.terminate_ref();
}
