"""Seeing what a loop did: an event log, its path diagram and its timeline.

The loop runs with `Runtime(event_log=...)`, which appends every event to a
JSON-lines file. Its interception handler rewrites one transition: after the
tool call, the request that reads the tool's result is sent streaming
(`function_call --infer--> inference` becomes `--infer_streaming-->
inference_streaming`), so the answer arrives chunk by chunk.

Once the runtime has exited, the example reads the log back and prints:

- the path diagram (mermaid): the states the loop visited, each edge labelled
  with the steps that took it, the rewritten one marked with where it was going;
- the timeline: each transition with its time and the time spent in each state,
  the interception decisions, the tool call and the answer.

The same views come from the command line:
`agentfsm inspect FILE --loop ID`, `agentfsm diagram --events FILE --loop ID`.

Run it with `python examples/inspect_rewrite.py` (no network, no graphviz).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import anyio
import structlog

from agentfsm import (
    Decision,
    InferenceInput,
    LoopState,
    ModelContext,
    PendingTransition,
    Rewrite,
    Runtime,
    Trigger,
    tool,
)
from agentfsm.diagrams import LoopPath, render_path_mermaid
from agentfsm.eventlog import read_events
from agentfsm.messages import TokenUsage
from agentfsm.testing import ScriptedProvider, call, calls, text
from agentfsm.timeline import build_timeline, format_table, format_timeline, summarize

# The library logs transitions at debug and never configures structlog itself.
structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
)


@tool
def convert(amount: float, currency: str) -> str:
    """Convert an amount of euros to another currency."""
    rates = {"USD": 1.08, "GBP": 0.85}
    return f"{amount * rates[currency]:.2f} {currency}"


# A scripted model: a tool call first, then the answer.
provider = ScriptedProvider(
    [
        calls(
            call("convert", amount=120, currency="USD"),
            usage=TokenUsage(input_tokens=52, output_tokens=14),
        ),
        text(
            "120 EUR is 129.60 USD.",
            usage=TokenUsage(input_tokens=81, output_tokens=9),
        ),
    ]
)


def stream_after_tools(pending: PendingTransition) -> Decision | None:
    """Send the request that follows a tool call streaming."""
    if pending.source is LoopState.function_call and pending.trigger is Trigger.infer:
        return Rewrite(dest=LoopState.inference_streaming)
    return None


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "events.jsonl"
        async with Runtime(providers={"scripted": provider}, event_log=log) as runtime:
            request = InferenceInput(
                model="scripted:demo", context=ModelContext(), tools=(convert,)
            )
            loop_id = runtime.run_loop(
                "exchange-agent", "What is 120 EUR in USD?", request, stream_after_tools
            )
        # The runtime has exited: every event of the loop is in the log.
        events = list(read_events(log))

    print(format_table(summarize(events)))
    print(render_path_mermaid(LoopPath.from_events(events, loop_id)))
    print(format_timeline(build_timeline(events, loop_id)))


if __name__ == "__main__":
    anyio.run(main)
