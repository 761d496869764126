"""Ctrl-C in `agentfsm run`: the first stops the run, a second ends the process.

A Python signal handler runs in the main thread even while the event loop is
blocked (an async tool calling `time.sleep`, say). The first Ctrl-C says at
once that the loop is stopping, and writes a byte to a socket the run waits
on, so the run stops from its own task (the handler runs between any two bytecodes, where calling into the
runtime is not safe); the second ends the process at once, without waiting
for anything and without a traceback.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager, suppress
from types import FrameType

import anyio

__all__ = (
    "INTERRUPTED_EXIT",
    "STOPPING",
    "Interrupts",
    "exit_at_interrupt",
    "exit_now",
    "leave_threads",
)

INTERRUPTED_EXIT = 130
"""The exit code of an interrupted run (128 + SIGINT, as shells report it)."""


STOPPING = "\ninterrupted: stopping the loop (Ctrl-C again ends the process at once)\n"
"""What the first Ctrl-C prints at once, from its signal handler."""


def exit_now(code: int) -> None:
    """End the process now: output flushed, no thread waited for, no cleanup."""
    for stream in (sys.stdout, sys.stderr):
        # From a signal handler the stream may be in the middle of a write.
        with suppress(Exception):
            stream.flush()
    os._exit(code)


def leave_threads(code: int, before: Collection[threading.Thread] = ()) -> None:
    """Exit with `code` now if threads the run started are left running (a
    sync tool's past its timeout or its cancel, a model still loading, one
    waiting for the terminal): they are left to finish on their own, as
    docs/how-to/cancellation.md says, and the process does not wait for them.
    Threads in `before` (running when the run began) are not the run's."""
    here = threading.current_thread()
    deadline = time.monotonic() + _IDLE_GRACE
    for thread in threading.enumerate():
        if thread is here or thread.daemon or thread in before:
            continue
        # An idle worker thread of the run's event loop was told to stop when
        # the loop closed and ends at once; a busy one does not.
        thread.join(max(deadline - time.monotonic(), 0))
        if thread.is_alive():
            exit_now(code)


_IDLE_GRACE = 1.0
"""Seconds the run's idle worker threads are given to end (a bound, not a wait:
only a thread still busy takes it all)."""


@contextmanager
def exit_at_interrupt() -> Iterator[None]:
    """Ctrl-C in this block ends the process at once, with "interrupted" and
    `INTERRUPTED_EXIT`, and no traceback: for a command that only reads (a
    store's listing), with nothing to stop cleanly and maybe a thread blocked
    on a server that does not answer. The main thread only (elsewhere Python
    delivers no signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        with suppress(OSError, ValueError):
            os.write(sys.stderr.fileno(), b"\ninterrupted\n")
        exit_now(INTERRUPTED_EXIT)

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Interrupts:
    """Receives Ctrl-C (SIGINT) while installed; `wait` returns at the first."""

    __slots__ = ("_count", "_receive", "_send", "told")

    def __init__(self) -> None:
        self._count = 0
        self.told = False
        """Whether the signal handler said the loop is stopping (its line
        ended the one being written)."""
        self._receive, self._send = socket.socketpair()
        self._send.setblocking(False)

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C was pressed."""
        return self._count > 0

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Handle SIGINT in this block (the main thread only: elsewhere Python
        delivers no signals, and `KeyboardInterrupt` stays as it was)."""
        try:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = signal.signal(signal.SIGINT, self._handle)
            try:
                yield
            finally:
                signal.signal(signal.SIGINT, previous)
        finally:
            self._receive.close()
            self._send.close()

    def interrupt(self) -> None:
        """What Ctrl-C does: the first stops the run (`wait` returns), the
        second ends the process."""
        self._count += 1
        if self._count > 1:
            exit_now(INTERRUPTED_EXIT)
        with suppress(OSError):  # the byte is there already
            self._send.send(b"\0")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._count == 0:
            # Said from here, at once: the run tells more once its task runs,
            # which an async tool blocking the event loop may hold off. A raw
            # write: `sys.stderr` may be in the middle of one of its own.
            with suppress(OSError, ValueError):
                os.write(sys.stderr.fileno(), STOPPING.encode())
                self.told = True
        self.interrupt()

    async def wait(self) -> None:
        """Return once Ctrl-C was pressed."""
        await anyio.wait_readable(self._receive)
