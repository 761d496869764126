"""The seam an instrument (`agentfsm.otel.OpenTelemetry`) plugs into a runtime.

`Runtime(instrument=...)` calls these three hooks, and nothing else; without an
instrument each costs the runtime one `is None` check. They are called with the
internal `Loop`, so an instrument is part of the library, not a user's plug-in.

- `start_run(loop, start)`: the runtime is handing `loop` to a worker (its first
  run, a resume, or a cancel that ends a paused loop). It must call
  `start(loop)`, exactly once; for a resume, `start` also applies the decision
  (so the loop is still paused when the hook is called). Workers run a loop in a copy of the context
  current during `start`, so a context variable set around that call (OTel's
  current span) is what the run sees, and the caller's context is left as it was.
- `run_ended(loop)`: a run of `loop` returned (the loop ended, or paused).
- `loop_ended(loop)`: `loop` ended; in its run, or without one (a paused loop
  that the runtime's closing or its deadline ended).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from agentfsm._loop import Loop

__all__ = ("Instrument",)


@runtime_checkable
class Instrument(Protocol):
    """Hooks a runtime calls around its loops' runs (see the module)."""

    def start_run(self, loop: Loop, start: Callable[[Loop], None], /) -> None:
        """Hand `loop` to a worker by calling `start(loop)`."""
        ...

    def run_ended(self, loop: Loop, /) -> None:
        """A run of `loop` returned (it ended or paused)."""
        ...

    def loop_ended(self, loop: Loop, /) -> None:
        """`loop` ended (its outcome is set)."""
        ...
