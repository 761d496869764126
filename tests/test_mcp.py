"""agentfsm.mcp: an MCP server's tools as agentfsm tools, over one session per
runtime (in process, over stdio, over streamable HTTP), on asyncio and trio.

The server is tests/mcp_calc_server.py; it counts the sessions and the calls it
sees, which is how the tests know that one session served every call.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import mcp
import pytest

from agentfsm import (
    ConfigurationError,
    FunctionCallOutputItem,
    InferenceInput,
    LoopResult,
    LoopStatus,
    ModelContext,
    NoRuntimeError,
    PendingTransition,
    Rewrite,
    Runtime,
    Tool,
    ToolBatch,
    ToolCall,
    ToolError,
    ToolResult,
)
from agentfsm.cli import main
from agentfsm.cli import run as run_command
from agentfsm.cli.run import _request, _watch, with_mcp_tools
from agentfsm.exceptions import LoopStateError
from agentfsm.mcp import MCPConnectionError, MCPTool, MCPToolset, mcp_tools
from agentfsm.testing import ScriptedProvider, call, calls, text
from agentfsm.tools import ToolNext
from tests.mcp_calc_server import make_server

SERVER = Path(__file__).with_name("mcp_calc_server.py")

CALC_TOOLS = ["add", "divide", "weather", "shout", "slow", "stats", "grow"]


def request(tools: Any) -> InferenceInput:
    return InferenceInput(model="s:m", context=ModelContext(), tools=tools)


def outputs(req: InferenceInput) -> list[FunctionCallOutputItem]:
    return [i for i in req.context.items if isinstance(i, FunctionCallOutputItem)]


async def run(
    runtime: Runtime, tools: Any, *items: Any, **options: Any
) -> tuple[LoopResult, InferenceInput]:
    """One loop that makes the calls `items` in one turn, then answers."""
    req = request(tools)
    loop_id = runtime.run_loop("a", "go", req, **options)
    return await runtime.wait(loop_id), req


def scripted(*turns: Any) -> dict[str, ScriptedProvider]:
    return {"s": ScriptedProvider([*turns, text("done")])}


async def stats(tools: MCPToolset) -> dict[str, int]:
    """What the server has seen (through the toolset's own session)."""
    stats_tool = next(
        t for t in tools if isinstance(t, MCPTool) and t.spec.name == "stats"
    )
    counts: dict[str, int] = json.loads((await stats_tool.invoke({})).output)
    return counts


# ------------------------------------------------------------------ in process


class TestTools:
    async def test_the_servers_names_descriptions_and_schemas(self) -> None:
        """Each listed tool is a `Tool` named, described and shaped by the server."""
        server = make_server()
        listed = {t.name: t for t in await server.list_tools()}
        async with Runtime():
            tools = await mcp_tools(server)
            assert [t.name for t in tools] == CALC_TOOLS
            add = tools[0]
            assert isinstance(add, MCPTool)
            assert isinstance(add, Tool)
            assert add.definition.description == "Add two integers."
            schema = dict(listed["add"].input_schema)
            del schema["title"]  # the tool has a name
            assert add.definition.parameters == schema
            assert add.definition.parameters["required"] == ["a", "b"]

    async def test_prefix(self) -> None:
        """A prefix names every tool `<prefix>_<name>`; calls use the server's name."""
        async with Runtime(providers=scripted(calls(call("calc_add", a=2, b=3)))) as rt:
            tools = await mcp_tools(make_server(), prefix="calc")
            assert [t.name for t in tools] == [f"calc_{n}" for n in CALC_TOOLS]
            result, req = await run(rt, tools)
        assert result.outcome == "answered"
        assert [o.output for o in outputs(req)] == ["5"]

    @pytest.mark.parametrize(
        ("options", "offered"),
        [
            pytest.param({"include": ["add", "shout"]}, ["add", "shout"], id="include"),
            pytest.param(
                {"exclude": {"grow", "slow", "stats"}},
                ["add", "divide", "weather", "shout"],
                id="exclude",
            ),
            pytest.param(
                {"include": lambda t: "integers" in (t.description or "")},
                ["add"],
                id="predicate",
            ),
            pytest.param(
                {"include": ["add", "divide"], "exclude": ["divide"]},
                ["add"],
                id="both",
            ),
        ],
    )
    async def test_filtering(self, options: Any, offered: list[str]) -> None:
        """include (names or a predicate) and exclude choose what is offered."""
        async with Runtime():
            tools = await mcp_tools(make_server(), **options)
            assert [t.name for t in tools] == offered

    async def test_include_of_a_missing_tool_says_what_there_is(self) -> None:
        """A name in include the server lacks is an error naming it and the tools."""
        async with Runtime():
            with pytest.raises(ConfigurationError, match="does not have: ad ") as e:
                await mcp_tools(make_server(), include=["ad"])
        assert "it has: add, divide, grow" in str(e.value)

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            pytest.param({"include": "add"}, "include takes a collection", id="str"),
            pytest.param({"exclude": [1]}, "exclude takes tool names", id="not-str"),
            pytest.param({"prefix": "my calc"}, "prefix must be letters", id="prefix"),
            pytest.param({"timeout": 0}, "timeout must be positive", id="timeout"),
            pytest.param(
                {"execution_mode": "x"}, "execution_mode", id="execution-mode"
            ),
            pytest.param({"needs_approval": "add"}, "needs_approval", id="approval"),
            pytest.param({"mode": "2024-11-05"}, "mode must be", id="protocol-mode"),
        ],
    )
    def test_bad_options(self, options: Any, message: str) -> None:
        """Bad options are refused at once, saying which."""
        with pytest.raises(ConfigurationError, match=message):
            MCPToolset(make_server(), **options)

    def test_made_before_an_event_loop_runs(self) -> None:
        """A toolset can be made at import time; it connects when entered."""
        toolset = MCPToolset(make_server(), prefix="calc")
        assert (toolset.name, len(toolset)) == ("calc", 0)

    @pytest.mark.parametrize(
        "server",
        ["", "  ", "python 'unclosed", 42],
        ids=["empty", "blank", "unbalanced-quote", "int"],
    )
    def test_bad_server(self, server: Any) -> None:
        """A server that is none of the accepted kinds is refused, saying so."""
        with pytest.raises(ConfigurationError, match="MCP server"):
            MCPToolset(server)

    def test_public_names(self) -> None:
        """`agentfsm.mcp.__all__` names what the module defines."""
        import agentfsm.mcp

        assert set(agentfsm.mcp.__all__) == {
            "DEFAULT_CONNECT_TIMEOUT",
            "DEFAULT_REQUEST_TIMEOUT",
            "MCPConnectionError",
            "MCPRequestError",
            "MCPServerSpec",
            "MCPTool",
            "MCPToolset",
            "MCPToolsetOptions",
            "mcp_tools",
        }
        assert all(hasattr(agentfsm.mcp, name) for name in agentfsm.mcp.__all__)


