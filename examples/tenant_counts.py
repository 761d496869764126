"""An extension of one's own: tool calls and model tokens counted per tenant.

A SaaS runs its customers' agents in one runtime and bills by use. The
`TenantMeter` extension takes part in every loop whose agent id names a tenant
(`tenant/agent`), and in no other (`open` returns None: those loops pay
nothing for it). Its part in a loop counts each tool call as it passes
(the `call_tool` layer, inside the loop's own tool wrappers) and adds the
loop's tokens when the loop ends (the `loop_ended` hook, which reads the loop
through its read-only `LoopInfo`).

Run it with `python examples/tenant_counts.py` (no network).
"""

from __future__ import annotations

import logging
from collections import Counter

import anyio
import structlog

from agentfsm import (
    InferenceInput,
    ModelContext,
    Runtime,
    TokenUsage,
    ToolCall,
    ToolResult,
    tool,
)
from agentfsm.extensions import Extension, LoopExtension, LoopInfo
from agentfsm.testing import ScriptedProvider, call, calls, text
from agentfsm.tools import ToolNext

structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
)


class TenantMeter(Extension):
    """Counts, per tenant, the tool calls its loops make and the tokens they use."""

    def __init__(self) -> None:
        self.tool_calls: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()

    def open(self, loop: LoopInfo, /) -> LoopExtension | None:
        tenant, _, agent = loop.agent_id.partition("/")
        return _Metered(self, tenant, loop) if agent else None


class _Metered(LoopExtension):
    def __init__(self, meter: TenantMeter, tenant: str, loop: LoopInfo) -> None:
        self.meter, self.tenant, self.loop = meter, tenant, loop

    async def call_tool(self, call: ToolCall, next_: ToolNext, /) -> ToolResult:
        self.meter.tool_calls[self.tenant] += 1
        return await next_(call)

    def loop_ended(self) -> None:
        self.meter.tokens[self.tenant] += self.loop.usage.total_tokens


@tool
def lookup(order: str) -> str:
    """Look an order up."""
    return f"order {order}: shipped"


USAGE = TokenUsage(input_tokens=6, output_tokens=4)
"""What the scripted model reports for each request."""


def script(orders: list[str]) -> ScriptedProvider:
    """A model that looks each order up, then answers."""
    looked_up = calls(*(call("lookup", order=o) for o in orders), usage=USAGE)
    return ScriptedProvider([looked_up, text("All shipped.", usage=USAGE)])


async def main() -> None:
    meter = TenantMeter()
    request = InferenceInput(model="scripted:m", context=ModelContext(), tools=[lookup])
    runs = [
        ("acme/support", ["A1", "A2"]),
        ("globex/support", ["G1"]),
        ("acme/billing", ["A3"]),
        ("internal-smoke-test", ["T1"]),  # no tenant: not metered
    ]
    for agent_id, orders in runs:
        async with Runtime(
            providers={"scripted": script(orders)}, extensions=[meter]
        ) as runtime:
            result = await runtime.wait(
                runtime.run_loop(agent_id, "Where are my orders?", request)
            )
            print(f"{agent_id}: {result.outcome}, {result.tool_calls} tool calls")
    for tenant in sorted(meter.tool_calls):
        print(
            f"tenant {tenant}: {meter.tool_calls[tenant]} tool calls, "
            f"{meter.tokens[tenant]} tokens"
        )


if __name__ == "__main__":
    anyio.run(main)
