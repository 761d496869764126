"""Stored breakpoints (issue 29): breakpoints kept in the store, set from a
process that holds no loop (`agentfsm ui`, a script), which every runtime
watching the store (`Runtime(requests=...)`) syncs into `runtime.breakpoints`.

Every store: memory, SQLite, PostgreSQL (tests/postgres_server.py). The "UI"
is a second store object on the same data (`store_factory()` again; the
memory store's one object). A PostgreSQL runtime is never poked: the store's
notice wakes it (its poll is an hour).
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from agentfsm import (
    InferenceInput,
    LoopStatus,
    ModelContext,
    Outcome,
    Runtime,
    Tool,
    tool,
)
from agentfsm.breakpoints import Break, ScopedBreak, is_breakpoint_pause
from agentfsm.exceptions import (
    ConfigurationError,
    LoopStateError,
    StoreError,
    UnknownLoopError,
)
from agentfsm.states import LoopState
from agentfsm.store import (
    LoopStore,
    MemoryStore,
    Requests,
    SharedBreakpoints,
    SQLiteStore,
    StoredBreak,
)
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import wait_until

GATES: dict[str, anyio.Event] = {}
RAN: list[str] = []


@tool
async def wait_for(tag: str) -> str:
    """Run until GATES[tag] is set."""
    RAN.append(tag)
    await GATES.setdefault(tag, anyio.Event()).wait()
    return f"{tag} opened"


@pytest.fixture(autouse=True)
def _clean() -> None:
    GATES.clear()
    RAN.clear()


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store_factory(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[[], LoopStore]:
    """A new store object on the same data at each call (the memory store's
    one object is the data)."""
    if request.param == "memory":
        memory = MemoryStore()
        return lambda: memory
    if request.param == "postgres":
        from agentfsm.store.postgres import PostgresStore

        server = request.getfixturevalue("postgres_server")
        schema = f"t_{uuid.uuid4().hex}"
        return lambda: PostgresStore(server.conninfo(), schema=schema)
    return lambda: SQLiteStore(tmp_path / "loops.db")


def shared(store: LoopStore) -> SharedBreakpoints:
    assert isinstance(store, SharedBreakpoints)
    return store


def inbox(store: LoopStore) -> Requests:
    assert isinstance(store, Requests)
    return store


def notices(store: LoopStore) -> bool:
    """Whether the store wakes a watching runtime by itself (PostgreSQL)."""
    return type(store).__name__ == "PostgresStore"


def wake(runtime: Runtime) -> None:
    """What the UI mounted beside a runtime does after a change (a store with
    notices needs none: not poked, so the notice is what is tested)."""
    assert runtime.store is not None
    if not notices(runtime.store):
        runtime.poke_requests()


def request_with(*tools: Tool) -> InferenceInput:
    return InferenceInput(model="scripted:m", context=ModelContext(), tools=list(tools))


def request_of(provider: str) -> InferenceInput:
    return InferenceInput(
        model=f"{provider}:m", context=ModelContext(), tools=[wait_for]
    )


def stored_ids(runtime: Runtime, **scope: str) -> set[int]:
    """The stored breakpoints the runtime has set (of a scope, `list`'s)."""
    return {s.stored for s in runtime.breakpoints.list(**scope) if s.stored is not None}


async def synced(runtime: Runtime, wanted: set[int], **scope: str) -> None:
    """Wait until the runtime's stored breakpoints (of the scope) are `wanted`."""
    await wait_until(lambda: stored_ids(runtime, **scope) == wanted)


async def paused_at(runtime: Runtime, loop_id: str, seq_after: int = 0) -> int:
    """The seq of the loop's pause once it pauses past `seq_after`."""

    def there() -> bool:
        pending = runtime.get(loop_id).pending
        return pending is not None and pending.seq > seq_after

    await wait_until(there)
    pending = runtime.get(loop_id).pending
    assert pending is not None
    return pending.seq


async def stored_pause_seq(store: LoopStore, loop_id: str, seq_after: int) -> int:
    """The seq of the loop's pause once its store holds it (what the UI sees)."""
    with anyio.fail_after(30):
        while True:
            loaded = await store.load(loop_id)
            pause = None if loaded is None else loaded.record.pause
            if pause is not None and pause.seq > seq_after:
                return pause.seq
            await anyio.sleep(0.005)


def running_provider(*tags: str) -> ScriptedProvider:
    """A model that calls `wait_for(tag)` once per tag, then answers."""
    return ScriptedProvider(
        [calls(call("wait_for", call_id=f"c-{t}", tag=t)) for t in tags]
        + [text("done")]
    )


class TestStore:
    async def test_a_breakpoint_set_by_one_handle_is_read_by_another(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        async with Runtime(
            providers={"scripted": running_provider("a")}, store=store_factory()
        ) as runtime:
            loop_id = runtime.run_loop("billing", "go", request_with(wait_for))
            await wait_until(lambda: RAN == ["a"])
            async with store_factory() as ui, store_factory() as other:
                by_loop = await shared(ui).add_breakpoint(
                    loop_id=loop_id, state="function_call", by="alice"
                )
                by_agent = await shared(ui).add_breakpoint(
                    agent_id="billing", every=True, by="bob"
                )
                elsewhere = await shared(ui).add_breakpoint(
                    agent_id="support", state=LoopState.inference, by="bob"
                )
                assert by_loop.id < by_agent.id < elsewhere.id
                assert (by_loop.state, by_loop.every) == (
                    LoopState.function_call,
                    False,
                )
                assert (by_agent.state, by_agent.every) == (None, True)
                seen = await shared(other).breakpoints()
                assert seen == [by_loop, by_agent, elsewhere]
                assert await shared(other).breakpoints(loop_id=loop_id) == [by_loop]
                assert await shared(other).breakpoints(agent_id="billing") == [by_agent]
                assert await shared(other).breakpoints(loop_id, "billing") == [
                    by_loop,
                    by_agent,
                ]
                removed = await shared(other).remove_breakpoint(by_agent.id, by="carol")
                assert removed is not None
                assert (removed.removed_by, removed.by) == ("carol", "bob")
                assert removed.removed_at is not None
                assert removed.removed_at >= removed.created_at
                again = await shared(ui).remove_breakpoint(by_agent.id, by="carol")
                assert again is None
                assert await shared(ui).remove_breakpoint(999, by="carol") is None
                assert await shared(ui).breakpoints() == [by_loop, elsewhere]
            GATES["a"].set()
            with anyio.fail_after(30):
                await runtime.wait(loop_id)

    async def test_bad_arguments_are_refused_naming_the_field(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("hi")])},
            store=store_factory(),
        ) as runtime:
            ended = runtime.run_loop("agent", "hi", request_with())
            with anyio.fail_after(30):
                await runtime.wait(ended)
            store = shared(runtime.store)  # type: ignore[arg-type]
            cases: list[tuple[dict[str, object], type[Exception], str]] = [
                ({"agent_id": "a", "state": "nowhere"}, ConfigurationError, "state"),
                ({"agent_id": "a"}, ConfigurationError, "every=True"),
                (
                    {"agent_id": "a", "state": "idle", "every": True},
                    ConfigurationError,
                    "exactly one",
                ),
                ({"state": "idle"}, ConfigurationError, "loop_id"),
                (
                    {"loop_id": ended, "agent_id": "a", "state": "idle"},
                    ConfigurationError,
                    "agent_id",
                ),
                ({"agent_id": "", "state": "idle"}, ConfigurationError, "agent_id"),
                ({"agent_id": "a", "state": 3}, ConfigurationError, "state"),
                ({"loop_id": "nope", "state": "idle"}, UnknownLoopError, "nope"),
                ({"loop_id": ended, "state": "idle"}, LoopStateError, "ended"),
            ]
            for kwargs, error, named in cases:
                with pytest.raises(error, match=named):
                    await store.add_breakpoint(**kwargs, by="alice")  # type: ignore[arg-type]
            with pytest.raises(ConfigurationError, match="by"):
                await store.add_breakpoint(agent_id="a", state="idle", by=" ")
            with pytest.raises(ConfigurationError, match="by"):
                await store.remove_breakpoint(1, by="")
            with pytest.raises(ConfigurationError, match="breakpoint_id"):
                await store.remove_breakpoint(-1, by="alice")
            with pytest.raises(ConfigurationError, match="agent_id"):
                await store.breakpoints(agent_id=3)  # type: ignore[arg-type]
            assert await store.breakpoints() == []


