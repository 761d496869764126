"""An MCP server's tools in agentfsm loops, with approval for one of them.

`mcp_tools` starts examples/mcp_calc_server.py as a subprocess and speaks MCP
to it over stdin and stdout, in a session the runtime holds: every call of
every loop goes over it, and it closes (the server stops) when the runtime
exits. The tools are prefixed (`calc_add`, ...) and `calc_divide` needs
approval: a batch calling it pauses the loop until `runtime.resume`.

A scripted model makes the calls (no network); a real model would pick them
from the tools' names, descriptions and schemas, which are the server's.

Run it with `python examples/mcp_server_tools.py` (needs `agentfsm[mcp]`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import structlog

from agentfsm import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    ModelContext,
    Runtime,
)
from agentfsm.events import LoopPaused
from agentfsm.mcp import mcp_tools
from agentfsm.testing import ScriptedProvider, call, calls, text

structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
)

SERVER = Path(__file__).with_name("mcp_calc_server.py")

arithmetic = ScriptedProvider(
    [
        calls(call("calc_add", a=2, b=3), call("calc_multiply", a=6, b=7)),
        text("2 + 3 = 5 and 6 x 7 = 42."),
    ]
)
division = ScriptedProvider(
    [
        calls(call("calc_divide", a=1, b=0)),
        calls(call("calc_divide", a=84, b=2)),
        text("84 / 2 = 42."),
    ]
)


def show(request: InferenceInput) -> None:
    names = {}
    for item in request.context.items:
        if isinstance(item, FunctionCallItem):
            names[item.call_id] = f"{item.name}({item.arguments})"
        elif isinstance(item, FunctionCallOutputItem):
            status = "error" if item.is_error else "->"
            print(f"  {names[item.call_id]} {status} {item.output}")


async def main() -> None:
    providers = {"arith": arithmetic, "div": division}
    async with Runtime(providers=providers) as runtime:
        # A .py file alone runs on this interpreter.
        calc = await mcp_tools(str(SERVER), prefix="calc", needs_approval={"divide"})
        print(
            "tools:", ", ".join(f"{t.name} ({t.definition.description})" for t in calc)
        )

        print("\n== arithmetic")
        request = InferenceInput(model="arith:m", context=ModelContext(), tools=calc)
        result = await runtime.wait(runtime.run_loop("calc", "2+3, 6x7?", request))
        show(request)
        print(f"answer: {result.answer.content if result.answer else None}")

        print("\n== division, approved by a person")
        request = InferenceInput(model="div:m", context=ModelContext(), tools=calc)
        with runtime.bus.subscribe("loop.paused") as paused:
            loop_id = runtime.run_loop("calc", "84 / 2, and 1 / 0?", request)
            for _ in range(2):  # each batch calling calc_divide waits for a person
                event = await paused.receive()
                assert isinstance(event, LoopPaused)
                print(f"paused: {event.reason}; approved")
                runtime.resume(loop_id)
        result = await runtime.wait(loop_id)
        show(request)
        print(f"answer: {result.answer.content if result.answer else None}")
    print(f"\nsession closed; {result.tool_calls} calls in the last loop")


if __name__ == "__main__":
    anyio.run(main)
