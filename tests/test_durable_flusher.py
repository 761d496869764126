"""The runtime's writer of commits (`agentfsm._durable.flusher`): a commit into
`inference` is not waited for, whoever waits writes the queue in one trip, the
commits land in order, and a failed one fails its loop before any tool runs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    LoopState,
    LoopStatus,
    ModelContext,
    Outcome,
    Runtime,
    current_call,
    tool,
)
from agentfsm.providers.function import FunctionProvider
from agentfsm.store import Commit, LoopLockedError, MemoryStore, SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import wait_until

pytestmark = pytest.mark.anyio

STORE: dict[str, MemoryStore] = {}
SEEN: list[tuple[str, str | None]] = []
"""What `add` found in the ledger when it ran: (its key, the entry's status)."""


@tool
async def add(a: int, b: int) -> int:
    """Add two integers; note what the ledger holds for this call as it runs."""
    key = current_call().idempotency_key
    entries = await STORE["store"].calls(current_call().loop_id, 1)
    SEEN.append((key, next((e.status for e in entries if e.key == key), None)))
    return a + b


@pytest.fixture(autouse=True)
def _clean() -> None:
    SEEN.clear()
    STORE.clear()


class GatedStore(MemoryStore):
    """A store whose writes wait for `gate` (when set), and that notes the
    states of the commits of each trip (`trips`)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: anyio.Event | None = None
        self.trips: list[list[LoopState]] = []
        self.commits: list[Commit] = []
        self.landed: list[LoopState] = []

    async def commit_many(
        self, commits: Sequence[tuple[Commit, str]]
    ) -> list[Exception | None]:
        self.trips.append([c.record.state for c, _ in commits])
        self.commits.extend(c for c, _ in commits)
        if self.gate is not None:
            await self.gate.wait()
        errors = await super().commit_many(commits)
        self.landed.extend(
            c.record.state
            for (c, _), e in zip(commits, errors, strict=True)
            if e is None
        )
        return errors


class FailingStore(MemoryStore):
    """A store that cannot take the commits into `fail_in`."""

    def __init__(self, fail_in: LoopState) -> None:
        super().__init__()
        self.fail_in = fail_in

    async def commit(self, commit: Commit, owner: str) -> None:
        if commit.record.state is self.fail_in:
            raise OSError(f"disk full at seq {commit.record.seq}")
        await super().commit(commit, owner)


def request() -> InferenceInput:
    return InferenceInput(model="scripted:m", context=ModelContext(), tools=[add])


async def test_the_request_goes_out_before_its_commit_lands() -> None:
    """The model is asked while the commit into `inference` is still queued;
    the tool runs only once the commit into `function_call`, with its intent,
    has landed; the two went to the store in one trip."""
    store = STORE["store"] = GatedStore()
    store.gate = anyio.Event()
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(providers={"scripted": provider}, store=store) as runtime:
        loop_id = runtime.run_loop("agent", "add 1 and 2", request())
        await wait_until(lambda: len(provider.requests) == 1)
        assert await store.load(loop_id) is None  # nothing has landed yet
        assert SEEN == []  # and the tool waits for its intent
        store.gate.set()
        with anyio.fail_after(5):
            result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.answered
    assert [status for _, status in SEEN] == ["started"]
    assert store.trips[0] == [LoopState.inference, LoopState.function_call]
    stored = await store.load(loop_id)
    assert stored is not None
    assert stored.record.status is LoopStatus.done


async def test_a_commit_nobody_waits_for_is_written_by_the_runtime() -> None:
    """A request that takes its time: the commit into `inference` lands while
    it is in flight, though the loop never waits for it."""
    store = STORE["store"] = GatedStore()
    answer = anyio.Event()

    async def slow(request: InferenceInput) -> InferenceOutput:
        await answer.wait()
        return text("done")

    async with Runtime(
        providers={"scripted": FunctionProvider(slow)}, store=store
    ) as runtime:
        loop_id = runtime.run_loop("agent", "hi", request())

        await wait_until(lambda: LoopState.inference in store.landed)
        answer.set()
        with anyio.fail_after(5):
            result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.answered


async def test_a_failed_commit_fails_the_loop_before_any_tool_runs() -> None:
    """The commit into `inference` fails (the loop did not wait for it): the
    loop fails at its next write, before the tool it asked for runs; it ends
    in idle with the store's error, and writes nothing after the failure."""
    store = STORE["store"] = FailingStore(LoopState.inference)
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(providers={"scripted": provider}, store=store) as runtime:
        loop_id = runtime.run_loop("agent", "add 1 and 2", request())
        with anyio.fail_after(5):
            result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.failed
    assert result.reason is not None
    assert "disk full at seq 3" in result.reason  # the commit into `inference`
    assert SEEN == []  # the tool never ran
    assert len(provider.requests) == 1
    assert runtime.get(loop_id).state is LoopState.idle
    assert await store.load(loop_id) is None  # nothing landed after it


async def test_commits_land_in_order_and_none_after_a_failed_one_of_its_loop(
    tmp_path: Path,
) -> None:
    """`commit_many` (SQLite: one trip): a loop whose commit fails writes none
    of its later ones; another loop's commits in the same trip land."""
    store = STORE["store"] = GatedStore()
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("a"), text("b")])},
        store=store,
    ) as runtime:
        first = runtime.run_loop("agent", "one", request())
        second = runtime.run_loop("agent", "two", request())
        with anyio.fail_after(5):
            await runtime.wait(first)
            await runtime.wait(second)
    # Every commit the two loops made, replayed into a SQLite store in one trip,
    # after another owner took the first loop's lease.
    commits = [
        (commit, "me")
        for loop_id in (first, second)
        for commit in store.commits
        if commit.record.loop_id == loop_id
    ]
    sqlite = SQLiteStore(tmp_path / "loops.db")
    async with sqlite:
        await sqlite.commit(commits[0][0], "someone else")
        errors = await sqlite.commit_many(commits)
        ours = [
            e
            for (c, _), e in zip(commits, errors, strict=True)
            if c.record.loop_id == first
        ]
        theirs = [
            e
            for (c, _), e in zip(commits, errors, strict=True)
            if c.record.loop_id == second
        ]
        assert all(isinstance(e, LoopLockedError) for e in ours)
        assert len({id(e) for e in ours}) == 1  # the first one's, for the rest
        assert theirs == [None] * len(theirs)
        kept = await sqlite.load(first)
        assert kept is not None
        assert kept.record.seq == commits[0][0].record.seq
        done = await sqlite.load(second)
        assert done is not None
        assert done.record.status is LoopStatus.done


async def test_a_failed_commit_nobody_waited_for_stops_the_next_turn() -> None:
    """A loop of answers and follow-ups waits for no write until its end: a
    failed commit into `inference` fails it at its next commit, before it
    sends another request."""
    store = STORE["store"] = FailingStore(LoopState.inference)
    sent: list[InferenceInput] = []

    async def model(request: InferenceInput) -> InferenceOutput:
        sent.append(request)
        await anyio.sleep(0.001)  # a request in flight: the event loop runs on
        return text(f"answer {len(sent)}")

    async with Runtime(
        providers={"scripted": FunctionProvider(model)}, store=store
    ) as runtime:
        loop_id = runtime.run_loop("agent", "hi", request())
        runtime.follow_up(loop_id, "and then?")
        runtime.follow_up(loop_id, "and then?")
        with anyio.fail_after(5):
            result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.failed
    assert result.reason is not None
    assert "disk full at seq 3" in result.reason
    assert len(sent) == 1