class TestResults:
    async def test_results(self) -> None:
        """Text beats structured content unless the tool declares an output
        schema (a wrapped value is then unwrapped), and `is_error` makes an
        error output."""
        turn = calls(
            call("add", a=2, b=3),
            call("weather", city="Lisbon"),
            call("shout", text="hi"),
            call("weather", city="Paris"),
            call("divide", a=1, b=0),
        )
        async with Runtime(providers=scripted(turn)) as rt:
            result, req = await run(rt, await mcp_tools(make_server()))
        assert result.outcome == "answered"
        got = [(o.output, o.is_error) for o in outputs(req)]
        assert got[:4] == [
            ("5", False),  # {"result": 5} as the SDK wraps it: the model reads 5
            ("Sunny, 18 C", False),  # no output schema: the text, not the JSON
            ("HI", False),
            ("no weather for Paris", True),
        ]
        assert got[4][1] is True
        assert "divide" in got[4][0]

    async def test_invalid_arguments_are_not_sent(self) -> None:
        """Arguments that do not fit the server's schema are an error output
        naming each problem; the server never sees the call."""
        turn = calls(call("add", a="two"), call("add", a=1, b=2))
        async with Runtime(providers=scripted(turn)) as rt:
            tools = await mcp_tools(make_server())
            _, req = await run(rt, tools)
            seen = await stats(tools)
        bad, good = outputs(req)
        assert bad.is_error
        assert bad.output == (
            "invalid arguments for tool 'add': a: 'two' is not of type 'integer'; "
            "arguments: 'b' is a required property"
        )
        assert (good.output, good.is_error) == ("3", False)
        assert seen["calls"] == 2  # the good call and `stats`

    async def test_parallel_calls_share_the_session(self) -> None:
        """Calls of one batch run at once over the one session; outputs keep order."""
        turn = calls(*(call("add", a=i, b=i) for i in range(8)))
        async with Runtime(providers=scripted(turn)) as rt:
            tools = await mcp_tools(make_server())
            result, req = await run(rt, tools, tool_execution="parallel")
        assert result.outcome == "answered"
        assert [o.output for o in outputs(req)] == [str(2 * i) for i in range(8)]


