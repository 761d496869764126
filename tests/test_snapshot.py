"""`Runtime.snapshot`: a running or paused loop's record, as data."""

from __future__ import annotations

import pytest

from agentfsm import LoopState, Runtime, Trigger
from agentfsm.exceptions import LoopStateError, UnknownLoopError
from agentfsm.record import LoopRecord, PauseRecord
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import pause_tools, request, wait_until


async def test_a_paused_loops_record_holds_its_pause_and_round_trips() -> None:
    script = [calls(call("add", call_id="c", a=1, b=2)), text("3"), text("then")]
    provider = ScriptedProvider(script)
    async with Runtime(providers={"scripted": provider}) as runtime:
        loop_id = runtime.run_loop("agent", "go", request(), pause_tools)
        runtime.follow_up(loop_id, "then this")
        await wait_until(lambda: runtime.get(loop_id).status == "paused")
        record = runtime.snapshot(loop_id)
        assert LoopRecord.model_validate_json(record.model_dump_json()) == record
        assert (record.state, record.status) == (LoopState.inference, "paused")
        assert record.pause is not None
        assert record.pause == PauseRecord(
            source=LoopState.inference,
            trigger=Trigger.call_tools,
            dest=LoopState.function_call,
            seq=record.pause.seq,  # numbered before `loop.paused` was
            payload=record.pending.payload if record.pending else None,
            handler=0,
            reason="approval required",
            original_dest=LoopState.function_call,
        )
        assert record.pending is not None
        assert record.pending.trigger is Trigger.call_tools
        assert [m.content for m in record.follow_ups] == ["then this"]
        assert record.turn.output is not None  # the output the batch came from
        assert (record.model_requests, record.tool_calls) == (1, 0)
        runtime.resume(loop_id)
        result = await runtime.wait(loop_id)
        with pytest.raises(LoopStateError, match="has finished"):
            runtime.snapshot(loop_id)
        with pytest.raises(UnknownLoopError):
            runtime.snapshot("no-such-loop")
    assert result.model_requests == 3  # the call's turn, the answer, the follow-up


@pytest.mark.anyio
async def test_a_record_keeps_no_loop_alive() -> None:
    """What the records cache (a request's settings, tools and schema; a
    loop's options and handlers as names) keeps neither the request nor its
    context: a loop's context is freed with the loop."""
    import gc
    import weakref

    from agentfsm import InferenceInput, ModelContext, UserMessage
    from agentfsm._loop import snapshot

    contexts = []
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("hi")] * 3, record=False)}
    ) as rt:
        for _ in range(3):
            made = InferenceInput(
                model="scripted:m",
                context=ModelContext(items=[UserMessage(content="x" * 1000)]),
            )
            contexts.append(weakref.ref(made.context))
            loop_id = rt.run_loop("agent", "go", made, pause_tools)
            rt.snapshot(loop_id)
            await rt.wait(loop_id)
        del made
    gc.collect()
    assert [c() for c in contexts] == [None, None, None]
    assert not any(static[0]() is None for static in snapshot._STATIC.values())


def test_options_are_described_anew_when_they_change() -> None:
    """`options_record` remembers the options it last described (most loops
    share theirs) while they live: other options get their own record, and
    the remembered ones are not kept alive."""
    import gc
    import weakref

    from agentfsm.options import LoopOptions
    from agentfsm.record import options_record

    first = LoopOptions(max_turns=3)
    assert options_record(first).max_turns == 3
    assert options_record(first) is options_record(first)
    second = LoopOptions(max_turns=4, stop_when=(_never_stop,))
    assert options_record(second).max_turns == 4
    assert options_record(second).stop_when == (f"{__name__}:_never_stop",)
    assert options_record(first).max_turns == 3
    gone = weakref.ref(second)
    options_record(second)
    del second
    gc.collect()
    assert gone() is None


def _never_stop(view: object) -> None:
    return None
