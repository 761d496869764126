"""A situation processor: fire-and-forget loops, answers taken from the bus.

Three situations arrive for three agents. The processor starts one loop for
each with `runtime.run_loop(...)`, which returns a `loop_id` at once while the
loop runs in the background. It then reacts to `model.answer` events from a
bus subscription, in whatever order the loops finish, and stops listening once
every loop has answered.

The model is a `FunctionProvider`: on a fresh question it calls the
`lookup` tool, and once the tool has answered it replies with what it found.

Run it with `python examples/situation_processor.py` (no network).
"""

from __future__ import annotations

import logging

import anyio
import structlog

from agentfsm import (
    FunctionCallOutputItem,
    FunctionProvider,
    InferenceInput,
    InferenceOutput,
    ModelContext,
    Runtime,
    UserMessage,
    tool,
)
from agentfsm.events import ModelAnswer
from agentfsm.testing import call, calls, text

# The library logs transitions at debug and never configures structlog itself.
structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
)

# key -> (status, seconds the lookup takes): the slow ones answer last.
RECORDS = {
    "order 1042": ("shipped on Monday, arriving Thursday", 0.03),
    "invoice 77": ("paid in full on the 3rd", 0.01),
    "ticket 9": ("escalated to the network team", 0.02),
}


@tool
async def lookup(key: str) -> str:
    """Look a record up by its key."""
    status, seconds = RECORDS.get(key, ("no such record", 0.0))
    await anyio.sleep(seconds)
    return status


def model(request: InferenceInput) -> InferenceOutput:
    """Call `lookup` for a new question; answer once its output is in the context."""
    last = request.context.items[-1]
    if isinstance(last, UserMessage):
        key = last.text.removeprefix("What is the status of ").rstrip("?")
        return calls(call("lookup", key=key))
    if isinstance(last, FunctionCallOutputItem):
        return text(f"Status: {last.output}.")
    return text("I have nothing to add.")


SITUATIONS = {
    "shipping-agent": "What is the status of order 1042?",
    "billing-agent": "What is the status of invoice 77?",
    "support-agent": "What is the status of ticket 9?",
}


async def main() -> None:
    async with Runtime(providers={"fn": FunctionProvider(model)}) as runtime:
        # Subscribe first: an answer published before the subscription is not seen.
        with runtime.bus.subscribe("model.answer") as answers:
            pending: dict[str, str] = {}
            for agent_id, situation in SITUATIONS.items():
                request = InferenceInput(
                    model="fn:records", context=ModelContext(), tools=(lookup,)
                )
                loop_id = runtime.run_loop(agent_id, situation, request)
                pending[loop_id] = agent_id
                print(f"started {agent_id}: loop {loop_id}")
            print(f"{len(pending)} loops running; waiting for their answers")

            async for event in answers:
                # The subscription yields `AgentEvent`; narrow it for the type checker.
                assert isinstance(event, ModelAnswer)
                agent_id = pending.pop(event.loop_id)
                print(f"answer from {agent_id}: {event.message.content}")
                if not pending:
                    break
        print(f"all {len(SITUATIONS)} agents answered")


if __name__ == "__main__":
    anyio.run(main)
