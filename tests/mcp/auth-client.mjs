// An MCP client that authorizes with OAuth, on the official TypeScript SDK, for the conformance
// suite's client scenarios (tests/conformance.rs). The suite runs it with the URL of its own
// server (behind its own authorization server, which approves at once) as the last argument.
// With ONCEGATE_BIN set, it starts oncegate in front of that server first and talks to the
// proxy instead: the suite then sees the client through oncegate.
//
//   node auth-client.mjs SERVER_URL
import { spawn } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { pathToFileURL } from "node:url";

const sdk = (p) =>
  import(pathToFileURL(path.join(process.env.ONCEGATE_MCP_NODE, "node_modules/@modelcontextprotocol/sdk/dist/esm", p)).href);
const { Client } = await sdk("client/index.js");
const { StreamableHTTPClientTransport } = await sdk("client/streamableHttp.js");
const { UnauthorizedError } = await sdk("client/auth.js");

const server = process.argv[process.argv.length - 1];

// oncegate in front of the server (/mcp → the server's URL), on ports of its own choosing: the
// address is read from its log, so that proxies started side by side never share one.
async function proxyFor(url) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "oncegate-auth-"));
  const config = path.join(dir, "oncegate.toml");
  fs.writeFileSync(
    config,
    `[server]\nlisten = "127.0.0.1:0"\n\n[admin]\nlisten = "127.0.0.1:0"\n\n` +
      `[store]\npath = "${path.join(dir, "store")}"\n\n` +
      `[[upstreams]]\nname = "server"\nprefix = "/mcp"\nurl = "${url}"\nprotocol = "mcp"\n`,
  );
  const child = spawn(process.env.ONCEGATE_BIN, ["run", "--config", config], {
    stdio: ["ignore", "ignore", "pipe"],
  });
  process.on("exit", () => child.kill());
  return await new Promise((resolve, reject) => {
    let log = "";
    const timer = setTimeout(() => reject(new Error(`oncegate did not start:\n${log}`)), 20000);
    child.stderr.on("data", (d) => {
      log += d;
      const m = log.match(/oncegate listening addr=([0-9.:]+)/);
      if (m) {
        clearTimeout(timer);
        resolve(`http://${m[1]}/mcp`);
      }
    });
  });
}

const url = process.env.ONCEGATE_BIN ? await proxyFor(server) : server;

// An OAuth client whose user approves at once: the authorization server's redirect carries the
// code, which the client takes without a browser.
class Provider {
  constructor() {
    this.info = undefined;
    this.saved = undefined;
    this.verifier = undefined;
    this.code = undefined;
  }
  get redirectUrl() {
    return "http://localhost:3000/callback";
  }
  get clientMetadata() {
    return {
      client_name: "oncegate-conformance",
      redirect_uris: ["http://localhost:3000/callback"],
      grant_types: ["authorization_code", "refresh_token"],
      response_types: ["code"],
      token_endpoint_auth_method: "client_secret_post",
    };
  }
  clientInformation() {
    return this.info;
  }
  saveClientInformation(info) {
    this.info = info;
  }
  tokens() {
    return this.saved;
  }
  saveTokens(tokens) {
    this.saved = tokens;
  }
  async redirectToAuthorization(authorizationUrl) {
    const r = await fetch(authorizationUrl, { redirect: "manual" });
    const to = r.headers.get("location");
    this.code = to ? new URL(to).searchParams.get("code") : undefined;
  }
  saveCodeVerifier(v) {
    this.verifier = v;
  }
  codeVerifier() {
    return this.verifier;
  }
}

const provider = new Provider();
const connect = async () => {
  const transport = new StreamableHTTPClientTransport(new URL(url), { authProvider: provider });
  const client = new Client({ name: "oncegate-conformance", version: "1.0.0" });
  try {
    await client.connect(transport);
    return client;
  } catch (e) {
    if (!(e instanceof UnauthorizedError) || !provider.code) throw e;
    await transport.finishAuth(provider.code);
    const again = new Client({ name: "oncegate-conformance", version: "1.0.0" });
    await again.connect(new StreamableHTTPClientTransport(new URL(url), { authProvider: provider }));
    return again;
  }
};

const client = await connect();
const { tools } = await client.listTools();
if (tools.length > 0) {
  await client.callTool({ name: tools[0].name, arguments: {} }).catch(() => {});
}
await client.close();
process.exit(0);
