//! TLS: HTTPS upstreams through rustls with a CA made in the test, HTTP/2 by ALPN, and the
//! listener's own TLS.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;

use bytes::Bytes;
use http::Version;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use support::{config, FakeUpstream, TestClient, TestProxy};

struct Pki {
    ca_pem: String,
    ca_der: CertificateDer<'static>,
    leaf: CertificateDer<'static>,
    key: PrivatePkcs8KeyDer<'static>,
    leaf_pem: String,
    key_pem: String,
}

/// A CA, and a leaf for 127.0.0.1 and localhost signed by it.
fn pki() -> Pki {
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    Pki {
        ca_pem: ca.pem(),
        ca_der: ca.der().clone(),
        leaf: leaf.der().clone(),
        leaf_pem: leaf.pem(),
        key: PrivatePkcs8KeyDer::from(key.serialize_der()),
        key_pem: key.serialize_pem(),
    }
}

fn server_config(p: &Pki, alpn: &[&[u8]]) -> rustls::ServerConfig {
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![p.leaf.clone()],
        PrivateKeyDer::Pkcs8(p.key.clone_key()),
    )
    .unwrap();
    cfg.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    cfg
}

#[tokio::test]
async fn https_upstream_with_a_ca_file_speaks_http2_by_alpn() {
    let p = pki();
    let up = FakeUpstream::start_tls(server_config(&p, &[b"h2", b"http/1.1"])).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &p.ca_pem).unwrap();
    let extra = format!("ca_file = {:?}", ca.display().to_string());
    let proxy = TestProxy::start(&config(&up.url(), &extra)).await;
    let r = TestClient::default().get(&proxy.url("/pay/v1/x?y=1")).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let got = &up.received()[0];
    assert_eq!(got.version, Version::HTTP_2);
    assert_eq!(got.target, "/v1/x?y=1");
    // Over HTTP/2 the authority travels as `:authority`, with no `Host` header beside it.
    assert_eq!(got.header("host"), None);
    // A write goes over TLS too, with its key.
    let r = TestClient::default()
        .post(
            &proxy.url("/pay/v1/charges"),
            &[("idempotency-key", "k-tls")],
            "{}",
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(up.count_key("idempotency-key", "k-tls"), 1);
}

#[tokio::test]
async fn https_upstream_over_http1_when_alpn_offers_only_http1() {
    let p = pki();
    let up = FakeUpstream::start_tls(server_config(&p, &[b"http/1.1"])).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &p.ca_pem).unwrap();
    let extra = format!("ca_file = {:?}", ca.display().to_string());
    let proxy = TestProxy::start(&config(&up.url(), &extra)).await;
    let r = TestClient::default().get(&proxy.url("/pay/v1/x")).await;
    assert_eq!(r.status, 200);
    assert_eq!(up.received()[0].version, Version::HTTP_11);
    // Over HTTP/1.1, `Host` is the upstream's.
    assert_eq!(
        up.received()[0].header("host"),
        Some(up.addr.to_string().as_str())
    );
}

#[tokio::test]
async fn an_untrusted_upstream_certificate_is_unreachable_and_nothing_is_sent() {
    let p = pki();
    let up = FakeUpstream::start_tls(server_config(&p, &[b"http/1.1"])).await;
    // No ca_file: the test CA is not among the web PKI roots.
    let proxy = TestProxy::start(&config(&up.url(), "")).await;
    let r = TestClient::default()
        .post(
            &proxy.url("/pay/v1/charges"),
            &[("idempotency-key", "k1")],
            "{}",
        )
        .await;
    assert_eq!(r.status, 502);
    assert_eq!(r.problem(), "upstream-unreachable");
    let ev = &r.json()["evidence"][0]["tries"][0];
    assert_eq!(ev["phase"], "connect");
    assert!(
        ev["error"]
            .as_str()
            .unwrap()
            .to_lowercase()
            .contains("certificate"),
        "{ev}"
    );
    assert_eq!(up.count(), 0);
}

#[tokio::test]
async fn the_listener_serves_tls_when_configured() {
    let p = pki();
    let up = FakeUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, &p.leaf_pem).unwrap();
    std::fs::write(&key, &p.key_pem).unwrap();
    let cfg = config(&up.url(), "").replace(
        "drain_timeout = \"5s\"",
        &format!(
            "drain_timeout = \"5s\"\ntls = {{ cert = {:?}, key = {:?} }}",
            cert.display().to_string(),
            key.display().to_string()
        ),
    );
    let proxy = TestProxy::start(&cfg).await;

    let mut roots = rustls::RootCertStore::empty();
    roots.add(p.ca_der.clone()).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(client))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get("/pay/v1/x")
        .header("host", "localhost")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, r#"{"ok":true}"#);
    assert_eq!(up.count(), 1);
}
