"""Call ids unique within a loop: a model output whose calls repeat an id (of
the output or of the loop's context) or have an empty one gets those calls
renamed (`_loop/bounds.unique_call_ids`) before anything publishes or stores
it, the same way in a first run, a recovery and a replay; and a `ToolBatch`
refuses calls sharing an id."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import ValidationError
from structlog.typing import EventDict

from agentfsm import (
    FunctionCallItem,
    InferenceInput,
    LoopStatus,
    ModelContext,
    Outcome,
    PendingTransition,
    Proceed,
    Rewrite,
    Runtime,
    ToolBatch,
    Trigger,
    tool,
)
from agentfsm._loop.bounds import checked_output
from agentfsm.events import InferenceCompleted, InferenceStream
from agentfsm.inference import InferenceOutput, ToolCallDelta
from agentfsm.options import LoopOptions
from agentfsm.replay import replay
from agentfsm.store import LoopStore, MemoryStore, SQLiteStore
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from tests.helpers import assert_one_output_per_call, items_of, wait_until

RAN: list[str] = []
"""What the tools below did, one entry a run of a body."""

GATE: dict[str, anyio.Event] = {}


@tool(needs_approval=True)
async def send(to: str, body: str) -> str:
    """Send a message."""
    RAN.append(f"send {to}")
    return f"sent to {to}"


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    RAN.append(f"add {a} {b}")
    return a + b


@tool
async def charge(amount: int) -> str:
    """Charge a card (not idempotent: a crash during it pauses the loop)."""
    RAN.append(f"charge {amount}")
    gate = GATE.get("block")
    if gate is not None:
        await gate.wait()
    return f"charged {amount}"


TOOLS = [send, add, charge]


@pytest.fixture(autouse=True)
def _clean() -> None:
    RAN.clear()
    GATE.clear()


def request_with(*tools: Any, streaming: bool = False) -> InferenceInput:
    return InferenceInput(
        model="scripted:m", context=ModelContext(), tools=tools, streaming=streaming
    )


def ids_of(items: Any) -> list[str]:
    return [i.call_id for i in items if isinstance(i, FunctionCallItem)]


def same_id_twice() -> InferenceOutput:
    """The reviewer's output: two sends sharing `call_1`."""
    return calls(
        call("send", call_id="call_1", to="alice", body="hi"),
        call("send", call_id="call_1", to="mallory", body="secrets"),
    )


async def finished(runtime: Runtime, loop_id: str) -> Any:
    with anyio.fail_after(20):
        return await runtime.wait(loop_id)