async def test_a_read_only_sqlite_store_made_before_the_table_lists_none(
    tmp_path: Path,
) -> None:
    """A file of the same layout without the table (made before it): a
    read-only handle lists none and changes none; the first writable
    open adds the table."""
    path = tmp_path / "loops.db"
    async with SQLiteStore(path):
        pass
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE breakpoints")
    async with SQLiteStore(path, read_only=True) as reader:
        assert await reader.breakpoints() == []
        with pytest.raises(StoreError, match="read_only"):
            await reader.add_breakpoint(agent_id="a", state="idle", by="alice")
        with pytest.raises(StoreError, match="read_only"):
            await reader.remove_breakpoint(1, by="alice")
    async with SQLiteStore(path) as writer:
        made = await writer.add_breakpoint(agent_id="a", state="idle", by="alice")
        assert await writer.breakpoints() == [made]


class TestRuntime:
    async def test_a_stored_breakpoint_pauses_a_running_loop_until_removed(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """Set from another handle while the loop runs its first tool: the
        loop pauses before its next tool call, the pause naming the stored
        breakpoint; removed and resumed through the inbox, its later tool
        calls go unpaused."""
        async with Runtime(
            providers={"scripted": running_provider("a", "b", "c")},
            store=store_factory(),
            requests=3600.0,  # only the poke (or a store's notice) wakes it
        ) as runtime:
            loop_id = runtime.run_loop("agent", "go", request_with(wait_for))
            await wait_until(lambda: RAN == ["a"])
            async with store_factory() as ui:
                brk = await shared(ui).add_breakpoint(
                    loop_id=loop_id, state="function_call", by="alice"
                )
                wake(runtime)
                await synced(runtime, {brk.id}, loop_id=loop_id)
                GATES["a"].set()
                seq = await stored_pause_seq(ui, loop_id, 0)
                view = runtime.get(loop_id)
                assert view.status is LoopStatus.paused
                assert RAN == ["a"]  # b waits behind the breakpoint
                reason = view.pause_reason
                assert is_breakpoint_pause(reason)
                assert reason is not None
                assert f"#{brk.id} before function_call, set by alice" in reason
                assert await shared(ui).remove_breakpoint(brk.id, by="bob") is not None
                wake(runtime)
                await synced(runtime, set(), loop_id=loop_id)
                await inbox(ui).submit_request(loop_id, "resume", seq=seq, by="bob")
                wake(runtime)
                await wait_until(lambda: RAN == ["a", "b"])
                GATES["b"].set()
                await wait_until(lambda: RAN == ["a", "b", "c"])  # not paused
                GATES["c"].set()
                with anyio.fail_after(30):
                    result = await runtime.wait(loop_id)
                decisions = await ui.decisions(loop_id)
        assert result.outcome is Outcome.answered
        paused = [d for d in decisions if d.decision.kind == "pause"]
        assert len(paused) == 1
        assert [d.by for d in decisions if d.by is not None] == ["bob"]

    async def test_an_agent_breakpoint_pauses_that_agents_loops_only(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """Set for `billing` while a billing loop and a support loop run their
        first tool: the billing loop (and a billing loop started after) pause
        before their next model request; the support loop never does."""
        async with Runtime(
            providers={
                "billing": running_provider("billing"),
                "support": running_provider("support"),
            },
            store=store_factory(),
            requests=3600.0,
        ) as runtime:
            billing = runtime.run_loop("billing", "go", request_of("billing"))
            await wait_until(lambda: RAN == ["billing"])
            support = runtime.run_loop("support", "go", request_of("support"))
            await wait_until(lambda: RAN == ["billing", "support"])
            async with store_factory() as ui:
                brk = await shared(ui).add_breakpoint(
                    agent_id="billing", state="inference", by="alice"
                )
                wake(runtime)
                await synced(runtime, {brk.id}, agent_id="billing")
                assert stored_ids(runtime, agent_id="support") == set()
                GATES["support"].set()
                with anyio.fail_after(30):
                    answered = await runtime.wait(support)
                GATES["billing"].set()
                seq = await paused_at(runtime, billing)
                reason = runtime.get(billing).pause_reason
                assert reason is not None
                assert f"#{brk.id} before inference" in reason
                pending = runtime.get(billing).pending
                assert pending is not None
                assert pending.dest is LoopState.inference
                later = runtime.run_loop("billing", "again", request_of("billing"))
                await paused_at(runtime, later)
                # A loop started after the breakpoint was set pauses at it too.
                later_reason = runtime.get(later).pause_reason
                assert later_reason is not None
                assert f"#{brk.id} before inference" in later_reason
                await shared(ui).remove_breakpoint(brk.id, by="alice")
                wake(runtime)
                await synced(runtime, set())
                runtime.resume(billing)
                runtime.resume(later)
                with anyio.fail_after(30):
                    billed = await runtime.wait(billing)
                    await runtime.wait(later)
        assert answered.outcome is Outcome.answered
        assert billed.outcome is Outcome.answered
        assert seq > 0

    async def test_step_mode_pauses_before_every_transition(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        async with Runtime(
            providers={"scripted": running_provider("a")},
            store=store_factory(),
            requests=3600.0,
        ) as runtime:
            loop_id = runtime.run_loop("agent", "go", request_with(wait_for))
            await wait_until(lambda: RAN == ["a"])
            async with store_factory() as ui:
                step = await shared(ui).add_breakpoint(
                    loop_id=loop_id, every=True, by="alice"
                )
                wake(runtime)
                await synced(runtime, {step.id}, loop_id=loop_id)
                GATES["a"].set()
                seqs = []
                dests = []
                seq = 0
                for _ in range(2):  # function_call -> inference -> model_message
                    seq = await paused_at(runtime, loop_id, seq)
                    view = runtime.get(loop_id)
                    assert view.pending is not None
                    assert view.pause_reason is not None
                    assert f"#{step.id} every transition" in view.pause_reason
                    seqs.append(seq)
                    dests.append(view.pending.dest)
                    runtime.resume(loop_id)
                seq = await paused_at(runtime, loop_id, seq)
                await shared(ui).remove_breakpoint(step.id, by="alice")
                wake(runtime)
                await synced(runtime, set())
                runtime.resume(loop_id)
                with anyio.fail_after(30):
                    result = await runtime.wait(loop_id)
        assert result.outcome is Outcome.answered
        assert seqs == sorted(set(seqs))
        assert dests == [LoopState.inference, LoopState.model_message]

    async def test_the_breakpoints_given_in_code_are_left_alone(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """Stored breakpoints of the same states and scopes as those given in
        code come and go; those given in code stay, named as not stored."""
        in_code = Break("model_message")
        async with Runtime(
            providers={"scripted": running_provider("a")},
            store=store_factory(),
            requests=3600.0,
            breakpoints=[in_code],
        ) as runtime:
            loop_id = runtime.run_loop("agent", "go", request_with(wait_for))
            await wait_until(lambda: RAN == ["a"])
            runtime.breakpoints.add(Break("inference"), agent_id="agent")
            runtime.breakpoints.add(Break("function_call"), loop_id=loop_id)
            before = runtime.breakpoints.list()
            assert all(s.stored is None for s in before)
            async with store_factory() as ui:
                made = [
                    await shared(ui).add_breakpoint(
                        agent_id="agent", state="inference", by="alice"
                    ),
                    await shared(ui).add_breakpoint(
                        loop_id=loop_id, state="function_call", by="alice"
                    ),
                ]
                wake(runtime)
                await synced(runtime, {b.id for b in made})
                assert len(runtime.breakpoints.list()) == len(before) + 2
                for brk in made:
                    await shared(ui).remove_breakpoint(brk.id, by="alice")
                wake(runtime)
                await synced(runtime, set())
            assert runtime.breakpoints.list() == before
            assert ScopedBreak(in_code) in before
            runtime.breakpoints.step(loop_id, on=False)  # (a no-op: none set)
            runtime.breakpoints.remove(Break("function_call"), loop_id=loop_id)
            runtime.breakpoints.remove(Break("inference"), agent_id="agent")
            runtime.breakpoints.remove(in_code)
            GATES["a"].set()
            with anyio.fail_after(30):
                result = await runtime.wait(loop_id)
        assert result.outcome is Outcome.answered

    async def test_a_loop_breakpoint_of_a_loop_held_elsewhere_is_not_set(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """A breakpoint of a loop this runtime does not hold (another runtime
        does) is left to that runtime: this one's set does not hold it."""
        async with (
            Runtime(
                providers={"scripted": running_provider("a")},
                store=store_factory(),
            ) as holder,
            Runtime(
                providers={"scripted": running_provider()},
                store=store_factory(),
                requests=3600.0,
            ) as watcher,
        ):
            loop_id = holder.run_loop("agent", "go", request_with(wait_for))
            await wait_until(lambda: RAN == ["a"])
            async with store_factory() as ui:
                by_loop = await shared(ui).add_breakpoint(
                    loop_id=loop_id, state="idle", by="alice"
                )
                by_agent = await shared(ui).add_breakpoint(
                    agent_id="agent", state="idle", by="alice"
                )
                wake(watcher)
                await synced(watcher, {by_agent.id})
                assert by_loop.id not in stored_ids(watcher)
            GATES["a"].set()
            with anyio.fail_after(30):
                await holder.wait(loop_id)


def test_a_stored_break_is_frozen() -> None:
    made = StoredBreak.model_validate(
        {"id": 1, "agent_id": "a", "by": "x", "created_at": "2026-01-01T00:00:00Z"}
    )
    assert made.every
    assert made.label == "#1 every transition, set by x"
    with pytest.raises(ValueError, match="frozen"):
        made.by = "y"  # type: ignore[misc]
