"""The stdio transport and the toolset against a server that misbehaves at
the byte level (tests/mcp_raw_server.py): lines that are not JSON, not UTF-8,
too long, or hold a lone surrogate escape; a server that closes its stdout,
leaves children, or writes as it exits; requests that are never answered;
listings without end."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import mcp
import pytest
from structlog.typing import EventDict

from agentfsm import Runtime
from agentfsm.exceptions import ConfigurationError, ToolError
from agentfsm.mcp import MCPRequestError, MCPToolset, mcp_tools
from agentfsm.mcp import _stdio as stdio
from agentfsm.mcp._progress import payload
from agentfsm.mcp._resources import READABLE, Readable

RAW = Path(__file__).with_name("mcp_raw_server.py")

pytestmark = pytest.mark.e2e


def raw(**env: str) -> mcp.StdioServerParameters:
    return mcp.StdioServerParameters(command=sys.executable, args=[str(RAW)], env=env)


def named(tools: MCPToolset, name: str) -> Any:
    return next(t for t in tools if t.name == name)


def dropped(log_output: list[EventDict]) -> list[EventDict]:
    return [e for e in log_output if e["event"] == "mcp_line_dropped"]


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting to be reaped does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


# ------------------------------------------------------- what is read


async def test_a_lone_surrogate_escape_is_read_escaped() -> None:
    """A reply with `\\ud83d` (valid JSON that pydantic's parser refuses) is
    read, the surrogate escaped as text, for a call and for a prompt."""
    async with Runtime():
        tools = await mcp_tools(raw(), name="raw")
        with anyio.fail_after(20):
            result = await named(tools, "emoji_cut").invoke({})
            prompt = await tools.get_prompt("cut")
    assert (result.output, result.is_error) == ("cut \\ud83d", False)
    assert prompt.messages[0].content.text == "cut \\ud83d"  # type: ignore[union-attr]


async def test_lines_not_read_are_logged_and_the_session_goes_on(
    log_output: list[EventDict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line that is no JSON, one that is not UTF-8 and one over
    `LINE_BYTES` are each logged (escaped, quoted short) and dropped; the
    session goes on and the calls are answered."""
    monkeypatch.setattr(stdio, "LINE_BYTES", 50_000)
    async with Runtime():
        tools = await mcp_tools(raw(RAW_BIG="100000"), name="raw")
        with anyio.fail_after(20):
            answers = [
                (await named(tools, name).invoke({})).output
                for name in ("garbage", "badutf8", "bigline")
            ]
    assert answers == ["garbage done", "badutf8 done", "bigline done"]
    logged = dropped(log_output)
    assert [e["why"].split(" (")[0] for e in logged] == [
        "it is no JSON-RPC message",
        "it is not utf-8",
        "it is longer than 50,000 bytes",
    ]
    assert logged[0]["line"] == "{not json"
    assert "\\xff\\xfe" in logged[1]["line"]
    assert all(e["server"] == "raw" and len(e["line"]) <= 200 for e in logged)


@pytest.mark.parametrize(
    ("chunks", "drops"),
    [
        ([b"ab\ncd\n"], 0),
        ([b"a", b"b\nc", b"d\n"], 0),
        ([b"ab\n", b"x" * 30, b"y" * 30, b"\ncd\n"], 1),  # long, across chunks
        ([b"ab\n" + b"x" * 61 + b"\ncd"], 1),  # long, in one; no last newline
    ],
)
async def test_lines_are_split_across_chunks(
    chunks: list[bytes], drops: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines are found across chunk boundaries; one over `LINE_BYTES` is
    dropped whether it came in one chunk or many."""
    monkeypatch.setattr(stdio, "LINE_BYTES", 40)
    why: list[str] = []

    async def stream() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    lines = stdio._lines(stream(), lambda reason, _: why.append(reason))  # type: ignore[arg-type]
    assert [line async for line in lines] == [b"ab", b"cd"]
    assert why == ["it is longer than 40 bytes"] * drops


# ------------------------------------------------ the toolset's requests


async def test_a_request_never_answered_times_out() -> None:
    """The toolset's own request has `request_timeout`: one the server never
    answers fails, naming the server and the request."""
    async with Runtime():
        tools = await mcp_tools(raw(), name="raw")
        # Lowered once connected: the connection's own tools/list, on a loaded
        # machine, could take longer than the half second meant for `hang`.
        tools._request_timeout = 0.5
        with anyio.fail_after(20), pytest.raises(MCPRequestError) as caught:
            await tools.get_prompt("hang")
    assert str(caught.value) == (
        "MCP server raw did not answer the prompts/get request within 0.5s "
        "(request_timeout)"
    )


def test_request_timeout_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="request_timeout must be a positive"):
        MCPToolset(str(RAW), request_timeout=0)


# ----------------------------------------------------- how a server ends


async def test_a_server_that_closes_stdout_is_said_so() -> None:
    """A server that closes its stdout and keeps running is stopped by
    agentfsm: the call says what the server did, not the signal it got."""
    async with Runtime():
        tools = await mcp_tools(raw(), name="raw")
        with anyio.fail_after(30), pytest.raises(ToolError) as caught:
            await named(tools, "closeout").invoke({})
    assert str(caught.value) == (
        "MCP server raw is not running: it closed its stdout while still "
        "running (agentfsm then stopped it)"
    )


async def test_a_server_writing_as_it_exits_exits_by_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output written on stdin's end is read and dropped: a server flushing
    more than a pipe holds exits by itself, not by a signal."""
    # A grace long enough for a loaded machine: only a server whose output
    # is not read never gets to exit by itself.
    monkeypatch.setattr(stdio, "_GRACE", 60.0)
    marker = tmp_path / "exited"
    async with Runtime():
        await mcp_tools(raw(RAW_FLUSH="20000", RAW_MARKER=str(marker)), name="raw")
    assert marker.read_text() == "exited by itself"


async def test_children_in_the_servers_group_are_stopped() -> None:
    """A child the server left in its process group is stopped once the
    server exits (the server itself exits on stdin's end)."""
    async with Runtime():
        tools = await mcp_tools(raw(), name="raw")
        pid = int((await named(tools, "spawn").invoke({})).output)
        assert alive(pid)
    with anyio.fail_after(20):
        while alive(pid):  # noqa: ASYNC110 - reaping by init has no event
            await anyio.sleep(0.05)


# ------------------------------------------------------------- resources


def test_readable_keeps_the_last_and_is_linear() -> None:
    """Many URIs at once keep the last `READABLE` (in one pass: forgetting
    them one at a time was quadratic, 20 s for 300,000; no timed assert here,
    the suite's machines are shared)."""
    readable = Readable()
    readable.add(["first"])
    assert not readable.forgot
    readable.add(f"u{k}" for k in range(300_000))
    assert len(readable) == READABLE
    assert "u299999" in readable
    assert f"u{300_000 - READABLE}" in readable
    assert f"u{300_000 - READABLE - 1}" not in readable
    assert "first" not in readable
    assert readable.forgot


async def test_the_resource_tool_says_why_a_uri_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Too long, forgotten, or never listed: each said as it is; an unknown
    URI lists the resources again at most every `_RELIST_EVERY` seconds."""
    import agentfsm.mcp

    monkeypatch.setattr(agentfsm.mcp, "_RELIST_EVERY", 3600.0)
    async with Runtime():
        tools = await mcp_tools(raw(), name="raw", resource_tool=True)
        reader = named(tools, "read_resource")
        lists = named(tools, "lists")
        with anyio.fail_after(30):
            read = await reader.invoke({"uri": "raw://r/1"})  # lists once
            assert read.output == "content of raw://r/1"
            with pytest.raises(ToolError, match="is no resource MCP server raw listed"):
                await reader.invoke({"uri": "made://up"})  # not listed again
            assert (await lists.invoke({})).output == "1"
            with pytest.raises(ToolError) as long:
                await reader.invoke({"uri": "raw://long/" + "x" * 5000})
            tools._readable.add(f"raw://many/{k}" for k in range(READABLE))
            with pytest.raises(ToolError) as forgotten:
                await reader.invoke({"uri": "raw://r/0"})
    assert (
        "the URI is 5,011 characters long: this tool reads URIs of up to "
        "4,096 characters"
    ) in str(long.value)
    assert "is not among the last 10,000 resources MCP server raw listed" in str(
        forgotten.value
    )


async def test_a_list_without_end_is_cut(
    log_output: list[EventDict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server whose pages never end is followed until `_LIST_ITEMS` items."""
    import agentfsm.mcp

    monkeypatch.setattr(agentfsm.mcp, "_LIST_ITEMS", 10)
    async with Runtime():
        tools = await mcp_tools(raw(RAW_ENDLESS="1"), name="raw")
        with anyio.fail_after(30):
            listed = await tools.list_resources()
            lists = (await named(tools, "lists").invoke({})).output
    assert (len(listed), lists) == (12, "3")  # 4 a page: 3 pages reach 10
    cut = [e for e in log_output if e["event"] == "mcp_list_cut"]
    assert [(e["method"], e["items"]) for e in cut] == [("resources/list", 12)]


# --------------------------------------------------------------- progress


def test_huge_progress_numbers_stay_floats() -> None:
    """Whole numbers are ints only while exact (below 2**53): 1e308 is not
    made a 309-digit int."""
    small = payload(3.0, 10.0, None)
    assert small == {"progress": 3, "total": 10}
    assert type(small["progress"]) is int  # (3.0 == 3: the types tell)
    huge = payload(1e308, float(2**70), None)
    assert huge == {"progress": 1e308, "total": 2.0**70}
    assert type(huge["progress"]) is float
    assert type(huge["total"]) is float
    assert payload(-1e300, None, None) == {"progress": -1e300}
