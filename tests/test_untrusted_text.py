"""What a loop takes from a model, a tool and a user (issue 25): text that
cannot be encoded is escaped where it enters, a provider's value of the wrong
type fails the loop naming the provider, and a model's output stays within the
loop's limits. Every sink (event log, SQLite store) reads back whole, and the
store agrees with what the caller is told."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentfsm import (
    Abort,
    Decision,
    FunctionCallItem,
    InferenceInput,
    InferenceOutput,
    LoopResult,
    ModelContext,
    ModelMessageItem,
    Outcome,
    Pause,
    PendingTransition,
    Rewrite,
    Runtime,
    ToolBatch,
    ToolResult,
    UserMessage,
    tool,
)
from agentfsm._text import encodable, json_text, model_json, printable
from agentfsm.eventlog import read_events
from agentfsm.exceptions import ConfigurationError
from agentfsm.inference import OutputCompleted, StreamEvent, TextDelta
from agentfsm.messages import TokenUsage
from agentfsm.providers.function import FunctionProvider
from agentfsm.store import SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text

BAD = "name-\udcff-\ud800"
"""Two lone surrogates: a non-UTF-8 file name as `os.listdir` gives it, and a
`\\ud800` escape a model server's JSON decoded."""
ESCAPED = "name-\\udcff-\\ud800"


@tool
async def listing() -> str:
    """List a directory."""
    return f"files: {BAD}"


@tool
async def structured() -> dict[str, Any]:
    """Return data holding a lone surrogate, in a key and a value."""
    return {BAD: [BAD]}


@tool
async def result() -> ToolResult:
    """Return a ToolResult built without validation."""
    made: ToolResult = construct(
        ToolResult, output=BAD, is_error=False, terminate=False
    )
    return made


def construct(cls: Any, **values: Any) -> Any:
    """A model built without validation, as a provider may build one."""
    return cls.model_construct(**values)


def request(*tools: Any, streaming: bool = False) -> InferenceInput:
    return InferenceInput(
        model="s:m", context=ModelContext(), tools=list(tools), streaming=streaming
    )


async def run_one(
    tmp_path: Path,
    provider: Any,
    tools: list[Any],
    message: str | UserMessage = "go",
    streaming: bool = False,
    **options: Any,
) -> tuple[LoopResult, list[Any], Any]:
    """Run one loop with an event log and a SQLite store: its result, the
    events the log reads back, and the store's record of it."""
    log = tmp_path / "events.jsonl"
    db = tmp_path / "loops.db"
    rt = Runtime(
        providers={"s": provider}, store=SQLiteStore(db), tools=tools, event_log=log
    )
    async with rt:
        loop_id = rt.run_loop(
            "agent", message, request(*tools, streaming=streaming), **options
        )
        result = await rt.wait(loop_id)
    events = list(read_events(log))
    async with SQLiteStore(db) as store:
        stored = await store.load(loop_id)
    assert stored is not None
    return result, events, stored


def assert_agrees(result: LoopResult, events: list[Any], stored: Any) -> None:
    """The log holds every event of the loop, whole, ending with its outcome;
    the store holds the same outcome and a context the JSON sinks can write."""
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[-1].type == "loop.idle"
    assert events[-1].outcome == result.outcome
    assert stored.record.outcome == result.outcome
    for item in stored.items:
        model_json(item).encode()  # raises on a lone surrogate


def assert_over_limit(result: LoopResult, named: str) -> None:
    """The loop failed on a limit, and its error names it."""
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert result.error.type == "OutputLimitExceeded"
    assert named in result.error.message


# ---------------------------------------------------------------- surrogates


@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_lone_surrogates_are_escaped_where_they_enter(
    tmp_path: Path, streaming: bool
) -> None:
    provider = ScriptedProvider(
        [
            calls(call("listing"), call("structured"), call("result")),
            construct(
                InferenceOutput,
                items=(construct(ModelMessageItem, content=f"done {BAD}"),),
            ),
        ]
    )
    tools = [listing, structured, result]
    result_, events, stored = await run_one(
        tmp_path, provider, tools, f"look at {BAD}", streaming
    )
    assert result_.outcome is Outcome.answered, result_.error
    assert result_.answer is not None
    assert result_.answer.content == f"done {ESCAPED}"
    outputs = [i.output for i in stored.items if i.type == "function_call_output"]
    assert outputs == [
        f"files: {ESCAPED}",
        json.dumps({ESCAPED: [ESCAPED]}, separators=(",", ":")),
        ESCAPED,
    ]
    assert stored.items[0].content == f"look at {ESCAPED}"
    assert_agrees(result_, events, stored)
    # The model saw the escaped text too: the second request's context.
    seen = provider.requests[-1].context.items
    assert [i.output for i in seen if i.type == "function_call_output"] == outputs


