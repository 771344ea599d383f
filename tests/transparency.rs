//! Transparency (SPEC §2): one test per HTTP invariant of the proxy as a reverse proxy.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use support::{config, raw, Behavior, FakeUpstream, TestClient, TestProxy};
use tokio::sync::Notify;

async fn setup(extra: &str) -> (FakeUpstream, TestProxy) {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), extra)).await;
    (up, proxy)
}

#[tokio::test]
async fn hop_by_hop_request_headers_are_not_forwarded() {
    let (up, proxy) = setup("").await;
    let req = "GET /pay/v1/x HTTP/1.1\r\nHost: client.example\r\nKeep-Alive: timeout=5\r\n\
               Proxy-Connection: keep-alive\r\nTE: trailers\r\nTrailer: X-Sum\r\nUpgrade: websocket\r\n\
               X-Keep: yes\r\nConnection: close\r\n\r\n";
    let (resp, _) = raw(proxy.addr, req.as_bytes(), Duration::from_secs(5)).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let got = &up.received()[0];
    for h in [
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "connection",
    ] {
        assert!(
            got.header(h).is_none(),
            "{h} was forwarded: {:?}",
            got.headers
        );
    }
    assert_eq!(got.header("x-keep"), Some("yes"));
}

#[tokio::test]
async fn headers_named_in_connection_are_removed_both_ways() {
    let (up, proxy) = setup("").await;
    up.set_default(
        Behavior::json(200, "{}")
            .with_header("connection", "x-upstream-secret")
            .with_header("x-upstream-secret", "1")
            .with_header("x-upstream-public", "2"),
    );
    let req = "GET /pay/v1/x HTTP/1.1\r\nHost: a\r\nConnection: x-private, close\r\nX-Private: 1\r\nX-Public: 2\r\n\r\n";
    let (resp, _) = raw(proxy.addr, req.as_bytes(), Duration::from_secs(5)).await;
    let got = &up.received()[0];
    assert!(got.header("x-private").is_none());
    assert_eq!(got.header("x-public"), Some("2"));
    let lower = resp.to_ascii_lowercase();
    assert!(!lower.contains("x-upstream-secret"), "{resp}");
    assert!(lower.contains("x-upstream-public: 2"), "{resp}");
}

#[tokio::test]
async fn hop_by_hop_response_headers_are_not_returned() {
    let (up, proxy) = setup("").await;
    up.set_default(
        Behavior::json(200, "{}")
            .with_header("keep-alive", "timeout=99")
            .with_header("proxy-connection", "keep-alive")
            .with_header("x-kept", "1"),
    );
    let r = TestClient::default().get(&proxy.url("/pay/x")).await;
    assert!(r.header("keep-alive").is_none());
    assert!(r.header("proxy-connection").is_none());
    assert_eq!(r.header("x-kept"), Some("1"));
}

#[tokio::test]
async fn host_is_the_upstreams() {
    let (up, proxy) = setup("").await;
    let req = "GET /pay/v1/x HTTP/1.1\r\nHost: agent.example\r\nConnection: close\r\n\r\n";
    raw(proxy.addr, req.as_bytes(), Duration::from_secs(5)).await;
    assert_eq!(
        up.received()[0].header("host"),
        Some(up.addr.to_string().as_str())
    );
}

#[tokio::test]
async fn via_is_added_and_no_forwarded_headers() {
    let (up, proxy) = setup("").await;
    TestClient::default()
        .send("GET", &proxy.url("/pay/x"), &[("via", "1.1 agent-gw")], "")
        .await;
    let got = &up.received()[0];
    let via: Vec<&str> = got
        .headers
        .get_all("via")
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    assert_eq!(via, ["1.1 agent-gw", "1.1 oncegate"]);
    assert!(got
        .headers
        .keys()
        .all(|k| !k.as_str().starts_with("x-forwarded")));
    assert!(got.header("forwarded").is_none());
}

#[tokio::test]
async fn oncegate_request_headers_are_not_forwarded() {
    let (up, proxy) = setup("").await;
    TestClient::default()
        .send(
            "GET",
            &proxy.url("/pay/x"),
            &[
                ("oncegate-task", "t1"),
                ("oncegate-step", "s1"),
                ("x-other", "1"),
            ],
            "",
        )
        .await;
    let got = &up.received()[0];
    assert!(got
        .headers
        .keys()
        .all(|k| !k.as_str().starts_with("oncegate-")));
    assert_eq!(got.header("x-other"), Some("1"));
}

