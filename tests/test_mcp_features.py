"""agentfsm.mcp against a server with progress, resources and prompts
(tests/mcp_library_server.py): progress notifications as
`function_call.progress`, resources and prompts through the toolset and the
opt-in resource tool, text preferred over structured content, and a server
that goes away (a killed stdio process, an HTTP server stopped and started
again). In process, over stdio and over streamable HTTP, on asyncio and trio.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.server.mcpserver import MCPServer
from structlog.typing import EventDict

from agentfsm import (
    ConfigurationError,
    FunctionCallOutputItem,
    InferenceInput,
    LoopResult,
    ModelContext,
    Runtime,
    Tool,
    ToolError,
)
from agentfsm.events import AgentEvent, FunctionCallCompleted, FunctionCallProgress
from agentfsm.mcp import (
    MCPConnectionError,
    MCPRequestError,
    MCPTool,
    MCPToolset,
    mcp_tools,
)
from agentfsm.mcp import _stdio as stdio
from agentfsm.mcp._progress import MESSAGE_CHARS, reporter
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.mcp_calc_server import make_server as make_calc_server
from tests.mcp_library_server import make_server

LIBRARY = Path(__file__).with_name("mcp_library_server.py")

REFUSED = (
    "'library://books/secret' is no resource MCP server library "
    "listed or a tool returned: only those can be read"
)


def request(tools: Any) -> InferenceInput:
    return InferenceInput(model="s:m", context=ModelContext(), tools=tools)


def outputs(req: InferenceInput) -> list[tuple[str, bool]]:
    return [
        (item.output, item.is_error)
        for item in req.context.items
        if isinstance(item, FunctionCallOutputItem)
    ]


def scripted(*turns: Any) -> dict[str, ScriptedProvider]:
    return {"s": ScriptedProvider([*turns, text("done")])}


def named(tools: MCPToolset, name: str) -> Tool:
    return next(t for t in tools if t.name == name)


async def run(runtime: Runtime, tools: Any) -> tuple[LoopResult, InferenceInput]:
    req = request(tools)
    return await runtime.wait(runtime.run_loop("a", "go", req)), req


@contextmanager
def http_server(port: int = 0) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """The library server over streamable HTTP on 127.0.0.1 (`port`, or one
    of the system's choosing); killed on leaving (a graceful stop would wait
    for the client's open streams)."""
    proc = subprocess.Popen(
        [sys.executable, str(LIBRARY), "--http", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        printed = proc.stdout.readline().strip()  # once the socket listens
        assert printed.isdigit(), f"the server did not start (printed {printed!r})"
        yield int(printed), proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


@asynccontextmanager
async def served(transport: str) -> AsyncIterator[Any]:
    """What `mcp_tools` connects to, for each transport."""
    if transport == "in-process":
        yield make_server()
    elif transport == "stdio":
        yield str(LIBRARY)
    else:
        with http_server() as (port, _):
            yield f"http://127.0.0.1:{port}/mcp"


# The SDK's streamable-HTTP client returns from inside its `async for` over a
# server-sent-event response (one answering a call with a progress token)
# without closing the generator; on trio, its finalizer then warns that it
# was collected unexhausted (`mcp` 2.3, mcp/client/streamable_http.py,
# `_handle_sse_response`). The stream is closed either way: the warning is
# the SDK's, not a leak of agentfsm's.
SDK_SSE_GENERATOR = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <async_generator object "
    "(EventSource|PoolByteStream)\\.__aiter__:pytest.PytestUnraisableExceptionWarning"
)

TRANSPORTS = [
    pytest.param("in-process", id="in-process"),
    pytest.param("stdio", id="stdio", marks=pytest.mark.e2e),
    pytest.param("http", id="http", marks=[pytest.mark.e2e, SDK_SSE_GENERATOR]),
]


# --------------------------------------------------------------- progress


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_progress_is_the_calls_progress(transport: str) -> None:
    """Each progress notification of a call is a `function_call.progress`
    event of that call, in order, before the call completes; its message
    printable on one line."""
    steps = 12
    turn = calls(call("count", steps=steps), call("pid"))
    async with served(transport) as server, Runtime(providers=scripted(turn)) as rt:
        tools = await mcp_tools(server)
        with rt.bus.subscribe(
            ["function_call.progress", "function_call.completed"]
        ) as sub:
            result, _ = await run(rt, tools)
            seen: list[AgentEvent] = []
            while not (
                seen
                and isinstance(seen[-1], FunctionCallCompleted)
                and sum(isinstance(e, FunctionCallCompleted) for e in seen) == 2
            ):
                with anyio.fail_after(10):
                    seen.append(await sub.receive())
    assert result.outcome == "answered"
    counted = next(
        e
        for e in seen
        if isinstance(e, FunctionCallCompleted) and e.call.name == "count"
    )
    progress = [e for e in seen if isinstance(e, FunctionCallProgress)]
    assert {e.call_id for e in progress} == {counted.call.call_id}
    assert [e.progress for e in progress] == [
        {"progress": step, "total": steps, "message": f"step {step}\\x1b[2J"}
        for step in range(1, steps + 1)
    ]
    assert seen.index(counted) > seen.index(progress[-1])


async def test_progress_that_goes_back_or_is_no_number_is_dropped() -> None:
    """The progress callback a call sends keeps reports in order: one whose
    progress goes back, or is no finite number, is dropped; a total that is
    no finite number is left out; a long message is cut."""

    async def noisy() -> str:
        report = reporter()
        await report(1.0, 4.0, "a")
        await report(0.5, 4.0, "back")
        await report(math.nan, None, None)
        await report(math.inf, None, None)
        await report(2.5, math.inf, "x" * 2000)
        await report(2.5, None, "same")
        return "ok"

    turn = calls(call("noisy"))
    async with Runtime(providers=scripted(turn)) as rt:
        with rt.bus.subscribe("function_call.progress") as sub:
            await run(rt, [Tool(noisy)])
            seen = [sub.receive_nowait() for _ in range(3)]
            with pytest.raises(anyio.WouldBlock):
                sub.receive_nowait()
    assert [e.progress for e in seen if isinstance(e, FunctionCallProgress)] == [
        {"progress": 1, "total": 4, "message": "a"},
        {"progress": 2.5, "message": "x" * (MESSAGE_CHARS - 1) + "…"},
        {"progress": 2.5, "message": "same"},
    ]


# ----------------------------------------------------- resources and prompts


class TestResourcesAndPrompts:
    @pytest.mark.parametrize("transport", TRANSPORTS)
    async def test_listed_and_read(self, transport: str) -> None:
        """Resources, templates and prompts are listed; a resource is read, a
        prompt filled in."""
        async with served(transport) as server, Runtime():
            tools = await mcp_tools(server)
            assert [(r.uri, r.name) for r in await tools.list_resources()] == [
                ("library://books/dune", "dune")
            ]
            templates = await tools.list_resource_templates()
            assert [t.uri_template for t in templates] == ["library://books/{title}"]
            [contents] = await tools.read_resource("library://books/emma")
            assert (contents.uri, contents.mime_type) == (
                "library://books/emma",
                "text/plain",
            )
            assert getattr(contents, "text", None) == "Emma, by Jane Austen."
            [prompt] = await tools.list_prompts()
            assert (prompt.name, prompt.description) == (
                "review",
                "Ask for a short review of a book.",
            )
            got = await tools.get_prompt("review", {"title": "Dune"})
            [message] = got.messages
            assert message.role == "user"
            assert getattr(message.content, "text", None) == (
                "Write a short review of Dune."
            )

    async def test_errors(self) -> None:
        """A server's error is an MCPRequestError; bad arguments are refused
        before anything is sent."""
        async with Runtime():
            tools = await mcp_tools(make_server())
            with pytest.raises(MCPRequestError, match="MCP server library refused"):
                await tools.get_prompt("no-such-prompt")
            with pytest.raises(
                MCPRequestError, match="refused the resources/read request"
            ):
                await tools.read_resource("other://x")
            with pytest.raises(ConfigurationError, match="uri must be a str, got int"):
                await tools.read_resource(1)  # type: ignore[arg-type]
            with pytest.raises(ConfigurationError, match="arguments are str to str"):
                await tools.get_prompt("review", {"title": 1})  # type: ignore[dict-item]

    async def test_a_server_without_them(self) -> None:
        """A server offering no resources or prompts lists none."""
        async with Runtime():
            tools = await mcp_tools(make_calc_server())
            assert await tools.list_resources() == []
            assert await tools.list_resource_templates() == []
            assert await tools.list_prompts() == []

    async def test_closed(self) -> None:
        """After the toolset closed, reading is a connection error."""
        async with MCPToolset(make_server()) as tools:
            pass
        with pytest.raises(MCPConnectionError, match="is closed"):
            await tools.list_resources()


class TestResourceTool:
    async def test_reads_what_was_listed_or_linked_only(self) -> None:
        """The model reads a resource a tool linked to and one the server
        lists; a URI it made up is refused, though the server would serve it."""
        turn = calls(call("find", title="emma"))
        reads = calls(
            call("read_resource", uri="library://books/emma"),
            call("read_resource", uri="library://books/secret"),
            call("read_resource", uri="library://books/dune"),
        )
        async with Runtime(providers=scripted(turn, reads)) as rt:
            tools = await mcp_tools(make_server(), resource_tool=True)
            assert tools.resource_tool is tools[-1]
            assert not isinstance(tools[-1], MCPTool)
            result, req = await run(rt, tools)
            served_anyway = await tools.read_resource("library://books/secret")
        assert result.outcome == "answered"
        assert outputs(req) == [
            ("found emma\n[resource link library://books/emma: emma]", False),
            ("Emma, by Jane Austen.", False),
            (REFUSED, True),
            ("Dune, by Frank Herbert.", False),  # listed: looked up when asked
        ]
        assert getattr(served_anyway[0], "text", None) == "no book called secret"

    async def test_off_by_default_and_named(self) -> None:
        """Without `resource_tool` there is no such tool; a prefix or a str
        names it; approval rules name it `read_resource`."""
        async with Runtime():
            plain = await mcp_tools(make_server())
            assert plain.resource_tool is None
            assert "read_resource" not in {t.name for t in plain}
            prefixed = await mcp_tools(
                make_server(),
                prefix="lib",
                resource_tool=True,
                needs_approval={"read_resource"},
            )
            reader = prefixed.resource_tool
            assert reader is not None
            assert reader.name == "lib_read_resource"
            assert reader.requires_approval({"uri": "x"})
            assert not named(prefixed, "lib_pid").requires_approval({})
            own = await mcp_tools(make_server(), resource_tool="open_book")
            assert [t.name for t in own][-1] == "open_book"

    async def test_a_server_tool_of_the_same_name_is_left_out(
        self, log_output: list[EventDict]
    ) -> None:
        server: MCPServer[Any] = MCPServer("clash")

        @server.tool()
        def read_resource(uri: str) -> str:
            """The server's own."""
            return uri

        async with Runtime():
            tools = await mcp_tools(server, resource_tool=True)
            assert [t.name for t in tools] == ["read_resource"]
            assert tools[0] is tools.resource_tool
            with pytest.raises(ConfigurationError, match="name is the resource tool"):
                await mcp_tools(server, resource_tool=True, include=["read_resource"])
        [warning] = [e for e in log_output if e["event"] == "mcp_tool_refused"]
        assert warning["problem"] == "name is the resource tool's, 'read_resource'"

    @pytest.mark.parametrize("option", [1, "", " ", None])
    def test_bad_option(self, option: Any) -> None:
        with pytest.raises(ConfigurationError, match="resource_tool must be"):
            MCPToolset(make_server(), resource_tool=option)


# ------------------------------------------------------------------ content


async def test_text_is_preferred_unless_there_is_an_output_schema() -> None:
    """A result's text blocks are the output, not its structured content;
    a tool declaring an output schema gives its structured content."""
    turn = calls(call("summary", title="dune"), call("pages", title="dune"))
    async with Runtime(providers=scripted(turn)) as rt:
        tools = await mcp_tools(make_server())
        pages = named(tools, "pages")
        assert isinstance(pages, MCPTool)
        assert pages.spec.output_schema is not None
        _, req = await run(rt, tools)
    assert outputs(req) == [
        ("Dune, by Frank Herbert.", False),
        ('{"title":"dune","pages":412}', False),
    ]


# ------------------------------------------------------ a server that goes


@pytest.mark.e2e
async def test_a_killed_stdio_server_is_not_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stdio server killed mid-call: that call and the next say it is not
    running and how its process ended; the loop goes on and answers."""
    # How it ended is known once the process is reaped: a loaded machine may
    # take longer to get there than the usual grace.
    monkeypatch.setattr(stdio, "_GRACE", 60.0)
    provider = ScriptedProvider([calls(call("wait")), calls(call("pid")), text("ok")])
    async with Runtime(providers={"s": provider}) as rt:
        tools = await mcp_tools(str(LIBRARY))
        pid = int((await named(tools, "pid").invoke({})).output)
        req = request(tools)
        with rt.bus.subscribe("function_call.progress") as progress:
            loop_id = rt.run_loop("a", "go", req)
            with anyio.fail_after(20):
                await progress.receive()  # `wait` is running on the server
            os.kill(pid, signal.SIGKILL)
            result = await rt.wait(loop_id)
        with pytest.raises(MCPConnectionError, match="is not running"):
            await tools.list_prompts()
    gone = f"MCP server {LIBRARY.name} is not running: its process was killed by signal SIGKILL"
    assert result.outcome == "answered"
    assert outputs(req) == [(gone, True), (gone, True)]


@pytest.mark.e2e
@SDK_SSE_GENERATOR
async def test_an_http_server_started_again_serves_the_next_call() -> None:
    """An HTTP server stopped: a call says the connection was lost; started
    again on its port, the next call opens a new session and is served."""
    with http_server() as (port, proc):
        async with Runtime():
            tools = await mcp_tools(f"http://127.0.0.1:{port}/mcp")
            pages = named(tools, "pages")
            assert (await pages.invoke({"title": "dune"})).output == (
                '{"title":"dune","pages":412}'
            )
            proc.kill()
            proc.wait(timeout=10)
            with pytest.raises(ToolError) as caught:
                await pages.invoke({"title": "dune"})
            # Lost, or (had the session seen the server go first) lost and
            # not connected to again: either way, said so.
            assert str(caught.value).startswith(
                f"the connection to MCP server 127.0.0.1:{port} was lost"
            )
            assert str(caught.value).endswith(
                ("; the next call connects again", "; the next call tries again")
            )
            with http_server(port):
                result = await pages.invoke({"title": "emma"})
                assert result.output == '{"title":"emma","pages":412}'
                assert [r.uri for r in await tools.list_resources()] == [
                    "library://books/dune"
                ]
