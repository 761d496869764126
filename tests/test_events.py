"""Every event round-trips through JSON; a real run's events do too, with seq 1..n."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from datetime import UTC, datetime
from typing import Any, get_args

import anyio
import pytest
from pydantic import ValidationError

from agentfsm import Pause, PendingTransition, Rewrite, Runtime
from agentfsm.events import (
    EVENT_TYPES,
    AgentEvent,
    AgentEventAdapter,
    FunctionCallCompleted,
    FunctionCallProgress,
    FunctionCallStarted,
    InferenceCompleted,
    InferenceStream,
    InputDropped,
    LoopDetached,
    LoopFailed,
    LoopIdle,
    LoopPaused,
    LoopRecovered,
    LoopResumed,
    LoopStarted,
    LoopTransition,
    ModelAnswer,
    RequestSummary,
    TransitionIntercepted,
)
from agentfsm.exceptions import ProviderError
from agentfsm.interception import Decision, ToolBatch
from agentfsm.messages import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ModelMessageItem,
    ReasoningItem,
    TokenUsage,
    UserMessage,
)
from agentfsm.providers import (
    InferenceOutput,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
)
from agentfsm.states import LoopState, Outcome, Trigger
from agentfsm.testing import (
    EventRecorder,
    ScriptedProvider,
    call,
    calls,
    reasoning,
    text,
)
from tests.helpers import request

S = LoopState
T = Trigger
TS = datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
CALL = FunctionCallItem(call_id="call_1", name="add", arguments='{"a":1,"b":2}')
USAGE = TokenUsage(
    input_tokens=120, output_tokens=30, reasoning_tokens=10, cached_input_tokens=64
)
OUTPUT = InferenceOutput(
    items=(ReasoningItem(content="add them", encrypted_content="opaque=="), CALL),
    token_usage=USAGE,
    raw_response={
        "id": "resp_1",
        "output": [{"type": "function_call", "arguments": '{"a":1,"b":2}'}],
        "usage": {"total": 150, "ratio": 0.25, "cached": None, "ok": True},
    },
    finish_reason="tool_calls",
)
SUMMARY = RequestSummary(
    model="scripted:test",
    max_output_tokens=256,
    reasoning_effort="low",
    tool_choice="auto",
    tools=("add", "search"),
    instructions="Be brief.",
    context_items=3,
)
BATCH = ToolBatch(
    calls=(CALL, FunctionCallItem(call_id="call_2", name="rm", arguments="{}")),
    denied={"call_2": "not allowed"},
)


def envelope(seq: int, state: LoopState) -> dict[str, Any]:
    return {
        "event_id": f"loop-1:{seq}",
        "loop_id": "loop-1",
        "agent_id": "agent-1",
        "seq": seq,
        "ts": TS,
        "state": state,
    }


EXAMPLES: list[Any] = [
    pytest.param(
        LoopStarted(
            **envelope(1, S.idle),
            message=UserMessage(content="1+2?"),
            model="scripted:test",
            streaming=False,
        ),
        id="loop.started",
    ),
    pytest.param(
        LoopStarted(
            **envelope(1, S.idle), message=None, model="scripted:test", streaming=True
        ),
        id="loop.started-continue",
    ),
    pytest.param(
        TransitionIntercepted(
            **envelope(2, S.inference),
            source=S.inference,
            trigger=T.call_tools,
            dest=S.function_call,
            decision="rewrite",
            new_dest=S.function_call,
            payload=BATCH,
            handler=0,
        ),
        id="transition.intercepted-tool-batch",
    ),
    pytest.param(
        TransitionIntercepted(
            **envelope(2, S.context_update),
            source=S.context_update,
            trigger=T.infer,
            dest=S.inference,
            decision="rewrite",
            new_dest=S.inference_streaming,
            payload=SUMMARY,
            handler=1,
        ),
        id="transition.intercepted-request",
    ),
    pytest.param(
        TransitionIntercepted(
            **envelope(2, S.function_call),
            source=S.function_call,
            trigger=T.steer,
            dest=S.context_update,
            decision="rewrite",
            payload=(UserMessage(content="also"), UserMessage(content="this")),
            handler=0,
        ),
        id="transition.intercepted-messages",
    ),
    pytest.param(
        TransitionIntercepted(
            **envelope(2, S.model_message),
            source=S.model_message,
            trigger=T.finish,
            dest=S.idle,
            decision="rewrite",
            payload=ModelMessageItem(content="3", refusal=None),
            handler=0,
        ),
        id="transition.intercepted-message",
    ),
    pytest.param(
        TransitionIntercepted(
            **envelope(2, S.idle),
            source=S.idle,
            trigger=T.start,
            dest=S.context_update,
            decision="abort",
            reason="budget",
            handler=-1,
        ),
        id="transition.intercepted-abort",
    ),
    pytest.param(
        LoopPaused(
            **envelope(3, S.inference),
            source=S.inference,
            trigger=T.call_tools,
            dest=S.function_call,
            reason="approve rm",
            payload=BATCH,
        ),
        id="loop.paused",
    ),
    pytest.param(
        LoopResumed(**envelope(4, S.inference), decision="proceed"),
        id="loop.resumed",
    ),
    pytest.param(
        LoopTransition(
            **envelope(5, S.inference_streaming),
            source=S.context_update,
            trigger=T.infer_streaming,
            dest=S.inference_streaming,
            rewritten_from=S.inference,
        ),
        id="loop.transition",
    ),
    pytest.param(
        InferenceStream(
            **envelope(6, S.inference_streaming), index=0, delta=TextDelta(text="Hel")
        ),
        id="inference.stream-text",
    ),
    pytest.param(
        InferenceStream(
            **envelope(6, S.inference_streaming),
            index=1,
            delta=ReasoningDelta(text="think"),
        ),
        id="inference.stream-reasoning",
    ),
    pytest.param(
        InferenceStream(
            **envelope(6, S.inference_streaming),
            index=2,
            delta=ToolCallDelta(
                index=0, call_id="call_1", name="add", arguments='{"a"'
            ),
        ),
        id="inference.stream-tool-call",
    ),
    pytest.param(
        InferenceCompleted(
            **envelope(7, S.inference), model="scripted:test", output=OUTPUT
        ),
        id="inference.completed",
    ),
    pytest.param(
        LoopRecovered(
            **envelope(8, S.function_call),
            status="paused",
            uncertain_calls=("call_1",),
        ),
        id="loop.recovered",
    ),
    pytest.param(
        FunctionCallStarted(**envelope(8, S.function_call), call=CALL),
        id="function_call.started",
    ),
    pytest.param(
        FunctionCallProgress(
            **envelope(9, S.function_call),
            call_id="call_1",
            progress={"done": 3, "of": 10, "steps": ["a", "b"], "rate": 0.5},
        ),
        id="function_call.progress",
    ),
    pytest.param(
        FunctionCallCompleted(
            **envelope(10, S.function_call),
            call=CALL,
            output=FunctionCallOutputItem.error(
                "call_1", "tool 'add' raised ValueError"
            ),
            duration=0.125,
        ),
        id="function_call.completed",
    ),
    pytest.param(
        ModelAnswer(
            **envelope(11, S.model_message),
            message=ModelMessageItem(content="", refusal="I can't"),
        ),
        id="model.answer",
    ),
    pytest.param(
        LoopFailed(
            **envelope(12, S.inference), error_type="ProviderError", message="boom"
        ),
        id="loop.failed",
    ),
    pytest.param(
        LoopDetached(
            **envelope(12, S.function_call),
            reason="loops.db: database or disk is full",
            error_type="StoreError",
        ),
        id="loop.detached",
    ),
    pytest.param(
        InputDropped(
            **envelope(12, S.inference),
            input="steer",
            reason="the message must be a string, got a number",
        ),
        id="input.dropped",
    ),
    pytest.param(
        LoopIdle(
            **envelope(13, S.idle),
            outcome=Outcome.answered,
            answer=ModelMessageItem(content="3"),
            usage=USAGE,
            model_requests=2,
            tool_calls=1,
        ),
        id="loop.idle",
    ),
]


def example_events() -> list[AgentEvent]:
    return [p.values[0] for p in EXAMPLES]


@pytest.mark.parametrize("event", EXAMPLES)
def test_round_trip(event: AgentEvent) -> None:
    """An event read back from its JSON equals the original, nested payloads included."""
    again = AgentEventAdapter.validate_json(event.model_dump_json())
    assert again == event
    assert type(again) is type(event)


@pytest.mark.parametrize("event", EXAMPLES)
def test_round_trip_python(event: AgentEvent) -> None:
    """An event read back from its JSON-mode dict equals the original."""
    assert AgentEventAdapter.validate_python(event.model_dump(mode="json")) == event


def test_every_event_type_has_an_example() -> None:
    """Each type in EVENT_TYPES has an example above, so a new event needs a test."""
    assert {e.type for e in example_events()} == set(EVENT_TYPES)


def test_event_types_match_union() -> None:
    """EVENT_TYPES lists exactly the members of the AgentEvent union, once each."""
    union = get_args(get_args(AgentEvent)[0])
    types = [cls.model_fields["type"].default for cls in union]
    assert sorted(types) == sorted(EVENT_TYPES)
    assert len(set(EVENT_TYPES)) == len(EVENT_TYPES)


def test_nested_payload_types_survive() -> None:
    """Payloads in the `EventPayload` union come back as the same classes."""
    for event in example_events():
        if isinstance(event, TransitionIntercepted | LoopPaused):
            again = AgentEventAdapter.validate_json(event.model_dump_json())
            assert isinstance(again, TransitionIntercepted | LoopPaused)
            assert type(again.payload) is type(event.payload)


def test_events_are_frozen() -> None:
    """Events cannot be changed after they are published."""
    event = example_events()[0]
    with pytest.raises(ValidationError):
        event.seq = 99  # type: ignore[misc]


def test_events_hold_no_extra_or_private_values() -> None:
    """Those two pydantic slots are None, read from the class; a value is refused."""
    event = example_events()[0]
    assert event.__pydantic_extra__ is None
    assert event.__pydantic_private__ is None
    with pytest.raises(TypeError, match="no extra or private values"):
        object.__setattr__(event, "__pydantic_extra__", {"surprise": 1})


def test_unknown_type_rejected() -> None:
    """JSON with an unknown `type` does not validate."""
    data = example_events()[0].model_dump(mode="json")
    data["type"] = "loop.exploded"
    with pytest.raises(ValidationError):
        AgentEventAdapter.validate_python(data)


def test_extra_field_rejected() -> None:
    """Events forbid unknown fields."""
    data = example_events()[0].model_dump(mode="json")
    data["surprise"] = 1
    with pytest.raises(ValidationError):
        AgentEventAdapter.validate_python(data)


class TestRowResponse:
    def test_seed_spelling_accepted(self) -> None:
        """InferenceOutput reads the seed's `rowResponse` as `raw_response`."""
        output = InferenceOutput.model_validate_json('{"rowResponse": {"id": "r1"}}')
        assert output.raw_response == {"id": "r1"}

    def test_field_name_accepted(self) -> None:
        """`raw_response` is accepted too."""
        output = InferenceOutput.model_validate({"raw_response": [1, "two"]})
        assert output.raw_response == [1, "two"]

    def test_dumped_as_raw_response(self) -> None:
        """The output is written with the field name, and reads back equal."""
        output = InferenceOutput.model_validate({"rowResponse": {"id": "r1"}})
        data = output.model_dump(mode="json")
        assert data["raw_response"] == {"id": "r1"}
        assert "rowResponse" not in data
        assert InferenceOutput.model_validate_json(output.model_dump_json()) == output

    def test_inside_an_event(self) -> None:
        """An `inference.completed` event spelled with `rowResponse` validates."""
        event = InferenceCompleted(
            **envelope(7, S.inference), model="scripted:test", output=OUTPUT
        )
        data = event.model_dump(mode="json")
        data["output"]["rowResponse"] = data["output"].pop("raw_response")
        assert AgentEventAdapter.validate_python(data) == event


