"""The process tests/test_durable_storm.py SIGKILLs: many durable loops of a
scripted workload with side-effecting tools, on one store.

    python durable_storm_child.py start CONFIG
    python durable_storm_child.py recover CONFIG

CONFIG is JSON: `kind` (`sqlite`, `sqlite-events`, `postgres` or
`postgres-events`), `path`
(the SQLite file) or `conninfo` and `schema` (PostgreSQL), `dir` (where the
logs below are), `round` (this process's number in the storm), `first` and
`wave` (the indexes of the new loops it starts: `wave` from `first` on) and
`backend` (`asyncio` or `trio`).

`recover` first calls `Runtime.recover()`, then starts again, under a new id,
each loop whose first commit never landed (the store does not hold it: a
client sending its request again). Both modes then start their wave of new
loops, resolve every pause as an operator would, wait for every loop, and
exit 0. Each prints `go` as it starts its work (the test times its kill from
there); SIGUSR1 dumps every thread's stack to stderr (a hung round).

Everything that happened is appended to JSON-lines files in `dir`, a line
per `os.write` (one line is one write: a kill never leaves half of one),
fsynced before the process goes on:

- `loops.jsonl`: each loop started (`index`, `loop`), before `run_loop`;
- `effects.jsonl`: each tool execution (`loop`, `call_id`, `tool`, `key`:
  `current_call().idempotency_key`), written in the middle of the call,
  before it returns;
- `requests.jsonl`: each model request served (`loop`, `n`: the request's
  number, from its context), before the answer;
- `decisions.jsonl`: each pause the operator is asked about (`asked`: the
  loop, the kind, the batch's call ids, the uncertain calls with the
  ledger's attempt, the loop's seq), then the decision (`given`), before
  `resume`;
- `results.jsonl`: each loop's outcome as `wait()` reports it (or as
  `recover()` reports a loop it failed).

Every line carries the process's `round`.

The workload: loop `index` runs `SCRIPTS[index % 4]`: three or four model
requests, each a batch of calls (parallel or sequential, some beyond the
loop's `max_tool_concurrency`) of three tools: `retry_step`
(`on_crash="retry"`), `pause_step` (the default, pause on a crash) and
`approve_step` (`needs_approval=True`); then an answer. The model's answer
depends only on the request's context, so any process continues any loop.
The tools and the model sleep a little (a deterministic time per call), so
that a kill can land in the middle of each.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio

from agentfsm import (
    FunctionCallItem,
    InferenceInput,
    InferenceOutput,
    LoopStatus,
    ModelContext,
    Proceed,
    Rewrite,
    Runtime,
    ToolBatch,
    UserMessage,
    current_call,
    current_loop_id,
    tool,
)
from agentfsm.providers.function import FunctionProvider
from agentfsm.store import LoopStore, SQLiteStore
from agentfsm.testing import call, calls, text

__all__ = (
    "SCRIPTS",
    "TOOL_POLICY",
    "Step",
    "denied",
    "loop_id_of",
    "open_store",
    "output_of",
    "script_of",
)

# ------------------------------------------------------------------ workload

RETRY, PAUSE, APPROVE = "retry_step", "pause_step", "approve_step"
TOOL_POLICY = {RETRY: "retry", PAUSE: "pause", APPROVE: "pause"}
"""Each tool's `on_crash` policy (`approve_step` needs approval too)."""


@dataclass(frozen=True)
class Step:
    """One model request's answer: a batch of calls `(tool, call_id)`, or
    (none) the final text."""

    calls: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Script:
    steps: tuple[Step, ...]
    """Each request's answer, the last one the final text."""
    execution: Literal["sequential", "parallel"]
    """The loop's `tool_execution`."""
    concurrency: int = 8
    """The loop's `max_tool_concurrency`."""


