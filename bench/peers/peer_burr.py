"""The workload on Apache Burr: actions `model` and `tool` in a graph.

The graph (model -> tool while the last message asks for a tool, else model ->
answer; tool -> model) is built once; each run builds an `Application` on it
with a fresh state and runs it with `arun(halt_after=["answer"])`. The messages live in Burr's
state, which Burr copies on every update. Run by `run.py` (and by
`bench_scaling.py --context`) with `bench/.venvs/burr/bin/python`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version
from typing import Any

from burr.core import ApplicationBuilder, GraphBuilder, State, action, default, expr
from harness import ANSWER, PROMPT, Counter, Subject, main, script_step

Message = dict[str, Any]


def reply(messages: list[Message]) -> Message:
    # Tool results since the last user message (the context may hold older ones).
    n = 0
    for m in reversed(messages):
        if m["role"] == "user":
            break
        n += m["role"] == "tool"
    step = script_step(n)
    if step is None:
        return {"role": "assistant", "content": ANSWER}
    name, args = step
    call = {"id": f"call_{n + 1}", "name": name, "arguments": json.dumps(args)}
    return {"role": "assistant", "tool_calls": [call]}


def build_graph(counter: Counter, checkpoint: bool) -> Any:
    async def add(a: int, b: int) -> int:
        counter.n += 1
        return a + b

    tools = {"add": add}

    @action(reads=["messages"], writes=["messages", "pending"])
    async def model(state: State) -> State:
        if checkpoint:
            await asyncio.sleep(0)
        message = reply(state["messages"])
        return state.append(messages=message).update(pending="tool_calls" in message)

    @action(reads=["messages"], writes=["messages"])
    async def tool(state: State) -> State:
        for tc in state["messages"][-1]["tool_calls"]:
            output = await tools[tc["name"]](**json.loads(tc["arguments"]))
            state = state.append(
                messages={
                    "role": "tool",
                    "tool_call_id": tc["id"],
                    "content": str(output),
                }
            )
        return state

    @action(reads=["messages"], writes=["answer"])
    async def answer(state: State) -> State:
        return state.update(answer=state["messages"][-1]["content"])

    return (
        GraphBuilder()
        .with_actions(model=model, tool=tool, answer=answer)
        .with_transitions(
            ("model", "tool", expr("pending")),
            ("model", "answer", default),
            ("tool", "model", default),
        )
        .build()
    )


def check(messages: list[Message]) -> None:
    assert messages[-1] == {"role": "assistant", "content": ANSWER}, messages[-1]
    outputs = [m["content"] for m in messages[-7:] if m["role"] == "tool"]
    assert outputs == ["3", "6", "10"], outputs


@asynccontextmanager
async def make_subject(context: list[Message] | None = None) -> AsyncIterator[Subject]:
    counter = Counter()
    graphs = {cp: build_graph(counter, cp) for cp in (False, True)}
    before = context or []

    async def one(checkpoint: bool) -> None:
        app = (
            ApplicationBuilder()
            .with_graph(graphs[checkpoint])
            .with_state(
                messages=[*before, {"role": "user", "content": PROMPT}], pending=False
            )
            .with_entrypoint("model")
            .build()
        )
        _, _, state = await app.arun(halt_after=["answer"])
        assert state["answer"] == ANSWER, state["answer"]
        check(state["messages"])

    yield Subject("burr", one, counter=counter)


def context_items(n: int) -> list[Message]:
    """`n` items: user message, tool call, its result, answer, repeated (as
    bench_scaling.py's agentfsm context)."""
    items: list[Message] = []
    for i in range(n):
        k, q = divmod(i, 4)
        if q == 0:
            items.append({"role": "user", "content": f"question {k}"})
        elif q == 1:
            call = {"id": f"old_{k}", "name": "add", "arguments": '{"a":1,"b":2}'}
            items.append({"role": "assistant", "tool_calls": [call]})
        elif q == 2:
            items.append({"role": "tool", "tool_call_id": f"old_{k}", "content": "3"})
        else:
            items.append({"role": "assistant", "content": f"answer {k}"})
    return items


def context_scaling(sizes: list[int], seconds: float) -> dict[str, float]:
    """CPU µs per run with `size` items in the context before the run starts."""

    async def run() -> dict[str, float]:
        out = {}
        for size in sizes:
            async with make_subject(context_items(size)) as subject:
                await subject.run_one(False)
                runs, spent = 0, 0.0
                while spent < seconds or runs < 3:
                    gc.collect()
                    start = time.process_time()
                    await subject.run_one(False)
                    spent += time.process_time() - start
                    runs += 1
            out[str(size)] = spent / runs * 1e6
        return out

    return asyncio.run(run())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--context"]:
        # bench_scaling.py: `--context 10,100,1000 [seconds]` prints JSON.
        sizes = [int(s) for s in sys.argv[2].split(",")]
        seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
        print(json.dumps(context_scaling(sizes, seconds)))
        sys.exit(0)
    main(
        make_subject,
        name="burr",
        version=version("apache-burr"),
        imports=["burr.core"],
    )