class TestOneOutput:
    async def test_a_repeated_id_pauses_two_calls_each_approved_on_its_own(
        self, log_output: list[EventDict]
    ) -> None:
        provider = ScriptedProvider([same_id_twice(), text("done")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request_with(send)
            loop_id = runtime.run_loop("agent", "send them", inference_input)
            await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
            view = runtime.get(loop_id)
            assert view.pending is not None
            batch = view.pending.payload
            assert isinstance(batch, ToolBatch)
            assert ids_of(batch.calls) == ["call_1", "call_1-2"]
            assert batch.awaiting_approval == ("call_1", "call_1-2")
            mallory = batch.calls[1]
            assert mallory.parsed_arguments()["to"] == "mallory"
            # Approving alice's call leaves mallory's waiting; denying
            # mallory's leaves alice's approved.
            approved = batch.approve("call_1")
            assert approved.awaiting_approval == ("call_1-2",)
            decided = approved.deny("call_1-2", "not to mallory")
            runtime.resume(loop_id, Rewrite(payload=decided))
            result = await finished(runtime, loop_id)
        assert result.outcome is Outcome.answered
        assert RAN == ["send alice"]
        assert items_of(inference_input.context) == [
            "user:send them",
            "call:call_1",
            "call:call_1-2",
            "out:call_1=sent to alice",
            "out:call_1-2=ERR",
            "model:done",
        ]
        (warning,) = [e for e in log_output if e["event"] == "call_ids_renamed"]
        assert warning["log_level"] == "warning"
        assert warning["loop_id"] == loop_id
        assert warning["renamed"] == ["items[1]: 'call_1' -> 'call_1-2'"]

    async def test_an_empty_id_is_named_and_each_call_gets_its_output(self) -> None:
        output = calls(
            FunctionCallItem(call_id="", name="add", arguments='{"a": 1, "b": 2}'),
            # The first free name is taken by a later call of the output.
            call("add", call_id="call-1", a=3, b=4),
            FunctionCallItem(call_id="", name="add", arguments='{"a": 5, "b": 6}'),
        )
        provider = ScriptedProvider([output, text("done")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            recorder = EventRecorder(runtime.bus, "inference.completed")
            inference_input = request_with(add)
            result = await finished(
                runtime, runtime.run_loop("agent", "add", inference_input)
            )
        assert result.outcome is Outcome.answered
        completed = recorder.events[0]  # (the second is the answer's)
        assert isinstance(completed, InferenceCompleted)
        assert ids_of(completed.output.items) == ["call-2", "call-1", "call-3"]
        assert items_of(inference_input.context)[4:7] == [
            "out:call-2=3",
            "out:call-1=7",
            "out:call-3=11",
        ]

    def test_renaming_skips_an_id_a_later_call_of_the_output_has(self) -> None:
        class Loop:  # what `checked_output` reads of a loop
            input = request_with()
            call_ids = None
            log = _NullLog()

        output = calls(
            call("add", call_id="c", a=1, b=2),
            call("add", call_id="c", a=1, b=2),
            call("add", call_id="c-2", a=1, b=2),
        )
        checked = checked_output(output, "m", LoopOptions(), Loop())  # type: ignore[arg-type]
        assert ids_of(checked.items) == ["c", "c-3", "c-2"]
        unique = calls(call("add", call_id="x", a=1, b=2))
        # Unique ids: the very output back.
        assert checked_output(unique, "m", LoopOptions(), Loop()) is unique  # type: ignore[arg-type]

    async def test_a_streamed_output_is_renamed_its_chunks_are_not(self) -> None:
        output = calls(
            call("add", call_id="call_0", a=1, b=2),
            call("add", call_id="call_0", a=3, b=4),
        )
        provider = ScriptedProvider([output, text("done")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            recorder = EventRecorder(
                runtime.bus, ["inference.stream", "inference.completed"]
            )
            inference_input = request_with(add, streaming=True)
            result = await finished(
                runtime, runtime.run_loop("agent", "add", inference_input)
            )
        assert result.outcome is Outcome.answered
        deltas = [
            e.delta
            for e in recorder.events
            if isinstance(e, InferenceStream) and isinstance(e.delta, ToolCallDelta)
        ]
        # The chunks are the provider's (told apart by index); the output is
        # the loop's.
        assert {(d.index, d.call_id) for d in deltas if d.call_id} == {
            (0, "call_0"),
            (1, "call_0"),
        }
        completed = [e for e in recorder.events if isinstance(e, InferenceCompleted)]
        assert ids_of(completed[0].output.items) == ["call_0", "call_0-2"]
        assert items_of(inference_input.context)[1:5] == [
            "call:call_0",
            "call:call_0-2",
            "out:call_0=3",
            "out:call_0-2=7",
        ]


class _NullLog:
    def warning(self, event: str, **values: Any) -> None:
        pass


class TestAcrossTurns:
    async def test_an_id_reused_every_turn_runs_every_call_and_ledgers_each(
        self, tmp_path: Path
    ) -> None:
        """A server naming every turn's call `call_0`: with a durable store,
        the second call runs (it is not taken for the first, done), and the
        ledger and the context keep both, each paired with its output."""
        script = [
            calls(call("add", call_id="call_0", a=1, b=2)),
            calls(call("add", call_id="call_0", a=3, b=4)),
            calls(call("add", call_id="call_0", a=5, b=6)),
            text("done"),
        ]
        store = SQLiteStore(tmp_path / "loops.db")
        async with Runtime(
            providers={"scripted": ScriptedProvider(script)}, store=store
        ) as runtime:
            inference_input = request_with(add)
            loop_id = runtime.run_loop("agent", "add", inference_input)
            result = await finished(runtime, loop_id)
        assert result.outcome is Outcome.answered
        assert RAN == ["add 1 2", "add 3 4", "add 5 6"]
        async with SQLiteStore(tmp_path / "loops.db") as again:
            ledger = await again.calls(loop_id)
            stored = await again.load(loop_id)
        assert [(c.request, c.call_id, c.status) for c in ledger] == [
            (1, "call_0", "done"),
            (2, "call_0-2", "done"),
            (3, "call_0-3", "done"),
        ]
        assert len({c.key for c in ledger}) == 3
        assert stored is not None
        assert items_of(ModelContext(items=stored.items)) == [
            "user:add",
            "call:call_0",
            "out:call_0=3",
            "call:call_0-2",
            "out:call_0-2=7",
            "call:call_0-3",
            "out:call_0-3=11",
            "model:done",
        ]
        assert_one_output_per_call(stored.items)

    async def test_a_conversation_s_next_loop_renames_an_earlier_loop_s_id(
        self,
    ) -> None:
        """Loops one after another on one context: the second's `call_0` is
        not the first's (the request pairs each output with its own call)."""
        script = [
            calls(call("add", call_id="call_0", a=1, b=2)),
            text("3"),
            calls(call("add", call_id="call_0", a=3, b=4)),
            text("7"),
        ]
        async with Runtime(providers={"scripted": ScriptedProvider(script)}) as runtime:
            inference_input = request_with(add)
            for message in ("first", "second"):
                await finished(
                    runtime, runtime.run_loop("agent", message, inference_input)
                )
        assert ids_of(inference_input.context.items) == ["call_0", "call_0-2"]
        assert_one_output_per_call(inference_input.context.items)


class Hold:
    """Holds the loop at `call_tools` until GATE["hold"] is set (with
    `holds=False` it decides at once); keeps the batches it saw."""

    def __init__(self, *, holds: bool = True) -> None:
        self.holds = holds
        self.batches: list[ToolBatch] = []

    async def __call__(self, pending: PendingTransition) -> None:
        if pending.trigger is Trigger.call_tools:
            assert isinstance(pending.payload, ToolBatch)
            self.batches.append(pending.payload)
            if self.holds:
                await GATE["hold"].wait()


async def die_when(
    store: LoopStore,
    script: list[Any],
    start: Callable[[Runtime], str],
    until: Callable[[Runtime, str], bool],
) -> str:
    """Run a loop on `store`; kill its runtime (cancel the task running it, as
    a deployment stopping does) once `until` holds."""
    loop_id = ""
    with anyio.CancelScope() as scope:
        async with Runtime(
            providers={"scripted": ScriptedProvider(script)}, store=store
        ) as runtime:
            loop_id = start(runtime)
            await wait_until(lambda: until(runtime, loop_id))
            scope.cancel()
            await anyio.sleep_forever()
    return loop_id


TWO_CALL_1 = [
    calls(
        call("add", call_id="call_1", a=1, b=2),
        call("charge", call_id="call_1", amount=5),
    )
]


@pytest.fixture(params=["memory", "sqlite"])
def store_factory(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[[], LoopStore]:
    """A new store object on the same data each call."""
    if request.param == "memory":
        memory = MemoryStore()
        return lambda: memory
    return lambda: SQLiteStore(tmp_path / "loops.db")


class TestRecovery:
    async def test_a_crash_inside_a_renamed_batch_recovers_with_its_ids(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """Killed while `charge` (renamed `call_1-2`) runs: the recovered loop
        pauses naming `call_1-2`, runs it again when told to, and `add`'s
        call (`call_1`, done) never again."""
        GATE["block"] = anyio.Event()
        loop_id = await die_when(
            store_factory(),
            TWO_CALL_1,
            lambda rt: rt.run_loop(
                "agent", "go", request_with(add, charge), tool_execution="sequential"
            ),
            lambda rt, loop_id: "charge 5" in RAN,
        )
        del GATE["block"]
        store = store_factory()
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("done")])},
            store=store,
            tools=TOOLS,
        ) as second:
            report = await second.recover()
            assert report.paused == [loop_id]
            view = second.get(loop_id)
            assert view.pause_reason is not None
            assert "call_1-2 (charge)" in view.pause_reason
            assert view.pending is not None
            batch = view.pending.payload
            assert isinstance(batch, ToolBatch)
            assert ids_of(batch.calls) == ["call_1", "call_1-2"]
            second.resume(loop_id, Proceed())
            result = await finished(second, loop_id)
            stored = await store.load(loop_id)
        assert result.outcome is Outcome.answered
        assert RAN == ["add 1 2", "charge 5", "charge 5"]
        assert stored is not None
        assert items_of(ModelContext(items=stored.items)) == [
            "user:go",
            "call:call_1",
            "call:call_1-2",
            "out:call_1=3",
            "out:call_1-2=charged 5",
            "model:done",
        ]

    @pytest.mark.parametrize("recorded", ["renamed", "as the model sent it"])
    async def test_a_recorded_output_gives_the_ids_of_the_first_run(
        self, store_factory: Callable[[], LoopStore], recorded: str
    ) -> None:
        """Killed while a handler decides about the batch: the recovered loop
        takes the output its store recorded (renamed before it was recorded;
        one recorded as the model sent it, by a version that did not rename,
        is renamed alike) and runs the calls under the first run's ids."""
        GATE["hold"] = anyio.Event()
        first = Hold()
        loop_id = await die_when(
            store_factory(),
            TWO_CALL_1,
            lambda rt: rt.run_loop("agent", "go", request_with(add, charge), first),
            lambda rt, loop_id: bool(first.batches),
        )
        store = store_factory()
        if recorded != "renamed":
            raw = TWO_CALL_1[0]

            async def inference(loop_id: str, request: int) -> InferenceOutput:
                return raw

            store.inference = inference  # type: ignore[method-assign]
        again = Hold(holds=False)
        provider = ScriptedProvider([text("done")])
        async with Runtime(
            providers={"scripted": provider},
            store=store,
            tools=TOOLS,
            handlers=[again],
        ) as second:
            await second.recover()
            result = await finished(second, loop_id)
        assert result.outcome is Outcome.answered
        assert len(provider.requests) == 1  # the first request was not sent again
        assert ids_of(again.batches[0].calls) == ids_of(first.batches[0].calls)
        assert ids_of(first.batches[0].calls) == ["call_1", "call_1-2"]
        assert RAN == ["add 1 2", "charge 5"]


class TestReplay:
    async def test_a_recording_with_a_repeated_id_replays_without_divergence(
        self, tmp_path: Path
    ) -> None:
        log = tmp_path / "events.jsonl"
        script = [
            calls(
                call("add", call_id="call_0", a=1, b=2),
                call("add", call_id="call_0", a=3, b=4),
            ),
            calls(call("add", call_id="call_0", a=5, b=6)),
            text("21"),
        ]
        async with Runtime(
            providers={"scripted": ScriptedProvider(script)}, event_log=log
        ) as runtime:
            loop_id = runtime.run_loop("agent", "add them", request_with(add))
            await finished(runtime, loop_id)
        ran = list(RAN)
        report = await replay(log, tools=[add])
        assert report.divergence is None
        assert report.result is not None
        assert report.result.outcome is Outcome.answered
        assert ran == RAN  # a replay runs no tool
        completed = [e for e in report.events if isinstance(e, InferenceCompleted)]
        assert [ids_of(e.output.items) for e in completed] == [
            ["call_0", "call_0-2"],
            ["call_0-3"],
            [],
        ]


class TestToolBatch:
    def test_a_batch_of_calls_sharing_an_id_is_refused(self) -> None:
        a = FunctionCallItem(call_id="x", name="send", arguments="{}")
        b = FunctionCallItem(call_id="x", name="send", arguments='{"to": "m"}')
        with pytest.raises(ValidationError, match=r"distinct call_ids.*'x'"):
            ToolBatch(calls=(a, b))
        with pytest.raises(ValidationError, match="distinct call_ids"):
            ToolBatch.model_validate({"calls": [a.model_dump(), b.model_dump()]})

    def test_a_batch_copied_past_the_check_refuses_a_decision_by_that_id(
        self,
    ) -> None:
        a = FunctionCallItem(call_id="x", name="send", arguments="{}")
        b = FunctionCallItem(call_id="y", name="send", arguments="{}")
        batch = ToolBatch(calls=(a, b), awaiting_approval=("x", "y"))
        copied = batch.model_copy(update={"calls": (a, a.model_copy())})
        decisions: list[Callable[[], ToolBatch]] = [
            lambda: copied.approve("x"),
            lambda: copied.deny("x", "no"),
            lambda: copied.answer("x", "out"),
            lambda: copied.with_arguments("x", {}),
        ]
        for decide in decisions:
            with pytest.raises(ValueError, match="more than one call has 'x'"):
                decide()
        # A distinct id still works.
        assert batch.approve("x").awaiting_approval == ("y",)