def _batch(n: int, *names: str) -> Step:
    """Request `n`'s batch: call ids `s<n>-<letter><j>` (unique in a loop)."""
    counts: dict[str, int] = {}
    items = []
    for name in names:
        counts[name] = counts.get(name, 0) + 1
        items.append((name, f"s{n}-{name[0]}{counts[name]}"))
    return Step(tuple(items))


SCRIPTS = (
    Script(
        (
            _batch(1, RETRY, PAUSE),
            _batch(2, APPROVE, RETRY, PAUSE),
            _batch(3, PAUSE),
            Step(),
        ),
        "parallel",
    ),
    Script(
        (
            _batch(1, PAUSE, RETRY, PAUSE),
            _batch(2, RETRY),
            _batch(3, APPROVE, APPROVE),
            Step(),
        ),
        "sequential",
    ),
    Script(
        (
            _batch(1, APPROVE),
            _batch(2, PAUSE, PAUSE, RETRY, RETRY),
            Step(),
        ),
        "parallel",
    ),
    # More calls than `max_tool_concurrency`: no intent goes with the commit
    # into `function_call`, each call writes its own as it starts.
    Script(
        (
            _batch(1, RETRY, PAUSE, RETRY, PAUSE),
            _batch(2, APPROVE, PAUSE),
            _batch(3, RETRY),
            Step(),
        ),
        "parallel",
        concurrency=2,
    ),
)


def script_of(index: int) -> Script:
    return SCRIPTS[index % len(SCRIPTS)]


def loop_id_of(index: int, round_: int) -> str:
    """The id of loop `index` started by the process of `round_`."""
    return f"storm-{index:03d}-r{round_}"


def output_of(tool_name: str, call_id: str) -> str:
    """What a call returns (an operator answering it gives the same)."""
    return f"{tool_name} done {call_id}"


def denied(loop_id: str, call_id: str) -> bool:
    """Whether the operator denies this call awaiting approval (a third of them)."""
    return zlib.crc32(f"{loop_id}/{call_id}".encode()) % 3 == 0


def _pause(key: str, scale: float) -> float:
    """A deterministic sleep of up to `scale` seconds for `key`."""
    if CONFIG.get("warming"):
        return 0
    return (zlib.crc32(key.encode()) % 1000) / 1000 * scale


# --------------------------------------------------------------------- files

CONFIG: dict[str, Any] = {}
_FILES: dict[str, int] = {}


def log(name: str, **fields: Any) -> None:
    """Append a line to `<dir>/<name>.jsonl` in one write, and fsync it."""
    if CONFIG.get("warming"):
        return
    fd = _FILES.get(name)
    if fd is None:
        path = Path(CONFIG["dir"]) / f"{name}.jsonl"
        fd = _FILES[name] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    fields = {"round": CONFIG["round"], "time": round(time.time(), 4), **fields}
    line = json.dumps(fields, sort_keys=True) + "\n"
    data = line.encode()
    assert os.write(fd, data) == len(data)
    os.fsync(fd)


def read_log(name: str) -> list[dict[str, Any]]:
    path = Path(CONFIG["dir"]) / f"{name}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------- tools


async def side_effect(tool_name: str, tag: str) -> str:
    running = current_call()
    await anyio.sleep(_pause(f"{running.loop_id}/{tag}/before", 0.02))
    log(
        "effects",
        loop=running.loop_id,
        call_id=running.call_id,
        tool=tool_name,
        key=running.idempotency_key,
    )
    await anyio.sleep(_pause(f"{running.loop_id}/{tag}/after", 0.03))
    return output_of(tool_name, tag)


@tool(on_crash="retry")
async def retry_step(tag: str) -> str:
    """An idempotent step: it runs again after a crash."""
    return await side_effect(RETRY, tag)


@tool
async def pause_step(tag: str) -> str:
    """A step that must not run twice: a crash in it pauses the loop."""
    return await side_effect(PAUSE, tag)