async def test_escaped_text_is_the_same_in_every_sink(tmp_path: Path) -> None:
    """What the loop holds, the log and the store hold: no sink escapes on its own."""
    provider = ScriptedProvider([calls(call("listing")), text("ok")])
    result_, events, stored = await run_one(tmp_path, provider, [listing], BAD)
    completed = [e for e in events if e.type == "function_call.completed"]
    assert completed[0].output.output == f"files: {ESCAPED}"
    started = [e for e in events if e.type == "loop.started"]
    assert started[0].message.content == ESCAPED
    assert stored.record.input is not None
    assert_agrees(result_, events, stored)


async def test_a_surrogate_in_a_reason_reaches_every_sink(tmp_path: Path) -> None:
    """Text that enters by no message (a stop condition's reason, a cancel
    reason) is escaped too: the store commits the loop's end, the log stays
    on for every later event."""
    log = tmp_path / "events.jsonl"
    db = tmp_path / "loops.db"
    provider = ScriptedProvider([calls(call("listing")), text("b")])
    rt = Runtime(
        providers={"s": provider}, store=SQLiteStore(db), tools=[listing], event_log=log
    )
    async with rt:
        first = rt.run_loop(
            "agent", "hi", request(listing), stop_when=[lambda view: f"why {BAD}"]
        )
        stopped = await rt.wait(first)
        second = rt.run_loop("agent", "hi", request(listing), deadline=60)
        rt.cancel(second, f"because {BAD}")
        cancelled = await rt.wait(second)
    assert stopped.reason == f"why {ESCAPED}"
    assert cancelled.reason == f"because {ESCAPED}"
    events = list(read_events(log))
    ends = {e.loop_id: e.reason for e in events if e.type == "loop.idle"}
    assert ends == {first: stopped.reason, second: cancelled.reason}
    async with SQLiteStore(db) as store:
        for result_ in (stopped, cancelled):
            stored = await store.load(result_.loop_id)
            assert stored is not None
            assert stored.record.reason == result_.reason


@pytest.mark.parametrize("agent_id", [f"agent {BAD}"])
async def test_an_id_that_cannot_be_encoded_is_refused(agent_id: str) -> None:
    """An id is not rewritten (the caller looks loops up by it): refused."""
    rt = Runtime(
        providers={"s": ScriptedProvider([text("a")])}, ids=lambda: f"loop {BAD}"
    )
    async with rt:
        with pytest.raises(ConfigurationError, match="agent_id cannot hold"):
            rt.run_loop(agent_id, "hi", request())
        with pytest.raises(ConfigurationError, match="a loop id cannot hold"):
            rt.run_loop("agent", "hi", request())
        assert rt.loops() == []


def test_escaping_functions() -> None:
    assert encodable("plain ascii") == "plain ascii"
    assert encodable("café ✓") == "café ✓"
    assert encodable(BAD) == ESCAPED
    assert encodable(ESCAPED) == ESCAPED  # idempotent
    assert json_text({BAD: 1}) == '{"name-\\\\udcff-\\\\ud800":1}'
    assert json.loads(json_text({BAD: 1})) == {ESCAPED: 1}
    shown = printable("a\x1b]52;c;aGk=\x07b\r\n\u202ec\udcff")
    for control in ("\x1b", "\x07", "\u202e"):
        assert control not in shown
    assert shown == "a\\x1b]52;c;aGk=\\x07b\n\\u202ec\\udcff"
    assert printable("a\nb", newlines=False) == "a\\nb"


# ---------------------------------------------------- values a provider built


ASKED: list[InferenceInput] = []


def returning(output: InferenceOutput) -> FunctionProvider:
    def answer(request: InferenceInput) -> InferenceOutput:
        ASKED.append(request)
        return output

    return FunctionProvider(answer)