class TestSession:
    async def test_one_session_for_every_call_of_every_loop(self) -> None:
        """Two loops, many calls: the server saw one session."""
        server = make_server()
        turn = calls(*(call("add", a=1, b=i) for i in range(5)))
        async with Runtime(providers=scripted(turn)) as rt:
            tools = await mcp_tools(server)
            first, second = (rt.run_loop("a", "go", request(tools)) for _ in range(2))
            assert (await rt.wait(first)).tool_calls == 5
            assert (await rt.wait(second)).tool_calls == 5
        seen = server.seen  # type: ignore[attr-defined]
        assert seen["server/discover"] + seen["initialize"] == 1
        assert seen["tools/call"] == 10
        assert seen["tools/list"] == 1  # listed once, not per loop or call

    async def test_closed_when_the_runtime_exits(self) -> None:
        """Once the runtime has exited, a call is an error: the session is closed."""
        async with Runtime():
            tools = await mcp_tools(make_server())
        with pytest.raises(ToolError, match=r"is closed \(its runtime has exited\)"):
            await tools[0].invoke({"a": 1, "b": 2})

    async def test_a_loop_still_running_at_exit_keeps_the_session(self) -> None:
        """Leaving the runtime waits for running loops before closing the session:
        a call made after the block ended still reaches the server."""
        slow_then_add = calls(call("slow", seconds=0.05))
        provider = ScriptedProvider(
            [slow_then_add, calls(call("add", a=1, b=1)), text("done")]
        )
        async with Runtime(providers={"s": provider}) as rt:
            tools = await mcp_tools(make_server())
            req = request(tools)
            loop_id = rt.run_loop("a", "go", req)
        result = await rt.wait(loop_id)
        assert result.outcome == "answered"
        assert [(o.output, o.is_error) for o in outputs(req)] == [
            ("done", False),
            ("2", False),
        ]

    async def test_mcp_tools_needs_a_runtime(self) -> None:
        """Outside a runtime (and without `runtime=`) it says so."""
        with pytest.raises(NoRuntimeError):
            await mcp_tools(make_server())

    async def test_the_runtime_is_given(self) -> None:
        """`runtime=` holds the session in that runtime."""
        async with Runtime() as rt:
            tools = await mcp_tools(make_server(), runtime=rt)
            assert len(tools) == len(CALC_TOOLS)

    async def test_a_toolset_of_its_own(self) -> None:
        """Entered directly, a toolset holds its session for its block only."""
        server = make_server()
        async with MCPToolset(server, include=["add"]) as tools:
            assert (await tools[0].invoke({"a": 2, "b": 2})).output == "4"
        with pytest.raises(ToolError, match="is closed"):
            await tools[0].invoke({"a": 2, "b": 2})
        with pytest.raises(ConfigurationError, match="entered before"):
            await tools.__aenter__()


class TestListChanged:
    @pytest.mark.parametrize("mode", ["auto", "legacy"])
    async def test_the_list_is_fetched_again(self, mode: str) -> None:
        """When the server says its list changed (on a listen stream from
        2026-07-28, as a notification before), the toolset fetches it again;
        a loop started after can call the new tool."""
        changed = anyio.Event()
        providers = {  # a script per loop: each loop reads its script from the top
            "g": ScriptedProvider([calls(call("calc_grow")), text("grown")]),
            "s": ScriptedProvider([calls(call("calc_multiply", a=6, b=7)), text("42")]),
        }
        async with Runtime(providers=providers) as rt:
            tools = await mcp_tools(
                make_server(),
                prefix="calc",
                mode=mode,
                on_change=lambda _: changed.set(),
            )
            before = tools.tools
            grow = request(tools).model_copy(update={"model": "g:m"})
            await rt.wait(rt.run_loop("a", "grow", grow))
            with anyio.fail_after(5):
                await changed.wait()
            assert [t.name for t in tools][-1] == "calc_multiply"
            # The tools that did not change are the same objects.
            assert tools.tools[: len(before)] == before
            result, req = await run(rt, tools)
        assert result.outcome == "answered"
        assert [o.output for o in outputs(req)] == ["42"]

    async def test_refresh_on_demand(self) -> None:
        """`refresh()` fetches the list now."""
        server = make_server()
        async with Runtime():
            tools = await mcp_tools(server, include=lambda t: t.name != "divide")
            server.remove_tool("add")
            assert [t.name for t in await tools.refresh()] == CALC_TOOLS[2:]