def _pause_rm(pending: PendingTransition) -> Decision | None:
    batch = pending.payload
    if isinstance(batch, ToolBatch) and any(c.name == "rm" for c in batch.calls):
        return Pause(reason="approve rm")
    return None


def _force_streaming(pending: PendingTransition) -> Decision | None:
    if pending.trigger is T.infer:
        return Rewrite(dest=S.inference_streaming)
    return None


async def test_events_of_a_real_run() -> None:
    """Events of real loops round-trip and carry seq 1..n without holes per loop."""
    usage = TokenUsage(input_tokens=10, output_tokens=5)
    plain = ScriptedProvider(
        [
            reasoning("sum", calls(call("add", a=1, b=2), usage=usage, text="let me")),
            text("3", usage=usage),
        ]
    )
    pausing = ScriptedProvider(
        [calls(call("rm"), call("add", a="x", b=1)), text("done")]
    )
    failing = ScriptedProvider([ProviderError("boom")])
    providers = {"plain": plain, "pausing": pausing, "failing": failing}
    with anyio.fail_after(10):
        async with Runtime(providers=providers) as runtime:
            recorder = EventRecorder(runtime.bus)
            ids = [
                runtime.run_loop("a", "1+2?", request(model="plain:m")),
                runtime.run_loop("a", "1+2?", request(model="plain:m", streaming=True)),
                runtime.run_loop(
                    "b", "1+2?", request(model="plain:m"), _force_streaming
                ),
                runtime.run_loop(
                    "b", "clean up", request(model="pausing:m"), _pause_rm
                ),
                runtime.run_loop("c", "hi", request(model="failing:m")),
            ]
            await anyio.wait_all_tasks_blocked()
            runtime.resume(ids[3])
            results = [await runtime.wait(loop_id) for loop_id in ids]
            events = recorder.events
            recorder.close()
    assert [r.outcome for r in results] == [
        Outcome.answered,
        Outcome.answered,
        Outcome.answered,
        Outcome.answered,
        Outcome.failed,
    ]
    # (A recovered loop's and a detached one's are in tests/test_durable*.py,
    # a dropped input's in tests/test_temporal_defense.py.)
    assert set(EVENT_TYPES) - {e.type for e in events} == {
        "function_call.progress",
        "loop.recovered",
        "loop.detached",
        "input.dropped",
    }
    for event in events:
        assert AgentEventAdapter.validate_json(event.model_dump_json()) == event
        # Built by the loop without validation: copies and pickles still work.
        assert copy.deepcopy(event) == event == pickle.loads(pickle.dumps(event))
        assert event.model_copy(update={"seq": 0}).seq == 0
        assert event.model_fields_set == set(type(event).model_fields)
    for loop_id in ids:
        mine = [e for e in events if e.loop_id == loop_id]
        assert [e.seq for e in mine] == list(range(1, len(mine) + 1))
        assert [e.event_id for e in mine] == [f"{loop_id}:{e.seq}" for e in mine]
        assert mine[0].type == "loop.started"
        assert mine[-1].type == "loop.idle"
        assert [e.ts for e in mine] == sorted(e.ts for e in mine)


