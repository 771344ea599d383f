// An MCP client for oncegate's tests, on the official TypeScript SDK (npm
// @modelcontextprotocol/sdk, installed in $ONCEGATE_MCP_NODE by .ci/run).
//
//   node client.mjs URL TOOL ARGS_JSON [CALLS] [TIMEOUTS_MS_JSON]
//
// Calls the tool CALLS times on one connection (each call a new JSON-RPC id, as a resend is) and
// prints what the model would see, as one JSON line. TIMEOUTS_MS_JSON (`[1000, 20000]`) gives
// each call the SDK's own request timeout: when it fires, the SDK sends
// `notifications/cancelled` and the call's entry holds the error.
import path from "node:path";
import { pathToFileURL } from "node:url";

const sdk = (p) =>
  import(pathToFileURL(path.join(process.env.ONCEGATE_MCP_NODE, "node_modules/@modelcontextprotocol/sdk/dist/esm", p)).href);
const { Client } = await sdk("client/index.js");
const { StreamableHTTPClientTransport } = await sdk("client/streamableHttp.js");

const [url, tool, args, calls = "1", timeouts = "[]"] = process.argv.slice(2);
const timeoutOf = JSON.parse(timeouts);
const client = new Client({ name: "oncegate-test", version: "1.0.0" });
await client.connect(new StreamableHTTPClientTransport(new URL(url)));
const out = { calls: [] };
for (let i = 0; i < Number(calls); i++) {
  const options = timeoutOf[i] ? { timeout: timeoutOf[i] } : undefined;
  let r;
  try {
    r = await client.callTool({ name: tool, arguments: JSON.parse(args) }, undefined, options);
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
await client.close();
console.log(JSON.stringify(out));