class TestControl:
    async def test_needs_approval_pauses_the_batch(self) -> None:
        """`needs_approval` (names) pauses a batch calling such a tool; resumed,
        it runs."""
        turn = calls(call("divide", a=6, b=3), call("add", a=1, b=1))
        async with Runtime(providers=scripted(turn)) as rt:
            tools = await mcp_tools(make_server(), needs_approval={"divide"})
            by_name = {t.name: t for t in tools}
            assert by_name["divide"].requires_approval({"a": 1, "b": 2})
            assert not by_name["add"].requires_approval({"a": 1, "b": 2})
            req = request(tools)
            with rt.bus.subscribe("loop.paused") as paused:
                loop_id = rt.run_loop("a", "go", req)
                await paused.receive()
            assert rt.get(loop_id).status is LoopStatus.paused
            assert outputs(req) == []  # nothing ran yet
            rt.resume(loop_id)
            result = await rt.wait(loop_id)
        assert result.outcome == "answered"
        assert [o.output for o in outputs(req)] == ["2.0", "2"]

    async def test_approval_rule_of_the_arguments(self) -> None:
        """A rule sees the listed tool and the arguments."""
        seen: list[tuple[str, dict[str, Any]]] = []

        def rule(spec: mcp.types.Tool, arguments: dict[str, Any]) -> bool:
            seen.append((spec.name, arguments))
            return bool(arguments.get("b") == 0)

        async with Runtime():
            tools = await mcp_tools(
                make_server(), include=["divide"], needs_approval=rule
            )
            assert tools[0].requires_approval('{"a": 1, "b": 0}')
            assert not tools[0].requires_approval('{"a": 1, "b": 2}')
        assert seen == [("divide", {"a": 1, "b": 0}), ("divide", {"a": 1, "b": 2})]

    async def test_a_handler_denies_a_call(self) -> None:
        """An interception handler denies an MCP call like any other: the server
        never sees it, the model reads why."""

        def deny_divide(pending: PendingTransition) -> Rewrite | None:
            batch = pending.payload
            if not isinstance(batch, ToolBatch):
                return None
            for item in batch.calls:
                if item.name == "calc_divide":
                    batch = batch.deny(item.call_id, "no dividing today")
            return Rewrite(payload=batch)

        turn = calls(call("calc_divide", a=1, b=2), call("calc_add", a=1, b=2))
        async with Runtime(providers=scripted(turn)) as rt:
            tools = await mcp_tools(make_server(), prefix="calc")
            req = request(tools)
            await rt.wait(rt.run_loop("a", "go", req, interception_handler=deny_divide))
            seen = await stats(tools)
        denied, ran = outputs(req)
        assert denied.is_error
        assert denied.output == "the call was denied: no dividing today"
        assert ran.output == "3"
        assert seen["calls"] == 2  # add and stats: divide never went out

    async def test_a_tool_wrapper_changes_the_arguments(self) -> None:
        """Tool wrappers see MCP calls and may change them."""

        async def double_b(tool_call: ToolCall, call_next: ToolNext) -> ToolResult:
            arguments = json.loads(tool_call.arguments)
            arguments["b"] *= 2
            return await call_next(tool_call.with_arguments(arguments))

        async with Runtime(providers=scripted(calls(call("add", a=1, b=2)))) as rt:
            tools = await mcp_tools(make_server())
            _, req = await run(rt, tools, tool_wrappers=[double_b])
        assert [o.output for o in outputs(req)] == ["5"]

    async def test_timeout(self) -> None:
        """A call past the timeout is cancelled and its output is an error; the
        loop goes on, and the session serves the next call."""
        turn = calls(call("slow", seconds=30))
        provider = ScriptedProvider([turn, calls(call("add", a=1, b=1)), text("ok")])
        async with Runtime(providers={"s": provider}) as rt:
            tools = await mcp_tools(make_server(), timeout=0.2)
            result, req = await run(rt, tools)
        assert result.outcome == "answered"
        (slow, add) = outputs(req)
        assert slow.is_error
        assert slow.output == "tool 'slow' timed out after 0.2s"
        assert (add.output, add.is_error) == ("2", False)


