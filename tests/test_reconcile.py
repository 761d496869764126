"""`@tool(reconcile=fn)`: recovery asks a tool's reconcile function about a call
that was in flight at a crash, before the loop would pause over it.

A loop dies while `charge` (call c1, `on_crash="pause"`) runs; a second
runtime recovers it and asks `find_charge`, whose reply each test sets
(`REPLY`). `Reconciled.ran(output)` records the output and never runs the call
again; `Reconciled.not_run()` runs it now with the same key; None, an error, a
timeout or a wrong type pauses the loop as without `reconcile`, saying why.
Every answer is stored (the ledger, and `loop.recovered` in a store that keeps
events) before it acts: a crash during the asking asks again, a crash right
after it neither asks again nor runs a reconciled call.

On MemoryStore, SQLiteStore and PostgresStore, on asyncio and trio.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentfsm import (
    LoopResult,
    ModelContext,
    Outcome,
    Proceed,
    Reconciled,
    Runtime,
    Tool,
    ToolResult,
    current_call,
    tool,
)
from agentfsm.events import LoopRecovered, ReconciledCall
from agentfsm.exceptions import ConfigurationError, StoreError
from agentfsm.inference import InferenceInput
from agentfsm.store import Commit, EventArchive, LoopStore, MemoryStore, SQLiteStore
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from tests.helpers import items_of, wait_until

RAN: list[str] = []
"""What the tools did (one line per run of their bodies)."""
KEYS: list[str] = []
"""The idempotency key each run of a tool saw."""
ASKED: list[tuple[str, str, dict[str, Any]]] = []
"""(tool, key, arguments) of each question to a reconcile function."""
GATE: dict[str, anyio.Event] = {}
REPLY: dict[str, Callable[[], Any]] = {}
"""What each tool's reconcile function returns (by tool name): called for
each question; it may raise."""


async def find_charge(key: str, arguments: dict[str, Any]) -> Reconciled | None:
    ASKED.append(("charge", key, arguments))
    gate = GATE.get("ask")
    if gate is not None:
        await gate.wait()
    answer: Reconciled | None = REPLY["charge"]()
    return answer


def find_refund(key: str, arguments: dict[str, Any]) -> Reconciled | None:
    """A sync reconcile function (run in a worker thread)."""
    ASKED.append(("refund", key, arguments))
    answer: Reconciled | None = REPLY["refund"]()
    return answer


async def _charge(amount: int) -> str:
    """Charge a card (not idempotent)."""
    RAN.append(f"charge {amount}")
    KEYS.append(current_call().idempotency_key)
    gate = GATE.get("block")
    if gate is not None:
        await gate.wait()
    return f"charged {amount}"


async def _refund(amount: int) -> str:
    """Refund an amount (not idempotent)."""
    RAN.append(f"refund {amount}")
    gate = GATE.get("block")
    if gate is not None:
        await gate.wait()
    return f"refunded {amount}"


charge = Tool(_charge, name="charge", reconcile=find_charge)
refund = Tool(_refund, name="refund", reconcile=find_refund)
TOOLS = [charge, refund]


@pytest.fixture(autouse=True)
def _clean() -> None:
    for kept in (RAN, KEYS, ASKED, GATE, REPLY):
        kept.clear()


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], LoopStore]:
    """A new store object on the same data each call, keeping events."""
    if request.param == "memory":
        memory = MemoryStore(events=True)
        return lambda: memory
    if request.param == "postgres":
        from agentfsm.store.postgres import PostgresStore

        server = request.getfixturevalue("postgres_server")
        schema = f"t_{uuid.uuid4().hex}"
        return lambda: PostgresStore(server.conninfo(), schema=schema, events=True)
    return lambda: SQLiteStore(tmp_path / "loops.db", events=True)


def request_with(*tools: Tool) -> InferenceInput:
    return InferenceInput(model="scripted:m", context=ModelContext(), tools=list(tools))


async def died_during(
    store: LoopStore, *ids_and_tools: tuple[str, str], parallel: bool = False
) -> str:
    """A loop whose runtime was killed (its task cancelled, as a deployment
    stopping would) while its calls ran: in flight in the store. Each call is
    `(call_id, tool)` with amount 5."""
    GATE["block"] = anyio.Event()
    script = [calls(*(call(name, call_id=c, amount=5) for c, name in ids_and_tools))]
    names = [name for _, name in ids_and_tools]
    loop_id = ""
    with anyio.CancelScope() as scope:
        async with Runtime(
            providers={"scripted": ScriptedProvider(script)}, store=store
        ) as first:
            loop_id = first.run_loop(
                "agent",
                "go",
                request_with(charge, refund),
                tool_execution="parallel" if parallel else "sequential",
            )
            await wait_until(lambda: all(f"{n} 5" in RAN for n in names))
            scope.cancel()
            await anyio.sleep_forever()
    del GATE["block"]
    return loop_id


def second_runtime(
    store: LoopStore, tools: Sequence[Tool] = TOOLS, answer: str = "done"
) -> Runtime:
    return Runtime(
        providers={"scripted": ScriptedProvider([text(answer)])},
        store=store,
        tools=list(tools),
    )


async def finished(runtime: Runtime, loop_id: str) -> LoopResult:
    with anyio.fail_after(20):
        return await runtime.wait(loop_id)


def recovered_event(recorder: EventRecorder) -> LoopRecovered:
    (event,) = recorder.events
    assert isinstance(event, LoopRecovered)
    return event


def answers(event: LoopRecovered) -> list[tuple[str, str]]:
    return [(c.call_id, c.answer) for c in event.reconciled]


class TestDeclaring:
    def test_the_tool_keeps_its_reconcile_function(self) -> None:
        assert charge.reconcile is find_charge
        assert tool(_charge).reconcile is None

    @pytest.mark.parametrize(
        "fn",
        [
            pytest.param(lambda key: None, id="one-parameter"),
            pytest.param(lambda key, arguments, extra: None, id="three-parameters"),
            pytest.param(lambda key, *, arguments: None, id="keyword-only"),
        ],
    )
    def test_a_function_of_other_parameters_is_refused_naming_the_tool(
        self, fn: Any
    ) -> None:
        with pytest.raises(ConfigurationError, match="tool 'pay': reconcile must take"):
            tool(name="pay", reconcile=fn)(_charge)

    def test_something_not_callable_is_refused(self) -> None:
        with pytest.raises(ConfigurationError, match=r"tool '_charge'.*got str"):
            tool(reconcile="find_charge")(_charge)  # type: ignore[call-overload]

    def test_a_retried_tool_is_refused_a_reconcile_function(self) -> None:
        """`on_crash="retry"` runs the call again without asking: a reconcile
        function there would never be asked."""
        with pytest.raises(ConfigurationError, match="on_crash='retry'"):
            tool(on_crash="retry", reconcile=find_charge)(_charge)

    def test_functions_taking_two_positional_arguments_are_accepted(self) -> None:
        def variadic(*args: Any) -> None:
            return None

        for fn in (find_charge, find_refund, variadic, lambda k, a, extra=1: None):
            assert tool(reconcile=fn)(_charge).reconcile is fn

    def test_answers(self) -> None:
        assert Reconciled.ran({"id": 3}).result == ToolResult(output='{"id":3}')
        assert Reconciled.ran("x").outcome == "ran"
        assert Reconciled.not_run().result is None
        with pytest.raises(ValueError, match=r"use Reconciled\.ran"):
            Reconciled(outcome="ran")
        with pytest.raises(ValueError, match=r"use Reconciled\.ran"):
            Reconciled(outcome="not_run", result=ToolResult(output="x"))


class TestAnswers:
    async def test_ran_records_the_output_and_never_runs_the_call_again(
        self, stores: Callable[[], LoopStore]
    ) -> None:
        REPLY["charge"] = lambda: Reconciled.ran("charged 5 (found by key)")
        loop_id = await died_during(stores(), ("c1", "charge"))
        async with second_runtime(stores()) as second:
            recorder = EventRecorder(second.bus, "loop.recovered")
            report = await second.recover()
            assert report.running == [loop_id]  # no pause
            result = await finished(second, loop_id)
            stored = await second.store.load(loop_id)  # type: ignore[union-attr]
            ledger = await second.store.calls(loop_id)  # type: ignore[union-attr]
        assert result.outcome is Outcome.answered
        assert RAN == ["charge 5"]  # the first runtime's, only
        assert [(t, a) for t, _, a in ASKED] == [("charge", {"amount": 5})]
        assert ASKED[0][1] == KEYS[0]  # the call's idempotency key
        assert stored is not None
        assert items_of(ModelContext(items=stored.items)) == [
            "user:go",
            "call:c1",
            "out:c1=charged 5 (found by key)",
            "model:done",
        ]
        (entry,) = ledger
        assert (entry.status, entry.by) == (
            "done",
            "reconcile:tests.test_reconcile:find_charge",
        )
        assert entry.output is not None
        assert entry.output.output == "charged 5 (found by key)"
        event = recovered_event(recorder)
        assert (event.status, event.uncertain_calls) == ("running", ())
        assert event.reconciled == (
            ReconciledCall(
                call_id="c1",
                tool="charge",
                idempotency_key=KEYS[0],
                answer="ran",
                output=entry.output,
            ),
        )

    async def test_not_run_runs_the_call_now_with_the_same_key(
        self, stores: Callable[[], LoopStore]
    ) -> None:
        REPLY["charge"] = Reconciled.not_run
        loop_id = await died_during(stores(), ("c1", "charge"))
        async with second_runtime(stores()) as second:
            recorder = EventRecorder(second.bus, "loop.recovered")
            assert (await second.recover()).running == [loop_id]
            result = await finished(second, loop_id)
            ledger = await second.store.calls(loop_id)  # type: ignore[union-attr]
        assert result.outcome is Outcome.answered
        assert RAN == ["charge 5", "charge 5"]
        assert KEYS[0] == KEYS[1]
        assert [(c.status, c.attempt) for c in ledger] == [("done", 2)]
        assert answers(recovered_event(recorder)) == [("c1", "not_run")]

    async def test_a_sync_function_answers_from_a_thread(
        self, stores: Callable[[], LoopStore]
    ) -> None:
        loop_thread = threading.get_ident()
        threads: list[int] = []

        def reply() -> Reconciled:
            threads.append(threading.get_ident())
            return Reconciled.ran(ToolResult(output="refunded 5", terminate=True))

        REPLY["refund"] = reply
        loop_id = await died_during(stores(), ("c1", "refund"))
        async with second_runtime(stores()) as second:
            assert (await second.recover()).running == [loop_id]
            result = await finished(second, loop_id)
        assert threads != [loop_thread]
        assert RAN == ["refund 5"]
        # The result's `terminate` is the call's: every call asked to end.
        assert (result.outcome, result.reason) == (Outcome.stopped, "terminated")

    @pytest.mark.parametrize(
        ("reply", "said"),
        [
            pytest.param(lambda: None, "reconcile did not know whether c1", id="none"),
            pytest.param(
                lambda: (_ for _ in ()).throw(RuntimeError("payments API down")),
                "it raised RuntimeError: payments API down",
                id="raises",
            ),
            pytest.param(
                lambda: "charged",
                "it returned a str, not a Reconciled",
                id="wrong-type",
            ),
        ],
    )
    async def test_no_answer_pauses_saying_why(
        self, stores: Callable[[], LoopStore], reply: Callable[[], Any], said: str
    ) -> None:
        """None, an error or a wrong type: the loop pauses over the call as
        without `reconcile`, the reason saying why; a person resumes it."""
        REPLY["charge"] = reply
        loop_id = await died_during(stores(), ("c1", "charge"))
        async with second_runtime(stores()) as second:
            recorder = EventRecorder(second.bus, "loop.recovered")
            assert (await second.recover()).paused == [loop_id]
            view = second.get(loop_id)
            assert view.pause_reason is not None
            assert "uncertain tool outcome" in view.pause_reason
            assert said in view.pause_reason
            ledger = await second.store.calls(loop_id)  # type: ignore[union-attr]
            assert [c.status for c in ledger] == ["uncertain"]
            event = recovered_event(recorder)
            assert event.uncertain_calls == ("c1",)
            (asked,) = event.reconciled
            assert asked.answer == ("unknown" if said.startswith("rec") else "failed")
            second.resume(loop_id, Proceed())
            result = await finished(second, loop_id)
        assert result.outcome is Outcome.answered
        assert RAN == ["charge 5", "charge 5"]

    async def test_a_function_past_the_tool_s_timeout_pauses(
        self, stores: Callable[[], LoopStore]
    ) -> None:
        GATE["ask"] = anyio.Event()  # never set: it never answers
        REPLY["charge"] = Reconciled.not_run
        loop_id = await died_during(stores(), ("c1", "charge"))
        quick = Tool(_charge, name="charge", timeout=0.05, reconcile=find_charge)
        async with second_runtime(stores(), [quick, refund]) as second:
            assert (await second.recover()).paused == [loop_id]
            reason = second.get(loop_id).pause_reason
        assert reason is not None
        assert "it did not answer within 0.05s" in reason
        assert RAN == ["charge 5"]

    async def test_only_the_unanswered_call_of_a_batch_pauses(
        self, stores: Callable[[], LoopStore]
    ) -> None:
        """Two calls in flight: `charge` is found to have run, `refund` is
        unknown. The loop pauses over `refund` alone, with `charge`'s output
        stored; a later runtime resuming it asks nobody again, runs `refund`
        and never `charge`."""
        REPLY["charge"] = lambda: Reconciled.ran("charged 5 (found)")
        REPLY["refund"] = lambda: None
        loop_id = await died_during(
            stores(), ("c1", "charge"), ("c2", "refund"), parallel=True
        )
        async with second_runtime(stores()) as second:
            recorder = EventRecorder(second.bus, "loop.recovered")
            assert (await second.recover()).paused == [loop_id]
            reason = second.get(loop_id).pause_reason
            assert reason is not None
            assert "c2 (refund)" in reason
            assert "c1 (charge)" not in reason
        event = recovered_event(recorder)
        assert event.uncertain_calls == ("c2",)
        assert answers(event) == [("c1", "ran"), ("c2", "unknown")]
        ASKED.clear()
        async with second_runtime(stores()) as third:
            assert (await third.recover()).paused == [loop_id]
            third.resume(loop_id, Proceed())
            result = await finished(third, loop_id)
            stored = await third.store.load(loop_id)  # type: ignore[union-attr]
        assert ASKED == []
        assert result.outcome is Outcome.answered
        assert sorted(RAN) == ["charge 5", "refund 5", "refund 5"]
        assert stored is not None
        assert items_of(ModelContext(items=stored.items)) == [
            "user:go",
            "call:c1",
            "call:c2",
            "out:c1=charged 5 (found)",
            "out:c2=refunded 5",
            "model:done",
        ]


def failing_after_reconcile(store: LoopStore) -> LoopStore:
    """`store`, failing every write after the one that stores a reconcile
    function's answer (as if the process died right after it landed)."""
    commit_many = store.commit_many
    landed: list[Commit] = []

    async def spy(commits: Sequence[Commit]) -> list[Exception | None]:
        if landed:
            return [StoreError("the process died") for _ in commits]
        errors = await commit_many(commits)
        for commit, error in zip(commits, errors, strict=True):
            by = [c.by or "" for c in commit.ledger]
            if error is None and any(b.startswith("reconcile:") for b in by):
                landed.append(commit)
        return errors

    store.commit_many = spy  # type: ignore[method-assign]
    return store


