//! Traces (issue 60): with `[telemetry] otlp_endpoint` set, the proxy posts its spans to an
//! OTLP/HTTP collector, here a fake one that keeps what it receives, decoded with the
//! `opentelemetry-proto` types. A caller's `traceparent` is the request span's parent; the
//! attempt is the request's child; no credential or body reaches the collector.
#![allow(clippy::unwrap_used)]

mod support;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value::Value as Any, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use support::{Behavior, ChildProxy, FakeUpstream, TestClient};

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

fn attr(kvs: &[KeyValue], key: &str) -> Option<String> {
    let v = kvs
        .iter()
        .find(|kv| kv.key == key)?
        .value
        .as_ref()?
        .value
        .as_ref()?;
    Some(match v {
        Any::StringValue(s) => s.clone(),
        Any::IntValue(i) => i.to_string(),
        Any::BoolValue(b) => b.to_string(),
        other => format!("{other:?}"),
    })
}

#[tokio::test]
async fn spans_go_to_the_collector_under_the_callers_trace_without_secrets() {
    let up = FakeUpstream::start().await;
    let collector = FakeUpstream::start().await;
    collector
        .set_default(Behavior::status(200).with_header("content-type", "application/x-protobuf"));
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::child_config(dir.path(), &up.url(), "");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        format!(
            "{text}\n[telemetry]\notlp_endpoint = \"{}\"\nservice_name = \"oncegate-test\"\n",
            collector.url()
        ),
    )
    .unwrap();
    let mut proxy = tokio::task::spawn_blocking(move || ChildProxy::spawn(&cfg))
        .await
        .unwrap();
    let c = TestClient::default();
    up.push(Behavior::json(201, r#"{"id":"ch_1"}"#));
    let traceparent = format!("00-{TRACE}-{PARENT}-01");
    let w = c
        .post(
            &proxy.url("/pay/v1/charges"),
            &[
                ("idempotency-key", "otlp-1"),
                ("authorization", "Bearer sk_otlp_s3cret"),
                ("traceparent", traceparent.as_str()),
                ("content-type", "application/json"),
            ],
            r#"{"amount":4200,"memo":"body-otlp-s3cret"}"#,
        )
        .await;
    assert_eq!(w.status, 201);
    let id = w.header("oncegate-action").unwrap().to_string();
    // A read, in a trace of its own.
    c.get(&proxy.url("/pay/v1/charges/ch_1")).await;
    // The upstream got the caller's trace context as sent.
    assert_eq!(
        up.received()[0].header("traceparent"),
        Some(traceparent.as_str())
    );
    // A stop flushes the spans still batched.
    let status = tokio::task::spawn_blocking(move || proxy.terminate_ref())
        .await
        .unwrap();
    assert!(status.success(), "{status:?}");

    let posts = collector.received();
    assert!(!posts.is_empty(), "nothing reached the collector");
    let mut spans: Vec<Span> = Vec::new();
    let mut raw = Vec::new();
    for p in &posts {
        assert_eq!(p.method, "POST");
        assert_eq!(p.target, "/v1/traces");
        assert_eq!(p.header("content-type"), Some("application/x-protobuf"));
        raw.extend_from_slice(&p.body);
        let req = ExportTraceServiceRequest::decode(p.body.as_ref()).unwrap();
        for rs in req.resource_spans {
            let res = rs.resource.unwrap();
            assert_eq!(
                attr(&res.attributes, "service.name").as_deref(),
                Some("oncegate-test")
            );
            for ss in rs.scope_spans {
                spans.extend(ss.spans);
            }
        }
    }
    let raw = String::from_utf8_lossy(&raw);
    for secret in ["sk_otlp_s3cret", "body-otlp-s3cret", "4200"] {
        assert!(!raw.contains(secret), "{secret} reached the collector");
    }
    let request = spans
        .iter()
        .find(|s| s.name == "request" && attr(&s.attributes, "action").as_deref() == Some(&id))
        .unwrap_or_else(|| panic!("no request span for {id}: {spans:?}"));
    assert_eq!(hex(&request.trace_id), TRACE);
    assert_eq!(hex(&request.parent_span_id), PARENT);
    for (k, v) in [
        ("upstream", "pay"),
        ("class", "write"),
        ("key_source", "header"),
        ("outcome", "sent"),
        ("status", "201"),
        ("method", "POST"),
        ("path", "/pay/v1/charges"),
    ] {
        assert_eq!(
            attr(&request.attributes, k).as_deref(),
            Some(v),
            "{k}: {request:?}"
        );
    }
    let attempt = spans
        .iter()
        .find(|s| s.name == "attempt")
        .unwrap_or_else(|| panic!("no attempt span: {spans:?}"));
    assert_eq!(attempt.trace_id, request.trace_id);
    assert_eq!(attempt.parent_span_id, request.span_id);
    assert_eq!(
        attr(&attempt.attributes, "action").as_deref(),
        Some(id.as_str())
    );
    assert_eq!(attr(&attempt.attributes, "attempt").as_deref(), Some("1"));
    assert_eq!(
        attr(&attempt.attributes, "outcome").as_deref(),
        Some("sent")
    );
    // The read: a root span of its own trace, forwarded.
    let read = spans
        .iter()
        .find(|s| s.name == "request" && attr(&s.attributes, "class").as_deref() == Some("read"))
        .unwrap_or_else(|| panic!("no read span: {spans:?}"));
    assert_ne!(read.trace_id, request.trace_id);
    assert!(read.parent_span_id.is_empty());
    assert_eq!(
        attr(&read.attributes, "outcome").as_deref(),
        Some("forwarded")
    );
}

/// A bad endpoint is a config error that names the key (exit 64).
#[tokio::test]
async fn a_bad_otlp_endpoint_names_the_key() {
    for bad in ["collector:4318", "ftp://collector", ""] {
        let text = format!(
            "{}\n[telemetry]\notlp_endpoint = {bad:?}\n",
            support::config("http://127.0.0.1:9", "")
        );
        let e = oncegate::config::Config::parse(&text)
            .unwrap_err()
            .to_string();
        assert!(e.contains("telemetry.otlp_endpoint"), "{bad}: {e}");
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
