//! The official MCP conformance suite (npm `@modelcontextprotocol/conformance`, pinned by
//! `.ci/run`) against the reference server (`@modelcontextprotocol/server-everything`, pinned),
//! directly and through oncegate configured three ways: every tool a read, some reads and some
//! writes, every tool a write (issue 57, SPEC §14.6). Every check must come out through oncegate
//! as it does direct, except where oncegate is stricter by SPEC (listed below with its clause).
//! Writes happen at most once: that is the other tests' business.
//!
//! Needs `ONCEGATE_CONFORMANCE`: a folder whose `node_modules` holds node 22 (npm `node@22`),
//! the suite (0.1.16, and 0.2.0-alpha.12 as `conformance-next`) and the server, as `.ci/run`
//! installs them.
#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::TestProxy;

/// Checks whose result through oncegate may differ from direct, because oncegate is stricter by
/// SPEC: (scenario, check, direct, through oncegate, clause).
const STRICTER: &[(&str, &str, &str, &str, &str)] = &[(
    "dns-rebinding-protection",
    "localhost-host-rebinding-rejected",
    "FAILURE",
    "SUCCESS",
    "SPEC §14.6: the proxy makes the server's DNS rebinding check in its place",
)];

fn tools_dir() -> PathBuf {
    let dir = std::env::var("ONCEGATE_CONFORMANCE").unwrap_or_else(|_| {
        panic!("this test needs ONCEGATE_CONFORMANCE: a folder with node@22, @modelcontextprotocol/conformance and @modelcontextprotocol/server-everything installed (as .ci/run makes)")
    });
    PathBuf::from(dir).join("node_modules")
}

/// PATH with node 22 first.
fn path_with_node(modules: &Path) -> String {
    format!(
        "{}:{}",
        modules.join(".bin").display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

struct Everything(Child, u16);

impl Drop for Everything {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The reference server over Streamable HTTP, on a free port.
fn everything(modules: &Path) -> Everything {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(modules.join(".bin/node"))
        .arg(modules.join("@modelcontextprotocol/server-everything/dist/index.js"))
        .arg("streamableHttp")
        .env("PORT", port.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = Everything(child, port);
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return server;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("server-everything did not listen on {port}");
}

/// Every check of every scenario (`--suite all`) against `url`: (scenario, check) → the
/// results, in order (a check id may repeat); INFO rows are traces, not results, and are left
/// out.
async fn run_suite(
    modules: &Path,
    suite: &str,
    url: &str,
) -> BTreeMap<(String, String), Vec<String>> {
    let out = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(modules.join(".bin/node"));
    cmd.arg(modules.join(suite).join("dist/index.js"))
        .args(["server", "--suite", "all", "--url", url, "-o"])
        .arg(out.path())
        .env("PATH", path_with_node(modules))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let ran = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let mut checks: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for entry in std::fs::read_dir(out.path()).unwrap() {
        let dir = entry.unwrap().path();
        // `server-<scenario>-<timestamp>`, the timestamp `-2026-12-06T11-18-20-123Z`.
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let bare = name.strip_prefix("server-").unwrap_or(&name);
        let scenario = bare[..bare.len().saturating_sub(25)].to_string();
        let Ok(text) = std::fs::read_to_string(dir.join("checks.json")) else {
            continue;
        };
        let rows: Vec<Value> = serde_json::from_str(&text).unwrap();
        for row in rows {
            let status = row["status"].as_str().unwrap_or("").to_string();
            if status == "INFO" {
                continue;
            }
            let id = row["id"].as_str().unwrap_or("").to_string();
            checks
                .entry((scenario.clone(), id))
                .or_default()
                .push(status);
        }
    }
    assert!(
        checks.len() > 20,
        "the suite ran ({} checks): {}\n{}",
        checks.len(),
        String::from_utf8_lossy(&ran.stdout),
        String::from_utf8_lossy(&ran.stderr)
    );
    checks
}

fn config(server: u16, tools: &str) -> String {
    format!(
        r#"[server]
listen = "127.0.0.1:0"

[admin]
listen = "127.0.0.1:0"

[[upstreams]]
name = "everything"
prefix = "/mcp"
url = "http://127.0.0.1:{server}/mcp"
protocol = "mcp"
timeout = "20s"
{tools}
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the MCP conformance suite and node 22 (ONCEGATE_CONFORMANCE; .ci/run installs them)"]
async fn the_conformance_suite_sees_the_server_through_oncegate_as_it_does_direct() {
    let modules = tools_dir();
    let server = everything(&modules);
    // The suite's release (0.1.16) and its preview of revision 2026-07-28 (0.2.0-alpha.12).
    for suite in ["@modelcontextprotocol/conformance", "conformance-next"] {
        the_same_through_oncegate(&modules, suite, server.1).await;
    }
}

async fn the_same_through_oncegate(modules: &Path, suite: &str, server: u16) {
    let direct = run_suite(modules, suite, &format!("http://127.0.0.1:{server}/mcp")).await;
    let passed = direct
        .values()
        .flatten()
        .filter(|s| *s == "SUCCESS")
        .count();
    eprintln!("{suite}: {} checks direct, {passed} passed", direct.len());
    let configurations = [
        (
            "every tool a read",
            "\n[[upstreams.tools]]\nname = \"*\"\nclass = \"read\"\n",
        ),
        (
            "mixed",
            "\n[[upstreams.tools]]\nname = \"get-*\"\nclass = \"read\"\n\n[[upstreams.tools]]\nname = \"echo\"\nclass = \"read\"\n",
        ),
        ("every tool a write", ""),
    ];
    let mut differences = Vec::new();
    for (name, tools) in configurations {
        let proxy = TestProxy::start(&config(server, tools)).await;
        let through = run_suite(modules, suite, &proxy.url("/mcp")).await;
        proxy.stop().await;
        for key in direct.keys().chain(through.keys()) {
            let (d, t) = (direct.get(key), through.get(key));
            if d == t {
                continue;
            }
            let allowed = STRICTER.iter().any(|(s, c, dd, tt, _)| {
                (key.0.as_str(), key.1.as_str()) == (*s, *c)
                    && d.is_some_and(|d| d.iter().all(|x| x == dd))
                    && t.is_some_and(|t| t.iter().all(|x| x == tt))
            });
            if !allowed {
                differences.push(format!(
                    "{name}: {}/{}: direct {d:?}, through oncegate {t:?}",
                    key.0, key.1
                ));
            }
        }
    }
    differences.dedup();
    assert!(
        differences.is_empty(),
        "checks that differ through oncegate:\n{}",
        differences.join("\n")
    );
}