@tool(needs_approval=True)
async def approve_step(tag: str) -> str:
    """A step a person approves first."""
    return await side_effect(APPROVE, tag)


TOOLS = [retry_step, pause_step, approve_step]

# --------------------------------------------------------------------- model


def request_number(items: list[Any]) -> int:
    """The request's number: one more than the batches in its context."""
    steps = {i.call_id.split("-")[0] for i in items if isinstance(i, FunctionCallItem)}
    return len(steps) + 1


async def model(request: InferenceInput) -> InferenceOutput:
    """The script's answer for this point of the conversation, whichever
    process asks: the loop's script from its first message, the step from the
    batches its context holds."""
    items = list(request.context.items)
    first = items[0]
    assert isinstance(first, UserMessage)
    index = int(str(first.content).split()[-1])
    loop_id = current_loop_id()
    n = request_number(items)
    log("requests", loop=loop_id, n=n)
    await anyio.sleep(_pause(f"{loop_id}/{n}/model", 0.015))
    steps = script_of(index).steps
    if n > len(steps):
        return text(f"off script: request {n}")
    step = steps[n - 1]
    if not step.calls:
        return text(f"done {index}")
    return calls(*(call(name, call_id=cid, tag=cid) for name, cid in step.calls))


# ------------------------------------------------------------------- runtime


def open_store(config: dict[str, Any]) -> LoopStore:
    kind = config["kind"]
    events = kind.endswith("-events")
    if kind.startswith("postgres"):
        from agentfsm.store.postgres import PostgresStore

        return PostgresStore(
            config["conninfo"], schema=config["schema"], events=events, lease_ttl=5
        )
    return SQLiteStore(config["path"], events=events, lease_ttl=5)


class Ids:
    """The runtime's id source: the id the next `run_loop` takes."""

    def __init__(self) -> None:
        self.next = ""

    def __call__(self) -> str:
        return self.next


def start(runtime: Runtime, ids: Ids, index: int, loop_id: str = "") -> str:
    loop_id = ids.next = loop_id or loop_id_of(index, CONFIG["round"])
    log("loops", index=index, loop=loop_id)
    script = script_of(index)
    runtime.run_loop(
        "storm",
        f"storm loop {index}",
        InferenceInput(model="script:m", context=ModelContext(), tools=list(TOOLS)),
        tool_execution=script.execution,
        max_tool_concurrency=script.concurrency,
    )
    return loop_id


_UNCERTAIN = re.compile(r"(\S+) \((\w+)\)")


async def decide(runtime: Runtime, store: LoopStore, loop_id: str) -> None:
    """Resolve a paused loop as an operator would, logging the question and
    the decision first: approvals by `denied`; calls whose outcome is
    uncertain answered with their output when their side effect happened
    (the effects file says), else run (Proceed)."""
    view = runtime.get(loop_id)
    batch = view.pending.payload if view.pending is not None else None
    reason = view.pause_reason or ""
    assert isinstance(batch, ToolBatch), (loop_id, reason, batch)
    seq = runtime.snapshot(loop_id).seq
    ids = [c.call_id for c in batch.calls]
    uncertain: dict[str, int] = {}
    if reason.startswith("uncertain tool outcome"):
        kind = "uncertain"
        named = reason.split(" started and ")[0]
        ledger = {c.call_id: c for c in await store.calls(loop_id, view.model_requests)}
        for call_id, _ in _UNCERTAIN.findall(named):
            uncertain[call_id] = ledger[call_id].attempt if call_id in ledger else 0
    elif reason.startswith("approval required"):
        kind = "approval"
    else:
        raise AssertionError(f"loop {loop_id} paused for {reason!r}")
    question = {
        "loop": loop_id,
        "kind": kind,
        "calls": ids,
        "uncertain": uncertain,
        "awaiting": list(batch.awaiting_approval),
        "seq": seq,
        "reason": reason,
    }
    log("decisions", type="asked", **question)
    answered: dict[str, str] = {}
    refused: list[str] = []
    if kind == "uncertain":
        ran = {
            e["call_id"]
            for e in read_log("effects")
            if e["loop"] == loop_id and e["call_id"] in uncertain
        }
        names = {c.call_id: c.name for c in batch.calls}
        for call_id in uncertain:
            if call_id in ran:
                answered[call_id] = output_of(names[call_id], call_id)
                batch = batch.answer(call_id, answered[call_id])
    else:
        for call_id in batch.awaiting_approval:
            if denied(loop_id, call_id):
                refused.append(call_id)
                batch = batch.deny(call_id, "the operator said no")
    log(
        "decisions",
        type="given",
        answered=answered,
        denied=refused,
        **question,
    )
    runtime.resume(
        loop_id, Rewrite(payload=batch) if answered or refused else Proceed()
    )


