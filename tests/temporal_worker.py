"""A worker in a process of its own, for the crash test of tests/test_temporal.py:
`python -m tests.temporal_worker <address> <task_queue>`; prints `ready` once
it polls. The test kills it with SIGKILL in the middle of a tool call."""

from __future__ import annotations

import asyncio  # noqa: TID251 - temporalio's workers run on asyncio
import os
import sys
from datetime import timedelta

from temporalio.client import Client

from agentfsm.temporal import worker
from tests.temporal_agents import AGENTS, PROVIDERS


async def main(address: str, task_queue: str) -> None:
    client = await Client.connect(address)
    # A short sticky timeout: once this worker is gone, its workflow's next
    # task goes to the normal queue (another worker) after 1 s, not 10 s.
    async with worker(
        client,
        task_queue=task_queue,
        agents=AGENTS,
        providers=PROVIDERS,
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=1),
    ):
        print("ready", flush=True)  # noqa: T201 - the test waits for it
        await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(main(sys.argv[1], sys.argv[2]))
    finally:
        os._exit(0)  # temporalio's core threads would keep the process alive
