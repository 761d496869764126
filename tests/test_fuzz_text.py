"""Random text through every sink at once (issue 25): a property over any
unicode a model, a tool or a user can produce (lone surrogates, NUL, control
characters, very long strings).

The loop runs twice: plainly, and with an event log, a SQLite store and OTel
content capture on. Both end with the same outcome and path; the log reads
back whole (every event, in order, ending with the outcome); the store holds
the outcome the caller was told and the same context. hypothesis drives sync
tests that run their body with `anyio.run`, as tests/test_fuzz.py does.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from agentfsm import (
    FunctionCallItem,
    InferenceInput,
    LoopResult,
    ModelContext,
    Runtime,
    tool,
)
from agentfsm._text import json_text
from agentfsm.eventlog import read_events
from agentfsm.otel import OpenTelemetry
from agentfsm.store import SQLiteStore
from agentfsm.testing import ScriptedProvider, calls, text

BACKENDS = pytest.mark.parametrize("backend", ["asyncio", "trio"])
FUZZ = settings(
    # Modest, for `make test`; hunt longer with AGENTFSM_FUZZ_EXAMPLES=5000.
    max_examples=int(os.environ.get("AGENTFSM_FUZZ_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

CHARACTERS = st.one_of(
    st.characters(codec=None),  # any code point, lone surrogates included
    st.sampled_from(["\x00", "\x1b", "\x7f", "\x85", "\u202e", "\ud800", "\udcff"]),
)
TEXT = st.one_of(
    st.text(CHARACTERS, max_size=40),
    st.builds(
        lambda s, n: s * n,
        st.text(CHARACTERS, min_size=1, max_size=3),
        st.integers(1000, 20_000),
    ),
)

OUTPUTS: list[str] = []
"""The tool's output for the example being run."""


@tool
async def echo(value: str = "") -> str:
    """Return the example's text."""
    return OUTPUTS[0] + value


async def one_run(
    message: str, answer: str, arguments: str, sinks: Path | None
) -> tuple[LoopResult, list[Any]]:
    """Run the loop, with every sink under `sinks` (or none): its result, and
    the context it ended with."""
    call = FunctionCallItem(call_id="c1", name="echo", arguments=arguments)
    provider = ScriptedProvider([calls(call), text(answer)])
    options: dict[str, Any] = {}  # (the request offers the tool to a plain runtime)
    exporter = InMemorySpanExporter()
    tracer = TracerProvider()
    tracer.add_span_processor(SimpleSpanProcessor(exporter))
    if sinks is not None:
        options = {
            "store": SQLiteStore(sinks / "loops.db"),
            "tools": [echo],
            "event_log": sinks / "events.jsonl",
            "extensions": [OpenTelemetry(tracer_provider=tracer, capture_content=True)],
        }
    try:
        async with Runtime(providers={"s": provider}, **options) as rt:
            request = InferenceInput(model="s:m", context=ModelContext(), tools=[echo])
            loop_id = rt.run_loop("agent", message, request)
            result = await rt.wait(loop_id)
            items = list(request.context.items)
    finally:
        tracer.shutdown()
    if sinks is not None:
        assert exporter.get_finished_spans()  # traced, not switched off
    return result, items


async def check(message: str, answer: str, output: str, argument: str) -> None:
    OUTPUTS[:] = [output]
    arguments = json_text({"value": argument})
    plain, plain_items = await one_run(message, answer, arguments, None)
    with tempfile.TemporaryDirectory() as tmp:
        sinks = Path(tmp)
        sunk, items = await one_run(message, answer, arguments, sinks)
        events = list(read_events(sinks / "events.jsonl"))
        async with SQLiteStore(sinks / "loops.db") as store:
            stored = await store.load(sunk.loop_id)
    assert sunk.outcome == plain.outcome
    assert sunk.path == plain.path
    assert sunk.answer == plain.answer
    assert items == plain_items
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[-1].type == "loop.idle"
    assert events[-1].outcome == sunk.outcome
    assert stored is not None
    assert stored.record.outcome == sunk.outcome
    assert list(stored.items) == items


@BACKENDS
@FUZZ
@given(message=TEXT, answer=TEXT, output=TEXT, argument=TEXT)
def test_any_text_reaches_every_sink_whole(
    backend: str, message: str, answer: str, output: str, argument: str
) -> None:
    anyio.run(check, message, answer, output, argument, backend=backend)