class TestConnectionErrors:
    async def test_a_command_that_does_not_exist(self) -> None:
        """A server command that cannot run is an MCPConnectionError naming it."""
        async with Runtime():
            with pytest.raises(MCPConnectionError, match="no-such-mcp-server-xyz"):
                await mcp_tools("no-such-mcp-server-xyz --flag")

    async def test_a_server_that_never_answers(self) -> None:
        """A server silent past `connect_timeout` is an error saying so."""
        # It reads its stdin to the end and never answers (and ends once the
        # client closes its stdin, so the test need not wait for it to be killed).
        silent = f"{sys.executable} -c 'import sys; sys.stdin.read()'"
        async with Runtime():
            with pytest.raises(MCPConnectionError, match=r"within 0.5s"):
                await mcp_tools(silent, connect_timeout=0.5)

    async def test_nothing_listens_at_the_url(self) -> None:
        """An URL nothing serves is an MCPConnectionError."""
        async with Runtime():
            with pytest.raises(
                MCPConnectionError, match="cannot connect to MCP server"
            ):
                await mcp_tools("http://127.0.0.1:9/mcp")


class TestRuntimeContexts:
    """`Runtime.enter_async_context`, the seam the MCP session is held by."""

    @staticmethod
    def _recorded(log: list[str]) -> Callable[..., Any]:
        @asynccontextmanager
        async def held(name: str, fail: bool = False) -> Any:
            if fail:
                raise ValueError(f"{name} failed")
            async with anyio.create_task_group() as tg:  # a scope of its own
                log.append(f"open {name}")
                yield name
                log.append(f"close {name}")
                tg.cancel_scope.cancel()

        return held

    async def test_closed_last_entered_first_after_the_body(self) -> None:
        """Contexts close after the block, in reverse order; one that fails to
        enter raises to its caller and leaves nothing open."""
        log: list[str] = []
        held = self._recorded(log)
        async with Runtime() as rt:
            assert await rt.enter_async_context(held("a")) == "a"
            with pytest.raises(ValueError, match="b failed"):
                await rt.enter_async_context(held("b", fail=True))
            await rt.enter_async_context(held("c"))
            log.append("body")
        assert log == ["open a", "open c", "body", "close c", "close a"]

    async def test_closed_when_the_body_raises(self) -> None:
        """An error leaving the block still closes them (and is what the caller sees)."""
        log: list[str] = []
        held = self._recorded(log)

        async def body() -> None:
            async with Runtime() as rt:
                await rt.enter_async_context(held("a"))
                raise KeyError("boom")

        with pytest.raises(KeyError):
            await body()
        assert log == ["open a", "close a"]

    async def test_one_that_fails_while_open_cancels_nothing(self) -> None:
        """A context failing while open is logged; the runtime goes on."""
        failed = anyio.Event()

        @asynccontextmanager
        async def breaks() -> Any:
            async with anyio.create_task_group() as tg:

                async def fail() -> None:
                    await anyio.lowlevel.checkpoint()
                    failed.set()
                    raise OSError("the server died")

                tg.start_soon(fail)
                yield

        async with Runtime(providers=scripted()) as rt:
            await rt.enter_async_context(breaks())
            with anyio.fail_after(5):
                await failed.wait()
            result, _ = await run(rt, ())
        assert result.outcome == "answered"

    async def test_not_running(self) -> None:
        """Before entering or after leaving, it is refused."""
        runtime = Runtime()
        with pytest.raises(LoopStateError, match="not running"):
            await runtime.enter_async_context(self._recorded([])("a"))


# ---------------------------------------------------------- real subprocesses


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_stdio_subprocess() -> None:
    """A server run as a subprocess over stdio: one session for every call,
    a timed-out call cancelled on the server, the process gone at exit."""
    provider = ScriptedProvider(
        [
            calls(call("calc_add", a=2, b=3), call("calc_weather", city="Lisbon")),
            calls(call("calc_slow", seconds=30)),
            text("done"),
        ]
    )
    async with Runtime(providers={"s": provider}) as rt:
        # A command whose first word is a .py file runs on this interpreter.
        tools = await mcp_tools(str(SERVER), prefix="calc", timeout=0.5)
        result, req = await run(rt, tools)
        seen = await stats(tools)
    assert result.outcome == "answered"
    assert [(o.output, o.is_error) for o in outputs(req)] == [
        ("5", False),
        ("Sunny, 18 C", False),
        ("tool 'calc_slow' timed out after 0.5s", True),
    ]
    assert seen["sessions"] == 1
    assert seen["calls"] == 4  # add, weather, slow, stats
    assert seen["cancelled"] >= 1  # the client told the server to stop `slow`
    assert _gone(seen["pid"])


