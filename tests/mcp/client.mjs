// An MCP client for oncegate's tests, on the official TypeScript SDK, installed in
// $ONCEGATE_MCP_NODE by .ci/run: @modelcontextprotocol/sdk 1.x (revision 2025-11-25) and
// @modelcontextprotocol/client 2.x (which also speaks 2026-07-28).
//
//   node client.mjs URL TOOL ARGS_JSON [CALLS] [TIMEOUTS_MS_JSON] [SDK]
//
// Calls the tool CALLS times on one connection (each call a new JSON-RPC id, as a resend is) and
// prints what the model would see, as one JSON line, with the revision the client negotiated.
// TIMEOUTS_MS_JSON (`[1000, 20000]`) gives each call the SDK's own request timeout: when it fires,
// the SDK abandons the call (at 2025-11-25 it sends `notifications/cancelled`; at 2026-07-28 it
// closes the call's stream) and the call's entry holds the error. SDK is `v1` (the default), or
// `v2-legacy` / `v2-auto` for the 2.x client with that version negotiation mode (`auto` probes
// `server/discover` and takes 2026-07-28 where the server offers it).
import path from "node:path";
import { pathToFileURL } from "node:url";

const [url, tool, args, calls = "1", timeouts = "[]", sdkName = "v1"] = process.argv.slice(2);
const modules = path.join(process.env.ONCEGATE_MCP_NODE, "node_modules/@modelcontextprotocol");
const load = (p) => import(pathToFileURL(path.join(modules, p)).href);

let client, transport;
const info = { name: "oncegate-test", version: "1.0.0" };
if (sdkName === "v1") {
  const { Client } = await load("sdk/dist/esm/client/index.js");
  const { StreamableHTTPClientTransport } = await load("sdk/dist/esm/client/streamableHttp.js");
  client = new Client(info);
  transport = new StreamableHTTPClientTransport(new URL(url));
} else {
  const mode = sdkName.replace(/^v2-/, "");
  const { Client, StreamableHTTPClientTransport } = await load("client/dist/index.mjs");
  client = new Client(info, { versionNegotiation: { mode } });
  transport = new StreamableHTTPClientTransport(new URL(url));
}
await client.connect(transport);
const timeoutOf = JSON.parse(timeouts);
const out = { calls: [] };
for (let i = 0; i < Number(calls); i++) {
  const options = timeoutOf[i] ? { timeout: timeoutOf[i] } : undefined;
  let r;
  try {
    r = sdkName === "v1"
      ? await client.callTool({ name: tool, arguments: JSON.parse(args) }, undefined, options)
      : await client.callTool({ name: tool, arguments: JSON.parse(args) }, options);
  } catch (e) {
    out.calls.push({ error: String(e.message ?? e) });
    continue;
  }
  out.calls.push({
    is_error: Boolean(r.isError),
    text: r.content.filter((c) => c.type === "text").map((c) => c.text).join(" "),
    structured: r.structuredContent ?? null,
  });
}
out.protocol_version = client.getNegotiatedProtocolVersion?.() ?? transport.protocolVersion ?? null;
await client.close();
console.log(JSON.stringify(out));