GARBAGE = [
    pytest.param(
        construct(InferenceOutput, items="garbage"), "items is str", id="items"
    ),
    pytest.param(
        construct(
            InferenceOutput,
            items=(
                construct(FunctionCallItem, call_id=None, name="x", arguments="{}"),
            ),
        ),
        "items[0].call_id is NoneType",
        id="call-id",
    ),
    pytest.param(
        construct(InferenceOutput, items=({"type": "model_message"},)),
        "items[0] is dict",
        id="dict-item",
    ),
    pytest.param(
        construct(InferenceOutput, items=(construct(ModelMessageItem, content=12345),)),
        "items[0].content is int",
        id="content",
    ),
    pytest.param(
        construct(
            InferenceOutput,
            items=(),
            token_usage=construct(TokenUsage, input_tokens="many"),
        ),
        "token_usage.input_tokens is str",
        id="usage",
    ),
    pytest.param(
        construct(InferenceOutput, items=(), raw_response={"at": object()}),
        "raw_response is dict",
        id="raw",
    ),
    pytest.param(
        construct(InferenceOutput, items=(), finish_reason=3),
        "finish_reason is int",
        id="finish",
    ),
]


@pytest.mark.parametrize(("output", "named"), GARBAGE)
async def test_a_value_the_loop_cannot_publish_fails_it_naming_the_provider(
    tmp_path: Path, output: InferenceOutput, named: str
) -> None:
    ASKED.clear()
    result_, events, stored = await run_one(tmp_path, returning(output), [])
    assert result_.outcome is Outcome.failed
    assert result_.error is not None
    assert result_.error.type == "ProviderError"
    assert "'s:m'" in result_.error.message
    assert named in result_.error.message
    assert len(ASKED) == 1  # not retried: it would come back the same
    assert_agrees(result_, events, stored)


async def test_a_stream_chunk_of_the_wrong_type_fails_the_loop(tmp_path: Path) -> None:
    async def chunks(request: InferenceInput) -> AsyncIterator[StreamEvent]:
        yield TextDelta(text="fine ")
        yield construct(TextDelta, text=12345)
        yield OutputCompleted(output=text("never"))

    provider = FunctionProvider(lambda r: text("x"), stream_handler=chunks)
    result_, events, stored = await run_one(tmp_path, provider, [], streaming=True)
    assert result_.outcome is Outcome.failed
    assert result_.error is not None
    assert "TextDelta.text is int 12345" in result_.error.message
    assert [e.delta.text for e in events if e.type == "inference.stream"] == ["fine "]
    assert_agrees(result_, events, stored)


# ---------------------------------------------------------------- limits


async def test_too_many_calls_in_one_output_fail_the_loop(tmp_path: Path) -> None:
    many = calls(*[call("listing") for _ in range(6)])
    provider = ScriptedProvider([many])
    result_, events, stored = await run_one(
        tmp_path, provider, [listing], max_output_calls=5
    )
    assert_over_limit(result_, "max_output_calls=5")
    assert result_.tool_calls == 0
    assert_agrees(result_, events, stored)


@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_an_output_over_max_output_chars_fails_the_loop(
    tmp_path: Path, streaming: bool
) -> None:
    sent: list[int] = []

    async def endless(request: InferenceInput) -> AsyncIterator[StreamEvent]:
        while True:  # a server that never stops: the limit ends it
            sent.append(1)
            yield TextDelta(text="x" * 100)

    provider = FunctionProvider(lambda r: text("y" * 1001), stream_handler=endless)
    result_, events, stored = await run_one(
        tmp_path, provider, [], streaming=streaming, max_output_chars=1000
    )
    assert_over_limit(result_, "max_output_chars")
    if streaming:
        assert len(sent) == 11  # the chunk past the limit is the last one read
    assert_agrees(result_, events, stored)


async def test_a_stream_past_max_stream_seconds_fails_the_loop(tmp_path: Path) -> None:
    async def trickle(request: InferenceInput) -> AsyncIterator[StreamEvent]:
        yield TextDelta(text="a")
        await anyio.sleep_forever()  # a server holding the connection open
        yield OutputCompleted(output=text("never"))  # pragma: no cover

    provider = FunctionProvider(lambda r: text("x"), stream_handler=trickle)
    result_, events, stored = await run_one(
        tmp_path, provider, [], streaming=True, max_stream_seconds=0.05
    )
    assert_over_limit(result_, "max_stream_seconds=0.05")
    assert_agrees(result_, events, stored)


@tool
async def huge() -> str:
    """Return a lot."""
    return "z" * 5000


