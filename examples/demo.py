"""What `make demo` runs: one streaming loop with a tool, on the scripted provider.

The loop asks for the weather, the model calls the `weather` tool, then streams
its answer. The demo prints the answer as its chunks arrive (`inference.stream`
events carrying `TextDelta`s), then every event of the loop, one line each,
then the path the loop took and the tokens it used.

Run it with `python examples/demo.py` (no network: the model is a script).
"""

from __future__ import annotations

import logging

import anyio
import structlog

from agentfsm import AgentEvent, InferenceInput, ModelContext, Runtime, TokenUsage, tool
from agentfsm.events import (
    FunctionCallCompleted,
    InferenceStream,
    LoopIdle,
    LoopTransition,
)
from agentfsm.providers import TextDelta, ToolCallDelta
from agentfsm.testing import ScriptedProvider, call, calls, text

# The library logs transitions at debug and never configures structlog itself.
structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
)


@tool
def weather(city: str) -> str:
    """Today's weather in a city."""
    return f"{city}: 18 C, light rain in the afternoon"


# One output per model request: first a tool call, then the answer.
SCRIPT = ScriptedProvider(
    [
        calls(
            call("weather", city="Lisbon"),
            usage=TokenUsage(input_tokens=52, output_tokens=14),
        ),
        text(
            "Lisbon is at 18 C today, with light rain in the afternoon: "
            "take an umbrella if you go out after lunch.",
            usage=TokenUsage(input_tokens=97, output_tokens=26),
        ),
    ]
)


def detail(event: AgentEvent) -> str:
    """A few words about an event, for its line in the event list."""
    match event:
        case LoopTransition():
            return f"{event.source} --{event.trigger}--> {event.dest}"
        case InferenceStream(delta=TextDelta() as delta):
            return f"text {delta.text!r}"
        case InferenceStream(delta=ToolCallDelta(name=str(name))):
            return f"tool call {name}"
        case InferenceStream(delta=ToolCallDelta() as delta):
            return f"arguments {delta.arguments!r}"
        case FunctionCallCompleted():
            return f"{event.call.name} -> {event.output.output!r}"
        case LoopIdle():
            return f"outcome {event.outcome}"
        case _:
            return ""


async def main() -> None:
    request = InferenceInput(
        model="scripted:demo",
        context=ModelContext(instructions="You answer questions about the weather."),
        tools=(weather,),
        streaming=True,
    )
    async with Runtime(providers={"scripted": SCRIPT}) as runtime:
        # stream=True keeps the loop's events from its first: `events` may be
        # called whenever, and its iteration ends with the loop.
        loop_id = runtime.run_loop(
            "weather-agent", "Do I need an umbrella?", request, stream=True
        )
        print(f"loop {loop_id} started")
        print("answer (streamed): ", end="", flush=True)
        seen: list[AgentEvent] = []
        with runtime.events(loop_id) as events:
            async for event in events:
                seen.append(event)
                if isinstance(event, InferenceStream) and isinstance(
                    event.delta, TextDelta
                ):
                    print(event.delta.text, end="", flush=True)
        print()
        result = await runtime.wait(loop_id)

    print("\nevents (seq, type, state):")
    for event in seen:
        print(
            f"  {event.seq:3}  {event.type:24} {event.state:20} {detail(event)}".rstrip()
        )

    print("\npath:", " -> ".join(result.states))
    usage = result.usage
    print(
        f"tokens: {usage.input_tokens} in + {usage.output_tokens} out = "
        f"{usage.total_tokens} total, over {result.model_requests} model requests "
        f"and {result.tool_calls} tool call(s)"
    )
    print("outcome:", result.outcome)


if __name__ == "__main__":
    anyio.run(main)
