"""An MCP server for oncegate's tests, on the official Python SDK (PyPI `mcp`).

Every execution of a tool is appended to a ledger file (one JSON line), so a test counts what the
server really ran. Prints `PORT <n>` once it listens on 127.0.0.1 (port chosen by the OS).

    python server.py LEDGER [--stateful] [--json] [--resumable]

`--resumable` keeps every event in memory (an event store), so that a client can resume a stream
the server ended (`Last-Event-ID`, SEP-1699), which `polled_charge` does.
"""

import asyncio
import json
import os
import socket
import sys

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.streamable_http import EventMessage, EventStore
from mcp.types import ToolAnnotations

LEDGER = sys.argv[1]
STATEFUL = "--stateful" in sys.argv
JSON_RESPONSE = "--json" in sys.argv
RESUMABLE = "--resumable" in sys.argv

server = MCPServer("oncegate-test")


def ran(tool: str, **args) -> int:
    with open(LEDGER, "a", encoding="utf-8") as f:
        f.write(json.dumps({"tool": tool, "args": args}) + "\n")
    with open(LEDGER, encoding="utf-8") as f:
        return sum(1 for _ in f)


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def search(query: str) -> str:
    """Searches (a read)."""
    ran("search", query=query)
    return f"results for {query}"


@server.tool()
def send_email(to: str, subject: str) -> str:
    """Sends an email (a write)."""
    n = ran("send_email", to=to, subject=subject)
    return f"sent email #{n} to {to}"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def lying_read(note: str) -> str:
    """Marked read-only by its server, but writes: only trusted annotations make it a read."""
    n = ran("lying_read", note=note)
    return f"noted #{n}"


@server.tool()
def delete_everything(confirm: bool) -> str:
    """A tool the proxy's config denies."""
    ran("delete_everything", confirm=confirm)
    return "deleted"


@server.tool()
async def slow_charge(amount: int, seconds: float, gate: str = "") -> str:
    """Charges after a delay: the answer comes later than the proxy's timeout. With `gate`, the
    charge waits until that file exists instead (for `seconds` at most), so that a test decides
    when the answer comes whatever the machine's load."""
    if gate:
        deadline = asyncio.get_running_loop().time() + seconds
        while not os.path.exists(gate) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
    else:
        await asyncio.sleep(seconds)
    n = ran("slow_charge", amount=amount)
    return f"charged {amount} (#{n})"


@server.tool()
def toggle_feature() -> str:
    """Flips a switch: every call is a new effect (no arguments to tell calls apart)."""
    n = ran("toggle_feature")
    return f"toggled (#{n})"


@server.tool()
def start_session_log() -> str:
    """Starts this session's log stream: one effect per session."""
    n = ran("start_session_log")
    return f"session log started (#{n})"


@server.tool()
async def polled_charge(amount: int, ctx: Context) -> str:
    """Charges, after ending the call's stream for the client to resume (SEP-1699): the result
    is delivered on the stream the client resumes with Last-Event-ID."""
    await ctx.close_sse_stream()
    await asyncio.sleep(0.3)
    n = ran("polled_charge", amount=amount)
    return f"charged {amount} (#{n})"


class MemoryEvents(EventStore):
    """Every event of every stream, in memory, for resumption."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, object]] = []

    async def store_event(self, stream_id, message):
        event_id = str(len(self.events) + 1)
        self.events.append((event_id, stream_id, message))
        return event_id

    async def replay_events_after(self, last_event_id, send_callback):
        at = next((i for i, e in enumerate(self.events) if e[0] == last_event_id), None)
        if at is None:
            return None
        stream = self.events[at][1]
        for event_id, stream_id, message in self.events[at + 1 :]:
            if stream_id == stream and message is not None:
                await send_callback(EventMessage(message, event_id))
        return stream


@server.tool()
async def report(steps: int, ctx: Context) -> str:
    """Sends progress notifications, then its result."""
    for i in range(steps):
        await ctx.report_progress(i + 1, steps, f"step {i + 1}")
        await asyncio.sleep(0.05)
    n = ran("report", steps=steps)
    return f"report done (#{n})"


@server.tool()
def refuse(reason: str) -> str:
    """Fails: a tool result with isError."""
    ran("refuse", reason=reason)
    raise ValueError(f"refused: {reason}")


async def main() -> None:
    app = server.streamable_http_app(
        stateless_http=not STATEFUL,
        json_response=JSON_RESPONSE,
        event_store=MemoryEvents() if RESUMABLE else None,
        retry_interval=100 if RESUMABLE else None,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    await uvicorn.Server(config).serve(sockets=[sock])


asyncio.run(main())
