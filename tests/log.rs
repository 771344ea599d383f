//! The write log (SPEC §11): every event, its fields, tamper evidence, redaction, and survival of
//! a SIGKILL under load.
#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;
use support::{config, Behavior, ChildProxy, FakeUpstream, TestClient, TestProxy, ADMIN_TOKEN};

const KEY: &str = "idempotency-key";
const FIELDS: &[&str] = &[
    "seq",
    "ts",
    "event",
    "action",
    "upstream",
    "method",
    "path",
    "principal",
    "key",
    "task",
    "step",
    "attempt",
    "status",
    "outcome",
    "external_id",
    "fingerprint",
    "actor",
    "detail",
    "alg",
    "prev",
    "hash",
];

fn lines(ndjson: &[u8]) -> Vec<Value> {
    String::from_utf8(ndjson.to_vec())
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not one JSON object ({e}): {l}"))
        })
        .collect()
}

async fn export(proxy: &TestProxy) -> Vec<Value> {
    lines(&proxy.admin("GET", "/v1/log?limit=10000", "").await.body)
}

#[tokio::test]
async fn every_event_is_logged_with_its_fields() {
    let up = FakeUpstream::start().await;
    let extra = r#"timeout = "300ms"
external_id = "/id"
lookup = { path = "/v1/lookup/{key}", found = "/id" }"#;
    let proxy = TestProxy::start(&config(&up.url(), extra)).await;
    let c = TestClient::default();
    let url = proxy.url("/pay/v1/charges");
    let task = [("oncegate-task", "t-9"), ("oncegate-step", "charge")];
    up.push(Behavior::json(201, r#"{"id":"ch_1"}"#));
    c.post(&url, &task, "amount=1").await; // intent, sent, outcome
    c.post(&url, &task, "amount=1").await; // replayed
    c.post(&url, &task, "amount=2").await; // conflict (key-reused)
    c.post(&url, &[(KEY, "")], "x").await; // rejected
    up.push(Behavior::Hang);
    let r = c.post(&url, &[(KEY, "k-unknown")], "amount=3").await; // unknown
    let unknown_id = r.header("oncegate-action").unwrap().to_string();
    up.on("/v1/lookup/", Behavior::json(500, "{}"));
    c.post(&url, &[(KEY, "k-unknown")], "amount=3").await; // lookup (left unknown), conflict
    proxy
        .admin(
            "POST",
            &format!("/v1/actions/{unknown_id}/resolve"),
            r#"{"outcome":"applied","reason":"seen in the ledger"}"#,
        )
        .await; // resolved
    let later = oncegate::action::now_millis() + 3 * 24 * 3600 * 1000;
    assert_eq!(proxy.store.expire(later).await.unwrap(), 2); // expired
    let entries = export(&proxy).await;
    let events: HashSet<&str> = entries
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    for ev in [
        "intent", "sent", "outcome", "replayed", "conflict", "rejected", "unknown", "lookup",
        "resolved", "expired",
    ] {
        assert!(events.contains(ev), "no {ev} entry in {events:?}");
    }
    // Every entry has the fields every entry needs and none outside the list; no `null`s. An
    // intent (and a conflict or a rejection: requests that are not the action's) describes the
    // request; the action's later entries name the action and its principal, and the chain
    // binds them to their intent.
    let described = ["upstream", "method", "path", "key", "fingerprint"];
    for e in &entries {
        let obj = e.as_object().unwrap();
        for f in ["seq", "ts", "event", "actor", "alg", "prev", "hash"] {
            assert!(obj.contains_key(f), "entry lacks {f}: {e}");
        }
        for (k, v) in obj {
            assert!(FIELDS.contains(&k.as_str()), "unexpected field {k} in {e}");
            assert!(!v.is_null(), "{k} is null in {e}");
        }
        let describes = ["intent", "conflict", "rejected"].contains(&e["event"].as_str().unwrap());
        for f in described {
            if describes && e["event"] != "rejected" {
                assert!(obj.contains_key(f), "{} lacks {f}: {e}", e["event"]);
            } else if !describes {
                assert!(!obj.contains_key(f), "{} repeats {f}: {e}", e["event"]);
            }
        }
        if e["event"] != "rejected" {
            assert!(
                obj.contains_key("action") && obj.contains_key("principal"),
                "{e}"
            );
        }
    }
    let outcome = entries.iter().find(|e| e["event"] == "outcome").unwrap();
    assert_eq!(outcome["status"], 201);
    assert_eq!(outcome["outcome"], "applied");
    assert_eq!(outcome["external_id"], "ch_1");
    assert_eq!(outcome["actor"], "proxy");
    let intent = entries
        .iter()
        .find(|e| e["event"] == "intent" && e["action"] == outcome["action"])
        .unwrap();
    assert_eq!(intent["task"], "t-9");
    assert_eq!(intent["step"], "charge");
    let resolved = entries.iter().find(|e| e["event"] == "resolved").unwrap();
    assert_eq!(resolved["actor"], "admin");
    assert_eq!(resolved["detail"], "seen in the ledger");
    assert_eq!(
        entries.iter().find(|e| e["event"] == "lookup").unwrap()["actor"],
        "lookup"
    );
    // The chain verifies; the first entry starts it.
    assert_eq!(entries[0]["prev"], "0".repeat(64));
    let v = proxy.admin("GET", "/v1/log/verify", "").await.json();
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["entries"], entries.len());
    assert_eq!(v["head"], entries.last().unwrap()["hash"]);
}

fn cli(args: &[&str], envs: &[(&str, &str)]) -> std::process::Output {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_oncegate"));
    c.args(args).env("ONCEGATE_ADMIN_TOKEN", ADMIN_TOKEN);
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn verify_file(path: &Path, extra: &[&str], envs: &[(&str, &str)]) -> (bool, Value) {
    let mut args = vec!["log", "verify", "--file", path.to_str().unwrap()];
    args.extend_from_slice(extra);
    let out = cli(&args, envs);
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    (out.status.success(), v)
}

/// A proxy with some history, exported to a file through the CLI.
async fn exported(hmac: Option<&str>) -> (tempfile::TempDir, TestProxy, FakeUpstream, Vec<String>) {
    let up = FakeUpstream::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let options = oncegate::store::StoreOptions {
        chain: oncegate::log::Chain::new(hmac.map(|k| k.as_bytes().to_vec())),
        ..Default::default()
    };
    let store =
        Arc::new(oncegate::store::sled::SledStore::open(&tmp.path().join("s"), options).unwrap());
    let proxy = TestProxy::start_with_store(&config(&up.url(), ""), store, tmp.path()).await;
    let c = TestClient::default();
    for i in 0..4 {
        c.post(&proxy.url("/pay/v1/x"), &[(KEY, &format!("k{i}"))], "a")
            .await;
    }
    let file = tmp.path().join("log.ndjson");
    let admin = proxy.admin_url("");
    let out = tokio::task::spawn_blocking({
        let file = file.clone();
        move || {
            cli(
                &[
                    "log",
                    "--admin",
                    &admin,
                    "export",
                    "--out",
                    file.to_str().unwrap(),
                ],
                &[],
            )
        }
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<String> = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(lines.len(), 12, "intent, sent, outcome per write");
    (tmp, proxy, up, lines)
}

fn write(dir: &Path, name: &str, lines: &[String]) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    p
}

#[tokio::test]
async fn tampering_with_an_export_is_found_at_the_right_entry() {
    let (tmp, _proxy, _up, lines) = exported(None).await;
    let (ok, v) = verify_file(&write(tmp.path(), "good", &lines), &[], &[]);
    assert!(ok, "{v}");
    assert_eq!(v["entries"], 12);

    let mut flipped = lines.clone();
    flipped[2] = flipped[2].replacen("\"applied\"", "\"not-applied\"", 1);
    assert_ne!(flipped[2], lines[2]);
    let (ok, v) = verify_file(&write(tmp.path(), "flipped", &flipped), &[], &[]);
    assert!(!ok);
    assert_eq!(v["first_bad_seq"], 3);

    let mut dropped = lines.clone();
    dropped.remove(4);
    let (ok, v) = verify_file(&write(tmp.path(), "dropped", &dropped), &[], &[]);
    assert!(!ok);
    assert_eq!(v["first_bad_seq"], 5);

    let mut swapped = lines.clone();
    swapped.swap(6, 7);
    let (ok, v) = verify_file(&write(tmp.path(), "swapped", &swapped), &[], &[]);
    assert!(!ok);
    assert_eq!(v["first_bad_seq"], 7);

    // A cut tail verifies on its own, but not against a head anchored elsewhere.
    let head: Value = serde_json::from_str(lines.last().unwrap()).unwrap();
    let anchor = format!("{}:{}", head["seq"], head["hash"].as_str().unwrap());
    let cut = &lines[..10];
    let (ok, _) = verify_file(&write(tmp.path(), "cut", cut), &[], &[]);
    assert!(ok, "a chain alone cannot show a cut tail");
    let (ok, v) = verify_file(
        &write(tmp.path(), "cut2", cut),
        &["--expect-head", &anchor],
        &[],
    );
    assert!(!ok, "{v}");
    let (ok, _) = verify_file(
        &write(tmp.path(), "full", &lines),
        &["--expect-head", &anchor],
        &[],
    );
    assert!(ok);

    // A field added to an entry is an edit.
    let mut added = lines.clone();
    let mut e: Value = serde_json::from_str(&added[5]).unwrap();
    e["reason"] = "approved by the CFO".into();
    added[5] = e.to_string();
    let (ok, v) = verify_file(&write(tmp.path(), "added", &added), &[], &[]);
    assert!(!ok, "{v}");
    assert_eq!(v["first_bad_seq"], 6);

    // A file with no entries is not a verified log.
    let (ok, v) = verify_file(&write(tmp.path(), "empty", &[]), &[], &[]);
    assert!(!ok, "{v}");
}

#[tokio::test]
async fn with_an_hmac_key_recomputed_plain_hashes_are_caught() {
    let (tmp, proxy, _up, lines) = exported(Some("k3y-for-the-log")).await;
    let env = [("LOG_KEY", "k3y-for-the-log")];
    let (ok, v) = verify_file(
        &write(tmp.path(), "good", &lines),
        &["--hmac-key-env", "LOG_KEY"],
        &env,
    );
    assert!(ok, "{v}");
    assert_eq!(
        proxy.admin("GET", "/v1/log/verify", "").await.json()["ok"],
        true
    );
    // Without the key the chain does not verify, and says a key is needed (entries name `alg`).
    let (ok, v) = verify_file(&write(tmp.path(), "nokey", &lines), &[], &[]);
    assert!(!ok);
    assert!(v["notes"].to_string().contains("key"), "{v}");
    // An attacker edits entry 5 and recomputes plain SHA-256 hashes from there on.
    let chain = oncegate::log::Chain::default();
    let mut forged: Vec<oncegate::log::Entry> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    forged[4].path = Some("/v1/forged".into());
    for i in 4..forged.len() {
        forged[i].prev = forged[i - 1].hash.clone();
        forged[i].hash = chain.hash(&forged[i]);
    }
    let forged: Vec<String> = forged
        .iter()
        .map(|e| serde_json::to_string(e).unwrap())
        .collect();
    let (ok, v) = verify_file(
        &write(tmp.path(), "forged", &forged),
        &["--hmac-key-env", "LOG_KEY"],
        &env,
    );
    assert!(!ok);
    assert_eq!(v["first_bad_seq"], 5);
}

#[tokio::test]
async fn control_characters_and_quotes_stay_inside_one_json_line() {
    let up = FakeUpstream::start().await;
    let proxy = TestProxy::start(&config(&up.url(), "")).await;
    let c = TestClient::default();
    let nasty = [
        (KEY, "k\"}\n{\\"),
        ("oncegate-task", "t\"x\\"),
        ("oncegate-step", "s\"}{"),
    ];
    // HTTP itself refuses raw CR/LF in a request; quotes, backslashes and tabs get through.
    let raw = "POST /pay/v1/a%22b%7Cc?q=%0A%22x%5C HTTP/1.1\r\nHost: a\r\nOncegate-Task: t\"x\\\r\n\
               Oncegate-Step: s\"}{\r\nX-Note: tab\there\r\nContent-Length: 1\r\nConnection: close\r\n\r\na";
    let (resp, _) = support::raw(
        proxy.addr,
        raw.as_bytes(),
        std::time::Duration::from_secs(5),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let _ = nasty;
    c.post(&proxy.url("/pay/v1/z"), &[(KEY, "quote\"back\\slash")], "a")
        .await;
    let body = proxy.admin("GET", "/v1/log", "").await.body;
    let text = String::from_utf8(body.to_vec()).unwrap();
    for l in text.lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        assert!(v.is_object());
    }
    let entries = lines(text.as_bytes());
    assert!(entries.iter().any(|e| e["task"] == "t\"x\\"));
    assert!(entries.iter().any(|e| e["key"] == "quote\"back\\slash"));
    assert_eq!(
        proxy.admin("GET", "/v1/log/verify", "").await.json()["ok"],
        true
    );
}

#[tokio::test]
async fn secrets_never_reach_the_log_the_admin_api_problems_or_stderr() {
    let up = FakeUpstream::start().await;
    up.set_default(
        Behavior::json(201, r#"{"id":"c1"}"#)
            .with_header("set-cookie", "session=CANARY-SETCOOKIE-5; Path=/"),
    );
    let tmp = tempfile::tempdir().unwrap();
    let cfg_path = support::child_config(tmp.path(), &up.url(), "timeout = \"300ms\"");
    let mut child = ChildProxy::spawn_with(
        &cfg_path,
        &[("RUST_LOG", "debug"), ("ONCEGATE_ADMIN_TOKEN", ADMIN_TOKEN)],
    );
    let c = TestClient::default();
    let secrets = [
        ("authorization", "Bearer CANARY-AUTH-1"),
        ("x-api-key", "CANARY-APIKEY-2"),
        ("cookie", "sid=CANARY-COOKIE-3"),
    ];
    let url = child.url("/pay/v1/customers?api_key=CANARY-QUERY-4&plain=1");
    let mut outputs: Vec<String> = Vec::new();
    let r = c
        .post(
            &url,
            &[secrets[0], secrets[1], secrets[2], (KEY, "canary")],
            "email=a@b.c",
        )
        .await;
    assert_eq!(r.status, 201);
    // A problem about the same action (same key, other body), and an unknown one.
    let p = c
        .post(
            &url,
            &[secrets[0], secrets[1], secrets[2], (KEY, "canary")],
            "email=other",
        )
        .await;
    outputs.push(String::from_utf8_lossy(&p.body).into_owned());
    up.push(Behavior::Hang);
    let p = c
        .post(
            &url,
            &[secrets[0], secrets[1], secrets[2], (KEY, "canary-2")],
            "x",
        )
        .await;
    outputs.push(String::from_utf8_lossy(&p.body).into_owned());
    let id = r.header("oncegate-action").unwrap();
    let admin = |path: &str| format!("http://{}{}", child.admin, path);
    let auth = [("authorization", format!("Bearer {ADMIN_TOKEN}"))];
    let auth: Vec<(&str, &str)> = auth.iter().map(|(k, v)| (*k, v.as_str())).collect();
    for path in [
        "/v1/actions".to_string(),
        format!("/v1/actions/{id}"),
        "/v1/log".to_string(),
        "/v1/tasks/none".to_string(),
        "/metrics".to_string(),
    ] {
        let r = c.send("GET", &admin(&path), &auth, "").await;
        assert_eq!(r.status, 200, "{path}");
        outputs.push(String::from_utf8_lossy(&r.body).into_owned());
    }
    // The stored request headers are there, redacted.
    let show = &outputs[3];
    assert!(show.contains("\"authorization\",\"REDACTED\""), "{show}");
    assert!(show.contains("api_key=REDACTED"), "{show}");
    // The replay still sets the upstream's cookie for the agent: only views are redacted.
    let again = c
        .post(
            &url,
            &[secrets[0], secrets[1], secrets[2], (KEY, "canary")],
            "email=a@b.c",
        )
        .await;
    assert_eq!(again.header("oncegate-outcome"), Some("replayed"));
    assert_eq!(
        again.header("set-cookie"),
        Some("session=CANARY-SETCOOKIE-5; Path=/")
    );
    child.terminate_ref();
    outputs.push(child.stderr.lock().unwrap().clone());
    for out in &outputs {
        for canary in [
            "CANARY-AUTH-1",
            "CANARY-APIKEY-2",
            "CANARY-COOKIE-3",
            "CANARY-QUERY-4",
            "CANARY-SETCOOKIE-5",
        ] {
            assert!(!out.contains(canary), "{canary} leaked into:\n{out}");
        }
    }
    // The upstream itself got everything, untouched.
    let got = &up.received()[0];
    assert_eq!(got.header("authorization"), Some("Bearer CANARY-AUTH-1"));
    assert!(got.target.contains("api_key=CANARY-QUERY-4"));
}

#[tokio::test]
async fn after_a_sigkill_under_load_the_log_verifies_and_every_received_write_was_logged_sent() {
    let up = FakeUpstream::start().await;
    up.set_default(Behavior::Delay(
        std::time::Duration::from_millis(5),
        Box::new(Behavior::json(201, r#"{"ok":1}"#)),
    ));
    let tmp = tempfile::tempdir().unwrap();
    let cfg_path = support::child_config(tmp.path(), &up.url(), "");
    let child = ChildProxy::spawn(&cfg_path);
    let url = child.url("/pay/v1/load");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..8 {
        let (url, stop) = (url.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let client =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .build_http::<http_body_util::Full<bytes::Bytes>>();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && i < 10_000 {
                let req = http::Request::post(&url)
                    .header(KEY, format!("w{w}-{i}"))
                    .body(http_body_util::Full::new(bytes::Bytes::from_static(b"x")))
                    .unwrap();
                if client.request(req).await.is_err() {
                    break;
                }
                i += 1;
            }
        }));
    }
    up.wait_for(60).await;
    child.kill();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }
    let child = ChildProxy::spawn_with(&cfg_path, &[("ONCEGATE_ADMIN_TOKEN", ADMIN_TOKEN)]);
    let c = TestClient::default();
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let v = c
        .send(
            "GET",
            &format!("http://{}/v1/log/verify", child.admin),
            &[("authorization", &auth)],
            "",
        )
        .await
        .json();
    assert_eq!(v["ok"], true, "{v}");
    let log = c
        .send(
            "GET",
            &format!("http://{}/v1/log?limit=10000", child.admin),
            &[("authorization", &auth)],
            "",
        )
        .await;
    // A sent entry names its action; the action's intent says its key.
    let entries = lines(&log.body);
    let keys: std::collections::HashMap<&str, &str> = entries
        .iter()
        .filter(|e| e["event"] == "intent")
        .map(|e| (e["action"].as_str().unwrap(), e["key"].as_str().unwrap()))
        .collect();
    let sent: HashSet<String> = entries
        .iter()
        .filter(|e| e["event"] == "sent")
        .map(|e| keys[e["action"].as_str().unwrap()].to_string())
        .collect();
    let received = up.received();
    assert!(received.len() >= 60);
    for r in &received {
        let key = r.header(KEY).unwrap();
        assert!(
            sent.contains(key),
            "{key} reached the upstream without a sent entry"
        );
    }
}

/// `log verify --file` takes the key the config names (issue 58 item 6): the genuine HMAC log
/// verifies with `--config` and its key in the environment, and a log chained without the key
/// (as a forger re-chains an edited one) fails that same command. Checked with no key at all, a
/// report says the key was not used.
#[tokio::test]
async fn an_export_is_verified_with_the_key_its_config_names() {
    let (tmp, _proxy, _up, genuine) = exported(Some("log-secret-key")).await;
    let (_tmp2, _proxy2, _up2, plain) = exported(None).await;
    let cfg = tmp.path().join("oncegate.toml");
    std::fs::write(&cfg, "[log]\nhmac_key_env = \"TEST_LOG_KEY\"\n").unwrap();
    let with_config = ["--config", cfg.to_str().unwrap()];
    let key = [("TEST_LOG_KEY", "log-secret-key")];
    let (ok, v) = verify_file(&write(tmp.path(), "genuine", &genuine), &with_config, &key);
    assert!(ok, "the genuine log verifies with its config's key: {v}");
    let (ok, v) = verify_file(&write(tmp.path(), "forged", &plain), &with_config, &key);
    assert!(!ok, "a log chained without the key fails: {v}");
    // The config names a key that is not set: refused, rather than checked without it.
    let out = cli(
        &[
            "log",
            "verify",
            "--file",
            tmp.path().join("genuine").to_str().unwrap(),
            "--config",
            cfg.to_str().unwrap(),
        ],
        &[],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("TEST_LOG_KEY"));
    // No key at all: the report says what that proves.
    let (ok, v) = verify_file(&write(tmp.path(), "plain", &plain), &[], &[]);
    assert!(ok, "{v}");
    assert!(v.to_string().contains("without an HMAC key"), "{v}");
}
