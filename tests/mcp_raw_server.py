"""A raw JSON-RPC MCP server over stdio, for tests/test_mcp_transport.py:
`python tests/mcp_raw_server.py`. It writes bytes the SDK's server never
would, one behaviour per tool:

- `emoji_cut`: a result whose text ends with a lone surrogate escape
  (`"\\ud83d"`, what JavaScript's `JSON.stringify` writes for a string cut
  mid-emoji);
- `badutf8`: a notification line that is not UTF-8, then a result;
- `bigline`: a notification line of `RAW_BIG` bytes, then a result;
- `garbage`: a line that is no JSON, then a result;
- `closeout`: closes its stdout and sleeps (never exits by itself);
- `spawn`: starts a `sleep` in its process group and answers with its pid;
- `lists`: how many `resources/list` requests it answered.

The prompt `cut` has a lone surrogate escape too; the prompt `hang` is never
answered. `resources/list` lists `RAW_RESOURCES` resources (`raw://r/0`,
...) and one with a URI of 5,011 characters, with a next cursor every time
when `RAW_ENDLESS` is set. On stdin's end, it writes
`RAW_FLUSH` notifications (blocking on a full pipe unless they are read),
then creates the file `RAW_MARKER` names, and exits with 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OUT = sys.stdout.buffer
TOOLS = ("emoji_cut", "badutf8", "bigline", "garbage", "closeout", "spawn", "lists")
LONG_URI = "raw://long/" + "x" * 5000


def send(message: dict[str, Any]) -> None:
    write(json.dumps(message).encode())


def write(line: bytes) -> None:
    OUT.write(line + b"\n")
    OUT.flush()


def answer(id_: Any, result: dict[str, Any]) -> None:
    send({"jsonrpc": "2.0", "id": id_, "result": result})


def text(value: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": value}], "isError": False}


def note(data: str) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "method": "notifications/message",
        "params": {"level": "info", "data": data},
    }


CUT = b"cut \\ud83d"  # the JSON escape of a lone high surrogate, as bytes


def call(id_: Any, name: str, state: dict[str, int]) -> None:
    if name == "emoji_cut":
        write(
            b'{"jsonrpc":"2.0","id":%s,"result":{"content":[{"type":"text","text":"%s"}],'
            b'"isError":false}}' % (json.dumps(id_).encode(), CUT)
        )
    elif name == "badutf8":
        write(
            b'{"jsonrpc":"2.0","method":"notifications/message","params":'
            b'{"level":"info","data":"\xff\xfe"}}'
        )
        answer(id_, text("badutf8 done"))
    elif name == "bigline":
        send(note("B" * int(os.environ.get("RAW_BIG", "100000"))))
        answer(id_, text("bigline done"))
    elif name == "garbage":
        write(b"{not json")
        answer(id_, text("garbage done"))
    elif name == "closeout":
        os.close(1)
        time.sleep(3600)
    elif name == "spawn":
        child = subprocess.Popen(
            ["sleep", "3600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        answer(id_, text(str(child.pid)))
    elif name == "lists":
        answer(id_, text(str(state["lists"])))


def handle(message: dict[str, Any], state: dict[str, int]) -> None:
    method = message.get("method")
    id_ = message.get("id")
    if id_ is None:
        return
    params = message.get("params") or {}
    if method == "initialize":
        answer(
            id_,
            {
                "protocolVersion": params["protocolVersion"],
                "capabilities": {"tools": {}, "resources": {}, "prompts": {}},
                "serverInfo": {"name": "raw", "version": "1"},
            },
        )
    elif method == "tools/list":
        answer(
            id_,
            {"tools": [{"name": n, "inputSchema": {"type": "object"}} for n in TOOLS]},
        )
    elif method == "tools/call":
        call(id_, params["name"], state)
    elif method == "resources/list":
        state["lists"] += 1
        count = int(os.environ.get("RAW_RESOURCES", "3"))
        listed = [{"uri": f"raw://r/{k}", "name": f"r{k}"} for k in range(count)]
        listed.append({"uri": LONG_URI, "name": "long"})
        page: dict[str, Any] = {"resources": listed}
        if os.environ.get("RAW_ENDLESS"):
            page["nextCursor"] = str(state["lists"])
        answer(id_, page)
    elif method == "resources/read":
        uri = params["uri"]
        answer(id_, {"contents": [{"uri": uri, "text": f"content of {uri}"}]})
    elif method == "prompts/get":
        if params["name"] == "cut":
            write(
                b'{"jsonrpc":"2.0","id":%s,"result":{"messages":[{"role":"user",'
                b'"content":{"type":"text","text":"%s"}}]}}'
                % (json.dumps(id_).encode(), CUT)
            )
        # `hang` is never answered.
    else:
        send({"jsonrpc": "2.0", "id": id_, "error": {"code": -32601, "message": "no"}})


def main() -> None:
    state = {"lists": 0}
    for line in sys.stdin.buffer:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        handle(message, state)
    for _ in range(int(os.environ.get("RAW_FLUSH", "0"))):
        send(note("bye" * 30))
    marker = os.environ.get("RAW_MARKER")
    if marker:
        Path(marker).write_text("exited by itself")


if __name__ == "__main__":
    main()