#[tokio::test]
async fn oncegate_response_headers_from_an_upstream_are_not_returned() {
    // The `Oncegate-*` headers are the proxy's word to its client: an upstream's would claim
    // a read was a replay, and was counted so in /metrics.
    let (up, proxy) = setup("").await;
    let spoofing = |status| {
        Behavior::json(status, "{}")
            .with_header("oncegate-outcome", "replayed")
            .with_header("oncegate-replay-source", "lookup")
            .with_header("x-kept", "1")
    };
    up.set_default(spoofing(200));
    let c = TestClient::default();
    let r = c.get(&proxy.url("/pay/x")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("oncegate-outcome"), None);
    assert_eq!(r.header("oncegate-replay-source"), None);
    assert_eq!(r.header("x-kept"), Some("1"));
    let metrics =
        String::from_utf8_lossy(&c.get(&proxy.admin_url("/metrics")).await.body).to_string();
    assert!(
        metrics.contains(r#"class="read",outcome="forwarded"} 1"#),
        "{metrics}"
    );
    assert!(
        !metrics.contains(r#"class="read",outcome="replayed"} 1"#),
        "{metrics}"
    );
    // A write: its answer and its replay say what the proxy did, nothing the upstream said.
    let key = [("idempotency-key", "spoofed-1")];
    let first = c
        .send("POST", &proxy.url("/pay/v1/charges"), &key, "{}")
        .await;
    assert_eq!(first.header("oncegate-outcome"), Some("sent"));
    assert_eq!(first.header("oncegate-replay-source"), None);
    let again = c
        .send("POST", &proxy.url("/pay/v1/charges"), &key, "{}")
        .await;
    assert_eq!(again.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(again.header("oncegate-replay-source"), None);
    assert_eq!(again.header("x-kept"), Some("1"));
    assert_eq!(up.count(), 2, "the read and the write, once");
}

#[tokio::test]
async fn path_and_query_are_preserved_byte_for_byte() {
    // (An encoded slash passes only where the upstream allows it: tests/paths.rs.)
    let (up, proxy) = setup("allow_encoded_slash = true").await;
    let target = "/pay/v1/search%2Fx/a;b?q=a%20b+c&q=2&empty=&flag&%E2%9C%93=%2F";
    let req = format!("GET {target} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
    raw(proxy.addr, req.as_bytes(), Duration::from_secs(5)).await;
    assert_eq!(
        up.received()[0].target,
        "/v1/search%2Fx/a;b?q=a%20b+c&q=2&empty=&flag&%E2%9C%93=%2F"
    );
}

#[tokio::test]
async fn upstream_base_path_is_prepended() {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&format!("{}/base/", up.url()), "")).await;
    TestClient::default().get(&proxy.url("/pay/v1/x?y=1")).await;
    TestClient::default().get(&proxy.url("/pay")).await;
    let got = up.received();
    assert_eq!(got[0].target, "/base/v1/x?y=1");
    assert_eq!(got[1].target, "/base");
}

#[tokio::test]
async fn server_sent_events_reach_the_client_chunk_by_chunk() {
    let (up, proxy) = setup("").await;
    let gate = Arc::new(Notify::new());
    up.set_default(Behavior::Stream {
        first: Bytes::from_static(b"data: one\n\n"),
        gate: gate.clone(),
        rest: Bytes::from_static(b"data: two\n\n"),
    });
    let resp = TestClient::default()
        .stream(&proxy.url("/pay/v1/events"))
        .await;
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.into_body();
    // The first event arrives while the upstream is still holding the second back.
    let first = tokio::time::timeout(Duration::from_secs(5), body.frame())
        .await
        .expect("first event streamed before the upstream finished")
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), "data: one\n\n");
    gate.notify_one();
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(rest, "data: two\n\n");
}

#[tokio::test]
async fn a_large_download_streams_through_intact() {
    let (up, proxy) = setup("").await;
    let size: u64 = 64 << 20;
    up.set_default(Behavior::Large(size));
    let resp = TestClient::default().stream(&proxy.url("/pay/big")).await;
    let mut body = resp.into_body();
    let mut total = 0u64;
    let mut frames = 0;
    while let Some(f) = body.frame().await {
        let data = f.unwrap().into_data().unwrap();
        assert!(data.iter().all(|b| *b == b'x'));
        total += data.len() as u64;
        frames += 1;
    }
    assert_eq!(total, size);
    assert!(
        frames > 100,
        "the body arrived in {frames} frames: it was buffered"
    );
}

