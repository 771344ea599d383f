//! Connections that never finish (SPEC §2): silent or trickling clients are closed at
//! `header_timeout`, a write body that does not arrive within `body_timeout` gets 408 and
//! nothing is sent, and at most `max_connections` are open at once. Real sockets throughout.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use support::{config, FakeUpstream, TestProxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Writes `first` on a new connection, then waits up to `limit` for the proxy to close it;
/// returns what it answered and how long it kept the connection.
async fn held_for(proxy: &TestProxy, first: &[u8], limit: Duration) -> (String, Option<Duration>) {
    let started = Instant::now();
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(first).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout_at((started + limit).into(), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                return (
                    String::from_utf8_lossy(&out).into_owned(),
                    Some(started.elapsed()),
                )
            }
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&out).into_owned(), None),
        }
    }
}

#[tokio::test]
async fn silent_and_one_byte_connections_are_closed_at_header_timeout() {
    let up = FakeUpstream::start().await;
    // The test config's header_timeout is 2s.
    let proxy = TestProxy::start(&config(&up.url(), "")).await;
    for first in [&b""[..], b"P", b"POST /pay/v1/c HTTP/1.1\r\nhost: x\r\n"] {
        let (_, closed) = held_for(&proxy, first, Duration::from_secs(6)).await;
        let held = closed.unwrap_or_else(|| panic!("{first:?}: still open after 6 s"));
        assert!(
            held >= Duration::from_millis(1_900),
            "{first:?}: closed early, {held:?}"
        );
    }
    assert_eq!(up.count(), 0);
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_at_header_timeout_after_its_response() {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), "")).await;
    let (out, closed) = held_for(
        &proxy,
        b"GET /pay/v1/c HTTP/1.1\r\nhost: x\r\n\r\n",
        Duration::from_secs(6),
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    let held = closed.expect("an idle connection is closed");
    assert!(held >= Duration::from_millis(1_900), "{held:?}");
}

/// A later head on a kept-alive connection is bounded too: trickled a byte every 300 ms after a
/// first request was answered, it is cut at `header_timeout` of its first byte (the silence
/// bound never fires, since the client keeps sending), and nothing of it is sent upstream.
#[tokio::test]
async fn a_trickled_second_head_is_closed_at_header_timeout() {
    let up = FakeUpstream::start().await;
    // The test config's header_timeout is 2s.
    let proxy = TestProxy::start(&config(&up.url(), "")).await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(b"GET /pay/v1/first HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    assert_eq!(up.count(), 1);
    let started = Instant::now();
    let head =
        b"GET /pay/v1/second HTTP/1.1\r\nhost: x\r\nx-long: aaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let mut closed = None;
    for b in head.iter() {
        if s.write_all(&[*b]).await.is_err() {
            closed = Some(started.elapsed());
            break;
        }
        // A closed connection shows as a read of 0 (or an error) before the next byte.
        match tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                closed = Some(started.elapsed());
                break;
            }
            Ok(Ok(n)) => panic!("answered a head never finished: {:?}", &buf[..n]),
            Err(_) => {}
        }
    }
    let held = closed.expect("the trickled head's connection is closed before it finishes");
    assert!(
        held >= Duration::from_millis(1_900) && held < Duration::from_millis(3_500),
        "closed after {held:?}, not at header_timeout (2 s) of the head's first byte"
    );
    assert_eq!(up.count(), 1, "nothing of the trickled head was sent");
}