async def operate(runtime: Runtime, store: LoopStore) -> None:
    """Resolve every pause, as it comes (until cancelled)."""
    while True:
        for loop_id in runtime.loops(status=LoopStatus.paused):
            await decide(runtime, store, loop_id)
        await anyio.sleep(0.005)


async def report(runtime: Runtime, loop_id: str) -> None:
    result = await runtime.wait(loop_id)
    log(
        "results",
        loop=loop_id,
        outcome=result.outcome.value,
        reason=result.reason,
        error=None if result.error is None else result.error.message,
    )


async def run_all(runtime: Runtime, store: LoopStore, loops: list[str]) -> None:
    """Wait for every loop (reporting each outcome), resolving the pauses."""
    async with anyio.create_task_group() as operator:
        operator.start_soon(operate, runtime, store)
        async with anyio.create_task_group() as waiters:
            for loop_id in loops:
                waiters.start_soon(report, runtime, loop_id)
        operator.cancel_scope.cancel()


async def warm_up() -> None:
    """Run a loop of each script first, logging nothing and sleeping nowhere,
    on a store of its own: the modules and models a loop uses the first time
    are ready before `go`, so that a kill soon after it lands in the work."""
    CONFIG["warming"] = True
    ids = Ids()
    path = Path(CONFIG["dir"]) / f"warm-up-{CONFIG['round']}.db"
    store = SQLiteStore(path, events=CONFIG["kind"].endswith("-events"))
    async with Runtime(
        providers={"script": FunctionProvider(model)}, store=store, ids=ids
    ) as runtime:
        loops = [start(runtime, ids, i, f"warm-up-{i}") for i in range(len(SCRIPTS))]
        await run_all(runtime, store, loops)
    CONFIG["warming"] = False


async def main(mode: str) -> None:
    await warm_up()
    store = open_store(CONFIG)
    ids = Ids()
    async with Runtime(
        providers={"script": FunctionProvider(model)},
        store=store,
        tools=TOOLS,
        ids=ids,
    ) as runtime:
        say("go")
        log("marks", mark="go")
        loops: list[str] = []
        if mode == "recover":
            with anyio.fail_after(60):
                while True:
                    recovered = await runtime.recover()
                    loops += recovered.recovered
                    for loop_id, error in recovered.failed.items():
                        log("results", loop=loop_id, outcome="failed", error=error)
                    if not recovered.locked:
                        break
                    await anyio.sleep(0.2)  # a lease not yet known to be dead
            latest: dict[int, str] = {}
            for line in read_log("loops"):
                latest[line["index"]] = line["loop"]
            for index, loop_id in sorted(latest.items()):
                if await store.load(loop_id) is None:  # its first commit never landed
                    loops.append(start(runtime, ids, index))
        first = CONFIG["first"]
        loops += [start(runtime, ids, i) for i in range(first, first + CONFIG["wave"])]
        await run_all(runtime, store, loops)
    say("done")


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    CONFIG.update(json.loads(sys.argv[2]))
    anyio.run(main, sys.argv[1], backend=CONFIG["backend"])
