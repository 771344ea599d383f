//! The operator's commands (SPEC §10.3): `oncegate actions …` and `oncegate log …` speak to the
//! admin API; `oncegate log verify --file` checks an export offline. Each returns the text to
//! print, or an error message; `main` turns them into exit codes.

use std::path::Path;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

use crate::log::{parse_export, verify, Chain, Verification, GENESIS};

/// Where the admin API is and how to authenticate.
#[derive(Debug, Clone)]
pub struct AdminClient {
    pub base: String,
    pub token: Option<String>,
    /// The variable the token was read from, named when the API refuses it.
    pub token_env: String,
}

impl AdminClient {
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(StatusCode, Bytes), String> {
        let url = format!("{}{}", self.base.trim_end_matches('/'), path);
        let mut req = Request::builder().method(method).uri(&url);
        if let Some(t) = &self.token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let body = match body {
            Some(v) => {
                req = req.header("content-type", "application/json");
                Bytes::from(serde_json::to_vec(&v).map_err(|e| e.to_string())?)
            }
            None => Bytes::new(),
        };
        let req = req
            .body(Full::new(body))
            .map_err(|e| format!("{url}: {e}"))?;
        let client = Client::builder(TokioExecutor::new()).build_http();
        let resp = client
            .request(req)
            .await
            .map_err(|e| format!("cannot reach the admin API at {}: {e}", self.base))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, body))
    }

    /// Calls and parses JSON; a non-2xx answer becomes an error with the problem's detail.
    pub(crate) async fn json(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, String> {
        let (status, bytes) = self.call(method, path, body).await?;
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if status == StatusCode::UNAUTHORIZED {
            let why = if self.token.is_some() {
                "the token in it was refused"
            } else {
                "it is not set here"
            };
            return Err(format!(
                "admin API answered {status}: set {} to the proxy's admin token ({why})",
                self.token_env
            ));
        }
        if !status.is_success() {
            let detail = v["detail"].as_str().unwrap_or("");
            return Err(format!("admin API answered {status}: {detail}"));
        }
        Ok(v)
    }
}

