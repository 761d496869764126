"""The process tests/test_images_store.py kills: a durable loop whose user
message holds an image and whose tool returns the same image, on a SQLite
store that keeps events, with an event log.

    python images_crash_child.py run DB LOG SIDE_EFFECTS [KILL]
    python images_crash_child.py recover DB LOG SIDE_EFFECTS LOOP_ID

`run` starts the loop and prints its id; with KILL the process SIGKILLs itself
in the middle of the second tool call (after its side effect). `recover` takes
the loop up in a new process (the tool's `on_crash="retry"` runs the call
again), then prints as JSON how it ended, the SHA-256 of every image's bytes
in its stored context, and what replaying it from the store and from the log
reported.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
from pathlib import Path

import anyio

from agentfsm import (
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    ModelContext,
    Runtime,
    tool,
)
from agentfsm.messages import ImageBlock, UserMessage
from agentfsm.providers.function import FunctionProvider
from agentfsm.replay import replay
from agentfsm.store import SQLiteStore
from agentfsm.testing import call, calls, text

DB, LOG, SIDE_EFFECTS = sys.argv[2], sys.argv[3], Path(sys.argv[4])
KILL = sys.argv[1] == "run" and len(sys.argv) > 5

IMAGE = b"\x89PNG\r\n\x1a\n" + random.Random(31).randbytes(200_000)
"""The same bytes in every process (a PNG signature, then noise)."""


def effect(n: int) -> None:
    """The call's side effect (a line), then death in the second call."""
    with SIDE_EFFECTS.open("a") as file:
        file.write(f"look {n}\n")
        file.flush()
        os.fsync(file.fileno())
    if KILL and n == 2:
        os.kill(os.getpid(), signal.SIGKILL)


@tool(on_crash="retry")
async def look(n: int) -> ImageBlock:
    """Look again at the picture."""
    effect(n)
    return ImageBlock.from_bytes(IMAGE)


def model(request: InferenceInput) -> InferenceOutput:
    done = sum(isinstance(i, FunctionCallOutputItem) for i in request.context.items)
    if done < 3:
        return calls(call("look", call_id=f"c{done + 1}", n=done + 1))
    return text("the same picture")


def runtime() -> Runtime:
    return Runtime(
        providers={"script": FunctionProvider(model)},
        store=SQLiteStore(DB, events=True),
        event_log=LOG,
        tools=[look],
    )


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def run() -> None:
    async with runtime() as rt:
        loop_id = rt.run_loop(
            "agent",
            UserMessage(content=["what changed?", ImageBlock.from_bytes(IMAGE)]),
            InferenceInput(model="script:m", context=ModelContext(), tools=[look]),
        )
        say(loop_id)
        await rt.wait(loop_id)


async def recover(loop_id: str) -> None:
    async with runtime() as rt:
        report = await rt.recover()
        assert loop_id in report.recovered, report
        await rt.wait(loop_id)
    async with SQLiteStore(DB, events=True) as store:
        stored = await store.load(loop_id)
        from_store = await replay(store, loop_id=loop_id)
    from_log = await replay(LOG, loop_id=loop_id)
    assert stored is not None
    images: list[str] = []
    for item in stored.items:
        blocks = item.images if hasattr(item, "images") else ()
        images.extend(hashlib.sha256(b.data or b"").hexdigest() for b in blocks)
    say(
        json.dumps(
            {
                "outcome": stored.record.outcome,
                "status": stored.record.status,
                "images": images,
                "replayed": [from_store.describe(), from_log.describe()],
                "diverged": [from_store.diverged, from_log.diverged],
            }
        )
    )


if __name__ == "__main__":
    backend = os.environ.get("AGENTFSM_BACKEND", "asyncio")
    if sys.argv[1] == "run":
        anyio.run(run, backend=backend)
    else:
        anyio.run(recover, sys.argv[5], backend=backend)