#[tokio::test]
async fn content_length_with_transfer_encoding_is_refused_and_closed() {
    let (up, proxy) = setup("").await;
    let req = "POST /pay/v1/x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
    let (resp, closed) = raw(proxy.addr, req.as_bytes(), Duration::from_secs(5)).await;
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert!(
        closed,
        "the connection stays open after an ambiguous framing"
    );
    assert_eq!(up.count(), 0);
}

#[tokio::test]
async fn duplicate_content_length_is_refused_and_closed() {
    let (up, proxy) = setup("").await;
    for cls in [
        "Content-Length: 5\r\nContent-Length: 5",
        "Content-Length: 5\r\nContent-Length: 6",
    ] {
        let req = format!("POST /pay/v1/x HTTP/1.1\r\nHost: a\r\n{cls}\r\n\r\nhello");
        let (resp, closed) = raw(proxy.addr, req.as_bytes(), Duration::from_secs(5)).await;
        assert!(resp.starts_with("HTTP/1.1 400"), "{cls}: {resp}");
        assert!(closed);
    }
    assert_eq!(up.count(), 0);
}

#[tokio::test]
async fn a_client_that_trickles_headers_is_cut_off() {
    let up = FakeUpstream::start().await;
    let cfg =
        config(&up.url(), "").replace("header_timeout = \"2s\"", "header_timeout = \"300ms\"");
    let proxy = TestProxy::start(&cfg).await;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(b"GET /pay/x HTTP/1.1\r\nHost: a\r\n")
        .await
        .unwrap();
    let (mut rd, mut wr) = s.into_split();
    // One header byte every 100 ms, forever: never a complete head.
    let trickle = tokio::spawn(async move {
        loop {
            if wr.write_all(b"X").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), rd.read_to_end(&mut buf)).await;
    trickle.abort();
    assert!(read.is_ok(), "the connection was not closed");
    assert_eq!(up.count(), 0);
}

#[tokio::test]
async fn too_many_headers_get_431() {
    let (up, proxy) = setup("").await;
    let mut req = String::from("GET /pay/x HTTP/1.1\r\nHost: a\r\n");
    for i in 0..200 {
        req.push_str(&format!("X-H{i}: v\r\n"));
    }
    req.push_str("\r\n");
    let (resp, _) = raw(proxy.addr, req.as_bytes(), Duration::from_secs(5)).await;
    assert!(resp.starts_with("HTTP/1.1 431"), "{resp}");
    assert_eq!(up.count(), 0);
}

#[tokio::test]
async fn a_request_head_over_64_kib_gets_431_and_one_under_is_served() {
    let (up, proxy) = setup("").await;
    let long = "a".repeat(66 * 1024);
    let req = format!("POST /pay/v1/charges?q={long} HTTP/1.1\r\nHost: a\r\nIdempotency-Key: k1\r\nContent-Length: 2\r\n\r\n{{}}");
    let (resp, _) = raw(proxy.addr, req.as_bytes(), Duration::from_secs(5)).await;
    assert!(
        resp.starts_with("HTTP/1.1 431"),
        "{}",
        &resp[..resp.len().min(200)]
    );
    assert_eq!(up.count(), 0, "nothing was sent or recorded");

    let fits = "a".repeat(60 * 1024);
    let req =
        format!("GET /pay/x HTTP/1.1\r\nHost: a\r\nX-Big: {fits}\r\nConnection: close\r\n\r\n");
    let (resp, _) = raw(proxy.addr, req.as_bytes(), Duration::from_secs(5)).await;
    assert!(
        resp.starts_with("HTTP/1.1 200"),
        "{}",
        &resp[..resp.len().min(200)]
    );
    assert_eq!(up.count(), 1);
}

#[tokio::test]
async fn http2_clients_are_served() {
    let (up, proxy) = setup("").await;
    let r = TestClient::http2().get(&proxy.url("/pay/v1/x?a=1")).await;
    assert_eq!(r.status, 200);
    assert_eq!(up.received()[0].target, "/v1/x?a=1");
}

#[tokio::test]
async fn unknown_prefix_is_a_no_route_problem_and_nothing_is_forwarded() {
    let (up, proxy) = setup("").await;
    let c = TestClient::default();
    for path in ["/other/x", "/payments/x", "/_oncegate/anything", "/"] {
        let r = c.get(&proxy.url(path)).await;
        assert_eq!(r.status, 404, "{path}");
        assert_eq!(r.problem(), "no-route");
        let p = r.json();
        assert_eq!(p["status"], 404);
        assert_eq!(p["outcome"], "rejected");
        assert!(p["next_step"].as_str().is_some());
    }
    assert_eq!(up.count(), 0);
}

#[tokio::test]
async fn denied_routes_get_403_and_send_nothing() {
    let (up, proxy) = setup(
        r#"
[[upstreams.routes]]
methods = ["DELETE"]
path = "/v1/customers/*"
class = "deny"
"#,
    )
    .await;
    let r = TestClient::default()
        .send("DELETE", &proxy.url("/pay/v1/customers/cus_1"), &[], "")
        .await;
    assert_eq!(r.status, 403);
    assert_eq!(r.problem(), "route-denied");
    assert_eq!(r.header("oncegate-outcome"), Some("rejected"));
    assert_eq!(up.count(), 0);
}

#[tokio::test]
async fn reads_on_one_connection_time_out_each_at_its_own_limit() {
    // One client connection (the pool reuses it), so its requests share the connection's timer.
    let (up, proxy) = setup(
        r#"
[[upstreams.routes]]
path = "/v1/stall-short"
timeout = "300ms"
"#,
    )
    .await;
    let stall = || Behavior::Delay(Duration::from_secs(5), Box::new(Behavior::status(200)));
    up.on("/v1/stall", stall());
    let c = TestClient::default();
    let timed = |path: &'static str| {
        let (c, url) = (&c, proxy.url(path));
        async move {
            let start = std::time::Instant::now();
            let r = c.get(&url).await;
            (r, start.elapsed())
        }
    };
    let (r, _) = timed("/pay/v1/fast").await;
    assert_eq!(r.status, 200);
    // The default limit (1 s), then a shorter one than the timer is set for, then a longer one
    // again: each times out at its own limit, never before it.
    for (path, limit) in [
        ("/pay/v1/stall", 1000),
        ("/pay/v1/stall-short", 300),
        ("/pay/v1/stall", 1000),
    ] {
        let (r, took) = timed(path).await;
        assert_eq!(r.status, 504, "{path}");
        assert_eq!(r.problem(), "upstream-timeout");
        let limit = Duration::from_millis(limit);
        assert!(
            took >= limit,
            "{path}: timed out after {took:?}, before {limit:?}"
        );
        assert!(
            took < limit + Duration::from_millis(1500),
            "{path}: {took:?}"
        );
    }
    let (r, _) = timed("/pay/v1/fast").await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn reads_are_tried_again_on_retry_statuses() {
    let (up, proxy) = setup("").await;
    up.push(Behavior::status(503));
    up.push(Behavior::status(429));
    let r = TestClient::default().get(&proxy.url("/pay/v1/x")).await;
    assert_eq!(r.status, 200);
    assert_eq!(up.count(), 3);
}

#[tokio::test]
async fn reads_to_an_unreachable_upstream_get_502_after_tries() {
    // A port that refuses connections, reserved for the test's length.
    let (_reserved, addr) = support::refusing_port();
    let proxy = TestProxy::start(&config(&format!("http://{addr}"), "")).await;
    let r = TestClient::default().get(&proxy.url("/pay/v1/x")).await;
    assert_eq!(r.status, 502);
    assert_eq!(r.problem(), "upstream-unreachable");
    // The proxy tried again already: the SDKs do not add tries of their own at once (SPEC §8);
    // its words and `Retry-After` say a later try is safe (issue 60 item 15).
    assert_eq!(r.header("x-should-retry"), Some("false"));
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(r.json()["next_step"]
        .as_str()
        .unwrap()
        .contains("tried again"));
}

#[tokio::test]
async fn the_proxy_drains_and_stops_on_shutdown() {
    let (up, proxy) = setup("").await;
    let gate = Arc::new(Notify::new());
    up.set_default(Behavior::Gate(
        gate.clone(),
        Box::new(Behavior::json(200, "{\"late\":true}")),
    ));
    let url = proxy.url("/pay/slow");
    let req = tokio::spawn(async move { TestClient::default().get(&url).await });
    up.wait_for(1).await;
    let addr = proxy.addr;
    let stopping = tokio::spawn(proxy.stop());
    // New connections are refused once the listener is closed; the open request still finishes.
    loop {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            break;
        }
        tokio::task::yield_now().await;
    }
    gate.notify_one();
    let r = req.await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body, "{\"late\":true}");
    stopping.await.unwrap();
}