fn enc(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// Filters of `actions list`.
#[derive(Debug, Default, Clone)]
pub struct ListArgs {
    pub state: Option<String>,
    pub upstream: Option<String>,
    pub task: Option<String>,
    pub limit: Option<usize>,
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A plain text table: columns padded to their widest cell.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    out.push('\n');
    for r in rows {
        out.push_str(&line(r.clone()));
        out.push('\n');
    }
    out
}

pub async fn actions_list(c: &AdminClient, a: &ListArgs, as_json: bool) -> Result<String, String> {
    let mut q = Vec::new();
    for (k, v) in [
        ("state", &a.state),
        ("upstream", &a.upstream),
        ("task", &a.task),
    ] {
        if let Some(v) = v {
            q.push(format!("{k}={}", enc(v)));
        }
    }
    if let Some(l) = a.limit {
        q.push(format!("limit={l}"));
    }
    let v = c
        .json(Method::GET, &format!("/v1/actions?{}", q.join("&")), None)
        .await?;
    if as_json {
        return Ok(format!("{v:#}\n"));
    }
    let rows: Vec<Vec<String>> = v["actions"]
        .as_array()
        .map(|a| a.as_slice())
        .unwrap_or_default()
        .iter()
        .map(|a| {
            vec![
                s(&a["id"]),
                s(&a["state"]),
                s(&a["upstream"]),
                match a["tool"].as_str() {
                    // An MCP tool call: the tool says what it was.
                    Some(tool) => format!("tools/call {tool}"),
                    None => format!("{} {}", s(&a["method"]), s(&a["path"])),
                },
                match (&a["task"], &a["step"]) {
                    (Value::Null, _) => "-".into(),
                    (t, st) => format!("{}/{}", s(t), s(st)),
                },
                s(&a["attempts"]),
                s(&a["updated_at"]),
            ]
        })
        .collect();
    let mut out = table(
        &[
            "ID",
            "STATE",
            "UPSTREAM",
            "REQUEST",
            "TASK/STEP",
            "ATTEMPTS",
            "UPDATED",
        ],
        &rows,
    );
    if let Some(next) = v["next"].as_str() {
        out.push_str(&format!("(more: --after {next})\n"));
    }
    Ok(out)
}

fn describe(v: &Value) -> String {
    let mut out = String::new();
    for k in [
        "id",
        "state",
        "upstream",
        "method",
        "path",
        "key",
        "task",
        "step",
        "attempts",
        "external_id",
        "principal",
        "created_at",
        "updated_at",
        "expires_at",
    ] {
        out.push_str(&format!("{k:<12} {}\n", s(&v[k])));
    }
    if let Some(r) = v["resolution"].as_object() {
        out.push_str(&format!(
            "resolution   {} by {} at {}: {}\n",
            s(&r["outcome"]),
            s(&r["actor"]),
            s(&r["at"]),
            s(&r["reason"])
        ));
    }
    for a in v["evidence"]
        .as_array()
        .map(|a| a.as_slice())
        .unwrap_or_default()
    {
        out.push_str(&format!(
            "attempt {} ({}):\n",
            s(&a["attempt"]),
            s(&a["state"])
        ));
        for t in a["tries"]
            .as_array()
            .map(|a| a.as_slice())
            .unwrap_or_default()
        {
            out.push_str(&format!(
                "  {} phase={} status={} error={}\n",
                s(&t["at"]),
                s(&t["phase"]),
                s(&t["status"]),
                s(&t["error"])
            ));
        }
    }
    out
}

pub async fn actions_show(c: &AdminClient, id: &str, as_json: bool) -> Result<String, String> {
    let v = c
        .json(Method::GET, &format!("/v1/actions/{}", enc(id)), None)
        .await?;
    Ok(if as_json {
        format!("{v:#}\n")
    } else {
        describe(&v)
    })
}

pub async fn actions_resolve(
    c: &AdminClient,
    id: &str,
    outcome: &str,
    reason: &str,
    external_id: Option<&str>,
    as_json: bool,
) -> Result<String, String> {
    let body = json!({"outcome": outcome, "reason": reason, "external_id": external_id});
    let v = c
        .json(
            Method::POST,
            &format!("/v1/actions/{}/resolve", enc(id)),
            Some(body),
        )
        .await?;
    Ok(if as_json {
        format!("{v:#}\n")
    } else {
        format!("resolved {id}: now {}\n", s(&v["state"]))
    })
}

pub async fn actions_lookup(c: &AdminClient, id: &str, as_json: bool) -> Result<String, String> {
    let v = c
        .json(
            Method::POST,
            &format!("/v1/actions/{}/lookup", enc(id)),
            // The admin API takes POST bodies as JSON only (a web page cannot forge one).
            Some(serde_json::json!({})),
        )
        .await?;
    Ok(if as_json {
        format!("{v:#}\n")
    } else {
        let mut out = format!("lookup of {id}: {}\n", s(&v["result"]));
        if let Some(d) = v["detail"].as_str() {
            out.push_str(&format!("  {d}\n"));
        }
        out
    })
}

/// The whole log (or from `after`), as NDJSON.
pub async fn log_export(c: &AdminClient, after: u64) -> Result<String, String> {
    let mut out = String::new();
    let mut after = after;
    loop {
        let (status, body) = c
            .call(
                Method::GET,
                &format!("/v1/log?after={after}&limit=10000"),
                None,
            )
            .await?;
        if !status.is_success() {
            return Err(format!(
                "admin API answered {status}: {}",
                String::from_utf8_lossy(&body)
            ));
        }
        let text = String::from_utf8_lossy(&body).into_owned();
        let mut last = None;
        for line in text.lines().filter(|l| !l.is_empty()) {
            last = serde_json::from_str::<Value>(line)
                .ok()
                .and_then(|v| v["seq"].as_u64());
            out.push_str(line);
            out.push('\n');
        }
        match last {
            Some(seq) => after = seq,
            None => return Ok(out),
        }
    }
}

pub async fn log_verify_remote(c: &AdminClient) -> Result<(bool, String), String> {
    let v = c.json(Method::GET, "/v1/log/verify", None).await?;
    Ok((v["ok"] == true, format!("{v:#}\n")))
}

/// Checks an export offline. `expect_head` is `SEQ:HASH` recorded earlier (an anchor kept
/// elsewhere): the export must still hold that entry unchanged, which detects a cut tail.
pub fn log_verify_file(
    path: &Path,
    hmac_key: Option<Vec<u8>>,
    expect_head: Option<&str>,
) -> Result<(bool, String), String> {
    // A folder is an archive (`oncegate log archive`): its files in name order are one chain.
    let text = if path.is_dir() {
        let mut all = String::new();
        for f in crate::archive::files(path)? {
            all.push_str(
                &std::fs::read_to_string(&f).map_err(|e| format!("{}: {e}", f.display()))?,
            );
        }
        all
    } else {
        std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?
    };
    let entries = parse_export(&text);
    let anchor = match entries.first() {
        Some(Ok(e)) if e.seq != 1 => Some((e.seq, e.prev.clone())),
        _ => Some((1, GENESIS.to_string())),
    };
    let keyed = hmac_key.is_some();
    let chain = Chain::new(hmac_key);
    let Verification {
        ok,
        entries: n,
        head_seq,
        head,
        first_bad_seq,
        reason,
    } = verify(&chain, entries.iter().cloned(), anchor.clone());
    let mut ok = ok;
    let mut notes: Vec<String> = reason.into_iter().collect();
    if !keyed {
        // A log written with a key and rewritten without one chains as well as the genuine
        // one does without the key: only the key tells them apart.
        notes.push(
            "checked without an HMAC key: a log written with log.hmac_key_env is proven only with that key (--config or --hmac-key-env)".into(),
        );
    }
    if n == 0 && first_bad_seq.is_none() {
        // Nothing was checked: an emptied file must not pass for a verified log.
        ok = false;
        notes.push("the file holds no entries: there is nothing to verify".into());
    }
    if let Some((seq, _)) = anchor.filter(|(s, _)| *s != 1) {
        notes.push(format!(
            "the export starts at seq {seq}; earlier entries are not checked"
        ));
    }
    if let Some(expect) = expect_head {
        let (seq, hash) = expect
            .split_once(':')
            .and_then(|(s, h)| s.parse::<u64>().ok().map(|s| (s, h.to_string())))
            .ok_or_else(|| format!("--expect-head {expect:?}: expected SEQ:HASH"))?;
        let found = entries
            .iter()
            .filter_map(|e| e.as_ref().ok())
            .find(|e| e.seq == seq);
        match found {
            Some(e) if e.hash == hash => notes.push(format!("anchored head {seq} is present")),
            Some(_) => {
                ok = false;
                notes.push(format!(
                    "entry {seq} does not have the anchored hash: history was rewritten"
                ));
            }
            None => {
                ok = false;
                notes.push(format!(
                    "entry {seq} (the anchored head) is missing: the log was cut at {head_seq}"
                ));
            }
        }
    }
    let report = json!({
        "ok": ok,
        "entries": n,
        "head": head,
        "head_seq": head_seq,
        "first_bad_seq": first_bad_seq,
        "notes": notes,
    });
    Ok((ok, format!("{report:#}\n")))
}