#[tokio::test]
async fn a_trickled_or_missing_write_body_gets_408_and_nothing_is_sent() {
    let up = FakeUpstream::start().await;
    let cfg = config(&up.url(), "").replace(
        "header_timeout = \"2s\"",
        "header_timeout = \"2s\"\nbody_timeout = \"1s\"",
    );
    let proxy = TestProxy::start(&cfg).await;
    // Expect: 100-continue with no body at all.
    let (out, closed) = held_for(
        &proxy,
        b"POST /pay/v1/c HTTP/1.1\r\nhost: x\r\nidempotency-key: b1\r\nexpect: 100-continue\r\ncontent-length: 10\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(out.contains("408"), "{out}");
    assert!(out.contains("body-timeout"), "{out}");
    assert!(closed.is_some());
    // A body trickled at one byte a second.
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        b"POST /pay/v1/c HTTP/1.1\r\nhost: x\r\nidempotency-key: b2\r\ncontent-length: 10\r\n\r\n",
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    let started = Instant::now();
    let mut buf = [0u8; 1024];
    while started.elapsed() < Duration::from_secs(5) {
        let _ = s.write_all(b"x").await;
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(400), s.read(&mut buf)).await
        {
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
            if out.windows(4).any(|w| w == b"\r\n\r\n") && out.ends_with(b"}") {
                break;
            }
        }
    }
    let out = String::from_utf8_lossy(&out);
    assert!(out.starts_with("HTTP/1.1 408"), "{out}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(up.count(), 0, "nothing was sent");
}

#[tokio::test]
async fn at_most_max_connections_are_served_at_once() {
    let up = FakeUpstream::start().await;
    let cfg = config(&up.url(), "").replace(
        "header_timeout = \"2s\"",
        "header_timeout = \"30s\"\nmax_connections = 3",
    );
    let proxy = TestProxy::start(&cfg).await;
    // Three idle connections take every place; a fourth is not served until one closes.
    let mut idle = Vec::new();
    for _ in 0..3 {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(b"G").await.unwrap();
        idle.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let client = support::TestClient::default();
    let waiting = tokio::time::timeout(
        Duration::from_millis(800),
        client.get(&proxy.url("/pay/v1/c")),
    )
    .await;
    assert!(waiting.is_err(), "a fourth connection was served");
    drop(idle.pop());
    let r = tokio::time::timeout(Duration::from_secs(5), client.get(&proxy.url("/pay/v1/c")))
        .await
        .expect("served once a place is free");
    assert_eq!(r.status, 200);
}

/// The HTTP/2 client preface and an empty SETTINGS frame: an h2c connection that then says
/// nothing.
const H2_PREFACE_AND_SETTINGS: &[u8] =
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// HTTP/2 connections that send their preface and settings and then nothing (issue 58 item 4):
/// each is closed at `header_timeout` as an HTTP/1 one is, so that a crowd of them cannot hold
/// every place (`max_connections`) and starve ordinary requests.
#[tokio::test]
async fn idle_http2_connections_are_closed_at_header_timeout_and_free_their_places() {
    let up = FakeUpstream::start().await;
    let cfg = config(&up.url(), "").replace(
        "header_timeout = \"2s\"",
        "header_timeout = \"1s\"\nmax_connections = 5",
    );
    let proxy = TestProxy::start(&cfg).await;
    let (_, closed) = held_for(&proxy, H2_PREFACE_AND_SETTINGS, Duration::from_secs(5)).await;
    let held = closed.expect("an idle HTTP/2 connection is closed");
    assert!(held >= Duration::from_millis(900), "closed early: {held:?}");
    // Five of them take every place; an ordinary request is served once they are closed.
    let mut crowd = Vec::new();
    for _ in 0..5 {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(H2_PREFACE_AND_SETTINGS).await.unwrap();
        crowd.push(s);
    }
    let client = support::TestClient::default();
    let r = tokio::time::timeout(Duration::from_secs(5), client.get(&proxy.url("/pay/v1/c")))
        .await
        .expect("served once the idle connections are closed");
    assert_eq!(r.status, 200);
    drop(crowd);
}

/// A request in progress keeps its connection however long its answer takes: over HTTP/2, a
/// slow answer (3 s, past a 1 s header_timeout) arrives whole.
#[tokio::test]
async fn a_slow_answer_over_http2_is_not_cut_by_the_idle_bound() {
    let up = FakeUpstream::start().await;
    up.set_default(support::Behavior::Delay(
        Duration::from_secs(3),
        Box::new(support::Behavior::json(200, "{\"slow\":true}")),
    ));
    let cfg = config(&up.url(), "timeout = \"10s\"")
        .replace("header_timeout = \"2s\"", "header_timeout = \"1s\"");
    let proxy = TestProxy::start(&cfg).await;
    let r = support::TestClient::http2()
        .get(&proxy.url("/pay/v1/c"))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(&r.body[..], b"{\"slow\":true}");
}

/// Request bodies held in memory are bounded all together (issue 58 item 5): while one upload
/// holds `max_buffered`, another write gets 503 `busy` with `Retry-After`, and nothing of it is
/// sent; once the first is done, writes go again.
#[tokio::test]
async fn bodies_held_at_once_are_bounded_by_max_buffered() {
    let up = FakeUpstream::start().await;
    let cfg = config(&up.url(), "").replace(
        "header_timeout = \"2s\"",
        "header_timeout = \"2s\"\nmax_body = \"64KiB\"\nmax_buffered = \"100KiB\"",
    );
    let proxy = TestProxy::start(&cfg).await;
    // A slow upload declares 64 KiB and sends half: its whole length is held.
    let mut slow = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    slow.write_all(
        b"POST /pay/v1/files HTTP/1.1\r\nhost: x\r\nidempotency-key: big\r\ncontent-length: 65536\r\n\r\n",
    )
    .await
    .unwrap();
    slow.write_all(&[b'a'; 32 * 1024]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let c = support::TestClient::default();
    let body = "b".repeat(40 * 1024);
    let busy = c
        .post(
            &proxy.url("/pay/v1/files"),
            &[("idempotency-key", "k2")],
            &body,
        )
        .await;
    assert_eq!(busy.status, 503, "{busy:?}");
    assert_eq!(busy.problem(), "busy");
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert_eq!(busy.json()["duplicate_risk"], false);
    assert_eq!(up.count(), 0, "nothing was sent");
    // The slow upload ends; its share is given back.
    slow.write_all(&[b'a'; 32 * 1024]).await.unwrap();
    let mut answer = [0u8; 12];
    slow.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"HTTP/1.1 200");
    let again = c
        .post(
            &proxy.url("/pay/v1/files"),
            &[("idempotency-key", "k2")],
            &body,
        )
        .await;
    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(up.count(), 2);
}

/// A write body that arrives in many pieces (chunked, no declared length, and declared but sent
/// in pieces) reaches the upstream byte for byte as it was sent: the pieces are gathered into
/// one buffer as they arrive, not kept and joined at the end.
#[tokio::test]
async fn a_body_sent_in_pieces_reaches_the_upstream_whole() {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), "")).await;
    let pieces: Vec<Vec<u8>> = (0..40u8)
        .map(|i| vec![b'a' + i % 26; 997 + i as usize])
        .collect();
    let whole: Vec<u8> = pieces.concat();
    for declared in [false, true] {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let key = format!("pieces-{declared}");
        let head = match declared {
            true => format!("POST /pay/v1/files HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\ncontent-length: {}\r\n\r\n", whole.len()),
            false => format!("POST /pay/v1/files HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\ntransfer-encoding: chunked\r\n\r\n"),
        };
        s.write_all(head.as_bytes()).await.unwrap();
        for p in &pieces {
            if declared {
                s.write_all(p).await.unwrap();
            } else {
                s.write_all(format!("{:x}\r\n", p.len()).as_bytes())
                    .await
                    .unwrap();
                s.write_all(p).await.unwrap();
                s.write_all(b"\r\n").await.unwrap();
            }
            s.flush().await.unwrap();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        if !declared {
            s.write_all(b"0\r\n\r\n").await.unwrap();
        }
        let mut answer = [0u8; 12];
        s.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"HTTP/1.1 200", "declared: {declared}");
    }
    let got = up.received();
    assert_eq!(got.len(), 2);
    for r in got {
        assert!(
            r.body == whole,
            "{} bytes, not the {} sent",
            r.body.len(),
            whole.len()
        );
    }
}