@pytest.mark.e2e
async def test_stdio_list_changed() -> None:
    """Over stdio the toolset follows the server's list changes."""
    changed = anyio.Event()
    params = mcp.StdioServerParameters(command=sys.executable, args=[str(SERVER)])
    async with Runtime():
        tools = await mcp_tools(params, on_change=lambda _: changed.set())
        grow = next(t for t in tools if t.name == "grow")
        assert (await grow.invoke({})).output == "multiply added"
        with anyio.fail_after(10):
            await changed.wait()
        assert "multiply" in {t.name for t in tools}


@pytest.fixture(scope="module")
def http_server() -> Iterator[str]:
    """tests/mcp_calc_server.py over streamable HTTP on 127.0.0.1 (a port of
    the system's choosing), for this module's HTTP tests; stopped after them."""
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--http"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().strip()  # printed once the socket listens
        assert port.isdigit(), f"the server did not start (printed {port!r})"
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.e2e
async def test_streamable_http(http_server: str) -> None:
    """A server over streamable HTTP: the loop's calls go over one session
    (one handshake), and the list change is followed."""
    changed = anyio.Event()
    provider = ScriptedProvider(
        [calls(*(call("add", a=i, b=1) for i in range(3)), call("grow")), text("done")]
    )
    async with Runtime(providers={"s": provider}) as rt:
        tools = await mcp_tools(http_server, on_change=lambda _: changed.set())
        before = await stats(tools)
        result, req = await run(rt, tools)
        with anyio.fail_after(10):
            await changed.wait()
        after = await stats(tools)
    assert result.outcome == "answered"
    assert [o.output for o in outputs(req)] == ["1", "2", "3", "multiply added"]
    assert after["sessions"] == before["sessions"]  # no new session per call
    assert after["calls"] == before["calls"] + 5  # 4 calls of the loop, 1 stats
    assert "multiply" in {t.name for t in tools}


# --------------------------------------------------------------- the command


def _cli_args(*argv: str) -> argparse.Namespace:
    """The parsed arguments of `agentfsm run ...`."""
    parser = argparse.ArgumentParser()
    run_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["run", *argv])


class TestCli:
    def test_a_server_that_cannot_start_exits_2(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`--mcp` with a command that cannot run exits 2, naming it."""
        argv = ["run", "hi", "--model", "openai-chat:x", "--base-url", "http://x"]
        assert main([*argv, "--mcp", "no-such-mcp-server-xyz"]) == 2
        err = capsys.readouterr().err
        assert (
            "error: --mcp: cannot connect to MCP server no-such-mcp-server-xyz" in err
        )

    def test_without_the_extra(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Without the MCP SDK, `--mcp` exits 2 saying which extra to install."""
        monkeypatch.setitem(sys.modules, "mcp", None)  # `import mcp` fails
        monkeypatch.delitem(sys.modules, "agentfsm.mcp")
        argv = ["run", "hi", "--model", "openai-chat:x", "--base-url", "http://x"]
        assert main([*argv, "--mcp", "python server.py"]) == 2
        assert "pip install 'agentfsm[mcp]'" in capsys.readouterr().err

    @pytest.mark.e2e
    async def test_run_with_an_mcp_server(self) -> None:
        """`--mcp` (repeatable) offers the server's tools; `--tool-choice` may
        name one of them; the calls are shown like any other."""
        provider = ScriptedProvider([calls(call("add", a=2, b=3)), text("It is 5.")])
        server = f"{sys.executable} {SERVER}"
        args = _cli_args(
            "2+3?", "--model", "s:m", "--mcp", server, "--tool-choice", "add"
        )
        out = io.StringIO()
        async with Runtime(providers={"s": provider}) as runtime:
            req = await with_mcp_tools(
                runtime, args, _request(args, [], check_choice=False)
            )
            assert [t.name for t in req.tools] == CALC_TOOLS
            result = await _watch(runtime, args, req, out)
        assert result.outcome == "answered"
        shown = out.getvalue().splitlines()
        assert '  call add({"a":2,"b":3})' in shown
        assert any(line.startswith("  add -> 5 (") for line in shown)

    @pytest.mark.e2e
    async def test_two_servers_with_one_tool_name(self) -> None:
        """Two servers offering one name is an error naming it."""
        server = f"{sys.executable} {SERVER}"
        args = _cli_args("hi", "--model", "s:m", "--mcp", server, "--mcp", server)
        async with Runtime(providers=scripted()) as runtime:
            with pytest.raises(ConfigurationError, match="two tools are named 'add'"):
                await with_mcp_tools(runtime, args, _request(args, []))