async def test_a_tool_output_over_its_limit_reaches_the_model_as_an_error(
    tmp_path: Path,
) -> None:
    provider = ScriptedProvider([calls(call("huge")), text("noted")])
    result_, events, stored = await run_one(
        tmp_path, provider, [huge], max_tool_output_chars=1000
    )
    assert result_.outcome is Outcome.answered
    [output] = [i for i in stored.items if i.type == "function_call_output"]
    assert output.is_error
    assert "5,000 characters" in output.output
    assert "max_tool_output_chars=1,000" in output.output
    assert_agrees(result_, events, stored)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_output_calls", 0),
        ("max_output_chars", -1),
        ("max_tool_output_chars", 0),
        ("max_stream_seconds", 0),
        ("max_stream_seconds", float("nan")),
        ("max_output_calls", 1.5),
    ],
)
async def test_a_bad_limit_is_refused_by_name(name: str, value: Any) -> None:
    rt = Runtime(providers={"s": ScriptedProvider([text("a")])})
    async with rt:
        with pytest.raises(ConfigurationError, match=name):
            rt.run_loop("agent", "hi", request(), **{name: value})


# ------------------------------------------------------- nested arguments


@tool
async def anything(value: Any = None) -> str:
    """Take any value."""
    return "ran"


async def test_deeply_nested_arguments_end_a_durable_loop(tmp_path: Path) -> None:
    depth = 100_000
    arguments = "[" * depth + "]" * depth
    nested = FunctionCallItem(call_id="c1", name="anything", arguments=arguments)
    provider = ScriptedProvider([calls(nested), text("done")])
    result_, events, stored = await run_one(tmp_path, provider, [anything])
    assert result_.outcome is Outcome.answered, result_.error
    assert_agrees(result_, events, stored)


# ----------------------------------------------------------- decisions


async def test_a_handlers_text_is_escaped_as_it_decides(tmp_path: Path) -> None:
    """A denial, an answer and a pause reason holding lone surrogates: the
    store commits each decision, the log stays whole, the model sees the
    escaped text."""

    def decide(pending: PendingTransition) -> Decision | None:
        batch = pending.payload
        if isinstance(batch, ToolBatch) and not batch.denied and not batch.outputs:
            first, second = batch.calls
            batch = batch.deny(first.call_id, f"no {BAD}")
            return Rewrite(
                dest=pending.dest, payload=batch.answer(second.call_id, f"said {BAD}")
            )
        return None

    provider = ScriptedProvider([calls(call("listing"), call("listing")), text("done")])
    log = tmp_path / "events.jsonl"
    db = tmp_path / "loops.db"
    rt = Runtime(
        providers={"s": provider},
        store=SQLiteStore(db),
        tools=[listing],
        handlers=[decide],
        event_log=log,
    )
    async with rt:
        loop_id = rt.run_loop(
            "agent", "go", request(listing), interception_handler=decide
        )
        result_ = await rt.wait(loop_id)
    events = list(read_events(log))
    async with SQLiteStore(db) as store:
        stored = await store.load(loop_id)
    assert stored is not None
    assert result_.outcome is Outcome.answered, result_.error
    outputs = [i.output for i in stored.items if i.type == "function_call_output"]
    assert outputs == [f"the call was denied: no {ESCAPED}", f"said {ESCAPED}"]
    assert_agrees(result_, events, stored)
    assert Pause(f"wait {BAD}").reason == f"wait {ESCAPED}"
    assert Abort(f"stop {BAD}").reason == f"stop {ESCAPED}"


# ------------------------------------------- what no validation ever saw


def wrapped(output: InferenceOutput) -> Any:
    """A model wrapper that answers with `output` instead of asking the model."""

    async def wrapper(request: Any, call_next: Any) -> InferenceOutput:
        return output

    return wrapper


async def test_a_model_wrappers_output_is_checked_as_a_providers(
    tmp_path: Path,
) -> None:
    many = calls(*[call("listing") for _ in range(4)])
    provider = ScriptedProvider([text("unused")])
    result_, events, stored = await run_one(
        tmp_path,
        provider,
        [listing],
        model_wrappers=[wrapped(many)],
        max_output_calls=3,
    )
    assert_over_limit(result_, "max_output_calls=3")
    assert result_.tool_calls == 0
    assert_agrees(result_, events, stored)
    answer = construct(
        InferenceOutput,
        items=(
            construct(
                ModelMessageItem, type="model_message", content=BAD, refusal=None
            ),
        ),
    )
    (tmp_path / "2").mkdir()
    result_, events, stored = await run_one(
        tmp_path / "2",
        ScriptedProvider([text("unused")]),
        [],
        model_wrappers=[wrapped(answer)],
    )
    assert result_.answer is not None
    assert result_.answer.content == ESCAPED
    assert_agrees(result_, events, stored)


DEEP: list[Any] = []
"""A raw response nested 500 lists deep."""
_inner = DEEP
for _ in range(500):
    _inner.append([])
    _inner = _inner[0]


