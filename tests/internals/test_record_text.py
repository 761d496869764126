"""`_rows.record_text` writes a record field by field (not through pydantic's
serializer, for speed): what it writes must read back (`_rows.record_of`) as
the record it was given, for records of every shape, a record with every
field away from its default included (a field added to `LoopRecord` and not
to `record_text` reads back at its default, and fails here)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from agentfsm.inference import InferenceOutput
from agentfsm.interception import ToolBatch
from agentfsm.messages import (
    FunctionCallItem,
    ModelMessageItem,
    TokenUsage,
    UserMessage,
)
from agentfsm.record import (
    DecisionRecord,
    LoopRecord,
    MessagesRecord,
    OptionsRecord,
    PauseRecord,
    RequestRecord,
    ResumeRecord,
    StepRecord,
    TurnRecord,
)
from agentfsm.results import ErrorInfo, LoopStatus, PathStep
from agentfsm.states import LoopState, Outcome, Trigger
from agentfsm.store._rows import (
    SHARED,
    ModelTexts,
    record_of,
    record_text,
    shared_text,
)

WHEN = datetime(2026, 12, 2, 9, 30, 15, 123456, tzinfo=UTC)
INPUT = RequestRecord(
    model="scripted:m",
    settings={"temperature": 0.5, "stop_sequences": ["\n"]},
    tools=("add",),
    tool_schemas=("0123456789abcdef",),
    instructions="be brief",
    context_items=1,
    own_context=True,
)
LATER = INPUT.model_copy(update={"context_items": 3, "instructions": "ünïcode ✓"})
CALL = FunctionCallItem(call_id="c1", name="add", arguments='{"a": 1}')
ANSWER = ModelMessageItem(content='the "answer"')
PATH = (
    PathStep(LoopState.idle, Trigger.start, LoopState.context_update),
    PathStep(LoopState.context_update, Trigger.infer, LoopState.inference),
)


def minimal(**changes: Any) -> LoopRecord:
    """A record with every field it can at its default."""
    values: dict[str, Any] = {
        "loop_id": "L",
        "agent_id": "agent",
        "started_at": WHEN,
        "input": INPUT,
        "handlers": (),
        "options": OptionsRecord(
            max_turns=10,
            stop_when=(),
            tool_execution="sequential",
            max_tool_concurrency=4,
            tool_wrappers=(),
            model_wrappers=(),
            steering_mode="all",
            follow_up_mode="all",
            inference_timeout=None,
            deadline=None,
            max_retries=2,
            retry_backoff=0.5,
            structured_output_retries=2,
            finish_turn=None,
        ),
        "state": LoopState.context_update,
        "status": LoopStatus.running,
        "seq": 1,
        "path": PATH[:1],
        "context_items": 0,
        "model_requests": 0,
        "tool_calls": 0,
        "structured_failures": 0,
        "usage": TokenUsage(),
        "turn": TurnRecord(request=INPUT),
    }
    return LoopRecord(**{**values, **changes})


def maximal() -> LoopRecord:
    """A record with every field away from its default (not one a loop could
    be in: each field is what matters here)."""
    decision = DecisionRecord(
        kind="rewrite", dest=LoopState.model_message, payload=ANSWER, reason="r"
    )
    return minimal(
        handlers=("mod:gate",),
        state=LoopState.function_call,
        status=LoopStatus.done,
        seq=9,
        path=PATH,
        context_items=3,
        pending=StepRecord(
            trigger=Trigger.call_tools,
            payload=ToolBatch(calls=(CALL,), denied={"c1": "no"}),
            reason="pending reason",
        ),
        step=StepRecord(trigger=Trigger.infer, payload=LATER, reason="why"),
        pause=PauseRecord(
            source=LoopState.inference,
            trigger=Trigger.call_tools,
            dest=LoopState.function_call,
            seq=7,
            payload=MessagesRecord(messages=(UserMessage(content="m"),)),
            handler=0,
            reason="approve?",
            original_dest=LoopState.function_call,
        ),
        resume=ResumeRecord(
            decision=decision, handler=0, original_dest=LoopState.function_call
        ),
        model_requests=2,
        tool_calls=1,
        structured_failures=1,
        usage=TokenUsage(input_tokens=12, output_tokens=3, cached_input_tokens=1),
        steering=(UserMessage(content="steer"),),
        follow_ups=(UserMessage(content="then"),),
        turn=TurnRecord(
            request=LATER,
            output=InferenceOutput(items=(CALL,), finish_reason="tool_calls"),
            message=ANSWER,
            answer_at=2,
            history=3,
            last_tools=("add",),
        ),
        cancel_requested=True,
        cancel_reason="stop",
        deadline_at=12.5,
        deadline_utc=WHEN,
        outcome=Outcome.answered,
        reason="because",
        answer=ANSWER,
        parsed={"n": [1, 2.5, None, True, "x"]},
        error=ErrorInfo(type="ValueError", message="bad value"),
        ended_at=WHEN,
    )


def read_back(record: LoopRecord, path_length: int | None) -> LoopRecord:
    """`record` through its row's text and its run's shared text."""
    texts = ModelTexts()
    text = record_text(record, path_length, None, texts)
    again = record_text(record, path_length, None, texts)  # from `texts` now
    assert again == text
    shared = json.loads(shared_text(record))
    path = PATH_STEPS_DATA if path_length is not None else []
    return record_of(json.loads(text), shared, list(path))


PATH_STEPS_DATA = [list(step) for step in PATH]


@pytest.mark.parametrize("path_length", [None, 1, 2])
@pytest.mark.parametrize("make", [minimal, maximal], ids=["minimal", "maximal"])
def test_a_record_reads_back_as_it_was(make: Any, path_length: int | None) -> None:
    record = make()
    if path_length is not None:
        record = record.model_copy(update={"path": PATH[:path_length]})
    assert read_back(record, path_length) == record


def test_the_maximal_record_leaves_no_field_at_its_default() -> None:
    """(The test above is only as good as this; what a run's records share
    is the shared text's, not `record_text`'s.)"""
    record = maximal()
    for name, field in LoopRecord.model_fields.items():
        if not field.is_required() and name not in SHARED:
            assert getattr(record, name) != field.get_default(
                call_default_factory=True
            ), name
    for name, field in TurnRecord.model_fields.items():
        if not field.is_required():
            assert getattr(record.turn, name) != field.get_default(), name


def test_fields_at_their_defaults_are_left_out() -> None:
    """A record of a loop in its stride writes what moved, not 20 nulls."""
    data = json.loads(record_text(minimal(), 1))
    assert data == {
        "path": 1,
        "input": {"context_items": 1, "instructions": "be brief"},
        "state": "context_update",
        "status": "running",
        "seq": 1,
        "context_items": 0,
        "model_requests": 0,
        "tool_calls": 0,
        "structured_failures": 0,
        "usage": json.loads(TokenUsage().model_dump_json()),
        "turn": {"history": 0},
    }


def test_the_input_is_not_written_again() -> None:
    """The turn's request and an inference step's payload, when they are the
    input (the very object), are the shared text's."""
    record = minimal(step=StepRecord(trigger=Trigger.infer, payload=INPUT))
    data = json.loads(record_text(record, 1))
    assert data["step"] == {"trigger": "infer"}
    assert "request" not in data["turn"]
    assert read_back(record, 1) == record
    own = minimal(
        step=StepRecord(trigger=Trigger.infer, payload=None),
        turn=TurnRecord(request=LATER),
    )
    data = json.loads(record_text(own, 1))
    assert data["step"] == {"trigger": "infer", "payload": None}
    assert data["turn"]["request"]["context_items"] == 3
    assert read_back(own, 1) == own


def test_model_texts_are_kept_by_identity_while_the_model_lives() -> None:
    texts = ModelTexts()
    first = UserMessage(content="a")
    assert texts.text(first) == first.model_dump_json()
    equal = UserMessage(content="a")
    other = UserMessage(content="b")
    assert texts.text(other) == other.model_dump_json()
    assert texts.text(equal) == equal.model_dump_json()
    big = UserMessage(content="x" * (ModelTexts.LONGEST + 1))
    assert texts.text(big) == big.model_dump_json()
    assert id(big) not in texts._known  # large texts are not kept
    for n in range(ModelTexts.KEPT + 10):  # bounded
        texts.text(UserMessage(content=str(n)))
    assert len(texts._known) <= ModelTexts.KEPT
