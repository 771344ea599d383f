//! MCP test fixtures: the tests' MCP config, message builders, and the official SDKs' server
//! and clients (`tests/mcp/`), which need `ONCEGATE_PYTHON` and `ONCEGATE_MCP_NODE` (`.ci/run`
//! installs them).

use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use serde_json::{json, Value};

/// The tests' config (`support::config`) with its one upstream an MCP server, `tools` at
/// `/mcp`, whose duplicates wait for a running call; `extra` is appended to its table.
pub fn mcp_config(url: &str, extra: &str) -> String {
    let tools = r#"
[[upstreams.tools]]
name = "search"
class = "read"

[[upstreams.tools]]
name = "delete_*"
class = "deny"
"#;
    super::config(
        url,
        &format!("protocol = \"mcp\"\nin_flight_wait = \"5s\"\n{extra}\n{tools}"),
    )
    .replacen("name = \"pay\"", "name = \"tools\"", 1)
    .replacen("prefix = \"/pay\"", "prefix = \"/mcp\"", 1)
}

pub const JSON_SSE: &[(&str, &str)] = &[
    ("content-type", "application/json"),
    ("accept", "application/json, text/event-stream"),
];

pub fn call_body(id: u64, tool: &str, args: Value) -> String {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": tool, "arguments": args}})
        .to_string()
}

pub fn python() -> String {
    std::env::var("ONCEGATE_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| {
            panic!("this test needs ONCEGATE_PYTHON: a Python with the mcp SDK (as .ci/run makes)")
        })
}

pub fn script(name: &str) -> String {
    format!("{}/tests/mcp/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// The Python SDK's server, on a port of its own choosing, with its ledger of executions.
pub struct McpServer {
    child: Child,
    pub port: u16,
    ledger: PathBuf,
    pub tmp: tempfile::TempDir,
}

impl McpServer {
    pub fn start(flags: &[&str]) -> McpServer {
        let tmp = tempfile::tempdir().unwrap();
        let ledger = tmp.path().join("ledger.jsonl");
        let mut child = Command::new(python())
            .arg(script("server.py"))
            .arg(&ledger)
            .args(flags)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .unwrap_or_else(|| panic!("the MCP server did not start: {line:?}"))
            .parse()
            .unwrap();
        McpServer {
            child,
            port,
            ledger,
            tmp,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    /// How many times the server ran `tool`, by its own ledger.
    pub fn ran(&self, tool: &str) -> usize {
        std::fs::read_to_string(&self.ledger)
            .unwrap_or_default()
            .lines()
            .filter(|l| serde_json::from_str::<Value>(l).unwrap()["tool"] == tool)
            .count()
    }
}

impl Drop for McpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the Python SDK client against `url`: `tool` with `args`, plus `flags`; returns what it
/// printed.
pub async fn py_client_at(url: &str, tool: &str, args: Value, flags: &[&str]) -> Value {
    let mut cmd = Command::new(python());
    cmd.arg(script("client.py"))
        .arg(url)
        .arg(tool)
        .arg(args.to_string())
        .args(flags);
    run_client(cmd).await
}

pub async fn run_client(mut cmd: Command) -> Value {
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "the MCP client failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim().lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("client output is not JSON ({e}): {stdout}"))
}

/// The folder with the TypeScript SDK (`ONCEGATE_MCP_NODE`, as `.ci/run` makes it).
pub fn node_dir() -> String {
    std::env::var("ONCEGATE_MCP_NODE").unwrap_or_else(|_| {
        panic!("this test needs ONCEGATE_MCP_NODE: a folder with @modelcontextprotocol/sdk installed (as .ci/run makes)")
    })
}

/// The TypeScript SDK's client (`tests/mcp/client.mjs`): `tool` with `args` at `url`, then
/// `more` arguments (how many calls, their timeouts).
pub fn ts_client(url: &str, tool: &str, args: &Value, more: &[&str]) -> Command {
    let mut cmd = Command::new("node");
    cmd.arg(script("client.mjs"))
        .arg(url)
        .arg(tool)
        .arg(args.to_string())
        .args(more)
        .env("ONCEGATE_MCP_NODE", node_dir());
    cmd
}
