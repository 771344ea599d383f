"""An MCP client for oncegate's tests, on the official Python SDK (PyPI `mcp`).

Calls one tool through the proxy and prints what the model would see, as one JSON line:

    python client.py URL TOOL ARGS_JSON [--meta JSON] [--header NAME=VALUE]... [--progress]
                     [--mode auto|legacy] [--list] [--calls N] [--read-timeout SECONDS]
                     [--read-timeouts JSON]

`--calls N` calls the tool N times on one connection (each call gets a new JSON-RPC id, as an
agent's resend does). `--list` lists the tools first (as an agent does before calling).
`--read-timeouts [0.8, 20]` gives each call its own timeout (seconds); when one fires, the SDK
abandons the call: at 2025-11-25 it sends `notifications/cancelled`, at 2026-07-28 it closes the
call's stream.
"""

import argparse
import asyncio
import json
from datetime import timedelta  # noqa: F401  (kept for older SDKs' signatures)

from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("tool")
    p.add_argument("args")
    p.add_argument("--meta")
    p.add_argument("--header", action="append", default=[])
    p.add_argument("--progress", action="store_true")
    p.add_argument("--mode", default="auto")
    p.add_argument("--list", action="store_true")
    p.add_argument("--calls", type=int, default=1)
    p.add_argument("--read-timeout", type=float)
    p.add_argument("--read-timeouts", default="[]")
    a = p.parse_args()
    headers = dict(h.split("=", 1) for h in a.header)
    http = create_mcp_http_client(headers=headers)
    progress: list[float] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(value)

    out = {"calls": []}
    async with http:
        transport = streamable_http_client(a.url, http_client=http, terminate_on_close=False)
        async with Client(transport, mode=a.mode) as client:
            if a.list:
                tools = await client.list_tools()
                out["tools"] = sorted(t.name for t in tools.tools)
            timeouts = json.loads(a.read_timeouts)
            for i in range(a.calls):
                try:
                    r = await client.call_tool(
                        a.tool,
                        json.loads(a.args),
                        read_timeout_seconds=timeouts[i] if i < len(timeouts) else a.read_timeout,
                        progress_callback=on_progress if a.progress else None,
                        meta=json.loads(a.meta) if a.meta else None,
                    )
                    text = " ".join(c.text for c in r.content if getattr(c, "type", "") == "text")
                    out["calls"].append(
                        {
                            "is_error": bool(r.is_error),
                            "text": text,
                            "structured": r.structured_content,
                        }
                    )
                except Exception as e:  # the SDK's own error (a JSON-RPC error, a timeout)
                    out["calls"].append({"exception": f"{type(e).__name__}: {e}"})
            out["protocol_version"] = client.protocol_version
    out["progress"] = progress
    print(json.dumps(out))


asyncio.run(main())
