"""The workload on agentfsm, exactly as `bench/bench_loop.py` runs it.

`Runtime.run_loop` + `Runtime.wait` with a `ScriptedProvider(record=False)` and
an async `@agentfsm.tool`; the script, the tool and the checks are
bench_loop.py's own. Nobody subscribes to the bus, so no event is built: the
conditions of the peers and the bare loop, which publish nothing. With
`--subscriber` (run by `run.py` as the subject `agentfsm_observed`) one bus
subscriber drains every event of every run. Run by `run.py` with the python of
`bench/.venvs/agentfsm`.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from harness import Counter, Subject, main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_loop

import agentfsm
from agentfsm import InferenceInput, ModelContext


def outputs(context: ModelContext) -> list[str]:
    return [i.output for i in context.items if i.type == "function_call_output"]


class Runner:
    """A runtime (with its draining subscriber, if any), renewed by `reset` before each round.

    As in bench_loop.py, each timed round gets a fresh `Runtime` (set up outside
    the timed region): a runtime keeps up to `keep_finished` (10,000) finished
    loops for `wait`, and a heap holding thousands of them makes every full
    garbage collection slower (see bench/README.md, "Scaling"). The peers keep
    nothing once a run has returned.
    """

    def __init__(self, subscriber: bool) -> None:
        self.subscriber = subscriber
        self.counter = Counter()  # agentfsm counts tool calls: LoopResult.tool_calls
        self.providers = {
            "scripted": bench_loop.scripted_provider(),
            # Yields once per model call, so concurrent loops are in flight together.
            "checkpoint": bench_loop.CheckpointProvider(bench_loop.scripted_provider()),
        }
        self.models = {False: "scripted:bench", True: "checkpoint:bench"}
        self.stack: AsyncExitStack | None = None
        self.runtime = agentfsm.Runtime()

    async def open(self) -> None:
        stack = self.stack = AsyncExitStack()
        runtime = self.runtime = agentfsm.Runtime(providers=self.providers)
        seen = [0]
        runs = self.counter.n

        def check_events() -> None:
            published = runtime.bus.statistics().published
            loops = (self.counter.n - runs) // 3
            expected = loops * bench_loop.EVENTS_PER_RUN if self.subscriber else 0
            assert seen[0] == published == expected, (seen[0], published, expected)

        stack.callback(check_events)  # once the drain task has ended
        tg = await stack.enter_async_context(anyio.create_task_group())
        await stack.enter_async_context(runtime)
        if self.subscriber:
            tg.start_soon(bench_loop.drain, runtime.bus.subscribe("*"), seen)
        await anyio.lowlevel.checkpoint()

    async def close(self) -> None:
        if self.stack is not None:
            stack, self.stack = self.stack, None
            await stack.aclose()

    async def reset(self) -> None:
        await self.close()
        await self.open()

    def start(self, checkpoint: bool) -> tuple[str, ModelContext]:
        context = ModelContext()
        request = InferenceInput(
            model=self.models[checkpoint], context=context, tools=[bench_loop.add]
        )
        return self.runtime.run_loop("agent", bench_loop.PROMPT, request), context

    async def finish(self, loop_id: str, context: ModelContext) -> None:
        result = await self.runtime.wait(loop_id)
        bench_loop.check(result)  # answered "10", 3 tool calls, 4 model requests
        assert outputs(context) == ["3", "6", "10"], outputs(context)
        self.counter.n += result.tool_calls

    async def one(self, checkpoint: bool) -> None:
        await self.finish(*self.start(checkpoint))

    async def many(self, n: int) -> None:
        # As bench_loop.py: start them all, then wait for each.
        started = [self.start(True) for _ in range(n)]
        for loop_id, context in started:
            await self.finish(loop_id, context)


def subject_maker(name: str, subscriber: bool) -> Any:
    @asynccontextmanager
    async def make_subject() -> AsyncIterator[Subject]:
        runner = Runner(subscriber)
        await runner.open()
        try:
            yield Subject(name, runner.one, runner.many, runner.counter, runner.reset)
        finally:
            await runner.close()

    return make_subject


if __name__ == "__main__":
    observed = "--subscriber" in sys.argv
    if observed:
        sys.argv.remove("--subscriber")
    name = "agentfsm (one subscriber)" if observed else "agentfsm"
    main(
        subject_maker(name, subscriber=observed),
        name=name,
        version=agentfsm.__version__,
        imports=["agentfsm"],
        reference_imports=["pydantic", "anyio", "transitions"],
    )