_UNWATCHED = """
import sys
import anyio
import agentfsm
from agentfsm import FunctionProvider, InferenceInput, InferenceOutput, Pause
from agentfsm import ModelContext, ModelMessageItem, Rewrite, Runtime, Trigger

def answer(request):
    return InferenceOutput(items=[ModelMessageItem(content="hi")])

def rewrite(pending):  # a rewritten request is what events summarize
    if pending.trigger is Trigger.infer:
        return Rewrite(payload=pending.payload)

def pause(pending):
    if pending.trigger is Trigger.infer:
        return Pause(reason="look first")

async def main():
    async with Runtime(providers={"fn": FunctionProvider(answer)}) as runtime:
        request = InferenceInput(model="fn:x", context=ModelContext())
        result = await runtime.wait(runtime.run_loop("a", "hello", request))
        assert result.answer.content == "hi", result
        result = await runtime.wait(runtime.run_loop("a", "hi", request, rewrite))
        assert result.answer.content == "hi", result
        paused = runtime.run_loop("a", "hi", request, pause)
        await anyio.wait_all_tasks_blocked()
        runtime.resume(paused)
        assert (await runtime.wait(paused)).answer.content == "hi"
        print("unwatched", "agentfsm.events" in sys.modules)
        with runtime.bus.subscribe("loop.idle") as idle:
            await runtime.wait(runtime.run_loop("a", "again", request))
            print("watched", (await idle.receive()).type)

anyio.run(main)
"""


def test_a_loop_nobody_watches_never_imports_the_event_classes() -> None:
    """`agentfsm.events` is imported by the first subscription, not by loops."""
    done = subprocess.run(
        [sys.executable, "-c", _UNWATCHED],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    printed = [line for line in done.stdout.splitlines() if "watched" in line]
    assert printed == ["unwatched False", "watched loop.idle"]