@pytest.mark.parametrize(
    ("output", "named"),
    [
        pytest.param(
            construct(
                InferenceOutput,
                items=(
                    construct(
                        ModelMessageItem,
                        type="function_call",
                        content="x",
                        refusal=None,
                    ),
                ),
            ),
            "items[0].type",
            id="discriminator",
        ),
        pytest.param(
            construct(InferenceOutput, items=(), raw_response=DEEP),
            "raw_response",
            id="deep-raw",
        ),
    ],
)
async def test_an_item_of_another_kind_or_a_deep_response_fails_the_loop(
    tmp_path: Path, output: InferenceOutput, named: str
) -> None:
    result_, events, stored = await run_one(tmp_path, returning(output), [])
    assert result_.error is not None
    assert result_.error.type == "ProviderError"
    assert named in result_.error.message
    assert_agrees(result_, events, stored)


@tool
async def constructed(which: str) -> ToolResult:
    """Return a ToolResult built without validation."""
    if which == "output":
        made: ToolResult = construct(
            ToolResult, output=123, is_error=False, terminate=False
        )
    else:
        made = construct(ToolResult, output="fine", is_error=False, terminate="no")
    return made


async def test_a_tool_result_of_wrong_types_is_an_error_output(tmp_path: Path) -> None:
    provider = ScriptedProvider(
        [
            calls(
                call("constructed", which="output"),
                call("constructed", which="terminate"),
            ),
            text("noted"),
        ]
    )
    result_, events, stored = await run_one(tmp_path, provider, [constructed])
    assert result_.outcome is Outcome.answered, result_.error
    outputs = [i for i in stored.items if i.type == "function_call_output"]
    assert [o.is_error for o in outputs] == [True, True]
    assert "returned a int as output" in outputs[0].output
    assert "returned a str as terminate" in outputs[1].output
    assert_agrees(result_, events, stored)


async def test_a_message_built_without_validation_is_checked_at_the_call() -> None:
    rt = Runtime(providers={"s": ScriptedProvider([text("a")])})
    async with rt:
        with pytest.raises(TypeError, match=r"message\.content must be a str"):
            rt.run_loop(
                "agent",
                construct(UserMessage, type="user_message", content=123),
                request(),
            )
        assert rt.loops() == []


async def test_text_no_loop_entry_saw_is_escaped_by_the_store(tmp_path: Path) -> None:
    """Instructions set on a context by hand, and a message built without
    validation: the SQLite store writes them as the loop would have escaped
    them, instead of detaching the loop."""
    context = ModelContext()
    context.instructions = f"be brief {BAD}"
    context.append(
        construct(UserMessage, type="user_message", content=f"earlier {BAD}")
    )
    db = tmp_path / "loops.db"
    rt = Runtime(providers={"s": ScriptedProvider([text("ok")])}, store=SQLiteStore(db))
    async with rt:
        loop_id = rt.run_loop(
            "agent", "go", InferenceInput(model="s:m", context=context)
        )
        result_ = await rt.wait(loop_id)
    assert result_.outcome is Outcome.answered, result_.error
    async with SQLiteStore(db) as store:
        stored = await store.load(loop_id)
    assert stored is not None
    assert stored.record.outcome is Outcome.answered


# --------------------------------------------------------- shared contexts


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_shared_context_takes_only_what_it_can_read_back(
    tmp_path: Path, kind: str
) -> None:
    from agentfsm.store import MemoryStore

    store = MemoryStore() if kind == "memory" else SQLiteStore(tmp_path / "c.db")
    good = UserMessage(content="hi")
    bad_calls: list[tuple[Any, ...]] = [
        (7, 0, [good], ["d"]),
        ("ctx", -3, [good], ["d"]),
        ("ctx", 0, [good], [5]),
        ("ctx", 0, [good], ["d", "e"]),
        ("ctx", 0, [{"type": "user_message", "content": "hi"}], ["d"]),
        ("ctx", 0, [construct(UserMessage, type="user_message", content=123)], ["d"]),
    ]
    async with store:
        for arguments in bad_calls:
            with pytest.raises((TypeError, ValueError)):
                await store.append_context(*arguments)
        assert await store.context("ctx") is None
        odd = construct(UserMessage, type="user_message", content=BAD)
        await store.append_context("ctx", 0, [good, odd], ["d1", "d2"])
        held = await store.context("ctx")
    assert held is not None
    assert [i.content for i in held[0]] == ["hi", ESCAPED]  # type: ignore[union-attr]