class TestCrashes:
    @pytest.mark.parametrize("reply", ["ran", "not_run"])
    async def test_a_crash_while_asking_asks_again(
        self, stores: Callable[[], LoopStore], reply: str
    ) -> None:
        """The runtime dies while the function is being asked: nothing of it
        was stored, and the next recovery asks again and acts once."""
        loop_id = await died_during(stores(), ("c1", "charge"))
        GATE["ask"] = anyio.Event()
        REPLY["charge"] = lambda: Reconciled.ran("charged 5 (found)")
        with anyio.CancelScope() as scope:
            async with (
                second_runtime(stores()) as second,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(second.recover)
                await wait_until(lambda: len(ASKED) == 1)
                scope.cancel()
                await anyio.sleep_forever()
        del GATE["ask"]
        async with stores() as store:
            assert [c.status for c in await store.calls(loop_id)] == ["started"]
        REPLY["charge"] = (
            Reconciled.not_run
            if reply == "not_run"
            else lambda: Reconciled.ran("charged 5 (found)")
        )
        async with second_runtime(stores()) as third:
            assert (await third.recover()).running == [loop_id]
            result = await finished(third, loop_id)
        assert result.outcome is Outcome.answered
        assert len(ASKED) == 2
        assert RAN.count("charge 5") == len(RAN) == (1 if reply == "ran" else 2)

    @pytest.mark.parametrize("reply", ["ran", "not_run"])
    async def test_a_crash_right_after_the_answer_is_stored_never_asks_again(
        self, stores: Callable[[], LoopStore], reply: str
    ) -> None:
        """The answer lands, and nothing the loop does after it is written:
        the next recovery acts on the stored answer without asking; a call
        found to have run is never run; one found not to have run runs once
        more. The `loop.recovered` event reporting it was stored with it."""
        loop_id = await died_during(stores(), ("c1", "charge"))
        REPLY["charge"] = (
            Reconciled.not_run
            if reply == "not_run"
            else lambda: Reconciled.ran("charged 5 (found)")
        )
        # (The second runtime's model never answers: the loop would go on to
        # its request, and the writes fail before anything else lands.)
        failing = failing_after_reconcile(stores())
        async with second_runtime(failing) as second:
            detached = EventRecorder(second.bus, "loop.detached")
            await second.recover()
            await wait_until(lambda: detached.events)
        del failing.commit_many  # (one MemoryStore is the data of every store)
        assert len(ASKED) == 1
        async with stores() as store:
            assert isinstance(store, EventArchive)
            stored = await store.events(loop_id)
        (event,) = [e for e in stored if isinstance(e, LoopRecovered)]
        assert answers(event) == [("c1", reply)]
        async with second_runtime(stores()) as third:
            assert (await third.recover()).running == [loop_id]
            result = await finished(third, loop_id)
        assert result.outcome is Outcome.answered
        assert len(ASKED) == 1  # not asked again
        # (The second runtime could not run it: its intent's write failed.)
        assert RAN.count("charge 5") == len(RAN) == (1 if reply == "ran" else 2)


CHILD = Path(__file__).with_name("reconcile_crash_child.py")


def child(backend: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(CHILD.parent.parent),
        "AGENTFSM_BACKEND": backend,
    }
    return subprocess.run(
        [sys.executable, str(CHILD), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize(
    "effect", [pytest.param("after", id="it-ran"), pytest.param("before", id="not")]
)
@pytest.mark.parametrize("kill_at", ["asking", "answered"])
def test_a_process_killed_during_reconciliation(
    tmp_path: Path, backend: str, effect: str, kill_at: str
) -> None:
    """SIGKILLed mid-call, then SIGKILLed again as its recovery asks the
    reconcile function (`asking`) or right after the answer's transaction
    (`answered`): a third process ends the loop, the charge took effect
    exactly once, and the function was asked again only if its answer was
    not stored."""
    db = str(tmp_path / "loops.db")
    ran = child(backend, "run", db, str(tmp_path), effect)
    assert ran.returncode == -signal.SIGKILL, ran.stderr[-2000:]
    loop_id = ran.stdout.split()[0]
    killed = child(backend, "recover", db, str(tmp_path), loop_id, kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    last = child(backend, "recover", db, str(tmp_path), loop_id)
    assert last.returncode == 0, last.stderr[-2000:]
    result = json.loads(last.stdout.splitlines()[-1])
    assert (result["running"], result["outcome"]) == ([loop_id], "answered")
    effects = (tmp_path / "effects").read_text().splitlines()
    asked = (tmp_path / "asked").read_text().splitlines()
    assert len(effects) == 1  # once: found to have run, or run once after
    assert len(asked) == (2 if kill_at == "asking" else 1)
    assert asked[0] == f'{effects[0].split()[1]} {{"amount": 5}}'  # its key
    found = "charged 5 (found by key)" if effect == "after" else "charged 5"
    assert result["outputs"] == [found]
