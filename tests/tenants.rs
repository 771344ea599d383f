//! Callers are tenants (SPEC §4.3, issue 58): a caller is known by every header that carries a
//! credential, so two callers sending the same write are two actions, and neither ever gets the
//! other's stored answer.
#![allow(clippy::unwrap_used)]

mod support;

use support::{config, Behavior, FakeUpstream, TestClient, TestProxy};

/// Two callers, each authenticated by one credential header, send the same keyless write: each
/// is sent, and each gets its own answer. Before, a caller known only by `Cookie`, by
/// `x-goog-api-key`, or by a header the operator lists in `log.redact_headers`, counted as
/// `anonymous`: the second got the first one's answer and its write was never sent.
#[tokio::test]
async fn callers_known_by_any_credential_header_never_share_an_answer() {
    let up = FakeUpstream::start().await;
    let toml = config(&up.url(), "").replace(
        "[defaults]",
        "[log]\nredact_headers = [\"x-tenant-secret\"]\n\n[defaults]",
    );
    let proxy = TestProxy::start(&toml).await;
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    for (i, header) in [
        "cookie",
        "x-goog-api-key",
        "x-auth-token",
        "proxy-authorization",
        "x-tenant-secret",
    ]
    .into_iter()
    .enumerate()
    {
        let body = format!(r#"{{"amount":{}}}"#, 4200 + i);
        let before = up.count();
        up.push(Behavior::json(201, r#"{"id":"ch_alice"}"#));
        up.push(Behavior::json(201, r#"{"id":"ch_bob"}"#));
        let json = ("content-type", "application/json");
        let alice = c.post(&url, &[json, (header, "alice-secret")], &body).await;
        let bob = c.post(&url, &[json, (header, "bob-secret")], &body).await;
        assert_eq!(alice.header("oncegate-outcome"), Some("sent"), "{header}");
        assert_eq!(
            bob.header("oncegate-outcome"),
            Some("sent"),
            "{header}: {bob:?}"
        );
        assert_eq!(&bob.body[..], br#"{"id":"ch_bob"}"#, "{header}");
        assert_ne!(
            alice.header("oncegate-action"),
            bob.header("oncegate-action")
        );
        assert_eq!(up.count(), before + 2, "{header}");
        // The same caller again: the same action, replayed.
        let again = c.post(&url, &[json, (header, "alice-secret")], &body).await;
        assert_eq!(
            again.header("oncegate-outcome"),
            Some("replayed"),
            "{header}"
        );
        assert_eq!(&again.body[..], br#"{"id":"ch_alice"}"#, "{header}");
    }
    proxy.stop().await;
}
