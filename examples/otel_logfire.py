"""Tracing loops with Logfire: GenAI spans of the loop, its requests and tools.

`logfire.configure()` sets OpenTelemetry's tracer provider; `OpenTelemetry()`
traces every loop of the runtime to it. Here nothing leaves the machine
(`send_to_logfire=False`): Logfire prints each span to the console as it
starts, indented under its parent. Drop that argument (and log in with
`logfire auth`) to see the same trace in Logfire's UI, or point
`OTEL_EXPORTER_OTLP_ENDPOINT` at any OpenTelemetry backend.

The loop asks for the weather in two cities (a tool), pauses for approval
before a booking (a tool that needs approval), and answers once it is
approved: the paused part and the resumed part are two `invoke_agent` spans,
the second linked to the first.

Run: `pip install logfire 'agentfsm[otel]'`, then `python examples/otel_logfire.py`.
"""

from __future__ import annotations

import anyio
import logfire

from agentfsm import InferenceInput, ModelContext, Runtime, tool
from agentfsm.otel import OpenTelemetry, conversation
from agentfsm.testing import ScriptedProvider, call, calls, text


@tool
async def weather(city: str) -> str:
    """The weather in a city today."""
    with logfire.span("weather service {city}", city=city):  # nests under the tool
        return {"Lisbon": "18 C, sunny", "Porto": "14 C, rain"}[city]


@tool(needs_approval=True)
async def book_train(origin: str, destination: str) -> str:
    """Book a train ticket."""
    return f"booked {origin} -> {destination}"


async def main() -> None:
    logfire.configure(
        send_to_logfire=False,
        service_name="otel-example",
        console=logfire.ConsoleOptions(colors="never", include_timestamps=False),
    )
    provider = ScriptedProvider(
        [
            calls(
                call("weather", city="Lisbon"),
                call("weather", city="Porto"),
            ),
            calls(call("book_train", origin="Porto", destination="Lisbon")),
            text("Lisbon is sunny (18 C): I booked you the train from Porto."),
        ]
    )
    request = InferenceInput(
        model="scripted:planner",
        context=ModelContext(instructions="Plan a day trip."),
        tools=[weather, book_train],
    )
    async with Runtime(
        providers={"scripted": provider},
        extensions=[OpenTelemetry(capture_content=False)],
    ) as runtime:
        pauses = runtime.bus.subscribe("loop.paused")
        with conversation("trip-7"), logfire.span("plan a trip"):
            loop_id = runtime.run_loop(
                "trip-planner", "Sunny city for tomorrow?", request
            )
        await pauses.receive()
        print("paused:", runtime.get(loop_id).pause_reason)
        with logfire.span("approve the booking"):  # the resumed part nests here
            runtime.resume(loop_id)
        result = await runtime.wait(loop_id)
    print("answer:", result.answer.content if result.answer else None)


if __name__ == "__main__":
    anyio.run(main)
